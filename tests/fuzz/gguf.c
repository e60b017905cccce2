/* gguf: the GGUF reader on any bytes (kvt_gguf_open_mem), then what its
 * users do with what it accepts: every value and typed getter, every tensor
 * dequantised, the writer's round trip (a file written from what was read
 * reads back identically), the tokenizer built from the metadata (and its
 * own GGUF round trip), and the model loaders of both architectures, a
 * model they accept running a few tokens and a snapshot of them. */
#include "fuzz.h"
#include "format/gguf.h"
#include "arch/model.h"
#include "text/tokenizer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 64
#define MAX_F32 (1u << 22) /* elements dequantised per tensor */

volatile uint32_t fuzz_sink;

static bool is_scalar(uint32_t t) { return t <= KVT_GGUF_BOOL || (t >= KVT_GGUF_U64 && t <= KVT_GGUF_F64); }

/* Read every byte of a value; false when it breaks the header's promises. */
static bool walk(const kvt_gguf_val *v, int depth, uint64_t *acc)
{
    if (depth > MAX_DEPTH) return true;
    if (v->type == KVT_GGUF_STR) {
        for (uint64_t i = 0; i < v->n; i++) *acc += (uint8_t)v->v.str[i];
        return v->n == 0 || v->v.str;
    }
    if (v->type == KVT_GGUF_ARR) {
        if (v->n && !v->v.arr) return false;
        for (uint64_t i = 0; i < v->n; i++) {
            if (v->v.arr[i].type != v->elem_type) return false;
            if (!walk(&v->v.arr[i], depth + 1, acc)) return false;
        }
        return true;
    }
    *acc += v->v.u;
    return is_scalar(v->type);
}

static bool val_equal(const kvt_gguf_val *a, const kvt_gguf_val *b, int depth)
{
    if (a->type != b->type || a->n != b->n) return false;
    if (depth > MAX_DEPTH) return true;
    switch (a->type) {
    case KVT_GGUF_STR: return a->n == 0 || !memcmp(a->v.str, b->v.str, a->n);
    case KVT_GGUF_ARR:
        if (a->elem_type != b->elem_type) return false;
        for (uint64_t i = 0; i < a->n; i++)
            if (!val_equal(&a->v.arr[i], &b->v.arr[i], depth + 1)) return false;
        return true;
    case KVT_GGUF_F32: case KVT_GGUF_F64: return !memcmp(&a->v.f, &b->v.f, sizeof a->v.f) || a->v.f == b->v.f;
    default: return a->v.u == b->v.u;
    }
}

static void check_getters(const kvt_gguf *g, const char *key)
{
    uint32_t u32;
    int64_t i64;
    float f;
    bool b;
    const char *s;
    size_t n;
    const kvt_gguf_val *items;
    int rc[9] = {
        kvt_gguf_get_u32(g, key, &u32), kvt_gguf_get_i64(g, key, &i64), kvt_gguf_get_f32(g, key, &f),
        kvt_gguf_get_bool(g, key, &b), kvt_gguf_get_str(g, key, &s, &n),
        kvt_gguf_get_arr(g, key, KVT_GGUF_STR, &items, &n), kvt_gguf_get_arr(g, key, KVT_GGUF_I32, &items, &n),
        kvt_gguf_get_arr(g, key, KVT_GGUF_F32, &items, &n), kvt_gguf_get_arr(g, key, KVT_GGUF_ARR, &items, &n),
    };
    for (int i = 0; i < 9; i++)
        FUZZ_CHECK(rc[i] == KVT_OK || rc[i] == KVT_EFORMAT, "getter %d of '%.100s' gave %s", i, key,
                   kvt_strerror(rc[i]));
    FUZZ_CHECK(kvt_gguf_get(g, key), "key '%.100s' is listed but not found", key);
}

static void check_tensor(const kvt_gguf *g, const kvt_gguf_tensor *t, const uint8_t *data, size_t size)
{
    FUZZ_CHECK(t->name && kvt_gguf_find_tensor(g, t->name), "tensor not found by its name");
    FUZZ_CHECK(t->n_dims >= 1 && t->n_dims <= 4, "tensor %.100s: %u dims", t->name, t->n_dims);
    uint64_t ne = 1;
    bool over = false;
    for (int d = 0; d < 4; d++) {
        over |= t->ne[d] && ne > UINT64_MAX / t->ne[d];
        ne *= t->ne[d];
        if (d >= (int)t->n_dims) FUZZ_CHECK(t->ne[d] == 1, "tensor %.100s: unused dim %d is %llu", t->name, d,
                                             (unsigned long long)t->ne[d]);
    }
    FUZZ_CHECK(!over && ne == t->n_elem, "tensor %.100s: %llu elements, dims give %llu", t->name,
               (unsigned long long)t->n_elem, (unsigned long long)ne);
    FUZZ_CHECK(kvt_ggml_type_name(t->type) && t->n_bytes == kvt_ggml_type_size(t->type, t->n_elem),
               "tensor %.100s: %llu bytes for %llu elements of type %u", t->name, (unsigned long long)t->n_bytes,
               (unsigned long long)t->n_elem, t->type);
    const uint8_t *p = t->data;
    FUZZ_CHECK(p >= data && p <= data + size && t->n_bytes <= (size_t)(data + size - p),
               "tensor %.100s lies outside the buffer", t->name);
    if (t->n_elem == 0 || t->n_elem > MAX_F32) return;
    float *f = malloc(t->n_elem * sizeof *f);
    if (!f) return;
    FUZZ_CHECK(kvt_gguf_tensor_to_f32(t, f, t->n_elem) == KVT_OK, "tensor %.100s: to_f32: %s", t->name, kvt_errmsg());
    uint32_t bits = 0; /* every value is read */
    for (uint64_t i = 0; i < t->n_elem; i++) {
        uint32_t u;
        memcpy(&u, &f[i], 4);
        bits ^= u;
    }
    fuzz_sink ^= bits;
    free(f);
}

/* A file written from what was read reads back identically. */
static void check_rewrite(const kvt_gguf *g)
{
    size_t nkv = kvt_gguf_n_kv(g), nt = kvt_gguf_n_tensors(g);
    /* the writer replaces a repeated key: compare only files without one */
    for (size_t i = 0; i < nkv; i++)
        for (size_t j = 0; j < i; j++)
            if (!strcmp(kvt_gguf_key(g, i), kvt_gguf_key(g, j))) return;
    for (size_t i = 0; i < nt; i++)
        for (size_t j = 0; j < i; j++)
            if (!strcmp(kvt_gguf_tensor_at(g, i)->name, kvt_gguf_tensor_at(g, j)->name)) return;
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    if (!w) return;
    int rc = KVT_OK;
    for (size_t i = 0; !rc && i < nkv; i++) rc = kvt_gguf_writer_set(w, kvt_gguf_key(g, i), kvt_gguf_val_at(g, i));
    for (size_t i = 0; !rc && i < nt; i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        rc = kvt_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data, t->n_bytes);
    }
    uint8_t *buf = NULL;
    size_t len = 0;
    if (!rc) rc = kvt_gguf_writer_to_mem(w, &buf, &len);
    kvt_gguf_writer_free(w);
    if (rc) return; /* the writer may refuse what it would not write (an odd alignment) */
    kvt_gguf *h = NULL;
    rc = kvt_gguf_open_mem(&h, buf, len);
    FUZZ_CHECK(rc == KVT_OK, "the rewritten file does not open: %s", kvt_errmsg());
    if (!rc) {
        bool same = kvt_gguf_n_kv(h) == nkv && kvt_gguf_n_tensors(h) == nt &&
                    kvt_gguf_alignment(h) == kvt_gguf_alignment(g);
        for (size_t i = 0; same && i < nkv; i++)
            same = !strcmp(kvt_gguf_key(g, i), kvt_gguf_key(h, i)) &&
                   val_equal(kvt_gguf_val_at(g, i), kvt_gguf_val_at(h, i), 0);
        for (size_t i = 0; same && i < nt; i++) {
            const kvt_gguf_tensor *a = kvt_gguf_tensor_at(g, i), *b = kvt_gguf_tensor_at(h, i);
            same = !strcmp(a->name, b->name) && a->type == b->type && a->n_dims == b->n_dims &&
                   !memcmp(a->ne, b->ne, sizeof a->ne) && a->n_bytes == b->n_bytes &&
                   (a->n_bytes == 0 || !memcmp(a->data, b->data, a->n_bytes));
        }
        FUZZ_CHECK(same, "the rewritten file reads back differently (%zu keys, %zu tensors)", nkv, nt);
    }
    kvt_gguf_close(h);
    free(buf);
}

static const char *const texts[] = {
    "Hello world", " a  b\n\n\tc ", "<s></s><unk>", "\xe2\x96\x81x\xe2\x96\x81", "\xf0\x9f\x98\x80\xff\x80",
    ("<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>hi"),
};

/* Encode the sample texts; the ids (with parse_special too) as one list. */
static bool encode_all(const kvt_tokenizer *t, int32_t **all, size_t *n_all)
{
    *all = NULL;
    *n_all = 0;
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++)
        for (int sp = 0; sp < 2; sp++) {
            int32_t *ids = NULL;
            size_t n = 0;
            if (kvt_tokenizer_encode(t, texts[i], strlen(texts[i]), sp, sp, &ids, &n)) {
                free(*all);
                *all = NULL;
                return false;
            }
            for (size_t k = 0; k < n; k++)
                FUZZ_CHECK(ids[k] >= 0 && (uint32_t)ids[k] < kvt_tokenizer_n_vocab(t), "id %d out of range", ids[k]);
            int32_t *p = realloc(*all, (*n_all + n + 1) * sizeof *p);
            if (!p) {
                free(ids);
                free(*all);
                *all = NULL;
                return false;
            }
            memcpy(p + *n_all, ids, n * sizeof *ids);
            *all = p;
            *n_all += n;
            free(ids);
        }
    return true;
}

static void check_tokenizer(const kvt_gguf *g)
{
    kvt_tokenizer *t = NULL, *t2 = NULL;
    if (kvt_tokenizer_from_gguf(&t, g)) return;
    uint32_t nv = kvt_tokenizer_n_vocab(t);
    FUZZ_CHECK(nv > 0, "a tokenizer without tokens");
    int32_t bos = kvt_tokenizer_bos(t), eos = kvt_tokenizer_eos(t);
    FUZZ_CHECK(bos < (int32_t)nv && eos < (int32_t)nv && bos >= -1 && eos >= -1, "bos %d eos %d of %u", bos, eos, nv);
    for (uint32_t i = 0; i < nv; i++) {
        const char *p;
        size_t n;
        FUZZ_CHECK(kvt_tokenizer_piece(t, (int32_t)i, &p, &n) == KVT_OK, "no piece for %u", i);
        FUZZ_CHECK(kvt_tokenizer_find(t, p, n) >= -1, "find");
    }
    int32_t *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    bool enc = encode_all(t, &a, &na);
    if (enc) {
        char *s = NULL;
        size_t sl;
        FUZZ_CHECK(kvt_tokenizer_decode(t, a, na, &s, &sl) == KVT_OK && s[sl] == 0, "decode failed");
        free(s);
    }
    /* its own GGUF round trip: the same tokenizer */
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    uint8_t *buf = NULL;
    size_t len = 0;
    kvt_gguf *h = NULL;
    int rc = w ? kvt_tokenizer_to_gguf(t, w) : KVT_ENOMEM;
    if (!rc) rc = kvt_gguf_writer_to_mem(w, &buf, &len);
    kvt_gguf_writer_free(w);
    if (rc != KVT_ENOMEM) FUZZ_CHECK(rc == KVT_OK, "tokenizer to GGUF: %s", kvt_errmsg());
    if (!rc) {
        rc = kvt_gguf_open_mem(&h, buf, len);
        if (!rc) rc = kvt_tokenizer_from_gguf(&t2, h);
        FUZZ_CHECK(rc == KVT_OK, "the tokenizer's own GGUF does not load: %s", kvt_errmsg());
    }
    if (!rc) {
        FUZZ_CHECK(kvt_tokenizer_n_vocab(t2) == nv && kvt_tokenizer_bos(t2) == bos && kvt_tokenizer_eos(t2) == eos &&
                   kvt_tokenizer_add_bos(t2) == kvt_tokenizer_add_bos(t) &&
                   !strcmp(kvt_tokenizer_model(t), kvt_tokenizer_model(t2)),
                   "the tokenizer read back differs");
        bool enc2 = encode_all(t2, &b, &nb);
        FUZZ_CHECK(enc == enc2 && (!enc || (na == nb && !memcmp(a, b, na * sizeof *a))),
                   "the tokenizer read back encodes differently");
    }
    free(a);
    free(b);
    kvt_tokenizer_free(t2);
    kvt_gguf_close(h);
    free(buf);
    kvt_tokenizer_free(t);
}

/* The model kvt_model_open makes of the file (kvt_model_from_gguf, from
 * memory here), when the loader accepts it. */
static void check_model(const kvt_gguf *g)
{
    kvt_model *m = NULL;
    if (kvt_model_from_gguf(&m, g, "fuzz")) return;
    int rc;
    /* a model the loader accepts runs: a few tokens, one more, a snapshot
     * that restores to the same state */
    kvt_session *s = NULL, *s2 = NULL;
    kvt_session_opts o = {.n_ctx = 8, .n_threads = 1};
    rc = kvt_session_new(&s, m, &o);
    FUZZ_CHECK(rc == KVT_OK || rc == KVT_ENOMEM, "a loaded model gets no session: %s", kvt_errmsg());
    if (!rc) {
        uint32_t V = m->info.n_vocab;
        int32_t toks[3] = {0, (int32_t)(1 % V), (int32_t)(V - 1)};
        rc = kvt_session_sync(s, toks, 3, NULL);
        FUZZ_CHECK(rc == KVT_OK || rc == KVT_ENOMEM, "a loaded model does not run: %s", kvt_errmsg());
        if (!rc) rc = kvt_session_decode(s, (int32_t)(2 % V));
        uint8_t *snap = NULL, *c1 = NULL, *c2 = NULL;
        size_t sl = 0, l1 = 0, l2 = 0;
        if (!rc && !kvt_session_snapshot(s, &snap, &sl) && !kvt_session_new(&s2, m, &o)) {
            rc = kvt_session_restore(s2, snap, sl);
            FUZZ_CHECK(rc == KVT_OK, "a snapshot of a loaded model does not restore: %s", kvt_errmsg());
            if (!rc && !kvt_session_cache_bytes(s, &c1, &l1) && !kvt_session_cache_bytes(s2, &c2, &l2))
                FUZZ_CHECK(l1 == l2 && !memcmp(c1, c2, l1), "a restored snapshot holds another state");
        }
        free(snap);
        free(c1);
        free(c2);
    }
    kvt_session_free(s2);
    kvt_session_free(s);
    kvt_model_close(m);
}

int fuzz_gguf(const uint8_t *data, size_t size)
{
    kvt_gguf *g = NULL;
    if (kvt_gguf_open_mem(&g, data, size) != KVT_OK) return 0;
    FUZZ_CHECK(kvt_gguf_version(g) == 2 || kvt_gguf_version(g) == 3, "version %u", kvt_gguf_version(g));
    uint32_t al = kvt_gguf_alignment(g);
    FUZZ_CHECK(al > 0, "alignment %u", al);
    uint64_t acc = 0;
    size_t nkv = kvt_gguf_n_kv(g), nt = kvt_gguf_n_tensors(g);
    for (size_t i = 0; i < nkv; i++) {
        const char *key = kvt_gguf_key(g, i);
        const kvt_gguf_val *v = kvt_gguf_val_at(g, i);
        FUZZ_CHECK(key && v, "key %zu missing", i);
        if (!key || !v) continue;
        FUZZ_CHECK(walk(v, 0, &acc), "value of '%.100s' is malformed", key);
        check_getters(g, key);
    }
    for (size_t i = 0; i < nt; i++) check_tensor(g, kvt_gguf_tensor_at(g, i), data, size);
    check_rewrite(g);
    check_tokenizer(g);
    check_model(g);
    kvt_gguf_close(g);
    return 0;
}
