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
 * damaged one aside and goes on with the new one (recovery.c).
 *
 * The files: this one runs the operations (open, save, lookup, load,
 * removal, eviction, free space, inspection) and holds the public entry
 * points; db.c the connection, its SQLite calls and transactions and the
 * places of records (db.h, private to src/store/); recovery.c the rebuild
 * of a damaged database; segments.c the segment files.
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
#include "store/db.h"
#include "store/recovery.h"
#include "store/segments.h"
#include "session/snapshot.h"
#include "store/store.h"
#include "store/testing.h"
#include "store/storedir.h"
#include "arch/model.h"
#include "base/util.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <time.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

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
    kvt_db_close(st, false);
    st->inspect = true;
    kvt_db_op_start(st, "open");
    int rc = kvt_db_open(st);
    st->inspect = false;
    bloc *put = NULL;
    size_t n_put = 0, cap_put = 0;
    typedef struct { int64_t key, left; } bref;
    bref *refs = NULL;
    size_t n_refs = 0, cap_refs = 0;
    sqlite3_stmt *lru = rc || !st->has_segs ? NULL : kvt_db_prep(st, "SELECT id, rseg, roff, bytes FROM snaps ORDER BY last_used, id", NULL);
    sqlite3_stmt *blk = lru ? kvt_db_prep(st, "SELECT b.key, b.refs, b.seg, b.off, b.bytes FROM snap_blocks sb JOIN blocks b"
                                       " ON b.key = sb.key WHERE sb.snap = ?", NULL) : NULL;
    while (blk && freed < deficit && kvt_db_step(st, lru, NULL) == SQLITE_ROW) {
        int64_t id = sqlite3_column_int64(lru, 0);
        bloc w;
        int grc = 0;
        KVT_GROW(put, &cap_put, n_put + 1, grc);
        if (grc) break;
        if (kvt_db_row_bloc(lru, 1, 2, 3, &w) && w.seg) { put[n_put++] = w; freed += w.bytes; }
        sqlite3_reset(blk);
        sqlite3_bind_int64(blk, 1, id);
        while (kvt_db_step(st, blk, NULL) == SQLITE_ROW) {
            int64_t key = sqlite3_column_int64(blk, 0);
            size_t k = 0;
            while (k < n_refs && refs[k].key != key) k++;
            if (k == n_refs) {
                KVT_GROW(refs, &cap_refs, n_refs + 1, grc);
                if (grc) break;
                refs[n_refs++] = (bref){key, sqlite3_column_int64(blk, 1)};
            }
            if (--refs[k].left != 0 || !kvt_db_row_bloc(blk, 2, 3, 4, &w) || !w.seg) continue;
            KVT_GROW(put, &cap_put, n_put + 1, grc);
            if (grc) break;
            put[n_put++] = w;
            freed += w.bytes;
        }
        kvt_db_idset_add(victims, id);
    }
    sqlite3_finalize(blk);
    sqlite3_finalize(lru);
    kvt_db_close(st, true);
    kvt_db_coalesce(put, &n_put);
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
    kvt_db_op_start(st, "open");
    if (kvt_db_begin(st)) return;
    uint64_t evicted = 0;
    for (size_t i = 0; i < victims->n && !st->sql_rc; i++)
        if (kvt_db_q_int(st, "SELECT COUNT(*) FROM snaps WHERE id = ?", 1, &victims->v[i], 0) == 1) {
            drop_snap(st, victims->v[i]);
            evicted++;
        }
    kvt_db_counter_add(st, "evictions", evicted);
    kvt_db_commit(st);
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
        if (rc && !inspect && !st->corrupt && room_before_open(st, &victims) == KVT_OK) {
            if (!st->quiet)
                fprintf(stderr, "kvtier: cache store %s: the file system is full; %zu least recently used snapshots "
                                "evicted to open it\n", dir, victims.n);
            kvt_db_op_start(st, "open");
            if (!(rc = kvt_db_open(st))) drop_victims(st, &victims);
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

/* ---- the index ---- */

static int cmp_ientry(const void *a, const void *b)
{
    const ientry *x = a, *y = b;
    if (x->head != y->head) return x->head < y->head ? -1 : 1;
    return (x->n > y->n) - (x->n < y->n);
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
    if (kvt_db_q(st, &stmt, sql, 0, NULL) != SQLITE_ROW) return false;
    *t = (totals){sqlite3_column_int64(stmt, 0), sqlite3_column_int64(stmt, 1), sqlite3_column_int64(stmt, 2),
                  sqlite3_column_int64(stmt, 3)};
    sqlite3_finalize(stmt);
    return true;
}

static bool has_totals(kvt_store *st)
{
    return kvt_db_q_int(st, "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'totals'", 0, NULL, 0) == 1;
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
    kvt_db_q(st, NULL, "DELETE FROM totals", 0, NULL);
    int64_t v[4] = {b.bytes, b.snaps, b.blocks, b.refs};
    kvt_db_q(st, NULL, "INSERT INTO totals(one, bytes, snaps, blocks, refs) VALUES(1, ?, ?, ?, ?)", 4, v);
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
    kvt_db_q(st, NULL, "UPDATE blocks SET refs = refs - 1 WHERE key IN (SELECT key FROM snap_blocks WHERE snap = ?)", 1, &id);
    kvt_db_delete_placed(st, "DELETE FROM blocks WHERE key IN (SELECT key FROM snap_blocks WHERE snap = ?) AND refs <= 0"
                      " RETURNING seg, off, bytes", 1, &id);
    kvt_db_q(st, NULL, "DELETE FROM snap_blocks WHERE snap = ?", 1, &id);
    kvt_db_delete_placed(st, "DELETE FROM snaps WHERE id = ? RETURNING rseg, roff, bytes", 1, &id);
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
        int64_t victim = kvt_db_q_int(st, "SELECT id FROM snaps WHERE id != ? ORDER BY last_used ASC, id ASC LIMIT 1",
                               1, &keep, -1);
        if (victim < 0) break;
        int64_t freed = drop_snap(st, victim);
        total = (uint64_t)freed > total ? 0 : total - (uint64_t)freed;
        evicted++;
    }
    kvt_db_counter_add(st, "evictions", evicted);
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
        int rc = kvt_db_begin(st);
        if (rc) return rc;
        uint64_t freed = 0, evicted = 0;
        while (freed < want && !st->sql_rc) {
            int64_t victim = kvt_db_q_int(st, "SELECT id FROM snaps WHERE id != ? ORDER BY last_used ASC, id ASC LIMIT 1",
                                   1, &keep, -1);
            if (victim < 0) break;
            int64_t f = drop_snap(st, victim);
            freed += f > 0 ? (uint64_t)f : 0;
            evicted++;
        }
        kvt_db_counter_add(st, "evictions", evicted);
        if ((rc = kvt_db_commit(st))) return rc;
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
    if (kvt_db_q(st, &old, "SELECT rseg, roff, bytes FROM snaps WHERE id = ?", 1, &id) == SQLITE_ROW && kvt_db_row_bloc(old, 0, 1, 2, &was) &&
        was.seg) {
        int rc; /* a place not recorded stays allocated until gc */
        KVT_GROW(st->freed, &st->cap_freed, st->n_freed + 1, rc);
        if (!rc) st->freed[st->n_freed++] = was;
    }
    sqlite3_finalize(old);
    if (st->sql_rc) return;
    if (kvt_db_seg_append(st, p, len, &w)) {
        kvt_db_sql_note(st, SQLITE_IOERR, "save snapshot"); /* ends the transaction: it rolls back */
        snprintf(st->sql_msg, sizeof st->sql_msg, "%s", kvt_errmsg());
        return;
    }
    sqlite3_stmt *put = kvt_db_prep(st, set_sql, "save snapshot");
    if (put) {
        sqlite3_bind_int64(put, 1, (int64_t)len);
        sqlite3_bind_int64(put, 2, w.seg);
        sqlite3_bind_int64(put, 3, (int64_t)w.off);
        sqlite3_bind_int64(put, 4, id);
        kvt_db_step(st, put, "save snapshot");
    }
    sqlite3_finalize(put);
}

/* Replace a stored record by the same record without its fixed state. */
static int drop_state(kvt_store *st, int64_t id)
{
    kvt_wbuf out = {0};
    uint8_t *buf = NULL;
    size_t cap = 0;
    sqlite3_stmt *get = kvt_db_prep(st, "SELECT data, rseg, roff, bytes FROM snaps WHERE id = ?", "thin snapshot");
    if (!get) return kvt_db_sql_status(st);
    sqlite3_bind_int64(get, 1, id);
    const uint8_t *p;
    size_t len;
    /* a record that does not read or parse stays as it is: loading will quarantine it */
    if (kvt_db_step(st, get, "thin snapshot") == SQLITE_ROW && kvt_db_row_record(st, get, 0, 3, &buf, &cap, &p, &len) == KVT_OK && p &&
        kvt_snap_without_state(p, len, &out) == KVT_OK && out.len > 0) {
        sqlite3_finalize(get);
        get = NULL;
        replace_record(st, id, out.p, out.len,
                       "UPDATE snaps SET data = X'', bytes = ?1, rseg = ?2, roff = ?3, replay = 1 WHERE id = ?4");
    }
    sqlite3_finalize(get);
    free(buf);
    kvt_wbuf_free(&out);
    return kvt_db_sql_status(st);
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
    sqlite3_stmt *sel = kvt_db_prep(st, "SELECT id, n_tokens, tail FROM snaps WHERE head = ? AND n_tokens < ? AND"
                                 " reason != 'cold' AND id != ? AND replay = 0", "thin snapshots");
    if (!sel) return kvt_db_sql_status(st);
    for (size_t b = 0; b <= nb && !st->sql_rc; b++) {
        uint64_t head = b ? keys[b - 1] : kvt_snap_key0(m);
        sqlite3_reset(sel);
        sqlite3_bind_int64(sel, 1, (int64_t)head);
        sqlite3_bind_int64(sel, 2, (int64_t)n);
        sqlite3_bind_int64(sel, 3, self);
        while (kvt_db_step(st, sel, "thin snapshots") == SQLITE_ROW) {
            size_t na = (size_t)sqlite3_column_int64(sel, 1);
            if (na / KVT_BLOCK != b || (uint64_t)sqlite3_column_int64(sel, 2) !=
                                           kvt_snap_tail_hash(head, tokens + b * KVT_BLOCK, na - b * KVT_BLOCK))
                continue;
            kvt_db_idset_add(&ids, sqlite3_column_int64(sel, 0));
        }
    }
    sqlite3_finalize(sel);
    int rc = ids.oom ? kvt_fail(KVT_ENOMEM, "thin snapshots") : kvt_db_sql_status(st);
    for (size_t i = 0; i < ids.n && !rc; i++) rc = drop_state(st, ids.v[i]);
    free(ids.v);
    return rc;
}

/* A save in progress: what the steps of store_save share. */
typedef struct save_job {
    kvt_session *s;
    size_t n, nb;            /* tokens saved, and their whole blocks */
    const char *reason;
    const uint64_t *keys;    /* (nb) the session's block keys (kvt_snap_keys) */
    int64_t head, tail;      /* the entry's identity: the last block's key, the tail's hash */
    kvt_wbuf rec;            /* the snapshot record (encoded once the save must write) */
    kvt_wbuf blk;            /* a block record's bytes before its rows (the one being written) */
    struct iovec *runs;      /* its rows where they lie, and its checksum (kvt_snap_block_parts) */
    kvt_wbuf locs;           /* the places of the blocks (snaps.locs) */
    char preview[64];
    uint64_t need;           /* bytes the save may write, at most */
} save_job;

/* The entry's identity (head, tail) from the token ids alone. */
static void save_identity(save_job *j)
{
    j->head = (int64_t)(j->nb ? j->keys[j->nb - 1] : kvt_snap_key0(j->s->m));
    j->tail = (int64_t)kvt_snap_tail_hash((uint64_t)j->head, j->s->tokens + j->nb * KVT_BLOCK, j->n - j->nb * KVT_BLOCK);
}

/* The id of the stored entry with the job's identity (-1: none), inside
 * the save's transaction. */
static int64_t stored_id(kvt_store *st, const save_job *j)
{
    int64_t a[3] = {j->head, (int64_t)j->n, j->tail};
    return kvt_db_q_int(st, "SELECT id FROM snaps WHERE head = ? AND n_tokens = ? AND tail = ?", 3, a, -1);
}

/* Whether a cold save meets an entry of another kind (which it rewrites). */
static bool cold_meets_other(kvt_store *st, const save_job *j, int64_t id, int64_t def)
{
    return j->reason && !strcmp(j->reason, "cold") &&
           kvt_db_q_int(st, "SELECT reason != 'cold' OR replay != 0 FROM snaps WHERE id = ?", 1, &id, def) != 0;
}

/* A save of a prefix the store holds whole already (the save policy runs
 * again over the prefixes of a session that a request extended): only its
 * use moves, and the record is never encoded, which for a long prefix with
 * a recurrent state costs seconds. Returns KVT_OK when that was all, 1 when
 * the save must go on (not stored, or a cold save that meets another kind
 * of entry and rewrites its record), or an error. */
static int stored_already(kvt_store *st, const save_job *j, int64_t *id_out)
{
    int rc = kvt_db_begin(st);
    if (rc) { st->save_errors++; return rc; }
    int64_t id = stored_id(st, j);
    /* (a row the unique index names and the table lacks is damage, which
     * the save below meets and the rebuild mends) */
    bool whole = id >= 0 && !st->sql_rc && kvt_db_q_int(st, "SELECT COUNT(*) FROM snaps WHERE id = ?", 1, &id, 0) == 1 &&
                 !cold_meets_other(st, j, id, 1);
    if (!whole || st->sql_rc) {
        int failed = st->sql_rc;
        kvt_db_rollback(st);
        if (!failed) return 1;
        st->save_errors++;
        return kvt_db_sql_status(st);
    }
    int64_t u[2] = {kvt_db_tick(st), id};
    kvt_db_q(st, NULL, "UPDATE snaps SET last_used = ? WHERE id = ?", 2, u);
    kvt_db_flush_counters(st);
    if ((rc = kvt_db_commit(st))) { st->save_errors++; return rc; }
    if (id_out) *id_out = id;
    return KVT_OK;
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

/* The preview of an entry: the text of its first 64 tokens, printable. */
static void save_preview(save_job *j)
{
    char head_text[256];
    size_t hl = 0;
    for (size_t i = 0; i < j->n && i < 64 && hl < sizeof head_text; i++) {
        const char *pc;
        size_t pl;
        if (kvt_token_piece(j->s->m, j->s->tokens[i], &pc, &pl) != KVT_OK) continue;
        if (pl > sizeof head_text - hl) pl = sizeof head_text - hl;
        memcpy(head_text + hl, pc, pl);
        hl += pl;
    }
    preview_of(head_text, hl, j->preview, sizeof j->preview);
}

/* Encode the record, and the room the save needs for it and its blocks
 * (an upper bound: blocks stored already are not written again), measured
 * before anything is written. */
static int save_encode(kvt_store *st, save_job *j)
{
    int rc = kvt_snap_encode(j->s, j->n, 0, &j->rec, NULL);
    if (rc) return rc;
    save_preview(j);
    j->need = j->rec.len + ROOM_SLACK + wal_headroom(st);
    if (j->nb) {
        uint64_t key;
        size_t n;
        if (!(j->runs = kvt_calloc(kvt_snap_block_runs_max(j->s) + 2, sizeof *j->runs))) return KVT_ENOMEM;
        j->blk.len = 0;
        if ((rc = kvt_snap_block_parts(j->s, 0, kvt_snap_key0(j->s->m), &j->blk, &key, j->runs + 1, &n))) return rc;
        uint64_t bytes = j->blk.len + 8;
        for (size_t i = 1; i <= n; i++) bytes += j->runs[i].iov_len;
        j->need += (uint64_t)j->nb * (bytes + 2048); /* the text of a block varies */
    }
    return KVT_OK;
}

/* Whether block b, stored already with its row r (seg, off, bytes), must
 * be written anew; *w receives the place its row says. The new snapshot
 * names that place once the record's header there says it is this block
 * and its end is there: a damaged row or a cut segment must not spread to
 * new snapshots (damage inside a record is met by the load, which removes
 * the block). */
static bool block_moved(kvt_store *st, sqlite3_stmt *r, uint64_t key, bloc *w)
{
    uint8_t head[KVT_SNAP_BLOCK_HEAD], end[8];
    if (!kvt_db_row_bloc(r, 0, 1, 2, w)) return true;
    if (!w->seg) return false;
    /* its last bytes read too: a segment cut short is seen */
    return w->bytes < sizeof head || kvt_segs_read(st->segs, w->seg, w->off, head, sizeof head) ||
           !kvt_snap_block_names(head, key, (size_t)w->bytes) ||
           kvt_segs_read(st->segs, w->seg, w->off + w->bytes - sizeof end, end, sizeof end);
}

bool kvt_store_fault_copy_rows;

static void sum_piece(void *arg, const void *p, size_t len) { XXH3_64bits_update(arg, p, len); }

/* Write block b (its key follows prev) to the segment and its row: a new
 * row, or (again) the row of a block stored already, moved to it. The
 * rows go from the session's pages to the file, never copied on the way;
 * the checksum is taken as they are written, at the writes' priority
 * (kvt_segs_background), then written after them. */
static int write_block(kvt_store *st, save_job *j, size_t b, uint64_t prev, bool again, bloc *w)
{
    uint64_t key;
    size_t n;
    if (kvt_store_fault_copy_rows) { /* tests: the record copied whole first, as before */
        j->blk.len = 0;
        int rc = kvt_snap_block(j->s, (uint32_t)b, prev, &j->blk, &key);
        if (!rc) rc = kvt_db_seg_append(st, j->blk.p, j->blk.len, w);
        if (rc) return rc;
        goto row;
    }
    if (!j->runs && !(j->runs = kvt_calloc(kvt_snap_block_runs_max(j->s) + 2, sizeof *j->runs))) return KVT_ENOMEM;
    j->blk.len = 0;
    int rc = kvt_snap_block_parts(j->s, (uint32_t)b, prev, &j->blk, &key, j->runs + 1, &n);
    if (rc) return rc;
    XXH3_state_t sum;
    XXH3_64bits_reset(&sum);
    j->runs[0] = (struct iovec){j->blk.p, j->blk.len};
    bloc tail;
    uint8_t le[8];
    if (!(rc = kvt_db_seg_appendv(st, j->runs, (int)n + 1, sum_piece, &sum, w))) {
        uint64_t h = XXH3_64bits_digest(&sum);
        for (int i = 0; i < 8; i++) le[i] = (uint8_t)(h >> (8 * i));
        rc = kvt_db_seg_append(st, le, sizeof le, &tail);
    }
    if (rc) return rc;
    w->bytes += sizeof le;
row:;
    sqlite3_stmt *ins = kvt_db_prep(st, again ? "UPDATE blocks SET bytes = ?2, data = X'', seg = ?3, off = ?4 WHERE key = ?1"
                                              : "INSERT INTO blocks(key, refs, bytes, data, seg, off) VALUES(?, 0, ?, X'', ?, ?)",
                                    "save block");
    if (ins) {
        sqlite3_bind_int64(ins, 1, (int64_t)j->keys[b]);
        sqlite3_bind_int64(ins, 2, (int64_t)w->bytes);
        sqlite3_bind_int64(ins, 3, w->seg);
        sqlite3_bind_int64(ins, 4, (int64_t)w->off);
        kvt_db_step(st, ins, "save block");
    }
    sqlite3_finalize(ins);
    return KVT_OK;
}

/* The blocks of a new entry: each stored once in the store (a block
 * stored already is named where it is), new ones appended to the segment;
 * their places go to j->locs. */
static int save_blocks(kvt_store *st, save_job *j)
{
    int rc = KVT_OK;
    uint64_t prev = kvt_snap_key0(j->s->m);
    sqlite3_stmt *has = kvt_db_prep(st, "SELECT seg, off, bytes FROM blocks WHERE key = ?", "save block");
    for (size_t b = 0; b < j->nb && !rc && !st->sql_rc; b++) {
        sqlite3_reset(has);
        sqlite3_bind_int64(has, 1, (int64_t)j->keys[b]);
        int r = kvt_db_step(st, has, "save block");
        if (r != SQLITE_ROW && r != SQLITE_DONE) break;
        bloc w;
        bool again = r == SQLITE_ROW && block_moved(st, has, j->keys[b], &w);
        if (r == SQLITE_DONE || again) rc = write_block(st, j, b, prev, again, &w);
        if (rc) break;
        kvt_db_locs_put(&j->locs, &w);
        prev = j->keys[b];
    }
    sqlite3_finalize(has);
    if (!rc && j->locs.oom) rc = kvt_fail(KVT_ENOMEM, "block places");
    return rc;
}

/* The new entry's row (its record at rw, its blocks at j->locs); its id, or
 * -1 on a failure (noted). */
static int64_t insert_snap(kvt_store *st, const save_job *j, int64_t t, const bloc *rw)
{
    int64_t id = -1;
    sqlite3_stmt *ins = kvt_db_prep(st, "INSERT INTO snaps(model, head, n_tokens, tail, n_blocks, reason, created,"
                                        " last_used, used_at, bytes, preview, data, locs, rseg, roff)"
                                        " VALUES(?,?,?,?,?,?,?,?,?,?,?,X'',?,?,?)",
                                    "save snapshot");
    if (!ins) return -1;
    double now = kvt_db_now_unix();
    sqlite3_bind_int64(ins, 1, (int64_t)j->s->m->fingerprint);
    sqlite3_bind_int64(ins, 2, j->head);
    sqlite3_bind_int64(ins, 3, (int64_t)j->n);
    sqlite3_bind_int64(ins, 4, j->tail);
    sqlite3_bind_int64(ins, 5, (int64_t)j->nb);
    sqlite3_bind_text(ins, 6, j->reason ? j->reason : "manual", -1, SQLITE_TRANSIENT);
    sqlite3_bind_double(ins, 7, now);
    sqlite3_bind_int64(ins, 8, t);
    sqlite3_bind_double(ins, 9, now);
    sqlite3_bind_int64(ins, 10, (int64_t)j->rec.len);
    sqlite3_bind_text(ins, 11, j->preview, -1, SQLITE_TRANSIENT);
    if (j->locs.len) sqlite3_bind_blob(ins, 12, j->locs.p, (int)j->locs.len, SQLITE_STATIC);
    else sqlite3_bind_null(ins, 12);
    sqlite3_bind_int64(ins, 13, rw->seg);
    sqlite3_bind_int64(ins, 14, (int64_t)rw->off);
    if (kvt_db_step(st, ins, "save snapshot") == SQLITE_DONE) id = sqlite3_last_insert_rowid(st->db);
    sqlite3_finalize(ins);
    return id;
}

/* A new entry (inside the save's transaction): the record, then new
 * blocks, go to the end of the current segment (kvt_db_seg_append: synced
 * before the rows that name them commit, cut back if they do not), then
 * the rows; its ancestors are thinned and the budget kept. */
static int save_new(kvt_store *st, save_job *j, int64_t t, int64_t *id)
{
    /* the record first: a load reads it, then the blocks, so a first
     * save's are read in the order they lie */
    bloc rw = {0};
    int rc = kvt_db_seg_append(st, j->rec.p, j->rec.len, &rw);
    if (!rc) rc = save_blocks(st, j);
    if (rc) return rc;
    *id = insert_snap(st, j, t, &rw);
    for (size_t b = 0; b < j->nb && !st->sql_rc; b++) {
        int64_t a[3] = {*id, (int64_t)b, (int64_t)j->keys[b]};
        kvt_db_q(st, NULL, "INSERT INTO snap_blocks(snap, idx, key) VALUES(?, ?, ?)", 3, a);
        kvt_db_q(st, NULL, "UPDATE blocks SET refs = refs + 1 WHERE key = ?", 1, &a[2]);
    }
    if (!st->sql_rc && j->s->m->arch->state_rebuild) rc = thin_ancestors(st, j->s->m, j->s->tokens, j->n, j->keys, *id);
    if (!rc) {
        kvt_db_counter_add(st, "saves", 1);
        enforce_budget(st, *id);
    }
    return rc;
}

/* An entry stored already (inside the save's transaction): only its use
 * moves, unless a cold save meets another kind of entry: it becomes a
 * whole cold one, as if saved cold first (fork points stay whole). */
static void save_touch(kvt_store *st, save_job *j, int64_t t, int64_t id)
{
    int64_t a[2] = {t, id};
    kvt_db_q(st, NULL, "UPDATE snaps SET last_used = ? WHERE id = ?", 2, a);
    if (cold_meets_other(st, j, id, 0))
        replace_record(st, id, j->rec.p, j->rec.len,
                       "UPDATE snaps SET reason = 'cold', replay = 0, data = X'', bytes = ?1, rseg = ?2, roff = ?3"
                       " WHERE id = ?4");
}

/* One attempt at the save, inside the write transaction it ends:
 * committed, or rolled back. *id receives the entry, *fresh whether it is
 * new. */
static int save_txn(kvt_store *st, save_job *j, int64_t *id, bool *fresh)
{
    int rc = KVT_OK;
    j->locs.len = 0;
    *id = stored_id(st, j);
    int64_t t = kvt_db_tick(st);
    *fresh = *id < 0;
    if (st->sql_rc) {
        /* the transaction rolls back below */
    } else if (!*fresh && kvt_db_q_int(st, "SELECT COUNT(*) FROM snaps WHERE id = ?", 1, id, 0) != 1 && !st->sql_rc) {
        /* the unique index names a row the table does not hold: damage,
         * which the rebuild (and the save after it) mends */
        kvt_db_sql_note(st, SQLITE_CORRUPT, "save snapshot: the index names a snapshot the table lacks");
    } else if (!*fresh) {
        save_touch(st, j, t, *id);
    } else {
        rc = save_new(st, j, t, id);
    }
    if (rc) {
        kvt_db_rollback(st);
        return rc;
    }
    kvt_db_flush_counters(st);
    return kvt_db_commit(st);
}

static int store_save(kvt_store *st, kvt_session *s, size_t n, const char *reason, int64_t *id_out, bool *created)
{
    if (created) *created = false;
    if (!kvt_snap_can_save(s, n))
        return kvt_fail(KVT_EINVAL, "cannot save %zu tokens: the session holds %zu and no checkpoint there", n, s->n);
    save_job j = {.s = s, .n = n, .nb = n / KVT_BLOCK, .reason = reason};
    if (!(j.keys = kvt_snap_keys(s, j.nb))) return kvt_fail(KVT_EINVAL, "cannot save %zu tokens of %zu", n, s->n);
    save_identity(&j);
    int rc = stored_already(st, &j, id_out);
    if (rc != 1) return rc;
    int64_t id = -1;
    bool fresh = false;
    if ((rc = save_encode(st, &j))) goto out;
    st->full = false;
    kvt_segs_took_full(st->segs);
    if ((rc = make_room(st, j.need, -1, false))) {
        st->save_errors++;
        goto out;
    }
    for (bool retried = false;; retried = true) {
        if ((rc = kvt_db_begin(st)) || !(rc = save_txn(st, &j, &id, &fresh)) || !st->full || retried ||
            kvt_store_room_fault)
            break;
        /* the disk filled meanwhile (another writer, or the estimate was
         * short): evict what the save needs and try once more */
        st->full = false;
        st->sql_rc = 0;
        if (make_room(st, j.need, -1, true) != KVT_OK) break;
        st->sql_rc = 0;
    }
    if (rc) {
        st->save_errors++;
        goto out;
    }
    if (fresh) index_add(st, (ientry){(uint64_t)j.head, (uint64_t)j.tail, (uint32_t)n, id});
    if (id_out) *id_out = id;
    if (created) *created = fresh;
out:
    kvt_wbuf_free(&j.rec);
    kvt_wbuf_free(&j.blk);
    free(j.runs);
    kvt_wbuf_free(&j.locs);
    return rc;
}

/* ---- lookup ---- */

static int refresh_index(kvt_store *st)
{
    int64_t dv = kvt_db_q_int(st, "PRAGMA data_version", 0, NULL, -2);
    if (st->sql_rc) return kvt_db_sql_status(st);
    if (!st->dirty && dv == st->data_version) return KVT_OK;
    int64_t count = kvt_db_q_int(st, "SELECT COUNT(*) FROM snaps", 0, NULL, 0);
    if (st->sql_rc) return kvt_db_sql_status(st);
    size_t cap = (count > 0 ? (size_t)count : 0) + 16, n = 0, bytes;
    ientry *idx = kvt_mul_ok(cap, sizeof *idx, &bytes) ? kvt_malloc(bytes) : NULL;
    if (!idx) return kvt_fail(KVT_ENOMEM, "cache index of %zu entries", cap);
    sqlite3_stmt *stmt = kvt_db_prep(st, "SELECT head, n_tokens, tail, id FROM snaps", "index");
    while (kvt_db_step(st, stmt, "index") == SQLITE_ROW) {
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
        return kvt_db_sql_status(st);
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

/* Whether record id's tail ids begin with ids (k of them): read from the
 * head of its record alone (kvt_snap_parse_head: its header and the tokens
 * section, checksums included), never its rows. Any failure (a record
 * damaged, or removed and its place reused since the index was read) is a
 * no: the load would refuse it anyway. */
bool kvt_store_tail_ids_fault;

static bool tail_begins(kvt_store *st, int64_t id, uint32_t n_rec, const int32_t *ids, size_t k)
{
    if (kvt_store_tail_ids_fault) return true;
    sqlite3_stmt *stmt = NULL;
    int64_t args[2] = {KVT_SNAP_TAIL_HEAD, id};
    if (kvt_db_q(st, &stmt, "SELECT substr(data, 1, ?), rseg, roff, bytes FROM snaps WHERE id = ?", 2, args) !=
        SQLITE_ROW)
        return false;
    uint8_t head[KVT_SNAP_TAIL_HEAD];
    size_t len = (size_t)sqlite3_column_bytes(stmt, 0);
    bloc w;
    bool ok = kvt_db_row_bloc(stmt, 1, 2, 3, &w) && len <= sizeof head;
    if (ok && w.seg) { /* in a segment: its first bytes */
        len = w.bytes < sizeof head ? (size_t)w.bytes : sizeof head;
        struct iovec v = {head, len};
        ok = kvt_segs_readv(st->segs, w.seg, w.off, &v, 1) == KVT_OK;
    } else if (ok) {
        memcpy(head, sqlite3_column_blob(stmt, 0), len);
    }
    sqlite3_finalize(stmt);
    kvt_snap_info in;
    if (!ok || kvt_snap_parse_head(head, len, &in) != KVT_OK || in.n != n_rec || in.sec_len[1] < 4 * k) return false;
    for (size_t i = 0; i < k; i++)
        if (kvt_rd32(in.sec[1] + 4 * i) != (uint32_t)ids[i]) return false;
    return true;
}

/* At most this many records longer than a prompt are read for their ids
 * in one lookup (each a read of KVT_SNAP_TAIL_HEAD bytes). */
#define LONGER_TRIES 4

/* The longest record of a prefix of tokens (*match tokens, *id; 0 and -1:
 * none); longer: also one that goes on past them within their last block
 * (below), for the first lookup of a prompt (a restore that fails to load
 * it looks again without). */
static int store_lookup(kvt_store *st, const kvt_model *m, const int32_t *tokens, size_t n, bool longer, size_t *match,
                        int64_t *id)
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
        size_t start = b * KVT_BLOCK;
        for (size_t k = end; k-- > lo;) {
            const ientry *e = &st->idx[k];
            if (e->n > n || e->n < start || e->n - start >= KVT_BLOCK || e->n == 0 || skipped(st, e->id)) continue;
            if (kvt_snap_tail_hash(heads[b], tokens + start, e->n - start) == e->tail) {
                *match = e->n;
                *id = e->id;
                break;
            }
        }
        /* A record that goes on past the prompt within its last block (the
         * session saved after the reply, at a shutdown or an eviction)
         * holds the whole prompt when its first ids are the prompt's: for a
         * model whose rows are per token (no window, no recurrent state, no
         * compressed rows), the session goes back to the prompt from it and
         * computes the prompt's last token again (kvt_session_sync), rather
         * than prefilling from a shorter record. Its ids are read from the
         * record (the index's tail hash covers all of them); the shortest
         * first. */
        if (!longer || b != nb || *match == n || !kvt_snap_rows_per_token(m)) continue;
        for (size_t k = lo, tries = 0; k < end && tries < LONGER_TRIES; k++) {
            const ientry *e = &st->idx[k];
            if (e->n <= n || e->n - start >= KVT_BLOCK || skipped(st, e->id)) continue;
            tries++;
            if (tail_begins(st, e->id, e->n, tokens + start, n - start)) {
                *match = n;
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
    if (!g->stmt && !(g->stmt = kvt_db_prep(g->st, "SELECT data FROM blocks WHERE key = ?", "load block")))
        return kvt_db_sql_status(g->st);
    sqlite3_reset(g->stmt);
    sqlite3_bind_int64(g->stmt, 1, (int64_t)key);
    int r = kvt_db_step(g->st, g->stmt, "load block");
    if (r != SQLITE_ROW)
        return r == SQLITE_DONE ? kvt_fail(KVT_EFORMAT, "block %u (key %016llx) is missing", b, (unsigned long long)key)
                                : kvt_db_sql_status(g->st);
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
        return kvt_db_sql_note(st, rc, "load block");
    }
    size_t n = (size_t)sqlite3_blob_bytes(g->blob);
    if (n == 0) return kvt_fail(KVT_EFORMAT, "block %u (key %016llx) is empty", b, (unsigned long long)key);
    if (n > *cap) {
        uint8_t *nb = realloc(*buf, n);
        if (!nb) return kvt_fail(KVT_ENOMEM, "block %u: %zu bytes", b, n);
        *buf = nb;
        *cap = n;
    }
    if ((rc = sqlite3_blob_read(g->blob, *buf, (int)n, 0)) != SQLITE_OK) return kvt_db_sql_note(st, rc, "load block");
    *len = n;
    return KVT_OK;
}

static int read_block(void *user, uint32_t b, uint64_t key, const kvt_block_rows *rows, uint8_t **buf, size_t *cap,
                      size_t *len, bool *in_place)
{
    struct getter *g = user;
    kvt_store *st = g->st;
    *in_place = false;
    if (st->sql_rc) return kvt_db_sql_status(st);
    bloc w;
    if (b < g->n_locs && kvt_db_locs_at(g->locs, b, &w) && w.seg) { /* in a segment, where the snapshot says */
        if (w.bytes > BLOCK_MAX) return kvt_fail(KVT_EFORMAT, "block %u: %llu bytes", b, (unsigned long long)w.bytes);
        /* a record too short to hold the rows is read whole, and fails its checks */
        *in_place = rows && rows->bytes <= BLOCK_MAX && w.bytes >= rows->bytes + 8;
        int rc = kvt_db_read_bloc_into(st, &w, *in_place ? rows : NULL, buf, cap);
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
    if (kvt_db_begin(st) == KVT_OK) {
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
            int r = kvt_db_q(st, &at, "SELECT seg, off, bytes FROM blocks WHERE key = ?", 1, &k);
            if (r != SQLITE_ROW) {
                has_key = false;
            } else if (kvt_db_row_bloc(at, 0, 1, 2, &now) && now.seg == where->seg && now.off == where->off &&
                       now.bytes == where->bytes) {
                /* the row names where the damage is */
            } else {
                sqlite3_stmt *row = kvt_db_prep(st, kvt_db_block_row_sql(st), "quarantine");
                uint8_t *buf = NULL;
                size_t cap = 0;
                if (row) {
                    sqlite3_bind_int64(row, 1, k);
                    if (kvt_db_step(st, row, "quarantine") == SQLITE_ROW &&
                        kvt_db_check_block_row(st, row, 0, key, &buf, &cap) >= KVT_OK) /* sound, or a newer kvtier's */
                        has_key = false;
                }
                free(buf);
                sqlite3_finalize(row);
            }
            sqlite3_finalize(at);
        }
        sqlite3_stmt *ins = kvt_db_prep(st, "INSERT INTO quarantine(what, reason, at) VALUES(?, ?, ?)", "quarantine");
        if (ins) {
            char what[64];
            if (has_key) snprintf(what, sizeof what, "block %016llx", (unsigned long long)key);
            else snprintf(what, sizeof what, "snapshot %lld", (long long)id);
            sqlite3_bind_text(ins, 1, what, -1, SQLITE_TRANSIENT);
            sqlite3_bind_text(ins, 2, reason, -1, SQLITE_TRANSIENT);
            sqlite3_bind_double(ins, 3, kvt_db_now_unix());
            kvt_db_step(st, ins, "quarantine");
        }
        sqlite3_finalize(ins);
        if (has_key) {
            int64_t k = (int64_t)key;
            idset victims = {0};
            sqlite3_stmt *sel = kvt_db_prep(st, "SELECT DISTINCT snap FROM snap_blocks WHERE key = ?", "quarantine");
            if (sel) {
                sqlite3_bind_int64(sel, 1, k);
                while (kvt_db_step(st, sel, "quarantine") == SQLITE_ROW) kvt_db_idset_add(&victims, sqlite3_column_int64(sel, 0));
            }
            sqlite3_finalize(sel);
            if (victims.oom) kvt_db_sql_note(st, SQLITE_NOMEM, "quarantine");
            for (size_t i = 0; i < victims.n; i++) drop_snap(st, victims.v[i]);
            free(victims.v);
            kvt_db_delete_placed(st, "DELETE FROM blocks WHERE key = ? RETURNING seg, off, bytes", 1, &k);
        }
        if (id >= 0) drop_snap(st, id);
        kvt_db_counter_add(st, "damaged", 1);
        resync_totals(st, NULL, NULL); /* the damaged row's size may have read back wrong */
        st->keep_places = false;
        kvt_db_commit(st);
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
    if (st->durable) kvt_db_exec(st, "PRAGMA synchronous=NORMAL");
    if (kvt_db_begin(st) == KVT_OK) {
        int64_t a[2] = {kvt_db_tick(st), id};
        kvt_db_q(st, NULL, "UPDATE snaps SET hits = hits + 1, last_used = ? WHERE id = ?", 2, a);
        sqlite3_stmt *u = kvt_db_prep(st, "UPDATE snaps SET used_at = ? WHERE id = ?", NULL);
        if (u) {
            sqlite3_bind_double(u, 1, kvt_db_now_unix());
            sqlite3_bind_int64(u, 2, id);
            kvt_db_step(st, u, NULL);
        }
        sqlite3_finalize(u);
        kvt_db_flush_counters(st);
        kvt_db_commit(st);
    }
    if (st->durable) {
        int rc = sqlite3_exec(st->db, "PRAGMA synchronous=FULL", NULL, NULL, NULL);
        if (rc != SQLITE_OK) kvt_db_sql_note(st, rc, "restore synchronous=FULL");
    }
    if (st->sql_rc && !st->quiet) fprintf(stderr, "kvtier: %s (a use of entry %lld not recorded)\n", st->sql_msg, (long long)id);
}

/* Whether the block row of key holds a record of a newer format whose
 * envelope checks out (a newer kvtier's, stored under a key this build's
 * records name too). */
static bool block_newer(kvt_store *st, uint64_t key)
{
    sqlite3_stmt *row = kvt_db_prep(st, kvt_db_block_row_sql(st), NULL);
    uint8_t *buf = NULL;
    size_t cap = 0;
    bool newer = false;
    if (row) {
        sqlite3_bind_int64(row, 1, (int64_t)key);
        newer = kvt_db_step(st, row, NULL) == SQLITE_ROW && kvt_db_check_block_row(st, row, 0, key, &buf, &cap) == KVT_DB_NEWER;
    }
    free(buf);
    sqlite3_finalize(row);
    return newer;
}

static int store_load(kvt_store *st, int64_t id, kvt_session *s)
{
    sqlite3_stmt *stmt = NULL;
    /* one read transaction: the record and its blocks come from one state of
     * the store whatever other processes commit meanwhile, and the blocks
     * are read without a lock round trip each */
    kvt_db_rollback(st); /* one a failed call left open */
    int rc = kvt_db_exec(st, "BEGIN");
    if (rc) return rc;
    int r = kvt_db_q(st, &stmt, st->has_segs ? "SELECT locs, " SNAP_COLS " FROM snaps WHERE id = ?"
                                      : "SELECT NULL, " SNAP_COLS1 " FROM snaps WHERE id = ?", 1, &id);
    if (r != SQLITE_ROW) {
        rc = st->sql_rc ? kvt_db_sql_status(st) : kvt_fail(KVT_ENOENT, "no cache entry %lld", (long long)id);
        kvt_db_rollback(st);
        return rc;
    }
    size_t locs_len = (size_t)sqlite3_column_bytes(stmt, 0);
    if (locs_len % LOC_BYTES) locs_len = 0; /* not a list of places: each block is looked up by its key */
    uint8_t *locs = kvt_malloc(locs_len + 1);
    if (!locs) { sqlite3_finalize(stmt); kvt_db_rollback(st); return KVT_ENOMEM; }
    if (locs_len) memcpy(locs, sqlite3_column_blob(stmt, 0), locs_len);
    struct getter g = {.st = st, .locs = locs, .n_locs = locs_len / LOC_BYTES};
    const uint8_t *rp = NULL;
    size_t len = 0;
    uint8_t *rbuf = NULL, *rec = NULL;
    size_t rcap = 0;
    rc = kvt_db_row_record(st, stmt, 8, 7, &rbuf, &rcap, &rp, &len);
    /* a record of a newer format (a newer kvtier's) is skipped below and
     * kept; one that fails its envelope is damaged (db.h) */
    kvt_snap_info info;
    if (!rc) rc = kvt_db_snap_row_agrees(stmt, 1, rp, len, &info);
    bool future = rc == KVT_DB_NEWER;
    if (future) rc = kvt_fail(KVT_EFORMAT, "snapshot: format version %u, newer than this build reads (%d): skipped, kept",
                              info.version, KVT_SNAP_VERSION_MAX);
    /* a record of other row types (the model's cache types differ from the
     * ones it was saved with) is a miss for this model, not damage: it is
     * kept for a model of its types, never converted */
    bool other_rows = !rc && !future && (rc = kvt_snap_rows_check(s->m, &info)) != KVT_OK;
    if (!rc && !(rec = kvt_malloc(len ? len : 1))) rc = KVT_ENOMEM;
    if (!rc && len) memcpy(rec, rp, len);
    free(rbuf);
    sqlite3_finalize(stmt);
    if (rc) {
        kvt_snap_empty(s); /* as a load that failed later leaves it (kvtier.h) */
        free(locs);
        kvt_db_rollback(st);
        if (future && !skipped(st, id)) st->skip[st->n_skip++ % 64] = id;
        if (rc == KVT_ENOMEM || rc == KVT_EIO || other_rows || future) { st->misses++; return rc; }
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
        g.concurrent = kvt_db_locs_at(g.locs, i, &w) && w.seg;
    }
    rc = kvt_snap_load_read_start(s, rec, len, read_block, g.concurrent, &g, &rebuild, &bad_block, &bad_key);
    getter_end(&g);
    /* a read that failed is the database's failure, never the record's */
    if (st->sql_rc) rc = kvt_db_sql_status(st);
    char why[512];
    snprintf(why, sizeof why, "%s", kvt_errmsg());
    kvt_db_rollback(st); /* ends the read */
    if (rc == KVT_OK) rc = kvt_snap_load_finish(s, rebuild); /* a replay needs no database */
    else kvt_fail(rc, "%s", why);
    free(rec);
    /* the place of the block that failed, before the places go */
    bloc where = {0};
    if (rc != KVT_OK && bad_block < g.n_locs) kvt_db_locs_at(g.locs, bad_block, &where);
    free(locs);
    if (rc == KVT_OK) {
        st->hits++;
        record_use(st, id);
        return KVT_OK;
    }
    if (rc == KVT_ENOMEM || rc == KVT_ECTX || rc == KVT_EIO) {
        st->misses++;
        return rc;
    }
    char reason[512];
    snprintf(reason, sizeof reason, "%s", kvt_errmsg());
    /* A block that failed its own checks is the culprit; otherwise the record. */
    bool block_bad = bad_block != UINT32_MAX && strncmp(reason, "snapshot", 8) != 0;
    if (block_bad && block_newer(st, bad_key)) { /* a newer kvtier's block under this key: a miss, both kept */
        if (!skipped(st, id)) st->skip[st->n_skip++ % 64] = id;
        st->misses++;
        return kvt_fail(rc, "%s (block of a newer format: skipped, kept)", reason);
    }
    quarantine(st, id, block_bad, bad_key, block_bad && where.seg ? &where : NULL, reason);
    st->misses++;
    return kvt_fail(rc, "%s", reason);
}

/* Restore the longest prefix of tokens the store holds into s. found: the
 * entry a lookup of these tokens found already (match tokens, id; -1:
 * none given), loaded without looking it up again; when it cannot serve
 * (removed since, or damaged), the store is looked up again. */
static int store_restore_prefix(kvt_store *st, kvt_session *s, const int32_t *tokens, size_t n, size_t found_match,
                                int64_t found_id, size_t *reused)
{
    *reused = 0;
    for (int attempt = 0; attempt < 4; attempt++) {
        size_t match = found_match;
        int64_t id = found_id;
        st->sql_rc = 0; /* each attempt stands alone: a removal that failed was reported */
        int rc = attempt == 0 && found_id >= 0 && found_match ? KVT_OK : store_lookup(st, s->m, tokens, n, attempt == 0, &match, &id);
        if (rc == KVT_OK && (!match || match > s->n_ctx || match > n)) return KVT_OK;
        if (rc == KVT_OK) rc = store_load(st, id, s);
        if (rc == KVT_ENOMEM) return rc;
        if (rc == KVT_OK) {
            /* the record may go on past the prompt (store_lookup): the
             * session holds it whole, and a sync of the prompt goes back */
            size_t held = kvt_session_len(s);
            if ((held == match || (held > match && kvt_snap_rows_per_token(s->m))) &&
                !memcmp(kvt_session_tokens(s), tokens, match * sizeof *tokens)) {
                *reused = match;
                return KVT_OK;
            }
            /* a hash collision: never use rows of another prefix */
            kvt_snap_empty(s);
            return KVT_OK;
        }
        if (kvt_recovery_retry(st)) continue; /* the database was damaged: look again in the rebuilt one */
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
    int rc = kvt_db_begin(st);
    if (rc) return rc;
    if (kvt_db_q_int(st, "SELECT COUNT(*) FROM snaps WHERE id = ?", 1, &id, 0) == 0 && !st->sql_rc) {
        kvt_db_rollback(st);
        return kvt_fail(KVT_ENOENT, "no cache entry %lld", (long long)id);
    }
    drop_snap(st, id);
    return kvt_db_commit(st);
}

typedef struct badrec { int64_t id; bool block; char why[200]; } badrec;

typedef struct checked {
    size_t records, bad; /* records read (or that could not be read), of them damaged */
    size_t newer;        /* of them, of a newer format than this build reads: kept */
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
    sqlite3_stmt *stmt = kvt_db_prep(st, sql, what);
    if (!stmt && kvt_db_forget_finding(st) && !st->quiet) fprintf(stderr, "kvtier: %s\n", st->sql_msg);
    return stmt;
}

/* Check every record: each snapshot the database lists (its row against its
 * record, and the record's checksums), then each block that a sound
 * snapshot stands on or that the blocks table holds. A record SQLite cannot
 * read is damaged, and so is a block missing under a snapshot. A record of
 * a newer format whose envelope checks out is counted (o->newer), not
 * damaged: the blocks a newer snapshot stands on are the ones its rows in
 * snap_blocks name (this build cannot read its list). Damage that cuts a
 * list short is reported; a failure other than damage ends the check and
 * is its result. */
static int check_records(kvt_store *st, checked *o)
{
    idset ids = {0}, keys = {0};
    kvt_db_snap_ids(st, &ids, true);
    kvt_db_idset_seal(&ids);
    char why[512];
    sqlite3_stmt *get = prep_inspect(st, st->has_segs ? "SELECT " SNAP_COLS " FROM snaps WHERE id = ?"
                                                      : "SELECT " SNAP_COLS1 " FROM snaps WHERE id = ?", "snapshot");
    sqlite3_stmt *under = prep_inspect(st, "SELECT key FROM snap_blocks WHERE snap = ?", "snapshot blocks");
    uint8_t *rscratch = NULL;
    size_t rscratch_cap = 0;
    for (size_t i = 0; i < ids.n && get && !st->sql_rc; i++) {
        sqlite3_reset(get);
        sqlite3_bind_int64(get, 1, ids.v[i]);
        int r = kvt_db_step(st, get, "snapshot");
        if (r == SQLITE_DONE) continue; /* named by the index only: the integrity check reports that */
        o->records++;
        kvt_snap_info in;
        if (r != SQLITE_ROW) {
            snprintf(why, sizeof why, "cannot be read (%s)", st->sql_msg);
            if (!kvt_db_forget_damage(st)) break;
            found_bad(st, o, ids.v[i], false, why);
        } else if ((r = kvt_db_check_snap_row(st, get, 0, &in, &rscratch, &rscratch_cap)) == KVT_DB_NEWER) {
            o->newer++;
            if (under) {
                sqlite3_reset(under);
                sqlite3_bind_int64(under, 1, ids.v[i]);
                while (kvt_db_step(st, under, "snapshot blocks") == SQLITE_ROW)
                    kvt_db_idset_add(&keys, sqlite3_column_int64(under, 0));
                if (kvt_db_forget_damage(st) && !st->quiet) fprintf(stderr, "kvtier: %s\n", st->sql_msg);
            }
        } else if (r != KVT_OK) {
            found_bad(st, o, ids.v[i], false, kvt_errmsg());
        } else {
            for (uint32_t b = 0; b < in.nb; b++) kvt_db_idset_add(&keys, (int64_t)kvt_rd64(in.sec[6] + 8 * (size_t)b));
        }
    }
    sqlite3_finalize(get);
    sqlite3_finalize(under);
    free(rscratch);
    sqlite3_stmt *all = prep_inspect(st, "SELECT key FROM blocks", "blocks");
    while (kvt_db_step(st, all, "blocks") == SQLITE_ROW) kvt_db_idset_add(&keys, sqlite3_column_int64(all, 0));
    sqlite3_finalize(all);
    if (kvt_db_forget_damage(st) && !st->quiet) fprintf(stderr, "kvtier: %s\n", st->sql_msg);
    kvt_db_idset_seal(&keys);
    sqlite3_stmt *getb = prep_inspect(st, kvt_db_block_row_sql(st), "block");
    uint8_t *scratch = NULL;
    size_t scratch_cap = 0;
    for (size_t i = 0; i < keys.n && getb && !st->sql_rc; i++) {
        sqlite3_reset(getb);
        sqlite3_bind_int64(getb, 1, keys.v[i]);
        int r = kvt_db_step(st, getb, "block");
        o->records++;
        if (r == SQLITE_DONE) {
            found_bad(st, o, keys.v[i], true, "missing (a snapshot stands on it)");
        } else if (r != SQLITE_ROW) {
            snprintf(why, sizeof why, "cannot be read (%s)", st->sql_msg);
            if (!kvt_db_forget_damage(st)) break;
            found_bad(st, o, keys.v[i], true, why);
        } else if ((r = kvt_db_check_block_row(st, getb, 0, (uint64_t)keys.v[i], &scratch, &scratch_cap)) == KVT_DB_NEWER) {
            o->newer++;
        } else if (r != KVT_OK) {
            found_bad(st, o, keys.v[i], true, kvt_errmsg());
        }
    }
    free(scratch);
    sqlite3_finalize(getb);
    bool oom = ids.oom || keys.oom || o->oom;
    free(ids.v);
    free(keys.v);
    if (st->sql_rc) return kvt_db_sql_status(st);
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
    sqlite3_stmt *stmt = kvt_db_prep(st, "PRAGMA integrity_check", "integrity check");
    if (!stmt) snprintf(stop, sizeof stop, "%s", sqlite3_errmsg(st->db));
    int r;
    while ((r = kvt_db_step(st, stmt, "integrity check")) == SQLITE_ROW) {
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
    if (kvt_db_forget_finding(st)) { /* it could not run, or not to its end: that is a finding too */
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
        int64_t bad = kvt_db_q_int(st, "SELECT COUNT(*) FROM totals WHERE NOT (one = 1)", 0, NULL, 0);
        kvt_db_forget_finding(st);
        for (int64_t i = 0; i < bad; i++) {
            kvt_wbuf_put(&out, line, sizeof line - 1);
            (*problems)++;
        }
    }
    kvt_wbuf_put(&out, "", 1);
    int rc = kvt_db_sql_status(st);
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
    int64_t current = kvt_db_q_int(st, "SELECT v FROM meta WHERE k = 'seg'", 0, NULL, 1);
    sqlite3_stmt *q = kvt_db_prep(st, "SELECT seg, off, bytes FROM blocks WHERE seg IS NOT NULL"
                               " UNION ALL SELECT rseg, roff, bytes FROM snaps WHERE rseg IS NOT NULL ORDER BY 1, 2", "gc");
    uint32_t seg = 0, used[64];
    size_t n_used = 0;
    uint64_t end = 0;
    while (kvt_db_step(st, q, "gc") == SQLITE_ROW) {
        bloc w;
        if (!kvt_db_row_bloc(q, 0, 1, 2, &w) || !w.seg) continue;
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
    if (problems) { /* rebuilt from the records that check out (the caller's kvt_recovery_rebuild) */
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
    /* a newer kvtier's records stay (the budget below may still evict them) */
    if (o.newer && !st->quiet)
        fprintf(stderr, "kvtier: %zu record%s of a newer format (kept)\n", o.newer, o.newer == 1 ? "" : "s");
    if (st->sql_rc) return kvt_db_sql_status(st);
    if ((rc = kvt_db_begin(st))) return rc;
    enforce_budget(st, -1);
    kvt_db_q(st, NULL, "DELETE FROM snap_blocks WHERE snap NOT IN (SELECT id FROM snaps)", 0, NULL);
    kvt_db_q(st, NULL, "UPDATE blocks SET refs = (SELECT COUNT(*) FROM snap_blocks WHERE snap_blocks.key = blocks.key)", 0, NULL);
    kvt_db_delete_placed(st, "DELETE FROM blocks WHERE refs <= 0 RETURNING seg, off, bytes", 0, NULL);
    totals was, now;
    bool repaired = resync_totals(st, &was, &now);
    kvt_db_flush_counters(st);
    if ((rc = kvt_db_commit(st))) return rc;
    if (repaired && !st->quiet)
        fprintf(stderr, "kvtier: cache totals were %lld B in %lld snapshots, %lld blocks, %lld references; the tables"
                        " hold %lld B, %lld, %lld, %lld: set to those\n", (long long)was.bytes, (long long)was.snaps,
                (long long)was.blocks, (long long)was.refs, (long long)now.bytes, (long long)now.snaps,
                (long long)now.blocks, (long long)now.refs);
    st->dirty = true;
    /* and the free space the file system is to keep */
    if ((rc = make_room(st, 0, -1, false)) && !st->quiet) fprintf(stderr, "kvtier: %s\n", kvt_errmsg());
    /* under the write lock, with nothing written: no save appends meanwhile */
    if (kvt_db_begin(st) == KVT_OK) {
        reclaim_segments(st);
        kvt_db_rollback(st);
    }
    if (st->sql_rc) return kvt_db_sql_status(st);
    return kvt_db_exec(st, "PRAGMA wal_checkpoint(TRUNCATE)");
}

static int store_verify(kvt_store *st, size_t *bad, size_t *n_checked, size_t *newer)
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
    kvt_db_forget_finding(st);
    *bad = o.bad;
    *n_checked = o.records;
    if (newer) *newer = o.newer; /* a newer kvtier's records, in a store it shares: not damage */
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
    sqlite3_stmt *stmt = kvt_db_prep(st, "SELECT value FROM counters WHERE name = ?", "stats");
    for (size_t i = 0; i < sizeof c / sizeof c[0] && stmt; i++) {
        *c[i].dst = c[i].pending;
        sqlite3_reset(stmt);
        sqlite3_bind_text(stmt, 1, c[i].name, -1, SQLITE_STATIC);
        if (kvt_db_step(st, stmt, "stats") == SQLITE_ROW) *c[i].dst += (uint64_t)sqlite3_column_int64(stmt, 0);
    }
    sqlite3_finalize(stmt);
    return kvt_db_sql_status(st);
}

static int store_list(kvt_store *st, kvt_store_entry **out, size_t *n)
{
    *out = NULL;
    *n = 0;
    int64_t count = kvt_db_q_int(st, "SELECT COUNT(*) FROM snaps", 0, NULL, 0);
    if (st->sql_rc) return kvt_db_sql_status(st);
    size_t cap = (count > 0 ? (size_t)count : 0) + 1, k = 0;
    kvt_store_entry *e = kvt_calloc(cap, sizeof *e);
    if (!e) return KVT_ENOMEM;
    sqlite3_stmt *stmt = kvt_db_prep(st, "SELECT id, model, bytes, hits, n_tokens, n_blocks, created, used_at, reason, preview,"
                                  " (SELECT COUNT(*) FROM snap_blocks sb JOIN blocks b ON b.key = sb.key"
                                  "   WHERE sb.snap = snaps.id AND b.refs > 1)"
                                  ", replay"
                                  " FROM snaps ORDER BY last_used DESC", NULL);
    while (kvt_db_step(st, stmt, NULL) == SQLITE_ROW) {
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
        return kvt_db_sql_status(st);
    }
    *out = e;
    *n = k;
    return KVT_OK;
}

static int store_text(kvt_store *st, int64_t id, char **text, size_t *len)
{
    sqlite3_stmt *stmt = NULL, *blk = NULL;
    int r = kvt_db_q(st, &stmt, st->has_segs ? "SELECT data, rseg, roff, bytes FROM snaps WHERE id = ?"
                                      : "SELECT data, NULL, NULL, bytes FROM snaps WHERE id = ?", 1, &id);
    if (r != SQLITE_ROW) return st->sql_rc ? kvt_db_sql_status(st) : kvt_fail(KVT_ENOENT, "no cache entry %lld", (long long)id);
    kvt_snap_info in;
    kvt_wbuf out = {0};
    uint8_t *rbuf = NULL;
    size_t rcap = 0, rlen = 0;
    const uint8_t *rp = NULL;
    int rc = kvt_db_row_record(st, stmt, 0, 3, &rbuf, &rcap, &rp, &rlen);
    if (!rc && (rc = kvt_db_newer_snap(rp, rlen)) == KVT_DB_NEWER)
        rc = kvt_fail(KVT_EUNSUPPORTED, "cache entry %lld is of a newer format (version %u) than this build reads:"
                      " kept for the kvtier that wrote it", (long long)id, kvt_rd32(rp + 8));
    if (!rc) rc = rp ? kvt_snap_parse_raw(rp, rlen, &in) : kvt_fail(KVT_EFORMAT, "snapshot: empty record");
    if (!rc && !(blk = kvt_db_prep(st, kvt_db_block_row_sql(st), NULL))) rc = kvt_db_sql_status(st);
    uint8_t *scratch = NULL;
    size_t scratch_cap = 0;
    /* the prefix's text: every block's text, then the tail's */
    for (uint32_t b = 0; !rc && b < in.nb; b++) {
        sqlite3_reset(blk);
        sqlite3_bind_int64(blk, 1, (int64_t)kvt_rd64(in.sec[6] + 8 * (size_t)b));
        const uint8_t *t;
        size_t tl;
        int s = kvt_db_step(st, blk, NULL);
        bloc w;
        if (s != SQLITE_ROW) rc = s == SQLITE_DONE ? kvt_fail(KVT_EFORMAT, "block %u is missing", b) : kvt_db_sql_status(st);
        else if (!kvt_db_row_bloc(blk, 2, 3, 0, &w)) rc = kvt_fail(KVT_EFORMAT, "block %u: its row's place is out of range", b);
        else if (w.seg && (rc = kvt_db_read_bloc_into(st, &w, NULL, &scratch, &scratch_cap))) {
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
    kvt_db_op_start(st, name);
    int rc = kvt_db_follow(st);
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
    if (!rc && (rc = store_save(st, s, n, reason, id_out, created)) && kvt_recovery_retry(st))
        rc = store_save(st, s, n, reason, id_out, created);
    return leave(st, rc);
}

int kvt_store_lookup(kvt_store *st, const kvt_model *m, const int32_t *tokens, size_t n, size_t *match, int64_t *id)
{
    *match = 0;
    *id = -1;
    int rc = enter(st, "lookup", false);
    if (!rc && (rc = store_lookup(st, m, tokens, n, true, match, id)) && kvt_recovery_retry(st))
        rc = store_lookup(st, m, tokens, n, true, match, id);
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
            rc = store_lookup(st, m, tokens, n, true, match, id);
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
    if (!rc && (rc = store_load(st, id, s)) == KVT_EIO && kvt_recovery_retry(st)) rc = store_load(st, id, s);
    return leave(st, rc);
}

int kvt_store_restore_found(kvt_store *st, kvt_session *s, const int32_t *tokens, size_t n, size_t found_match,
                            int64_t found_id, size_t *reused)
{
    *reused = 0;
    int rc = enter(st, "restore", false);
    if (!rc) {
        rc = store_restore_prefix(st, s, tokens, n, found_match, found_id, reused);
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
    if (!rc && (rc = store_rm(st, id)) && kvt_recovery_retry(st)) rc = store_rm(st, id);
    return leave(st, rc);
}

int kvt_store_gc(kvt_store *st)
{
    int rc = enter(st, "gc", true);
    if (!rc && (rc = store_gc(st)) && kvt_recovery_retry(st)) rc = store_gc(st);
    return leave(st, rc);
}

int kvt_store_verify(kvt_store *st, size_t *bad, size_t *checked, size_t *newer)
{
    *bad = *checked = 0;
    if (newer) *newer = 0;
    int rc = enter(st, "verify", false);
    if (!rc) rc = store_verify(st, bad, checked, newer);
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

/* The figures, under st->mu; kept for kvt_store_stats_try. */
static int stats_locked(kvt_store *st, kvt_store_stats *o)
{
    int rc = enter_locked(st, "stats", false);
    if (!rc && (rc = store_stats_get(st, o)) && kvt_recovery_retry(st)) rc = store_stats_get(st, o);
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
    if (!rc && (rc = store_list(st, out, n)) && kvt_recovery_retry(st)) rc = store_list(st, out, n);
    return leave(st, rc);
}

int kvt_store_text(kvt_store *st, int64_t id, char **text, size_t *len)
{
    int rc = enter(st, "show", false);
    if (!rc && (rc = store_text(st, id, text, len)) == KVT_EIO && kvt_recovery_retry(st)) rc = store_text(st, id, text, len);
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
        totals a, b;
        get_totals(st, &a);
        read_totals(st, totals_sum, &b);
        *recorded = (kvt_store_stats){.snapshots = (uint64_t)a.snaps, .blocks = (uint64_t)a.blocks,
                                      .block_refs = (uint64_t)a.refs, .bytes = (uint64_t)a.bytes};
        *counted = (kvt_store_stats){.snapshots = (uint64_t)b.snaps, .blocks = (uint64_t)b.blocks,
                                     .block_refs = (uint64_t)b.refs, .bytes = (uint64_t)b.bytes};
        rc = kvt_db_sql_status(st);
    }
    return leave(st, rc);
}
