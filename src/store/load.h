/* Loading a stored snapshot into a session, and restoring a prompt's
 * longest stored prefix (load.c). Private to src/store/. */
#ifndef KVT_STORE_LOAD_H
#define KVT_STORE_LOAD_H

#include "store/db.h"

#include <stddef.h>
#include <stdint.h>

/* Load snapshot id into s (kvt_store_load, under the store's lock). */
int kvt_load_entry(kvt_store *st, int64_t id, kvt_session *s);
/* Restore the longest prefix of tokens the store holds into s; found: the
 * entry a lookup of these tokens found already (found_match tokens,
 * found_id; -1: none), loaded without a second lookup while it serves.
 * *reused: the tokens restored (0: a miss). */
int kvt_load_restore_prefix(kvt_store *st, kvt_session *s, const int32_t *tokens, size_t n, size_t found_match,
                            int64_t found_id, size_t *reused);

#endif
