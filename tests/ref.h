/* Independent f64 reference forwards used by the tests. */
#ifndef KVT_TEST_REF_H
#define KVT_TEST_REF_H

#include <stddef.h>
#include <stdint.h>

/* Logits (T, V) for every position of tok[0..T) of the llama GGUF at path,
 * recomputed from scratch in double. *out is malloc'ed. 0 on success. */
int ref_llama_logits(const char *path, const int32_t *tok, size_t T, double **out, uint32_t *n_vocab);

/* Logits (T, V) in double for every position of tok[0..T) of the DeepSeek-V4
 * GGUF (llama.cpp's `deepseek4` layout) at path, recomputed from scratch.
 * When ambiguous is non-NULL (T bytes), ambiguous[t] is set to 1 when at
 * position t some ratio-4 layer's indexer top-k selection, or some non-hash
 * layer's expert routing (probs + bias), had a margin below 1e-6 relative
 * between the K-th and (K+1)-th best score (relative to the magnitude of the
 * terms summed into them, so a tiny f32-vs-f64 difference could select a
 * different row or expert; tests skip those positions), else 0. A different
 * pick at t reaches later positions through the layers after it, so a flag
 * raised in a layer that is not the last also marks every position after t.
 * *out (T, V) is malloc'ed and owned by the caller. Returns 0 on success, -1
 * on failure (T = 0, a token out of range, an unreadable or malformed file). */
int ref_ds4_logits(const char *path, const int32_t *tok, size_t T, double **out,
                   uint32_t *n_vocab, unsigned char *ambiguous);

#endif
