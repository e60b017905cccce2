/* kvtier's side of bench/mtp_peer.sh: the same tokens through the model
 * in one pass (the hidden states from the pass's tap, kvt_ds4_hidden),
 * then the MTP layer at positions 1..n-1 one after the other over a fresh
 * window ring, each row of logits against llama.cpp's (mtp_peer_llama's
 * OUT): the worst and mean |difference|, top-1 agreement. With LLH set
 * the layer reads llama.cpp's hidden states instead of kvtier's (the
 * layer alone compared); PER prints each position's worst difference.
 *   mtp_peer FILE.gguf OUT N */
#include "arch/ds4.h"
#include "arch/model.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(int argc, char **argv)
{
    const char *path = argv[1], *llbin = argv[2];
    int n = atoi(argv[3]);
    kvt_model *m = NULL;
    if (kvt_model_open(&m, path)) { fprintf(stderr, "%s\n", kvt_errmsg()); return 1; }
    size_t V = m->info.n_vocab, hf = kvt_ds4_hidden_floats(m);
    FILE *f = fopen(llbin, "rb");
    int32_t *t = malloc(n * 4);
    float *want = malloc((size_t)(n - 1) * V * 4), *got = malloc(V * 4);
    if (fread(t, 4, n, f) != (size_t)n || fread(want, 4, (size_t)(n - 1) * V, f) != (size_t)(n - 1) * V) return 1;
    float *HL = malloc((size_t)n * hf * 4);
    bool llh = getenv("LLH") != NULL;
    if (llh && fread(HL, 4, (size_t)n * hf, f) != (size_t)n * hf) return 1;
    fclose(f);
    kvt_session_opts so = {.n_ctx = 1024, .n_threads = 1};
    kvt_session *s = NULL;
    if (kvt_session_new(&s, m, &so) || kvt_session_sync(s, t, n, NULL)) { fprintf(stderr, "%s\n", kvt_errmsg()); return 1; }
    float *H = malloc((size_t)n * hf * 4), *hout = malloc(hf * 4);
    for (int p = 0; p < n; p++)
        if (kvt_ds4_hidden(s, p, H + (size_t)p * hf)) { fprintf(stderr, "no hidden at %d\n", p); return 1; }
    double hw = 0, hm = 0;
    for (size_t i = 0; llh && i < (size_t)n * hf; i++) { double d = fabs(H[i] - HL[i]); if (d > hw) hw = d; if (fabs(HL[i]) > hm) hm = fabs(HL[i]); }
    if (llh) { printf("hidden states: max |dh| %.3g of max |h| %.3g; the MTP layer fed llama.cpp's\n", hw, hm); memcpy(H, HL, (size_t)n * hf * 4); }
    uint16_t *ring = calloc(1, kvt_ds4_mtp_ring_bytes(m));
    double worst = 0, maxl = 0, sumd = 0; int agree = 0, worst_at = -1;
    for (int p = 0; p + 1 < n; p++) {
        if (kvt_ds4_mtp_step(s, ring, H + (size_t)p * hf, t[p + 1], p + 1, false, hout, got)) { fprintf(stderr, "%s\n", kvt_errmsg()); return 1; }
        const float *w = want + (size_t)p * V;
        size_t a = 0, b = 0;
        for (size_t v = 0; v < V; v++) {
            double d = fabs((double)got[v] - w[v]);
            if (d > worst) worst = d, worst_at = p;
            if (fabs(w[v]) > maxl) maxl = fabs(w[v]);
            sumd += d;
            if (got[v] > got[a]) a = v;
            if (w[v] > w[b]) b = v;
        }
        agree += a == b;
        double pw = 0; for (size_t v = 0; v < V; v++) { double d = fabs((double)got[v] - w[v]); if (d > pw) pw = d; }
        if (getenv("PER")) printf("%d %.3g\n", p, pw);
    }
    printf("MTP logits, %d positions of %zu: max |dlogit| %.3g (at %d) of max |logit| %.3g, mean |dlogit| %.3g; top-1 agrees %d/%d\n",
           n - 1, V, worst, worst_at, maxl, sumd / ((double)(n - 1) * V), agree, n - 1);
    return 0;
}
