/* f32 kernels: dot products, matmul, norms, RoPE, softmax. See kernels.h for
 * the fixed-order contract. The AVX2 code is compiled with a target attribute
 * and chosen at run time, so one binary runs on any x86-64 (and elsewhere the
 * scalar path is the only one). */
#include "kernels.h"
#include "gguf.h"
#include "qkernels.h"
#include "quant.h"
#include "util.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVT_HAVE_X86 1
#endif

#define LANES 16

/* Fixed reduction tree over the 16 lanes. */
static inline float reduce16(float *l)
{
    for (int k = 0; k < 8; k++) l[k] += l[k + 8];
    for (int k = 0; k < 4; k++) l[k] += l[k + 4];
    l[0] += l[2];
    l[1] += l[3];
    return l[0] + l[1];
}

static float dot_scalar(const float *a, const float *b, size_t n)
{
    float l[LANES] = {0};
    for (size_t i = 0; i < n; i++) l[i % LANES] = fmaf(a[i], b[i], l[i % LANES]);
    return reduce16(l);
}

static void axpy_scalar(float *y, float a, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
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

__attribute__((target("avx2,fma"))) static float dot_avx2(const float *a, const float *b, size_t n)
{
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    if (i + 8 <= n) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        i += 8;
    }
    if (i == n) return reduce16_avx2(acc0, acc1);
    float l[LANES];
    _mm256_storeu_ps(l, acc0);
    _mm256_storeu_ps(l + 8, acc1);
    for (; i < n; i++) l[i % LANES] = fmaf(a[i], b[i], l[i % LANES]);
    return reduce16(l);
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

__attribute__((target("avx2,fma"))) static void axpy_avx2(float *y, float a, const float *x, size_t n)
{
    __m256 va = _mm256_set1_ps(a);
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

__attribute__((target("avx2,fma,f16c"))) static void f16_to_f32_f16c(float *dst, const uint16_t *src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = kvt_f16_to_f32(src[i]);
}

__attribute__((target("avx2,fma,f16c"))) static void f32_to_f16_f16c(uint16_t *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) dst[i] = kvt_f32_to_f16(src[i]);
}
#endif

#ifdef KVT_HAVE_X86
#include <cpuid.h>
/* AVX2, FMA and F16C from cpuid, with the OS's consent to the AVX state
 * (OSXSAVE, XCR0 bits 1-2). Read directly rather than through
 * __builtin_cpu_supports, whose feature strings differ between compilers
 * (clang 14 has no "f16c"). */
static int cpu_has_avx2_fma_f16c(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 6) != 6) return 0;
    bool fma = c >> 12 & 1, f16c = c >> 29 & 1;
    return fma && f16c && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b >> 5 & 1);
}
#endif

static int simd_state = -1; /* -1 unknown, 0 scalar, 1 avx2 */
static bool forced_scalar;

static bool use_simd(void)
{
    if (simd_state < 0) {
#ifdef KVT_HAVE_X86
        simd_state = cpu_has_avx2_fma_f16c();
#else
        simd_state = 0;
#endif
    }
    return simd_state && !forced_scalar;
}

bool kvt_kernels_force_scalar(bool on)
{
    bool old = forced_scalar;
    forced_scalar = on;
    return old;
}

bool kvt_kernels_simd(void) { return use_simd(); }

float kvt_dot(const float *a, const float *b, size_t n)
{
#ifdef KVT_HAVE_X86
    if (use_simd()) return dot_avx2(a, b, n);
#endif
    return dot_scalar(a, b, n);
}

void kvt_axpy(float *y, float a, const float *x, size_t n)
{
#ifdef KVT_HAVE_X86
    if (use_simd()) { axpy_avx2(y, a, x, n); return; }
#endif
    axpy_scalar(y, a, x, n);
}

void kvt_dots(float *out, const float *q, size_t ldq, size_t nq, const float *k, size_t n)
{
#ifdef KVT_HAVE_X86
    if (use_simd()) {
        for (size_t u = 0; u < nq; u++) out[u] = dot_avx2(q + u * ldq, k, n);
        return;
    }
#endif
    for (size_t u = 0; u < nq; u++) out[u] = dot_scalar(q + u * ldq, k, n);
}

#ifdef KVT_HAVE_X86
/* Up to four query heads against one key, n a multiple of 16: each dot
 * has dot_avx2's two accumulators and reduction; the key is loaded once
 * for all of them and their chains run side by side. */
__attribute__((target("avx2,fma"))) static void dots4_avx2(float *out, size_t ldo, const float *q, size_t ldq,
                                                          size_t nq, const float *k, size_t n, float scale)
{
    __m256 a[4][2];
    for (size_t u = 0; u < 4; u++) a[u][0] = a[u][1] = _mm256_setzero_ps();
    for (size_t i = 0; i < n; i += 16) {
        __m256 k0 = _mm256_loadu_ps(k + i), k1 = _mm256_loadu_ps(k + i + 8);
        for (size_t u = 0; u < nq; u++) {
            a[u][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + u * ldq + i), k0, a[u][0]);
            a[u][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + u * ldq + i + 8), k1, a[u][1]);
        }
    }
    for (size_t u = 0; u < nq; u++) out[u * ldo] = reduce16_avx2(a[u][0], a[u][1]) * scale;
}

/* y += a_j * v_j for j < nk in order, n a multiple of 8 up to 128: y held
 * in registers across the keys, each element one fma per key as in
 * axpy_avx2. */
__attribute__((target("avx2,fma"))) static void axpy_rows_avx2(float *y, const float *a, const float *v, size_t ldv,
                                                              size_t nk, size_t n)
{
    __m256 acc[16];
    size_t c = n / 8;
    for (size_t e = 0; e < c; e++) acc[e] = _mm256_loadu_ps(y + 8 * e);
    for (size_t j = 0; j < nk; j++, v += ldv) {
        __m256 va = _mm256_set1_ps(a[j]);
        for (size_t e = 0; e < c; e++) acc[e] = _mm256_fmadd_ps(va, _mm256_loadu_ps(v + 8 * e), acc[e]);
    }
    for (size_t e = 0; e < c; e++) _mm256_storeu_ps(y + 8 * e, acc[e]);
}
#endif

void kvt_dots_rows(float *out, size_t ldo, const float *q, size_t ldq, size_t nq, const float *k, size_t ldk,
                   size_t nk, size_t n, float scale)
{
#ifdef KVT_HAVE_X86
    if (use_simd() && n % 16 == 0) {
        for (size_t j = 0; j < nk; j++, k += ldk)
            for (size_t u0 = 0; u0 < nq; u0 += 4)
                dots4_avx2(out + u0 * ldo + j, ldo, q + u0 * ldq, ldq, nq - u0 < 4 ? nq - u0 : 4, k, n, scale);
        return;
    }
#endif
    for (size_t j = 0; j < nk; j++, k += ldk)
        for (size_t u = 0; u < nq; u++) {
            float d[1];
            kvt_dots(d, q + u * ldq, ldq, 1, k, n);
            out[u * ldo + j] = d[0] * scale;
        }
}

void kvt_axpys_rows(float *y, size_t ldy, const float *a, size_t lda, size_t nq, const float *v, size_t ldv, size_t nk,
                    size_t n)
{
#ifdef KVT_HAVE_X86
    if (use_simd() && n % 8 == 0 && n <= 128) {
        for (size_t u = 0; u < nq; u++) axpy_rows_avx2(y + u * ldy, a + u * lda, v, ldv, nk, n);
        return;
    }
#endif
    for (size_t j = 0; j < nk; j++, v += ldv) kvt_axpys(y, ldy, a + j, lda, nq, v, n);
}

void kvt_axpys(float *y, size_t ldy, const float *a, size_t lda, size_t nq, const float *v, size_t n)
{
#ifdef KVT_HAVE_X86
    if (use_simd()) {
        for (size_t u = 0; u < nq; u++) axpy_avx2(y + u * ldy, a[u * lda], v, n);
        return;
    }
#endif
    for (size_t u = 0; u < nq; u++) axpy_scalar(y + u * ldy, a[u * lda], v, n);
}

void kvt_f16_row_to_f32(float *dst, const uint16_t *src, size_t n)
{
#ifdef KVT_HAVE_X86
    if (use_simd()) { f16_to_f32_f16c(dst, src, n); return; }
#endif
    for (size_t i = 0; i < n; i++) dst[i] = kvt_f16_to_f32(src[i]);
}

void kvt_f32_row_to_f16(uint16_t *dst, const float *src, size_t n)
{
#ifdef KVT_HAVE_X86
    if (use_simd()) { f32_to_f16_f16c(dst, src, n); return; }
#endif
    for (size_t i = 0; i < n; i++) dst[i] = kvt_f32_to_f16(src[i]);
}

kvt_wmat kvt_wmat_f32(const float *W, size_t rows, size_t cols)
{
    return (kvt_wmat){(const uint8_t *)W, KVT_GGML_F32, rows, cols, cols * sizeof(float)};
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
    for (; i < n; i++) dst[i] = kvt_bf16_to_f32(src[i]);
}
#endif

static void bf16_row_to_f32(float *dst, const uint16_t *src, size_t n)
{
#ifdef KVT_HAVE_X86
    if (use_simd()) { bf16_avx2(dst, src, n); return; }
#endif
    for (size_t i = 0; i < n; i++) dst[i] = kvt_bf16_to_f32(src[i]);
}

#define SEG 512  /* elements of a weight row dequantised at a time: whole blocks of every type */
#define TOKS 96   /* tokens whose lanes one sweep over a segment carries */
#define TR 4      /* weight rows of a tile */
#define TT 3      /* tokens of a tile */

/* Lane state: lanes[r][t] are the 16 lanes of row r's dot product with
 * token t, each lane accumulating its elements (i % 16) in increasing i
 * with a fused multiply-add, so any tiling of the work gives the bits of
 * dot_avx2 / dot_scalar. */
typedef float lanes_t[LANES];

#ifdef KVT_HAVE_X86
/* One half (lanes h*8 .. h*8+7) of a 4-row x 3-token tile over w[r][0, len):
 * elements i with i % 16 in that half, i < full (a multiple of 16) plus, for
 * the low half, the 8 at full when tail8. Twelve accumulators, three token
 * vectors and one weight vector: the sixteen registers. */
__attribute__((target("avx2,fma"))) static inline void tile_half(lanes_t (*L)[TOKS], const float *const *w,
                                                                const float *x, size_t ldx, size_t full,
                                                                bool tail8, int h)
{
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx;
    __m256 a00 = _mm256_loadu_ps(L[0][0] + 8 * h), a01 = _mm256_loadu_ps(L[0][1] + 8 * h), a02 = _mm256_loadu_ps(L[0][2] + 8 * h);
    __m256 a10 = _mm256_loadu_ps(L[1][0] + 8 * h), a11 = _mm256_loadu_ps(L[1][1] + 8 * h), a12 = _mm256_loadu_ps(L[1][2] + 8 * h);
    __m256 a20 = _mm256_loadu_ps(L[2][0] + 8 * h), a21 = _mm256_loadu_ps(L[2][1] + 8 * h), a22 = _mm256_loadu_ps(L[2][2] + 8 * h);
    __m256 a30 = _mm256_loadu_ps(L[3][0] + 8 * h), a31 = _mm256_loadu_ps(L[3][1] + 8 * h), a32 = _mm256_loadu_ps(L[3][2] + 8 * h);
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    size_t end = full + (tail8 ? 16 : 0);
    for (size_t i = 8 * (size_t)h; i < end; i += 16) {
        __m256 v0 = _mm256_loadu_ps(x0 + i), v1 = _mm256_loadu_ps(x1 + i), v2 = _mm256_loadu_ps(x2 + i), wv;
        wv = _mm256_loadu_ps(w0 + i);
        a00 = _mm256_fmadd_ps(wv, v0, a00); a01 = _mm256_fmadd_ps(wv, v1, a01); a02 = _mm256_fmadd_ps(wv, v2, a02);
        wv = _mm256_loadu_ps(w1 + i);
        a10 = _mm256_fmadd_ps(wv, v0, a10); a11 = _mm256_fmadd_ps(wv, v1, a11); a12 = _mm256_fmadd_ps(wv, v2, a12);
        wv = _mm256_loadu_ps(w2 + i);
        a20 = _mm256_fmadd_ps(wv, v0, a20); a21 = _mm256_fmadd_ps(wv, v1, a21); a22 = _mm256_fmadd_ps(wv, v2, a22);
        wv = _mm256_loadu_ps(w3 + i);
        a30 = _mm256_fmadd_ps(wv, v0, a30); a31 = _mm256_fmadd_ps(wv, v1, a31); a32 = _mm256_fmadd_ps(wv, v2, a32);
    }
    _mm256_storeu_ps(L[0][0] + 8 * h, a00); _mm256_storeu_ps(L[0][1] + 8 * h, a01); _mm256_storeu_ps(L[0][2] + 8 * h, a02);
    _mm256_storeu_ps(L[1][0] + 8 * h, a10); _mm256_storeu_ps(L[1][1] + 8 * h, a11); _mm256_storeu_ps(L[1][2] + 8 * h, a12);
    _mm256_storeu_ps(L[2][0] + 8 * h, a20); _mm256_storeu_ps(L[2][1] + 8 * h, a21); _mm256_storeu_ps(L[2][2] + 8 * h, a22);
    _mm256_storeu_ps(L[3][0] + 8 * h, a30); _mm256_storeu_ps(L[3][1] + 8 * h, a31); _mm256_storeu_ps(L[3][2] + 8 * h, a32);
}

__attribute__((target("avx2,fma"))) static void tile_avx2(lanes_t (*L)[TOKS], const float *const *w, const float *x,
                                                         size_t ldx, size_t len)
{
    size_t full = len / 16 * 16;
    bool tail8 = len - full >= 8;
    tile_half(L, w, x, ldx, full, tail8, 0);
    tile_half(L, w, x, ldx, full, false, 1);
    for (size_t j = full + (tail8 ? 8 : 0); j < len; j++)
        for (int r = 0; r < TR; r++)
            for (int t = 0; t < TT; t++) L[r][t][j % LANES] = fmaf(w[r][j], x[t * ldx + j], L[r][t][j % LANES]);
}
#endif

/* Four rows against one token (decode): eight accumulators, the order of
 * dot_avx2 per row. */
__attribute__((target("avx2,fma"))) static void tile4x1_avx2(lanes_t (*L)[TOKS], const float *const *w,
                                                            const float *x, size_t len)
{
    __m256 a0 = _mm256_loadu_ps(L[0][0]), b0 = _mm256_loadu_ps(L[0][0] + 8);
    __m256 a1 = _mm256_loadu_ps(L[1][0]), b1 = _mm256_loadu_ps(L[1][0] + 8);
    __m256 a2 = _mm256_loadu_ps(L[2][0]), b2 = _mm256_loadu_ps(L[2][0] + 8);
    __m256 a3 = _mm256_loadu_ps(L[3][0]), b3 = _mm256_loadu_ps(L[3][0] + 8);
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    size_t i = 0;
    for (; i + 16 <= len; i += 16) {
        __m256 xl = _mm256_loadu_ps(x + i), xh = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xl, a0);
        b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i + 8), xh, b0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), xl, a1);
        b1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i + 8), xh, b1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), xl, a2);
        b2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i + 8), xh, b2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), xl, a3);
        b3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i + 8), xh, b3);
    }
    _mm256_storeu_ps(L[0][0], a0); _mm256_storeu_ps(L[0][0] + 8, b0);
    _mm256_storeu_ps(L[1][0], a1); _mm256_storeu_ps(L[1][0] + 8, b1);
    _mm256_storeu_ps(L[2][0], a2); _mm256_storeu_ps(L[2][0] + 8, b2);
    _mm256_storeu_ps(L[3][0], a3); _mm256_storeu_ps(L[3][0] + 8, b3);
    /* the tail (an 8 and single elements) as dot_avx2 takes it */
    for (int r = 0; r < TR; r++) lanes1_avx2(L[r][0] , w[r] + i, x + i, len - i);
}

/* One binary16 row against one token, converted in registers (F16C is
 * exact): the order of dot_avx2. */
__attribute__((target("avx2,fma,f16c"))) static void row1_f16_avx2(float *l, const uint16_t *w, const float *x,
                                                                  size_t len)
{
    __m256 a = _mm256_loadu_ps(l), b = _mm256_loadu_ps(l + 8);
    size_t i = 0;
    for (; i + 16 <= len; i += 16) {
        a = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i))), _mm256_loadu_ps(x + i), a);
        b = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i + 8))), _mm256_loadu_ps(x + i + 8),
                            b);
    }
    _mm256_storeu_ps(l, a);
    _mm256_storeu_ps(l + 8, b);
    float t[16];
    f16_to_f32_f16c(t, w + i, len - i);
    lanes1_avx2(l, t, x + i, len - i); /* the tail (an 8 and single elements) as dot_avx2 takes it */
}

/* Rows [0, nr) x tokens [0, nt) of the lanes over w[r][0, len) and the
 * tokens' x (ldx apart). */
static void lanes_run(lanes_t (*L)[TOKS], const float *const *w, size_t nr, const float *x, size_t ldx, size_t nt,
                      size_t len, bool simd)
{
    size_t t = 0;
#ifdef KVT_HAVE_X86
    if (simd) {
        if (nr == TR) {
            for (; t + TT <= nt; t += TT) {
                lanes_t(*Lt)[TOKS] = (lanes_t(*)[TOKS])(&L[0][t]);
                tile_avx2(Lt, w, x + t * ldx, ldx, len);
            }
            for (; t < nt; t++) {
                lanes_t(*Lt)[TOKS] = (lanes_t(*)[TOKS])(&L[0][t]);
                tile4x1_avx2(Lt, w, x + t * ldx, len);
            }
        }
        for (; t < nt; t++)
            for (size_t r = 0; r < nr; r++) lanes1_avx2(L[r][t], w[r], x + t * ldx, len);
    }
#else
    (void)simd;
#endif
    for (; t < nt; t++) {
        const float *xt = x + t * ldx;
        for (size_t r = 0; r < nr; r++)
            for (size_t i = 0; i < len; i++) L[r][t][i % LANES] = fmaf(w[r][i], xt[i], L[r][t][i % LANES]);
    }
}

struct mm_ctx { float *y; const kvt_wmat *W; const float *x; size_t n; bool simd; };

static void mm_range(void *arg, size_t o0, size_t o1)
{
    struct mm_ctx *c = arg;
    const kvt_wmat *W = c->W;
    size_t d_in = W->cols, d_out = W->rows, blk = 1, blk_bytes = 4;
    bool f32 = W->type == KVT_GGML_F32;
    if (!f32) kvt_quant_block(W->type, &blk, &blk_bytes);
    static _Thread_local float wseg[TR][SEG] __attribute__((aligned(32)));
    static _Thread_local lanes_t lanes[TR][TOKS];
    for (size_t o = o0; o < o1; o += TR) {
        size_t nr = o1 - o < TR ? o1 - o : TR;
        for (size_t t0 = 0; t0 < c->n; t0 += TOKS) {
            size_t nt = c->n - t0 < TOKS ? c->n - t0 : TOKS;
            for (size_t r = 0; r < nr; r++) memset(lanes[r], 0, nt * sizeof(lanes_t));
#ifdef KVT_HAVE_X86
            if (c->simd && (W->type == KVT_GGML_F16 || f32) && nt < TT) {
                /* decode: each row whole (binary16 straight into
                 * registers), one row after the other. One stream through
                 * memory: rows read four side by side, or in segments,
                 * ran at a third of the read bandwidth (8.5 against 19 to
                 * 24 GB/s on a 2048 x 768 F16 matrix out of the cache). */
                for (size_t r = 0; r < nr; r++) {
                    const uint8_t *row = W->data + (o + r) * W->row_bytes;
                    for (size_t t = 0; t < nt; t++) {
                        const float *xt = c->x + (t0 + t) * d_in;
                        if (f32) lanes1_avx2(lanes[r][t], (const float *)row, xt, d_in);
                        else row1_f16_avx2(lanes[r][t], (const uint16_t *)row, xt, d_in);
                    }
                }
            } else
#endif
            for (size_t k = 0; k < d_in; k += SEG) {
                size_t len = d_in - k < SEG ? d_in - k : SEG;
                const float *w[TR];
                for (size_t r = 0; r < nr; r++) {
                    const uint8_t *row = W->data + (o + r) * W->row_bytes;
                    w[r] = (const float *)row + k;
                    if (f32) continue;
                    const uint8_t *src = row + k / blk * blk_bytes;
                    if (W->type == KVT_GGML_F16) kvt_f16_row_to_f32(wseg[r], (const uint16_t *)src, len);
                    else if (W->type == KVT_GGML_BF16) bf16_row_to_f32(wseg[r], (const uint16_t *)src, len);
                    else kvt_quant_to_f32(W->type, src, wseg[r], len);
                    w[r] = wseg[r];
                }
                lanes_run(lanes, w, nr, c->x + t0 * d_in + k, d_in, nt, len, c->simd);
            }
            for (size_t r = 0; r < nr; r++)
                for (size_t t = 0; t < nt; t++) {
                    float *l = lanes[r][t];
#ifdef KVT_HAVE_X86
                    if (c->simd) {
                        c->y[(t0 + t) * d_out + o + r] = lanes_sum_avx2(l);
                        continue;
                    }
#endif
                    c->y[(t0 + t) * d_out + o + r] = reduce16(l);
                }
        }
    }
}

void kvt_matmul_w(kvt_pool *pool, float *y, const kvt_wmat *W, const float *x, size_t n, uint8_t *qx)
{
    if (kvt_q_supported(W->type)) {
        kvt_q_matmul(pool, y, W, x, n, qx);
        return;
    }
    struct mm_ctx c = {y, W, x, n, use_simd()};
    size_t per_out = n * W->cols;
    size_t min = per_out ? (32768 + per_out - 1) / per_out : W->rows;
    kvt_pool_for(pool, W->rows, min, mm_range, &c);
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
void kvt_rope_inv(float *v, size_t n_rot, size_t pos, float base) { rope_dir(v, n_rot, pos, base, -1.0f); }

void kvt_softmax(float *x, size_t n)
{
    if (!n) return;
    float m = x[0];
    for (size_t i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    float sum = 0;
    for (size_t i = 0; i < n; i++) { x[i] = expf(x[i] - m); sum += x[i]; }
    for (size_t i = 0; i < n; i++) x[i] /= sum;
}
