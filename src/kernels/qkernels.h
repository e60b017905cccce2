/* Integer kernels for quantised weights: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
 * IQ4_NL and MXFP4 (blocks of 32), Q4_K, Q5_K, Q6_K and IQ4_XS (superblocks
 * of 256), and the low-bit superblocks Q2_K, Q3_K, IQ2_XXS, IQ2_XS, IQ2_S,
 * IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0 and TQ2_0 (their kernels in qlowbit.c,
 * kernels/qlowbit.h: unpacked to integer magnitudes, signs and scales, then
 * the same integer scheme). A matmul over weights of such a type first quantises each
 * token's activations on its own (as llama.cpp does: Q8_0 blocks of 32 for
 * the 32-element weight types, the int8 values of llama.cpp's Q8_1 for Q4_1
 * and Q5_1 too), then every output is a dot product of integer blocks:
 *
 *   For each block b, the products of the 32 int8 pairs are summed in
 *   exact integers into 8 partial sums (lane j: elements 4j .. 4j+3); each
 *   lane accumulates d_w(b) * d_x(b) * partial(b, j) with a fused
 *   multiply-add in increasing b (the scale product is exact in f32); the
 *   8 lanes are summed in a fixed tree. For Q4_1 and Q5_1 (d_w * q + m_w)
 *   each lane then also accumulates m_w(b) * d_x(b) * sx(b, j), sx the
 *   exact sum of the lane's 4 activation values, with a second fused
 *   multiply-add (m_w is an f16 and d_x an f16-rounded f32, so m_w * d_x,
 *   like d_w * d_x, has at most 22 significant bits and is exact in f32).
 *
 * The AVX2 path (maddubs/madd) and the scalar path compute the same
 * integers and the same float operations in the same order, so they agree
 * bit for bit; a token's result does not depend on the batch, the tiling or
 * the thread count. */
#ifndef KVT_QKERNELS_H
#define KVT_QKERNELS_H

#include "base/threads.h"
#include "kernels/wmat.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Whether weights of this type run on the integer kernels. */
bool kvt_q_supported(uint32_t wtype);
/* Bytes of the quantised activations of n tokens of cols elements for
 * weights of wtype (0: not an integer type, or cols not whole blocks). */
size_t kvt_q_act_bytes(uint32_t wtype, size_t n, size_t cols);
/* y (n, W->rows) = x (n, W->cols) · W^T for an integer type; qx holds
 * kvt_q_act_bytes(W->type, n, W->cols) bytes of scratch. */
void kvt_q_matmul(kvt_pool *pool, float *y, const kvt_wmat *W, const float *x, size_t n, uint8_t *qx);
/* Whether weights of types a and b quantise the same activations the same
 * way (both Q8_K, or both Q8_0), so that one's qx serves the other. */
bool kvt_q_same_act(uint32_t a, uint32_t b);
/* kvt_q_matmul with qx already holding x's activations for W's type. */
void kvt_q_matmul_quantised(kvt_pool *pool, float *y, const kvt_wmat *W, size_t n, const uint8_t *qx);

/* Four-row packing (Q4_K, Q5_K on x86): kvt_q_pack_bytes is the size of
 * W's packed copy, 0 when W does not pack (another type, rows not a
 * multiple of 4); kvt_q_pack writes it to dst (nothing when it is 0). With W->pk = dst, the SIMD
 * kernels read the copy instead of W->data, with the same results bit for
 * bit (the scalar path still reads W->data). */
size_t kvt_q_pack_bytes(const kvt_wmat *W);
void kvt_q_pack(const kvt_wmat *W, uint8_t *dst);

#endif
