/* The ds4 architecture: DeepSeek-V4-style hybrid compressed attention, as
 * specified in the project's ds4 architecture document (ds4-architecture.md
 * in the shared docs; docs/ds4.md here describes the files and presets).
 *
 * Per layer the cache holds three entry classes:
 *
 *   window     the last W raw rows k_t (binary16), a ring indexed by t mod W,
 *              in the cache's fixed state area;
 *   frontier   the pooling inputs (ckv, csc) of the block not yet complete
 *              (for ratio 4 also the previous block's 4 entries the next row
 *              still needs), f32 rings indexed by t mod 8 (ratio 4) or t mod
 *              128 (ratio 128), also in the fixed state area;
 *   blocks     completed compressed rows (binary16) in cache streams: per
 *              128-token block a ratio-4 layer gains 32 rows plus 32 indexer
 *              rows, a ratio-128 layer 1 row.
 *
 * Exactness: tokens of a chunk are pooled in position order by one thread, a
 * row becomes visible at the token that completes it, and attention for
 * position t reads exactly the rows visible at t in the canonical order
 * (compressed by increasing index, then window by increasing position), each
 * through the fixed-order kernels. The window ring is updated only after the
 * chunk's attention, reading rows of the chunk from the chunk's own buffer, so
 * chunk size never changes what a position sees.
 *
 * Synthetic weights (no weight file): every tensor, in the order ds4_tensors
 * lists them, is filled from one splitmix64 stream seeded with the model seed.
 * A draw is u = (x >> 11) * 2^-53 in [0, 1); the value is (float)((2u - 1) *
 * scale) computed in double, with scale = 1/sqrt(fan_in) for matrices (fan_in
 * = ne[0], the input width), 1 for the token embedding and 0.02 for the
 * compressors' APE. Norm weights are 1 and sinks 0 and take no draws.
 */
#include "kernels.h"
#include "model.h"
#include "util.h"

#include <math.h>
#include <stdio.h>
#include <xxhash.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LAYERS 64

typedef struct ds4_config {
    uint32_t V, D, L, H, Dh, Dr, Rq, F, W, Hi, Di, K, ctx;
    float eps, idx_base;
    uint32_t ratio[MAX_LAYERS];
    float base[MAX_LAYERS];
} ds4_config;

typedef struct ds4_layer {
    float *attn_norm;           /* (D) */
    float *wqa, *q_norm;        /* (Rq, D), (Rq) */
    float *wqb;                 /* (H*Dh, Rq) */
    float *wkv, *kv_norm;       /* (Dh, D), (Dh) */
    float *sinks;               /* (H) */
    float *wo;                  /* (D, H*Dh) */
    float *ffn_norm;            /* (D) */
    float *w1, *w3, *w2;        /* (F, D), (F, D), (D, F) */
    float *c_kv, *c_gate;       /* (c*Dh, D) compressor, ratio > 0 */
    float *c_ape, *c_norm;      /* (r, c*Dh), (Dh) */
    float *i_kv, *i_gate;       /* (2*Di, D) indexer compressor, ratio 4 */
    float *i_ape, *i_norm;      /* (4, 2*Di), (Di) */
    float *i_q, *i_w;           /* (Hi*Di, Rq), (Hi, D) */
    /* cache geometry */
    int s_comp, s_idx;          /* stream ids (-1: none) */
    size_t off_win, off_cf, off_if; /* state offsets: window ring, frontiers */
} ds4_layer;

typedef struct ds4_weights {
    ds4_config c;
    uint64_t seed;
    float *tok_embd;            /* (V, D) */
    float *out_norm;            /* (D) */
    float *out;                 /* (V, D), tied to tok_embd */
    ds4_layer layers[MAX_LAYERS];
    size_t n_streams, state_bytes;
} ds4_weights;

/* ---- presets ---- */

static void set_layout(ds4_config *c)
{
    for (uint32_t l = 0; l < c->L; l++) {
        c->ratio[l] = l < 2 ? 0 : (l % 2 == 0 ? 4 : 128);
        c->base[l] = c->ratio[l] ? 160000.0f : 10000.0f;
    }
    c->eps = 1e-6f;
    c->idx_base = 160000.0f;
}

static bool preset_config(const char *name, ds4_config *c)
{
    memset(c, 0, sizeof *c);
    if (!strcmp(name, "ds4-tiny")) {
        *c = (ds4_config){.D = 64, .L = 4, .H = 2, .Dh = 32, .Dr = 8, .Rq = 32, .F = 128, .W = 16,
                          .Hi = 2, .Di = 16, .K = 8, .ctx = 4096};
    } else if (!strcmp(name, "ds4-mini")) {
        *c = (ds4_config){.D = 256, .L = 8, .H = 8, .Dh = 64, .Dr = 16, .Rq = 128, .F = 768, .W = 128,
                          .Hi = 4, .Di = 32, .K = 64, .ctx = 131072};
    } else if (!strcmp(name, "ds4-flash")) {
        *c = (ds4_config){.V = 129280, .D = 4096, .L = 43, .H = 64, .Dh = 512, .Dr = 64, .Rq = 1024,
                          .F = 0, .W = 128, .Hi = 64, .Di = 128, .K = 512, .ctx = 1048576};
    } else {
        return false;
    }
    set_layout(c);
    return true;
}

/* ---- tensor table: one list drives generation, loading, writing ---- */

enum init { INIT_MAT, INIT_EMBED, INIT_APE, INIT_ONE, INIT_ZERO };

typedef struct tdesc {
    char name[48];
    uint32_t ne0, ne1;          /* ne0 = input (contiguous) width */
    enum init init;
    float **slot;
} tdesc;

#define MAX_TENSORS (3 + MAX_LAYERS * 25)

static size_t ds4_tensors(ds4_weights *w, tdesc *t)
{
    const ds4_config *c = &w->c;
    size_t n = 0;
#define ADD(nm, a, b, in, sl)                                                   \
    do { t[n] = (tdesc){.ne0 = (a), .ne1 = (b), .init = (in), .slot = (sl)};   \
         snprintf(t[n].name, sizeof t[n].name, "%s", nm); n++; } while (0)
#define ADDL(suffix, a, b, in, sl)                                             \
    do { char nm_[48]; snprintf(nm_, sizeof nm_, "blk.%u.%s", l, suffix);       \
         ADD(nm_, a, b, in, sl); } while (0)
    ADD("token_embd.weight", c->D, c->V, INIT_EMBED, &w->tok_embd);
    /* a config refused for its layer count has no layers to walk (ds4_free) */
    uint32_t L = c->L <= MAX_LAYERS ? c->L : 0;
    for (uint32_t l = 0; l < L; l++) {
        ds4_layer *ly = &w->layers[l];
        uint32_t r = c->ratio[l], cw = (r == 4 ? 2 : 1) * c->Dh;
        ADDL("attn_norm.weight", c->D, 1, INIT_ONE, &ly->attn_norm);
        ADDL("attn_q_a.weight", c->D, c->Rq, INIT_MAT, &ly->wqa);
        ADDL("attn_q_a_norm.weight", c->Rq, 1, INIT_ONE, &ly->q_norm);
        ADDL("attn_q_b.weight", c->Rq, c->H * c->Dh, INIT_MAT, &ly->wqb);
        ADDL("attn_kv.weight", c->D, c->Dh, INIT_MAT, &ly->wkv);
        ADDL("attn_kv_norm.weight", c->Dh, 1, INIT_ONE, &ly->kv_norm);
        ADDL("attn_sinks.weight", c->H, 1, INIT_ZERO, &ly->sinks);
        ADDL("attn_output.weight", c->H * c->Dh, c->D, INIT_MAT, &ly->wo);
        ADDL("ffn_norm.weight", c->D, 1, INIT_ONE, &ly->ffn_norm);
        ADDL("ffn_gate.weight", c->D, c->F, INIT_MAT, &ly->w1);
        ADDL("ffn_up.weight", c->D, c->F, INIT_MAT, &ly->w3);
        ADDL("ffn_down.weight", c->F, c->D, INIT_MAT, &ly->w2);
        if (r) {
            ADDL("comp_kv.weight", c->D, cw, INIT_MAT, &ly->c_kv);
            ADDL("comp_gate.weight", c->D, cw, INIT_MAT, &ly->c_gate);
            ADDL("comp_ape.weight", cw, r, INIT_APE, &ly->c_ape);
            ADDL("comp_norm.weight", c->Dh, 1, INIT_ONE, &ly->c_norm);
        }
        if (r == 4) {
            ADDL("idx_comp_kv.weight", c->D, 2 * c->Di, INIT_MAT, &ly->i_kv);
            ADDL("idx_comp_gate.weight", c->D, 2 * c->Di, INIT_MAT, &ly->i_gate);
            ADDL("idx_comp_ape.weight", 2 * c->Di, 4, INIT_APE, &ly->i_ape);
            ADDL("idx_comp_norm.weight", c->Di, 1, INIT_ONE, &ly->i_norm);
            ADDL("idx_q.weight", c->Rq, c->Hi * c->Di, INIT_MAT, &ly->i_q);
            ADDL("idx_w.weight", c->D, c->Hi, INIT_MAT, &ly->i_w);
        }
    }
    ADD("output_norm.weight", c->D, 1, INIT_ONE, &w->out_norm);
#undef ADDL
#undef ADD
    return n;
}

static void ds4_free(void *p)
{
    ds4_weights *w = p;
    if (!w) return;
    if (w->out != w->tok_embd) free(w->out);
    tdesc *t = malloc(MAX_TENSORS * sizeof *t);
    if (t) {
        size_t n = ds4_tensors(w, t);
        for (size_t i = 0; i < n; i++) free(*t[i].slot);
        free(t);
    }
    free(w);
}

/* Validate a config and derive the cache geometry (streams, state offsets). */
static int finish_config(ds4_weights *w)
{
    ds4_config *c = &w->c;
    if (!c->V || !c->D || !c->L || c->L > MAX_LAYERS || !c->H || !c->Dh || c->Dh % 2 || !c->Dr ||
        c->Dr > c->Dh || c->Dr % 2 || !c->Rq || !c->F || !c->W || !c->Hi || !c->Di || !c->K ||
        !c->ctx || c->D > 16384 || c->Dh > 4096 || c->H > 1024 || c->Rq > 65536 || c->F > 1u << 20 ||
        c->V > 1u << 24 || c->W > 1u << 20 || c->Di > 4096 || c->Hi > 1024 || c->ctx > 1u << 24 ||
        !(c->eps > 0) || !(c->idx_base > 0))
        return kvt_fail(KVT_EFORMAT, "ds4: inconsistent configuration (D=%u L=%u H=%u Dh=%u Dr=%u)",
                        c->D, c->L, c->H, c->Dh, c->Dr);
    /* the indexer's selection scratch is (chunk, K) per session */
    if (c->K > 1u << 16) return kvt_fail(KVT_EFORMAT, "ds4: indexer top-k of %u rows (at most 65536)", c->K);
    size_t off = 0, ns = 0;
    for (uint32_t l = 0; l < c->L; l++) {
        ds4_layer *ly = &w->layers[l];
        uint32_t r = c->ratio[l];
        if (r != 0 && r != 4 && r != 128)
            return kvt_fail(KVT_EFORMAT, "ds4: layer %u has compression ratio %u (0, 4 or 128)", l, r);
        if (!(c->base[l] > 0)) return kvt_fail(KVT_EFORMAT, "ds4: layer %u RoPE base", l);
        ly->s_comp = ly->s_idx = -1;
        ly->off_win = off;
        off += (size_t)c->W * c->Dh * 2;
        if (r) {
            ly->s_comp = (int)ns++;
            ly->off_cf = off;
            /* ratio 4: 8 slots of (ckv 2Dh, csc 2Dh); ratio 128: 128 of (Dh, Dh) */
            off += r == 4 ? 8 * 4 * (size_t)c->Dh * 4 : 128 * 2 * (size_t)c->Dh * 4;
        }
        if (r == 4) {
            ly->s_idx = (int)ns++;
            ly->off_if = off;
            off += 8 * 4 * (size_t)c->Di * 4;
        }
    }
    w->n_streams = ns;
    w->state_bytes = off;
    return KVT_OK;
}

static void fill_info(kvt_model *m, const ds4_weights *w)
{
    const ds4_config *c = &w->c;
    kvt_model_info *in = &m->info;
    in->arch = "ds4";
    in->n_vocab = c->V;
    in->n_ctx_train = c->ctx;
    in->n_embd = c->D;
    in->n_layer = c->L;
    in->n_head = c->H;
    in->n_head_kv = 1;
    in->head_dim = c->Dh;
    in->n_ff = c->F;
    uint64_t np = 0;
    tdesc *t = malloc(MAX_TENSORS * sizeof *t);
    if (t) {
        size_t n = ds4_tensors((ds4_weights *)w, t);
        for (size_t i = 0; i < n; i++) np += (uint64_t)t[i].ne0 * t[i].ne1;
        free(t);
    }
    in->n_params = np;
    m->arch = &kvt_arch_ds4;
}

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int generate(ds4_weights *w)
{
    tdesc *t = kvt_malloc(MAX_TENSORS * sizeof *t);
    if (!t) return KVT_ENOMEM;
    size_t n = ds4_tensors(w, t);
    uint64_t st = w->seed;
    for (size_t i = 0; i < n; i++) {
        size_t cnt = (size_t)t[i].ne0 * t[i].ne1;
        float *p = kvt_malloc(cnt * sizeof(float));
        if (!p) { free(t); return KVT_ENOMEM; }
        *t[i].slot = p;
        double scale = t[i].init == INIT_MAT ? 1.0 / sqrt((double)t[i].ne0)
                     : t[i].init == INIT_APE ? 0.02 : 1.0;
        for (size_t j = 0; j < cnt; j++) {
            if (t[i].init == INIT_ONE) p[j] = 1.0f;
            else if (t[i].init == INIT_ZERO) p[j] = 0.0f;
            else {
                double u = (double)(splitmix(&st) >> 11) * (1.0 / 9007199254740992.0);
                p[j] = (float)((2.0 * u - 1.0) * scale);
            }
        }
    }
    free(t);
    w->out = w->tok_embd;
    return KVT_OK;
}

int kvt_ds4_preset(kvt_model *m, const char *preset, uint64_t seed, kvt_tokenizer *tok)
{
    ds4_weights *w = kvt_calloc(1, sizeof *w);
    if (!w) return KVT_ENOMEM;
    if (!preset_config(preset, &w->c) || !strcmp(preset, "ds4-flash")) {
        free(w);
        return kvt_fail(KVT_ENOENT, "no ds4 preset '%s' with weights (ds4-tiny, ds4-mini)", preset);
    }
    w->c.V = kvt_tokenizer_n_vocab(tok);
    w->seed = seed;
    int rc = finish_config(w);
    if (!rc) rc = generate(w);
    if (rc) { ds4_free(w); return rc; }
    m->weights = w;
    m->tok = tok;
    fill_info(m, w);
    return KVT_OK;
}

/* ---- GGUF ---- */

static int get_u32(const kvt_gguf *g, const char *k, uint32_t *v)
{
    int rc = kvt_gguf_get_u32(g, k, v);
    return rc == KVT_ENOENT ? kvt_fail(KVT_EFORMAT, "ds4: missing metadata key %s", k) : rc;
}

int kvt_ds4_load(kvt_model *m, const kvt_gguf *g)
{
    ds4_weights *w = kvt_calloc(1, sizeof *w);
    if (!w) return KVT_ENOMEM;
    ds4_config *c = &w->c;
    int rc;
    if ((rc = get_u32(g, "ds4.vocab_size", &c->V)) || (rc = get_u32(g, "ds4.embedding_length", &c->D)) ||
        (rc = get_u32(g, "ds4.block_count", &c->L)) ||
        (rc = get_u32(g, "ds4.attention.head_count", &c->H)) ||
        (rc = get_u32(g, "ds4.attention.head_dim", &c->Dh)) ||
        (rc = get_u32(g, "ds4.rope.dimension_count", &c->Dr)) ||
        (rc = get_u32(g, "ds4.attention.q_lora_rank", &c->Rq)) ||
        (rc = get_u32(g, "ds4.feed_forward_length", &c->F)) ||
        (rc = get_u32(g, "ds4.attention.sliding_window", &c->W)) ||
        (rc = get_u32(g, "ds4.indexer.head_count", &c->Hi)) ||
        (rc = get_u32(g, "ds4.indexer.head_dim", &c->Di)) ||
        (rc = get_u32(g, "ds4.indexer.top_k", &c->K)) ||
        (rc = get_u32(g, "ds4.context_length", &c->ctx)))
        goto fail;
    if ((rc = kvt_gguf_get_f32(g, "ds4.attention.layer_norm_rms_epsilon", &c->eps)) ||
        (rc = kvt_gguf_get_f32(g, "ds4.indexer.rope_freq_base", &c->idx_base))) {
        if (rc == KVT_ENOENT) rc = kvt_fail(KVT_EFORMAT, "ds4: missing epsilon or indexer RoPE base");
        goto fail;
    }
    if (c->L == 0 || c->L > MAX_LAYERS) {
        rc = kvt_fail(KVT_EFORMAT, "ds4: block_count %u out of range [1, %d]", c->L, MAX_LAYERS);
        goto fail;
    }
    const kvt_gguf_val *ra, *ba;
    size_t nr, nb;
    if ((rc = kvt_gguf_get_arr(g, "ds4.compress_ratios", KVT_GGUF_U32, &ra, &nr)) ||
        (rc = kvt_gguf_get_arr(g, "ds4.rope.freq_bases", KVT_GGUF_F32, &ba, &nb))) {
        if (rc == KVT_ENOENT) rc = kvt_fail(KVT_EFORMAT, "ds4: missing compress_ratios or freq_bases");
        goto fail;
    }
    if (nr != c->L || nb != c->L) {
        rc = kvt_fail(KVT_EFORMAT, "ds4: %zu ratios and %zu RoPE bases for %u layers", nr, nb, c->L);
        goto fail;
    }
    for (uint32_t l = 0; l < c->L; l++) {
        c->ratio[l] = ra[l].v.u > 128 ? 1 : (uint32_t)ra[l].v.u;
        c->base[l] = (float)ba[l].v.f;
    }
    uint64_t seed = 0;
    int64_t sv;
    if (kvt_gguf_get_i64(g, "ds4.seed", &sv) == KVT_OK) seed = (uint64_t)sv;
    w->seed = seed;
    if ((rc = finish_config(w))) goto fail;
    tdesc *t = kvt_malloc(MAX_TENSORS * sizeof *t);
    if (!t) { rc = KVT_ENOMEM; goto fail; }
    size_t n = ds4_tensors(w, t);
    for (size_t i = 0; i < n && !rc; i++) rc = kvt_model_tensor_f32(g, t[i].name, t[i].ne0, t[i].ne1, t[i].slot);
    free(t);
    if (rc) goto fail;
    if (kvt_gguf_find_tensor(g, "output.weight")) {
        if ((rc = kvt_model_tensor_f32(g, "output.weight", c->D, c->V, &w->out))) goto fail;
    } else {
        w->out = w->tok_embd;
    }
    m->weights = w;
    fill_info(m, w);
    return KVT_OK;
fail:
    ds4_free(w);
    return rc;
}

int kvt_ds4_write_gguf(const kvt_model *m, const char *path)
{
    if (m->arch != &kvt_arch_ds4) return kvt_fail(KVT_EINVAL, "not a ds4 model");
    ds4_weights *w = m->weights;
    const ds4_config *c = &w->c;
    kvt_gguf_writer *gw = kvt_gguf_writer_new();
    tdesc *t = kvt_malloc(MAX_TENSORS * sizeof *t);
    kvt_gguf_val *ra = kvt_calloc(c->L, sizeof *ra), *ba = kvt_calloc(c->L, sizeof *ba);
    int rc = KVT_ENOMEM;
    if (!gw || !t || !ra || !ba) goto done;
    for (uint32_t l = 0; l < c->L; l++) {
        ra[l] = (kvt_gguf_val){.type = KVT_GGUF_U32, .v.u = c->ratio[l]};
        ba[l] = (kvt_gguf_val){.type = KVT_GGUF_F32, .v.f = c->base[l]};
    }
    kvt_gguf_val rv = {.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_U32, .n = c->L, .v.arr = ra};
    kvt_gguf_val bv = {.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_F32, .n = c->L, .v.arr = ba};
    kvt_gguf_val seed = {.type = KVT_GGUF_U64, .v.u = w->seed};
    if ((rc = kvt_gguf_writer_set_str(gw, "general.architecture", "ds4")) ||
        (rc = kvt_gguf_writer_set_str(gw, "general.name", m->info.name)) ||
        (rc = kvt_gguf_writer_set_u32(gw, "ds4.vocab_size", c->V)) ||
        (rc = kvt_gguf_writer_set_u32(gw, "ds4.context_length", c->ctx)) ||
        (rc = kvt_gguf_writer_set_u32(gw, "ds4.embedding_length", c->D)) ||
        (rc = kvt_gguf_writer_set_u32(gw, "ds4.block_count", c->L)) ||
        (rc = kvt_gguf_writer_set_u32(gw, "ds4.attention.head_count", c->H)) ||
        (rc = kvt_gguf_writer_set_u32(gw, "ds4.attention.head_dim", c->Dh)) ||
        (rc = kvt_gguf_writer_set_u32(gw, "ds4.rope.dimension_count", c->Dr)) ||
        (rc = kvt_gguf_writer_set_u32(gw, "ds4.attention.q_lora_rank", c->Rq)) ||
        (rc = kvt_gguf_writer_set_u32(gw, "ds4.feed_forward_length", c->F)) ||
        (rc = kvt_gguf_writer_set_u32(gw, "ds4.attention.sliding_window", c->W)) ||
        (rc = kvt_gguf_writer_set_u32(gw, "ds4.indexer.head_count", c->Hi)) ||
        (rc = kvt_gguf_writer_set_u32(gw, "ds4.indexer.head_dim", c->Di)) ||
        (rc = kvt_gguf_writer_set_u32(gw, "ds4.indexer.top_k", c->K)) ||
        (rc = kvt_gguf_writer_set_f32(gw, "ds4.attention.layer_norm_rms_epsilon", c->eps)) ||
        (rc = kvt_gguf_writer_set_f32(gw, "ds4.indexer.rope_freq_base", c->idx_base)) ||
        (rc = kvt_gguf_writer_set(gw, "ds4.compress_ratios", &rv)) ||
        (rc = kvt_gguf_writer_set(gw, "ds4.rope.freq_bases", &bv)) ||
        (rc = kvt_gguf_writer_set(gw, "ds4.seed", &seed)) ||
        (rc = kvt_tokenizer_to_gguf(m->tok, gw)))
        goto done;
    size_t n = ds4_tensors(w, t);
    for (size_t i = 0; i < n && !rc; i++) {
        uint64_t ne[2] = {t[i].ne0, t[i].ne1};
        rc = kvt_gguf_writer_add_tensor(gw, t[i].name, KVT_GGML_F32, t[i].ne1 > 1 ? 2 : 1, ne, *t[i].slot,
                                        (size_t)t[i].ne0 * t[i].ne1 * sizeof(float));
    }
    if (!rc && w->out != w->tok_embd) {
        uint64_t ne[2] = {c->D, c->V};
        rc = kvt_gguf_writer_add_tensor(gw, "output.weight", KVT_GGML_F32, 2, ne, w->out,
                                        (size_t)c->D * c->V * sizeof(float));
    }
    if (!rc) rc = kvt_gguf_writer_write(gw, path);
done:
    free(ra);
    free(ba);
    free(t);
    kvt_gguf_writer_free(gw);
    return rc;
}

static uint64_t ds4_fingerprint(const void *p)
{
    const ds4_weights *w = p;
    const ds4_config *c = &w->c;
    XXH3_state_t *st = XXH3_createState();
    if (!st) return 0;
    XXH3_64bits_reset(st);
    uint32_t hdr[] = {c->V, c->D, c->L, c->H, c->Dh, c->Dr, c->Rq, c->F, c->W, c->Hi, c->Di, c->K, c->ctx};
    XXH3_64bits_update(st, "ds4", 3);
    XXH3_64bits_update(st, hdr, sizeof hdr);
    XXH3_64bits_update(st, &c->eps, 4);
    XXH3_64bits_update(st, &c->idx_base, 4);
    XXH3_64bits_update(st, c->ratio, c->L * 4);
    XXH3_64bits_update(st, c->base, c->L * 4);
    tdesc *t = malloc(MAX_TENSORS * sizeof *t);
    if (t) {
        size_t n = ds4_tensors((ds4_weights *)w, t);
        for (size_t i = 0; i < n; i++)
            XXH3_64bits_update(st, *t[i].slot, (size_t)t[i].ne0 * t[i].ne1 * sizeof(float));
        free(t);
    }
    if (w->out != w->tok_embd) XXH3_64bits_update(st, w->out, (size_t)c->D * c->V * sizeof(float));
    uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return h;
}

/* ---- cache ---- */

static int ds4_cache_new(kvt_session *s)
{
    const ds4_weights *w = s->m->weights;
    const ds4_config *c = &w->c;
    uint32_t spec[2 * MAX_LAYERS][2];
    for (uint32_t l = 0; l < c->L; l++) {
        const ds4_layer *ly = &w->layers[l];
        uint32_t r = c->ratio[l];
        if (ly->s_comp >= 0) { spec[ly->s_comp][0] = c->Dh * 2; spec[ly->s_comp][1] = KVT_BLOCK / r; }
        if (ly->s_idx >= 0) { spec[ly->s_idx][0] = c->Di * 2; spec[ly->s_idx][1] = KVT_BLOCK / 4; }
    }
    s->cache = kvt_cache_new(w->n_streams, (const uint32_t (*)[2])spec, s->n_ctx, w->state_bytes);
    return s->cache ? KVT_OK : KVT_ENOMEM;
}

static inline uint16_t *win_row(const kvt_cache *cache, const ds4_layer *ly, const ds4_config *c, size_t t)
{
    return (uint16_t *)(cache->state + ly->off_win) + (t % c->W) * c->Dh;
}

/* Frontier slot of token t: (ckv, csc) of width cw each. */
static inline float *front_slot(const kvt_cache *cache, size_t off, uint32_t r, size_t cw, size_t t)
{
    size_t slots = r == 4 ? 8 : 128;
    return (float *)(cache->state + off) + (t % slots) * 2 * cw;
}

#define to_f16 kvt_f32_row_to_f16
#define from_f16 kvt_f16_row_to_f32

/* Pool the block of ratio r that token t completes into out (width d), then
 * normalise, rotate and round it: one compressed row. Inputs come from the
 * frontier ring at offset off (slots of (ckv, csc), each cw = c*d wide). */
static void emit_row(const kvt_cache *cache, size_t off, uint32_t r, size_t d, size_t t,
                     const float *norm_w, float eps, size_t n_rot, float base, float *p, uint16_t *out)
{
    size_t b = (t + 1) / r - 1, first = b * r, cw = (r == 4 ? 2 : 1) * d;
    for (size_t j = 0; j < d; j++) {
        /* scores in canonical order: previous block (ratio 4), then this block */
        float m = -INFINITY, z = 0, acc = 0;
        size_t s0 = (r == 4 && b > 0) ? first - 4 : first;
        for (size_t s = s0; s <= t; s++) {
            const float *sl = front_slot(cache, off, r, cw, s);
            size_t col = (r == 4 && s >= first) ? d + j : j;
            float sc = sl[cw + col];
            m = sc > m ? sc : m;
        }
        for (size_t s = s0; s <= t; s++) {
            const float *sl = front_slot(cache, off, r, cw, s);
            size_t col = (r == 4 && s >= first) ? d + j : j;
            float e = kvt_expf(sl[cw + col] - m);
            z += e;
            acc = fmaf(e, sl[col], acc);
        }
        p[j] = acc / z;
    }
    kvt_rmsnorm(p, p, norm_w, d, eps);
    kvt_rope(p + d - n_rot, n_rot, first, base);
    to_f16(out, p, d);
}

/* ---- forward ---- */

/* Frontier tokens valid at n: the incomplete block, plus for ratio 4 the
 * previous complete block. */
static size_t front_start(uint32_t r, size_t n)
{
    size_t b = n / r * r;
    return r == 4 ? (b >= 4 ? b - 4 : 0) : b;
}

typedef struct cand { float score; uint32_t c; } cand;

/* A session's scratch, allocated when it is created (ds4_work_new) and sized
 * from its context: the activations of up to ch tokens (a longer chunk runs
 * in passes of ch, which changes nothing but the scratch: every position's
 * result is that of any chunking), the indexer's keys and dot products, and
 * per part of the pool the keys one token attends to with their scores and
 * the indexer's scores and heap. */
typedef struct ds4_work {
    size_t ch, n_ctx, parts;
    size_t maxc4;      /* indexer rows at n_ctx (0: no ratio-4 layer) */
    size_t nk;         /* keys one position attends to at most */
    float *x;          /* (ch, D) residual */
    float *h;          /* (ch, D) normed input */
    float *qr;         /* (ch, Rq) */
    float *q;          /* (ch, H*Dh) */
    float *kv;         /* (ch, Dh) */
    uint16_t *rows;    /* (ch, Dh) binary16 raw rows */
    float *ckv, *csc;  /* (ch, 2*max(Dh, Di)) compressor inputs and scores */
    float *iq;         /* (ch, Hi*Di) */
    float *iw;         /* (ch, Hi) */
    float *att;        /* (ch, H*Dh) */
    float *f1, *f3;    /* (ch, F) */
    float *tmp;        /* (ch, max(D, H*Dh)) */
    float *p;          /* (max(Dh, Di)) a pooled row */
    uint16_t *chk;     /* (max(Dh, Di)) a replayed row */
    uint32_t *sel;     /* (ch, K) selected indexer rows; NULL when K >= maxc4 (never selects) */
    uint32_t *nsel;    /* (ch) */
    float *kI;         /* (maxc4, Di) indexer keys */
    float *dots;       /* (slice, Hi, maxc) for slices of at most ndots floats */
    float *keys;       /* (parts, nk, Dh) */
    float *sc;         /* (parts, nk) */
    float *isc;        /* (parts, maxc4 + 1) when sel */
    cand *heap;        /* (parts, K + 1) when sel */
} ds4_work;

typedef struct fwd {
    kvt_session *s;
    const ds4_weights *w;
    const ds4_layer *ly;
    ds4_work *wk;
    uint32_t l;
    size_t n, pos0;
    const float *q;        /* (n, H*Dh) rotated, normed queries */
    const uint16_t *rows;  /* (n, Dh) this chunk's raw rows */
    const float *iq;       /* (n, Hi*Di) indexer queries */
    const float *iw;       /* (n, Hi) indexer head weights */
    float *att;            /* (n, H*Dh) */
    /* indexer selection (ratio 4 with more than K visible rows) */
    const float *dots;     /* (ns, Hi, maxc) qI · kI for tokens [i_base, i_base + ns) */
    size_t i_base, maxc;
} fwd;

/* Is a better than b: higher score, then lower index. */
static inline bool better(cand a, cand b) { return a.score > b.score || (a.score == b.score && a.c < b.c); }

/* Min-heap on `better`; heap[0] is the worst of the kept. */
static void heap_sift(cand *h, size_t n, size_t i)
{
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && better(h[m], h[l])) m = l;
        if (r < n && better(h[m], h[r])) m = r;
        if (m == i) return;
        cand t = h[i]; h[i] = h[m]; h[m] = t;
        i = m;
    }
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

size_t kvt_ds4_topk(const float *score, size_t n, size_t k, uint32_t *sel, void *scratch)
{
    if (n <= k) {
        for (size_t i = 0; i < n; i++) sel[i] = (uint32_t)i;
        return n;
    }
    cand *heap = scratch;
    for (size_t i = 0; i < k; i++) heap[i] = (cand){score[i], (uint32_t)i};
    for (size_t j = k / 2 + 1; j-- > 0;) heap_sift(heap, k, j);
    for (size_t i = k; i < n; i++) {
        cand cd = {score[i], (uint32_t)i};
        if (better(cd, heap[0])) { heap[0] = cd; heap_sift(heap, k, 0); }
    }
    for (size_t j = 0; j < k; j++) sel[j] = heap[j].c;
    qsort(sel, k, sizeof *sel, cmp_u32);
    return k;
}

int kvt_ds4_fault;

/* Indexer top-k for tokens [i_base + j0, i_base + j1) from precomputed dots:
 * score_c = sum_h wI_h * relu(qI_h · kI_c), heads in order. */
static void select_range(void *arg, uint32_t part, size_t j0, size_t j1)
{
    fwd *f = arg;
    const ds4_config *c = &f->w->c;
    ds4_work *wk = f->wk;
    size_t Hi = c->Hi, maxc = f->maxc;
    float *isc = wk->isc + part * (wk->maxc4 + 1);
    cand *heap = wk->heap + part * ((size_t)c->K + 1);
    for (size_t j = j0; j < j1; j++) {
        size_t i = f->i_base + j, t = f->pos0 + i, ncomp = (t + 1) / 4;
        if (ncomp <= c->K) continue;
        const float *wi = f->iw + i * Hi, *d = f->dots + j * Hi * maxc;
        for (size_t k = 0; k < ncomp; k++) {
            float s = 0;
            for (size_t h = 0; h < Hi; h++) {
                float v = d[h * maxc + k];
                s = fmaf(wi[h], v > 0 ? v : 0, s);
            }
            isc[k] = s;
        }
        wk->nsel[i] = (uint32_t)kvt_ds4_topk(isc, ncomp, c->K, wk->sel + i * c->K, heap);
    }
}

/* Score all visible indexer rows for every token of the chunk as one matrix
 * product per slice of tokens (each score is still one fixed-order dot
 * product), then select per token. */
static void index_select(fwd *f)
{
    const ds4_config *c = &f->w->c;
    ds4_work *wk = f->wk;
    size_t Di = c->Di, Hi = c->Hi, maxc = f->maxc;
    size_t slice = (size_t)(1u << 22) / (Hi * maxc); /* ~16 MB of dots (ds4_work_new sizes them) */
    if (slice < 1) slice = 1;
    if (slice > f->n) slice = f->n;
    for (size_t k = 0; k < maxc; k++) from_f16(wk->kI + k * Di, kvt_cache_row_ro(f->s->cache, f->ly->s_idx, k), Di);
    for (size_t i0 = 0; i0 < f->n; i0 += slice) {
        size_t ns = f->n - i0 < slice ? f->n - i0 : slice;
        kvt_matmul(f->s->pool, wk->dots, wk->kI, f->iq + i0 * Hi * Di, ns * Hi, Di, maxc);
        f->dots = wk->dots;
        f->i_base = i0;
        kvt_pool_for_part(f->s->pool, ns, 1, select_range, f);
    }
}

static void attn_range(void *arg, uint32_t part, size_t i0, size_t i1)
{
    fwd *f = arg;
    const ds4_config *c = &f->w->c;
    const ds4_layer *ly = f->ly;
    const kvt_cache *cache = f->s->cache;
    ds4_work *wk = f->wk;
    uint32_t r = c->ratio[f->l];
    size_t Dh = c->Dh, H = c->H;
    float *keys = wk->keys + part * wk->nk * Dh, *sc = wk->sc + part * wk->nk;
    float scale = 1.0f / sqrtf((float)Dh);
    for (size_t i = i0; i < i1; i++) {
        size_t t = f->pos0 + i, ncomp = r ? (t + 1) / r : 0, nsel = ncomp;
        const uint32_t *sel = NULL; /* NULL: every compressed row, in order */
        if (r == 4 && ncomp > c->K) { sel = wk->sel + i * c->K; nsel = wk->nsel[i]; }
        size_t nk = 0;
        for (size_t k = 0; k < nsel; k++)
            from_f16(keys + nk++ * Dh, kvt_cache_row_ro(cache, ly->s_comp, sel ? sel[k] : k), Dh);
        size_t w0 = t + 1 > c->W ? t + 1 - c->W : 0;
        if (kvt_ds4_fault == KVT_DS4_FAULT_MASK && w0 < t) w0++; /* tests: an off-by-one window */
        for (size_t p = w0; p <= t; p++) {
            const uint16_t *row = p >= f->pos0 ? f->rows + (p - f->pos0) * Dh : win_row(cache, ly, c, p);
            from_f16(keys + nk++ * Dh, row, Dh);
        }
        for (size_t h = 0; h < H; h++) {
            const float *q = f->q + (i * H + h) * Dh;
            float z = ly->sinks[h], m = z;
            kvt_dots_rows(sc, 1, q, Dh, 1, keys, Dh, nk, Dh, scale);
            for (size_t k = 0; k < nk; k++) m = sc[k] > m ? sc[k] : m;
            float den = kvt_expf(z - m);
            for (size_t k = 0; k < nk; k++) { sc[k] = kvt_expf(sc[k] - m); den += sc[k]; }
            float *o = f->att + (i * H + h) * Dh;
            memset(o, 0, Dh * sizeof(float));
            kvt_axpys_rows(o, Dh, sc, 0, 1, keys, Dh, nk, Dh);
            for (size_t d = 0; d < Dh; d++) o[d] /= den;
            kvt_rope_inv(o + Dh - c->Dr, c->Dr, t, c->base[f->l]);
        }
    }
}

static void ds4_work_free(void *p)
{
    ds4_work *k = p;
    if (!k) return;
    void *b[] = {k->x, k->h, k->qr, k->q, k->kv, k->rows, k->ckv, k->csc, k->iq, k->iw, k->att, k->f1, k->f3,
                 k->tmp, k->p, k->chk, k->sel, k->nsel, k->kI, k->dots, k->keys, k->sc, k->isc, k->heap};
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++) free(b[i]);
    free(k);
}

/* The per-part scratch for the pool's parts (again when the pool grew). */
static int parts_fit(ds4_work *k, const ds4_config *c, size_t parts)
{
    if (k->parts >= parts) return KVT_OK;
    float *keys = kvt_malloc(parts * k->nk * c->Dh * sizeof(float));
    float *sc = kvt_malloc(parts * k->nk * sizeof(float));
    float *isc = k->sel ? kvt_malloc(parts * (k->maxc4 + 1) * sizeof(float)) : NULL;
    cand *heap = k->sel ? kvt_malloc(parts * ((size_t)c->K + 1) * sizeof(cand)) : NULL;
    if (!keys || !sc || (k->sel && (!isc || !heap))) {
        free(keys); free(sc); free(isc); free(heap);
        return kvt_fail(KVT_ENOMEM, "ds4 attention scratch for %zu threads", parts);
    }
    free(k->keys); free(k->sc); free(k->isc); free(k->heap);
    k->keys = keys; k->sc = sc; k->isc = isc; k->heap = heap;
    k->parts = parts;
    return KVT_OK;
}

#define MAX_PASS 256 /* tokens of one pass through the layers */

static int ds4_work_new(kvt_session *s)
{
    const ds4_config *c = &((const ds4_weights *)s->m->weights)->c;
    ds4_work *k = kvt_calloc(1, sizeof *k);
    if (!k) return KVT_ENOMEM;
    /* every size below is bounded by finish_config's limits and n_ctx <= 2^24:
     * none overflows a 64-bit size_t */
    size_t ch = s->chunk < MAX_PASS ? (s->chunk ? s->chunk : 1) : MAX_PASS, n_ctx = s->n_ctx;
    size_t D = c->D, Dh = c->Dh, HD = (size_t)c->H * c->Dh, F = c->F, Rq = c->Rq, Di = c->Di, Hi = c->Hi;
    size_t wide = Dh > Di ? Dh : Di, CW = 2 * wide, K = c->K;
    k->ch = ch;
    k->n_ctx = n_ctx;
    size_t nc = 0; /* compressed rows one position attends to at most */
    for (uint32_t l = 0; l < c->L; l++) {
        size_t r = c->ratio[l], m = r ? n_ctx / r : 0;
        if (r == 4 && m > K) m = K;
        if (r == 4) k->maxc4 = n_ctx / 4;
        nc = m > nc ? m : nc;
    }
    k->nk = nc + c->W;
    k->x = kvt_malloc(ch * D * sizeof(float));
    k->h = kvt_malloc(ch * D * sizeof(float));
    k->qr = kvt_malloc(ch * Rq * sizeof(float));
    k->q = kvt_malloc(ch * HD * sizeof(float));
    k->kv = kvt_malloc(ch * Dh * sizeof(float));
    k->rows = kvt_malloc(ch * Dh * 2);
    k->ckv = kvt_malloc(ch * CW * sizeof(float));
    k->csc = kvt_malloc(ch * CW * sizeof(float));
    k->iq = kvt_malloc(ch * Hi * Di * sizeof(float));
    k->iw = kvt_malloc(ch * Hi * sizeof(float));
    k->att = kvt_malloc(ch * HD * sizeof(float));
    k->f1 = kvt_malloc(ch * F * sizeof(float));
    k->f3 = kvt_malloc(ch * F * sizeof(float));
    k->tmp = kvt_malloc(ch * (D > HD ? D : HD) * sizeof(float));
    k->p = kvt_malloc(wide * sizeof(float));
    k->chk = kvt_malloc(wide * 2);
    k->nsel = kvt_malloc(ch * sizeof(uint32_t));
    bool ok = k->x && k->h && k->qr && k->q && k->kv && k->rows && k->ckv && k->csc && k->iq && k->iw && k->att &&
              k->f1 && k->f3 && k->tmp && k->p && k->chk && k->nsel;
    if (ok && k->maxc4 > K) {
        /* the dots of index_select's slices: slice * Hi * maxc floats, where
         * slice = clamp(2^22 / (Hi * maxc), 1, n) with maxc <= maxc4 and n <= ch */
        size_t all = ch * Hi * k->maxc4, one = Hi * k->maxc4, big = one > (1u << 22) ? one : (1u << 22);
        k->sel = kvt_malloc(ch * K * sizeof(uint32_t));
        k->kI = kvt_malloc(k->maxc4 * Di * sizeof(float));
        k->dots = kvt_malloc((all < big ? all : big) * sizeof(float));
        ok = k->sel && k->kI && k->dots;
    }
    int rc = ok ? parts_fit(k, c, kvt_pool_size(s->pool)) : KVT_ENOMEM;
    if (rc) {
        ds4_work_free(k);
        return rc == KVT_ENOMEM ? kvt_fail(KVT_ENOMEM, "ds4 scratch for %zu tokens of a %zu-token context", ch, n_ctx)
                                : rc;
    }
    s->work = k;
    return KVT_OK;
}

/* One pass of at most wk->ch tokens. replay_from is SIZE_MAX for a normal
 * pass. Otherwise the pass is part of a replay that started at replay_from
 * over a cache whose stream rows are already complete (see ds4_state_rebuild):
 * the compressed rows are not written, and each one whose inputs the replay
 * has already made exact is recomputed and must equal the stored row. */
static int forward_pass(kvt_session *s, ds4_work *wk, const int32_t *tok, size_t n, size_t pos0, float *logits,
                        size_t lfrom, size_t replay_from)
{
    const ds4_weights *w = s->m->weights;
    const ds4_config *c = &w->c;
    size_t D = c->D, Dh = c->Dh, HD = (size_t)c->H * c->Dh, F = c->F, Rq = c->Rq, Di = c->Di, Hi = c->Hi;
    float *x = wk->x, *h = wk->h, *qr = wk->qr, *q = wk->q, *kv = wk->kv, *ckv = wk->ckv, *csc = wk->csc;
    float *iq = wk->iq, *iw = wk->iw, *att = wk->att, *f1 = wk->f1, *f3 = wk->f3, *tmp = wk->tmp, *p = wk->p;
    uint16_t *rows = wk->rows, *chk = wk->chk;
    bool replay = replay_from != SIZE_MAX;
    for (size_t i = 0; i < n; i++) {
        if (tok[i] < 0 || (uint32_t)tok[i] >= c->V)
            return kvt_fail(KVT_EINVAL, "token id %d out of range [0, %u)", tok[i], c->V);
        memcpy(x + i * D, w->tok_embd + (size_t)tok[i] * D, D * sizeof(float));
    }
    for (uint32_t l = 0; l < c->L; l++) {
        /* A replay skips the positions whose values at this layer cannot
         * reach what it keeps (see replay_start): they start exact at
         * replay_from + l(W-1). */
        size_t skip = 0, lead = replay ? replay_from + (size_t)l * (c->W - 1) : 0;
        if (replay && replay_from && lead > pos0) skip = lead - pos0 < n ? lead - pos0 : n;
        if (skip == n) continue;
        const size_t nn = n - skip, p0 = pos0 + skip;
        float *xl = x + skip * D;
        const ds4_layer *ly = &w->layers[l];
        uint32_t r = c->ratio[l];
        float base = c->base[l];
        for (size_t i = 0; i < nn; i++) kvt_rmsnorm(h + i * D, xl + i * D, ly->attn_norm, D, c->eps);
        /* queries */
        kvt_matmul(s->pool, tmp, ly->wqa, h, nn, D, Rq);
        for (size_t i = 0; i < nn; i++) kvt_rmsnorm(qr + i * Rq, tmp + i * Rq, ly->q_norm, Rq, c->eps);
        kvt_matmul(s->pool, q, ly->wqb, qr, nn, Rq, HD);
        for (size_t i = 0; i < nn; i++)
            for (size_t hh = 0; hh < c->H; hh++) {
                float *qh = q + (i * c->H + hh) * Dh;
                kvt_rmsnorm(qh, qh, NULL, Dh, c->eps);
                kvt_rope(qh + Dh - c->Dr, c->Dr, p0 + i, base);
            }
        /* raw rows: key and value at once */
        kvt_matmul(s->pool, kv, ly->wkv, h, nn, D, Dh);
        for (size_t i = 0; i < nn; i++) {
            float *k = kv + i * Dh;
            kvt_rmsnorm(k, k, ly->kv_norm, Dh, c->eps);
            kvt_rope(k + Dh - c->Dr, c->Dr, p0 + i, base);
            to_f16(rows + i * Dh, k, Dh);
        }
        /* compressors: pool in position order, emit rows as blocks complete */
        for (int pass = 0; pass < (r == 4 ? 2 : r ? 1 : 0); pass++) {
            bool idx = pass == 1;
            size_t d = idx ? Di : Dh, cw = (r == 4 ? 2 : 1) * d, off = idx ? ly->off_if : ly->off_cf;
            int stream = idx ? ly->s_idx : ly->s_comp;
            kvt_matmul(s->pool, ckv, idx ? ly->i_kv : ly->c_kv, h, nn, D, cw);
            kvt_matmul(s->pool, csc, idx ? ly->i_gate : ly->c_gate, h, nn, D, cw);
            const float *ape = idx ? ly->i_ape : ly->c_ape;
            size_t n_rot = idx ? (c->Dr < Di ? c->Dr : Di) : c->Dr;
            float rb = idx ? c->idx_base : base;
            for (size_t i = 0; i < nn; i++) {
                size_t t = p0 + i;
                float *sl = front_slot(s->cache, off, r, cw, t);
                memcpy(sl, ckv + i * cw, cw * sizeof(float));
                for (size_t j = 0; j < cw; j++) sl[cw + j] = csc[i * cw + j] + ape[(t % r) * cw + j];
                if ((t + 1) % r) continue;
                size_t row = (t + 1) / r - 1;
                uint16_t *out = chk; /* a replay recomputes rows its exact region pools, to compare */
                if (replay && replay_from && (r == 4 && row > 0 ? row * r - 4 : row * r) < lead) continue;
                if (!replay && !(out = kvt_cache_row(s->cache, (size_t)stream, row)))
                    return kvt_fail(KVT_ENOMEM, "ds4: compressed row for token %zu", t);
                emit_row(s->cache, off, r, d, t, idx ? ly->i_norm : ly->c_norm, c->eps, n_rot, rb, p, out);
                if (replay && memcmp(chk, kvt_cache_row_ro(s->cache, (size_t)stream, row), d * 2))
                    return kvt_fail(KVT_ECORRUPT, "ds4 replay: layer %u row %zu differs from the stored row", l, row);
            }
        }
        if (r == 4) {
            kvt_matmul(s->pool, iq, ly->i_q, qr, nn, Rq, Hi * Di);
            size_t n_rot = c->Dr < Di ? c->Dr : Di;
            for (size_t i = 0; i < nn; i++)
                for (size_t hh = 0; hh < Hi; hh++) kvt_rope(iq + (i * Hi + hh) * Di + Di - n_rot, n_rot, p0 + i, c->idx_base);
            kvt_matmul(s->pool, iw, ly->i_w, h, nn, D, Hi);
            float isc = 1.0f / sqrtf((float)(Di * Hi));
            for (size_t j = 0; j < nn * Hi; j++) iw[j] *= isc;
        }
        fwd fa = {s, w, ly, wk, l, nn, p0, q, rows, iq, iw, att};
        fa.maxc = r ? (p0 + nn) / r : 0;
        if (r == 4 && fa.maxc > c->K) index_select(&fa);
        kvt_pool_for_part(s->pool, nn, 1, attn_range, &fa);
        /* only now does the ring take this chunk's rows */
        for (size_t i = nn > c->W ? nn - c->W : 0; i < nn; i++)
            memcpy(win_row(s->cache, ly, c, p0 + i), rows + i * Dh, Dh * 2);
        kvt_matmul(s->pool, tmp, ly->wo, att, nn, HD, D);
        for (size_t j = 0; j < nn * D; j++) xl[j] += tmp[j];
        for (size_t i = 0; i < nn; i++) kvt_rmsnorm(h + i * D, xl + i * D, ly->ffn_norm, D, c->eps);
        kvt_matmul(s->pool, f1, ly->w1, h, nn, D, F);
        kvt_matmul(s->pool, f3, ly->w3, h, nn, D, F);
        for (size_t j = 0; j < nn * F; j++) f1[j] = kvt_silu(f1[j]) * f3[j];
        kvt_matmul(s->pool, tmp, ly->w2, f1, nn, F, D);
        for (size_t j = 0; j < nn * D; j++) xl[j] += tmp[j];
    }
    if (lfrom < n) {
        size_t nl = n - lfrom;
        for (size_t i = 0; i < nl; i++) kvt_rmsnorm(h + i * D, x + (lfrom + i) * D, w->out_norm, D, c->eps);
        kvt_matmul(s->pool, logits, w->out, h, nl, D, c->V);
    }
    return KVT_OK;
}

/* Tokens [pos0, pos0 + n) in passes of at most wk->ch (see forward_pass). */
static int forward_chunk(kvt_session *s, const int32_t *tok, size_t n, size_t pos0, float *logits, size_t lfrom,
                         size_t replay_from)
{
    ds4_work *wk = s->work;
    int rc = parts_fit(wk, &((const ds4_weights *)s->m->weights)->c, kvt_pool_size(s->pool));
    if (rc) return rc;
    if (pos0 + n > wk->n_ctx) return kvt_fail(KVT_ECTX, "tokens up to %zu exceed the context", pos0 + n);
    size_t V = s->m->info.n_vocab;
    for (size_t done = 0; done < n && !rc;) {
        size_t m = n - done < wk->ch ? n - done : wk->ch;
        size_t lf = lfrom > done ? lfrom - done : 0; /* the pass's first row with logits */
        float *lg = NULL;
        if (logits && lf < m) lg = logits + (done + lf - lfrom) * V;
        else lf = m;
        rc = forward_pass(s, wk, tok + done, m, pos0 + done, lg, lf, replay_from);
        done += m;
    }
    return rc;
}

static int ds4_forward(kvt_session *s, const int32_t *tok, size_t n, size_t pos0, float *logits, size_t lfrom)
{
    return forward_chunk(s, tok, n, pos0, logits, lfrom, SIZE_MAX);
}

/* Where a replay that ends at n must start so that everything it leaves is
 * exact. Layer 0's input (the embedding) is exact at every position, and
 * attention at t reads the window rows t-W+1..t of its layer (the stored
 * compressed rows are exact), so the input of layer l is exact from
 * q + l(W-1) on. The state at n needs that for layer L-1 at the window's
 * first position n-W, at the first frontier token of every compressing
 * layer, and (for the logits, which check the replay) at n-1 after the last
 * layer. */
static size_t replay_start(const ds4_config *c, size_t n)
{
    if (n == 0) return 0;
    size_t w1 = c->W - 1, win = n > c->W ? n - c->W : 0, lead = (size_t)c->L * w1;
    size_t need = n - 1 > lead ? n - 1 - lead : 0; /* the logits, after the last layer */
    for (uint32_t l = 0; l < c->L; l++) {
        size_t first = win; /* the first position layer l's state holds */
        if (c->ratio[l] && front_start(c->ratio[l], n) < first) first = front_start(c->ratio[l], n);
        lead = (size_t)l * w1;
        size_t q = first > lead ? first - lead : 0;
        if (q < need) need = q;
    }
    if (kvt_ds4_fault == KVT_DS4_FAULT_REPLAY && need > 0) need++; /* tests: one token short */
    return need;
}

/* Rebuild the fixed state at s->n from the token ids and the stream rows
 * alone: replay the last tokens from a zeroed state, then check the replay
 * against the stored logits. */
static int ds4_state_rebuild(kvt_session *s)
{
    const ds4_config *c = &((const ds4_weights *)s->m->weights)->c;
    size_t n = s->n, q = replay_start(c, n), chunk = ((ds4_work *)s->work)->ch;
    if (n == 0) return KVT_OK;
    float *lg = kvt_malloc((size_t)c->V * sizeof(float));
    if (!lg) return KVT_ENOMEM;
    memset(s->cache->state, 0, s->cache->state_bytes);
    int rc = KVT_OK;
    for (size_t pos = q; pos < n && !rc; pos += chunk) {
        size_t k = n - pos < chunk ? n - pos : chunk;
        rc = forward_chunk(s, s->tokens + pos, k, pos, lg, pos + k == n ? k - 1 : k, q);
    }
    if (!rc && memcmp(lg, s->logits, (size_t)c->V * sizeof(float)))
        rc = kvt_fail(KVT_ECORRUPT, "ds4 replay: the logits after %zu tokens differ from the stored ones", n);
    free(lg);
    return rc;
}

size_t kvt_ds4_replay_tokens(const kvt_model *m, size_t n)
{
    return n - replay_start(&((const ds4_weights *)m->weights)->c, n);
}

/* ---- state in logical order ---- */

static void ds4_state_save(const kvt_session *s, kvt_wbuf *b)
{
    const ds4_weights *w = s->m->weights;
    const ds4_config *c = &w->c;
    size_t n = s->n;
    for (uint32_t l = 0; l < c->L; l++) {
        const ds4_layer *ly = &w->layers[l];
        uint32_t r = c->ratio[l];
        for (size_t t = n > c->W ? n - c->W : 0; t < n; t++) kvt_wbuf_put(b, win_row(s->cache, ly, c, t), c->Dh * 2);
        for (int pass = 0; pass < (r == 4 ? 2 : r ? 1 : 0); pass++) {
            size_t d = pass ? c->Di : c->Dh, cw = (r == 4 ? 2 : 1) * d;
            for (size_t t = front_start(r, n); t < n; t++)
                kvt_wbuf_put(b, front_slot(s->cache, pass ? ly->off_if : ly->off_cf, r, cw, t), 2 * cw * sizeof(float));
        }
    }
}

static int ds4_state_load(kvt_session *s, size_t n, kvt_rbuf *rb)
{
    const ds4_weights *w = s->m->weights;
    const ds4_config *c = &w->c;
    for (uint32_t l = 0; l < c->L; l++) {
        const ds4_layer *ly = &w->layers[l];
        uint32_t r = c->ratio[l];
        for (size_t t = n > c->W ? n - c->W : 0; t < n; t++)
            if (!kvt_rbuf_get(rb, win_row(s->cache, ly, c, t), c->Dh * 2))
                return kvt_fail(KVT_EFORMAT, "ds4 state: window of layer %u truncated", l);
        for (int pass = 0; pass < (r == 4 ? 2 : r ? 1 : 0); pass++) {
            size_t d = pass ? c->Di : c->Dh, cw = (r == 4 ? 2 : 1) * d;
            for (size_t t = front_start(r, n); t < n; t++) {
                float *sl = front_slot(s->cache, pass ? ly->off_if : ly->off_cf, r, cw, t);
                if (!kvt_rbuf_get(rb, sl, 2 * cw * sizeof(float)))
                    return kvt_fail(KVT_EFORMAT, "ds4 state: frontier of layer %u truncated", l);
                if (kvt_ds4_fault == KVT_DS4_FAULT_FRONTIER) sl[0] += 1.0f; /* tests: a corrupt frontier */
            }
        }
    }
    return KVT_OK;
}

/* ---- memory accounting ---- */

/* The cache of a shape at ctx tokens, as kvtier lays it out: binary16 window
 * rings, compressed and indexer rows, f32 frontiers. */
static void plan_config(const ds4_config *c, uint64_t ctx, kvt_plan *out)
{
    memset(out, 0, sizeof *out);
    for (uint32_t l = 0; l < c->L; l++) {
        uint32_t r = c->ratio[l];
        out->window += (uint64_t)c->W * c->Dh * 2;
        if (r) {
            out->compressed += ctx / r * c->Dh * 2;
            out->per_token_x1000 += 1000ull * c->Dh * 2 / r;
            out->frontier += r == 4 ? 8ull * 4 * c->Dh * 4 : 128ull * 2 * c->Dh * 4;
        }
        if (r == 4) {
            out->indexer += ctx / 4 * c->Di * 2;
            out->per_token_x1000 += 1000ull * c->Di * 2 / 4;
            out->frontier += 8ull * 4 * c->Di * 4;
        }
    }
    out->fixed = out->window + out->frontier;
    out->total = out->fixed + out->compressed + out->indexer;
}


/* ---- DeepSeek-V4 files in llama.cpp's layout (deepseek4), header only ---- */

static int dsv4_u32(const kvt_gguf *g, const char *key, uint32_t *v)
{
    char k[96];
    snprintf(k, sizeof k, "deepseek4.%s", key);
    int rc = kvt_gguf_get_u32(g, k, v);
    if (rc == KVT_ENOENT) return kvt_fail(KVT_EFORMAT, "deepseek4: missing metadata key %s", k);
    if (!rc) return KVT_OK;
    char msg[256];
    snprintf(msg, sizeof msg, "%s", kvt_errmsg());
    return kvt_fail(rc, "deepseek4: %s: %s", k, msg);
}

/* A key that may be one value or one per layer: the first layer's. */
static int dsv4_u32_or_arr(const kvt_gguf *g, const char *key, uint32_t L, uint32_t *v)
{
    char k[96];
    snprintf(k, sizeof k, "deepseek4.%s", key);
    const kvt_gguf_val *a = kvt_gguf_get(g, k);
    if (!a || a->type != KVT_GGUF_ARR) return dsv4_u32(g, key, v);
    if (a->n != L || (a->elem_type != KVT_GGUF_U32 && a->elem_type != KVT_GGUF_I32) || a->v.arr[0].v.i < 0)
        return kvt_fail(KVT_EFORMAT, "deepseek4: %s: an array of %llu for %u layers", k,
                        (unsigned long long)a->n, L);
    *v = (uint32_t)a->v.arr[0].v.u;
    return KVT_OK;
}

int kvt_ds4_describe(const kvt_gguf *g, uint64_t ctx, kvt_model_info *info, char *detail, size_t dlen,
                     kvt_plan *plan)
{
    ds4_config c = {0};
    uint32_t Dv = 0, hc = 0, E = 0, Eu = 0, Es = 0, Fe = 0, nh = 0, og = 0, orank = 0, mtp = 0;
    int rc;
    if ((rc = dsv4_u32(g, "block_count", &c.L)) || (rc = dsv4_u32(g, "embedding_length", &c.D)) ||
        (rc = dsv4_u32(g, "context_length", &c.ctx)) || (rc = dsv4_u32(g, "attention.head_count", &c.H)) ||
        (rc = dsv4_u32(g, "attention.key_length", &c.Dh)) || (rc = dsv4_u32(g, "attention.value_length", &Dv)) ||
        (rc = dsv4_u32(g, "rope.dimension_count", &c.Dr)) || (rc = dsv4_u32(g, "attention.q_lora_rank", &c.Rq)) ||
        (rc = dsv4_u32(g, "attention.sliding_window", &c.W)) ||
        (rc = dsv4_u32(g, "attention.indexer.head_count", &c.Hi)) ||
        (rc = dsv4_u32(g, "attention.indexer.key_length", &c.Di)) ||
        (rc = dsv4_u32(g, "attention.indexer.top_k", &c.K)) || (rc = dsv4_u32(g, "hyper_connection.count", &hc)) ||
        (rc = dsv4_u32(g, "expert_count", &E)) || (rc = dsv4_u32(g, "expert_shared_count", &Es)) ||
        (rc = dsv4_u32(g, "hash_layer_count", &nh)) || (rc = dsv4_u32(g, "attention.output_group_count", &og)) ||
        (rc = dsv4_u32(g, "attention.output_lora_rank", &orank)))
        return rc;
    if (c.L == 0 || c.L > MAX_LAYERS)
        return kvt_fail(KVT_EFORMAT, "deepseek4: block_count %u out of range [1, %d]", c.L, MAX_LAYERS);
    if ((rc = dsv4_u32_or_arr(g, "expert_used_count", c.L, &Eu)) ||
        (rc = dsv4_u32_or_arr(g, "expert_feed_forward_length", c.L, &Fe)))
        return rc;
    if (kvt_gguf_get_u32(g, "deepseek4.nextn_predict_layers", &mtp) == KVT_OK && mtp > c.L)
        return kvt_fail(KVT_EFORMAT, "deepseek4: %u prediction layers of %u", mtp, c.L);
    if (!c.D || !c.H || !c.Dh || Dv != c.Dh || !c.Dr || c.Dr > c.Dh || c.Dr % 2 || (c.Dh - c.Dr) % 2 || !c.W ||
        !c.Hi || !c.Di || c.Di < c.Dr || !c.K || hc != 4 || !E || E > 1024 || !Eu || Eu > E || !Fe || !og ||
        c.H % og || !orank || nh > c.L)
        return kvt_fail(KVT_EFORMAT,
                        "deepseek4: inconsistent shape (D=%u H=%u key/value length %u/%u rope %u window %u "
                        "indexer %ux%u top-k %u streams %u experts %u used %u groups %u)",
                        c.D, c.H, c.Dh, Dv, c.Dr, c.W, c.Hi, c.Di, c.K, hc, E, Eu, og);
    const kvt_gguf_val *ra = kvt_gguf_get(g, "deepseek4.attention.compress_ratios");
    if (!ra || ra->type != KVT_GGUF_ARR || (ra->elem_type != KVT_GGUF_I32 && ra->elem_type != KVT_GGUF_U32))
        return kvt_fail(KVT_EFORMAT, "deepseek4: attention.compress_ratios missing or not an integer array");
    if (ra->n < c.L)
        return kvt_fail(KVT_EFORMAT, "deepseek4: %llu compress ratios for %u layers",
                        (unsigned long long)ra->n, c.L);
    uint32_t count[3] = {0};
    for (uint32_t l = 0; l < c.L; l++) {
        int64_t r = ra->elem_type == KVT_GGUF_I32 ? ra->v.arr[l].v.i : (int64_t)ra->v.arr[l].v.u;
        if (r != 0 && r != 4 && r != 128)
            return kvt_fail(KVT_EFORMAT, "deepseek4: layer %u has compression ratio %lld (0, 4 or 128)", l,
                            (long long)r);
        c.ratio[l] = (uint32_t)r;
        count[r == 0 ? 0 : r == 4 ? 1 : 2]++;
    }
    const kvt_gguf_val *toks = kvt_gguf_get(g, "tokenizer.ggml.tokens");
    const kvt_gguf_tensor *emb = kvt_gguf_find_tensor(g, "token_embd.weight");
    c.V = toks && toks->type == KVT_GGUF_ARR ? (uint32_t)(toks->n > UINT32_MAX ? UINT32_MAX : toks->n)
          : emb && emb->n_dims == 2 && emb->ne[1] <= UINT32_MAX ? (uint32_t)emb->ne[1] : 0;
    uint64_t np = 0, bytes = 0;
    for (size_t i = 0; i < kvt_gguf_n_tensors(g); i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        np += t->n_elem;
        bytes += t->n_bytes;
    }
    *info = (kvt_model_info){.arch = "deepseek4", .name = "", .n_vocab = c.V, .n_ctx_train = c.ctx, .n_embd = c.D,
                             .n_layer = c.L, .n_head = c.H, .n_head_kv = 1, .head_dim = c.Dh, .n_ff = Fe,
                             .n_params = np, .bos = -1, .eos = -1, .tokenizer = ""};
    if (detail)
        snprintf(detail, dlen,
                 "experts %u (%u used, %u shared, first %u layers hash-routed), %u streams, window %u, "
                 "layers by compression ratio 0/4/128: %u/%u/%u, indexer %u heads x %u top-%u, "
                 "output %u groups of rank %u, %u prediction layers, %u tensors of %.2f GB",
                 E, Eu, Es, nh, hc, c.W, count[0], count[1], count[2], c.Hi, c.Di, c.K, og, orank, mtp,
                 (unsigned)kvt_gguf_n_tensors(g), bytes / 1e9);
    if (plan) plan_config(&c, ctx, plan);
    return KVT_OK;
}

int kvt_ds4_plan(const char *preset_or_null, const kvt_model *m, uint64_t ctx, kvt_plan *out)
{
    ds4_config cfg;
    const ds4_config *c;
    if (m) {
        if (m->arch != &kvt_arch_ds4) return kvt_fail(KVT_EINVAL, "not a ds4 model");
        c = &((const ds4_weights *)m->weights)->c;
    } else {
        if (!preset_or_null || !preset_config(preset_or_null, &cfg))
            return kvt_fail(KVT_ENOENT, "no ds4 preset '%s'", preset_or_null ? preset_or_null : "");
        c = &cfg;
    }
    plan_config(c, ctx, out);
    return KVT_OK;
}

const kvt_arch kvt_arch_ds4 = {
    .name = "ds4",
    .cache_new = ds4_cache_new,
    .forward = ds4_forward,
    .state_save = ds4_state_save,
    .state_load = ds4_state_load,
    .state_rebuild = ds4_state_rebuild,
    .fingerprint = ds4_fingerprint,
    .weights_free = ds4_free,
    .work_new = ds4_work_new,
    .work_free = ds4_work_free,
};
