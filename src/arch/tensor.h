/* The tensor fetchers (tensor.c): what an architecture's loader reads its
 * weights with. Not part of the public API. */
#ifndef KVT_TENSOR_H
#define KVT_TENSOR_H

#include "format/gguf.h"
#include "kernels/kernels.h"

#include <stdint.h>

/* Dequantise a named tensor of the expected shape into a new f32 array. */
int kvt_tensor_f32(const kvt_gguf *g, const char *name, uint64_t ne0, uint64_t ne1, float **out);
/* A named matrix of the expected shape (ne0 elements per row, ne1 rows), in
 * place in the mapped file, in its own type. */
int kvt_tensor_mat(const kvt_gguf *g, const char *name, uint64_t ne0, uint64_t ne1, kvt_wmat *out);
/* Add a matrix's bytes as stored to a fingerprint: an f32 matrix hashes as
 * its values alone (as before weights stayed in place), any other type with
 * its type id first. st is an XXH3_state_t. */
struct XXH3_state_s;
void kvt_tensor_hash(struct XXH3_state_s *st, const kvt_wmat *m);
/* Test hook: the matrix bytes kvt_tensor_hash has hashed, in all. */
extern _Atomic uint64_t kvt_tensor_hashed_bytes;
/* The same for a 3-D tensor (ne0, ne1, ne2): ne1 * ne2 rows (a mixture's
 * experts, expert e's rows e * ne1 ..). */
int kvt_tensor_mat3(const kvt_gguf *g, const char *name, uint64_t ne0, uint64_t ne1, uint64_t ne2,
                    kvt_wmat *out);

#endif
