/* In-RAM KV cache: row streams paged in 128-token blocks. See cache.h.
 *
 * Why blocks and not one array per stream: a block is the unit the disk tier
 * addresses by the token prefix it closes, and the unit that compressed
 * layers complete (32 ratio-4 rows or 1 ratio-128 row per 128 tokens). Growing
 * a session never moves existing rows, so readers may hold row pointers for
 * the duration of a forward pass. */
#include "cache/cache.h"
#include "base/util.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

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
        st->blocks = kvt_calloc(n_blocks ? n_blocks : 1, sizeof *st->blocks);
        if (!st->blocks || !st->rows_per_block || KVT_BLOCK % st->rows_per_block) {
            kvt_cache_free(c);
            return NULL;
        }
    }
    return c;
}

/* Free one block: its own allocation, or its share of an arena. */
static void block_free(kvt_cache *c, uint8_t *p)
{
    if (!p) return;
    for (size_t i = 0; i < c->n_arenas; i++) {
        kvt_arena *a = &c->arenas[i];
        if (p >= a->base && p < a->base + a->bytes) {
            if (--a->live == 0) {
                /* the largest emptied arena stays for the next load */
                if (!c->spare.base || a->bytes > c->spare.bytes) {
                    free(c->spare.base);
                    c->spare = (kvt_arena){a->base, a->bytes, 0, 0};
                } else {
                    free(a->base);
                }
                c->arenas[i] = c->arenas[--c->n_arenas];
            }
            return;
        }
    }
    free(p);
}

void kvt_cache_free(kvt_cache *c)
{
    if (!c) return;
    for (size_t s = 0; s < c->n_streams; s++) {
        kvt_stream *st = &c->streams[s];
        if (!st->blocks) continue;
        for (size_t b = 0; b < st->n_blocks; b++) block_free(c, st->blocks[b]);
        free(st->blocks);
    }
    for (size_t i = 0; i < c->n_arenas; i++) free(c->arenas[i].base);
    free(c->arenas);
    free(c->spare.base);
    free(c->streams);
    free(c->state);
    free(c->keys);
    free(c);
}

void *kvt_cache_row(kvt_cache *c, size_t s, size_t r)
{
    kvt_stream *st = &c->streams[s];
    size_t b = r / st->rows_per_block;
    if (b >= st->n_blocks) return NULL;
    if (!st->blocks[b]) {
        st->blocks[b] = kvt_calloc(st->rows_per_block, st->row_bytes);
        if (!st->blocks[b]) return NULL;
    }
    return st->blocks[b] + (r % st->rows_per_block) * (size_t)st->row_bytes;
}

void kvt_cache_truncate(kvt_cache *c, size_t n_tokens)
{
    size_t keep = (n_tokens + KVT_BLOCK - 1) / KVT_BLOCK;
    if (c->n_keys > n_tokens / KVT_BLOCK) c->n_keys = n_tokens / KVT_BLOCK;
    for (size_t s = 0; s < c->n_streams; s++) {
        kvt_stream *st = &c->streams[s];
        for (size_t b = keep; b < st->n_blocks; b++) { block_free(c, st->blocks[b]); st->blocks[b] = NULL; }
    }
    /* An arena that keeps under a quarter of its blocks gives them their own
     * allocations and goes, so a long load rolled back to a short prefix
     * does not hold the memory of the long one. */
    for (size_t i = 0; i < c->n_arenas;) {
        kvt_arena *a = &c->arenas[i];
        if (a->live * 4 >= a->count) { i++; continue; }
        bool moved = true;
        for (size_t s = 0; s < c->n_streams && moved; s++) {
            kvt_stream *st = &c->streams[s];
            size_t blk = (size_t)st->rows_per_block * st->row_bytes;
            for (size_t b = 0; b < st->n_blocks && moved; b++) {
                uint8_t *p = st->blocks[b];
                if (!p || p < a->base || p >= a->base + a->bytes) continue;
                uint8_t *q = malloc(blk);
                if (!q) { moved = false; break; } /* keep the arena: nothing is lost */
                memcpy(q, p, blk);
                st->blocks[b] = q;
                a->live--;
            }
        }
        if (a->live == 0) {
            free(a->base);
            c->arenas[i] = c->arenas[--c->n_arenas];
        } else {
            i++;
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
            if (st->blocks[b]) return KVT_EINVAL;
        per_block += (size_t)st->rows_per_block * st->row_bytes;
    }
    if (!nb || !per_block) return KVT_OK;
    if (!kvt_mul_ok(nb, per_block, &bytes)) return KVT_ENOMEM;
    kvt_arena *g = realloc(c->arenas, (c->n_arenas + 1) * sizeof *g);
    if (!g) return KVT_ENOMEM;
    c->arenas = g;
    uint8_t *base = NULL;
    if (c->spare.base && c->spare.bytes < bytes) { /* too small: given back */
        free(c->spare.base);
        c->spare = (kvt_arena){0};
    }
    if (c->spare.base) { /* pages an earlier load touched */
        base = c->spare.base;
        bytes = c->spare.bytes;
        c->spare = (kvt_arena){0};
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
    if (!base) return KVT_ENOMEM;
    c->arenas[c->n_arenas++] = (kvt_arena){base, bytes, 0, 0};
    uint8_t *p = base;
    for (size_t s = 0; s < c->n_streams; s++) {
        kvt_stream *st = &c->streams[s];
        size_t blk = (size_t)st->rows_per_block * st->row_bytes;
        if (!blk) continue;
        for (size_t b = 0; b < nb; b++, p += blk, count++) st->blocks[b] = p;
    }
    c->arenas[c->n_arenas - 1].live = c->arenas[c->n_arenas - 1].count = count;
    return KVT_OK;
}

size_t kvt_cache_bytes_allocated(const kvt_cache *c)
{
    size_t total = c->state_bytes;
    for (size_t s = 0; s < c->n_streams; s++) {
        const kvt_stream *st = &c->streams[s];
        for (size_t b = 0; b < st->n_blocks; b++)
            if (st->blocks[b]) total += (size_t)st->rows_per_block * st->row_bytes;
    }
    return total + c->spare.bytes;
}

size_t kvt_cache_bytes_held(const kvt_cache *c)
{
    size_t total = sizeof *c + c->state_bytes + c->n_streams * sizeof *c->streams + c->spare.bytes +
                   (c->max_tokens + KVT_BLOCK - 1) / KVT_BLOCK * sizeof *c->keys;
    for (size_t i = 0; i < c->n_arenas; i++) total += c->arenas[i].bytes + sizeof *c->arenas;
    for (size_t s = 0; s < c->n_streams; s++) {
        const kvt_stream *st = &c->streams[s];
        total += st->n_blocks * sizeof *st->blocks;
        for (size_t b = 0; b < st->n_blocks; b++) {
            const uint8_t *p = st->blocks[b];
            bool in_arena = false;
            for (size_t i = 0; p && i < c->n_arenas && !in_arena; i++)
                in_arena = p >= c->arenas[i].base && p < c->arenas[i].base + c->arenas[i].bytes;
            if (p && !in_arena) total += (size_t)st->rows_per_block * st->row_bytes;
        }
    }
    return total;
}

void kvt_cache_trim(kvt_cache *c)
{
    free(c->spare.base);
    c->spare = (kvt_arena){0};
}
