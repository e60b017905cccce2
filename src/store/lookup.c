/* Lookup in the disk tier: the longest stored prefix of a prompt.
 *
 * Lookup never scans: each process keeps an index of (head key, length,
 * tail hash) for all snapshots. Its own saves and removals update it as they
 * commit (kvt_lookup_index_add; db.c takes removals out); it is rebuilt only
 * when PRAGMA data_version says another connection changed the database. A
 * prompt is hashed once along its 128-token blocks; each block boundary is
 * probed in the index, longest first, and a candidate's tail is hashed only
 * when its head matches. See lookup.h.
 */
#include "store/lookup.h"
#include "store/testing.h"
#include "arch/model.h"
#include "base/util.h"

#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

/* ---- the index ---- */

static int cmp_ientry(const void *a, const void *b)
{
    const ientry *x = a, *y = b;
    if (x->head != y->head) return x->head < y->head ? -1 : 1;
    return (x->n > y->n) - (x->n < y->n);
}


/* A snapshot this process committed joins the index in place: a save costs
 * the next lookup no rebuild. */
void kvt_lookup_index_add(kvt_store *st, ientry e)
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

bool kvt_lookup_skipped(const kvt_store *st, int64_t id)
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
int kvt_lookup_find(kvt_store *st, const kvt_model *m, const int32_t *tokens, size_t n, bool longer, size_t *match,
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
            if (e->n > n || e->n < start || e->n - start >= KVT_BLOCK || e->n == 0 || kvt_lookup_skipped(st, e->id)) continue;
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
            if (e->n <= n || e->n - start >= KVT_BLOCK || kvt_lookup_skipped(st, e->id)) continue;
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
