/* block: block records (one per complete 128-token block, docs/FORMAT.md)
 * on any bytes: the model-free check and text (kvt_snap_block_check,
 * kvt_snap_block_text, what the disk tier runs on a stored block), and the
 * loader's checks and copy (kvt_snap_load of a ds4-tiny record of 130 tokens
 * whose one block is the input). Each runs on the input as it is and on a
 * copy repaired by fuzz_fix_block with the mode bits of the input's last
 * byte (part of the checksum it replaces); bit 3 also makes the copy claim
 * to be block 0 of the record's model (index, previous key, fingerprint,
 * stream count), so that it gets past the header comparison. What must
 * hold: a checked block's key and text lie where the header says; a loaded
 * block's ids are the session's first 128 and the session runs on; a refused
 * load leaves the session empty. */
#include "fuzz.h"
#include "arch/model.h"
#include "session/snapshot.h"
#include "base/util.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#define BLK_HDR 48
#define N_TOK 130

static uint8_t *rec;        /* a ds4-tiny record of N_TOK tokens, without its block */
static size_t rec_len, keys_off;
static size_t rows;         /* bytes of one block's rows */

static void init(void)
{
    kvt_model *m = fuzz_ds4(7);
    kvt_session *s = fuzz_session(m, 0);
    int32_t t[N_TOK];
    uint64_t x = 1;
    t[0] = 256;
    for (size_t i = 1; i < N_TOK; i++) t[i] = (int32_t)((x = x * 6364136223846793005ull + 1442695040888963407ull) >> 56);
    kvt_wbuf b = {0};
    if (kvt_session_sync(s, t, N_TOK, NULL) || kvt_snap_encode(s, N_TOK, 0, &b, NULL)) abort();
    kvt_snap_info in;
    if (kvt_snap_parse_raw(b.p, b.len, &in)) abort();
    rec = b.p;
    rec_len = b.len;
    keys_off = (size_t)(in.sec[6] - b.p);
    for (size_t i = 0; i < s->cache->n_streams; i++)
        rows += (size_t)s->cache->streams[i].rows_per_block * s->cache->streams[i].row_bytes;
}

static uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

struct one { const uint8_t *p; size_t len; };
static int get_one(void *user, uint32_t b, uint64_t key, const uint8_t **p, size_t *len)
{
    struct one *o = user;
    (void)key;
    if (b) return kvt_fail(KVT_EINVAL, "block %u asked for", b);
    *p = o->p;
    *len = o->len;
    return KVT_OK;
}

static void check(const uint8_t *p, size_t len)
{
    uint64_t key = 0;
    if (kvt_snap_block_check(p, len, &key) == KVT_OK) {
        FUZZ_CHECK(len >= 56 + 516 && key == rd64(p + 24), "a checked block's key is not its header's");
        const uint8_t *text = NULL;
        size_t tl = 0;
        FUZZ_CHECK(kvt_snap_block_text(p, len, &text, &tl) == KVT_OK, "a checked block has no text");
        FUZZ_CHECK(text == p + BLK_HDR + 516 && tl <= len - (BLK_HDR + 516 + 8), "the text of a block lies outside it");
    }
    /* as block 0 of the record: its key in the record's keys and head */
    kvt_session *s = fuzz_session(fuzz_ds4(7), 0);
    uint8_t *r = malloc(rec_len);
    if (!r) return;
    memcpy(r, rec, rec_len);
    uint64_t k = len >= 32 ? rd64(p + 24) : 0;
    memcpy(r + keys_off, &k, 8);
    memcpy(r + 48, &k, 8);
    fuzz_fix_record(r, rec_len);
    struct one o = {p, len};
    int rc = kvt_snap_load(s, r, rec_len, get_one, &o);
    if (rc) {
        FUZZ_CHECK(kvt_session_len(s) == 0, "a refused block (%s) leaves %zu tokens", kvt_errmsg(), kvt_session_len(s));
    } else {
        bool ids = kvt_session_len(s) == N_TOK;
        for (size_t i = 0; ids && i < 128; i++) ids = (uint32_t)kvt_session_tokens(s)[i] == (uint32_t)(p[BLK_HDR + 4 * i] |
            p[BLK_HDR + 4 * i + 1] << 8 | p[BLK_HDR + 4 * i + 2] << 16 | (uint32_t)p[BLK_HDR + 4 * i + 3] << 24);
        FUZZ_CHECK(ids, "a loaded block's ids are not the session's");
        FUZZ_CHECK(kvt_session_decode(s, 1) == KVT_OK, "a session with a loaded block does not decode: %s", kvt_errmsg());
    }
    free(r);
}

int fuzz_block(const uint8_t *data, size_t size)
{
    if (!rec) init();
    if (size == 0) return 0;
    check(data, size);
    uint8_t *p = malloc(size);
    if (!p) return 0;
    memcpy(p, data, size);
    unsigned mode = p[size - 1];
    if (mode & 8 && size >= 56 + 516) {
        kvt_model *m = fuzz_ds4(7);
        uint32_t b = 0, ns = (uint32_t)fuzz_session(m, 0)->cache->n_streams;
        uint64_t key0 = kvt_snap_key0(m);
        memcpy(p + 12, &b, 4);
        memcpy(p + 16, &(uint64_t){kvt_model_fingerprint(m)}, 8);
        memcpy(p + 32, &key0, 8);
        memcpy(p + 40, &ns, 4);
    }
    fuzz_fix_block(p, size, mode & 7, rows);
    if (memcmp(p, data, size)) check(p, size);
    free(p);
    return 0;
}
