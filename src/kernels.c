/* f32 kernels: dot products, matmul, norms, RoPE, softmax. See kernels.h for
 * the fixed-order contract. The AVX2 code is compiled with a target attribute
 * and chosen at run time, so one binary runs on any x86-64 (and elsewhere the
 * scalar path is the only one). */
#include "kernels.h"
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
    float l[LANES];
    _mm256_storeu_ps(l, acc0);
    _mm256_storeu_ps(l + 8, acc1);
    for (; i < n; i++) l[i % LANES] = fmaf(a[i], b[i], l[i % LANES]);
    return reduce16(l);
}

/* Four dot products sharing one row of W: each uses exactly dot_avx2's order. */
__attribute__((target("avx2,fma"))) static void dot4_avx2(const float *w, const float *x0,
                                                          const float *x1, const float *x2,
                                                          const float *x3, size_t n, float *out)
{
    __m256 a0 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps();
    __m256 a1 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps();
    __m256 a3 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 wl = _mm256_loadu_ps(w + i), wh = _mm256_loadu_ps(w + i + 8);
        a0 = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x0 + i), a0);
        b0 = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x0 + i + 8), b0);
        a1 = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x1 + i), a1);
        b1 = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x1 + i + 8), b1);
        a2 = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x2 + i), a2);
        b2 = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x2 + i + 8), b2);
        a3 = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x3 + i), a3);
        b3 = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x3 + i + 8), b3);
    }
    if (i + 8 <= n) {
        __m256 wl = _mm256_loadu_ps(w + i);
        a0 = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x0 + i), a0);
        a1 = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x1 + i), a1);
        a2 = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x2 + i), a2);
        a3 = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x3 + i), a3);
        i += 8;
    }
    const float *xs[4] = {x0, x1, x2, x3};
    __m256 lo[4] = {a0, a1, a2, a3}, hi[4] = {b0, b1, b2, b3};
    for (int r = 0; r < 4; r++) {
        float l[LANES];
        _mm256_storeu_ps(l, lo[r]);
        _mm256_storeu_ps(l + 8, hi[r]);
        for (size_t j = i; j < n; j++) l[j % LANES] = fmaf(w[j], xs[r][j], l[j % LANES]);
        out[r] = reduce16(l);
    }
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

struct mm_ctx { float *y; const float *W, *x; size_t n, d_in, d_out; };

static void mm_range(void *arg, size_t o0, size_t o1)
{
    struct mm_ctx *c = arg;
    size_t d_in = c->d_in, d_out = c->d_out;
    for (size_t o = o0; o < o1; o++) {
        const float *w = c->W + o * d_in;
        size_t i = 0;
#ifdef KVT_HAVE_X86
        if (use_simd()) {
            float r[4];
            for (; i + 4 <= c->n; i += 4) {
                const float *x = c->x + i * d_in;
                dot4_avx2(w, x, x + d_in, x + 2 * d_in, x + 3 * d_in, d_in, r);
                for (int k = 0; k < 4; k++) c->y[(i + k) * d_out + o] = r[k];
            }
        }
#endif
        for (; i < c->n; i++) c->y[i * d_out + o] = kvt_dot(w, c->x + i * d_in, d_in);
    }
}

void kvt_matmul(kvt_pool *pool, float *y, const float *W, const float *x,
                size_t n, size_t d_in, size_t d_out)
{
    struct mm_ctx c = {y, W, x, n, d_in, d_out};
    size_t per_out = n * d_in;
    size_t min = per_out ? (32768 + per_out - 1) / per_out : d_out;
    kvt_pool_for(pool, d_out, min, mm_range, &c);
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
