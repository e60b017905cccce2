/* What this CPU can do at most, for bench/peers.sh to relate speeds to:
 *
 *   peak [MAX_THREADS]   (default 1)
 *
 * For each thread count 1..MAX_THREADS, one line each:
 *   fma T GFLOPS   independent AVX2 FMAs: 12 chains of 8-wide fmadd per thread
 *                  (enough to cover the FMA latency on two FMA ports), 2 FLOPs
 *                  a lane; the best of 5 runs of about 0.3 s
 *   fma512 T GFLOPS
 *                  the same with 16-wide AVX-512 fmadd (zmm), when the CPU has
 *                  AVX-512F and the OS saves its state; left out otherwise.
 *                  A CPU with full-width 512-bit FMA units (Zen 5, Intel's
 *                  server cores with two 512-bit ports) reads about twice
 *                  fma; one that splits them in two 256-bit halves (Zen 4)
 *                  about the same
 *   read T GBS     a sum of 64-bit integers over a 1 GiB buffer (each thread
 *                  its share), 256-bit loads; bytes read / wall time, the best
 *                  of 5 passes after one that faults the pages in
 * GFLOPS and GBS are 1e9 per second. Built by bench/peers.sh with
 * -O2 -mavx2 -mfma (the 512-bit loop has its own target attribute), not
 * by the Makefile. */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHAINS 12
#define RUNS 5
#define BUF_BYTES (1ull << 30)

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct work {
    long iters;                /* fma: loop trips */
    const __m256i *p;          /* read: the thread's share */
    size_t n;                  /* in 32-byte vectors */
    double sink;
} work;

static void *fma_loop(void *arg)
{
    work *w = arg;
    const __m256 m = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
    /* twelve named chains, not an array: an array may be kept in memory */
    __m256 a0 = _mm256_set1_ps(1), a1 = _mm256_set1_ps(2), a2 = _mm256_set1_ps(3), a3 = _mm256_set1_ps(4),
           a4 = _mm256_set1_ps(5), a5 = _mm256_set1_ps(6), a6 = _mm256_set1_ps(7), a7 = _mm256_set1_ps(8),
           a8 = _mm256_set1_ps(9), a9 = _mm256_set1_ps(10), a10 = _mm256_set1_ps(11), a11 = _mm256_set1_ps(12);
    for (long i = 0; i < w->iters; i++) {
        a0 = _mm256_fmadd_ps(a0, m, c); a1 = _mm256_fmadd_ps(a1, m, c); a2 = _mm256_fmadd_ps(a2, m, c);
        a3 = _mm256_fmadd_ps(a3, m, c); a4 = _mm256_fmadd_ps(a4, m, c); a5 = _mm256_fmadd_ps(a5, m, c);
        a6 = _mm256_fmadd_ps(a6, m, c); a7 = _mm256_fmadd_ps(a7, m, c); a8 = _mm256_fmadd_ps(a8, m, c);
        a9 = _mm256_fmadd_ps(a9, m, c); a10 = _mm256_fmadd_ps(a10, m, c); a11 = _mm256_fmadd_ps(a11, m, c);
    }
    float out[8];
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    _mm256_storeu_ps(out, s);
    w->sink = out[0];
    return NULL;
}

/* fma_loop in 512-bit registers: twelve chains of 16-wide fmadd. */
__attribute__((target("avx512f"))) static void *fma512_loop(void *arg)
{
    work *w = arg;
    const __m512 m = _mm512_set1_ps(0.9999999f), c = _mm512_set1_ps(1e-7f);
    __m512 a0 = _mm512_set1_ps(1), a1 = _mm512_set1_ps(2), a2 = _mm512_set1_ps(3), a3 = _mm512_set1_ps(4),
           a4 = _mm512_set1_ps(5), a5 = _mm512_set1_ps(6), a6 = _mm512_set1_ps(7), a7 = _mm512_set1_ps(8),
           a8 = _mm512_set1_ps(9), a9 = _mm512_set1_ps(10), a10 = _mm512_set1_ps(11), a11 = _mm512_set1_ps(12);
    for (long i = 0; i < w->iters; i++) {
        a0 = _mm512_fmadd_ps(a0, m, c); a1 = _mm512_fmadd_ps(a1, m, c); a2 = _mm512_fmadd_ps(a2, m, c);
        a3 = _mm512_fmadd_ps(a3, m, c); a4 = _mm512_fmadd_ps(a4, m, c); a5 = _mm512_fmadd_ps(a5, m, c);
        a6 = _mm512_fmadd_ps(a6, m, c); a7 = _mm512_fmadd_ps(a7, m, c); a8 = _mm512_fmadd_ps(a8, m, c);
        a9 = _mm512_fmadd_ps(a9, m, c); a10 = _mm512_fmadd_ps(a10, m, c); a11 = _mm512_fmadd_ps(a11, m, c);
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                             _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    w->sink = _mm512_reduce_add_ps(s);
    return NULL;
}

/* AVX-512F from cpuid, with the OS saving the opmask and zmm state (XCR0
 * bits 1, 2, 5, 6, 7). */
static int have_avx512(void)
{
    unsigned a, b, c, d, lo, hi;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (!(c >> 27 & 1)) return 0; /* OSXSAVE */
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0xe6) != 0xe6) return 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    return b >> 16 & 1;
}

static void *read_loop(void *arg)
{
    work *w = arg;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 4 <= w->n; i += 4) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256(w->p + i));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256(w->p + i + 1));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256(w->p + i + 2));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256(w->p + i + 3));
    }
    int64_t out[4];
    _mm256_storeu_si256((__m256i *)out, _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
    w->sink = (double)(out[0] + out[1] + out[2] + out[3]);
    return NULL;
}

/* Wall time of fn on n threads, one work each. */
static double run(void *(*fn)(void *), work *w, int n)
{
    pthread_t th[64];
    double t0 = now();
    for (int i = 1; i < n; i++)
        if (pthread_create(&th[i], NULL, fn, &w[i])) { perror("pthread_create"); exit(1); }
    fn(&w[0]);
    for (int i = 1; i < n; i++) pthread_join(th[i], NULL);
    return now() - t0;
}

int main(int argc, char **argv)
{
    int max = argc > 1 ? atoi(argv[1]) : 1;
    if (max < 1 || max > 64) { fprintf(stderr, "usage: peak [MAX_THREADS (1..64)]\n"); return 2; }
    work w[64];
    /* calibrate: trips for about 0.3 s on one thread */
    memset(w, 0, sizeof w);
    w[0].iters = 1 << 22;
    double t = run(fma_loop, w, 1);
    long iters = (long)(w[0].iters * (0.3 / (t > 1e-6 ? t : 1e-6)));
    if (iters < 1) iters = 1;
    int wide = have_avx512();
    for (int n = 1; n <= max; n++)
        for (int z = 0; z <= wide; z++) { /* 256-bit, then 512-bit (half the trips: the same time at twice the rate) */
            long it = z ? iters / 2 : iters;
            double best = 1e30;
            for (int r = 0; r < RUNS; r++) {
                for (int i = 0; i < n; i++) w[i].iters = it;
                double dt = run(z ? fma512_loop : fma_loop, w, n);
                if (dt < best) best = dt;
            }
            printf("%s %d %.2f\n", z ? "fma512" : "fma", n, (double)it * CHAINS * (z ? 16 : 8) * 2 * n / best / 1e9);
            fflush(stdout);
        }
    __m256i *buf = aligned_alloc(64, BUF_BYTES);
    if (!buf) { fprintf(stderr, "peak: cannot allocate 1 GiB\n"); return 1; }
    memset(buf, 0x5a, BUF_BYTES);
    size_t nv = BUF_BYTES / sizeof(__m256i);
    for (int n = 1; n <= max; n++) {
        size_t share = nv / n / 4 * 4;
        for (int i = 0; i < n; i++) { w[i].p = buf + i * share; w[i].n = share; }
        run(read_loop, w, n);
        double best = 1e30;
        for (int r = 0; r < RUNS; r++) {
            double dt = run(read_loop, w, n);
            if (dt < best) best = dt;
        }
        printf("read %d %.2f\n", n, (double)share * n * sizeof(__m256i) / best / 1e9);
        fflush(stdout);
    }
    free(buf);
    return 0;
}
