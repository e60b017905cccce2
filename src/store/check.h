/* The checks of the disk tier and gc, which mends what they find
 * (check.c). Private to src/store/. */
#ifndef KVT_STORE_CHECK_H
#define KVT_STORE_CHECK_H

#include "store/db.h"

#include <stddef.h>

/* Every record read and checked (kvt_store_verify): *bad damaged of
 * *n_checked, *newer (may be NULL) of a newer format, kept. */
int kvt_check_verify(kvt_store *st, size_t *bad, size_t *n_checked, size_t *newer);
/* SQLite's integrity check (kvt_store_integrity): *problems lines,
 * *report (may be NULL; malloc'ed) their text. */
int kvt_check_integrity(kvt_store *st, size_t *problems, char **report);
/* gc (kvt_store_gc): damaged records removed, references and totals
 * recounted, budget and free space kept, unnamed segment space given back. */
int kvt_check_gc(kvt_store *st);

#endif
