/* The disk tier's benchmark suite (kvtier bench --store). */
#ifndef KVT_BENCH_STORE_H
#define KVT_BENCH_STORE_H

#include <stdbool.h>

/* Writes one CSV row per measurement to csv_path; quick: the short form
 * CI runs. 0 on success. */
int kvt_bench_store(const char *csv_path, bool quick);

#endif
