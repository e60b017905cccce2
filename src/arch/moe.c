/* The routed experts of a mixture-of-experts feed-forward (moe.h). */
#include "arch/moe.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

kvt_forced *kvt_force;

void kvt_moe_select(const float *score, size_t E, size_t Eu, uint32_t *ex)
{
    for (size_t j = 0; j < Eu; j++) {
        uint32_t best = UINT32_MAX;
        float bs = -INFINITY;
        for (size_t e = 0; e < E; e++) {
            bool used = false;
            for (size_t k = 0; k < j; k++) used |= ex[k] == e;
            float v = score[e];
            if (!used && (best == UINT32_MAX || v > bs)) { best = (uint32_t)e; bs = v; }
        }
        ex[j] = best;
    }
}

void kvt_moe_normalise(float *wt, size_t Eu)
{
    float z = 0;
    for (size_t j = 0; j < Eu; j++) z += wt[j];
    if (z < 6.103515625e-5f) z = 6.103515625e-5f;
    for (size_t j = 0; j < Eu; j++) wt[j] /= z;
}

void kvt_moe_swiglu(float *g, const float *u, size_t n, float clamp)
{
    if (clamp > 1e-6f) {
        for (size_t j = 0; j < n; j++) {
            float a = g[j] < clamp ? g[j] : clamp, b = u[j] < -clamp ? -clamp : u[j] > clamp ? clamp : u[j];
            g[j] = a / (1.0f + kvt_expf(-a)) * b;
        }
    } else {
        for (size_t j = 0; j < n; j++) g[j] = kvt_silu(g[j]) * u[j];
    }
}

void kvt_moe_run(kvt_pool *pool, const kvt_moe *m, const float *h, size_t n, const uint32_t *ex, const float *wt,
                 const kvt_moe_scratch *sc, float *out)
{
    size_t D = m->D, F = m->F, Eu = m->Eu;
    /* each expert over the tokens routed to it, in token order */
    for (uint32_t e = 0; e < m->E; e++) {
        size_t ne = 0;
        for (size_t q = 0; q < n * Eu; q++)
            if (ex[q] == e) {
                sc->rt[ne] = (uint32_t)q;
                memcpy(sc->xe + ne * D, h + q / Eu * D, D * sizeof(float));
                ne++;
            }
        if (!ne) continue;
        size_t st = m->stride ? m->stride : F;
        kvt_wmat gx = kvt_wmat_rows(m->gate, e * st, F), ux = kvt_wmat_rows(m->up, e * st + m->up_off, F),
                 dx = kvt_wmat_rows(m->down, e * D, D);
        kvt_matmul_w(pool, sc->f1, &gx, sc->xe, ne, sc->qx);
        kvt_matmul_w_next(pool, sc->f3, &ux, &gx, sc->xe, ne, sc->qx);
        if (m->geglu) kvt_geglu(sc->f1, sc->f3, ne * F);
        else kvt_moe_swiglu(sc->f1, sc->f3, ne * F, m->clamp);
        kvt_matmul_w(pool, sc->xe, &dx, sc->f1, ne, sc->qx);
        if (m->down_scale)
            for (size_t j = 0; j < ne * D; j++) sc->xe[j] *= m->down_scale[e];
        for (size_t r = 0; r < ne; r++) memcpy(sc->eo + (size_t)sc->rt[r] * D, sc->xe + r * D, D * sizeof(float));
    }
    for (size_t i = 0; i < n; i++) {
        const float *eo = sc->eo + i * Eu * D, *w = wt + i * Eu;
        float *o = out + i * D;
        for (size_t d = 0; d < D; d++) {
            float v = eo[d] * w[0];
            for (size_t j = 1; j < Eu; j++) v = v + eo[j * D + d] * w[j];
            o[d] = v + o[d];
        }
    }
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The gap between the k-th best of score[0..n) (the least of the chosen
 * own[0..k)) and the best of the rest, relative to the largest |score|. */
static float choice_gap(const float *score, size_t n, const uint32_t *own, size_t k)
{
    float kth = INFINITY, rest = -INFINITY, big = 0;
    for (size_t i = 0; i < n; i++) {
        bool in = false;
        for (size_t j = 0; j < k; j++) in |= own[j] == i;
        if (in && score[i] < kth) kth = score[i];
        if (!in && score[i] > rest) rest = score[i];
        if (fabsf(score[i]) > big) big = fabsf(score[i]);
    }
    return big > 0 ? (kth - rest) / big : 0;
}

void kvt_moe_force_choice(const int32_t *forced, float *gaps, size_t t, uint32_t *own, size_t k, const float *score,
                          size_t n, bool sort)
{
    int32_t f[1024], o[1024];
    if (k > 1024) return;
    for (size_t j = 0; j < k; j++) { f[j] = forced[t * k + j]; o[j] = (int32_t)own[j]; }
    qsort(f, k, sizeof *f, cmp_i32);
    qsort(o, k, sizeof *o, cmp_i32);
    bool same = !memcmp(f, o, k * sizeof *f);
    if (gaps) gaps[t] = same ? -1.0f : score ? choice_gap(score, n, own, k) : INFINITY;
    for (size_t j = 0; j < k; j++) own[j] = (uint32_t)(sort ? f[j] : forced[t * k + j]);
}
