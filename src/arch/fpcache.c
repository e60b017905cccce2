/* The fingerprint cache: one small file per model file, holding the model's
 * fingerprint (kvt_arch.fingerprint, XXH3 over the configuration and every
 * weight) under the file's identity, so that a later start of the same file
 * reads 112 bytes instead of hashing the whole file (80-160 GB for
 * DeepSeek-V4-Flash).
 *
 * A wrong fingerprint would let a model load cache entries of another
 * model, so every doubt is a miss, never a guess: the entry is found by
 * (st_dev, st_ino) and must match the stat fields a change to the file
 * changes (size, mtime, and ctime, which a user cannot set back) and the
 * hash of the header's bytes; its own bytes are checked (size, magic,
 * version, the fingerprint definition, a checksum) and it is read only as a
 * regular, private file of the user's, never through a link. A miss costs
 * one hash, as every start paid before. The format is docs/FORMAT.md's
 * "Fingerprint cache files".
 *
 * One entry per model file ever opened would grow without end: a put
 * keeps the directory to KVT_FPCACHE_MAX_ENTRIES, removing the entries
 * used least recently (a hit sets the entry's mtime). Removing an entry
 * another process is about to read costs that process one hash. */
#include "arch/fpcache.h"
#include "base/util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

/* The entry, little-endian (the machines kvtier runs on), 112 bytes:
 *   0  magic "KVTFPRNT"          8  u32 version (1), u32 0
 *  16  u64 definition           24  u64 st_dev, 32 st_ino, 40 st_size
 *  48  i64 mtime s, 56 ns       64  i64 ctime s, 72 ns
 *  80  u64 header bytes         88  u64 XXH3-64 of them
 *  96  u64 fingerprint         104  u64 XXH3-64 of bytes 0..104 */
#define ENTRY_BYTES 112
#define ENTRY_VERSION 1
static const char entry_magic[8] = {'K', 'V', 'T', 'F', 'P', 'R', 'N', 'T'};
/* The fingerprint's definition: bump FP_DEFINITION whenever any row's
 * kvt_arch.fingerprint changes what it hashes (the golden files of
 * docs/FORMAT.md then change too): entries of the old definition miss. */
#define FP_DEFINITION "kvt_arch.fingerprint 2: XXH3-64 of each row's configuration and weights (Qwen 3.5's MTP layer apart)"

int64_t kvt_fpcache_settle_ns = 2000000000;
const char *kvt_fpcache_dir_for_tests;
int kvt_fpcache_fault;

static uint64_t definition(void) { return XXH3_64bits(FP_DEFINITION, sizeof FP_DEFINITION - 1); }

bool kvt_fpcache_id(const kvt_gguf *g, kvt_fp_id *id)
{
    struct stat st;
    struct timespec seen;
    if (!kvt_gguf_file_stat(g, &st, &seen)) return false;
    size_t hl;
    const void *h = kvt_gguf_header_bytes(g, &hl);
    *id = (kvt_fp_id){(uint64_t)st.st_dev, (uint64_t)st.st_ino, (uint64_t)st.st_size,
                      (int64_t)st.st_mtim.tv_sec, (int64_t)st.st_mtim.tv_nsec,
                      (int64_t)st.st_ctim.tv_sec, (int64_t)st.st_ctim.tv_nsec,
                      (int64_t)seen.tv_sec, (int64_t)seen.tv_nsec, (uint64_t)hl, XXH3_64bits(h, hl)};
    return true;
}

bool kvt_fpcache_default_dir(char *out, size_t cap)
{
    const char *x = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    int n;
    if (kvt_fpcache_dir_for_tests) n = snprintf(out, cap, "%s", kvt_fpcache_dir_for_tests);
    else if (x && *x) n = snprintf(out, cap, "%s/kvtier/fingerprints", x);
    else if (home && *home) n = snprintf(out, cap, "%s/.cache/kvtier/fingerprints", home);
    else return false;
    return n > 0 && (size_t)n < cap;
}

/* The entry's name in its directory: one per (device, inode), so a file
 * changed in place replaces its entry rather than adding one. */
static void entry_name(const kvt_fp_id *id, char *out, size_t cap)
{
    uint64_t k[2] = {id->dev, id->ino};
    snprintf(out, cap, "fp-%016" PRIx64, XXH3_64bits(k, sizeof k));
}

static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

static void encode(uint8_t *e, const kvt_fp_id *id, uint64_t fp)
{
    memset(e, 0, ENTRY_BYTES);
    memcpy(e, entry_magic, 8);
    uint32_t v = ENTRY_VERSION;
    memcpy(e + 8, &v, 4);
    uint64_t f[] = {definition(), id->dev, id->ino, id->size, (uint64_t)id->mtime_s, (uint64_t)id->mtime_ns,
                    (uint64_t)id->ctime_s, (uint64_t)id->ctime_ns, id->header_len, id->header_hash, fp};
    for (size_t i = 0; i < sizeof f / sizeof *f; i++) put64(e + 16 + 8 * i, f[i]);
    put64(e + 104, XXH3_64bits(e, 104));
}

/* The directory opened for entries: a directory of the user's that no one
 * else may write (a link to one is followed, as a user's ~/.cache often
 * is; what it names is checked). -1: none such (a miss, nothing written). */
static int open_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    struct stat sb;
    if (fd < 0) return -1;
    if (fstat(fd, &sb) || !S_ISDIR(sb.st_mode) || sb.st_uid != geteuid() || (sb.st_mode & 022)) {
        close(fd);
        return -1;
    }
    return fd;
}

bool kvt_fpcache_get(const char *dir, const kvt_fp_id *id, uint64_t *fp)
{
    if (!dir) return false;
    int dfd = open_dir(dir);
    if (dfd < 0) return false;
    char name[32];
    entry_name(id, name, sizeof name);
    /* O_NONBLOCK: a fifo planted at the name must not hang the open */
    int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    close(dfd);
    if (fd < 0) return false;
    uint8_t e[ENTRY_BYTES + 1], want[ENTRY_BYTES];
    struct stat sb;
    bool ok = !fstat(fd, &sb) && S_ISREG(sb.st_mode) && sb.st_uid == geteuid() && !(sb.st_mode & 077) &&
              sb.st_size == ENTRY_BYTES;
    /* read one byte more than an entry: a file grown since the fstat is refused too */
    ssize_t n = ok ? pread(fd, e, sizeof e, 0) : -1;
    if (n != ENTRY_BYTES || memcmp(e, entry_magic, 8) || kvt_rd32(e + 8) != ENTRY_VERSION || kvt_rd32(e + 12) ||
        kvt_rd64(e + 104) != XXH3_64bits(e, 104)) {
        close(fd);
        return false;
    }
    uint64_t got = kvt_rd64(e + 96);
    encode(want, id, got);
    if (kvt_fpcache_fault == KVT_FPCACHE_FAULT_SIZE_MTIME) { /* the negative control: size and mtime alone */
        ok = !memcmp(e + 40, want + 40, 24);
    } else {
        ok = !memcmp(e, want, ENTRY_BYTES);
    }
    /* used now: the trim of a put removes the least recently used first
     * (the owner may set the times of a file it only reads) */
    if (ok && kvt_fpcache_fault != KVT_FPCACHE_FAULT_NO_TOUCH) (void)futimens(fd, NULL);
    close(fd);
    if (ok) *fp = got;
    return ok;
}

/* An entry's name: "fp-" and 16 lowercase hex digits (entry_name), nothing
 * else (a temporary file has a suffix). */
static bool is_entry_name(const char *n)
{
    if (strncmp(n, "fp-", 3) || strlen(n) != 19) return false;
    for (const char *c = n + 3; *c; c++)
        if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f'))) return false;
    return true;
}

typedef struct aged { char name[20]; int64_t s, ns; } aged;

/* Newest first; equal times by name, so the order is total. */
static int newer_first(const void *pa, const void *pb)
{
    const aged *a = pa, *b = pb;
    if (a->s != b->s) return a->s > b->s ? -1 : 1;
    if (a->ns != b->ns) return a->ns > b->ns ? -1 : 1;
    return strcmp(a->name, b->name);
}

/* Keep the directory's entries to KVT_FPCACHE_MAX_ENTRIES: the least
 * recently used past them are removed. Only regular files named as
 * entries count, as lstat sees them (a link, even to an entry, and every
 * other name are left alone); a name another process removed or replaced
 * meanwhile is skipped or removed as found (a miss for whoever wanted
 * it). Out of memory: nothing removed. */
static void trim(int dfd)
{
    int fd = dup(dfd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        if (fd >= 0) close(fd);
        return;
    }
    bool any = kvt_fpcache_fault == KVT_FPCACHE_FAULT_TRIM_ANY; /* tests: the negative control */
    aged *v = NULL;
    size_t n = 0, cap = 0;
    bool oom = false;
    struct dirent *de;
    while (!oom && (de = readdir(d))) {
        if (any ? de->d_name[0] == '.' || strlen(de->d_name) >= sizeof v->name : !is_entry_name(de->d_name)) continue;
        struct stat st;
        if (fstatat(dfd, de->d_name, &st, any ? 0 : AT_SYMLINK_NOFOLLOW) || (!any && !S_ISREG(st.st_mode))) continue;
        if (n == cap) {
            size_t nc = cap ? 2 * cap : 2 * KVT_FPCACHE_MAX_ENTRIES;
            aged *nv = realloc(v, nc * sizeof *nv);
            if (!nv) { oom = true; break; }
            v = nv;
            cap = nc;
        }
        snprintf(v[n].name, sizeof v[n].name, "%s", de->d_name);
        v[n].s = (int64_t)st.st_mtim.tv_sec;
        v[n].ns = (int64_t)st.st_mtim.tv_nsec;
        n++;
    }
    closedir(d);
    if (!oom && n > KVT_FPCACHE_MAX_ENTRIES) {
        qsort(v, n, sizeof *v, newer_first);
        for (size_t i = KVT_FPCACHE_MAX_ENTRIES; i < n; i++) (void)unlinkat(dfd, v[i].name, 0); /* ENOENT: gone already */
    }
    free(v);
}

/* mkdir -p, 0700 for what it makes. */
static int make_dirs(const char *dir)
{
    char p[4096];
    if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p) return KVT_EINVAL;
    for (char *c = p + 1;; c++) {
        if (*c && *c != '/') continue;
        char save = *c;
        *c = 0;
        if (mkdir(p, 0700) && errno != EEXIST) return KVT_EIO;
        *c = save;
        if (!save) return KVT_OK;
    }
}

int kvt_fpcache_put(const char *dir, const kvt_fp_id *id, uint64_t fp)
{
    if (!dir) return KVT_EINVAL;
    /* racy: a change after the open, within the ctime's tick, would keep
     * it; such a file is hashed again at its next start */
    int64_t lim_s = id->seen_s - kvt_fpcache_settle_ns / 1000000000,
            lim_ns = id->seen_ns - kvt_fpcache_settle_ns % 1000000000;
    if (lim_ns < 0) lim_ns += 1000000000, lim_s--;
    if (id->ctime_s > lim_s || (id->ctime_s == lim_s && id->ctime_ns >= lim_ns)) return KVT_OK;
    if (make_dirs(dir)) return KVT_EIO;
    int dfd = open_dir(dir);
    if (dfd < 0) return KVT_EIO;
    char name[32], tmp[80];
    static _Atomic unsigned seq;
    entry_name(id, name, sizeof name);
    snprintf(tmp, sizeof tmp, "%s.tmp-%ld-%u", name, (long)getpid(), seq++);
    uint8_t e[ENTRY_BYTES];
    encode(e, id, fp);
    int rc = KVT_EIO;
    int fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0) {
        /* 0600 whatever the umask */
        bool ok = !fchmod(fd, 0600) && write(fd, e, sizeof e) == (ssize_t)sizeof e && !fsync(fd);
        if (close(fd)) ok = false;
        if (ok && !renameat(dfd, tmp, dfd, name)) {
            fsync(dfd);
            rc = KVT_OK;
            trim(dfd);
        } else {
            unlinkat(dfd, tmp, 0);
        }
    }
    close(dfd);
    return rc;
}
