/* What leaves the disk tier (evict.c): removal, eviction to keep the
 * budget and the file system's free space, and quarantine of damaged
 * entries. Private to src/store/. */
#ifndef KVT_STORE_EVICT_H
#define KVT_STORE_EVICT_H

#include "store/db.h"

#include <stdbool.h>
#include <stdint.h>

/* Remove snapshot id and the blocks only it stands on, inside a write
 * transaction (it leaves the index when that commits); the bytes freed. */
int64_t kvt_evict_drop(kvt_store *st, int64_t id);
/* Evict least recently used snapshots (never keep; -1: none kept) until
 * the store is within its budget, inside a write transaction. */
void kvt_evict_budget(kvt_store *st, int64_t keep);
/* Make room for a write of need bytes: evict least recently used
 * snapshots (never keep), a transaction per round, until the file system
 * has need bytes besides the free space it keeps; force: at least need
 * bytes whatever it says (a write met a full disk). KVT_EIO ("disk full")
 * when nothing is left to evict. */
int kvt_evict_room(kvt_store *st, uint64_t need, int64_t keep, bool force);
/* What the WAL may still grow by before its next checkpoint. */
uint64_t kvt_evict_wal_headroom(const kvt_store *st);
/* An open that failed on a full file system: give back the segment space
 * of the least recently used snapshots (read with a read-only connection)
 * and list them in *victims, whose rows kvt_evict_victims removes once the
 * database opens. KVT_OK when something was given back. */
int kvt_evict_before_open(kvt_store *st, idset *victims);
void kvt_evict_victims(kvt_store *st, const idset *victims);
/* A damaged entry: recorded in the quarantine table, removed, reported
 * once. id (-1: none) is the snapshot; with has_key the block of that key
 * is damaged (or missing; where: the place it was read from, NULL: its
 * row's), and every snapshot that stands on it goes too. */
void kvt_evict_quarantine(kvt_store *st, int64_t id, bool has_key, uint64_t key, const bloc *where, const char *reason);
/* Remove snapshot id on request (kvt_store_rm): KVT_ENOENT when there is
 * none. */
int kvt_evict_rm(kvt_store *st, int64_t id);

#endif
