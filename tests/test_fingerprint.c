/* The model's fingerprint made on first use and remembered across starts
 * (src/arch/model.c, src/arch/fpcache.c): the weight bytes hashed are
 * counted (kvt_tensor_hashed_bytes, kvt_model_fingerprint_runs), so each
 * test says what a start reads, and every value is compared with the
 * architecture's own hash of the weights (kvt_arch.fingerprint), which the
 * golden files of tests/test_snapshot.c pin. Files are ds4-tiny written
 * to a temporary directory (and a synthetic llama when ../shared has its
 * vocabulary); the cache's directory is one of the test's. */
#include "test.h"
#include "fixture.h"
#include "synth_family.h"
#include "arch/model.h"
#include "arch/fpcache.h"
#include "arch/tensor.h"
#include "serve/draft.h"
#include "base/util.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

typedef struct fpx {
    char dir[64], cache[96], a[96], b[96];
} fpx;

static void settle_restore(void *arg) { kvt_fpcache_settle_ns = *(int64_t *)arg; }
static void fault_off(void *arg) { (void)arg; kvt_fpcache_fault = KVT_FPCACHE_FAULT_NONE; }

/* A temporary directory with ds4-tiny (seed 7) at a and seed 8 at b, the
 * cache at cache; entries of files just written allowed (settle 0). */
static bool fpx_make(fpx *x)
{
    static int64_t saved;
    snprintf(x->dir, sizeof x->dir, "/tmp/kvtier-fp-XXXXXX");
    if (!kvt_test_mkdtemp(x->dir)) return false;
    snprintf(x->cache, sizeof x->cache, "%s/cache/fingerprints", x->dir);
    snprintf(x->a, sizeof x->a, "%s/a.gguf", x->dir);
    snprintf(x->b, sizeof x->b, "%s/b.gguf", x->dir);
    saved = kvt_fpcache_settle_ns;
    kvt_test_defer(settle_restore, &saved);
    kvt_test_defer(fault_off, NULL);
    kvt_fpcache_settle_ns = 0;
    for (int i = 0; i < 2; i++) {
        kvt_model *p = NULL;
        int rc = kvt_model_preset(&p, "ds4-tiny", 7 + (uint64_t)i, NULL);
        if (!rc) rc = kvt_model_save(p, i ? x->b : x->a);
        kvt_model_close(p);
        if (rc) { printf("    ds4-tiny: %s\n", kvt_errmsg()); return false; }
    }
    return true;
}

/* A model of path whose cache is dir (NULL: the model's default). */
static kvt_model *open_in(const char *path, const char *dir)
{
    kvt_model *m = NULL;
    if (kvt_model_open(&m, path) != KVT_OK) { printf("    %s: %s\n", path, kvt_errmsg()); return NULL; }
    if (dir && kvt_model_set_fingerprint_dir(m, dir) != KVT_OK) { kvt_model_close(m); return NULL; }
    kvt_test_defer_model(m);
    return m;
}

/* The weights' hash as the architecture makes it, past any cache. */
static uint64_t truth(const kvt_model *m) { return m->arch->fingerprint(m->weights); }

static void counters_zero(void)
{
    kvt_tensor_hashed_bytes = 0;
    kvt_model_fingerprint_runs = 0;
}

/* The fingerprint of path opened with cache dir, its model closed; *runs
 * and *bytes: the hashes it took. */
static uint64_t fp_of(const char *path, const char *dir, uint64_t *runs, uint64_t *bytes)
{
    kvt_model *m = open_in(path, dir);
    if (!m) return 0;
    counters_zero();
    uint64_t fp = kvt_model_fingerprint(m);
    *runs = kvt_model_fingerprint_runs;
    *bytes = kvt_tensor_hashed_bytes;
    kvt_test_release(m);
    return fp;
}

/* The tensor bytes of a GGUF: what "every weight" is. */
static uint64_t tensor_bytes(const char *path)
{
    kvt_gguf *g = NULL;
    uint64_t n = 0;
    if (kvt_gguf_open(&g, path)) return 0;
    for (size_t i = 0; i < kvt_gguf_n_tensors(g); i++) n += kvt_gguf_tensor_at(g, i)->n_bytes;
    kvt_gguf_close(g);
    return n;
}

/* The one entry file in dir: its path into out; false when not exactly one. */
static bool the_entry(const char *dir, char *out, size_t cap)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd, "ls %s 2>/dev/null", dir);
    FILE *p = popen(cmd, "r");
    char line[128], name[128] = "";
    int n = 0;
    while (p && fgets(line, sizeof line, p)) {
        line[strcspn(line, "\n")] = 0;
        snprintf(name, sizeof name, "%s", line);
        n++;
    }
    if (p) pclose(p);
    snprintf(out, cap, "%s/%s", dir, name);
    return n == 1;
}

/* A model file's first start hashes every weight when asked, and only
 * then; the next start of the same file hashes nothing and gives the same
 * 64 bits; a start that never asks hashes nothing. The entry is 0600 in a
 * 0700 directory. */
TEST(fingerprint_lazy_and_remembered)
{
    fpx x;
    CHECK(fpx_make(&x));
    kvt_model *m = open_in(x.a, x.cache);
    CHECK(m);
    uint64_t want = truth(m), all = tensor_bytes(x.a);
    counters_zero();
    kvt_test_release(m);
    m = open_in(x.a, x.cache);
    CHECK(m);
    CHECKF(kvt_tensor_hashed_bytes == 0 && kvt_model_fingerprint_runs == 0, "open hashed %llu bytes",
           (unsigned long long)kvt_tensor_hashed_bytes);
    uint64_t fp = kvt_model_fingerprint(m);
    uint64_t first = kvt_tensor_hashed_bytes;
    printf("    first use: %llu of the file's %llu tensor bytes hashed (the rest: vectors hashed as values)\n",
           (unsigned long long)first, (unsigned long long)all);
    CHECK(fp == want && kvt_model_fingerprint_runs == 1);
    CHECKF(first > all / 2 && first <= all, "hashed %llu of %llu", (unsigned long long)first, (unsigned long long)all);
    CHECK(kvt_model_fingerprint(m) == want && kvt_model_fingerprint_runs == 1); /* once */
    kvt_test_release(m);

    uint64_t runs = 9, bytes = 9;
    CHECK(fp_of(x.a, x.cache, &runs, &bytes) == want);
    printf("    second start: %llu hashes, %llu bytes\n", (unsigned long long)runs, (unsigned long long)bytes);
    CHECK(runs == 0 && bytes == 0);

    counters_zero();
    m = open_in(x.a, x.cache);
    CHECK(m);
    kvt_test_release(m);
    CHECK(kvt_tensor_hashed_bytes == 0 && kvt_model_fingerprint_runs == 0);

    char entry[256];
    CHECK(the_entry(x.cache, entry, sizeof entry));
    struct stat se, sd;
    CHECK(lstat(entry, &se) == 0 && stat(x.cache, &sd) == 0);
    printf("    %s: mode %o, %lld bytes; directory %o\n", strrchr(entry, '/') + 1, (unsigned)(se.st_mode & 0777),
           (long long)se.st_size, (unsigned)(sd.st_mode & 0777));
    CHECK(S_ISREG(se.st_mode) && (se.st_mode & 0777) == 0600 && se.st_size == 112);
    CHECK((sd.st_mode & 0777) == 0700);
}

/* A file just written (its ctime within the settle time of the open) is
 * hashed and not remembered: a change made after the open within the
 * ctime's tick would keep the same stat. */
TEST(fingerprint_fresh_file_not_remembered)
{
    fpx x;
    CHECK(fpx_make(&x));
    kvt_fpcache_settle_ns = 3600 * 1000000000ll;
    uint64_t runs = 0, bytes = 0, fp = fp_of(x.a, x.cache, &runs, &bytes);
    CHECK(fp && runs == 1);
    CHECK(fp_of(x.a, x.cache, &runs, &bytes) == fp && runs == 1);
    char entry[256];
    CHECKF(!the_entry(x.cache, entry, sizeof entry), "an entry for a file of the last hour");
}

/* Several threads asking at once get one hash and one value. */
typedef struct asker { kvt_model *m; uint64_t fp; } asker;
static void *ask(void *p) { asker *a = p; a->fp = kvt_model_fingerprint(a->m); return NULL; }

TEST(fingerprint_threads)
{
    fpx x;
    CHECK(fpx_make(&x));
    kvt_model *m = open_in(x.a, x.cache);
    CHECK(m);
    uint64_t want = truth(m);
    kvt_test_release(m);
    m = open_in(x.a, NULL); /* no entry there: every thread would hash */
    CHECK(m);
    CHECK_OK(kvt_model_set_fingerprint_dir(m, x.dir)); /* a directory without entries */
    kvt_fpcache_settle_ns = 3600 * 1000000000ll;      /* and none written */
    counters_zero();
    enum { T = 6 };
    pthread_t th[T];
    asker a[T];
    for (int i = 0; i < T; i++) {
        a[i] = (asker){m, 0};
        CHECK(pthread_create(&th[i], NULL, ask, &a[i]) == 0);
    }
    bool same = true;
    for (int i = 0; i < T; i++) {
        pthread_join(th[i], NULL);
        same &= a[i].fp == want;
    }
    printf("    %d threads: %llu hash\n", T, (unsigned long long)kvt_model_fingerprint_runs);
    CHECK(same && kvt_model_fingerprint_runs == 1);
}

/* Rewrite one weight of path in place (the same size), and give it back
 * its mtime: only the ctime (which no user can set) and the bytes differ.
 * Waits until the ctime's tick has moved. */
static bool rewrite_in_place(const char *path)
{
    struct stat before, after;
    kvt_gguf *g = NULL;
    if (stat(path, &before) || kvt_gguf_open(&g, path)) return false;
    const kvt_gguf_tensor *t = kvt_gguf_find_tensor(g, "output.weight");
    size_t hl;
    const uint8_t *base = kvt_gguf_header_bytes(g, &hl);
    off_t at = t ? (off_t)((const uint8_t *)t->data - base) : -1;
    kvt_gguf_close(g);
    int fd = at > 0 ? open(path, O_RDWR) : -1;
    uint32_t v;
    bool ok = fd >= 0 && pread(fd, &v, 4, at) == 4;
    v ^= 1u << 20; /* a bit of a float's mantissa */
    ok = ok && pwrite(fd, &v, 4, at) == 4 && !fsync(fd);
    if (fd >= 0) close(fd);
    struct timespec ts[2] = {before.st_atim, before.st_mtim};
    for (int i = 0; ok && i < 5000; i++) {
        ok = !utimensat(AT_FDCWD, path, ts, 0) && !stat(path, &after);
        if (ok && (after.st_ctim.tv_sec != before.st_ctim.tv_sec || after.st_ctim.tv_nsec != before.st_ctim.tv_nsec))
            break;
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    return ok && after.st_size == before.st_size && after.st_mtim.tv_sec == before.st_mtim.tv_sec &&
           after.st_mtim.tv_nsec == before.st_mtim.tv_nsec && after.st_ino == before.st_ino &&
           (after.st_ctim.tv_sec != before.st_ctim.tv_sec || after.st_ctim.tv_nsec != before.st_ctim.tv_nsec);
}

/* The file written in place with the same size and its mtime restored:
 * its ctime differs, the entry misses, the weights are hashed again and
 * the new value remembered. Control: KVT_FPCACHE_FAULT_SIZE_MTIME (an
 * entry matched on size and mtime alone) returns the stale fingerprint,
 * and the test sees it. */
TEST(fingerprint_rewritten_in_place)
{
    fpx x;
    CHECK(fpx_make(&x));
    uint64_t runs = 0, bytes = 0, old = fp_of(x.a, x.cache, &runs, &bytes);
    CHECK(old && runs == 1);
    CHECK(rewrite_in_place(x.a));
    kvt_model *m = open_in(x.a, NULL);
    CHECK(m);
    uint64_t now = truth(m);
    kvt_test_release(m);
    CHECK(now != old);

    kvt_fpcache_fault = KVT_FPCACHE_FAULT_SIZE_MTIME;
    uint64_t stale = fp_of(x.a, x.cache, &runs, &bytes);
    kvt_fpcache_fault = KVT_FPCACHE_FAULT_NONE;
    printf("    keyed by size and mtime: %s fingerprint, %llu hashes\n", stale == old ? "the stale" : "another",
           (unsigned long long)runs);
    CHECKF(stale == old && runs == 0, "the control did not return the stale fingerprint");

    uint64_t fp = fp_of(x.a, x.cache, &runs, &bytes);
    printf("    keyed by the full identity: %s, %llu hash\n", fp == now ? "the new fingerprint" : "WRONG",
           (unsigned long long)runs);
    CHECK(fp == now && runs == 1);
    CHECK(fp_of(x.a, x.cache, &runs, &bytes) == now && runs == 0);
}

/* Another file renamed over the name: the other file's fingerprint. */
TEST(fingerprint_replaced_file)
{
    fpx x;
    CHECK(fpx_make(&x));
    uint64_t runs = 0, bytes = 0, fa = fp_of(x.a, x.cache, &runs, &bytes);
    kvt_model *m = open_in(x.b, NULL);
    CHECK(m);
    uint64_t fb = truth(m);
    kvt_test_release(m);
    CHECK(fa && fb && fa != fb);
    CHECK(rename(x.b, x.a) == 0);
    uint64_t fp = fp_of(x.a, x.cache, &runs, &bytes);
    CHECK(fp == fb && runs == 1);
}

/* Entries damaged in every way the directory can hold them: each a miss
 * (the weights hashed, the right value, a good entry written in its
 * place), never a wrong value; a link's target is left as it was. */
TEST(fingerprint_damaged_entries)
{
    fpx x;
    CHECK(fpx_make(&x));
    uint64_t runs = 0, bytes = 0, want = fp_of(x.a, x.cache, &runs, &bytes);
    char entry[256], victim[160], aside[160];
    CHECK(want && the_entry(x.cache, entry, sizeof entry));
    size_t len = 0;
    uint8_t *good = (uint8_t *)kvt_test_read_file(entry, &len);
    kvt_test_defer_free(good);
    CHECK(good && len == 112);
    /* b's entry: well made, another file's */
    snprintf(aside, sizeof aside, "%s/aside", x.dir);
    CHECK(rename(x.cache, aside) == 0);
    char moved[320];
    snprintf(moved, sizeof moved, "%s/%s", aside, strrchr(entry, '/') + 1);
    CHECK(unlink(moved) == 0); /* a's entry, so that b's is the one there */
    uint64_t fb = fp_of(x.b, aside, &runs, &bytes);
    char bentry[256];
    CHECK(fb && the_entry(aside, bentry, sizeof bentry));
    size_t blen = 0;
    uint8_t *foreign = (uint8_t *)kvt_test_read_file(bentry, &blen);
    kvt_test_defer_free(foreign);
    CHECK(foreign && blen == 112);
    CHECK(mkdir(x.cache, 0700) == 0);
    snprintf(victim, sizeof victim, "%s/victim", x.dir);

    enum { TRUNC, LONG, MAGIC, FLIP, VERSION, DEF, FOREIGN, LINK, MODE, FIFO, DIR_, EMPTY, NKIND };
    static const char *const names[NKIND] = {"truncated", "a byte longer", "another magic", "a flipped fingerprint bit",
                                             "another version", "another definition", "another file's entry",
                                             "a link to a good entry", "mode 0644", "a fifo", "a directory", "empty"};
    for (int k = 0; k < NKIND; k++) {
        unlink(entry);
        rmdir(entry);
        uint8_t e[120];
        memcpy(e, good, 112);
        size_t n = 112;
        bool ok = true;
        switch (k) {
        case TRUNC: n = 60; break;
        case LONG: e[112] = 0; n = 113; break;
        case MAGIC: memcpy(e, "GGUFGGUF", 8); break;
        case FLIP: e[96] ^= 1; break;
        case VERSION: e[8] = 2; break;
        case DEF: e[16] ^= 1; break;
        case FOREIGN: memcpy(e, foreign, 112); break;
        case EMPTY: n = 0; break;
        default: break;
        }
        /* checksummed anew but FLIP's: the field's own check must refuse it */
        if (k == MAGIC || k == VERSION || k == DEF) {
            uint64_t c = XXH3_64bits(e, 104);
            memcpy(e + 104, &c, 8);
        }
        if (k == LINK) {
            ok = fx_write_file(victim, good, 112) && chmod(victim, 0600) == 0 && symlink(victim, entry) == 0;
        } else if (k == FIFO) {
            ok = mkfifo(entry, 0600) == 0;
        } else if (k == DIR_) {
            ok = mkdir(entry, 0700) == 0;
        } else {
            ok = fx_write_file(entry, e, n) && chmod(entry, k == MODE ? 0644 : 0600) == 0;
        }
        CHECKF(ok, "%s: cannot plant it: %s", names[k], strerror(errno));
        uint64_t fp = fp_of(x.a, x.cache, &runs, &bytes);
        struct stat st;
        bool rewritten = lstat(entry, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 0777) == 0600;
        size_t nl = 0;
        uint8_t *now = rewritten ? (uint8_t *)kvt_test_read_file(entry, &nl) : NULL;
        rewritten = rewritten && nl == 112 && !memcmp(now, good, 112);
        free(now);
        printf("    %-26s %s, %llu hash, %s\n", names[k], fp == want ? "the right value" : "A WRONG VALUE",
               (unsigned long long)runs, rewritten ? "entry rewritten" : "not rewritten");
        CHECKF(fp == want && runs == 1, "%s", names[k]);
        CHECKF(rewritten || k == DIR_, "%s: no good entry after", names[k]); /* a directory stays */
        if (k == LINK) {
            size_t vl = 0;
            uint8_t *v = (uint8_t *)kvt_test_read_file(victim, &vl);
            bool same = v && vl == 112 && !memcmp(v, good, 112);
            free(v);
            CHECKF(same, "the link's target was written");
        }
    }
    /* a good entry after all that: a hit */
    rmdir(entry);
    CHECK(fx_write_file(entry, good, 112) && chmod(entry, 0600) == 0);
    CHECK(fp_of(x.a, x.cache, &runs, &bytes) == want && runs == 0);
    /* a directory others may write is not used (a miss, nothing written) */
    CHECK(chmod(x.cache, 0777) == 0);
    CHECK(fp_of(x.a, x.cache, &runs, &bytes) == want && runs == 1);
    CHECK(chmod(x.cache, 0700) == 0);
}

/* Presets have no file: made on first use as before, once per model, no
 * entry written. A separate MTP layer attached leaves the fingerprint that
 * of the model as opened (the control: the weights hashed after the attach
 * give another value, so the order matters). */
TEST(fingerprint_presets_and_mtp)
{
    fpx x;
    CHECK(fpx_make(&x));
    kvt_model *p = NULL, *q = NULL;
    CHECK_OK(kvt_model_preset(&p, "ds4-tiny", 7, NULL));
    kvt_test_defer_model(p);
    CHECK_OK(kvt_model_set_fingerprint_dir(p, x.cache));
    counters_zero();
    uint64_t fp = kvt_model_fingerprint(p);
    CHECK(fp == truth(p) && kvt_model_fingerprint_runs == 1 && kvt_model_fingerprint(p) == fp &&
          kvt_model_fingerprint_runs == 1);
    struct stat st;
    CHECK(stat(x.cache, &st) != 0); /* nothing written */
    /* the file saved from the preset has its fingerprint */
    uint64_t runs = 0, bytes = 0;
    CHECK(fp_of(x.a, x.cache, &runs, &bytes) == fp);

    char mtp[128];
    snprintf(mtp, sizeof mtp, "%s/mtp.gguf", x.dir);
    CHECK_OK(kvt_model_preset(&q, "ds4-tiny+mtp=1", 7, NULL));
    kvt_test_defer_model(q);
    CHECK_OK(kvt_draft_mtp_write(q, mtp));
    kvt_model *m = open_in(x.a, x.cache);
    CHECK(m);
    CHECK_OK(kvt_draft_mtp_attach(m, mtp));
    uint64_t after = truth(m);
    printf("    with the MTP layer attached: %s; its weights hashed after it: %s\n",
           kvt_model_fingerprint(m) == fp ? "the model's fingerprint" : "ANOTHER",
           after != fp ? "another value" : "the same value");
    CHECK(kvt_model_fingerprint(m) == fp);
    CHECK(after != fp);
}

/* The llama family's files the same way (a synthetic llama on
 * ../shared's vocabulary): remembered, and missed once rewritten. */
TEST(fingerprint_llama_file)
{
    const char *vocab = kvt_test_shared("vocab/ggml-vocab-llama-spm.gguf");
    if (!vocab) SKIP("../shared/vocab absent");
    char vpath[1024];
    snprintf(vpath, sizeof vpath, "%s", vocab);
    fpx x;
    CHECK(fpx_make(&x));
    const fam_spec f = {"llama", false, false, FAM_HEAD_DIM, false, false, false};
    CHECK_OK(fam_write(x.b, vpath, 3, FAM_ROPE_BASE, &f, false));
    kvt_model *m = open_in(x.b, NULL);
    CHECK(m);
    uint64_t want = truth(m);
    kvt_test_release(m);
    uint64_t runs = 0, bytes = 0;
    CHECK(fp_of(x.b, x.cache, &runs, &bytes) == want && runs == 1 && bytes > 0);
    CHECK(fp_of(x.b, x.cache, &runs, &bytes) == want && runs == 0 && bytes == 0);
}

/* The entry's bytes are pinned by a golden file per version
 * (tests/golden/fpcache-v1.bin, docs/FORMAT.md "Fingerprint cache files"):
 * today's writer must produce it byte for byte for a fixed identity, and
 * today's reader must take it back to the same fingerprint (and miss it for
 * an identity one nanosecond of ctime away). KVT_WRITE_GOLDEN=1 rewrites it
 * (only when the entry's version changes). */
TEST(fingerprint_golden_v1)
{
    char dir[] = "/tmp/kvt-fpgold-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir));
    const kvt_fp_id id = {.dev = 0x801, .ino = 1234567, .size = 1537900, .mtime_s = 1764979200, .mtime_ns = 123456789,
                          .ctime_s = 1764979201, .ctime_ns = 987654321, .seen_s = 1764990000, .seen_ns = 0,
                          .header_len = 4096, .header_hash = 0x0123456789abcdefull};
    const uint64_t fp = 0xfedcba9876543210ull;
    CHECK_OK(kvt_fpcache_put(dir, &id, fp));
    /* the one entry the put wrote */
    char cmd[160], name[64] = {0}, path[160];
    snprintf(cmd, sizeof cmd, "ls %s", dir);
    FILE *f = popen(cmd, "r");
    CHECK(f && fgets(name, sizeof name, f));
    pclose(f);
    name[strcspn(name, "\n")] = 0;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    size_t len = 0, glen = 0;
    char *e = kvt_test_read_file(path, &len);
    CHECK(e);
    uint8_t *golden = fx_golden("tests/golden/fpcache-v1.bin", e, len, true, &glen);
    free(e);
    CHECKF(golden, "the golden file tests/golden/fpcache-v1.bin (above)");
    /* the golden bytes in place of the entry: read back */
    FILE *w = fopen(path, "wb");
    CHECK(w && fwrite(golden, 1, glen, w) == glen && fclose(w) == 0);
    free(golden);
    uint64_t got = 0;
    CHECKF(kvt_fpcache_get(dir, &id, &got) && got == fp, "the golden entry read back: %016llx",
           (unsigned long long)got);
    kvt_fp_id other = id;
    other.ctime_ns++;
    CHECKF(!kvt_fpcache_get(dir, &other, &got), "the golden entry matched another ctime");
}

/* ---- the bound on the cache's entries ---- */

/* A regular file of 112 bytes at dir/name, 0600, its mtime mtime (s). */
static bool plant(const char *dir, const char *name, int64_t mtime)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    uint8_t e[112] = {0};
    bool ok = fd >= 0 && write(fd, e, sizeof e) == (ssize_t)sizeof e;
    if (fd >= 0 && close(fd)) ok = false;
    struct timespec ts[2] = {{(time_t)mtime, 0}, {(time_t)mtime, 0}};
    return ok && !utimensat(AT_FDCWD, path, ts, AT_SYMLINK_NOFOLLOW);
}

/* What lstat says of dir/name (name NULL: of dir): 'f' a regular file,
 * 'l' a link, 0 nothing. */
static char kind(const char *dir, const char *name)
{
    char path[256];
    struct stat st;
    snprintf(path, sizeof path, "%s%s%s", dir, name ? "/" : "", name ? name : "");
    if (lstat(path, &st)) return 0;
    return S_ISLNK(st.st_mode) ? 'l' : S_ISREG(st.st_mode) ? 'f' : '?';
}

/* The entry's name of an identity, as fpcache.c makes it. */
static void entry_of(const kvt_fp_id *id, char *out, size_t cap)
{
    uint64_t k[2] = {id->dev, id->ino};
    snprintf(out, cap, "fp-%016llx", (unsigned long long)XXH3_64bits(k, sizeof k));
}

static void planted_name(size_t i, char *out, size_t cap) { snprintf(out, cap, "fp-%016llx", 0x1000ull + i); }

/* The directory after the put of fingerprint_cache_bounded: what it must
 * hold, each miss printed. */
static bool bounded_ok(const char *dir, const char *a, const char *b, const char *target)
{
    size_t n = KVT_FPCACHE_MAX_ENTRIES;
    bool ok = true;
    char name[32];
    size_t kept = 0, gone_old = 0;
    for (size_t i = 0; i < n + 5; i++) {
        planted_name(i, name, sizeof name);
        bool here = kind(dir, name) == 'f';
        kept += here;
        if (i < 7 && !here) gone_old++;
        if (i >= 7 && !here) { printf("    %s (planted %zu, among the newest) removed\n", name, i); ok = false; }
    }
    if (gone_old != 7) { printf("    %zu of the 7 oldest removed\n", gone_old); ok = false; }
    if (kind(dir, a) != 'f') { printf("    the entry just used (the oldest written) removed\n"); ok = false; }
    if (kind(dir, b) != 'f') { printf("    the entry just written removed\n"); ok = false; }
    if (kind(dir, "fp-00000000000000ff") != 'l' || kind(target, NULL) != 'f') {
        printf("    the planted link or its target removed\n");
        ok = false;
    }
    if (kind(dir, "notes.txt") != 'f' || kind(dir, "fp-0000000000000001.tmp-1-0") != 'f') {
        printf("    a foreign file removed\n");
        ok = false;
    }
    size_t entries = kept + (kind(dir, a) == 'f') + (kind(dir, b) == 'f');
    printf("    %zu entries left of %zu (bound %zu)\n", entries, n + 7, n);
    return ok && entries == n;
}

/* The cache keeps KVT_FPCACHE_MAX_ENTRIES entries: a directory with N + 5
 * entries (mtimes a second apart), an older entry just used (a hit, which
 * sets its mtime), a link named as an entry to a file outside, and two
 * foreign files (one a writer's temporary name) gets a put: N entries
 * are left, the 7 least recently used gone, the one just used and the one
 * just written kept, the link, its target and the foreign files left
 * alone. Negative controls: KVT_FPCACHE_FAULT_TRIM_ANY (every name
 * counted and removed, links by their targets' mtime) removes the link
 * and the foreign files; KVT_FPCACHE_FAULT_NO_TOUCH (a hit leaves the
 * mtime) removes the entry just used; the test says so for each. */
TEST(fingerprint_cache_bounded)
{
    char base[] = "/tmp/kvt-fpbound-XXXXXX";
    CHECK(kvt_test_mkdtemp(base));
    kvt_test_defer(fault_off, NULL);
    const int faults[] = {KVT_FPCACHE_FAULT_NONE, KVT_FPCACHE_FAULT_TRIM_ANY, KVT_FPCACHE_FAULT_NO_TOUCH};
    const char *what[] = {"", "KVT_FPCACHE_FAULT_TRIM_ANY", "KVT_FPCACHE_FAULT_NO_TOUCH"};
    int64_t now = (int64_t)time(NULL), t0 = now - 1000000;
    for (int c = 0; c < 3; c++) {
        char dir[96], target[96], path[160], a[32], b[32];
        snprintf(dir, sizeof dir, "%s/fp%d", base, c);
        snprintf(target, sizeof target, "%s/target%d", base, c);
        CHECK(mkdir(dir, 0700) == 0);
        kvt_fp_id ia = {.dev = 1, .ino = 1, .size = 100, .ctime_s = 1000, .seen_s = now, .header_len = 1},
                  ib = {.dev = 1, .ino = 2, .size = 100, .ctime_s = 1000, .seen_s = now, .header_len = 1};
        entry_of(&ia, a, sizeof a);
        entry_of(&ib, b, sizeof b);
        /* a: written first and oldest of all, then used */
        CHECK_OK(kvt_fpcache_put(dir, &ia, 0xaaaa));
        snprintf(path, sizeof path, "%s/%s", dir, a);
        struct timespec old[2] = {{(time_t)(t0 - 100), 0}, {(time_t)(t0 - 100), 0}};
        CHECK(utimensat(AT_FDCWD, path, old, 0) == 0);
        char name[32];
        for (size_t i = 0; i < KVT_FPCACHE_MAX_ENTRIES + 5; i++) {
            planted_name(i, name, sizeof name);
            CHECK(plant(dir, name, t0 + (int64_t)i));
        }
        CHECK(plant(dir, "notes.txt", t0 - 50) && plant(dir, "fp-0000000000000001.tmp-1-0", t0 - 50));
        CHECK(plant(base, strrchr(target, '/') + 1, t0 - 50));
        snprintf(path, sizeof path, "%s/fp-00000000000000ff", dir);
        CHECK(symlink(target, path) == 0);
        kvt_fpcache_fault = faults[c];
        uint64_t got = 0;
        bool hit = kvt_fpcache_get(dir, &ia, &got);
        int rc = kvt_fpcache_put(dir, &ib, 0xbbbb);
        kvt_fpcache_fault = KVT_FPCACHE_FAULT_NONE;
        CHECK(hit && got == 0xaaaa);
        CHECK_OK(rc);
        if (c) printf("    negative control, %s (must be caught):\n", what[c]);
        bool ok = bounded_ok(dir, a, b, target);
        if (!c) CHECKF(ok, "the bound");
        else CHECKF(!ok, "control: %s went unnoticed", what[c]);
        if (!c) CHECK(kvt_fpcache_get(dir, &ib, &got) && got == 0xbbbb);
    }
}
