/* The synthetic llama that bench/peers.sh runs kvtier and llama.cpp on.
 *
 *   synth_llama VOCAB.gguf OUT.gguf   write the F16 model
 *   synth_llama --sizes FILE.gguf     print a llama GGUF's shape, parameter
 *                                     count and tensor bytes as one JSON line
 *
 * The model: dim 768, 12 layers, 12 heads, 4 KV heads (head dim 64), SwiGLU
 * FFN of 2048, vocabulary 32000, context 8192, an output matrix of its own:
 * 124.7M parameters. Every matrix is N(0, 0.02), from a fixed seed, so the
 * file is the same on every machine; the norms are 1.0 (f32, as llama.cpp's
 * converter writes them), the matrices and the embedding table f16. Every
 * tokenizer.* key is copied from VOCAB (the llama SPM vocabulary file of the
 * llama.cpp tree), so both engines load it as a llama with that vocabulary.
 * Written with kvtier's GGUF writer (src/gguf.h); built by bench/peers.sh
 * against libkvtier.a, not by the Makefile.
 *
 * --sizes parses the header itself rather than with kvt_gguf_open, which
 * refuses the tensor types kvtier cannot compute with (q4_K, q6_K): a
 * tensor's bytes are the distance to the next tensor's offset (so they
 * include the alignment padding, under 32 bytes a tensor). */
#include "gguf.h"
#include "util.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DIM 768
#define LAYERS 12
#define HEADS 12
#define KV_HEADS 4
#define FFN 2048
#define VOCAB 32000
#define CTX 8192
#define SEED 0x6b767469657231ull /* "kvtier1" */
#define SIGMA 0.02

/* ---- writing ---- */

static uint64_t rng = SEED;

static uint64_t splitmix64(void)
{
    uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* N(0, 1) by Box-Muller, both values used. */
static double normal(void)
{
    static double spare;
    static int have;
    if (have) { have = 0; return spare; }
    double u = ((splitmix64() >> 11) + 1.0) / 9007199254740993.0; /* (0, 1] */
    double v = (splitmix64() >> 11) / 9007199254740992.0;
    double r = sqrt(-2.0 * log(u));
    spare = r * sin(2 * M_PI * v);
    have = 1;
    return r * cos(2 * M_PI * v);
}

static int die(const char *what, int rc)
{
    fprintf(stderr, "synth_llama: %s: %s: %s\n", what, kvt_strerror(rc), kvt_errmsg());
    return 1;
}

/* An f16 matrix of rows x cols (ne = {cols, rows}), N(0, SIGMA). */
static int add_matrix(kvt_gguf_writer *w, const char *name, uint64_t cols, uint64_t rows)
{
    size_t n = cols * rows;
    uint16_t *h = malloc(n * sizeof *h);
    if (!h) return KVT_ENOMEM;
    for (size_t i = 0; i < n; i++) h[i] = kvt_f32_to_f16((float)(SIGMA * normal()));
    uint64_t ne[2] = {cols, rows};
    int rc = kvt_gguf_writer_add_tensor(w, name, KVT_GGML_F16, 2, ne, h, n * sizeof *h);
    free(h);
    return rc;
}

static int add_norm(kvt_gguf_writer *w, const char *name)
{
    float v[DIM];
    for (size_t i = 0; i < DIM; i++) v[i] = 1.0f;
    uint64_t ne[1] = {DIM};
    return kvt_gguf_writer_add_tensor(w, name, KVT_GGML_F32, 1, ne, v, sizeof v);
}

static int write_model(const char *vocab_path, const char *out)
{
    kvt_gguf *vocab = NULL;
    int rc = kvt_gguf_open(&vocab, vocab_path);
    if (rc) return die(vocab_path, rc);
    const kvt_gguf_val *tokens = kvt_gguf_get(vocab, "tokenizer.ggml.tokens");
    if (!tokens || tokens->type != KVT_GGUF_ARR || tokens->n != VOCAB) {
        fprintf(stderr, "synth_llama: %s: tokenizer.ggml.tokens is not an array of %d tokens\n", vocab_path, VOCAB);
        kvt_gguf_close(vocab);
        return 1;
    }
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    if (!w) { kvt_gguf_close(vocab); return die("writer", KVT_ENOMEM); }
    const char *what = "metadata";
    if ((rc = kvt_gguf_writer_set_str(w, "general.architecture", "llama")) ||
        (rc = kvt_gguf_writer_set_str(w, "general.name", "synth-llama-124m")) ||
        (rc = kvt_gguf_writer_set_u32(w, "general.file_type", 1)) || /* mostly f16 */
        (rc = kvt_gguf_writer_set_u32(w, "llama.context_length", CTX)) ||
        (rc = kvt_gguf_writer_set_u32(w, "llama.embedding_length", DIM)) ||
        (rc = kvt_gguf_writer_set_u32(w, "llama.block_count", LAYERS)) ||
        (rc = kvt_gguf_writer_set_u32(w, "llama.feed_forward_length", FFN)) ||
        (rc = kvt_gguf_writer_set_u32(w, "llama.attention.head_count", HEADS)) ||
        (rc = kvt_gguf_writer_set_u32(w, "llama.attention.head_count_kv", KV_HEADS)) ||
        (rc = kvt_gguf_writer_set_u32(w, "llama.rope.dimension_count", DIM / HEADS)) ||
        (rc = kvt_gguf_writer_set_f32(w, "llama.rope.freq_base", 10000.0f)) ||
        (rc = kvt_gguf_writer_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f)) ||
        (rc = kvt_gguf_writer_set_u32(w, "llama.vocab_size", VOCAB)))
        goto out;
    what = "tokenizer metadata";
    size_t copied = 0;
    for (size_t i = 0; i < kvt_gguf_n_kv(vocab) && !rc; i++)
        if (!strncmp(kvt_gguf_key(vocab, i), "tokenizer.", 10)) {
            rc = kvt_gguf_writer_set(w, kvt_gguf_key(vocab, i), kvt_gguf_val_at(vocab, i));
            copied++;
        }
    if (rc) goto out;
    what = "tensors";
    if ((rc = add_matrix(w, "token_embd.weight", DIM, VOCAB))) goto out;
    for (int l = 0; l < LAYERS; l++) {
        char nm[64];
#define M(suffix, cols, rows) \
        snprintf(nm, sizeof nm, "blk.%d.%s", l, suffix); \
        if ((rc = add_matrix(w, nm, cols, rows))) goto out;
#define N(suffix) \
        snprintf(nm, sizeof nm, "blk.%d.%s", l, suffix); \
        if ((rc = add_norm(w, nm))) goto out;
        N("attn_norm.weight")
        M("attn_q.weight", DIM, DIM)
        M("attn_k.weight", DIM, KV_HEADS * (DIM / HEADS))
        M("attn_v.weight", DIM, KV_HEADS * (DIM / HEADS))
        M("attn_output.weight", DIM, DIM)
        N("ffn_norm.weight")
        M("ffn_gate.weight", DIM, FFN)
        M("ffn_up.weight", DIM, FFN)
        M("ffn_down.weight", FFN, DIM)
#undef M
#undef N
    }
    if ((rc = add_norm(w, "output_norm.weight")) || (rc = add_matrix(w, "output.weight", DIM, VOCAB))) goto out;
    what = out;
    rc = kvt_gguf_writer_write(w, out);
    if (!rc) printf("synth_llama: wrote %s (%zu tokenizer keys from %s)\n", out, copied, vocab_path);
out:
    kvt_gguf_writer_free(w);
    kvt_gguf_close(vocab);
    return rc ? die(what, rc) : 0;
}

/* ---- --sizes ---- */

typedef struct rd {
    FILE *f;
    const char *path;
    int bad;
} rd;

static uint64_t rd_n(rd *r, int bytes)
{
    uint8_t b[8] = {0};
    if (fread(b, 1, (size_t)bytes, r->f) != (size_t)bytes) r->bad = 1;
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; i--) v = v << 8 | b[i];
    return v;
}

/* A string into buf (truncated to cap - 1), or skipped when buf is NULL. */
static void rd_str(rd *r, char *buf, size_t cap)
{
    uint64_t n = rd_n(r, 8);
    if (r->bad || n > (1u << 30)) { r->bad = 1; return; }
    if (!buf) { if (fseek(r->f, (long)n, SEEK_CUR)) r->bad = 1; return; }
    size_t keep = n < cap ? n : cap - 1;
    if (fread(buf, 1, keep, r->f) != keep || (n > keep && fseek(r->f, (long)(n - keep), SEEK_CUR))) r->bad = 1;
    buf[keep] = 0;
}

static int scalar_bytes(uint32_t type)
{
    static const int size[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return type < sizeof size / sizeof size[0] ? size[type] : -1;
}

/* Skips one value; returns its integer value when it is an integer scalar. */
static uint64_t rd_val(rd *r, uint32_t type)
{
    if (type == KVT_GGUF_STR) { rd_str(r, NULL, 0); return 0; }
    if (type == KVT_GGUF_ARR) {
        uint32_t et = (uint32_t)rd_n(r, 4);
        uint64_t n = rd_n(r, 8);
        int sz = scalar_bytes(et);
        if (sz > 0) {
            if (fseek(r->f, (long)(n * (uint64_t)sz), SEEK_CUR)) r->bad = 1;
        } else {
            for (uint64_t i = 0; i < n && !r->bad; i++) rd_val(r, et);
        }
        return 0;
    }
    int sz = scalar_bytes(type);
    if (sz <= 0) { r->bad = 1; return 0; }
    return rd_n(r, sz);
}

typedef struct tinfo {
    char name[96];
    uint64_t n_elem, offset, bytes;
} tinfo;

static int by_offset(const void *a, const void *b)
{
    uint64_t x = ((const tinfo *)a)->offset, y = ((const tinfo *)b)->offset;
    return x < y ? -1 : x > y;
}

static int sizes(const char *path)
{
    rd r = {fopen(path, "rb"), path, 0};
    if (!r.f) { perror(path); return 1; }
    uint32_t magic = (uint32_t)rd_n(&r, 4), version = (uint32_t)rd_n(&r, 4);
    uint64_t n_t = rd_n(&r, 8), n_kv = rd_n(&r, 8);
    if (r.bad || magic != 0x46554747u || version < 2 || n_t > 100000 || n_kv > 100000) {
        fprintf(stderr, "synth_llama: %s: not a GGUF v2/v3 file\n", path);
        fclose(r.f);
        return 1;
    }
    uint64_t embd = 0, layers = 0, heads = 0, heads_kv = 0, ffn = 0, align = 32;
    for (uint64_t i = 0; i < n_kv && !r.bad; i++) {
        char key[128];
        rd_str(&r, key, sizeof key);
        uint32_t type = (uint32_t)rd_n(&r, 4);
        uint64_t v = rd_val(&r, type);
        if (!strcmp(key, "llama.embedding_length")) embd = v;
        else if (!strcmp(key, "llama.block_count")) layers = v;
        else if (!strcmp(key, "llama.attention.head_count")) heads = v;
        else if (!strcmp(key, "llama.attention.head_count_kv")) heads_kv = v;
        else if (!strcmp(key, "llama.feed_forward_length")) ffn = v;
        else if (!strcmp(key, "general.alignment")) align = v;
    }
    tinfo *t = calloc(n_t ? n_t : 1, sizeof *t);
    if (!t) { fclose(r.f); return 1; }
    for (uint64_t i = 0; i < n_t && !r.bad; i++) {
        rd_str(&r, t[i].name, sizeof t[i].name);
        uint32_t dims = (uint32_t)rd_n(&r, 4);
        if (dims > 4) r.bad = 1;
        t[i].n_elem = 1;
        for (uint32_t d = 0; d < dims && !r.bad; d++) t[i].n_elem *= rd_n(&r, 8);
        rd_n(&r, 4); /* type */
        t[i].offset = rd_n(&r, 8);
    }
    long pos = ftell(r.f);
    int bad = r.bad || pos < 0 || !align || fseek(r.f, 0, SEEK_END);
    long end = bad ? 0 : ftell(r.f);
    fclose(r.f);
    uint64_t data = ((uint64_t)pos + align - 1) / align * align;
    if (bad || end < 0 || (uint64_t)end < data) {
        fprintf(stderr, "synth_llama: %s: truncated or malformed header\n", path);
        free(t);
        return 1;
    }
    qsort(t, n_t, sizeof *t, by_offset);
    uint64_t params = 0, bytes = 0, embd_params = 0, embd_bytes = 0, vocab = 0, tied = 1;
    for (uint64_t i = 0; i < n_t; i++) {
        t[i].bytes = (i + 1 < n_t ? t[i + 1].offset : (uint64_t)end - data) - t[i].offset;
        params += t[i].n_elem;
        bytes += t[i].bytes;
        if (!strcmp(t[i].name, "token_embd.weight")) {
            embd_params = t[i].n_elem;
            embd_bytes = t[i].bytes;
            vocab = embd ? t[i].n_elem / embd : 0;
        }
        if (!strcmp(t[i].name, "output.weight")) tied = 0;
    }
    free(t);
    if (!embd || !layers || !heads || !vocab) {
        fprintf(stderr, "synth_llama: %s: not a llama GGUF (llama.* shape or token_embd.weight missing)\n", path);
        return 1;
    }
    printf("{\"n_embd\": %llu, \"n_layer\": %llu, \"n_head\": %llu, \"n_head_kv\": %llu, \"n_ff\": %llu, "
           "\"n_vocab\": %llu, \"output_tied\": %s, \"params\": %llu, \"embd_params\": %llu, \"bytes\": %llu, "
           "\"embd_bytes\": %llu}\n",
           (unsigned long long)embd, (unsigned long long)layers, (unsigned long long)heads,
           (unsigned long long)(heads_kv ? heads_kv : heads), (unsigned long long)ffn,
           (unsigned long long)vocab, tied ? "true" : "false", (unsigned long long)params,
           (unsigned long long)embd_params, (unsigned long long)bytes, (unsigned long long)embd_bytes);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "--sizes")) return sizes(argv[2]);
    if (argc == 3 && argv[1][0] != '-') return write_model(argv[1], argv[2]);
    fprintf(stderr, "usage: synth_llama VOCAB.gguf OUT.gguf | synth_llama --sizes FILE.gguf\n");
    return 2;
}
