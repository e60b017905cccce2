/* The Q8_K activations the integer kernels of the 256-element types read
 * (qkernels.c writes them, qkernels.c and qlowbit.c read them), kept below
 * both so that neither needs the other for the layout.
 *
 * Per token, for cols / 256 superblocks: the f32 scales d (nsb), then the
 * int16 sums of each 16 values (nsb * 16), then the int8 values
 * (nsb * 256); value i of the token is d[i / 256] * q[i] (ggml's Q8_K). */
#ifndef KVT_Q8K_H
#define KVT_Q8K_H

#include <stddef.h>
#include <stdint.h>

#define KVT_Q8K_N 256 /* elements per superblock */

/* A token's Q8_K activations, borrowed from the matmul's scratch. */
typedef struct kvt_q8k {
    const float *d;    /* (nsb) */
    const int16_t *bs; /* (nsb, 16) */
    const int8_t *q;   /* (nsb, 256) */
} kvt_q8k;

/* Bytes of one token's activations of cols elements (cols whole superblocks). */
static inline size_t kvt_q8k_stride(size_t cols)
{
    return cols / KVT_Q8K_N * (sizeof(float) + 16 * sizeof(int16_t) + KVT_Q8K_N);
}

/* Token t's activations in qx (tokens kvt_q8k_stride(cols) apart). */
static inline kvt_q8k kvt_q8k_at(const uint8_t *qx, size_t t, size_t cols)
{
    size_t nsb = cols / KVT_Q8K_N;
    const uint8_t *base = qx + t * kvt_q8k_stride(cols);
    return (kvt_q8k){(const float *)base, (const int16_t *)(base + nsb * sizeof(float)),
                     (const int8_t *)(base + nsb * (sizeof(float) + 16 * sizeof(int16_t)))};
}

#endif
