/* Worker pool: threads wait on a generation counter; kvt_pool_for publishes a
 * job, runs range 0 itself and waits for the others. The workers run one
 * job at a time.
 *
 * Waiting spins first, then sleeps: a forward pass publishes some hundred
 * jobs a few microseconds apart, and waking a thread that sleeps on a
 * condition variable costs tens of microseconds on a virtual machine (a
 * decode step of a 125M model paid milliseconds of it). A worker that
 * finds no new job within SPIN polls, and a caller whose workers are not
 * done within as many, sleep on the condition variables as before; a job
 * is announced on the condition variable only when a worker sleeps.
 *
 * A pool may be shared (the server's sessions run on one): its workers
 * take one job at a time, and a caller that finds them on another
 * thread's job runs its parts itself, one after another. Kernels give the
 * same bytes for any split, so only the time differs. */
#include "base/threads.h"
#include "base/util.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define SPIN 4096        /* polls, a yield of the CPU every 32 */
#define CROWDED_NS 250000 /* a yield that took longer: other threads want the core */
#define CALM_NS 200000000 /* then no spinning for this long */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

struct kvt_pool {
    uint32_t n;
    pthread_t *tid;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    _Atomic uint64_t gen;
    _Atomic uint32_t pending;
    _Atomic int quit;
    _Atomic int taken;   /* a caller's job holds the workers */
    uint32_t sleepers;   /* workers waiting on go (under mu) */
    /* Spinning pays only while the pool's threads have cores to themselves:
     * a spinning thread that another thread preempts has spent the credit
     * the scheduler gives a thread it wakes, and waits behind the other for
     * a whole time slice. A yield that comes back late shows it; then the
     * pool sleeps at once for CALM_NS. */
    _Atomic int64_t no_spin_until;
    bool caller_sleeps;  /* the caller waits on done (under mu) */
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

/* One poll of a spin (i: its index): false when the pool must not spin. */
static bool spin_poll(kvt_pool *p, int i)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if (i % 32 != 31) return true;
    int64_t t = now_ns();
    if (t < atomic_load(&p->no_spin_until)) return false;
    sched_yield();
    int64_t u = now_ns();
    if (u - t > CROWDED_NS) {
        atomic_store(&p->no_spin_until, u + CALM_NS);
        return false;
    }
    return true;
}

struct worker_arg { kvt_pool *p; uint32_t k; };

static void *worker(void *arg)
{
    struct worker_arg *wa = arg;
    kvt_pool *p = wa->p;
    uint32_t k = wa->k;
    free(wa);
    uint64_t seen = 0;
    for (;;) {
        for (int i = 0; i < SPIN && atomic_load(&p->gen) == seen && !atomic_load(&p->quit) && spin_poll(p, i); i++) {}
        if (atomic_load(&p->gen) == seen && !atomic_load(&p->quit)) {
            pthread_mutex_lock(&p->mu);
            p->sleepers++;
            while (atomic_load(&p->gen) == seen && !atomic_load(&p->quit)) pthread_cond_wait(&p->go, &p->mu);
            p->sleepers--;
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->quit)) break;
        seen = atomic_load(&p->gen);
        run_part(p, k);
        if (atomic_fetch_sub(&p->pending, 1) == 1) { /* the last: the caller may sleep */
            pthread_mutex_lock(&p->mu);
            if (p->caller_sleeps) pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
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
    if (!p->tid) { p->n = 1; kvt_pool_free(p); return NULL; } /* no worker to join */
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
    atomic_store(&p->quit, 1);
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

static uint32_t pool_run(kvt_pool *p, size_t n, size_t min_per_thread, kvt_range_fn fn, kvt_part_fn part_fn,
                         void *ctx)
{
    if (n == 0) return 1;
    uint32_t parts = p ? p->n : 1;
    if (min_per_thread < 1) min_per_thread = 1;
    if (n / min_per_thread < parts) parts = (uint32_t)(n / min_per_thread);
    if (parts <= 1) {
        if (p) p->last_parts = 1;
        if (part_fn) part_fn(ctx, 0, 0, n);
        else fn(ctx, 0, n);
        return 1;
    }
    if (atomic_exchange(&p->taken, 1)) {
        /* the workers run another thread's job: the same parts, here */
        for (uint32_t k = 0; k < parts; k++) {
            size_t b = n * k / parts, e = n * (k + 1) / parts;
            if (b >= e) continue;
            if (part_fn) part_fn(ctx, k, b, e);
            else fn(ctx, b, e);
        }
        return parts;
    }
    p->last_parts = parts;
    /* the job's fields, then the generation that publishes them (the
     * atomic store orders them before it for a worker that sees it) */
    p->fn = fn;
    p->part_fn = part_fn;
    p->ctx = ctx;
    p->total = n;
    p->parts = parts;
    atomic_store(&p->pending, p->n - 1);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->gen, 1);
    if (p->sleepers) pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    run_part(p, 0);
    for (int i = 0; i < SPIN && atomic_load(&p->pending) && spin_poll(p, i); i++) {}
    if (atomic_load(&p->pending)) {
        pthread_mutex_lock(&p->mu);
        p->caller_sleeps = true;
        while (atomic_load(&p->pending)) pthread_cond_wait(&p->done, &p->mu);
        p->caller_sleeps = false;
        pthread_mutex_unlock(&p->mu);
    }
    atomic_store(&p->taken, 0);
    return parts;
}

uint32_t kvt_pool_for(kvt_pool *p, size_t n, size_t min_per_thread, kvt_range_fn fn, void *ctx)
{
    return pool_run(p, n, min_per_thread, fn, NULL, ctx);
}

uint32_t kvt_pool_for_part(kvt_pool *p, size_t n, size_t min_per_thread, kvt_part_fn fn, void *ctx)
{
    return pool_run(p, n, min_per_thread, NULL, fn, ctx);
}
