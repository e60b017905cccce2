/* qwen35's Gated DeltaNet layers (src/arch/deltanet.c) keep their
 * convolution and delta-rule state in the session's fixed state; the
 * proofs of tests/test_window.c's window rings (fam_state.h) hold for it,
 * and format version 5 is pinned by a golden file. */
#include "test.h"
#include "fixture.h"
#include "arch/model.h"
#include "arch/llama.h"
#include "session/snapshot.h"
#include "cache/rows.h"
#include "fam_state.h"
#include "synth_family.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const fam_spec qwen35 = {"qwen35", .qwen35 = FAM_Q35_DENSE};
static const fam_spec qwen35moe = {"qwen35moe", .qwen35 = FAM_Q35_MOE};

/* The same proofs for qwen35's Gated DeltaNet layers (synth_family.h: 8
 * layers, 6 of them recurrent, 2 gated attention layers), whose state is
 * their convolution and delta-rule state: snapshots at the positions above
 * (on and off the 128-token grid) restored and run on to 420 equal the
 * uninterrupted run (and through a disk store), checkpoints every 128
 * tokens give back exact earlier positions, damaged or stateless records
 * are refused; with the state restored one value off
 * (KVT_LLAMA_FAULT_RING) each check fails. The attention layers' rows in
 * f16 (the default), then f32, bf16 and q8_0 at fewer positions; the
 * checkpoints in each of them. */
TEST(deltanet_snapshot_restore)
{
    const fam_spec *fs[2] = {&qwen35, &qwen35moe};
    for (int i = 0; i < 2 && !kvt_test_failed(); i++) {
        char dir[] = "/tmp/kvtier-window-XXXXXX", path[96];
        kvt_model *m = fam_open(fs[i], dir, path, sizeof path);
        if (!m) return;
        /* then, lighter, f32, bf16 and q8_0 (K and V of one type: no rings) */
        for (size_t r = 0; r < 4 && m; r++) {
            kvt_plan p;
            CHECK_OK(kvt_model_plan(m, 4096, &p));
            /* 6 DeltaNet layers of (3, 512) + (4, 64, 64) f32; 2 attention layers' full rows of 2 heads * 64 */
            uint64_t rec = kvt_plan_bytes(&p, "recurrent"), full = kvt_plan_bytes(&p, "full rows");
            uint64_t row = kvt_rows_bytes(m->type_k, 128) + kvt_rows_bytes(m->type_v, 128);
            CHECKF(rec == 6ull * (3 * 512 + 4 * 64 * 64) * 4 && full == 4096ull * 2 * row &&
                   kvt_plan_bytes(&p, "window") == 0, "plan: recurrent %llu, full %llu", (unsigned long long)rec,
                   (unsigned long long)full);
            fam_restore_all(m, r > 0);
            kvt_model_close(m);
            m = r < 3 && !kvt_test_failed() ? fam_reopen(path, fam_rows_more[r]) : NULL;
        }
        kvt_model_close(m);
        unlink(path);
        rmdir(dir);
    }
}

TEST(deltanet_checkpoints) { fam_checkpoints(&qwen35); }
TEST(deltanet_damaged_state) { fam_damaged_state(&qwen35); }

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
TEST(deltanet_snapshot_golden_v5)
{
    const char *gpath = "tests/golden/snapshot-v5-qwen35-5.bin";
    char dir[] = "/tmp/kvtier-window-XXXXXX", path[96];
    kvt_model *m = fam_open(&qwen35, dir, path, sizeof path);
    if (!m) return;
    CHECK_OK(kvt_model_set_cache_types(m, KVT_ROWS_F32, KVT_ROWS_F32)); /* the golden file's rows */
    enum { N = 5 };
    int32_t t[N];
    fam_prompt(t, N, 13);
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
    size_t glen = 0;
    uint8_t *golden = fx_golden(gpath, snap, len, true, &glen);
    CHECKF(golden, "the golden file %s (above)", gpath);
    CHECK_OK(kvt_session_restore(r, golden, glen));
    CHECKF(kvt_test_digest(r, m) == want, "%s does not restore the state it was made from", gpath);
    kvt_llama_fault = KVT_LLAMA_FAULT_RING;
    int rc = kvt_session_restore(r, golden, glen);
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
    fam_close(m, dir, path);
}
