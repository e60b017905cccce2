/* kvtier bench --suite fork: the cost of a copy of a session (a fork, a
 * second conversation on a shared prefix, the copy the server hands the
 * store thread to save), measured.
 *
 * A session of N tokens (default 20000) of --model, in its K and V row
 * types: its rows are filled without running the model (a copy's cost and
 * memory do not depend on what the rows hold), with the checkpoints a
 * prefill leaves (one every checkpoint interval, one at the end), so a
 * copy copies what it would after a real prefill. Then:
 *   1. kvt_session_clone into a fresh session, best and median of --reps
 *      (default 5) copies, each freed after it was timed;
 *   2. resident memory (the process's RSS, /proc/self/statm) and the RAM
 *      budget's count (the sum of kvt_session_bytes) with 1, 2, 4, 8 and 16
 *      copies alive at once.
 * The sessions run on one shared pool and make no scratch, as the server's
 * copies do (kvt_session_new_on). A copy is not made when a full copy of the
 *      rows would not fit in a quarter of MemAvailable (the figures of a build
 *      whose copies copy their rows stop there).
 * Nothing is asserted: the numbers are for reading (bench/README.md). */
#include "app/bench_fork.h"
#include "arch/model.h"
#include "base/threads.h"
#include "base/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define FORK_TOKENS 20000
#define MAX_COPIES 16

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double rss_mib(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long size = 0, res = 0;
    if (!f) return -1;
    if (fscanf(f, "%lu %lu", &size, &res) != 2) res = 0;
    fclose(f);
    return (double)res * (double)sysconf(_SC_PAGESIZE) / (1024.0 * 1024.0);
}

static double mem_available_mib(void)
{
    uint64_t kib = 0;
    return kvt_proc_kib("/proc/meminfo", "MemAvailable", &kib) ? (double)kib / 1024.0 : -1; /* unknown: below any need */
}

/* s holds tokens t[0..n): rows filled with a byte pattern, the checkpoints
 * a prefill leaves. */
static int fill(kvt_session *s, const int32_t *t, size_t n)
{
    kvt_cache *c = s->cache;
    for (size_t st = 0; st < c->n_streams; st++)
        for (size_t r = 0; r < kvt_cache_rows_for(c, st, n); r++) {
            void *row = kvt_cache_row(c, st, r);
            if (!row) return kvt_fail(KVT_ENOMEM, "rows of %zu tokens", n);
            memset(row, (int)(r * 31 + st) & 0xff, c->streams[st].row_bytes);
        }
    memcpy(s->tokens, t, n * sizeof *t);
    memset(s->logits, 0, (size_t)s->m->info.n_vocab * sizeof(float));
    for (size_t p = s->ckpt_interval; p < n; p += s->ckpt_interval) {
        s->n = p;
        kvt_session_checkpoint(s);
    }
    s->n = n;
    kvt_session_checkpoint(s);
    return KVT_OK;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int kvt_bench_fork(const char *model, kvt_row_type type_k, kvt_row_type type_v, size_t n_tokens, unsigned reps)
{
    size_t n = n_tokens ? n_tokens : FORK_TOKENS;
    if (!reps) reps = 5;
    kvt_model *m = NULL;
    kvt_pool *pool = kvt_pool_new(1);
    kvt_session *src = NULL, *copy[MAX_COPIES] = {0};
    int32_t *t = malloc(n * sizeof *t);
    double *secs = malloc(reps * sizeof *secs);
    int rc = t && secs && pool ? kvt_model_open(&m, model) : KVT_ENOMEM;
    if (!rc) rc = kvt_model_set_cache_types(m, type_k, type_v);
    kvt_session_opts so = {.n_ctx = (uint32_t)(n + KVT_BLOCK), .n_threads = 1};
    if (!rc) rc = kvt_session_new_on(&src, m, &so, pool);
    if (rc) goto out;
    for (size_t i = 0; i < n; i++) t[i] = (int32_t)(i % m->info.n_vocab);
    double r0 = rss_mib(), t0 = now();
    if ((rc = fill(src, t, n))) goto out;
    double rows = (double)kvt_cache_bytes_allocated(src->cache) / (1024.0 * 1024.0);
    printf("\nfork suite: %s, %zu tokens, K/V %s/%s: rows %.1f MiB, %zu checkpoints (filled in %.2f s)\n",
           model ? model : "the default model", n, kvt_row_type_name(type_k), kvt_row_type_name(type_v), rows,
           src->n_ckpt, now() - t0);
    /* 1. the time of a copy */
    for (unsigned r = 0; r < reps; r++) {
        kvt_session *d = NULL;
        if ((rc = kvt_session_new_on(&d, m, &so, pool))) goto out;
        double c0 = now();
        rc = kvt_session_clone(d, src);
        secs[r] = now() - c0;
        kvt_session_free(d);
        if (rc) goto out;
    }
    qsort(secs, reps, sizeof *secs, cmp_double);
    printf("%-44s %12.3f ms best, %.3f ms median of %u\n", "kvt_session_clone", secs[0] * 1e3, secs[reps / 2] * 1e3,
           reps);
    /* 2. resident memory with k copies alive */
    double base = rss_mib();
    printf("%-44s %12.1f MiB (%.1f MiB before the session)\n", "RSS, the session alone", base, r0);
    size_t k = 0;
    for (size_t want = 1; want <= MAX_COPIES; want *= 2) {
        while (k < want) {
            if (mem_available_mib() < 4 * rows) {
                printf("stopped before copy %zu: a full copy of the rows would not fit in a quarter of MemAvailable\n",
                       k + 1);
                goto out;
            }
            if ((rc = kvt_session_new_on(&copy[k], m, &so, pool)) || (rc = kvt_session_clone(copy[k], src))) goto out;
            k++;
        }
        double budget = (double)kvt_session_bytes(src);
        for (size_t i = 0; i < k; i++) budget += (double)kvt_session_bytes(copy[i]);
        double rss = rss_mib();
        printf("%-44s %12.1f MiB RSS: +%.1f MiB for the copies (%.2f MiB each); budget count %.1f MiB (%.2fx the rows)\n",
               k == 1 ? "the session and 1 copy" : want == 2 ? "the session and 2 copies" : want == 4 ? "the session and 4 copies"
               : want == 8 ? "the session and 8 copies" : "the session and 16 copies",
               rss, rss - base, (rss - base) / (double)k, budget / (1024.0 * 1024.0), budget / (1024.0 * 1024.0) / rows);
    }
out:
    if (rc) fprintf(stderr, "kvtier: bench fork: %s: %s\n", kvt_strerror(rc), kvt_errmsg());
    for (size_t i = 0; i < MAX_COPIES; i++) kvt_session_free(copy[i]);
    kvt_session_free(src);
    kvt_model_close(m);
    kvt_pool_free(pool);
    free(t);
    free(secs);
    return rc ? 1 : 0;
}
