/* The codebooks of ggml's i-quant formats: format data, generated from
 * llama.cpp's ggml-common.h by tools/iqgrid.py into iqgrid.c.
 *
 * A grid maps an index read from a block to 8 (IQ3: 4) element values,
 * element j at [j]: the IQ2 grids' values are 8, 25 and 43, the IQ3_XXS
 * grid's 4, 12, 20, ..., 52, 62 and the IQ3_S grid's odd 1 .. 15, all
 * before the block's signs; the IQ1 grid's -1, 0, 1 before the block's
 * delta. kvt_iqgrid_ksigns[k] is the
 * sign byte of 7 sign bits k (bit j set: element j negative), the eighth
 * bit making the count of negatives even. quant.c and kernels/qkernels.c
 * read them; tests/test_quant.c checks every entry against libggml. */
#ifndef KVT_IQGRID_H
#define KVT_IQGRID_H

#include <stdint.h>

extern const uint8_t kvt_iqgrid_iq2xxs[256][8];
extern const uint8_t kvt_iqgrid_iq2xs[512][8];
extern const uint8_t kvt_iqgrid_iq2s[1024][8];
extern const uint8_t kvt_iqgrid_iq3xxs[256][4];
extern const uint8_t kvt_iqgrid_iq3s[512][4];
extern const int8_t kvt_iqgrid_iq1s[2048][8];
extern const uint8_t kvt_iqgrid_ksigns[128];
/* Derived from nothing but the bits (not format data): sign byte s as 8
 * bytes of -1 (bit j set) or +1, byte j for bit j, little-endian. */
extern const uint64_t kvt_iqgrid_sign8[256];

#endif
