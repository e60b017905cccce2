/* ggml tensor types: one table of block shapes and names, and a scalar row
 * dequantiser whose f32 output equals ggml's to_float bit for bit (NaN
 * payloads included) on x86-64. tests/test_quant.c holds it against the
 * libggml-base.so node-llama-cpp ships.
 *
 * A tensor row is a whole number of blocks; a block is `elems` values in
 * `bytes` bytes, little-endian, packed with no padding. The types kvtier
 * reads (ggml id, elements / bytes per block, layout in byte order):
 *
 *   f32     0    1 /   4  IEEE binary32
 *   f16     1    1 /   2  IEEE binary16
 *   q4_0    2   32 /  18  f16 d | 16 B nibbles       x = d * (q - 8)
 *   q4_1    3   32 /  20  f16 d, f16 m | 16 B        x = d * q + m
 *   q5_0    6   32 /  22  f16 d | u32 qh | 16 B      x = d * (q - 16)
 *   q5_1    7   32 /  24  f16 d, f16 m | u32 qh | 16 B   x = d * q + m
 *   q8_0    8   32 /  34  f16 d | 32 x i8            x = d * q
 *   q2_K   10  256 /  84  scales[16] | 64 B 2-bit | f16 d, f16 dmin
 *   q3_K   11  256 / 110  32 B hmask | 64 B 2-bit | 12 B scales | f16 d
 *   q4_K   12  256 / 144  f16 d, f16 dmin | 12 B scales | 128 B nibbles
 *   q5_K   13  256 / 176  f16 d, f16 dmin | 12 B scales | 32 B qh | 128 B
 *   q6_K   14  256 / 210  128 B ql | 64 B qh | 16 x i8 scales | f16 d
 *   iq2_xxs 16 256 /  66  f16 d | 8 x (4 B grid idx, u32 signs + scale)
 *   iq2_xs 17  256 /  74  f16 d | 32 x u16 (9-bit grid idx, 7-bit signs) | 8 B scales
 *   iq3_xxs 18 256 /  98  f16 d | 64 B grid idx | 8 x u32 (signs + scale)
 *   iq1_s  19  256 /  50  f16 d | 32 B grid idx | 8 x u16 (idx high bits, scale, delta)
 *   iq4_nl 20   32 /  18  f16 d | 16 B nibbles       x = d * kvalues_iq4nl[q]
 *   iq3_s  21  256 / 110  f16 d | 64 B grid idx | 8 B qh | 32 B signs | 4 B scales
 *   iq2_s  22  256 /  82  f16 d | 32 B grid idx | 32 B signs | 8 B qh | 8 B scales
 *   iq4_xs 23  256 / 136  f16 d | u16 scales_h | 4 B scales_l | 128 B
 *   iq1_m  29  256 /  56  32 B grid idx | 16 B qh | 4 x u16 scales (d in their top nibbles)
 *   bf16   30    1 /   2  the high half of a binary32
 *   tq1_0  34  256 /  54  48 B 5 trits a byte | 4 B 4 trits a byte | f16 d   x = d * (t - 1)
 *   tq2_0  35  256 /  66  64 B 2-bit t | f16 d                   x = d * (t - 1)
 *   mxfp4  39   32 /  17  u8 E8M0 e | 16 B nibbles   x = 2^(e-127) * E2M1(q)
 *
 * In the 32-element types byte j's low nibble is element j and its high
 * nibble element j + 16; q5's qh bit j is the fifth bit of element j. The
 * K-quants are 8 sub-blocks of 32 (q6_K: 16 of 16) with 6-bit scales and
 * mins (q6_K: int8 scales) under the f16 super-scales; quant.c spells out
 * each packing. q2_K and q3_K are 16 sub-blocks of 16 with 4-bit scales
 * and mins (q2_K) or 6-bit signed scales (q3_K, q in -4 .. 3). The
 * i-quants pick groups of 8 (IQ3: 4) values from a codebook, the grids of
 * format/iqgrid.h, with sign bits (IQ2, IQ3: 7 stored, the eighth making
 * their count even) or a +-1/8 delta (IQ1), and a scale per 32 (or 16).
 * The ternary tq types hold t in 0..2 (value t - 1): tq2_0 2 bits each,
 * tq1_0 5 (qh: 4) base-3 digits a byte, the byte a fraction of 3^5 whose
 * digit n comes to the top when multiplied by 3^n (quant.c).
 * mxfp4's E8M0 is decoded as ggml does: ggml keeps the scale
 * halved and the E2M1 elements doubled, so e = 0 and 1 become the f32
 * subnormals 2^-128 and 2^-127 (exact, never flushed), and e = 255, NaN in
 * the OCP spec, is 2^128 (halved: 2^127) like any other exponent.
 *
 * Every other ggml type has a name here (for messages) and no block:
 * kvt_quant_block says false and gguf.c refuses the tensor.
 */
#ifndef KVT_QUANT_H
#define KVT_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Elements per block and bytes per block of a ggml type; false when kvtier
 * does not support it (elems and bytes untouched). Either may be NULL. */
bool kvt_quant_block(uint32_t type, size_t *elems, size_t *bytes);
/* Bytes of n elements (n a multiple of the block); 0 when the type is
 * unsupported, n is not whole blocks or the size overflows size_t. */
size_t kvt_quant_row_bytes(uint32_t type, uint64_t n);
/* ggml's name ("q4_K", "iq4_nl", ...) of any type ggml defines, supported or
 * not; NULL for an id ggml does not define. Static storage. */
const char *kvt_quant_name(uint32_t type);
/* Dequantise n elements (whole blocks) of type: src holds
 * kvt_quant_row_bytes(type, n) bytes, any alignment; dst receives (n) f32.
 * Scalar and exact: the same bits as ggml's to_float. KVT_EUNSUPPORTED for
 * an unsupported type, KVT_EINVAL when n is not whole blocks or a pointer is
 * NULL (n > 0); nothing is written then. */
int kvt_quant_to_f32(uint32_t type, const void *src, float *dst, size_t n);
/* Quantise n f32 values to type as ggml's reference quantisers do
 * (quantize_row_q8_0_ref; f16 rounded to nearest even): F32, F16 and Q8_0
 * only (KVT_EUNSUPPORTED otherwise); dst receives kvt_quant_row_bytes(type,
 * n) bytes. KVT_EINVAL when n is not whole blocks. */
int kvt_quant_from_f32(uint32_t type, const float *src, void *dst, size_t n);

/* Tests only: KVT_QUANT_FAULT_GRID makes iq2_xxs read grid entry 78 for
 * index 77, KVT_QUANT_FAULT_SCALE adds one to q3_K's sixth scale, in
 * kvt_quant_to_f32 (kvt_quant_fault) or in the integer kernels
 * (kernels/qlowbit.h kvt_q_fault), so the tests can show they catch one
 * wrong codebook entry and one off-by-one scale. KVT_QUANT_FAULT_LANE (the
 * low-bit SIMD kernels only) adds one to one lane's integer sum of a
 * superblock: row 1 of a four-row decode tile, token 3 of an eight-token
 * prefill vector, so a test can show it compares every tile's bits.
 * KVT_QUANT_FAULT_PACK (kernels/qkernels.c's SIMD packer of four Q4_K or
 * Q5_K rows only) swaps two rows' first 8 values' bytes in each superblock. */
enum { KVT_QUANT_FAULT_NONE, KVT_QUANT_FAULT_GRID, KVT_QUANT_FAULT_SCALE, KVT_QUANT_FAULT_LANE, KVT_QUANT_FAULT_PACK };
extern int kvt_quant_fault;

#endif
