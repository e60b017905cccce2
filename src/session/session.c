/* A session: one timeline over a model. It owns the exact token ids it holds,
 * the KV cache for them and the next-token logits after the last one.
 *
 * Invariant: after every public call returns, tokens[0..n) are exactly the ids
 * the cache rows were computed from, and logits (when n > 0) are the logits
 * after tokens[n-1]. Reuse is decided only by comparing token ids, never by
 * text or by length, so rows computed from another prefix are never used. */
#include "kernels/kernels.h"
#include "arch/model.h"
#include "base/util.h"
#include "session/testing.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_CHUNK 256
#define CKPT_INTERVAL 2048

/* ---- checkpoints ----
 *
 * llama rows are per token, so any prefix of a session is a valid state by
 * truncation; only the logits there are lost. ds4's window ring and frontier
 * are overwritten as the session advances, so going back to an earlier
 * position needs that state as it was then. A checkpoint keeps both: the
 * logits and the fixed state (empty for llama) at a position. Sessions keep one at every multiple of CKPT_INTERVAL
 * tokens (prefill chunks are cut to land on them), one at the end of the
 * latest sync, so regenerating from the same prompt costs nothing, and one
 * at the two positions the caller marks (the server marks where the last
 * user turn begins, which is where the next conversation on the same prompt
 * diverges, and both it and `kvtier run` the save policy's cold point, so
 * the prompt can be saved there); any other divergence costs at most
 * CKPT_INTERVAL tokens of prefill. */

static bool stateful(const kvt_session *s) { return s->m->arch->state_save != NULL; }

static void ckpt_free(kvt_checkpoint *c)
{
    free(c->logits);
    kvt_wbuf_free(&c->state);
}

/* Drop checkpoints past pos (all when pos is 0). */
static void ckpt_drop_after(kvt_session *s, size_t pos)
{
    while (s->n_ckpt && s->ckpt[s->n_ckpt - 1].pos > pos) ckpt_free(&s->ckpt[--s->n_ckpt]);
}

void kvt_session_ckpt_clear(kvt_session *s) { ckpt_drop_after(s, 0); }

/* Append a checkpoint (copies logits and state). Failure to allocate only
 * loses the checkpoint. */
static void ckpt_push(kvt_session *s, size_t pos, const float *logits, const kvt_wbuf *state)
{
    if (state->oom) return;
    if (s->n_ckpt == s->cap_ckpt) {
        size_t cap = s->cap_ckpt ? 2 * s->cap_ckpt : 8;
        kvt_checkpoint *p = realloc(s->ckpt, cap * sizeof *p);
        if (!p) return;
        s->ckpt = p;
        s->cap_ckpt = cap;
    }
    size_t V = s->m->info.n_vocab;
    kvt_checkpoint c = {.pos = pos, .logits = malloc(V * sizeof(float))};
    if (!c.logits) return;
    memcpy(c.logits, logits, V * sizeof(float));
    kvt_wbuf_put(&c.state, state->p, state->len);
    if (c.state.oom) { ckpt_free(&c); return; }
    s->ckpt[s->n_ckpt++] = c;
}

/* Remember the state at s->n. */
void kvt_session_checkpoint(kvt_session *s)
{
    if (s->n == 0 || s->logits_stale) return;
    if (s->n_ckpt && s->ckpt[s->n_ckpt - 1].pos == s->n) return;
    bool grid = s->n % s->ckpt_interval == 0;
    size_t off = 0;
    for (size_t i = 0; i < s->n_ckpt; i++) off += s->ckpt[i].pos % s->ckpt_interval != 0;
    if (!grid && off >= 3) /* keep at most three off-grid checkpoints (two marks, a sync's end): drop the oldest */
        for (size_t i = 0; i < s->n_ckpt; i++)
            if (s->ckpt[i].pos % s->ckpt_interval) {
                ckpt_free(&s->ckpt[i]);
                memmove(&s->ckpt[i], &s->ckpt[i + 1], (s->n_ckpt - i - 1) * sizeof *s->ckpt);
                s->n_ckpt--;
                break;
            }
    kvt_wbuf state = {0};
    if (s->m->arch->state_save) s->m->arch->state_save(s, &state);
    ckpt_push(s, s->n, s->logits, &state);
    kvt_wbuf_free(&state);
}

/* Return to the latest checkpoint (state and logits), or to empty. */
static size_t restore_last(kvt_session *s)
{
    size_t at = 0;
    if (s->n_ckpt) {
        kvt_checkpoint *c = &s->ckpt[s->n_ckpt - 1];
        kvt_rbuf r = {c->state.p, c->state.len, 0};
        if (!s->m->arch->state_load || s->m->arch->state_load(s, c->pos, &r) == KVT_OK) {
            memcpy(s->logits, c->logits, (size_t)s->m->info.n_vocab * sizeof(float));
            at = c->pos;
            s->logits_stale = false;
        } else {
            kvt_session_ckpt_clear(s);
        }
    }
    s->n = at;
    if (!at) s->logits_stale = false;
    kvt_cache_truncate(s->cache, at);
    return at;
}

/* Go back to the latest restorable position <= pos and return it. llama
 * rows are per token, so that is pos itself, but its logits are only known
 * when a checkpoint sits there: *logits_ok says whether they are (a sync
 * recomputes at least one token when not). ds4 goes back to its latest
 * checkpoint <= pos, logits included. */
static size_t rollback_to(kvt_session *s, size_t pos, bool *logits_ok)
{
    *logits_ok = true;
    if (pos >= s->n) return s->n;
    ckpt_drop_after(s, pos);
    if (stateful(s)) return restore_last(s);
    kvt_checkpoint *c = s->n_ckpt ? &s->ckpt[s->n_ckpt - 1] : NULL;
    *logits_ok = pos == 0 || (c && c->pos == pos);
    if (c && c->pos == pos) memcpy(s->logits, c->logits, (size_t)s->m->info.n_vocab * sizeof(float));
    s->logits_stale = !*logits_ok;
    s->n = pos;
    kvt_cache_truncate(s->cache, pos);
    return pos;
}

/* After a failed forward from position pos: back to a consistent state. A
 * failed llama forward never touched rows [0, pos) or the logits; a failed
 * ds4 forward may have touched the window and frontier, so it returns to a
 * checkpoint (the one at the end of the last sync, when decoding). */
static void recover(kvt_session *s, size_t pos)
{
    if (pos > s->n) pos = s->n;
    bool ok;
    if (!stateful(s)) {
        rollback_to(s, pos, &ok);
        if (!ok) restore_last(s);
        return;
    }
    ckpt_drop_after(s, pos);
    restore_last(s);
}

/* c tokens at s->n, cut so as not to cross the next checkpoint position
 * (the grid, the marks). */
static size_t cut_at_checkpoint(const kvt_session *s, size_t c)
{
    size_t grid = (s->n / s->ckpt_interval + 1) * s->ckpt_interval;
    if (s->n + c > grid) c = grid - s->n;
    if (s->mark > s->n && s->n + c > s->mark) c = s->mark - s->n;
    if (s->save_mark > s->n && s->n + c > s->save_mark) c = s->save_mark - s->n;
    return c;
}

/* pool NULL: threads of its own and its scratch at once (kvt_session_new);
 * else pool borrowed and the scratch made when it first runs. */
static int session_make(kvt_session **out, kvt_model *m, const kvt_session_opts *opts, kvt_pool *pool)
{
    *out = NULL;
    if (!m->arch)
        return kvt_fail(KVT_EINVAL, "model '%s' has a tokenizer only (opened for tokenize)", m->name);
    kvt_session_opts o = {0};
    if (opts) o = *opts;
    kvt_session *s = kvt_calloc(1, sizeof *s);
    if (!s) return KVT_ENOMEM;
    atomic_store(&m->sessions_made, true); /* its cache types are fixed from here on */
    s->m = m;
    s->n_ctx = o.n_ctx ? o.n_ctx : m->info.n_ctx_train;
    s->chunk = o.chunk ? o.chunk : DEFAULT_CHUNK;
    s->rolling = o.rolling;
    s->progress = o.progress;
    s->progress_user = o.progress_user;
    s->n_threads = o.n_threads;
    s->ckpt_interval = o.checkpoint_interval ? o.checkpoint_interval : CKPT_INTERVAL;
    int rc = KVT_ENOMEM;
    if (s->n_ctx == 0 || s->n_ctx > (1u << 24)) {
        rc = kvt_fail(KVT_EINVAL, "context of %u tokens is out of range", s->n_ctx);
        goto fail;
    }
    s->own_pool = !pool;
    s->pool = pool ? pool : kvt_pool_new(o.n_threads);
    if (pool) s->n_threads = kvt_pool_size(pool);
    s->tokens = kvt_malloc((size_t)s->n_ctx * sizeof(int32_t));
    s->logits = kvt_malloc((size_t)m->info.n_vocab * sizeof(float));
    if (!s->pool || !s->tokens || !s->logits) goto fail;
    if ((rc = m->arch->cache_new(s))) goto fail;
    if (!pool && (rc = kvt_session_work(s))) goto fail;
    *out = s;
    return KVT_OK;
fail:
    kvt_session_free(s);
    return rc;
}

int kvt_session_new(kvt_session **out, kvt_model *m, const kvt_session_opts *opts)
{
    return session_make(out, m, opts, NULL);
}

int kvt_session_new_on(kvt_session **out, kvt_model *m, const kvt_session_opts *opts, kvt_pool *pool)
{
    *out = NULL;
    if (!pool) return kvt_fail(KVT_EINVAL, "a session on a shared pool needs the pool");
    return session_make(out, m, opts, pool);
}

int kvt_session_work(kvt_session *s)
{
    return s->work || !s->m->arch->work_new ? KVT_OK : s->m->arch->work_new(s);
}

void *kvt_session_park(kvt_session *s)
{
    kvt_cache_trim(s->cache);
    void *w = s->work;
    s->work = NULL;
    return w;
}

void kvt_session_lend(kvt_session *s, void *work)
{
    if (s->work) kvt_session_scratch_free(s->m, work);
    else s->work = work;
}

void kvt_session_scratch_free(const kvt_model *m, void *work)
{
    if (work) m->arch->work_free(work);
}

size_t kvt_session_scratch_bytes(const kvt_model *m, const void *work)
{
    return work && m->arch->work_bytes ? m->arch->work_bytes(work) : 0;
}

void kvt_session_free(kvt_session *s)
{
    if (!s) return;
    kvt_session_ckpt_clear(s);
    free(s->ckpt);
    if (s->work) s->m->arch->work_free(s->work);
    kvt_cache_free(s->cache);
    if (s->own_pool) kvt_pool_free(s->pool);
    free(s->tokens);
    free(s->logits);
    free(s);
}

void kvt_session_set_threads(kvt_session *s, uint32_t n)
{
    kvt_pool *p = kvt_pool_new(n);
    if (!p) return;
    if (s->own_pool) kvt_pool_free(s->pool);
    s->pool = p;
    s->own_pool = true;
    s->n_threads = n;
}

const float *kvt_session_logits(const kvt_session *s)
{
    return s->n && !(s->logits_stale && kvt_session_fault != KVT_SESSION_FAULT_STALE_LOGITS) ? s->logits : NULL;
}
size_t kvt_session_len(const kvt_session *s) { return s->n; }
const int32_t *kvt_session_tokens(const kvt_session *s) { return s->tokens; }
uint64_t kvt_session_rebuilds(const kvt_session *s) { return s->rebuilds; }

/* Run tokens[s->n .. n) in chunks (sizes cycled from chunks[]). The logits of
 * the last row of every chunk are kept, so a cancelled prefill still leaves a
 * consistent session. Chunks are cut at checkpoint positions; that changes
 * no result (chunking never does). */
static int prefill(kvt_session *s, const int32_t *tokens, size_t n, const uint32_t *chunks,
                   size_t n_chunks)
{
    size_t start = s->n, ci = 0;
    int wrc = s->n < n ? kvt_session_work(s) : KVT_OK;
    if (wrc) return wrc;
    while (s->n < n) {
        size_t c = chunks ? chunks[ci++ % n_chunks] : s->chunk;
        if (c == 0) c = 1;
        if (c > n - s->n) c = n - s->n;
        c = cut_at_checkpoint(s, c);
        int rc = s->m->arch->forward(s, tokens + s->n, c, s->n, s->logits, c - 1);
        if (rc) { recover(s, start); return rc; }
        memcpy(s->tokens + s->n, tokens + s->n, c * sizeof(int32_t));
        s->n += c;
        s->logits_stale = false;
        if (s->n % s->ckpt_interval == 0 || s->n == s->mark || s->n == s->save_mark) kvt_session_checkpoint(s);
        if (s->progress && !s->progress(s->progress_user, s->n - start, n - start))
            return s->n < n ? kvt_fail(KVT_ECANCELED, "prefill canceled at %zu of %zu tokens", s->n, n)
                            : KVT_OK;
    }
    return KVT_OK;
}

int kvt_session_sync_prepare(kvt_session *s, const int32_t **tokens, size_t *n, size_t *reused)
{
    *reused = 0;
    if (*n > s->n_ctx) {
        if (!s->rolling)
            return kvt_fail(KVT_ECTX, "prompt of %zu tokens exceeds the context of %u tokens", *n, s->n_ctx);
        /* Rolling mode: keep the last n_ctx tokens, re-prefilled from position 0. */
        *tokens += *n - s->n_ctx;
        *n = s->n_ctx;
        s->rebuilds++;
    }
    const int32_t *t = *tokens;
    size_t nt = *n;
    for (size_t i = 0; i < nt; i++)
        if (t[i] < 0 || (uint32_t)t[i] >= s->m->info.n_vocab)
            return kvt_fail(KVT_EINVAL, "token %zu: id %d out of range [0, %u)", i, t[i], s->m->info.n_vocab);
    size_t common = 0, lim = nt < s->n ? nt : s->n;
    while (common < lim && s->tokens[common] == t[common]) common++;
    bool stale = s->logits_stale && kvt_session_fault != KVT_SESSION_FAULT_STALE_LOGITS;
    if (common == nt && nt == s->n && !stale) {
        *reused = nt;
        return KVT_OK;
    }
    /* a prompt that ends where a trim left the session, its logits stale:
     * the last token is computed again (a longer prompt's prefill computes
     * the logits after its own last token; the rows held are exact) */
    if (stale && common == nt && nt == s->n) common = s->n - 1;
    if (common < s->n) {
        /* Going back. The prompt may end inside what we hold: then we need
         * the logits after its last token, from a checkpoint right there or
         * by recomputing at least that token. */
        bool exact = false, logits_ok;
        if (common == nt && nt > 0) {
            ckpt_drop_after(s, nt);
            exact = s->n_ckpt && s->ckpt[s->n_ckpt - 1].pos == nt;
            if (!exact) common = nt - 1;
        }
        common = rollback_to(s, common, &logits_ok);
        if (exact) {
            *reused = nt;
            return KVT_OK;
        }
    }
    *reused = common;
    return KVT_OK;
}

int kvt_session_sync_chunks(kvt_session *s, const int32_t *tokens, size_t n,
                            const uint32_t *chunks, size_t n_chunks, size_t *reused)
{
    size_t kept = 0;
    if (reused) *reused = 0;
    if (chunks && !n_chunks) return kvt_fail(KVT_EINVAL, "empty chunk schedule");
    int rc = kvt_session_sync_prepare(s, &tokens, &n, &kept);
    if (rc) return rc;
    if (reused) *reused = kept;
    if (s->n == n) return KVT_OK;
    rc = prefill(s, tokens, n, chunks, n_chunks);
    if (!rc) kvt_session_checkpoint(s);
    return rc;
}

int kvt_session_sync(kvt_session *s, const int32_t *tokens, size_t n, size_t *reused)
{
    return kvt_session_sync_chunks(s, tokens, n, NULL, 0, reused);
}

int kvt_session_decode(kvt_session *s, int32_t token)
{
    if (token < 0 || (uint32_t)token >= s->m->info.n_vocab)
        return kvt_fail(KVT_EINVAL, "token id %d out of range [0, %u)", token, s->m->info.n_vocab);
    if (s->n >= s->n_ctx) {
        if (!s->rolling)
            return kvt_fail(KVT_ECTX, "context of %u tokens is full", s->n_ctx);
        int32_t *win = kvt_malloc((size_t)s->n_ctx * sizeof(int32_t));
        if (!win) return KVT_ENOMEM;
        memcpy(win, s->tokens + 1, (s->n_ctx - 1) * sizeof(int32_t));
        win[s->n_ctx - 1] = token;
        s->rebuilds++;
        recover(s, 0);
        int rc = prefill(s, win, s->n_ctx, NULL, 0);
        free(win);
        return rc;
    }
    int rc = kvt_session_work(s);
    if (rc) return rc;
    rc = s->m->arch->forward(s, &token, 1, s->n, s->logits, 0);
    if (rc) { recover(s, s->n); return rc; }
    s->tokens[s->n++] = token;
    s->logits_stale = false;
    if (s->n % s->ckpt_interval == 0) kvt_session_checkpoint(s); /* the grid, as prefill and a batched step */
    return KVT_OK;
}

int kvt_session_fault;

/* ---- batched steps ----
 *
 * Each session's tokens are cut as prefill cuts them (at the checkpoint
 * grid and the marks), so a session stepped with others leaves the same
 * checkpoints as one synced alone; then one forward pass runs them all. */
int kvt_session_step(kvt_step *st, size_t k, size_t max_tokens)
{
    if (!k) return KVT_OK;
    const kvt_model *m = st[0].s->m;
    size_t budget = max_tokens ? max_tokens : st[0].s->chunk, want = 0;
    if (budget < k) budget = k;
    for (size_t i = 0; i < k; i++) {
        kvt_session *s = st[i].s;
        st[i].done = 0;
        if (s->m != m) return kvt_fail(KVT_EINVAL, "step: sessions of different models");
        if (!st[i].n) return kvt_fail(KVT_EINVAL, "step: session %zu has no tokens", i);
        if (s->n >= s->n_ctx) return kvt_fail(KVT_ECTX, "context of %u tokens is full", s->n_ctx);
        for (size_t j = 0; j < i; j++)
            if (st[j].s == s) return kvt_fail(KVT_EINVAL, "step: a session twice");
        size_t c = st[i].n < s->n_ctx - s->n ? st[i].n : s->n_ctx - s->n;
        c = cut_at_checkpoint(s, c);
        for (size_t j = 0; j < c; j++)
            if (st[i].tok[j] < 0 || (uint32_t)st[i].tok[j] >= m->info.n_vocab)
                return kvt_fail(KVT_EINVAL, "token id %d out of range [0, %u)", st[i].tok[j], m->info.n_vocab);
        st[i].done = c;
        want += c;
    }
    for (size_t i = 0; i < k; i++) {
        int rc = kvt_session_work(st[i].s);
        if (rc) {
            for (size_t j = 0; j < k; j++) st[j].done = 0;
            return rc;
        }
    }
    /* over the budget: one token each, the rest to the first ones */
    if (want > budget) {
        size_t left = budget - k;
        for (size_t i = 0; i < k; i++) {
            size_t more = st[i].done - 1 < left ? st[i].done - 1 : left;
            st[i].done = 1 + more;
            left -= more;
        }
    }
    kvt_seg segs[64], *seg = k <= 64 ? segs : kvt_malloc(k * sizeof *seg);
    if (!seg) return KVT_ENOMEM;
    for (size_t i = 0; i < k; i++) {
        seg[i] = (kvt_seg){st[i].s, st[i].tok, st[i].done, st[i].s->n, st[i].s->logits, st[i].done - 1};
        if (st[i].rows) {
            seg[i].logits = st[i].rows;
            seg[i].lfrom = 0;
        }
        if (st[i].save && stateful(st[i].s)) {
            st[i].save->len = 0;
            st[i].save->oom = false;
            m->arch->state_save(st[i].s, st[i].save);
        }
    }
    int rc = KVT_OK;
    if (m->arch->forward_batch) {
        rc = m->arch->forward_batch(seg, k);
    } else {
        for (size_t i = 0; i < k && !rc; i++)
            rc = m->arch->forward(seg[i].s, seg[i].tok, seg[i].n, seg[i].pos0, seg[i].logits, seg[i].lfrom);
    }
    if (seg != segs) free(seg);
    if (rc) {
        for (size_t i = 0; i < k; i++) {
            recover(st[i].s, st[i].s->n);
            st[i].done = 0;
        }
        return rc;
    }
    for (size_t i = 0; i < k; i++) {
        kvt_session *s = st[i].s;
        if (st[i].rows)
            memcpy(s->logits, st[i].rows + (st[i].done - 1) * (size_t)m->info.n_vocab, m->info.n_vocab * sizeof(float));
        memcpy(s->tokens + s->n, st[i].tok, st[i].done * sizeof(int32_t));
        s->n += st[i].done;
        s->logits_stale = false;
        bool mark = (s->n == s->mark || s->n == s->save_mark) && kvt_session_fault != KVT_SESSION_FAULT_STEP_MARK;
        if (s->n % s->ckpt_interval == 0 || mark || (st[i].end && st[i].done == st[i].n))
            kvt_session_checkpoint(s);
    }
    return KVT_OK;
}

/* ---- verify passes (speculative decoding) ----
 *
 * A pass of a sampled token and drafts after it, then a rollback to the
 * drafts kept. Rows of the llama family without state are per token:
 * truncating them is exact. Window rings, ds4's window and frontiers and
 * recurrent state are overwritten by the pass; the pass saved them first,
 * so the rollback loads them and runs the kept tokens again, which gives
 * the same bits as running them the first time (no chunk schedule changes
 * any). */
int kvt_session_verify(kvt_session *s, const int32_t *tok, size_t n, float *rows, kvt_wbuf *save, size_t *done)
{
    kvt_step st = {s, tok, n, false, 0, rows, save};
    int rc = kvt_session_step(&st, 1, n);
    *done = st.done;
    return rc;
}

int kvt_session_keep(kvt_session *s, size_t pos0, const int32_t *tok, size_t ran, size_t keep, const float *rows,
                     const kvt_wbuf *save)
{
    if (keep < 1 || keep > ran || pos0 + ran != s->n)
        return kvt_fail(KVT_EINVAL, "keep %zu of a pass of %zu tokens from %zu (the session holds %zu)", keep, ran,
                        pos0, s->n);
    if (keep == ran) return KVT_OK;
    if (kvt_session_fault == KVT_SESSION_FAULT_KEEP_ONE_MORE) keep++; /* tests: an off-by-one rollback */
    size_t V = s->m->info.n_vocab, end = pos0 + keep;
    ckpt_drop_after(s, end);
    if (!stateful(s)) {
        s->n = end;
        kvt_cache_truncate(s->cache, end);
        memcpy(s->logits, rows + (keep - 1) * V, V * sizeof(float));
        return KVT_OK;
    }
    /* the state before the pass, then the kept tokens again */
    kvt_rbuf r = {save ? save->p : NULL, save ? save->len : 0, 0};
    s->n = pos0;
    kvt_cache_truncate(s->cache, pos0);
    int rc = save && !save->oom ? s->m->arch->state_load(s, pos0, &r)
                                : kvt_fail(KVT_ENOMEM, "no state saved before the verify pass");
    if (!rc) rc = s->m->arch->forward(s, tok, keep, pos0, s->logits, keep - 1);
    if (rc) { recover(s, pos0); return rc; }
    s->n = end;
    if (s->n % s->ckpt_interval == 0) kvt_session_checkpoint(s);
    return KVT_OK;
}

int kvt_session_nll(kvt_session *s, const int32_t *tokens, size_t n, double *sum_nll, size_t *n_scored)
{
    *sum_nll = 0;
    *n_scored = 0;
    if (n < 2) return KVT_OK;
    if (n - 1 > s->n_ctx)
        return kvt_fail(KVT_ECTX, "%zu tokens exceed the context of %u tokens", n - 1, s->n_ctx);
    for (size_t i = 0; i < n; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= s->m->info.n_vocab)
            return kvt_fail(KVT_EINVAL, "token %zu: id %d out of range", i, tokens[i]);
    int rc = kvt_session_work(s);
    if (rc) return rc;
    size_t V = s->m->info.n_vocab;
    float *lg = kvt_malloc((size_t)s->chunk * V * sizeof(float));
    if (!lg) return KVT_ENOMEM;
    recover(s, 0);
    double sum = 0;
    while (s->n < n - 1) {
        size_t c = s->chunk < n - 1 - s->n ? s->chunk : n - 1 - s->n;
        if ((rc = s->m->arch->forward(s, tokens + s->n, c, s->n, lg, 0))) { recover(s, 0); break; }
        for (size_t i = 0; i < c; i++) {
            const float *l = lg + i * V;
            float mx = l[0];
            for (size_t j = 1; j < V; j++) mx = l[j] > mx ? l[j] : mx;
            double z = 0;
            for (size_t j = 0; j < V; j++) z += exp((double)l[j] - mx);
            sum += log(z) + mx - l[tokens[s->n + i + 1]];
        }
        memcpy(s->tokens + s->n, tokens + s->n, c * sizeof(int32_t));
        memcpy(s->logits, lg + (c - 1) * V, V * sizeof(float));
        s->n += c;
        s->logits_stale = false;
    }
    free(lg);
    if (rc) return rc;
    *sum_nll = sum;
    *n_scored = n - 1;
    return KVT_OK;
}

void kvt_session_bytes_parts(const kvt_session *s, kvt_session_parts *out)
{
    size_t V = s->m->info.n_vocab, ck = 0;
    kvt_cache_parts c;
    kvt_cache_bytes_parts(s->cache, &c);
    for (size_t i = 0; i < s->n_ckpt; i++) ck += s->ckpt[i].state.cap + V * sizeof(float);
    *out = (kvt_session_parts){
        .rows_whole = c.whole,
        .rows_pages = c.pages,
        .checkpoints = ck + s->cap_ckpt * sizeof *s->ckpt,
        .other = sizeof *s + c.other + (size_t)s->n_ctx * sizeof(int32_t) + V * sizeof(float),
        .scratch = kvt_session_scratch_bytes(s->m, s->work),
    };
}

size_t kvt_session_bytes(const kvt_session *s)
{
    kvt_session_parts p;
    kvt_session_bytes_parts(s, &p);
    return p.rows_whole + p.rows_pages + p.checkpoints + p.other + p.scratch;
}

int kvt_session_clone(kvt_session *dst, const kvt_session *src)
{
    if (dst->m != src->m || dst->n_ctx < src->n)
        return kvt_fail(KVT_EINVAL, "clone: another model or a smaller context");
    if (dst == src) return KVT_OK;
    kvt_session_ckpt_clear(dst);
    dst->n = 0;
    kvt_cache_truncate(dst->cache, 0);
    const kvt_cache *a = src->cache;
    kvt_cache *b = dst->cache;
    /* the rows by reference: no row is copied here; whichever of the two
     * writes a block they share first copies it (cache.h) */
    int rc = kvt_cache_share(b, a, src->n);
    if (rc) return rc;
    memcpy(b->state, a->state, a->state_bytes);
    memcpy(dst->tokens, src->tokens, src->n * sizeof(int32_t));
    memcpy(dst->logits, src->logits, (size_t)src->m->info.n_vocab * sizeof(float));
    dst->n = src->n;
    dst->logits_stale = src->logits_stale;
    memcpy(b->keys, a->keys, a->n_keys * sizeof *a->keys); /* the same tokens: the same block keys */
    b->n_keys = a->n_keys;
    b->key_scope = a->key_scope;
    for (size_t i = 0; i < src->n_ckpt; i++) ckpt_push(dst, src->ckpt[i].pos, src->ckpt[i].logits, &src->ckpt[i].state);
    return KVT_OK;
}

void kvt_session_set_mark(kvt_session *s, size_t pos) { s->mark = pos; }
void kvt_session_set_save_mark(kvt_session *s, size_t pos) { s->save_mark = pos; }

/* ---- trimming (eviction at block granularity, src/serve/tiers.c) ---- */

size_t kvt_session_resume_at(const kvt_session *s, size_t cut)
{
    if (cut >= s->n) return s->n;
    if (!stateful(s)) return cut;
    for (size_t i = s->n_ckpt; i-- > 0;)
        if (s->ckpt[i].pos <= cut) return s->ckpt[i].pos;
    return 0;
}

size_t kvt_session_trim(kvt_session *s, size_t cut)
{
    size_t at = kvt_session_resume_at(s, cut);
    if (at >= s->n) return s->n;
    if (!at) return 0;
    bool ok;
    return rollback_to(s, at, &ok);
}

bool kvt_session_block_private(const kvt_session *s, size_t b, const kvt_session *const *others, size_t n)
{
    for (size_t k = 0; k < s->cache->n_streams; k++) {
        const kvt_stream *st = &s->cache->streams[k];
        kvt_block *h = b < st->n_blocks ? st->held[b] : NULL;
        if (!h || atomic_load_explicit(&h->refs, memory_order_acquire) == 1) continue;
        for (size_t i = 0; i < n; i++) {
            const kvt_stream *o = others[i] && others[i] != s ? &others[i]->cache->streams[k] : NULL;
            /* held, or read as the base of a block it holds (a page it copied) */
            for (const kvt_block *x = o && b < o->n_blocks ? o->held[b] : NULL; x; x = x->base)
                if (x == h) return false;
        }
    }
    return true;
}
