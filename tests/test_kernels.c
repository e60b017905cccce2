/* Kernel contracts: the scalar and SIMD paths are bit-identical (dot
 * products of every length, binary16 conversions of every value), and a
 * matmul's bytes do not depend on the batch size or the thread count. */
#include "test.h"
#include "kernels/kernels.h"
#include "cache/rows.h"
#include "format/gguf.h"
#include "kernels/qkernels.h"
#include "kernels/qlowbit.h"
#include "format/quant.h"
#include "base/threads.h"
#include "base/util.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static float frand(uint64_t *s) { return (float)((double)(kvt_test_rand(s) >> 11) / 9007199254740992.0 * 2 - 1); }

bool kvt_test_kernel_paths(void)
{
    bool old = kvt_kernels_force_scalar(false), old2 = kvt_kernels_force_avx2(false);
    bool simd = kvt_kernels_simd(), wide = kvt_kernels_avx512();
    kvt_kernels_force_scalar(old);
    kvt_kernels_force_avx2(old2);
    if (wide) printf("    kernel paths: AVX-512 (the widest), AVX2 without it, scalar\n");
    else if (simd)
        kvt_test_skip_env("the AVX2-without-AVX-512 cases: this CPU has no AVX-512 (F, BW, VL), so they would repeat "
                      "the widest path (AVX2); AVX2 and scalar ran");
    else
        kvt_test_skip_env("the SIMD cases: this CPU has no AVX2 (with FMA and F16C), so they would repeat the scalar "
                      "path; scalar ran");
    return wide;
}

TEST(kernels_dot_scalar_equals_simd)
{
    uint64_t st = kvt_test_seed("kernels_dot_scalar_equals_simd");
    float a[300], b[300];
    for (int i = 0; i < 300; i++) { a[i] = frand(&st); b[i] = frand(&st) * 100; }
    for (size_t n = 0; n <= 300; n++) {
        float v = kvt_dot(a, b, n);
        bool old = kvt_kernels_force_scalar(true);
        float w = kvt_dot(a, b, n);
        kvt_kernels_force_scalar(old);
        CHECKF(!memcmp(&v, &w, 4), "n=%zu: %a vs %a", n, v, w);
    }
}

/* The attention kernels against their definitions (kernels.h): scores are
 * kvt_dot * scale, values kvt_axpy key after key, bit for bit (with the
 * queries at a stride, and anywhere), for every
 * shape the blocked SIMD paths split differently (keys in fours and the
 * rest, columns 64/32/16/8 at a time) and on the scalar path. */
TEST(kernels_attention_rows_are_dots_and_axpys)
{
    uint64_t st = kvt_test_seed("kernels_attention_rows_are_dots_and_axpys");
    enum { NQ = 4, NK = 11, MAXN = 200, LDK = 208 };
    static float q[NQ * MAXN], k[NK * LDK], a[NQ * NK], out[NQ * NK], y[NQ * MAXN], want[NQ * MAXN];
    for (size_t i = 0; i < NQ * MAXN; i++) q[i] = frand(&st);
    for (size_t i = 0; i < NK * LDK; i++) k[i] = frand(&st) * 10;
    for (size_t i = 0; i < NQ * NK; i++) a[i] = frand(&st);
    const size_t ns[] = {8, 16, 24, 48, 64, 80, 120, 128, 136, 200};
    int checked = 0, paths = 0;
    /* the widest path, scalar, and AVX2 without the AVX-512 kernels (when
     * the CPU has them) */
    static const char *const path_name[3] = {"simd", "scalar", "avx2"};
    bool wide = kvt_test_kernel_paths();
    for (int sc = 0; sc < 3; sc++) {
        if (sc == 2 && !wide) continue;
        paths++;
        bool old = kvt_kernels_force_scalar(sc == 1), old2 = kvt_kernels_force_avx2(sc == 2);
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
            for (size_t nq = 1; nq <= NQ; nq++)
                for (size_t nk = 0; nk <= NK; nk++) {
                    size_t n = ns[ni];
                    kvt_dots_rows(out, NK, q, MAXN, nq, k, LDK, nk, n, 0.125f);
                    for (size_t u = 0; u < nq; u++)
                        for (size_t j = 0; j < nk; j++) {
                            float d = kvt_dot(q + u * MAXN, k + j * LDK, n) * 0.125f;
                            CHECKF(!memcmp(&d, &out[u * NK + j], 4), "%s n=%zu nq=%zu nk=%zu: score %zu,%zu",
                                   path_name[sc], n, nq, nk, u, j);
                        }
                    for (size_t i = 0; i < NQ * MAXN; i++) y[i] = want[i] = q[i];
                    kvt_axpys_rows(y, MAXN, a, NK, nq, k, LDK, nk, n);
                    for (size_t u = 0; u < nq; u++)
                        for (size_t j = 0; j < nk; j++) kvt_axpy(want + u * MAXN, a[u * NK + j], k + j * LDK, n);
                    CHECKF(!memcmp(y, want, sizeof y), "%s n=%zu nq=%zu nk=%zu: values", path_name[sc], n, nq,
                           nk);
                    /* the same with the queries anywhere (kvt_dots_qs, kvt_axpys_qs), in reverse order */
                    float *op[NQ], *yp[NQ];
                    const float *qp[NQ], *ap[NQ];
                    for (size_t u = 0; u < nq; u++) {
                        size_t r = nq - 1 - u;
                        op[u] = out + r * NK, qp[u] = q + r * MAXN, yp[u] = y + r * MAXN, ap[u] = a + r * NK;
                    }
                    memset(out, 0, sizeof out);
                    kvt_dots_qs(nq, op, qp, k, LDK, nk, n, 0.125f);
                    for (size_t u = 0; u < nq; u++)
                        for (size_t j = 0; j < nk; j++) {
                            float d = kvt_dot(q + u * MAXN, k + j * LDK, n) * 0.125f;
                            CHECKF(!memcmp(&d, &out[u * NK + j], 4), "%s n=%zu nq=%zu nk=%zu: qs score %zu,%zu",
                                   path_name[sc], n, nq, nk, u, j);
                        }
                    for (size_t i = 0; i < NQ * MAXN; i++) y[i] = q[i];
                    kvt_axpys_qs(nq, yp, ap, k, LDK, nk, n);
                    CHECKF(!memcmp(y, want, sizeof y), "%s n=%zu nq=%zu nk=%zu: qs values", path_name[sc], n, nq, nk);
                    checked++;
                }
        kvt_kernels_force_scalar(old);
        kvt_kernels_force_avx2(old2);
    }
    CHECK(checked == paths * 10 * NQ * (NK + 1));
}

/* kvt_expf is glibc's expf (on an FMA machine, as glibc picks its FMA
 * build there): every 31st float of magnitude 2^-8 to 104, where the
 * table and the polynomial decide the bits (a table entry off by 2^-32 of
 * its value changes hundreds of them), every 65537th of the rest, and the
 * edges of the special cases. The whole range was compared once by hand
 * (all 2^32 inputs, 0 differ). */
TEST(kernels_expf_is_glibc)
{
    if (!kvt_kernels_simd()) SKIP_ENV("no AVX2/FMA: libm's expf is then its non-FMA build, which rounds differently");
    size_t bad = 0, n = 0;
    const uint32_t lo = 0x3b800000u, hi = 0x42d00000u; /* 2^-8, 104 */
    for (uint64_t u = 0; u <= 0xffffffffu; n++) {
        uint32_t b = (uint32_t)u, mag = b & 0x7fffffffu;
        float x, a, c;
        memcpy(&x, &b, 4);
        a = kvt_expf(x), c = expf(x);
        if (memcmp(&a, &c, 4) && !(isnan(a) && isnan(c)) && bad++ < 5) printf("    x=%a: %a, libm %a\n", x, a, c);
        u += mag >= lo && mag < hi ? 31 : 65537;
    }
    const float edge[] = {88.0f, 0x1.62e42ep6f, nextafterf(0x1.62e42ep6f, 100), -88.0f, -0x1.9fe368p6f,
                          nextafterf(-0x1.9fe368p6f, -200), -0x1.9d1d9ep6f, nextafterf(-0x1.9d1d9ep6f, -200),
                          -INFINITY, INFINITY, 0.0f, -0.0f, 1e-30f, -1e-30f, -103.5f, 88.5f};
    for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++, n++) {
        float a = kvt_expf(edge[i]), c = expf(edge[i]);
        if (memcmp(&a, &c, 4) && bad++ < 10) printf("    x=%a: %a, libm %a\n", edge[i], a, c);
    }
    printf("    %zu inputs, %zu differ\n", n, bad);
    CHECK(bad == 0);
}

/* kvt_softmax_rows: the SIMD and scalar paths agree bit for bit, and both
 * equal the definition (max, libm expf, sum in order, divide) wherever
 * libm's expf is glibc's; rows with scores 88 and more below their
 * maximum (the special lanes), ties, and every length to 40 plus long
 * ones. */
TEST(kernels_softmax_rows)
{
    uint64_t st = kvt_test_seed("kernels_softmax_rows");
    enum { LD = 1100 };
    static float x[4 * LD], y[4 * LD], w[4 * LD], z[4 * LD];
    size_t lens[48];
    for (size_t i = 0; i <= 40; i++) lens[i] = i;
    const size_t big[] = {63, 64, 65, 255, 1000, 1024, 1099};
    memcpy(lens + 41, big, sizeof big);
    bool wide = kvt_test_kernel_paths();
    for (size_t li = 0; li < 48; li++)
        for (size_t nr = 1; nr <= 4; nr++) {
            size_t n = lens[li];
            for (size_t i = 0; i < 4 * LD; i++) {
                float v = frand(&st) * 8;
                uint64_t k = kvt_test_rand(&st) % 16;
                x[i] = k == 0 ? -150.0f + v : k == 1 ? 3.0f : v; /* special lanes, ties */
            }
            memcpy(y, x, sizeof x);
            memcpy(w, x, sizeof x);
            memcpy(z, x, sizeof x);
            kvt_softmax_rows(x, LD, nr, n);
            bool old = kvt_kernels_force_scalar(true);
            kvt_softmax_rows(y, LD, nr, n);
            kvt_kernels_force_scalar(old);
            old = kvt_kernels_force_avx2(true); /* without the AVX-512 kernels */
            if (wide) kvt_softmax_rows(z, LD, nr, n);
            kvt_kernels_force_avx2(old);
            CHECKF(!memcmp(x, y, sizeof x), "n=%zu rows=%zu: SIMD and scalar differ", n, nr);
            CHECKF(!wide || !memcmp(z, y, sizeof x), "n=%zu rows=%zu: AVX2 and scalar differ", n, nr);
            if (!kvt_kernels_simd()) continue;
            for (size_t r = 0; r < nr; r++) {
                float *v = w + r * LD, m = n ? v[0] : 0, sum = 0;
                for (size_t i = 1; i < n; i++) m = v[i] > m ? v[i] : m;
                for (size_t i = 0; i < n; i++) { v[i] = expf(v[i] - m); sum += v[i]; }
                for (size_t i = 0; i < n; i++) v[i] /= sum;
            }
            CHECKF(!memcmp(x, w, sizeof x), "n=%zu rows=%zu: not the definition", n, nr);
        }
}

/* kvt_swiglu: SIMD and scalar bit for bit, and the definition with libm's
 * expf where that is glibc's; values out to +-120, so that exp(-g)
 * overflows and underflows (the special lanes), every length to 40. */
TEST(kernels_swiglu)
{
    uint64_t st = kvt_test_seed("kernels_swiglu");
    enum { N = 1000 };
    static float g[N], h3[N], a[N], b[N], want[N];
    for (int i = 0; i < N; i++) {
        g[i] = frand(&st) * (i % 5 == 0 ? 120.0f : 6.0f);
        h3[i] = frand(&st) * 3;
    }
    bool wide = kvt_test_kernel_paths();
    for (size_t n = 0; n <= N; n = n < 40 ? n + 1 : n + 480) {
        memcpy(a, g, sizeof g);
        memcpy(b, g, sizeof g);
        kvt_swiglu(a, h3, n);
        bool old = kvt_kernels_force_scalar(true);
        kvt_swiglu(b, h3, n);
        kvt_kernels_force_scalar(old);
        CHECKF(!memcmp(a, b, sizeof a), "n=%zu: SIMD and scalar differ", n);
        memcpy(b, g, sizeof g);
        old = kvt_kernels_force_avx2(true); /* without the AVX-512 kernels */
        if (wide) kvt_swiglu(b, h3, n);
        kvt_kernels_force_avx2(old);
        CHECKF(!wide || !memcmp(a, b, sizeof a), "n=%zu: AVX2 and the widest path differ", n);
        if (!kvt_kernels_simd()) continue;
        for (size_t i = 0; i < N; i++) want[i] = i < n ? g[i] * (1.0f / (1.0f + expf(-g[i]))) * h3[i] : g[i];
        CHECKF(!memcmp(a, want, sizeof a), "n=%zu: not g * (1 / (1 + expf(-g))) * h3", n);
    }
}

TEST(kernels_f16_every_value)
{
    static uint16_t h[65536], back[65536];
    static float f[65536], g[65536];
    for (uint32_t i = 0; i < 65536; i++) h[i] = (uint16_t)i;
    kvt_f16_row_to_f32(f, h, 65536);
    bool old = kvt_kernels_force_scalar(true);
    kvt_f16_row_to_f32(g, h, 65536);
    kvt_kernels_force_scalar(old);
    CHECK(!memcmp(f, g, sizeof f));
    kvt_f32_row_to_f16(back, f, 65536);
    for (uint32_t i = 0; i < 65536; i++) {
        bool nan = (i & 0x7c00) == 0x7c00 && (i & 0x3ff);
        CHECKF(nan ? (back[i] & 0x7c00) == 0x7c00 && (back[i] & 0x3ff) : back[i] == i, "half %#x -> %#x", i, back[i]);
    }
    /* f32 -> f16 rounding: SIMD and scalar agree on random, tie and subnormal inputs */
    uint64_t st = kvt_test_seed("kernels_f16_every_value");
    enum { N = 1 << 16 };
    static float x[N];
    static uint16_t r1[N], r2[N];
    for (int i = 0; i < N; i++) {
        uint32_t bits = (uint32_t)kvt_test_rand(&st);
        if (i % 3 == 0) bits = (bits & 0x80000000u) | ((uint32_t)(100 + i % 60) << 23) | (bits & 0x7fe000u) | 0x1000u; /* exact ties */
        memcpy(&x[i], &bits, 4);
        if (isnan(x[i])) x[i] = 1.0f;
    }
    kvt_f32_row_to_f16(r1, x, N);
    old = kvt_kernels_force_scalar(true);
    kvt_f32_row_to_f16(r2, x, N);
    kvt_kernels_force_scalar(old);
    for (int i = 0; i < N; i++) CHECKF(r1[i] == r2[i], "%a: %#x vs %#x", x[i], r1[i], r2[i]);
}

/* Attention over typed K and V rows (kvt_att_*: f16, bf16 and q8_0 rows
 * read where they are stored and widened in registers) against the same
 * f32 kernels on those rows read into f32 first (kvt_rows_get): the same
 * bits, for the scores (kvt_att_dots_rows, kvt_att_dots_qs) and the mixed
 * values (kvt_att_axpys_rows, kvt_att_axpys_qs) on every kernel path, with
 * rows at an odd byte offset and stride, 1 to 5 queries (the SIMD paths
 * take 3 and 4 heads at a time, then the rest) at odd strides and anywhere
 * (the _qs pair, in reverse order), 0 to 11 keys (4 and 2 at a time, then
 * the rest) and lengths that leave each path's tails (f16 and bf16: 1 to
 * 200, odd ones included; q8_0: whole blocks, 32 to 256). f16 rows hold
 * random finite bits (subnormals included), q8_0 blocks random quants and
 * random finite scales (subnormal ones included), bf16 rows random values
 * over 2^-30 .. 2^30. One (type, path) pass: the count of mismatches of
 * each kernel in miss[4]. */
enum { TK_NQ = 5, TK_NK = 11, TK_MAXN = 256, TK_LDS = 2 * TK_MAXN + 13, TK_LDK = TK_MAXN + 3, TK_LDQ = TK_MAXN + 5 };

static size_t typed_vs_f32(kvt_row_type t, uint64_t *st, size_t miss[4], bool quiet)
{
    static uint8_t src[1 + TK_NK * TK_LDS];
    static float kf[TK_NK * TK_LDK], q[TK_NQ * TK_LDQ], a[TK_NQ * TK_NK], got[TK_NQ * TK_LDQ], want[TK_NQ * TK_LDQ];
    uint8_t *rows = src + 1; /* odd: no alignment to lean on */
    for (size_t i = 0; i < sizeof src; i++) src[i] = (uint8_t)kvt_test_rand(st);
    for (size_t r = 0; r < TK_NK; r++) {
        uint8_t *row = rows + r * TK_LDS;
        if (t == KVT_ROWS_F16)
            for (size_t i = 0; i < TK_MAXN; i++)
                if ((row[2 * i + 1] & 0x7c) == 0x7c) row[2 * i + 1] &= 0xbf; /* finite */
        if (t == KVT_ROWS_Q8_0)
            for (size_t b = 0; b < TK_MAXN / 32; b++)
                if ((row[b * 34 + 1] & 0x7c) == 0x7c) row[b * 34 + 1] &= 0xbf;
        if (t == KVT_ROWS_BF16) {
            float x[TK_MAXN];
            for (size_t i = 0; i < TK_MAXN; i++) x[i] = frand(st) * ldexpf(1.0f, (int)(kvt_test_rand(st) % 61) - 30);
            kvt_rows_put(t, row, x, TK_MAXN);
        }
        kvt_rows_get(t, kf + r * TK_LDK, row, TK_MAXN);
    }
    for (size_t i = 0; i < TK_NQ * TK_LDQ; i++) q[i] = frand(st);
    for (size_t i = 0; i < TK_NQ * TK_NK; i++) a[i] = frand(st);
    const size_t n16[] = {1, 7, 8, 9, 15, 16, 17, 24, 31, 40, 64, 72, 96, 128, 136, 200};
    const size_t n8[] = {32, 64, 96, 128, 160, 192, 256};
    const size_t *ns = t == KVT_ROWS_Q8_0 ? n8 : n16;
    size_t nn = t == KVT_ROWS_Q8_0 ? sizeof n8 / sizeof *n8 : sizeof n16 / sizeof *n16, cases = 0;
    for (size_t ni = 0; ni < nn; ni++)
        for (size_t nq = 1; nq <= TK_NQ; nq++)
            for (size_t nk = 0; nk <= TK_NK; nk++, cases++) {
                size_t n = ns[ni];
                float *gp[TK_NQ], *wp[TK_NQ];
                const float *qp[TK_NQ], *ap[TK_NQ];
                for (size_t u = 0; u < nq; u++) { /* the queries anywhere: in reverse order */
                    size_t r = nq - 1 - u;
                    gp[u] = got + r * TK_LDQ, wp[u] = want + r * TK_LDQ, qp[u] = q + r * TK_LDQ, ap[u] = a + r * TK_NK;
                }
                for (int kind = 0; kind < 4; kind++) {
                    bool mix = kind % 2;
                    for (size_t i = 0; i < TK_NQ * TK_LDQ; i++) got[i] = want[i] = mix ? q[i] : NAN;
                    switch (kind) {
                    case 0:
                        kvt_dots_rows(want, TK_LDQ, q, TK_LDQ, nq, kf, TK_LDK, nk, n, 0.125f);
                        kvt_att_dots_rows(t, got, TK_LDQ, q, TK_LDQ, nq, rows, TK_LDS, nk, n, 0.125f);
                        break;
                    case 1:
                        kvt_axpys_rows(want, TK_LDQ, a, TK_NK, nq, kf, TK_LDK, nk, n);
                        kvt_att_axpys_rows(t, got, TK_LDQ, a, TK_NK, nq, rows, TK_LDS, nk, n);
                        break;
                    case 2:
                        kvt_dots_qs(nq, wp, qp, kf, TK_LDK, nk, n, 0.125f);
                        kvt_att_dots_qs(t, nq, gp, qp, rows, TK_LDS, nk, n, 0.125f);
                        break;
                    default:
                        kvt_axpys_qs(nq, wp, ap, kf, TK_LDK, nk, n);
                        kvt_att_axpys_qs(t, nq, gp, ap, rows, TK_LDS, nk, n);
                    }
                    if (memcmp(got, want, sizeof got) && miss[kind]++ < 2 && !quiet)
                        printf("    %s n=%zu nq=%zu nk=%zu: %s differ\n", kvt_row_type_name(t), n, nq, nk,
                               (const char *[]){"dots_rows", "axpys_rows", "dots_qs", "axpys_qs"}[kind]);
                }
            }
    return cases;
}

static const char *const att_path[3] = {"widest", "scalar", "AVX2"};
static const char *const att_kind[4] = {"dots_rows", "axpys_rows", "dots_qs", "axpys_qs"};

TEST(kernels_attention_typed_rows_equal_f32)
{
    uint64_t st = kvt_test_seed("kernels_attention_typed_rows_equal_f32");
    bool wide = kvt_test_kernel_paths();
    const kvt_row_type types[] = {KVT_ROWS_F16, KVT_ROWS_BF16, KVT_ROWS_Q8_0};
    for (int p = 0; p < 3; p++) {
        if (p == 2 && !wide) continue;
        bool old = kvt_kernels_force_scalar(p == 1), old2 = kvt_kernels_force_avx2(p == 2);
        for (size_t k = 0; k < 3; k++) {
            size_t miss[4] = {0}, cases = 0;
            for (int round = 0; round < 2; round++) cases += typed_vs_f32(types[k], &st, miss, false);
            for (int kind = 0; kind < 4; kind++)
                CHECKF(!miss[kind], "%s path, %s rows: %s differ from f32's in %zu of %zu cases", att_path[p],
                       kvt_row_type_name(types[k]), att_kind[kind], miss[kind], cases);
            if (p == 0) printf("    %s: %zu cases x 4 kernels\n", kvt_row_type_name(types[k]), cases);
        }
        kvt_kernels_force_scalar(old);
        kvt_kernels_force_avx2(old2);
    }
}

/* The comparison above catches a kernel that is not the f32 one on the
 * read rows: q8_0 rows read without their scale (KVT_KERNELS_FAULT_Q8_SCALE)
 * differ in every kernel on every path. */
TEST(kernels_attention_typed_rows_control)
{
    uint64_t st = kvt_test_seed("kernels_attention_typed_rows_control");
    bool wide = kvt_test_kernel_paths();
    for (int p = 0; p < 3; p++) {
        if (p == 2 && !wide) continue;
        bool old = kvt_kernels_force_scalar(p == 1), old2 = kvt_kernels_force_avx2(p == 2);
        size_t miss[4] = {0};
        kvt_kernels_fault = KVT_KERNELS_FAULT_Q8_SCALE;
        size_t cases = typed_vs_f32(KVT_ROWS_Q8_0, &st, miss, true);
        kvt_kernels_fault = 0;
        for (int kind = 0; kind < 4; kind++)
            CHECKF(miss[kind] > cases / 2, "%s path: %s without the q8_0 scale passes in %zu of %zu cases",
                   att_path[p], att_kind[kind], cases - miss[kind], cases);
        printf("    %s path, q8_0 without its scale: %zu, %zu, %zu, %zu of %zu cases differ\n", att_path[p], miss[0],
               miss[1], miss[2], miss[3], cases);
        kvt_kernels_force_scalar(old);
        kvt_kernels_force_avx2(old2);
    }
}

/* A matmul's bytes equal one row at a time and do not depend on how many
 * threads split the outputs. The shapes make the pool split for real (it
 * keeps at least 32K multiply-adds per part): 9 rows x 517 inputs give
 * parts of 8 outputs, so 53 outputs run as 2, 3 and 4 parts with uneven
 * boundaries; d_in 517 leaves a 5-element tail past the 16 lanes. */
TEST(kernels_matmul_batch_and_threads)
{
    enum { DI = 517, DO = 53, NB = 9 };
    uint64_t st = 42;
    float *W = malloc(sizeof(float) * DO * DI), *x = malloc(sizeof(float) * NB * DI);
    float *y1 = malloc(sizeof(float) * NB * DO), *y2 = malloc(sizeof(float) * NB * DO);
    CHECK(W && x && y1 && y2);
    for (int i = 0; i < DO * DI; i++) W[i] = frand(&st);
    for (int i = 0; i < NB * DI; i++) x[i] = frand(&st);
    kvt_matmul(NULL, y1, W, x, NB, DI, DO);
    for (int i = 0; i < NB; i++) kvt_matmul(NULL, y2 + i * DO, W, x + i * DI, 1, DI, DO);
    bool rows_eq = !memcmp(y1, y2, sizeof(float) * NB * DO);
    /* each output is kvt_dot's fixed order, on every path (the widest,
     * scalar, AVX2 without the 8-row AVX-512 tile), whatever the tile:
     * 53 rows are six 8-row tiles, a 4-row one and a single row */
    bool dot_eq = true, wide = kvt_test_kernel_paths();
    for (int path = 0; path < 3; path++) {
        if (path == 2 && !wide) continue;
        bool old = kvt_kernels_force_scalar(path == 1), old2 = kvt_kernels_force_avx2(path == 2);
        kvt_matmul(NULL, y2, W, x, NB, DI, DO);
        for (int i = 0; i < NB; i++)
            for (int o = 0; o < DO; o++) {
                float d = kvt_dot(W + o * DI, x + i * DI, DI);
                dot_eq &= !memcmp(&d, &y1[i * DO + o], 4) && !memcmp(&d, &y2[i * DO + o], 4);
            }
        kvt_kernels_force_scalar(old);
        kvt_kernels_force_avx2(old2);
    }
    CHECK(dot_eq);
    bool threads_eq = true, split = true;
    for (uint32_t th = 2; th <= 4; th++) {
        kvt_pool *p = kvt_pool_new(th);
        if (!p) { split = false; break; }
        memset(y2, 0, sizeof(float) * NB * DO);
        kvt_matmul(p, y2, W, x, NB, DI, DO);
        uint32_t parts = kvt_pool_last_parts(p);
        kvt_pool_free(p);
        if (parts < th) { printf("    %u threads ran as %u ranges\n", th, parts); split = false; }
        if (memcmp(y1, y2, sizeof(float) * NB * DO)) { printf("    %u threads differ\n", th); threads_eq = false; }
    }
    /* One row is too little work to split: it runs as one part. */
    kvt_pool *p = kvt_pool_new(2);
    if (p) kvt_matmul(p, y2, W, x, 1, DI, DO);
    uint32_t one = kvt_pool_last_parts(p);
    kvt_pool_free(p);
    free(W), free(x), free(y1), free(y2);
    CHECK(rows_eq);
    CHECK(split && threads_eq);
    CHECK(one == 1);
}

/* Float weights (F16 and BF16 read in place by the SIMD tiles, converted
 * to f32 a segment at a time by the scalar path, F32): every output is kvt_dot of the row as f32, on
 * every path, one token at a time, in a prefill whose last token block is
 * a single token, and on 3 threads with the tokens split. The shapes take
 * each way through: d_in 5 (no vector at all), 517 (a 5-element tail:
 * the tiles leave their lanes to the reduction after them), 768 and 2048 (one segment of F16, a
 * multiple of 16: the tiles finish the dots), 1048 (a last F16 segment of
 * 24: 16 and a tail of 8) and 2053 (three F16 segments, the last of 5); 55
 * rows (six 8-row sweeps, then 4 rows and 3), 14 tokens (four 3-token tiles
 * and 2). Negative control: one weight of row 5 changed changes row 5's
 * outputs only. */
/* Outputs of tokens [0, n) in y (n x d_out) that are not kvt_dot of the
 * rows of wf (d_out x d_in) with x. */
static size_t not_dot(const float *wf, const float *x, const float *y, size_t n, size_t d_out, size_t d_in)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t o = 0; o < d_out; o++) {
            float d = kvt_dot(wf + o * d_in, x + i * d_in, d_in);
            bad += memcmp(&d, &y[i * d_out + o], 4) != 0;
        }
    return bad;
}

TEST(kernels_matmul_float_types)
{
    enum { DO = 55, NB = 14, N1 = 97, NP = 302 }; /* N1: blocks of 96 tokens and 1; NP: 100, 101, 101 a thread */
    const size_t dis[] = {5, 517, 768, 1048, 2048, 2053};
    const uint32_t types[] = {KVT_GGML_F16, KVT_GGML_BF16, KVT_GGML_F32};
    uint64_t st = kvt_test_seed("kernels_matmul_float_types");
    kvt_pool *p = kvt_pool_new(3);
    CHECK(p != NULL);
    bool wide = kvt_test_kernel_paths();
    for (size_t ty = 0; ty < 3; ty++)
        for (size_t c = 0; c < sizeof dis / sizeof dis[0]; c++) {
            uint32_t type = types[ty];
            size_t DI = dis[c], es = type == KVT_GGML_F32 ? 4 : 2;
            uint8_t *W = malloc(es * DO * DI);
            float *wf = malloc(sizeof(float) * DO * DI), *x = malloc(sizeof(float) * NP * DI);
            float *y1 = malloc(sizeof(float) * NP * DO), *y2 = malloc(sizeof(float) * NP * DO);
            CHECK(W && wf && x && y1 && y2);
            for (size_t i = 0; i < DO * DI; i++) {
                float v = frand(&st);
                if (type == KVT_GGML_F16) ((uint16_t *)W)[i] = kvt_f32_to_f16(v), wf[i] = kvt_f16_to_f32(kvt_f32_to_f16(v));
                else if (type == KVT_GGML_BF16) ((uint16_t *)W)[i] = kvt_f32_to_bf16(v), wf[i] = kvt_bf16_to_f32(kvt_f32_to_bf16(v));
                else ((float *)W)[i] = wf[i] = v;
            }
            for (size_t i = 0; i < NP * DI; i++) x[i] = frand(&st);
            kvt_wmat m = {W, type, DO, DI, es * DI, NULL};
            const char *tn = kvt_quant_name(type);
            for (int path = 0; path < 3; path++) {
                if (path == 2 && !wide) continue;
                bool old = kvt_kernels_force_scalar(path == 1), old2 = kvt_kernels_force_avx2(path == 2);
                kvt_matmul_w(NULL, y1, &m, x, NB, NULL);
                for (int i = 0; i < NB; i++) kvt_matmul_w(NULL, y2 + i * DO, &m, x + i * DI, 1, NULL);
                size_t b1 = not_dot(wf, x, y1, NB, DO, DI), b2 = not_dot(wf, x, y2, NB, DO, DI);
                CHECKF(b1 == 0 && b2 == 0, "%s d_in %zu path %d: %zu outputs of a batch, %zu one token at a time, not kvt_dot",
                       tn, DI, path, b1, b2);
                /* the few tokens of batched decodes */
                for (size_t nb = 2; nb <= 9; nb++) {
                    kvt_matmul_w(NULL, y1, &m, x, nb, NULL);
                    size_t bn = not_dot(wf, x, y1, nb, DO, DI);
                    CHECKF(bn == 0, "%s d_in %zu path %d: %zu outputs of %zu tokens not kvt_dot", tn, DI, path, bn, nb);
                }
                kvt_kernels_force_scalar(old);
                kvt_kernels_force_avx2(old2);
            }
            kvt_matmul_w(NULL, y1, &m, x, N1, NULL);
            size_t b1 = not_dot(wf, x, y1, N1, DO, DI);
            CHECKF(b1 == 0, "%s d_in %zu: %zu outputs of %d tokens not kvt_dot", tn, DI, b1, N1);
            kvt_matmul_w(p, y1, &m, x, NP, NULL);
            CHECKF(kvt_pool_last_parts(p) == 3, "%s d_in %zu: %d tokens ran as %u parts", tn, DI, NP, kvt_pool_last_parts(p));
            b1 = not_dot(wf, x, y1, NP, DO, DI);
            CHECKF(b1 == 0, "%s d_in %zu: %zu outputs of %d tokens on 3 threads not kvt_dot", tn, DI, b1, NP);
            /* 2 rows: split by rows it would run as 2 parts */
            kvt_wmat two = {W, type, 2, DI, es * DI, NULL};
            kvt_matmul_w(p, y2, &two, x, NP, NULL);
            CHECKF(kvt_pool_last_parts(p) == 3, "%s d_in %zu: 2 rows x %d tokens not split by tokens", tn, DI, NP);
            kvt_matmul_w(NULL, y1, &m, x, NB, NULL);
            if (type == KVT_GGML_F32) ((uint32_t *)W)[5 * DI + DI / 2] ^= 0x00800000u; /* the exponent's low bit */
            else ((uint16_t *)W)[5 * DI + DI / 2] ^= type == KVT_GGML_F16 ? 0x0400 : 0x0080;
            kvt_matmul_w(NULL, y2, &m, x, NB, NULL);
            size_t row5 = 0, others = 0;
            for (int i = 0; i < NB; i++)
                for (int o = 0; o < DO; o++)
                    if (y1[i * DO + o] != y2[i * DO + o]) ++*(o == 5 ? &row5 : &others);
            CHECKF(others == 0 && row5 == NB, "%s d_in %zu: a changed weight of row 5 changes %zu of its %d outputs and %zu others",
                   tn, DI, row5, NB, others);
            free(W), free(wf), free(x), free(y1), free(y2);
        }
    kvt_pool_free(p);
}

/* Negative control of kernels_matmul_float_types' comparison on the
 * AVX-512 tile (F16, BF16 and F32 weights, 512-bit fused multiply-adds):
 * with KVT_KERNELS_FAULT_ZMM_ORDER the tile adds lane 3's elements in
 * reverse order (the same products, one lane's order changed, nothing
 * else). The
 * comparison with kvt_dot must then find outputs that differ, and only on
 * the AVX-512 path: AVX2 and scalar keep the bits. Skips without AVX-512.
 * At 6 tokens (two 3-token tiles) and at 2, which a batched decode step of
 * two sequences gives: two tokens run on the 8-row tile too (not the
 * one-row decode kernel, which is AVX2's on every path), so the fault must
 * show there as well. */
TEST(kernels_matmul_zmm_order_control)
{
    enum { DI = 768, DO = 24, NB = 6 };
    bool wide = kvt_test_kernel_paths();
    if (!wide) SKIP_ENV("the AVX-512 tile does not run on this CPU (no AVX-512 F, BW, VL)");
    const uint32_t types[] = {KVT_GGML_F16, KVT_GGML_BF16, KVT_GGML_F32};
    uint64_t st = kvt_test_seed("kernels_matmul_zmm_order_control");
    for (size_t ty = 0; ty < 3; ty++) {
        uint32_t type = types[ty];
        size_t es = type == KVT_GGML_F32 ? 4 : 2;
        uint8_t *W = malloc(es * DO * DI);
        float *wf = malloc(sizeof(float) * DO * DI), *x = malloc(sizeof(float) * NB * DI);
        float *y = malloc(sizeof(float) * NB * DO);
        CHECK(W && wf && x && y);
        for (size_t i = 0; i < DO * DI; i++) {
            float v = frand(&st);
            if (type == KVT_GGML_F16) ((uint16_t *)W)[i] = kvt_f32_to_f16(v), wf[i] = kvt_f16_to_f32(kvt_f32_to_f16(v));
            else if (type == KVT_GGML_BF16) ((uint16_t *)W)[i] = kvt_f32_to_bf16(v), wf[i] = kvt_bf16_to_f32(kvt_f32_to_bf16(v));
            else ((float *)W)[i] = wf[i] = v;
        }
        for (size_t i = 0; i < NB * DI; i++) x[i] = frand(&st);
        kvt_wmat m = {W, type, DO, DI, es * DI, NULL};
        const char *tn = kvt_quant_name(type);
        for (size_t k = 0; k < 2; k++) {
            size_t nb = k ? 2 : NB, bad[3];
            for (int path = 0; path < 3; path++) {
                bool old = kvt_kernels_force_scalar(path == 1), old2 = kvt_kernels_force_avx2(path == 2);
                kvt_kernels_fault = KVT_KERNELS_FAULT_ZMM_ORDER;
                kvt_matmul_w(NULL, y, &m, x, nb, NULL);
                kvt_kernels_fault = 0;
                bad[path] = not_dot(wf, x, y, nb, DO, DI);
                kvt_kernels_force_scalar(old);
                kvt_kernels_force_avx2(old2);
            }
            printf("    %s, %zu tokens: with the fault, %zu of %zu outputs of the AVX-512 path differ from kvt_dot "
                   "(AVX2 %zu, scalar %zu)\n", tn, nb, bad[0], nb * DO, bad[2], bad[1]);
            CHECKF(bad[0] > 0, "%s, %zu tokens: one lane's order changed in the AVX-512 tile, and no output differs", tn,
                   nb);
            CHECKF(bad[1] == 0 && bad[2] == 0, "%s, %zu tokens: the fault reached the scalar (%zu) or AVX2 (%zu) path", tn,
                   nb, bad[1], bad[2]);
            kvt_matmul_w(NULL, y, &m, x, nb, NULL);
            CHECKF(not_dot(wf, x, y, nb, DO, DI) == 0, "%s, %zu tokens: without the fault the AVX-512 path is not kvt_dot",
                   tn, nb);
        }
        free(W), free(wf), free(x), free(y);
    }
}

/* Where a block keeps its f16 super-scale d (iq1_m: in the top nibbles of
 * its scale words, iq1m_set_d). */
static size_t d_at(uint32_t type)
{
    return type == KVT_GGML_Q6_K ? 208 : type == KVT_GGML_Q2_K ? 80 : type == KVT_GGML_Q3_K ? 108
         : type == KVT_GGML_TQ1_0 ? 52 : type == KVT_GGML_TQ2_0 ? 64 : 0;
}

static uint16_t iq1m_d(const uint8_t *q)
{
    uint16_t d = 0;
    for (int w = 0; w < 4; w++) d |= (uint16_t)((q[49 + 2 * w] >> 4) << 4 * w);
    return d;
}

static void iq1m_set_d(uint8_t *q, uint16_t d)
{
    for (int w = 0; w < 4; w++) q[49 + 2 * w] = (uint8_t)((q[49 + 2 * w] & 0x0f) | ((d >> 4 * w) & 15) << 4);
}

/* Random blocks of an integer weight type with sane f16 scales; Q4_1 and
 * Q5_1 get a negative minimum of up to the block's range, as ggml's is. */
static void rand_blocks(uint32_t type, uint8_t *p, size_t rows, size_t cols, uint64_t *st)
{
    size_t blk, bytes;
    kvt_quant_block(type, &blk, &bytes);
    size_t nb = rows * cols / blk;
    for (size_t b = 0; b < nb; b++) {
        uint8_t *q = p + b * bytes;
        for (size_t j = 0; j < bytes; j++) q[j] = (uint8_t)kvt_test_rand(st);
        uint16_t d = kvt_f32_to_f16(0.01f + 0.02f * fabsf(frand(st)));
        uint16_t m = kvt_f32_to_f16(0.005f * fabsf(frand(st)));
        size_t at = d_at(type);
        if (type == KVT_GGML_MXFP4) { q[0] = (uint8_t)(120 + kvt_test_rand(st) % 4); continue; }
        if (type == KVT_GGML_IQ1_M) { iq1m_set_d(q, d); continue; }
        q[at] = (uint8_t)d, q[at + 1] = (uint8_t)(d >> 8);
        if (type == KVT_GGML_Q4_K || type == KVT_GGML_Q5_K) q[2] = (uint8_t)m, q[3] = (uint8_t)(m >> 8);
        if (type == KVT_GGML_Q2_K) q[82] = (uint8_t)m, q[83] = (uint8_t)(m >> 8);
        if (type == KVT_GGML_Q4_1 || type == KVT_GGML_Q5_1) {
            float dv = kvt_f16_to_f32(d), qmax = type == KVT_GGML_Q4_1 ? 15.0f : 31.0f;
            m = kvt_f32_to_f16(-dv * qmax * fabsf(frand(st)));
            q[2] = (uint8_t)m, q[3] = (uint8_t)(m >> 8);
        }
    }
}

/* The integer kernels (qkernels.h: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL,
 * MXFP4, Q2_K to Q6_K, IQ4_XS, the IQ1/IQ2/IQ3 types, TQ1_0, TQ2_0):
 * scalar and SIMD give the same bits, a
 * token's outputs do not depend on the batch or the threads, and each output
 * is within the activations' rounding of the exact dot product of the
 * dequantised weights with x: the per-token quantisation moves element i by
 * at most d_x / 2 (d_x its block's scale, amax / 127), so
 * |y - w.x| <= sum_i |w_i| d_x(i) / 2, plus float rounding (1e-5 relative).
 * Negative control: with row 0's block scales doubled (Q4_1, Q5_1: and
 * their minima, so that the row doubles), its large outputs leave the
 * bound. */
TEST(kernels_integer_types)
{
    const uint32_t types[] = {KVT_GGML_Q8_0, KVT_GGML_Q4_0, KVT_GGML_Q4_1, KVT_GGML_Q5_0,
                              KVT_GGML_Q5_1, KVT_GGML_IQ4_NL, KVT_GGML_MXFP4, KVT_GGML_Q4_K,
                              KVT_GGML_Q5_K, KVT_GGML_Q6_K, KVT_GGML_IQ4_XS, KVT_GGML_Q2_K,
                              KVT_GGML_Q3_K, KVT_GGML_IQ2_XXS, KVT_GGML_IQ2_XS, KVT_GGML_IQ2_S,
                              KVT_GGML_IQ3_XXS, KVT_GGML_IQ3_S, KVT_GGML_IQ1_S, KVT_GGML_IQ1_M,
                              KVT_GGML_TQ1_0, KVT_GGML_TQ2_0};
    enum { DI = 768, DO = 13, NB = 13 }; /* tokens: K-quant rows take 8, 4 and 1 at a time */
    uint64_t st = kvt_test_seed("kernels_integer_types");
    bool wide = kvt_test_kernel_paths();
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        uint32_t type = types[k];
        size_t row = kvt_quant_row_bytes(type, DI);
        uint8_t *W = malloc(row * DO), *qx = malloc(kvt_q_act_bytes(type, NB, DI));
        float *x = malloc(sizeof(float) * NB * DI), *wf = malloc(sizeof(float) * DO * DI);
        float *y1 = malloc(sizeof(float) * NB * DO), *y2 = malloc(sizeof(float) * NB * DO);
        CHECK(W && qx && x && wf && y1 && y2);
        rand_blocks(type, W, DO, DI, &st);
        for (int i = 0; i < NB * DI; i++) x[i] = frand(&st) * (i % 97 == 0 ? 8.0f : 1.0f);
        CHECK_OK(kvt_quant_to_f32(type, W, wf, (size_t)DO * DI));
        kvt_wmat m = {W, type, DO, DI, row};
        kvt_matmul_w(NULL, y1, &m, x, NB, qx);
        bool old = kvt_kernels_force_scalar(true);
        kvt_matmul_w(NULL, y2, &m, x, NB, qx);
        kvt_kernels_force_scalar(old);
        CHECKF(!memcmp(y1, y2, sizeof(float) * NB * DO), "%s: scalar differs from SIMD", kvt_quant_name(type));
        old = kvt_kernels_force_avx2(true);
        if (wide) kvt_matmul_w(NULL, y2, &m, x, NB, qx);
        kvt_kernels_force_avx2(old);
        CHECKF(!memcmp(y1, y2, sizeof(float) * NB * DO), "%s: AVX2 differs from AVX-512", kvt_quant_name(type));
        for (int i = 0; i < NB; i++) kvt_matmul_w(NULL, y2 + i * DO, &m, x + i * DI, 1, qx);
        CHECKF(!memcmp(y1, y2, sizeof(float) * NB * DO), "%s: one token at a time differs", kvt_quant_name(type));
        kvt_pool *p = kvt_pool_new(3);
        CHECK(p != NULL);
        kvt_matmul_w(p, y2, &m, x, NB, qx);
        kvt_pool_free(p);
        CHECKF(!memcmp(y1, y2, sizeof(float) * NB * DO), "%s: 3 threads differ", kvt_quant_name(type));
        /* the control's outputs: row 0's block scales doubled (f16 exponent + 1) */
        float *yc = malloc(sizeof(float) * NB * DO);
        size_t bbytes, belems, at = d_at(type);
        kvt_quant_block(type, &belems, &bbytes);
        /* f16: exponent + 1 (bit 2 of the high byte); E8M0: + 1 */
        size_t hi = type == KVT_GGML_MXFP4 ? 0 : at + 1;
        uint8_t step = type == KVT_GGML_MXFP4 ? 1 : 4;
        bool mins = type == KVT_GGML_Q4_1 || type == KVT_GGML_Q5_1; /* the minimum's high byte: 3 */
        for (size_t b = 0; b < DI / belems; b++) {
            if (type == KVT_GGML_IQ1_M) { iq1m_set_d(W + b * bbytes, (uint16_t)(iq1m_d(W + b * bbytes) + 0x400)); continue; }
            W[b * bbytes + hi] = (uint8_t)(W[b * bbytes + hi] + step);
            if (mins) W[b * bbytes + 3] = (uint8_t)(W[b * bbytes + 3] + step);
        }
        kvt_matmul_w(NULL, yc, &m, x, NB, qx);
        for (size_t b = 0; b < DI / belems; b++) {
            if (type == KVT_GGML_IQ1_M) { iq1m_set_d(W + b * bbytes, (uint16_t)(iq1m_d(W + b * bbytes) - 0x400)); continue; }
            W[b * bbytes + hi] = (uint8_t)(W[b * bbytes + hi] - step);
            if (mins) W[b * bbytes + 3] = (uint8_t)(W[b * bbytes + 3] - step);
        }
        size_t blk = belems, off = 0, n_bad = 0, n_ctl = 0;
        double worst = 0;
        for (int i = 0; i < NB; i++)
            for (int o = 0; o < DO; o++) {
                double exact = 0, bound = 0;
                for (size_t b = 0; b < DI / blk; b++) {
                    double amax = 0;
                    for (size_t j = 0; j < blk; j++) amax = fmax(amax, fabs(x[i * DI + b * blk + j]));
                    for (size_t j = 0; j < blk; j++) {
                        size_t e = b * blk + j;
                        exact += (double)wf[o * DI + e] * x[i * DI + e];
                        bound += fabs(wf[o * DI + e]) * amax / 127 / 2;
                    }
                }
                bound = bound * 1.001 + 1e-5 * fabs(exact) + 1e-6;
                double err = fabs(y1[i * DO + o] - exact);
                worst = fmax(worst, err / bound);
                n_bad += err > bound;
                if (o == 0) n_ctl += fabs(yc[i * DO] - exact) > bound;
                off++;
            }
        printf("    %s: %zu outputs, worst error %.2f of its bound; control: %zu of %d outside\n",
               kvt_quant_name(type), off, worst, n_ctl, NB);
        CHECKF(n_bad == 0, "%s: %zu outputs outside the bound", kvt_quant_name(type), n_bad);
        /* outputs near 0 stay inside; the large ones must not */
        CHECKF(n_ctl >= 1, "%s: doubled scales stay inside the bound", kvt_quant_name(type));
        free(W), free(qx), free(x), free(wf), free(y1), free(y2), free(yc);
    }
}

/* The low-bit types' kernels (Q2_K, Q3_K, the i-quants, TQ1_0, TQ2_0) against the exact
 * dot product of the dequantised weights (kvt_quant_to_f32, itself ggml's
 * to_float bit for bit) with the token's own Q8_K activations as the
 * kernel read them from qx (d_x * q_i): the kernel's integers are exact, so
 * only its float steps round (per superblock d_w * d_x, the integer sum to
 * f32, one fma; Q2_K a second), and |y - ref| <= 2^-20 sum |w_i d_x q_i|.
 * Then the bits: every path (AVX-512 with VNNI where the CPU has it,
 * AVX-512 without VNNI, AVX2, scalar) and every tile gives the scalar
 * path's bits: 1, 2 and 3 tokens (the four-row decode tiles, DO = 53 rows:
 * thirteen tiles and one row alone), 4, 8, 13 and 75 tokens (eight-token
 * vectors, the rest one at a time, past LB_T = 64; with VNNI the prefill's
 * 16-row panels, three and five rows alone, and 8, 4 and 1 tokens a step),
 * one token a call, and 3 threads (ranges that cut the tiles). Negative controls
 * (kvt_q_fault, the kernels alone): iq2_xxs with grid entry 78 read for
 * index 77 (every block of row 0 uses 77 in its first group) and q3_K with
 * its sixth scale one more put row 0's outputs outside (both in the
 * kernels that build the weights in registers: the SIMD paths read
 * iq2_xxs's codebook through the faulted copy, q3_K's scales through
 * q3k_scales or its vector form); KVT_QUANT_FAULT_LANE (one lane of a SIMD tile one off in
 * its integer sum) makes the bit comparison fail on every SIMD path, in
 * decode (row 1 of a tile) and in prefill (token 3 of a vector; row 5 of
 * a VNNI panel). */
TEST(kernels_lowbit_exact)
{
    const uint32_t types[] = {KVT_GGML_Q2_K, KVT_GGML_Q3_K, KVT_GGML_IQ2_XXS, KVT_GGML_IQ2_XS, KVT_GGML_IQ2_S,
                              KVT_GGML_IQ3_XXS, KVT_GGML_IQ3_S, KVT_GGML_IQ1_S, KVT_GGML_IQ1_M,
                              KVT_GGML_TQ1_0, KVT_GGML_TQ2_0};
    enum { DI = 1024, DO = 53, NB = 75 };
    static const int widths[] = {1, 2, 3, 4, 8, 13, NB};
    uint64_t st = kvt_test_seed("kernels_lowbit_exact");
    bool wide = kvt_test_kernel_paths();
    bool simd = kvt_kernels_simd(), vnni = kvt_cpu_vnni();
    const char *const path[4] = {vnni ? "AVX-512 VNNI" : wide ? "AVX-512" : "widest", "AVX2", "scalar",
                                 "AVX-512 without VNNI"};
    if (wide && !vnni)
        kvt_test_skip_env("the AVX-512-without-VNNI case: this CPU has no AVX-512 VNNI, so it would repeat the widest "
                          "path");
    kvt_pool *pool = kvt_pool_new(3);
    CHECK(pool != NULL);
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        uint32_t type = types[k];
        size_t row = kvt_quant_row_bytes(type, DI), bbytes = row / (DI / 256), nsb = DI / 256;
        uint8_t *W = malloc(row * DO), *qx = malloc(kvt_q_act_bytes(type, NB, DI));
        float *x = malloc(sizeof(float) * NB * DI), *wf = malloc(sizeof(float) * DO * DI), *y = malloc(sizeof(float) * NB * DO);
        float *ys = malloc(sizeof(float) * NB * DO);
        CHECK(W && qx && x && wf && y && ys);
        rand_blocks(type, W, DO, DI, &st);
        if (type == KVT_GGML_IQ2_XXS)
            for (size_t b = 0; b < nsb; b++) W[b * bbytes + 2] = 77; /* row 0: index 77 in every block */
        for (int i = 0; i < NB * DI; i++) x[i] = frand(&st) * (i % 97 == 0 ? 8.0f : 1.0f);
        CHECK_OK(kvt_quant_to_f32(type, W, wf, (size_t)DO * DI));
        kvt_wmat m = {W, type, DO, DI, row};
        size_t stride = kvt_q_act_bytes(type, 1, DI);
        bool os = kvt_kernels_force_scalar(true);
        kvt_matmul_w(NULL, ys, &m, x, NB, qx); /* the scalar bits every other run must give */
        kvt_kernels_force_scalar(os);
        for (int run = 0; run < 5; run++) {
            /* 0 widest, 1 AVX2, 2 scalar, 3 AVX-512 without VNNI, 4 the GRID / SCALE control (widest) */
            bool fault = run == 4 && (type == KVT_GGML_IQ2_XXS || type == KVT_GGML_Q3_K);
            if (run == 4 && !fault) break;
            if (run == 1 && !wide) continue;
            if (run == 3 && !vnni) continue;
            bool o1 = kvt_kernels_force_avx2(run == 1), o2 = kvt_kernels_force_scalar(run == 2);
            bool o3 = kvt_kernels_force_novnni(run == 3);
            kvt_q_fault = fault ? (type == KVT_GGML_Q3_K ? KVT_QUANT_FAULT_SCALE : KVT_QUANT_FAULT_GRID) : 0;
            kvt_matmul_w(NULL, y, &m, x, NB, qx);
            kvt_q_fault = 0;
            size_t n_bad = 0, n_row0 = 0;
            double worst = 0;
            for (int i = 0; i < NB; i++) {
                const uint8_t *a = qx + (size_t)i * stride;
                const float *dx = (const float *)a;
                const int8_t *q = (const int8_t *)(a + nsb * (sizeof(float) + 16 * sizeof(int16_t)));
                for (int o = 0; o < DO; o++) {
                    double ref = 0, mag = 0;
                    for (size_t e = 0; e < DI; e++) {
                        double t = (double)wf[o * DI + e] * ((double)dx[e / 256] * q[e]);
                        ref += t, mag += fabs(t);
                    }
                    double err = fabs(y[i * DO + o] - ref), bound = mag * 0x1p-20 + 1e-30;
                    worst = fmax(worst, err / bound);
                    if (err > bound) { n_bad++; n_row0 += o == 0; }
                }
            }
            if (fault) {
                kvt_kernels_force_avx2(o1), kvt_kernels_force_scalar(o2), kvt_kernels_force_novnni(o3);
                printf("    %s control: %zu of row 0's %d outputs outside, %zu others\n", kvt_quant_name(type), n_row0, NB,
                       n_bad - n_row0);
                CHECKF(n_row0 >= NB - 1, "%s: the injected fault stays inside the bound", kvt_quant_name(type));
                continue;
            }
            CHECKF(n_bad == 0, "%s, %s: %zu outputs off the exact sum (worst %.2f of the bound)",
                   kvt_quant_name(type), path[run], n_bad, worst);
            if (run == 0) printf("    %s: worst error %.3f of its bound\n", kvt_quant_name(type), worst);
            /* the bits: each tile width, one token a call, 3 threads */
            size_t n_diff = 0;
            for (size_t wi = 0; wi < sizeof widths / sizeof *widths; wi++) {
                kvt_matmul_w(NULL, y, &m, x, (size_t)widths[wi], qx);
                n_diff += memcmp(y, ys, sizeof(float) * DO * (size_t)widths[wi]) != 0;
            }
            for (int i = 0; i < NB; i++) kvt_matmul_w(NULL, y + i * DO, &m, x + i * DI, 1, qx);
            n_diff += memcmp(y, ys, sizeof(float) * NB * DO) != 0;
            kvt_matmul_w(pool, y, &m, x, NB, qx);
            n_diff += memcmp(y, ys, sizeof(float) * NB * DO) != 0;
            kvt_matmul_w(pool, y, &m, x, 1, qx);
            n_diff += memcmp(y, ys, sizeof(float) * DO) != 0;
            CHECKF(n_diff == 0, "%s, %s: %zu of 10 runs differ from the scalar bits", kvt_quant_name(type), path[run],
                   n_diff);
            /* the control: one lane one off, in decode and in prefill */
            bool lanes = (run == 0 && simd) || run == 1 || run == 3;
            if (lanes) {
                kvt_q_fault = KVT_QUANT_FAULT_LANE;
                kvt_matmul_w(NULL, y, &m, x, 1, qx);
                bool dec = memcmp(y, ys, sizeof(float) * DO) != 0;
                kvt_matmul_w(NULL, y, &m, x, NB, qx);
                bool pre = false; /* row 5: inside a VNNI panel, in every path's prefill tile */
                for (int i = 0; i < NB; i++) pre |= memcmp(y + i * DO + 5, ys + i * DO + 5, sizeof(float)) != 0;
                kvt_q_fault = 0;
                if (k == 0) printf("    lane control, %s: decode %s, prefill %s\n", path[run], dec ? "differs" : "SAME",
                                   pre ? "differs" : "SAME");
                CHECKF(dec && pre, "%s, %s: one lane one off keeps the scalar bits (decode %d, prefill %d)",
                       kvt_quant_name(type), path[run], dec, pre);
            }
            kvt_kernels_force_avx2(o1), kvt_kernels_force_scalar(o2), kvt_kernels_force_novnni(o3);
        }
        free(W), free(qx), free(x), free(wf), free(y), free(ys);
    }
    kvt_pool_free(pool);
}

/* Q4_K and Q5_K matrices packed four rows at a time (kvt_q_pack, as a model
 * does when it loads): the kernels that read the packed copy give the bits
 * of the rows as stored, for decode (one token), prefill (eight, four and
 * one token a call), 1 and 3 threads, AVX-512 and AVX2, against the scalar
 * path over W->data. The control: one scale changed in the packed copy
 * alone changes the outputs of its rows, so the packed copy is what ran. */
TEST(kernels_kquant_packed)
{
    const uint32_t types[] = {KVT_GGML_Q4_K, KVT_GGML_Q5_K};
    enum { DI = 1024, DO = 16, NB = 13 };
    uint64_t st = kvt_test_seed("kernels_kquant_packed");
    bool wide = kvt_test_kernel_paths();
    for (size_t k = 0; k < 2; k++) {
        uint32_t type = types[k];
        size_t row = kvt_quant_row_bytes(type, DI);
        uint8_t *W = malloc(row * DO), *qx = malloc(kvt_q_act_bytes(type, NB, DI));
        float *x = malloc(sizeof(float) * NB * DI), *y1 = malloc(sizeof(float) * NB * DO),
              *y2 = malloc(sizeof(float) * NB * DO);
        CHECK(W && qx && x && y1 && y2);
        rand_blocks(type, W, DO, DI, &st);
        for (int i = 0; i < NB * DI; i++) x[i] = frand(&st) * (i % 97 == 0 ? 8.0f : 1.0f);
        kvt_wmat m = {W, type, DO, DI, row, NULL};
        kvt_wmat odd = {W, type, DO - 1, DI, row, NULL}, other = {W, KVT_GGML_Q6_K, DO, DI, row, NULL};
        CHECK(kvt_q_pack_bytes(&odd) == 0 && kvt_q_pack_bytes(&other) == 0);
        size_t pb = kvt_q_pack_bytes(&m);
        CHECK(pb > 0);
        uint8_t *pk = malloc(pb);
        CHECK(pk != NULL);
        kvt_q_pack(&m, pk);
        bool old = kvt_kernels_force_scalar(true);
        kvt_matmul_w(NULL, y1, &m, x, NB, qx);
        kvt_kernels_force_scalar(old);
        m.pk = pk;
        kvt_pool *p = kvt_pool_new(3);
        CHECK(p != NULL);
        for (int avx2 = 0; avx2 < 1 + wide; avx2++) {
            bool o2 = kvt_kernels_force_avx2(avx2);
            kvt_matmul_w(NULL, y2, &m, x, NB, qx);
            CHECKF(!memcmp(y1, y2, sizeof(float) * NB * DO), "%s: packed (%s) differs from scalar",
                   kvt_quant_name(type), avx2 ? "AVX2" : "widest");
            for (int i = 0; i < NB; i++) kvt_matmul_w(NULL, y2 + i * DO, &m, x + i * DI, 1, qx);
            CHECKF(!memcmp(y1, y2, sizeof(float) * NB * DO), "%s: packed one token at a time differs",
                   kvt_quant_name(type));
            kvt_matmul_w(p, y2, &m, x, NB, qx);
            CHECKF(!memcmp(y1, y2, sizeof(float) * NB * DO), "%s: packed on 3 threads differs", kvt_quant_name(type));
            kvt_kernels_force_avx2(o2);
        }
        /* the control: row 5's first scale (group 1, row 1 of it), 32 more
         * or less; a token whose sub-block sums to 0 there keeps its output */
        pk[pb / (DO / 4) + (type == KVT_GGML_Q5_K ? 640 : 512) + 1] ^= 32;
        kvt_matmul_w(NULL, y2, &m, x, NB, qx);
        size_t row5 = 0, others = 0;
        for (int i = 0; i < NB; i++)
            for (int o = 0; o < DO; o++)
                if (y1[i * DO + o] != y2[i * DO + o]) ++*(o == 5 ? &row5 : &others);
        CHECKF(others == 0 && row5 >= NB - 2, "%s: a changed packed scale changes %zu of row 5's %d outputs and %zu others",
               kvt_quant_name(type), row5, NB, others);
        kvt_pool_free(p);
        free(W), free(qx), free(x), free(y1), free(y2), free(pk);
    }
}

/* The SIMD packer of four Q4_K or Q5_K rows (what a prefill chunk packs on
 * the stack for a matrix without a packed copy, and kvt_q_pack at load)
 * writes the bytes of the scalar p4_pack: kvt_q_pack's output compared
 * byte for byte, widest path and AVX2 against the scalar path's, over rows
 * of random bytes (every bit of the 6-bit scales and mins), and matmuls of
 * 4 to 13 tokens (the stack's packing) bit-equal to the scalar path's. The
 * control: KVT_QUANT_FAULT_PACK (two rows' first 8 bytes swapped per
 * superblock in the SIMD packer) is seen by both comparisons. */
TEST(kernels_kquant_pack_bytes)
{
    const uint32_t types[] = {KVT_GGML_Q4_K, KVT_GGML_Q5_K};
    enum { DI = 1280, DO = 12, NB = 13 };
    uint64_t st = kvt_test_seed("kernels_kquant_pack_bytes");
    bool wide = kvt_test_kernel_paths(), simd = kvt_kernels_simd();
    if (!simd) {
        kvt_test_skip_env("no SIMD kernels here: the packer compared is the scalar one");
        return;
    }
    for (size_t k = 0; k < 2; k++) {
        uint32_t type = types[k];
        size_t row = kvt_quant_row_bytes(type, DI);
        uint8_t *W = malloc(row * DO), *qx = malloc(kvt_q_act_bytes(type, NB, DI));
        float *x = malloc(sizeof(float) * NB * DI), *y1 = malloc(sizeof(float) * NB * DO),
              *y2 = malloc(sizeof(float) * NB * DO);
        CHECK(W && qx && x && y1 && y2);
        rand_blocks(type, W, DO, DI, &st);
        for (int i = 0; i < NB * DI; i++) x[i] = frand(&st) * (i % 97 == 0 ? 8.0f : 1.0f);
        kvt_wmat m = {W, type, DO, DI, row, NULL};
        size_t pb = kvt_q_pack_bytes(&m);
        uint8_t *ref = malloc(pb), *pk = malloc(pb);
        CHECK(pb > 0 && ref && pk);
        bool old = kvt_kernels_force_scalar(true);
        kvt_q_pack(&m, ref);
        kvt_matmul_w(NULL, y1, &m, x, NB, qx);
        kvt_kernels_force_scalar(old);
        for (int run = 0; run < 2 + wide; run++) {
            /* 0 widest, 1 AVX2 (when it is not the widest), last: the control */
            bool fault = run == 1 + wide;
            bool o2 = kvt_kernels_force_avx2(run == 1 && wide);
            kvt_q_fault = fault ? KVT_QUANT_FAULT_PACK : 0;
            memset(pk, 0, pb);
            kvt_q_pack(&m, pk);
            bool same = !memcmp(pk, ref, pb);
            size_t n_diff = 0;
            for (size_t n = 4; n <= NB; n++) {
                kvt_matmul_w(NULL, y2, &m, x, n, qx);
                n_diff += memcmp(y1, y2, sizeof(float) * n * DO) != 0;
            }
            kvt_q_fault = 0;
            kvt_kernels_force_avx2(o2);
            if (fault) {
                printf("    %s control: packed bytes %s, %zu of %d matmuls differ\n", kvt_quant_name(type),
                       same ? "SAME" : "differ", n_diff, NB - 3);
                CHECKF(!same && n_diff == NB - 3, "%s: the packer's fault is not seen (bytes same %d, %zu matmuls differ)",
                       kvt_quant_name(type), same, n_diff);
                continue;
            }
            CHECKF(same, "%s, %s: the SIMD packer's bytes differ from p4_pack's", kvt_quant_name(type),
                   run ? "AVX2" : "widest");
            CHECKF(n_diff == 0, "%s, %s: %zu of %d matmuls of 4 to %d tokens differ from the scalar bits",
                   kvt_quant_name(type), run ? "AVX2" : "widest", n_diff, NB - 3, NB);
        }
        free(W), free(qx), free(x), free(y1), free(y2), free(ref), free(pk);
    }
}

/* The four-row prefill kernels add maddubs pairs in int16 before their
 * madd: Q4_K/Q5_K four of them (at most 8 * 31 * 127 = 31496 in magnitude),
 * Q6_K two (4 * 63 * 127 = 32004). Every weight at its largest (scales, mins
 * and values all ones, Q5_K's high bits set; Q6_K's scales 127) against
 * activations all at +127 and all at -127 reaches that bound;
 * the SIMD paths (AVX-512 and AVX2) must still equal the scalar one, which
 * sums in int32. */
TEST(kernels_kquant_int16_extremes)
{
    const uint32_t types[] = {KVT_GGML_Q4_K, KVT_GGML_Q5_K, KVT_GGML_Q6_K};
    enum { DI = 768, DO = 9, NB = 13 };
    bool wide = kvt_test_kernel_paths();
    for (size_t k = 0; k < 3; k++)
        for (int sign = -1; sign <= 1; sign += 2) {
            uint32_t type = types[k];
            size_t row = kvt_quant_row_bytes(type, DI), bytes = row / (DI / 256);
            uint8_t *W = malloc(row * DO), *qx = malloc(kvt_q_act_bytes(type, NB, DI));
            float *x = malloc(sizeof(float) * NB * DI), *y[3];
            for (int i = 0; i < 3; i++) y[i] = malloc(sizeof(float) * NB * DO);
            CHECK(W && qx && x && y[0] && y[1] && y[2]);
            memset(W, 0xff, row * DO);
            for (size_t b = 0; b < DO * DI / 256; b++) {
                uint8_t *blk = W + b * bytes;
                if (type == KVT_GGML_Q6_K) {
                    memset(blk + 192, 0x7f, 16);      /* scales 127 */
                    blk[208] = 0x00, blk[209] = 0x14; /* d = 2^-10 */
                } else {
                    blk[0] = 0x00, blk[1] = 0x14; /* d = 2^-10 */
                    blk[2] = 0x00, blk[3] = 0x10; /* dmin = 2^-11 */
                }
            }
            for (int i = 0; i < NB * DI; i++) x[i] = (float)sign;
            kvt_wmat m = {W, type, DO, DI, row};
            kvt_matmul_w(NULL, y[0], &m, x, NB, qx);
            bool old = kvt_kernels_force_avx2(true);
            if (wide) kvt_matmul_w(NULL, y[1], &m, x, NB, qx);
            else memcpy(y[1], y[0], sizeof(float) * NB * DO);
            kvt_kernels_force_avx2(old);
            old = kvt_kernels_force_scalar(true);
            kvt_matmul_w(NULL, y[2], &m, x, NB, qx);
            kvt_kernels_force_scalar(old);
            CHECKF(!memcmp(y[0], y[2], sizeof(float) * NB * DO) && !memcmp(y[1], y[2], sizeof(float) * NB * DO),
                   "%s, activations %+d: SIMD %g / AVX2 %g, scalar %g", kvt_quant_name(type), sign * 127,
                   y[0][0], y[1][0], y[2][0]);
            free(W); free(qx); free(x);
            for (int i = 0; i < 3; i++) free(y[i]);
        }
}

/* The tokens' activations (Q8_0 blocks of 32 and Q8_K superblocks of 256)
 * are the same bytes from the AVX2 and the scalar quantisers, on rows that
 * hold what a model can make: values on rounding ties, the largest
 * magnitude twice with both signs, zeros, -0, subnormals, infinities and
 * NaN. */
TEST(kernels_activation_quantisers)
{
    enum { DI = 768, NB = 24 };
    const uint32_t types[] = {KVT_GGML_Q8_0, KVT_GGML_Q4_K};
    uint64_t st = kvt_test_seed("kernels_activation_quantisers");
    float *x = malloc(sizeof(float) * NB * DI), *y = malloc(sizeof(float) * NB * 4);
    CHECK(x && y);
    for (int t = 0; t < NB; t++)
        for (int i = 0; i < DI; i++) {
            float *v = x + t * DI + i, r = frand(&st);
            switch (t % 8) {
            case 0: *v = r; break;
            case 1: *v = (float)((int)(r * 8)) * 0.5f + 0.25f; break;              /* ties after scaling */
            case 2: *v = i % 37 == 5 ? 3.0f : i % 37 == 9 ? -3.0f : r; break;      /* +-max, first wins */
            case 3: *v = i % 2 ? -0.0f : 0.0f; break;                              /* an all-zero row */
            case 4: *v = r * 1e-40f; break;                                        /* subnormals */
            case 5: *v = i == 100 ? INFINITY : i == 300 ? -INFINITY : r; break;
            case 6: *v = i % 50 == 7 ? NAN : r; break;
            default: *v = i % 3 ? r : (float)(i % 256) - 127.5f; break;
            }
        }
    for (size_t k = 0; k < 2; k++) {
        size_t row = kvt_quant_row_bytes(types[k], DI), bytes = kvt_q_act_bytes(types[k], NB, DI);
        uint8_t *W = calloc(4, row), *q1 = malloc(bytes), *q2 = malloc(bytes);
        CHECK(W && q1 && q2);
        kvt_wmat m = {W, types[k], 4, DI, row};
        kvt_q_matmul(NULL, y, &m, x, NB, q1);
        bool old = kvt_kernels_force_scalar(true);
        kvt_q_matmul(NULL, y, &m, x, NB, q2);
        kvt_kernels_force_scalar(old);
        size_t bad = 0;
        for (size_t i = 0; i < bytes; i++) bad += q1[i] != q2[i];
        CHECKF(bad == 0, "%s activations: %zu of %zu bytes differ", kvt_quant_name(types[k]), bad, bytes);
        free(W); free(q1); free(q2);
    }
    free(x); free(y);
}

/* The instruction set is chosen once, with no data race when the first
 * kernel calls come from several threads at the same moment (a pool's
 * workers in a process that has not run a kernel yet). Run alone in a fresh
 * process under ThreadSanitizer to see a race (the earlier lazy, plain
 * state was one: two threads wrote it):
 *   make SAN=-fsanitize=thread BUILD=build-tsan test T=kernels_isa_first_use
 * In the suite (kernels already chosen) it checks that every thread sees
 * the same choice and the same bits. */
#define ISA_THREADS 4
struct isa_probe {
    pthread_barrier_t *go;
    const float *a, *b;
    bool simd, wide;
    float dot, sw[64];
};

static void *isa_first_use(void *arg)
{
    struct isa_probe *p = arg;
    pthread_barrier_wait(p->go);
    p->dot = kvt_dot(p->a, p->b, 100);
    for (int i = 0; i < 64; i++) p->sw[i] = p->a[i];
    kvt_swiglu(p->sw, p->b, 64);
    p->simd = kvt_kernels_simd();
    p->wide = kvt_kernels_avx512();
    return NULL;
}

TEST(kernels_isa_first_use_threads)
{
    uint64_t st = kvt_test_seed("kernels_isa_first_use_threads");
    float a[100], b[100];
    for (int i = 0; i < 100; i++) a[i] = frand(&st), b[i] = frand(&st);
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, ISA_THREADS);
    struct isa_probe p[ISA_THREADS];
    pthread_t th[ISA_THREADS];
    for (int i = 0; i < ISA_THREADS; i++) {
        p[i] = (struct isa_probe){.go = &go, .a = a, .b = b};
        CHECK(pthread_create(&th[i], NULL, isa_first_use, &p[i]) == 0);
    }
    for (int i = 0; i < ISA_THREADS; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&go);
    bool simd = kvt_kernels_simd(), wide = kvt_kernels_avx512();
    printf("    chosen: %s\n", wide ? "AVX-512" : simd ? "AVX2" : "scalar");
    for (int i = 0; i < ISA_THREADS; i++) {
        CHECKF(p[i].simd == simd && p[i].wide == wide, "thread %d saw another choice (simd %d avx512 %d vs %d %d)", i,
               p[i].simd, p[i].wide, simd, wide);
        CHECKF(!memcmp(&p[i].dot, &p[0].dot, 4) && !memcmp(p[i].sw, p[0].sw, sizeof p[0].sw),
               "thread %d's results differ from thread 0's", i);
    }
    float d = kvt_dot(a, b, 100);
    CHECK(!memcmp(&d, &p[0].dot, 4));
}
