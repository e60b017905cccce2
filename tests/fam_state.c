/* The proofs a llama-family cache's fixed state must pass (fam_state.h),
 * shared by tests/test_window.c (gemma's window rings) and
 * tests/test_deltanet.c (qwen35's recurrent state). */
#include "fam_state.h"
#include "test.h"
#include "arch/model.h"
#include "arch/llama.h"
#include "session/snapshot.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { W = FAM_GEMMA_SWA };

/* The synthetic model f in dir (written once per test), or NULL: the test
 * is skipped (../shared/vocab absent) or has failed (the model could not be
 * written or loaded; the message says why). */
kvt_model *fam_open(const fam_spec *f, char *dir, char *path, size_t cap)
{
    const char *vocab = kvt_test_shared("vocab/ggml-vocab-llama-spm.gguf");
    if (!vocab) { kvt_test_skip("../shared/vocab absent"); return NULL; }
    char v[1024];
    snprintf(v, sizeof v, "%s", vocab);
    if (!kvt_test_mkdtemp(dir)) { kvt_test_fail(__FILE__, __LINE__, "mkdtemp %s: %s", dir, strerror(errno)); return NULL; }
    snprintf(path, cap, "%s/%s.gguf", dir, f->arch);
    kvt_model *m = NULL;
    int rc = fam_write(path, v, 5, FAM_ROPE_BASE, f, false);
    if (rc) kvt_test_fail(__FILE__, __LINE__, "writing %s: %s: %s", path, kvt_strerror(rc), kvt_errmsg());
    else if ((rc = kvt_model_open(&m, path)))
        kvt_test_fail(__FILE__, __LINE__, "loading %s: %s: %s", path, kvt_strerror(rc), kvt_errmsg());
    if (rc) { unlink(path); rmdir(dir); }
    return m;
}

void fam_close(kvt_model *m, const char *dir, const char *path)
{
    kvt_model_close(m);
    unlink(path);
    rmdir(dir);
}

/* BOS then ids from a seed. */
void fam_prompt(int32_t *t, size_t n, uint64_t seed)
{
    t[0] = 1;
    for (size_t i = 1; i < n; i++) t[i] = (int32_t)(3 + kvt_test_rand(&seed) % 31000);
}

/* A snapshot of t[0..k), restored into a new session: the same digest as
 * the session it came from, and t[0..n) run on from it the digest of one
 * uninterrupted run (want). */
static bool restore_exact(kvt_model *m, const int32_t *t, size_t n, size_t k, uint64_t want)
{
    kvt_session *a = NULL, *b = NULL;
    uint8_t *snap = NULL;
    size_t len = 0, reused = 0;
    bool ok = !kvt_session_new(&a, m, NULL) && !kvt_session_sync(a, t, k, NULL) &&
              !kvt_session_snapshot(a, &snap, &len) && !kvt_session_new(&b, m, NULL) &&
              !kvt_session_restore(b, snap, len) && kvt_session_len(b) == k &&
              kvt_test_digest(a, m) == kvt_test_digest(b, m) && !kvt_session_sync(b, t, n, &reused) &&
              reused == k && kvt_test_digest(b, m) == want;
    kvt_session_free(a);
    kvt_session_free(b);
    free(snap);
    return ok;
}

const fam_rows fam_rows_more[4] = {
    {KVT_ROWS_F32, KVT_ROWS_F32}, {KVT_ROWS_BF16, KVT_ROWS_BF16}, {KVT_ROWS_Q8_0, KVT_ROWS_Q8_0},
    {KVT_ROWS_Q8_0, KVT_ROWS_F16}};

kvt_model *fam_reopen(const char *path, fam_rows r)
{
    kvt_model *m = NULL;
    int rc = kvt_model_open(&m, path);
    if (!rc) rc = kvt_model_set_cache_types(m, r.k, r.v);
    if (rc) {
        kvt_test_fail(__FILE__, __LINE__, "%s with %s/%s rows: %s: %s", path, kvt_row_type_name(r.k),
                      kvt_row_type_name(r.v), kvt_strerror(rc), kvt_errmsg());
        kvt_model_close(m);
        return NULL;
    }
    printf("    K rows %s, V rows %s\n", kvt_row_type_name(r.k), kvt_row_type_name(r.v));
    return m;
}

/* t[0..k) saved to a disk store in a new directory, the store closed and
 * opened again, restored from it into a new session and run on to n: the
 * digest of one uninterrupted run (want). */
static bool disk_exact(kvt_model *m, const int32_t *t, size_t n, size_t k, uint64_t want)
{
    char dir[] = "/tmp/kvtier-famstore-XXXXXX", cmd[96];
    if (!kvt_test_mkdtemp(dir)) return false;
    kvt_store *st = NULL;
    kvt_session *a = NULL, *b = NULL;
    size_t reused = 0;
    bool ok = !kvt_store_open(&st, dir, 0) && !kvt_session_new(&a, m, NULL) && !kvt_session_sync(a, t, k, NULL) &&
              !kvt_store_save(st, a, k, "manual", NULL);
    kvt_store_close(st);
    st = NULL;
    ok = ok && !kvt_store_open(&st, dir, 0) && !kvt_session_new(&b, m, NULL) &&
         !kvt_store_restore_prefix(st, b, t, n, &reused) && reused == k && !kvt_session_sync(b, t, n, NULL) &&
         kvt_test_digest(b, m) == want;
    if (!ok) printf("    disk round trip at %zu: reused %zu, then the run differs or fails\n", k, reused);
    kvt_store_close(st);
    kvt_session_free(a);
    kvt_session_free(b);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) ok = false;
    return ok;
}

/* Snapshots at positions around the window's edge restored and run on
 * (restore_exact), one through a disk store (disk_exact), and the negative
 * controls. */
void fam_restore_all(kvt_model *m, bool light)
{
    enum { N = 420, N_LIGHT = 300 };
    size_t n = light ? N_LIGHT : N;
    int32_t t[N];
    fam_prompt(t, n, 3);
    uint64_t want = kvt_test_twin(m, t, n);
    /* around the edge of the window and of the ring's wraps, and past the
     * 256-token chunk that overwrites a whole ring in one pass */
    const size_t all[] = {1, 2, W - 1, W, W + 1, 2 * W - 1, 2 * W, 2 * W + 1, 3 * W + 5, 255, 256, 257, 300, N - 1};
    const size_t some[] = {W - 1, W + 1, 2 * W + 1, 257};
    const size_t *ks = light ? some : all;
    size_t ok = 0, nk = light ? sizeof some / sizeof *some : sizeof all / sizeof *all;
    for (size_t i = 0; i < nk; i++) {
        bool e = restore_exact(m, t, n, ks[i], want);
        if (!e) printf("    restore at %zu differs from the uninterrupted run\n", ks[i]);
        ok += e;
    }
    printf("    %zu of %zu restore positions give the uninterrupted run's bits\n", ok, nk);
    CHECK(ok == nk);
    CHECKF(disk_exact(m, t, n, 2 * W + 1, want), "a session through a disk store differs from the uninterrupted run");
    /* Negative control: a ring restored with one value off. */
    kvt_llama_fault = KVT_LLAMA_FAULT_RING;
    bool caught = !restore_exact(m, t, n, W + 1, want) && !restore_exact(m, t, n, 257, want);
    kvt_llama_fault = KVT_LLAMA_FAULT_NONE;
    CHECKF(caught, "a ring restored wrong went unnoticed");
    /* K's and V's row types crossed when a ring is loaded: seen where they
     * differ (the rings' rows are then of two sizes) */
    if (m->type_k != m->type_v && ((const kvt_llama_weights *)m->weights)->n_ring) {
        kvt_llama_fault = KVT_LLAMA_FAULT_RING_TYPES;
        caught = !restore_exact(m, t, n, W + 1, want) && !disk_exact(m, t, n, 2 * W + 1, want);
        kvt_llama_fault = KVT_LLAMA_FAULT_NONE;
        printf("    control, a ring loaded with K's and V's types crossed: %s\n", caught ? "caught" : "missed");
        CHECKF(caught, "a ring loaded with K's and V's row types crossed went unnoticed");
    }
}

/* fam_checkpoints on m; control: with KVT_LLAMA_FAULT_RING, which must
 * be caught. */
static void checkpoints(kvt_model *m, bool control)
{
    /* checkpoints every 128 tokens, so that going back lands inside
     * positions whose rings are long overwritten */
    enum { N = 460, D = 330, I = 128 };
    int32_t a[N], b[N];
    fam_prompt(a, N, 7);
    memcpy(b, a, sizeof a);
    for (size_t i = D; i < N; i++) b[i] = (int32_t)(3 + (a[i] + 11) % 31000);
    kvt_session_opts so = {.checkpoint_interval = I};
    kvt_llama_fault = control ? KVT_LLAMA_FAULT_RING : KVT_LLAMA_FAULT_NONE;
    kvt_session *s = NULL;
    size_t reused = 0;
    bool exact = true;
    CHECK_OK(kvt_session_new(&s, m, &so));
    CHECK_OK(kvt_session_sync(s, a, N, NULL));
    /* diverge at D: back to the checkpoint at 256 */
    CHECK_OK(kvt_session_sync(s, b, N, &reused));
    CHECKF(reused == 256, "diverging at %d reused %zu (the checkpoint at 256 expected)", D, reused);
    exact &= kvt_test_digest(s, m) == kvt_test_twin(m, b, N);
    /* regenerate after decoding: the same prompt again reuses all of it */
    CHECK_OK(kvt_session_decode(s, 100));
    CHECK_OK(kvt_session_decode(s, 200));
    CHECK_OK(kvt_session_sync(s, b, N, &reused));
    CHECKF(reused == N, "regenerating reused %zu of %d", reused, N);
    exact &= kvt_test_digest(s, m) == kvt_test_twin(m, b, N);
    /* a strict prefix off every checkpoint, one past the window's edge
     * of a checkpoint: recomputed from 128 */
    CHECK_OK(kvt_session_sync(s, b, I + W + 1, &reused));
    CHECKF(reused == I, "a prefix of %d reused %zu (%d expected)", I + W + 1, reused, I);
    exact &= kvt_test_digest(s, m) == kvt_test_twin(m, b, I + W + 1);
    kvt_session_free(s);
    kvt_llama_fault = KVT_LLAMA_FAULT_NONE;
    if (!control) CHECKF(exact, "going back to a checkpoint is not the uninterrupted run");
    else CHECKF(!exact, "control: a checkpoint restored wrong went unnoticed");
}

void fam_checkpoints(const fam_spec *f)
{
    char dir[] = "/tmp/kvtier-window-XXXXXX", path[96];
    kvt_model *m = fam_open(f, dir, path, sizeof path);
    if (!m) return;
    for (int control = 0; control < 2 && !kvt_test_failed(); control++) checkpoints(m, control);
    kvt_model_close(m);
    for (size_t r = 0; r < sizeof fam_rows_more / sizeof *fam_rows_more && !kvt_test_failed(); r++) {
        m = fam_reopen(path, fam_rows_more[r]);
        if (m) checkpoints(m, false);
        kvt_model_close(m);
    }
    unlink(path);
    rmdir(dir);
}

void fam_damaged_state(const fam_spec *f)
{
    char dir[] = "/tmp/kvtier-window-XXXXXX", path[96];
    kvt_model *m = fam_open(f, dir, path, sizeof path);
    if (!m) return;
    enum { N = 200 };
    int32_t t[N];
    fam_prompt(t, N, 9);
    kvt_session *a = NULL, *b = NULL;
    uint8_t *snap = NULL;
    size_t len = 0;
    CHECK_OK(kvt_session_new(&a, m, NULL));
    CHECK_OK(kvt_session_sync(a, t, N, NULL));
    CHECK_OK(kvt_session_snapshot(a, &snap, &len));
    CHECK_OK(kvt_session_new(&b, m, NULL));
    /* every byte flipped in turn would take long; a flip in each eighth
     * of the record, and the record cut at each eighth: all refused, the
     * session left empty */
    size_t refused = 0, tried = 0;
    for (int i = 1; i < 8; i++) {
        size_t at = len * (size_t)i / 8;
        snap[at] ^= 0x10;
        tried++;
        if (kvt_session_restore(b, snap, len) != KVT_OK && kvt_session_len(b) == 0) refused++;
        snap[at] ^= 0x10;
        tried++;
        if (kvt_session_restore(b, snap, at) != KVT_OK && kvt_session_len(b) == 0) refused++;
    }
    /* a record stored without its state (the disk tier's thin form): the
     * rings cannot be rebuilt from the rows, so it is refused by name */
    kvt_snap_info in;
    kvt_wbuf thin = {0};
    CHECK_OK(kvt_snap_parse_raw(snap, len, &in));
    CHECK_OK(kvt_snap_without_state(snap, in.rec_len, &thin));
    if (in.nsec == 7) {
        /* a recurrent state (version 5, or 6 with rows of a cache type) is
         * never dropped: the thin form is not made; one forged anyway
         * (version 4, or 6 with its types, a digest for the state, no
         * recurrent section) is refused the same way */
        CHECK(thin.len == 0);
        uint8_t digest[8] = {0};
        in.sec[4] = digest;
        in.sec_len[4] = 8;
        size_t fl = 0;
        uint32_t v = in.version == KVT_SNAP_VERSION_TYPED ? KVT_SNAP_VERSION_TYPED : KVT_SNAP_VERSION_REPLAY;
        uint8_t *forged = kvt_test_repack(snap, len, v, in.flags | KVT_SNAP_REPLAY, 6, in.sec, in.sec_len, &fl);
        CHECK(forged);
        kvt_wbuf_put(&thin, forged, fl);
        free(forged);
    } else {
        CHECK(thin.len > 0 && !thin.oom);
        kvt_wbuf_put(&thin, snap + in.rec_len, len - in.rec_len);
    }
    tried++;
    int rc = kvt_session_restore(b, thin.p, thin.len);
    if (rc == KVT_EFORMAT && strstr(kvt_errmsg(), "without its state") && kvt_session_len(b) == 0) refused++;
    else printf("    a record without its state: %s\n", kvt_errmsg());
    kvt_wbuf_free(&thin);
    printf("    %zu of %zu damaged records refused\n", refused, tried);
    CHECK(refused == tried);
    CHECK_OK(kvt_session_restore(b, snap, len));
    CHECK(kvt_test_digest(a, m) == kvt_test_digest(b, m));
    kvt_session_free(a);
    kvt_session_free(b);
    free(snap);
    fam_close(m, dir, path);
}
