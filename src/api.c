/* The API-shape layer (api.h): OpenAI and Anthropic request bodies in,
 * rendered prompt text and response / SSE / error bodies out.
 *
 * Why it is shaped so:
 *  - Parsing is strict about what the server uses and lenient about the rest.
 *    Clients send many fields we have no use for (metadata, user, store,
 *    tools, logprobs, ...): those are ignored. A field we do use with a wrong
 *    type or range is a 400 naming the field, because silently falling back
 *    to a default would hide a client bug. Content we cannot honour (images,
 *    audio, tool calls, n > 1) is a 400 too: answering as if it were not there
 *    would be a wrong answer, not a degraded one.
 *  - Templates render message text byte for byte, with fixed separators and
 *    markers, so that a conversation resent with one more turn renders to a
 *    string that extends the previous rendering. That append-only growth is
 *    what lets the session and the disk tier reuse the cached prefix.
 *  - Output JSON is built with jansson and dumped compact (one line, which an
 *    SSE "data:" field needs). Generated text may hold invalid UTF-8 (a byte
 *    token, a cut character); it is repaired to U+FFFD, never dropped whole.
 *
 * docs/API.md is the user-facing description of all of this.
 */
#include "api.h"
#include "buf.h"
#include "util.h"

#include <float.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The DeepSeek chat markers; each is one special token of the built-in byte
 * tokenizer (src/tokenizer.c, ids 256..259). ｜ is U+FF5C, ▁ is U+2581. */
#define FW_BAR "\xef\xbd\x9c"
#define SP_MARK "\xe2\x96\x81"
#define DS_BOS "<" FW_BAR "begin" SP_MARK "of" SP_MARK "sentence" FW_BAR ">"
#define DS_EOS "<" FW_BAR "end" SP_MARK "of" SP_MARK "sentence" FW_BAR ">"
#define DS_USER "<" FW_BAR "User" FW_BAR ">"
#define DS_ASSISTANT "<" FW_BAR "Assistant" FW_BAR ">"
/* Between system texts, content parts, and (plain template) messages. */
#define SEP "\n\n"

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

/* A top-level field; null counts as absent (clients send null for "unset"). */
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

/* ---- messages ------------------------------------------------------------- */

enum { ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT };

/* One message reduced to its role and text (its parts joined). */
typedef struct turn {
    int role;
    char *text;  /* (len) bytes, malloc'ed */
    size_t len;
} turn;

typedef struct chat {
    turn *t;     /* (n) in request order, Anthropic's "system" first */
    size_t n, cap;
} chat;

static void chat_free(chat *c)
{
    for (size_t i = 0; i < c->n; i++) free(c->t[i].text);
    free(c->t);
    *c = (chat){0};
}

/* Append the text of content c (a string, or an array of parts / blocks) to
 * b. Text parts are joined with SEP; any other part type is refused. where
 * names c in messages ("messages[2].content", "system"). */
static int content_text(kvt_wbuf *b, const json_t *c, const char *where, int *status)
{
    if (json_is_string(c)) {
        kvt_wbuf_put(b, json_string_value(c), json_string_length(c));
        return KVT_OK;
    }
    if (!json_is_array(c))
        return bad(status, "\"%s\": expected a string or an array of content parts, got %s", where, type_name(c));
    size_t i, n_text = 0;
    json_t *part;
    json_array_foreach(c, i, part) {
        if (!json_is_object(part))
            return bad(status, "\"%s[%zu]\": expected an object, got %s", where, i, type_name(part));
        json_t *ty = json_object_get(part, "type");
        if (!json_is_string(ty))
            return bad(status, "\"%s[%zu].type\": expected a string, got %s", where, i,
                       ty ? type_name(ty) : "nothing");
        const char *t = json_string_value(ty);
        if (strcmp(t, "text") != 0) {
            bool media = !strcmp(t, "image_url") || !strcmp(t, "image") || !strcmp(t, "input_audio") ||
                         !strcmp(t, "audio") || !strcmp(t, "file") || !strcmp(t, "document");
            bool tool = !strncmp(t, "tool_", 5) || !strcmp(t, "server_tool_use");
            return bad(status, "\"%s[%zu]\": content of type \"%.40s\" is not supported%s", where, i, t,
                       media ? ": this model reads text only"
                       : tool ? ": this server does not do tool calls"
                       : "; send text parts");
        }
        json_t *tx = json_object_get(part, "text");
        if (!json_is_string(tx))
            return bad(status, "\"%s[%zu].text\": expected a string, got %s", where, i,
                       tx ? type_name(tx) : "nothing");
        /* cache_control (Anthropic prompt caching hints) and any other key of
         * the part are ignored: kvtier caches every prefix on its own. */
        if (n_text++) kvt_wbuf_put(b, SEP, sizeof SEP - 1);
        kvt_wbuf_put(b, json_string_value(tx), json_string_length(tx));
    }
    return KVT_OK;
}

/* Add a turn whose text is content c. */
static int chat_add(chat *ch, int role, const json_t *c, const char *where, int *status)
{
    if (ch->n == ch->cap) {
        size_t cap = ch->cap ? ch->cap * 2 : 8, bytes; /* cap <= 2 x the JSON array's size + 8 */
        turn *t = kvt_mul_ok(cap, sizeof *t, &bytes) ? realloc(ch->t, bytes) : NULL;
        if (!t) return oom(status);
        ch->t = t;
        ch->cap = cap;
    }
    kvt_wbuf b = {0};
    int rc = c ? content_text(&b, c, where, status) : KVT_OK;
    if (!rc && b.oom) rc = oom(status);
    if (!rc) {
        kvt_wbuf_put(&b, "", 1); /* NUL: b.p is never NULL afterwards */
        if (b.oom) rc = oom(status);
    }
    if (rc) { kvt_wbuf_free(&b); return rc; }
    ch->t[ch->n++] = (turn){role, (char *)b.p, b.len - 1};
    return KVT_OK;
}

static int parse_messages(chat *ch, const json_t *root, kvt_api api, int *status)
{
    int rc;
    if (api == KVT_API_MESSAGES) {
        json_t *sys = field(root, "system");
        if (sys && !json_is_string(sys) && !json_is_array(sys))
            return bad(status, "\"system\": expected a string or an array of text blocks, got %s", type_name(sys));
        /* An empty system prompt is no system prompt. */
        if (sys && (json_is_string(sys) ? json_string_length(sys) : json_array_size(sys)) > 0 &&
            (rc = chat_add(ch, ROLE_SYSTEM, sys, "system", status)))
            return rc;
    }
    json_t *msgs = json_object_get(root, "messages");
    if (!msgs || json_is_null(msgs)) return bad(status, "\"messages\": required");
    if (!json_is_array(msgs)) return bad(status, "\"messages\": expected an array, got %s", type_name(msgs));
    if (json_array_size(msgs) == 0) return bad(status, "\"messages\": must hold at least one message");
    size_t i;
    json_t *msg;
    json_array_foreach(msgs, i, msg) {
        char where[48];
        snprintf(where, sizeof where, "messages[%zu].content", i);
        if (!json_is_object(msg)) return bad(status, "\"messages[%zu]\": expected an object, got %s", i, type_name(msg));
        json_t *jr = json_object_get(msg, "role");
        if (!json_is_string(jr))
            return bad(status, "\"messages[%zu].role\": expected a string, got %s", i, jr ? type_name(jr) : "nothing");
        const char *rs = json_string_value(jr);
        int role;
        if (!strcmp(rs, "user")) role = ROLE_USER;
        else if (!strcmp(rs, "assistant")) role = ROLE_ASSISTANT;
        else if (!strcmp(rs, "system") || !strcmp(rs, "developer")) role = ROLE_SYSTEM;
        else if (!strcmp(rs, "tool") || !strcmp(rs, "function"))
            return bad(status, "\"messages[%zu]\": role \"%s\" is not supported: this server does not do tool calls", i, rs);
        else
            return bad(status, "\"messages[%zu].role\": unknown role \"%.40s\"", i, rs);
        json_t *tc = field(msg, "tool_calls"), *fc = field(msg, "function_call");
        if ((tc && (!json_is_array(tc) || json_array_size(tc) > 0)) || fc)
            return bad(status, "\"messages[%zu]\": tool calls are not supported by this server", i);
        json_t *c = field(msg, "content");
        /* OpenAI allows an assistant message without content (it then
         * carries tool calls, refused above): render it as empty text. */
        if (!c && role != ROLE_ASSISTANT) return bad(status, "\"%s\": required", where);
        if ((rc = chat_add(ch, role, c, where, status))) return rc;
    }
    return KVT_OK;
}

/* ---- templates ------------------------------------------------------------ */

static void put_str(kvt_wbuf *b, const char *s) { kvt_wbuf_put(b, s, strlen(s)); }

/* deepseek: BOS, every system text (joined with SEP, hoisted to the front as
 * DeepSeek's own template does), then each turn as <｜User｜>text or
 * <｜Assistant｜>text<｜end▁of▁sentence｜>, then <｜Assistant｜> to prompt the
 * reply. A conversation that ends with an assistant turn is a prefill: that
 * turn stays open (no end-of-sentence, no new marker) and the reply continues
 * its text. Either way each rendering is a prefix of the next one. */
static void render_deepseek(kvt_wbuf *b, const chat *ch)
{
    put_str(b, DS_BOS);
    size_t n_sys = 0, last = SIZE_MAX;
    for (size_t i = 0; i < ch->n; i++) {
        if (ch->t[i].role != ROLE_SYSTEM) { last = i; continue; }
        if (n_sys++) put_str(b, SEP);
        kvt_wbuf_put(b, ch->t[i].text, ch->t[i].len);
    }
    for (size_t i = 0; i < ch->n; i++) {
        const turn *t = &ch->t[i];
        if (t->role == ROLE_SYSTEM) continue;
        put_str(b, t->role == ROLE_USER ? DS_USER : DS_ASSISTANT);
        kvt_wbuf_put(b, t->text, t->len);
        if (t->role == ROLE_ASSISTANT && i != last) put_str(b, DS_EOS);
    }
    if (last == SIZE_MAX || ch->t[last].role != ROLE_ASSISTANT) put_str(b, DS_ASSISTANT);
}

/* plain: the text of every message in order, joined with SEP, no markers. For
 * models trained on raw text, the reply continues the last message. */
static void render_plain(kvt_wbuf *b, const chat *ch)
{
    for (size_t i = 0; i < ch->n; i++) {
        if (i) put_str(b, SEP);
        kvt_wbuf_put(b, ch->t[i].text, ch->t[i].len);
    }
}

const char *kvt_template_name(const kvt_model *m)
{
    if (!m) return "plain";
    kvt_model_info info;
    kvt_model_info_get(m, &info);
    return info.arch && !strcmp(info.arch, "ds4") ? "deepseek" : "plain";
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
    memset(r, 0, sizeof *r);
}

static int parse_sampling(kvt_request *r, const json_t *root, kvt_api api, int *status)
{
    int rc;
    bool present;
    int64_t x;
    const bool openai = api != KVT_API_MESSAGES;

    json_t *model = field(root, "model");
    if (model) {
        if (!json_is_string(model)) return bad(status, "\"model\": expected a string, got %s", type_name(model));
        if (!(r->model = kvt_strndup(json_string_value(model), json_string_length(model)))) return oom(status);
    }
    if ((rc = get_bool(root, "stream", &r->stream, status))) return rc;
    if (openai) {
        json_t *so = field(root, "stream_options");
        if (so && !json_is_object(so))
            return bad(status, "\"stream_options\": expected an object, got %s", type_name(so));
        json_t *iu = so ? field(so, "include_usage") : NULL;
        if (iu && !json_is_boolean(iu))
            return bad(status, "\"stream_options.include_usage\": expected a boolean, got %s", type_name(iu));
        r->include_usage = iu && json_is_true(iu);
    }

    /* max_tokens: Anthropic requires it; OpenAI chat prefers its newer name
     * max_completion_tokens when both are sent. */
    const char *mt = "max_tokens";
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

    if (openai) rc = parse_stop(r, root, "stop", true, KVT_API_MAX_STOP_OPENAI, status);
    else rc = parse_stop(r, root, "stop_sequences", false, KVT_API_MAX_STOP_ANTHROPIC, status);
    if (rc) return rc;

    /* Known OpenAI fields whose other values ask for more than one plain
     * completion: refuse rather than quietly answer something else. */
    if (openai) {
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
    return KVT_OK;
}

static int parse_root(kvt_request *r, const json_t *root, kvt_api api, const kvt_model *m, int *status)
{
    int rc = parse_sampling(r, root, api, status);
    if (rc) return rc;
    kvt_wbuf b = {0};
    if (api == KVT_API_COMPLETIONS) {
        rc = completions_prompt(&b, root, status);
    } else {
        chat ch = {0};
        rc = parse_messages(&ch, root, api, status);
        if (!rc) {
            r->prompt_has_bos = !strcmp(kvt_template_name(m), "deepseek");
            if (r->prompt_has_bos) render_deepseek(&b, &ch);
            else render_plain(&b, &ch);
        }
        chat_free(&ch);
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

int kvt_request_parse(kvt_request *out, kvt_api api, const char *body, size_t len,
                      const kvt_model *m, int *status)
{
    int st;
    if (!status) status = &st;
    *status = 500;
    if (!out) return kvt_fail(KVT_EINVAL, "api: NULL request");
    memset(out, 0, sizeof *out);
    if (api != KVT_API_CHAT && api != KVT_API_COMPLETIONS && api != KVT_API_MESSAGES)
        return kvt_fail(KVT_EINVAL, "api: unknown api %d", (int)api);
    if (!body || len == 0) return bad(status, "the request body is empty; send a JSON object");
    json_error_t je;
    /* Flags 0: the top level must be an object or array, and \u0000 is
     * refused (every string here ends up NUL-terminated). jansson bounds the
     * nesting depth, so a hostile body cannot exhaust the stack. */
    json_t *root = json_loadb(body, len, 0, &je);
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
        rc = parse_root(out, root, api, m, status);
    }
    json_decref(root);
    if (rc) {
        kvt_request_free(out);
        return rc;
    }
    *status = 200;
    return KVT_OK;
}

/* ---- JSON output ---------------------------------------------------------- */

/* Length of the well-formed UTF-8 character at s[0..n) (RFC 3629: no
 * overlongs, no surrogates, nothing past U+10FFFF, as jansson checks), or 0. */
static size_t utf8_char(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t need;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) need = 2, cp = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF) need = 3, cp = c & 0x0F;
    else if (c >= 0xF0 && c <= 0xF4) need = 4, cp = c & 0x07;
    else return 0;
    if (n < need) return 0;
    for (size_t i = 1; i < need; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    if (need == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) return 0;
    if (need == 4 && (cp < 0x10000 || cp > 0x10FFFF)) return 0;
    return need;
}

/* A JSON string of any bytes: an invalid byte, with the continuation bytes
 * that follow it, becomes one U+FFFD. NULL on out of memory. */
static json_t *jstr(const char *s, size_t len)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, k;
    while (i < len && (k = utf8_char(u + i, len - i))) i += k;
    if (i == len) return json_stringn(s, len);
    kvt_wbuf b = {0};
    kvt_wbuf_put(&b, s, i);
    while (i < len) {
        if ((k = utf8_char(u + i, len - i))) {
            kvt_wbuf_put(&b, s + i, k);
            i += k;
        } else {
            kvt_wbuf_put(&b, "\xef\xbf\xbd", 3);
            for (i++; i < len && (u[i] & 0xC0) == 0x80; i++) {}
        }
    }
    json_t *v = b.oom ? NULL : json_stringn((const char *)b.p, b.len);
    kvt_wbuf_free(&b);
    return v;
}

static json_t *jcstr(const char *s) { return s ? jstr(s, strlen(s)) : json_string(""); }

/* Dump v (stolen) compact; NULL when v is NULL or out of memory. */
static char *dump(json_t *v)
{
    if (!v) return NULL;
    char *s = json_dumps(v, JSON_COMPACT);
    json_decref(v);
    return s;
}

/* Append one SSE event carrying v (stolen); sets b->oom on failure. */
static void sse(kvt_wbuf *b, const char *event, json_t *v)
{
    char *s = dump(v);
    if (!s) { b->oom = true; return; }
    if (event) {
        put_str(b, "event: ");
        put_str(b, event);
        put_str(b, "\n");
    }
    put_str(b, "data: ");
    put_str(b, s);
    put_str(b, "\n\n");
    free(s);
}

/* The buffer as a malloc'ed string (b is consumed); NULL on out of memory. */
static char *finish_buf(kvt_wbuf *b)
{
    kvt_wbuf_put(b, "", 1);
    if (b->oom) { kvt_wbuf_free(b); return NULL; }
    return (char *)b->p;
}

static json_int_t ji(uint64_t x) { return (json_int_t)x; }

/* Usage with the counts made consistent: cached <= prompt, created <= the
 * prompt tokens that were not cached. */
static kvt_usage usage_of(const kvt_usage *u)
{
    kvt_usage z = u ? *u : (kvt_usage){0};
    if (z.cached_tokens > z.prompt_tokens) z.cached_tokens = z.prompt_tokens;
    if (z.created_tokens > z.prompt_tokens - z.cached_tokens) z.created_tokens = z.prompt_tokens - z.cached_tokens;
    return z;
}

/* OpenAI usage, with DeepSeek's prompt_cache_hit/miss_tokens alongside
 * OpenAI's prompt_tokens_details.cached_tokens. */
static json_t *usage_openai(const kvt_usage *in)
{
    kvt_usage u = usage_of(in);
    return json_pack("{s:I, s:I, s:I, s:{s:I}, s:I, s:I}",
                     "prompt_tokens", ji(u.prompt_tokens),
                     "completion_tokens", ji(u.completion_tokens),
                     "total_tokens", ji((uint64_t)u.prompt_tokens + u.completion_tokens),
                     "prompt_tokens_details", "cached_tokens", ji(u.cached_tokens),
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

static const char *openai_finish(const char *finish) { return finish ? finish : "stop"; }

static const char *anthropic_stop(const char *finish, const char *stop_seq)
{
    if (finish && !strcmp(finish, "length")) return "max_tokens";
    return stop_seq ? "stop_sequence" : "end_turn";
}

/* stop_sequence: the matched sequence, only with stop_reason "stop_sequence". */
static json_t *anthropic_stop_seq(const char *finish, const char *stop_seq)
{
    return !strcmp(anthropic_stop(finish, stop_seq), "stop_sequence") ? jcstr(stop_seq) : json_null();
}

char *kvt_response_json(const kvt_request *r, const char *id, const char *model_name,
                        const char *text, size_t len, const char *finish, const char *stop_seq,
                        const kvt_usage *u, long created)
{
    if (!r) return NULL;
    if (!text) len = 0;
    json_t *t = jstr(text ? text : "", len);
    switch (r->api) {
    case KVT_API_CHAT:
        return dump(json_pack("{s:o, s:s, s:I, s:o, s:[{s:i, s:{s:s, s:o, s:n}, s:n, s:s}], s:o}",
                              "id", jcstr(id), "object", "chat.completion", "created", (json_int_t)created,
                              "model", jcstr(model_name),
                              "choices", "index", 0, "message", "role", "assistant", "content", t, "refusal",
                              "logprobs", "finish_reason", openai_finish(finish),
                              "usage", usage_openai(u)));
    case KVT_API_COMPLETIONS:
        return dump(json_pack("{s:o, s:s, s:I, s:o, s:[{s:o, s:i, s:n, s:s}], s:o}",
                              "id", jcstr(id), "object", "text_completion", "created", (json_int_t)created,
                              "model", jcstr(model_name),
                              "choices", "text", t, "index", 0, "logprobs", "finish_reason", openai_finish(finish),
                              "usage", usage_openai(u)));
    case KVT_API_MESSAGES: {
        uint32_t out = u ? u->completion_tokens : 0;
        return dump(json_pack("{s:o, s:s, s:s, s:o, s:[{s:s, s:o}], s:s, s:o, s:o}",
                              "id", jcstr(id), "type", "message", "role", "assistant", "model", jcstr(model_name),
                              "content", "type", "text", "text", t,
                              "stop_reason", anthropic_stop(finish, stop_seq),
                              "stop_sequence", anthropic_stop_seq(finish, stop_seq),
                              "usage", usage_anthropic(u, out)));
    }
    }
    json_decref(t);
    return NULL;
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
 * (stolen), with finish_reason (NULL: null). */
static json_t *choice(const kvt_request *r, json_t *content, const char *finish)
{
    json_t *fr = finish ? jcstr(finish) : json_null();
    if (r->api == KVT_API_CHAT)
        return json_pack("[{s:i, s:o, s:n, s:o}]", "index", 0, "delta", content, "logprobs", "finish_reason", fr);
    return json_pack("[{s:o, s:i, s:n, s:o}]", "text", content, "index", 0, "logprobs", "finish_reason", fr);
}

char *kvt_stream_begin(const kvt_request *r, const char *id, const char *model_name,
                       const kvt_usage *u, long created)
{
    if (!r) return NULL;
    kvt_wbuf b = {0};
    if (r->api == KVT_API_CHAT) {
        sse(&b, NULL, chunk(r, id, model_name, created,
                            choice(r, json_pack("{s:s, s:s}", "role", "assistant", "content", ""), NULL), NULL));
    } else if (r->api == KVT_API_MESSAGES) {
        sse(&b, "message_start",
            json_pack("{s:s, s:{s:o, s:s, s:s, s:[], s:o, s:n, s:n, s:o}}", "type", "message_start", "message",
                      "id", jcstr(id), "type", "message", "role", "assistant", "content", "model",
                      jcstr(model_name), "stop_reason", "stop_sequence", "usage",
                      usage_anthropic(u, u ? u->completion_tokens : 0)));
        sse(&b, "content_block_start",
            json_pack("{s:s, s:i, s:{s:s, s:s}}", "type", "content_block_start", "index", 0, "content_block",
                      "type", "text", "text", ""));
        sse(&b, "ping", json_pack("{s:s}", "type", "ping"));
    }
    return finish_buf(&b);
}

char *kvt_stream_delta(const kvt_request *r, const char *id, const char *model_name,
                       const char *text, size_t len, long created)
{
    if (!r) return NULL;
    kvt_wbuf b = {0};
    if (text && len) {
        json_t *t = jstr(text, len);
        if (r->api == KVT_API_CHAT)
            sse(&b, NULL, chunk(r, id, model_name, created, choice(r, json_pack("{s:o}", "content", t), NULL), NULL));
        else if (r->api == KVT_API_COMPLETIONS)
            sse(&b, NULL, chunk(r, id, model_name, created, choice(r, t, NULL), NULL));
        else
            sse(&b, "content_block_delta",
                json_pack("{s:s, s:i, s:{s:s, s:o}}", "type", "content_block_delta", "index", 0, "delta", "type",
                          "text_delta", "text", t));
    }
    return finish_buf(&b);
}

char *kvt_stream_end(const kvt_request *r, const char *id, const char *model_name,
                     const char *finish, const char *stop_seq, const kvt_usage *u, long created)
{
    if (!r) return NULL;
    kvt_wbuf b = {0};
    if (r->api == KVT_API_MESSAGES) {
        sse(&b, "content_block_stop", json_pack("{s:s, s:i}", "type", "content_block_stop", "index", 0));
        sse(&b, "message_delta",
            json_pack("{s:s, s:{s:s, s:o}, s:o}", "type", "message_delta", "delta",
                      "stop_reason", anthropic_stop(finish, stop_seq),
                      "stop_sequence", anthropic_stop_seq(finish, stop_seq),
                      "usage", usage_anthropic(u, u ? u->completion_tokens : 0)));
        sse(&b, "message_stop", json_pack("{s:s}", "type", "message_stop"));
    } else {
        json_t *empty = r->api == KVT_API_CHAT ? json_object() : json_string("");
        sse(&b, NULL, chunk(r, id, model_name, created, choice(r, empty, openai_finish(finish)), NULL));
        if (r->include_usage) sse(&b, NULL, chunk(r, id, model_name, created, json_array(), usage_openai(u)));
        put_str(&b, "data: [DONE]\n\n");
    }
    return finish_buf(&b);
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

char *kvt_stream_error(kvt_api api, int status, const char *message)
{
    kvt_wbuf b = {0};
    sse(&b, api == KVT_API_MESSAGES ? "error" : NULL, error_obj(api, status, message));
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
