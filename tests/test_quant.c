/* src/format/quant.c against ggml itself, bit for bit.
 *
 *   quant_table        the block table on its own: ids, shapes, names, row
 *                      sizes, and the refusals (unsupported type, partial
 *                      block, NULL)
 *   quant_ggml_exact   ggml's table (name, block and byte size of every type
 *                      id) equals kvtier's; and for every supported type
 *                      kvt_quant_to_f32 writes the bytes ggml's to_float
 *                      writes (memcmp, so NaN payloads count) on
 *                        (a) rows ggml quantised itself (ggml_quantize_chunk,
 *                            no importance matrix) from seeded random floats
 *                            (uniform, bell-shaped with outliers, sparse) at
 *                            scales 1e-7 .. 1e5;
 *                        (b) random bytes, with every f16 pattern in each f16
 *                            scale field (d, m, dmin), every pair of special
 *                            f16 scales (zeros, subnormals, max, infinities,
 *                            quiet and signalling NaNs of both signs) for the
 *                            two-scale types, and every E8M0 exponent 0..255
 *                            for mxfp4; for f16 and bf16 every 16-bit pattern,
 *                            for f32 random bit patterns and special values;
 *                        (c) every buffer decoded in rows of 1 block, 3 blocks
 *                            and a long row of 8192 elements, in turn.
 *   quant_ggml_control negative controls: the comparison fails on a source
 *                      with one scale bit flipped, on an output with one
 *                      mantissa bit flipped, and on a NaN whose payload
 *                      differs in one bit (which a "both NaN" comparison
 *                      would let through); and ggml's choice of NaN in q4_1's
 *                      d*q + m when d and m are both NaN (the product's) is
 *                      not the other one.
 *   quant_iq_codebooks every entry of the i-quant grids and of the sign
 *                      table (format/iqgrid.h) in a block built to select
 *                      it, against ggml; controls: one wrong grid entry
 *                      (iq2_xxs) and one off-by-one scale (q3_K), injected
 *                      with kvt_quant_fault, are found.
 * The importance matrix ggml requires for iq2_xxs, iq2_xs and iq1_s (and
 * iq1_m, which uses one when given) is random positive weights.
 *
 * The peer is libggml-base.so of node-llama-cpp's prebuilt linux-x64 CPU
 * build (FX_PEER_BINS), dlopen()ed: the install tests/test_peer.c uses (npm
 * ci on first use, fx_peer_ensure). The ggml tests skip, saying why, when it
 * cannot be had; KVT_PEER=0 skips them too. ggml has no to_float for f32 (it
 * is the identity); there the reference is the input itself. Every random
 * test prints its seed; KVT_TEST_SEED repeats it. About 10 s, most of it
 * ggml's one-time set-up of its iq1_s and iq2 quantisers' search tables. */
#include "fixture.h"
#include "peer_ggml.h"
#include "format/quant.h"
#include "test.h"
#include "base/util.h"

#include <dlfcn.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define LONG_ROW 8192        /* elements in the long rows */
#define CHUNK 4096           /* blocks decoded per comparison */


/* The supported types, and where each keeps its f16 scales (byte offsets in
 * the block). */
static const struct qcase {
    uint32_t type;
    int n_f16;
    size_t f16_at[2];
} cases[] = {
    {0, 0, {0}},        /* f32 */
    {1, 0, {0}},        /* f16 */
    {30, 0, {0}},       /* bf16 */
    {8, 1, {0}},        /* q8_0: d */
    {2, 1, {0}},        /* q4_0: d */
    {3, 2, {0, 2}},     /* q4_1: d, m */
    {6, 1, {0}},        /* q5_0: d */
    {7, 2, {0, 2}},     /* q5_1: d, m */
    {12, 2, {0, 2}},    /* q4_K: d, dmin */
    {13, 2, {0, 2}},    /* q5_K: d, dmin */
    {14, 1, {208}},     /* q6_K: d, at the end */
    {20, 1, {0}},       /* iq4_nl: d */
    {23, 1, {0}},       /* iq4_xs: d */
    {39, 0, {0}},       /* mxfp4: an E8M0 byte, not an f16 */
    {10, 2, {80, 82}},  /* q2_K: d, dmin, at the end */
    {11, 1, {108}},     /* q3_K: d, at the end */
    {16, 1, {0}},       /* iq2_xxs: d */
    {17, 1, {0}},       /* iq2_xs: d */
    {22, 1, {0}},       /* iq2_s: d */
    {18, 1, {0}},       /* iq3_xxs: d */
    {21, 1, {0}},       /* iq3_s: d */
    {19, 1, {0}},       /* iq1_s: d */
    {29, 0, {0}},       /* iq1_m: d is the top nibbles of its 4 scale words (its own case below) */
    {34, 1, {52}},      /* tq1_0: d, at the end */
    {35, 1, {64}},      /* tq2_0: d, at the end */
};
#define N_CASES (sizeof cases / sizeof cases[0])

/* f16 scales at the edges: zeros, subnormals, the smallest normal, 1, the
 * largest finite, infinities, signalling and quiet NaNs with small and full
 * payloads, both signs. */
static const uint16_t f16_special[] = {
    0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x0400, 0x3c00, 0x7bff, 0xfbff, 0x7c00,
    0xfc00, 0x7c01, 0xfc01, 0x7d00, 0x7e00, 0xfe00, 0x7e01, 0x7fff, 0xffff,
};
#define N_F16_SPECIAL (sizeof f16_special / sizeof f16_special[0])

static uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static void fill_random(uint8_t *p, size_t n, uint64_t *rng)
{
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(kvt_test_rand(rng) >> 56);
}

/* ---- one comparison ------------------------------------------------------ */

typedef struct cmp {
    uint32_t type;
    const char *name;
    size_t elems, bytes;     /* per block */
    ggml_to_float_t to_float;/* NULL for f32: the identity */
    unsigned row_turn;       /* which row length comes next */
    uint64_t blocks;         /* compared and equal so far */
} cmp;

/* Decode nb blocks of src with ggml (want) and kvtier (got), both in rows of
 * 1 block, 3 blocks and LONG_ROW elements in turn; false when kvtier refused. */
static bool decode_both(cmp *c, const uint8_t *src, size_t nb, float *want, float *got)
{
    const size_t rows[3] = {1, 3, LONG_ROW / c->elems};
    for (size_t b = 0; b < nb;) {
        size_t k = rows[c->row_turn++ % 3];
        if (k > nb - b) k = nb - b;
        const uint8_t *p = src + b * c->bytes;
        size_t n = k * c->elems, at = b * c->elems;
        if (c->to_float) c->to_float(p, want + at, (int64_t)n);
        else memcpy(want + at, p, n * sizeof(float));
        if (kvt_quant_to_f32(c->type, p, got + at, n) != KVT_OK) return false;
        b += k;
    }
    return true;
}

/* Index of the first element whose bits differ; SIZE_MAX when none. */
static size_t first_diff(const float *a, const float *b, size_t n)
{
    if (!memcmp(a, b, n * sizeof *a)) return SIZE_MAX;
    size_t i = 0;
    while (bits(a[i]) == bits(b[i])) i++;
    return i;
}

/* Compare nb blocks at src; on a difference print the element, both values
 * and the block, and return false. */
static bool same_as_ggml(cmp *c, const uint8_t *src, size_t nb, const char *what)
{
    size_t n = nb * c->elems;
    float *want = malloc(n * sizeof *want), *got = malloc(n * sizeof *got);
    bool ok = want && got;
    if (!ok) printf("    out of memory for %zu values\n", n);
    if (ok && !decode_both(c, src, nb, want, got)) {
        printf("    %s, %s: kvt_quant_to_f32 failed: %s\n", c->name, what, kvt_errmsg());
        ok = false;
    }
    size_t i = ok ? first_diff(want, got, n) : SIZE_MAX;
    if (i != SIZE_MAX) {
        size_t blk = i / c->elems;
        printf("    %s, %s: element %zu (block %zu, [%zu]): ggml %08x (%a), kvtier %08x (%a)\n",
               c->name, what, i, blk, i % c->elems, bits(want[i]), want[i], bits(got[i]), got[i]);
        printf("      block:");
        for (size_t k = 0; k < c->bytes && k < 48; k++) printf(" %02x", src[blk * c->bytes + k]);
        printf("%s\n", c->bytes > 48 ? " ..." : "");
        ok = false;
    }
    if (ok) c->blocks += nb;
    free(want);
    free(got);
    return ok;
}

/* ---- (a) blocks ggml quantised ------------------------------------------- */

/* value i of a row of distribution dist (0 uniform, 1 bell with outliers,
 * 2 sparse) at the given scale */
static float sample(int dist, float scale, uint64_t *rng)
{
    float u = (float)(kvt_test_rand(rng) >> 40) * 0x1p-24f * 2.0f - 1.0f;
    if (dist == 0) return scale * u;
    if (dist == 1) {
        float v = u;
        for (int k = 0; k < 3; k++) v += (float)(kvt_test_rand(rng) >> 40) * 0x1p-24f * 2.0f - 1.0f;
        return scale * v * (kvt_test_rand(rng) % 64 == 0 ? 16.0f : 1.0f);
    }
    return kvt_test_rand(rng) % 8 == 0 ? scale * u : 0.0f;
}

static bool needs_imatrix(uint32_t type) { return type == 16 || type == 17 || type == 19 || type == 29; }

static bool quantised_rows(cmp *c, uint64_t *rng, uint64_t *n_blocks)
{
    static const float scales[] = {1e-7f, 1e-3f, 1.0f, 1e3f, 1e5f};
    const size_t row_blocks[] = {1, 3, LONG_ROW / c->elems};
    for (int dist = 0; dist < 3; dist++)
        for (size_t s = 0; s < sizeof scales / sizeof *scales; s++)
            for (size_t r = 0; r < 3; r++) {
                size_t n_per_row = row_blocks[r] * c->elems, nrows = LONG_ROW / n_per_row;
                if (!nrows) nrows = 1;
                size_t n = nrows * n_per_row, row_bytes = kvt_quant_row_bytes(c->type, n_per_row);
                float *x = malloc(n * sizeof *x);
                uint8_t *q = malloc(nrows * row_bytes);
                if (!x || !q) { free(x); free(q); printf("    out of memory\n"); return false; }
                for (size_t i = 0; i < n; i++) x[i] = sample(dist, scales[s], rng);
                /* the i-quants below 3 bits need an importance matrix (ggml
                 * asserts one for iq2_xxs, iq2_xs, iq1_s): positive weights
                 * per column, as llama-imatrix makes */
                float *imat = NULL;
                if (needs_imatrix(c->type)) {
                    imat = malloc(n_per_row * sizeof *imat);
                    if (!imat) { free(x); free(q); printf("    out of memory\n"); return false; }
                    for (size_t i = 0; i < n_per_row; i++)
                        imat[i] = 0.01f + (float)(kvt_test_rand(rng) >> 40) * 0x1p-24f;
                }
                size_t wrote = ggml.quantize_chunk((int)c->type, x, q, 0, (int64_t)nrows,
                                                   (int64_t)n_per_row, imat);
                free(imat);
                char what[96];
                snprintf(what, sizeof what, "ggml-quantised, distribution %d, scale %g, rows of %zu",
                         dist, scales[s], n_per_row);
                bool ok = wrote == nrows * row_bytes;
                if (!ok) printf("    %s, %s: ggml wrote %zu bytes, not %zu\n", c->name, what, wrote,
                                nrows * row_bytes);
                ok = ok && same_as_ggml(c, q, n / c->elems, what);
                if (ok) *n_blocks += n / c->elems;
                free(x);
                free(q);
                if (!ok) return false;
            }
    return true;
}

/* ---- (b) random bytes ---------------------------------------------------- */

static bool random_blocks(cmp *c, const struct qcase *qc, uint64_t *rng)
{
    uint8_t *buf = malloc(CHUNK * c->bytes);
    if (!buf) { printf("    out of memory\n"); return false; }
    bool ok = true;
    char what[96];

    /* plain random blocks */
    fill_random(buf, CHUNK * c->bytes, rng);
    ok = same_as_ggml(c, buf, CHUNK, "random bytes");

    /* every f16 pattern in each scale field, the rest random */
    for (int f = 0; ok && f < qc->n_f16; f++) {
        for (uint32_t h0 = 0; ok && h0 < 65536; h0 += CHUNK) {
            fill_random(buf, CHUNK * c->bytes, rng);
            for (uint32_t k = 0; k < CHUNK; k++) {
                buf[k * c->bytes + qc->f16_at[f]] = (uint8_t)(h0 + k);
                buf[k * c->bytes + qc->f16_at[f] + 1] = (uint8_t)((h0 + k) >> 8);
            }
            snprintf(what, sizeof what, "f16 field at byte %zu = 0x%04x..0x%04x", qc->f16_at[f], h0,
                     h0 + CHUNK - 1);
            ok = same_as_ggml(c, buf, CHUNK, what);
        }
    }
    /* two scales: every pair of special values, 4 random fills each */
    if (ok && qc->n_f16 == 2) {
        size_t nb = 0;
        for (size_t i = 0; i < N_F16_SPECIAL; i++)
            for (size_t j = 0; j < N_F16_SPECIAL; j++)
                for (int r = 0; r < 4; r++, nb++) {
                    uint8_t *b = buf + nb * c->bytes;
                    fill_random(b, c->bytes, rng);
                    b[qc->f16_at[0]] = (uint8_t)f16_special[i];
                    b[qc->f16_at[0] + 1] = (uint8_t)(f16_special[i] >> 8);
                    b[qc->f16_at[1]] = (uint8_t)f16_special[j];
                    b[qc->f16_at[1] + 1] = (uint8_t)(f16_special[j] >> 8);
                }
        ok = same_as_ggml(c, buf, nb, "pairs of special f16 scales");
    }
    /* mxfp4: every exponent, with a block holding all 16 codes in both
     * nibbles and 15 random ones */
    if (ok && c->type == 39) {
        for (uint32_t e = 0; e < 256; e++) {
            uint8_t *b = buf + e * 16 * c->bytes;
            fill_random(b, 16 * c->bytes, rng);
            for (int k = 0; k < 16; k++) b[k * c->bytes] = (uint8_t)e;
            for (int j = 0; j < 16; j++) b[1 + j] = (uint8_t)(j << 4 | (15 - j));
        }
        ok = same_as_ggml(c, buf, 256 * 16, "E8M0 exponents 0..255");
    }
    /* iq1_m: every f16 pattern as its super-scale (the top nibble of each
     * of its 4 scale words at bytes 48..55, first word lowest) */
    if (ok && c->type == 29) {
        for (uint32_t h0 = 0; ok && h0 < 65536; h0 += CHUNK) {
            fill_random(buf, CHUNK * c->bytes, rng);
            for (uint32_t k = 0; k < CHUNK; k++) {
                uint8_t *sc = buf + k * c->bytes + 48;
                for (int w = 0; w < 4; w++)
                    sc[2 * w + 1] = (uint8_t)((sc[2 * w + 1] & 0x0f) | (((h0 + k) >> 4 * w) & 15) << 4);
            }
            snprintf(what, sizeof what, "iq1_m super-scale = 0x%04x..0x%04x", h0, h0 + CHUNK - 1);
            ok = same_as_ggml(c, buf, CHUNK, what);
        }
    }
    /* f16 and bf16: every 16-bit pattern */
    if (ok && c->elems == 1 && c->bytes == 2) {
        for (uint32_t h0 = 0; ok && h0 < 65536; h0 += CHUNK) {
            for (uint32_t k = 0; k < CHUNK; k++) {
                buf[2 * k] = (uint8_t)(h0 + k);
                buf[2 * k + 1] = (uint8_t)((h0 + k) >> 8);
            }
            snprintf(what, sizeof what, "every pattern 0x%04x..0x%04x", h0, h0 + CHUNK - 1);
            ok = same_as_ggml(c, buf, CHUNK, what);
        }
    }
    /* f32: specials (signalling NaNs must keep their bits) after random words */
    if (ok && c->type == 0) {
        static const uint32_t special[] = {0x7f800001, 0xff800001, 0x7fbfffff, 0x7fc00000, 0xffc00000,
                                           0x7fffffff, 0x7f800000, 0xff800000, 0x00000001, 0x80000000,
                                           0x7f7fffff, 0x00800000};
        for (size_t k = 0; k < sizeof special / sizeof *special; k++) memcpy(buf + 4 * k, &special[k], 4);
        ok = same_as_ggml(c, buf, CHUNK, "f32 special and random words");
    }
    free(buf);
    return ok;
}

/* ---- tests --------------------------------------------------------------- */

TEST(quant_table)
{
    static const struct { uint32_t type; const char *name; size_t elems, bytes; } want[] = {
        {0, "f32", 1, 4}, {1, "f16", 1, 2}, {2, "q4_0", 32, 18}, {3, "q4_1", 32, 20},
        {6, "q5_0", 32, 22}, {7, "q5_1", 32, 24}, {8, "q8_0", 32, 34}, {12, "q4_K", 256, 144},
        {13, "q5_K", 256, 176}, {14, "q6_K", 256, 210}, {20, "iq4_nl", 32, 18},
        {23, "iq4_xs", 256, 136}, {30, "bf16", 1, 2}, {39, "mxfp4", 32, 17},
        {10, "q2_K", 256, 84}, {11, "q3_K", 256, 110}, {16, "iq2_xxs", 256, 66}, {17, "iq2_xs", 256, 74},
        {22, "iq2_s", 256, 82}, {18, "iq3_xxs", 256, 98}, {21, "iq3_s", 256, 110}, {19, "iq1_s", 256, 50},
        {29, "iq1_m", 256, 56}, {34, "tq1_0", 256, 54}, {35, "tq2_0", 256, 66},
    };
    size_t n_supported = 0;
    for (uint32_t t = 0; t < 256; t++) n_supported += kvt_quant_block(t, NULL, NULL);
    CHECKF(n_supported == sizeof want / sizeof *want, "%zu supported types", n_supported);
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        size_t e = 0, b = 0;
        CHECK(kvt_quant_block(want[i].type, &e, &b));
        CHECKF(e == want[i].elems && b == want[i].bytes, "%s: %zu / %zu", want[i].name, e, b);
        CHECK(kvt_quant_name(want[i].type) && !strcmp(kvt_quant_name(want[i].type), want[i].name));
        CHECK(kvt_quant_row_bytes(want[i].type, 3 * e) == 3 * b);
        CHECK(e == 1 || kvt_quant_row_bytes(want[i].type, 3 * e + 1) == 0);
    }
    CHECK(!strcmp(kvt_quant_name(41), "q1_0") && !kvt_quant_block(41, NULL, NULL));
    CHECK(!strcmp(kvt_quant_name(40), "nvfp4") && !kvt_quant_block(40, NULL, NULL));
    CHECK(kvt_quant_name(4) == NULL && kvt_quant_name(31) == NULL && kvt_quant_name(43) == NULL);
    CHECK(kvt_quant_name(UINT32_MAX) == NULL && !kvt_quant_block(UINT32_MAX, NULL, NULL));
    CHECK(kvt_quant_row_bytes(41, 256) == 0);
    CHECK(kvt_quant_row_bytes(0, 1ull << 62) == 0);                 /* overflows size_t */
    CHECK(kvt_quant_row_bytes(1, 1ull << 63) == 0);

    uint8_t blk[144] = {0x00, 0x3c};
    float out[256];
    CHECK(kvt_quant_to_f32(41, blk, out, 256) == KVT_EUNSUPPORTED && strstr(kvt_errmsg(), "q1_0"));
    CHECK(kvt_quant_to_f32(999, blk, out, 256) == KVT_EUNSUPPORTED);
    CHECK(kvt_quant_to_f32(12, blk, out, 255) == KVT_EINVAL);
    CHECK(kvt_quant_to_f32(12, NULL, out, 256) == KVT_EINVAL);
    CHECK(kvt_quant_to_f32(12, blk, NULL, 256) == KVT_EINVAL);
    CHECK_OK(kvt_quant_to_f32(12, NULL, NULL, 0));
    /* q8_0 by hand: d = 0.5, q = -128 .. 127 in steps of 8 */
    uint8_t q8[34] = {0x00, 0x38};
    for (int j = 0; j < 32; j++) q8[2 + j] = (uint8_t)(int8_t)(j * 8 - 128);
    CHECK_OK(kvt_quant_to_f32(8, q8, out, 32));
    for (int j = 0; j < 32; j++) CHECKF(out[j] == 0.5f * (float)(j * 8 - 128), "q8_0 [%d] = %g", j, out[j]);
    /* mxfp4 by hand: the E8M0 edges (2^-128 and 2^127 per doubled code) */
    uint8_t mx[17] = {0};
    for (int j = 0; j < 16; j++) mx[1 + j] = (uint8_t)(j << 4 | j);
    CHECK_OK(kvt_quant_to_f32(39, mx, out, 32));
    CHECK(out[1] == 0x1p-128f && out[7] == 12 * 0x1p-128f && out[15] == -12 * 0x1p-128f);
    CHECK(out[16 + 8] == 0.0f && !signbit(out[16 + 8]));
    mx[0] = 255;
    CHECK_OK(kvt_quant_to_f32(39, mx, out, 32));
    CHECK(out[1] == 0x1p127f && isinf(out[2]) && out[9] == -0x1p127f);
}

TEST(quant_ggml_exact)
{
    const char *why = ggml_load();
    if (why) SKIP("%s", why);

    /* ggml's table against kvtier's, for every type id */
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const struct ggml_type_traits *tr = ggml.traits(t);
        const char *mine = kvt_quant_name((uint32_t)t);
        size_t e = 0, b = 0;
        bool sup = kvt_quant_block((uint32_t)t, &e, &b);
        if (tr->blck_size == 0) { /* a type ggml removed */
            CHECKF(!mine && !sup, "type %d: ggml removed it (\"%s\"), kvtier names it %s", t,
                   tr->type_name, mine);
            continue;
        }
        CHECKF(mine && !strcmp(mine, tr->type_name), "type %d: ggml \"%s\", kvtier \"%s\"", t,
               tr->type_name, mine ? mine : "(null)");
        CHECKF(!sup || (e == (size_t)tr->blck_size && b == tr->type_size),
               "%s: ggml %lld elements / %zu bytes, kvtier %zu / %zu", mine, (long long)tr->blck_size,
               tr->type_size, e, b);
    }

    uint64_t seed = kvt_test_seed("quant_ggml_exact"), rng = seed;
    double t0 = fx_now();
    size_t n_failed = 0;
    for (size_t i = 0; i < N_CASES; i++) {
        const struct qcase *qc = &cases[i];
        const struct ggml_type_traits *tr = ggml.traits((int)qc->type);
        cmp c = {.type = qc->type, .name = kvt_quant_name(qc->type), .to_float = tr->to_float};
        CHECK(kvt_quant_block(qc->type, &c.elems, &c.bytes));
        CHECKF(tr->to_float || qc->type == 0, "%s: ggml has no to_float", c.name);
        uint64_t n_quantised = 0;
        double t1 = fx_now();
        bool ok = quantised_rows(&c, &rng, &n_quantised) && random_blocks(&c, qc, &rng);
        if (ok)
            printf("    %-7s %7llu blocks equal (%llu quantised by ggml, %llu of bytes), %.1f s\n", c.name,
                   (unsigned long long)c.blocks, (unsigned long long)n_quantised,
                   (unsigned long long)(c.blocks - n_quantised), fx_now() - t1);
        else
            n_failed++;
    }
    printf("    %.1f s\n", fx_now() - t0);
    CHECKF(n_failed == 0, "%zu types differ from ggml (see above; seed %llu)", n_failed,
           (unsigned long long)seed);
}

TEST(quant_ggml_control)
{
    const char *why = ggml_load();
    if (why) SKIP("%s", why);
    uint64_t rng = kvt_test_seed("quant_ggml_control");

    /* q4_K blocks quantised by ggml; kvtier reads them the same */
    enum { NB = 4, QK_K = 256, Q4K = 144 };
    float x[NB * QK_K], want[NB * QK_K], got[NB * QK_K];
    uint8_t q[NB * Q4K], bad[NB * Q4K];
    for (size_t i = 0; i < NB * QK_K; i++) x[i] = sample(1, 1.0f, &rng);
    CHECK(ggml.quantize_chunk(12, x, q, 0, 1, NB * QK_K, NULL) == sizeof q);
    cmp c = {.type = 12, .name = "q4_K", .elems = QK_K, .bytes = Q4K, .to_float = ggml.traits(12)->to_float};
    CHECK(decode_both(&c, q, NB, want, got));
    CHECK(first_diff(want, got, NB * QK_K) == SIZE_MAX);

    /* one flipped bit in block 2's d: the comparison finds block 2, and only it */
    memcpy(bad, q, sizeof q);
    bad[2 * Q4K] ^= 1;
    CHECK_OK(kvt_quant_to_f32(12, bad, got, NB * QK_K));
    size_t i = first_diff(want, got, NB * QK_K);
    CHECKF(i / QK_K == 2, "flipped scale bit: first difference at %zu", i);
    CHECK(first_diff(want + 3 * QK_K, got + 3 * QK_K, QK_K) == SIZE_MAX);
    /* one flipped mantissa bit in an output */
    CHECK_OK(kvt_quant_to_f32(12, q, got, NB * QK_K));
    uint32_t u = bits(got[17]) ^ 1;
    memcpy(&got[17], &u, 4);
    CHECK(first_diff(want, got, NB * QK_K) == 17);

    /* a NaN payload one bit off: "both NaN" would pass it, the bits do not */
    uint8_t q8[34] = {0x01, 0x7e};                   /* d = f16 quiet NaN, payload 1 */
    for (int j = 0; j < 32; j++) q8[2 + j] = (uint8_t)(j + 1);
    float w8[32], g8[32];
    ggml.traits(8)->to_float(q8, w8, 32);
    CHECKF(bits(w8[0]) == 0x7fc02000, "ggml: q8_0 with d = 0x7e01 gives %08x", bits(w8[0]));
    CHECK_OK(kvt_quant_to_f32(8, q8, g8, 32));
    CHECK(first_diff(w8, g8, 32) == SIZE_MAX);
    u = bits(g8[5]) ^ 1;
    memcpy(&g8[5], &u, 4);
    CHECK(isnan(w8[5]) && isnan(g8[5]));             /* what a NaN-tolerant compare would accept */
    CHECK(first_diff(w8, g8, 32) == 5);

    /* q4_1, d and m both NaN: ggml's x86 build adds with the product first,
     * so the result carries d's payload; m's would be another answer */
    uint8_t q41[20] = {0x01, 0x7e, 0x02, 0x7d};      /* d = qNaN payload 1, m = sNaN payload 0x102 */
    for (int j = 0; j < 16; j++) q41[4 + j] = (uint8_t)(j * 17);
    float w41[32], g41[32];
    ggml.traits(3)->to_float(q41, w41, 32);
    CHECK_OK(kvt_quant_to_f32(3, q41, g41, 32));
    CHECKF(bits(w41[3]) == 0x7fc02000 && bits(w41[3]) != (bits(kvt_f16_to_f32(0x7d02)) | 0x400000u),
           "ggml: q4_1 NaN + NaN gives %08x", bits(w41[3]));
    CHECK(first_diff(w41, g41, 32) == SIZE_MAX);
    /* d = inf, q = 0: inf * 0 is the x86 default NaN (ffc00000), whatever m is */
    q41[0] = 0x00, q41[1] = 0x7c;
    ggml.traits(3)->to_float(q41, w41, 32);
    CHECK_OK(kvt_quant_to_f32(3, q41, g41, 32));
    CHECKF(bits(w41[0]) == 0xffc00000, "ggml: q4_1 inf * 0 + NaN gives %08x", bits(w41[0]));
    CHECK(first_diff(w41, g41, 32) == SIZE_MAX);
}

/* ---- the i-quant codebooks ------------------------------------------------ */

/* Put grid index idx in slot k of an i-quant block (a group of 8 values;
 * for iq3, a half-group of 4). Slots per block: iq3 64, the others 32. */
static void set_index(uint32_t type, uint8_t *b, int k, unsigned idx)
{
    int i = k / 4, l = k % 4;
    switch (type) {
    case 16: b[2 + 8 * i + l] = (uint8_t)idx; break;                          /* iq2_xxs */
    case 17: b[2 + 2 * k] = (uint8_t)idx, b[3 + 2 * k] = (uint8_t)((b[3 + 2 * k] & 0xfe) | idx >> 8); break;
    case 22:                                                                    /* iq2_s */
        b[2 + k] = (uint8_t)idx;
        b[66 + i] = (uint8_t)((b[66 + i] & ~(3 << 2 * l)) | (idx >> 8) << 2 * l);
        break;
    case 18: b[2 + k] = (uint8_t)idx; break;                                  /* iq3_xxs: 64 slots */
    case 21:                                                                    /* iq3_s: 64 slots */
        b[2 + k] = (uint8_t)idx;
        b[66 + k / 8] = (uint8_t)((b[66 + k / 8] & ~(1 << k % 8)) | (idx >> 8) << k % 8);
        break;
    case 19: {                                                                  /* iq1_s */
        b[2 + k] = (uint8_t)idx;
        uint16_t qh = kvt_rd16(b + 34 + 2 * i);
        qh = (uint16_t)((qh & ~(7u << 3 * l)) | (idx >> 8) << 3 * l);
        b[34 + 2 * i] = (uint8_t)qh, b[35 + 2 * i] = (uint8_t)(qh >> 8);
        break;
    }
    case 29: {                                                                  /* iq1_m */
        b[k] = (uint8_t)idx;
        uint8_t *h = b + 32 + 2 * i + l / 2;
        *h = (uint8_t)((*h & ~(7 << 4 * (l % 2))) | (idx >> 8) << 4 * (l % 2));
        break;
    }
    }
}

/* Every entry of each codebook (quant.c's grids, format/iqgrid.h, and the
 * sign table) in a block built to select it, decoded by kvtier and by
 * ggml: the same bytes. The rest of each block is random, its f16 d 1.0
 * (iq1_m: 1.0 in its scale nibbles). Negative controls: with
 * KVT_QUANT_FAULT_GRID (iq2_xxs reads entry 78 for 77) and
 * KVT_QUANT_FAULT_SCALE (q3_K's sixth scale one more) the comparison finds
 * the difference. */
TEST(quant_iq_codebooks)
{
    const char *why = ggml_load();
    if (why) SKIP("%s", why);
    uint64_t rng = kvt_test_seed("quant_iq_codebooks");
    static const struct { uint32_t type; unsigned entries; int slots; } books[] = {
        {16, 256, 32}, {17, 512, 32}, {22, 1024, 32}, {18, 256, 64}, {21, 512, 64}, {19, 2048, 32}, {29, 2048, 32},
    };
    for (size_t t = 0; t < sizeof books / sizeof *books; t++) {
        uint32_t type = books[t].type;
        cmp c = {.type = type, .name = kvt_quant_name(type), .to_float = ggml.traits((int)type)->to_float};
        CHECK(kvt_quant_block(type, &c.elems, &c.bytes));
        size_t nb = books[t].entries / (unsigned)books[t].slots;
        uint8_t *buf = malloc(nb * c.bytes);
        CHECK(buf != NULL);
        fill_random(buf, nb * c.bytes, &rng);
        for (size_t b = 0; b < nb; b++) {
            uint8_t *blk = buf + b * c.bytes;
            if (type == 29) /* d = 0x3c00 */
                for (int w = 0; w < 4; w++) blk[49 + 2 * w] = (uint8_t)((blk[49 + 2 * w] & 0x0f) | ((0x3c00 >> 4 * w) & 15) << 4);
            else blk[0] = 0x00, blk[1] = 0x3c;
            for (int k = 0; k < books[t].slots; k++) set_index(type, blk, k, (unsigned)(b * (size_t)books[t].slots + (size_t)k));
        }
        CHECKF(same_as_ggml(&c, buf, nb, "every codebook entry"), "%s: a codebook entry differs", c.name);
        printf("    %-7s %4u grid entries equal\n", c.name, books[t].entries);
        if (type == 16) { /* the control: one wrong entry */
            kvt_quant_fault = KVT_QUANT_FAULT_GRID;
            CHECKF(!same_as_ggml(&c, buf, nb, "control: entry 77 read as 78 (expected to differ)"),
                   "iq2_xxs: a wrong grid entry went unnoticed");
            kvt_quant_fault = KVT_QUANT_FAULT_NONE;
        }
        free(buf);
    }
    /* the sign table: iq2_xxs's 7-bit sign fields, all 128 values in 32 blocks */
    cmp c = {.type = 16, .name = "iq2_xxs", .elems = 256, .bytes = 66, .to_float = ggml.traits(16)->to_float};
    uint8_t buf[32 * 66];
    fill_random(buf, sizeof buf, &rng);
    for (int b = 0; b < 32; b++) {
        uint8_t *blk = buf + 66 * b;
        blk[0] = 0x00, blk[1] = 0x3c;
        for (int i = 0; i < 8; i++) {
            uint32_t aux = kvt_rd32(blk + 2 + 8 * i + 4) & 0xf0000000u;
            for (int l = 0; l < 4; l++) aux |= (uint32_t)((4 * b + l + 32 * (i % 4)) % 128) << 7 * l;
            for (int j = 0; j < 4; j++) blk[2 + 8 * i + 4 + j] = (uint8_t)(aux >> 8 * j);
        }
    }
    CHECKF(same_as_ggml(&c, buf, 32, "every sign byte"), "a sign table entry differs");
    /* the control: one off-by-one scale in q3_K */
    cmp c3 = {.type = 11, .name = "q3_K", .elems = 256, .bytes = 110, .to_float = ggml.traits(11)->to_float};
    uint8_t q3[4 * 110];
    fill_random(q3, sizeof q3, &rng);
    for (int b = 0; b < 4; b++) q3[110 * b + 108] = 0x00, q3[110 * b + 109] = 0x3c;
    CHECK(same_as_ggml(&c3, q3, 4, "q3_K"));
    kvt_quant_fault = KVT_QUANT_FAULT_SCALE;
    CHECKF(!same_as_ggml(&c3, q3, 4, "control: q3_K scale 5 one more (expected to differ)"),
           "q3_K: an off-by-one scale went unnoticed");
    kvt_quant_fault = KVT_QUANT_FAULT_NONE;
}

/* kvt_quant_from_f32 (the writer of `model new --type`) against ggml's own
 * reference quantisers (from_float_ref) for f16 and q8_0: the same bytes on
 * values of every scale, zeros and halfway cases included. Control: a block
 * nudged by one unit after quantising differs (the comparison sees a byte). */
TEST(quant_from_f32_is_ggmls)
{
    const char *why = ggml_load();
    if (why) SKIP("%s", why);
    enum { N = 32 * 4096 };
    float *x = malloc(N * sizeof *x);
    uint8_t *a = malloc(N * 2 + 64), *b = malloc(N * 2 + 64);
    CHECK(x && a && b);
    uint64_t rng = kvt_test_seed("quant_from_f32_is_ggmls");
    for (size_t i = 0; i < N; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        double u = (double)(rng >> 11) * (1.0 / 9007199254740992.0);
        int blk = (int)(i / 32) % 8;
        /* blocks of scales 1e-8 .. 1e4, an all-zero block, one of halves */
        x[i] = blk == 6 ? 0.0f : blk == 7 ? (float)((int)(u * 64) - 32) * 0.5f
                                          : (float)((2 * u - 1) * pow(10.0, blk * 2 - 8));
    }
    static const uint32_t types[] = {1, 8}; /* f16, q8_0 */
    for (size_t k = 0; k < 2; k++) {
        const struct ggml_type_traits *tr = ggml.traits((int)types[k]);
        CHECKF(tr && tr->from_float_ref, "ggml has no from_float_ref for %s", kvt_quant_name(types[k]));
        size_t bytes = kvt_quant_row_bytes(types[k], N);
        CHECK(kvt_quant_from_f32(types[k], x, a, N) == KVT_OK);
        tr->from_float_ref(x, b, N);
        size_t diff = 0;
        for (size_t i = 0; i < bytes; i++) diff += a[i] != b[i];
        printf("    %s: %zu values, %zu bytes, %zu differ\n", kvt_quant_name(types[k]), (size_t)N, bytes, diff);
        CHECKF(diff == 0, "%s: %zu of %zu bytes differ from ggml's", kvt_quant_name(types[k]), diff, bytes);
        a[bytes / 2] ^= 1;
        diff = 0;
        for (size_t i = 0; i < bytes; i++) diff += a[i] != b[i];
        CHECK(diff == 1);
    }
    CHECK(kvt_quant_from_f32(8, x, a, 31) == KVT_EINVAL);
    CHECK(kvt_quant_from_f32(12, x, a, 256) == KVT_EUNSUPPORTED);
    free(x);
    free(a);
    free(b);
}
