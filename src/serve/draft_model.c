/* The draft-model drafter: a smaller model with the same vocabulary runs
 * ahead of the model greedily, and the model verifies its guesses in one
 * pass (generate.c, run in cli.c) as it verifies n-gram drafts.
 *
 * The draft model keeps a session of its own that follows the tokens the
 * model accepted. Each pass runs on it the sampled token, then each greedy
 * guess in turn (a token a step: a guess depends on the one before), with
 * the state saved before the pass and every row of logits kept, exactly
 * as a verify pass of the model is run. When the next pass comes, the
 * context says which of those tokens were kept, and kvt_session_keep
 * rolls the draft session back to them by the machinery that rolls the
 * model's session back (truncated rows, the saved state loaded and the
 * kept tokens run again): the draft session is then what a session of
 * the draft model synced to the same tokens would be, bit for bit, and
 * its guesses are the draft model's own. Whatever it lacks of the context
 * (the prompt, the last draft of a pass that kept them all) runs as a
 * prefill, a chunk of it a pass at most; anything else (a context that went another way) goes through
 * kvt_session_sync, which reuses the longest common prefix.
 *
 * A drafter may also start from a session it is given (kvt_draft_model_adopt:
 * the one a server kept from the conversation's previous reply, or restored
 * from its store) and give its session back when the reply ends
 * (kvt_draft_model_release, rolled back to the tokens the reply kept): the
 * first follow then brings that session to the context as kvt_session_sync
 * does (the longest common prefix kept, the rest run a chunk a pass), so the
 * contract holds whatever the session held. */
#include "serve/draft.h"
#include "serve/sampler.h"
#include "arch/model.h"
#include "base/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kvt_draft_model {
    const kvt_model *target;
    kvt_model *m;
    kvt_session *s;
    uint32_t V;                 /* logits per row of the draft model */
    uint32_t n_ids;             /* ids a draft may be: within both models' logits */
    /* the pass in flight: tok[0..ran) run from pos0, a row of logits
     * each, the state before it */
    int32_t tok[KVT_DRAFT_MAX_LIMIT];
    size_t pos0, ran;
    float *rows;                /* (cap, V): grown to the longest pass asked for */
    size_t cap;
    kvt_wbuf save;
    bool failed;
    bool held;                  /* its session is being restored elsewhere: no drafts, not touched */
    bool adopted;               /* its session was given, not made */
    size_t prefilled;           /* tokens its session ran to follow the context (not drafts) */
};

/* A token's bytes for a message: printable ASCII as is, others as \xNN,
 * cut to fit cap. */
static void shown(char *o, size_t cap, const char *p, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n && k + 5 < cap; i++) {
        unsigned char c = (unsigned char)p[i];
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') o[k++] = (char)c;
        else k += (size_t)snprintf(o + k, cap - k, "\\x%02x", c);
    }
    o[k] = 0;
}

int kvt_draft_vocab_check(const kvt_model *target, const kvt_model *draft)
{
    uint32_t nt = kvt_tokenizer_n_vocab(target->tok), nd = kvt_tokenizer_n_vocab(draft->tok);
    uint32_t n = nt < nd ? nt : nd;
    for (uint32_t id = 0; id <= n; id++) {
        if (id == n) {
            if (nt == nd) break;
            return kvt_fail(KVT_EMISMATCH, "the draft model's vocabulary differs from the model's at token %u: "
                            "the %s has %u tokens, the %s %u", n, nt > nd ? "model" : "draft model", nt > nd ? nt : nd,
                            nt > nd ? "draft model" : "model", n);
        }
        const char *a = "", *b = "";
        size_t la = 0, lb = 0;
        bool ha = kvt_token_piece(target, (int32_t)id, &a, &la) == KVT_OK;
        bool hb = kvt_token_piece(draft, (int32_t)id, &b, &lb) == KVT_OK;
        if (ha != hb || la != lb || memcmp(a, b, la)) {
            char sa[80], sb[80];
            shown(sa, sizeof sa, ha ? a : "", ha ? la : 0);
            shown(sb, sizeof sb, hb ? b : "", hb ? lb : 0);
            return kvt_fail(KVT_EMISMATCH, "the draft model's vocabulary differs from the model's at token %u: "
                            "\"%s\" in the model, \"%s\" in the draft model", id, sa, sb);
        }
    }
    if (target->info.bos != draft->info.bos || target->info.eos != draft->info.eos)
        return kvt_fail(KVT_EMISMATCH, "the draft model's BOS/EOS (%d/%d) differ from the model's (%d/%d)",
                        draft->info.bos, draft->info.eos, target->info.bos, target->info.eos);
    return KVT_OK;
}

static int settle(kvt_draft_model *d, const int32_t *ctx, size_t n, int32_t last);

static kvt_draft_model *drafter(const kvt_model *target, kvt_model *draft)
{
    kvt_draft_model *d = kvt_calloc(1, sizeof *d);
    if (!d) return NULL;
    d->target = target;
    d->m = draft;
    d->V = draft->info.n_vocab;
    d->n_ids = target->info.n_vocab < d->V ? target->info.n_vocab : d->V;
    return d;
}

int kvt_draft_model_new(kvt_draft_model **out, const kvt_model *target, kvt_model *draft,
                        const kvt_session_opts *opts, kvt_pool *pool)
{
    *out = NULL;
    int rc = KVT_OK;
    kvt_draft_model *d = drafter(target, draft);
    if (!d) return KVT_ENOMEM;
    kvt_session_opts so = *opts;
    so.progress = NULL;
    so.progress_user = NULL;
    if ((rc = pool ? kvt_session_new_on(&d->s, draft, &so, pool) : kvt_session_new(&d->s, draft, &so))) {
        kvt_draft_model_free(d);
        return rc;
    }
    *out = d;
    return KVT_OK;
}

int kvt_draft_model_adopt(kvt_draft_model **out, const kvt_model *target, kvt_model *draft, kvt_session *s)
{
    *out = NULL;
    if (s->m != draft) return kvt_fail(KVT_EINVAL, "a session of another model given to the draft model");
    kvt_draft_model *d = drafter(target, draft);
    if (!d) return KVT_ENOMEM;
    d->s = s;
    d->adopted = true;
    *out = d;
    return KVT_OK;
}

kvt_session *kvt_draft_model_release(kvt_draft_model *d, const int32_t *ctx, size_t n)
{
    if (!d || !d->s || d->held || d->failed) return NULL;
    int rc = n ? settle(d, ctx, n - 1, ctx[n - 1]) : KVT_OK;
    d->ran = 0;
    if (rc) return NULL;
    kvt_session *s = d->s;
    d->s = NULL;
    return s;
}

void kvt_draft_model_hold(kvt_draft_model *d, bool on) { d->held = on; }
size_t kvt_draft_model_prefilled(const kvt_draft_model *d) { return d->prefilled; }

void kvt_draft_model_free(kvt_draft_model *d)
{
    if (!d) return;
    kvt_session_free(d->s);
    free(d->rows);
    kvt_wbuf_free(&d->save);
    free(d);
}

kvt_session *kvt_draft_model_session(const kvt_draft_model *d) { return d->s; }
bool kvt_draft_model_failed(const kvt_draft_model *d) { return d->failed; }

size_t kvt_draft_model_bytes(const kvt_draft_model *d)
{
    return sizeof *d + (d->s ? kvt_session_bytes(d->s) : 0) + d->cap * (size_t)d->V * sizeof(float) + d->save.cap;
}

size_t kvt_draft_model_reserve(const kvt_model *draft, uint32_t n_ctx, size_t tokens, uint32_t draft_max,
                               size_t scratch)
{
    kvt_plan p = {0};
    if (tokens > n_ctx) tokens = n_ctx;
    size_t V = draft->info.n_vocab, cache = kvt_model_plan(draft, tokens, &p) == KVT_OK ? (size_t)p.total : 0;
    /* checkpoints (session.c): one on each 2048-token grid point and at
     * most three off it, each the state (the plan's fixed parts) and a
     * row of logits; the state saved before a pass is one more */
    size_t ckpts = 4 + tokens / 2048, state = (size_t)p.fixed + V * sizeof(float);
    return sizeof(kvt_draft_model) + cache + (ckpts + 1) * state + (size_t)n_ctx * sizeof(int32_t) +
           (2 + (size_t)draft_max) * V * sizeof(float) + scratch;
}

/* The pass in flight is over: keep the tokens of it the context (ctx[0..n)
 * then last) holds, as kvt_session_keep keeps a verify pass's. None kept
 * (a context that went another way): left to follow. */
static int settle(kvt_draft_model *d, const int32_t *ctx, size_t n, int32_t last)
{
    size_t ran = d->ran, kept = 0;
    d->ran = 0;
    if (!ran || d->pos0 > n || d->s->n != d->pos0 + ran) return KVT_OK;
    while (kept < ran && d->pos0 + kept <= n && (d->pos0 + kept < n ? ctx[d->pos0 + kept] : last) == d->tok[kept])
        kept++;
    return kept ? kvt_session_keep(d->s, d->pos0, d->tok, ran, kept, d->rows, &d->save) : KVT_OK;
}

int kvt_draft_model_follow(kvt_draft_model *d, const int32_t *ctx, size_t n)
{
    kvt_session *s = d->s;
    /* the usual case, after settle: the session holds the context already */
    if (s->n == n && !s->logits_stale && (!n || !memcmp(s->tokens, ctx, n * sizeof *ctx))) return KVT_OK;
    /* tests: an adopted session one token longer than the context kept so */
    if (kvt_draft_fault == KVT_DRAFT_FAULT_ADOPT_LONG && d->adopted && s->n == n + 1 &&
        (!n || !memcmp(s->tokens, ctx, n * sizeof *ctx)))
        return KVT_OK;
    size_t kept = 0;
    int rc = kvt_session_sync(s, ctx, n, &kept);
    if (!rc && n > kept) d->prefilled += n - kept;
    return rc;
}

/* One token of the pass (the i-th) through the draft session, its logits
 * into row i; the first saves the state before it. */
static int run_one(kvt_draft_model *d, size_t i)
{
    kvt_session *s = d->s;
    bool late = kvt_draft_fault == KVT_DRAFT_FAULT_SAVE_LATE && i == 0;
    kvt_step st = {s, &d->tok[i], 1, false, 0, d->rows + i * (size_t)d->V, i || late ? NULL : &d->save};
    int rc = kvt_session_step(&st, 1, 1);
    if (!rc && late && s->m->arch->state_save) { /* tests: the state after the first token, not before */
        d->save.len = 0;
        d->save.oom = false;
        s->m->arch->state_save(s, &d->save);
    }
    return rc;
}

size_t kvt_draft_model_propose(kvt_draft_model *d, const int32_t *ctx, size_t n, int32_t last, size_t max,
                               int32_t *out)
{
    if (d->failed || d->held || !max) return 0;
    if (max > KVT_DRAFT_MAX_LIMIT) max = KVT_DRAFT_MAX_LIMIT;
    kvt_session *s = d->s;
    int rc = settle(d, ctx, n, last);
    /* a long way behind (a prompt the server's reply starts from): one
     * chunk of it a pass and no drafts until it is in, so a long prompt's
     * draft prefill never holds the other requests' steps for long */
    size_t c = 0, lim = s->n < n ? s->n : n;   /* what it holds of the context */
    while (c < lim && s->tokens[c] == ctx[c]) c++;
    /* a session that went another way (one kept from an earlier reply)
     * resumes at c, or with fixed state at its checkpoint before c: the
     * chunk counts from there */
    if (c < s->n) c = kvt_session_resume_at(s, c);
    size_t want = n - c > s->chunk ? c + s->chunk : n;
    if (!rc) rc = kvt_draft_model_follow(d, ctx, want);
    if (!rc && want < n) return 0;
    /* the pass: last, then every guess but the final one */
    if (!rc && n + max > s->n_ctx) max = s->n_ctx > n ? s->n_ctx - n : 0;
    if (!rc && max > d->cap) { /* the rows of the pass: (max, V) */
        float *r = realloc(d->rows, max * (size_t)d->V * sizeof(float));
        if (r) d->rows = r, d->cap = max;
        else rc = kvt_fail(KVT_ENOMEM, "no memory for %zu rows of the draft model's logits", max);
    }
    size_t got = 0;
    if (!rc && max) {
        d->pos0 = n;
        d->tok[0] = last;
        for (size_t i = 0; !rc; i++) {
            if ((rc = run_one(d, i))) break;
            d->ran = i + 1;
            out[got++] = (int32_t)kvt_sampler_greedy(d->rows + i * (size_t)d->V, d->n_ids);
            if (got == max) break;
            d->tok[i + 1] = out[i];
        }
    }
    if (rc) {
        fprintf(stderr, "kvtier: the draft model is off for this reply: %s\n", kvt_errmsg());
        d->failed = true;
        d->ran = 0;
        return 0;
    }
    return got;
}
