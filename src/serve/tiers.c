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
 *      differently does not break reuse); the match on token ids goes
 *      through an index over the sessions' full blocks. Beyond the budget the least recently used
 *      session gives back its own tail blocks one by one (saved to disk
 *      first, reason evict), then goes whole (make_room).
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
#include "session/snapshot.h"
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
    for (size_t i = 0; i < t->n; i++) {
        kvt_session_free(t->pool[i].s);
        kvt_session_free(t->pool[i].draft);
        free(t->pool[i].ik);
    }
    free(t->ix);
    for (size_t i = 0; i < t->n_spare; i++) kvt_session_scratch_free(t->m, t->spare[i]);
    kvt_pool_free(t->threads);
    free(t);
}

size_t kvt_tiers_bytes(const kvt_tiers *t, int tenant)
{
    size_t b = 0;
    for (size_t i = 0; i < t->n; i++)
        if ((tenant < 0 || t->pool[i].tenant == tenant) && !t->pool[i].loading)
            b += kvt_session_bytes(t->pool[i].s) +
                 (t->pool[i].draft && kvt_tiers_fault != KVT_TIERS_FAULT_DRAFT_UNCOUNTED /* tests */
                      ? kvt_session_bytes(t->pool[i].draft) : 0);
    return b;
}

size_t kvt_tiers_draft_bytes(const kvt_tiers *t, int tenant)
{
    size_t b = 0;
    for (size_t i = 0; i < t->n; i++)
        if ((tenant < 0 || t->pool[i].tenant == tenant) && t->pool[i].draft) b += kvt_session_bytes(t->pool[i].draft);
    return b;
}

size_t kvt_tiers_spare_bytes(const kvt_tiers *t)
{
    size_t b = 0;
    for (size_t i = 0; i < t->n_spare; i++) b += kvt_session_scratch_bytes(t->m, t->spare[i]);
    return b;
}

void kvt_tiers_reserve(kvt_tiers *t, int tenant, size_t bytes) { t->reserved[tenant] += bytes; }

void kvt_tiers_unreserve(kvt_tiers *t, int tenant, size_t bytes)
{
    t->reserved[tenant] -= bytes < t->reserved[tenant] ? bytes : t->reserved[tenant];
}

size_t kvt_tiers_reserved(const kvt_tiers *t, int tenant)
{
    size_t b = 0;
    for (size_t i = 0; i < t->o.n_tenants; i++)
        if (tenant < 0 || (size_t)tenant == i) b += t->reserved[i];
    return b;
}

/* What counts against the budget beside the sessions: the reservations. */
static size_t reserved_counted(const kvt_tiers *t, int tenant)
{
    return kvt_tiers_fault == KVT_TIERS_FAULT_UNRESERVED ? 0 : kvt_tiers_reserved(t, tenant); /* tests */
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
static void ix_refresh(kvt_tiers *t, kvt_pooled *p);

void kvt_tiers_release(kvt_tiers *t, const kvt_session *s)
{
    for (size_t i = 0; i < t->n; i++) {
        if (t->pool[i].s != s || !t->pool[i].busy) continue;
        t->pool[i].busy = false;
        if (!t->pool[i].loading) ix_refresh(t, &t->pool[i]); /* its blocks as the request left them */
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

/* ---- the index over the blocks in RAM ----
 *
 * Every full block of every pooled session, keyed by its chained key
 * (kvt_snap_keys_in: the key of block b covers tokens [0, 128 (b + 1)), so
 * equal keys mean equal prefixes): key -> (session, block, tenant). The
 * chain is of the pool's scope (kvt_tiers_opts.keys): the disk tier's when
 * there is one, so that a save or a lookup finds the session's keys made;
 * else one seeded without the model's fingerprint, whose first use would
 * read every weight for keys that never leave the process.
 * A prompt's longest prefix held in RAM is then the longest run of its
 * own chained keys found for its tenant, plus what the sessions holding
 * the last of those blocks share of the partial block after it. Open
 * addressing with linear probing on the key (already a hash), deletion by
 * shifting the run back; each session keeps the keys it has entries for
 * (kvt_pooled.ik), so its entries follow it as it grows, goes back or is
 * trimmed (ix_refresh), at the cost of its changed blocks only. */

static size_t ix_slot(const kvt_tiers *t, uint64_t key) { return (size_t)(key ^ key >> 32) & (t->ix_cap - 1); }

static bool ix_grow(kvt_tiers *t)
{
    size_t cap = t->ix_cap ? 2 * t->ix_cap : 256, old_cap = t->ix_cap;
    kvt_tier_ix *old = t->ix, *nw = kvt_calloc(cap, sizeof *nw);
    if (!nw) return false;
    t->ix = nw;
    t->ix_cap = cap;
    for (size_t i = 0; i < old_cap; i++) {
        if (!old[i].s) continue;
        size_t j = ix_slot(t, old[i].key);
        while (nw[j].s) j = (j + 1) & (cap - 1);
        nw[j] = old[i];
    }
    free(old);
    return true;
}

static bool ix_add(kvt_tiers *t, uint64_t key, const kvt_session *s, size_t b, int tenant)
{
    if (2 * (t->ix_n + 1) > t->ix_cap && !ix_grow(t)) return false;
    size_t j = ix_slot(t, key);
    while (t->ix[j].s) j = (j + 1) & (t->ix_cap - 1);
    t->ix[j] = (kvt_tier_ix){key, s, (uint32_t)b, tenant};
    t->ix_n++;
    return true;
}

static void ix_del(kvt_tiers *t, uint64_t key, const kvt_session *s)
{
    if (!t->ix_cap) return;
    size_t mask = t->ix_cap - 1, i = ix_slot(t, key);
    while (t->ix[i].s && !(t->ix[i].key == key && t->ix[i].s == s)) i = (i + 1) & mask;
    if (!t->ix[i].s) return;
    /* the entries after the hole in its run move back into it unless their
     * own slot lies cyclically in (hole, entry] */
    for (size_t j = i;;) {
        j = (j + 1) & mask;
        if (!t->ix[j].s) break;
        size_t k = ix_slot(t, t->ix[j].key);
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
        t->ix[i] = t->ix[j];
        i = j;
    }
    t->ix[i] = (kvt_tier_ix){0};
    t->ix_n--;
}

/* Bring pooled session p's entries up to the full blocks it holds now: in
 * O(1) when they did not change (the key of its last full block, which
 * chains all the others), else from the first block that changed (found
 * by bisection: the keys chain) on. Out of memory: the blocks left out are
 * not found in RAM, nothing else. */
static void ix_refresh(kvt_tiers *t, kvt_pooled *p)
{
    kvt_session *s = p->s;
    size_t nb = kvt_session_len(s) / KVT_BLOCK, cap = (size_t)t->o.n_ctx / KVT_BLOCK + 1;
    if (nb > cap) nb = cap;
    if (!p->ik && !(p->ik = kvt_malloc(cap * sizeof *p->ik))) return;
    const uint64_t *k = nb ? kvt_snap_keys_in(s, nb, t->o.keys) : NULL;
    if (nb == p->nik && (!nb || k[nb - 1] == p->ik[nb - 1])) return;
    size_t lo = 0, hi = nb < p->nik ? nb : p->nik;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (p->ik[mid] == k[mid]) lo = mid + 1;
        else hi = mid;
    }
    for (size_t b = lo; b < p->nik; b++) ix_del(t, p->ik[b], s);
    p->nik = lo;
    for (size_t b = lo; b < nb && ix_add(t, k[b], s, b, p->tenant); b++) {
        p->ik[b] = k[b];
        p->nik = b + 1;
    }
}

/* Pooled session p leaves the pool: its entries go. */
static void ix_forget(kvt_tiers *t, kvt_pooled *p)
{
    for (size_t b = 0; b < p->nik; b++) ix_del(t, p->ik[b], p->s);
    free(p->ik);
    p->ik = NULL;
    p->nik = 0;
}

static size_t pool_index(const kvt_tiers *t, const kvt_session *s)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->pool[i].s == s) return i;
    return SIZE_MAX;
}

size_t kvt_tiers_index_entries(const kvt_tiers *t, int tenant)
{
    size_t k = 0;
    for (size_t i = 0; i < t->ix_cap; i++) k += t->ix[i].s && (tenant < 0 || t->ix[i].tenant == tenant);
    return k;
}

/* Save session s (the pool's no longer) to store per the policy with
 * reason, or hand it off to be saved, then free it. */
static void save_free(kvt_tiers *t, int tenant, kvt_session *s, kvt_store *store, const char *reason)
{
    const kvt_tier_hooks *h = &t->o.hooks;
    bool save = store && kvt_session_len(s) >= t->o.policy.min_tokens && kvt_session_logits(s);
    if (save && h->hand_off && h->hand_off(h->user, tenant, store, s, reason)) return;
    if (save) {
        double t0 = kvt_now();
        bool created = false;
        int rc = kvt_store_save_new(store, s, kvt_session_len(s), reason, NULL, &created);
        if (h->saved) h->saved(h->user, tenant, kvt_now() - t0, rc, created);
    }
    t->freed += kvt_session_bytes(s);
    kvt_session_free(s);
}

/* Pooled session i's companion goes: saved (reason given) and freed. */
static void drop_draft(kvt_tiers *t, size_t i, kvt_store *store, const char *reason)
{
    kvt_session *d = t->pool[i].draft;
    t->pool[i].draft = NULL;
    if (d) save_free(t, t->pool[i].tenant, d, store, reason);
}

void kvt_tiers_drop(kvt_tiers *t, size_t i, kvt_store *store, const char *reason)
{
    kvt_session *s = t->pool[i].s;
    int tenant = t->pool[i].tenant;
    /* not again when saved before its first block went (trim_tail), nor
     * at a length a trim left without logits */
    bool saved = t->pool[i].saved;
    ix_forget(t, &t->pool[i]);
    kvt_session *d = t->pool[i].draft;
    t->pool[i] = t->pool[--t->n];
    save_free(t, tenant, s, saved ? NULL : store, reason);
    if (d) save_free(t, tenant, d, store, reason);
}

kvt_session *kvt_tiers_take_draft(kvt_tiers *t, const kvt_session *s)
{
    size_t i = pool_index(t, s);
    if (i == SIZE_MAX) return NULL;
    kvt_session *d = t->pool[i].draft;
    t->pool[i].draft = NULL;
    return d;
}

static size_t held_one(const kvt_tiers *t, int tenant);

bool kvt_tiers_keep_draft(kvt_tiers *t, const kvt_session *s, kvt_session *d)
{
    size_t i = pool_index(t, s);
    if (i == SIZE_MAX || t->pool[i].draft || t->pool[i].loading) return false;
    /* parked: its scratch (the draft model's, no spare of the pool's) freed */
    void *w = kvt_session_park(d);
    if (w) kvt_session_scratch_free(d->m, w);
    int tenant = t->pool[i].tenant;
    size_t share = t->o.ram_bytes / t->o.n_tenants;
    if (kvt_tiers_bytes(t, tenant) + kvt_session_bytes(d) + reserved_counted(t, tenant) + held_one(t, tenant) > share)
        return false;
    t->pool[i].draft = d;
    return true;
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

/* Save pooled session i to store (reason evict) before it loses its first
 * block, when the policy wants it and it was not saved since it last ran:
 * a copy by reference goes to hooks.hand_off (the session stays), else it
 * is saved here. */
static void save_before_trim(kvt_tiers *t, size_t i, kvt_store *store)
{
    kvt_pooled *p = &t->pool[i];
    kvt_session *s = p->s;
    const kvt_tier_hooks *h = &t->o.hooks;
    if (!store || p->saved) return;
    p->saved = true;
    if (kvt_session_len(s) < t->o.policy.min_tokens || !kvt_session_logits(s)) return;
    if (h->hand_off) {
        kvt_session_opts so = {.n_ctx = t->o.n_ctx, .n_threads = t->o.n_threads,
                               .checkpoint_interval = kvt_save_policy_grid(&t->o.policy)};
        kvt_session *c = NULL;
        bool ok = !kvt_session_new_on(&c, t->m, &so, t->threads) && !kvt_session_clone(c, s);
        if (ok) kvt_session_ckpt_clear(c); /* saved at its length: its state is the cache's own */
        if (ok && h->hand_off(h->user, p->tenant, store, c, "evict")) return;
        kvt_session_free(c);
    }
    double t0 = kvt_now();
    bool created = false;
    int rc = kvt_store_save_new(store, s, kvt_session_len(s), "evict", NULL, &created);
    if (h->saved) h->saved(h->user, p->tenant, kvt_now() - t0, rc, created);
}

/* Let go of the last block of pooled session i (the partial one, else its
 * last full one) when it frees memory: no other pooled session holds it.
 * Rows per token are cut at the block's start; a session with a window or
 * recurrent state at its latest checkpoint at or before it (which may let
 * go of more blocks). Saved first (save_before_trim). false: nothing to
 * let go of that way (its last block is shared, or no checkpoint to go
 * back to, or it would be left empty): the session goes whole if at all. */
static bool trim_tail(kvt_tiers *t, size_t i, kvt_store *store)
{
    if (t->pool[i].draft) { /* its companion first: the draft model's prefill costs less than the model's */
        drop_draft(t, i, store, "evict");
        return true;
    }
    kvt_session *s = t->pool[i].s;
    size_t n = kvt_session_len(s);
    if (!n) return false;
    size_t last = (n - 1) / KVT_BLOCK, cut = last * KVT_BLOCK;
    const kvt_session *others[KVT_TIERS_MAX_POOL + KVT_TIERS_MAX_BUSY];
    for (size_t j = 0; j < t->n; j++) others[j] = t->pool[j].s;
    if (kvt_tiers_fault != KVT_TIERS_FAULT_TRIM_SHARED && !kvt_session_block_private(s, last, others, t->n))
        return false;
    size_t at = kvt_session_resume_at(s, cut);
    if (!at) return false;
    save_before_trim(t, i, store);
    size_t got = kvt_session_trim(s, at);
    ix_refresh(t, &t->pool[i]);
    const kvt_tier_hooks *h = &t->o.hooks;
    if (got && h->trimmed) h->trimmed(h->user, t->pool[i].tenant, n, got);
    return got > 0;
}

static size_t held_one(const kvt_tiers *t, int tenant)
{
    const kvt_tier_hooks *h = &t->o.hooks;
    return h->held ? h->held(h->user, tenant) : 0;
}

/* The saves queued (hooks.held) of every tenant: sessions handed off and
 * not yet written, RAM until then. */
static size_t held_all(const kvt_tiers *t)
{
    const kvt_tier_hooks *h = &t->o.hooks;
    size_t b = 0;
    for (size_t i = 0; h->held && i < t->o.n_tenants; i++) b += h->held(h->user, (int)i);
    return b;
}

/* Free the spare scratch while the sessions, the reservations, the saves
 * queued and it exceed the budget: it counts against the budget too, and
 * goes before any session (making it again costs less than any session's
 * prefill). Then,
 * while the tenant's sessions, reservations (kvt_tiers_reserve) and saves
 * queued (hooks.held) are over its share, take from its least recently used session, never keep
 * (a fork's source, NULL: none) nor a busy one: its last block when no
 * other session holds it (trim_tail: block by block on the 128-token
 * grid, the shared prefix kept), else the session whole; over its count
 * of sessions, the session whole. Busy sessions may take a tenant past
 * its share until they are released. */
static void make_room(kvt_tiers *t, int tenant, kvt_store *store, const kvt_session *keep)
{
    size_t share = t->o.ram_bytes / t->o.n_tenants, slots = KVT_TIERS_MAX_POOL / t->o.n_tenants;
    const kvt_tier_hooks *h = &t->o.hooks;
    /* KVT_TIERS_FAULT_SPARES_UNHELD (tests): the queued saves left out, as
     * before, and the spares kept past the budget by as much as they hold */
    size_t queued = kvt_tiers_fault == KVT_TIERS_FAULT_SPARES_UNHELD ? 0 : held_all(t);
    while (t->n_spare &&
           kvt_tiers_bytes(t, -1) + kvt_tiers_spare_bytes(t) + reserved_counted(t, -1) + queued > t->o.ram_bytes) {
        void *w = t->spare[--t->n_spare];
        t->freed += kvt_session_scratch_bytes(t->m, w);
        kvt_session_scratch_free(t->m, w);
    }
    size_t bytes = kvt_tiers_bytes(t, tenant), outside = reserved_counted(t, tenant);
    while (kvt_tiers_count(t, tenant) > (keep ? 1u : 0u) &&
           (kvt_tiers_count(t, tenant) >= slots ||
            bytes + outside + (h->held ? h->held(h->user, tenant) : 0) > share)) {
        bool any = kvt_tiers_fault == KVT_TIERS_FAULT_TRIM_SHARED;
        size_t lru = SIZE_MAX;
        for (size_t i = 0; i < t->n; i++)
            if (t->pool[i].tenant == tenant && t->pool[i].s != keep && (!t->pool[i].busy || any) &&
                !t->pool[i].loading && (lru == SIZE_MAX || t->pool[i].last_used < t->pool[lru].last_used))
                lru = i;
        if (lru == SIZE_MAX) break;
        if (kvt_tiers_count(t, tenant) < slots) {
            /* counted again: the block let go may have read a base that
             * counted in this session and counts in another holder now */
            size_t before = kvt_session_bytes(t->pool[lru].s);
            if (trim_tail(t, lru, store)) {
                size_t after = kvt_session_bytes(t->pool[lru].s);
                t->freed += before > after ? before - after : 0;
                bytes = kvt_tiers_bytes(t, tenant);
                continue;
            }
        }
        kvt_tiers_drop(t, lru, store, "evict");
        if (h->evicted) h->evicted(h->user, tenant);
        bytes = kvt_tiers_bytes(t, tenant); /* blocks it shared count in their other holders now */
    }
    give_back(t);
}

/* Longest common prefix of toks[0..n) and a session's tokens from token
 * `from` on (they agree before it). */
static size_t match_from(const kvt_session *s, const int32_t *toks, size_t n, size_t from)
{
    size_t len = kvt_session_len(s);
    if (len < from) return 0;
    const int32_t *a = kvt_session_tokens(s);
    size_t lim = (len < n ? len : n), i = from;
    while (i < lim && a[i] == toks[i]) i++;
    return i;
}

/* The tenant's session holding the longest prefix of toks[0..n) (*best:
 * its pool index, SIZE_MAX: none) and that prefix's length. Through the
 * index: the prompt's chained keys probed from its last full block down;
 * the sessions holding the longest block found (every session of the
 * tenant when none) are then compared on the tokens after it, and the one
 * chosen on all the tokens before it too (a key is a hash: rows of
 * another prefix are never used). Ties go to the first in the pool. */
static size_t ram_match(kvt_tiers *t, int tenant, const int32_t *toks, size_t n, size_t *best)
{
    *best = SIZE_MAX;
    size_t nb = n / KVT_BLOCK, from = 0, nc = 0;
    size_t cand[KVT_TIERS_MAX_POOL + KVT_TIERS_MAX_BUSY];
    uint64_t *kp = nb ? kvt_malloc(nb * sizeof *kp) : NULL;
    if (kp) {
        uint64_t key = kvt_snap_key0_in(t->m, t->o.keys);
        for (size_t b = 0; b < nb; b++) kp[b] = key = kvt_snap_key_next(key, toks + b * KVT_BLOCK);
    }
    for (size_t b = kp ? nb : 0; b-- > 0 && !nc && t->ix_cap;) {
        for (size_t j = ix_slot(t, kp[b]); t->ix[j].s; j = (j + 1) & (t->ix_cap - 1)) {
            if (t->ix[j].key != kp[b] || t->ix[j].tenant != tenant) continue;
            size_t i = pool_index(t, t->ix[j].s);
            if (i != SIZE_MAX && !t->pool[i].loading) cand[nc++] = i;
        }
        if (nc) from = (b + 1) * KVT_BLOCK;
    }
    free(kp);
    for (int pass = 0; pass < 2; pass++) {
        if (!nc) { /* no block matched (or none checked out): every session of the tenant */
            from = 0;
            for (size_t i = 0; i < t->n; i++)
                if (t->pool[i].tenant == tenant && !t->pool[i].loading) cand[nc++] = i;
        }
        while (nc) {
            size_t bi = SIZE_MAX, bc = 0, k = 0;
            for (size_t c = 0; c < nc; c++) {
                size_t m = match_from(t->pool[cand[c]].s, toks, n, from);
                if (m > bc || (m == bc && m && cand[c] < bi)) { bc = m; bi = cand[c]; k = c; }
            }
            if (bi == SIZE_MAX) { nc = 0; break; }
            if (!memcmp(kvt_session_tokens(t->pool[bi].s), toks, from * sizeof *toks)) {
                *best = bi;
                return bc - (bc && kvt_tiers_fault == KVT_TIERS_FAULT_PREFIX_SHORT);
            }
            cand[k] = cand[--nc]; /* a key that matched other tokens */
        }
        if (!from) break;
    }
    return 0;
}

int kvt_tiers_select(kvt_tiers *t, int tenant, kvt_store *store, const kvt_tier_prompt *p, int32_t **toks,
                     size_t *n, kvt_tier_pick *out)
{
    kvt_model *m = t->m;
    *out = (kvt_tier_pick){.tier = "none"};
    /* tier 1: RAM. The longest prefix on token ids (the index), or (when
     * the client resent our output as text) a longer one matched on the
     * bytes of a session's exact tokens. */
    for (size_t i = 0; i < t->n; i++)
        if (t->pool[i].tenant == tenant && !t->pool[i].loading) ix_refresh(t, &t->pool[i]);
    size_t best = SIZE_MAX;
    size_t reuse = ram_match(t, tenant, *toks, *n, &best);
    int32_t *best_alt = NULL;
    size_t best_alt_n = 0;
    for (size_t i = 0; p->len && i < t->n; i++) {
        if (t->pool[i].tenant != tenant || t->pool[i].loading) continue;
        kvt_session *s = t->pool[i].s;
        if (kvt_session_len(s) <= reuse) continue; /* cannot match more */
        size_t k = text_match(m, s, p->text, p->len);
        int32_t *alt = NULL;
        size_t na = 0;
        if (k > reuse && splice(m, s, k, p->text, p->len, &alt, &na) == KVT_OK) {
            reuse = k;
            best = i;
            free(best_alt);
            best_alt = alt;
            best_alt_n = na;
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
        t->pool[best].saved = false;
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
        t->pool[t->n++] = (kvt_pooled){.s = s, .last_used = ++t->clock, .tenant = tenant, .busy = true,
                                       .prompt_end = *n};
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
