/* Numeric kernels (f32). The exactness contract of the engine lives here:
 *
 *   Every reduction has one fixed order per output element, independent of
 *   batch size, chunking and thread count. A dot product over n elements
 *   accumulates element i into lane i % 16 with a fused multiply-add and then
 *   sums the 16 lanes in a fixed tree. The AVX2/FMA path and the scalar
 *   fallback (fmaf) perform the same operations in the same order, so they are
 *   bit-identical too (tests check this).
 *
 * Buffers are row-major; shapes are in comments as (rows, cols).
 */
#ifndef KVT_KERNELS_H
#define KVT_KERNELS_H

#include "threads.h"
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Force the scalar path (tests); returns the previous setting. */
bool kvt_kernels_force_scalar(bool on);
/* True when the AVX2/FMA path is in use. */
bool kvt_kernels_simd(void);

float kvt_dot(const float *a, const float *b, size_t n);
/* y += a * x, element-wise fma. */
void kvt_axpy(float *y, float a, const float *x, size_t n);

/* binary16 rows <-> f32 (round to nearest even). Conversions are exact
 * IEEE operations, so the F16C path and the scalar path agree bit for bit. */
void kvt_f16_row_to_f32(float *dst, const uint16_t *src, size_t n);
void kvt_f32_row_to_f16(uint16_t *dst, const float *src, size_t n);

/* y (n, d_out) = x (n, d_in) · W^T, W (d_out, d_in). Parallel over d_out. */
void kvt_matmul(kvt_pool *pool, float *y, const float *W, const float *x,
                size_t n, size_t d_in, size_t d_out);

/* out (d) = x / sqrt(mean(x^2) + eps) * w; w may be NULL (weightless). */
void kvt_rmsnorm(float *out, const float *x, const float *w, size_t d, float eps);
/* Rotate adjacent pairs (2i, 2i+1) of v (n_rot dims) by pos * base^(-2i/n_rot). */
void kvt_rope(float *v, size_t n_rot, size_t pos, float base);
/* Same rotation with the opposite angle. */
void kvt_rope_inv(float *v, size_t n_rot, size_t pos, float base);
/* In-place softmax over n. */
void kvt_softmax(float *x, size_t n);
static inline float kvt_silu(float x) { return x / (1.0f + __builtin_expf(-x)); }

#endif
