/* Synthetic models of the llama family (src/llama.c) for the tests: the
 * peer-logits tests compare them with llama.cpp (tests/test_peer_logits.c),
 * the invariance tests run them under every chunk schedule and thread
 * count (tests/test_llama.c).
 *
 * The model: dim 256, 4 layers, 4 heads, 2 KV heads (head dim 64 unless the
 * family says otherwise), SwiGLU FFN of 512 (or 8 experts of 128, 2 per
 * token), context 2048, an output matrix of its own, and the 32000-token
 * vocabulary of the vocabulary file given (every tokenizer.* key copied).
 * Every row is a multiple of 256 long, so the K-quants and IQ4_XS apply to
 * every matrix. Weights are N(0, 0.02) from the seed, except attn_q and
 * attn_k at N(0, 0.08): at 0.02 the attention scores of random weights
 * spread by about 0.1, the softmax is nearly uniform and position hardly
 * matters; at 0.08 they spread by about 1.6. Norms are 1.0 (the family's
 * own norms 1 + N(0, 0.3)). Every hyperparameter kvtier reads is written
 * explicitly, so llama.cpp and kvtier run the same shape, epsilon and RoPE. */
#ifndef KVT_TEST_SYNTH_FAMILY_H
#define KVT_TEST_SYNTH_FAMILY_H

#include <stdbool.h>
#include <stdint.h>

enum { FAM_DIM = 256, FAM_LAYERS = 4, FAM_HEADS = 4, FAM_KV_HEADS = 2, FAM_HEAD_DIM = FAM_DIM / FAM_HEADS,
       FAM_FFN = 512, FAM_CTX = 2048, FAM_VOCAB = 32000 };
enum { FAM_MOE_E = 8, FAM_MOE_EU = 2, FAM_MOE_F = 128, FAM_GEMMA_SWA = 64 };
#define FAM_EPS 1e-5f
#define FAM_ROPE_BASE 10000.0f
#define FAM_GEMMA_BASE_SWA 1000.0f
#define FAM_SIGMA 0.02
#define FAM_SIGMA_QK 0.08
#define FAM_SIGMA_BIAS 0.5   /* large against q and k of N(0, ~1): a bias left out moves the logits */
#define FAM_SIGMA_NORM 0.3
#define FAM_SIGMA_ROUTER 0.1 /* router logits of about N(0, 1.6): the top experts apart by ~0.5 */

/* A member of the llama family (src/llama.c): its architecture name, what
 * it adds to llama, its head length. */
typedef struct fam_spec {
    const char *arch;
    bool bias;      /* qwen2: attn_q/k/v.bias, N(0, FAM_SIGMA_BIAS) */
    bool qk_norm;   /* qwen3: attn_q_norm/attn_k_norm, 1 + N(0, FAM_SIGMA_NORM) */
    int head_dim;   /* written as attention.key_length when not FAM_DIM / FAM_HEADS */
    bool rope_freqs; /* llama 3: rope_freqs.weight, factors 1 (fast pairs) to 8 (slow) */
    bool moe;       /* qwen3moe: FAM_MOE_E experts of FAM_MOE_F, FAM_MOE_EU per token, for the FAM_FFN */
    bool gemma;     /* gemma3: post norms, GeGLU, every other layer a FAM_GEMMA_SWA window with
                     * RoPE base FAM_GEMMA_BASE_SWA */
    int gemma4;     /* FAM_G4_DENSE or FAM_G4_MOE: the gemma4 below (the fields above unused); 0: none */
} fam_spec;

/* gemma4 (src/llama.c), FAM_G4_LAYERS layers, window and global in turn
 * (attention.sliding_window_pattern [1, 0, 1, 0, 1, 0]), the window
 * FAM_GEMMA_SWA with RoPE base FAM_GEMMA_BASE_SWA. Window layers: head
 * length 64, RoPE over its first 32 dims, 4 KV heads (rows of 256), attn_v.
 * Global layers: head length 128, 1 KV head (rows of 128), no attn_v (V is
 * K's projection), rope_freqs of the converter's "proportional" RoPE (16
 * pairs turned, 48 left alone by factors of 1e30). 4 query heads
 * everywhere. The last FAM_G4_SHARED layers share K and V (layer 4 reads
 * layer 2's, layer 5 layer 3's); the file still holds attn_k (and a window
 * layer's attn_v and attn_k_norm) for them, which llama.cpp loads and does
 * not use. FFN lengths per layer (an array: 512, and 1024 for the shared
 * layers, as the converter's double-wide MLP). Every layer has a
 * layer_output_scale in [0.5, 1]. q and k head norms 0.3 + N(0, 0.075):
 * gemma4 does not scale attention, and at 1 the scores of random weights
 * would spread by 8 - 11; at 0.3 by about 0.8 - 1.1, as the other
 * families' (unit rows scaled by 1 / sqrt(head_dim)). At 0.4 (1.3 - 1.8)
 * the sharper softmax carried the engines' rounding differences further:
 * 1.7x the F16 and Q4_K_M differences of 0.3.
 *   FAM_G4_DENSE  per-layer embeddings of FAM_G4_PL, final_logit_softcapping
 *                 written as 10
 *   FAM_G4_MOE    no per-layer embeddings, softcapping absent (llama.cpp's
 *                 default, 30); every layer but layer 1 adds FAM_MOE_E
 *                 routed experts of FAM_MOE_F (FAM_MOE_EU per token) to its
 *                 MLP, in one ffn_gate_up_exps on even layers and
 *                 ffn_gate_exps + ffn_up_exps on odd ones, router scales
 *                 1 + N(0, FAM_SIGMA_NORM), router N(0, FAM_SIGMA_ROUTER_G4),
 *                 expert output scales exp(N(0, 0.5)) (none on layer 5, they
 *                 being optional). Post norms and the experts' norms 1 +
 *                 N(0, FAM_SIGMA_NORM), as gemma3's. */
enum { FAM_G4_DENSE = 1, FAM_G4_MOE = 2, FAM_G4_LAYERS = 6, FAM_G4_SHARED = 2, FAM_G4_PL = 256 };
/* the router's input is RMS-normed and scaled by 1 / sqrt(DIM): N(0, 1.6)
 * router weights give logits of about N(0, 1.6), as qwen3moe's */
#define FAM_SIGMA_ROUTER_G4 1.6
/* Write the synthetic model of family f (its weights from seed, in F32)
 * with vocab's tokenizer and rope.freq_base rope_base. neutral: f's own
 * tensors (biases, head and post norms, rope factors; gemma4's output,
 * router and expert scales) drawn as usual but written neutral (0, 1), a
 * negative control. The llama family draws
 * exactly the tensors it always did, in the same order. KVT_OK or an error. */
int fam_write(const char *path, const char *vocab, uint64_t seed, float rope_base, const fam_spec *f, bool neutral);
/* The same with a context_length of ctx and the vocabulary's own size (the
 * agent tests' models: a family's own vocabulary, a client's long prompts). */
int fam_write_ctx(const char *path, const char *vocab, uint64_t seed, float rope_base, const fam_spec *f, bool neutral,
                  uint32_t ctx);

#endif
