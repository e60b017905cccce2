/* The llama architecture: RMSNorm, RoPE on adjacent pairs, grouped-query
 * attention over full K and V rows, SwiGLU FFN, tied or separate output head,
 * configured from GGUF `llama.*` metadata.
 *
 * Cache layout: two streams per layer, K then V, each one f32 row of
 * n_head_kv * head_dim per token (128 rows per 128-token block). Rows are
 * written once, when their token is processed, and never change afterwards.
 *
 * Exactness: a chunk of n tokens is processed with the same per-row kernels
 * as a single token. Attention for the token at position t reads keys 0..t in
 * increasing order whatever chunk they were written in, and every matmul
 * output is one fixed-order dot product, so logits and cache bytes do not
 * depend on the chunk schedule or the thread count.
 */
#include "kernels.h"
#include "model.h"
#include "util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <xxhash.h>

typedef struct llama_layer {
    float *attn_norm;  /* (D) */
    float *wq;         /* (D, D)       q = wq · x */
    float *wk, *wv;    /* (KV, D)      KV = n_head_kv * head_dim */
    float *wo;         /* (D, D) */
    float *ffn_norm;   /* (D) */
    float *w1, *w3;    /* (F, D)       gate, up */
    float *w2;         /* (D, F)       down */
} llama_layer;

typedef struct llama_weights {
    uint32_t D, L, H, Hkv, hd, KV, F, V, n_rot;
    float eps, rope_base;
    float *tok_embd;   /* (V, D) */
    float *out_norm;   /* (D) */
    float *out;        /* (V, D); == tok_embd when tied */
    llama_layer *layers; /* (L) */
} llama_weights;

static void llama_free(void *p)
{
    llama_weights *w = p;
    if (!w) return;
    if (w->layers) {
        for (uint32_t l = 0; l < w->L; l++) {
            llama_layer *ly = &w->layers[l];
            free(ly->attn_norm); free(ly->wq); free(ly->wk); free(ly->wv); free(ly->wo);
            free(ly->ffn_norm); free(ly->w1); free(ly->w2); free(ly->w3);
        }
        free(w->layers);
    }
    if (w->out != w->tok_embd) free(w->out);
    free(w->tok_embd);
    free(w->out_norm);
    free(w);
}

static int need_u32(const kvt_gguf *g, const char *key, uint32_t *out)
{
    int rc = kvt_gguf_get_u32(g, key, out);
    if (rc == KVT_ENOENT) return kvt_fail(KVT_EFORMAT, "missing metadata key %s", key);
    return rc;
}

int kvt_llama_load(kvt_model *m, const kvt_gguf *g)
{
    llama_weights *w = kvt_calloc(1, sizeof *w);
    if (!w) return KVT_ENOMEM;
    int rc;
    uint32_t ctx = 0;
    if ((rc = need_u32(g, "llama.embedding_length", &w->D)) ||
        (rc = need_u32(g, "llama.block_count", &w->L)) ||
        (rc = need_u32(g, "llama.attention.head_count", &w->H)) ||
        (rc = need_u32(g, "llama.feed_forward_length", &w->F)) ||
        (rc = need_u32(g, "llama.context_length", &ctx)))
        goto fail;
    w->Hkv = w->H;
    if ((rc = kvt_gguf_get_u32(g, "llama.attention.head_count_kv", &w->Hkv)) && rc != KVT_ENOENT) goto fail;
    w->eps = 1e-5f;
    if ((rc = kvt_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &w->eps)) && rc != KVT_ENOENT) goto fail;
    w->rope_base = 10000.0f;
    if ((rc = kvt_gguf_get_f32(g, "llama.rope.freq_base", &w->rope_base)) && rc != KVT_ENOENT) goto fail;
    rc = KVT_EFORMAT;
    if (!w->D || !w->L || !w->H || !w->Hkv || !w->F || w->D % w->H || w->H % w->Hkv ||
        w->D > 65536 || w->L > 1024 || w->F > 1u << 20 || ctx == 0) {
        rc = kvt_fail(KVT_EFORMAT, "llama: inconsistent shape D=%u L=%u H=%u Hkv=%u F=%u ctx=%u",
                      w->D, w->L, w->H, w->Hkv, w->F, ctx);
        goto fail;
    }
    w->hd = w->D / w->H;
    w->KV = w->Hkv * w->hd;
    w->n_rot = w->hd;
    if ((rc = kvt_gguf_get_u32(g, "llama.rope.dimension_count", &w->n_rot)) && rc != KVT_ENOENT) goto fail;
    if (w->n_rot > w->hd || w->n_rot % 2) {
        rc = kvt_fail(KVT_EFORMAT, "llama: rope.dimension_count %u does not fit head dim %u", w->n_rot, w->hd);
        goto fail;
    }
    const kvt_gguf_tensor *te = kvt_gguf_find_tensor(g, "token_embd.weight");
    if (!te || te->n_dims != 2 || te->ne[0] != w->D || te->ne[1] == 0 || te->ne[1] > 1u << 24) {
        rc = kvt_fail(KVT_EFORMAT, "llama: token_embd.weight missing or not (%u, V)", w->D);
        goto fail;
    }
    w->V = (uint32_t)te->ne[1];
    if ((rc = kvt_model_tensor_f32(g, "token_embd.weight", w->D, w->V, &w->tok_embd)) ||
        (rc = kvt_model_tensor_f32(g, "output_norm.weight", w->D, 1, &w->out_norm)))
        goto fail;
    if (kvt_gguf_find_tensor(g, "output.weight")) {
        if ((rc = kvt_model_tensor_f32(g, "output.weight", w->D, w->V, &w->out))) goto fail;
    } else {
        w->out = w->tok_embd;
    }
    w->layers = kvt_calloc(w->L, sizeof *w->layers);
    if (!w->layers) { rc = KVT_ENOMEM; goto fail; }
    for (uint32_t l = 0; l < w->L; l++) {
        llama_layer *ly = &w->layers[l];
        char nm[96];
#define T(field, suffix, a, b)                                                   \
        snprintf(nm, sizeof nm, "blk.%u.%s", l, suffix);                         \
        if ((rc = kvt_model_tensor_f32(g, nm, a, b, &ly->field))) goto fail;
        T(attn_norm, "attn_norm.weight", w->D, 1)
        T(wq, "attn_q.weight", w->D, w->D)
        T(wk, "attn_k.weight", w->D, w->KV)
        T(wv, "attn_v.weight", w->D, w->KV)
        T(wo, "attn_output.weight", w->D, w->D)
        T(ffn_norm, "ffn_norm.weight", w->D, 1)
        T(w1, "ffn_gate.weight", w->D, w->F)
        T(w3, "ffn_up.weight", w->D, w->F)
        T(w2, "ffn_down.weight", w->F, w->D)
#undef T
    }
    m->weights = w;
    m->arch = &kvt_arch_llama;
    kvt_model_info *in = &m->info;
    in->arch = "llama";
    in->n_vocab = w->V;
    in->n_ctx_train = ctx;
    in->n_embd = w->D;
    in->n_layer = w->L;
    in->n_head = w->H;
    in->n_head_kv = w->Hkv;
    in->head_dim = w->hd;
    in->n_ff = w->F;
    in->n_params = (uint64_t)w->V * w->D * (w->out == w->tok_embd ? 1 : 2) + w->D +
                   (uint64_t)w->L * (2ull * w->D + 2ull * w->D * w->D + 2ull * w->KV * w->D +
                                     3ull * w->D * w->F);
    return KVT_OK;
fail:
    llama_free(w);
    return rc;
}

static int llama_cache_new(kvt_session *s)
{
    const llama_weights *w = s->m->weights;
    size_t n = 2 * (size_t)w->L;
    uint32_t (*spec)[2] = kvt_calloc(n, sizeof *spec);
    if (!spec) return KVT_ENOMEM;
    for (size_t i = 0; i < n; i++) { spec[i][0] = w->KV * (uint32_t)sizeof(float); spec[i][1] = KVT_BLOCK; }
    s->cache = kvt_cache_new(n, (const uint32_t (*)[2])spec, s->n_ctx, 0);
    free(spec);
    return s->cache ? KVT_OK : KVT_ENOMEM;
}

/* Attention for rows [b, e) of (token, head) pairs. */
struct attn_ctx {
    const llama_weights *w;
    const kvt_cache *cache;
    size_t layer, pos0;
    const float *q;    /* (n, D) */
    float *out;        /* (n, D) */
};

static void attn_range(void *arg, size_t b, size_t e)
{
    struct attn_ctx *c = arg;
    const llama_weights *w = c->w;
    size_t H = w->H, hd = w->hd, group = w->H / w->Hkv;
    size_t last = (e - 1) / H;
    float *att = malloc((c->pos0 + last + 1) * sizeof(float));
    if (!att) abort(); /* a few KB per thread; nothing sensible to do otherwise */
    float scale = 1.0f / sqrtf((float)hd);
    for (size_t r = b; r < e; r++) {
        size_t i = r / H, h = r % H, kvh = h / group, t = c->pos0 + i;
        const float *q = c->q + i * w->D + h * hd;
        for (size_t j = 0; j <= t; j++) {
            const float *k = (const float *)kvt_cache_row_ro(c->cache, 2 * c->layer, j) + kvh * hd;
            att[j] = kvt_dot(q, k, hd) * scale;
        }
        kvt_softmax(att, t + 1);
        float *o = c->out + i * w->D + h * hd;
        for (size_t d = 0; d < hd; d++) o[d] = 0;
        for (size_t j = 0; j <= t; j++) {
            const float *v = (const float *)kvt_cache_row_ro(c->cache, 2 * c->layer + 1, j) + kvh * hd;
            kvt_axpy(o, att[j], v, hd);
        }
    }
    free(att);
}

static int llama_forward(kvt_session *s, const int32_t *tok, size_t n, size_t pos0,
                         float *logits, size_t lfrom)
{
    const llama_weights *w = s->m->weights;
    size_t D = w->D, KV = w->KV, F = w->F, hd = w->hd;
    int rc = KVT_ENOMEM;
    float *x = kvt_malloc(n * D * sizeof(float));   /* (n, D) residual */
    float *xb = kvt_malloc(n * D * sizeof(float));  /* (n, D) */
    float *q = kvt_malloc(n * D * sizeof(float));   /* (n, D) */
    float *att = kvt_malloc(n * D * sizeof(float)); /* (n, D) */
    float *k = kvt_malloc(n * KV * sizeof(float));  /* (n, KV) */
    float *v = kvt_malloc(n * KV * sizeof(float));  /* (n, KV) */
    float *h1 = kvt_malloc(n * F * sizeof(float));  /* (n, F) */
    float *h3 = kvt_malloc(n * F * sizeof(float));  /* (n, F) */
    if (!x || !xb || !q || !att || !k || !v || !h1 || !h3) goto done;
    for (size_t i = 0; i < n; i++) {
        if (tok[i] < 0 || (uint32_t)tok[i] >= w->V) {
            rc = kvt_fail(KVT_EINVAL, "token id %d out of range [0, %u)", tok[i], w->V);
            goto done;
        }
        memcpy(x + i * D, w->tok_embd + (size_t)tok[i] * D, D * sizeof(float));
    }
    for (size_t l = 0; l < w->L; l++) {
        const llama_layer *ly = &w->layers[l];
        for (size_t i = 0; i < n; i++) kvt_rmsnorm(xb + i * D, x + i * D, ly->attn_norm, D, w->eps);
        kvt_matmul(s->pool, q, ly->wq, xb, n, D, D);
        kvt_matmul(s->pool, k, ly->wk, xb, n, D, KV);
        kvt_matmul(s->pool, v, ly->wv, xb, n, D, KV);
        for (size_t i = 0; i < n; i++) {
            for (size_t h = 0; h < w->H; h++) kvt_rope(q + i * D + h * hd, w->n_rot, pos0 + i, w->rope_base);
            for (size_t h = 0; h < w->Hkv; h++) kvt_rope(k + i * KV + h * hd, w->n_rot, pos0 + i, w->rope_base);
            float *kr = kvt_cache_row(s->cache, 2 * l, pos0 + i);
            float *vr = kvt_cache_row(s->cache, 2 * l + 1, pos0 + i);
            if (!kr || !vr) { rc = kvt_fail(KVT_ENOMEM, "cache row %zu", pos0 + i); goto done; }
            memcpy(kr, k + i * KV, KV * sizeof(float));
            memcpy(vr, v + i * KV, KV * sizeof(float));
        }
        struct attn_ctx ac = {w, s->cache, l, pos0, q, att};
        /* one (token, head) scores and mixes up to pos0 + n rows: give a
         * thread at least 128K multiply-adds (measured in bench/README.md),
         * so a tiny model's decode step does not pay for waking the pool */
        size_t per = 2 * (pos0 + n) * hd;
        kvt_pool_for(s->pool, n * w->H, (131072 + per - 1) / per, attn_range, &ac);
        kvt_matmul(s->pool, xb, ly->wo, att, n, D, D);
        for (size_t j = 0; j < n * D; j++) x[j] += xb[j];
        for (size_t i = 0; i < n; i++) kvt_rmsnorm(xb + i * D, x + i * D, ly->ffn_norm, D, w->eps);
        kvt_matmul(s->pool, h1, ly->w1, xb, n, D, F);
        kvt_matmul(s->pool, h3, ly->w3, xb, n, D, F);
        for (size_t j = 0; j < n * F; j++) {
            float g = h1[j];
            h1[j] = g * (1.0f / (1.0f + expf(-g))) * h3[j];
        }
        kvt_matmul(s->pool, xb, ly->w2, h1, n, F, D);
        for (size_t j = 0; j < n * D; j++) x[j] += xb[j];
    }
    if (lfrom < n) {
        size_t nl = n - lfrom;
        for (size_t i = 0; i < nl; i++) kvt_rmsnorm(xb + i * D, x + (lfrom + i) * D, w->out_norm, D, w->eps);
        kvt_matmul(s->pool, logits, w->out, xb, nl, D, w->V);
    }
    rc = KVT_OK;
done:
    free(x); free(xb); free(q); free(att); free(k); free(v); free(h1); free(h3);
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
    XXH3_64bits_update(st, hdr, sizeof hdr);
    XXH3_64bits_update(st, &w->eps, 4);
    XXH3_64bits_update(st, &w->rope_base, 4);
    size_t D = w->D, KV = w->KV, F = w->F, V = w->V;
    XXH3_64bits_update(st, w->tok_embd, V * D * 4);
    XXH3_64bits_update(st, w->out_norm, D * 4);
    if (w->out != w->tok_embd) XXH3_64bits_update(st, w->out, V * D * 4);
    for (uint32_t l = 0; l < w->L; l++) {
        const llama_layer *ly = &w->layers[l];
        const float *t[9] = {ly->attn_norm, ly->wq, ly->wk, ly->wv, ly->wo, ly->ffn_norm, ly->w1, ly->w3, ly->w2};
        size_t n[9] = {D, D * D, KV * D, KV * D, D * D, D, F * D, F * D, D * F};
        for (int i = 0; i < 9; i++) XXH3_64bits_update(st, t[i], n[i] * 4);
    }
    uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return h;
}

const kvt_arch kvt_arch_llama = {
    .name = "llama",
    .cache_new = llama_cache_new,
    .forward = llama_forward,
    .fingerprint = llama_fingerprint,
    .weights_free = llama_free,
};
