/* An f64 reference forward for llama GGUF models, written straight from the
 * math with no cache: every position's logits are recomputed from scratch
 * over the whole sequence. It reads tensors through the GGUF reader only and
 * shares no code with src/arch/llama.c or src/kernels/kernels.c, so agreement between the
 * two is evidence, not tautology. */
#include "ref.h"
#include "format/gguf.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double *load(const kvt_gguf *g, const char *name, size_t n)
{
    const kvt_gguf_tensor *t = kvt_gguf_find_tensor(g, name);
    if (!t || t->n_elem != n) return NULL;
    float *f = malloc(n * sizeof *f);
    double *d = malloc(n * sizeof *d);
    if (!f || !d || kvt_gguf_tensor_to_f32(t, f, n) != KVT_OK) { free(f); free(d); return NULL; }
    for (size_t i = 0; i < n; i++) d[i] = f[i];
    free(f);
    return d;
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

static void rmsnorm(double *o, const double *x, const double *w, size_t n, double eps)
{
    double ss = 0;
    for (size_t i = 0; i < n; i++) ss += x[i] * x[i];
    double s = 1.0 / sqrt(ss / n + eps);
    for (size_t i = 0; i < n; i++) o[i] = x[i] * s * w[i];
}

static void rope(double *v, size_t n_rot, size_t pos, double base)
{
    for (size_t i = 0; i < n_rot; i += 2) {
        double ang = (double)pos * pow(base, -(double)i / (double)n_rot);
        double c = cos(ang), s = sin(ang), a = v[i], b = v[i + 1];
        v[i] = a * c - b * s;
        v[i + 1] = a * s + b * c;
    }
}

static uint32_t u32(const kvt_gguf *g, const char *k, uint32_t def)
{
    uint32_t v = def;
    kvt_gguf_get_u32(g, k, &v);
    return v;
}

int ref_llama_logits(const char *path, const int32_t *tok, size_t T, double **out, uint32_t *n_vocab)
{
    kvt_gguf *g = NULL;
    if (kvt_gguf_open(&g, path)) return -1;
    size_t D = u32(g, "llama.embedding_length", 0), L = u32(g, "llama.block_count", 0);
    size_t H = u32(g, "llama.attention.head_count", 0);
    size_t Hkv = u32(g, "llama.attention.head_count_kv", (uint32_t)H);
    size_t F = u32(g, "llama.feed_forward_length", 0), hd = D / H, KV = Hkv * hd;
    size_t n_rot = u32(g, "llama.rope.dimension_count", (uint32_t)hd);
    float epsf = 1e-5f, basef = 10000.0f;
    kvt_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &epsf);
    kvt_gguf_get_f32(g, "llama.rope.freq_base", &basef);
    double eps = epsf, base = basef;
    const kvt_gguf_tensor *te = kvt_gguf_find_tensor(g, "token_embd.weight");
    size_t V = te ? te->ne[1] : 0;
    double *emb = load(g, "token_embd.weight", V * D);
    double *onorm = load(g, "output_norm.weight", D);
    double *outw = kvt_gguf_find_tensor(g, "output.weight") ? load(g, "output.weight", V * D) : emb;
    double *x = calloc(T * D, sizeof *x), *xb = calloc(D, sizeof *xb), *q = calloc(T * D, sizeof *q);
    double *k = calloc(T * KV, sizeof *k), *v = calloc(T * KV, sizeof *v), *att = calloc(T * D, sizeof *att);
    double *h1 = calloc(F, sizeof *h1), *h3 = calloc(F, sizeof *h3), *tmp = calloc(D, sizeof *tmp);
    double *sc = calloc(T, sizeof *sc), *logits = calloc(T * V, sizeof *logits);
    int rc = -1;
    if (!emb || !onorm || !outw || !x || !q || !k || !v || !att || !logits) goto done;
    for (size_t t = 0; t < T; t++) memcpy(x + t * D, emb + (size_t)tok[t] * D, D * sizeof *x);
    for (size_t l = 0; l < L; l++) {
        char nm[64];
        double *w[9];
        const char *names[9] = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"};
        size_t sizes[9] = {D, D * D, KV * D, KV * D, D * D, D, F * D, F * D, D * F};
        for (int i = 0; i < 9; i++) {
            snprintf(nm, sizeof nm, "blk.%zu.%s.weight", l, names[i]);
            w[i] = load(g, nm, sizes[i]);
        }
        bool ok = true;
        for (int i = 0; i < 9; i++) ok = ok && w[i];
        if (ok) {
            for (size_t t = 0; t < T; t++) {
                rmsnorm(xb, x + t * D, w[0], D, eps);
                mv(q + t * D, w[1], xb, D, D);
                mv(k + t * KV, w[2], xb, D, KV);
                mv(v + t * KV, w[3], xb, D, KV);
                for (size_t h = 0; h < H; h++) rope(q + t * D + h * hd, n_rot, t, base);
                for (size_t h = 0; h < Hkv; h++) rope(k + t * KV + h * hd, n_rot, t, base);
            }
            for (size_t t = 0; t < T; t++)
                for (size_t h = 0; h < H; h++) {
                    size_t kh = h / (H / Hkv);
                    double mx = -INFINITY, z = 0;
                    for (size_t j = 0; j <= t; j++) {
                        double s = 0;
                        for (size_t d = 0; d < hd; d++) s += q[t * D + h * hd + d] * k[j * KV + kh * hd + d];
                        sc[j] = s / sqrt((double)hd);
                        mx = sc[j] > mx ? sc[j] : mx;
                    }
                    for (size_t j = 0; j <= t; j++) z += (sc[j] = exp(sc[j] - mx));
                    for (size_t d = 0; d < hd; d++) {
                        double s = 0;
                        for (size_t j = 0; j <= t; j++) s += sc[j] / z * v[j * KV + kh * hd + d];
                        att[t * D + h * hd + d] = s;
                    }
                }
            for (size_t t = 0; t < T; t++) {
                mv(tmp, w[4], att + t * D, D, D);
                for (size_t i = 0; i < D; i++) x[t * D + i] += tmp[i];
                rmsnorm(xb, x + t * D, w[5], D, eps);
                mv(h1, w[6], xb, D, F);
                mv(h3, w[7], xb, D, F);
                for (size_t i = 0; i < F; i++) h1[i] = h1[i] / (1 + exp(-h1[i])) * h3[i];
                mv(tmp, w[8], h1, F, D);
                for (size_t i = 0; i < D; i++) x[t * D + i] += tmp[i];
            }
        }
        for (int i = 0; i < 9; i++) free(w[i]);
        if (!ok) goto done;
    }
    for (size_t t = 0; t < T; t++) {
        rmsnorm(xb, x + t * D, onorm, D, eps);
        mv(logits + t * V, outw, xb, D, V);
    }
    *out = logits;
    logits = NULL;
    *n_vocab = (uint32_t)V;
    rc = 0;
done:
    if (outw != emb) free(outw);
    free(emb); free(onorm); free(x); free(xb); free(q); free(k); free(v); free(att);
    free(h1); free(h3); free(tmp); free(sc); free(logits);
    kvt_gguf_close(g);
    return rc;
}
