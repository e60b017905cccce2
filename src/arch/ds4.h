/* The ds4 architecture (ds4.c; its weights ds4_weights.c): DeepSeek-V4 as
 * llama.cpp runs it, from a GGUF whose general.architecture is "deepseek4"
 * or from a built-in preset (docs/ds4.md). The model layer reaches it through kvt_arch_ds4 alone;
 * the rest is for its tests. Not part of the public API. */
#ifndef KVT_DS4_H
#define KVT_DS4_H

#include "arch/arch.h"
#include "arch/ds4_weights.h" /* the test hooks, kvt_ds4_write_preset */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

extern const kvt_arch kvt_arch_ds4;

/* Indices of the k best scores (ties: lower index), sorted ascending;
 * scratch holds k + 1 (score, index) pairs. Returns min(n, k). */
size_t kvt_ds4_topk(const float *score, size_t n, size_t k, uint32_t *sel, void *scratch);
/* Passes that ran several sessions' segments together (forward_batch), for
 * the tests that must know the batched pass ran, not the fallback. */
extern _Atomic size_t kvt_ds4_batch_passes;
/* Tokens a ds4 snapshot of n tokens stored without its state replays on
 * load (kvt_arch_ds4.replay_tokens). */
size_t kvt_ds4_replay_tokens(const kvt_model *m, size_t n);
/* The MTP (nextn) layer (DeepSeek-V4's multi-token prediction, one layer
 * after the model's, as llama.cpp's deepseek4 MTP graph runs it):
 * kvt_ds4_mtp_layers is the model's count (0 or 1; 0 for another
 * architecture). A position's hidden state is its final hyper-connection
 * streams (kvt_ds4_hidden_floats floats); the layer's window ring holds
 * kvt_ds4_mtp_window rows, position p at row p mod W (kvt_ds4_mtp_ring_bytes). */
uint32_t kvt_ds4_mtp_layers(const kvt_model *m);
size_t kvt_ds4_hidden_floats(const kvt_model *m);
size_t kvt_ds4_mtp_window(const kvt_model *m);
size_t kvt_ds4_mtp_ring_bytes(const kvt_model *m);
/* The hidden state of position pos from s's last forward pass, when that
 * pass ran pos with the tokens s holds (s's scratch keeps it until the next
 * pass or MTP step): KVT_OK, else KVT_ENOENT (no message). */
int kvt_ds4_hidden(const kvt_session *s, size_t pos, float *out);
/* The MTP layer on s's scratch for the token tok at position pos (its
 * RoPE position and row, as llama.cpp's MTP batches place it) and the
 * hidden state hin of pos - 1 (the model's, or the previous MTP step's
 * hout). Writes the layer's row of pos into ring; row_only: nothing else
 * (the row depends on hin and tok alone). Otherwise the layer's output
 * streams into hout and the logits of the token at pos + 1 into logits
 * (n_vocab). */
int kvt_ds4_mtp_step(kvt_session *s, uint16_t *ring, const float *hin, int32_t tok, size_t pos, bool row_only,
                     float *hout, float *logits);
/* The MTP layer from ds4.c's separate file g (mtp.0.* tensors, docs/ds4.md
 * "ds4.c's files") into m, a model without one (kvt_mtp_ops.attach): every
 * tensor's shape checked against m's. On success m owns g (closed with m);
 * on failure m is as it was and the caller closes g. */
int kvt_ds4_mtp_attach(kvt_model *m, kvt_gguf *g);
/* Write the MTP layer of m (a ds4 model with one) as ds4.c's separate file:
 * its mtp.0.* names, eh_proj as e_proj and h_proj, the head's mixes and
 * norm the layer's own or else the model's (tests: the same layer both
 * ways). */
int kvt_ds4_mtp_write_ds4c(const kvt_model *m, const char *path);
/* Write a ds4 model (config, weights, tokenizer) as GGUF
 * (kvt_arch_ds4.write_gguf). */
int kvt_ds4_write_gguf(const kvt_model *m, const char *path);

#endif
