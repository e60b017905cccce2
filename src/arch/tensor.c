/* The tensor fetchers the architectures load their weights with: a named
 * tensor of the expected shape, checked against its record, as an f32 copy
 * or in place in the mapped file (kvt_wmat); and the fingerprint of a
 * matrix as stored. */
#include "arch/tensor.h"
#include "format/quant.h"
#include "base/util.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <xxhash.h>

static int find_shaped(const kvt_gguf *g, const char *name, uint64_t ne0, uint64_t ne1, const kvt_gguf_tensor **out)
{
    const kvt_gguf_tensor *t = kvt_gguf_find_tensor(g, name);
    if (!t) return kvt_fail(KVT_EFORMAT, "missing tensor %s", name);
    uint64_t a = t->ne[0], b = t->n_elem / (t->ne[0] ? t->ne[0] : 1);
    if (a != ne0 || b != ne1 || t->n_dims > 2)
        return kvt_fail(KVT_EFORMAT, "tensor %s has shape (%llu, %llu), expected (%llu, %llu)", name,
                        (unsigned long long)a, (unsigned long long)b, (unsigned long long)ne0,
                        (unsigned long long)ne1);
    *out = t;
    return KVT_OK;
}

int kvt_tensor_f32(const kvt_gguf *g, const char *name, uint64_t ne0, uint64_t ne1, float **out)
{
    const kvt_gguf_tensor *t;
    int rc = find_shaped(g, name, ne0, ne1, &t);
    if (rc) return rc;
    size_t n;
    if (!kvt_mul_ok((size_t)ne0, (size_t)ne1, &n) || n > SIZE_MAX / sizeof(float))
        return kvt_fail(KVT_EFORMAT, "tensor %s too large", name);
    float *p = kvt_malloc(n * sizeof(float));
    if (!p) return KVT_ENOMEM;
    rc = kvt_gguf_tensor_to_f32(t, p, n);
    if (rc) { free(p); return rc; }
    *out = p;
    return KVT_OK;
}

int kvt_tensor_mat(const kvt_gguf *g, const char *name, uint64_t ne0, uint64_t ne1, kvt_wmat *out)
{
    const kvt_gguf_tensor *t;
    int rc = find_shaped(g, name, ne0, ne1, &t);
    if (rc) return rc;
    /* the reader checked that the tensor's bytes lie in the file and that
     * its rows are whole blocks of a supported type */
    size_t row = kvt_quant_row_bytes(t->type, ne0); /* a type kvtier computes with */
    if (!row || row * ne1 != t->n_bytes || !t->data)
        return kvt_fail(KVT_EUNSUPPORTED, "tensor %s: type %s in rows of %llu is not supported", name,
                        kvt_ggml_type_name(t->type), (unsigned long long)ne0);
    *out = (kvt_wmat){t->data, t->type, (size_t)ne1, (size_t)ne0, row};
    return KVT_OK;
}

_Atomic uint64_t kvt_tensor_hashed_bytes;

void kvt_tensor_hash(struct XXH3_state_s *st, const kvt_wmat *m)
{
    if (m->type != KVT_GGML_F32) XXH3_64bits_update(st, &m->type, sizeof m->type);
    XXH3_64bits_update(st, m->data, m->rows * m->row_bytes);
    atomic_fetch_add_explicit(&kvt_tensor_hashed_bytes, m->rows * m->row_bytes, memory_order_relaxed);
}

int kvt_tensor_mat3(const kvt_gguf *g, const char *name, uint64_t ne0, uint64_t ne1, uint64_t ne2,
                          kvt_wmat *out)
{
    const kvt_gguf_tensor *t = kvt_gguf_find_tensor(g, name);
    if (!t) return kvt_fail(KVT_EFORMAT, "missing tensor %s", name);
    if (t->n_dims != 3 || t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != ne2)
        return kvt_fail(KVT_EFORMAT, "tensor %s has shape (%llu, %llu, %llu), expected (%llu, %llu, %llu)", name,
                        (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], (unsigned long long)t->ne[2],
                        (unsigned long long)ne0, (unsigned long long)ne1, (unsigned long long)ne2);
    size_t row = kvt_quant_row_bytes(t->type, ne0), rows = (size_t)(ne1 * ne2);
    if (!row || row * rows != t->n_bytes || !t->data)
        return kvt_fail(KVT_EUNSUPPORTED, "tensor %s: type %s in rows of %llu is not supported", name,
                        kvt_ggml_type_name(t->type), (unsigned long long)ne0);
    *out = (kvt_wmat){t->data, t->type, rows, (size_t)ne0, row};
    return KVT_OK;
}
