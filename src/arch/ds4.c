/* The ds4 architecture: DeepSeek-V4 as llama.cpp runs it (`deepseek4`):
 * hyper-connections, hybrid compressed attention with an indexer, and a
 * mixture of experts. docs/ds4.md gives the math, the GGUF layout and the
 * presets; the notes there say where kvtier follows llama.cpp rather than
 * the original checkpoint's code.
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
 * The residual is 4 hyper-connection streams per token; they live only in
 * the pass's scratch, never in the cache.
 *
 * Exactness: tokens of a chunk are pooled in position order by one thread, a
 * row becomes visible at the token that completes it, and attention for
 * position t reads exactly the rows visible at t in the canonical order
 * (compressed by increasing index, then window by increasing position), each
 * through the fixed-order kernels. The window ring is updated only after the
 * chunk's attention, reading rows of the chunk from the chunk's own buffer, so
 * chunk size never changes what a position sees. Experts run per token on
 * the rows routed to them; each output is a fixed-order dot product, so
 * which other tokens share a pass changes nothing: a batched pass
 * (forward_batch) runs several sessions' tokens through every matrix at
 * once, and what touches a session's state per segment on its own cache.
 *
 * Synthetic weights (no weight file): every tensor, in the order ds4_tensors
 * lists them, is filled from one splitmix64 stream seeded with the model seed
 * (docs/ds4.md, "Synthetic weights").
 */
#include "kernels/kernels.h"
#include "arch/ds4.h"
#include "arch/tensor.h"
#include "arch/moe.h"
#include "kernels/qkernels.h"
#include "format/quant.h"
#include "base/util.h"

#include <errno.h>
#include <malloc.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <unistd.h>
#include <xxhash.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LAYERS 64
#define HC 4 /* hyper-connection streams (llama.cpp supports 4 only) */
#define HC_MIX ((2 + HC) * HC)
#define GGML_I32 26

enum { SCALE_NONE, SCALE_LINEAR, SCALE_YARN };

typedef struct ds4_config {
    uint32_t V, D, L, H, Dh, Dr, Rq, W, Hi, Di, K, ctx;
    uint32_t E, Eu, Es, Fe, iters, n_hash, og, orank, nextn, yarn_orig;
    uint32_t scaling;           /* compressed layers' RoPE scaling: SCALE_NONE, _LINEAR (by 1/factor), _YARN */
    float eps, hc_eps, base, cbase, wscale, yarn_factor;
    bool wnorm;
    uint32_t ratio[MAX_LAYERS];
    float clamp_exp[MAX_LAYERS], clamp_sh[MAX_LAYERS];
} ds4_config;

/* The projection matrices are kvt_wmat: in the file's own type, in place in
 * the mapped file (a synthetic preset's f32 arrays, or a type kvtier only
 * dequantises, are owned copies), so a quantised file runs on the integer
 * kernels (src/kernels/qkernels.h) and resident memory stays that of the file. The
 * vectors, the hyper-connection mixes and the router stay f32 copies. */
typedef struct ds4_layer {
    float *attn_norm, *sinks;       /* (D), (H) */
    kvt_wmat wqa, wqb;              /* (Rq, D), (H*Dh, Rq) */
    float *q_norm;                  /* (Rq) */
    kvt_wmat wkv;                   /* (Dh, D) */
    float *kv_norm;                 /* (Dh) */
    kvt_wmat woa, wob;              /* (og*orank, H*Dh/og): group g's rows g*orank..; (D, og*orank) */
    float *hca_fn, *hca_base, *hca_scale; /* (24, 4D), (24), (3) */
    float *hcf_fn, *hcf_base, *hcf_scale;
    kvt_wmat c_kv, c_gate;          /* (c*Dh, D) x2; ratio > 0 */
    float *c_ape, *c_norm;          /* (r, c*Dh), (Dh) */
    kvt_wmat i_proj, i_qb;          /* (Hi, D), (Hi*Di, Rq); ratio 4 */
    kvt_wmat i_kv, i_gate;          /* (2*Di, D) x2 */
    float *i_ape, *i_norm;          /* (4, 2*Di), (Di) */
    float *ffn_norm, *gate_inp, *probs_b; /* (D), (E, D), (E) when not hash-routed */
    int32_t *tid2eid;               /* (V, Eu) when hash-routed */
    kvt_wmat gate_x, up_x, down_x;  /* (E*Fe, D), (E*Fe, D), (E*D, Fe): expert e's rows e*Fe.. (e*D..) */
    kvt_wmat gate_s, up_s, down_s;  /* (Es*Fe, D) x2, (D, Es*Fe) */
    kvt_wmat eh;                    /* the MTP layer's (D, 2D): [embedding, hidden] to the streams */
    float *enorm, *hnorm;           /* (D) x2, the MTP layer's */
    /* the MTP layer's optional own embedding and head (NULL data: the
     * model's): token rows, head norm, output, and (ds4.c's file) the
     * head's stream mixes */
    kvt_wmat emb, head;             /* (V, D) x2 */
    float *head_norm;               /* (D) */
    float *hh_fn, *hh_base, *hh_scale; /* (4, 4D), (4), (1) */
    /* cache geometry */
    int s_comp, s_idx;              /* stream ids (-1: none) */
    size_t off_win, off_cf, off_if; /* state offsets: window ring, frontiers */
} ds4_layer;

typedef struct ds4_weights {
    ds4_config c;
    uint64_t seed;
    kvt_wmat tok_embd, out;                 /* (V, D) x2 */
    float *out_norm;                        /* (D) */
    float *hch_fn, *hch_base, *hch_scale;   /* (4, 4D), (4), (1) */
    float **own;                            /* (n_own) the matrices' owned f32 arrays */
    size_t n_own;
    ds4_layer layers[MAX_LAYERS];
    kvt_gguf *mtp_file;                     /* a separate MTP file the layer borrows from (kvt_ds4_mtp_attach) */
    kvt_yarn yarn;                          /* compressed layers' RoPE */
    size_t n_streams, state_bytes, hd_idx;  /* hd_idx: the indexer's Hadamard order */
} ds4_weights;

/* ---- presets ---- */

static void set_layout(ds4_config *c)
{
    for (uint32_t l = 0; l < c->L; l++) {
        c->ratio[l] = l < 2 ? 0 : (l % 2 == 0 ? 4 : 128);
        c->clamp_exp[l] = c->clamp_sh[l] = 1.0f;
    }
    c->eps = 1e-6f;
    c->hc_eps = 1e-6f;
    c->iters = 20;
    c->base = 10000.0f;
    c->cbase = 160000.0f;
    c->wscale = 1.5f;
    c->wnorm = true;
    c->scaling = SCALE_YARN;
    c->yarn_factor = 16.0f;
    c->yarn_orig = 65536;
}

/* "key=value,key=value" over a preset (see docs/ds4.md, "Shape variants"). */
static bool apply_overrides(ds4_config *c, const char *s)
{
    static const struct { const char *k; size_t off; } u[] = {
#define U(name, field) {name, offsetof(ds4_config, field)}
        U("D", D), U("L", L), U("H", H), U("Dh", Dh), U("Dr", Dr), U("Rq", Rq), U("W", W), U("Hi", Hi),
        U("Di", Di), U("K", K), U("ctx", ctx), U("E", E), U("Eu", Eu), U("Es", Es), U("Fe", Fe),
        U("hash", n_hash), U("og", og), U("orank", orank), U("iters", iters), U("mtp", nextn),
#undef U
    };
    while (*s) {
        const char *eq = strchr(s, '='), *end = strchr(s, ',');
        if (!end) end = s + strlen(s);
        if (!eq || eq > end) return false;
        size_t kl = (size_t)(eq - s);
        const char *v = eq + 1;
        char *e;
        bool done = false;
        for (size_t i = 0; i < sizeof u / sizeof u[0] && !done; i++)
            if (strlen(u[i].k) == kl && !memcmp(s, u[i].k, kl)) {
                unsigned long x = strtoul(v, &e, 10);
                if (e != end || x > UINT32_MAX) return false;
                *(uint32_t *)((char *)c + u[i].off) = (uint32_t)x;
                done = true;
            }
        if (!done && kl == 5 && !memcmp(s, "clamp", 5)) {
            float x = strtof(v, &e);
            if (e != end || !(x >= 0)) return false;
            for (uint32_t l = 0; l < MAX_LAYERS; l++) c->clamp_exp[l] = c->clamp_sh[l] = x;
            done = true;
        } else if (!done && kl == 4 && !memcmp(s, "yarn", 4)) {
            float x = strtof(v, &e);
            if (e != end || !(x >= 0)) return false;
            c->yarn_factor = x;
            c->scaling = x > 1 ? SCALE_YARN : SCALE_NONE;
            done = true;
        } else if (!done && kl == 6 && !memcmp(s, "ratios", 6)) {
            /* one per layer, colon-separated; the layer count follows */
            uint32_t n = 0;
            for (const char *q = v; q < end; n++) {
                if (n == MAX_LAYERS) return false;
                unsigned long x = strtoul(q, &e, 10);
                if (e == q || x > 128) return false;
                c->ratio[n] = (uint32_t)x;
                q = *e == ':' ? e + 1 : e;
                if (e > end || (*e != ':' && e != end)) return false;
            }
            c->L = n;
            done = true;
        }
        if (!done) return false;
        s = *end ? end + 1 : end;
    }
    return true;
}

static bool preset_config(const char *name, ds4_config *c)
{
    memset(c, 0, sizeof *c);
    const char *plus = strchr(name, '+');
    if (plus) {
        char base[16];
        size_t bl = (size_t)(plus - name);
        if (bl >= sizeof base) return false;
        memcpy(base, name, bl);
        base[bl] = 0;
        if (!strcmp(base, "ds4-flash") || !preset_config(base, c)) return false;
        uint32_t L0 = c->L;
        if (!apply_overrides(c, plus + 1)) return false;
        for (uint32_t l = L0; l < c->L && l < MAX_LAYERS; l++) {
            c->clamp_exp[l] = c->clamp_sh[l] = c->clamp_exp[0];
            if (!strstr(plus, "ratios=")) c->ratio[l] = l < 2 ? 0 : (l % 2 == 0 ? 4 : 128);
        }
        if (c->L < MAX_LAYERS) c->clamp_exp[c->L] = c->clamp_sh[c->L] = c->clamp_exp[0]; /* the MTP layer's */
        return true;
    }
    if (!strcmp(name, "ds4-tiny")) {
        *c = (ds4_config){.D = 64, .L = 4, .H = 2, .Dh = 32, .Dr = 8, .Rq = 32, .W = 16, .Hi = 2, .Di = 64, .K = 8,
                          .ctx = 4096, .E = 8, .Eu = 2, .Es = 1, .Fe = 32, .n_hash = 1, .og = 2, .orank = 16};
    } else if (!strcmp(name, "ds4-mini")) {
        *c = (ds4_config){.D = 256, .L = 8, .H = 8, .Dh = 128, .Dr = 16, .Rq = 128, .W = 128, .Hi = 4, .Di = 64,
                          .K = 64, .ctx = 131072, .E = 16, .Eu = 4, .Es = 1, .Fe = 128, .n_hash = 2, .og = 4,
                          .orank = 64};
    } else if (!strcmp(name, "ds4-flash-bench")) {
        /* Flash's widths with two layers (ratio 4 then 128, the first
         * hash-routed): written by `model new --type`, for benchmarks */
        *c = (ds4_config){.D = 4096, .L = 2, .H = 64, .Dh = 512, .Dr = 64, .Rq = 1024, .W = 128, .Hi = 64,
                          .Di = 128, .K = 512, .ctx = 1048576, .E = 256, .Eu = 6, .Es = 1, .Fe = 2048,
                          .n_hash = 1, .og = 8, .orank = 1024};
    } else if (!strcmp(name, "ds4-flash")) {
        *c = (ds4_config){.V = 129280, .D = 4096, .L = 43, .H = 64, .Dh = 512, .Dr = 64, .Rq = 1024, .W = 128,
                          .Hi = 64, .Di = 128, .K = 512, .ctx = 1048576, .E = 256, .Eu = 6, .Es = 1, .Fe = 2048,
                          .n_hash = 3, .og = 8, .orank = 1024};
    } else {
        return false;
    }
    set_layout(c);
    bool flash = !strncmp(name, "ds4-flash", 9);
    if (flash)
        for (uint32_t l = 0; l < c->L; l++) c->clamp_exp[l] = c->clamp_sh[l] = 10.0f;
    if (!strcmp(name, "ds4-flash-bench")) c->ratio[0] = 4, c->ratio[1] = 128;
    return true;
}

/* ---- tensor table: one list drives generation, loading, writing ---- */

enum init { INIT_MAT, INIT_EMBED, INIT_SMALL, INIT_ONE, INIT_ZERO, INIT_ROUTE };

typedef struct tdesc {
    char name[56];
    uint32_t nd;
    uint64_t ne[3];             /* ne[0] = input (contiguous) width */
    enum init init;
    float **slot;               /* f32 tensors */
    kvt_wmat *mat;              /* matrices (ne[0] columns, ne[1] * ne[2] rows) */
    int32_t **islot;            /* the I32 routing table */
    uint8_t opt;                /* OPT_*: whether a file must have it */
} tdesc;

/* OPT_FILE: optional in either layout (llama.cpp's optional nextn
 * tensors); OPT_DS4C: read from ds4.c's separate MTP file only (llama.cpp's
 * layout has no such tensor: the model's is used). Optional tensors are
 * neither drawn nor written by the presets. */
enum { OPT_NO, OPT_FILE, OPT_DS4C };

#define MAX_TENSORS (8 + MAX_LAYERS * 37)

static size_t tcount(const tdesc *t) { return (size_t)(t->ne[0] * t->ne[1] * t->ne[2]); }

/* An optional tensor the weights do not have. */
static bool absent(const tdesc *t) { return t->opt && (t->mat ? !t->mat->data : !*t->slot); }

static size_t ds4_tensors(ds4_weights *w, tdesc *t)
{
    const ds4_config *c = &w->c;
    size_t n = 0;
    uint64_t D = c->D, HD = (uint64_t)c->H * c->Dh;
#define ADD(nm, d, a, b, e, in, sl)                                                              \
    do { t[n] = (tdesc){.nd = (d), .ne = {(a), (b), (e)}, .init = (in), .slot = (sl)};         \
         snprintf(t[n].name, sizeof t[n].name, "%s", nm); n++; } while (0)
#define ADDL(suffix, d, a, b, e, in, sl)                                                         \
    do { char nm_[56]; snprintf(nm_, sizeof nm_, "blk.%u.%s", l, suffix);                       \
         ADD(nm_, d, a, b, e, in, sl); } while (0)
#define ADDM(nm, d, a, b, e, in, m) do { ADD(nm, d, a, b, e, in, NULL); t[n - 1].mat = (m); } while (0)
#define ADDLM(suffix, d, a, b, e, in, m) do { ADDL(suffix, d, a, b, e, in, NULL); t[n - 1].mat = (m); } while (0)
    ADDM("token_embd.weight", 2, D, c->V, 1, INIT_EMBED, &w->tok_embd);
    ADD("output_norm.weight", 1, D, 1, 1, INIT_ONE, &w->out_norm);
    ADDM("output.weight", 2, D, c->V, 1, INIT_MAT, &w->out);
    ADD("output_hc_fn.weight", 2, HC * D, HC, 1, INIT_MAT, &w->hch_fn);
    ADD("output_hc_base.weight", 1, HC, 1, 1, INIT_SMALL, &w->hch_base);
    ADD("output_hc_scale.weight", 1, 1, 1, 1, INIT_ONE, &w->hch_scale);
    /* a config refused for its layer count has no layers to walk (ds4_free) */
    uint32_t L = c->L + c->nextn <= MAX_LAYERS ? c->L : 0, nx = L ? c->nextn : 0;
    /* the MTP (nextn) layer after the model's: a layer of raw attention,
     * routed by its scores, and its projection of [embedding, hidden] */
    for (uint32_t l = 0; l < L + nx; l++) {
        ds4_layer *ly = &w->layers[l];
        uint32_t r = l < L ? c->ratio[l] : 0, cw = (r == 4 ? 2 : 1) * c->Dh;
        uint64_t Fs = (uint64_t)c->Fe * c->Es;
        ADDL("attn_norm.weight", 1, D, 1, 1, INIT_ONE, &ly->attn_norm);
        ADDL("attn_sinks.weight", 1, c->H, 1, 1, INIT_ZERO, &ly->sinks);
        ADDLM("attn_q_a.weight", 2, D, c->Rq, 1, INIT_MAT, &ly->wqa);
        ADDL("attn_q_a_norm.weight", 1, c->Rq, 1, 1, INIT_ONE, &ly->q_norm);
        ADDLM("attn_q_b.weight", 2, c->Rq, HD, 1, INIT_MAT, &ly->wqb);
        ADDLM("attn_kv.weight", 2, D, c->Dh, 1, INIT_MAT, &ly->wkv);
        ADDL("attn_kv_a_norm.weight", 1, c->Dh, 1, 1, INIT_ONE, &ly->kv_norm);
        ADDLM("attn_output_a.weight", 2, c->og ? HD / c->og : 0, (uint64_t)c->orank * c->og, 1, INIT_MAT, &ly->woa);
        ADDLM("attn_output_b.weight", 2, (uint64_t)c->og * c->orank, D, 1, INIT_MAT, &ly->wob);
        ADDL("hc_attn_fn.weight", 2, HC * D, HC_MIX, 1, INIT_MAT, &ly->hca_fn);
        ADDL("hc_attn_base.weight", 1, HC_MIX, 1, 1, INIT_SMALL, &ly->hca_base);
        ADDL("hc_attn_scale.weight", 1, 3, 1, 1, INIT_ONE, &ly->hca_scale);
        ADDL("hc_ffn_fn.weight", 2, HC * D, HC_MIX, 1, INIT_MAT, &ly->hcf_fn);
        ADDL("hc_ffn_base.weight", 1, HC_MIX, 1, 1, INIT_SMALL, &ly->hcf_base);
        ADDL("hc_ffn_scale.weight", 1, 3, 1, 1, INIT_ONE, &ly->hcf_scale);
        if (r) {
            ADDLM("attn_compressor_kv.weight", 2, D, cw, 1, INIT_MAT, &ly->c_kv);
            ADDLM("attn_compressor_gate.weight", 2, D, cw, 1, INIT_MAT, &ly->c_gate);
            ADDL("attn_compressor_ape.weight", 2, cw, r, 1, INIT_SMALL, &ly->c_ape);
            ADDL("attn_compressor_norm.weight", 1, c->Dh, 1, 1, INIT_ONE, &ly->c_norm);
        }
        if (r == 4) {
            ADDLM("indexer.proj.weight", 2, D, c->Hi, 1, INIT_MAT, &ly->i_proj);
            ADDLM("indexer.attn_q_b.weight", 2, c->Rq, (uint64_t)c->Hi * c->Di, 1, INIT_MAT, &ly->i_qb);
            ADDLM("indexer_compressor_kv.weight", 2, D, 2 * c->Di, 1, INIT_MAT, &ly->i_kv);
            ADDLM("indexer_compressor_gate.weight", 2, D, 2 * c->Di, 1, INIT_MAT, &ly->i_gate);
            ADDL("indexer_compressor_ape.weight", 2, 2 * c->Di, 4, 1, INIT_SMALL, &ly->i_ape);
            ADDL("indexer_compressor_norm.weight", 1, c->Di, 1, 1, INIT_ONE, &ly->i_norm);
        }
        ADDL("ffn_gate_inp.weight", 2, D, c->E, 1, INIT_MAT, &ly->gate_inp);
        if (l < c->n_hash) {
            ADDL("ffn_gate_tid2eid.weight", 2, c->Eu, c->V, 1, INIT_ROUTE, NULL);
            t[n - 1].islot = &ly->tid2eid;
        } else {
            ADDL("exp_probs_b.bias", 1, c->E, 1, 1, INIT_SMALL, &ly->probs_b);
        }
        ADDL("ffn_norm.weight", 1, D, 1, 1, INIT_ONE, &ly->ffn_norm);
        ADDLM("ffn_gate_exps.weight", 3, D, c->Fe, c->E, INIT_MAT, &ly->gate_x);
        ADDLM("ffn_down_exps.weight", 3, c->Fe, D, c->E, INIT_MAT, &ly->down_x);
        ADDLM("ffn_up_exps.weight", 3, D, c->Fe, c->E, INIT_MAT, &ly->up_x);
        ADDLM("ffn_gate_shexp.weight", 2, D, Fs, 1, INIT_MAT, &ly->gate_s);
        ADDLM("ffn_down_shexp.weight", 2, Fs, D, 1, INIT_MAT, &ly->down_s);
        ADDLM("ffn_up_shexp.weight", 2, D, Fs, 1, INIT_MAT, &ly->up_s);
        if (l >= L) {
            ADDLM("nextn.eh_proj.weight", 2, 2 * D, D, 1, INIT_MAT, &ly->eh);
            ADDL("nextn.enorm.weight", 1, D, 1, 1, INIT_ONE, &ly->enorm);
            ADDL("nextn.hnorm.weight", 1, D, 1, 1, INIT_ONE, &ly->hnorm);
            ADDLM("nextn.embed_tokens.weight", 2, D, c->V, 1, INIT_EMBED, &ly->emb);
            t[n - 1].opt = OPT_FILE;
            ADDL("nextn.shared_head_norm.weight", 1, D, 1, 1, INIT_ONE, &ly->head_norm);
            t[n - 1].opt = OPT_FILE;
            ADDLM("nextn.shared_head_head.weight", 2, D, c->V, 1, INIT_MAT, &ly->head);
            t[n - 1].opt = OPT_FILE;
            ADDL("nextn.hc_head_fn.weight", 2, HC * D, HC, 1, INIT_MAT, &ly->hh_fn);
            t[n - 1].opt = OPT_DS4C;
            ADDL("nextn.hc_head_base.weight", 1, HC, 1, 1, INIT_SMALL, &ly->hh_base);
            t[n - 1].opt = OPT_DS4C;
            ADDL("nextn.hc_head_scale.weight", 1, 1, 1, 1, INIT_ONE, &ly->hh_scale);
            t[n - 1].opt = OPT_DS4C;
        }
    }
#undef ADDLM
#undef ADDM
#undef ADDL
#undef ADD
    return n;
}

static void ds4_free(void *p)
{
    ds4_weights *w = p;
    if (!w) return;
    tdesc *t = malloc(MAX_TENSORS * sizeof *t);
    if (t) {
        size_t n = ds4_tensors(w, t);
        for (size_t i = 0; i < n; i++)
            if (!t[i].mat) free(t[i].slot ? (void *)*t[i].slot : (void *)*t[i].islot);
        free(t);
    }
    for (size_t i = 0; i < w->n_own; i++) free(w->own[i]);
    free(w->own);
    kvt_gguf_close(w->mtp_file); /* after the weights that point into it */
    free(w);
}

/* Validate a config and derive the cache geometry (streams, state offsets). */
static int finish_config(ds4_weights *w)
{
    ds4_config *c = &w->c;
    if (!c->V || !c->D || !c->L || c->L > MAX_LAYERS || !c->H || !c->Dh || c->Dh % 2 || !c->Dr ||
        c->Dr > c->Dh || c->Dr % 2 || !c->Rq || !c->W || !c->Hi || !c->Di || c->Di < c->Dr || !c->K ||
        !c->ctx || c->D > 16384 || c->Dh > 4096 || c->H > 1024 || c->Rq > 65536 || c->V > 1u << 24 ||
        c->W > 1u << 20 || c->Di > 4096 || c->Hi > 1024 || c->ctx > 1u << 24 || !c->E || c->E > 1024 || !c->Eu ||
        c->Eu > c->E || c->Eu > 64 || !c->Fe || c->Fe > 1u << 20 || c->Es > 64 || !c->og || c->H % c->og ||
        !c->orank || c->orank > 65536 || c->n_hash > c->L || !c->iters || c->iters > 1000 || !(c->eps > 0) ||
        !(c->hc_eps >= 0) || !(c->base > 0) || !(c->cbase > 0) || !(c->wscale >= 0) ||
        !(c->yarn_factor >= 0) || c->yarn_factor > 1e6f || c->nextn > 1 || c->L + c->nextn > MAX_LAYERS)
        return kvt_fail(KVT_EFORMAT,
                        "ds4: inconsistent configuration (D=%u L=%u H=%u Dh=%u Dr=%u experts %u used %u groups %u, "
                        "%u MTP layers: at most 1)", c->D, c->L, c->H, c->Dh, c->Dr, c->E, c->Eu, c->og, c->nextn);
    /* the indexer's keys and queries turn by the largest power-of-two
     * Hadamard from 64 up that divides Di (llama.cpp's rule) */
    if (c->Di % 64)
        return kvt_fail(KVT_EFORMAT, "ds4: indexer key length %u is not a multiple of 64", c->Di);
    size_t hd = 64;
    while (c->Di % (hd * 2) == 0) hd *= 2;
    w->hd_idx = hd;
    /* the indexer's selection scratch is (chunk, K) per session */
    if (c->K > 1u << 16) return kvt_fail(KVT_EFORMAT, "ds4: indexer top-k of %u rows (at most 65536)", c->K);
    w->yarn = (kvt_yarn){1.0f, 0.0f, 0.0f, 0.0f};
    if (c->scaling == SCALE_YARN)
        w->yarn = kvt_yarn_make(c->Dr, c->cbase, c->yarn_factor, c->yarn_orig ? c->yarn_orig : c->ctx);
    else if (c->scaling == SCALE_LINEAR && c->yarn_factor > 0)
        w->yarn.freq_scale = 1.0f / c->yarn_factor;
    size_t off = 0, ns = 0;
    for (uint32_t l = 0; l < c->L; l++) {
        ds4_layer *ly = &w->layers[l];
        uint32_t r = c->ratio[l];
        if (r != 0 && r != 4 && r != 128)
            return kvt_fail(KVT_EFORMAT, "ds4: layer %u has compression ratio %u (0, 4 or 128)", l, r);
        if (!(c->clamp_exp[l] >= 0) || !(c->clamp_sh[l] >= 0))
            return kvt_fail(KVT_EFORMAT, "ds4: layer %u SwiGLU clamp", l);
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
    /* the MTP layer: raw attention over a window ring of its own (the
     * drafter's, not the session's state) */
    if (c->nextn) {
        c->ratio[c->L] = 0;
        w->layers[c->L].s_comp = w->layers[c->L].s_idx = -1;
        w->layers[c->L].off_win = 0;
    }
    w->n_streams = ns;
    w->state_bytes = off;
    return KVT_OK;
}

/* Parameters of a configuration (its tensors' elements). */
static uint64_t config_params(ds4_weights *w)
{
    uint64_t np = 0;
    tdesc *t = malloc(MAX_TENSORS * sizeof *t);
    if (!t) return 0;
    size_t n = ds4_tensors(w, t);
    for (size_t i = 0; i < n; i++) np += absent(&t[i]) ? 0 : tcount(&t[i]);
    free(t);
    return np;
}

static void fill_info(kvt_model *m, const ds4_weights *w)
{
    const ds4_config *c = &w->c;
    kvt_model_info *in = &m->info;
    in->arch = "deepseek4";
    in->n_vocab = c->V;
    in->n_ctx_train = c->ctx;
    in->n_embd = c->D;
    in->n_layer = c->L;
    in->n_head = c->H;
    in->n_head_kv = 1;
    in->head_dim = c->Dh;
    in->n_ff = c->Fe;
    in->n_params = config_params((ds4_weights *)w);
    m->arch = &kvt_arch_ds4;
}

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Keep p (an f32 array of matrix d) as d's matrix, owned by w. */
static int own_mat(ds4_weights *w, const tdesc *d, float *p)
{
    if (!w->own && !(w->own = kvt_calloc(MAX_TENSORS, sizeof *w->own))) return KVT_ENOMEM;
    w->own[w->n_own++] = p; /* at most one per tensor: ds4_tensors lists at most MAX_TENSORS */
    *d->mat = kvt_wmat_f32(p, (size_t)(d->ne[1] * d->ne[2]), (size_t)d->ne[0]);
    return KVT_OK;
}

/* The routing table of d (each token's Eu distinct experts: draws mod E,
 * repeats redrawn) from the stream st into p. */
static void draw_route(const tdesc *d, uint32_t E, uint64_t *st, int32_t *p)
{
    uint32_t Eu = (uint32_t)d->ne[0];
    for (size_t v = 0; v < d->ne[1]; v++)
        for (uint32_t j = 0; j < Eu; j++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)(splitmix(st) % E);
                dup = false;
                for (uint32_t k = 0; k < j; k++) dup |= p[v * Eu + k] == e;
            } while (dup);
            p[v * Eu + j] = e;
        }
}

/* The next n values of tensor d from the stream st into p, in storage
 * order: a tensor drawn in pieces gets the values it gets drawn at once. */
static void draw_values(const tdesc *d, uint64_t *st, float *p, size_t n)
{
    double scale = d->init == INIT_MAT ? 1.0 / sqrt((double)d->ne[0]) : d->init == INIT_SMALL ? 0.02 : 1.0;
    for (size_t j = 0; j < n; j++) {
        if (d->init == INIT_ONE) p[j] = 1.0f;
        else if (d->init == INIT_ZERO) p[j] = 0.0f;
        else {
            double u = (double)(splitmix(st) >> 11) * (1.0 / 9007199254740992.0);
            p[j] = (float)((2.0 * u - 1.0) * scale);
        }
    }
}

static int generate(ds4_weights *w)
{
    tdesc *t = kvt_malloc(MAX_TENSORS * sizeof *t);
    if (!t) return KVT_ENOMEM;
    size_t n = ds4_tensors(w, t);
    uint64_t st = w->seed;
    for (size_t i = 0; i < n; i++) {
        size_t cnt = tcount(&t[i]);
        if (t[i].opt) continue; /* the presets have none */
        if (t[i].init == INIT_ROUTE) {
            int32_t *p = kvt_malloc(cnt * sizeof(int32_t));
            if (!p) { free(t); return KVT_ENOMEM; }
            *t[i].islot = p;
            draw_route(&t[i], w->c.E, &st, p);
            continue;
        }
        float *p = kvt_malloc(cnt * sizeof(float));
        if (!p) { free(t); return KVT_ENOMEM; }
        if (!t[i].mat) *t[i].slot = p;
        else if (own_mat(w, &t[i], p)) { free(p); free(t); return KVT_ENOMEM; }
        draw_values(&t[i], &st, p, cnt);
    }
    free(t);
    return KVT_OK;
}

/* Presets whose weights in f32 exceed this are written to a file by
 * kvt_ds4_write_preset instead of built in memory. */
#define PRESET_MAX_F32 (4ull << 30)

static int ds4_preset(kvt_model *m, const char *preset, uint64_t seed, kvt_tokenizer *tok)
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
    if (!rc && config_params(w) * 4 > PRESET_MAX_F32)
        rc = kvt_fail(KVT_EUNSUPPORTED,
                      "ds4: preset '%s' has %llu parameters, %.1f GiB in f32: too large to build in memory; "
                      "write it with `kvtier model new --preset %s --type q8_0 --out FILE` and open the file",
                      preset, (unsigned long long)config_params(w), config_params(w) * 4.0 / (1u << 30), preset);
    if (!rc) rc = generate(w);
    if (rc) { ds4_free(w); return rc; }
    m->weights = w;
    m->tok = tok;
    fill_info(m, w);
    return KVT_OK;
}

/* ---- GGUF: llama.cpp's deepseek4 layout ---- */

static void key_name(char *k, size_t len, const char *key) { snprintf(k, len, "deepseek4.%s", key); }

static int dsv4_u32(const kvt_gguf *g, const char *key, uint32_t *v)
{
    char k[96];
    key_name(k, sizeof k, key);
    int rc = kvt_gguf_get_u32(g, k, v);
    if (rc == KVT_ENOENT) return kvt_fail(KVT_EFORMAT, "deepseek4: missing metadata key %s", k);
    if (!rc) return KVT_OK;
    char msg[256];
    snprintf(msg, sizeof msg, "%s", kvt_errmsg());
    return kvt_fail(rc, "deepseek4: %s: %s", k, msg);
}

static int dsv4_f32(const kvt_gguf *g, const char *key, float *v, bool need)
{
    char k[96];
    key_name(k, sizeof k, key);
    int rc = kvt_gguf_get_f32(g, k, v);
    if (rc == KVT_ENOENT && !need) return KVT_OK;
    if (rc == KVT_ENOENT) return kvt_fail(KVT_EFORMAT, "deepseek4: missing metadata key %s", k);
    return rc ? kvt_fail(rc, "deepseek4: %s is not a float", k) : KVT_OK;
}

/* A key that may be one value or one per layer (at least L entries): every
 * layer's value into v[0..L), or the first layer's when L is 1 and v one. */
static int dsv4_u32_or_arr(const kvt_gguf *g, const char *key, uint32_t L, uint32_t *v)
{
    char k[96];
    key_name(k, sizeof k, key);
    const kvt_gguf_val *a = kvt_gguf_get(g, k);
    if (!a || a->type != KVT_GGUF_ARR) return dsv4_u32(g, key, v);
    if (a->n < L || (a->elem_type != KVT_GGUF_U32 && a->elem_type != KVT_GGUF_I32) || a->v.arr[0].v.i < 0)
        return kvt_fail(KVT_EFORMAT, "deepseek4: %s: an array of %llu for %u layers", k,
                        (unsigned long long)a->n, L);
    for (uint32_t l = 1; l < L; l++)
        if (a->v.arr[l].v.u != a->v.arr[0].v.u)
            return kvt_fail(KVT_EUNSUPPORTED, "deepseek4: %s differs between layers", k);
    *v = (uint32_t)a->v.arr[0].v.u;
    return KVT_OK;
}

static int dsv4_f32_arr(const kvt_gguf *g, const char *key, uint32_t L, float *v, bool need, const float *dflt)
{
    char k[96];
    key_name(k, sizeof k, key);
    const kvt_gguf_val *a = kvt_gguf_get(g, k);
    if (!a) {
        if (need) return kvt_fail(KVT_EFORMAT, "deepseek4: missing metadata key %s", k);
        for (uint32_t l = 0; l < L; l++) v[l] = dflt[l];
        return KVT_OK;
    }
    if (a->type == KVT_GGUF_F32) {
        for (uint32_t l = 0; l < L; l++) v[l] = (float)a->v.f;
        return KVT_OK;
    }
    if (a->type == KVT_GGUF_F64) { /* ds4.c's reader takes f64 as well */
        for (uint32_t l = 0; l < L; l++) v[l] = (float)a->v.f;
        return KVT_OK;
    }
    if (a->type != KVT_GGUF_ARR || (a->elem_type != KVT_GGUF_F32 && a->elem_type != KVT_GGUF_F64) || a->n < L)
        return kvt_fail(KVT_EFORMAT, "deepseek4: %s is not a float or %u floats", k, L);
    for (uint32_t l = 0; l < L; l++) v[l] = (float)a->v.arr[l].v.f;
    return KVT_OK;
}

/* The two writers of deepseek4 files: llama.cpp's converter and ds4.c's
 * own quantiser (antirez/ds4, gguf-tools/deepseek4-quantize.c, which copies
 * a template file's metadata and tensor order) use the same tensor names,
 * the same merged 3-D expert tensors and the same keys; ds4.c's reader
 * (ds4.c, config_validate_model) also requires keys llama.cpp's deepseek4
 * loader does not read. Each is checked here against what kvtier computes
 * with, so a file that says otherwise is refused rather than misread. */
enum key_check { KEY_VOCAB, KEY_EQUALS, KEY_AT_MOST };
static const struct {
    const char *key;
    enum key_check check;
    double want;
    const char *why;
} layout_keys[] = {
    {"vocab_size", KEY_VOCAB, 0, "the tokenizer's length"},
    {"rope.scaling.yarn_beta_fast", KEY_EQUALS, 32, "YaRN's fast correction (llama.cpp's deepseek4: 32)"},
    {"rope.scaling.yarn_beta_slow", KEY_EQUALS, 1, "YaRN's slow correction (llama.cpp's deepseek4: 1)"},
    {"expert_group_count", KEY_AT_MOST, 1, "expert groups (kvtier routes without groups)"},
    {"expert_group_used_count", KEY_AT_MOST, 1, "expert groups used (kvtier routes without groups)"},
};

/* The keys of layout_keys a file has, against c (V known). */
static int check_layout_keys(const kvt_gguf *g, const ds4_config *c)
{
    for (size_t i = 0; i < sizeof layout_keys / sizeof layout_keys[0]; i++) {
        char k[96];
        key_name(k, sizeof k, layout_keys[i].key);
        const kvt_gguf_val *v = kvt_gguf_get(g, k);
        if (!v) continue;
        double x;
        if (v->type == KVT_GGUF_F32 || v->type == KVT_GGUF_F64) x = v->v.f;
        else if (v->type == KVT_GGUF_U8 || v->type == KVT_GGUF_U16 || v->type == KVT_GGUF_U32 || v->type == KVT_GGUF_U64)
            x = (double)v->v.u;
        else if (v->type == KVT_GGUF_I8 || v->type == KVT_GGUF_I16 || v->type == KVT_GGUF_I32 || v->type == KVT_GGUF_I64)
            x = (double)v->v.i;
        else
            return kvt_fail(KVT_EFORMAT, "deepseek4: %s is not a number", k);
        double want = layout_keys[i].check == KEY_VOCAB ? (double)c->V : layout_keys[i].want;
        bool ok = layout_keys[i].check == KEY_AT_MOST ? x <= want : x == want;
        if (!ok)
            return kvt_fail(layout_keys[i].check == KEY_VOCAB ? KVT_EFORMAT : KVT_EUNSUPPORTED,
                            "deepseek4: %s is %g, %s %g (%s)", k, x,
                            layout_keys[i].check == KEY_AT_MOST ? "kvtier computes with at most" : "kvtier computes with",
                            want, layout_keys[i].why);
    }
    return KVT_OK;
}

/* The configuration of a deepseek4 file, from its metadata alone. V is the
 * vocabulary's length. */
static int read_config(const kvt_gguf *g, ds4_config *c)
{
    memset(c, 0, sizeof *c);
    uint32_t Dv = 0, hc = 0, n_all = 0, hkv = 1, gating = 0;
    int rc;
    if ((rc = dsv4_u32(g, "block_count", &n_all)) || (rc = dsv4_u32(g, "embedding_length", &c->D)) ||
        (rc = dsv4_u32(g, "context_length", &c->ctx)) || (rc = dsv4_u32(g, "attention.head_count", &c->H)) ||
        (rc = dsv4_u32(g, "attention.key_length", &c->Dh)) || (rc = dsv4_u32(g, "attention.value_length", &Dv)) ||
        (rc = dsv4_u32(g, "rope.dimension_count", &c->Dr)) || (rc = dsv4_u32(g, "attention.q_lora_rank", &c->Rq)) ||
        (rc = dsv4_u32(g, "attention.sliding_window", &c->W)) ||
        (rc = dsv4_u32(g, "attention.indexer.head_count", &c->Hi)) ||
        (rc = dsv4_u32(g, "attention.indexer.key_length", &c->Di)) ||
        (rc = dsv4_u32(g, "attention.indexer.top_k", &c->K)) || (rc = dsv4_u32(g, "hyper_connection.count", &hc)) ||
        (rc = dsv4_u32(g, "hyper_connection.sinkhorn_iterations", &c->iters)) ||
        (rc = dsv4_u32(g, "expert_count", &c->E)) || (rc = dsv4_u32(g, "expert_shared_count", &c->Es)) ||
        (rc = dsv4_u32(g, "hash_layer_count", &c->n_hash)) ||
        (rc = dsv4_u32(g, "attention.output_group_count", &c->og)) ||
        (rc = dsv4_u32(g, "attention.output_lora_rank", &c->orank)) ||
        (rc = dsv4_u32(g, "expert_gating_func", &gating)))
        return rc;
    if (n_all == 0 || n_all > MAX_LAYERS + 1)
        return kvt_fail(KVT_EFORMAT, "deepseek4: block_count %u out of range [1, %d]", n_all, MAX_LAYERS);
    if (kvt_gguf_get_u32(g, "deepseek4.nextn_predict_layers", &c->nextn) == KVT_OK && c->nextn >= n_all)
        return kvt_fail(KVT_EFORMAT, "deepseek4: %u prediction layers of %u", c->nextn, n_all);
    if (c->nextn) {
        /* as llama.cpp: without the first prediction layer's tensors the
         * key is ignored and every block is a decoding layer */
        char probe[64];
        snprintf(probe, sizeof probe, "blk.%u.nextn.eh_proj.weight", n_all - c->nextn);
        if (!kvt_gguf_find_tensor(g, probe)) c->nextn = 0;
    }
    c->L = n_all - c->nextn;
    if (c->L > MAX_LAYERS)
        return kvt_fail(KVT_EFORMAT, "deepseek4: %u layers (at most %d)", c->L, MAX_LAYERS);
    if ((rc = dsv4_u32_or_arr(g, "expert_used_count", c->L, &c->Eu)) ||
        (rc = dsv4_u32_or_arr(g, "expert_feed_forward_length", c->L, &c->Fe)))
        return rc;
    if (kvt_gguf_get(g, "deepseek4.attention.head_count_kv") && (rc = dsv4_u32(g, "attention.head_count_kv", &hkv)))
        return rc;
    if ((rc = dsv4_f32(g, "attention.layer_norm_rms_epsilon", &c->eps, true)) ||
        (rc = dsv4_f32(g, "hyper_connection.epsilon", &c->hc_eps, true)) ||
        (rc = dsv4_f32(g, "attention.compress_rope_freq_base", &c->cbase, true)) ||
        (rc = dsv4_f32(g, "expert_weights_scale", &c->wscale, true)))
        return rc;
    c->base = 10000.0f;
    if ((rc = dsv4_f32(g, "rope.freq_base", &c->base, false))) return rc;
    if ((rc = kvt_gguf_get_bool(g, "deepseek4.expert_weights_norm", &c->wnorm)) != KVT_OK)
        return kvt_fail(KVT_EFORMAT, "deepseek4: expert_weights_norm missing or not a bool");
    float zero[MAX_LAYERS] = {0};
    if ((rc = dsv4_f32_arr(g, "swiglu_clamp_exp", c->L, c->clamp_exp, true, zero)) ||
        (rc = dsv4_f32_arr(g, "swiglu_clamp_shexp", c->L, c->clamp_sh, false, c->clamp_exp)))
        return rc;
    if (c->nextn) { /* the MTP layer's: its entry when the arrays have one, else the last layer's */
        float e[MAX_LAYERS + 1], sh[MAX_LAYERS + 1];
        bool has = dsv4_f32_arr(g, "swiglu_clamp_exp", c->L + 1, e, true, zero) == KVT_OK &&
                   dsv4_f32_arr(g, "swiglu_clamp_shexp", c->L + 1, sh, false, e) == KVT_OK;
        c->clamp_exp[c->L] = has ? e[c->L] : c->clamp_exp[c->L - 1];
        c->clamp_sh[c->L] = has ? sh[c->L] : c->clamp_sh[c->L - 1];
    }
    /* llama.cpp's reading: the type defaults to linear, a missing factor
     * is no scaling, and only compressed layers scale */
    const char *st = "linear";
    size_t sl = 6;
    if (kvt_gguf_get(g, "deepseek4.rope.scaling.type") &&
        kvt_gguf_get_str(g, "deepseek4.rope.scaling.type", &st, &sl) != KVT_OK)
        return kvt_fail(KVT_EFORMAT, "deepseek4: rope.scaling.type is not a string");
    if (sl == 4 && !memcmp(st, "yarn", 4)) c->scaling = SCALE_YARN;
    else if (sl == 6 && !memcmp(st, "linear", 6)) c->scaling = SCALE_LINEAR;
    else if (sl == 4 && !memcmp(st, "none", 4)) c->scaling = SCALE_NONE;
    else
        return kvt_fail(KVT_EUNSUPPORTED, "deepseek4: rope scaling '%.*s' (yarn, linear or none)",
                        (int)(sl > 32 ? 32 : sl), st);
    if ((rc = dsv4_f32(g, "rope.scaling.factor", &c->yarn_factor, false))) return rc;
    if (!(c->yarn_factor > 0)) c->yarn_factor = 0, c->scaling = SCALE_NONE;
    c->yarn_orig = c->ctx;
    if (kvt_gguf_get(g, "deepseek4.rope.scaling.original_context_length") &&
        (rc = dsv4_u32(g, "rope.scaling.original_context_length", &c->yarn_orig)))
        return rc;
    if (hc != HC || Dv != c->Dh || hkv != 1 || gating != 4)
        return kvt_fail(KVT_EFORMAT,
                        "deepseek4: inconsistent shape (hyper-connection streams %u, not 4; key/value length %u/%u; "
                        "KV heads %u, not 1; gating function %u, not 4 = sqrt-softplus)", hc, c->Dh, Dv, hkv, gating);
    const kvt_gguf_val *ra = kvt_gguf_get(g, "deepseek4.attention.compress_ratios");
    if (!ra || ra->type != KVT_GGUF_ARR || (ra->elem_type != KVT_GGUF_I32 && ra->elem_type != KVT_GGUF_U32))
        return kvt_fail(KVT_EFORMAT, "deepseek4: attention.compress_ratios missing or not an integer array");
    if (ra->n < c->L)
        return kvt_fail(KVT_EFORMAT, "deepseek4: %llu compress ratios for %u layers", (unsigned long long)ra->n, c->L);
    for (uint32_t l = 0; l < c->L; l++) {
        int64_t r = ra->elem_type == KVT_GGUF_I32 ? ra->v.arr[l].v.i : (int64_t)ra->v.arr[l].v.u;
        if (r != 0 && r != 4 && r != 128)
            return kvt_fail(KVT_EFORMAT, "deepseek4: layer %u has compression ratio %lld (0, 4 or 128)", l, (long long)r);
        c->ratio[l] = (uint32_t)r;
    }
    const kvt_gguf_val *toks = kvt_gguf_get(g, "tokenizer.ggml.tokens");
    const kvt_gguf_tensor *emb = kvt_gguf_find_tensor(g, "token_embd.weight");
    c->V = toks && toks->type == KVT_GGUF_ARR ? (uint32_t)(toks->n > UINT32_MAX ? UINT32_MAX : toks->n)
           : emb && emb->n_dims == 2 && emb->ne[1] <= UINT32_MAX ? (uint32_t)emb->ne[1] : 0;
    if (emb && emb->n_dims == 2 && emb->ne[1] != c->V)
        return kvt_fail(KVT_EFORMAT, "deepseek4: %u tokens, an embedding of %llu rows", c->V,
                        (unsigned long long)emb->ne[1]);
    return check_layout_keys(g, c);
}

/* Tensor d of the table from g, where g names it name: exactly the
 * table's shape, in place or converted to f32. */
static int load_named(ds4_weights *w, const kvt_gguf *g, const tdesc *d, const char *name)
{
    const kvt_gguf_tensor *t = kvt_gguf_find_tensor(g, name);
    if (!t && d->opt) return KVT_OK; /* the model's stands in */
    if (!t) return kvt_fail(KVT_EFORMAT, "deepseek4: missing tensor %s", name);
    bool shape = t->n_dims == d->nd;
    for (uint32_t i = 0; i < 3; i++) shape &= t->ne[i] == (i < d->nd ? d->ne[i] : 1);
    if (!shape)
        return kvt_fail(KVT_EFORMAT, "deepseek4: tensor %s has shape (%llu, %llu, %llu), expected (%llu, %llu, %llu)",
                        name, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
                        (unsigned long long)t->ne[2], (unsigned long long)d->ne[0], (unsigned long long)d->ne[1],
                        (unsigned long long)d->ne[2]);
    size_t n = tcount(d);
    if (d->init == INIT_ROUTE) {
        if (t->type != GGML_I32 || t->n_bytes != n * 4 || !t->data)
            return kvt_fail(KVT_EFORMAT, "deepseek4: %s is not an I32 table", name);
        int32_t *p = kvt_malloc(n * sizeof *p);
        if (!p) return KVT_ENOMEM;
        memcpy(p, t->data, n * 4);
        *d->islot = p;
        return KVT_OK;
    }
    if (d->mat) {
        /* in place when kvtier computes with the type (the reader checked
         * that the bytes lie in the file) */
        size_t rows = (size_t)(d->ne[1] * d->ne[2]), row = kvt_quant_row_bytes(t->type, d->ne[0]);
        if (row && t->data && row * rows == t->n_bytes) {
            *d->mat = (kvt_wmat){t->data, t->type, rows, (size_t)d->ne[0], row, NULL};
            return KVT_OK;
        }
    }
    float *p = kvt_malloc(n * sizeof *p);
    if (!p) return KVT_ENOMEM;
    int rc = kvt_gguf_tensor_to_f32(t, p, n);
    if (!rc && d->mat) rc = own_mat(w, d, p);
    else if (!rc) *d->slot = p;
    if (rc) free(p);
    return rc;
}

/* A tensor of the model's file (one ds4.c's file alone has: not there). */
static int load_tensor(ds4_weights *w, const kvt_gguf *g, const tdesc *d)
{
    return d->opt == OPT_DS4C ? KVT_OK : load_named(w, g, d, d->name);
}

static int ds4_load(kvt_model *m, const kvt_gguf *g)
{
    ds4_weights *w = kvt_calloc(1, sizeof *w);
    if (!w) return KVT_ENOMEM;
    ds4_config *c = &w->c;
    int rc = read_config(g, c);
    uint64_t sv = 0;
    const kvt_gguf_val *sd = kvt_gguf_get(g, "kvtier.seed");
    if (sd && sd->type == KVT_GGUF_U64) sv = sd->v.u;
    w->seed = sv;
    if (!rc) rc = finish_config(w);
    tdesc *t = rc ? NULL : kvt_malloc(MAX_TENSORS * sizeof *t);
    if (!rc && !t) rc = KVT_ENOMEM;
    if (rc) goto fail;
    size_t n = ds4_tensors(w, t);
    for (size_t i = 0; i < n && !rc; i++) rc = load_tensor(w, g, &t[i]);
    free(t);
    if (rc) goto fail;
    for (uint32_t l = 0; l < c->n_hash; l++)
        for (size_t i = 0; i < (size_t)c->V * c->Eu; i++)
            if (w->layers[l].tid2eid[i] < 0 || (uint32_t)w->layers[l].tid2eid[i] >= c->E) {
                rc = kvt_fail(KVT_EFORMAT, "deepseek4: layer %u routes a token to expert %d of %u", l,
                              w->layers[l].tid2eid[i], c->E);
                goto fail;
            }
    m->weights = w;
    fill_info(m, w);
    return KVT_OK;
fail:
    ds4_free(w);
    return rc;
}

/* The metadata of a deepseek4 file of configuration c (llama.cpp's keys,
 * docs/ds4.md) with the tokenizer, into gw. */
static int write_meta(kvt_gguf_writer *gw, const ds4_config *c, const char *name, uint64_t seed_v,
                      const kvt_tokenizer *tok)
{
    uint32_t n_all = c->L + c->nextn; /* the MTP layer after the model's */
    kvt_gguf_val *ra = kvt_calloc(n_all, sizeof *ra), *ce = kvt_calloc(n_all, sizeof *ce),
                 *cs = kvt_calloc(n_all, sizeof *cs);
    int rc = KVT_ENOMEM;
    if (!ra || !ce || !cs) goto done;
    for (uint32_t l = 0; l < n_all; l++) {
        ra[l] = (kvt_gguf_val){.type = KVT_GGUF_I32, .v.i = c->ratio[l]};
        ce[l] = (kvt_gguf_val){.type = KVT_GGUF_F32, .v.f = c->clamp_exp[l]};
        cs[l] = (kvt_gguf_val){.type = KVT_GGUF_F32, .v.f = c->clamp_sh[l]};
    }
    kvt_gguf_val rv = {.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_I32, .n = n_all, .v.arr = ra};
    kvt_gguf_val cev = {.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_F32, .n = n_all, .v.arr = ce};
    kvt_gguf_val csv = {.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_F32, .n = n_all, .v.arr = cs};
    kvt_gguf_val seed = {.type = KVT_GGUF_U64, .v.u = seed_v};
    struct { const char *k; uint32_t v; } u[] = {
        {"context_length", c->ctx}, {"embedding_length", c->D}, {"block_count", n_all},
        {"nextn_predict_layers", c->nextn},
        {"attention.head_count", c->H}, {"attention.head_count_kv", 1}, {"attention.key_length", c->Dh},
        {"attention.value_length", c->Dh}, {"rope.dimension_count", c->Dr}, {"attention.q_lora_rank", c->Rq},
        {"attention.sliding_window", c->W}, {"expert_feed_forward_length", c->Fe}, {"expert_count", c->E},
        {"expert_used_count", c->Eu}, {"expert_shared_count", c->Es}, {"expert_gating_func", 4},
        {"attention.indexer.head_count", c->Hi}, {"attention.indexer.key_length", c->Di},
        {"attention.indexer.top_k", c->K}, {"attention.output_group_count", c->og},
        {"attention.output_lora_rank", c->orank}, {"hyper_connection.count", HC},
        {"hyper_connection.sinkhorn_iterations", c->iters}, {"hash_layer_count", c->n_hash},
        {"embedding_length_out", HC * c->D}, {"rope.scaling.original_context_length", c->yarn_orig},
    };
    struct { const char *k; float v; } f[] = {
        {"rope.freq_base", c->base}, {"attention.layer_norm_rms_epsilon", c->eps},
        {"expert_weights_scale", c->wscale}, {"attention.compress_rope_freq_base", c->cbase},
        {"hyper_connection.epsilon", c->hc_eps}, {"rope.scaling.factor", c->yarn_factor},
    };
    char k[96];
    if ((rc = kvt_gguf_writer_set_str(gw, "general.architecture", "deepseek4")) ||
        (rc = kvt_gguf_writer_set_str(gw, "general.name", name)) ||
        (rc = kvt_gguf_writer_set(gw, "kvtier.seed", &seed)))
        goto done;
    for (size_t i = 0; i < sizeof u / sizeof u[0] && !rc; i++) {
        key_name(k, sizeof k, u[i].k);
        rc = kvt_gguf_writer_set_u32(gw, k, u[i].v);
    }
    for (size_t i = 0; i < sizeof f / sizeof f[0] && !rc; i++) {
        key_name(k, sizeof k, f[i].k);
        rc = kvt_gguf_writer_set_f32(gw, k, f[i].v);
    }
    if (rc || (rc = kvt_gguf_writer_set_bool(gw, "deepseek4.expert_weights_norm", c->wnorm)) ||
        (rc = kvt_gguf_writer_set_str(gw, "deepseek4.rope.scaling.type",
                                      c->scaling == SCALE_YARN ? "yarn" : c->scaling == SCALE_LINEAR ? "linear" : "none")) ||
        (rc = kvt_gguf_writer_set(gw, "deepseek4.attention.compress_ratios", &rv)) ||
        (rc = kvt_gguf_writer_set(gw, "deepseek4.swiglu_clamp_exp", &cev)) ||
        (rc = kvt_gguf_writer_set(gw, "deepseek4.swiglu_clamp_shexp", &csv)))
        goto done;
    rc = kvt_tokenizer_to_gguf(tok, gw);
done:
    free(ra);
    free(ce);
    free(cs);
    return rc;
}

/* Tensor d added to gw under name, its data v when given (f32 values),
 * else its matrix's or vector's own. */
static int add_tensor(kvt_gguf_writer *gw, const char *name, const tdesc *d, const float *v)
{
    bool route = d->init == INIT_ROUTE;
    const kvt_wmat *mt = d->mat;
    const void *data = v ? (const void *)v : mt ? (const void *)mt->data : route ? (const void *)*d->islot
                                                                               : (const void *)*d->slot;
    uint32_t type = mt ? mt->type : route ? GGML_I32 : KVT_GGML_F32;
    return kvt_gguf_writer_add_tensor(gw, name, type, d->nd, d->ne, data, mt ? mt->rows * mt->row_bytes : tcount(d) * 4);
}

int kvt_ds4_write_gguf(const kvt_model *m, const char *path)
{
    if (m->arch != &kvt_arch_ds4) return kvt_fail(KVT_EINVAL, "not a ds4 model");
    ds4_weights *w = m->weights;
    const ds4_config *c = &w->c;
    kvt_gguf_writer *gw = kvt_gguf_writer_new();
    tdesc *t = kvt_malloc(MAX_TENSORS * sizeof *t);
    int rc = KVT_ENOMEM;
    if (!gw || !t || (rc = write_meta(gw, c, m->info.name, w->seed, m->tok))) goto done;
    size_t n = ds4_tensors(w, t);
    for (size_t i = 0; i < n && !rc; i++) {
        if (absent(&t[i]) || t[i].opt == OPT_DS4C) continue; /* llama.cpp's layout has no place for the latter */
        rc = add_tensor(gw, t[i].name, &t[i], NULL);
    }
    if (!rc) rc = kvt_gguf_writer_write(gw, path);
done:
    free(t);
    kvt_gguf_writer_free(gw);
    return rc;
}

/* Append tensor d's values, drawn from st and stored as type, to f, then
 * the zeros up to the file's alignment (32). Rows at a time: an expert
 * tensor of Flash's shape is 2^31 values. */
static int stream_tensor(FILE *f, const tdesc *d, uint32_t type, uint32_t E, uint64_t *st, float *buf,
                         uint8_t *qbuf, size_t chunk)
{
    size_t cnt = tcount(d), bytes;
    if (d->init == INIT_ROUTE) {
        int32_t *p = kvt_malloc(cnt * sizeof *p);
        if (!p) return KVT_ENOMEM;
        draw_route(d, E, st, p);
        bool ok = fwrite(p, 4, cnt, f) == cnt;
        free(p);
        if (!ok) return kvt_fail(KVT_EIO, "ds4: cannot write %s", d->name);
        bytes = cnt * 4;
    } else {
        size_t row = (size_t)d->ne[0], step = chunk / row * row;
        if (!step) step = row; /* chunk is at least one row: checked by the caller */
        bytes = kvt_ggml_type_size(type, cnt);
        for (size_t at = 0; at < cnt; at += step) {
            size_t k = cnt - at < step ? cnt - at : step, qb = kvt_ggml_type_size(type, k);
            draw_values(d, st, buf, k);
            int rc = kvt_quant_from_f32(type, buf, qbuf, k);
            if (rc) return rc;
            if (fwrite(qbuf, 1, qb, f) != qb) return kvt_fail(KVT_EIO, "ds4: cannot write %s", d->name);
        }
    }
    static const uint8_t zero[32];
    size_t pad = (32 - bytes % 32) % 32;
    return fwrite(zero, 1, pad, f) == pad ? KVT_OK : kvt_fail(KVT_EIO, "ds4: cannot write %s", d->name);
}

int kvt_ds4_write_preset(const char *preset, uint64_t seed, const kvt_tokenizer *tok, uint32_t type,
                         const char *path)
{
    if (type != KVT_GGML_F32 && type != KVT_GGML_F16 && type != KVT_GGML_Q8_0)
        return kvt_fail(KVT_EUNSUPPORTED, "ds4: synthetic weights are written as f32, f16 or q8_0");
    ds4_weights *w = kvt_calloc(1, sizeof *w);
    tdesc *t = kvt_malloc(MAX_TENSORS * sizeof *t);
    kvt_gguf_writer *gw = kvt_gguf_writer_new();
    size_t tlen = strlen(path) + 32, chunk = (size_t)1 << 20;
    char *tmp = kvt_malloc(tlen);
    float *buf = NULL;
    uint8_t *qbuf = NULL;
    FILE *f = NULL;
    int rc = KVT_ENOMEM;
    if (!w || !t || !gw || !tmp) goto done;
    if (!preset_config(preset, &w->c)) {
        rc = kvt_fail(KVT_ENOENT, "no ds4 preset '%s'", preset);
        goto done;
    }
    w->c.V = kvt_tokenizer_n_vocab(tok);
    w->seed = seed;
    if ((rc = finish_config(w)) || (rc = write_meta(gw, &w->c, preset, seed, tok))) goto done;
    size_t n = ds4_tensors(w, t);
    for (size_t i = 0; i < n && !rc; i++) {
        if (t[i].opt) continue; /* the presets have none */
        uint32_t ty = t[i].init == INIT_ROUTE ? GGML_I32 : t[i].mat ? type : KVT_GGML_F32;
        size_t bytes = kvt_ggml_type_size(ty, tcount(&t[i]));
        if (t[i].ne[0] > chunk) chunk = (size_t)t[i].ne[0];
        if (!bytes || (ty == KVT_GGML_Q8_0 && t[i].ne[0] % 32))
            rc = kvt_fail(KVT_EUNSUPPORTED, "ds4: %s of width %llu cannot be stored as %s", t[i].name,
                          (unsigned long long)t[i].ne[0], kvt_quant_name(ty));
        else
            rc = kvt_gguf_writer_add_tensor(gw, t[i].name, ty, t[i].nd, t[i].ne, NULL, bytes);
    }
    /* the header alone, then the tensors appended in the order it lists
     * them, each padded to the alignment as the writer pads them */
    snprintf(tmp, tlen, "%s.part.%ld", path, (long)getpid());
    if (rc || (rc = kvt_gguf_writer_write(gw, tmp))) goto done;
    buf = kvt_malloc(chunk * sizeof *buf);
    qbuf = kvt_malloc(chunk * 4);
    if (!buf || !qbuf) { rc = KVT_ENOMEM; goto done; }
    if (!(f = fopen(tmp, "ab"))) { rc = kvt_fail(KVT_EIO, "ds4: cannot append to %s: %s", tmp, strerror(errno)); goto done; }
    uint64_t st = seed;
    for (size_t i = 0; i < n && !rc; i++)
        if (!t[i].opt) rc = stream_tensor(f, &t[i], t[i].init == INIT_ROUTE ? GGML_I32 : t[i].mat ? type : KVT_GGML_F32, w->c.E,
                           &st, buf, qbuf, chunk);
    if (!rc && (fflush(f) || fsync(fileno(f)))) rc = kvt_fail(KVT_EIO, "ds4: cannot write %s: %s", tmp, strerror(errno));
    if (fclose(f) && !rc) rc = kvt_fail(KVT_EIO, "ds4: cannot close %s", tmp);
    f = NULL;
    if (!rc && rename(tmp, path)) rc = kvt_fail(KVT_EIO, "ds4: cannot rename %s to %s: %s", tmp, path, strerror(errno));
done:
    if (rc && tmp) unlink(tmp);
    free(buf);
    free(qbuf);
    free(tmp);
    free(t);
    free(w);
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
    uint32_t u[] = {c->V, c->D, c->L, c->H, c->Dh, c->Dr, c->Rq, c->W, c->Hi, c->Di, c->K, c->ctx, c->E, c->Eu,
                    c->Es, c->Fe, c->iters, c->n_hash, c->og, c->orank, c->yarn_orig, c->wnorm, c->scaling};
    float f[] = {c->eps, c->hc_eps, c->base, c->cbase, c->wscale, c->yarn_factor};
    XXH3_64bits_update(st, "deepseek4", 9);
    XXH3_64bits_update(st, u, sizeof u);
    XXH3_64bits_update(st, f, sizeof f);
    XXH3_64bits_update(st, c->ratio, c->L * 4);
    XXH3_64bits_update(st, c->clamp_exp, c->L * 4);
    XXH3_64bits_update(st, c->clamp_sh, c->L * 4);
    tdesc *t = malloc(MAX_TENSORS * sizeof *t);
    if (t) {
        size_t n = ds4_tensors((ds4_weights *)w, t);
        for (size_t i = 0; i < n; i++) {
            const kvt_wmat *mt = t[i].mat;
            if (absent(&t[i])) continue;
            if (mt) kvt_tensor_hash(st, mt);
            else XXH3_64bits_update(st, t[i].slot ? (const void *)*t[i].slot : (const void *)*t[i].islot,
                                    tcount(&t[i]) * 4);
        }
        free(t);
    }
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
static void emit_row(const kvt_cache *cache, size_t off, uint32_t r, size_t d, size_t t, const float *norm_w,
                     float eps, size_t n_rot, float base, const kvt_yarn *y, size_t had, float *p, uint16_t *out)
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
    kvt_rope_ext(p + d - n_rot, n_rot, first, base, y, 1.0f);
    for (size_t j = 0; had && j < d; j += had) kvt_hadamard(p + j, had);
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
    float *x;          /* (ch, 4, D) the residual's hyper-connection streams */
    float *xn;         /* (ch, 4, D) the streams normed; then the next streams */
    float *mix;        /* (ch, 24) hyper-connection mixes */
    float *hc;         /* (ch, 24) per token pre (4), post (4), comb (16: [src][dst]) */
    float *h;          /* (ch, D) normed input */
    float *qr;         /* (ch, Rq) */
    float *q;          /* (ch, H*Dh) */
    float *kv;         /* (ch, Dh) */
    uint16_t *rows;    /* (ch, Dh) binary16 raw rows */
    float *ckv, *csc;  /* (ch, 2*max(Dh, Di)) compressor inputs and scores */
    float *iq;         /* (ch, Hi*Di) */
    float *iw;         /* (ch, Hi) */
    float *att;        /* (ch, H*Dh) */
    float *og;         /* (ch, H*Dh/og + 2*og*orank) one output group's inputs, the low-rank outputs, a group's */
    float *f1, *f3;    /* (ch, Fe * max(Es, Eu)): the shared experts, or one expert's tokens */
    float *lg;         /* (ch, E) router logits, then probabilities */
    uint32_t *ex;      /* (ch, Eu) each token's experts, in routing order */
    float *ew;         /* (ch, Eu) their weights */
    float *eo;         /* (ch, Eu, D) their outputs */
    uint32_t *rt;      /* (ch, Eu) the (token, slot) pairs one expert runs on */
    float *xe;         /* (ch, Eu, D) their inputs */
    float *tmp;        /* (ch, max(D, H*Dh, 24)) */
    uint8_t *qx;       /* a matmul's activations quantised for an integer-type matrix (qkernels.h); NULL: none */
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
    /* the tap: x holds the final streams of the tokens tap_tok (tap_n of
     * them, from tap_pos0) of session tap_s's last pass (NULL: none) */
    const kvt_session *tap_s;
    size_t tap_pos0, tap_n;
    int32_t *tap_tok;  /* (ch) */
    int32_t *tok;      /* (ch) the pass's token ids, its segments' one after another */
    size_t *pos;       /* (ch) their RoPE positions */
    float *lgb;        /* (lgb_rows, V) a batched pass's logits, before each segment takes its own; made on demand */
    size_t lgb_rows;
} ds4_work;

typedef struct fwd {
    kvt_pool *pool;
    kvt_session *s;
    const kvt_cache *cache;    /* the window rings' (the session's, or the MTP drafter's ring) */
    size_t w_first;            /* the window's first position with a row (the MTP layer's: 1) */
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
_Atomic size_t kvt_ds4_batch_passes;

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
        const kvt_forced *fz = kvt_force;
        if (fz && t < fz->n && fz->K == c->K && fz->sel[f->l])
            kvt_moe_force_choice(fz->sel[f->l], fz->sel_gap[f->l], t, wk->sel + i * c->K, c->K, isc, ncomp, true);
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
        kvt_matmul(f->pool, wk->dots, wk->kI, f->iq + i0 * Hi * Di, ns * Hi, Di, maxc);
        f->dots = wk->dots;
        f->i_base = i0;
        kvt_pool_for_part(f->pool, ns, 1, select_range, f);
    }
}

static void attn_range(void *arg, uint32_t part, size_t i0, size_t i1)
{
    fwd *f = arg;
    const ds4_config *c = &f->w->c;
    const ds4_layer *ly = f->ly;
    const kvt_cache *cache = f->cache;
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
        if (w0 < f->w_first) w0 = f->w_first;
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
            kvt_rope_ext(o + Dh - c->Dr, c->Dr, t, r ? c->cbase : c->base, r ? &f->w->yarn : NULL, -1.0f);
        }
    }
}

#define WORK_BUFS 39
#define WB_KEYS 30 /* keys, sc, isc, heap: the per-part buffers, in work_bufs' order */

/* Every allocation of the scratch but k itself, WORK_BUFS of them. */
static void work_bufs(const ds4_work *k, void **b)
{
    void *all[WORK_BUFS] = {k->x, k->xn, k->mix, k->hc, k->h, k->qr, k->q, k->kv, k->rows, k->ckv, k->csc, k->iq,
                            k->iw, k->att, k->og, k->f1, k->f3, k->lg, k->ex, k->ew, k->eo, k->rt, k->xe, k->tmp,
                            k->p, k->chk, k->sel, k->nsel, k->kI, k->dots, k->keys, k->sc, k->isc, k->heap, k->qx,
                            k->tap_tok, k->tok, k->pos, k->lgb};
    memcpy(b, all, sizeof all);
}

static void ds4_work_free(void *p)
{
    ds4_work *k = p;
    if (!k) return;
    void *b[WORK_BUFS];
    work_bufs(k, b);
    for (size_t i = 0; i < WORK_BUFS; i++) free(b[i]);
    free(k);
}

static size_t ds4_work_bytes(const void *p)
{
    const ds4_work *k = p;
    void *b[WORK_BUFS];
    work_bufs(k, b);
    size_t n = malloc_usable_size((void *)k);
    for (size_t i = 0; i < WORK_BUFS; i++) n += malloc_usable_size(b[i]);
    return n;
}

static void work_sizes(const ds4_config *c, size_t ch, size_t n_ctx, size_t parts, size_t qb, size_t *sz,
                       size_t *maxc4, size_t *nk);

/* The per-part scratch for the pool's parts (again when the pool grew). */
static int parts_fit(ds4_work *k, const ds4_config *c, size_t parts)
{
    if (k->parts >= parts) return KVT_OK;
    size_t sz[WORK_BUFS], m4, nk;
    work_sizes(c, k->ch, k->n_ctx, parts, 0, sz, &m4, &nk);
    float *keys = kvt_malloc(sz[WB_KEYS]);
    float *sc = kvt_malloc(sz[WB_KEYS + 1]);
    float *isc = k->sel ? kvt_malloc(sz[WB_KEYS + 2]) : NULL;
    cand *heap = k->sel ? kvt_malloc(sz[WB_KEYS + 3]) : NULL;
    if (!keys || !sc || (k->sel && (!isc || !heap))) {
        free(keys); free(sc); free(isc); free(heap);
        return kvt_fail(KVT_ENOMEM, "ds4 attention scratch for %zu threads", parts);
    }
    free(k->keys); free(k->sc); free(k->isc); free(k->heap);
    k->keys = keys; k->sc = sc; k->isc = isc; k->heap = heap;
    k->parts = parts;
    return KVT_OK;
}

/* Tokens of one pass through the layers at most: the session's chunk, up to
 * this. A pass routes each token to Eu of E experts and runs each expert
 * once over its tokens, so a longer pass gives each expert more tokens a
 * matmul (Flash: about 6 of 256 per 256 tokens, 12 per 512), where the
 * low-bit kernels' panels pay (kernels/qlowbit.c, LB_TILE_FROM). */
#define MAX_PASS 512
/* The pass of a session with the default chunk (session.c: 256), which
 * info's estimate of the scratch assumes. */
#define DEFAULT_PASS 256

/* The bytes of each of a scratch's buffers (in work_bufs' order; 0: none)
 * for chunk ch, context n_ctx, parts of the pool and qb bytes of quantised
 * activations, with the scratch's maxc4 and nk: the one sizing ds4_work_new
 * allocates by and kvt_arch.work_estimate reports. Every size is bounded by
 * finish_config's limits and n_ctx <= 2^24: none overflows a 64-bit size_t. */
static void work_sizes(const ds4_config *c, size_t ch, size_t n_ctx, size_t parts, size_t qb, size_t *sz,
                       size_t *maxc4, size_t *nk)
{
    size_t D = c->D, Dh = c->Dh, HD = (size_t)c->H * c->Dh, Rq = c->Rq, Di = c->Di, Hi = c->Hi;
    size_t E = c->E, Eu = c->Eu, F = (size_t)c->Fe * (c->Es > Eu ? c->Es : Eu); /* the shared, or one expert's rows */
    size_t wide = Dh > Di ? Dh : Di, CW = 2 * wide, K = c->K;
    size_t OG = HD / c->og + 2 * (size_t)c->og * c->orank; /* a group's inputs, the low-rank outputs, one group's */
    size_t TW = D > HD ? D : HD;
    if (TW < HC_MIX) TW = HC_MIX;
    size_t nc = 0, m4 = 0; /* compressed rows one position attends to at most */
    for (uint32_t l = 0; l < c->L; l++) {
        size_t r = c->ratio[l], m = r ? n_ctx / r : 0;
        if (r == 4 && m > K) m = K;
        if (r == 4) m4 = n_ctx / 4;
        nc = m > nc ? m : nc;
    }
    size_t nkk = nc + c->W, f = sizeof(float);
    bool sel = m4 > K;
    /* the dots of index_select's slices: slice * Hi * maxc floats, where
     * slice = clamp(2^22 / (Hi * maxc), 1, n) with maxc <= maxc4 and n <= ch */
    size_t all = ch * Hi * m4, one = Hi * m4, big = one > (1u << 22) ? one : (1u << 22);
    size_t v[WORK_BUFS] = {
        ch * HC * D * f, ch * HC * D * f, ch * HC_MIX * f, ch * HC_MIX * f, ch * D * f, ch * Rq * f, ch * HD * f,
        ch * Dh * f, ch * Dh * 2, ch * CW * f, ch * CW * f, ch * Hi * Di * f, ch * Hi * f, ch * HD * f, ch * OG * f,
        ch * F * f, ch * F * f, ch * E * f, ch * Eu * sizeof(uint32_t), ch * Eu * f, ch * Eu * D * f,
        ch * Eu * sizeof(uint32_t), ch * Eu * D * f, ch * TW * f, wide * f, wide * 2,
        sel ? ch * K * sizeof(uint32_t) : 0, ch * sizeof(uint32_t), sel ? m4 * Di * f : 0,
        sel ? (all < big ? all : big) * f : 0, parts * nkk * Dh * f, parts * nkk * f,
        sel ? parts * (m4 + 1) * f : 0, sel ? parts * ((size_t)K + 1) * sizeof(cand) : 0, qb, ch * sizeof(int32_t),
        ch * sizeof(int32_t), ch * sizeof(size_t), 0};
    memcpy(sz, v, sizeof v);
    *maxc4 = m4;
    *nk = nkk;
}

/* The largest activations the integer kernels quantise: at most ch tokens
 * through any matrix of the model. */
static size_t work_qbytes(const ds4_weights *w, size_t ch, int *rc)
{
    size_t qb = 0;
    tdesc *t = kvt_malloc(MAX_TENSORS * sizeof *t);
    if (!t) { *rc = KVT_ENOMEM; return 0; }
    size_t n = ds4_tensors((ds4_weights *)w, t);
    for (size_t i = 0; i < n; i++) {
        size_t b = t[i].mat ? kvt_q_act_bytes(t[i].mat->type, ch, t[i].mat->cols) : 0;
        qb = b > qb ? b : qb;
    }
    free(t);
    *rc = KVT_OK;
    return qb;
}

static int ds4_work_new(kvt_session *s)
{
    const ds4_weights *w = s->m->weights;
    const ds4_config *c = &w->c;
    size_t ch = s->chunk < MAX_PASS ? (s->chunk ? s->chunk : 1) : MAX_PASS, n_ctx = s->n_ctx;
    int rc;
    size_t qb = work_qbytes(w, ch, &rc);
    if (rc) return rc;
    ds4_work *k = kvt_calloc(1, sizeof *k);
    if (!k) return KVT_ENOMEM;
    k->ch = ch;
    k->n_ctx = n_ctx;
    size_t sz[WORK_BUFS];
    /* the per-part buffers come from parts_fit, which sizes them again as the pool grows */
    work_sizes(c, ch, n_ctx, 0, qb, sz, &k->maxc4, &k->nk);
    void **dst[WORK_BUFS] = {
        (void **)&k->x, (void **)&k->xn, (void **)&k->mix, (void **)&k->hc, (void **)&k->h, (void **)&k->qr,
        (void **)&k->q, (void **)&k->kv, (void **)&k->rows, (void **)&k->ckv, (void **)&k->csc, (void **)&k->iq,
        (void **)&k->iw, (void **)&k->att, (void **)&k->og, (void **)&k->f1, (void **)&k->f3, (void **)&k->lg,
        (void **)&k->ex, (void **)&k->ew, (void **)&k->eo, (void **)&k->rt, (void **)&k->xe, (void **)&k->tmp,
        (void **)&k->p, (void **)&k->chk, (void **)&k->sel, (void **)&k->nsel, (void **)&k->kI, (void **)&k->dots,
        (void **)&k->keys, (void **)&k->sc, (void **)&k->isc, (void **)&k->heap, (void **)&k->qx,
        (void **)&k->tap_tok, (void **)&k->tok, (void **)&k->pos, (void **)&k->lgb};
    bool ok = true;
    for (size_t i = 0; i < WORK_BUFS && ok; i++)
        if (sz[i] && !(*dst[i] = kvt_malloc(sz[i]))) ok = false;
    rc = ok ? parts_fit(k, c, kvt_pool_size(s->pool)) : KVT_ENOMEM;
    if (rc) {
        ds4_work_free(k);
        return rc == KVT_ENOMEM ? kvt_fail(KVT_ENOMEM, "ds4 scratch for %zu tokens of a %zu-token context", ch, n_ctx)
                                : rc;
    }
    s->work = k;
    return KVT_OK;
}

static inline float sigm(float v) { return 1.0f / (1.0f + kvt_expf(-v)); }

/* Sinkhorn on a token's comb (4 x 4, [src][dst]): softmax over dst, plus
 * eps, a column normalisation, then iters - 1 times rows and columns, each
 * sum plus eps (llama.cpp's build_hc_sinkhorn). */
static void sinkhorn(float *cb, uint32_t iters, float eps)
{
    for (size_t s = 0; s < HC; s++) {
        float *r = cb + s * HC, m = r[0], z = 0;
        for (size_t d = 1; d < HC; d++) m = r[d] > m ? r[d] : m;
        for (size_t d = 0; d < HC; d++) { r[d] = kvt_expf(r[d] - m); z += r[d]; }
        for (size_t d = 0; d < HC; d++) r[d] = r[d] / z + eps;
    }
    for (uint32_t it = 0; it < iters; it++) {
        if (it > 0)
            for (size_t s = 0; s < HC; s++) {
                float z = eps;
                for (size_t d = 0; d < HC; d++) z += cb[s * HC + d];
                for (size_t d = 0; d < HC; d++) cb[s * HC + d] /= z;
            }
        for (size_t d = 0; d < HC; d++) {
            float z = eps;
            for (size_t s = 0; s < HC; s++) z += cb[s * HC + d];
            for (size_t s = 0; s < HC; s++) cb[s * HC + d] /= z;
        }
    }
}

/* The mixes of n tokens' streams x (n, 4, D) through fn (out, 4D): each
 * token's streams normed as one vector of 4D. */
static void hc_mixes(kvt_pool *pool, ds4_work *wk, const ds4_config *c, const float *x, size_t n, const float *fn,
                     size_t out)
{
    size_t W4 = (size_t)HC * c->D;
    for (size_t i = 0; i < n; i++) kvt_rmsnorm(wk->xn + i * W4, x + i * W4, NULL, W4, c->eps);
    kvt_matmul(pool, wk->mix, fn, wk->xn, n, W4, out);
}

/* Collapse each token's streams with weights pre (stride apart) into h (n, D). */
static void hc_collapse(const float *x, size_t n, size_t D, const float *pre, size_t stride, float *h)
{
    for (size_t i = 0; i < n; i++) {
        const float *xi = x + i * HC * D, *p = pre + i * stride;
        float *o = h + i * D;
        for (size_t d = 0; d < D; d++) {
            float v = xi[d] * p[0];
            for (size_t k = 1; k < HC; k++) v = v + xi[k * D + d] * p[k];
            o[d] = v;
        }
    }
}

/* A sublayer's input: the hyper-connection coefficients of every token into
 * wk->hc, then the collapsed streams into h. */
static void hc_pre(kvt_pool *pool, ds4_work *wk, const ds4_config *c, const float *x, size_t n, const float *fn,
                   const float *base, const float *scale, float *h)
{
    hc_mixes(pool, wk, c, x, n, fn, HC_MIX);
    for (size_t i = 0; i < n; i++) {
        const float *m = wk->mix + i * HC_MIX;
        float *k = wk->hc + i * HC_MIX;
        for (size_t j = 0; j < HC; j++) k[j] = sigm(m[j] * scale[0] + base[j]) + c->hc_eps;
        for (size_t j = HC; j < 2 * HC; j++) k[j] = 2.0f * sigm(m[j] * scale[1] + base[j]);
        for (size_t j = 2 * HC; j < HC_MIX; j++) k[j] = m[j] * scale[2] + base[j];
        sinkhorn(k + 2 * HC, c->iters, c->hc_eps);
    }
    hc_collapse(x, n, c->D, wk->hc, HC_MIX, h);
}

/* The streams after a sublayer with output f (n, D): stream dst becomes
 * f * post[dst] + sum over src of x[src] * comb[src][dst]. */
static void hc_post(ds4_work *wk, const ds4_config *c, float *x, size_t n, const float *f)
{
    size_t D = c->D;
    for (size_t i = 0; i < n; i++) {
        const float *k = wk->hc + i * HC_MIX, *cb = k + 2 * HC, *xi = x + i * HC * D, *fi = f + i * D;
        float *o = wk->xn + i * HC * D;
        for (size_t dst = 0; dst < HC; dst++)
            for (size_t d = 0; d < D; d++) {
                float v = fi[d] * k[HC + dst];
                for (size_t src = 0; src < HC; src++) v = v + xi[src * D + d] * cb[src * HC + dst];
                o[dst * D + d] = v;
            }
    }
    memcpy(x, wk->xn, n * HC * D * sizeof(float));
}

/* The feed-forward of n tokens h (n, D) with ids tok at positions pos into
 * out (n, D): the routed experts, weighted, plus the shared experts. Every
 * matrix runs over all n tokens (of one session or of several), the
 * experts each over the tokens routed to it. */
static void moe(kvt_pool *pool, ds4_work *wk, const ds4_weights *w, uint32_t l, const int32_t *tok, const size_t *pos,
                const float *h, size_t n, float *out)
{
    const ds4_config *c = &w->c;
    const ds4_layer *ly = &w->layers[l];
    size_t D = c->D, E = c->E, Eu = c->Eu, Fe = c->Fe, Fs = (size_t)c->Fe * c->Es;
    kvt_matmul(pool, wk->lg, ly->gate_inp, h, n, D, E);
    for (size_t i = 0; i < n; i++) {
        float *p = wk->lg + i * E, *wt = wk->ew + i * Eu;
        uint32_t *ex = wk->ex + i * Eu;
        for (size_t e = 0; e < E; e++) p[e] = sqrtf(p[e] > 20.0f ? p[e] : logf(1.0f + expf(p[e])));
        float sc[1024]; /* the selection scores: p + bias (E <= 1024: finish_config) */
        for (size_t e = 0; e < E; e++) sc[e] = p[e] + (ly->probs_b ? ly->probs_b[e] : 0);
        if (l < c->n_hash) {
            for (size_t j = 0; j < Eu; j++) ex[j] = (uint32_t)ly->tid2eid[(size_t)tok[i] * Eu + j];
        } else {
            kvt_moe_select(sc, E, Eu, ex);
        }
        const kvt_forced *fz = kvt_force;
        if (fz && pos[i] < fz->n && fz->Eu == Eu && fz->ex[l])
            kvt_moe_force_choice(fz->ex[l], fz->ex_gap[l], pos[i], ex, Eu, l < c->n_hash ? NULL : sc, E, false);
        for (size_t j = 0; j < Eu; j++) wt[j] = p[ex[j]];
        if (c->wnorm) kvt_moe_normalise(wt, Eu);
        if (c->wscale != 0.0f && c->wscale != 1.0f) /* llama.cpp: 0 is "no scale" too */
            for (size_t j = 0; j < Eu; j++) wt[j] *= c->wscale;
    }
    /* the shared experts, then the routed ones added to them */
    kvt_matmul_w(pool, wk->f1, &ly->gate_s, h, n, wk->qx);
    kvt_matmul_w_next(pool, wk->f3, &ly->up_s, &ly->gate_s, h, n, wk->qx);
    kvt_moe_swiglu(wk->f1, wk->f3, n * Fs, c->clamp_sh[l]);
    kvt_matmul_w(pool, out, &ly->down_s, wk->f1, n, wk->qx);
    kvt_moe m = {&ly->gate_x, &ly->up_x, &ly->down_x, E, Eu, Fe, D, c->clamp_exp[l]};
    kvt_moe_scratch sc = {wk->xe, wk->eo, wk->f1, wk->f3, wk->rt, wk->qx};
    kvt_moe_run(pool, &m, h, n, wk->ex, wk->ew, &sc, out);
}

/* Layer l over the streams xl of k segments' tokens one after another (nn
 * in all, ids tok, RoPE positions pos): matrix products and per-token steps
 * over all of them; what reads or writes a session's state (frontiers,
 * compressed rows, the indexer's selection, attention, the window ring in
 * win, or each session's cache when win is NULL) per segment on its own.
 * lead, replay, replay_from: forward_pass's replay of one segment (it
 * recomputes and compares the compressed rows it can make exact).
 * row_only: stop once the window ring holds the tokens' raw rows (the MTP
 * layer's rows of positions already verified: the streams are left). */
static int layer_run(kvt_pool *pool, ds4_work *wk, const kvt_seg *sg, size_t k, const kvt_cache *win, uint32_t l,
                     float *xl, const int32_t *tok, const size_t *pos, bool replay, size_t replay_from, size_t lead,
                     bool row_only)
{
    const ds4_weights *w = sg[0].s->m->weights;
    const ds4_config *c = &w->c;
    size_t D = c->D, Dh = c->Dh, HD = (size_t)c->H * c->Dh, Rq = c->Rq, Di = c->Di, Hi = c->Hi;
    size_t og = c->og, orank = c->orank, gd = HD / og, nn = 0;
    for (size_t g = 0; g < k; g++) nn += sg[g].n;
    float *h = wk->h, *qr = wk->qr, *q = wk->q, *kv = wk->kv, *ckv = wk->ckv, *csc = wk->csc;
    float *iq = wk->iq, *iw = wk->iw, *att = wk->att, *tmp = wk->tmp, *p = wk->p;
    uint16_t *rows = wk->rows, *chk = wk->chk;
    const ds4_layer *ly = &w->layers[l];
    uint32_t r = c->ratio[l];
    float base = r ? c->cbase : c->base;
    const kvt_yarn *yarn = r && kvt_ds4_fault != KVT_DS4_FAULT_YARN ? &w->yarn : NULL; /* tests: plain RoPE */
    hc_pre(pool, wk, c, xl, nn, ly->hca_fn, ly->hca_base, ly->hca_scale, h);
    for (size_t i = 0; i < nn; i++) kvt_rmsnorm(h + i * D, h + i * D, ly->attn_norm, D, c->eps);
    /* raw rows: key and value at once */
    kvt_matmul_w(pool, kv, &ly->wkv, h, nn, wk->qx);
    for (size_t i = 0; i < nn; i++) {
        float *kr = kv + i * Dh;
        kvt_rmsnorm(kr, kr, ly->kv_norm, Dh, c->eps);
        kvt_rope_ext(kr + Dh - c->Dr, c->Dr, pos[i], base, yarn, 1.0f);
        to_f16(rows + i * Dh, kr, Dh);
    }
    if (row_only) {
        for (size_t g = 0, off = 0; g < k; off += sg[g++].n)
            for (size_t i = sg[g].n > c->W ? sg[g].n - c->W : 0; i < sg[g].n; i++)
                memcpy(win_row(win ? win : sg[g].s->cache, ly, c, sg[g].pos0 + i), rows + (off + i) * Dh, Dh * 2);
        return KVT_OK;
    }
    /* queries */
    kvt_matmul_w(pool, tmp, &ly->wqa, h, nn, wk->qx);
    for (size_t i = 0; i < nn; i++) kvt_rmsnorm(qr + i * Rq, tmp + i * Rq, ly->q_norm, Rq, c->eps);
    kvt_matmul_w(pool, q, &ly->wqb, qr, nn, wk->qx);
    for (size_t i = 0; i < nn; i++)
        for (size_t hh = 0; hh < c->H; hh++) {
            float *qh = q + (i * c->H + hh) * Dh;
            kvt_rmsnorm(qh, qh, NULL, Dh, c->eps);
            kvt_rope_ext(qh + Dh - c->Dr, c->Dr, pos[i], base, yarn, 1.0f);
        }
    /* compressors: each segment pooled in position order into its own
     * session's frontier, rows emitted as blocks complete */
    for (int pass = 0; pass < (r == 4 ? 2 : r ? 1 : 0); pass++) {
        bool idx = pass == 1;
        size_t d = idx ? Di : Dh, cw = (r == 4 ? 2 : 1) * d, off = idx ? ly->off_if : ly->off_cf;
        int stream = idx ? ly->s_idx : ly->s_comp;
        const kvt_wmat *wkv_c = idx ? &ly->i_kv : &ly->c_kv, *wg_c = idx ? &ly->i_gate : &ly->c_gate;
        kvt_matmul_w(pool, ckv, wkv_c, h, nn, wk->qx);
        kvt_matmul_w_next(pool, csc, wg_c, wkv_c, h, nn, wk->qx);
        const float *ape = idx ? ly->i_ape : ly->c_ape;
        for (size_t g = 0, o = 0; g < k; o += sg[g++].n) {
            kvt_cache *cache = sg[g].s->cache;
            for (size_t i = o; i < o + sg[g].n; i++) {
                size_t t = sg[g].pos0 + (i - o);
                float *sl = front_slot(cache, off, r, cw, t);
                memcpy(sl, ckv + i * cw, cw * sizeof(float));
                for (size_t j = 0; j < cw; j++) sl[cw + j] = csc[i * cw + j] + ape[(t % r) * cw + j];
                if ((t + 1) % r) continue;
                size_t row = (t + 1) / r - 1;
                uint16_t *out = chk; /* a replay recomputes rows its exact region pools, to compare */
                if (replay && replay_from && (r == 4 && row > 0 ? row * r - 4 : row * r) < lead) continue;
                if (!replay && !(out = kvt_cache_row(cache, (size_t)stream, row)))
                    return kvt_fail(KVT_ENOMEM, "ds4: compressed row for token %zu", t);
                emit_row(cache, off, r, d, t, idx ? ly->i_norm : ly->c_norm, c->eps, c->Dr, c->cbase, &w->yarn,
                         idx ? w->hd_idx : 0, p, out);
                if (replay && memcmp(chk, kvt_cache_row_ro(cache, (size_t)stream, row), d * 2))
                    return kvt_fail(KVT_ECORRUPT, "ds4 replay: layer %u row %zu differs from the stored row", l, row);
            }
        }
    }
    if (r == 4) {
        kvt_matmul_w(pool, iq, &ly->i_qb, qr, nn, wk->qx);
        for (size_t i = 0; i < nn; i++)
            for (size_t hh = 0; hh < Hi; hh++) {
                float *v = iq + (i * Hi + hh) * Di;
                kvt_rope_ext(v + Di - c->Dr, c->Dr, pos[i], c->cbase, &w->yarn, 1.0f);
                for (size_t j = 0; j < Di; j += w->hd_idx) kvt_hadamard(v + j, w->hd_idx);
            }
        kvt_matmul_w(pool, iw, &ly->i_proj, h, nn, wk->qx);
        float isc = 1.0f / sqrtf((float)(Di * Hi));
        for (size_t j = 0; j < nn * Hi; j++) iw[j] *= isc;
    }
    /* attention, each segment over its own session's rows; only after it
     * does the segment's ring take its rows. The MTP layer has no row at
     * position 0 (its first pair is the hidden state of 0 with the token
     * at 1, at position 1). */
    for (size_t g = 0, o = 0; g < k; o += sg[g++].n) {
        const kvt_cache *wc = win ? win : sg[g].s->cache;
        size_t n = sg[g].n, p0 = sg[g].pos0;
        fwd fa = {pool, sg[g].s, wc, l < c->L ? 0 : 1, w, ly, wk, l, n, p0, q + o * HD, rows + o * Dh,
                  iq + o * Hi * Di, iw + o * Hi, att + o * HD};
        fa.maxc = r ? (p0 + n) / r : 0;
        if (r == 4 && fa.maxc > c->K) index_select(&fa);
        kvt_pool_for_part(pool, n, 1, attn_range, &fa);
        for (size_t i = n > c->W ? n - c->W : 0; i < n; i++)
            memcpy(win_row(wc, ly, c, p0 + i), rows + (o + i) * Dh, Dh * 2);
    }
    /* grouped low-rank output: group g's heads through rows g*orank.. of wo_a */
    float *xg = wk->og, *oa = xg + nn * gd, *go = oa + nn * og * orank;
    for (size_t g = 0; g < og; g++) {
        for (size_t i = 0; i < nn; i++) memcpy(xg + i * gd, att + i * HD + g * gd, gd * sizeof(float));
        kvt_wmat wa = kvt_wmat_rows(&ly->woa, g * orank, orank);
        kvt_matmul_w(pool, go, &wa, xg, nn, wk->qx);
        for (size_t i = 0; i < nn; i++) memcpy(oa + (i * og + g) * orank, go + i * orank, orank * sizeof(float));
    }
    kvt_matmul_w(pool, tmp, &ly->wob, oa, nn, wk->qx);
    hc_post(wk, c, xl, nn, tmp);
    /* feed-forward */
    hc_pre(pool, wk, c, xl, nn, ly->hcf_fn, ly->hcf_base, ly->hcf_scale, h);
    for (size_t i = 0; i < nn; i++) kvt_rmsnorm(h + i * D, h + i * D, ly->ffn_norm, D, c->eps);
    moe(pool, wk, w, l, tok, pos, h, nn, tmp);
    hc_post(wk, c, xl, nn, tmp);
    return KVT_OK;
}

/* The output head over nl tokens' streams, xs's rows ri[0..nl) (NULL: its
 * first nl): the streams collapsed by the head's mixes, normed, through the
 * output matrix into logits (nl, V). The head is the model's, or for the
 * MTP layer (ly) its own parts where it has them. */
static void head_run(kvt_pool *pool, const ds4_weights *w, ds4_work *wk, const float *xs, size_t nl,
                     const uint32_t *ri, float *logits, const ds4_layer *ly)
{
    const ds4_config *c = &w->c;
    size_t D = c->D, W4 = (size_t)HC * D;
    float *h = wk->h;
    bool own = ly && ly->hh_fn && ly->hh_base && ly->hh_scale;
    const float *fn = own ? ly->hh_fn : w->hch_fn, *base = own ? ly->hh_base : w->hch_base;
    const float *scale = own ? ly->hh_scale : w->hch_scale;
    const float *norm = ly && ly->head_norm ? ly->head_norm : w->out_norm;
    const kvt_wmat *out = ly && ly->head.data ? &ly->head : &w->out;
    /* hc_mixes and hc_collapse, row by row from where each row is */
    for (size_t i = 0; i < nl; i++) kvt_rmsnorm(wk->xn + i * W4, xs + (ri ? ri[i] : i) * W4, NULL, W4, c->eps);
    kvt_matmul(pool, wk->mix, fn, wk->xn, nl, W4, HC);
    for (size_t i = 0; i < nl; i++) {
        for (size_t k = 0; k < HC; k++)
            wk->mix[i * HC + k] = sigm(wk->mix[i * HC + k] * scale[0] + base[k]) + c->hc_eps;
        hc_collapse(xs + (ri ? ri[i] : i) * W4, 1, D, wk->mix + i * HC, HC, h + i * D);
        kvt_rmsnorm(h + i * D, h + i * D, norm, D, c->eps);
    }
    kvt_matmul_w(pool, logits, out, h, nl, wk->qx);
}

/* A batched pass's logits: the nl rows of the segments that want them
 * through the head at once (into wk->lgb, which ds4_forward_batch sized),
 * then each segment's into its own buffer. */
static void batch_logits(kvt_pool *pool, const ds4_weights *w, ds4_work *wk, const kvt_seg *sg, size_t k, size_t nl)
{
    size_t V = w->c.V;
    uint32_t *ri = wk->rt; /* (ch * Eu) free after the layers */
    size_t r = 0;
    for (size_t g = 0, off = 0; g < k; off += sg[g++].n)
        for (size_t i = sg[g].logits ? sg[g].lfrom : sg[g].n; i < sg[g].n; i++) ri[r++] = (uint32_t)(off + i);
    head_run(pool, w, wk, wk->x, nl, ri, wk->lgb, NULL);
    r = 0;
    for (size_t g = 0; g < k; g++) {
        if (!sg[g].logits || sg[g].lfrom >= sg[g].n) continue;
        size_t m = sg[g].n - sg[g].lfrom;
        memcpy(sg[g].logits, wk->lgb + r * V, m * V * sizeof(float));
        r += m;
    }
}

/* Session s's tap (kvt_ds4_hidden) in its own scratch: the final streams x
 * of its n tokens tok from pos0, their last ones where its scratch holds
 * fewer (a batched pass ran them in the first session's scratch). */
static void tap_set(const kvt_session *s, const float *x, const int32_t *tok, size_t n, size_t pos0)
{
    ds4_work *o = s->work;
    if (!o) return;
    size_t W4 = kvt_ds4_hidden_floats(s->m), keep = n < o->ch ? n : o->ch, skip = n - keep;
    if (o->x != x) memcpy(o->x, x + skip * W4, keep * W4 * sizeof(float));
    memcpy(o->tap_tok, tok + skip, keep * sizeof *tok);
    o->tap_s = s;
    o->tap_pos0 = pos0 + skip;
    o->tap_n = keep;
}

/* One pass of the k segments' tokens (at most wk->ch in all) on the
 * scratch wk; every segment's results are those of a pass of it alone (see
 * layer_run). replay_from is SIZE_MAX for a normal pass. Otherwise the pass
 * (of one segment) is part of a replay that started at replay_from over a
 * cache whose stream rows are already complete (see ds4_state_rebuild):
 * the compressed rows are not written, and each one whose inputs the replay
 * has already made exact is recomputed and must equal the stored row. A
 * normal pass leaves each segment's final streams in its session's scratch
 * (the tap: what the MTP layer reads, kvt_ds4_hidden). */
static int forward_pass(kvt_pool *pool, ds4_work *wk, const kvt_seg *sg, size_t k, size_t replay_from)
{
    const ds4_weights *w = sg[0].s->m->weights;
    const ds4_config *c = &w->c;
    size_t D = c->D, W4 = (size_t)HC * D, n = 0, nl = 0;
    float *x = wk->x;
    bool replay = replay_from != SIZE_MAX;
    wk->tap_s = NULL;
    for (size_t g = 0; g < k; g++) {
        for (size_t i = 0; i < sg[g].n; i++, n++) {
            int32_t t = sg[g].tok[i];
            if (t < 0 || (uint32_t)t >= c->V) return kvt_fail(KVT_EINVAL, "token id %d out of range [0, %u)", t, c->V);
            wk->tok[n] = t;
            bool fault = kvt_ds4_fault == KVT_DS4_FAULT_BATCH_POS && g > 0; /* tests: the one before's positions on */
            wk->pos[n] = (fault ? sg[g - 1].pos0 + sg[g - 1].n : sg[g].pos0) + i;
            const kvt_wmat *te = &w->tok_embd;
            kvt_quant_to_f32(te->type, te->data + (size_t)t * te->row_bytes, x + n * W4, D);
            for (size_t j = 1; j < HC; j++) memcpy(x + n * W4 + j * D, x + n * W4, D * sizeof(float));
        }
        nl += sg[g].logits && sg[g].lfrom < sg[g].n ? sg[g].n - sg[g].lfrom : 0;
    }
    for (uint32_t l = 0; l < c->L; l++) {
        /* A replay skips the positions whose values at this layer cannot
         * reach what it keeps (see replay_start): they start exact at
         * replay_from + l(W-1). */
        size_t skip = 0, lead = replay ? replay_from + (size_t)l * (c->W - 1) : 0;
        if (replay && replay_from && lead > sg[0].pos0) skip = lead - sg[0].pos0 < n ? lead - sg[0].pos0 : n;
        if (skip == n) continue;
        kvt_seg one = {sg[0].s, sg[0].tok + skip, sg[0].n - skip, sg[0].pos0 + skip, NULL, SIZE_MAX};
        int rc = layer_run(pool, wk, skip ? &one : sg, k, NULL, l, x + skip * W4, wk->tok + skip, wk->pos + skip,
                           replay, replay_from, lead, false);
        if (rc) return rc;
    }
    if (k == 1 && sg[0].lfrom < n)
        head_run(pool, w, wk, x + sg[0].lfrom * W4, n - sg[0].lfrom, NULL, sg[0].logits, NULL);
    if (k > 1 && nl) batch_logits(pool, w, wk, sg, k, nl);
    if (replay) return KVT_OK;
    for (size_t g = 0, off = 0; g < k; off += sg[g++].n)
        tap_set(sg[g].s, x + off * W4, sg[g].tok, sg[g].n, sg[g].pos0);
    return KVT_OK;
}

/* ---- the MTP (nextn) layer ----
 *
 * As llama.cpp's deepseek4 MTP graph: the position's hidden streams h (the
 * model's final streams, before the output head) and the next token's
 * embedding e are normed (hnorm per stream, enorm), each stream becomes
 * eh_proj [e, h], and the streams go through a layer of raw attention over
 * a window ring of its own and a routed feed-forward, then the model's
 * output head. */

uint32_t kvt_ds4_mtp_layers(const kvt_model *m)
{
    return m->arch == &kvt_arch_ds4 ? ((const ds4_weights *)m->weights)->c.nextn : 0;
}

size_t kvt_ds4_hidden_floats(const kvt_model *m) { return (size_t)HC * ((const ds4_weights *)m->weights)->c.D; }

size_t kvt_ds4_mtp_window(const kvt_model *m) { return ((const ds4_weights *)m->weights)->c.W; }

size_t kvt_ds4_mtp_ring_bytes(const kvt_model *m)
{
    const ds4_config *c = &((const ds4_weights *)m->weights)->c;
    return (size_t)c->W * c->Dh * 2;
}

int kvt_ds4_hidden(const kvt_session *s, size_t pos, float *out)
{
    const ds4_work *wk = s->work;
    if (!wk || wk->tap_s != s || pos < wk->tap_pos0 || pos >= wk->tap_pos0 + wk->tap_n || pos >= s->n ||
        memcmp(wk->tap_tok, s->tokens + wk->tap_pos0, (pos + 1 - wk->tap_pos0) * sizeof(int32_t)))
        return KVT_ENOENT;
    size_t W4 = kvt_ds4_hidden_floats(s->m);
    memcpy(out, wk->x + (pos - wk->tap_pos0) * W4, W4 * sizeof(float));
    return KVT_OK;
}

int kvt_ds4_mtp_step(kvt_session *s, uint16_t *ring, const float *hin, int32_t tok, size_t pos, bool row_only,
                     float *hout, float *logits)
{
    const ds4_weights *w = s->m->weights;
    const ds4_config *c = &w->c;
    if (s->m->arch != &kvt_arch_ds4 || !c->nextn) return kvt_fail(KVT_EUNSUPPORTED, "the model has no MTP layer");
    ds4_work *wk = s->work;
    int rc;
    if (!wk || wk->ch < HC) return kvt_fail(KVT_EINVAL, "MTP: the session has no scratch of %d tokens", HC);
    if (tok < 0 || (uint32_t)tok >= c->V) return kvt_fail(KVT_EINVAL, "MTP: token id %d out of range [0, %u)", tok, c->V);
    if (pos >= wk->n_ctx || pos == 0) return kvt_fail(KVT_ECTX, "MTP: position %zu outside [1, %zu)", pos, wk->n_ctx);
    if ((rc = parts_fit(wk, c, kvt_pool_size(s->pool)))) return rc;
    wk->tap_s = NULL; /* the streams are the MTP's from here */
    const ds4_layer *ly = &w->layers[c->L];
    size_t D = c->D;
    float *cat = kvt_malloc(2 * HC * D * sizeof(float));
    if (!cat) return KVT_ENOMEM;
    const kvt_wmat *te = ly->emb.data ? &ly->emb : &w->tok_embd; /* as llama.cpp: its own rows when it has them */
    kvt_quant_to_f32(te->type, te->data + (size_t)tok * te->row_bytes, cat, D);
    kvt_rmsnorm(cat, cat, ly->enorm, D, c->eps);
    for (size_t k = 0; k < HC; k++) {
        if (k) memcpy(cat + k * 2 * D, cat, D * sizeof(float));
        kvt_rmsnorm(cat + k * 2 * D + D, hin + k * D, ly->hnorm, D, c->eps);
    }
    kvt_matmul_w(s->pool, wk->x, &ly->eh, cat, HC, wk->qx); /* the token's HC streams */
    free(cat);
    kvt_cache ring_cache;
    memset(&ring_cache, 0, sizeof ring_cache);
    ring_cache.state = (uint8_t *)ring;
    ring_cache.state_bytes = kvt_ds4_mtp_ring_bytes(s->m);
    kvt_seg one = {s, &tok, 1, pos, NULL, 1};
    wk->tok[0] = tok;
    wk->pos[0] = pos;
    rc = layer_run(s->pool, wk, &one, 1, &ring_cache, c->L, wk->x, wk->tok, wk->pos, false, SIZE_MAX, 0, row_only);
    if (rc || row_only) return rc;
    memcpy(hout, wk->x, (size_t)HC * D * sizeof(float));
    head_run(s->pool, w, wk, wk->x, 1, NULL, logits, ly);
    return KVT_OK;
}

/* ---- ds4.c's separate MTP file ----
 *
 * ds4.c ships the MTP layer as a GGUF of its own (given with --mtp): the
 * layer's tensors named mtp.0.<suffix>. The layer's block tensors have
 * llama.cpp's suffixes (blk.<L>.<suffix>); the rest differ, one row each
 * here: the projection of [embedding, hidden] is two matrices, e_proj and
 * h_proj, where llama.cpp has their concatenation eh_proj (row r of eh_proj
 * is row r of e_proj then row r of h_proj); norm is llama.cpp's
 * shared_head_norm; hc_head_* are the layer's own head mixes (llama.cpp's
 * layout has none: it uses the model's output_hc_*). embed_tokens and
 * shared_head_head have no ds4.c name (ds4.c uses the model's). */
static const struct { const char *llama, *ds4c; } mtp_names[] = {
    {"nextn.eh_proj.weight", NULL}, /* e_proj.weight and h_proj.weight */
    {"nextn.enorm.weight", "enorm.weight"},
    {"nextn.hnorm.weight", "hnorm.weight"},
    {"nextn.shared_head_norm.weight", "norm.weight"},
    {"nextn.hc_head_fn.weight", "hc_head_fn.weight"},
    {"nextn.hc_head_base.weight", "hc_head_base.weight"},
    {"nextn.hc_head_scale.weight", "hc_head_scale.weight"},
    {"nextn.embed_tokens.weight", ""}, /* "": none */
    {"nextn.shared_head_head.weight", ""},
};

/* The ds4.c name of the MTP layer's table entry whose llama.cpp suffix is
 * sfx, into out (NULL: eh_proj, the split pair; "": none). */
static const char *ds4c_name(const char *sfx, char *out, size_t n)
{
    for (size_t i = 0; i < sizeof mtp_names / sizeof mtp_names[0]; i++)
        if (!strcmp(sfx, mtp_names[i].llama)) {
            if (!mtp_names[i].ds4c || !*mtp_names[i].ds4c) return mtp_names[i].ds4c;
            snprintf(out, n, "mtp.0.%s", mtp_names[i].ds4c);
            return out;
        }
    snprintf(out, n, "mtp.0.%s", sfx);
    return out;
}

/* eh_proj (D rows of 2D) from ds4.c's e_proj and h_proj ((D, D) each, one
 * type): each row the two rows' bytes, in place of one matrix, so the layer
 * computes exactly as with llama.cpp's eh_proj of the same values. A type
 * kvtier only dequantises is concatenated in f32. */
static int load_eh(ds4_weights *w, const kvt_gguf *g, ds4_layer *ly)
{
    size_t D = w->c.D;
    const kvt_gguf_tensor *e = kvt_gguf_find_tensor(g, "mtp.0.e_proj.weight"),
                          *h = kvt_gguf_find_tensor(g, "mtp.0.h_proj.weight");
    if (!e || !h) return kvt_fail(KVT_EFORMAT, "deepseek4 MTP file: missing tensor mtp.0.%s_proj.weight", e ? "h" : "e");
    if (kvt_ds4_fault == KVT_DS4_FAULT_MTP_BIND) { /* tests: the two halves bound to each other's place */
        const kvt_gguf_tensor *x = e;
        e = h, h = x;
    }
    const kvt_gguf_tensor *p[2] = {e, h};
    for (int k = 0; k < 2; k++)
        if (p[k]->n_dims != 2 || p[k]->ne[0] != D || p[k]->ne[1] != D || !p[k]->data)
            return kvt_fail(KVT_EFORMAT, "deepseek4 MTP file: tensor mtp.0.%s_proj.weight has shape (%llu, %llu), "
                            "expected (%zu, %zu)", k ? "h" : "e", (unsigned long long)p[k]->ne[0],
                            (unsigned long long)p[k]->ne[1], D, D);
    if (e->type != h->type)
        return kvt_fail(KVT_EFORMAT, "deepseek4 MTP file: mtp.0.e_proj.weight and mtp.0.h_proj.weight differ in type");
    size_t rb = kvt_quant_row_bytes(e->type, D);
    if (rb && kvt_quant_row_bytes(e->type, 2 * D) == 2 * rb && e->n_bytes == rb * D && h->n_bytes == rb * D) {
        uint8_t *b = kvt_malloc(2 * rb * D);
        if (!b) return KVT_ENOMEM;
        for (size_t r = 0; r < D; r++) {
            memcpy(b + r * 2 * rb, e->data + r * rb, rb);
            memcpy(b + r * 2 * rb + rb, h->data + r * rb, rb);
        }
        w->own[w->n_own++] = (float *)(void *)b; /* freed as bytes */
        ly->eh = (kvt_wmat){b, e->type, D, 2 * D, 2 * rb, NULL};
        return KVT_OK;
    }
    float *f = kvt_malloc(2 * D * D * sizeof *f), *t = kvt_malloc(D * D * sizeof *t);
    int rc = f && t ? KVT_OK : KVT_ENOMEM;
    for (int k = 0; k < 2 && !rc; k++) {
        rc = kvt_gguf_tensor_to_f32(p[k], t, D * D);
        for (size_t r = 0; r < D && !rc; r++) memcpy(f + r * 2 * D + k * D, t + r * D, D * sizeof *f);
    }
    free(t);
    if (rc) { free(f); return rc; }
    w->own[w->n_own++] = f;
    ly->eh = kvt_wmat_f32(f, D, 2 * D);
    return KVT_OK;
}

int kvt_ds4_mtp_attach(kvt_model *m, kvt_gguf *g)
{
    if (m->arch != &kvt_arch_ds4) return kvt_fail(KVT_EUNSUPPORTED, "an MTP file goes with a deepseek4 model");
    ds4_weights *w = m->weights;
    ds4_config *c = &w->c;
    const char *a;
    size_t an;
    if (kvt_gguf_get_str(g, "general.architecture", &a, &an) != KVT_OK || an != 9 || memcmp(a, "deepseek4", 9))
        return kvt_fail(KVT_EFORMAT, "the MTP file is not a deepseek4 file (general.architecture '%.*s')",
                        kvt_gguf_get_str(g, "general.architecture", &a, &an) == KVT_OK ? (int)(an > 32 ? 32 : an) : 0,
                        kvt_gguf_get_str(g, "general.architecture", &a, &an) == KVT_OK ? a : "");
    if (c->nextn) return kvt_fail(KVT_EINVAL, "the model has its MTP layer already (blk.%u.nextn.*)", c->L);
    if (c->L + 1 > MAX_LAYERS) return kvt_fail(KVT_EUNSUPPORTED, "ds4: %u layers and an MTP layer", c->L);
    if (!w->own && !(w->own = kvt_calloc(MAX_TENSORS, sizeof *w->own))) return KVT_ENOMEM;
    tdesc *t = kvt_malloc(MAX_TENSORS * sizeof *t);
    if (!t) return KVT_ENOMEM;
    c->nextn = 1;
    c->clamp_exp[c->L] = c->clamp_exp[c->L - 1]; /* as a model file without the layer's entry */
    c->clamp_sh[c->L] = c->clamp_sh[c->L - 1];
    int rc = finish_config(w);
    size_t n = rc ? 0 : ds4_tensors(w, t), first = n;
    char pre[24], nm[80];
    snprintf(pre, sizeof pre, "blk.%u.", c->L);
    for (size_t i = 0; i < n && !rc; i++) {
        if (strncmp(t[i].name, pre, strlen(pre))) continue;
        if (first == n) first = i;
        const char *x = ds4c_name(t[i].name + strlen(pre), nm, sizeof nm);
        if (!x) rc = load_eh(w, g, &w->layers[c->L]);
        else if (*x) rc = load_named(w, g, &t[i], x);
    }
    if (rc) { /* the model as it was: the layer's copies freed, its matrices with the model */
        for (size_t i = first; i < n; i++)
            if (!t[i].mat && t[i].slot) free(*t[i].slot);
        memset(&w->layers[c->L], 0, sizeof w->layers[c->L]);
        c->nextn = 0;
        finish_config(w);
    } else {
        w->mtp_file = g;
    }
    free(t);
    return rc;
}

int kvt_ds4_mtp_write_ds4c(const kvt_model *m, const char *path)
{
    if (m->arch != &kvt_arch_ds4 || !((const ds4_weights *)m->weights)->c.nextn)
        return kvt_fail(KVT_EINVAL, "not a ds4 model with an MTP layer");
    ds4_weights *w = m->weights;
    const ds4_config *c = &w->c;
    const ds4_layer *ly = &w->layers[c->L];
    kvt_gguf_writer *gw = kvt_gguf_writer_new();
    tdesc *t = kvt_malloc(MAX_TENSORS * sizeof *t);
    int rc = KVT_ENOMEM;
    if (!gw || !t) goto done;
    if ((rc = kvt_gguf_writer_set_str(gw, "general.architecture", "deepseek4")) ||
        (rc = kvt_gguf_writer_set_str(gw, "general.name", "mtp")))
        goto done;
    size_t n = ds4_tensors(w, t);
    char pre[24], nm[80];
    snprintf(pre, sizeof pre, "blk.%u.", c->L);
    /* the head's parts ds4.c's file always has: the model's where the layer has none */
    const float *hh[3] = {ly->hh_fn ? ly->hh_fn : w->hch_fn, ly->hh_base ? ly->hh_base : w->hch_base,
                          ly->hh_scale ? ly->hh_scale : w->hch_scale};
    for (size_t i = 0; i < n && !rc; i++) {
        const char *sfx = t[i].name + strlen(pre);
        if (strncmp(t[i].name, pre, strlen(pre))) continue;
        const char *x = ds4c_name(sfx, nm, sizeof nm);
        if (!x) { /* eh_proj as its halves: each row's first and second D columns */
            size_t hb = ly->eh.row_bytes / 2;
            uint64_t ne[3] = {c->D, c->D, 1};
            if (kvt_quant_row_bytes(ly->eh.type, c->D) != hb) {
                rc = kvt_fail(KVT_EUNSUPPORTED, "ds4: eh_proj's rows do not split in two");
                break;
            }
            for (int k = 0; k < 2 && !rc; k++) {
                uint8_t *b = kvt_malloc(hb * c->D);
                if (!b) { rc = KVT_ENOMEM; break; }
                for (size_t r = 0; r < c->D; r++) memcpy(b + r * hb, ly->eh.data + r * ly->eh.row_bytes + k * hb, hb);
                rc = kvt_gguf_writer_add_tensor(gw, k ? "mtp.0.h_proj.weight" : "mtp.0.e_proj.weight", ly->eh.type, 2,
                                                ne, b, hb * c->D);
                free(b);
            }
            continue;
        }
        if (!*x) continue;
        const float *v = NULL;
        if (t[i].opt == OPT_DS4C)
            v = !strcmp(sfx, "nextn.hc_head_fn.weight") ? hh[0] : !strcmp(sfx, "nextn.hc_head_base.weight") ? hh[1] : hh[2];
        else if (!strcmp(sfx, "nextn.shared_head_norm.weight"))
            v = ly->head_norm ? ly->head_norm : w->out_norm;
        if (absent(&t[i]) && !v) continue;
        rc = add_tensor(gw, x, &t[i], v);
    }
    if (!rc) rc = kvt_gguf_writer_write(gw, path);
done:
    free(t);
    kvt_gguf_writer_free(gw);
    return rc;
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
        kvt_seg one = {s, tok + done, m, pos0 + done, lg, lf};
        rc = forward_pass(s->pool, wk, &one, 1, replay_from);
        done += m;
    }
    return rc;
}

static int ds4_forward(kvt_session *s, const int32_t *tok, size_t n, size_t pos0, float *logits, size_t lfrom)
{
    return forward_chunk(s, tok, n, pos0, logits, lfrom, SIZE_MAX);
}

/* Segments of at most the first session's pass (wk->ch tokens) in all go
 * through one pass on its scratch (the others' contexts no larger than
 * its, which sizes the attention's and the indexer's scratch); a longer
 * batch runs as forwards one after another. */
static int ds4_forward_batch(const kvt_seg *sg, size_t k)
{
    ds4_work *wk = k ? sg[0].s->work : NULL;
    size_t total = 0, nl = 0, V = k ? sg[0].s->m->info.n_vocab : 0;
    bool one = k > 1 && wk;
    for (size_t g = 0; g < k && one; g++) {
        one = sg[g].n && sg[g].s->m == sg[0].s->m && sg[g].s->n_ctx <= wk->n_ctx && (!g || sg[g].s->work != wk);
        total += sg[g].n;
        nl += sg[g].logits && sg[g].lfrom < sg[g].n ? sg[g].n - sg[g].lfrom : 0;
    }
    int rc = KVT_OK;
    if (!one || total > wk->ch) {
        for (size_t g = 0; g < k && !rc; g++)
            rc = ds4_forward(sg[g].s, sg[g].tok, sg[g].n, sg[g].pos0, sg[g].logits, sg[g].lfrom);
        return rc;
    }
    if (wk->lgb_rows < nl) { /* the logits' rows, before any session changes */
        float *p = kvt_malloc(nl * V * sizeof(float));
        if (!p) return kvt_fail(KVT_ENOMEM, "ds4: logits of %zu rows", nl);
        free(wk->lgb);
        wk->lgb = p;
        wk->lgb_rows = nl;
    }
    kvt_pool *pool = sg[0].s->pool;
    rc = parts_fit(wk, &((const ds4_weights *)sg[0].s->m->weights)->c, kvt_pool_size(pool));
    for (size_t g = 0; g < k && !rc; g++)
        if (sg[g].pos0 + sg[g].n > sg[g].s->n_ctx)
            rc = kvt_fail(KVT_ECTX, "tokens up to %zu exceed the context", sg[g].pos0 + sg[g].n);
    if (!rc) rc = forward_pass(pool, wk, sg, k, SIZE_MAX);
    if (!rc) kvt_ds4_batch_passes++;
    return rc;
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
    out->type_k = out->type_v = KVT_ROWS_F16; /* the model's own rows, whatever cache types are asked */
    out->rows_own = true;
    /* every part, even at 0 bytes: four names, in room for KVT_PLAN_MAX_PARTS */
    kvt_plan_add(out, "window", 0, true);
    kvt_plan_add(out, "compressed", 0, false);
    kvt_plan_add(out, "indexer", 0, false);
    kvt_plan_add(out, "frontier", 0, true);
    for (uint32_t l = 0; l < c->L; l++) {
        uint32_t r = c->ratio[l];
        kvt_plan_add(out, "window", (uint64_t)c->W * c->Dh * 2, true);
        if (r) {
            kvt_plan_add(out, "compressed", ctx / r * c->Dh * 2, false);
            out->per_token_x1000 += 1000ull * c->Dh * 2 / r;
            kvt_plan_add(out, "frontier", r == 4 ? 8ull * 4 * c->Dh * 4 : 128ull * 2 * c->Dh * 4, true);
        }
        if (r == 4) {
            kvt_plan_add(out, "indexer", ctx / 4 * c->Di * 2, false);
            out->per_token_x1000 += 1000ull * c->Di * 2 / 4;
            kvt_plan_add(out, "frontier", 8ull * 4 * c->Di * 4, true);
        }
    }
}

/* ---- ds4 files (general.architecture deepseek4), header only ---- */

/* The configuration a file's header gives, with the loader's reading and
 * checks, without the weights. */
static int header_config(const kvt_gguf *g, ds4_config *c)
{
    ds4_weights *w = kvt_calloc(1, sizeof *w);
    if (!w) return KVT_ENOMEM;
    int rc = read_config(g, &w->c);
    if (!rc) rc = finish_config(w);
    *c = w->c;
    free(w);
    return rc;
}

static int ds4_describe(const kvt_gguf *g, uint64_t ctx, kvt_model_info *info, char *detail, size_t dlen,
                        kvt_plan *plan)
{
    ds4_config c;
    int rc = header_config(g, &c);
    if (rc) return rc;
    uint32_t count[3] = {0};
    for (uint32_t l = 0; l < c.L; l++) count[c.ratio[l] == 0 ? 0 : c.ratio[l] == 4 ? 1 : 2]++;
    uint64_t np = 0, bytes = 0;
    for (size_t i = 0; i < kvt_gguf_n_tensors(g); i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        np += t->n_elem;
        bytes += t->n_bytes;
    }
    *info = (kvt_model_info){.arch = "deepseek4", .name = "", .n_vocab = c.V, .n_ctx_train = c.ctx, .n_embd = c.D,
                             .n_layer = c.L, .n_head = c.H, .n_head_kv = 1, .head_dim = c.Dh, .n_ff = c.Fe,
                             .n_params = np, .bos = -1, .eos = -1, .tokenizer = ""};
    if (detail)
        snprintf(detail, dlen,
                 "experts %u (%u used, %u shared, first %u layers hash-routed), %u streams, window %u, "
                 "layers by compression ratio 0/4/128: %u/%u/%u, indexer %u heads x %u top-%u, "
                 "output %u groups of rank %u, %u prediction layers, %u tensors of %.2f GB",
                 c.E, c.Eu, c.Es, c.n_hash, HC, c.W, count[0], count[1], count[2], c.Hi, c.Di, c.K, c.og, c.orank,
                 c.nextn, (unsigned)kvt_gguf_n_tensors(g), bytes / 1e9);
    if (plan) plan_config(&c, ctx, plan);
    return KVT_OK;
}

/* The scratch ds4_work_new makes for a session of ctx tokens, the default
 * chunk (DEFAULT_PASS) and parts threads, from the header alone: the same
 * sizes (work_sizes), the quantised activations from the header's matrix
 * types (a file's types are kept as they are), without the allocator's
 * rounding. */
static int ds4_work_estimate(const kvt_gguf *g, uint64_t ctx, uint32_t parts, uint64_t *bytes)
{
    ds4_config c;
    int rc = header_config(g, &c);
    if (rc) return rc;
    if (ctx == 0 || ctx > (1u << 24)) return kvt_fail(KVT_EINVAL, "context of %llu tokens is out of range",
                                                      (unsigned long long)ctx);
    size_t qb = 0;
    for (size_t i = 0; i < kvt_gguf_n_tensors(g); i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        size_t b = t->n_dims >= 2 ? kvt_q_act_bytes(t->type, DEFAULT_PASS, t->ne[0]) : 0;
        qb = b > qb ? b : qb;
    }
    size_t sz[WORK_BUFS], m4, nk;
    work_sizes(&c, DEFAULT_PASS, ctx, parts ? parts : 1, qb, sz, &m4, &nk);
    uint64_t n = sizeof(ds4_work);
    for (size_t i = 0; i < WORK_BUFS; i++) n += sz[i];
    *bytes = n;
    return KVT_OK;
}

static int ds4_plan_preset(const char *preset, uint64_t ctx, kvt_plan *out)
{
    ds4_config c;
    if (!preset || !preset_config(preset, &c)) return kvt_fail(KVT_ENOENT, "no ds4 preset '%s'", preset ? preset : "");
    plan_config(&c, ctx, out);
    return KVT_OK;
}

static int ds4_plan(const kvt_model *m, uint64_t ctx, kvt_plan *out)
{
    if (m->arch != &kvt_arch_ds4) return kvt_fail(KVT_EINVAL, "not a ds4 model");
    plan_config(&((const ds4_weights *)m->weights)->c, ctx, out);
    return KVT_OK;
}

/* A preset, or a shape variant of one ("ds4-tiny+W=32,K=4": docs/ds4.md). */
static bool ds4_is_preset(const char *name)
{
    return !strcmp(name, "ds4-tiny") || !strcmp(name, "ds4-mini") || !strncmp(name, "ds4-tiny+", 9) ||
           !strncmp(name, "ds4-mini+", 9) || !strcmp(name, "ds4-flash-bench") || !strncmp(name, "ds4-flash-bench+", 16);
}

static bool ds4_handles(const kvt_gguf *g)
{
    const char *a;
    size_t n;
    return kvt_gguf_get_str(g, "general.architecture", &a, &n) == KVT_OK && n == 9 && !memcmp(a, "deepseek4", 9);
}

static const kvt_mtp_ops ds4_mtp = {
    .layers = kvt_ds4_mtp_layers,
    .hidden_floats = kvt_ds4_hidden_floats,
    .window = kvt_ds4_mtp_window,
    .ring_bytes = kvt_ds4_mtp_ring_bytes,
    .hidden = kvt_ds4_hidden,
    .step = kvt_ds4_mtp_step,
    .attach = kvt_ds4_mtp_attach,
    .write_file = kvt_ds4_mtp_write_ds4c,
};

const kvt_arch kvt_arch_ds4 = {
    .name = "ds4",
    .handles = ds4_handles,
    .load = ds4_load,
    .describe = ds4_describe,
    .work_estimate = ds4_work_estimate,
    .is_preset = ds4_is_preset,
    .presets = "ds4-tiny, ds4-mini",
    .preset = ds4_preset,
    .plan_preset = ds4_plan_preset,
    .write_gguf = kvt_ds4_write_gguf,
    .write_preset = kvt_ds4_write_preset,
    .replay_tokens = kvt_ds4_replay_tokens,
    .plan = ds4_plan,
    .cache_new = ds4_cache_new,
    .forward = ds4_forward,
    .forward_batch = ds4_forward_batch,
    .state_save = ds4_state_save,
    .state_load = ds4_state_load,
    .state_rebuild = ds4_state_rebuild,
    .fingerprint = ds4_fingerprint,
    .weights_free = ds4_free,
    .work_new = ds4_work_new,
    .work_free = ds4_work_free,
    .work_bytes = ds4_work_bytes,
    .mtp = &ds4_mtp,
};
