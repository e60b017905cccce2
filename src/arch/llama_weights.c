/* The llama family's weights: which general.architecture values it runs,
 * how each differs from llama (one row of `families` each, named
 * features), and reading them from a GGUF: `ARCH.*` metadata, checked,
 * then every tensor in place (tensor.h). Also their packing for the
 * kernels, their fingerprint and their parameter count. The passes over
 * them are llama.c's. The families, by what the features in their rows
 * mean:
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
 */
#include "arch/llama_weights.h"
#include "cache/rows.h"
#include "arch/tensor.h"
#include "kernels/qkernels.h"
#include "format/quant.h"
#include "base/util.h"

#include <malloc.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

int kvt_llama_fault;

static const kvt_llama_family families[] = {
    {.name = "llama"},
    {.name = "qwen2", .neox = true, .qkv_bias = true},
    {.name = "qwen3", .neox = true, .qk_norm = true},
    {.name = "qwen3moe", .neox = true, .qk_norm = true, .moe = true},
    {.name = "gemma3", .neox = true, .qk_norm = true, .embd_scale = true, .post_norms = true, .geglu = true,
     .windows = true},
    {.name = "gemma4", .neox = true, .qk_norm = true, .embd_scale = true, .post_norms = true, .geglu = true,
     .windows = true, .layer_shapes = true, .shared_kv = true, .v_norm = true, .unscaled_attn = true,
     .global_rope_freqs = true, .softcap = 30.0f, .ple = true, .layer_experts = true},
    {.name = "qwen35", .neox = true, .qk_norm = true, .gated_attn = true, .deltanet = true},
    {.name = "qwen35moe", .neox = true, .qk_norm = true, .gated_attn = true, .deltanet = true, .moe = true},
};

/* The matrices of layer l (l == L: the output head and the per-layer
 * embeddings' projection; l == L + 1: the MTP layer's, with its eh_proj
 * and head), n of them. Every index up to mats_end(w) - 1. */
#define LAYER_MATS 19
static size_t layer_mats(kvt_llama_weights *w, uint32_t l, kvt_wmat **m)
{
    if (l == w->L) { m[0] = &w->out; m[1] = &w->ple_proj; return 2; }
    kvt_llama_layer *ly = l > w->L ? w->mtp : &w->layers[l];
    kvt_wmat *all[LAYER_MATS] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo, &ly->w1, &ly->w3, &ly->w2, &ly->inp_gate,
                                 &ly->proj, &ly->gdn.qkv, &ly->gdn.gate, &ly->gdn.beta, &ly->gdn.alpha, &ly->gdn.out,
                                 &ly->sh_gate, &ly->sh_up, &ly->sh_down, &w->eh, &w->mtp_head};
    memcpy(m, all, sizeof all);
    return l > w->L ? LAYER_MATS : LAYER_MATS - 2;
}

static uint32_t mats_end(const kvt_llama_weights *w) { return w->L + (w->mtp ? 2 : 1); }

void kvt_llama_weights_free(void *p)
{
    kvt_llama_weights *w = p;
    if (!w) return;
    if (w->layers) {
        for (uint32_t l = 0; l < mats_end(w); l++) { /* the packed copies (kvt_llama_weights_pack), the head's too */
            kvt_wmat *m[LAYER_MATS];
            for (size_t i = 0, n = layer_mats(w, l, m); i < n; i++) free((void *)m[i]->pk);
        }
        for (uint32_t l = 0; l < w->L + (w->mtp != NULL); l++) {
            kvt_llama_layer *ly = &w->layers[l];
            void *v[] = {ly->attn_norm, ly->ffn_norm, ly->bq, ly->bk, ly->bv, ly->qn, ly->kn, ly->gate_inp,
                         ly->post_attn, ly->post_ffn, ly->out_scale, ly->gate_inp_s, ly->down_s, ly->pre_ffn2,
                         ly->post_ffn1, ly->post_ffn2, ly->ple_post, ly->gdn.conv_w, ly->gdn.dt, ly->gdn.a,
                         ly->gdn.norm, ly->sh_inp};
            for (size_t i = 0; i < sizeof v / sizeof *v; i++) free(v[i]);
        }
        free(w->layers);
    }
    free(w->out_norm);
    free(w->enorm);
    free(w->hnorm);
    free(w->mtp_norm);
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
int kvt_llama_weights_pack(void *p, const kvt_gguf *g)
{
    kvt_llama_weights *w = p;
    for (uint32_t l = 0; l < mats_end(w); l++) {
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

/* ARCH.suffix, the family's key. */
static const char *fkey(const kvt_llama_weights *w, const char *suffix)
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
static int layer_u32(const kvt_gguf *g, const kvt_llama_weights *w, const char *suffix, bool need, uint32_t def,
                     uint32_t *out)
{
    const char *key = fkey(w, suffix);
    const kvt_gguf_val *v = kvt_gguf_get(g, key);
    if (v && v->type == KVT_GGUF_ARR && w->fam->layer_shapes) {
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
static int opt_f32(const kvt_gguf *g, const kvt_llama_weights *w, const char *suffix, float def, float *out)
{
    *out = def;
    int rc = kvt_gguf_get_f32(g, fkey(w, suffix), out);
    return rc == KVT_ENOENT ? KVT_OK : rc;
}

static int opt_u32(const kvt_gguf *g, const kvt_llama_weights *w, const char *suffix, uint32_t def, uint32_t *out)
{
    *out = def;
    int rc = kvt_gguf_get_u32(g, fkey(w, suffix), out);
    return rc == KVT_ENOENT ? KVT_OK : rc;
}

/* The family of general.architecture; NULL when it is none of them. */
static const kvt_llama_family *family_of(const kvt_gguf *g)
{
    const char *a;
    size_t n;
    if (kvt_gguf_get_str(g, "general.architecture", &a, &n)) return NULL;
    for (size_t i = 0; i < sizeof families / sizeof *families; i++)
        if (strlen(families[i].name) == n && !memcmp(families[i].name, a, n)) return &families[i];
    return NULL;
}

bool kvt_llama_weights_handles(const kvt_gguf *g) { return family_of(g) != NULL; }

/* The window layers (windows): which they are, their window and RoPE base,
 * and the final soft-capping. */
static int window_hparams(const kvt_gguf *g, kvt_llama_weights *w)
{
    int rc;
    const kvt_llama_family *f = w->fam;
    /* llama.cpp's gemma3: window layers by attention.sliding_window_pattern
     * (every n-th layer global, default 6; or a per-layer array), their
     * RoPE base rope.freq_base_swa (default 10000); the 62-layer 27B scales
     * attention by 1 / sqrt(D / H). Its gemma4 (layer_shapes): the window
     * and the pattern (an array, 1 for a window layer; layers past its end
     * global) required; soft-capping 30 unless given; no attention scaling. */
    if ((rc = f->layer_shapes ? need_u32(g, fkey(w, "attention.sliding_window"), &w->swa)
                              : opt_u32(g, w, "attention.sliding_window", 0, &w->swa)) ||
        (rc = opt_f32(g, w, "rope.freq_base_swa", 10000.0f, &w->rope_base_swa)) ||
        (rc = opt_f32(g, w, "final_logit_softcapping", f->softcap, &w->softcap)))
        return rc;
    if (!(w->softcap >= 0) || !isfinite(w->softcap) || !(w->rope_base_swa > 0) || !isfinite(w->rope_base_swa))
        return kvt_fail(KVT_EFORMAT, "%s: bad final_logit_softcapping %g or rope.freq_base_swa %g", f->name,
                        (double)w->softcap, (double)w->rope_base_swa);
    if (w->L == 62 && !f->unscaled_attn) w->scale = 1.0f / sqrtf((float)(w->D / w->H));
    if (f->unscaled_attn) w->scale = 1.0f;
    if (!(w->is_swa = kvt_calloc(w->L, 1))) return KVT_ENOMEM;
    const char *pk = fkey(w, "attention.sliding_window_pattern");
    const kvt_gguf_val *pv = kvt_gguf_get(g, pk);
    uint32_t np = 6;
    if (pv && pv->type == KVT_GGUF_ARR) {
        if ((f->layer_shapes ? pv->n > w->L : pv->n != w->L) ||
            !(pv->elem_type == KVT_GGUF_BOOL || pv->elem_type <= KVT_GGUF_I32))
            return kvt_fail(KVT_EFORMAT, "%s: sliding_window_pattern has %llu entries for %u layers", f->name,
                            (unsigned long long)pv->n, w->L);
        for (uint32_t l = 0; l < pv->n; l++) w->is_swa[l] = pv->v.arr[l].v.u != 0;
    } else if (f->layer_shapes) {
        return kvt_fail(KVT_EFORMAT, "%s is %s, not an array of one entry per layer", pk, pv ? "a scalar" : "missing");
    } else {
        if (pv && (rc = kvt_gguf_get_u32(g, pk, &np))) return rc;
        for (uint32_t l = 0; l < w->L; l++) w->is_swa[l] = np == 0 || l % np < np - 1;
    }
    if (!w->swa) memset(w->is_swa, 0, w->L);
    if (w->swa > 1u << 20 || (f->layer_shapes && !w->swa))
        return kvt_fail(KVT_EFORMAT, "%s: attention.sliding_window %u is 0 or past 2^20", f->name, w->swa);
    return KVT_OK;
}

/* The rest of llama.cpp's gemma4 header, each part by its feature: the
 * window layers' head length (*hd_swa) and the norms' epsilon required
 * (layer_shapes), the per-layer embeddings' length (ple), the shared layers
 * (*shared: shared_kv), the experts (layer_experts). */
static int layer_hparams(const kvt_gguf *g, kvt_llama_weights *w, uint32_t *hd_swa, uint32_t *shared)
{
    int rc;
    const kvt_llama_family *f = w->fam;
    uint32_t vl = 0, any = 0;
    for (uint32_t l = 0; l < w->L; l++) any += w->is_swa && w->is_swa[l];
    if ((f->layer_shapes && ((rc = need_u32(g, fkey(w, "attention.key_length_swa"), hd_swa)) ||
                             (rc = need_u32(g, fkey(w, "attention.value_length_swa"), &vl)))) ||
        (f->ple && (rc = need_u32(g, fkey(w, "embedding_length_per_layer_input"), &w->n_pl))) ||
        (f->shared_kv && (rc = opt_u32(g, w, "attention.shared_kv_layers", 0, shared))))
        return rc;
    if (f->layer_shapes) {
        if (!kvt_gguf_get(g, fkey(w, "attention.layer_norm_rms_epsilon")))
            return kvt_fail(KVT_EFORMAT, "missing metadata key %s", fkey(w, "attention.layer_norm_rms_epsilon"));
        if (!*hd_swa || *hd_swa % 2 || *hd_swa > 1024 || vl != *hd_swa)
            return kvt_fail(KVT_EFORMAT, "%s: attention.key_length_swa %u and value_length_swa %u: not one even length "
                            "up to 1024", f->name, *hd_swa, vl);
        if (!any) return kvt_fail(KVT_EFORMAT, "%s: no window layer in attention.sliding_window_pattern", f->name);
    }
    if (f->ple && (w->n_pl > 65536 || (uint64_t)w->n_pl * w->L > 1u << 24))
        return kvt_fail(KVT_EFORMAT, "%s: embedding_length_per_layer_input %u is too large", f->name, w->n_pl);
    if (f->shared_kv && (*shared >= w->L || w->L - *shared < 2))
        return kvt_fail(KVT_EFORMAT, "%s: attention.shared_kv_layers %u leaves fewer than 2 of %u layers their own K "
                        "and V", f->name, *shared, w->L);
    if (!f->layer_experts) return KVT_OK;
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
            if (eu[l] != w->Eu) rc = kvt_fail(KVT_EFORMAT, "%s: expert_used_count differs by layer", f->name);
        if (!rc && (w->E > 1024 || w->Eu > w->E || w->Eu > 64 || (w->E && (!w->Eu || !w->Fe)) || w->Fe > 1u << 20))
            rc = kvt_fail(KVT_EFORMAT, "%s: inconsistent experts: expert_count %u, expert_used_count %u, "
                          "expert_feed_forward_length %u", f->name, w->E, w->Eu, w->Fe);
    }
    free(eu);
    return rc;
}

/* gemma4's own tensors of layer l: the output scale and the per-layer
 * embedding's gate and projection (ple), the experts of a layer with
 * ffn_gate_inp (layer_experts). The per-tensor output scales llama.cpp
 * also reads (an NVFP4 file's) are refused: kvtier does not apply them. */
static int layer_extras(const kvt_gguf *g, kvt_llama_weights *w, uint32_t l)
{
    kvt_llama_layer *ly = &w->layers[l];
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
    if (w->fam->ple && kvt_gguf_find_tensor(g, NAME("layer_output_scale.weight"))) {
        if ((rc = kvt_tensor_f32(g, nm, 1, 1, &ly->out_scale))) return rc;
        if (!isfinite(*ly->out_scale)) return kvt_fail(KVT_EFORMAT, "%s: %s is not finite", w->fam->name, nm);
    }
    if (w->fam->layer_experts && kvt_gguf_find_tensor(g, NAME("ffn_gate_inp.weight"))) {
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
    if (w->fam->ple && w->n_pl &&
        ((rc = kvt_tensor_mat(g, NAME("inp_gate.weight"), D, w->n_pl, &ly->inp_gate)) ||
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
static int hybrid_hparams(const kvt_gguf *g, kvt_llama_weights *w)
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
static int gdn_layer(const kvt_gguf *g, const kvt_llama_weights *w, uint32_t l, kvt_gdn_layer *d)
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
static int llama_layout(kvt_llama_weights *w)
{
    uint32_t L = w->L;
    if (!(w->kv_at = kvt_calloc(L, sizeof *w->kv_at)) || !(w->ring_at = kvt_calloc(L + 1, sizeof *w->ring_at)) ||
        !(w->ring_kv = kvt_calloc(L, sizeof *w->ring_kv)) || !(w->stream_kv = kvt_calloc(L, sizeof *w->stream_kv)))
        return KVT_ENOMEM;
    w->swa_src = -1;
    for (uint32_t l = 0; l < L; l++) {
        const kvt_llama_layer *ly = &w->layers[l];
        bool swa = w->is_swa && w->is_swa[l];
        if (ly->recr) { /* no rows: its state follows the rings */
            w->kv_at[l] = 0;
        } else if (ly->shared) {
            uint32_t src = w->n_kv - (swa ? 2 : 1);
            w->kv_at[l] = w->kv_at[src];
            if (w->kv_at[src] < 0) w->swa_src = (int32_t)src;
        } else if (swa && kvt_llama_fault != KVT_LLAMA_FAULT_NO_WINDOW) {
            w->ring_kv[w->n_ring] = ly->KV;
            w->kv_at[l] = -1 - (int32_t)w->n_ring++;
        } else {
            w->stream_kv[w->n_global] = ly->KV;
            w->kv_at[l] = (int32_t)(2 * w->n_global++);
        }
    }
    return kvt_llama_weights_rows(w, kvt_rows_resolve(KVT_ROWS_DEFAULT), kvt_rows_resolve(KVT_ROWS_DEFAULT),
                                  true);
}

int kvt_llama_weights_rows(kvt_llama_weights *w, kvt_row_type type_k, kvt_row_type type_v, bool set)
{
    /* attention reads a head's part of a row on its own: a block may not
     * straddle two heads */
    for (uint32_t l = 0; l < w->L + (w->mtp != NULL); l++) { /* the MTP layer's rows too */
        const kvt_llama_layer *ly = &w->layers[l];
        if (ly->recr || ly->shared) continue;
        for (int v = 0; v < 2; v++)
            if (!kvt_rows_fits(v ? type_v : type_k, ly->hd))
                return kvt_fail(KVT_EINVAL, "cache type %s for %c: layer %u's heads are %zu long, not a multiple of %zu",
                                kvt_row_type_name(v ? type_v : type_k), v ? 'V' : 'K', l, (size_t)ly->hd,
                                kvt_rows_block(v ? type_v : type_k));
    }
    if (!set) return KVT_OK;
    w->type_k = type_k;
    w->type_v = type_v;
    for (size_t r = 0; r < w->n_ring; r++)
        w->ring_at[r + 1] = w->ring_at[r] + (size_t)w->swa * (kvt_rows_bytes(type_k, w->ring_kv[r]) +
                                                              kvt_rows_bytes(type_v, w->ring_kv[r]));
    w->rec_at = w->ring_at[w->n_ring];
    return KVT_OK;
}

/* The fixed state's bytes: the rings, then the DeltaNet layers' states. */
size_t kvt_llama_weights_state_bytes(const kvt_llama_weights *w)
{
    return w->rec_at + w->n_rec * (w->n_rec ? kvt_gdn_state_bytes(&w->gdn) : 0) +
           (w->mtp_rows ? (size_t)w->D * sizeof(float) : 0);
}


/* What kvt_llama_weights_load reads before the tensors: the per-layer counts (from
 * arrays where the family has layer_shapes) and the window layers' head
 * length and RoPE dims. */
typedef struct load_shape {
    uint32_t ctx;
    uint32_t *Hs, *Hkvs, *Fs;  /* (L) x3 head counts, KV head counts, FFN lengths */
    uint32_t hd_swa, rot_swa, shared;
    uint32_t nextn;            /* qwen35: nextn_predict_layers, the MTP layers after the model's (0 or 1) */
} load_shape;

/* The model's settings: its shape, norms, RoPE, experts and each
 * feature's own keys, checked. */
static int load_settings(const kvt_gguf *g, kvt_llama_weights *w, load_shape *sh)
{
    const kvt_llama_family *f = w->fam;
    int rc;
    if ((rc = need_u32(g, fkey(w, "embedding_length"), &w->D)) || (rc = need_u32(g, fkey(w, "block_count"), &w->L)) ||
        (rc = need_u32(g, fkey(w, "context_length"), &sh->ctx)))
        return rc;
    if (!w->D || w->D > 65536 || !w->L || w->L > 1024 || sh->ctx == 0)
        return kvt_fail(KVT_EFORMAT, "%s: inconsistent shape D=%u L=%u ctx=%u", f->name, w->D, w->L, sh->ctx);
    /* qwen35's MTP layer: block_count counts it (llama.cpp's n_layer_all),
     * the model's layers are the ones before it */
    if (f->deltanet && (rc = opt_u32(g, w, "nextn_predict_layers", 0, &sh->nextn))) return rc;
    if (sh->nextn > 1)
        return kvt_fail(KVT_EUNSUPPORTED, "%s: nextn_predict_layers %u: one MTP layer is supported", f->name,
                        sh->nextn);
    if (sh->nextn && w->L < 2)
        return kvt_fail(KVT_EFORMAT, "%s: block_count %u leaves no layer before the MTP layer", f->name, w->L);
    w->L -= sh->nextn;
    /* head counts, KV head counts (default: the head counts), FFN lengths */
    if (!(sh->Hs = kvt_calloc(3 * (size_t)w->L, sizeof *sh->Hs))) return KVT_ENOMEM;
    sh->Hkvs = sh->Hs + w->L;
    sh->Fs = sh->Hs + 2 * w->L;
    if ((rc = layer_u32(g, w, "attention.head_count", true, 0, sh->Hs)) ||
        (rc = layer_u32(g, w, "feed_forward_length", !(f->moe && f->deltanet), 1, sh->Fs)) ||
        (rc = layer_u32(g, w, "attention.head_count_kv", false, 0, sh->Hkvs)))
        return rc;
    if (!kvt_gguf_get(g, fkey(w, "attention.head_count_kv"))) memcpy(sh->Hkvs, sh->Hs, w->L * sizeof *sh->Hs);
    w->H = sh->Hs[0];
    w->Hkv = sh->Hkvs[0];
    w->F = sh->Fs[0];
    if ((rc = opt_f32(g, w, "attention.layer_norm_rms_epsilon", 1e-5f, &w->eps)) ||
        (rc = opt_f32(g, w, "rope.freq_base", 10000.0f, &w->rope_base)))
        return rc;
    if (!(w->eps >= 0) || !isfinite(w->eps) || !(w->rope_base > 0) || !isfinite(w->rope_base))
        return kvt_fail(KVT_EFORMAT, "%s: bad layer_norm_rms_epsilon %g or rope.freq_base %g", f->name,
                        (double)w->eps, (double)w->rope_base);
    w->hd = w->H && w->D % w->H == 0 ? w->D / w->H : 0;
    uint32_t vl = 0;
    if ((rc = opt_u32(g, w, "attention.key_length", w->hd, &w->hd)) ||
        (rc = opt_u32(g, w, "attention.value_length", 0, &vl)))
        return rc;
    if (!w->H || !w->Hkv || !w->F || !w->hd || w->hd % 2 || w->hd > 1024 || (vl && vl != w->hd) ||
        w->H % w->Hkv || w->H > 1024 || w->F > 1u << 20)
        return kvt_fail(KVT_EFORMAT, "%s: inconsistent shape D=%u L=%u H=%u Hkv=%u head_dim=%u (values %u) F=%u ctx=%u",
                        f->name, w->D, w->L, w->H, w->Hkv, w->hd, vl, w->F, sh->ctx);
    if (f->moe) {
        if ((rc = need_u32(g, fkey(w, "expert_count"), &w->E)) ||
            (rc = need_u32(g, fkey(w, "expert_used_count"), &w->Eu)) ||
            (rc = need_u32(g, fkey(w, "expert_feed_forward_length"), &w->Fe)))
            return rc;
        if (!w->E || w->E > 1024 || !w->Eu || w->Eu > w->E || w->Eu > 64 || !w->Fe || w->Fe > 1u << 20)
            return kvt_fail(KVT_EFORMAT, "%s: inconsistent experts: %u, %u used, length %u", f->name, w->E, w->Eu,
                            w->Fe);
    }
    w->scale = 1.0f / sqrtf((float)w->hd);
    sh->hd_swa = w->hd;
    if (f->windows && ((rc = window_hparams(g, w)) || (rc = layer_hparams(g, w, &sh->hd_swa, &sh->shared))))
        return rc;
    if ((rc = opt_u32(g, w, "rope.dimension_count", w->hd, &w->n_rot)) ||
        (rc = opt_u32(g, w, "rope.dimension_count_swa", w->n_rot, &sh->rot_swa)))
        return rc;
    if (w->n_rot > w->hd || w->n_rot % 2 || (f->layer_shapes && (sh->rot_swa > sh->hd_swa || sh->rot_swa % 2)))
        return kvt_fail(KVT_EFORMAT, "%s: rope.dimension_count %u (_swa %u) does not fit head dim %u (_swa %u)",
                        f->name, w->n_rot, sh->rot_swa, w->hd, sh->hd_swa);
    return KVT_OK;
}

/* Each layer's shape, the shared layers and what they read; the largest
 * of the layers' lengths (the scratch's). */
static int layer_shapes(kvt_llama_weights *w, const load_shape *sh)
{
    const kvt_llama_family *f = w->fam;
    w->QD = w->KV = w->F = 0;
    for (uint32_t l = 0; l < w->L; l++) {
        kvt_llama_layer *ly = &w->layers[l];
        bool swa = w->is_swa && w->is_swa[l];
        uint32_t src = w->n_kv - (swa ? 2 : 1);
        ly->H = sh->Hs[l];
        ly->Hkv = sh->Hkvs[l];
        ly->F = sh->Fs[l];
        ly->hd = f->layer_shapes && swa ? sh->hd_swa : w->hd;
        ly->n_rot = f->layer_shapes && swa ? sh->rot_swa : w->n_rot;
        ly->base = swa ? w->rope_base_swa : w->rope_base;
        ly->shared = l >= w->n_kv && kvt_llama_fault != KVT_LLAMA_FAULT_OWN_KV;
        ly->QD = ly->H * ly->hd;
        ly->KV = ly->Hkv * ly->hd;
        if (!ly->H || !ly->Hkv || ly->H % ly->Hkv || ly->H > 1024 || !ly->F || ly->F > 1u << 20)
            return kvt_fail(KVT_EFORMAT, "%s: layer %u: attention.head_count %u, head_count_kv %u, "
                            "feed_forward_length %u are inconsistent", f->name, l, ly->H, ly->Hkv, ly->F);
        if (l >= w->n_kv && (w->is_swa[src] != swa || sh->Hkvs[src] != ly->Hkv))
            return kvt_fail(KVT_EFORMAT, "%s: shared layer %u would read layer %u, of another kind "
                            "(attention.sliding_window_pattern, head_count_kv)", f->name, l, src);
        w->QD = ly->QD > w->QD ? ly->QD : w->QD;
        w->KV = ly->KV > w->KV ? ly->KV : w->KV;
        w->F = ly->F > w->F ? ly->F : w->F;
    }
    if (kvt_llama_fault == KVT_LLAMA_FAULT_OWN_KV) w->n_kv = w->L;
    w->F = w->Fs > w->F ? w->Fs : w->F;
    if (f->gated_attn) w->QD *= 2; /* the queries and their gates (the scratch's q holds both) */
    return KVT_OK;
}

/* The tensors outside the layers: the embeddings (and the per-layer ones),
 * the output norm and head, rope_freqs. */
static int load_globals(const kvt_gguf *g, kvt_llama_weights *w)
{
    const kvt_llama_family *f = w->fam;
    int rc;
    const kvt_gguf_tensor *te = kvt_gguf_find_tensor(g, "token_embd.weight");
    if (!te || te->n_dims != 2 || te->ne[0] != w->D || te->ne[1] == 0 || te->ne[1] > 1u << 24)
        return kvt_fail(KVT_EFORMAT, "llama: token_embd.weight missing or not (%u, V)", w->D);
    w->V = (uint32_t)te->ne[1];
    if ((rc = kvt_tensor_mat(g, "token_embd.weight", w->D, w->V, &w->tok_embd)) ||
        (rc = kvt_tensor_f32(g, "output_norm.weight", w->D, 1, &w->out_norm)))
        return rc;
    if (w->n_pl) {
        uint64_t NP = (uint64_t)w->n_pl * w->L;
        if ((rc = kvt_tensor_mat(g, "per_layer_token_embd.weight", NP, w->V, &w->ple_embd)) ||
            (rc = kvt_tensor_mat(g, "per_layer_model_proj.weight", w->D, NP, &w->ple_proj)) ||
            (rc = kvt_tensor_f32(g, "per_layer_proj_norm.weight", w->n_pl, 1, &w->ple_norm)))
            return rc;
    }
    /* rope_freqs: llama 3's, of its n_rot / 2 pairs; gemma4's
     * (global_rope_freqs), of its global layers' head_dim / 2 pairs (the
     * first n_rot / 2 used), needed there */
    bool any_global = false;
    for (uint32_t l = 0; l < w->L; l++) any_global |= !w->is_swa || !w->is_swa[l];
    if (f->global_rope_freqs && any_global && !kvt_gguf_find_tensor(g, "rope_freqs.weight"))
        return kvt_fail(KVT_EFORMAT, "%s: missing tensor rope_freqs.weight (of the global layers)", f->name);
    if (kvt_gguf_find_tensor(g, "rope_freqs.weight")) {
        w->n_ff = f->global_rope_freqs ? w->hd / 2 : w->n_rot / 2;
        if ((rc = kvt_tensor_f32(g, "rope_freqs.weight", w->n_ff, 1, &w->rope_ff))) return rc;
        for (uint32_t i = 0; i < w->n_ff; i++)
            if (!(w->rope_ff[i] > 0) || !isfinite(w->rope_ff[i]))
                return kvt_fail(KVT_EFORMAT, "%s: rope_freqs.weight[%u] = %g is not a positive factor", f->name, i,
                                (double)w->rope_ff[i]);
    }
    if (kvt_gguf_find_tensor(g, "output.weight")) return kvt_tensor_mat(g, "output.weight", w->D, w->V, &w->out);
    w->out = w->tok_embd;
    return KVT_OK;
}

/* Layer l's tensors, as its family and kind (DeltaNet, shared) have them. */
static int load_layer(const kvt_gguf *g, kvt_llama_weights *w, uint32_t l)
{
    const kvt_llama_family *f = w->fam;
    kvt_llama_layer *ly = &w->layers[l];
    int rc;
    ly->ff = f->global_rope_freqs && w->is_swa[l] ? NULL : w->rope_ff;
    char nm[96];
#define V(field, suffix, a)                                                      \
    snprintf(nm, sizeof nm, "blk.%u.%s", l, suffix);                             \
    if ((rc = kvt_tensor_f32(g, nm, a, 1, &ly->field))) return rc;
#define M(field, suffix, a, b)                                                   \
    snprintf(nm, sizeof nm, "blk.%u.%s", l, suffix);                             \
    if ((rc = kvt_tensor_mat(g, nm, a, b, &ly->field))) return rc;
    V(attn_norm, "attn_norm.weight", w->D)
    if (ly->recr) {
        if ((rc = gdn_layer(g, w, l, &ly->gdn))) return rc;
    } else {
        M(wq, "attn_q.weight", w->D, f->gated_attn ? 2 * ly->QD : ly->QD)
        if (!ly->shared) {
            M(wk, "attn_k.weight", w->D, ly->KV)
            snprintf(nm, sizeof nm, "blk.%u.attn_v.weight", l);
            if (!f->v_norm || kvt_gguf_find_tensor(g, nm)) { M(wv, "attn_v.weight", w->D, ly->KV) }
        }
        if (f->qkv_bias) {
            V(bq, "attn_q.bias", ly->QD)
            V(bk, "attn_k.bias", ly->KV)
            V(bv, "attn_v.bias", ly->KV)
        }
        if (f->qk_norm) {
            V(qn, "attn_q_norm.weight", ly->hd)
            if (!ly->shared) { V(kn, "attn_k_norm.weight", ly->hd) }
        }
        M(wo, "attn_output.weight", ly->QD, w->D)
    }
    if (f->deltanet) { /* qwen35's FFN input norm */
        V(ffn_norm, "post_attention_norm.weight", w->D)
    } else {
        V(ffn_norm, "ffn_norm.weight", w->D)
    }
    if (f->post_norms) {
        V(post_attn, "post_attention_norm.weight", w->D)
        V(post_ffn, "post_ffw_norm.weight", w->D)
    }
    if (f->moe) {
        snprintf(nm, sizeof nm, "blk.%u.ffn_gate_inp.weight", l);
        if ((rc = kvt_tensor_f32(g, nm, w->D, w->E, &ly->gate_inp))) return rc;
        const char *const xn[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
        kvt_wmat *xm[3] = {&ly->gate_x, &ly->up_x, &ly->down_x};
        for (int i = 0; i < 3; i++) {
            snprintf(nm, sizeof nm, "blk.%u.%s.weight", l, xn[i]);
            if ((rc = kvt_tensor_mat3(g, nm, i < 2 ? w->D : w->Fe, i < 2 ? w->Fe : w->D, w->E, xm[i]))) return rc;
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
    return f->ple || f->layer_experts ? layer_extras(g, w, l) : KVT_OK;
}

/* qwen35's MTP layer (block L): a full-attention layer of the model's
 * shape, as llama.cpp's load_block_mtp, and its nextn.* tensors. */
static int load_mtp(const kvt_gguf *g, kvt_llama_weights *w)
{
    uint32_t L = w->L;
    kvt_llama_layer *ly = &w->layers[L];
    *ly = (kvt_llama_layer){.H = w->H, .Hkv = w->Hkv, .hd = w->hd, .QD = w->H * w->hd, .KV = w->Hkv * w->hd,
                            .F = w->layers[0].F, .n_rot = w->n_rot, .base = w->rope_base};
    w->mtp = ly;
    int rc = load_layer(g, w, L);
    if (rc) return rc;
    uint64_t D = w->D;
    char nm[96];
#define NM(s) (snprintf(nm, sizeof nm, "blk.%u.nextn.%s", L, s), nm)
    if ((rc = kvt_tensor_mat(g, NM("eh_proj.weight"), 2 * D, D, &w->eh)) ||
        (rc = kvt_tensor_f32(g, NM("enorm.weight"), D, 1, &w->enorm)) ||
        (rc = kvt_tensor_f32(g, NM("hnorm.weight"), D, 1, &w->hnorm)))
        return rc;
    if (kvt_gguf_find_tensor(g, NM("embed_tokens.weight")) && (rc = kvt_tensor_mat(g, nm, D, w->V, &w->mtp_embd)))
        return rc;
    if (kvt_gguf_find_tensor(g, NM("shared_head_head.weight")) && (rc = kvt_tensor_mat(g, nm, D, w->V, &w->mtp_head)))
        return rc;
    if (kvt_gguf_find_tensor(g, NM("shared_head_norm.weight")) && (rc = kvt_tensor_f32(g, nm, D, 1, &w->mtp_norm)))
        return rc;
#undef NM
    return KVT_OK;
}

/* The parameters: every matrix and vector the model computes with (as the
 * families counted them when they came: gemma3's post norms are left out). */
static uint64_t count_params(const kvt_llama_weights *w)
{
    const kvt_llama_family *f = w->fam;
    uint64_t D = w->D, np = (uint64_t)w->V * D * (w->out.data == w->tok_embd.data ? 1 : 2) + D;
    for (uint32_t l = 0; l < w->L; l++) {
        const kvt_llama_layer *ly = &w->layers[l];
        if (f->deltanet) { /* its matrices, norms and the DeltaNet layers' vectors */
            kvt_wmat *mm[LAYER_MATS];
            for (size_t i = 0, nm = layer_mats((kvt_llama_weights *)w, l, mm); i < nm; i++)
                np += (uint64_t)mm[i]->rows * mm[i]->cols;
            np += 2 * D + (ly->qn ? 2 * ly->hd : 0) + (f->moe ? (uint64_t)w->E * (D + 3 * D * w->Fe) + D : 0) +
                  (ly->recr ? kvt_gdn_channels(&w->gdn) * w->gdn.conv + 2 * w->gdn.Hv + w->gdn.S : 0);
            continue;
        }
        np += 2 * D + 2ull * ly->QD * D + (uint64_t)(ly->wk.rows + ly->wv.rows) * D +
              (f->moe ? (uint64_t)w->E * (D + 3 * D * w->Fe) : 3 * D * ly->F) +
              (f->qkv_bias ? ly->QD + 2ull * ly->KV : 0) + (ly->qn ? ly->hd : 0) + (ly->kn ? ly->hd : 0);
        if (f->ple) /* gemma4: its post norms, output scale, experts, per-layer embeddings */
            np += 2 * D + (ly->out_scale ? 1 : 0) + (ly->gate_inp ? (uint64_t)w->E * (D + 3 * D * w->Fe) + 4 * D : 0) +
                  (ly->down_s ? w->E : 0) + (w->n_pl ? 2ull * w->n_pl * D + D : 0);
    }
    if (f->ple) np += (uint64_t)w->n_pl * w->L * (w->V + D) + w->n_pl + w->n_ff;
    return np;
}

int kvt_llama_weights_load(kvt_llama_weights **out, const kvt_gguf *g, kvt_model_info *info)
{
    kvt_llama_weights *w = kvt_calloc(1, sizeof *w);
    if (!w) return KVT_ENOMEM;
    load_shape sh = {0};
    int rc;
    if (!(w->fam = family_of(g))) {
        free(w);
        return kvt_fail(KVT_EFORMAT, "llama: general.architecture is not of the llama family");
    }
    if ((rc = load_settings(g, w, &sh))) goto fail;
    if (!(w->layers = kvt_calloc(w->L + sh.nextn, sizeof *w->layers))) { rc = KVT_ENOMEM; goto fail; }
    w->n_kv = w->L - sh.shared;
    if ((w->fam->deltanet && (rc = hybrid_hparams(g, w))) || (rc = layer_shapes(w, &sh)) ||
        (rc = load_globals(g, w)))
        goto fail;
    for (uint32_t l = 0; l < w->L; l++)
        if ((rc = load_layer(g, w, l))) goto fail;
    if (sh.nextn && (rc = load_mtp(g, w))) goto fail;
    if ((rc = llama_layout(w))) goto fail;
    free(sh.Hs);
    *out = w;
    *info = (kvt_model_info){.arch = w->fam->name, .n_vocab = w->V, .n_ctx_train = sh.ctx, .n_embd = w->D,
                               .n_layer = w->L, .n_head = w->H, .n_head_kv = w->Hkv, .head_dim = w->hd,
                               .n_ff = w->F, .n_params = count_params(w)};
    return KVT_OK;
fail:
    free(sh.Hs);
    kvt_llama_weights_free(w);
    return rc;
}

static void hash_vec(XXH3_state_t *st, const float *v, size_t n)
{
    if (v) XXH3_64bits_update(st, v, n * sizeof(float));
}

/* gemma4's own: its shape per layer, sharing, per-layer embeddings, output
 * scales and experts' scales and norms. */
static void gemma4_hash(XXH3_state_t *st, const kvt_llama_weights *w)
{
    uint32_t h[] = {w->n_kv, w->n_pl, w->E, w->Eu, w->Fe, w->n_ff};
    XXH3_64bits_update(st, h, sizeof h);
    if (w->n_pl) {
        kvt_tensor_hash(st, &w->ple_embd);
        kvt_tensor_hash(st, &w->ple_proj);
        hash_vec(st, w->ple_norm, w->n_pl);
    }
    for (uint32_t l = 0; l < w->L; l++) {
        const kvt_llama_layer *ly = &w->layers[l];
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
static void hybrid_hash(XXH3_state_t *st, const kvt_llama_weights *w)
{
    const kvt_gdn_shape *gd = &w->gdn;
    uint32_t h[] = {gd->Hk, gd->Hv, gd->S, gd->conv, w->Fs, (uint32_t)w->n_rec};
    XXH3_64bits_update(st, h, sizeof h);
    XXH3_64bits_update(st, &w->moe_scale, sizeof w->moe_scale);
    size_t C = kvt_gdn_channels(gd);
    for (uint32_t l = 0; l < w->L; l++) {
        const kvt_llama_layer *ly = &w->layers[l];
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
    if (!w->mtp) return; /* a file without the MTP layer hashes as before it was read */
    const kvt_llama_layer *ly = w->mtp;
    XXH3_64bits_update(st, "nextn", 5);
    kvt_wmat *m[LAYER_MATS];
    for (size_t i = 0, n = layer_mats((kvt_llama_weights *)w, w->L + 1, m); i < n; i++) kvt_tensor_hash(st, m[i]);
    kvt_tensor_hash(st, &w->mtp_embd);
    const float *v[] = {ly->attn_norm, ly->ffn_norm, ly->qn, ly->kn, ly->sh_inp, w->enorm, w->hnorm, w->mtp_norm};
    size_t len[] = {w->D, w->D, ly->hd, ly->hd, w->D, w->D, w->D, w->D};
    for (size_t i = 0; i < sizeof v / sizeof *v; i++) hash_vec(st, v[i], len[i]);
    if (ly->gate_inp) XXH3_64bits_update(st, ly->gate_inp, (size_t)w->E * w->D * 4);
}

uint64_t kvt_llama_weights_fingerprint(const void *p)
{
    const kvt_llama_weights *w = p;
    XXH3_state_t *st = XXH3_createState();
    if (!st) return 0;
    XXH3_64bits_reset(st);
    uint32_t hdr[] = {w->D, w->L, w->H, w->Hkv, w->hd, w->KV, w->F, w->V, w->n_rot};
    XXH3_64bits_update(st, "llama", 5);
    hash_vec(st, w->rope_ff, w->n_ff);
    if (w->fam->windows) {
        float g[3] = {w->rope_base_swa, w->scale, w->softcap};
        XXH3_64bits_update(st, g, sizeof g);
        XXH3_64bits_update(st, &w->swa, sizeof w->swa);
        XXH3_64bits_update(st, w->is_swa, w->L);
    }
    if (w->fam->layer_shapes) gemma4_hash(st, w);
    if (w->fam->deltanet) hybrid_hash(st, w);
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
        const kvt_llama_layer *ly = &w->layers[l];
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
