/* f32 kernels: dot products, matmul, norms, RoPE, softmax. See kernels.h for
 * the fixed-order contract. The AVX2 and AVX-512 code is compiled with target
 * attributes, so one binary runs on any x86-64 (and elsewhere the scalar path
 * is the only one). Each instruction set has one static const row of
 * function pointers (struct f32_ops, at the end of the file); the public
 * functions call through the row kernels/cpu.h chose and test no CPU
 * feature themselves. Weights of an integer type go to qkernels.c. */
#include "kernels/kernels.h"
#include "format/gguf.h"
#include "kernels/qkernels.h"
#include "format/quant.h"
#include "base/util.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVT_HAVE_X86 1
#endif

#define LANES 16

/* The kernels of one instruction set: one static const row each, at the
 * end of the file. */
struct mm_ops;
struct att_ops;
struct f32_ops {
    float (*dot)(const float *a, const float *b, size_t n);
    void (*axpy)(float *y, float a, const float *x, size_t n);
    size_t qs_shared; /* kvt_qs_shared: for n a multiple of this; 0: never */
    void (*f16_to_f32)(float *dst, const uint16_t *src, size_t n);
    void (*f32_to_f16)(uint16_t *dst, const float *src, size_t n);
    void (*bf16_to_f32)(float *dst, const uint16_t *src, size_t n);
    const struct att_ops *att; /* attention, one row per row type (ATT_ROWS of them) */
    float (*expf1)(float x);
    void (*swiglu)(float *h1, const float *h3, size_t n);
    void (*exp_row)(float *x, size_t n);       /* softmax: x = exp(x - max x) */
    void (*div)(float *x, size_t n, float d); /* softmax: x = x / d */
    const struct mm_ops *mm;                   /* NULL: the scalar matmul loops */
};

/* The row of the instruction set in use (kvt_cpu_isa). */
static const struct f32_ops *ops(void);

/* A binary16 or bfloat16 element of a row that may lie at an odd address
 * (rows of any type packed one after another: cache/rows.c), read and
 * written without an unaligned uint16_t access. */
static inline uint16_t ld16(const uint16_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}
static inline void st16(uint16_t *p, uint16_t v) { memcpy(p, &v, 2); }

/* Fixed reduction tree over the 16 lanes. */
static inline float reduce16(float *l)
{
    for (int k = 0; k < 8; k++) l[k] += l[k + 8];
    for (int k = 0; k < 4; k++) l[k] += l[k + 4];
    l[0] += l[2];
    l[1] += l[3];
    return l[0] + l[1];
}

/* ---- K and V rows in their row type (attention reads them where they are) ----
 *
 * A row of n elements of kvtier.h's kvt_row_type, its rows ld bytes apart:
 * f32, binary16 (f16), bfloat16, or ggml's q8_0 blocks (an f16 scale d,
 * then 32 int8 q; each element d * q). The kernels widen each element to
 * f32 where they read it, in registers; every widening is exact (f16 and
 * bf16 widen exactly, d * q is an 11-bit scale times an 8-bit integer), so
 * a kernel on typed rows performs the f32 kernel's operations on the values
 * cache/rows.c's kvt_rows_get gives, in the same order, bit for bit. */

#define Q8_0_BLOCK 32
#define Q8_0_BYTES 34 /* f16 d | 32 x int8 */
/* A table row past the types (tests): q8_0 rows read with their scale
 * dropped (KVT_KERNELS_FAULT_Q8_SCALE). */
#define ATT_FAULT_Q8 (KVT_ROWS_Q8_0 + 1)
#define ATT_ROWS (ATT_FAULT_Q8 + 1)
#define IS_Q8(T) ((T) == KVT_ROWS_Q8_0 || (T) == ATT_FAULT_Q8)

_Atomic int kvt_kernels_fault;

/* Bytes of n elements of a row of type T (n whole blocks for q8_0). */
static inline size_t row_bytes(const int T, size_t n)
{
    return T == KVT_ROWS_F32 ? 4 * n : IS_Q8(T) ? n / Q8_0_BLOCK * Q8_0_BYTES : 2 * n;
}

/* Elements [i, i + m) of a row of type T into x, as f32: q8_0 in whole
 * blocks, through format/quant.c's dequantiser (its one scalar
 * definition). */
static inline void widen(const int T, float *x, const uint8_t *r, size_t i, size_t m)
{
    if (T == KVT_ROWS_Q8_0) {
        kvt_quant_to_f32(KVT_GGML_Q8_0, r + i / Q8_0_BLOCK * Q8_0_BYTES, x, m);
        return;
    }
    for (size_t e = 0; e < m; e++) {
        const uint8_t *b = r + (i + e) / Q8_0_BLOCK * Q8_0_BYTES;
        x[e] = T == KVT_ROWS_F16    ? kvt_f16_to_f32(kvt_rd16(r + 2 * (i + e)))
               : T == KVT_ROWS_BF16 ? kvt_bf16_to_f32(kvt_rd16(r + 2 * (i + e)))
               : T == ATT_FAULT_Q8  ? (float)(int8_t)b[2 + (i + e) % Q8_0_BLOCK]
                                    : ((const float *)r)[i + e];
    }
}

/* Element i of a row of type T (the SIMD kernels' single-element tails). */
static inline float row_at(const int T, const uint8_t *r, size_t i)
{
    if (T == KVT_ROWS_F32) return ((const float *)r)[i];
    float x[Q8_0_BLOCK];
    if (T != KVT_ROWS_Q8_0) {
        widen(T, x, r, i, 1);
        return x[0];
    }
    widen(T, x, r, i / Q8_0_BLOCK * Q8_0_BLOCK, Q8_0_BLOCK);
    return x[i % Q8_0_BLOCK];
}

#define WIDE 64 /* elements the scalar kernels widen at a time: whole lane sets and q8_0 blocks */

static inline float dot_scalar_t(const int T, const float *a, const uint8_t *r, size_t n)
{
    float l[LANES] = {0}, x[WIDE];
    for (size_t i0 = 0; i0 < n; i0 += WIDE) {
        size_t m = n - i0 < WIDE ? n - i0 : WIDE;
        const float *b = x;
        if (T == KVT_ROWS_F32) b = (const float *)r + i0;
        else widen(T, x, r, i0, m);
        for (size_t i = 0; i < m; i++) l[i % LANES] = fmaf(a[i0 + i], b[i], l[i % LANES]);
    }
    return reduce16(l);
}

static inline void axpy_scalar_t(const int T, float *y, float a, const uint8_t *r, size_t n)
{
    float x[WIDE];
    for (size_t i0 = 0; i0 < n; i0 += WIDE) {
        size_t m = n - i0 < WIDE ? n - i0 : WIDE;
        const float *b = x;
        if (T == KVT_ROWS_F32) b = (const float *)r + i0;
        else widen(T, x, r, i0, m);
        for (size_t i = 0; i < m; i++) y[i0 + i] = fmaf(a, b[i], y[i0 + i]);
    }
}

static float dot_scalar(const float *a, const float *b, size_t n)
{
    return dot_scalar_t(KVT_ROWS_F32, a, (const uint8_t *)b, n);
}

static void axpy_scalar(float *y, float a, const float *x, size_t n)
{
    axpy_scalar_t(KVT_ROWS_F32, y, a, (const uint8_t *)x, n);
}

#ifdef KVT_HAVE_X86
/* reduce16 on lanes 0..7 in lo and 8..15 in hi: the same adds in the same
 * order, four and two at a time. */
__attribute__((target("avx2,fma"))) static inline float reduce16_avx2(__m256 lo, __m256 hi)
{
    __m256 s8 = _mm256_add_ps(lo, hi);                                              /* l[k] += l[k + 8] */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1)); /* l[k] += l[k + 4] */
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                              /* l0 += l2, l1 += l3 */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));                      /* l0 + l1 */
}

__attribute__((target("avx2,fma"))) static float lanes_sum_avx2(const float *l)
{
    return reduce16_avx2(_mm256_loadu_ps(l), _mm256_loadu_ps(l + 8));
}

/* lanes_sum_avx2 of eight lane sets l[r * ld] into out[0..8): each output's
 * adds of reduce16 in its order, eight outputs a vector. */
__attribute__((target("avx2,fma"))) static void lanes_sum8_avx2(float *out, const float *l, size_t ld)
{
    __m256 a[8], b[4], c[2];
    for (int r = 0; r < 8; r++) a[r] = _mm256_add_ps(_mm256_loadu_ps(l + r * ld), _mm256_loadu_ps(l + r * ld + 8));
    for (int r = 0; r < 4; r++) /* [r0's a0..3 | r1's a0..3] + [r0's a4..7 | r1's a4..7] */
        b[r] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * r], a[2 * r + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * r], a[2 * r + 1], 0x31));
    for (int r = 0; r < 2; r++) /* b0 + b2, b1 + b3 */
        c[r] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * r], b[2 * r + 1], 0x44),
                             _mm256_shuffle_ps(b[2 * r], b[2 * r + 1], 0xee));
    /* c0 + c1: [r0 r2 r4 r6 | r1 r3 r5 r7], then in order */
    __m256 d = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xdd));
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(d, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* The scale of the q8_0 block that holds element i of row r, in every
 * lane (F16C widens it as kvt_f16_to_f32 would: exactly); zero for the
 * other types, which have none. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256 scale8(const int T, const uint8_t *r,
                                                                                    size_t i)
{
    if (!IS_Q8(T)) return _mm256_setzero_ps();
    return _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(kvt_rd16(r + i / Q8_0_BLOCK * Q8_0_BYTES))));
}

/* Eight elements [i, i + 8) of a row of type T (i a multiple of 8),
 * widened in registers: F16C for f16, a shift for bf16, d * q for q8_0
 * with d = scale8(T, r, i) (the caller's: one per block it reads). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256 row8d(const int T, const uint8_t *r,
                                                                                   size_t i, __m256 d)
{
    if (T == KVT_ROWS_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + 2 * i)));
    if (T == KVT_ROWS_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r + 2 * i))), 16));
    if (IS_Q8(T)) {
        const uint8_t *b = r + i / Q8_0_BLOCK * Q8_0_BYTES;
        __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + i % Q8_0_BLOCK))));
        return T == ATT_FAULT_Q8 ? q : _mm256_mul_ps(d, q);
    }
    return _mm256_loadu_ps((const float *)r + i);
}

/* row8d with the block's scale read for it. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256 row8(const int T, const uint8_t *r,
                                                                                  size_t i)
{
    return row8d(T, r, i, scale8(T, r, i));
}

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline float dot_avx2_t(const int T, const float *a,
                                                                                      const uint8_t *b, size_t n)
{
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) { /* (i and i + 8 in one q8_0 block) */
        __m256 d = scale8(T, b, i);
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), row8d(T, b, i, d), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), row8d(T, b, i + 8, d), acc1);
    }
    if (i + 8 <= n) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), row8(T, b, i), acc0);
        i += 8;
    }
    if (i == n) return reduce16_avx2(acc0, acc1);
    float l[LANES];
    _mm256_storeu_ps(l, acc0);
    _mm256_storeu_ps(l + 8, acc1);
    for (; i < n; i++) l[i % LANES] = fmaf(a[i], row_at(T, b, i), l[i % LANES]);
    return reduce16(l);
}

__attribute__((target("avx2,fma,f16c"))) static float dot_avx2(const float *a, const float *b, size_t n)
{
    return dot_avx2_t(KVT_ROWS_F32, a, (const uint8_t *)b, n);
}

/* l[i % 16] += w[i] * x[i] for i in [0, len): the order of dot_avx2,
 * carried across calls (len a multiple of 16 except in a row's last call). */
__attribute__((target("avx2,fma"))) static void lanes1_avx2(float *l, const float *w, const float *x, size_t len)
{
    __m256 a = _mm256_loadu_ps(l), b = _mm256_loadu_ps(l + 8);
    size_t i = 0;
    for (; i + 16 <= len; i += 16) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), b);
    }
    if (i + 8 <= len) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a);
        i += 8;
    }
    _mm256_storeu_ps(l, a);
    _mm256_storeu_ps(l + 8, b);
    for (; i < len; i++) l[i % LANES] = fmaf(w[i], x[i], l[i % LANES]);
}

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void axpy_avx2_t(const int T, float *y, float a,
                                                                                      const uint8_t *x, size_t n)
{
    __m256 va = _mm256_set1_ps(a);
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, row8(T, x, i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(a, row_at(T, x, i), y[i]);
}

__attribute__((target("avx2,fma,f16c"))) static void axpy_avx2(float *y, float a, const float *x, size_t n)
{
    axpy_avx2_t(KVT_ROWS_F32, y, a, (const uint8_t *)x, n);
}

__attribute__((target("avx2,fma,f16c"))) static void f16_to_f32_f16c(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = kvt_f16_to_f32(ld16(src + i));
}

__attribute__((target("avx2,fma,f16c"))) static void f32_to_f16_f16c(uint16_t *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) st16(dst + i, kvt_f32_to_f16(src[i]));
}
#endif

/* ---- attention: scores against K rows, values mixed from V rows ---- */

/* The attention kernels of one instruction set for rows of one type (a
 * row of its att table, indexed by kvt_row_type): K and V rows ld bytes
 * apart, read in their type (above). The fallbacks reach the other kernels
 * of the same row through o. */
struct att_ops {
    float (*dot)(const float *a, const uint8_t *r, size_t n);
    void (*axpy)(float *y, float a, const uint8_t *r, size_t n);
    void (*dots_rows)(const struct att_ops *o, float *out, size_t ldo, const float *q, size_t ldq, size_t nq,
                      const uint8_t *k, size_t ldk, size_t nk, size_t n, float scale);
    void (*axpys_rows)(const struct att_ops *o, float *y, size_t ldy, const float *a, size_t lda, size_t nq,
                       const uint8_t *v, size_t ldv, size_t nk, size_t n);
    void (*dots_qs)(const struct att_ops *o, size_t nq, float *const *out, const float *const *q, const uint8_t *k,
                    size_t ldk, size_t nk, size_t n, float scale);
    void (*axpys_qs)(const struct att_ops *o, size_t nq, float *const *y, const float *const *a, const uint8_t *v,
                     size_t ldv, size_t nk, size_t n);
};

/* The queries one at a time (the SIMD rows' fallbacks, and the scalar
 * path): each score a dot product, each value an axpy, in key order. */
static void dots_rows_each(const struct att_ops *o, float *out, size_t ldo, const float *q, size_t ldq, size_t nq,
                           const uint8_t *k, size_t ldk, size_t nk, size_t n, float scale)
{
    for (size_t j = 0; j < nk; j++, k += ldk)
        for (size_t u = 0; u < nq; u++) out[u * ldo + j] = o->dot(q + u * ldq, k, n) * scale;
}

static void axpys_rows_each(const struct att_ops *o, float *y, size_t ldy, const float *a, size_t lda, size_t nq,
                            const uint8_t *v, size_t ldv, size_t nk, size_t n)
{
    for (size_t j = 0; j < nk; j++, v += ldv)
        for (size_t u = 0; u < nq; u++) o->axpy(y + u * ldy, a[u * lda + j], v, n);
}

static void dots_qs_each(const struct att_ops *o, size_t nq, float *const *out, const float *const *q,
                         const uint8_t *k, size_t ldk, size_t nk, size_t n, float scale)
{
    for (size_t u = 0; u < nq; u++) o->dots_rows(o, out[u], 0, q[u], 0, 1, k, ldk, nk, n, scale);
}

static void axpys_qs_each(const struct att_ops *o, size_t nq, float *const *y, const float *const *a,
                          const uint8_t *v, size_t ldv, size_t nk, size_t n)
{
    for (size_t u = 0; u < nq; u++) o->axpys_rows(o, y[u], 0, a[u], 0, 1, v, ldv, nk, n);
}

#ifdef KVT_HAVE_X86
/* reduce16 of four lane sets at once: d[p] = reduce16 of (lo[p], hi[p]),
 * the same adds in the same order as reduce16_avx2 (a + b == b + a in IEEE
 * arithmetic, so only the tree matters), four dots finished with the
 * instructions of about one. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m128 reduce16x4_avx2(const __m256 lo[4],
                                                                                      const __m256 hi[4])
{
    __m256 s0 = _mm256_add_ps(lo[0], hi[0]), s1 = _mm256_add_ps(lo[1], hi[1]); /* l[k] += l[k + 8] */
    __m256 s2 = _mm256_add_ps(lo[2], hi[2]), s3 = _mm256_add_ps(lo[3], hi[3]);
    /* l[k] += l[k + 4]: [0 | 2] and [1 | 3], four lanes each */
    __m256 t02 = _mm256_add_ps(_mm256_permute2f128_ps(s0, s2, 0x20), _mm256_permute2f128_ps(s0, s2, 0x31));
    __m256 t13 = _mm256_add_ps(_mm256_permute2f128_ps(s1, s3, 0x20), _mm256_permute2f128_ps(s1, s3, 0x31));
    /* l0 += l2, l1 += l3: low half [0: l0 l1, 1: l0 l1], high half [2 .., 3 ..] */
    __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t02, t13, 0x44), _mm256_shuffle_ps(t02, t13, 0xee));
    __m128 lo4 = _mm256_castps256_ps128(u), hi4 = _mm256_extractf128_ps(u, 1);
    /* l0 + l1: [0, 1, 2, 3] */
    return _mm_add_ps(_mm_shuffle_ps(lo4, hi4, 0x88), _mm_shuffle_ps(lo4, hi4, 0xdd));
}

#define TGT2 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline
#define TGT5 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl"), always_inline)) static inline

/* out[j] = dot(q, k + j * ldk) * scale for four keys, n a multiple of 16:
 * each dot has dot_avx2's two accumulators, all eight in registers; the
 * query is loaded once for the four keys. */
TGT2 void dots_key4_avx2(const int T, float *out, const float *q, const uint8_t *k, size_t ldk, size_t n, float scale)
{
    __m256 lo[4], hi[4];
    for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_ps();
    const uint8_t *k0 = k, *k1 = k + ldk, *k2 = k + 2 * ldk, *k3 = k + 3 * ldk;
    for (size_t i = 0; i < n; i += 16) {
        __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + i + 8);
        __m256 d0 = scale8(T, k0, i), d1 = scale8(T, k1, i), d2 = scale8(T, k2, i), d3 = scale8(T, k3, i);
        lo[0] = _mm256_fmadd_ps(q0, row8d(T, k0, i, d0), lo[0]);
        lo[1] = _mm256_fmadd_ps(q0, row8d(T, k1, i, d1), lo[1]);
        lo[2] = _mm256_fmadd_ps(q0, row8d(T, k2, i, d2), lo[2]);
        lo[3] = _mm256_fmadd_ps(q0, row8d(T, k3, i, d3), lo[3]);
        hi[0] = _mm256_fmadd_ps(q1, row8d(T, k0, i + 8, d0), hi[0]);
        hi[1] = _mm256_fmadd_ps(q1, row8d(T, k1, i + 8, d1), hi[1]);
        hi[2] = _mm256_fmadd_ps(q1, row8d(T, k2, i + 8, d2), hi[2]);
        hi[3] = _mm256_fmadd_ps(q1, row8d(T, k3, i + 8, d3), hi[3]);
    }
    _mm_storeu_ps(out, _mm_mul_ps(reduce16x4_avx2(lo, hi), _mm_set1_ps(scale)));
}

/* Prefetch the nb bytes at p (a K or V row some keys ahead: rows ldk apart
 * defeat the hardware's prefetchers at long context). */
static inline void prefetch_bytes(const uint8_t *p, size_t nb)
{
    for (size_t i = 0; i < nb; i += 64) _mm_prefetch((const char *)(p + i), _MM_HINT_T0);
}

#define ATT_AHEAD 8 /* keys ahead that the attention kernels prefetch */

/* Three query heads against two keys, n a multiple of 16: the six dots
 * of dot_avx2 side by side (twelve accumulators), each key half loaded
 * once for the three heads; out rows ldo apart. */
TGT2 void dots_h3k2_avx2(const int T, float *out, size_t ldo, const float *q, size_t ldq, const uint8_t *k,
                         size_t ldk, size_t n, float scale)
{
    __m256 lo[6], hi[6];
    for (int p = 0; p < 6; p++) lo[p] = hi[p] = _mm256_setzero_ps();
    const uint8_t *k0 = k, *k1 = k + ldk;
    const float *q0 = q, *q1 = q + ldq, *q2 = q + 2 * ldq;
    for (size_t i = 0; i < n; i += 16) {
        __m256 da = scale8(T, k0, i), db = scale8(T, k1, i);
        __m256 ka = row8d(T, k0, i, da), kb = row8d(T, k1, i, db), x;
        x = _mm256_loadu_ps(q0 + i);
        lo[0] = _mm256_fmadd_ps(x, ka, lo[0]);
        lo[1] = _mm256_fmadd_ps(x, kb, lo[1]);
        x = _mm256_loadu_ps(q1 + i);
        lo[2] = _mm256_fmadd_ps(x, ka, lo[2]);
        lo[3] = _mm256_fmadd_ps(x, kb, lo[3]);
        x = _mm256_loadu_ps(q2 + i);
        lo[4] = _mm256_fmadd_ps(x, ka, lo[4]);
        lo[5] = _mm256_fmadd_ps(x, kb, lo[5]);
        ka = row8d(T, k0, i + 8, da), kb = row8d(T, k1, i + 8, db);
        x = _mm256_loadu_ps(q0 + i + 8);
        hi[0] = _mm256_fmadd_ps(x, ka, hi[0]);
        hi[1] = _mm256_fmadd_ps(x, kb, hi[1]);
        x = _mm256_loadu_ps(q1 + i + 8);
        hi[2] = _mm256_fmadd_ps(x, ka, hi[2]);
        hi[3] = _mm256_fmadd_ps(x, kb, hi[3]);
        x = _mm256_loadu_ps(q2 + i + 8);
        hi[4] = _mm256_fmadd_ps(x, ka, hi[4]);
        hi[5] = _mm256_fmadd_ps(x, kb, hi[5]);
    }
    __m128 sc = _mm_set1_ps(scale);
    __m128 r01 = _mm_mul_ps(reduce16x4_avx2(lo, hi), sc); /* head 0 key 0, 1; head 1 key 0, 1 */
    const __m256 lo2[4] = {lo[4], lo[5], lo[4], lo[5]}, hi2[4] = {hi[4], hi[5], hi[4], hi[5]};
    __m128 r2 = _mm_mul_ps(reduce16x4_avx2(lo2, hi2), sc);
    _mm_storel_pi((__m64 *)out, r01);
    _mm_storeh_pi((__m64 *)(out + ldo), r01);
    _mm_storel_pi((__m64 *)(out + 2 * ldo), r2);
}

/* y[0..W*8) += a_j * v_j[e0..e0 + W*8) for j < nk in order, W a constant:
 * y in W registers across the keys, each element one fma per key as in
 * axpy_avx2. */
TGT2 void axpy_cols_avx2(const int T, const int W, float *y, const float *a, const uint8_t *v, size_t e0,
                         size_t ldv, size_t nk)
{
    __m256 acc[8];
    for (int e = 0; e < W; e++) acc[e] = _mm256_loadu_ps(y + 8 * e);
    for (size_t j = 0; j < nk; j++, v += ldv) {
        __m256 va = _mm256_set1_ps(a[j]);
        for (int e = 0; e < W; e++) acc[e] = _mm256_fmadd_ps(va, row8(T, v, e0 + 8 * (size_t)e), acc[e]);
    }
    for (int e = 0; e < W; e++) _mm256_storeu_ps(y + 8 * e, acc[e]);
}

/* y[0..n) += a_j * v_j, n a multiple of 8: columns 64 at a time (then 32,
 * 16, 8), each over every key; the elements are independent, so the
 * split changes no bit. */
TGT2 void axpy_rows_avx2(const int T, float *y, const float *a, const uint8_t *v, size_t ldv, size_t nk, size_t n)
{
    size_t e = 0;
    for (; e + 64 <= n; e += 64) axpy_cols_avx2(T, 8, y + e, a, v, e, ldv, nk);
    if (e + 32 <= n) { axpy_cols_avx2(T, 4, y + e, a, v, e, ldv, nk); e += 32; }
    if (e + 16 <= n) { axpy_cols_avx2(T, 2, y + e, a, v, e, ldv, nk); e += 16; }
    if (e + 8 <= n) axpy_cols_avx2(T, 1, y + e, a, v, e, ldv, nk);
}

/* Three query heads at once over 32 columns: y_u[0..32) += a_u[j] *
 * v_j[e0..e0 + 32) for u < 3, j < nk in order. Twelve accumulator chains
 * (a single head has eight, and each key's fma waits on the last one's),
 * the value row loaded once for the three. */
TGT2 void axpy_rows3h_avx2(const int T, float *y, size_t ldy, const float *a, size_t lda, const uint8_t *v, size_t e0,
                           size_t ldv, size_t nk)
{
    __m256 c0[4], c1[4], c2[4];
#pragma GCC unroll 4
    for (int e = 0; e < 4; e++) {
        c0[e] = _mm256_loadu_ps(y + 8 * e);
        c1[e] = _mm256_loadu_ps(y + ldy + 8 * e);
        c2[e] = _mm256_loadu_ps(y + 2 * ldy + 8 * e);
    }
    const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda;
    for (size_t j = 0; j < nk; j++, v += ldv) {
        __m256 b0 = _mm256_set1_ps(a0[j]), b1 = _mm256_set1_ps(a1[j]), b2 = _mm256_set1_ps(a2[j]);
        __m256 d = scale8(T, v, e0); /* the 32 columns: one q8_0 block */
#pragma GCC unroll 4
        for (int e = 0; e < 4; e++) {
            __m256 x = row8d(T, v, e0 + 8 * (size_t)e, d);
            c0[e] = _mm256_fmadd_ps(b0, x, c0[e]);
            c1[e] = _mm256_fmadd_ps(b1, x, c1[e]);
            c2[e] = _mm256_fmadd_ps(b2, x, c2[e]);
        }
    }
#pragma GCC unroll 4
    for (int e = 0; e < 4; e++) {
        _mm256_storeu_ps(y + 8 * e, c0[e]);
        _mm256_storeu_ps(y + ldy + 8 * e, c1[e]);
        _mm256_storeu_ps(y + 2 * ldy + 8 * e, c2[e]);
    }
}

/* scale8 and row8d sixteen elements at a time (i a multiple of 16). */
TGT5 __m512 scale16(const int T, const uint8_t *r, size_t i)
{
    if (!IS_Q8(T)) return _mm512_setzero_ps();
    return _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(kvt_rd16(r + i / Q8_0_BLOCK * Q8_0_BYTES))));
}

TGT5 __m512 row16d(const int T, const uint8_t *r, size_t i, __m512 d)
{
    if (T == KVT_ROWS_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + 2 * i)));
    if (T == KVT_ROWS_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r + 2 * i))), 16));
    if (IS_Q8(T)) {
        const uint8_t *b = r + i / Q8_0_BLOCK * Q8_0_BYTES;
        __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + i % Q8_0_BLOCK))));
        return T == ATT_FAULT_Q8 ? q : _mm512_mul_ps(d, q);
    }
    return _mm512_loadu_ps((const float *)r + i);
}

/* Scores of H (1 to 4) queries against four keys with AVX-512: q[h] (n) and
 * out[h][j..j + 4) for h < H, each (query, key) the same operations (16
 * lanes reduced as the AVX2 path's two halves), whatever H is. */
TGT5 void dots_pk4_avx512(const int T, const int H, float *const *out, size_t j, const float *const *q,
                          const uint8_t *k, size_t ldk, size_t n, float scale)
{
    __m512 acc[4][4];
    _Pragma("GCC unroll 4") for (int h = 0; h < H; h++)
        _Pragma("GCC unroll 4") for (int jj = 0; jj < 4; jj++) acc[h][jj] = _mm512_setzero_ps();
    const size_t step = IS_Q8(T) ? Q8_0_BLOCK : 16; /* q8_0: a block, its scale read once */
    for (size_t i0 = 0; i0 < n; i0 += step) {
        __m512 d[4];
        _Pragma("GCC unroll 4") for (int jj = 0; jj < 4; jj++) d[jj] = scale16(T, k + (size_t)jj * ldk, i0);
        _Pragma("GCC unroll 2") for (size_t i = i0; i < i0 + step; i += 16) {
            __m512 kv[4];
            _Pragma("GCC unroll 4") for (int jj = 0; jj < 4; jj++) kv[jj] = row16d(T, k + (size_t)jj * ldk, i, d[jj]);
            _Pragma("GCC unroll 4") for (int h = 0; h < H; h++) {
                __m512 x = _mm512_loadu_ps(q[h] + i);
                _Pragma("GCC unroll 4") for (int jj = 0; jj < 4; jj++)
                    acc[h][jj] = _mm512_fmadd_ps(x, kv[jj], acc[h][jj]);
            }
        }
    }
    __m128 sc = _mm_set1_ps(scale);
    _Pragma("GCC unroll 4") for (int h = 0; h < H; h++) {
        __m256 lo[4], hi[4];
        _Pragma("GCC unroll 4") for (int jj = 0; jj < 4; jj++) {
            lo[jj] = _mm512_castps512_ps256(acc[h][jj]);
            hi[jj] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[h][jj]), 1));
        }
        _mm_storeu_ps(out[h] + j, _mm_mul_ps(reduce16x4_avx2(lo, hi), sc));
    }
}

/* y[h][e0..e0 + 64) += a[h][j] * v_j[e0..e0 + 64) for H (1 to 4) queries,
 * keys in order (each element its own fma per key, so any width gives the
 * same bits). */
TGT5 void axpy_ph_avx512(const int T, const int H, float *const *y, size_t e0, const float *const *a,
                         const uint8_t *v, size_t ldv, size_t nk)
{
    __m512 c[4][4];
    const size_t pb = row_bytes(T, 64), po = row_bytes(T, e0) + ATT_AHEAD * ldv;
    _Pragma("GCC unroll 4") for (int h = 0; h < H; h++)
        _Pragma("GCC unroll 4") for (int e = 0; e < 4; e++) c[h][e] = _mm512_loadu_ps(y[h] + e0 + 16 * e);
    for (size_t j = 0; j < nk; j++, v += ldv) {
        prefetch_bytes(v + po, pb);
        __m512 b[4];
        _Pragma("GCC unroll 4") for (int h = 0; h < H; h++) b[h] = _mm512_set1_ps(a[h][j]);
        const __m512 d[2] = {scale16(T, v, e0), scale16(T, v, e0 + 32)}; /* the 64 columns: two q8_0 blocks */
        _Pragma("GCC unroll 4") for (int e = 0; e < 4; e++) {
            __m512 x = row16d(T, v, e0 + 16 * (size_t)e, d[e / 2]);
            _Pragma("GCC unroll 4") for (int h = 0; h < H; h++) c[h][e] = _mm512_fmadd_ps(b[h], x, c[h][e]);
        }
    }
    _Pragma("GCC unroll 4") for (int h = 0; h < H; h++)
        _Pragma("GCC unroll 4") for (int e = 0; e < 4; e++) _mm512_storeu_ps(y[h] + e0 + 16 * e, c[h][e]);
}

typedef void (*dots_pk4_fn)(float *const *, size_t, const float *const *, const uint8_t *, size_t, size_t, float);
typedef void (*axpy_ph_fn)(float *const *, size_t, const float *const *, const uint8_t *, size_t, size_t);

/* The public kernels of each instruction set, n-generic: the scalar
 * fallbacks where n leaves a tail the blocked code does not take. */
TGT2 void dots_rows_avx2_t(const int T, const struct att_ops *o, float *out, size_t ldo, const float *q, size_t ldq,
                           size_t nq, const uint8_t *k, size_t ldk, size_t nk, size_t n, float scale)
{
    if (n % 16) {
        dots_rows_each(o, out, ldo, q, ldq, nq, k, ldk, nk, n, scale);
        return;
    }
    const size_t rb = row_bytes(T, n);
    size_t u = 0;
    for (; u + 3 <= nq; u += 3) {
        float *ou = out + u * ldo;
        const float *qu = q + u * ldq;
        size_t j = 0;
        for (; j + 2 <= nk; j += 2) {
            prefetch_bytes(k + (j + ATT_AHEAD) * ldk, rb);
            prefetch_bytes(k + (j + ATT_AHEAD + 1) * ldk, rb);
            dots_h3k2_avx2(T, ou + j, ldo, qu, ldq, k + j * ldk, ldk, n, scale);
        }
        for (; j < nk; j++)
            for (size_t h = 0; h < 3; h++) ou[h * ldo + j] = o->dot(qu + h * ldq, k + j * ldk, n) * scale;
    }
    for (; u < nq; u++) { /* one query head: four keys a call, then one at a time */
        float *ou = out + u * ldo;
        const float *qu = q + u * ldq;
        size_t j = 0;
        for (; j + 4 <= nk; j += 4) dots_key4_avx2(T, ou + j, qu, k + j * ldk, ldk, n, scale);
        for (; j < nk; j++) ou[j] = o->dot(qu, k + j * ldk, n) * scale;
    }
}

TGT2 void axpys_rows_avx2_t(const int T, const struct att_ops *o, float *y, size_t ldy, const float *a, size_t lda,
                            size_t nq, const uint8_t *v, size_t ldv, size_t nk, size_t n)
{
    if (n % 8) {
        axpys_rows_each(o, y, ldy, a, lda, nq, v, ldv, nk, n);
        return;
    }
    size_t u = 0;
    if (n % 32 == 0)
        for (; u + 3 <= nq; u += 3)
            for (size_t e = 0; e < n; e += 32) axpy_rows3h_avx2(T, y + u * ldy + e, ldy, a + u * lda, lda, v, e, ldv, nk);
    for (; u < nq; u++) axpy_rows_avx2(T, y + u * ldy, a + u * lda, v, ldv, nk, n);
}

/* Up to four heads at a time. */
TGT5 void dots_rows_avx512_t(const int T, const dots_pk4_fn *pk4, const struct att_ops *o, float *out, size_t ldo,
                             const float *q, size_t ldq, size_t nq, const uint8_t *k, size_t ldk, size_t nk, size_t n,
                             float scale)
{
    if (n % 16) {
        dots_rows_each(o, out, ldo, q, ldq, nq, k, ldk, nk, n, scale);
        return;
    }
    const size_t rb = row_bytes(T, n);
    for (size_t u = 0, hs; u < nq; u += hs) {
        hs = nq - u >= 4 ? 4 : nq - u;
        float *ou = out + u * ldo;
        const float *qu = q + u * ldq;
        size_t j = 0;
        float *op[4];
        const float *qp[4];
        for (size_t h = 0; h < hs; h++) op[h] = ou + h * ldo, qp[h] = qu + h * ldq;
        for (; j + 4 <= nk; j += 4) {
            for (size_t b = 0; b < 4; b++) prefetch_bytes(k + (j + ATT_AHEAD + b) * ldk, rb);
            pk4[hs](op, j, qp, k + j * ldk, ldk, n, scale);
        }
        for (; j < nk; j++)
            for (size_t h = 0; h < hs; h++) ou[h * ldo + j] = o->dot(qu + h * ldq, k + j * ldk, n) * scale;
    }
}

/* Up to four heads at a time where n is whole zmm quads, else AVX2's. */
TGT5 void axpys_rows_avx512_t(const int T, const axpy_ph_fn *ph, const struct att_ops *o, float *y, size_t ldy,
                              const float *a, size_t lda, size_t nq, const uint8_t *v, size_t ldv, size_t nk, size_t n)
{
    if (n % 64) {
        axpys_rows_avx2_t(T, o, y, ldy, a, lda, nq, v, ldv, nk, n);
        return;
    }
    for (size_t u = 0, hs; u < nq; u += hs) {
        hs = nq - u >= 4 ? 4 : nq - u;
        float *yp[4];
        const float *ap[4];
        for (size_t h = 0; h < hs; h++) yp[h] = y + (u + h) * ldy, ap[h] = a + (u + h) * lda;
        for (size_t e = 0; e < n; e += 64) ph[hs](yp, e, ap, v, ldv, nk);
    }
}

TGT5 void dots_qs_avx512_t(const int T, const dots_pk4_fn *pk4, const struct att_ops *o, size_t nq, float *const *out,
                           const float *const *q, const uint8_t *k, size_t ldk, size_t nk, size_t n, float scale)
{
    if (n % 16) {
        dots_qs_each(o, nq, out, q, k, ldk, nk, n, scale);
        return;
    }
    const size_t rb = row_bytes(T, n);
    for (size_t u = 0, hs; u < nq; u += hs) {
        hs = nq - u >= 4 ? 4 : nq - u;
        size_t j = 0;
        for (; j + 4 <= nk; j += 4) {
            for (size_t b = 0; b < 4; b++) prefetch_bytes(k + (j + ATT_AHEAD + b) * ldk, rb);
            pk4[hs](out + u, j, q + u, k + j * ldk, ldk, n, scale);
        }
        for (; j < nk; j++)
            for (size_t h = u; h < u + hs; h++) out[h][j] = o->dot(q[h], k + j * ldk, n) * scale;
    }
}

TGT5 void axpys_qs_avx512_t(const int T, const axpy_ph_fn *ph, const struct att_ops *o, size_t nq, float *const *y,
                            const float *const *a, const uint8_t *v, size_t ldv, size_t nk, size_t n)
{
    if (n % 64) {
        axpys_qs_each(o, nq, y, a, v, ldv, nk, n);
        return;
    }
    for (size_t u = 0, hs; u < nq; u += hs) {
        hs = nq - u >= 4 ? 4 : nq - u;
        for (size_t e = 0; e < n; e += 64) ph[hs](y + u, e, a + u, v, ldv, nk);
    }
}

/* The functions of one row type T (suffix s) on the SIMD paths: dot and
 * axpy, the AVX2 kernels, the AVX-512 ones with their per-H tiles. */
#define ATT_H(s, T, H)                                                                                         \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512vl"))) static void dots_p##H##k4_##s(                  \
        float *const *out, size_t j, const float *const *q, const uint8_t *k, size_t ldk, size_t n, float scale) \
    {                                                                                                          \
        dots_pk4_avx512(T, H, out, j, q, k, ldk, n, scale);                                                    \
    }                                                                                                          \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512vl"))) static void axpy_p##H##h_##s(                    \
        float *const *y, size_t e0, const float *const *a, const uint8_t *v, size_t ldv, size_t nk)            \
    {                                                                                                          \
        axpy_ph_avx512(T, H, y, e0, a, v, ldv, nk);                                                            \
    }
#define ATT_SIMD(s, T)                                                                                           \
    __attribute__((target("avx2,fma,f16c"))) static float dot_##s##_avx2(const float *a, const uint8_t *r,      \
                                                                         size_t n)                              \
    {                                                                                                            \
        return dot_avx2_t(T, a, r, n);                                                                           \
    }                                                                                                            \
    __attribute__((target("avx2,fma,f16c"))) static void axpy_##s##_avx2(float *y, float a, const uint8_t *r,   \
                                                                         size_t n)                              \
    {                                                                                                            \
        axpy_avx2_t(T, y, a, r, n);                                                                              \
    }                                                                                                            \
    __attribute__((target("avx2,fma,f16c"))) static void dots_rows_##s##_avx2(                                  \
        const struct att_ops *o, float *out, size_t ldo, const float *q, size_t ldq, size_t nq, const uint8_t *k, \
        size_t ldk, size_t nk, size_t n, float scale)                                                            \
    {                                                                                                            \
        dots_rows_avx2_t(T, o, out, ldo, q, ldq, nq, k, ldk, nk, n, scale);                                      \
    }                                                                                                            \
    __attribute__((target("avx2,fma,f16c"))) static void axpys_rows_##s##_avx2(                                 \
        const struct att_ops *o, float *y, size_t ldy, const float *a, size_t lda, size_t nq, const uint8_t *v,   \
        size_t ldv, size_t nk, size_t n)                                                                         \
    {                                                                                                            \
        axpys_rows_avx2_t(T, o, y, ldy, a, lda, nq, v, ldv, nk, n);                                              \
    }                                                                                                            \
    ATT_H(s, T, 1) ATT_H(s, T, 2) ATT_H(s, T, 3) ATT_H(s, T, 4)                                                  \
    static const dots_pk4_fn dots_pk4_##s[5] = {NULL, dots_p1k4_##s, dots_p2k4_##s, dots_p3k4_##s, dots_p4k4_##s}; \
    static const axpy_ph_fn axpy_ph_##s[5] = {NULL, axpy_p1h_##s, axpy_p2h_##s, axpy_p3h_##s, axpy_p4h_##s};    \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512vl"))) static void dots_rows_##s##_avx512(              \
        const struct att_ops *o, float *out, size_t ldo, const float *q, size_t ldq, size_t nq, const uint8_t *k, \
        size_t ldk, size_t nk, size_t n, float scale)                                                            \
    {                                                                                                            \
        dots_rows_avx512_t(T, dots_pk4_##s, o, out, ldo, q, ldq, nq, k, ldk, nk, n, scale);                      \
    }                                                                                                            \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512vl"))) static void axpys_rows_##s##_avx512(             \
        const struct att_ops *o, float *y, size_t ldy, const float *a, size_t lda, size_t nq, const uint8_t *v,   \
        size_t ldv, size_t nk, size_t n)                                                                         \
    {                                                                                                            \
        axpys_rows_avx512_t(T, axpy_ph_##s, o, y, ldy, a, lda, nq, v, ldv, nk, n);                               \
    }                                                                                                            \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512vl"))) static void dots_qs_##s##_avx512(                \
        const struct att_ops *o, size_t nq, float *const *out, const float *const *q, const uint8_t *k,           \
        size_t ldk, size_t nk, size_t n, float scale)                                                            \
    {                                                                                                            \
        dots_qs_avx512_t(T, dots_pk4_##s, o, nq, out, q, k, ldk, nk, n, scale);                                  \
    }                                                                                                            \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512vl"))) static void axpys_qs_##s##_avx512(               \
        const struct att_ops *o, size_t nq, float *const *y, const float *const *a, const uint8_t *v, size_t ldv, \
        size_t nk, size_t n)                                                                                     \
    {                                                                                                            \
        axpys_qs_avx512_t(T, axpy_ph_##s, o, nq, y, a, v, ldv, nk, n);                                           \
    }
ATT_SIMD(f32, KVT_ROWS_F32)
ATT_SIMD(f16, KVT_ROWS_F16)
ATT_SIMD(bf16, KVT_ROWS_BF16)
ATT_SIMD(q8, KVT_ROWS_Q8_0)
ATT_SIMD(q8fault, ATT_FAULT_Q8)
#undef ATT_SIMD
#undef ATT_H
#undef TGT2
#undef TGT5
#endif

/* The scalar path's dot and axpy of each row type. */
#define ATT_SCALAR(s, T)                                                                                         \
    static float dot_##s##_scalar(const float *a, const uint8_t *r, size_t n) { return dot_scalar_t(T, a, r, n); } \
    static void axpy_##s##_scalar(float *y, float a, const uint8_t *r, size_t n) { axpy_scalar_t(T, y, a, r, n); }
ATT_SCALAR(f32, KVT_ROWS_F32)
ATT_SCALAR(f16, KVT_ROWS_F16)
ATT_SCALAR(bf16, KVT_ROWS_BF16)
ATT_SCALAR(q8, KVT_ROWS_Q8_0)
ATT_SCALAR(q8fault, ATT_FAULT_Q8)
#undef ATT_SCALAR

/* Each instruction set's table, one row per row type (KVT_ROWS_DEFAULT
 * is f16, cache/rows.h). */
#define ATT_TABLE(ROW)                                                                                         \
    {                                                                                                          \
        [KVT_ROWS_DEFAULT] = ROW(f16), [KVT_ROWS_F32] = ROW(f32), [KVT_ROWS_F16] = ROW(f16),                   \
        [KVT_ROWS_BF16] = ROW(bf16), [KVT_ROWS_Q8_0] = ROW(q8), [ATT_FAULT_Q8] = ROW(q8fault),                \
    }
#define ROW_SCALAR(s) {dot_##s##_scalar, axpy_##s##_scalar, dots_rows_each, axpys_rows_each, dots_qs_each, axpys_qs_each}
static const struct att_ops att_scalar[ATT_ROWS] = ATT_TABLE(ROW_SCALAR);
#ifdef KVT_HAVE_X86
#define ROW_AVX2(s) {dot_##s##_avx2, axpy_##s##_avx2, dots_rows_##s##_avx2, axpys_rows_##s##_avx2, dots_qs_each, axpys_qs_each}
#define ROW_AVX512(s)                                                                                          \
    {dot_##s##_avx2, axpy_##s##_avx2, dots_rows_##s##_avx512, axpys_rows_##s##_avx512, dots_qs_##s##_avx512,     \
     axpys_qs_##s##_avx512}
static const struct att_ops att_avx2[ATT_ROWS] = ATT_TABLE(ROW_AVX2);
static const struct att_ops att_avx512[ATT_ROWS] = ATT_TABLE(ROW_AVX512);
#undef ROW_AVX2
#undef ROW_AVX512
#endif
#undef ROW_SCALAR
#undef ATT_TABLE

static void f16_to_f32_scalar(float *dst, const uint16_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = kvt_f16_to_f32(ld16(src + i));
}

static void f32_to_f16_scalar(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++) st16(dst + i, kvt_f32_to_f16(src[i]));
}

/* bf16 -> f32 is a shift: exact on either path. */
#ifdef KVT_HAVE_X86
__attribute__((target("avx2"))) static void bf16_avx2(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_slli_epi32(v, 16));
    }
    for (; i < n; i++) dst[i] = kvt_bf16_to_f32(ld16(src + i));
}
#endif

static void bf16_scalar(float *dst, const uint16_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = kvt_bf16_to_f32(ld16(src + i));
}

#define SEG 512  /* elements of a weight row dequantised at a time: whole blocks of every type */
#define SEG16 1024 /* elements of an f16 or bf16 row a sweep reads in place (8 rows: 16 KiB, in L1) */
#define TOKS 96   /* tokens whose lanes one sweep over a segment carries */
#define TR 8      /* weight rows of a sweep: one 8-row tile (AVX-512) or two of 4 */
#define TT 3      /* tokens of a tile */
#define XBLK (256 * 1024) /* bytes of activations a token block keeps in L2 */

/* Lane state: lanes[r][t] are the 16 lanes of row r's dot product with
 * token t, each lane accumulating its elements (i % 16) in increasing i
 * with a fused multiply-add, so any tiling of the work gives the bits of
 * dot_avx2 / dot_scalar. */
typedef float lanes_t[LANES];

/* The weight types the SIMD tiles read in place: f32, binary16 (F16C) and
 * bfloat16 (a shift), each widened to f32 exactly in registers. */
enum { WT_F32, WT_F16, WT_BF16, WT_N };

/* A tile of rows x tokens over a segment (lanes_run); tables of them are
 * indexed [wt][T]. */
typedef void (*tile_fn)(lanes_t (*L)[TOKS], const void *const *w, const float *x, size_t ldx, size_t len,
                        bool fresh, float *y, size_t ldy, size_t pf);

/* The SIMD matmul kernels of an instruction set (none: the scalar loops). */
struct mm_ops {
    const tile_fn (*tile4)[TT + 1]; /* 4 rows x 1..3 tokens */
    const tile_fn (*tile8)[TT + 1]; /* 8 rows x 1..3 tokens, or NULL */
    /* one row of type wt against one token, read in place; fresh: the
     * lanes start at zero (l is not read), else carried across calls */
    void (*row1[WT_N])(float *l, const void *w, const float *x, size_t len, bool fresh);
    float (*lanes_sum)(const float *l);                    /* reduce16 */
    void (*lanes_sum8)(float *out, const float *l, size_t ld); /* reduce16 of eight lane sets */
};

#ifdef KVT_HAVE_X86
/* Eight weights from w[i..i+8) of type wt, widened in registers (F16C and
 * the bfloat16 shift are exact). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256 wload(const int wt, const void *w, size_t i)
{
    if (wt == WT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    if (wt == WT_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i))), 16));
    return _mm256_loadu_ps((const float *)w + i);
}

/* Sixteen of them, for the AVX-512 tile. */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl"), always_inline)) static inline __m512 wload16(const int wt,
                                                                                                     const void *w,
                                                                                                     size_t i)
{
    if (wt == WT_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i)));
    if (wt == WT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i))), 16));
    return _mm512_loadu_ps((const float *)w + i);
}

static inline float wscalar(const int wt, const void *w, size_t i)
{
    if (wt == WT_F16) return kvt_f16_to_f32(((const uint16_t *)w)[i]);
    if (wt == WT_BF16) return kvt_bf16_to_f32(((const uint16_t *)w)[i]);
    return ((const float *)w)[i];
}

/* Elements [j, len) of an R-row x T-token tile one at a time, each into
 * lane j % 16: the tiles' single-element tail. */
static inline void tile_tail(const int R, const int T, const int wt, lanes_t (*L)[TOKS], const void *const *w,
                             const float *x, size_t ldx, size_t j, size_t len)
{
    for (; j < len; j++)
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                L[r][t][j % LANES] = fmaf(wscalar(wt, w[r], j), x[t * ldx + j], L[r][t][j % LANES]);
}

/* One half (lanes h*8 .. h*8+7) of a 4-row x T-token tile (T <= 3) over w[r][0, len):
 * elements i with i % 16 in that half, i < full (a multiple of 16) plus, for
 * the low half, the 8 at full when tail8. Twelve accumulators, three token
 * vectors and one weight vector: AVX2's sixteen registers (tile8_zmm is
 * the AVX-512 tile). Weights of type wt. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void tile_half(const int wt, const int T,
                                                                              lanes_t (*L)[TOKS],
                                                                              const void *const *w, const float *x,
                                                                              size_t ldx, size_t full, bool tail8,
                                                                              int h, bool fresh, float *y, size_t ldy,
                                                                              size_t pf)
{
    enum { R = 4 };
    __m256 a[R][TT];
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 3") for (int t = 0; t < T; t++)
            a[r][t] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(L[r][t] + 8 * h);
    size_t end = full + (tail8 ? 16 : 0);
    for (size_t i = 8 * (size_t)h; i < end; i += 16) {
        __m256 v[TT];
        /* (a prefetch of the next tile's lines here, while x came from
         * L3, cost 5 to 25 % once the token blocks kept x in L2) */
        _Pragma("GCC unroll 3") for (int t = 0; t < T; t++) v[t] = _mm256_loadu_ps(x + (size_t)t * ldx + i);
        if (pf) /* the rows read next, pf bytes on: the line this step's elements lie in (tile8_step) */
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)w[r] + i * (wt == WT_F32 ? 4 : 2) + pf, _MM_HINT_T0);
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
            __m256 wv = wload(wt, w[r], i);
            _Pragma("GCC unroll 3") for (int t = 0; t < T; t++) a[r][t] = _mm256_fmadd_ps(wv, v[t], a[r][t]);
        }
    }
    if (y) { /* the high half of the last segment: finish the dots, lanes 0..7 from L */
        _Pragma("GCC unroll 3") for (int t = 0; t < T; t++) {
            __m256 lo[R];
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) lo[r] = _mm256_loadu_ps(L[r][t]);
            __m256 hi[R] = {a[0][t], a[1][t], a[2][t], a[3][t]};
            _mm_storeu_ps(y + (size_t)t * ldy, reduce16x4_avx2(lo, hi));
        }
        return;
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 3") for (int t = 0; t < T; t++) _mm256_storeu_ps(L[r][t] + 8 * h, a[r][t]);
}

/* fresh: the lanes start at zero (the first segment) instead of from L.
 * y: the row's last segment, len a multiple of 8: the tile's outputs are
 * written to y[t * ldy + r] instead of its lanes to L. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void tile_rows4(const int wt, const int T,
                                                                               lanes_t (*L)[TOKS],
                                                                               const void *const *w, const float *x,
                                                                               size_t ldx, size_t len, bool fresh,
                                                                               float *y, size_t ldy, size_t pf)
{
    size_t full = len / 16 * 16;
    bool tail8 = len - full >= 8;
    /* the low half's steps (16 elements apart) reach every line of the rows */
    tile_half(wt, T, L, w, x, ldx, full, tail8, 0, fresh, NULL, 0, pf);
    tile_half(wt, T, L, w, x, ldx, full, false, 1, fresh, y, ldy, 0);
    tile_tail(4, T, wt, L, w, x, ldx, full + (tail8 ? 8 : 0), len);
}

/* One function per weight type and token count (the last tile of a sweep
 * takes the one or two tokens left), each compiled with its constants;
 * tbl[wt][T]. */
#define TILE_FN(name, tgt, tile, wt, T)                                                                           \
    __attribute__((target(tgt))) static void name(lanes_t (*L)[TOKS], const void *const *w, const float *x,      \
                                                  size_t ldx, size_t len, bool fresh, float *y, size_t ldy,       \
                                                  size_t pf)                                                      \
    {                                                                                                             \
        tile(wt, T, L, w, x, ldx, len, fresh, y, ldy, pf);                                                        \
    }
#define TILE_FNS(tbl, tgt, tile)                                                                                  \
    TILE_FN(tbl##_f32_t1, tgt, tile, WT_F32, 1)                                                                   \
    TILE_FN(tbl##_f32_t2, tgt, tile, WT_F32, 2)                                                                   \
    TILE_FN(tbl##_f32_t3, tgt, tile, WT_F32, 3)                                                                   \
    TILE_FN(tbl##_f16_t1, tgt, tile, WT_F16, 1)                                                                   \
    TILE_FN(tbl##_f16_t2, tgt, tile, WT_F16, 2)                                                                   \
    TILE_FN(tbl##_f16_t3, tgt, tile, WT_F16, 3)                                                                   \
    TILE_FN(tbl##_bf16_t1, tgt, tile, WT_BF16, 1)                                                                 \
    TILE_FN(tbl##_bf16_t2, tgt, tile, WT_BF16, 2)                                                                 \
    TILE_FN(tbl##_bf16_t3, tgt, tile, WT_BF16, 3)                                                                 \
    static const tile_fn tbl##_fns[WT_N][TT + 1] = {                                                              \
        [WT_F32] = {NULL, tbl##_f32_t1, tbl##_f32_t2, tbl##_f32_t3},                                              \
        [WT_F16] = {NULL, tbl##_f16_t1, tbl##_f16_t2, tbl##_f16_t3},                                              \
        [WT_BF16] = {NULL, tbl##_bf16_t1, tbl##_bf16_t2, tbl##_bf16_t3}};
TILE_FNS(tile4, "avx2,fma,f16c", tile_rows4)

/* An 8-row x 3-token tile with AVX-512: each (row, token) keeps its 16
 * lanes in one zmm, so both halves run at once (twenty-four accumulators,
 * three token vectors, one weight vector of the thirty-two registers). Each
 * lane sees the same fused multiply-adds in the same order as tile_half's,
 * so the bits are those of the AVX2 tiles; the 8 at full (tail8) go to
 * lanes 0..7 under a mask. Weights of type wt (f32, f16, bf16). */
/* Elements [i, i + 16) of the 8-row tile into the lanes of mask m. */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl"), always_inline)) static inline void
tile8_step(const int wt, const int T, __m512 (*a)[TT], const void *const *w, const float *x, size_t ldx, size_t i,
           __mmask16 m, size_t pf)
{
    if (pf && wt == WT_F32) /* the line of each row pf bytes on that this step reaches: the rows read next */
        _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++)
            _mm_prefetch((const char *)w[r] + i * 4 + pf, _MM_HINT_T0);
    else if (pf) /* 16 elements of binary16 are half a line: four rows a step, in turn */
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)
            _mm_prefetch((const char *)w[(i / 16 & 1) * 4 + r] + i * 2 + pf, _MM_HINT_T0);
    __m512 v[TT];
    _Pragma("GCC unroll 3") for (int t = 0; t < T; t++) v[t] = _mm512_loadu_ps(x + (size_t)t * ldx + i);
    _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) {
        __m512 wv = wload16(wt, w[r], i);
        _Pragma("GCC unroll 3") for (int t = 0; t < T; t++)
            a[r][t] = m == 0xFFFF ? _mm512_fmadd_ps(wv, v[t], a[r][t]) : _mm512_mask3_fmadd_ps(wv, v[t], a[r][t], m);
    }
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512vl"), always_inline)) static inline void
tile8_zmm(const int wt, const int T, lanes_t (*L)[TOKS], const void *const *w, const float *x, size_t ldx,
          size_t len, bool fresh, float *y, size_t ldy, size_t pf)
{
    size_t full = len / 16 * 16;
    bool tail8 = len - full >= 8;
    __m512 a[8][TT];
    _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++)
        _Pragma("GCC unroll 3") for (int t = 0; t < T; t++)
            a[r][t] = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(L[r][t]);
    if (atomic_load_explicit(&kvt_kernels_fault, memory_order_relaxed) == KVT_KERNELS_FAULT_ZMM_ORDER) {
        /* the tests' fault: lane 3 takes its elements in reverse order */
        for (size_t i = 0; i < full; i += 16) tile8_step(wt, T, a, w, x, ldx, i, 0xFFF7, pf);
        for (size_t i = full; i >= 16; i -= 16) tile8_step(wt, T, a, w, x, ldx, i - 16, 0x0008, 0);
    } else if (pf)
        for (size_t i = 0; i < full; i += 16) tile8_step(wt, T, a, w, x, ldx, i, 0xFFFF, pf);
    else
        for (size_t i = 0; i < full; i += 16) tile8_step(wt, T, a, w, x, ldx, i, 0xFFFF, 0);
    if (tail8) {
        __m512 v[TT];
        _Pragma("GCC unroll 3") for (int t = 0; t < T; t++)
            v[t] = _mm512_zextps256_ps512(_mm256_loadu_ps(x + (size_t)t * ldx + full));
        _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) {
            __m512 wv = _mm512_zextps256_ps512(wload(wt, w[r], full));
            _Pragma("GCC unroll 3") for (int t = 0; t < T; t++)
                a[r][t] = _mm512_mask3_fmadd_ps(wv, v[t], a[r][t], 0x00FF);
        }
    }
    if (y) { /* the last segment (len a multiple of 8): finish the dots */
        _Pragma("GCC unroll 3") for (int t = 0; t < T; t++)
            _Pragma("GCC unroll 2") for (int q = 0; q < 8; q += 4) {
                __m256 lo[4], hi[4];
                _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
                    lo[r] = _mm512_castps512_ps256(a[q + r][t]);
                    hi[r] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[q + r][t]), 1));
                }
                _mm_storeu_ps(y + (size_t)t * ldy + q, reduce16x4_avx2(lo, hi));
            }
        return;
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++)
        _Pragma("GCC unroll 3") for (int t = 0; t < T; t++) _mm512_storeu_ps(L[r][t], a[r][t]);
    tile_tail(8, T, wt, L, w, x, ldx, full + (tail8 ? 8 : 0), len);
}

TILE_FNS(tile8, "avx2,fma,f16c,avx512f,avx512vl", tile8_zmm)
#undef TILE_FNS
#undef TILE_FN

/* One binary16 or bfloat16 row against one token, widened in registers
 * (exact): the order of dot_avx2. fresh: the lanes start at zero (l is not
 * read). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void row1_avx2_t(const int wt, float *l,
                                                                                     const void *wv, const float *x,
                                                                                     size_t len, bool fresh)
{
    const uint16_t *w = wv;
    __m256 a = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(l), b = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(l + 8);
    size_t i = 0;
#define ROW1_STEP(k)                                                                                                 \
    a = _mm256_fmadd_ps(wload(wt, w, (k)), _mm256_loadu_ps(x + (k)), a);                                             \
    b = _mm256_fmadd_ps(wload(wt, w, (k) + 8), _mm256_loadu_ps(x + (k) + 8), b)
    for (; i + 32 <= len; i += 32) { /* a line of weights a step */
        _mm_prefetch((const char *)(w + i) + KVT_PF_AHEAD, _MM_HINT_T0);
        ROW1_STEP(i);
        ROW1_STEP(i + 16);
    }
    if (i + 16 <= len) {
        ROW1_STEP(i);
        i += 16;
    }
#undef ROW1_STEP
    _mm256_storeu_ps(l, a);
    _mm256_storeu_ps(l + 8, b);
    if (i == len) return;
    float t[16];
    for (size_t j = i; j < len; j++) t[j - i] = wscalar(wt, w, j);
    lanes1_avx2(l, t, x + i, len - i); /* the tail (an 8 and single elements) as dot_avx2 takes it */
}

__attribute__((target("avx2,fma,f16c"))) static void row1_f16_avx2(float *l, const void *w, const float *x, size_t len,
                                                                  bool fresh)
{
    row1_avx2_t(WT_F16, l, w, x, len, fresh);
}

__attribute__((target("avx2,fma,f16c"))) static void row1_bf16_avx2(float *l, const void *w, const float *x, size_t len,
                                                                   bool fresh)
{
    row1_avx2_t(WT_BF16, l, w, x, len, fresh);
}

/* An f32 row: lanes1_avx2, from zero when fresh. */
static void row1_f32_avx2(float *l, const void *w, const float *x, size_t len, bool fresh)
{
    if (fresh) memset(l, 0, sizeof(lanes_t));
    lanes1_avx2(l, w, x, len);
}
#endif

/* Rows [0, nr) x tokens [0, nt) of the lanes over w[r][0, len) and the
 * tokens' x (ldx apart); w f32, or binary16 or bfloat16 read in place as
 * wt says (the SIMD kernels only).
 * fresh: the first segment, whose lanes start at zero (L is not read).
 * y (the last segment, len a multiple of 8): the 3-token tiles write their
 * outputs to y (tokens ldy apart) and *done_r x *done_t say which: rows
 * [0, done_r) of tokens [0, done_t); the others' lanes are left in L.
 * pf (0: none): the first token tile prefetches each row's lines pf bytes
 * on (the rows read next); no bit depends on it. */
static void lanes_run(lanes_t (*L)[TOKS], const void *const *w, int wt, size_t nr, const float *x, size_t ldx,
                      size_t nt, size_t len, const struct mm_ops *mm, bool fresh, float *y, size_t ldy, size_t *done_r,
                      size_t *done_t, size_t pf)
{
    *done_r = *done_t = 0;
#define LT(r, t) ((lanes_t(*)[TOKS])(&L[r][t]))
    if (mm) {
        size_t r = 0, tt = nt / TT * TT;
        if (nr == 8 && mm->tile8) {
            for (size_t t = 0; t < nt; t += TT) { /* the last tile takes what is left */
                float *yt = y ? y + t * ldy : NULL;
                int T = nt - t < TT ? (int)(nt - t) : TT;
                mm->tile8[wt][T](LT(0, t), w, x + t * ldx, ldx, len, fresh, yt, ldy, t ? 0 : pf);
            }
            r = 8;
            tt = nt;
        } else {
            for (; r + 4 <= nr; r += 4)
                for (size_t t = 0; t < nt; t += TT) {
                    float *yt = y ? y + t * ldy + r : NULL;
                    int T = nt - t < TT ? (int)(nt - t) : TT;
                    mm->tile4[wt][T](LT(r, t), w + r, x + t * ldx, ldx, len, fresh, yt, ldy, t ? 0 : pf);
                }
            if (r) tt = nt;
        }
        if (y) *done_r = r, *done_t = tt;
        /* the rest a row and a token at a time: rows [r, nr) of every
         * token, the rows before of the tokens past the tiles' */
        for (size_t q = 0; q < nr; q++)
            for (size_t u = q < r ? tt : 0; u < nt; u++) mm->row1[wt](L[q][u], w[q], x + u * ldx, len, fresh);
        return;
    }
#undef LT
    for (size_t t = 0; t < nt; t++) {
        const float *xt = x + t * ldx;
        for (size_t r = 0; r < nr; r++) {
            const float *wr = w[r];
            if (fresh) memset(L[r][t], 0, sizeof(lanes_t));
            for (size_t i = 0; i < len; i++) L[r][t][i % LANES] = fmaf(wr[i], xt[i], L[r][t][i % LANES]);
        }
    }
}

/* mm: the SIMD kernels, NULL for the scalar loops */
struct mm_ctx { float *y; const kvt_wmat *W; const float *x; size_t n; const struct mm_ops *mm; };

static void mm_range(void *arg, size_t o0, size_t o1)
{
    struct mm_ctx *c = arg;
    const kvt_wmat *W = c->W;
    size_t d_in = W->cols, d_out = W->rows, blk = 1, blk_bytes = 4;
    bool f32 = W->type == KVT_GGML_F32;
    if (!f32) kvt_quant_block(W->type, &blk, &blk_bytes);
    static _Thread_local float wseg[TR][SEG] __attribute__((aligned(32)));
    static _Thread_local lanes_t lanes[TR][TOKS];
    /* f32 rows are read in place, and F16 and BF16 ones by the SIMD
     * kernels (a segment of SEG16); the other types are converted to f32 a
     * segment of SEG at a time */
    const struct mm_ops *mm = c->mm;
    bool in_place = f32 || (mm && (W->type == KVT_GGML_F16 || W->type == KVT_GGML_BF16));
    int wt = !in_place || f32 ? WT_F32 : W->type == KVT_GGML_F16 ? WT_F16 : WT_BF16;
    size_t seg = wt != WT_F32 ? SEG16 : SEG;
    /* tokens of a block: their x (tb x d_in floats) stays in L2 while
     * every row of the range runs over it */
    size_t tb = d_in ? XBLK / (d_in * sizeof(float)) / TT * TT : TOKS;
    tb = tb < TT ? TT : tb > TOKS ? TOKS : tb;
    for (size_t t0 = 0; t0 < c->n; t0 += tb) {
        size_t nt = c->n - t0 < tb ? c->n - t0 : tb;
        for (size_t o = o0; o < o1; o += TR) {
        size_t nr = o1 - o < TR ? o1 - o : TR;
            /* the lanes start at zero: set here for decode and an empty row;
             * the first segment's kernels start from zero themselves */
            if (!d_in) for (size_t r = 0; r < nr; r++) memset(lanes[r], 0, nt * sizeof(lanes_t));
            size_t done_r = 0, done_t = 0; /* outputs the tiles wrote (lanes_run) */
            /* the outputs' lines (a token's are adjacent; tokens d_out
             * apart), on their way while the tiles run */
            if (mm)
                for (size_t t = 0; t < nt; t++) __builtin_prefetch(c->y + (t0 + t) * d_out + o, 0, 3);
            /* the tiles read the rows in place, eight (AVX-512) or four
             * side by side: streams the hardware's prefetchers do not
             * follow in time (rows of 768 F16 are 24 lines), so the first
             * token tile of each segment prefetches the same segment of the
             * next eight rows, pf bytes on, a line per row as it reaches
             * it. Without it a batched decode step (2 to 8 tokens, 1
             * thread) read the weights at 9.5 to 17 GB/s against 27 for
             * one token, waiting on each line (perf: the stalls on the
             * tiles' vcvtph2ps loads); with it the 32000 x 768 F16 output
             * matrix took 1.35 to 1.7x less CPU time at 3 to 8 tokens
             * (bench/SERVE.md, "The batched step on F16") */
            size_t pf = in_place && o + 2 * TR <= o1 ? TR * W->row_bytes : 0;
            if (mm && in_place && nt == 1) {
                /* decode: each row whole (binary16 or bfloat16 straight into
                 * registers), one row after the other. One stream through
                 * memory: rows read four side by side, or in segments,
                 * ran at a third of the read bandwidth (8.5 against 19 to
                 * 24 GB/s on a 2048 x 768 F16 matrix out of the cache).
                 * Two tokens go to the tiles: the row kernel's two chains a
                 * token (latency-bound) made a 2-token step cost twice a
                 * 1-token one, where the tiles with pf take 1.2x. */
                for (size_t r = 0; r < nr; r++)
                    mm->row1[wt](lanes[r][0], W->data + (o + r) * W->row_bytes, c->x + t0 * d_in, d_in, true);
            } else
            for (size_t k = 0; k < d_in; k += seg) {
                size_t len = d_in - k < seg ? d_in - k : seg;
                const void *w[TR];
                for (size_t r = 0; r < nr; r++) {
                    const uint8_t *src = W->data + (o + r) * W->row_bytes + k / blk * blk_bytes;
                    if (in_place) w[r] = src;
                    else if (W->type == KVT_GGML_F16) kvt_f16_row_to_f32(wseg[r], (const uint16_t *)src, len);
                    else if (W->type == KVT_GGML_BF16) ops()->bf16_to_f32(wseg[r], (const uint16_t *)src, len);
                    else kvt_quant_to_f32(W->type, src, wseg[r], len);
                    if (!in_place) w[r] = wseg[r];
                }
                bool last = k + len == d_in && len % 8 == 0;
                lanes_run(lanes, w, wt, nr, c->x + t0 * d_in + k, d_in, nt, len, mm, k == 0,
                          last ? c->y + t0 * d_out + o : NULL, d_out, &done_r, &done_t, pf);
            }
            /* the outputs the tiles did not write, token by token: a
             * token's outputs are adjacent in y */
            for (size_t t = 0; t < nt; t++)
                for (size_t r = t < done_t ? done_r : 0; r < nr; r++) {
                    float *l = lanes[r][t];
                    if (mm && nr == 8 && r == 0) {
                        mm->lanes_sum8(c->y + (t0 + t) * d_out + o, l, TOKS * LANES);
                        break;
                    }
                    if (mm) {
                        c->y[(t0 + t) * d_out + o + r] = mm->lanes_sum(l);
                        continue;
                    }
                    c->y[(t0 + t) * d_out + o + r] = reduce16(l);
                }
        }
    }
}

/* Tokens [t0, t1) against every row: a thread's share of a prefill split
 * by tokens. */
static void mm_tokens(void *arg, size_t t0, size_t t1)
{
    const struct mm_ctx *c = arg;
    struct mm_ctx part = {c->y + t0 * c->W->rows, c->W, c->x + t0 * c->W->cols, t1 - t0, c->mm};
    mm_range(&part, 0, c->W->rows);
}

/* Split a prefill by tokens rather than rows: each thread then reads the
 * activations that it wrote (the norms before split by tokens the same
 * way) instead of half of them from the other core, at the price of
 * reading every weight. Any split gives the same bits. */
static bool tok_split(const kvt_pool *pool, const kvt_wmat *W, size_t n)
{
    return pool && kvt_pool_size(pool) > 1 && n >= TOKS * kvt_pool_size(pool) && W->cols;
}

void kvt_matmul_w(kvt_pool *pool, float *y, const kvt_wmat *W, const float *x, size_t n, uint8_t *qx)
{
    if (kvt_q_supported(W->type)) {
        kvt_q_matmul(pool, y, W, x, n, qx);
        return;
    }
    struct mm_ctx c = {y, W, x, n, ops()->mm};
    if (tok_split(pool, W, n)) {
        kvt_pool_for(pool, n, TOKS, mm_tokens, &c);
        return;
    }
    size_t per_out = n * W->cols;
    size_t min = per_out ? (32768 + per_out - 1) / per_out : W->rows;
    kvt_pool_for(pool, W->rows, min, mm_range, &c);
}

void kvt_matmul_w_next(kvt_pool *pool, float *y, const kvt_wmat *W, const kvt_wmat *prev, const float *x, size_t n,
                       uint8_t *qx)
{
    if (qx && prev->cols == W->cols && kvt_q_same_act(prev->type, W->type)) {
        kvt_q_matmul_quantised(pool, y, W, n, qx);
        return;
    }
    kvt_matmul_w(pool, y, W, x, n, qx);
}

void kvt_matmul(kvt_pool *pool, float *y, const float *W, const float *x,
                size_t n, size_t d_in, size_t d_out)
{
    kvt_wmat w = kvt_wmat_f32(W, d_out, d_in);
    kvt_matmul_w(pool, y, &w, x, n, NULL);
}

void kvt_rmsnorm(float *out, const float *x, const float *w, size_t d, float eps)
{
    float ss = kvt_dot(x, x, d) / (float)d + eps;
    float s = 1.0f / sqrtf(ss);
    for (size_t j = 0; j < d; j++) out[j] = w ? w[j] * (s * x[j]) : s * x[j];
}

static void rope_dir(float *v, size_t n_rot, size_t pos, float base, float sign)
{
    for (size_t i = 0; i < n_rot; i += 2) {
        float freq = 1.0f / powf(base, (float)i / (float)n_rot);
        float ang = (float)pos * freq;
        float c = cosf(ang), s = sign * sinf(ang);
        float a = v[i], b = v[i + 1];
        v[i] = a * c - b * s;
        v[i + 1] = a * s + b * c;
    }
}

void kvt_rope(float *v, size_t n_rot, size_t pos, float base) { rope_dir(v, n_rot, pos, base, 1.0f); }

void kvt_rope_heads(float *a, size_t na, float *b, size_t nb, size_t stride, size_t n_rot, size_t pos, float base,
                    const float *ff, bool neox)
{
    size_t half = n_rot / 2;
    for (size_t i = 0; i < n_rot; i += 2) {
        float freq = 1.0f / powf(base, (float)i / (float)n_rot);
        float ang = ff ? (float)pos * freq / ff[i / 2] : (float)pos * freq;
        float c = cosf(ang), s = sinf(ang);
        size_t j0 = neox ? i / 2 : i, j1 = neox ? i / 2 + half : i + 1;
        for (size_t h = 0; h < na + nb; h++) {
            float *p = h < na ? a + h * stride : b + (h - na) * stride, u = p[j0], v = p[j1];
            p[j0] = u * c - v * s;
            p[j1] = u * s + v * c;
        }
    }
}
void kvt_rope_inv(float *v, size_t n_rot, size_t pos, float base) { rope_dir(v, n_rot, pos, base, -1.0f); }


static float yarn_corr_dim(size_t n_rot, uint32_t orig, float beta, float base)
{
    return (float)n_rot * logf((float)orig / (beta * 2.0f * (float)M_PI)) / (2.0f * logf(base));
}

kvt_yarn kvt_yarn_make(size_t n_rot, float base, float factor, uint32_t orig_ctx)
{
    if (!(factor > 1.0f) || !orig_ctx) return (kvt_yarn){1.0f, 0.0f, 0.0f, 0.0f};
    float lo = floorf(yarn_corr_dim(n_rot, orig_ctx, 32.0f, base));
    float hi = ceilf(yarn_corr_dim(n_rot, orig_ctx, 1.0f, base));
    return (kvt_yarn){1.0f / factor, 1.0f, lo > 0 ? lo : 0, hi < (float)n_rot - 1 ? hi : (float)n_rot - 1};
}

void kvt_rope_ext(float *v, size_t n_rot, size_t pos, float base, const kvt_yarn *y, float sign)
{
    if (!y || (y->ext_factor == 0.0f && y->freq_scale == 1.0f)) {
        rope_dir(v, n_rot, pos, base, sign);
        return;
    }
    for (size_t i = 0; i < n_rot; i += 2) {
        float freq = 1.0f / powf(base, (float)i / (float)n_rot);
        float extrap = (float)pos * freq, interp = y->freq_scale * extrap, ang = interp;
        if (y->ext_factor != 0.0f) {
            float r = ((float)(i / 2) - y->lo) / fmaxf(0.001f, y->hi - y->lo);
            float mix = (1.0f - fminf(1.0f, fmaxf(0.0f, r))) * y->ext_factor;
            ang = interp * (1.0f - mix) + extrap * mix;
        }
        float c = cosf(ang), s = sign * sinf(ang);
        float a = v[i], b = v[i + 1];
        v[i] = a * c - b * s;
        v[i + 1] = a * s + b * c;
    }
}

void kvt_hadamard(float *v, size_t n)
{
    for (size_t h = 1; h < n; h *= 2)
        for (size_t i = 0; i < n; i += 2 * h)
            for (size_t j = i; j < i + h; j++) {
                float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
    float s = 1.0f / sqrtf((float)n);
    for (size_t i = 0; i < n; i++) v[i] *= s;
}

/* exp: the algorithm and constants of glibc's expf (Arm's optimized
 * routines: x * 32 / ln 2 = k + r, 2^(k/32) from a table, a cubic in r, in
 * double), with the fused multiply-adds of its FMA build, so that it gives
 * the bits glibc 2.36 gives on this machine (tests/test_kernels.c compares
 * it with libm's expf) but no longer depends on the machine's libm. */
static const uint64_t exp2f_tab[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
};
#define EXPF_INVLN2N 0x1.71547652b82fep+5 /* 32 / ln 2 */
#define EXPF_SHIFT 0x1.8p+52              /* rounds to an integer when added */
#define EXPF_C0 0x1.c6af84b912394p-20
#define EXPF_C1 0x1.ebfce50fac4f3p-13
#define EXPF_C2 0x1.62e42ff0c52d6p-6
#define EXPF_TOP_SPECIAL 0x42b /* top 12 bits of |x| from 88.0f on: the special cases */

static inline uint32_t f32_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }

__attribute__((always_inline)) static inline float expf_core(float x)
{
    uint32_t ix = f32_bits(x), top = ix >> 20 & 0x7ff;
    if (top >= EXPF_TOP_SPECIAL) {
        if (ix == 0xff800000u) return 0.0f;            /* exp(-inf) */
        if (top >= 0x7f8) return x + x;                /* inf, NaN */
        if (x > 0x1.62e42ep6f) return INFINITY;        /* overflows */
        if (x < -0x1.9fe368p6f) return 0.0f;           /* under 2^-150 */
        if (x < -0x1.9d1d9ep6f) return 0x1p-149f;      /* rounds to the least subnormal */
    }
    double xd = x, kd = fma(EXPF_INVLN2N, xd, EXPF_SHIFT);
    uint64_t ki;
    memcpy(&ki, &kd, 8);
    kd -= EXPF_SHIFT;
    double r = fma(EXPF_INVLN2N, xd, -kd);
    uint64_t t = exp2f_tab[ki % 32] + (ki << 47);
    double sc;
    memcpy(&sc, &t, 8);
    double z = fma(EXPF_C0, r, EXPF_C1), r2 = r * r, y = fma(EXPF_C2, r, 1.0);
    y = fma(z, r2, y) * sc;
    return (float)y;
}


#ifdef KVT_HAVE_X86
/* kvt_expf with the fma instruction (a library call elsewhere). */
__attribute__((target("avx2,fma"))) static float expf1_fma(float x) { return expf_core(x); }

/* kvt_expf of four floats in double lanes. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m128 expf4_avx2(__m128 x)
{
    __m256d xd = _mm256_cvtps_pd(x);
    __m256d kd = _mm256_fmadd_pd(_mm256_set1_pd(EXPF_INVLN2N), xd, _mm256_set1_pd(EXPF_SHIFT));
    __m256i ki = _mm256_castpd_si256(kd);
    kd = _mm256_sub_pd(kd, _mm256_set1_pd(EXPF_SHIFT));
    __m256d r = _mm256_fmsub_pd(_mm256_set1_pd(EXPF_INVLN2N), xd, kd);
    __m256i t = _mm256_i64gather_epi64((const long long *)exp2f_tab, _mm256_and_si256(ki, _mm256_set1_epi64x(31)), 8);
    __m256d sc = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64(ki, 47)));
    __m256d z = _mm256_fmadd_pd(_mm256_set1_pd(EXPF_C0), r, _mm256_set1_pd(EXPF_C1));
    __m256d r2 = _mm256_mul_pd(r, r);
    __m256d y = _mm256_fmadd_pd(_mm256_set1_pd(EXPF_C2), r, _mm256_set1_pd(1.0));
    y = _mm256_mul_pd(_mm256_fmadd_pd(z, r2, y), sc);
    return _mm256_cvtpd_ps(y);
}

/* kvt_expf of eight floats: four at a time in double lanes, or, when a
 * lane is in the special range (|x| >= 88, NaN), each through expf1_fma. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 expf8_avx2(__m256 d)
{
    __m256i top = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(d), 20), _mm256_set1_epi32(0x7ff));
    if (!_mm256_testz_si256(_mm256_cmpgt_epi32(top, _mm256_set1_epi32(EXPF_TOP_SPECIAL - 1)), _mm256_set1_epi32(-1))) {
        float l[8];
        _mm256_storeu_ps(l, d);
        for (int e = 0; e < 8; e++) l[e] = expf1_fma(l[e]);
        return _mm256_loadu_ps(l);
    }
    return _mm256_set_m128(expf4_avx2(_mm256_extractf128_ps(d, 1)), expf4_avx2(_mm256_castps256_ps128(d)));
}

/* x[i] = kvt_expf(x[i] - m), eight at a time. */
__attribute__((target("avx2,fma"))) static void exp_shift_avx2(float *x, size_t n, float m)
{
    size_t i = 0;
    __m256 vm = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, expf8_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm)));
    for (; i < n; i++) x[i] = expf1_fma(x[i] - m);
}

/* expf4_avx2 for eight floats in the double lanes of a zmm, the table
 * read by two-source permutes (32 entries in four registers). */
__attribute__((target("avx2,fma,avx512f,avx512vl"), always_inline)) static inline __m256 expf8_zmm(__m256 x,
                                                                                                 const __m512i T[4])
{
    __m512d xd = _mm512_cvtps_pd(x);
    __m512d kd = _mm512_fmadd_pd(_mm512_set1_pd(EXPF_INVLN2N), xd, _mm512_set1_pd(EXPF_SHIFT));
    __m512i ki = _mm512_castpd_si512(kd);
    kd = _mm512_sub_pd(kd, _mm512_set1_pd(EXPF_SHIFT));
    __m512d r = _mm512_fmsub_pd(_mm512_set1_pd(EXPF_INVLN2N), xd, kd);
    __m512i lo = _mm512_permutex2var_epi64(T[0], ki, T[1]), hi = _mm512_permutex2var_epi64(T[2], ki, T[3]);
    __m512i t = _mm512_mask_blend_epi64(_mm512_test_epi64_mask(ki, _mm512_set1_epi64(16)), lo, hi);
    __m512d sc = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64(ki, 47)));
    __m512d z = _mm512_fmadd_pd(_mm512_set1_pd(EXPF_C0), r, _mm512_set1_pd(EXPF_C1));
    __m512d r2 = _mm512_mul_pd(r, r);
    __m512d y = _mm512_fmadd_pd(_mm512_set1_pd(EXPF_C2), r, _mm512_set1_pd(1.0));
    y = _mm512_mul_pd(_mm512_fmadd_pd(z, r2, y), sc);
    return _mm512_cvtpd_ps(y);
}

/* exp_shift_avx2 sixteen at a time with AVX-512: the same operations per
 * element, a block with a lane in the special range through expf1_fma. */
__attribute__((target("avx2,fma,avx512f,avx512vl"))) static void exp_shift_avx512(float *x, size_t n, float m)
{
    const __m512i T[4] = {_mm512_loadu_si512((const void *)exp2f_tab), _mm512_loadu_si512((const void *)(exp2f_tab + 8)),
                          _mm512_loadu_si512((const void *)(exp2f_tab + 16)),
                          _mm512_loadu_si512((const void *)(exp2f_tab + 24))};
    size_t i = 0;
    const __m512 vm = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + i), vm);
        __m512i top = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(d), 20), _mm512_set1_epi32(0x7ff));
        if (_mm512_cmpgt_epi32_mask(top, _mm512_set1_epi32(EXPF_TOP_SPECIAL - 1))) {
            for (int e = 0; e < 16; e++) x[i + e] = expf1_fma(x[i + e] - m);
            continue;
        }
        __m256 a = expf8_zmm(_mm512_castps512_ps256(d), T);
        __m256 b = expf8_zmm(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(d), 1)), T);
        _mm256_storeu_ps(x + i, a);
        _mm256_storeu_ps(x + i + 8, b);
    }
    for (; i < n; i++) x[i] = expf1_fma(x[i] - m);
}

/* kvt_swiglu eight at a time: the scalar expression's operations in its
 * order, exp through expf8_avx2. */
__attribute__((target("avx2,fma"))) static void swiglu_avx2(float *h1, const float *h3, size_t n)
{
    size_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(h1 + i), e = expf8_avx2(_mm256_xor_ps(g, neg));
        __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
        _mm256_storeu_ps(h1 + i, _mm256_mul_ps(_mm256_mul_ps(g, r), _mm256_loadu_ps(h3 + i)));
    }
    for (; i < n; i++) {
        float g = h1[i];
        h1[i] = g * (1.0f / (1.0f + expf1_fma(-g))) * h3[i];
    }
}

/* swiglu_avx2 sixteen at a time with AVX-512 (exp through expf8_zmm). */
__attribute__((target("avx2,fma,avx512f,avx512vl"))) static void swiglu_avx512(float *h1, const float *h3, size_t n)
{
    const __m512i T[4] = {_mm512_loadu_si512((const void *)exp2f_tab), _mm512_loadu_si512((const void *)(exp2f_tab + 8)),
                          _mm512_loadu_si512((const void *)(exp2f_tab + 16)),
                          _mm512_loadu_si512((const void *)(exp2f_tab + 24))};
    const __m512 one = _mm512_set1_ps(1.0f);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 g = _mm512_loadu_ps(h1 + i), d = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN)));
        __m512i top = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(d), 20), _mm512_set1_epi32(0x7ff));
        if (_mm512_cmpgt_epi32_mask(top, _mm512_set1_epi32(EXPF_TOP_SPECIAL - 1))) {
            for (size_t e = i; e < i + 16; e++) h1[e] = h1[e] * (1.0f / (1.0f + expf1_fma(-h1[e]))) * h3[e];
            continue;
        }
        __m512 e = _mm512_castpd_ps(_mm512_insertf64x4(
            _mm512_castpd256_pd512(_mm256_castps_pd(expf8_zmm(_mm512_castps512_ps256(d), T))),
            _mm256_castps_pd(expf8_zmm(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(d), 1)), T)), 1));
        __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
        _mm512_storeu_ps(h1 + i, _mm512_mul_ps(_mm512_mul_ps(g, r), _mm512_loadu_ps(h3 + i)));
    }
    for (; i < n; i++) {
        float g = h1[i];
        h1[i] = g * (1.0f / (1.0f + expf1_fma(-g))) * h3[i];
    }
}

__attribute__((target("avx2,fma"))) static void div_avx2(float *x, size_t n, float d)
{
    size_t i = 0;
    __m256 vd = _mm256_set1_ps(d);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_div_ps(_mm256_loadu_ps(x + i), vd));
    for (; i < n; i++) x[i] /= d;
}
#endif

static float expf1_scalar(float x) { return expf_core(x); }

float kvt_expf(float x) { return ops()->expf1(x); }

/* GELU (tanh form) of every binary16 input, rounded to binary16: the
 * function kvt_geglu computes between -10 and 10, tabulated once (ggml's
 * CPU backend looks it up the same way), so a lookup gives the bits the
 * computation would. */
static float gelu_tab[65536];
static pthread_once_t gelu_once = PTHREAD_ONCE_INIT;

static void gelu_init(void)
{
    for (uint32_t h = 0; h < 65536; h++) {
        float v = kvt_f16_to_f32((uint16_t)h);
        gelu_tab[h] = kvt_f16_to_f32(kvt_f32_to_f16(0.5f * v * (1.0f + tanhf(0.7978845608028654f * v *
                                                                              (1.0f + 0.044715f * v * v)))));
    }
}

void kvt_geglu(float *h1, const float *h3, size_t n)
{
    pthread_once(&gelu_once, gelu_init);
    for (size_t i = 0; i < n; i++) {
        float x = h1[i], g;
        if (x <= -10.0f) g = 0.0f;
        else if (x >= 10.0f) g = x;
        else g = gelu_tab[kvt_f32_to_f16(x)];
        h1[i] = g * h3[i];
    }
}

void kvt_swiglu(float *h1, const float *h3, size_t n) { ops()->swiglu(h1, h3, n); }

static void swiglu_scalar(float *h1, const float *h3, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float g = h1[i];
        h1[i] = g * (1.0f / (1.0f + expf_core(-g))) * h3[i];
    }
}

/* The maximum in eight lanes, x[i] into lane i % 8 as m = x > m ? x : m,
 * the lanes then in order (so NaNs are met as by one fixed sequence; for
 * numbers any order gives the same maximum, up to the sign of a zero, which
 * no x - m can see). */
static float max8(const float *x, size_t n)
{
    float l[8] = {0};
    size_t k = n < 8 ? n : 8;
    for (size_t e = 0; e < k; e++) l[e] = x[e];
    for (size_t i = 8; i < n; i++) l[i % 8] = x[i] > l[i % 8] ? x[i] : l[i % 8];
    float m = l[0];
    for (size_t e = 1; e < k; e++) m = l[e] > m ? l[e] : m;
    return m;
}

/* x[i] = kvt_expf(x[i] - m), m the row's maximum (max8). */
static void exp_row_scalar(float *x, size_t n)
{
    float m = max8(x, n);
    for (size_t i = 0; i < n; i++) x[i] = expf_core(x[i] - m);
}

static void div_scalar(float *x, size_t n, float d)
{
    for (size_t i = 0; i < n; i++) x[i] /= d;
}

#ifdef KVT_HAVE_X86
__attribute__((target("avx2,fma"))) static float max8_avx2(const float *x, size_t n)
{
    if (n < 16) return max8(x, n);
    __m256 v = _mm256_loadu_ps(x);
    size_t i = 8;
    for (; i + 8 <= n; i += 8) {
        __m256 y = _mm256_loadu_ps(x + i);
        v = _mm256_blendv_ps(v, y, _mm256_cmp_ps(y, v, _CMP_GT_OQ));
    }
    float l[8];
    _mm256_storeu_ps(l, v);
    for (; i < n; i++) l[i % 8] = x[i] > l[i % 8] ? x[i] : l[i % 8];
    float m = l[0];
    for (int e = 1; e < 8; e++) m = l[e] > m ? l[e] : m;
    return m;
}

static void exp_row_avx2(float *x, size_t n) { exp_shift_avx2(x, n, max8_avx2(x, n)); }
static void exp_row_avx512(float *x, size_t n) { exp_shift_avx512(x, n, max8_avx2(x, n)); }
#endif

void kvt_softmax_rows(float *x, size_t ldx, size_t nrows, size_t n)
{
    if (!n) return;
    const struct f32_ops *k = ops();
    for (size_t r0 = 0; r0 < nrows; r0 += 4) {
        size_t nr = nrows - r0 < 4 ? nrows - r0 : 4;
        float *row[4] = {x + r0 * ldx, x + (r0 + 1) * ldx, x + (r0 + 2) * ldx, x + (r0 + 3) * ldx};
        float sum[4] = {0, 0, 0, 0};
        for (size_t r = 0; r < nr; r++) k->exp_row(row[r], n);
        /* each row's sum in position order; the rows' chains side by side */
        if (nr == 4)
            for (size_t i = 0; i < n; i++) {
                sum[0] += row[0][i];
                sum[1] += row[1][i];
                sum[2] += row[2][i];
                sum[3] += row[3][i];
            }
        else if (nr == 3)
            for (size_t i = 0; i < n; i++) {
                sum[0] += row[0][i];
                sum[1] += row[1][i];
                sum[2] += row[2][i];
            }
        else
            for (size_t r = 0; r < nr; r++)
                for (size_t i = 0; i < n; i++) sum[r] += row[r][i];
        for (size_t r = 0; r < nr; r++) k->div(row[r], n, sum[r]);
    }
}

float kvt_dot(const float *a, const float *b, size_t n) { return ops()->dot(a, b, n); }
void kvt_axpy(float *y, float a, const float *x, size_t n) { ops()->axpy(y, a, x, n); }

/* The attention row of type t (the faulty one for tests: kvt_kernels_fault). */
static const struct att_ops *att_row(kvt_row_type t)
{
    if (t == KVT_ROWS_Q8_0 && atomic_load_explicit(&kvt_kernels_fault, memory_order_relaxed) == KVT_KERNELS_FAULT_Q8_SCALE)
        t = (kvt_row_type)ATT_FAULT_Q8;
    return &ops()->att[(unsigned)t < ATT_FAULT_Q8 ? t : KVT_ROWS_DEFAULT];
}

void kvt_att_dots_rows(kvt_row_type t, float *out, size_t ldo, const float *q, size_t ldq, size_t nq, const void *k,
                       size_t ldk, size_t nk, size_t n, float scale)
{
    const struct att_ops *o = att_row(t);
    o->dots_rows(o, out, ldo, q, ldq, nq, k, ldk, nk, n, scale);
}

void kvt_att_axpys_rows(kvt_row_type t, float *y, size_t ldy, const float *a, size_t lda, size_t nq, const void *v,
                        size_t ldv, size_t nk, size_t n)
{
    const struct att_ops *o = att_row(t);
    o->axpys_rows(o, y, ldy, a, lda, nq, v, ldv, nk, n);
}

void kvt_att_dots_qs(kvt_row_type t, size_t nq, float *const *out, const float *const *q, const void *k, size_t ldk,
                     size_t nk, size_t n, float scale)
{
    const struct att_ops *o = att_row(t);
    o->dots_qs(o, nq, out, q, k, ldk, nk, n, scale);
}

void kvt_att_axpys_qs(kvt_row_type t, size_t nq, float *const *y, const float *const *a, const void *v, size_t ldv,
                      size_t nk, size_t n)
{
    const struct att_ops *o = att_row(t);
    o->axpys_qs(o, nq, y, a, v, ldv, nk, n);
}

void kvt_dots_rows(float *out, size_t ldo, const float *q, size_t ldq, size_t nq, const float *k, size_t ldk,
                   size_t nk, size_t n, float scale)
{
    kvt_att_dots_rows(KVT_ROWS_F32, out, ldo, q, ldq, nq, k, ldk * sizeof(float), nk, n, scale);
}

void kvt_axpys_rows(float *y, size_t ldy, const float *a, size_t lda, size_t nq, const float *v, size_t ldv, size_t nk,
                    size_t n)
{
    kvt_att_axpys_rows(KVT_ROWS_F32, y, ldy, a, lda, nq, v, ldv * sizeof(float), nk, n);
}

void kvt_dots_qs(size_t nq, float *const *out, const float *const *q, const float *k, size_t ldk, size_t nk, size_t n,
                 float scale)
{
    kvt_att_dots_qs(KVT_ROWS_F32, nq, out, q, k, ldk * sizeof(float), nk, n, scale);
}

void kvt_axpys_qs(size_t nq, float *const *y, const float *const *a, const float *v, size_t ldv, size_t nk, size_t n)
{
    kvt_att_axpys_qs(KVT_ROWS_F32, nq, y, a, v, ldv * sizeof(float), nk, n);
}

bool kvt_qs_shared(size_t n)
{
    size_t m = ops()->qs_shared;
    return m && n % m == 0;
}

void kvt_f16_row_to_f32(float *dst, const uint16_t *src, size_t n) { ops()->f16_to_f32(dst, src, n); }
void kvt_f32_row_to_f16(uint16_t *dst, const float *src, size_t n) { ops()->f32_to_f16(dst, src, n); }
void kvt_bf16_row_to_f32(float *dst, const uint16_t *src, size_t n) { ops()->bf16_to_f32(dst, src, n); }

/* ---- the kernels of each instruction set ---- */


static const struct f32_ops ops_scalar = {
    .dot = dot_scalar,
    .att = att_scalar,
    .axpy = axpy_scalar,
    .f16_to_f32 = f16_to_f32_scalar,
    .f32_to_f16 = f32_to_f16_scalar,
    .bf16_to_f32 = bf16_scalar,
    .expf1 = expf1_scalar,
    .swiglu = swiglu_scalar,
    .exp_row = exp_row_scalar,
    .div = div_scalar,
};

#ifdef KVT_HAVE_X86
static const struct mm_ops mm_avx2 = {
    .tile4 = tile4_fns,
    .row1 = {row1_f32_avx2, row1_f16_avx2, row1_bf16_avx2},
    .lanes_sum = lanes_sum_avx2,
    .lanes_sum8 = lanes_sum8_avx2,
};

static const struct mm_ops mm_avx512 = {
    .tile4 = tile4_fns,
    .tile8 = tile8_fns,
    .row1 = {row1_f32_avx2, row1_f16_avx2, row1_bf16_avx2},
    .lanes_sum = lanes_sum_avx2,
    .lanes_sum8 = lanes_sum8_avx2,
};

static const struct f32_ops ops_avx2 = {
    .dot = dot_avx2,
    .axpy = axpy_avx2,
    .att = att_avx2,
    .f16_to_f32 = f16_to_f32_f16c,
    .f32_to_f16 = f32_to_f16_f16c,
    .bf16_to_f32 = bf16_avx2,
    .expf1 = expf1_fma,
    .swiglu = swiglu_avx2,
    .exp_row = exp_row_avx2,
    .div = div_avx2,
    .mm = &mm_avx2,
};

static const struct f32_ops ops_avx512 = {
    .dot = dot_avx2,
    .axpy = axpy_avx2,
    .att = att_avx512,
    .qs_shared = 64,
    .f16_to_f32 = f16_to_f32_f16c,
    .f32_to_f16 = f32_to_f16_f16c,
    .bf16_to_f32 = bf16_avx2,
    .expf1 = expf1_fma,
    .swiglu = swiglu_avx512,
    .exp_row = exp_row_avx512,
    .div = div_avx2,
    .mm = &mm_avx512,
};
#endif

static const struct f32_ops *const isa_ops[KVT_ISA_COUNT] = {
#ifdef KVT_HAVE_X86
    [KVT_ISA_SCALAR] = &ops_scalar, [KVT_ISA_AVX2] = &ops_avx2, [KVT_ISA_AVX512] = &ops_avx512,
#else
    [KVT_ISA_SCALAR] = &ops_scalar, [KVT_ISA_AVX2] = &ops_scalar, [KVT_ISA_AVX512] = &ops_scalar,
#endif
};

static const struct f32_ops *ops(void) { return isa_ops[kvt_cpu_isa()]; }
