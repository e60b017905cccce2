/* kvtier bench --suite fork: what a copy of a session costs (bench_fork.c). */
#ifndef KVT_BENCH_FORK_H
#define KVT_BENCH_FORK_H

#include "kvtier.h"

#include <stdbool.h>
#include <stddef.h>

/* A session of n_tokens tokens (0: 20000) of model (NULL: the default
 * model), its K and V rows in type_k and type_v; the time of
 * kvt_session_clone, best of reps (0: 5), and resident memory with 1, 2, 4,
 * 8 and 16 copies. 0 on success. */
int kvt_bench_fork(const char *model, kvt_row_type type_k, kvt_row_type type_v, size_t n_tokens, unsigned reps);

#endif
