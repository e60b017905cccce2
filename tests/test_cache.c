/* The in-RAM KV cache (src/cache/cache.c) on its own, without a model:
 * the chains of bases that copy-on-write makes, and their release.
 *
 * A block a cache writes into while another cache holds it becomes the
 * base of the cache's new block, which owns the page written and reads
 * the pages before it from the base. A fork of a fork that writes into the
 * same block adds a link each time, so the chain is as long as the forks
 * are many. Letting go of its top frees the whole chain; the tests run
 * that release on a thread with a 64 KiB stack, where a release that took a
 * call per base overflows the stack long before the end. A let-go walks
 * only the run of blocks that count in the cache (kvt_cache_bytes_held),
 * so n forks of forks cost n links, not n^2: cache_fork_chain_linear
 * counts them (kvt_cache_links_walked). */
#include "test.h"
#include "cache/cache.h"

#include <link.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* One stream of 4-byte rows, 128 a block: pages of 16 rows (64 bytes). */
static const uint32_t spec[1][2] = {{4, 128}};
#define SMALL_STACK (64u << 10)

static void *free_cache(void *c)
{
    kvt_cache_free(c);
    return NULL;
}

static void free_cache_void(void *c) { kvt_cache_free(c); } /* for the cleanup list */

static int add_tls(struct dl_phdr_info *info, size_t size, void *sum)
{
    for (size_t i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_TLS)
            *(size_t *)sum += info->dlpi_phdr[i].p_memsz + info->dlpi_phdr[i].p_align;
    return 0;
}

/* kvt_cache_free(c) on a thread of its own with SMALL_STACK bytes of
 * stack to call in. glibc carves a thread's static thread-local storage
 * (here 64 KiB of the kernels' tiles) and its descriptor out of the size
 * asked: they are added to it, and 8 KiB for the descriptor and what the
 * C library adds. */
static bool free_on_small_stack(kvt_cache *c)
{
    size_t tls = 0;
    dl_iterate_phdr(add_tls, &tls);
    pthread_attr_t a;
    pthread_t t;
    if (pthread_attr_init(&a)) return false;
    int rc = pthread_attr_setstacksize(&a, SMALL_STACK + tls + (8u << 10));
    if (!rc) rc = pthread_create(&t, &a, free_cache, c);
    pthread_attr_destroy(&a);
    if (!rc) rc = pthread_join(t, NULL);
    if (rc) printf("    a thread of a %u KiB stack (and %zu bytes of TLS): %s\n", SMALL_STACK >> 10, tls, strerror(rc));
    return !rc;
}

static size_t chain_length(const kvt_block *h)
{
    size_t n = 0;
    for (; h; h = h->base) n++;
    return n;
}

static size_t refs(const kvt_block *h) { return atomic_load(&((kvt_block *)h)->refs); }

/* Forks of forks through the cache's API: each shares its parent's block
 * 0, writes row 16 (page 1) into it, and the parent goes. The chain grows
 * a link a fork; every fork reads row 0 from the first cache's block and
 * row 16 as it wrote it. The last fork's release frees every link and
 * leaves the first cache's block held by that cache alone. */
TEST(cache_fork_chain_release)
{
    enum { FORKS = 3000 };
    kvt_cache *first = kvt_cache_new(1, spec, KVT_BLOCK, 0);
    CHECK(first != NULL);
    uint32_t *w = kvt_cache_row(first, 0, 0);
    CHECK(w != NULL);
    *w = 7;
    CHECK((w = kvt_cache_row(first, 0, 16)) != NULL); /* a write may move the rows before it */
    *w = 0;
    kvt_cache *prev = first;
    for (uint32_t i = 1; i <= FORKS; i++) {
        kvt_cache *c = kvt_cache_new(1, spec, KVT_BLOCK, 0);
        CHECK(c != NULL);
        CHECK_OK(kvt_cache_share(c, prev, 32));
        CHECK((w = kvt_cache_row(c, 0, 16)) != NULL);
        *w = i;
        if (prev != first) kvt_cache_free(prev);
        prev = c;
        CHECK(*(const uint32_t *)kvt_cache_row_ro(c, 0, 0) == 7);
    }
    const kvt_block *top = prev->streams[0].held[0], *bottom = first->streams[0].held[0];
    CHECKF(chain_length(top) == FORKS + 1, "a chain of %zu blocks after %d forks", chain_length(top), FORKS);
    CHECK(*(const uint32_t *)kvt_cache_row_ro(prev, 0, 16) == FORKS);
    CHECK(*(const uint32_t *)kvt_cache_row_ro(first, 0, 16) == 0);
    CHECK(refs(bottom) == 2); /* the first cache and the first fork's block */
    CHECK(free_on_small_stack(prev));
    CHECKF(refs(bottom) == 1, "the first block held %zu times after the release", refs(bottom));
    CHECK(*(const uint32_t *)kvt_cache_row_ro(first, 0, 0) == 7);
    kvt_cache_free(first);
}

/* n forks of forks, as cache_fork_chain_release makes them (each fork
 * reads its own figure, kvt_cache_bytes_held, so that it takes the blocks
 * its freed parents left), then the last one freed: *links the links its
 * let-gos visited (kvt_cache_links_walked), *held what the last fork
 * counts of the blocks before its release (kvt_cache_bytes_parts: the
 * chain's blocks but the first cache's), *expect the bytes of those
 * blocks. */
static void fork_chain_walk(uint32_t n, unsigned long *links, size_t *held, size_t *expect)
{
    *links = 0;
    *held = *expect = 0;
    kvt_cache *first = kvt_cache_new(1, spec, KVT_BLOCK, 0);
    CHECK(first != NULL);
    kvt_test_defer(free_cache_void, first);
    uint32_t *w = kvt_cache_row(first, 0, 0);
    CHECK(w != NULL);
    *w = 7;
    CHECK(kvt_cache_row(first, 0, 16) != NULL);
    unsigned long l0 = kvt_cache_links_walked();
    kvt_cache *prev = first;
    for (uint32_t i = 1; i <= n; i++) {
        kvt_cache *c = kvt_cache_new(1, spec, KVT_BLOCK, 0);
        CHECK(c != NULL);
        kvt_test_defer(free_cache_void, c);
        CHECK_OK(kvt_cache_share(c, prev, 32));
        CHECK((w = kvt_cache_row(c, 0, 16)) != NULL);
        *w = i;
        (void)kvt_cache_bytes_held(c);
        if (prev != first) kvt_test_release(prev);
        prev = c;
    }
    const kvt_block *top = prev->streams[0].held[0], *bottom = first->streams[0].held[0];
    CHECKF(chain_length(top) == n + 1, "a chain of %zu blocks after %u forks", chain_length(top), n);
    for (const kvt_block *h = top; h != bottom; h = h->base) *expect += KVT_BLOCK_ROWS_AT + h->bytes;
    kvt_cache_parts p;
    kvt_cache_bytes_parts(prev, &p);
    *held = p.whole + p.pages;
    CHECK(*(const uint32_t *)kvt_cache_row_ro(prev, 0, 0) == 7);
    kvt_test_release(prev);
    *links = kvt_cache_links_walked() - l0;
    CHECKF(refs(bottom) == 1, "the first block held %zu times after the release", refs(bottom));
    kvt_test_release(first);
}

/* 20,000 forks of forks built and released: the links the let-gos visit
 * (a count, not a time) stay under a few per fork, and the last fork
 * counts every block of the chain its parents left (the accounting the
 * bounded walk keeps). With KVT_CACHE_FAULT_FULL_WALK (every let-go walks
 * its whole chain, as before) the count is quadratic, and the test says
 * so (the fault's run, at 20,000, walks 200 million links: a few
 * seconds). */
TEST(cache_fork_chain_linear)
{
    enum { FORKS = 20000 };
    unsigned long links;
    size_t held, expect;
    fork_chain_walk(FORKS, &links, &held, &expect);
    if (kvt_test_failed()) return;
    printf("    %d forks of forks: %lu links visited by the let-gos (%.2f a fork); the last fork counts %zu bytes "
           "of blocks, the chain's are %zu\n", FORKS, links, (double)links / FORKS, held, expect);
    CHECKF(links <= 4ul * FORKS, "%lu links visited for %d forks: not linear", links, FORKS);
    CHECKF(held == expect, "the last fork counts %zu bytes of blocks, not the %zu of the chain its parents left",
           held, expect);
    /* negative control: the full walk */
    kvt_cache_fault = KVT_CACHE_FAULT_FULL_WALK;
    fork_chain_walk(FORKS, &links, &held, &expect);
    kvt_cache_fault = 0;
    if (kvt_test_failed()) return;
    printf("    with KVT_CACHE_FAULT_FULL_WALK: %lu links (%.0f a fork)\n", links, (double)links / FORKS);
    CHECKF(links >= (unsigned long)FORKS * FORKS / 4, "with the full walk %lu links for %d forks: the count "
           "cannot tell a quadratic walk from a linear one", links, FORKS);
    CHECKF(held == expect, "with the full walk the last fork counts %zu bytes, not %zu", held, expect);
}

/* A block of its own allocation owning page `from` (from 0: pages 0 and
 * 1), over base, held once. */
static kvt_block *link_block(kvt_block *base, uint32_t from)
{
    uint32_t pages = from ? 1 : 2;
    kvt_block *h = malloc(KVT_BLOCK_ROWS_AT + pages * 64);
    if (!h) return NULL;
    atomic_init(&h->refs, 1);
    atomic_init(&h->owner, (uintptr_t)0);
    h->arena = NULL;
    h->base = base;
    h->from = from;
    h->n_pages = pages;
    h->bytes = pages * 64;
    memset((uint8_t *)h + KVT_BLOCK_ROWS_AT, 0, h->bytes);
    return h;
}

/* Cache c holds h (its reference is the one h was made with) as block 0
 * of its stream, reading page 0 from bottom. */
static void hold(kvt_cache *c, kvt_block *h, kvt_block *bottom)
{
    kvt_stream *st = &c->streams[0];
    st->held[0] = h;
    st->pages[0] = (uint8_t *)bottom + KVT_BLOCK_ROWS_AT;
    st->pages[1] = (uint8_t *)h + KVT_BLOCK_ROWS_AT + (h == bottom ? 64 : 0);
}

/* The same at 100,000 links, made as the forks above make them but
 * directly: through the API every fork that goes walks the chain below
 * its block (to give back the blocks that count in it), so forks of forks
 * cost the square of their number to make. */
TEST(cache_base_chain_release)
{
    enum { LINKS = 100000 };
    kvt_cache *first = kvt_cache_new(1, spec, KVT_BLOCK, 0), *last = kvt_cache_new(1, spec, KVT_BLOCK, 0);
    kvt_block *bottom = link_block(NULL, 0);
    CHECK(first && last && bottom);
    hold(first, bottom, bottom);
    atomic_fetch_add(&bottom->refs, 1); /* the first link's */
    kvt_block *top = bottom;
    for (size_t i = 0; i < LINKS; i++) {
        kvt_block *h = link_block(top, 1);
        CHECK(h != NULL);
        top = h;
    }
    hold(last, top, bottom);
    CHECK(chain_length(top) == LINKS + 1);
    CHECK(free_on_small_stack(last));
    CHECKF(refs(bottom) == 1, "the bottom block held %zu times after the release", refs(bottom));
    kvt_cache_free(first);
}
