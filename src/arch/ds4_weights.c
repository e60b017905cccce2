/* The ds4 architecture's weights: the configuration (the presets and their
 * shape variants, a deepseek4 GGUF's metadata, checked, and the cache
 * geometry derived from it), the tensor table (one list drives generation,
 * loading and writing), the synthetic weights, reading a GGUF's tensors in
 * place (the file's own type) or as f32 copies, the GGUF writers (the
 * model's file in memory, a preset's streamed to disk) and ds4.c's separate
 * MTP file. The passes over them are ds4.c's; docs/ds4.md gives the layout.
 *
 * Synthetic weights (no weight file): every tensor, in the order
 * kvt_ds4_tensors lists them, is filled from one splitmix64 stream seeded
 * with the model seed (docs/ds4.md, "Synthetic weights").
 */
#include "arch/ds4_weights.h"
#include "arch/tensor.h"
#include "kernels/kernels.h"
#include "format/quant.h"
#include "base/util.h"

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <unistd.h>
#include <xxhash.h>
#include <stdlib.h>
#include <string.h>

#define GGML_I32 26

int kvt_ds4_fault;

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

bool kvt_ds4_preset_config(const char *name, ds4_config *c)
{
    memset(c, 0, sizeof *c);
    const char *plus = strchr(name, '+');
    if (plus) {
        char base[16];
        size_t bl = (size_t)(plus - name);
        if (bl >= sizeof base) return false;
        memcpy(base, name, bl);
        base[bl] = 0;
        if (!strcmp(base, "ds4-flash") || !kvt_ds4_preset_config(base, c)) return false;
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

static size_t tcount(const tdesc *t) { return (size_t)(t->ne[0] * t->ne[1] * t->ne[2]); }

/* An optional tensor the weights do not have. */
static bool absent(const tdesc *t) { return t->opt && (t->mat ? !t->mat->data : !*t->slot); }

size_t kvt_ds4_tensors(ds4_weights *w, tdesc *t)
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

void kvt_ds4_weights_free(void *p)
{
    ds4_weights *w = p;
    if (!w) return;
    tdesc *t = malloc(MAX_TENSORS * sizeof *t);
    if (t) {
        size_t n = kvt_ds4_tensors(w, t);
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
    size_t n = kvt_ds4_tensors(w, t);
    for (size_t i = 0; i < n; i++) np += absent(&t[i]) ? 0 : tcount(&t[i]);
    free(t);
    return np;
}

/* m's info from w (the row, ds4.c, sets m->arch). */
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
    w->own[w->n_own++] = p; /* at most one per tensor: kvt_ds4_tensors lists at most MAX_TENSORS */
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
    size_t n = kvt_ds4_tensors(w, t);
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

int kvt_ds4_weights_preset(kvt_model *m, const char *preset, uint64_t seed, kvt_tokenizer *tok)
{
    ds4_weights *w = kvt_calloc(1, sizeof *w);
    if (!w) return KVT_ENOMEM;
    if (!kvt_ds4_preset_config(preset, &w->c) || !strcmp(preset, "ds4-flash")) {
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
    if (rc) { kvt_ds4_weights_free(w); return rc; }
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

/* The configuration a file's header gives, with the loader's reading and
 * checks, without the weights. */
int kvt_ds4_header_config(const kvt_gguf *g, ds4_config *c)
{
    ds4_weights *w = kvt_calloc(1, sizeof *w);
    if (!w) return KVT_ENOMEM;
    int rc = read_config(g, &w->c);
    if (!rc) rc = finish_config(w);
    *c = w->c;
    free(w);
    return rc;
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

int kvt_ds4_weights_load(kvt_model *m, const kvt_gguf *g)
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
    size_t n = kvt_ds4_tensors(w, t);
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
    kvt_ds4_weights_free(w);
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

int kvt_ds4_weights_write_gguf(const kvt_model *m, const char *path)
{
    ds4_weights *w = m->weights;
    const ds4_config *c = &w->c;
    kvt_gguf_writer *gw = kvt_gguf_writer_new();
    tdesc *t = kvt_malloc(MAX_TENSORS * sizeof *t);
    int rc = KVT_ENOMEM;
    if (!gw || !t || (rc = write_meta(gw, c, m->info.name, w->seed, m->tok))) goto done;
    size_t n = kvt_ds4_tensors(w, t);
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
    if (!kvt_ds4_preset_config(preset, &w->c)) {
        rc = kvt_fail(KVT_ENOENT, "no ds4 preset '%s'", preset);
        goto done;
    }
    w->c.V = kvt_tokenizer_n_vocab(tok);
    w->seed = seed;
    if ((rc = finish_config(w)) || (rc = write_meta(gw, &w->c, preset, seed, tok))) goto done;
    size_t n = kvt_ds4_tensors(w, t);
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

uint64_t kvt_ds4_weights_fingerprint(const void *p)
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
        size_t n = kvt_ds4_tensors((ds4_weights *)w, t);
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

int kvt_ds4_weights_mtp_attach(kvt_model *m, kvt_gguf *g)
{
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
    size_t n = rc ? 0 : kvt_ds4_tensors(w, t), first = n;
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

int kvt_ds4_weights_mtp_write(const kvt_model *m, const char *path)
{
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
    size_t n = kvt_ds4_tensors(w, t);
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
