/* Worker pool: kvt_pool_for cuts [0, n) into ranges, several a thread, and
 * publishes the job; the caller and the workers claim ranges one at a time
 * until none is left, and the caller waits only for ranges that a thread
 * has claimed and not finished. The workers run one job at a time.
 *
 * Why several ranges a thread: other threads of the process (a save's
 * encoding and writes, the HTTP threads) and of the machine take a core
 * now and then. With one range a thread, the range whose thread lost its
 * core waited a time slice and the whole step took twice as long; now the
 * threads that have a core take the ranges that thread would have run,
 * and a worker that wakes late finds the job claimed and runs nothing.
 * Only a thread preempted in the middle of a range still holds the step.
 *
 * The claim word holds the job's generation, its count of ranges and the
 * next range to claim, so a worker that read it for one job cannot claim
 * a range of the next (its compare-and-swap fails); the job's fields are
 * written before the word that publishes them and read after the claim.
 *
 * Waiting spins first, then sleeps: a forward pass publishes some hundred
 * jobs a few microseconds apart, and waking a thread that sleeps on a
 * condition variable costs tens of microseconds on a virtual machine (a
 * decode step of a 125M model paid milliseconds of it). A worker that
 * finds no new job within SPIN polls, and a caller whose ranges are not
 * done within as many, sleep on the condition variables as before; a job
 * is announced on the condition variable only when a worker sleeps.
 * A yield that comes back late says another thread took the core; the
 * pool stops spinning for a while (CALM_NS) only when such yields lose
 * more than a quarter of the time in a window of 20 ms (a crowded
 * machine's time slices, a few ms each, get there in two). One alone is a
 * thread that ran a moment and blocked again, as the server's HTTP thread
 * and its client do at every token of a stream: a pool that stopped
 * spinning for it paid a wake-up per job for the next CALM_NS, about as
 * slow as one thread.
 *
 * A pool may be shared (the server's sessions run on one): its workers
 * take one job at a time, and a caller that finds them on another
 * thread's job runs its ranges itself, one after another, as part 0.
 * Kernels give the same bytes for any split, so only the time differs. */
#include "base/threads.h"
#include "base/util.h"

#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define SPIN 4096        /* polls, a yield of the CPU every 32 */
#define CROWDED_NS 250000 /* a yield that took longer: other threads wanted the core */
#define CROWD_WINDOW_NS 20000000 /* the time such yields lost is summed over windows this long */
#define CROWD_SHARE 4    /* more than 1/CROWD_SHARE of a window lost: the cores are crowded */
#define CALM_NS 200000000 /* then no spinning for this long */
#define PER_THREAD 4     /* ranges a thread, at most (each at least min_per_thread long) */
#define MAX_RANGES 0xffffu

/* claim word: generation << 32 | ranges << 16 | next range */
#define C_GEN(c) ((uint32_t)((c) >> 32))
#define C_NR(c) ((uint32_t)((c) >> 16) & MAX_RANGES)
#define C_NEXT(c) ((uint32_t)(c) & MAX_RANGES)

int kvt_pool_fault;

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
    _Atomic uint64_t claim;
    _Atomic uint32_t finished; /* ranges of the current job done */
    _Atomic int quit;
    _Atomic int taken;   /* a caller's job holds the workers */
    uint32_t sleepers;   /* workers waiting on go (under mu) */
    /* Spinning pays only while the pool's threads have cores to themselves:
     * a spinning thread that another thread preempts has spent the credit
     * the scheduler gives a thread it wakes, and waits behind the other for
     * a whole time slice. A yield that comes back late shows it; then the
     * pool sleeps at once for CALM_NS. */
    _Atomic int64_t no_spin_until;
    _Atomic int64_t win_start, win_lost; /* the late yields' window, and the time they lost in it */
    bool caller_sleeps;  /* the caller waits on done (under mu) */
    /* current job, written before the claim word publishes it */
    kvt_range_fn fn;
    kvt_part_fn part_fn; /* instead of fn, when set */
    void *ctx;
    size_t total;
    uint32_t last_parts; /* ranges of the latest kvt_pool_for, 1 when it ran unsplit */
};

uint32_t kvt_ncpu(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (uint32_t)n : 1;
}

static void run_range(kvt_range_fn fn, kvt_part_fn part_fn, void *ctx, uint32_t part, size_t n, uint32_t nr,
                      uint32_t r)
{
    size_t b = n * r / nr, e = n * (r + 1) / nr;
    if (b >= e) return;
    if (part_fn) part_fn(ctx, part, b, e);
    else fn(ctx, b, e);
}

/* Claim and run ranges of the job of generation gen as part `part` until
 * none is left; returns at once when the word holds another job. */
static void claim_and_run(kvt_pool *p, uint32_t gen, uint32_t part)
{
    uint64_t c = atomic_load(&p->claim);
    for (;;) {
        if (C_GEN(c) != gen || C_NEXT(c) >= C_NR(c)) return;
        if (kvt_pool_fault == KVT_POOL_FAULT_STATIC && C_NEXT(c) != part) { /* tests: range k on thread k only */
            if (C_NEXT(c) > part) return;
            c = atomic_load(&p->claim);
            continue;
        }
        if (!atomic_compare_exchange_weak(&p->claim, &c, c + 1)) continue;
        /* the range is ours: the job cannot change until it is finished */
        uint32_t nr = C_NR(c), r = C_NEXT(c);
        run_range(p->fn, p->part_fn, p->ctx, kvt_pool_fault == KVT_POOL_FAULT_SHARED_PART ? 0 : part, p->total, nr,
                  r);
        if (atomic_fetch_add(&p->finished, 1) + 1 == nr && part) { /* a worker ran the last: the caller may sleep */
            pthread_mutex_lock(&p->mu);
            if (p->caller_sleeps) pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
        c = atomic_load(&p->claim);
    }
}

void (*kvt_pool_test_yield)(void);

/* A yield of the CPU that came back late (t: before it, u: after it):
 * whether the cores are crowded now, by the time late yields lost in the
 * window they fall in. */
static bool crowded(kvt_pool *p, int64_t t, int64_t u)
{
    if (kvt_pool_fault == KVT_POOL_FAULT_CALM_AT_ONCE) return true;
    if (u - atomic_load(&p->win_start) > CROWD_WINDOW_NS) { /* a new window (two threads may both start it) */
        atomic_store(&p->win_start, t);
        atomic_store(&p->win_lost, 0);
    }
    return (atomic_fetch_add(&p->win_lost, u - t) + (u - t)) * CROWD_SHARE > CROWD_WINDOW_NS;
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
    if (kvt_pool_test_yield) kvt_pool_test_yield();
    else sched_yield();
    int64_t u = now_ns();
    if (u - t > CROWDED_NS && crowded(p, t, u)) {
        atomic_store(&p->no_spin_until, u + CALM_NS);
        return false;
    }
    return true;
}

bool kvt_pool_spinning(const kvt_pool *p) { return p && now_ns() >= atomic_load(&p->no_spin_until); }

struct worker_arg { kvt_pool *p; uint32_t k; };

static void *worker(void *arg)
{
    struct worker_arg *wa = arg;
    kvt_pool *p = wa->p;
    uint32_t k = wa->k;
    free(wa);
    uint32_t seen = 0;
#define NEWS() (C_GEN(atomic_load(&p->claim)) != seen || atomic_load(&p->quit))
    for (;;) {
        for (int i = 0; i < SPIN && !NEWS() && spin_poll(p, i); i++) {}
        if (!NEWS()) {
            pthread_mutex_lock(&p->mu);
            p->sleepers++;
            while (!NEWS()) pthread_cond_wait(&p->go, &p->mu);
            p->sleepers--;
            pthread_mutex_unlock(&p->mu);
        }
#undef NEWS
        if (atomic_load(&p->quit)) break;
        seen = C_GEN(atomic_load(&p->claim));
        claim_and_run(p, seen, k);
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

/* How many ranges [0, n) runs as: PER_THREAD a thread, each at least
 * min_per_range long; more ranges than threads only as a multiple of the
 * threads, so that threads that all keep their cores get the same share
 * (5 ranges on 2 threads would make the step 3/5 of the work, not 1/2). */
static uint32_t ranges_of(const kvt_pool *p, size_t n, size_t min_per_range)
{
    if (n == 0) return 1;
    if (min_per_range < 1) min_per_range = 1;
    size_t t = kvt_pool_size(p), nr = t <= 1 ? 1 : t * PER_THREAD;
    if (kvt_pool_fault == KVT_POOL_FAULT_STATIC) nr = t;
    if (n / min_per_range < nr) nr = n / min_per_range;
    if (nr > t) nr -= nr % t;
    if (nr > MAX_RANGES) nr = MAX_RANGES;
    return nr ? (uint32_t)nr : 1;
}

static uint32_t pool_run(kvt_pool *p, size_t n, size_t min_per_range, kvt_range_fn fn, kvt_part_fn part_fn,
                         void *ctx)
{
    if (n == 0) return 1;
    uint32_t nr = ranges_of(p, n, min_per_range);
    if (nr <= 1) {
        if (p) p->last_parts = 1;
        if (part_fn) part_fn(ctx, 0, 0, n);
        else fn(ctx, 0, n);
        return 1;
    }
    if (atomic_exchange(&p->taken, 1)) {
        /* the workers run another thread's job: the same ranges, here */
        for (uint32_t r = 0; r < nr; r++) run_range(fn, part_fn, ctx, 0, n, nr, r);
        return nr;
    }
    p->last_parts = nr;
    /* the job's fields, then the claim word that publishes them (the
     * atomic store orders them before it for a worker that sees it) */
    p->fn = fn;
    p->part_fn = part_fn;
    p->ctx = ctx;
    p->total = n;
    atomic_store(&p->finished, 0);
    uint32_t gen = C_GEN(atomic_load(&p->claim)) + 1;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->claim, (uint64_t)gen << 32 | (uint64_t)nr << 16);
    if (p->sleepers) pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    claim_and_run(p, gen, 0);
    for (int i = 0; i < SPIN && atomic_load(&p->finished) < nr && spin_poll(p, i); i++) {}
    if (atomic_load(&p->finished) < nr) {
        pthread_mutex_lock(&p->mu);
        p->caller_sleeps = true;
        while (atomic_load(&p->finished) < nr) pthread_cond_wait(&p->done, &p->mu);
        p->caller_sleeps = false;
        pthread_mutex_unlock(&p->mu);
    }
    atomic_store(&p->taken, 0);
    return nr;
}

uint32_t kvt_pool_for(kvt_pool *p, size_t n, size_t min_per_range, kvt_range_fn fn, void *ctx)
{
    return pool_run(p, n, min_per_range, fn, NULL, ctx);
}

uint32_t kvt_pool_for_part(kvt_pool *p, size_t n, size_t min_per_range, kvt_part_fn fn, void *ctx)
{
    return pool_run(p, n, min_per_range, NULL, fn, ctx);
}

/* ---- a thread's CPU policy for background work ---- */

static void *idle_probe(void *arg)
{
    struct sched_param sp = {0};
    bool *ok = arg;
    *ok = sched_setscheduler(0, SCHED_IDLE, &sp) == 0 && sched_setscheduler(0, SCHED_OTHER, &sp) == 0;
    return NULL;
}

static bool idle_can;
static pthread_once_t idle_once = PTHREAD_ONCE_INIT;

static void idle_probe_once(void)
{
    pthread_t t;
    bool ok = false;
    if (pthread_create(&t, NULL, idle_probe, &ok) == 0 && pthread_join(t, NULL) == 0) idle_can = ok;
}

bool kvt_thread_idle_ok(void)
{
    pthread_once(&idle_once, idle_probe_once);
    return idle_can;
}

bool kvt_thread_idle(bool on, int *was)
{
    struct sched_param sp = {0};
    if (on) {
        *was = -1; /* nothing to give back */
        int now = sched_getscheduler(0);
        if (now == SCHED_IDLE) return true;
        if ((now != SCHED_OTHER && now != SCHED_BATCH) || !kvt_thread_idle_ok()) return false;
        *was = now;
        return sched_setscheduler(0, SCHED_IDLE, &sp) == 0;
    }
    if (*was < 0) return sched_getscheduler(0) != SCHED_IDLE;
    if (sched_setscheduler(0, *was, &sp) != 0) return false;
    *was = -1;
    return true;
}
