/* Hooks of the store layer for the tests: not part of the library's
 * interface (kvtier.h). */
#ifndef KVT_STORE_TESTING_H
#define KVT_STORE_TESTING_H

#include "kvtier.h"

#include <stdbool.h>

/* Silence the one-line stderr reports of damaged entries and rebuilt
 * databases. */
void kvt_store_set_quiet(kvt_store *st, bool quiet);

/* Hold the store (on) as a long save does, until released (off), from the
 * same thread. */
void kvt_store_hold(kvt_store *st, bool on);

/* True skips keeping free space before a save and the retry after a full
 * disk (the negative control of tests/test_store_hostile.c; evict.c,
 * save.c), and the seconds between two reports of failed saves (60;
 * save.c). */
extern bool kvt_store_room_fault;
extern double kvt_store_report_every;
/* True takes a record longer than a prompt for it without reading its ids
 * (the negative control of tests/test_store.c's store_longer_record_*;
 * lookup.c). */
extern bool kvt_store_tail_ids_fault;
/* True makes a save copy each block's record whole before writing it
 * (kvt_snap_block), instead of writing the rows from where they lie (the
 * negative control of tests/test_store.c's store_save_rows_in_place;
 * save.c). */
extern bool kvt_store_fault_copy_rows;

#endif
