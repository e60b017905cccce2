/* Independent f64 reference forwards used by the tests. */
#ifndef KVT_TEST_REF_H
#define KVT_TEST_REF_H

#include <stddef.h>
#include <stdint.h>

/* Logits (T, V) for every position of tok[0..T) of the llama GGUF at path,
 * recomputed from scratch in double. *out is malloc'ed. 0 on success. */
int ref_llama_logits(const char *path, const int32_t *tok, size_t T, double **out, uint32_t *n_vocab);

#endif
