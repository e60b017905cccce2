/* libggml-base of the peer's llama.cpp, dlopen()ed for the tests that
 * compare kvtier's number formats with ggml's own (tests/test_quant.c,
 * tests/test_rows.c). */
#ifndef KVT_TEST_PEER_GGML_H
#define KVT_TEST_PEER_GGML_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define GGML_LIB FX_PEER_BINS "/libggml-base.so"
#define GGML_TYPE_COUNT 43   /* ggml.h of that llama.cpp: enum ggml_type ends with Q2_0 = 42 */

/* ggml/include/ggml.h (the llama.cpp that node-llama-cpp FX_PEER_VERSION
 * builds: its llama/gitRelease.bundle): struct ggml_type_traits and its
 * function types, fields in that file's order. enum ggml_type is passed as
 * an int. */
typedef void (*ggml_to_float_t)(const void *x, float *y, int64_t k);
typedef void (*ggml_from_float_t)(const float *x, void *y, int64_t k);
struct ggml_type_traits {
    const char *type_name;
    int64_t blck_size;
    int64_t blck_size_interleave; /* interleave elements in blocks */
    size_t type_size;
    bool is_quantized;
    ggml_to_float_t to_float;
    ggml_from_float_t from_float_ref;
};

extern struct fx_ggml {
    void *lib;
    const struct ggml_type_traits *(*traits)(int type);
    size_t (*quantize_chunk)(int type, const float *src, void *dst, int64_t start, int64_t nrows,
                             int64_t n_per_row, const float *imatrix);
} ggml;

/* Load libggml-base.so once (it stays loaded); NULL, or why it cannot be. */
const char *ggml_load(void);

#endif
