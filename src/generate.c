/* The generation loop: sample a reply token by token on a session synced
 * to the prompt, stop at EOS, at the template's end-of-turn tokens, at a
 * stop sequence, at max_new or at the context, and build the response.
 *
 * Streaming sends only what is settled: no partial UTF-8 character, nothing
 * that could still become a stop sequence or the start of a tool call; in
 * thinking mode the reasoning goes out as reasoning pieces and the answer
 * as text. The events go through the caller's emit callback, so the loop
 * does not know where they go (the server's job buffer, a test's list). */
#include "generate.h"
#include "model.h"
#include "util.h"

#include <stdlib.h>
#include <string.h>

static void emit(const kvt_gen_out *out, char *sse)
{
    if (sse && out->emit) out->emit(out->user, sse);
    else free(sse);
}

/* Emit text that is complete: hold back a partial UTF-8 sequence at the end
 * and anything that could still become a stop sequence. */
static size_t safe_len(const char *text, size_t len, const kvt_request *r)
{
    size_t keep = len;
    for (size_t i = 0; i < r->n_stop; i++) {
        size_t sl = strlen(r->stop[i]);
        for (size_t k = sl > 1 ? sl - 1 : 0; k > 0; k--)
            if (k <= len && !memcmp(text + len - k, r->stop[i], k)) {
                if (len - k < keep) keep = len - k;
                break;
            }
    }
    /* back up to a UTF-8 boundary */
    size_t b = keep;
    while (b > 0 && b > keep - 4 && ((unsigned char)text[b - 1] & 0xC0) == 0x80) b--;
    if (b > 0) {
        unsigned char c = (unsigned char)text[b - 1];
        size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        if (keep - (b - 1) < need) keep = b - 1;
    }
    return keep;
}

/* The log-probabilities of the sampled tokens, for a request that asked:
 * per token its own and its n_top most likely alternatives (kvt_logprob
 * entries), computed from the logits it was sampled from. The pieces follow
 * each other in the text, so a token's text offset is the sum of the
 * lengths before it. An append that fails stops both lists (the wbuf's oom
 * is sticky), so what was recorded stays a consistent prefix. */
typedef struct lp_rec {
    kvt_wbuf tok, top;
    size_t n_top;
    size_t sent, sent_end;      /* tokens gone out with a delta; where the next begins */
} lp_rec;

static void lp_add(lp_rec *l, const kvt_model *m, int32_t id, double lp, const int32_t *top_id,
                   const double *top_lp)
{
    kvt_logprob e = {"", 0, lp};
    if (kvt_token_piece(m, id, &e.bytes, &e.len) != KVT_OK) e.bytes = "", e.len = 0;
    for (size_t k = 0; k < l->n_top; k++) {
        kvt_logprob a = {"", 0, top_lp[k]};
        if (kvt_token_piece(m, top_id[k], &a.bytes, &a.len) != KVT_OK) a.bytes = "", a.len = 0;
        kvt_wbuf_put(&l->top, &a, sizeof a);
    }
    if (!l->top.oom) kvt_wbuf_put(&l->tok, &e, sizeof e);
}

static size_t lp_count(const lp_rec *l)
{
    size_t n = l->tok.len / sizeof(kvt_logprob);
    if (l->n_top && l->top.len / (l->n_top * sizeof(kvt_logprob)) < n)
        n = l->top.len / (l->n_top * sizeof(kvt_logprob));
    return n;
}

/* The tokens not sent yet whose text begins before byte end: they go out
 * with the text up to end (a token cut by a stop sequence still counts). */
static kvt_logprobs lp_take(lp_rec *l, size_t end)
{
    const kvt_logprob *tok = (const kvt_logprob *)l->tok.p, *top = (const kvt_logprob *)l->top.p;
    size_t n = lp_count(l), i = l->sent, off = l->sent_end;
    kvt_logprobs v = {tok ? tok + i : NULL, top ? top + i * l->n_top : NULL, 0, l->n_top, off};
    while (i < n && off < end) off += tok[i++].len;
    v.n = i - l->sent;
    l->sent = i;
    l->sent_end = off;
    return v;
}

/* All the tokens whose text begins before end, from the first. */
static kvt_logprobs lp_all(const lp_rec *l, size_t end)
{
    lp_rec from0 = *l;
    from0.sent = from0.sent_end = 0;
    return lp_take(&from0, end);
}

/* Where a thinking-mode reply stands while it streams (kvt_think_parts with
 * the request's template): text[start, end) is certainly reasoning; once
 * answering, the reasoning ended at end and the answer begins at answer
 * (what lies between, the </think> and what the template writes around it,
 * is neither). Outside thinking mode the whole reply is answer: answering
 * from the start, start = end = answer = 0. */
typedef struct think_pos {
    bool answering;
    size_t start, end, answer;
} think_pos;

/* Move the position over the text grown to len bytes. */
static void think_advance(think_pos *t, const kvt_template *tpl, const char *text, size_t len)
{
    if (t->answering) return;
    kvt_think k;
    t->answering = kvt_think_parts(tpl, text, len, true, &k);
    t->start = k.rs;
    t->end = k.re;
    t->answer = k.as;
}

/* Streaming: send what of the reply is settled and not sent yet; *emitted
 * is where the next piece begins. ok: how far the text is settled (no
 * partial character, stop sequence or tool-call opener before it); lp_end
 * (>= ok): the answer piece carries the log-probabilities of the tokens that
 * begin before it. The reasoning goes out as reasoning pieces, the answer as
 * text, and the </think> between them as neither (the template writes it
 * back between the two). */
static void stream_settled(const kvt_gen_out *out, kvt_request *r, const char *id, const char *model_name,
                           long created, const char *text, size_t ok, size_t lp_end, const think_pos *t,
                           size_t *emitted, lp_rec *lp)
{
    if (*emitted < t->start) *emitted = t->start;
    size_t e = ok < t->end ? ok : t->end;
    if (e > *emitted) {
        kvt_logprobs lv = lp_take(lp, e);
        emit(out, kvt_stream_reasoning_lp(r, id, model_name, text + *emitted, e - *emitted, created, &lv));
        *emitted = e;
    }
    if (!t->answering || *emitted < t->end) return;
    if (*emitted < t->answer) *emitted = t->answer;
    if (ok > *emitted) {
        kvt_logprobs lv = lp_take(lp, lp_end);
        emit(out, kvt_stream_delta_lp(r, id, model_name, text + *emitted, ok - *emitted, created, &lv));
        *emitted = ok;
    }
}

char *kvt_generate_run(const kvt_gen *g, kvt_usage *u, const kvt_gen_out *out)
{
    kvt_model *m = g->m;
    kvt_session *s = g->s;
    kvt_request *r = g->r;
    const char *id = g->id, *model_name = g->model_name;
    long created = g->created;
    /* the tokens that end the template's turns: generation stops at them and at EOS */
    kvt_template_tokens tt;
    kvt_template_tokens_get(kvt_template_for(m), m, &tt);
    kvt_sampler *smp = NULL;
    kvt_sampler_opts sopt = {.temperature = r->temperature, .top_p = r->top_p, .top_k = r->top_k,
                             .seed = r->has_seed ? r->seed : g->seed};
    kvt_sampler_new(&smp, &sopt);
    kvt_wbuf text = {0};
    const char *finish = "length", *stop_hit = NULL;
    size_t emitted = 0;
    think_pos th = {.answering = !r->thinking};
    lp_rec lp = {.n_top = r->logprobs ? r->top_logprobs : 0};
    if (lp.n_top > KVT_API_MAX_TOP_LOGPROBS) lp.n_top = KVT_API_MAX_TOP_LOGPROBS; /* the arrays below */
    if (lp.n_top > m->info.n_vocab) lp.n_top = m->info.n_vocab;
    if (g->stream) emit(out, kvt_stream_begin(r, id, model_name, u, created));
    while (u->completion_tokens < g->max_new && smp) {
        if (out->canceled && out->canceled(out->user)) { finish = "stop"; break; }
        const float *logits = kvt_session_logits(s);
        int32_t t = kvt_sampler_sample(smp, logits, m->info.n_vocab);
        /* from the raw logits, before temperature and top-p: the model's
         * distribution, which is what OpenAI reports */
        int32_t top_id[KVT_API_MAX_TOP_LOGPROBS] = {0};
        double top_lp[KVT_API_MAX_TOP_LOGPROBS] = {0}, t_lp = 0;
        if (r->logprobs) t_lp = kvt_logprob_top(logits, m->info.n_vocab, t, (uint32_t)lp.n_top, top_id, top_lp);
        bool eos = t == m->info.eos;
        for (size_t k = 0; k < tt.n_end; k++) eos |= t == tt.end[k];
        if (kvt_session_len(s) < g->n_ctx) {
            if (kvt_session_decode(s, t)) break; /* keep the session's timeline complete */
        } else {
            finish = "context";
            break;
        }
        if (eos) { finish = "stop"; break; }
        u->completion_tokens++;
        const char *p;
        size_t pl;
        if (kvt_token_piece(m, t, &p, &pl) == KVT_OK) kvt_wbuf_put(&text, p, pl);
        /* every token through the one that completes </think> is reasoning */
        if (!th.answering) {
            u->reasoning_tokens++;
            think_advance(&th, r->tmpl, text.p ? (const char *)text.p : "", text.len);
        }
        if (r->logprobs) lp_add(&lp, m, t, t_lp, top_id, top_lp);
        for (size_t i = 0; i < r->n_stop && !stop_hit; i++) {
            const char *hit = text.len ? memmem(text.p, text.len, r->stop[i], strlen(r->stop[i])) : NULL;
            if (hit) { stop_hit = r->stop[i]; text.len = (size_t)(hit - (const char *)text.p); }
        }
        if (stop_hit) { finish = "stop"; break; }
        if (g->stream) {
            const char *tx = text.p ? (const char *)text.p : "";
            size_t ok = safe_len(tx, text.len, r);
            /* never stream the start of a tool call as text (a request that
             * offers tools was rendered by a template: r->tmpl is set) */
            if (r->n_tools && th.answering) {
                size_t t_ok = th.answer + r->tmpl->tool_calls_text_len(tx + th.answer, text.len - th.answer);
                if (t_ok < ok) ok = t_ok;
            }
            stream_settled(out, r, id, model_name, created, tx, ok, ok, &th, &emitted, &lp);
        }
    }
    /* a partial UTF-8 tail left at the end is not text: drop it */
    size_t final_len = safe_len((const char *)text.p, text.len, &(kvt_request){0});
    const char *tp = text.p ? (const char *)text.p : "";
    kvt_tool_call *calls = NULL;
    size_t n_calls = 0, text_end = final_len;
    /* in thinking mode out of the answer only, raw_off still counting from
     * tp (what the replay hook gets back) */
    if (kvt_reply_tool_calls(r, tp, final_len, &calls, &n_calls, &text_end) == KVT_OK && n_calls && out->tool_calls)
        out->tool_calls(out->user, tp, calls, n_calls);
    /* the text: before the calls when there are some (in thinking mode the
     * reasoning, the </think> and the answer, which the response splits) */
    size_t upto = n_calls ? text_end : final_len;
    /* every generated token before the calls or a stop is reported, also
     * the bytes of a partial character the text leaves out (spelt as bytes) */
    size_t lp_end = n_calls ? text_end : text.len;
    kvt_logprobs all = lp_all(&lp, lp_end);
    char *body;
    if (g->stream) {
        /* the rest: a reply cut inside its reasoning is all reasoning */
        think_pos fin = {.answering = true};
        if (r->thinking) {
            kvt_think k;
            kvt_think_parts(r->tmpl, tp, upto, false, &k);
            fin = (think_pos){true, k.rs, k.re, k.as};
        }
        stream_settled(out, r, id, model_name, created, tp, upto, lp_end, &fin, &emitted, &lp);
        /* the end repeats the text that went out as deltas (Responses) */
        body = kvt_stream_end_lp(r, id, model_name, tp, upto, calls, n_calls, finish, stop_hit, u, created, &all);
    } else {
        body = kvt_response_json_lp(r, id, model_name, tp, upto, calls, n_calls, finish, stop_hit, u, created, &all);
    }
    kvt_tool_calls_free(calls, n_calls);
    kvt_wbuf_free(&lp.tok);
    kvt_wbuf_free(&lp.top);
    kvt_wbuf_free(&text);
    kvt_sampler_free(smp);
    return body;
}
