/* Gated DeltaNet layers (deltanet.h). For n tokens of normed input x:
 *
 *   mix = attn_qkv x, z = attn_gate x, b = sigmoid(ssm_beta x),
 *   g = softplus(ssm_alpha x + dt) * a                       (per value head)
 *   c_t = silu(sum_k conv_w[k] * mix_{t - conv + 1 + k})   (per channel, the
 *         inputs before the pass from the convolution state)
 *   q, k = each head of c's q and k parts divided by its L2 norm, v = c's v
 *   per value head h, with key head kh = h % Hk, token by token:
 *     M *= exp(g)                         (M[j][i] = S[i][j])
 *     d[j] = (v[j] - M[j] . k) * b        M[j] += d[j] k
 *     o[j] = (M[j] . q) / sqrt(S)
 *   out = ssm_out (rmsnorm(o_h) * ssm_norm * silu(z_h), every head h)
 *
 * as llama.cpp computes it (its fused gated_delta_net operator: the same
 * steps in the same order). */
#include "arch/deltanet.h"
#include "base/util.h"

#include <malloc.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

int kvt_gdn_fault_grouped;

int kvt_gdn_work_new(kvt_gdn_work *k, const kvt_gdn_shape *g, size_t ch)
{
    size_t C = kvt_gdn_channels(g), VD = (size_t)g->Hv * g->S;
    memset(k, 0, sizeof *k);
    k->ch = ch;
    k->mix = kvt_malloc(ch * C * sizeof(float));
    k->cv = kvt_malloc(ch * C * sizeof(float));
    k->z = kvt_malloc(ch * VD * sizeof(float));
    k->ba = kvt_malloc(ch * 2 * (size_t)g->Hv * sizeof(float));
    k->o = kvt_malloc(ch * VD * sizeof(float));
    if (k->mix && k->cv && k->z && k->ba && k->o) return KVT_OK;
    kvt_gdn_work_free(k);
    return KVT_ENOMEM;
}

void kvt_gdn_work_free(kvt_gdn_work *k)
{
    free(k->mix);
    free(k->cv);
    free(k->z);
    free(k->ba);
    free(k->o);
    memset(k, 0, sizeof *k);
}

size_t kvt_gdn_work_bytes(const kvt_gdn_work *k)
{
    return malloc_usable_size(k->mix) + malloc_usable_size(k->cv) + malloc_usable_size(k->z) +
           malloc_usable_size(k->ba) + malloc_usable_size(k->o);
}

struct gdn_ctx {
    const kvt_gdn_shape *g;
    const kvt_gdn_layer *w;
    float *state;
    kvt_gdn_work *k;
    size_t n;
};

static float sigmoid(float x) { return 1.0f / (1.0f + kvt_expf(-x)); }

/* ggml's softplus: x past 20, else log(1 + e^x). */
static float softplus(float x) { return x > 20.0f ? x : logf(1.0f + kvt_expf(x)); }

/* Channels [c0, c1): the convolution over the pass, each channel on its
 * own, then the state's last conv - 1 inputs. */
static void conv_range(void *arg, size_t c0, size_t c1)
{
    struct gdn_ctx *c = arg;
    const kvt_gdn_shape *g = c->g;
    size_t C = kvt_gdn_channels(g), K = g->conv, n = c->n;
    float *st = c->state; /* (K - 1, C) */
    const float *mix = c->k->mix;
    float *cv = c->k->cv;
    for (size_t ch = c0; ch < c1; ch++) {
        const float *wc = c->w->conv_w + ch * K;
        for (size_t t = 0; t < n; t++) {
            float s = 0.0f;
            for (size_t j = 0; j < K; j++) { /* input t - (K - 1) + j of the pass */
                size_t at = t + j;       /* in [state, pass] coordinates */
                float x = at < K - 1 ? st[at * C + ch] : mix[(at - (K - 1)) * C + ch];
                s += x * wc[j];
            }
            cv[t * C + ch] = kvt_silu(s);
        }
        /* the new state: the last K - 1 inputs of [state, pass] */
        for (size_t j = 0; j < K - 1; j++) {
            size_t at = n + j; /* input n - (K - 1) + j */
            st[j * C + ch] = at < K - 1 ? st[at * C + ch] : mix[(at - (K - 1)) * C + ch];
        }
    }
}

/* Tokens [t0, t1): beta and the decay's exponent, q and k L2-normed. */
static void prep_range(void *arg, size_t t0, size_t t1)
{
    struct gdn_ctx *c = arg;
    const kvt_gdn_shape *g = c->g;
    size_t C = kvt_gdn_channels(g), S = g->S, Hv = g->Hv, nqk = 2 * (size_t)g->Hk;
    for (size_t t = t0; t < t1; t++) {
        float *b = c->k->ba + t * Hv, *ge = c->k->ba + (c->n + t) * Hv;
        for (size_t h = 0; h < Hv; h++) {
            b[h] = sigmoid(b[h]);
            ge[h] = softplus(ge[h] + c->w->dt[h]) * c->w->a[h];
        }
        /* ggml's rms_norm(x, eps / S) scaled by 1 / sqrt(S) */
        for (size_t h = 0; h < nqk; h++) {
            float *x = c->k->cv + t * C + h * S;
            float ss = kvt_dot(x, x, S);
            float r = 1.0f / sqrtf(ss / (float)S + g->eps / (float)S), sc = 1.0f / sqrtf((float)S);
            for (size_t i = 0; i < S; i++) x[i] = x[i] * r * sc;
        }
    }
}

/* Value heads [h0, h1): the delta rule over the pass, token by token, then
 * the gated output norm. */
static void rule_range(void *arg, size_t h0, size_t h1)
{
    struct gdn_ctx *c = arg;
    const kvt_gdn_shape *g = c->g;
    size_t C = kvt_gdn_channels(g), S = g->S, Hv = g->Hv, Hk = g->Hk, VD = Hv * S;
    float *Ms = c->state + (size_t)(g->conv - 1) * C;
    float delta[512];
    const float scale = 1.0f / sqrtf((float)S);
    for (size_t h = h0; h < h1; h++) {
        float *M = Ms + h * S * S;
        size_t kh = kvt_gdn_fault_grouped ? h / (Hv / Hk) : h % Hk;
        for (size_t t = 0; t < c->n; t++) {
            const float *row = c->k->cv + t * C;
            const float *q = row + kh * S, *k = row + Hk * S + kh * S, *v = row + 2 * Hk * S + h * S;
            float b = c->k->ba[t * Hv + h], decay = kvt_expf(c->k->ba[(c->n + t) * Hv + h]);
            float *o = c->k->o + t * VD + h * S;
            for (size_t e = 0; e < S * S; e++) M[e] *= decay;
            for (size_t j = 0; j < S; j++) delta[j] = (v[j] - kvt_dot(M + j * S, k, S)) * b;
            for (size_t j = 0; j < S; j++) kvt_axpy(M + j * S, delta[j], k, S);
            for (size_t j = 0; j < S; j++) o[j] = kvt_dot(M + j * S, q, S) * scale;
            /* rmsnorm(o) * norm * silu(z) */
            kvt_rmsnorm(o, o, c->w->norm, S, g->eps);
            const float *z = c->k->z + t * VD + h * S;
            for (size_t j = 0; j < S; j++) o[j] *= kvt_silu(z[j]);
        }
    }
}

void kvt_gdn_forward(kvt_pool *pool, const kvt_gdn_shape *g, const kvt_gdn_layer *w, float *state,
                     kvt_gdn_work *k, const float *xb, size_t n, float *out, uint8_t *qx)
{
    size_t C = kvt_gdn_channels(g), Hv = g->Hv;
    kvt_matmul_w(pool, k->mix, &w->qkv, xb, n, qx);
    kvt_matmul_w_next(pool, k->z, &w->gate, &w->qkv, xb, n, qx);
    kvt_matmul_w_next(pool, k->ba, &w->beta, &w->gate, xb, n, qx);
    kvt_matmul_w_next(pool, k->ba + n * Hv, &w->alpha, &w->beta, xb, n, qx);
    struct gdn_ctx c = {g, w, state, k, n};
    kvt_pool_for(pool, C, 64, conv_range, &c);
    kvt_pool_for(pool, n, 32, prep_range, &c);
    kvt_pool_for(pool, Hv, 1, rule_range, &c);
    kvt_matmul_w(pool, out, &w->out, k->o, n, qx);
}
