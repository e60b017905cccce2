/* Synthetic models of the llama family for the tests (synth_family.h). */
#include "synth_family.h"
#include "format/gguf.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double gauss(uint64_t *rng)
{
    /* Box-Muller on two 53-bit uniforms, u in (0, 1] */
    double u = ((kvt_test_rand(rng) >> 11) + 1.0) / 9007199254740992.0;
    double v = (kvt_test_rand(rng) >> 11) / 9007199254740992.0;
    return sqrt(-2.0 * log(u)) * cos(2.0 * M_PI * v);
}

/* An f32 tensor of ne[0] = cols, ne[1] = rows: N(0, sigma), or all 1 when
 * sigma is 0 (a norm vector, rows 1, one dimension). */
static int add_tensor(kvt_gguf_writer *w, const char *name, uint64_t cols, uint64_t rows, double sigma, uint64_t *rng)
{
    size_t n = (size_t)(cols * rows);
    float *f = malloc(n * sizeof *f);
    if (!f) return KVT_ENOMEM;
    for (size_t i = 0; i < n; i++) f[i] = sigma ? (float)(sigma * gauss(rng)) : 1.0f;
    uint64_t ne[4] = {cols, rows, 1, 1};
    int rc = kvt_gguf_writer_add_tensor(w, name, KVT_GGML_F32, rows > 1 ? 2 : 1, ne, f, n * sizeof *f);
    free(f);
    return rc;
}

/* An f32 tensor (cols, rows, n3) of N(0, sigma): a mixture's experts. */
static int add_tensor3(kvt_gguf_writer *w, const char *name, uint64_t cols, uint64_t rows, uint64_t n3,
                       double sigma, uint64_t *rng)
{
    size_t n = (size_t)(cols * rows * n3);
    float *f = malloc(n * sizeof *f);
    if (!f) return KVT_ENOMEM;
    for (size_t i = 0; i < n; i++) f[i] = (float)(sigma * gauss(rng));
    uint64_t ne[4] = {cols, rows, n3, 1};
    int rc = kvt_gguf_writer_add_tensor(w, name, KVT_GGML_F32, 3, ne, f, n * sizeof *f);
    free(f);
    return rc;
}

/* An f32 vector of n elements base + N(0, sigma) (a bias, base 0, or a
 * norm's weights, base 1); neutral: base alone, the draws made all the same
 * (so that the tensors after it are those of the model it stands in for). */
static int add_vec(kvt_gguf_writer *w, const char *name, uint64_t n, double base, double sigma, bool neutral,
                   uint64_t *rng)
{
    float *f = malloc(n * sizeof *f);
    if (!f) return KVT_ENOMEM;
    for (size_t i = 0; i < n; i++) {
        double d = sigma * gauss(rng);
        f[i] = (float)(neutral ? base : base + d);
    }
    uint64_t ne[4] = {n, 1, 1, 1};
    int rc = kvt_gguf_writer_add_tensor(w, name, KVT_GGML_F32, 1, ne, f, n * sizeof *f);
    free(f);
    return rc;
}

/* An array of L u32 (bools when is_bool) as a family key. */
static int set_arr(kvt_gguf_writer *w, const char *key, const uint32_t *v, int n, bool is_bool)
{
    kvt_gguf_val a[16];
    for (int i = 0; i < n; i++) a[i] = (kvt_gguf_val){.type = is_bool ? KVT_GGUF_BOOL : KVT_GGUF_U32, .v.u = v[i]};
    kvt_gguf_val arr = {.type = KVT_GGUF_ARR, .elem_type = is_bool ? KVT_GGUF_BOOL : KVT_GGUF_U32, .n = (uint64_t)n,
                        .v.arr = a};
    return kvt_gguf_writer_set(w, key, &arr);
}

/* One f32 value as a tensor of one element (a layer_output_scale). */
static int add_scalar(kvt_gguf_writer *w, const char *name, float v)
{
    uint64_t ne[4] = {1, 1, 1, 1};
    return kvt_gguf_writer_add_tensor(w, name, KVT_GGML_F32, 1, ne, &v, sizeof v);
}

/* The synthetic gemma4 of synth_family.h (kind FAM_G4_DENSE or _MOE). */
static int g4_write(kvt_gguf_writer *w, const char *arch, int kind, uint64_t seed, float rope_base, bool neutral)
{
    enum { L = FAM_G4_LAYERS, N_KV = FAM_G4_LAYERS - FAM_G4_SHARED, HD_S = 64, HD_G = 128, KV_S = 4, KV_G = 1,
           ROT_S = 32, PL = FAM_G4_PL };
    const bool moe = kind == FAM_G4_MOE;
    const uint32_t pl = moe ? 0 : PL;
    uint32_t swa[L], hkv[L], ff[L];
    for (int l = 0; l < L; l++) {
        swa[l] = l % 2 == 0;
        hkv[l] = swa[l] ? KV_S : KV_G;
        ff[l] = l < N_KV ? FAM_FFN : 2 * FAM_FFN;
    }
    char k[96];
    int rc;
#define KEY(suffix) (snprintf(k, sizeof k, "%s.%s", arch, suffix), k)
    if ((rc = kvt_gguf_writer_set_u32(w, KEY("context_length"), FAM_CTX)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("embedding_length"), FAM_DIM)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("block_count"), L)) ||
        (rc = set_arr(w, KEY("feed_forward_length"), ff, L, false)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.head_count"), FAM_HEADS)) ||
        (rc = set_arr(w, KEY("attention.head_count_kv"), hkv, L, false)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.key_length"), HD_G)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.value_length"), HD_G)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.key_length_swa"), HD_S)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.value_length_swa"), HD_S)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("rope.dimension_count"), HD_G)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("rope.dimension_count_swa"), ROT_S)) ||
        (rc = kvt_gguf_writer_set_f32(w, KEY("rope.freq_base"), rope_base)) ||
        (rc = kvt_gguf_writer_set_f32(w, KEY("rope.freq_base_swa"), FAM_GEMMA_BASE_SWA)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.sliding_window"), FAM_GEMMA_SWA)) ||
        (rc = set_arr(w, KEY("attention.sliding_window_pattern"), swa, L, true)) ||
        (rc = kvt_gguf_writer_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), FAM_EPS)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("embedding_length_per_layer_input"), pl)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.shared_kv_layers"), FAM_G4_SHARED)))
        return rc;
    if (!moe && (rc = kvt_gguf_writer_set_f32(w, KEY("final_logit_softcapping"), 10.0f))) return rc;
    if (moe && ((rc = kvt_gguf_writer_set_u32(w, KEY("expert_count"), FAM_MOE_E)) ||
                (rc = kvt_gguf_writer_set_u32(w, KEY("expert_used_count"), FAM_MOE_EU)) ||
                (rc = kvt_gguf_writer_set_u32(w, KEY("expert_feed_forward_length"), FAM_MOE_F))))
        return rc;
#undef KEY
    uint64_t rng = seed;
    if ((rc = add_tensor(w, "token_embd.weight", FAM_DIM, FAM_VOCAB, FAM_SIGMA, &rng)) ||
        (rc = add_tensor(w, "output_norm.weight", FAM_DIM, 1, 0, &rng)) ||
        (rc = add_tensor(w, "output.weight", FAM_DIM, FAM_VOCAB, FAM_SIGMA, &rng)))
        return rc;
    float rf[HD_G / 2];
    for (int i = 0; i < HD_G / 2; i++) rf[i] = i < HD_G / 8 ? 1.0f : 1e30f; /* partial_rotary_factor 0.25 */
    uint64_t ne[4] = {HD_G / 2, 1, 1, 1};
    if ((rc = kvt_gguf_writer_add_tensor(w, "rope_freqs.weight", KVT_GGML_F32, 1, ne, rf, sizeof rf))) return rc;
    if (pl && ((rc = add_tensor(w, "per_layer_token_embd.weight", (uint64_t)pl * L, FAM_VOCAB, FAM_SIGMA, &rng)) ||
               (rc = add_tensor(w, "per_layer_model_proj.weight", FAM_DIM, (uint64_t)pl * L, FAM_SIGMA, &rng)) ||
               (rc = add_vec(w, "per_layer_proj_norm.weight", pl, 1.0, FAM_SIGMA_NORM, false, &rng))))
        return rc;
    for (int l = 0; l < L && !rc; l++) {
        const uint64_t hd = swa[l] ? HD_S : HD_G, QD = FAM_HEADS * hd, KVD = hkv[l] * hd;
        const bool exps = moe && l != 1;
        char name[64];
#define NAME(s) (snprintf(name, sizeof name, "blk.%d.%s", l, s), name)
        if ((rc = add_tensor(w, NAME("attn_norm.weight"), FAM_DIM, 1, 0, &rng)) ||
            (rc = add_tensor(w, NAME("attn_q.weight"), FAM_DIM, QD, FAM_SIGMA_QK, &rng)) ||
            (rc = add_tensor(w, NAME("attn_k.weight"), FAM_DIM, KVD, FAM_SIGMA_QK, &rng)) ||
            (swa[l] && (rc = add_tensor(w, NAME("attn_v.weight"), FAM_DIM, KVD, FAM_SIGMA, &rng))) ||
            (rc = add_tensor(w, NAME("attn_output.weight"), QD, FAM_DIM, FAM_SIGMA, &rng)) ||
            (rc = add_vec(w, NAME("attn_q_norm.weight"), hd, 0.3, 0.075, false, &rng)) ||
            (rc = add_vec(w, NAME("attn_k_norm.weight"), hd, 0.3, 0.075, false, &rng)) ||
            (rc = add_vec(w, NAME("post_attention_norm.weight"), FAM_DIM, 1.0, FAM_SIGMA_NORM, false, &rng)) ||
            (rc = add_tensor(w, NAME("ffn_norm.weight"), FAM_DIM, 1, 0, &rng)) ||
            (rc = add_tensor(w, NAME("ffn_gate.weight"), FAM_DIM, ff[l], FAM_SIGMA, &rng)) ||
            (rc = add_tensor(w, NAME("ffn_up.weight"), FAM_DIM, ff[l], FAM_SIGMA, &rng)) ||
            (rc = add_tensor(w, NAME("ffn_down.weight"), ff[l], FAM_DIM, FAM_SIGMA, &rng)) ||
            (rc = add_vec(w, NAME("post_ffw_norm.weight"), FAM_DIM, 1.0, FAM_SIGMA_NORM, false, &rng)))
            break;
        double u = (kvt_test_rand(&rng) >> 11) / 9007199254740992.0;
        if ((rc = add_scalar(w, NAME("layer_output_scale.weight"), neutral ? 1.0f : (float)(0.5 + 0.5 * u)))) break;
        if (exps) {
            float ds[FAM_MOE_E];
            for (int e = 0; e < FAM_MOE_E; e++) {
                double d = gauss(&rng);
                ds[e] = neutral ? 1.0f : (float)exp(0.5 * d);
            }
            uint64_t ne1[4] = {FAM_MOE_E, 1, 1, 1};
            if ((rc = add_tensor(w, NAME("ffn_gate_inp.weight"), FAM_DIM, FAM_MOE_E, FAM_SIGMA_ROUTER_G4, &rng)) ||
                (rc = add_vec(w, NAME("ffn_gate_inp.scale"), FAM_DIM, 1.0, FAM_SIGMA_NORM, neutral, &rng)) ||
                (rc = add_vec(w, NAME("pre_ffw_norm_2.weight"), FAM_DIM, 1.0, FAM_SIGMA_NORM, false, &rng)) ||
                (rc = add_vec(w, NAME("post_ffw_norm_1.weight"), FAM_DIM, 1.0, FAM_SIGMA_NORM, false, &rng)) ||
                (rc = add_vec(w, NAME("post_ffw_norm_2.weight"), FAM_DIM, 1.0, FAM_SIGMA_NORM, false, &rng)) ||
                (l % 2 == 0 &&
                 (rc = add_tensor3(w, NAME("ffn_gate_up_exps.weight"), FAM_DIM, 2 * FAM_MOE_F, FAM_MOE_E, FAM_SIGMA,
                                   &rng))) ||
                (l % 2 && ((rc = add_tensor3(w, NAME("ffn_gate_exps.weight"), FAM_DIM, FAM_MOE_F, FAM_MOE_E,
                                             FAM_SIGMA, &rng)) ||
                           (rc = add_tensor3(w, NAME("ffn_up_exps.weight"), FAM_DIM, FAM_MOE_F, FAM_MOE_E, FAM_SIGMA,
                                             &rng)))) ||
                (rc = add_tensor3(w, NAME("ffn_down_exps.weight"), FAM_MOE_F, FAM_DIM, FAM_MOE_E, FAM_SIGMA, &rng)) ||
                (l != 5 && (rc = kvt_gguf_writer_add_tensor(w, NAME("ffn_down_exps.scale"), KVT_GGML_F32, 1, ne1, ds,
                                                            sizeof ds))))
                break;
        }
        if (pl && ((rc = add_tensor(w, NAME("inp_gate.weight"), FAM_DIM, pl, FAM_SIGMA, &rng)) ||
                   (rc = add_tensor(w, NAME("proj.weight"), pl, FAM_DIM, FAM_SIGMA, &rng)) ||
                   (rc = add_vec(w, NAME("post_norm.weight"), FAM_DIM, 1.0, FAM_SIGMA_NORM, false, &rng))))
            break;
#undef NAME
    }
    return rc;
}

/* An array of n i32 as a family key (rope.dimension_sections). */
static int set_arr_i32(kvt_gguf_writer *w, const char *key, const int32_t *v, int n)
{
    kvt_gguf_val a[8];
    for (int i = 0; i < n; i++) a[i] = (kvt_gguf_val){.type = KVT_GGUF_I32, .v.i = v[i]};
    kvt_gguf_val arr = {.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_I32, .n = (uint64_t)n, .v.arr = a};
    return kvt_gguf_writer_set(w, key, &arr);
}

/* The synthetic Qwen 3.5 of synth_family.h (kind FAM_Q35_DENSE or _MOE) with
 * a vocabulary of V and a context of ctx. */
static int q35_write(kvt_gguf_writer *w, const char *arch, int kind, uint64_t seed, float rope_base, bool neutral,
                     uint64_t V, uint32_t ctx, bool mtp)
{
    enum { L = FAM_Q35_LAYERS, HD = FAM_Q35_HEAD_DIM, QD = FAM_HEADS * HD, KVD = FAM_KV_HEADS * HD,
           S = FAM_Q35_STATE, HK = FAM_Q35_HK, HV = FAM_Q35_HV, KD = HK * S, VD = HV * S, CONV = 2 * KD + VD };
    const bool moe = kind == FAM_Q35_MOE;
    uint32_t recr[L + 1];
    for (int l = 0; l < L; l++) recr[l] = (l + 1) % FAM_Q35_INTERVAL != 0;
    recr[L] = 0; /* the MTP layer (mtp) */
    static const int32_t sections[4] = {3, 3, 2, 0}; /* pairs: 8 = FAM_Q35_ROT / 2 */
    char k[96];
    int rc;
#define KEY(suffix) (snprintf(k, sizeof k, "%s.%s", arch, suffix), k)
    if ((rc = kvt_gguf_writer_set_u32(w, KEY("context_length"), ctx)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("embedding_length"), FAM_DIM)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("block_count"), L + mtp)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("feed_forward_length"), moe ? FAM_Q35_SHEXP : FAM_FFN)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.head_count"), FAM_HEADS)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.head_count_kv"), FAM_KV_HEADS)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.key_length"), HD)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.value_length"), HD)) ||
        (rc = kvt_gguf_writer_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), FAM_EPS)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("rope.dimension_count"), FAM_Q35_ROT)) ||
        (rc = set_arr_i32(w, KEY("rope.dimension_sections"), sections, 4)) ||
        (rc = kvt_gguf_writer_set_f32(w, KEY("rope.freq_base"), rope_base)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("ssm.conv_kernel"), FAM_Q35_CONV)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("ssm.state_size"), S)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("ssm.group_count"), HK)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("ssm.time_step_rank"), HV)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("ssm.inner_size"), VD)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("full_attention_interval"), FAM_Q35_INTERVAL)))
        return rc;
    if (!moe && (rc = set_arr(w, KEY("attention.recurrent_layers"), recr, L + mtp, true))) return rc;
    if (mtp && (rc = kvt_gguf_writer_set_u32(w, KEY("nextn_predict_layers"), 1))) return rc;
    if (moe && ((rc = kvt_gguf_writer_set_u32(w, KEY("expert_count"), FAM_MOE_E)) ||
                (rc = kvt_gguf_writer_set_u32(w, KEY("expert_used_count"), FAM_MOE_EU)) ||
                (rc = kvt_gguf_writer_set_u32(w, KEY("expert_feed_forward_length"), FAM_MOE_F)) ||
                (rc = kvt_gguf_writer_set_u32(w, KEY("expert_shared_feed_forward_length"), FAM_Q35_SHEXP))))
        return rc;
#undef KEY
    /* ssm_a per V head: -0.02 * 100^(h / (HV - 1)), 0 in the neutral file */
    float a[HV];
    for (int h = 0; h < HV; h++) a[h] = neutral ? 0.0f : (float)(-0.02 * pow(100.0, (double)h / (HV - 1)));
    uint64_t rng = seed;
    if ((rc = add_tensor(w, "token_embd.weight", FAM_DIM, V, FAM_SIGMA, &rng)) ||
        (rc = add_vec(w, "output_norm.weight", FAM_DIM, 1.0, FAM_SIGMA_NORM, false, &rng)) ||
        (rc = add_tensor(w, "output.weight", FAM_DIM, V, FAM_SIGMA, &rng)))
        return rc;
    for (int l = 0; l < L + mtp && !rc; l++) {
        char name[64];
#define NAME(s) (snprintf(name, sizeof name, "blk.%d.%s", l, s), name)
        if ((rc = add_vec(w, NAME("attn_norm.weight"), FAM_DIM, 1.0, FAM_SIGMA_NORM, false, &rng)) ||
            (rc = add_vec(w, NAME("post_attention_norm.weight"), FAM_DIM, 1.0, FAM_SIGMA_NORM, false, &rng)))
            break;
        if (!recr[l]) {
            if ((rc = add_tensor(w, NAME("attn_q.weight"), FAM_DIM, 2 * QD, FAM_SIGMA_QK, &rng)) ||
                (rc = add_tensor(w, NAME("attn_k.weight"), FAM_DIM, KVD, FAM_SIGMA_QK, &rng)) ||
                (rc = add_tensor(w, NAME("attn_v.weight"), FAM_DIM, KVD, FAM_SIGMA, &rng)) ||
                (rc = add_tensor(w, NAME("attn_output.weight"), QD, FAM_DIM, FAM_SIGMA, &rng)) ||
                (rc = add_vec(w, NAME("attn_q_norm.weight"), HD, 1.0, FAM_SIGMA_NORM, false, &rng)) ||
                (rc = add_vec(w, NAME("attn_k_norm.weight"), HD, 1.0, FAM_SIGMA_NORM, false, &rng)))
                break;
        } else {
            uint64_t ne[4] = {HV, 1, 1, 1};
            if ((rc = add_tensor(w, NAME("attn_qkv.weight"), FAM_DIM, CONV, FAM_SIGMA_QK, &rng)) ||
                (rc = add_tensor(w, NAME("attn_gate.weight"), FAM_DIM, VD, FAM_SIGMA, &rng)) ||
                (rc = add_tensor(w, NAME("ssm_conv1d.weight"), FAM_Q35_CONV, CONV, 0.5, &rng)) ||
                (rc = add_vec(w, NAME("ssm_dt.bias"), HV, 0.0, 0.5, false, &rng)) ||
                (rc = kvt_gguf_writer_add_tensor(w, NAME("ssm_a"), KVT_GGML_F32, 1, ne, a, sizeof a)) ||
                (rc = add_tensor(w, NAME("ssm_beta.weight"), FAM_DIM, HV, FAM_SIGMA, &rng)) ||
                (rc = add_tensor(w, NAME("ssm_alpha.weight"), FAM_DIM, HV, FAM_SIGMA, &rng)) ||
                (rc = add_vec(w, NAME("ssm_norm.weight"), S, 1.0, FAM_SIGMA_NORM, false, &rng)) ||
                (rc = add_tensor(w, NAME("ssm_out.weight"), VD, FAM_DIM, FAM_SIGMA, &rng)))
                break;
        }
        if (!moe) {
            if ((rc = add_tensor(w, NAME("ffn_gate.weight"), FAM_DIM, FAM_FFN, FAM_SIGMA, &rng)) ||
                (rc = add_tensor(w, NAME("ffn_up.weight"), FAM_DIM, FAM_FFN, FAM_SIGMA, &rng)) ||
                (rc = add_tensor(w, NAME("ffn_down.weight"), FAM_FFN, FAM_DIM, FAM_SIGMA, &rng)))
                break;
        } else if ((rc = add_tensor(w, NAME("ffn_gate_inp.weight"), FAM_DIM, FAM_MOE_E, FAM_SIGMA_ROUTER, &rng)) ||
                   (rc = add_tensor3(w, NAME("ffn_gate_exps.weight"), FAM_DIM, FAM_MOE_F, FAM_MOE_E, FAM_SIGMA,
                                     &rng)) ||
                   (rc = add_tensor3(w, NAME("ffn_up_exps.weight"), FAM_DIM, FAM_MOE_F, FAM_MOE_E, FAM_SIGMA,
                                     &rng)) ||
                   (rc = add_tensor3(w, NAME("ffn_down_exps.weight"), FAM_MOE_F, FAM_DIM, FAM_MOE_E, FAM_SIGMA,
                                     &rng)) ||
                   (rc = add_vec(w, NAME("ffn_gate_inp_shexp.weight"), FAM_DIM, 0.0, FAM_SIGMA_ROUTER, false,
                                 &rng)) ||
                   (rc = add_tensor(w, NAME("ffn_gate_shexp.weight"), FAM_DIM, FAM_Q35_SHEXP, FAM_SIGMA, &rng)) ||
                   (rc = add_tensor(w, NAME("ffn_up_shexp.weight"), FAM_DIM, FAM_Q35_SHEXP, FAM_SIGMA, &rng)) ||
                   (rc = add_tensor(w, NAME("ffn_down_shexp.weight"), FAM_Q35_SHEXP, FAM_DIM, FAM_SIGMA, &rng)))
            break;
        if (l == L && ((rc = add_tensor(w, NAME("nextn.eh_proj.weight"), 2 * FAM_DIM, FAM_DIM, FAM_SIGMA, &rng)) ||
                       (rc = add_vec(w, NAME("nextn.enorm.weight"), FAM_DIM, 1.0, FAM_SIGMA_NORM, false, &rng)) ||
                       (rc = add_vec(w, NAME("nextn.hnorm.weight"), FAM_DIM, 1.0, FAM_SIGMA_NORM, false, &rng)) ||
                       (rc = add_vec(w, NAME("nextn.shared_head_norm.weight"), FAM_DIM, 1.0, FAM_SIGMA_NORM, false,
                                     &rng))))
            break;
#undef NAME
    }
    return rc;
}

/* The synthetic model of family f (its weights from seed, in F32), with
 * vocab's tokenizer and rope.freq_base rope_base. neutral: f's own tensors
 * (biases, head norms) drawn as usual but written neutral (0, 1), the
 * negative control of the family test. The llama family draws exactly the
 * tensors it always did, in the same order. */
int fam_write(const char *path, const char *vocab, uint64_t seed, float rope_base, const fam_spec *f,
                        bool neutral)
{
    return fam_write_ctx(path, vocab, seed, rope_base, f, neutral, FAM_CTX);
}

int fam_write_ctx(const char *path, const char *vocab, uint64_t seed, float rope_base, const fam_spec *f,
                  bool neutral, uint32_t ctx)
{
    kvt_gguf *g = NULL;
    int rc = kvt_gguf_open(&g, vocab);
    if (rc) return rc;
    const kvt_gguf_val *toks = kvt_gguf_get(g, "tokenizer.ggml.tokens");
    if (!toks || toks->type != KVT_GGUF_ARR || !toks->n || toks->n > 1u << 20) {
        kvt_gguf_close(g);
        return KVT_EFORMAT;
    }
    const uint64_t V = toks->n;
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    if (!w) { kvt_gguf_close(g); return KVT_ENOMEM; }
    if (f->gemma4 || f->qwen35) {
        if (!(rc = kvt_gguf_writer_set_str(w, "general.architecture", f->arch)) &&
            !(rc = kvt_gguf_writer_set_str(w, "general.name", "kvtier peer-logits synthetic model")) &&
            !(rc = kvt_gguf_writer_set_u32(w, "general.file_type", 0)))
            for (size_t i = 0; !rc && i < kvt_gguf_n_kv(g); i++)
                if (!strncmp(kvt_gguf_key(g, i), "tokenizer.", 10))
                    rc = kvt_gguf_writer_set(w, kvt_gguf_key(g, i), kvt_gguf_val_at(g, i));
        if (!rc)
            rc = f->qwen35 ? q35_write(w, f->arch, f->qwen35, seed, rope_base, neutral, V, ctx, f->mtp)
                           : g4_write(w, f->arch, f->gemma4, seed, rope_base, neutral);
        if (!rc) rc = kvt_gguf_writer_write(w, path);
        kvt_gguf_writer_free(w);
        kvt_gguf_close(g);
        return rc;
    }
    const uint64_t QD = (uint64_t)FAM_HEADS * f->head_dim, KVD = (uint64_t)FAM_KV_HEADS * f->head_dim;
    char k[96];
#define KEY(suffix) (snprintf(k, sizeof k, "%s.%s", f->arch, suffix), k)
    /* every key kvtier's src/arch/llama.c reads, and what llama.cpp needs to
     * load the model; the defaults of the two engines are not relied on */
    if ((rc = kvt_gguf_writer_set_str(w, "general.architecture", f->arch)) ||
        (rc = kvt_gguf_writer_set_str(w, "general.name", "kvtier peer-logits synthetic model")) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("context_length"), ctx)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("embedding_length"), FAM_DIM)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("block_count"), FAM_LAYERS)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("feed_forward_length"), FAM_FFN)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.head_count"), FAM_HEADS)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("attention.head_count_kv"), FAM_KV_HEADS)) ||
        (rc = kvt_gguf_writer_set_u32(w, KEY("rope.dimension_count"), (uint32_t)f->head_dim)) ||
        (rc = kvt_gguf_writer_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), FAM_EPS)) ||
        (rc = kvt_gguf_writer_set_f32(w, KEY("rope.freq_base"), rope_base)) ||
        (rc = kvt_gguf_writer_set_u32(w, "general.file_type", 0))) /* LLAMA_FTYPE_ALL_F32 */
        goto out;
    if (f->gemma && ((rc = kvt_gguf_writer_set_u32(w, KEY("attention.sliding_window"), FAM_GEMMA_SWA)) ||
                     (rc = kvt_gguf_writer_set_u32(w, KEY("attention.sliding_window_pattern"), 2)) ||
                     (rc = kvt_gguf_writer_set_f32(w, KEY("rope.freq_base_swa"), FAM_GEMMA_BASE_SWA))))
        goto out;
    if (f->moe && ((rc = kvt_gguf_writer_set_u32(w, KEY("expert_count"), FAM_MOE_E)) ||
                   (rc = kvt_gguf_writer_set_u32(w, KEY("expert_used_count"), FAM_MOE_EU)) ||
                   (rc = kvt_gguf_writer_set_u32(w, KEY("expert_feed_forward_length"), FAM_MOE_F))))
        goto out;
    if (f->head_dim != FAM_HEAD_DIM &&
        ((rc = kvt_gguf_writer_set_u32(w, KEY("attention.key_length"), (uint32_t)f->head_dim)) ||
         (rc = kvt_gguf_writer_set_u32(w, KEY("attention.value_length"), (uint32_t)f->head_dim))))
        goto out;
#undef KEY
    for (size_t i = 0; !rc && i < kvt_gguf_n_kv(g); i++)
        if (!strncmp(kvt_gguf_key(g, i), "tokenizer.", 10))
            rc = kvt_gguf_writer_set(w, kvt_gguf_key(g, i), kvt_gguf_val_at(g, i));
    uint64_t rng = seed;
    if (rc || (rc = add_tensor(w, "token_embd.weight", FAM_DIM, V, FAM_SIGMA, &rng)) ||
        (rc = add_tensor(w, "output_norm.weight", FAM_DIM, 1, 0, &rng)) ||
        (rc = add_tensor(w, "output.weight", FAM_DIM, V, FAM_SIGMA, &rng)))
        goto out;
    if (f->rope_freqs) { /* the shape of llama 3's: 1 for the fast pairs rising to 8 for the slow ones */
        float ff[64];
        int np = f->head_dim / 2;
        for (int i = 0; i < np; i++) ff[i] = neutral ? 1.0f : 1.0f + 7.0f * (float)i / (float)(np - 1);
        uint64_t ne[4] = {(uint64_t)np, 1, 1, 1};
        if ((rc = kvt_gguf_writer_add_tensor(w, "rope_freqs.weight", KVT_GGML_F32, 1, ne, ff, np * sizeof *ff)))
            goto out;
    }
    for (int l = 0; l < FAM_LAYERS && !rc; l++) {
        const struct { const char *name; uint64_t cols, rows; double sigma; } t[] = {
            {"attn_norm", FAM_DIM, 1, 0},
            {"attn_q", FAM_DIM, QD, FAM_SIGMA_QK},
            {"attn_k", FAM_DIM, KVD, FAM_SIGMA_QK},
            {"attn_v", FAM_DIM, KVD, FAM_SIGMA},
            {"attn_output", QD, FAM_DIM, FAM_SIGMA},
            {"ffn_norm", FAM_DIM, 1, 0},
            {"ffn_gate", FAM_DIM, FAM_FFN, FAM_SIGMA},
            {"ffn_up", FAM_DIM, FAM_FFN, FAM_SIGMA},
            {"ffn_down", FAM_FFN, FAM_DIM, FAM_SIGMA},
        };
        for (size_t i = 0; i < sizeof t / sizeof t[0] && !rc; i++) {
            char name[64];
            if (f->moe && !strncmp(t[i].name, "ffn_", 4) && strcmp(t[i].name, "ffn_norm")) continue;
            snprintf(name, sizeof name, "blk.%d.%s.weight", l, t[i].name);
            rc = add_tensor(w, name, t[i].cols, t[i].rows, t[i].sigma, &rng);
        }
        if (f->moe && !rc) {
            char name[64];
            snprintf(name, sizeof name, "blk.%d.ffn_gate_inp.weight", l);
            rc = add_tensor(w, name, FAM_DIM, FAM_MOE_E, FAM_SIGMA_ROUTER, &rng);
            const struct { const char *name; uint64_t cols, rows; } x[] = {
                {"ffn_gate_exps", FAM_DIM, FAM_MOE_F},
                {"ffn_up_exps", FAM_DIM, FAM_MOE_F},
                {"ffn_down_exps", FAM_MOE_F, FAM_DIM}};
            for (size_t i = 0; i < 3 && !rc; i++) {
                snprintf(name, sizeof name, "blk.%d.%s.weight", l, x[i].name);
                rc = add_tensor3(w, name, x[i].cols, x[i].rows, FAM_MOE_E, FAM_SIGMA, &rng);
            }
        }
        char name[64];
        const char *const bn[3] = {"attn_q", "attn_k", "attn_v"};
        const uint64_t bl[3] = {QD, KVD, KVD};
        for (int i = 0; f->bias && i < 3 && !rc; i++) {
            snprintf(name, sizeof name, "blk.%d.%s.bias", l, bn[i]);
            rc = add_vec(w, name, bl[i], 0.0, FAM_SIGMA_BIAS, neutral, &rng);
        }
        const char *const nn[2] = {"attn_q_norm", "attn_k_norm"};
        for (int i = 0; f->qk_norm && i < 2 && !rc; i++) {
            snprintf(name, sizeof name, "blk.%d.%s.weight", l, nn[i]);
            rc = add_vec(w, name, (uint64_t)f->head_dim, 1.0, FAM_SIGMA_NORM, neutral && !f->gemma, &rng);
        }
        const char *const pn[2] = {"post_attention_norm", "post_ffw_norm"};
        for (int i = 0; f->gemma && i < 2 && !rc; i++) {
            snprintf(name, sizeof name, "blk.%d.%s.weight", l, pn[i]);
            rc = add_vec(w, name, FAM_DIM, 1.0, FAM_SIGMA_NORM, neutral, &rng);
        }
    }
    if (!rc) rc = kvt_gguf_writer_write(w, path);
out:
    kvt_gguf_writer_free(w);
    kvt_gguf_close(g);
    return rc;
}

