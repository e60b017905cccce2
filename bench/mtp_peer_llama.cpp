// llama.cpp's side of bench/mtp_peer.sh: a deepseek4 GGUF with an MTP
// layer, n tokens (a fixed pseudo-random sequence under 100,000) through
// the model in one batch with the hidden states kept (the staging API
// llama_set_embeddings_nextn), then the pairs (hidden state of p, token at
// p + 1) at positions 1..n-1 through an MTP context (LLAMA_CONTEXT_TYPE_MTP)
// in one batch, as common/speculative.cpp's draft-mtp places them. Writes
// OUT: the n token ids (i32), the n - 1 rows of MTP logits, the n hidden
// states (f32).
//   mtp_peer_llama FILE.gguf N OUT
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
void llama_set_embeddings_nextn(llama_context *, bool, bool);
float *llama_get_embeddings_nextn_ith(llama_context *, int32_t);
int main(int argc, char **argv) {
    const char *path = argv[1]; int n = atoi(argv[2]); const char *out = argv[3];
    llama_backend_init();
    auto mp = llama_model_default_params(); mp.n_gpu_layers = 0; mp.load_mtp = true; mp.use_extra_bufts = false;
    llama_model *m = llama_model_load_from_file(path, mp);
    if (!m) { fprintf(stderr, "load failed\n"); return 1; }
    fprintf(stderr, "nextn layers %d\n", llama_model_n_layer_nextn(m));
    auto cp = llama_context_default_params(); cp.n_ctx = 1024; cp.n_batch = cp.n_ubatch = 1024; cp.n_threads = cp.n_threads_batch = 1;
    llama_context *ctx = llama_init_from_model(m, cp);
    llama_set_embeddings_nextn(ctx, true, false);
    std::vector<llama_token> t(n);
    uint64_t s = 12345; for (int i = 0; i < n; i++) { s = s * 6364136223846793005ull + 1442695040888963407ull; t[i] = (llama_token)((s >> 33) % 100000); }
    llama_batch b = llama_batch_get_one(t.data(), n);
    if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 1; }
    int ne = llama_model_n_embd_out(m);
    fprintf(stderr, "n_embd_out %d\n", ne);
    std::vector<float> H((size_t)n * ne);
    for (int i = 0; i < n; i++) memcpy(H.data() + (size_t)i * ne, llama_get_embeddings_nextn_ith(ctx, i), ne * 4);
    auto cp2 = cp; cp2.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    llama_context *c2 = llama_init_from_model(m, cp2);
    if (!c2) { fprintf(stderr, "mtp ctx failed\n"); return 1; }
    llama_set_embeddings_nextn(c2, true, true);
    llama_batch b2 = {}; int k = n - 1;
    b2.n_tokens = k; b2.token = (llama_token*)calloc(k, 4); b2.embd = (float*)calloc((size_t)k * ne, 4);
    b2.pos = (llama_pos*)calloc(k, 4); b2.n_seq_id = (int32_t*)calloc(k, 4); b2.seq_id = (llama_seq_id**)calloc(k, sizeof(void*)); b2.logits = (int8_t*)calloc(k, 1);
    static llama_seq_id zero = 0;
    for (int p = 0; p < k; p++) { b2.token[p] = t[p + 1]; memcpy(b2.embd + (size_t)p * ne, H.data() + (size_t)p * ne, ne * 4); b2.pos[p] = p + 1; b2.n_seq_id[p] = 1; b2.seq_id[p] = &zero; b2.logits[p] = 1; }
    if (llama_decode(c2, b2)) { fprintf(stderr, "mtp decode failed\n"); return 1; }
    int nv = llama_vocab_n_tokens(llama_model_get_vocab(m));
    FILE *f = fopen(out, "wb");
    fwrite(t.data(), 4, n, f);
    for (int p = 0; p < k; p++) fwrite(llama_get_logits_ith(c2, p), 4, nv, f);
    fwrite(H.data(), 4, (size_t)n * ne, f);
    fclose(f);
    fprintf(stderr, "ok %d rows of %d\n", k, nv);
    return 0;
}
