/* The disk tier: a durable, content-addressed, budgeted store of session
 * snapshots (see kvtier.h and docs/STORE.md).
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
 * A save reads the store's size from totals and evicts through an index on
 * snaps(last_used): its cost does not grow with the number of entries. A
 * load reads the snapshot's blocks from the places its row lists, each
 * with one read straight into the rows, on two threads; the rows are one
 * allocation (kvt_cache_reserve).
 *
 * Every SQLite failure is a failure of the operation that met it (sql_note),
 * never the end of a table. When SQLite reports the database damaged
 * (SQLITE_CORRUPT, SQLITE_NOTADB), whatever the operation, the store builds
 * a new database from the records that still read and check out, moves the
 * damaged one aside and goes on with the new one (recover).
 *
 * Lookup never scans: each process keeps an index of (head key, length,
 * tail hash) for all snapshots. Its own saves and removals update it as they
 * commit; it is rebuilt only when PRAGMA data_version says another
 * connection changed the database. A prompt is hashed once along its
 * 128-token blocks; each block boundary is probed in the index, longest
 * first, and a candidate's tail is hashed only when its head matches.
 *
 * Eviction is least-recently-used over snapshots (a logical clock, not wall
 * time, orders uses); removing a snapshot releases its blocks, and a block
 * is freed only when no snapshot references it. The snapshot just written is
 * never the one evicted.
 */
#include "store/segments.h"
#include "session/snapshot.h"
#include "store/store.h"
#include "store/testing.h"
#include "store/storedir.h"
#include "arch/model.h"
#include "base/util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <time.h>

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
    bool corrupt;            /* SQLite reported the database damaged: recover() */
    /* counters not yet written to the database, and those a write
     * transaction in progress is writing (cleared when it commits) */
    uint64_t lookups, hits, misses, save_errors;
    uint64_t flushing[4];
};

/* ---- SQLite calls ----
 *
 * The first SQLite failure of an operation is kept (st->sql_rc, with
 * SQLite's message) and ends it: statements after it are not run (prep
 * gives no statement, q and step fail at once), so a loop over rows ends on
 * the failure and the operation reports it instead of taking it for the end
 * of a table, and a write transaction that met one rolls back (commit). */

static bool is_damage(int rc)
{
    return (rc & 0xff) == SQLITE_CORRUPT || (rc & 0xff) == SQLITE_NOTADB;
}

/* Whether an operation of this thread met another connection's lock
 * (kvt_store_busy_seen). */
static _Thread_local bool busy_seen;

/* Note SQLite result rc of a failed call (what: the step, or NULL for the
 * operation); returns KVT_EIO with the kept failure's message. */
static int sql_note(kvt_store *st, int rc, const char *what)
{
    if (is_damage(rc)) st->corrupt = true;
    if ((rc & 0xff) == SQLITE_FULL) st->full = true;
    if ((rc & 0xff) == SQLITE_BUSY || (rc & 0xff) == SQLITE_LOCKED) busy_seen = true;
    if (!st->sql_rc) {
        st->sql_rc = rc;
        snprintf(st->sql_msg, sizeof st->sql_msg, "cache store: %s: %s", what ? what : st->op ? st->op : "query",
                 (rc & 0xff) == SQLITE_FULL ? "disk full" : st->db ? sqlite3_errmsg(st->db) : sqlite3_errstr(rc));
    }
    return kvt_fail(KVT_EIO, "%s", st->sql_msg);
}

/* The operation's SQLite failure, if it met one, as its result. */
static int sql_status(const kvt_store *st)
{
    return st->sql_rc ? kvt_fail(KVT_EIO, "%s", st->sql_msg) : KVT_OK;
}

/* Damage met while inspecting (verify, gc's checks) is a finding, not the
 * end of the inspection: forget it (st->corrupt stays set) and go on. True
 * when the kept failure was damage; any other failure is kept. */
static bool forget_damage(kvt_store *st)
{
    if (!st->sql_rc || !is_damage(st->sql_rc)) return false;
    st->sql_rc = 0;
    return true;
}

/* The same for a statement an inspection cannot prepare or finish because
 * of what the file holds: damage, or a header or schema SQLite does not
 * accept (SQLITE_ERROR, such as "unsupported file format"). */
static bool forget_finding(kvt_store *st)
{
    if (st->sql_rc && ((st->sql_rc & 0xff) == SQLITE_ERROR || (st->sql_rc & 0xff) == SQLITE_FORMAT)) {
        st->sql_rc = 0;
        return true;
    }
    return forget_damage(st);
}

static sqlite3_stmt *prep(kvt_store *st, const char *sql, const char *what)
{
    sqlite3_stmt *stmt = NULL;
    if (st->sql_rc) return NULL;
    int rc = sqlite3_prepare_v2(st->db, sql, -1, &stmt, NULL);
    if (rc != SQLITE_OK) {
        sql_note(st, rc, what);
        sqlite3_finalize(stmt);
        return NULL;
    }
    return stmt;
}

/* SQLITE_ROW, SQLITE_DONE or a failure (noted; also when a failure came
 * before). */
static int step(kvt_store *st, sqlite3_stmt *stmt, const char *what)
{
    if (st->sql_rc || !stmt) return st->sql_rc ? st->sql_rc : SQLITE_MISUSE;
    int rc = sqlite3_step(stmt);
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) sql_note(st, rc, what);
    return rc;
}

static int exec(kvt_store *st, const char *sql)
{
    int rc = sqlite3_exec(st->db, sql, NULL, NULL, NULL);
    return rc == SQLITE_OK ? KVT_OK : sql_note(st, rc, NULL);
}

/* End a transaction without its changes (a read, or a write that failed). */
static void rollback(kvt_store *st)
{
    /* the segment's bytes this transaction appended go, while its write
     * lock still keeps other writers out */
    if (st->seg_wrote && st->db && !sqlite3_get_autocommit(st->db))
        kvt_segs_truncate(st->segs, st->seg_cur, st->seg_cut_at);
    if (st->db && !sqlite3_get_autocommit(st->db)) {
        int rc = sqlite3_exec(st->db, "ROLLBACK", NULL, NULL, NULL);
        if (rc != SQLITE_OK) sql_note(st, rc, "rollback");
    }
    st->n_gone = 0;
    st->n_freed = 0;
    st->seg_open = st->seg_wrote = false;
    memset(st->flushing, 0, sizeof st->flushing);
}

static int begin(kvt_store *st)
{
    st->n_gone = 0;
    st->n_freed = 0;
    st->seg_open = st->seg_wrote = false;
    memset(st->flushing, 0, sizeof st->flushing);
    return exec(st, "BEGIN IMMEDIATE");
}

static void index_remove(kvt_store *st, int64_t id);
static void release_freed(kvt_store *st);

/* Commit a write transaction. One that met a failure, or cannot commit, is
 * rolled back, so the connection is never left inside it. Once it commits,
 * the snapshots it removed leave the index and the counters it wrote leave
 * memory. */
static int commit(kvt_store *st)
{
    /* the rows it commits name only bytes the disk holds */
    if (!st->sql_rc && st->seg_wrote && st->durable && kvt_segs_sync(st->segs) != KVT_OK) {
        char why[400];
        snprintf(why, sizeof why, "%s", kvt_errmsg());
        rollback(st);
        return kvt_fail(KVT_EIO, "%s", why);
    }
    if (!st->sql_rc) exec(st, "COMMIT");
    if (st->sql_rc) {
        rollback(st);
        return sql_status(st);
    }
    st->seg_open = st->seg_wrote = false;
    for (size_t i = 0; i < st->n_gone; i++) index_remove(st, st->gone[i]);
    st->n_gone = 0;
    release_freed(st);
    st->lookups -= st->flushing[0];
    st->hits -= st->flushing[1];
    st->misses -= st->flushing[2];
    st->save_errors -= st->flushing[3];
    memset(st->flushing, 0, sizeof st->flushing);
    return KVT_OK;
}

/* Prepare, bind int64 parameters, step once. Returns the sqlite3 result; a
 * row, when there is one, is left in *out (finalize it). */
static int q(kvt_store *st, sqlite3_stmt **out, const char *sql, int n, const int64_t *args)
{
    sqlite3_stmt *stmt = prep(st, sql, NULL);
    if (!stmt) return st->sql_rc;
    for (int i = 0; i < n; i++) sqlite3_bind_int64(stmt, i + 1, args[i]);
    int rc = step(st, stmt, NULL);
    if (out && rc == SQLITE_ROW) *out = stmt;
    else sqlite3_finalize(stmt);
    return rc;
}

/* The first column of the first row, or def (no row, or a failure, which
 * is noted). */
static int64_t q_int(kvt_store *st, const char *sql, int n, const int64_t *args, int64_t def)
{
    sqlite3_stmt *stmt = NULL;
    int64_t v = def;
    if (q(st, &stmt, sql, n, args) == SQLITE_ROW) {
        v = sqlite3_column_int64(stmt, 0);
        sqlite3_finalize(stmt);
    }
    return v;
}

static double now_unix(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void counter_add(kvt_store *st, const char *name, uint64_t v)
{
    if (!v) return;
    sqlite3_stmt *stmt = prep(st, "INSERT INTO counters(name, value) VALUES(?1, ?2) "
                                  "ON CONFLICT(name) DO UPDATE SET value = value + ?2", NULL);
    if (!stmt) return;
    sqlite3_bind_text(stmt, 1, name, -1, SQLITE_STATIC);
    sqlite3_bind_int64(stmt, 2, (int64_t)v);
    step(st, stmt, NULL);
    sqlite3_finalize(stmt);
}

/* Write pending in-memory counters (inside a write transaction; commit
 * takes them out of memory). */
static void flush_counters(kvt_store *st)
{
    uint64_t v[4] = {st->lookups, st->hits, st->misses, st->save_errors};
    counter_add(st, "lookups", v[0]);
    counter_add(st, "hits", v[1]);
    counter_add(st, "misses", v[2]);
    counter_add(st, "save_errors", v[3]);
    memcpy(st->flushing, v, sizeof v);
}

static int64_t tick(kvt_store *st)
{
    q(st, NULL, "UPDATE meta SET v = v + 1 WHERE k = 'tick'", 0, NULL);
    return q_int(st, "SELECT v FROM meta WHERE k = 'tick'", 0, NULL, 0);
}

static const char *schema =
    "CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS blocks(key INTEGER PRIMARY KEY, refs INTEGER NOT NULL,"
    "  bytes INTEGER NOT NULL, data BLOB NOT NULL, seg INTEGER, off INTEGER);"
    "CREATE TABLE IF NOT EXISTS snaps(id INTEGER PRIMARY KEY AUTOINCREMENT, model INTEGER NOT NULL,"
    "  head INTEGER NOT NULL, n_tokens INTEGER NOT NULL, tail INTEGER NOT NULL, n_blocks INTEGER NOT NULL,"
    "  reason TEXT NOT NULL, created REAL NOT NULL, last_used INTEGER NOT NULL, used_at REAL NOT NULL,"
    "  hits INTEGER NOT NULL DEFAULT 0, bytes INTEGER NOT NULL, preview TEXT NOT NULL, data BLOB NOT NULL,"
    "  replay INTEGER NOT NULL DEFAULT 0, locs BLOB, rseg INTEGER, roff INTEGER, UNIQUE(head, n_tokens, tail));"
    "CREATE TABLE IF NOT EXISTS snap_blocks(snap INTEGER NOT NULL, idx INTEGER NOT NULL, key INTEGER NOT NULL,"
    "  PRIMARY KEY(snap, idx)) WITHOUT ROWID;"
    "CREATE TABLE IF NOT EXISTS counters(name TEXT PRIMARY KEY, value INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS quarantine(id INTEGER PRIMARY KEY, what TEXT NOT NULL, reason TEXT NOT NULL,"
    "  at REAL NOT NULL);"
    "INSERT OR IGNORE INTO meta(k, v) VALUES('schema', 2), ('tick', 0);";

/* Schema 2 keeps block records in segment files (segments.h): blocks.seg
 * and blocks.off say where (NULL: in blocks.data, as schema 1 kept them all;
 * a segment block's data is empty) and snaps.locs lists the places of a
 * snapshot's blocks, so that a load needs no lookup per block. A schema 1
 * store gets the columns and keeps its blocks where they are; builds of
 * schema 1 refuse a schema 2 store (they would take its empty data for
 * damage). */
static const char *schema_segs =
    "CREATE INDEX IF NOT EXISTS blocks_seg ON blocks(seg, off);"
    "CREATE INDEX IF NOT EXISTS snaps_seg ON snaps(rseg, roff);"
    "INSERT OR IGNORE INTO meta(k, v) VALUES('seg', 1);"
    "UPDATE meta SET v = 2 WHERE k = 'schema' AND v = 1;";

/* Running totals, so that a save reads the store's size instead of adding
 * it up (docs/STORE.md): one row, kept by triggers in the transaction of
 * every insert, delete or resize of a snapshot, block or block reference,
 * whichever build or code path makes it, so they are exact after any
 * commit and roll back with any rollback. A store without them (made
 * before them, or rebuilt by a build that predates them) gets them added
 * up once, in the transaction that creates the triggers. The index on
 * last_used lets eviction take the least recently used snapshot without a
 * sort of the table. Builds before these ignore them (their writes fire
 * the triggers all the same), so the schema version stays 1. */
static const char *schema_totals =
    "CREATE TABLE IF NOT EXISTS totals(one INTEGER PRIMARY KEY CHECK (one = 1), bytes INTEGER NOT NULL,"
    "  snaps INTEGER NOT NULL, blocks INTEGER NOT NULL, refs INTEGER NOT NULL);"
    "INSERT OR IGNORE INTO totals(one, bytes, snaps, blocks, refs) SELECT 1,"
    "  (SELECT COALESCE(SUM(bytes), 0) FROM snaps) + (SELECT COALESCE(SUM(bytes), 0) FROM blocks),"
    "  (SELECT COUNT(*) FROM snaps), (SELECT COUNT(*) FROM blocks), (SELECT COUNT(*) FROM snap_blocks);"
    "CREATE TRIGGER IF NOT EXISTS totals_snap_add AFTER INSERT ON snaps BEGIN"
    "  UPDATE totals SET bytes = IFNULL(bytes, 0) + IFNULL(NEW.bytes, 0), snaps = IFNULL(snaps, 0) + 1; END;"
    "CREATE TRIGGER IF NOT EXISTS totals_snap_del AFTER DELETE ON snaps BEGIN"
    "  UPDATE totals SET bytes = IFNULL(bytes, 0) - IFNULL(OLD.bytes, 0), snaps = IFNULL(snaps, 0) - 1; END;"
    "CREATE TRIGGER IF NOT EXISTS totals_snap_size AFTER UPDATE OF bytes ON snaps BEGIN"
    "  UPDATE totals SET bytes = IFNULL(bytes, 0) - IFNULL(OLD.bytes, 0) + IFNULL(NEW.bytes, 0); END;"
    "CREATE TRIGGER IF NOT EXISTS totals_block_add AFTER INSERT ON blocks BEGIN"
    "  UPDATE totals SET bytes = IFNULL(bytes, 0) + IFNULL(NEW.bytes, 0), blocks = IFNULL(blocks, 0) + 1; END;"
    "CREATE TRIGGER IF NOT EXISTS totals_block_del AFTER DELETE ON blocks BEGIN"
    "  UPDATE totals SET bytes = IFNULL(bytes, 0) - IFNULL(OLD.bytes, 0), blocks = IFNULL(blocks, 0) - 1; END;"
    "CREATE TRIGGER IF NOT EXISTS totals_block_size AFTER UPDATE OF bytes ON blocks BEGIN"
    "  UPDATE totals SET bytes = IFNULL(bytes, 0) - IFNULL(OLD.bytes, 0) + IFNULL(NEW.bytes, 0); END;"
    "CREATE TRIGGER IF NOT EXISTS totals_ref_add AFTER INSERT ON snap_blocks BEGIN"
    "  UPDATE totals SET refs = IFNULL(refs, 0) + 1; END;"
    "CREATE TRIGGER IF NOT EXISTS totals_ref_del AFTER DELETE ON snap_blocks BEGIN"
    "  UPDATE totals SET refs = IFNULL(refs, 0) - 1; END;"
    "CREATE INDEX IF NOT EXISTS snaps_lru ON snaps(last_used, id);";

/* What schema_totals adds, all present, and the totals row: the schema is
 * up to date and an open need not take the write lock to set it up. */
static const char *schema_current =
    "SELECT (SELECT v FROM meta WHERE k = 'schema'), (SELECT COUNT(*) FROM totals),"
    " (SELECT COUNT(*) FROM sqlite_master WHERE name IN ('totals_snap_add', 'totals_snap_del', 'totals_snap_size',"
    "   'totals_block_add', 'totals_block_del', 'totals_block_size', 'totals_ref_add', 'totals_ref_del', 'snaps_lru')),"
    " (SELECT COUNT(*) FROM pragma_table_info('snaps') WHERE name IN ('replay', 'locs', 'rseg', 'roff'))"
    " + (SELECT COUNT(*) FROM pragma_table_info('blocks') WHERE name IN ('seg', 'off'))"
    " + (SELECT COUNT(*) FROM sqlite_master WHERE name IN ('blocks_seg', 'snaps_seg'))";

/* Start an operation (name: for messages). */
static void op_start(kvt_store *st, const char *name)
{
    st->op = name;
    st->sql_rc = 0;
    st->sql_msg[0] = 0;
}

/* A header that declares a file format this SQLite cannot write (write
 * version above 2: the file opens read-only) or read (schema format above
 * 4) makes the store unusable for good, as damage does. */
static void unusable_header(kvt_store *st)
{
    int code = st->sql_rc & 0xff;
    if ((code == SQLITE_READONLY && access(st->path, W_OK) == 0 && access(st->dir, W_OK) == 0) ||
        (code == SQLITE_ERROR && strstr(st->sql_msg, "unsupported file format")))
        st->corrupt = true;
}

/* True when the database has every table, column, trigger and index this
 * build adds (then *ver gets its schema version). A database that lacks
 * some is not current; a failure other than a missing object is noted. */
static bool schema_is_current(kvt_store *st, int64_t *ver)
{
    sqlite3_stmt *stmt = NULL;
    int rc = sqlite3_prepare_v2(st->db, schema_current, -1, &stmt, NULL);
    if (rc != SQLITE_OK) {
        sqlite3_finalize(stmt);
        if ((rc & 0xff) != SQLITE_ERROR) sql_note(st, rc, "open");
        return false; /* no such table: set it up */
    }
    bool current = false;
    if (step(st, stmt, "open") == SQLITE_ROW) {
        *ver = sqlite3_column_type(stmt, 0) == SQLITE_NULL ? -1 : sqlite3_column_int64(stmt, 0);
        current = *ver >= 0 && sqlite3_column_int64(stmt, 1) == 1 && sqlite3_column_int64(stmt, 2) == 9 &&
                  sqlite3_column_int64(stmt, 3) == 8;
    }
    sqlite3_finalize(stmt);
    /* a header that forbids writing: the set-up path finds it (unusable_header) */
    return current && !st->sql_rc && sqlite3_db_readonly(st->db, "main") == 0;
}

/* Whether the database has schema 2's columns (a schema 1 store opened to
 * inspect does not: its blocks are all in their rows). */
static void note_columns(kvt_store *st)
{
    st->has_segs = q_int(st, "SELECT (SELECT COUNT(*) FROM pragma_table_info('blocks') WHERE name IN ('seg', 'off'))"
                             " + (SELECT COUNT(*) FROM pragma_table_info('snaps') WHERE name IN ('locs', 'rseg', 'roff'))",
                         0, NULL, 0) == 5;
    forget_finding(st);
}

/* A reader of a WAL database needs its shared-memory file, which SQLite
 * creates and sizes even for a read-only connection: on a read-only or full
 * file system it cannot, and the first read fails. When there is no WAL (a
 * store closed cleanly), the database file is the whole store: it is then
 * read as immutable (no -shm, no locks). With a WAL, reading without it
 * could see a state that never was, so the failure stands. */
static int inspect_fallback(kvt_store *st)
{
    int rc = sqlite3_exec(st->db, "SELECT COUNT(*) FROM sqlite_master", NULL, NULL, NULL);
    int code = rc & 0xff;
    if (rc == SQLITE_OK || is_damage(rc) ||
        (code != SQLITE_IOERR && code != SQLITE_CANTOPEN && code != SQLITE_READONLY && code != SQLITE_FULL))
        return KVT_OK; /* the inspection meets it and reports it */
    size_t plen = strlen(st->path);
    char *wal = kvt_malloc(plen + 8), *uri = kvt_malloc(plen * 3 + 32);
    if (!wal || !uri) { free(wal); free(uri); return KVT_ENOMEM; }
    snprintf(wal, plen + 8, "%s-wal", st->path);
    struct stat sb;
    bool no_wal = stat(wal, &sb) != 0 ? errno == ENOENT : sb.st_size == 0;
    free(wal);
    if (!no_wal) { free(uri); return KVT_OK; }
    /* file:PATH?immutable=1, PATH percent-encoded */
    size_t k = (size_t)snprintf(uri, 8, "file:");
    for (const unsigned char *c = (const unsigned char *)st->path; *c; c++)
        if ((*c >= 'A' && *c <= 'Z') || (*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || strchr("/._-~", *c))
            uri[k++] = (char)*c;
        else
            k += (size_t)snprintf(uri + k, 4, "%%%02X", *c);
    snprintf(uri + k, 16, "?immutable=1");
    sqlite3_close(st->db);
    st->db = NULL;
    rc = sqlite3_open_v2(uri, &st->db, SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX | SQLITE_OPEN_NOFOLLOW | SQLITE_OPEN_URI,
                         NULL);
    free(uri);
    if (rc != SQLITE_OK) {
        rc = sql_note(st, rc, "open");
        sqlite3_close(st->db);
        st->db = NULL;
        return rc;
    }
    return KVT_OK;
}

static int open_db(kvt_store *st)
{
    st->dirty = true;
    st->data_version = -1;
    /* The file is made here (0600, O_EXCL | O_NOFOLLOW: SQLite's WAL,
     * shared memory and the segments take its mode), and SQLite never
     * follows a link at its name. To inspect, the connection is read-only:
     * nothing is created or written, so a read-only or full store can be
     * checked. */
    int rc = st->inspect ? KVT_OK : kvt_storedir_file(st->path);
    for (int k = 0; k < 2 && !rc; k++) {
        char side[4200];
        snprintf(side, sizeof side, "%s%s", st->path, k ? "-shm" : "-wal");
        rc = kvt_storedir_no_link(side);
    }
    if (rc) return rc;
    int flags = SQLITE_OPEN_NOMUTEX | SQLITE_OPEN_NOFOLLOW |
                (st->inspect ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE);
    rc = sqlite3_open_v2(st->path, &st->db, flags, NULL);
    if (rc != SQLITE_OK) {
        rc = sql_note(st, rc, "open");
        sqlite3_close(st->db);
        st->db = NULL;
        return rc;
    }
    struct stat sb;
    if (stat(st->path, &sb) == 0) {
        st->dev = sb.st_dev;
        st->ino = sb.st_ino;
    }
    sqlite3_busy_timeout(st->db, st->busy_ms);
    /* to inspect, the last connection out must not checkpoint the WAL into
     * the database and delete it, as closing one otherwise does */
    if (st->inspect) {
        if (sqlite3_db_config(st->db, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, NULL) != SQLITE_OK)
            return sql_note(st, sqlite3_errcode(st->db), "open");
        if ((rc = inspect_fallback(st))) return rc;
        note_columns(st);
        return KVT_OK;
    }
    if ((rc = exec(st, "PRAGMA journal_mode=WAL")) || (rc = exec(st, "PRAGMA wal_autocheckpoint=" KVT_STR(WAL_PAGES))) ||
        (rc = exec(st, "PRAGMA journal_size_limit=" KVT_STR(WAL_LIMIT))) ||
        (rc = exec(st, st->durable ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=OFF"))) {
        unusable_header(st);
        return rc;
    }
    int64_t ver = -1;
    if (!schema_is_current(st, &ver)) {
        if (st->sql_rc || (rc = begin(st))) {
            unusable_header(st);
            return sql_status(st);
        }
        exec(st, schema);
        /* snaps.replay (the record has no state section) came after the first
         * stores: add it where it is missing. Builds that predate it ignore it
         * and write whole records, which its default describes. */
        if (q_int(st, "SELECT COUNT(*) FROM pragma_table_info('snaps') WHERE name = 'replay'", 0, NULL, 1) == 0)
            exec(st, "ALTER TABLE snaps ADD COLUMN replay INTEGER NOT NULL DEFAULT 0");
        if (q_int(st, "SELECT COUNT(*) FROM pragma_table_info('snaps') WHERE name = 'locs'", 0, NULL, 1) == 0) {
            exec(st, "ALTER TABLE snaps ADD COLUMN locs BLOB");
            exec(st, "ALTER TABLE snaps ADD COLUMN rseg INTEGER");
            exec(st, "ALTER TABLE snaps ADD COLUMN roff INTEGER");
        }
        if (q_int(st, "SELECT COUNT(*) FROM pragma_table_info('blocks') WHERE name = 'seg'", 0, NULL, 1) == 0) {
            exec(st, "ALTER TABLE blocks ADD COLUMN seg INTEGER");
            exec(st, "ALTER TABLE blocks ADD COLUMN off INTEGER");
        }
        exec(st, schema_totals);
        exec(st, schema_segs);
        ver = q_int(st, "SELECT v FROM meta WHERE k = 'schema'", 0, NULL, -1);
        if ((rc = commit(st))) {
            unusable_header(st);
            return rc;
        }
    }
    if (ver != SCHEMA_VERSION)
        return kvt_fail(KVT_EUNSUPPORTED, "cache store %s has schema version %lld (this build uses %d)", st->path,
                        (long long)ver, SCHEMA_VERSION);
    note_columns(st);
    return KVT_OK;
}

/* Close the connection. keep_files: the database was renamed or replaced
 * under it, so the WAL and shared-memory files of its name are another
 * database's now; they must not be deleted on the way out. */
static void close_db(kvt_store *st, bool keep_files)
{
    if (!st->db) return;
    if (keep_files) {
        int one = 1;
        sqlite3_file_control(st->db, "main", SQLITE_FCNTL_PERSIST_WAL, &one);
    }
    sqlite3_close(st->db);
    st->db = NULL;
}

/* Whether path still names the file the connection has open. */
static bool same_file(const kvt_store *st)
{
    struct stat sb;
    return stat(st->path, &sb) == 0 && sb.st_dev == st->dev && sb.st_ino == st->ino;
}

/* Another process rebuilt a damaged database (recover) under this one:
 * leave the old file and open the new one. A missing file is someone's
 * rebuild in progress: the old connection serves until it is done. */
static int follow(kvt_store *st)
{
    struct stat sb;
    if (st->inspect || !st->db || stat(st->path, &sb) != 0 || (sb.st_dev == st->dev && sb.st_ino == st->ino))
        return KVT_OK;
    close_db(st, true);
    kvt_segs_close_all(st->segs);
    return open_db(st);
}

/* ---- a damaged database ---- */

typedef struct idset { int64_t *v; size_t n, cap; bool oom; } idset;

static void idset_add(idset *s, int64_t x)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap : 64, bytes;
        if (!kvt_mul_ok(cap, 2 * sizeof *s->v, &bytes)) { s->oom = true; return; }
        int64_t *v = realloc(s->v, bytes);
        if (!v) { s->oom = true; return; }
        s->v = v;
        s->cap = 2 * cap;
    }
    s->v[s->n++] = x;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Sort, drop repeats. */
static void idset_seal(idset *s)
{
    if (s->n) qsort(s->v, s->n, sizeof *s->v, cmp_i64);
    size_t k = 0;
    for (size_t i = 0; i < s->n; i++)
        if (!k || s->v[k - 1] != s->v[i]) s->v[k++] = s->v[i];
    s->n = k;
}

/* The snapshot ids the database lists: its table, and its unique index
 * (which holds every row's id too, so a damaged table still names the rows
 * it lost). A damaged part ends a list (reported when report is set); any
 * other failure is kept in st->sql_rc. */
static void snap_ids(kvt_store *st, idset *ids, bool report)
{
    static const char *const sqls[2] = {"SELECT id FROM snaps NOT INDEXED",
                                        "SELECT id FROM snaps INDEXED BY sqlite_autoindex_snaps_1"};
    for (int k = 0; k < 2 && !st->sql_rc; k++) {
        sqlite3_stmt *stmt = prep(st, sqls[k], k ? "snapshot index" : "snapshots");
        while (stmt && step(st, stmt, k ? "snapshot index" : "snapshots") == SQLITE_ROW)
            idset_add(ids, sqlite3_column_int64(stmt, 0));
        sqlite3_finalize(stmt);
        if (forget_damage(st) && report && !st->quiet) fprintf(stderr, "kvtier: %s\n", st->sql_msg);
    }
}

/* ---- where blocks are ---- */

#define BLOCK_MAX (1ull << 30) /* a block record larger than this is damage */
#define LOC_BYTES 16           /* snaps.locs: per block u32 seg, u32 bytes, u64 off (LE) */

/* The place a row's seg, off and bytes columns (cs, co, cb) say, checked:
 * false when they cannot be a block's. A row with a NULL seg keeps its
 * record in its data column (w->seg = 0). */
static bool row_bloc(sqlite3_stmt *r, int cs, int co, int cb, bloc *w)
{
    *w = (bloc){0};
    int64_t bytes = sqlite3_column_int64(r, cb);
    if (bytes <= 0 || (uint64_t)bytes > BLOCK_MAX) return false;
    w->bytes = (uint64_t)bytes;
    if (sqlite3_column_type(r, cs) == SQLITE_NULL) return true;
    int64_t seg = sqlite3_column_int64(r, cs), off = sqlite3_column_int64(r, co);
    if (seg < 1 || seg > UINT32_MAX || off < 0 || off > INT64_MAX - bytes) return false;
    w->seg = (uint32_t)seg;
    w->off = (uint64_t)off;
    return true;
}

/* Entry b of a snapshot's locs (its length checked by the caller). */
static bool locs_at(const uint8_t *locs, size_t b, bloc *w)
{
    const uint8_t *p = locs + LOC_BYTES * b;
    *w = (bloc){kvt_rd32(p), kvt_rd64(p + 8), kvt_rd32(p + 4)};
    return w->bytes > 0 && w->off <= (uint64_t)INT64_MAX - w->bytes;
}

static void locs_put(kvt_wbuf *b, const bloc *w)
{
    uint8_t e[LOC_BYTES];
    uint32_t seg = w->seg, bytes = (uint32_t)w->bytes;
    memcpy(e, &seg, 4);
    memcpy(e + 4, &bytes, 4);
    memcpy(e + 8, &w->off, 8);
    kvt_wbuf_put(b, e, sizeof e);
}

/* Block b's record at w (a segment place), read whole into *buf, or with
 * rows (non-NULL) its rows straight into them and the bytes before and
 * after them (the checksum) into *buf, all in one read. May run on two
 * threads at once (kvt_segs_readv). */
static int read_bloc_into(kvt_store *st, const bloc *w, const kvt_block_rows *rows, uint8_t **buf, size_t *cap)
{
    size_t whole = (size_t)w->bytes, head = rows ? whole - rows->bytes - 8 : whole;
    size_t need = rows ? head + 8 : whole, n = rows ? (size_t)rows->n + 2 : 1;
    if (need > *cap) {
        uint8_t *nb = realloc(*buf, need);
        if (!nb) return kvt_fail(KVT_ENOMEM, "block of %zu bytes", whole);
        *buf = nb;
        *cap = need;
    }
    struct iovec local[64], *v = n <= 64 ? local : kvt_malloc(n * sizeof *v);
    if (!v) return KVT_ENOMEM;
    v[0] = (struct iovec){*buf, head};
    if (rows) {
        memcpy(v + 1, rows->iov, (size_t)rows->n * sizeof *v);
        v[n - 1] = (struct iovec){*buf + head, 8};
    }
    int rc = kvt_segs_readv(st->segs, w->seg, w->off, v, (int)n);
    if (v != local) free(v);
    return rc;
}

/* Delete rows whose records are in segments (sql: a DELETE ... RETURNING
 * the place: segment, offset, bytes); the segment ranges they leave are
 * released when the transaction commits. */
static void delete_placed(kvt_store *st, const char *sql, int n, const int64_t *args)
{
    sqlite3_stmt *stmt = prep(st, sql, NULL);
    if (!stmt) return;
    for (int i = 0; i < n; i++) sqlite3_bind_int64(stmt, i + 1, args[i]);
    while (step(st, stmt, NULL) == SQLITE_ROW) {
        bloc w;
        if (!row_bloc(stmt, 0, 1, 2, &w) || !w.seg || st->keep_places) continue;
        int rc; /* a range not recorded stays allocated until gc */
        KVT_GROW(st->freed, &st->cap_freed, st->n_freed + 1, rc);
        if (!rc) st->freed[st->n_freed++] = w;
    }
    sqlite3_finalize(stmt);
}

static int cmp_bloc(const void *a, const void *b)
{
    const bloc *x = a, *y = b;
    if (x->seg != y->seg) return x->seg < y->seg ? -1 : 1;
    return x->off < y->off ? -1 : x->off > y->off;
}

/* Sort places and join those that touch: records removed together often
 * lie end to end, and a hole punched over the run frees the pages that
 * straddle two of them, which holes record by record leave (a ds4-tiny
 * block is about one 4 KiB page). */
static void coalesce(bloc *v, size_t *n)
{
    if (*n < 2) return;
    qsort(v, *n, sizeof *v, cmp_bloc);
    size_t k = 0;
    for (size_t i = 1; i < *n; i++) {
        bloc *c = &v[k];
        if (v[i].seg == c->seg && v[i].off <= c->off + c->bytes) {
            if (v[i].off + v[i].bytes > c->off + c->bytes) c->bytes = v[i].off + v[i].bytes - c->off;
        } else {
            v[++k] = v[i];
        }
    }
    *n = k + 1;
}

/* The write transaction that removed st->freed committed: punch their
 * ranges out of the segments, and delete a segment that holds no block and
 * takes no more (below the current one). Best effort, after the commit: a
 * failure or a crash here only leaves space that gc gives back. */
static void release_freed(kvt_store *st)
{
    if (!st->n_freed) return;
    sqlite3_stmt *cur = NULL, *any = NULL;
    sqlite3_prepare_v2(st->db, "SELECT v FROM meta WHERE k = 'seg'", -1, &cur, NULL);
    sqlite3_prepare_v2(st->db, "SELECT EXISTS(SELECT 1 FROM blocks WHERE seg = ?1) OR EXISTS(SELECT 1 FROM snaps WHERE rseg = ?1)",
                       -1, &any, NULL);
    int64_t current = cur && sqlite3_step(cur) == SQLITE_ROW ? sqlite3_column_int64(cur, 0) : INT64_MAX;
    coalesce(st->freed, &st->n_freed);
    for (size_t i = 0; i < st->n_freed; i++) {
        const bloc *w = &st->freed[i];
        kvt_segs_release(st->segs, w->seg, w->off, w->bytes);
        bool seen = false;
        for (size_t k = 0; k < i && !seen; k++) seen = st->freed[k].seg == w->seg;
        if (seen || (int64_t)w->seg >= current || !any) continue;
        sqlite3_reset(any);
        sqlite3_bind_int64(any, 1, w->seg);
        if (sqlite3_step(any) == SQLITE_ROW && sqlite3_column_int(any, 0) == 0) kvt_segs_remove(st->segs, w->seg);
    }
    sqlite3_finalize(cur);
    sqlite3_finalize(any);
    st->n_freed = 0;
}

/* The segment a save appends to and where: the current one (meta 'seg'),
 * cut back to the end of its last committed block (what a save that failed
 * or was cut off left is garbage), or the next one when it is full. Inside
 * the save's write transaction. */
static int open_segment(kvt_store *st, uint32_t *seg, uint64_t *end)
{
    int64_t cur = q_int(st, "SELECT v FROM meta WHERE k = 'seg'", 0, NULL, 1);
    if (st->sql_rc) return sql_status(st);
    if (cur < 1 || cur > UINT32_MAX) cur = 1;
    for (;;) {
        int64_t e = q_int(st, "SELECT MAX(COALESCE((SELECT off + bytes FROM blocks WHERE seg = ?1 ORDER BY off DESC LIMIT 1), 0),"
                              " COALESCE((SELECT roff + bytes FROM snaps WHERE rseg = ?1 ORDER BY roff DESC LIMIT 1), 0))",
                          1, &cur, 0);
        if (st->sql_rc) return sql_status(st);
        if (e < 0) e = 0;
        uint64_t size;
        int rc = kvt_segs_size(st->segs, (uint32_t)cur, &size);
        if (rc) return rc;
        if ((uint64_t)e < SEG_MAX || cur == UINT32_MAX) {
            if (size > (uint64_t)e && (rc = kvt_segs_truncate(st->segs, (uint32_t)cur, (uint64_t)e))) return rc;
            *seg = (uint32_t)cur;
            *end = (uint64_t)e;
            return KVT_OK;
        }
        cur++;
        q(st, NULL, "INSERT OR REPLACE INTO meta(k, v) VALUES('seg', ?)", 1, &cur);
        if (st->sql_rc) return sql_status(st);
    }
}

/* Append a record to the current segment inside a write transaction; *w
 * receives its place. commit syncs the segment first; rollback cuts it
 * back. */
static int seg_append(kvt_store *st, const void *p, size_t len, bloc *w)
{
    int rc;
    if (!st->seg_open) {
        if ((rc = open_segment(st, &st->seg_cur, &st->seg_end))) return rc;
        st->seg_open = true;
        st->seg_cut_at = st->seg_end;
    }
    st->seg_wrote = true;
    if ((rc = kvt_segs_write(st->segs, st->seg_cur, st->seg_end, p, len))) {
        if (kvt_segs_took_full(st->segs)) st->full = true;
        return rc;
    }
    *w = (bloc){st->seg_cur, st->seg_end, len};
    st->seg_end += len;
    return KVT_OK;
}

/* The record of a snapshot row whose data, rseg, roff and bytes columns
 * are cd, cd + 1, cd + 2 and cb: in its segment (read into *buf, of *cap
 * bytes) or in its data. */
static int row_record(kvt_store *st, sqlite3_stmt *r, int cd, int cb, uint8_t **buf, size_t *cap, const uint8_t **p,
                      size_t *len)
{
    bloc w;
    if (!row_bloc(r, cd + 1, cd + 2, cb, &w)) {
        if (sqlite3_column_type(r, cd + 1) != SQLITE_NULL)
            return kvt_fail(KVT_EFORMAT, "snapshot: its row's place or size is out of range");
        w.seg = 0;
    }
    *p = sqlite3_column_blob(r, cd);
    *len = (size_t)sqlite3_column_bytes(r, cd);
    if (!w.seg) return KVT_OK;
    if (*len) return kvt_fail(KVT_EFORMAT, "snapshot: a segment's record with bytes in its row too");
    int rc = read_bloc_into(st, &w, NULL, buf, cap);
    if (rc) return rc;
    *p = *buf;
    *len = (size_t)w.bytes;
    return KVT_OK;
}

/* A snapshot row (SNAP_COLS from column c0 on) against its record p (len
 * bytes): the record's own checks, and the columns that lookups and the
 * budget read agree with it (a valid record of another snapshot at the
 * row's place is refused). */
static int snap_row_agrees(sqlite3_stmt *r, int c0, const uint8_t *p, size_t len, kvt_snap_info *in)
{
    if (!p) return kvt_fail(KVT_EFORMAT, "snapshot: empty record");
    int rc = kvt_snap_parse_raw(p, len, in);
    if (rc) return rc;
    size_t tail_n = in->n - (size_t)in->nb * KVT_BLOCK;
    int32_t ids[KVT_BLOCK];
    if (tail_n >= KVT_BLOCK || in->sec_len[1] != 4 * tail_n)
        return kvt_fail(KVT_EFORMAT, "snapshot: %zu bytes of tail ids for %zu tokens", in->sec_len[1], tail_n);
    memcpy(ids, in->sec[1], 4 * tail_n); /* u32 LE: the host's order (FORMAT.md) */
    if ((uint64_t)sqlite3_column_int64(r, c0) != in->model || (uint64_t)sqlite3_column_int64(r, c0 + 1) != in->head ||
        sqlite3_column_int64(r, c0 + 2) != (int64_t)in->n || sqlite3_column_int64(r, c0 + 4) != (int64_t)in->nb ||
        (uint64_t)sqlite3_column_int64(r, c0 + 3) != kvt_snap_tail_hash(in->head, ids, tail_n) ||
        (sqlite3_column_int64(r, c0 + 5) != 0) != ((in->flags & KVT_SNAP_REPLAY) != 0) ||
        sqlite3_column_int64(r, c0 + 6) != (int64_t)len)
        return kvt_fail(KVT_EFORMAT, "snapshot: its row disagrees with its record");
    return KVT_OK;
}

/* The same with the record read from the row's place into *buf. */
static int check_snap_row(kvt_store *st, sqlite3_stmt *r, int c0, kvt_snap_info *in, uint8_t **buf, size_t *cap)
{
    const uint8_t *p;
    size_t len;
    int rc = row_record(st, r, c0 + 7, c0 + 6, buf, cap, &p, &len);
    return rc ? rc : snap_row_agrees(r, c0, p, len, in);
}

/* The columns check_snap_row reads (from a store of schema 1 opened to
 * inspect: no places, every record in its row). */
#define SNAP_COLS "model, head, n_tokens, tail, n_blocks, replay, bytes, data, rseg, roff"
#define SNAP_COLS1 "model, head, n_tokens, tail, n_blocks, replay, bytes, data, NULL, NULL"

/* The query of a block's row that check_block_row reads. */
static const char *block_row_sql(const kvt_store *st)
{
    return st->has_segs ? "SELECT bytes, data, seg, off FROM blocks WHERE key = ?"
                        : "SELECT bytes, data, NULL, NULL FROM blocks WHERE key = ?";
}

/* A block row (bytes, data, seg, off from c0) stored under key: its record,
 * in its segment (read into *buf, of *cap bytes) or in its data. */
static int check_block_row(kvt_store *st, sqlite3_stmt *r, int c0, uint64_t key, uint8_t **buf, size_t *cap)
{
    const uint8_t *p = sqlite3_column_blob(r, c0 + 1);
    size_t len = (size_t)sqlite3_column_bytes(r, c0 + 1);
    bloc w;
    if (!row_bloc(r, c0 + 2, c0 + 3, c0, &w)) return kvt_fail(KVT_EFORMAT, "block: its row's place or size is out of range");
    if (w.seg) {
        if (len) return kvt_fail(KVT_EFORMAT, "block: a segment's block with bytes in its row too");
        int rc = read_bloc_into(st, &w, NULL, buf, cap);
        if (rc) return rc;
        p = *buf;
        len = (size_t)w.bytes;
    }
    uint64_t k;
    if (!p) return kvt_fail(KVT_EFORMAT, "block: empty record");
    int rc = kvt_snap_block_check(p, len, &k);
    if (rc) return rc;
    if (k != key) return kvt_fail(KVT_EMISMATCH, "block stored under another key");
    if (sqlite3_column_int64(r, c0) != (int64_t)len) return kvt_fail(KVT_EFORMAT, "block: its row disagrees with its record");
    return KVT_OK;
}

/* Bind each column of row (from c0, n of them) to parameters from 1 on. */
static void bind_row(sqlite3_stmt *dst, sqlite3_stmt *row, int c0, int n)
{
    for (int i = 0; i < n; i++) sqlite3_bind_value(dst, i + 1, sqlite3_column_value(row, c0 + i));
}

static bool nd_ok(sqlite3 *nd, int rc, int *err)
{
    if (rc == SQLITE_OK || rc == SQLITE_ROW || rc == SQLITE_DONE) return true;
    if (!*err) {
        *err = rc;
        kvt_fail(KVT_EIO, "cache store: rebuild: %s", (rc & 0xff) == SQLITE_FULL ? "disk full" : sqlite3_errmsg(nd));
    }
    return false;
}

/* Copy what still reads and checks out of the damaged database (st->db)
 * into the new one, nd (inside a transaction): every snapshot whose row,
 * record and blocks pass their checks, with its id and uses, and the
 * counters. A read of the damaged database that fails loses what it would
 * have read, nothing else. *seen receives the snapshots it listed, *kept
 * those copied. Fails only when writing nd fails. */
static int salvage(kvt_store *st, sqlite3 *nd, size_t *kept, size_t *seen)
{
    idset ids = {0};
    snap_ids(st, &ids, false);
    st->sql_rc = 0;
    for (size_t i = 0; i < st->n_idx; i++) idset_add(&ids, st->idx[i].id);
    idset_seal(&ids);
    static const char *const nd_sql[5] = {
        "SELECT 1 FROM blocks WHERE key = ?",
        "INSERT INTO blocks(key, refs, bytes, data, seg, off) VALUES(?, 0, ?, ?, ?, ?)",
        "INSERT OR IGNORE INTO snaps(id, " SNAP_COLS ", reason, created, last_used, used_at, hits, preview, locs)"
        " VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        "INSERT INTO snap_blocks(snap, idx, key) VALUES(?, ?, ?)",
        "UPDATE blocks SET refs = refs + 1 WHERE key = ?",
    };
    sqlite3_stmt *w[5] = {0}, *get = NULL, *getb = NULL;
    int err = 0;
    for (int k = 0; k < 5 && !err; k++) nd_ok(nd, sqlite3_prepare_v2(nd, nd_sql[k], -1, &w[k], NULL), &err);
    /* reads of the damaged database: their failures are expected */
    sqlite3_prepare_v2(st->db, st->has_segs ?
                       "SELECT id, " SNAP_COLS ", COALESCE(reason, 'manual'), COALESCE(created, 0),"
                       " COALESCE(last_used, 0), COALESCE(used_at, 0), COALESCE(hits, 0), COALESCE(preview, ''), locs"
                       " FROM snaps WHERE id = ?" :
                       "SELECT id, " SNAP_COLS1 ", COALESCE(reason, 'manual'), COALESCE(created, 0),"
                       " COALESCE(last_used, 0), COALESCE(used_at, 0), COALESCE(hits, 0), COALESCE(preview, ''), NULL"
                       " FROM snaps WHERE id = ?", -1, &get, NULL);
    sqlite3_prepare_v2(st->db, block_row_sql(st), -1, &getb, NULL);
    uint8_t *scratch = NULL, *rscratch = NULL;
    size_t scratch_cap = 0, rscratch_cap = 0;
    int64_t max_used = 0;
    for (size_t i = 0; i < ids.n && !err && get && getb; i++) {
        sqlite3_reset(get);
        sqlite3_bind_int64(get, 1, ids.v[i]);
        int r = sqlite3_step(get);
        if (r == SQLITE_DONE) continue; /* named by the index only: a row that is gone */
        (*seen)++;
        kvt_snap_info in;
        if (r != SQLITE_ROW || check_snap_row(st, get, 1, &in, &rscratch, &rscratch_cap) != KVT_OK) continue;
        bool whole = true;
        for (uint32_t b = 0; b < in.nb && whole && !err; b++) {
            int64_t key = (int64_t)kvt_rd64(in.sec[6] + 8 * (size_t)b);
            sqlite3_reset(w[0]);
            sqlite3_bind_int64(w[0], 1, key);
            int h = sqlite3_step(w[0]);
            if (!nd_ok(nd, h, &err) || h == SQLITE_ROW) continue;
            sqlite3_reset(getb);
            sqlite3_bind_int64(getb, 1, key);
            if (sqlite3_step(getb) != SQLITE_ROW ||
                check_block_row(st, getb, 0, (uint64_t)key, &scratch, &scratch_cap) != KVT_OK) {
                whole = false;
                break;
            }
            sqlite3_reset(w[1]);
            sqlite3_bind_int64(w[1], 1, key);
            for (int c = 0; c < 4; c++) sqlite3_bind_value(w[1], 2 + c, sqlite3_column_value(getb, c));
            nd_ok(nd, sqlite3_step(w[1]), &err);
        }
        if (!whole || err) continue;
        sqlite3_reset(w[2]);
        bind_row(w[2], get, 0, 18);
        if (!nd_ok(nd, sqlite3_step(w[2]), &err)) break;
        /* a damaged index can let the same prefix in twice: the first stays */
        if (sqlite3_changes(nd) != 1) continue;
        for (uint32_t b = 0; b < in.nb && !err; b++) {
            int64_t key = (int64_t)kvt_rd64(in.sec[6] + 8 * (size_t)b);
            sqlite3_reset(w[3]);
            sqlite3_bind_int64(w[3], 1, ids.v[i]);
            sqlite3_bind_int64(w[3], 2, b);
            sqlite3_bind_int64(w[3], 3, key);
            sqlite3_reset(w[4]);
            sqlite3_bind_int64(w[4], 1, key);
            if (nd_ok(nd, sqlite3_step(w[3]), &err)) nd_ok(nd, sqlite3_step(w[4]), &err);
        }
        int64_t used = sqlite3_column_int64(get, 13);
        if (used > max_used) max_used = used;
        (*kept)++;
    }
    free(scratch);
    free(rscratch);
    sqlite3_finalize(get);
    sqlite3_finalize(getb);
    for (int k = 0; k < 5; k++) sqlite3_finalize(w[k]);
    free(ids.v);
    if (err) return KVT_EIO;
    /* the blocks of snapshots that were not whole; then the clock, the id
     * sequence (ids are never reused) and the counters, where they read */
    nd_ok(nd, sqlite3_exec(nd, "DELETE FROM blocks WHERE refs = 0", NULL, NULL, NULL), &err);
    int64_t old_tick = 0, old_seq = 0;
    sqlite3_stmt *r = NULL, *put = NULL;
    if (sqlite3_prepare_v2(st->db, "SELECT v FROM meta WHERE k = 'tick'", -1, &r, NULL) == SQLITE_OK &&
        sqlite3_step(r) == SQLITE_ROW)
        old_tick = sqlite3_column_int64(r, 0);
    sqlite3_finalize(r);
    r = NULL;
    if (sqlite3_prepare_v2(st->db, "SELECT seq FROM sqlite_sequence WHERE name = 'snaps'", -1, &r, NULL) == SQLITE_OK &&
        sqlite3_step(r) == SQLITE_ROW)
        old_seq = sqlite3_column_int64(r, 0);
    sqlite3_finalize(r);
    r = NULL;
    /* the current segment: past every segment there is, so that the new
     * database appends where no record of the old one can be */
    int64_t seg = 1;
    if (sqlite3_prepare_v2(st->db, "SELECT v FROM meta WHERE k = 'seg'", -1, &r, NULL) == SQLITE_OK &&
        sqlite3_step(r) == SQLITE_ROW && sqlite3_column_int64(r, 0) > 0 && sqlite3_column_int64(r, 0) < UINT32_MAX)
        seg = sqlite3_column_int64(r, 0);
    sqlite3_finalize(r);
    r = NULL;
    DIR *d = opendir(st->dir);
    for (struct dirent *e; d && (e = readdir(d));) {
        unsigned n;
        char tail;
        if (sscanf(e->d_name, "kvtier.db-seg%u%c", &n, &tail) == 1 && n < UINT32_MAX && (int64_t)n + 1 > seg) seg = (int64_t)n + 1;
    }
    if (d) closedir(d);
    if (!err && nd_ok(nd, sqlite3_prepare_v2(nd, "UPDATE meta SET v = ? WHERE k = 'seg'", -1, &put, NULL), &err)) {
        sqlite3_bind_int64(put, 1, seg);
        nd_ok(nd, sqlite3_step(put), &err);
    }
    sqlite3_finalize(put);
    put = NULL;
    if (!err && nd_ok(nd, sqlite3_prepare_v2(nd, "UPDATE meta SET v = MAX(?, ?) WHERE k = 'tick'", -1, &put, NULL), &err)) {
        sqlite3_bind_int64(put, 1, old_tick);
        sqlite3_bind_int64(put, 2, max_used);
        nd_ok(nd, sqlite3_step(put), &err);
    }
    sqlite3_finalize(put);
    put = NULL;
    if (!err && nd_ok(nd, sqlite3_prepare_v2(nd, "INSERT INTO sqlite_sequence(name, seq) SELECT 'snaps', 0"
                                             " WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'snaps')",
                                             -1, &put, NULL), &err))
        nd_ok(nd, sqlite3_step(put), &err);
    sqlite3_finalize(put);
    put = NULL;
    if (!err && nd_ok(nd, sqlite3_prepare_v2(nd, "UPDATE sqlite_sequence SET seq = MAX(seq, ?) WHERE name = 'snaps'",
                                             -1, &put, NULL), &err)) {
        sqlite3_bind_int64(put, 1, old_seq);
        nd_ok(nd, sqlite3_step(put), &err);
    }
    sqlite3_finalize(put);
    put = NULL;
    if (!err && sqlite3_prepare_v2(st->db, "SELECT name, value FROM counters WHERE typeof(name) = 'text'"
                                   " AND typeof(value) = 'integer'", -1, &r, NULL) == SQLITE_OK &&
        nd_ok(nd, sqlite3_prepare_v2(nd, "INSERT OR REPLACE INTO counters(name, value) VALUES(?, ?)", -1, &put, NULL),
              &err)) {
        while (!err && sqlite3_step(r) == SQLITE_ROW) {
            sqlite3_reset(put);
            bind_row(put, r, 0, 2);
            nd_ok(nd, sqlite3_step(put), &err);
        }
    }
    sqlite3_finalize(r);
    sqlite3_finalize(put);
    return err ? KVT_EIO : KVT_OK;
}

static void path_plus(char *out, size_t cap, const char *path, const char *suffix)
{
    snprintf(out, cap, "%s%s", path, suffix);
}

/* SQLite reported the database damaged: build a new database from what
 * still reads and checks out (salvage), move the damaged file aside as
 * DIR/kvtier.db.damaged-<time> (with its WAL), put the new one in its place
 * and go on with it. One rebuild at a time per directory (a lock file);
 * a process that finds the file replaced already follows it instead. */
static int recover(kvt_store *st)
{
    char why[400];
    snprintf(why, sizeof why, "%s", st->sql_msg[0] ? st->sql_msg : "damaged");
    st->corrupt = false;
    st->sql_rc = 0;
    rollback(st);
    st->sql_rc = 0;
    size_t plen = strlen(st->path) + 64;
    char *nm[5];
    for (int k = 0; k < 5; k++) nm[k] = kvt_malloc(plen);
    if (!nm[0] || !nm[1] || !nm[2] || !nm[3] || !nm[4]) {
        for (int k = 0; k < 5; k++) free(nm[k]);
        return KVT_ENOMEM;
    }
    char *lock = nm[0], *tmp = nm[1], *aside = nm[2], *a = nm[3], *b = nm[4];
    path_plus(lock, plen, st->path, ".lock");
    int lfd = open(lock, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (lfd >= 0) flock(lfd, LOCK_EX);
    int rc;
    if (st->db && !same_file(st)) { /* rebuilt by another process meanwhile */
        close_db(st, true);
        rc = open_db(st);
        goto out;
    }
    snprintf(tmp, plen, "%s.rebuild-%d", st->path, (int)getpid());
    long long now = (long long)time(NULL);
    snprintf(aside, plen, "%s.damaged-%lld", st->path, now);
    for (int k = 2; access(aside, F_OK) == 0 && k < 1000; k++) snprintf(aside, plen, "%s.damaged-%lld.%d", st->path, now, k);
    unlink(tmp);
    path_plus(a, plen, tmp, "-journal");
    unlink(a);
    size_t kept = 0, seen = 0;
    bool built = false;
    sqlite3 *nd = NULL;
    if (kvt_storedir_file(tmp) == KVT_OK &&
        sqlite3_open_v2(tmp, &nd, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX | SQLITE_OPEN_NOFOLLOW, NULL) == SQLITE_OK &&
        sqlite3_exec(nd, "PRAGMA synchronous=FULL; BEGIN IMMEDIATE", NULL, NULL, NULL) == SQLITE_OK &&
        sqlite3_exec(nd, schema, NULL, NULL, NULL) == SQLITE_OK &&
        sqlite3_exec(nd, schema_totals, NULL, NULL, NULL) == SQLITE_OK &&
        sqlite3_exec(nd, schema_segs, NULL, NULL, NULL) == SQLITE_OK &&
        (!st->db || salvage(st, nd, &kept, &seen) == KVT_OK)) {
        sqlite3_stmt *ins = NULL;
        int err = 0;
        if (nd_ok(nd, sqlite3_prepare_v2(nd, "INSERT INTO counters(name, value) VALUES('damaged', ?1)"
                                         " ON CONFLICT(name) DO UPDATE SET value = value + ?1", -1, &ins, NULL), &err)) {
            sqlite3_bind_int64(ins, 1, (int64_t)(seen - kept));
            nd_ok(nd, sqlite3_step(ins), &err);
        }
        sqlite3_finalize(ins);
        ins = NULL;
        if (!err && nd_ok(nd, sqlite3_prepare_v2(nd, "INSERT INTO quarantine(what, reason, at) VALUES('database', ?, ?)",
                                                 -1, &ins, NULL), &err)) {
            char reason[1200];
            snprintf(reason, sizeof reason, "%s; moved to %s, %zu of %zu snapshots kept", why, aside, kept, seen);
            sqlite3_bind_text(ins, 1, reason, -1, SQLITE_TRANSIENT);
            sqlite3_bind_double(ins, 2, now_unix());
            nd_ok(nd, sqlite3_step(ins), &err);
        }
        sqlite3_finalize(ins);
        built = !err && sqlite3_exec(nd, "COMMIT", NULL, NULL, NULL) == SQLITE_OK;
    }
    sqlite3_close(nd);
    if (!built) { /* no room for a copy: start empty; the damaged file keeps everything */
        unlink(tmp);
        unlink(a);
        kept = 0;
    }
    /* Close before the renames: the last connection out deletes the WAL and
     * shared memory by name, which must still be the damaged database's. */
    bool ours = !st->db || same_file(st);
    close_db(st, false);
    if (ours) {
        if (rename(st->path, aside) != 0 && errno != ENOENT) {
            rc = kvt_fail(KVT_EIO, "cache store: cannot move %s aside: %s", st->path, strerror(errno));
            unlink(tmp);
            goto out;
        }
        path_plus(a, plen, st->path, "-wal");
        path_plus(b, plen, aside, "-wal");
        rename(a, b);
        path_plus(a, plen, st->path, "-shm"); /* rebuilt from the WAL by whoever opens it */
        unlink(a);
        if (built && rename(tmp, st->path) != 0) unlink(tmp);
        int dfd = open(st->dir, O_RDONLY | O_CLOEXEC);
        if (dfd >= 0) {
            fsync(dfd);
            close(dfd);
        }
        if (!st->quiet)
            fprintf(stderr, "kvtier: cache store %s is damaged (%s); moved to %s, %zu of %zu snapshots kept\n",
                    st->path, why, aside, kept, seen);
    } else {
        unlink(tmp);
    }
    st->corrupt = false; /* what the reads of the damaged file met is behind us */
    st->sql_rc = 0;
    rc = open_db(st);
out:
    if (lfd >= 0) {
        flock(lfd, LOCK_UN);
        close(lfd);
    }
    for (int k = 0; k < 5; k++) free(nm[k]);
    st->dirty = true;
    st->data_version = -1;
    return rc;
}

/* After a step of an operation failed: when SQLite found the database
 * damaged, rebuild it; true when the caller should run the step again. */
static bool rebuilt(kvt_store *st)
{
    if (!st->corrupt || st->inspect) return false;
    return recover(st) == KVT_OK;
}

static bool fs_room(const kvt_store *st, uint64_t *avail, uint64_t *reserve);
static uint64_t wal_headroom(const kvt_store *st);
static int64_t drop_snap(kvt_store *st, int64_t id);

/* The database could not be opened and the file system lacks room:
 * SQLite needs some (its shared memory, its WAL) before anything can be
 * evicted the usual way. Read, with a read-only connection, which least
 * recently used snapshots give back enough, punch their records and the
 * blocks only they use out of the segments, and leave their ids in
 * *victims for the rows to go once the database opens (drop_victims).
 * A process that loads one of them meanwhile finds a hole, which is a
 * miss. KVT_OK when something was given back. */
static int room_before_open(kvt_store *st, idset *victims)
{
    uint64_t avail = 0, reserve = 0;
    if (!fs_room(st, &avail, &reserve)) return KVT_EIO;
    uint64_t want = reserve + wal_headroom(st) + ROOM_SLACK;
    if (avail >= want) return KVT_EIO; /* room is not what failed */
    uint64_t deficit = want - avail, freed = 0;
    close_db(st, false);
    st->inspect = true;
    op_start(st, "open");
    int rc = open_db(st);
    st->inspect = false;
    bloc *put = NULL;
    size_t n_put = 0, cap_put = 0;
    typedef struct { int64_t key, left; } bref;
    bref *refs = NULL;
    size_t n_refs = 0, cap_refs = 0;
    sqlite3_stmt *lru = rc || !st->has_segs ? NULL : prep(st, "SELECT id, rseg, roff, bytes FROM snaps ORDER BY last_used, id", NULL);
    sqlite3_stmt *blk = lru ? prep(st, "SELECT b.key, b.refs, b.seg, b.off, b.bytes FROM snap_blocks sb JOIN blocks b"
                                       " ON b.key = sb.key WHERE sb.snap = ?", NULL) : NULL;
    while (blk && freed < deficit && step(st, lru, NULL) == SQLITE_ROW) {
        int64_t id = sqlite3_column_int64(lru, 0);
        bloc w;
        int grc = 0;
        KVT_GROW(put, &cap_put, n_put + 1, grc);
        if (grc) break;
        if (row_bloc(lru, 1, 2, 3, &w) && w.seg) { put[n_put++] = w; freed += w.bytes; }
        sqlite3_reset(blk);
        sqlite3_bind_int64(blk, 1, id);
        while (step(st, blk, NULL) == SQLITE_ROW) {
            int64_t key = sqlite3_column_int64(blk, 0);
            size_t k = 0;
            while (k < n_refs && refs[k].key != key) k++;
            if (k == n_refs) {
                KVT_GROW(refs, &cap_refs, n_refs + 1, grc);
                if (grc) break;
                refs[n_refs++] = (bref){key, sqlite3_column_int64(blk, 1)};
            }
            if (--refs[k].left != 0 || !row_bloc(blk, 2, 3, 4, &w) || !w.seg) continue;
            KVT_GROW(put, &cap_put, n_put + 1, grc);
            if (grc) break;
            put[n_put++] = w;
            freed += w.bytes;
        }
        idset_add(victims, id);
    }
    sqlite3_finalize(blk);
    sqlite3_finalize(lru);
    close_db(st, true);
    coalesce(put, &n_put);
    for (size_t i = 0; i < n_put; i++) kvt_segs_release(st->segs, put[i].seg, put[i].off, put[i].bytes);
    kvt_segs_close_all(st->segs);
    free(put);
    free(refs);
    st->sql_rc = 0;
    st->corrupt = false;
    return victims->n && !victims->oom ? KVT_OK : KVT_EIO;
}

/* The rows of the snapshots room_before_open gave back go (their places
 * are punched out already). */
static void drop_victims(kvt_store *st, const idset *victims)
{
    op_start(st, "open");
    if (begin(st)) return;
    uint64_t evicted = 0;
    for (size_t i = 0; i < victims->n && !st->sql_rc; i++)
        if (q_int(st, "SELECT COUNT(*) FROM snaps WHERE id = ?", 1, &victims->v[i], 0) == 1) {
            drop_snap(st, victims->v[i]);
            evicted++;
        }
    counter_add(st, "evictions", evicted);
    commit(st);
    st->sql_rc = 0;
}

static int store_open(kvt_store **out, const char *dir, uint64_t budget, bool inspect)
{
    *out = NULL;
    int rc = inspect ? KVT_OK : kvt_storedir_prepare(dir);
    if (rc) return rc;
    kvt_store *st = kvt_calloc(1, sizeof *st);
    if (!st) return KVT_ENOMEM;
    pthread_mutex_init(&st->mu, NULL);
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
    op_start(st, "open");
    if (inspect && access(st->path, F_OK) != 0) {
        rc = kvt_fail(KVT_ENOENT, "no cache store in %s", dir);
    } else {
        rc = open_db(st);
        idset victims = {0};
        if (rc && !inspect && !st->corrupt && room_before_open(st, &victims) == KVT_OK) {
            if (!st->quiet)
                fprintf(stderr, "kvtier: cache store %s: the file system is full; %zu least recently used snapshots "
                                "evicted to open it\n", dir, victims.n);
            op_start(st, "open");
            if (!(rc = open_db(st))) drop_victims(st, &victims);
        }
        free(victims.v);
        if (rc && rebuilt(st)) rc = KVT_OK;
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
    op_start(st, "close");
    if (st->db && !st->inspect && (st->lookups || st->hits || st->misses || st->save_errors) &&
        begin(st) == KVT_OK) {
        flush_counters(st);
        commit(st);
    }
    /* leave no large WAL behind: the last connection out deletes it, but
     * one that another process keeps would otherwise stay at its largest
     * size (no waiting here for readers: busy, it stays) */
    if (st->db && !st->inspect && same_file(st)) {
        sqlite3_busy_timeout(st->db, 0);
        sqlite3_wal_checkpoint_v2(st->db, NULL, SQLITE_CHECKPOINT_TRUNCATE, NULL, NULL);
    }
    close_db(st, st->db && !st->inspect && !same_file(st));
    kvt_segs_free(st->segs);
    free(st->idx);
    free(st->gone);
    free(st->freed);
    free(st->dir);
    free(st->path);
    pthread_mutex_destroy(&st->mu);
    free(st);
}

void kvt_store_set_quiet(kvt_store *st, bool quiet) { st->quiet = quiet; }

static int store_limit_pages(kvt_store *st, uint32_t pages)
{
    char sql[64];
    kvt_segs_cap(st->segs, (uint64_t)pages * 4096);
    snprintf(sql, sizeof sql, "PRAGMA max_page_count = %u", pages);
    return exec(st, sql);
}

/* ---- the index ---- */

static int cmp_ientry(const void *a, const void *b)
{
    const ientry *x = a, *y = b;
    if (x->head != y->head) return x->head < y->head ? -1 : 1;
    return (x->n > y->n) - (x->n < y->n);
}

static void index_remove(kvt_store *st, int64_t id)
{
    for (size_t i = 0; i < st->n_idx; i++)
        if (st->idx[i].id == id) {
            memmove(&st->idx[i], &st->idx[i + 1], (st->n_idx - i - 1) * sizeof *st->idx);
            st->n_idx--;
            return;
        }
}

/* A snapshot this process committed joins the index in place: a save costs
 * the next lookup no rebuild. */
static void index_add(kvt_store *st, ientry e)
{
    if (st->dirty) return; /* rebuilt before the next lookup anyway */
    int rc;
    KVT_GROW(st->idx, &st->cap_idx, st->n_idx + 1, rc);
    if (rc) { st->dirty = true; return; }
    size_t lo = 0, hi = st->n_idx; /* after the entries that sort before it or equal */
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cmp_ientry(&st->idx[mid], &e) <= 0) lo = mid + 1;
        else hi = mid;
    }
    memmove(&st->idx[lo + 1], &st->idx[lo], (st->n_idx - lo) * sizeof *st->idx);
    st->idx[lo] = e;
    st->n_idx++;
}

/* The running totals (schema_totals), or, in a store opened to inspect that
 * predates them, the same added up. */
typedef struct totals { int64_t bytes, snaps, blocks, refs; } totals;

static const char *totals_sum =
    "SELECT (SELECT COALESCE(SUM(bytes), 0) FROM snaps) + (SELECT COALESCE(SUM(bytes), 0) FROM blocks),"
    " (SELECT COUNT(*) FROM snaps), (SELECT COUNT(*) FROM blocks), (SELECT COUNT(*) FROM snap_blocks)";

static bool read_totals(kvt_store *st, const char *sql, totals *t)
{
    memset(t, 0, sizeof *t);
    sqlite3_stmt *stmt = NULL;
    if (q(st, &stmt, sql, 0, NULL) != SQLITE_ROW) return false;
    *t = (totals){sqlite3_column_int64(stmt, 0), sqlite3_column_int64(stmt, 1), sqlite3_column_int64(stmt, 2),
                  sqlite3_column_int64(stmt, 3)};
    sqlite3_finalize(stmt);
    return true;
}

static bool has_totals(kvt_store *st)
{
    return q_int(st, "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'totals'", 0, NULL, 0) == 1;
}

static void get_totals(kvt_store *st, totals *t)
{
    if (st->inspect && !st->sql_rc && !has_totals(st)) read_totals(st, totals_sum, t);
    else read_totals(st, "SELECT bytes, snaps, blocks, refs FROM totals", t);
}

/* Set the totals to what the tables add up to (inside a write transaction);
 * true when they differed. Only damage makes them differ: a damaged row's
 * size read back as another number when it is removed. gc and the removal
 * of a damaged entry (quarantine) call this; *was and *now (may be NULL)
 * receive both. */
static bool resync_totals(kvt_store *st, totals *was, totals *now)
{
    totals a, b;
    read_totals(st, "SELECT bytes, snaps, blocks, refs FROM totals", &a);
    if (!read_totals(st, totals_sum, &b)) return false;
    if (was) *was = a;
    if (now) *now = b;
    if (!memcmp(&a, &b, sizeof a)) return false;
    q(st, NULL, "DELETE FROM totals", 0, NULL);
    int64_t v[4] = {b.bytes, b.snaps, b.blocks, b.refs};
    q(st, NULL, "INSERT INTO totals(one, bytes, snaps, blocks, refs) VALUES(1, ?, ?, ?, ?)", 4, v);
    return true;
}

static uint64_t total_bytes(kvt_store *st)
{
    totals t;
    get_totals(st, &t);
    return t.bytes > 0 ? (uint64_t)t.bytes : 0;
}

/* ---- removal and eviction (inside a write transaction) ---- */

/* Remove a snapshot and the blocks only it referenced; returns bytes freed. */
static int64_t drop_snap(kvt_store *st, int64_t id)
{
    int64_t before = (int64_t)total_bytes(st);
    /* only its own blocks can reach no references: no scan of the table */
    q(st, NULL, "UPDATE blocks SET refs = refs - 1 WHERE key IN (SELECT key FROM snap_blocks WHERE snap = ?)", 1, &id);
    delete_placed(st, "DELETE FROM blocks WHERE key IN (SELECT key FROM snap_blocks WHERE snap = ?) AND refs <= 0"
                      " RETURNING seg, off, bytes", 1, &id);
    q(st, NULL, "DELETE FROM snap_blocks WHERE snap = ?", 1, &id);
    delete_placed(st, "DELETE FROM snaps WHERE id = ? RETURNING rseg, roff, bytes", 1, &id);
    int64_t after = (int64_t)total_bytes(st);
    int rc; /* it leaves the index when the transaction commits */
    KVT_GROW(st->gone, &st->cap_gone, st->n_gone + 1, rc);
    if (!rc) st->gone[st->n_gone++] = id;
    else st->dirty = true;
    return before - after;
}

static void enforce_budget(kvt_store *st, int64_t keep)
{
    uint64_t total = total_bytes(st), evicted = 0;
    while (total > st->budget && !st->sql_rc) {
        int64_t victim = q_int(st, "SELECT id FROM snaps WHERE id != ? ORDER BY last_used ASC, id ASC LIMIT 1",
                               1, &keep, -1);
        if (victim < 0) break;
        int64_t freed = drop_snap(st, victim);
        total = (uint64_t)freed > total ? 0 : total - (uint64_t)freed;
        evicted++;
    }
    counter_add(st, "evictions", evicted);
}

/* ---- free space on the file system ----
 *
 * The budget bounds the bytes of records; the file system may be smaller,
 * or shared. Before a save writes, the store checks that the file system
 * keeps min_free bytes besides what the save will write, and evicts least
 * recently used snapshots until it does, each round in a transaction of
 * its own: their segment ranges are given back when it commits (punched
 * out), so the room is there before the save appends. SQLite needs room
 * too (its WAL grows with every commit), which the reserve leaves it. */

bool kvt_store_room_fault;
double kvt_store_report_every = 60;

/* Free bytes for this user and the bytes to keep free; false when the file
 * system cannot tell. */
static bool fs_room(const kvt_store *st, uint64_t *avail, uint64_t *reserve)
{
    struct statvfs v;
    if (statvfs(st->dir, &v) != 0 || !v.f_frsize) return false;
    *avail = (uint64_t)v.f_bavail * v.f_frsize;
    if (st->min_free != KVT_STORE_MIN_FREE_DEFAULT) {
        *reserve = st->min_free;
    } else {
        *reserve = (uint64_t)v.f_blocks * v.f_frsize / 20;
        if (*reserve > MIN_FREE_CAP) *reserve = MIN_FREE_CAP;
    }
    return true;
}

/* What the WAL may still grow by before its next checkpoint. */
static uint64_t wal_headroom(const kvt_store *st)
{
    char wal[4200];
    snprintf(wal, sizeof wal, "%s-wal", st->path);
    struct stat sb;
    uint64_t most = (WAL_PAGES + 16) * 4096ull, now = stat(wal, &sb) == 0 ? (uint64_t)sb.st_size : 0;
    return now < most ? most - now : 0;
}

/* Make room for a write of need bytes: evict least recently used
 * snapshots (never keep) until the file system has need bytes besides its
 * reserve; force: evict at least need bytes whatever it says (a write met
 * a full disk). KVT_EIO ("disk full") when nothing is left to evict. */
static int make_room(kvt_store *st, uint64_t need, int64_t keep, bool force)
{
    for (int round = 0; round < 16 && !kvt_store_room_fault; round++) {
        uint64_t avail = 0, reserve = 0;
        bool known = fs_room(st, &avail, &reserve);
        if (!force && (!known || avail >= reserve + need)) return KVT_OK;
        uint64_t want = known && reserve + need > avail ? reserve + need - avail : 0;
        if (force && want < need) want = need;
        force = false;
        int rc = begin(st);
        if (rc) return rc;
        uint64_t freed = 0, evicted = 0;
        while (freed < want && !st->sql_rc) {
            int64_t victim = q_int(st, "SELECT id FROM snaps WHERE id != ? ORDER BY last_used ASC, id ASC LIMIT 1",
                                   1, &keep, -1);
            if (victim < 0) break;
            int64_t f = drop_snap(st, victim);
            freed += f > 0 ? (uint64_t)f : 0;
            evicted++;
        }
        counter_add(st, "evictions", evicted);
        if ((rc = commit(st))) return rc;
        if (!evicted)
            return kvt_fail(KVT_EIO, "cache store: disk full: %llu KiB free on the file system of %s, %llu KiB to keep "
                            "free (--kv-disk-min-free-mb) and %llu KiB to write, nothing left to evict",
                            (unsigned long long)(avail >> 10), st->dir, (unsigned long long)(reserve >> 10),
                            (unsigned long long)(need >> 10));
    }
    return KVT_OK;
}

void kvt_store_set_min_free(kvt_store *st, uint64_t bytes) { st->min_free = bytes; }

void kvt_store_report_save_failure(kvt_store *st, const char *what)
{
    double now = kvt_now();
    if (st->fail_logged > 0 && now - st->fail_logged < kvt_store_report_every) {
        st->fail_quiet++;
        return;
    }
    if (st->fail_quiet)
        fprintf(stderr, "kvtier: cache: %s failed: %s (and %llu more save failures in the last %.0f s, not shown)\n",
                what, kvt_errmsg(), (unsigned long long)st->fail_quiet, now - st->fail_logged);
    else
        fprintf(stderr, "kvtier: cache: %s failed: %s\n", what, kvt_errmsg());
    st->fail_logged = now;
    st->fail_quiet = 0;
}

/* ---- save ---- */

/* Put a snapshot's record, which replaces the one it had (inside a write
 * transaction): appended to the segment, its row moved to it, the old
 * place released when the transaction commits. */
static void replace_record(kvt_store *st, int64_t id, const uint8_t *p, size_t len, const char *set_sql)
{
    sqlite3_stmt *old = NULL;
    bloc was = {0}, w;
    if (q(st, &old, "SELECT rseg, roff, bytes FROM snaps WHERE id = ?", 1, &id) == SQLITE_ROW && row_bloc(old, 0, 1, 2, &was) &&
        was.seg) {
        int rc; /* a place not recorded stays allocated until gc */
        KVT_GROW(st->freed, &st->cap_freed, st->n_freed + 1, rc);
        if (!rc) st->freed[st->n_freed++] = was;
    }
    sqlite3_finalize(old);
    if (st->sql_rc) return;
    if (seg_append(st, p, len, &w)) {
        sql_note(st, SQLITE_IOERR, "save snapshot"); /* ends the transaction: it rolls back */
        snprintf(st->sql_msg, sizeof st->sql_msg, "%s", kvt_errmsg());
        return;
    }
    sqlite3_stmt *put = prep(st, set_sql, "save snapshot");
    if (put) {
        sqlite3_bind_int64(put, 1, (int64_t)len);
        sqlite3_bind_int64(put, 2, w.seg);
        sqlite3_bind_int64(put, 3, (int64_t)w.off);
        sqlite3_bind_int64(put, 4, id);
        step(st, put, "save snapshot");
    }
    sqlite3_finalize(put);
}

/* Replace a stored record by the same record without its fixed state. */
static int drop_state(kvt_store *st, int64_t id)
{
    kvt_wbuf out = {0};
    uint8_t *buf = NULL;
    size_t cap = 0;
    sqlite3_stmt *get = prep(st, "SELECT data, rseg, roff, bytes FROM snaps WHERE id = ?", "thin snapshot");
    if (!get) return sql_status(st);
    sqlite3_bind_int64(get, 1, id);
    const uint8_t *p;
    size_t len;
    /* a record that does not read or parse stays as it is: loading will quarantine it */
    if (step(st, get, "thin snapshot") == SQLITE_ROW && row_record(st, get, 0, 3, &buf, &cap, &p, &len) == KVT_OK && p &&
        kvt_snap_without_state(p, len, &out) == KVT_OK && out.len > 0) {
        sqlite3_finalize(get);
        get = NULL;
        replace_record(st, id, out.p, out.len,
                       "UPDATE snaps SET data = X'', bytes = ?1, rseg = ?2, roff = ?3, replay = 1 WHERE id = ?4");
    }
    sqlite3_finalize(get);
    free(buf);
    kvt_wbuf_free(&out);
    return sql_status(st);
}

/* Snapshots that the one just saved (n tokens, block keys keys) extends keep
 * only what their blocks cannot give: their fixed state is dropped, and
 * loading one rebuilds it by replay (docs/STORE.md). Cold snapshots stay
 * whole: new conversations fork from them. */
static int thin_ancestors(kvt_store *st, const kvt_model *m, const int32_t *tokens, size_t n, const uint64_t *keys,
                          int64_t self)
{
    size_t nb = n / KVT_BLOCK;
    idset ids = {0};
    sqlite3_stmt *sel = prep(st, "SELECT id, n_tokens, tail FROM snaps WHERE head = ? AND n_tokens < ? AND"
                                 " reason != 'cold' AND id != ? AND replay = 0", "thin snapshots");
    if (!sel) return sql_status(st);
    for (size_t b = 0; b <= nb && !st->sql_rc; b++) {
        uint64_t head = b ? keys[b - 1] : kvt_snap_key0(m);
        sqlite3_reset(sel);
        sqlite3_bind_int64(sel, 1, (int64_t)head);
        sqlite3_bind_int64(sel, 2, (int64_t)n);
        sqlite3_bind_int64(sel, 3, self);
        while (step(st, sel, "thin snapshots") == SQLITE_ROW) {
            size_t na = (size_t)sqlite3_column_int64(sel, 1);
            if (na / KVT_BLOCK != b || (uint64_t)sqlite3_column_int64(sel, 2) !=
                                           kvt_snap_tail_hash(head, tokens + b * KVT_BLOCK, na - b * KVT_BLOCK))
                continue;
            idset_add(&ids, sqlite3_column_int64(sel, 0));
        }
    }
    sqlite3_finalize(sel);
    int rc = ids.oom ? kvt_fail(KVT_ENOMEM, "thin snapshots") : sql_status(st);
    for (size_t i = 0; i < ids.n && !rc; i++) rc = drop_state(st, ids.v[i]);
    free(ids.v);
    return rc;
}

static void preview_of(const char *text, size_t len, char *out, size_t cap)
{
    size_t k = 0;
    for (size_t i = 0; i < len && k + 1 < cap; i++) {
        unsigned char c = (unsigned char)text[i];
        out[k++] = c == '\n' || c == '\t' ? ' ' : (c >= 32 && c < 127 ? (char)c : '.');
    }
    out[k] = 0;
}

/* A save of a prefix the store holds whole already (the save policy runs
 * again over the prefixes of a session that a request extended): only its
 * use moves, and the record is never encoded, which for a long prefix with
 * a recurrent state costs seconds. The entry's identity comes from the
 * token ids alone. Returns KVT_OK when that was all, 1 when the save must
 * go on (not stored, or a cold save that meets another kind of entry and
 * rewrites its record), or an error. */
static int stored_already(kvt_store *st, kvt_session *s, size_t n, const char *reason, int64_t *id_out)
{
    size_t nb = n / KVT_BLOCK;
    uint64_t head = kvt_snap_key0(s->m);
    for (size_t b = 0; b < nb; b++) head = kvt_snap_key_next(head, s->tokens + b * KVT_BLOCK);
    int64_t a[3] = {(int64_t)head, (int64_t)n,
                    (int64_t)kvt_snap_tail_hash(head, s->tokens + nb * KVT_BLOCK, n - nb * KVT_BLOCK)};
    int rc = begin(st);
    if (rc) { st->save_errors++; return rc; }
    int64_t id = q_int(st, "SELECT id FROM snaps WHERE head = ? AND n_tokens = ? AND tail = ?", 3, a, -1);
    /* (a row the unique index names and the table lacks is damage, which
     * the save below meets and the rebuild mends) */
    bool whole = id >= 0 && !st->sql_rc && q_int(st, "SELECT COUNT(*) FROM snaps WHERE id = ?", 1, &id, 0) == 1 &&
                 !(reason && !strcmp(reason, "cold") &&
                   q_int(st, "SELECT reason != 'cold' OR replay != 0 FROM snaps WHERE id = ?", 1, &id, 1) != 0);
    if (!whole || st->sql_rc) {
        int failed = st->sql_rc;
        rollback(st);
        if (!failed) return 1;
        st->save_errors++;
        return sql_status(st);
    }
    int64_t u[2] = {tick(st), id};
    q(st, NULL, "UPDATE snaps SET last_used = ? WHERE id = ?", 2, u);
    flush_counters(st);
    if ((rc = commit(st))) { st->save_errors++; return rc; }
    if (id_out) *id_out = id;
    return KVT_OK;
}

static int store_save(kvt_store *st, kvt_session *s, size_t n, const char *reason, int64_t *id_out, bool *created)
{
    if (created) *created = false;
    if (!kvt_snap_can_save(s, n))
        return kvt_fail(KVT_EINVAL, "cannot save %zu tokens: the session holds %zu and no checkpoint there", n, s->n);
    int rc = stored_already(st, s, n, reason, id_out);
    if (rc != 1) return rc;
    kvt_wbuf rec = {0}, blk = {0}, locs = {0};
    uint64_t *keys = NULL;
    rc = kvt_snap_encode(s, n, 0, &rec, &keys);
    if (rc) { kvt_wbuf_free(&rec); return rc; } /* what it appended before running out */
    kvt_snap_info in;
    if ((rc = kvt_snap_parse_raw(rec.p, rec.len, &in))) goto out;
    size_t nb = in.nb, tail_n = n - nb * KVT_BLOCK;
    int64_t head = (int64_t)in.head;
    int64_t tail = (int64_t)kvt_snap_tail_hash(in.head, s->tokens + nb * KVT_BLOCK, tail_n);
    char head_text[256], preview[64];
    size_t hl = 0;
    for (size_t i = 0; i < n && i < 64 && hl < sizeof head_text; i++) {
        const char *pc;
        size_t pl;
        if (kvt_token_piece(s->m, s->tokens[i], &pc, &pl) != KVT_OK) continue;
        if (pl > sizeof head_text - hl) pl = sizeof head_text - hl;
        memcpy(head_text + hl, pc, pl);
        hl += pl;
    }
    preview_of(head_text, hl, preview, sizeof preview);
    /* room for the record and its blocks (an upper bound: blocks stored
     * already are not written again) before anything is written */
    uint64_t need = rec.len + ROOM_SLACK + wal_headroom(st);
    if (nb) {
        uint64_t key;
        if ((rc = kvt_snap_block(s, 0, kvt_snap_key0(s->m), &blk, &key))) goto out;
        need += (uint64_t)nb * (blk.len + 2048); /* the text of a block varies */
    }
    bool retried = false;
    st->full = false;
    kvt_segs_took_full(st->segs);
    if ((rc = make_room(st, need, -1, false))) {
        st->save_errors++;
        goto out;
    }
again:
    locs.len = 0;
    if ((rc = begin(st))) {
        st->save_errors++;
        goto out;
    }
    int64_t id = -1;
    {
        int64_t a[3] = {head, (int64_t)n, tail};
        id = q_int(st, "SELECT id FROM snaps WHERE head = ? AND n_tokens = ? AND tail = ?", 3, a, -1);
    }
    int64_t t = tick(st);
    bool fresh = id < 0;
    if (st->sql_rc) {
        /* the transaction rolls back below */
    } else if (!fresh && q_int(st, "SELECT COUNT(*) FROM snaps WHERE id = ?", 1, &id, 0) != 1 && !st->sql_rc) {
        /* the unique index names a row the table does not hold: damage,
         * which the rebuild (and the save after it) mends */
        sql_note(st, SQLITE_CORRUPT, "save snapshot: the index names a snapshot the table lacks");
    } else if (!fresh) { /* already stored: only the use moves */
        int64_t a[2] = {t, id};
        q(st, NULL, "UPDATE snaps SET last_used = ? WHERE id = ?", 2, a);
        /* ...unless a cold save meets another kind of entry: it becomes a
         * whole cold one, as if saved cold first (fork points stay whole) */
        if (reason && !strcmp(reason, "cold") &&
            q_int(st, "SELECT reason != 'cold' OR replay != 0 FROM snaps WHERE id = ?", 1, &id, 0) == 1)
            replace_record(st, id, rec.p, rec.len,
                           "UPDATE snaps SET reason = 'cold', replay = 0, data = X'', bytes = ?1, rseg = ?2, roff = ?3"
                           " WHERE id = ?4");
    } else {
        /* The record, then new blocks, go to the end of the current
         * segment (seg_append: synced before the rows that name them
         * commit, cut back if they do not) */
        uint64_t prev = kvt_snap_key0(s->m);
        /* the record first: a load reads it, then the blocks, so a first
         * save's are read in the order they lie */
        bloc rw = {0};
        if (!st->sql_rc) rc = seg_append(st, rec.p, rec.len, &rw);
        sqlite3_stmt *has = rc ? NULL : prep(st, "SELECT seg, off, bytes FROM blocks WHERE key = ?", "save block");
        for (size_t b = 0; b < nb && !rc && !st->sql_rc; b++) {
            int64_t k = (int64_t)keys[b];
            sqlite3_reset(has);
            sqlite3_bind_int64(has, 1, k);
            int r = step(st, has, "save block");
            if (r != SQLITE_ROW && r != SQLITE_DONE) break;
            bloc w;
            bool again = false;
            if (r == SQLITE_ROW) {
                /* stored already: the new snapshot names the place its row
                 * says, once the record's header there says it is this
                 * block and its end is there (a damaged row or a cut
                 * segment must not spread to new snapshots: the block is
                 * written anew and its row moved to it; damage inside a
                 * record is met by the load, which removes the block) */
                uint8_t head[KVT_SNAP_BLOCK_HEAD], end[8];
                if (!row_bloc(has, 0, 1, 2, &w)) again = true;
                else if (w.seg) /* its last bytes read too: a segment cut short is seen */
                    again = w.bytes < sizeof head || kvt_segs_read(st->segs, w.seg, w.off, head, sizeof head) ||
                            !kvt_snap_block_names(head, keys[b], (size_t)w.bytes) ||
                            kvt_segs_read(st->segs, w.seg, w.off + w.bytes - sizeof end, end, sizeof end);
            }
            if (r == SQLITE_DONE || again) {
                uint64_t key;
                blk.len = 0;
                if ((rc = kvt_snap_block(s, (uint32_t)b, prev, &blk, &key))) break;
                if ((rc = seg_append(st, blk.p, blk.len, &w))) break;
                sqlite3_stmt *ins = prep(st, again ? "UPDATE blocks SET bytes = ?2, data = X'', seg = ?3, off = ?4 WHERE key = ?1"
                                                   : "INSERT INTO blocks(key, refs, bytes, data, seg, off) VALUES(?, 0, ?, X'', ?, ?)",
                                         "save block");
                if (ins) {
                    sqlite3_bind_int64(ins, 1, k);
                    sqlite3_bind_int64(ins, 2, (int64_t)blk.len);
                    sqlite3_bind_int64(ins, 3, w.seg);
                    sqlite3_bind_int64(ins, 4, (int64_t)w.off);
                    step(st, ins, "save block");
                }
                sqlite3_finalize(ins);
            }
            locs_put(&locs, &w);
            prev = keys[b];
        }
        sqlite3_finalize(has);
        if (!rc && locs.oom) rc = kvt_fail(KVT_ENOMEM, "block places");
        sqlite3_stmt *ins = rc ? NULL : prep(st, "INSERT INTO snaps(model, head, n_tokens, tail, n_blocks, reason, created,"
                                                 " last_used, used_at, bytes, preview, data, locs, rseg, roff)"
                                                 " VALUES(?,?,?,?,?,?,?,?,?,?,?,X'',?,?,?)",
                                             "save snapshot");
        if (ins) {
            double now = now_unix();
            sqlite3_bind_int64(ins, 1, (int64_t)s->m->fingerprint);
            sqlite3_bind_int64(ins, 2, head);
            sqlite3_bind_int64(ins, 3, (int64_t)n);
            sqlite3_bind_int64(ins, 4, tail);
            sqlite3_bind_int64(ins, 5, (int64_t)nb);
            sqlite3_bind_text(ins, 6, reason ? reason : "manual", -1, SQLITE_TRANSIENT);
            sqlite3_bind_double(ins, 7, now);
            sqlite3_bind_int64(ins, 8, t);
            sqlite3_bind_double(ins, 9, now);
            sqlite3_bind_int64(ins, 10, (int64_t)rec.len);
            sqlite3_bind_text(ins, 11, preview, -1, SQLITE_TRANSIENT);
            if (locs.len) sqlite3_bind_blob(ins, 12, locs.p, (int)locs.len, SQLITE_STATIC);
            else sqlite3_bind_null(ins, 12);
            sqlite3_bind_int64(ins, 13, rw.seg);
            sqlite3_bind_int64(ins, 14, (int64_t)rw.off);
            if (step(st, ins, "save snapshot") == SQLITE_DONE) id = sqlite3_last_insert_rowid(st->db);
        }
        sqlite3_finalize(ins);
        for (size_t b = 0; b < nb && !rc && !st->sql_rc; b++) {
            int64_t a[3] = {id, (int64_t)b, (int64_t)keys[b]};
            q(st, NULL, "INSERT INTO snap_blocks(snap, idx, key) VALUES(?, ?, ?)", 3, a);
            q(st, NULL, "UPDATE blocks SET refs = refs + 1 WHERE key = ?", 1, &a[2]);
        }
        if (!rc && !st->sql_rc && s->m->arch->state_rebuild) rc = thin_ancestors(st, s->m, s->tokens, n, keys, id);
        if (!rc) {
            counter_add(st, "saves", 1);
            enforce_budget(st, id);
        }
    }
    if (!rc) {
        flush_counters(st);
        rc = commit(st);
    } else {
        rollback(st);
    }
    if (rc && st->full && !retried && !kvt_store_room_fault) {
        /* the disk filled meanwhile (another writer, or the estimate was
         * short): evict what the save needs and try once more */
        retried = true;
        st->full = false;
        st->sql_rc = 0;
        if (make_room(st, need, -1, true) == KVT_OK) {
            st->sql_rc = 0;
            goto again;
        }
    }
    if (rc) {
        st->save_errors++;
        goto out;
    }
    if (fresh) index_add(st, (ientry){(uint64_t)head, (uint64_t)tail, (uint32_t)n, id});
    if (id_out) *id_out = id;
    if (created) *created = fresh;
out:
    kvt_wbuf_free(&rec);
    kvt_wbuf_free(&blk);
    kvt_wbuf_free(&locs);
    free(keys);
    return rc;
}

/* ---- lookup ---- */

static int refresh_index(kvt_store *st)
{
    int64_t dv = q_int(st, "PRAGMA data_version", 0, NULL, -2);
    if (st->sql_rc) return sql_status(st);
    if (!st->dirty && dv == st->data_version) return KVT_OK;
    int64_t count = q_int(st, "SELECT COUNT(*) FROM snaps", 0, NULL, 0);
    if (st->sql_rc) return sql_status(st);
    size_t cap = (count > 0 ? (size_t)count : 0) + 16, n = 0, bytes;
    ientry *idx = kvt_mul_ok(cap, sizeof *idx, &bytes) ? kvt_malloc(bytes) : NULL;
    if (!idx) return kvt_fail(KVT_ENOMEM, "cache index of %zu entries", cap);
    sqlite3_stmt *stmt = prep(st, "SELECT head, n_tokens, tail, id FROM snaps", "index");
    while (step(st, stmt, "index") == SQLITE_ROW) {
        int rc; /* another connection may have added rows since the count */
        KVT_GROW(idx, &cap, n + 1, rc);
        if (rc) {
            sqlite3_finalize(stmt);
            free(idx);
            return rc;
        }
        idx[n++] = (ientry){(uint64_t)sqlite3_column_int64(stmt, 0), (uint64_t)sqlite3_column_int64(stmt, 2),
                            (uint32_t)sqlite3_column_int64(stmt, 1), sqlite3_column_int64(stmt, 3)};
    }
    sqlite3_finalize(stmt);
    if (st->sql_rc) {
        free(idx);
        return sql_status(st);
    }
    qsort(idx, n, sizeof *idx, cmp_ientry);
    free(st->idx);
    st->idx = idx;
    st->n_idx = n;
    st->cap_idx = cap;
    st->data_version = dv;
    st->dirty = false;
    return KVT_OK;
}

static bool skipped(const kvt_store *st, int64_t id)
{
    for (size_t i = 0; i < st->n_skip && i < 64; i++) /* the last 64 */
        if (st->skip[i] == id) return true;
    return false;
}

static int store_lookup(kvt_store *st, const kvt_model *m, const int32_t *tokens, size_t n, size_t *match, int64_t *id)
{
    *match = 0;
    *id = -1;
    int rc = refresh_index(st);
    if (rc) return rc;
    st->lookups++;
    size_t nb = n / KVT_BLOCK;
    uint64_t *heads = kvt_malloc((nb + 1) * sizeof *heads);
    if (!heads) return KVT_ENOMEM;
    heads[0] = kvt_snap_key0(m);
    for (size_t b = 0; b < nb; b++) heads[b + 1] = kvt_snap_key_next(heads[b], tokens + b * KVT_BLOCK);
    for (size_t b = nb + 1; b-- > 0 && !*match;) {
        /* entries with this head, longest first */
        size_t lo = 0, hi = st->n_idx;
        while (lo < hi) {
            size_t mid = (lo + hi) / 2;
            if (st->idx[mid].head < heads[b]) lo = mid + 1;
            else hi = mid;
        }
        size_t end = lo;
        while (end < st->n_idx && st->idx[end].head == heads[b]) end++;
        for (size_t k = end; k-- > lo;) {
            const ientry *e = &st->idx[k];
            size_t start = b * KVT_BLOCK;
            if (e->n > n || e->n < start || e->n - start >= KVT_BLOCK || e->n == 0 || skipped(st, e->id)) continue;
            if (kvt_snap_tail_hash(heads[b], tokens + start, e->n - start) == e->tail) {
                *match = e->n;
                *id = e->id;
                break;
            }
        }
    }
    free(heads);
    if (!*match) st->misses++;
    return KVT_OK;
}

/* ---- load ---- */

/* The blocks of a load, at the places the snapshot's locs name (segments;
 * with a place for every block, read on two threads straight into the
 * rows, kvt_snap_load_read_start), or else in the record's order through
 * one incremental blob handle (a schema 1 store's rows):
 * sqlite3_blob_reopen moves it to the next block's row (a seek on the
 * table's key, no statement to step), and sqlite3_blob_read copies the
 * record into the loader's buffer. A block the handle cannot open (no such
 * row, or a value that is not a blob) is read again with a statement,
 * which tells a missing block from a damaged one. Blocks read from SQLite
 * are read one after the other, so a failed read is the load's first
 * failure, as the store's own (st->sql_rc). */
struct getter {
    kvt_store *st;
    const uint8_t *locs;     /* the snapshot's block places (snaps.locs), n_locs of them */
    size_t n_locs;
    sqlite3_blob *blob;
    sqlite3_stmt *stmt;      /* the fallback, prepared on first use */
    bool concurrent;         /* every block has its place: read on two threads, segments only */
};

static int read_block_stmt(struct getter *g, uint32_t b, uint64_t key, uint8_t **buf, size_t *cap, size_t *len)
{
    if (!g->stmt && !(g->stmt = prep(g->st, "SELECT data FROM blocks WHERE key = ?", "load block")))
        return sql_status(g->st);
    sqlite3_reset(g->stmt);
    sqlite3_bind_int64(g->stmt, 1, (int64_t)key);
    int r = step(g->st, g->stmt, "load block");
    if (r != SQLITE_ROW)
        return r == SQLITE_DONE ? kvt_fail(KVT_EFORMAT, "block %u (key %016llx) is missing", b, (unsigned long long)key)
                                : sql_status(g->st);
    const void *p = sqlite3_column_blob(g->stmt, 0);
    size_t n = (size_t)sqlite3_column_bytes(g->stmt, 0);
    if (!p) return kvt_fail(KVT_EFORMAT, "block %u (key %016llx) is empty", b, (unsigned long long)key);
    if (n > *cap) {
        uint8_t *nb = realloc(*buf, n);
        if (!nb) return kvt_fail(KVT_ENOMEM, "block %u: %zu bytes", b, n);
        *buf = nb;
        *cap = n;
    }
    memcpy(*buf, p, n);
    *len = n;
    return KVT_OK;
}

static int read_block_blob(struct getter *g, uint32_t b, uint64_t key, uint8_t **buf, size_t *cap, size_t *len)
{
    kvt_store *st = g->st;
    int rc = g->blob ? sqlite3_blob_reopen(g->blob, (sqlite3_int64)key)
                     : sqlite3_blob_open(st->db, "main", "blocks", "data", (sqlite3_int64)key, 0, &g->blob);
    if (rc != SQLITE_OK) {
        /* the handle is spent: the next block opens a new one */
        sqlite3_blob_close(g->blob);
        g->blob = NULL;
        if ((rc & 0xff) == SQLITE_ERROR) return read_block_stmt(g, b, key, buf, cap, len);
        return sql_note(st, rc, "load block");
    }
    size_t n = (size_t)sqlite3_blob_bytes(g->blob);
    if (n == 0) return kvt_fail(KVT_EFORMAT, "block %u (key %016llx) is empty", b, (unsigned long long)key);
    if (n > *cap) {
        uint8_t *nb = realloc(*buf, n);
        if (!nb) return kvt_fail(KVT_ENOMEM, "block %u: %zu bytes", b, n);
        *buf = nb;
        *cap = n;
    }
    if ((rc = sqlite3_blob_read(g->blob, *buf, (int)n, 0)) != SQLITE_OK) return sql_note(st, rc, "load block");
    *len = n;
    return KVT_OK;
}

static int read_block(void *user, uint32_t b, uint64_t key, const kvt_block_rows *rows, uint8_t **buf, size_t *cap,
                      size_t *len, bool *in_place)
{
    struct getter *g = user;
    kvt_store *st = g->st;
    *in_place = false;
    if (st->sql_rc) return sql_status(st);
    bloc w;
    if (b < g->n_locs && locs_at(g->locs, b, &w) && w.seg) { /* in a segment, where the snapshot says */
        if (w.bytes > BLOCK_MAX) return kvt_fail(KVT_EFORMAT, "block %u: %llu bytes", b, (unsigned long long)w.bytes);
        /* a record too short to hold the rows is read whole, and fails its checks */
        *in_place = rows && rows->bytes <= BLOCK_MAX && w.bytes >= rows->bytes + 8;
        int rc = read_bloc_into(st, &w, *in_place ? rows : NULL, buf, cap);
        if (rc) {
            char why[400];
            snprintf(why, sizeof why, "%s", kvt_errmsg());
            return kvt_fail(rc, "block %u (key %016llx): %s", b, (unsigned long long)key, why);
        }
        *len = (size_t)w.bytes;
        return KVT_OK;
    }
    /* read on two threads, the snapshot named a place for every block
     * (store_load): SQLite is not for this thread */
    if (g->concurrent) return kvt_fail(KVT_EFORMAT, "block %u (key %016llx) has no place", b, (unsigned long long)key);
    return read_block_blob(g, b, key, buf, cap, len);
}

/* The load's blocks are read: close the handle. */
static void getter_end(struct getter *g)
{
    sqlite3_blob_close(g->blob);
    g->blob = NULL;
    sqlite3_finalize(g->stmt);
    g->stmt = NULL;
}

/* A damaged entry: record, remove, report once. id (-1: none) is the
 * snapshot; with has_key the block of that key is damaged (or missing), and
 * every snapshot that stands on it goes too. */
static void quarantine(kvt_store *st, int64_t id, bool has_key, uint64_t key, const bloc *where, const char *reason)
{
    if (begin(st) == KVT_OK) {
        st->keep_places = true; /* what the removed rows name is gc's to give back */
        /* A block read from the place a snapshot named (where) that its
         * row no longer names: the snapshot's list of places is wrong, or
         * the block was removed and stored anew since the load began, or
         * the row is damaged. The block goes only if the record its row
         * names fails its checks too. */
        if (has_key && where) {
            sqlite3_stmt *at = NULL;
            int64_t k = (int64_t)key;
            bloc now;
            int r = q(st, &at, "SELECT seg, off, bytes FROM blocks WHERE key = ?", 1, &k);
            if (r != SQLITE_ROW) {
                has_key = false;
            } else if (row_bloc(at, 0, 1, 2, &now) && now.seg == where->seg && now.off == where->off &&
                       now.bytes == where->bytes) {
                /* the row names where the damage is */
            } else {
                sqlite3_stmt *row = prep(st, block_row_sql(st), "quarantine");
                uint8_t *buf = NULL;
                size_t cap = 0;
                if (row) {
                    sqlite3_bind_int64(row, 1, k);
                    if (step(st, row, "quarantine") == SQLITE_ROW && check_block_row(st, row, 0, key, &buf, &cap) == KVT_OK)
                        has_key = false;
                }
                free(buf);
                sqlite3_finalize(row);
            }
            sqlite3_finalize(at);
        }
        sqlite3_stmt *ins = prep(st, "INSERT INTO quarantine(what, reason, at) VALUES(?, ?, ?)", "quarantine");
        if (ins) {
            char what[64];
            if (has_key) snprintf(what, sizeof what, "block %016llx", (unsigned long long)key);
            else snprintf(what, sizeof what, "snapshot %lld", (long long)id);
            sqlite3_bind_text(ins, 1, what, -1, SQLITE_TRANSIENT);
            sqlite3_bind_text(ins, 2, reason, -1, SQLITE_TRANSIENT);
            sqlite3_bind_double(ins, 3, now_unix());
            step(st, ins, "quarantine");
        }
        sqlite3_finalize(ins);
        if (has_key) {
            int64_t k = (int64_t)key;
            idset victims = {0};
            sqlite3_stmt *sel = prep(st, "SELECT DISTINCT snap FROM snap_blocks WHERE key = ?", "quarantine");
            if (sel) {
                sqlite3_bind_int64(sel, 1, k);
                while (step(st, sel, "quarantine") == SQLITE_ROW) idset_add(&victims, sqlite3_column_int64(sel, 0));
            }
            sqlite3_finalize(sel);
            if (victims.oom) sql_note(st, SQLITE_NOMEM, "quarantine");
            for (size_t i = 0; i < victims.n; i++) drop_snap(st, victims.v[i]);
            free(victims.v);
            delete_placed(st, "DELETE FROM blocks WHERE key = ? RETURNING seg, off, bytes", 1, &k);
        }
        if (id >= 0) drop_snap(st, id);
        counter_add(st, "damaged", 1);
        resync_totals(st, NULL, NULL); /* the damaged row's size may have read back wrong */
        st->keep_places = false;
        commit(st);
    }
    if (st->quiet) return;
    char who[64];
    if (id >= 0) snprintf(who, sizeof who, "cache entry %lld", (long long)id);
    else snprintf(who, sizeof who, "cache block %016llx", (unsigned long long)key);
    if (st->sql_rc) fprintf(stderr, "kvtier: %s is unusable (%s); not removed: %s\n", who, reason, st->sql_msg);
    else fprintf(stderr, "kvtier: %s is unusable (%s); removed\n", who, reason);
}

/* Recording a use is bookkeeping: in WAL mode a commit without its fsync
 * keeps the store consistent, and a crash forgets at most the last uses.
 * Saves and removals stay synchronous=FULL. A failure to record one is
 * reported; the load it follows stands. */
static void record_use(kvt_store *st, int64_t id)
{
    if (st->durable) exec(st, "PRAGMA synchronous=NORMAL");
    if (begin(st) == KVT_OK) {
        int64_t a[2] = {tick(st), id};
        q(st, NULL, "UPDATE snaps SET hits = hits + 1, last_used = ? WHERE id = ?", 2, a);
        sqlite3_stmt *u = prep(st, "UPDATE snaps SET used_at = ? WHERE id = ?", NULL);
        if (u) {
            sqlite3_bind_double(u, 1, now_unix());
            sqlite3_bind_int64(u, 2, id);
            step(st, u, NULL);
        }
        sqlite3_finalize(u);
        flush_counters(st);
        commit(st);
    }
    if (st->durable) {
        int rc = sqlite3_exec(st->db, "PRAGMA synchronous=FULL", NULL, NULL, NULL);
        if (rc != SQLITE_OK) sql_note(st, rc, "restore synchronous=FULL");
    }
    if (st->sql_rc && !st->quiet) fprintf(stderr, "kvtier: %s (a use of entry %lld not recorded)\n", st->sql_msg, (long long)id);
}

static int store_load(kvt_store *st, int64_t id, kvt_session *s)
{
    sqlite3_stmt *stmt = NULL;
    /* one read transaction: the record and its blocks come from one state of
     * the store whatever other processes commit meanwhile, and the blocks
     * are read without a lock round trip each */
    rollback(st); /* one a failed call left open */
    int rc = exec(st, "BEGIN");
    if (rc) return rc;
    int r = q(st, &stmt, st->has_segs ? "SELECT locs, " SNAP_COLS " FROM snaps WHERE id = ?"
                                      : "SELECT NULL, " SNAP_COLS1 " FROM snaps WHERE id = ?", 1, &id);
    if (r != SQLITE_ROW) {
        rc = st->sql_rc ? sql_status(st) : kvt_fail(KVT_ENOENT, "no cache entry %lld", (long long)id);
        rollback(st);
        return rc;
    }
    size_t locs_len = (size_t)sqlite3_column_bytes(stmt, 0);
    if (locs_len % LOC_BYTES) locs_len = 0; /* not a list of places: each block is looked up by its key */
    uint8_t *locs = kvt_malloc(locs_len + 1);
    if (!locs) { sqlite3_finalize(stmt); rollback(st); return KVT_ENOMEM; }
    if (locs_len) memcpy(locs, sqlite3_column_blob(stmt, 0), locs_len);
    struct getter g = {.st = st, .locs = locs, .n_locs = locs_len / LOC_BYTES};
    const uint8_t *rp = NULL;
    size_t len = 0;
    uint8_t *rbuf = NULL, *rec = NULL;
    size_t rcap = 0;
    rc = row_record(st, stmt, 8, 7, &rbuf, &rcap, &rp, &len);
    /* a record of a newer version is skipped below, not blamed on its row */
    bool future = !rc && len >= 12 && !memcmp(rp, "KVTSNAP", 7) && kvt_rd32(rp + 8) > KVT_SNAP_VERSION_MAX;
    kvt_snap_info info;
    if (!rc && !future) rc = snap_row_agrees(stmt, 1, rp, len, &info);
    if (!rc && !(rec = kvt_malloc(len ? len : 1))) rc = KVT_ENOMEM;
    if (!rc && len) memcpy(rec, rp, len);
    free(rbuf);
    sqlite3_finalize(stmt);
    if (rc) {
        kvt_snap_empty(s); /* as a load that failed later leaves it (kvtier.h) */
        free(locs);
        rollback(st);
        if (rc == KVT_ENOMEM || rc == KVT_EIO) { st->misses++; return rc; }
        char reason[512];
        snprintf(reason, sizeof reason, "%s", kvt_errmsg());
        quarantine(st, id, false, 0, NULL, reason);
        st->misses++;
        return kvt_fail(rc, "%s", reason);
    }
    bool rebuild = false;
    uint32_t bad_block = UINT32_MAX;
    uint64_t bad_key = 0;
    g.concurrent = g.n_locs > 0;
    for (size_t i = 0; i < g.n_locs && g.concurrent; i++) {
        bloc w;
        g.concurrent = locs_at(g.locs, i, &w) && w.seg;
    }
    rc = kvt_snap_load_read_start(s, rec, len, read_block, g.concurrent, &g, &rebuild, &bad_block, &bad_key);
    getter_end(&g);
    /* a read that failed is the database's failure, never the record's */
    if (st->sql_rc) rc = sql_status(st);
    char why[512];
    snprintf(why, sizeof why, "%s", kvt_errmsg());
    rollback(st); /* ends the read */
    if (rc == KVT_OK) rc = kvt_snap_load_finish(s, rebuild); /* a replay needs no database */
    else kvt_fail(rc, "%s", why);
    free(rec);
    /* the place of the block that failed, before the places go */
    bloc where = {0};
    if (rc != KVT_OK && bad_block < g.n_locs) locs_at(g.locs, bad_block, &where);
    free(locs);
    if (rc == KVT_OK) {
        st->hits++;
        record_use(st, id);
        return KVT_OK;
    }
    if (rc == KVT_ENOMEM || rc == KVT_ECTX || rc == KVT_EIO || future) {
        if (future && !skipped(st, id)) st->skip[st->n_skip++ % 64] = id;
        st->misses++;
        return rc;
    }
    char reason[512];
    snprintf(reason, sizeof reason, "%s", kvt_errmsg());
    /* A block that failed its own checks is the culprit; otherwise the record. */
    bool block_bad = bad_block != UINT32_MAX && strncmp(reason, "snapshot", 8) != 0;
    quarantine(st, id, block_bad, bad_key, block_bad && where.seg ? &where : NULL, reason);
    st->misses++;
    return kvt_fail(rc, "%s", reason);
}

static int store_restore_prefix(kvt_store *st, kvt_session *s, const int32_t *tokens, size_t n, size_t *reused)
{
    *reused = 0;
    for (int attempt = 0; attempt < 4; attempt++) {
        size_t match;
        int64_t id;
        st->sql_rc = 0; /* each attempt stands alone: a removal that failed was reported */
        int rc = store_lookup(st, s->m, tokens, n, &match, &id);
        if (rc == KVT_OK && (!match || match > s->n_ctx)) return KVT_OK;
        if (rc == KVT_OK) rc = store_load(st, id, s);
        if (rc == KVT_ENOMEM) return rc;
        if (rc == KVT_OK) {
            if (kvt_session_len(s) == match && !memcmp(kvt_session_tokens(s), tokens, match * sizeof *tokens)) {
                *reused = match;
                return KVT_OK;
            }
            /* a hash collision: never use rows of another prefix */
            s->n = 0;
            kvt_cache_truncate(s->cache, 0);
            kvt_session_ckpt_clear(s);
            return KVT_OK;
        }
        if (rebuilt(st)) continue; /* the database was damaged: look again in the rebuilt one */
        if (rc == KVT_EIO) {       /* a miss; the store is not at fault for the prompt */
            if (!st->quiet) fprintf(stderr, "kvtier: %s (a miss)\n", kvt_errmsg());
            return KVT_OK;
        }
        /* the entry was removed or is passed over: a shorter prefix may serve */
    }
    return KVT_OK;
}

/* ---- maintenance and inspection ---- */

static int store_rm(kvt_store *st, int64_t id)
{
    int rc = begin(st);
    if (rc) return rc;
    if (q_int(st, "SELECT COUNT(*) FROM snaps WHERE id = ?", 1, &id, 0) == 0 && !st->sql_rc) {
        rollback(st);
        return kvt_fail(KVT_ENOENT, "no cache entry %lld", (long long)id);
    }
    drop_snap(st, id);
    return commit(st);
}

typedef struct badrec { int64_t id; bool block; char why[200]; } badrec;

typedef struct checked {
    size_t records, bad; /* records read (or that could not be read), of them damaged */
    badrec *list;        /* (bad of them) */
    bool oom;
} checked;

static void found_bad(kvt_store *st, checked *o, int64_t id, bool block, const char *why)
{
    badrec *g = NULL;
    size_t bytes;
    if (!o->oom && kvt_mul_ok(o->bad + 1, sizeof *g, &bytes) && (g = realloc(o->list, bytes))) {
        o->list = g;
        g[o->bad] = (badrec){id, block, ""};
        snprintf(g[o->bad].why, sizeof g[o->bad].why, "%s", why);
    } else {
        o->oom = true;
    }
    o->bad++;
    if (st->quiet) return;
    if (block) fprintf(stderr, "kvtier: block %016llx: %s\n", (unsigned long long)id, why);
    else fprintf(stderr, "kvtier: snapshot %lld: %s\n", (long long)id, why);
}

/* A statement to inspect with, or NULL (damage that keeps it from being
 * prepared, such as a damaged schema, is a finding). */
static sqlite3_stmt *prep_inspect(kvt_store *st, const char *sql, const char *what)
{
    sqlite3_stmt *stmt = prep(st, sql, what);
    if (!stmt && forget_finding(st) && !st->quiet) fprintf(stderr, "kvtier: %s\n", st->sql_msg);
    return stmt;
}

/* Check every record: each snapshot the database lists (its row against its
 * record, and the record's checksums), then each block that a sound
 * snapshot stands on or that the blocks table holds. A record SQLite cannot
 * read is damaged, and so is a block missing under a snapshot. Damage that
 * cuts a list short is reported; a failure other than damage ends the
 * check and is its result. */
static int check_records(kvt_store *st, checked *o)
{
    idset ids = {0}, keys = {0};
    snap_ids(st, &ids, true);
    idset_seal(&ids);
    char why[512];
    sqlite3_stmt *get = prep_inspect(st, st->has_segs ? "SELECT " SNAP_COLS " FROM snaps WHERE id = ?"
                                                      : "SELECT " SNAP_COLS1 " FROM snaps WHERE id = ?", "snapshot");
    uint8_t *rscratch = NULL;
    size_t rscratch_cap = 0;
    for (size_t i = 0; i < ids.n && get && !st->sql_rc; i++) {
        sqlite3_reset(get);
        sqlite3_bind_int64(get, 1, ids.v[i]);
        int r = step(st, get, "snapshot");
        if (r == SQLITE_DONE) continue; /* named by the index only: the integrity check reports that */
        o->records++;
        kvt_snap_info in;
        if (r != SQLITE_ROW) {
            snprintf(why, sizeof why, "cannot be read (%s)", st->sql_msg);
            if (!forget_damage(st)) break;
            found_bad(st, o, ids.v[i], false, why);
        } else if (check_snap_row(st, get, 0, &in, &rscratch, &rscratch_cap) != KVT_OK) {
            found_bad(st, o, ids.v[i], false, kvt_errmsg());
        } else {
            for (uint32_t b = 0; b < in.nb; b++) idset_add(&keys, (int64_t)kvt_rd64(in.sec[6] + 8 * (size_t)b));
        }
    }
    sqlite3_finalize(get);
    free(rscratch);
    sqlite3_stmt *all = prep_inspect(st, "SELECT key FROM blocks", "blocks");
    while (step(st, all, "blocks") == SQLITE_ROW) idset_add(&keys, sqlite3_column_int64(all, 0));
    sqlite3_finalize(all);
    if (forget_damage(st) && !st->quiet) fprintf(stderr, "kvtier: %s\n", st->sql_msg);
    idset_seal(&keys);
    sqlite3_stmt *getb = prep_inspect(st, block_row_sql(st), "block");
    uint8_t *scratch = NULL;
    size_t scratch_cap = 0;
    for (size_t i = 0; i < keys.n && getb && !st->sql_rc; i++) {
        sqlite3_reset(getb);
        sqlite3_bind_int64(getb, 1, keys.v[i]);
        int r = step(st, getb, "block");
        o->records++;
        if (r == SQLITE_DONE) {
            found_bad(st, o, keys.v[i], true, "missing (a snapshot stands on it)");
        } else if (r != SQLITE_ROW) {
            snprintf(why, sizeof why, "cannot be read (%s)", st->sql_msg);
            if (!forget_damage(st)) break;
            found_bad(st, o, keys.v[i], true, why);
        } else if (check_block_row(st, getb, 0, (uint64_t)keys.v[i], &scratch, &scratch_cap) != KVT_OK) {
            found_bad(st, o, keys.v[i], true, kvt_errmsg());
        }
    }
    free(scratch);
    sqlite3_finalize(getb);
    bool oom = ids.oom || keys.oom || o->oom;
    free(ids.v);
    free(keys.v);
    if (st->sql_rc) return sql_status(st);
    return oom ? kvt_fail(KVT_ENOMEM, "cache store: verify") : KVT_OK;
}

/* SQLite's integrity check: the lines it reports other than "ok", and a
 * failure that stops it (a damaged schema or header) as one more line. */
static int store_integrity(kvt_store *st, size_t *problems, char **report)
{
    *problems = 0;
    if (report) *report = NULL;
    kvt_wbuf out = {0};
    char stop[300] = "";
    sqlite3_stmt *stmt = prep(st, "PRAGMA integrity_check", "integrity check");
    if (!stmt) snprintf(stop, sizeof stop, "%s", sqlite3_errmsg(st->db));
    int r;
    while ((r = step(st, stmt, "integrity check")) == SQLITE_ROW) {
        /* "ok", or problems a line each, under a heading per database
         * (there is one: the heading is left out) */
        const char *text = (const char *)sqlite3_column_text(stmt, 0);
        for (const char *l = text; l && *l;) {
            size_t len = strcspn(l, "\n");
            if (!(len == 2 && !memcmp(l, "ok", 2)) && strncmp(l, "*** in database ", 16)) {
                (*problems)++;
                kvt_wbuf_put(&out, l, len);
                kvt_wbuf_put(&out, "\n", 1);
            }
            l += len + (l[len] == '\n');
        }
    }
    if (stmt && r != SQLITE_DONE) snprintf(stop, sizeof stop, "%s", sqlite3_errmsg(st->db));
    sqlite3_finalize(stmt);
    if (forget_finding(st)) { /* it could not run, or not to its end: that is a finding too */
        (*problems)++;
        kvt_wbuf_put(&out, "the check stopped: ", 19);
        kvt_wbuf_put(&out, stop, strlen(stop));
        kvt_wbuf_put(&out, "\n", 1);
    } else if (!*problems && sqlite3_db_readonly(st->db, "main") == 1) {
        /* SQLite does not load CHECK constraints on a read-only connection
         * (they guard writes), so its check leaves them out: the schema's
         * one is checked here, once the b-trees are sound (a query over a
         * damaged one reads what the check reports already) */
        static const char line[] = "CHECK constraint failed in totals\n";
        int64_t bad = q_int(st, "SELECT COUNT(*) FROM totals WHERE NOT (one = 1)", 0, NULL, 0);
        forget_finding(st);
        for (int64_t i = 0; i < bad; i++) {
            kvt_wbuf_put(&out, line, sizeof line - 1);
            (*problems)++;
        }
    }
    kvt_wbuf_put(&out, "", 1);
    int rc = sql_status(st);
    if (!rc && out.oom) rc = kvt_fail(KVT_ENOMEM, "cache store: integrity check");
    if (rc || !report) {
        kvt_wbuf_free(&out);
        return rc;
    }
    *report = (char *)out.p;
    return KVT_OK;
}

/* gc, inside its write transaction: give back the segment space no row
 * names (what a crash between a commit and its release left, or the rows
 * a rebuild could not keep): the whole pages between the records that rows
 * name are punched out, and a segment below the current one that no row
 * names is deleted. The current one's tail after its last record is cut
 * by the next save. */
static void reclaim_segments(kvt_store *st)
{
    int64_t current = q_int(st, "SELECT v FROM meta WHERE k = 'seg'", 0, NULL, 1);
    sqlite3_stmt *q = prep(st, "SELECT seg, off, bytes FROM blocks WHERE seg IS NOT NULL"
                               " UNION ALL SELECT rseg, roff, bytes FROM snaps WHERE rseg IS NOT NULL ORDER BY 1, 2", "gc");
    uint32_t seg = 0, used[64];
    size_t n_used = 0;
    uint64_t end = 0;
    while (step(st, q, "gc") == SQLITE_ROW) {
        bloc w;
        if (!row_bloc(q, 0, 1, 2, &w) || !w.seg) continue;
        if (w.seg != seg) {
            seg = w.seg;
            end = 0;
            if (n_used < 64) used[n_used++] = seg;
        }
        if (w.off > end) kvt_segs_release(st->segs, seg, end, w.off - end);
        if (w.off + w.bytes > end) end = w.off + w.bytes;
    }
    sqlite3_finalize(q);
    if (st->sql_rc || n_used == 64) return;
    DIR *d = opendir(st->dir);
    for (struct dirent *e; d && (e = readdir(d));) {
        unsigned n;
        char tail;
        if (sscanf(e->d_name, "kvtier.db-seg%u%c", &n, &tail) != 1 || n == 0 || (int64_t)n >= current) continue;
        bool named = false;
        for (size_t i = 0; i < n_used && !named; i++) named = used[i] == n;
        if (!named) kvt_segs_remove(st->segs, n);
    }
    if (d) closedir(d);
}

static int store_gc(kvt_store *st)
{
    size_t problems = 0;
    char *report = NULL;
    int rc = store_integrity(st, &problems, &report);
    if (rc) return rc;
    if (problems) { /* rebuilt from the records that check out (the caller's recover) */
        size_t len = strcspn(report, "\n");
        st->corrupt = true;
        snprintf(st->sql_msg, sizeof st->sql_msg, "integrity check: %.*s", (int)(len < 300 ? len : 300), report);
        free(report);
        return kvt_fail(KVT_EIO, "cache store: %s", st->sql_msg);
    }
    free(report);
    /* records that fail their checks go, as a load that met them would remove them */
    checked o = {0};
    if ((rc = check_records(st, &o)) || st->corrupt) {
        free(o.list);
        return rc ? rc : kvt_fail(KVT_EIO, "cache store: gc: damaged records");
    }
    for (size_t i = 0; i < o.bad && !o.oom && !st->sql_rc; i++)
        quarantine(st, o.list[i].block ? -1 : o.list[i].id, o.list[i].block, (uint64_t)o.list[i].id, NULL, o.list[i].why);
    free(o.list);
    if (st->sql_rc) return sql_status(st);
    if ((rc = begin(st))) return rc;
    enforce_budget(st, -1);
    q(st, NULL, "DELETE FROM snap_blocks WHERE snap NOT IN (SELECT id FROM snaps)", 0, NULL);
    q(st, NULL, "UPDATE blocks SET refs = (SELECT COUNT(*) FROM snap_blocks WHERE snap_blocks.key = blocks.key)", 0, NULL);
    delete_placed(st, "DELETE FROM blocks WHERE refs <= 0 RETURNING seg, off, bytes", 0, NULL);
    totals was, now;
    bool repaired = resync_totals(st, &was, &now);
    flush_counters(st);
    if ((rc = commit(st))) return rc;
    if (repaired && !st->quiet)
        fprintf(stderr, "kvtier: cache totals were %lld B in %lld snapshots, %lld blocks, %lld references; the tables"
                        " hold %lld B, %lld, %lld, %lld: set to those\n", (long long)was.bytes, (long long)was.snaps,
                (long long)was.blocks, (long long)was.refs, (long long)now.bytes, (long long)now.snaps,
                (long long)now.blocks, (long long)now.refs);
    st->dirty = true;
    /* and the free space the file system is to keep */
    if ((rc = make_room(st, 0, -1, false)) && !st->quiet) fprintf(stderr, "kvtier: %s\n", kvt_errmsg());
    /* under the write lock, with nothing written: no save appends meanwhile */
    if (begin(st) == KVT_OK) {
        reclaim_segments(st);
        rollback(st);
    }
    if (st->sql_rc) return sql_status(st);
    return exec(st, "PRAGMA wal_checkpoint(TRUNCATE)");
}

static int store_verify(kvt_store *st, size_t *bad, size_t *n_checked)
{
    checked o = {0};
    int rc = check_records(st, &o);
    free(o.list);
    /* the running totals against the tables (a store that predates them
     * has none to compare) */
    totals a, b;
    if (!rc && !st->quiet && has_totals(st) && read_totals(st, "SELECT bytes, snaps, blocks, refs FROM totals", &a) &&
        read_totals(st, totals_sum, &b) && memcmp(&a, &b, sizeof a))
        fprintf(stderr, "kvtier: cache totals say %lld B in %lld snapshots, %lld blocks, %lld references; the tables"
                        " hold %lld B, %lld, %lld, %lld (kvtier cache gc sets them)\n", (long long)a.bytes,
                (long long)a.snaps, (long long)a.blocks, (long long)a.refs, (long long)b.bytes, (long long)b.snaps,
                (long long)b.blocks, (long long)b.refs);
    forget_finding(st);
    *bad = o.bad;
    *n_checked = o.records;
    return rc;
}

static int store_stats_get(kvt_store *st, kvt_store_stats *o)
{
    memset(o, 0, sizeof *o);
    totals t;
    get_totals(st, &t);
    o->snapshots = (uint64_t)t.snaps;
    o->blocks = (uint64_t)t.blocks;
    o->block_refs = (uint64_t)t.refs;
    o->bytes = (uint64_t)t.bytes;
    o->budget = st->budget;
    struct { const char *name; uint64_t *dst, pending; } c[] = {
        {"lookups", &o->lookups, st->lookups}, {"hits", &o->hits, st->hits}, {"misses", &o->misses, st->misses},
        {"saves", &o->saves, 0}, {"evictions", &o->evictions, 0}, {"damaged", &o->damaged, 0},
        {"save_errors", &o->save_errors, st->save_errors},
    };
    sqlite3_stmt *stmt = prep(st, "SELECT value FROM counters WHERE name = ?", "stats");
    for (size_t i = 0; i < sizeof c / sizeof c[0] && stmt; i++) {
        *c[i].dst = c[i].pending;
        sqlite3_reset(stmt);
        sqlite3_bind_text(stmt, 1, c[i].name, -1, SQLITE_STATIC);
        if (step(st, stmt, "stats") == SQLITE_ROW) *c[i].dst += (uint64_t)sqlite3_column_int64(stmt, 0);
    }
    sqlite3_finalize(stmt);
    return sql_status(st);
}

static int store_list(kvt_store *st, kvt_store_entry **out, size_t *n)
{
    *out = NULL;
    *n = 0;
    int64_t count = q_int(st, "SELECT COUNT(*) FROM snaps", 0, NULL, 0);
    if (st->sql_rc) return sql_status(st);
    size_t cap = (count > 0 ? (size_t)count : 0) + 1, k = 0;
    kvt_store_entry *e = kvt_calloc(cap, sizeof *e);
    if (!e) return KVT_ENOMEM;
    sqlite3_stmt *stmt = prep(st, "SELECT id, model, bytes, hits, n_tokens, n_blocks, created, used_at, reason, preview,"
                                  " (SELECT COUNT(*) FROM snap_blocks sb JOIN blocks b ON b.key = sb.key"
                                  "   WHERE sb.snap = snaps.id AND b.refs > 1)"
                                  ", replay"
                                  " FROM snaps ORDER BY last_used DESC", NULL);
    while (step(st, stmt, NULL) == SQLITE_ROW) {
        int rc; /* another connection may have added entries since the count */
        KVT_GROW(e, &cap, k + 1, rc);
        if (rc) {
            sqlite3_finalize(stmt);
            free(e);
            return rc;
        }
        kvt_store_entry *x = &e[k++];
        memset(x, 0, sizeof *x);
        x->id = sqlite3_column_int64(stmt, 0);
        x->model = (uint64_t)sqlite3_column_int64(stmt, 1);
        x->bytes = (uint64_t)sqlite3_column_int64(stmt, 2);
        x->hits = (uint64_t)sqlite3_column_int64(stmt, 3);
        x->n_tokens = (uint32_t)sqlite3_column_int64(stmt, 4);
        x->n_blocks = (uint32_t)sqlite3_column_int64(stmt, 5);
        x->created = sqlite3_column_double(stmt, 6);
        x->used_at = sqlite3_column_double(stmt, 7);
        const char *reason = (const char *)sqlite3_column_text(stmt, 8);
        const char *preview = (const char *)sqlite3_column_text(stmt, 9);
        snprintf(x->reason, sizeof x->reason, "%s", reason ? reason : "");
        snprintf(x->preview, sizeof x->preview, "%s", preview ? preview : "");
        x->shared_blocks = (uint32_t)sqlite3_column_int64(stmt, 10);
        x->replay = sqlite3_column_int64(stmt, 11) != 0;
    }
    sqlite3_finalize(stmt);
    if (st->sql_rc) {
        free(e);
        return sql_status(st);
    }
    *out = e;
    *n = k;
    return KVT_OK;
}

static int store_text(kvt_store *st, int64_t id, char **text, size_t *len)
{
    sqlite3_stmt *stmt = NULL, *blk = NULL;
    int r = q(st, &stmt, st->has_segs ? "SELECT data, rseg, roff, bytes FROM snaps WHERE id = ?"
                                      : "SELECT data, NULL, NULL, bytes FROM snaps WHERE id = ?", 1, &id);
    if (r != SQLITE_ROW) return st->sql_rc ? sql_status(st) : kvt_fail(KVT_ENOENT, "no cache entry %lld", (long long)id);
    kvt_snap_info in;
    kvt_wbuf out = {0};
    uint8_t *rbuf = NULL;
    size_t rcap = 0, rlen = 0;
    const uint8_t *rp = NULL;
    int rc = row_record(st, stmt, 0, 3, &rbuf, &rcap, &rp, &rlen);
    if (!rc) rc = rp ? kvt_snap_parse_raw(rp, rlen, &in) : kvt_fail(KVT_EFORMAT, "snapshot: empty record");
    if (!rc && !(blk = prep(st, block_row_sql(st), NULL))) rc = sql_status(st);
    uint8_t *scratch = NULL;
    size_t scratch_cap = 0;
    /* the prefix's text: every block's text, then the tail's */
    for (uint32_t b = 0; !rc && b < in.nb; b++) {
        sqlite3_reset(blk);
        sqlite3_bind_int64(blk, 1, (int64_t)kvt_rd64(in.sec[6] + 8 * (size_t)b));
        const uint8_t *t;
        size_t tl;
        int s = step(st, blk, NULL);
        bloc w;
        if (s != SQLITE_ROW) rc = s == SQLITE_DONE ? kvt_fail(KVT_EFORMAT, "block %u is missing", b) : sql_status(st);
        else if (!row_bloc(blk, 2, 3, 0, &w)) rc = kvt_fail(KVT_EFORMAT, "block %u: its row's place is out of range", b);
        else if (w.seg && (rc = read_bloc_into(st, &w, NULL, &scratch, &scratch_cap))) {
        } else if (!(rc = w.seg ? kvt_snap_block_text(scratch, (size_t)w.bytes, &t, &tl)
                                : kvt_snap_block_text(sqlite3_column_blob(blk, 1), (size_t)sqlite3_column_bytes(blk, 1),
                                                      &t, &tl)))
            kvt_wbuf_put(&out, t, tl);
    }
    free(scratch);
    if (!rc) {
        size_t n;
        const uint8_t *t = kvt_snap_text(&in, &n);
        kvt_wbuf_put(&out, t, n);
        kvt_wbuf_put(&out, "", 1);
        if (out.oom) rc = kvt_fail(KVT_ENOMEM, "text");
    }
    sqlite3_finalize(blk);
    sqlite3_finalize(stmt);
    free(rbuf);
    if (rc) { kvt_wbuf_free(&out); return rc; }
    *text = (char *)out.p;
    *len = out.len - 1;
    return KVT_OK;
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
    op_start(st, name);
    int rc = follow(st);
    if (!rc && !st->db) rc = kvt_fail(KVT_EIO, "cache store %s is unavailable", st->path);
    if (!rc && writes && st->inspect) rc = kvt_fail(KVT_EINVAL, "cache store %s is open to inspect only", st->path);
    return rc;
}

static int enter(kvt_store *st, const char *name, bool writes)
{
    pthread_mutex_lock(&st->mu);
    return enter_locked(st, name, writes);
}

static int leave(kvt_store *st, int rc)
{
    if (st->corrupt && !st->inspect) {
        char why[512];
        snprintf(why, sizeof why, "%s", kvt_errmsg());
        recover(st);
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
    if (!rc && (rc = store_save(st, s, n, reason, id_out, created)) && rebuilt(st))
        rc = store_save(st, s, n, reason, id_out, created);
    return leave(st, rc);
}

int kvt_store_lookup(kvt_store *st, const kvt_model *m, const int32_t *tokens, size_t n, size_t *match, int64_t *id)
{
    *match = 0;
    *id = -1;
    int rc = enter(st, "lookup", false);
    if (!rc && (rc = store_lookup(st, m, tokens, n, match, id)) && rebuilt(st))
        rc = store_lookup(st, m, tokens, n, match, id);
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
            busy_seen = false;
            rc = store_lookup(st, m, tokens, n, match, id);
            if (st->db) sqlite3_busy_timeout(st->db, st->busy_ms);
        }
        bool busy = rc && busy_seen;
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
    bool b = busy_seen;
    if (clear) busy_seen = false;
    return b;
}

int kvt_store_load(kvt_store *st, int64_t id, kvt_session *s)
{
    int rc = enter(st, "load", false);
    if (!rc && (rc = store_load(st, id, s)) == KVT_EIO && rebuilt(st)) rc = store_load(st, id, s);
    return leave(st, rc);
}

int kvt_store_restore_prefix(kvt_store *st, kvt_session *s, const int32_t *tokens, size_t n, size_t *reused)
{
    *reused = 0;
    int rc = enter(st, "restore", false);
    if (!rc) {
        rc = store_restore_prefix(st, s, tokens, n, reused);
    } else if (rc != KVT_ENOMEM) { /* a miss (kvtier.h) */
        if (!st->quiet) fprintf(stderr, "kvtier: %s (a miss)\n", kvt_errmsg());
        rc = KVT_OK;
    }
    return leave(st, rc);
}

int kvt_store_rm(kvt_store *st, int64_t id)
{
    int rc = enter(st, "rm", true);
    if (!rc && (rc = store_rm(st, id)) && rebuilt(st)) rc = store_rm(st, id);
    return leave(st, rc);
}

int kvt_store_gc(kvt_store *st)
{
    int rc = enter(st, "gc", true);
    if (!rc && (rc = store_gc(st)) && rebuilt(st)) rc = store_gc(st);
    return leave(st, rc);
}

int kvt_store_verify(kvt_store *st, size_t *bad, size_t *checked)
{
    *bad = *checked = 0;
    int rc = enter(st, "verify", false);
    if (!rc) rc = store_verify(st, bad, checked);
    return leave(st, rc);
}

int kvt_store_integrity(kvt_store *st, size_t *problems, char **report)
{
    *problems = 0;
    if (report) *report = NULL;
    int rc = enter(st, "integrity check", false);
    if (!rc) rc = store_integrity(st, problems, report);
    return leave(st, rc);
}

int kvt_store_stats_get(kvt_store *st, kvt_store_stats *o)
{
    memset(o, 0, sizeof *o);
    int rc = enter(st, "stats", false);
    if (!rc && (rc = store_stats_get(st, o)) && rebuilt(st)) rc = store_stats_get(st, o);
    return leave(st, rc);
}

int kvt_store_list(kvt_store *st, kvt_store_entry **out, size_t *n)
{
    *out = NULL;
    *n = 0;
    int rc = enter(st, "ls", false);
    if (!rc && (rc = store_list(st, out, n)) && rebuilt(st)) rc = store_list(st, out, n);
    return leave(st, rc);
}

int kvt_store_text(kvt_store *st, int64_t id, char **text, size_t *len)
{
    int rc = enter(st, "show", false);
    if (!rc && (rc = store_text(st, id, text, len)) == KVT_EIO && rebuilt(st)) rc = store_text(st, id, text, len);
    return leave(st, rc);
}

int kvt_store_set_synchronous(kvt_store *st, bool on)
{
    int rc = enter(st, "synchronous", true);
    if (!rc) {
        st->durable = on;
        rc = exec(st, on ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=OFF");
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
        totals a, b;
        get_totals(st, &a);
        read_totals(st, totals_sum, &b);
        *recorded = (kvt_store_stats){.snapshots = (uint64_t)a.snaps, .blocks = (uint64_t)a.blocks,
                                      .block_refs = (uint64_t)a.refs, .bytes = (uint64_t)a.bytes};
        *counted = (kvt_store_stats){.snapshots = (uint64_t)b.snaps, .blocks = (uint64_t)b.blocks,
                                     .block_refs = (uint64_t)b.refs, .bytes = (uint64_t)b.bytes};
        rc = sql_status(st);
    }
    return leave(st, rc);
}
