/* Internal hooks of the disk tier (the public API is in kvtier.h). */
#ifndef KVT_STORE_H
#define KVT_STORE_H

#include "kvtier.h"

/* Cap the database at `pages` pages and each segment at as many 4 KiB, so
 * writes fail as on a full disk (tests of the save error path). */
int kvt_store_limit_pages(kvt_store *st, uint32_t pages);

/* kvt_store_save that also says whether a new entry was written (false
 * when an identical one was already stored). */
int kvt_store_save_new(kvt_store *st, kvt_session *s, size_t n, const char *reason, int64_t *id, bool *created);

/* Commit without waiting for the disk (populating a benchmark store only). */
int kvt_store_set_synchronous(kvt_store *st, bool on);

/* The running totals as recorded (what kvt_store_stats_get reports) and as
 * the tables add up to (snapshots, blocks, block_refs and bytes of each;
 * the other fields zero). Tests: the two agree after every commit. */
int kvt_store_totals(kvt_store *st, kvt_store_stats *recorded, kvt_store_stats *counted);

/* Tests: true skips keeping free space before a save and the retry after a
 * full disk (the negative control of tests/test_store_hostile.c), and the
 * seconds between two reports of failed saves (60). */
extern bool kvt_store_room_fault;
extern double kvt_store_report_every;

/* The disk tier's benchmark suite (bench_store.c); 0 on success. */
int kvt_bench_store(const char *csv_path, bool quick);

#endif
