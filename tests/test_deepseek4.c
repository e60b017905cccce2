/* DeepSeek-V4 files in llama.cpp's layout (general.architecture deepseek4)
 * read from their header alone: a header-only file with the real
 * DeepSeek-V4-Flash shape (every tensor record of the real file, in the real
 * types, and no tensor bytes: the file ends after its header, as a
 * download's first megabytes do) gives its shape and a cache plan whose
 * bytes the test computes on its own, through the library and through
 * `kvtier info` and `kvtier plan`. Negative controls: a damaged shape
 * (ratios too few, a ratio of 5, 3 streams, value length unequal to key
 * length), a truncated header and a plain (non-header) open all fail
 * cleanly, and a plan with one layer's ratio changed differs. */
#include "format/gguf.h"
#include "format/quant.h"
#include "session/memory.h"
#include "arch/model.h"
#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { L = 43, D = 4096, H = 64, DH = 512, DR = 64, RQ = 1024, W = 128, HI = 64, DI = 128, TOPK = 512, E = 256,
       EU = 6, FE = 2048, NHASH = 3, OG = 8, ORANK = 1024, HC = 4, V = 129280 };
#define CTX 1048576ull

/* Layers 0-1 uncompressed, then ratio 4 and 128 in turn; one more entry for
 * the prediction layer, as the released config has. */
static int ratio_of(int l) { return l < 2 ? 0 : (l % 2 == 0 ? 4 : 128); }

typedef struct damage {
    int n_ratios, bad_layer, bad_ratio, hc, value_length;
    float beta_fast;            /* ds4.c's layout: rope.scaling.yarn_beta_fast, when set */
    int vocab_off, groups;      /* ds4.c's layout: vocab_size off by this; expert_group_count */
} damage;

/* The two writers' layouts (docs/ds4.md, "ds4.c's files"): llama.cpp's
 * converter (BF16 trunk, F32 vectors and mixes, MXFP4 routed experts) and
 * ds4.c's quantiser as its two published files have them (F16 embedding,
 * mixes, compressors, indexer and router; Q8_0 attention, shared experts
 * and head; routed experts IQ2_XXS gate/up and Q2_K down, or Q4_K), with
 * the keys ds4.c's reader requires besides llama.cpp's, in the forms it
 * accepts (u64 context lengths, a u32 ratio array, f64 clamp arrays). */
enum layout { LLAMA, DS4C_Q2, DS4C_Q4 };

/* The tensor data the last header written declares: in all, and by type. */
static uint64_t declared, declared_type[KVT_MEMORY_TYPES];

static int tensor(kvt_gguf_writer *w, const char *name, uint32_t type, uint32_t nd, uint64_t a, uint64_t b,
                  uint64_t c)
{
    uint64_t ne[3] = {a, b, c}, n = a * b * c;
    declared += kvt_ggml_type_size(type, n);
    if (type < KVT_MEMORY_TYPES) declared_type[type] += kvt_ggml_type_size(type, n);
    return kvt_gguf_writer_add_tensor(w, name, type, nd, ne, NULL, kvt_ggml_type_size(type, n));
}

static int write_header_as(const char *path, damage dm, enum layout lay)
{
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    if (!w) return KVT_ENOMEM;
    declared = 0;
    memset(declared_type, 0, sizeof declared_type);
    bool ds4c = lay != LLAMA;
    int rc = kvt_gguf_writer_set_str(w, "general.architecture", "deepseek4");
    struct { const char *k; uint32_t v; } u[] = {
        {"block_count", L}, {"context_length", CTX}, {"embedding_length", D}, {"attention.head_count", H},
        {"attention.head_count_kv", 1}, {"attention.key_length", DH},
        {"attention.value_length", dm.value_length ? (uint32_t)dm.value_length : DH},
        {"rope.dimension_count", DR}, {"attention.q_lora_rank", RQ}, {"attention.sliding_window", W},
        {"attention.indexer.head_count", HI}, {"attention.indexer.key_length", DI},
        {"attention.indexer.top_k", TOPK}, {"expert_count", E}, {"expert_used_count", EU},
        {"expert_shared_count", 1}, {"expert_feed_forward_length", FE}, {"expert_gating_func", 4},
        {"hyper_connection.count", dm.hc ? (uint32_t)dm.hc : HC}, {"hyper_connection.sinkhorn_iterations", 20},
        {"hash_layer_count", NHASH}, {"attention.output_group_count", OG},
        {"attention.output_lora_rank", ORANK}, {"rope.scaling.original_context_length", 65536}};
    char key[96];
    for (size_t i = 0; i < sizeof u / sizeof u[0] && !rc; i++) {
        snprintf(key, sizeof key, "deepseek4.%s", u[i].k);
        bool wide = ds4c && (!strcmp(u[i].k, "context_length") || !strcmp(u[i].k, "rope.scaling.original_context_length"));
        kvt_gguf_val v64 = {.type = KVT_GGUF_U64, .v.u = u[i].v};
        rc = wide ? kvt_gguf_writer_set(w, key, &v64) : kvt_gguf_writer_set_u32(w, key, u[i].v);
    }
    if (ds4c) { /* the keys ds4.c's reader requires besides llama.cpp's */
        if (!rc) rc = kvt_gguf_writer_set_u32(w, "deepseek4.vocab_size", (uint32_t)(V + dm.vocab_off));
        if (!rc) rc = kvt_gguf_writer_set_f32(w, "deepseek4.rope.scaling.yarn_beta_fast", dm.beta_fast ? dm.beta_fast : 32.0f);
        if (!rc) rc = kvt_gguf_writer_set_f32(w, "deepseek4.rope.scaling.yarn_beta_slow", 1.0f);
        if (!rc) rc = kvt_gguf_writer_set_u32(w, "deepseek4.expert_group_count", (uint32_t)dm.groups);
        if (!rc) rc = kvt_gguf_writer_set_u32(w, "deepseek4.expert_group_used_count", 0);
        if (!rc) rc = kvt_gguf_writer_set_u32(w, "quantize.imatrix.entries_count", 129);
    }
    if (!rc) rc = kvt_gguf_writer_set_f32(w, "deepseek4.attention.layer_norm_rms_epsilon", 1e-6f);
    if (!rc) rc = kvt_gguf_writer_set_f32(w, "deepseek4.attention.compress_rope_freq_base", 160000.0f);
    if (!rc) rc = kvt_gguf_writer_set_str(w, "deepseek4.rope.scaling.type", "yarn");
    if (!rc) rc = kvt_gguf_writer_set_f32(w, "deepseek4.rope.scaling.factor", 16.0f);
    if (!rc) rc = kvt_gguf_writer_set_f32(w, "deepseek4.rope.freq_base", 10000.0f);
    if (!rc) rc = kvt_gguf_writer_set_f32(w, "deepseek4.hyper_connection.epsilon", 1e-6f);
    if (!rc) rc = kvt_gguf_writer_set_f32(w, "deepseek4.expert_weights_scale", 1.5f);
    if (!rc) rc = kvt_gguf_writer_set_bool(w, "deepseek4.expert_weights_norm", true);
    kvt_gguf_val cl[L];
    uint32_t ft = ds4c ? KVT_GGUF_F64 : KVT_GGUF_F32;
    for (int l = 0; l < L; l++) cl[l] = (kvt_gguf_val){.type = ft, .v.f = 10.0};
    kvt_gguf_val cla = {.type = KVT_GGUF_ARR, .elem_type = ft, .n = L, .v.arr = cl};
    if (!rc) rc = kvt_gguf_writer_set(w, "deepseek4.swiglu_clamp_exp", &cla);
    if (!rc) rc = kvt_gguf_writer_set(w, "deepseek4.swiglu_clamp_shexp", &cla);
    kvt_gguf_val r[L + 1];
    int nr = dm.n_ratios ? dm.n_ratios : L + 1;
    for (int l = 0; l < nr; l++)
        r[l] = ds4c ? (kvt_gguf_val){.type = KVT_GGUF_U32, .v.u = (uint64_t)(l == dm.bad_layer ? dm.bad_ratio : l < L ? ratio_of(l) : 0)}
                    : (kvt_gguf_val){.type = KVT_GGUF_I32, .v.i = l == dm.bad_layer ? dm.bad_ratio : l < L ? ratio_of(l) : 0};
    kvt_gguf_val ra = {.type = KVT_GGUF_ARR, .elem_type = ds4c ? KVT_GGUF_U32 : KVT_GGUF_I32, .n = (uint64_t)nr, .v.arr = r};
    if (!rc) rc = kvt_gguf_writer_set(w, "deepseek4.attention.compress_ratios", &ra);
    /* the vocabulary: V token strings */
    kvt_gguf_val *toks = calloc(V, sizeof *toks);
    char *text = malloc((size_t)V * 8);
    if (!toks || !text) rc = KVT_ENOMEM;
    for (uint32_t i = 0; i < V && !rc; i++) {
        int len = snprintf(text + (size_t)i * 8, 8, "t%u", i);
        toks[i] = (kvt_gguf_val){.type = KVT_GGUF_STR, .n = (uint64_t)len, .v.str = text + (size_t)i * 8};
    }
    kvt_gguf_val tv = {.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_STR, .n = V, .v.arr = toks};
    if (!rc) rc = kvt_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    if (!rc) rc = kvt_gguf_writer_set(w, "tokenizer.ggml.tokens", &tv);
    /* every tensor record of the real file, in its types: llama.cpp's BF16
     * trunk, MXFP4 routed experts, I32 hash table, F32 vectors; ds4.c's as
     * enum layout says. BF: the matrices in Q8_0 in ds4.c's files; F16M:
     * the F16 ones there (F32 mixes, BF16 projections in llama.cpp's); GU,
     * DN: the routed gate/up and down. */
    const uint32_t F32 = KVT_GGML_F32, I32 = 26, BF = ds4c ? KVT_GGML_Q8_0 : KVT_GGML_BF16,
                   EMB = ds4c ? KVT_GGML_F16 : KVT_GGML_BF16, F16P = ds4c ? KVT_GGML_F16 : KVT_GGML_BF16,
                   F16M = ds4c ? KVT_GGML_F16 : KVT_GGML_F32, APE = ds4c ? KVT_GGML_F16 : KVT_GGML_F32,
                   GU = lay == LLAMA ? KVT_GGML_MXFP4 : lay == DS4C_Q2 ? KVT_GGML_IQ2_XXS : KVT_GGML_Q4_K,
                   DN = lay == LLAMA ? KVT_GGML_MXFP4 : lay == DS4C_Q2 ? KVT_GGML_Q2_K : KVT_GGML_Q4_K;
    const uint32_t mix = (2 + HC) * HC;
    if (!rc) rc = tensor(w, "token_embd.weight", EMB, 2, D, V, 1);
    if (!rc) rc = tensor(w, "output_norm.weight", F32, 1, D, 1, 1);
    if (!rc) rc = tensor(w, "output.weight", BF, 2, D, V, 1);
    if (!rc) rc = tensor(w, "output_hc_fn.weight", F16M, 2, HC * D, HC, 1);
    if (!rc) rc = tensor(w, "output_hc_base.weight", F32, 1, HC, 1, 1);
    if (!rc) rc = tensor(w, "output_hc_scale.weight", F32, 1, 1, 1, 1);
    for (int l = 0; l < L && !rc; l++) {
        int ra4 = ratio_of(l), cw = (ra4 == 4 ? 2 : 1) * DH;
        struct { const char *n; uint32_t t, nd; uint64_t a, b, c; bool on; } t[] = {
            {"attn_norm.weight", F32, 1, D, 1, 1, true}, {"attn_sinks.weight", F32, 1, H, 1, 1, true},
            {"attn_q_a.weight", BF, 2, D, RQ, 1, true}, {"attn_q_a_norm.weight", F32, 1, RQ, 1, 1, true},
            {"attn_q_b.weight", BF, 2, RQ, H * DH, 1, true}, {"attn_kv.weight", BF, 2, D, DH, 1, true},
            {"attn_kv_a_norm.weight", F32, 1, DH, 1, 1, true},
            {"attn_output_a.weight", BF, 2, H * DH / OG, ORANK * OG, 1, true},
            {"attn_output_b.weight", BF, 2, OG * ORANK, D, 1, true},
            {"hc_attn_fn.weight", F16M, 2, HC * D, mix, 1, true}, {"hc_attn_base.weight", F32, 1, mix, 1, 1, true},
            {"hc_attn_scale.weight", F32, 1, 3, 1, 1, true}, {"hc_ffn_fn.weight", F16M, 2, HC * D, mix, 1, true},
            {"hc_ffn_base.weight", F32, 1, mix, 1, 1, true}, {"hc_ffn_scale.weight", F32, 1, 3, 1, 1, true},
            {"attn_compressor_kv.weight", F16P, 2, D, cw, 1, ra4 != 0},
            {"attn_compressor_gate.weight", F16P, 2, D, cw, 1, ra4 != 0},
            {"attn_compressor_ape.weight", APE, 2, cw, ra4 ? ra4 : 1, 1, ra4 != 0},
            {"attn_compressor_norm.weight", F32, 1, DH, 1, 1, ra4 != 0},
            {"indexer.proj.weight", F16P, 2, D, HI, 1, ra4 == 4},
            {"indexer.attn_q_b.weight", F16P, 2, RQ, HI * DI, 1, ra4 == 4},
            {"indexer_compressor_kv.weight", F16P, 2, D, 2 * DI, 1, ra4 == 4},
            {"indexer_compressor_gate.weight", F16P, 2, D, 2 * DI, 1, ra4 == 4},
            {"indexer_compressor_ape.weight", APE, 2, 2 * DI, 4, 1, ra4 == 4},
            {"indexer_compressor_norm.weight", F32, 1, DI, 1, 1, ra4 == 4},
            {"ffn_gate_inp.weight", F16P, 2, D, E, 1, true},
            {"ffn_gate_tid2eid.weight", I32, 2, EU, V, 1, l < NHASH},
            {"exp_probs_b.bias", F32, 1, E, 1, 1, l >= NHASH}, {"ffn_norm.weight", F32, 1, D, 1, 1, true},
            {"ffn_gate_exps.weight", GU, 3, D, FE, E, true}, {"ffn_down_exps.weight", DN, 3, FE, D, E, true},
            {"ffn_up_exps.weight", GU, 3, D, FE, E, true}, {"ffn_gate_shexp.weight", BF, 2, D, FE, 1, true},
            {"ffn_down_shexp.weight", BF, 2, FE, D, 1, true}, {"ffn_up_shexp.weight", BF, 2, D, FE, 1, true}};
        for (size_t i = 0; i < sizeof t / sizeof t[0] && !rc; i++) {
            if (!t[i].on) continue;
            char nm[96];
            snprintf(nm, sizeof nm, "blk.%d.%s", l, t[i].n);
            rc = tensor(w, nm, t[i].t, t[i].nd, t[i].a, t[i].b, t[i].c);
        }
    }
    if (!rc) rc = kvt_gguf_writer_write(w, path);
    kvt_gguf_writer_free(w);
    free(toks);
    free(text);
    return rc;
}

static int write_header(const char *path, damage dm) { return write_header_as(path, dm, LLAMA); }

/* The plan by the formula (docs/ds4.md, Cache geometry), computed here. */
static kvt_plan expected_plan(int changed_layer)
{
    kvt_plan p = {0};
    for (int l = 0; l < L; l++) {
        int r = ratio_of(l);
        if (l == changed_layer) r = r == 4 ? 128 : 4;
        kvt_plan_add(&p, "window", (uint64_t)W * DH * 2, true);
        if (r) {
            kvt_plan_add(&p, "compressed", CTX / r * DH * 2, false);
            kvt_plan_add(&p, "frontier", r == 4 ? 8ull * 2 * (2 * DH) * 4 : 128ull * 2 * DH * 4, true);
            p.per_token_x1000 += 1000ull * DH * 2 / r;
        }
        if (r == 4) {
            kvt_plan_add(&p, "indexer", CTX / 4 * DI * 2, false);
            kvt_plan_add(&p, "frontier", 8ull * 2 * (2 * DI) * 4, true);
            p.per_token_x1000 += 1000ull * DI * 2 / 4;
        }
    }
    return p;
}

/* The same parts by name (each of a's in b and each of b's in a, with the
 * same bytes) and the same sums. */
static bool same_plan(const kvt_plan *a, const kvt_plan *b)
{
    const kvt_plan *pair[2][2] = {{a, b}, {b, a}};
    for (int k = 0; k < 2; k++)
        for (size_t i = 0; i < pair[k][0]->n_parts; i++)
            if (pair[k][0]->part[i].bytes != kvt_plan_bytes(pair[k][1], pair[k][0]->part[i].name)) return false;
    return a->fixed == b->fixed && a->total == b->total && a->per_token_x1000 == b->per_token_x1000;
}

/* info's figures at CTX (a) and 2 CTX (b) against the header written and
 * the plan expected at CTX: the mapped bytes are the tensor data the header
 * declares, the KV total is every class's sum and the plan's, the growing
 * part doubles with the context, and the resident estimate adds up. */
static bool memory_ok(const kvt_memory *a, const kvt_memory *b, const kvt_plan *want)
{
    uint64_t parts = 0;
    for (size_t i = 0; i < a->kv.n_parts; i++) parts += a->kv.part[i].bytes;
    bool types = true;
    for (int t = 0; t < KVT_MEMORY_TYPES; t++) types &= a->mapped_type[t] == declared_type[t];
    return a->ctx == CTX && b->ctx == 2 * CTX && a->mapped == declared && types &&
           a->n_tensors > 1000 && a->kv.total == want->total && parts == a->kv.total && b->kv.total > a->kv.total &&
           b->kv.total - b->kv.fixed == 2 * (a->kv.total - a->kv.fixed) && a->scratch_known && !a->scratch_measured &&
           a->scratch > (1u << 20) && b->scratch >= a->scratch &&
           a->resident == a->kv.total + a->scratch + a->arrays && a->arrays == CTX * 4 + V * 4;
}

/* The binary's stdout and stderr; *st its exit status. */
static char *run_all(const char *args, int *st)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s %s 2>&1", kvt_test_bin(), args);
    FILE *f = popen(cmd, "r");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (buf) n = fread(buf, 1, cap - 1, f);
    *st = pclose(f);
    if (buf) buf[n] = 0;
    return buf;
}

static char *run_out(const char *args)
{
    int st = 0;
    char *buf = run_all(args, &st);
    if (st != 0 && buf) buf[0] = 0; /* a failure reads as no output */
    return buf;
}

TEST(deepseek4_header_flash_shape)
{
    char path[] = "/tmp/kvt-dsv4-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    CHECKF(write_header(path, (damage){.bad_layer = -1}) == KVT_OK, "%s", kvt_errmsg());
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fclose(f);
    /* the records of 1,400-odd tensors and 129,280 tokens, no weights */
    CHECKF(size > 0 && size < 8 << 20, "header-only file of %ld bytes", size);

    kvt_model_info in;
    kvt_plan p;
    char detail[512];
    CHECKF(kvt_model_describe(path, CTX, &in, detail, sizeof detail, &p) == KVT_OK, "%s", kvt_errmsg());
    printf("    %s: %ld bytes; %s\n", in.arch, size, detail);
    CHECK(!strcmp(in.arch, "deepseek4"));
    CHECK(in.n_layer == L && in.n_embd == D && in.n_head == H && in.head_dim == DH && in.n_vocab == V);
    CHECK(in.n_ctx_train == CTX && in.n_ff == FE);
    /* 284B parameters: DeepSeek-V4-Flash's published count, give or take
     * the prediction layer the file leaves out */
    CHECKF(in.n_params > 270000000000ull && in.n_params < 290000000000ull, "%llu parameters",
           (unsigned long long)in.n_params);
    CHECK(strstr(detail, "experts 256 (6 used, 1 shared, first 3 layers hash-routed)") != NULL);
    CHECK(strstr(detail, "0/4/128: 2/21/20") != NULL);
    kvt_plan want = expected_plan(-1), other = expected_plan(10);
    CHECK(same_plan(&p, &want));
    CHECK(!same_plan(&p, &other)); /* the comparison sees one layer's ratio */
    printf("    plan at %llu tokens: %llu bytes (%.1f per token)\n", CTX, (unsigned long long)p.total,
           p.per_token_x1000 / 1000.0);

    /* what a run needs in memory, from the header alone */
    kvt_memory mm, mm2;
    CHECKF(kvt_model_memory(path, NULL, CTX, 0, &mm) == KVT_OK, "%s", kvt_errmsg());
    CHECKF(kvt_model_memory(path, NULL, 2 * CTX, 0, &mm2) == KVT_OK, "%s", kvt_errmsg());
    CHECKF(memory_ok(&mm, &mm2, &want), "mapped %llu of %llu declared, kv %llu (want %llu), at 2x %llu",
           (unsigned long long)mm.mapped, (unsigned long long)declared, (unsigned long long)mm.kv.total,
           (unsigned long long)want.total, (unsigned long long)mm2.kv.total);
    printf("    info: %llu B mapped (%llu MXFP4), kv %llu B at %llu tokens, %llu B at %llu\n",
           (unsigned long long)mm.mapped, (unsigned long long)declared_type[KVT_GGML_MXFP4],
           (unsigned long long)mm.kv.total, CTX, (unsigned long long)mm2.kv.total, 2 * CTX);
    /* the check sees a class left out of the KV sum */
    kvt_memory_fault = KVT_MEMORY_FAULT_DROP_PART;
    kvt_memory bad1, bad2;
    int fr = kvt_model_memory(path, NULL, CTX, 0, &bad1) | kvt_model_memory(path, NULL, 2 * CTX, 0, &bad2);
    kvt_memory_fault = 0;
    CHECK(fr == KVT_OK && !memory_ok(&bad1, &bad2, &want));

    /* a plain open wants the weights' bytes in the file */
    kvt_model *m = NULL;
    CHECK(kvt_model_open(&m, path) == KVT_EFORMAT && m == NULL);
    CHECK(strstr(kvt_errmsg(), "past the end") != NULL);
    kvt_gguf *g = NULL;
    CHECK(kvt_gguf_open(&g, path) == KVT_EFORMAT && g == NULL);

    /* the CLI */
    if (access(kvt_test_bin(), X_OK) == 0) {
        char args[256];
        snprintf(args, sizeof args, "info --model %s", path);
        char *o = run_out(args);
        CHECK(o && strstr(o, "architecture  deepseek4") && strstr(o, "layers        43"));
        free(o);
        snprintf(args, sizeof args, "plan --model %s --ctx %llu", path, CTX);
        o = run_out(args);
        char line[96];
        snprintf(line, sizeof line, "%20llu B", (unsigned long long)want.total);
        CHECKF(o && strstr(o, line), "plan output: %.400s", o ? o : "(none)");
        free(o);
        /* info prints the same figures; the weights exceed this machine */
        for (int k = 1; k <= 2; k++) {
            const kvt_memory *x = k == 1 ? &mm : &mm2;
            snprintf(args, sizeof args, "info --model %s --ctx %llu", path, k * CTX);
            o = run_out(args);
            char want_l[3][128];
            snprintf(want_l[0], sizeof want_l[0], "mapped        %llu B", (unsigned long long)x->mapped);
            snprintf(want_l[1], sizeof want_l[1], "kv cache      %llu B at %llu tokens", (unsigned long long)x->kv.total,
                     k * CTX);
            snprintf(want_l[2], sizeof want_l[2], "resident      %llu B", (unsigned long long)x->resident);
            for (int j = 0; j < 3; j++) CHECKF(o && strstr(o, want_l[j]), "no '%s' in: %.1200s", want_l[j], o ? o : "");
            CHECK(strstr(o, "mxfp4 ") || strstr(o, "MXFP4 "));
            uint64_t avail = kvt_mem_available();
            if (avail && x->mapped > avail + (1ull << 30))
                CHECKF(strstr(o, "are larger than the available memory"), "%.1200s", o);
            free(o);
        }
        /* run says so at start, before the open refuses this header-only file */
        uint64_t avail = kvt_mem_available();
        if (avail && mm.mapped > avail + (1ull << 30)) {
            int st = 0;
            snprintf(args, sizeof args, "run --model %s --prompt hi --max-tokens 1", path);
            o = run_all(args, &st);
            CHECKF(o && st != 0 && strstr(o, "are larger than the available memory") &&
                       strstr(o, "the run goes on with their pages read from the file") && strstr(o, "past the end"),
                   "status %d: %.1200s", st, o ? o : "");
            free(o);
        }
    }

    /* the note itself: only when the mapped weights exceed a known figure */
    char note[256];
    kvt_memory t = {.mapped = 10ull << 30, .available = 4ull << 30};
    CHECK(kvt_memory_note(&t, note, sizeof note) && strstr(note, "10.00 GiB") && strstr(note, "4.00 GiB"));
    t.available = 10ull << 30;
    CHECK(!kvt_memory_note(&t, note, sizeof note) && !note[0]);
    t.available = 0;
    CHECK(!kvt_memory_note(&t, note, sizeof note) && !note[0]);
    /* from the header alone (the mapped bytes and MemAvailable, no plan or
     * scratch): the same note as from the whole figures, when the
     * available memory is known and a GiB or more away from the weights */
    uint64_t avail = kvt_mem_available();
    if (avail && (mm.mapped > avail + (1ull << 30) || mm.mapped + (1ull << 30) < avail)) {
        char full[256], gib[32];
        kvt_memory at = mm;
        at.available = avail;
        bool want_note = kvt_memory_note(&at, full, sizeof full);
        snprintf(gib, sizeof gib, "(%.2f GiB,", mm.mapped / 1073741824.0);
        CHECKF(kvt_model_memory_note(path, NULL, note, sizeof note) == want_note &&
                   (!want_note || strstr(note, gib)),
               "want %s (%s): '%s'", want_note ? "a note" : "none", gib, note);
    }

    /* truncated inside the header: every cut is a clean format error */
    f = fopen(path, "rb");
    CHECK(f != NULL);
    char *all = malloc((size_t)size);
    CHECK(all && fread(all, 1, (size_t)size, f) == (size_t)size);
    fclose(f);
    for (long cut = 16; cut < size; cut = cut * 3 + 7) {
        f = fopen(path, "wb");
        CHECK(f && fwrite(all, 1, (size_t)cut, f) == (size_t)cut);
        fclose(f);
        int rc = kvt_model_describe(path, CTX, &in, NULL, 0, &p);
        CHECKF(rc == KVT_EFORMAT, "cut at %ld: %d (%s)", cut, rc, kvt_errmsg());
    }
    free(all);

    const damage bad[] = {{.n_ratios = L - 1, .bad_layer = -1}, {.bad_layer = 7, .bad_ratio = 5},
                          {.bad_layer = -1, .hc = 3}, {.bad_layer = -1, .value_length = 256}};
    const char *why[] = {"compress ratios for", "compression ratio 5", "streams 3", "key/value length 512/256"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECKF(write_header(path, bad[i]) == KVT_OK, "%s", kvt_errmsg());
        int rc = kvt_model_describe(path, CTX, &in, NULL, 0, &p);
        CHECKF(rc == KVT_EFORMAT && strstr(kvt_errmsg(), why[i]), "damage %zu: %d (%s)", i, rc, kvt_errmsg());
    }
    unlink(path);
}

/* The scratch sized from a header is the scratch a session makes: a ds4
 * file's estimate against the scratch of a session of the model opened from
 * it, at several contexts (within the allocator's rounding, 1%). */
TEST(deepseek4_scratch_estimate_is_sessions)
{
    char path[] = "/tmp/kvt-dsest-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    kvt_model *m = NULL;
    CHECKF(kvt_model_preset(&m, "ds4-tiny", 1, NULL) == KVT_OK && kvt_model_save(m, path) == KVT_OK, "%s",
           kvt_errmsg());
    kvt_model_close(m);
    m = NULL;
    CHECKF(kvt_model_open(&m, path) == KVT_OK, "%s", kvt_errmsg());
    for (uint32_t ctx = 1024; ctx <= 16384; ctx *= 4) {
        kvt_session *s = NULL;
        kvt_session_opts so = {.n_ctx = ctx, .n_threads = 2};
        CHECKF(kvt_session_new(&s, m, &so) == KVT_OK, "%s", kvt_errmsg());
        uint64_t have = kvt_session_scratch_bytes(m, s->work), est = 0;
        kvt_session_free(s);
        CHECKF(kvt_model_scratch_estimate(path, ctx, 2, &est) == KVT_OK, "%s", kvt_errmsg());
        printf("    ctx %u: scratch %llu B, from the header %llu B\n", ctx, (unsigned long long)have,
               (unsigned long long)est);
        CHECKF(est <= have && have - est <= have / 100, "ctx %u: %llu B made, %llu B estimated", ctx,
               (unsigned long long)have, (unsigned long long)est);
    }
    kvt_model_close(m);
    unlink(path);
}

TEST(deepseek4_describe_other_files)
{
    /* a preset name or a file of an architecture kvtier runs is not
     * described from its header: the caller opens it */
    kvt_model_info in;
    CHECK(kvt_model_describe("ds4-tiny", 100, &in, NULL, 0, NULL) == KVT_ENOENT);
    if (access("../shared/models/stories260K.gguf", R_OK) == 0)
        CHECK(kvt_model_describe("../shared/models/stories260K.gguf", 100, &in, NULL, 0, NULL) == KVT_ENOENT);
}

/* ds4.c's own files (antirez/ds4: DeepSeek-V4-Flash in IQ2_XXS/Q2_K and in
 * Q4_K routed experts) read from the header alone as llama.cpp's are: the
 * same shape, parameters and cache plan, info's mapped bytes equal to the
 * tensor data declared, type by type, and the KV cache at the context
 * asked. The keys ds4.c's reader requires besides llama.cpp's are checked,
 * not ignored: a YaRN correction, a vocabulary size or expert groups other
 * than what kvtier computes with are refused, by the library and by
 * `kvtier info` (which, without that check, describes such a file as if it
 * were Flash). */
TEST(deepseek4_header_ds4c_layout)
{
    char path[] = "/tmp/kvt-dsv4c-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    /* the llama.cpp layout's figures, which ds4.c's must match */
    kvt_model_info ref;
    kvt_plan refp;
    CHECKF(write_header(path, (damage){.bad_layer = -1}) == KVT_OK, "%s", kvt_errmsg());
    CHECKF(kvt_model_describe(path, CTX, &ref, NULL, 0, &refp) == KVT_OK, "%s", kvt_errmsg());
    const kvt_plan want = expected_plan(-1);
    static const struct { enum layout lay; const char *name; uint32_t gu, dn; double lo, hi; } v[] = {
        /* ds4.c's download_model.sh: "about 81 GB" and "about 153 GB" on
         * disk, in GiB as du -h counts */
        {DS4C_Q2, "IQ2_XXS/Q2_K", KVT_GGML_IQ2_XXS, KVT_GGML_Q2_K, 79.0 * (1 << 30), 83.0 * (1 << 30)},
        {DS4C_Q4, "Q4_K", KVT_GGML_Q4_K, KVT_GGML_Q4_K, 150.0 * (1 << 30), 157.0 * (1 << 30)}};
    for (size_t k = 0; k < sizeof v / sizeof v[0]; k++) {
        CHECKF(write_header_as(path, (damage){.bad_layer = -1}, v[k].lay) == KVT_OK, "%s", kvt_errmsg());
        kvt_model_info in;
        kvt_plan p;
        char detail[512];
        CHECKF(kvt_model_describe(path, CTX, &in, detail, sizeof detail, &p) == KVT_OK, "%s: %s", v[k].name,
               kvt_errmsg());
        CHECK(!strcmp(in.arch, "deepseek4") && in.n_layer == ref.n_layer && in.n_embd == ref.n_embd &&
              in.n_head == ref.n_head && in.head_dim == ref.head_dim && in.n_vocab == ref.n_vocab &&
              in.n_ctx_train == ref.n_ctx_train && in.n_ff == ref.n_ff && in.n_params == ref.n_params);
        CHECK(strstr(detail, "experts 256 (6 used, 1 shared, first 3 layers hash-routed)") != NULL);
        CHECK(same_plan(&p, &want) && same_plan(&p, &refp));
        kvt_memory mm, mm2;
        CHECKF(kvt_model_memory(path, NULL, CTX, 0, &mm) == KVT_OK, "%s", kvt_errmsg());
        CHECKF(kvt_model_memory(path, NULL, 2 * CTX, 0, &mm2) == KVT_OK, "%s", kvt_errmsg());
        CHECKF(memory_ok(&mm, &mm2, &want), "%s: mapped %llu of %llu declared", v[k].name,
               (unsigned long long)mm.mapped, (unsigned long long)declared);
        CHECK(mm.mapped_type[v[k].gu] > 0 && mm.mapped_type[v[k].dn] > 0 && mm.mapped_type[KVT_GGML_F16] > 0 &&
              mm.mapped_type[KVT_GGML_Q8_0] > 0 && mm.mapped_type[KVT_GGML_MXFP4] == 0);
        CHECKF(mm.mapped > v[k].lo && mm.mapped < v[k].hi, "%s: %llu B mapped", v[k].name,
               (unsigned long long)mm.mapped);
        printf("    ds4.c %s: %llu B mapped (experts %llu + %llu B), kv %llu B at %llu tokens, resident %llu B\n",
               v[k].name, (unsigned long long)mm.mapped, (unsigned long long)mm.mapped_type[v[k].gu],
               v[k].gu == v[k].dn ? 0ull : (unsigned long long)mm.mapped_type[v[k].dn],
               (unsigned long long)mm.kv.total, CTX, (unsigned long long)mm.resident);
        if (access(kvt_test_bin(), X_OK) == 0) {
            char args[256], line[3][128];
            snprintf(args, sizeof args, "info --model %s --ctx %llu", path, CTX);
            char *o = run_out(args);
            snprintf(line[0], sizeof line[0], "mapped        %llu B", (unsigned long long)mm.mapped);
            snprintf(line[1], sizeof line[1], "kv cache      %llu B at %llu tokens", (unsigned long long)mm.kv.total, CTX);
            snprintf(line[2], sizeof line[2], "resident      %llu B", (unsigned long long)mm.resident);
            if (!o || !o[0]) { /* the refusal's reason, for the message below */
                int st = 0;
                free(o);
                o = run_all(args, &st);
            }
            for (int j = 0; j < 3; j++) CHECKF(o && strstr(o, line[j]), "no '%s' in: %.1200s", line[j], o ? o : "");
            CHECKF(o && strstr(o, kvt_quant_name(v[k].gu)) && strstr(o, kvt_quant_name(v[k].dn)), "%.1200s", o ? o : "");
            free(o);
            snprintf(args, sizeof args, "plan --model %s --ctx %llu", path, CTX);
            o = run_out(args);
            snprintf(line[0], sizeof line[0], "%20llu B", (unsigned long long)want.total);
            CHECKF(o && strstr(o, line[0]), "plan output: %.400s", o ? o : "(none)");
            free(o);
        }
    }
    /* ds4.c's keys are read: values kvtier does not compute with are refused */
    const damage bad[] = {{.bad_layer = -1, .beta_fast = 16.0f}, {.bad_layer = -1, .vocab_off = 1},
                          {.bad_layer = -1, .groups = 8}};
    const char *why[] = {"yarn_beta_fast is 16", "vocab_size is 129281", "expert_group_count is 8"};
    const int code[] = {KVT_EUNSUPPORTED, KVT_EFORMAT, KVT_EUNSUPPORTED};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECKF(write_header_as(path, bad[i], DS4C_Q2) == KVT_OK, "%s", kvt_errmsg());
        kvt_model_info in;
        int rc = kvt_model_describe(path, CTX, &in, NULL, 0, NULL);
        CHECKF(rc == code[i] && strstr(kvt_errmsg(), why[i]), "damage %zu: %d (%s)", i, rc, kvt_errmsg());
        if (access(kvt_test_bin(), X_OK) == 0) {
            char args[256];
            int st = 0;
            snprintf(args, sizeof args, "info --model %s", path);
            char *o = run_all(args, &st);
            CHECKF(o && st != 0 && strstr(o, why[i]), "info on damage %zu: status %d: %.600s", i, st, o ? o : "");
            free(o);
        }
    }
    unlink(path);
}
