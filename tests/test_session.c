/* Sessions (src/session/session.c) on ds4-tiny: a prompt that diverges goes
 * back to the last checkpoint before the divergence and computes what an
 * uninterrupted run does; a regeneration and a strict prefix too; a marked
 * position keeps a checkpoint off the grid (the start of a last turn). A
 * copy of a session shares its blocks: writes never reach a shared block,
 * and the RAM they hold counts once. */
#include "test.h"
#include "ds4_tiny.h"
#include "arch/model.h"
#include "session/snapshot.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

TEST(session_rollback_and_checkpoints)
{
    kvt_model *m = tiny();
    CHECK(m);
    enum { N = 2400, D = 2300 };
    int32_t a[N], b[N];
    seqb(a, N, 13);
    memcpy(b, a, sizeof a);
    for (size_t i = D; i < N; i++) b[i] = (int32_t)((a[i] + 3) % 256);
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    CHECK_OK(kvt_session_sync(s, a, N, NULL));
    /* Diverge at D: the session goes back to its checkpoint at 2048. */
    size_t reused = 0;
    CHECK_OK(kvt_session_sync(s, b, N, &reused));
    CHECKF(reused == 2048, "reused %zu (checkpoint at 2048 expected)", reused);
    state x = {0}, y = {0};
    CHECK_OK(capture(s, m, &x));
    CHECK_OK(run(m, b, N, NULL, 0, 1, &y));
    CHECK(equal(&x, &y));
    state_free(&x); state_free(&y);
    /* Regenerate: the same prompt after decoding reuses all of it, exactly. */
    CHECK_OK(kvt_session_decode(s, 65));
    CHECK_OK(kvt_session_decode(s, 66));
    CHECK_OK(kvt_session_sync(s, b, N, &reused));
    CHECKF(reused == N, "regenerate reused %zu of %d", reused, N);
    CHECK_OK(capture(s, m, &x));
    CHECK_OK(run(m, b, N, NULL, 0, 1, &y));
    CHECK(equal(&x, &y));
    state_free(&x); state_free(&y);
    /* A strict prefix off every checkpoint: recomputed from 2048, exact. */
    CHECK_OK(kvt_session_sync(s, b, 2100, &reused));
    CHECK(reused == 2048);
    CHECK_OK(capture(s, m, &x));
    CHECK_OK(run(m, b, 2100, NULL, 0, 1, &y));
    CHECK(equal(&x, &y));
    state_free(&x); state_free(&y);
    kvt_session_free(s);
    kvt_model_close(m);
}

TEST(session_marked_checkpoint)
{
    kvt_model *m = tiny();
    CHECK(m);
    enum { N = 900, MARK = 777 };
    int32_t a[N], b[N];
    seqb(a, N, 23);
    memcpy(b, a, sizeof a);
    for (size_t i = MARK + 1; i < N; i++) b[i] = (a[i] + 9) % 256; /* another last turn */
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    kvt_session_set_mark(s, MARK);
    CHECK_OK(kvt_session_sync(s, a, N, NULL));
    size_t reused = 0;
    CHECK_OK(kvt_session_sync(s, b, N, &reused));
    CHECKF(reused == MARK, "reused %zu, the mark is at %d", reused, MARK);
    state x = {0}, y = {0};
    CHECK_OK(capture(s, m, &x));
    CHECK_OK(run(m, b, N, NULL, 0, 1, &y));
    CHECK(equal(&x, &y));
    state_free(&x);
    state_free(&y);
    /* without a mark the same divergence goes back to the start (no grid point below 2048) */
    kvt_session_set_mark(s, 0);
    CHECK_OK(kvt_session_sync(s, a, N, &reused));
    CHECK(reused == MARK); /* the marked checkpoint is still there */
    kvt_session_free(s);
    CHECK_OK(kvt_session_new(&s, m, NULL));
    CHECK_OK(kvt_session_sync(s, a, N, NULL));
    CHECK_OK(kvt_session_sync(s, b, N, &reused));
    CHECK(reused == 0);
    kvt_session_free(s);
    kvt_model_close(m);
}

/* ---- copies share their blocks (kvt_session_clone, cache.h) ---- */

/* Tokens for model m: BOS-free ids in [3, n_vocab), seeded. */
static void ids_for(const kvt_model *m, int32_t *t, size_t n, uint64_t seed)
{
    kvt_model_info info;
    kvt_model_info_get(m, &info);
    for (size_t i = 0; i < n; i++) t[i] = (int32_t)(3 + kvt_test_rand(&seed) % (info.n_vocab - 3));
}

struct reader {
    const kvt_session *s;
    const uint8_t *want;
    size_t len;
    bool same;
};

/* On another thread: the copy's canonical bytes, as a store thread reads
 * a copy to save it, while its source goes on on the calling thread. */
static void *read_copy(void *p)
{
    struct reader *r = p;
    uint8_t *b = NULL;
    size_t n = 0;
    for (int k = 0; k < 4; k++) {
        r->same = kvt_session_cache_bytes(r->s, &b, &n) == KVT_OK && n == r->len && !memcmp(b, r->want, n);
        free(b);
        if (!r->same) break;
    }
    return NULL;
}

/* Whether stream st's block b is the same block in both caches. */
static bool same_block(const kvt_session *a, const kvt_session *b, size_t st, size_t blk)
{
    return a->cache->streams[st].held[blk] && a->cache->streams[st].held[blk] == b->cache->streams[st].held[blk];
}

/* B, a copy of A, is rolled back into a block they share (a checkpoint
 * marked there) and goes on with other tokens; A goes on with its own
 * first (writing into the partial block they share) while a third copy is
 * read on another thread. Every session ends with the bits of its own
 * uninterrupted run, and the blocks neither wrote stay shared. With the
 * copy-on-write skipped (kvt_cache_fault) A's bytes change: returns false. */
static bool clone_writes(kvt_model *m, const char *what, bool fault)
{
    enum { N0 = 300, D = 200, NA = 420, NB = 380 };
    int32_t a[NA], b[NB];
    ids_for(m, a, NA, 101);
    memcpy(b, a, D * sizeof *b);
    ids_for(m, b + D, NB - D, 102);
    kvt_session *A = NULL, *B = NULL, *C = NULL;
    bool ok = false;
    if (kvt_session_new(&A, m, NULL) || kvt_session_new(&B, m, NULL) || kvt_session_new(&C, m, NULL)) goto out;
    kvt_session_set_mark(A, D); /* a checkpoint at D, inside block 1 */
    if (kvt_session_sync(A, a, N0, NULL) || kvt_session_clone(B, A) || kvt_session_clone(C, A)) goto out;
    size_t nst = A->cache->n_streams, shared = 0;
    for (size_t st = 0; st < nst; st++)
        for (size_t k = 0; k < 3; k++) shared += same_block(A, B, st, k) && same_block(A, C, st, k);
    uint8_t *cb = NULL;
    size_t cl = 0;
    if (kvt_session_cache_bytes(C, &cb, &cl)) goto out;
    struct reader r = {C, cb, cl, false};
    pthread_t th;
    if (pthread_create(&th, NULL, read_copy, &r)) { free(cb); goto out; }
    kvt_cache_fault = fault ? KVT_CACHE_FAULT_WRITE_SHARED : 0;
    size_t reused = 0;
    int rc = kvt_session_sync(A, a, NA, NULL);
    pthread_join(th, NULL);
    free(cb);
    kvt_session_free(C); /* freed after its reader, its blocks still in A and B */
    C = NULL;
    if (!rc) rc = kvt_session_sync(B, b, NB, &reused);
    kvt_cache_fault = 0;
    if (rc) goto out;
    uint64_t da = kvt_test_digest(A, m), db = kvt_test_digest(B, m);
    uint64_t ta = kvt_test_twin(m, a, NA), tb = kvt_test_twin(m, b, NB);
    bool still = true; /* block 0: neither wrote it */
    for (size_t st = 0; st < nst; st++) still &= !A->cache->streams[st].held[0] || same_block(A, B, st, 0);
    printf("    %s%s: %zu blocks shared by 3, B reused %zu, copy read on a thread %s, A %s, B %s, block 0 %s\n", what,
           fault ? " (no copy-on-write)" : "", shared, reused, r.same ? "intact" : "CHANGED",
           da == ta ? "exact" : "DIFFERS", db == tb ? "exact" : "DIFFERS", still ? "still shared" : "not shared");
    ok = shared >= nst && reused == D && r.same && da == ta && db == tb && still;
out:
    kvt_cache_fault = 0;
    kvt_session_free(A);
    kvt_session_free(B);
    kvt_session_free(C);
    return ok;
}

TEST(session_clone_copy_on_write)
{
    kvt_model *m = tiny();
    CHECK(m);
    CHECKF(clone_writes(m, "ds4-tiny", false), "ds4-tiny: %s", kvt_errmsg());
    CHECKF(!clone_writes(m, "ds4-tiny", true), "ds4-tiny: writing into a shared block went unnoticed");
    kvt_model_close(m);
    const char *p = kvt_test_shared("models/stories260K.gguf");
    if (!p) SKIP("../shared absent: the llama half (stories260K) did not run");
    const kvt_row_type types[] = {KVT_ROWS_DEFAULT, KVT_ROWS_F32};
    for (size_t i = 0; i < 2; i++) {
        CHECK_OK(kvt_model_open(&m, p));
        CHECK_OK(kvt_model_set_cache_types(m, types[i], types[i]));
        char what[64];
        snprintf(what, sizeof what, "stories260K %s rows", kvt_row_type_name(types[i]));
        CHECKF(clone_writes(m, what, false), "%s: %s", what, kvt_errmsg());
        CHECKF(!clone_writes(m, what, true), "%s: writing into a shared block went unnoticed", what);
        kvt_model_close(m);
    }
}

/* The rows' bytes the caches hold, counted once per block (each distinct
 * block header), and the sum of the caches' kvt_cache_bytes_held less
 * what each holds besides blocks. */
static void rows_counted(kvt_session *const *s, size_t k, double *distinct, double *held)
{
    *distinct = *held = 0;
    const kvt_block *seen[4096];
    size_t n_seen = 0;
    for (size_t i = 0; i < k; i++) {
        const kvt_cache *c = s[i]->cache;
        size_t other = sizeof *c + c->state_bytes + c->n_streams * sizeof *c->streams + c->spare_bytes +
                       (c->max_tokens + KVT_BLOCK - 1) / KVT_BLOCK * sizeof *c->keys;
        for (size_t st = 0; st < c->n_streams; st++) {
            other += c->streams[st].n_blocks *
                     (c->streams[st].pages_per_block * sizeof *c->streams[st].pages + sizeof *c->streams[st].held);
            for (size_t b = 0; b < c->streams[st].n_blocks; b++)
                for (const kvt_block *h = c->streams[st].held[b]; h; h = h->base) { /* and the blocks it reads */
                    bool dup = false;
                    for (size_t j = 0; j < n_seen && !dup; j++) dup = seen[j] == h;
                    if (dup || n_seen == 4096) continue;
                    seen[n_seen++] = h;
                    *distinct += (double)h->bytes + (h->arena ? 0 : KVT_BLOCK_ROWS_AT);
                }
        }
        *held += (double)(kvt_cache_bytes_held(c) - other);
    }
}

/* 2 and 8 copies of a 1,000-token session hold about the rows of one: the
 * RAM budget's count (kvt_session_bytes) sums to 1x the rows, not 3x or 9x,
 * while counting each copy's blocks in full (what the budget did when
 * every copy had its own rows) gives 3x and 9x. Each block counts once
 * over the sessions that hold it, also as the copies write (a partial
 * block copied) and go. */
TEST(session_clone_ram_counts_once)
{
    kvt_model *m = tiny();
    CHECK(m);
    enum { N = 1000 };
    int32_t t[N + 4];
    seqb(t, N + 4, 31);
    kvt_session *s[9] = {0};
    CHECK_OK(kvt_session_new(&s[0], m, NULL));
    CHECK_OK(kvt_session_sync(s[0], t, N, NULL));
    double one, held, distinct;
    rows_counted(s, 1, &one, &held);
    CHECK(held == one);
    size_t alone = kvt_session_bytes(s[0]);
    double fixed = (double)alone - one; /* what a session holds besides rows: a copy's too (its checkpoints' buffers may be sized a little otherwise) */
    for (size_t k = 2; k <= 8; k += 6) {
        for (size_t i = 1; i <= k; i++) {
            if (!s[i]) CHECK_OK(kvt_session_new(&s[i], m, NULL));
            CHECK_OK(kvt_session_clone(s[i], s[0]));
        }
        double sum = 0, full = 0;
        for (size_t i = 0; i <= k; i++) {
            sum += (double)kvt_session_bytes(s[i]);
            full += (double)kvt_cache_bytes_allocated(s[i]->cache) - (double)s[i]->cache->state_bytes;
        }
        full *= one / ((double)kvt_cache_bytes_allocated(s[0]->cache) - (double)s[0]->cache->state_bytes);
        rows_counted(s, k + 1, &distinct, &held);
        double extra = sum - (double)alone; /* what the k copies add to the budget's count */
        /* the source's own figure does not move with its copies (a tenant's
         * RAM figure with its save copies: /metrics) */
        CHECKF(kvt_session_bytes(s[0]) == alone, "%zu copies moved the source's count from %zu to %zu", k, alone,
               kvt_session_bytes(s[0]));
        printf("    1 session + %zu copies of %d tokens: rows counted %.2fx one session's (%.0f of %.0f bytes; "
               "in full per copy %.2fx); each copy adds %.0f bytes (%.0f besides rows)\n",
               k, N, held / one, held, one, full / one, extra / (double)k, fixed);
        CHECKF(distinct == one && held >= one - (double)k && held <= one + (double)k + 1,
               "%zu copies: rows counted %.0f, held once %.0f, one session's %.0f", k, held, distinct, one);
        CHECK(full >= (double)(k + 1) * one - 1); /* the check above would fail on a count per copy */
        CHECKF(extra <= (double)k * (1.01 * fixed + 0.02 * one), "each copy adds %.0f bytes: %.0f besides rows, %.0f rows",
               extra / (double)k, fixed, one);
    }
    /* the copies write: each takes its own copy of the page it writes of
     * the partial block (the rest of it read from the source's), and the
     * count goes up by that page each (4 tokens: DeepSeek-V4's rows of
     * ratio 4 are written every fourth) */
    for (size_t i = 1; i <= 8; i++)
        for (size_t j = 0; j < 4; j++) CHECK_OK(kvt_session_decode(s[i], t[N + j]));
    rows_counted(s, 9, &distinct, &held);
    double blk = 0, pg = 0;
    for (size_t st = 0; st < s[0]->cache->n_streams; st++) {
        const kvt_block *h0 = s[0]->cache->streams[st].held[N / KVT_BLOCK], *h1 = s[1]->cache->streams[st].held[N / KVT_BLOCK];
        if (h0) blk += (double)h0->bytes + KVT_BLOCK_ROWS_AT;
        if (h1 && h1 != h0) {
            CHECK(h1->base == h0 && h1->n_pages == 1); /* one page of its own, the rest read from the source's */
            pg += (double)h1->bytes + KVT_BLOCK_ROWS_AT;
        }
    }
    printf("    after 4 tokens each: %.2fx (a page of %.0f bytes copied by each copy, of a partial block of %.0f; %.0f "
           "counted, %.0f held once)\n", held / one, pg, blk, held, distinct);
    CHECK(pg > 0 && pg < blk / 4 && distinct == one + 8 * pg && held >= distinct - 9 && held <= distinct + 10);
    /* the source goes: its rows are the copies' now, counted once (its
     * partial block too: the copies read it) */
    kvt_session_free(s[0]);
    s[0] = NULL;
    rows_counted(s + 1, 8, &distinct, &held);
    CHECK(held >= distinct - 8 && held <= distinct + 9 && distinct == one + 8 * pg);
    for (size_t i = 1; i < 8; i++) kvt_session_free(s[i]);
    rows_counted(s + 8, 1, &distinct, &held);
    CHECK(held >= distinct - 1 && held <= distinct + 1 && distinct == one + pg);
    kvt_session_free(s[8]);
    kvt_model_close(m);
}

/* Blocks of an arena (a load's one allocation) shared with a copy: the
 * arena outlives the cache that made it, goes with the last block any
 * cache holds, and counts once. */
TEST(session_clone_arena_outlives_its_cache)
{
    const uint32_t spec[2][2] = {{64, 32}, {16, 1}};
    kvt_cache *a = kvt_cache_new(2, spec, 8 * KVT_BLOCK, 0), *b = kvt_cache_new(2, spec, 8 * KVT_BLOCK, 0);
    CHECK(a && b);
    CHECK_OK(kvt_cache_reserve(a, 8));
    kvt_arena *ar = a->streams[0].held[0]->arena;
    for (size_t sx = 0; sx < 2; sx++)
        for (size_t r = 0; r < kvt_cache_rows_for(a, sx, 8 * KVT_BLOCK); r++)
            memset(kvt_cache_row(a, sx, r), (int)(r * 5 + sx), spec[sx][0]);
    size_t alone = kvt_cache_bytes_held(a);
    CHECK_OK(kvt_cache_share(b, a, 8 * KVT_BLOCK));
    size_t ha = kvt_cache_bytes_held(a), hb = kvt_cache_bytes_held(b), own = alone - ar->bytes - sizeof *ar - 16 * sizeof *ar->blk;
    printf("    one cache %zu bytes; shared, %zu + %zu\n", alone, ha, hb);
    CHECK(ha + hb <= alone + own + 1 && ha + hb + 1 >= alone + own);
    /* a writes block 1 of stream 0: its own copy; b still reads the arena's */
    memset(kvt_cache_row(a, 0, 40), 0xee, spec[0][0]);
    CHECK(a->streams[0].held[1]->arena == NULL && b->streams[0].held[1]->arena == ar);
    CHECK(((const uint8_t *)kvt_cache_row_ro(b, 0, 40))[0] == (uint8_t)(40 * 5));
    kvt_cache_free(a); /* the arena stays: b holds its blocks */
    CHECK(ar->live == 16);
    for (size_t sx = 0; sx < 2; sx++)
        for (size_t r = 0; r < kvt_cache_rows_for(b, sx, 8 * KVT_BLOCK); r++)
            CHECKF(((const uint8_t *)kvt_cache_row_ro(b, sx, r))[spec[sx][0] - 1] == (uint8_t)(r * 5 + sx),
                   "row %zu of stream %zu after its arena's cache went", r, sx);
    kvt_cache_truncate(b, 1 * KVT_BLOCK); /* 2 of 16 left: they move out, and the arena goes (ASan: no leak) */
    CHECK(!b->streams[0].held[0]->arena && !b->streams[1].held[0]->arena && !b->spare);
    CHECK(((const uint8_t *)kvt_cache_row_ro(b, 0, 31))[0] == (uint8_t)(31 * 5));
    kvt_cache_free(b);
}
