/* Counting allocations: the test binary is linked with
 * -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc (Makefile), so every call
 * from the library's and the tests' objects comes through here first. Used
 * to show that a forward pass allocates nothing but the cache blocks its
 * new rows need (issue: "no allocation per chunk"), and to fail one chosen
 * allocation (kvt_test_fail_alloc). */
#include "test.h"
#include "arch/model.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);

static _Atomic unsigned long allocs;
static _Atomic long fail_in = -1; /* allocations until the one that fails; -1: none */
static _Atomic unsigned long failed;

/* Counts the call; true when it is the one to fail. */
static bool count(void)
{
    atomic_fetch_add_explicit(&allocs, 1, memory_order_relaxed);
    long k = atomic_load(&fail_in);
    while (k >= 0 && !atomic_compare_exchange_weak(&fail_in, &k, k - 1)) {}
    if (k != 0) return false;
    atomic_fetch_add(&failed, 1);
    return true;
}

void *__wrap_malloc(size_t n) { return count() ? NULL : __real_malloc(n); }
void *__wrap_calloc(size_t n, size_t size) { return count() ? NULL : __real_calloc(n, size); }
void *__wrap_realloc(void *p, size_t n) { return count() ? NULL : __real_realloc(p, n); }

unsigned long kvt_test_allocs(void) { return atomic_load(&allocs); }

void kvt_test_fail_alloc(long k) { atomic_store(&fail_in, k); }
unsigned long kvt_test_failed_allocs(void) { return atomic_load(&failed); }

/* Pages the session's cache holds rows of its own for, over all streams
 * (each one allocation, a malloc or a realloc, when kvt_cache_row first
 * touches it). */
static size_t cache_blocks(const kvt_session *s)
{
    size_t n = 0;
    for (size_t i = 0; i < s->cache->n_streams; i++) {
        const kvt_stream *st = &s->cache->streams[i];
        for (size_t b = 0; b < st->n_blocks; b++) n += st->held[b] ? st->held[b]->n_pages : 0;
    }
    return n;
}

int kvt_test_forward_allocs(kvt_session *s, const int32_t *tok, size_t n, size_t pos0, float *logits,
                            size_t lfrom, long *extra)
{
    size_t b0 = cache_blocks(s);
    unsigned long a0 = kvt_test_allocs();
    int rc = s->m->arch->forward(s, tok, n, pos0, logits, lfrom);
    unsigned long a1 = kvt_test_allocs();
    *extra = (long)(a1 - a0) - (long)(cache_blocks(s) - b0);
    return rc;
}

bool kvt_test_forward_no_scratch(kvt_session *s, const int32_t *tok, size_t n0)
{
    float *lg = malloc((size_t)s->m->info.n_vocab * sizeof(float));
    long extra = -1, extra1 = -1;
    int rc = lg ? kvt_session_sync(s, tok, n0, NULL) : KVT_ENOMEM;
    if (!rc) rc = kvt_test_forward_allocs(s, tok + n0, 300, n0, lg, 299, &extra);
    if (!rc) rc = kvt_test_forward_allocs(s, tok + n0 + 300, 1, n0 + 300, lg, 0, &extra1);
    free(lg);
    if (rc) {
        printf("    forward: %s: %s\n", kvt_strerror(rc), kvt_errmsg());
        return false;
    }
    printf("    allocations beyond cache blocks: %ld in a 300-token pass, %ld in a decode step\n", extra, extra1);
    return extra == 0 && extra1 == 0;
}
