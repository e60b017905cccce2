/* What leaves the disk tier, and why: the removal of a snapshot and of the
 * blocks only it stands on (kvt_evict_drop), on request (kvt_evict_rm),
 * least recently used first to keep the budget (kvt_evict_budget) or the
 * free space of the file system (kvt_evict_room, and before an open that
 * a full disk stopped: kvt_evict_before_open), and the removal of a
 * damaged entry (kvt_evict_quarantine). See evict.h and docs/STORE.md.
 *
 * Eviction is least-recently-used over snapshots (a logical clock, not wall
 * time, orders uses); removing a snapshot releases its blocks, and a block
 * is freed only when no snapshot references it. The snapshot just written is
 * never the one evicted. The store's size is read from the running totals
 * (db.h), never added up: a save's eviction costs the same whatever the
 * number of entries.
 */
#include "store/evict.h"
#include "store/segments.h"
#include "store/testing.h"
#include "base/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

static bool fs_room(const kvt_store *st, uint64_t *avail, uint64_t *reserve);

/* The database could not be opened and the file system lacks room:
 * SQLite needs some (its shared memory, its WAL) before anything can be
 * evicted the usual way. Read, with a read-only connection, which least
 * recently used snapshots give back enough, punch their records and the
 * blocks only they use out of the segments, and leave their ids in
 * *victims for the rows to go once the database opens (kvt_evict_victims).
 * A process that loads one of them meanwhile finds a hole, which is a
 * miss. KVT_OK when something was given back. */
int kvt_evict_before_open(kvt_store *st, idset *victims)
{
    uint64_t avail = 0, reserve = 0;
    if (!fs_room(st, &avail, &reserve)) return KVT_EIO;
    uint64_t want = reserve + kvt_evict_wal_headroom(st) + ROOM_SLACK;
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

/* The rows of the snapshots kvt_evict_before_open gave back go (their places
 * are punched out already). */
void kvt_evict_victims(kvt_store *st, const idset *victims)
{
    kvt_db_op_start(st, "open");
    if (kvt_db_begin(st)) return;
    uint64_t evicted = 0;
    for (size_t i = 0; i < victims->n && !st->sql_rc; i++)
        if (kvt_db_q_int(st, "SELECT COUNT(*) FROM snaps WHERE id = ?", 1, &victims->v[i], 0) == 1) {
            kvt_evict_drop(st, victims->v[i]);
            evicted++;
        }
    kvt_db_counter_add(st, "evictions", evicted);
    kvt_db_commit(st);
    st->sql_rc = 0;
}

static uint64_t total_bytes(kvt_store *st)
{
    kvt_db_totals t;
    kvt_db_totals_get(st, &t);
    return t.bytes > 0 ? (uint64_t)t.bytes : 0;
}

/* ---- removal and eviction (inside a write transaction) ---- */

/* Remove a snapshot and the blocks only it referenced; returns bytes freed. */
int64_t kvt_evict_drop(kvt_store *st, int64_t id)
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

void kvt_evict_budget(kvt_store *st, int64_t keep)
{
    uint64_t total = total_bytes(st), evicted = 0;
    while (total > st->budget && !st->sql_rc) {
        int64_t victim = kvt_db_q_int(st, "SELECT id FROM snaps WHERE id != ? ORDER BY last_used ASC, id ASC LIMIT 1",
                               1, &keep, -1);
        if (victim < 0) break;
        int64_t freed = kvt_evict_drop(st, victim);
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
uint64_t kvt_evict_wal_headroom(const kvt_store *st)
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
int kvt_evict_room(kvt_store *st, uint64_t need, int64_t keep, bool force)
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
            int64_t f = kvt_evict_drop(st, victim);
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

/* A damaged entry: record, remove, report once. id (-1: none) is the
 * snapshot; with has_key the block of that key is damaged (or missing), and
 * every snapshot that stands on it goes too. */
void kvt_evict_quarantine(kvt_store *st, int64_t id, bool has_key, uint64_t key, const bloc *where, const char *reason)
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
            for (size_t i = 0; i < victims.n; i++) kvt_evict_drop(st, victims.v[i]);
            free(victims.v);
            kvt_db_delete_placed(st, "DELETE FROM blocks WHERE key = ? RETURNING seg, off, bytes", 1, &k);
        }
        if (id >= 0) kvt_evict_drop(st, id);
        kvt_db_counter_add(st, "damaged", 1);
        kvt_db_totals_resync(st, NULL, NULL); /* the damaged row's size may have read back wrong */
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

/* ---- removal on request ---- */

int kvt_evict_rm(kvt_store *st, int64_t id)
{
    int rc = kvt_db_begin(st);
    if (rc) return rc;
    if (kvt_db_q_int(st, "SELECT COUNT(*) FROM snaps WHERE id = ?", 1, &id, 0) == 0 && !st->sql_rc) {
        kvt_db_rollback(st);
        return kvt_fail(KVT_ENOENT, "no cache entry %lld", (long long)id);
    }
    kvt_evict_drop(st, id);
    return kvt_db_commit(st);
}
