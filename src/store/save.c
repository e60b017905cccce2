/* Saving a session's prefix into the disk tier: one write transaction
 * that appends the snapshot's record and its new blocks to the current
 * segment (synced before the rows that name them commit) and inserts the
 * rows; a block stored already is named where it is. Before it writes, the
 * save makes room on the file system (evict.h); after, it keeps the budget
 * and thins the snapshots it extends (their state is rebuilt by replay).
 * See save.h and docs/STORE.md.
 */
#include "store/save.h"
#include "store/evict.h"
#include "store/lookup.h"
#include "store/segments.h"
#include "store/testing.h"
#include "arch/model.h"
#include "base/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

double kvt_store_report_every = 60;

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

/* A save in progress: what the steps of kvt_save_entry share. */
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
    j->need = j->rec.len + ROOM_SLACK + kvt_evict_wal_headroom(st);
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
    sqlite3_bind_int64(ins, 1, (int64_t)kvt_model_fingerprint(j->s->m));
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
        kvt_evict_budget(st, *id);
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

int kvt_save_entry(kvt_store *st, kvt_session *s, size_t n, const char *reason, int64_t *id_out, bool *created)
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
    if ((rc = kvt_evict_room(st, j.need, -1, false))) {
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
        if (kvt_evict_room(st, j.need, -1, true) != KVT_OK) break;
        st->sql_rc = 0;
    }
    if (rc) {
        st->save_errors++;
        goto out;
    }
    if (fresh) kvt_lookup_index_add(st, (ientry){(uint64_t)j.head, (uint64_t)j.tail, (uint32_t)n, id});
    if (id_out) *id_out = id;
    if (created) *created = fresh;
out:
    kvt_wbuf_free(&j.rec);
    kvt_wbuf_free(&j.blk);
    free(j.runs);
    kvt_wbuf_free(&j.locs);
    return rc;
}
