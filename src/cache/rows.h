/* How a K or V row is stored: one row per entry of the table in rows.c
 * (f32, f16, bf16, q8_0). A row is rounded once, when it is written
 * (kvt_rows_put), and read back exactly (kvt_rows_get: f16 and bf16 widen
 * exactly to f32; a q8_0 element d * q is exact in f32, an 11-bit scale
 * times an 8-bit integer), so whatever reads rows reads the same f32
 * values on every path. Putting a row that was got from a put gives the
 * same values again (kvt_rows_round relies on it; tests/test_rows.c proves
 * it for every type), and the same bytes but in one case: a q8_0 block
 * whose scale underflows f16 (every element below about 3.8e-6) reads
 * back as zeros, and ggml's quantiser writes such a block with non-zero
 * quants the second put makes zero. Every path rounds the same way
 * (rounded in place, then put), so the cache bytes do not depend on it. */
#ifndef KVT_ROWS_H
#define KVT_ROWS_H

#include "kvtier.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A row type other than KVT_ROWS_DEFAULT: the one it stands for. */
kvt_row_type kvt_rows_resolve(kvt_row_type t);
/* Whether t (resolved) is a type, and rows of n elements fit its blocks. */
bool kvt_rows_fits(kvt_row_type t, size_t n);
/* Elements per block (1, or 32 for q8_0). */
size_t kvt_rows_block(kvt_row_type t);
/* Bytes of a row of n elements (n a multiple of the block). */
size_t kvt_rows_bytes(kvt_row_type t, size_t n);
/* ggml's type id of t (for files and messages). */
uint32_t kvt_rows_ggml(kvt_row_type t);
/* n elements of src rounded into dst (kvt_rows_bytes(t, n) bytes). */
void kvt_rows_put(kvt_row_type t, void *dst, const float *src, size_t n);
/* n elements of src (a put row) into dst, exactly. */
void kvt_rows_get(kvt_row_type t, float *dst, const void *src, size_t n);
/* x (n elements) replaced by what storing it as t and reading it back
 * gives: the values every reader of the stored row will see. */
void kvt_rows_round(kvt_row_type t, float *x, size_t n);

#endif
