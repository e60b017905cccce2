/* The checks of the disk tier and the mending they lead to: every record
 * read and checked against its row (kvt_check_verify), SQLite's integrity
 * check (kvt_check_integrity), and gc (kvt_check_gc), which removes the
 * damaged records the checks find, recounts the blocks' references and
 * the totals, keeps the budget and the free space, and gives back the
 * segment space no row names. See check.h and docs/STORE.md.
 */
#include "store/check.h"
#include "store/evict.h"
#include "store/segments.h"
#include "base/util.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
int kvt_check_integrity(kvt_store *st, size_t *problems, char **report)
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

int kvt_check_gc(kvt_store *st)
{
    size_t problems = 0;
    char *report = NULL;
    int rc = kvt_check_integrity(st, &problems, &report);
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
        kvt_evict_quarantine(st, o.list[i].block ? -1 : o.list[i].id, o.list[i].block, (uint64_t)o.list[i].id, NULL, o.list[i].why);
    free(o.list);
    /* a newer kvtier's records stay (the budget below may still evict them) */
    if (o.newer && !st->quiet)
        fprintf(stderr, "kvtier: %zu record%s of a newer format (kept)\n", o.newer, o.newer == 1 ? "" : "s");
    if (st->sql_rc) return kvt_db_sql_status(st);
    if ((rc = kvt_db_begin(st))) return rc;
    kvt_evict_budget(st, -1);
    kvt_db_q(st, NULL, "DELETE FROM snap_blocks WHERE snap NOT IN (SELECT id FROM snaps)", 0, NULL);
    kvt_db_q(st, NULL, "UPDATE blocks SET refs = (SELECT COUNT(*) FROM snap_blocks WHERE snap_blocks.key = blocks.key)", 0, NULL);
    kvt_db_delete_placed(st, "DELETE FROM blocks WHERE refs <= 0 RETURNING seg, off, bytes", 0, NULL);
    kvt_db_totals was, now;
    bool repaired = kvt_db_totals_resync(st, &was, &now);
    kvt_db_flush_counters(st);
    if ((rc = kvt_db_commit(st))) return rc;
    if (repaired && !st->quiet)
        fprintf(stderr, "kvtier: cache totals were %lld B in %lld snapshots, %lld blocks, %lld references; the tables"
                        " hold %lld B, %lld, %lld, %lld: set to those\n", (long long)was.bytes, (long long)was.snaps,
                (long long)was.blocks, (long long)was.refs, (long long)now.bytes, (long long)now.snaps,
                (long long)now.blocks, (long long)now.refs);
    st->dirty = true;
    /* and the free space the file system is to keep */
    if ((rc = kvt_evict_room(st, 0, -1, false)) && !st->quiet) fprintf(stderr, "kvtier: %s\n", kvt_errmsg());
    /* under the write lock, with nothing written: no save appends meanwhile */
    if (kvt_db_begin(st) == KVT_OK) {
        reclaim_segments(st);
        kvt_db_rollback(st);
    }
    if (st->sql_rc) return kvt_db_sql_status(st);
    return kvt_db_exec(st, "PRAGMA wal_checkpoint(TRUNCATE)");
}

int kvt_check_verify(kvt_store *st, size_t *bad, size_t *n_checked, size_t *newer)
{
    checked o = {0};
    int rc = check_records(st, &o);
    free(o.list);
    /* the running totals against the tables (a store that predates them
     * has none to compare) */
    kvt_db_totals a, b;
    if (!rc && !st->quiet && kvt_db_has_totals(st) && kvt_db_totals_recorded(st, &a) && kvt_db_totals_counted(st, &b) &&
        memcmp(&a, &b, sizeof a))
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
