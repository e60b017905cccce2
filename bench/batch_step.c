/* The batched decode step alone, without the server around it:
 *
 *   batch_step MODEL [THREADS [STEPS [COUNTS]]]   (defaults 2, 64, "1,2,3,4,5,6,7,8")
 *   batch_step --mm MODEL [THREADS [REPS]]
 *
 * For each count k, k sessions on one pool of THREADS threads (as the
 * server's, kvt_session_new_on) each prefill a 32-token prompt of their
 * own, then STEPS steps of kvt_session_step advance all k by one greedy
 * token each: one line per k with the step's time (median and best),
 * tokens/s, and for a llama-family model the weights' bytes read per step
 * over the best step's time (the model's matrices once a step, as the step
 * must read them). Then, for k > 1, the same k sessions stepped one after
 * another (a kvt_session_step of each in turn: what a model without a
 * batched pass does), the same line with "seq", and the ratio. Any model
 * kvt_model_open takes (a GGUF, a ds4 preset).
 *
 * --mm (llama-family models) times kvt_matmul_w alone on each distinct
 * matrix shape of the model's first layer and its output matrix, for 1 to
 * 8 tokens: the best of REPS (default 50) calls, its GB/s of weights and
 * its GFLOP/s.
 *
 * Built by hand against the library (it uses src/ headers):
 *   cc -O2 -std=c11 -D_GNU_SOURCE -Iinclude -Isrc -o /tmp/batch_step bench/batch_step.c \
 *      build/libkvtier.a $(sed -n 's/^PKG_LIBS := //p' build/config.mk) -lpthread -lm
 * Numbers only: timing never goes in the tests. */
#include "kvtier.h"
#include "arch/model.h"
#include "arch/llama_weights.h"
#include "base/threads.h"
#include "kernels/kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* CPUT=1 in the environment: the process's CPU time instead of the wall
 * clock (one thread on a crowded machine: the time it ran, not the time it
 * waited for a core). */
static clockid_t clk = CLOCK_MONOTONIC;

static double now(void)
{
    struct timespec ts;
    clock_gettime(clk, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmpd(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int32_t argmax(const float *l, size_t n)
{
    size_t b = 0;
    for (size_t i = 1; i < n; i++) b = l[i] > l[b] ? i : b;
    return (int32_t)b;
}

/* k sessions' steps, together (one kvt_session_step) or one after another
 * (seq); *tps: the median step's tokens/s. */
static int steps_run(kvt_model *m, kvt_pool *pool, size_t k, size_t steps, double wbytes, bool seq, double *tps)
{
    kvt_session *s[8] = {0};
    kvt_step st[8];
    int32_t tok[8];
    double *t = calloc(steps, sizeof *t);
    int rc = t ? KVT_OK : KVT_ENOMEM;
    kvt_model_info info;
    kvt_model_info_get(m, &info);
    uint32_t V = info.n_vocab;
    for (size_t i = 0; i < k && !rc; i++) {
        kvt_session_opts o = {.n_ctx = 1024};
        int32_t p[32];
        for (size_t j = 0; j < 32; j++) p[j] = (int32_t)(1 + (i * 977 + j * 131) % (V - 1));
        rc = kvt_session_new_on(&s[i], m, &o, pool);
        if (!rc) rc = kvt_session_sync(s[i], p, 32, NULL);
    }
    for (size_t n = 0; n < steps && !rc; n++) {
        for (size_t i = 0; i < k; i++) {
            tok[i] = argmax(kvt_session_logits(s[i]), V);
            st[i] = (kvt_step){.s = s[i], .tok = &tok[i], .n = 1};
        }
        double t0 = now();
        if (seq)
            for (size_t i = 0; i < k && !rc; i++) rc = kvt_session_step(&st[i], 1, 0);
        else
            rc = kvt_session_step(st, k, 0);
        t[n] = now() - t0;
    }
    if (!rc) {
        qsort(t, steps, sizeof *t, cmpd);
        double med = t[steps / 2], best = t[0];
        *tps = k / med;
        printf("k %zu%s  step ms median %7.2f best %7.2f  tok/s %7.1f (best %7.1f)", k, seq ? " seq" : "", med * 1e3,
               best * 1e3, k / med, k / best);
        if (wbytes > 0) printf("  weights GB/s (best) %6.1f", wbytes / best * 1e-9);
        printf("\n");
    }
    for (size_t i = 0; i < k; i++) kvt_session_free(s[i]);
    free(t);
    return rc;
}

/* The bytes of every matrix a decode step reads: all but the token embedding. */
static double weight_bytes(const kvt_llama_weights *w)
{
    double b = 0;
    for (size_t l = 0; l < w->L; l++) {
        const kvt_llama_layer *ly = &w->layers[l];
        const kvt_wmat *ms[] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo, &ly->w1, &ly->w2, &ly->w3};
        for (size_t i = 0; i < sizeof ms / sizeof *ms; i++) b += (double)ms[i]->rows * ms[i]->row_bytes;
    }
    return b + (double)w->out.rows * w->out.row_bytes;
}

static void mm_run(kvt_pool *pool, const kvt_wmat *W, const char *name, size_t reps)
{
    float *x = malloc(8 * W->cols * sizeof *x), *y = malloc(8 * W->rows * sizeof *y);
    for (size_t i = 0; i < 8 * W->cols; i++) x[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
    for (size_t n = 1; n <= 8; n++) {
        double best = 1e9;
        for (size_t r = 0; r < reps; r++) {
            double t0 = now();
            kvt_matmul_w(pool, y, W, x, n, NULL);
            double d = now() - t0;
            best = d < best ? d : best;
        }
        double bytes = (double)W->rows * W->row_bytes;
        printf("%-8s %5zu x %5zu  n %zu  us %8.1f  GB/s %6.1f  GFLOP/s %6.1f\n", name, W->rows, W->cols, n,
               best * 1e6, bytes / best * 1e-9, 2.0 * n * W->rows * W->cols / best * 1e-9);
    }
    free(x);
    free(y);
}

int main(int argc, char **argv)
{
    if (getenv("CPUT") && atoi(getenv("CPUT"))) clk = CLOCK_PROCESS_CPUTIME_ID;
    bool mm = argc > 1 && !strcmp(argv[1], "--mm");
    if (mm) argv++, argc--;
    if (argc < 2) {
        fputs("usage: batch_step [--mm] MODEL [THREADS [STEPS|REPS [COUNTS]]]\n", stderr);
        return 2;
    }
    uint32_t threads = argc > 2 ? (uint32_t)atoi(argv[2]) : 2;
    size_t steps = argc > 3 ? (size_t)atoi(argv[3]) : mm ? 50 : 64;
    const char *counts = argc > 4 ? argv[4] : "1,2,3,4,5,6,7,8";
    kvt_model *m = NULL;
    int rc = kvt_model_open(&m, argv[1]);
    if (rc) {
        fprintf(stderr, "batch_step: %s: %s\n", argv[1], kvt_strerror(rc));
        return 1;
    }
    kvt_pool *pool = kvt_pool_new(threads);
    kvt_model_info info;
    kvt_model_info_get(m, &info);
    bool llama = strcmp(info.arch, "deepseek4") != 0;
    const kvt_llama_weights *w = llama ? m->weights : NULL;
    if (mm && !llama) {
        fputs("batch_step: --mm takes a llama-family model\n", stderr);
        rc = KVT_EINVAL;
    } else if (mm) {
        const kvt_llama_layer *ly = &w->layers[0];
        mm_run(pool, &ly->wq, "wq", steps);
        mm_run(pool, &ly->wk, "wk", steps);
        mm_run(pool, &ly->w1, "w1", steps);
        mm_run(pool, &ly->w2, "w2", steps);
        mm_run(pool, &w->out, "output", steps > 10 ? steps / 5 : steps);
    } else {
        double wb = w ? weight_bytes(w) : 0;
        if (w) printf("weights read a step: %.1f MB, %u threads\n", wb * 1e-6, threads);
        else printf("%s (%s), %u threads\n", info.name, info.arch, threads);
        for (const char *c = counts; *c && !rc;) {
            size_t k = (size_t)strtoul(c, (char **)&c, 10);
            double tb = 0, ts = 0;
            if (*c == ',') c++;
            if (k >= 1 && k <= 8) rc = steps_run(m, pool, k, steps, wb, false, &tb);
            if (!rc && k >= 2 && k <= 8 && !(rc = steps_run(m, pool, k, steps, wb, true, &ts)))
                printf("k %zu  together / one after another: %.2fx\n", k, tb / ts);
        }
        if (rc) fprintf(stderr, "batch_step: %s\n", kvt_strerror(rc));
    }
    kvt_pool_free(pool);
    kvt_model_close(m);
    return rc ? 1 : 0;
}
