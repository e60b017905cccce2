/* The disk tier: a durable, content-addressed, budgeted store of session
 * snapshots (see kvtier.h and docs/STORE.md).
 *
 * One SQLite database per directory, in WAL mode with synchronous=FULL, so a
 * save is one transaction that is atomic and durable (a crash leaves the old
 * store or the new one), several processes can share the directory, and a
 * full disk fails a save cleanly. SQLite does not checksum its pages, so
 * every record carries its own XXH3 checksums (snapshot.c) and is verified
 * on load.
 *
 *   blocks(key, refs, bytes, data)        one row per distinct 128-token block
 *   snaps(id, model, head, n_tokens, tail, ..., data)
 *   snap_blocks(snap, idx, key)           which blocks a snapshot stands on
 *   counters(name, value), meta(k, v), quarantine(...)
 *
 * Lookup never scans: each process keeps an index of (head key, length,
 * tail hash) for all snapshots, reloaded only when PRAGMA data_version says
 * another connection changed the database. A prompt is hashed once along its
 * 128-token blocks; each block boundary is probed in the index, longest
 * first, and a candidate's tail is hashed only when its head matches.
 *
 * Eviction is least-recently-used over snapshots (a logical clock, not wall
 * time, orders uses); removing a snapshot releases its blocks, and a block
 * is freed only when no snapshot references it. The snapshot just written is
 * never the one evicted.
 */
#include "snapshot.h"
#include "store.h"
#include "model.h"
#include "util.h"

#include <errno.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <time.h>

#define SCHEMA_VERSION 1
#define DEFAULT_BUDGET (4096ull << 20)

typedef struct ientry { uint64_t head, tail; uint32_t n; int64_t id; } ientry;

struct kvt_store {
    pthread_mutex_t mu;      /* the server's worker and its metrics reader share a store */
    sqlite3 *db;
    char *dir;
    uint64_t budget;
    bool quiet;
    bool durable;            /* synchronous=FULL (off only while a benchmark populates) */
    ientry *idx;             /* (n_idx) sorted by head */
    size_t n_idx;
    int64_t skip[64];        /* entries of a newer format: kept for the build that wrote them, */
    size_t n_skip;           /* passed over by this one's lookups */
    int64_t data_version;
    bool dirty;              /* our own writes since the index was built */
    /* counters not yet written to the database */
    uint64_t lookups, hits, misses, save_errors;
};

static int sql_fail(kvt_store *st, const char *what)
{
    int code = sqlite3_errcode(st->db);
    return kvt_fail(KVT_EIO, "cache store: %s: %s", what, code == SQLITE_FULL ? "disk full" : sqlite3_errmsg(st->db));
}

static int exec(kvt_store *st, const char *sql)
{
    char *err = NULL;
    if (sqlite3_exec(st->db, sql, NULL, NULL, &err) != SQLITE_OK) {
        int rc = kvt_fail(KVT_EIO, "cache store: %s", err ? err : "error");
        sqlite3_free(err);
        return rc;
    }
    return KVT_OK;
}

/* Commit a write transaction; one that cannot commit is rolled back, so the
 * connection is never left inside it. */
static int commit(kvt_store *st)
{
    int rc = exec(st, "COMMIT");
    if (rc) {
        char why[512];
        snprintf(why, sizeof why, "%s", kvt_errmsg());
        exec(st, "ROLLBACK");
        rc = kvt_fail(rc, "%s", why);
    }
    return rc;
}

/* Prepare, bind int64 parameters, step once. Returns the sqlite3 result; a
 * row, when there is one, is left in *out (finalize it). */
static int q(kvt_store *st, sqlite3_stmt **out, const char *sql, int n, const int64_t *args)
{
    sqlite3_stmt *stmt = NULL;
    int rc = sqlite3_prepare_v2(st->db, sql, -1, &stmt, NULL);
    if (rc != SQLITE_OK) return rc;
    for (int i = 0; i < n; i++) sqlite3_bind_int64(stmt, i + 1, args[i]);
    rc = sqlite3_step(stmt);
    if (out && rc == SQLITE_ROW) *out = stmt;
    else sqlite3_finalize(stmt);
    return rc;
}

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

static bool q_ok(int rc) { return rc == SQLITE_DONE || rc == SQLITE_ROW; }

static double now_unix(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void counter_add(kvt_store *st, const char *name, uint64_t v)
{
    if (!v) return;
    sqlite3_stmt *stmt = NULL;
    if (sqlite3_prepare_v2(st->db,
                           "INSERT INTO counters(name, value) VALUES(?1, ?2) "
                           "ON CONFLICT(name) DO UPDATE SET value = value + ?2", -1, &stmt, NULL) == SQLITE_OK) {
        sqlite3_bind_text(stmt, 1, name, -1, SQLITE_STATIC);
        sqlite3_bind_int64(stmt, 2, (int64_t)v);
        sqlite3_step(stmt);
    }
    sqlite3_finalize(stmt);
}

/* Write pending in-memory counters (inside a write transaction). */
static void flush_counters(kvt_store *st)
{
    counter_add(st, "lookups", st->lookups);
    counter_add(st, "hits", st->hits);
    counter_add(st, "misses", st->misses);
    counter_add(st, "save_errors", st->save_errors);
    st->lookups = st->hits = st->misses = st->save_errors = 0;
}

static int64_t tick(kvt_store *st)
{
    q(st, NULL, "UPDATE meta SET v = v + 1 WHERE k = 'tick'", 0, NULL);
    return q_int(st, "SELECT v FROM meta WHERE k = 'tick'", 0, NULL, 0);
}

static const char *schema =
    "CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS blocks(key INTEGER PRIMARY KEY, refs INTEGER NOT NULL,"
    "  bytes INTEGER NOT NULL, data BLOB NOT NULL);"
    "CREATE TABLE IF NOT EXISTS snaps(id INTEGER PRIMARY KEY AUTOINCREMENT, model INTEGER NOT NULL,"
    "  head INTEGER NOT NULL, n_tokens INTEGER NOT NULL, tail INTEGER NOT NULL, n_blocks INTEGER NOT NULL,"
    "  reason TEXT NOT NULL, created REAL NOT NULL, last_used INTEGER NOT NULL, used_at REAL NOT NULL,"
    "  hits INTEGER NOT NULL DEFAULT 0, bytes INTEGER NOT NULL, preview TEXT NOT NULL, data BLOB NOT NULL,"
    "  replay INTEGER NOT NULL DEFAULT 0, UNIQUE(head, n_tokens, tail));"
    "CREATE TABLE IF NOT EXISTS snap_blocks(snap INTEGER NOT NULL, idx INTEGER NOT NULL, key INTEGER NOT NULL,"
    "  PRIMARY KEY(snap, idx)) WITHOUT ROWID;"
    "CREATE TABLE IF NOT EXISTS counters(name TEXT PRIMARY KEY, value INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS quarantine(id INTEGER PRIMARY KEY, what TEXT NOT NULL, reason TEXT NOT NULL,"
    "  at REAL NOT NULL);"
    "INSERT OR IGNORE INTO meta(k, v) VALUES('schema', 1), ('tick', 0);";

static int mkdirs(const char *dir)
{
    char *p = kvt_strndup(dir, strlen(dir));
    if (!p) return KVT_ENOMEM;
    for (char *c = p + 1; ; c++) {
        if (*c == '/' || *c == 0) {
            char save = *c;
            *c = 0;
            if (mkdir(p, 0755) != 0 && errno != EEXIST) {
                int rc = kvt_fail(KVT_EIO, "cache store: cannot create %s: %s", p, strerror(errno));
                free(p);
                return rc;
            }
            *c = save;
            if (!save) break;
        }
    }
    free(p);
    return KVT_OK;
}

static int open_db(kvt_store *st, const char *path)
{
    if (sqlite3_open_v2(path, &st->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, NULL) != SQLITE_OK)
        return sql_fail(st, "open");
    sqlite3_busy_timeout(st->db, 30000);
    int rc;
    if ((rc = exec(st, "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;")) ||
        (rc = exec(st, "BEGIN IMMEDIATE")))
        return rc;
    if ((rc = exec(st, schema))) { exec(st, "ROLLBACK"); return rc; }
    /* snaps.replay (the record has no state section) came after the first
     * stores: add it where it is missing. Builds that predate it ignore it
     * and write whole records, which its default describes. */
    if (q_int(st, "SELECT COUNT(*) FROM pragma_table_info('snaps') WHERE name = 'replay'", 0, NULL, 1) == 0 &&
        (rc = exec(st, "ALTER TABLE snaps ADD COLUMN replay INTEGER NOT NULL DEFAULT 0"))) {
        exec(st, "ROLLBACK");
        return rc;
    }
    int64_t ver = q_int(st, "SELECT v FROM meta WHERE k = 'schema'", 0, NULL, -1);
    exec(st, "COMMIT");
    if (ver != SCHEMA_VERSION)
        return kvt_fail(KVT_EUNSUPPORTED, "cache store %s has schema version %lld (this build uses %d)", path,
                        (long long)ver, SCHEMA_VERSION);
    return KVT_OK;
}

int kvt_store_open(kvt_store **out, const char *dir, uint64_t budget)
{
    *out = NULL;
    int rc = mkdirs(dir);
    if (rc) return rc;
    kvt_store *st = kvt_calloc(1, sizeof *st);
    if (!st) return KVT_ENOMEM;
    pthread_mutex_init(&st->mu, NULL);
    st->budget = budget ? budget : DEFAULT_BUDGET;
    st->dirty = true;
    st->data_version = -1;
    st->durable = true;
    st->dir = kvt_strndup(dir, strlen(dir));
    size_t plen = strlen(dir) + 32;
    char *path = kvt_malloc(plen);
    if (!st->dir || !path) { free(path); kvt_store_close(st); return KVT_ENOMEM; }
    snprintf(path, plen, "%s/kvtier.db", dir);
    rc = open_db(st, path);
    if (rc == KVT_EIO && (sqlite3_errcode(st->db) == SQLITE_NOTADB || sqlite3_errcode(st->db) == SQLITE_CORRUPT)) {
        /* Not a database we can use: move it aside, start empty. */
        char *aside = kvt_malloc(plen + 32);
        if (aside) {
            snprintf(aside, plen + 32, "%s.damaged-%lld", path, (long long)time(NULL));
            sqlite3_close(st->db);
            st->db = NULL;
            fprintf(stderr, "kvtier: cache store %s is damaged (%s); moved to %s\n", path, kvt_errmsg(), aside);
            rename(path, aside);
            char wal[4200];
            snprintf(wal, sizeof wal, "%s-wal", path);
            unlink(wal);
            snprintf(wal, sizeof wal, "%s-shm", path);
            unlink(wal);
            free(aside);
            rc = open_db(st, path);
        }
    }
    free(path);
    if (rc) { kvt_store_close(st); return rc; }
    *out = st;
    return KVT_OK;
}

void kvt_store_close(kvt_store *st)
{
    if (!st) return;
    if (st->db && (st->lookups || st->hits || st->misses || st->save_errors) &&
        exec(st, "BEGIN IMMEDIATE") == KVT_OK) {
        flush_counters(st);
        commit(st);
    }
    sqlite3_close(st->db);
    free(st->idx);
    free(st->dir);
    pthread_mutex_destroy(&st->mu);
    free(st);
}

void kvt_store_set_quiet(kvt_store *st, bool quiet) { st->quiet = quiet; }

static int store_limit_pages(kvt_store *st, uint32_t pages)
{
    char sql[64];
    snprintf(sql, sizeof sql, "PRAGMA max_page_count = %u", pages);
    return exec(st, sql);
}

/* ---- removal and eviction (inside a write transaction) ---- */

/* Remove a snapshot and the blocks only it referenced; returns bytes freed. */
static int64_t drop_snap(kvt_store *st, int64_t id)
{
    int64_t before = q_int(st, "SELECT COALESCE(SUM(bytes), 0) FROM blocks", 0, NULL, 0) +
                     q_int(st, "SELECT bytes FROM snaps WHERE id = ?", 1, &id, 0);
    q(st, NULL, "UPDATE blocks SET refs = refs - 1 WHERE key IN (SELECT key FROM snap_blocks WHERE snap = ?)", 1, &id);
    q(st, NULL, "DELETE FROM snap_blocks WHERE snap = ?", 1, &id);
    q(st, NULL, "DELETE FROM snaps WHERE id = ?", 1, &id);
    q(st, NULL, "DELETE FROM blocks WHERE refs <= 0", 0, NULL);
    int64_t after = q_int(st, "SELECT COALESCE(SUM(bytes), 0) FROM blocks", 0, NULL, 0);
    st->dirty = true;
    return before - after;
}

static uint64_t total_bytes(kvt_store *st)
{
    return (uint64_t)(q_int(st, "SELECT COALESCE(SUM(bytes), 0) FROM snaps", 0, NULL, 0) +
                      q_int(st, "SELECT COALESCE(SUM(bytes), 0) FROM blocks", 0, NULL, 0));
}

static void enforce_budget(kvt_store *st, int64_t keep)
{
    uint64_t total = total_bytes(st), evicted = 0;
    while (total > st->budget) {
        int64_t victim = q_int(st, "SELECT id FROM snaps WHERE id != ? ORDER BY last_used ASC, id ASC LIMIT 1",
                               1, &keep, -1);
        if (victim < 0) break;
        int64_t freed = drop_snap(st, victim);
        total = (uint64_t)freed > total ? 0 : total - (uint64_t)freed;
        evicted++;
    }
    counter_add(st, "evictions", evicted);
}

/* ---- save ---- */

/* Replace a stored record by the same record without its fixed state. */
static int drop_state(kvt_store *st, int64_t id)
{
    sqlite3_stmt *get = NULL, *put = NULL;
    kvt_wbuf out = {0};
    int rc = KVT_OK;
    if (sqlite3_prepare_v2(st->db, "SELECT data FROM snaps WHERE id = ?", -1, &get, NULL) != SQLITE_OK)
        return sql_fail(st, "thin snapshot");
    sqlite3_bind_int64(get, 1, id);
    if (sqlite3_step(get) == SQLITE_ROW &&
        kvt_snap_without_state(sqlite3_column_blob(get, 0), (size_t)sqlite3_column_bytes(get, 0), &out) == KVT_OK &&
        out.len > 0) {
        if (sqlite3_prepare_v2(st->db, "UPDATE snaps SET data = ?, bytes = ?, replay = 1 WHERE id = ?", -1, &put, NULL) !=
            SQLITE_OK) {
            rc = sql_fail(st, "thin snapshot");
        } else {
            sqlite3_bind_blob(put, 1, out.p, (int)out.len, SQLITE_STATIC);
            sqlite3_bind_int64(put, 2, (int64_t)out.len);
            sqlite3_bind_int64(put, 3, id);
            if (sqlite3_step(put) != SQLITE_DONE) rc = sql_fail(st, "thin snapshot");
        }
    }
    /* a record that does not parse stays as it is: loading will quarantine it */
    sqlite3_finalize(get);
    sqlite3_finalize(put);
    kvt_wbuf_free(&out);
    return rc;
}

/* Snapshots that the one just saved (n tokens, block keys keys) extends keep
 * only what their blocks cannot give: their fixed state is dropped, and
 * loading one rebuilds it by replay (docs/STORE.md). Cold snapshots stay
 * whole: new conversations fork from them. */
static int thin_ancestors(kvt_store *st, const kvt_model *m, const int32_t *tokens, size_t n, const uint64_t *keys,
                          int64_t self)
{
    size_t nb = n / KVT_BLOCK, cap = 16, k = 0;
    int64_t *ids = kvt_malloc(cap * sizeof *ids);
    sqlite3_stmt *sel = NULL;
    if (!ids) return KVT_ENOMEM;
    if (sqlite3_prepare_v2(st->db, "SELECT id, n_tokens, tail FROM snaps WHERE head = ? AND n_tokens < ? AND"
                           " reason != 'cold' AND id != ? AND replay = 0", -1, &sel, NULL) != SQLITE_OK) {
        free(ids);
        return sql_fail(st, "thin snapshots");
    }
    int rc = KVT_OK;
    for (size_t b = 0; b <= nb && !rc; b++) {
        uint64_t head = b ? keys[b - 1] : kvt_snap_key0(m);
        sqlite3_reset(sel);
        sqlite3_bind_int64(sel, 1, (int64_t)head);
        sqlite3_bind_int64(sel, 2, (int64_t)n);
        sqlite3_bind_int64(sel, 3, self);
        while (sqlite3_step(sel) == SQLITE_ROW) {
            size_t na = (size_t)sqlite3_column_int64(sel, 1);
            if (na / KVT_BLOCK != b || (uint64_t)sqlite3_column_int64(sel, 2) !=
                                           kvt_snap_tail_hash(head, tokens + b * KVT_BLOCK, na - b * KVT_BLOCK))
                continue;
            if (k == cap) {
                int64_t *g = realloc(ids, 2 * cap * sizeof *ids);
                if (!g) { rc = kvt_fail(KVT_ENOMEM, "thin snapshots"); break; }
                ids = g;
                cap *= 2;
            }
            ids[k++] = sqlite3_column_int64(sel, 0);
        }
    }
    sqlite3_finalize(sel);
    for (size_t i = 0; i < k && !rc; i++) rc = drop_state(st, ids[i]);
    free(ids);
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

static int store_save(kvt_store *st, kvt_session *s, size_t n, const char *reason, int64_t *id_out, bool *created)
{
    if (created) *created = false;
    if (!kvt_snap_can_save(s, n))
        return kvt_fail(KVT_EINVAL, "cannot save %zu tokens: the session holds %zu and no checkpoint there", n, s->n);
    kvt_wbuf rec = {0}, blk = {0};
    uint64_t *keys = NULL;
    int rc = kvt_snap_encode(s, n, 0, &rec, &keys);
    if (rc) return rc;
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
    if ((rc = exec(st, "BEGIN IMMEDIATE"))) goto out;
    int64_t id = -1;
    {
        int64_t a[3] = {head, (int64_t)n, tail};
        id = q_int(st, "SELECT id FROM snaps WHERE head = ? AND n_tokens = ? AND tail = ?", 3, a, -1);
    }
    int64_t t = tick(st);
    bool fresh = id < 0;
    if (id >= 0) { /* already stored: only the use moves */
        int64_t a[2] = {t, id};
        q(st, NULL, "UPDATE snaps SET last_used = ? WHERE id = ?", 2, a);
        /* ...unless a cold save meets another kind of entry: it becomes a
         * whole cold one, as if saved cold first (fork points stay whole) */
        sqlite3_stmt *up = NULL;
        if (reason && !strcmp(reason, "cold") &&
            sqlite3_prepare_v2(st->db, "UPDATE snaps SET reason = 'cold', replay = 0, data = ?, bytes = ?"
                               " WHERE id = ? AND (reason != 'cold' OR replay != 0)", -1, &up, NULL) == SQLITE_OK) {
            sqlite3_bind_blob(up, 1, rec.p, (int)rec.len, SQLITE_STATIC);
            sqlite3_bind_int64(up, 2, (int64_t)rec.len);
            sqlite3_bind_int64(up, 3, id);
            if (sqlite3_step(up) != SQLITE_DONE) rc = sql_fail(st, "save snapshot");
        }
        sqlite3_finalize(up);
    } else {
        uint64_t prev = kvt_snap_key0(s->m);
        for (size_t b = 0; b < nb && !rc; b++) {
            int64_t k = (int64_t)keys[b];
            if (q_int(st, "SELECT 1 FROM blocks WHERE key = ?", 1, &k, 0) == 0) {
                uint64_t key;
                blk.len = 0;
                if ((rc = kvt_snap_block(s, (uint32_t)b, prev, &blk, &key))) break;
                sqlite3_stmt *ins = NULL;
                if (sqlite3_prepare_v2(st->db, "INSERT INTO blocks(key, refs, bytes, data) VALUES(?, 0, ?, ?)", -1,
                                       &ins, NULL) != SQLITE_OK) { rc = sql_fail(st, "save block"); break; }
                sqlite3_bind_int64(ins, 1, k);
                sqlite3_bind_int64(ins, 2, (int64_t)blk.len);
                sqlite3_bind_blob(ins, 3, blk.p, (int)blk.len, SQLITE_STATIC);
                int r = sqlite3_step(ins);
                sqlite3_finalize(ins);
                if (r != SQLITE_DONE) { rc = sql_fail(st, "save block"); break; }
            }
            prev = keys[b];
        }
        if (!rc) {
            sqlite3_stmt *ins = NULL;
            if (sqlite3_prepare_v2(st->db,
                                   "INSERT INTO snaps(model, head, n_tokens, tail, n_blocks, reason, created, last_used,"
                                   " used_at, bytes, preview, data) VALUES(?,?,?,?,?,?,?,?,?,?,?,?)", -1, &ins,
                                   NULL) != SQLITE_OK) {
                rc = sql_fail(st, "save snapshot");
            } else {
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
                sqlite3_bind_blob(ins, 12, rec.p, (int)rec.len, SQLITE_STATIC);
                if (sqlite3_step(ins) != SQLITE_DONE) rc = sql_fail(st, "save snapshot");
                sqlite3_finalize(ins);
            }
            id = sqlite3_last_insert_rowid(st->db);
        }
        for (size_t b = 0; b < nb && !rc; b++) {
            int64_t a[3] = {id, (int64_t)b, (int64_t)keys[b]};
            if (!q_ok(q(st, NULL, "INSERT INTO snap_blocks(snap, idx, key) VALUES(?, ?, ?)", 3, a)) ||
                !q_ok(q(st, NULL, "UPDATE blocks SET refs = refs + 1 WHERE key = ?", 1, &a[2])))
                rc = sql_fail(st, "save references");
        }
        if (!rc && s->m->arch->state_rebuild) rc = thin_ancestors(st, s->m, s->tokens, n, keys, id);
        if (!rc) {
            counter_add(st, "saves", 1);
            enforce_budget(st, id);
        }
    }
    flush_counters(st);
    if (rc || exec(st, "COMMIT") != KVT_OK) {
        if (!rc) rc = sql_fail(st, "commit");
        char msg[512];
        snprintf(msg, sizeof msg, "%s", kvt_errmsg());
        exec(st, "ROLLBACK");
        st->save_errors++;
        rc = kvt_fail(rc, "%s", msg);
        goto out;
    }
    st->dirty = true;
    if (id_out) *id_out = id;
    if (created) *created = fresh;
out:
    kvt_wbuf_free(&rec);
    kvt_wbuf_free(&blk);
    free(keys);
    return rc;
}

/* ---- lookup ---- */

static int cmp_ientry(const void *a, const void *b)
{
    const ientry *x = a, *y = b;
    if (x->head != y->head) return x->head < y->head ? -1 : 1;
    return (x->n > y->n) - (x->n < y->n);
}

static int refresh_index(kvt_store *st)
{
    int64_t dv = q_int(st, "PRAGMA data_version", 0, NULL, -2);
    if (!st->dirty && dv == st->data_version) return KVT_OK;
    size_t cap = (size_t)q_int(st, "SELECT COUNT(*) FROM snaps", 0, NULL, 0) + 16, n = 0;
    ientry *idx = kvt_malloc(cap * sizeof *idx);
    if (!idx) return KVT_ENOMEM;
    sqlite3_stmt *stmt = NULL;
    if (sqlite3_prepare_v2(st->db, "SELECT head, n_tokens, tail, id FROM snaps", -1, &stmt, NULL) != SQLITE_OK) {
        free(idx);
        return sql_fail(st, "index");
    }
    while (sqlite3_step(stmt) == SQLITE_ROW && n < cap)
        idx[n++] = (ientry){(uint64_t)sqlite3_column_int64(stmt, 0), (uint64_t)sqlite3_column_int64(stmt, 2),
                            (uint32_t)sqlite3_column_int64(stmt, 1), sqlite3_column_int64(stmt, 3)};
    sqlite3_finalize(stmt);
    qsort(idx, n, sizeof *idx, cmp_ientry);
    free(st->idx);
    st->idx = idx;
    st->n_idx = n;
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

struct getter { kvt_store *st; sqlite3_stmt *stmt; uint32_t bad_block; uint64_t bad_key; };

static int get_block(void *user, uint32_t b, uint64_t key, const uint8_t **p, size_t *len)
{
    struct getter *g = user;
    g->bad_block = b;
    g->bad_key = key;
    sqlite3_reset(g->stmt);
    sqlite3_bind_int64(g->stmt, 1, (int64_t)key);
    if (sqlite3_step(g->stmt) != SQLITE_ROW) return kvt_fail(KVT_EFORMAT, "block %u (key %016llx) is missing", b, (unsigned long long)key);
    /* SQLite's copy stays valid until the next step: the loader checks and
     * copies a block before it asks for the next one */
    *p = sqlite3_column_blob(g->stmt, 0);
    *len = (size_t)sqlite3_column_bytes(g->stmt, 0);
    if (!*p) return kvt_fail(KVT_EFORMAT, "block %u (key %016llx) is empty", b, (unsigned long long)key);
    return KVT_OK;
}

/* A damaged entry: report once, record, remove (with a bad block, every
 * snapshot that stands on it goes too). */
static void quarantine(kvt_store *st, int64_t id, bool block_bad, uint64_t key, const char *reason)
{
    if (!st->quiet) fprintf(stderr, "kvtier: cache entry %lld is unusable (%s); removed\n", (long long)id, reason);
    if (exec(st, "BEGIN IMMEDIATE")) return;
    sqlite3_stmt *ins = NULL;
    if (sqlite3_prepare_v2(st->db, "INSERT INTO quarantine(what, reason, at) VALUES(?, ?, ?)", -1, &ins, NULL) == SQLITE_OK) {
        char what[64];
        snprintf(what, sizeof what, block_bad ? "block %016llx" : "snapshot %lld",
                 block_bad ? (unsigned long long)key : (unsigned long long)id);
        sqlite3_bind_text(ins, 1, what, -1, SQLITE_TRANSIENT);
        sqlite3_bind_text(ins, 2, reason, -1, SQLITE_TRANSIENT);
        sqlite3_bind_double(ins, 3, now_unix());
        sqlite3_step(ins);
    }
    sqlite3_finalize(ins);
    if (block_bad) {
        int64_t k = (int64_t)key;
        sqlite3_stmt *sel = NULL;
        if (sqlite3_prepare_v2(st->db, "SELECT DISTINCT snap FROM snap_blocks WHERE key = ?", -1, &sel, NULL) == SQLITE_OK) {
            sqlite3_bind_int64(sel, 1, k);
            int64_t victims[256];
            size_t nv = 0;
            while (sqlite3_step(sel) == SQLITE_ROW && nv < 256) victims[nv++] = sqlite3_column_int64(sel, 0);
            sqlite3_finalize(sel);
            for (size_t i = 0; i < nv; i++) drop_snap(st, victims[i]);
        }
        q(st, NULL, "DELETE FROM blocks WHERE key = ?", 1, &k);
    }
    drop_snap(st, id);
    counter_add(st, "damaged", 1);
    commit(st);
}

static int store_load(kvt_store *st, int64_t id, kvt_session *s)
{
    sqlite3_stmt *stmt = NULL;
    /* one read transaction: the record and its blocks come from one state of
     * the store whatever other processes commit meanwhile, and the blocks
     * are read without a lock round trip each */
    if (!sqlite3_get_autocommit(st->db)) exec(st, "ROLLBACK"); /* one a failed commit left open */
    int rc = exec(st, "BEGIN");
    if (rc) return rc;
    int r = q(st, &stmt, "SELECT data FROM snaps WHERE id = ?", 1, &id);
    if (r != SQLITE_ROW) {
        rc = q_ok(r) ? kvt_fail(KVT_ENOENT, "no cache entry %lld", (long long)id) : sql_fail(st, "load");
        exec(st, "COMMIT");
        return rc;
    }
    size_t len = (size_t)sqlite3_column_bytes(stmt, 0);
    uint8_t *rec = kvt_malloc(len ? len : 1);
    if (!rec) { sqlite3_finalize(stmt); exec(st, "COMMIT"); return KVT_ENOMEM; }
    if (len) memcpy(rec, sqlite3_column_blob(stmt, 0), len);
    sqlite3_finalize(stmt);
    struct getter g = {st, NULL, UINT32_MAX, 0};
    bool rebuild = false;
    if (sqlite3_prepare_v2(st->db, "SELECT data FROM blocks WHERE key = ?", -1, &g.stmt, NULL) != SQLITE_OK) {
        rc = sql_fail(st, "load");
    } else {
        rc = kvt_snap_load_start(s, rec, len, get_block, &g, &rebuild);
        if (rc == KVT_OK) g.bad_block = UINT32_MAX; /* from here on a failure is the record's */
    }
    sqlite3_finalize(g.stmt);
    exec(st, "COMMIT"); /* ends the read; kvt_errmsg() still says why a load failed */
    if (rc == KVT_OK) rc = kvt_snap_load_finish(s, rebuild); /* a replay needs no database */
    bool future = len >= 12 && !memcmp(rec, "KVTSNAP", 7) && kvt_rd32(rec + 8) > KVT_SNAP_VERSION_REPLAY;
    free(rec);
    if (rc == KVT_OK) {
        st->hits++;
        /* Recording a use is bookkeeping: in WAL mode a commit without its
         * fsync keeps the store consistent, and a crash forgets at most the
         * last uses. Saves and removals stay synchronous=FULL. */
        if (st->durable) exec(st, "PRAGMA synchronous=NORMAL");
        if (exec(st, "BEGIN IMMEDIATE") == KVT_OK) {
            int64_t a[2] = {tick(st), id};
            q(st, NULL, "UPDATE snaps SET hits = hits + 1, last_used = ? WHERE id = ?", 2, a);
            sqlite3_stmt *u = NULL;
            if (sqlite3_prepare_v2(st->db, "UPDATE snaps SET used_at = ? WHERE id = ?", -1, &u, NULL) == SQLITE_OK) {
                sqlite3_bind_double(u, 1, now_unix());
                sqlite3_bind_int64(u, 2, id);
                sqlite3_step(u);
            }
            sqlite3_finalize(u);
            flush_counters(st);
            commit(st);
        }
        if (st->durable) exec(st, "PRAGMA synchronous=FULL");
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
    bool block_bad = g.bad_block != UINT32_MAX && strncmp(reason, "snapshot", 8) != 0;
    quarantine(st, id, block_bad, g.bad_key, reason);
    st->misses++;
    return kvt_fail(rc, "%s", reason);
}

static int store_restore_prefix(kvt_store *st, kvt_session *s, const int32_t *tokens, size_t n, size_t *reused)
{
    *reused = 0;
    for (int attempt = 0; attempt < 4; attempt++) {
        size_t match;
        int64_t id;
        int rc = store_lookup(st, s->m, tokens, n, &match, &id);
        if (rc || !match) return rc == KVT_ENOMEM ? rc : KVT_OK;
        if (match > s->n_ctx) return KVT_OK;
        rc = store_load(st, id, s);
        if (rc == KVT_ENOMEM) return rc;
        if (rc) continue; /* removed; the next lookup may find a shorter prefix */
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
    return KVT_OK;
}

/* ---- maintenance and inspection ---- */

static int store_rm(kvt_store *st, int64_t id)
{
    int rc = exec(st, "BEGIN IMMEDIATE");
    if (rc) return rc;
    if (q_int(st, "SELECT COUNT(*) FROM snaps WHERE id = ?", 1, &id, 0) == 0) {
        exec(st, "ROLLBACK");
        return kvt_fail(KVT_ENOENT, "no cache entry %lld", (long long)id);
    }
    drop_snap(st, id);
    return commit(st);
}

static int store_gc(kvt_store *st)
{
    int rc = exec(st, "BEGIN IMMEDIATE");
    if (rc) return rc;
    enforce_budget(st, -1);
    q(st, NULL, "DELETE FROM snap_blocks WHERE snap NOT IN (SELECT id FROM snaps)", 0, NULL);
    q(st, NULL, "UPDATE blocks SET refs = (SELECT COUNT(*) FROM snap_blocks WHERE snap_blocks.key = blocks.key)", 0, NULL);
    q(st, NULL, "DELETE FROM blocks WHERE refs <= 0", 0, NULL);
    flush_counters(st);
    if ((rc = commit(st))) return rc;
    st->dirty = true;
    return exec(st, "PRAGMA wal_checkpoint(TRUNCATE)");
}

static int store_verify(kvt_store *st, size_t *bad, size_t *checked)
{
    *bad = *checked = 0;
    const char *sqls[2] = {"SELECT id, data FROM snaps", "SELECT key, data FROM blocks"};
    for (int k = 0; k < 2; k++) {
        sqlite3_stmt *stmt = NULL;
        if (sqlite3_prepare_v2(st->db, sqls[k], -1, &stmt, NULL) != SQLITE_OK) return sql_fail(st, "verify");
        while (sqlite3_step(stmt) == SQLITE_ROW) {
            const uint8_t *p = sqlite3_column_blob(stmt, 1);
            size_t len = (size_t)sqlite3_column_bytes(stmt, 1);
            int64_t id = sqlite3_column_int64(stmt, 0);
            kvt_snap_info in;
            uint64_t key;
            int rc = !p ? kvt_fail(KVT_EFORMAT, "empty") : k == 0 ? kvt_snap_parse_raw(p, len, &in)
                                                                  : kvt_snap_block_check(p, len, &key);
            if (!rc && k == 1 && key != (uint64_t)id) rc = kvt_fail(KVT_EMISMATCH, "block stored under another key");
            (*checked)++;
            if (rc) {
                (*bad)++;
                if (!st->quiet)
                    fprintf(stderr, "kvtier: %s %llx: %s\n", k ? "block" : "snapshot", (unsigned long long)id, kvt_errmsg());
            }
        }
        sqlite3_finalize(stmt);
    }
    return KVT_OK;
}

static int store_stats_get(kvt_store *st, kvt_store_stats *o)
{
    memset(o, 0, sizeof *o);
    o->snapshots = (uint64_t)q_int(st, "SELECT COUNT(*) FROM snaps", 0, NULL, 0);
    o->blocks = (uint64_t)q_int(st, "SELECT COUNT(*) FROM blocks", 0, NULL, 0);
    o->block_refs = (uint64_t)q_int(st, "SELECT COUNT(*) FROM snap_blocks", 0, NULL, 0);
    o->bytes = total_bytes(st);
    o->budget = st->budget;
    struct { const char *name; uint64_t *dst, pending; } c[] = {
        {"lookups", &o->lookups, st->lookups}, {"hits", &o->hits, st->hits}, {"misses", &o->misses, st->misses},
        {"saves", &o->saves, 0}, {"evictions", &o->evictions, 0}, {"damaged", &o->damaged, 0},
        {"save_errors", &o->save_errors, st->save_errors},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        sqlite3_stmt *stmt = NULL;
        *c[i].dst = c[i].pending;
        if (sqlite3_prepare_v2(st->db, "SELECT value FROM counters WHERE name = ?", -1, &stmt, NULL) == SQLITE_OK) {
            sqlite3_bind_text(stmt, 1, c[i].name, -1, SQLITE_STATIC);
            if (sqlite3_step(stmt) == SQLITE_ROW) *c[i].dst += (uint64_t)sqlite3_column_int64(stmt, 0);
        }
        sqlite3_finalize(stmt);
    }
    return KVT_OK;
}

static int store_list(kvt_store *st, kvt_store_entry **out, size_t *n)
{
    *out = NULL;
    *n = 0;
    size_t cap = (size_t)q_int(st, "SELECT COUNT(*) FROM snaps", 0, NULL, 0) + 1, k = 0;
    kvt_store_entry *e = kvt_calloc(cap, sizeof *e);
    if (!e) return KVT_ENOMEM;
    sqlite3_stmt *stmt = NULL;
    if (sqlite3_prepare_v2(st->db,
                           "SELECT id, model, bytes, hits, n_tokens, n_blocks, created, used_at, reason, preview,"
                           " (SELECT COUNT(*) FROM snap_blocks sb JOIN blocks b ON b.key = sb.key"
                           "   WHERE sb.snap = snaps.id AND b.refs > 1)"
                           ", replay"
                           " FROM snaps ORDER BY last_used DESC", -1, &stmt, NULL) != SQLITE_OK) {
        free(e);
        return sql_fail(st, "list");
    }
    while (sqlite3_step(stmt) == SQLITE_ROW && k < cap) {
        kvt_store_entry *x = &e[k++];
        x->id = sqlite3_column_int64(stmt, 0);
        x->model = (uint64_t)sqlite3_column_int64(stmt, 1);
        x->bytes = (uint64_t)sqlite3_column_int64(stmt, 2);
        x->hits = (uint64_t)sqlite3_column_int64(stmt, 3);
        x->n_tokens = (uint32_t)sqlite3_column_int64(stmt, 4);
        x->n_blocks = (uint32_t)sqlite3_column_int64(stmt, 5);
        x->created = sqlite3_column_double(stmt, 6);
        x->used_at = sqlite3_column_double(stmt, 7);
        snprintf(x->reason, sizeof x->reason, "%s", (const char *)sqlite3_column_text(stmt, 8));
        snprintf(x->preview, sizeof x->preview, "%s", (const char *)sqlite3_column_text(stmt, 9));
        x->shared_blocks = (uint32_t)sqlite3_column_int64(stmt, 10);
        x->replay = sqlite3_column_int64(stmt, 11) != 0;
    }
    sqlite3_finalize(stmt);
    *out = e;
    *n = k;
    return KVT_OK;
}

static int store_text(kvt_store *st, int64_t id, char **text, size_t *len)
{
    sqlite3_stmt *stmt = NULL, *blk = NULL;
    int r = q(st, &stmt, "SELECT data FROM snaps WHERE id = ?", 1, &id);
    if (r != SQLITE_ROW) return q_ok(r) ? kvt_fail(KVT_ENOENT, "no cache entry %lld", (long long)id) : sql_fail(st, "show");
    kvt_snap_info in;
    kvt_wbuf out = {0};
    int rc = kvt_snap_parse_raw(sqlite3_column_blob(stmt, 0), (size_t)sqlite3_column_bytes(stmt, 0), &in);
    if (!rc && sqlite3_prepare_v2(st->db, "SELECT data FROM blocks WHERE key = ?", -1, &blk, NULL) != SQLITE_OK)
        rc = sql_fail(st, "show");
    /* the prefix's text: every block's text, then the tail's */
    for (uint32_t b = 0; !rc && b < in.nb; b++) {
        sqlite3_reset(blk);
        sqlite3_bind_int64(blk, 1, (int64_t)kvt_rd64(in.sec[6] + 8 * (size_t)b));
        const uint8_t *t;
        size_t tl;
        if (sqlite3_step(blk) != SQLITE_ROW) rc = kvt_fail(KVT_EFORMAT, "block %u is missing", b);
        else if (!(rc = kvt_snap_block_text(sqlite3_column_blob(blk, 0), (size_t)sqlite3_column_bytes(blk, 0), &t, &tl)))
            kvt_wbuf_put(&out, t, tl);
    }
    if (!rc) {
        size_t n;
        const uint8_t *t = kvt_snap_text(&in, &n);
        kvt_wbuf_put(&out, t, n);
        kvt_wbuf_put(&out, "", 1);
        if (out.oom) rc = kvt_fail(KVT_ENOMEM, "text");
    }
    sqlite3_finalize(blk);
    sqlite3_finalize(stmt);
    if (rc) { kvt_wbuf_free(&out); return rc; }
    *text = (char *)out.p;
    *len = out.len - 1;
    return KVT_OK;
}

/* ---- public entry points: one caller at a time per store ---- */

int kvt_store_save(kvt_store *st, kvt_session *s, size_t n, const char *reason, int64_t *id_out)
{
    pthread_mutex_lock(&st->mu);
    int rc = store_save(st, s, n, reason, id_out, NULL);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int kvt_store_save_new(kvt_store *st, kvt_session *s, size_t n, const char *reason, int64_t *id_out, bool *created)
{
    pthread_mutex_lock(&st->mu);
    int rc = store_save(st, s, n, reason, id_out, created);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int kvt_store_lookup(kvt_store *st, const kvt_model *m, const int32_t *tokens, size_t n, size_t *match, int64_t *id)
{
    pthread_mutex_lock(&st->mu);
    int rc = store_lookup(st, m, tokens, n, match, id);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int kvt_store_load(kvt_store *st, int64_t id, kvt_session *s)
{
    pthread_mutex_lock(&st->mu);
    int rc = store_load(st, id, s);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int kvt_store_restore_prefix(kvt_store *st, kvt_session *s, const int32_t *tokens, size_t n, size_t *reused)
{
    pthread_mutex_lock(&st->mu);
    int rc = store_restore_prefix(st, s, tokens, n, reused);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int kvt_store_rm(kvt_store *st, int64_t id)
{
    pthread_mutex_lock(&st->mu);
    int rc = store_rm(st, id);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int kvt_store_gc(kvt_store *st)
{
    pthread_mutex_lock(&st->mu);
    int rc = store_gc(st);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int kvt_store_verify(kvt_store *st, size_t *bad, size_t *checked)
{
    pthread_mutex_lock(&st->mu);
    int rc = store_verify(st, bad, checked);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int kvt_store_stats_get(kvt_store *st, kvt_store_stats *o)
{
    pthread_mutex_lock(&st->mu);
    int rc = store_stats_get(st, o);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int kvt_store_list(kvt_store *st, kvt_store_entry **out, size_t *n)
{
    pthread_mutex_lock(&st->mu);
    int rc = store_list(st, out, n);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int kvt_store_text(kvt_store *st, int64_t id, char **text, size_t *len)
{
    pthread_mutex_lock(&st->mu);
    int rc = store_text(st, id, text, len);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

int kvt_store_set_synchronous(kvt_store *st, bool on)
{
    st->durable = on;
    return exec(st, on ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=OFF");
}

int kvt_store_limit_pages(kvt_store *st, uint32_t pages)
{
    pthread_mutex_lock(&st->mu);
    int rc = store_limit_pages(st, pages);
    pthread_mutex_unlock(&st->mu);
    return rc;
}

