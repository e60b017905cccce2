/* snapshot: snapshot records with their blocks inline (what
 * kvt_session_snapshot writes and kvt_session_restore reads) on any bytes.
 *
 * The record is loaded into a session of the model its fingerprint names
 * (stories260K when it is that one and ../shared has it, else ds4-tiny with
 * the golden files' weight seed 7), twice: as it is, and with its checksums
 * and, by the mode bits taken from the header checksum it replaces, its key
 * chain and block lengths recomputed (fuzz_fix_snapshot), so that changes
 * reach the checks behind the checksums. Both go through the model-free
 * parser and kvt_snap_without_state too. What must hold:
 *   - a refusal leaves the session empty;
 *   - a restored session runs on (one more token) and its snapshot restores
 *     into another session to the same state (cache bytes and logits);
 *   - the record without its state, when that loads, rebuilds the same state. */
#include "fuzz.h"
#include "arch/model.h"
#include "session/snapshot.h"
#include "base/util.h"

#include <stdlib.h>
#include <string.h>

static size_t block_rows(const kvt_session *s)
{
    size_t r = 0;
    for (size_t i = 0; i < s->cache->n_streams; i++)
        r += (size_t)s->cache->streams[i].rows_per_block * s->cache->streams[i].row_bytes;
    return r;
}

static bool same_state(const kvt_session *a, const kvt_session *b)
{
    uint8_t *ca = NULL, *cb = NULL;
    size_t la = 0, lb = 0;
    bool ok = kvt_session_len(a) == kvt_session_len(b) &&
              !memcmp(kvt_session_tokens(a), kvt_session_tokens(b), kvt_session_len(a) * sizeof(int32_t)) &&
              !kvt_session_cache_bytes(a, &ca, &la) && !kvt_session_cache_bytes(b, &cb, &lb) && la == lb &&
              !memcmp(ca, cb, la);
    if (ok && kvt_session_len(a))
        ok = !memcmp(kvt_session_logits(a), kvt_session_logits(b), a->m->info.n_vocab * sizeof(float));
    free(ca);
    free(cb);
    return ok;
}

/* Blocks inline after the record, as kvt_session_restore reads them. */
struct inline_src { const uint8_t *p; size_t len, off; };
static int get_inline(void *user, uint32_t b, uint64_t key, const uint8_t **p, size_t *len)
{
    struct inline_src *src = user;
    (void)key;
    if (src->len - src->off < 56) return kvt_fail(KVT_EFORMAT, "inline block %u missing", b);
    size_t n = 56 + (size_t)(src->p[src->off + 44] | src->p[src->off + 45] << 8 | src->p[src->off + 46] << 16 |
                             (uint32_t)src->p[src->off + 47] << 24);
    if (n > src->len - src->off) return kvt_fail(KVT_EFORMAT, "inline block %u truncated", b);
    *p = src->p + src->off;
    *len = n;
    src->off += n;
    return KVT_OK;
}

static void load(kvt_model *m, const uint8_t *rec, size_t len, bool try_thin)
{
    kvt_session *s = fuzz_session(m, 0), *s2 = fuzz_session(m, 1);
    kvt_snap_info in;
    if (kvt_snap_parse_raw(rec, len, &in) == KVT_OK)
        FUZZ_CHECK(in.rec_len <= len && in.rec_len >= 216, "record length %zu of %zu", in.rec_len, len);
    /* the head a store reads for a record's tail ids: within the bytes
     * given, and the ids the whole record's */
    size_t hl = len < KVT_SNAP_TAIL_HEAD ? len : KVT_SNAP_TAIL_HEAD;
    kvt_snap_info hi;
    if (kvt_snap_parse_head(rec, hl, &hi) == KVT_OK) {
        FUZZ_CHECK(hi.sec[1] >= rec && hi.sec_len[1] <= hl && (size_t)(hi.sec[1] - rec) <= hl - hi.sec_len[1],
                   "tail ids outside the %zu bytes read", hl);
        if (kvt_snap_parse_raw(rec, len, &in) == KVT_OK)
            FUZZ_CHECK(hi.n == in.n && hi.sec_len[1] == in.sec_len[1] && !memcmp(hi.sec[1], in.sec[1], in.sec_len[1]),
                       "the head's ids differ from the record's");
    }
    int rc = kvt_session_restore(s, rec, len);
    if (rc) {
        FUZZ_CHECK(kvt_session_len(s) == 0, "a refused snapshot (%s) leaves %zu tokens", kvt_errmsg(),
                   kvt_session_len(s));
        return;
    }
    /* again, through its own snapshot */
    uint8_t *snap = NULL;
    size_t sl = 0;
    rc = kvt_session_snapshot(s, &snap, &sl);
    if (!rc) {
        rc = kvt_session_restore(s2, snap, sl);
        FUZZ_CHECK(rc == KVT_OK, "the snapshot of a restored session does not restore: %s", kvt_errmsg());
        if (!rc) FUZZ_CHECK(same_state(s, s2), "the snapshot of a restored session restores another state");
    }
    /* without its state: when it loads, it rebuilt the same state */
    kvt_snap_info whole;
    kvt_wbuf thin = {0};
    if (!rc && try_thin && kvt_snap_parse_raw(snap, sl, &whole) == KVT_OK &&
        kvt_snap_without_state(snap, whole.rec_len, &thin) == KVT_OK && thin.len) {
        kvt_snap_info ti;
        FUZZ_CHECK(kvt_snap_parse_raw(thin.p, thin.len, &ti) == KVT_OK,
                   "kvt_snap_without_state wrote a record that does not parse: %s", kvt_errmsg());
        struct inline_src blocks = {snap, sl, whole.rec_len};
        if (kvt_snap_load(s2, thin.p, thin.len, get_inline, &blocks) == KVT_OK)
            FUZZ_CHECK(same_state(s, s2), "a record without its state rebuilt another state");
        else
            FUZZ_CHECK(kvt_session_len(s2) == 0, "a refused record without its state leaves tokens");
    }
    kvt_wbuf_free(&thin);
    free(snap);
    /* the restored session runs on */
    if (kvt_session_len(s) < s->n_ctx) {
        rc = kvt_session_decode(s, 0);
        FUZZ_CHECK(rc == KVT_OK, "a restored session does not decode: %s", kvt_errmsg());
    }
}

int fuzz_snapshot(const uint8_t *data, size_t size)
{
    if (size == 0) {
        fuzz_session(fuzz_ds4(7), 0);
        fuzz_session(fuzz_ds4(7), 1);
        return 0;
    }
    kvt_model *m = fuzz_ds4(7), *st = fuzz_stories();
    if (st && size >= 24 && !memcmp(data + 16, &(uint64_t){kvt_model_fingerprint(st)}, 8)) m = st;
    uint64_t h = fuzz_hash(data, size);
    /* as it is */
    load(m, data, size, h % 8 == 0);
    /* with what the checksums and the key chain would refuse repaired */
    uint8_t *p = malloc(size);
    if (!p) return 0;
    memcpy(p, data, size);
    size_t hdr = fuzz_record_header(p, size);
    unsigned mode = hdr ? p[hdr - 8] & 7 : 0;
    fuzz_fix_snapshot(p, size, mode, block_rows(fuzz_session(m, 0)));
    if (memcmp(p, data, size)) load(m, p, size, h % 8 == 1);
    kvt_wbuf thin = {0};
    if (kvt_snap_without_state(p, size, &thin) == KVT_OK && thin.len)
        FUZZ_CHECK(kvt_snap_parse_raw(thin.p, thin.len, &(kvt_snap_info){0}) == KVT_OK,
                   "kvt_snap_without_state wrote a record that does not parse: %s", kvt_errmsg());
    kvt_wbuf_free(&thin);
    free(p);
    return 0;
}
