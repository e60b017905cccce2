/* The store's directory and files: owners, modes, links (storedir.h).
 *
 * Checks are made on what was opened (fstat of a descriptor), not on a
 * name looked up twice, so a name swapped between the check and the use
 * is not trusted. The directory's own name may be a link (a user's ~/.cache
 * often is): what it names must pass the checks. */
#include "store/storedir.h"
#include "kvtier.h"
#include "base/util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define SECRET_FILE "kvtier.secret"
#define SECRET_LEN 192 /* XXH3 takes a secret of 136 bytes or more */

/* mkdir -p with 0700 for what it creates. */
static int mkdirs(const char *dir)
{
    char *p = kvt_strndup(dir, strlen(dir));
    if (!p) return KVT_ENOMEM;
    for (char *c = p + 1;; c++) {
        if (*c != '/' && *c) continue;
        char save = *c;
        *c = 0;
        if (mkdir(p, 0700) != 0 && errno != EEXIST) {
            int rc = kvt_fail(KVT_EIO, "cache store: cannot create %s: %s", p, strerror(errno));
            free(p);
            return rc;
        }
        *c = save;
        if (!save) break;
    }
    free(p);
    return KVT_OK;
}

int kvt_storedir_prepare(const char *dir)
{
    int rc = mkdirs(dir);
    if (rc) return rc;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return kvt_fail(KVT_EIO, "cache store: cannot open directory %s: %s", dir, strerror(errno));
    struct stat sb;
    uid_t me = geteuid();
    if (fstat(fd, &sb) != 0) {
        rc = kvt_fail(KVT_EIO, "cache store: %s: %s", dir, strerror(errno));
    } else if (sb.st_uid != me) {
        rc = kvt_fail(KVT_EINVAL,
                      "cache store %s belongs to uid %u, not to this user (uid %u): its owner could read the cached "
                      "prompts and replace its files; use a directory of your own (--kv-disk-dir DIR), or give this "
                      "one to this user (chown %u %s)",
                      dir, (unsigned)sb.st_uid, (unsigned)me, (unsigned)me, dir);
    } else if (sb.st_mode & (S_IWGRP | S_IWOTH)) {
        rc = kvt_fail(KVT_EINVAL,
                      "cache store %s is writable by %s (mode %04o): another user could plant links or files in it "
                      "and have kvtier write through them; make it private (chmod 700 %s) after checking what it "
                      "holds, or use a directory of your own (--kv-disk-dir DIR)",
                      dir, (sb.st_mode & S_IWGRP) && (sb.st_mode & S_IWOTH) ? "group and others"
                           : sb.st_mode & S_IWGRP ? "its group" : "others",
                      (unsigned)(sb.st_mode & 07777), dir);
    } else if ((sb.st_mode & 07777) != 0700 && fchmod(fd, 0700) != 0) {
        /* readable by others only: nothing can have been planted, so it is
         * made private rather than refused */
        rc = kvt_fail(KVT_EIO, "cache store: cannot make %s private (chmod 700): %s", dir, strerror(errno));
    }
    close(fd);
    return rc;
}

/* Check an opened file of the store (fd, its name path): a regular file
 * of the user's; tightened to mode. */
static int check_file(int fd, const char *path, mode_t mode)
{
    struct stat sb;
    if (fstat(fd, &sb) != 0) return kvt_fail(KVT_EIO, "cache store: %s: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode)) return kvt_fail(KVT_EINVAL, "cache store: %s is not a regular file; refused", path);
    if (sb.st_uid != geteuid())
        return kvt_fail(KVT_EINVAL, "cache store: %s belongs to uid %u, not to this user; refused (remove it)", path,
                        (unsigned)sb.st_uid);
    if ((sb.st_mode & 07777) != mode && fchmod(fd, mode) != 0)
        return kvt_fail(KVT_EIO, "cache store: cannot make %s private: %s", path, strerror(errno));
    return KVT_OK;
}

/* Open an existing file of the store without following a link. */
static int open_existing(const char *path, int flags, int *fd)
{
    *fd = open(path, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (*fd >= 0) return KVT_OK;
    if (errno == ELOOP)
        return kvt_fail(KVT_EINVAL, "cache store: %s is a symbolic link; refused, never followed (remove it)", path);
    return kvt_fail(errno == ENOENT ? KVT_ENOENT : KVT_EIO, "cache store: cannot open %s: %s", path, strerror(errno));
}

int kvt_storedir_file(const char *path)
{
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) return kvt_fail(KVT_EIO, "cache store: cannot create %s: %s", path, strerror(errno));
    int rc = KVT_OK;
    if (fd < 0 && (rc = open_existing(path, O_RDONLY, &fd))) return rc;
    rc = check_file(fd, path, 0600);
    close(fd);
    return rc;
}

int kvt_storedir_no_link(const char *path)
{
    struct stat sb;
    if (lstat(path, &sb) == 0 && S_ISLNK(sb.st_mode))
        return kvt_fail(KVT_EINVAL, "cache store: %s is a symbolic link; refused, never followed (remove it)", path);
    return KVT_OK;
}

static int write_all(int fd, const uint8_t *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* root's secret: read, or made. Two processes that start at once agree:
 * the secret is written whole to a file of this process's own, then linked
 * to its name, which fails for the second (it reads the first's). */
static int load_secret(const char *root, uint8_t *secret)
{
    char path[4200], tmp[4300];
    snprintf(path, sizeof path, "%s/" SECRET_FILE, root);
    int fd = -1, rc = open_existing(path, O_RDONLY, &fd);
    if (rc == KVT_ENOENT) {
        snprintf(tmp, sizeof tmp, "%s.new-%d", path, (int)getpid());
        unlink(tmp);
        if ((rc = kvt_fill_random(secret, SECRET_LEN))) return rc;
        int w = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (w < 0) return kvt_fail(KVT_EIO, "cache store: cannot create %s: %s", tmp, strerror(errno));
        bool ok = fchmod(w, 0600) == 0 && write_all(w, secret, SECRET_LEN) == 0 && fsync(w) == 0;
        close(w);
        if (!ok || (link(tmp, path) != 0 && errno != EEXIST)) {
            rc = kvt_fail(KVT_EIO, "cache store: cannot write %s: %s", path, strerror(errno));
            unlink(tmp);
            return rc;
        }
        unlink(tmp);
        rc = open_existing(path, O_RDONLY, &fd);
    }
    if (rc) return rc;
    rc = check_file(fd, path, 0600);
    ssize_t got = rc ? 0 : read(fd, secret, SECRET_LEN);
    uint8_t extra;
    if (!rc && (got != SECRET_LEN || read(fd, &extra, 1) != 0))
        rc = kvt_fail(KVT_EFORMAT, "cache store: %s is not %d bytes long; remove it (the API keys' directories "
                      "get new names, their entries are lost)", path, SECRET_LEN);
    close(fd);
    return rc;
}

int kvt_storedir_ns(const char *root, const char *key, size_t len, char *out, size_t cap)
{
    uint8_t secret[SECRET_LEN];
    int rc = load_secret(root, secret);
    if (rc) return rc;
    XXH128_hash_t h = XXH3_128bits_withSecret(key, len, secret, sizeof secret);
    if (cap < 36) return kvt_fail(KVT_EINVAL, "namespace name buffer of %zu bytes", cap);
    snprintf(out, cap, "ns-%016llx%016llx", (unsigned long long)h.high64, (unsigned long long)h.low64);
    /* the directory of the name without a secret (earlier builds): moved
     * to the new name, unless that exists already; a failure leaves the
     * old one, and the key starts with an empty store */
    char was[4200], now[4200];
    snprintf(was, sizeof was, "%s/ns-%016llx", root, (unsigned long long)XXH3_64bits(key, len));
    snprintf(now, sizeof now, "%s/%s", root, out);
    struct stat sb;
    if (lstat(was, &sb) == 0 && S_ISDIR(sb.st_mode) && sb.st_uid == geteuid() && lstat(now, &sb) != 0 &&
        errno == ENOENT)
        rename(was, now);
    return KVT_OK;
}
