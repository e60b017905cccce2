/* GGUF reader and writer: round trips through every value type and tensor
 * type, the real model and vocab files, dequantisation against hand-computed
 * values, and corrupt input (truncated at every length, bit-flipped at every
 * byte, hand-crafted hostile headers) placed against a guard page so that an
 * over-read crashes instead of passing quietly. */
#include "test.h"
#include "format/gguf.h"
#include "base/util.h"

#include <dirent.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- helpers ------------------------------------------------------------- */

/* A buffer whose last byte sits just before a PROT_NONE page. */
typedef struct guard {
    uint8_t *base;
    size_t cap, total;
} guard;

static bool guard_new(guard *g, size_t cap)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    g->cap = (cap + page - 1) / page * page;
    g->total = g->cap + page;
    g->base = mmap(NULL, g->total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (g->base == MAP_FAILED) return false;
    return mprotect(g->base + g->cap, page, PROT_NONE) == 0;
}

/* Copy n bytes so that they end at the guard page; returns where they start. */
static uint8_t *guard_put(guard *g, const void *p, size_t n)
{
    uint8_t *dst = g->base + g->cap - n;
    if (n) memcpy(dst, p, n);
    return dst;
}

static void guard_free(guard *g)
{
    if (g->base && g->base != MAP_FAILED) munmap(g->base, g->total);
}

/* Growing byte buffer for hand-crafted files. */
typedef struct bytes {
    uint8_t *p;
    size_t n, cap;
} bytes;

static void b_put(bytes *b, const void *d, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, d, n);
    b->n += n;
}
static void b_u32(bytes *b, uint32_t v) { b_put(b, &v, 4); }
static void b_u64(bytes *b, uint64_t v) { b_put(b, &v, 8); }
static void b_str(bytes *b, const char *s) { b_u64(b, strlen(s)); b_put(b, s, strlen(s)); }
static void b_hdr(bytes *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    b_put(b, "GGUF", 4);
    b_u32(b, version);
    b_u64(b, n_tensors);
    b_u64(b, n_kv);
}
static void b_pad(bytes *b, size_t a) { while (b->n % a) b_put(b, "", 1); }
static void b_tensor(bytes *b, const char *name, uint32_t n_dims, const uint64_t *ne,
                     uint32_t type, uint64_t off)
{
    b_str(b, name);
    b_u32(b, n_dims);
    for (uint32_t d = 0; d < n_dims; d++) b_u64(b, ne[d]);
    b_u32(b, type);
    b_u64(b, off);
}

static bool val_eq(const kvt_gguf_val *a, const kvt_gguf_val *b)
{
    if (a->type != b->type) return false;
    if (a->type == KVT_GGUF_STR)
        return a->n == b->n && (!a->n || !memcmp(a->v.str, b->v.str, (size_t)a->n));
    if (a->type != KVT_GGUF_ARR) return !memcmp(&a->v, &b->v, sizeof a->v);
    if (a->elem_type != b->elem_type || a->n != b->n) return false;
    for (uint64_t i = 0; i < a->n; i++)
        if (!val_eq(&a->v.arr[i], &b->v.arr[i])) return false;
    return true;
}

/* Touch everything a successfully opened (possibly corrupt) file exposes. */
static uint64_t walk_val(const kvt_gguf_val *v)
{
    uint64_t h = v->type;
    if (v->type == KVT_GGUF_STR)
        for (uint64_t i = 0; i < v->n; i++) h += (uint8_t)v->v.str[i];
    else if (v->type == KVT_GGUF_ARR)
        for (uint64_t i = 0; i < v->n; i++) h += walk_val(&v->v.arr[i]);
    else h += v->v.u;
    return h;
}

static uint64_t walk(const kvt_gguf *g)
{
    uint64_t h = 0;
    for (size_t i = 0; i < kvt_gguf_n_kv(g); i++)
        h += strlen(kvt_gguf_key(g, i)) + walk_val(kvt_gguf_val_at(g, i));
    for (size_t i = 0; i < kvt_gguf_n_tensors(g); i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        float *f = malloc((size_t)t->n_elem * sizeof *f);
        if (f && kvt_gguf_tensor_to_f32(t, f, (size_t)t->n_elem) == KVT_OK)
            for (uint64_t k = 0; k < t->n_elem; k++) h += f[k] != 0;
        free(f);
    }
    return h;
}

#define SV(s) ((kvt_gguf_val){.type = KVT_GGUF_STR, .n = sizeof(s) - 1, .v.str = (s)})
#define ARR(et, items) ((kvt_gguf_val){.type = KVT_GGUF_ARR, .elem_type = (et), \
    .n = sizeof(items) / sizeof((items)[0]), .v.arr = (items)})

static float tval(size_t i) { return (float)i * 0.375f - 7.25f; }

/* Every scalar type at its extremes, strings with NULs, arrays of every type,
 * nested arrays, and one tensor of each type with odd shapes. */
static kvt_gguf_writer *build_sample(uint32_t alignment)
{
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    if (!w) return NULL;
    int rc = 0;
    /* set first with another value: a later set must replace it in place */
    rc |= kvt_gguf_writer_set(w, "t.u8", &(kvt_gguf_val){.type = KVT_GGUF_U8, .v.u = 1});
    rc |= kvt_gguf_writer_set(w, "t.i8", &(kvt_gguf_val){.type = KVT_GGUF_I8, .v.i = INT8_MIN});
    rc |= kvt_gguf_writer_set(w, "t.u16", &(kvt_gguf_val){.type = KVT_GGUF_U16, .v.u = UINT16_MAX});
    rc |= kvt_gguf_writer_set(w, "t.i16", &(kvt_gguf_val){.type = KVT_GGUF_I16, .v.i = INT16_MIN});
    rc |= kvt_gguf_writer_set_u32(w, "t.u32", UINT32_MAX);
    rc |= kvt_gguf_writer_set(w, "t.i32", &(kvt_gguf_val){.type = KVT_GGUF_I32, .v.i = INT32_MIN});
    rc |= kvt_gguf_writer_set_f32(w, "t.f32", -1.5f);
    rc |= kvt_gguf_writer_set_bool(w, "t.true", true);
    rc |= kvt_gguf_writer_set_bool(w, "t.false", false);
    rc |= kvt_gguf_writer_set(w, "t.u64", &(kvt_gguf_val){.type = KVT_GGUF_U64, .v.u = UINT64_MAX});
    rc |= kvt_gguf_writer_set(w, "t.i64", &(kvt_gguf_val){.type = KVT_GGUF_I64, .v.i = INT64_MIN});
    rc |= kvt_gguf_writer_set(w, "t.f64", &(kvt_gguf_val){.type = KVT_GGUF_F64, .v.f = 0.1});
    rc |= kvt_gguf_writer_set_str(w, "t.str", "hello, gguf");
    rc |= kvt_gguf_writer_set_str(w, "t.str.empty", "");
    rc |= kvt_gguf_writer_set(w, "t.str.nul", &SV("a\0b\0"));
    rc |= kvt_gguf_writer_set(w, "t.u8", &(kvt_gguf_val){.type = KVT_GGUF_U8, .v.u = 255});
    if (alignment) rc |= kvt_gguf_writer_set_u32(w, "general.alignment", alignment);

    kvt_gguf_val a_u8[] = {{.type = KVT_GGUF_U8, .v.u = 0}, {.type = KVT_GGUF_U8, .v.u = 255}};
    kvt_gguf_val a_i8[] = {{.type = KVT_GGUF_I8, .v.i = -1}, {.type = KVT_GGUF_I8, .v.i = 127}};
    kvt_gguf_val a_u16[] = {{.type = KVT_GGUF_U16, .v.u = 7}, {.type = KVT_GGUF_U16, .v.u = 65535}};
    kvt_gguf_val a_i16[] = {{.type = KVT_GGUF_I16, .v.i = -300}, {.type = KVT_GGUF_I16, .v.i = 3}};
    kvt_gguf_val a_u32[] = {{.type = KVT_GGUF_U32, .v.u = 1}, {.type = KVT_GGUF_U32, .v.u = 1u << 31}};
    kvt_gguf_val a_i32[] = {{.type = KVT_GGUF_I32, .v.i = -5}, {.type = KVT_GGUF_I32, .v.i = INT32_MAX}};
    kvt_gguf_val a_f32[] = {{.type = KVT_GGUF_F32, .v.f = 0.25}, {.type = KVT_GGUF_F32, .v.f = -0.0},
                            {.type = KVT_GGUF_F32, .v.f = INFINITY}};
    kvt_gguf_val a_bool[] = {{.type = KVT_GGUF_BOOL, .v.u = 1}, {.type = KVT_GGUF_BOOL, .v.u = 0}};
    kvt_gguf_val a_str[] = {SV(""), SV("x"), SV("a\0b"), SV("\xe2\x96\x81the")};
    kvt_gguf_val a_u64[] = {{.type = KVT_GGUF_U64, .v.u = UINT64_MAX}, {.type = KVT_GGUF_U64}};
    kvt_gguf_val a_i64[] = {{.type = KVT_GGUF_I64, .v.i = INT64_MIN}, {.type = KVT_GGUF_I64, .v.i = 9}};
    kvt_gguf_val a_f64[] = {{.type = KVT_GGUF_F64, .v.f = 1e300}, {.type = KVT_GGUF_F64, .v.f = -2.5}};
    rc |= kvt_gguf_writer_set(w, "a.u8", &ARR(KVT_GGUF_U8, a_u8));
    rc |= kvt_gguf_writer_set(w, "a.i8", &ARR(KVT_GGUF_I8, a_i8));
    rc |= kvt_gguf_writer_set(w, "a.u16", &ARR(KVT_GGUF_U16, a_u16));
    rc |= kvt_gguf_writer_set(w, "a.i16", &ARR(KVT_GGUF_I16, a_i16));
    rc |= kvt_gguf_writer_set(w, "a.u32", &ARR(KVT_GGUF_U32, a_u32));
    rc |= kvt_gguf_writer_set(w, "a.i32", &ARR(KVT_GGUF_I32, a_i32));
    rc |= kvt_gguf_writer_set(w, "a.f32", &ARR(KVT_GGUF_F32, a_f32));
    rc |= kvt_gguf_writer_set(w, "a.bool", &ARR(KVT_GGUF_BOOL, a_bool));
    rc |= kvt_gguf_writer_set(w, "a.str", &ARR(KVT_GGUF_STR, a_str));
    rc |= kvt_gguf_writer_set(w, "a.u64", &ARR(KVT_GGUF_U64, a_u64));
    rc |= kvt_gguf_writer_set(w, "a.i64", &ARR(KVT_GGUF_I64, a_i64));
    rc |= kvt_gguf_writer_set(w, "a.f64", &ARR(KVT_GGUF_F64, a_f64));
    rc |= kvt_gguf_writer_set(w, "a.empty", &(kvt_gguf_val){.type = KVT_GGUF_ARR,
                                                            .elem_type = KVT_GGUF_I32});
    /* array of arrays of strings (one empty), and one of mixed inner types */
    kvt_gguf_val s1[] = {SV("a"), SV("bc")}, s3[] = {SV("\0")};
    kvt_gguf_val nested[] = {ARR(KVT_GGUF_STR, s1),
                             {.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_STR},
                             ARR(KVT_GGUF_STR, s3)};
    rc |= kvt_gguf_writer_set(w, "a.nested", &ARR(KVT_GGUF_ARR, nested));
    kvt_gguf_val mixed[] = {ARR(KVT_GGUF_F32, a_f32), ARR(KVT_GGUF_ARR, nested)};
    rc |= kvt_gguf_writer_set(w, "a.mixed", &ARR(KVT_GGUF_ARR, mixed));

    /* tensors: f32 3x5, f16 7, bf16 5x3x2, q8_0 64x3, f32 4-d with unit dims */
    float f[128];
    uint16_t h[64];
    uint8_t q[6 * 34];
    for (size_t i = 0; i < 128; i++) f[i] = tval(i);
    rc |= kvt_gguf_writer_add_tensor(w, "f32.a", KVT_GGML_F32, 2, (uint64_t[]){3, 5}, f, 15 * 4);
    for (size_t i = 0; i < 7; i++) h[i] = kvt_f32_to_f16(tval(i));
    rc |= kvt_gguf_writer_add_tensor(w, "f16.b", KVT_GGML_F16, 1, (uint64_t[]){7}, h, 14);
    for (size_t i = 0; i < 30; i++) h[i] = kvt_f32_to_bf16(tval(i));
    rc |= kvt_gguf_writer_add_tensor(w, "bf16.c", KVT_GGML_BF16, 3, (uint64_t[]){5, 3, 2}, h, 60);
    for (size_t i = 0; i < sizeof q; i++) q[i] = (uint8_t)(i * 37 + 11);
    rc |= kvt_gguf_writer_add_tensor(w, "q8.d", KVT_GGML_Q8_0, 2, (uint64_t[]){64, 3}, q, sizeof q);
    rc |= kvt_gguf_writer_add_tensor(w, "f32.e", KVT_GGML_F32, 4, (uint64_t[]){1, 2, 1, 3}, f + 50, 24);
    if (rc) {
        kvt_gguf_writer_free(w);
        return NULL;
    }
    return w;
}

/* Re-create a writer from what was read, to check the bytes come out the same. */
static kvt_gguf_writer *rewrite(const kvt_gguf *g)
{
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    for (size_t i = 0; w && i < kvt_gguf_n_kv(g); i++)
        if (kvt_gguf_writer_set(w, kvt_gguf_key(g, i), kvt_gguf_val_at(g, i))) goto fail;
    for (size_t i = 0; w && i < kvt_gguf_n_tensors(g); i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        if (kvt_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data,
                                       (size_t)t->n_bytes)) goto fail;
    }
    return w;
fail:
    kvt_gguf_writer_free(w);
    return NULL;
}

/* ---- round trip ---------------------------------------------------------- */

static void roundtrip(uint32_t alignment)
{
    kvt_gguf_writer *w = build_sample(alignment);
    CHECKF(w, "build_sample: %s", kvt_errmsg());
    uint8_t *buf, *buf2;
    size_t len, len2;
    CHECK_OK(kvt_gguf_writer_to_mem(w, &buf, &len));
    kvt_gguf *g;
    CHECK_OK(kvt_gguf_open_mem(&g, buf, len));
    uint32_t a = alignment ? alignment : 32;
    CHECK(kvt_gguf_version(g) == 3);
    CHECK(kvt_gguf_alignment(g) == a);
    CHECK(len % a == 0);

    /* same keys in the same order: t.u8 stays first though set twice */
    CHECK(kvt_gguf_n_kv(g) == (alignment ? 31u : 30u));
    CHECK(!strcmp(kvt_gguf_key(g, 0), "t.u8"));
    CHECK(kvt_gguf_val_at(g, 0)->v.u == 255);
    CHECK(!strcmp(kvt_gguf_key(g, 14), "t.str.nul"));
    CHECK(kvt_gguf_key(g, kvt_gguf_n_kv(g)) == NULL);
    kvt_gguf *ref; /* a second reader of the same bytes to compare against */
    CHECK_OK(kvt_gguf_open_mem(&ref, buf, len));
    kvt_gguf_writer *w2 = rewrite(g);
    CHECKF(w2, "rewrite: %s", kvt_errmsg());
    CHECK_OK(kvt_gguf_writer_to_mem(w2, &buf2, &len2));
    CHECK(len2 == len && !memcmp(buf, buf2, len));

    const kvt_gguf_val *v;
    CHECK((v = kvt_gguf_get(g, "t.str.nul")) && v->type == KVT_GGUF_STR && v->n == 4 &&
          !memcmp(v->v.str, "a\0b\0", 4));
    CHECK((v = kvt_gguf_get(g, "t.str.empty")) && v->type == KVT_GGUF_STR && v->n == 0);
    CHECK((v = kvt_gguf_get(g, "t.i64")) && v->v.i == INT64_MIN);
    CHECK((v = kvt_gguf_get(g, "t.f64")) && v->v.f == 0.1);
    CHECK((v = kvt_gguf_get(g, "a.f32")) && v->n == 3 && isinf(v->v.arr[2].v.f) &&
          signbit(v->v.arr[1].v.f));
    CHECK((v = kvt_gguf_get(g, "a.nested")) && v->elem_type == KVT_GGUF_ARR && v->n == 3 &&
          v->v.arr[0].n == 2 && v->v.arr[1].n == 0 && v->v.arr[2].v.arr[0].n == 1 &&
          v->v.arr[0].v.arr[1].n == 2 && !memcmp(v->v.arr[0].v.arr[1].v.str, "bc", 2));
    CHECK((v = kvt_gguf_get(g, "a.mixed")) && v->v.arr[0].elem_type == KVT_GGUF_F32 &&
          v->v.arr[1].elem_type == KVT_GGUF_ARR);
    for (size_t i = 0; i < kvt_gguf_n_kv(g); i++)
        CHECK(val_eq(kvt_gguf_val_at(g, i), kvt_gguf_get(ref, kvt_gguf_key(g, i))));

    /* typed getters: conversions, ranges, absent keys */
    uint32_t u32 = 7;
    int64_t i64;
    float f32;
    bool b;
    const char *s;
    size_t n;
    const kvt_gguf_val *items;
    CHECK_OK(kvt_gguf_get_u32(g, "t.u8", &u32));
    CHECK(u32 == 255);
    CHECK_OK(kvt_gguf_get_u32(g, "t.u32", &u32));
    CHECK(u32 == UINT32_MAX);
    CHECK(kvt_gguf_get_u32(g, "t.i32", &u32) == KVT_EFORMAT && u32 == UINT32_MAX);
    CHECK(kvt_gguf_get_u32(g, "t.u64", &u32) == KVT_EFORMAT);
    CHECK(kvt_gguf_get_u32(g, "t.str", &u32) == KVT_EFORMAT);
    CHECK(kvt_gguf_get_u32(g, "no.such.key", &u32) == KVT_ENOENT && u32 == UINT32_MAX);
    CHECK(strstr(kvt_errmsg(), "no.such.key"));
    CHECK_OK(kvt_gguf_get_i64(g, "t.i32", &i64));
    CHECK(i64 == INT32_MIN);
    CHECK_OK(kvt_gguf_get_i64(g, "t.u32", &i64));
    CHECK(i64 == UINT32_MAX);
    CHECK(kvt_gguf_get_i64(g, "t.u64", &i64) == KVT_EFORMAT);
    CHECK_OK(kvt_gguf_get_f32(g, "t.f32", &f32));
    CHECK(f32 == -1.5f);
    CHECK_OK(kvt_gguf_get_f32(g, "t.f64", &f32));
    CHECK(f32 == 0.1f);
    CHECK(kvt_gguf_get_f32(g, "t.i32", &f32) == KVT_EFORMAT);
    CHECK_OK(kvt_gguf_get_bool(g, "t.true", &b));
    CHECK(b);
    CHECK_OK(kvt_gguf_get_bool(g, "t.false", &b));
    CHECK(!b);
    CHECK(kvt_gguf_get_bool(g, "t.u8", &b) == KVT_EFORMAT);
    CHECK_OK(kvt_gguf_get_str(g, "t.str", &s, &n));
    CHECK(n == 11 && !memcmp(s, "hello, gguf", 11));
    CHECK_OK(kvt_gguf_get_arr(g, "a.str", KVT_GGUF_STR, &items, &n));
    CHECK(n == 4 && items[3].n == 6);
    CHECK(kvt_gguf_get_arr(g, "a.str", KVT_GGUF_I32, &items, &n) == KVT_EFORMAT);
    CHECK(kvt_gguf_get_arr(g, "t.str", KVT_GGUF_STR, &items, &n) == KVT_EFORMAT);
    CHECK_OK(kvt_gguf_get_arr(g, "a.empty", KVT_GGUF_I32, &items, &n));
    CHECK(n == 0);

    /* tensors: order, shapes, bytes, alignment */
    CHECK(kvt_gguf_n_tensors(g) == 5);
    static const char *names[] = {"f32.a", "f16.b", "bf16.c", "q8.d", "f32.e"};
    static const uint32_t types[] = {KVT_GGML_F32, KVT_GGML_F16, KVT_GGML_BF16, KVT_GGML_Q8_0,
                                     KVT_GGML_F32};
    static const uint64_t n_elem[] = {15, 7, 30, 192, 6}, n_bytes[] = {60, 14, 60, 204, 24};
    for (size_t i = 0; i < 5; i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        CHECK(!strcmp(t->name, names[i]) && t->type == types[i]);
        CHECK(t->n_elem == n_elem[i] && t->n_bytes == n_bytes[i]);
        CHECK(t->offset % a == 0);
        CHECK(((const uint8_t *)t->data - buf) % a == 0);
        CHECK(kvt_gguf_find_tensor(g, names[i]) == t);
        const kvt_gguf_tensor *r = kvt_gguf_find_tensor(ref, names[i]);
        CHECK(r && !memcmp(r->data, t->data, (size_t)t->n_bytes));
    }
    CHECK(kvt_gguf_find_tensor(g, "nope") == NULL);
    const kvt_gguf_tensor *t = kvt_gguf_find_tensor(g, "bf16.c");
    CHECK(t->n_dims == 3 && t->ne[0] == 5 && t->ne[1] == 3 && t->ne[2] == 2 && t->ne[3] == 1);
    t = kvt_gguf_find_tensor(g, "f32.e");
    CHECK(t->n_dims == 4 && t->ne[1] == 2 && t->ne[3] == 3);
    float out[30];
    CHECK_OK(kvt_gguf_tensor_to_f32(t, out, 6));
    for (size_t i = 0; i < 6; i++) CHECK(out[i] == tval(50 + i));
    t = kvt_gguf_find_tensor(g, "f16.b"); /* tval(i) is exact in f16 */
    CHECK_OK(kvt_gguf_tensor_to_f32(t, out, 7));
    for (size_t i = 0; i < 7; i++) CHECK(out[i] == tval(i));
    t = kvt_gguf_find_tensor(g, "bf16.c");
    CHECK_OK(kvt_gguf_tensor_to_f32(t, out, 30));
    for (size_t i = 0; i < 30; i++) CHECK(out[i] == kvt_bf16_to_f32(kvt_f32_to_bf16(tval(i))));
    CHECK(kvt_gguf_tensor_to_f32(t, out, 29) == KVT_EINVAL);

    kvt_gguf_close(g);
    kvt_gguf_close(ref);
    kvt_gguf_writer_free(w);
    kvt_gguf_writer_free(w2);
    free(buf);
    free(buf2);
}

TEST(gguf_roundtrip) { roundtrip(0); }
TEST(gguf_roundtrip_align64) { roundtrip(64); }

TEST(gguf_writer_rejects)
{
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    CHECK(w);
    float f[64] = {0};
    CHECK(kvt_gguf_writer_set(w, "x", &(kvt_gguf_val){.type = KVT_GGUF_U8, .v.u = 256}) == KVT_EINVAL);
    CHECK(kvt_gguf_writer_set(w, "x", &(kvt_gguf_val){.type = KVT_GGUF_I16, .v.i = 40000}) == KVT_EINVAL);
    CHECK(kvt_gguf_writer_set(w, "x", &(kvt_gguf_val){.type = KVT_GGUF_BOOL, .v.u = 2}) == KVT_EINVAL);
    CHECK(kvt_gguf_writer_set(w, "x", &(kvt_gguf_val){.type = 13}) == KVT_EINVAL);
    kvt_gguf_val mix[] = {{.type = KVT_GGUF_U8}, {.type = KVT_GGUF_I8}};
    CHECK(kvt_gguf_writer_set(w, "x", &ARR(KVT_GGUF_U8, mix)) == KVT_EINVAL);
    CHECK(kvt_gguf_writer_set_u32(w, "general.alignment", 0) == KVT_EINVAL);
    CHECK(kvt_gguf_writer_set_u32(w, "general.alignment", 48) == KVT_EINVAL);
    CHECK(kvt_gguf_writer_set_str(w, "general.alignment", "32") == KVT_EINVAL);
    CHECK(kvt_gguf_writer_add_tensor(w, "t", KVT_GGML_F32, 1, (uint64_t[]){4}, f, 12) == KVT_EINVAL);
    CHECK(kvt_gguf_writer_add_tensor(w, "t", KVT_GGML_F32, 0, (uint64_t[]){4}, f, 16) == KVT_EINVAL);
    CHECK(kvt_gguf_writer_add_tensor(w, "t", KVT_GGML_F32, 5, (uint64_t[]){1, 1, 1, 1, 4}, f, 16) ==
          KVT_EINVAL);
    CHECK(kvt_gguf_writer_add_tensor(w, "t", KVT_GGML_F32, 2, (uint64_t[]){4, 0}, f, 0) == KVT_EINVAL);
    CHECK(kvt_gguf_writer_add_tensor(w, "t", KVT_GGML_Q8_0, 1, (uint64_t[]){16}, f, 17) == KVT_EINVAL);
    CHECK(kvt_gguf_writer_add_tensor(w, "t", 40, 1, (uint64_t[]){256}, f, 84) == KVT_EUNSUPPORTED); /* nvfp4 */
    CHECK_OK(kvt_gguf_writer_add_tensor(w, "t", KVT_GGML_F32, 1, (uint64_t[]){4}, f, 16));
    CHECK(kvt_gguf_writer_add_tensor(w, "t", KVT_GGML_F32, 1, (uint64_t[]){4}, f, 16) == KVT_EINVAL);
    kvt_gguf_writer_free(w);
    kvt_gguf_writer_free(NULL);
    kvt_gguf_close(NULL);
}

/* ---- dequantisation ------------------------------------------------------ */

static bool same_f32(float a, float b) { return !memcmp(&a, &b, 4) || (isnan(a) && isnan(b)); }

TEST(gguf_dequant)
{
    /* f16: zeros, normals, the largest finite, subnormals, infinities, NaN */
    static const uint16_t h[] = {0x0000, 0x8000, 0x3c00, 0xc000, 0x3555, 0x7bff, 0x0400,
                                 0x0001, 0x8001, 0x03ff, 0x0200, 0x7c00, 0xfc00, 0x7e00};
    const float hf[] = {0.0f, -0.0f, 1.0f, -2.0f, 0x1.554p-2f, 65504.0f, 0x1p-14f,
                        0x1p-24f, -0x1p-24f, 0x3ffp-24f, 0x1p-15f, INFINITY, -INFINITY, NAN};
    /* bf16: the top half of an f32, subnormals included */
    static const uint16_t bf[] = {0x3f80, 0xc040, 0x7f80, 0xff80, 0x0001, 0x8000, 0x4049, 0x7fc0};
    const float bff[] = {1.0f, -3.0f, INFINITY, -INFINITY, 0x1p-133f, -0.0f, 3.140625f, NAN};
    /* q8_0: two blocks, d = 0.5 and d = the smallest f16 subnormal */
    uint8_t q[68] = {0x00, 0x38};
    for (int j = 0; j < 32; j++) q[2 + j] = (uint8_t)(int8_t)(j * 8 - 128);
    q[34] = 0x01;
    q[35] = 0x00;
    for (int j = 0; j < 32; j++) q[36 + j] = (uint8_t)(int8_t)(127 - j);

    kvt_gguf_writer *w = kvt_gguf_writer_new();
    CHECK(w);
    CHECK_OK(kvt_gguf_writer_add_tensor(w, "h", KVT_GGML_F16, 1, (uint64_t[]){14}, h, sizeof h));
    CHECK_OK(kvt_gguf_writer_add_tensor(w, "bf", KVT_GGML_BF16, 2, (uint64_t[]){4, 2}, bf, sizeof bf));
    CHECK_OK(kvt_gguf_writer_add_tensor(w, "q", KVT_GGML_Q8_0, 2, (uint64_t[]){32, 2}, q, sizeof q));
    uint8_t *buf;
    size_t len;
    CHECK_OK(kvt_gguf_writer_to_mem(w, &buf, &len));
    kvt_gguf_writer_free(w);
    kvt_gguf *g;
    CHECK_OK(kvt_gguf_open_mem(&g, buf, len));
    float out[64];
    CHECK_OK(kvt_gguf_tensor_to_f32(kvt_gguf_find_tensor(g, "h"), out, 14));
    for (int i = 0; i < 14; i++) CHECKF(same_f32(out[i], hf[i]), "f16 %04x: %a != %a", h[i], out[i], hf[i]);
    CHECK_OK(kvt_gguf_tensor_to_f32(kvt_gguf_find_tensor(g, "bf"), out, 8));
    for (int i = 0; i < 8; i++) CHECKF(same_f32(out[i], bff[i]), "bf16 %04x: %a != %a", bf[i], out[i], bff[i]);
    CHECK_OK(kvt_gguf_tensor_to_f32(kvt_gguf_find_tensor(g, "q"), out, 64));
    for (int j = 0; j < 32; j++) {
        CHECKF(out[j] == 0.5f * (float)(j * 8 - 128), "q8_0 block 0 [%d] = %g", j, out[j]);
        CHECKF(out[32 + j] == ldexpf((float)(127 - j), -24), "q8_0 block 1 [%d] = %a", j, out[32 + j]);
    }
    CHECK(out[0] == -64.0f && out[31] == 60.0f && out[32] == 0x1.fcp-18f);
    CHECK(kvt_gguf_tensor_to_f32(kvt_gguf_find_tensor(g, "q"), out, 63) == KVT_EINVAL);
    kvt_gguf_tensor fake = *kvt_gguf_find_tensor(g, "q");
    fake.type = 40; /* nvfp4 */
    CHECK(kvt_gguf_tensor_to_f32(&fake, out, 64) == KVT_EUNSUPPORTED);
    CHECK(strstr(kvt_errmsg(), "nvfp4"));
    kvt_gguf_close(g);
    free(buf);

    CHECK(kvt_ggml_type_size(KVT_GGML_F32, 3) == 12);
    CHECK(kvt_ggml_type_size(KVT_GGML_F16, 3) == 6);
    CHECK(kvt_ggml_type_size(KVT_GGML_BF16, 5) == 10);
    CHECK(kvt_ggml_type_size(KVT_GGML_Q8_0, 64) == 68);
    CHECK(kvt_ggml_type_size(KVT_GGML_Q8_0, 33) == 0);
    CHECK(kvt_ggml_type_size(KVT_GGML_Q4_K, 256) == 144);
    CHECK(kvt_ggml_type_size(KVT_GGML_Q4_K, 128) == 0);
    CHECK(kvt_ggml_type_size(40, 256) == 0); /* nvfp4: not supported */
    CHECK(kvt_ggml_type_size(KVT_GGML_F32, 1ull << 62) == 0);
    CHECK(!strcmp(kvt_ggml_type_name(KVT_GGML_Q8_0), "q8_0"));
    CHECK(!strcmp(kvt_ggml_type_name(KVT_GGML_BF16), "bf16"));
    CHECK(!strcmp(kvt_ggml_type_name(12), "q4_K"));
    CHECK(!strcmp(kvt_ggml_type_name(1000), "unknown"));
}

/* ---- real files ---------------------------------------------------------- */

TEST(gguf_stories260k)
{
    const char *path = kvt_test_shared("models/stories260K.gguf");
    if (!path) SKIP("shared/models/stories260K.gguf not found");
    kvt_gguf *g;
    CHECK_OK(kvt_gguf_open(&g, path));
    CHECK(kvt_gguf_version(g) == 3);
    CHECK(kvt_gguf_alignment(g) == 32);
    const char *s;
    size_t n;
    uint32_t u;
    CHECK_OK(kvt_gguf_get_str(g, "general.architecture", &s, &n));
    CHECK(n == 5 && !memcmp(s, "llama", 5));
    CHECK_OK(kvt_gguf_get_u32(g, "llama.embedding_length", &u));
    CHECK(u == 64);
    CHECK_OK(kvt_gguf_get_u32(g, "llama.block_count", &u));
    CHECK(u == 5);
    const kvt_gguf_val *tok;
    CHECK_OK(kvt_gguf_get_arr(g, "tokenizer.ggml.tokens", KVT_GGUF_STR, &tok, &n));
    CHECK(n == 512);
    CHECK(tok[1].n == 3 && !memcmp(tok[1].v.str, "<s>", 3));
    CHECK(kvt_gguf_n_tensors(g) == 48);
    const kvt_gguf_tensor *t = kvt_gguf_find_tensor(g, "token_embd.weight");
    CHECK(t && t->type == KVT_GGML_F32 && t->n_dims == 2 && t->ne[0] == 64 && t->ne[1] == 512);
    CHECK(t->n_bytes == 64 * 512 * 4 && (uintptr_t)t->data % 32 == 0);
    float *f = malloc(64 * 512 * sizeof *f);
    CHECK(f);
    CHECK_OK(kvt_gguf_tensor_to_f32(t, f, 64 * 512));
    CHECK(!memcmp(f, t->data, t->n_bytes));
    free(f);
    /* the loader will want these; they are in this file */
    CHECK(kvt_gguf_find_tensor(g, "output.weight") && kvt_gguf_find_tensor(g, "blk.4.ffn_norm.weight"));
    kvt_gguf_close(g);
}

TEST(gguf_vocab_files)
{
    static const struct { const char *path, *model; uint64_t n_tokens, n_merges; } files[] = {
        {"vocab/ggml-vocab-llama-spm.gguf", "llama", 32000, 0},
        {"vocab/ggml-vocab-deepseek-llm.gguf", "gpt2", 102400, 99757},
        {"vocab/ggml-vocab-gpt-2.gguf", "gpt2", 50257, 50000},
    };
    int found = 0;
    for (size_t k = 0; k < 3; k++) {
        const char *path = kvt_test_shared(files[k].path);
        if (!path) continue;
        found++;
        kvt_gguf *g;
        unsigned long a0 = kvt_test_allocs();
        CHECK_OK(kvt_gguf_open(&g, path));
        unsigned long allocs = kvt_test_allocs() - a0;
        size_t n_kv = kvt_gguf_n_kv(g);
        /* Opening costs a few allocations per key (its name, its array of
         * items), never one per array element: the 32,000 - 102,400 token
         * strings and merges stay in the mapping (gguf.c). Counted, not
         * timed, so the check holds on any machine and under the sanitizer;
         * a copy per string would be over 50,000 here. */
        printf("    %s: %zu keys, opened with %lu allocations\n", files[k].path, n_kv, allocs);
        CHECKF(allocs <= 2 * n_kv + 16, "%s: %lu allocations to open %zu keys: one per array element?",
               files[k].path, allocs, n_kv);
        const char *s;
        size_t n;
        CHECK_OK(kvt_gguf_get_str(g, "tokenizer.ggml.model", &s, &n));
        CHECK(n == strlen(files[k].model) && !memcmp(s, files[k].model, n));
        const kvt_gguf_val *items;
        CHECK_OK(kvt_gguf_get_arr(g, "tokenizer.ggml.tokens", KVT_GGUF_STR, &items, &n));
        CHECKF(n == files[k].n_tokens, "%s: %zu tokens", files[k].path, n);
        CHECK_OK(kvt_gguf_get_arr(g, "tokenizer.ggml.token_type", KVT_GGUF_I32, &items, &n));
        CHECK(n == files[k].n_tokens);
        if (files[k].n_merges) {
            CHECK_OK(kvt_gguf_get_arr(g, "tokenizer.ggml.merges", KVT_GGUF_STR, &items, &n));
            CHECK(n == files[k].n_merges);
        } else {
            CHECK_OK(kvt_gguf_get_arr(g, "tokenizer.ggml.scores", KVT_GGUF_F32, &items, &n));
            CHECK(n == files[k].n_tokens);
        }
        CHECK(kvt_gguf_n_tensors(g) == 0);
        kvt_gguf_close(g);
    }
    if (!found) SKIP("shared/vocab/*.gguf not found");
}

TEST(gguf_open_errors)
{
    kvt_gguf *g = (kvt_gguf *)1;
    CHECK(kvt_gguf_open(&g, "/nonexistent/dir/x.gguf") == KVT_ENOENT && g == NULL);
    CHECK(kvt_gguf_open(&g, "/") != KVT_OK);
    CHECK(kvt_gguf_open(&g, "/dev/null") != KVT_OK);
    CHECK(kvt_gguf_open_mem(&g, NULL, 0) == KVT_EFORMAT);
}

/* ---- corrupt input ------------------------------------------------------- */

/* A few keys including arrays and a nested array, and two tensors, the last
 * ending exactly at the end of the file, so every truncation loses a byte
 * that the reader needs. */
static int small_file(uint8_t **buf, size_t *len)
{
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    if (!w) return KVT_ENOMEM;
    kvt_gguf_val a[] = {SV("ab"), SV(""), SV("c")};
    kvt_gguf_val ints[] = {{.type = KVT_GGUF_I32, .v.i = -1}, {.type = KVT_GGUF_I32, .v.i = 2}};
    kvt_gguf_val nested[] = {ARR(KVT_GGUF_STR, a), ARR(KVT_GGUF_I32, ints)};
    float f[32];
    uint8_t q[34] = {0x00, 0x3c, 1, 2, 3};
    for (int i = 0; i < 32; i++) f[i] = (float)i;
    int rc = kvt_gguf_writer_set_str(w, "general.architecture", "llama");
    if (!rc) rc = kvt_gguf_writer_set_u32(w, "llama.block_count", 5);
    if (!rc) rc = kvt_gguf_writer_set_bool(w, "b", true);
    if (!rc) rc = kvt_gguf_writer_set(w, "tok", &ARR(KVT_GGUF_STR, a));
    if (!rc) rc = kvt_gguf_writer_set(w, "nest", &ARR(KVT_GGUF_ARR, nested));
    if (!rc) rc = kvt_gguf_writer_add_tensor(w, "q", KVT_GGML_Q8_0, 1, (uint64_t[]){32}, q, 34);
    if (!rc) rc = kvt_gguf_writer_add_tensor(w, "w", KVT_GGML_F32, 2, (uint64_t[]){8, 4}, f, 128);
    if (!rc) rc = kvt_gguf_writer_to_mem(w, buf, len);
    kvt_gguf_writer_free(w);
    return rc;
}

TEST(gguf_truncated)
{
    uint8_t *buf;
    size_t len;
    CHECK_OK(small_file(&buf, &len));
    guard gd;
    CHECK(guard_new(&gd, len));
    kvt_gguf *g;
    CHECK_OK(kvt_gguf_open_mem(&g, guard_put(&gd, buf, len), len));
    kvt_gguf_close(g);
    for (size_t n = 0; n < len; n++) {
        kvt_fail(KVT_OK, "%s", "");
        int rc = kvt_gguf_open_mem(&g, guard_put(&gd, buf, n), n);
        CHECKF(rc == KVT_EFORMAT && g == NULL, "truncated at %zu of %zu: %s", n, len,
               rc ? kvt_errmsg() : "opened");
        CHECKF(kvt_errmsg()[0], "truncated at %zu: empty message", n);
    }
    guard_free(&gd);
    free(buf);
}

TEST(gguf_bitflip)
{
    uint8_t *buf;
    size_t len;
    CHECK_OK(small_file(&buf, &len));
    guard gd;
    CHECK(guard_new(&gd, len));
    static const uint8_t pats[] = {0xff, 0x80, 0x01, 0x10, 0x7f};
    size_t opened = 0, tries = 0;
    uint64_t sink = 0;
    for (size_t pos = 0; pos < len; pos++) {
        for (size_t k = 0; k < sizeof pats; k++, tries++) {
            uint8_t *p = guard_put(&gd, buf, len);
            p[pos] ^= pats[k];
            kvt_gguf *g = NULL;
            int rc = kvt_gguf_open_mem(&g, p, len);
            if (rc == KVT_OK) {
                opened++;
                sink += walk(g);
                kvt_gguf_close(g);
            } else {
                CHECKF(g == NULL && kvt_errmsg()[0], "flip %02x at %zu", pats[k], pos);
                CHECKF(rc == KVT_EFORMAT || rc == KVT_EUNSUPPORTED,
                       "flip %02x at %zu: %s", pats[k], pos, kvt_strerror(rc));
            }
        }
    }
    printf("    %zu of %zu flips still open (value bytes) [%llu]\n", opened, tries,
           (unsigned long long)(sink & 1));
    guard_free(&gd);
    free(buf);
}

/* Hand-crafted hostile headers; each must be refused with a message. */
static void expect(bytes *b, int want, const char *what)
{
    guard gd;
    CHECK(guard_new(&gd, b->n ? b->n : 1));
    kvt_gguf *g = NULL;
    kvt_fail(KVT_OK, "%s", "");
    int rc = kvt_gguf_open_mem(&g, guard_put(&gd, b->p, b->n), b->n);
    guard_free(&gd);
    free(b->p);
    *b = (bytes){0};
    if (rc == KVT_OK) kvt_gguf_close(g);
    CHECKF(rc == want, "%s: got %s (%s), want %s", what, kvt_strerror(rc), kvt_errmsg(),
           kvt_strerror(want));
    CHECKF(want == KVT_OK || kvt_errmsg()[0], "%s: empty message", what);
    if (getenv("KVT_VERBOSE")) printf("    %-28s %s\n", what, kvt_errmsg());
}

TEST(gguf_hostile_headers)
{
    bytes b = {0};
    const uint64_t ne1[] = {8};

    b_put(&b, "GGUX", 4); b_u32(&b, 3); b_u64(&b, 0); b_u64(&b, 0);
    expect(&b, KVT_EFORMAT, "bad magic");
    b_put(&b, "GG", 2);
    expect(&b, KVT_EFORMAT, "short magic");
    b_hdr(&b, 0, 0, 0);
    expect(&b, KVT_EFORMAT, "version 0");
    b_hdr(&b, 1, 0, 0);
    expect(&b, KVT_EUNSUPPORTED, "version 1");
    b_hdr(&b, 4, 0, 0);
    expect(&b, KVT_EUNSUPPORTED, "version 4");
    b_hdr(&b, 0x03000000, 0, 0);
    expect(&b, KVT_EUNSUPPORTED, "big-endian");
    b_hdr(&b, 3, 0, 1ull << 62);
    expect(&b, KVT_EFORMAT, "n_kv 2^62");
    b_hdr(&b, 3, 1ull << 62, 0);
    expect(&b, KVT_EFORMAT, "n_tensors 2^62");
    b_hdr(&b, 2, 0, 1); b_u64(&b, 1ull << 63); b_put(&b, "k", 1); b_u32(&b, KVT_GGUF_U8); b_put(&b, "", 1);
    expect(&b, KVT_EFORMAT, "key length 2^63");
    b_hdr(&b, 3, 0, 1); b_str(&b, "k"); b_u32(&b, KVT_GGUF_STR); b_u64(&b, 1ull << 63); b_put(&b, "x", 1);
    expect(&b, KVT_EFORMAT, "string length 2^63");
    b_hdr(&b, 3, 0, 1); b_str(&b, "k"); b_u32(&b, KVT_GGUF_ARR); b_u32(&b, KVT_GGUF_U32);
    b_u64(&b, 1ull << 60); b_u64(&b, 0);
    expect(&b, KVT_EFORMAT, "array count 2^60");
    b_hdr(&b, 3, 0, 1); b_str(&b, "k"); b_u32(&b, KVT_GGUF_ARR); b_u32(&b, KVT_GGUF_STR);
    b_u64(&b, UINT64_MAX); b_u64(&b, 0);
    expect(&b, KVT_EFORMAT, "string array count 2^64-1");
    b_hdr(&b, 3, 0, 1); b_str(&b, "k"); b_u32(&b, KVT_GGUF_ARR); b_u32(&b, KVT_GGUF_STR);
    b_u64(&b, 2); b_str(&b, "a"); b_u64(&b, 1000);
    expect(&b, KVT_EFORMAT, "array string past end");
    b_hdr(&b, 3, 0, 1); b_str(&b, "k"); b_u32(&b, 13); b_u64(&b, 0);
    expect(&b, KVT_EFORMAT, "value type 13");
    b_hdr(&b, 3, 0, 1); b_str(&b, "k"); b_u32(&b, KVT_GGUF_ARR); b_u32(&b, 99); b_u64(&b, 0);
    expect(&b, KVT_EFORMAT, "array element type 99");
    b_hdr(&b, 3, 0, 1); b_str(&b, "k"); b_u32(&b, KVT_GGUF_BOOL); b_put(&b, "\2", 1);
    expect(&b, KVT_EFORMAT, "bool 2");
    b_hdr(&b, 3, 0, 1); b_u64(&b, 3); b_put(&b, "a\0b", 3); b_u32(&b, KVT_GGUF_U8); b_put(&b, "", 1);
    expect(&b, KVT_EFORMAT, "NUL in key");
    b_hdr(&b, 3, 0, 2);
    b_str(&b, "k"); b_u32(&b, KVT_GGUF_U8); b_put(&b, "", 1);
    b_str(&b, "k"); b_u32(&b, KVT_GGUF_U8); b_put(&b, "", 1);
    expect(&b, KVT_EFORMAT, "duplicate key");
    b_hdr(&b, 3, 0, 1); b_str(&b, "k");
    for (int d = 0; d < 100; d++) { b_u32(&b, KVT_GGUF_ARR); if (d) b_u64(&b, 1); }
    b_u32(&b, KVT_GGUF_U8); b_u64(&b, 0);
    for (int d = 0; d < 64; d++) b_u64(&b, 0);
    expect(&b, KVT_EFORMAT, "nesting depth 100");
    static const uint32_t aligns[] = {0, 3, 48};
    for (int k = 0; k < 3; k++) {
        b_hdr(&b, 3, 0, 1); b_str(&b, "general.alignment"); b_u32(&b, KVT_GGUF_U32); b_u32(&b, aligns[k]);
        expect(&b, KVT_EFORMAT, "alignment not a power of 2");
    }
    b_hdr(&b, 3, 0, 1); b_str(&b, "general.alignment"); b_u32(&b, KVT_GGUF_U64); b_u64(&b, 32);
    expect(&b, KVT_EFORMAT, "alignment of type u64");

    /* tensor infos */
    b_hdr(&b, 3, 1, 0); b_tensor(&b, "t", 0, ne1, KVT_GGML_F32, 0); b_pad(&b, 32); b_put(&b, ne1, 8);
    b_u64(&b, 0); b_u64(&b, 0); b_u64(&b, 0);
    expect(&b, KVT_EFORMAT, "n_dims 0");
    b_hdr(&b, 3, 1, 0); b_tensor(&b, "t", 5, (uint64_t[]){8, 1, 1, 1, 1}, KVT_GGML_F32, 0);
    b_pad(&b, 32); for (int i = 0; i < 8; i++) b_u32(&b, 0);
    expect(&b, KVT_EFORMAT, "n_dims 5");
    b_hdr(&b, 3, 1, 0); b_tensor(&b, "t", 2, (uint64_t[]){1ull << 32, 1ull << 32}, KVT_GGML_F32, 0);
    b_pad(&b, 32); b_u64(&b, 0);
    expect(&b, KVT_EFORMAT, "ne product overflow");
    b_hdr(&b, 3, 1, 0); b_tensor(&b, "t", 2, (uint64_t[]){1ull << 31, 1ull << 31}, KVT_GGML_F32, 0);
    b_pad(&b, 32); b_u64(&b, 0);
    expect(&b, KVT_EFORMAT, "byte size overflow / past EOF");
    b_hdr(&b, 3, 1, 0); b_tensor(&b, "t", 2, (uint64_t[]){8, 0}, KVT_GGML_F32, 0);
    b_pad(&b, 32); for (int i = 0; i < 8; i++) b_u32(&b, 0);
    expect(&b, KVT_EFORMAT, "ne 0");
    b_hdr(&b, 3, 1, 0); b_tensor(&b, "t", 1, ne1, KVT_GGML_F32, 4);
    b_pad(&b, 32); for (int i = 0; i < 16; i++) b_u32(&b, 0);
    expect(&b, KVT_EFORMAT, "offset not aligned");
    b_hdr(&b, 3, 1, 0); b_tensor(&b, "t", 1, ne1, KVT_GGML_F32, 0);
    b_pad(&b, 32); for (int i = 0; i < 7; i++) b_u32(&b, 0);
    expect(&b, KVT_EFORMAT, "data past EOF by 4");
    b_hdr(&b, 3, 1, 0); b_tensor(&b, "t", 1, ne1, KVT_GGML_F32, 1ull << 63);
    b_pad(&b, 32); for (int i = 0; i < 8; i++) b_u32(&b, 0);
    expect(&b, KVT_EFORMAT, "offset 2^63");
    b_hdr(&b, 3, 1, 0); b_tensor(&b, "t", 1, ne1, KVT_GGML_F32, 0);
    expect(&b, KVT_EFORMAT, "no data section");
    b_hdr(&b, 3, 1, 0); b_tensor(&b, "t", 1, (uint64_t[]){16}, KVT_GGML_Q8_0, 0);
    b_pad(&b, 32); for (int i = 0; i < 16; i++) b_u32(&b, 0);
    expect(&b, KVT_EFORMAT, "q8_0 row not whole blocks");
    b_hdr(&b, 3, 1, 0); b_tensor(&b, "t", 1, (uint64_t[]){256}, 40, 0);
    b_pad(&b, 32); for (int i = 0; i < 64; i++) b_u32(&b, 0);
    expect(&b, KVT_EUNSUPPORTED, "tensor type nvfp4");
    b_hdr(&b, 3, 2, 0); b_tensor(&b, "t", 1, ne1, KVT_GGML_F32, 0);
    b_tensor(&b, "t", 1, ne1, KVT_GGML_F32, 32);
    b_pad(&b, 32); for (int i = 0; i < 16; i++) b_u32(&b, 0);
    expect(&b, KVT_EFORMAT, "duplicate tensor name");
    b_hdr(&b, 3, 2, 0); b_tensor(&b, "t", 1, (uint64_t[]){16}, KVT_GGML_F32, 0);
    b_tensor(&b, "u", 1, ne1, KVT_GGML_F32, 32);
    b_pad(&b, 32); for (int i = 0; i < 24; i++) b_u32(&b, 0);
    expect(&b, KVT_EFORMAT, "overlapping tensors");
    b_hdr(&b, 3, 1, 0); b_u64(&b, 3); b_put(&b, "t\0u", 3); b_u32(&b, 1); b_u64(&b, 8);
    b_u32(&b, 0); b_u64(&b, 0); b_pad(&b, 32); for (int i = 0; i < 8; i++) b_u32(&b, 0);
    expect(&b, KVT_EFORMAT, "NUL in tensor name");

    /* and the positive control: the same shape of file, well formed, opens */
    b_hdr(&b, 2, 2, 1); b_str(&b, "general.alignment"); b_u32(&b, KVT_GGUF_U32); b_u32(&b, 16);
    b_tensor(&b, "t", 1, ne1, KVT_GGML_F32, 0); b_tensor(&b, "u", 1, ne1, KVT_GGML_F32, 32);
    b_pad(&b, 16); for (int i = 0; i < 16; i++) b_u32(&b, 0);
    expect(&b, KVT_OK, "valid v2, alignment 16");
}

/* A K-quant tensor through the size checks: q4_K rows must be whole
 * 256-element blocks of 144 bytes (512 elements in rows of 128 are two
 * blocks' worth and still refused), and a file cut anywhere inside the
 * tensor's bytes does not open. */
TEST(gguf_kquant_sizes)
{
    enum { BLK = 256, BYTES = 144 };
    uint8_t q[2 * BYTES];
    for (size_t i = 0; i < sizeof q; i++) q[i] = (uint8_t)(i * 37 + 11);
    for (int b = 0; b < 2; b++) {
        uint8_t *blk = q + b * BYTES;
        blk[0] = 0x00, blk[1] = 0x3c;         /* d = 1 */
        blk[2] = 0x00, blk[3] = 0x38;         /* dmin = 0.5 */
        memset(blk + 4, 1, 12);               /* sub-blocks 0..3: scale 1, min 1; 4..7: scale 1, min 0 */
    }
    CHECK(kvt_ggml_type_size(KVT_GGML_Q4_K, 2 * BLK) == sizeof q);

    kvt_gguf_writer *w = kvt_gguf_writer_new();
    CHECK(w);
    CHECK(kvt_gguf_writer_add_tensor(w, "k", KVT_GGML_Q4_K, 2, (uint64_t[]){128, 4}, q, sizeof q) ==
          KVT_EINVAL);
    CHECK(kvt_gguf_writer_add_tensor(w, "k", KVT_GGML_Q4_K, 2, (uint64_t[]){BLK, 2}, q, sizeof q - 1) ==
          KVT_EINVAL);
    CHECK_OK(kvt_gguf_writer_add_tensor(w, "k", KVT_GGML_Q4_K, 2, (uint64_t[]){BLK, 2}, q, sizeof q));
    uint8_t *buf;
    size_t len;
    CHECK_OK(kvt_gguf_writer_to_mem(w, &buf, &len));
    kvt_gguf_writer_free(w);

    guard gd;
    CHECK(guard_new(&gd, len));
    kvt_gguf *g;
    CHECK_OK(kvt_gguf_open_mem(&g, guard_put(&gd, buf, len), len));
    const kvt_gguf_tensor *t = kvt_gguf_find_tensor(g, "k");
    CHECK(t && t->type == KVT_GGML_Q4_K && t->n_elem == 2 * BLK && t->n_bytes == sizeof q);
    size_t data_at = (size_t)((const uint8_t *)t->data - (gd.base + gd.cap - len));
    CHECK(data_at + sizeof q == len); /* the tensor ends the file: every cut below is inside it */
    float out[2 * BLK];
    CHECK_OK(kvt_gguf_tensor_to_f32(t, out, 2 * BLK));
    /* element 0: sub-block 0, low nibble of qs[0] (q[16] = 16*37+11 = 603 & 255 = 91, nibble 11),
     * 1 * 11 - 0.5 * 1; element 255: sub-block 7, high nibble of qs[127] (q[143] = 0xb6), 1 * 11 - 0 */
    CHECKF(out[0] == 10.5f && out[255] == 11.0f, "q4_K values %g %g", out[0], out[255]);
    kvt_gguf_close(g);

    for (size_t n = data_at; n < len; n++) {
        kvt_fail(KVT_OK, "%s", "");
        g = NULL;
        int rc = kvt_gguf_open_mem(&g, guard_put(&gd, buf, n), n);
        CHECKF(rc == KVT_EFORMAT && g == NULL && strstr(kvt_errmsg(), "past the end"),
               "cut at %zu of %zu (tensor data from %zu): %s", n, len, data_at,
               rc ? kvt_errmsg() : "opened");
    }
    guard_free(&gd);
    free(buf);

    /* the same tensor, hand-written with rows of 128: refused at the header */
    bytes b = {0};
    b_hdr(&b, 3, 1, 0); b_tensor(&b, "k", 2, (uint64_t[]){128, 4}, KVT_GGML_Q4_K, 0);
    b_pad(&b, 32); b_put(&b, q, sizeof q);
    CHECK(guard_new(&gd, b.n));
    kvt_fail(KVT_OK, "%s", "");
    int rc = kvt_gguf_open_mem(&g, guard_put(&gd, b.p, b.n), b.n);
    guard_free(&gd);
    free(b.p);
    CHECKF(rc == KVT_EFORMAT &&
           strstr(kvt_errmsg(), "row length 128 is not a multiple of the q4_K block of 256"),
           "q4_K rows of 128: %s (%s)", kvt_strerror(rc), kvt_errmsg());
}

/* ---- atomic file write --------------------------------------------------- */

TEST(gguf_write_file)
{
    char dir[] = "/tmp/kvt-gguf-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir));
    char path[256], bad[300];
    snprintf(path, sizeof path, "%s/model.gguf", dir);
    snprintf(bad, sizeof bad, "%s/missing/model.gguf", dir);
    kvt_gguf_writer *w = build_sample(0);
    CHECK(w);
    CHECK_OK(kvt_gguf_writer_write(w, path));
    CHECK_OK(kvt_gguf_writer_write(w, path)); /* replacing an existing file */
    uint8_t *mem;
    size_t mem_len, file_len;
    CHECK_OK(kvt_gguf_writer_to_mem(w, &mem, &mem_len));
    char *file = kvt_test_read_file(path, &file_len);
    CHECK(file && file_len == mem_len && !memcmp(file, mem, mem_len));
    kvt_gguf *g;
    CHECK_OK(kvt_gguf_open(&g, path));
    CHECK(kvt_gguf_n_tensors(g) == 5 && kvt_gguf_get(g, "a.nested"));
    kvt_gguf_close(g);

    /* rename onto a directory fails after the temp file was written: it must go */
    char sub[300];
    snprintf(sub, sizeof sub, "%s/sub", dir);
    CHECK(mkdir(sub, 0700) == 0);
    CHECK(kvt_gguf_writer_write(w, sub) == KVT_EIO);
    CHECK(strstr(kvt_errmsg(), "rename"));
    CHECK(rmdir(sub) == 0);

    DIR *d = opendir(dir);
    CHECK(d);
    int entries = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        entries++;
        CHECKF(!strcmp(e->d_name, "model.gguf"), "left behind: %s", e->d_name);
    }
    closedir(d);
    CHECK(entries == 1);

    kvt_fail(KVT_OK, "%s", "");
    CHECK(kvt_gguf_writer_write(w, bad) == KVT_EIO);
    CHECK(strstr(kvt_errmsg(), "No such file"));
    CHECK(kvt_gguf_writer_write(w, "/proc/kvt-no-write.gguf") == KVT_EIO);

    unlink(path);
    CHECK(rmdir(dir) == 0);
    free(file);
    free(mem);
    kvt_gguf_writer_free(w);
}

/* Random multi-byte damage on top of the exhaustive single flips: a few bytes
 * overwritten (often with 0x00/0xff, the values that make counts extreme),
 * sometimes truncated as well. $KVT_GGUF_FUZZ sets the iteration count. */
TEST(gguf_fuzz)
{
    uint64_t rng = kvt_test_seed("gguf_fuzz");
    const char *env = getenv("KVT_GGUF_FUZZ");
    long iters = env ? atol(env) : 3000;
    uint8_t *buf;
    size_t len;
    CHECK_OK(small_file(&buf, &len));
    guard gd;
    CHECK(guard_new(&gd, len));
    long opened = 0;
    for (long it = 0; it < iters; it++) {
        size_t n = kvt_test_rand(&rng) % 4 ? len : kvt_test_rand(&rng) % len;
        uint8_t *p = guard_put(&gd, buf, n);
        int hits = 1 + (int)(kvt_test_rand(&rng) % 8);
        for (int h = 0; h < hits && n; h++) {
            uint64_t r = kvt_test_rand(&rng);
            p[r % n] = (r >> 32) % 3 == 0 ? 0 : (r >> 32) % 3 == 1 ? 0xff : (uint8_t)(r >> 40);
        }
        kvt_gguf *g = NULL;
        int rc = kvt_gguf_open_mem(&g, p, n);
        if (rc == KVT_OK) {
            opened++;
            (void)walk(g);
            kvt_gguf_close(g);
        } else {
            CHECKF(g == NULL && kvt_errmsg()[0] && (rc == KVT_EFORMAT || rc == KVT_EUNSUPPORTED),
                   "iteration %ld: %s", it, kvt_strerror(rc));
        }
    }
    printf("    %ld of %ld damaged files still open\n", opened, iters);
    guard_free(&gd);
    free(buf);
}
