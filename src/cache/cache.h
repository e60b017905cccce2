/* The in-RAM KV cache.
 *
 * Storage is organised on one grid for every architecture: 128-token blocks
 * (lcm(4, 128), so ds4's ratio-4 and ratio-128 compression both tile a block
 * exactly). A cache is a set of row streams; a stream holds fixed-size rows
 * and a block of 128 tokens contributes `rows_per_block` rows to it (128 for
 * llama's full K and V rows; 32 and 1 for ds4's compressed rows). Each block
 * has its own row memory (its own allocation, or its part of the one a
 * snapshot load makes for all the blocks it restores), so whole blocks can
 * be addressed, shared and persisted by the token prefix they cover.
 *
 * Inside a block, rows are addressed in pages of KVT_PAGE tokens (16 rows
 * of a stream with 128 rows per block; a stream with fewer rows per block
 * than that has one page per block). A block a session writes has rows of
 * its own for the pages it wrote only, and grows a page at a time: a
 * session's partial last block holds the pages its tokens reach, not 128
 * tokens' worth. A session that writes into a block it shares (its own
 * turn starting inside a shared prompt's last block) copies the page it
 * writes, not the block: its new block reads the pages before that one
 * from the shared block, which it holds as its base.
 *
 * Next to the streams, a cache holds a fixed-size state area whose size does
 * not depend on the context: ds4's sliding-window ring and the frontier (the
 * pooling inputs of compressed blocks not yet complete).
 *
 * The cache does not know what a row means; the architecture does. It only
 * guarantees that rows for tokens [0, n) stay put until truncated, and that
 * truncation frees whole blocks past the new end.
 */
#ifndef KVT_CACHE_H
#define KVT_CACHE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVT_BLOCK 128
#define KVT_PAGE 16  /* tokens per page: the step a block's own rows grow by */

typedef struct kvt_arena kvt_arena;

/* The rows of one block of one stream, shared by reference between caches.
 * The last cache to let it go frees it: its own allocation (the rows follow
 * this header) or its part of an arena. Its own rows are those of pages
 * [from, from + n_pages) of the block; the pages before them are read from
 * base (when from > 0 and they were written), the pages after them are not
 * written yet. */
typedef struct kvt_block {
    atomic_size_t refs;      /* caches and blocks (as base) holding it; > 1: nobody writes it */
    atomic_uintptr_t owner;  /* the cache it counts in (kvt_cache_bytes_held); 0: none yet */
    kvt_arena *arena;        /* the arena its rows are carved from, NULL: its own allocation */
    struct kvt_block *base;  /* the block pages [0, from) are read from, held by reference; NULL: none */
    uint32_t from, n_pages;  /* its own pages: [from, from + n_pages) */
    size_t bytes;            /* its own rows' bytes: n_pages pages */
} kvt_block;

/* The rows of a block with its own allocation start this far past its
 * header (a multiple of 16, as malloc aligns). */
#define KVT_BLOCK_ROWS_AT 64

/* One allocation holding the blocks of several streams (kvt_cache_reserve):
 * freed when no cache holds any block in it, whichever cache that is (it
 * outlives the cache that made it when a copy holds some of its blocks). */
struct kvt_arena {
    uint8_t *base;
    size_t bytes, count;     /* of memory; blocks carved from it */
    atomic_size_t live;      /* its blocks some cache still holds, of count */
    atomic_size_t live_bytes;/* their rows' bytes */
    kvt_block blk[];         /* (count) the headers of its blocks */
};

typedef struct kvt_stream {
    uint32_t row_bytes;      /* bytes of one row */
    uint32_t rows_per_block; /* rows one 128-token block contributes: divides 128 */
    uint32_t page_rows;      /* rows of one page: rows_per_block * KVT_PAGE / 128, at least 1 */
    uint32_t pages_per_block;/* rows_per_block / page_rows */
    size_t n_blocks;         /* allocated block slots */
    uint8_t **pages;         /* (n_blocks * pages_per_block) -> (page_rows, row_bytes) or NULL */
    kvt_block **held;        /* (n_blocks) -> the block whose pages these are (NULL: none) */
} kvt_stream;

typedef struct kvt_cache {
    size_t n_streams;
    kvt_stream *streams;     /* (n_streams) */
    uint8_t *spare;          /* the largest arena this cache emptied (NULL: none), kept for
                                its next kvt_cache_reserve: a live session's next load
                                writes into pages it has touched, not fresh ones */
    size_t spare_bytes;
    size_t max_tokens;       /* capacity in tokens (the context) */
    uint8_t *state;          /* (state_bytes) fixed-size state: window rings, frontiers */
    size_t state_bytes;
    /* Set by a snapshot load that leaves the state to be rebuilt by replay
     * (snapshot.c): the XXH3-64 the rebuilt state's canonical bytes must
     * have. Cleared once checked and whenever the session is emptied. */
    bool state_check;
    uint64_t state_digest;
    /* The chained keys of the first n_keys blocks of the tokens held
     * (snapshot.c fills them as a save or a lookup of the session needs
     * them, kvt_snap_keys), so that one save computes them once. Room for
     * every block of the context; a truncation drops the keys of the
     * blocks it cuts, so a key is never kept for tokens the session no
     * longer holds. */
    uint64_t *keys;          /* (max_tokens / KVT_BLOCK) */
    size_t n_keys;
    int key_scope;           /* the chain they are of (kvt_key_scope, snapshot.h; 0: the records') */
} kvt_cache;

/* spec[i] = {row_bytes, rows_per_block} for each stream, plus state_bytes of
 * fixed state (zeroed). NULL on failure. */
kvt_cache *kvt_cache_new(size_t n_streams, const uint32_t (*spec)[2], size_t max_tokens,
                         size_t state_bytes);
/* Lets go of every block (a block another cache holds stays with it). */
void kvt_cache_free(kvt_cache *c);
/* Row r of stream s for writing: allocates its page on first use (the
 * block's own rows grow by a page), and gives the cache its own copy of a
 * page of a block another cache holds too before anything writes it (NULL:
 * out of memory or r past capacity). Every write of rows goes through here
 * or kvt_cache_block. */
void *kvt_cache_row(kvt_cache *c, size_t s, size_t r);
/* Block b of stream s whole for writing: its rows_per_block rows in one
 * piece, its own (NULL: out of memory or b past capacity). */
void *kvt_cache_block(kvt_cache *c, size_t s, size_t b);
/* Block b of stream s whole for reading when its rows are in one piece (a
 * block of its own with every page: kvt_cache_reserve's, a full block),
 * else NULL. */
static inline const void *kvt_cache_block_ro(const kvt_cache *c, size_t s, size_t b)
{
    const kvt_stream *st = &c->streams[s];
    const kvt_block *h = b < st->n_blocks ? st->held[b] : NULL;
    return h && h->from == 0 && h->n_pages == st->pages_per_block ? st->pages[b * st->pages_per_block] : NULL;
}
/* Make dst hold src's blocks of tokens [0, n_tokens) by reference (the
 * blocks dst held there are let go): no row is copied. The caches must be
 * of the same shape (KVT_EINVAL otherwise); dst's capacity must cover
 * n_tokens. The state, keys and everything else are the caller's. */
int kvt_cache_share(kvt_cache *dst, const kvt_cache *src, size_t n_tokens);
/* Give blocks [0, nb) of every stream their memory in one allocation,
 * uninitialised: the caller (a snapshot load) writes every byte of them
 * before they are used, or truncates them away. The blocks must not exist
 * yet. One allocation instead of one per block and stream: fewer calls, and
 * its pages are faulted in as one run (huge pages where the kernel gives
 * them). Blocks freed later go one by one as before; the allocation goes
 * with the last of them. KVT_ENOMEM, or KVT_OK. */
int kvt_cache_reserve(kvt_cache *c, size_t nb);
/* Row r of stream s for reading; the row must have been written. */
static inline const void *kvt_cache_row_ro(const kvt_cache *c, size_t s, size_t r)
{
    const kvt_stream *st = &c->streams[s];
    return st->pages[r / st->page_rows] + (r % st->page_rows) * (size_t)st->row_bytes;
}
/* The first row past row r of stream s that does not follow it in memory
 * (rows are contiguous within a page). */
static inline size_t kvt_cache_run_end(const kvt_cache *c, size_t s, size_t r)
{
    const kvt_stream *st = &c->streams[s];
    return (r / st->page_rows + 1) * st->page_rows;
}
/* Rows of stream s that cover tokens [0, n_tokens). */
static inline size_t kvt_cache_rows_for(const kvt_cache *c, size_t s, size_t n_tokens)
{
    return n_tokens * c->streams[s].rows_per_block / KVT_BLOCK;
}
/* Keep tokens [0, n_tokens): let go of blocks that lie wholly past them.
 * The blocks kept stay put, except those of an arena left under a quarter
 * held (by any cache) that this cache alone holds: they move to
 * allocations of their own (rows are addressed through the block table,
 * never held across a truncation). */
void kvt_cache_truncate(kvt_cache *c, size_t n_tokens);
/* Bytes of the rows the cache holds (of its blocks and their bases, shared
 * or not), its state and its spare arena. */
size_t kvt_cache_bytes_allocated(const kvt_cache *c);
/* This cache's part of the RAM the caches hold: the state, the block
 * tables, the spare arena, the cache itself, and the blocks that count in
 * it: a block counts in full in one of the caches that hold it, the one
 * that made it, and once that one lets it go, the first other holder to
 * ask that reaches it through blocks that count in it (a block in an arena counts its part of the arena, the blocks no
 * cache holds any more included). Summed over every cache, each block
 * counts once; a cache's figure does not move when a copy of it comes or
 * goes. */
size_t kvt_cache_bytes_held(const kvt_cache *c);
/* kvt_cache_bytes_held by kind: the blocks that count in c with every
 * page (whole: a full block), those with fewer (pages: a partial block's
 * own pages, a page copied from a shared block), and the rest (tables,
 * state, keys, spare arena). The three sum to kvt_cache_bytes_held. */
typedef struct kvt_cache_parts {
    size_t whole, pages, other;
} kvt_cache_parts;
void kvt_cache_bytes_parts(const kvt_cache *c, kvt_cache_parts *out);
/* Give the spare arena back (a cache that waits, not loading). */
void kvt_cache_trim(kvt_cache *c);

/* For tests: KVT_CACHE_FAULT_WRITE_SHARED makes kvt_cache_row write into a
 * block other caches hold (no copy-on-write), to show that the tests of
 * shared blocks catch it; KVT_CACHE_FAULT_FREE_SHARED makes a cache that
 * lets go of a block of its own allocation free it whoever else holds it
 * (a use after free under ASan, tests/test_tiers.c);
 * KVT_CACHE_FAULT_WHOLE_BLOCKS makes every block a writer owns a whole
 * one (all its pages, a shared one copied whole: the cache before pages),
 * to show that tests/test_tiers.c's count of a conversation's own bytes
 * catches it; KVT_CACHE_FAULT_FULL_WALK makes a let-go walk the whole
 * chain of bases (as before it stopped where the blocks counting in the
 * cache end), to show that tests/test_cache.c's count of the links catches
 * it. 0: none. */
enum { KVT_CACHE_FAULT_WRITE_SHARED = 1, KVT_CACHE_FAULT_FREE_SHARED = 2, KVT_CACHE_FAULT_WHOLE_BLOCKS = 3,
       KVT_CACHE_FAULT_FULL_WALK = 4 };
extern int kvt_cache_fault;
/* Tests: the links (blocks of a chain of bases) the calling thread's
 * let-gos of blocks have visited so far. */
unsigned long kvt_cache_links_walked(void);

#endif
