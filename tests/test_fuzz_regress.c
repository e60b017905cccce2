/* The fuzz targets' inputs as ordinary tests (tests/fuzz/README.md): every
 * file under tests/fuzz/regress/<target>/ (a crasher or a broken property
 * the fuzzer found, kept once fixed) and under tests/fuzz/seeds/<target>/
 * goes through the same fuzz_<target> function the libFuzzer binary runs,
 * from an exact-size heap copy, so `make asan` replays them under the
 * sanitizers. A property the target checks (FUZZ_CHECK) fails the test
 * with the file's name. Run from the repository root, as `make test` does.
 * fuzz_fix_records checks the targets' record repair on the golden files. */
#include "test.h"
#include "fuzz/fuzz.h"
#include "session/snapshot.h"
#include "base/util.h"

#include <dirent.h>
#include <stdlib.h>
#include <string.h>

typedef int (*fuzz_fn)(const uint8_t *, size_t);
static const struct { const char *name; fuzz_fn fn; } targets[] = {
#define FUZZ_ENTRY(t) {#t, fuzz_##t},
    FUZZ_TARGETS(FUZZ_ENTRY)
#undef FUZZ_ENTRY
};

static char failed_msg[1024];
static int n_failed;

static void on_fail(const char *msg)
{
    if (!n_failed++) snprintf(failed_msg, sizeof failed_msg, "%s", msg);
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Run every file of dir/<target>/; the number of files in *n_files. False
 * (with a message) at the first input that breaks a property. */
static bool replay(const char *dir, size_t *n_files)
{
    *n_files = 0;
    for (size_t t = 0; t < sizeof targets / sizeof *targets; t++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, targets[t].name);
        DIR *d = opendir(path);
        if (!d) continue;
        char *names[4096];
        size_t n = 0;
        for (struct dirent *e; (e = readdir(d)) && n < 4096;)
            if (e->d_name[0] != '.' && strcmp(e->d_name, "README.md")) names[n++] = strdup(e->d_name);
        closedir(d);
        qsort(names, n, sizeof *names, by_name);
        bool ok = true;
        for (size_t i = 0; i < n; i++) {
            if (!names[i] || !ok) { free(names[i]); continue; }
            snprintf(path, sizeof path, "%s/%s/%s", dir, targets[t].name, names[i]);
            size_t len = 0;
            char *data = kvt_test_read_file(path, &len);
            if (!data) {
                printf("    cannot read %s\n", path);
                ok = false;
            } else {
                /* exactly len bytes: an over-read is past the allocation */
                uint8_t *copy = malloc(len ? len : 1);
                memcpy(copy, data, len);
                free(data);
                n_failed = 0;
                fuzz_fail_hook = on_fail;
                targets[t].fn(copy, len);
                fuzz_fail_hook = NULL;
                free(copy);
                (*n_files)++;
                if (n_failed) {
                    printf("    %s: %d properties broken, the first: %s\n", path, n_failed, failed_msg);
                    ok = false;
                }
            }
            free(names[i]);
        }
        if (!ok) return false;
    }
    return true;
}

TEST(fuzz_regress)
{
    size_t n = 0;
    bool ok = replay("tests/fuzz/regress", &n);
    printf("    %zu inputs under tests/fuzz/regress/\n", n);
    CHECKF(ok, "a saved fuzz input fails again");
}

TEST(fuzz_regress_seeds)
{
    size_t n = 0;
    bool ok = replay("tests/fuzz/seeds", &n);
    if (n == 0) SKIP("no tests/fuzz/seeds/ (not run from the repository root?)");
    printf("    %zu inputs under tests/fuzz/seeds/\n", n);
    CHECKF(ok, "a seed breaks a property");
}

/* The snapshot target repairs what the checksums would refuse
 * (fuzz_fix_snapshot, fuzz_fix_record) for every section count the format
 * has: on the golden files of 6 sections (versions 2 and 6, with blocks
 * inline) and of 7 (version 5, the recurrent section last), an intact
 * record is left byte for byte as it is, and one with a byte of its last
 * section and of its last block (when it has one) changed parses again
 * after the repair, its header checksum where its section count puts it.
 * Against the repair of 6 sections only, the version 5 record fails both. */
TEST(fuzz_fix_records)
{
    static const struct { const char *path; uint32_t nsec; } g[] = {
        {"tests/golden/snapshot-v2-ds4-tiny-300.bin", 6},
        {"tests/golden/snapshot-v6-gemma3-130.bin", 6},
        {"tests/golden/snapshot-v5-qwen35-5.bin", 7},
    };
    for (size_t i = 0; i < sizeof g / sizeof *g; i++) {
        size_t len = 0;
        uint8_t *p = (uint8_t *)kvt_test_read_file(g[i].path, &len);
        CHECKF(p, "%s missing", g[i].path);
        kvt_snap_info in;
        CHECK_OK(kvt_snap_parse_raw(p, len, &in));
        CHECK(in.nsec == g[i].nsec && fuzz_record_header(p, len) == 64 + 24 * (size_t)in.nsec + 8);
        uint8_t *q = malloc(len);
        CHECK(q);
        memcpy(q, p, len);
        fuzz_fix_snapshot(q, len, 0, 0);
        CHECKF(!memcmp(p, q, len), "%s: the repair changed an intact record of %u sections", g[i].path, in.nsec);
        /* a byte of the last section (and of the blocks' rows) changed */
        q[in.sec[in.nsec] - p + in.sec_len[in.nsec] / 2] ^= 0x5a;
        if (len - in.rec_len > 600) q[len - 100] ^= 0x5a;
        CHECK(kvt_snap_parse_raw(q, len, &in) == KVT_ECORRUPT);
        fuzz_fix_snapshot(q, len, 0, 0);
        int rc = kvt_snap_parse_raw(q, len, &in);
        CHECKF(rc == KVT_OK, "%s: a record of %u sections does not parse after the repair: %s", g[i].path,
               g[i].nsec, kvt_errmsg());
        size_t off = in.rec_len, nb = 0; /* the blocks after it check out */
        while (len - off >= KVT_SNAP_BLOCK_HEAD + 8) {
            size_t bl = KVT_SNAP_BLOCK_HEAD + (size_t)kvt_rd32(q + off + 44) + 8;
            uint64_t key = 0;
            CHECK(bl <= len - off);
            CHECKF(kvt_snap_block_check(q + off, bl, &key) == KVT_OK, "%s: block %zu after the repair: %s", g[i].path,
                   nb, kvt_errmsg());
            off += bl;
            nb++;
        }
        CHECK(off == len && nb == in.nb);
        printf("    %s: %u sections, %zu blocks inline: repaired\n", g[i].path, in.nsec, nb);
        free(q);
        free(p);
    }
}
