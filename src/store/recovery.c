/* Damage recovery of the disk tier: when SQLite reports the database
 * damaged (SQLITE_CORRUPT, SQLITE_NOTADB), whatever the operation, a new
 * database is built from the records that still read and check out
 * (salvage), the damaged one is moved aside as DIR/kvtier.db.damaged-<time>
 * and the store goes on with the new one (docs/STORE.md). One rebuild at a
 * time per directory; a process that finds the file replaced follows it.
 */
#include "store/recovery.h"
#include "store/db.h"
#include "store/storedir.h"
#include "base/util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

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
static int salvage_rest(kvt_store *st, sqlite3 *nd, int64_t max_used);

/* The keys of a snapshot's blocks in order, as its rows in snap_blocks of
 * the damaged database name them: true when there are n, idx 0..n-1 (a
 * read that fails, or a list with a gap, loses the snapshot). */
typedef struct keylist { int64_t *v; size_t n, cap; } keylist;

static bool newer_keys(kvt_store *st, int64_t id, int64_t n, keylist *out)
{
    out->n = 0;
    if (n < 0 || n > UINT32_MAX) return false;
    sqlite3_stmt *q = NULL;
    bool ok = sqlite3_prepare_v2(st->db, "SELECT idx, key FROM snap_blocks WHERE snap = ? ORDER BY idx", -1, &q, NULL) ==
              SQLITE_OK;
    if (ok) sqlite3_bind_int64(q, 1, id);
    int r = SQLITE_DONE;
    while (ok && (r = sqlite3_step(q)) == SQLITE_ROW) {
        int grc = 0;
        KVT_GROW(out->v, &out->cap, out->n + 1, grc);
        if (grc || sqlite3_column_int64(q, 0) != (int64_t)out->n) ok = false;
        else out->v[out->n++] = sqlite3_column_int64(q, 1);
    }
    sqlite3_finalize(q);
    return ok && r == SQLITE_DONE && (int64_t)out->n == n;
}

static int salvage(kvt_store *st, sqlite3 *nd, size_t *kept, size_t *seen)
{
    idset ids = {0};
    kvt_db_snap_ids(st, &ids, false);
    st->sql_rc = 0;
    for (size_t i = 0; i < st->n_idx; i++) kvt_db_idset_add(&ids, st->idx[i].id);
    kvt_db_idset_seal(&ids);
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
    sqlite3_prepare_v2(st->db, kvt_db_block_row_sql(st), -1, &getb, NULL);
    uint8_t *scratch = NULL, *rscratch = NULL;
    size_t scratch_cap = 0, rscratch_cap = 0;
    int64_t max_used = 0;
    keylist under = {0};
    for (size_t i = 0; i < ids.n && !err && get && getb; i++) {
        sqlite3_reset(get);
        sqlite3_bind_int64(get, 1, ids.v[i]);
        int r = sqlite3_step(get);
        if (r == SQLITE_DONE) continue; /* named by the index only: a row that is gone */
        (*seen)++;
        kvt_snap_info in;
        int c = r == SQLITE_ROW ? kvt_db_check_snap_row(st, get, 1, &in, &rscratch, &rscratch_cap) : KVT_EIO;
        if (c != KVT_OK && c != KVT_DB_NEWER) continue;
        /* the blocks it stands on: its list, or for a record of a newer
         * format (kept for the kvtier that wrote it) its rows in snap_blocks,
         * every one of its blocks in order */
        if (c == KVT_DB_NEWER && !newer_keys(st, ids.v[i], sqlite3_column_int64(get, 5), &under)) continue;
        in.nb = c == KVT_DB_NEWER ? (uint32_t)under.n : in.nb;
        const uint8_t *list = c == KVT_DB_NEWER ? NULL : in.sec[6];
        bool whole = true;
        for (uint32_t b = 0; b < in.nb && whole && !err; b++) {
            int64_t key = list ? (int64_t)kvt_rd64(list + 8 * (size_t)b) : under.v[b];
            sqlite3_reset(w[0]);
            sqlite3_bind_int64(w[0], 1, key);
            int h = sqlite3_step(w[0]);
            if (!nd_ok(nd, h, &err) || h == SQLITE_ROW) continue;
            sqlite3_reset(getb);
            sqlite3_bind_int64(getb, 1, key);
            if (sqlite3_step(getb) != SQLITE_ROW ||
                kvt_db_check_block_row(st, getb, 0, (uint64_t)key, &scratch, &scratch_cap) < KVT_OK) {
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
            int64_t key = list ? (int64_t)kvt_rd64(list + 8 * (size_t)b) : under.v[b];
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
    free(under.v);
    sqlite3_finalize(get);
    sqlite3_finalize(getb);
    for (int k = 0; k < 5; k++) sqlite3_finalize(w[k]);
    free(ids.v);
    return err ? KVT_EIO : salvage_rest(st, nd, max_used);
}

/* After the snapshots (salvage): the blocks of those that were not whole
 * go; the clock (at least max_used, the latest use kept), the current
 * segment, the id sequence (ids are never reused) and the counters come
 * over, where they read. */
static int salvage_rest(kvt_store *st, sqlite3 *nd, int64_t max_used)
{
    int err = 0;
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
int kvt_recovery_rebuild(kvt_store *st)
{
    char why[400];
    snprintf(why, sizeof why, "%s", st->sql_msg[0] ? st->sql_msg : "damaged");
    st->corrupt = false;
    st->sql_rc = 0;
    kvt_db_rollback(st);
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
    if (st->db && !kvt_db_same_file(st)) { /* rebuilt by another process meanwhile */
        kvt_db_close(st, true);
        rc = kvt_db_open(st);
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
        kvt_db_schema_create(nd) == SQLITE_OK &&
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
            sqlite3_bind_double(ins, 2, kvt_db_now_unix());
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
    bool ours = !st->db || kvt_db_same_file(st);
    kvt_db_close(st, false);
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
    rc = kvt_db_open(st);
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
bool kvt_recovery_retry(kvt_store *st)
{
    if (!st->corrupt || st->inspect) return false;
    return kvt_recovery_rebuild(st) == KVT_OK;
}
