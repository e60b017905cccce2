/* The row types of the cache's K and V rows, one table row each. */
#include "cache/rows.h"
#include "base/util.h"
#include "format/gguf.h"
#include "format/quant.h"
#include "kernels/kernels.h"

#include <math.h>
#include <string.h>

#define Q8_BLOCK 32
#define Q8_BYTES 34 /* f16 d | 32 x int8 */

/* q8_0 as ggml's reference quantiser (quantize_row_q8_0_ref) writes it:
 * d = amax / 127, each element round-half-away(x / d) through 1 / d, d
 * stored as f16. */
static void q8_put(void *dst, const float *x, size_t n)
{
    uint8_t *b = dst;
    for (size_t i = 0; i < n; i += Q8_BLOCK, b += Q8_BYTES) {
        float amax = 0.0f;
        for (size_t j = 0; j < Q8_BLOCK; j++) amax = fmaxf(amax, fabsf(x[i + j]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t h = kvt_f32_to_f16(d);
        b[0] = (uint8_t)h;
        b[1] = (uint8_t)(h >> 8);
        for (size_t j = 0; j < Q8_BLOCK; j++) b[2 + j] = (uint8_t)(int8_t)roundf(x[i + j] * id);
    }
}

/* d * q per element: format/quant.c's dequantiser (the one scalar
 * definition; the attention kernels widen the same way in registers). */
static void q8_get(float *dst, const void *src, size_t n) { kvt_quant_to_f32(KVT_GGML_Q8_0, src, dst, n); }

static void f32_put(void *dst, const float *x, size_t n) { memcpy(dst, x, n * sizeof(float)); }
static void f32_get(float *dst, const void *src, size_t n) { memcpy(dst, src, n * sizeof(float)); }
static void f16_put(void *dst, const float *x, size_t n) { kvt_f32_row_to_f16(dst, x, n); }
static void f16_get(float *dst, const void *src, size_t n) { kvt_f16_row_to_f32(dst, src, n); }
static void bf16_put(void *dst, const float *x, size_t n)
{
    uint8_t *p = dst;
    for (size_t i = 0; i < n; i++) {
        uint16_t h = kvt_f32_to_bf16(x[i]);
        p[2 * i] = (uint8_t)h;
        p[2 * i + 1] = (uint8_t)(h >> 8);
    }
}
static void bf16_get(float *dst, const void *src, size_t n) { kvt_bf16_row_to_f32(dst, src, n); }

static const struct row_type {
    const char *name;
    uint32_t ggml;
    uint32_t block, block_bytes;
    void (*put)(void *dst, const float *x, size_t n);
    void (*get)(float *dst, const void *src, size_t n);
} types[] = {
    [KVT_ROWS_F32] = {"f32", KVT_GGML_F32, 1, 4, f32_put, f32_get},
    [KVT_ROWS_F16] = {"f16", KVT_GGML_F16, 1, 2, f16_put, f16_get},
    [KVT_ROWS_BF16] = {"bf16", KVT_GGML_BF16, 1, 2, bf16_put, bf16_get},
    [KVT_ROWS_Q8_0] = {"q8_0", KVT_GGML_Q8_0, Q8_BLOCK, Q8_BYTES, q8_put, q8_get},
};
#define N_TYPES (sizeof types / sizeof types[0])

kvt_row_type kvt_rows_resolve(kvt_row_type t) { return t == KVT_ROWS_DEFAULT ? KVT_ROWS_F16 : t; }

static const struct row_type *type_of(kvt_row_type t)
{
    t = kvt_rows_resolve(t);
    return (size_t)t < N_TYPES && types[t].name ? &types[t] : NULL;
}

int kvt_row_type_parse(const char *name, kvt_row_type *out)
{
    for (size_t t = 1; name && t < N_TYPES; t++)
        if (!strcmp(name, types[t].name)) {
            *out = (kvt_row_type)t;
            return KVT_OK;
        }
    return kvt_fail(KVT_EINVAL, "cache type '%s': expected f32, f16, bf16 or q8_0", name ? name : "");
}

const char *kvt_row_type_name(kvt_row_type t)
{
    const struct row_type *r = type_of(t);
    return r ? r->name : "?";
}

bool kvt_rows_fits(kvt_row_type t, size_t n)
{
    const struct row_type *r = type_of(t);
    return r && n % r->block == 0;
}

size_t kvt_rows_block(kvt_row_type t) { return type_of(t)->block; }
size_t kvt_rows_bytes(kvt_row_type t, size_t n) { return n / type_of(t)->block * type_of(t)->block_bytes; }
uint32_t kvt_rows_ggml(kvt_row_type t) { return type_of(t)->ggml; }
void kvt_rows_put(kvt_row_type t, void *dst, const float *src, size_t n) { type_of(t)->put(dst, src, n); }
void kvt_rows_get(kvt_row_type t, float *dst, const void *src, size_t n) { type_of(t)->get(dst, src, n); }

void kvt_rows_round(kvt_row_type t, float *x, size_t n)
{
    const struct row_type *r = type_of(t);
    if (r->ggml == KVT_GGML_F32) return;
    uint8_t tmp[2048 * 2]; /* 2048 elements of any type but f32 (2 bytes or less each) */
    for (size_t i = 0; i < n;) {
        size_t m = n - i < 2048 ? n - i : 2048;
        r->put(tmp, x + i, m);
        r->get(x + i, tmp, m);
        i += m;
    }
}
