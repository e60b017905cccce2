/* What the disk tier holds, read for a person: the figures (kvt_store_stats),
 * the entries (kvtier cache ls) and an entry's text (kvtier cache show).
 * See inspect.h.
 */
#include "store/inspect.h"
#include "store/segments.h"
#include "base/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kvt_inspect_stats(kvt_store *st, kvt_store_stats *o)
{
    memset(o, 0, sizeof *o);
    kvt_db_totals t;
    kvt_db_totals_get(st, &t);
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

int kvt_inspect_list(kvt_store *st, kvt_store_entry **out, size_t *n)
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

int kvt_inspect_text(kvt_store *st, int64_t id, char **text, size_t *len)
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
