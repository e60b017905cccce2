/* Synthetic models of the llama family (src/arch/llama.c) for the tests: the
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

/* A member of the llama family (src/arch/llama.c): its architecture name, what
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
    int qwen35;     /* FAM_Q35_DENSE (qwen35) or FAM_Q35_MOE (qwen35moe): the Qwen 3.5 below (the fields
                     * above unused); 0: none */
    bool mtp;       /* qwen35: an MTP (nextn) layer after the model's, as below */
} fam_spec;

/* gemma4 (src/arch/llama.c), FAM_G4_LAYERS layers, window and global in turn
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
/* qwen35 and qwen35moe (Qwen 3.5), FAM_Q35_LAYERS layers, Gated DeltaNet
 * (recurrent) layers but every FAM_Q35_INTERVAL-th, which is a gated full
 * attention layer: R R R F R R R F. Both files write full_attention_interval
 * 4; the dense one also attention.recurrent_layers (a bool array, as the
 * converter's add_recurrent_layers types a list of bools), the MoE one not,
 * so both of llama.cpp's ways to find the layer types are used.
 *   full attention  4 heads, 2 KV heads, head length 64; attn_q of 512 rows,
 *                   per head its 64 query rows then its 64 gate rows (the
 *                   attention output is multiplied by sigmoid(gate)); q and
 *                   k head norms; RoPE over the first 16 of 64 dims (partial
 *                   rotary, a quarter), rope.dimension_sections [3, 3, 2, 0]
 *                   (an i32 array, as the converter writes the real [11, 11,
 *                   10, 0]: a text-only prompt has one position per token).
 *   DeltaNet        ssm.conv_kernel 4, ssm.state_size 64 (the K and V head
 *                   length), ssm.group_count 2 (K heads), ssm.time_step_rank
 *                   4 (V heads), ssm.inner_size 256: attn_qkv D -> 512 (q
 *                   128, k 128, v 256: the conv channels), attn_gate D -> 256
 *                   (z), ssm_conv1d (ne 4 x 512, F32), ssm_dt.bias (4),
 *                   ssm_a (4, no .weight: the converter's -exp(A_log)),
 *                   ssm_beta and ssm_alpha D -> 4, ssm_norm (64), ssm_out
 *                   256 -> D. V head h reads K head h % 2 (the converter's
 *                   tiled order).
 *   FFN             attn_norm, then post_attention_norm as the FFN's input
 *                   norm. FAM_Q35_DENSE: SwiGLU of FAM_FFN. FAM_Q35_MOE:
 *                   FAM_MOE_E routed experts of FAM_MOE_F (FAM_MOE_EU per
 *                   token, weights normalised, no expert_weights_scale
 *                   written), router N(0, FAM_SIGMA_ROUTER), plus a shared
 *                   SwiGLU expert of FAM_Q35_SHEXP times sigmoid(w . x),
 *                   w (ffn_gate_inp_shexp, a vector of D) N(0,
 *                   FAM_SIGMA_ROUTER): gates of mean 0.44, sd 0.31;
 *                   feed_forward_length written as FAM_Q35_SHEXP.
 * Every matrix row is a multiple of 256 long but ffn_down_exps' (FAM_MOE_F,
 * as qwen3moe's: llama.cpp's Q4_K_M makes them q8_0); ssm_conv1d and the
 * vectors stay F32 in its F16 and Q4_K_M (which makes attn_qkv q6_K, or q8_0
 * with the experts, as attn_v).
 * Every hyperparameter llama.cpp reads for them is written. The vocabulary
 * is the file's (its size), with an output matrix of its own. Every norm
 * (attn_norm, post_attention_norm, output_norm, the head norms, ssm_norm)
 * is 1 + N(0, FAM_SIGMA_NORM): the converter stores them with the 1 added
 * (llama.cpp multiplies by them as they are), so an engine adding 1 again
 * would be caught. Scales, and what llama.cpp's graph showed of them over
 * the 600-token prompt of the peer test (x: a normed input, RMS about 1):
 *   attn_q, attn_k    N(0, FAM_SIGMA_QK), as the other families'; the head
 *                     norms set the scores' spread anyway (about 1); the
 *                     gate rows give sigmoid gates of mean 0.5, sd 0.25
 *   attn_qkv          N(0, FAM_SIGMA_QK): conv inputs of sd 1.4
 *   ssm_conv1d        N(0, 0.5): 4 taps of equal weight, a gain of 1, so the
 *                     conv output is of order 1 (sd 1.4, SiLU's curved
 *                     part) and the three tokens before count as much as
 *                     the token itself
 *   attn_gate         N(0, FAM_SIGMA): z of sd 0.35; the DeltaNet layer adds
 *                     sd 0.056 per element to the residual, the attention
 *                     layers 0.013, the FFN 0.014 - 0.026 (the residual ends
 *                     at sd 0.16): every part counts
 *   ssm_beta, ssm_alpha  N(0, FAM_SIGMA): beta = sigmoid(N(0, 0.33)), 0.2 -
 *                     0.75 (each token overwrites about half of what the
 *                     state holds along its key)
 *   ssm_dt.bias       N(0, 0.5): softplus(alpha + dt) of mean 0.75 - 1.0 by
 *                     layer, 0.2 - 2.2 by head and token
 *   ssm_a             fixed per V head, -0.02 * 100^(h / 3): -0.02, -0.093,
 *                     -0.43, -2, so with softplus about 0.85 a decay per
 *                     token of exp(-0.017) (a memory of about 60 tokens,
 *                     beside the delta rule's own forgetting, beta / 64 per
 *                     token along random keys: about 130), exp(-0.08) (12),
 *                     exp(-0.37) (3) and exp(-1.7) (under one); the heads'
 *                     decays differ by 100x, so a decay read for the wrong
 *                     head or left out moves the logits
 * Measured in llama.cpp: other tokens at positions 1 - 99 move the logits
 * of positions 500 - 599 by 0.05 (qwen35) and 0.13 (qwen35moe) of max
 * |logit| (by 1.1 at 100 - 199); the neutral file's logits differ from the
 * file's by 1.0 - 1.3 of max |logit| over the first 16 to 600 positions.
 * neutral (the control): ssm_a written as 0 (no decay), every draw the
 * same.
 * mtp: an MTP (nextn) layer as llama.cpp's converter writes Qwen 3.5's:
 * nextn_predict_layers 1, block_count FAM_Q35_LAYERS + 1 (the layer is
 * block 8), attention.recurrent_layers one entry longer (false for it);
 * block 8 holds a full-attention layer's tensors (as above, its FFN the
 * family's) and nextn.eh_proj (2D -> D, N(0, FAM_SIGMA): its output of sd
 * about 0.45, normed by attn_norm), nextn.enorm, nextn.hnorm and
 * nextn.shared_head_norm (1 + N(0, FAM_SIGMA_NORM)); no embed_tokens or
 * shared_head_head (the model's are used). Its tensors are drawn after
 * every other, so the model's are those of the file without it. */
enum { FAM_Q35_DENSE = 1, FAM_Q35_MOE = 2, FAM_Q35_LAYERS = 8, FAM_Q35_INTERVAL = 4, FAM_Q35_HEAD_DIM = 64,
       FAM_Q35_ROT = 16, FAM_Q35_CONV = 4, FAM_Q35_STATE = 64, FAM_Q35_HK = 2, FAM_Q35_HV = 4,
       FAM_Q35_SHEXP = 256 };
/* the router's input is RMS-normed and scaled by 1 / sqrt(DIM): N(0, 1.6)
 * router weights give logits of about N(0, 1.6), as qwen3moe's */
#define FAM_SIGMA_ROUTER_G4 1.6
/* Write the synthetic model of family f (its weights from seed, in F32)
 * with vocab's tokenizer and rope.freq_base rope_base. neutral: f's own
 * tensors (biases, head and post norms, rope factors; gemma4's output,
 * router and expert scales; qwen35's ssm_a, written 0) drawn as usual but
 * written neutral (0, 1), a negative control. The llama family draws
 * exactly the tensors it always did, in the same order. KVT_OK or an error. */
int fam_write(const char *path, const char *vocab, uint64_t seed, float rope_base, const fam_spec *f, bool neutral);
/* The same with a context_length of ctx and the vocabulary's own size (the
 * agent tests' models: a family's own vocabulary, a client's long prompts). */
int fam_write_ctx(const char *path, const char *vocab, uint64_t seed, float rope_base, const fam_spec *f, bool neutral,
                  uint32_t ctx);

#endif
