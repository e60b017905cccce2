/* Numeric kernels (f32 arithmetic; weights in any GGUF type, kvt_wmat).
 * The exactness contract of the engine lives here:
 *
 *   Every reduction has one fixed order per output element, independent of
 *   batch size, chunking and thread count. A dot product over n elements
 *   accumulates element i into lane i % 16 with a fused multiply-add and then
 *   sums the 16 lanes in a fixed tree. The AVX2/FMA path and the scalar
 *   fallback (fmaf) perform the same operations in the same order, so they are
 *   bit-identical too (tests check this).
 *
 * Which path runs is chosen once (src/kernels/cpu.h); the functions below
 * call through that instruction set's table.
 *
 * Buffers are row-major; shapes are in comments as (rows, cols).
 */
#ifndef KVT_KERNELS_H
#define KVT_KERNELS_H

#include "kvtier.h"
#include "base/threads.h"
#include "kernels/cpu.h"
#include "kernels/wmat.h"
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

float kvt_dot(const float *a, const float *b, size_t n);
/* y += a * x, element-wise fma. */
void kvt_axpy(float *y, float a, const float *x, size_t n);
/* out[u * ldo + j] = kvt_dot(q + u * ldq, k + j * ldk, n) * scale for
 * u < nq, j < nk, bit for bit (attention scores: the query heads of a KV
 * head against nk keys, each key read once). */
void kvt_dots_rows(float *out, size_t ldo, const float *q, size_t ldq, size_t nq, const float *k, size_t ldk,
                   size_t nk, size_t n, float scale);
/* kvt_axpy(y + u * ldy, a[u * lda + j], v + j * ldv, n) for u < nq and
 * j < nk, j in order, bit for bit (attention: values mixed in position
 * order). */
void kvt_axpys_rows(float *y, size_t ldy, const float *a, size_t lda, size_t nq, const float *v, size_t ldv, size_t nk,
                    size_t n);
/* The same two for queries anywhere: out[u][j] = kvt_dot(q[u], k + j * ldk,
 * n) * scale, and kvt_axpy(y[u], a[u][j], v + j * ldv, n) for j in order,
 * u < nq (the query heads of several tokens against the keys they share). */
void kvt_dots_qs(size_t nq, float *const *out, const float *const *q, const float *k, size_t ldk, size_t nk, size_t n,
                 float scale);
void kvt_axpys_qs(size_t nq, float *const *y, const float *const *a, const float *v, size_t ldv, size_t nk, size_t n);
/* Whether those two take several queries in one pass over the keys for
 * rows of n floats, so that a caller gains by handing them the queries of
 * more than one token at once (the bits are the same either way). */
bool kvt_qs_shared(size_t n);
/* The four above over K or V rows stored in a row type t (kvtier.h; f32,
 * f16, bf16, q8_0 as ggml's blocks of 32, n then a multiple of 32): k and
 * v point at the first row's first element, rows ldk / ldv BYTES apart.
 * Each element is widened to f32 where it is read, in registers, exactly
 * (cache/rows.h: the values kvt_rows_get gives), so the bits equal those
 * of the f32 kernels on the rows read into f32 first, on every path. The
 * f32 kernels above are these with t = KVT_ROWS_F32. */
void kvt_att_dots_rows(kvt_row_type t, float *out, size_t ldo, const float *q, size_t ldq, size_t nq, const void *k,
                       size_t ldk, size_t nk, size_t n, float scale);
void kvt_att_axpys_rows(kvt_row_type t, float *y, size_t ldy, const float *a, size_t lda, size_t nq, const void *v,
                        size_t ldv, size_t nk, size_t n);
void kvt_att_dots_qs(kvt_row_type t, size_t nq, float *const *out, const float *const *q, const void *k, size_t ldk,
                     size_t nk, size_t n, float scale);
void kvt_att_axpys_qs(kvt_row_type t, size_t nq, float *const *y, const float *const *a, const void *v, size_t ldv,
                      size_t nk, size_t n);
/* Faults the tests inject to show their comparisons catch them (0: none;
 * not to be set while kernels run on other threads). */
enum {
    KVT_KERNELS_FAULT_Q8_SCALE = 1, /* the kvt_att_* kernels read q8_0 rows without their scale */
    KVT_KERNELS_FAULT_ZMM_ORDER,    /* the AVX-512 matmul tile adds lane 3's elements in reverse order */
};
extern _Atomic int kvt_kernels_fault;

/* binary16 rows <-> f32 (round to nearest even). Conversions are exact
 * IEEE operations, so the F16C path and the scalar path agree bit for bit. */
void kvt_f16_row_to_f32(float *dst, const uint16_t *src, size_t n);
void kvt_f32_row_to_f16(uint16_t *dst, const float *src, size_t n);
/* bfloat16 rows to f32 (exact). */
void kvt_bf16_row_to_f32(float *dst, const uint16_t *src, size_t n);
/* y (n, W->rows) = x (n, W->cols) · W^T, parallel over the rows of W. Each
 * output is the fixed-order dot product above over W's row as f32: a row in
 * another type is dequantised (exactly, src/format/quant.h) 2048 elements at a time
 * into the thread's stack, so the result equals that of an f32 copy of W,
 * bit for bit, without one. Weights of an integer type (src/kernels/qkernels.h)
 * run on integer dot products instead, with the tokens' activations
 * quantised into qx (kvt_q_act_bytes of scratch; NULL for other types). */
void kvt_matmul_w(kvt_pool *pool, float *y, const kvt_wmat *W, const float *x, size_t n, uint8_t *qx);
/* kvt_matmul_w right after kvt_matmul_w(.., prev, x, n, qx) on the same x
 * and n, with nothing written to x or qx between: when prev's type
 * quantised x as W's does, its activations in qx are used again. */
void kvt_matmul_w_next(kvt_pool *pool, float *y, const kvt_wmat *W, const kvt_wmat *prev, const float *x, size_t n,
                       uint8_t *qx);
/* The same for an f32 W (d_out, d_in). */
void kvt_matmul(kvt_pool *pool, float *y, const float *W, const float *x,
                size_t n, size_t d_in, size_t d_out);

/* out (d) = x / sqrt(mean(x^2) + eps) * w; w may be NULL (weightless). */
void kvt_rmsnorm(float *out, const float *x, const float *w, size_t d, float eps);
/* Rotate adjacent pairs (2i, 2i+1) of v (n_rot dims) by pos * base^(-2i/n_rot). */
void kvt_rope(float *v, size_t n_rot, size_t pos, float base);
/* kvt_rope of the na heads of a and the nb heads of b (stride floats
 * apart: a token's queries and keys) at one position, each angle's cosine
 * and sine computed once for all of them. ff (n_rot / 2, may be NULL):
 * per-pair frequency divisors (a llama 3 file's rope_freqs), pair i turning
 * by pos * base^(-2i/n_rot) / ff[i]. neox: pair i is (i, i + n_rot/2) of
 * each head, llama.cpp's NEOX layout, rather than (2i, 2i+1). */
void kvt_rope_heads(float *a, size_t na, float *b, size_t nb, size_t stride, size_t n_rot, size_t pos, float base,
                    const float *ff, bool neox);
/* Same rotation with the opposite angle. */
void kvt_rope_inv(float *v, size_t n_rot, size_t pos, float base);
/* YaRN context extension (Peng et al. 2023) as llama.cpp applies it: pair i
 * turns by freq_scale * theta_i blended towards theta_i by ramp(i) *
 * ext_factor, where ramp falls from 1 to 0 between the correction dims lo
 * and hi. The magnitude correction is not applied (the architectures that
 * use this cancel it). freq_scale 1 and ext_factor 0 are plain RoPE. */
typedef struct kvt_yarn { float freq_scale, ext_factor, lo, hi; } kvt_yarn;
/* The correction dims for n_rot rotary dims of base trained at orig_ctx
 * tokens and stretched by factor (beta_fast 32, beta_slow 1); factor <= 1
 * gives plain RoPE. */
kvt_yarn kvt_yarn_make(size_t n_rot, float base, float factor, uint32_t orig_ctx);
/* kvt_rope (sign 1) or kvt_rope_inv (sign -1) with YaRN y (NULL: none). */
void kvt_rope_ext(float *v, size_t n_rot, size_t pos, float base, const kvt_yarn *y, float sign);
/* v (n) = H v with H the orthonormal Sylvester-Hadamard matrix of order n
 * (a power of two), by the fast transform. */
void kvt_hadamard(float *v, size_t n);
/* exp(x), bit for bit the same on every path and machine: glibc's expf
 * algorithm (kernels.c), not the libm of the machine. */
float kvt_expf(float x);
/* In-place softmax of nrows rows of n, ldx apart: per row m the maximum,
 * x = kvt_expf(x - m), the sum in position order, x / sum (the rows' sums
 * run side by side). */
void kvt_softmax_rows(float *x, size_t ldx, size_t nrows, size_t n);
/* h1[i] = g * (1 / (1 + kvt_expf(-g))) * h3[i] with g = h1[i] (SwiGLU). */
void kvt_swiglu(float *h1, const float *h3, size_t n);
/* h1[i] = gelu(h1[i]) * h3[i] (GeGLU), gelu as ggml's CPU backend computes
 * it: 0 at or below -10, x at or above 10, else the tanh form of the
 * input rounded to binary16, rounded to binary16 (its lookup table). */
void kvt_geglu(float *h1, const float *h3, size_t n);
static inline float kvt_silu(float x) { return x / (1.0f + kvt_expf(-x)); }

#endif
