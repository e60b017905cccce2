/* The Gemma templates: gemma3 (Gemma 3's template; Gemma 2's,
 * models/templates/google-gemma-2-2b-it.jinja in llama.cpp, is the same but
 * for the system message) and gemma4 (google-gemma-4-31B-it.jinja), and
 * Gemma 4's tool calls read back out of generated text. template_impl.h lists what it shares with the
 * other template files; docs/API.md describes them. */
#include "chat/template_impl.h"
#include "base/jsonstr.h"
#include "base/util.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define GEMMA_BOS "<bos>"
#define GEMMA_START "<start_of_turn>"
#define GEMMA_END "<end_of_turn>\n"

/* gemma3, byte for byte:
 *
 *   <bos>, then per message <start_of_turn>ROLE\nTEXT<end_of_turn>\n, ROLE
 *   "model" for the assistant, else the message's role, TEXT trimmed; a first
 *   system (or developer) message is no turn: its text and "\n\n" go before
 *   the first turn's text
 *
 * then <start_of_turn>model\n. The template has no tools and no tool calls:
 * tools are not written, an assistant turn is its text (its calls are not
 * written) and a tool result a "tool" turn. It raises when the roles do not
 * alternate user, assistant, user...; kvtier renders those conversations
 * all the same, each message its own turn. A prefill (the last turn an
 * assistant's without calls) leaves out its <end_of_turn>\n and the
 * generation prompt (false). */
bool kvt_render_gemma3(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user)
{
    kvt_wbuf_puts(b, GEMMA_BOS);
    size_t i0 = ch->n && kvt_role_is_system(ch->t[0].role);
    for (size_t i = i0; i < ch->n; i++) {
        const kvt_turn *t = &ch->t[i];
        kvt_wbuf_puts(b, GEMMA_START);
        kvt_wbuf_puts(b, t->role == KVT_ROLE_ASSISTANT ? "model" : kvt_tpl_role(t->role));
        kvt_wbuf_puts(b, "\n");
        if (i == i0 && i0) {
            kvt_wbuf_put(b, ch->t[0].text, ch->t[0].len);
            kvt_wbuf_puts(b, "\n\n");
        }
        kvt_tpl_put_trim(b, t->text, t->len);
        if (i + 1 == ch->n && t->role == KVT_ROLE_ASSISTANT && !t->n_calls) return false;
        kvt_wbuf_puts(b, GEMMA_END);
    }
    kvt_wbuf_puts(b, GEMMA_START "model\n");
    return true;
}

/* ---- gemma4 ------------------------------------------------------------------- */

#define G4_Q "<|\"|>" /* the template's string quote (one token) */
#define G4_TURN "<|turn>"
#define G4_TURN_END "<turn|>"
#define G4_THOUGHT "<|channel>thought\n"
#define G4_CHANNEL_END "<channel|>"
#define G4_CALL "<|tool_call>call:"
#define G4_CALL_END "<tool_call|>"
#define G4_RESULT "<|tool_response>"
#define G4_RESULT_END "<tool_response|>"

/* Jinja truthiness of a JSON value (NULL: undefined). */
static bool truthy(const json_t *v)
{
    switch (v ? json_typeof(v) : JSON_NULL) {
    case JSON_STRING: return json_string_length(v) > 0;
    case JSON_INTEGER: return json_integer_value(v) != 0;
    case JSON_REAL: return json_real_value(v) != 0;
    case JSON_TRUE: return true;
    case JSON_OBJECT: return json_object_size(v) > 0;
    case JSON_ARRAY: return json_array_size(v) > 0;
    default: return false;
    }
}

/* An object's keys as `dictsort` orders them: by the key lowercased (ASCII),
 * ties in their order. NULL (b->oom set) when out of memory; *n the count. */
typedef struct g4_key { const char *k; size_t i; } g4_key;

static int key_cmp(const void *x, const void *y)
{
    const g4_key *a = x, *b = y;
    for (size_t i = 0;; i++) {
        int ca = (unsigned char)a->k[i], cb = (unsigned char)b->k[i];
        if (ca >= 'A' && ca <= 'Z') ca += 32;
        if (cb >= 'A' && cb <= 'Z') cb += 32;
        if (ca != cb) return ca - cb;
        if (!ca) return a->i < b->i ? -1 : a->i > b->i;
    }
}

static g4_key *sorted_keys(kvt_wbuf *b, const json_t *o, size_t *n)
{
    *n = json_object_size(o);
    g4_key *v = *n ? calloc(*n, sizeof *v) : NULL;
    if (*n && !v) { b->oom = true; *n = 0; return NULL; }
    const char *k;
    json_t *x;
    size_t i = 0;
    json_object_foreach((json_t *)o, k, x) v[i] = (g4_key){k, i}, i++;
    if (*n > 1) qsort(v, *n, sizeof *v, key_cmp);
    return v;
}

/* A value as the template prints it with {{ }} (Python's str: None, a real
 * as Python spells it). */
static void g4_scalar(kvt_wbuf *b, const json_t *v)
{
    if (json_is_null(v)) kvt_wbuf_puts(b, "None");
    else if (json_is_real(v)) kvt_tpl_py_real(b, json_real_value(v));
    else if (json_is_string(v)) kvt_wbuf_put(b, json_string_value(v), json_string_length(v));
    else kvt_json_scalar(b, v);
}

static void g4_upper(kvt_wbuf *b, const json_t *v)
{
    const char *s = json_is_string(v) ? json_string_value(v) : "";
    for (size_t i = 0; s[i]; i++) {
        char c = s[i] >= 'a' && s[i] <= 'z' ? (char)(s[i] - 32) : s[i];
        kvt_wbuf_put(b, &c, 1);
    }
}

static bool upper_is(const json_t *v, const char *what)
{
    const char *s = json_is_string(v) ? json_string_value(v) : "";
    return strlen(s) == strlen(what) && !strcasecmp(s, what);
}

/* The template's format_argument. */
static void g4_argument(kvt_wbuf *b, const json_t *v, bool escape_keys)
{
    if (json_is_string(v)) {
        kvt_wbuf_puts(b, G4_Q);
        kvt_wbuf_put(b, json_string_value(v), json_string_length(v));
        kvt_wbuf_puts(b, G4_Q);
    } else if (json_is_boolean(v)) {
        kvt_wbuf_puts(b, json_is_true(v) ? "true" : "false");
    } else if (json_is_object(v)) {
        size_t n;
        g4_key *keys = sorted_keys(b, v, &n);
        kvt_wbuf_puts(b, "{");
        for (size_t i = 0; i < n; i++) {
            if (i) kvt_wbuf_puts(b, ",");
            if (escape_keys) kvt_wbuf_puts(b, G4_Q);
            kvt_wbuf_puts(b, keys[i].k);
            if (escape_keys) kvt_wbuf_puts(b, G4_Q);
            kvt_wbuf_puts(b, ":");
            g4_argument(b, json_object_get(v, keys[i].k), escape_keys);
        }
        kvt_wbuf_puts(b, "}");
        free(keys);
    } else if (json_is_array(v)) {
        kvt_wbuf_puts(b, "[");
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i) kvt_wbuf_puts(b, ",");
            g4_argument(b, json_array_get(v, i), escape_keys);
        }
        kvt_wbuf_puts(b, "]");
    } else {
        g4_scalar(b, v);
    }
}

/* <|"|>ITEM<|"|> for each item of a list, "," between them. */
static void g4_quoted_list(kvt_wbuf *b, const json_t *list)
{
    for (size_t i = 0; i < json_array_size(list); i++) {
        if (i) kvt_wbuf_puts(b, ",");
        kvt_wbuf_puts(b, G4_Q);
        g4_scalar(b, json_array_get(list, i));
        kvt_wbuf_puts(b, G4_Q);
    }
}

static void g4_comma(kvt_wbuf *b, bool *add) { if (*add) kvt_wbuf_puts(b, ","); else *add = true; }

/* The template's format_parameters: each property but the schema's own
 * keywords, in dictsort order. */
static void g4_parameters(kvt_wbuf *b, const json_t *props, int depth)
{
    static const char *const standard[] = {"description", "type", "properties", "required", "nullable"};
    if (!json_is_object(props) || depth > 64) return;
    size_t n;
    g4_key *keys = sorted_keys(b, props, &n);
    bool first = true;
    for (size_t i = 0; i < n; i++) {
        const char *key = keys[i].k;
        bool std = false;
        for (size_t s = 0; s < sizeof standard / sizeof *standard; s++) std |= !strcmp(key, standard[s]);
        if (std) continue;
        const json_t *v = json_object_get(props, key), *ty = json_object_get(v, "type");
        if (!first) kvt_wbuf_puts(b, ",");
        first = false;
        kvt_wbuf_puts(b, key);
        kvt_wbuf_puts(b, ":{");
        bool add = false;
        if (truthy(json_object_get(v, "description"))) {
            kvt_wbuf_puts(b, "description:" G4_Q);
            g4_scalar(b, json_object_get(v, "description"));
            kvt_wbuf_puts(b, G4_Q);
            add = true;
        }
        if (upper_is(ty, "STRING")) {
            if (truthy(json_object_get(v, "enum"))) {
                g4_comma(b, &add);
                kvt_wbuf_puts(b, "enum:");
                g4_argument(b, json_object_get(v, "enum"), true);
            }
        } else if (upper_is(ty, "ARRAY")) {
            const json_t *items = json_object_get(v, "items");
            if (json_is_object(items) && json_object_size(items)) {
                g4_comma(b, &add);
                kvt_wbuf_puts(b, "items:{");
                size_t ni;
                g4_key *ik = sorted_keys(b, items, &ni);
                bool ifirst = true;
                for (size_t k = 0; k < ni; k++) {
                    const json_t *iv = json_object_get(items, ik[k].k);
                    if (json_is_null(iv)) continue;
                    if (!ifirst) kvt_wbuf_puts(b, ",");
                    ifirst = false;
                    if (!strcmp(ik[k].k, "properties")) {
                        kvt_wbuf_puts(b, "properties:{");
                        g4_parameters(b, iv, depth + 1);
                        kvt_wbuf_puts(b, "}");
                    } else if (!strcmp(ik[k].k, "required")) {
                        kvt_wbuf_puts(b, "required:[");
                        g4_quoted_list(b, iv);
                        kvt_wbuf_puts(b, "]");
                    } else if (!strcmp(ik[k].k, "type")) {
                        kvt_wbuf_puts(b, "type:");
                        if (json_is_string(iv)) {
                            kvt_wbuf_puts(b, G4_Q);
                            g4_upper(b, iv);
                            kvt_wbuf_puts(b, G4_Q);
                        } else {
                            kvt_wbuf_puts(b, "[");
                            for (size_t x = 0; x < json_array_size(iv); x++) {
                                if (x) kvt_wbuf_puts(b, ",");
                                kvt_wbuf_puts(b, G4_Q);
                                g4_upper(b, json_array_get(iv, x));
                                kvt_wbuf_puts(b, G4_Q);
                            }
                            kvt_wbuf_puts(b, "]");
                        }
                    } else {
                        kvt_wbuf_puts(b, ik[k].k);
                        kvt_wbuf_puts(b, ":");
                        g4_argument(b, iv, true);
                    }
                }
                free(ik);
                kvt_wbuf_puts(b, "}");
            }
        }
        if (truthy(json_object_get(v, "nullable"))) {
            g4_comma(b, &add);
            kvt_wbuf_puts(b, "nullable:true");
        }
        if (upper_is(ty, "OBJECT")) {
            const json_t *p = json_object_get(v, "properties");
            g4_comma(b, &add);
            kvt_wbuf_puts(b, "properties:{");
            g4_parameters(b, json_is_object(p) ? p : v, depth + 1);
            kvt_wbuf_puts(b, "}");
            if (truthy(json_object_get(v, "required"))) {
                g4_comma(b, &add);
                kvt_wbuf_puts(b, "required:[");
                g4_quoted_list(b, json_object_get(v, "required"));
                kvt_wbuf_puts(b, "]");
            }
        }
        g4_comma(b, &add);
        kvt_wbuf_puts(b, "type:" G4_Q);
        g4_upper(b, ty);
        kvt_wbuf_puts(b, G4_Q "}");
    }
    free(keys);
}

/* The template's format_function_declaration, trimmed. */
static void g4_declaration(kvt_wbuf *b, const json_t *fn)
{
    kvt_wbuf d = {0};
    kvt_wbuf_puts(&d, "declaration:");
    g4_scalar(&d, json_object_get(fn, "name"));
    kvt_wbuf_puts(&d, "{description:" G4_Q);
    if (json_object_get(fn, "description")) g4_scalar(&d, json_object_get(fn, "description"));
    kvt_wbuf_puts(&d, G4_Q);
    const json_t *params = json_object_get(fn, "parameters");
    if (truthy(params)) {
        kvt_wbuf_puts(&d, ",parameters:{");
        if (truthy(json_object_get(params, "properties"))) {
            kvt_wbuf_puts(&d, "properties:{");
            g4_parameters(&d, json_object_get(params, "properties"), 0);
            kvt_wbuf_puts(&d, "},");
        }
        if (truthy(json_object_get(params, "required"))) {
            kvt_wbuf_puts(&d, "required:[");
            g4_quoted_list(&d, json_object_get(params, "required"));
            kvt_wbuf_puts(&d, "],");
        }
        if (truthy(json_object_get(params, "type"))) {
            kvt_wbuf_puts(&d, "type:" G4_Q);
            g4_upper(&d, json_object_get(params, "type"));
            kvt_wbuf_puts(&d, G4_Q "}");
        }
    }
    const json_t *resp = json_object_get(fn, "response");
    if (resp) {
        kvt_wbuf_puts(&d, ",response:{");
        if (truthy(json_object_get(resp, "description"))) {
            kvt_wbuf_puts(&d, "description:" G4_Q);
            g4_scalar(&d, json_object_get(resp, "description"));
            kvt_wbuf_puts(&d, G4_Q ",");
        }
        if (upper_is(json_object_get(resp, "type"), "OBJECT")) kvt_wbuf_puts(&d, "type:" G4_Q "OBJECT" G4_Q "}");
    }
    kvt_wbuf_puts(&d, "}");
    if (d.oom) b->oom = true;
    else kvt_tpl_put_trim(b, (const char *)d.p, d.len);
    kvt_wbuf_free(&d);
}

/* The template's strip_thinking: the text without its <|channel>...<channel|>
 * parts, trimmed. */
static void g4_strip_thinking(kvt_wbuf *b, const char *s, size_t n)
{
    kvt_wbuf r = {0};
    for (size_t p = 0; p <= n;) {
        const char *e = kvt_tpl_find(s, p, n, G4_CHANNEL_END, LIT(G4_CHANNEL_END));
        size_t end = e ? (size_t)(e - s) : n;
        const char *o = kvt_tpl_find(s, p, end, "<|channel>", 10);
        kvt_wbuf_put(&r, s + p, (o ? (size_t)(o - s) : end) - p);
        if (!e) break;
        p = end + LIT(G4_CHANNEL_END);
    }
    if (r.oom) b->oom = true;
    else kvt_tpl_put_trim(b, (const char *)r.p, r.len);
    kvt_wbuf_free(&r);
}

/* gemma4: the Gemma 4 template (models/templates/google-gemma-4-31B-it.jinja
 * in llama.cpp), byte for byte where it keeps the history:
 *
 *   <bos>; a system turn when there is system text, tools or thinking mode:
 *   <|turn>system\n, <|think|>\n in thinking mode, the first message's system
 *   text trimmed, each tool as <|tool>declaration:NAME{...}<tool|> (its
 *   schema in the template's own notation), <turn|>\n; then per message
 *   user, system  <|turn>ROLE\nTEXT<turn|>\n, TEXT trimmed
 *   assistant     <|turn>model\n (not again right after another assistant
 *                 turn: a continuation after tool results), its reasoning as
 *                 <|channel>thought\nREASONING\n<channel|>, its calls
 *                 <|tool_call>call:NAME{KEY:VALUE,...}<tool_call|> (keys in
 *                 dictsort order, values in the template's notation), the
 *                 results that follow it each
 *                 <|tool_response>response:NAME{value:<|"|>TEXT<|"|>}<tool_response|>,
 *                 its text (without <|channel> parts, trimmed) and <turn|>\n
 *                 (none after results when it has no text: the model goes on)
 *   tool          written with the calls before it
 *
 * then, unless the last thing written is a result (the model goes on in the
 * same turn), <|turn>model\n and, outside thinking mode, the empty thought
 * channel <|channel>thought\n<channel|>. A result is matched to its call by
 * the order of both (kvtier keeps no result's call id; the template looks
 * the id up).
 *
 * The template writes an assistant turn's reasoning only for a turn with
 * calls after the last user message, and no empty thought channel for an
 * earlier turn, so each new user turn would rewrite the history before it.
 * kvtier writes every turn's reasoning, and outside thinking mode the empty
 * channel after every <|turn>model\n of a turn without reasoning (where the
 * generation prompt had it): each rendering is a prefix of the next. A
 * prefill (the last turn an assistant's without calls) leaves out its
 * <turn|>\n and the generation prompt (false). */
bool kvt_render_gemma4(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user)
{
    bool sys0 = ch->n && kvt_role_is_system(ch->t[0].role);
    kvt_wbuf_puts(b, GEMMA_BOS);
    if (ch->thinking || ch->n_tools || sys0) {
        kvt_wbuf_puts(b, G4_TURN "system\n");
        if (ch->thinking) kvt_wbuf_puts(b, "<|think|>\n");
        if (sys0) kvt_tpl_put_trim(b, ch->t[0].text, ch->t[0].len);
        for (size_t k = 0; k < json_array_size(ch->fns); k++) {
            kvt_wbuf_puts(b, "<|tool>");
            g4_declaration(b, json_array_get(ch->fns, k));
            kvt_wbuf_puts(b, "<tool|>");
        }
        kvt_wbuf_puts(b, G4_TURN_END "\n");
    }
    int prev = 0; /* what was written last: 0 other, 1 a call, 2 a result */
    for (size_t i = sys0; i < ch->n; i++) {
        const kvt_turn *t = &ch->t[i];
        if (t->role == KVT_ROLE_TOOL) continue;
        prev = 0;
        bool model = t->role == KVT_ROLE_ASSISTANT;
        size_t j = i;
        while (j > sys0 && ch->t[j - 1].role == KVT_ROLE_TOOL) j--;
        bool cont = model && j > sys0 && ch->t[j - 1].role == KVT_ROLE_ASSISTANT;
        if (!cont) {
            kvt_wbuf_puts(b, G4_TURN);
            kvt_wbuf_puts(b, model ? "model" : kvt_tpl_role(t->role));
            kvt_wbuf_puts(b, "\n");
            if (model && !ch->thinking && !t->rlen) kvt_wbuf_puts(b, G4_THOUGHT G4_CHANNEL_END);
        }
        if (model && t->rlen) {
            kvt_wbuf_puts(b, G4_THOUGHT);
            kvt_wbuf_put(b, t->reasoning, t->rlen);
            kvt_wbuf_puts(b, "\n" G4_CHANNEL_END);
        }
        for (size_t k = 0; k < t->n_calls; k++) {
            const kvt_turn_call *c = &t->calls[k];
            kvt_wbuf_puts(b, G4_CALL);
            kvt_wbuf_puts(b, c->name);
            kvt_wbuf_puts(b, "{");
            if (c->argv) {
                size_t n;
                g4_key *keys = sorted_keys(b, c->argv, &n);
                for (size_t x = 0; x < n; x++) {
                    if (x) kvt_wbuf_puts(b, ",");
                    kvt_wbuf_puts(b, keys[x].k);
                    kvt_wbuf_puts(b, ":");
                    g4_argument(b, json_object_get(c->argv, keys[x].k), false);
                }
                free(keys);
            } else if (!c->args_json) {
                kvt_wbuf_put(b, c->args, c->args_len);
            }
            kvt_wbuf_puts(b, "}" G4_CALL_END);
            prev = 1;
        }
        bool results = false;
        for (size_t k = i + 1; t->n_calls && k < ch->n && ch->t[k].role == KVT_ROLE_TOOL; k++) {
            size_t nth = k - i - 1;
            kvt_wbuf_puts(b, G4_RESULT "response:");
            kvt_wbuf_puts(b, nth < t->n_calls ? t->calls[nth].name : "unknown");
            kvt_wbuf_puts(b, "{value:" G4_Q);
            kvt_wbuf_put(b, ch->t[k].text, ch->t[k].len);
            kvt_wbuf_puts(b, G4_Q "}" G4_RESULT_END);
            results = true;
            prev = 2;
        }
        if (model) g4_strip_thinking(b, t->text, t->len);
        else kvt_tpl_put_trim(b, t->text, t->len);
        if (model && i + 1 == ch->n && !t->n_calls) return false;
        if (prev == 1) kvt_wbuf_puts(b, G4_RESULT);
        else if (!(results && !t->len)) kvt_wbuf_puts(b, G4_TURN_END "\n");
    }
    if (prev == 0) {
        kvt_wbuf_puts(b, G4_TURN "model\n");
        if (!ch->thinking) kvt_wbuf_puts(b, G4_THOUGHT G4_CHANNEL_END);
    }
    return true;
}

/* ---- gemma4's tool calls ---------------------------------------------------- *
 *
 * The reply's text, then calls to its end, each
 *   <|tool_call>call:NAME{KEY:VALUE,...}<tool_call|>
 * in the template's notation: keys bare (or quoted), strings between <|"|>,
 * objects {KEY:VALUE,...}, arrays [VALUE,...], numbers, true, false, null
 * (or None). Whitespace between the calls is allowed; the text loses the
 * whitespace before the first. An unfinished or malformed call ends the
 * calls. */

typedef struct g4_in { const char *s; size_t p, end; int depth; } g4_in;

static void g4_ws(g4_in *in) { while (in->p < in->end && kvt_tpl_is_space(in->s[in->p])) in->p++; }

static bool g4_lit(g4_in *in, const char *lit)
{
    size_t n = strlen(lit);
    if (in->end - in->p < n || memcmp(in->s + in->p, lit, n)) return false;
    in->p += n;
    return true;
}

static json_t *g4_value(g4_in *in);

/* A quoted string (after its opening quote): up to the next quote. */
static json_t *g4_string(g4_in *in)
{
    const char *e = kvt_tpl_find(in->s, in->p, in->end, G4_Q, LIT(G4_Q));
    if (!e || !kvt_tpl_utf8_ok(in->s, in->p, (size_t)(e - in->s))) return NULL;
    json_t *v = json_stringn(in->s + in->p, (size_t)(e - in->s) - in->p);
    in->p = (size_t)(e - in->s) + LIT(G4_Q);
    return v;
}

/* A key: quoted, or bare up to ':' (no structure in it). NULL: none. */
static char *g4_read_key(g4_in *in)
{
    g4_ws(in);
    if (g4_lit(in, G4_Q)) {
        json_t *k = g4_string(in);
        char *r = k ? kvt_strndup(json_string_value(k), json_string_length(k)) : NULL;
        json_decref(k);
        return r;
    }
    size_t a = in->p;
    while (in->p < in->end && !strchr(":{}[],<>\"", in->s[in->p]) && (unsigned char)in->s[in->p] >= 0x20) in->p++;
    size_t z = in->p;
    while (z > a && kvt_tpl_is_space(in->s[z - 1])) z--;
    if (z == a || !kvt_tpl_utf8_ok(in->s, a, z)) return NULL;
    return kvt_strndup(in->s + a, z - a);
}

/* KEY:VALUE,... up to the closing '}' (the opening one read). */
static json_t *g4_object(g4_in *in)
{
    json_t *o = json_object();
    g4_ws(in);
    if (o && g4_lit(in, "}")) return o;
    while (o) {
        char *k = g4_read_key(in);
        g4_ws(in);
        json_t *v = k && g4_lit(in, ":") ? g4_value(in) : NULL;
        int bad = !v || json_object_set_new(o, k, v);
        free(k);
        if (bad) break;
        g4_ws(in);
        if (g4_lit(in, "}")) return o;
        if (!g4_lit(in, ",")) break;
    }
    json_decref(o);
    return NULL;
}

static json_t *g4_array(g4_in *in)
{
    json_t *a = json_array();
    g4_ws(in);
    if (a && g4_lit(in, "]")) return a;
    while (a) {
        json_t *v = g4_value(in);
        if (!v || json_array_append_new(a, v)) break;
        g4_ws(in);
        if (g4_lit(in, "]")) return a;
        if (!g4_lit(in, ",")) break;
    }
    json_decref(a);
    return NULL;
}

static json_t *g4_value(g4_in *in)
{
    g4_ws(in);
    if (++in->depth > 64) return NULL;
    json_t *v = NULL;
    if (g4_lit(in, G4_Q)) v = g4_string(in);
    else if (g4_lit(in, "{")) v = g4_object(in);
    else if (g4_lit(in, "[")) v = g4_array(in);
    else if (g4_lit(in, "true")) v = json_true();
    else if (g4_lit(in, "false")) v = json_false();
    else if (g4_lit(in, "null") || g4_lit(in, "None")) v = json_null();
    else { /* a number: what JSON reads of it */
        size_t a = in->p;
        while (in->p < in->end && strchr("+-.0123456789eE", in->s[in->p])) in->p++;
        if (in->p > a) v = json_loadb(in->s + a, in->p - a, JSON_DECODE_ANY, NULL);
        if (v && !json_is_number(v)) { json_decref(v); v = NULL; }
    }
    in->depth--;
    return v;
}

int kvt_gemma4_tool_calls(const char *text, size_t len, const json_t *fns, kvt_tool_call **calls, size_t *n,
                          size_t *text_end)
{
    (void)fns; /* the syntax carries the types */
    if (!calls || !n || !text_end || (!text && len)) return kvt_fail(KVT_EINVAL, "tool calls: NULL argument");
    *calls = NULL;
    *n = 0;
    *text_end = len;
    const char *first = kvt_tpl_find(text, 0, len, G4_CALL, LIT(G4_CALL));
    if (!first) return KVT_OK;
    size_t start = (size_t)(first - text), from;
    while (start > 0 && kvt_tpl_is_space(text[start - 1])) start--;
    from = start;
    g4_in in = {text, (size_t)(first - text), len, 0};
    kvt_tpl_calls cs = {0};
    for (;;) {
        g4_ws(&in);
        if (!g4_lit(&in, G4_CALL)) break;
        size_t na = in.p;
        while (in.p < len && text[in.p] != '{' && !kvt_tpl_is_space(text[in.p]) && text[in.p] != '<') in.p++;
        size_t nz = in.p;
        if (nz == na || !kvt_tpl_utf8_ok(text, na, nz) || !g4_lit(&in, "{")) break;
        json_t *args = g4_object(&in);
        if (!args || !g4_lit(&in, G4_CALL_END)) { json_decref(args); break; }
        size_t end = in.p;
        while (end < len && kvt_tpl_is_space(text[end])) end++;
        int rc = kvt_tpl_calls_add(&cs, text + na, nz - na, args, from, end - from);
        json_decref(args);
        if (rc) {
            kvt_tool_calls_free(cs.v, cs.n);
            return kvt_fail(KVT_ENOMEM, "tool calls: out of memory");
        }
        from = in.p = end;
    }
    if (!cs.n) return KVT_OK;
    *calls = cs.v;
    *n = cs.n;
    *text_end = start;
    return KVT_OK;
}

size_t kvt_gemma4_tool_calls_scan(kvt_tool_scan *s, const char *text, size_t len)
{
    return kvt_tpl_scan_opener(s, text, len, "<|tool_call>");
}

size_t kvt_gemma4_tool_calls_text_len(const char *text, size_t len)
{
    kvt_tool_scan s = {0};
    return kvt_gemma4_tool_calls_scan(&s, text, len);
}
