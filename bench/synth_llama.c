/* The synthetic llama that bench/peers.sh runs kvtier and llama.cpp on.
 *
 *   synth_llama [--shape S] VOCAB.gguf OUT.gguf   write the F16 model (S below;
 *                                     default llama-124m)
 *   synth_llama --sizes FILE.gguf     print a llama GGUF's shape, parameter
 *                                     count and tensor bytes as one JSON line
 *   synth_llama --imatrix FILE.gguf OUT.dat  an importance matrix of ones
 *                                     for FILE's matrices (below)
 *   synth_llama --experts FILE.gguf OUT.gguf GATE_UP DOWN
 *                                     FILE with its routed experts
 *                                     (*_exps) as random blocks of the
 *                                     types named (below)
 *
 * The model: dim 768, 12 layers, 12 heads, 4 KV heads (head dim 64), SwiGLU
 * FFN of 2048, vocabulary 32000, context 8192, an output matrix of its own:
 * 124.7M parameters. Every matrix is N(0, 0.02), from a fixed seed, so the
 * file is the same on every machine; the norms are 1.0 (f32, as llama.cpp's
 * converter writes them), the matrices and the embedding table f16. Every
 * tokenizer.* key is copied from VOCAB (the llama SPM vocabulary file of the
 * llama.cpp tree), so both engines load it as a llama with that vocabulary.
 * Written with kvtier's GGUF writer (src/format/gguf.h); built by bench/peers.sh
 * against libkvtier.a, not by the Makefile.
 *
 * --sizes parses the header itself rather than with kvt_gguf_open, which
 * refuses the tensor types kvtier cannot compute with (q4_K, q6_K): a
 * tensor's bytes are the distance to the next tensor's offset (so they
 * include the alignment padding, under 32 bytes a tensor). */
#include "format/gguf.h"
#include "base/util.h"

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The shapes it writes: the llama above, and the two small models of the
 * families people run on a CPU with coding agents, their real dimensions
 * (Qwen3-0.6B: tied embeddings, q/k head norms, head length 128; Gemma 3
 * 1B: tied, head norms, post norms, a 512-token window on five layers of
 * every six with its own RoPE base; Qwen3.5-0.8B: below), each with the
 * vocabulary file of its family from the llama.cpp tree (its size is the
 * file's). Norms are 1.0 (but Qwen3.5's); the weights are drawn in file
 * order from the one seed.
 *
 * qwen3.5-0.8b (arch qwen35): Qwen3.5-0.8B's shape, 24 layers of which
 * every fourth is a gated full attention layer (8 heads, 2 KV heads, head
 * length 256, attn_q of 2 x 8 x 256 rows: each head's queries then its
 * gate; q/k head norms; RoPE over 64 of the 256 dims, rope.dimension_sections
 * [11, 11, 10, 0]) and the others Gated DeltaNet layers (conv kernel 4, 16
 * K heads and 16 V heads of 128, inner 2048: attn_qkv of 6144 rows,
 * attn_gate, ssm_conv1d, ssm_dt.bias, ssm_a, ssm_beta, ssm_alpha,
 * ssm_norm, ssm_out), both full_attention_interval 4 and the
 * attention.recurrent_layers array written, SwiGLU FFN of 3584 after
 * post_attention_norm, tied embeddings, context 262144. The scales are
 * those of the tests' synthetic qwen35 (tests/synth_family.h): attn_q,
 * attn_k and attn_qkv N(0, 0.08), ssm_conv1d N(0, 0.5) (F32, as the
 * converter keeps it), ssm_dt.bias N(0, 0.5), ssm_a -0.02 * 100^(h / 15)
 * per V head h (-0.02 to -2), every norm 1 + N(0, 0.3), the rest N(0,
 * 0.02); matrices F16, vectors F32. */
typedef struct shape {
    const char *name, *arch;
    uint32_t D, L, H, Hkv, hd, F, ctx;
    bool tied, qk_norm, gemma;
    float rope_base;
    const struct q35_shape *q35; /* qwen35's own, or NULL */
} shape;

/* qwen35's RoPE dims, DeltaNet conv kernel, head length, K and V heads;
 * mtp: an MTP (nextn) layer after the 24 */
typedef struct q35_shape {
    uint32_t rot, conv, state, hk, hv;
    bool mtp;
} q35_shape;

static const q35_shape qwen35_08b = {64, 4, 128, 16, 16, false};
static const q35_shape qwen35_08b_mtp = {64, 4, 128, 16, 16, true};

static const shape shapes[] = {
    {"llama-124m", "llama", 768, 12, 12, 4, 64, 2048, 8192, false, false, false, 10000.0f, NULL},
    {"qwen3-0.6b", "qwen3", 1024, 28, 16, 8, 128, 3072, 40960, true, true, false, 1000000.0f, NULL},
    {"gemma3-1b", "gemma3", 1152, 26, 4, 1, 256, 6912, 32768, true, true, true, 1000000.0f, NULL},
    {"qwen3.5-0.8b", "qwen35", 1024, 24, 8, 2, 256, 3584, 262144, true, true, false, 10000000.0f, &qwen35_08b},
    /* the same with an MTP layer as llama.cpp's converter writes Qwen 3.5's
     * (bench/draft_peer.sh's --draft mtp cell): block 24 a full-attention
     * layer with its FFN, nextn.eh_proj (2D -> D), enorm, hnorm,
     * shared_head_norm; nextn_predict_layers 1, block_count 25; its
     * tensors drawn after the model's, which are those of qwen3.5-0.8b */
    {"qwen3.5-0.8b-mtp", "qwen35", 1024, 24, 8, 2, 256, 3584, 262144, true, true, false, 10000000.0f, &qwen35_08b_mtp},
    /* a draft model for qwen3-0.6b (bench/draft.sh): its vocabulary, 2
     * layers of 256 */
    {"qwen3-tiny", "qwen3", 256, 2, 4, 2, 64, 768, 40960, true, true, false, 1000000.0f, NULL},
};
#define Q35_INTERVAL 4
#define Q35_SIGMA_QK 0.08
#define Q35_SIGMA_CONV 0.5
#define Q35_SIGMA_DT 0.5
#define Q35_SIGMA_NORM 0.3
#define GEMMA_SWA 512
#define GEMMA_PATTERN 6
#define GEMMA_BASE_SWA 10000.0f
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

/* An f16 matrix of rows x cols (ne = {cols, rows}), N(0, sigma). */
static int add_matrix_s(kvt_gguf_writer *w, const char *name, uint64_t cols, uint64_t rows, double sigma)
{
    size_t n = cols * rows;
    uint16_t *h = malloc(n * sizeof *h);
    if (!h) return KVT_ENOMEM;
    for (size_t i = 0; i < n; i++) h[i] = kvt_f32_to_f16((float)(sigma * normal()));
    uint64_t ne[2] = {cols, rows};
    int rc = kvt_gguf_writer_add_tensor(w, name, KVT_GGML_F16, 2, ne, h, n * sizeof *h);
    free(h);
    return rc;
}

/* The same of N(0, SIGMA). */
static int add_matrix(kvt_gguf_writer *w, const char *name, uint64_t cols, uint64_t rows)
{
    return add_matrix_s(w, name, cols, rows, SIGMA);
}

/* An f32 tensor of cols x rows (rows 1: a vector) of base + N(0, sigma). */
static int add_f32(kvt_gguf_writer *w, const char *name, uint64_t cols, uint64_t rows, double base, double sigma)
{
    size_t n = cols * rows;
    float *f = malloc(n * sizeof *f);
    if (!f) return KVT_ENOMEM;
    for (size_t i = 0; i < n; i++) f[i] = (float)(base + sigma * normal());
    uint64_t ne[2] = {cols, rows};
    int rc = kvt_gguf_writer_add_tensor(w, name, KVT_GGML_F32, rows > 1 ? 2 : 1, ne, f, n * sizeof *f);
    free(f);
    return rc;
}

static int add_norm(kvt_gguf_writer *w, const char *name, uint64_t n)
{
    float v[8192];
    if (n > 8192) return KVT_EINVAL;
    for (size_t i = 0; i < n; i++) v[i] = 1.0f;
    uint64_t ne[1] = {n};
    return kvt_gguf_writer_add_tensor(w, name, KVT_GGML_F32, 1, ne, v, n * sizeof *v);
}

/* An array of n values of type t (bools, i32) as a key. */
static int set_arr(kvt_gguf_writer *w, const char *key, const int32_t *v, uint32_t n, uint32_t t)
{
    kvt_gguf_val a[64];
    if (n > 64) return KVT_EINVAL;
    for (uint32_t i = 0; i < n; i++) {
        a[i] = (kvt_gguf_val){.type = t};
        if (t == KVT_GGUF_BOOL) a[i].v.u = v[i] != 0;
        else a[i].v.i = v[i];
    }
    kvt_gguf_val arr = {.type = KVT_GGUF_ARR, .elem_type = t, .n = n, .v.arr = a};
    return kvt_gguf_writer_set(w, key, &arr);
}

/* The qwen35 keys and tensors of sh (qwen3.5-0.8b above), after the common
 * keys; V the vocabulary's size. */
static int write_q35(kvt_gguf_writer *w, const shape *sh, uint64_t V)
{
    const q35_shape *q = sh->q35;
    const uint64_t D = sh->D, QD = (uint64_t)sh->H * sh->hd, KVD = (uint64_t)sh->Hkv * sh->hd,
                   KD = (uint64_t)q->hk * q->state, VD = (uint64_t)q->hv * q->state, CONV = 2 * KD + VD;
    int32_t recr[65];
    const uint32_t L = sh->L + q->mtp; /* block_count: the MTP layer's block too */
    const int32_t sections[4] = {11, 11, 10, 0}; /* the converter's default: 32 pairs = rot / 2 */
    if (sh->L > 64 || q->hv > 64 || sections[0] + sections[1] + sections[2] != (int32_t)q->rot / 2)
        return KVT_EINVAL;
    for (uint32_t l = 0; l < L; l++) recr[l] = l < sh->L && (l + 1) % Q35_INTERVAL != 0;
    char k[96];
    int rc;
#define KEY(suffix) (snprintf(k, sizeof k, "%s.%s", sh->arch, suffix), k)
    if ((rc = kvt_gguf_writer_set_u32(w, KEY("rope.dimension_count"), q->rot)) ||
        (rc = set_arr(w, KEY("rope.dimension_sections"), sections, 4, KVT_GGUF_I32)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("ssm.conv_kernel"), q->conv)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("ssm.state_size"), q->state)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("ssm.group_count"), q->hk)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("ssm.time_step_rank"), q->hv)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("ssm.inner_size"), (uint32_t)VD)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("full_attention_interval"), Q35_INTERVAL)) ||
        (rc = set_arr(w, KEY("attention.recurrent_layers"), recr, L, KVT_GGUF_BOOL)) ||
        (q->mtp && (rc = kvt_gguf_writer_set_u32(w, KEY("nextn_predict_layers"), 1))))
        return rc;
#undef KEY
    float a[64];
    for (uint32_t h = 0; h < q->hv; h++) a[h] = (float)(-0.02 * pow(100.0, (double)h / (q->hv - 1)));
    if ((rc = add_matrix(w, "token_embd.weight", D, V))) return rc;
    for (uint32_t l = 0; l < sh->L; l++) {
        char nm[64];
#define NM(suffix) (snprintf(nm, sizeof nm, "blk.%u.%s", l, suffix), nm)
        if ((rc = add_f32(w, NM("attn_norm.weight"), D, 1, 1.0, Q35_SIGMA_NORM)) ||
            (rc = add_f32(w, NM("post_attention_norm.weight"), D, 1, 1.0, Q35_SIGMA_NORM)))
            return rc;
        if (!recr[l]) {
            if ((rc = add_matrix_s(w, NM("attn_q.weight"), D, 2 * QD, Q35_SIGMA_QK)) ||
                (rc = add_matrix_s(w, NM("attn_k.weight"), D, KVD, Q35_SIGMA_QK)) ||
                (rc = add_matrix(w, NM("attn_v.weight"), D, KVD)) ||
                (rc = add_matrix(w, NM("attn_output.weight"), QD, D)) ||
                (rc = add_f32(w, NM("attn_q_norm.weight"), sh->hd, 1, 1.0, Q35_SIGMA_NORM)) ||
                (rc = add_f32(w, NM("attn_k_norm.weight"), sh->hd, 1, 1.0, Q35_SIGMA_NORM)))
                return rc;
        } else {
            uint64_t ne[1] = {q->hv};
            if ((rc = add_matrix_s(w, NM("attn_qkv.weight"), D, CONV, Q35_SIGMA_QK)) ||
                (rc = add_matrix(w, NM("attn_gate.weight"), D, VD)) ||
                (rc = add_f32(w, NM("ssm_conv1d.weight"), q->conv, CONV, 0.0, Q35_SIGMA_CONV)) ||
                (rc = add_f32(w, NM("ssm_dt.bias"), q->hv, 1, 0.0, Q35_SIGMA_DT)) ||
                (rc = kvt_gguf_writer_add_tensor(w, NM("ssm_a"), KVT_GGML_F32, 1, ne, a, q->hv * sizeof *a)) ||
                (rc = add_matrix(w, NM("ssm_beta.weight"), D, q->hv)) ||
                (rc = add_matrix(w, NM("ssm_alpha.weight"), D, q->hv)) ||
                (rc = add_f32(w, NM("ssm_norm.weight"), q->state, 1, 1.0, Q35_SIGMA_NORM)) ||
                (rc = add_matrix(w, NM("ssm_out.weight"), VD, D)))
                return rc;
        }
        if ((rc = add_matrix(w, NM("ffn_gate.weight"), D, sh->F)) ||
            (rc = add_matrix(w, NM("ffn_up.weight"), D, sh->F)) ||
            (rc = add_matrix(w, NM("ffn_down.weight"), sh->F, D)))
            return rc;
#undef NM
    }
    if ((rc = add_f32(w, "output_norm.weight", D, 1, 1.0, Q35_SIGMA_NORM))) return rc;
    if (q->mtp) {
        char nm[64];
        uint32_t l = sh->L;
#define NM(suffix) (snprintf(nm, sizeof nm, "blk.%u.%s", l, suffix), nm)
        if ((rc = add_f32(w, NM("attn_norm.weight"), D, 1, 1.0, Q35_SIGMA_NORM)) ||
            (rc = add_f32(w, NM("post_attention_norm.weight"), D, 1, 1.0, Q35_SIGMA_NORM)) ||
            (rc = add_matrix_s(w, NM("attn_q.weight"), D, 2 * QD, Q35_SIGMA_QK)) ||
            (rc = add_matrix_s(w, NM("attn_k.weight"), D, KVD, Q35_SIGMA_QK)) ||
            (rc = add_matrix(w, NM("attn_v.weight"), D, KVD)) ||
            (rc = add_matrix(w, NM("attn_output.weight"), QD, D)) ||
            (rc = add_f32(w, NM("attn_q_norm.weight"), sh->hd, 1, 1.0, Q35_SIGMA_NORM)) ||
            (rc = add_f32(w, NM("attn_k_norm.weight"), sh->hd, 1, 1.0, Q35_SIGMA_NORM)) ||
            (rc = add_matrix(w, NM("ffn_gate.weight"), D, sh->F)) ||
            (rc = add_matrix(w, NM("ffn_up.weight"), D, sh->F)) ||
            (rc = add_matrix(w, NM("ffn_down.weight"), sh->F, D)) ||
            (rc = add_matrix(w, NM("nextn.eh_proj.weight"), 2 * D, D)) ||
            (rc = add_f32(w, NM("nextn.enorm.weight"), D, 1, 1.0, Q35_SIGMA_NORM)) ||
            (rc = add_f32(w, NM("nextn.hnorm.weight"), D, 1, 1.0, Q35_SIGMA_NORM)) ||
            (rc = add_f32(w, NM("nextn.shared_head_norm.weight"), D, 1, 1.0, Q35_SIGMA_NORM)))
            return rc;
#undef NM
    }
    return sh->tied ? KVT_OK : add_matrix(w, "output.weight", D, V);
}

static int write_model(const shape *sh, const char *vocab_path, const char *out)
{
    kvt_gguf *vocab = NULL;
    int rc = kvt_gguf_open(&vocab, vocab_path);
    if (rc) return die(vocab_path, rc);
    const kvt_gguf_val *tokens = kvt_gguf_get(vocab, "tokenizer.ggml.tokens");
    if (!tokens || tokens->type != KVT_GGUF_ARR || tokens->n < 256 || tokens->n > 1u << 20) {
        fprintf(stderr, "synth_llama: %s: tokenizer.ggml.tokens is not an array of 256 to 2^20 tokens\n", vocab_path);
        kvt_gguf_close(vocab);
        return 1;
    }
    const uint64_t V = tokens->n, D = sh->D, QD = (uint64_t)sh->H * sh->hd, KVD = (uint64_t)sh->Hkv * sh->hd;
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    if (!w) { kvt_gguf_close(vocab); return die("writer", KVT_ENOMEM); }
    const char *what = "metadata";
    char name[64], k[96];
    snprintf(name, sizeof name, "synth-%s", sh->name);
#define KEY(suffix) (snprintf(k, sizeof k, "%s.%s", sh->arch, suffix), k)
    if ((rc = kvt_gguf_writer_set_str(w, "general.architecture", sh->arch)) ||
        (rc = kvt_gguf_writer_set_str(w, "general.name", name)) ||
        (rc = kvt_gguf_writer_set_u32(w, "general.file_type", 1)) || /* mostly f16 */
        (rc = kvt_gguf_writer_set_u32(w, KEY("context_length"), sh->ctx)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("embedding_length"), sh->D)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("block_count"), sh->L + (sh->q35 && sh->q35->mtp))) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("feed_forward_length"), sh->F)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.head_count"), sh->H)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.head_count_kv"), sh->Hkv)) ||
        (!sh->q35 && (rc = kvt_gguf_writer_set_u32(w, KEY("rope.dimension_count"), sh->hd))) ||
        (rc = kvt_gguf_writer_set_f32(w, KEY("rope.freq_base"), sh->rope_base)) ||
        (rc = kvt_gguf_writer_set_f32(w, KEY("attention.layer_norm_rms_epsilon"),
                                      sh->gemma || sh->q35 ? 1e-6f : 1e-5f)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("vocab_size"), (uint32_t)V)))
        goto out;
    if (sh->hd != sh->D / sh->H && ((rc = kvt_gguf_writer_set_u32(w, KEY("attention.key_length"), sh->hd)) ||
                                    (rc = kvt_gguf_writer_set_u32(w, KEY("attention.value_length"), sh->hd))))
        goto out;
    if (sh->gemma && ((rc = kvt_gguf_writer_set_u32(w, KEY("attention.sliding_window"), GEMMA_SWA)) ||
                      (rc = kvt_gguf_writer_set_u32(w, KEY("attention.sliding_window_pattern"), GEMMA_PATTERN)) ||
                      (rc = kvt_gguf_writer_set_f32(w, KEY("rope.freq_base_swa"), GEMMA_BASE_SWA))))
        goto out;
#undef KEY
    what = "tokenizer metadata";
    size_t copied = 0;
    for (size_t i = 0; i < kvt_gguf_n_kv(vocab) && !rc; i++)
        if (!strncmp(kvt_gguf_key(vocab, i), "tokenizer.", 10)) {
            rc = kvt_gguf_writer_set(w, kvt_gguf_key(vocab, i), kvt_gguf_val_at(vocab, i));
            copied++;
        }
    if (rc) goto out;
    what = "tensors";
    if (sh->q35) {
        if ((rc = write_q35(w, sh, V))) goto out;
        goto write;
    }
    if ((rc = add_matrix(w, "token_embd.weight", D, V))) goto out;
    for (uint32_t l = 0; l < sh->L; l++) {
        char nm[64];
#define M(suffix, cols, rows) \
        snprintf(nm, sizeof nm, "blk.%u.%s", l, suffix); \
        if ((rc = add_matrix(w, nm, cols, rows))) goto out;
#define N(suffix, n) \
        snprintf(nm, sizeof nm, "blk.%u.%s", l, suffix); \
        if ((rc = add_norm(w, nm, n))) goto out;
        N("attn_norm.weight", D)
        M("attn_q.weight", D, QD)
        M("attn_k.weight", D, KVD)
        M("attn_v.weight", D, KVD)
        if (sh->qk_norm) {
            N("attn_q_norm.weight", sh->hd)
            N("attn_k_norm.weight", sh->hd)
        }
        M("attn_output.weight", QD, D)
        if (sh->gemma) {
            N("post_attention_norm.weight", D)
            N("post_ffw_norm.weight", D)
        }
        N("ffn_norm.weight", D)
        M("ffn_gate.weight", D, sh->F)
        M("ffn_up.weight", D, sh->F)
        M("ffn_down.weight", sh->F, D)
#undef M
#undef N
    }
    if ((rc = add_norm(w, "output_norm.weight", D))) goto out;
    if (!sh->tied && (rc = add_matrix(w, "output.weight", D, V))) goto out;
write:
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

/* ---- --imatrix ---- */

/* An importance matrix of ones for every matrix of the model at path, in
 * llama-imatrix's legacy file format (tools/imatrix of the llama.cpp tree,
 * read by llama-quantize --imatrix: the entry count, then per entry its
 * name's length and bytes, the call count and the value count, the
 * values; int32 and f32 little-endian): ne[0] * ne[2] values per tensor
 * (a column weight per input, per expert). IQ2_XXS, IQ2_XS, IQ1_S and
 * IQ1_M files need one (llama-quantize has no flag to go without); with
 * every weight 1 the quantiser's search is unweighted, as from a flat
 * activation distribution. */
static int imatrix(const char *path, const char *out)
{
    kvt_gguf *g = NULL;
    int rc = kvt_gguf_open_header(&g, path);
    if (rc) return die(path, rc);
    FILE *f = fopen(out, "wb");
    if (!f) {
        kvt_gguf_close(g);
        fprintf(stderr, "synth_llama: %s: cannot write\n", out);
        return 1;
    }
    int32_t n = 0;
    for (size_t i = 0; i < kvt_gguf_n_tensors(g); i++) n += kvt_gguf_tensor_at(g, i)->n_dims >= 2;
    fwrite(&n, 4, 1, f);
    for (size_t i = 0; i < kvt_gguf_n_tensors(g); i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        if (t->n_dims < 2) continue;
        int32_t len = (int32_t)strlen(t->name), ncall = 1, nval = (int32_t)(t->ne[0] * t->ne[2]);
        fwrite(&len, 4, 1, f);
        fwrite(t->name, 1, (size_t)len, f);
        fwrite(&ncall, 4, 1, f);
        fwrite(&nval, 4, 1, f);
        for (int32_t j = 0; j < nval; j++) {
            float one = 1.0f;
            fwrite(&one, 4, 1, f);
        }
    }
    kvt_gguf_close(g);
    return fclose(f) ? 1 : 0;
}

/* ---- --experts ---- */

/* FILE (a GGUF kvtier reads: the ds4-flash-bench file in Q8_0) copied to
 * OUT with its routed expert tensors (names ending in _exps.weight) stored
 * as GATE_UP (gate and up) and DOWN (down): iq2_xxs, q2_K or q4_K blocks
 * of random bits whose f16 scales are 2^-12 (values of a few 1e-2 at
 * most), every other key and tensor byte for byte. For a speed benchmark
 * of the layout and types ds4.c ships Flash in: llama-quantize makes the
 * same types from the Q8_0 weights, at about 10^6 values a second for
 * IQ2_XXS on one core (the grid search), which is hours for the 8.6
 * billion values of two Flash layers' gate and up experts; a kernel's speed
 * does not depend on the bits it multiplies. */
static uint32_t type_id(const char *name)
{
    static const struct { const char *n; uint32_t id; } t[] = {
        {"iq2_xxs", KVT_GGML_IQ2_XXS}, {"q2_K", KVT_GGML_Q2_K}, {"q4_K", KVT_GGML_Q4_K}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(name, t[i].n)) return t[i].id;
    return UINT32_MAX;
}

/* nb random blocks of type into p, their f16 scale fields 2^-12 */
static void random_blocks(uint32_t type, uint8_t *p, size_t nb)
{
    size_t bs = kvt_ggml_type_size(type, 256);
    static const size_t f16_at[][3] = {{0, SIZE_MAX}, {80, 82, SIZE_MAX}, {0, 2, SIZE_MAX}};
    const size_t *at = f16_at[type == KVT_GGML_IQ2_XXS ? 0 : type == KVT_GGML_Q2_K ? 1 : 2];
    for (size_t b = 0; b < nb; b++, p += bs) {
        for (size_t i = 0; i < bs; i += 8) {
            uint64_t r = splitmix64();
            memcpy(p + i, &r, bs - i < 8 ? bs - i : 8);
        }
        for (size_t k = 0; at[k] != SIZE_MAX; k++) p[at[k]] = 0x00, p[at[k] + 1] = 0x0c; /* f16 0x0c00 = 2^-12 */
    }
}

static int experts(const char *path, const char *out, const char *gu_name, const char *dn_name)
{
    uint32_t gu = type_id(gu_name), dn = type_id(dn_name);
    if (gu == UINT32_MAX || dn == UINT32_MAX) {
        fprintf(stderr, "synth_llama: --experts types: iq2_xxs, q2_K or q4_K\n");
        return 2;
    }
    kvt_gguf *g = NULL;
    int rc = kvt_gguf_open(&g, path);
    if (rc) return die(path, rc);
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    size_t nt = kvt_gguf_n_tensors(g);
    uint32_t *ty = calloc(nt, sizeof *ty);
    if (!w || !ty) return die("out of memory", KVT_ENOMEM);
    for (size_t i = 0; i < kvt_gguf_n_kv(g) && !rc; i++) rc = kvt_gguf_writer_set(w, kvt_gguf_key(g, i), kvt_gguf_val_at(g, i));
    for (size_t i = 0; i < nt && !rc; i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        const char *e = strstr(t->name, "_exps.weight");
        ty[i] = t->type;
        if (e && !e[12]) ty[i] = strstr(t->name, "ffn_down_exps") ? dn : gu;
        uint64_t bytes = kvt_ggml_type_size(ty[i], t->n_elem);
        if (!bytes) { fprintf(stderr, "synth_llama: %s: %s does not fit\n", t->name, kvt_ggml_type_name(ty[i])); return 1; }
        rc = kvt_gguf_writer_add_tensor(w, t->name, ty[i], t->n_dims, t->ne, NULL, bytes);
    }
    char part[4096];
    snprintf(part, sizeof part, "%s.part", out);
    if (rc || (rc = kvt_gguf_writer_write(w, part))) return die(part, rc);
    FILE *f = fopen(part, "ab");
    if (!f) { fprintf(stderr, "synth_llama: %s: cannot append\n", part); return 1; }
    size_t cap = (size_t)1 << 24;
    uint8_t *buf = malloc(cap), zero[64] = {0};
    uint32_t a = kvt_gguf_alignment(g);
    bool ok = buf && a <= sizeof zero;
    for (size_t i = 0; i < nt && ok; i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        uint64_t bytes = kvt_ggml_type_size(ty[i], t->n_elem);
        if (ty[i] == t->type) {
            ok = fwrite(t->data, 1, bytes, f) == bytes;
        } else {
            size_t bs = kvt_ggml_type_size(ty[i], 256), per = cap / bs;
            for (uint64_t left = bytes / bs; left && ok; ) {
                size_t k = left < per ? (size_t)left : per;
                random_blocks(ty[i], buf, k);
                ok = fwrite(buf, bs, k, f) == k;
                left -= k;
            }
        }
        size_t pad = (size_t)((a - bytes % a) % a);
        ok = ok && fwrite(zero, 1, pad, f) == pad;
    }
    ok = fclose(f) == 0 && ok;
    free(buf);
    free(ty);
    kvt_gguf_writer_free(w);
    kvt_gguf_close(g);
    if (!ok || rename(part, out)) { fprintf(stderr, "synth_llama: %s: cannot write\n", out); unlink(part); return 1; }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "--sizes")) return sizes(argv[2]);
    if (argc == 4 && !strcmp(argv[1], "--imatrix")) return imatrix(argv[2], argv[3]);
    if (argc == 6 && !strcmp(argv[1], "--experts")) return experts(argv[2], argv[3], argv[4], argv[5]);
    const shape *sh = &shapes[0];
    if (argc == 5 && !strcmp(argv[1], "--shape")) {
        sh = NULL;
        for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
            if (!strcmp(argv[2], shapes[i].name)) sh = &shapes[i];
        if (!sh) { fprintf(stderr, "synth_llama: no shape %s\n", argv[2]); return 2; }
        argc -= 2;
        argv += 2;
    }
    if (argc == 3 && argv[1][0] != '-') return write_model(sh, argv[1], argv[2]);
    fprintf(stderr, "usage: synth_llama [--shape llama-124m|qwen3-0.6b|gemma3-1b|qwen3.5-0.8b|qwen3.5-0.8b-mtp|qwen3-tiny] VOCAB.gguf OUT.gguf\n"
                    "       synth_llama --sizes FILE.gguf\n"
                    "       synth_llama --imatrix FILE.gguf OUT.dat\n"
                    "       synth_llama --experts FILE.gguf OUT.gguf GATE_UP DOWN\n");
    return 2;
}
