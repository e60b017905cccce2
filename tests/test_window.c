/* The window ring entry class of the llama family (src/arch/llama.c): gemma3's
 * window layers keep only their last sliding_window K and V rows, in a ring
 * in the session's fixed state, while its global layers keep full rows.
 * Everything a session does with its state must give the bits of one
 * uninterrupted run, at every position around the window's edge:
 *
 *   window_snapshot_restore   a snapshot at k, restored into a new session
 *                             and run on, equals the uninterrupted run, and
 *                             so does a record through a disk store; the
 *                             plan's bytes are the row types'; for f16 rows
 *                             (the default), then f32, bf16, q8_0 and q8_0
 *                             K with f16 V at fewer positions
 *   window_checkpoints        a prompt that diverges from the one a session
 *                             holds goes back to a checkpoint and is exact;
 *                             so is a strict prefix and a regeneration (for
 *                             every row type)
 *   window_snapshot_layout    the record's streams, rows and state section
 *                             are the sizes docs/FORMAT.md gives, and its
 *                             state is the rings in logical order (f32 rows)
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
 * restores a ring with one value off: each check must then fail; and for
 * q8_0 K with f16 V, KVT_LLAMA_FAULT_RING_TYPES, which loads a ring with
 * K's and V's row types crossed (unseen where they are the same). */
#include "test.h"
#include "arch/model.h"
#include "arch/llama.h"
#include "session/snapshot.h"
#include "cache/rows.h"
#include "fam_state.h"
#include "synth_family.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { W = FAM_GEMMA_SWA };

static const fam_spec gemma3 = {"gemma3", false, true, FAM_HEAD_DIM, false, false, true};
static const fam_spec gemma4 = {"gemma4", .gemma4 = FAM_G4_DENSE};

static kvt_model *gemma_open(char *dir, char *path, size_t cap) { return fam_open(&gemma3, dir, path, cap); }

/* m's plan at 4096 tokens: 2 window layers' rings of W rows of kvw
 * elements, 2 global layers' full rows of kvg, K and V each in their row
 * types. */
static void plan_check(const kvt_model *m, size_t kvw, size_t kvg)
{
    kvt_plan p;
    CHECK_OK(kvt_model_plan(m, 4096, &p));
    uint64_t win = kvt_plan_bytes(&p, "window"), full = kvt_plan_bytes(&p, "full rows");
    uint64_t rw = kvt_rows_bytes(m->type_k, kvw) + kvt_rows_bytes(m->type_v, kvw),
             rg = kvt_rows_bytes(m->type_k, kvg) + kvt_rows_bytes(m->type_v, kvg);
    CHECKF(win == 2 * W * rw && full == 4096ull * 2 * rg && p.type_k == m->type_k && p.type_v == m->type_v,
           "plan: window %llu, full %llu", (unsigned long long)win, (unsigned long long)full);
}

/* The restore proofs (fam_restore_all) on f's model, for the default row
 * types (f16) and then, lighter, for each of fam_rows_more; kvw and kvg as
 * plan_check takes them. */
static void restore_every_type(const fam_spec *f, size_t kvw, size_t kvg)
{
    char dir[] = "/tmp/kvtier-window-XXXXXX", path[96];
    kvt_model *m = fam_open(f, dir, path, sizeof path);
    if (!m) return;
    plan_check(m, kvw, kvg);
    if (!kvt_test_failed()) fam_restore_all(m, false);
    kvt_model_close(m);
    for (size_t r = 0; r < sizeof fam_rows_more / sizeof *fam_rows_more && !kvt_test_failed(); r++) {
        if (!(m = fam_reopen(path, fam_rows_more[r]))) break;
        plan_check(m, kvw, kvg);
        if (!kvt_test_failed()) fam_restore_all(m, true);
        kvt_model_close(m);
    }
    unlink(path);
    rmdir(dir);
}

/* gemma3: 2 window layers of (2, 64, 2 heads * 64), 2 global layers' full
 * rows of 2 heads * 64. */
TEST(window_snapshot_restore) { restore_every_type(&gemma3, 128, 128); }

/* The same on gemma4 (synth_family.h): its window layers' rows are 256
 * elements, its global layers' 128 (1 head), and its two shared layers (one
 * window, one global) keep nothing, reading the rings and rows of layers 2
 * and 3. */
TEST(window_snapshot_restore_gemma4) { restore_every_type(&gemma4, 256, 128); }

TEST(window_checkpoints) { fam_checkpoints(&gemma3); }

TEST(window_damaged_state) { fam_damaged_state(&gemma3); }

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
    CHECK_OK(kvt_model_set_cache_types(m, KVT_ROWS_F32, KVT_ROWS_F32)); /* the f32 layout */
    enum { N = 300, ROW = FAM_KV_HEADS * FAM_HEAD_DIM * 4 };
    int32_t t[N];
    fam_prompt(t, N, 11);
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
    fam_close(m, dir, path);
}
