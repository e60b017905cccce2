/* GGUF v2/v3: the reader (validate the whole header, then hand out borrowed
 * views of the mapping) and the writer (collect, lay out, write atomically).
 *
 * The format, little-endian throughout:
 *
 *   "GGUF" | u32 version | u64 n_tensors | u64 n_kv
 *   n_kv      x { str key | u32 value type | value }
 *   n_tensors x { str name | u32 n_dims | u64 ne[n_dims] | u32 ggml type | u64 offset }
 *   zero padding to general.alignment (u32, default 32)
 *   data section: tensor i at data + offset_i (offsets multiples of the alignment)
 *
 * where str = u64 length + bytes (no NUL), and an array value = u32 element
 * type + u64 count + count element payloads (an element that is itself an
 * array carries its own type + count prefix). v2 and v3 share this layout;
 * v3 only added the (big-endian) variant we refuse.
 *
 * The reader never trusts a count. Before anything is allocated, a count is
 * checked against the bytes that remain divided by the smallest encoding of
 * one item, so memory stays within a constant factor of the file size (one
 * kvt_gguf_val, 24 bytes, per input byte at worst) and a corrupt count is a
 * KVT_EFORMAT message, never a huge malloc. String values stay in the mapping;
 * keys and tensor names are copied to gain their NUL.
 */
#include "format/gguf.h"
#include "format/quant.h"
#include "base/util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gguf.c reads and writes host-order integers; it assumes a little-endian host"
#endif

#define MAX_DEPTH 16          /* array nesting; real files nest at most once */
#define DEFAULT_ALIGNMENT 32
/* Smallest encodings, used to bound counts before allocating. */
#define MIN_KV_BYTES 13       /* key length 8 + type 4 + a 1-byte value */
#define MIN_TENSOR_BYTES 32   /* name length 8 + n_dims 4 + ne 8 + type 4 + offset 8 */

/* ---- value types --------------------------------------------------------- */

static const char *const value_type_names[] = {
    "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "str", "arr", "u64", "i64", "f64",
};

static const char *value_type_name(uint32_t t)
{
    return t <= KVT_GGUF_F64 ? value_type_names[t] : "invalid";
}

/* Encoded bytes of a scalar type; 0 for STR, ARR and invalid types. */
static size_t scalar_size(uint32_t t)
{
    switch (t) {
    case KVT_GGUF_U8: case KVT_GGUF_I8: case KVT_GGUF_BOOL: return 1;
    case KVT_GGUF_U16: case KVT_GGUF_I16: return 2;
    case KVT_GGUF_U32: case KVT_GGUF_I32: case KVT_GGUF_F32: return 4;
    case KVT_GGUF_U64: case KVT_GGUF_I64: case KVT_GGUF_F64: return 8;
    }
    return 0;
}

/* Smallest encoding of one value: a scalar, a string's length prefix, an
 * array's type + count prefix. */
static size_t min_value_size(uint32_t t)
{
    return t == KVT_GGUF_STR ? 8 : t == KVT_GGUF_ARR ? 12 : scalar_size(t);
}

static bool is_signed_int(uint32_t t)
{
    return t == KVT_GGUF_I8 || t == KVT_GGUF_I16 || t == KVT_GGUF_I32 || t == KVT_GGUF_I64;
}

static bool is_int(uint32_t t)
{
    return is_signed_int(t) || t == KVT_GGUF_U8 || t == KVT_GGUF_U16 || t == KVT_GGUF_U32 ||
           t == KVT_GGUF_U64;
}

static void decode_scalar(const uint8_t *p, uint32_t t, kvt_gguf_val *v)
{
    float f;
    switch (t) {
    case KVT_GGUF_U8: case KVT_GGUF_BOOL: v->v.u = p[0]; break;
    case KVT_GGUF_I8: v->v.i = (int8_t)p[0]; break;
    case KVT_GGUF_U16: v->v.u = kvt_rd16(p); break;
    case KVT_GGUF_I16: v->v.i = (int16_t)kvt_rd16(p); break;
    case KVT_GGUF_U32: v->v.u = kvt_rd32(p); break;
    case KVT_GGUF_I32: v->v.i = (int32_t)kvt_rd32(p); break;
    case KVT_GGUF_F32: memcpy(&f, p, 4); v->v.f = f; break;
    case KVT_GGUF_U64: v->v.u = kvt_rd64(p); break;
    case KVT_GGUF_I64: v->v.i = (int64_t)kvt_rd64(p); break;
    case KVT_GGUF_F64: memcpy(&v->v.f, p, 8); break;
    }
}

/* ---- tensor types -------------------------------------------------------- */

/* The types, their blocks and their dequantisers live in quant.c; gguf.c
 * only checks shapes and sizes against them. */

const char *kvt_ggml_type_name(uint32_t type)
{
    const char *s = kvt_quant_name(type);
    return s ? s : "unknown";
}

/* The types a file may store: those kvtier computes with (kvt_quant_block)
 * and ggml's plain integer and f64 types (one element a block), which a
 * model may hold as tables (DeepSeek-V4's token -> experts map is I32). */
static bool storage_block(uint32_t type, size_t *elems, size_t *bytes)
{
    static const uint8_t plain[] = {[24] = 1, [25] = 2, [26] = 4, [27] = 8, [28] = 8};
    if (kvt_quant_block(type, elems, bytes)) return true;
    if (type >= sizeof plain || !plain[type]) return false;
    if (elems) *elems = 1;
    if (bytes) *bytes = plain[type];
    return true;
}

size_t kvt_ggml_type_size(uint32_t type, uint64_t n)
{
    size_t bytes;
    uint64_t r;
    if (kvt_quant_block(type, NULL, NULL)) return kvt_quant_row_bytes(type, n);
    if (!storage_block(type, NULL, &bytes) || __builtin_mul_overflow(n, (uint64_t)bytes, &r) || r > SIZE_MAX)
        return 0;
    return (size_t)r;
}

/* "f32, f16, ..." : the types kvt_quant_block accepts, for messages. */
static void supported_types(char *buf, size_t len)
{
    size_t o = 0;
    buf[0] = 0;
    for (uint32_t t = 0; t < 64 && o < len; t++)
        if (storage_block(t, NULL, NULL))
            o += (size_t)snprintf(buf + o, len - o, "%s%s", o ? ", " : "", kvt_quant_name(t));
}

int kvt_gguf_tensor_to_f32(const kvt_gguf_tensor *t, float *out, size_t n)
{
    if (!t || (!out && n)) return kvt_fail(KVT_EINVAL, "gguf: tensor_to_f32: NULL argument");
    size_t need = kvt_ggml_type_size(t->type, t->n_elem);
    if (!need)
        return kvt_fail(KVT_EUNSUPPORTED, "gguf: tensor '%s': cannot dequantise type %s (%u)",
                        t->name ? t->name : "?", kvt_ggml_type_name(t->type), t->type);
    if (n != t->n_elem || need != t->n_bytes || !t->data)
        return kvt_fail(KVT_EINVAL,
                        "gguf: tensor '%s': asked for %zu values, it holds %llu (%llu bytes)",
                        t->name ? t->name : "?", n, (unsigned long long)t->n_elem,
                        (unsigned long long)t->n_bytes);
    return kvt_quant_to_f32(t->type, t->data, out, n);
}

/* ---- name index ---------------------------------------------------------- */

/* Open addressing from a NUL-terminated name to its position; a slot holds
 * position + 1 so that 0 means empty. At most half full, so probes end. Keeps
 * duplicate detection and lookups linear for files with many tensors. */
typedef struct name_index {
    size_t *slot;
    size_t mask;
} name_index;

static uint64_t hash_name(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

static int index_init(name_index *ix, size_t n)
{
    size_t cap = 8;
    while (cap / 2 < n) cap *= 2;
    ix->slot = kvt_calloc(cap, sizeof *ix->slot);
    ix->mask = cap - 1;
    return ix->slot ? KVT_OK : KVT_ENOMEM;
}

static size_t index_find(const name_index *ix, char *const *names, const char *name)
{
    if (!ix->slot || !name) return SIZE_MAX;
    for (size_t h = hash_name(name) & ix->mask; ix->slot[h]; h = (h + 1) & ix->mask)
        if (!strcmp(names[ix->slot[h] - 1], name)) return ix->slot[h] - 1;
    return SIZE_MAX;
}

/* Add names[i]; false when the name is already present. */
static bool index_add(name_index *ix, char *const *names, size_t i)
{
    size_t h = hash_name(names[i]) & ix->mask;
    for (; ix->slot[h]; h = (h + 1) & ix->mask)
        if (!strcmp(names[ix->slot[h] - 1], names[i])) return false;
    ix->slot[h] = i + 1;
    return true;
}

/* ---- reader -------------------------------------------------------------- */

struct kvt_gguf {
    const uint8_t *base;     /* the file bytes (mapping or caller buffer) */
    size_t len;
    void *map;               /* munmap'ed on close; NULL for open_mem */
    uint32_t version, alignment;
    size_t n_kv;
    char **keys;             /* (n_kv) owned, NUL-terminated */
    kvt_gguf_val *vals;      /* (n_kv) arrays owned, strings borrowed */
    name_index key_index;
    size_t n_tensors;
    char **tensor_names;     /* (n_tensors) owned; tensors[i].name aliases */
    kvt_gguf_tensor *tensors;
    name_index tensor_index;
    size_t data_off;         /* file offset of the data section */
    bool header_only;        /* kvt_gguf_open_header: tensors' bytes need not be in the file */
    bool from_file;          /* opened from a file: st and seen below */
    struct stat st;          /* fstat of the descriptor that was mapped */
    struct timespec seen;    /* CLOCK_REALTIME just before that fstat */
};

/* Only array storage is owned; recurse only where elements are arrays so that
 * freeing a 100k-token string array touches one pointer. */
static void free_read_val(kvt_gguf_val *v)
{
    if (v->type != KVT_GGUF_ARR || !v->v.arr) return;
    kvt_gguf_val *items = (kvt_gguf_val *)v->v.arr; /* allocated by read_value */
    if (v->elem_type == KVT_GGUF_ARR)
        for (uint64_t i = 0; i < v->n; i++) free_read_val(&items[i]);
    free(items);
}

void kvt_gguf_release(const kvt_gguf *g, const void *p, size_t n)
{
    if (!g || !g->map || !p) return;
    uintptr_t b = (uintptr_t)g->base, a = (uintptr_t)p;
    if (a < b || a - b > g->len || n > g->len - (a - b)) return;
    uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE), lo = (a + pg - 1) / pg * pg, hi = (a + n) / pg * pg;
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

void kvt_gguf_close(kvt_gguf *g)
{
    if (!g) return;
    for (size_t i = 0; i < g->n_kv; i++) {
        free(g->keys[i]);
        free_read_val(&g->vals[i]);
    }
    for (size_t i = 0; i < g->n_tensors; i++) free(g->tensor_names[i]);
    free(g->keys);
    free(g->vals);
    free(g->key_index.slot);
    free(g->tensor_names);
    free(g->tensors);
    free(g->tensor_index.slot);
    if (g->map) munmap(g->map, g->len);
    free(g);
}

/* Parse position plus what is being parsed, so every message can name it. */
typedef struct cursor {
    const uint8_t *p;
    size_t len, pos;
    char what[112];          /* "header", "key 'x'", "tensor 'y'" */
} cursor;

static size_t left(const cursor *c) { return c->len - c->pos; }

__attribute__((format(printf, 3, 4)))
static int bad(const cursor *c, size_t off, const char *fmt, ...)
{
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvt_fail(KVT_EFORMAT, "%s: %s (offset %zu)", c->what, msg, off);
}

static int take_u32(cursor *c, const char *item, uint32_t *v)
{
    if (left(c) < 4) return bad(c, c->pos, "%s needs 4 bytes, %zu remain", item, left(c));
    *v = kvt_rd32(c->p + c->pos);
    c->pos += 4;
    return KVT_OK;
}

static int take_u64(cursor *c, const char *item, uint64_t *v)
{
    if (left(c) < 8) return bad(c, c->pos, "%s needs 8 bytes, %zu remain", item, left(c));
    *v = kvt_rd64(c->p + c->pos);
    c->pos += 8;
    return KVT_OK;
}

static int take_str(cursor *c, const char *item, const char **s, uint64_t *n)
{
    size_t at = c->pos;
    int rc = take_u64(c, item, n);
    if (rc) return rc;
    if (*n > left(c))
        return bad(c, at, "%s length %llu exceeds the %zu bytes remaining", item,
                   (unsigned long long)*n, left(c));
    *s = (const char *)c->p + c->pos;
    c->pos += (size_t)*n;
    return KVT_OK;
}

static int read_value(cursor *c, uint32_t type, kvt_gguf_val *v, int depth)
{
    size_t at = c->pos, sz = scalar_size(type);
    v->type = type;
    if (sz) {
        if (left(c) < sz)
            return bad(c, at, "%s value needs %zu bytes, %zu remain", value_type_name(type), sz,
                       left(c));
        decode_scalar(c->p + at, type, v);
        if (type == KVT_GGUF_BOOL && v->v.u > 1)
            return bad(c, at, "bool value %llu is neither 0 nor 1", (unsigned long long)v->v.u);
        c->pos += sz;
        return KVT_OK;
    }
    if (type == KVT_GGUF_STR) return take_str(c, "string", &v->v.str, &v->n);
    if (type != KVT_GGUF_ARR) return bad(c, at, "unknown value type %u", type);

    if (depth >= MAX_DEPTH) return bad(c, at, "arrays nested deeper than %d", MAX_DEPTH);
    uint32_t et = 0;
    uint64_t n = 0;
    int rc = take_u32(c, "array element type", &et);
    if (!rc) rc = take_u64(c, "array count", &n);
    if (rc) return rc;
    if (et > KVT_GGUF_F64) return bad(c, at, "unknown array element type %u", et);
    size_t min = min_value_size(et);
    if (n > left(c) / min)
        return bad(c, at, "array of %llu %s needs at least %zu bytes each, %zu remain",
                   (unsigned long long)n, value_type_name(et), min, left(c));
    v->elem_type = et;
    if (n == 0) return KVT_OK;
    /* Zeroed items read as empty U8 scalars, so a partly read array frees cleanly. */
    kvt_gguf_val *items = kvt_calloc((size_t)n, sizeof *items);
    if (!items) return KVT_ENOMEM;
    v->v.arr = items;
    v->n = n;

    /* one call per element is cheap: the 100k-token arrays read in ~1 ms */
    for (uint64_t i = 0; i < n; i++)
        if ((rc = read_value(c, et, &items[i], depth + 1))) return rc;
    return KVT_OK;
}

/* Key or tensor name: copied for its NUL, so an embedded NUL would make two
 * different names compare equal and is refused. */
static int take_name(cursor *c, const char *item, char **out)
{
    size_t at = c->pos;
    const char *s;
    uint64_t n;
    int rc = take_str(c, item, &s, &n);
    if (rc) return rc;
    if (memchr(s, 0, (size_t)n)) return bad(c, at, "%s contains a NUL byte", item);
    *out = kvt_strndup(s, (size_t)n);
    return *out ? KVT_OK : KVT_ENOMEM;
}

static int parse_kvs(kvt_gguf *g, cursor *c, uint64_t n_kv)
{
    if (n_kv > left(c) / MIN_KV_BYTES)
        return bad(c, c->pos, "%llu key/values need at least %d bytes each, %zu remain",
                   (unsigned long long)n_kv, MIN_KV_BYTES, left(c));
    g->keys = kvt_calloc((size_t)n_kv, sizeof *g->keys);
    g->vals = kvt_calloc((size_t)n_kv, sizeof *g->vals);
    if (!g->keys || !g->vals || index_init(&g->key_index, (size_t)n_kv)) return KVT_ENOMEM;
    for (size_t i = 0; i < n_kv; i++) {
        size_t at = c->pos;
        snprintf(c->what, sizeof c->what, "key/value %zu", i);
        int rc = take_name(c, "key", &g->keys[i]);
        if (rc) return rc;
        g->n_kv = i + 1;
        snprintf(c->what, sizeof c->what, "key '%.80s'", g->keys[i]);
        if (!index_add(&g->key_index, g->keys, i)) return bad(c, at, "duplicate key");
        uint32_t type = 0;
        if ((rc = take_u32(c, "value type", &type))) return rc;
        if ((rc = read_value(c, type, &g->vals[i], 0))) return rc;
        if (!strcmp(g->keys[i], "general.alignment")) {
            const kvt_gguf_val *v = &g->vals[i];
            if (v->type != KVT_GGUF_U32 || v->v.u == 0 || (v->v.u & (v->v.u - 1)))
                return bad(c, at, "must be a non-zero power of two of type u32, not %s %llu",
                           value_type_name(v->type), (unsigned long long)v->v.u);
            g->alignment = (uint32_t)v->v.u;
        }
    }
    return KVT_OK;
}

static int parse_tensor(kvt_gguf *g, cursor *c, size_t i)
{
    kvt_gguf_tensor *t = &g->tensors[i];
    size_t at = c->pos;
    snprintf(c->what, sizeof c->what, "tensor %zu", i);
    int rc = take_name(c, "tensor name", &g->tensor_names[i]);
    if (rc) return rc;
    g->n_tensors = i + 1;
    t->name = g->tensor_names[i];
    snprintf(c->what, sizeof c->what, "tensor '%.80s'", t->name);
    if (!index_add(&g->tensor_index, g->tensor_names, i)) return bad(c, at, "duplicate tensor name");

    size_t dims_at = c->pos;
    if ((rc = take_u32(c, "n_dims", &t->n_dims))) return rc;
    if (t->n_dims < 1 || t->n_dims > 4)
        return bad(c, dims_at, "n_dims %u is not in 1..4", t->n_dims);
    t->n_elem = 1;
    for (uint32_t d = 0; d < 4; d++) {
        t->ne[d] = 1;
        if (d >= t->n_dims) continue;
        size_t ne_at = c->pos;
        if ((rc = take_u64(c, "dimension", &t->ne[d]))) return rc;
        if (t->ne[d] == 0) return bad(c, ne_at, "dimension %u is 0", d);
        /* ggml holds sizes in int64_t */
        if (__builtin_mul_overflow(t->n_elem, t->ne[d], &t->n_elem) || t->n_elem > INT64_MAX)
            return bad(c, ne_at, "element count overflows at dimension %u (%llu)", d,
                       (unsigned long long)t->ne[d]);
    }
    size_t type_at = c->pos;
    if ((rc = take_u32(c, "tensor type", &t->type))) return rc;
    size_t blk;
    if (!storage_block(t->type, &blk, NULL)) {
        char list[256];
        supported_types(list, sizeof list);
        return kvt_fail(KVT_EUNSUPPORTED, "%s: type %s (%u) is not supported (only %s) (offset %zu)",
                        c->what, kvt_ggml_type_name(t->type), t->type, list, type_at);
    }
    /* whole blocks per row, so that every row starts on a block */
    if (t->ne[0] % blk)
        return bad(c, type_at, "row length %llu is not a multiple of the %s block of %zu",
                   (unsigned long long)t->ne[0], kvt_ggml_type_name(t->type), blk);
    t->n_bytes = kvt_ggml_type_size(t->type, t->n_elem);
    if (!t->n_bytes) return bad(c, type_at, "byte size overflows");
    size_t off_at = c->pos;
    if ((rc = take_u64(c, "data offset", &t->offset))) return rc;
    if (t->offset % g->alignment)
        return bad(c, off_at, "data offset %llu is not a multiple of the alignment %u",
                   (unsigned long long)t->offset, g->alignment);
    return KVT_OK;
}

typedef struct span { uint64_t begin, end; size_t i; } span;

static int cmp_span(const void *a, const void *b)
{
    const span *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

/* Every tensor inside the file and no two sharing a byte: a file whose
 * tensors alias would make a write through one view corrupt another. */
static int check_data(kvt_gguf *g)
{
    if (!g->n_tensors) return KVT_OK; /* metadata-only files may end at the header */
    if (g->header_only) {
        /* the data section may lie past the end: only the tensors' places
         * are checked (no two share a byte); none has data */
        for (size_t i = 0; i < g->n_tensors; i++)
            if (g->tensors[i].n_bytes > UINT64_MAX - g->tensors[i].offset)
                return kvt_fail(KVT_EFORMAT, "tensor '%.80s': %llu bytes at data offset %llu overflow",
                                g->tensors[i].name, (unsigned long long)g->tensors[i].n_bytes,
                                (unsigned long long)g->tensors[i].offset);
    } else if (g->data_off > g->len)
        return kvt_fail(KVT_EFORMAT, "data section starts at offset %zu, past the end of the "
                        "%zu-byte file", g->data_off, g->len);
    size_t avail = g->len > g->data_off ? g->len - g->data_off : 0;
    for (size_t i = 0; i < g->n_tensors && !g->header_only; i++) {
        kvt_gguf_tensor *t = &g->tensors[i];
        if (t->offset > avail || t->n_bytes > avail - t->offset)
            return kvt_fail(KVT_EFORMAT, "tensor '%.80s': %llu bytes at data offset %llu run "
                            "past the end of the %zu-byte file (data section at offset %zu)",
                            t->name, (unsigned long long)t->n_bytes,
                            (unsigned long long)t->offset, g->len, g->data_off);
        t->data = g->base + g->data_off + t->offset;
    }
    span *s = kvt_malloc(g->n_tensors * sizeof *s);
    if (!s) return KVT_ENOMEM;
    for (size_t i = 0; i < g->n_tensors; i++)
        s[i] = (span){g->tensors[i].offset, g->tensors[i].offset + g->tensors[i].n_bytes, i};
    qsort(s, g->n_tensors, sizeof *s, cmp_span);
    int rc = KVT_OK;
    for (size_t k = 1; k < g->n_tensors && !rc; k++)
        if (s[k].begin < s[k - 1].end)
            rc = kvt_fail(KVT_EFORMAT, "tensors '%.80s' and '%.80s' overlap (file offset %zu)",
                          g->tensors[s[k - 1].i].name, g->tensors[s[k].i].name,
                          g->data_off + (size_t)s[k].begin);
    free(s);
    return rc;
}

static int parse(kvt_gguf *g)
{
    cursor c = {.p = g->base, .len = g->len, .what = "header"};
    if (g->len < 4 || memcmp(g->base, "GGUF", 4)) {
        if (g->len < 4) return bad(&c, 0, "%zu bytes is too short for the GGUF magic", g->len);
        return bad(&c, 0, "bad magic %02x %02x %02x %02x, not a GGUF file", g->base[0],
                   g->base[1], g->base[2], g->base[3]);
    }
    c.pos = 4;
    uint32_t version = 0;
    uint64_t n_tensors = 0, n_kv = 0;
    int rc = take_u32(&c, "version", &version);
    if (rc) return rc;
    if (version && !(version & 0xffff))
        return kvt_fail(KVT_EUNSUPPORTED, "header: version bytes %08x: a big-endian GGUF, only "
                        "little-endian is supported (offset 4)", version);
    if (version == 1 || version > 3)
        return kvt_fail(KVT_EUNSUPPORTED, "header: GGUF version %u is not supported (only 2 and "
                        "3) (offset 4)", version);
    if (version == 0) return bad(&c, 4, "version 0 is not a GGUF version");
    g->version = version;
    if ((rc = take_u64(&c, "tensor count", &n_tensors))) return rc;
    if ((rc = take_u64(&c, "key/value count", &n_kv))) return rc;

    g->alignment = DEFAULT_ALIGNMENT;
    if ((rc = parse_kvs(g, &c, n_kv))) return rc;

    snprintf(c.what, sizeof c.what, "tensor infos");
    if (n_tensors > left(&c) / MIN_TENSOR_BYTES)
        return bad(&c, c.pos, "%llu tensors need at least %d bytes each, %zu remain",
                   (unsigned long long)n_tensors, MIN_TENSOR_BYTES, left(&c));
    g->tensor_names = kvt_calloc((size_t)n_tensors, sizeof *g->tensor_names);
    g->tensors = kvt_calloc((size_t)n_tensors, sizeof *g->tensors);
    if (!g->tensor_names || !g->tensors || index_init(&g->tensor_index, (size_t)n_tensors))
        return KVT_ENOMEM;
    for (size_t i = 0; i < n_tensors; i++)
        if ((rc = parse_tensor(g, &c, i))) return rc;

    /* pos <= len and alignment <= 2^31: no wrap with a 64-bit size_t */
    g->data_off = (c.pos + g->alignment - 1) & ~((size_t)g->alignment - 1);
    return check_data(g);
}

/* Takes the mapping (if any): on failure it is unmapped. */
static int open_buf(kvt_gguf **out, const void *buf, size_t len, void *map, bool header_only)
{
    kvt_gguf *g = kvt_calloc(1, sizeof *g);
    if (!g) {
        if (map) munmap(map, len);
        return KVT_ENOMEM;
    }
    g->base = buf;
    g->len = len;
    g->map = map;
    g->header_only = header_only;
    int rc = parse(g);
    if (rc) {
        kvt_gguf_close(g);
        return rc;
    }
    *out = g;
    return KVT_OK;
}

/* Prefix the recorded message with where the bytes came from. */
static int prefix_msg(int rc, const char *src)
{
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kvt_errmsg());
    return kvt_fail(rc, "gguf %s: %s", src, msg);
}

int kvt_gguf_open_mem(kvt_gguf **out, const void *buf, size_t len)
{
    if (!out || (!buf && len)) return kvt_fail(KVT_EINVAL, "gguf: open_mem: NULL argument");
    *out = NULL;
    static const uint8_t none[1];
    int rc = open_buf(out, buf ? buf : none, len, NULL, false);
    return rc ? prefix_msg(rc, "buffer") : KVT_OK;
}

static int open_file(kvt_gguf **out, const char *path, bool header_only)
{
    if (!out || !path) return kvt_fail(KVT_EINVAL, "gguf: open: NULL argument");
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kvt_fail(errno == ENOENT ? KVT_ENOENT : KVT_EIO, "gguf '%s': cannot open: %s",
                        path, strerror(errno));
    struct stat st;
    struct timespec seen;
    clock_gettime(CLOCK_REALTIME, &seen);
    if (fstat(fd, &st)) {
        int e = errno;
        close(fd);
        return kvt_fail(KVT_EIO, "gguf '%s': cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode) || st.st_size <= 0 || (uint64_t)st.st_size > SIZE_MAX) {
        close(fd);
        return kvt_fail(S_ISREG(st.st_mode) ? KVT_EFORMAT : KVT_EIO,
                        "gguf '%s': %s", path, S_ISREG(st.st_mode) ? "empty file"
                                                                   : "not a regular file");
    }
    size_t len = (size_t)st.st_size;
    void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd); /* the mapping keeps the file alive */
    if (map == MAP_FAILED) return kvt_fail(KVT_EIO, "gguf '%s': cannot map: %s", path, strerror(e));
    int rc = open_buf(out, map, len, map, header_only);
    if (rc) return prefix_msg(rc, path);
    (*out)->from_file = true;
    (*out)->st = st;
    (*out)->seen = seen;
    return KVT_OK;
}

int kvt_gguf_open(kvt_gguf **out, const char *path) { return open_file(out, path, false); }
int kvt_gguf_open_header(kvt_gguf **out, const char *path) { return open_file(out, path, true); }

uint32_t kvt_gguf_version(const kvt_gguf *g) { return g ? g->version : 0; }
uint32_t kvt_gguf_alignment(const kvt_gguf *g) { return g ? g->alignment : 0; }

bool kvt_gguf_file_stat(const kvt_gguf *g, struct stat *st, struct timespec *seen)
{
    if (!g || !g->from_file) return false;
    *st = g->st;
    *seen = g->seen;
    return true;
}

const void *kvt_gguf_header_bytes(const kvt_gguf *g, size_t *len)
{
    *len = g ? (g->data_off < g->len ? g->data_off : g->len) : 0;
    return g ? g->base : NULL;
}
size_t kvt_gguf_n_kv(const kvt_gguf *g) { return g ? g->n_kv : 0; }
size_t kvt_gguf_n_tensors(const kvt_gguf *g) { return g ? g->n_tensors : 0; }

const char *kvt_gguf_key(const kvt_gguf *g, size_t i)
{
    return g && i < g->n_kv ? g->keys[i] : NULL;
}

const kvt_gguf_val *kvt_gguf_val_at(const kvt_gguf *g, size_t i)
{
    return g && i < g->n_kv ? &g->vals[i] : NULL;
}

const kvt_gguf_val *kvt_gguf_get(const kvt_gguf *g, const char *key)
{
    size_t i = g ? index_find(&g->key_index, g->keys, key) : SIZE_MAX;
    return i == SIZE_MAX ? NULL : &g->vals[i];
}

const kvt_gguf_tensor *kvt_gguf_tensor_at(const kvt_gguf *g, size_t i)
{
    return g && i < g->n_tensors ? &g->tensors[i] : NULL;
}

const kvt_gguf_tensor *kvt_gguf_find_tensor(const kvt_gguf *g, const char *name)
{
    size_t i = g ? index_find(&g->tensor_index, g->tensor_names, name) : SIZE_MAX;
    return i == SIZE_MAX ? NULL : &g->tensors[i];
}

/* ---- typed getters ------------------------------------------------------- */

static const kvt_gguf_val *lookup(const kvt_gguf *g, const char *key)
{
    const kvt_gguf_val *v = kvt_gguf_get(g, key);
    if (!v) kvt_fail(KVT_ENOENT, "gguf: no key '%s'", key ? key : "(null)");
    return v;
}

static int wrong_type(const char *key, const kvt_gguf_val *v, const char *want)
{
    char got[64];
    if (v->type == KVT_GGUF_ARR)
        snprintf(got, sizeof got, "an array of %s", value_type_name(v->elem_type));
    else if (is_signed_int(v->type))
        snprintf(got, sizeof got, "%s %lld", value_type_name(v->type), (long long)v->v.i);
    else if (is_int(v->type))
        snprintf(got, sizeof got, "%s %llu", value_type_name(v->type), (unsigned long long)v->v.u);
    else
        snprintf(got, sizeof got, "%s", value_type_name(v->type));
    return kvt_fail(KVT_EFORMAT, "gguf: key '%s' is %s, expected %s", key, got, want);
}

int kvt_gguf_get_u32(const kvt_gguf *g, const char *key, uint32_t *out)
{
    const kvt_gguf_val *v = lookup(g, key);
    if (!v) return KVT_ENOENT;
    if (!is_int(v->type) || (is_signed_int(v->type) ? v->v.i < 0 || v->v.i > UINT32_MAX
                                                    : v->v.u > UINT32_MAX))
        return wrong_type(key, v, "u32");
    *out = (uint32_t)v->v.u;
    return KVT_OK;
}

int kvt_gguf_get_i64(const kvt_gguf *g, const char *key, int64_t *out)
{
    const kvt_gguf_val *v = lookup(g, key);
    if (!v) return KVT_ENOENT;
    if (!is_int(v->type) || (!is_signed_int(v->type) && v->v.u > INT64_MAX))
        return wrong_type(key, v, "i64");
    *out = v->v.i;
    return KVT_OK;
}

int kvt_gguf_get_f32(const kvt_gguf *g, const char *key, float *out)
{
    const kvt_gguf_val *v = lookup(g, key);
    if (!v) return KVT_ENOENT;
    if (v->type != KVT_GGUF_F32 && v->type != KVT_GGUF_F64) return wrong_type(key, v, "f32/f64");
    *out = (float)v->v.f;
    return KVT_OK;
}

int kvt_gguf_get_bool(const kvt_gguf *g, const char *key, bool *out)
{
    const kvt_gguf_val *v = lookup(g, key);
    if (!v) return KVT_ENOENT;
    if (v->type != KVT_GGUF_BOOL) return wrong_type(key, v, "bool");
    *out = v->v.u != 0;
    return KVT_OK;
}

int kvt_gguf_get_str(const kvt_gguf *g, const char *key, const char **s, size_t *len)
{
    const kvt_gguf_val *v = lookup(g, key);
    if (!v) return KVT_ENOENT;
    if (v->type != KVT_GGUF_STR) return wrong_type(key, v, "str");
    *s = v->v.str;
    if (len) *len = (size_t)v->n;
    return KVT_OK;
}

int kvt_gguf_get_arr(const kvt_gguf *g, const char *key, uint32_t elem_type,
                     const kvt_gguf_val **items, size_t *n)
{
    const kvt_gguf_val *v = lookup(g, key);
    if (!v) return KVT_ENOENT;
    if (v->type != KVT_GGUF_ARR || v->elem_type != elem_type) {
        char want[32];
        snprintf(want, sizeof want, "an array of %s", value_type_name(elem_type));
        return wrong_type(key, v, want);
    }
    *items = v->v.arr;
    *n = (size_t)v->n;
    return KVT_OK;
}

/* ---- writer -------------------------------------------------------------- */

typedef struct wtensor {
    char *name;
    uint32_t type, n_dims;
    uint64_t ne[4];
    uint8_t *data;          /* (n_bytes) owned copy */
    size_t n_bytes;
} wtensor;

typedef struct wkv {
    char *key;
    kvt_gguf_val val;       /* deep copy: strings and arrays owned */
} wkv;

struct kvt_gguf_writer {
    size_t n_kv, cap_kv;
    wkv *kvs;               /* (n_kv) in insertion order */
    size_t n_tensors, cap_tensors;
    wtensor *tensors;       /* (n_tensors) in insertion order, which is file order */
};

/* Room for one more element in a doubling array. */
static bool grow(void **arr, size_t *cap, size_t n, size_t elem)
{
    if (n < *cap) return true;
    size_t new_cap = *cap ? 2 * *cap : 16;
    void *p = realloc(*arr, new_cap * elem);
    if (!p) {
        kvt_fail(KVT_ENOMEM, "gguf writer: out of memory for %zu entries", new_cap);
        return false;
    }
    *arr = p;
    *cap = new_cap;
    return true;
}

/* Writer values own their strings and arrays (the const in kvt_gguf_val is
 * for readers; these were allocated by copy_value). */
static void free_owned(kvt_gguf_val *v)
{
    if (v->type == KVT_GGUF_STR) {
        free((char *)v->v.str);
    } else if (v->type == KVT_GGUF_ARR && v->v.arr) {
        kvt_gguf_val *items = (kvt_gguf_val *)v->v.arr;
        if (v->elem_type == KVT_GGUF_STR || v->elem_type == KVT_GGUF_ARR)
            for (uint64_t i = 0; i < v->n; i++) free_owned(&items[i]);
        free(items);
    }
}

void kvt_gguf_writer_free(kvt_gguf_writer *w)
{
    if (!w) return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kvs[i].key);
        free_owned(&w->kvs[i].val);
    }
    for (size_t i = 0; i < w->n_tensors; i++) {
        free(w->tensors[i].name);
        free(w->tensors[i].data);
    }
    free(w->kvs);
    free(w->tensors);
    free(w);
}

kvt_gguf_writer *kvt_gguf_writer_new(void)
{
    return kvt_calloc(1, sizeof(kvt_gguf_writer));
}

/* Refuse what the reader would refuse, so every written file reads back. */
static int check_value(const char *key, const kvt_gguf_val *v, int depth)
{
    const char *why = NULL;
    switch (v->type) {
    case KVT_GGUF_U8: if (v->v.u > UINT8_MAX) why = "u8 out of range"; break;
    case KVT_GGUF_U16: if (v->v.u > UINT16_MAX) why = "u16 out of range"; break;
    case KVT_GGUF_U32: if (v->v.u > UINT32_MAX) why = "u32 out of range"; break;
    case KVT_GGUF_I8: if (v->v.i < INT8_MIN || v->v.i > INT8_MAX) why = "i8 out of range"; break;
    case KVT_GGUF_I16: if (v->v.i < INT16_MIN || v->v.i > INT16_MAX) why = "i16 out of range"; break;
    case KVT_GGUF_I32: if (v->v.i < INT32_MIN || v->v.i > INT32_MAX) why = "i32 out of range"; break;
    case KVT_GGUF_BOOL: if (v->v.u > 1) why = "bool is neither 0 nor 1"; break;
    case KVT_GGUF_U64: case KVT_GGUF_I64: case KVT_GGUF_F32: case KVT_GGUF_F64: break;
    case KVT_GGUF_STR: if (v->n && !v->v.str) why = "string with NULL bytes"; break;
    case KVT_GGUF_ARR:
        if (depth >= MAX_DEPTH) why = "arrays nested too deep";
        else if (v->elem_type > KVT_GGUF_F64) why = "unknown array element type";
        else if (v->n && !v->v.arr) why = "array with NULL items";
        for (uint64_t i = 0; !why && i < v->n; i++) {
            if (v->v.arr[i].type != v->elem_type) why = "array element of another type";
            else {
                int rc = check_value(key, &v->v.arr[i], depth + 1);
                if (rc) return rc;
            }
        }
        break;
    default: why = "unknown value type";
    }
    return why ? kvt_fail(KVT_EINVAL, "gguf writer: key '%s': %s", key, why) : KVT_OK;
}

static int copy_value(kvt_gguf_val *dst, const kvt_gguf_val *src)
{
    *dst = *src;
    if (src->type == KVT_GGUF_STR) {
        char *s = kvt_malloc((size_t)src->n);
        dst->v.str = s; /* never src's pointer: the caller frees dst on failure */
        if (!s) return KVT_ENOMEM;
        if (src->n) memcpy(s, src->v.str, (size_t)src->n);
    } else if (src->type == KVT_GGUF_ARR) {
        dst->n = 0;
        dst->v.arr = NULL;
        if (!src->n) return KVT_OK;
        kvt_gguf_val *items = kvt_calloc((size_t)src->n, sizeof *items);
        if (!items) return KVT_ENOMEM;
        dst->v.arr = items;
        for (uint64_t i = 0; i < src->n; i++) {
            dst->n = i + 1; /* so free_owned releases exactly what was copied */
            int rc = copy_value(&items[i], &src->v.arr[i]);
            if (rc) return rc;
        }
    }
    return KVT_OK;
}

int kvt_gguf_writer_set(kvt_gguf_writer *w, const char *key, const kvt_gguf_val *v)
{
    if (!w || !key || !v) return kvt_fail(KVT_EINVAL, "gguf writer: set: NULL argument");
    int rc = check_value(key, v, 0);
    if (rc) return rc;
    if (!strcmp(key, "general.alignment") &&
        (v->type != KVT_GGUF_U32 || v->v.u == 0 || (v->v.u & (v->v.u - 1))))
        return kvt_fail(KVT_EINVAL, "gguf writer: general.alignment must be a non-zero power "
                        "of two of type u32");
    kvt_gguf_val copy;
    if ((rc = copy_value(&copy, v))) {
        free_owned(&copy);
        return rc;
    }
    for (size_t i = 0; i < w->n_kv; i++) {
        if (!strcmp(w->kvs[i].key, key)) { /* replace in place: the key keeps its position */
            free_owned(&w->kvs[i].val);
            w->kvs[i].val = copy;
            return KVT_OK;
        }
    }
    char *k = NULL;
    if (!grow((void **)&w->kvs, &w->cap_kv, w->n_kv, sizeof *w->kvs) ||
        !(k = kvt_strndup(key, strlen(key)))) {
        free_owned(&copy);
        return KVT_ENOMEM;
    }
    w->kvs[w->n_kv++] = (wkv){k, copy};
    return KVT_OK;
}

int kvt_gguf_writer_set_u32(kvt_gguf_writer *w, const char *key, uint32_t v)
{
    return kvt_gguf_writer_set(w, key, &(kvt_gguf_val){.type = KVT_GGUF_U32, .v.u = v});
}

int kvt_gguf_writer_set_f32(kvt_gguf_writer *w, const char *key, float v)
{
    return kvt_gguf_writer_set(w, key, &(kvt_gguf_val){.type = KVT_GGUF_F32, .v.f = v});
}

int kvt_gguf_writer_set_bool(kvt_gguf_writer *w, const char *key, bool v)
{
    return kvt_gguf_writer_set(w, key, &(kvt_gguf_val){.type = KVT_GGUF_BOOL, .v.u = v});
}

int kvt_gguf_writer_set_str(kvt_gguf_writer *w, const char *key, const char *s)
{
    if (!s) return kvt_fail(KVT_EINVAL, "gguf writer: key '%s': NULL string", key ? key : "?");
    return kvt_gguf_writer_set(w, key, &(kvt_gguf_val){.type = KVT_GGUF_STR, .n = strlen(s),
                                                       .v.str = s});
}

int kvt_gguf_writer_add_tensor(kvt_gguf_writer *w, const char *name, uint32_t type,
                               uint32_t n_dims, const uint64_t *ne, const void *data,
                               size_t n_bytes)
{
    if (!w || !name || !ne)
        return kvt_fail(KVT_EINVAL, "gguf writer: add_tensor: NULL argument");
    for (size_t i = 0; i < w->n_tensors; i++)
        if (!strcmp(w->tensors[i].name, name))
            return kvt_fail(KVT_EINVAL, "gguf writer: duplicate tensor '%s'", name);
    uint64_t n_elem = 1;
    size_t blk;
    if (!storage_block(type, &blk, NULL))
        return kvt_fail(KVT_EUNSUPPORTED, "gguf writer: tensor '%s': type %s (%u) not supported",
                        name, kvt_ggml_type_name(type), type);
    if (n_dims < 1 || n_dims > 4)
        return kvt_fail(KVT_EINVAL, "gguf writer: tensor '%s': n_dims %u not in 1..4", name, n_dims);
    wtensor t = {.type = type, .n_dims = n_dims, .ne = {1, 1, 1, 1}, .n_bytes = n_bytes};
    for (uint32_t d = 0; d < n_dims; d++) {
        t.ne[d] = ne[d];
        if (!ne[d] || __builtin_mul_overflow(n_elem, ne[d], &n_elem) || n_elem > INT64_MAX)
            return kvt_fail(KVT_EINVAL, "gguf writer: tensor '%s': dimension %u (%llu) is 0 or "
                            "overflows", name, d, (unsigned long long)ne[d]);
    }
    if (ne[0] % blk || kvt_ggml_type_size(type, n_elem) != n_bytes)
        return kvt_fail(KVT_EINVAL, "gguf writer: tensor '%s': %zu bytes do not hold %llu %s "
                        "values in rows of %llu", name, n_bytes, (unsigned long long)n_elem,
                        kvt_ggml_type_name(type), (unsigned long long)ne[0]);
    if (!grow((void **)&w->tensors, &w->cap_tensors, w->n_tensors, sizeof *w->tensors))
        return KVT_ENOMEM;
    t.name = kvt_strndup(name, strlen(name));
    t.data = t.name && data ? kvt_malloc(n_bytes ? n_bytes : 1) : NULL;
    if (!t.name || (data && !t.data)) {
        free(t.name);
        free(t.data);
        return KVT_ENOMEM;
    }
    if (data) memcpy(t.data, data, n_bytes);
    w->tensors[w->n_tensors++] = t;
    return KVT_OK;
}

/* One serialiser for memory and files, so the two cannot drift apart: with
 * f set the bytes go to the file, otherwise into buf (sized by layout()). */
typedef struct sink {
    uint8_t *buf;
    FILE *f;
    size_t pos;
    bool failed;
} sink;

static void put(sink *s, const void *p, size_t n)
{
    if (!n) return;
    if (s->f) {
        if (!s->failed && fwrite(p, 1, n, s->f) != n) s->failed = true;
    } else {
        memcpy(s->buf + s->pos, p, n);
    }
    s->pos += n;
}

static void put_u32(sink *s, uint32_t v) { put(s, &v, 4); }
static void put_u64(sink *s, uint64_t v) { put(s, &v, 8); }

static void put_zeros(sink *s, size_t n)
{
    static const uint8_t zeros[256];
    for (size_t k; n; n -= k) put(s, zeros, k = n < sizeof zeros ? n : sizeof zeros);
}

static void put_str(sink *s, const char *p, uint64_t n)
{
    put_u64(s, n);
    put(s, p, (size_t)n);
}

static size_t payload_size(const kvt_gguf_val *v)
{
    if (v->type == KVT_GGUF_STR) return 8 + (size_t)v->n;
    if (v->type != KVT_GGUF_ARR) return scalar_size(v->type);
    size_t sz = 12, el = scalar_size(v->elem_type);
    if (el) return sz + el * (size_t)v->n;
    for (uint64_t i = 0; i < v->n; i++) sz += payload_size(&v->v.arr[i]);
    return sz;
}

static void put_payload(sink *s, const kvt_gguf_val *v)
{
    uint8_t b8;
    uint16_t b16;
    float f;
    switch (v->type) {
    case KVT_GGUF_U8: case KVT_GGUF_I8: case KVT_GGUF_BOOL: b8 = (uint8_t)v->v.u; put(s, &b8, 1); break;
    case KVT_GGUF_U16: case KVT_GGUF_I16: b16 = (uint16_t)v->v.u; put(s, &b16, 2); break;
    case KVT_GGUF_U32: case KVT_GGUF_I32: put_u32(s, (uint32_t)v->v.u); break;
    case KVT_GGUF_U64: case KVT_GGUF_I64: put_u64(s, v->v.u); break;
    case KVT_GGUF_F32: f = (float)v->v.f; put(s, &f, 4); break;
    case KVT_GGUF_F64: put(s, &v->v.f, 8); break;
    case KVT_GGUF_STR: put_str(s, v->v.str, v->n); break;
    case KVT_GGUF_ARR:
        put_u32(s, v->elem_type);
        put_u64(s, v->n);
        for (uint64_t i = 0; i < v->n; i++) put_payload(s, &v->v.arr[i]);
        break;
    }
}

static uint32_t writer_alignment(const kvt_gguf_writer *w)
{
    for (size_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->kvs[i].key, "general.alignment")) return (uint32_t)w->kvs[i].val.v.u;
    return DEFAULT_ALIGNMENT;
}

static size_t align_up(size_t x, uint32_t a) { return (x + a - 1) & ~((size_t)a - 1); }

/* Header size, padded to the alignment (the data section's offset), and the
 * total: every tensor padded to the alignment, the last one too, like ggml. */
/* A tensor added without data makes the file its header alone. */
static bool header_only(const kvt_gguf_writer *w)
{
    for (size_t i = 0; i < w->n_tensors; i++)
        if (!w->tensors[i].data) return true;
    return false;
}

static void layout(const kvt_gguf_writer *w, size_t *data_off, size_t *total)
{
    uint32_t a = writer_alignment(w);
    size_t n = 4 + 4 + 8 + 8;
    for (size_t i = 0; i < w->n_kv; i++)
        n += 8 + strlen(w->kvs[i].key) + 4 + payload_size(&w->kvs[i].val);
    for (size_t i = 0; i < w->n_tensors; i++)
        n += 8 + strlen(w->tensors[i].name) + 4 + 8 * w->tensors[i].n_dims + 4 + 8;
    *data_off = align_up(n, a);
    *total = *data_off;
    if (header_only(w)) return;
    for (size_t i = 0; i < w->n_tensors; i++) *total += align_up(w->tensors[i].n_bytes, a);
}

static void emit(const kvt_gguf_writer *w, sink *s)
{
    uint32_t a = writer_alignment(w);
    size_t data_off, total;
    layout(w, &data_off, &total);
    put(s, "GGUF", 4);
    put_u32(s, 3);
    put_u64(s, w->n_tensors);
    put_u64(s, w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        put_str(s, w->kvs[i].key, strlen(w->kvs[i].key));
        put_u32(s, w->kvs[i].val.type);
        put_payload(s, &w->kvs[i].val);
    }
    size_t off = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        const wtensor *t = &w->tensors[i];
        put_str(s, t->name, strlen(t->name));
        put_u32(s, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) put_u64(s, t->ne[d]);
        put_u32(s, t->type);
        put_u64(s, off);
        off += align_up(t->n_bytes, a);
    }
    put_zeros(s, data_off - s->pos);
    for (size_t i = 0; i < w->n_tensors && !header_only(w); i++) {
        put(s, w->tensors[i].data, w->tensors[i].n_bytes);
        put_zeros(s, align_up(w->tensors[i].n_bytes, a) - w->tensors[i].n_bytes);
    }
}

int kvt_gguf_writer_to_mem(kvt_gguf_writer *w, uint8_t **out, size_t *len)
{
    if (!w || !out || !len) return kvt_fail(KVT_EINVAL, "gguf writer: to_mem: NULL argument");
    size_t data_off, total;
    layout(w, &data_off, &total);
    sink s = {.buf = kvt_malloc(total)};
    if (!s.buf) return KVT_ENOMEM;
    emit(w, &s);
    *out = s.buf;
    *len = s.pos;
    return KVT_OK;
}

/* Make the rename durable: fsync the directory holding path. Filesystems
 * that cannot fsync a directory (EINVAL) have nothing to flush. */
static int fsync_dir(const char *path)
{
    const char *slash = strrchr(path, '/');
    char *dir = slash ? kvt_strndup(path, slash == path ? 1 : (size_t)(slash - path))
                      : kvt_strndup(".", 1);
    if (!dir) return KVT_ENOMEM;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC), rc = KVT_OK;
    if (fd < 0 || (fsync(fd) && errno != EINVAL))
        rc = kvt_fail(KVT_EIO, "gguf writer: cannot fsync directory '%s': %s", dir,
                      strerror(errno));
    if (fd >= 0) close(fd);
    free(dir);
    return rc;
}

int kvt_gguf_writer_write(kvt_gguf_writer *w, const char *path)
{
    if (!w || !path) return kvt_fail(KVT_EINVAL, "gguf writer: write: NULL argument");
    size_t tlen = strlen(path) + 32;
    char *tmp = kvt_malloc(tlen);
    if (!tmp) return KVT_ENOMEM;
    snprintf(tmp, tlen, "%s.tmp.%ld", path, (long)getpid());
    const char *step = "create";
    FILE *f = NULL;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) goto fail;
    if (!(f = fdopen(fd, "wb"))) {
        int e = errno;
        close(fd);
        errno = e;
        goto fail;
    }
    step = "write";
    sink s = {.f = f};
    emit(w, &s);
    if (s.failed || fflush(f)) goto fail;
    step = "fsync";
    if (fsync(fileno(f))) goto fail;
    step = "close";
    int closed = fclose(f);
    f = NULL;
    if (closed) goto fail;
    step = "rename";
    if (rename(tmp, path)) goto fail;
    free(tmp);
    return fsync_dir(path);

fail:;
    int e = errno;
    if (f) fclose(f);
    unlink(tmp);
    int rc = kvt_fail(KVT_EIO, "gguf writer: cannot %s '%s': %s", step, tmp, strerror(e));
    free(tmp);
    return rc;
}
