/* Qwen 3.5's MTP (nextn) layer: the parts of its arithmetic that need no
 * scratch of llama.c's (which runs them: the rows of every forward pass,
 * mtp_rows_pass, and the drafter's steps, llama_mtp_step).
 *
 * As llama.cpp's qwen35 MTP graph: the row of position q pairs the token at
 * q with the model's h_nextn of q - 1 (output_norm of its final residual;
 * zeros before position 0): x = eh_proj [enorm(embedding), hnorm(h)], then
 * a gated full-attention layer over the layer's own K and V of every
 * position up to q, its FFN, and the head norm: the h_nextn that chains the
 * next step, whose projection by the head gives the logits of the token at
 * q + 1. With mtp_rows (kvt_model_set_mtp_rows) a session keeps the layer's
 * K and V of every position it holds in a stream pair of its own, written
 * by each forward pass, and the last position's h_nextn in its state:
 * snapshots, rollbacks, the disk store carry them as any rows and state. A
 * row needs only eh_proj, the norms, K and V. The drafter's steps read
 * those rows for the positions the session holds and a ring of their own
 * chained guesses' rows for the ones after. Each step here is one token's
 * on its own, in a fixed order: the rows' bytes do not depend on how the
 * tokens were chunked or batched. */
#include "arch/llama_mtp.h"
#include "cache/rows.h"
#include "format/quant.h"

#include <math.h>
#include <string.h>

/* The layer's input of a token and the h_nextn before it: [enorm(its
 * embedding), hnorm(h)] into cat (2D). */
void kvt_llama_mtp_input(const kvt_llama_weights *w, float *cat, int32_t tok, const float *h)
{
    size_t D = w->D;
    const kvt_wmat *te = w->mtp_embd.data ? &w->mtp_embd : &w->tok_embd; /* as llama.cpp: its own rows if any */
    kvt_quant_to_f32(te->type, te->data + (size_t)tok * te->row_bytes, cat, D);
    kvt_rmsnorm(cat, cat, w->enorm, D, w->eps);
    kvt_rmsnorm(cat + D, h, w->hnorm, D, w->eps);
}

/* A token's queries (nq heads; 0: none) and K (head norms, RoPE at pos),
 * then K and V rounded to the rows' types, as the main layers'. */
void kvt_llama_mtp_qkv(const kvt_llama_weights *w, float *q, size_t nq, float *k, float *v, size_t pos)
{
    const kvt_llama_layer *ly = w->mtp;
    size_t hd = ly->hd;
    for (size_t h = 0; h < nq; h++) kvt_rmsnorm(q + h * hd, q + h * hd, ly->qn, hd, w->eps);
    for (size_t h = 0; h < ly->Hkv; h++) kvt_rmsnorm(k + h * hd, k + h * hd, ly->kn, hd, w->eps);
    kvt_rope_heads(nq ? q : k, nq ? nq : ly->Hkv, nq ? k : NULL, nq ? ly->Hkv : 0, hd, ly->n_rot, pos, ly->base,
                   ly->ff, w->fam->neox);
    kvt_rows_round(w->type_k, k, ly->KV);
    kvt_rows_round(w->type_v, v, ly->KV);
}

/* The MTP layer's attention of one token (queries q, its row at pos in the
 * ring already) over the rows of positions 0..pos: the session's stream
 * below s->n, the ring from there; gated; into out (QD). */
void kvt_llama_mtp_attend(const kvt_session *s, const kvt_llama_weights *w, const uint8_t *ring, const float *q,
                          const float *gate, size_t pos, float *sc, float *out)
{
    const kvt_llama_layer *ly = w->mtp;
    size_t hd = ly->hd, group = ly->H / ly->Hkv, st = kvt_llama_mtp_stream(w);
    size_t rk = kvt_rows_bytes(w->type_k, ly->KV), rv = kvt_rows_bytes(w->type_v, ly->KV);
    size_t hk = kvt_rows_bytes(w->type_k, hd), hv = kvt_rows_bytes(w->type_v, hd);
    float row[1024]; /* a head (hd <= 1024: llama_weights.c) */
    for (size_t h = 0; h < ly->H; h++) {
        size_t kvh = h / group;
        const float *qh = q + h * hd;
        float mx = -INFINITY, z = 0;
        for (size_t j = 0; j <= pos; j++) {
            const uint8_t *r = j < s->n ? kvt_cache_row_ro(s->cache, st, j) : ring + j % KVT_LLAMA_MTP_RING * (rk + rv);
            kvt_rows_get(w->type_k, row, r + kvh * hk, hd);
            sc[j] = kvt_dot(qh, row, hd) * w->scale;
            mx = sc[j] > mx ? sc[j] : mx;
        }
        for (size_t j = 0; j <= pos; j++) z += sc[j] = kvt_expf(sc[j] - mx);
        float *o = out + h * hd;
        memset(o, 0, hd * sizeof(float));
        for (size_t j = 0; j <= pos; j++) {
            const uint8_t *r =
                j < s->n ? kvt_cache_row_ro(s->cache, st + 1, j) : ring + j % KVT_LLAMA_MTP_RING * (rk + rv) + rk;
            kvt_rows_get(w->type_v, row, r + kvh * hv, hd);
            float p = sc[j] / z;
            for (size_t e = 0; e < hd; e++) o[e] += p * row[e];
        }
        for (size_t e = 0; e < hd; e++) o[e] *= 1.0f / (1.0f + kvt_expf(-gate[h * 2 * hd + e]));
    }
}

