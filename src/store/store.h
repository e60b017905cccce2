/* Internal hooks of the disk tier (the public API is in kvtier.h). */
#ifndef KVT_STORE_H
#define KVT_STORE_H

#include "kvtier.h"

/* Cap the database at `pages` pages and each segment at as many 4 KiB, so
 * writes fail as on a full disk (tests of the save error path). */
int kvt_store_limit_pages(kvt_store *st, uint32_t pages);

/* kvt_store_save that also says whether a new entry was written (false
 * when an identical one was already stored). */
int kvt_store_save_new(kvt_store *st, kvt_session *s, size_t n, const char *reason, int64_t *id, bool *created);

/* kvt_store_lookup for a caller that must not wait (the server's
 * scheduler): when another thread holds the store for more than wait_ms,
 * or SQLite finds another process's lock for that long, the lookup is a
 * miss (*match 0, KVT_OK), reported on stderr at most once a minute with a
 * count. */
int kvt_store_lookup_try(kvt_store *st, const kvt_model *m, const int32_t *tokens, size_t n, int wait_ms,
                         size_t *match, int64_t *id);

/* kvt_store_restore_prefix of the entry a lookup of the same tokens found
 * (kvt_store_lookup's *match and *id; id -1 or match 0: none): it is
 * loaded without looking the tokens up again; when it cannot serve
 * (removed since, damaged), the store is looked up again as
 * kvt_store_restore_prefix does. */
int kvt_store_restore_found(kvt_store *st, kvt_session *s, const int32_t *tokens, size_t n, size_t match, int64_t id,
                            size_t *reused);

/* kvt_store_stats_get for a reader that must not wait (the server's
 * /metrics: a save holds the store for seconds, and every scrape would
 * hold an HTTP thread that long): when another thread holds the store for
 * more than wait_ms, the figures the last read found (*stale set; zero
 * before any). */
int kvt_store_stats_try(kvt_store *st, kvt_store_stats *o, int wait_ms, bool *stale);
/* Test hook: kvt_store_stats_try waits for the store as
 * kvt_store_stats_get does, to show a test catches it. */
extern bool kvt_store_fault_stats_wait;

/* How long the store's operations wait for another process's lock before
 * they fail (SQLite's busy timeout; 30,000 ms unless set). */
void kvt_store_set_busy(kvt_store *st, int ms);

/* Whether an operation of the calling thread failed on another
 * connection's lock since the flag was last cleared (clear: clear it now);
 * such a failure is worth trying again later. */
bool kvt_store_busy_seen(bool clear);

/* The thread that steps sessions (the server's scheduler) marks itself
 * (on: true): from then on every store operation it enters with the
 * store's blocking lock (a save, a load, an unbounded lookup: each may
 * wait seconds on another thread's save or another process's lock) counts
 * in kvt_store_stepper_waits, the calling thread's count. The bounded
 * kvt_store_lookup_try and kvt_store_stats_try do not count: they give up
 * instead of waiting. So the server can count the steps that waited on
 * the disk tier, and a test can show there are none (tests/test_storeq.c). */
void kvt_store_mark_stepper(bool on);
unsigned long kvt_store_stepper_waits(void);

/* Commit without waiting for the disk (populating a benchmark store only). */
int kvt_store_set_synchronous(kvt_store *st, bool on);

/* The running totals as recorded (what kvt_store_stats_get reports) and as
 * the tables add up to (snapshots, blocks, block_refs and bytes of each;
 * the other fields zero). Tests: the two agree after every commit. */
int kvt_store_totals(kvt_store *st, kvt_store_stats *recorded, kvt_store_stats *counted);

#endif
