/* The routed experts of a mixture-of-experts feed-forward, shared by the
 * architectures that have one (src/arch/ds4.c, the qwen3moe and gemma4 rows of
 * src/arch/llama.c).
 *
 * Each token picks Eu of E experts with weights (the router is the
 * architecture's: softmax, sqrt-softplus, a hash table...); kvt_moe_select
 * is the common "best Eu scores, best first, ties to the lower id" and
 * kvt_moe_normalise llama.cpp's weight normalisation. kvt_moe_run then runs
 * each expert once over the tokens routed to it, in token order, and adds
 * each token's weighted sum of its experts' outputs, in its order of
 * choice, to out. Every token's result is the same whatever the other
 * tokens of the pass are: a token's expert outputs are matmul rows of its
 * own (fixed-order dot products), and its sum is over its own Eu outputs. */
#ifndef KVT_MOE_H
#define KVT_MOE_H

#include "kernels/kernels.h"
#include "base/threads.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kvt_moe {
    const kvt_wmat *gate, *up; /* (E * F, D): expert e's rows e*F .. e*F + F - 1 (but see stride) */
    const kvt_wmat *down;      /* (E * D, F): expert e's rows e*D .. */
    size_t E, Eu, F, D;
    float clamp;               /* SwiGLU clamp (DeepSeek-V4's swiglu_limit); 0: none */
    bool geglu;                /* the activation: GeGLU (kvt_geglu, ggml's) rather than SwiGLU */
    const float *down_scale;   /* (E): expert e's output times down_scale[e], before its weight; NULL: none */
    size_t stride, up_off;     /* rows per expert in gate and up (0: F), and where up's start within them:
                                * a fused gate_up tensor (gate == up) has stride 2F and up_off F */
} kvt_moe;

/* Scratch for n tokens: xe (n * Eu, D), eo (n * Eu, D), f1 and f3 (n * Eu, F)
 * floats, rt (n * Eu), and qx as the matrices' integer kernels need
 * (kvt_q_act_bytes for n * Eu rows; NULL when no matrix is of an integer
 * type). */
typedef struct kvt_moe_scratch {
    float *xe, *eo, *f1, *f3;
    uint32_t *rt;
    uint8_t *qx;
} kvt_moe_scratch;

/* ex (Eu) = the Eu best of score (E), best first; ties to the lower id.
 * A NaN score is never picked over a number. */
void kvt_moe_select(const float *score, size_t E, size_t Eu, uint32_t *ex);
/* wt (Eu) /= their sum, the sum clamped below at 2^-14 (llama.cpp's
 * 6.103515625e-5). */
void kvt_moe_normalise(float *wt, size_t Eu);
/* g = silu(g) * u over n elements, or with clamp > 0 the clamped form
 * (g at most clamp, u within [-clamp, clamp]). */
void kvt_moe_swiglu(float *g, const float *u, size_t n, float clamp);
/* For the n tokens h (n, D) with experts ex (n, Eu) and weights wt (n, Eu):
 * out[i] = sum_j wt[i][j] * expert_{ex[i][j]}(h[i]) + out[i], the sum
 * in order of j; with down_scale, each expert's output is
 * (down(act) * down_scale[e]) * wt, as llama.cpp's scaled experts. */
void kvt_moe_run(kvt_pool *pool, const kvt_moe *m, const float *h, size_t n, const uint32_t *ex, const float *wt,
                 const kvt_moe_scratch *sc, float *out);

/* Tests against another implementation (kvt_force, above): impose its
 * choice forced[t * k ..] (k ids of position t) on own[0..k) (sorted
 * ascending when sort), after recording in gaps[t] (when gaps is not NULL)
 * -1 where the two agree as sets, else how close kvtier's own choice was:
 * the gap between the least chosen of score[0..n) and the best of the rest,
 * relative to the largest |score| (INFINITY without scores). */
void kvt_moe_force_choice(const int32_t *forced, float *gaps, size_t t, uint32_t *own, size_t k, const float *score,
                          size_t n, bool sort);

/* Tests against another implementation: its discrete choices imposed, so
 * that everything else can be compared position by position (ds4, and the
 * routed experts of the llama family's qwen3moe). For each
 * layer l with sel[l] (ds4's ratio 4) the rows the indexer keeps at position t
 * (< n; K per token, any order) replace kvtier's own choice wherever it
 * chooses (more than K rows visible); ex[l] (Eu per token) does the same for
 * the routed experts. kvtier still makes its own choice first and records
 * in sel_gap[l][t] / ex_gap[l][t] (n floats each, when given) -1 where the
 * two agree, else how close its own choice was: the gap between its K-th
 * (Eu-th) and (K+1)-th ((Eu+1)-th) score relative to the largest score
 * (INFINITY for a hash layer's table). */
typedef struct kvt_forced {
    size_t n;
    uint32_t K, Eu;
    const int32_t *sel[64], *ex[64];
    float *sel_gap[64], *ex_gap[64];
} kvt_forced;
extern kvt_forced *kvt_force; /* moe.c; NULL: kvtier's own choices */

#endif
