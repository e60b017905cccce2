/* A fixed pool of worker threads for data-parallel loops. kvt_pool_for splits
 * [0, n) into contiguous ranges, one per thread. Kernels never let the split
 * change a result: each output element is computed start to finish by one
 * thread in a fixed order, so any thread count gives identical bytes. */
#ifndef KVT_THREADS_H
#define KVT_THREADS_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvt_pool kvt_pool;
typedef void (*kvt_range_fn)(void *ctx, size_t begin, size_t end);
/* A range with the index of its part, 0 .. kvt_pool_size() - 1: each part
 * runs on one thread, so a part may use scratch of its own. */
typedef void (*kvt_part_fn)(void *ctx, uint32_t part, size_t begin, size_t end);

/* n_threads 0: all online cores. NULL on failure. */
kvt_pool *kvt_pool_new(uint32_t n_threads);
void kvt_pool_free(kvt_pool *p);
uint32_t kvt_pool_size(const kvt_pool *p);
/* Run fn over [0, n) on all threads (the caller is one of them); returns when
 * every range is done, with how many ranges it ran as (1: unsplit). Ranges
 * smaller than min_per_thread are not split. Several threads may call on
 * one pool: while the workers run one caller's job, another's ranges run
 * one after another on its own thread (the same ranges and parts). */
uint32_t kvt_pool_for(kvt_pool *p, size_t n, size_t min_per_thread, kvt_range_fn fn, void *ctx);
/* The same, telling each range its part. */
uint32_t kvt_pool_for_part(kvt_pool *p, size_t n, size_t min_per_thread, kvt_part_fn fn, void *ctx);
/* How many ranges the latest kvt_pool_for on p that had its workers ran as
 * (1: unsplit), so tests can show that a split happened. */
uint32_t kvt_pool_last_parts(const kvt_pool *p);
uint32_t kvt_ncpu(void);

#endif
