/* Worker pool: threads wait on a generation counter; kvt_pool_for publishes a
 * job, runs range 0 itself and waits for the others. One job at a time per
 * pool (a session owns its pool). */
#include "threads.h"
#include "util.h"

#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

struct kvt_pool {
    uint32_t n;
    pthread_t *tid;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t gen;
    uint32_t pending;
    int quit;
    /* current job */
    kvt_range_fn fn;
    kvt_part_fn part_fn; /* instead of fn, when set */
    void *ctx;
    size_t total;
    uint32_t parts;
    uint32_t last_parts; /* parts of the latest kvt_pool_for, 1 when it ran unsplit */
};

uint32_t kvt_ncpu(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (uint32_t)n : 1;
}

static void run_part(kvt_pool *p, uint32_t k)
{
    if (k >= p->parts) return;
    size_t b = p->total * k / p->parts, e = p->total * (k + 1) / p->parts;
    if (b >= e) return;
    if (p->part_fn) p->part_fn(p->ctx, k, b, e);
    else p->fn(p->ctx, b, e);
}

struct worker_arg { kvt_pool *p; uint32_t k; };

static void *worker(void *arg)
{
    struct worker_arg *wa = arg;
    kvt_pool *p = wa->p;
    uint32_t k = wa->k;
    free(wa);
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->gen == seen && !p->quit) pthread_cond_wait(&p->go, &p->mu);
        if (p->quit) break;
        seen = p->gen;
        pthread_mutex_unlock(&p->mu);
        run_part(p, k);
        pthread_mutex_lock(&p->mu);
        if (--p->pending == 0) pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

kvt_pool *kvt_pool_new(uint32_t n)
{
    if (n == 0) n = kvt_ncpu();
    if (n > 256) n = 256;
    kvt_pool *p = kvt_calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n = n;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    p->tid = kvt_calloc(n, sizeof *p->tid);
    if (!p->tid) { kvt_pool_free(p); return NULL; }
    for (uint32_t k = 1; k < n; k++) {
        struct worker_arg *wa = malloc(sizeof *wa);
        if (!wa) { p->n = k; kvt_pool_free(p); return NULL; }
        *wa = (struct worker_arg){p, k};
        if (pthread_create(&p->tid[k], NULL, worker, wa) != 0) {
            free(wa);
            p->n = k;
            kvt_pool_free(p);
            kvt_fail(KVT_ENOMEM, "cannot start worker thread %u", k);
            return NULL;
        }
    }
    return p;
}

void kvt_pool_free(kvt_pool *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->quit = 1;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (uint32_t k = 1; k < p->n; k++) pthread_join(p->tid[k], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done);
    free(p->tid);
    free(p);
}

uint32_t kvt_pool_size(const kvt_pool *p) { return p ? p->n : 1; }
uint32_t kvt_pool_last_parts(const kvt_pool *p) { return p ? p->last_parts : 1; }

static void pool_run(kvt_pool *p, size_t n, size_t min_per_thread, kvt_range_fn fn, kvt_part_fn part_fn, void *ctx)
{
    if (n == 0) return;
    uint32_t parts = p ? p->n : 1;
    if (min_per_thread < 1) min_per_thread = 1;
    if (n / min_per_thread < parts) parts = (uint32_t)(n / min_per_thread);
    if (p) p->last_parts = parts > 1 ? parts : 1;
    if (parts <= 1) {
        if (part_fn) part_fn(ctx, 0, 0, n);
        else fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->part_fn = part_fn;
    p->ctx = ctx;
    p->total = n;
    p->parts = parts;
    p->pending = p->n - 1;
    p->gen++;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    run_part(p, 0);
    pthread_mutex_lock(&p->mu);
    while (p->pending) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

void kvt_pool_for(kvt_pool *p, size_t n, size_t min_per_thread, kvt_range_fn fn, void *ctx)
{
    pool_run(p, n, min_per_thread, fn, NULL, ctx);
}

void kvt_pool_for_part(kvt_pool *p, size_t n, size_t min_per_thread, kvt_part_fn fn, void *ctx)
{
    pool_run(p, n, min_per_thread, NULL, fn, ctx);
}
