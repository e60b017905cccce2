/* The window ring entry class of the llama family (src/arch/llama.c): gemma3's
 * window layers keep only their last sliding_window K and V rows, in a ring
 * in the session's fixed state, while its global layers keep full rows.
 * Everything a session does with its state must give the bits of one
 * uninterrupted run, at every position around the window's edge:
 *
 *   window_snapshot_restore   a snapshot at k, restored into a new session
 *                             and run on, equals the uninterrupted run
 *   window_checkpoints        a prompt that diverges from the one a session
 *                             holds goes back to a checkpoint and is exact;
 *                             so is a strict prefix and a regeneration
 *   window_snapshot_layout    the record's streams, rows and state section
 *                             are the sizes docs/FORMAT.md gives, and its
 *                             state is the rings in logical order
 *   window_damaged_state      damaged and truncated records, and a record
 *                             stored without its state (the rings cannot be
 *                             rebuilt from the rows), are refused and leave
 *                             the session empty
 *
 * (Chunk schedules and thread counts: llama_family_invariance; the disk
 * tier across processes: store_persist_round_trip_gemma3.) The model is the
 * synthetic gemma3 of tests/synth_family.h: 4 layers, every other one a
 * 64-token window; window_snapshot_restore_gemma4 runs the first check on
 * its gemma4 (per-layer row lengths, shared layers). Negative controls use KVT_LLAMA_FAULT_RING, which
 * restores a ring with one value off: each check must then fail. */
#include "test.h"
#include "arch/model.h"
#include "arch/llama.h"
#include "session/snapshot.h"
#include "synth_family.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { W = FAM_GEMMA_SWA };

static const fam_spec gemma3 = {"gemma3", false, true, FAM_HEAD_DIM, false, false, true};
static const fam_spec gemma4 = {"gemma4", .gemma4 = FAM_G4_DENSE};
static const fam_spec qwen35 = {"qwen35", .qwen35 = FAM_Q35_DENSE};
static const fam_spec qwen35moe = {"qwen35moe", .qwen35 = FAM_Q35_MOE};

/* The synthetic model f in dir (written once per test), or NULL: the test
 * is skipped (../shared/vocab absent) or has failed (the model could not be
 * written or loaded; the message says why). */
static kvt_model *fam_open(const fam_spec *f, char *dir, char *path, size_t cap)
{
    const char *vocab = kvt_test_shared("vocab/ggml-vocab-llama-spm.gguf");
    if (!vocab) { kvt_test_skip("../shared/vocab absent"); return NULL; }
    char v[1024];
    snprintf(v, sizeof v, "%s", vocab);
    if (!mkdtemp(dir)) { kvt_test_fail(__FILE__, __LINE__, "mkdtemp %s: %s", dir, strerror(errno)); return NULL; }
    snprintf(path, cap, "%s/%s.gguf", dir, f->arch);
    kvt_model *m = NULL;
    int rc = fam_write(path, v, 5, FAM_ROPE_BASE, f, false);
    if (rc) kvt_test_fail(__FILE__, __LINE__, "writing %s: %s: %s", path, kvt_strerror(rc), kvt_errmsg());
    else if ((rc = kvt_model_open(&m, path)))
        kvt_test_fail(__FILE__, __LINE__, "loading %s: %s: %s", path, kvt_strerror(rc), kvt_errmsg());
    if (rc) { unlink(path); rmdir(dir); }
    return m;
}

static kvt_model *gemma_open(char *dir, char *path, size_t cap) { return fam_open(&gemma3, dir, path, cap); }

static void gemma_close(kvt_model *m, const char *dir, const char *path)
{
    kvt_model_close(m);
    unlink(path);
    rmdir(dir);
}

/* BOS then ids from a seed. */
static void prompt(int32_t *t, size_t n, uint64_t seed)
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

/* Snapshots at positions around the window's edge restored and run on
 * (restore_exact), and the negative control. */
static void restore_all(kvt_model *m)
{
    enum { N = 420 };
    int32_t t[N];
    prompt(t, N, 3);
    uint64_t want = kvt_test_twin(m, t, N);
    /* around the edge of the window and of the ring's wraps, and past the
     * 256-token chunk that overwrites a whole ring in one pass */
    const size_t ks[] = {1, 2, W - 1, W, W + 1, 2 * W - 1, 2 * W, 2 * W + 1, 3 * W + 5, 255, 256, 257, 300, N - 1};
    size_t ok = 0, nk = sizeof ks / sizeof *ks;
    for (size_t i = 0; i < nk; i++) {
        bool e = restore_exact(m, t, N, ks[i], want);
        if (!e) printf("    restore at %zu differs from the uninterrupted run\n", ks[i]);
        ok += e;
    }
    printf("    %zu of %zu restore positions give the uninterrupted run's bits\n", ok, nk);
    CHECK(ok == nk);
    /* Negative control: a ring restored with one value off. */
    kvt_llama_fault = KVT_LLAMA_FAULT_RING;
    bool caught = !restore_exact(m, t, N, W + 1, want) && !restore_exact(m, t, N, 300, want);
    kvt_llama_fault = KVT_LLAMA_FAULT_NONE;
    CHECKF(caught, "a ring restored wrong went unnoticed");
}

TEST(window_snapshot_restore)
{
    char dir[] = "/tmp/kvtier-window-XXXXXX", path[96];
    kvt_model *m = gemma_open(dir, path, sizeof path);
    if (!m) return;
    kvt_plan p;
    CHECK_OK(kvt_model_plan(m, 4096, &p));
    /* 2 window layers of (2, 64, 2 heads * 64) f32; 2 global layers' full rows */
    uint64_t win = kvt_plan_bytes(&p, "window"), full = kvt_plan_bytes(&p, "full rows");
    CHECKF(win == 2 * 2 * W * 128 * 4 && full == 4096ull * 2 * 2 * 128 * 4, "plan: window %llu, full %llu",
           (unsigned long long)win, (unsigned long long)full);
    restore_all(m);
    gemma_close(m, dir, path);
}

/* The same on gemma4 (synth_family.h): its window layers' rows are 256
 * floats, its global layers' 128, and its two shared layers (one window,
 * one global) keep nothing, reading the rings and rows of layers 2 and 3. */
TEST(window_snapshot_restore_gemma4)
{
    char dir[] = "/tmp/kvtier-window-XXXXXX", path[96];
    kvt_model *m = fam_open(&gemma4, dir, path, sizeof path);
    if (!m) return;
    kvt_plan p;
    CHECK_OK(kvt_model_plan(m, 4096, &p));
    /* 2 window layers of (2, 64, 4 heads * 64) f32; 2 global layers' full rows of 1 head * 128 */
    uint64_t win = kvt_plan_bytes(&p, "window"), full = kvt_plan_bytes(&p, "full rows");
    CHECKF(win == 2 * 2 * W * 256 * 4 && full == 4096ull * 2 * 2 * 128 * 4, "plan: window %llu, full %llu",
           (unsigned long long)win, (unsigned long long)full);
    restore_all(m);
    gemma_close(m, dir, path);
}

static void checkpoints(const fam_spec *f)
{
    char dir[] = "/tmp/kvtier-window-XXXXXX", path[96];
    kvt_model *m = fam_open(f, dir, path, sizeof path);
    if (!m) return;
    /* checkpoints every 128 tokens, so that going back lands inside
     * positions whose rings are long overwritten */
    enum { N = 460, D = 330, I = 128 };
    int32_t a[N], b[N];
    prompt(a, N, 7);
    memcpy(b, a, sizeof a);
    for (size_t i = D; i < N; i++) b[i] = (int32_t)(3 + (a[i] + 11) % 31000);
    kvt_session_opts so = {.checkpoint_interval = I};
    for (int control = 0; control < 2; control++) {
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
    gemma_close(m, dir, path);
}

TEST(window_checkpoints) { checkpoints(&gemma3); }

static void damaged_state(const fam_spec *f)
{
    char dir[] = "/tmp/kvtier-window-XXXXXX", path[96];
    kvt_model *m = fam_open(f, dir, path, sizeof path);
    if (!m) return;
    enum { N = 200 };
    int32_t t[N];
    prompt(t, N, 9);
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
    if (in.version == KVT_SNAP_VERSION_RECURRENT) {
        /* a recurrent state is never dropped: the thin form is not made;
         * one forged anyway (version 4, a digest for the state, no
         * recurrent section) is refused the same way */
        CHECK(thin.len == 0);
        uint8_t digest[8] = {0};
        in.sec[4] = digest;
        in.sec_len[4] = 8;
        size_t fl = 0;
        uint8_t *forged = kvt_test_repack(snap, len, KVT_SNAP_VERSION_REPLAY, in.flags | KVT_SNAP_REPLAY, 6, in.sec,
                                          in.sec_len, &fl);
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
    gemma_close(m, dir, path);
}

TEST(window_damaged_state) { damaged_state(&gemma3); }

/* The same proofs for qwen35's Gated DeltaNet layers (synth_family.h: 8
 * layers, 6 of them recurrent, 2 gated attention layers), whose state is
 * their convolution and delta-rule state: snapshots at the positions above
 * (on and off the 128-token grid) restored and run on to 420 equal the
 * uninterrupted run, checkpoints every 128 tokens give back exact earlier
 * positions, damaged or stateless records are refused; with the state
 * restored one value off (KVT_LLAMA_FAULT_RING) each check fails. */
TEST(recurrent_snapshot_restore)
{
    const fam_spec *fs[2] = {&qwen35, &qwen35moe};
    for (int i = 0; i < 2; i++) {
        char dir[] = "/tmp/kvtier-window-XXXXXX", path[96];
        kvt_model *m = fam_open(fs[i], dir, path, sizeof path);
        if (!m) return;
        kvt_plan p;
        CHECK_OK(kvt_model_plan(m, 4096, &p));
        /* 6 DeltaNet layers of (3, 512) + (4, 64, 64) f32; 2 attention layers' full rows of 2 heads * 64 */
        uint64_t rec = kvt_plan_bytes(&p, "recurrent"), full = kvt_plan_bytes(&p, "full rows");
        CHECKF(rec == 6ull * (3 * 512 + 4 * 64 * 64) * 4 && full == 4096ull * 2 * 2 * 128 * 4 &&
               kvt_plan_bytes(&p, "window") == 0, "plan: recurrent %llu, full %llu", (unsigned long long)rec,
               (unsigned long long)full);
        restore_all(m);
        gemma_close(m, dir, path);
    }
}

TEST(recurrent_checkpoints) { checkpoints(&qwen35); }
TEST(recurrent_damaged_state) { damaged_state(&qwen35); }

/* Format version 5 (docs/FORMAT.md), the records of a model with recurrent
 * layers, pinned by a golden file: a RAM snapshot of the synthetic qwen35
 * (seed 5) after 5 tokens, its DeltaNet state in the seventh section (430080
 * of its 568600 bytes; blocks have not changed since version 2, whose
 * golden file pins them). Today's encoder must write it byte for byte
 * (KVT_WRITE_GOLDEN=1 writes it anew when the model or the format
 * changes) and the decoder must load it to the state it was made from. The
 * same record as the release before wrote it (version 2: that state at the
 * end of the state section) must load to the same state. Refused: the
 * recurrent section one value short, a version 5 record labelled version
 * 2, and a version 2 one with the recurrent state missing. Control: with
 * the state restored one value off (KVT_LLAMA_FAULT_RING) the restored
 * session differs. */
TEST(recurrent_snapshot_golden_v5)
{
    const char *gpath = "tests/golden/snapshot-v5-qwen35-5.bin";
    char dir[] = "/tmp/kvtier-window-XXXXXX", path[96];
    kvt_model *m = fam_open(&qwen35, dir, path, sizeof path);
    if (!m) return;
    enum { N = 5 };
    int32_t t[N];
    prompt(t, N, 13);
    kvt_session *s = NULL, *r = NULL;
    uint8_t *snap = NULL;
    size_t len = 0;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    CHECK_OK(kvt_session_new(&r, m, NULL));
    CHECK_OK(kvt_session_sync(s, t, N, NULL));
    CHECK_OK(kvt_session_snapshot(s, &snap, &len));
    uint64_t want = kvt_test_digest(s, m);
    kvt_plan p;
    CHECK_OK(kvt_model_plan(m, N, &p));
    kvt_snap_info in;
    CHECK_OK(kvt_snap_parse_raw(snap, len, &in));
    printf("    version %u, %zu bytes; recurrent section %zu, state section %zu\n", in.version, len, in.sec_len[7],
           in.sec_len[4]);
    CHECK(in.version == KVT_SNAP_VERSION_RECURRENT && in.sec_len[7] == kvt_plan_bytes(&p, "recurrent") && in.sec_len[4] == 0);
    const char *w = getenv("KVT_WRITE_GOLDEN");
    if (w && !strcmp(w, "1")) {
        FILE *f = fopen(gpath, "wb");
        CHECK(f && fwrite(snap, 1, len, f) == len);
        fclose(f);
    }
    size_t glen = 0;
    char *golden = kvt_test_read_file(gpath, &glen);
    CHECKF(golden, "%s missing", gpath);
    CHECKF(glen == len && !memcmp(golden, snap, len), "the encoder no longer writes %s (%zu vs %zu bytes)", gpath,
           len, glen);
    CHECK_OK(kvt_session_restore(r, (const uint8_t *)golden, glen));
    CHECKF(kvt_test_digest(r, m) == want, "%s does not restore the state it was made from", gpath);
    kvt_llama_fault = KVT_LLAMA_FAULT_RING;
    int rc = kvt_session_restore(r, (const uint8_t *)golden, glen);
    kvt_llama_fault = KVT_LLAMA_FAULT_NONE;
    CHECK(rc == KVT_OK);
    CHECKF(kvt_test_digest(r, m) != want, "control: a recurrent state restored wrong went unnoticed");
    /* version 2, as the release before wrote it */
    const uint8_t *sec[8];
    size_t sl[8];
    memcpy(sec, in.sec, sizeof sec);
    memcpy(sl, in.sec_len, sizeof sl);
    uint8_t *joined = malloc(sl[4] + sl[7]);
    CHECK(joined);
    memcpy(joined, in.sec[4], sl[4]);
    memcpy(joined + sl[4], in.sec[7], sl[7]);
    sec[4] = joined;
    sl[4] += sl[7];
    size_t l2 = 0, refused = 0;
    uint8_t *v2 = kvt_test_repack(snap, len, KVT_SNAP_VERSION, in.flags, 6, sec, sl, &l2);
    CHECK(v2);
    CHECK_OK(kvt_session_restore(r, v2, l2));
    CHECKF(kvt_test_digest(r, m) == want, "a version 2 record of the release before does not restore");
    /* refused: version 5 with a short recurrent section; labelled 2 with 7
     * sections; version 2 without the recurrent state */
    uint8_t *bad[3];
    size_t bl[3];
    sl[4] = in.sec_len[4];
    sec[4] = in.sec[4];
    sl[7] -= 4;
    bad[0] = kvt_test_repack(snap, len, KVT_SNAP_VERSION_RECURRENT, in.flags, 7, sec, sl, &bl[0]);
    sl[7] += 4;
    bad[1] = kvt_test_repack(snap, len, KVT_SNAP_VERSION, in.flags, 7, sec, sl, &bl[1]);
    bad[2] = kvt_test_repack(snap, len, KVT_SNAP_VERSION, in.flags, 6, sec, sl, &bl[2]);
    for (int i = 0; i < 3; i++) {
        CHECK(bad[i]);
        if (kvt_session_restore(r, bad[i], bl[i]) != KVT_OK && kvt_session_len(r) == 0) refused++;
        else printf("    damaged record %d: %s\n", i, kvt_errmsg());
        free(bad[i]);
    }
    CHECKF(refused == 3, "%zu of 3 malformed records refused", refused);
    /* an empty session's record (a zero recurrent state) restores, and the
     * session runs on from it as a new one */
    kvt_session *e = NULL;
    uint8_t *empty = NULL;
    size_t el = 0;
    CHECK_OK(kvt_session_new(&e, m, NULL));
    CHECK_OK(kvt_session_snapshot(e, &empty, &el));
    kvt_session_free(e);
    CHECK_OK(kvt_session_restore(r, empty, el));
    free(empty);
    CHECK(kvt_session_len(r) == 0);
    CHECK_OK(kvt_session_sync(r, t, N, NULL));
    CHECKF(kvt_test_digest(r, m) == want, "a session restored empty does not run as a new one");
    free(v2);
    free(joined);
    free(golden);
    free(snap);
    kvt_session_free(r);
    kvt_session_free(s);
    gemma_close(m, dir, path);
}

/* docs/FORMAT.md, llama: 2 streams per global layer; the state, for each
 * window layer, K then V rows of positions max(0, n - W) .. n - 1, oldest
 * first. At n = 300 on the synthetic gemma3: 2 x 2 streams of 512-byte
 * rows, 44 rows each past the 2 blocks, a state of 2 x 2 x 64 x 512 bytes,
 * whose first window layer's last K row is position 299's key as a session
 * of 300 tokens computed it (its K ring's slot 299 mod 64). */
TEST(window_snapshot_layout)
{
    char dir[] = "/tmp/kvtier-window-XXXXXX", path[96];
    kvt_model *m = gemma_open(dir, path, sizeof path);
    if (!m) return;
    enum { N = 300, ROW = FAM_KV_HEADS * FAM_HEAD_DIM * 4 };
    int32_t t[N];
    prompt(t, N, 11);
    kvt_session *s = NULL;
    uint8_t *snap = NULL;
    size_t len = 0;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    CHECK_OK(kvt_session_sync(s, t, N, NULL));
    CHECK_OK(kvt_session_snapshot(s, &snap, &len));
    kvt_snap_info in;
    CHECK_OK(kvt_snap_parse_raw(snap, len, &in));
    printf("    %u streams, rows %zu bytes, state %zu bytes\n", in.n_streams, in.sec_len[5], in.sec_len[4]);
    CHECK(in.n_streams == 4 && in.nb == 2);
    CHECK(in.sec_len[5] == 4ull * (N - 2 * 128) * ROW);
    CHECK(in.sec_len[4] == 2ull * 2 * W * ROW);
    const uint8_t *ring = s->cache->state; /* the first window layer's K ring, (W, KV) f32 */
    CHECK(!memcmp(in.sec[4] + (W - 1) * (size_t)ROW, ring + (N - 1) % W * (size_t)ROW, ROW));
    CHECK(!memcmp(in.sec[4], ring + (N - W) % W * (size_t)ROW, ROW));
    kvt_session_free(s);
    free(snap);
    gemma_close(m, dir, path);
}
