/* The disk tier: a durable, content-addressed, budgeted store of session
 * snapshots (see kvtier.h and docs/STORE.md). This file opens and closes a
 * store and holds the public entry points; each operation is in the file
 * named for it.
 *
 * One SQLite database per directory, in WAL mode with synchronous=FULL, so a
 * save is one transaction that is atomic and durable (a crash or a power cut
 * leaves the old store or the new one), several processes can share the
 * directory, and a full disk fails a save cleanly. SQLite does not checksum
 * its pages, so every record carries its own XXH3 checksums (snapshot.c) and
 * is verified on load.
 *
 *   blocks(key, refs, bytes, seg, off)    one row per distinct 128-token block
 *   snaps(id, model, head, n_tokens, tail, ..., rseg, roff, locs)
 *                                         (records in segment files, segments.h;
 *                                         a schema 1 store's in the rows' data)
 *   snap_blocks(snap, idx, key)           which blocks a snapshot stands on
 *   counters(name, value), meta(k, v), quarantine(...)
 *   totals(bytes, snaps, blocks, refs)   one row, kept exact by triggers
 *
 * Every SQLite failure is a failure of the operation that met it (sql_note),
 * never the end of a table. When SQLite reports the database damaged
 * (SQLITE_CORRUPT, SQLITE_NOTADB), whatever the operation, the store builds
 * a new database from the records that still read and check out, moves the
 * damaged one aside and goes on with the new one (recovery.c).
 *
 * The files, each calling only those after it (and db.c, segments.c):
 *   store.c    open, close, the public entry points (one caller at a time)
 *   save.c     save: the record, the blocks, the rows in one transaction
 *   load.c     load, and the restore of a prompt's longest stored prefix
 *   lookup.c   the index of snapshots and the lookup of a prompt
 *   check.c    verify, the integrity check, gc
 *   inspect.c  the figures, the list of entries, an entry's text
 *   evict.c    removal: on request, eviction (budget, free space), quarantine
 *   db.c       the connection, its SQLite calls and transactions, the places
 *              of records, the running totals (db.h, private to src/store/)
 *   recovery.c the rebuild of a damaged database; segments.c the segment files
 */
#include "store/store.h"
#include "store/check.h"
#include "store/db.h"
#include "store/evict.h"
#include "store/inspect.h"
#include "store/load.h"
#include "store/lookup.h"
#include "store/recovery.h"
#include "store/save.h"
#include "store/segments.h"
#include "store/storedir.h"
#include "store/testing.h"
#include "base/util.h"

#include <pthread.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int store_open(kvt_store **out, const char *dir, uint64_t budget, bool inspect)
{
    *out = NULL;
    int rc = inspect ? KVT_OK : kvt_storedir_prepare(dir);
    if (rc) return rc;
    kvt_store *st = kvt_calloc(1, sizeof *st);
    if (!st) return KVT_ENOMEM;
    pthread_mutex_init(&st->mu, NULL);
    pthread_mutex_init(&st->last_mu, NULL);
    st->busy_ms = 30000;
    st->budget = budget ? budget : DEFAULT_BUDGET;
    st->min_free = KVT_STORE_MIN_FREE_DEFAULT;
    st->dirty = true;
    st->data_version = -1;
    st->durable = true;
    st->inspect = inspect;
    st->dir = kvt_strndup(dir, strlen(dir));
    size_t plen = strlen(dir) + 16;
    st->path = kvt_malloc(plen);
    if (!st->dir || !st->path) { kvt_store_close(st); return KVT_ENOMEM; }
    snprintf(st->path, plen, "%s/kvtier.db", dir);
    if (!(st->segs = kvt_segs_new(st->path))) { kvt_store_close(st); return KVT_ENOMEM; }
    kvt_db_op_start(st, "open");
    if (inspect && access(st->path, F_OK) != 0) {
        rc = kvt_fail(KVT_ENOENT, "no cache store in %s", dir);
    } else {
        rc = kvt_db_open(st);
        idset victims = {0};
        if (rc && !inspect && !st->corrupt && kvt_evict_before_open(st, &victims) == KVT_OK) {
            if (!st->quiet)
                fprintf(stderr, "kvtier: cache store %s: the file system is full; %zu least recently used snapshots "
                                "evicted to open it\n", dir, victims.n);
            kvt_db_op_start(st, "open");
            if (!(rc = kvt_db_open(st))) kvt_evict_victims(st, &victims);
        }
        free(victims.v);
        if (rc && kvt_recovery_retry(st)) rc = KVT_OK;
    }
    if (rc) { kvt_store_close(st); return rc; }
    *out = st;
    return KVT_OK;
}

int kvt_store_open(kvt_store **out, const char *dir, uint64_t budget)
{
    return store_open(out, dir, budget, false);
}

int kvt_store_open_inspect(kvt_store **out, const char *dir)
{
    return store_open(out, dir, 0, true);
}

void kvt_store_close(kvt_store *st)
{
    if (!st) return;
    kvt_db_op_start(st, "close");
    if (st->db && !st->inspect && (st->lookups || st->hits || st->misses || st->save_errors) &&
        kvt_db_begin(st) == KVT_OK) {
        kvt_db_flush_counters(st);
        kvt_db_commit(st);
    }
    /* leave no large WAL behind: the last connection out deletes it, but
     * one that another process keeps would otherwise stay at its largest
     * size (no waiting here for readers: busy, it stays) */
    if (st->db && !st->inspect && kvt_db_same_file(st)) {
        sqlite3_busy_timeout(st->db, 0);
        sqlite3_wal_checkpoint_v2(st->db, NULL, SQLITE_CHECKPOINT_TRUNCATE, NULL, NULL);
    }
    kvt_db_close(st, st->db && !st->inspect && !kvt_db_same_file(st));
    kvt_segs_free(st->segs);
    free(st->idx);
    free(st->gone);
    free(st->freed);
    free(st->dir);
    free(st->path);
    pthread_mutex_destroy(&st->mu);
    pthread_mutex_destroy(&st->last_mu);
    free(st);
}

void kvt_store_set_quiet(kvt_store *st, bool quiet) { st->quiet = quiet; }

static int store_limit_pages(kvt_store *st, uint32_t pages)
{
    char sql[64];
    kvt_segs_cap(st->segs, (uint64_t)pages * 4096);
    snprintf(sql, sizeof sql, "PRAGMA max_page_count = %u", pages);
    return kvt_db_exec(st, sql);
}

/* ---- public entry points: one caller at a time per store ----
 *
 * Each starts an operation (enter), follows a database another process
 * rebuilt, and ends (leave) by rebuilding one that SQLite reported damaged
 * meanwhile. An operation that failed on the damage runs once more on the
 * rebuilt database; verify and the integrity check report what they found
 * instead. */

/* enter, with st->mu held already */
static int enter_locked(kvt_store *st, const char *name, bool writes)
{
    kvt_db_op_start(st, name);
    int rc = kvt_db_follow(st);
    if (!rc && !st->db) rc = kvt_fail(KVT_EIO, "cache store %s is unavailable", st->path);
    if (!rc && writes && st->inspect) rc = kvt_fail(KVT_EINVAL, "cache store %s is open to inspect only", st->path);
    return rc;
}

static _Thread_local bool stepper;          /* kvt_store_mark_stepper */
static _Thread_local unsigned long stepper_waits;

void kvt_store_mark_stepper(bool on) { stepper = on; }
unsigned long kvt_store_stepper_waits(void) { return stepper_waits; }

static int enter(kvt_store *st, const char *name, bool writes)
{
    if (stepper) stepper_waits++; /* a step that may wait on the disk tier */
    pthread_mutex_lock(&st->mu);
    return enter_locked(st, name, writes);
}

static int leave(kvt_store *st, int rc)
{
    if (st->corrupt && !st->inspect) {
        char why[512];
        snprintf(why, sizeof why, "%s", kvt_errmsg());
        kvt_recovery_rebuild(st);
        kvt_fail(rc, "%s", why);
    }
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int kvt_store_save(kvt_store *st, kvt_session *s, size_t n, const char *reason, int64_t *id_out)
{
    return kvt_store_save_new(st, s, n, reason, id_out, NULL);
}

int kvt_store_save_new(kvt_store *st, kvt_session *s, size_t n, const char *reason, int64_t *id_out, bool *created)
{
    int rc = enter(st, "save", true);
    if (!rc && (rc = kvt_save_entry(st, s, n, reason, id_out, created)) && kvt_recovery_retry(st))
        rc = kvt_save_entry(st, s, n, reason, id_out, created);
    return leave(st, rc);
}

int kvt_store_lookup(kvt_store *st, const kvt_model *m, const int32_t *tokens, size_t n, size_t *match, int64_t *id)
{
    *match = 0;
    *id = -1;
    int rc = enter(st, "lookup", false);
    if (!rc && (rc = kvt_lookup_find(st, m, tokens, n, true, match, id)) && kvt_recovery_retry(st))
        rc = kvt_lookup_find(st, m, tokens, n, true, match, id);
    return leave(st, rc);
}

/* The lookup of the server's scheduler: it never waits on another thread
 * or process for more than wait_ms. When a store thread holds the store
 * (a save, a load, a save waiting for another process's lock) or SQLite
 * reports it busy, the lookup is a miss, reported at most once a minute
 * with a count. A database found damaged is rebuilt by the next operation
 * of a store thread (leave), not here. */
int kvt_store_lookup_try(kvt_store *st, const kvt_model *m, const int32_t *tokens, size_t n, int wait_ms,
                         size_t *match, int64_t *id)
{
    *match = 0;
    *id = -1;
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_nsec += (long)wait_ms * 1000000L;
    dl.tv_sec += dl.tv_nsec / 1000000000L;
    dl.tv_nsec %= 1000000000L;
    if (pthread_mutex_timedlock(&st->mu, &dl) == 0) {
        int rc = enter_locked(st, "lookup", false);
        if (!rc) {
            sqlite3_busy_timeout(st->db, wait_ms);
            kvt_db_busy_seen = false;
            rc = kvt_lookup_find(st, m, tokens, n, true, match, id);
            if (st->db) sqlite3_busy_timeout(st->db, st->busy_ms);
        }
        bool busy = rc && kvt_db_busy_seen;
        pthread_mutex_unlock(&st->mu);
        if (!busy) return rc;
        *match = 0;
        *id = -1;
    }
    uint64_t skipped = atomic_fetch_add(&st->skipped_lookups, 1) + 1;
    int64_t now_ms = (int64_t)(kvt_now() * 1000), last = atomic_load(&st->skip_logged_ms);
    if ((!last || now_ms - last >= 60000) && atomic_compare_exchange_strong(&st->skip_logged_ms, &last, now_ms)) {
        skipped = atomic_exchange(&st->skipped_lookups, 0);
        if (!st->quiet)
            fprintf(stderr, "kvtier: cache store %s busy: %llu lookup(s) taken as misses\n", st->path,
                    (unsigned long long)skipped);
    }
    return KVT_OK;
}

void kvt_store_set_busy(kvt_store *st, int ms)
{
    pthread_mutex_lock(&st->mu);
    st->busy_ms = ms;
    if (st->db) sqlite3_busy_timeout(st->db, ms);
    pthread_mutex_unlock(&st->mu);
}

bool kvt_store_busy_seen(bool clear)
{
    bool b = kvt_db_busy_seen;
    if (clear) kvt_db_busy_seen = false;
    return b;
}

int kvt_store_load(kvt_store *st, int64_t id, kvt_session *s)
{
    int rc = enter(st, "load", false);
    if (!rc && (rc = kvt_load_entry(st, id, s)) == KVT_EIO && kvt_recovery_retry(st)) rc = kvt_load_entry(st, id, s);
    return leave(st, rc);
}

int kvt_store_restore_found(kvt_store *st, kvt_session *s, const int32_t *tokens, size_t n, size_t found_match,
                            int64_t found_id, size_t *reused)
{
    *reused = 0;
    int rc = enter(st, "restore", false);
    if (!rc) {
        rc = kvt_load_restore_prefix(st, s, tokens, n, found_match, found_id, reused);
    } else if (rc != KVT_ENOMEM) { /* a miss (kvtier.h) */
        if (!st->quiet) fprintf(stderr, "kvtier: %s (a miss)\n", kvt_errmsg());
        rc = KVT_OK;
    }
    return leave(st, rc);
}

int kvt_store_restore_prefix(kvt_store *st, kvt_session *s, const int32_t *tokens, size_t n, size_t *reused)
{
    return kvt_store_restore_found(st, s, tokens, n, 0, -1, reused);
}

int kvt_store_rm(kvt_store *st, int64_t id)
{
    int rc = enter(st, "rm", true);
    if (!rc && (rc = kvt_evict_rm(st, id)) && kvt_recovery_retry(st)) rc = kvt_evict_rm(st, id);
    return leave(st, rc);
}

int kvt_store_gc(kvt_store *st)
{
    int rc = enter(st, "gc", true);
    if (!rc && (rc = kvt_check_gc(st)) && kvt_recovery_retry(st)) rc = kvt_check_gc(st);
    return leave(st, rc);
}

int kvt_store_verify(kvt_store *st, size_t *bad, size_t *checked, size_t *newer)
{
    *bad = *checked = 0;
    if (newer) *newer = 0;
    int rc = enter(st, "verify", false);
    if (!rc) rc = kvt_check_verify(st, bad, checked, newer);
    return leave(st, rc);
}

int kvt_store_integrity(kvt_store *st, size_t *problems, char **report)
{
    *problems = 0;
    if (report) *report = NULL;
    int rc = enter(st, "integrity check", false);
    if (!rc) rc = kvt_check_integrity(st, problems, report);
    return leave(st, rc);
}

/* The figures, under st->mu; kept for kvt_store_stats_try. */
static int stats_locked(kvt_store *st, kvt_store_stats *o)
{
    int rc = enter_locked(st, "stats", false);
    if (!rc && (rc = kvt_inspect_stats(st, o)) && kvt_recovery_retry(st)) rc = kvt_inspect_stats(st, o);
    if (!rc) {
        pthread_mutex_lock(&st->last_mu);
        st->last_stats = *o;
        pthread_mutex_unlock(&st->last_mu);
    }
    return leave(st, rc);
}

int kvt_store_stats_get(kvt_store *st, kvt_store_stats *o)
{
    memset(o, 0, sizeof *o);
    pthread_mutex_lock(&st->mu);
    return stats_locked(st, o);
}

int kvt_store_stats_try(kvt_store *st, kvt_store_stats *o, int wait_ms, bool *stale)
{
    memset(o, 0, sizeof *o);
    *stale = false;
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_nsec += (long)wait_ms * 1000000L;
    dl.tv_sec += dl.tv_nsec / 1000000000L;
    dl.tv_nsec %= 1000000000L;
    if (!kvt_store_fault_stats_wait && pthread_mutex_timedlock(&st->mu, &dl) != 0) {
        *stale = true;
        pthread_mutex_lock(&st->last_mu);
        *o = st->last_stats;
        pthread_mutex_unlock(&st->last_mu);
        return KVT_OK;
    }
    if (kvt_store_fault_stats_wait) pthread_mutex_lock(&st->mu);
    return stats_locked(st, o);
}

bool kvt_store_fault_stats_wait;

void kvt_store_hold(kvt_store *st, bool on)
{
    if (on) pthread_mutex_lock(&st->mu);
    else pthread_mutex_unlock(&st->mu);
}

int kvt_store_list(kvt_store *st, kvt_store_entry **out, size_t *n)
{
    *out = NULL;
    *n = 0;
    int rc = enter(st, "ls", false);
    if (!rc && (rc = kvt_inspect_list(st, out, n)) && kvt_recovery_retry(st)) rc = kvt_inspect_list(st, out, n);
    return leave(st, rc);
}

int kvt_store_text(kvt_store *st, int64_t id, char **text, size_t *len)
{
    int rc = enter(st, "show", false);
    if (!rc && (rc = kvt_inspect_text(st, id, text, len)) == KVT_EIO && kvt_recovery_retry(st)) rc = kvt_inspect_text(st, id, text, len);
    return leave(st, rc);
}

int kvt_store_set_synchronous(kvt_store *st, bool on)
{
    int rc = enter(st, "synchronous", true);
    if (!rc) {
        st->durable = on;
        rc = kvt_db_exec(st, on ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=OFF");
    }
    return leave(st, rc);
}

int kvt_store_limit_pages(kvt_store *st, uint32_t pages)
{
    int rc = enter(st, "limit pages", true);
    if (!rc) rc = store_limit_pages(st, pages);
    return leave(st, rc);
}

int kvt_store_totals(kvt_store *st, kvt_store_stats *recorded, kvt_store_stats *counted)
{
    memset(recorded, 0, sizeof *recorded);
    memset(counted, 0, sizeof *counted);
    int rc = enter(st, "totals", false);
    if (!rc) {
        kvt_db_totals a, b;
        kvt_db_totals_get(st, &a);
        kvt_db_totals_counted(st, &b);
        *recorded = (kvt_store_stats){.snapshots = (uint64_t)a.snaps, .blocks = (uint64_t)a.blocks,
                                      .block_refs = (uint64_t)a.refs, .bytes = (uint64_t)a.bytes};
        *counted = (kvt_store_stats){.snapshots = (uint64_t)b.snaps, .blocks = (uint64_t)b.blocks,
                                     .block_refs = (uint64_t)b.refs, .bytes = (uint64_t)b.bytes};
        rc = kvt_db_sql_status(st);
    }
    return leave(st, rc);
}
