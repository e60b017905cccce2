/* The cache tiers a request runs on: the RAM pool of live sessions, the
 * choice of session for a prompt, and the checkpoint mark its prefill
 * leaves.
 *
 * Tiers, in the order a prompt tries them:
 *   1. RAM: a pool of live sessions under the RAM budget. The prompt goes to
 *      the session with the longest reusable prefix, matched on token ids or,
 *      when the client resent the conversation as text, on the rendered bytes
 *      of the session's exact sampled tokens (only the new suffix is then
 *      tokenized, so a sampled token that the tokenizer would split
 *      differently does not break reuse). Least recently used sessions are
 *      saved to disk (reason evict) and dropped beyond the budget.
 *   2. Disk: the store (store.c), when it covers more of the prompt.
 *   3. Nothing: a new session, all of it prefilled by the caller.
 *
 * Each tenant (API key) has its own share of the budget, in bytes and in
 * sessions; sessions of one tenant are never candidates for another's
 * prompts nor evicted to make room for them. The pool keeps no lock: its
 * one caller (the server's worker) owns it and its sessions, except those
 * it lent to another thread: a session being restored from disk
 * (defer_loads: loading, neither read nor counted until kvt_tiers_loaded)
 * and the dropped sessions handed off to be saved (hooks.hand_off: no
 * longer in the pool; hooks.held counts them against the tenant's share). */
#include "serve/tiers.h"
#include "arch/model.h"
#include "store/store.h"
#include "chat/template.h"
#include "base/util.h"

#include <malloc.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MIN_FORK 256  /* a shorter shared prefix is not worth copying a session */
#define LOOKUP_WAIT_MS 5 /* with defer_loads, a store busy for longer is a miss */

int kvt_tiers_new(kvt_tiers **out, kvt_model *m, const kvt_tiers_opts *o)
{
    *out = NULL;
    if (!o->n_tenants || o->n_tenants > KVT_TIERS_MAX_POOL)
        return kvt_fail(KVT_EINVAL, "%zu tenants for a pool of %d sessions", o->n_tenants, KVT_TIERS_MAX_POOL);
    kvt_tiers *t = kvt_calloc(1, sizeof *t);
    if (!t) return KVT_ENOMEM;
    t->o = *o;
    t->m = m;
    if (!(t->threads = kvt_pool_new(o->n_threads))) {
        free(t);
        return kvt_fail(KVT_ENOMEM, "cannot start the sessions' %u worker threads", o->n_threads);
    }
    *out = t;
    return KVT_OK;
}

/* Freed sessions' memory goes back to the system once TRIM_BYTES of them
 * were dropped: glibc keeps freed memory in its arenas otherwise, above
 * what the budget counts (ds4-mini, --kv-ram-mb 64, 120 prompts of 300
 * tokens: 72 MiB over the model without, 56 MiB with). Not after every
 * drop: a trim costs some milliseconds. */
#define TRIM_BYTES ((size_t)16 << 20)
static void give_back(kvt_tiers *t)
{
    if (t->freed < TRIM_BYTES) return;
    malloc_trim(0);
    t->freed = 0;
}

void kvt_tiers_free(kvt_tiers *t)
{
    if (!t) return;
    for (size_t i = 0; i < t->n; i++) kvt_session_free(t->pool[i].s);
    for (size_t i = 0; i < t->n_spare; i++) kvt_session_scratch_free(t->m, t->spare[i]);
    kvt_pool_free(t->threads);
    free(t);
}

size_t kvt_tiers_bytes(const kvt_tiers *t, int tenant)
{
    size_t b = 0;
    for (size_t i = 0; i < t->n; i++)
        if ((tenant < 0 || t->pool[i].tenant == tenant) && !t->pool[i].loading) b += kvt_session_bytes(t->pool[i].s);
    return b;
}

size_t kvt_tiers_spare_bytes(const kvt_tiers *t)
{
    size_t b = 0;
    for (size_t i = 0; i < t->n_spare; i++) b += kvt_session_scratch_bytes(t->m, t->spare[i]);
    return b;
}

size_t kvt_tiers_count(const kvt_tiers *t, int tenant)
{
    size_t n = 0;
    for (size_t i = 0; i < t->n; i++) n += tenant < 0 || t->pool[i].tenant == tenant;
    return n;
}

size_t kvt_tiers_busy(const kvt_tiers *t)
{
    size_t n = 0;
    for (size_t i = 0; i < t->n; i++) n += t->pool[i].busy;
    return n;
}

bool kvt_tiers_fault_keep_scratch;

void kvt_tiers_release(kvt_tiers *t, const kvt_session *s)
{
    for (size_t i = 0; i < t->n; i++) {
        if (t->pool[i].s != s || !t->pool[i].busy) continue;
        t->pool[i].busy = false;
        if (kvt_tiers_fault_keep_scratch) continue;
        void *w = kvt_session_park(t->pool[i].s);
        if (w && t->n_spare < KVT_TIERS_MAX_BUSY) t->spare[t->n_spare++] = w;
        else kvt_session_scratch_free(t->m, w);
    }
}

/* A session picked: it takes a spare scratch when there is one (else it
 * makes its own when it first runs). */
static void lend(kvt_tiers *t, kvt_session *s)
{
    if (t->n_spare) kvt_session_lend(s, t->spare[--t->n_spare]);
}

void kvt_tiers_defer(kvt_tiers *t, kvt_tier_pick *pick)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->pool[i].s == pick->s) t->pool[i].loading = true;
}

void kvt_tiers_loaded(kvt_tiers *t, kvt_tier_pick *pick, size_t got)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->pool[i].s == pick->s) t->pool[i].loading = false;
    pick->load = 0;
    if (got) { pick->from_disk = pick->reused = got; pick->tier = "disk"; }
}

void kvt_tiers_drop(kvt_tiers *t, size_t i, kvt_store *store, const char *reason)
{
    kvt_session *s = t->pool[i].s;
    const kvt_tier_hooks *h = &t->o.hooks;
    bool save = store && kvt_session_len(s) >= t->o.policy.min_tokens;
    if (save && h->hand_off && h->hand_off(h->user, t->pool[i].tenant, store, s, reason)) {
        t->pool[i] = t->pool[--t->n];
        return;
    }
    if (save) {
        double t0 = kvt_now();
        bool created = false;
        int rc = kvt_store_save_new(store, s, kvt_session_len(s), reason, NULL, &created);
        if (h->saved) h->saved(h->user, t->pool[i].tenant, kvt_now() - t0, rc, created);
    }
    t->freed += kvt_session_bytes(s);
    kvt_session_free(s);
    t->pool[i] = t->pool[--t->n];
}

/* Longest prefix of a session's exact tokens whose rendered bytes start the
 * prompt text: the retokenization defence. Returns the token count. */
static size_t text_match(const kvt_model *m, const kvt_session *s, const char *text, size_t len)
{
    const int32_t *t = kvt_session_tokens(s);
    size_t n = kvt_session_len(s), off = 0, k = 0;
    for (; k < n; k++) {
        const char *p;
        size_t pl;
        if (kvt_token_piece(m, t[k], &p, &pl) != KVT_OK || pl > len - off || memcmp(text + off, p, pl)) break;
        off += pl;
    }
    return k;
}

/* Tokens of the prompt for a session whose first k tokens render the start
 * of the prompt text: its exact tokens, then the suffix tokenized alone. */
static int splice(const kvt_model *m, const kvt_session *s, size_t k, const char *text, size_t len,
                  int32_t **out, size_t *n)
{
    const int32_t *t = kvt_session_tokens(s);
    size_t off = 0;
    for (size_t i = 0; i < k; i++) {
        const char *p;
        size_t pl;
        kvt_token_piece(m, t[i], &p, &pl);
        off += pl;
    }
    int32_t *suf = NULL;
    size_t ns = 0;
    int rc = kvt_tokenizer_encode(m->tok, text + off, len - off, false, true, &suf, &ns);
    if (rc) return rc;
    int32_t *all = kvt_malloc((k + ns + 1) * sizeof *all);
    if (!all) { free(suf); return KVT_ENOMEM; }
    memcpy(all, t, k * sizeof *all);
    memcpy(all + k, suf, ns * sizeof *all);
    free(suf);
    *out = all;
    *n = k + ns;
    return KVT_OK;
}

int kvt_tiers_fault;

static size_t common_prefix(const int32_t *a, size_t na, const int32_t *b, size_t nb)
{
    size_t n = na < nb ? na : nb, i = 0;
    while (i < n && a[i] == b[i]) i++;
    return i - (i && kvt_tiers_fault == KVT_TIERS_FAULT_PREFIX_SHORT);
}

/* Whether the template's marker q (n tokens) is at toks[i]. */
static bool marker_at(const int32_t *q, size_t nq, const int32_t *toks, size_t n, size_t i)
{
    return nq && n - i >= nq && !memcmp(toks + i, q, nq * sizeof *toks);
}

/* Where the prefill of toks[0..n) leaves a checkpoint: where the last user
 * turn begins, so that the next conversation on the same prompt forks
 * there; *opening when no assistant turn comes before it (a conversation's
 * first request). 0: nowhere. */
static size_t checkpoint_mark(const kvt_model *m, const int32_t *toks, size_t n, const kvt_tier_prompt *p,
                              bool *opening)
{
    const kvt_template *tpl = kvt_template_for(m); /* its turn markers, if it has any */
    kvt_template_tokens tt;
    kvt_template_tokens_get(tpl, m, &tt);
    size_t mark = 0;
    *opening = tt.n_assistant > 0;
    for (size_t i = n; tt.n_user && i-- > 1;) {
        if (!mark && marker_at(tt.user, tt.n_user, toks, n, i)) mark = i;
        if (mark && marker_at(tt.assistant, tt.n_assistant, toks, n, i)) *opening = false;
    }
    /* the mark goes where the last user message's own text begins, when the
     * template wrote it (after its turn's marker, and in Gemma after the
     * system prompt the first user turn carries): the common prefix of the
     * prompt's tokens and those of the prompt up to there */
    if (p->fork_at != SIZE_MAX && p->fork_at <= p->len) {
        int32_t *pt = NULL;
        size_t np = 0;
        if (kvt_tokenizer_encode(m->tok, p->text, p->fork_at, p->has_bos ? false : m->info.add_bos, p->special,
                                 &pt, &np) == KVT_OK) {
            size_t f = common_prefix(pt, np, toks, n);
            if (f > 0 && f < n) { mark = f; *opening = p->opening; }
        }
        free(pt);
    }
    return mark;
}

/* Free the spare scratch while the sessions and it exceed the budget: it
 * counts against the budget too, and goes before any session (making it
 * again costs less than any session's prefill). Then drop the tenant's
 * least recently used sessions, never keep (a fork's source, NULL: none)
 * nor a busy one, until a new session fits in its share (or only those
 * are left: busy sessions may take a tenant past its share until they are
 * released). */
static void make_room(kvt_tiers *t, int tenant, kvt_store *store, const kvt_session *keep)
{
    size_t share = t->o.ram_bytes / t->o.n_tenants, slots = KVT_TIERS_MAX_POOL / t->o.n_tenants;
    const kvt_tier_hooks *h = &t->o.hooks;
    while (t->n_spare && kvt_tiers_bytes(t, -1) + kvt_tiers_spare_bytes(t) > t->o.ram_bytes) {
        void *w = t->spare[--t->n_spare];
        t->freed += kvt_session_scratch_bytes(t->m, w);
        kvt_session_scratch_free(t->m, w);
    }
    while (kvt_tiers_count(t, tenant) > (keep ? 1u : 0u) &&
           (kvt_tiers_count(t, tenant) >= slots ||
            kvt_tiers_bytes(t, tenant) + (h->held ? h->held(h->user, tenant) : 0) > share)) {
        size_t lru = SIZE_MAX;
        for (size_t i = 0; i < t->n; i++)
            if (t->pool[i].tenant == tenant && t->pool[i].s != keep && !t->pool[i].busy &&
                (lru == SIZE_MAX || t->pool[i].last_used < t->pool[lru].last_used))
                lru = i;
        if (lru == SIZE_MAX) break;
        kvt_tiers_drop(t, lru, store, "evict");
        if (h->evicted) h->evicted(h->user, tenant);
    }
    give_back(t);
}

int kvt_tiers_select(kvt_tiers *t, int tenant, kvt_store *store, const kvt_tier_prompt *p, int32_t **toks,
                     size_t *n, kvt_tier_pick *out)
{
    kvt_model *m = t->m;
    *out = (kvt_tier_pick){.tier = "none"};
    /* tier 1: RAM. Per session: the common token prefix, or (when the client
     * resent our output as text) the longer prefix matched on its bytes. */
    size_t best = SIZE_MAX, reuse = 0;
    int32_t *best_alt = NULL;
    size_t best_alt_n = 0;
    for (size_t i = 0; i < t->n; i++) {
        if (t->pool[i].tenant != tenant || t->pool[i].loading) continue;
        kvt_session *s = t->pool[i].s;
        size_t c = common_prefix(kvt_session_tokens(s), kvt_session_len(s), *toks, *n);
        size_t k = text_match(m, s, p->text, p->len);
        int32_t *alt = NULL;
        size_t na = 0;
        if (k > c && splice(m, s, k, p->text, p->len, &alt, &na) == KVT_OK) c = k;
        if (c > reuse) {
            reuse = c;
            best = i;
            free(best_alt);
            best_alt = alt;
            best_alt_n = na;
        } else {
            free(alt);
        }
    }
    if (best_alt) { free(*toks); *toks = best_alt; *n = best_alt_n; }
    if (*n > t->o.n_ctx) return kvt_fail(KVT_ECTX, "the prompt has %zu tokens, the context %u", *n, t->o.n_ctx);
    /* tier 2: disk, when it covers more than RAM does */
    size_t disk_match = 0;
    int64_t disk_id = -1;
    if (store && t->o.defer_loads) kvt_store_lookup_try(store, m, *toks, *n, LOOKUP_WAIT_MS, &disk_match, &disk_id);
    else if (store) kvt_store_lookup(store, m, *toks, *n, &disk_match, &disk_id);
    /* A session is extended in place when the prompt continues it. A prompt
     * that leaves it part way (another conversation on the same system
     * prompt) gets a copy, so the session it shares a prefix with stays
     * whole; a short shared prefix is not worth a copy. */
    if (kvt_tiers_busy(t) >= KVT_TIERS_MAX_BUSY)
        return kvt_fail(KVT_EINVAL, "%d sessions are busy already", KVT_TIERS_MAX_BUSY);
    bool extend = best != SIZE_MAX && !t->pool[best].busy && reuse > 0 && reuse >= disk_match &&
                  (reuse == kvt_session_len(t->pool[best].s) || reuse >= t->pool[best].prompt_end);
    bool fork = !extend && best != SIZE_MAX && reuse >= MIN_FORK && reuse >= disk_match;
    kvt_session *s = NULL;
    if (extend) {
        s = t->pool[best].s;
        t->pool[best].last_used = ++t->clock;
        t->pool[best].busy = true;
        t->pool[best].prompt_end = *n;
        lend(t, s);
        *out = (kvt_tier_pick){.s = s, .reused = reuse, .tier = "ram", .extended = true};
    } else {
        kvt_session *src = fork ? t->pool[best].s : NULL;
        if (fork) t->pool[best].last_used = ++t->clock; /* keep the source out of the eviction below */
        make_room(t, tenant, store, src);
        kvt_session_opts so = {.n_ctx = t->o.n_ctx, .n_threads = t->o.n_threads,
                               .checkpoint_interval = kvt_save_policy_grid(&t->o.policy)};
        int rc;
        if ((rc = kvt_session_new_on(&s, m, &so, t->threads)) || (src && (rc = kvt_session_clone(s, src)))) {
            kvt_session_free(s);
            return rc;
        }
        if (t->n == KVT_TIERS_MAX_POOL + KVT_TIERS_MAX_BUSY) { /* every other tenant's share full, and busy ones */
            kvt_session_free(s);
            return kvt_fail(KVT_ENOMEM, "the RAM pool holds %zu sessions", t->n);
        }
        t->pool[t->n++] = (kvt_pooled){s, ++t->clock, tenant, true, false, *n};
        lend(t, s);
        *out = (kvt_tier_pick){.s = s, .reused = src ? reuse : 0, .tier = src ? "ram" : "none", .forked = src != NULL};
        if (!src && disk_match && store && t->o.defer_loads) {
            t->pool[t->n - 1].loading = true;
            out->load = disk_match;
            out->load_id = disk_id;
        } else if (!src && disk_match && store) {
            double t0 = kvt_now();
            size_t got = 0;
            rc = kvt_store_restore_found(store, s, *toks, *n, disk_match, disk_id, &got);
            const kvt_tier_hooks *h = &t->o.hooks;
            if (h->loaded) h->loaded(h->user, tenant, kvt_now() - t0);
            if (!rc && got) { out->from_disk = out->reused = got; out->tier = "disk"; }
        }
    }
    out->mark = checkpoint_mark(m, *toks, *n, p, &out->opening);
    kvt_session_set_mark(s, out->mark);
    kvt_save_policy_mark(&t->o.policy, s, *n);
    return KVT_OK;
}
