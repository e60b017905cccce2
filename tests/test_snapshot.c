/* The snapshot format (src/session/snapshot.c, docs/FORMAT.md) on ds4-tiny:
 * damaged, truncated and foreign records are refused and leave the session
 * empty; golden files pin versions 2, 3 and 4. */
#include "test.h"
#include "ds4_tiny.h"
#include "arch/model.h"
#include "session/snapshot.h"

#include <stdlib.h>
#include <string.h>

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
    const char *w = getenv("KVT_WRITE_GOLDEN");
    for (int v = V2; v <= V3; v++) {
        if (w && !strcmp(w, "1")) {
            size_t l3 = 0;
            uint8_t *v3 = v == V3 ? as_version_3(snap[V4], len[V4], &l3) : NULL;
            FILE *f = fopen(paths[v], "wb");
            CHECK(f && (v == V3 ? v3 && fwrite(v3, 1, l3, f) == l3 : fwrite(snap[v], 1, len[v], f) == len[v]));
            fclose(f);
            free(v3);
        }
        size_t glen = 0;
        char *golden = kvt_test_read_file(paths[v], &glen);
        CHECKF(golden, "%s missing", paths[v]);
        const uint8_t *g = (const uint8_t *)golden;
        if (v != V3) {
            CHECKF(glen == len[v] && !memcmp(g, snap[v], len[v]), "the encoder no longer writes %s (%zu vs %zu bytes)",
                   paths[v], len[v], glen);
        } else {
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
