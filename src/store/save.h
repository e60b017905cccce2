/* Saving a session's prefix into the disk tier (save.c). Private to
 * src/store/. */
#ifndef KVT_STORE_SAVE_H
#define KVT_STORE_SAVE_H

#include "store/db.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Save tokens [0, n) of s (kvt_store_save_new, under the store's lock):
 * *id_out the entry, *created whether it is new (both may be NULL). */
int kvt_save_entry(kvt_store *st, kvt_session *s, size_t n, const char *reason, int64_t *id_out, bool *created);

#endif
