/* Kernel contracts: the scalar and SIMD paths are bit-identical (dot
 * products of every length, binary16 conversions of every value), and a
 * matmul's bytes do not depend on the batch size or the thread count. */
#include "test.h"
#include "kernels.h"
#include "threads.h"
#include "util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static float frand(uint64_t *s) { return (float)((double)(kvt_test_rand(s) >> 11) / 9007199254740992.0 * 2 - 1); }

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
    bool threads_eq = true, split = true;
    for (uint32_t th = 2; th <= 4; th++) {
        kvt_pool *p = kvt_pool_new(th);
        if (!p) { split = false; break; }
        memset(y2, 0, sizeof(float) * NB * DO);
        kvt_matmul(p, y2, W, x, NB, DI, DO);
        uint32_t parts = kvt_pool_last_parts(p);
        kvt_pool_free(p);
        if (parts != th) { printf("    %u threads ran as %u parts\n", th, parts); split = false; }
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
