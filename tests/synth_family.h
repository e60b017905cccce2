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
} fam_spec;



#define FAM_SIGMA_BIAS 0.5 /* large against q and k of N(0, ~1): a bias left out moves the logits */
#define FAM_SIGMA_NORM 0.3
/* Write the synthetic model of family f (its weights from seed, in F32)
 * with vocab's tokenizer and rope.freq_base rope_base. neutral: f's own
 * tensors (biases, head and post norms, rope factors) drawn as usual but
 * written neutral (0, 1), a negative control. The llama family draws
 * exactly the tensors it always did, in the same order. KVT_OK or an error. */
int fam_write(const char *path, const char *vocab, uint64_t seed, float rope_base, const fam_spec *f, bool neutral);
/* The same with a context_length of ctx and the vocabulary's own size (the
 * agent tests' models: a family's own vocabulary, a client's long prompts). */
int fam_write_ctx(const char *path, const char *vocab, uint64_t seed, float rope_base, const fam_spec *f, bool neutral,
                  uint32_t ctx);

#endif
