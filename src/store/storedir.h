/* The disk tier's directory and files as the operating system sees them:
 * who owns them, who may read them, and what a name on disk points at
 * (docs/STORE.md, "Files, owners and modes").
 *
 * A store directory holds every cached prompt in clear, so it is private:
 * 0700, its files 0600, whatever the umask. A directory that belongs to
 * another user, or that group or others may write (a shared path, a 0777
 * one under /tmp), is refused, as ssh refuses such a ~/.ssh: whoever can
 * write there can plant a link at kvtier.db and have this process write
 * through it. Files are created with O_EXCL | O_NOFOLLOW and an existing
 * one must be a regular file of the user's, never a link. */
#ifndef KVT_STOREDIR_H
#define KVT_STOREDIR_H

#include <stddef.h>

/* Make dir ready to hold a store: created (with its missing parents) 0700
 * when absent; refused (KVT_EINVAL, the message says why and how to fix
 * it) when it is not a directory, belongs to another user or is writable
 * by group or others; tightened to 0700 when it is the user's and more
 * open (0755: readable by others). */
int kvt_storedir_prepare(const char *dir);

/* The file at path as one of a store's: created empty, 0600, with
 * O_CREAT | O_EXCL | O_NOFOLLOW when absent (files SQLite creates beside
 * it, its WAL, shared memory and the segments, take its mode); when it
 * exists, refused unless it is a regular file of the user's (a link is
 * refused, never followed), and tightened to 0600. */
int kvt_storedir_file(const char *path);

/* KVT_EINVAL (the message names it) when path is a symbolic link; KVT_OK
 * when it is anything else or nothing. For the files SQLite makes beside
 * the database (its WAL and shared memory), which it opens O_NOFOLLOW and
 * would refuse with a bare "unable to open database file". */
int kvt_storedir_no_link(const char *path);

/* The directory name of API key `key` (len bytes) in the store root:
 * "ns-" and 32 hex digits of XXH3-128 of the key keyed with the root's
 * secret (root/kvtier.secret: 192 random bytes, 0600, made on first use
 * with O_EXCL | O_NOFOLLOW), so that the name tells nothing of the key to
 * someone without the secret. root must have been prepared. A directory of
 * the earlier name (ns-<unkeyed XXH3-64 of the key>) is renamed to the new
 * one, so its entries survive. out gets at least 36 bytes. */
int kvt_storedir_ns(const char *root, const char *key, size_t len, char *out, size_t cap);

#endif
