/* Hooks of the store layer for the tests: not part of the library's
 * interface (kvtier.h). */
#ifndef KVT_STORE_TESTING_H
#define KVT_STORE_TESTING_H

#include "kvtier.h"

/* Silence the one-line stderr reports of damaged entries and rebuilt
 * databases. */
void kvt_store_set_quiet(kvt_store *st, bool quiet);

/* Hold the store (on) as a long save does, until released (off), from the
 * same thread. */
void kvt_store_hold(kvt_store *st, bool on);

#endif
