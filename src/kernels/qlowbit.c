/* Integer kernels for the low-bit types (qlowbit.h): Q2_K, Q3_K, the
 * IQ1/IQ2/IQ3 i-quants, TQ1_0 and TQ2_0, against the Q8_K activations
 * qkernels.c quantised (kernels/q8k.h). Kept apart from qkernels.c because
 * these types share nothing with the others but the activations: their
 * weights are unpacked (or built in registers) to integer magnitudes, signs
 * and scales, then summed exactly.
 *
 * Each instruction set has one static const row of kernels (struct lb_ops,
 * at the end of the file), chosen by kernels/cpu.h as in qkernels.c; NULL
 * members fall back to the scalar loops, which every other path equals bit
 * for bit. */
#include "kernels/qlowbit.h"
#include "base/util.h"
#include "format/gguf.h"
#include "format/iqgrid.h"
#include "format/quant.h"
#include "kernels/cpu.h"
#include "kernels/q8k.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVT_HAVE_X86 1
#endif

#define QKK KVT_Q8K_N

typedef kvt_q8k kact;

struct lb_grid;
/* One row against T <= LB_T tokens (a), out[t] (the SIMD paths). */
typedef void (*lb_row_fn)(uint32_t ty, const uint8_t *row, size_t nsb, size_t bytes, const kact *a, size_t T,
                          float *out, const struct lb_grid *grid);
/* Four rows (row_bytes apart) against one token, out[0 .. 3] (decode). */
typedef void (*lb_rows4_fn)(uint32_t ty, const uint8_t *row, size_t row_bytes, size_t nsb, size_t bytes,
                            const kact *a, float *out, const struct lb_grid *grid);
/* LB_PR rows (row_bytes apart) against T <= LB_T tokens (a), y[t * ldy + r]
 * (prefill). */
typedef void (*lb_tile_fn)(uint32_t ty, const uint8_t *row, size_t row_bytes, size_t nsb, size_t bytes, const kact *a,
                           size_t T, float *y, size_t ldy, const struct lb_grid *grid);
/* The kernels of one instruction set; NULL: the scalar loops. */
struct lb_ops {
    lb_row_fn row;     /* one row against up to LB_T tokens */
    lb_rows4_fn rows4; /* decode: four rows a call; NULL: row */
    lb_tile_fn tile;   /* prefill: LB_PR rows a call (then row for the rest); NULL: row */
};
/* Below this many tokens a matmul runs rows4 per token (decode). */
#define LB_ROWS4_BELOW 4
/* From this many tokens a matmul runs tile where there is one (VNNI): its
 * panels cost about as much to build as ten tokens' dot products in row
 * (IQ2_XXS 2048 x 4096, 1 thread: 8 tokens 1.14 ms against 0.90, 10 even,
 * 12 1.32 against 1.56, 64 3.2 against 11.6). */
#define LB_TILE_FROM 11
static const struct lb_ops *ops(void);

#ifdef KVT_HAVE_X86
__attribute__((target("avx2"))) static inline int32_t hsum_i32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

/* ---- unpacking and the scalar sums ----
 *
 * Each superblock of 256 is first unpacked (lb_unpack, shared by every
 * path) into 256 magnitudes (u8, at most 62), their signs (+1 / -1), a
 * scale per 16 (int16; Q2_K also a min per 16) and the float factor d of
 * the superblock, such that element i is d * sc[i / 16] * sgn[i] * mag[i]
 * (Q2_K: minus dmin * mn[i / 16]) exactly as quant.c dequantises it:
 *   Q2_K     d, dmin        sc, mn the nibbles; mag the 2-bit q
 *   Q3_K     d              sc the 6-bit scale - 32; sgn * mag the q in -4 .. 3
 *   IQ2_*    d / 8          sc 2 ls + 1 (d (0.5 + ls) / 4 = d / 8 (2 ls + 1))
 *   IQ3_XXS  d / 4          sc 2 ls + 1
 *   IQ3_S    d              sc 2 ls + 1
 *   IQ1_*    d / 8          sc 2 s + 1; sgn * mag = 8 g +- 1 (dl (g +- 1/8))
 *   TQ1_0, TQ2_0  d         sc 1; sgn * mag = t - 1
 * The dot product against a token's Q8_K superblock is then the exact
 * integer isum = sum_g sc[g] sum_16 sgn mag q (and msum = sum_g mn[g]
 * bsum[g]), |isum| < 2^31 for every type (at most 256 * 62 * 127 * 31),
 * and acc = fma(d * d_x, isum, acc) (Q2_K then acc = fma(-(dmin * d_x),
 * msum, acc)) per superblock in increasing order, as for the other
 * K-quants. The AVX2 and AVX-512 paths differ only in how they sum the
 * integers (maddubs of the magnitudes against the signed activations:
 * |pair| <= 2 * 62 * 127, no saturation) and in how many rows and tokens
 * share a load (prefill: a row's superblock built once for up to LB_T
 * tokens; decode: four rows against a token), so they give the same bits.
 *
 * Where the time goes (AVX-512, 64 tokens): the maddubs/madd/add steps
 * (and the signs' subtraction) per 64 weights and token, then per
 * superblock and token the sum of 16 lanes and one fma; weights offset by
 * 64 (the signs moved to a 16-sum correction) and a table of the tokens'
 * scales measured no faster. With AVX-512 VNNI a prefill of at least
 * LB_TILE_FROM tokens instead decodes 16 rows' superblock once into int8
 * panels and multiplies them with vpdpbusd (lb_tile_vnni, below): the dot
 * product alone per token, about a third of the instructions, the panel's
 * build about ten tokens' worth. */

int kvt_q_fault;

typedef struct lb_sb {
    uint8_t mag[QKK];
    int8_t sgn[QKK];
    int16_t sc[16], mn[16];
    float d, dmin;
} lb_sb;

static bool lb_type(uint32_t t)
{
    return t == KVT_GGML_Q2_K || t == KVT_GGML_Q3_K || t == KVT_GGML_IQ2_XXS || t == KVT_GGML_IQ2_XS ||
           t == KVT_GGML_IQ2_S || t == KVT_GGML_IQ3_XXS || t == KVT_GGML_IQ3_S || t == KVT_GGML_IQ1_S ||
           t == KVT_GGML_IQ1_M || t == KVT_GGML_TQ1_0 || t == KVT_GGML_TQ2_0;
}

static size_t lb_bytes(uint32_t t)
{
    size_t b = 0;
    kvt_quant_block(t, NULL, &b);
    return b;
}

/* Sign bits s (bit j: byte j negative) as 8 bytes of -1 (0xff) or +1. */
static inline uint64_t lb_signs(uint8_t s) { return kvt_iqgrid_sign8[s]; }

/* 8 grid magnitudes and the sign bits s (bit j: element j negative). */
static inline void lb_put8(lb_sb *u, int at, const uint8_t *grid, uint8_t s)
{
    uint64_t sg = lb_signs(s);
    memcpy(u->mag + at, grid, 8);
    memcpy(u->sgn + at, &sg, 8);
}

static inline void lb_put4(lb_sb *u, int at, const uint8_t *grid, uint8_t s)
{
    uint64_t sg = lb_signs(s);
    memcpy(u->mag + at, grid, 4);
    memcpy(u->sgn + at, &sg, 4);
}

#define LB_ONES 0x0101010101010101ull

/* 8 IQ1 values 8 g + delta (g in -1, 0, 1; delta -1 or +1), a byte each in
 * u64 lanes: N marks g = -1, P g = 1; with delta +1 the magnitudes are 7,
 * 1, 9 (negative for g = -1), with delta -1 9, 1, 7 (negative unless g =
 * 1). */
static inline void lb_put_iq1(lb_sb *u, int at, const int8_t *grid, bool neg)
{
    uint64_t g, n, p, mag, m, sel = -(uint64_t)neg; /* a select, not a branch: delta's sign is data */
    memcpy(&g, grid, 8);
    n = (g >> 7) & LB_ONES;
    p = (g & LB_ONES) ^ n;
    mag = LB_ONES + 6 * n + 8 * p;
    mag ^= (mag ^ (LB_ONES + 8 * n + 6 * p)) & sel;
    m = n ^ ((n ^ (p ^ LB_ONES)) & sel);
    m = m * 0xfe | LB_ONES;
    memcpy(u->mag + at, &mag, 8);
    memcpy(u->sgn + at, &m, 8);
}

/* Q3_K's sixteen 6-bit scales (minus 32) from its 12 bytes: scale i's low
 * 4 bits the nibble i / 8 of byte i % 8, its high 2 bits bits 2 (i / 4) of
 * byte 8 + i % 4. */
static inline void q3k_scales(const uint8_t *s, int16_t *sc)
{
    for (int i = 0; i < 16; i++)
        sc[i] = (int16_t)((((s[i % 8] >> 4 * (i / 8)) & 15) | ((s[8 + i % 4] >> 2 * (i / 4)) & 3) << 4) - 32);
    if (kvt_q_fault == KVT_QUANT_FAULT_SCALE) sc[5] += 1; /* tests */
}

static void lb_unpack(uint32_t t, const uint8_t *w, lb_sb *u)
{
    memset(u->mn, 0, sizeof u->mn);
    u->dmin = 0;
    switch (t) {
    case KVT_GGML_Q2_K:
        u->d = kvt_f16_to_f32(kvt_rd16(w + 80));
        u->dmin = kvt_f16_to_f32(kvt_rd16(w + 82));
        for (int g = 0; g < 16; g++) u->sc[g] = (int16_t)(w[g] & 15), u->mn[g] = (int16_t)(w[g] >> 4);
        memset(u->sgn, 1, QKK);
        /* element 128 h + 32 r + 16 k + l: bits 2r of qs[32 h + 16 k + l],
         * 8 bytes of qs a u64 */
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < 4; r++)
                for (int j = 0; j < 32; j += 8) {
                    uint64_t q;
                    memcpy(&q, w + 16 + 32 * h + j, 8);
                    q = (q >> 2 * r) & (3 * LB_ONES);
                    memcpy(u->mag + 128 * h + 32 * r + j, &q, 8);
                }
        return;
    case KVT_GGML_Q3_K: {
        u->d = kvt_f16_to_f32(kvt_rd16(w + 108));
        q3k_scales(w + 96, u->sc);
        /* element 128 h + 32 r + j: low bits 2r of qs[32 h + j], the third
         * bit 4h + r of hmask[j]; a clear one makes q = low - 4 (magnitude
         * 4 - low, negative). 8 elements a u64. */
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < 4; r++)
                for (int j = 0; j < 32; j += 8) {
                    uint64_t lo, hm, clear, mask, mag, sg;
                    memcpy(&lo, w + 32 + 32 * h + j, 8);
                    memcpy(&hm, w + j, 8);
                    lo = (lo >> 2 * r) & (3 * LB_ONES);
                    clear = ((hm >> (4 * h + r)) & LB_ONES) ^ LB_ONES;
                    mask = clear * 0xff;
                    mag = (lo & ~mask) | ((4 * LB_ONES - lo) & mask);
                    sg = clear * 0xfe | LB_ONES;
                    memcpy(u->mag + 128 * h + 32 * r + j, &mag, 8);
                    memcpy(u->sgn + 128 * h + 32 * r + j, &sg, 8);
                }
        return;
    }
    case KVT_GGML_IQ2_XXS:
        u->d = kvt_f16_to_f32(kvt_rd16(w)) * 0.125f;
        for (int i = 0; i < 8; i++) {
            const uint8_t *g = w + 2 + 8 * i;
            uint32_t aux = kvt_rd32(g + 4);
            u->sc[2 * i] = u->sc[2 * i + 1] = (int16_t)(2 * (aux >> 28) + 1);
            for (int l = 0; l < 4; l++) {
                const uint8_t *grid = kvt_iqgrid_iq2xxs[g[l]];
                if (kvt_q_fault == KVT_QUANT_FAULT_GRID && g[l] == 77) grid = kvt_iqgrid_iq2xxs[78]; /* tests */
                lb_put8(u, 32 * i + 8 * l, grid, kvt_iqgrid_ksigns[(aux >> 7 * l) & 127]);
            }
        }
        return;
    case KVT_GGML_IQ2_XS:
        u->d = kvt_f16_to_f32(kvt_rd16(w)) * 0.125f;
        for (int i = 0; i < 8; i++) {
            u->sc[2 * i] = (int16_t)(2 * (w[66 + i] & 15) + 1);
            u->sc[2 * i + 1] = (int16_t)(2 * (w[66 + i] >> 4) + 1);
            for (int l = 0; l < 4; l++) {
                uint16_t q = kvt_rd16(w + 2 + 2 * (4 * i + l));
                lb_put8(u, 32 * i + 8 * l, kvt_iqgrid_iq2xs[q & 511], kvt_iqgrid_ksigns[q >> 9]);
            }
        }
        return;
    case KVT_GGML_IQ2_S:
        u->d = kvt_f16_to_f32(kvt_rd16(w)) * 0.125f;
        for (int i = 0; i < 8; i++) {
            u->sc[2 * i] = (int16_t)(2 * (w[74 + i] & 15) + 1);
            u->sc[2 * i + 1] = (int16_t)(2 * (w[74 + i] >> 4) + 1);
            for (int l = 0; l < 4; l++)
                lb_put8(u, 32 * i + 8 * l, kvt_iqgrid_iq2s[w[2 + 4 * i + l] | ((w[66 + i] >> 2 * l) & 3) << 8],
                        w[34 + 4 * i + l]);
        }
        return;
    case KVT_GGML_IQ3_XXS:
        u->d = kvt_f16_to_f32(kvt_rd16(w)) * 0.25f;
        for (int i = 0; i < 8; i++) {
            const uint8_t *qs = w + 2 + 8 * i;
            uint32_t aux = kvt_rd32(w + 66 + 4 * i);
            u->sc[2 * i] = u->sc[2 * i + 1] = (int16_t)(2 * (aux >> 28) + 1);
            for (int l = 0; l < 4; l++) {
                uint8_t s = kvt_iqgrid_ksigns[(aux >> 7 * l) & 127];
                lb_put4(u, 32 * i + 8 * l, kvt_iqgrid_iq3xxs[qs[2 * l]], s);
                lb_put4(u, 32 * i + 8 * l + 4, kvt_iqgrid_iq3xxs[qs[2 * l + 1]], (uint8_t)(s >> 4));
            }
        }
        return;
    case KVT_GGML_IQ3_S:
        u->d = kvt_f16_to_f32(kvt_rd16(w));
        for (int i = 0; i < 8; i++) {
            u->sc[2 * i] = u->sc[2 * i + 1] = (int16_t)(2 * ((w[106 + i / 2] >> 4 * (i % 2)) & 15) + 1);
            uint8_t qh = w[66 + i];
            for (int l = 0; l < 4; l++) {
                int k = 8 * i + 2 * l;
                uint8_t s = w[74 + 4 * i + l];
                lb_put4(u, 32 * i + 8 * l, kvt_iqgrid_iq3s[w[2 + k] | ((qh >> 2 * l) & 1) << 8], s);
                lb_put4(u, 32 * i + 8 * l + 4, kvt_iqgrid_iq3s[w[3 + k] | ((qh >> (2 * l + 1)) & 1) << 8],
                        (uint8_t)(s >> 4));
            }
        }
        return;
    case KVT_GGML_IQ1_S:
        u->d = kvt_f16_to_f32(kvt_rd16(w)) * 0.125f;
        for (int i = 0; i < 8; i++) {
            uint16_t qh = kvt_rd16(w + 34 + 2 * i);
            u->sc[2 * i] = u->sc[2 * i + 1] = (int16_t)(2 * ((qh >> 12) & 7) + 1);
            for (int l = 0; l < 4; l++)
                lb_put_iq1(u, 32 * i + 8 * l, kvt_iqgrid_iq1s[w[2 + 4 * i + l] | ((qh >> 3 * l) & 7) << 8], qh & 0x8000);
        }
        return;
    case KVT_GGML_TQ1_0:
    case KVT_GGML_TQ2_0: {
        /* t - 1 in -1 .. 1, one scale for all: magnitude |t - 1|, its sign */
        static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
        int8_t v[QKK];
        if (t == KVT_GGML_TQ2_0) {
            u->d = kvt_f16_to_f32(kvt_rd16(w + 64));
            for (int h = 0; h < 2; h++)
                for (int l = 0; l < 4; l++)
                    for (int m = 0; m < 32; m++) v[128 * h + 32 * l + m] = (int8_t)(((w[32 * h + m] >> 2 * l) & 3) - 1);
        } else {
            u->d = kvt_f16_to_f32(kvt_rd16(w + 52));
            for (int n = 0; n < 5; n++)
                for (int m = 0; m < 32; m++) v[32 * n + m] = (int8_t)((((uint8_t)(w[m] * pow3[n]) * 3) >> 8) - 1);
            for (int n = 0; n < 5; n++)
                for (int m = 0; m < 16; m++)
                    v[160 + 16 * n + m] = (int8_t)((((uint8_t)(w[32 + m] * pow3[n]) * 3) >> 8) - 1);
            for (int n = 0; n < 4; n++)
                for (int j = 0; j < 4; j++) v[240 + 4 * n + j] = (int8_t)((((uint8_t)(w[48 + j] * pow3[n]) * 3) >> 8) - 1);
        }
        for (int i = 0; i < QKK; i++) u->mag[i] = (uint8_t)(v[i] < 0 ? -v[i] : v[i]), u->sgn[i] = v[i] < 0 ? -1 : 1;
        for (int g = 0; g < 16; g++) u->sc[g] = 1;
        return;
    }
    case KVT_GGML_IQ1_M: {
        const uint8_t *sc = w + 48;
        uint16_t s[4];
        for (int k = 0; k < 4; k++) s[k] = kvt_rd16(sc + 2 * k);
        u->d = kvt_f16_to_f32((uint16_t)((s[0] >> 12) | ((s[1] >> 8) & 0x00f0) | ((s[2] >> 4) & 0x0f00) |
                                         (s[3] & 0xf000))) * 0.125f;
        for (int i = 0; i < 8; i++) {
            uint16_t wd = s[i / 2];
            u->sc[2 * i] = (int16_t)(2 * ((wd >> (6 * (i % 2))) & 7) + 1);
            u->sc[2 * i + 1] = (int16_t)(2 * ((wd >> (6 * (i % 2) + 3)) & 7) + 1);
            for (int l = 0; l < 4; l++) {
                uint8_t h = (uint8_t)(w[32 + 2 * i + l / 2] >> 4 * (l % 2));
                lb_put_iq1(u, 32 * i + 8 * l, kvt_iqgrid_iq1s[w[4 * i + l] | (h & 7) << 8], h & 8);
            }
        }
        return;
    }
    }
}

/* An unpacked superblock against token a's superblock b: the scaled sum
 * and the min sum (both exact integers). */
static void lb_ints_scalar(const lb_sb *u, const kact *a, size_t b, int32_t *isum, int32_t *msum)
{
    const int8_t *q = a->q + QKK * b;
    const int16_t *bs = a->bs + 16 * b;
    int32_t is = 0, ms = 0;
    for (int g = 0; g < 16; g++) {
        int32_t s = 0;
        for (int l = 0; l < 16; l++) s += u->sgn[16 * g + l] * u->mag[16 * g + l] * q[16 * g + l];
        is += u->sc[g] * s;
        ms += u->mn[g] * bs[g];
    }
    *isum = is;
    *msum = ms;
}

/* The iq2_xxs codebook the kernels read: the format's, or (kvt_q_fault
 * KVT_QUANT_FAULT_GRID, tests) a copy with entry 78 at 77, so that the
 * fused kernels below show the fault too. */
struct lb_grid { uint8_t iq2xxs[256][8]; };

static const struct lb_grid *lb_grid_for(void)
{
    static struct lb_grid faulty;
    if (kvt_q_fault != KVT_QUANT_FAULT_GRID) return (const struct lb_grid *)kvt_iqgrid_iq2xxs;
    memcpy(faulty.iq2xxs, kvt_iqgrid_iq2xxs, sizeof faulty.iq2xxs); /* tests only, before the threads start */
    memcpy(faulty.iq2xxs[77], kvt_iqgrid_iq2xxs[78], 8);
    return &faulty;
}

/* The most tokens whose accumulators a row keeps at once. */
#define LB_T 64
/* The rows whose outputs lb_range keeps before it writes them, token by token. */
#define LB_OB 8

#ifdef KVT_HAVE_X86
/* Lane t of the result: the sum of v[t]'s eight lanes (exact). */
__attribute__((target("avx2"), always_inline)) static inline __m256i lb_sum8(const __m256i *v)
{
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
}

/* The weights of 32 k of a superblock, for maddubs: their magnitudes m,
 * their signs s (+1 / -1 bytes, for sign_epi8 on the activations; Q2_K's
 * all +1, unused) and the two groups' scales sc (int16, group 2 k in the
 * low 128-bit lane); sc16 holds Q3_K's sixteen scales (q3k_scales). Built
 * in registers from the block w itself for Q2_K (bits 2r of qs[32h ..]),
 * Q3_K (those and the third bit 4h + r of hmask, a clear one subtracting
 * 4) and IQ2_XXS (four codebook entries and four sign bytes); from the
 * unpacked copy u for the others. */
__attribute__((target("avx2"), always_inline)) static inline void lbv_weights(const uint32_t ty, const uint8_t *w,
                                                                             const lb_sb *u,
                                                                             const struct lb_grid *grid,
                                                                             const int16_t *sc16, int k, __m256i *m,
                                                                             __m256i *s, __m256i *sc)
{
    int h = k / 4, r = k % 4;
    *s = _mm256_set1_epi8(1);
    if (ty == KVT_GGML_Q2_K) {
        *m = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(w + 16 + 32 * h)), 2 * r),
                              _mm256_set1_epi8(3));
        *sc = _mm256_set_m128i(_mm_set1_epi16((short)(w[2 * k + 1] & 15)), _mm_set1_epi16((short)(w[2 * k] & 15)));
    } else if (ty == KVT_GGML_Q3_K) {
        __m256i lo = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(w + 32 + 32 * h)), 2 * r),
                                      _mm256_set1_epi8(3));
        __m256i clear = _mm256_cmpeq_epi8(
            _mm256_and_si256(_mm256_loadu_si256((const __m256i *)w), _mm256_set1_epi8((char)(1 << (4 * h + r)))),
            _mm256_setzero_si256());
        *s = _mm256_sub_epi8(lo, _mm256_and_si256(clear, _mm256_set1_epi8(4)));
        *m = _mm256_abs_epi8(*s);
        *sc = _mm256_set_m128i(_mm_set1_epi16(sc16[2 * k + 1]), _mm_set1_epi16(sc16[2 * k]));
    } else if (ty == KVT_GGML_IQ2_XXS) {
        const uint8_t *g = w + 2 + 8 * k;
        uint32_t aux = kvt_rd32(g + 4);
        *m = _mm256_set_epi64x((long long)kvt_rd64(grid->iq2xxs[g[3]]), (long long)kvt_rd64(grid->iq2xxs[g[2]]),
                               (long long)kvt_rd64(grid->iq2xxs[g[1]]), (long long)kvt_rd64(grid->iq2xxs[g[0]]));
        *s = _mm256_set_epi64x((long long)lb_signs(kvt_iqgrid_ksigns[(aux >> 21) & 127]),
                               (long long)lb_signs(kvt_iqgrid_ksigns[(aux >> 14) & 127]),
                               (long long)lb_signs(kvt_iqgrid_ksigns[(aux >> 7) & 127]),
                               (long long)lb_signs(kvt_iqgrid_ksigns[aux & 127]));
        *sc = _mm256_set1_epi16((short)(2 * (aux >> 28) + 1));
    } else {
        *m = _mm256_loadu_si256((const __m256i *)(u->mag + 32 * k));
        *s = _mm256_loadu_si256((const __m256i *)(u->sgn + 32 * k));
        *sc = _mm256_set_m128i(_mm_set1_epi16(u->sc[2 * k + 1]), _mm_set1_epi16(u->sc[2 * k]));
    }
}

/* Q2_K's min sum of superblock b against a token, as eight int32 lanes
 * (the high nibbles of scales[16] against the token's 16-sums). */
__attribute__((target("avx2"), always_inline)) static inline __m256i lbv_mins(const uint8_t *w, const kact *a,
                                                                             size_t b)
{
    __m256i mv = _mm256_cvtepu8_epi16(
        _mm_srli_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i *)w), _mm_set1_epi8((char)0xf0)), 4));
    return _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a->bs + 16 * b)), mv);
}

/* The integer sums of one superblock against T tokens, as eight int32
 * lanes per token whose total is lb_ints_scalar's isum (and, Q2_K only,
 * msum). Magnitudes go to maddubs against the activations with the
 * weights' signs (|pair| <= 2 * 62 * 127: no saturation), then madd with
 * the scales. */
__attribute__((target("avx2"), always_inline)) static inline void lb_vec_avx2(const uint32_t ty, const int T,
                                                                             const uint8_t *w, const lb_sb *u,
                                                                             const struct lb_grid *grid,
                                                                             const kact *a, size_t b, __m256i *is,
                                                                             __m256i *ms)
{
    _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) is[t] = _mm256_setzero_si256();
    int16_t sc16[16];
    if (ty == KVT_GGML_Q3_K) q3k_scales(w + 96, sc16);
    _Pragma("GCC unroll 8") for (int k = 0; k < 8; k++) {
        __m256i m, s, sc;
        lbv_weights(ty, w, u, grid, sc16, k, &m, &s, &sc);
        _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(a[t].q + QKK * b + 32 * k));
            if (ty != KVT_GGML_Q2_K) x = _mm256_sign_epi8(x, s);
            is[t] = _mm256_add_epi32(is[t], _mm256_madd_epi16(_mm256_maddubs_epi16(m, x), sc));
        }
    }
    if (ty == KVT_GGML_Q2_K) _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) ms[t] = lbv_mins(w, a + t, b);
}

/* A superblock's float factors: d (as lb_unpack's u->d) and Q2_K's dmin. */
__attribute__((target("avx2,f16c"), always_inline)) static inline float lb_d(const uint32_t ty, const uint8_t *w,
                                                                            const lb_sb *u, float *dmin)
{
    if (ty == KVT_GGML_Q2_K) {
        *dmin = _cvtsh_ss(kvt_rd16(w + 82));
        return _cvtsh_ss(kvt_rd16(w + 80));
    }
    *dmin = 0;
    if (ty == KVT_GGML_Q3_K) return _cvtsh_ss(kvt_rd16(w + 108));
    if (ty == KVT_GGML_IQ2_XXS) return _cvtsh_ss(kvt_rd16(w)) * 0.125f;
    return u->d;
}

static inline bool lb_fused(uint32_t ty)
{
    return ty == KVT_GGML_Q2_K || ty == KVT_GGML_Q3_K || ty == KVT_GGML_IQ2_XXS;
}

/* The float steps of superblock b for eight tokens ag[0 .. 7] of one row,
 * a lane each (lb_row_avx2 and lb_row_zmm share them): is[t] and (Q2_K)
 * ms[t] hold token t's integer sums in eight lanes; acc + d * dx * isum
 * (bump added: tests), then - dmin * dx * msum, each the scalar's fma. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 lb_end8(__m256 acc, const __m256i *is,
                                                                               const __m256i *ms, __m256i bump,
                                                                               float d, float dmin, bool q2,
                                                                               const kact *ag, size_t b)
{
    __m256 dx = _mm256_set_ps(ag[7].d[b], ag[6].d[b], ag[5].d[b], ag[4].d[b], ag[3].d[b], ag[2].d[b], ag[1].d[b],
                              ag[0].d[b]);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(d), dx), _mm256_cvtepi32_ps(_mm256_add_epi32(lb_sum8(is), bump)),
                          acc);
    if (q2) acc = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), dx), _mm256_cvtepi32_ps(lb_sum8(ms)), acc);
    return acc;
}

/* The same for one token a (its sums in eight lanes of is, ms). */
__attribute__((target("avx2,fma"), always_inline)) static inline float lb_end1(float acc, __m256i is, __m256i ms,
                                                                              float d, float dmin, bool q2,
                                                                              const kact *a, size_t b)
{
    float dx = a->d[b];
    acc = fmaf(d * dx, (float)hsum_i32(is), acc);
    if (q2) acc = fmaf(-(dmin * dx), (float)hsum_i32(ms), acc);
    return acc;
}

/* One row of type (ty: the same for the fused types, 0 for the others)
 * against T <= LB_T tokens: out[t] = lb_range's scalar sum, bit
 * for bit (the float steps per superblock in increasing order, each a
 * single fma). One token (decode): eight superblocks' integer sums at a
 * time, reduced to one vector (lb_sum8), then the fmas in order. More:
 * eight tokens a vector lane each, their fmas side by side (each lane the
 * scalar's fma of its token); the rest one at a time. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void lb_row_avx2(const uint32_t ty,
                                                                                      uint32_t type,
                                                                                      const uint8_t *row, size_t nsb,
                                                                                      size_t bytes, const kact *a,
                                                                                      size_t T, float *out,
                                                                                      const struct lb_grid *grid)
{
    lb_sb u;
    u.d = u.dmin = 0;
    const bool q2 = ty == KVT_GGML_Q2_K;
    const __m256i bump = _mm256_set_epi32(0, 0, 0, 0, kvt_q_fault == KVT_QUANT_FAULT_LANE, 0, 0, 0); /* tests: token 3 */
    if (T == 1) {
        float acc = 0;
        for (size_t b0 = 0; b0 < nsb; b0 += 8) {
            size_t nb = nsb - b0 < 8 ? nsb - b0 : 8;
            __m256i is[8], ms[8];
            float d[8], dm[8];
            for (size_t j = 0; j < 8; j++) {
                if (j >= nb) {
                    is[j] = ms[j] = _mm256_setzero_si256();
                    continue;
                }
                const uint8_t *w = row + (b0 + j) * bytes;
                _mm_prefetch((const char *)w + KVT_PF_AHEAD, _MM_HINT_T0);
                if (!lb_fused(ty)) lb_unpack(type, w, &u);
                lb_vec_avx2(ty, 1, w, &u, grid, a, b0 + j, is + j, ms + j);
                d[j] = lb_d(ty, w, &u, dm + j);
            }
            int32_t isum[8], msum[8];
            _mm256_storeu_si256((__m256i *)isum, lb_sum8(is));
            if (q2) _mm256_storeu_si256((__m256i *)msum, lb_sum8(ms));
            for (size_t j = 0; j < nb; j++) {
                float dx = a->d[b0 + j];
                acc = fmaf(d[j] * dx, (float)isum[j], acc);
                if (q2) acc = fmaf(-(dm[j] * dx), (float)msum[j], acc);
            }
        }
        *out = acc;
        return;
    }
    size_t G = T / 8, R = T % 8;
    __m256 acc[LB_T / 8];
    float acc1[8] = {0};
    for (size_t g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
    for (size_t b = 0; b < nsb; b++) {
        const uint8_t *w = row + b * bytes;
        if (!lb_fused(ty)) lb_unpack(type, w, &u);
        float dmin, d = lb_d(ty, w, &u, &dmin);
        for (size_t g = 0; g < G; g++) {
            const kact *ag = a + 8 * g;
            __m256i is[8], ms[8];
            lb_vec_avx2(ty, 8, w, &u, grid, ag, b, is, ms);
            acc[g] = lb_end8(acc[g], is, ms, bump, d, dmin, q2, ag, b);
        }
        for (size_t r = 0; r < R; r++) {
            const kact *ar = a + 8 * G + r;
            __m256i is, ms = _mm256_setzero_si256();
            lb_vec_avx2(ty, 1, w, &u, grid, ar, b, &is, &ms);
            acc1[r] = lb_end1(acc1[r], is, ms, d, dmin, q2, ar, b);
        }
    }
    for (size_t g = 0; g < G; g++) _mm256_storeu_ps(out + 8 * g, acc[g]);
    for (size_t r = 0; r < R; r++) out[8 * G + r] = acc1[r];
}

/* How far the four-row decode kernels prefetch (in bytes: a later row's
 * superblock): at least the next four rows, and KVT_PF_AHEAD on in each
 * row's stream (qkernels.c's four-row kernels do the same). */
static inline size_t rows4_ahead(size_t row_bytes)
{
    return row_bytes * (row_bytes * 4 >= KVT_PF_AHEAD ? 4 : (KVT_PF_AHEAD + row_bytes - 1) / row_bytes);
}

/* The end of superblock b of four rows (lb_rows4_avx2, lb_rows4_zmm): h
 * holds the rows' integer sums in pairs of lanes; each row's sum (bump
 * added: tests) times its scale d and the token's, and Q2_K's mins times
 * -(dmin * the token's scale), into the row's lane of acc4. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m128 lb_rows4_block_end(
    __m128 acc4, __m256i h, __m128i bump, const float d[4], const float dm[4], bool q2, const uint8_t *const wr[4],
    const kact *a, size_t b)
{
    __m128i is = _mm_add_epi32(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)), bump);
    __m128 dx = _mm_set1_ps(a->d[b]);
    acc4 = _mm_fmadd_ps(_mm_mul_ps(_mm_loadu_ps(d), dx), _mm_cvtepi32_ps(is), acc4);
    if (q2) {
        __m256i mh = _mm256_hadd_epi32(_mm256_hadd_epi32(lbv_mins(wr[0], a, b), lbv_mins(wr[1], a, b)),
                                       _mm256_hadd_epi32(lbv_mins(wr[2], a, b), lbv_mins(wr[3], a, b)));
        __m128i ms = _mm_add_epi32(_mm256_castsi256_si128(mh), _mm256_extracti128_si256(mh, 1));
        __m128 ndm = _mm_xor_ps(_mm_mul_ps(_mm_loadu_ps(dm), dx), _mm_set1_ps(-0.0f)); /* -(dmin * dx) */
        acc4 = _mm_fmadd_ps(ndm, _mm_cvtepi32_ps(ms), acc4);
    }
    return acc4;
}

/* Four rows (row_bytes apart) against one token, for decode: each 32 of
 * the token's activations loaded once for the four rows, each row's
 * weights built in registers; the rows' integer sums reduced together and
 * each lane of acc4 a row's float chain (the scalar's fmas, four rows side
 * by side). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void lb_rows4_avx2(
    const uint32_t ty, uint32_t type, const uint8_t *row, size_t row_bytes, size_t nsb, size_t bytes, const kact *a,
    float *out, const struct lb_grid *grid)
{
    const bool q2 = ty == KVT_GGML_Q2_K;
    const size_t ahead = rows4_ahead(row_bytes);
    const __m128i bump = _mm_set_epi32(0, 0, kvt_q_fault == KVT_QUANT_FAULT_LANE, 0); /* tests: row 1 */
    __m128 acc4 = _mm_setzero_ps();
    lb_sb u[4];
    for (int r = 0; r < 4; r++) u[r].d = u[r].dmin = 0;
    for (size_t b = 0; b < nsb; b++) {
        const uint8_t *wr[4];
        __m256i acc[4];
        float d[4], dm[4] = {0};
        int16_t sc16[4][16];
        for (int r = 0; r < 4; r++) {
            const uint8_t *w = wr[r] = row + (size_t)r * row_bytes + b * bytes;
            for (size_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)(w + ahead + off), _MM_HINT_T0);
            if (!lb_fused(ty)) lb_unpack(type, w, u + r);
            if (ty == KVT_GGML_Q3_K) q3k_scales(w + 96, sc16[r]);
            d[r] = lb_d(ty, w, u + r, dm + r);
            acc[r] = _mm256_setzero_si256();
        }
        const int8_t *q = a->q + QKK * b;
        _Pragma("GCC unroll 8") for (int k = 0; k < 8; k++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(q + 32 * k));
            _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
                __m256i m, s, sc;
                lbv_weights(ty, wr[r], u + r, grid, sc16[r], k, &m, &s, &sc);
                __m256i xs = ty == KVT_GGML_Q2_K ? x : _mm256_sign_epi8(x, s);
                acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(m, xs), sc));
            }
        }
        __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]), _mm256_hadd_epi32(acc[2], acc[3]));
        acc4 = lb_rows4_block_end(acc4, h, bump, d, dm, q2, wr, a, b);
    }
    _mm_storeu_ps(out, acc4);
}

__attribute__((target("avx2,fma,f16c"))) static void lb_rows4_avx2_fn(uint32_t ty, const uint8_t *row,
                                                                     size_t row_bytes, size_t nsb, size_t bytes,
                                                                     const kact *a, float *out,
                                                                     const struct lb_grid *grid)
{
    switch (ty) {
    case KVT_GGML_Q2_K: lb_rows4_avx2(KVT_GGML_Q2_K, ty, row, row_bytes, nsb, bytes, a, out, grid); return;
    case KVT_GGML_Q3_K: lb_rows4_avx2(KVT_GGML_Q3_K, ty, row, row_bytes, nsb, bytes, a, out, grid); return;
    case KVT_GGML_IQ2_XXS: lb_rows4_avx2(KVT_GGML_IQ2_XXS, ty, row, row_bytes, nsb, bytes, a, out, grid); return;
    default: lb_rows4_avx2(0, ty, row, row_bytes, nsb, bytes, a, out, grid); return;
    }
}

/* The AVX2 row: the three fused types each compiled for its own, the
 * others through the unpacked copy. */
__attribute__((target("avx2,fma,f16c"))) static void lb_row_avx2_fn(uint32_t ty, const uint8_t *row, size_t nsb,
                                                                   size_t bytes, const kact *a, size_t T, float *out,
                                                                   const struct lb_grid *grid)
{
    switch (ty) {
    case KVT_GGML_Q2_K: lb_row_avx2(KVT_GGML_Q2_K, ty, row, nsb, bytes, a, T, out, grid); return;
    case KVT_GGML_Q3_K: lb_row_avx2(KVT_GGML_Q3_K, ty, row, nsb, bytes, a, T, out, grid); return;
    case KVT_GGML_IQ2_XXS: lb_row_avx2(KVT_GGML_IQ2_XXS, ty, row, nsb, bytes, a, T, out, grid); return;
    default: lb_row_avx2(0, ty, row, nsb, bytes, a, T, out, grid); return;
    }
}
/* ---- AVX-512BW ----
 *
 * The same integers in 512-bit vectors: vector j of a superblock holds its
 * elements 64 j .. 64 j + 63, so 128-bit lane l is group 4 j + l (one
 * scale). The weights' signs are a 64-bit mask (AVX-512 has no sign_epi8):
 * the activations they cover are negated (0 - x; |x| <= 127, so the same
 * integers as sign_epi8). Q2_K: the 32 bytes of qs[32 h ..] broadcast to
 * both halves, shifted by 2 r and 2 r + 2; Q3_K: the same with hmask's
 * bits 4 h + r and 4 h + r + 1; IQ2_XXS: eight codebook entries and eight
 * sign bytes (two of its 32s); the other types from lb_unpack's copy. */
#define LB_ZMM __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"), always_inline)) static inline

/* A superblock's 16 scales as int16 in a vector, for lbz_scale's picks:
 * words 0 .. 15 (IQ2_XXS: 2 (aux >> 28) + 1 in the low word of every odd
 * u32 of its 64 bytes of qs, aux k at word 4 k + 2, the other words
 * unused). Q3_K: q3k_scales in vectors (low nibbles of bytes 0 .. 7 then
 * their high ones; the high 2 bits from the u32 of bytes 8 .. 11 shifted by
 * 0, 2, 4, 6), with the tests' KVT_QUANT_FAULT_SCALE as there. */
LB_ZMM __m512i lbz_scales(const uint32_t ty, const uint8_t *w, const lb_sb *u)
{
    __m256i s;
    if (ty == KVT_GGML_Q2_K) {
        s = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i *)w), _mm_set1_epi8(15)));
    } else if (ty == KVT_GGML_Q3_K) {
        const __m128i m4 = _mm_set1_epi8(15);
        __m128i q = _mm_loadl_epi64((const __m128i *)(w + 96));
        __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(q, m4), _mm_and_si128(_mm_srli_epi16(q, 4), m4));
        __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)kvt_rd32(w + 104)), _mm_set_epi32(6, 4, 2, 0)),
                                   _mm_set1_epi8(3));
        s = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_or_si128(lo, _mm_slli_epi16(hi, 4))), _mm256_set1_epi16(32));
        if (kvt_q_fault == KVT_QUANT_FAULT_SCALE) /* tests: the sixth scale one more */
            s = _mm256_add_epi16(s, _mm256_setr_epi16(0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0));
    } else if (ty == KVT_GGML_IQ2_XXS) {
        __m512i a = _mm512_srli_epi32(_mm512_loadu_si512((const void *)(w + 2)), 28);
        return _mm512_add_epi32(_mm512_add_epi32(a, a), _mm512_set1_epi32(1));
    } else {
        s = _mm256_loadu_si256((const __m256i *)u->sc);
    }
    return _mm512_castsi256_si512(s);
}

/* Vector j's scales: lane l's eight words the scale of group 4 j + l
 * (IQ2_XXS: of aux 2 j + l / 2, lbz_scales). */
LB_ZMM __m512i lbz_scale(const uint32_t ty, __m512i s16, int j)
{
    const bool xxs = ty == KVT_GGML_IQ2_XXS;
    const __m512i idx = _mm512_add_epi16(
        xxs ? _mm512_set_epi64(0x0006000600060006ll, 0x0006000600060006ll, 0x0006000600060006ll, 0x0006000600060006ll,
                               0x0002000200020002ll, 0x0002000200020002ll, 0x0002000200020002ll, 0x0002000200020002ll)
            : _mm512_set_epi64(0x0003000300030003ll, 0x0003000300030003ll, 0x0002000200020002ll, 0x0002000200020002ll,
                               0x0001000100010001ll, 0x0001000100010001ll, 0, 0),
        _mm512_set1_epi16((short)((xxs ? 8 : 4) * j)));
    return _mm512_permutexvar_epi16(idx, s16);
}

/* Vector j's magnitudes (u8) and the mask of its negative weights. */
LB_ZMM __m512i lbz_weights(const uint32_t ty, const uint8_t *w, const lb_sb *u, const struct lb_grid *grid, int j,
                           __mmask64 *neg)
{
    const int h = j / 2, r = 2 * (j % 2);
    if (ty == KVT_GGML_Q2_K || ty == KVT_GGML_Q3_K) {
        const __m512i cnt = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * r)), _mm256_set1_epi16((short)(2 * r + 2)), 1);
        __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + (ty == KVT_GGML_Q2_K ? 16 : 32) + 32 * h)));
        __m512i lo = _mm512_and_si512(_mm512_srlv_epi16(q, cnt), _mm512_set1_epi8(3));
        if (ty == KVT_GGML_Q2_K) {
            *neg = 0;
            return lo;
        }
        const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (4 * h + r))),
                                               _mm256_set1_epi8((char)(1 << (4 * h + r + 1))), 1);
        __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)w));
        __mmask64 clear = _mm512_testn_epi8_mask(hm, bit); /* q = lo - 4 < 0: magnitude 4 - lo */
        *neg = clear;
        return _mm512_mask_sub_epi8(lo, clear, _mm512_set1_epi8(4), lo);
    }
    if (ty == KVT_GGML_IQ2_XXS) {
        /* the eight sign bytes ksigns[v] = v | parity(v) << 7 of the 7-bit
         * fields v computed side by side and packed to the mask (table
         * lookups in general registers cost a third more time); the eight
         * codebook entries loaded one by one (a gather was slower) */
        const uint8_t *g0 = w + 2 + 16 * j, *g1 = g0 + 8;
        uint32_t a0 = kvt_rd32(g0 + 4), a1 = kvt_rd32(g1 + 4);
        __m256i v = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_inserti128_si256(_mm256_set1_epi32((int)a0), _mm_set1_epi32((int)a1), 1),
                              _mm256_set_epi32(21, 14, 7, 0, 21, 14, 7, 0)),
            _mm256_set1_epi32(127));
        __m256i p = _mm256_xor_si256(v, _mm256_srli_epi32(v, 4));
        p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 2));
        p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 1));
        __m256i sb = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(p, _mm256_set1_epi32(1)), 7));
        *neg = (__mmask64)_mm_cvtsi128_si64(_mm256_cvtepi32_epi8(sb));
        return _mm512_set_epi64((long long)kvt_rd64(grid->iq2xxs[g1[3]]), (long long)kvt_rd64(grid->iq2xxs[g1[2]]),
                                (long long)kvt_rd64(grid->iq2xxs[g1[1]]), (long long)kvt_rd64(grid->iq2xxs[g1[0]]),
                                (long long)kvt_rd64(grid->iq2xxs[g0[3]]), (long long)kvt_rd64(grid->iq2xxs[g0[2]]),
                                (long long)kvt_rd64(grid->iq2xxs[g0[1]]), (long long)kvt_rd64(grid->iq2xxs[g0[0]]));
    }
    *neg = _mm512_movepi8_mask(_mm512_loadu_si512((const void *)(u->sgn + 64 * j)));
    return _mm512_loadu_si512((const void *)(u->mag + 64 * j));
}

/* acc + vector j's integers against activations x (64 int8). */
LB_ZMM __m512i lbz_dot(__m512i acc, __m512i m, __mmask64 neg, __m512i sc, __m512i x)
{
    x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(m, x), sc));
}

/* A zmm's sixteen int32 lanes folded to eight (exact). */
LB_ZMM __m256i lbz_fold(__m512i v)
{
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

/* Four rows (row_bytes apart) against one token, for decode: each
 * superblock's activations loaded once for the four rows, each row's
 * weights built in registers; the rows' integer sums reduced together and
 * each lane of acc4 a row's float chain (the scalar's fmas, four rows side
 * by side). */
LB_ZMM void lb_rows4_zmm(const uint32_t ty, uint32_t type, const uint8_t *row, size_t row_bytes, size_t nsb,
                         size_t bytes, const kact *a, float *out, const struct lb_grid *grid)
{
    const bool q2 = ty == KVT_GGML_Q2_K;
    const size_t ahead = rows4_ahead(row_bytes);
    const __m128i bump = _mm_set_epi32(0, 0, kvt_q_fault == KVT_QUANT_FAULT_LANE, 0); /* tests: row 1 */
    __m128 acc4 = _mm_setzero_ps();
    lb_sb u[4];
    for (int r = 0; r < 4; r++) u[r].d = u[r].dmin = 0;
    for (size_t b = 0; b < nsb; b++) {
        const uint8_t *wr[4];
        __m512i s16[4], acc[4];
        float d[4], dm[4] = {0};
        for (int r = 0; r < 4; r++) {
            const uint8_t *w = wr[r] = row + (size_t)r * row_bytes + b * bytes;
            for (size_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)(w + ahead + off), _MM_HINT_T0);
            if (!lb_fused(ty)) lb_unpack(type, w, u + r);
            s16[r] = lbz_scales(ty, w, u + r);
            d[r] = lb_d(ty, w, u + r, dm + r);
            acc[r] = _mm512_setzero_si512();
        }
        const int8_t *q = a->q + QKK * b;
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {
            __m512i x = _mm512_loadu_si512((const void *)(q + 64 * j));
            _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
                __mmask64 neg;
                __m512i m = lbz_weights(ty, wr[r], u + r, grid, j, &neg);
                acc[r] = lbz_dot(acc[r], m, neg, lbz_scale(ty, s16[r], j), x);
            }
        }
        __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(lbz_fold(acc[0]), lbz_fold(acc[1])),
                                      _mm256_hadd_epi32(lbz_fold(acc[2]), lbz_fold(acc[3])));
        acc4 = lb_rows4_block_end(acc4, h, bump, d, dm, q2, wr, a, b);
    }
    _mm_storeu_ps(out, acc4);
}

/* One row against T <= LB_T tokens (prefill), as lb_row_avx2: each
 * superblock's weights built once into registers, then eight tokens a
 * vector lane each, the rest one at a time. */
LB_ZMM void lb_row_zmm(const uint32_t ty, uint32_t type, const uint8_t *row, size_t nsb, size_t bytes, const kact *a,
                       size_t T, float *out, const struct lb_grid *grid)
{
    lb_sb u;
    u.d = u.dmin = 0;
    const bool q2 = ty == KVT_GGML_Q2_K;
    const __m256i bump = _mm256_set_epi32(0, 0, 0, 0, kvt_q_fault == KVT_QUANT_FAULT_LANE, 0, 0, 0); /* tests: token 3 */
    size_t G = T / 8, R = T % 8;
    __m256 acc[LB_T / 8];
    float acc1[8] = {0};
    for (size_t g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
    for (size_t b = 0; b < nsb; b++) {
        const uint8_t *w = row + b * bytes;
        if (!lb_fused(ty)) lb_unpack(type, w, &u);
        float dmin, d = lb_d(ty, w, &u, &dmin);
        __m512i s16 = lbz_scales(ty, w, &u), m[4], sc[4];
        __mmask64 neg[4];
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {
            m[j] = lbz_weights(ty, w, &u, grid, j, neg + j);
            sc[j] = lbz_scale(ty, s16, j);
        }
        for (size_t g = 0; g < G; g++) {
            const kact *ag = a + 8 * g;
            __m256i is[8], ms[8];
            _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) {
                const int8_t *q = ag[t].q + QKK * b;
                __m512i v = _mm512_setzero_si512();
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)
                    v = lbz_dot(v, m[j], neg[j], sc[j], _mm512_loadu_si512((const void *)(q + 64 * j)));
                is[t] = lbz_fold(v);
                if (q2) ms[t] = lbv_mins(w, ag + t, b);
            }
            acc[g] = lb_end8(acc[g], is, ms, bump, d, dmin, q2, ag, b);
        }
        for (size_t r = 0; r < R; r++) {
            const kact *ar = a + 8 * G + r;
            const int8_t *q = ar->q + QKK * b;
            __m512i v = _mm512_setzero_si512();
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)
                v = lbz_dot(v, m[j], neg[j], sc[j], _mm512_loadu_si512((const void *)(q + 64 * j)));
            acc1[r] = lb_end1(acc1[r], lbz_fold(v), q2 ? lbv_mins(w, ar, b) : _mm256_setzero_si256(), d, dmin, q2, ar,
                              b);
        }
    }
    for (size_t g = 0; g < G; g++) _mm256_storeu_ps(out + 8 * g, acc[g]);
    for (size_t r = 0; r < R; r++) out[8 * G + r] = acc1[r];
}

/* The AVX-512 kernels: the three fused types each compiled for its own,
 * the others through the unpacked copy. */
#define LB_ZMM_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw"))) static
LB_ZMM_FN void lb_row_zmm_fn(uint32_t ty, const uint8_t *row, size_t nsb, size_t bytes, const kact *a, size_t T,
                             float *out, const struct lb_grid *grid)
{
    switch (ty) {
    case KVT_GGML_Q2_K: lb_row_zmm(KVT_GGML_Q2_K, ty, row, nsb, bytes, a, T, out, grid); return;
    case KVT_GGML_Q3_K: lb_row_zmm(KVT_GGML_Q3_K, ty, row, nsb, bytes, a, T, out, grid); return;
    case KVT_GGML_IQ2_XXS: lb_row_zmm(KVT_GGML_IQ2_XXS, ty, row, nsb, bytes, a, T, out, grid); return;
    default: lb_row_zmm(0, ty, row, nsb, bytes, a, T, out, grid); return;
    }
}

LB_ZMM_FN void lb_rows4_zmm_fn(uint32_t ty, const uint8_t *row, size_t row_bytes, size_t nsb, size_t bytes,
                               const kact *a, float *out, const struct lb_grid *grid)
{
    switch (ty) {
    case KVT_GGML_Q2_K: lb_rows4_zmm(KVT_GGML_Q2_K, ty, row, row_bytes, nsb, bytes, a, out, grid); return;
    case KVT_GGML_Q3_K: lb_rows4_zmm(KVT_GGML_Q3_K, ty, row, row_bytes, nsb, bytes, a, out, grid); return;
    case KVT_GGML_IQ2_XXS: lb_rows4_zmm(KVT_GGML_IQ2_XXS, ty, row, row_bytes, nsb, bytes, a, out, grid); return;
    default: lb_rows4_zmm(0, ty, row, row_bytes, nsb, bytes, a, out, grid); return;
    }
}
#undef LB_ZMM_FN

/* ---- AVX-512 VNNI: the prefill's int8 panels ----
 *
 * For LB_PR = 16 rows at once, each superblock is decoded once into a
 * panel (lb_panel) whose vectors hold one int32 lane per row: w[c], lane r,
 * the four weights 4 c .. 4 c + 3 of row r as unsigned bytes (the signed
 * weight plus LB_OFF: every type's weights lie in -62 .. 62; Q2_K's, 0 ..
 * 3, stay as they are), so that one vpdpbusd against the token's four
 * activations 4 c .. 4 c + 3 (broadcast) adds those four products to each
 * row's lane. Per group of 16 (four such steps) the lanes are multiplied
 * by the rows' scales (vpmulld) and added; the offset comes back out as
 * -LB_OFF * sc[g] * bsum[g] for each group g of the token (its Q8_K sums
 * of 16), two groups a vpdpwssd (pr[k], lane r: the int16 pair -LB_OFF
 * sc[2 k], -LB_OFF sc[2 k + 1]; Q2_K's pair is its mins, whose sum is
 * msum). Every step is an exact integer sum (a group's offset sum is at
 * most 16 * 126 * 127 in size, times a scale of at most 32, sixteen groups
 * plus the correction: far inside int32), so the lane of row r ends at
 * lb_ints_scalar's isum; the float steps are the scalar's, sixteen rows a
 * vector, and a token's sixteen outputs are stored side by side. The
 * weights of the panel's rows are built as lb_row_zmm builds them, then
 * transposed (lbp_transpose); per token the work left is the dot product:
 * 64 vpdpbusd, 16 vpmulld and 8 vpdpwssd for 16 rows, where lb_row_zmm
 * spends about 20 instructions per row. */
#define LB_PR 16
#define LB_OFF 64
#define LB_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"), always_inline)) static inline

struct lb_panel {
    __m512i w[64]; /* (chunk of 4 weights, row), unsigned: weight + LB_OFF (Q2_K: weight) */
    __m512i sc[16]; /* (group, row) int32 scales */
    __m512i pr[8]; /* (pair of groups, row) int16 pairs: -LB_OFF * scales (Q2_K: mins) */
    float d[LB_PR], dm[LB_PR]; /* (row) */
};

/* r[i] lane j becomes r[j] lane i (a 16 x 16 transpose of int32). */
LB_VNNI void lbp_transpose(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* A superblock's sixteen scales as int32 lanes (lb_unpack's sc), and the
 * pairs lbp_tokens adds with the token's sums of 16: -LB_OFF * sc (Q2_K:
 * its mins, lb_unpack's mn) as int16 in the low 256 bits. In vectors for
 * the fused types (no scalar stores read back as a vector). */
LB_VNNI __m512i lbp_scales(const uint32_t ty, const uint8_t *w, const lb_sb *u, __m512i *pairs)
{
    __m512i sc;
    if (ty == KVT_GGML_Q2_K) {
        __m128i s = _mm_loadu_si128((const __m128i *)w);
        *pairs = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), _mm_set1_epi8(15))));
        return _mm512_cvtepu8_epi32(_mm_and_si128(s, _mm_set1_epi8(15)));
    }
    if (ty == KVT_GGML_IQ2_XXS) {
        /* aux k (bits 28 .. 31: its scale) the odd u32 2 k + 1 of qs */
        __m512i a = _mm512_permutexvar_epi32(_mm512_setr_epi32(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15),
                                             _mm512_srli_epi32(_mm512_loadu_si512((const void *)(w + 2)), 28));
        sc = _mm512_add_epi32(_mm512_add_epi32(a, a), _mm512_set1_epi32(1));
    } else if (ty == KVT_GGML_Q3_K) {
        sc = _mm512_cvtepi16_epi32(_mm512_castsi512_si256(lbz_scales(ty, w, u)));
    } else {
        sc = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)u->sc));
    }
    *pairs = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_mullo_epi32(sc, _mm512_set1_epi32(-LB_OFF))));
    return sc;
}

/* Panel p of superblock b of the LB_PR rows at row (row_bytes apart). */
LB_VNNI void lbp_build(const uint32_t ty, uint32_t type, const uint8_t *row, size_t row_bytes, size_t b, size_t bytes,
                       const struct lb_grid *grid, lb_sb *u, struct lb_panel *p)
{
    const bool q2 = ty == KVT_GGML_Q2_K;
    const uint8_t *wr[LB_PR];
    __m512i v[LB_PR], e[LB_PR];
    for (int r = 0; r < LB_PR; r++) {
        const uint8_t *w = wr[r] = row + (size_t)r * row_bytes + b * bytes;
        /* the same superblock of the next panel's rows (the next 16 rows) */
        for (size_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)(w + LB_PR * row_bytes + off), _MM_HINT_T0);
        if (!lb_fused(ty)) lb_unpack(type, w, u + r);
        v[r] = lbp_scales(ty, w, u + r, e + r);
        p->d[r] = lb_d(ty, w, u + r, p->dm + r);
    }
    lbp_transpose(v);
    for (int g = 0; g < 16; g++) p->sc[g] = v[g];
    lbp_transpose(e);
    for (int k = 0; k < 8; k++) p->pr[k] = e[k];
    for (int j = 0; j < 4; j++) {
        for (int r = 0; r < LB_PR; r++) {
            __mmask64 neg;
            __m512i m = lbz_weights(ty, wr[r], u + r, grid, j, &neg);
            v[r] = q2 ? m
                      : _mm512_mask_sub_epi8(_mm512_add_epi8(m, _mm512_set1_epi8(LB_OFF)), neg,
                                             _mm512_set1_epi8(LB_OFF), m);
        }
        lbp_transpose(v);
        for (int c = 0; c < 16; c++) p->w[16 * j + c] = v[c];
    }
}

/* NT tokens (a) against panel p of superblock b, into their outputs F[t]
 * (lane r: row r). bump: the tests' fault (one row's sum one more). */
LB_VNNI void lbp_tokens(const bool q2, const int NT, const struct lb_panel *p, const kact *a, size_t b, __m512 *F,
                        __m512i bump)
{
    __m512i is[8], ms[8];
    _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) is[t] = ms[t] = _mm512_setzero_si512();
    for (int g = 0; g < 16; g++) {
        const __m512i w0 = p->w[4 * g], w1 = p->w[4 * g + 1], w2 = p->w[4 * g + 2], w3 = p->w[4 * g + 3];
        const __m512i sc = p->sc[g];
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {
            const uint8_t *x = (const uint8_t *)(a[t].q + QKK * b + 16 * g);
            __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_set1_epi32((int)kvt_rd32(x)));
            s = _mm512_dpbusd_epi32(s, w1, _mm512_set1_epi32((int)kvt_rd32(x + 4)));
            s = _mm512_dpbusd_epi32(s, w2, _mm512_set1_epi32((int)kvt_rd32(x + 8)));
            s = _mm512_dpbusd_epi32(s, w3, _mm512_set1_epi32((int)kvt_rd32(x + 12)));
            is[t] = _mm512_add_epi32(is[t], _mm512_mullo_epi32(s, sc));
        }
    }
    _Pragma("GCC unroll 8") for (int k = 0; k < 8; k++) {
        const __m512i pr = p->pr[k];
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {
            __m512i bs = _mm512_set1_epi32((int)kvt_rd32((const uint8_t *)(a[t].bs + 16 * b + 2 * k)));
            if (q2) ms[t] = _mm512_dpwssd_epi32(ms[t], pr, bs);
            else is[t] = _mm512_dpwssd_epi32(is[t], pr, bs);
        }
    }
    const __m512 d = _mm512_loadu_ps(p->d), dm = _mm512_loadu_ps(p->dm);
    _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {
        __m512 dx = _mm512_set1_ps(a[t].d[b]);
        F[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(_mm512_add_epi32(is[t], bump)), F[t]);
        if (q2) F[t] = _mm512_fnmadd_ps(_mm512_mul_ps(dm, dx), _mm512_cvtepi32_ps(ms[t]), F[t]);
    }
}

/* LB_PR rows (row_bytes apart) against T <= LB_T tokens: y[t * ldy + r]. */
LB_VNNI void lb_tile_vnni(const uint32_t ty, uint32_t type, const uint8_t *row, size_t row_bytes, size_t nsb,
                          size_t bytes, const kact *a, size_t T, float *y, size_t ldy, const struct lb_grid *grid)
{
    const bool q2 = ty == KVT_GGML_Q2_K;
    const __m512i bump = _mm512_maskz_set1_epi32(kvt_q_fault == KVT_QUANT_FAULT_LANE ? 1 << 5 : 0, 1); /* tests: row 5 */
    struct lb_panel p;
    lb_sb u[lb_fused(ty) ? 1 : LB_PR];
    __m512 F[LB_T];
    for (size_t t = 0; t < T; t++) F[t] = _mm512_setzero_ps();
    for (size_t b = 0; b < nsb; b++) {
        lbp_build(ty, type, row, row_bytes, b, bytes, grid, u, &p);
        size_t t = 0;
        for (; t + 8 <= T; t += 8) lbp_tokens(q2, 8, &p, a + t, b, F + t, bump);
        for (; t + 4 <= T; t += 4) lbp_tokens(q2, 4, &p, a + t, b, F + t, bump);
        for (; t < T; t++) lbp_tokens(q2, 1, &p, a + t, b, F + t, bump);
    }
    for (size_t t = 0; t < T; t++) _mm512_storeu_ps(y + t * ldy, F[t]);
}

#define LB_VNNI_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"))) static
LB_VNNI_FN void lb_tile_vnni_fn(uint32_t ty, const uint8_t *row, size_t row_bytes, size_t nsb, size_t bytes,
                                const kact *a, size_t T, float *y, size_t ldy, const struct lb_grid *grid)
{
    switch (ty) {
    case KVT_GGML_Q2_K: lb_tile_vnni(KVT_GGML_Q2_K, ty, row, row_bytes, nsb, bytes, a, T, y, ldy, grid); return;
    case KVT_GGML_Q3_K: lb_tile_vnni(KVT_GGML_Q3_K, ty, row, row_bytes, nsb, bytes, a, T, y, ldy, grid); return;
    case KVT_GGML_IQ2_XXS: lb_tile_vnni(KVT_GGML_IQ2_XXS, ty, row, row_bytes, nsb, bytes, a, T, y, ldy, grid); return;
    default: lb_tile_vnni(0, ty, row, row_bytes, nsb, bytes, a, T, y, ldy, grid); return;
    }
}
#undef LB_VNNI_FN
#undef LB_VNNI
#undef LB_ZMM
#endif

struct lb_ctx { float *y; const kvt_wmat *W; const uint8_t *qx; size_t n; const struct lb_ops *k; const struct lb_grid *grid; };

static void lb_range(void *arg, size_t o0, size_t o1)
{
    const struct lb_ctx *c = arg;
    const kvt_wmat *W = c->W;
    uint32_t ty = W->type;
    size_t nsb = W->cols / QKK, bytes = lb_bytes(ty);
    lb_sb u;
    if (c->k->rows4 && c->n < LB_ROWS4_BELOW) {
        /* decode, and the few tokens of batched decodes: four rows a call,
         * each token's activations loaded once for the four */
        for (; o0 + 4 <= o1; o0 += 4)
            for (size_t t = 0; t < c->n; t++) {
                kact a = kvt_q8k_at(c->qx, t, W->cols);
                c->k->rows4(ty, W->data + o0 * W->row_bytes, W->row_bytes, nsb, bytes, &a, c->y + t * W->rows + o0,
                            c->grid);
            }
    }
    if (c->k->tile && c->n >= LB_TILE_FROM && o0 + LB_PR <= o1) {
        /* prefill: LB_PR rows a call, each superblock of theirs decoded
         * once for each block of up to LB_T tokens; the blocks outside, so
         * that a block's activations stay in the cache while the rows pass
         * (the other way round, 256 tokens took twice the time a token) */
        size_t o = o0;
        for (size_t t0 = 0; t0 < c->n; t0 += LB_T) {
            size_t T = c->n - t0 < LB_T ? c->n - t0 : LB_T;
            kact a[LB_T];
            for (size_t k = 0; k < T; k++) a[k] = kvt_q8k_at(c->qx, t0 + k, W->cols);
            for (o = o0; o + LB_PR <= o1; o += LB_PR)
                c->k->tile(ty, W->data + o * W->row_bytes, W->row_bytes, nsb, bytes, a, T, c->y + t0 * W->rows + o,
                           W->rows, c->grid);
        }
        o0 = o;
    }
    /* LB_OB rows at a time against each block of up to LB_T tokens: the
     * block's activations found once for the rows, and each token's
     * outputs written LB_OB side by side (one at a time, the stores a
     * row apart touched a cache line each: a fifth of a prefill's time) */
    for (size_t ob = o0; ob < o1; ob += LB_OB) {
        size_t R = o1 - ob < LB_OB ? o1 - ob : LB_OB;
        for (size_t t0 = 0; t0 < c->n; t0 += LB_T) {
            size_t T = c->n - t0 < LB_T ? c->n - t0 : LB_T;
            kact a[LB_T];
            float acc[LB_OB][LB_T]; /* (row, token) */
            for (size_t k = 0; k < T; k++) a[k] = kvt_q8k_at(c->qx, t0 + k, W->cols);
            for (size_t r = 0; r < R; r++) {
                const uint8_t *row = W->data + (ob + r) * W->row_bytes;
                float *out = acc[r];
                if (c->k->row) {
                    c->k->row(ty, row, nsb, bytes, a, T, out, c->grid); /* writes out[0 .. T) */
                    continue;
                }
                for (size_t k = 0; k < T; k++) out[k] = 0;
                for (size_t b = 0; b < nsb; b++) {
                    int32_t is[LB_T], ms[LB_T];
                    lb_unpack(ty, row + b * bytes, &u);
                    for (size_t k = 0; k < T; k++) lb_ints_scalar(&u, a + k, b, is + k, ms + k);
                    for (size_t k = 0; k < T; k++) {
                        float dx = a[k].d[b];
                        out[k] = fmaf(u.d * dx, (float)is[k], out[k]);
                        if (ty == KVT_GGML_Q2_K) out[k] = fmaf(-(u.dmin * dx), (float)ms[k], out[k]);
                    }
                }
            }
            for (size_t k = 0; k < T; k++) {
                float *y = c->y + (t0 + k) * W->rows + ob;
                for (size_t r = 0; r < R; r++) y[r] = acc[r][k];
            }
        }
    }
}

bool kvt_qlowbit_supported(uint32_t wtype) { return lb_type(wtype); }

void kvt_qlowbit_matmul(kvt_pool *pool, float *y, const kvt_wmat *W, size_t n, const uint8_t *qx)
{
    size_t per_out = n * W->cols;
    size_t min = per_out ? (32768 + per_out - 1) / per_out : W->rows;
    struct lb_ctx c = {y, W, qx, n, ops(), lb_grid_for()};
    kvt_pool_for(pool, W->rows, min, lb_range, &c);
}

/* ---- the kernels of each instruction set ---- */

static const struct lb_ops ops_scalar = {0};

#ifdef KVT_HAVE_X86
static const struct lb_ops ops_avx2 = {
    .row = lb_row_avx2_fn,
    .rows4 = lb_rows4_avx2_fn,
};

/* AVX-512: every type in zmm, four rows a call in decode. */
static const struct lb_ops ops_avx512 = {
    .row = lb_row_zmm_fn,
    .rows4 = lb_rows4_zmm_fn,
};
#endif

static const struct lb_ops *const isa_ops[KVT_ISA_COUNT] = {
#ifdef KVT_HAVE_X86
    [KVT_ISA_SCALAR] = &ops_scalar, [KVT_ISA_AVX2] = &ops_avx2, [KVT_ISA_AVX512] = &ops_avx512,
#else
    [KVT_ISA_SCALAR] = &ops_scalar, [KVT_ISA_AVX2] = &ops_scalar, [KVT_ISA_AVX512] = &ops_scalar,
#endif
};

#ifdef KVT_HAVE_X86
/* AVX-512 with VNNI: the prefill's int8 panels. */
static const struct lb_ops ops_avx512_vnni = {
    .row = lb_row_zmm_fn,
    .rows4 = lb_rows4_zmm_fn,
    .tile = lb_tile_vnni_fn,
};
#endif

static const struct lb_ops *ops(void)
{
#ifdef KVT_HAVE_X86
    if (kvt_cpu_vnni()) return &ops_avx512_vnni;
#endif
    return isa_ops[kvt_cpu_isa()];
}
