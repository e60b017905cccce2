/* Seeds the engine writes, for the fuzz corpora: `seedgen DIR` fills
 * DIR/<target>/ (Makefile, `make fuzz-seeds`; tests/fuzz/README.md).
 *
 *   gguf       vocabulary files (the byte tokenizer, a tiny BPE and a tiny
 *              SentencePiece vocabulary, stories260K's), a file with every
 *              value type and tensor type, a tiny llama model with F32,
 *              F16, BF16 and Q8_0 weights, and ds4-tiny as kvt_model_save
 *              writes it
 *   snapshot   RAM snapshots of ds4-tiny (weight seed 7) at lengths around
 *              block boundaries, whole and without their state, and of
 *              stories260K when ../shared has it
 *   block      the block records of a ds4-tiny snapshot
 *   tokenizer  texts: the stories260K golden prompts, llama.cpp's vocabulary
 *              test inputs, the start of each ../shared/seeds text, bytes
 *              around the specials
 *   toolcall   model outputs with calls in each layout
 * The golden snapshot files (tests/golden/) are copied into snapshot/ by the
 * Makefile; request bodies come from tests/test_api*.c (capture.h). */
#include "fuzz.h"
#include "format/gguf.h"
#include "arch/model.h"
#include "session/snapshot.h"
#include "text/tokenizer.h"
#include "base/util.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *root;
static int failures;

static void put(const char *target, const char *name, const void *p, size_t len)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", root, target);
    if (mkdir(path, 0777) && errno != EEXIST) { perror(path); failures++; return; }
    snprintf(path, sizeof path, "%s/%s/%s", root, target, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, len, f) != len || fclose(f)) { perror(path); failures++; }
}

static void must(int rc, const char *what)
{
    if (rc) {
        fprintf(stderr, "seedgen: %s: %s: %s\n", what, kvt_strerror(rc), kvt_errmsg());
        exit(1);
    }
}

static void put_writer(const char *name, kvt_gguf_writer *w)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    must(kvt_gguf_writer_to_mem(w, &buf, &len), name);
    put("gguf", name, buf, len);
    free(buf);
    kvt_gguf_writer_free(w);
}

/* ---- gguf ---------------------------------------------------------------- */

static void vocab_of(const kvt_tokenizer *t, const char *name)
{
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    must(kvt_gguf_writer_set_str(w, "general.name", name), name);
    must(kvt_tokenizer_to_gguf(t, w), name);
    put_writer(name, w);
}

static kvt_gguf_val sv(const char *s) { return (kvt_gguf_val){.type = KVT_GGUF_STR, .n = strlen(s), .v.str = s}; }

static void set_arr(kvt_gguf_writer *w, const char *key, uint32_t type, const kvt_gguf_val *items, size_t n)
{
    kvt_gguf_val v = {.type = KVT_GGUF_ARR, .elem_type = type, .n = n, .v.arr = items};
    must(kvt_gguf_writer_set(w, key, &v), key);
}

static void tiny_bpe(void)
{
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    static const char *const toks[] = {"a", "b", "ab", "\xc4\xa0", ("\xc4\xa0" "a"), "<|end|>", "<|user|>"};
    kvt_gguf_val items[7], types[7], merges[2] = {sv("a b"), sv("\xc4\xa0 a")};
    for (int i = 0; i < 7; i++) {
        items[i] = sv(toks[i]);
        types[i] = (kvt_gguf_val){.type = KVT_GGUF_I32, .v.i = i >= 5 ? 3 : i == 4 ? 4 : 1};
    }
    must(kvt_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2"), "bpe");
    must(kvt_gguf_writer_set_str(w, "tokenizer.ggml.pre", "default"), "bpe");
    set_arr(w, "tokenizer.ggml.tokens", KVT_GGUF_STR, items, 7);
    set_arr(w, "tokenizer.ggml.token_type", KVT_GGUF_I32, types, 7);
    set_arr(w, "tokenizer.ggml.merges", KVT_GGUF_STR, merges, 2);
    must(kvt_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 5), "bpe");
    put_writer("vocab-tiny-bpe.gguf", w);
}

/* SentencePiece: <unk>, <s>, </s>, the 256 byte tokens, a few pieces. */
static void tiny_spm(void)
{
    enum { N = 3 + 256 + 6 };
    static char bytes[256][8];
    static const char *const pieces[] = {"\xe2\x96\x81", "\xe2\x96\x81" "a", "ab", "\xe2\x96\x81" "ab", "b", "a"};
    kvt_gguf_val toks[N], scores[N], types[N];
    const char *fixed[3] = {"<unk>", "<s>", "</s>"};
    for (int i = 0; i < N; i++) {
        const char *s;
        int type;
        if (i < 3) s = fixed[i], type = i ? 3 : 2;
        else if (i < 259) snprintf(bytes[i - 3], 8, "<0x%02X>", i - 3), s = bytes[i - 3], type = 6;
        else s = pieces[i - 259], type = 1;
        toks[i] = sv(s);
        scores[i] = (kvt_gguf_val){.type = KVT_GGUF_F32, .v.f = i >= 259 ? -(double)(i - 259) : 0};
        types[i] = (kvt_gguf_val){.type = KVT_GGUF_I32, .v.i = type};
    }
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    must(kvt_gguf_writer_set_str(w, "tokenizer.ggml.model", "llama"), "spm");
    set_arr(w, "tokenizer.ggml.tokens", KVT_GGUF_STR, toks, N);
    set_arr(w, "tokenizer.ggml.scores", KVT_GGUF_F32, scores, N);
    set_arr(w, "tokenizer.ggml.token_type", KVT_GGUF_I32, types, N);
    must(kvt_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1), "spm");
    must(kvt_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2), "spm");
    must(kvt_gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", 0), "spm");
    must(kvt_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", true), "spm");
    put_writer("vocab-tiny-spm.gguf", w);
}

/* Bytes of n elements of a type, from f32 values. */
static uint8_t *quant(uint32_t type, const float *f, size_t n, size_t *len)
{
    *len = kvt_ggml_type_size(type, n);
    uint8_t *p = calloc(1, *len ? *len : 1);
    for (size_t i = 0; i < n; i++) {
        if (type == KVT_GGML_F32) memcpy(p + 4 * i, &f[i], 4);
        if (type == KVT_GGML_F16 || type == KVT_GGML_BF16) {
            uint16_t h = type == KVT_GGML_F16 ? kvt_f32_to_f16(f[i]) : kvt_f32_to_bf16(f[i]);
            memcpy(p + 2 * i, &h, 2);
        }
    }
    if (type != KVT_GGML_F32 && type != KVT_GGML_F16 && type != KVT_GGML_BF16 && type != KVT_GGML_Q8_0) {
        /* the other block types: bytes from the values (any bytes are a block) */
        for (size_t i = 0; i < *len; i++) p[i] = (uint8_t)(int)(f[i % n] * 8000.0f + (float)i);
    }
    if (type == KVT_GGML_Q8_0)
        for (size_t b = 0; b < n / 32; b++) {
            float amax = 0;
            for (int k = 0; k < 32; k++) amax = fabsf(f[32 * b + k]) > amax ? fabsf(f[32 * b + k]) : amax;
            float d = amax / 127;
            uint16_t h = kvt_f32_to_f16(d);
            memcpy(p + 34 * b, &h, 2);
            for (int k = 0; k < 32; k++) p[34 * b + 2 + k] = (uint8_t)(int8_t)(d ? f[32 * b + k] / d : 0);
        }
    return p;
}

static void tensor(kvt_gguf_writer *w, const char *name, uint32_t type, uint64_t ne0, uint64_t ne1, uint64_t *rng)
{
    size_t n = (size_t)(ne0 * ne1), len;
    float *f = malloc(n * sizeof *f);
    for (size_t i = 0; i < n; i++) f[i] = (float)((int64_t)((*rng = *rng * 6364136223846793005ull + 1) >> 40) % 2000) / 8000.0f;
    uint8_t *p = quant(type, f, n, &len);
    uint64_t ne[2] = {ne0, ne1};
    must(kvt_gguf_writer_add_tensor(w, name, type, ne1 > 1 ? 2 : 1, ne, p, len), name);
    free(p);
    free(f);
}

static void all_types(void)
{
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    kvt_gguf_val v;
    static const uint32_t scalars[] = {KVT_GGUF_U8, KVT_GGUF_I8, KVT_GGUF_U16, KVT_GGUF_I16, KVT_GGUF_U32,
                                       KVT_GGUF_I32, KVT_GGUF_F32, KVT_GGUF_BOOL, KVT_GGUF_U64, KVT_GGUF_I64,
                                       KVT_GGUF_F64};
    for (size_t i = 0; i < sizeof scalars / sizeof *scalars; i++) {
        char key[32];
        snprintf(key, sizeof key, "t.scalar%u", scalars[i]);
        v = (kvt_gguf_val){.type = scalars[i]};
        if (scalars[i] == KVT_GGUF_F32 || scalars[i] == KVT_GGUF_F64) v.v.f = -1.5;
        else if (scalars[i] == KVT_GGUF_BOOL) v.v.u = 1;
        else if (scalars[i] == KVT_GGUF_I8 || scalars[i] == KVT_GGUF_I16 || scalars[i] == KVT_GGUF_I32 ||
                 scalars[i] == KVT_GGUF_I64) v.v.i = -2;
        else v.v.u = 7;
        must(kvt_gguf_writer_set(w, key, &v), key);
    }
    must(kvt_gguf_writer_set_str(w, "general.architecture", "none"), "arch");
    must(kvt_gguf_writer_set_str(w, "t.str", "h\xc3\xa9llo"), "str");
    kvt_gguf_val ints[3] = {{.type = KVT_GGUF_U16, .v.u = 1}, {.type = KVT_GGUF_U16, .v.u = 2}, {.type = KVT_GGUF_U16, .v.u = 3}};
    set_arr(w, "t.arr.u16", KVT_GGUF_U16, ints, 3);
    kvt_gguf_val strs[2] = {sv("x"), sv("")};
    set_arr(w, "t.arr.str", KVT_GGUF_STR, strs, 2);
    kvt_gguf_val inner[2] = {{.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_U16, .n = 3, .v.arr = ints},
                             {.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_U16, .n = 1, .v.arr = ints}};
    set_arr(w, "t.arr.nested", KVT_GGUF_ARR, inner, 2);
    set_arr(w, "t.arr.empty", KVT_GGUF_I32, NULL, 0);
    uint64_t rng = 1;
    tensor(w, "t.f32", KVT_GGML_F32, 5, 3, &rng);
    tensor(w, "t.f16", KVT_GGML_F16, 7, 1, &rng);
    tensor(w, "t.bf16", KVT_GGML_BF16, 4, 2, &rng);
    tensor(w, "t.q8_0", KVT_GGML_Q8_0, 64, 2, &rng);
    static const struct { const char *name; uint32_t type; uint64_t ne0; } blocks[] = {
        {"t.q4_0", KVT_GGML_Q4_0, 64},   {"t.q4_1", KVT_GGML_Q4_1, 32},   {"t.q5_0", KVT_GGML_Q5_0, 32},
        {"t.q5_1", KVT_GGML_Q5_1, 64},   {"t.q4_K", KVT_GGML_Q4_K, 256},  {"t.q5_K", KVT_GGML_Q5_K, 256},
        {"t.q6_K", KVT_GGML_Q6_K, 256},  {"t.iq4_nl", KVT_GGML_IQ4_NL, 32}, {"t.iq4_xs", KVT_GGML_IQ4_XS, 256},
        {"t.mxfp4", KVT_GGML_MXFP4, 64},
    };
    for (size_t i = 0; i < sizeof blocks / sizeof *blocks; i++) tensor(w, blocks[i].name, blocks[i].type, blocks[i].ne0, 2, &rng);
    put_writer("all-types.gguf", w);
    /* the same with another alignment */
    w = kvt_gguf_writer_new();
    must(kvt_gguf_writer_set_u32(w, "general.alignment", 64), "alignment");
    tensor(w, "a", KVT_GGML_F32, 3, 1, &rng);
    tensor(w, "b", KVT_GGML_Q8_0, 32, 1, &rng);
    put_writer("align64.gguf", w);
}

/* A llama model of a few KB: D 32, 1 layer, 4 heads (2 KV heads), the byte
 * tokenizer, weights in every tensor type, the output tied to the
 * embedding. */
static void tiny_llama(void)
{
    kvt_tokenizer *t;
    must(kvt_tokenizer_new_bytes(&t), "bytes");
    uint32_t V = kvt_tokenizer_n_vocab(t), D = 32, F = 32, KV = 16;
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    must(kvt_gguf_writer_set_str(w, "general.architecture", "llama"), "llama");
    must(kvt_gguf_writer_set_str(w, "general.name", "tiny-llama"), "llama");
    must(kvt_gguf_writer_set_u32(w, "llama.embedding_length", D), "llama");
    must(kvt_gguf_writer_set_u32(w, "llama.block_count", 1), "llama");
    must(kvt_gguf_writer_set_u32(w, "llama.attention.head_count", 4), "llama");
    must(kvt_gguf_writer_set_u32(w, "llama.attention.head_count_kv", 2), "llama");
    must(kvt_gguf_writer_set_u32(w, "llama.feed_forward_length", F), "llama");
    must(kvt_gguf_writer_set_u32(w, "llama.context_length", 64), "llama");
    must(kvt_gguf_writer_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f), "llama");
    must(kvt_gguf_writer_set_u32(w, "llama.rope.dimension_count", 8), "llama");
    must(kvt_tokenizer_to_gguf(t, w), "llama tokenizer");
    kvt_tokenizer_free(t);
    uint64_t rng = 3;
    tensor(w, "token_embd.weight", KVT_GGML_Q8_0, D, V, &rng);
    tensor(w, "output_norm.weight", KVT_GGML_F32, D, 1, &rng);
    /* no output.weight: tied to token_embd */
    tensor(w, "blk.0.attn_norm.weight", KVT_GGML_F32, D, 1, &rng);
    tensor(w, "blk.0.attn_q.weight", KVT_GGML_BF16, D, D, &rng);
    tensor(w, "blk.0.attn_k.weight", KVT_GGML_F16, D, KV, &rng);
    tensor(w, "blk.0.attn_v.weight", KVT_GGML_Q8_0, D, KV, &rng);
    tensor(w, "blk.0.attn_output.weight", KVT_GGML_F32, D, D, &rng);
    tensor(w, "blk.0.ffn_norm.weight", KVT_GGML_F32, D, 1, &rng);
    tensor(w, "blk.0.ffn_gate.weight", KVT_GGML_F16, D, F, &rng);
    tensor(w, "blk.0.ffn_up.weight", KVT_GGML_BF16, D, F, &rng);
    tensor(w, "blk.0.ffn_down.weight", KVT_GGML_Q8_0, F, D, &rng);
    uint8_t *buf = NULL;
    size_t len = 0;
    must(kvt_gguf_writer_to_mem(w, &buf, &len), "tiny llama");
    kvt_gguf_writer_free(w);
    /* it must load, or it seeds nothing past the loader */
    char path[] = "/tmp/kvtier-seedgen-XXXXXX";
    int fd = mkstemp(path);
    kvt_model *m = NULL;
    if (fd >= 0 && write(fd, buf, len) == (ssize_t)len) must(kvt_model_open(&m, path), "tiny llama loads");
    if (fd >= 0) close(fd);
    unlink(path);
    kvt_model_close(m);
    put("gguf", "tiny-llama.gguf", buf, len);
    free(buf);
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc((size_t)n + 1);
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n) { free(p); p = NULL; }
    fclose(f);
    if (p) p[n] = 0, *len = (size_t)n;
    return p;
}

/* ds4-tiny as kvt_model_save writes it (F32 and an I32 routing table),
 * rewritten with the weights in Q8_0 (F16 where a row is not whole blocks): a quarter of
 * the size, and the loader's dequantisation paths. */
static void ds4_file(void)
{
    char dir[] = "/tmp/kvtier-seedgen-XXXXXX", path[128], path2[128];
    if (!mkdtemp(dir)) { perror("mkdtemp"); failures++; return; }
    snprintf(path, sizeof path, "%s/ds4-tiny.gguf", dir);
    snprintf(path2, sizeof path2, "%s/ds4-tiny-q8.gguf", dir);
    must(kvt_model_save(fuzz_ds4(1), path), "ds4-tiny save");
    kvt_gguf *g = NULL;
    must(kvt_gguf_open(&g, path), "ds4-tiny open");
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    for (size_t i = 0; i < kvt_gguf_n_kv(g); i++)
        must(kvt_gguf_writer_set(w, kvt_gguf_key(g, i), kvt_gguf_val_at(g, i)), "ds4-tiny key");
    for (size_t i = 0; i < kvt_gguf_n_tensors(g); i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        if (t->type == 26) { /* the I32 routing table stays as it is */
            must(kvt_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data, t->n_bytes), t->name);
            continue;
        }
        uint32_t type = t->ne[0] % 32 ? KVT_GGML_F16 : KVT_GGML_Q8_0;
        float *f = malloc(t->n_elem * sizeof *f);
        size_t len;
        must(kvt_gguf_tensor_to_f32(t, f, t->n_elem), "ds4-tiny tensor");
        uint8_t *q = quant(type, f, t->n_elem, &len);
        must(kvt_gguf_writer_add_tensor(w, t->name, type, t->n_dims, t->ne, q, len), t->name);
        free(q);
        free(f);
    }
    kvt_gguf_close(g);
    must(kvt_gguf_writer_write(w, path2), "ds4-tiny-q8 write");
    kvt_gguf_writer_free(w);
    kvt_model *m = NULL;
    must(kvt_model_open(&m, path2), "ds4-tiny-q8 loads");
    kvt_model_close(m);
    size_t len = 0;
    char *p = read_file(path2, &len);
    if (p) put("gguf", "ds4-tiny-q8.gguf", p, len);
    free(p);
    unlink(path);
    unlink(path2);
    rmdir(dir);
}

static void gguf_seeds(void)
{
    kvt_tokenizer *t;
    must(kvt_tokenizer_new_bytes(&t), "bytes");
    vocab_of(t, "vocab-bytes.gguf");
    kvt_tokenizer_free(t);
    if (fuzz_stories()) vocab_of(fuzz_stories()->tok, "vocab-stories260K.gguf");
    tiny_bpe();
    tiny_spm();
    all_types();
    tiny_llama();
    ds4_file();
}

/* ---- snapshots and blocks --------------------------------------------------- */

static void tokens(int32_t *t, size_t n, uint32_t V, uint64_t seed)
{
    t[0] = V > 256 ? 256 : 1; /* ds4: BOS */
    for (size_t i = 1; i < n; i++) t[i] = (int32_t)(((seed = seed * 6364136223846793005ull + 1442695040888963407ull) >> 33) % (V < 256 ? V : 256));
}

static void snapshots(kvt_model *m, const char *tag, const size_t *lens, size_t n_lens, bool blocks)
{
    kvt_session *s = NULL;
    kvt_session_opts o = {.n_ctx = 1024, .n_threads = 1};
    must(kvt_session_new(&s, m, &o), "session");
    int32_t t[400];
    tokens(t, 400, m->info.n_vocab, 29);
    for (size_t i = 0; i < n_lens; i++) {
        must(kvt_session_sync(s, t, lens[i], NULL), "sync");
        uint8_t *snap = NULL;
        size_t sl = 0;
        must(kvt_session_snapshot(s, &snap, &sl), "snapshot");
        char name[64];
        snprintf(name, sizeof name, "%s-%zu.bin", tag, lens[i]);
        put("snapshot", name, snap, sl);
        /* without the state: the thin record, then the same blocks */
        kvt_snap_info in;
        kvt_wbuf thin = {0};
        must(kvt_snap_parse_raw(snap, sl, &in), "parse");
        must(kvt_snap_without_state(snap, in.rec_len, &thin), "without state");
        if (thin.len) {
            kvt_wbuf_put(&thin, snap + in.rec_len, sl - in.rec_len);
            snprintf(name, sizeof name, "%s-%zu-thin.bin", tag, lens[i]);
            put("snapshot", name, thin.p, thin.len);
        }
        kvt_wbuf_free(&thin);
        /* its blocks alone */
        size_t off = in.rec_len;
        for (uint32_t b = 0; blocks && b < in.nb && off + 56 <= sl; b++) {
            uint32_t pl;
            memcpy(&pl, snap + off + 44, 4);
            snprintf(name, sizeof name, "%s-%zu-block%u.bin", tag, lens[i], b);
            put("block", name, snap + off, 56 + (size_t)pl);
            off += 56 + (size_t)pl;
        }
        free(snap);
    }
    kvt_session_free(s);
}

static void snapshot_seeds(void)
{
    static const size_t ds4[] = {0, 1, 5, 127, 128, 133, 300};
    snapshots(fuzz_ds4(7), "ds4-tiny", ds4, sizeof ds4 / sizeof *ds4, false);
    static const size_t blk[] = {300};
    snapshots(fuzz_ds4(7), "ds4-tiny", blk, 1, true);
    static const size_t st[] = {3, 40};
    if (fuzz_stories()) snapshots(fuzz_stories(), "stories260K", st, 2, false);
}

/* ---- texts ---------------------------------------------------------------------- */

#define FW "\xef\xbd\x9c"
#define SPM "\xe2\x96\x81"
#define CSB "<" FW "tool" SPM "calls" SPM "begin" FW ">"
#define CSE "<" FW "tool" SPM "calls" SPM "end" FW ">"
#define CB "<" FW "tool" SPM "call" SPM "begin" FW ">"
#define CE "<" FW "tool" SPM "call" SPM "end" FW ">"
#define TSEP "<" FW "tool" SPM "sep" FW ">"

static void text_seeds(void)
{
    char name[64];
    int k = 0;
    const char *gp = fuzz_shared("golden/stories260K-greedy.jsonl");
    size_t len = 0;
    char *g = gp ? read_file(gp, &len) : NULL;
    for (char *line = g ? strtok(g, "\n") : NULL; line && k < 8; line = strtok(NULL, "\n")) {
        json_t *j = json_loads(line, 0, NULL);
        const char *p = json_string_value(json_object_get(j, "prompt"));
        if (p) {
            snprintf(name, sizeof name, "golden-prompt-%d", k++);
            put("tokenizer", name, p, strlen(p));
        }
        json_decref(j);
    }
    free(g);
    const char *sd = fuzz_shared("seeds");
    DIR *d = sd ? opendir(sd) : NULL;
    for (struct dirent *e; d && (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", sd, e->d_name);
        char *p = read_file(path, &len);
        if (p) put("tokenizer", e->d_name, p, len > 2048 ? 2048 : len);
        free(p);
    }
    if (d) closedir(d);
    /* llama.cpp's tokenizer test inputs, one case a file */
    const char *vd = fuzz_shared("vocab");
    d = vd ? opendir(vd) : NULL;
    static const char sep[] = "\n__ggml_vocab_test__\n";
    for (struct dirent *e; d && (e = readdir(d));) {
        size_t nl = strlen(e->d_name);
        if (nl < 4 || strcmp(e->d_name + nl - 4, ".inp")) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", vd, e->d_name);
        char *p = read_file(path, &len);
        for (char *c = p; c && *c;) {
            char *end = strstr(c, sep);
            size_t cl = end ? (size_t)(end - c) : strlen(c);
            snprintf(name, sizeof name, "llamacpp-%016llx", (unsigned long long)fuzz_hash(c, cl));
            put("tokenizer", name, c, cl);
            c = end ? end + sizeof sep - 1 : NULL;
        }
        free(p);
    }
    if (d) closedir(d);
    static const char *const texts[] = {
        "<" FW "begin" SPM "of" SPM "sentence" FW ">" "<" FW "User" FW ">hi<" FW "Assistant" FW ">",
        "  \t\n\r\n  x  ", "\xe2\x96\x81\xe2\x96\x81 a\xe2\x96\x81", "\xc0\xc1\xf5\xff\x80\xed\xa0\x80\xf4\x90\x80\x80",
        "Hello, world! 123 4567 don't", CB "function" TSEP "f\n```json\n{}\n```" CE,
    };
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) {
        snprintf(name, sizeof name, "text-%zu", i);
        put("tokenizer", name, texts[i], strlen(texts[i]));
    }
    static const char *const outs[] = {
        "Checking." CSB CB "function" TSEP "get_weather\n```json\n{ \"city\" : \"Paris\" }\n```" CE "\n" CB "function" TSEP
        "get_weather\n```json\n{\"units\":\"C\",  \"city\":\"Rome\"}\n```" CE CSE,
        "Hi " CB "function" TSEP " ls \n  {\"a\": [1, 2.50]}  " CE CB "read" TSEP "{\"p\":\"x\"}" CE CB "function" TSEP
        "now" CE CB "function" TSEP "bad\n```json\n{oops\n```" CE CB "function" TSEP "arr\n[1,2]" CE CSE " trailing",
        "x" CB "function get_weather {}" CE, "abc" CSB, "plain text <" FW "User" FW ">",
        CB "function" TSEP "ns.fn\n```json\n{\"q\":\"\\u00e9\\ud83d\\ude00\",\"n\":-0.0,\"e\":1e300}\n```" CE,
    };
    for (size_t i = 0; i < sizeof outs / sizeof *outs; i++) {
        snprintf(name, sizeof name, "output-%zu", i);
        put("toolcall", name, outs[i], strlen(outs[i]));
    }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: seedgen DIR\n");
        return 2;
    }
    root = argv[1];
    if (mkdir(root, 0777) && errno != EEXIST) { perror(root); return 1; }
    gguf_seeds();
    snapshot_seeds();
    text_seeds();
    return failures ? 1 : 0;
}
