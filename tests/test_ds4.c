/* ds4 and its heterogeneous cache: block alignment of the compressed
 * classes, agreement with the independent f64 reference, exactness under any
 * chunk schedule / thread count / kernel path, snapshot and restore, shared
 * prefixes, and negative controls that prove the checks catch a
 * corrupt frontier, a shifted mask and a wrong prefix. */
#include "test.h"
#include "session/testing.h"
#include "kernels/kernels.h"
#include "arch/model.h"
#include "arch/ds4.h"
#include "ref.h"
#include "session/snapshot.h"
#include "base/util.h"
#include "ds4_tiny.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

static size_t nonzero_rows(const kvt_stream *st)
{
    size_t n = 0;
    for (size_t p = 0; p < st->n_blocks * st->pages_per_block; p++) {
        if (!st->pages[p]) continue;
        for (size_t r = 0; r < st->page_rows; r++) {
            const uint8_t *row = st->pages[p] + r * st->row_bytes;
            for (size_t k = 0; k < st->row_bytes; k++)
                if (row[k]) { n++; break; }
        }
    }
    return n;
}

TEST(ds4_block_alignment)
{
    kvt_model *m = tiny();
    CHECK(m);
    enum { N = 3 * 128 + 50 };
    int32_t t[N];
    seqb(t, N, 1);
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    const kvt_cache *c = s->cache;
    CHECK(c->n_streams == 3); /* ds4-tiny: layer 2 (ratio 4: rows + indexer rows), layer 3 (ratio 128) */
    size_t prev[3] = {0};
    for (size_t i = 0; i < N; i++) {
        CHECK_OK(kvt_session_decode(s, t[i]));
        for (size_t k = 0; k < 3; k++) {
            uint32_t r = KVT_BLOCK / c->streams[k].rows_per_block;
            size_t rows = nonzero_rows(&c->streams[k]);
            CHECKF(rows == (i + 1) / r, "stream %zu (ratio %u) has %zu rows after %zu tokens", k, r, rows, i + 1);
            if ((i + 1) % KVT_BLOCK == 0) {
                CHECKF(rows - prev[k] == c->streams[k].rows_per_block,
                       "block %zu added %zu rows to a ratio-%u stream", i / KVT_BLOCK, rows - prev[k], r);
                prev[k] = rows;
            }
        }
    }
    /* Memory accounting: a block-aligned context allocates exactly the plan. */
    kvt_session_free(s);
    CHECK_OK(kvt_session_new(&s, m, NULL));
    CHECK_OK(kvt_session_sync(s, t, 3 * 128, NULL));
    kvt_plan p;
    CHECK_OK(kvt_model_plan(m, 3 * 128, &p));
    CHECKF(kvt_cache_bytes_allocated(s->cache) == p.total, "allocated %zu, plan %llu",
           kvt_cache_bytes_allocated(s->cache), (unsigned long long)p.total);
    kvt_session_free(s);
    CHECK_OK(kvt_plan_preset("ds4-mini", 1000, &p));
    CHECK(p.per_token_x1000 == 294000); /* 3 x (128 + 64) / 2 + 3 x 128 / 64 B per token */
    kvt_model_close(m);
}

static const char *tiny_path(void)
{
    static char path[64];
    snprintf(path, sizeof path, "/tmp/kvtier-test-tiny-%d.gguf", (int)getpid());
    return path;
}

/* Max |engine - f64| over positions the reference calls unambiguous. */
static int ref_maxdiff(kvt_model *m, const char *path, const int32_t *t, size_t n, double *maxd, size_t *skipped)
{
    double *ref = NULL;
    uint32_t V = 0;
    unsigned char *amb = calloc(n, 1);
    if (!amb || ref_ds4_logits(path, t, n, &ref, &V, amb)) { free(amb); return -1; }
    kvt_session *s = NULL;
    int rc = kvt_session_new(&s, m, NULL);
    *maxd = 0;
    *skipped = 0;
    for (size_t i = 0; !rc && i < n; i++) {
        rc = kvt_session_decode(s, t[i]);
        if (rc) break;
        if (amb[i]) { (*skipped)++; continue; }
        const float *lg = kvt_session_logits(s);
        for (uint32_t j = 0; j < V; j++) *maxd = fmax(*maxd, fabs(lg[j] - ref[i * V + j]));
    }
    kvt_session_free(s);
    free(ref);
    free(amb);
    return rc;
}

#define REF_TOL 1e-2

TEST(ds4_f64_reference_and_model_file)
{
    kvt_model *m = tiny();
    CHECK(m);
    const char *path = tiny_path();
    CHECK_OK(kvt_model_save(m, path));
    kvt_model *mf = NULL;
    CHECK_OK(kvt_model_open(&mf, path));
    CHECK(kvt_model_fingerprint(mf) == kvt_model_fingerprint(m));
    CHECK(kvt_model_tokenizer_fingerprint(mf) == kvt_model_tokenizer_fingerprint(m));
    enum { N = 640 }; /* crosses W = 16, every 4, and the 128 boundaries 5 times */
    int32_t t[N];
    seqb(t, N, 3);
    state a = {0}, b = {0};
    CHECK_OK(run(m, t, N, NULL, 0, 1, &a));
    CHECK_OK(run(mf, t, N, NULL, 0, 1, &b));
    bool eq = equal(&a, &b);
    state_free(&a);
    state_free(&b);
    CHECKF(eq, "the model loaded from its GGUF differs from the in-memory preset");
    double maxd;
    size_t skipped;
    CHECK(ref_maxdiff(mf, path, t, N, &maxd, &skipped) == 0);
    printf("    max |f32 - f64| = %.3g over %d positions (%zu skipped as top-k ties)\n", maxd, N, skipped);
    /* Tolerance: the engine rounds window, compressed and indexer rows to
     * binary16 exactly where the reference does, but from an f32 value that
     * differs from the f64 one by ~1e-6 relative; when that straddles a
     * binary16 rounding boundary the two round to neighbours 2^-11 (4.9e-4)
     * apart. Such flips are rare and each moves a logit by well under 1e-3;
     * 1e-2 bounds their sum over 4 layers while any real error in the math
     * (a wrong row, position or weight) moves logits by >= 1e-1. */
    CHECKF(maxd < REF_TOL, "max |f32 - f64| = %g", maxd);
    CHECK(skipped < N / 10);
    /* Negative control: an off-by-one window mask must fail this check. */
    kvt_ds4_fault = KVT_DS4_FAULT_MASK;
    int rc = ref_maxdiff(mf, path, t, 200, &maxd, &skipped);
    kvt_ds4_fault = KVT_DS4_FAULT_NONE;
    CHECK(rc == 0);
    printf("    with a shifted mask: max diff %.3g\n", maxd);
    CHECKF(maxd > REF_TOL, "a shifted window mask went unnoticed (max diff %g)", maxd);
    unlink(path);
    kvt_model_close(mf);
    kvt_model_close(m);
}

TEST(ds4_chunk_thread_kernel_invariance)
{
    kvt_model *m = tiny();
    CHECK(m);
    enum { N = 700 };
    int32_t t[N];
    seqb(t, N, 5);
    state base = {0}, o = {0};
    CHECK_OK(run(m, t, N, NULL, 0, 1, &base));
    static const uint32_t one[] = {1}, odd[] = {4, 1, 7, 12}, blk[] = {128}, win[] = {16},
                          mix[] = {3, 5, 120, 17, 128, 1, 255}, all[] = {N};
    uint32_t rnd[64];
    uint64_t st = kvt_test_seed("ds4_chunk_thread_kernel_invariance");
    for (int i = 0; i < 64; i++) rnd[i] = 1 + (uint32_t)(kvt_test_rand(&st) % 200);
    struct { const uint32_t *c; size_t n; uint32_t th; const char *what; } cases[] = {
        {all, 1, 1, "one-shot"}, {one, 1, 1, "1 token at a time"}, {odd, 4, 1, "4/1/7/12"},
        {blk, 1, 1, "128-token chunks"}, {win, 1, 1, "W-token chunks"}, {mix, 7, 1, "3/5/120/17/128/1/255"},
        {rnd, 64, 1, "random chunks"}, {NULL, 0, 2, "2 threads"}, {mix, 7, 3, "mixed chunks, 3 threads"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        CHECK_OK(run(m, t, N, cases[i].c, cases[i].n, cases[i].th, &o));
        bool eq = equal(&base, &o);
        state_free(&o);
        CHECKF(eq, "%s differs from the default schedule", cases[i].what);
    }
    bool old = kvt_kernels_force_scalar(true);
    int rc = run(m, t, N, odd, 4, 2, &o);
    kvt_kernels_force_scalar(old);
    CHECK_OK(rc);
    bool eq = equal(&base, &o);
    state_free(&o);
    CHECK(eq);
    state_free(&base);
    kvt_model_close(m);
}

/* Uninterrupted run of t[0..n) vs snapshot at k, restore in a new session,
 * continue to n. Returns true when bit-identical. */
/* Restore the state at k (stored whole, or without its state when replay)
 * into a new session, check it equals the original's, then run on to n and
 * compare with one uninterrupted run. */
static bool restore_equivalent_as(kvt_model *m, const int32_t *t, size_t n, size_t k, bool replay)
{
    state a = {0}, b = {0}, c0 = {0}, c1 = {0};
    kvt_session *s1 = NULL, *s2 = NULL;
    uint8_t *snap = NULL;
    size_t len = 0;
    bool ok = run(m, t, n, NULL, 0, 1, &a) == KVT_OK && kvt_session_new(&s1, m, NULL) == KVT_OK &&
              kvt_session_sync(s1, t, k, NULL) == KVT_OK && kvt_session_snapshot(s1, &snap, &len) == KVT_OK;
    if (ok && replay) {
        uint8_t *thin = NULL;
        ok = without_state(snap, len, &thin, &len) == KVT_OK;
        free(snap);
        snap = thin;
    }
    ok = ok && kvt_session_new(&s2, m, NULL) == KVT_OK && kvt_session_restore(s2, snap, len) == KVT_OK &&
              kvt_session_len(s2) == k;
    if (ok && k) ok = capture(s1, m, &c0) == KVT_OK && capture(s2, m, &c1) == KVT_OK && equal(&c0, &c1);
    size_t reused = 0;
    ok = ok && kvt_session_sync(s2, t, n, &reused) == KVT_OK && reused == k && capture(s2, m, &b) == KVT_OK &&
         equal(&a, &b);
    state_free(&a); state_free(&b); state_free(&c0); state_free(&c1);
    kvt_session_free(s1);
    kvt_session_free(s2);
    free(snap);
    return ok;
}

static bool restore_equivalent(kvt_model *m, const int32_t *t, size_t n, size_t k)
{
    return restore_equivalent_as(m, t, n, k, false);
}

TEST(ds4_snapshot_restore_equivalence)
{
    kvt_model *m = tiny();
    CHECK(m);
    enum { N = 420 };
    int32_t t[N];
    seqb(t, N, 9);
    const size_t ks[] = {0, 1, 3, 4, 5, 15, 16, 17, 127, 128, 129, 131, 256, 300, 384, 419};
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++)
        CHECKF(restore_equivalent(m, t, N, ks[i]), "restore at %zu differs from the uninterrupted run", ks[i]);
    /* Negative control: a corrupt frontier on restore must be caught. */
    kvt_ds4_fault = KVT_DS4_FAULT_FRONTIER;
    bool caught = !restore_equivalent(m, t, N, 300) && !restore_equivalent(m, t, N, 130);
    kvt_ds4_fault = KVT_DS4_FAULT_NONE;
    CHECKF(caught, "a corrupted frontier went unnoticed");
    kvt_model_close(m);
}

TEST(ds4_shared_prefix_and_wrong_prefix)
{
    kvt_model *m = tiny();
    CHECK(m);
    enum { P = 300, N = 380 };
    int32_t a[N], b[N], w[N];
    seqb(a, N, 11);
    memcpy(b, a, sizeof a);
    for (size_t i = P; i < N; i++) b[i] = (int32_t)((a[i] + 1 + i) % 256); /* diverge after P */
    memcpy(w, a, sizeof a);
    for (size_t i = 1; i < P; i++) w[i] = (int32_t)((a[i] + 7) % 256);     /* other prefix, same suffix */
    kvt_session *s = NULL, *x = NULL, *y = NULL;
    uint8_t *snap = NULL, *wsnap = NULL;
    size_t len = 0, wlen = 0;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    CHECK_OK(kvt_session_sync(s, a, P, NULL));
    CHECK_OK(kvt_session_snapshot(s, &snap, &len));
    CHECK_OK(kvt_session_sync(s, w, P, NULL));
    CHECK_OK(kvt_session_snapshot(s, &wsnap, &wlen));
    CHECK_OK(kvt_session_new(&x, m, NULL));
    CHECK_OK(kvt_session_new(&y, m, NULL));
    CHECK_OK(kvt_session_restore(x, snap, len));
    CHECK_OK(kvt_session_restore(y, snap, len));
    CHECK_OK(kvt_session_sync(x, a, N, NULL));
    CHECK_OK(kvt_session_sync(y, b, N, NULL));
    state sx = {0}, sy = {0}, ta = {0}, tb = {0}, sw = {0};
    CHECK_OK(capture(x, m, &sx));
    CHECK_OK(capture(y, m, &sy));
    CHECK_OK(run(m, a, N, NULL, 0, 2, &ta));
    CHECK_OK(run(m, b, N, NULL, 0, 2, &tb));
    CHECK(equal(&sx, &ta));
    CHECK(equal(&sy, &tb));
    /* Negative control: the other prefix's snapshot + the same suffix. */
    kvt_session *z = NULL;
    CHECK_OK(kvt_session_new(&z, m, NULL));
    CHECK_OK(kvt_session_restore(z, wsnap, wlen));
    size_t reused = 0;
    CHECK_OK(kvt_session_sync(z, w, N, &reused));
    CHECK(reused == P);
    CHECK_OK(capture(z, m, &sw));
    double maxd = 0;
    for (uint32_t j = 0; j < sw.V; j++) maxd = fmax(maxd, fabs(sw.logits[j] - ta.logits[j]));
    CHECKF(maxd > 1e-3, "a different prefix gave the same logits (max diff %g)", maxd);
    /* Syncing a to a session holding w's prefix reuses only the BOS. */
    CHECK_OK(kvt_session_sync(z, a, N, &reused));
    CHECKF(reused <= 1, "reused %zu rows of another prefix", reused);
    state sz = {0};
    CHECK_OK(capture(z, m, &sz));
    CHECK(equal(&sz, &ta));
    state_free(&sx); state_free(&sy); state_free(&ta); state_free(&tb); state_free(&sw); state_free(&sz);
    kvt_session_free(s); kvt_session_free(x); kvt_session_free(y); kvt_session_free(z);
    free(snap);
    free(wsnap);
    kvt_model_close(m);
}

TEST(ds4_causality_and_topk_ties)
{
    kvt_model *m = tiny();
    CHECK(m);
    enum { N = 300, P = 200 };
    int32_t a[N], b[N];
    seqb(a, N, 17);
    memcpy(b, a, sizeof a);
    b[P] = (a[P] + 1) % 256;
    kvt_session *x = NULL, *y = NULL;
    CHECK_OK(kvt_session_new(&x, m, NULL));
    CHECK_OK(kvt_session_new(&y, m, NULL));
    bool early = true, late = false;
    for (size_t i = 0; i < N; i++) {
        CHECK_OK(kvt_session_decode(x, a[i]));
        CHECK_OK(kvt_session_decode(y, b[i]));
        bool eq = !memcmp(kvt_session_logits(x), kvt_session_logits(y), 271 * sizeof(float));
        if (i < P) early = early && eq;
        else late = late || !eq;
    }
    CHECK(early);
    CHECK(late);
    kvt_session_free(x);
    kvt_session_free(y);
    /* Ties resolve to the lower index, whatever the order they arrive in. */
    float sc[10] = {1, 3, 3, 2, 3, 0, 3, 3, 1, 3};
    uint32_t sel[4];
    char scratch[8 * 16];
    CHECK(kvt_ds4_topk(sc, 10, 4, sel, scratch) == 4);
    CHECK(sel[0] == 1 && sel[1] == 2 && sel[2] == 4 && sel[3] == 6);
    CHECK(kvt_ds4_topk(sc, 3, 4, sel, scratch) == 3 && sel[2] == 2);
    kvt_model_close(m);
}

/* What loading the state at k, stored without it, does under a replay one
 * token short (KVT_DS4_FAULT_REPLAY): the restore's result, whether a
 * refusal left the session empty, and, when the state loads, whether it is
 * the one the record was made from and whether running on to n gives the
 * uninterrupted run's logits (full). */
typedef struct short_replay { int rc; bool empty, state_equal, logits_equal; } short_replay;

static int replay_one_short(kvt_model *m, const int32_t *t, size_t n, size_t k, const state *full, short_replay *o)
{
    kvt_session *s1 = NULL, *s2 = NULL;
    uint8_t *snap = NULL, *thin = NULL;
    size_t len = 0, tlen = 0;
    state c0 = {0}, c1 = {0}, b = {0};
    *o = (short_replay){0};
    int rc = kvt_session_new(&s1, m, NULL);
    if (!rc) rc = kvt_session_sync(s1, t, k, NULL);
    if (!rc) rc = kvt_session_snapshot(s1, &snap, &len);
    if (!rc) rc = without_state(snap, len, &thin, &tlen);
    if (!rc) rc = capture(s1, m, &c0);
    if (!rc) rc = kvt_session_new(&s2, m, NULL);
    if (!rc) {
        kvt_ds4_fault = KVT_DS4_FAULT_REPLAY;
        o->rc = kvt_session_restore(s2, thin, tlen);
        kvt_ds4_fault = KVT_DS4_FAULT_NONE;
        o->empty = kvt_session_len(s2) == 0;
    }
    if (!rc && o->rc == KVT_OK) {
        rc = capture(s2, m, &c1);
        if (!rc) o->state_equal = equal(&c0, &c1);
        if (!rc) rc = kvt_session_sync(s2, t, n, NULL);
        if (!rc) rc = capture(s2, m, &b);
        if (!rc) o->logits_equal = !memcmp(b.logits, full->logits, full->V * sizeof(float));
    }
    state_free(&c0); state_free(&c1); state_free(&b);
    kvt_session_free(s1);
    kvt_session_free(s2);
    free(snap);
    free(thin);
    return rc;
}

/* A snapshot stored without its fixed state (window, frontier) is restored
 * by replaying its last tokens over the stored rows. The result must be the
 * uninterrupted run's state bit for bit, wherever the snapshot ends. A
 * replay that starts one token too late gives another state wherever the
 * replay does not start at 0 (so the span is as short as it can be), and
 * loading must refuse it there: the recomputed rows and the logits see only
 * part of the state, the record's state digest sees all of it. */
TEST(ds4_snapshot_replay)
{
    kvt_model *m = tiny();
    CHECK(m);
    enum { N = 720 };
    int32_t t[N];
    seqb(t, N, 31);
    const size_t ks[] = {1, 4, 15, 16, 17, 60, 61, 62, 127, 128, 129, 172, 173, 255, 256, 300, 383, 384, 511, 640, 719};
    const size_t nk = sizeof ks / sizeof ks[0];
    for (size_t i = 0; i < nk; i++)
        CHECKF(restore_equivalent_as(m, t, N, ks[i], true), "replayed restore at %zu differs", ks[i]);
    printf("    ds4-tiny replays %zu tokens at 300, %zu at 383, %zu at 384\n", kvt_ds4_replay_tokens(m, 300),
           kvt_ds4_replay_tokens(m, 383), kvt_ds4_replay_tokens(m, 384));
    /* A replay one token short, at each of these positions where the replay
     * does not start at 0 (elsewhere the fault changes nothing): refused
     * with the digest check, and (the negative control) accepted at some
     * with it off, as version 3 records are loaded, although wrong. */
    state full = {0};
    CHECK_OK(run(m, t, N, NULL, 0, 1, &full));
    size_t affected = 0, refused = 0, accepted = 0, wrong = 0, diverged = 0;
    char where[256] = "";
    for (size_t i = 0; i < nk; i++) {
        size_t k = ks[i];
        if (kvt_ds4_replay_tokens(m, k) == k) continue;
        affected++;
        short_replay o;
        CHECK_OK(replay_one_short(m, t, N, k, &full, &o));
        if (o.rc == KVT_ECORRUPT && o.empty) refused++;
        else printf("    a replay one token short was not refused at %zu (%s)\n", k, kvt_strerror(o.rc));
        kvt_snap_skip_state_digest = true;
        int rc = replay_one_short(m, t, N, k, &full, &o);
        kvt_snap_skip_state_digest = false;
        CHECK_OK(rc);
        if (o.rc != KVT_OK) continue;
        accepted++;
        wrong += !o.state_equal;
        diverged += !o.logits_equal;
        snprintf(where + strlen(where), sizeof where - strlen(where), "%s%zu", accepted > 1 ? ", " : "", k);
    }
    state_free(&full);
    printf("    a replay one token short: refused %zu of %zu\n", refused, affected);
    printf("    without the digest check: accepted %zu of %zu (%s), %zu of them wrong, %zu giving other logits "
           "when continued\n", accepted, affected, where, wrong, diverged);
    CHECKF(affected > 0 && refused == affected, "a replay one token short was refused at %zu of %zu positions",
           refused, affected);
    CHECKF(accepted > 0, "negative control: without the digest check the fault was refused everywhere, so this "
           "test does not show that the digest is what catches it");
    CHECKF(wrong == accepted, "negative control: %zu of the %zu states accepted without the digest check were "
           "right after all", accepted - wrong, accepted);
    /* The same at every position of the sequence, each snapshot taken from
     * one growing session. */
    {
        kvt_session *s = NULL, *r = NULL;
        CHECK_OK(kvt_session_new(&s, m, NULL));
        CHECK_OK(kvt_session_new(&r, m, NULL));
        size_t all = 0, all_refused = 0, all_accepted = 0, all_wrong = 0;
        for (size_t k = 1; k < N; k++) {
            CHECK_OK(kvt_session_decode(s, t[k - 1]));
            if (kvt_ds4_replay_tokens(m, k) == k) continue;
            all++;
            uint8_t *snap = NULL, *thin = NULL;
            size_t len = 0, tlen = 0;
            CHECK_OK(kvt_session_snapshot(s, &snap, &len));
            int rc = without_state(snap, len, &thin, &tlen);
            free(snap);
            CHECK_OK(rc);
            kvt_ds4_fault = KVT_DS4_FAULT_REPLAY;
            rc = kvt_session_restore(r, thin, tlen);
            bool empty = kvt_session_len(r) == 0;
            kvt_snap_skip_state_digest = true;
            int rc_off = kvt_session_restore(r, thin, tlen);
            kvt_snap_skip_state_digest = false;
            kvt_ds4_fault = KVT_DS4_FAULT_NONE;
            free(thin);
            if (rc == KVT_ECORRUPT && empty) all_refused++;
            else printf("    a replay one token short was not refused at %zu (%s)\n", k, kvt_strerror(rc));
            if (rc_off == KVT_OK) {
                all_accepted++;
                state x = {0}, y = {0};
                CHECK_OK(capture(s, m, &x));
                CHECK_OK(capture(r, m, &y));
                all_wrong += !equal(&x, &y);
                state_free(&x);
                state_free(&y);
            }
        }
        kvt_session_free(s);
        kvt_session_free(r);
        printf("    at every position 1..%d where it changes the replay: refused %zu of %zu; without the digest "
               "check accepted %zu, %zu of them wrong\n", N - 1, all_refused, all, all_accepted, all_wrong);
        CHECK(all > 0 && all_refused == all);
        CHECK(all_accepted > 0 && all_wrong == all_accepted);
    }
    /* the record is the whole one with its state section replaced by the
     * state's XXH3-64, as version 4 */
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    CHECK_OK(kvt_session_sync(s, t, 300, NULL));
    uint8_t *snap = NULL, *thin = NULL;
    size_t len = 0, tlen = 0;
    CHECK_OK(kvt_session_snapshot(s, &snap, &len));
    CHECK_OK(without_state(snap, len, &thin, &tlen));
    kvt_snap_info a, b;
    CHECK_OK(kvt_snap_parse_raw(snap, len, &a));
    CHECK_OK(kvt_snap_parse_raw(thin, tlen, &b));
    CHECK(a.version == 2 && b.version == 4 && b.flags == (KVT_SNAP_INLINE | KVT_SNAP_REPLAY));
    CHECK(tlen + a.sec_len[4] == len + 8 && b.sec_len[4] == 8);
    CHECK(kvt_rd64(b.sec[4]) == XXH3_64bits(a.sec[4], a.sec_len[4]));
    /* a wrong digest (resealed, so that only the digest check can see it)
     * refuses a replay that is otherwise right */
    {
        kvt_wbuf bad = {0};
        uint8_t digest[8];
        for (int k = 0; k < 8; k++) digest[k] = (uint8_t)((kvt_rd64(b.sec[4]) ^ 1) >> (8 * k));
        size_t off = (size_t)(b.sec[4] - thin), hdr = 64 + 6 * 24 + 8, ent = 64 + 3 * 24;
        kvt_wbuf_put(&bad, thin, tlen);
        CHECK(!bad.oom);
        memcpy(bad.p + off, digest, 8);
        uint64_t h = XXH3_64bits(digest, 8);
        for (int k = 0; k < 8; k++) bad.p[ent + 16 + k] = (uint8_t)(h >> (8 * k));
        h = XXH3_64bits(bad.p, hdr - 8);
        for (int k = 0; k < 8; k++) bad.p[hdr - 8 + k] = (uint8_t)(h >> (8 * k));
        kvt_session *r = NULL;
        CHECK_OK(kvt_session_new(&r, m, NULL));
        int rc = kvt_session_restore(r, bad.p, bad.len);
        CHECKF(rc == KVT_ECORRUPT && kvt_session_len(r) == 0, "a wrong state digest: rc %d: %s", rc, kvt_errmsg());
        kvt_snap_skip_state_digest = true;
        rc = kvt_session_restore(r, bad.p, bad.len);
        kvt_snap_skip_state_digest = false;
        CHECK_OK(rc);
        kvt_session_free(r);
        kvt_wbuf_free(&bad);
    }
    /* at 384 the logits bound the span, so the replay's own logits check
     * already refuses a replay one token short; a good restore into the
     * same session works afterwards */
    free(snap);
    free(thin);
    CHECK_OK(kvt_session_sync(s, t, 384, NULL));
    CHECK_OK(kvt_session_snapshot(s, &snap, &len));
    CHECK_OK(without_state(snap, len, &thin, &tlen));
    kvt_session *r = NULL;
    CHECK_OK(kvt_session_new(&r, m, NULL));
    kvt_ds4_fault = KVT_DS4_FAULT_REPLAY;
    kvt_snap_skip_state_digest = true;
    int rc = kvt_session_restore(r, thin, tlen);
    kvt_snap_skip_state_digest = false;
    kvt_ds4_fault = KVT_DS4_FAULT_NONE;
    CHECKF(rc == KVT_ECORRUPT && kvt_session_len(r) == 0, "rc %d: %s", rc, kvt_errmsg());
    CHECK_OK(kvt_session_restore(r, thin, tlen));
    kvt_session_free(r);
    free(snap);
    free(thin);
    kvt_session_free(s);
    kvt_model_close(m);
}

/* The same on ds4-mini, whose replay (1,017 tokens) runs in several chunks
 * and skips positions layer by layer. */
TEST(ds4_snapshot_replay_mini)
{
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_preset(&m, "ds4-mini", 1, NULL));
    enum { N = 1500 };
    int32_t *t = malloc(N * sizeof *t);
    CHECK(t);
    seqb(t, N, 37);
    CHECK(kvt_ds4_replay_tokens(m, 1300) == 1017);
    CHECKF(restore_equivalent_as(m, t, N, 1300, true), "replayed restore at 1300 differs");
    free(t);
    kvt_model_close(m);
}

/* The forward pass allocates nothing but the cache blocks its new rows take:
 * its scratch is the session's, sized from the context when the session is
 * made. ds4-mini at 2 threads, a prefill pass of 300 tokens past the point
 * where the indexer selects (more than K = 64 rows), then one decode step. */
TEST(ds4_forward_allocates_no_scratch)
{
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_preset(&m, "ds4-mini", 1, NULL));
    enum { N = 701 };
    int32_t t[N];
    seqb(t, N, 41);
    kvt_session *s = NULL;
    kvt_session_opts so = {.n_ctx = 2048, .n_threads = 2};
    CHECK_OK(kvt_session_new(&s, m, &so));
    bool ok = kvt_test_forward_no_scratch(s, t, 400);
    kvt_session_free(s);
    kvt_model_close(m);
    CHECKF(ok, "the forward pass allocated");
}

/* A file's indexer top-k is a size like any other: ds4-tiny written as GGUF
 * with ds4.indexer.top_k patched to 2^28 - 1 (what the fuzzer found: the
 * pass allocated chunk x K selection slots, 3.2 GB for three tokens) is
 * refused when it loads. */
TEST(ds4_load_refuses_huge_topk)
{
    kvt_model *m = tiny();
    CHECK(m);
    char dir[] = "/tmp/kvtier-topk-XXXXXX", path[64];
    CHECK(kvt_test_mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/tiny.gguf", dir);
    CHECK_OK(kvt_ds4_write_gguf(m, path));
    kvt_model_close(m);
    size_t len = 0;
    char *b = kvt_test_read_file(path, &len);
    CHECK(b);
    const char key[] = "deepseek4.attention.indexer.top_k";
    char *at = memmem(b, len, key, sizeof key - 1);
    CHECK(at && at + sizeof key - 1 + 8 <= b + len);
    uint32_t ty, k = (1u << 28) - 1;
    memcpy(&ty, at + sizeof key - 1, 4);
    CHECK(ty == 4); /* GGUF uint32 */
    memcpy(at + sizeof key - 1 + 4, &k, 4);
    FILE *f = fopen(path, "wb");
    CHECK(f && fwrite(b, 1, len, f) == len);
    fclose(f);
    free(b);
    kvt_model *bad = NULL;
    int rc = kvt_model_open(&bad, path);
    printf("    top-k 2^28 - 1: %s\n", rc ? kvt_errmsg() : "loaded");
    CHECKF(rc == KVT_EFORMAT && strstr(kvt_errmsg(), "top-k"), "the file loaded (%s)", kvt_strerror(rc));
    kvt_test_clear_dir(dir);
    rmdir(dir);
}
