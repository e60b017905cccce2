/* The row types of the cache's K and V rows (src/cache/rows.c) against
 * their definitions, bit for bit, on every kernel path:
 *
 *   rows_f16_bf16_reference  f16 and bf16 rows: kvt_rows_put writes what
 *                            kvt_f32_to_f16 / kvt_f32_to_bf16 give element
 *                            by element (round to nearest even), and
 *                            kvt_rows_get what kvt_f16_to_f32 /
 *                            kvt_bf16_to_f32 give, on random bit patterns
 *                            (NaNs and infinities included), values with
 *                            their dropped bits an exact tie, and the edges:
 *                            ±0, f32 and f16 subnormals, the halfway points
 *                            between them, the largest finite values and
 *                            the ties above them (to infinity), ±inf; a NaN
 *                            need only stay a NaN (the row functions keep
 *                            its payload as F16C does, kvt_f32_to_f16 makes
 *                            it the canonical one)
 *   rows_q8_0_ggml           q8_0 rows: the bytes ggml's own reference
 *                            quantiser writes (the peer's libggml-base.so,
 *                            ggml_quantize_chunk with GGML_TYPE_Q8_0), and
 *                            what its to_float reads back, on random rows at
 *                            scales 1e-9 .. 1e6, all-zero blocks, blocks of
 *                            exact halves (x / d = k + 0.5: round half away
 *                            from zero, as roundf), blocks whose scale is
 *                            an f16 subnormal or underflows to 0, blocks
 *                            with one value, ±0 and f32 subnormals; f16 and
 *                            bf16 rows also equal ggml's conversions there
 *   rows_idempotent          put(get(put(x))) == put(x) byte for byte, for
 *                            every type, on all of the above: the llama
 *                            attention rounds K and V in place (put then
 *                            get) and then stores them (put), so the stored
 *                            bytes must be the rounding's. One exception,
 *                            ggml's: a q8_0 block whose scale underflows f16
 *                            stores d = 0 and nonzero quants (read back as
 *                            0); it is counted, and its values are 0
 *                            either way (-0 where q < 0 in the first row,
 *                            +0 in the second)
 *   rows_kernel_paths        every test above runs on each kernel path
 *                            (AVX-512, AVX2 without it, scalar:
 *                            kvt_kernels_force_*), and put and get give the
 *                            same bytes on all of them (NaNs: a NaN on each)
 *   rows_control             negative controls: each comparison fails on a
 *                            row with one bit flipped, on a q8_0 block
 *                            rounded half to even instead of away from
 *                            zero, on bf16 truncated instead of rounded, and
 *                            on values never rounded (attention without the
 *                            rounding in place)
 *
 * The ggml test skips, saying why, when the peer cannot be had (KVT_PEER=0,
 * offline); the others need nothing. Every random test prints its seed;
 * KVT_TEST_SEED repeats it. Under a second. */
#include "fixture.h"
#include "peer_ggml.h"
#include "test.h"
#include "cache/rows.h"
#include "format/gguf.h"
#include "kernels/cpu.h"
#include "base/util.h"

#include <dlfcn.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define N_RAND 4096 /* random elements per kind of input (a multiple of 32) */
#define MAXN 32768  /* elements of the largest input */


static const kvt_row_type all_types[] = {KVT_ROWS_F32, KVT_ROWS_F16, KVT_ROWS_BF16, KVT_ROWS_Q8_0};
#define N_TYPES (sizeof all_types / sizeof all_types[0])

static float fbits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t ubits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* ---- inputs -------------------------------------------------------------- */

/* The edges of f16 and bf16, both signs (the negatives appended). */
static size_t edges(float *x)
{
    const float e[] = {
        0.0f, 1.0f, FLT_MIN, fbits(1), fbits(0x007fffff),          /* f32 zero, normal, subnormals */
        0x1p-24f, 0x1p-25f, 0x1.8p-24f, 0x1.8p-25f, 0x1p-26f,      /* f16's smallest subnormal, ties around it */
        0x1.ff8p-15f, 0x1.ffcp-15f, 0x1p-14f, 0x1.004p-14f,        /* f16's largest subnormal, the tie to normal */
        65504.0f, 65519.0f, 65520.0f, 65536.0f, 1e6f,              /* f16's largest, the tie to inf, beyond */
        0x1.002p0f, 0x1.006p0f, 0x1.0020001p0f, 0x1.01p0f,         /* f16 ties at 1 (to even, down and up) */
        0x1.03p0f, 0x1.0100002p0f, 0x1.fep127f, 0x1.ff8p127f,      /* bf16 ties, bf16's largest, past it */
        FLT_MAX, INFINITY, 0.1f, 1.0f / 3.0f, 3.14159265f,
    };
    size_t n = sizeof e / sizeof e[0];
    for (size_t i = 0; i < n; i++) {
        x[i] = e[i];
        x[n + i] = -e[i];
    }
    return 2 * n;
}

/* Random f32 bit patterns (every kind of value, NaNs included), then
 * values whose bits below f16's or bf16's mantissa are an exact tie. */
static size_t randoms(float *x, uint64_t *rng)
{
    size_t n = 0;
    for (size_t i = 0; i < N_RAND; i++) x[n++] = fbits((uint32_t)kvt_test_rand(rng));
    for (size_t i = 0; i < N_RAND; i++) { /* f16 range, ties at bit 12 */
        uint32_t u = (uint32_t)kvt_test_rand(rng);
        uint32_t e = 103 + (uint32_t)(kvt_test_rand(rng) % 40); /* 2^-24 .. 2^15 */
        x[n++] = fbits((u & 0x80000000u) | e << 23 | (u & 0x007fe000u) | 0x1000u);
    }
    for (size_t i = 0; i < N_RAND; i++) { /* bf16 ties at bit 15 */
        uint32_t u = (uint32_t)kvt_test_rand(rng);
        x[n++] = fbits((u & 0xffff0000u) | 0x8000u);
    }
    return n;
}

/* Rows for q8_0, 32 elements a block: random rows at scales 1e-9 .. 1e6
 * (the largest block's scale still finite in f16), zero blocks, exact
 * halves, a scale that is an f16 subnormal or underflows, one value in a
 * block, signed zeros and f32 subnormals. */
static size_t q8_rows(float *x, uint64_t *rng)
{
    size_t n = 0;
    const float scales[] = {1e-9f, 1e-7f, 3e-6f, 1e-4f, 0.01f, 1.0f, 37.0f, 1e3f, 1e5f, 1e6f};
    for (size_t s = 0; s < sizeof scales / sizeof scales[0]; s++)
        for (size_t i = 0; i < 1024; i++) {
            double u = (double)(kvt_test_rand(rng) >> 11) / 9007199254740992.0 * 2 - 1;
            x[n++] = (float)(u * u * u) * scales[s]; /* bell-shaped, the block's amax varies */
        }
    for (size_t i = 0; i < 64; i++) x[n++] = 0.0f; /* two zero blocks */
    for (size_t i = 0; i < 32; i++) x[n++] = i % 2 ? -0.0f : 0.0f;
    /* exact halves: amax 127 gives d = 1, id = 1; amax 63.5 d = 0.5, id = 2 */
    for (int b = 0; b < 2; b++) {
        float amax = b ? 63.5f : 127.0f, d = b ? 0.5f : 1.0f;
        x[n++] = amax;
        x[n++] = -amax;
        for (int j = 2; j < 32; j++) x[n++] = d * ((float)(j - 16) + (j % 2 ? 0.5f : -0.5f));
    }
    /* one value; the scale an f16 subnormal (amax 127 * 2^-20), zero (amax
     * below 127 * 2^-25) */
    for (int b = 0; b < 3; b++)
        for (int j = 0; j < 32; j++) {
            float amax = b == 0 ? 5.0f : b == 1 ? 127.0f * 0x1p-20f : 127.0f * 0x1p-27f;
            x[n++] = b == 0 ? (j == 7 ? -amax : 0.0f) : amax * (float)(j - 15) / 16.0f;
        }
    for (int j = 0; j < 32; j++) x[n++] = fbits((uint32_t)(j * 7919) & 0x807fffffu); /* f32 subnormals */
    return n;
}

/* ---- the paths ----------------------------------------------------------- */

enum { PATH_WIDE, PATH_SCALAR, PATH_AVX2, N_PATHS };
static const char *const path_name[N_PATHS] = {"widest", "scalar", "AVX2"};

static void path_set(int p, bool *o1, bool *o2)
{
    *o1 = kvt_kernels_force_scalar(p == PATH_SCALAR);
    *o2 = kvt_kernels_force_avx2(p == PATH_AVX2);
}
static void path_reset(bool o1, bool o2)
{
    kvt_kernels_force_scalar(o1);
    kvt_kernels_force_avx2(o2);
}

/* Index of the first byte where a and b differ; SIZE_MAX when none. */
static size_t diff_at(const void *a, const void *b, size_t n)
{
    const uint8_t *p = a, *q = b;
    for (size_t i = 0; i < n; i++)
        if (p[i] != q[i]) return i;
    return SIZE_MAX;
}

/* f16 or bf16 put and get of x[0..n) against the element functions: the
 * element where they differ, SIZE_MAX when none. */
static size_t vs_reference(kvt_row_type t, const float *x, size_t n, uint16_t *row, float *back)
{
    kvt_rows_put(t, row, x, n);
    kvt_rows_get(t, back, row, n);
    for (size_t i = 0; i < n; i++) {
        uint16_t h = t == KVT_ROWS_F16 ? kvt_f32_to_f16(x[i]) : kvt_f32_to_bf16(x[i]);
        float f = t == KVT_ROWS_F16 ? kvt_f16_to_f32(h) : kvt_bf16_to_f32(h);
        /* a NaN: NaN both ways (the row functions keep its payload, as
         * F16C does; kvt_f32_to_f16 makes it the canonical one) */
        if (isnan(x[i]) && isnan(back[i]) && isnan(f)) continue;
        if (row[i] != h || ubits(back[i]) != ubits(f)) {
            printf("    %s: x = %08x (%a): put %04x (want %04x), get %08x (want %08x)\n", kvt_row_type_name(t),
                   ubits(x[i]), x[i], row[i], h, ubits(back[i]), ubits(f));
            return i;
        }
    }
    return SIZE_MAX;
}

static float xs[MAXN], back[MAXN], back2[MAXN];
static uint8_t row1[MAXN * 4], row2[MAXN * 4], ref[MAXN * 4];

TEST(rows_f16_bf16_reference)
{
    uint64_t rng = kvt_test_seed("rows_f16_bf16_reference");
    bool wide = kvt_test_kernel_paths();
    size_t n = edges(xs);
    n += randoms(xs + n, &rng);
    for (int p = 0; p < N_PATHS; p++) {
        if (p == PATH_AVX2 && !wide) continue;
        bool o1, o2;
        path_set(p, &o1, &o2);
        size_t bad[2];
        for (int k = 0; k < 2; k++) {
            kvt_row_type t = k ? KVT_ROWS_BF16 : KVT_ROWS_F16;
            /* in one long row and in rows of 1, 7 and 64 (the SIMD paths' tails) */
            bad[k] = vs_reference(t, xs, n, (uint16_t *)row1, back);
            const size_t lens[] = {1, 7, 64};
            for (size_t l = 0; l < 3 && bad[k] == SIZE_MAX; l++)
                for (size_t i = 0; i + lens[l] <= n && bad[k] == SIZE_MAX; i += lens[l])
                    bad[k] = vs_reference(t, xs + i, lens[l], (uint16_t *)row1, back);
        }
        path_reset(o1, o2);
        CHECKF(bad[0] == SIZE_MAX && bad[1] == SIZE_MAX, "%s path: f16 or bf16 rows differ from the element functions",
               path_name[p]);
    }
    printf("    %zu values (%zu edges), f16 and bf16, every path: the element functions' bits\n", n, (size_t)edges(back));
}

/* q8_0 of x[0..n) by kvtier and by ggml: the first differing byte of the
 * rows, or of what each reads back; SIZE_MAX when none. */
static size_t q8_vs_ggml(const float *x, size_t n, const char **what)
{
    size_t rb = kvt_rows_bytes(KVT_ROWS_Q8_0, n);
    kvt_rows_put(KVT_ROWS_Q8_0, row1, x, n);
    size_t wrote = ggml.quantize_chunk(KVT_GGML_Q8_0, x, ref, 0, 1, (int64_t)n, NULL);
    *what = "rows";
    if (wrote != rb) return 0;
    size_t d = diff_at(row1, ref, rb);
    if (d != SIZE_MAX) return d;
    *what = "values read back";
    kvt_rows_get(KVT_ROWS_Q8_0, back, row1, n);
    ggml.traits(KVT_GGML_Q8_0)->to_float(ref, back2, (int64_t)n);
    return diff_at(back, back2, n * sizeof(float));
}

TEST(rows_q8_0_ggml)
{
    const char *why = ggml_load();
    if (why) SKIP("%s", why);
    uint64_t rng = kvt_test_seed("rows_q8_0_ggml");
    bool wide = kvt_test_kernel_paths();
    size_t n = q8_rows(xs, &rng);
    /* f16 and bf16 beside ggml's conversions too (finite values: ggml's
     * bf16 makes every NaN quiet its own way) */
    size_t nf = edges(xs + n);
    size_t nr = randoms(xs + n + nf, &rng);
    for (size_t i = n; i < n + nf + nr; i++)
        if (isnan(xs[i])) xs[i] = 1.0f;
    for (int p = 0; p < N_PATHS; p++) {
        if (p == PATH_AVX2 && !wide) continue;
        bool o1, o2;
        path_set(p, &o1, &o2);
        const char *what = "";
        size_t d = q8_vs_ggml(xs, n, &what);
        /* one block at a time and in rows of 3 blocks */
        for (size_t i = 0; i < n && d == SIZE_MAX; i += 32) d = q8_vs_ggml(xs + i, 32, &what);
        for (size_t i = 0; i + 96 <= n && d == SIZE_MAX; i += 96) d = q8_vs_ggml(xs + i, 96, &what);
        size_t f = SIZE_MAX;
        for (int k = 0; k < 2 && f == SIZE_MAX; k++) {
            kvt_row_type t = k ? KVT_ROWS_BF16 : KVT_ROWS_F16;
            kvt_rows_put(t, row1, xs + n, nf + nr);
            ggml.quantize_chunk((int)kvt_rows_ggml(t), xs + n, ref, 0, 1, (int64_t)(nf + nr), NULL);
            f = diff_at(row1, ref, (nf + nr) * 2);
            if (f != SIZE_MAX) printf("    %s: element %zu: %a\n", kvt_row_type_name(t), f / 2, xs[n + f / 2]);
        }
        path_reset(o1, o2);
        CHECKF(d == SIZE_MAX, "%s path: q8_0 %s differ from ggml's at byte %zu", path_name[p], what, d);
        CHECKF(f == SIZE_MAX, "%s path: f16 or bf16 rows differ from ggml's", path_name[p]);
    }
    printf("    %zu q8_0 blocks and %zu f16 and bf16 values as ggml writes and reads them, on each path\n", n / 32,
           nf + nr);
}

/* put(get(put(x))) against put(x) for type t over x[0..n): the first
 * differing byte (SIZE_MAX: none); *underflow counts the q8_0 blocks whose
 * f16 scale is 0 with quants that are not (their values, 0, compared). */
static size_t round_trip(kvt_row_type t, const float *x, size_t n, size_t *underflow)
{
    size_t rb = kvt_rows_bytes(t, n);
    kvt_rows_put(t, row1, x, n);
    kvt_rows_get(t, back, row1, n);
    kvt_rows_put(t, row2, back, n);
    memcpy(back2, x, n * sizeof(float));
    kvt_rows_round(t, back2, n); /* what attention keeps in place */
    if (diff_at(back, back2, n * sizeof(float)) != SIZE_MAX) return 0;
    if (t != KVT_ROWS_Q8_0) return diff_at(row1, row2, rb);
    for (size_t b = 0; b < rb; b += 34) {
        size_t d = diff_at(row1 + b, row2 + b, 34);
        if (d == SIZE_MAX) continue;
        if (row1[b] || row1[b + 1]) return b + d; /* a scale that is not 0 */
        (*underflow)++;
        kvt_rows_get(t, back2, row2 + b, 32);
        for (size_t j = 0; j < 32; j++) /* 0 and -0 (d * q of a negative q) */
            if (back2[j] != 0.0f || back[b / 34 * 32 + j] != 0.0f) return b + d;
    }
    return SIZE_MAX;
}

TEST(rows_idempotent)
{
    uint64_t rng = kvt_test_seed("rows_idempotent");
    bool wide = kvt_test_kernel_paths();
    size_t nq = q8_rows(xs, &rng);
    size_t n = nq + edges(xs + nq);
    n += randoms(xs + n, &rng);
    n -= n % 32;
    /* q8_0: its own rows (with the edges and random bits a block would hold
     * infinities and NaNs, which ggml's q8_0 does not define) */
    for (int p = 0; p < N_PATHS; p++) {
        if (p == PATH_AVX2 && !wide) continue;
        bool o1, o2;
        path_set(p, &o1, &o2);
        size_t under = 0, d[N_TYPES];
        for (size_t k = 0; k < N_TYPES; k++)
            d[k] = round_trip(all_types[k], xs, all_types[k] == KVT_ROWS_Q8_0 ? nq : n, &under);
        path_reset(o1, o2);
        for (size_t k = 0; k < N_TYPES; k++)
            CHECKF(d[k] == SIZE_MAX, "%s path, %s: put(get(put(x))) differs from put(x) at byte %zu", path_name[p],
                   kvt_row_type_name(all_types[k]), d[k]);
        if (p == PATH_WIDE)
            printf("    %zu values (q8_0: %zu), every type: put(get(put(x))) == put(x); %zu q8_0 blocks with an "
                   "underflowed scale (values equal)\n", n, nq, under);
        CHECK(under >= 1); /* the block built for it */
    }
}

/* The first element of x[0..n) whose put (rows a, b) or get (values fa,
 * fb) differs between two paths; SIZE_MAX when none. A NaN need only be a
 * NaN on both: the scalar f16 path writes the canonical NaN, F16C keeps the
 * payload's top bits. */
static size_t same_but_nan(kvt_row_type t, const uint8_t *a, const uint8_t *b, const float *fa, const float *fb,
                           size_t n)
{
    if (t == KVT_ROWS_F32 || t == KVT_ROWS_Q8_0) {
        size_t rb = kvt_rows_bytes(t, n), d = diff_at(a, b, rb);
        if (d != SIZE_MAX) return t == KVT_ROWS_F32 ? d / 4 : d / 34 * 32;
        d = diff_at(fa, fb, n * sizeof(float));
        return d == SIZE_MAX ? d : d / 4;
    }
    for (size_t i = 0; i < n; i++) {
        uint16_t ha = (uint16_t)(a[2 * i] | a[2 * i + 1] << 8), hb = (uint16_t)(b[2 * i] | b[2 * i + 1] << 8);
        bool nan = isnan(fa[i]) && isnan(fb[i]);
        if (!nan && (ha != hb || ubits(fa[i]) != ubits(fb[i]))) return i;
    }
    return SIZE_MAX;
}

/* The bytes of put and get for every type on every path: the same (a NaN
 * a NaN). */
TEST(rows_kernel_paths)
{
    uint64_t rng = kvt_test_seed("rows_kernel_paths");
    bool wide = kvt_test_kernel_paths();
    size_t nq = q8_rows(xs, &rng);
    size_t n = nq + edges(xs + nq);
    n += randoms(xs + n, &rng);
    static uint8_t put_at[N_PATHS][MAXN * 4];
    static float get_at[N_PATHS][MAXN];
    for (size_t k = 0; k < N_TYPES; k++) {
        kvt_row_type t = all_types[k];
        size_t m = t == KVT_ROWS_Q8_0 ? nq : n;
        int np = 0;
        for (int p = 0; p < N_PATHS; p++) {
            if (p == PATH_AVX2 && !wide) continue;
            bool o1, o2;
            path_set(p, &o1, &o2);
            kvt_rows_put(t, put_at[p], xs, m);
            kvt_rows_get(t, get_at[p], put_at[p], m);
            path_reset(o1, o2);
            np++;
            size_t d = same_but_nan(t, put_at[0], put_at[p], get_at[0], get_at[p], m);
            CHECKF(d == SIZE_MAX, "%s: put or get on the %s path differs from the widest at element %zu (%08x)",
                   kvt_row_type_name(t), path_name[p], d, ubits(xs[d]));
        }
        printf("    %s: %zu values, the same bytes on %d paths\n", kvt_row_type_name(t), m, np);
    }
}

/* The comparisons above catch what they are for: a bit flipped in a row,
 * a q8_0 quantiser rounding halves to even (rintf), bf16 truncated. */
TEST(rows_control)
{
    uint64_t rng = kvt_test_seed("rows_control");
    size_t n = edges(xs);
    n += randoms(xs + n, &rng);
    /* a row with one bit flipped is not the element functions' */
    kvt_rows_put(KVT_ROWS_F16, row1, xs, n);
    memcpy(row2, row1, n * 2);
    row2[2 * 100] ^= 1;
    CHECK(diff_at(row1, row2, n * 2) == 200);
    /* bf16 truncated: differs from round to nearest even on the ties */
    size_t trunc_diff = 0;
    for (size_t i = 0; i < n; i++)
        trunc_diff += !isnan(xs[i]) && (uint16_t)(ubits(xs[i]) >> 16) != kvt_f32_to_bf16(xs[i]);
    CHECKF(trunc_diff > 100, "bf16 truncation agrees with rounding on all but %zu values", trunc_diff);
    /* halves to even: the tie block (amax 127, d = 1) differs from ggml's
     * away-from-zero bytes */
    size_t nq = q8_rows(xs, &rng), tie = 0;
    for (size_t b = 0; b < nq; b += 32)
        if (xs[b] == 127.0f && xs[b + 1] == -127.0f) tie = b;
    CHECK(tie > 0);
    kvt_rows_put(KVT_ROWS_Q8_0, row1, xs + tie, 32);
    int8_t even[32];
    size_t differ = 0;
    for (int j = 0; j < 32; j++) {
        even[j] = (int8_t)rintf(xs[tie + j]);
        differ += (int8_t)row1[2 + j] != even[j];
    }
    printf("    control: %zu of 32 quants of the tie block differ when halves go to even; bf16 truncated differs on "
           "%zu values\n", differ, trunc_diff);
    CHECK(differ >= 10);
    /* a rounding in place that rounds nothing (as attention without it)
     * is not what a reader of the stored row sees */
    for (size_t k = 1; k < N_TYPES; k++) {
        kvt_row_type t = all_types[k];
        kvt_rows_put(t, row1, xs, nq);
        kvt_rows_get(t, back, row1, nq);
        CHECKF(diff_at(back, xs, nq * sizeof(float)) != SIZE_MAX, "%s: unrounded values pass for read ones",
               kvt_row_type_name(t));
    }
}
