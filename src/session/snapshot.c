/* One serializer for session state: RAM snapshots, canonical cache bytes for
 * the exactness tests, and the disk tier's records. docs/FORMAT.md is the
 * normative description of the layout written here.
 *
 * A session's state at n tokens splits into two kinds of record:
 *
 *   block records   one per completed 128-token block: its token ids, their
 *                   text, and the rows every cache stream gained in it. Immutable and keyed
 *                   by a chained hash of the token ids (key_{b+1} =
 *                   XXH3(key_b || 128 ids), key_0 = XXH3(model fingerprint ||
 *                   tokenizer fingerprint)), so equal prefixes of equal models
 *                   have equal keys and the disk tier stores each block once.
 *   snapshot record the rest: the ids after the last whole block, the
 *                   next-token logits, their text, the fixed state in
 *                   logical order (window rows oldest first, frontier), the
 *                   stream rows of the incomplete block, and the list of block
 *                   keys it stands on. A record stored without its state
 *                   (version 4) holds the XXH3-64 of that state instead, and
 *                   loading it rebuilds the state by replay and checks it
 *                   against that digest. A model with recurrent layers
 *                   (qwen35's DeltaNet) keeps their state, fixed in size
 *                   and not rebuildable from rows, in a seventh section
 *                   (version 5). A model whose rows are rounded to a cache
 *                   type (f16, bf16, q8_0) writes every snapshot record as
 *                   version 6, the layout of the others with the K and V
 *                   types in its header: a record loads only into a model
 *                   of its types (f32 rows, or DeepSeek-V4's own, for the
 *                   versions before), so a record of other types is a miss.
 *
 * Every section and every block carries an XXH3-64 checksum and every size is
 * checked against the model before use, so a damaged or foreign record is
 * refused with a reason, never loaded. A RAM snapshot is a snapshot record
 * with its blocks inline after it.
 */
#include "session/snapshot.h"
#include "arch/model.h"
#include "cache/rows.h"
#include "base/threads.h"
#include "base/util.h"

#include <stdatomic.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#define REC_MAGIC "KVTSNAP\0"
#define BLK_MAGIC "KVTBLK\0\0"
#define HDR_FIXED 64
#define SEC_ENTRY 24
#define BLK_HDR 48
#define DIGEST_LEN 8 /* the state section of a version 4 record: XXH3-64 of the state */

/* Sections by id. Version 5 records have a seventh, the recurrent state,
 * and so do version 6 records of a model with recurrent layers (the
 * header's section count says which); the others have six. */
enum { SEC_TOKENS = 1, SEC_LOGITS, SEC_TEXT, SEC_STATE, SEC_ROWS, SEC_KEYS, SEC_RECURRENT, N_SEC_MAX = 7 };
static const char *sec_name[] = {"", "tokens", "logits", "text", "state", "rows", "block keys", "recurrent"};

/* The section count of a version; version 6 records state theirs (6 or 7). */
static int n_sec(uint32_t version) { return version == KVT_SNAP_VERSION_RECURRENT ? 7 : 6; }
/* Header bytes 60..64 of a version 6 record: u8 K type, u8 V type (ggml's
 * ids), u16 0. */
static uint32_t types_word(const kvt_model *m)
{
    return kvt_rows_ggml(m->type_k) | kvt_rows_ggml(m->type_v) << 8;
}
static size_t hdr_len(int nsec) { return HDR_FIXED + (size_t)nsec * SEC_ENTRY + 8; }

/* The recurrent layers' state: the last bytes of the architecture's state,
 * the same number at every n (0: the model has none). */
static size_t recurrent_bytes(const kvt_model *m)
{
    kvt_plan p;
    return m->arch->plan && m->arch->plan(m, 0, &p) == KVT_OK ? (size_t)kvt_plan_bytes(&p, "recurrent") : 0;
}

static void put_u32_at(uint8_t *p, uint32_t v) { for (int k = 0; k < 4; k++) p[k] = (uint8_t)(v >> (8 * k)); }
static void put_u64_at(uint8_t *p, uint64_t v) { for (int k = 0; k < 8; k++) p[k] = (uint8_t)(v >> (8 * k)); }

uint64_t kvt_snap_key0(const kvt_model *m)
{
    /* rows rounded to a cache type: the types (ggml's ids) too, so that a
     * record of other types is a miss; f32 rows keep the key they have
     * always had */
    uint64_t seed[3] = {kvt_model_fingerprint(m), m->tok_fingerprint,
                        kvt_rows_ggml(m->type_k) | (uint64_t)kvt_rows_ggml(m->type_v) << 32};
    uint64_t k = XXH3_64bits(seed, kvt_model_rows_rounded(m) ? sizeof seed : 2 * sizeof seed[0]);
    /* the MTP layer's rows kept (kvt_model_set_mtp_rows): another layout,
     * so a record with them and one without never meet (a miss) */
    return kvt_model_mtp_rows(m) ? XXH3_64bits_withSeed("kvtier mtp rows", 15, k) : k;
}

int kvt_snap_fault;

/* "KVTPROC" as a u64: the process scope's seed hashes 32 bytes that start
 * with it, the records' 16 or 24 bytes of fingerprints */
#define PROCESS_TAG 0x00434f525054564bull

uint64_t kvt_snap_key0_in(const kvt_model *m, kvt_key_scope scope)
{
    if (scope == KVT_KEYS_RECORDS || kvt_snap_fault == KVT_SNAP_FAULT_PROCESS_SEED_FINGERPRINTED)
        return kvt_snap_key0(m);
    uint64_t seed[4] = {PROCESS_TAG, (uint64_t)(uintptr_t)m, m->tok_fingerprint,
                        kvt_rows_ggml(m->type_k) | (uint64_t)kvt_rows_ggml(m->type_v) << 32};
    return XXH3_64bits(seed, sizeof seed);
}

_Atomic uint64_t kvt_snap_key_steps;

uint64_t kvt_snap_key_next(uint64_t prev, const int32_t *ids)
{
    atomic_fetch_add_explicit(&kvt_snap_key_steps, 1, memory_order_relaxed);
    uint8_t buf[8 + 4 * KVT_BLOCK];
    put_u64_at(buf, prev);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(buf + 8, ids, 4 * KVT_BLOCK); /* u32 LE is the host's order */
#else
    for (size_t i = 0; i < KVT_BLOCK; i++) put_u32_at(buf + 8 + 4 * i, (uint32_t)ids[i]);
#endif
    return XXH3_64bits(buf, sizeof buf);
}

uint64_t kvt_snap_tail_hash(uint64_t head, const int32_t *ids, size_t n)
{
    uint8_t buf[4 * KVT_BLOCK];
    if (n > KVT_BLOCK) n = KVT_BLOCK; /* a tail is shorter than a block */
    for (size_t i = 0; i < n; i++) put_u32_at(buf + 4 * i, (uint32_t)ids[i]);
    return XXH3_64bits_withSeed(buf, 4 * n, head);
}

/* Concatenated pieces of ids: the text those tokens stand for, exactly as
 * decoding emits it (control tokens as their text). */
static void put_pieces(const kvt_model *m, const int32_t *ids, size_t n, kvt_wbuf *out)
{
    for (size_t i = 0; i < n; i++) {
        const char *p;
        size_t len;
        if (kvt_token_piece(m, ids[i], &p, &len) == KVT_OK) kvt_wbuf_put(out, p, len);
    }
}

/* ---- state at a position: now, or a checkpoint ---- */

static int state_at(kvt_session *s, size_t n, kvt_wbuf *state, const float **logits)
{
    if (n == s->n && !s->logits_stale) {
        if (s->m->arch->state_save) s->m->arch->state_save(s, state);
        *logits = s->logits;
        return state->oom ? kvt_fail(KVT_ENOMEM, "snapshot state") : KVT_OK;
    }
    /* an earlier position: its checkpoint has the logits (and the fixed
     * state, for architectures that have one) */
    for (size_t i = 0; i < s->n_ckpt; i++)
        if (s->ckpt[i].pos == n) {
            kvt_wbuf_put(state, s->ckpt[i].state.p, s->ckpt[i].state.len);
            *logits = s->ckpt[i].logits;
            return state->oom ? kvt_fail(KVT_ENOMEM, "snapshot state") : KVT_OK;
        }
    return kvt_fail(KVT_EINVAL, "no checkpoint at %zu tokens (session holds %zu)", n, s->n);
}

bool kvt_snap_can_save(const kvt_session *s, size_t n)
{
    if (n == 0 || n > s->n) return false;
    if (n == s->n && !s->logits_stale) return true;
    for (size_t i = 0; i < s->n_ckpt; i++)
        if (s->ckpt[i].pos == n) return true;
    return false;
}

/* ---- encoding ---- */

const uint64_t *kvt_snap_keys(kvt_session *s, size_t nb) { return kvt_snap_keys_in(s, nb, KVT_KEYS_RECORDS); }

const uint64_t *kvt_snap_keys_in(kvt_session *s, size_t nb, kvt_key_scope scope)
{
    kvt_cache *c = s->cache;
    if (nb * KVT_BLOCK > s->n) return NULL;
    if (c->key_scope != (int)scope) { /* the other scope's chain: none of it holds here */
        c->key_scope = (int)scope;
        c->n_keys = 0;
    }
    uint64_t key = c->n_keys ? c->keys[c->n_keys - 1] : kvt_snap_key0_in(s->m, scope);
    for (size_t b = c->n_keys; b < nb; b++) c->keys[b] = key = kvt_snap_key_next(key, s->tokens + b * KVT_BLOCK);
    if (nb > c->n_keys) c->n_keys = nb;
    return c->keys;
}

size_t kvt_snap_block_runs_max(const kvt_session *s)
{
    const kvt_cache *c = s->cache;
    size_t n = 0;
    for (size_t i = 0; i < c->n_streams; i++) n += c->streams[i].rows_per_block; /* a run has one row at least */
    return n;
}

int kvt_snap_block_parts(const kvt_session *s, uint32_t b, uint64_t prev, kvt_wbuf *head, uint64_t *key,
                         struct iovec *runs, size_t *n_runs)
{
    const kvt_cache *c = s->cache;
    *n_runs = 0;
    if ((size_t)(b + 1) * KVT_BLOCK > s->n) return kvt_fail(KVT_EINVAL, "block %u is not complete", b);
    const int32_t *ids = s->tokens + (size_t)b * KVT_BLOCK;
    /* the session's key when it has it (of the records' chain) and prev is
     * the key it follows */
    *key = c->key_scope == KVT_KEYS_RECORDS && b < c->n_keys && prev == (b ? c->keys[b - 1] : kvt_snap_key0(s->m))
               ? c->keys[b]
               : kvt_snap_key_next(prev, ids);
    kvt_wbuf text = {0};
    put_pieces(s->m, ids, KVT_BLOCK, &text);
    if (text.oom) { kvt_wbuf_free(&text); return kvt_fail(KVT_ENOMEM, "block text"); }
    size_t payload = 4 * KVT_BLOCK + 4 + text.len;
    for (size_t i = 0; i < c->n_streams; i++) payload += (size_t)c->streams[i].rows_per_block * c->streams[i].row_bytes;
    kvt_wbuf_put(head, BLK_MAGIC, 8);
    kvt_wbuf_u32(head, KVT_SNAP_VERSION);
    kvt_wbuf_u32(head, b);
    kvt_wbuf_u64(head, kvt_model_fingerprint(s->m));
    kvt_wbuf_u64(head, *key);
    kvt_wbuf_u64(head, prev);
    kvt_wbuf_u32(head, (uint32_t)c->n_streams);
    kvt_wbuf_u32(head, (uint32_t)payload);
    for (size_t i = 0; i < KVT_BLOCK; i++) kvt_wbuf_u32(head, (uint32_t)ids[i]);
    kvt_wbuf_u32(head, (uint32_t)text.len);
    kvt_wbuf_put(head, text.p, text.len);
    kvt_wbuf_free(&text);
    if (head->oom) return kvt_fail(KVT_ENOMEM, "block record");
    /* the rows where they lie: a run per page (rows are contiguous within one) */
    size_t k = 0;
    for (size_t i = 0; i < c->n_streams; i++) {
        const kvt_stream *st = &c->streams[i];
        size_t r0 = (size_t)b * st->rows_per_block, r1 = r0 + st->rows_per_block;
        for (size_t r = r0; r < r1;) {
            size_t e = kvt_cache_run_end(c, i, r);
            if (e > r1) e = r1;
            const uint8_t *p = kvt_cache_row_ro(c, i, r);
            size_t len = (e - r) * (size_t)st->row_bytes;
            if (k && (const uint8_t *)runs[k - 1].iov_base + runs[k - 1].iov_len == p) runs[k - 1].iov_len += len;
            else runs[k++] = (struct iovec){(void *)p, len};
            r = e;
        }
    }
    *n_runs = k;
    return KVT_OK;
}

uint64_t kvt_snap_block_sum(const kvt_wbuf *head, size_t from, const struct iovec *runs, size_t n_runs)
{
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    XXH3_64bits_update(&st, head->p + from, head->len - from);
    for (size_t i = 0; i < n_runs; i++) XXH3_64bits_update(&st, runs[i].iov_base, runs[i].iov_len);
    return XXH3_64bits_digest(&st);
}

int kvt_snap_block(const kvt_session *s, uint32_t b, uint64_t prev, kvt_wbuf *out, uint64_t *key)
{
    size_t start = out->len, n;
    struct iovec *runs = kvt_calloc(kvt_snap_block_runs_max(s) + 1, sizeof *runs);
    if (!runs) return KVT_ENOMEM;
    int rc = kvt_snap_block_parts(s, b, prev, out, key, runs, &n);
    if (!rc) {
        for (size_t i = 0; i < n; i++) kvt_wbuf_put(out, runs[i].iov_base, runs[i].iov_len);
        if (!out->oom) kvt_wbuf_u64(out, XXH3_64bits(out->p + start, out->len - start));
        if (out->oom) rc = kvt_fail(KVT_ENOMEM, "block record");
    }
    free(runs);
    return rc;
}

/* Append a snapshot record: header, section table, header checksum, then
 * the sections. mid holds header bytes 16..56 (fingerprints, n, nb, V,
 * streams, head), types bytes 60..64 (0 but in version 6). Of a model with
 * rounded rows every record is version 6 (nsec 7 with a recurrent
 * section); of the others a record without its state is version 4, one
 * with a recurrent section 5 (seven sections), others 2. */
static void put_record(kvt_wbuf *rec, uint32_t version, uint32_t flags, const uint8_t *mid, int nsec,
                       uint32_t types, const uint8_t *const *sec, const size_t *len)
{
    size_t start = rec->len, hdr = hdr_len(nsec);
    kvt_wbuf_put(rec, REC_MAGIC, 8);
    kvt_wbuf_u32(rec, version);
    kvt_wbuf_u32(rec, flags);
    kvt_wbuf_put(rec, mid, 40);
    kvt_wbuf_u32(rec, (uint32_t)nsec);
    kvt_wbuf_u32(rec, types);
    uint64_t off = hdr;
    for (int i = 1; i <= nsec; i++) {
        kvt_wbuf_u64(rec, off);
        kvt_wbuf_u64(rec, len[i]);
        kvt_wbuf_u64(rec, XXH3_64bits(sec[i], len[i]));
        off += len[i];
    }
    if (!rec->oom) kvt_wbuf_u64(rec, XXH3_64bits(rec->p + start, rec->len - start));
    for (int i = 1; i <= nsec; i++) kvt_wbuf_put(rec, sec[i], len[i]);
}

int kvt_snap_encode(kvt_session *s, size_t n, uint32_t flags, kvt_wbuf *rec, uint64_t **keys_out)
{
    const kvt_model *m = s->m;
    const kvt_cache *c = s->cache;
    if (n > s->n) return kvt_fail(KVT_EINVAL, "cannot save %zu tokens of %zu", n, s->n);
    size_t nb = n / KVT_BLOCK, tail = n - nb * KVT_BLOCK;
    const uint64_t *keys = kvt_snap_keys(s, nb); /* not NULL: n <= s->n */
    kvt_wbuf state = {0};
    const float *logits = NULL;
    int rc = n ? state_at(s, n, &state, &logits) : KVT_OK;
    if (rc) goto done;
    uint64_t key = nb ? keys[nb - 1] : kvt_snap_key0(m);
    /* the recurrent layers' state, the state's last bytes, goes to a
     * section of its own (version 5) */
    size_t R = recurrent_bytes(m);
    if (!n && R) { /* before the first token the recurrent state is zero */
        uint8_t *z = kvt_calloc(1, R);
        if (!z) { rc = KVT_ENOMEM; goto done; }
        kvt_wbuf_put(&state, z, R);
        free(z);
    }
    if (R > state.len) { rc = kvt_fail(KVT_EINVAL, "snapshot: state shorter than its recurrent part"); goto done; }
    /* rows rounded to a cache type: version 6 whatever else the record
     * holds, its types in the header; f32 rows (and DeepSeek-V4's own)
     * keep the versions they have always had */
    bool typed = kvt_model_rows_rounded(m);
    uint32_t version = typed ? KVT_SNAP_VERSION_TYPED
                       : flags & KVT_SNAP_REPLAY ? KVT_SNAP_VERSION_REPLAY
                       : R ? KVT_SNAP_VERSION_RECURRENT
                           : KVT_SNAP_VERSION;
    /* sections */
    kvt_wbuf sec[N_SEC_MAX + 1] = {{0}};
    for (size_t i = 0; i < tail; i++) kvt_wbuf_u32(&sec[SEC_TOKENS], (uint32_t)s->tokens[nb * KVT_BLOCK + i]);
    if (n) kvt_wbuf_put(&sec[SEC_LOGITS], logits, (size_t)m->info.n_vocab * sizeof(float));
    put_pieces(m, s->tokens + nb * KVT_BLOCK, tail, &sec[SEC_TEXT]);
    kvt_wbuf_put(&sec[SEC_STATE], state.p, state.len - R);
    kvt_wbuf_put(&sec[SEC_RECURRENT], state.p ? state.p + state.len - R : NULL, R);
    for (size_t i = 0; i < c->n_streams; i++) {
        const kvt_stream *st = &c->streams[i];
        for (size_t r = nb * st->rows_per_block; r < kvt_cache_rows_for(c, i, n); r++)
            kvt_wbuf_put(&sec[SEC_ROWS], kvt_cache_row_ro(c, i, r), st->row_bytes);
    }
    for (size_t b = 0; b < nb; b++) kvt_wbuf_u64(&sec[SEC_KEYS], keys[b]);
    kvt_wbuf mid = {0}; /* header bytes 16..56 */
    kvt_wbuf_u64(&mid, kvt_model_fingerprint(m));
    kvt_wbuf_u64(&mid, m->tok_fingerprint);
    kvt_wbuf_u32(&mid, (uint32_t)n);
    kvt_wbuf_u32(&mid, (uint32_t)nb);
    kvt_wbuf_u32(&mid, m->info.n_vocab);
    kvt_wbuf_u32(&mid, (uint32_t)c->n_streams);
    kvt_wbuf_u64(&mid, key);
    const uint8_t *sp[N_SEC_MAX + 1];
    size_t sl[N_SEC_MAX + 1];
    for (int i = 1; i <= N_SEC_MAX; i++) {
        sp[i] = sec[i].p;
        sl[i] = sec[i].len;
        rec->oom |= sec[i].oom;
    }
    if (!mid.oom) put_record(rec, version, flags, mid.p, R ? 7 : 6, typed ? types_word(m) : 0, sp, sl);
    rec->oom |= mid.oom;
    kvt_wbuf_free(&mid);
    for (int i = 1; i <= N_SEC_MAX; i++) kvt_wbuf_free(&sec[i]);
    rc = rec->oom ? kvt_fail(KVT_ENOMEM, "snapshot record") : KVT_OK;
done:
    kvt_wbuf_free(&state);
    if (!rc && keys_out) {
        if (!(*keys_out = kvt_malloc((nb ? nb : 1) * sizeof **keys_out))) return KVT_ENOMEM;
        memcpy(*keys_out, keys, nb * sizeof *keys);
    }
    return rc;
}

/* ---- decoding ---- */

/* The header, section table and checksums of a record; whole: the record
 * is len bytes (every section checked), else len bytes are a prefix of it
 * and the sections that end within them are checked and set (at least the
 * tokens section: KVT_EFORMAT when it does not). */
static int parse(const uint8_t *p, size_t len, bool whole, kvt_snap_info *out)
{
    memset(out, 0, sizeof *out);
    if (len < 12 || memcmp(p, REC_MAGIC, 8))
        return kvt_fail(KVT_EFORMAT, "snapshot: bad magic");
    out->version = kvt_rd32(p + 8);
    if (out->version < KVT_SNAP_VERSION || out->version > KVT_SNAP_VERSION_MAX)
        return kvt_fail(KVT_EFORMAT, "snapshot: format version %u (this build reads %d to %d)", out->version,
                        KVT_SNAP_VERSION, KVT_SNAP_VERSION_MAX);
    /* version 6 states its section count (6, or 7 with a recurrent
     * state); the others have theirs by version */
    bool typed = out->version == KVT_SNAP_VERSION_TYPED;
    if (typed && len < HDR_FIXED) return kvt_fail(KVT_EFORMAT, "snapshot: %zu bytes, shorter than its header", len);
    int nsec = typed ? (kvt_rd32(p + 56) == 7 ? 7 : 6) : n_sec(out->version);
    size_t hdr = hdr_len(nsec);
    if (len < hdr) return kvt_fail(KVT_EFORMAT, "snapshot: %zu bytes, shorter than its header", len);
    /* the replay flag: required in versions 3 and 4, refused in 2 and 5,
     * either in 6 (but not with a recurrent state, which cannot be rebuilt) */
    bool replay = kvt_rd32(p + 12) & KVT_SNAP_REPLAY;
    bool replay_ok = typed ? !(replay && nsec == 7)
                           : replay == (out->version == KVT_SNAP_VERSION_REPLAY || out->version == KVT_SNAP_VERSION_REPLAY_V3);
    if (XXH3_64bits(p, hdr - 8) != kvt_rd64(p + hdr - 8))
        return kvt_fail(KVT_ECORRUPT, "snapshot: header checksum mismatch");
    out->flags = kvt_rd32(p + 12);
    out->model = kvt_rd64(p + 16);
    out->tok = kvt_rd64(p + 24);
    out->n = kvt_rd32(p + 32);
    out->nb = kvt_rd32(p + 36);
    out->n_vocab = kvt_rd32(p + 40);
    out->n_streams = kvt_rd32(p + 44);
    out->head = kvt_rd64(p + 48);
    out->nsec = (uint32_t)nsec;
    /* offset 60: reserved 0 before version 6; in it u8 K, u8 V, u16 0 */
    uint32_t types = kvt_rd32(p + 60);
    out->ggml_k = typed ? types & 0xff : 0;
    out->ggml_v = typed ? types >> 8 & 0xff : 0;
    if (kvt_rd32(p + 56) != (uint32_t)nsec || (typed ? types >> 16 : types) || out->nb != out->n / KVT_BLOCK ||
        (out->flags & ~(KVT_SNAP_INLINE | KVT_SNAP_REPLAY)) || !replay_ok)
        return kvt_fail(KVT_EFORMAT, "snapshot: malformed header");
    uint64_t off = hdr;
    for (int i = 1; i <= nsec; i++) {
        const uint8_t *e = p + HDR_FIXED + (size_t)(i - 1) * SEC_ENTRY;
        uint64_t so = kvt_rd64(e), sl = kvt_rd64(e + 8);
        if (!whole && i > SEC_TOKENS && so == off && (so > len || sl > len - so)) return KVT_OK;
        if (so != off || so > len || sl > len - so)
            return kvt_fail(KVT_EFORMAT, "snapshot: section %s at %llu+%llu outside %zu bytes", sec_name[i],
                            (unsigned long long)so, (unsigned long long)sl, len);
        if (XXH3_64bits(p + so, sl) != kvt_rd64(e + 16))
            return kvt_fail(KVT_ECORRUPT, "snapshot: checksum mismatch in section %s", sec_name[i]);
        out->sec[i] = p + so;
        out->sec_len[i] = sl;
        off = so + sl;
    }
    if (out->sec_len[SEC_KEYS] != 8 * (size_t)out->nb)
        return kvt_fail(KVT_EFORMAT, "snapshot: %zu bytes of block keys for %u blocks", out->sec_len[SEC_KEYS], out->nb);
    out->rec_len = off;
    return KVT_OK;
}

int kvt_snap_parse_raw(const uint8_t *p, size_t len, kvt_snap_info *out) { return parse(p, len, true, out); }

bool kvt_snap_rows_per_token(const kvt_model *m) { return !m->arch->state_save; }

int kvt_snap_parse_head(const uint8_t *p, size_t len, kvt_snap_info *out)
{
    int rc = parse(p, len, false, out);
    if (rc) return rc;
    if (out->sec_len[SEC_TOKENS] != 4 * ((size_t)out->n - (size_t)out->nb * KVT_BLOCK))
        return kvt_fail(KVT_EFORMAT, "snapshot: %zu bytes of ids for a tail of %u tokens", out->sec_len[SEC_TOKENS],
                        out->n - out->nb * KVT_BLOCK);
    return KVT_OK;
}

int kvt_snap_parse(const kvt_model *m, const uint8_t *p, size_t len, kvt_snap_info *out)
{
    int rc = kvt_snap_parse_raw(p, len, out);
    if (rc) return rc;
    if (out->model != kvt_model_fingerprint(m)) return kvt_fail(KVT_EMISMATCH, "snapshot: made by another model");
    if (out->tok != m->tok_fingerprint) return kvt_fail(KVT_EMISMATCH, "snapshot: made with another tokenizer");
    if (out->n_vocab != m->info.n_vocab) return kvt_fail(KVT_EFORMAT, "snapshot: vocabulary size differs");
    return kvt_snap_rows_check(m, out);
}

bool kvt_snap_skip_row_types;

/* The name of a row type by its ggml id ("ggml type N" for one this build
 * does not store rows in). */
static const char *ggml_name(uint32_t id, char *buf, size_t cap)
{
    for (kvt_row_type t = KVT_ROWS_F32; t <= KVT_ROWS_Q8_0; t++)
        if (kvt_rows_ggml(t) == id) return kvt_row_type_name(t);
    snprintf(buf, cap, "ggml type %u", id);
    return buf;
}

int kvt_snap_rows_check(const kvt_model *m, const kvt_snap_info *in)
{
    if (kvt_snap_skip_row_types) return KVT_OK; /* tests: the negative control */
    bool typed = in->version == KVT_SNAP_VERSION_TYPED, rounded = kvt_model_rows_rounded(m);
    if (typed ? rounded && in->ggml_k == kvt_rows_ggml(m->type_k) && in->ggml_v == kvt_rows_ggml(m->type_v) : !rounded)
        return KVT_OK;
    char bk[24], bv[24], mine[64];
    if (m->type_k == KVT_ROWS_DEFAULT) snprintf(mine, sizeof mine, "its own");
    else snprintf(mine, sizeof mine, "K %s, V %s", kvt_row_type_name(m->type_k), kvt_row_type_name(m->type_v));
    if (typed)
        return kvt_fail(KVT_EMISMATCH, "snapshot: rows of K %s, V %s; this model's rows are %s (a miss, never converted)",
                        ggml_name(in->ggml_k, bk, sizeof bk), ggml_name(in->ggml_v, bv, sizeof bv), mine);
    return kvt_fail(KVT_EMISMATCH, "snapshot: rows of K f32, V f32 (format version %u); this model's rows are %s "
                    "(a miss, never converted)", in->version, mine);
}

/* The state section becomes the digest of the state it held: the bytes a
 * rebuilt state must hash to (kvt_snap_load_finish). */
int kvt_snap_without_state(const uint8_t *p, size_t len, kvt_wbuf *out)
{
    kvt_snap_info in;
    int rc = kvt_snap_parse_raw(p, len, &in);
    if (rc) return rc;
    /* a recurrent state (version 5, or 6 with 7 sections) cannot be
     * rebuilt from the rows */
    if (in.flags & KVT_SNAP_REPLAY || in.sec_len[SEC_STATE] == 0 || in.nsec == 7) return KVT_OK;
    uint8_t digest[DIGEST_LEN];
    put_u64_at(digest, XXH3_64bits(in.sec[SEC_STATE], in.sec_len[SEC_STATE]));
    const uint8_t *sp[N_SEC_MAX + 1];
    size_t sl[N_SEC_MAX + 1];
    for (int i = 1; i <= N_SEC_MAX; i++) {
        sp[i] = i == SEC_STATE ? digest : in.sec[i];
        sl[i] = i == SEC_STATE ? DIGEST_LEN : in.sec_len[i];
    }
    /* version 6 stays 6, its types kept */
    bool typed = in.version == KVT_SNAP_VERSION_TYPED;
    put_record(out, typed ? KVT_SNAP_VERSION_TYPED : KVT_SNAP_VERSION_REPLAY, in.flags | KVT_SNAP_REPLAY, p + 16, 6,
               typed ? kvt_rd32(p + 60) : 0, sp, sl);
    return out->oom ? kvt_fail(KVT_ENOMEM, "snapshot record") : KVT_OK;
}

/* The checks of kvt_snap_block_check past its length: p holds at least
 * the record's header, ids and text length (BLOCK_FIXED bytes); sum is the
 * XXH3-64 of its first len - 8 bytes, stored the 8 it ends with. */
#define BLOCK_FIXED (BLK_HDR + 4 * KVT_BLOCK + 4)
_Atomic uint64_t kvt_snap_block_hashed;
bool kvt_snap_fault_hash_checked;

static void count_hashed(size_t n) { atomic_fetch_add_explicit(&kvt_snap_block_hashed, n, memory_order_relaxed); }

static int block_check_head(const uint8_t *p, size_t len, uint64_t sum, uint64_t stored, uint64_t *key)
{
    if (memcmp(p, BLK_MAGIC, 8)) return kvt_fail(KVT_EFORMAT, "block: %zu bytes or bad magic", len);
    if (sum != stored) return kvt_fail(KVT_ECORRUPT, "block: checksum mismatch");
    if (kvt_rd32(p + 8) != KVT_SNAP_VERSION) return kvt_fail(KVT_EFORMAT, "block: format version %u", kvt_rd32(p + 8));
    if ((size_t)kvt_rd32(p + 44) != len - BLK_HDR - 8) return kvt_fail(KVT_EFORMAT, "block: payload length");
    if (kvt_rd32(p + BLK_HDR + 4 * KVT_BLOCK) > len - BLK_HDR - 4 * KVT_BLOCK - 12)
        return kvt_fail(KVT_EFORMAT, "block: text length");
    int32_t ids[KVT_BLOCK];
    for (size_t i = 0; i < KVT_BLOCK; i++) ids[i] = (int32_t)kvt_rd32(p + BLK_HDR + 4 * i);
    if (kvt_snap_key_next(kvt_rd64(p + 32), ids) != kvt_rd64(p + 24))
        return kvt_fail(KVT_EMISMATCH, "block: ids do not hash to its key");
    if (key) *key = kvt_rd64(p + 24);
    return KVT_OK;
}

int kvt_snap_block_check(const uint8_t *p, size_t len, uint64_t *key)
{
    if (len < BLK_HDR + 4 * KVT_BLOCK + 8 || memcmp(p, BLK_MAGIC, 8))
        return kvt_fail(KVT_EFORMAT, "block: %zu bytes or bad magic", len);
    count_hashed(len - 8);
    return block_check_head(p, len, XXH3_64bits(p, len - 8), kvt_rd64(p + len - 8), key);
}

int kvt_snap_block_check_parts(const struct iovec *parts, size_t n, size_t len, uint64_t *key)
{
    if (len < BLK_HDR + 4 * KVT_BLOCK + 8) return kvt_fail(KVT_EFORMAT, "block: %zu bytes or bad magic", len);
    /* one pass over the parts: the head and the stored sum gathered, the
     * rest hashed where it lies */
    uint8_t head[BLOCK_FIXED], tail[8];
    XXH3_state_t h;
    XXH3_64bits_reset(&h);
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *p = parts[i].iov_base;
        size_t l = parts[i].iov_len;
        if (l > len - off) return kvt_fail(KVT_EFORMAT, "block: parts longer than its %zu bytes", len);
        if (off < BLOCK_FIXED) memcpy(head + off, p, l < BLOCK_FIXED - off ? l : BLOCK_FIXED - off);
        size_t body = off < len - 8 ? (l < len - 8 - off ? l : len - 8 - off) : 0; /* bytes of it before the sum */
        XXH3_64bits_update(&h, p, body);
        for (size_t k = body; k < l; k++) tail[off + k - (len - 8)] = p[k];
        off += l;
    }
    if (off != len) return kvt_fail(KVT_EFORMAT, "block: parts of %zu bytes, %zu expected", off, len);
    count_hashed(len - 8);
    return block_check_head(head, len, XXH3_64bits_digest(&h), kvt_rd64(tail), key);
}

bool kvt_snap_block_names(const uint8_t *p, uint64_t key, size_t len)
{
    _Static_assert(KVT_SNAP_BLOCK_HEAD == BLK_HDR, "the block header");
    return len >= BLK_HDR + 8 && !memcmp(p, BLK_MAGIC, 8) && kvt_rd64(p + 24) == key &&
           (size_t)kvt_rd32(p + 44) == len - BLK_HDR - 8;
}

int kvt_snap_block_text(const uint8_t *p, size_t len, const uint8_t **text, size_t *tlen)
{
    int rc = kvt_snap_block_check(p, len, NULL);
    if (rc) return rc;
    *tlen = kvt_rd32(p + BLK_HDR + 4 * KVT_BLOCK);
    *text = p + BLK_HDR + 4 * KVT_BLOCK + 4;
    return KVT_OK;
}

/* Expected sizes of the snapshot sections for n tokens of this session. */
static int expect(kvt_session *s, size_t n, size_t *state_len, size_t *rows_len)
{
    *state_len = 0;
    if (s->m->arch->state_save) {
        size_t held = s->n;
        s->n = n; /* the state's length depends only on n */
        kvt_wbuf b = {0};
        s->m->arch->state_save(s, &b);
        s->n = held;
        *state_len = b.len;
        bool oom = b.oom;
        kvt_wbuf_free(&b);
        if (oom) return kvt_fail(KVT_ENOMEM, "snapshot state");
    }
    *rows_len = 0;
    size_t nb = n / KVT_BLOCK;
    for (size_t i = 0; i < s->cache->n_streams; i++) {
        const kvt_stream *st = &s->cache->streams[i];
        *rows_len += (kvt_cache_rows_for(s->cache, i, n) - nb * st->rows_per_block) * st->row_bytes;
    }
    return KVT_OK;
}

static void reset(kvt_session *s)
{
    s->n = 0;
    s->logits_stale = false;
    kvt_cache_truncate(s->cache, 0);
    kvt_session_ckpt_clear(s);
    s->cache->state_check = false;
}

void kvt_snap_empty(kvt_session *s) { reset(s); }

/* The bytes of a block's rows in a record (every stream's, in order). */
static size_t block_rows_len(const kvt_cache *c)
{
    size_t n = 0;
    for (size_t i = 0; i < c->n_streams; i++) n += (size_t)c->streams[i].rows_per_block * c->streams[i].row_bytes;
    return n;
}

/* Where block b's rows of stream i are: the block exists whole
 * (kvt_cache_reserve made it), or NULL. Reads the block table only, so the
 * reader thread may call it while the checker loads other blocks. */
static void *block_dst(const kvt_cache *c, size_t i, uint32_t b)
{
    return (void *)kvt_cache_block_ro(c, i, b);
}

/* The places block b's rows are read into in place (false: a block without
 * its rows allocated, to be read whole). iov has n_streams entries. */
static bool block_rows_at(const kvt_cache *c, uint32_t b, struct iovec *iov, kvt_block_rows *out)
{
    size_t bytes = 0;
    for (size_t i = 0; i < c->n_streams; i++) {
        const kvt_stream *st = &c->streams[i];
        void *dst = block_dst(c, i, b);
        if (!dst) return false;
        iov[i] = (struct iovec){dst, (size_t)st->rows_per_block * st->row_bytes};
        bytes += iov[i].iov_len;
    }
    *out = (kvt_block_rows){iov, (int)c->n_streams, bytes};
    return true;
}

/* Check a block record against what the snapshot expects, then copy its
 * rows in. in_place: its rows were read straight into the session's rows
 * (kvt_block_read_fn) and p holds the rest of the record, len - rows bytes
 * of it; they are checked where they are. checked: its reader checked the
 * record's checksum over these very bytes (kvt_block_read_fn), so it is
 * not hashed again; every other check stands. */
static int load_block(kvt_session *s, uint32_t b, uint64_t prev, uint64_t key, const uint8_t *p, size_t len,
                      bool in_place, bool checked)
{
    const kvt_cache *c = s->cache;
    size_t rows_len = block_rows_len(c);
    size_t fixed = BLK_HDR + 4 * KVT_BLOCK + 4 + rows_len + 8;
    if (len < fixed || memcmp(p, BLK_MAGIC, 8))
        return kvt_fail(KVT_EFORMAT, "block %u: %zu bytes or bad magic (at least %zu expected)", b, len, fixed);
    size_t payload = len - BLK_HDR - 8, head = len - rows_len - 8; /* head: the bytes before the rows */
    uint64_t sum, stored = kvt_rd64(p + (in_place ? head : len - 8));
    if (checked && !kvt_snap_fault_hash_checked) {
        sum = stored;
    } else if (in_place) { /* the checksum of the pieces, as of the record they make */
        XXH3_state_t *h = XXH3_createState();
        if (!h) return kvt_fail(KVT_ENOMEM, "block %u checksum", b);
        XXH3_64bits_reset(h);
        XXH3_64bits_update(h, p, head);
        for (size_t i = 0; i < c->n_streams; i++) {
            const kvt_stream *st = &c->streams[i];
            XXH3_64bits_update(h, block_dst(c, i, b), (size_t)st->rows_per_block * st->row_bytes);
        }
        sum = XXH3_64bits_digest(h);
        XXH3_freeState(h);
        count_hashed(len - 8);
    } else {
        sum = XXH3_64bits(p, len - 8);
        count_hashed(len - 8);
    }
    if (sum != stored) return kvt_fail(KVT_ECORRUPT, "block %u: checksum mismatch", b);
    if (kvt_rd32(p + 8) != KVT_SNAP_VERSION || kvt_rd32(p + 12) != b || kvt_rd64(p + 16) != kvt_model_fingerprint(s->m) ||
        kvt_rd64(p + 24) != key || kvt_rd64(p + 32) != prev || kvt_rd32(p + 40) != c->n_streams ||
        kvt_rd32(p + 44) != payload)
        return kvt_fail(KVT_EMISMATCH, "block %u: header does not match the snapshot", b);
    int32_t *ids = s->tokens + (size_t)b * KVT_BLOCK;
    for (size_t i = 0; i < KVT_BLOCK; i++) {
        uint32_t t = kvt_rd32(p + BLK_HDR + 4 * i);
        if (t >= s->m->info.n_vocab) return kvt_fail(KVT_EFORMAT, "block %u: token id %u out of range", b, t);
        ids[i] = (int32_t)t;
    }
    if (kvt_snap_key_next(prev, ids) != key) return kvt_fail(KVT_EMISMATCH, "block %u: ids do not hash to its key", b);
    size_t text_len = kvt_rd32(p + BLK_HDR + 4 * KVT_BLOCK);
    if (text_len != len - fixed) return kvt_fail(KVT_EFORMAT, "block %u: text of %zu bytes does not fit", b, text_len);
    if (in_place) return KVT_OK;
    const uint8_t *rows = p + head;
    for (size_t i = 0; i < c->n_streams; i++) {
        const kvt_stream *st = &c->streams[i];
        size_t bytes = (size_t)st->rows_per_block * st->row_bytes;
        void *dst = kvt_cache_block(s->cache, i, b);
        if (!dst) return kvt_fail(KVT_ENOMEM, "block %u rows", b);
        memcpy(dst, rows, bytes);
        rows += bytes;
    }
    return KVT_OK;
}

/* An architecture's error while restoring the state, reported as the
 * record's (the disk tier blames the record, not its last block). */
static int state_fail(kvt_session *s, int rc)
{
    char why[400];
    snprintf(why, sizeof why, "%s", kvt_errmsg());
    reset(s);
    return kvt_fail(rc, "snapshot: %s", why);
}

int kvt_snap_load(kvt_session *s, const uint8_t *rec, size_t len, kvt_block_get_fn get, void *user)
{
    bool rebuild = false;
    int rc = kvt_snap_load_start(s, rec, len, get, user, &rebuild);
    return rc ? rc : kvt_snap_load_finish(s, rebuild);
}

bool kvt_snap_skip_state_digest;

/* The canonical bytes of the rebuilt state (what the whole record's state
 * section held) must hash to the digest the record stores. The replay's own
 * checks (recomputed rows, logits after the last token) see only the part of
 * the state that reaches them; the digest sees every byte of it. */
static int check_state_digest(kvt_session *s)
{
    kvt_cache *c = s->cache;
    if (!c->state_check) return KVT_OK;
    c->state_check = false;
    if (kvt_snap_skip_state_digest) return KVT_OK; /* tests: the negative control */
    kvt_wbuf b = {0};
    s->m->arch->state_save(s, &b);
    bool oom = b.oom, ok = !oom && XXH3_64bits(b.p, b.len) == c->state_digest;
    kvt_wbuf_free(&b);
    if (oom) return kvt_fail(KVT_ENOMEM, "snapshot state");
    if (!ok) return kvt_fail(KVT_ECORRUPT, "the state rebuilt at %zu tokens does not match the record's state digest", s->n);
    return KVT_OK;
}

int kvt_snap_load_finish(kvt_session *s, bool rebuild)
{
    int rc;
    if (rebuild && ((rc = kvt_session_work(s)) || (rc = s->m->arch->state_rebuild(s)) || (rc = check_state_digest(s))))
        return state_fail(s, rc);
    s->cache->state_check = false;
    kvt_session_checkpoint(s);
    return KVT_OK;
}

/* Where a load's blocks come from: get (a pointer valid until the next
 * call) or read (into a buffer of the loader's; concurrent: from two
 * threads at once). bad and bad_key: the block whose read or check failed. */
struct block_src {
    kvt_block_get_fn get;
    kvt_block_read_fn read;
    bool concurrent;
    void *user;
    uint32_t bad;
    uint64_t bad_key;
};

/* Key of the block before b: the chain the record lists. */
static uint64_t prev_key(const kvt_session *s, const kvt_snap_info *in, uint32_t b)
{
    return b ? kvt_rd64(in->sec[SEC_KEYS] + 8 * (size_t)(b - 1)) : kvt_snap_key0(s->m);
}

/* Read (in place where the source can) and check block b; buf and iov are
 * the caller's (iov: n_streams entries). */
static int read_and_load(kvt_session *s, const kvt_snap_info *in, struct block_src *src, uint32_t b, uint8_t **buf,
                         size_t *cap, struct iovec *iov)
{
    uint64_t key = kvt_rd64(in->sec[SEC_KEYS] + 8 * (size_t)b);
    const uint8_t *p = NULL;
    size_t len = 0;
    bool in_place = false, checked = false;
    int rc;
    if (src->read) {
        kvt_block_rows rows;
        bool at = block_rows_at(s->cache, b, iov, &rows);
        rc = src->read(src->user, b, key, at ? &rows : NULL, buf, cap, &len, &in_place, &checked);
        p = *buf;
    } else {
        rc = src->get(src->user, b, key, &p, &len);
    }
    return rc ? rc : load_block(s, b, prev_key(s, in, b), key, p, len, in_place, checked);
}

/* ---- the blocks of a load on two threads ----
 *
 * With a source that reads concurrently, the blocks go in runs of PAR_RUN,
 * taken in turn, to two halves that two of the pool's threads read and
 * check straight into the rows: the copy out of the page cache, a load's
 * largest cost, runs on both cores. A block's checks need only
 * the record (its key and the one before it), never another block, so the
 * order they run in changes nothing, and the outcome is the one of a load
 * that read and checked the blocks one after the other: the first block in
 * order whose read or check fails is the failure (a thread stops at its
 * first failure and skips blocks past the lowest one seen so far; every
 * block before that one was read and checked by one thread or the other).
 * Errors raised on the other thread are carried over by message. */

#define PAR_RUN 16
#define PAR_MIN 32 /* fewer blocks: one thread */

struct par {
    kvt_session *s;
    const kvt_snap_info *in;
    struct block_src *src;
    _Atomic uint32_t first_bad;  /* the lowest failed block so far (UINT32_MAX: none) */
    int rc[2];
    uint32_t bad[2];
    char why[2][512];
};

/* Half w (0 or 1) of the blocks: the runs w, w + 2, ... */
static void par_half(struct par *p, uint32_t w)
{
    uint32_t nb = p->in->nb;
    p->bad[w] = UINT32_MAX;
    uint8_t *buf = NULL;
    size_t cap = 0;
    struct iovec *iov = kvt_calloc(p->s->cache->n_streams ? p->s->cache->n_streams : 1, sizeof *iov);
    int rc = iov ? KVT_OK : KVT_ENOMEM;
    uint32_t b = w * PAR_RUN; /* out of memory: blamed on the first block this thread would read */
    for (; !rc && b < nb; b += (b + 1) % PAR_RUN ? 1 : PAR_RUN + 1) {
        if (b > atomic_load(&p->first_bad)) break;
        rc = read_and_load(p->s, p->in, p->src, b, &buf, &cap, iov);
        if (rc) break;
    }
    if (rc) {
        p->rc[w] = rc;
        p->bad[w] = b;
        snprintf(p->why[w], sizeof p->why[w], "%s", kvt_errmsg());
        uint32_t cur = atomic_load(&p->first_bad);
        while (b < cur && !atomic_compare_exchange_weak(&p->first_bad, &cur, b)) {}
    }
    free(buf);
    free(iov);
}

/* The pool's ranges of [0, 2) are the halves: on two threads, or one after
 * the other on one when the other thread is late or busy. */
static void par_part(void *ctx, uint32_t part, size_t begin, size_t end)
{
    (void)part;
    for (size_t w = begin; w < end && w < 2; w++) par_half(ctx, (uint32_t)w);
}

static int load_blocks_parallel(kvt_session *s, const kvt_snap_info *in, struct block_src *src)
{
    struct par *p = kvt_calloc(1, sizeof *p);
    if (!p) return KVT_ENOMEM;
    *p = (struct par){.s = s, .in = in, .src = src, .first_bad = UINT32_MAX};
    int rc = KVT_OK;
    kvt_pool_for_part(s->pool, 2, 1, par_part, p);
    int w = p->bad[1] < p->bad[0];
    if (p->rc[w]) {
        rc = kvt_fail(p->rc[w], "%s", p->why[w]);
        src->bad = p->bad[w];
        src->bad_key = kvt_rd64(in->sec[SEC_KEYS] + 8 * (size_t)p->bad[w]);
    }
    free(p);
    return rc;
}

/* Every block of the record, checked and copied in, in order. */
static int load_blocks(kvt_session *s, const kvt_snap_info *in, struct block_src *src)
{
    if (src->read && src->concurrent && in->nb >= PAR_MIN && kvt_pool_size(s->pool) > 1)
        return load_blocks_parallel(s, in, src);
    uint8_t *buf = NULL;
    size_t cap = 0;
    struct iovec *iov = kvt_calloc(s->cache->n_streams ? s->cache->n_streams : 1, sizeof *iov);
    if (!iov) return KVT_ENOMEM;
    int rc = KVT_OK;
    for (uint32_t b = 0; b < in->nb && !rc; b++) {
        if ((rc = read_and_load(s, in, src, b, &buf, &cap, iov))) {
            src->bad = b;
            src->bad_key = kvt_rd64(in->sec[SEC_KEYS] + 8 * (size_t)b);
        }
    }
    free(buf);
    free(iov);
    return rc;
}

static int load_start(kvt_session *s, const uint8_t *rec, size_t len, struct block_src *src, bool *rebuild)
{
    *rebuild = false;
    src->bad = UINT32_MAX;
    src->bad_key = 0;
    kvt_snap_info in;
    reset(s);
    int rc = kvt_snap_parse(s->m, rec, len, &in);
    if (rc) return rc;
    if (in.n > s->n_ctx) return kvt_fail(KVT_ECTX, "snapshot of %u tokens exceeds the context of %u", in.n, s->n_ctx);
    size_t tail = in.n - (size_t)in.nb * KVT_BLOCK, state_len = 0, rows_len = 0, V = s->m->info.n_vocab;
    if ((rc = expect(s, in.n, &state_len, &rows_len))) return rc;
    bool replay = in.flags & KVT_SNAP_REPLAY;
    if (replay && !s->m->arch->state_rebuild)
        return kvt_fail(KVT_EFORMAT, "snapshot: stored without its state, which this model cannot rebuild");
    /* without its state: versions 4 and 6 keep the state's digest,
     * version 3 nothing. A model with recurrent layers: versions 5 and 6
     * keep their state in its own section; version 2 (the release before)
     * at the end of the state section, where it is still read. */
    size_t R = recurrent_bytes(s->m), rec_len = 0;
    bool digest = in.version == KVT_SNAP_VERSION_REPLAY || in.version == KVT_SNAP_VERSION_TYPED;
    if (replay) state_len = digest ? DIGEST_LEN : 0;
    if (in.version == KVT_SNAP_VERSION_TYPED && R && in.nsec != 7)
        return kvt_fail(KVT_EFORMAT, "snapshot: version 6 of a model with recurrent layers without their section");
    if (in.nsec == 7) {
        if (!R) return kvt_fail(KVT_EFORMAT, "snapshot: a recurrent state for a model without recurrent layers");
        if (state_len < R) return kvt_fail(KVT_EFORMAT, "snapshot: state shorter than its recurrent part");
        state_len -= R;
        rec_len = R;
    }
    if (in.sec_len[SEC_TOKENS] != 4 * tail || in.sec_len[SEC_LOGITS] != (in.n ? V * 4 : 0) ||
        in.sec_len[SEC_STATE] != state_len || in.sec_len[SEC_ROWS] != rows_len ||
        in.sec_len[SEC_KEYS] != 8 * (size_t)in.nb || in.sec_len[SEC_RECURRENT] != rec_len)
        return kvt_fail(KVT_EFORMAT, "snapshot: section sizes do not fit %u tokens of this model", in.n);
    /* the rows of every block in one allocation (the blocks' records fill
     * every byte of it, or the session is emptied) */
    if (kvt_cache_reserve(s->cache, in.nb)) return kvt_fail(KVT_ENOMEM, "rows of %u blocks", in.nb);
    if ((rc = load_blocks(s, &in, src))) { reset(s); return rc; }
    uint64_t last = in.nb ? kvt_rd64(in.sec[SEC_KEYS] + 8 * (size_t)(in.nb - 1)) : kvt_snap_key0(s->m);
    if (last != in.head) { reset(s); return kvt_fail(KVT_EMISMATCH, "snapshot: block chain does not end at its head"); }
    for (size_t i = 0; i < tail; i++) {
        uint32_t t = kvt_rd32(in.sec[SEC_TOKENS] + 4 * i);
        if (t >= V) { reset(s); return kvt_fail(KVT_EFORMAT, "snapshot: token id %u out of range", t); }
        s->tokens[(size_t)in.nb * KVT_BLOCK + i] = (int32_t)t;
    }
    if (in.n) memcpy(s->logits, in.sec[SEC_LOGITS], V * 4);
    /* the architecture reads its state as one string: version 5's two
     * sections joined */
    uint8_t *joined = NULL;
    kvt_rbuf r = {in.sec[SEC_STATE], in.sec_len[SEC_STATE], 0};
    if (rec_len) {
        if (!(joined = kvt_malloc(state_len + rec_len))) { reset(s); return kvt_fail(KVT_ENOMEM, "snapshot state"); }
        if (state_len) memcpy(joined, in.sec[SEC_STATE], state_len);
        memcpy(joined + state_len, in.sec[SEC_RECURRENT], rec_len);
        r = (kvt_rbuf){joined, state_len + rec_len, 0};
    }
    if (!replay && s->m->arch->state_load && (rc = s->m->arch->state_load(s, in.n, &r))) {
        free(joined);
        return state_fail(s, rc);
    }
    free(joined);
    const uint8_t *rows = in.sec[SEC_ROWS];
    for (size_t i = 0; i < s->cache->n_streams; i++) {
        const kvt_stream *st = &s->cache->streams[i];
        for (size_t k = (size_t)in.nb * st->rows_per_block; k < kvt_cache_rows_for(s->cache, i, in.n); k++) {
            void *dst = kvt_cache_row(s->cache, i, k);
            if (!dst) { reset(s); return kvt_fail(KVT_ENOMEM, "snapshot rows"); }
            memcpy(dst, rows, st->row_bytes);
            rows += st->row_bytes;
        }
    }
    s->n = in.n;
    s->logits_stale = false;
    /* the keys the blocks were checked against are the session's now */
    for (uint32_t b = 0; b < in.nb; b++) s->cache->keys[b] = kvt_rd64(in.sec[SEC_KEYS] + 8 * (size_t)b);
    s->cache->n_keys = in.nb;
    s->cache->key_scope = KVT_KEYS_RECORDS;
    *rebuild = replay;
    s->cache->state_check = replay && digest;
    if (s->cache->state_check) s->cache->state_digest = kvt_rd64(in.sec[SEC_STATE]);
    return KVT_OK;
}

int kvt_snap_load_start(kvt_session *s, const uint8_t *rec, size_t len, kvt_block_get_fn get, void *user,
                        bool *rebuild)
{
    struct block_src src = {.get = get, .user = user};
    return load_start(s, rec, len, &src, rebuild);
}

int kvt_snap_load_read_start(kvt_session *s, const uint8_t *rec, size_t len, kvt_block_read_fn read, bool concurrent,
                             void *user, bool *rebuild, uint32_t *bad_block, uint64_t *bad_key)
{
    struct block_src src = {.read = read, .concurrent = concurrent, .user = user};
    int rc = load_start(s, rec, len, &src, rebuild);
    *bad_block = src.bad;
    *bad_key = src.bad_key;
    return rc;
}

/* ---- RAM snapshots: the record with its blocks inline ---- */

int kvt_session_snapshot(const kvt_session *cs, uint8_t **out, size_t *len)
{
    /* encoding changes nothing the session holds: state_at may measure,
     * and the block keys are kept (kvt_snap_keys) */
    kvt_session *s = (kvt_session *)cs;
    kvt_wbuf b = {0};
    int rc = kvt_snap_encode(s, s->n, KVT_SNAP_INLINE, &b, NULL);
    uint64_t prev = kvt_snap_key0(s->m), key;
    for (size_t i = 0; !rc && i < s->n / KVT_BLOCK; i++) {
        rc = kvt_snap_block(s, (uint32_t)i, prev, &b, &key);
        prev = key;
    }
    if (rc) { kvt_wbuf_free(&b); return rc; }
    *out = b.p ? b.p : malloc(1);
    *len = b.len;
    return *out ? KVT_OK : KVT_ENOMEM;
}

struct inline_blocks { const uint8_t *p; size_t len, off; };

/* Inline block records follow each other; each states its payload length. */
static int get_inline(void *user, uint32_t b, uint64_t key, const uint8_t **p, size_t *len)
{
    struct inline_blocks *ib = user;
    if (ib->len - ib->off < BLK_HDR + 8) return kvt_fail(KVT_EFORMAT, "snapshot: inline block %u missing", b);
    size_t n = BLK_HDR + (size_t)kvt_rd32(ib->p + ib->off + 44) + 8;
    if (n > ib->len - ib->off) return kvt_fail(KVT_EFORMAT, "snapshot: inline block %u truncated", b);
    *p = ib->p + ib->off;
    *len = n;
    ib->off += n;
    (void)key;
    return KVT_OK;
}

int kvt_session_restore(kvt_session *s, const uint8_t *buf, size_t len)
{
    kvt_snap_info in;
    reset(s);
    int rc = kvt_snap_parse(s->m, buf, len, &in);
    if (rc) return rc;
    if (!(in.flags & KVT_SNAP_INLINE)) return kvt_fail(KVT_EFORMAT, "snapshot: blocks are not inline");
    struct inline_blocks ib = {buf, len, in.rec_len};
    rc = kvt_snap_load(s, buf, in.rec_len, get_inline, &ib);
    if (!rc && ib.off != len) {
        reset(s);
        rc = kvt_fail(KVT_EFORMAT, "snapshot: %zu bytes after the last block", len - ib.off);
    }
    return rc;
}

/* ---- canonical cache bytes ---- */

int kvt_session_cache_bytes(const kvt_session *s, uint8_t **out, size_t *len)
{
    kvt_wbuf b = {0};
    if (s->m->arch->state_save) s->m->arch->state_save(s, &b);
    const kvt_cache *c = s->cache;
    for (size_t i = 0; i < c->n_streams; i++) {
        size_t rows = kvt_cache_rows_for(c, i, s->n);
        for (size_t r = 0; r < rows; r++) kvt_wbuf_put(&b, kvt_cache_row_ro(c, i, r), c->streams[i].row_bytes);
    }
    if (b.oom) { kvt_wbuf_free(&b); return kvt_fail(KVT_ENOMEM, "cache bytes"); }
    *out = b.p ? b.p : malloc(1);
    *len = b.len;
    return *out ? KVT_OK : KVT_ENOMEM;
}
