/* One serializer for session state: RAM snapshots, canonical cache bytes for
 * the exactness tests, and (through the disk tier) files. docs/FORMAT.md is
 * the normative description of the layout written here.
 *
 * A snapshot carries state bytes, never pointers: the exact token ids, the
 * next-token logits, the architecture's fixed state in logical order (window
 * rows oldest first, frontier entries) and the rows of every cache stream that
 * the held tokens cover. Restoring validates every size against the model
 * and the bytes that remain before touching the session, and a failure
 * leaves the session empty rather than half-restored.
 */
#include "model.h"
#include "util.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#define SNAP_MAGIC "KVTSNAP\0"
#define SNAP_VERSION 1
#define SNAP_HEADER 48

/* State and stream rows for the held tokens (the canonical cache bytes). */
static void put_cache(const kvt_session *s, kvt_wbuf *b)
{
    if (s->m->arch->state_save) s->m->arch->state_save(s, b);
    const kvt_cache *c = s->cache;
    for (size_t i = 0; i < c->n_streams; i++) {
        size_t rows = kvt_cache_rows_for(c, i, s->n);
        for (size_t r = 0; r < rows; r++) kvt_wbuf_put(b, kvt_cache_row_ro(c, i, r), c->streams[i].row_bytes);
    }
}

int kvt_session_cache_bytes(const kvt_session *s, uint8_t **out, size_t *len)
{
    kvt_wbuf b = {0};
    put_cache(s, &b);
    if (b.oom) { kvt_wbuf_free(&b); return kvt_fail(KVT_ENOMEM, "cache bytes"); }
    *out = b.p ? b.p : malloc(1);
    *len = b.len;
    return *out ? KVT_OK : KVT_ENOMEM;
}

int kvt_session_snapshot(const kvt_session *s, uint8_t **out, size_t *len)
{
    const kvt_model *m = s->m;
    kvt_wbuf b = {0};
    kvt_wbuf_put(&b, SNAP_MAGIC, 8);
    kvt_wbuf_u32(&b, SNAP_VERSION);
    kvt_wbuf_u32(&b, 0);                       /* flags */
    kvt_wbuf_u64(&b, m->fingerprint);
    kvt_wbuf_u64(&b, m->tok_fingerprint);
    kvt_wbuf_u32(&b, (uint32_t)s->n);
    kvt_wbuf_u32(&b, m->info.n_vocab);
    kvt_wbuf_u32(&b, (uint32_t)s->cache->n_streams);
    kvt_wbuf_u32(&b, 0);                       /* reserved */
    for (size_t i = 0; i < s->n; i++) kvt_wbuf_u32(&b, (uint32_t)s->tokens[i]);
    if (s->n) kvt_wbuf_put(&b, s->logits, (size_t)m->info.n_vocab * sizeof(float));
    size_t at = b.len;
    kvt_wbuf_u64(&b, 0);                       /* cache section length, patched below */
    put_cache(s, &b);
    if (!b.oom) {
        uint64_t n = b.len - at - 8;
        for (int k = 0; k < 8; k++) b.p[at + k] = (uint8_t)(n >> (8 * k));
        kvt_wbuf_u64(&b, XXH3_64bits(b.p, b.len));
    }
    if (b.oom) { kvt_wbuf_free(&b); return kvt_fail(KVT_ENOMEM, "snapshot of %zu tokens", s->n); }
    *out = b.p;
    *len = b.len;
    return KVT_OK;
}

/* Expected cache section length for n tokens of this session's model. */
static int cache_len_for(kvt_session *s, size_t n, size_t *out)
{
    size_t total = 0;
    if (s->m->arch->state_save) {
        /* the state's length depends only on n: measure it on an empty save */
        size_t held = s->n;
        s->n = n;
        kvt_wbuf b = {0};
        s->m->arch->state_save(s, &b);
        s->n = held;
        bool oom = b.oom;
        total = b.len;
        kvt_wbuf_free(&b);
        if (oom) return kvt_fail(KVT_ENOMEM, "snapshot state");
    }
    for (size_t i = 0; i < s->cache->n_streams; i++)
        total += kvt_cache_rows_for(s->cache, i, n) * s->cache->streams[i].row_bytes;
    *out = total;
    return KVT_OK;
}

int kvt_session_restore(kvt_session *s, const uint8_t *buf, size_t len)
{
    const kvt_model *m = s->m;
    kvt_rbuf r = {buf, len, 0};
    s->n = 0;
    kvt_cache_truncate(s->cache, 0);
    kvt_session_ckpt_clear(s);
    if (len < SNAP_HEADER + 8 || memcmp(buf, SNAP_MAGIC, 8))
        return kvt_fail(KVT_EFORMAT, "snapshot: bad magic or shorter than its header (%zu bytes)", len);
    uint32_t version, flags, n, n_vocab, n_streams, reserved;
    uint64_t fp, tfp, cache_len;
    r.off = 8;
    kvt_rbuf_u32(&r, &version);
    kvt_rbuf_u32(&r, &flags);
    if (version != SNAP_VERSION)
        return kvt_fail(KVT_EFORMAT, "snapshot: version %u (this build reads %d)", version, SNAP_VERSION);
    if (XXH3_64bits(buf, len - 8) != kvt_rd64(buf + len - 8))
        return kvt_fail(KVT_ECORRUPT, "snapshot: checksum mismatch");
    kvt_rbuf_u64(&r, &fp);
    kvt_rbuf_u64(&r, &tfp);
    kvt_rbuf_u32(&r, &n);
    kvt_rbuf_u32(&r, &n_vocab);
    kvt_rbuf_u32(&r, &n_streams);
    kvt_rbuf_u32(&r, &reserved);
    if (fp != m->fingerprint) return kvt_fail(KVT_EMISMATCH, "snapshot: made by another model");
    if (tfp != m->tok_fingerprint) return kvt_fail(KVT_EMISMATCH, "snapshot: made with another tokenizer");
    if (flags || reserved || n_vocab != m->info.n_vocab || n_streams != s->cache->n_streams)
        return kvt_fail(KVT_EFORMAT, "snapshot: header does not fit the model");
    if (n > s->n_ctx)
        return kvt_fail(KVT_ECTX, "snapshot of %u tokens exceeds the context of %u", n, s->n_ctx);
    r.len = len - 8; /* the checksum is not payload */
    size_t need = (size_t)n * 4 + (n ? (size_t)n_vocab * 4 : 0) + 8;
    if (kvt_rbuf_left(&r) < need) return kvt_fail(KVT_EFORMAT, "snapshot: truncated token section");
    int32_t *tok = s->tokens;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t t;
        kvt_rbuf_u32(&r, &t);
        if (t >= m->info.n_vocab) return kvt_fail(KVT_EFORMAT, "snapshot: token %u has id %u", i, t);
        tok[i] = (int32_t)t;
    }
    if (n) kvt_rbuf_get(&r, s->logits, (size_t)n_vocab * 4);
    kvt_rbuf_u64(&r, &cache_len);
    size_t want = 0;
    int rc = cache_len_for(s, n, &want);
    if (rc) return rc;
    if (cache_len != want || kvt_rbuf_left(&r) != want)
        return kvt_fail(KVT_EFORMAT, "snapshot: cache section of %llu bytes, expected %zu",
                        (unsigned long long)cache_len, want);
    if (m->arch->state_load && (rc = m->arch->state_load(s, n, &r))) return rc;
    for (size_t i = 0; i < s->cache->n_streams; i++) {
        size_t rows = kvt_cache_rows_for(s->cache, i, n), rb = s->cache->streams[i].row_bytes;
        for (size_t k = 0; k < rows; k++) {
            void *dst = kvt_cache_row(s->cache, i, k);
            if (!dst) { kvt_cache_truncate(s->cache, 0); return kvt_fail(KVT_ENOMEM, "snapshot rows"); }
            kvt_rbuf_get(&r, dst, rb);
        }
    }
    s->n = n;
    kvt_session_checkpoint(s);
    return KVT_OK;
}
