/* The disk tier's database (db.h): the connection and its schema, the
 * SQLite calls and their failure rule, write transactions, and the places
 * of records in segment files with the checks of a row against its record.
 * store.c runs the operations on it, recovery.c rebuilds it when SQLite
 * finds it damaged. See store.c for the design as a whole.
 */
#include "store/db.h"
#include "cache/cache.h"
#include "store/storedir.h"
#include "base/util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

static void release_freed(kvt_store *st);

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
_Thread_local bool kvt_db_busy_seen;

/* Note SQLite result rc of a failed call (what: the step, or NULL for the
 * operation); returns KVT_EIO with the kept failure's message. */
int kvt_db_sql_note(kvt_store *st, int rc, const char *what)
{
    if (is_damage(rc)) st->corrupt = true;
    if ((rc & 0xff) == SQLITE_FULL) st->full = true;
    if ((rc & 0xff) == SQLITE_BUSY || (rc & 0xff) == SQLITE_LOCKED) kvt_db_busy_seen = true;
    if (!st->sql_rc) {
        st->sql_rc = rc;
        snprintf(st->sql_msg, sizeof st->sql_msg, "cache store: %s: %s", what ? what : st->op ? st->op : "query",
                 (rc & 0xff) == SQLITE_FULL ? "disk full" : st->db ? sqlite3_errmsg(st->db) : sqlite3_errstr(rc));
    }
    return kvt_fail(KVT_EIO, "%s", st->sql_msg);
}

/* The operation's SQLite failure, if it met one, as its result. */
int kvt_db_sql_status(const kvt_store *st)
{
    return st->sql_rc ? kvt_fail(KVT_EIO, "%s", st->sql_msg) : KVT_OK;
}

/* Damage met while inspecting (verify, gc's checks) is a finding, not the
 * end of the inspection: forget it (st->corrupt stays set) and go on. True
 * when the kept failure was damage; any other failure is kept. */
bool kvt_db_forget_damage(kvt_store *st)
{
    if (!st->sql_rc || !is_damage(st->sql_rc)) return false;
    st->sql_rc = 0;
    return true;
}

/* The same for a statement an inspection cannot prepare or finish because
 * of what the file holds: damage, or a header or schema SQLite does not
 * accept (SQLITE_ERROR, such as "unsupported file format"). */
bool kvt_db_forget_finding(kvt_store *st)
{
    if (st->sql_rc && ((st->sql_rc & 0xff) == SQLITE_ERROR || (st->sql_rc & 0xff) == SQLITE_FORMAT)) {
        st->sql_rc = 0;
        return true;
    }
    return kvt_db_forget_damage(st);
}

sqlite3_stmt *kvt_db_prep(kvt_store *st, const char *sql, const char *what)
{
    sqlite3_stmt *stmt = NULL;
    if (st->sql_rc) return NULL;
    int rc = sqlite3_prepare_v2(st->db, sql, -1, &stmt, NULL);
    if (rc != SQLITE_OK) {
        kvt_db_sql_note(st, rc, what);
        sqlite3_finalize(stmt);
        return NULL;
    }
    return stmt;
}

/* SQLITE_ROW, SQLITE_DONE or a failure (noted; also when a failure came
 * before). */
int kvt_db_step(kvt_store *st, sqlite3_stmt *stmt, const char *what)
{
    if (st->sql_rc || !stmt) return st->sql_rc ? st->sql_rc : SQLITE_MISUSE;
    int rc = sqlite3_step(stmt);
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) kvt_db_sql_note(st, rc, what);
    return rc;
}

int kvt_db_exec(kvt_store *st, const char *sql)
{
    int rc = sqlite3_exec(st->db, sql, NULL, NULL, NULL);
    return rc == SQLITE_OK ? KVT_OK : kvt_db_sql_note(st, rc, NULL);
}

/* End a transaction without its changes (a read, or a write that failed). */
void kvt_db_rollback(kvt_store *st)
{
    /* the segment's bytes this transaction appended go, while its write
     * lock still keeps other writers out */
    if (st->seg_wrote && st->db && !sqlite3_get_autocommit(st->db))
        kvt_segs_truncate(st->segs, st->seg_cur, st->seg_cut_at);
    if (st->db && !sqlite3_get_autocommit(st->db)) {
        int rc = sqlite3_exec(st->db, "ROLLBACK", NULL, NULL, NULL);
        if (rc != SQLITE_OK) kvt_db_sql_note(st, rc, "rollback");
    }
    st->n_gone = 0;
    st->n_freed = 0;
    st->seg_open = st->seg_wrote = false;
    memset(st->flushing, 0, sizeof st->flushing);
}

int kvt_db_begin(kvt_store *st)
{
    st->n_gone = 0;
    st->n_freed = 0;
    st->seg_open = st->seg_wrote = false;
    memset(st->flushing, 0, sizeof st->flushing);
    return kvt_db_exec(st, "BEGIN IMMEDIATE");
}


/* Commit a write transaction. One that met a failure, or cannot commit, is
 * rolled back, so the connection is never left inside it. Once it commits,
 * the snapshots it removed leave the index and the counters it wrote leave
 * memory. */
int kvt_db_commit(kvt_store *st)
{
    /* the rows it commits name only bytes the disk holds */
    if (!st->sql_rc && st->seg_wrote && st->durable && kvt_segs_sync(st->segs) != KVT_OK) {
        char why[400];
        snprintf(why, sizeof why, "%s", kvt_errmsg());
        kvt_db_rollback(st);
        return kvt_fail(KVT_EIO, "%s", why);
    }
    if (!st->sql_rc) kvt_db_exec(st, "COMMIT");
    if (st->sql_rc) {
        kvt_db_rollback(st);
        return kvt_db_sql_status(st);
    }
    st->seg_open = st->seg_wrote = false;
    for (size_t i = 0; i < st->n_gone; i++) kvt_db_index_remove(st, st->gone[i]);
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
int kvt_db_q(kvt_store *st, sqlite3_stmt **out, const char *sql, int n, const int64_t *args)
{
    sqlite3_stmt *stmt = kvt_db_prep(st, sql, NULL);
    if (!stmt) return st->sql_rc;
    for (int i = 0; i < n; i++) sqlite3_bind_int64(stmt, i + 1, args[i]);
    int rc = kvt_db_step(st, stmt, NULL);
    if (out && rc == SQLITE_ROW) *out = stmt;
    else sqlite3_finalize(stmt);
    return rc;
}

/* The first column of the first row, or def (no row, or a failure, which
 * is noted). */
int64_t kvt_db_q_int(kvt_store *st, const char *sql, int n, const int64_t *args, int64_t def)
{
    sqlite3_stmt *stmt = NULL;
    int64_t v = def;
    if (kvt_db_q(st, &stmt, sql, n, args) == SQLITE_ROW) {
        v = sqlite3_column_int64(stmt, 0);
        sqlite3_finalize(stmt);
    }
    return v;
}

double kvt_db_now_unix(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

void kvt_db_counter_add(kvt_store *st, const char *name, uint64_t v)
{
    if (!v) return;
    sqlite3_stmt *stmt = kvt_db_prep(st, "INSERT INTO counters(name, value) VALUES(?1, ?2) "
                                  "ON CONFLICT(name) DO UPDATE SET value = value + ?2", NULL);
    if (!stmt) return;
    sqlite3_bind_text(stmt, 1, name, -1, SQLITE_STATIC);
    sqlite3_bind_int64(stmt, 2, (int64_t)v);
    kvt_db_step(st, stmt, NULL);
    sqlite3_finalize(stmt);
}

/* Write pending in-memory counters (inside a write transaction; commit
 * takes them out of memory). */
void kvt_db_flush_counters(kvt_store *st)
{
    uint64_t v[4] = {st->lookups, st->hits, st->misses, st->save_errors};
    kvt_db_counter_add(st, "lookups", v[0]);
    kvt_db_counter_add(st, "hits", v[1]);
    kvt_db_counter_add(st, "misses", v[2]);
    kvt_db_counter_add(st, "save_errors", v[3]);
    memcpy(st->flushing, v, sizeof v);
}

int64_t kvt_db_tick(kvt_store *st)
{
    kvt_db_q(st, NULL, "UPDATE meta SET v = v + 1 WHERE k = 'tick'", 0, NULL);
    return kvt_db_q_int(st, "SELECT v FROM meta WHERE k = 'tick'", 0, NULL, 0);
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

/* Create every table, trigger and index of the current schema in db (a new
 * database: a rebuild's, recovery.c), inside its transaction; the SQLite
 * result. */
int kvt_db_schema_create(sqlite3 *db)
{
    int rc = sqlite3_exec(db, schema, NULL, NULL, NULL);
    if (rc == SQLITE_OK) rc = sqlite3_exec(db, schema_totals, NULL, NULL, NULL);
    if (rc == SQLITE_OK) rc = sqlite3_exec(db, schema_segs, NULL, NULL, NULL);
    return rc;
}

/* Start an operation (name: for messages). */
void kvt_db_op_start(kvt_store *st, const char *name)
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
        if ((rc & 0xff) != SQLITE_ERROR) kvt_db_sql_note(st, rc, "open");
        return false; /* no such table: set it up */
    }
    bool current = false;
    if (kvt_db_step(st, stmt, "open") == SQLITE_ROW) {
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
    st->has_segs = kvt_db_q_int(st, "SELECT (SELECT COUNT(*) FROM pragma_table_info('blocks') WHERE name IN ('seg', 'off'))"
                             " + (SELECT COUNT(*) FROM pragma_table_info('snaps') WHERE name IN ('locs', 'rseg', 'roff'))",
                         0, NULL, 0) == 5;
    kvt_db_forget_finding(st);
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
        rc = kvt_db_sql_note(st, rc, "open");
        sqlite3_close(st->db);
        st->db = NULL;
        return rc;
    }
    return KVT_OK;
}

int kvt_db_open(kvt_store *st)
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
        rc = kvt_db_sql_note(st, rc, "open");
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
            return kvt_db_sql_note(st, sqlite3_errcode(st->db), "open");
        if ((rc = inspect_fallback(st))) return rc;
        note_columns(st);
        return KVT_OK;
    }
    if ((rc = kvt_db_exec(st, "PRAGMA journal_mode=WAL")) || (rc = kvt_db_exec(st, "PRAGMA wal_autocheckpoint=" KVT_STR(WAL_PAGES))) ||
        (rc = kvt_db_exec(st, "PRAGMA journal_size_limit=" KVT_STR(WAL_LIMIT))) ||
        (rc = kvt_db_exec(st, st->durable ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=OFF"))) {
        unusable_header(st);
        return rc;
    }
    int64_t ver = -1;
    if (!schema_is_current(st, &ver)) {
        if (st->sql_rc || (rc = kvt_db_begin(st))) {
            unusable_header(st);
            return kvt_db_sql_status(st);
        }
        kvt_db_exec(st, schema);
        /* snaps.replay (the record has no state section) came after the first
         * stores: add it where it is missing. Builds that predate it ignore it
         * and write whole records, which its default describes. */
        if (kvt_db_q_int(st, "SELECT COUNT(*) FROM pragma_table_info('snaps') WHERE name = 'replay'", 0, NULL, 1) == 0)
            kvt_db_exec(st, "ALTER TABLE snaps ADD COLUMN replay INTEGER NOT NULL DEFAULT 0");
        if (kvt_db_q_int(st, "SELECT COUNT(*) FROM pragma_table_info('snaps') WHERE name = 'locs'", 0, NULL, 1) == 0) {
            kvt_db_exec(st, "ALTER TABLE snaps ADD COLUMN locs BLOB");
            kvt_db_exec(st, "ALTER TABLE snaps ADD COLUMN rseg INTEGER");
            kvt_db_exec(st, "ALTER TABLE snaps ADD COLUMN roff INTEGER");
        }
        if (kvt_db_q_int(st, "SELECT COUNT(*) FROM pragma_table_info('blocks') WHERE name = 'seg'", 0, NULL, 1) == 0) {
            kvt_db_exec(st, "ALTER TABLE blocks ADD COLUMN seg INTEGER");
            kvt_db_exec(st, "ALTER TABLE blocks ADD COLUMN off INTEGER");
        }
        kvt_db_exec(st, schema_totals);
        kvt_db_exec(st, schema_segs);
        ver = kvt_db_q_int(st, "SELECT v FROM meta WHERE k = 'schema'", 0, NULL, -1);
        if ((rc = kvt_db_commit(st))) {
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
void kvt_db_close(kvt_store *st, bool keep_files)
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
bool kvt_db_same_file(const kvt_store *st)
{
    struct stat sb;
    return stat(st->path, &sb) == 0 && sb.st_dev == st->dev && sb.st_ino == st->ino;
}

/* Another process rebuilt a damaged database (recovery.c) under this one:
 * leave the old file and open the new one. A missing file is someone's
 * rebuild in progress: the old connection serves until it is done. */
int kvt_db_follow(kvt_store *st)
{
    struct stat sb;
    if (st->inspect || !st->db || stat(st->path, &sb) != 0 || (sb.st_dev == st->dev && sb.st_ino == st->ino))
        return KVT_OK;
    kvt_db_close(st, true);
    kvt_segs_close_all(st->segs);
    return kvt_db_open(st);
}



void kvt_db_idset_add(idset *s, int64_t x)
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
void kvt_db_idset_seal(idset *s)
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
void kvt_db_snap_ids(kvt_store *st, idset *ids, bool report)
{
    static const char *const sqls[2] = {"SELECT id FROM snaps NOT INDEXED",
                                        "SELECT id FROM snaps INDEXED BY sqlite_autoindex_snaps_1"};
    for (int k = 0; k < 2 && !st->sql_rc; k++) {
        sqlite3_stmt *stmt = kvt_db_prep(st, sqls[k], k ? "snapshot index" : "snapshots");
        while (stmt && kvt_db_step(st, stmt, k ? "snapshot index" : "snapshots") == SQLITE_ROW)
            kvt_db_idset_add(ids, sqlite3_column_int64(stmt, 0));
        sqlite3_finalize(stmt);
        if (kvt_db_forget_damage(st) && report && !st->quiet) fprintf(stderr, "kvtier: %s\n", st->sql_msg);
    }
}


/* ---- where blocks are ---- */


/* The place a row's seg, off and bytes columns (cs, co, cb) say, checked:
 * false when they cannot be a block's. A row with a NULL seg keeps its
 * record in its data column (w->seg = 0). */
bool kvt_db_row_bloc(sqlite3_stmt *r, int cs, int co, int cb, bloc *w)
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
bool kvt_db_locs_at(const uint8_t *locs, size_t b, bloc *w)
{
    const uint8_t *p = locs + LOC_BYTES * b;
    *w = (bloc){kvt_rd32(p), kvt_rd64(p + 8), kvt_rd32(p + 4)};
    return w->bytes > 0 && w->off <= (uint64_t)INT64_MAX - w->bytes;
}

void kvt_db_locs_put(kvt_wbuf *b, const bloc *w)
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
int kvt_db_read_bloc_into(kvt_store *st, const bloc *w, const kvt_block_rows *rows, uint8_t **buf, size_t *cap)
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
void kvt_db_delete_placed(kvt_store *st, const char *sql, int n, const int64_t *args)
{
    sqlite3_stmt *stmt = kvt_db_prep(st, sql, NULL);
    if (!stmt) return;
    for (int i = 0; i < n; i++) sqlite3_bind_int64(stmt, i + 1, args[i]);
    while (kvt_db_step(st, stmt, NULL) == SQLITE_ROW) {
        bloc w;
        if (!kvt_db_row_bloc(stmt, 0, 1, 2, &w) || !w.seg || st->keep_places) continue;
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
void kvt_db_coalesce(bloc *v, size_t *n)
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
    kvt_db_coalesce(st->freed, &st->n_freed);
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
    int64_t cur = kvt_db_q_int(st, "SELECT v FROM meta WHERE k = 'seg'", 0, NULL, 1);
    if (st->sql_rc) return kvt_db_sql_status(st);
    if (cur < 1 || cur > UINT32_MAX) cur = 1;
    for (;;) {
        int64_t e = kvt_db_q_int(st, "SELECT MAX(COALESCE((SELECT off + bytes FROM blocks WHERE seg = ?1 ORDER BY off DESC LIMIT 1), 0),"
                              " COALESCE((SELECT roff + bytes FROM snaps WHERE rseg = ?1 ORDER BY roff DESC LIMIT 1), 0))",
                          1, &cur, 0);
        if (st->sql_rc) return kvt_db_sql_status(st);
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
        kvt_db_q(st, NULL, "INSERT OR REPLACE INTO meta(k, v) VALUES('seg', ?)", 1, &cur);
        if (st->sql_rc) return kvt_db_sql_status(st);
    }
}

/* Append a record to the current segment inside a write transaction; *w
 * receives its place. commit syncs the segment first; rollback cuts it
 * back. */
int kvt_db_seg_appendv(kvt_store *st, const struct iovec *iov, int n, void (*seen)(void *, const void *, size_t),
                       void *arg, bloc *w)
{
    int rc;
    if (!st->seg_open) {
        if ((rc = open_segment(st, &st->seg_cur, &st->seg_end))) return rc;
        st->seg_open = true;
        st->seg_cut_at = st->seg_end;
    }
    st->seg_wrote = true;
    if ((rc = kvt_segs_writev(st->segs, st->seg_cur, st->seg_end, iov, n, seen, arg))) {
        if (kvt_segs_took_full(st->segs)) st->full = true;
        return rc;
    }
    size_t len = 0;
    for (int i = 0; i < n; i++) len += iov[i].iov_len;
    *w = (bloc){st->seg_cur, st->seg_end, len};
    st->seg_end += len;
    return KVT_OK;
}

int kvt_db_seg_append(kvt_store *st, const void *p, size_t len, bloc *w)
{
    struct iovec v = {(void *)p, len};
    return kvt_db_seg_appendv(st, &v, 1, NULL, NULL, w);
}

/* The record of a snapshot row whose data, rseg, roff and bytes columns
 * are cd, cd + 1, cd + 2 and cb: in its segment (read into *buf, of *cap
 * bytes) or in its data. */
int kvt_db_row_record(kvt_store *st, sqlite3_stmt *r, int cd, int cb, uint8_t **buf, size_t *cap, const uint8_t **p,
                      size_t *len)
{
    bloc w;
    if (!kvt_db_row_bloc(r, cd + 1, cd + 2, cb, &w)) {
        if (sqlite3_column_type(r, cd + 1) != SQLITE_NULL)
            return kvt_fail(KVT_EFORMAT, "snapshot: its row's place or size is out of range");
        w.seg = 0;
    }
    *p = sqlite3_column_blob(r, cd);
    *len = (size_t)sqlite3_column_bytes(r, cd);
    if (!w.seg) return KVT_OK;
    if (*len) return kvt_fail(KVT_EFORMAT, "snapshot: a segment's record with bytes in its row too");
    int rc = kvt_db_read_bloc_into(st, &w, NULL, buf, cap);
    if (rc) return rc;
    *p = *buf;
    *len = (size_t)w.bytes;
    return KVT_OK;
}

/* ---- records of a newer format ----
 *
 * A store shared with a newer kvtier holds records this build cannot
 * read: kept for the release that wrote them, never removed as damaged.
 * What this build can still check of them is the envelope every version
 * has had (docs/STORE.md, docs/FORMAT.md): a snapshot record's 64-byte header with the
 * section count at 56, its section table (offset, length, XXH3-64 of each
 * section) and the XXH3-64 of header and table after it; a block record's
 * XXH3-64 of everything before its last 8 bytes. The version is inside
 * what those checksums cover, so a flipped byte that makes a record look
 * newer fails them: a newer record that fails its envelope (cut short, a
 * flipped byte) is damaged like any other. */

int kvt_db_newer_snap(const uint8_t *p, size_t len)
{
    if (!p || len < 12 || memcmp(p, "KVTSNAP\0", 8) || kvt_rd32(p + 8) <= KVT_SNAP_VERSION_MAX) return KVT_OK;
    uint32_t v = kvt_rd32(p + 8);
    if (len < 64 + 8) return kvt_fail(KVT_EFORMAT, "snapshot: format version %u (newer), %zu bytes: shorter than its header", v, len);
    uint32_t nsec = kvt_rd32(p + 56);
    if (nsec == 0 || nsec > (len - 64 - 8) / 24)
        return kvt_fail(KVT_EFORMAT, "snapshot: format version %u (newer): %u sections do not fit %zu bytes", v, nsec, len);
    size_t hdr = 64 + (size_t)nsec * 24 + 8;
    if (XXH3_64bits(p, hdr - 8) != kvt_rd64(p + hdr - 8))
        return kvt_fail(KVT_ECORRUPT, "snapshot: format version %u (newer): header checksum mismatch", v);
    for (uint32_t i = 0; i < nsec; i++) {
        const uint8_t *e = p + 64 + (size_t)i * 24;
        uint64_t so = kvt_rd64(e), sl = kvt_rd64(e + 8);
        if (so < hdr || so > len || sl > len - so)
            return kvt_fail(KVT_EFORMAT, "snapshot: format version %u (newer): section %u at %llu+%llu outside %zu bytes", v,
                            i + 1, (unsigned long long)so, (unsigned long long)sl, len);
        if (XXH3_64bits(p + so, sl) != kvt_rd64(e + 16))
            return kvt_fail(KVT_ECORRUPT, "snapshot: format version %u (newer): checksum mismatch in section %u", v, i + 1);
    }
    return KVT_DB_NEWER;
}

int kvt_db_newer_block(const uint8_t *p, size_t len)
{
    if (!p || len < 12 || memcmp(p, "KVTBLK\0\0", 8) || kvt_rd32(p + 8) <= KVT_SNAP_VERSION) return KVT_OK;
    uint32_t v = kvt_rd32(p + 8);
    if (len < 48 + 8) return kvt_fail(KVT_EFORMAT, "block: format version %u (newer), %zu bytes: shorter than its header", v, len);
    if (XXH3_64bits(p, len - 8) != kvt_rd64(p + len - 8))
        return kvt_fail(KVT_ECORRUPT, "block: format version %u (newer): checksum mismatch", v);
    return KVT_DB_NEWER;
}

/* A snapshot row (SNAP_COLS from column c0 on) against its record p (len
 * bytes): the record's own checks, and the columns that lookups and the
 * budget read agree with it (a valid record of another snapshot at the
 * row's place is refused). */
int kvt_db_snap_row_agrees(sqlite3_stmt *r, int c0, const uint8_t *p, size_t len, kvt_snap_info *in)
{
    if (!p) return kvt_fail(KVT_EFORMAT, "snapshot: empty record");
    int rc = kvt_db_newer_snap(p, len);
    if (rc) { /* the envelope is all this build reads of it: its version, and its length against its row */
        memset(in, 0, sizeof *in);
        in->version = kvt_rd32(p + 8);
        if (rc == KVT_DB_NEWER && sqlite3_column_int64(r, c0 + 6) != (int64_t)len)
            return kvt_fail(KVT_EFORMAT, "snapshot: its row disagrees with its record");
        return rc;
    }
    rc = kvt_snap_parse_raw(p, len, in);
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
int kvt_db_check_snap_row(kvt_store *st, sqlite3_stmt *r, int c0, kvt_snap_info *in, uint8_t **buf, size_t *cap)
{
    const uint8_t *p;
    size_t len;
    int rc = kvt_db_row_record(st, r, c0 + 7, c0 + 6, buf, cap, &p, &len);
    return rc ? rc : kvt_db_snap_row_agrees(r, c0, p, len, in);
}

/* The columns check_snap_row reads (from a store of schema 1 opened to
 * inspect: no places, every record in its row). */

/* The query of a block's row that check_block_row reads. */
const char *kvt_db_block_row_sql(const kvt_store *st)
{
    return st->has_segs ? "SELECT bytes, data, seg, off FROM blocks WHERE key = ?"
                        : "SELECT bytes, data, NULL, NULL FROM blocks WHERE key = ?";
}

/* A block row (bytes, data, seg, off from c0) stored under key: its record,
 * in its segment (read into *buf, of *cap bytes) or in its data. */
int kvt_db_check_block_row(kvt_store *st, sqlite3_stmt *r, int c0, uint64_t key, uint8_t **buf, size_t *cap)
{
    const uint8_t *p = sqlite3_column_blob(r, c0 + 1);
    size_t len = (size_t)sqlite3_column_bytes(r, c0 + 1);
    bloc w;
    if (!kvt_db_row_bloc(r, c0 + 2, c0 + 3, c0, &w)) return kvt_fail(KVT_EFORMAT, "block: its row's place or size is out of range");
    if (w.seg) {
        if (len) return kvt_fail(KVT_EFORMAT, "block: a segment's block with bytes in its row too");
        int rc = kvt_db_read_bloc_into(st, &w, NULL, buf, cap);
        if (rc) return rc;
        p = *buf;
        len = (size_t)w.bytes;
    }
    uint64_t k;
    if (!p) return kvt_fail(KVT_EFORMAT, "block: empty record");
    int rc = kvt_db_newer_block(p, len);
    if (rc == KVT_DB_NEWER && sqlite3_column_int64(r, c0) != (int64_t)len)
        return kvt_fail(KVT_EFORMAT, "block: its row disagrees with its record");
    if (rc) return rc;
    rc = kvt_snap_block_check(p, len, &k);
    if (rc) return rc;
    if (k != key) return kvt_fail(KVT_EMISMATCH, "block stored under another key");
    if (sqlite3_column_int64(r, c0) != (int64_t)len) return kvt_fail(KVT_EFORMAT, "block: its row disagrees with its record");
    return KVT_OK;
}


void kvt_db_index_remove(kvt_store *st, int64_t id)
{
    for (size_t i = 0; i < st->n_idx; i++)
        if (st->idx[i].id == id) {
            memmove(&st->idx[i], &st->idx[i + 1], (st->n_idx - i - 1) * sizeof *st->idx);
            st->n_idx--;
            return;
        }
}

/* ---- the running totals (schema_totals) ---- */

static const char *totals_sum =
    "SELECT (SELECT COALESCE(SUM(bytes), 0) FROM snaps) + (SELECT COALESCE(SUM(bytes), 0) FROM blocks),"
    " (SELECT COUNT(*) FROM snaps), (SELECT COUNT(*) FROM blocks), (SELECT COUNT(*) FROM snap_blocks)";

static bool read_totals(kvt_store *st, const char *sql, kvt_db_totals *t)
{
    memset(t, 0, sizeof *t);
    sqlite3_stmt *stmt = NULL;
    if (kvt_db_q(st, &stmt, sql, 0, NULL) != SQLITE_ROW) return false;
    *t = (kvt_db_totals){sqlite3_column_int64(stmt, 0), sqlite3_column_int64(stmt, 1), sqlite3_column_int64(stmt, 2),
                  sqlite3_column_int64(stmt, 3)};
    sqlite3_finalize(stmt);
    return true;
}

bool kvt_db_has_totals(kvt_store *st)
{
    return kvt_db_q_int(st, "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'totals'", 0, NULL, 0) == 1;
}

bool kvt_db_totals_recorded(kvt_store *st, kvt_db_totals *t)
{
    return read_totals(st, "SELECT bytes, snaps, blocks, refs FROM totals", t);
}

bool kvt_db_totals_counted(kvt_store *st, kvt_db_totals *t) { return read_totals(st, totals_sum, t); }

void kvt_db_totals_get(kvt_store *st, kvt_db_totals *t)
{
    if (st->inspect && !st->sql_rc && !kvt_db_has_totals(st)) kvt_db_totals_counted(st, t);
    else kvt_db_totals_recorded(st, t);
}

bool kvt_db_totals_resync(kvt_store *st, kvt_db_totals *was, kvt_db_totals *now)
{
    kvt_db_totals a, b;
    kvt_db_totals_recorded(st, &a);
    if (!kvt_db_totals_counted(st, &b)) return false;
    if (was) *was = a;
    if (now) *now = b;
    if (!memcmp(&a, &b, sizeof a)) return false;
    kvt_db_q(st, NULL, "DELETE FROM totals", 0, NULL);
    int64_t v[4] = {b.bytes, b.snaps, b.blocks, b.refs};
    kvt_db_q(st, NULL, "INSERT INTO totals(one, bytes, snaps, blocks, refs) VALUES(1, ?, ?, ?, ?)", 4, v);
    return true;
}
