/* The generation loop: sample a reply token by token on a session synced
 * to the prompt, stop at EOS, at the template's end-of-turn tokens, at a
 * stop sequence, at max_new or at the context, and build the response.
 *
 * Streaming sends only what is settled: no partial UTF-8 character, nothing
 * that could still become a stop sequence or the start of a tool call; in
 * thinking mode the reasoning goes out as reasoning pieces and the answer
 * as text. The events go through the caller's emit callback, so the loop
 * does not know where they go (the server's job buffer, a test's list).
 *
 * Speculative decoding (kvt_gen_next_pass / kvt_gen_took_pass): the
 * sampled token goes through the model together with tokens a drafter
 * guessed would follow it, and each guess is then sampled against as a
 * token of its own would be (the same logits, the draw of its position):
 * the guesses plain decoding would have made are taken, the session is
 * rolled back after the first it would not. The reply is plain decoding's,
 * in fewer passes. */
#include "serve/generate.h"
#include "arch/model.h"
#include "base/util.h"

#include <stdio.h>
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
    size_t searched;            /* no closing tag begins before it (the search resumes there) */
} think_pos;

/* Move the position over the text grown to len bytes. */
static void think_advance(think_pos *t, const kvt_template *tpl, const char *text, size_t len)
{
    if (t->answering) return;
    kvt_think k;
    t->answering = kvt_think_parts_resume(tpl, text, len, &t->searched, &k);
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

/* A reply in progress: the loop's state between its steps. */
struct kvt_gen_run {
    kvt_gen g;
    kvt_usage *u;
    const kvt_gen_out *out;
    kvt_template_tokens tt;     /* the tokens that end the template's turns: generation stops at them and at EOS */
    kvt_sampler *smp;
    kvt_wbuf text;
    const char *finish, *stop_hit;
    size_t emitted;
    think_pos th;
    kvt_tool_scan scan;         /* the tool-call scan of the answer, resumed at each token */
    lp_rec lp;
    bool done, eos;
    int32_t t;                  /* the token sampled last */
    double t_lp;                /* its log-probability and its alternatives' */
    int32_t top_id[KVT_API_MAX_TOP_LOGPROBS];
    double top_lp[KVT_API_MAX_TOP_LOGPROBS];
    /* speculative decoding: the pass's tokens (the sampled one, then the
     * drafts), where it began, the logits of its rows, the state before it */
    int32_t pass[1 + KVT_DRAFT_MAX_LIMIT];
    size_t pass_n, pos0;
    kvt_draft_tune tune;
    double t_pass;              /* when the pass's drafting began (kvt_now), for the tuning */
    float *rows;                /* (1 + draft_max, n_vocab) */
    kvt_wbuf save;
};

kvt_gen_run *kvt_gen_start(const kvt_gen *g, kvt_usage *u, const kvt_gen_out *out)
{
    kvt_gen_run *R = kvt_calloc(1, sizeof *R);
    if (!R) return NULL;
    kvt_request *r = g->r;
    R->g = *g;
    R->u = u;
    R->out = out;
    kvt_template_tokens_get(kvt_template_for(g->m), g->m, &R->tt);
    kvt_sampler_opts sopt = {.temperature = r->temperature, .top_p = r->top_p, .top_k = r->top_k,
                             .seed = r->has_seed ? r->seed : g->seed};
    kvt_sampler_new(&R->smp, &sopt);
    R->finish = "length";
    R->th = (think_pos){.answering = !r->thinking};
    R->lp = (lp_rec){.n_top = r->logprobs ? r->top_logprobs : 0};
    if (R->lp.n_top > KVT_API_MAX_TOP_LOGPROBS) R->lp.n_top = KVT_API_MAX_TOP_LOGPROBS; /* the arrays above */
    if (R->lp.n_top > g->m->info.n_vocab) R->lp.n_top = g->m->info.n_vocab;
    if (R->g.draft_max == 0) R->g.draft_max = KVT_DRAFT_MAX_DEFAULT;
    if (R->g.draft_max > KVT_DRAFT_MAX_LIMIT) R->g.draft_max = KVT_DRAFT_MAX_LIMIT;
    if (R->g.draft == KVT_DRAFT_AUTO) R->g.draft = kvt_draft_auto(g->m, NULL);
    if (R->g.draft != KVT_DRAFT_NGRAM && !(R->g.draft == KVT_DRAFT_MODEL && R->g.dm) &&
        !(R->g.draft == KVT_DRAFT_MTP && R->g.mtp))
        R->g.draft = KVT_DRAFT_NONE;
    kvt_draft_tune_resume(&R->tune, R->g.learned, R->g.draft_max);
    /* no room for the rows: plain decoding, the same reply */
    size_t rows = (size_t)(1 + R->g.draft_max) * g->m->info.n_vocab * sizeof(float);
    if (R->g.draft && !(R->rows = malloc(rows))) {
        fprintf(stderr, "kvtier: speculative decoding off for a reply: no memory for its %zu bytes of logits\n", rows);
        R->g.draft = KVT_DRAFT_NONE;
    }
    if (g->stream) emit(out, kvt_stream_begin(r, g->id, g->model_name, u, g->created));
    return R;
}

/* The next token from logits, the session then holding len tokens: as
 * kvt_gen_next, whose logits are the session's. The draw is that of the
 * token's position in the reply (the tokens taken before it). */
static bool next_from(kvt_gen_run *R, const float *logits, size_t len, int32_t *tok)
{
    const kvt_gen *g = &R->g;
    kvt_request *r = g->r;
    kvt_model *m = g->m;
    if (R->done || R->u->completion_tokens >= g->max_new || !R->smp) return !(R->done = true);
    if (R->out->canceled && R->out->canceled(R->out->user)) {
        R->finish = "stop";
        return !(R->done = true);
    }
    int32_t t = kvt_sampler_sample_at(R->smp, logits, m->info.n_vocab, R->u->completion_tokens);
    /* from the raw logits, before temperature and top-p: the model's
     * distribution, which is what OpenAI reports */
    R->t_lp = 0;
    if (r->logprobs)
        R->t_lp = kvt_logprob_top(logits, m->info.n_vocab, t, (uint32_t)R->lp.n_top, R->top_id, R->top_lp);
    bool eos = t == m->info.eos;
    for (size_t k = 0; k < R->tt.n_end; k++) eos |= t == R->tt.end[k];
    R->eos = eos;
    R->t = t;
    if (len >= g->n_ctx) {
        R->finish = "context";
        return !(R->done = true);
    }
    *tok = t; /* run it even when it ends the reply: the session's timeline stays complete */
    return true;
}

size_t (*kvt_gen_test_drafter)(const int32_t *ctx, size_t n, int32_t last, size_t max, int32_t *out);

bool kvt_gen_next(kvt_gen_run *R, int32_t *tok)
{
    R->pass_n = 1;
    return next_from(R, kvt_session_logits(R->g.s), kvt_session_len(R->g.s), tok);
}

bool kvt_gen_next_pass(kvt_gen_run *R, kvt_gen_pass *p)
{
    const kvt_gen *g = &R->g;
    kvt_session *s = g->s;
    *p = (kvt_gen_pass){R->pass, 1, NULL, NULL};
    if (!kvt_gen_next(R, &R->pass[0])) return false;
    R->t_pass = kvt_now(); /* a pass's time: its drafting, its forward pass (the step's), its rollback */
    R->pos0 = kvt_session_len(s);
    if (g->draft == KVT_DRAFT_NONE || R->eos) return true;
    /* drafts only where plain decoding could go on: within max_new (the
     * sampled token is one more) and the context */
    size_t lim = kvt_draft_tune_len(&R->tune), c = R->u->completion_tokens + 1;
    lim = g->max_new > c ? (lim < g->max_new - c ? lim : g->max_new - c) : 0;
    size_t ctx = g->n_ctx < s->n_ctx ? g->n_ctx : s->n_ctx;
    lim = ctx > R->pos0 + 1 ? (lim < ctx - R->pos0 - 1 ? lim : ctx - R->pos0 - 1) : 0;
    const int32_t *toks = kvt_session_tokens(s);
    /* the MTP drafter every pass: it takes the model's hidden states of
     * the pass before, which its window needs, even when it drafts none
     * (under the test hook too, which then replaces its guesses) */
    size_t d = g->draft == KVT_DRAFT_MTP ? kvt_draft_mtp_propose(g->mtp, toks, R->pos0, R->pass[0], lim, R->pass + 1)
               : 0;
    if (kvt_gen_test_drafter || g->draft != KVT_DRAFT_MTP)
        d = !lim                        ? 0
            : kvt_gen_test_drafter        ? kvt_gen_test_drafter(toks, R->pos0, R->pass[0], lim, R->pass + 1)
            : g->draft == KVT_DRAFT_MODEL ? kvt_draft_model_propose(g->dm, toks, R->pos0, R->pass[0], lim, R->pass + 1)
                                          : kvt_draft_ngram(toks, R->pos0, R->pass[0], lim, R->pass + 1);
    R->pass_n = p->n = 1 + d;
    if (d) {
        p->rows = R->rows;
        p->save = &R->save;
    }
    return true;
}

bool kvt_gen_took(kvt_gen_run *R, int rc)
{
    const kvt_gen *g = &R->g;
    kvt_request *r = g->r;
    kvt_model *m = g->m;
    kvt_usage *u = R->u;
    if (rc) return !(R->done = true);
    if (R->eos) {
        R->finish = "stop";
        return !(R->done = true);
    }
    int32_t t = R->t;
    u->completion_tokens++;
    const char *p;
    size_t pl, before = R->text.len;
    if (kvt_token_piece(m, t, &p, &pl) == KVT_OK) kvt_wbuf_put(&R->text, p, pl);
    /* every token through the one that completes </think> is reasoning */
    if (!R->th.answering) {
        u->reasoning_tokens++;
        think_advance(&R->th, r->tmpl, R->text.p ? (const char *)R->text.p : "", R->text.len);
    }
    if (r->logprobs) lp_add(&R->lp, m, t, R->t_lp, R->top_id, R->top_lp);
    /* a stop sequence ends in the new piece: look where one could begin */
    for (size_t i = 0; i < r->n_stop && !R->stop_hit; i++) {
        size_t sl = strlen(r->stop[i]), from = before >= sl - 1 ? before - (sl - 1) : 0;
        const char *hit = R->text.len > from ? memmem(R->text.p + from, R->text.len - from, r->stop[i], sl) : NULL;
        if (hit) { R->stop_hit = r->stop[i]; R->text.len = (size_t)(hit - (const char *)R->text.p); }
    }
    if (R->stop_hit) {
        R->finish = "stop";
        return !(R->done = true);
    }
    if (g->stream) {
        const char *tx = R->text.p ? (const char *)R->text.p : "";
        size_t ok = safe_len(tx, R->text.len, r);
        /* never stream the start of a tool call as text (a request that
         * offers tools was rendered by a template: r->tmpl is set); the
         * scan resumes where the last token's stopped (the answer's start
         * is fixed once answering), so a reply's scans are linear in it */
        if (r->n_tools && R->th.answering) {
            size_t t_ok = R->th.answer + r->tmpl->tool_calls_scan(&R->scan, tx + R->th.answer,
                                                                 R->text.len - R->th.answer);
            if (t_ok < ok) ok = t_ok;
        }
        stream_settled(R->out, r, g->id, g->model_name, g->created, tx, ok, ok, &R->th, &R->emitted, &R->lp);
    }
    return true;
}

bool kvt_gen_took_pass(kvt_gen_run *R, int rc, size_t done)
{
    kvt_usage *u = R->u;
    if (!rc) u->passes++;
    if (!rc && R->pass_n == 1 && R->g.draft != KVT_DRAFT_NONE)
        kvt_draft_tune_after(&R->tune, 0, 0, kvt_now() - R->t_pass);
    if (rc || R->pass_n == 1) return kvt_gen_took(R, rc);
    u->drafted += (uint32_t)(R->pass_n - 1);
    size_t V = R->g.m->info.n_vocab, keep = 1;
    bool more = kvt_gen_took(R, 0);
    /* each draft is kept only when it is what plain decoding samples there */
    for (int32_t t; more && keep < done; keep++, u->accepted++, more = kvt_gen_took(R, 0)) {
        if (!next_from(R, R->rows + (keep - 1) * V, R->pos0 + keep, &t)) break;
        if (t != R->pass[keep] && keep == 1 && kvt_draft_fault == KVT_DRAFT_FAULT_ACCEPT_FIRST) /* tests */
            t = R->t = R->pass[keep];
        if (t != R->pass[keep]) break;
    }
    if (kvt_session_keep(R->g.s, R->pos0, R->pass, done, keep, R->rows, &R->save)) return !(R->done = true);
    kvt_draft_tune_after(&R->tune, done - 1, keep - 1, kvt_now() - R->t_pass);
    return more && !R->done;
}

char *kvt_gen_finish(kvt_gen_run *R)
{
    if (!R) return NULL;
    const kvt_gen *g = &R->g;
    kvt_request *r = g->r;
    const char *id = g->id, *model_name = g->model_name;
    long created = g->created;
    kvt_usage *u = R->u;
    const kvt_gen_out *out = R->out;
    kvt_wbuf *text = &R->text;
    /* a partial UTF-8 tail left at the end is not text: drop it */
    size_t final_len = safe_len((const char *)text->p, text->len, &(kvt_request){0});
    const char *tp = text->p ? (const char *)text->p : "";
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
    size_t lp_end = n_calls ? text_end : text->len;
    kvt_logprobs all = lp_all(&R->lp, lp_end);
    char *body;
    if (g->stream) {
        /* the rest: a reply cut inside its reasoning is all reasoning */
        think_pos fin = {.answering = true};
        if (r->thinking) {
            kvt_think k;
            kvt_think_parts(r->tmpl, tp, upto, false, &k);
            fin = (think_pos){true, k.rs, k.re, k.as, 0};
        }
        stream_settled(out, r, id, model_name, created, tp, upto, lp_end, &fin, &R->emitted, &R->lp);
        /* the end repeats the text that went out as deltas (Responses) */
        body = kvt_stream_end_lp(r, id, model_name, tp, upto, calls, n_calls, R->finish, R->stop_hit, u, created,
                                 &all);
    } else {
        body = kvt_response_json_lp(r, id, model_name, tp, upto, calls, n_calls, R->finish, R->stop_hit, u, created,
                                    &all);
    }
    /* what the tuning learned, for the next reply (a reply that drafted
     * nothing, its drafter off, leaves the record as it was) */
    if (g->learned && g->draft != KVT_DRAFT_NONE) kvt_draft_tune_keep(g->learned, &R->tune);
    kvt_tool_calls_free(calls, n_calls);
    kvt_wbuf_free(&R->lp.tok);
    kvt_wbuf_free(&R->lp.top);
    kvt_wbuf_free(text);
    kvt_sampler_free(R->smp);
    free(R->rows);
    kvt_wbuf_free(&R->save);
    free(R);
    return body;
}

char *kvt_generate_run(const kvt_gen *g, kvt_usage *u, const kvt_gen_out *out)
{
    kvt_gen_run *R = kvt_gen_start(g, u, out);
    if (!R) return NULL;
    for (kvt_gen_pass p; kvt_gen_next_pass(R, &p);) {
        size_t done = 1;
        int rc = p.n == 1 ? kvt_session_decode(g->s, p.tok[0]) : kvt_session_verify(g->s, p.tok, p.n, p.rows, p.save, &done);
        if (!kvt_gen_took_pass(R, rc, done)) break;
    }
    return kvt_gen_finish(R);
}
