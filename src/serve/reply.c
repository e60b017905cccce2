/* The reply side of the API-shape layer (api.h): what goes back to a
 * client of OpenAI chat / completions / Responses or Anthropic messages.
 *
 * Who owns what: api.c reads request bodies into a kvt_request; this file
 * renders the answer to one: the tool calls of generated text (read with
 * the parser of the template that rendered the prompt), complete JSON
 * bodies, Server-Sent Events while streaming, log-probabilities, usage,
 * error bodies and the model list, each in the shape its api's official
 * clients parse. It places a reply's reasoning and tool calls where each
 * api expects them and knows no template marker (template.c's).
 *
 * Output JSON is built with jansson and dumped compact (one line, which an
 * SSE "data:" field needs). Generated text may hold invalid UTF-8 (a byte
 * token, a cut character); it is repaired to U+FFFD, never dropped whole.
 *
 * docs/API.md is the user-facing description of all of this.
 */
#include "serve/api.h"
#include "base/buf.h"
#include "base/jsonstr.h"
#include "chat/template.h"
#include "base/util.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LIT(s) (sizeof(s "") - 1)


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
