/* The snapshot format (src/session/snapshot.c, docs/FORMAT.md) on ds4-tiny:
 * damaged, truncated and foreign records are refused and leave the session
 * empty; golden files pin versions 2, 3 and 4. On the synthetic gemma3:
 * version 6 (rows of a cache type) and its golden file, and records of
 * other row types refused in RAM and kept as misses by the disk tier. */
#include "test.h"
#include "fixture.h"
#include "ds4_tiny.h"
#include "fam_state.h"
#include "synth_family.h"
#include "arch/model.h"
#include "base/util.h"
#include "cache/rows.h"
#include "session/snapshot.h"
#include "store/testing.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

TEST(snapshot_rejects_damage)
{
    kvt_model *m = tiny(), *other = NULL;
    CHECK(m);
    CHECK_OK(kvt_model_preset(&other, "ds4-tiny", TINY_SEED + 1, NULL));
    enum { N = 150 };
    int32_t t[N];
    seqb(t, N, 19);
    kvt_session *s = NULL, *r = NULL, *o = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    CHECK_OK(kvt_session_new(&r, m, NULL));
    CHECK_OK(kvt_session_new(&o, other, NULL));
    CHECK_OK(kvt_session_sync(s, t, N, NULL));
    uint8_t *snap = NULL;
    size_t len = 0;
    CHECK_OK(kvt_session_snapshot(s, &snap, &len));
    CHECK(kvt_session_restore(o, snap, len) == KVT_EMISMATCH);
    CHECK(kvt_session_len(o) == 0);
    uint8_t *bad = malloc(len);
    for (size_t cut = 0; cut < len; cut += 1 + cut / 7) {
        CHECK(kvt_session_restore(r, snap, cut) != KVT_OK);
        CHECK(kvt_session_len(r) == 0);
    }
    uint64_t st = kvt_test_seed("snapshot_rejects_damage");
    for (int i = 0; i < 300; i++) {
        memcpy(bad, snap, len);
        bad[kvt_test_rand(&st) % len] ^= (uint8_t)(1 + kvt_test_rand(&st) % 255);
        int rc = kvt_session_restore(r, bad, len);
        CHECKF(rc == KVT_ECORRUPT || rc == KVT_EFORMAT || rc == KVT_EMISMATCH, "flip %d: %s", i, kvt_strerror(rc));
        CHECK(kvt_session_len(r) == 0);
    }
    /* Still usable after all that: a good restore works. */
    CHECK_OK(kvt_session_restore(r, snap, len));
    CHECK(kvt_session_len(r) == N);
    free(bad);
    free(snap);
    kvt_session_free(s); kvt_session_free(r); kvt_session_free(o);
    kvt_model_close(other);
    kvt_model_close(m);
}

/* kvt_snap_block_check_parts (a block record read in parts, as the remote
 * tier reads a value: checked where the parts lie) says what
 * kvt_snap_block_check says of the joined record: the same key for a good
 * record cut in parts of 1, 7, 100 and 1000 bytes and whole; the same
 * failure for each of 200 seeded byte flips and for records cut short. */
static int check_in_parts(const uint8_t *p, size_t len, size_t part, uint64_t *key)
{
    size_t n = (len + part - 1) / part;
    struct iovec *v = calloc(n ? n : 1, sizeof *v);
    for (size_t i = 0; i < n; i++)
        v[i] = (struct iovec){(void *)(p + i * part), len - i * part < part ? len - i * part : part};
    int rc = kvt_snap_block_check_parts(v, n, len, key);
    free(v);
    return rc;
}

TEST(snapshot_block_check_in_parts)
{
    kvt_model *m = tiny();
    CHECK(m);
    enum { N = 300 };
    int32_t t[N];
    seqb(t, N, 23);
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    CHECK_OK(kvt_session_sync(s, t, N, NULL));
    kvt_wbuf b = {0};
    uint64_t key = 0, k0 = kvt_snap_key0(m);
    CHECK_OK(kvt_snap_block(s, 1, kvt_snap_key_next(k0, t), &b, &key));
    const size_t parts[] = {1, 7, 100, 1000, b.len};
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        uint64_t k = 0;
        CHECK_OK(check_in_parts(b.p, b.len, parts[i], &k));
        CHECKF(k == key, "parts of %zu bytes: key %016llx", parts[i], (unsigned long long)k);
    }
    uint8_t *bad = malloc(b.len);
    uint64_t st = kvt_test_seed("snapshot_block_check_in_parts");
    for (int i = 0; i < 200; i++) {
        memcpy(bad, b.p, b.len);
        bad[kvt_test_rand(&st) % b.len] ^= (uint8_t)(1 + kvt_test_rand(&st) % 255);
        int whole = kvt_snap_block_check(bad, b.len, NULL);
        CHECK(whole != KVT_OK);
        for (size_t j = 0; j < sizeof parts / sizeof parts[0]; j++)
            CHECKF(check_in_parts(bad, b.len, parts[j], NULL) == whole, "flip %d, parts of %zu bytes", i, parts[j]);
    }
    for (size_t cut = 0; cut < b.len; cut += 1 + cut / 3)
        CHECK(check_in_parts(b.p, cut, 100, NULL) == kvt_snap_block_check(b.p, cut, NULL) &&
              kvt_snap_block_check(b.p, cut, NULL) != KVT_OK);
    free(bad);
    kvt_wbuf_free(&b);
    kvt_session_free(s);
    kvt_model_close(m);
}

/* A version 3 record from a version 4 one (v4, len): the same header and
 * sections less the state's digest (an empty state section), as the encoder
 * of version 3 wrote it; what follows the record (the blocks) is kept. Used
 * only to rewrite the version 3 golden file when the preset it holds
 * changes (KVT_WRITE_GOLDEN=1). */
static uint8_t *as_version_3(const uint8_t *v4, size_t len, size_t *out_len)
{
    kvt_snap_info in;
    if (kvt_snap_parse_raw(v4, len, &in) || in.version != 4) return NULL;
    in.sec_len[4] = 0;
    return kvt_test_repack(v4, len, 3, in.flags, 6, in.sec, in.sec_len, out_len);
}

/* The snapshot format is pinned by a golden file per version: today's
 * encoder must reproduce the current ones byte for byte and today's decoder
 * must load every one. KVT_WRITE_GOLDEN=1 rewrites the current ones (only
 * when a format version changes). Version 2 is a whole record, version 4
 * the same record without its state but with the state's digest. Version 3,
 * the same without the digest, is no longer written but still read: its
 * golden file must load, and it must be the version 4 record less the
 * digest. When the preset changes, KVT_WRITE_GOLDEN=1 rewrites all three
 * (version 3 from today's version 4 record, as_version_3). */
TEST(snapshot_golden_v2_v3_v4)
{
    enum { V2, V4, V3 };
    const char *paths[3] = {"tests/golden/snapshot-v2-ds4-tiny-300.bin", "tests/golden/snapshot-v4-ds4-tiny-300.bin",
                            "tests/golden/snapshot-v3-ds4-tiny-300.bin"};
    kvt_model *m = tiny();
    CHECK(m);
    enum { N = 300 };
    int32_t t[N];
    seqb(t, N, 29);
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    CHECK_OK(kvt_session_sync(s, t, N, NULL));
    state a = {0};
    CHECK_OK(capture(s, m, &a));
    uint8_t *snap[2] = {NULL, NULL};
    size_t len[2] = {0, 0};
    CHECK_OK(kvt_session_snapshot(s, &snap[V2], &len[V2]));
    CHECK_OK(without_state(snap[V2], len[V2], &snap[V4], &len[V4]));
    for (int v = V2; v <= V3; v++) {
        /* version 3 is compared section by section below, not byte for
         * byte: no encoder writes it any more */
        size_t glen = 0, l3 = 0;
        uint8_t *v3 = v == V3 && fx_golden_writing() ? as_version_3(snap[V4], len[V4], &l3) : NULL;
        uint8_t *golden = v == V3 ? fx_golden(paths[v], v3, l3, false, &glen)
                                  : fx_golden(paths[v], snap[v], len[v], true, &glen);
        free(v3);
        CHECKF(golden, "the golden file %s (above)", paths[v]);
        const uint8_t *g = golden;
        if (v == V3) {
            kvt_snap_info g3, g4;
            CHECK_OK(kvt_snap_parse_raw(g, glen, &g3));
            CHECK_OK(kvt_snap_parse_raw(snap[V4], len[V4], &g4));
            CHECK(g3.version == 3 && g4.version == 4 && g3.flags == g4.flags);
            CHECK(g3.sec_len[4] == 0 && g4.sec_len[4] == 8);
            CHECK(!memcmp(g + 16, snap[V4] + 16, 40)); /* fingerprints, n, nb, V, streams, head */
            for (int i = 1; i <= 6; i++)
                CHECKF(i == 4 || (g3.sec_len[i] == g4.sec_len[i] && !memcmp(g3.sec[i], g4.sec[i], g3.sec_len[i])),
                       "section %d of the version 3 golden file differs from today's version 4 record", i);
            CHECK(glen - g3.rec_len == len[V4] - g4.rec_len &&
                  !memcmp(g + g3.rec_len, snap[V4] + g4.rec_len, glen - g3.rec_len)); /* the same blocks */
        }
        kvt_session *r = NULL;
        CHECK_OK(kvt_session_new(&r, m, NULL));
        CHECK_OK(kvt_session_restore(r, g, glen));
        state b = {0};
        CHECK_OK(capture(r, m, &b));
        CHECKF(equal(&a, &b), "%s does not restore the state it was made from", paths[v]);
        state_free(&b);
        free(golden);
        kvt_session_free(r);
    }
    free(snap[V2]);
    free(snap[V4]);
    state_free(&a);
    kvt_session_free(s);
    kvt_model_close(m);
}

/* ---- row types: version 6 (docs/FORMAT.md) ----
 *
 * The synthetic gemma3 of tests/synth_family.h (window rings and full rows,
 * heads of 64, so q8_0 fits) opened several times from one file: the same
 * weights with other cache types. kvt_snap_skip_row_types is the negative
 * control: the checks below must fail without the type check. */

static const fam_spec gemma3 = {"gemma3", false, true, FAM_HEAD_DIM, false, false, true};
static const fam_spec qwen35 = {"qwen35", .qwen35 = FAM_Q35_DENSE};

/* The model at path with K and V rows of types k and v, or NULL (the test
 * fails). */
static kvt_model *open_typed(const char *path, kvt_row_type k, kvt_row_type v)
{
    kvt_model *m = NULL;
    int rc = kvt_model_open(&m, path);
    if (!rc && (rc = kvt_model_set_cache_types(m, k, v))) { kvt_model_close(m); m = NULL; }
    if (rc) kvt_test_fail(__FILE__, __LINE__, "%s as %s/%s: %s", path, kvt_row_type_name(k), kvt_row_type_name(v),
                          kvt_errmsg());
    return m;
}

/* A snapshot of m after t[0..n) (malloc'ed). */
static uint8_t *snap_of(kvt_model *m, const int32_t *t, size_t n, size_t *len, uint64_t *digest)
{
    kvt_session *s = NULL;
    uint8_t *snap = NULL;
    if (kvt_session_new(&s, m, NULL) || kvt_session_sync(s, t, n, NULL) || kvt_session_snapshot(s, &snap, len))
        snap = NULL;
    if (digest) *digest = kvt_test_digest(s, m);
    kvt_session_free(s);
    return snap;
}

/* rc, kvt_errmsg() and the session: a refusal of a record of other row
 * types (KVT_EMISMATCH naming the record's types, want, and the model's,
 * mine) that left the session empty. */
static bool refused_types(int rc, const kvt_session *s, const char *want, const char *mine)
{
    const char *msg = kvt_errmsg();
    bool ok = rc == KVT_EMISMATCH && kvt_session_len(s) == 0 && strstr(msg, want) && strstr(msg, mine);
    if (!ok) printf("    not refused for its types (%s): %s\n", kvt_strerror(rc), msg);
    return ok;
}

/* Restore snap into a new session of m: refused_types. */
static bool restore_refused(kvt_model *m, const uint8_t *snap, size_t len, const char *want, const char *mine)
{
    kvt_session *r = NULL;
    if (kvt_session_new(&r, m, NULL)) return false;
    bool ok = refused_types(kvt_session_restore(r, snap, len), r, want, mine);
    kvt_session_free(r);
    return ok;
}

/* Header bytes 60..64 set to v and the header checksum made anew. */
static void reseal_types(uint8_t *rec, uint32_t v)
{
    size_t hdr = 72 + 24 * (size_t)kvt_rd32(rec + 56);
    for (int k = 0; k < 4; k++) rec[60 + k] = (uint8_t)(v >> (8 * k));
    uint64_t h = XXH3_64bits(rec, hdr - 8);
    for (int k = 0; k < 8; k++) rec[hdr - 8 + k] = (uint8_t)(h >> (8 * k));
}

/* Version 6 pinned by its golden file: a RAM snapshot of the synthetic
 * gemma3 (seed 5) with K q8_0 and V f16 after 130 tokens (one block, two
 * wraps of the 64-token rings, 2 rows in the tail). The encoder must write
 * it byte for byte and it must load to the state it was made from; a model
 * of other types (V and K swapped among them) refuses it. The goldens of
 * the versions before are unchanged: DeepSeek-V4 writes version 2 whatever
 * cache types it is given (its rows are its own), and the version 5 golden
 * loads with f32 rows and is refused with f16 ones. KVT_WRITE_GOLDEN=1
 * rewrites the version 6 file (only when the version changes). */
TEST(snapshot_golden_v6)
{
    const char *gpath = "tests/golden/snapshot-v6-gemma3-130.bin";
    char dir[] = "/tmp/kvtier-rows-XXXXXX", path[96];
    kvt_model *g = fam_open(&gemma3, dir, path, sizeof path);
    if (!g) return;
    kvt_model_close(g);
    kvt_model *m = open_typed(path, KVT_ROWS_Q8_0, KVT_ROWS_F16);
    kvt_model *swap = open_typed(path, KVT_ROWS_F16, KVT_ROWS_Q8_0);
    kvt_model *f32 = open_typed(path, KVT_ROWS_F32, KVT_ROWS_F32);
    CHECK(m && swap && f32);
    enum { N = 130, MORE = 150 };
    int32_t t[MORE];
    fam_prompt(t, MORE, 17);
    uint64_t want = 0;
    size_t len = 0;
    uint8_t *snap = snap_of(m, t, N, &len, &want);
    CHECK(snap);
    kvt_snap_info in;
    CHECK_OK(kvt_snap_parse_raw(snap, len, &in));
    /* rows of 2 KV heads of 64: K q8_0 4 x 34 = 136 bytes, V f16 256 */
    enum { RK = 136, RV = 256, KV = 2 * 64 };
    printf("    version %u, %zu bytes, header types %02x %02x %02x %02x; state %zu, rows %zu\n", in.version, len,
           snap[60], snap[61], snap[62], snap[63], in.sec_len[4], in.sec_len[5]);
    CHECK(in.version == KVT_SNAP_VERSION_TYPED && in.nsec == 6 && in.ggml_k == 8 && in.ggml_v == 1);
    CHECK(snap[60] == 8 && snap[61] == 1 && snap[62] == 0 && snap[63] == 0);
    CHECK(in.n_streams == 4 && in.nb == 1);
    CHECK(in.sec_len[4] == 2ull * FAM_GEMMA_SWA * (RK + RV));                /* 2 window layers' rings */
    CHECK(in.sec_len[5] == 2ull * (N - 128) * (RK + RV));                    /* 2 global layers, 2 tail rows */
    CHECK(len - in.rec_len == 56 + 512 + 4 + kvt_rd32(snap + in.rec_len + 560) + 2ull * 128 * (RK + RV));
    CHECK(RK == kvt_rows_bytes(KVT_ROWS_Q8_0, KV) && RV == kvt_rows_bytes(KVT_ROWS_F16, KV));
    size_t glen = 0;
    uint8_t *golden = fx_golden(gpath, snap, len, true, &glen);
    CHECKF(golden, "the golden file %s (above)", gpath);
    kvt_session *r = NULL;
    size_t reused = 0;
    CHECK_OK(kvt_session_new(&r, m, NULL));
    CHECK_OK(kvt_session_restore(r, golden, glen));
    CHECKF(kvt_test_digest(r, m) == want, "%s does not restore the state it was made from", gpath);
    CHECK_OK(kvt_session_sync(r, t, MORE, &reused));
    CHECKF(reused == N && kvt_test_digest(r, m) == kvt_test_twin(m, t, MORE),
           "run on from %s, the session differs from the uninterrupted run", gpath);
    kvt_session_free(r);
    /* refused by the same weights with other types: K and V swapped, f32 */
    CHECK(restore_refused(swap, golden, glen, "K q8_0, V f16", "K f16, V q8_0"));
    CHECK(restore_refused(f32, golden, glen, "K q8_0, V f16", "K f32, V f32"));
    /* the versions before: ds4 (rows of its own) writes the version 2
     * golden byte for byte with any cache types */
    kvt_model *ds4 = tiny();
    CHECK(ds4);
    CHECK_OK(kvt_model_set_cache_types(ds4, KVT_ROWS_Q8_0, KVT_ROWS_F16));
    int32_t d[300];
    seqb(d, 300, 29);
    size_t dlen = 0, d2len = 0;
    uint8_t *dsnap = snap_of(ds4, d, 300, &dlen, NULL);
    char *d2 = kvt_test_read_file("tests/golden/snapshot-v2-ds4-tiny-300.bin", &d2len);
    CHECK(dsnap && d2);
    CHECKF(dlen == d2len && !memcmp(dsnap, d2, dlen), "ds4 given cache types no longer writes the version 2 golden");
    free(dsnap);
    free(d2);
    kvt_model_close(ds4);
    /* the version 5 golden: loads with f32 rows, refused with f16 ones */
    char qdir[] = "/tmp/kvtier-rows-XXXXXX", qpath[96];
    kvt_model *q = fam_open(&qwen35, qdir, qpath, sizeof qpath);
    CHECK(q);
    kvt_model_close(q);
    kvt_model *q32 = open_typed(qpath, KVT_ROWS_F32, KVT_ROWS_F32), *q16 = open_typed(qpath, KVT_ROWS_F16, KVT_ROWS_F16);
    CHECK(q32 && q16);
    int32_t qt[5];
    fam_prompt(qt, 5, 13);
    uint64_t qwant = 0;
    size_t v5len = 0, q6len = 0;
    uint8_t *q5 = snap_of(q32, qt, 5, &v5len, &qwant);
    char *v5 = kvt_test_read_file("tests/golden/snapshot-v5-qwen35-5.bin", &v5len);
    CHECK(q5 && v5);
    free(q5);
    CHECK_OK(kvt_session_new(&r, q32, NULL));
    CHECK_OK(kvt_session_restore(r, (const uint8_t *)v5, v5len));
    CHECKF(kvt_test_digest(r, q32) == qwant, "the version 5 golden does not load with f32 rows");
    kvt_session_free(r);
    CHECK(restore_refused(q16, (const uint8_t *)v5, v5len, "K f32, V f32 (format version 5)", "K f16, V f16"));
    /* qwen35 with f16 rows: version 6 with its recurrent section (7
     * sections), whole (no record without its state), and it loads */
    uint64_t q16want = 0;
    uint8_t *q6 = snap_of(q16, qt, 5, &q6len, &q16want);
    CHECK(q6);
    kvt_snap_info qi;
    CHECK_OK(kvt_snap_parse_raw(q6, q6len, &qi));
    CHECK(qi.version == KVT_SNAP_VERSION_TYPED && qi.nsec == 7 && qi.ggml_k == 1 && qi.ggml_v == 1 && qi.sec_len[4] == 0);
    kvt_wbuf thin = {0};
    CHECK_OK(kvt_snap_without_state(q6, qi.rec_len, &thin));
    CHECK(thin.len == 0);
    CHECK_OK(kvt_session_new(&r, q16, NULL));
    CHECK_OK(kvt_session_restore(r, q6, q6len));
    CHECK(kvt_test_digest(r, q16) == q16want);
    kvt_session_free(r);
    CHECK(restore_refused(q32, q6, q6len, "K f16, V f16", "K f32, V f32"));
    free(q6);
    free(v5);
    kvt_model_close(q32);
    kvt_model_close(q16);
    unlink(qpath);
    rmdir(qdir);
    free(golden);
    free(snap);
    kvt_model_close(m);
    kvt_model_close(swap);
    kvt_model_close(f32);
    unlink(path);
    rmdir(dir);
}

/* A RAM snapshot of one row type restored by the same weights with
 * another is refused with both types named (f16 and bf16 rows have the
 * same sizes, so only the types tell them apart), and so is a record whose
 * header types were edited and resealed: to other types than the model's
 * (refused by the type check; without it the record would load, its rows
 * being the model's), or to the types of the model it is loaded into
 * (refused by the key chain, whose key0 holds the types). Each with the
 * type check skipped (kvt_snap_skip_row_types) must fail. */
static int across_types(const char *path, bool skip)
{
    static const kvt_row_type ty[][2] = {{KVT_ROWS_F16, KVT_ROWS_F16},
                                        {KVT_ROWS_BF16, KVT_ROWS_BF16},
                                        {KVT_ROWS_Q8_0, KVT_ROWS_F16},
                                        {KVT_ROWS_F32, KVT_ROWS_F32}};
    enum { NT = 4, N = 150 };
    kvt_model *m[NT] = {0};
    uint8_t *snap[NT] = {0};
    size_t len[NT] = {0};
    int32_t t[N];
    fam_prompt(t, N, 23);
    int bad = 0;
    bool setup = true;
    for (int i = 0; i < NT; i++) {
        if (!(m[i] = open_typed(path, ty[i][0], ty[i][1]))) setup = false;
        else if (!(snap[i] = snap_of(m[i], t, i == 1 ? 20 : N, &len[i], NULL))) setup = false; /* bf16: no block */
    }
    if (!setup) bad++;
    kvt_snap_skip_row_types = skip;
    for (int i = 0; i < NT && setup; i++)
        for (int j = 0; j < NT; j++) {
            char want[48], mine[48];
            snprintf(want, sizeof want, "K %s, V %s", kvt_row_type_name(ty[i][0]), kvt_row_type_name(ty[i][1]));
            snprintf(mine, sizeof mine, "K %s, V %s", kvt_row_type_name(ty[j][0]), kvt_row_type_name(ty[j][1]));
            kvt_session *r = NULL;
            if (kvt_session_new(&r, m[j], NULL)) { bad++; break; }
            int rc = kvt_session_restore(r, snap[i], len[i]);
            if (i == j ? rc != KVT_OK : !refused_types(rc, r, want, mine)) {
                printf("    %s restored into %s: %s\n", want, mine, kvt_strerror(rc));
                bad++;
            }
            kvt_session_free(r);
        }
    /* headers edited: q8_0/f16 as f16/q8_0 into its own model; f16/f16 as
     * bf16/bf16 into the bf16 model */
    for (int e = 0; e < 2 && setup; e++) {
        int from = e ? 0 : 2, into = e ? 1 : 2;
        uint8_t *x = malloc(len[from]);
        if (!x) { bad++; break; }
        memcpy(x, snap[from], len[from]);
        reseal_types(x, e ? 30u | 30u << 8 : 1u | 8u << 8);
        kvt_session *r = NULL;
        if (kvt_session_new(&r, m[into], NULL)) bad++;
        int rc = r ? kvt_session_restore(r, x, len[from]) : KVT_ENOMEM;
        bool ok = e ? rc == KVT_EMISMATCH && kvt_session_len(r) == 0
                    : refused_types(rc, r, "K f16, V q8_0", "K q8_0, V f16");
        if (!ok) {
            printf("    edited header %d: %s (%s)\n", e, kvt_strerror(rc), kvt_errmsg());
            bad++;
        }
        kvt_session_free(r);
        free(x);
    }
    kvt_snap_skip_row_types = false;
    for (int i = 0; i < NT; i++) {
        free(snap[i]);
        kvt_model_close(m[i]);
    }
    return bad;
}

TEST(snapshot_rows_across_types)
{
    char dir[] = "/tmp/kvtier-rows-XXXXXX", path[96];
    kvt_model *g = fam_open(&gemma3, dir, path, sizeof path);
    if (!g) return;
    kvt_model_close(g);
    int bad = across_types(path, false);
    CHECKF(bad == 0, "%d records of other row types not refused as such", bad);
    printf("    control: the type check skipped\n");
    int control = across_types(path, true);
    printf("    control: %d failures\n", control);
    CHECKF(control > 0, "control: with the type check skipped, every record was still refused for its types");
    /* malformed version 6 headers: a type this build does not store rows in
     * is another type (a miss); bytes 62..64 not 0 are malformed */
    kvt_model *m = open_typed(path, KVT_ROWS_F16, KVT_ROWS_F16);
    CHECK(m);
    int32_t t[20];
    fam_prompt(t, 20, 29);
    size_t len = 0;
    uint8_t *snap = snap_of(m, t, 20, &len, NULL);
    CHECK(snap);
    reseal_types(snap, 2u | 1u << 8);
    CHECK(restore_refused(m, snap, len, "K ggml type 2, V f16", "K f16, V f16"));
    reseal_types(snap, 1u | 1u << 8 | 1u << 16);
    kvt_session *r = NULL;
    CHECK_OK(kvt_session_new(&r, m, NULL));
    CHECK(kvt_session_restore(r, snap, len) == KVT_EFORMAT && kvt_session_len(r) == 0);
    reseal_types(snap, 1u | 1u << 8);
    CHECK_OK(kvt_session_restore(r, snap, len)); /* resealed as it was: loads */
    kvt_session_free(r);
    free(snap);
    kvt_model_close(m);
    unlink(path);
    rmdir(dir);
}

/* The disk tier: a record saved by the model with f16 rows is a miss for
 * the same weights with q8_0 rows and with f32 rows (their lookups find
 * nothing, and loading it by its id is KVT_EMISMATCH, a miss that leaves
 * the session empty), and it stays in the store: the f16 model still finds
 * and loads it afterwards, and the store verifies clean. Returns the number
 * of failures; skip: with the type check skipped (the control). */
static int store_across(const char *path, bool skip)
{
    enum { N = 150 };
    int32_t t[N];
    fam_prompt(t, N, 31);
    char dir[] = "/tmp/kvtier-rows-store-XXXXXX";
    if (!kvt_test_mkdtemp(dir)) return 1;
    kvt_model *f16 = open_typed(path, KVT_ROWS_F16, KVT_ROWS_F16);
    kvt_model *other[2] = {open_typed(path, KVT_ROWS_Q8_0, KVT_ROWS_Q8_0), open_typed(path, KVT_ROWS_F32, KVT_ROWS_F32)};
    kvt_store *st = NULL;
    kvt_session *s = NULL;
    int64_t id = -1, got = -1;
    size_t match = 0, reused = 0;
    uint64_t want = 0;
    bool setup = f16 && other[0] && other[1] && !kvt_store_open(&st, dir, 0) && !kvt_session_new(&s, f16, NULL) &&
                 !kvt_session_sync(s, t, N, NULL) && !kvt_store_save(st, s, N, "test", &id);
    int bad = !setup;
    if (setup) {
        kvt_store_set_quiet(st, true);
        want = kvt_test_digest(s, f16);
    }
    kvt_session_free(s);
    s = NULL;
    kvt_snap_skip_row_types = skip;
    for (int o = 0; o < 2 && setup; o++) {
        kvt_session *r = NULL;
        if (kvt_session_new(&r, other[o], NULL)) { bad++; break; }
        match = 1;
        if (kvt_store_lookup(st, other[o], t, N, &match, &got) || match) {
            printf("    %s rows: the lookup found %zu tokens\n", kvt_row_type_name(other[o]->type_k), match);
            bad++;
        }
        int rc = kvt_store_load(st, id, r);
        if (!refused_types(rc, r, "K f16, V f16", kvt_row_type_name(other[o]->type_k))) bad++;
        if (kvt_store_restore_prefix(st, r, t, N, &reused) || reused || kvt_session_len(r)) {
            printf("    %s rows: restored %zu tokens\n", kvt_row_type_name(other[o]->type_k), reused);
            bad++;
        }
        kvt_session_free(r);
    }
    kvt_snap_skip_row_types = false;
    /* still there for a model of its types */
    size_t nbad = 1, checked = 0;
    if (setup) {
        match = 0;
        int rc = kvt_store_lookup(st, f16, t, N, &match, &got);
        if (rc || match != N || got != id) {
            printf("    the f16 record is gone: the lookup finds %zu tokens\n", match);
            bad++;
        } else if (kvt_session_new(&s, f16, NULL) || kvt_store_load(st, id, s) || kvt_test_digest(s, f16) != want) {
            printf("    the f16 record does not load: %s\n", kvt_errmsg());
            bad++;
        }
        if (kvt_store_verify(st, &nbad, &checked, NULL) || nbad) {
            printf("    verify: %zu bad of %zu\n", nbad, checked);
            bad++;
        }
    }
    kvt_session_free(s);
    kvt_store_close(st);
    kvt_model_close(f16);
    kvt_model_close(other[0]);
    kvt_model_close(other[1]);
    kvt_test_clear_dir(dir);
    rmdir(dir);
    return bad;
}

TEST(snapshot_rows_store_miss)
{
    char dir[] = "/tmp/kvtier-rows-XXXXXX", path[96];
    kvt_model *g = fam_open(&gemma3, dir, path, sizeof path);
    if (!g) return;
    kvt_model_close(g);
    int bad = store_across(path, false);
    CHECKF(bad == 0, "%d failures: a record of other row types was not a kept miss", bad);
    printf("    control: the type check skipped\n");
    int control = store_across(path, true);
    printf("    control: %d failures\n", control);
    CHECKF(control > 0, "control: with the type check skipped, the record of other types was still kept");
    unlink(path);
    rmdir(dir);
}
