/* The worker pool (src/base/threads.c): several callers on one pool. */
#include "test.h"
#include "kernels/kernels.h"
#include "base/threads.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static float frand(uint64_t *s) { return (float)((double)(kvt_test_rand(s) >> 11) / 9007199254740992.0 * 2 - 1); }

/* A pool two threads call at once (the server's sessions share one): the
 * second caller, finding the workers on the first's job, runs its parts
 * itself, the same parts, with the same bytes. Thread A holds the pool
 * (its part 0 waits) while this thread runs a matmul and a parted loop on
 * it: every part on this thread, the loop's part count that of the pool,
 * the matmul's bytes those of no pool. Negative control (by hand): without
 * the pool's taken flag the second caller's part 1 runs on the worker. */
typedef struct hold {
    kvt_pool *p;
    _Atomic int started, release;
    pthread_t caller;
    _Atomic int elsewhere, ran;
} hold;

static void hold_part(void *ctx, uint32_t part, size_t b, size_t e)
{
    hold *h = ctx;
    if (part != 0) return;
    atomic_store(&h->started, 1);
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
    CHECKF(parts == 2 && atomic_load(&h.ran) == 2 && !atomic_load(&h.elsewhere),
           "the second caller's loop: %u parts, %d ran, %d on another thread", parts, atomic_load(&h.ran),
           atomic_load(&h.elsewhere));
    CHECK(same);
}
