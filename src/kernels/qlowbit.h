/* Integer kernels for the low-bit superblocks of 256: Q2_K, Q3_K, IQ2_XXS,
 * IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0 and TQ2_0 (the types of
 * the 2-3 bit files, DeepSeek-V4-Flash's routed experts among them).
 * qkernels.c quantises the activations (Q8_K, kernels/q8k.h) and hands the
 * matmul here; qkernels.h has the contract the results keep: every output
 * an exact integer sum per superblock, then the fixed float steps, so every
 * instruction set, tile and thread count gives the scalar path's bits. */
#ifndef KVT_QLOWBIT_H
#define KVT_QLOWBIT_H

#include "base/threads.h"
#include "kernels/wmat.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Whether weights of this type are one of the low-bit types above. */
bool kvt_qlowbit_supported(uint32_t wtype);
/* y (n, W->rows) = x · W^T for a low-bit W, qx holding the n tokens' Q8_K
 * activations (kvt_q8k_stride(W->cols) bytes each). */
void kvt_qlowbit_matmul(kvt_pool *pool, float *y, const kvt_wmat *W, size_t n, const uint8_t *qx);

/* Tests only: format/quant.h's KVT_QUANT_FAULT_GRID or _SCALE in the
 * kernels' reading of iq2_xxs and q3_K, every path (not in
 * kvt_quant_to_f32), so a kernel test can show it finds one wrong codebook
 * entry or scale. Set it only while no matmul runs. */
extern int kvt_q_fault;

#endif
