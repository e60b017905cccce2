/* An f64 reference forward for ds4 GGUF models (docs: ds4-architecture.md),
 * written straight from the math with no cache and no incremental state: each
 * layer computes, for the whole sequence at once, the normed inputs, every raw
 * row, every compressed and indexer row of every complete block, and then for
 * each position t the rows visible at t. Nothing is carried between positions
 * except through the residual stream, so causality is structural.
 *
 * It reads tensors through the GGUF reader only and shares no code with
 * src/ds4.c, src/kernels.c or src/cache.c (its binary16 rounding included), so
 * agreement between the two is evidence, not tautology. Speed is not a goal;
 * T = 700 on ds4-tiny takes well under a second. */
#include "ref.h"
#include "gguf.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* An indexer top-k cut whose K-th and (K+1)-th scores are closer than this,
 * relative to the magnitude of the terms that make them, could come out the
 * other way in f32: those positions are flagged ambiguous. */
#define AMBIG_REL 1e-6

typedef struct cfg {
    size_t V, D, L, H, Dh, Dr, Rq, F, W, Hi, Di, K, nri; /* nri = min(Dr, Di) */
    double eps, ibase;
} cfg;

/* One layer's weights, each W(out, in) row-major as stored (ne = (in, out)). */
typedef struct lw {
    double *attn_norm, *q_a, *q_a_norm, *q_b, *kv, *kv_norm, *sinks, *wo; /* (D) (Rq,D) (Rq) (H*Dh,Rq) (Dh,D) (Dh) (H) (D,H*Dh) */
    double *ffn_norm, *w1, *w3, *w2;                                      /* (D) (F,D) (F,D) (D,F) */
    double *c_kv, *c_gate, *c_ape, *c_norm;                               /* (c*Dh,D) (c*Dh,D) (r,c*Dh) (Dh) */
    double *i_kv, *i_gate, *i_ape, *i_norm, *i_q, *i_w;                   /* (2Di,D) (2Di,D) (4,2Di) (Di) (Hi*Di,Rq) (Hi,D) */
} lw;
#define LW_N (sizeof(lw) / sizeof(double *))

/* Tensor name as ne = (ne0, ne1), converted to double; NULL when absent or
 * shaped otherwise. */
static double *load(const kvt_gguf *g, const char *name, size_t ne0, size_t ne1)
{
    const kvt_gguf_tensor *t = kvt_gguf_find_tensor(g, name);
    if (!t || t->ne[0] != ne0 || t->n_elem != (uint64_t)ne0 * ne1 || !t->n_elem) return NULL;
    size_t n = (size_t)t->n_elem;
    float *f = malloc(n * sizeof *f);
    double *d = malloc(n * sizeof *d);
    if (!f || !d || kvt_gguf_tensor_to_f32(t, f, n) != KVT_OK) { free(f); free(d); return NULL; }
    for (size_t i = 0; i < n; i++) d[i] = f[i];
    free(f);
    return d;
}

static int load_layer(const kvt_gguf *g, const cfg *c, size_t l, size_t r, lw *w)
{
    size_t cw = (r == 4 ? 2 : 1) * c->Dh, HD = c->H * c->Dh, D = c->D;
    struct { double **p; const char *n; size_t ne0, ne1; bool need; } t[] = {
        {&w->attn_norm, "attn_norm", D, 1, true},       {&w->q_a, "attn_q_a", D, c->Rq, true},
        {&w->q_a_norm, "attn_q_a_norm", c->Rq, 1, true}, {&w->q_b, "attn_q_b", c->Rq, HD, true},
        {&w->kv, "attn_kv", D, c->Dh, true},            {&w->kv_norm, "attn_kv_norm", c->Dh, 1, true},
        {&w->sinks, "attn_sinks", c->H, 1, true},       {&w->wo, "attn_output", HD, D, true},
        {&w->ffn_norm, "ffn_norm", D, 1, true},         {&w->w1, "ffn_gate", D, c->F, true},
        {&w->w3, "ffn_up", D, c->F, true},              {&w->w2, "ffn_down", c->F, D, true},
        {&w->c_kv, "comp_kv", D, cw, r > 0},            {&w->c_gate, "comp_gate", D, cw, r > 0},
        {&w->c_ape, "comp_ape", cw, r, r > 0},          {&w->c_norm, "comp_norm", c->Dh, 1, r > 0},
        {&w->i_kv, "idx_comp_kv", D, 2 * c->Di, r == 4}, {&w->i_gate, "idx_comp_gate", D, 2 * c->Di, r == 4},
        {&w->i_ape, "idx_comp_ape", 2 * c->Di, 4, r == 4}, {&w->i_norm, "idx_comp_norm", c->Di, 1, r == 4},
        {&w->i_q, "idx_q", c->Rq, c->Hi * c->Di, r == 4}, {&w->i_w, "idx_w", D, c->Hi, r == 4},
    };
    memset(w, 0, sizeof *w);
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        if (!t[i].need) continue;
        char nm[80];
        snprintf(nm, sizeof nm, "blk.%zu.%s.weight", l, t[i].n);
        if (!(*t[i].p = load(g, nm, t[i].ne0, t[i].ne1))) return -1;
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

/* Rotate adjacent pairs of the last n_rot of the n dims of v by angle
 * sign * pos * base^(-2i/n_rot); sign = -1 is the inverse. */
static void rope(double *v, size_t n, size_t n_rot, size_t pos, double base, double sign)
{
    double *r = v + (n - n_rot);
    for (size_t i = 0; i < n_rot / 2; i++) {
        double ang = sign * (double)pos * pow(base, -(double)(2 * i) / (double)n_rot);
        double c = cos(ang), s = sin(ang), a = r[2 * i], b = r[2 * i + 1];
        r[2 * i] = a * c - b * s;
        r[2 * i + 1] = a * s + b * c;
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

/* Compressed rows (nb, w) of one compressor, nb = T / r complete blocks, from
 * the normed layer inputs h (T, D). c = 2 for r = 4 (overlapping windows: block
 * b pools the first w columns of block b-1 and the last w of block b), c = 1
 * for r = 128. Each row is RMSNorm(p)·norm, RoPE'd on its last n_rot dims at
 * the first token of its block, then rounded to binary16. */
static int compress(double *rows, const double *h, size_t T, const cfg *cf, size_t r, size_t w,
                    const double *Wkv, const double *Wg, const double *ape, const double *norm,
                    size_t n_rot, double base)
{
    size_t c = r == 4 ? 2 : 1, cw = c * w, nb = T / r;
    double *ckv = malloc(T * cw * sizeof *ckv), *csc = malloc(T * cw * sizeof *csc); /* (T, cw) */
    double *sc = malloc(2 * r * sizeof *sc), *val = malloc(2 * r * sizeof *val);     /* (<= 2r) */
    if (!ckv || !csc || !sc || !val) { free(ckv); free(csc); free(sc); free(val); return -1; }
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
        rope(p, w, n_rot, b * r, base, 1.0);
        for (size_t j = 0; j < w; j++) p[j] = f16r(p[j]);
    }
    free(ckv); free(csc); free(sc); free(val);
    return 0;
}

/* Pick the K best of score[0..n) (ties: lower index first) into sel (n, 0/1).
 * Returns 1 when the cut between the K-th and (K+1)-th best is within
 * AMBIG_REL of the larger of their magnitudes mag[] (mag[c] bounds |score[c]|
 * and is what f32 rounding error scales with), else 0. n > K. */
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

/* One layer over all T positions, updating x (T, D) in place. last: no layer
 * follows (see the ambiguity note at ref_ds4_logits). */
static int layer(double *x, size_t T, const cfg *c, const lw *w, size_t r, double base, bool last,
                 unsigned char *ambiguous)
{
    size_t D = c->D, Dh = c->Dh, H = c->H, HD = H * Dh, Rq = c->Rq, Hi = c->Hi, Di = c->Di;
    size_t nb = r ? T / r : 0, HiDi = Hi * Di;
    double *h = malloc(T * D * sizeof *h);          /* (T, D) normed inputs */
    double *qr = malloc(T * Rq * sizeof *qr);       /* (T, Rq) */
    double *q = malloc(T * HD * sizeof *q);         /* (T, H, Dh) */
    double *k = malloc(T * Dh * sizeof *k);         /* (T, Dh) raw rows */
    double *crow = malloc((nb + 1) * Dh * sizeof *crow);   /* (nb, Dh) compressed rows */
    double *irow = malloc((nb + 1) * Di * sizeof *irow);   /* (nb, Di) indexer rows */
    double *qI = malloc(HiDi * sizeof *qI), *wI = malloc(Hi * sizeof *wI); /* (Hi, Di) (Hi) */
    double *score = malloc((nb + 1) * sizeof *score), *mag = malloc((nb + 1) * sizeof *mag); /* (nb) */
    unsigned char *sel = malloc(nb + 1);            /* (nb) */
    const double **keys = malloc((nb + c->W) * sizeof *keys); /* (n_keys) pointers to rows */
    double *s = malloc((nb + c->W) * sizeof *s);    /* (n_keys) attention scores */
    double *att = malloc(HD * sizeof *att), *tmp = malloc(D * sizeof *tmp), *g = malloc(D * sizeof *g);
    double *h1 = malloc(c->F * sizeof *h1), *h3 = malloc(c->F * sizeof *h3); /* (F) */
    int rc = -1;
    if (!h || !qr || !q || !k || !crow || !irow || !qI || !wI || !score || !mag || !sel || !keys ||
        !s || !att || !tmp || !g || !h1 || !h3)
        goto done;

    /* Everything a position may look at, for the whole sequence. */
    for (size_t t = 0; t < T; t++) {
        double *ht = h + t * D, *qt = q + t * HD, *kt = k + t * Dh;
        rmsnorm(ht, x + t * D, w->attn_norm, D, c->eps);
        mv(tmp, w->q_a, ht, D, Rq);
        rmsnorm(qr + t * Rq, tmp, w->q_a_norm, Rq, c->eps);
        mv(qt, w->q_b, qr + t * Rq, Rq, HD);
        for (size_t hh = 0; hh < H; hh++) {
            rmsnorm(qt + hh * Dh, qt + hh * Dh, NULL, Dh, c->eps);
            rope(qt + hh * Dh, Dh, c->Dr, t, base, 1.0);
        }
        mv(kt, w->kv, ht, D, Dh);
        rmsnorm(kt, kt, w->kv_norm, Dh, c->eps);
        rope(kt, Dh, c->Dr, t, base, 1.0);
        for (size_t j = 0; j < Dh; j++) kt[j] = f16r(kt[j]);
    }
    if (r && compress(crow, h, T, c, r, Dh, w->c_kv, w->c_gate, w->c_ape, w->c_norm, c->Dr, base))
        goto done;
    if (r == 4 && compress(irow, h, T, c, 4, Di, w->i_kv, w->i_gate, w->i_ape, w->i_norm, c->nri, c->ibase))
        goto done;

    /* Per position: the visible keys, attention with sinks, then the FFN. All
     * of h/q/k/crow/irow were computed from x before any position changed it. */
    for (size_t t = 0; t < T; t++) {
        size_t nc = r ? (t + 1) / r : 0, nk = 0;
        if (r == 4 && nc > c->K) {
            mv(qI, w->i_q, qr + t * Rq, Rq, HiDi);
            for (size_t hh = 0; hh < Hi; hh++) rope(qI + hh * Di, Di, c->nri, t, c->ibase, 1.0);
            mv(wI, w->i_w, h + t * D, D, Hi);
            for (size_t hh = 0; hh < Hi; hh++) wI[hh] /= sqrt((double)(Di * Hi));
            for (size_t cc = 0; cc < nc; cc++) {
                score[cc] = mag[cc] = 0;
                for (size_t hh = 0; hh < Hi; hh++) {
                    double d = 0, a = 0;
                    for (size_t j = 0; j < Di; j++) {
                        d += qI[hh * Di + j] * irow[cc * Di + j];
                        a += fabs(qI[hh * Di + j] * irow[cc * Di + j]);
                    }
                    score[cc] += wI[hh] * (d > 0 ? d : 0);
                    /* A head whose dot is clearly negative contributes an exact 0
                     * in any precision; otherwise its rounding scales with a. */
                    if (d > -AMBIG_REL * a) mag[cc] += fabs(wI[hh]) * a;
                }
            }
            if (topk(score, mag, nc, c->K, sel) && ambiguous)
                for (size_t u = t; u < (last ? t + 1 : T); u++) ambiguous[u] = 1;
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
            den = exp(z - m);
            for (size_t j = 0; j < Dh; j++) o[j] = 0;
            for (size_t i = 0; i < nk; i++) {
                double e = exp(s[i] - m);
                den += e;
                for (size_t j = 0; j < Dh; j++) o[j] += e * keys[i][j];
            }
            for (size_t j = 0; j < Dh; j++) o[j] /= den;
            rope(o, Dh, c->Dr, t, base, -1.0);
        }
        double *xt = x + t * D;
        mv(tmp, w->wo, att, HD, D);
        for (size_t i = 0; i < D; i++) xt[i] += tmp[i];
        rmsnorm(g, xt, w->ffn_norm, D, c->eps);
        mv(h1, w->w1, g, D, c->F);
        mv(h3, w->w3, g, D, c->F);
        for (size_t i = 0; i < c->F; i++) h1[i] = h1[i] / (1 + exp(-h1[i])) * h3[i];
        mv(tmp, w->w2, h1, c->F, D);
        for (size_t i = 0; i < D; i++) xt[i] += tmp[i];
    }
    rc = 0;
done:
    free(h); free(qr); free(q); free(k); free(crow); free(irow); free(qI); free(wI);
    free(score); free(mag); free(sel); free(keys); free(s); free(att); free(tmp); free(g);
    free(h1); free(h3);
    return rc;
}

/* Another row picked at t changes x_t, and a later layer carries x_t to every
 * later position (window rows, compressed rows that never expire), so an
 * ambiguous cut in a layer that is not the last marks t and every position
 * after it; in the last layer it marks t alone. */
static size_t u32(const kvt_gguf *g, const char *k)
{
    uint32_t v = 0;
    return kvt_gguf_get_u32(g, k, &v) == KVT_OK ? v : 0;
}

int ref_ds4_logits(const char *path, const int32_t *tok, size_t T, double **out,
                   uint32_t *n_vocab, unsigned char *ambiguous)
{
    kvt_gguf *g = NULL;
    const char *arch = NULL;
    size_t alen = 0, nr = 0, nbases = 0;
    const kvt_gguf_val *ratios = NULL, *bases = NULL;
    double *emb = NULL, *onorm = NULL, *outw = NULL, *x = NULL, *xb = NULL, *logits = NULL;
    float epsf = 0, ibf = 0;
    int rc = -1;
    if (!tok || !T || !out || !n_vocab || kvt_gguf_open(&g, path) != KVT_OK) return -1;
    if (kvt_gguf_get_str(g, "general.architecture", &arch, &alen) || alen != 3 || memcmp(arch, "ds4", 3))
        goto done;
    cfg c = {
        .V = u32(g, "ds4.vocab_size"), .D = u32(g, "ds4.embedding_length"),
        .L = u32(g, "ds4.block_count"), .H = u32(g, "ds4.attention.head_count"),
        .Dh = u32(g, "ds4.attention.head_dim"), .Dr = u32(g, "ds4.rope.dimension_count"),
        .Rq = u32(g, "ds4.attention.q_lora_rank"), .F = u32(g, "ds4.feed_forward_length"),
        .W = u32(g, "ds4.attention.sliding_window"), .Hi = u32(g, "ds4.indexer.head_count"),
        .Di = u32(g, "ds4.indexer.head_dim"), .K = u32(g, "ds4.indexer.top_k"),
    };
    c.nri = c.Dr < c.Di ? c.Dr : c.Di;
    if (kvt_gguf_get_f32(g, "ds4.attention.layer_norm_rms_epsilon", &epsf) ||
        kvt_gguf_get_f32(g, "ds4.indexer.rope_freq_base", &ibf) ||
        kvt_gguf_get_arr(g, "ds4.compress_ratios", KVT_GGUF_U32, &ratios, &nr) ||
        kvt_gguf_get_arr(g, "ds4.rope.freq_bases", KVT_GGUF_F32, &bases, &nbases))
        goto done;
    c.eps = epsf;
    c.ibase = ibf;
    if (!c.V || !c.D || !c.L || !c.H || !c.Dh || !c.Rq || !c.F || !c.W || !c.Hi || !c.Di || !c.K ||
        c.Dr > c.Dh || c.Dr % 2 || c.nri % 2 || nr != c.L || nbases != c.L)
        goto done;
    for (size_t l = 0; l < c.L; l++)
        if (ratios[l].v.u != 0 && ratios[l].v.u != 4 && ratios[l].v.u != 128) goto done;
    for (size_t t = 0; t < T; t++)
        if (tok[t] < 0 || (size_t)tok[t] >= c.V) goto done;

    emb = load(g, "token_embd.weight", c.D, c.V);   /* (V, D) */
    onorm = load(g, "output_norm.weight", c.D, 1);  /* (D) */
    outw = kvt_gguf_find_tensor(g, "output.weight") ? load(g, "output.weight", c.D, c.V) : emb; /* (V, D) */
    x = malloc(T * c.D * sizeof *x);                /* (T, D) residual stream */
    xb = malloc(c.D * sizeof *xb);                  /* (D) */
    logits = malloc(T * c.V * sizeof *logits);      /* (T, V) */
    if (!emb || !onorm || !outw || !x || !xb || !logits) goto done;
    if (ambiguous) memset(ambiguous, 0, T);
    for (size_t t = 0; t < T; t++) memcpy(x + t * c.D, emb + (size_t)tok[t] * c.D, c.D * sizeof *x);
    for (size_t l = 0; l < c.L; l++) {
        lw w;
        size_t r = (size_t)ratios[l].v.u;
        int bad = load_layer(g, &c, l, r, &w) || layer(x, T, &c, &w, r, bases[l].v.f, l + 1 == c.L, ambiguous);
        free_layer(&w);
        if (bad) goto done;
    }
    for (size_t t = 0; t < T; t++) {
        rmsnorm(xb, x + t * c.D, onorm, c.D, c.eps);
        mv(logits + t * c.V, outw, xb, c.D, c.V);
    }
    *out = logits;
    logits = NULL;
    *n_vocab = (uint32_t)c.V;
    rc = 0;
done:
    if (outw != emb) free(outw);
    free(emb); free(onorm); free(x); free(xb); free(logits);
    kvt_gguf_close(g);
    return rc;
}
