/* Gated DeltaNet (Yang et al. 2024), the recurrent layers of Qwen 3.5
 * (llama.cpp's qwen35 and qwen35moe), as a layer of the llama family
 * (src/arch/llama.c): the projections, the short causal convolution, the gated
 * delta rule and its gated output norm.
 *
 * A layer's cache entry is fixed-size state, not rows: its convolution
 * state (the last conv - 1 inputs of every channel) and its delta-rule state
 * (one S x S matrix per value head). Both hold everything the tokens so far
 * left behind; going back to an earlier position needs them as they were
 * there (the session's checkpoints keep them, snapshots store them).
 *
 * Exactness: each token is one step of the recurrence in position order,
 * whatever chunk it arrives in. A step's operations per channel and per
 * value head are fixed (kvt_dot and kvt_axpy: one order of operations on
 * every path), threads split channels and heads, never a reduction, so
 * logits and state do not depend on the chunk schedule, the thread count or
 * the kernel path. */
#ifndef KVT_DELTANET_H
#define KVT_DELTANET_H

#include "kernels/kernels.h"
#include "base/threads.h"

#include <stddef.h>
#include <stdint.h>

/* The shape shared by a model's DeltaNet layers, from the GGUF's ssm.* keys:
 * Hk key heads (ssm.group_count), Hv value heads (ssm.time_step_rank), a
 * head length S for both (ssm.state_size; ssm.inner_size = Hv * S), a
 * convolution of conv taps (ssm.conv_kernel). Value head h reads key head
 * h % Hk (the converter's tiled order). */
typedef struct kvt_gdn_shape {
    uint32_t D, Hk, Hv, S, conv;
    float eps;
} kvt_gdn_shape;

/* Channels of the convolution: q, k (Hk * S each) and v (Hv * S). */
static inline size_t kvt_gdn_channels(const kvt_gdn_shape *g) { return (2 * (size_t)g->Hk + g->Hv) * g->S; }
/* Bytes of one layer's state: the convolution's (conv - 1, channels) f32,
 * oldest input first, then the delta rule's (Hv, S, S) f32, head h's matrix
 * M with M[j][i] = S_h[i][j] (row j: value dimension j over the key
 * dimensions). */
static inline size_t kvt_gdn_state_bytes(const kvt_gdn_shape *g)
{
    return ((size_t)(g->conv - 1) * kvt_gdn_channels(g) + (size_t)g->Hv * g->S * g->S) * sizeof(float);
}

/* One layer's weights, in place in the file but for the small vectors. */
typedef struct kvt_gdn_layer {
    kvt_wmat qkv;       /* (channels, D) attn_qkv: q, k, v before the convolution */
    kvt_wmat gate;      /* (Hv * S, D) attn_gate: z, the output norm's gate */
    kvt_wmat beta;      /* (Hv, D) ssm_beta: the write strength, sigmoid */
    kvt_wmat alpha;     /* (Hv, D) ssm_alpha: the decay's input */
    float *conv_w;      /* (channels, conv) ssm_conv1d, oldest tap first */
    float *dt;          /* (Hv) ssm_dt.bias */
    float *a;           /* (Hv) ssm_a: -exp(A_log), as the converter stores it */
    float *norm;        /* (S) ssm_norm */
    kvt_wmat out;       /* (D, Hv * S) ssm_out */
} kvt_gdn_layer;

/* Scratch for passes of up to ch tokens. */
typedef struct kvt_gdn_work {
    size_t ch;
    float *mix;   /* (ch, channels) the projection, then the convolution's output */
    float *cv;    /* (ch, channels) */
    float *z;     /* (ch, Hv * S) */
    float *ba;    /* (2, n, Hv) of a pass of n: beta, then the decay's exponent */
    float *o;     /* (ch, Hv * S) */
} kvt_gdn_work;

int kvt_gdn_work_new(kvt_gdn_work *k, const kvt_gdn_shape *g, size_t ch);
void kvt_gdn_work_free(kvt_gdn_work *k);
size_t kvt_gdn_work_bytes(const kvt_gdn_work *k); /* the memory it holds */

/* Test hook: value head h reads key head h / (Hv / Hk) (the grouped order
 * of the original weights), not h % Hk. */
extern int kvt_gdn_fault_grouped;

/* The layer on n tokens: xb (n, D) its normed input; out (n, D) receives
 * its output; state (kvt_gdn_state_bytes) goes from the position before
 * the first token to the last one's. qx: the quantised activations'
 * scratch of kvt_matmul_w. */
void kvt_gdn_forward(kvt_pool *pool, const kvt_gdn_shape *g, const kvt_gdn_layer *w, float *state,
                     kvt_gdn_work *k, const float *xb, size_t n, float *out, uint8_t *qx);

#endif
