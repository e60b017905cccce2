/* Lookup in the disk tier (lookup.c): the index of every snapshot's
 * (head key, length, tail hash) and the longest stored prefix of a
 * prompt. Private to src/store/. */
#ifndef KVT_STORE_LOOKUP_H
#define KVT_STORE_LOOKUP_H

#include "store/db.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A snapshot this process committed joins the index in place. */
void kvt_lookup_index_add(kvt_store *st, ientry e);
/* Whether snapshot id is passed over (of a newer format than this build
 * reads: st->skip, the last 64). */
bool kvt_lookup_skipped(const kvt_store *st, int64_t id);
/* The longest stored prefix of tokens[0..n) (*match tokens, *id; 0 and -1:
 * none); longer: also a record that goes on past them within their last
 * block, its first ids theirs (for a model whose rows are per token). */
int kvt_lookup_find(kvt_store *st, const kvt_model *m, const int32_t *tokens, size_t n, bool longer, size_t *match,
                    int64_t *id);

#endif
