/* The fingerprint cache (fpcache.c): a model file's fingerprint remembered
 * across starts, keyed by the file's identity, so that a start does not read
 * every weight again to hash it (docs/FORMAT.md "Fingerprint cache files").
 * The model layer's (model.c); not part of the public API. */
#ifndef KVT_FPCACHE_H
#define KVT_FPCACHE_H

#include "format/gguf.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A model file's identity as kvt_gguf_open saw it: its stat (st_ctim cannot
 * be set by a user: a file written in place, or another file renamed over
 * the name, has another) and the hash of its header's bytes. */
typedef struct kvt_fp_id {
    uint64_t dev, ino, size;
    int64_t mtime_s, mtime_ns, ctime_s, ctime_ns;
    int64_t seen_s, seen_ns;      /* when open looked (not stored: see kvt_fpcache_put) */
    uint64_t header_len, header_hash;
} kvt_fp_id;

/* g's identity; false: g was not opened from a file. */
bool kvt_fpcache_id(const kvt_gguf *g, kvt_fp_id *id);
/* The directory of entries when none is set: $XDG_CACHE_HOME/kvtier/fingerprints,
 * else $HOME/.cache/kvtier/fingerprints (the default store directory's,
 * src/app/cli.c); false: neither variable is set. */
bool kvt_fpcache_default_dir(char *out, size_t cap);
/* The entries a directory keeps: a put that leaves more removes the least
 * recently used (by mtime, which a get that hits sets to now) down to this
 * many (docs/FORMAT.md "Fingerprint cache files"). */
#define KVT_FPCACHE_MAX_ENTRIES 128
/* The fingerprint an entry of dir holds for id: true and *fp when a valid
 * entry matches every field (its mtime then set to now: it was used);
 * false (a miss) for anything else: no entry, a link, not a regular file,
 * not the user's, not private, another size, another magic, version or
 * definition, a bad checksum, another identity. */
bool kvt_fpcache_get(const char *dir, const kvt_fp_id *id, uint64_t *fp);
/* Remember fp for id in dir (created 0700 with its parents when missing):
 * an entry of 0600 written to a new temporary file, synced and renamed over
 * the entry's name; then, past KVT_FPCACHE_MAX_ENTRIES entries, the least
 * recently used removed (only regular files named as entries, never
 * through a link; one another process removed first is skipped). Nothing is written (KVT_OK) while the file's ctime is
 * within kvt_fpcache_settle_ns of when open looked (id->seen): a change made
 * after the open could carry the same ctime, the clock's tick being coarse.
 * Errors are for the caller to ignore: the cache only saves time. */
int kvt_fpcache_put(const char *dir, const kvt_fp_id *id, uint64_t fp);

/* Test hooks. kvt_fpcache_settle_ns: the settle time of kvt_fpcache_put (2 s;
 * the tests make entries of files just written with 0).
 * KVT_FPCACHE_FAULT_SIZE_MTIME makes an entry match on the size and the
 * mtime alone (the negative control of tests/test_fingerprint.c: a file
 * written in place with its mtime restored then gets the stale
 * fingerprint). */
extern int64_t kvt_fpcache_settle_ns;
/* Non-NULL: the directory kvt_fpcache_default_dir gives (the test runner's
 * own, so that a run of the tests leaves no entry in the user's). */
extern const char *kvt_fpcache_dir_for_tests;
/* KVT_FPCACHE_FAULT_TRIM_ANY makes the trim of a put count and remove
 * every name of the directory, links (their targets' mtime) and other
 * files too; KVT_FPCACHE_FAULT_NO_TOUCH makes a hit leave the entry's
 * mtime (the least recently written go first, not the least used): the
 * negative controls of fingerprint_cache_bounded. */
enum { KVT_FPCACHE_FAULT_NONE, KVT_FPCACHE_FAULT_SIZE_MTIME, KVT_FPCACHE_FAULT_TRIM_ANY, KVT_FPCACHE_FAULT_NO_TOUCH };
extern int kvt_fpcache_fault;

#endif
