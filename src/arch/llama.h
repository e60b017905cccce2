/* The llama family (llama.c): llama, qwen2, qwen3, qwen3moe, qwen35,
 * qwen35moe, gemma3 and gemma4 from their GGUF files. The model layer
 * reaches it through kvt_arch_llama alone; the rest is for its tests. Not
 * part of the public API. */
#ifndef KVT_LLAMA_H
#define KVT_LLAMA_H

#include "arch/arch.h"
#include "arch/llama_weights.h" /* the test hooks */

extern const kvt_arch kvt_arch_llama;


#endif
