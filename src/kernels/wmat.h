/* A weight matrix as the model file holds it (kvt_wmat): the type the f32
 * kernels (kernels.h) and the integer kernels (qkernels.h) both take, kept
 * below both so that neither needs the other's header for it. */
#ifndef KVT_WMAT_H
#define KVT_WMAT_H

#include "format/gguf.h"

#include <stddef.h>
#include <stdint.h>

/* Rows of cols elements of one ggml type (src/format/quant.h), row r at
 * data + r * row_bytes. The data is borrowed (the mapped GGUF, or the
 * architecture's own array). */
typedef struct kvt_wmat {
    const uint8_t *data;
    uint32_t type;
    size_t rows, cols, row_bytes;
    const uint8_t *pk; /* NULL, or the rows packed four at a time (kvt_q_pack), which the SIMD kernels read */
} kvt_wmat;

/* An f32 (rows, cols) array as a kvt_wmat. */
static inline kvt_wmat kvt_wmat_f32(const float *W, size_t rows, size_t cols)
{
    return (kvt_wmat){(const uint8_t *)W, KVT_GGML_F32, rows, cols, cols * sizeof(float), NULL};
}
/* Rows [r0, r0 + n) of m as a matrix of their own (unpacked: pk NULL). */
static inline kvt_wmat kvt_wmat_rows(const kvt_wmat *m, size_t r0, size_t n)
{
    return (kvt_wmat){m->data + r0 * m->row_bytes, m->type, n, m->cols, m->row_bytes, NULL};
}

#endif
