/* The llama family's weights (llama_weights.c), shared by the file that
 * loads them and the one that runs them (llama.c): the families' features,
 * each layer's shape and tensors, the model's. Not part of the public API. */
#ifndef KVT_LLAMA_WEIGHTS_H
#define KVT_LLAMA_WEIGHTS_H

#include "arch/arch.h"
#include "arch/deltanet.h"
#include "kernels/kernels.h"

/* How a family differs from llama, one named feature per field; the rows
 * of families (llama_weights.c) set the ones they have (designated
 * initializers: a feature not named is off). */
typedef struct kvt_llama_family {
    const char *name;    /* general.architecture, and the prefix of its keys */
    /* attention */
    bool neox;           /* RoPE on the halves of a head, not on adjacent pairs */
    bool qkv_bias;       /* attn_q.bias, attn_k.bias, attn_v.bias */
    bool qk_norm;        /* attn_q_norm.weight, attn_k_norm.weight (head_dim each) before RoPE */
    bool gated_attn;     /* attn_q gives each head its queries then an output gate: the output times
                          * sigmoid(gate) before attn_output */
    bool v_norm;         /* V's heads RMS-normed without a weight; V is K's projection where attn_v
                          * is absent */
    bool unscaled_attn;  /* attention scale 1, not 1 / sqrt(head_dim) */
    bool windows;        /* window layers (attention.sliding_window, _pattern) with a RoPE base of
                          * their own (rope.freq_base_swa); final_logit_softcapping */
    bool layer_shapes;   /* a shape per layer: counts may be arrays, window layers have a head length
                          * and RoPE dims of their own, the window pattern is an array */
    bool shared_kv;      /* the last attention.shared_kv_layers layers read another's K and V */
    bool global_rope_freqs; /* rope_freqs (needed) turns the global layers only, over head_dim / 2 */
    float softcap;       /* final_logit_softcapping when the file gives none (0: none) */
    /* residual stream */
    bool embd_scale;     /* embeddings scaled by sqrt(D) */
    bool post_norms;     /* a norm after each sublayer (post_attention_norm, post_ffw_norm) */
    bool ple;            /* the FFN's residual added at the layer's end, then per-layer embeddings
                          * (embedding_length_per_layer_input) and layer_output_scale */
    /* FFN */
    bool geglu;          /* GeGLU, not SwiGLU */
    bool moe;            /* routed experts for the FFN: softmax router, weights normalised */
    bool layer_experts;  /* a layer with ffn_gate_inp adds routed GeGLU experts to its MLP */
    /* layers */
    bool deltanet;       /* Gated DeltaNet layers (src/arch/deltanet.c) between the attention layers,
                          * post_attention_norm the FFN's input norm */
} kvt_llama_family;


typedef struct kvt_llama_layer {
    uint32_t H, Hkv, hd, QD, KV, F, n_rot; /* this layer's shape (the model's, but for gemma4's per-layer ones) */
    float base;        /* its RoPE base */
    const float *ff;   /* its RoPE frequency divisors (w->rope_ff; NULL: none) */
    bool shared;       /* gemma4: computes no K or V, reads its source's (w->kv_at) */
    float *attn_norm;  /* (D) */
    kvt_wmat wq;       /* (QD, D)      q = wq · x, QD = n_head * head_dim */
    kvt_wmat wk, wv;   /* (KV, D)      KV = n_head_kv * head_dim; wv.rows 0 (gemma4): V is wk's output */
    float *bq, *bk, *bv; /* (QD), (KV), (KV) qwen2; else NULL */
    float *qn, *kn;    /* (head_dim) x2 qwen3; else NULL (kn: a shared layer) */
    kvt_wmat wo;       /* (D, QD) */
    float *ffn_norm;   /* (D) */
    kvt_wmat w1, w3;   /* (F, D)       gate, up */
    kvt_wmat w2;       /* (D, F)       down */
    float *gate_inp;   /* (E, D) the router (moe, or a gemma4 layer with experts; else NULL) */
    float *post_attn, *post_ffn; /* (D) x2 the sublayers' output norms (gemma) */
    kvt_wmat gate_x, up_x, down_x; /* (E*Fe, D) x2, (E*D, Fe): the experts (moe); gate_up: gate_x is
                                    * (E*2Fe, D), each expert's gate rows then its up rows, up_x unused */
    bool gate_up;
    /* gemma4 */
    float *out_scale;  /* (1) layer_output_scale; NULL: none */
    float *gate_inp_s; /* (D) the router input's scale (a layer with experts) */
    float *down_s;     /* (E) ffn_down_exps.scale; NULL: none */
    float *pre_ffn2, *post_ffn1, *post_ffn2; /* (D) x3 the experts' input and output norms, the MLP's */
    kvt_wmat inp_gate; /* (n_pl, D) per-layer embeddings: the gate */
    kvt_wmat proj;     /* (D, n_pl) its projection */
    float *ple_post;   /* (D) its norm */
    /* qwen35 */
    bool recr;         /* a Gated DeltaNet layer (gdn; no attention, no streams) */
    kvt_gdn_layer gdn;
    kvt_wmat sh_gate, sh_up, sh_down; /* (Fs, D) x2, (D, Fs): qwen35moe's shared expert (rows 0: none) */
    float *sh_inp;     /* (D) its gate: sigmoid(sh_inp . x) */
} kvt_llama_layer;

typedef struct kvt_llama_weights {
    const kvt_llama_family *fam;
    uint32_t D, L, H, Hkv, hd, QD, KV, F, V, n_rot; /* gemma4: H, Hkv and hd of layer 0 and the global layers,
                                                     * QD, KV, F the largest of any layer */
    uint32_t E, Eu, Fe;  /* experts, used per token, each one's FFN length (moe; else 0) */
    float eps, rope_base;
    float rope_base_swa, scale, softcap; /* gemma: the window layers' RoPE base; the attention scale
                                          * (others 1 / sqrt(head_dim)); final logit soft-capping (0: none) */
    uint32_t swa;      /* the sliding window of the window layers (gemma; 0: none) */
    uint8_t *is_swa;   /* (L) which layers have it */
    int32_t *kv_at;    /* (L) a global layer's K stream (V: the next), or -1 - r for the r-th window
                        * layer, whose rings are at state offset ring_at[r]; a shared layer: its source's */
    size_t n_global, n_ring;
    size_t *ring_at;   /* (n_ring + 1) the state offsets of the window layers' rings: swa K rows of the
                        * layer's KV elements in type_k, then swa V rows in type_v */
    kvt_row_type type_k, type_v; /* the rows' types (resolved; kvt_llama_weights_rows) */
    uint32_t *ring_kv, *stream_kv; /* (n_ring), (n_global) their row lengths (KV) */
    uint32_t n_kv;     /* the layers with K and V of their own (the first n_kv) */
    int32_t swa_src;   /* the window layer whose ring shared layers read (its ring is written at the pass's
                        * end); -1: none */
    uint32_t n_ff;     /* rope_freqs' length */
    uint32_t n_pl;     /* gemma4: the per-layer embeddings' length (0: none) */
    kvt_wmat ple_embd; /* (V, L * n_pl) per_layer_token_embd */
    kvt_wmat ple_proj; /* (L * n_pl, D) per_layer_model_proj */
    float *ple_norm;   /* (n_pl) per_layer_proj_norm */
    kvt_wmat tok_embd; /* (V, D) */
    float *out_norm;   /* (D) */
    float *rope_ff;    /* (n_ff) rope_freqs.weight (llama 3's scaling, as the converter writes it); NULL: none */
    kvt_wmat out;      /* (V, D); the same tensor as tok_embd when tied */
    kvt_llama_layer *layers; /* (L) */
    /* qwen35 */
    kvt_gdn_shape gdn; /* the DeltaNet layers' shape */
    size_t n_rec;      /* DeltaNet layers */
    int32_t *rec_ix;   /* (L) a DeltaNet layer's index among them (else -1); its state is at rec_at +
                        * index * kvt_gdn_state_bytes */
    size_t rec_at;     /* the state offset of the first (after the rings) */
    uint32_t Fs;       /* the shared expert's length (0: none) */
    float moe_scale;   /* expert_weights_scale (0 or 1: none) */
    /* qwen35's MTP (nextn) layer, the file's block L of L + nextn_predict_layers (1): a gated
     * full-attention layer of the model's shape (layers[L]) run on eh_proj [enorm(embedding of the
     * token at q), hnorm(h_nextn of q - 1)], where h_nextn is output_norm of a position's final
     * residual; NULL: the file has none */
    kvt_llama_layer *mtp;
    kvt_wmat eh;       /* (D, 2D) nextn.eh_proj */
    float *enorm, *hnorm; /* (D) x2 nextn.enorm, nextn.hnorm */
    kvt_wmat mtp_embd; /* (V, D) nextn.embed_tokens; data NULL: tok_embd */
    kvt_wmat mtp_head; /* (V, D) nextn.shared_head_head; data NULL: out */
    float *mtp_norm;   /* (D) nextn.shared_head_norm; NULL: out_norm */
    bool mtp_rows;     /* sessions keep the layer's K and V rows of every position (a stream pair after the
                        * global layers') and the last position's h_nextn (D floats, the state's last) */
} kvt_llama_weights;

/* Whether general.architecture is one of the families. */
bool kvt_llama_weights_handles(const kvt_gguf *g);
/* The weights of g (*out, kvt_llama_weights_free) and the model's shape
 * and parameter count in *info. */
int kvt_llama_weights_load(kvt_llama_weights **out, const kvt_gguf *g, kvt_model_info *info);
void kvt_llama_weights_free(void *w);
/* Each matrix packed for the integer kernels where
 * they read it faster (kvt_arch.weights_pack). */
int kvt_llama_weights_pack(void *w, const kvt_gguf *g);
/* Hash over the configuration and every weight (kvt_arch.fingerprint). */
uint64_t kvt_llama_weights_fingerprint(const void *w);
/* Whether K and V rows of these types (resolved) fit the model's rows
 * (KVT_EINVAL naming the layer and length when not), and when set, the
 * rings laid out for them (ring_at, rec_at). */
int kvt_llama_weights_rows(kvt_llama_weights *w, kvt_row_type type_k, kvt_row_type type_v, bool set);
/* The fixed state's bytes: the window rings, then the DeltaNet layers'
 * states (at rec_at), then with mtp_rows the last position's h_nextn. */
size_t kvt_llama_weights_state_bytes(const kvt_llama_weights *w);

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
 * ring right after its own layer, before the shared layers read it;
 * KVT_LLAMA_FAULT_ROWS_UNROUNDED leaves K and V unrounded after RoPE, so a
 * pass reads its own tokens' rows as computed and a later pass the stored
 * ones; KVT_LLAMA_FAULT_RING_TYPES loads a window ring's rows with K's and
 * V's row types crossed (the rows' sizes and the V ring's start), as the
 * state was saved with them right (only K and V types that differ show
 * it); KVT_LLAMA_FAULT_MTP_PENDING: state_load leaves the MTP layer's
 * h_nextn as it was (a rollback or restore that forgets it: the next row
 * pairs its token with another position's hidden state). */
enum { KVT_LLAMA_FAULT_NONE, KVT_LLAMA_FAULT_ROPE_PAIRS, KVT_LLAMA_FAULT_MOE_WEIGHTS, KVT_LLAMA_FAULT_NO_WINDOW,
       KVT_LLAMA_FAULT_RING, KVT_LLAMA_FAULT_OWN_KV, KVT_LLAMA_FAULT_NO_PLE, KVT_LLAMA_FAULT_V_NORM_WEIGHT,
       KVT_LLAMA_FAULT_GDN_GROUPED, KVT_LLAMA_FAULT_BATCH_POS, KVT_LLAMA_FAULT_WINDOW_CHUNK,
       KVT_LLAMA_FAULT_SOURCE_RING_EARLY, KVT_LLAMA_FAULT_ROWS_UNROUNDED, KVT_LLAMA_FAULT_RING_TYPES,
       KVT_LLAMA_FAULT_MTP_PENDING };
extern int kvt_llama_fault;

#endif
