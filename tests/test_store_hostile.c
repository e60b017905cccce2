/* The disk tier under a hostile local user and an unlucky disk (issue 36):
 *
 *   store_hostile_planted_links   a link at kvtier.db (to a victim's file,
 *                                 dangling), its WAL, its shared memory or a
 *                                 segment is refused and never written
 *                                 through
 *   store_hostile_shared_dir      a directory others may write (0777, 0770)
 *                                 or another user's is refused with why and
 *                                 how to fix it; nothing is created in it
 *   store_hostile_private_modes   under a umask of 0, the directories are
 *                                 0700 and every file 0600 (the database, its
 *                                 WAL and shared memory, the segments); a
 *                                 0755 directory of the user's is tightened
 *   store_hostile_ns_names        a key's directory name is keyed with the
 *                                 store's secret (0600, made once), tells
 *                                 nothing of the key, and an old-named
 *                                 directory is renamed with its entries
 *   store_hostile_full_disk       on an 8 MiB tmpfs: free space is kept, no
 *                                 save fails; a disk filled by another file
 *                                 is met by evicting; `cache gc` and
 *                                 `cache verify` work on the full disk and
 *                                 verify on a read-only one
 *   store_hostile_report_rate     failed saves print a line a minute
 *
 * The checks made through the binary (KVT_BIN) fail on a build without
 * the fixes (KVT_BIN=/work/main/build/kvtier: the link is written through,
 * the 0777 directory used, the files 0644, gc and verify fail on the full
 * disk). The free-space checks fail with kvt_store_room_fault set. */
#include "test.h"
#include "store/testing.h"
#include "fixture.h"
#include "store/storedir.h"
#include "store/store.h"
#include "base/util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

static void rm_rf(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) {}
}

/* A fresh 0755 directory of its own under /tmp. */
static bool scratch(char *out, size_t cap, const char *tag)
{
    snprintf(out, cap, "/tmp/kvtier-hostile-%s-XXXXXX", tag);
    return kvt_test_mkdtemp(out) && chmod(out, 0755) == 0;
}

static int mode_of(const char *path)
{
    struct stat sb;
    return lstat(path, &sb) == 0 ? (int)(sb.st_mode & 07777) : -1;
}

static bool write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f) return false;
    fputs(text, f);
    return fclose(f) == 0;
}

/* `KVT_BIN args...` with its output in dir/cli.out; its exit status (-1:
 * did not run or exit) and its output (malloc'ed) in *out. */
static int run_bin(const char *dir, const char *const *args, char **out)
{
    const char *argv[24] = {kvt_test_bin()};
    size_t n = 1;
    for (size_t i = 0; args[i] && n + 1 < sizeof argv / sizeof *argv; i++) argv[n++] = args[i];
    argv[n] = NULL;
    char path[300];
    snprintf(path, sizeof path, "%s.cli.out", dir);
    int st = 0;
    int ran = fx_run(argv, path, 120, &st);
    size_t len = 0;
    *out = kvt_test_read_file(path, &len);
    if (!*out) *out = calloc(1, 1);
    unlink(path);
    return ran == 1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static kvt_model *tiny(void)
{
    kvt_model *m = NULL;
    kvt_model_preset(&m, "ds4-tiny", 7, NULL);
    return m;
}

/* Save a snapshot of n tokens of seeded text (its own first block, so
 * nothing is shared with another seed's). */
static int save_seeded(kvt_store *st, kvt_session *s, size_t n, uint64_t seed)
{
    int32_t *t = malloc(n * sizeof *t);
    if (!t) return KVT_ENOMEM;
    kvt_test_tokens(t, n, seed);
    int rc = kvt_session_sync(s, t, n, NULL);
    if (!rc) rc = kvt_store_save(st, s, n, "manual", NULL);
    free(t);
    return rc;
}

TEST(store_hostile_planted_links)
{
    char d[128], store[160], db[200], victim[200], dangling[200], target[200];
    CHECK(scratch(d, sizeof d, "links"));
    snprintf(store, sizeof store, "%s/store", d);
    snprintf(db, sizeof db, "%s/kvtier.db", store);
    snprintf(victim, sizeof victim, "%s/victim", d);
    snprintf(dangling, sizeof dangling, "%s/not-there", d);
    CHECK(mkdir(store, 0700) == 0 && write_file(victim, "the victim's file\n") && symlink(victim, db) == 0);
    /* the API: refused, the target unchanged */
    kvt_store *st = NULL;
    int rc = kvt_store_open(&st, store, 0);
    CHECKF(rc == KVT_EINVAL && strstr(kvt_errmsg(), "symbolic link"), "a link at kvtier.db: %s: %s", kvt_strerror(rc),
           kvt_errmsg());
    char *text = kvt_test_read_file(victim, NULL);
    CHECKF(text && !strcmp(text, "the victim's file\n"), "the link's target changed");
    free(text);
    /* a dangling link: nothing made where it points */
    CHECK(unlink(db) == 0 && symlink(dangling, db) == 0);
    rc = kvt_store_open(&st, store, 0);
    CHECKF(rc != KVT_OK && access(dangling, F_OK) != 0, "a dangling link at kvtier.db was followed");
    /* the binary, which a build without the fix writes through */
    CHECK(unlink(db) == 0 && symlink(victim, db) == 0);
    char *out = NULL;
    int code = run_bin(d, (const char *const[]){"cache", "stats", "--kv-disk-dir", store, NULL}, &out);
    text = kvt_test_read_file(victim, NULL);
    bool same = text && !strcmp(text, "the victim's file\n");
    free(text);
    CHECKF(code == 1 && strstr(out, "symbolic link") && same, "kvtier cache stats over a planted link: exit %d, %s%s",
           code, out, same ? "" : "; the victim's file was written");
    free(out);
    /* links at the WAL and the shared memory SQLite makes beside the
     * database: refused, not followed */
    CHECK(unlink(db) == 0);
    CHECK_OK(kvt_store_open(&st, store, 0));
    kvt_store_close(st);
    const char *sides[] = {"-wal", "-shm"};
    for (int k = 0; k < 2; k++) {
        snprintf(target, sizeof target, "%s%s", db, sides[k]);
        CHECK(symlink(victim, target) == 0);
        rc = kvt_store_open(&st, store, 0);
        text = kvt_test_read_file(victim, NULL);
        same = text && !strcmp(text, "the victim's file\n");
        free(text);
        CHECKF(rc == KVT_EINVAL && strstr(kvt_errmsg(), "symbolic link") && same, "a link at kvtier.db%s: %s%s", sides[k],
               rc ? kvt_errmsg() : "opened", same ? "" : ", written through");
        CHECK(unlink(target) == 0);
    }
    /* a link at a segment the next save creates: refused, not followed */
    CHECK(unlink(db) == 0);
    kvt_model *m = tiny();
    kvt_session *s = NULL;
    CHECK(m && kvt_session_new(&s, m, NULL) == KVT_OK);
    CHECK_OK(kvt_store_open(&st, store, 0));
    snprintf(target, sizeof target, "%s/kvtier.db-seg1", store);
    CHECK(symlink(victim, target) == 0);
    rc = save_seeded(st, s, 600, 3);
    text = kvt_test_read_file(victim, NULL);
    same = text && !strcmp(text, "the victim's file\n");
    free(text);
    CHECKF(rc != KVT_OK && same, "a save over a link at the segment: %s%s", rc ? "refused" : "saved",
           same ? "" : ", through it");
    kvt_store_close(st);
    kvt_session_free(s);
    kvt_model_close(m);
    rm_rf(d);
}

TEST(store_hostile_shared_dir)
{
    char d[128], open_dir[160], grp[160], theirs[160], db[200];
    CHECK(scratch(d, sizeof d, "shared"));
    snprintf(open_dir, sizeof open_dir, "%s/open", d);
    snprintf(grp, sizeof grp, "%s/group", d);
    snprintf(theirs, sizeof theirs, "%s/theirs", d);
    CHECK(mkdir(open_dir, 0700) == 0 && chmod(open_dir, 0777) == 0);
    CHECK(mkdir(grp, 0700) == 0 && chmod(grp, 0770) == 0);
    const char *dirs[2] = {open_dir, grp};
    for (int i = 0; i < 2; i++) {
        kvt_store *st = NULL;
        int rc = kvt_store_open(&st, dirs[i], 0);
        CHECKF(rc == KVT_EINVAL && strstr(kvt_errmsg(), "writable by") && strstr(kvt_errmsg(), "chmod 700"),
               "%s (mode %04o): %s: %s", dirs[i], mode_of(dirs[i]), kvt_strerror(rc), kvt_errmsg());
        snprintf(db, sizeof db, "%s/kvtier.db", dirs[i]);
        CHECKF(access(db, F_OK) != 0 && mode_of(dirs[i]) != 0700, "%s: something was made in it, or it was changed",
               dirs[i]);
    }
    /* the binary says why and how to fix it */
    char *out = NULL;
    int code = run_bin(d, (const char *const[]){"cache", "stats", "--kv-disk-dir", open_dir, NULL}, &out);
    snprintf(db, sizeof db, "%s/kvtier.db", open_dir);
    CHECKF(code == 1 && strstr(out, "mode 0777") && strstr(out, "chmod 700") && access(db, F_OK) != 0,
           "kvtier cache stats in a 0777 directory: exit %d: %s", code, out);
    free(out);
    /* another user's directory (as root: one given to nobody) */
    if (geteuid() == 0) {
        CHECK(mkdir(theirs, 0700) == 0 && chown(theirs, 65534, 65534) == 0);
        kvt_store *st = NULL;
        int rc = kvt_store_open(&st, theirs, 0);
        CHECKF(rc == KVT_EINVAL && strstr(kvt_errmsg(), "belongs to uid 65534"), "another user's directory: %s",
               kvt_errmsg());
    } else {
        printf("    another user's directory: not checked (needs root to give one away)\n");
    }
    rm_rf(d);
}

TEST(store_hostile_private_modes)
{
    char d[128], store[200], path[260];
    CHECK(scratch(d, sizeof d, "modes"));
    snprintf(store, sizeof store, "%s/a/b", d);
    mode_t was = umask(0);
    kvt_model *m = tiny();
    kvt_session *s = NULL;
    kvt_store *st = NULL;
    CHECK(m && kvt_session_new(&s, m, NULL) == KVT_OK);
    int rc = kvt_store_open(&st, store, 0);
    if (!rc) rc = save_seeded(st, s, 600, 5);
    /* checked while the store is open: the WAL and shared memory exist */
    const char *files[] = {"kvtier.db", "kvtier.db-wal", "kvtier.db-shm", "kvtier.db-seg1"};
    int modes[4];
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s", store, files[i]);
        modes[i] = mode_of(path);
    }
    kvt_store_close(st);
    umask(was);
    CHECK_OK(rc);
    snprintf(path, sizeof path, "%s/a", d);
    CHECKF(mode_of(path) == 0700 && mode_of(store) == 0700, "directories %04o %04o, not 0700", mode_of(path),
           mode_of(store));
    for (int i = 0; i < 4; i++) CHECKF(modes[i] == 0600, "%s: mode %04o, not 0600", files[i], modes[i]);
    /* an existing 0755 directory of the user's is tightened, its 0644
     * database too */
    CHECK(chmod(store, 0755) == 0);
    snprintf(path, sizeof path, "%s/kvtier.db", store);
    CHECK(chmod(path, 0644) == 0);
    CHECK_OK(kvt_store_open(&st, store, 0));
    kvt_store_close(st);
    CHECKF(mode_of(store) == 0700 && mode_of(path) == 0600, "an existing store: %04o and %04o after open",
           mode_of(store), mode_of(path));
    rm_rf(d);
    /* the binary under a umask of 0 (a build without the fix leaves 0777
     * and 0644 here) */
    CHECK(scratch(d, sizeof d, "modes"));
    snprintf(store, sizeof store, "%s/s", d);
    umask(0);
    char *out = NULL;
    int code = run_bin(d, (const char *const[]){"run", "--model", "ds4-tiny", "--prompt", "private modes", "--max-tokens",
                                                "2", "--kv-save", "--kv-disk-dir", store, NULL}, &out);
    umask(was);
    int dm = mode_of(store), fm[4];
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s", store, files[i]);
        fm[i] = mode_of(path);
    }
    CHECKF(code == 0, "kvtier run --kv-save: exit %d: %s", code, out);
    free(out);
    CHECKF(dm == 0700 && fm[0] == 0600 && fm[3] == 0600, "kvtier run under umask 0: directory %04o, kvtier.db %04o, "
           "kvtier.db-seg1 %04o", dm, fm[0], fm[3]);
    kvt_session_free(s);
    kvt_model_close(m);
    rm_rf(d);
}

TEST(store_hostile_ns_names)
{
    char d[128], r2[160], path[300], ns[64], ns_again[64], ns_other[64], old_name[64];
    CHECK(scratch(d, sizeof d, "ns"));
    snprintf(r2, sizeof r2, "%s/other", d);
    CHECK_OK(kvt_storedir_prepare(d));
    CHECK_OK(kvt_storedir_prepare(r2));
    const char *key = "abcde";
    snprintf(old_name, sizeof old_name, "ns-%016llx", (unsigned long long)XXH3_64bits(key, strlen(key)));
    /* an old-named directory with an entry in it */
    snprintf(path, sizeof path, "%s/%s", d, old_name);
    CHECK(mkdir(path, 0700) == 0);
    snprintf(path, sizeof path, "%s/%s/marker", d, old_name);
    CHECK(write_file(path, "x"));
    CHECK_OK(kvt_storedir_ns(d, key, strlen(key), ns, sizeof ns));
    CHECK_OK(kvt_storedir_ns(d, key, strlen(key), ns_again, sizeof ns_again));
    CHECK_OK(kvt_storedir_ns(r2, key, strlen(key), ns_other, sizeof ns_other));
    CHECKF(!strcmp(ns, ns_again), "the same key in the same store: %s, then %s", ns, ns_again);
    CHECKF(strcmp(ns, old_name) && !strstr(ns, old_name + 3), "the name %s is the unkeyed hash", ns);
    CHECKF(strcmp(ns, ns_other), "two stores (two secrets) give the key one name %s", ns);
    CHECKF(strlen(ns) == 35 && !strncmp(ns, "ns-", 3), "name %s", ns);
    snprintf(path, sizeof path, "%s/kvtier.secret", d);
    struct stat sb;
    CHECKF(lstat(path, &sb) == 0 && S_ISREG(sb.st_mode) && (sb.st_mode & 0777) == 0600 && sb.st_size == 192,
           "the secret: mode %04o, %lld bytes", (int)(sb.st_mode & 07777), (long long)sb.st_size);
    snprintf(path, sizeof path, "%s/%s/marker", d, ns);
    CHECKF(access(path, F_OK) == 0, "the old directory's entries are not under the new name");
    snprintf(path, sizeof path, "%s/%s", d, old_name);
    CHECKF(access(path, F_OK) != 0, "the old-named directory is still there");
    /* a link planted at the secret's name is refused */
    snprintf(path, sizeof path, "%s/kvtier.secret", r2);
    CHECK(unlink(path) == 0 && symlink("/etc/hostname", path) == 0);
    int rc = kvt_storedir_ns(r2, key, strlen(key), ns_other, sizeof ns_other);
    CHECKF(rc != KVT_OK && strstr(kvt_errmsg(), "symbolic link"), "a link at the secret: %s", kvt_errmsg());
    rm_rf(d);
}

/* ---- a full disk ---- */

typedef struct tmpfs { char dir[128]; bool mounted; } tmpfs;

static const char *tmpfs_mount(tmpfs *t, const char *size)
{
    if (geteuid() != 0) return "needs root to mount a tmpfs";
    if (!scratch(t->dir, sizeof t->dir, "tmpfs")) return "no temporary directory";
    char opts[64];
    snprintf(opts, sizeof opts, "size=%s,mode=0700", size);
    if (mount("tmpfs", t->dir, "tmpfs", 0, opts) != 0) {
        static char why[160];
        snprintf(why, sizeof why, "mount -t tmpfs failed: %s", strerror(errno));
        rmdir(t->dir);
        return why;
    }
    t->mounted = true;
    return NULL;
}

static void tmpfs_unmount(tmpfs *t)
{
    if (t->mounted && umount2(t->dir, MNT_DETACH) != 0) printf("    umount %s: %s\n", t->dir, strerror(errno));
    t->mounted = false;
    rmdir(t->dir);
}

static uint64_t fs_free(const char *dir)
{
    struct statvfs v;
    return statvfs(dir, &v) == 0 ? (uint64_t)v.f_bavail * v.f_frsize : 0;
}

/* Fill the file system of dir to its last byte with a file of its own. */
static bool fill_up(const char *path)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) return false;
    static char buf[65536];
    memset(buf, 0xA5, sizeof buf);
    for (size_t chunk = sizeof buf; chunk >= 1;) {
        ssize_t w = write(fd, buf, chunk);
        if (w < 0 && errno == ENOSPC) { chunk /= 2; continue; }
        if (w <= 0) break;
    }
    close(fd);
    return true;
}

/* Save `rounds` distinct snapshots; the saves that failed, the lowest free
 * space seen after a save. */
static void fill_store(kvt_store *st, kvt_session *s, const char *dir, int rounds, uint64_t seed, int *failed,
                       uint64_t *lowest)
{
    *failed = 0;
    *lowest = UINT64_MAX;
    for (int i = 0; i < rounds; i++) {
        if (save_seeded(st, s, 1536, seed + (uint64_t)i)) (*failed)++;
        uint64_t f = fs_free(dir);
        if (f < *lowest) *lowest = f;
    }
}

/* The body of store_hostile_full_disk on the mounted fs (a failed check
 * returns here, and the caller unmounts). */
static void full_disk(tmpfs *t)
{
    tmpfs fs = *t;
    char store[200], path[300];
    snprintf(store, sizeof store, "%s/store", fs.dir);
    kvt_model *m = tiny();
    kvt_session *s = NULL;
    kvt_store *st = NULL;
    CHECK(m && kvt_session_new(&s, m, NULL) == KVT_OK);
    /* the negative control first: without keeping free space, the
     * 100 distinct prompts fill the 8 MiB and saves fail */
    CHECK_OK(kvt_store_open(&st, store, 0));
    kvt_store_set_quiet(st, true);
    kvt_store_room_fault = true;
    int failed = 0;
    uint64_t lowest = 0;
    fill_store(st, s, fs.dir, 100, 1000, &failed, &lowest);
    kvt_store_room_fault = false;
    kvt_store_close(st);
    printf("    without the reserve: %d of 100 saves failed, %llu KiB free at the lowest\n", failed,
           (unsigned long long)(lowest >> 10));
    CHECKF(failed > 0, "the negative control: 100 distinct saves fit in 8 MiB (make the test fill it)");
    rm_rf(store);
    /* keeping the default free space (5%: 409 KiB of 8 MiB): no save fails */
    CHECK_OK(kvt_store_open(&st, store, 0));
    kvt_store_set_quiet(st, true);
    fill_store(st, s, fs.dir, 100, 2000, &failed, &lowest);
    kvt_store_stats z;
    CHECK_OK(kvt_store_stats_get(st, &z));
    printf("    with it: %d of 100 saves failed, %llu KiB free at the lowest, %llu snapshots kept, %llu evicted\n",
           failed, (unsigned long long)(lowest >> 10), (unsigned long long)z.snapshots,
           (unsigned long long)z.evictions);
    CHECKF(failed == 0 && z.save_errors == 0, "%d saves failed on an 8 MiB file system", failed);
    CHECKF(lowest >= (8ull << 20) / 20 - (256 << 10), "%llu KiB free after a save", (unsigned long long)(lowest >> 10));
    CHECK(z.evictions > 0 && z.snapshots > 0);
    /* the newest is there */
    {
        int32_t t[1536];
        kvt_test_tokens(t, 1536, 2099);
        size_t reused = 0;
        kvt_session *r = NULL;
        CHECK_OK(kvt_session_new(&r, m, NULL));
        CHECK_OK(kvt_store_restore_prefix(st, r, t, 1536, &reused));
        kvt_session_free(r);
        CHECKF(reused == 1536, "the newest snapshot: %zu of 1536 tokens restored", reused);
    }
    /* another file takes every byte left: the next save evicts and goes on
     * (or is skipped), never leaves the store broken */
    snprintf(path, sizeof path, "%s/filler", fs.dir);
    CHECK(fill_up(path));
    int rc = save_seeded(st, s, 1536, 3000);
    printf("    a save on the full disk: %s (%llu KiB free after it)\n", rc ? kvt_errmsg() : "saved",
           (unsigned long long)(fs_free(fs.dir) >> 10));
    CHECK(rc == KVT_OK || rc == KVT_EIO);
    kvt_store_close(st);
    /* no WAL left behind by a clean close */
    snprintf(path, sizeof path, "%s/kvtier.db-wal", store);
    struct stat sb;
    CHECKF(stat(path, &sb) != 0 || sb.st_size == 0, "a WAL of %lld bytes after close", (long long)sb.st_size);
    /* the disk full again, then gc and verify through the binary */
    snprintf(path, sizeof path, "%s/filler2", fs.dir);
    CHECK(fill_up(path));
    char *vout = NULL, *gout = NULL;
    int vcode = run_bin(fs.dir, (const char *const[]){"cache", "verify", "--kv-disk-dir", store, NULL}, &vout);
    uint64_t before = fs_free(fs.dir);
    int gcode = run_bin(fs.dir, (const char *const[]){"cache", "gc", "--kv-disk-dir", store, NULL}, &gout);
    printf("    cache gc on the full disk: exit %d, %llu KiB free before, %llu KiB after\n", gcode,
           (unsigned long long)(before >> 10), (unsigned long long)(fs_free(fs.dir) >> 10));
    bool vok = vcode == 0 && strstr(vout, " 0 damaged"), gok = gcode == 0;
    if (!vok) printf("    cache verify on a full disk: exit %d: %s", vcode, vout);
    if (!gok) printf("    cache gc on a full disk: exit %d: %s", gcode, gout);
    free(vout);
    free(gout);
    CHECKF(vok && gok, "cache verify or cache gc failed on a full disk");
    unlink(path);
    char *out = NULL;
    int code;
    /* a read-only file system: verify only reads */
    if (mount(NULL, fs.dir, NULL, MS_REMOUNT | MS_RDONLY, NULL) != 0) {
        printf("    read-only remount failed (%s): verify on a read-only store not checked\n", strerror(errno));
    } else {
        code = run_bin("/tmp/kvtier-hostile-ro", (const char *const[]){"cache", "verify", "--kv-disk-dir", store, NULL},
                       &out);
        CHECKF(code == 0 && strstr(out, " 0 damaged"), "cache verify on a read-only store: exit %d: %s", code, out);
        free(out);
    }
    kvt_session_free(s);
    kvt_model_close(m);
}

TEST(store_hostile_full_disk)
{
    tmpfs fs = {0};
    const char *why = tmpfs_mount(&fs, "8m");
    if (why) SKIP("%s", why);
    kvt_store_room_fault = false;
    full_disk(&fs);
    kvt_store_room_fault = false;
    tmpfs_unmount(&fs);
}

TEST(store_hostile_report_rate)
{
    char d[128], log[200];
    CHECK(scratch(d, sizeof d, "rate"));
    snprintf(log, sizeof log, "%s/err", d);
    kvt_store *st = NULL;
    CHECK_OK(kvt_store_open(&st, d, 0));
    fflush(stderr);
    int saved = dup(2), fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    CHECK(saved >= 0 && fd >= 0);
    dup2(fd, 2);
    close(fd);
    kvt_store_report_every = 0.3;
    kvt_fail(KVT_EIO, "cache store: disk full");
    for (int i = 0; i < 1000; i++) kvt_store_report_save_failure(st, "cold save at 2048 tokens");
    fx_sleep_ms(400);
    kvt_store_report_save_failure(st, "cold save at 4096 tokens");
    kvt_store_report_every = 60;
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    kvt_store_close(st);
    char *text = kvt_test_read_file(log, NULL);
    CHECK(text);
    int lines = 0;
    for (const char *p = text; *p; p++) lines += *p == '\n';
    CHECKF(lines == 2 && strstr(text, "and 999 more save failures"), "1,001 failures gave %d lines:\n%s", lines, text);
    free(text);
    rm_rf(d);
}
