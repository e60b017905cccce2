/* GGUF v2/v3 reader and writer (the subset kvtier needs: every metadata type
 * including nested arrays; the tensor types of src/format/quant.h: F32, F16, BF16,
 * Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ1_S, IQ1_M,
 * IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0,
 * MXFP4).
 *
 * Reader: kvt_gguf_open maps the file read-only and validates the whole header
 * before returning: every count, string length, array length, dimension and
 * tensor offset is checked against the bytes that remain, so a malformed file
 * is KVT_EFORMAT with a message naming the key/tensor and offset, never a
 * crash or an unchecked allocation. Everything returned (keys, strings, values,
 * tensor data) is borrowed from the kvt_gguf and valid until kvt_gguf_close.
 *
 * Writer: collects key/values and tensors, then writes a v3 file atomically
 * (temp file, fsync, rename, fsync of the directory). A written file reads
 * back identically (same keys in the same order, same values, same tensors).
 */
#ifndef KVT_GGUF_H
#define KVT_GGUF_H

#include "kvtier.h"

#include <sys/stat.h>
#include <time.h>

enum kvt_gguf_type {
    KVT_GGUF_U8 = 0, KVT_GGUF_I8 = 1, KVT_GGUF_U16 = 2, KVT_GGUF_I16 = 3,
    KVT_GGUF_U32 = 4, KVT_GGUF_I32 = 5, KVT_GGUF_F32 = 6, KVT_GGUF_BOOL = 7,
    KVT_GGUF_STR = 8, KVT_GGUF_ARR = 9, KVT_GGUF_U64 = 10, KVT_GGUF_I64 = 11,
    KVT_GGUF_F64 = 12,
};

/* ggml's type ids (ggml.h enum ggml_type) of the types kvtier reads; blocks
 * and layouts in src/format/quant.h. */
enum kvt_ggml_type {
    KVT_GGML_F32 = 0, KVT_GGML_F16 = 1, KVT_GGML_Q4_0 = 2, KVT_GGML_Q4_1 = 3,
    KVT_GGML_Q5_0 = 6, KVT_GGML_Q5_1 = 7, KVT_GGML_Q8_0 = 8, KVT_GGML_Q2_K = 10,
    KVT_GGML_Q3_K = 11, KVT_GGML_Q4_K = 12, KVT_GGML_Q5_K = 13, KVT_GGML_Q6_K = 14,
    KVT_GGML_IQ2_XXS = 16, KVT_GGML_IQ2_XS = 17, KVT_GGML_IQ3_XXS = 18, KVT_GGML_IQ1_S = 19,
    KVT_GGML_IQ4_NL = 20, KVT_GGML_IQ3_S = 21, KVT_GGML_IQ2_S = 22, KVT_GGML_IQ4_XS = 23,
    KVT_GGML_IQ1_M = 29, KVT_GGML_BF16 = 30, KVT_GGML_TQ1_0 = 34, KVT_GGML_TQ2_0 = 35,
    KVT_GGML_MXFP4 = 39,
};

/* One metadata value. Scalars live in the union (integers widened, floats as
 * double); strings are (str, n) and not NUL-terminated; arrays are n values
 * of elem_type in arr (nested arrays allowed). */
typedef struct kvt_gguf_val {
    uint32_t type;       /* enum kvt_gguf_type */
    uint32_t elem_type;  /* for KVT_GGUF_ARR: type of every element */
    uint64_t n;          /* string length in bytes, or array element count */
    union {
        uint64_t u;      /* U8..U64, BOOL (0/1) */
        int64_t i;       /* I8..I64 */
        double f;        /* F32, F64 */
        const char *str; /* STR */
        const struct kvt_gguf_val *arr; /* ARR */
    } v;
} kvt_gguf_val;

typedef struct kvt_gguf_tensor {
    const char *name;    /* NUL-terminated */
    uint32_t type;       /* enum kvt_ggml_type */
    uint32_t n_dims;     /* 1..4 */
    uint64_t ne[4];      /* ne[0] is the contiguous (row) dimension; unused = 1 */
    uint64_t n_elem;
    uint64_t offset;     /* from the start of the data section */
    uint64_t n_bytes;
    const void *data;    /* borrowed; in the mapping (reader) */
} kvt_gguf_tensor;

typedef struct kvt_gguf kvt_gguf;

int kvt_gguf_open(kvt_gguf **out, const char *path);
/* The header alone (metadata and tensor records) of a file that may end
 * there, as a download's first megabytes do: the tensors' places are
 * checked against each other, not against the file's size, and no tensor
 * has data (kvtier info and plan on files too large to load). */
int kvt_gguf_open_header(kvt_gguf **out, const char *path);
/* Parse a buffer the caller keeps alive until close (tests, fuzzing). */
int kvt_gguf_open_mem(kvt_gguf **out, const void *buf, size_t len);
void kvt_gguf_close(kvt_gguf *g);
/* The caller no longer needs bytes [p, p + n) of a mapped file resident:
 * the whole pages among them leave the process's memory, and stay readable
 * (a later read brings them back from the file). Nothing for a buffer of
 * kvt_gguf_open_mem, or bytes outside the file. */
void kvt_gguf_release(const kvt_gguf *g, const void *p, size_t n);

uint32_t kvt_gguf_version(const kvt_gguf *g);
uint32_t kvt_gguf_alignment(const kvt_gguf *g);
/* What kvt_gguf_open saw of the file: the fstat of the descriptor it
 * mapped, and the time (CLOCK_REALTIME) taken just before that fstat (a
 * change to the file after it has a ctime at or after that time, give or
 * take the clock's tick). false, nothing written: not opened from a file
 * (kvt_gguf_open_mem). */
bool kvt_gguf_file_stat(const kvt_gguf *g, struct stat *st, struct timespec *seen);
/* The header's bytes: the file's first *len bytes, up to the data section
 * (metadata, tensor records, padding). Borrowed, valid until close. */
const void *kvt_gguf_header_bytes(const kvt_gguf *g, size_t *len);

size_t kvt_gguf_n_kv(const kvt_gguf *g);
const char *kvt_gguf_key(const kvt_gguf *g, size_t i);          /* NUL-terminated */
const kvt_gguf_val *kvt_gguf_val_at(const kvt_gguf *g, size_t i);
const kvt_gguf_val *kvt_gguf_get(const kvt_gguf *g, const char *key); /* NULL if absent */

/* Typed getters. KVT_ENOENT when absent (out untouched), KVT_EFORMAT when the
 * type does not fit (any integer type converts when the value is in range;
 * F32/F64 both read as float/double). */
int kvt_gguf_get_u32(const kvt_gguf *g, const char *key, uint32_t *out);
int kvt_gguf_get_i64(const kvt_gguf *g, const char *key, int64_t *out);
int kvt_gguf_get_f32(const kvt_gguf *g, const char *key, float *out);
int kvt_gguf_get_bool(const kvt_gguf *g, const char *key, bool *out);
int kvt_gguf_get_str(const kvt_gguf *g, const char *key, const char **s, size_t *len);
/* Array of the given element type (KVT_EFORMAT when another type). */
int kvt_gguf_get_arr(const kvt_gguf *g, const char *key, uint32_t elem_type,
                     const kvt_gguf_val **items, size_t *n);

size_t kvt_gguf_n_tensors(const kvt_gguf *g);
const kvt_gguf_tensor *kvt_gguf_tensor_at(const kvt_gguf *g, size_t i);
const kvt_gguf_tensor *kvt_gguf_find_tensor(const kvt_gguf *g, const char *name);

/* Dequantise a tensor (any supported type) into n f32 values; n must equal
 * t->n_elem. */
int kvt_gguf_tensor_to_f32(const kvt_gguf_tensor *t, float *out, size_t n);
/* Bytes for n elements of a type a file may store (n a multiple of the block
 * size): the types kvtier computes with (kvt_quant_row_bytes) and ggml's
 * plain I8, I16, I32, I64 and F64; 0 for another type or n not a whole
 * number of blocks. */
size_t kvt_ggml_type_size(uint32_t type, uint64_t n);
/* ggml's name of the type ("q4_K"), "unknown" for an id ggml lacks. */
const char *kvt_ggml_type_name(uint32_t type);

/* ---- writer ---- */

typedef struct kvt_gguf_writer kvt_gguf_writer;

kvt_gguf_writer *kvt_gguf_writer_new(void);
void kvt_gguf_writer_free(kvt_gguf_writer *w);
/* Deep-copies the value (strings and nested arrays). Replaces an existing key. */
int kvt_gguf_writer_set(kvt_gguf_writer *w, const char *key, const kvt_gguf_val *v);
int kvt_gguf_writer_set_u32(kvt_gguf_writer *w, const char *key, uint32_t v);
int kvt_gguf_writer_set_f32(kvt_gguf_writer *w, const char *key, float v);
int kvt_gguf_writer_set_bool(kvt_gguf_writer *w, const char *key, bool v);
int kvt_gguf_writer_set_str(kvt_gguf_writer *w, const char *key, const char *s);
/* Copies the tensor bytes (n_bytes must equal kvt_ggml_type_size(type, n_elem)).
 * data NULL records the tensor without bytes: a writer holding such a
 * tensor writes the header alone (the data section's offsets as if the
 * bytes followed). */
int kvt_gguf_writer_add_tensor(kvt_gguf_writer *w, const char *name, uint32_t type,
                               uint32_t n_dims, const uint64_t *ne, const void *data,
                               size_t n_bytes);
/* Write version 3, alignment 32 (or general.alignment when set), atomically. */
int kvt_gguf_writer_write(kvt_gguf_writer *w, const char *path);
/* Serialise into a malloc'ed buffer (tests). */
int kvt_gguf_writer_to_mem(kvt_gguf_writer *w, uint8_t **out, size_t *len);

#endif
