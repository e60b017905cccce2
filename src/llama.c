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
 *   qwen3moe  qwen3 with routed experts for the FFN (src/moe.c)
 *   gemma3 qwen3's attention, embeddings scaled by sqrt(D), a norm after
 *          each sublayer (post_attention_norm, post_ffw_norm), GeGLU, and
 *          window layers (attention.sliding_window_pattern) that attend to
 *          the last attention.sliding_window positions with RoPE base
 *          rope.freq_base_swa.
 *
 * Cache layout. A global layer has two streams, K then V, each one f32 row
 * of n_head_kv * head_dim per token (128 rows per 128-token block), written
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
 * every prefix of its streams is a valid cache.
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
#include "kernels.h"
#include "model.h"
#include "moe.h"
#include "qkernels.h"
#include "quant.h"
#include "util.h"

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
} family;

static const family families[] = {
    {"llama", false, false, false, false, false},
    {"qwen2", true, true, false, false, false},
    {"qwen3", true, false, true, false, false},
    {"qwen3moe", true, false, true, true, false},
    {"gemma3", true, false, true, false, true},
};

typedef struct llama_layer {
    float *attn_norm;  /* (D) */
    kvt_wmat wq;       /* (QD, D)      q = wq · x, QD = n_head * head_dim */
    kvt_wmat wk, wv;   /* (KV, D)      KV = n_head_kv * head_dim */
    float *bq, *bk, *bv; /* (QD), (KV), (KV) qwen2; else NULL */
    float *qn, *kn;    /* (head_dim) x2 qwen3; else NULL */
    kvt_wmat wo;       /* (D, QD) */
    float *ffn_norm;   /* (D) */
    kvt_wmat w1, w3;   /* (F, D)       gate, up */
    kvt_wmat w2;       /* (D, F)       down */
    float *gate_inp;   /* (E, D) the router (moe) */
    float *post_attn, *post_ffn; /* (D) x2 the sublayers' output norms (gemma) */
    kvt_wmat gate_x, up_x, down_x; /* (E*Fe, D) x2, (E*D, Fe): the experts (moe) */
} llama_layer;

typedef struct llama_weights {
    const family *fam;
    uint32_t D, L, H, Hkv, hd, QD, KV, F, V, n_rot;
    uint32_t E, Eu, Fe;  /* experts, used per token, each one's FFN length (moe; else 0) */
    float eps, rope_base;
    float rope_base_swa, scale, softcap; /* gemma: the window layers' RoPE base; the attention scale
                                          * (others 1 / sqrt(head_dim)); final logit soft-capping (0: none) */
    uint32_t swa;      /* the sliding window of the window layers (gemma; 0: none) */
    uint8_t *is_swa;   /* (L) which layers have it */
    int32_t *kv_at;    /* (L) a global layer's K stream (V: the next), or -1 - r for the r-th window
                        * layer, whose rings are at state offset r * ring_bytes */
    size_t n_global, n_ring, ring_bytes; /* ring_bytes: a window layer's K and V rings, (2, swa, KV) f32 */
    kvt_wmat tok_embd; /* (V, D) */
    float *out_norm;   /* (D) */
    float *rope_ff;    /* (n_rot / 2) rope_freqs.weight (llama 3's scaling, as the converter writes it); NULL: none */
    kvt_wmat out;      /* (V, D); the same tensor as tok_embd when tied */
    llama_layer *layers; /* (L) */
} llama_weights;

/* A session's scratch, allocated when it is created: the activations of up
 * to `ch` tokens (a longer chunk runs in passes of ch) and, per part of the
 * pool, one attention score row per query head of a KV group and token of
 * an attention group (ATT_TOKS). */
typedef struct llama_work {
    size_t ch, parts, n_ctx, group;
    float *x;          /* (ch, D) residual */
    float *xb;         /* (ch, D) normed input, then a sublayer's output */
    float *q;          /* (ch, D) */
    float *att;        /* (ch, D) attention output */
    float *k, *v;      /* (ch, KV) */
    float *h1, *h3;    /* (ch, F) */
    float *lg, *ew, *mo; /* moe: (ch, E) router probabilities, (ch, Eu) weights, (ch, D) output */
    uint32_t *ex;      /* moe: (ch, Eu) experts */
    kvt_moe_scratch ms; /* moe: the experts' scratch */
    float *scores;     /* (parts, ATT_TOKS, group, n_ctx): group = query heads per KV head */
    uint8_t *qx;       /* (ch) tokens' activations quantised for the integer matrices (qkernels.h); NULL: none */
} llama_work;

/* The matrices of layer l (l == L: the output head), n of them. */
static size_t layer_mats(llama_weights *w, uint32_t l, kvt_wmat **m)
{
    if (l == w->L) { m[0] = &w->out; return 1; }
    llama_layer *ly = &w->layers[l];
    kvt_wmat *all[7] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo, &ly->w1, &ly->w3, &ly->w2};
    memcpy(m, all, sizeof all);
    return 7;
}

static void llama_free(void *p)
{
    llama_weights *w = p;
    if (!w) return;
    if (w->layers) {
        for (uint32_t l = 0; l <= w->L; l++) { /* the packed copies (llama_pack), the head's too */
            kvt_wmat *m[7];
            for (size_t i = 0, n = layer_mats(w, l, m); i < n; i++) free((void *)m[i]->pk);
        }
        for (uint32_t l = 0; l < w->L; l++) {
            llama_layer *ly = &w->layers[l];
            void *v[] = {ly->attn_norm, ly->ffn_norm, ly->bq, ly->bk, ly->bv, ly->qn, ly->kn, ly->gate_inp,
                         ly->post_attn, ly->post_ffn};
            for (size_t i = 0; i < sizeof v / sizeof *v; i++) free(v[i]);
        }
        free(w->layers);
    }
    free(w->out_norm);
    free(w->rope_ff);
    free(w->is_swa);
    free(w->kv_at);
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
        kvt_wmat *m[7];
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

bool kvt_llama_handles(const kvt_gguf *g) { return family_of(g) != NULL; }

int kvt_llama_load(kvt_model *m, const kvt_gguf *g)
{
    llama_weights *w = kvt_calloc(1, sizeof *w);
    if (!w) return KVT_ENOMEM;
    int rc;
    uint32_t ctx = 0;
    if (!(w->fam = family_of(g))) {
        free(w);
        return kvt_fail(KVT_EFORMAT, "llama: general.architecture is not of the llama family");
    }
    if ((rc = need_u32(g, fkey(w, "embedding_length"), &w->D)) ||
        (rc = need_u32(g, fkey(w, "block_count"), &w->L)) ||
        (rc = need_u32(g, fkey(w, "attention.head_count"), &w->H)) ||
        (rc = need_u32(g, fkey(w, "feed_forward_length"), &w->F)) ||
        (rc = need_u32(g, fkey(w, "context_length"), &ctx)))
        goto fail;
    w->Hkv = w->H;
    if ((rc = kvt_gguf_get_u32(g, fkey(w, "attention.head_count_kv"), &w->Hkv)) && rc != KVT_ENOENT) goto fail;
    w->eps = 1e-5f;
    if ((rc = kvt_gguf_get_f32(g, fkey(w, "attention.layer_norm_rms_epsilon"), &w->eps)) && rc != KVT_ENOENT)
        goto fail;
    w->rope_base = 10000.0f;
    if ((rc = kvt_gguf_get_f32(g, fkey(w, "rope.freq_base"), &w->rope_base)) && rc != KVT_ENOENT) goto fail;
    w->hd = w->H && w->D % w->H == 0 ? w->D / w->H : 0;
    uint32_t vl = 0;
    if ((rc = kvt_gguf_get_u32(g, fkey(w, "attention.key_length"), &w->hd)) && rc != KVT_ENOENT) goto fail;
    if ((rc = kvt_gguf_get_u32(g, fkey(w, "attention.value_length"), &vl)) && rc != KVT_ENOENT) goto fail;
    rc = KVT_EFORMAT;
    if (!w->D || !w->L || !w->H || !w->Hkv || !w->F || !w->hd || w->hd % 2 || w->hd > 1024 || (vl && vl != w->hd) ||
        w->H % w->Hkv || w->H > 1024 || w->D > 65536 || w->L > 1024 || w->F > 1u << 20 || ctx == 0) {
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
    if (w->fam->gemma) {
        /* llama.cpp's gemma3: window layers by attention.sliding_window_pattern
         * (every n-th layer global, default 6; or a per-layer array), their
         * RoPE base rope.freq_base_swa (default 10000); the 62-layer 27B scales
         * attention by 1 / sqrt(D / H) */
        if ((rc = kvt_gguf_get_u32(g, fkey(w, "attention.sliding_window"), &w->swa)) && rc != KVT_ENOENT) goto fail;
        w->rope_base_swa = 10000.0f;
        if ((rc = kvt_gguf_get_f32(g, fkey(w, "rope.freq_base_swa"), &w->rope_base_swa)) && rc != KVT_ENOENT)
            goto fail;
        if ((rc = kvt_gguf_get_f32(g, fkey(w, "final_logit_softcapping"), &w->softcap)) && rc != KVT_ENOENT)
            goto fail;
        if (!(w->softcap >= 0) || !(w->rope_base_swa > 0)) {
            rc = kvt_fail(KVT_EFORMAT, "%s: bad final_logit_softcapping %g or rope.freq_base_swa %g", w->fam->name,
                          (double)w->softcap, (double)w->rope_base_swa);
            goto fail;
        }
        if (w->L == 62) w->scale = 1.0f / sqrtf((float)(w->D / w->H));
        if (!(w->is_swa = kvt_calloc(w->L, 1))) { rc = KVT_ENOMEM; goto fail; }
        const kvt_gguf_val *pv = kvt_gguf_get(g, fkey(w, "attention.sliding_window_pattern"));
        uint32_t np = 6;
        if (pv && pv->type == KVT_GGUF_ARR) {
            if (pv->n != w->L || !(pv->elem_type == KVT_GGUF_BOOL || pv->elem_type <= KVT_GGUF_I32)) {
                rc = kvt_fail(KVT_EFORMAT, "%s: sliding_window_pattern has %llu entries for %u layers", w->fam->name,
                              (unsigned long long)pv->n, w->L);
                goto fail;
            }
            for (uint32_t l = 0; l < w->L; l++) w->is_swa[l] = pv->v.arr[l].v.u != 0;
        } else {
            if (pv && (rc = kvt_gguf_get_u32(g, fkey(w, "attention.sliding_window_pattern"), &np))) goto fail;
            for (uint32_t l = 0; l < w->L; l++) w->is_swa[l] = np == 0 || l % np < np - 1;
        }
        if (!w->swa) memset(w->is_swa, 0, w->L);
        if (w->swa > 1u << 20) {
            rc = kvt_fail(KVT_EFORMAT, "%s: sliding_window %u is past 2^20", w->fam->name, w->swa);
            goto fail;
        }
    }
    w->QD = w->H * w->hd;
    w->KV = w->Hkv * w->hd;
    w->n_rot = w->hd;
    if ((rc = kvt_gguf_get_u32(g, fkey(w, "rope.dimension_count"), &w->n_rot)) && rc != KVT_ENOENT) goto fail;
    if (w->n_rot > w->hd || w->n_rot % 2) {
        rc = kvt_fail(KVT_EFORMAT, "%s: rope.dimension_count %u does not fit head dim %u", w->fam->name, w->n_rot,
                      w->hd);
        goto fail;
    }
    const kvt_gguf_tensor *te = kvt_gguf_find_tensor(g, "token_embd.weight");
    if (!te || te->n_dims != 2 || te->ne[0] != w->D || te->ne[1] == 0 || te->ne[1] > 1u << 24) {
        rc = kvt_fail(KVT_EFORMAT, "llama: token_embd.weight missing or not (%u, V)", w->D);
        goto fail;
    }
    w->V = (uint32_t)te->ne[1];
    if ((rc = kvt_model_tensor_mat(g, "token_embd.weight", w->D, w->V, &w->tok_embd)) ||
        (rc = kvt_model_tensor_f32(g, "output_norm.weight", w->D, 1, &w->out_norm)))
        goto fail;
    if (kvt_gguf_find_tensor(g, "rope_freqs.weight")) {
        if ((rc = kvt_model_tensor_f32(g, "rope_freqs.weight", w->n_rot / 2, 1, &w->rope_ff))) goto fail;
        for (uint32_t i = 0; i < w->n_rot / 2; i++)
            if (!(w->rope_ff[i] > 0) || !isfinite(w->rope_ff[i])) {
                rc = kvt_fail(KVT_EFORMAT, "%s: rope_freqs.weight[%u] = %g is not a positive factor", w->fam->name, i,
                              (double)w->rope_ff[i]);
                goto fail;
            }
    }
    if (kvt_gguf_find_tensor(g, "output.weight")) {
        if ((rc = kvt_model_tensor_mat(g, "output.weight", w->D, w->V, &w->out))) goto fail;
    } else {
        w->out = w->tok_embd;
    }
    w->layers = kvt_calloc(w->L, sizeof *w->layers);
    if (!w->layers) { rc = KVT_ENOMEM; goto fail; }
    for (uint32_t l = 0; l < w->L; l++) {
        llama_layer *ly = &w->layers[l];
        char nm[96];
#define V(field, suffix, a)                                                      \
        snprintf(nm, sizeof nm, "blk.%u.%s", l, suffix);                         \
        if ((rc = kvt_model_tensor_f32(g, nm, a, 1, &ly->field))) goto fail;
#define M(field, suffix, a, b)                                                   \
        snprintf(nm, sizeof nm, "blk.%u.%s", l, suffix);                         \
        if ((rc = kvt_model_tensor_mat(g, nm, a, b, &ly->field))) goto fail;
        V(attn_norm, "attn_norm.weight", w->D)
        M(wq, "attn_q.weight", w->D, w->QD)
        M(wk, "attn_k.weight", w->D, w->KV)
        M(wv, "attn_v.weight", w->D, w->KV)
        if (w->fam->qkv_bias) {
            V(bq, "attn_q.bias", w->QD)
            V(bk, "attn_k.bias", w->KV)
            V(bv, "attn_v.bias", w->KV)
        }
        if (w->fam->qk_norm) {
            V(qn, "attn_q_norm.weight", w->hd)
            V(kn, "attn_k_norm.weight", w->hd)
        }
        M(wo, "attn_output.weight", w->QD, w->D)
        V(ffn_norm, "ffn_norm.weight", w->D)
        if (w->fam->gemma) {
            V(post_attn, "post_attention_norm.weight", w->D)
            V(post_ffn, "post_ffw_norm.weight", w->D)
        }
        if (w->fam->moe) {
            snprintf(nm, sizeof nm, "blk.%u.ffn_gate_inp.weight", l);
            if ((rc = kvt_model_tensor_f32(g, nm, w->D, w->E, &ly->gate_inp))) goto fail;
            const char *const xn[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
            kvt_wmat *xm[3] = {&ly->gate_x, &ly->up_x, &ly->down_x};
            for (int i = 0; i < 3; i++) {
                snprintf(nm, sizeof nm, "blk.%u.%s.weight", l, xn[i]);
                if ((rc = kvt_model_tensor_mat3(g, nm, i < 2 ? w->D : w->Fe, i < 2 ? w->Fe : w->D, w->E, xm[i])))
                    goto fail;
            }
        } else {
            M(w1, "ffn_gate.weight", w->D, w->F)
            M(w3, "ffn_up.weight", w->D, w->F)
            M(w2, "ffn_down.weight", w->F, w->D)
        }
#undef V
#undef M
    }
    /* the cache's layout: streams for the global layers, rings for the
     * window layers (every layer global under the tests' no-window fault) */
    if (!(w->kv_at = kvt_calloc(w->L, sizeof *w->kv_at))) { rc = KVT_ENOMEM; goto fail; }
    for (uint32_t l = 0; l < w->L; l++) {
        if (w->is_swa && w->is_swa[l] && kvt_llama_fault != KVT_LLAMA_FAULT_NO_WINDOW)
            w->kv_at[l] = -1 - (int32_t)w->n_ring++;
        else
            w->kv_at[l] = (int32_t)(2 * w->n_global++);
    }
    w->ring_bytes = 2 * (size_t)w->swa * w->KV * sizeof(float);
    m->weights = w;
    m->arch = w->n_ring ? &arch_llama_window : &kvt_arch_llama;
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
    in->n_params = (uint64_t)w->V * w->D * (w->out.data == w->tok_embd.data ? 1 : 2) + w->D +
                   (uint64_t)w->L * (2ull * w->D + 2ull * w->QD * w->D + 2ull * w->KV * w->D +
                                     (w->E ? (uint64_t)w->E * (w->D + 3ull * w->D * w->Fe) : 3ull * w->D * w->F) +
                                     (w->fam->qkv_bias ? w->QD + 2ull * w->KV : 0) +
                                     (w->fam->qk_norm ? 2ull * w->hd : 0));
    return KVT_OK;
fail:
    llama_free(w);
    return rc;
}

static int llama_cache_new(kvt_session *s)
{
    const llama_weights *w = s->m->weights;
    size_t n = 2 * w->n_global, state;
    if (!kvt_mul_ok(w->n_ring, w->ring_bytes, &state))
        return kvt_fail(KVT_ENOMEM, "window rings of %zu layers", w->n_ring);
    uint32_t (*spec)[2] = kvt_calloc(n ? n : 1, sizeof *spec);
    if (!spec) return KVT_ENOMEM;
    for (size_t i = 0; i < n; i++) { spec[i][0] = w->KV * (uint32_t)sizeof(float); spec[i][1] = KVT_BLOCK; }
    s->cache = kvt_cache_new(n, (const uint32_t (*)[2])spec, s->n_ctx, state);
    free(spec);
    return s->cache ? KVT_OK : KVT_ENOMEM;
}

static void llama_work_free(void *p)
{
    llama_work *k = p;
    if (!k) return;
    free(k->x); free(k->xb); free(k->q); free(k->att); free(k->k); free(k->v); free(k->h1); free(k->h3);
    free(k->lg); free(k->ew); free(k->mo); free(k->ex);
    free(k->ms.xe); free(k->ms.eo); free(k->ms.f1); free(k->ms.f3); free(k->ms.rt);
    free(k->scores);
    free(k->qx);
    free(k);
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
    k->group = w->H / w->Hkv;
    size_t D = w->D, QD = w->QD, KV = w->KV, F = w->F, ch = k->ch;
    k->x = kvt_malloc(ch * D * sizeof(float));
    k->xb = kvt_malloc(ch * D * sizeof(float));
    k->q = kvt_malloc(ch * QD * sizeof(float));
    k->att = kvt_malloc(ch * QD * sizeof(float));
    k->k = kvt_malloc(ch * KV * sizeof(float));
    k->v = kvt_malloc(ch * KV * sizeof(float));
    k->h1 = kvt_malloc(ch * F * sizeof(float));
    k->h3 = kvt_malloc(ch * F * sizeof(float));
    bool mok = true;
    if (w->E) {
        size_t E = w->E, Eu = w->Eu, Fe = w->Fe;
        k->lg = kvt_malloc(ch * E * sizeof(float));
        k->ew = kvt_malloc(ch * Eu * sizeof(float));
        k->mo = kvt_malloc(ch * D * sizeof(float));
        k->ex = kvt_malloc(ch * Eu * sizeof(uint32_t));
        /* an expert takes a token at most once: ch rows through it */
        k->ms = (kvt_moe_scratch){kvt_malloc(ch * D * sizeof(float)), kvt_malloc(ch * Eu * D * sizeof(float)),
                                  kvt_malloc(ch * Fe * sizeof(float)), kvt_malloc(ch * Fe * sizeof(float)),
                                  kvt_malloc(ch * Eu * sizeof(uint32_t)), NULL};
        mok = k->lg && k->ew && k->mo && k->ex && k->ms.xe && k->ms.eo && k->ms.f1 && k->ms.f3 && k->ms.rt;
    }
    /* the largest quantised activations any matrix needs */
    size_t qb = kvt_q_act_bytes(w->tok_embd.type, 0, 0);
    for (uint32_t l = 0; l < w->L; l++) {
        const llama_layer *ly = &w->layers[l];
        const kvt_wmat *m[10] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo, &ly->w1, &ly->w3, &ly->w2,
                                 &ly->gate_x, &ly->up_x, &ly->down_x};
        for (int i = 0; i < 10; i++) {
            size_t b = m[i]->rows ? kvt_q_act_bytes(m[i]->type, ch, m[i]->cols) : 0;
            qb = b > qb ? b : qb;
        }
    }
    size_t bo = kvt_q_act_bytes(w->out.type, ch, w->out.cols);
    qb = bo > qb ? bo : qb;
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
    size_t KV = c->w->KV, W = c->swa;
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
    const llama_weights *w = c->w;
    size_t group = w->H / w->Hkv, hd = w->hd, row_f = w->KV;
    const float *rows = sp->kr + (ja - sp->j0) * row_f;
    if (nu == 1) {
        float *sc = sp->att + u * sp->ldg + ja, *o = c->out + (sp->i0 + u) * w->QD + sp->kvh * group * hd;
        if (sp->mix) kvt_axpys_rows(o, hd, sc, c->n_ctx, group, rows, row_f, je - ja, hd);
        else kvt_dots_rows(sc, c->n_ctx, c->q + (sp->i0 + u) * w->QD + sp->kvh * group * hd, hd, group, rows, row_f,
                           je - ja, hd, w->scale);
        return;
    }
    float *o[32];
    const float *p[32];
    for (size_t h0 = 0; h0 < group; h0 += 16) { /* up to 16 heads of each token at a time */
        size_t nh = group - h0 < 16 ? group - h0 : 16, nq = 0;
        for (size_t x = u; x < u + 2; x++)
            for (size_t h = h0; h < h0 + nh; h++, nq++) {
                float *sc = sp->att + x * sp->ldg + h * c->n_ctx + ja;
                size_t at = (sp->i0 + x) * w->QD + (sp->kvh * group + h) * hd;
                o[nq] = sp->mix ? c->out + at : sc;
                p[nq] = sp->mix ? sc : c->q + at;
            }
        if (sp->mix) kvt_axpys_qs(nq, o, p, rows, row_f, je - ja, hd);
        else kvt_dots_qs(nq, o, p, rows, row_f, je - ja, hd, w->scale);
    }
}

static void attn_range(void *arg, uint32_t part, size_t b, size_t e)
{
    struct attn_ctx *c = arg;
    const llama_weights *w = c->w;
    size_t Hkv = w->Hkv, hd = w->hd, group = w->H / w->Hkv, ldg = group * c->n_ctx;
    float *att = c->scores + (size_t)part * ATT_TOKS * ldg;
    /* tokens in pairs where the kernels take queries anywhere (AVX-512) */
    size_t step = kvt_kernels_avx512() && hd % 64 == 0 ? 2 : 1;
    for (size_t r = b; r < e; r++) {
        /* token groups in the order 0, last, 1, last - 1, ...: the causal
         * work of a group grows with its position, so each thread's
         * contiguous range of units gets its share of early and late ones */
        size_t gi = r / Hkv, ng = (c->n + ATT_TOKS - 1) / ATT_TOKS, g = gi % 2 ? ng - 1 - gi / 2 : gi / 2;
        size_t i0 = g * ATT_TOKS, kvh = r % Hkv, t0 = c->pos0 + i0;
        size_t nt = c->n - i0 < ATT_TOKS ? c->n - i0 : ATT_TOKS, t_last = t0 + nt - 1;
        /* token t attends to positions lo(t) .. t: all of them, or in a
         * window layer the last swa (llama.cpp's standard window) */
#define LO(t) (c->swa && (t) + 1 > c->swa ? (t) + 1 - c->swa : 0)
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
                    memset(c->out + (i0 + u) * w->QD + kvh * group * hd, 0, group * hd * sizeof(float));
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
 * q and k (and v's bias). */
struct tok_ctx {
    const llama_weights *w;
    const llama_layer *ly;
    float *x, *xb, *q, *k, *v;
    const float *add, *norm;
    size_t pos0;
    const float *post;  /* gemma: add is rmsnorm(add) * post first (NULL: as it is) */
    float base;         /* this layer's RoPE base */
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
    size_t hd = w->hd;
    for (size_t i = i0; i < i1; i++) {
        float *q = c->q + i * w->QD, *k = c->k + i * w->KV;
        if (ly->bq) {
            add_bias(q, ly->bq, w->QD);
            add_bias(k, ly->bk, w->KV);
            add_bias(c->v + i * w->KV, ly->bv, w->KV);
        }
        if (ly->qn) {
            for (size_t h = 0; h < w->H; h++) kvt_rmsnorm(q + h * hd, q + h * hd, ly->qn, hd, w->eps);
            for (size_t h = 0; h < w->Hkv; h++) kvt_rmsnorm(k + h * hd, k + h * hd, ly->kn, hd, w->eps);
        }
        kvt_rope_heads(q, w->H, k, w->Hkv, hd, w->n_rot, c->pos0 + i, c->base, w->rope_ff,
                       w->fam->neox && kvt_llama_fault != KVT_LLAMA_FAULT_ROPE_PAIRS);
    }
}

/* The routed experts (qwen3moe) of n tokens xb (n, D), their output into xb:
 * softmax router probabilities, the Eu best (kvt_moe_select), their
 * probabilities normalised to sum 1, as llama.cpp's build_moe_ffn with
 * norm_w (or the choice kvt_force imposes, for the tests). */
static void moe_ffn(kvt_session *s, llama_work *wk, const llama_weights *w, size_t l, float *xb, size_t n,
                    size_t pos0)
{
    const llama_layer *ly = &w->layers[l];
    size_t D = w->D, E = w->E, Eu = w->Eu;
    kvt_matmul(s->pool, wk->lg, ly->gate_inp, xb, n, D, E);
    for (size_t i = 0; i < n; i++) {
        float *p = wk->lg + i * E, m = p[0], z = 0;
        for (size_t e = 1; e < E; e++) m = p[e] > m ? p[e] : m;
        for (size_t e = 0; e < E; e++) { p[e] = kvt_expf(p[e] - m); z += p[e]; }
        for (size_t e = 0; e < E; e++) p[e] /= z;
        uint32_t *ex = wk->ex + i * Eu;
        kvt_moe_select(p, E, Eu, ex);
        const kvt_forced *fz = kvt_force;
        if (fz && pos0 + i < fz->n && fz->Eu == Eu && fz->ex[l])
            kvt_moe_force_choice(fz->ex[l], fz->ex_gap[l], pos0 + i, ex, Eu, p, E, false);
        for (size_t j = 0; j < Eu; j++) wk->ew[i * Eu + j] = p[ex[j]];
        if (kvt_llama_fault != KVT_LLAMA_FAULT_MOE_WEIGHTS) kvt_moe_normalise(wk->ew + i * Eu, Eu);
    }
    memset(wk->mo, 0, n * D * sizeof(float));
    kvt_moe m = {&ly->gate_x, &ly->up_x, &ly->down_x, E, Eu, w->Fe, D, 0.0f};
    kvt_moe_run(s->pool, &m, xb, n, wk->ex, wk->ew, &wk->ms, wk->mo);
    memcpy(xb, wk->mo, n * D * sizeof(float));
}

/* Tokens a thread takes at least in those steps (a decode step runs them
 * without waking the pool). */
#define TOK_MIN 32

/* Tokens tok[0..n) at pos0.., n <= the scratch's ch. */
static int llama_pass(kvt_session *s, llama_work *wk, const int32_t *tok, size_t n, size_t pos0, float *logits,
                      size_t lfrom)
{
    const llama_weights *w = s->m->weights;
    size_t D = w->D, KV = w->KV, F = w->F, hd = w->hd;
    float *x = wk->x, *xb = wk->xb, *q = wk->q, *att = wk->att, *k = wk->k, *v = wk->v, *h1 = wk->h1, *h3 = wk->h3;
    for (size_t i = 0; i < n; i++) {
        if (tok[i] < 0 || (uint32_t)tok[i] >= w->V)
            return kvt_fail(KVT_EINVAL, "token id %d out of range [0, %u)", tok[i], w->V);
        const uint8_t *row = w->tok_embd.data + (size_t)tok[i] * w->tok_embd.row_bytes;
        kvt_quant_to_f32(w->tok_embd.type, row, x + i * D, D);
        if (w->fam->gemma)
            for (size_t j = 0; j < D; j++) x[i * D + j] *= sqrtf((float)D);
    }
    for (size_t l = 0; l < w->L; l++) {
        const llama_layer *ly = &w->layers[l];
        bool swa = w->is_swa && w->is_swa[l];
        int32_t at = w->kv_at[l];
        size_t window = at < 0 ? w->swa : 0; /* a window layer: the positions its ring holds and its own */
        /* the residual of the layer before (none before the first), then
         * this layer's attention norm */
        struct tok_ctx tc = {w, ly, x, xb, q, k, v, l ? xb : NULL, ly->attn_norm, pos0,
                             l ? w->layers[l - 1].post_ffn : NULL, swa ? w->rope_base_swa : w->rope_base};
        kvt_pool_for(s->pool, n, TOK_MIN, add_norm_range, &tc);
        kvt_matmul_w(s->pool, q, &ly->wq, xb, n, wk->qx);
        kvt_matmul_w_next(s->pool, k, &ly->wk, &ly->wq, xb, n, wk->qx);
        kvt_matmul_w_next(s->pool, v, &ly->wv, &ly->wk, xb, n, wk->qx);
        kvt_pool_for(s->pool, n, TOK_MIN, rope_range, &tc);
        float *ring = at < 0 ? (float *)(s->cache->state + (size_t)(-1 - at) * w->ring_bytes) : NULL;
        for (size_t i = 0; i < n && !ring; i++) {
            float *kr = kvt_cache_row(s->cache, (size_t)at, pos0 + i);
            float *vr = kvt_cache_row(s->cache, (size_t)at + 1, pos0 + i);
            if (!kr || !vr) return kvt_fail(KVT_ENOMEM, "cache row %zu", pos0 + i);
            memcpy(kr, k + i * KV, KV * sizeof(float));
            memcpy(vr, v + i * KV, KV * sizeof(float));
        }
        struct attn_ctx ac = {w, s->cache, ring ? 0 : (size_t)at, pos0, n, window, ring, k, v,
                              q, att, wk->scores, wk->n_ctx};
        /* one (token group, KV head) scores and mixes up to pos0 + n rows
         * per query head and token: give a thread at least 128K
         * multiply-adds (measured in bench/README.md), so a tiny model's
         * decode step does not pay for waking the pool */
        size_t span = window && window < pos0 + n ? window : pos0 + n;
        size_t ng = (n + ATT_TOKS - 1) / ATT_TOKS, per = 2 * span * hd * (w->H / w->Hkv) * (n < ATT_TOKS ? n : ATT_TOKS);
        kvt_pool_for_part(s->pool, ng * w->Hkv, (131072 + per - 1) / per, attn_range, &ac);
        /* only now does a window layer's ring take the pass's last rows */
        for (size_t i = ring && n > w->swa ? n - w->swa : 0; ring && i < n; i++) {
            size_t slot = (pos0 + i) % w->swa;
            memcpy(ring + slot * KV, k + i * KV, KV * sizeof(float));
            memcpy(ring + (w->swa + slot) * KV, v + i * KV, KV * sizeof(float));
        }
        kvt_matmul_w(s->pool, xb, &ly->wo, att, n, wk->qx);
        tc.add = xb;
        tc.norm = ly->ffn_norm;
        tc.post = ly->post_attn;
        kvt_pool_for(s->pool, n, TOK_MIN, add_norm_range, &tc);
        if (w->E) {
            moe_ffn(s, wk, w, l, xb, n, pos0);
            continue;
        }
        kvt_matmul_w(s->pool, h1, &ly->w1, xb, n, wk->qx);
        kvt_matmul_w_next(s->pool, h3, &ly->w3, &ly->w1, xb, n, wk->qx);
        struct swiglu_ctx sc = {h1, h3, w->fam->gemma};
        kvt_pool_for(s->pool, n * F, 16384, swiglu_range, &sc);
        kvt_matmul_w(s->pool, xb, &ly->w2, h1, n, wk->qx);
    }
    /* the last layer's residual */
    struct tok_ctx tc = {w, NULL, x, xb, q, k, v, xb, NULL, pos0, w->layers[w->L - 1].post_ffn, 0};
    kvt_pool_for(s->pool, n, TOK_MIN, add_norm_range, &tc);
    if (lfrom < n) {
        size_t nl = n - lfrom;
        for (size_t i = 0; i < nl; i++) kvt_rmsnorm(xb + i * D, x + (lfrom + i) * D, w->out_norm, D, w->eps);
        kvt_matmul_w(s->pool, logits, &w->out, xb, nl, wk->qx);
        if (w->softcap > 0) /* gemma's final soft-capping: cap * tanh(logit / cap) */
            for (size_t j = 0; j < nl * w->V; j++) logits[j] = w->softcap * tanhf(logits[j] / w->softcap);
    }
    return KVT_OK;
}

static int llama_forward(kvt_session *s, const int32_t *tok, size_t n, size_t pos0,
                         float *logits, size_t lfrom)
{
    llama_work *wk = s->work;
    int rc = scores_fit(wk, kvt_pool_size(s->pool));
    if (rc) return rc;
    if (pos0 + n > wk->n_ctx) return kvt_fail(KVT_ECTX, "tokens up to %zu exceed the context", pos0 + n);
    /* passes of at most ch tokens: every token's result is that of any
     * other chunking (above), so this changes nothing but the scratch */
    for (size_t done = 0; done < n && !rc;) {
        size_t m = n - done < wk->ch ? n - done : wk->ch;
        size_t lf = lfrom > done ? lfrom - done : 0; /* the pass's first row with logits */
        float *lg = NULL;
        if (logits && lf < m) lg = logits + (done + lf - lfrom) * (size_t)s->m->info.n_vocab;
        else lf = m;
        rc = llama_pass(s, wk, tok + done, m, pos0 + done, lg, lf);
        done += m;
    }
    return rc;
}

static uint64_t llama_fingerprint(const void *p)
{
    const llama_weights *w = p;
    XXH3_state_t *st = XXH3_createState();
    if (!st) return 0;
    XXH3_64bits_reset(st);
    uint32_t hdr[] = {w->D, w->L, w->H, w->Hkv, w->hd, w->KV, w->F, w->V, w->n_rot};
    XXH3_64bits_update(st, "llama", 5);
    if (w->rope_ff) XXH3_64bits_update(st, w->rope_ff, w->n_rot / 2 * 4);
    if (w->fam->gemma) {
        float g[3] = {w->rope_base_swa, w->scale, w->softcap};
        XXH3_64bits_update(st, g, sizeof g);
        XXH3_64bits_update(st, &w->swa, sizeof w->swa);
        XXH3_64bits_update(st, w->is_swa, w->L);
    }
    if (w->fam != &families[0]) { /* the llama row hashes as before there were others */
        uint32_t f[] = {w->QD, w->fam->neox, w->fam->qkv_bias, w->fam->qk_norm};
        XXH3_64bits_update(st, w->fam->name, strlen(w->fam->name));
        XXH3_64bits_update(st, f, sizeof f);
    }
    XXH3_64bits_update(st, hdr, sizeof hdr);
    XXH3_64bits_update(st, &w->eps, 4);
    XXH3_64bits_update(st, &w->rope_base, 4);
    size_t D = w->D;
    kvt_model_hash_mat(st, &w->tok_embd);
    XXH3_64bits_update(st, w->out_norm, D * 4);
    if (w->out.data != w->tok_embd.data) kvt_model_hash_mat(st, &w->out);
    for (uint32_t l = 0; l < w->L; l++) {
        const llama_layer *ly = &w->layers[l];
        XXH3_64bits_update(st, ly->attn_norm, D * 4);
        const kvt_wmat *a[4] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo};
        for (int i = 0; i < 4; i++) kvt_model_hash_mat(st, a[i]);
        if (ly->bq) {
            XXH3_64bits_update(st, ly->bq, w->QD * 4);
            XXH3_64bits_update(st, ly->bk, w->KV * 4);
            XXH3_64bits_update(st, ly->bv, w->KV * 4);
        }
        if (ly->qn) {
            XXH3_64bits_update(st, ly->qn, w->hd * 4);
            XXH3_64bits_update(st, ly->kn, w->hd * 4);
        }
        if (ly->post_attn) {
            XXH3_64bits_update(st, ly->post_attn, D * 4);
            XXH3_64bits_update(st, ly->post_ffn, D * 4);
        }
        XXH3_64bits_update(st, ly->ffn_norm, D * 4);
        const kvt_wmat *f[3] = {&ly->w1, &ly->w3, &ly->w2};
        for (int i = 0; i < 3; i++) kvt_model_hash_mat(st, f[i]);
        if (ly->gate_inp) {
            uint32_t e[3] = {w->E, w->Eu, w->Fe};
            XXH3_64bits_update(st, e, sizeof e);
            XXH3_64bits_update(st, ly->gate_inp, (size_t)w->E * D * 4);
            const kvt_wmat *x[3] = {&ly->gate_x, &ly->up_x, &ly->down_x};
            for (int i = 0; i < 3; i++) kvt_model_hash_mat(st, x[i]);
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
    size_t n = s->n, W = w->swa, KV = w->KV;
    for (size_t r = 0; r < w->n_ring; r++) {
        const float *ring = (const float *)(s->cache->state + r * w->ring_bytes);
        for (int v = 0; v < 2; v++)
            for (size_t t = n > W ? n - W : 0; t < n; t++)
                kvt_wbuf_put(b, ring + ((size_t)v * W + t % W) * KV, KV * sizeof(float));
    }
}

static int llama_state_load(kvt_session *s, size_t n, kvt_rbuf *rb)
{
    const llama_weights *w = s->m->weights;
    size_t W = w->swa, KV = w->KV;
    for (size_t r = 0; r < w->n_ring; r++) {
        float *ring = (float *)(s->cache->state + r * w->ring_bytes);
        for (int v = 0; v < 2; v++)
            for (size_t t = n > W ? n - W : 0; t < n; t++)
                if (!kvt_rbuf_get(rb, ring + ((size_t)v * W + t % W) * KV, KV * sizeof(float)))
                    return kvt_fail(KVT_EFORMAT, "%s state: the window rings of %zu tokens are truncated",
                                    w->fam->name, n);
        if (kvt_llama_fault == KVT_LLAMA_FAULT_RING && n) ring[(n > W ? n - W : 0) % W * KV] += 1.0f;
    }
    return KVT_OK;
}

/* The cache at ctx tokens: full f32 K and V rows for the global layers, the
 * window layers' rings (fixed). */
static int llama_plan(const kvt_model *m, uint64_t ctx, kvt_plan *out)
{
    const llama_weights *w = m->weights;
    memset(out, 0, sizeof *out);
    uint64_t row = 2ull * w->KV * sizeof(float);
    out->full = ctx * w->n_global * row;
    out->window = (uint64_t)w->n_ring * w->ring_bytes;
    out->fixed = out->window;
    out->total = out->full + out->fixed;
    out->per_token_x1000 = 1000ull * w->n_global * row;
    return KVT_OK;
}

#define LLAMA_OPS                                                                 \
    .cache_new = llama_cache_new, .forward = llama_forward, .fingerprint = llama_fingerprint, \
    .weights_pack = llama_pack, .weights_free = llama_free, .plan = llama_plan,   \
    .work_new = llama_work_new, .work_free = llama_work_free

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
