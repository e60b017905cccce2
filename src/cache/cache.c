/* In-RAM KV cache: row streams paged in 128-token blocks. See cache.h.
 *
 * Why blocks and not one array per stream: a block is the unit the disk tier
 * addresses by the token prefix it closes, and the unit that compressed
 * layers complete (32 ratio-4 rows or 1 ratio-128 row per 128 tokens). Growing
 * a session moves no rows but those of a block it shares, at its first write
 * into it (below); so a reader may hold row pointers of a stream until the
 * next write into that stream (the forward passes fetch them afresh).
 *
 * Sharing: every block has a header with an atomic count of the caches
 * holding it (cache.h). A copy of a session takes references
 * (kvt_cache_share); the only ways to write rows are kvt_cache_row and
 * kvt_cache_block, which copy what they write of a block held by others
 * before handing out a pointer into it, so a shared block stays exactly as
 * it was when it was shared. The count is read with acquire order there: a
 * copy let go on another thread has finished reading the block before this
 * cache writes it.
 *
 * Pages: each stream's table points at every page (KVT_PAGE tokens) of
 * every block, so a read is one lookup whichever block the page's rows are
 * in. A block's own rows cover a run of its pages; a write past them grows
 * the run (realloc: the block is this cache's alone), and a write into a
 * block others hold makes a new block of that one page whose base is the
 * shared block (held by reference, so its rows stay while the table points
 * into them). So a conversation that starts inside a shared prompt's last
 * block holds one page of that block and the pages of its own tokens, not
 * two whole blocks: on the Qwen3-0.6B shape 16 tokens are 1.75 MiB, a block
 * 14 MiB. */
#include "cache/cache.h"
#include "base/util.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

int kvt_cache_fault;
static _Thread_local unsigned long links_walked; /* kvt_cache_links_walked */

unsigned long kvt_cache_links_walked(void) { return links_walked; }

#define ROWS_AT KVT_BLOCK_ROWS_AT
_Static_assert(sizeof(kvt_block) <= ROWS_AT, "a block header fits before its rows");

static uint8_t *own_rows(kvt_block *h) { return (uint8_t *)h + ROWS_AT; }

static size_t page_bytes(const kvt_stream *st) { return (size_t)st->page_rows * st->row_bytes; }

kvt_cache *kvt_cache_new(size_t n_streams, const uint32_t (*spec)[2], size_t max_tokens,
                         size_t state_bytes)
{
    kvt_cache *c = kvt_calloc(1, sizeof *c);
    if (!c) return NULL;
    c->state_bytes = state_bytes;
    c->state = kvt_calloc(state_bytes ? state_bytes : 1, 1);
    if (!c->state) { free(c); return NULL; }
    c->n_streams = n_streams;
    c->max_tokens = max_tokens;
    c->streams = kvt_calloc(n_streams ? n_streams : 1, sizeof *c->streams);
    if (!c->streams) { free(c->state); free(c); return NULL; }
    size_t n_blocks = (max_tokens + KVT_BLOCK - 1) / KVT_BLOCK;
    c->keys = kvt_calloc(n_blocks ? n_blocks : 1, sizeof *c->keys);
    if (!c->keys) { free(c->streams); free(c->state); free(c); return NULL; }
    for (size_t s = 0; s < n_streams; s++) {
        kvt_stream *st = &c->streams[s];
        st->row_bytes = spec[s][0];
        st->rows_per_block = spec[s][1];
        st->n_blocks = n_blocks;
        st->page_rows = st->rows_per_block * KVT_PAGE / KVT_BLOCK ? st->rows_per_block * KVT_PAGE / KVT_BLOCK : 1;
        st->pages_per_block = st->rows_per_block / st->page_rows;
        st->pages = kvt_calloc(n_blocks ? n_blocks * st->pages_per_block : 1, sizeof *st->pages);
        st->held = kvt_calloc(n_blocks ? n_blocks : 1, sizeof *st->held);
        if (!st->pages || !st->held || !st->rows_per_block || KVT_BLOCK % st->rows_per_block) {
            kvt_cache_free(c);
            return NULL;
        }
    }
    return c;
}

/* Drop one reference to h. The last holder frees it: its own allocation,
 * or its share of an arena (the arena with its last block; the largest
 * emptied arena stays with c for its next load when keep says so), and
 * then drops its reference to its base, and so on down the chain. A loop,
 * not a call per base: forks of forks that each write into the block they
 * share make a chain as long as the forks are many, and a recursion that
 * deep would overflow a thread's stack (tests/test_cache.c). */
static void block_unref(kvt_cache *c, kvt_block *h, bool keep)
{
    while (h && atomic_fetch_sub_explicit(&h->refs, 1, memory_order_acq_rel) == 1) {
        kvt_block *base = h->base;
        kvt_arena *a = h->arena;
        if (!a) {
            free(h);
        } else {
            atomic_fetch_sub_explicit(&a->live_bytes, h->bytes, memory_order_relaxed);
            if (atomic_fetch_sub_explicit(&a->live, 1, memory_order_acq_rel) == 1) {
                if (keep && (!c->spare || a->bytes > c->spare_bytes)) {
                    free(c->spare);
                    c->spare = a->base;
                    c->spare_bytes = a->bytes;
                } else {
                    free(a->base);
                }
                free(a);
            }
        }
        h = base;
    }
}

/* Let go of one block that c holds. c is the cache letting go, on its own
 * thread. */
static void block_let_go(kvt_cache *c, kvt_block *h, bool keep)
{
    if (!h) return;
    /* The count of the block and of the bases it reads goes with it (before
     * the holder count: after it, another holder may free the block); the
     * next holder to count takes it. c reaches a base through this block
     * only: every block it reaches is at the same place in the same stream.
     * The blocks that count in c are a run from the top of each chain it
     * holds: it makes a block on top of its chain, and takes one (block_part)
     * only below blocks that count in it. So the first block of the chain
     * that is not c's ends the run: a fork of a fork of ... lets go in the
     * length of its own run, not of the whole chain, and n forks of forks
     * cost n, not n^2 (tests/test_cache.c). */
    for (kvt_block *x = h; x; x = x->base) {
        uintptr_t me = (uintptr_t)c;
        links_walked++;
        if (!atomic_compare_exchange_strong(&x->owner, &me, (uintptr_t)0) &&
            kvt_cache_fault != KVT_CACHE_FAULT_FULL_WALK)
            break;
    }
    if (kvt_cache_fault == KVT_CACHE_FAULT_FREE_SHARED && !h->arena) { free(h); return; }
    block_unref(c, h, keep);
}

static void block_release(kvt_cache *c, kvt_block *h) { block_let_go(c, h, true); }

/* Stream st's block b let go, its slot empty. */
static void slot_clear(kvt_cache *c, kvt_stream *st, size_t b)
{
    block_release(c, st->held[b]);
    st->held[b] = NULL;
    for (size_t k = 0; k < st->pages_per_block; k++) st->pages[b * st->pages_per_block + k] = NULL;
}

void kvt_cache_free(kvt_cache *c)
{
    if (!c) return;
    for (size_t s = 0; s < c->n_streams; s++) {
        kvt_stream *st = &c->streams[s];
        for (size_t b = 0; st->pages && st->held && b < st->n_blocks; b++) slot_clear(c, st, b);
        free(st->pages);
        free(st->held);
    }
    free(c->spare);
    free(c->streams);
    free(c->state);
    free(c->keys);
    free(c);
}

/* Give stream st's block b its own rows for pages [lo, hi) of it, the
 * rows it reads now kept (a page not written yet: zeros). The block held
 * there now (h) goes on as follows:
 *   - c alone holds it: the new block's own pages are h's and [lo, hi)
 *     (in place when they only grow past h's: realloc), its base h's;
 *   - others hold it too: the new block owns [lo, hi) only and reads the
 *     pages before them from h, its base (c's reference moves there); the
 *     pages after them are not c's any more (nothing read them: the rows
 *     past a session's tokens are never read);
 *   - none: a new block of [lo, hi).
 * An arena's block that empties goes too unless keep. false: no memory,
 * nothing changed. */
static bool own_pages(kvt_cache *c, kvt_stream *st, size_t b, size_t lo, size_t hi, bool keep)
{
    kvt_block *h = st->held[b];
    size_t pb = page_bytes(st), ppb = st->pages_per_block;
    uint8_t **pg = st->pages + b * ppb;
    if (kvt_cache_fault == KVT_CACHE_FAULT_WHOLE_BLOCKS) {
        lo = 0;
        hi = ppb;
    }
    bool alone = h && atomic_load_explicit(&h->refs, memory_order_acquire) == 1;
    if (alone) {
        if (h->from < lo) lo = h->from;
        if (h->from + h->n_pages > hi) hi = h->from + h->n_pages;
    }
    size_t bytes = (hi - lo) * pb;
    if (alone && !h->arena && lo == h->from) { /* grows past its own pages: in place */
        kvt_block *n = realloc(h, ROWS_AT + bytes);
        if (!n) return false;
        memset(own_rows(n) + n->bytes, 0, bytes - n->bytes);
        n->n_pages = (uint32_t)(hi - lo);
        n->bytes = bytes;
        st->held[b] = n;
        for (size_t k = lo; k < hi; k++) pg[k] = own_rows(n) + (k - lo) * pb;
        return true;
    }
    kvt_block *n = kvt_malloc(ROWS_AT + bytes);
    if (!n) return false;
    atomic_init(&n->refs, 1);
    atomic_init(&n->owner, (uintptr_t)c);
    n->arena = NULL;
    n->from = (uint32_t)lo;
    n->n_pages = (uint32_t)(hi - lo);
    n->bytes = bytes;
    for (size_t k = lo; k < hi; k++) {
        if (pg[k]) memcpy(own_rows(n) + (k - lo) * pb, pg[k], pb);
        else memset(own_rows(n) + (k - lo) * pb, 0, pb);
    }
    n->base = NULL;
    if (alone) { /* h goes; its base (which serves [0, lo) as it served [0, h->from)) is n's now */
        if (lo) n->base = h->base;
        else block_let_go(c, h->base, keep); /* its count too: c reaches it no more */
        h->base = NULL;
        block_let_go(c, h, keep);
    } else if (h && lo) { /* c's reference to h is n's */
        n->base = h;
    } else {
        block_let_go(c, h, keep);
    }
    st->held[b] = n;
    for (size_t k = lo; k < ppb; k++) pg[k] = k < hi ? own_rows(n) + (k - lo) * pb : NULL;
    return true;
}

void *kvt_cache_row(kvt_cache *c, size_t s, size_t r)
{
    kvt_stream *st = &c->streams[s];
    size_t b = r / st->rows_per_block;
    if (b >= st->n_blocks) return NULL;
    size_t q = r % st->rows_per_block / st->page_rows;
    kvt_block *h = st->held[b];
    /* copy-on-write: a block another cache holds is never written */
    bool shared = h && atomic_load_explicit(&h->refs, memory_order_acquire) > 1 &&
                  kvt_cache_fault != KVT_CACHE_FAULT_WRITE_SHARED;
    bool mine = h && !shared && q >= h->from && q < (size_t)h->from + h->n_pages;
    if (!mine && !own_pages(c, st, b, q, q + 1, true)) return NULL;
    return st->pages[r / st->page_rows] + (r % st->page_rows) * (size_t)st->row_bytes;
}

void *kvt_cache_block(kvt_cache *c, size_t s, size_t b)
{
    kvt_stream *st = &c->streams[s];
    if (b >= st->n_blocks) return NULL;
    kvt_block *h = st->held[b];
    bool whole = h && h->from == 0 && h->n_pages == st->pages_per_block &&
                 atomic_load_explicit(&h->refs, memory_order_acquire) == 1;
    if (!whole && !own_pages(c, st, b, 0, st->pages_per_block, true)) return NULL;
    return st->pages[b * st->pages_per_block];
}

int kvt_cache_share(kvt_cache *dst, const kvt_cache *src, size_t n_tokens)
{
    if (dst == src) return KVT_OK;
    if (dst->n_streams != src->n_streams || n_tokens > dst->max_tokens || n_tokens > src->max_tokens)
        return kvt_fail(KVT_EINVAL, "share: caches of other shapes, or %zu tokens past one's capacity", n_tokens);
    for (size_t s = 0; s < src->n_streams; s++)
        if (dst->streams[s].row_bytes != src->streams[s].row_bytes ||
            dst->streams[s].rows_per_block != src->streams[s].rows_per_block)
            return kvt_fail(KVT_EINVAL, "share: stream %zu has rows of another shape", s);
    for (size_t s = 0; s < src->n_streams; s++) {
        const kvt_stream *a = &src->streams[s];
        kvt_stream *d = &dst->streams[s];
        size_t blocks = (kvt_cache_rows_for(src, s, n_tokens) + a->rows_per_block - 1) / a->rows_per_block;
        for (size_t b = 0; b < blocks; b++) {
            kvt_block *h = a->held[b];
            if (h == d->held[b]) continue;
            /* src holds it, so it cannot go meanwhile: a relaxed increment */
            if (h) atomic_fetch_add_explicit(&h->refs, 1, memory_order_relaxed);
            block_release(dst, d->held[b]);
            d->held[b] = h;
            memcpy(d->pages + b * d->pages_per_block, a->pages + b * a->pages_per_block,
                   a->pages_per_block * sizeof *d->pages);
        }
    }
    return KVT_OK;
}

void kvt_cache_truncate(kvt_cache *c, size_t n_tokens)
{
    size_t keep = (n_tokens + KVT_BLOCK - 1) / KVT_BLOCK;
    if (c->n_keys > n_tokens / KVT_BLOCK) c->n_keys = n_tokens / KVT_BLOCK;
    for (size_t s = 0; s < c->n_streams; s++) {
        kvt_stream *st = &c->streams[s];
        for (size_t b = keep; b < st->n_blocks; b++)
            if (st->held[b]) slot_clear(c, st, b);
    }
    /* A block of an arena that keeps under a quarter of its blocks gets an
     * allocation of its own when this cache alone holds it, so a long load
     * rolled back to a short prefix does not hold the memory of the long
     * one. A block other caches hold too stays where it is (moving it would
     * copy it): the arena goes once they let it go. */
    for (size_t s = 0; s < c->n_streams; s++) {
        kvt_stream *st = &c->streams[s];
        for (size_t b = 0; b < keep && b < st->n_blocks; b++) {
            kvt_block *h = st->held[b];
            if (!h || !h->arena || atomic_load_explicit(&h->arena->live, memory_order_relaxed) * 4 >= h->arena->count ||
                atomic_load_explicit(&h->refs, memory_order_acquire) != 1)
                continue;
            own_pages(c, st, b, 0, st->pages_per_block, false); /* no memory: it stays in the arena, nothing is lost */
        }
    }
}

#define HUGE_PAGE (2u << 20)

int kvt_cache_reserve(kvt_cache *c, size_t nb)
{
    size_t per_block = 0, bytes, count = 0;
    for (size_t s = 0; s < c->n_streams; s++) {
        const kvt_stream *st = &c->streams[s];
        if (nb > st->n_blocks) return KVT_ENOMEM;
        for (size_t b = 0; b < nb; b++)
            if (st->held[b]) return KVT_EINVAL;
        size_t blk = (size_t)st->rows_per_block * st->row_bytes;
        per_block += blk;
        count += blk ? nb : 0;
    }
    if (!nb || !per_block) return KVT_OK;
    if (!kvt_mul_ok(nb, per_block, &bytes)) return KVT_ENOMEM;
    kvt_arena *a = kvt_calloc(1, sizeof *a + count * sizeof *a->blk);
    if (!a) return KVT_ENOMEM;
    uint8_t *base = NULL;
    if (c->spare && c->spare_bytes < bytes) { /* too small: given back */
        free(c->spare);
        c->spare = NULL;
        c->spare_bytes = 0;
    }
    if (c->spare) { /* pages an earlier load touched */
        base = c->spare;
        bytes = c->spare_bytes;
        c->spare = NULL;
        c->spare_bytes = 0;
    } else if (bytes >= 2 * HUGE_PAGE) {
        /* A large one on huge-page boundaries, so the kernel may back it
         * with 2 MiB pages (one fault each instead of 512) */
        size_t up = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
        if (posix_memalign((void **)&base, HUGE_PAGE, up) == 0) {
#ifdef MADV_HUGEPAGE
            madvise(base, up, MADV_HUGEPAGE);
#endif
            bytes = up;
        } else {
            base = NULL;
        }
    } else {
        base = malloc(bytes);
    }
    if (!base) { free(a); return KVT_ENOMEM; }
    a->base = base;
    a->bytes = bytes;
    a->count = count;
    atomic_init(&a->live, count);
    atomic_init(&a->live_bytes, nb * per_block);
    uint8_t *p = base;
    size_t k = 0;
    for (size_t s = 0; s < c->n_streams; s++) {
        kvt_stream *st = &c->streams[s];
        size_t blk = (size_t)st->rows_per_block * st->row_bytes;
        if (!blk) continue;
        for (size_t b = 0; b < nb; b++, p += blk, k++) {
            kvt_block *h = &a->blk[k];
            atomic_init(&h->refs, 1);
            atomic_init(&h->owner, (uintptr_t)c);
            h->arena = a;
            h->base = NULL;
            h->from = 0;
            h->n_pages = st->pages_per_block;
            h->bytes = blk;
            st->held[b] = h;
            for (size_t k = 0; k < st->pages_per_block; k++) st->pages[b * st->pages_per_block + k] = p + k * page_bytes(st);
        }
    }
    return KVT_OK;
}

size_t kvt_cache_bytes_allocated(const kvt_cache *c)
{
    size_t total = c->state_bytes;
    for (size_t s = 0; s < c->n_streams; s++) {
        const kvt_stream *st = &c->streams[s];
        for (size_t b = 0; b < st->n_blocks; b++)
            for (const kvt_block *h = st->held[b]; h; h = h->base) total += h->bytes;
    }
    return total + c->spare_bytes;
}

/* This cache's part of block h: the memory it stands for (its allocation,
 * or its part of the arena's in proportion to the bytes of the arena's
 * blocks still held) when the block counts in c, else -1. A block counts in
 * one of its holders: the cache that made it, and after that one lets it
 * go, the first holder to count that reaches it through blocks that count
 * in it (which takes it here; the caller asks down a chain only while the
 * blocks count in c). So a session's figure does not move when a copy of
 * it (a save's, a fork) comes or goes, and the blocks that count in a
 * cache are a run from the top of each of its chains (block_let_go). */
static double block_part(const kvt_cache *c, kvt_block *h)
{
    uintptr_t o = atomic_load_explicit(&h->owner, memory_order_acquire), zero = 0;
    if (!o && atomic_compare_exchange_strong(&h->owner, &zero, (uintptr_t)c)) o = (uintptr_t)c;
    if (o != (uintptr_t)c) return -1;
    double mem = (double)(ROWS_AT + h->bytes);
    const kvt_arena *a = h->arena;
    if (a) {
        size_t live = atomic_load_explicit(&a->live_bytes, memory_order_relaxed);
        double whole = (double)a->bytes + (double)(sizeof *a + a->count * sizeof *a->blk);
        mem = live ? whole * (double)h->bytes / (double)live : (double)h->bytes;
    }
    return mem;
}

void kvt_cache_bytes_parts(const kvt_cache *c, kvt_cache_parts *out)
{
    size_t other = sizeof *c + c->state_bytes + c->n_streams * sizeof *c->streams + c->spare_bytes +
                   (c->max_tokens + KVT_BLOCK - 1) / KVT_BLOCK * sizeof *c->keys;
    double whole = 0, pages = 0;
    for (size_t s = 0; s < c->n_streams; s++) {
        const kvt_stream *st = &c->streams[s];
        other += st->n_blocks * (st->pages_per_block * sizeof *st->pages + sizeof *st->held);
        for (size_t b = 0; b < st->n_blocks; b++)
            for (kvt_block *h = st->held[b]; h; h = h->base) {
                double part = block_part(c, h);
                if (part < 0) break; /* the run of c's blocks ends: none below is c's */
                *(h->n_pages == st->pages_per_block ? &whole : &pages) += part;
            }
    }
    *out = (kvt_cache_parts){(size_t)(whole + 0.5), (size_t)(pages + 0.5), other};
}

size_t kvt_cache_bytes_held(const kvt_cache *c)
{
    kvt_cache_parts p;
    kvt_cache_bytes_parts(c, &p);
    return p.whole + p.pages + p.other;
}

void kvt_cache_trim(kvt_cache *c)
{
    free(c->spare);
    c->spare = NULL;
    c->spare_bytes = 0;
}
