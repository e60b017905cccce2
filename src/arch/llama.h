/* The llama family (llama.c): llama, qwen2, qwen3, qwen3moe, qwen35,
 * qwen35moe, gemma3 and gemma4 from their GGUF files. The model layer
 * reaches it through kvt_arch_llama alone; the rest is for its tests. Not
 * part of the public API. */
#ifndef KVT_LLAMA_H
#define KVT_LLAMA_H

#include "arch/arch.h"

extern const kvt_arch kvt_arch_llama;


/* Test hooks of the llama family, to show a test catches such bugs:
 * KVT_LLAMA_FAULT_ROPE_PAIRS turns NEOX heads (qwen2, qwen3) on adjacent
 * pairs, as llama's; KVT_LLAMA_FAULT_MOE_WEIGHTS leaves the chosen experts'
 * weights unnormalised (qwen3moe); KVT_LLAMA_FAULT_NO_WINDOW lets gemma3's
 * window layers see every position (their rows kept in full, as a global
 * layer's; set before the model is loaded); KVT_LLAMA_FAULT_RING restores
 * a window ring with its oldest K value off by one; gemma4's:
 * KVT_LLAMA_FAULT_OWN_KV lets the shared layers compute and keep K and V
 * of their own, from the attn_k and attn_v a file may still hold for them
 * (set before loading); KVT_LLAMA_FAULT_NO_PLE leaves the per-layer
 * embeddings out; KVT_LLAMA_FAULT_V_NORM_WEIGHT norms V with attn_k_norm's
 * weight; KVT_LLAMA_FAULT_GDN_GROUPED pairs a DeltaNet layer's V head h
 * with K head h / (Hv / Hk), not h % Hk (the converter's tiled order);
 * KVT_LLAMA_FAULT_BATCH_POS turns the tokens of a batched pass of several
 * segments by their place in the pass, not their positions;
 * KVT_LLAMA_FAULT_WINDOW_CHUNK starts every token's window at the one of
 * its pass's first token (gemma3's window anchored to the chunk);
 * KVT_LLAMA_FAULT_SOURCE_RING_EARLY writes gemma4's shared layers' source
 * ring right after its own layer, before the shared layers read it. */
enum { KVT_LLAMA_FAULT_NONE, KVT_LLAMA_FAULT_ROPE_PAIRS, KVT_LLAMA_FAULT_MOE_WEIGHTS, KVT_LLAMA_FAULT_NO_WINDOW,
       KVT_LLAMA_FAULT_RING, KVT_LLAMA_FAULT_OWN_KV, KVT_LLAMA_FAULT_NO_PLE, KVT_LLAMA_FAULT_V_NORM_WEIGHT,
       KVT_LLAMA_FAULT_GDN_GROUPED, KVT_LLAMA_FAULT_BATCH_POS, KVT_LLAMA_FAULT_WINDOW_CHUNK,
       KVT_LLAMA_FAULT_SOURCE_RING_EARLY };
extern int kvt_llama_fault;

#endif
