/* Hooks of the session layer for the tests (tests/test_llama.c,
 * tests/test_ds4.c): not part of the library's interface (kvtier.h). */
#ifndef KVT_SESSION_TESTING_H
#define KVT_SESSION_TESTING_H

#include "kvtier.h"

/* kvt_session_sync with an explicit chunk schedule for the prefill (sizes
 * cycled; chunks NULL: the session's chunk): proves that logits and cache
 * bytes do not depend on it. */
int kvt_session_sync_chunks(kvt_session *s, const int32_t *tokens, size_t n,
                            const uint32_t *chunks, size_t n_chunks, size_t *reused);

#endif
