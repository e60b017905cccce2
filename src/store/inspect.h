/* What the disk tier holds, read for a person (inspect.c). Private to
 * src/store/. */
#ifndef KVT_STORE_INSPECT_H
#define KVT_STORE_INSPECT_H

#include "store/db.h"

#include <stddef.h>
#include <stdint.h>

/* kvt_store_stats_get, kvt_store_list and kvt_store_text under the store's
 * lock. */
int kvt_inspect_stats(kvt_store *st, kvt_store_stats *o);
int kvt_inspect_list(kvt_store *st, kvt_store_entry **out, size_t *n);
int kvt_inspect_text(kvt_store *st, int64_t id, char **text, size_t *len);

#endif
