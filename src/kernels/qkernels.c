/* Integer kernels for quantised weights (qkernels.h has the contract).
 *
 * Activations, per token (kvt_q_act_bytes): the f32 scales of its nb
 * blocks (each the f16-rounded amax / 127, as ggml stores it), then
 * nb * 32 int8 values, round(x / d) with ties to even, in [-127, 127].
 *
 * For the 256-element types (Q2_K .. Q6_K, IQ4_XS, the IQ1/IQ2/IQ3 and
 * the TQ types), per token: the f32 scales of its nsb
 * superblocks of 256 (1 / iscale, iscale = -127 / the value of largest
 * magnitude, as ggml's Q8_K), then nsb * 16 int16 sums of 16 values, then
 * nsb * 256 int8 values.
 *
 * Weights of 32 elements (Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4, Q4_1, Q5_1) are
 * unpacked a block at a time into int8 values (Q4_0: nibble - 8; Q5_0: the
 * 5-bit q - 16; IQ4_NL and MXFP4: ggml's value tables, the MXFP4 scale
 * halved for its doubled table, as quant.c; Q4_1 and Q5_1: the unsigned
 * nibble or 5-bit q) and take the Q8_0 scheme above. Q4_1 and Q5_1 add
 * their block minimum m_w: sum_i (d_w q_i + m_w) d_x x_i =
 * d_w d_x sum q_i x_i + m_w d_x sum x_i, so each lane j also takes the exact
 * integer sum sx_j of its 4 activation values and, after its product term,
 * l_j = fma(m_w * d_x, sx_j, l_j). m_w is an f16 and d_x an f16-rounded
 * f32, so m_w * d_x is exact in f32 like d_w * d_x. The activations are the
 * same as for every 32-element type (llama.cpp's Q8_1 instead stores
 * d_x * sum x_i rounded to f16).
 *
 * Weights are the GGUF's blocks as they are (quant.h spells out each
 * layout). A K-quant superblock's dot product is two exact integers, the
 * scaled sums and the min (or offset) correction, so any order of the
 * integer work gives the same bits; the floats are then, per superblock in
 * increasing order, acc = fma(d_w * d_x, isum, acc) and, for Q4_K and Q5_K,
 * acc = fma(-(dmin_w * d_x), msum, acc).
 *
 * Each instruction set has one static const row of kernels (struct q_ops,
 * at the end of the file), chosen by kernels/cpu.h; the code below calls
 * through it and tests no CPU feature itself. The low-bit types (Q2_K,
 * Q3_K, the i-quants, TQ1_0, TQ2_0) take the Q8_K activations quantised
 * here and run in qlowbit.c. */
#include "kernels/qkernels.h"
#include "format/gguf.h"
#include "format/iqgrid.h"
#include "format/quant.h"
#include "kernels/cpu.h"
#include "kernels/q8k.h"
#include "kernels/qlowbit.h"
#include "base/util.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVT_HAVE_X86 1
#endif

#define QK 32

#define QKK KVT_Q8K_N
#define KT 8 /* the most tokens a K-quant row takes at once (prefill) */
#define Q4K_BYTES 144
#define Q6K_BYTES 210
#define Q5K_BYTES 176
#define IQ4XS_BYTES 136

struct q8_tiles;
struct qk_ops;
/* The kernels of one instruction set. */
struct q_ops {
    float (*quant_block)(const float *x, int8_t *q);                    /* 32 activations (Q8_0) */
    float (*quant_k_block)(const float *x, int8_t *q, int16_t *bsums); /* 256 activations (Q8_K) */
    const struct q8_tiles *q8; /* the 32-element types' tiles, one row per type; NULL: q8_scalar */
    const struct qk_ops *qk;   /* the K-quants' SIMD kernels; NULL: the scalar loops */
};
/* The row of the instruction set in use (kvt_cpu_isa). */
static const struct q_ops *ops(void);

/* The 32-element weight types on the Q8_0 lane scheme: each block gives
 * int8 values (in [-127, 127]), an exact f32 scale and, for Q4_1 and Q5_1,
 * an exact f32 minimum. */
static bool b32_type(uint32_t wtype)
{
    return wtype == KVT_GGML_Q8_0 || wtype == KVT_GGML_Q4_0 || wtype == KVT_GGML_Q5_0 || wtype == KVT_GGML_IQ4_NL ||
           wtype == KVT_GGML_MXFP4 || wtype == KVT_GGML_Q4_1 || wtype == KVT_GGML_Q5_1;
}

/* The types with a block minimum (d * q + m). */
static inline bool b32_min(uint32_t wtype) { return wtype == KVT_GGML_Q4_1 || wtype == KVT_GGML_Q5_1; }

static bool k_type(uint32_t wtype)
{
    return wtype == KVT_GGML_Q4_K || wtype == KVT_GGML_Q5_K || wtype == KVT_GGML_Q6_K || wtype == KVT_GGML_IQ4_XS;
}

bool kvt_q_supported(uint32_t wtype)
{
    return b32_type(wtype) || k_type(wtype) || kvt_qlowbit_supported(wtype);
}


/* The types whose activations are Q8_K superblocks (the others': Q8_0). */
static bool q8k_act(uint32_t wtype) { return k_type(wtype) || kvt_qlowbit_supported(wtype); }

static size_t act_stride(size_t cols) { return cols / QK * (sizeof(float) + QK); }
static size_t act_stride_k(size_t cols) { return kvt_q8k_stride(cols); }

size_t kvt_q_act_bytes(uint32_t wtype, size_t n, size_t cols)
{
    size_t b;
    if (!kvt_q_supported(wtype) || cols % (q8k_act(wtype) ? QKK : QK) ||
        !kvt_mul_ok(n, q8k_act(wtype) ? act_stride_k(cols) : act_stride(cols), &b))
        return 0;
    return b;
}

/* ---- activations ---- */

static inline float max_nan_as_simd(float a, float b) { return a > b ? a : b; } /* _mm256_max_ps(a, b) */

/* One block of 32: the scale and the int8 values. The largest magnitude
 * goes through the lane tree the SIMD path uses (lane j: x[j], x[j+8],
 * x[j+16], x[j+24]; then 4, 2, 1), so NaNs land alike. */
static float quant_block_scalar(const float *x, int8_t *q)
{
    float l[8];
    for (int j = 0; j < 8; j++) {
        float m = fabsf(x[j]);
        for (int k = 1; k < 4; k++) m = max_nan_as_simd(fabsf(x[j + 8 * k]), m);
        l[j] = m;
    }
    for (int j = 0; j < 4; j++) l[j] = max_nan_as_simd(l[j + 4], l[j]);
    for (int j = 0; j < 2; j++) l[j] = max_nan_as_simd(l[j + 2], l[j]);
    float amax = max_nan_as_simd(l[1], l[0]);
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < QK; j++) {
        float v = nearbyintf(x[j] * id);
        q[j] = v != v ? 0 : (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v); /* NaN: 0 */
    }
    return kvt_f16_to_f32(kvt_f32_to_f16(d));
}

#ifdef KVT_HAVE_X86
__attribute__((target("avx2,fma,f16c"))) static float quant_block_avx2(const float *x, int8_t *q)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
           v3 = _mm256_loadu_ps(x + 24);
    __m256 m = _mm256_andnot_ps(sign, v0);
    m = _mm256_max_ps(_mm256_andnot_ps(sign, v1), m);
    m = _mm256_max_ps(_mm256_andnot_ps(sign, v2), m);
    m = _mm256_max_ps(_mm256_andnot_ps(sign, v3), m);
    float l[8];
    _mm256_storeu_ps(l, m);
    for (int j = 0; j < 4; j++) l[j] = max_nan_as_simd(l[j + 4], l[j]);
    for (int j = 0; j < 2; j++) l[j] = max_nan_as_simd(l[j + 2], l[j]);
    float amax = max_nan_as_simd(l[1], l[0]);
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    __m256i i[4];
    const __m256 v[4] = {v0, v1, v2, v3};
    for (int k = 0; k < 4; k++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(v[k], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        /* min/max as the scalar clamp; a NaN lane becomes 0 below */
        __m256 ok = _mm256_cmp_ps(r, r, _CMP_ORD_Q);
        r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
        i[k] = _mm256_and_si256(_mm256_cvtps_epi32(r), _mm256_castps_si256(ok));
    }
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
    return _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
}
#endif

struct qa_ctx { const float *x; uint8_t *qx; size_t cols; const struct q_ops *k; };

static void quant_range(void *arg, size_t t0, size_t t1)
{
    struct qa_ctx *c = arg;
    size_t nb = c->cols / QK;
    for (size_t t = t0; t < t1; t++) {
        const float *x = c->x + t * c->cols;
        uint8_t *base = c->qx + t * act_stride(c->cols);
        float *d = (float *)base;
        int8_t *q = (int8_t *)(base + nb * sizeof(float));
        for (size_t b = 0; b < nb; b++) d[b] = c->k->quant_block(x + QK * b, q + QK * b);
    }
}

/* One superblock of 256 as ggml's Q8_K: iscale = -127 / the value of
 * largest magnitude (the first of equals), q = round(iscale * x) with ties
 * to even, at most 127; d = 1 / iscale; bsums of 16. NaN values become 0. */
static float quant_k_block(const float *x, int8_t *q, int16_t *bsums)
{
    float amax = 0, max = 0;
    for (int j = 0; j < QKK; j++) {
        float ax = fabsf(x[j]);
        if (ax > amax) { amax = ax; max = x[j]; }
    }
    if (amax == 0) {
        memset(q, 0, QKK);
        memset(bsums, 0, 16 * sizeof *bsums);
        return 0;
    }
    float iscale = -127.0f / max;
    for (int j = 0; j < QKK; j++) {
        float v = nearbyintf(iscale * x[j]);
        q[j] = v != v ? 0 : (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
    }
    for (int g = 0; g < 16; g++) {
        int s = 0;
        for (int j = 0; j < 16; j++) s += q[16 * g + j];
        bsums[g] = (int16_t)s;
    }
    return 1.0f / iscale;
}

#ifdef KVT_HAVE_X86
/* quant_k_block, eight lanes at a time: the same largest magnitude (max
 * ignores NaN as the scalar comparison does), the first element of it, the
 * same products, rounding (ties to even), clamp and NaN rule. */
__attribute__((target("avx2,fma,f16c"))) static float quant_k_block_avx2(const float *x, int8_t *q, int16_t *bsums)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < QKK; j += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), m);
    float l[8];
    _mm256_storeu_ps(l, m);
    float amax = 0;
    for (int j = 0; j < 8; j++) amax = l[j] > amax ? l[j] : amax;
    if (amax == 0) {
        memset(q, 0, QKK);
        memset(bsums, 0, 16 * sizeof *bsums);
        return 0;
    }
    const __m256 va = _mm256_set1_ps(amax);
    int first = 0;
    for (int j = 0; j < QKK; j += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), va, _CMP_EQ_OQ));
        if (mask) { first = j + __builtin_ctz((unsigned)mask); break; }
    }
    float iscale = -127.0f / x[first];
    const __m256 vis = _mm256_set1_ps(iscale), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (int j = 0; j < QKK; j += 32) {
        __m256i i[4];
        for (int k = 0; k < 4; k++) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(vis, _mm256_loadu_ps(x + j + 8 * k)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m256 ok = _mm256_cmp_ps(r, r, _CMP_ORD_Q);
            r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
            i[k] = _mm256_and_si256(_mm256_cvtps_epi32(r), _mm256_castps_si256(ok));
        }
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + j), p);
    }
    for (int g = 0; g < 16; g++) {
        int s = 0;
        for (int j = 0; j < 16; j++) s += q[16 * g + j];
        bsums[g] = (int16_t)s;
    }
    return 1.0f / iscale;
}
#endif

static void quant_k_range(void *arg, size_t t0, size_t t1)
{
    struct qa_ctx *c = arg;
    size_t nsb = c->cols / QKK;
    for (size_t t = t0; t < t1; t++) {
        const float *x = c->x + t * c->cols;
        uint8_t *base = c->qx + t * act_stride_k(c->cols);
        float *d = (float *)base;
        int16_t *bs = (int16_t *)(base + nsb * sizeof(float));
        int8_t *q = (int8_t *)(base + nsb * (sizeof(float) + 16 * sizeof(int16_t)));
        for (size_t b = 0; b < nsb; b++) d[b] = c->k->quant_k_block(x + QKK * b, q + QKK * b, bs + 16 * b);
    }
}

/* A token's Q8_K activations. */
typedef kvt_q8k kact;

/* The K-quant SIMD kernels (kernels of one row against T tokens, of four
 * rows, of four packed rows), by type: Q4_K, Q5_K, Q6_K, IQ4_XS (kq). */
typedef void (*qk_row_fn)(const uint8_t *row, size_t nsb, const kact *a, float *acc);
typedef void (*qk_rows4_fn)(const uint8_t *row, size_t row_bytes, size_t nsb, const kact *a, float *out);
typedef void (*p4_fn)(const uint8_t *x, size_t nsb, const kact *a, float *out, size_t ldo);
struct q6k_x4;
typedef void (*q6x4_fn)(const struct q6k_x4 *x, size_t nsb, const kact *a, float *out, size_t ldo);
struct qk_ops {
    qk_row_fn row[4][3];  /* [kq][8, 4, 1 tokens] */
    qk_rows4_fn rows4[4]; /* [kq]: decode, four adjacent rows a call */
    p4_fn p4[2][3];       /* packed Q4_K, Q5_K [q5][8, 4, 1 tokens]; [q5][0] NULL: four at most */
    q6x4_fn q6x4[2];      /* four Q6_K rows packed on the stack against [8, 4] tokens */
    /* four Q4_K or Q5_K rows into a p4 group (p4_pack's bytes) */
    void (*pack)(bool q5, const uint8_t *row, size_t row_bytes, size_t nsb, uint8_t *x);
};

static int kq(uint32_t ty)
{
    return ty == KVT_GGML_Q4_K ? 0 : ty == KVT_GGML_Q5_K ? 1 : ty == KVT_GGML_Q6_K ? 2 : 3;
}

static kact kact_at(const uint8_t *qx, size_t t, size_t cols) { return kvt_q8k_at(qx, t, cols); }

/* ggml's get_scale_min_k4: sub-block i's 6-bit scale and min. */
static inline void k4_scale_min(const uint8_t *s, int i, int *sc, int *mn)
{
    if (i < 4) {
        *sc = s[i] & 63;
        *mn = s[i + 4] & 63;
    } else {
        *sc = (s[i + 4] & 15) | (s[i - 4] >> 6) << 4;
        *mn = (s[i + 4] >> 4) | (s[i] >> 6) << 4;
    }
}

/* ---- dot products ---- */

static inline float hsum8(float *l)
{
    for (int k = 0; k < 4; k++) l[k] += l[k + 4];
    l[0] += l[2];
    l[1] += l[3];
    return l[0] + l[1];
}

/* ggml-common.h's value tables (data): iq4_nl's 16 levels and E2M1 x 2. */
static const int8_t iq4nl_levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t e2m1_x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static size_t b32_bytes(uint32_t t)
{
    return t == KVT_GGML_Q8_0 ? 34 : t == KVT_GGML_MXFP4 ? 17 : t == KVT_GGML_Q4_1 ? 20 : t == KVT_GGML_Q5_0 ? 22
         : t == KVT_GGML_Q5_1 ? 24 : 18;
}

/* Where a block's nibbles start, and its u32 of fifth bits (Q5_0, Q5_1). */
static inline size_t b32_qs_at(uint32_t t)
{
    return t == KVT_GGML_MXFP4 ? 1 : t == KVT_GGML_Q4_1 ? 4 : t == KVT_GGML_Q5_0 ? 6 : t == KVT_GGML_Q5_1 ? 8 : 2;
}
static inline bool b32_q5(uint32_t t) { return t == KVT_GGML_Q5_0 || t == KVT_GGML_Q5_1; }
static inline size_t b32_qh_at(uint32_t t) { return t == KVT_GGML_Q5_0 ? 2 : 4; }

/* A block's scale, exactly as quant.c dequantises it. */
static inline float b32_scale(uint32_t t, const uint8_t *wb)
{
    return t == KVT_GGML_MXFP4 ? ldexpf(1.0f, (int)wb[0] - 128) : kvt_f16_to_f32(kvt_rd16(wb));
}

/* A block's 32 int8 values: element j < 16 in the low nibble of byte j,
 * j + 16 in its high nibble, and for Q5_0 and Q5_1 bit j of qh as element
 * j's fifth bit (q8_0: the bytes themselves). */
static inline void b32_values(uint32_t t, const uint8_t *wb, int8_t *q)
{
    if (t == KVT_GGML_Q8_0) { memcpy(q, wb + 2, 32); return; }
    const uint8_t *qs = wb + b32_qs_at(t);
    uint32_t qh = b32_q5(t) ? kvt_rd32(wb + b32_qh_at(t)) : 0;
    for (int j = 0; j < 16; j++) {
        int lo = qs[j] & 15, hi = qs[j] >> 4;
        int lo5 = lo | (int)(qh >> j & 1) << 4, hi5 = hi | (int)(qh >> (j + 16) & 1) << 4;
        if (t == KVT_GGML_Q4_0) q[j] = (int8_t)(lo - 8), q[j + 16] = (int8_t)(hi - 8);
        else if (t == KVT_GGML_Q5_0) q[j] = (int8_t)(lo5 - 16), q[j + 16] = (int8_t)(hi5 - 16);
        else if (t == KVT_GGML_Q4_1) q[j] = (int8_t)lo, q[j + 16] = (int8_t)hi;
        else if (t == KVT_GGML_Q5_1) q[j] = (int8_t)lo5, q[j + 16] = (int8_t)hi5;
        else if (t == KVT_GGML_IQ4_NL) q[j] = iq4nl_levels[lo], q[j + 16] = iq4nl_levels[hi];
        else q[j] = e2m1_x2[lo], q[j + 16] = e2m1_x2[hi];
    }
}

/* Rows w[0, R) against tokens (d, q)[0, T) over nb blocks, out[t * ldo + r]. */
typedef void (*q8_tile_fn)(const uint8_t *const *w, const float *const *dx, const int8_t *const *qx, size_t nb,
                           float *out, size_t ldo);
/* A 32-element type's tiles: 2 rows x 4 tokens, 1 x 1, and 2 x 8 (or NULL). */
struct q8_tiles { uint32_t wt; q8_tile_fn t2x4, t1x1, t2x8; };

/* Rows w[0, R) against tokens (d, q)[0, T) over nb blocks. */
static void q8_scalar(uint32_t wt, int R, int T, const uint8_t *const *w, const float *const *dx, const int8_t *const *qx,
                      size_t nb, float *out, size_t ldo)
{
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            float l[8] = {0};
            size_t bb = b32_bytes(wt);
            for (size_t b = 0; b < nb; b++) {
                const uint8_t *wb = w[r] + b * bb;
                int8_t wq[32];
                b32_values(wt, wb, wq);
                const int8_t *xq = qx[t] + b * QK;
                float s = b32_scale(wt, wb) * dx[t][b];
                float sm = b32_min(wt) ? kvt_f16_to_f32(kvt_rd16(wb + 2)) * dx[t][b] : 0;
                for (int j = 0; j < 8; j++) {
                    int32_t p = 0, sx = 0;
                    for (int k = 0; k < 4; k++) p += (int32_t)wq[4 * j + k] * xq[4 * j + k];
                    l[j] = fmaf(s, (float)p, l[j]);
                    if (b32_min(wt)) {
                        for (int k = 0; k < 4; k++) sx += xq[4 * j + k];
                        l[j] = fmaf(sm, (float)sx, l[j]);
                    }
                }
            }
            out[(size_t)t * ldo + (size_t)r] = hsum8(l);
        }
}

#ifdef KVT_HAVE_X86
/* A 32-block's values as bytes: signed, or unsigned for the types with a
 * min (b32_values). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256i b32_vals_avx2(const uint32_t wt,
                                                                                     const uint8_t *wb)
{
    if (wt == KVT_GGML_Q8_0) return _mm256_loadu_si256((const __m256i *)(wb + 2));
    __m128i v = _mm_loadu_si128((const __m128i *)(wb + b32_qs_at(wt)));
    const __m128i m4 = _mm_set1_epi8(15);
    __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
    if (b32_q5(wt)) {
        /* byte j of qh's broadcast picks byte j / 8 of qh, and every bit
         * but j % 8 is set, so byte j is all ones iff bit j is set; its
         * 0x10 is element j's fifth bit */
        uint32_t qh = kvt_rd32(wb + b32_qh_at(wt));
        const __m256i pick = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101,
                                               0x0000000000000000);
        __m256i hb = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), pick);
        hb = _mm256_or_si256(hb, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
        hb = _mm256_cmpeq_epi8(hb, _mm256_set1_epi64x(-1));
        nib = _mm256_or_si256(nib, _mm256_and_si256(hb, _mm256_set1_epi8(16)));
    }
    if (wt == KVT_GGML_Q4_0) return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
    if (wt == KVT_GGML_Q5_0) return _mm256_sub_epi8(nib, _mm256_set1_epi8(16));
    if (b32_min(wt)) return nib;
    __m128i tab = _mm_loadu_si128((const __m128i *)(wt == KVT_GGML_IQ4_NL ? iq4nl_levels : e2m1_x2));
    return _mm256_shuffle_epi8(_mm256_set_m128i(tab, tab), nib);
}

/* The R x T tile (R, T constants after inlining). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
q8_tile_avx2(const uint32_t wt, const int R, const int T, const uint8_t *const *w, const float *const *dx, const int8_t *const *qx,
             size_t nb, float *out, size_t ldo)
{
    __m256 acc[4][4];
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1), ones8 = _mm256_set1_epi8(1);
    const bool mins = b32_min(wt);
    for (size_t b = 0; b < nb; b++) {
        __m256i wv[4], aw[4];
        __m256 dw[4], mw[4];
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
            const uint8_t *wb = w[r] + b * b32_bytes(wt);
            if (R == 1 && T == 1) _mm_prefetch((const char *)(wb + KVT_PF_AHEAD), _MM_HINT_T0); /* decode */
            wv[r] = b32_vals_avx2(wt, wb);
            /* unsigned values go to maddubs as they are; signed ones as
             * |w| against x carrying w's sign */
            aw[r] = mins ? wv[r] : _mm256_sign_epi8(wv[r], wv[r]);
            /* the scales, broadcast: d_w * d_x below is the scalar path's
             * one multiply, lane by lane */
            dw[r] = wt == KVT_GGML_MXFP4 ? _mm256_set1_ps(ldexpf(1.0f, (int)wb[0] - 128))
                                         : _mm256_cvtph_ps(_mm_set1_epi16((short)kvt_rd16(wb)));
            mw[r] = mins ? _mm256_cvtph_ps(_mm_set1_epi16((short)kvt_rd16(wb + 2))) : _mm256_setzero_ps();
        }
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(qx[t] + b * QK));
            __m256 d = _mm256_broadcast_ss(dx[t] + b);
            /* lane j's sum of x (elements 4j .. 4j+3) */
            __m256 sx = mins ? _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(ones8, xv), ones))
                             : _mm256_setzero_ps();
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
                __m256i p16 = _mm256_maddubs_epi16(aw[r], mins ? xv : _mm256_sign_epi8(xv, wv[r]));
                __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(dw[r], d), p, acc[r][t]);
                if (mins) acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(mw[r], d), sx, acc[r][t]);
            }
        }
    }
    /* unrolled too, so that acc stays in registers */
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4") for (int t = 0; t < T; t++) {
            float l[8];
            _mm256_storeu_ps(l, acc[r][t]);
            out[(size_t)t * ldo + (size_t)r] = hsum8(l);
        }
}

/* q8_tile_avx2 for two rows against T (4 or 8) tokens with AVX-512BW: rows 0 and
 * 1 side by side in one zmm (lanes 0..7 and 8..15), each lane the same
 * operations as the AVX2 tile's, so the same bits. AVX-512 has no byte
 * sign: x takes w's sign by a masked negation (x where w is 0 meets |w| =
 * 0, as there). */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"), always_inline)) static inline void
q8_pair_zmm(const uint32_t wt, const int T, const uint8_t *const *w, const float *const *dx,
            const int8_t *const *qx, size_t nb, float *out, size_t ldo)
{
    __m512 acc[8];
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    const __m512i ones = _mm512_set1_epi16(1), ones8 = _mm512_set1_epi8(1);
    const bool mins = b32_min(wt);
    const size_t bb = b32_bytes(wt);
    for (size_t b = 0; b < nb; b++) {
        const uint8_t *w0 = w[0] + b * bb, *w1 = w[1] + b * bb;
        __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(b32_vals_avx2(wt, w0)), b32_vals_avx2(wt, w1), 1);
        __m512i aw = mins ? wv : _mm512_abs_epi8(wv);
        __mmask64 neg = _mm512_movepi8_mask(wv);
        float d0 = wt == KVT_GGML_MXFP4 ? ldexpf(1.0f, (int)w0[0] - 128) : _cvtsh_ss(kvt_rd16(w0));
        float d1 = wt == KVT_GGML_MXFP4 ? ldexpf(1.0f, (int)w1[0] - 128) : _cvtsh_ss(kvt_rd16(w1));
        __m512 dw = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
        __m512 mw = mins ? _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(_cvtsh_ss(kvt_rd16(w0 + 2))),
                                                _mm512_set1_ps(_cvtsh_ss(kvt_rd16(w1 + 2))))
                         : _mm512_setzero_ps();
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
            __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qx[t] + b * QK)));
            __m512 d = _mm512_set1_ps(dx[t][b]);
            __m512i xs = mins ? xv : _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
            __m512 p = _mm512_cvtepi32_ps(_mm512_madd_epi16(_mm512_maddubs_epi16(aw, xs), ones));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, d), p, acc[t]);
            if (mins) {
                __m512 sx = _mm512_cvtepi32_ps(_mm512_madd_epi16(_mm512_maddubs_epi16(ones8, xv), ones));
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(mw, d), sx, acc[t]);
            }
        }
    }
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
        float l[16];
        _mm512_storeu_ps(l, acc[t]);
        out[(size_t)t * ldo] = hsum8(l);
        out[(size_t)t * ldo + 1] = hsum8(l + 8);
    }
}

/* One function per type and tile, so that each is compiled with its
 * constants. */
#define Q8_TILE(name, wt, R, T)                                                                               \
    __attribute__((target("avx2,fma,f16c"))) static void name(const uint8_t *const *w, const float *const *dx, \
                                                             const int8_t *const *qx, size_t nb, float *out,  \
                                                             size_t ldo)                                      \
    {                                                                                                         \
        q8_tile_avx2(wt, R, T, w, dx, qx, nb, out, ldo);                                                      \
    }
#define Q8_TILE_ZMM(name, wt, T)                                                                               \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"))) static void name(                     \
        const uint8_t *const *w, const float *const *dx, const int8_t *const *qx, size_t nb, float *out,      \
        size_t ldo)                                                                                           \
    {                                                                                                         \
        q8_pair_zmm(wt, T, w, dx, qx, nb, out, ldo);                                                          \
    }
#define Q8_TILES(tn, wt) Q8_TILE(tn##_2x4, wt, 2, 4) Q8_TILE(tn##_1x1, wt, 1, 1) Q8_TILE_ZMM(tn##_2x4z, wt, 4) \
    Q8_TILE_ZMM(tn##_2x8z, wt, 8)
Q8_TILES(q8_0, KVT_GGML_Q8_0)
Q8_TILES(q4_0, KVT_GGML_Q4_0)
Q8_TILES(q5_0, KVT_GGML_Q5_0)
Q8_TILES(iq4_nl, KVT_GGML_IQ4_NL)
Q8_TILES(mxfp4, KVT_GGML_MXFP4)
Q8_TILES(q4_1, KVT_GGML_Q4_1)
Q8_TILES(q5_1, KVT_GGML_Q5_1)

/* t2x8: the zmm tile for eight tokens (each weight block unpacked once for
 * eight, not four; every (row, token) lane does the same operations). */
static const struct q8_tiles q8_avx2[] = {
    {KVT_GGML_Q8_0, q8_0_2x4, q8_0_1x1, NULL},
    {KVT_GGML_Q4_0, q4_0_2x4, q4_0_1x1, NULL},
    {KVT_GGML_Q5_0, q5_0_2x4, q5_0_1x1, NULL},
    {KVT_GGML_IQ4_NL, iq4_nl_2x4, iq4_nl_1x1, NULL},
    {KVT_GGML_MXFP4, mxfp4_2x4, mxfp4_1x1, NULL},
    {KVT_GGML_Q4_1, q4_1_2x4, q4_1_1x1, NULL},
    {KVT_GGML_Q5_1, q5_1_2x4, q5_1_1x1, NULL},
};
static const struct q8_tiles q8_avx512[] = {
    {KVT_GGML_Q8_0, q8_0_2x4z, q8_0_1x1, q8_0_2x8z},
    {KVT_GGML_Q4_0, q4_0_2x4z, q4_0_1x1, q4_0_2x8z},
    {KVT_GGML_Q5_0, q5_0_2x4z, q5_0_1x1, q5_0_2x8z},
    {KVT_GGML_IQ4_NL, iq4_nl_2x4z, iq4_nl_1x1, iq4_nl_2x8z},
    {KVT_GGML_MXFP4, mxfp4_2x4z, mxfp4_1x1, mxfp4_2x8z},
    {KVT_GGML_Q4_1, q4_1_2x4z, q4_1_1x1, q4_1_2x8z},
    {KVT_GGML_Q5_1, q5_1_2x4z, q5_1_1x1, q5_1_2x8z},
};
#endif


/* ---- K-quant dot products: exact integers per superblock ---- */

/* Q4_K superblock b against a token: the scaled sum and the min sum. */
static void q4k_ints_scalar(bool q5, const uint8_t *w, const kact *a, size_t b, int32_t *isum, int32_t *msum)
{
    /* q5_K: qh[32] before qs; bit i of qh[l] is element l of sub-block i's fifth bit */
    const uint8_t *s = w + 4, *qh = w + 16, *qs = w + (q5 ? 48 : 16);
    const int8_t *q = a->q + QKK * b;
    const int16_t *bs = a->bs + 16 * b;
    int32_t is = 0, ms = 0;
    for (int k = 0; k < 4; k++) {
        int sc0, m0, sc1, m1;
        k4_scale_min(s, 2 * k, &sc0, &m0);
        k4_scale_min(s, 2 * k + 1, &sc1, &m1);
        int32_t s0 = 0, s1 = 0;
        for (int l = 0; l < 32; l++) {
            int h0 = q5 ? (qh[l] >> (2 * k) & 1) << 4 : 0, h1 = q5 ? (qh[l] >> (2 * k + 1) & 1) << 4 : 0;
            s0 += ((qs[32 * k + l] & 15) | h0) * q[64 * k + l];
            s1 += ((qs[32 * k + l] >> 4) | h1) * q[64 * k + 32 + l];
        }
        is += sc0 * s0 + sc1 * s1;
        ms += m0 * (bs[4 * k] + bs[4 * k + 1]) + m1 * (bs[4 * k + 2] + bs[4 * k + 3]);
    }
    *isum = is;
    *msum = ms;
}

/* Q6_K superblock against a token: sum of scale * (q - 32) * a. */
static int32_t q6k_int_scalar(const uint8_t *w, const kact *a, size_t b)
{
    const int8_t *q = a->q + QKK * b;
    const int16_t *bs = a->bs + 16 * b;
    int32_t is = 0;
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(w + 192 + 8 * h);
        for (int r = 0; r < 4; r++) {
            const uint8_t *lo = ql + 32 * (r & 1);
            int shift = r < 2 ? 0 : 4;
            for (int l0 = 0; l0 < 32; l0 += 16) {
                int32_t sum = 0;
                for (int l = l0; l < l0 + 16; l++) {
                    int v = ((lo[l] >> shift) & 15) | ((qh[l] >> 2 * r) & 3) << 4;
                    sum += v * q[128 * h + 32 * r + l];
                }
                is += sc[2 * r + l0 / 16] * (sum - 32 * bs[(128 * h + 32 * r + l0) / 16]);
            }
        }
    }
    return is;
}

/* IQ4_XS superblock against a token: sum of (scale - 32) * level * a. */
static int32_t iq4xs_int_scalar(const uint8_t *w, const kact *a, size_t b)
{
    const int8_t *q = a->q + QKK * b;
    uint16_t sh = kvt_rd16(w + 2);
    const uint8_t *sl = w + 4;
    int32_t is = 0;
    for (int i = 0; i < 8; i++) {
        int ls = ((sl[i / 2] >> 4 * (i % 2)) & 15) | ((sh >> 2 * i) & 3) << 4;
        const uint8_t *qs = w + 8 + 16 * i;
        int32_t sum = 0;
        for (int j = 0; j < 16; j++)
            sum += iq4nl_levels[qs[j] & 15] * q[32 * i + j] + iq4nl_levels[qs[j] >> 4] * q[32 * i + 16 + j];
        is += (ls - 32) * sum;
    }
    return is;
}

#ifdef KVT_HAVE_X86
__attribute__((target("avx2"))) static inline int32_t hsum_i32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* A superblock's eight 6-bit scales and mins (k4_scale_min for i = 0..7),
 * unpacked four at a time from the 12 bytes as 32-bit words. */
static inline void k4_scales_mins(const uint8_t *s, uint8_t sc[8], uint8_t mn[8])
{
    uint32_t u[3], v[4];
    memcpy(u, s, 12);
    v[0] = u[0] & 0x3f3f3f3fu;                                              /* scales 0..3 */
    v[1] = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 6) & 0x03030303u) << 4;         /* scales 4..7 */
    v[2] = u[1] & 0x3f3f3f3fu;                                              /* mins 0..3 */
    v[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 6) & 0x03030303u) << 4;  /* mins 4..7 */
    memcpy(sc, v, 8);
    memcpy(mn, v + 2, 8);
}

/* The integers of one Q4_K superblock against T tokens, as vectors whose
 * lanes sum to them: iv[t] (eight int32) the scaled sum, mv4[t] (four) the
 * min sum. */
__attribute__((target("avx2"), always_inline)) static inline void q4k_vecs_avx2(const bool q5, const int T,
                                                                               const uint8_t *w, const kact *a,
                                                                               size_t b, __m256i *iv, __m128i *mv4)
{
    const uint8_t *qs = w + (q5 ? 48 : 16);
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
    uint8_t sc[8], mn[8];
    k4_scales_mins(w + 4, sc, mn);
    __m256i acc[KT];
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_si256();
    _Pragma("GCC unroll 8") for (int k = 0; k < 4; k++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * k));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (q5) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * k + 1), one), 4));
        }
        __m256i s0 = _mm256_set1_epi16((short)sc[2 * k]), s1 = _mm256_set1_epi16((short)sc[2 * k + 1]);
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
            const int8_t *q = a[t].q + QKK * b + 64 * k;
            __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)q));
            __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + 32)));
            acc[t] = _mm256_add_epi32(acc[t], _mm256_add_epi32(_mm256_madd_epi16(p0, s0), _mm256_madd_epi16(p1, s1)));
        }
    }
    /* the min sums: sub-block k's min against the sum of its two 16-sums
     * (each pair at most 2 * 16 * 128 in magnitude: an int16) */
    __m128i mv = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)mn));
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
        iv[t] = acc[t];
        __m256i bs = _mm256_loadu_si256((const __m256i *)(a[t].bs + 16 * b));
        __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
        mv4[t] = _mm_madd_epi16(pairs, mv);
    }
}

__attribute__((target("avx2"))) static inline int32_t hsum4_i32(__m128i m)
{
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4e));
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0xb1));
    return _mm_cvtsi128_si32(m);
}

/* The integer of one Q6_K superblock against T tokens, as eight int32
 * lanes (iv[t]) that sum to it. */
__attribute__((target("avx2"), always_inline)) static inline void q6k_vecs_avx2(const int T, const uint8_t *w,
                                                                               const kact *a, size_t b,
                                                                               __m256i *iv)
{
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    __m256i acc[KT];
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_si256();
    _Pragma("GCC unroll 8") for (int h = 0; h < 2; h++) {
        const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(w + 192 + 8 * h);
        __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        __m256i hv = _mm256_loadu_si256((const __m256i *)qh);
        /* the half's eight scales as int16 in both 128-bit lanes; scale
         * 2r for the low lane's eight int16, 2r + 1 for the high one's */
        __m128i s8 = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)sc));
        __m256i s16 = _mm256_set_m128i(s8, s8);
        _Pragma("GCC unroll 8") for (int r = 0; r < 4; r++) {
            __m256i lo = r & 1 ? l1 : l0;
            if (r >= 2) lo = _mm256_srli_epi16(lo, 4);
            __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * r), m2);
            __m256i v = _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_slli_epi16(hb, 4));
            /* int16 lanes 0..7 carry elements 0..15 (scale 2r), 8..15 the rest */
            const char a0 = (char)(4 * r), a1 = (char)(4 * r + 1), b0 = (char)(4 * r + 2), b1 = (char)(4 * r + 3);
            __m256i scv = _mm256_shuffle_epi8(s16, _mm256_setr_epi8(a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1,
                                                                    a0, a1, a0, a1, b0, b1, b0, b1, b0, b1, b0, b1,
                                                                    b0, b1, b0, b1, b0, b1, b0, b1));
            _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
                const int8_t *q = a[t].q + QKK * b + 128 * h + 32 * r;
                __m256i p = _mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i *)q));
                acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(p, scv));
            }
        }
    }
    /* the offset: 32 * sum of scale_j * (the 16-sum j); the 16 scales in
     * sum order (half h, r, then l0) are the block's scales in order */
    __m256i sv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
        __m256i off = _mm256_madd_epi16(sv, _mm256_loadu_si256((const __m256i *)(a[t].bs + 16 * b)));
        iv[t] = _mm256_sub_epi32(acc[t], _mm256_slli_epi32(off, 5));
    }
}

/* The integer of one IQ4_XS superblock against T tokens, as eight int32
 * lanes (iv[t]) that sum to it. */
__attribute__((target("avx2"), always_inline)) static inline void iq4xs_vecs_avx2(const int T, const uint8_t *w,
                                                                                 const kact *a, size_t b,
                                                                                 __m256i *iv)
{
    const __m128i m4 = _mm_set1_epi8(15), tab = _mm_loadu_si128((const __m128i *)iq4nl_levels);
    const __m256i tab2 = _mm256_set_m128i(tab, tab);
    uint16_t sh = kvt_rd16(w + 2);
    const uint8_t *sl = w + 4;
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) iv[t] = _mm256_setzero_si256();
    _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {
        int ls = ((sl[i / 2] >> 4 * (i % 2)) & 15) | ((sh >> 2 * i) & 3) << 4;
        __m128i v = _mm_loadu_si128((const __m128i *)(w + 8 + 16 * i));
        __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
        __m256i wv = _mm256_shuffle_epi8(tab2, nib), aw = _mm256_sign_epi8(wv, wv);
        __m256i sc = _mm256_set1_epi16((short)(ls - 32));
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(a[t].q + QKK * b + 32 * i));
            /* pairs of products (at most 2 * 127 * 127) times the scale */
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), sc);
            iv[t] = _mm256_add_epi32(iv[t], p);
        }
    }
}

/* Row (nsb superblocks of type ty) against T tokens: acc[t] += each
 * superblock's d * dx * isum - dmin * dx * msum, superblock after
 * superblock, the float operations of qk_outputs' scalar loop. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void qk_row_avx2(const uint32_t ty, const int T,
                                                                                 const uint8_t *row, size_t nsb,
                                                                                 const kact *a, float *acc)
{
    const bool q4 = ty == KVT_GGML_Q4_K, q5 = ty == KVT_GGML_Q5_K, q6 = ty == KVT_GGML_Q6_K, mins = q4 || q5;
    const size_t bytes = q4 ? Q4K_BYTES : q5 ? Q5K_BYTES : q6 ? Q6K_BYTES : IQ4XS_BYTES;
    for (size_t b = 0; b < nsb; b++) {
        const uint8_t *w = row + b * bytes;
        __m256i iv[KT];
        __m128i mv[KT];
        if (mins) q4k_vecs_avx2(q5, T, w, a, b, iv, mv);
        else if (q6) q6k_vecs_avx2(T, w, a, b, iv);
        else iq4xs_vecs_avx2(T, w, a, b, iv);
        float d = _cvtsh_ss(kvt_rd16(q6 ? w + 208 : w)); /* F16C: exact, as kvt_f16_to_f32 */
        float dmin = mins ? _cvtsh_ss(kvt_rd16(w + 2)) : 0;
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
            float dx = a[t].d[b];
            acc[t] = fmaf(d * dx, (float)hsum_i32(iv[t]), acc[t]);
            if (mins) acc[t] = fmaf(-(dmin * dx), (float)hsum4_i32(mv[t]), acc[t]);
        }
    }
}

/* q4k_vecs_avx2 for four rows against one token, the token's activations
 * loaded once for the four, each row's scales as int16 in both 128-bit
 * lanes and picked per sub-block by a shuffle. */
__attribute__((target("avx2"), always_inline)) static inline void q4k_vecs_rows4_avx2(const bool q5,
                                                                                     const uint8_t *const w[4],
                                                                                     const kact *a, size_t b,
                                                                                     __m256i *iv, __m128i *mv)
{
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    __m256i S[4], acc[4];
    __m128i mn16[4];
    _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
        uint8_t sc[8], mn[8];
        k4_scales_mins(w[r] + 4, sc, mn);
        S[r] = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
        mn16[r] = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)mn));
        acc[r] = _mm256_setzero_si256();
    }
    const int8_t *q = a->q + QKK * b;
    _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(q + 64 * k));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(q + 64 * k + 32));
        const char c0 = (char)(4 * k), c1 = (char)(4 * k + 1), c2 = (char)(4 * k + 2), c3 = (char)(4 * k + 3);
        const __m256i M0 = _mm256_setr_epi8(c0, c1, c0, c1, c0, c1, c0, c1, c0, c1, c0, c1, c0, c1, c0, c1, c0, c1,
                                            c0, c1, c0, c1, c0, c1, c0, c1, c0, c1, c0, c1, c0, c1);
        const __m256i M1 = _mm256_setr_epi8(c2, c3, c2, c3, c2, c3, c2, c3, c2, c3, c2, c3, c2, c3, c2, c3, c2, c3,
                                            c2, c3, c2, c3, c2, c3, c2, c3, c2, c3, c2, c3, c2, c3);
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w[r] + (q5 ? 48 : 16) + 32 * k));
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (q5) {
                __m256i qh = _mm256_loadu_si256((const __m256i *)(w[r] + 16));
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), one), 4));
                hi = _mm256_or_si256(hi,
                                     _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * k + 1), one), 4));
            }
            __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_shuffle_epi8(S[r], M0));
            __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), _mm256_shuffle_epi8(S[r], M1));
            acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(p0, p1));
        }
    }
    __m256i bs = _mm256_loadu_si256((const __m256i *)(a->bs + 16 * b));
    __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
    _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
        iv[r] = acc[r];
        mv[r] = _mm_madd_epi16(pairs, mn16[r]);
    }
}

/* How far the four-row decode kernels prefetch (in bytes: a later row's
 * superblock): at least the next four rows, and KVT_PF_AHEAD on in each
 * row's stream. */
static inline size_t rows4_ahead(size_t row_bytes)
{
    return row_bytes * (row_bytes * 4 >= KVT_PF_AHEAD ? 4 : (KVT_PF_AHEAD + row_bytes - 1) / row_bytes);
}

/* Four rows (row_bytes apart) against one token, for decode: each lane of
 * acc4 is a row's qk_row_avx2 chain (the same float operations, four
 * rows side by side), the integer sums finished four rows at once. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void qk_rows4_avx2(const uint32_t ty,
                                                                                        const uint8_t *row,
                                                                                        size_t row_bytes,
                                                                                        size_t nsb, const kact *a,
                                                                                        float *out)
{
    const bool q4 = ty == KVT_GGML_Q4_K, q5 = ty == KVT_GGML_Q5_K, q6 = ty == KVT_GGML_Q6_K, mins = q4 || q5;
    const size_t bytes = q4 ? Q4K_BYTES : q5 ? Q5K_BYTES : q6 ? Q6K_BYTES : IQ4XS_BYTES;
    __m128 acc4 = _mm_setzero_ps();
    const size_t ahead = rows4_ahead(row_bytes);
    for (size_t b = 0; b < nsb; b++) {
        __m256i iv[4];
        __m128i mv[4];
        uint16_t dh[4], mh[4];
        const uint8_t *wr[4];
        _Pragma("GCC unroll 8") for (int r = 0; r < 4; r++) {
            const uint8_t *w = wr[r] = row + (size_t)r * row_bytes + b * bytes;
            /* a later row's superblock, while this one computes (the
             * hardware's prefetchers lose the four interleaved streams) */
            for (size_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)(w + ahead + off), _MM_HINT_T0);
            if (q6) q6k_vecs_avx2(1, w, a, b, iv + r);
            else if (!mins) iq4xs_vecs_avx2(1, w, a, b, iv + r);
            dh[r] = kvt_rd16(q6 ? w + 208 : w);
            mh[r] = mins ? kvt_rd16(w + 2) : 0;
        }
        if (mins) q4k_vecs_rows4_avx2(q5, wr, a, b, iv, mv); /* Q4_K, Q5_K: the four rows at once */
        /* integer sums (exact in any order): [row 0, 1, 2, 3] */
        __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(iv[0], iv[1]), _mm256_hadd_epi32(iv[2], iv[3]));
        __m128i is = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        __m128 dx = _mm_set1_ps(a->d[b]);
        __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)dh));
        acc4 = _mm_fmadd_ps(_mm_mul_ps(d, dx), _mm_cvtepi32_ps(is), acc4);
        if (mins) {
            __m128i ms = _mm_hadd_epi32(_mm_hadd_epi32(mv[0], mv[1]), _mm_hadd_epi32(mv[2], mv[3]));
            __m128 dm = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)mh));
            __m128 ndm = _mm_xor_ps(_mm_mul_ps(dm, dx), _mm_set1_ps(-0.0f)); /* -(dmin * dx) */
            acc4 = _mm_fmadd_ps(ndm, _mm_cvtepi32_ps(ms), acc4);
        }
    }
    _mm_storeu_ps(out, acc4);
}

/* q6k_vecs_avx2 for one token with AVX-512BW: the superblock's two halves
 * side by side (half h in 256-bit lane h), the same integers. */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"), always_inline)) static inline __m256i
q6k_vec_zmm(const uint8_t *w, const kact *a, size_t b)
{
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3);
    const int8_t *q = a->q + QKK * b;
    const __m512i l0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)w)),
                                          _mm256_loadu_si256((const __m256i *)(w + 64)), 1);
    const __m512i l1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + 32))),
                                          _mm256_loadu_si256((const __m256i *)(w + 96)), 1);
    const __m512i hv = _mm512_loadu_si512((const void *)(w + 128));
    /* the 16 scales as int16: half 0's eight in 128-bit lanes 0 and 1,
     * half 1's in lanes 2 and 3 */
    const __m256i s8 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
    const __m512i s16 = _mm512_shuffle_i64x2(_mm512_castsi256_si512(s8), _mm512_castsi256_si512(s8),
                                             _MM_SHUFFLE(1, 1, 0, 0));
    __m512i acc = _mm512_setzero_si512();
    _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
        __m512i lo = r & 1 ? l1 : l0;
        if (r >= 2) lo = _mm512_srli_epi16(lo, 4);
        __m512i hb = _mm512_and_si512(_mm512_srli_epi16(hv, 2 * r), m2);
        __m512i v = _mm512_or_si512(_mm512_and_si512(lo, m4), _mm512_slli_epi16(hb, 4));
        const char a0 = (char)(4 * r), a1 = (char)(4 * r + 1), b0 = (char)(4 * r + 2), b1 = (char)(4 * r + 3);
        __m512i scv = _mm512_shuffle_epi8(
            s16, _mm512_broadcast_i64x4(_mm256_setr_epi8(a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0,
                                                         a1, b0, b1, b0, b1, b0, b1, b0, b1, b0, b1, b0, b1, b0, b1,
                                                         b0, b1)));
        __m512i xq = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q + 32 * r))),
                                        _mm256_loadu_si256((const __m256i *)(q + 128 + 32 * r)), 1);
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(v, xq), scv));
    }
    __m256i sum = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    __m256i off = _mm256_madd_epi16(s8, _mm256_loadu_si256((const __m256i *)(a->bs + 16 * b)));
    return _mm256_sub_epi32(sum, _mm256_slli_epi32(off, 5));
}

/* qk_rows4_avx2 for Q6_K with q6k_vec_zmm: the same float operations. */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"))) static void
q6k_rows4_zmm(const uint8_t *row, size_t row_bytes, size_t nsb, const kact *a, float *out)
{
    __m128 acc4 = _mm_setzero_ps();
    const size_t ahead = rows4_ahead(row_bytes);
    for (size_t b = 0; b < nsb; b++) {
        __m256i iv[4];
        uint16_t dh[4];
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
            const uint8_t *w = row + (size_t)r * row_bytes + b * Q6K_BYTES;
            for (size_t off = 0; off < Q6K_BYTES; off += 64) _mm_prefetch((const char *)(w + ahead + off), _MM_HINT_T0);
            iv[r] = q6k_vec_zmm(w, a, b);
            dh[r] = kvt_rd16(w + 208);
        }
        __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(iv[0], iv[1]), _mm256_hadd_epi32(iv[2], iv[3]));
        __m128i is = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        __m128 dx = _mm_set1_ps(a->d[b]);
        __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)dh));
        acc4 = _mm_fmadd_ps(_mm_mul_ps(d, dx), _mm_cvtepi32_ps(is), acc4);
    }
    _mm_storeu_ps(out, acc4);
}

#define QK_ROWS4(name, ty)                                                                                     \
    __attribute__((target("avx2,fma,f16c"))) static void name(const uint8_t *row, size_t row_bytes, size_t nsb, \
                                                              const kact *a, float *out)                      \
    {                                                                                                          \
        qk_rows4_avx2(ty, row, row_bytes, nsb, a, out);                                                        \
    }
QK_ROWS4(q4k_rows4, KVT_GGML_Q4_K)
QK_ROWS4(q5k_rows4, KVT_GGML_Q5_K)
QK_ROWS4(q6k_rows4, KVT_GGML_Q6_K)
QK_ROWS4(iq4xs_rows4, KVT_GGML_IQ4_XS)
#undef QK_ROWS4


/* ---- four rows interleaved (Q4_K, Q5_K) ----
 * A group of four rows, superblock by superblock (p4: P4_BYTES each): in
 * each 32-byte vector of values, 8 bytes of each row, so that one maddubs
 * against a token's 8 activations broadcast four times serves all four
 * rows, and four such products add up in int16 (at most 8 * 31 * 127 =
 * 31496) before one madd applies the four rows' sub-block scales. That is
 * a quarter of the activation loads and half the madds of one row at a
 * time. A model packs its Q4_K and Q5_K matrices so once, when it loads
 * (kvt_q_pack; W->pk), and both prefill and decode read the packed copy; a
 * matrix without one is packed a group at a time into the thread's stack
 * for a prefill chunk. The integers are exact, and the float operations
 * per row are qk_row_avx2's, so the bits are those of every other path.
 *
 * Layout of one p4 (offsets in bytes): qs [k][i][32] (512: chunk k's
 * bytes 8i .. 8i+7 of rows 0..3, 8 each), Q5_K only qh [i][32] (128: the
 * high-bit bytes 8i .. 8i+7 of rows 0..3), sc [j][r] (32: row r's 6-bit
 * scale of sub-block j), mn [r][j] (32: its mins), d [r] and dmin [r]
 * (16: binary16, as in the file). */
#define X4_MAX_SB 64 /* superblocks a row may have for the stack's packing (16384 columns) */
#define Q6_PACK_MIN 32 /* tokens from which a Q6_K matmul packs its rows on the stack */
#define P4_QH 512
static inline size_t p4_sc_at(bool q5) { return q5 ? 640 : 512; }
static inline size_t p4_bytes(bool q5) { return p4_sc_at(q5) + 80; }

static void p4_pack(bool q5, const uint8_t *row, size_t row_bytes, size_t nsb, uint8_t *x)
{
    const size_t bytes = q5 ? Q5K_BYTES : Q4K_BYTES, qs_at = q5 ? 48 : 16, sc_at = p4_sc_at(q5);
    for (size_t b = 0; b < nsb; b++, x += p4_bytes(q5))
        for (int r = 0; r < 4; r++) {
            const uint8_t *w = row + (size_t)r * row_bytes + b * bytes;
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < 4; i++) memcpy(x + 128 * k + 32 * i + 8 * r, w + qs_at + 32 * k + 8 * i, 8);
            if (q5)
                for (int i = 0; i < 4; i++) memcpy(x + P4_QH + 32 * i + 8 * r, w + 16 + 8 * i, 8);
            for (int j = 0; j < 8; j++) {
                int sc, mn;
                k4_scale_min(w + 4, j, &sc, &mn);
                x[sc_at + 4 * j + r] = (uint8_t)sc;
                x[sc_at + 32 + 8 * r + j] = (uint8_t)mn;
            }
            memcpy(x + sc_at + 64 + 2 * r, w, 2);
            memcpy(x + sc_at + 72 + 2 * r, w + 2, 2);
        }
}

/* Quads i = 0..3 (8 bytes each) of four rows' 32 bytes a[r] to four
 * vectors o[i] = [row 0's quad i, row 1's, row 2's, row 3's]: a 4x4
 * transpose of 64-bit lanes. */
__attribute__((target("avx2"), always_inline)) static inline void quads4(const uint8_t *const a[4], size_t at,
                                                                        uint8_t *o)
{
    __m256i a0 = _mm256_loadu_si256((const __m256i *)(a[0] + at)), a1 = _mm256_loadu_si256((const __m256i *)(a[1] + at));
    __m256i a2 = _mm256_loadu_si256((const __m256i *)(a[2] + at)), a3 = _mm256_loadu_si256((const __m256i *)(a[3] + at));
    __m256i t0 = _mm256_unpacklo_epi64(a0, a1), t1 = _mm256_unpackhi_epi64(a0, a1); /* [0.q0 1.q0 | 0.q2 1.q2], q1/q3 */
    __m256i t2 = _mm256_unpacklo_epi64(a2, a3), t3 = _mm256_unpackhi_epi64(a2, a3); /* rows 2, 3 the same */
    _mm256_storeu_si256((__m256i *)o, _mm256_permute2x128_si256(t0, t2, 0x20));
    _mm256_storeu_si256((__m256i *)(o + 32), _mm256_permute2x128_si256(t1, t3, 0x20));
    _mm256_storeu_si256((__m256i *)(o + 64), _mm256_permute2x128_si256(t0, t2, 0x31));
    _mm256_storeu_si256((__m256i *)(o + 96), _mm256_permute2x128_si256(t1, t3, 0x31));
}

/* p4_pack's bytes with vector moves: the values' 8-byte quads as a 4x4
 * transpose per 32 bytes, the four rows' scales unpacked eight at a time
 * and interleaved by byte. A move of bytes only, so the same bytes as
 * p4_pack (the tests compare them); a prefill chunk of a matrix without a
 * packed copy (ds4's routed experts) spent as long packing as multiplying
 * with the scalar one. kvt_q_fault == KVT_QUANT_FAULT_PACK (tests) swaps
 * rows 0 and 1 of the first quad of each superblock. */
__attribute__((target("avx2"))) static void p4_pack_avx2(bool q5, const uint8_t *row, size_t row_bytes, size_t nsb,
                                                          uint8_t *x)
{
    const size_t bytes = q5 ? Q5K_BYTES : Q4K_BYTES, qs_at = q5 ? 48 : 16, sc_at = p4_sc_at(q5);
    const bool fault = kvt_q_fault == KVT_QUANT_FAULT_PACK;
    for (size_t b = 0; b < nsb; b++, x += p4_bytes(q5)) {
        const uint8_t *w[4];
        uint8_t sc[4][8], mn[4][8];
        for (int r = 0; r < 4; r++) w[r] = row + (size_t)r * row_bytes + b * bytes;
        for (int k = 0; k < 4; k++) quads4(w, qs_at + 32 * (size_t)k, x + 128 * k);
        if (q5) quads4(w, 16, x + P4_QH);
        for (int r = 0; r < 4; r++) {
            k4_scales_mins(w[r] + 4, sc[r], mn[r]);
            memcpy(x + sc_at + 32 + 8 * r, mn[r], 8);
            memcpy(x + sc_at + 64 + 2 * r, w[r], 2);
            memcpy(x + sc_at + 72 + 2 * r, w[r] + 2, 2);
        }
        /* sc [j][r]: bytes of rows 0, 1 and 2, 3 interleaved, then their pairs */
        __m128i u01 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)sc[0]), _mm_loadl_epi64((const __m128i *)sc[1]));
        __m128i u23 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)sc[2]), _mm_loadl_epi64((const __m128i *)sc[3]));
        _mm_storeu_si128((__m128i *)(x + sc_at), _mm_unpacklo_epi16(u01, u23));
        _mm_storeu_si128((__m128i *)(x + sc_at + 16), _mm_unpackhi_epi16(u01, u23));
        if (fault) {
            uint8_t t[8];
            memcpy(t, x, 8), memcpy(x, x + 8, 8), memcpy(x + 8, t, 8);
        }
    }
}

/* Row r's eight int32 lanes of m[r], summed, side by side: [m0 m1 m2 m3]. */
__attribute__((target("avx2"), always_inline)) static inline __m128i sum4x8(__m256i m0, __m256i m1, __m256i m2,
                                                                          __m256i m3)
{
    __m256i u01 = _mm256_add_epi32(_mm256_unpacklo_epi32(m0, m1), _mm256_unpackhi_epi32(m0, m1));
    __m256i u23 = _mm256_add_epi32(_mm256_unpacklo_epi32(m2, m3), _mm256_unpackhi_epi32(m2, m3));
    /* per half: u01 [m0 m1 m0 m1], u23 [m2 m3 m2 m3] */
    __m256i u = _mm256_add_epi32(_mm256_unpacklo_epi64(u01, u23), _mm256_unpackhi_epi64(u01, u23));
    return _mm_add_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}

/* A token's sixteen 16-sums bs against each of four rows' sixteen int16
 * weights m[r] (Q6_K's scales): [r0 r1 r2 r3]. */
__attribute__((target("avx2"), always_inline)) static inline __m128i bs_dot4(__m256i bs, const __m256i m[4])
{
    return sum4x8(_mm256_madd_epi16(bs, m[0]), _mm256_madd_epi16(bs, m[1]), _mm256_madd_epi16(bs, m[2]),
                  _mm256_madd_epi16(bs, m[3]));
}

/* int32 lanes [r0 r0 r1 r1 r2 r2 r3 r3], each row's two summed: [r0 r1 r2 r3]. */
__attribute__((target("avx2"), always_inline)) static inline __m128i pairs4(__m256i v)
{
    __m256i s = _mm256_add_epi32(v, _mm256_srli_epi64(v, 32));
    return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(s, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
}

/* Eight int8 values in each quarter of a vector. */
__attribute__((target("avx2"), always_inline)) static inline __m256i bcast8(const int8_t *q)
{
    int64_t v;
    memcpy(&v, q, 8);
    return _mm256_set1_epi64x(v);
}

/* pshufb picks of sub-block j's scale (j mod 4; the 16 bytes of j's half
 * in both 128-bit lanes): row r's byte 4j + r into int16 lanes 4r .. 4r+3 */
#define P4_PICK(j) \
    _mm256_setr_epi8(4 * j, -1, 4 * j, -1, 4 * j, -1, 4 * j, -1, 4 * j + 1, -1, 4 * j + 1, -1, 4 * j + 1, -1, \
                     4 * j + 1, -1, 4 * j + 2, -1, 4 * j + 2, -1, 4 * j + 2, -1, 4 * j + 2, -1, 4 * j + 3, -1,  \
                     4 * j + 3, -1, 4 * j + 3, -1, 4 * j + 3, -1)

/* A p4 superblock's float operations for T tokens, once the integers are
 * summed per row (isum[t]: [r0 r1 r2 r3]): the min sums, then acc[t] +=
 * d * dx * isum and -(dmin * dx) * msum, row by row as qk_row_avx2. sc:
 * the p4's scales (x + p4_sc_at). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void p4_finish(const int T, const uint8_t *sc,
                                                                              const kact *a, size_t b,
                                                                              const __m128i *isum, __m128 *acc)
{
    const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + 64)));
    const __m128 dmin = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + 72)));
    /* the mins as int16: rows 0, 1 and rows 2, 3 */
    const __m256i M01 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(sc + 32)));
    const __m256i M23 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(sc + 48)));
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
        /* the min sums: min j against the sum of 16-sums 2j and 2j + 1
         * (at most 2 * 16 * 128 in magnitude: an int16) */
        __m256i bs = _mm256_loadu_si256((const __m256i *)(a[t].bs + 16 * b));
        __m256i P = _mm256_broadcastsi128_si256(_mm_hadd_epi16(_mm256_castsi256_si128(bs),
                                                               _mm256_extracti128_si256(bs, 1)));
        /* [r0 x4 | r1 x4], [r2 x4 | r3 x4] -> [r0 r2 r0 r2 | r1 r3 r1 r3] */
        __m256i h = _mm256_hadd_epi32(_mm256_madd_epi16(P, M01), _mm256_madd_epi16(P, M23));
        h = _mm256_hadd_epi32(h, h);
        __m128i msum = _mm_unpacklo_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        __m128 dx = _mm_set1_ps(a[t].d[b]);
        acc[t] = _mm_fmadd_ps(_mm_mul_ps(d, dx), _mm_cvtepi32_ps(isum[t]), acc[t]);
        acc[t] = _mm_fmadd_ps(_mm_xor_ps(_mm_mul_ps(dmin, dx), _mm_set1_ps(-0.0f)), _mm_cvtepi32_ps(msum), acc[t]);
    }
}

/* Four packed rows (nsb p4s at x) against T tokens: out[t * ldo + r] for r < 4. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void p4_avx2(const bool q5, const int T,
                                                                                 const uint8_t *x, size_t nsb,
                                                                                 const kact *a, float *out,
                                                                                 size_t ldo)
{
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const __m256i pick[4] = {P4_PICK(0), P4_PICK(1), P4_PICK(2), P4_PICK(3)};
    const size_t sc_at = p4_sc_at(q5);
    __m128 acc[KT];
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) acc[t] = _mm_setzero_ps();
    for (size_t b = 0; b < nsb; b++, x += p4_bytes(q5)) {
        if (T == 1) /* decode: the stream's lines KVT_PF_AHEAD on */
            for (size_t off = 0; off < p4_bytes(q5); off += 64) _mm_prefetch((const char *)(x + KVT_PF_AHEAD + off), _MM_HINT_T0);
        __m256i is[KT];
        __m128i isum[KT];
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) is[t] = _mm256_setzero_si256();
        const __m256i S[2] = {_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(x + sc_at))),
                              _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(x + sc_at + 16)))};
        _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++)
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
                /* h 0: sub-block 2k (low nibbles), h 1: 2k + 1 (high) */
                const int j = 2 * k + h;
                __m256i v[4];
                _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(x + 128 * k + 32 * i));
                    v[i] = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, m4);
                    if (q5) {
                        __m256i qh = _mm256_loadu_si256((const __m256i *)(x + P4_QH + 32 * i));
                        v[i] = _mm256_or_si256(v[i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), one), 4));
                    }
                }
                __m256i sc = _mm256_shuffle_epi8(S[j / 4], pick[j % 4]);
                _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
                    const int8_t *q = a[t].q + QKK * b + 32 * j;
                    __m256i p = _mm256_maddubs_epi16(v[0], bcast8(q));
                    _Pragma("GCC unroll 4") for (int i = 1; i < 4; i++)
                        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(v[i], bcast8(q + 8 * i)));
                    is[t] = _mm256_add_epi32(is[t], _mm256_madd_epi16(p, sc));
                }
            }
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) isum[t] = pairs4(is[t]);
        p4_finish(T, x + sc_at, a, b, isum, acc);
    }
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) _mm_storeu_ps(out + (size_t)t * ldo, acc[t]);
}

/* p4_avx2 with AVX-512BW: chunk k's two sub-blocks at once, 2k (the low
 * nibbles) in a zmm's low half and 2k + 1 in its high half, each half
 * four rows of eight bytes as in p4_avx2; a token's activations for both
 * come from one 64-byte load, each quarter's pair of eight picked by a
 * permute. The integers are the same (exact in any order), and the float
 * operations those of p4_avx2, so the bits are too. */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"), always_inline)) static inline void
p4_zmm(const bool q5, const int T, const uint8_t *x, size_t nsb, const kact *a, float *out, size_t ldo)
{
    const __m512i m4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    const __m512i nib_shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    const __m512i pick[2] = {_mm512_inserti64x4(_mm512_castsi256_si512(P4_PICK(0)), P4_PICK(1), 1),
                             _mm512_inserti64x4(_mm512_castsi256_si512(P4_PICK(2)), P4_PICK(3), 1)};
    const __m512i quarter[4] = {_mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0), _mm512_set_epi64(5, 5, 5, 5, 1, 1, 1, 1),
                                _mm512_set_epi64(6, 6, 6, 6, 2, 2, 2, 2), _mm512_set_epi64(7, 7, 7, 7, 3, 3, 3, 3)};
    const size_t sc_at = p4_sc_at(q5);
    __m128 acc[KT];
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) acc[t] = _mm_setzero_ps();
    for (size_t b = 0; b < nsb; b++, x += p4_bytes(q5)) {
        if (T == 1) /* decode: the stream's lines KVT_PF_AHEAD on */
            for (size_t off = 0; off < p4_bytes(q5); off += 64) _mm_prefetch((const char *)(x + KVT_PF_AHEAD + off), _MM_HINT_T0);
        __m512i is[KT];
        __m128i isum[KT];
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) is[t] = _mm512_setzero_si512();
        _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {
            __m512i v[4];
            const __m512i qh_shift = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(2 * k))),
                                                        _mm256_set1_epi16((short)(2 * k + 1)), 1);
            _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
                __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x + 128 * k + 32 * i)));
                v[i] = _mm512_and_si512(_mm512_srlv_epi64(raw, nib_shift), m4);
                if (q5) {
                    __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x + P4_QH + 32 * i)));
                    v[i] = _mm512_or_si512(v[i],
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, qh_shift), one), 4));
                }
            }
            /* the scales of sub-blocks 2k and 2k + 1: both in half k / 2 */
            __m512i S = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(x + sc_at + 16 * (k / 2))));
            __m512i sc = _mm512_shuffle_epi8(S, pick[k % 2]);
            _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
                __m512i X = _mm512_loadu_si512((const void *)(a[t].q + QKK * b + 64 * k));
                __m512i p = _mm512_maddubs_epi16(v[0], _mm512_permutexvar_epi64(quarter[0], X));
                _Pragma("GCC unroll 4") for (int i = 1; i < 4; i++)
                    p = _mm512_add_epi16(p, _mm512_maddubs_epi16(v[i], _mm512_permutexvar_epi64(quarter[i], X)));
                is[t] = _mm512_add_epi32(is[t], _mm512_madd_epi16(p, sc));
            }
        }
        /* both halves' rows as p4_avx2's lanes [r0 r0 r1 r1 r2 r2 r3 r3] */
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++)
            isum[t] = pairs4(_mm256_add_epi32(_mm512_castsi512_si256(is[t]), _mm512_extracti64x4_epi64(is[t], 1)));
        p4_finish(T, x + sc_at, a, b, isum, acc);
    }
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) _mm_storeu_ps(out + (size_t)t * ldo, acc[t]);
}

#define P4_KERNEL(name, q5, T, tgt)                                                                              \
    __attribute__((target(tgt))) static void name(const uint8_t *x, size_t nsb, const kact *a, float *out,       \
                                                  size_t ldo)                                                    \
    {                                                                                                            \
        p4_avx2(q5, T, x, nsb, a, out, ldo);                                                                     \
    }
P4_KERNEL(q4k_p4_t1, false, 1, "avx2,fma,f16c")
P4_KERNEL(q5k_p4_t1, true, 1, "avx2,fma,f16c")
P4_KERNEL(q4k_p4_t4, false, 4, "avx2,fma,f16c")
P4_KERNEL(q5k_p4_t4, true, 4, "avx2,fma,f16c")
/* with AVX-512BW, eight tokens in 512-bit vectors */
#define P4_KERNEL_ZMM(name, q5, T)                                                                               \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"))) static void name(                        \
        const uint8_t *x, size_t nsb, const kact *a, float *out, size_t ldo)                                     \
    {                                                                                                            \
        p4_zmm(q5, T, x, nsb, a, out, ldo);                                                                      \
    }
P4_KERNEL_ZMM(q4k_p4_t8, false, 8)
P4_KERNEL_ZMM(q5k_p4_t8, true, 8)
P4_KERNEL_ZMM(q4k_p4_t1z, false, 1)
P4_KERNEL_ZMM(q5k_p4_t1z, true, 1)
#undef P4_KERNEL_ZMM
#undef P4_KERNEL
#undef P4_PICK

/* Q6_K in the same scheme, its values unpacked to bytes (0..63) when
 * packed: a sub-block of 16 values is two vectors, whose two maddubs add in
 * int16 (at most 4 * 63 * 127 = 32004) before one madd applies the four
 * rows' signed scales; the offset of 32 is subtracted as the scalar path
 * does, 32 * sum_j scale_j * (16-sum j). */
typedef struct q6k_x4 {
    uint8_t q[16][2][32]; /* [j][i]: rows 0..3's values 16j + 8i .. 16j + 8i + 7 */
    int16_t sc[16][16];   /* sub-block j: row r's scale in lanes 4r .. 4r+3 */
    int16_t scr[4][16];   /* row r: its 16 scales */
    float d[4];
} q6k_x4;

__attribute__((target("avx2"))) static void q6k_x4_pack(const uint8_t *row, size_t row_bytes, size_t nsb,
                                                         q6k_x4 *x)
{
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    for (size_t b = 0; b < nsb; b++, x++)
        for (int r = 0; r < 4; r++) {
            const uint8_t *w = row + (size_t)r * row_bytes + b * Q6K_BYTES;
            uint8_t v[256];
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = w + 64 * h;
                __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
                __m256i hv = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
                for (int s = 0; s < 4; s++) { /* values 128h + 32s + l, as q6k_int_scalar */
                    __m256i lo = s & 1 ? l1 : l0;
                    if (s >= 2) lo = _mm256_srli_epi16(lo, 4);
                    __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * s), m2);
                    _mm256_storeu_si256((__m256i *)(v + 128 * h + 32 * s),
                                        _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_slli_epi16(hb, 4)));
                }
            }
            for (int j = 0; j < 16; j++)
                for (int i = 0; i < 2; i++) memcpy(x->q[j][i] + 8 * r, v + 16 * j + 8 * i, 8);
            const int8_t *sc = (const int8_t *)(w + 192);
            for (int j = 0; j < 16; j++) {
                for (int l = 0; l < 4; l++) x->sc[j][4 * r + l] = sc[j];
                x->scr[r][j] = sc[j];
            }
            x->d[r] = kvt_f16_to_f32(kvt_rd16(w + 208));
        }
}

/* Four packed Q6_K rows against T tokens: out[t * ldo + r] for r < 4. */
__attribute__((target("avx2,fma"), always_inline)) static inline void q6k_x4_avx2(const int T, const q6k_x4 *x,
                                                                                size_t nsb, const kact *a,
                                                                                float *out, size_t ldo)
{
    __m128 acc[KT];
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) acc[t] = _mm_setzero_ps();
    for (size_t b = 0; b < nsb; b++, x++) {
        __m256i is[KT];
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) is[t] = _mm256_setzero_si256();
        for (int j = 0; j < 16; j++) {
            __m256i v0 = _mm256_loadu_si256((const __m256i *)x->q[j][0]);
            __m256i v1 = _mm256_loadu_si256((const __m256i *)x->q[j][1]);
            __m256i sc = _mm256_loadu_si256((const __m256i *)x->sc[j]);
            _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
                const int8_t *q = a[t].q + QKK * b + 16 * j;
                __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(v0, bcast8(q)), _mm256_maddubs_epi16(v1, bcast8(q + 8)));
                is[t] = _mm256_add_epi32(is[t], _mm256_madd_epi16(p, sc));
            }
        }
        const __m128 d = _mm_loadu_ps(x->d);
        __m256i scr[4];
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) scr[r] = _mm256_loadu_si256((const __m256i *)x->scr[r]);
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
            __m128i off = bs_dot4(_mm256_loadu_si256((const __m256i *)(a[t].bs + 16 * b)), scr);
            __m128i isum = _mm_sub_epi32(pairs4(is[t]), _mm_slli_epi32(off, 5));
            acc[t] = _mm_fmadd_ps(_mm_mul_ps(d, _mm_set1_ps(a[t].d[b])), _mm_cvtepi32_ps(isum), acc[t]);
        }
    }
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) _mm_storeu_ps(out + (size_t)t * ldo, acc[t]);
}

__attribute__((target("avx2,fma"))) static void q6k_x4_t8(const q6k_x4 *x, size_t nsb, const kact *a, float *out,
                                                           size_t ldo)
{
    q6k_x4_avx2(8, x, nsb, a, out, ldo);
}

__attribute__((target("avx2,fma"))) static void q6k_x4_t4(const q6k_x4 *x, size_t nsb, const kact *a, float *out,
                                                           size_t ldo)
{
    q6k_x4_avx2(4, x, nsb, a, out, ldo);
}

#define QK_ROW(name, ty, T)                                                                                    \
    __attribute__((target("avx2,fma,f16c"))) static void name(const uint8_t *row, size_t nsb, const kact *a, \
                                                         float *acc)                                         \
    {                                                                                                        \
        qk_row_avx2(ty, T, row, nsb, a, acc);                                                                \
    }
QK_ROW(q4k_row8, KVT_GGML_Q4_K, KT)
QK_ROW(q5k_row8, KVT_GGML_Q5_K, KT)
QK_ROW(q6k_row8, KVT_GGML_Q6_K, KT)
QK_ROW(iq4xs_row8, KVT_GGML_IQ4_XS, KT)
QK_ROW(q4k_row4, KVT_GGML_Q4_K, 4)
QK_ROW(q4k_row1, KVT_GGML_Q4_K, 1)
QK_ROW(q5k_row4, KVT_GGML_Q5_K, 4)
QK_ROW(q5k_row1, KVT_GGML_Q5_K, 1)
QK_ROW(q6k_row4, KVT_GGML_Q6_K, 4)
QK_ROW(q6k_row1, KVT_GGML_Q6_K, 1)
QK_ROW(iq4xs_row4, KVT_GGML_IQ4_XS, 4)
QK_ROW(iq4xs_row1, KVT_GGML_IQ4_XS, 1)
#undef QK_ROW

#endif

struct qk_ctx { float *y; const kvt_wmat *W; const uint8_t *qx; size_t n; const struct qk_ops *qk; };

/* The rows qk_outputs keeps before it writes them, token by token. */
#define QK_OB 8

/* Rows [o, o + R) (R <= QK_OB) against tokens [t, t + T): each row's
 * fixed float order per superblock, as one row alone; then each token's R
 * outputs written side by side (one row at a time, the stores a row apart
 * touched a cache line each, what cost the low-bit prefill a fifth of its
 * time before it did the same). */
static void qk_outputs(const struct qk_ctx *c, size_t o, size_t R, size_t t, int T)
{
    const kvt_wmat *W = c->W;
    uint32_t ty = W->type;
    bool q4 = ty == KVT_GGML_Q4_K, q5 = ty == KVT_GGML_Q5_K, q6 = ty == KVT_GGML_Q6_K, mins = q4 || q5;
    size_t nsb = W->cols / QKK, bytes = q4 ? Q4K_BYTES : q5 ? Q5K_BYTES : q6 ? Q6K_BYTES : IQ4XS_BYTES;
    kact a[KT];
    float acc[QK_OB][KT] = {{0}}; /* (row, token) */
    for (int k = 0; k < T; k++) a[k] = kact_at(c->qx, t + (size_t)k, W->cols);
    for (size_t r = 0; r < R; r++) {
        const uint8_t *row = W->data + (o + r) * W->row_bytes;
        if (c->qk) {
            const qk_row_fn *f = c->qk->row[kq(ty)];
            if (T == KT) f[0](row, nsb, a, acc[r]);
            else if (T == 4) f[1](row, nsb, a, acc[r]);
            else
                for (int k = 0; k < T; k++) f[2](row, nsb, a + k, acc[r] + k);
            continue;
        }
        for (size_t b = 0; b < nsb; b++) {
            const uint8_t *w = row + b * bytes;
            int32_t is[KT], ms[KT] = {0};
            for (int k = 0; k < T; k++) {
                if (mins) q4k_ints_scalar(q5, w, a + k, b, is + k, ms + k);
                else if (q6) is[k] = q6k_int_scalar(w, a + k, b);
                else is[k] = iq4xs_int_scalar(w, a + k, b);
            }
            float d = kvt_f16_to_f32(kvt_rd16(q6 ? w + 208 : w));
            float dmin = mins ? kvt_f16_to_f32(kvt_rd16(w + 2)) : 0;
            for (int k = 0; k < T; k++) {
                float dx = a[k].d[b];
                acc[r][k] = fmaf(d * dx, (float)is[k], acc[r][k]);
                if (mins) acc[r][k] = fmaf(-(dmin * dx), (float)ms[k], acc[r][k]);
            }
        }
    }
    for (int k = 0; k < T; k++) {
        float *y = c->y + (t + (size_t)k) * W->rows + o;
        for (size_t r = 0; r < R; r++) y[r] = acc[r][k];
    }
}

#ifdef KVT_HAVE_X86
/* One group's four rows (packed at x, the first of them row o) against
 * every token of the matmul: eight (AVX-512VL) or four tokens a call, the
 * rest one at a time. */
static void p4_tokens(const struct qk_ctx *c, const uint8_t *x, size_t o)
{
    const kvt_wmat *W = c->W;
    bool q5 = W->type == KVT_GGML_Q5_K;
    size_t nsb = W->cols / QKK, t = 0;
    const p4_fn *p4 = c->qk->p4[q5];
    for (int T = p4[0] ? 8 : 4; T >= 1; T = T > 4 ? 4 : T - 3) {
        p4_fn f = p4[T == 8 ? 0 : T == 4 ? 1 : 2];
        for (; t + (size_t)T <= c->n; t += (size_t)T) {
            kact a[KT];
            for (int k = 0; k < T; k++) a[k] = kact_at(c->qx, t + (size_t)k, W->cols);
            f(x, nsb, a, c->y + t * W->rows + o, W->rows);
        }
    }
}

/* Groups [g0, g1) of a packed matrix (W->pk). */
static void qk_groups(void *arg, size_t g0, size_t g1)
{
    struct qk_ctx *c = arg;
    size_t stride = c->W->cols / QKK * p4_bytes(c->W->type == KVT_GGML_Q5_K);
    for (size_t g = g0; g < g1; g++) p4_tokens(c, c->W->pk + g * stride, 4 * g);
}
#endif

static void qk_range(void *arg, size_t o0, size_t o1)
{
    struct qk_ctx *c = arg;
#ifdef KVT_HAVE_X86
    const kvt_wmat *W = c->W;
    size_t nsb = W->cols / QKK;
    bool q4 = W->type == KVT_GGML_Q4_K, q5 = W->type == KVT_GGML_Q5_K, q6 = W->type == KVT_GGML_Q6_K;
    if (c->qk && (c->n < 4 || (q6 && c->n < Q6_PACK_MIN))) {
        /* decode, and the few tokens of batched decodes: four rows at a
         * time (adjacent in memory, so one stream), each group against
         * every token while it is in L1; Q6_K rows are not worth packing
         * for fewer than Q6_PACK_MIN tokens */
        qk_rows4_fn f = c->qk->rows4[kq(W->type)];
        for (; o0 + 4 <= o1; o0 += 4)
            for (size_t t = 0; t < c->n; t++) {
                kact a = kact_at(c->qx, t, W->cols);
                f(W->data + o0 * W->row_bytes, W->row_bytes, nsb, &a, c->y + t * W->rows + o0);
            }
    }
    if (c->qk && c->n >= 4 && (q4 || q5 || q6) && nsb <= X4_MAX_SB) {
        /* prefill: four rows at a time, packed once for all the tokens.
         * Q6_K takes eight tokens a call on AVX2 too (a sub-block needs
         * three vectors). */
        union { uint8_t k4[X4_MAX_SB * 720]; q6k_x4 k6[X4_MAX_SB]; } x;
        for (; o0 + 4 <= o1; o0 += 4) {
            const uint8_t *rows = W->data + o0 * W->row_bytes;
            if (!q6) {
                c->qk->pack(q5, rows, W->row_bytes, nsb, x.k4);
                p4_tokens(c, x.k4, o0);
                continue;
            }
            q6k_x4_pack(rows, W->row_bytes, nsb, x.k6);
            size_t t = 0;
            for (int T = 8; T >= 4; T -= 4)
                for (; t + (size_t)T <= c->n; t += (size_t)T) {
                    kact a[KT];
                    for (int k = 0; k < T; k++) a[k] = kact_at(c->qx, t + (size_t)k, W->cols);
                    c->qk->q6x4[T == 8 ? 0 : 1](x.k6, nsb, a, c->y + t * W->rows + o0, W->rows);
                }
            for (size_t u = t; u < c->n; u++) qk_outputs(c, o0, 4, u, 1);
        }
    }
#endif
    for (size_t o = o0; o < o1; o += QK_OB) {
        size_t R = o1 - o < QK_OB ? o1 - o : QK_OB;
        for (size_t t = 0; t < c->n;) {
            int T = c->n - t >= KT ? KT : c->n - t >= 4 ? 4 : 1;
            qk_outputs(c, o, R, t, T);
            t += (size_t)T;
        }
    }
}

size_t kvt_q_pack_bytes(const kvt_wmat *W)
{
#ifdef KVT_HAVE_X86
    bool q5 = W->type == KVT_GGML_Q5_K;
    if ((W->type == KVT_GGML_Q4_K || q5) && W->rows % 4 == 0 && W->cols % QKK == 0 && W->rows && W->cols)
        return W->rows / 4 * (W->cols / QKK) * p4_bytes(q5);
#else
    (void)W;
#endif
    return 0;
}

void kvt_q_pack(const kvt_wmat *W, uint8_t *dst)
{
#ifdef KVT_HAVE_X86
    if (!kvt_q_pack_bytes(W)) return; /* nothing to pack */
    bool q5 = W->type == KVT_GGML_Q5_K;
    size_t nsb = W->cols / QKK, stride = nsb * p4_bytes(q5);
    const struct qk_ops *qk = ops()->qk; /* the scalar path (no qk) packs with the reference p4_pack */
    for (size_t g = 0; g < W->rows / 4; g++)
        (qk ? qk->pack : p4_pack)(q5, W->data + 4 * g * W->row_bytes, W->row_bytes, nsb, dst + g * stride);
#else
    (void)W, (void)dst;
#endif
}

struct qm_ctx { float *y; const kvt_wmat *W; const uint8_t *qx; size_t n; const struct q8_tiles *q8; };

static void qm_range(void *arg, size_t o0, size_t o1)
{
    struct qm_ctx *c = arg;
    const kvt_wmat *W = c->W;
    size_t nb = W->cols / QK, stride = act_stride(W->cols), d_out = W->rows;
    const struct q8_tiles *tiles = c->q8;
    if (tiles)
        while (tiles->wt != W->type) tiles++;
    for (size_t o = o0; o < o1;) {
        /* prefill: two rows against four tokens (eight with AVX-512). Decode: one row after the
         * other, one stream through memory (four rows side by side ran
         * the 1-thread Q8_0 decode 2.6 times slower) */
        size_t R = c->n > 1 && o1 - o >= 2 ? 2 : 1;
        const uint8_t *w[4];
        for (size_t r = 0; r < R; r++) w[r] = W->data + (o + r) * W->row_bytes;
        for (size_t t = 0; t < c->n;) {
            size_t T = c->n - t >= 4 ? 4 : 1;
            if (tiles && tiles->t2x8 && R == 2 && c->n - t >= 8) T = 8;
            const float *dx[8];
            const int8_t *qx[8];
            for (size_t k = 0; k < T; k++) {
                const uint8_t *base = c->qx + (t + k) * stride;
                dx[k] = (const float *)base;
                qx[k] = (const int8_t *)(base + nb * sizeof(float));
            }
            float *out = c->y + t * d_out + o;
            if (tiles) {
                if (T == 8) tiles->t2x8(w, dx, qx, nb, out, d_out);
                else if (R == 2 && T == 4) tiles->t2x4(w, dx, qx, nb, out, d_out);
                else
                    for (size_t r = 0; r < R; r++)
                        for (size_t k = 0; k < T; k++) tiles->t1x1(w + r, dx + k, qx + k, nb, out + k * d_out + r, d_out);
                t += T;
                continue;
            }
            q8_scalar(W->type, (int)R, (int)T, w, dx, qx, nb, out, d_out);
            t += T;
        }
        o += R;
    }
}

bool kvt_q_same_act(uint32_t a, uint32_t b)
{
    return kvt_q_supported(a) && kvt_q_supported(b) && q8k_act(a) == q8k_act(b);
}

void kvt_q_matmul_quantised(kvt_pool *pool, float *y, const kvt_wmat *W, size_t n, const uint8_t *qx)
{
    const struct q_ops *k = ops();
    size_t per_out = n * W->cols;
    size_t min = per_out ? (32768 + per_out - 1) / per_out : W->rows;
    if (kvt_qlowbit_supported(W->type)) {
        kvt_qlowbit_matmul(pool, y, W, n, qx);
        return;
    }
    if (k_type(W->type)) {
        struct qk_ctx c = {y, W, qx, n, k->qk};
#ifdef KVT_HAVE_X86
        if (k->qk && W->pk) { /* the packed copy is read by the SIMD kernels only */
            kvt_pool_for(pool, W->rows / 4, (min + 3) / 4, qk_groups, &c);
            return;
        }
#endif
        kvt_pool_for(pool, W->rows, min, qk_range, &c);
        return;
    }
    struct qm_ctx c = {y, W, qx, n, k->q8};
    kvt_pool_for(pool, W->rows, min, qm_range, &c);
}

void kvt_q_matmul(kvt_pool *pool, float *y, const kvt_wmat *W, const float *x, size_t n, uint8_t *qx)
{
    struct qa_ctx a = {x, qx, W->cols, ops()};
    if (q8k_act(W->type)) kvt_pool_for(pool, n, 16, quant_k_range, &a);
    else kvt_pool_for(pool, n, 64, quant_range, &a);
    kvt_q_matmul_quantised(pool, y, W, n, qx);
}

/* ---- the kernels of each instruction set ---- */

static const struct q_ops ops_scalar = {
    .quant_block = quant_block_scalar,
    .quant_k_block = quant_k_block,
};

#ifdef KVT_HAVE_X86
static const struct qk_ops qk_avx2 = {
    .row = {{q4k_row8, q4k_row4, q4k_row1}, {q5k_row8, q5k_row4, q5k_row1}, {q6k_row8, q6k_row4, q6k_row1},
            {iq4xs_row8, iq4xs_row4, iq4xs_row1}},
    .rows4 = {q4k_rows4, q5k_rows4, q6k_rows4, iq4xs_rows4},
    .p4 = {{NULL, q4k_p4_t4, q4k_p4_t1}, {NULL, q5k_p4_t4, q5k_p4_t1}},
    .q6x4 = {q6k_x4_t8, q6k_x4_t4},
    .pack = p4_pack_avx2,
};

/* AVX-512: Q6_K decode in zmm, eight packed tokens a call, the one-token
 * packed kernel in zmm. */
static const struct qk_ops qk_avx512 = {
    .row = {{q4k_row8, q4k_row4, q4k_row1}, {q5k_row8, q5k_row4, q5k_row1}, {q6k_row8, q6k_row4, q6k_row1},
            {iq4xs_row8, iq4xs_row4, iq4xs_row1}},
    .rows4 = {q4k_rows4, q5k_rows4, q6k_rows4_zmm, iq4xs_rows4},
    .p4 = {{q4k_p4_t8, q4k_p4_t4, q4k_p4_t1z}, {q5k_p4_t8, q5k_p4_t4, q5k_p4_t1z}},
    .q6x4 = {q6k_x4_t8, q6k_x4_t4},
    .pack = p4_pack_avx2,
};

static const struct q_ops ops_avx2 = {
    .quant_block = quant_block_avx2,
    .quant_k_block = quant_k_block_avx2,
    .q8 = q8_avx2,
    .qk = &qk_avx2,
};

static const struct q_ops ops_avx512 = {
    .quant_block = quant_block_avx2,
    .quant_k_block = quant_k_block_avx2,
    .q8 = q8_avx512,
    .qk = &qk_avx512,
};
#endif

static const struct q_ops *const isa_ops[KVT_ISA_COUNT] = {
#ifdef KVT_HAVE_X86
    [KVT_ISA_SCALAR] = &ops_scalar, [KVT_ISA_AVX2] = &ops_avx2, [KVT_ISA_AVX512] = &ops_avx512,
#else
    [KVT_ISA_SCALAR] = &ops_scalar, [KVT_ISA_AVX2] = &ops_scalar, [KVT_ISA_AVX512] = &ops_scalar,
#endif
};

static const struct q_ops *ops(void) { return isa_ops[kvt_cpu_isa()]; }
