/* The API-shape layer (api.h): OpenAI chat / completions / Responses and
 * Anthropic request bodies in, response / SSE / error bodies out.
 *
 * Who owns what: this file reads every api's request body into the neutral
 * conversation of template.h (kvt_chat: turns, tool calls, the function
 * tools in canonical form, the thinking-mode request) and hands it to the
 * model's template (kvt_template_for), which renders the prompt. The chat
 * templates, every marker and fixed text they write, the tool-call parser
 * of generated text and the thinking split are template.c's; this file
 * knows no marker. What stays here is the api side: the request fields, the
 * canonical JSON of tool definitions and call arguments (request content),
 * the volatile-line filter, and the response shapes, which place a reply's
 * reasoning and tool calls where each api expects them.
 *
 * Why it is shaped so:
 *  - Parsing is strict about what the server uses and lenient about the rest.
 *    Clients send many fields we have no use for (metadata, user, store,
 *    prompt_cache_key, item ids, ...): those are ignored. A field we do use
 *    with a wrong type or range is a 400 naming the field, because silently
 *    falling back to a default would hide a client bug. Content we cannot
 *    honour (images, audio, n > 1, a reference to a stored response) is a 400
 *    too: answering as if it were not there would be a wrong answer, not a
 *    degraded one.
 *  - Prompt reuse: a conversation resent with one more turn must render to a
 *    string that extends the previous rendering (the templates see to the
 *    markers). Here that means message text is kept byte for byte, tool
 *    definitions and call arguments are re-serialised in one canonical JSON
 *    form (whatever key order and whitespace the client used), per-request
 *    metadata never enters the conversation, volatile lines clients inject
 *    into system text are dropped, and the replay hook is passed on so that
 *    a tool call the server sampled renders back with the bytes it sampled.
 *  - A thinking-mode reply (REASONING</think>ANSWER, split by
 *    kvt_think_split) goes to the api's own place for reasoning
 *    (reasoning_content, a thinking block), nothing trimmed, so that the
 *    reasoning a client sends back with the turn renders to the bytes the
 *    model sampled; tool calls are read from the answer only, with the
 *    parser of the template that rendered the prompt.
 *  - Output JSON is built with jansson and dumped compact (one line, which an
 *    SSE "data:" field needs). Generated text may hold invalid UTF-8 (a byte
 *    token, a cut character); it is repaired to U+FFFD, never dropped whole.
 *
 * docs/API.md is the user-facing description of all of this.
 */
#include "serve/api.h"
#include "base/buf.h"
#include "base/jsonstr.h"
#include "chat/template.h"
#include "base/util.h"

#include <float.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define LIT(s) (sizeof(s "") - 1)

/* System text lines that clients inject without meaning for the model and
 * that change from request to request (a per-prompt hash): dropped from the
 * prompt unless kvt_parse_opts.keep_volatile. Matched at a line start,
 * case-insensitively. */
static const char *const volatile_prefixes[] = {
    "x-anthropic-billing-header:",
};

/* ---- parse errors --------------------------------------------------------- */

static int bad(int *status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* A client error: 400 with a message for the client. */
static int bad(int *status, const char *fmt, ...)
{
    char msg[480];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    *status = 400;
    return kvt_fail(KVT_EINVAL, "%s", msg);
}

static int oom(int *status)
{
    *status = 500;
    return kvt_fail(KVT_ENOMEM, "out of memory while reading the request");
}

static const char *type_name(const json_t *v)
{
    if (!v) return "nothing";
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE: case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "something else";
}

/* A field; null counts as absent (clients send null for "unset"). */
static json_t *field(const json_t *obj, const char *key)
{
    json_t *v = json_object_get(obj, key);
    return json_is_null(v) ? NULL : v;
}

static int get_bool(const json_t *root, const char *key, bool *out, int *status)
{
    json_t *v = field(root, key);
    if (!v) return KVT_OK;
    if (!json_is_boolean(v)) return bad(status, "\"%s\": expected a boolean, got %s", key, type_name(v));
    *out = json_is_true(v);
    return KVT_OK;
}

static int get_float(const json_t *root, const char *key, double lo, double hi, float *out,
                     bool *present, int *status)
{
    json_t *v = field(root, key);
    if (present) *present = v != NULL;
    if (!v) return KVT_OK;
    if (!json_is_number(v)) return bad(status, "\"%s\": expected a number, got %s", key, type_name(v));
    double d = json_number_value(v);
    if (!(d >= lo && d <= hi)) return bad(status, "\"%s\": %g is outside [%g, %g]", key, d, lo, hi);
    *out = (float)d;
    return KVT_OK;
}

/* An integer in [lo, hi]. A real with an integral value (256.0) is accepted:
 * some clients' JSON encoders write every number that way. */
static int get_int(const json_t *root, const char *key, int64_t lo, int64_t hi, int64_t *out,
                   bool *present, int *status)
{
    json_t *v = field(root, key);
    if (present) *present = v != NULL;
    if (!v) return KVT_OK;
    int64_t x;
    if (json_is_integer(v)) {
        x = (int64_t)json_integer_value(v);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
               fabs(json_real_value(v)) < 9.2e18) {
        x = (int64_t)json_real_value(v);
    } else {
        return bad(status, "\"%s\": expected an integer, got %s", key, type_name(v));
    }
    if (x < lo || x > hi)
        return bad(status, "\"%s\": %lld is outside [%lld, %lld]", key, (long long)x, (long long)lo,
                   (long long)hi);
    *out = x;
    return KVT_OK;
}

/* A string field of an object nested somewhere (where names it), or NULL
 * when absent; anything but a string is a 400. */
static int get_str(const json_t *obj, const char *key, const char *where, bool required, const json_t **out,
                   int *status)
{
    json_t *v = field(obj, key);
    *out = NULL;
    if (!v) return required ? bad(status, "\"%s.%s\": required", where, key) : KVT_OK;
    if (!json_is_string(v)) return bad(status, "\"%s.%s\": expected a string, got %s", where, key, type_name(v));
    *out = v;
    return KVT_OK;
}

/* ---- canonical JSON ------------------------------------------------------- */

/* One serialisation per JSON value, so that the same tool schema or call
 * arguments render to the same prompt bytes whatever key order, whitespace
 * and number spelling the client used: compact, object keys sorted by byte
 * value (code point order), strings with only the escapes JSON requires (",
 * \, and control characters; everything else as UTF-8, which is how jansson
 * writes them too), integers in decimal, reals in the shortest %g form that
 * reads back to the same double (0.95, not 0.94999999999999996). The
 * string text is jsonstr.c's, shared with the templates. */

static int cmp_key(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Append v canonically; sets b->oom on failure. skip_schema drops the
 * object's own "$schema" key (a tool's parameters: the JSON Schema dialect
 * URL some clients add is no information for the model). jansson bounds the
 * nesting depth of what it parsed, so the recursion is bounded too. */
static void canon(kvt_wbuf *b, const json_t *v, bool skip_schema)
{
    char num[40];
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        size_t n = json_object_size(v), k = 0;
        const char **keys = n ? malloc(n * sizeof *keys) : NULL;
        if (n && !keys) { b->oom = true; return; }
        const char *key;
        json_t *x;
        json_object_foreach((json_t *)v, key, x) keys[k++] = key;
        if (k > 1) qsort(keys, k, sizeof *keys, cmp_key);
        kvt_wbuf_put(b, "{", 1);
        bool first = true;
        for (size_t i = 0; i < k; i++) {
            if (skip_schema && !strcmp(keys[i], "$schema")) continue;
            if (!first) kvt_wbuf_put(b, ",", 1);
            first = false;
            kvt_json_string(b, keys[i], strlen(keys[i]));
            kvt_wbuf_put(b, ":", 1);
            canon(b, json_object_get(v, keys[i]), false);
        }
        kvt_wbuf_put(b, "}", 1);
        free(keys);
        return;
    }
    case JSON_ARRAY: {
        kvt_wbuf_put(b, "[", 1);
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i) kvt_wbuf_put(b, ",", 1);
            canon(b, json_array_get(v, i), false);
        }
        kvt_wbuf_put(b, "]", 1);
        return;
    }
    case JSON_REAL: {
        double d = json_real_value(v); /* finite: jansson refuses overflow */
        for (int p = 1; p <= 17; p++) {
            snprintf(num, sizeof num, "%.*g", p, d);
            if (strtod(num, NULL) == d) break;
        }
        kvt_wbuf_puts(b, num);
        return;
    }
    default: kvt_json_scalar(b, v); return;
    }
}

/* ---- stop sequences ------------------------------------------------------- */

/* OpenAI "stop" (a string or an array) or Anthropic "stop_sequences" (an
 * array). Empty strings are dropped: they could never match meaningfully. */
static int parse_stop(kvt_request *r, const json_t *root, const char *key, bool allow_string,
                      size_t max, int *status)
{
    json_t *v = field(root, key);
    if (!v) return KVT_OK;
    size_t n;
    if (json_is_string(v) && allow_string) n = 1;
    else if (json_is_array(v)) n = json_array_size(v);
    else return bad(status, "\"%s\": expected %s, got %s", key,
                    allow_string ? "a string or an array of strings" : "an array of strings", type_name(v));
    if (n > max) return bad(status, "\"%s\": at most %zu stop sequences are supported, got %zu", key, max, n);
    if (n == 0) return KVT_OK;
    r->stop = kvt_calloc(n, sizeof *r->stop);
    if (!r->stop) return oom(status);
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_is_array(v) ? json_array_get(v, i) : v;
        if (!json_is_string(s)) return bad(status, "\"%s[%zu]\": expected a string, got %s", key, i, type_name(s));
        if (json_string_length(s) == 0) continue;
        if (!(r->stop[r->n_stop] = kvt_strndup(json_string_value(s), json_string_length(s)))) return oom(status);
        r->n_stop++;
    }
    return KVT_OK;
}

/* ---- the conversation ----------------------------------------------------- */

/* The conversation is read into template.h's kvt_chat, which the model's
 * template renders; chat is that and how to read it. */
typedef struct chat {
    kvt_chat c;
    bool keep_volatile; /* kvt_parse_opts.keep_volatile */
} chat;

/* Append a turn with empty text; NULL on out of memory. */
static kvt_turn *chat_push(chat *ch, int role)
{
    if (ch->c.n == ch->c.cap) {
        size_t cap = ch->c.cap ? ch->c.cap * 2 : 8, bytes; /* cap <= 2 x the turns the body holds + 8 */
        kvt_turn *t = kvt_mul_ok(cap, sizeof *t, &bytes) ? realloc(ch->c.t, bytes) : NULL;
        if (!t) return NULL;
        ch->c.t = t;
        ch->c.cap = cap;
    }
    char *empty = kvt_strndup("", 0);
    if (!empty) return NULL;
    kvt_turn *t = &ch->c.t[ch->c.n++];
    *t = (kvt_turn){.role = role, .text = empty};
    return t;
}

/* Give t the bytes of b (consumed, also on failure). */
static int turn_take(kvt_turn *t, kvt_wbuf *b, int *status)
{
    kvt_wbuf_put(b, "", 1); /* NUL: b->p is never NULL afterwards */
    if (b->oom) { kvt_wbuf_free(b); return oom(status); }
    free(t->text);
    t->text = (char *)b->p;
    t->len = b->len - 1;
    *b = (kvt_wbuf){0};
    return KVT_OK;
}

/* Add a tool call to assistant turn t; args (the canonical or verbatim
 * arguments) and the reference argv (may be NULL) are consumed. */
static int turn_call(kvt_turn *t, const json_t *id, const char *ns, const char *name, size_t name_len, kvt_wbuf *args,
                     bool args_json, json_t *argv, int *status)
{
    kvt_turn_call c = {.args_json = args_json, .argv = argv};
    kvt_wbuf_put(args, "", 1);
    kvt_wbuf qn = {0};
    if (ns) {
        kvt_wbuf_puts(&qn, ns);
        kvt_wbuf_puts(&qn, KVT_API_NS_SEP);
    }
    kvt_wbuf_put(&qn, name, name_len);
    kvt_wbuf_put(&qn, "", 1);
    c.name = (char *)qn.p;
    c.args = (char *)args->p;
    c.args_len = args->len - 1;
    if (id && !(c.id = kvt_strndup(json_string_value(id), json_string_length(id)))) args->oom = true;
    if (t->n_calls == t->cap_calls && !args->oom && !qn.oom) {
        size_t cap = t->cap_calls ? t->cap_calls * 2 : 4, bytes;
        kvt_turn_call *p = kvt_mul_ok(cap, sizeof *p, &bytes) ? realloc(t->calls, bytes) : NULL;
        if (!p) args->oom = true;
        else { t->calls = p; t->cap_calls = cap; }
    }
    if (args->oom || qn.oom) {
        free(c.id);
        kvt_wbuf_free(&qn);
        kvt_wbuf_free(args);
        json_decref(argv);
        return oom(status);
    }
    t->calls[t->n_calls++] = c;
    *args = (kvt_wbuf){0};
    return KVT_OK;
}

/* ---- text of content ------------------------------------------------------ */

static bool volatile_line(const char *s, size_t n)
{
    for (size_t i = 0; i < sizeof volatile_prefixes / sizeof *volatile_prefixes; i++) {
        size_t k = strlen(volatile_prefixes[i]);
        if (n >= k && !strncasecmp(s, volatile_prefixes[i], k)) return true;
    }
    return false;
}

/* s without its volatile lines (each with its newline) into out, when it
 * has one (true); false, out untouched, when it has none. */
static bool strip_volatile(kvt_wbuf *out, const char *s, size_t n)
{
    bool any = false;
    for (size_t i = 0; i < n && !any;) {
        const char *nl = memchr(s + i, '\n', n - i);
        size_t end = nl ? (size_t)(nl - s) + 1 : n;
        any = volatile_line(s + i, end - i);
        i = end;
    }
    if (!any) return false;
    for (size_t i = 0; i < n;) {
        const char *nl = memchr(s + i, '\n', n - i);
        size_t end = nl ? (size_t)(nl - s) + 1 : n;
        if (!volatile_line(s + i, end - i)) kvt_wbuf_put(out, s + i, end - i);
        i = end;
    }
    return true;
}

/* Text being collected from content parts: KVT_CHAT_SEP between parts.
 * System text (filter) loses its volatile lines; dropped tells whether any
 * went. */
typedef struct text_acc {
    kvt_wbuf b;
    size_t n_parts;
    bool filter, dropped;
} text_acc;

/* Append one text part. A system part that held nothing but volatile lines
 * is dropped whole. */
static void put_part(text_acc *a, const char *s, size_t n)
{
    kvt_wbuf f = {0};
    if (a->filter && strip_volatile(&f, s, n)) {
        a->dropped = true;
        if (f.oom) a->b.oom = true;
        else if (f.len) {
            if (a->n_parts++) kvt_wbuf_puts(&a->b, KVT_CHAT_SEP);
            kvt_wbuf_put(&a->b, f.p, f.len);
        }
        kvt_wbuf_free(&f);
        return;
    }
    if (a->n_parts++) kvt_wbuf_puts(&a->b, KVT_CHAT_SEP);
    kvt_wbuf_put(&a->b, s, n);
}

static bool is_text_type(const char *t)
{
    return !strcmp(t, "text") || !strcmp(t, "input_text") || !strcmp(t, "output_text");
}

/* The 400 for a content part of type t that the context cannot take. */
static int part_refused(int *status, const char *where, size_t i, const char *t)
{
    bool media = !strcmp(t, "image_url") || !strcmp(t, "image") || !strcmp(t, "input_audio") ||
                 !strcmp(t, "audio") || !strcmp(t, "file") || !strcmp(t, "document") ||
                 !strcmp(t, "input_image") || !strcmp(t, "input_file");
    bool tool = !strncmp(t, "tool_", 5) || strstr(t, "tool_use") || strstr(t, "tool_result");
    return bad(status, "\"%s[%zu]\": content of type \"%.40s\" is not supported%s", where, i, t,
               media ? ": this model reads text only"
               : tool ? " in this place"
               : "; send text parts");
}

/* The type of content part i (an object with a string "type"). */
static int part_type(const json_t *part, const char *where, size_t i, const char **t, int *status)
{
    if (!json_is_object(part))
        return bad(status, "\"%s[%zu]\": expected an object, got %s", where, i, type_name(part));
    json_t *ty = json_object_get(part, "type");
    if (!json_is_string(ty))
        return bad(status, "\"%s[%zu].type\": expected a string, got %s", where, i, type_name(ty));
    *t = json_string_value(ty);
    return KVT_OK;
}

/* Append the text of text part i. */
static int part_text(text_acc *a, const json_t *part, const char *where, size_t i, int *status)
{
    json_t *tx = json_object_get(part, "text");
    if (!json_is_string(tx))
        return bad(status, "\"%s[%zu].text\": expected a string, got %s", where, i, type_name(tx));
    /* cache_control (Anthropic prompt caching hints), annotations, ids and
     * any other key of the part are ignored: kvtier caches every prefix on
     * its own, and none of them is text for the model. */
    put_part(a, json_string_value(tx), json_string_length(tx));
    return KVT_OK;
}

/* Append the text of content c (a string, or an array of text parts).
 * Text parts ("text", and Responses' "input_text" / "output_text") are
 * joined with KVT_CHAT_SEP; "refusal" parts are skipped; any other type is
 * refused.
 * where names c ("messages[2].content", "system"). */
static int content_text(text_acc *a, const json_t *c, const char *where, int *status)
{
    if (json_is_string(c)) {
        put_part(a, json_string_value(c), json_string_length(c));
        return KVT_OK;
    }
    if (!json_is_array(c))
        return bad(status, "\"%s\": expected a string or an array of content parts, got %s", where, type_name(c));
    size_t i;
    json_t *part;
    json_array_foreach(c, i, part) {
        const char *t;
        int rc = part_type(part, where, i, &t, status);
        if (rc) return rc;
        if (!strcmp(t, "refusal")) continue;
        if (!is_text_type(t)) return part_refused(status, where, i, t);
        if ((rc = part_text(a, part, where, i, status))) return rc;
    }
    return KVT_OK;
}

/* Add a turn with the collected text (a->b consumed). A system turn left
 * empty only because its volatile lines were dropped is no turn. */
static int chat_add_acc(chat *ch, int role, text_acc *a, int *status)
{
    if (a->dropped && a->b.len == 0 && !a->b.oom) {
        kvt_wbuf_free(&a->b);
        return KVT_OK;
    }
    kvt_turn *t = chat_push(ch, role);
    if (!t) { kvt_wbuf_free(&a->b); return oom(status); }
    return turn_take(t, &a->b, status);
}

/* Add a turn whose text is content c (NULL: empty). */
static int chat_add(chat *ch, int role, const json_t *c, const char *where, int *status)
{
    text_acc a = {.filter = kvt_role_is_system(role) && !ch->keep_volatile};
    int rc = c ? content_text(&a, c, where, status) : KVT_OK;
    if (rc) { kvt_wbuf_free(&a.b); return rc; }
    return chat_add_acc(ch, role, &a, status);
}

/* ---- tool definitions ----------------------------------------------------- */

/* Append one function to ch->c.tools as a canonical line:
 * {"name":…,"description":…,"parameters":…}, fixed key order at the top (the
 * name first reads best), parameters canonical without "$schema"; absent
 * description or parameters are left out. ns: the Responses namespace. */
static int tool_add_canon(chat *ch, const char *ns, const json_t *name, const json_t *desc, const json_t *params,
                          int *status)
{
    kvt_wbuf *b = &ch->c.tools;
    if (ch->c.n_tools++) kvt_wbuf_put(b, "\n", 1);
    kvt_wbuf_puts(b, "{\"name\":\"");
    if (ns) {
        kvt_json_chars(b, ns, strlen(ns));
        kvt_wbuf_puts(b, KVT_API_NS_SEP);
    }
    kvt_json_chars(b, json_string_value(name), json_string_length(name));
    kvt_wbuf_puts(b, "\"");
    if (desc) {
        kvt_wbuf_puts(b, ",\"description\":");
        kvt_json_string(b, json_string_value(desc), json_string_length(desc));
    }
    if (params) {
        kvt_wbuf_puts(b, ",\"parameters\":");
        canon(b, params, true);
    }
    kvt_wbuf_puts(b, "}");
    return b->oom ? oom(status) : KVT_OK;
}

/* Append one function to ch->c.fns as the OpenAI function object the
 * DeepSeek-V4 template renders (tool['function'] | tojson): an OpenAI chat
 * function (no "type", schema under "parameters", no namespace) as the
 * client sent it, every key in its order; any other (Anthropic's
 * input_schema, Responses' typed and namespaced tools) as the function it
 * stands for, {"name", "description", "parameters"}. */
static int tool_add_fn(chat *ch, const char *ns, const json_t *fn, const json_t *name, const json_t *desc,
                       const json_t *params, const char *params_key, int *status)
{
    json_t *f = NULL;
    if (!ns && !strcmp(params_key, "parameters") && !json_object_get(fn, "type")) {
        f = json_incref((json_t *)fn);
    } else if ((f = json_object())) {
        kvt_wbuf q = {0};
        if (ns) {
            kvt_wbuf_puts(&q, ns);
            kvt_wbuf_puts(&q, KVT_API_NS_SEP);
        }
        kvt_wbuf_put(&q, json_string_value(name), json_string_length(name));
        int bad_set = q.oom || json_object_set_new(f, "name", json_stringn((const char *)q.p, q.len)) ||
                      (desc && json_object_set(f, "description", (json_t *)desc)) ||
                      (params && json_object_set(f, "parameters", (json_t *)params));
        kvt_wbuf_free(&q);
        if (bad_set) { json_decref(f); f = NULL; }
    }
    if (!f) return oom(status);
    if (!ch->c.fns && !(ch->c.fns = json_array())) { json_decref(f); return oom(status); }
    return json_array_append_new(ch->c.fns, f) ? oom(status) : KVT_OK;
}

/* A function definition: checked, then added to both forms. */
static int tool_add(chat *ch, const char *ns, const json_t *fn, const char *name_key, const char *params_key,
                    const char *where, int *status)
{
    const json_t *name, *desc;
    int rc = get_str(fn, name_key, where, true, &name, status);
    if (rc || (rc = get_str(fn, "description", where, false, &desc, status))) return rc;
    if (json_string_length(name) == 0) return bad(status, "\"%s.%s\": must not be empty", where, name_key);
    json_t *params = field(fn, params_key);
    if (params && !json_is_object(params))
        return bad(status, "\"%s.%s\": expected an object (a JSON Schema), got %s", where, params_key,
                   type_name(params));
    if ((rc = tool_add_canon(ch, ns, name, desc, params, status))) return rc;
    return tool_add_fn(ch, ns, fn, name, desc, params, params_key, status);
}

static int add_namespace(kvt_request *r, const json_t *name, int *status)
{
    size_t bytes;
    char **p = kvt_mul_ok(r->n_namespaces + 1, sizeof *p, &bytes) ? realloc(r->namespaces, bytes) : NULL;
    if (!p) return oom(status);
    r->namespaces = p;
    if (!(p[r->n_namespaces] = kvt_strndup(json_string_value(name), json_string_length(name)))) return oom(status);
    r->n_namespaces++;
    return KVT_OK;
}

/* The function tools a request offers, rendered into ch->c.tools; anything
 * else (hosted tools such as web_search, Anthropic server tools, custom
 * grammar tools) is ignored: the model cannot run them. */
static int parse_tools(chat *ch, kvt_request *r, const json_t *root, kvt_api api, int *status)
{
    json_t *tools = field(root, "tools");
    if (tools && !json_is_array(tools)) return bad(status, "\"tools\": expected an array, got %s", type_name(tools));
    size_t i;
    json_t *tool;
    char where[64];
    int rc;
    json_array_foreach(tools, i, tool) {
        snprintf(where, sizeof where, "tools[%zu]", i);
        if (!json_is_object(tool)) return bad(status, "\"%s\": expected an object, got %s", where, type_name(tool));
        const json_t *ty;
        if ((rc = get_str(tool, "type", where, false, &ty, status))) return rc;
        const char *t = ty ? json_string_value(ty) : NULL;
        if (api == KVT_API_CHAT) {
            /* {type:"function", function:{name, description, parameters, strict}} */
            if (t && strcmp(t, "function")) continue;
            json_t *fn = field(tool, "function");
            if (!json_is_object(fn))
                return bad(status, "\"%s.function\": expected an object, got %s", where, type_name(fn));
            snprintf(where, sizeof where, "tools[%zu].function", i);
            rc = tool_add(ch, NULL, fn, "name", "parameters", where, status);
        } else if (api == KVT_API_MESSAGES) {
            /* {name, description, input_schema}; a typed tool other than
             * "custom" is a server or client-defined Anthropic tool. */
            if (t && strcmp(t, "custom")) continue;
            rc = tool_add(ch, NULL, tool, "name", "input_schema", where, status);
        } else {
            /* Responses: {type:"function", name, description, parameters,
             * strict}, or {type:"namespace", name, tools:[functions]}. */
            if (!t) return bad(status, "\"%s.type\": required", where);
            if (!strcmp(t, "function")) {
                rc = tool_add(ch, NULL, tool, "name", "parameters", where, status);
            } else if (!strcmp(t, "namespace")) {
                const json_t *ns;
                if ((rc = get_str(tool, "name", where, true, &ns, status))) return rc;
                if (json_string_length(ns) == 0) return bad(status, "\"%s.name\": must not be empty", where);
                json_t *inner = field(tool, "tools");
                if (!json_is_array(inner))
                    return bad(status, "\"%s.tools\": expected an array, got %s", where, type_name(inner));
                size_t k;
                json_t *fn;
                json_array_foreach(inner, k, fn) {
                    char w2[128];
                    snprintf(w2, sizeof w2, "tools[%zu].tools[%zu]", i, k);
                    if (!json_is_object(fn))
                        return bad(status, "\"%s\": expected an object, got %s", w2, type_name(fn));
                    const json_t *ity;
                    if ((rc = get_str(fn, "type", w2, false, &ity, status))) return rc;
                    if (ity && strcmp(json_string_value(ity), "function")) continue;
                    if ((rc = tool_add(ch, json_string_value(ns), fn, "name", "parameters", w2, status))) return rc;
                }
                rc = add_namespace(r, ns, status);
            } else {
                continue;
            }
        }
        if (rc) return rc;
    }
    /* OpenAI's deprecated "functions": [{name, description, parameters}]. */
    json_t *fns = api == KVT_API_CHAT ? field(root, "functions") : NULL;
    if (fns && !json_is_array(fns)) return bad(status, "\"functions\": expected an array, got %s", type_name(fns));
    json_array_foreach(fns, i, tool) {
        snprintf(where, sizeof where, "functions[%zu]", i);
        if (!json_is_object(tool)) return bad(status, "\"%s\": expected an object, got %s", where, type_name(tool));
        if ((rc = tool_add(ch, NULL, tool, "name", "parameters", where, status))) return rc;
    }
    return KVT_OK;
}

/* ---- conversations, per api ---------------------------------------------- */

/* A tool call: its name is obj[name_key], its arguments obj[args_key], a
 * JSON text (OpenAI, Responses) or a JSON value (Anthropic's input);
 * absent arguments are {}. id: the call id (may be NULL). */
static int add_call(kvt_turn *t, const json_t *id, const char *ns, const json_t *obj, const char *name_key,
                    const char *args_key, const char *where, int *status)
{
    const json_t *name;
    int rc = get_str(obj, name_key, where, true, &name, status);
    if (rc) return rc;
    json_t *a = field(obj, args_key), *argv = NULL;
    kvt_wbuf args = {0};
    bool is_json = true;
    if (!a) {
        kvt_wbuf_puts(&args, "{}");
        if (!(argv = json_object())) args.oom = true;
    } else if (json_is_string(a)) {
        json_error_t e;
        argv = json_loadb(json_string_value(a), json_string_length(a), JSON_DECODE_ANY, &e);
        if (!argv && json_error_code(&e) == json_error_out_of_memory) args.oom = true;
        is_json = argv != NULL;
        if (argv) canon(&args, argv, false);
        else kvt_wbuf_put(&args, json_string_value(a), json_string_length(a));
    } else {
        canon(&args, a, false);
        argv = json_incref(a);
    }
    if (argv && !json_is_object(argv)) { json_decref(argv); argv = NULL; }
    if (rc || args.oom) { kvt_wbuf_free(&args); json_decref(argv); return oom(status); }
    return turn_call(t, id, ns, json_string_value(name), json_string_length(name), &args, is_json, argv, status);
}

/* Move the collected text and calls of tmp into a new assistant turn. */
static int chat_add_assistant(chat *ch, text_acc *a, kvt_turn *tmp, int *status)
{
    kvt_turn *t = chat_push(ch, KVT_ROLE_ASSISTANT);
    if (!t) { kvt_wbuf_free(&a->b); kvt_turn_free(tmp); return oom(status); }
    t->calls = tmp->calls;
    t->n_calls = tmp->n_calls;
    t->cap_calls = tmp->cap_calls;
    t->reasoning = tmp->reasoning;
    t->rlen = tmp->rlen;
    *tmp = (kvt_turn){0};
    return turn_take(t, &a->b, status);
}

static int role_of(const json_t *jr, const char *where, bool allow_tool, int *role, int *status)
{
    if (!json_is_string(jr)) return bad(status, "\"%s.role\": expected a string, got %s", where, type_name(jr));
    const char *rs = json_string_value(jr);
    if (!strcmp(rs, "user")) *role = KVT_ROLE_USER;
    else if (!strcmp(rs, "assistant")) *role = KVT_ROLE_ASSISTANT;
    else if (!strcmp(rs, "system")) *role = KVT_ROLE_SYSTEM;
    else if (!strcmp(rs, "developer")) *role = KVT_ROLE_DEVELOPER;
    else if (allow_tool && (!strcmp(rs, "tool") || !strcmp(rs, "function"))) *role = KVT_ROLE_TOOL;
    else return bad(status, "\"%s.role\": unknown role \"%.40s\"", where, rs);
    return KVT_OK;
}

static int messages_array(const json_t *root, const json_t **out, int *status)
{
    json_t *msgs = field(root, "messages");
    if (!msgs) return bad(status, "\"messages\": required");
    if (!json_is_array(msgs)) return bad(status, "\"messages\": expected an array, got %s", type_name(msgs));
    if (json_array_size(msgs) == 0) return bad(status, "\"messages\": must hold at least one message");
    *out = msgs;
    return KVT_OK;
}

/* One entry of an OpenAI assistant message's tool_calls:
 * {id, type:"function", function:{name, arguments}}. */
static int openai_call(kvt_turn *tmp, const json_t *call, const char *w, int *status)
{
    if (!json_is_object(call)) return bad(status, "\"%s\": expected an object, got %s", w, type_name(call));
    const json_t *ty, *id;
    int rc = get_str(call, "type", w, false, &ty, status);
    if (rc || (rc = get_str(call, "id", w, false, &id, status))) return rc;
    if (ty && strcmp(json_string_value(ty), "function"))
        return bad(status, "\"%s.type\": tool calls of type \"%.40s\" are not supported", w, json_string_value(ty));
    json_t *fn = field(call, "function");
    if (!json_is_object(fn)) return bad(status, "\"%s.function\": expected an object, got %s", w, type_name(fn));
    char fw[160];
    snprintf(fw, sizeof fw, "%s.function", w);
    return add_call(tmp, id, NULL, fn, "name", "arguments", fw, status);
}

/* OpenAI chat: system / developer / user messages, assistant messages with
 * optional tool_calls (and the legacy function_call), tool (and legacy
 * function) messages with the results. */
static int parse_chat(chat *ch, const json_t *root, int *status)
{
    const json_t *msgs;
    int rc = messages_array(root, &msgs, status);
    if (rc) return rc;
    size_t i;
    json_t *msg;
    json_array_foreach(msgs, i, msg) {
        char where[48], cwhere[64];
        snprintf(where, sizeof where, "messages[%zu]", i);
        snprintf(cwhere, sizeof cwhere, "messages[%zu].content", i);
        if (!json_is_object(msg)) return bad(status, "\"%s\": expected an object, got %s", where, type_name(msg));
        int role;
        if ((rc = role_of(json_object_get(msg, "role"), where, true, &role, status))) return rc;
        json_t *c = field(msg, "content");
        if (role != KVT_ROLE_ASSISTANT) {
            /* a tool message's tool_call_id and name are not rendered: the
             * results follow their calls in order */
            if (!c) return bad(status, "\"%s\": required", cwhere);
            if ((rc = chat_add(ch, role, c, cwhere, status))) return rc;
            continue;
        }
        /* OpenAI allows an assistant message without content (it then
         * carries tool calls): its text is empty. */
        text_acc a = {0};
        kvt_turn tmp = {0};
        rc = c ? content_text(&a, c, cwhere, status) : KVT_OK;
        json_t *tc = field(msg, "tool_calls"), *fc = field(msg, "function_call");
        if (!rc && tc && !json_is_array(tc))
            rc = bad(status, "\"%s.tool_calls\": expected an array, got %s", where, type_name(tc));
        size_t k;
        json_t *call;
        json_array_foreach(tc, k, call) {
            if (rc) break;
            char w[128];
            snprintf(w, sizeof w, "%s.tool_calls[%zu]", where, k);
            rc = openai_call(&tmp, call, w, status);
        }
        if (!rc && fc) {
            char w[128];
            snprintf(w, sizeof w, "%s.function_call", where);
            rc = json_is_object(fc) ? add_call(&tmp, NULL, NULL, fc, "name", "arguments", w, status)
                                    : bad(status, "\"%s\": expected an object, got %s", w, type_name(fc));
        }
        /* its reasoning, as DeepSeek's API and llama.cpp's server return it */
        const json_t *rs = NULL;
        if (!rc && !(rc = get_str(msg, "reasoning_content", where, false, &rs, status)) && rs &&
            !(tmp.reasoning = kvt_strndup(json_string_value(rs), json_string_length(rs))))
            rc = oom(status);
        tmp.rlen = rs ? json_string_length(rs) : 0;
        if (rc) { kvt_wbuf_free(&a.b); kvt_turn_free(&tmp); return rc; }
        if ((rc = chat_add_assistant(ch, &a, &tmp, status))) return rc;
    }
    return KVT_OK;
}

/* Give assistant turn t the reasoning collected in a (consumed, also on
 * failure). */
static int turn_take_reasoning(kvt_turn *t, text_acc *a, int *status)
{
    kvt_wbuf_put(&a->b, "", 1);
    if (a->b.oom) { kvt_wbuf_free(&a->b); return oom(status); }
    free(t->reasoning);
    t->reasoning = (char *)a->b.p;
    t->rlen = a->b.len - 1;
    a->b = (kvt_wbuf){0};
    return KVT_OK;
}

/* Anthropic content blocks of a user or assistant message: text blocks;
 * tool_result blocks in user messages (each becomes a tool turn, with the
 * user text around it as user turns, in order); tool_use blocks in assistant
 * messages (the calls, after the text); thinking blocks in assistant
 * messages (their "thinking" text is the turn's reasoning, which the deepseek
 * template writes in thinking mode: it is what this server sent as the
 * reply's thinking block, so sent back it renders the bytes the model
 * sampled; several are joined like text parts). The signature is not
 * checked: this server signs nothing. redacted_thinking blocks are skipped:
 * their content is encrypted by and for another service. */
static int anthropic_blocks(chat *ch, int role, const json_t *c, const char *where, int *status)
{
    text_acc a = {0}, ra = {0};
    kvt_turn tmp = {0};
    bool any = false, any_reasoning = false;
    size_t j;
    json_t *blk;
    int rc = KVT_OK;
    json_array_foreach(c, j, blk) {
        const char *t;
        char w[128];
        snprintf(w, sizeof w, "%s[%zu]", where, j);
        if ((rc = part_type(blk, where, j, &t, status))) break;
        if (is_text_type(t)) {
            if ((rc = part_text(&a, blk, where, j, status))) break;
        } else if (role == KVT_ROLE_USER && !strcmp(t, "tool_result")) {
            /* tool_use_id and is_error are not rendered: results follow
             * their calls in order, and an error result says so in its text */
            if (a.n_parts && (rc = chat_add_acc(ch, KVT_ROLE_USER, &a, status))) break;
            a = (text_acc){0};
            text_acc o = {0};
            json_t *oc = field(blk, "content");
            char cw[160];
            snprintf(cw, sizeof cw, "%s.content", w);
            if (oc && (rc = content_text(&o, oc, cw, status))) { kvt_wbuf_free(&o.b); break; }
            if ((rc = chat_add_acc(ch, KVT_ROLE_TOOL, &o, status))) break;
            any = true;
        } else if (role == KVT_ROLE_ASSISTANT && !strcmp(t, "tool_use")) {
            const json_t *id;
            if ((rc = get_str(blk, "id", w, false, &id, status))) break;
            if ((rc = add_call(&tmp, id, NULL, blk, "name", "input", w, status))) break;
        } else if (role == KVT_ROLE_ASSISTANT && !strcmp(t, "thinking")) {
            json_t *th = json_object_get(blk, "thinking");
            if (!json_is_string(th)) {
                rc = bad(status, "\"%s.thinking\": expected a string, got %s", w, type_name(th));
                break;
            }
            put_part(&ra, json_string_value(th), json_string_length(th));
            any_reasoning = true;
        } else if (role == KVT_ROLE_ASSISTANT && !strcmp(t, "redacted_thinking")) {
            continue;
        } else {
            rc = part_refused(status, where, j, t);
            break;
        }
    }
    if (!rc && any_reasoning) rc = turn_take_reasoning(&tmp, &ra, status);
    kvt_wbuf_free(&ra.b);
    if (rc) { kvt_wbuf_free(&a.b); kvt_turn_free(&tmp); return rc; }
    if (role == KVT_ROLE_ASSISTANT) return chat_add_assistant(ch, &a, &tmp, status);
    if (a.n_parts || !any) return chat_add_acc(ch, role, &a, status); /* [] is an empty kvt_turn */
    kvt_wbuf_free(&a.b);
    return KVT_OK;
}

/* Anthropic: "system" (a string or text blocks), then the messages. */
static int parse_anthropic(chat *ch, const json_t *root, int *status)
{
    int rc;
    json_t *sys = field(root, "system");
    if (sys && !json_is_string(sys) && !json_is_array(sys))
        return bad(status, "\"system\": expected a string or an array of text blocks, got %s", type_name(sys));
    /* An empty system prompt is no system prompt. */
    if (sys && (json_is_string(sys) ? json_string_length(sys) : json_array_size(sys)) > 0 &&
        (rc = chat_add(ch, KVT_ROLE_SYSTEM, sys, "system", status)))
        return rc;
    const json_t *msgs;
    if ((rc = messages_array(root, &msgs, status))) return rc;
    size_t i;
    json_t *msg;
    json_array_foreach(msgs, i, msg) {
        char where[48], cwhere[64];
        snprintf(where, sizeof where, "messages[%zu]", i);
        snprintf(cwhere, sizeof cwhere, "messages[%zu].content", i);
        if (!json_is_object(msg)) return bad(status, "\"%s\": expected an object, got %s", where, type_name(msg));
        int role;
        /* Anthropic itself takes only user and assistant here; system and
         * developer messages are accepted as system text (a leniency) */
        if ((rc = role_of(json_object_get(msg, "role"), where, false, &role, status))) return rc;
        json_t *c = field(msg, "content");
        if (!c && role != KVT_ROLE_ASSISTANT) return bad(status, "\"%s\": required", cwhere);
        if (!c || !json_is_array(c) || kvt_role_is_system(role)) rc = chat_add(ch, role, c, cwhere, status);
        else rc = anthropic_blocks(ch, role, c, cwhere, status);
        if (rc) return rc;
    }
    return KVT_OK;
}

/* OpenAI Responses: "instructions", then "input": a string (one user
 * message) or items. Message items (with or without "type"), function_call
 * items (joining the assistant turn before them, as the model writes text
 * then calls), function_call_output items, their custom-tool twins, and
 * reasoning items (skipped). Item ids are never rendered. */
static int parse_responses(chat *ch, const json_t *root, int *status)
{
    int rc;
    json_t *ins = field(root, "instructions");
    if (ins && !json_is_string(ins))
        return bad(status, "\"instructions\": expected a string, got %s", type_name(ins));
    if (ins && json_string_length(ins) > 0 && (rc = chat_add(ch, KVT_ROLE_SYSTEM, ins, "instructions", status)))
        return rc;
    json_t *in = field(root, "input");
    if (!in) return bad(status, "\"input\": required");
    if (json_is_string(in)) return chat_add(ch, KVT_ROLE_USER, in, "input", status);
    if (!json_is_array(in))
        return bad(status, "\"input\": expected a string or an array of items, got %s", type_name(in));
    size_t i;
    json_t *item;
    json_array_foreach(in, i, item) {
        char where[48], cwhere[64];
        snprintf(where, sizeof where, "input[%zu]", i);
        if (!json_is_object(item)) return bad(status, "\"%s\": expected an object, got %s", where, type_name(item));
        const json_t *ty;
        if ((rc = get_str(item, "type", where, false, &ty, status))) return rc;
        const char *t = ty ? json_string_value(ty) : "message";
        if (!strcmp(t, "message")) {
            int role;
            if ((rc = role_of(json_object_get(item, "role"), where, false, &role, status))) return rc;
            json_t *c = field(item, "content");
            snprintf(cwhere, sizeof cwhere, "input[%zu].content", i);
            if (!c) return bad(status, "\"%s\": required", cwhere);
            rc = chat_add(ch, role, c, cwhere, status);
        } else if (!strcmp(t, "function_call") || !strcmp(t, "custom_tool_call")) {
            const json_t *id, *ns;
            if ((rc = get_str(item, "call_id", where, true, &id, status)) ||
                (rc = get_str(item, "namespace", where, false, &ns, status)))
                return rc;
            if (ch->c.n == 0 || ch->c.t[ch->c.n - 1].role != KVT_ROLE_ASSISTANT) {
                if (!chat_push(ch, KVT_ROLE_ASSISTANT)) return oom(status);
            }
            rc = add_call(&ch->c.t[ch->c.n - 1], id, ns && json_string_length(ns) ? json_string_value(ns) : NULL, item,
                          "name", !strcmp(t, "function_call") ? "arguments" : "input", where, status);
        } else if (!strcmp(t, "function_call_output") || !strcmp(t, "custom_tool_call_output")) {
            snprintf(cwhere, sizeof cwhere, "input[%zu].output", i);
            rc = chat_add(ch, KVT_ROLE_TOOL, field(item, "output"), cwhere, status);
        } else if (!strcmp(t, "reasoning")) {
            continue;
        } else {
            return bad(status, "\"%s\": items of type \"%.40s\" are not supported", where, t);
        }
        if (rc) return rc;
    }
    return KVT_OK;
}

/* /v1/completions: "prompt" is a string, or an array holding one string. */
static int completions_prompt(kvt_wbuf *b, const json_t *root, int *status)
{
    json_t *p = json_object_get(root, "prompt");
    if (!p || json_is_null(p)) return bad(status, "\"prompt\": required");
    if (json_is_array(p)) {
        size_t n = json_array_size(p);
        if (n == 0) return bad(status, "\"prompt\": the array is empty");
        json_t *first = json_array_get(p, 0);
        if (json_is_integer(first) || json_is_array(first))
            return bad(status, "\"prompt\": token-id prompts are not supported; send text");
        if (n > 1) return bad(status, "\"prompt\": batches of %zu prompts are not supported; send one", n);
        p = first;
    }
    if (!json_is_string(p)) return bad(status, "\"prompt\": expected a string, got %s", type_name(p));
    kvt_wbuf_put(b, json_string_value(p), json_string_length(p));
    return KVT_OK;
}

/* ---- request -------------------------------------------------------------- */

void kvt_request_free(kvt_request *r)
{
    if (!r) return;
    free(r->model);
    free(r->prompt);
    for (size_t i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->stop);
    for (size_t i = 0; i < r->n_namespaces; i++) free(r->namespaces[i]);
    free(r->namespaces);
    json_decref(r->fns);
    memset(r, 0, sizeof *r);
}

/* Log-probabilities, in each api's own words and OpenAI's limits:
 *   chat         "logprobs": true, "top_logprobs": 0..20 (only with
 *                "logprobs": true, as OpenAI requires)
 *   completions  "logprobs": N, 0..5 (the legacy field is the count)
 *   responses    "include": [..., "message.output_text.logprobs", ...],
 *                "top_logprobs": 0..20; a top_logprobs of 1 or more asks for
 *                them too (a request for alternatives is one for logprobs)
 * Anthropic has none. */
static int parse_logprobs(kvt_request *r, const json_t *root, kvt_api api, int *status)
{
    int rc;
    bool present;
    int64_t x = 0;
    if (api == KVT_API_CHAT) {
        if ((rc = get_bool(root, "logprobs", &r->logprobs, status))) return rc;
        if ((rc = get_int(root, "top_logprobs", 0, KVT_API_MAX_TOP_LOGPROBS, &x, &present, status))) return rc;
        if (present && !r->logprobs) return bad(status, "\"top_logprobs\": requires \"logprobs\": true");
        r->top_logprobs = (uint32_t)x;
    } else if (api == KVT_API_COMPLETIONS) {
        if ((rc = get_int(root, "logprobs", 0, KVT_API_MAX_LOGPROBS_LEGACY, &x, &present, status))) return rc;
        r->logprobs = present;
        r->top_logprobs = (uint32_t)x;
    } else if (api == KVT_API_RESPONSES) {
        json_t *inc = field(root, "include");
        if (inc && !json_is_array(inc))
            return bad(status, "\"include\": expected an array, got %s", type_name(inc));
        size_t i;
        json_t *v;
        json_array_foreach(inc, i, v) {
            if (!json_is_string(v))
                return bad(status, "\"include[%zu]\": expected a string, got %s", i, type_name(v));
            if (!strcmp(json_string_value(v), "message.output_text.logprobs")) r->logprobs = true;
        }
        if ((rc = get_int(root, "top_logprobs", 0, KVT_API_MAX_TOP_LOGPROBS, &x, &present, status))) return rc;
        r->top_logprobs = (uint32_t)x;
        if (x > 0) r->logprobs = true;
    }
    return KVT_OK;
}

static int parse_sampling(kvt_request *r, const json_t *root, kvt_api api, int *status)
{
    int rc;
    bool present;
    int64_t x;
    const bool legacy = api == KVT_API_CHAT || api == KVT_API_COMPLETIONS; /* OpenAI, pre-Responses */

    json_t *model = field(root, "model");
    if (model) {
        if (!json_is_string(model)) return bad(status, "\"model\": expected a string, got %s", type_name(model));
        if (!(r->model = kvt_strndup(json_string_value(model), json_string_length(model)))) return oom(status);
    }
    if ((rc = get_bool(root, "stream", &r->stream, status))) return rc;
    if (legacy) {
        json_t *so = field(root, "stream_options");
        if (so && !json_is_object(so))
            return bad(status, "\"stream_options\": expected an object, got %s", type_name(so));
        json_t *iu = so ? field(so, "include_usage") : NULL;
        if (iu && !json_is_boolean(iu))
            return bad(status, "\"stream_options.include_usage\": expected a boolean, got %s", type_name(iu));
        r->include_usage = iu && json_is_true(iu);
    }

    /* max_tokens: Anthropic requires it; OpenAI chat prefers its newer name
     * max_completion_tokens when both are sent; Responses calls it
     * max_output_tokens. */
    const char *mt = api == KVT_API_RESPONSES ? "max_output_tokens" : "max_tokens";
    if (api == KVT_API_CHAT && field(root, "max_completion_tokens")) mt = "max_completion_tokens";
    if ((rc = get_int(root, mt, 1, UINT32_MAX, &x, &present, status))) return rc;
    if (present) r->max_tokens = (uint32_t)x;
    else if (api == KVT_API_MESSAGES) return bad(status, "\"max_tokens\": required");

    if ((rc = get_float(root, "temperature", 0, 2, &r->temperature, NULL, status))) return rc;
    if ((rc = get_float(root, "top_p", 0, 1, &r->top_p, NULL, status))) return rc;
    if (r->top_p == 0) r->top_p = FLT_MIN;
    if ((rc = get_int(root, "top_k", 0, UINT32_MAX, &x, &present, status))) return rc;
    if (present) r->top_k = (uint32_t)x;
    if ((rc = get_int(root, "seed", INT64_MIN, INT64_MAX, &x, &r->has_seed, status))) return rc;
    if (r->has_seed) r->seed = (uint64_t)x;

    if ((rc = parse_logprobs(r, root, api, status))) return rc;

    if (legacy) rc = parse_stop(r, root, "stop", true, KVT_API_MAX_STOP_OPENAI, status);
    else if (api == KVT_API_MESSAGES)
        rc = parse_stop(r, root, "stop_sequences", false, KVT_API_MAX_STOP_ANTHROPIC, status);
    if (rc) return rc;

    /* Known OpenAI fields whose other values ask for more than one plain
     * completion: refuse rather than quietly answer something else. */
    if (legacy) {
        if ((rc = get_int(root, "n", 1, INT64_MAX, &x, &present, status))) return rc;
        if (present && x != 1) return bad(status, "\"n\": only one choice per request is supported");
    }
    if (api == KVT_API_COMPLETIONS) {
        bool echo = false;
        if ((rc = get_bool(root, "echo", &echo, status))) return rc;
        if (echo) return bad(status, "\"echo\": echoing the prompt is not supported");
        if ((rc = get_int(root, "best_of", 1, INT64_MAX, &x, &present, status))) return rc;
        if (present && x != 1) return bad(status, "\"best_of\": only 1 is supported");
        json_t *sfx = field(root, "suffix");
        if (sfx && !json_is_string(sfx)) return bad(status, "\"suffix\": expected a string, got %s", type_name(sfx));
        if (sfx && json_string_length(sfx) > 0) return bad(status, "\"suffix\": insertion is not supported");
    }
    /* Responses that build on server-side state this server does not keep
     * (it stores nothing: every request carries its whole conversation). */
    if (api == KVT_API_RESPONSES) {
        static const char *const stored[] = {"previous_response_id", "conversation", "prompt"};
        for (size_t i = 0; i < sizeof stored / sizeof *stored; i++)
            if (field(root, stored[i]))
                return bad(status, "\"%s\": stored responses, conversations and prompts are not supported; "
                                   "send the whole conversation in \"input\"", stored[i]);
    }
    return KVT_OK;
}

/* OpenAI chat: thinking mode as llama.cpp's and vLLM's servers take it:
 * "chat_template_kwargs": {"thinking": true|false} (or "enable_thinking");
 * absent, the template's default (parse_root). "reasoning_effort" (top level, or in the kwargs)
 * "high" or "max" then selects the template's preamble; other efforts add
 * nothing, and an effort alone does not turn thinking on. */
static int parse_thinking(chat *ch, const json_t *root, int *status)
{
    json_t *kw = field(root, "chat_template_kwargs");
    if (kw && !json_is_object(kw))
        return bad(status, "\"chat_template_kwargs\": expected an object, got %s", type_name(kw));
    int rc = get_bool(kw, "enable_thinking", &ch->c.thinking, status);
    if (!rc) rc = get_bool(kw, "thinking", &ch->c.thinking, status);
    const json_t *e = NULL;
    if (!rc) rc = get_str(kw, "reasoning_effort", "chat_template_kwargs", false, &e, status);
    if (!rc && !e) rc = get_str(root, "reasoning_effort", "", false, &e, status);
    if (rc) return rc;
    const char *es = e ? json_string_value(e) : "";
    ch->c.effort = !strcmp(es, "max") ? 2 : !strcmp(es, "high") ? 1 : 0;
    return KVT_OK;
}

/* Anthropic: "thinking": {"type": "enabled", "budget_tokens": N} or
 * {"type": "adaptive"} turns thinking mode on, {"type": "disabled"} leaves it
 * off, as Anthropic's API takes them (Claude Code sends "adaptive"). The
 * budget is not enforced: the reasoning ends when the model closes it, or
 * at max_tokens. Unlike chat's reasoning_effort, Anthropic's effort
 * (output_config) selects no preamble: its levels are not the template's.
 * An unknown type is a 400, as Anthropic refuses it: answering without the
 * reasoning the client asked for would be a different answer. */
static int parse_thinking_anthropic(chat *ch, const json_t *root, int *status)
{
    json_t *th = field(root, "thinking");
    if (!th) return KVT_OK;
    if (!json_is_object(th)) return bad(status, "\"thinking\": expected an object, got %s", type_name(th));
    const json_t *ty;
    int rc = get_str(th, "type", "thinking", true, &ty, status);
    if (rc) return rc;
    const char *t = json_string_value(ty);
    if (!strcmp(t, "enabled") || !strcmp(t, "adaptive")) ch->c.thinking = true;
    else if (!strcmp(t, "disabled")) ch->c.thinking = false;
    else
        return bad(status, "\"thinking.type\": unknown type \"%.40s\"; expected \"enabled\", \"adaptive\" or "
                           "\"disabled\"", t);
    return KVT_OK;
}

/* Where the last user message's text (trimmed, as templates write it)
 * begins in the rendered prompt: its last occurrence. A template may put
 * other text of that turn before it (Gemma folds the system prompt into the
 * first user turn), so this, not the turn's marker, is where two
 * conversations on one system prompt part. *opening: no assistant turn
 * comes before that message. */
static size_t fork_offset(const kvt_wbuf *b, const kvt_chat *c, bool *opening)
{
    for (size_t i = c->n; i-- > 0;) {
        if (c->t[i].role != KVT_ROLE_USER) continue;
        *opening = true;
        for (size_t k = 0; k < i; k++) *opening &= c->t[k].role != KVT_ROLE_ASSISTANT;
        const char *t = c->t[i].text;
        size_t n = c->t[i].len;
        while (n && (*t == ' ' || *t == '\n' || *t == '\t' || *t == '\r')) t++, n--;
        while (n && (t[n - 1] == ' ' || t[n - 1] == '\n' || t[n - 1] == '\t' || t[n - 1] == '\r')) n--;
        if (!n || !b->p) return SIZE_MAX; /* no text, or nothing rendered (out of memory) */
        size_t at = SIZE_MAX;
        for (const uint8_t *p = b->p, *end = b->p + b->len; (p = memmem(p, (size_t)(end - p), t, n)); p++)
            at = (size_t)(p - b->p);
        return at;
    }
    return SIZE_MAX;
}

static int parse_root(kvt_request *r, const json_t *root, kvt_api api, const kvt_model *m,
                      const kvt_parse_opts *o, int *status)
{
    r->fork_at = SIZE_MAX; /* until a chat's rendering finds it */
    int rc = parse_sampling(r, root, api, status);
    if (rc) return rc;
    kvt_wbuf b = {0};
    if (api == KVT_API_COMPLETIONS) {
        rc = completions_prompt(&b, root, status);
    } else {
        chat ch = {.keep_volatile = o->keep_volatile};
        const kvt_template *t = kvt_template_for(m);
        /* thinking mode unless the request says: the template's own default
         * for OpenAI chat (Qwen 3 thinks, DeepSeek-V4 does not); off for
         * Anthropic's api, where thinking is asked for, and for Responses */
        ch.c.thinking = api == KVT_API_CHAT && t->thinking_default;
        rc = parse_tools(&ch, r, root, api, status);
        /* Responses' "reasoning" asks for OpenAI's reasoning items, which
         * this server does not produce: thinking mode stays off there */
        if (!rc && api == KVT_API_CHAT) rc = parse_thinking(&ch, root, status);
        if (!rc && api == KVT_API_MESSAGES) rc = parse_thinking_anthropic(&ch, root, status);
        if (!rc) {
            if (api == KVT_API_CHAT) rc = parse_chat(&ch, root, status);
            else if (api == KVT_API_MESSAGES) rc = parse_anthropic(&ch, root, status);
            else rc = parse_responses(&ch, root, status);
        }
        if (!rc) {
            r->tmpl = t;
            r->n_tools = ch.c.n_tools;
            r->fns = json_incref(ch.c.fns);
            r->prompt_has_bos = t->has_bos;
            r->prompt_special = t->special;
            /* a thinking-mode reply begins with its reasoning only after the
             * generation prompt (not in a prefill) */
            bool gen = t->render(&b, &ch.c, o->replay, o->replay_user);
            r->thinking = t->thinking && gen && ch.c.thinking;
            r->fork_at = fork_offset(&b, &ch.c, &r->opening);
        }
        kvt_chat_free(&ch.c);
    }
    if (!rc) {
        kvt_wbuf_put(&b, "", 1);
        if (b.oom) rc = oom(status);
    }
    if (rc) { kvt_wbuf_free(&b); return rc; }
    r->prompt = (char *)b.p;
    r->prompt_len = b.len - 1;
    return KVT_OK;
}

int kvt_request_parse_opts(kvt_request *out, kvt_api api, const char *body, size_t len,
                           const kvt_model *m, const kvt_parse_opts *opts, int *status)
{
    int st;
    if (!status) status = &st;
    *status = 500;
    if (!out) return kvt_fail(KVT_EINVAL, "api: NULL request");
    memset(out, 0, sizeof *out);
    if (api != KVT_API_CHAT && api != KVT_API_COMPLETIONS && api != KVT_API_MESSAGES && api != KVT_API_RESPONSES)
        return kvt_fail(KVT_EINVAL, "api: unknown api %d", (int)api);
    static const kvt_parse_opts defaults = {0};
    if (!opts) opts = &defaults;
    if (!body || len == 0) return bad(status, "the request body is empty; send a JSON object");
    json_error_t je;
    /* Flags 0: the top level must be an object or array, and \u0000 is
     * refused (every string here ends up NUL-terminated). jansson bounds the
     * nesting depth, so a hostile body cannot exhaust the stack. */
    json_t *root = json_loadb(body, len, 0, &je);
    if (!root && json_error_code(&je) != json_error_out_of_memory) {
        /* jansson reports some of its allocation failures as a syntax
         * error, or with no message: a syntax error repeats exactly, so a
         * second parse tells them apart (and may simply succeed) */
        json_error_t je2;
        root = json_loadb(body, len, 0, &je2);
        if (!root && (!je.text[0] || je2.position != je.position || strcmp(je2.text, je.text))) return oom(status);
    }
    if (!root) {
        if (json_error_code(&je) == json_error_out_of_memory) return oom(status);
        return bad(status, "the request body is not valid JSON: %s (line %d, column %d)", je.text, je.line,
                   je.column);
    }
    int rc;
    if (!json_is_object(root)) rc = bad(status, "the request body must be a JSON object, not %s", type_name(root));
    else {
        out->api = api;
        out->temperature = 1;
        out->top_p = 1;
        rc = parse_root(out, root, api, m, opts, status);
    }
    json_decref(root);
    if (rc) {
        kvt_request_free(out);
        return rc;
    }
    *status = 200;
    return KVT_OK;
}

int kvt_request_parse(kvt_request *out, kvt_api api, const char *body, size_t len,
                      const kvt_model *m, int *status)
{
    return kvt_request_parse_opts(out, api, body, len, m, NULL, status);
}

/* ---- the tool calls of a reply ------------------------------------------- */

/* Read with the parser of the template that rendered r's prompt (a request
 * built by hand: the DSML parser, kvt_tool_calls_parse), the request's
 * function schemas typing the arguments where the syntax does not. */
int kvt_reply_tool_calls(const kvt_request *r, const char *text, size_t len, kvt_tool_call **calls, size_t *n,
                         size_t *text_end)
{
    if (!r || !calls || !n || !text_end || (!text && len)) return kvt_fail(KVT_EINVAL, "tool calls: NULL argument");
    *calls = NULL;
    *n = 0;
    *text_end = len;
    if (!r->n_tools || !text) return KVT_OK;
    /* the calls come after the reasoning: markup the reasoning quotes (or
     * drafts) is no call, and an answer that has not begun has none */
    size_t from = 0;
    kvt_think th;
    if (r->thinking) kvt_think_parts(r->tmpl, text, len, false, &th), from = th.as;
    int rc = r->tmpl ? r->tmpl->tool_calls(text + from, len - from, r->fns, calls, n, text_end)
                     : kvt_tool_calls_parse(text + from, len - from, calls, n, text_end);
    if (rc) return rc;
    *text_end += from;
    for (size_t i = 0; i < *n; i++) (*calls)[i].raw_off += from;
    return KVT_OK;
}

/* ---- JSON output ---------------------------------------------------------- */


/* Bytes of the maximal subpart of an ill-formed sequence at s[0..n) (the
 * longest prefix of a well-formed character, at least 1): Unicode's
 * recommended unit of replacement (chapter 3, "U+FFFD Substitution of
 * Maximal Subparts"). A stray continuation byte is a subpart of its own, so
 * text cut between characters repairs to the same characters as the whole:
 * what a stream sent in pieces (server.c holds back a partial character)
 * equals the text sent at once. */
static size_t ill_formed_len(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    size_t need = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 1;
    size_t k = 1;
    for (; k < need && k < n; k++) {
        unsigned lo = 0x80, hi = 0xBF;
        if (k == 1) {
            if (c == 0xE0) lo = 0xA0;
            else if (c == 0xED) hi = 0x9F;
            else if (c == 0xF0) lo = 0x90;
            else if (c == 0xF4) hi = 0x8F;
        }
        if (s[k] < lo || s[k] > hi) break;
    }
    return k;
}

/* A JSON string of any bytes: each maximal subpart of an ill-formed
 * sequence becomes one U+FFFD. NULL on out of memory. */
static json_t *jstr(const char *s, size_t len)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, k;
    while (i < len && (k = kvt_utf8_char(u + i, len - i))) i += k;
    if (i == len) return json_stringn(s, len);
    kvt_wbuf b = {0};
    kvt_wbuf_put(&b, s, i);
    while (i < len) {
        if ((k = kvt_utf8_char(u + i, len - i))) {
            kvt_wbuf_put(&b, s + i, k);
            i += k;
        } else {
            kvt_wbuf_put(&b, "\xef\xbf\xbd", 3);
            i += ill_formed_len(u + i, len - i);
        }
    }
    json_t *v = b.oom ? NULL : json_stringn((const char *)b.p, b.len);
    kvt_wbuf_free(&b);
    return v;
}

static json_t *jcstr(const char *s) { return s ? jstr(s, strlen(s)) : json_string(""); }

/* ---- log-probabilities ---------------------------------------------------- */

double kvt_logprob_top(const float *logits, uint32_t n_vocab, int32_t id, uint32_t n_top,
                       int32_t *top_id, double *top_lp)
{
    if (!logits || !n_vocab) return NAN;
    if (!top_id || !top_lp) n_top = 0;
    if (n_top > n_vocab) n_top = n_vocab;
    /* log sum exp, shifted by the largest score so that no exp overflows;
     * only exp, the sum and log round (a difference of two floats is exact
     * in double unless their exponents lie more than 29 apart) */
    double mx = -INFINITY;
    for (uint32_t i = 0; i < n_vocab; i++)
        if (logits[i] > mx) mx = logits[i];
    double sum = 0;
    if (isfinite(mx))
        for (uint32_t i = 0; i < n_vocab; i++)
            if (logits[i] == logits[i]) sum += exp((double)logits[i] - mx);
    double lse = isfinite(mx) ? mx + log(sum) : mx;
    /* the n_top best by insertion: scanning ids upwards and inserting only
     * past equal values keeps the lower id first on ties */
    uint32_t k = 0;
    for (uint32_t i = 0; i < n_vocab && n_top; i++) {
        double v = (double)logits[i] - lse;
        if (v != v) v = -INFINITY;
        if (k == n_top && !(v > top_lp[k - 1])) continue;
        uint32_t at = k < n_top ? k++ : k - 1;
        while (at > 0 && v > top_lp[at - 1]) {
            top_lp[at] = top_lp[at - 1];
            top_id[at] = top_id[at - 1];
            at--;
        }
        top_lp[at] = v;
        top_id[at] = (int32_t)i;
    }
    if (id < 0 || (uint32_t)id >= n_vocab) return NAN;
    return (double)logits[id] - lse;
}

/* A log-probability as JSON: non-finite values cannot be JSON, and OpenAI
 * writes -9999.0 for a token too unlikely to score; lower values are
 * clamped to it. Written with 17 digits, it reads back as the same double. */
static json_t *jlogprob(double v) { return json_real(isfinite(v) && v > -9999.0 ? v : -9999.0); }

/* A token's text: its bytes when they are valid UTF-8 on their own; else
 * OpenAI's spelling "bytes:\xe2\x80" (each byte as \xNN), which keeps two
 * different partial tokens apart where U+FFFD would merge them. */
static json_t *token_text(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, k;
    while (i < n && (k = kvt_utf8_char(u + i, n - i))) i += k;
    if (i == n) return json_stringn(n ? s : "", n);
    if (n > (SIZE_MAX - 7) / 4) return NULL;
    char *b = kvt_malloc(6 + 4 * n + 1);
    if (!b) return NULL;
    memcpy(b, "bytes:", 6);
    for (i = 0; i < n; i++) snprintf(b + 6 + 4 * i, 5, "\\x%02x", u[i]);
    json_t *v = json_stringn(b, 6 + 4 * n);
    free(b);
    return v;
}

/* {"token","logprob","bytes"}: bytes the token's byte values. */
static json_t *logprob_entry(const kvt_logprob *t)
{
    json_t *bytes = json_array();
    for (size_t i = 0; bytes && i < t->len; i++)
        if (json_array_append_new(bytes, json_integer((unsigned char)t->bytes[i]))) {
            json_decref(bytes);
            bytes = NULL;
        }
    return json_pack("{s:o, s:o, s:o}", "token", token_text(t->bytes, t->len), "logprob", jlogprob(t->logprob),
                     "bytes", bytes);
}

/* The per-token list of OpenAI chat (logprobs.content) and of Responses
 * (an output_text's logprobs): each entry with its top_logprobs. */
static json_t *logprob_list(const kvt_logprobs *lp)
{
    json_t *out = json_array();
    for (size_t i = 0; out && lp && i < lp->n; i++) {
        json_t *top = json_array();
        for (size_t k = 0; top && k < lp->n_top; k++)
            if (json_array_append_new(top, logprob_entry(&lp->top[i * lp->n_top + k]))) {
                json_decref(top);
                top = NULL;
            }
        json_t *e = logprob_entry(&lp->tok[i]);
        if (!e || !top || json_object_set_new(e, "top_logprobs", top) || json_array_append_new(out, e)) {
            if (!e) json_decref(top);
            json_decref(e);
            json_decref(out);
            out = NULL;
        }
    }
    return out;
}

/* OpenAI chat choice.logprobs: {"content":[...],"refusal":null}, or null
 * when the request did not ask. */
static json_t *chat_logprobs(const kvt_request *r, const kvt_logprobs *lp)
{
    if (!r->logprobs) return json_null();
    return json_pack("{s:o, s:n}", "content", logprob_list(lp), "refusal");
}

/* Legacy completions choice.logprobs: parallel lists, top_logprobs one
 * object per token mapping token text to log-probability. text_offset
 * counts from the start of the prompt, as OpenAI's does, in bytes. Two
 * alternatives with the same text (possible only with byte-fallback tokens)
 * share a key: the more likely one is kept. */
static json_t *legacy_logprobs(const kvt_request *r, const kvt_logprobs *lp)
{
    if (!r->logprobs) return json_null();
    json_t *toks = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    size_t off = r->prompt_len + (lp ? lp->offset : 0);
    bool ok = toks && lps && tops && offs;
    for (size_t i = 0; ok && lp && i < lp->n; i++) {
        json_t *top = json_object();
        for (size_t k = 0; top && k < lp->n_top; k++) {
            const kvt_logprob *a = &lp->top[i * lp->n_top + k];
            json_t *key = token_text(a->bytes, a->len);
            const char *ks = json_string_value(key);
            size_t kl = json_string_length(key);
            if (!key || (!json_object_getn(top, ks, kl) && json_object_setn_new(top, ks, kl, jlogprob(a->logprob)))) {
                json_decref(top);
                top = NULL;
            }
            json_decref(key);
        }
        ok = top && !json_array_append_new(tops, top);
        ok = ok && !json_array_append_new(toks, token_text(lp->tok[i].bytes, lp->tok[i].len)) &&
             !json_array_append_new(lps, jlogprob(lp->tok[i].logprob)) &&
             !json_array_append_new(offs, json_integer((json_int_t)off));
        off += lp->tok[i].len;
    }
    if (!ok) {
        json_decref(toks);
        json_decref(lps);
        json_decref(tops);
        json_decref(offs);
        return NULL;
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", toks, "token_logprobs", lps, "top_logprobs", tops,
                     "text_offset", offs);
}

/* Reals in Responses bodies without log-probabilities are only the echoed
 * temperature and top_p, which were floats: 7 digits write them as sent
 * (0.2, not 0.20000000298023224).
 * Every other body keeps jansson's exact 17 digits (an Anthropic tool input
 * may hold any real). */
#define FLOAT_ECHO JSON_REAL_PRECISION(7)

/* Responses bodies with logprobs need every digit (a log-probability must
 * read back as the double computed), so they are written with 17; the
 * echoed floats then go out as the double nearest their shortest decimal
 * form, 0.20000000000000001, which reads back as 0.2. */
static size_t responses_flags(const kvt_request *r) { return r->logprobs ? 0 : FLOAT_ECHO; }

/* The double nearest the shortest decimal that reads back as f. */
static double float_echo(float f)
{
    char buf[32];
    for (int p = 1; p < 10; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, (double)f);
        double d = strtod(buf, NULL);
        if ((float)d == f) return d;
    }
    return (double)f;
}

/* Dump v (stolen) compact, with extra flags; NULL when v is NULL or out of
 * memory. */
static char *dump_f(json_t *v, size_t flags)
{
    char *s = kvt_json_dumps(v, JSON_COMPACT | flags);
    json_decref(v);
    return s;
}

static char *dump(json_t *v) { return dump_f(v, 0); }

/* Append one SSE event carrying v (stolen); sets b->oom on failure. */
static void sse_f(kvt_wbuf *b, const char *event, json_t *v, size_t flags)
{
    char *s = dump_f(v, flags);
    if (!s) { b->oom = true; return; }
    if (event) {
        kvt_wbuf_puts(b, "event: ");
        kvt_wbuf_puts(b, event);
        kvt_wbuf_puts(b, "\n");
    }
    kvt_wbuf_puts(b, "data: ");
    kvt_wbuf_puts(b, s);
    kvt_wbuf_puts(b, "\n\n");
    free(s);
}

static void sse(kvt_wbuf *b, const char *event, json_t *v) { sse_f(b, event, v, 0); }

/* The buffer as a malloc'ed string (b is consumed); NULL on out of memory. */
static char *finish_buf(kvt_wbuf *b)
{
    kvt_wbuf_put(b, "", 1);
    if (b->oom) { kvt_wbuf_free(b); return NULL; }
    return (char *)b->p;
}

static json_int_t ji(uint64_t x) { return (json_int_t)x; }

/* Usage with the counts made consistent: cached <= prompt, created <= the
 * prompt tokens that were not cached, reasoning <= completion. */
static kvt_usage usage_of(const kvt_usage *u)
{
    kvt_usage z = u ? *u : (kvt_usage){0};
    if (z.cached_tokens > z.prompt_tokens) z.cached_tokens = z.prompt_tokens;
    if (z.created_tokens > z.prompt_tokens - z.cached_tokens) z.created_tokens = z.prompt_tokens - z.cached_tokens;
    if (z.reasoning_tokens > z.completion_tokens) z.reasoning_tokens = z.completion_tokens;
    return z;
}

/* OpenAI usage, with DeepSeek's prompt_cache_hit/miss_tokens alongside
 * OpenAI's prompt_tokens_details.cached_tokens, and the reasoning's share of
 * the completion in completion_tokens_details (0 outside thinking mode). */
static json_t *usage_openai(const kvt_usage *in)
{
    kvt_usage u = usage_of(in);
    return json_pack("{s:I, s:I, s:I, s:{s:I}, s:{s:I}, s:I, s:I}",
                     "prompt_tokens", ji(u.prompt_tokens),
                     "completion_tokens", ji(u.completion_tokens),
                     "total_tokens", ji((uint64_t)u.prompt_tokens + u.completion_tokens),
                     "prompt_tokens_details", "cached_tokens", ji(u.cached_tokens),
                     "completion_tokens_details", "reasoning_tokens", ji(u.reasoning_tokens),
                     "prompt_cache_hit_tokens", ji(u.cached_tokens),
                     "prompt_cache_miss_tokens", ji(u.prompt_tokens - u.cached_tokens));
}

/* Anthropic usage: input_tokens + cache_read + cache_creation = the prompt. */
static json_t *usage_anthropic(const kvt_usage *in, uint32_t output)
{
    kvt_usage u = usage_of(in);
    return json_pack("{s:I, s:I, s:I, s:I}",
                     "input_tokens", ji(u.prompt_tokens - u.cached_tokens - u.created_tokens),
                     "output_tokens", ji(output),
                     "cache_creation_input_tokens", ji(u.created_tokens),
                     "cache_read_input_tokens", ji(u.cached_tokens));
}

/* Responses usage: input_tokens is the whole prompt, cached_tokens the part
 * reused; no reasoning tokens (Responses requests are never in thinking
 * mode: the model's text is all output). */
static json_t *usage_responses(const kvt_usage *in)
{
    kvt_usage u = usage_of(in);
    return json_pack("{s:I, s:{s:I}, s:I, s:{s:I}, s:I}",
                     "input_tokens", ji(u.prompt_tokens),
                     "input_tokens_details", "cached_tokens", ji(u.cached_tokens),
                     "output_tokens", ji(u.completion_tokens),
                     "output_tokens_details", "reasoning_tokens", (json_int_t)0,
                     "total_tokens", ji((uint64_t)u.prompt_tokens + u.completion_tokens));
}

/* "length": max_tokens reached; "context": the context window filled up. */
static bool is_length(const char *finish)
{
    return finish && (!strcmp(finish, "length") || !strcmp(finish, "context"));
}

/* finish_reason: "length" stays; with tool calls anything else is
 * "tool_calls"; otherwise the server's word ("stop" when NULL). */
static const char *openai_finish(const char *finish, size_t n_calls)
{
    if (is_length(finish)) return "length";
    if (n_calls) return "tool_calls";
    return finish && strcmp(finish, "tool_calls") ? finish : "stop";
}

static const char *anthropic_stop(const char *finish, const char *stop_seq, size_t n_calls)
{
    if (finish && !strcmp(finish, "context")) return "model_context_window_exceeded";
    if (is_length(finish)) return "max_tokens";
    if (n_calls) return "tool_use";
    return stop_seq ? "stop_sequence" : "end_turn";
}

/* stop_sequence: the matched sequence, only with stop_reason "stop_sequence". */
static json_t *anthropic_stop_seq(const char *finish, const char *stop_seq, size_t n_calls)
{
    return !strcmp(anthropic_stop(finish, stop_seq, n_calls), "stop_sequence") ? jcstr(stop_seq) : json_null();
}

/* A call's arguments as a JSON object (Anthropic's input): {} when the model
 * wrote something that is not one. */
static json_t *call_input(const kvt_tool_call *c)
{
    json_t *v = c->valid ? json_loads(c->arguments, 0, NULL) : NULL;
    if (json_is_object(v)) return v;
    json_decref(v);
    return json_object();
}

/* The arguments text Anthropic streams as input_json_delta. */
static const char *call_input_text(const kvt_tool_call *c) { return c->valid ? c->arguments : "{}"; }

/* OpenAI chat tool_calls entry k. */
static json_t *openai_call_json(const kvt_tool_call *c, size_t k, bool with_index)
{
    json_t *v = json_pack("{s:o, s:s, s:{s:o, s:o}}", "id", jcstr(c->id), "type", "function", "function",
                          "name", jcstr(c->name), "arguments", jcstr(c->arguments));
    if (v && with_index && json_object_set_new(v, "index", json_integer((json_int_t)k))) {
        json_decref(v);
        return NULL;
    }
    return v;
}

/* Whether a reply to r is split into reasoning and answer: thinking mode, in
 * the two apis that have a place for the reasoning. */
static bool reply_thinks(const kvt_request *r)
{
    return r->thinking && (r->api == KVT_API_CHAT || r->api == KVT_API_MESSAGES);
}

/* An Anthropic thinking block with the reasoning (stolen). The signature is
 * empty: Anthropic signs its thinking so that it can tell its own back; this
 * server checks nothing (the SDK and Claude Code carry the field as is). */
static json_t *thinking_block(json_t *reasoning)
{
    return json_pack("{s:s, s:o, s:s}", "type", "thinking", "thinking", reasoning, "signature", "");
}

/* The index of the Anthropic text block: after the thinking block in
 * thinking mode; the tool_use blocks follow it. */
static int anthropic_text_index(const kvt_request *r) { return reply_thinks(r) ? 1 : 0; }

static json_t *anthropic_tool_use(const kvt_tool_call *c, bool empty_input)
{
    return json_pack("{s:s, s:o, s:o, s:o}", "type", "tool_use", "id", jcstr(c->id), "name", jcstr(c->name),
                     "input", empty_input ? json_object() : call_input(c));
}

/* ---- Responses objects ---------------------------------------------------- */

/* An item id derived from another id: prefix + what follows the other's own
 * prefix ("resp_abc" -> "msg_abc", "call_123" -> "fc_123"), so that every
 * event of a stream names the same items without the caller keeping them. */
static void derived_id(char *out, size_t n, const char *prefix, const char *id)
{
    if (!id) id = "";
    const char *u = strchr(id, '_');
    snprintf(out, n, "%s%.100s", prefix, u && u[1] ? u + 1 : id);
}

/* An output_text part; with r->logprobs it carries the logprobs of its
 * tokens (lp NULL: none yet). */
static json_t *output_text_part(const kvt_request *r, json_t *text, const kvt_logprobs *lp)
{
    json_t *v = json_pack("{s:s, s:o, s:[]}", "type", "output_text", "text", text, "annotations");
    if (v && r->logprobs && json_object_set_new(v, "logprobs", logprob_list(lp))) {
        json_decref(v);
        return NULL;
    }
    return v;
}

/* The assistant message item; text (stolen) NULL: no content yet. */
static json_t *message_item(const kvt_request *r, const char *resp_id, json_t *text, const char *status,
                            const kvt_logprobs *lp)
{
    char mid[128];
    derived_id(mid, sizeof mid, "msg_", resp_id);
    json_t *content = text ? json_pack("[o]", output_text_part(r, text, lp)) : json_array();
    return json_pack("{s:s, s:s, s:s, s:s, s:o}", "id", mid, "type", "message", "status", status, "role",
                     "assistant", "content", content);
}

/* The name a call goes out under in Responses: a name "ns.fn" of a
 * namespace the request offered is "fn", with *ns (length *ns_len) "ns", as
 * OpenAI returns calls of namespace tools; any other name is itself. */
static const char *responses_name(const kvt_request *r, const kvt_tool_call *c, const char **ns, size_t *ns_len)
{
    *ns = NULL;
    *ns_len = 0;
    const char *name = c->name ? c->name : "";
    for (size_t i = 0; i < r->n_namespaces; i++) {
        size_t k = strlen(r->namespaces[i]);
        if (!strncmp(name, r->namespaces[i], k) && !strncmp(name + k, KVT_API_NS_SEP, LIT(KVT_API_NS_SEP)) &&
            name[k + LIT(KVT_API_NS_SEP)]) {
            *ns = r->namespaces[i];
            *ns_len = k;
            return name + k + LIT(KVT_API_NS_SEP);
        }
    }
    return name;
}

/* A function_call item (arguments "" while in progress). */
static json_t *function_call_item(const kvt_request *r, const kvt_tool_call *c, const char *status, bool with_args)
{
    char fid[128];
    derived_id(fid, sizeof fid, "fc_", c->id);
    const char *ns;
    size_t ns_len;
    const char *name = responses_name(r, c, &ns, &ns_len);
    json_t *v = json_pack("{s:s, s:s, s:s, s:o, s:o, s:o}", "id", fid, "type", "function_call", "status", status,
                          "call_id", jcstr(c->id), "name", jcstr(name), "arguments",
                          with_args ? jcstr(c->arguments) : json_string(""));
    if (v && ns && json_object_set_new(v, "namespace", jstr(ns, ns_len))) {
        json_decref(v);
        return NULL;
    }
    return v;
}

/* Whether the Responses output has a message item: when there is text, or
 * nothing else to show. */
static bool has_message(size_t len, size_t n_calls) { return len > 0 || n_calls == 0; }

/* The output items of a finished response. */
static json_t *responses_output(const kvt_request *r, const char *id, const char *text, size_t len,
                                const kvt_tool_call *calls, size_t n_calls, const char *finish,
                                const kvt_logprobs *lp)
{
    json_t *out = json_array();
    const char *st = is_length(finish) ? "incomplete" : "completed";
    if (out && has_message(len, n_calls) &&
        json_array_append_new(out, message_item(r, id, jstr(text, len), st, lp))) {
        json_decref(out);
        return NULL;
    }
    for (size_t k = 0; out && k < n_calls; k++)
        if (json_array_append_new(out, function_call_item(r, &calls[k], "completed", true))) {
            json_decref(out);
            return NULL;
        }
    return out;
}

/* A Response object; output and usage are stolen (NULL: out of memory).
 * finish "length" makes a completed response incomplete, as OpenAI reports a
 * max_output_tokens cut. The request's tools and instructions are not echoed
 * (a coding agent's run to tens of kilobytes); the sampling fields are. */
static json_t *response_obj(const kvt_request *r, const char *id, const char *model_name, long created,
                            const char *status, json_t *output, json_t *usage, const char *finish)
{
    bool incomplete = !strcmp(status, "completed") && is_length(finish);
    json_t *details = incomplete ? json_pack("{s:s}", "reason", "max_output_tokens") : json_null();
    json_t *v = json_pack("{s:o, s:s, s:I, s:s, s:n, s:o, s:n, s:o, s:o, s:o, s:b, s:n, s:{s:n, s:n},"
                          " s:b, s:f, s:{s:{s:s}}, s:s, s:[], s:f, s:s, s:o, s:{}}",
                          "id", jcstr(id), "object", "response", "created_at", (json_int_t)created,
                          "status", incomplete ? "incomplete" : status, "error", "incomplete_details", details,
                          "instructions", "max_output_tokens",
                          r->max_tokens ? json_integer((json_int_t)r->max_tokens) : json_null(),
                          "model", jcstr(model_name), "output", output,
                          "parallel_tool_calls", 1, "previous_response_id", "reasoning", "effort", "summary",
                          "store", 0, "temperature", float_echo(r->temperature), "text", "format", "type", "text",
                          "tool_choice", "auto", "tools", "top_p", r->top_p < 1e-30f ? 0.0 : float_echo(r->top_p),
                          "truncation", "disabled", "usage", usage, "metadata");
    return v;
}

/* One Responses event: type and the next sequence_number added to v (stolen). */
static void rsse(kvt_request *r, kvt_wbuf *b, const char *type, json_t *v)
{
    if (v && (json_object_set_new(v, "type", json_string(type)) ||
              json_object_set_new(v, "sequence_number", json_integer((json_int_t)r->sse_seq++)))) {
        json_decref(v);
        v = NULL;
    }
    sse_f(b, type, v, responses_flags(r));
}

/* ---- complete responses ---------------------------------------------------- */

char *kvt_response_json_lp(const kvt_request *r, const char *id, const char *model_name,
                           const char *text, size_t len, const kvt_tool_call *calls, size_t n_calls,
                           const char *finish, const char *stop_seq, const kvt_usage *u, long created,
                           const kvt_logprobs *lp)
{
    if (!r) return NULL;
    if (!text) len = 0;
    if (!calls) n_calls = 0;
    if (!text) text = "";
    /* thinking mode: the reasoning text[0, rlen) goes in its own field or
     * block, and from here on text is the answer */
    const char *reasoning = text;
    size_t rlen = 0;
    bool think = reply_thinks(r);
    if (think) {
        kvt_think th;
        kvt_think_parts(r->tmpl, text, len, false, &th);
        reasoning = text + th.rs;
        rlen = th.re - th.rs;
        text += th.as;
        len -= th.as;
    }
    switch (r->api) {
    case KVT_API_CHAT: {
        /* content is null when the reply is only tool calls, as OpenAI sends it */
        json_t *msg = json_pack("{s:s, s:o, s:n}", "role", "assistant", "content",
                                len || !n_calls ? jstr(text, len) : json_null(), "refusal");
        /* reasoning_content: DeepSeek's API and llama.cpp's server return
         * the reasoning so; a client sends it back with the kvt_turn */
        if (msg && think && json_object_set_new(msg, "reasoning_content", jstr(reasoning, rlen))) {
            json_decref(msg);
            msg = NULL;
        }
        json_t *tc = n_calls ? json_array() : NULL;
        for (size_t k = 0; tc && k < n_calls; k++)
            if (json_array_append_new(tc, openai_call_json(&calls[k], k, false))) { json_decref(tc); tc = NULL; }
        if (msg && n_calls && (!tc || json_object_set_new(msg, "tool_calls", tc))) {
            json_decref(msg);
            msg = NULL;
        }
        return dump(json_pack("{s:o, s:s, s:I, s:o, s:[{s:i, s:o, s:o, s:s}], s:o}",
                              "id", jcstr(id), "object", "chat.completion", "created", (json_int_t)created,
                              "model", jcstr(model_name),
                              "choices", "index", 0, "message", msg, "logprobs", chat_logprobs(r, lp),
                              "finish_reason", openai_finish(finish, n_calls),
                              "usage", usage_openai(u)));
    }
    case KVT_API_COMPLETIONS:
        return dump(json_pack("{s:o, s:s, s:I, s:o, s:[{s:o, s:i, s:o, s:s}], s:o}",
                              "id", jcstr(id), "object", "text_completion", "created", (json_int_t)created,
                              "model", jcstr(model_name),
                              "choices", "text", jstr(text, len), "index", 0, "logprobs", legacy_logprobs(r, lp),
                              "finish_reason", openai_finish(finish, 0),
                              "usage", usage_openai(u)));
    case KVT_API_MESSAGES: {
        uint32_t out = u ? u->completion_tokens : 0;
        json_t *content = json_array();
        if (content && think && json_array_append_new(content, thinking_block(jstr(reasoning, rlen)))) {
            json_decref(content);
            content = NULL;
        }
        if (content && (len || !n_calls) &&
            json_array_append_new(content, json_pack("{s:s, s:o}", "type", "text", "text", jstr(text, len)))) {
            json_decref(content);
            content = NULL;
        }
        for (size_t k = 0; content && k < n_calls; k++)
            if (json_array_append_new(content, anthropic_tool_use(&calls[k], false))) {
                json_decref(content);
                content = NULL;
            }
        return dump(json_pack("{s:o, s:s, s:s, s:o, s:o, s:s, s:o, s:o}",
                              "id", jcstr(id), "type", "message", "role", "assistant", "model", jcstr(model_name),
                              "content", content,
                              "stop_reason", anthropic_stop(finish, stop_seq, n_calls),
                              "stop_sequence", anthropic_stop_seq(finish, stop_seq, n_calls),
                              "usage", usage_anthropic(u, out)));
    }
    case KVT_API_RESPONSES:
        return dump_f(response_obj(r, id, model_name, created, "completed",
                                   responses_output(r, id, text, len, calls, n_calls, finish, lp),
                                   usage_responses(u), finish),
                      responses_flags(r));
    }
    return NULL;
}

char *kvt_response_json_calls(const kvt_request *r, const char *id, const char *model_name,
                              const char *text, size_t len, const kvt_tool_call *calls, size_t n_calls,
                              const char *finish, const char *stop_seq, const kvt_usage *u, long created)
{
    return kvt_response_json_lp(r, id, model_name, text, len, calls, n_calls, finish, stop_seq, u, created, NULL);
}

char *kvt_response_json(const kvt_request *r, const char *id, const char *model_name,
                        const char *text, size_t len, const char *finish, const char *stop_seq,
                        const kvt_usage *u, long created)
{
    return kvt_response_json_calls(r, id, model_name, text, len, NULL, 0, finish, stop_seq, u, created);
}

/* ---- streaming ------------------------------------------------------------ */

/* An OpenAI chunk around choices (stolen: an array, empty for the usage
 * chunk). usage (stolen) NULL: "usage": null when the client asked for usage
 * (OpenAI sends it on every chunk then), absent otherwise. */
static json_t *chunk(const kvt_request *r, const char *id, const char *model_name, long created,
                     json_t *choices, json_t *usage)
{
    json_t *c = json_pack("{s:o, s:s, s:I, s:o, s:o}", "id", jcstr(id),
                          "object", r->api == KVT_API_CHAT ? "chat.completion.chunk" : "text_completion",
                          "created", (json_int_t)created, "model", jcstr(model_name), "choices", choices);
    if (c && (usage || r->include_usage) && json_object_set_new(c, "usage", usage ? usage : json_null())) {
        json_decref(c);
        return NULL;
    }
    if (!c) json_decref(usage);
    return c;
}

/* The one choice of an OpenAI chunk: a chat delta (stolen) or completion text
 * (stolen), with logprobs (stolen; NULL: null) and finish_reason (NULL:
 * null). */
static json_t *choice(const kvt_request *r, json_t *content, json_t *logprobs, const char *finish)
{
    json_t *fr = finish ? jcstr(finish) : json_null();
    json_t *lp = logprobs ? logprobs : json_null();
    if (r->api == KVT_API_CHAT)
        return json_pack("[{s:i, s:o, s:o, s:o}]", "index", 0, "delta", content, "logprobs", lp, "finish_reason", fr);
    return json_pack("[{s:o, s:i, s:o, s:o}]", "text", content, "index", 0, "logprobs", lp, "finish_reason", fr);
}

/* Responses: the message item and its text part come into being (the first
 * text, or the end of a reply with neither text nor calls). */
static void responses_open_text(kvt_request *r, kvt_wbuf *b, const char *id)
{
    char mid[128];
    derived_id(mid, sizeof mid, "msg_", id);
    rsse(r, b, "response.output_item.added",
         json_pack("{s:i, s:o}", "output_index", 0, "item", message_item(r, id, NULL, "in_progress", NULL)));
    rsse(r, b, "response.content_part.added",
         json_pack("{s:s, s:i, s:i, s:o}", "item_id", mid, "output_index", 0, "content_index", 0, "part",
                   output_text_part(r, json_string(""), NULL)));
    r->sse_text_open = true;
}

char *kvt_stream_begin(kvt_request *r, const char *id, const char *model_name,
                       const kvt_usage *u, long created)
{
    if (!r) return NULL;
    kvt_wbuf b = {0};
    r->sse_seq = 0;
    r->sse_text_open = false;
    if (r->api == KVT_API_CHAT) {
        sse(&b, NULL, chunk(r, id, model_name, created,
                            choice(r, json_pack("{s:s, s:s}", "role", "assistant", "content", ""), NULL, NULL),
                            NULL));
    } else if (r->api == KVT_API_MESSAGES) {
        sse(&b, "message_start",
            json_pack("{s:s, s:{s:o, s:s, s:s, s:[], s:o, s:n, s:n, s:o}}", "type", "message_start", "message",
                      "id", jcstr(id), "type", "message", "role", "assistant", "content", "model",
                      jcstr(model_name), "stop_reason", "stop_sequence", "usage",
                      usage_anthropic(u, u ? u->completion_tokens : 0)));
        /* the reply's first block: its reasoning in thinking mode (the text
         * block follows when the answer begins), else its text */
        json_t *blk = reply_thinks(r) ? thinking_block(json_string(""))
                                      : json_pack("{s:s, s:s}", "type", "text", "text", "");
        sse(&b, "content_block_start",
            json_pack("{s:s, s:i, s:o}", "type", "content_block_start", "index", 0, "content_block", blk));
        sse(&b, "ping", json_pack("{s:s}", "type", "ping"));
    } else if (r->api == KVT_API_RESPONSES) {
        static const char *const events[] = {"response.created", "response.in_progress"};
        for (int i = 0; i < 2; i++)
            rsse(r, &b, events[i],
                 json_pack("{s:o}", "response",
                           response_obj(r, id, model_name, created, "in_progress", json_array(), json_null(),
                                        NULL)));
    }
    return finish_buf(&b);
}

/* Thinking mode, Anthropic: the answer begins, so the thinking block (index
 * 0) closes and the text block opens after it; for OpenAI chat only the
 * state moves (a reasoning piece after this would come out of order). */
static void open_answer(kvt_request *r, kvt_wbuf *b)
{
    if (!reply_thinks(r) || r->sse_text_open) return;
    r->sse_text_open = true;
    if (r->api != KVT_API_MESSAGES) return;
    sse(b, "content_block_stop", json_pack("{s:s, s:i}", "type", "content_block_stop", "index", 0));
    sse(b, "content_block_start",
        json_pack("{s:s, s:i, s:{s:s, s:s}}", "type", "content_block_start", "index", anthropic_text_index(r),
                  "content_block", "type", "text", "text", ""));
}

char *kvt_stream_reasoning_lp(kvt_request *r, const char *id, const char *model_name,
                              const char *text, size_t len, long created, const kvt_logprobs *lp)
{
    if (!r) return NULL;
    kvt_wbuf b = {0};
    if (text && len && reply_thinks(r) && !r->sse_text_open) {
        json_t *t = jstr(text, len);
        if (r->api == KVT_API_CHAT)
            sse(&b, NULL, chunk(r, id, model_name, created,
                                choice(r, json_pack("{s:o}", "reasoning_content", t), chat_logprobs(r, lp), NULL),
                                NULL));
        else
            sse(&b, "content_block_delta",
                json_pack("{s:s, s:i, s:{s:s, s:o}}", "type", "content_block_delta", "index", 0, "delta", "type",
                          "thinking_delta", "thinking", t));
    }
    return finish_buf(&b);
}

char *kvt_stream_reasoning(kvt_request *r, const char *id, const char *model_name,
                           const char *text, size_t len, long created)
{
    return kvt_stream_reasoning_lp(r, id, model_name, text, len, created, NULL);
}

char *kvt_stream_delta_lp(kvt_request *r, const char *id, const char *model_name,
                          const char *text, size_t len, long created, const kvt_logprobs *lp)
{
    if (!r) return NULL;
    kvt_wbuf b = {0};
    if (text && len) {
        open_answer(r, &b);
        json_t *t = jstr(text, len);
        if (r->api == KVT_API_CHAT) {
            sse(&b, NULL, chunk(r, id, model_name, created,
                                choice(r, json_pack("{s:o}", "content", t), chat_logprobs(r, lp), NULL), NULL));
        } else if (r->api == KVT_API_COMPLETIONS) {
            sse(&b, NULL, chunk(r, id, model_name, created, choice(r, t, legacy_logprobs(r, lp), NULL), NULL));
        } else if (r->api == KVT_API_MESSAGES) {
            sse(&b, "content_block_delta",
                json_pack("{s:s, s:i, s:{s:s, s:o}}", "type", "content_block_delta", "index",
                          anthropic_text_index(r), "delta", "type", "text_delta", "text", t));
        } else {
            if (!r->sse_text_open) responses_open_text(r, &b, id);
            char mid[128];
            derived_id(mid, sizeof mid, "msg_", id);
            rsse(r, &b, "response.output_text.delta",
                 json_pack("{s:s, s:i, s:i, s:o, s:o}", "item_id", mid, "output_index", 0, "content_index", 0,
                           "delta", t, "logprobs", r->logprobs ? logprob_list(lp) : json_array()));
        }
    }
    return finish_buf(&b);
}

char *kvt_stream_delta(kvt_request *r, const char *id, const char *model_name,
                       const char *text, size_t len, long created)
{
    return kvt_stream_delta_lp(r, id, model_name, text, len, created, NULL);
}

/* Responses: close the text (if any), add each call, then response.completed. */
static void responses_end(kvt_request *r, kvt_wbuf *b, const char *id, const char *model_name, const char *text,
                          size_t len, const kvt_tool_call *calls, size_t n_calls, const char *finish,
                          const kvt_usage *u, long created, const kvt_logprobs *lp)
{
    const char *st = is_length(finish) ? "incomplete" : "completed";
    size_t index = 0;
    if (r->sse_text_open || !n_calls) {
        if (!r->sse_text_open) responses_open_text(r, b, id);
        char mid[128];
        derived_id(mid, sizeof mid, "msg_", id);
        rsse(r, b, "response.output_text.done",
             json_pack("{s:s, s:i, s:i, s:o, s:o}", "item_id", mid, "output_index", 0, "content_index", 0, "text",
                       jstr(text, len), "logprobs", r->logprobs ? logprob_list(lp) : json_array()));
        rsse(r, b, "response.content_part.done",
             json_pack("{s:s, s:i, s:i, s:o}", "item_id", mid, "output_index", 0, "content_index", 0, "part",
                       output_text_part(r, jstr(text, len), lp)));
        rsse(r, b, "response.output_item.done",
             json_pack("{s:i, s:o}", "output_index", 0, "item", message_item(r, id, jstr(text, len), st, lp)));
        index = 1;
    }
    for (size_t k = 0; k < n_calls; k++, index++) {
        char fid[128];
        derived_id(fid, sizeof fid, "fc_", calls[k].id);
        json_t *oi = json_integer((json_int_t)index);
        const char *ns;
        size_t ns_len;
        const char *name = responses_name(r, &calls[k], &ns, &ns_len);
        rsse(r, b, "response.output_item.added",
             json_pack("{s:O, s:o}", "output_index", oi, "item",
                       function_call_item(r, &calls[k], "in_progress", false)));
        rsse(r, b, "response.function_call_arguments.delta",
             json_pack("{s:s, s:O, s:o}", "item_id", fid, "output_index", oi, "delta", jcstr(calls[k].arguments)));
        rsse(r, b, "response.function_call_arguments.done",
             json_pack("{s:s, s:O, s:o, s:o}", "item_id", fid, "output_index", oi, "name",
                       jcstr(name),
                       "arguments", jcstr(calls[k].arguments)));
        rsse(r, b, "response.output_item.done",
             json_pack("{s:O, s:o}", "output_index", oi, "item", function_call_item(r, &calls[k], "completed", true)));
        json_decref(oi);
    }
    rsse(r, b, "response.completed",
         json_pack("{s:o}", "response",
                   response_obj(r, id, model_name, created, "completed",
                                responses_output(r, id, text, len, calls, n_calls, finish, lp),
                                usage_responses(u), finish)));
}

char *kvt_stream_end_lp(kvt_request *r, const char *id, const char *model_name,
                        const char *text, size_t len, const kvt_tool_call *calls, size_t n_calls,
                        const char *finish, const char *stop_seq, const kvt_usage *u, long created,
                        const kvt_logprobs *lp)
{
    if (!r) return NULL;
    if (!text) text = "", len = 0;
    if (!calls || r->api == KVT_API_COMPLETIONS) n_calls = 0;
    kvt_wbuf b = {0};
    if (r->api == KVT_API_MESSAGES) {
        /* a thinking reply whose answer never began still gets its (empty)
         * text block, as every reply has one */
        open_answer(r, &b);
        int ti = anthropic_text_index(r);
        sse(&b, "content_block_stop", json_pack("{s:s, s:i}", "type", "content_block_stop", "index", ti));
        for (size_t k = 0; k < n_calls; k++) {
            json_int_t index = (json_int_t)k + ti + 1;
            sse(&b, "content_block_start",
                json_pack("{s:s, s:I, s:o}", "type", "content_block_start", "index", index, "content_block",
                          anthropic_tool_use(&calls[k], true)));
            sse(&b, "content_block_delta",
                json_pack("{s:s, s:I, s:{s:s, s:o}}", "type", "content_block_delta", "index", index, "delta",
                          "type", "input_json_delta", "partial_json", jcstr(call_input_text(&calls[k]))));
            sse(&b, "content_block_stop", json_pack("{s:s, s:I}", "type", "content_block_stop", "index", index));
        }
        sse(&b, "message_delta",
            json_pack("{s:s, s:{s:s, s:o}, s:o}", "type", "message_delta", "delta",
                      "stop_reason", anthropic_stop(finish, stop_seq, n_calls),
                      "stop_sequence", anthropic_stop_seq(finish, stop_seq, n_calls),
                      "usage", usage_anthropic(u, u ? u->completion_tokens : 0)));
        sse(&b, "message_stop", json_pack("{s:s}", "type", "message_stop"));
    } else if (r->api == KVT_API_RESPONSES) {
        responses_end(r, &b, id, model_name, text, len, calls, n_calls, finish, u, created, lp);
    } else {
        /* one chunk per call, with everything: the openai client merges
         * deltas by index, and a whole call is one delta */
        for (size_t k = 0; k < n_calls; k++)
            sse(&b, NULL, chunk(r, id, model_name, created,
                                choice(r, json_pack("{s:[o]}", "tool_calls", openai_call_json(&calls[k], k, true)),
                                       NULL, NULL),
                                NULL));
        /* the completions finish chunk carries text (""), so with logprobs
         * it carries theirs: empty lists */
        json_t *empty = r->api == KVT_API_CHAT ? json_object() : json_string("");
        json_t *elp = r->api == KVT_API_COMPLETIONS && r->logprobs ? legacy_logprobs(r, NULL) : NULL;
        sse(&b, NULL, chunk(r, id, model_name, created, choice(r, empty, elp, openai_finish(finish, n_calls)), NULL));
        if (r->include_usage) sse(&b, NULL, chunk(r, id, model_name, created, json_array(), usage_openai(u)));
        kvt_wbuf_puts(&b, "data: [DONE]\n\n");
    }
    return finish_buf(&b);
}

char *kvt_stream_end_calls(kvt_request *r, const char *id, const char *model_name,
                           const char *text, size_t len, const kvt_tool_call *calls, size_t n_calls,
                           const char *finish, const char *stop_seq, const kvt_usage *u, long created)
{
    return kvt_stream_end_lp(r, id, model_name, text, len, calls, n_calls, finish, stop_seq, u, created, NULL);
}

char *kvt_stream_end(kvt_request *r, const char *id, const char *model_name,
                     const char *finish, const char *stop_seq, const kvt_usage *u, long created)
{
    return kvt_stream_end_calls(r, id, model_name, NULL, 0, NULL, 0, finish, stop_seq, u, created);
}
/* ---- errors and models ---------------------------------------------------- */

const char *kvt_error_type(int status)
{
    switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 500: return "api_error";
    case 503: return "overloaded_error";
    }
    return status >= 400 && status < 500 ? "invalid_request_error" : "api_error";
}

static json_t *error_obj(kvt_api api, int status, const char *message)
{
    if (api == KVT_API_MESSAGES)
        return json_pack("{s:s, s:{s:s, s:o}}", "type", "error", "error", "type", kvt_error_type(status),
                         "message", jcstr(message));
    return json_pack("{s:{s:o, s:s, s:n, s:n}}", "error", "message", jcstr(message), "type",
                     kvt_error_type(status), "param", "code");
}

char *kvt_error_json(kvt_api api, int status, const char *message)
{
    return dump(error_obj(api, status, message));
}

/* Responses: an error event, which carries "error" too so that the openai
 * client throws on it, then response.failed, whose response.error Codex
 * reads (it ignores error events). The sequence numbers restart at 0: this
 * call has no request to count with, and the error ends the stream. */
static void responses_error(kvt_wbuf *b, int status, const char *message)
{
    const char *type = kvt_error_type(status);
    sse(b, "error",
        json_pack("{s:s, s:s, s:o, s:n, s:i, s:{s:o, s:s, s:n, s:s}}", "type", "error", "code", type, "message",
                  jcstr(message), "param", "sequence_number", 0, "error", "message", jcstr(message), "type", type,
                  "param", "code", type));
    sse(b, "response.failed",
        json_pack("{s:s, s:i, s:{s:s, s:s, s:s, s:{s:s, s:o}, s:[], s:n}}", "type", "response.failed",
                  "sequence_number", 1, "response", "id", "", "object", "response", "status", "failed", "error",
                  "code", type, "message", jcstr(message), "output", "usage"));
}

char *kvt_stream_error(kvt_api api, int status, const char *message)
{
    kvt_wbuf b = {0};
    if (api == KVT_API_RESPONSES) responses_error(&b, status, message);
    else sse(&b, api == KVT_API_MESSAGES ? "error" : NULL, error_obj(api, status, message));
    return finish_buf(&b);
}

char *kvt_models_json(const char *model_id, long created)
{
    char when[32] = "1970-01-01T00:00:00Z";
    time_t t = (time_t)created;
    struct tm tm;
    if (gmtime_r(&t, &tm)) strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
    return dump(json_pack("{s:s, s:[{s:o, s:s, s:s, s:I, s:s, s:o, s:s}], s:b, s:o, s:o}",
                          "object", "list",
                          "data", "id", jcstr(model_id), "object", "model", "type", "model",
                          "created", (json_int_t)created, "owned_by", "kvtier", "display_name",
                          jcstr(model_id), "created_at", when,
                          "has_more", 0, "first_id", jcstr(model_id), "last_id", jcstr(model_id)));
}
