/* Loading a stored snapshot into a session, and the restore of a prompt's
 * longest stored prefix (a lookup, lookup.h, then a load). A load reads
 * the snapshot's blocks from the places its row lists, each with one read
 * straight into the rows, on two threads; the rows are one allocation
 * (kvt_cache_reserve). A record or block that fails its checks is
 * quarantined (evict.h); one of a newer format is passed over and kept.
 * See load.h and docs/STORE.md.
 */
#include "store/load.h"
#include "store/evict.h"
#include "store/lookup.h"
#include "store/recovery.h"
#include "store/segments.h"
#include "arch/model.h"
#include "base/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* kvt_block_read_fn of the disk tier: the record's bytes as the file or
 * SQLite holds them, unchecked (*checked stays false): the loader's check
 * of each block is its only hash on this path. */
static int read_block(void *user, uint32_t b, uint64_t key, const kvt_block_rows *rows, uint8_t **buf, size_t *cap,
                      size_t *len, bool *in_place, bool *checked)
{
    (void)checked;
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
     * (kvt_load_entry): SQLite is not for this thread */
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

int kvt_load_entry(kvt_store *st, int64_t id, kvt_session *s)
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
        if (future && !kvt_lookup_skipped(st, id)) st->skip[st->n_skip++ % 64] = id;
        if (rc == KVT_ENOMEM || rc == KVT_EIO || other_rows || future) { st->misses++; return rc; }
        char reason[512];
        snprintf(reason, sizeof reason, "%s", kvt_errmsg());
        kvt_evict_quarantine(st, id, false, 0, NULL, reason);
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
        if (!kvt_lookup_skipped(st, id)) st->skip[st->n_skip++ % 64] = id;
        st->misses++;
        return kvt_fail(rc, "%s (block of a newer format: skipped, kept)", reason);
    }
    kvt_evict_quarantine(st, id, block_bad, bad_key, block_bad && where.seg ? &where : NULL, reason);
    st->misses++;
    return kvt_fail(rc, "%s", reason);
}

/* Restore the longest prefix of tokens the store holds into s. found: the
 * entry a lookup of these tokens found already (match tokens, id; -1:
 * none given), loaded without looking it up again; when it cannot serve
 * (removed since, or damaged), the store is looked up again. */
int kvt_load_restore_prefix(kvt_store *st, kvt_session *s, const int32_t *tokens, size_t n, size_t found_match,
                                int64_t found_id, size_t *reused)
{
    *reused = 0;
    for (int attempt = 0; attempt < 4; attempt++) {
        size_t match = found_match;
        int64_t id = found_id;
        st->sql_rc = 0; /* each attempt stands alone: a removal that failed was reported */
        int rc = attempt == 0 && found_id >= 0 && found_match ? KVT_OK : kvt_lookup_find(st, s->m, tokens, n, attempt == 0, &match, &id);
        if (rc == KVT_OK && (!match || match > s->n_ctx || match > n)) return KVT_OK;
        if (rc == KVT_OK) rc = kvt_load_entry(st, id, s);
        if (rc == KVT_ENOMEM) return rc;
        if (rc == KVT_OK) {
            /* the record may go on past the prompt (kvt_lookup_find): the
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
