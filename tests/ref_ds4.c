/* An f64 reference forward for DeepSeek-V4 GGUF files in llama.cpp's
 * `deepseek4` layout, written from the math of llama.cpp's graph
 * (src/models/deepseek4.cpp, build_moe_ffn/build_ffn in src/llama-graph.cpp,
 * the row visibility of src/llama-kv-cache-dsv4.cpp, rope_yarn and
 * swiglu_clamp in ggml-cpu/ops.cpp) with no cache and no incremental state:
 * each layer computes, for the whole sequence at once, the normed inputs,
 * every raw row, every compressed and indexer row of every complete block,
 * and then for each position t the rows visible at t. Nothing is carried
 * between positions except through the residual streams, so causality is
 * structural.
 *
 * It reads tensors through the GGUF reader only and shares no code with
 * src/arch/ds4.c, src/kernels/kernels.c or src/cache/cache.c (its binary16 rounding, RoPE and
 * Hadamard rotation included), so agreement between the two is evidence, not
 * tautology. Speed is not a goal; T = 1000 on ds4-tiny takes well under a
 * second.
 *
 * Where values are rounded: exactly where llama.cpp stores them in its f16
 * caches: raw rows after RoPE, compressed rows after RoPE, indexer rows after
 * RoPE and the Hadamard rotation. Everything else is f64. */
#include "ref.h"
#include "format/gguf.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* An indexer top-k cut or an expert routing cut whose K-th and (K+1)-th
 * scores are closer than this, relative to the magnitude of the terms that
 * make them, could come out the other way in f32: those positions are
 * flagged ambiguous. */
#define AMBIG_REL 1e-6

#define HC 4                   /* hyper-connection streams */
#define HC_MIX ((2 + HC) * HC) /* pre (4), post (4), comb (4 x 4) */
#define GGML_TYPE_I32 26
#define MAXL 256
#define PI 3.14159265358979323846

/* RoPE of one kind: base, frequency scale, YaRN extrapolation factor and the
 * YaRN correction dims [lo, hi] (unused when ext = 0). */
typedef struct rp {
    double base, fscale, ext, lo, hi;
} rp;

typedef struct cfg {
    size_t V, D, L, H, Dh, Dr, Rq, W, Hi, Di, K, og, orank, E, Es, iters, n_hash, nrot;
    size_t Eu[MAXL], Fe[MAXL], ratio[MAXL];
    double clamp_exp[MAXL], clamp_sh[MAXL];
    double eps, hc_eps, wscale;
    bool wnorm;
    rp r_raw, r_comp; /* ratio-0 layers; compressed layers, their rows and the indexer */
} cfg;

/* One layer's weights in double, each matrix W(out, in) row-major as stored
 * (ne = (in, out)); experts (E, out, in). */
typedef struct lw {
    double *attn_norm, *sinks, *q_a, *q_a_norm, *q_b, *kv, *kv_norm, *wo_a, *wo_b;
    double *hca_fn, *hca_base, *hca_scale, *hcf_fn, *hcf_base, *hcf_scale;
    double *c_kv, *c_gate, *c_ape, *c_norm;                 /* ratio > 0 */
    double *i_proj, *i_qb, *i_kv, *i_gate, *i_ape, *i_norm; /* ratio 4 */
    double *ffn_norm, *gate_inp, *probs_b;                  /* probs_b: not hash-routed */
    double *gate_x, *up_x, *down_x, *gate_s, *up_s, *down_s;
} lw;
#define LW_N (sizeof(lw) / sizeof(double *))

/* Tensor name of exactly ne = (ne0, ne1, ne2), converted to double; NULL when
 * absent or shaped otherwise. */
static double *load(const kvt_gguf *g, const char *name, size_t ne0, size_t ne1, size_t ne2)
{
    const kvt_gguf_tensor *t = kvt_gguf_find_tensor(g, name);
    if (!t || t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != ne2 || t->ne[3] != 1 || !t->n_elem) return NULL;
    size_t n = (size_t)t->n_elem;
    float *f = malloc(n * sizeof *f);
    double *d = malloc(n * sizeof *d);
    if (!f || !d || kvt_gguf_tensor_to_f32(t, f, n) != KVT_OK) { free(f); free(d); return NULL; }
    for (size_t i = 0; i < n; i++) d[i] = f[i];
    free(f);
    return d;
}

static int load_layer(const kvt_gguf *g, const cfg *c, size_t l, lw *w, int32_t **tid)
{
    size_t r = c->ratio[l], cw = (r == 4 ? 2 : 1) * c->Dh, HD = c->H * c->Dh, D = c->D;
    size_t E = c->E, Fe = c->Fe[l], Fs = Fe * c->Es, Di = c->Di;
    bool hash = l < c->n_hash;
    struct { double **p; const char *n; size_t ne0, ne1, ne2; bool need; } t[] = {
        {&w->attn_norm, "attn_norm.weight", D, 1, 1, true},
        {&w->sinks, "attn_sinks.weight", c->H, 1, 1, true},
        {&w->q_a, "attn_q_a.weight", D, c->Rq, 1, true},
        {&w->q_a_norm, "attn_q_a_norm.weight", c->Rq, 1, 1, true},
        {&w->q_b, "attn_q_b.weight", c->Rq, HD, 1, true},
        {&w->kv, "attn_kv.weight", D, c->Dh, 1, true},
        {&w->kv_norm, "attn_kv_a_norm.weight", c->Dh, 1, 1, true},
        {&w->wo_a, "attn_output_a.weight", HD / c->og, c->orank * c->og, 1, true},
        {&w->wo_b, "attn_output_b.weight", c->og * c->orank, D, 1, true},
        {&w->hca_fn, "hc_attn_fn.weight", HC * D, HC_MIX, 1, true},
        {&w->hca_base, "hc_attn_base.weight", HC_MIX, 1, 1, true},
        {&w->hca_scale, "hc_attn_scale.weight", 3, 1, 1, true},
        {&w->hcf_fn, "hc_ffn_fn.weight", HC * D, HC_MIX, 1, true},
        {&w->hcf_base, "hc_ffn_base.weight", HC_MIX, 1, 1, true},
        {&w->hcf_scale, "hc_ffn_scale.weight", 3, 1, 1, true},
        {&w->c_kv, "attn_compressor_kv.weight", D, cw, 1, r > 0},
        {&w->c_gate, "attn_compressor_gate.weight", D, cw, 1, r > 0},
        {&w->c_ape, "attn_compressor_ape.weight", cw, r, 1, r > 0},
        {&w->c_norm, "attn_compressor_norm.weight", c->Dh, 1, 1, r > 0},
        {&w->i_proj, "indexer.proj.weight", D, c->Hi, 1, r == 4},
        {&w->i_qb, "indexer.attn_q_b.weight", c->Rq, c->Hi * Di, 1, r == 4},
        {&w->i_kv, "indexer_compressor_kv.weight", D, 2 * Di, 1, r == 4},
        {&w->i_gate, "indexer_compressor_gate.weight", D, 2 * Di, 1, r == 4},
        {&w->i_ape, "indexer_compressor_ape.weight", 2 * Di, 4, 1, r == 4},
        {&w->i_norm, "indexer_compressor_norm.weight", Di, 1, 1, r == 4},
        {&w->ffn_norm, "ffn_norm.weight", D, 1, 1, true},
        {&w->gate_inp, "ffn_gate_inp.weight", D, E, 1, true},
        {&w->probs_b, "exp_probs_b.bias", E, 1, 1, !hash},
        {&w->gate_x, "ffn_gate_exps.weight", D, Fe, E, true},
        {&w->up_x, "ffn_up_exps.weight", D, Fe, E, true},
        {&w->down_x, "ffn_down_exps.weight", Fe, D, E, true},
        {&w->gate_s, "ffn_gate_shexp.weight", D, Fs, 1, true},
        {&w->up_s, "ffn_up_shexp.weight", D, Fs, 1, true},
        {&w->down_s, "ffn_down_shexp.weight", Fs, D, 1, true},
    };
    memset(w, 0, sizeof *w);
    *tid = NULL;
    char nm[96];
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        if (!t[i].need) continue;
        snprintf(nm, sizeof nm, "blk.%zu.%s", l, t[i].n);
        if (!(*t[i].p = load(g, nm, t[i].ne0, t[i].ne1, t[i].ne2))) return -1;
    }
    if (hash) { /* token -> Eu expert ids, I32 (Eu, V) */
        snprintf(nm, sizeof nm, "blk.%zu.ffn_gate_tid2eid.weight", l);
        const kvt_gguf_tensor *tt = kvt_gguf_find_tensor(g, nm);
        size_t n = c->Eu[l] * c->V;
        if (!tt || tt->type != GGML_TYPE_I32 || tt->ne[0] != c->Eu[l] || tt->ne[1] != c->V || tt->ne[2] != 1 ||
            tt->ne[3] != 1 || tt->n_bytes != n * 4 || !tt->data || !(*tid = malloc(n * sizeof **tid)))
            return -1;
        memcpy(*tid, tt->data, n * 4);
        for (size_t i = 0; i < n; i++)
            if ((*tid)[i] < 0 || (size_t)(*tid)[i] >= E) return -1;
    }
    return 0;
}

static void free_layer(lw *w)
{
    double **p = (double **)w;
    for (size_t i = 0; i < LW_N; i++) free(p[i]);
}

/* y(out) = W(out, in) x(in) */
static void mv(double *y, const double *W, const double *x, size_t in, size_t out)
{
    for (size_t o = 0; o < out; o++) {
        double s = 0;
        for (size_t i = 0; i < in; i++) s += W[o * in + i] * x[i];
        y[o] = s;
    }
}

/* o = x / sqrt(mean(x^2) + eps), times w when w is non-NULL. o may be x. */
static void rmsnorm(double *o, const double *x, const double *w, size_t n, double eps)
{
    double ss = 0;
    for (size_t i = 0; i < n; i++) ss += x[i] * x[i];
    double s = 1.0 / sqrt(ss / (double)n + eps);
    for (size_t i = 0; i < n; i++) o[i] = x[i] * s * (w ? w[i] : 1.0);
}

static double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* The YaRN correction dims of n_rot rotary dims (ggml_rope_yarn_corr_dims):
 * the pair index at which a dimension completes beta rotations over n_orig
 * positions is n_rot * ln(n_orig / (2 pi beta)) / (2 ln base); lo from
 * beta_fast = 32 (floored, at least 0), hi from beta_slow = 1 (ceiled, at
 * most n_rot - 1). */
static void yarn_dims(rp *p, size_t n_rot, size_t n_orig)
{
    double dlo = (double)n_rot * log((double)n_orig / (32.0 * 2 * PI)) / (2 * log(p->base));
    double dhi = (double)n_rot * log((double)n_orig / (1.0 * 2 * PI)) / (2 * log(p->base));
    p->lo = fmax(0, floor(dlo));
    p->hi = fmin((double)n_rot - 1, ceil(dhi));
}

/* Rotate adjacent pairs (ggml's NORM mode) of the last n_rot of the n dims of
 * v, pair i by sign * theta_i at pos. theta_i = pos * base^(-2i/n_rot) scaled
 * by fscale, with YaRN blending back the unscaled angle for the fast pairs:
 * ramp_i = 1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1), mixed by ext. The
 * YaRN magnitude factor 1 + 0.1 ln(1/fscale) is cancelled exactly by the
 * attention factor deepseek4 passes, so the rotation stays orthonormal.
 * sign = -1 is the inverse. */
static void rope(double *v, size_t n, size_t n_rot, size_t pos, const rp *p, double sign)
{
    double *r = v + (n - n_rot);
    for (size_t i = 0; i < n_rot / 2; i++) {
        double ex = (double)pos * pow(p->base, -(double)(2 * i) / (double)n_rot);
        double th = p->fscale * ex;
        if (p->ext != 0) {
            double y = ((double)i - p->lo) / fmax(0.001, p->hi - p->lo);
            double mix = (1 - fmin(1, fmax(0, y))) * p->ext;
            th = th * (1 - mix) + ex * mix;
        }
        double c = cos(th), s = sign * sin(th), a = r[2 * i], b = r[2 * i + 1];
        r[2 * i] = a * c - b * s;
        r[2 * i + 1] = a * s + b * c;
    }
}

/* v (n) <- blockwise orthonormal Sylvester-Hadamard rotation of order m:
 * y_i = sum_j (-1)^popcount(i & j) x_j / sqrt(m) on each block of m. */
static void hadamard(double *v, size_t n, size_t m, double *tmp)
{
    double s = 1.0 / sqrt((double)m);
    for (size_t b = 0; b < n; b += m) {
        for (size_t i = 0; i < m; i++) {
            double acc = 0;
            for (size_t j = 0; j < m; j++) acc += (__builtin_popcountll(i & j) & 1) ? -v[b + j] : v[b + j];
            tmp[i] = acc * s;
        }
        memcpy(v + b, tmp, m * sizeof *v);
    }
}

/* Round x to the nearest IEEE binary16 value (ties to even), returned as a
 * double. A binary16 number with |x| in [2^(e-1), 2^e) has 11 significant bits,
 * so its spacing is 2^(e-11); below 2^-14 the spacing stays at 2^-24
 * (subnormals). Scaling by a power of two is exact in double, and rint rounds
 * ties to even in the default rounding mode. Past the largest finite value
 * 65504 the result is infinity (65520 and up, as in IEEE). */
static double f16r(double x)
{
    if (!isfinite(x) || x == 0) return x;
    int e;
    frexp(x, &e);
    int q = e - 11 < -24 ? -24 : e - 11;
    double y = ldexp(rint(ldexp(x, -q)), q);
    if (fabs(y) > 65504.0) y = copysign(INFINITY, x);
    return y;
}

/* Compressed rows (nb, w), nb = T / r complete blocks, of one compressor from
 * the normed layer inputs h (T, D): kv = Wkv h_s and score = Wg h_s +
 * ape[s mod r] (width c*w, c = 2 for r = 4). Row i pools, per channel, a
 * softmax over its positions of the scores weighting kv: for r = 128 the
 * positions i*128 .. i*128+127 with channels [0, w); for r = 4 (overlapping)
 * the previous block's positions (i-1)*4 .. i*4-1 with channels [0, w) (none
 * for row 0: llama.cpp's zero kv / -inf score row) and block i's with
 * channels [w, 2w). Then RMSNorm * norm, RoPE of the last n_rot dims at the
 * block's first position i*r, the Hadamard rotation when hd (order hd), and
 * binary16. */
static int compress(double *rows, const double *h, size_t T, const cfg *cf, size_t r, size_t w,
                    const double *Wkv, const double *Wg, const double *ape, const double *norm, size_t hd)
{
    size_t c = r == 4 ? 2 : 1, cw = c * w, nb = T / r;
    double *ckv = malloc((nb * r + 1) * cw * sizeof *ckv), *csc = malloc((nb * r + 1) * cw * sizeof *csc);
    double *sc = malloc(2 * r * sizeof *sc), *val = malloc(2 * r * sizeof *val);
    double *tmp = malloc((hd ? hd : 1) * sizeof *tmp);
    if (!ckv || !csc || !sc || !val || !tmp) { free(ckv); free(csc); free(sc); free(val); free(tmp); return -1; }
    for (size_t t = 0; t < nb * r; t++) {
        mv(ckv + t * cw, Wkv, h + t * cf->D, cf->D, cw);
        mv(csc + t * cw, Wg, h + t * cf->D, cf->D, cw);
        for (size_t j = 0; j < cw; j++) csc[t * cw + j] += ape[(t % r) * cw + j];
    }
    for (size_t b = 0; b < nb; b++) {
        double *p = rows + b * w;
        for (size_t j = 0; j < w; j++) {
            size_t n = 0;
            if (r == 4 && b > 0)
                for (size_t s = (b - 1) * r; s < b * r; s++, n++) {
                    sc[n] = csc[s * cw + j];
                    val[n] = ckv[s * cw + j];
                }
            for (size_t s = b * r; s < (b + 1) * r; s++, n++) {
                sc[n] = csc[s * cw + (c - 1) * w + j];
                val[n] = ckv[s * cw + (c - 1) * w + j];
            }
            double mx = -INFINITY, z = 0, acc = 0;
            for (size_t i = 0; i < n; i++) mx = sc[i] > mx ? sc[i] : mx;
            for (size_t i = 0; i < n; i++) {
                double e = exp(sc[i] - mx);
                z += e;
                acc += e * val[i];
            }
            p[j] = acc / z;
        }
        rmsnorm(p, p, norm, w, cf->eps);
        rope(p, w, cf->Dr, b * r, &cf->r_comp, 1.0);
        if (hd) hadamard(p, w, hd, tmp);
        for (size_t j = 0; j < w; j++) p[j] = f16r(p[j]);
    }
    free(ckv); free(csc); free(sc); free(val); free(tmp);
    return 0;
}

/* Pick the K best of score[0..n) (ties: lower index first) into sel (n, 0/1).
 * Returns 1 when the cut between the K-th and (K+1)-th best is within
 * AMBIG_REL of the larger of their magnitudes mag[] (mag[c] bounds what f32
 * rounding error in score[c] scales with), else 0. n > K. */
static int topk(const double *score, const double *mag, size_t n, size_t K, unsigned char *sel)
{
    size_t last = 0, next = n;
    memset(sel, 0, n);
    for (size_t k = 0; k <= K; k++) {
        size_t best = n;
        for (size_t c = 0; c < n; c++)
            if (!sel[c] && (best == n || score[c] > score[best])) best = c;
        if (k == K) { next = best; break; }
        sel[best] = 1;
        last = best;
    }
    double gap = score[last] - score[next];
    double m = mag[last] > mag[next] ? mag[last] : mag[next];
    return gap < AMBIG_REL * m;
}

/* The hyper-connection mixes of one token's streams x (4, D) for a sublayer:
 * pre (4), post (4), comb (4 src x 4 dst, Sinkhorn-normalised). */
static void hc_mix(const double *x, const double *fn, const double *base, const double *scale, size_t n_mix,
                   const cfg *c, double *flat, double *pre, double *post, double *comb)
{
    size_t D = c->D;
    double mix[HC_MIX];
    rmsnorm(flat, x, NULL, HC * D, c->eps);
    mv(mix, fn, flat, HC * D, n_mix);
    for (size_t h = 0; h < HC; h++) pre[h] = sigmoid(mix[h] * scale[0] + base[h]) + c->hc_eps;
    if (!post) return;
    for (size_t h = 0; h < HC; h++) post[h] = 2.0 * sigmoid(mix[HC + h] * scale[1] + base[HC + h]);
    double *m = comb; /* m[src*4 + dst] */
    for (size_t i = 0; i < HC * HC; i++) m[i] = mix[2 * HC + i] * scale[2] + base[2 * HC + i];
    for (size_t s = 0; s < HC; s++) { /* softmax over dst, then + eps */
        double mx = -INFINITY, z = 0;
        for (size_t d = 0; d < HC; d++) mx = fmax(mx, m[s * HC + d]);
        for (size_t d = 0; d < HC; d++) z += (m[s * HC + d] = exp(m[s * HC + d] - mx));
        for (size_t d = 0; d < HC; d++) m[s * HC + d] = m[s * HC + d] / z + c->hc_eps;
    }
    for (size_t it = 0; it < c->iters; it++) {
        if (it > 0)
            for (size_t s = 0; s < HC; s++) { /* rows: each src sums to 1 over dst */
                double z = c->hc_eps;
                for (size_t d = 0; d < HC; d++) z += m[s * HC + d];
                for (size_t d = 0; d < HC; d++) m[s * HC + d] /= z;
            }
        for (size_t d = 0; d < HC; d++) { /* columns: each dst sums to 1 over src */
            double z = c->hc_eps;
            for (size_t s = 0; s < HC; s++) z += m[s * HC + d];
            for (size_t s = 0; s < HC; s++) m[s * HC + d] /= z;
        }
    }
}

/* x (4, D) <- f * post[dst] + sum_src x_old[src] * comb[src][dst]. */
static void hc_post(double *x, const double *f, const double *post, const double *comb, size_t D, double *old)
{
    memcpy(old, x, HC * D * sizeof *x);
    for (size_t d = 0; d < HC; d++)
        for (size_t i = 0; i < D; i++) {
            double s = f[i] * post[d];
            for (size_t src = 0; src < HC; src++) s += old[src * D + i] * comb[src * HC + d];
            x[d * D + i] = s;
        }
}

/* out (D) = W_down (act(W_gate x) * W_up x) with the clamped SwiGLU:
 * silu(min(g, L)) * clamp(u, -L, L), plain silu(g) * u when L <= 1e-6. */
static void swiglu(double *out, const double *Wg, const double *Wu, const double *Wd, const double *x, size_t D,
                   size_t F, double lim, double *g, double *u)
{
    mv(g, Wg, x, D, F);
    mv(u, Wu, x, D, F);
    for (size_t i = 0; i < F; i++) {
        double a = g[i], b = u[i];
        if (lim > 1e-6) {
            a = fmin(a, lim);
            b = fmax(-lim, fmin(b, lim));
        }
        g[i] = a * sigmoid(a) * b;
    }
    mv(out, Wd, g, F, D);
}

/* Flag position t as ambiguous, and every later one unless last. */
static void flag(unsigned char *amb, size_t t, size_t T, bool last)
{
    if (amb)
        for (size_t u = t; u < (last ? t + 1 : T); u++) amb[u] = 1;
}

/* One layer over all T positions, updating the streams x (T, 4, D) in place.
 * last: no layer follows (see the ambiguity note at ref_ds4_logits). */
static int layer(double *x, const int32_t *tok, size_t T, const cfg *c, size_t l, const lw *w,
                 const int32_t *tid, bool last, unsigned char *ambiguous)
{
    size_t D = c->D, Dh = c->Dh, H = c->H, HD = H * Dh, Rq = c->Rq, Hi = c->Hi, Di = c->Di, E = c->E;
    size_t r = c->ratio[l], nb = r ? T / r : 0, HiDi = Hi * Di, Eu = c->Eu[l], Fe = c->Fe[l], Fs = Fe * c->Es;
    size_t og = c->og, gdim = HD / og, Fmax = Fs > Fe ? Fs : Fe;
    const rp *rl = r ? &c->r_comp : &c->r_raw;
    double *h = malloc(T * D * sizeof *h);          /* (T, D) normed attention inputs */
    double *post = malloc(T * HC * sizeof *post);   /* (T, 4) */
    double *comb = malloc(T * HC * HC * sizeof *comb); /* (T, 4, 4) */
    double *qr = malloc(T * Rq * sizeof *qr);       /* (T, Rq) */
    double *q = malloc(T * HD * sizeof *q);         /* (T, H, Dh) */
    double *k = malloc(T * Dh * sizeof *k);         /* (T, Dh) raw rows */
    double *crow = malloc((nb + 1) * Dh * sizeof *crow); /* (nb, Dh) compressed rows */
    double *irow = malloc((nb + 1) * Di * sizeof *irow); /* (nb, Di) indexer rows */
    double *qI = malloc(HiDi * sizeof *qI), *wI = malloc(Hi * sizeof *wI); /* (Hi, Di) (Hi) */
    double *score = malloc((nb + 1) * sizeof *score), *mag = malloc((nb + 1) * sizeof *mag); /* (nb) */
    unsigned char *sel = malloc(nb + E + 1);        /* (max(nb, E)) */
    const double **keys = malloc((nb + c->W) * sizeof *keys); /* (n_keys) pointers to rows */
    double *s = malloc((nb + c->W) * sizeof *s);    /* (n_keys) attention scores */
    double *att = malloc(HD * sizeof *att), *oa = malloc(og * c->orank * sizeof *oa);
    double *flat = malloc(HC * D * sizeof *flat), *old = malloc(HC * D * sizeof *old);
    size_t nt = D > Rq ? D : Rq;
    nt = nt > HiDi ? nt : HiDi;
    double *tmp = malloc(nt * sizeof *tmp), *a = malloc(D * sizeof *a), *f = malloc(D * sizeof *f);
    double *eo = malloc(D * sizeof *eo), *g1 = malloc(Fmax * sizeof *g1), *g3 = malloc(Fmax * sizeof *g3);
    double *pr = malloc(E * sizeof *pr), *sp = malloc(E * sizeof *sp);
    double *em = malloc(E * sizeof *em);
    int rc = -1;
    if (!h || !post || !comb || !qr || !q || !k || !crow || !irow || !qI || !wI || !score || !mag || !sel ||
        !keys || !s || !att || !oa || !flat || !old || !tmp || !a || !f || !eo || !g1 || !g3 || !pr ||
        !sp || !em)
        goto done;

    /* Everything a position may look at, for the whole sequence. */
    for (size_t t = 0; t < T; t++) {
        double pre[HC];
        const double *xt = x + t * HC * D;
        double *ht = h + t * D, *qt = q + t * HD, *kt = k + t * Dh;
        hc_mix(xt, w->hca_fn, w->hca_base, w->hca_scale, HC_MIX, c, flat, pre, post + t * HC, comb + t * HC * HC);
        for (size_t i = 0; i < D; i++) {
            double v = 0;
            for (size_t hh = 0; hh < HC; hh++) v += pre[hh] * xt[hh * D + i];
            ht[i] = v;
        }
        rmsnorm(ht, ht, w->attn_norm, D, c->eps);
        mv(tmp, w->q_a, ht, D, Rq);
        rmsnorm(qr + t * Rq, tmp, w->q_a_norm, Rq, c->eps);
        mv(qt, w->q_b, qr + t * Rq, Rq, HD);
        for (size_t hh = 0; hh < H; hh++) {
            rmsnorm(qt + hh * Dh, qt + hh * Dh, NULL, Dh, c->eps);
            rope(qt + hh * Dh, Dh, c->Dr, t, rl, 1.0);
        }
        mv(kt, w->kv, ht, D, Dh);
        rmsnorm(kt, kt, w->kv_norm, Dh, c->eps);
        rope(kt, Dh, c->Dr, t, rl, 1.0);
        for (size_t j = 0; j < Dh; j++) kt[j] = f16r(kt[j]);
    }
    if (r && compress(crow, h, T, c, r, Dh, w->c_kv, w->c_gate, w->c_ape, w->c_norm, 0)) goto done;
    if (r == 4 && compress(irow, h, T, c, 4, Di, w->i_kv, w->i_gate, w->i_ape, w->i_norm, c->nrot)) goto done;

    /* Per position: the visible keys, attention with sinks, the grouped output
     * projection, the hyper-connection update. All of h/q/k/crow/irow were
     * computed before any position's streams changed. */
    for (size_t t = 0; t < T; t++) {
        size_t nc = r ? (t + 1) / r : 0, nk = 0;
        if (r == 4 && nc > c->K) {
            mv(qI, w->i_qb, qr + t * Rq, Rq, HiDi);
            for (size_t hh = 0; hh < Hi; hh++) {
                rope(qI + hh * Di, Di, c->Dr, t, &c->r_comp, 1.0);
                hadamard(qI + hh * Di, Di, c->nrot, tmp);
            }
            mv(wI, w->i_proj, h + t * D, D, Hi);
            for (size_t hh = 0; hh < Hi; hh++) wI[hh] /= sqrt((double)(Di * Hi));
            for (size_t cc = 0; cc < nc; cc++) {
                score[cc] = mag[cc] = 0;
                for (size_t hh = 0; hh < Hi; hh++) {
                    double d = 0, m = 0;
                    for (size_t j = 0; j < Di; j++) {
                        d += qI[hh * Di + j] * irow[cc * Di + j];
                        m += fabs(qI[hh * Di + j] * irow[cc * Di + j]);
                    }
                    score[cc] += wI[hh] * (d > 0 ? d : 0);
                    /* A head whose dot is clearly negative contributes an exact 0
                     * in any precision; otherwise its rounding scales with m. */
                    if (d > -AMBIG_REL * m) mag[cc] += fabs(wI[hh]) * m;
                }
            }
            if (topk(score, mag, nc, c->K, sel)) flag(ambiguous, t, T, last);
        } else {
            memset(sel, 1, nc); /* r = 128, or r = 4 with at most K rows: all */
        }
        for (size_t cc = 0; cc < nc; cc++)
            if (sel[cc]) keys[nk++] = crow + cc * Dh;
        for (size_t p = t + 1 > c->W ? t + 1 - c->W : 0; p <= t; p++) keys[nk++] = k + p * Dh;

        for (size_t hh = 0; hh < H; hh++) {
            const double *qh = q + t * HD + hh * Dh;
            double *o = att + hh * Dh, z = w->sinks[hh], m = z, den;
            for (size_t i = 0; i < nk; i++) {
                double d = 0;
                for (size_t j = 0; j < Dh; j++) d += qh[j] * keys[i][j];
                s[i] = d / sqrt((double)Dh);
                m = s[i] > m ? s[i] : m;
            }
            den = exp(z - m); /* the sink: in the denominator only */
            for (size_t j = 0; j < Dh; j++) o[j] = 0;
            for (size_t i = 0; i < nk; i++) {
                double e = exp(s[i] - m);
                den += e;
                for (size_t j = 0; j < Dh; j++) o[j] += e * keys[i][j];
            }
            for (size_t j = 0; j < Dh; j++) o[j] /= den;
            rope(o, Dh, c->Dr, t, rl, -1.0);
        }
        /* group gi (heads gi*H/og ..) through rows gi*orank .. of wo_a */
        for (size_t gi = 0; gi < og; gi++)
            mv(oa + gi * c->orank, w->wo_a + gi * c->orank * gdim, att + gi * gdim, gdim, c->orank);
        mv(f, w->wo_b, oa, og * c->orank, D);
        hc_post(x + t * HC * D, f, post + t * HC, comb + t * HC * HC, D, old);
    }

    /* The FFN sublayer, position by position. */
    for (size_t t = 0; t < T; t++) {
        double pre[HC], pst[HC], cmb[HC * HC];
        double *xt = x + t * HC * D;
        hc_mix(xt, w->hcf_fn, w->hcf_base, w->hcf_scale, HC_MIX, c, flat, pre, pst, cmb);
        for (size_t i = 0; i < D; i++) {
            double v = 0;
            for (size_t hh = 0; hh < HC; hh++) v += pre[hh] * xt[hh * D + i];
            a[i] = v;
        }
        rmsnorm(a, a, w->ffn_norm, D, c->eps);
        size_t ex[64];
        for (size_t e = 0; e < E; e++) {
            double z = 0, m = 0;
            for (size_t i = 0; i < D; i++) {
                z += w->gate_inp[e * D + i] * a[i];
                m += fabs(w->gate_inp[e * D + i] * a[i]);
            }
            double spl = z > 30 ? z + log1p(exp(-z)) : log1p(exp(z));
            pr[e] = sqrt(spl);
            /* d sqrt(softplus(z)) / dz = sigmoid(z) / (2 sqrt(softplus(z))) */
            em[e] = (pr[e] > 0 ? sigmoid(z) / (2 * pr[e]) * m : m) + pr[e];
        }
        if (l < c->n_hash) {
            for (size_t j = 0; j < Eu; j++) ex[j] = (size_t)tid[(size_t)tok[t] * Eu + j];
        } else {
            for (size_t e = 0; e < E; e++) {
                sp[e] = pr[e] + w->probs_b[e];
                em[e] += fabs(w->probs_b[e]);
            }
            if (Eu < E) {
                if (topk(sp, em, E, Eu, sel)) flag(ambiguous, t, T, last);
            } else {
                memset(sel, 1, E);
            }
            size_t n = 0;
            for (size_t e = 0; e < E; e++)
                if (sel[e]) ex[n++] = e;
        }
        double wsum = 0, wt[64];
        for (size_t j = 0; j < Eu; j++) wsum += (wt[j] = pr[ex[j]]);
        if (c->wnorm)
            for (size_t j = 0; j < Eu; j++) wt[j] /= fmax(wsum, 6.103515625e-5);
        if (c->wscale != 0)
            for (size_t j = 0; j < Eu; j++) wt[j] *= c->wscale;
        swiglu(f, w->gate_s, w->up_s, w->down_s, a, D, Fs, c->clamp_sh[l], g1, g3); /* shared expert */
        for (size_t j = 0; j < Eu; j++) {
            size_t e = ex[j];
            swiglu(eo, w->gate_x + e * Fe * D, w->up_x + e * Fe * D, w->down_x + e * D * Fe, a, D, Fe,
                   c->clamp_exp[l], g1, g3);
            for (size_t i = 0; i < D; i++) f[i] += wt[j] * eo[i];
        }
        hc_post(xt, f, pst, cmb, D, old);
    }
    rc = 0;
done:
    free(h); free(post); free(comb); free(qr); free(q); free(k); free(crow); free(irow); free(qI); free(wI);
    free(score); free(mag); free(sel); free(keys); free(s); free(att); free(oa); free(flat); free(old);
    free(tmp); free(a); free(f); free(eo); free(g1); free(g3); free(pr); free(sp); free(em);
    return rc;
}

/* ---- metadata ---- */

static const kvt_gguf_val *key(const kvt_gguf *g, const char *k)
{
    char nm[128];
    snprintf(nm, sizeof nm, "deepseek4.%s", k);
    return kvt_gguf_get(g, nm);
}

static int u32(const kvt_gguf *g, const char *k, size_t *out)
{
    char nm[128];
    uint32_t v = 0;
    snprintf(nm, sizeof nm, "deepseek4.%s", k);
    if (kvt_gguf_get_u32(g, nm, &v) != KVT_OK) return -1;
    *out = v;
    return 0;
}

static int f32(const kvt_gguf *g, const char *k, double *out)
{
    char nm[128];
    float v = 0;
    snprintf(nm, sizeof nm, "deepseek4.%s", k);
    if (kvt_gguf_get_f32(g, nm, &v) != KVT_OK) return -1;
    *out = v;
    return 0;
}

/* An integer key that is one value or an array of at least L (per layer). */
static int u32_per_layer(const kvt_gguf *g, const char *k, size_t L, size_t *out)
{
    const kvt_gguf_val *a = key(g, k);
    if (!a) return -1;
    if (a->type != KVT_GGUF_ARR) {
        size_t v;
        if (u32(g, k, &v)) return -1;
        for (size_t l = 0; l < L; l++) out[l] = v;
        return 0;
    }
    if (a->n < L || (a->elem_type != KVT_GGUF_U32 && a->elem_type != KVT_GGUF_I32)) return -1;
    for (size_t l = 0; l < L; l++) {
        int64_t v = a->elem_type == KVT_GGUF_I32 ? a->v.arr[l].v.i : (int64_t)a->v.arr[l].v.u;
        if (v < 0) return -1;
        out[l] = (size_t)v;
    }
    return 0;
}

/* A float key that is one value or an array of at least L. */
static int f32_per_layer(const kvt_gguf *g, const char *k, size_t L, double *out)
{
    const kvt_gguf_val *a = key(g, k);
    if (!a) return -1;
    if (a->type == KVT_GGUF_F32 || a->type == KVT_GGUF_F64) {
        for (size_t l = 0; l < L; l++) out[l] = a->v.f;
        return 0;
    }
    if (a->type != KVT_GGUF_ARR || a->n < L || a->elem_type != KVT_GGUF_F32) return -1;
    for (size_t l = 0; l < L; l++) out[l] = a->v.arr[l].v.f;
    return 0;
}

static int read_cfg(const kvt_gguf *g, cfg *c)
{
    size_t n_all = 0, nextn = 0, hc = 0, Dv = 0, ctx = 0, gating = 4, n_orig = 0;
    double base = 10000, cbase = 0, factor = 0;
    bool wnorm = false;
    memset(c, 0, sizeof *c);
    if (u32(g, "block_count", &n_all) || u32(g, "embedding_length", &c->D) ||
        u32(g, "attention.head_count", &c->H) || u32(g, "attention.key_length", &c->Dh) ||
        u32(g, "attention.value_length", &Dv) || u32(g, "rope.dimension_count", &c->Dr) ||
        u32(g, "attention.q_lora_rank", &c->Rq) || u32(g, "attention.sliding_window", &c->W) ||
        u32(g, "attention.indexer.head_count", &c->Hi) || u32(g, "attention.indexer.key_length", &c->Di) ||
        u32(g, "attention.indexer.top_k", &c->K) || u32(g, "attention.output_group_count", &c->og) ||
        u32(g, "attention.output_lora_rank", &c->orank) || u32(g, "hyper_connection.count", &hc) ||
        u32(g, "hyper_connection.sinkhorn_iterations", &c->iters) || u32(g, "expert_count", &c->E) ||
        u32(g, "expert_shared_count", &c->Es) || u32(g, "hash_layer_count", &c->n_hash) ||
        f32(g, "attention.layer_norm_rms_epsilon", &c->eps) || f32(g, "hyper_connection.epsilon", &c->hc_eps) ||
        f32(g, "attention.compress_rope_freq_base", &cbase) || f32(g, "expert_weights_scale", &c->wscale))
        return -1;
    if (key(g, "nextn_predict_layers") && u32(g, "nextn_predict_layers", &nextn)) return -1;
    if (key(g, "context_length") && u32(g, "context_length", &ctx)) return -1;
    if (key(g, "expert_gating_func") && u32(g, "expert_gating_func", &gating)) return -1;
    if (key(g, "rope.freq_base") && f32(g, "rope.freq_base", &base)) return -1;
    if (nextn >= n_all || n_all - nextn > MAXL) return -1;
    c->L = n_all - nextn;
    if (kvt_gguf_get_bool(g, "deepseek4.expert_weights_norm", &wnorm) != KVT_OK) return -1;
    c->wnorm = wnorm;
    if (u32_per_layer(g, "expert_used_count", c->L, c->Eu) ||
        u32_per_layer(g, "expert_feed_forward_length", c->L, c->Fe) ||
        u32_per_layer(g, "attention.compress_ratios", c->L, c->ratio) ||
        f32_per_layer(g, "swiglu_clamp_exp", c->L, c->clamp_exp))
        return -1;
    if (!key(g, "swiglu_clamp_shexp")) memcpy(c->clamp_sh, c->clamp_exp, sizeof c->clamp_sh);
    else if (f32_per_layer(g, "swiglu_clamp_shexp", c->L, c->clamp_sh)) return -1;

    /* RoPE scaling as llama.cpp's context sets it up: the type defaults to
     * linear; none never scales; yarn scales by 1/factor with ext_factor 1 and
     * beta_fast/slow 32/1 over original_context_length (default: the training
     * context). Ratio-0 layers never scale. */
    const char *st = "linear";
    size_t sl = 6;
    if (key(g, "rope.scaling.type") && kvt_gguf_get_str(g, "deepseek4.rope.scaling.type", &st, &sl)) return -1;
    if (key(g, "rope.scaling.factor") && f32(g, "rope.scaling.factor", &factor)) return -1;
    n_orig = ctx;
    if (key(g, "rope.scaling.original_context_length") && u32(g, "rope.scaling.original_context_length", &n_orig))
        return -1;
    c->r_raw = (rp){.base = base, .fscale = 1, .ext = 0};
    c->r_comp = (rp){.base = cbase, .fscale = factor == 0 ? 1 : 1 / factor, .ext = 0};
    if (sl == 4 && !memcmp(st, "yarn", 4)) {
        c->r_comp.ext = 1;
        if (!n_orig) return -1;
        yarn_dims(&c->r_comp, c->Dr, n_orig);
    } else if (sl == 4 && !memcmp(st, "none", 4)) {
        c->r_comp.fscale = 1;
    } else if (!(sl == 6 && !memcmp(st, "linear", 6))) {
        return -1;
    }

    const kvt_gguf_tensor *emb = kvt_gguf_find_tensor(g, "token_embd.weight");
    c->V = emb ? (size_t)emb->ne[1] : 0;
    if (hc != HC || Dv != c->Dh || gating != 4 || !c->V || !c->D || !c->H || !c->Dh || !c->Rq || !c->W ||
        !c->og || !c->orank || c->H % c->og || !c->E || !c->iters || c->Dr % 2 || c->Dr > c->Dh || !cbase ||
        !(base > 0) || !(cbase > 0))
        return -1;
    bool any4 = false;
    for (size_t l = 0; l < c->L; l++) {
        if (c->ratio[l] != 0 && c->ratio[l] != 4 && c->ratio[l] != 128) return -1;
        if (!c->Eu[l] || c->Eu[l] > c->E || c->Eu[l] > 64 || !c->Fe[l]) return -1;
        any4 |= c->ratio[l] == 4;
    }
    if (c->E > 64) return -1;
    if (any4) {
        /* The indexer's Hadamard order (llama_kv_cache::build_input_k_rot):
         * the largest power of two >= 64 that divides Di. */
        if (!c->Hi || !c->K || c->Dr > c->Di || c->Di % 64) return -1;
        c->nrot = 64;
        while (c->Di % (2 * c->nrot) == 0) c->nrot *= 2;
    }
    return 0;
}

/* Another row or expert picked at t changes the streams at t, and a later
 * layer carries them to every later position (window rows, compressed rows
 * that never expire), so an ambiguous cut in a layer that is not the last
 * marks t and every position after it; in the last layer it marks t alone. */
int ref_ds4_logits(const char *path, const int32_t *tok, size_t T, double **out,
                   uint32_t *n_vocab, unsigned char *ambiguous)
{
    kvt_gguf *g = NULL;
    const char *arch = NULL;
    size_t alen = 0;
    double *emb = NULL, *onorm = NULL, *outw = NULL, *hfn = NULL, *hbase = NULL, *hscale = NULL;
    double *x = NULL, *flat = NULL, *a = NULL, *logits = NULL;
    cfg *c = NULL;
    int rc = -1;
    if (!tok || !T || !out || !n_vocab || kvt_gguf_open(&g, path) != KVT_OK) return -1;
    if (kvt_gguf_get_str(g, "general.architecture", &arch, &alen) || alen != 9 || memcmp(arch, "deepseek4", 9))
        goto done;
    if (!(c = malloc(sizeof *c)) || read_cfg(g, c)) goto done;
    for (size_t t = 0; t < T; t++)
        if (tok[t] < 0 || (size_t)tok[t] >= c->V) goto done;
    size_t D = c->D, V = c->V;
    emb = load(g, "token_embd.weight", D, V, 1);          /* (V, D) */
    onorm = load(g, "output_norm.weight", D, 1, 1);       /* (D) */
    outw = load(g, "output.weight", D, V, 1);             /* (V, D) */
    hfn = load(g, "output_hc_fn.weight", HC * D, HC, 1);  /* (4, 4D) */
    hbase = load(g, "output_hc_base.weight", HC, 1, 1);   /* (4) */
    hscale = load(g, "output_hc_scale.weight", 1, 1, 1);  /* (1) */
    x = malloc(T * HC * D * sizeof *x);                   /* (T, 4, D) residual streams */
    flat = malloc(HC * D * sizeof *flat);
    a = malloc(D * sizeof *a);
    logits = malloc(T * V * sizeof *logits);              /* (T, V) */
    if (!emb || !onorm || !outw || !hfn || !hbase || !hscale || !x || !flat || !a || !logits) goto done;
    if (ambiguous) memset(ambiguous, 0, T);
    for (size_t t = 0; t < T; t++)
        for (size_t hh = 0; hh < HC; hh++) memcpy(x + (t * HC + hh) * D, emb + (size_t)tok[t] * D, D * sizeof *x);
    for (size_t l = 0; l < c->L; l++) {
        lw w;
        int32_t *tid = NULL;
        int bad = load_layer(g, c, l, &w, &tid) || layer(x, tok, T, c, l, &w, tid, l + 1 == c->L, ambiguous);
        free_layer(&w);
        free(tid);
        if (bad) goto done;
    }
    for (size_t t = 0; t < T; t++) {
        double pre[HC];
        const double *xt = x + t * HC * D;
        hc_mix(xt, hfn, hbase, hscale, HC, c, flat, pre, NULL, NULL);
        for (size_t i = 0; i < D; i++) {
            double v = 0;
            for (size_t hh = 0; hh < HC; hh++) v += pre[hh] * xt[hh * D + i];
            a[i] = v;
        }
        rmsnorm(a, a, onorm, D, c->eps);
        mv(logits + t * V, outw, a, D, V);
    }
    *out = logits;
    logits = NULL;
    *n_vocab = (uint32_t)V;
    rc = 0;
done:
    free(emb); free(onorm); free(outw); free(hfn); free(hbase); free(hscale);
    free(x); free(flat); free(a); free(logits); free(c);
    kvt_gguf_close(g);
    return rc;
}
