/* The cache tiers without HTTP (src/serve/tiers.c): which session a prompt runs
 * on and how much of it is reused. A pool on the built-in ds4-tiny model
 * (byte tokenizer) is filled the way the server fills it, kvt_tiers_select
 * then kvt_session_sync, and each test checks the pick: extend in place,
 * fork a copy that leaves its source whole, a new session, the disk tier
 * when it covers more, the text splice, the eviction within a tenant's
 * share, and the server's deferred disk load and hand-off of evicted
 * sessions (`kvtier-tests tiers_pick` runs them). The prompts are seeded random bytes after BOS (fixed seeds: the
 * figures below are exact token counts, not statistics). */
#include "test.h"
#include "arch/model.h"
#include "serve/tiers.h"
#include "base/util.h"
#include "cache/cache.h"
#include "fam_state.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CTX 1024

/* What the hooks saw. */
typedef struct seen { int saved, save_errors, evicted[2], loaded; } seen;

static void saw_save(void *user, int tenant, double seconds, int rc, bool created)
{
    seen *w = user;
    w->saved++;
    if (rc) w->save_errors++;
}
static void saw_evict(void *user, int tenant) { ((seen *)user)->evicted[tenant]++; }
static void saw_load(void *user, int tenant, double seconds) { ((seen *)user)->loaded++; }

static kvt_tiers *tiers_open(kvt_model **m, size_t tenants, size_t ram_bytes, seen *w)
{
    *m = NULL;
    if (kvt_model_preset(m, "ds4-tiny", 7, NULL)) return NULL;
    kvt_tiers_opts o = {.ram_bytes = ram_bytes, .n_tenants = tenants, .n_ctx = CTX, .n_threads = 1,
                        .policy = KVT_SAVE_POLICY_DEFAULT, .hooks = {saw_save, saw_evict, saw_load, w}};
    kvt_tiers *t = NULL;
    if (kvt_tiers_new(&t, *m, &o)) { kvt_model_close(*m); *m = NULL; }
    return t;
}

static void tiers_close(kvt_tiers *t, kvt_model *m)
{
    kvt_tiers_free(t);
    kvt_model_close(m);
}

/* A prompt: the first `same` tokens of the seed-a sequence, then seed-b
 * bytes to n. */
static int32_t *prompt(size_t n, uint64_t a, size_t same, uint64_t b)
{
    int32_t *t = malloc(n * sizeof *t), *o = malloc(n * sizeof *o);
    if (!t || !o) { free(t); free(o); return NULL; }
    kvt_test_tokens(t, n, a);
    kvt_test_tokens(o, n, b);
    if (same < n) memcpy(t + same, o + same, (n - same) * sizeof *t);
    free(o);
    return t;
}

/* Select for tenant's prompt (no prompt text: the match is on token ids)
 * and sync the chosen session to it, as the server's worker does; the
 * session stays busy when `keep_busy` (a request still running on it),
 * else it is released. The prompt array stays the caller's. */
static int run_as(kvt_tiers *t, int tenant, kvt_store *st, const int32_t *toks, size_t n, kvt_tier_pick *pick,
                  bool keep_busy)
{
    int32_t *own = malloc(n * sizeof *own);
    if (!own) return KVT_ENOMEM;
    memcpy(own, toks, n * sizeof *own);
    kvt_tier_prompt p = {.text = "", .len = 0, .fork_at = SIZE_MAX};
    int rc = kvt_tiers_select(t, tenant, st, &p, &own, &n, pick);
    if (!rc) {
        rc = kvt_session_sync(pick->s, own, n, NULL);
        if (!keep_busy) kvt_tiers_release(t, pick->s);
    }
    free(own);
    return rc;
}

static int run(kvt_tiers *t, int tenant, kvt_store *st, const int32_t *toks, size_t n, kvt_tier_pick *pick)
{
    return run_as(t, tenant, st, toks, n, pick, false);
}

/* The pick is (tier, reused); prints what it is when not. */
static bool pick_is(const kvt_tier_pick *p, const char *tier, size_t reused)
{
    if (!strcmp(p->tier, tier) && p->reused == reused) return true;
    printf("    pick: %s, reused %zu; expected %s, reused %zu\n", p->tier, p->reused, tier, reused);
    return false;
}

static bool in_pool(const kvt_tiers *t, const kvt_session *s, int tenant)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->pool[i].s == s) return t->pool[i].tenant == tenant;
    return false;
}

/* The session holds exactly toks[0..n). */
static bool holds(const kvt_session *s, const int32_t *toks, size_t n)
{
    return kvt_session_len(s) == n && !memcmp(kvt_session_tokens(s), toks, n * sizeof *toks);
}

/* Tenant's pooled sessions that hold exactly toks[0..n): a dropped session
 * is told by its tokens, not its address (a new one may get it). */
static size_t holding(const kvt_tiers *t, const int32_t *toks, size_t n, int tenant)
{
    size_t k = 0;
    for (size_t i = 0; i < t->n; i++) k += t->pool[i].tenant == tenant && holds(t->pool[i].s, toks, n);
    return k;
}

TEST(tiers_pick_extend_in_place)
{
    seen w = {0};
    kvt_model *m;
    kvt_tiers *t = tiers_open(&m, 1, SIZE_MAX, &w);
    if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
    int32_t *a = prompt(350, 1, 350, 1);
    kvt_tier_pick p, q;
    CHECK_OK(run(t, 0, NULL, a, 300, &p));
    CHECK(pick_is(&p, "none", 0) && !p.extended && !p.forked && t->n == 1);
    /* the next turn continues the conversation: the same session, grown */
    CHECK_OK(run(t, 0, NULL, a, 350, &q));
    CHECK(pick_is(&q, "ram", 300) && q.extended && q.s == p.s && t->n == 1);
    CHECK(holds(q.s, a, 350));
    tiers_close(t, m);
    /* negative control: the same two turns on a new pool with the common
     * prefix one token short (KVT_TIERS_FAULT_PREFIX_SHORT): the second
     * reuses 299 tokens of a copy, and the check above must refuse it */
    t = tiers_open(&m, 1, SIZE_MAX, &w);
    CHECK(t);
    CHECK_OK(run(t, 0, NULL, a, 300, &p));
    kvt_tiers_fault = KVT_TIERS_FAULT_PREFIX_SHORT;
    int rc = run(t, 0, NULL, a, 350, &q);
    kvt_tiers_fault = KVT_TIERS_FAULT_NONE;
    CHECK_OK(rc);
    printf("    negative control, a common prefix one token short (must be refused):\n");
    CHECKF(!(pick_is(&q, "ram", 300) && q.extended && q.s == p.s), "control: a reuse one token short went unnoticed");
    free(a);
    tiers_close(t, m);
}

TEST(tiers_pick_fork_keeps_source)
{
    seen w = {0};
    kvt_model *m;
    kvt_tiers *t = tiers_open(&m, 1, SIZE_MAX, &w);
    if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
    int32_t *a = prompt(400, 2, 400, 2), *b = prompt(380, 2, 300, 3), *c = prompt(380, 2, 200, 4);
    kvt_tier_pick p, q, r;
    CHECK_OK(run(t, 0, NULL, a, 400, &p));
    /* another conversation on the first 300 tokens: a copy, reused exactly
     * up to where it leaves the session (not one token more) */
    CHECK(a[300] != b[300]);
    CHECK_OK(run(t, 0, NULL, b, 380, &q));
    CHECK(pick_is(&q, "ram", 300) && q.forked && !q.extended);
    CHECK(q.s != p.s && in_pool(t, p.s, 0) && in_pool(t, q.s, 0) && t->n == 2);
    CHECK(holds(p.s, a, 400));  /* the source stays whole */
    CHECK(holds(q.s, b, 380));
    /* a shared prefix under 256 tokens is not worth a copy: a new session */
    CHECK_OK(run(t, 0, NULL, c, 380, &r));
    CHECK(pick_is(&r, "none", 0) && !r.forked && !r.extended && t->n == 3);
    CHECK(holds(p.s, a, 400) && holds(q.s, b, 380));
    free(a);
    free(b);
    free(c);
    tiers_close(t, m);
}

TEST(tiers_pick_new_when_nothing_matches)
{
    seen w = {0};
    kvt_model *m;
    kvt_tiers *t = tiers_open(&m, 2, SIZE_MAX, &w);
    if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
    int32_t *a = prompt(300, 5, 300, 5), *b = prompt(300, 6, 300, 6);
    kvt_tier_pick p, q, r;
    CHECK_OK(run(t, 0, NULL, a, 300, &p));
    /* only BOS in common */
    CHECK_OK(run(t, 0, NULL, b, 300, &q));
    CHECK(pick_is(&q, "none", 0) && q.s != p.s && t->n == 2);
    /* the same prompt from another tenant never sees tenant 0's session */
    CHECK_OK(run(t, 1, NULL, a, 300, &r));
    CHECK(pick_is(&r, "none", 0) && r.s != p.s && in_pool(t, r.s, 1) && t->n == 3);
    CHECK(kvt_tiers_count(t, 0) == 2 && kvt_tiers_count(t, 1) == 1);
    CHECK(holds(p.s, a, 300) && holds(q.s, b, 300));
    /* over the context: refused, the pool as it was */
    int32_t *big = prompt(CTX + 1, 5, CTX + 1, 5);
    int32_t *own = malloc((CTX + 1) * sizeof *own);
    memcpy(own, big, (CTX + 1) * sizeof *own);
    size_t n = CTX + 1;
    kvt_tier_prompt tp = {.text = "", .fork_at = SIZE_MAX};
    kvt_tier_pick x;
    CHECK(kvt_tiers_select(t, 0, NULL, &tp, &own, &n, &x) == KVT_ECTX && t->n == 3 && n == CTX + 1);
    free(own);
    free(big);
    free(a);
    free(b);
    tiers_close(t, m);
}

static void tmpdir(char *out, size_t cap, const char *tag)
{
    snprintf(out, cap, "/tmp/kvtier-tiers-%s-%d", tag, (int)getpid());
    kvt_test_clear_dir(out);
}

static void rmdir_all(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) {}
}

TEST(tiers_pick_disk_when_it_covers_more)
{
    seen w = {0};
    kvt_model *m;
    kvt_tiers *t = tiers_open(&m, 1, SIZE_MAX, &w);
    if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
    char dir[256];
    tmpdir(dir, sizeof dir, "disk");
    kvt_store *st = NULL;
    CHECK_OK(kvt_store_open(&st, dir, 0));
    int32_t *a = prompt(700, 7, 700, 7);
    /* the store holds 600 tokens of the prompt (saved from a session outside
     * the pool), RAM 300 */
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, &(kvt_session_opts){.n_ctx = CTX, .n_threads = 1}));
    CHECK_OK(kvt_session_sync(s, a, 600, NULL));
    CHECK_OK(kvt_store_save(st, s, 600, "manual", NULL));
    kvt_session_free(s);
    kvt_tier_prompt np = {.text = "", .fork_at = SIZE_MAX};
    kvt_tier_pick p, q, r;
    CHECK_OK(run(t, 0, NULL, a, 300, &p)); /* no store given: RAM and nothing */
    CHECK(pick_is(&p, "none", 0));
    CHECK_OK(run(t, 0, st, a, 700, &q));
    CHECK(pick_is(&q, "disk", 600) && q.from_disk == 600 && w.loaded == 1);
    CHECK(q.s != p.s && !q.extended && !q.forked && t->n == 2);
    CHECK(holds(p.s, a, 300) && holds(q.s, a, 700));
    /* RAM now covers more (700) than the store: extend, no restore */
    int32_t *own = malloc(700 * sizeof *own);
    memcpy(own, a, 700 * sizeof *own);
    size_t n = 700;
    CHECK_OK(kvt_tiers_select(t, 0, st, &np, &own, &n, &r));
    CHECK(pick_is(&r, "ram", 700) && r.extended && r.s == q.s && w.loaded == 1);
    free(own);
    free(a);
    kvt_store_close(st);
    tiers_close(t, m);
    rmdir_all(dir);
}

/* A prompt whose text renders a pooled session's exact tokens runs on that
 * session even when its own tokenization differs: the tokens become the
 * session's, then the rest of the text. */
TEST(tiers_pick_text_splice)
{
    seen w = {0};
    kvt_model *m;
    kvt_tiers *t = tiers_open(&m, 1, SIZE_MAX, &w);
    if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
    int32_t *a = prompt(300, 8, 300, 8), *other = prompt(303, 8, 1, 9);
    kvt_tier_pick p, q;
    CHECK_OK(run(t, 0, NULL, a, 300, &p));
    kvt_wbuf text = {0};
    for (size_t i = 0; i < 300; i++) {
        const char *pc;
        size_t pl;
        CHECK_OK(kvt_token_piece(m, a[i], &pc, &pl));
        kvt_wbuf_put(&text, pc, pl);
    }
    kvt_wbuf_put(&text, "xyz", 3);
    CHECK(!text.oom);
    int32_t *own = malloc(303 * sizeof *own);
    memcpy(own, other, 303 * sizeof *own);
    size_t n = 303;
    kvt_tier_prompt tp = {.text = (const char *)text.p, .len = text.len, .fork_at = SIZE_MAX};
    CHECK_OK(kvt_tiers_select(t, 0, NULL, &tp, &own, &n, &q));
    CHECK(pick_is(&q, "ram", 300) && q.extended && q.s == p.s);
    CHECK(n == 303 && !memcmp(own, a, 300 * sizeof *own) && own[300] == 'x' && own[301] == 'y' && own[302] == 'z');
    /* negative control: without the text the same tokens share only BOS */
    kvt_tier_pick r;
    int32_t *own2 = malloc(303 * sizeof *own2);
    memcpy(own2, other, 303 * sizeof *own2);
    n = 303;
    kvt_tier_prompt none = {.text = "", .fork_at = SIZE_MAX};
    CHECK_OK(kvt_tiers_select(t, 0, NULL, &none, &own2, &n, &r));
    CHECK(pick_is(&r, "none", 0) && r.s != p.s);
    free(own2);
    free(own);
    kvt_wbuf_free(&text);
    free(a);
    free(other);
    tiers_close(t, m);
}

TEST(tiers_pick_evict_lru_within_share)
{
    seen w = {0};
    kvt_model *m;
    kvt_tiers *t = tiers_open(&m, 2, SIZE_MAX, &w);
    if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
    char dir[256];
    tmpdir(dir, sizeof dir, "evict");
    kvt_store *st = NULL;
    CHECK_OK(kvt_store_open(&st, dir, 0));
    t->o.policy.min_tokens = 1; /* every evicted session is saved */
    int32_t *d = prompt(300, 10, 300, 10), *a = prompt(300, 11, 300, 11), *b = prompt(300, 12, 300, 12),
            *c = prompt(300, 13, 300, 13), *e = prompt(300, 14, 300, 14);
    kvt_tier_pick pd, pa, pb, pc, pe;
    CHECK_OK(run(t, 1, NULL, d, 300, &pd)); /* tenant 1's, the oldest of all */
    CHECK_OK(run(t, 0, st, a, 300, &pa));
    CHECK_OK(run(t, 0, st, b, 300, &pb));
    CHECK_OK(run(t, 0, st, c, 300, &pc));
    CHECK(t->n == 4 && w.evicted[0] == 0 && w.evicted[1] == 0);
    /* tenant 0's share (ram_bytes / 2) holds b and c, not a as well: the
     * next new session makes room by dropping a, tenant 0's least recently
     * used, and leaves tenant 1's older d alone */
    size_t bc = 0;
    for (size_t i = 0; i < t->n; i++)
        if (t->pool[i].s == pb.s || t->pool[i].s == pc.s) bc += kvt_session_bytes(t->pool[i].s);
    CHECK(bc > 0);
    t->o.ram_bytes = 2 * bc;
    CHECK_OK(run(t, 0, st, e, 300, &pe));
    CHECK(pick_is(&pe, "none", 0));
    CHECKF(w.evicted[0] == 1 && w.evicted[1] == 0, "evicted %d + %d", w.evicted[0], w.evicted[1]);
    CHECK(w.saved == 1 && w.save_errors == 0); /* saved before it was dropped */
    CHECK(t->n == 4 && holding(t, a, 300, 0) == 0);
    CHECK(holding(t, b, 300, 0) == 1 && holding(t, c, 300, 0) == 1 && holding(t, e, 300, 0) == 1);
    CHECK(holding(t, d, 300, 1) == 1);
    /* what was evicted comes back from disk */
    kvt_tier_pick again;
    t->o.ram_bytes = SIZE_MAX;
    CHECK_OK(run(t, 0, st, a, 300, &again));
    CHECK(pick_is(&again, "disk", 300));
    free(a);
    free(b);
    free(c);
    free(d);
    free(e);
    kvt_store_close(st);
    tiers_close(t, m);
    rmdir_all(dir);
}

/* Bytes a tenant holds outside the pool (a reply's draft session,
 * kvt_tiers_reserve) count against its share: a select makes room for
 * them as for sessions, and a reservation given back frees the room.
 * The pool alone keeps within what the share leaves: the select after a
 * reservation of two sessions' bytes drops the two least recently used.
 * Negative control: KVT_TIERS_FAULT_UNRESERVED (the reservation left out
 * of the budget) drops none, and the same bound fails. */
static bool reserve_bound(bool fault, size_t *dropped, size_t *over)
{
    seen w = {0};
    kvt_model *m;
    kvt_tiers *t = tiers_open(&m, 1, SIZE_MAX, &w);
    if (!t) return false;
    int32_t *p[5];
    kvt_tier_pick pk;
    bool ok = true;
    for (size_t i = 0; i < 5; i++) ok = (p[i] = prompt(300, 60 + i, 300, 60 + i)) && ok;
    for (size_t i = 0; ok && i < 4; i++) ok = run(t, 0, NULL, p[i], 300, &pk) == KVT_OK;
    size_t one = ok ? kvt_session_bytes(pk.s) : 0;
    /* a share that holds the four sessions, a reservation of two */
    t->o.ram_bytes = kvt_tiers_bytes(t, 0) + one / 2;
    kvt_tiers_reserve(t, 0, 2 * one);
    kvt_tiers_fault = fault ? KVT_TIERS_FAULT_UNRESERVED : KVT_TIERS_FAULT_NONE;
    /* the fifth prompt's session is new (empty at select) */
    int32_t *own = ok ? malloc(300 * sizeof *own) : NULL;
    size_t n = 300;
    if (own) memcpy(own, p[4], 300 * sizeof *own);
    kvt_tier_prompt tp = {.text = "", .len = 0, .fork_at = SIZE_MAX};
    ok = ok && own && kvt_tiers_select(t, 0, NULL, &tp, &own, &n, &pk) == KVT_OK;
    kvt_tiers_fault = KVT_TIERS_FAULT_NONE;
    size_t held = kvt_tiers_bytes(t, 0) + kvt_tiers_reserved(t, 0);
    *dropped = (size_t)w.evicted[0];
    *over = held > t->o.ram_bytes ? held - t->o.ram_bytes : 0;
    printf("    %s: a session %zu bytes, share %zu; after the select the pool %zu + reserved %zu, %zu sessions "
           "dropped\n", fault ? "control (reservation uncounted)" : "counted", one, t->o.ram_bytes,
           kvt_tiers_bytes(t, 0), kvt_tiers_reserved(t, 0), *dropped);
    if (ok) kvt_tiers_release(t, pk.s);
    /* given back: the reservation is gone, the room stays */
    kvt_tiers_unreserve(t, 0, 2 * one);
    ok = ok && kvt_tiers_reserved(t, 0) == 0 && kvt_tiers_reserved(t, -1) == 0;
    free(own);
    for (size_t i = 0; i < 5; i++) free(p[i]);
    tiers_close(t, m);
    return ok;
}

TEST(tiers_reserve_counts_in_share)
{
    size_t dropped = 0, over = 0, c_dropped = 0, c_over = 0;
    CHECKF(reserve_bound(false, &dropped, &over), "ds4-tiny's pool: %s", kvt_errmsg());
    CHECKF(over == 0 && dropped == 2, "the pool and the reservation exceed the share by %zu bytes (%zu dropped)",
           over, dropped);
    CHECK(reserve_bound(true, &c_dropped, &c_over));
    CHECKF(c_over > 0 && c_dropped == 0, "the control: the reservation uncounted went unseen");
}

TEST(tiers_pick_evict_spares_fork_source)
{
    seen w = {0};
    kvt_model *m;
    kvt_tiers *t = tiers_open(&m, 2, SIZE_MAX, &w);
    if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
    int32_t *src = prompt(400, 15, 400, 15), *x = prompt(300, 16, 300, 16), *y = prompt(300, 17, 300, 17),
            *f = prompt(360, 15, 320, 18);
    kvt_tier_pick ps, px, py, pf;
    CHECK_OK(run(t, 0, NULL, src, 400, &ps));
    CHECK_OK(run(t, 0, NULL, x, 300, &px));
    CHECK_OK(run(t, 1, NULL, y, 300, &py));
    /* no room at all: tenant 0 keeps only the fork's source (the least
     * recently used before the fork) and the copy; tenant 1 keeps its own */
    t->o.ram_bytes = 2;
    CHECK_OK(run(t, 0, NULL, f, 360, &pf));
    CHECK(pick_is(&pf, "ram", 320) && pf.forked);
    CHECKF(w.evicted[0] == 1 && w.evicted[1] == 0, "evicted %d + %d", w.evicted[0], w.evicted[1]);
    CHECK(t->n == 3 && holding(t, x, 300, 0) == 0);
    CHECK(in_pool(t, ps.s, 0) && holds(ps.s, src, 400) && holding(t, y, 300, 1) == 1);
    CHECK(pf.s != ps.s && in_pool(t, pf.s, 0));
    free(src);
    free(x);
    free(y);
    free(f);
    tiers_close(t, m);
}

/* A fork uses its source: the next eviction takes a session left alone
 * longer, not the source the fork just read. */
TEST(tiers_pick_fork_counts_as_use)
{
    seen w = {0};
    kvt_model *m;
    kvt_tiers *t = tiers_open(&m, 1, SIZE_MAX, &w);
    if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
    int32_t *src = prompt(400, 19, 400, 19), *x = prompt(300, 20, 300, 20), *f = prompt(360, 19, 300, 21),
            *g = prompt(300, 22, 300, 22);
    kvt_tier_pick ps, px, pf, pg;
    CHECK_OK(run(t, 0, NULL, src, 400, &ps));
    CHECK_OK(run(t, 0, NULL, x, 300, &px));
    CHECK_OK(run(t, 0, NULL, f, 360, &pf));
    CHECK(pick_is(&pf, "ram", 300) && pf.forked && t->n == 3 && w.evicted[0] == 0);
    /* room for the source and the fork: one of the three goes */
    t->o.ram_bytes = kvt_session_bytes(ps.s) + kvt_session_bytes(pf.s);
    CHECK_OK(run(t, 0, NULL, g, 300, &pg));
    CHECKF(w.evicted[0] == 1, "evicted %d", w.evicted[0]);
    CHECK(holding(t, x, 300, 0) == 0 && holding(t, src, 400, 0) == 1 && holding(t, f, 360, 0) == 1);
    free(src);
    free(x);
    free(f);
    free(g);
    tiers_close(t, m);
}

/* Requests at once (the server's scheduler): a session a request still runs
 * on is never extended in place by another request, nor evicted; the
 * second request on the same conversation gets an exact copy of it, and
 * once the first is released the conversation extends in place again. */
TEST(tiers_pick_busy_session)
{
    seen w = {0};
    kvt_model *m;
    kvt_tiers *t = tiers_open(&m, 1, SIZE_MAX, &w);
    if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
    int32_t *a = prompt(400, 23, 400, 23), *x = prompt(300, 24, 300, 24);
    kvt_tier_pick p, q, r, e;
    CHECK_OK(run_as(t, 0, NULL, a, 300, &p, true));
    CHECK(kvt_tiers_busy(t) == 1);
    /* the same conversation, one turn on, while the first still runs */
    CHECK_OK(run_as(t, 0, NULL, a, 350, &q, true));
    CHECK(pick_is(&q, "ram", 300) && q.forked && !q.extended && q.s != p.s);
    CHECK(holds(p.s, a, 300) && holds(q.s, a, 350) && kvt_tiers_busy(t) == 2);
    /* no room at all: neither busy session goes, only the idle one */
    CHECK_OK(run(t, 0, NULL, x, 300, &e));
    t->o.ram_bytes = 1;
    kvt_tier_pick y;
    CHECK_OK(run_as(t, 0, NULL, x, 300, &y, true)); /* x's own session extends: idle, reused whole */
    CHECK(pick_is(&y, "ram", 300) && y.extended);
    int32_t *z = prompt(300, 25, 300, 25);
    kvt_tier_pick pz;
    CHECK_OK(run(t, 0, NULL, z, 300, &pz));
    CHECKF(w.evicted[0] == 0, "evicted %d (every other session is busy)", w.evicted[0]);
    CHECK(in_pool(t, p.s, 0) && in_pool(t, q.s, 0) && in_pool(t, y.s, 0));
    /* released: the next turn extends the session in place */
    t->o.ram_bytes = SIZE_MAX;
    kvt_tiers_release(t, p.s);
    kvt_tiers_release(t, q.s);
    kvt_tiers_release(t, y.s);
    CHECK(kvt_tiers_busy(t) == 0);
    CHECK_OK(run(t, 0, NULL, a, 400, &r));
    CHECK(pick_is(&r, "ram", 350) && r.extended && r.s == q.s);
    free(a);
    free(x);
    free(z);
    tiers_close(t, m);
}

/* The next turn of a conversation whose client resent the reply otherwise
 * than it was sampled (or a regeneration): the prompt leaves the session
 * inside its last reply, so the session is extended in place (its reply's
 * tail dropped), not copied whole: a copy of a long session is hundreds of
 * MB of rows and checkpoints. A prompt that leaves it before its last
 * prompt's end (another conversation) still gets a copy. */
TEST(tiers_pick_next_turn_in_place)
{
    seen w = {0};
    kvt_model *m;
    kvt_tiers *t = tiers_open(&m, 1, SIZE_MAX, &w);
    if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
    int32_t *a = prompt(420, 26, 420, 26), *reply = prompt(20, 27, 20, 27), *b = prompt(420, 26, 300, 28);
    kvt_tier_pick p, q, r;
    CHECK_OK(run(t, 0, NULL, a, 300, &p));
    for (size_t i = 0; i < 20; i++) CHECK_OK(kvt_session_decode(p.s, reply[i])); /* the sampled reply */
    CHECK(a[300] != reply[0]);
    /* the next turn: the prompt, the reply as the client renders it (here
     * other tokens), a new question */
    CHECK_OK(run(t, 0, NULL, a, 420, &q));
    CHECK(pick_is(&q, "ram", 300) && q.extended && !q.forked && q.s == p.s && t->n == 1);
    CHECK(holds(q.s, a, 420));
    /* another conversation on the first 300 tokens leaves it before the
     * end of its last prompt (420): a copy */
    CHECK(b[300] != a[300]);
    CHECK_OK(run(t, 0, NULL, b, 420, &r));
    CHECK(pick_is(&r, "ram", 300) && r.forked && r.s != q.s && t->n == 2 && holds(q.s, a, 420));
    free(a);
    free(reply);
    free(b);
    tiers_close(t, m);
}

/* Parked sessions hold no scratch and no threads of their own (issue 36):
 * every pooled session runs on the tiers' one worker pool; a released
 * session's scratch goes to the spares and the next picked session takes
 * it, so there are never more scratch sets than sessions busy at once; a
 * busy session's bytes count its scratch. false (and why) when not. */
static bool parked_clean(const kvt_tiers *t, size_t spares)
{
    for (size_t i = 0; i < t->n; i++) {
        const kvt_session *s = t->pool[i].s;
        if (s->pool != t->threads || s->own_pool) {
            printf("    pooled session %zu runs on threads of its own\n", i);
            return false;
        }
        if (!t->pool[i].busy && s->work) {
            printf("    parked session %zu holds %zu bytes of scratch\n", i, kvt_session_scratch_bytes(t->m, s->work));
            return false;
        }
    }
    if (t->n_spare != spares) {
        printf("    %zu spare scratch sets, expected %zu\n", t->n_spare, spares);
        return false;
    }
    return true;
}

/* Two requests at once on a, b (kept busy), then released: a's scratch
 * was another session's before (stale bytes of another prompt), so its
 * logits and cache must still be those of a fresh session's run. */
static bool two_at_once(kvt_tiers *t, const int32_t *a, const int32_t *b, size_t n)
{
    kvt_tier_pick pa, pb;
    if (run_as(t, 0, NULL, a, n, &pa, true) || run_as(t, 0, NULL, b, n, &pb, true)) return false;
    bool ok = pa.s->work && pb.s->work && pa.s->work != pb.s->work;
    if (!ok) printf("    busy sessions without scratch of their own\n");
    size_t with = kvt_session_bytes(pa.s), scratch = kvt_session_scratch_bytes(t->m, pa.s->work);
    kvt_tiers_release(t, pa.s);
    kvt_tiers_release(t, pb.s);
    if (ok && (!scratch || with != kvt_session_bytes(pa.s) + scratch)) {
        printf("    a busy session's %zu bytes are not its parked %zu plus its scratch's %zu\n", with,
               kvt_session_bytes(pa.s), scratch);
        ok = false;
    }
    if (kvt_test_digest(pa.s, t->m) != kvt_test_twin(t->m, a, n)) {
        printf("    a session run on handed-on scratch differs from a fresh one\n");
        ok = false;
    }
    return ok;
}

TEST(tiers_pool_shared_scratch)
{
    seen w = {0};
    kvt_model *m;
    kvt_tiers *t = tiers_open(&m, 1, SIZE_MAX, &w);
    if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
    int32_t *a = prompt(400, 30, 400, 30), *b = prompt(400, 31, 400, 31), *c = prompt(300, 32, 300, 32),
            *e = prompt(300, 33, 300, 33);
    kvt_tier_pick p;
    /* negative control: sessions that keep their scratch when released */
    kvt_tiers_fault_keep_scratch = true;
    CHECK_OK(run(t, 0, NULL, c, 300, &p));
    printf("    negative control, scratch kept when released (must be refused):\n");
    bool caught = !parked_clean(t, 1);
    kvt_tiers_fault_keep_scratch = false;
    CHECK(caught);
    tiers_close(t, m);
    t = tiers_open(&m, 1, SIZE_MAX, &w);
    CHECK(t);
    /* one at a time: one scratch set, handed from session to session */
    CHECK_OK(run(t, 0, NULL, c, 300, &p));
    CHECK_OK(run(t, 0, NULL, a, 300, &p));
    CHECK(t->n == 2 && parked_clean(t, 1));
    /* two at once: a second set, kept as a spare after */
    CHECK(two_at_once(t, a, b, 400));
    CHECK(t->n == 3 && parked_clean(t, 2));
    /* the spares count against the budget, before any session: a budget
     * the sessions fill frees both and evicts nothing; e makes its own */
    t->o.ram_bytes = kvt_tiers_bytes(t, -1) + 1;
    CHECK_OK(run_as(t, 0, NULL, e, 300, &p, true));
    CHECKF(w.evicted[0] == 0 && t->n == 4 && t->n_spare == 0 && p.s->work, "evicted %d, %zu sessions, %zu spares",
           w.evicted[0], t->n, t->n_spare);
    kvt_tiers_release(t, p.s);
    CHECK(parked_clean(t, 1));
    free(a);
    free(b);
    free(c);
    free(e);
    tiers_close(t, m);
}

/* The server's way (defer_loads, hooks.hand_off): the restore is left to
 * the caller, the session it restores into is neither a candidate nor
 * counted while it loads, and an evicted session is handed off whole, its
 * bytes counted against the share through hooks.held until it is saved. */
typedef struct handed { kvt_session *s[4]; size_t n, held; } handed;

static bool take(void *user, int tenant, kvt_store *store, kvt_session *s, const char *reason)
{
    handed *h = user;
    if (h->n == 4) return false;
    h->s[h->n++] = s;
    h->held += kvt_session_bytes(s);
    return true;
}
static size_t held_bytes(void *user, int tenant) { return ((handed *)user)->held; }

TEST(tiers_pick_deferred_load_and_hand_off)
{
    kvt_model *m = NULL;
    if (kvt_model_preset(&m, "ds4-tiny", 7, NULL)) SKIP("ds4-tiny: %s", kvt_errmsg());
    handed h = {0};
    kvt_tiers_opts o = {.ram_bytes = SIZE_MAX, .n_tenants = 1, .n_ctx = CTX, .n_threads = 1,
                        .policy = KVT_SAVE_POLICY_DEFAULT, .defer_loads = true,
                        .hooks = {.hand_off = take, .held = held_bytes, .user = &h}};
    kvt_tiers *t = NULL;
    CHECK_OK(kvt_tiers_new(&t, m, &o));
    char dir[256];
    tmpdir(dir, sizeof dir, "defer");
    kvt_store *st = NULL;
    CHECK_OK(kvt_store_open(&st, dir, 0));
    int32_t *a = prompt(700, 7, 700, 7);
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, &(kvt_session_opts){.n_ctx = CTX, .n_threads = 1}));
    CHECK_OK(kvt_session_sync(s, a, 600, NULL));
    CHECK_OK(kvt_store_save(st, s, 600, "manual", NULL));
    kvt_session_free(s);
    /* the pick says what the store holds; nothing is restored yet */
    int32_t *own = malloc(700 * sizeof *own);
    memcpy(own, a, 700 * sizeof *own);
    size_t n = 700;
    kvt_tier_prompt np = {.text = "", .fork_at = SIZE_MAX};
    kvt_tier_pick q;
    CHECK_OK(kvt_tiers_select(t, 0, st, &np, &own, &n, &q));
    CHECK(q.load == 600 && pick_is(&q, "none", 0) && kvt_session_len(q.s) == 0);
    CHECK(t->n == 1 && t->pool[0].loading && kvt_tiers_bytes(t, 0) == 0);
    /* the caller restores (the server: on its store thread), then reports */
    size_t got = 0;
    CHECK_OK(kvt_store_restore_prefix(st, q.s, own, n, &got));
    kvt_tiers_loaded(t, &q, got);
    CHECK(got == 600 && pick_is(&q, "disk", 600) && q.from_disk == 600 && q.load == 0);
    CHECK(!t->pool[0].loading && kvt_tiers_bytes(t, 0) == kvt_session_bytes(q.s));
    CHECK_OK(kvt_session_sync(q.s, own, n, NULL));
    kvt_tiers_release(t, q.s);
    /* a share it already fills: the next new session takes its last blocks
     * (back to the checkpoint the load left at 600), a copy of the whole
     * of it handed off to be saved first; it stays, holding the prefix */
    t->o.ram_bytes = kvt_session_bytes(q.s) - 1;
    kvt_session *first = q.s;
    int32_t *b = prompt(100, 9, 100, 9);
    kvt_tier_pick r;
    CHECK_OK(run(t, 0, st, b, 100, &r));
    CHECKF(h.n == 1 && holds(h.s[0], a, 700) && h.s[0] != first, "%zu handed off", h.n);
    CHECKF(in_pool(t, first, 0) && holds(first, a, 600) && t->n == 2 && r.s != first, "first holds %zu, in pool %d, pool %zu",
           kvt_session_len(first), in_pool(t, first, 0), t->n);
    /* bytes waiting to be saved count against the share: with as many as
     * the share, both pooled sessions go (the first not saved again, the
     * other below the policy's 512 tokens) */
    t->o.ram_bytes = h.held = kvt_tiers_bytes(t, 0) + 1;
    int32_t *c = prompt(100, 10, 100, 10);
    kvt_tier_pick u;
    CHECK_OK(run(t, 0, st, c, 100, &u));
    CHECK(h.n == 1 && t->n == 1 && t->pool[0].s == u.s);
    free(c);
    for (size_t i = 0; i < h.n; i++) kvt_session_free(h.s[i]);
    free(own);
    free(a);
    free(b);
    kvt_store_close(st);
    tiers_close(t, m);
    rmdir_all(dir);
}

/* The RAM budget holds with saves queued: sessions parked with two spare
 * scratch sets, bytes handed off and not yet saved (hooks.held, the
 * server's kvt_storeq_held) as many as the spares', and a budget the
 * sessions and the queued saves fill. A new prompt's make_room must bring
 * sessions + queued saves + spare scratch (a spare the new session takes
 * counted among them) within the budget: it frees both spares, evicting
 * nothing (the new session makes its own scratch when it runs, as
 * tiers_pool_shared_scratch has it). The negative control
 * (KVT_TIERS_FAULT_SPARES_UNHELD: the spares freed while sessions,
 * reservations and spares alone exceed the budget, as before) keeps both
 * spares: the budget exceeded by both. Returns the bytes over the budget
 * (0 within), and the sessions handed off in *evicted. */
static size_t queued_spares_over(bool fault, size_t *evicted, size_t *scratch)
{
    kvt_model *m = NULL;
    if (kvt_model_preset(&m, "ds4-tiny", 7, NULL)) return SIZE_MAX;
    handed h = {0};
    kvt_tiers_opts o = {.ram_bytes = SIZE_MAX, .n_tenants = 1, .n_ctx = CTX, .n_threads = 1,
                        .policy = KVT_SAVE_POLICY_DEFAULT,
                        .hooks = {.hand_off = take, .held = held_bytes, .user = &h}};
    kvt_tiers *t = NULL;
    size_t over = SIZE_MAX;
    int32_t *a = prompt(400, 40, 400, 40), *b = prompt(400, 41, 400, 41), *c = prompt(300, 42, 300, 42);
    if (kvt_tiers_new(&t, m, &o) || !a || !b || !c || !two_at_once(t, a, b, 400) || !parked_clean(t, 2)) goto out;
    size_t sess = kvt_tiers_bytes(t, -1), spares = kvt_tiers_spare_bytes(t);
    *scratch = spares / 2;
    h.held = spares; /* saves queued: sessions evicted before, not yet written */
    t->o.ram_bytes = sess + h.held;
    void *spare[2] = {t->spare[0], t->spare[1]};
    kvt_tiers_fault = fault ? KVT_TIERS_FAULT_SPARES_UNHELD : KVT_TIERS_FAULT_NONE;
    kvt_tier_pick p;
    int32_t *own = malloc(300 * sizeof *own);
    size_t n = 300;
    int rc = own ? KVT_OK : KVT_ENOMEM;
    if (!rc) memcpy(own, c, 300 * sizeof *own);
    if (!rc) rc = kvt_tiers_select(t, 0, NULL, &(kvt_tier_prompt){.text = "", .fork_at = SIZE_MAX}, &own, &n, &p);
    kvt_tiers_fault = KVT_TIERS_FAULT_NONE;
    /* a new session has no scratch until it runs: any it holds now is a
     * spare lent to it (asked before it runs: the scratch it makes then may
     * come at a freed spare's address) */
    bool lent = !rc && p.s->work && (p.s->work == spare[0] || p.s->work == spare[1]);
    size_t took = lent ? kvt_session_scratch_bytes(m, p.s->work) : 0;
    if (!rc) rc = kvt_session_sync(p.s, own, n, NULL);
    free(own);
    if (rc) goto out;
    /* what make_room left: the other sessions, the spares (the one the new
     * session took among them), the saves queued */
    size_t others = kvt_tiers_bytes(t, -1) - kvt_session_bytes(p.s);
    size_t total = others + kvt_tiers_spare_bytes(t) + took + h.held;
    printf("    %s: budget %zu; sessions %zu + saves queued %zu + spares %zu (%zu left, %d taken) = %zu\n",
           fault ? "the control, spares checked without the queued saves" : "spares checked with the queued saves",
           t->o.ram_bytes, others, h.held, kvt_tiers_spare_bytes(t) + took, t->n_spare, lent, total);
    over = total > t->o.ram_bytes ? total - t->o.ram_bytes : 0;
    *evicted = h.n;
    kvt_tiers_release(t, p.s);
out:
    for (size_t i = 0; i < h.n; i++) kvt_session_free(h.s[i]);
    free(a);
    free(b);
    free(c);
    tiers_close(t, m);
    return over;
}

TEST(tiers_budget_holds_with_saves_queued)
{
    size_t evicted = 0, scratch = 0, over = queued_spares_over(false, &evicted, &scratch);
    if (over == SIZE_MAX && kvt_test_failed()) return;
    CHECKF(over == 0 && evicted == 0, "%zu bytes over the budget, %zu sessions evicted", over, evicted);
    size_t c_evicted = 0, c_over = queued_spares_over(true, &c_evicted, &scratch);
    printf("    a spare scratch set: %zu bytes; the control %zu bytes over\n", scratch, c_over);
    CHECKF(c_over != SIZE_MAX && c_over > 0 && c_evicted == 0, "the control: %zu bytes over the budget", c_over);
}

/* ---- eviction at block granularity, and the index over the blocks ----
 *
 * On the llama family's synthetic model (rows per token: any point of the
 * 128-token grid is a cut) and, for the architectures with per-position
 * state, on the grid's checkpoints. Prompts: A of 684 tokens (5 full
 * blocks and a partial one); B shares A's first 384 tokens (3 blocks), so
 * that a copy of A made for B (a fork) shares those blocks with A by
 * reference and holds 2 blocks of its own. */

enum { NA = 684, NSH = 384, NB = 634 };

/* A pool of one or two tenants on model m (the caller's), its checkpoint
 * grid `grid` tokens. */
static kvt_tiers *tiers_on(kvt_model *m, size_t tenants, uint32_t grid, seen *w)
{
    kvt_tiers_opts o = {.ram_bytes = SIZE_MAX, .n_tenants = tenants, .n_ctx = CTX, .n_threads = 1,
                        .policy = KVT_SAVE_POLICY_DEFAULT, .hooks = {saw_save, saw_evict, saw_load, w}};
    o.policy.continued_interval = grid; /* the grid is gcd(2048, it) */
    kvt_tiers *t = NULL;
    return kvt_tiers_new(&t, m, &o) ? NULL : t;
}

/* Bytes of one block of s's cache (every stream's rows, and each one's
 * header). */
static size_t blk_bytes(const kvt_session *s)
{
    size_t b = 0;
    for (size_t i = 0; i < s->cache->n_streams; i++)
        b += KVT_BLOCK_ROWS_AT + (size_t)s->cache->streams[i].rows_per_block * s->cache->streams[i].row_bytes;
    return b;
}

/* Bytes of s's last block (every stream's own rows, and each one's
 * header): the pages its tokens reach. */
static size_t tail_bytes(const kvt_session *s)
{
    size_t b = 0, last = (kvt_session_len(s) - 1) / KVT_BLOCK;
    for (size_t i = 0; i < s->cache->n_streams; i++) {
        const kvt_block *h = s->cache->streams[i].held[last];
        if (h) b += KVT_BLOCK_ROWS_AT + h->bytes;
    }
    return b;
}

/* Bytes of s's checkpoints past pos. */
static size_t ckpt_past(const kvt_session *s, size_t pos)
{
    size_t b = 0;
    for (size_t i = 0; i < s->n_ckpt; i++)
        if (s->ckpt[i].pos > pos) b += s->ckpt[i].state.cap + (size_t)s->m->info.n_vocab * sizeof(float);
    return b;
}

/* A new session for a short prompt of its own (seed), which makes room
 * first. */
static int trigger(kvt_tiers *t, int tenant, uint64_t seed)
{
    int32_t x[40];
    fam_prompt(x, 40, seed);
    if (t->m->info.tokenizer && !strcmp(t->m->info.tokenizer, "bytes")) kvt_test_tokens(x, 40, seed);
    kvt_tier_pick p;
    return run(t, tenant, NULL, x, 40, &p);
}

static const fam_spec llama_fam = {"llama", false, false, FAM_HEAD_DIM, false, false, false};

/* Over its share, the tenant's least recently used session gives back its
 * own tail blocks one at a time (the bytes held drop by exactly those
 * blocks and the checkpoints past the cut) down to the prefix it shares
 * with another session, which it keeps and which is found; then, as the
 * LRU with every block shared, it goes whole, its blocks counting in the
 * other holder from then on (whose bits never moved); a prompt on the kept
 * prefix is a RAM hit with the bits of a cold run. */
TEST(tiers_evict_blocks_lru_tail)
{
    char dir[] = "/tmp/kvt-tiers-XXXXXX", path[256];
    kvt_model *m = fam_open(&llama_fam, dir, path, sizeof path);
    if (!m) return;
    seen w = {0};
    kvt_tiers *t = tiers_on(m, 1, 2048, &w);
    CHECK(t);
    int32_t pa[NA], pb[NB], ph[NSH + 150];
    fam_prompt(pa, NA, 31);
    fam_prompt(pb, NB, 32);
    memcpy(pb, pa, NSH * sizeof *pb);
    fam_prompt(ph, NSH + 150, 33);
    memcpy(ph, pa, NSH * sizeof *ph);
    kvt_tier_pick a, b;
    CHECK_OK(run(t, 0, NULL, pa, NA, &a));
    CHECK_OK(run(t, 0, NULL, pb, NB, &b));
    CHECK(pick_is(&b, "ram", NSH) && b.forked);
    CHECK(kvt_tiers_index_entries(t, 0) == NA / KVT_BLOCK + NB / KVT_BLOCK);
    size_t blk = blk_bytes(a.s), a0 = kvt_session_bytes(a.s), b0 = kvt_session_bytes(b.s);
    uint64_t db = kvt_test_digest(b.s, m);
    /* one byte over: A's partial block goes, nothing else (its 44 tokens'
     * 3 pages of 16, not a block of 128) */
    size_t tail = tail_bytes(a.s), want = tail + ckpt_past(a.s, 640);
    CHECKF(tail == blk - 5 * (blk - KVT_BLOCK_ROWS_AT * a.s->cache->n_streams) / 8, "A's partial block: %zu bytes, a block %zu",
           tail, blk);
    t->o.ram_bytes = kvt_tiers_bytes(t, 0) - 1;
    CHECK_OK(trigger(t, 0, 40));
    CHECKF(in_pool(t, a.s, 0) && kvt_session_len(a.s) == 640, "A holds %zu", kvt_session_len(a.s));
    CHECKF(a0 - kvt_session_bytes(a.s) == want, "A gave back %zu bytes, its block and checkpoints %zu",
           a0 - kvt_session_bytes(a.s), want);
    CHECK(kvt_session_bytes(b.s) == b0 && w.evicted[0] == 0);
    CHECK(kvt_tiers_index_entries(t, 0) == 640 / KVT_BLOCK + NB / KVT_BLOCK);
    /* a block and a byte over: two more of A's own blocks go, down to the
     * prefix it shares with B */
    size_t a1 = kvt_session_bytes(a.s);
    want = 2 * blk + ckpt_past(a.s, NSH);
    t->o.ram_bytes = kvt_tiers_bytes(t, 0) - blk - 1;
    CHECK_OK(trigger(t, 0, 41));
    CHECKF(in_pool(t, a.s, 0) && holds(a.s, pa, NSH), "A holds %zu", kvt_session_len(a.s));
    CHECKF(a1 - kvt_session_bytes(a.s) == want, "A gave back %zu bytes, its blocks and checkpoints %zu",
           a1 - kvt_session_bytes(a.s), want);
    CHECK(kvt_session_bytes(b.s) == b0 && w.evicted[0] == 0);
    /* over again: A's last block is B's too, so A goes whole (and B
     * counts the 3 blocks they shared) */
    t->o.ram_bytes = kvt_tiers_bytes(t, 0) - 1;
    CHECK_OK(trigger(t, 0, 42));
    CHECK(holding(t, pa, NSH, 0) == 0 && w.evicted[0] == 1 && in_pool(t, b.s, 0) && holds(b.s, pb, NB));
    CHECKF(kvt_session_bytes(b.s) == b0 + 3 * blk, "B counts %zu bytes, %zu before", kvt_session_bytes(b.s), b0);
    CHECK(kvt_test_digest(b.s, m) == db);
    printf("    a block %zu bytes; A gave back 1 block, then 2, then went whole: B counts %zu bytes more\n", blk,
           kvt_session_bytes(b.s) - b0);
    /* the prefix kept is found in RAM: a copy of B, exact */
    t->o.ram_bytes = SIZE_MAX;
    kvt_tier_pick h;
    CHECK_OK(run(t, 0, NULL, ph, NSH + 150, &h));
    CHECK(pick_is(&h, "ram", NSH) && h.forked);
    CHECK(kvt_test_digest(h.s, m) == kvt_test_twin(m, ph, NSH + 150));
    kvt_tiers_free(t);
    fam_close(m, dir, path);
}

/* A session cut at a block's start without a checkpoint there has no
 * logits for its last token: it says so, and the prompt that ends there,
 * a RAM hit, computes that token again: the bits of an uninterrupted run.
 * Negative control: with KVT_SESSION_FAULT_STALE_LOGITS the stale logits
 * are served, and the same check must refuse them. */
TEST(tiers_evict_blocks_stale_logits)
{
    char dir[] = "/tmp/kvt-tiers-XXXXXX", path[256];
    kvt_model *m = fam_open(&llama_fam, dir, path, sizeof path);
    if (!m) return;
    int32_t pa[NA + 20];
    fam_prompt(pa, NA + 20, 34);
    uint64_t want = kvt_test_twin(m, pa, 640), want_more = kvt_test_twin(m, pa, NA + 20);
    for (int fault = 0; fault < 2; fault++) {
        seen w = {0};
        kvt_tiers *t = tiers_on(m, 1, 2048, &w);
        CHECK(t);
        kvt_tier_pick a, q;
        CHECK_OK(run(t, 0, NULL, pa, NA, &a));
        t->o.ram_bytes = kvt_tiers_bytes(t, 0) - 1;
        CHECK_OK(trigger(t, 0, 43));
        CHECK(kvt_session_len(a.s) == 640 && !kvt_session_logits(a.s));
        t->o.ram_bytes = SIZE_MAX;
        if (fault) kvt_session_fault = KVT_SESSION_FAULT_STALE_LOGITS;
        int rc = run(t, 0, NULL, pa, 640, &q);
        uint64_t got = rc ? 0 : kvt_test_digest(q.s, m); /* with the fault on: it serves the stale logits */
        kvt_session_fault = KVT_SESSION_FAULT_NONE;
        CHECK_OK(rc);
        CHECK(pick_is(&q, "ram", 640) && q.extended && q.s == a.s);
        if (!fault) {
            CHECK(got == want);
            /* and a prompt that goes on from there too */
            CHECK_OK(run(t, 0, NULL, pa, NA + 20, &q));
            CHECK(q.s == a.s && kvt_test_digest(q.s, m) == want_more);
        } else {
            printf("    negative control, stale logits served after a trim (must be refused):\n");
            CHECKF(got != want, "control: stale logits went unnoticed");
        }
        kvt_tiers_free(t);
    }
    fam_close(m, dir, path);
}

/* A block a busy session (a request running on it) holds is never freed,
 * nor is the busy session trimmed: the idle LRU session that shares a
 * prefix with it gives back its own blocks, then goes whole; the busy
 * session's bits do not move and it runs on exactly. Negative control:
 * KVT_TIERS_FAULT_TRIM_SHARED (blocks taken as if nobody else held them,
 * busy sessions' too) must be refused. With KVT_TIERS_TEST_FREE_SHARED=1
 * in the environment the eviction also frees blocks other caches hold
 * (KVT_CACHE_FAULT_FREE_SHARED): run so under `make asan`, the busy
 * session's next read is a use after free that ASan reports (a crash
 * otherwise: not run by default). */
TEST(tiers_evict_blocks_never_busy)
{
    char dir[] = "/tmp/kvt-tiers-XXXXXX", path[256];
    kvt_model *m = fam_open(&llama_fam, dir, path, sizeof path);
    if (!m) return;
    int32_t pa[NA], pb[NB + 30];
    fam_prompt(pa, NA, 35);
    fam_prompt(pb, NB + 30, 36);
    memcpy(pb, pa, NSH * sizeof *pb);
    uint64_t want = kvt_test_twin(m, pb, NB + 30);
    const char *asan = getenv("KVT_TIERS_TEST_FREE_SHARED");
    for (int fault = 0; fault < 2; fault++) {
        seen w = {0};
        kvt_tiers *t = tiers_on(m, 1, 2048, &w);
        CHECK(t);
        kvt_tier_pick a, b;
        CHECK_OK(run(t, 0, NULL, pa, NA, &a));
        CHECK_OK(run_as(t, 0, NULL, pb, NB, &b, true)); /* B's request runs on */
        CHECK(b.forked && kvt_tiers_busy(t) == 1);
        uint64_t db = kvt_test_digest(b.s, m);
        t->o.ram_bytes = 1;
        if (fault) kvt_tiers_fault = KVT_TIERS_FAULT_TRIM_SHARED;
        if (asan && !strcmp(asan, "1")) kvt_cache_fault = KVT_CACHE_FAULT_FREE_SHARED;
        int rc = trigger(t, 0, 44);
        kvt_tiers_fault = KVT_TIERS_FAULT_NONE;
        kvt_cache_fault = 0;
        CHECK_OK(rc);
        bool ok = in_pool(t, b.s, 0) && holds(b.s, pb, NB) && kvt_test_digest(b.s, m) == db;
        if (ok) { /* the request goes on: the rest of its tokens */
            for (size_t i = NB; i < NB + 30 && ok; i++) ok = kvt_session_decode(b.s, pb[i]) == KVT_OK;
            ok = ok && kvt_test_digest(b.s, m) == want;
        }
        if (!fault) {
            CHECK(ok && w.evicted[0] == 1 && t->n == 2); /* A went; B and the new one */
        } else {
            printf("    negative control, eviction taking a busy session's blocks (must be refused):\n");
            CHECKF(!ok, "control: a busy session trimmed went unnoticed");
        }
        kvt_tiers_release(t, b.s);
        kvt_tiers_free(t);
    }
    fam_close(m, dir, path);
}

/* Tenants never see each other's blocks: a prompt of another tenant's
 * session is a miss for this one, and eviction over one tenant's share
 * trims its own sessions only. */
TEST(tiers_evict_blocks_per_tenant)
{
    seen w = {0};
    kvt_model *m;
    kvt_tiers *t = tiers_open(&m, 2, SIZE_MAX, &w);
    if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
    t->o.policy.continued_interval = 128; /* checkpoints on every block (for new sessions) */
    int32_t *a = prompt(NA, 37, NA, 37);
    kvt_tier_pick p0, p1;
    CHECK_OK(run(t, 0, NULL, a, NA, &p0));
    CHECK_OK(run(t, 1, NULL, a, NA, &p1));
    CHECK(pick_is(&p1, "none", 0) && p1.s != p0.s);
    CHECK(kvt_tiers_index_entries(t, 0) == NA / KVT_BLOCK && kvt_tiers_index_entries(t, 1) == NA / KVT_BLOCK);
    uint64_t d0 = kvt_test_digest(p0.s, m);
    /* tenant 1 over its share, tenant 0 far over it too: only tenant 1's
     * session gives blocks back */
    t->o.ram_bytes = 2 * (kvt_tiers_bytes(t, 1) - 1);
    CHECK_OK(trigger(t, 1, 45));
    CHECK(in_pool(t, p1.s, 1) && kvt_session_len(p1.s) == 640);
    CHECK(holds(p0.s, a, NA) && kvt_test_digest(p0.s, m) == d0 && w.evicted[0] == 0 && w.evicted[1] == 0);
    CHECK(kvt_tiers_index_entries(t, 0) == NA / KVT_BLOCK);
    free(a);
    tiers_close(t, m);
}

/* Architectures with per-position state (window rings, recurrent state,
 * ds4's compressed rows and frontier) are cut at a checkpoint on the grid
 * (here every 128 tokens): the trimmed session resumes with the bits of
 * an uninterrupted run, for a prompt that ends at the cut and for one
 * that goes on. */
static void resume_exact(kvt_model *m, const int32_t *pa, size_t n)
{
    seen w = {0};
    kvt_tiers *t = tiers_on(m, 1, 128, &w);
    CHECK(t);
    kvt_tier_pick a, q;
    CHECK_OK(run(t, 0, NULL, pa, NA, &a));
    t->o.ram_bytes = kvt_tiers_bytes(t, 0) - 1;
    CHECK_OK(trigger(t, 0, 46));
    CHECKF(in_pool(t, a.s, 0) && kvt_session_len(a.s) == 640, "A holds %zu", kvt_session_len(a.s));
    t->o.ram_bytes = SIZE_MAX;
    CHECK_OK(run(t, 0, NULL, pa, 640, &q));
    CHECK(pick_is(&q, "ram", 640) && q.s == a.s && kvt_test_digest(q.s, m) == kvt_test_twin(m, pa, 640));
    CHECK_OK(run(t, 0, NULL, pa, n, &q));
    CHECK(q.s == a.s && kvt_test_digest(q.s, m) == kvt_test_twin(m, pa, n));
    /* no checkpoint to go back to (the default grid, 2048): the session
     * goes whole */
    kvt_tiers_free(t);
    t = tiers_on(m, 1, 2048, &w);
    CHECK(t);
    CHECK_OK(run(t, 0, NULL, pa, NA, &a));
    t->o.ram_bytes = kvt_tiers_bytes(t, 0) - 1;
    CHECK_OK(trigger(t, 0, 47));
    CHECK(holding(t, pa, NA, 0) == 0 && w.evicted[0] == 1);
    kvt_tiers_free(t);
}

TEST(tiers_evict_blocks_resume_ds4)
{
    kvt_model *m = NULL;
    if (kvt_model_preset(&m, "ds4-tiny", 7, NULL)) SKIP("ds4-tiny: %s", kvt_errmsg());
    int32_t *pa = prompt(NA + 100, 38, NA + 100, 38);
    resume_exact(m, pa, NA + 100);
    free(pa);
    kvt_model_close(m);
}

static void resume_family(const fam_spec *f)
{
    char dir[] = "/tmp/kvt-tiers-XXXXXX", path[256];
    kvt_model *m = fam_open(f, dir, path, sizeof path);
    if (!m) return;
    int32_t pa[NA + 100];
    fam_prompt(pa, NA + 100, 39);
    printf("    %s\n", f->arch);
    resume_exact(m, pa, NA + 100);
    fam_close(m, dir, path);
}

TEST(tiers_evict_blocks_resume_window)
{
    static const fam_spec gemma3 = {"gemma3", false, true, FAM_HEAD_DIM, false, false, true};
    resume_family(&gemma3);
}

TEST(tiers_evict_blocks_resume_recurrent)
{
    static const fam_spec qwen35 = {"qwen35", .qwen35 = FAM_Q35_DENSE};
    resume_family(&qwen35);
}

/* Conversations on one system prompt, as the server runs them (a fork of
 * the first at the prompt's end, then the conversation's own tokens): what
 * each holds of its own, by kind (kvt_session_bytes_parts). The prompt ends
 * inside a block (700 = 5 x 128 + 60, page 3 of 16 tokens; the fork is at
 * 700 or a token or two past it, as the seeds' tokens agree); each of the
 * other conversations owns exactly the pages its 30 tokens reach, 3 (rows
 * 60-89 of block 5: the page it copies from the shared block and 2 of its
 * own), and no whole block, and gives the bits of a cold run. false when
 * not (the reason printed): with KVT_CACHE_FAULT_WHOLE_BLOCKS (whole-block
 * copies, the cache before pages) it must be. */
enum { CONV_SYS = 700, CONV_OWN = 30, CONV_N = 6 };
static bool conversations_own_pages(kvt_model *m, bool fault)
{
    seen w = {0};
    kvt_tiers *t = tiers_on(m, 1, 2048, &w);
    if (!t) return false;
    kvt_cache_fault = fault ? KVT_CACHE_FAULT_WHOLE_BLOCKS : 0;
    bool ok = true;
    double sum = 0, one = 0;
    const kvt_session *first = NULL;
    int32_t p[CONV_SYS + CONV_OWN];
    fam_prompt(p, CONV_SYS, 50);
    for (int i = 0; i < CONV_N && ok; i++) {
        fam_prompt(p + CONV_SYS, CONV_OWN, 60 + (uint64_t)i);
        kvt_tier_pick k;
        if (run(t, 0, NULL, p, CONV_SYS + CONV_OWN, &k) || (i && !(k.forked && pick_is(&k, "ram", k.reused) && k.reused >= CONV_SYS && k.reused < 704))) {
            ok = false;
            break;
        }
        const kvt_cache *c = k.s->cache;
        size_t want = 0;
        for (size_t s = 0; s < c->n_streams; s++)
            want += KVT_BLOCK_ROWS_AT + 3 * (size_t)c->streams[s].page_rows * c->streams[s].row_bytes;
        kvt_session_parts q;
        kvt_session_bytes_parts(k.s, &q);
        sum += (double)kvt_session_bytes(k.s);
        if (!i) {
            one = (double)kvt_session_bytes(k.s);
            first = k.s;
        }
        printf("    conversation %d%s: rows of whole blocks %zu, of pages %zu, checkpoints %zu, other %zu, scratch %zu "
               "bytes\n", i + 1, fault ? " (whole blocks)" : "", q.rows_whole, q.rows_pages, q.checkpoints, q.other,
               q.scratch);
        if (i && (q.rows_whole || q.rows_pages != want)) {
            printf("    conversation %d owns rows of %zu bytes in whole blocks and %zu in pages; 3 pages are %zu\n", i + 1,
                   q.rows_whole, q.rows_pages, want);
            ok = false;
        }
        if (kvt_test_digest(k.s, m) != kvt_test_twin(m, p, CONV_SYS + CONV_OWN)) {
            printf("    conversation %d differs from a cold run\n", i + 1);
            ok = false;
        }
    }
    printf("    %d conversations: %.3fx one's bytes\n", CONV_N, sum / one);
    /* the first one's partial block is the others' base: cutting it would
     * free nothing (make_room drops the session whole instead) */
    const kvt_session *all[KVT_TIERS_MAX_POOL + KVT_TIERS_MAX_BUSY];
    for (size_t i = 0; i < t->n; i++) all[i] = t->pool[i].s;
    if (ok && !fault && kvt_session_block_private(first, CONV_SYS / KVT_BLOCK, all, t->n)) {
        printf("    the first conversation's partial block, the others' base, counts as its own\n");
        ok = false;
    }
    kvt_cache_fault = 0;
    kvt_tiers_free(t);
    return ok;
}

TEST(tiers_share_conversation_pages)
{
    char dir[] = "/tmp/kvt-tiers-XXXXXX", path[256];
    kvt_model *m = fam_open(&llama_fam, dir, path, sizeof path);
    if (!m) return;
    CHECK(conversations_own_pages(m, false));
    CHECK(!conversations_own_pages(m, true));
    fam_close(m, dir, path);
}

/* ---- the index's key scope (kvt_tiers_opts.keys, snapshot.h) ---- */

/* A pool of ds4-tiny (seed 7) keying its index in scope. */
static kvt_tiers *tiers_open_keys(kvt_model **m, kvt_key_scope keys)
{
    *m = NULL;
    if (kvt_model_preset(m, "ds4-tiny", 7, NULL)) return NULL;
    kvt_tiers_opts o = {.ram_bytes = SIZE_MAX, .n_tenants = 1, .n_ctx = CTX, .n_threads = 1,
                        .policy = KVT_SAVE_POLICY_DEFAULT, .keys = keys};
    kvt_tiers *t = NULL;
    if (kvt_tiers_new(&t, *m, &o)) { kvt_model_close(*m); *m = NULL; }
    return t;
}

/* The index holds block 0 of s under key. */
static bool indexed(const kvt_tiers *t, const kvt_session *s, uint64_t key)
{
    for (size_t i = 0; i < t->ix_cap; i++)
        if (t->ix[i].s == s && t->ix[i].b == 0) return t->ix[i].key == key;
    return false;
}

/* The model's fingerprint was made (kvt_model_fingerprint's state). */
static bool fingerprint_made(const kvt_model *m) { return atomic_load(&m->fp_state) != 0; }

/* A pool without a store (KVT_KEYS_PROCESS, as the server makes it
 * without a disk or remote tier) serves a 200-token prompt twice, the
 * second from RAM through its index, and the model's fingerprint is never
 * made: every weight would be read for keys that never leave the process.
 * The index holds the block under the process chain's key, the one the
 * prompt's lookup makes. Negative control: KVT_SNAP_FAULT_PROCESS_SEED_FINGERPRINTED
 * (the process chain seeded by the fingerprint, as every chain was) makes
 * the fingerprint on the same two requests, and the test says so. */
TEST(tiers_keys_process_no_fingerprint)
{
    int32_t *a = prompt(200, 11, 200, 11);
    CHECK(a);
    for (int fault = 0; fault < 2; fault++) {
        kvt_model *m;
        kvt_tiers *t = tiers_open_keys(&m, KVT_KEYS_PROCESS);
        if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
        uint64_t runs = kvt_model_fingerprint_runs;
        kvt_snap_fault = fault ? KVT_SNAP_FAULT_PROCESS_SEED_FINGERPRINTED : KVT_SNAP_FAULT_NONE;
        kvt_tier_pick p, q;
        int rc = run(t, 0, NULL, a, 200, &p);
        if (!rc) rc = run(t, 0, NULL, a, 200, &q);
        bool made = fingerprint_made(m);
        uint64_t key = kvt_snap_key_next(kvt_snap_key0_in(m, KVT_KEYS_PROCESS), a);
        kvt_snap_fault = KVT_SNAP_FAULT_NONE;
        CHECK_OK(rc);
        CHECK(pick_is(&p, "none", 0) && pick_is(&q, "ram", 200) && q.s == p.s);
        CHECK(kvt_tiers_index_entries(t, 0) == 1 && indexed(t, q.s, key));
        if (!fault) {
            printf("    without a store: fingerprint made %s, %llu hashes of the weights\n", made ? "yes" : "no",
                   (unsigned long long)(kvt_model_fingerprint_runs - runs));
            CHECK(!made && kvt_model_fingerprint_runs == runs);
            /* and the process chain is not the records' */
            CHECK(key != kvt_snap_key_next(kvt_snap_key0(m), a));
        } else {
            printf("    negative control, the process chain seeded by the fingerprint (must be caught):\n");
            CHECKF(made, "control: the old seed went unnoticed");
        }
        tiers_close(t, m);
    }
    free(a);
}

/* What leaves the process keeps the records' chain, whatever scope the
 * session's keys were made in: a pool with a store (the default scope)
 * indexes the records' keys, which its saves and the store's lookup use,
 * as before; a session of a process-scope pool saved to a store and
 * handed out as a RAM snapshot carries the records' keys (it loads into
 * another session of the model, and the store finds it), and the pool
 * still finds it in RAM afterwards (its index keys made again). */
TEST(tiers_keys_records_when_leaving)
{
    int32_t *a = prompt(300, 12, 300, 12);
    CHECK(a);
    char dir[256];
    tmpdir(dir, sizeof dir, "keys");
    kvt_store *st = NULL;
    CHECK_OK(kvt_store_open(&st, dir, 0));
    kvt_model *m;
    kvt_tiers *t = tiers_open_keys(&m, KVT_KEYS_RECORDS);
    if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
    uint64_t rkey = kvt_snap_key_next(kvt_snap_key0(m), a);
    kvt_tier_pick p, q;
    CHECK_OK(run(t, 0, st, a, 200, &p));
    CHECK_OK(run(t, 0, st, a, 200, &q));
    CHECK(pick_is(&q, "ram", 200) && indexed(t, q.s, rkey));
    CHECK_OK(kvt_store_save(st, q.s, 200, "manual", NULL));
    size_t match = 0;
    int64_t id = -1;
    CHECK_OK(kvt_store_lookup(st, m, a, 300, &match, &id));
    CHECK(match == 200);
    tiers_close(t, m);

    t = tiers_open_keys(&m, KVT_KEYS_PROCESS);
    CHECK(t);
    uint64_t pkey = kvt_snap_key_next(kvt_snap_key0_in(m, KVT_KEYS_PROCESS), a);
    CHECK_OK(run(t, 0, NULL, a, 300, &p));
    CHECK_OK(run(t, 0, NULL, a, 300, &q)); /* the session's keys made in the process scope */
    CHECK(pick_is(&q, "ram", 300) && q.s == p.s && indexed(t, p.s, pkey) && !fingerprint_made(m));
    rkey = kvt_snap_key_next(kvt_snap_key0(m), a); /* makes the fingerprint */
    kvt_wbuf blk = {0};
    uint64_t bkey = 0;
    CHECK_OK(kvt_snap_block(p.s, 0, kvt_snap_key0(m), &blk, &bkey));
    CHECK(bkey == rkey && kvt_snap_block_check(blk.p, blk.len, &bkey) == KVT_OK && bkey == rkey);
    kvt_wbuf_free(&blk);
    uint8_t *snap = NULL;
    size_t len = 0;
    CHECK_OK(kvt_session_snapshot(p.s, &snap, &len));
    kvt_snap_info in;
    CHECK_OK(kvt_snap_parse(m, snap, len, &in));
    CHECK(in.nb == 2 && kvt_rd64(in.sec[6] /* block keys */) == rkey && kvt_rd64(in.sec[6] + 8) == kvt_snap_key_next(rkey, a + 128));
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, &(kvt_session_opts){.n_ctx = CTX, .n_threads = 1}));
    CHECK_OK(kvt_session_restore(s, snap, len));
    CHECK(holds(s, a, 300));
    kvt_session_free(s);
    free(snap);
    CHECK_OK(kvt_store_save(st, p.s, 300, "manual", NULL));
    CHECK_OK(kvt_store_lookup(st, m, a, 300, &match, &id));
    CHECK(match == 300);
    CHECK_OK(run(t, 0, NULL, a, 300, &q));
    CHECK(pick_is(&q, "ram", 300) && q.s == p.s && indexed(t, q.s, pkey));
    tiers_close(t, m);
    kvt_store_close(st);
    rmdir_all(dir);
    free(a);
}

/* A pooled session's companion (the draft model's session of its last
 * reply, kvt_tiers_keep_draft): counted in the tenant's bytes, taken by the
 * next request on the session, refused when it does not fit the share;
 * saved with the session when it is dropped, as a record of the draft
 * model (ds4-tiny+D=32: the model's lookup does not find it, the draft
 * model's does); the first thing to go when the share is short (before
 * any block of the session itself), saved first. Control:
 * KVT_TIERS_FAULT_DRAFT_UNCOUNTED (the companion out of the bytes) is seen. */
TEST(tiers_draft_companion)
{
    seen w = {0};
    kvt_model *m, *dm = NULL;
    kvt_tiers *t = tiers_open(&m, 1, SIZE_MAX, &w);
    if (!t) SKIP("ds4-tiny: %s", kvt_errmsg());
    CHECK_OK(kvt_model_preset(&dm, "ds4-tiny+D=32", 3, NULL));
    char dir[256];
    tmpdir(dir, sizeof dir, "companion");
    kvt_store *st = NULL;
    CHECK_OK(kvt_store_open(&st, dir, 0));
    int32_t *a = prompt(900, 31, 900, 31), *b = prompt(900, 32, 900, 32);
    kvt_session_opts so = {.n_ctx = CTX, .n_threads = 1};
    kvt_tier_pick p, q;
    CHECK_OK(run(t, 0, NULL, a, 800, &p));
    size_t alone = kvt_tiers_bytes(t, 0);
    kvt_session *d = NULL, *d2 = NULL;
    CHECK_OK(kvt_session_new(&d, dm, &so));
    CHECK_OK(kvt_session_sync(d, a, 700, NULL));
    CHECK(kvt_tiers_keep_draft(t, p.s, d));
    size_t with = kvt_tiers_bytes(t, 0), db = kvt_session_bytes(d);
    CHECKF(with == alone + db, "the pool holds %zu bytes with its companion of %zu, %zu without", with, db, alone);
    kvt_tiers_fault = KVT_TIERS_FAULT_DRAFT_UNCOUNTED; /* control: the companion left out */
    size_t uncounted = kvt_tiers_bytes(t, 0);
    kvt_tiers_fault = KVT_TIERS_FAULT_NONE;
    CHECKF(uncounted != alone + db, "control: a companion left uncounted went unseen");
    /* one companion a session */
    CHECK_OK(kvt_session_new(&d2, dm, &so));
    CHECK(!kvt_tiers_keep_draft(t, p.s, d2));
    kvt_session_free(d2);
    /* the next request on the session takes it */
    CHECK_OK(run_as(t, 0, NULL, a, 860, &q, true));
    CHECK(q.extended && q.s == p.s);
    CHECK(kvt_tiers_take_draft(t, q.s) == d && kvt_tiers_take_draft(t, q.s) == NULL);
    CHECK(kvt_tiers_bytes(t, 0) == kvt_session_bytes(q.s)); /* out of the pool's bytes */
    kvt_tiers_release(t, q.s);
    /* a share it does not fit: refused, the caller frees it */
    size_t full = t->o.ram_bytes;
    t->o.ram_bytes = kvt_tiers_bytes(t, 0) + kvt_session_bytes(d) / 2;
    CHECK(!kvt_tiers_keep_draft(t, q.s, d));
    t->o.ram_bytes = full;
    CHECK(kvt_tiers_keep_draft(t, q.s, d));
    /* dropped with its session: both saved, each under its own model */
    kvt_tiers_drop(t, 0, st, "shutdown");
    size_t mm = 0, md = 0;
    int64_t id;
    CHECK_OK(kvt_store_lookup(st, m, a, 860, &mm, &id));
    CHECK_OK(kvt_store_lookup(st, dm, a, 860, &md, &id));
    printf("    companion of %zu bytes; dropped: the model's lookup finds %zu tokens, the draft model's %zu; %d saves\n",
           db, mm, md, w.saved);
    CHECKF(mm == 860 && md == 700 && w.saved == 2, "the session and its companion saved on drop");
    CHECK(t->n == 0 && kvt_tiers_bytes(t, 0) == 0);
    /* short of room: the companion goes first (saved), the session stays whole */
    kvt_tier_pick r, s2;
    CHECK_OK(run(t, 0, st, b, 800, &r));
    CHECK_OK(kvt_session_new(&d2, dm, &so));
    CHECK_OK(kvt_session_sync(d2, b, 600, NULL));
    CHECK(kvt_tiers_keep_draft(t, r.s, d2));
    size_t sess = kvt_session_bytes(r.s);
    t->o.ram_bytes = kvt_tiers_bytes(t, 0) - 1024; /* room for the session, not its companion */
    int saved = w.saved;
    int32_t *c = prompt(200, 33, 200, 33);
    CHECK_OK(run(t, 0, st, c, 10, &s2));
    printf("    short of room: %zu sessions, the first %s, its companion %s, %zu of 800 tokens, %zu bytes of %zu\n", t->n,
           t->n && t->pool[0].s == r.s ? "the same" : "ANOTHER", t->n && t->pool[0].draft ? "KEPT" : "gone",
           t->n ? kvt_session_len(t->pool[0].s) : 0, t->n ? kvt_session_bytes(t->pool[0].s) : 0, sess);
    CHECKF(t->n && t->pool[0].s == r.s && !t->pool[0].draft && kvt_session_bytes(r.s) == sess && kvt_session_len(r.s) == 800,
           "the companion must go before any block of its session");
    CHECK_OK(kvt_store_lookup(st, dm, b, 800, &md, &id));
    CHECKF(md == 600 && w.saved == saved + 1, "the companion saved before it went (%zu tokens found)", md);
    t->o.ram_bytes = full;
    free(a);
    free(b);
    free(c);
    kvt_store_close(st);
    tiers_close(t, m);
    kvt_model_close(dm);
    rmdir_all(dir);
}
