/* In-RAM KV cache: row streams paged in 128-token blocks. See cache.h.
 *
 * Why blocks and not one array per stream: a block is the unit the disk tier
 * addresses by the token prefix it closes, and the unit that compressed
 * layers complete (32 ratio-4 rows or 1 ratio-128 row per 128 tokens). Growing
 * a session never moves existing rows, so readers may hold row pointers for
 * the duration of a forward pass. */
#include "cache.h"
#include "util.h"

#include <stdlib.h>

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

void kvt_cache_free(kvt_cache *c)
{
    if (!c) return;
    for (size_t s = 0; s < c->n_streams; s++) {
        kvt_stream *st = &c->streams[s];
        if (!st->blocks) continue;
        for (size_t b = 0; b < st->n_blocks; b++) free(st->blocks[b]);
        free(st->blocks);
    }
    free(c->streams);
    free(c->state);
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
    for (size_t s = 0; s < c->n_streams; s++) {
        kvt_stream *st = &c->streams[s];
        for (size_t b = keep; b < st->n_blocks; b++) { free(st->blocks[b]); st->blocks[b] = NULL; }
    }
}

size_t kvt_cache_bytes_allocated(const kvt_cache *c)
{
    size_t total = c->state_bytes;
    for (size_t s = 0; s < c->n_streams; s++) {
        const kvt_stream *st = &c->streams[s];
        for (size_t b = 0; b < st->n_blocks; b++)
            if (st->blocks[b]) total += (size_t)st->rows_per_block * st->row_bytes;
    }
    return total;
}
