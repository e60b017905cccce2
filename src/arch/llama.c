/* The transformers of the llama family: RMSNorm, RoPE, grouped-query
 * attention over full K and V rows, SwiGLU FFN, tied or separate output head,
 * configured from GGUF `ARCH.*` metadata. One row of `families` per
 * architecture says how it differs from llama:
 *
 *   llama  RoPE on adjacent pairs (2i, 2i+1); a llama 3 file's rope_freqs
 *          (the converter's llama3 scaling) divides each pair's frequency
 *   qwen2  RoPE on the halves (i, i + n_rot/2) (llama.cpp's NEOX), biases on
 *          q, k and v
 *   qwen3  NEOX RoPE, an RMSNorm with a weight over each query and key head
 *          before the rotation (attn_q_norm, attn_k_norm), and a head
 *          length of its own (attention.key_length: H * head_dim need not
 *          be D)
 *   qwen3moe  qwen3 with routed experts for the FFN (src/arch/moe.c)
 *   gemma3 qwen3's attention, embeddings scaled by sqrt(D), a norm after
 *          each sublayer (post_attention_norm, post_ffw_norm), GeGLU, and
 *          window layers (attention.sliding_window_pattern) that attend to
 *          the last attention.sliding_window positions with RoPE base
 *          rope.freq_base_swa.
 *   gemma4 gemma3 with a shape per layer: window and global layers have
 *          head lengths of their own (attention.key_length_swa and
 *          key_length), RoPE dims (rope.dimension_count_swa and
 *          dimension_count) and bases (rope.freq_base_swa and freq_base);
 *          head counts, KV head counts and FFN lengths may be arrays, one
 *          entry per layer. rope_freqs divides the global layers'
 *          frequencies only (the converter's "proportional" RoPE: a factor
 *          of 1e30 leaves a pair unturned). No attention scaling (1, not
 *          1 / sqrt(head_dim)); V, RMS-normed without a weight, is K's raw
 *          projection where attn_v is absent. The last
 *          attention.shared_kv_layers layers compute no K or V: they attend
 *          with their own queries to those of the last window layer before
 *          them (a window layer) or the last global one (a global layer).
 *          Per-layer embeddings (embedding_length_per_layer_input n_pl > 0):
 *          per_layer_token_embd's row of the token plus a projection of
 *          the embedding, each n_pl per layer, gate a projection added to
 *          the residual after each layer's FFN. layer_output_scale
 *          multiplies the residual stream at a layer's end.
 *          final_logit_softcapping is 30 unless the file says otherwise.
 *          A layer with ffn_gate_inp adds routed GeGLU experts to its FFN
 *          (a shared MLP): a weightless RMSNorm of the router's input,
 *          scaled by 1 / sqrt(D) and ffn_gate_inp.scale, softmax, the best
 *          expert_used_count renormalised, each expert's output times
 *          ffn_down_exps.scale, the experts and the MLP each normed
 *          (post_ffw_norm_2, post_ffw_norm_1) and added.
 *
 *   qwen35 Gated DeltaNet layers (src/arch/deltanet.c; attention.recurrent_layers,
 *          else all but every full_attention_interval-th) between attention
 *          layers whose attn_q gives each head its queries and an output
 *          gate (the output times sigmoid(gate) before attn_output), with
 *          qwen3's head norms and NEOX RoPE over rope.dimension_count dims
 *          (rope.dimension_sections: llama.cpp's interleaved multi-axis
 *          RoPE, which on text turns every pair but those of the fourth
 *          axis by the position); post_attention_norm is the FFN's input
 *          norm. A DeltaNet layer's cache entry is its convolution and
 *          delta-rule state, after the rings in the fixed state area.
 *   qwen35moe  qwen35 with qwen3moe's routed experts plus a shared expert
 *          (ffn_*_shexp) scaled by sigmoid(ffn_gate_inp_shexp . x).
 *
 * Cache layout. A global layer has two streams, K then V, each one f32 row
 * of its n_head_kv * head_dim per token (128 rows per 128-token block), written
 * once, when their token is processed, and never changed afterwards. A
 * window layer keeps only what its attention can still read: a ring of the
 * last W = sliding_window K rows and one of V rows, row t in slot t mod W,
 * in the cache's fixed state area (K ring then V ring, window layers in
 * order). A pass reads the positions before it from the ring and its own
 * positions from its scratch, and only then writes its last W rows into the
 * ring. The rings make the model stateful: going back to an earlier
 * position needs the ring as it was there, which the session's checkpoints
 * keep (llama_state_save: the valid rows oldest first), and snapshots store
 * it as their state section. A model without window layers has no state:
 * every prefix of its streams is a valid cache. A gemma4 layer that shares
 * K and V has no streams or ring: it reads its source's. A shared window
 * layer reads its source's ring as it was before the pass, so that ring
 * takes the pass's rows only once every layer has run (its rows for the
 * pass stay in scratch of their own until then).
 *
 * Weights: every matrix is used in place, in the file's own type
 * (kvt_matmul_w); only the norm vectors are f32 copies.
 *
 * Exactness: a chunk of n tokens is processed with the same per-row kernels
 * as a single token. Attention for the token at position t reads keys 0..t in
 * increasing order whatever chunk they were written in, and every matmul
 * output is one fixed-order dot product, so logits and cache bytes do not
 * depend on the chunk schedule or the thread count.
 */
#include "arch/deltanet.h"
#include "kernels/kernels.h"
#include "arch/llama.h"
#include "arch/tensor.h"
#include "arch/moe.h"
#include "kernels/qkernels.h"
#include "format/quant.h"
#include "base/util.h"

#include <malloc.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

/* Consecutive tokens whose attention reads each block of K and V rows
 * together (the block stays in the core's cache across them). */
#define ATT_TOKS 8

typedef struct family {
    const char *name;  /* general.architecture, and the prefix of its keys */
    bool neox;         /* RoPE on the halves of a head, not on adjacent pairs */
    bool qkv_bias;     /* attn_q.bias, attn_k.bias, attn_v.bias */
    bool qk_norm;      /* attn_q_norm.weight, attn_k_norm.weight (head_dim each) */
    bool moe;          /* routed experts for the FFN: softmax router, weights normalised */
    bool gemma;        /* gemma3: embeddings scaled by sqrt(D), attn_post_norm and ffn_post_norm,
                        * GeGLU, sliding-window layers with a RoPE base of their own */
    bool gemma4;       /* gemma4's additions to gemma (the header) */
    bool hybrid;       /* qwen35: Gated DeltaNet layers (src/arch/deltanet.c) between gated attention layers */
} family;

static const family families[] = {
    {"llama", false, false, false, false, false, false},
    {"qwen2", true, true, false, false, false, false},
    {"qwen3", true, false, true, false, false, false},
    {"qwen3moe", true, false, true, true, false, false},
    {"gemma3", true, false, true, false, true, false},
    {"gemma4", true, false, true, false, true, true},
    {"qwen35", true, false, true, false, false, false, true},
    {"qwen35moe", true, false, true, true, false, false, true},
};

typedef struct llama_layer {
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
} llama_layer;

typedef struct llama_weights {
    const family *fam;
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
    size_t *ring_at;   /* (n_ring + 1) the state offsets of the window layers' rings, (2, swa, KV) f32 each */
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
    llama_layer *layers; /* (L) */
    /* qwen35 */
    kvt_gdn_shape gdn; /* the DeltaNet layers' shape */
    size_t n_rec;      /* DeltaNet layers */
    int32_t *rec_ix;   /* (L) a DeltaNet layer's index among them (else -1); its state is at rec_at +
                        * index * kvt_gdn_state_bytes */
    size_t rec_at;     /* the state offset of the first (after the rings) */
    uint32_t Fs;       /* the shared expert's length (0: none) */
    float moe_scale;   /* expert_weights_scale (0 or 1: none) */
} llama_weights;

/* A session's scratch, allocated when it is created: the activations of up
 * to `ch` tokens (a longer chunk runs in passes of ch) and, per part of the
 * pool, one attention score row per query head of a KV group and token of
 * an attention group (ATT_TOKS). */
typedef struct llama_work {
    size_t ch, parts, n_ctx, group;
    float *x;          /* (ch, D) residual */
    float *xb;         /* (ch, D) normed input, then a sublayer's output */
    float *q;          /* (ch, QD) */
    float *att;        /* (ch, QD) attention output */
    float *k, *v;      /* (ch, KV) */
    float *sk, *sv;    /* (ch, KV) the K and V rows of w->swa_src, kept for the shared layers (else NULL) */
    float *h1, *h3;    /* (ch, F) */
    float *lg, *ew, *mo; /* moe: (ch, E) router probabilities, (ch, Eu) weights, (ch, D) output */
    float *m2;         /* gemma4 moe: (ch, D) the experts' input */
    uint32_t *ex;      /* moe: (ch, Eu) experts */
    kvt_moe_scratch ms; /* moe: the experts' scratch */
    float *pl, *pl0;   /* per-layer embeddings: (ch, L * n_pl) the layers' inputs, the token rows */
    float *pg;         /* (ch, n_pl) a layer's gate */
    float *scores;     /* (parts, ATT_TOKS, group, n_ctx): group = query heads per KV head */
    uint8_t *qx;       /* (ch) tokens' activations quantised for the integer matrices (qkernels.h); NULL: none */
    float *qg;         /* qwen35: (ch, 2 QD) each head's queries then its output gate */
    float *sh, *shg;   /* qwen35moe: (ch, D) the shared expert's output, (ch) its gate */
    kvt_gdn_work gw;   /* qwen35: the DeltaNet layers' scratch */
    int32_t *tok;      /* (ch) a pass's tokens, its segments' one after another */
    size_t *pos;       /* (ch) their positions */
    float *lgb;        /* (lgb_rows, V) a batched pass's logits, before they go to their segments */
    size_t lgb_rows;
} llama_work;

/* The matrices of layer l (l == L: the output head and the per-layer
 * embeddings' projection), n of them. */
#define LAYER_MATS 17
static size_t layer_mats(llama_weights *w, uint32_t l, kvt_wmat **m)
{
    if (l == w->L) { m[0] = &w->out; m[1] = &w->ple_proj; return 2; }
    llama_layer *ly = &w->layers[l];
    kvt_wmat *all[LAYER_MATS] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo, &ly->w1, &ly->w3, &ly->w2, &ly->inp_gate,
                                 &ly->proj, &ly->gdn.qkv, &ly->gdn.gate, &ly->gdn.beta, &ly->gdn.alpha, &ly->gdn.out,
                                 &ly->sh_gate, &ly->sh_up, &ly->sh_down};
    memcpy(m, all, sizeof all);
    return LAYER_MATS;
}

static void llama_free(void *p)
{
    llama_weights *w = p;
    if (!w) return;
    if (w->layers) {
        for (uint32_t l = 0; l <= w->L; l++) { /* the packed copies (llama_pack), the head's too */
            kvt_wmat *m[LAYER_MATS];
            for (size_t i = 0, n = layer_mats(w, l, m); i < n; i++) free((void *)m[i]->pk);
        }
        for (uint32_t l = 0; l < w->L; l++) {
            llama_layer *ly = &w->layers[l];
            void *v[] = {ly->attn_norm, ly->ffn_norm, ly->bq, ly->bk, ly->bv, ly->qn, ly->kn, ly->gate_inp,
                         ly->post_attn, ly->post_ffn, ly->out_scale, ly->gate_inp_s, ly->down_s, ly->pre_ffn2,
                         ly->post_ffn1, ly->post_ffn2, ly->ple_post, ly->gdn.conv_w, ly->gdn.dt, ly->gdn.a,
                         ly->gdn.norm, ly->sh_inp};
            for (size_t i = 0; i < sizeof v / sizeof *v; i++) free(v[i]);
        }
        free(w->layers);
    }
    free(w->out_norm);
    free(w->rope_ff);
    free(w->ple_norm);
    free(w->is_swa);
    free(w->kv_at);
    free(w->ring_at);
    free(w->ring_kv);
    free(w->stream_kv);
    free(w->rec_ix);
    free(w);
}

/* Q4_K and Q5_K matrices packed four rows at a time (kvt_q_pack), the
 * file's pages they replace released: resident memory stays that of the
 * file. The token embedding keeps the file's rows (a lookup reads one),
 * also when the output head is the same tensor. */
static int llama_pack(void *p, const kvt_gguf *g)
{
    llama_weights *w = p;
    for (uint32_t l = 0; l <= w->L; l++) {
        kvt_wmat *m[LAYER_MATS];
        for (size_t i = 0, n = layer_mats(w, l, m); i < n; i++) {
            size_t bytes = kvt_q_pack_bytes(m[i]);
            if (!bytes || m[i]->pk) continue;
            uint8_t *pk = kvt_malloc(bytes);
            if (!pk) return KVT_ENOMEM;
            /* a MiB of rows at a time, each released once packed, so that
             * resident memory never holds both copies of a large matrix */
            size_t groups = m[i]->rows / 4, per = bytes / groups, row = m[i]->row_bytes;
            size_t step = (1u << 20) / (4 * row) ? (1u << 20) / (4 * row) : 1;
            for (size_t k = 0; k < groups; k += step) {
                size_t n = groups - k < step ? groups - k : step;
                kvt_wmat part = {m[i]->data + 4 * k * row, m[i]->type, 4 * n, m[i]->cols, row, NULL};
                kvt_q_pack(&part, pk + k * per);
                kvt_gguf_release(g, part.data, part.rows * row);
            }
            m[i]->pk = pk;
        }
    }
    return KVT_OK;
}

static const kvt_arch arch_llama_window;

/* ARCH.suffix, the family's key. */
static const char *fkey(const llama_weights *w, const char *suffix)
{
    static _Thread_local char k[96];
    snprintf(k, sizeof k, "%s.%s", w->fam->name, suffix);
    return k;
}

static int need_u32(const kvt_gguf *g, const char *key, uint32_t *out)
{
    int rc = kvt_gguf_get_u32(g, key, out);
    if (rc == KVT_ENOENT) return kvt_fail(KVT_EFORMAT, "missing metadata key %s", key);
    return rc;
}

/* ARCH.suffix into out[0..L): one u32 for every layer, or (gemma4, as
 * llama.cpp reads these keys) an array of exactly L non-negative integers;
 * def for every layer when the key is absent and not needed. */
static int layer_u32(const kvt_gguf *g, const llama_weights *w, const char *suffix, bool need, uint32_t def,
                     uint32_t *out)
{
    const char *key = fkey(w, suffix);
    const kvt_gguf_val *v = kvt_gguf_get(g, key);
    if (v && v->type == KVT_GGUF_ARR && w->fam->gemma4) {
        uint32_t et = v->elem_type;
        if (v->n != w->L || !(et == KVT_GGUF_U32 || et == KVT_GGUF_I32 || et == KVT_GGUF_U16 || et == KVT_GGUF_U8))
            return kvt_fail(KVT_EFORMAT, "%s: an array of %llu entries of type %u, not %u integers (one per layer)",
                            key, (unsigned long long)v->n, et, w->L);
        for (uint32_t l = 0; l < w->L; l++) {
            const kvt_gguf_val *e = &v->v.arr[l];
            if (et == KVT_GGUF_I32 ? e->v.i < 0 || e->v.i > INT32_MAX : e->v.u > UINT32_MAX)
                return kvt_fail(KVT_EFORMAT, "%s[%u] is out of range", key, l);
            out[l] = (uint32_t)(et == KVT_GGUF_I32 ? (uint64_t)e->v.i : e->v.u);
        }
        return KVT_OK;
    }
    uint32_t x = def;
    int rc = need ? need_u32(g, key, &x) : kvt_gguf_get_u32(g, key, &x);
    if (rc && rc != KVT_ENOENT) return rc;
    for (uint32_t l = 0; l < w->L; l++) out[l] = x;
    return KVT_OK;
}

/* An optional f32 key of the family (def when absent). */
static int opt_f32(const kvt_gguf *g, const llama_weights *w, const char *suffix, float def, float *out)
{
    *out = def;
    int rc = kvt_gguf_get_f32(g, fkey(w, suffix), out);
    return rc == KVT_ENOENT ? KVT_OK : rc;
}

static int opt_u32(const kvt_gguf *g, const llama_weights *w, const char *suffix, uint32_t def, uint32_t *out)
{
    *out = def;
    int rc = kvt_gguf_get_u32(g, fkey(w, suffix), out);
    return rc == KVT_ENOENT ? KVT_OK : rc;
}

/* The family of general.architecture; NULL when it is none of them. */
static const family *family_of(const kvt_gguf *g)
{
    const char *a;
    size_t n;
    if (kvt_gguf_get_str(g, "general.architecture", &a, &n)) return NULL;
    for (size_t i = 0; i < sizeof families / sizeof *families; i++)
        if (strlen(families[i].name) == n && !memcmp(families[i].name, a, n)) return &families[i];
    return NULL;
}

static bool llama_handles(const kvt_gguf *g) { return family_of(g) != NULL; }

/* gemma3's and gemma4's window layers, their RoPE base and the final
 * soft-capping; gemma4's window head length (*hd_swa), its shared layers
 * (*shared), per-layer embeddings and experts. */
static int gemma_hparams(const kvt_gguf *g, llama_weights *w, uint32_t *hd_swa, uint32_t *shared)
{
    int rc;
    bool g4 = w->fam->gemma4;
    /* llama.cpp's gemma3: window layers by attention.sliding_window_pattern
     * (every n-th layer global, default 6; or a per-layer array), their
     * RoPE base rope.freq_base_swa (default 10000); the 62-layer 27B scales
     * attention by 1 / sqrt(D / H). Its gemma4: the window, the pattern (an
     * array, 1 for a window layer; layers past its end global), the norms'
     * epsilon and the per-layer embeddings' length required; soft-capping
     * 30 unless given; no attention scaling. */
    if ((rc = g4 ? need_u32(g, fkey(w, "attention.sliding_window"), &w->swa)
                 : opt_u32(g, w, "attention.sliding_window", 0, &w->swa)) ||
        (rc = opt_f32(g, w, "rope.freq_base_swa", 10000.0f, &w->rope_base_swa)) ||
        (rc = opt_f32(g, w, "final_logit_softcapping", g4 ? 30.0f : 0.0f, &w->softcap)))
        return rc;
    if (!(w->softcap >= 0) || !isfinite(w->softcap) || !(w->rope_base_swa > 0) || !isfinite(w->rope_base_swa))
        return kvt_fail(KVT_EFORMAT, "%s: bad final_logit_softcapping %g or rope.freq_base_swa %g", w->fam->name,
                        (double)w->softcap, (double)w->rope_base_swa);
    if (w->L == 62 && !g4) w->scale = 1.0f / sqrtf((float)(w->D / w->H));
    if (g4) w->scale = 1.0f;
    if (!(w->is_swa = kvt_calloc(w->L, 1))) return KVT_ENOMEM;
    const char *pk = fkey(w, "attention.sliding_window_pattern");
    const kvt_gguf_val *pv = kvt_gguf_get(g, pk);
    uint32_t np = 6;
    if (pv && pv->type == KVT_GGUF_ARR) {
        if ((g4 ? pv->n > w->L : pv->n != w->L) || !(pv->elem_type == KVT_GGUF_BOOL || pv->elem_type <= KVT_GGUF_I32))
            return kvt_fail(KVT_EFORMAT, "%s: sliding_window_pattern has %llu entries for %u layers", w->fam->name,
                            (unsigned long long)pv->n, w->L);
        for (uint32_t l = 0; l < pv->n; l++) w->is_swa[l] = pv->v.arr[l].v.u != 0;
    } else if (g4) {
        return kvt_fail(KVT_EFORMAT, "%s is %s, not an array of one entry per layer", pk, pv ? "a scalar" : "missing");
    } else {
        if (pv && (rc = kvt_gguf_get_u32(g, pk, &np))) return rc;
        for (uint32_t l = 0; l < w->L; l++) w->is_swa[l] = np == 0 || l % np < np - 1;
    }
    if (!w->swa) memset(w->is_swa, 0, w->L);
    if (w->swa > 1u << 20 || (g4 && !w->swa))
        return kvt_fail(KVT_EFORMAT, "%s: attention.sliding_window %u is 0 or past 2^20", w->fam->name, w->swa);
    if (!g4) return KVT_OK;
    uint32_t vl = 0, any = 0;
    for (uint32_t l = 0; l < w->L; l++) any += w->is_swa[l];
    if ((rc = need_u32(g, fkey(w, "attention.key_length_swa"), hd_swa)) ||
        (rc = need_u32(g, fkey(w, "attention.value_length_swa"), &vl)) ||
        (rc = need_u32(g, fkey(w, "embedding_length_per_layer_input"), &w->n_pl)) ||
        (rc = opt_u32(g, w, "attention.shared_kv_layers", 0, shared)))
        return rc;
    if (!kvt_gguf_get(g, fkey(w, "attention.layer_norm_rms_epsilon")))
        return kvt_fail(KVT_EFORMAT, "missing metadata key %s", fkey(w, "attention.layer_norm_rms_epsilon"));
    if (!*hd_swa || *hd_swa % 2 || *hd_swa > 1024 || vl != *hd_swa)
        return kvt_fail(KVT_EFORMAT, "%s: attention.key_length_swa %u and value_length_swa %u: not one even length up "
                        "to 1024", w->fam->name, *hd_swa, vl);
    if (!any) return kvt_fail(KVT_EFORMAT, "%s: no window layer in attention.sliding_window_pattern", w->fam->name);
    if (w->n_pl > 65536 || (uint64_t)w->n_pl * w->L > 1u << 24)
        return kvt_fail(KVT_EFORMAT, "%s: embedding_length_per_layer_input %u is too large", w->fam->name, w->n_pl);
    if (*shared >= w->L || w->L - *shared < 2)
        return kvt_fail(KVT_EFORMAT, "%s: attention.shared_kv_layers %u leaves fewer than 2 of %u layers their own K "
                        "and V", w->fam->name, *shared, w->L);
    /* experts: used per token one count (or an array of equal ones), their
     * length that of layer 0 for every layer, as llama.cpp reads them */
    uint32_t *eu = kvt_calloc(2 * (size_t)w->L, sizeof *eu), *fe = eu + w->L;
    if (!eu) return KVT_ENOMEM;
    if (!(rc = opt_u32(g, w, "expert_count", 0, &w->E)) &&
        !(rc = layer_u32(g, w, "expert_used_count", false, 0, eu)) &&
        !(rc = layer_u32(g, w, "expert_feed_forward_length", false, 0, fe))) {
        w->Eu = eu[0];
        w->Fe = fe[0];
        for (uint32_t l = 1; l < w->L; l++)
            if (eu[l] != w->Eu) rc = kvt_fail(KVT_EFORMAT, "%s: expert_used_count differs by layer", w->fam->name);
        if (!rc && (w->E > 1024 || w->Eu > w->E || w->Eu > 64 || (w->E && (!w->Eu || !w->Fe)) || w->Fe > 1u << 20))
            rc = kvt_fail(KVT_EFORMAT, "%s: inconsistent experts: expert_count %u, expert_used_count %u, "
                          "expert_feed_forward_length %u", w->fam->name, w->E, w->Eu, w->Fe);
    }
    free(eu);
    return rc;
}

/* gemma4's own tensors of layer l: the output scale, the experts (a layer
 * with ffn_gate_inp), the per-layer embedding's gate and projection. The
 * per-tensor output scales llama.cpp also reads (an NVFP4 file's) are
 * refused: kvtier does not apply them. */
static int gemma4_layer(const kvt_gguf *g, llama_weights *w, uint32_t l)
{
    llama_layer *ly = &w->layers[l];
    size_t D = w->D;
    char nm[96];
    int rc = KVT_OK;
#define NAME(s) (snprintf(nm, sizeof nm, "blk.%u.%s", l, s), nm)
    static const char *const scaled[] = {"attn_q.scale", "attn_k.scale", "attn_v.scale", "attn_output.scale",
                                         "ffn_gate.scale", "ffn_up.scale", "ffn_down.scale", "ffn_gate_exps.scale",
                                         "ffn_up_exps.scale", "attn_qkv.weight"};
    for (size_t i = 0; i < sizeof scaled / sizeof *scaled; i++)
        if (kvt_gguf_find_tensor(g, NAME(scaled[i])))
            return kvt_fail(KVT_EUNSUPPORTED, "%s: tensor %s is not supported", w->fam->name, nm);
    if (kvt_gguf_find_tensor(g, NAME("layer_output_scale.weight"))) {
        if ((rc = kvt_tensor_f32(g, nm, 1, 1, &ly->out_scale))) return rc;
        if (!isfinite(*ly->out_scale)) return kvt_fail(KVT_EFORMAT, "%s: %s is not finite", w->fam->name, nm);
    }
    if (kvt_gguf_find_tensor(g, NAME("ffn_gate_inp.weight"))) {
        if (!w->E) return kvt_fail(KVT_EFORMAT, "%s: %s without %s", w->fam->name, nm, fkey(w, "expert_count"));
        if ((rc = kvt_tensor_f32(g, nm, D, w->E, &ly->gate_inp)) ||
            (rc = kvt_tensor_f32(g, NAME("ffn_gate_inp.scale"), D, 1, &ly->gate_inp_s)) ||
            (rc = kvt_tensor_f32(g, NAME("pre_ffw_norm_2.weight"), D, 1, &ly->pre_ffn2)) ||
            (rc = kvt_tensor_f32(g, NAME("post_ffw_norm_1.weight"), D, 1, &ly->post_ffn1)) ||
            (rc = kvt_tensor_f32(g, NAME("post_ffw_norm_2.weight"), D, 1, &ly->post_ffn2)))
            return rc;
        if ((ly->gate_up = kvt_gguf_find_tensor(g, NAME("ffn_gate_up_exps.weight")) != NULL))
            rc = kvt_tensor_mat3(g, nm, D, 2 * (uint64_t)w->Fe, w->E, &ly->gate_x);
        else if (!(rc = kvt_tensor_mat3(g, NAME("ffn_gate_exps.weight"), D, w->Fe, w->E, &ly->gate_x)))
            rc = kvt_tensor_mat3(g, NAME("ffn_up_exps.weight"), D, w->Fe, w->E, &ly->up_x);
        if (rc || (rc = kvt_tensor_mat3(g, NAME("ffn_down_exps.weight"), w->Fe, D, w->E, &ly->down_x)))
            return rc;
        if (kvt_gguf_find_tensor(g, NAME("ffn_down_exps.scale")) &&
            (rc = kvt_tensor_f32(g, nm, w->E, 1, &ly->down_s)))
            return rc;
    }
    if (w->n_pl && ((rc = kvt_tensor_mat(g, NAME("inp_gate.weight"), D, w->n_pl, &ly->inp_gate)) ||
                    (rc = kvt_tensor_mat(g, NAME("proj.weight"), w->n_pl, D, &ly->proj)) ||
                    (rc = kvt_tensor_f32(g, NAME("post_norm.weight"), D, 1, &ly->ple_post))))
        return rc;
#undef NAME
    return KVT_OK;
}

/* qwen35's hyperparameters: the DeltaNet layers' shape (ssm.*), which
 * layers they are (attention.recurrent_layers, else every layer but each
 * full_attention_interval-th), the shared expert's length, and the
 * interleaved multi-axis RoPE of its attention layers
 * (rope.dimension_sections): on text every axis but the fourth has the
 * token's position, the fourth 0, so pair i turns by its position unless
 * it falls in the fourth axis (llama.cpp's IMROPE: sector i mod the
 * sections' sum, axis sector mod 3 while sector < 3 x that axis's count),
 * where it stays as it is (a divisor of infinity: angle 0, the pair exact). */
static int hybrid_hparams(const kvt_gguf *g, llama_weights *w)
{
    kvt_gdn_shape *gd = &w->gdn;
    uint32_t inner = 0, interval = 4;
    int rc;
    if ((rc = need_u32(g, fkey(w, "ssm.conv_kernel"), &gd->conv)) ||
        (rc = need_u32(g, fkey(w, "ssm.state_size"), &gd->S)) ||
        (rc = need_u32(g, fkey(w, "ssm.group_count"), &gd->Hk)) ||
        (rc = need_u32(g, fkey(w, "ssm.time_step_rank"), &gd->Hv)) ||
        (rc = need_u32(g, fkey(w, "ssm.inner_size"), &inner)) ||
        (rc = opt_u32(g, w, "full_attention_interval", 4, &interval)))
        return rc;
    gd->D = w->D;
    gd->eps = w->eps;
    if (gd->conv < 2 || gd->conv > 16 || !gd->S || gd->S > 512 || !gd->Hk || !gd->Hv || gd->Hv > 1024 ||
        gd->Hv % gd->Hk || (uint64_t)gd->Hv * gd->S != inner || !interval)
        return kvt_fail(KVT_EFORMAT, "%s: inconsistent DeltaNet shape: conv_kernel %u, state_size %u, group_count %u, "
                        "time_step_rank %u, inner_size %u, full_attention_interval %u", w->fam->name, gd->conv, gd->S,
                        gd->Hk, gd->Hv, inner, interval);
    if (!(w->rec_ix = kvt_calloc(w->L, sizeof *w->rec_ix))) return KVT_ENOMEM;
    const kvt_gguf_val *v = kvt_gguf_get(g, fkey(w, "attention.recurrent_layers"));
    if (v && (v->type != KVT_GGUF_ARR || v->n < w->L || v->elem_type != KVT_GGUF_BOOL))
        return kvt_fail(KVT_EFORMAT, "%s: attention.recurrent_layers is not an array of %u bools", w->fam->name, w->L);
    for (uint32_t l = 0; l < w->L; l++) {
        bool r = v ? v->v.arr[l].v.u != 0 : (l + 1) % interval != 0;
        w->rec_ix[l] = r ? (int32_t)w->n_rec++ : -1;
        w->layers[l].recr = r;
    }
    if (w->fam->moe) {
        if ((rc = need_u32(g, fkey(w, "expert_shared_feed_forward_length"), &w->Fs)) ||
            (rc = opt_f32(g, w, "expert_weights_scale", 0.0f, &w->moe_scale)))
            return rc;
        if (!w->Fs || w->Fs > 1u << 20 || !isfinite(w->moe_scale))
            return kvt_fail(KVT_EFORMAT, "%s: expert_shared_feed_forward_length %u or expert_weights_scale %g",
                            w->fam->name, w->Fs, (double)w->moe_scale);
    }
    const kvt_gguf_val *sv = kvt_gguf_get(g, fkey(w, "rope.dimension_sections"));
    if (!sv || sv->type != KVT_GGUF_ARR || sv->n != 4 ||
        !(sv->elem_type == KVT_GGUF_I32 || sv->elem_type == KVT_GGUF_U32))
        return kvt_fail(KVT_EFORMAT, "%s: rope.dimension_sections missing or not 4 integers", w->fam->name);
    int64_t sec[4], sum = 0;
    for (int i = 0; i < 4; i++) {
        sec[i] = sv->elem_type == KVT_GGUF_I32 ? sv->v.arr[i].v.i : (int64_t)sv->v.arr[i].v.u;
        if (sec[i] < 0 || sec[i] > 4096) return kvt_fail(KVT_EFORMAT, "%s: rope.dimension_sections[%d] = %lld",
                                                       w->fam->name, i, (long long)sec[i]);
        sum += sec[i];
    }
    if (!sum || sum > w->hd || !(sec[0] || sec[1] || sec[2]))
        return kvt_fail(KVT_EFORMAT, "%s: rope.dimension_sections sum to %lld for head length %u", w->fam->name,
                        (long long)sum, w->hd);
    bool still = false;
    for (uint32_t i = 0; i < w->n_rot / 2; i++) {
        int64_t sc = (int64_t)i % sum, ax = sc % 3;
        still |= !(sc < 3 * sec[ax]);
    }
    if (!still) return KVT_OK;
    w->n_ff = w->n_rot / 2;
    if (!(w->rope_ff = kvt_calloc(w->n_ff, sizeof *w->rope_ff))) return KVT_ENOMEM;
    for (uint32_t i = 0; i < w->n_ff; i++) {
        int64_t sc = (int64_t)i % sum, ax = sc % 3;
        w->rope_ff[i] = sc < 3 * sec[ax] ? 1.0f : INFINITY;
    }
    return KVT_OK;
}

/* A qwen35 DeltaNet layer's tensors. */
static int gdn_layer(const kvt_gguf *g, const llama_weights *w, uint32_t l, kvt_gdn_layer *d)
{
    const kvt_gdn_shape *gd = &w->gdn;
    uint64_t C = kvt_gdn_channels(gd), VD = (uint64_t)gd->Hv * gd->S, D = w->D;
    char nm[96];
    int rc;
#define NM(suffix) (snprintf(nm, sizeof nm, "blk.%u.%s", l, suffix), nm)
    if ((rc = kvt_tensor_mat(g, NM("attn_qkv.weight"), D, C, &d->qkv)) ||
        (rc = kvt_tensor_mat(g, NM("attn_gate.weight"), D, VD, &d->gate)) ||
        (rc = kvt_tensor_mat(g, NM("ssm_beta.weight"), D, gd->Hv, &d->beta)) ||
        (rc = kvt_tensor_mat(g, NM("ssm_alpha.weight"), D, gd->Hv, &d->alpha)) ||
        (rc = kvt_tensor_mat(g, NM("ssm_out.weight"), VD, D, &d->out)) ||
        (rc = kvt_tensor_f32(g, NM("ssm_conv1d.weight"), gd->conv, C, &d->conv_w)) ||
        (rc = kvt_tensor_f32(g, NM("ssm_dt.bias"), gd->Hv, 1, &d->dt)) ||
        (rc = kvt_tensor_f32(g, NM("ssm_a"), gd->Hv, 1, &d->a)) ||
        (rc = kvt_tensor_f32(g, NM("ssm_norm.weight"), gd->S, 1, &d->norm)))
        return rc;
#undef NM
    for (uint32_t h = 0; h < gd->Hv; h++)
        if (!isfinite(d->a[h]) || !isfinite(d->dt[h]))
            return kvt_fail(KVT_EFORMAT, "%s: layer %u: ssm_a or ssm_dt.bias of head %u is not finite", w->fam->name, l,
                            h);
    return KVT_OK;
}

/* The cache's layout: streams for the global layers, rings for the window
 * layers (every layer global under the tests' no-window fault), a shared
 * layer reading its source's; the window layer shared layers read keeps
 * its pass's rows apart (swa_src). */
static int llama_layout(llama_weights *w)
{
    uint32_t L = w->L;
    if (!(w->kv_at = kvt_calloc(L, sizeof *w->kv_at)) || !(w->ring_at = kvt_calloc(L + 1, sizeof *w->ring_at)) ||
        !(w->ring_kv = kvt_calloc(L, sizeof *w->ring_kv)) || !(w->stream_kv = kvt_calloc(L, sizeof *w->stream_kv)))
        return KVT_ENOMEM;
    w->swa_src = -1;
    for (uint32_t l = 0; l < L; l++) {
        const llama_layer *ly = &w->layers[l];
        bool swa = w->is_swa && w->is_swa[l];
        if (ly->recr) { /* no rows: its state follows the rings */
            w->kv_at[l] = 0;
        } else if (ly->shared) {
            uint32_t src = w->n_kv - (swa ? 2 : 1);
            w->kv_at[l] = w->kv_at[src];
            if (w->kv_at[src] < 0) w->swa_src = (int32_t)src;
        } else if (swa && kvt_llama_fault != KVT_LLAMA_FAULT_NO_WINDOW) {
            w->ring_kv[w->n_ring] = ly->KV;
            w->ring_at[w->n_ring + 1] = w->ring_at[w->n_ring] + 2 * (size_t)w->swa * ly->KV * sizeof(float);
            w->kv_at[l] = -1 - (int32_t)w->n_ring++;
        } else {
            w->stream_kv[w->n_global] = ly->KV;
            w->kv_at[l] = (int32_t)(2 * w->n_global++);
        }
    }
    w->rec_at = w->ring_at[w->n_ring];
    return KVT_OK;
}

/* The fixed state's bytes: the rings, then the DeltaNet layers' states. */
static size_t state_bytes(const llama_weights *w)
{
    return w->rec_at + w->n_rec * (w->n_rec ? kvt_gdn_state_bytes(&w->gdn) : 0);
}

static float *rec_state(const kvt_session *s, const llama_weights *w, size_t l)
{
    return (float *)(s->cache->state + w->rec_at + (size_t)w->rec_ix[l] * kvt_gdn_state_bytes(&w->gdn));
}

static int llama_load(kvt_model *m, const kvt_gguf *g)
{
    llama_weights *w = kvt_calloc(1, sizeof *w);
    if (!w) return KVT_ENOMEM;
    int rc;
    uint32_t ctx = 0, *Hs = NULL;
    if (!(w->fam = family_of(g))) {
        free(w);
        return kvt_fail(KVT_EFORMAT, "llama: general.architecture is not of the llama family");
    }
    const bool g4 = w->fam->gemma4;
    if ((rc = need_u32(g, fkey(w, "embedding_length"), &w->D)) ||
        (rc = need_u32(g, fkey(w, "block_count"), &w->L)) ||
        (rc = need_u32(g, fkey(w, "context_length"), &ctx)))
        goto fail;
    rc = KVT_EFORMAT;
    if (!w->D || w->D > 65536 || !w->L || w->L > 1024 || ctx == 0) {
        rc = kvt_fail(KVT_EFORMAT, "%s: inconsistent shape D=%u L=%u ctx=%u", w->fam->name, w->D, w->L, ctx);
        goto fail;
    }
    /* head counts, KV head counts (default: the head counts), FFN lengths */
    if (!(Hs = kvt_calloc(3 * (size_t)w->L, sizeof *Hs))) { rc = KVT_ENOMEM; goto fail; }
    uint32_t *Hkvs = Hs + w->L, *Fs = Hs + 2 * w->L;
    if ((rc = layer_u32(g, w, "attention.head_count", true, 0, Hs)) ||
        (rc = layer_u32(g, w, "feed_forward_length", !(w->fam->moe && w->fam->hybrid), 1, Fs)) ||
        (rc = layer_u32(g, w, "attention.head_count_kv", false, 0, Hkvs)))
        goto fail;
    if (!kvt_gguf_get(g, fkey(w, "attention.head_count_kv"))) memcpy(Hkvs, Hs, w->L * sizeof *Hs);
    w->H = Hs[0];
    w->Hkv = Hkvs[0];
    w->F = Fs[0];
    if ((rc = opt_f32(g, w, "attention.layer_norm_rms_epsilon", 1e-5f, &w->eps)) ||
        (rc = opt_f32(g, w, "rope.freq_base", 10000.0f, &w->rope_base)))
        goto fail;
    if (!(w->eps >= 0) || !isfinite(w->eps) || !(w->rope_base > 0) || !isfinite(w->rope_base)) {
        rc = kvt_fail(KVT_EFORMAT, "%s: bad layer_norm_rms_epsilon %g or rope.freq_base %g", w->fam->name,
                      (double)w->eps, (double)w->rope_base);
        goto fail;
    }
    w->hd = w->H && w->D % w->H == 0 ? w->D / w->H : 0;
    uint32_t vl = 0;
    if ((rc = opt_u32(g, w, "attention.key_length", w->hd, &w->hd)) ||
        (rc = opt_u32(g, w, "attention.value_length", 0, &vl)))
        goto fail;
    rc = KVT_EFORMAT;
    if (!w->H || !w->Hkv || !w->F || !w->hd || w->hd % 2 || w->hd > 1024 || (vl && vl != w->hd) ||
        w->H % w->Hkv || w->H > 1024 || w->F > 1u << 20) {
        rc = kvt_fail(KVT_EFORMAT, "%s: inconsistent shape D=%u L=%u H=%u Hkv=%u head_dim=%u (values %u) F=%u ctx=%u",
                      w->fam->name, w->D, w->L, w->H, w->Hkv, w->hd, vl, w->F, ctx);
        goto fail;
    }
    if (w->fam->moe) {
        if ((rc = need_u32(g, fkey(w, "expert_count"), &w->E)) ||
            (rc = need_u32(g, fkey(w, "expert_used_count"), &w->Eu)) ||
            (rc = need_u32(g, fkey(w, "expert_feed_forward_length"), &w->Fe)))
            goto fail;
        if (!w->E || w->E > 1024 || !w->Eu || w->Eu > w->E || w->Eu > 64 || !w->Fe || w->Fe > 1u << 20) {
            rc = kvt_fail(KVT_EFORMAT, "%s: inconsistent experts: %u, %u used, length %u", w->fam->name, w->E, w->Eu,
                          w->Fe);
            goto fail;
        }
    }
    w->scale = 1.0f / sqrtf((float)w->hd);
    uint32_t hd_swa = w->hd, rot_swa, shared = 0;
    if (w->fam->gemma && (rc = gemma_hparams(g, w, &hd_swa, &shared))) goto fail;
    if ((rc = opt_u32(g, w, "rope.dimension_count", w->hd, &w->n_rot)) ||
        (rc = opt_u32(g, w, "rope.dimension_count_swa", w->n_rot, &rot_swa)))
        goto fail;
    if (w->n_rot > w->hd || w->n_rot % 2 || (g4 && (rot_swa > hd_swa || rot_swa % 2))) {
        rc = kvt_fail(KVT_EFORMAT, "%s: rope.dimension_count %u (_swa %u) does not fit head dim %u (_swa %u)",
                      w->fam->name, w->n_rot, rot_swa, w->hd, hd_swa);
        goto fail;
    }
    /* each layer's shape; gemma4's shared layers and what they read */
    w->layers = kvt_calloc(w->L, sizeof *w->layers);
    if (!w->layers) { rc = KVT_ENOMEM; goto fail; }
    w->n_kv = w->L - shared;
    if (w->fam->hybrid && (rc = hybrid_hparams(g, w))) goto fail;
    w->QD = w->KV = w->F = 0;
    for (uint32_t l = 0; l < w->L; l++) {
        llama_layer *ly = &w->layers[l];
        bool swa = w->is_swa && w->is_swa[l];
        uint32_t src = w->n_kv - (swa ? 2 : 1);
        ly->H = Hs[l];
        ly->Hkv = Hkvs[l];
        ly->F = Fs[l];
        ly->hd = g4 && swa ? hd_swa : w->hd;
        ly->n_rot = g4 && swa ? rot_swa : w->n_rot;
        ly->base = swa ? w->rope_base_swa : w->rope_base;
        ly->shared = l >= w->n_kv && kvt_llama_fault != KVT_LLAMA_FAULT_OWN_KV;
        ly->QD = ly->H * ly->hd;
        ly->KV = ly->Hkv * ly->hd;
        if (!ly->H || !ly->Hkv || ly->H % ly->Hkv || ly->H > 1024 || !ly->F || ly->F > 1u << 20) {
            rc = kvt_fail(KVT_EFORMAT, "%s: layer %u: attention.head_count %u, head_count_kv %u, feed_forward_length "
                          "%u are inconsistent", w->fam->name, l, ly->H, ly->Hkv, ly->F);
            goto fail;
        }
        if (l >= w->n_kv && (w->is_swa[src] != swa || Hkvs[src] != ly->Hkv)) {
            rc = kvt_fail(KVT_EFORMAT, "%s: shared layer %u would read layer %u, of another kind "
                          "(attention.sliding_window_pattern, head_count_kv)", w->fam->name, l, src);
            goto fail;
        }
        w->QD = ly->QD > w->QD ? ly->QD : w->QD;
        w->KV = ly->KV > w->KV ? ly->KV : w->KV;
        w->F = ly->F > w->F ? ly->F : w->F;
    }
    if (kvt_llama_fault == KVT_LLAMA_FAULT_OWN_KV) w->n_kv = w->L;
    w->F = w->Fs > w->F ? w->Fs : w->F;
    if (w->fam->hybrid) w->QD *= 2; /* the queries and their gates (the scratch's q holds both) */
    const kvt_gguf_tensor *te = kvt_gguf_find_tensor(g, "token_embd.weight");
    if (!te || te->n_dims != 2 || te->ne[0] != w->D || te->ne[1] == 0 || te->ne[1] > 1u << 24) {
        rc = kvt_fail(KVT_EFORMAT, "llama: token_embd.weight missing or not (%u, V)", w->D);
        goto fail;
    }
    w->V = (uint32_t)te->ne[1];
    if ((rc = kvt_tensor_mat(g, "token_embd.weight", w->D, w->V, &w->tok_embd)) ||
        (rc = kvt_tensor_f32(g, "output_norm.weight", w->D, 1, &w->out_norm)))
        goto fail;
    if (w->n_pl) {
        uint64_t NP = (uint64_t)w->n_pl * w->L;
        if ((rc = kvt_tensor_mat(g, "per_layer_token_embd.weight", NP, w->V, &w->ple_embd)) ||
            (rc = kvt_tensor_mat(g, "per_layer_model_proj.weight", w->D, NP, &w->ple_proj)) ||
            (rc = kvt_tensor_f32(g, "per_layer_proj_norm.weight", w->n_pl, 1, &w->ple_norm)))
            goto fail;
    }
    /* rope_freqs: llama 3's, of its n_rot / 2 pairs; gemma4's, of its
     * global layers' head_dim / 2 pairs (the first n_rot / 2 used), needed
     * there */
    bool any_global = false;
    for (uint32_t l = 0; l < w->L; l++) any_global |= !w->is_swa || !w->is_swa[l];
    if (g4 && any_global && !kvt_gguf_find_tensor(g, "rope_freqs.weight")) {
        rc = kvt_fail(KVT_EFORMAT, "%s: missing tensor rope_freqs.weight (of the global layers)", w->fam->name);
        goto fail;
    }
    if (kvt_gguf_find_tensor(g, "rope_freqs.weight")) {
        w->n_ff = g4 ? w->hd / 2 : w->n_rot / 2;
        if ((rc = kvt_tensor_f32(g, "rope_freqs.weight", w->n_ff, 1, &w->rope_ff))) goto fail;
        for (uint32_t i = 0; i < w->n_ff; i++)
            if (!(w->rope_ff[i] > 0) || !isfinite(w->rope_ff[i])) {
                rc = kvt_fail(KVT_EFORMAT, "%s: rope_freqs.weight[%u] = %g is not a positive factor", w->fam->name, i,
                              (double)w->rope_ff[i]);
                goto fail;
            }
    }
    if (kvt_gguf_find_tensor(g, "output.weight")) {
        if ((rc = kvt_tensor_mat(g, "output.weight", w->D, w->V, &w->out))) goto fail;
    } else {
        w->out = w->tok_embd;
    }
    for (uint32_t l = 0; l < w->L; l++) {
        llama_layer *ly = &w->layers[l];
        ly->ff = g4 && w->is_swa[l] ? NULL : w->rope_ff;
        char nm[96];
#define V(field, suffix, a)                                                      \
        snprintf(nm, sizeof nm, "blk.%u.%s", l, suffix);                         \
        if ((rc = kvt_tensor_f32(g, nm, a, 1, &ly->field))) goto fail;
#define M(field, suffix, a, b)                                                   \
        snprintf(nm, sizeof nm, "blk.%u.%s", l, suffix);                         \
        if ((rc = kvt_tensor_mat(g, nm, a, b, &ly->field))) goto fail;
        V(attn_norm, "attn_norm.weight", w->D)
        if (ly->recr) {
            if ((rc = gdn_layer(g, w, l, &ly->gdn))) goto fail;
        } else {
        M(wq, "attn_q.weight", w->D, w->fam->hybrid ? 2 * ly->QD : ly->QD)
        if (!ly->shared) {
            M(wk, "attn_k.weight", w->D, ly->KV)
            snprintf(nm, sizeof nm, "blk.%u.attn_v.weight", l);
            if (!g4 || kvt_gguf_find_tensor(g, nm)) { M(wv, "attn_v.weight", w->D, ly->KV) }
        }
        if (w->fam->qkv_bias) {
            V(bq, "attn_q.bias", ly->QD)
            V(bk, "attn_k.bias", ly->KV)
            V(bv, "attn_v.bias", ly->KV)
        }
        if (w->fam->qk_norm) {
            V(qn, "attn_q_norm.weight", ly->hd)
            if (!ly->shared) { V(kn, "attn_k_norm.weight", ly->hd) }
        }
        M(wo, "attn_output.weight", ly->QD, w->D)
        }
        if (w->fam->hybrid) { /* qwen35's FFN input norm */
            V(ffn_norm, "post_attention_norm.weight", w->D)
        } else {
            V(ffn_norm, "ffn_norm.weight", w->D)
        }
        if (w->fam->gemma) {
            V(post_attn, "post_attention_norm.weight", w->D)
            V(post_ffn, "post_ffw_norm.weight", w->D)
        }
        if (w->fam->moe) {
            snprintf(nm, sizeof nm, "blk.%u.ffn_gate_inp.weight", l);
            if ((rc = kvt_tensor_f32(g, nm, w->D, w->E, &ly->gate_inp))) goto fail;
            const char *const xn[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
            kvt_wmat *xm[3] = {&ly->gate_x, &ly->up_x, &ly->down_x};
            for (int i = 0; i < 3; i++) {
                snprintf(nm, sizeof nm, "blk.%u.%s.weight", l, xn[i]);
                if ((rc = kvt_tensor_mat3(g, nm, i < 2 ? w->D : w->Fe, i < 2 ? w->Fe : w->D, w->E, xm[i])))
                    goto fail;
            }
            if (w->Fs) {
                M(sh_gate, "ffn_gate_shexp.weight", w->D, w->Fs)
                M(sh_up, "ffn_up_shexp.weight", w->D, w->Fs)
                M(sh_down, "ffn_down_shexp.weight", w->Fs, w->D)
                V(sh_inp, "ffn_gate_inp_shexp.weight", w->D)
            }
        } else {
            M(w1, "ffn_gate.weight", w->D, ly->F)
            M(w3, "ffn_up.weight", w->D, ly->F)
            M(w2, "ffn_down.weight", ly->F, w->D)
        }
#undef V
#undef M
        if (g4 && (rc = gemma4_layer(g, w, l))) goto fail;
    }
    if ((rc = llama_layout(w))) goto fail;
    free(Hs);
    m->weights = w;
    m->arch = w->n_ring || w->n_rec ? &arch_llama_window : &kvt_arch_llama;
    kvt_model_info *in = &m->info;
    in->arch = w->fam->name;
    in->n_vocab = w->V;
    in->n_ctx_train = ctx;
    in->n_embd = w->D;
    in->n_layer = w->L;
    in->n_head = w->H;
    in->n_head_kv = w->Hkv;
    in->head_dim = w->hd;
    in->n_ff = w->F;
    uint64_t D = w->D, np = (uint64_t)w->V * D * (w->out.data == w->tok_embd.data ? 1 : 2) + D;
    for (uint32_t l = 0; l < w->L; l++) {
        const llama_layer *ly = &w->layers[l];
        if (w->fam->hybrid) { /* its matrices, norms and the DeltaNet layers' vectors */
            kvt_wmat *mm[LAYER_MATS];
            for (size_t i = 0, nm = layer_mats(w, l, mm); i < nm; i++) np += (uint64_t)mm[i]->rows * mm[i]->cols;
            np += 2 * D + (ly->qn ? 2 * ly->hd : 0) + (w->fam->moe ? (uint64_t)w->E * (D + 3 * D * w->Fe) + D : 0) +
                  (ly->recr ? kvt_gdn_channels(&w->gdn) * w->gdn.conv + 2 * w->gdn.Hv + w->gdn.S : 0);
            continue;
        }
        np += 2 * D + 2ull * ly->QD * D + (uint64_t)(ly->wk.rows + ly->wv.rows) * D +
              (w->fam->moe ? (uint64_t)w->E * (D + 3 * D * w->Fe) : 3 * D * ly->F) +
              (w->fam->qkv_bias ? ly->QD + 2ull * ly->KV : 0) + (ly->qn ? ly->hd : 0) + (ly->kn ? ly->hd : 0);
        if (g4)
            np += 2 * D + (ly->out_scale ? 1 : 0) + (ly->gate_inp ? (uint64_t)w->E * (D + 3 * D * w->Fe) + 4 * D : 0) +
                  (ly->down_s ? w->E : 0) + (w->n_pl ? 2ull * w->n_pl * D + D : 0);
    }
    if (g4) np += (uint64_t)w->n_pl * w->L * (w->V + D) + w->n_pl + w->n_ff;
    in->n_params = np;
    return KVT_OK;
fail:
    free(Hs);
    llama_free(w);
    return rc;
}

static int llama_cache_new(kvt_session *s)
{
    const llama_weights *w = s->m->weights;
    size_t n = 2 * w->n_global;
    uint32_t (*spec)[2] = kvt_calloc(n ? n : 1, sizeof *spec);
    if (!spec) return KVT_ENOMEM;
    for (size_t i = 0; i < n; i++) {
        spec[i][0] = w->stream_kv[i / 2] * (uint32_t)sizeof(float);
        spec[i][1] = KVT_BLOCK;
    }
    s->cache = kvt_cache_new(n, (const uint32_t (*)[2])spec, s->n_ctx, state_bytes(w));
    free(spec);
    return s->cache ? KVT_OK : KVT_ENOMEM;
}

#define WORK_BUFS 31

/* Every allocation of the scratch but k itself and its DeltaNet scratch,
 * WORK_BUFS of them. */
static void work_bufs(const llama_work *k, void **b)
{
    void *all[WORK_BUFS] = {k->x, k->xb, k->q, k->att, k->k, k->v, k->h1, k->h3, k->sk, k->sv, k->m2,
                            k->pl, k->pl0, k->pg, k->lg, k->ew, k->mo, k->ex, k->ms.xe, k->ms.eo, k->ms.f1,
                            k->ms.f3, k->ms.rt, k->scores, k->qx, k->qg, k->sh, k->shg, k->tok, k->pos,
                            k->lgb};
    memcpy(b, all, sizeof all);
}

static void llama_work_free(void *p)
{
    llama_work *k = p;
    if (!k) return;
    void *b[WORK_BUFS];
    work_bufs(k, b);
    for (size_t i = 0; i < WORK_BUFS; i++) free(b[i]);
    kvt_gdn_work_free(&k->gw);
    free(k);
}

static size_t llama_work_bytes(const void *p)
{
    const llama_work *k = p;
    void *b[WORK_BUFS];
    work_bufs(k, b);
    size_t n = malloc_usable_size((void *)k) + kvt_gdn_work_bytes(&k->gw);
    for (size_t i = 0; i < WORK_BUFS; i++) n += malloc_usable_size(b[i]);
    return n;
}

#define MAX_PASS 256 /* tokens of one pass through the layers */

/* The score rows for the pool's parts (again when the pool grew). */
static int scores_fit(llama_work *k, size_t parts)
{
    if (k->parts >= parts) return KVT_OK;
    size_t n;
    if (!kvt_mul_ok(parts * ATT_TOKS * k->group, k->n_ctx, &n) || n > SIZE_MAX / sizeof(float))
        return kvt_fail(KVT_ENOMEM, "attention scores for %zu threads", parts);
    float *sc = kvt_malloc(n * sizeof(float));
    if (!sc) return KVT_ENOMEM;
    free(k->scores);
    k->scores = sc;
    k->parts = parts;
    return KVT_OK;
}

static int llama_work_new(kvt_session *s)
{
    const llama_weights *w = s->m->weights;
    llama_work *k = kvt_calloc(1, sizeof *k);
    if (!k) return KVT_ENOMEM;
    k->ch = s->chunk < MAX_PASS ? (s->chunk ? s->chunk : 1) : MAX_PASS;
    k->n_ctx = s->n_ctx;
    for (uint32_t l = 0; l < w->L; l++) {
        size_t gr = w->layers[l].H / w->layers[l].Hkv;
        k->group = gr > k->group ? gr : k->group;
    }
    size_t D = w->D, QD = w->QD, KV = w->KV, F = w->F, ch = k->ch, NP = (size_t)w->n_pl * w->L;
    k->x = kvt_malloc(ch * D * sizeof(float));
    k->xb = kvt_malloc(ch * D * sizeof(float));
    k->q = kvt_malloc(ch * QD * sizeof(float));
    k->att = kvt_malloc(ch * QD * sizeof(float));
    k->k = kvt_malloc(ch * KV * sizeof(float));
    k->v = kvt_malloc(ch * KV * sizeof(float));
    k->h1 = kvt_malloc(ch * F * sizeof(float));
    k->h3 = kvt_malloc(ch * F * sizeof(float));
    k->tok = kvt_malloc(ch * sizeof(int32_t));
    k->pos = kvt_malloc(ch * sizeof(size_t));
    bool mok = k->tok && k->pos;
    if (w->swa_src >= 0) {
        k->sk = kvt_malloc(ch * KV * sizeof(float));
        k->sv = kvt_malloc(ch * KV * sizeof(float));
        mok = k->sk && k->sv;
    }
    if (NP) {
        k->pl = kvt_malloc(ch * NP * sizeof(float));
        k->pl0 = kvt_malloc(ch * NP * sizeof(float));
        k->pg = kvt_malloc(ch * w->n_pl * sizeof(float));
        mok = mok && k->pl && k->pl0 && k->pg;
    }
    if (w->E) {
        size_t E = w->E, Eu = w->Eu, Fe = w->Fe;
        k->lg = kvt_malloc(ch * E * sizeof(float));
        k->ew = kvt_malloc(ch * Eu * sizeof(float));
        k->mo = kvt_malloc(ch * D * sizeof(float));
        k->m2 = kvt_malloc(ch * D * sizeof(float));
        k->ex = kvt_malloc(ch * Eu * sizeof(uint32_t));
        /* an expert takes a token at most once: ch rows through it */
        k->ms = (kvt_moe_scratch){kvt_malloc(ch * D * sizeof(float)), kvt_malloc(ch * Eu * D * sizeof(float)),
                                  kvt_malloc(ch * Fe * sizeof(float)), kvt_malloc(ch * Fe * sizeof(float)),
                                  kvt_malloc(ch * Eu * sizeof(uint32_t)), NULL};
        mok = mok && k->lg && k->ew && k->mo && k->m2 && k->ex && k->ms.xe && k->ms.eo && k->ms.f1 && k->ms.f3 &&
              k->ms.rt;
    }
    if (w->fam->hybrid) {
        k->qg = kvt_malloc(ch * QD * sizeof(float));
        mok = mok && k->qg;
        if (w->n_rec) mok = mok && kvt_gdn_work_new(&k->gw, &w->gdn, ch) == KVT_OK;
        if (w->Fs) {
            k->sh = kvt_malloc(ch * D * sizeof(float));
            k->shg = kvt_malloc(ch * sizeof(float));
            mok = mok && k->sh && k->shg;
        }
    }
    /* the largest quantised activations any matrix needs */
    size_t qb = kvt_q_act_bytes(w->tok_embd.type, 0, 0);
    for (uint32_t l = 0; l <= w->L; l++) {
        const llama_layer *ly = &w->layers[l < w->L ? l : 0];
        const kvt_wmat *m[20] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo, &ly->w1, &ly->w3, &ly->w2,
                                 &ly->gate_x, &ly->up_x, &ly->down_x, &ly->inp_gate, &ly->proj,
                                 &ly->gdn.qkv, &ly->gdn.gate, &ly->gdn.beta, &ly->gdn.alpha, &ly->gdn.out,
                                 &ly->sh_gate, &ly->sh_up, &ly->sh_down};
        if (l == w->L) { m[0] = &w->out; m[1] = &w->ple_proj; }
        for (int i = 0; i < (l == w->L ? 2 : 20); i++) {
            size_t b = m[i]->rows ? kvt_q_act_bytes(m[i]->type, ch, m[i]->cols) : 0;
            qb = b > qb ? b : qb;
        }
    }
    bool qok = !qb || (k->qx = kvt_malloc(qb));
    k->ms.qx = k->qx;
    int rc = k->x && k->xb && k->q && k->att && k->k && k->v && k->h1 && k->h3 && qok && mok
                 ? scores_fit(k, kvt_pool_size(s->pool))
                 : KVT_ENOMEM;
    if (rc) {
        llama_work_free(k);
        return rc == KVT_ENOMEM ? kvt_fail(KVT_ENOMEM, "llama scratch for %zu tokens", ch) : rc;
    }
    s->work = k;
    return KVT_OK;
}

/* Attention for rows [b, e) of (token group, KV head) pairs: the query
 * heads that share a KV head, for up to ATT_TOKS consecutive tokens, read
 * each block of K and V rows once (while it is in the core's cache). Per
 * query head the operations are those of one head alone (scores in
 * position order, one softmax, values mixed in position order), so
 * grouping changes no bit. */
struct attn_ctx {
    const llama_weights *w;
    const llama_layer *ly; /* the layer (its shape) */
    const kvt_cache *cache;
    size_t stream, pos0, n; /* stream: a global layer's K stream (V: the next) */
    size_t swa;        /* a window layer's window (0: every position before) */
    const float *ring; /* a window layer's rings (2, swa, KV): K and V of the positions before pos0;
                        * NULL: a global layer */
    const float *kp, *vp; /* (n, KV) a window layer: this pass's K and V rows */
    const float *q;    /* (n, QD) */
    float *out;        /* (n, QD) */
    float *scores;     /* (parts, ATT_TOKS, group, n_ctx) */
    size_t n_ctx;
};

/* Row j of K (v = 0) or V (v = 1) for attention: *end is the first
 * position past j whose row does not follow it in memory. A global layer's
 * rows are its streams' (contiguous within a block); a window layer's
 * positions before the pass are in its ring (contiguous up to the ring's
 * end), its own in the pass's scratch. Only the rows' values reach the
 * result (each score is its own dot product, values are mixed in position
 * order), so where a run ends changes no bit. */
static const float *rows_at(const struct attn_ctx *c, int v, size_t j, size_t *end)
{
    if (!c->ring) {
        *end = (j / KVT_BLOCK + 1) * KVT_BLOCK;
        return kvt_cache_row_ro(c->cache, c->stream + (size_t)v, j);
    }
    size_t KV = c->ly->KV, W = c->swa;
    if (j >= c->pos0) {
        *end = SIZE_MAX;
        return (v ? c->vp : c->kp) + (j - c->pos0) * KV;
    }
    size_t slot = j % W;
    *end = j + (W - slot) < c->pos0 ? j + (W - slot) : c->pos0;
    return c->ring + ((size_t)v * W + slot) * KV;
}

/* One span of one kind of work (scores, or values mixed: mix) for tokens
 * u .. u + nu - 1 of a group (nu 1 or 2) over positions [ja, je) of a run
 * of rows kr that starts at j0. Two tokens go through the kernels together
 * (each row read once for both), one token's query heads as kvt_dots_rows
 * and kvt_axpys_rows take them. */
struct span { const struct attn_ctx *c; float *att; size_t ldg, i0, kvh; const float *kr; size_t j0; bool mix; };

static void span_run(const struct span *sp, size_t u, size_t nu, size_t ja, size_t je)
{
    if (ja >= je) return;
    const struct attn_ctx *c = sp->c;
    const llama_layer *ly = c->ly;
    size_t group = ly->H / ly->Hkv, hd = ly->hd, row_f = ly->KV, QD = ly->QD;
    float scale = c->w->scale;
    const float *rows = sp->kr + (ja - sp->j0) * row_f;
    if (nu == 1) {
        float *sc = sp->att + u * sp->ldg + ja, *o = c->out + (sp->i0 + u) * QD + sp->kvh * group * hd;
        if (sp->mix) kvt_axpys_rows(o, hd, sc, c->n_ctx, group, rows, row_f, je - ja, hd);
        else kvt_dots_rows(sc, c->n_ctx, c->q + (sp->i0 + u) * QD + sp->kvh * group * hd, hd, group, rows, row_f,
                           je - ja, hd, scale);
        return;
    }
    float *o[32];
    const float *p[32];
    for (size_t h0 = 0; h0 < group; h0 += 16) { /* up to 16 heads of each token at a time */
        size_t nh = group - h0 < 16 ? group - h0 : 16, nq = 0;
        for (size_t x = u; x < u + 2; x++)
            for (size_t h = h0; h < h0 + nh; h++, nq++) {
                float *sc = sp->att + x * sp->ldg + h * c->n_ctx + ja;
                size_t at = (sp->i0 + x) * QD + (sp->kvh * group + h) * hd;
                o[nq] = sp->mix ? c->out + at : sc;
                p[nq] = sp->mix ? sc : c->q + at;
            }
        if (sp->mix) kvt_axpys_qs(nq, o, p, rows, row_f, je - ja, hd);
        else kvt_dots_qs(nq, o, p, rows, row_f, je - ja, hd, scale);
    }
}

static void attn_range(void *arg, uint32_t part, size_t b, size_t e)
{
    struct attn_ctx *c = arg;
    const llama_layer *ly = c->ly;
    size_t Hkv = ly->Hkv, hd = ly->hd, group = ly->H / ly->Hkv, ldg = group * c->n_ctx, QD = ly->QD;
    float *att = c->scores + (size_t)part * ATT_TOKS * ldg;
    /* tokens in pairs where the kernels take queries anywhere (AVX-512) */
    size_t step = kvt_kernels_avx512() && hd % 64 == 0 ? 2 : 1;
    bool anchored = kvt_llama_fault == KVT_LLAMA_FAULT_WINDOW_CHUNK;
    for (size_t r = b; r < e; r++) {
        /* token groups in the order 0, last, 1, last - 1, ...: the causal
         * work of a group grows with its position, so each thread's
         * contiguous range of units gets its share of early and late ones */
        size_t gi = r / Hkv, ng = (c->n + ATT_TOKS - 1) / ATT_TOKS, g = gi % 2 ? ng - 1 - gi / 2 : gi / 2;
        size_t i0 = g * ATT_TOKS, kvh = r % Hkv, t0 = c->pos0 + i0;
        size_t nt = c->n - i0 < ATT_TOKS ? c->n - i0 : ATT_TOKS, t_last = t0 + nt - 1;
        /* token t attends to positions lo(t) .. t: all of them, or in a
         * window layer the last swa (llama.cpp's standard window) */
#define AT(t) (anchored ? c->pos0 : (t)) /* KVT_LLAMA_FAULT_WINDOW_CHUNK: the pass's first token's window */
#define LO(t) (c->swa && AT(t) + 1 > c->swa ? AT(t) + 1 - c->swa : 0)
        /* rows a run at a time (a block, or a stretch of a ring): one lookup
         * per run for the group's tokens. A pair of tokens t, t + 1 shares
         * the positions [a1, e0) of a run: the first token's own (a window's
         * first position) go before them, the second's own (its diagonal)
         * after, so each token still meets its positions in order. */
        for (int mix = 0; mix < 2; mix++) {
            if (mix)
                for (size_t u = 0; u < nt; u++) {
                    size_t t = t0 + u;
                    kvt_softmax_rows(att + u * ldg + LO(t), c->n_ctx, group, t + 1 - LO(t));
                    memset(c->out + (i0 + u) * QD + kvh * group * hd, 0, group * hd * sizeof(float));
                }
            for (size_t j0 = LO(t0), j1; j0 <= t_last; j0 = j1) {
                struct span sp = {c, att, ldg, i0, kvh, rows_at(c, mix, j0, &j1) + kvh * hd, j0, mix};
                for (size_t u = 0; u < nt; u += step) {
                    size_t t = t0 + u, a0 = LO(t) > j0 ? LO(t) : j0, e0 = t + 1 < j1 ? t + 1 : j1;
                    if (step == 1 || u + 1 == nt) { span_run(&sp, u, 1, a0, e0); continue; }
                    size_t a1 = LO(t + 1) > j0 ? LO(t + 1) : j0, e1 = t + 2 < j1 ? t + 2 : j1;
                    if (a1 >= e0) { /* nothing shared */
                        span_run(&sp, u, 1, a0, e0);
                        span_run(&sp, u + 1, 1, a1, e1);
                        continue;
                    }
                    span_run(&sp, u, 1, a0, a1);
                    span_run(&sp, u, 2, a1, e0);
                    span_run(&sp, u + 1, 1, e0, e1);
                }
            }
        }
#undef LO
#undef AT
    }
}

/* h1 = silu(h1) * h3 over a range of elements (each on its own: any split
 * gives the same bytes). */
struct swiglu_ctx { float *h1; const float *h3; bool gelu; };

static void swiglu_range(void *arg, size_t j0, size_t j1)
{
    struct swiglu_ctx *c = arg;
    (c->gelu ? kvt_geglu : kvt_swiglu)(c->h1 + j0, c->h3 + j0, j1 - j0);
}

/* The per-token steps of a pass, over a range of its tokens (each token on
 * its own: any split gives the same bytes): x += add (when set), then
 * xb = rmsnorm(x) (when norm is set); or the biases, head norms and RoPE of
 * q and k (and v's bias and norm). */
struct tok_ctx {
    const llama_weights *w;
    const llama_layer *ly;
    float *x, *xb, *q, *k, *v; /* k, v NULL: a shared layer's (q alone) */
    const float *add, *norm;
    const size_t *pos; /* (n) the tokens' positions */
    const float *post;  /* gemma: add is rmsnorm(add) * post first (NULL: as it is) */
};

static void add_norm_range(void *arg, size_t i0, size_t i1)
{
    struct tok_ctx *c = arg;
    size_t D = c->w->D;
    for (size_t i = i0; i < i1; i++) {
        float *x = c->x + i * D;
        if (c->post) /* add is xb: normed in place */
            kvt_rmsnorm(c->xb + i * D, c->xb + i * D, c->post, D, c->w->eps);
        if (c->add)
            for (size_t j = 0; j < D; j++) x[j] += c->add[i * D + j];
        if (c->norm) kvt_rmsnorm(c->xb + i * D, x, c->norm, D, c->w->eps);
    }
}

int kvt_llama_fault;

static void add_bias(float *x, const float *b, size_t n)
{
    for (size_t j = 0; j < n; j++) x[j] += b[j];
}

static void rope_range(void *arg, size_t i0, size_t i1)
{
    struct tok_ctx *c = arg;
    const llama_weights *w = c->w;
    const llama_layer *ly = c->ly;
    size_t hd = ly->hd, nk = c->k ? ly->Hkv : 0;
    for (size_t i = i0; i < i1; i++) {
        float *q = c->q + i * ly->QD, *k = c->k ? c->k + i * ly->KV : NULL, *v = c->v ? c->v + i * ly->KV : NULL;
        if (ly->bq) {
            add_bias(q, ly->bq, ly->QD);
            add_bias(k, ly->bk, ly->KV);
            add_bias(v, ly->bv, ly->KV);
        }
        if (ly->qn) {
            for (size_t h = 0; h < ly->H; h++) kvt_rmsnorm(q + h * hd, q + h * hd, ly->qn, hd, w->eps);
            for (size_t h = 0; h < nk; h++) kvt_rmsnorm(k + h * hd, k + h * hd, ly->kn, hd, w->eps);
        }
        if (w->fam->gemma4) /* V's heads RMS-normed, without a weight */
            for (size_t h = 0; h < nk; h++)
                kvt_rmsnorm(v + h * hd, v + h * hd, kvt_llama_fault == KVT_LLAMA_FAULT_V_NORM_WEIGHT ? ly->kn : NULL,
                            hd, w->eps);
        kvt_rope_heads(q, ly->H, k, nk, hd, ly->n_rot, c->pos[i], ly->base, ly->ff,
                       w->fam->neox && kvt_llama_fault != KVT_LLAMA_FAULT_ROPE_PAIRS);
    }
}

/* Softmax router probabilities of the n tokens' logits (wk->lg), their Eu
 * best (kvt_moe_select), those probabilities normalised to sum 1, as
 * llama.cpp's build_moe_ffn with norm_w (or the choice kvt_force imposes,
 * for the tests). */
static void moe_route(llama_work *wk, const llama_weights *w, size_t l, size_t n)
{
    size_t E = w->E, Eu = w->Eu;
    for (size_t i = 0; i < n; i++) {
        float *p = wk->lg + i * E, m = p[0], z = 0;
        for (size_t e = 1; e < E; e++) m = p[e] > m ? p[e] : m;
        for (size_t e = 0; e < E; e++) { p[e] = kvt_expf(p[e] - m); z += p[e]; }
        for (size_t e = 0; e < E; e++) p[e] /= z;
        uint32_t *ex = wk->ex + i * Eu;
        kvt_moe_select(p, E, Eu, ex);
        const kvt_forced *fz = kvt_force;
        if (fz && wk->pos[i] < fz->n && fz->Eu == Eu && l < 64 && fz->ex[l])
            kvt_moe_force_choice(fz->ex[l], fz->ex_gap[l], wk->pos[i], ex, Eu, p, E, false);
        for (size_t j = 0; j < Eu; j++) wk->ew[i * Eu + j] = p[ex[j]];
        if (kvt_llama_fault != KVT_LLAMA_FAULT_MOE_WEIGHTS) kvt_moe_normalise(wk->ew + i * Eu, Eu);
        if (w->moe_scale != 0.0f && w->moe_scale != 1.0f)
            for (size_t j = 0; j < Eu; j++) wk->ew[i * Eu + j] *= w->moe_scale;
    }
}

/* The routed experts of layer l over n tokens h (n, D), their weighted sum
 * into wk->mo. */
static void moe_experts(kvt_pool *pool, llama_work *wk, const llama_weights *w, size_t l, const float *h, size_t n)
{
    const llama_layer *ly = &w->layers[l];
    size_t D = w->D;
    memset(wk->mo, 0, n * D * sizeof(float));
    kvt_moe m = {&ly->gate_x, ly->gate_up ? &ly->gate_x : &ly->up_x, &ly->down_x, w->E, w->Eu, w->Fe, D, 0.0f,
                 w->fam->gemma4, ly->down_s, ly->gate_up ? 2 * (size_t)w->Fe : 0, ly->gate_up ? w->Fe : 0};
    kvt_moe_run(pool, &m, h, n, wk->ex, wk->ew, &wk->ms, wk->mo);
}

/* qwen3moe's FFN: the routed experts of xb (n, D), their output into xb. */
static void moe_ffn(kvt_pool *pool, llama_work *wk, const llama_weights *w, size_t l, float *xb, size_t n)
{
    kvt_matmul(pool, wk->lg, w->layers[l].gate_inp, xb, n, w->D, w->E);
    moe_route(wk, w, l, n);
    moe_experts(pool, wk, w, l, xb, n);
    memcpy(xb, wk->mo, n * w->D * sizeof(float));
}

/* qwen35moe's shared expert on the FFN input xb: its SwiGLU MLP into
 * wk->sh, its gate's logit (sh_inp . x) into wk->shg. */
static void shared_expert(kvt_pool *pool, llama_work *wk, const llama_weights *w, const llama_layer *ly, size_t n)
{
    size_t D = w->D;
    kvt_matmul_w(pool, wk->h1, &ly->sh_gate, wk->xb, n, wk->qx);
    kvt_matmul_w_next(pool, wk->h3, &ly->sh_up, &ly->sh_gate, wk->xb, n, wk->qx);
    kvt_swiglu(wk->h1, wk->h3, n * w->Fs);
    kvt_matmul_w(pool, wk->sh, &ly->sh_down, wk->h1, n, wk->qx);
    for (size_t i = 0; i < n; i++) wk->shg[i] = kvt_dot(ly->sh_inp, wk->xb + i * D, D);
}

/* Tokens a thread takes at least in those steps (a decode step runs them
 * without waking the pool). */
#define TOK_MIN 32

/* gemma4's per-token steps around its experts, over a range of tokens:
 * before (stage 0), the shared MLP's output xb normed (post_ffw_norm_1),
 * the experts' input m2 (pre_ffw_norm_2 of the residual x) and the
 * router's input mo (x RMS-normed without a weight, times 1 / sqrt(D), times
 * ffn_gate_inp.scale); after (stage 1), xb += the experts' sum mo normed
 * (post_ffw_norm_2). */
struct g4_ctx { const llama_weights *w; const llama_layer *ly; llama_work *wk; int stage; };

static void g4_moe_range(void *arg, size_t i0, size_t i1)
{
    struct g4_ctx *c = arg;
    const llama_weights *w = c->w;
    const llama_layer *ly = c->ly;
    size_t D = w->D;
    float rs = 1.0f / sqrtf((float)D);
    for (size_t i = i0; i < i1; i++) {
        float *xb = c->wk->xb + i * D, *x = c->wk->x + i * D, *mo = c->wk->mo + i * D;
        if (c->stage == 0) {
            kvt_rmsnorm(xb, xb, ly->post_ffn1, D, w->eps);
            kvt_rmsnorm(c->wk->m2 + i * D, x, ly->pre_ffn2, D, w->eps);
            kvt_rmsnorm(mo, x, NULL, D, w->eps);
            for (size_t j = 0; j < D; j++) mo[j] = mo[j] * rs * ly->gate_inp_s[j];
        } else {
            kvt_rmsnorm(mo, mo, ly->post_ffn2, D, w->eps);
            for (size_t j = 0; j < D; j++) xb[j] += mo[j];
        }
    }
}

/* gemma4's FFN of a layer with experts: x holds the residual, xb its
 * ffn_norm; the shared MLP's output xb (h1, h3 are the MLP's), then xb =
 * that normed plus the experts' sum normed. */
static void g4_moe_ffn(kvt_pool *pool, llama_work *wk, const llama_weights *w, size_t l, size_t n)
{
    const llama_layer *ly = &w->layers[l];
    struct g4_ctx gc = {w, ly, wk, 0};
    kvt_pool_for(pool, n, TOK_MIN, g4_moe_range, &gc);
    kvt_matmul(pool, wk->lg, ly->gate_inp, wk->mo, n, w->D, w->E);
    moe_route(wk, w, l, n);
    moe_experts(pool, wk, w, l, wk->m2, n);
    gc.stage = 1;
    kvt_pool_for(pool, n, TOK_MIN, g4_moe_range, &gc);
}

/* gemma4's per-layer embeddings, per token over a range: stage 0, the
 * layers' inputs pl (n, L, n_pl) from the projection of the scaled
 * embedding (in pl) and the token's row (pl0); stage 1, layer l's gate pg
 * = gelu(pg) * its input (ggml's GELU, kvt_geglu's); stage 2, the residual
 * scaled by the layer's output scale. */
struct ple_ctx { const llama_weights *w; llama_work *wk; const int32_t *tok; size_t l; int stage; };

static void ple_range(void *arg, size_t i0, size_t i1)
{
    struct ple_ctx *c = arg;
    const llama_weights *w = c->w;
    size_t np = w->n_pl, NP = np * w->L;
    float rd = 1.0f / sqrtf((float)w->D), rp = sqrtf((float)np), r2 = 1.0f / sqrtf(2.0f);
    for (size_t i = i0; i < i1; i++) {
        if (c->stage == 1) {
            kvt_geglu(c->wk->pg + i * np, c->wk->pl + i * NP + c->l * np, np);
            continue;
        }
        if (c->stage == 2) {
            float sc = *w->layers[c->l].out_scale, *x = c->wk->x + i * w->D;
            for (size_t j = 0; j < w->D; j++) x[j] *= sc;
            continue;
        }
        float *p = c->wk->pl + i * NP, *p0 = c->wk->pl0 + i * NP;
        const uint8_t *row = w->ple_embd.data + (size_t)c->tok[i] * w->ple_embd.row_bytes;
        kvt_quant_to_f32(w->ple_embd.type, row, p0, NP);
        for (size_t l = 0; l < w->L; l++) {
            float *a = p + l * np;
            for (size_t j = 0; j < np; j++) a[j] *= rd;
            kvt_rmsnorm(a, a, w->ple_norm, np, w->eps);
        }
        for (size_t j = 0; j < NP; j++) p[j] = (p[j] + p0[j] * rp) * r2;
    }
}

/* K and V rows of a pass's last min(n, W) positions into a window layer's
 * rings (KV floats each). */
static void ring_put(float *ring, size_t W, size_t KV, const float *k, const float *v, size_t n, size_t pos0)
{
    for (size_t i = n > W ? n - W : 0; i < n; i++) {
        size_t slot = (pos0 + i) % W;
        memcpy(ring + slot * KV, k + i * KV, KV * sizeof(float));
        memcpy(ring + (W + slot) * KV, v + i * KV, KV * sizeof(float));
    }
}

static float *ring_of(const kvt_session *s, const llama_weights *w, int32_t at)
{
    return at < 0 ? (float *)(s->cache->state + w->ring_at[-1 - at]) : NULL;
}

/* A pass over k segments (kvt_seg) of distinct sessions, their tokens one
 * after another in the scratch, at most ch in all. Every step on a token
 * on its own and every matrix product runs over all the pass's tokens
 * (each row of a product is its own dot products, in the order of its
 * columns: the same bytes whatever the other rows); what reads or writes a
 * session's cache (attention, the rows and rings kept, the DeltaNet state)
 * runs per segment on that session's own. So a segment's results are those
 * of a pass of it alone. */
static int llama_pass(llama_work *wk, const kvt_seg *sg, size_t k)
{
    kvt_session *s0 = sg[0].s;
    kvt_pool *pool = s0->pool;
    const llama_weights *w = s0->m->weights;
    size_t D = w->D, n = 0, nl = 0;
    float *x = wk->x, *xb = wk->xb, *q = wk->q, *att = wk->att, *h1 = wk->h1, *h3 = wk->h3;
    for (size_t g = 0; g < k; g++) {
        for (size_t i = 0; i < sg[g].n; i++, n++) {
            int32_t t = sg[g].tok[i];
            if (t < 0 || (uint32_t)t >= w->V) return kvt_fail(KVT_EINVAL, "token id %d out of range [0, %u)", t, w->V);
            wk->tok[n] = t;
            wk->pos[n] = kvt_llama_fault == KVT_LLAMA_FAULT_BATCH_POS && k > 1 ? n : sg[g].pos0 + i;
        }
        nl += sg[g].logits && sg[g].lfrom < sg[g].n ? sg[g].n - sg[g].lfrom : 0;
    }
    float *lgb = NULL; /* several segments' logits: first together, then to each */
    if (k > 1 && nl) {
        if (wk->lgb_rows < nl) {
            float *p = kvt_malloc(nl * (size_t)w->V * sizeof(float));
            if (!p) return kvt_fail(KVT_ENOMEM, "logits of %zu rows", nl);
            free(wk->lgb);
            wk->lgb = p;
            wk->lgb_rows = nl;
        }
        lgb = wk->lgb;
    }
    const int32_t *tok = wk->tok;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *row = w->tok_embd.data + (size_t)tok[i] * w->tok_embd.row_bytes;
        kvt_quant_to_f32(w->tok_embd.type, row, x + i * D, D);
        if (w->fam->gemma)
            for (size_t j = 0; j < D; j++) x[i * D + j] *= sqrtf((float)D);
    }
    bool ple = w->n_pl && kvt_llama_fault != KVT_LLAMA_FAULT_NO_PLE;
    struct ple_ctx pc = {w, wk, tok, 0, 0};
    if (ple) {
        kvt_matmul_w(pool, wk->pl, &w->ple_proj, x, n, wk->qx);
        kvt_pool_for(pool, n, TOK_MIN, ple_range, &pc);
    }
    bool pending = false; /* xb holds the layer before's FFN output, not yet added to x */
    for (size_t l = 0; l < w->L; l++) {
        const llama_layer *ly = &w->layers[l];
        int32_t at = w->kv_at[l];
        size_t window = at < 0 ? w->swa : 0; /* a window layer: the positions its ring holds and its own */
        size_t KV = ly->KV, hd = ly->hd;
        /* this layer's K and V rows: the scratch's, or those kept for the
         * shared layers (those layers computing none) */
        float *kk = (int32_t)l == w->swa_src ? wk->sk : wk->k, *v = (int32_t)l == w->swa_src ? wk->sv : wk->v;
        /* the residual of the layer before (none before the first, or it
         * was added at its end), then this layer's attention norm */
        struct tok_ctx tc = {w, ly, x, xb, q, ly->shared ? NULL : kk, ly->shared ? NULL : v, pending ? xb : NULL,
                             ly->attn_norm, wk->pos, pending ? w->layers[l - 1].post_ffn : NULL};
        kvt_pool_for(pool, n, TOK_MIN, add_norm_range, &tc);
        if (ly->recr) { /* qwen35's DeltaNet layer: its output into xb, each segment on its own state */
            kvt_gdn_fault_grouped = kvt_llama_fault == KVT_LLAMA_FAULT_GDN_GROUPED;
            for (size_t g = 0, off = 0; g < k; off += sg[g++].n)
                kvt_gdn_forward(pool, &w->gdn, &ly->gdn, rec_state(sg[g].s, w, l), &wk->gw, xb + off * D, sg[g].n,
                                xb + off * D, wk->qx);
            goto ffn;
        }
        kvt_matmul_w(pool, w->fam->hybrid ? wk->qg : q, &ly->wq, xb, n, wk->qx);
        if (w->fam->hybrid) /* each head's queries, then its gate: the queries on their own */
            for (size_t i = 0; i < n; i++)
                for (size_t h = 0; h < ly->H; h++)
                    memcpy(q + i * ly->QD + h * hd, wk->qg + (i * ly->H + h) * 2 * hd, hd * sizeof(float));
        if (!ly->shared) {
            kvt_matmul_w_next(pool, kk, &ly->wk, &ly->wq, xb, n, wk->qx);
            if (ly->wv.rows) kvt_matmul_w_next(pool, v, &ly->wv, &ly->wk, xb, n, wk->qx);
            else memcpy(v, kk, n * KV * sizeof(float)); /* gemma4: V is K's projection */
        }
        kvt_pool_for(pool, n, TOK_MIN, rope_range, &tc);
        for (size_t g = 0, off = 0; g < k; off += sg[g++].n) {
            kvt_session *s = sg[g].s;
            size_t sn = sg[g].n, pos0 = sg[g].pos0;
            float *ring = ring_of(s, w, at);
            for (size_t i = 0; i < sn && !ring && !ly->shared; i++) {
                float *kr = kvt_cache_row(s->cache, (size_t)at, pos0 + i);
                float *vr = kvt_cache_row(s->cache, (size_t)at + 1, pos0 + i);
                if (!kr || !vr) return kvt_fail(KVT_ENOMEM, "cache row %zu", pos0 + i);
                memcpy(kr, kk + (off + i) * KV, KV * sizeof(float));
                memcpy(vr, v + (off + i) * KV, KV * sizeof(float));
            }
            /* a shared window layer: its source's ring as before the pass,
             * and its source's rows of the pass */
            const float *kp = (ly->shared ? wk->sk : kk) + off * KV, *vp = (ly->shared ? wk->sv : v) + off * KV;
            struct attn_ctx ac = {w, ly, s->cache, ring ? 0 : (size_t)at, pos0, sn, window, ring, kp, vp,
                                  q + off * ly->QD, att + off * ly->QD, wk->scores, wk->n_ctx};
            /* one (token group, KV head) scores and mixes up to pos0 + sn
             * rows per query head and token: give a thread at least 128K
             * multiply-adds (measured in bench/README.md), so a tiny model's
             * decode step does not pay for waking the pool */
            size_t span = window && window < pos0 + sn ? window : pos0 + sn;
            size_t ng = (sn + ATT_TOKS - 1) / ATT_TOKS,
                   per = 2 * span * hd * (ly->H / ly->Hkv) * (sn < ATT_TOKS ? sn : ATT_TOKS);
            kvt_pool_for_part(pool, ng * ly->Hkv, (131072 + per - 1) / per, attn_range, &ac);
            /* only now does a window layer's ring take the pass's last rows
             * (the shared layers' source: once they all have read it) */
            if (ring && !ly->shared &&
                ((int32_t)l != w->swa_src || kvt_llama_fault == KVT_LLAMA_FAULT_SOURCE_RING_EARLY))
                ring_put(ring, w->swa, KV, kk + off * KV, v + off * KV, sn, pos0);
        }
        if (w->fam->hybrid) /* qwen35: the output times sigmoid(gate) */
            for (size_t i = 0; i < n; i++)
                for (size_t h = 0; h < ly->H; h++) {
                    const float *gt = wk->qg + (i * ly->H + h) * 2 * hd + hd;
                    float *o = att + i * ly->QD + h * hd;
                    for (size_t j = 0; j < hd; j++) o[j] *= 1.0f / (1.0f + kvt_expf(-gt[j]));
                }
        kvt_matmul_w(pool, xb, &ly->wo, att, n, wk->qx);
    ffn:
        tc.add = xb;
        tc.norm = ly->ffn_norm;
        tc.post = ly->post_attn;
        kvt_pool_for(pool, n, TOK_MIN, add_norm_range, &tc);
        if (ly->gate_inp && !w->fam->gemma4) {
            if (w->Fs) shared_expert(pool, wk, w, ly, n);
            moe_ffn(pool, wk, w, l, xb, n);
            if (w->Fs) /* qwen35moe: + the shared expert times sigmoid(its gate) */
                for (size_t i = 0; i < n; i++) {
                    float gt = 1.0f / (1.0f + kvt_expf(-wk->shg[i]));
                    for (size_t j = 0; j < D; j++) xb[i * D + j] += wk->sh[i * D + j] * gt;
                }
        } else {
            kvt_matmul_w(pool, h1, &ly->w1, xb, n, wk->qx);
            kvt_matmul_w_next(pool, h3, &ly->w3, &ly->w1, xb, n, wk->qx);
            struct swiglu_ctx sc = {h1, h3, w->fam->gemma};
            kvt_pool_for(pool, n * ly->F, 16384, swiglu_range, &sc);
            kvt_matmul_w(pool, xb, &ly->w2, h1, n, wk->qx);
            if (ly->gate_inp) g4_moe_ffn(pool, wk, w, l, n);
        }
        pending = true;
        if (!w->fam->gemma4) continue;
        /* gemma4: the residual now, then the per-layer embedding, then the
         * output scale */
        tc.add = xb;
        tc.norm = NULL;
        tc.post = ly->post_ffn;
        kvt_pool_for(pool, n, TOK_MIN, add_norm_range, &tc);
        pending = false;
        if (ple) {
            pc.l = l;
            pc.stage = 1;
            kvt_matmul_w(pool, wk->pg, &ly->inp_gate, x, n, wk->qx);
            kvt_pool_for(pool, n, TOK_MIN, ple_range, &pc);
            kvt_matmul_w(pool, xb, &ly->proj, wk->pg, n, wk->qx);
            tc.post = ly->ple_post;
            kvt_pool_for(pool, n, TOK_MIN, add_norm_range, &tc);
        }
        if (ly->out_scale) {
            pc.l = l;
            pc.stage = 2;
            kvt_pool_for(pool, n, TOK_MIN, ple_range, &pc);
        }
    }
    if (w->swa_src >= 0) /* the shared layers' source ring, read by all of them */
        for (size_t g = 0, off = 0; g < k; off += sg[g++].n)
            ring_put(ring_of(sg[g].s, w, w->kv_at[w->swa_src]), w->swa, w->layers[w->swa_src].KV,
                     wk->sk + off * w->layers[w->swa_src].KV, wk->sv + off * w->layers[w->swa_src].KV, sg[g].n,
                     sg[g].pos0);
    /* the last layer's residual */
    struct tok_ctx tc = {w, NULL, x, xb, q, NULL, NULL, pending ? xb : NULL, NULL, wk->pos,
                         pending ? w->layers[w->L - 1].post_ffn : NULL};
    if (pending) kvt_pool_for(pool, n, TOK_MIN, add_norm_range, &tc);
    if (!nl) return KVT_OK;
    /* the rows with logits, normed into xb one after another */
    for (size_t g = 0, off = 0, r = 0; g < k; off += sg[g++].n)
        for (size_t i = sg[g].logits ? sg[g].lfrom : sg[g].n; i < sg[g].n; i++, r++)
            kvt_rmsnorm(xb + r * D, x + (off + i) * D, w->out_norm, D, w->eps);
    float *lg = lgb ? lgb : sg[0].logits;
    kvt_matmul_w(pool, lg, &w->out, xb, nl, wk->qx);
    if (w->softcap > 0) { /* gemma's final soft-capping, as ggml: tanh(logit * (1 / cap)) * cap */
        float rc = 1.0f / w->softcap;
        for (size_t j = 0; j < nl * w->V; j++) lg[j] = tanhf(lg[j] * rc) * w->softcap;
    }
    if (lgb)
        for (size_t g = 0, r = 0; g < k; g++) {
            if (!sg[g].logits || sg[g].lfrom >= sg[g].n) continue;
            size_t m = sg[g].n - sg[g].lfrom;
            memcpy(sg[g].logits, lgb + r * w->V, m * w->V * sizeof(float));
            r += m;
        }
    return KVT_OK;
}

/* Before a forward of s from pos0: the scores fit the pool, the tokens the
 * context; a DeltaNet layer starts from zero state at position 0. */
static int forward_ready(kvt_session *s, llama_work *wk, size_t n, size_t pos0)
{
    int rc = scores_fit(wk, kvt_pool_size(s->pool));
    if (rc) return rc;
    if (pos0 + n > wk->n_ctx || pos0 + n > s->n_ctx)
        return kvt_fail(KVT_ECTX, "tokens up to %zu exceed the context", pos0 + n);
    const llama_weights *w = s->m->weights;
    if (pos0 == 0 && w->n_rec) memset(s->cache->state + w->rec_at, 0, state_bytes(w) - w->rec_at);
    return KVT_OK;
}

static int llama_forward(kvt_session *s, const int32_t *tok, size_t n, size_t pos0,
                         float *logits, size_t lfrom)
{
    llama_work *wk = s->work;
    int rc = forward_ready(s, wk, n, pos0);
    /* passes of at most ch tokens: every token's result is that of any
     * other chunking (above), so this changes nothing but the scratch */
    for (size_t done = 0; done < n && !rc;) {
        size_t m = n - done < wk->ch ? n - done : wk->ch;
        size_t lf = lfrom > done ? lfrom - done : 0; /* the pass's first row with logits */
        float *lg = NULL;
        if (logits && lf < m) lg = logits + (done + lf - lfrom) * (size_t)s->m->info.n_vocab;
        else lf = m;
        kvt_seg one = {s, tok + done, m, pos0 + done, lg, lf};
        rc = llama_pass(wk, &one, 1);
        done += m;
    }
    return rc;
}

/* Segments of at most the first session's ch tokens in all go through one
 * pass, on its scratch (the others' contexts no larger than its); a longer
 * batch runs as forwards one after another. */
static int llama_forward_batch(const kvt_seg *sg, size_t k)
{
    if (!k) return KVT_OK;
    llama_work *wk = sg[0].s->work;
    size_t total = 0;
    for (size_t g = 0; g < k; g++) total += sg[g].n;
    bool one = total <= wk->ch;
    for (size_t g = 0; g < k && one; g++) one = sg[g].s->n_ctx <= wk->n_ctx && sg[g].n;
    if (!one) {
        for (size_t g = 0; g < k; g++) {
            int rc = llama_forward(sg[g].s, sg[g].tok, sg[g].n, sg[g].pos0, sg[g].logits, sg[g].lfrom);
            if (rc) return rc;
        }
        return KVT_OK;
    }
    for (size_t g = 0; g < k; g++) {
        int rc = forward_ready(sg[g].s, wk, sg[g].n, sg[g].pos0);
        if (rc) return rc;
    }
    return llama_pass(wk, sg, k);
}

static void hash_vec(XXH3_state_t *st, const float *v, size_t n)
{
    if (v) XXH3_64bits_update(st, v, n * sizeof(float));
}

/* gemma4's own: its shape per layer, sharing, per-layer embeddings, output
 * scales and experts' scales and norms. */
static void gemma4_hash(XXH3_state_t *st, const llama_weights *w)
{
    uint32_t h[] = {w->n_kv, w->n_pl, w->E, w->Eu, w->Fe, w->n_ff};
    XXH3_64bits_update(st, h, sizeof h);
    if (w->n_pl) {
        kvt_tensor_hash(st, &w->ple_embd);
        kvt_tensor_hash(st, &w->ple_proj);
        hash_vec(st, w->ple_norm, w->n_pl);
    }
    for (uint32_t l = 0; l < w->L; l++) {
        const llama_layer *ly = &w->layers[l];
        uint32_t s[] = {ly->H, ly->Hkv, ly->hd, ly->F, ly->n_rot, ly->shared, ly->wv.rows != 0, ly->gate_up,
                        ly->out_scale != NULL, ly->gate_inp != NULL, ly->down_s != NULL};
        XXH3_64bits_update(st, s, sizeof s);
        XXH3_64bits_update(st, &ly->base, sizeof ly->base);
        hash_vec(st, ly->out_scale, 1);
        hash_vec(st, ly->gate_inp_s, w->D);
        hash_vec(st, ly->down_s, w->E);
        hash_vec(st, ly->pre_ffn2, w->D);
        hash_vec(st, ly->post_ffn1, w->D);
        hash_vec(st, ly->post_ffn2, w->D);
        if (w->n_pl) {
            kvt_tensor_hash(st, &ly->inp_gate);
            kvt_tensor_hash(st, &ly->proj);
            hash_vec(st, ly->ple_post, w->D);
        }
    }
}

/* qwen35's own: the DeltaNet shape and layers, the shared experts. */
static void hybrid_hash(XXH3_state_t *st, const llama_weights *w)
{
    const kvt_gdn_shape *gd = &w->gdn;
    uint32_t h[] = {gd->Hk, gd->Hv, gd->S, gd->conv, w->Fs, (uint32_t)w->n_rec};
    XXH3_64bits_update(st, h, sizeof h);
    XXH3_64bits_update(st, &w->moe_scale, sizeof w->moe_scale);
    size_t C = kvt_gdn_channels(gd);
    for (uint32_t l = 0; l < w->L; l++) {
        const llama_layer *ly = &w->layers[l];
        XXH3_64bits_update(st, &ly->recr, sizeof ly->recr);
        if (ly->recr) {
            const kvt_wmat *m[5] = {&ly->gdn.qkv, &ly->gdn.gate, &ly->gdn.beta, &ly->gdn.alpha, &ly->gdn.out};
            for (int i = 0; i < 5; i++) kvt_tensor_hash(st, m[i]);
            hash_vec(st, ly->gdn.conv_w, C * gd->conv);
            hash_vec(st, ly->gdn.dt, gd->Hv);
            hash_vec(st, ly->gdn.a, gd->Hv);
            hash_vec(st, ly->gdn.norm, gd->S);
        }
        if (w->Fs) {
            const kvt_wmat *m[3] = {&ly->sh_gate, &ly->sh_up, &ly->sh_down};
            for (int i = 0; i < 3; i++) kvt_tensor_hash(st, m[i]);
            hash_vec(st, ly->sh_inp, w->D);
        }
    }
}

static uint64_t llama_fingerprint(const void *p)
{
    const llama_weights *w = p;
    XXH3_state_t *st = XXH3_createState();
    if (!st) return 0;
    XXH3_64bits_reset(st);
    uint32_t hdr[] = {w->D, w->L, w->H, w->Hkv, w->hd, w->KV, w->F, w->V, w->n_rot};
    XXH3_64bits_update(st, "llama", 5);
    hash_vec(st, w->rope_ff, w->n_ff);
    if (w->fam->gemma) {
        float g[3] = {w->rope_base_swa, w->scale, w->softcap};
        XXH3_64bits_update(st, g, sizeof g);
        XXH3_64bits_update(st, &w->swa, sizeof w->swa);
        XXH3_64bits_update(st, w->is_swa, w->L);
    }
    if (w->fam->gemma4) gemma4_hash(st, w);
    if (w->fam->hybrid) hybrid_hash(st, w);
    if (w->fam != &families[0]) { /* the llama row hashes as before there were others */
        uint32_t f[] = {w->QD, w->fam->neox, w->fam->qkv_bias, w->fam->qk_norm};
        XXH3_64bits_update(st, w->fam->name, strlen(w->fam->name));
        XXH3_64bits_update(st, f, sizeof f);
    }
    XXH3_64bits_update(st, hdr, sizeof hdr);
    XXH3_64bits_update(st, &w->eps, 4);
    XXH3_64bits_update(st, &w->rope_base, 4);
    size_t D = w->D;
    kvt_tensor_hash(st, &w->tok_embd);
    XXH3_64bits_update(st, w->out_norm, D * 4);
    if (w->out.data != w->tok_embd.data) kvt_tensor_hash(st, &w->out);
    for (uint32_t l = 0; l < w->L; l++) {
        const llama_layer *ly = &w->layers[l];
        XXH3_64bits_update(st, ly->attn_norm, D * 4);
        const kvt_wmat *a[4] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo};
        for (int i = 0; i < 4; i++) kvt_tensor_hash(st, a[i]);
        if (ly->bq) {
            hash_vec(st, ly->bq, ly->QD);
            hash_vec(st, ly->bk, ly->KV);
            hash_vec(st, ly->bv, ly->KV);
        }
        hash_vec(st, ly->qn, ly->hd);
        hash_vec(st, ly->kn, ly->hd);
        if (ly->post_attn) {
            XXH3_64bits_update(st, ly->post_attn, D * 4);
            XXH3_64bits_update(st, ly->post_ffn, D * 4);
        }
        XXH3_64bits_update(st, ly->ffn_norm, D * 4);
        const kvt_wmat *f[3] = {&ly->w1, &ly->w3, &ly->w2};
        for (int i = 0; i < 3; i++) kvt_tensor_hash(st, f[i]);
        if (ly->gate_inp) {
            uint32_t e[3] = {w->E, w->Eu, w->Fe};
            XXH3_64bits_update(st, e, sizeof e);
            XXH3_64bits_update(st, ly->gate_inp, (size_t)w->E * D * 4);
            const kvt_wmat *x[3] = {&ly->gate_x, &ly->up_x, &ly->down_x};
            for (int i = 0; i < 3; i++) kvt_tensor_hash(st, x[i]);
        }
    }
    uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return h;
}

/* ---- the window rings as the session's state ----
 *
 * In logical order: for each window layer, its K rows of the positions
 * max(0, n - W) .. n - 1, oldest first, then its V rows of the same
 * positions; the same bytes whatever slot each was in. */

static void llama_state_save(const kvt_session *s, kvt_wbuf *b)
{
    const llama_weights *w = s->m->weights;
    size_t n = s->n, W = w->swa;
    for (size_t r = 0; r < w->n_ring; r++) {
        const float *ring = (const float *)(s->cache->state + w->ring_at[r]);
        size_t KV = w->ring_kv[r];
        for (int v = 0; v < 2; v++)
            for (size_t t = n > W ? n - W : 0; t < n; t++)
                kvt_wbuf_put(b, ring + ((size_t)v * W + t % W) * KV, KV * sizeof(float));
    }
    /* the DeltaNet layers' states as they are (their layout is logical) */
    if (w->n_rec) kvt_wbuf_put(b, s->cache->state + w->rec_at, state_bytes(w) - w->rec_at);
}

static int llama_state_load(kvt_session *s, size_t n, kvt_rbuf *rb)
{
    const llama_weights *w = s->m->weights;
    size_t W = w->swa;
    for (size_t r = 0; r < w->n_ring; r++) {
        float *ring = (float *)(s->cache->state + w->ring_at[r]);
        size_t KV = w->ring_kv[r];
        for (int v = 0; v < 2; v++)
            for (size_t t = n > W ? n - W : 0; t < n; t++)
                if (!kvt_rbuf_get(rb, ring + ((size_t)v * W + t % W) * KV, KV * sizeof(float)))
                    return kvt_fail(KVT_EFORMAT, "%s state: the window rings of %zu tokens are truncated",
                                    w->fam->name, n);
        if (kvt_llama_fault == KVT_LLAMA_FAULT_RING && n) ring[(n > W ? n - W : 0) % W * KV] += 1.0f;
    }
    if (w->n_rec) {
        uint8_t *st = s->cache->state + w->rec_at;
        if (!kvt_rbuf_get(rb, st, state_bytes(w) - w->rec_at))
            return kvt_fail(KVT_EFORMAT, "%s state: the DeltaNet layers' states are truncated", w->fam->name);
        if (kvt_llama_fault == KVT_LLAMA_FAULT_RING && n) ((float *)st)[0] += 1.0f;
    }
    return KVT_OK;
}

/* The cache at ctx tokens: full f32 K and V rows for the global layers, the
 * window layers' rings and the DeltaNet layers' state (both fixed). */
static int llama_plan(const kvt_model *m, uint64_t ctx, kvt_plan *out)
{
    const llama_weights *w = m->weights;
    memset(out, 0, sizeof *out);
    uint64_t row = 0;
    for (size_t i = 0; i < w->n_global; i++) row += 2ull * w->stream_kv[i] * sizeof(float);
    kvt_plan_add(out, "window", w->ring_at[w->n_ring], true);
    kvt_plan_add(out, "full rows", ctx * row, false);
    if (w->n_rec) kvt_plan_add(out, "recurrent", state_bytes(w) - w->rec_at, true);
    out->per_token_x1000 = 1000ull * row;
    return KVT_OK;
}

#define LLAMA_OPS                                                                 \
    .handles = llama_handles, .load = llama_load,                                 \
    .cache_new = llama_cache_new, .forward = llama_forward, .forward_batch = llama_forward_batch, \
    .fingerprint = llama_fingerprint, \
    .weights_pack = llama_pack, .weights_free = llama_free, .plan = llama_plan,   \
    .work_new = llama_work_new, .work_free = llama_work_free, .work_bytes = llama_work_bytes

/* A model with window layers: the same operations and its state. */
static const kvt_arch arch_llama_window = {
    .name = "llama",
    LLAMA_OPS,
    .state_save = llama_state_save,
    .state_load = llama_state_load,
};

const kvt_arch kvt_arch_llama = {
    .name = "llama",
    LLAMA_OPS,
};
