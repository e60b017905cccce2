/* Inside the disk tier (store.c and the files of its operations,
 * recovery.c): the store's state, its
 * SQLite connection and the records it names. Not for use outside
 * src/store/; the public API is kvtier.h, the store's hooks store.h.
 *
 * db.c owns the connection (open, schema, follow a file another process
 * replaced), the SQLite calls and their failure rule, write transactions
 * and what they leave on commit (index removals, freed segment ranges,
 * counters), the places of records in segment files (segments.h), the
 * checks of a row against its record and the running totals. Each function's note is at its
 * definition in db.c. */
#ifndef KVT_STORE_DB_H
#define KVT_STORE_DB_H

#include "base/buf.h"
#include "kvtier.h"
#include "session/snapshot.h"
#include "store/segments.h"

#include <pthread.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#define SCHEMA_VERSION 2
#define KVT_STR_(x) #x
#define KVT_STR(x) KVT_STR_(x)
#define SEG_MAX (256ull << 20) /* a segment takes no new blocks past this size */
#define DEFAULT_BUDGET (4096ull << 20)
#define MIN_FREE_CAP (1ull << 30)  /* the default free space: 5% of the file system, at most this */
#define ROOM_SLACK (256ull << 10)  /* what a save's rows add to the database, at most */
/* The WAL is checkpointed at 256 pages (1 MiB of 4 KiB pages, not
 * SQLite's 1,000) and cut back to 1 MiB after: a store on a small file
 * system leaves room for that much WAL, not 4 MB. */
#define WAL_PAGES 256
#define WAL_LIMIT 1048576

typedef struct ientry { uint64_t head, tail; uint32_t n; int64_t id; } ientry;

/* Where a block record is: bytes at off of segment seg (0: in its row). */
typedef struct bloc { uint32_t seg; uint64_t off, bytes; } bloc;

struct kvt_store {
    pthread_mutex_t mu;      /* the server's scheduler (lookups), its store threads and its
                                metrics reader share a store */
    int busy_ms;             /* SQLite's busy timeout: how long a write waits for another
                                process's lock (kvt_store_set_busy) */
    pthread_mutex_t last_mu; /* last_stats: read without mu (kvt_store_stats_try) */
    kvt_store_stats last_stats; /* the figures kvt_store_stats_get read last */
    _Atomic uint64_t skipped_lookups; /* lookups that found the store busy (kvt_store_lookup_try) */
    _Atomic int64_t skip_logged_ms;   /* since the last report, made at this kvt_now() (0: none) */
    sqlite3 *db;             /* NULL when a damaged database could not be replaced */
    char *dir, *path;        /* path: DIR/kvtier.db */
    dev_t dev;               /* the file db has open: another process that rebuilt a */
    ino_t ino;               /* damaged database replaced it (follow) */
    uint64_t budget;
    uint64_t min_free;       /* bytes kept free on the file system (KVT_STORE_MIN_FREE_DEFAULT) */
    bool full;               /* the operation met a full disk (SQLITE_FULL, a segment write) */
    double fail_logged;      /* kvt_store_report_save_failure: when it last printed, */
    uint64_t fail_quiet;     /* and the failures since that it did not print */
    bool quiet;
    bool durable;            /* synchronous=FULL (off only while a benchmark populates, or in tests) */
    bool keep_places;        /* removals leave their segment ranges to gc (quarantine: a damaged
                                row's place may be another row's) */
    bool inspect;            /* kvt_store_open_inspect: nothing is written, rebuilt or moved */
    ientry *idx;             /* (n_idx of cap_idx) sorted by head, then length */
    size_t n_idx, cap_idx;
    int64_t skip[64];        /* entries of a newer format: kept for the build that wrote them, */
    size_t n_skip;           /* passed over by this one's lookups */
    int64_t data_version;
    bool dirty;              /* the index must be rebuilt before the next lookup */
    int64_t *gone;           /* (n_gone) snapshots the write transaction in progress */
    size_t n_gone, cap_gone; /* removes: they leave the index when it commits */
    kvt_segs *segs;          /* the segment files (segments.h) */
    bool has_segs;           /* the database has the columns of schema 2 (seg, off, locs) */
    bloc *freed;             /* (n_freed) segment ranges of the records the write */
    size_t n_freed, cap_freed; /* transaction in progress removes: released when it commits */
    /* the write transaction's appends (seg_append): where the next goes,
     * and where the segment ended before the first, to cut it back to if
     * the transaction does not commit */
    bool seg_open, seg_wrote;
    uint32_t seg_cur;
    uint64_t seg_end, seg_cut_at;
    const char *op;          /* the operation in progress, for messages */
    int sql_rc;              /* its first SQLite failure (0: none) and SQLite's */
    char sql_msg[400];       /* message for it */
    bool corrupt;            /* SQLite reported the database damaged: kvt_recovery_rebuild */
    /* counters not yet written to the database, and those a write
     * transaction in progress is writing (cleared when it commits) */
    uint64_t lookups, hits, misses, save_errors;
    uint64_t flushing[4];
};

#define BLOCK_MAX (1ull << 30) /* a block record larger than this is damage */
#define LOC_BYTES 16           /* snaps.locs: per block u32 seg, u32 bytes, u64 off (LE) */

/* The columns kvt_db_check_snap_row reads (from a store of schema 1 opened
 * to inspect: no places, every record in its row). */
#define SNAP_COLS "model, head, n_tokens, tail, n_blocks, replay, bytes, data, rseg, roff"
#define SNAP_COLS1 "model, head, n_tokens, tail, n_blocks, replay, bytes, data, NULL, NULL"

/* A growing set of ids (oom: an add failed); kvt_db_idset_seal sorts it and
 * drops repeats. The caller frees v. */
typedef struct idset { int64_t *v; size_t n, cap; bool oom; } idset;

/* Whether an operation of this thread met another connection's lock
 * (kvt_store_busy_seen). */
extern _Thread_local bool kvt_db_busy_seen;

/* SQLite calls: the first failure of an operation is kept and ends it. */
int kvt_db_sql_note(kvt_store *st, int rc, const char *what);
int kvt_db_sql_status(const kvt_store *st);
bool kvt_db_forget_damage(kvt_store *st);
bool kvt_db_forget_finding(kvt_store *st);
sqlite3_stmt *kvt_db_prep(kvt_store *st, const char *sql, const char *what);
int kvt_db_step(kvt_store *st, sqlite3_stmt *stmt, const char *what);
int kvt_db_exec(kvt_store *st, const char *sql);
int kvt_db_q(kvt_store *st, sqlite3_stmt **out, const char *sql, int n, const int64_t *args);
int64_t kvt_db_q_int(kvt_store *st, const char *sql, int n, const int64_t *args, int64_t def);

/* Transactions, counters, the clock. */
int kvt_db_begin(kvt_store *st);
int kvt_db_commit(kvt_store *st);
void kvt_db_rollback(kvt_store *st);
void kvt_db_counter_add(kvt_store *st, const char *name, uint64_t v);
void kvt_db_flush_counters(kvt_store *st);
int64_t kvt_db_tick(kvt_store *st);
double kvt_db_now_unix(void);
void kvt_db_op_start(kvt_store *st, const char *name);

/* The connection. */
int kvt_db_open(kvt_store *st);
void kvt_db_close(kvt_store *st, bool keep_files);
bool kvt_db_same_file(const kvt_store *st);
int kvt_db_follow(kvt_store *st);
int kvt_db_schema_create(sqlite3 *db);
void kvt_db_index_remove(kvt_store *st, int64_t id);
void kvt_db_idset_add(idset *s, int64_t x);
void kvt_db_idset_seal(idset *s);
void kvt_db_snap_ids(kvt_store *st, idset *ids, bool report);

/* Where records are, and the checks of a row against its record. */
bool kvt_db_row_bloc(sqlite3_stmt *r, int cs, int co, int cb, bloc *w);
bool kvt_db_locs_at(const uint8_t *locs, size_t b, bloc *w);
void kvt_db_locs_put(kvt_wbuf *b, const bloc *w);
int kvt_db_read_bloc_into(kvt_store *st, const bloc *w, const kvt_block_rows *rows, uint8_t **buf, size_t *cap);
void kvt_db_delete_placed(kvt_store *st, const char *sql, int n, const int64_t *args);
void kvt_db_coalesce(bloc *v, size_t *n);
int kvt_db_seg_append(kvt_store *st, const void *p, size_t len, bloc *w);
/* The same from n pieces, one place for all of them (kvt_segs_writev:
 * seen is given each piece as it is written). */
int kvt_db_seg_appendv(kvt_store *st, const struct iovec *iov, int n, void (*seen)(void *, const void *, size_t),
                       void *arg, bloc *w);
int kvt_db_row_record(kvt_store *st, sqlite3_stmt *r, int cd, int cb, uint8_t **buf, size_t *cap, const uint8_t **p, size_t *len);
/* Records of a format newer than this build reads (a newer kvtier's in a
 * store it shares): magic right, version past KVT_SNAP_VERSION_MAX (a
 * snapshot record) or past KVT_SNAP_VERSION (a block record). KVT_DB_NEWER
 * when the record is one and its envelope (db.c) checks out: kept, never
 * removed as damaged (the budget still evicts it); a failure when it is one
 * that fails it (damaged); KVT_OK when it is not one (the usual checks
 * apply). */
#define KVT_DB_NEWER 1
int kvt_db_newer_snap(const uint8_t *p, size_t len);
int kvt_db_newer_block(const uint8_t *p, size_t len);
/* kvt_db_snap_row_agrees, kvt_db_check_snap_row and kvt_db_check_block_row
 * return KVT_DB_NEWER for a newer record whose envelope checks out and
 * whose row's size is its length (*in then holds its version only). */
int kvt_db_snap_row_agrees(sqlite3_stmt *r, int c0, const uint8_t *p, size_t len, kvt_snap_info *in);
int kvt_db_check_snap_row(kvt_store *st, sqlite3_stmt *r, int c0, kvt_snap_info *in, uint8_t **buf, size_t *cap);
const char *kvt_db_block_row_sql(const kvt_store *st);
int kvt_db_check_block_row(kvt_store *st, sqlite3_stmt *r, int c0, uint64_t key, uint8_t **buf, size_t *cap);

/* The running totals (the schema's totals row, kept by triggers): the
 * bytes of every record, the snapshots, the blocks and the references of
 * snapshots to blocks. */
typedef struct kvt_db_totals { int64_t bytes, snaps, blocks, refs; } kvt_db_totals;
/* As recorded in the totals row, and as the tables add up to (false, and
 * *t zero, when they cannot be read). */
bool kvt_db_totals_recorded(kvt_store *st, kvt_db_totals *t);
bool kvt_db_totals_counted(kvt_store *st, kvt_db_totals *t);
/* Whether the database has the totals row (a store made before it, opened
 * to inspect, lacks it). */
bool kvt_db_has_totals(kvt_store *st);
/* The recorded totals, or in a store opened to inspect that predates
 * them, the same added up. */
void kvt_db_totals_get(kvt_store *st, kvt_db_totals *t);
/* Set the totals to what the tables add up to (inside a write
 * transaction); true when they differed. Only damage makes them differ: a
 * damaged row's size read back as another number when it is removed. gc
 * and the removal of a damaged entry (quarantine) call this; *was and
 * *now (may be NULL) receive both. */
bool kvt_db_totals_resync(kvt_store *st, kvt_db_totals *was, kvt_db_totals *now);

#endif
