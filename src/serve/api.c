/* The request side of the API-shape layer (api.h): OpenAI chat /
 * completions / Responses and Anthropic request bodies in (reply.c: response
 * / SSE / error bodies out).
 *
 * Who owns what: this file reads every api's request body into the neutral
 * conversation of template.h (kvt_chat: turns, tool calls, the function
 * tools in canonical form, the thinking-mode request) and hands it to the
 * model's template (kvt_template_for), which renders the prompt. The chat
 * templates, every marker and fixed text they write, the tool-call parser
 * of generated text and the thinking split are template.c's; this file
 * knows no marker. What stays here is the api side of a request: the
 * request fields, the canonical JSON of tool definitions and call arguments
 * (request content) and the volatile-line filter. The reply side (response,
 * SSE, error and model-list bodies, the tool calls of generated text) is
 * reply.c's.
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
 *    parser of the template that rendered the prompt (reply.c).
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
