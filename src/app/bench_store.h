/* The disk tier's benchmark suite (kvtier bench --store). */
#ifndef KVT_BENCH_STORE_H
#define KVT_BENCH_STORE_H

#include "kvtier.h"

#include <stdbool.h>
#include <stddef.h>

/* Writes one CSV row per measurement to csv_path; quick: the short form
 * CI runs. model NULL: every part on ds4-mini (and ds4-tiny); else the
 * first part only (prefill, persist, bytes, loads) on that model, with its
 * K and V rows in type_k and type_v, over n_tokens tokens (0: the default).
 * 0 on success. */
int kvt_bench_store(const char *csv_path, bool quick, const char *model, kvt_row_type type_k, kvt_row_type type_v,
                    size_t n_tokens);

#endif
