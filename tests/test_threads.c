/* The worker pool (src/base/threads.c): every index of a loop runs exactly once,
 * a part's index stays below the pool's size and never runs two ranges at
 * once (kernels keep scratch per part), and a worker that is held in a
 * range does not stop the caller from running the rest of the job. Each
 * check has its negative control: the pool's fault switch (kvt_pool_fault)
 * gives every range part 0, or splits a job into one range a thread, range
 * k on thread k, and the check must then fail. */
#include "test.h"
#include "base/threads.h"
#include "kernels/kernels.h"
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct cover {
    size_t n, min;
    uint32_t size;
    _Atomic uint32_t *hits; /* n: runs of each index */
    _Atomic int busy[8];    /* ranges a part runs at this moment */
    _Atomic int calls, bad_part, overlap, short_range;
    int spin_ns;            /* each range takes this long, to let ranges meet */
} cover;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void cover_part(void *ctx, uint32_t part, size_t b, size_t e)
{
    cover *c = ctx;
    atomic_fetch_add(&c->calls, 1);
    bool own = part != UINT32_MAX; /* UINT32_MAX: kvt_pool_for's ranges, which have no part */
    if (own && (part >= c->size || part >= 8)) { atomic_fetch_add(&c->bad_part, 1); return; }
    if (own && atomic_fetch_add(&c->busy[part], 1)) atomic_fetch_add(&c->overlap, 1);
    if (b >= e || e > c->n) atomic_fetch_add(&c->short_range, 1);
    for (size_t i = b; i < e && i < c->n; i++) atomic_fetch_add(&c->hits[i], 1);
    for (int64_t t0 = now_ns(); c->spin_ns && now_ns() - t0 < c->spin_ns;) {}
    if (own) atomic_fetch_sub(&c->busy[part], 1);
}

static void cover_range(void *ctx, size_t b, size_t e) { cover_part(ctx, UINT32_MAX, b, e); }

/* One loop over [0, n) on p; false with a message when an index ran other
 * than once, a part index was out of range, a range was empty or shorter
 * than min when the loop was split, or the count of ranges returned is
 * not the count that ran, or there were more ranges than threads but not
 * a multiple of them. *overlap: times a part ran two ranges at once. */
static bool cover_once(kvt_pool *p, size_t n, size_t min, bool parted, int spin_ns, int *overlap, char *why,
                       size_t cap)
{
    cover c = {.n = n, .min = min, .size = kvt_pool_size(p), .spin_ns = spin_ns};
    c.hits = calloc(n ? n : 1, sizeof *c.hits);
    if (!c.hits) { snprintf(why, cap, "out of memory"); return false; }
    uint32_t nr = parted ? kvt_pool_for_part(p, n, min, cover_part, &c) : kvt_pool_for(p, n, min, cover_range, &c);
    bool ok = true;
    size_t wrong = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if (atomic_load(&c.hits[i]) != 1 && !wrong++) first = i;
    if (wrong) ok = false, snprintf(why, cap, "%zu indices not run once (the first %zu, %u times)", wrong, first,
                                    atomic_load(&c.hits[first]));
    else if (atomic_load(&c.bad_part)) ok = false, snprintf(why, cap, "a part index >= %u", c.size);
    else if (atomic_load(&c.short_range)) ok = false, snprintf(why, cap, "an empty range");
    else if (n && (uint32_t)atomic_load(&c.calls) != nr)
        ok = false, snprintf(why, cap, "%d ranges ran, %u returned", atomic_load(&c.calls), nr);
    else if (nr > 1 && n / nr < (min ? min : 1)) ok = false, snprintf(why, cap, "%u ranges of %zu: < %zu", nr, n, min);
    else if (nr > c.size && nr % c.size) ok = false, snprintf(why, cap, "%u ranges on %u threads", nr, c.size);
    *overlap += atomic_load(&c.overlap);
    free(c.hits);
    return ok;
}

/* Pools of 1 to 4 threads and none, loops of 0 to 100003 indices, minimum
 * ranges of 0 to 1000: every index once, in ranges of at least the
 * minimum, as many as the threads or fewer or a multiple of them. Then loops whose ranges take
 * 20 us, so that the threads' ranges meet: no part runs two at once, and
 * with every range told it is part 0 (KVT_POOL_FAULT_SHARED_PART) the
 * check sees parts that do. */
TEST(threads_pool_cover)
{
    const size_t ns[] = {0, 1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4097, 100003};
    const size_t mins[] = {0, 1, 2, 3, 5, 16, 64, 1000};
    char why[200];
    int overlap = 0;
    for (uint32_t th = 0; th <= 4; th++) {
        kvt_pool *p = th ? kvt_pool_new(th) : NULL;
        CHECK(!th || p);
        for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
            for (size_t b = 0; b < sizeof mins / sizeof mins[0]; b++)
                for (int parted = 0; parted < 2; parted++) {
                    bool ok = cover_once(p, ns[a], mins[b], parted, 0, &overlap, why, sizeof why);
                    if (!ok) kvt_pool_free(p);
                    CHECKF(ok, "%u threads, n %zu, min %zu%s: %s", th, ns[a], mins[b], parted ? ", parted" : "", why);
                }
        kvt_pool_free(p);
    }
    kvt_pool *p = kvt_pool_new(2);
    CHECK(p);
    bool ok = true;
    for (int i = 0; i < 200 && ok; i++) ok = cover_once(p, 64, 1, true, 20000, &overlap, why, sizeof why);
    int shared = 0;
    kvt_pool_fault = KVT_POOL_FAULT_SHARED_PART;
    for (int i = 0; i < 200 && !shared; i++) cover_once(p, 64, 1, true, 20000, &shared, why, sizeof why);
    kvt_pool_fault = 0;
    kvt_pool_free(p);
    CHECKF(ok, "2 threads, ranges of 20 us: %s", why);
    CHECKF(overlap == 0, "a part ran two ranges at once %d times", overlap);
    CHECKF(shared > 0, "negative control: with every range part 0 no part ran two ranges at once");
    printf("    negative control: every range part 0, %d ranges met another of their part\n", shared);
}

/* A worker held in its first range (as when another thread takes its
 * core): the caller claims and runs every other range, so the worker holds
 * at most the one range it took. */
typedef struct held {
    pthread_t caller;
    size_t n;
    _Atomic size_t on_worker; /* indices the worker ran */
    _Atomic int held;         /* the worker was held */
    _Atomic uint32_t *hits;
} held;

static void held_range(void *ctx, size_t b, size_t e)
{
    held *h = ctx;
    for (size_t i = b; i < e; i++) atomic_fetch_add(&h->hits[i], 1);
    if (pthread_equal(pthread_self(), h->caller)) {
        for (int64_t t0 = now_ns(); now_ns() - t0 < 50000;) {} /* 50 us: time for the worker to claim */
        return;
    }
    atomic_fetch_add(&h->on_worker, e - b);
    if (!atomic_exchange(&h->held, 1)) usleep(200000);
}

/* Loops of n on a 2-thread pool until the worker was held in one:
 * the indices the worker ran in it, or (size_t)-1 when it never took a
 * range in 200 loops or an index ran other than once. */
static size_t held_share(size_t n)
{
    kvt_pool *p = kvt_pool_new(2);
    if (!p) return (size_t)-1;
    held h = {.caller = pthread_self(), .n = n};
    h.hits = calloc(n, sizeof *h.hits);
    size_t share = (size_t)-1;
    for (int i = 0; h.hits && i < 200 && !atomic_load(&h.held); i++) {
        for (size_t k = 0; k < n; k++) atomic_store(&h.hits[k], 0);
        atomic_store(&h.on_worker, 0);
        kvt_pool_for(p, n, 1, held_range, &h);
        bool once = true;
        for (size_t k = 0; k < n; k++) once &= atomic_load(&h.hits[k]) == 1;
        if (!once) break;
        if (atomic_load(&h.held)) share = atomic_load(&h.on_worker);
    }
    kvt_pool_free(p);
    free(h.hits);
    return share;
}

TEST(threads_pool_held_worker)
{
    enum { N = 64 };
    size_t share = held_share(N);
    CHECKF(share != (size_t)-1, "the worker never took a range, or an index ran other than once");
    CHECKF(share <= N / 4, "the held worker ran %zu of %d indices: the caller did not take the rest", share, N);
    kvt_pool_fault = KVT_POOL_FAULT_STATIC;
    size_t fixed = held_share(N);
    kvt_pool_fault = 0;
    printf("    held worker: %zu of %d indices; negative control (one range a thread): %zu\n", share, N, fixed);
    CHECKF(fixed != (size_t)-1 && fixed > N / 4, "negative control: one range a thread, the held worker ran %zu",
           fixed);
}

static float frand(uint64_t *s) { return (float)((double)(kvt_test_rand(s) >> 11) / 9007199254740992.0 * 2 - 1); }

/* A pool two threads call at once (the server's sessions share one): the
 * second caller, finding the workers on the first's job, runs its ranges
 * itself, the same ranges, with the same bytes. Thread A holds the pool
 * (a range of its job waits) while this thread runs a matmul and a parted
 * loop on it: every range on this thread, the loop's range count the
 * pool's (4 for 4 indices), the matmul's bytes those of no pool. Negative control (by hand): without
 * the pool's taken flag the second caller's ranges run on the worker. */
typedef struct hold {
    kvt_pool *p;
    _Atomic int started, release;
    pthread_t caller;
    _Atomic int elsewhere, ran;
} hold;

static void hold_part(void *ctx, uint32_t part, size_t b, size_t e)
{
    hold *h = ctx;
    if (atomic_exchange(&h->started, 1)) return; /* the first range to run holds the job */
    for (int i = 0; i < 10000 && !atomic_load(&h->release); i++) usleep(1000);
}

static void *hold_main(void *arg)
{
    hold *h = arg;
    kvt_pool_for_part(h->p, 2, 1, hold_part, h);
    return NULL;
}

static void where_part(void *ctx, uint32_t part, size_t b, size_t e)
{
    hold *h = ctx;
    atomic_fetch_add(&h->ran, 1);
    if (!pthread_equal(pthread_self(), h->caller)) atomic_fetch_add(&h->elsewhere, 1);
}

TEST(threads_pool_two_callers)
{
    enum { DI = 517, DO = 53, NB = 9 };
    uint64_t st = 7;
    float *W = malloc(sizeof(float) * DO * DI), *x = malloc(sizeof(float) * NB * DI);
    float *y1 = malloc(sizeof(float) * NB * DO), *y2 = malloc(sizeof(float) * NB * DO);
    CHECK(W && x && y1 && y2);
    for (int i = 0; i < DO * DI; i++) W[i] = frand(&st);
    for (int i = 0; i < NB * DI; i++) x[i] = frand(&st);
    kvt_matmul(NULL, y1, W, x, NB, DI, DO);
    hold h = {.p = kvt_pool_new(2), .caller = pthread_self()};
    CHECK(h.p);
    pthread_t a;
    CHECK(pthread_create(&a, NULL, hold_main, &h) == 0);
    for (int i = 0; i < 10000 && !atomic_load(&h.started); i++) usleep(1000);
    bool held = atomic_load(&h.started);
    kvt_matmul(h.p, y2, W, x, NB, DI, DO);
    uint32_t parts = kvt_pool_for_part(h.p, 4, 1, where_part, &h);
    atomic_store(&h.release, 1);
    pthread_join(a, NULL);
    kvt_pool_free(h.p);
    bool same = !memcmp(y1, y2, sizeof(float) * NB * DO);
    free(W), free(x), free(y1), free(y2);
    CHECK(held);
    CHECKF(parts == 4 && atomic_load(&h.ran) == 4 && !atomic_load(&h.elsewhere),
           "the second caller's loop: %u parts, %d ran, %d on another thread", parts, atomic_load(&h.ran),
           atomic_load(&h.elsewhere));
    CHECK(same);
}

/* A late yield (another thread took the core) stops the pool's spinning
 * only when late yields take more than a quarter of 20 ms: one alone is a
 * thread that ran and blocked again, as the server's HTTP thread and its
 * client do at every token of a stream. The yields are the test's: the
 * late ones take 0.4 ms (CROWDED_NS is 0.25 ms), twenty of them in a row
 * (8 ms) stop the spinning. */
static _Atomic int yields, late_from, late_n;

static void test_yield(void)
{
    int k = atomic_fetch_add(&yields, 1);
    if (k >= late_from && k < late_from + late_n)
        for (int64_t t0 = now_ns(); now_ns() - t0 < 400000;) {}
}

/* Whether a fresh pool of 2 still spins once its worker has spun out (128
 * yields, then it sleeps), its yields from the 5th on late `n` in a row. */
static bool spins_after_late(int n)
{
    atomic_store(&yields, 0);
    atomic_store(&late_from, 4);
    atomic_store(&late_n, n);
    kvt_pool_test_yield = test_yield;
    kvt_pool *p = kvt_pool_new(2);
    if (!p) { kvt_pool_test_yield = NULL; return false; }
    /* past the late ones, then the rest of its spin (CALM_NS, 200 ms, is
     * far longer than these waits) */
    for (int i = 0; i < 1000 && atomic_load(&yields) < 4 + n && kvt_pool_spinning(p); i++) usleep(1000);
    if (kvt_pool_spinning(p)) usleep(20000);
    bool spinning = kvt_pool_spinning(p);
    kvt_pool_free(p);
    kvt_pool_test_yield = NULL;
    return spinning;
}

TEST(threads_pool_one_late_yield)
{
    bool one = spins_after_late(1), two = spins_after_late(2), many = spins_after_late(20);
    kvt_pool_fault = KVT_POOL_FAULT_CALM_AT_ONCE;
    bool one_fault = spins_after_late(1);
    kvt_pool_fault = 0;
    printf("    spinning after 0.4 ms late yields: one %s, two %s, twenty %s; negative control (one is enough): %s\n",
           one ? "yes" : "no", two ? "yes" : "no", many ? "yes" : "no", one_fault ? "yes" : "no");
    CHECKF(one && two, "one or two late yields stopped the pool's spinning");
    CHECKF(!many, "twenty late yields in a row (8 of 20 ms) did not stop the pool's spinning");
    CHECKF(!one_fault, "negative control: with the old rule one late yield still left the pool spinning");
}
