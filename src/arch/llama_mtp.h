/* Qwen 3.5's MTP (nextn) layer's arithmetic (llama_mtp.c), for the passes
 * of llama.c that run it. Not part of the public API. */
#ifndef KVT_LLAMA_MTP_H
#define KVT_LLAMA_MTP_H

#include "arch/llama_weights.h"

/* A pass's chained draft rows: more than the drafter's most guesses a pass
 * (KVT_DRAFT_MAX_LIMIT, 64, serve/draft.h), position p at row p mod it;
 * each row the layer's K row then its V row, in the model's row types. */
#define KVT_LLAMA_MTP_RING 65

/* The layer's K stream when sessions keep its rows (V: the next), after
 * the global layers'. */
static inline size_t kvt_llama_mtp_stream(const kvt_llama_weights *w) { return 2 * w->n_global; }

/* The last position's h_nextn (D floats), the state's last bytes (mtp_rows). */
static inline float *kvt_llama_mtp_pending(const kvt_session *s, const kvt_llama_weights *w)
{
    return (float *)(s->cache->state + kvt_llama_weights_state_bytes(w) - (size_t)w->D * sizeof(float));
}

/* The layer's input of token tok and the h_nextn h (D) of the position
 * before: [enorm(its embedding), hnorm(h)] into cat (2D). */
void kvt_llama_mtp_input(const kvt_llama_weights *w, float *cat, int32_t tok, const float *h);
/* One position's queries q (nq heads; 0: none) and K k (head norms, RoPE
 * at pos), then K and v rounded to the rows' types. */
void kvt_llama_mtp_qkv(const kvt_llama_weights *w, float *q, size_t nq, float *k, float *v, size_t pos);
/* The layer's gated attention of one token at pos (queries q, (QD); each
 * head's gate at gate + h * 2 * head_dim) over its rows of positions
 * 0..pos: s's stream below s->n, the ring (KVT_LLAMA_MTP_RING rows) from
 * there, its own row already in it; sc: pos + 1 floats of scratch; the
 * output into out (QD). */
void kvt_llama_mtp_attend(const kvt_session *s, const kvt_llama_weights *w, const uint8_t *ring, const float *q,
                          const float *gate, size_t pos, float *sc, float *out);

#endif
