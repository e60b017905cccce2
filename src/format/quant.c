/* ggml tensor types (see quant.h for the table of layouts): block shapes,
 * names, and dequantisation to f32.
 *
 * Why "bit for bit like ggml" holds, and what it rests on:
 *   - every value is the same sequence of single IEEE operations ggml's
 *     reference dequantisers perform (ggml-quants.c), with the same operands:
 *     an integer converted to float, times the same float scale, then the
 *     same subtraction or addition. One rounding per operation, no fused
 *     multiply-add (the Makefile builds with -ffp-contract=off; ggml's
 *     x86-64 base library has no FMA instructions either);
 *   - f16 scales convert exactly, NaNs quietened with their payload kept
 *     (kvt_f16_to_f32, the same bits as ggml's software conversion);
 *   - a NaN result takes its payload from the NaN operand. Where both
 *     operands of an addition can be NaN (q4_1, q5_1: q*d + m with NaN d and
 *     m) SSE returns the first operand, which in ggml's build is the product;
 *     a C compiler may swap the operands of +, so add_after_mul() makes that
 *     choice explicit. Everywhere else at most one operand can be NaN, or
 *     the operation (subtraction) has a fixed order. An invalid operation
 *     (inf * 0 with an infinite d, inf - inf) gives the x86 default NaN,
 *     ffc00000, here as in ggml.
 * Blocks are read byte by byte (kvt_rd16/32), so src needs no alignment. */
#include "format/quant.h"
#include "kvtier.h"
#include "base/util.h"
#include "format/iqgrid.h"

#include <math.h>
#include <string.h>

#define QK 32       /* elements in a q4_0 / q4_1 / q5_0 / q5_1 / q8_0 / iq4_nl / mxfp4 block */
#define QK_K 256    /* elements in a K-quant and iq4_xs super-block */

/* nb blocks at b -> (nb * elems) f32 at y. One call per run of blocks, not
 * per block: f16 and bf16 "blocks" are single elements. */
typedef void (*dequant_fn)(const uint8_t *b, float *y, size_t nb);

/* ---- value tables -------------------------------------------------------- */

/* The 16 iq4_nl levels (ggml-common.h kvalues_iq4nl), shared by iq4_xs. */
static const int8_t iq4nl_levels[16] = {
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
};

/* E2M1 (the OCP microscaling FP4 element) times two, so that every entry is
 * an integer: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (ggml-common.h
 * kvalues_mxfp4). The mxfp4 scale is halved to compensate. */
static const int8_t e2m1_x2[16] = {
    0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
};

static float f16_at(const uint8_t *p) { return kvt_f16_to_f32(kvt_rd16(p)); }

/* p + m where p is a product q*d: a NaN p wins over a NaN m, as in ggml's
 * x86 build, where p is the first operand of the addss (see the top). p,
 * being an arithmetic result, is already a quiet NaN. */
static float add_after_mul(float p, float m)
{
    float s = p + m;
    return isnan(p) ? p : s; /* a select, not a branch */
}

/* Each format is a function of one block (b -> y[elems]), and
 * BLOCKS(name, elems, bytes) makes deq_name, its loop over nb blocks, with
 * the block inlined. */
#define BLOCKS(name, elems, bytes)                                            \
    static void deq_##name(const uint8_t *b, float *y, size_t nb)             \
    {                                                                         \
        for (size_t i = 0; i < nb; i++)                                       \
            name##_block(b + i * (bytes), y + i * (elems));                   \
    }

/* ---- 32-element blocks --------------------------------------------------- */

/* q4_0: f16 d | qs[16]. Byte j: element j in the low nibble, j + 16 in the
 * high one; the value is d * (nibble - 8). */
static inline void q4_0_block(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)((qs[j] & 15) - 8) * d;
        y[j + QK / 2] = (float)((qs[j] >> 4) - 8) * d;
    }
}
BLOCKS(q4_0, QK, 18)

/* q4_1: f16 d | f16 m | qs[16]; d * nibble + m. */
static inline void q4_1_block(const uint8_t *b, float *y)
{
    float d = f16_at(b), m = f16_at(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = add_after_mul((float)(qs[j] & 15) * d, m);
        y[j + QK / 2] = add_after_mul((float)(qs[j] >> 4) * d, m);
    }
}
BLOCKS(q4_1, QK, 20)

/* q5: the nibbles as in q4, and bit j of the little-endian u32 qh as element
 * j's fifth bit. Fills q[32] with the 5-bit quants. */
static inline void q5_quants(const uint8_t *qs, uint32_t qh, int *q)
{
    for (int j = 0; j < QK / 2; j++) {
        q[j] = (qs[j] & 15) | (int)((qh >> j) & 1) << 4;
        q[j + QK / 2] = (qs[j] >> 4) | (int)((qh >> (j + QK / 2)) & 1) << 4;
    }
}

/* q5_0: f16 d | u32 qh | qs[16]; d * (q - 16). */
static inline void q5_0_block(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    int q[QK];
    q5_quants(b + 6, kvt_rd32(b + 2), q);
    for (int j = 0; j < QK; j++) y[j] = (float)(q[j] - 16) * d;
}
BLOCKS(q5_0, QK, 22)

/* q5_1: f16 d | f16 m | u32 qh | qs[16]; d * q + m. */
static inline void q5_1_block(const uint8_t *b, float *y)
{
    float d = f16_at(b), m = f16_at(b + 2);
    int q[QK];
    q5_quants(b + 8, kvt_rd32(b + 4), q);
    for (int j = 0; j < QK; j++) y[j] = add_after_mul((float)q[j] * d, m);
}
BLOCKS(q5_1, QK, 24)

/* q8_0: f16 d | 32 x int8; d * q. */
static inline void q8_0_block(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    for (int j = 0; j < QK; j++) y[j] = (float)(int8_t)b[2 + j] * d;
}
BLOCKS(q8_0, QK, 34)

/* iq4_nl: f16 d | qs[16], nibbles as in q4_0 indexing iq4nl_levels. */
static inline void iq4_nl_block(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = d * (float)iq4nl_levels[qs[j] & 15];
        y[j + QK / 2] = d * (float)iq4nl_levels[qs[j] >> 4];
    }
}
BLOCKS(iq4_nl, QK, 18)

/* The mxfp4 scale as ggml decodes it: E8M0 e means 2^(e - 127), halved for
 * the doubled table, so 2^(e - 128). That is a subnormal for e = 0 and 1
 * (2^-128, 2^-127: exact, not flushed) and 2^127 for e = 255, which the OCP
 * format reserves for NaN: ggml does not treat it specially, nor do we. */
static float e8m0_half(uint8_t e) { return ldexpf(1.0f, (int)e - 128); }

/* mxfp4: u8 e | qs[16], nibbles as in q4_0 indexing e2m1_x2. */
static inline void mxfp4_block(const uint8_t *b, float *y)
{
    float d = e8m0_half(b[0]);
    const uint8_t *qs = b + 1;
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)e2m1_x2[qs[j] & 15] * d;
        y[j + QK / 2] = (float)e2m1_x2[qs[j] >> 4] * d;
    }
}
BLOCKS(mxfp4, QK, 17)

/* ---- 256-element super-blocks -------------------------------------------- */

/* q4_K / q5_K scales: 12 bytes holding a 6-bit scale and a 6-bit min for
 * each of the 8 sub-blocks. Sub-blocks 0..3 keep theirs in the low 6 bits of
 * bytes 0..3 (scales) and 4..7 (mins); sub-blocks 4..7 keep their low 4 bits
 * in the nibbles of bytes 8..11 (scale low, min high) and their top 2 bits in
 * the spare top bits of bytes 0..3 (scales) and 4..7 (mins). ggml's
 * get_scale_min_k4. */
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

/* Sub-block i of a q4_K / q5_K: (d * scale) and (dmin * min), each rounded
 * to f32 first as in ggml; a value is then ds * q - ms. */
static inline void k4_sub(const uint8_t *s, int i, float d, float dmin, float *ds, float *ms)
{
    int sc, mn;
    k4_scale_min(s, i, &sc, &mn);
    *ds = d * (float)sc;
    *ms = dmin * (float)mn;
}

/* q4_K: f16 d | f16 dmin | scales[12] | qs[128]. Sub-blocks 2k and 2k + 1
 * share qs[32k .. 32k + 32): low nibbles, then high nibbles. */
static inline void q4_K_block(const uint8_t *b, float *y)
{
    float d = f16_at(b), dmin = f16_at(b + 2), ds0, ms0, ds1, ms1;
    const uint8_t *s = b + 4;
    for (int k = 0; k < 4; k++, y += 64) {
        const uint8_t *q = b + 16 + 32 * k;
        k4_sub(s, 2 * k, d, dmin, &ds0, &ms0);
        k4_sub(s, 2 * k + 1, d, dmin, &ds1, &ms1);
        for (int l = 0; l < 32; l++) y[l] = ds0 * (float)(q[l] & 15) - ms0;
        for (int l = 0; l < 32; l++) y[32 + l] = ds1 * (float)(q[l] >> 4) - ms1;
    }
}
BLOCKS(q4_K, QK_K, 144)

/* q5_K: q4_K's layout with qh[32] before qs: bit i of qh[l] is the fifth bit
 * of element l of sub-block i. */
static inline void q5_K_block(const uint8_t *b, float *y)
{
    float d = f16_at(b), dmin = f16_at(b + 2), ds0, ms0, ds1, ms1;
    const uint8_t *s = b + 4, *qh = b + 16;
    for (int k = 0; k < 4; k++, y += 64) {
        const uint8_t *q = b + 48 + 32 * k;
        k4_sub(s, 2 * k, d, dmin, &ds0, &ms0);
        k4_sub(s, 2 * k + 1, d, dmin, &ds1, &ms1);
        for (int l = 0; l < 32; l++)
            y[l] = ds0 * (float)((q[l] & 15) | ((qh[l] >> 2 * k) & 1) << 4) - ms0;
        for (int l = 0; l < 32; l++)
            y[32 + l] = ds1 * (float)((q[l] >> 4) | ((qh[l] >> (2 * k + 1)) & 1) << 4) - ms1;
    }
}
BLOCKS(q5_K, QK_K, 176)

/* q6_K: ql[128] | qh[64] | int8 scales[16] | f16 d, in two halves of 128
 * elements (ql + 64h, qh + 32h, scales + 8h). In a half, element 32r + l
 * (r = 0..3, l = 0..31) has its low 4 bits in ql[l + 32 (r & 1)] (low nibble
 * for r < 2, high for r >= 2), its high 2 bits in bits 2r, 2r + 1 of qh[l],
 * and scale scales[2r + l / 16]; the value is (d * scale) * (q - 32), the
 * product d * scale rounded first as in ggml. */
static inline void q6_K_block(const uint8_t *b, float *y)
{
    float d = f16_at(b + 208);
    for (int h = 0; h < 2; h++, y += 128) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(b + 192 + 8 * h);
        for (int r = 0; r < 4; r++) {
            const uint8_t *lo = ql + 32 * (r & 1);
            int shift = r < 2 ? 0 : 4;
            for (int l0 = 0; l0 < 32; l0 += 16) {
                float ds = d * (float)sc[2 * r + l0 / 16];
                for (int l = l0; l < l0 + 16; l++) {
                    int q = ((lo[l] >> shift) & 15) | ((qh[l] >> 2 * r) & 3) << 4;
                    y[32 * r + l] = ds * (float)(q - 32);
                }
            }
        }
    }
}
BLOCKS(q6_K, QK_K, 210)

/* iq4_xs: f16 d | u16 scales_h | scales_l[4] | qs[128]. Sub-block i (of 32)
 * has a 6-bit scale: low 4 bits the nibble i % 2 of scales_l[i / 2], high 2
 * bits bits 2i, 2i + 1 of scales_h; its 16 bytes of qs are iq4_nl nibbles
 * scaled by d * (scale - 32). */
static inline void iq4_xs_block(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    uint16_t sh = kvt_rd16(b + 2);
    const uint8_t *sl = b + 4;
    for (int i = 0; i < 8; i++, y += 32) {
        int ls = ((sl[i / 2] >> 4 * (i % 2)) & 15) | ((sh >> 2 * i) & 3) << 4;
        float dl = d * (float)(ls - 32);
        const uint8_t *q = b + 8 + 16 * i;
        for (int j = 0; j < 16; j++) {
            y[j] = dl * (float)iq4nl_levels[q[j] & 15];
            y[j + 16] = dl * (float)iq4nl_levels[q[j] >> 4];
        }
    }
}
BLOCKS(iq4_xs, QK_K, 136)

/* ---- the low-bit super-blocks: q2_K, q3_K and the i-quants ---------------- */

int kvt_quant_fault;

/* q2_K: scales[16] | qs[64] | f16 d | f16 dmin. Sixteen sub-blocks of 16:
 * scales[i]'s low nibble is sub-block i's scale, its high nibble its min;
 * the 2-bit quants of sub-block 8h + 2r + k (h = 0, 1 halves of 128; r =
 * 0..3 the bit pair; k = 0, 1) are bits 2r, 2r + 1 of qs[32h + 16k + l],
 * l = 0..15. A value is (d * scale) * q - (dmin * min). */
static inline void q2_K_block(const uint8_t *b, float *y)
{
    float d = f16_at(b + 80), dmin = f16_at(b + 82);
    const uint8_t *sc = b;
    for (int h = 0; h < 2; h++) {
        const uint8_t *q = b + 16 + 32 * h;
        for (int r = 0; r < 4; r++)
            for (int k = 0; k < 2; k++, y += 16) {
                uint8_t s = sc[8 * h + 2 * r + k];
                float dl = d * (float)(s & 15), ml = dmin * (float)(s >> 4);
                for (int l = 0; l < 16; l++) y[l] = dl * (float)((q[16 * k + l] >> 2 * r) & 3) - ml;
            }
    }
}
BLOCKS(q2_K, QK_K, 84)

/* q3_K's sixteen 6-bit scales from its 12 bytes: scale i's low 4 bits are
 * the nibble i / 8 of byte i % 8, its high 2 bits bits 2 (i / 4) of byte
 * 8 + i % 4; stored plus 32. */
static inline void q3_K_scales(const uint8_t *s, int *sc)
{
    for (int i = 0; i < 16; i++)
        sc[i] = (((s[i % 8] >> 4 * (i / 8)) & 15) | ((s[8 + i % 4] >> 2 * (i / 4)) & 3) << 4) - 32;
    if (kvt_quant_fault == KVT_QUANT_FAULT_SCALE) sc[5] += 1; /* tests */
}

/* q3_K: hmask[32] | qs[64] | scales[12] | f16 d. The 2 low bits of an
 * element are placed as q2_K's (qs[32h + 16k + l], bits 2r, 2r + 1); its
 * third bit is bit 4h + r of hmask[16k + l], and a clear bit subtracts 4:
 * q in -4 .. 3, the value (d * scale) * q. */
static inline void q3_K_block(const uint8_t *b, float *y)
{
    float d = f16_at(b + 108);
    int sc[16];
    q3_K_scales(b + 96, sc);
    const uint8_t *hm = b;
    for (int h = 0; h < 2; h++) {
        const uint8_t *q = b + 32 + 32 * h;
        for (int r = 0; r < 4; r++)
            for (int k = 0; k < 2; k++, y += 16) {
                float dl = d * (float)sc[8 * h + 2 * r + k];
                for (int l = 0; l < 16; l++) {
                    int v = ((q[16 * k + l] >> 2 * r) & 3) - ((hm[16 * k + l] >> (4 * h + r) & 1) ? 0 : 4);
                    y[l] = dl * (float)v;
                }
            }
    }
}
BLOCKS(q3_K, QK_K, 110)

/* One group of 8 values of an IQ2 type: (db * grid[j]) * (+-1), the sign
 * bit j of s. Multiplying by -1, not negating, keeps a NaN's sign as
 * ggml's mulss does. */
static inline void iq2_group(float db, const uint8_t *grid, uint8_t s, float *y)
{
    for (int j = 0; j < 8; j++) y[j] = db * (float)grid[j] * (s >> j & 1 ? -1.f : 1.f);
}

/* An IQ2 sub-scale: d * (0.5 + ls) * 0.25, left to right as ggml. */
static inline float iq2_db(float d, unsigned ls) { return d * (0.5f + (float)ls) * 0.25f; }

/* iq2_xxs: f16 d | 8 x (u32 grid, u32 aux) per 32. The grid word's bytes
 * are 4 indices into the 256-entry grid (8 values each); aux's 4 x 7 low
 * bits are sign indices (kvt_iqgrid_ksigns) and its top 4 bits the
 * scale ls of the 32: d * (0.5 + ls) / 4. */
static inline void iq2_xxs_block(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    for (int i = 0; i < 8; i++) {
        const uint8_t *g = b + 2 + 8 * i;
        uint32_t aux = kvt_rd32(g + 4);
        float db = iq2_db(d, aux >> 28);
        for (int l = 0; l < 4; l++, y += 8) {
            const uint8_t *grid = kvt_iqgrid_iq2xxs[g[l]];
            if (kvt_quant_fault == KVT_QUANT_FAULT_GRID && g[l] == 77) grid = kvt_iqgrid_iq2xxs[78]; /* tests */
            iq2_group(db, grid, kvt_iqgrid_ksigns[(aux >> 7 * l) & 127], y);
        }
    }
}
BLOCKS(iq2_xxs, QK_K, 66)

/* iq2_xs: f16 d | u16 qs[32] | scales[8]. qs[l]'s low 9 bits index the
 * 512-entry grid, its top 7 a sign byte; scales[i]'s nibbles are the
 * scales of the two halves of 16 of the 32 i. */
static inline void iq2_xs_block(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    for (int i = 0; i < 8; i++) {
        uint8_t s = b[66 + i];
        float db[2] = {iq2_db(d, s & 15), iq2_db(d, s >> 4)};
        for (int l = 0; l < 4; l++, y += 8) {
            uint16_t q = kvt_rd16(b + 2 + 2 * (4 * i + l));
            iq2_group(db[l / 2], kvt_iqgrid_iq2xs[q & 511], kvt_iqgrid_ksigns[q >> 9], y);
        }
    }
}
BLOCKS(iq2_xs, QK_K, 74)

/* iq2_s: f16 d | qs[32] | signs[32] | qh[8] | scales[8]. Group l of 32 i
 * indexes the 1024-entry grid with qs[4i + l] and bits 2l, 2l + 1 of
 * qh[i] as bits 8, 9; signs[4i + l] holds its 8 sign bits as they are;
 * scales as iq2_xs. */
static inline void iq2_s_block(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    const uint8_t *qs = b + 2, *sg = b + 34, *qh = b + 66, *sc = b + 74;
    for (int i = 0; i < 8; i++) {
        float db[2] = {iq2_db(d, sc[i] & 15), iq2_db(d, sc[i] >> 4)};
        for (int l = 0; l < 4; l++, y += 8)
            iq2_group(db[l / 2], kvt_iqgrid_iq2s[qs[4 * i + l] | ((qh[i] >> 2 * l) & 3) << 8], sg[4 * i + l], y);
    }
}
BLOCKS(iq2_s, QK_K, 82)

/* One group of 8 values of an IQ3 type from two grid entries of 4. */
static inline void iq3_group(float db, const uint8_t *g1, const uint8_t *g2, uint8_t s, float *y)
{
    for (int j = 0; j < 4; j++) {
        y[j] = db * (float)g1[j] * (s >> j & 1 ? -1.f : 1.f);
        y[j + 4] = db * (float)g2[j] * (s >> (j + 4) & 1 ? -1.f : 1.f);
    }
}

/* iq3_xxs: f16 d | qs[64] | u32 aux[8]. The 32 i has the 8 grid indices
 * qs[8i ..] (256-entry grid of 4 values), and aux[i] as iq2_xxs's: four
 * 7-bit sign indices and a 4-bit scale, d * (0.5 + ls) / 2. */
static inline void iq3_xxs_block(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    for (int i = 0; i < 8; i++) {
        const uint8_t *qs = b + 2 + 8 * i;
        uint32_t aux = kvt_rd32(b + 66 + 4 * i);
        float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        for (int l = 0; l < 4; l++, y += 8)
            iq3_group(db, kvt_iqgrid_iq3xxs[qs[2 * l]], kvt_iqgrid_iq3xxs[qs[2 * l + 1]],
                      kvt_iqgrid_ksigns[(aux >> 7 * l) & 127], y);
    }
}
BLOCKS(iq3_xxs, QK_K, 98)

/* iq3_s: f16 d | qs[64] | qh[8] | signs[32] | scales[4]. The 32 i has
 * grid indices qs[8i + k] with bit k of qh[i] as bit 8 (512 entries of
 * 4), sign bytes signs[4i ..] as they are, and the scale nibble i % 2 of
 * scales[i / 2]: d * (1 + 2 ls). */
static inline void iq3_s_block(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    const uint8_t *qs = b + 2, *qh = b + 66, *sg = b + 74, *sc = b + 106;
    for (int i = 0; i < 8; i++) {
        float db = d * (float)(1 + 2 * ((sc[i / 2] >> 4 * (i % 2)) & 15));
        for (int l = 0; l < 4; l++, y += 8) {
            int k = 8 * i + 2 * l;
            iq3_group(db, kvt_iqgrid_iq3s[qs[k] | ((qh[i] >> 2 * l) & 1) << 8],
                      kvt_iqgrid_iq3s[qs[k + 1] | ((qh[i] >> (2 * l + 1)) & 1) << 8], sg[4 * i + l], y);
        }
    }
}
BLOCKS(iq3_s, QK_K, 110)

/* One group of 8 values of an IQ1 type: dl * (grid[j] + delta), delta
 * -1/8 or +1/8. */
static inline void iq1_group(float dl, const int8_t *grid, bool neg, float *y)
{
    float delta = neg ? -0.125f : 0.125f;
    for (int j = 0; j < 8; j++) y[j] = dl * ((float)grid[j] + delta);
}

/* iq1_s: f16 d | qs[32] | u16 qh[8]. The 32 i: group l's 11-bit index
 * into the 2048-entry grid is qs[4i + l] with bits 3l .. 3l + 2 of qh[i]
 * above it; qh[i]'s bits 12..14 are the scale s (d * (2s + 1)), bit 15
 * the delta's sign. */
static inline void iq1_s_block(const uint8_t *b, float *y)
{
    float d = f16_at(b);
    for (int i = 0; i < 8; i++) {
        uint16_t qh = kvt_rd16(b + 34 + 2 * i);
        float dl = d * (float)(2 * ((qh >> 12) & 7) + 1);
        for (int l = 0; l < 4; l++, y += 8)
            iq1_group(dl, kvt_iqgrid_iq1s[b[2 + 4 * i + l] | ((qh >> 3 * l) & 7) << 8], qh & 0x8000, y);
    }
}
BLOCKS(iq1_s, QK_K, 50)

/* iq1_m's f16 super-scale: the top nibbles of its four u16 scale words,
 * first word lowest. */
static inline uint16_t iq1_m_d(const uint8_t *sc)
{
    uint16_t s[4];
    for (int k = 0; k < 4; k++) s[k] = kvt_rd16(sc + 2 * k);
    return (uint16_t)((s[0] >> 12) | ((s[1] >> 8) & 0x00f0) | ((s[2] >> 4) & 0x0f00) | (s[3] & 0xf000));
}

/* iq1_m: qs[32] | qh[16] | u16 scales[4] (no separate d). The 32 i:
 * group l's index is qs[4i + l] with bits 4 (l % 2) .. + 2 of qh[2i + l /
 * 2] above it, bit 4 (l % 2) + 3 the delta's sign; the 3-bit scales of
 * its halves of 16 are bits 6 (i % 2) and 6 (i % 2) + 3 of word i / 2:
 * d * (2s + 1). */
static inline void iq1_m_block(const uint8_t *b, float *y)
{
    const uint8_t *qs = b, *qh = b + 32, *sc = b + 48;
    float d = kvt_f16_to_f32(iq1_m_d(sc));
    for (int i = 0; i < 8; i++) {
        uint16_t w = kvt_rd16(sc + 2 * (i / 2));
        float dl[2] = {d * (float)(2 * ((w >> (6 * (i % 2))) & 7) + 1),
                       d * (float)(2 * ((w >> (6 * (i % 2) + 3)) & 7) + 1)};
        for (int l = 0; l < 4; l++, y += 8) {
            uint8_t h = qh[2 * i + l / 2] >> 4 * (l % 2);
            iq1_group(dl[l / 2], kvt_iqgrid_iq1s[qs[4 * i + l] | (h & 7) << 8], h & 8, y);
        }
    }
}
BLOCKS(iq1_m, QK_K, 56)

/* The ternary types: values (t - 1) * d, t in 0, 1, 2. */

/* tq1_0's trit n (0..4) of byte q, as ggml reads it: the byte is a
 * fixed-point fraction of 3^5, so multiplying by 3^n (mod 256) brings trit
 * n to the top and * 3 >> 8 takes it. */
static inline int tq1_trit(uint8_t q, int n)
{
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    return ((uint16_t)(uint8_t)(q * pow3[n]) * 3) >> 8;
}

/* tq1_0: qs[48] | qh[4] | f16 d. Elements 0..159: trit n of qs[m] is
 * element 32n + m (m < 32); 160..239: trit n of qs[32 + m] is 160 + 16n + m
 * (m < 16); 240..255: trit n (< 4) of qh[j] is 240 + 4n + j. */
static inline void tq1_0_block(const uint8_t *b, float *y)
{
    float d = f16_at(b + 52);
    for (int n = 0; n < 5; n++)
        for (int m = 0; m < 32; m++) y[32 * n + m] = (float)(tq1_trit(b[m], n) - 1) * d;
    for (int n = 0; n < 5; n++)
        for (int m = 0; m < 16; m++) y[160 + 16 * n + m] = (float)(tq1_trit(b[32 + m], n) - 1) * d;
    for (int n = 0; n < 4; n++)
        for (int j = 0; j < 4; j++) y[240 + 4 * n + j] = (float)(tq1_trit(b[48 + j], n) - 1) * d;
}
BLOCKS(tq1_0, QK_K, 54)

/* tq2_0: qs[64] | f16 d. Bits 2l of qs[32h + m] are element 128h + 32l + m. */
static inline void tq2_0_block(const uint8_t *b, float *y)
{
    float d = f16_at(b + 64);
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 4; l++)
            for (int m = 0; m < 32; m++) y[128 * h + 32 * l + m] = (float)(((b[32 * h + m] >> 2 * l) & 3) - 1) * d;
}
BLOCKS(tq2_0, QK_K, 66)

/* ---- plain floats: a block is one element -------------------------------- */

static void deq_f32(const uint8_t *b, float *y, size_t n) { memcpy(y, b, n * sizeof *y); }

static void deq_f16(const uint8_t *b, float *y, size_t n)
{
    for (size_t i = 0; i < n; i++) y[i] = kvt_f16_to_f32(kvt_rd16(b + 2 * i));
}

static void deq_bf16(const uint8_t *b, float *y, size_t n)
{
    for (size_t i = 0; i < n; i++) y[i] = kvt_bf16_to_f32(kvt_rd16(b + 2 * i));
}

/* ---- the table ----------------------------------------------------------- */

typedef struct qtype {
    const char *name;   /* ggml's type_name; NULL: no such ggml type */
    uint16_t elems;     /* per block; 0: not supported by kvtier */
    uint16_t bytes;
    dequant_fn deq;
} qtype;

/* Indexed by ggml type id (ggml.h enum ggml_type; the ids and sizes are
 * checked against libggml-base's type traits by tests/test_quant.c). Ids 4,
 * 5, 31..33 and 36..38 are types ggml removed. */
static const qtype types[] = {
    [0] = {"f32", 1, 4, deq_f32},
    [1] = {"f16", 1, 2, deq_f16},
    [2] = {"q4_0", QK, 18, deq_q4_0},
    [3] = {"q4_1", QK, 20, deq_q4_1},
    [6] = {"q5_0", QK, 22, deq_q5_0},
    [7] = {"q5_1", QK, 24, deq_q5_1},
    [8] = {"q8_0", QK, 34, deq_q8_0},
    [9] = {"q8_1"},
    [10] = {"q2_K", QK_K, 84, deq_q2_K},
    [11] = {"q3_K", QK_K, 110, deq_q3_K},
    [12] = {"q4_K", QK_K, 144, deq_q4_K},
    [13] = {"q5_K", QK_K, 176, deq_q5_K},
    [14] = {"q6_K", QK_K, 210, deq_q6_K},
    [15] = {"q8_K"},
    [16] = {"iq2_xxs", QK_K, 66, deq_iq2_xxs},
    [17] = {"iq2_xs", QK_K, 74, deq_iq2_xs},
    [18] = {"iq3_xxs", QK_K, 98, deq_iq3_xxs},
    [19] = {"iq1_s", QK_K, 50, deq_iq1_s},
    [20] = {"iq4_nl", QK, 18, deq_iq4_nl},
    [21] = {"iq3_s", QK_K, 110, deq_iq3_s},
    [22] = {"iq2_s", QK_K, 82, deq_iq2_s},
    [23] = {"iq4_xs", QK_K, 136, deq_iq4_xs},
    [24] = {"i8"},
    [25] = {"i16"},
    [26] = {"i32"},
    [27] = {"i64"},
    [28] = {"f64"},
    [29] = {"iq1_m", QK_K, 56, deq_iq1_m},
    [30] = {"bf16", 1, 2, deq_bf16},
    [34] = {"tq1_0", QK_K, 54, deq_tq1_0},
    [35] = {"tq2_0", QK_K, 66, deq_tq2_0},
    [39] = {"mxfp4", QK, 17, deq_mxfp4},
    [40] = {"nvfp4"},
    [41] = {"q1_0"},
    [42] = {"q2_0"},
};

static const qtype *find(uint32_t type)
{
    return type < sizeof types / sizeof *types ? &types[type] : NULL;
}

bool kvt_quant_block(uint32_t type, size_t *elems, size_t *bytes)
{
    const qtype *t = find(type);
    if (!t || !t->elems) return false;
    if (elems) *elems = t->elems;
    if (bytes) *bytes = t->bytes;
    return true;
}

size_t kvt_quant_row_bytes(uint32_t type, uint64_t n)
{
    size_t elems, bytes;
    uint64_t r;
    if (!kvt_quant_block(type, &elems, &bytes) || n % elems) return 0;
    if (__builtin_mul_overflow(n / elems, (uint64_t)bytes, &r) || r > SIZE_MAX) return 0;
    return (size_t)r;
}

const char *kvt_quant_name(uint32_t type)
{
    const qtype *t = find(type);
    return t ? t->name : NULL;
}

int kvt_quant_to_f32(uint32_t type, const void *src, float *dst, size_t n)
{
    const qtype *t = find(type);
    if (!t || !t->elems)
        return kvt_fail(KVT_EUNSUPPORTED, "quant: cannot dequantise type %s (%u)",
                        t && t->name ? t->name : "unknown", type);
    if (n % t->elems)
        return kvt_fail(KVT_EINVAL, "quant: %zu %s values are not whole blocks of %u", n, t->name,
                        t->elems);
    if (n && (!src || !dst)) return kvt_fail(KVT_EINVAL, "quant: to_f32: NULL argument");
    if (n) t->deq(src, dst, n / t->elems);
    return KVT_OK;
}

/* ggml's reference quantisers (quantize_row_q8_0_ref, the f16 and f32
 * copies): what a file writer needs to store synthetic weights compactly. */
int kvt_quant_from_f32(uint32_t type, const float *src, void *dst, size_t n)
{
    if (n && (!src || !dst)) return kvt_fail(KVT_EINVAL, "quant: from_f32: NULL argument");
    uint8_t *o = dst;
    switch (type) {
    case 0: /* f32 */
        if (n) memcpy(o, src, n * 4); /* little-endian hosts only, as the reader */
        return KVT_OK;
    case 1: /* f16 */
        for (size_t i = 0; i < n; i++) {
            uint16_t h = kvt_f32_to_f16(src[i]);
            o[2 * i] = (uint8_t)h, o[2 * i + 1] = (uint8_t)(h >> 8);
        }
        return KVT_OK;
    case 8: /* q8_0 */
        if (n % 32) return kvt_fail(KVT_EINVAL, "quant: %zu q8_0 values are not whole blocks of 32", n);
        for (size_t b = 0; b < n / 32; b++, o += 34) {
            const float *x = src + b * 32;
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
            const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
            uint16_t h = kvt_f32_to_f16(d);
            o[0] = (uint8_t)h, o[1] = (uint8_t)(h >> 8);
            for (int j = 0; j < 32; j++) o[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
        }
        return KVT_OK;
    default:
        return kvt_fail(KVT_EUNSUPPORTED, "quant: cannot quantise to type %s (%u) (f32, f16, q8_0)",
                        kvt_quant_name(type) ? kvt_quant_name(type) : "unknown", type);
    }
}
