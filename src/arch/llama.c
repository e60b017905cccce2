/* The passes of the llama family over a session's cache: attention over
 * full K and V rows or a window ring, the FFN (SwiGLU or GeGLU, routed
 * experts), Gated DeltaNet layers, as the family's features say
 * (llama_weights.c lists the families and loads their weights; each
 * feature is a field of kvt_llama_family, tested where it acts).
 *
 * Cache layout. A global layer has two streams, K then V, each one f32 row
 * of its n_head_kv * head_dim per token (128 rows per 128-token block), written
 * once, when their token is processed, and never changed afterwards. A
 * window layer keeps only what its attention can still read: a ring of the
 * last W = sliding_window K rows and one of V rows, row t in slot t mod W,
 * in the cache's fixed state area (K ring then V ring, window layers in
 * order). A pass reads the positions before it from the ring and its own
 * positions from its scratch, and only then writes its last W rows into the
 * ring. The rings make the model stateful: going back to an earlier
 * position needs the ring as it was there, which the session's checkpoints
 * keep (llama_state_save: the valid rows oldest first), and snapshots store
 * it as their state section. A model without window layers has no state:
 * every prefix of its streams is a valid cache. A gemma4 layer that shares
 * K and V has no streams or ring: it reads its source's. A shared window
 * layer reads its source's ring as it was before the pass, so that ring
 * takes the pass's rows only once every layer has run (its rows for the
 * pass stay in scratch of their own until then).
 *
 * Weights: every matrix is used in place, in the file's own type
 * (kvt_matmul_w); only the norm vectors are f32 copies.
 *
 * Exactness: a chunk of n tokens is processed with the same per-row kernels
 * as a single token. Attention for the token at position t reads keys 0..t in
 * increasing order whatever chunk they were written in, and every matmul
 * output is one fixed-order dot product, so logits and cache bytes do not
 * depend on the chunk schedule or the thread count.
 */
#include "arch/deltanet.h"
#include "kernels/kernels.h"
#include "arch/llama.h"
#include "arch/llama_weights.h"
#include "arch/llama_mtp.h"
#include "arch/moe.h"
#include "cache/rows.h"
#include "kernels/qkernels.h"
#include "format/quant.h"
#include "base/util.h"

#include <malloc.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

/* Consecutive tokens whose attention reads each block of K and V rows
 * together (the block stays in the core's cache across them). */
#define ATT_TOKS 8
/* A session's scratch, allocated when it is created: the activations of up
 * to `ch` tokens (a longer chunk runs in passes of ch) and, per part of the
 * pool, one attention score row per query head of a KV group and token of
 * an attention group (ATT_TOKS). */
typedef struct llama_work {
    size_t ch, parts, n_ctx, group;
    float *x;          /* (ch, D) residual */
    float *xb;         /* (ch, D) normed input, then a sublayer's output */
    float *q;          /* (ch, QD) */
    float *att;        /* (ch, QD) attention output */
    float *k, *v;      /* (ch, KV) */
    float *sk, *sv;    /* (ch, KV) the K and V rows of w->swa_src, kept for the shared layers (else NULL) */
    float *h1, *h3;    /* (ch, F) */
    float *lg, *ew, *mo; /* moe: (ch, E) router probabilities, (ch, Eu) weights, (ch, D) output */
    float *m2;         /* gemma4 moe: (ch, D) the experts' input */
    uint32_t *ex;      /* moe: (ch, Eu) experts */
    kvt_moe_scratch ms; /* moe: the experts' scratch */
    float *pl, *pl0;   /* per-layer embeddings: (ch, L * n_pl) the layers' inputs, the token rows */
    float *pg;         /* (ch, n_pl) a layer's gate */
    float *scores;     /* (parts, ATT_TOKS, group, n_ctx): group = query heads per KV head */
    uint8_t *qx;       /* (ch) tokens' activations quantised for the integer matrices (qkernels.h); NULL: none */
    float *qg;         /* qwen35: (ch, 2 QD) each head's queries then its output gate */
    float *sh, *shg;   /* qwen35moe: (ch, D) the shared expert's output, (ch) its gate */
    kvt_gdn_work gw;   /* qwen35: the DeltaNet layers' scratch */
    int32_t *tok;      /* (ch) a pass's tokens, its segments' one after another */
    size_t *pos;       /* (ch) their positions */
    float *lgb;        /* (lgb_rows, V) a batched pass's logits, before they go to their segments */
    size_t lgb_rows;
    float *hn, *cat;   /* the MTP layer: (ch, D) the tokens' h_nextn, (ch, 2D) its inputs (else NULL) */
} llama_work;

static const kvt_arch arch_llama_window, arch_llama_mtp;

static int llama_load(kvt_model *m, const kvt_gguf *g)
{
    kvt_llama_weights *w;
    int rc = kvt_llama_weights_load(&w, g, &m->info);
    if (rc) return rc;
    m->weights = w;
    /* window rings or DeltaNet layers: a state the session keeps; an MTP
     * layer (qwen35, which has that state): its operations too */
    m->arch = w->mtp && w->n_rec ? &arch_llama_mtp : w->n_ring || w->n_rec ? &arch_llama_window : &kvt_arch_llama;
    return KVT_OK;
}

static float *rec_state(const kvt_session *s, const kvt_llama_weights *w, size_t l)
{
    return (float *)(s->cache->state + w->rec_at + (size_t)w->rec_ix[l] * kvt_gdn_state_bytes(&w->gdn));
}

static int llama_cache_new(kvt_session *s)
{
    const kvt_llama_weights *w = s->m->weights;
    size_t n = 2 * w->n_global + (w->mtp_rows ? 2 : 0);
    uint32_t (*spec)[2] = kvt_calloc(n ? n : 1, sizeof *spec);
    if (!spec) return KVT_ENOMEM;
    for (size_t i = 0; i < n; i++) {
        uint32_t kv = i / 2 < w->n_global ? w->stream_kv[i / 2] : w->mtp->KV;
        spec[i][0] = (uint32_t)kvt_rows_bytes(i % 2 ? w->type_v : w->type_k, kv);
        spec[i][1] = KVT_BLOCK;
    }
    s->cache = kvt_cache_new(n, (const uint32_t (*)[2])spec, s->n_ctx, kvt_llama_weights_state_bytes(w));
    free(spec);
    return s->cache ? KVT_OK : KVT_ENOMEM;
}

#define WORK_BUFS 33

/* Every allocation of the scratch but k itself and its DeltaNet scratch,
 * WORK_BUFS of them. */
static void work_bufs(const llama_work *k, void **b)
{
    void *all[WORK_BUFS] = {k->x, k->xb, k->q, k->att, k->k, k->v, k->h1, k->h3, k->sk, k->sv, k->m2,
                            k->pl, k->pl0, k->pg, k->lg, k->ew, k->mo, k->ex, k->ms.xe, k->ms.eo, k->ms.f1,
                            k->ms.f3, k->ms.rt, k->scores, k->qx, k->qg, k->sh, k->shg, k->tok, k->pos,
                            k->lgb, k->hn, k->cat};
    memcpy(b, all, sizeof all);
}

static void llama_work_free(void *p)
{
    llama_work *k = p;
    if (!k) return;
    void *b[WORK_BUFS];
    work_bufs(k, b);
    for (size_t i = 0; i < WORK_BUFS; i++) free(b[i]);
    kvt_gdn_work_free(&k->gw);
    free(k);
}

static size_t llama_work_bytes(const void *p)
{
    const llama_work *k = p;
    void *b[WORK_BUFS];
    work_bufs(k, b);
    size_t n = malloc_usable_size((void *)k) + kvt_gdn_work_bytes(&k->gw);
    for (size_t i = 0; i < WORK_BUFS; i++) n += malloc_usable_size(b[i]);
    return n;
}

#define MAX_PASS 256 /* tokens of one pass through the layers */

/* The score rows for the pool's parts (again when the pool grew). */
static int scores_fit(llama_work *k, size_t parts)
{
    if (k->parts >= parts) return KVT_OK;
    size_t n;
    if (!kvt_mul_ok(parts * ATT_TOKS * k->group, k->n_ctx, &n) || n > SIZE_MAX / sizeof(float))
        return kvt_fail(KVT_ENOMEM, "attention scores for %zu threads", parts);
    float *sc = kvt_malloc(n * sizeof(float));
    if (!sc) return KVT_ENOMEM;
    free(k->scores);
    k->scores = sc;
    k->parts = parts;
    return KVT_OK;
}

static int llama_work_new(kvt_session *s)
{
    const kvt_llama_weights *w = s->m->weights;
    llama_work *k = kvt_calloc(1, sizeof *k);
    if (!k) return KVT_ENOMEM;
    k->ch = s->chunk < MAX_PASS ? (s->chunk ? s->chunk : 1) : MAX_PASS;
    k->n_ctx = s->n_ctx;
    for (uint32_t l = 0; l < w->L; l++) {
        size_t gr = w->layers[l].H / w->layers[l].Hkv;
        k->group = gr > k->group ? gr : k->group;
    }
    size_t D = w->D, QD = w->QD, KV = w->KV, F = w->F, ch = k->ch, NP = (size_t)w->n_pl * w->L;
    k->x = kvt_malloc(ch * D * sizeof(float));
    k->xb = kvt_malloc(ch * D * sizeof(float));
    k->q = kvt_malloc(ch * QD * sizeof(float));
    k->att = kvt_malloc(ch * QD * sizeof(float));
    k->k = kvt_malloc(ch * KV * sizeof(float));
    k->v = kvt_malloc(ch * KV * sizeof(float));
    k->h1 = kvt_malloc(ch * F * sizeof(float));
    k->h3 = kvt_malloc(ch * F * sizeof(float));
    k->tok = kvt_malloc(ch * sizeof(int32_t));
    k->pos = kvt_malloc(ch * sizeof(size_t));
    bool mok = k->tok && k->pos;
    if (w->swa_src >= 0) {
        k->sk = kvt_malloc(ch * KV * sizeof(float));
        k->sv = kvt_malloc(ch * KV * sizeof(float));
        mok = k->sk && k->sv;
    }
    if (NP) {
        k->pl = kvt_malloc(ch * NP * sizeof(float));
        k->pl0 = kvt_malloc(ch * NP * sizeof(float));
        k->pg = kvt_malloc(ch * w->n_pl * sizeof(float));
        mok = mok && k->pl && k->pl0 && k->pg;
    }
    if (w->E) {
        size_t E = w->E, Eu = w->Eu, Fe = w->Fe;
        k->lg = kvt_malloc(ch * E * sizeof(float));
        k->ew = kvt_malloc(ch * Eu * sizeof(float));
        k->mo = kvt_malloc(ch * D * sizeof(float));
        k->m2 = kvt_malloc(ch * D * sizeof(float));
        k->ex = kvt_malloc(ch * Eu * sizeof(uint32_t));
        /* an expert takes a token at most once: ch rows through it */
        k->ms = (kvt_moe_scratch){kvt_malloc(ch * D * sizeof(float)), kvt_malloc(ch * Eu * D * sizeof(float)),
                                  kvt_malloc(ch * Fe * sizeof(float)), kvt_malloc(ch * Fe * sizeof(float)),
                                  kvt_malloc(ch * Eu * sizeof(uint32_t)), NULL};
        mok = mok && k->lg && k->ew && k->mo && k->m2 && k->ex && k->ms.xe && k->ms.eo && k->ms.f1 && k->ms.f3 &&
              k->ms.rt;
    }
    if (w->fam->gated_attn) {
        k->qg = kvt_malloc(ch * QD * sizeof(float));
        mok = mok && k->qg;
        if (w->n_rec) mok = mok && kvt_gdn_work_new(&k->gw, &w->gdn, ch) == KVT_OK;
        if (w->Fs) {
            k->sh = kvt_malloc(ch * D * sizeof(float));
            k->shg = kvt_malloc(ch * sizeof(float));
            mok = mok && k->sh && k->shg;
        }
    }
    if (w->mtp) {
        k->hn = kvt_malloc(ch * D * sizeof(float));
        k->cat = kvt_malloc(ch * 2 * D * sizeof(float));
        mok = mok && k->hn && k->cat;
    }
    /* the largest quantised activations any matrix needs (the MTP layer's
     * too: its eh_proj reads 2D) */
    size_t qb = kvt_q_act_bytes(w->tok_embd.type, 0, 0);
    for (uint32_t l = 0; l <= w->L + (w->mtp != NULL); l++) {
        const kvt_llama_layer *ly = l < w->L ? &w->layers[l] : l > w->L ? w->mtp : &w->layers[0];
        if (l > w->L) {
            const kvt_wmat *mm[2] = {&w->eh, &w->mtp_head};
            for (int i = 0; i < 2; i++) {
                size_t b = mm[i]->rows ? kvt_q_act_bytes(mm[i]->type, ch, mm[i]->cols) : 0;
                qb = b > qb ? b : qb;
            }
        }
        const kvt_wmat *m[20] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo, &ly->w1, &ly->w3, &ly->w2,
                                 &ly->gate_x, &ly->up_x, &ly->down_x, &ly->inp_gate, &ly->proj,
                                 &ly->gdn.qkv, &ly->gdn.gate, &ly->gdn.beta, &ly->gdn.alpha, &ly->gdn.out,
                                 &ly->sh_gate, &ly->sh_up, &ly->sh_down};
        if (l == w->L) { m[0] = &w->out; m[1] = &w->ple_proj; }
        for (int i = 0; i < (l == w->L ? 2 : 20); i++) {
            size_t b = m[i]->rows ? kvt_q_act_bytes(m[i]->type, ch, m[i]->cols) : 0;
            qb = b > qb ? b : qb;
        }
    }
    bool qok = !qb || (k->qx = kvt_malloc(qb));
    k->ms.qx = k->qx;
    int rc = k->x && k->xb && k->q && k->att && k->k && k->v && k->h1 && k->h3 && qok && mok
                 ? scores_fit(k, kvt_pool_size(s->pool))
                 : KVT_ENOMEM;
    if (rc) {
        llama_work_free(k);
        return rc == KVT_ENOMEM ? kvt_fail(KVT_ENOMEM, "llama scratch for %zu tokens", ch) : rc;
    }
    s->work = k;
    return KVT_OK;
}

/* Attention for rows [b, e) of (token group, KV head) pairs: the query
 * heads that share a KV head, for up to ATT_TOKS consecutive tokens, read
 * each block of K and V rows once (while it is in the core's cache). Per
 * query head the operations are those of one head alone (scores in
 * position order, one softmax, values mixed in position order), so
 * grouping changes no bit. */
struct attn_ctx {
    const kvt_llama_weights *w;
    const kvt_llama_layer *ly; /* the layer (its shape) */
    const kvt_cache *cache;
    size_t stream, pos0, n; /* stream: a global layer's K stream (V: the next) */
    size_t swa;        /* a window layer's window (0: every position before) */
    const uint8_t *ring; /* a window layer's rings (swa K rows, then swa V rows): the positions before
                          * pos0; NULL: a global layer */
    const float *kp, *vp; /* (n, KV) a window layer: this pass's K and V rows */
    const float *q;    /* (n, QD) */
    float *out;        /* (n, QD) */
    float *scores;     /* (parts, ATT_TOKS, group, n_ctx) */
    size_t n_ctx;
};

/* Rows j .. *end - 1 of KV head h's K (v = 0) or V (v = 1) for attention:
 * the first row's first element, *ld bytes from one row to the next, in
 * the type *t (the kernels read rows in their type, kernels.h). A global
 * layer's rows are its streams' (contiguous within a page of the cache); a window
 * layer's positions before the pass are in its ring (contiguous up to the
 * ring's end), its own in the pass's scratch (f32, already rounded to the
 * row type: rope_range). Only the rows' values reach the result (each
 * score is its own dot product, values are mixed in position order), so
 * where a run ends changes no bit. */
static const uint8_t *rows_at(const struct attn_ctx *c, int v, size_t h, size_t j, size_t *end, size_t *ld,
                              kvt_row_type *t)
{
    const kvt_llama_weights *w = c->w;
    size_t KV = c->ly->KV, W = c->swa, hd = c->ly->hd;
    if (c->ring && j >= c->pos0) {
        *end = SIZE_MAX;
        *ld = KV * sizeof(float);
        *t = KVT_ROWS_F32;
        return (const uint8_t *)((v ? c->vp : c->kp) + (j - c->pos0) * KV + h * hd);
    }
    *t = v ? w->type_v : w->type_k;
    *ld = kvt_rows_bytes(*t, KV);
    const uint8_t *row;
    if (!c->ring) {
        *end = kvt_cache_run_end(c->cache, c->stream + (size_t)v, j);
        row = kvt_cache_row_ro(c->cache, c->stream + (size_t)v, j);
    } else {
        size_t slot = j % W;
        *end = j + (W - slot) < c->pos0 ? j + (W - slot) : c->pos0;
        row = c->ring + (v ? W * kvt_rows_bytes(w->type_k, KV) : 0) + slot * *ld;
    }
    return row + h * kvt_rows_bytes(*t, hd);
}

/* One span of one kind of work (scores, or values mixed: mix) for tokens
 * u .. u + nu - 1 of a group (nu 1 or 2) over positions [ja, je) of a run
 * of rows kr that starts at j0. Two tokens go through the kernels together
 * (each row read once for both), one token's query heads as
 * kvt_att_dots_rows and kvt_att_axpys_rows take them, the rows in their
 * type. */
struct span {
    const struct attn_ctx *c;
    float *att;
    size_t ldg, i0, kvh;
    const uint8_t *kr; /* rows_at's run: ld bytes apart, of type t */
    size_t ld, j0;
    kvt_row_type t;
    bool mix;
};

static void span_run(const struct span *sp, size_t u, size_t nu, size_t ja, size_t je)
{
    if (ja >= je) return;
    const struct attn_ctx *c = sp->c;
    const kvt_llama_layer *ly = c->ly;
    size_t group = ly->H / ly->Hkv, hd = ly->hd, ld = sp->ld, QD = ly->QD;
    float scale = c->w->scale;
    const uint8_t *rows = sp->kr + (ja - sp->j0) * ld;
    if (nu == 1) {
        float *sc = sp->att + u * sp->ldg + ja, *o = c->out + (sp->i0 + u) * QD + sp->kvh * group * hd;
        if (sp->mix) kvt_att_axpys_rows(sp->t, o, hd, sc, c->n_ctx, group, rows, ld, je - ja, hd);
        else kvt_att_dots_rows(sp->t, sc, c->n_ctx, c->q + (sp->i0 + u) * QD + sp->kvh * group * hd, hd, group,
                               rows, ld, je - ja, hd, scale);
        return;
    }
    float *o[32];
    const float *p[32];
    for (size_t h0 = 0; h0 < group; h0 += 16) { /* up to 16 heads of each token at a time */
        size_t nh = group - h0 < 16 ? group - h0 : 16, nq = 0;
        for (size_t x = u; x < u + 2; x++)
            for (size_t h = h0; h < h0 + nh; h++, nq++) {
                float *sc = sp->att + x * sp->ldg + h * c->n_ctx + ja;
                size_t at = (sp->i0 + x) * QD + (sp->kvh * group + h) * hd;
                o[nq] = sp->mix ? c->out + at : sc;
                p[nq] = sp->mix ? sc : c->q + at;
            }
        if (sp->mix) kvt_att_axpys_qs(sp->t, nq, o, p, rows, ld, je - ja, hd);
        else kvt_att_dots_qs(sp->t, nq, o, p, rows, ld, je - ja, hd, scale);
    }
}

static void attn_range(void *arg, uint32_t part, size_t b, size_t e)
{
    struct attn_ctx *c = arg;
    const kvt_llama_layer *ly = c->ly;
    size_t Hkv = ly->Hkv, hd = ly->hd, group = ly->H / ly->Hkv, ldg = group * c->n_ctx, QD = ly->QD;
    float *att = c->scores + (size_t)part * ATT_TOKS * ldg;
    /* tokens in pairs where the kernels take several queries a pass */
    size_t step = kvt_qs_shared(hd) ? 2 : 1;
    bool anchored = kvt_llama_fault == KVT_LLAMA_FAULT_WINDOW_CHUNK;
    for (size_t r = b; r < e; r++) {
        /* token groups in the order 0, last, 1, last - 1, ...: the causal
         * work of a group grows with its position, so each contiguous
         * range of units gets its share of early and late ones */
        size_t gi = r / Hkv, ng = (c->n + ATT_TOKS - 1) / ATT_TOKS, g = gi % 2 ? ng - 1 - gi / 2 : gi / 2;
        size_t i0 = g * ATT_TOKS, kvh = r % Hkv, t0 = c->pos0 + i0;
        size_t nt = c->n - i0 < ATT_TOKS ? c->n - i0 : ATT_TOKS, t_last = t0 + nt - 1;
        /* token t attends to positions lo(t) .. t: all of them, or in a
         * window layer the last swa (llama.cpp's standard window) */
#define AT(t) (anchored ? c->pos0 : (t)) /* KVT_LLAMA_FAULT_WINDOW_CHUNK: the pass's first token's window */
#define LO(t) (c->swa && AT(t) + 1 > c->swa ? AT(t) + 1 - c->swa : 0)
        /* rows a run at a time (a block, or a stretch of a ring): one lookup
         * per run for the group's tokens. A pair of tokens t, t + 1 shares
         * the positions [a1, e0) of a run: the first token's own (a window's
         * first position) go before them, the second's own (its diagonal)
         * after, so each token still meets its positions in order. */
        for (int mix = 0; mix < 2; mix++) {
            if (mix)
                for (size_t u = 0; u < nt; u++) {
                    size_t t = t0 + u;
                    kvt_softmax_rows(att + u * ldg + LO(t), c->n_ctx, group, t + 1 - LO(t));
                    memset(c->out + (i0 + u) * QD + kvh * group * hd, 0, group * hd * sizeof(float));
                }
            for (size_t j0 = LO(t0), j1; j0 <= t_last; j0 = j1) {
                size_t ld;
                kvt_row_type t;
                const uint8_t *kr = rows_at(c, mix, kvh, j0, &j1, &ld, &t);
                struct span sp = {c, att, ldg, i0, kvh, kr, ld, j0, t, mix};
                for (size_t u = 0; u < nt; u += step) {
                    size_t t = t0 + u, a0 = LO(t) > j0 ? LO(t) : j0, e0 = t + 1 < j1 ? t + 1 : j1;
                    if (step == 1 || u + 1 == nt) { span_run(&sp, u, 1, a0, e0); continue; }
                    size_t a1 = LO(t + 1) > j0 ? LO(t + 1) : j0, e1 = t + 2 < j1 ? t + 2 : j1;
                    if (a1 >= e0) { /* nothing shared */
                        span_run(&sp, u, 1, a0, e0);
                        span_run(&sp, u + 1, 1, a1, e1);
                        continue;
                    }
                    span_run(&sp, u, 1, a0, a1);
                    span_run(&sp, u, 2, a1, e0);
                    span_run(&sp, u + 1, 1, e0, e1);
                }
            }
        }
#undef LO
#undef AT
    }
}

/* h1 = silu(h1) * h3 over a range of elements (each on its own: any split
 * gives the same bytes). */
struct swiglu_ctx { float *h1; const float *h3; bool gelu; };

static void swiglu_range(void *arg, size_t j0, size_t j1)
{
    struct swiglu_ctx *c = arg;
    (c->gelu ? kvt_geglu : kvt_swiglu)(c->h1 + j0, c->h3 + j0, j1 - j0);
}

/* The per-token steps of a pass, over a range of its tokens (each token on
 * its own: any split gives the same bytes): x += add (when set), then
 * xb = rmsnorm(x) (when norm is set); or the biases, head norms and RoPE of
 * q and k (and v's bias and norm). */
struct tok_ctx {
    const kvt_llama_weights *w;
    const kvt_llama_layer *ly;
    float *x, *xb, *q, *k, *v; /* k, v NULL: a shared layer's (q alone) */
    const float *add, *norm;
    const size_t *pos; /* (n) the tokens' positions */
    const float *post;  /* gemma: add is rmsnorm(add) * post first (NULL: as it is) */
};

static void add_norm_range(void *arg, size_t i0, size_t i1)
{
    struct tok_ctx *c = arg;
    size_t D = c->w->D;
    for (size_t i = i0; i < i1; i++) {
        float *x = c->x + i * D;
        if (c->post) /* add is xb: normed in place */
            kvt_rmsnorm(c->xb + i * D, c->xb + i * D, c->post, D, c->w->eps);
        if (c->add)
            for (size_t j = 0; j < D; j++) x[j] += c->add[i * D + j];
        if (c->norm) kvt_rmsnorm(c->xb + i * D, x, c->norm, D, c->w->eps);
    }
}


static void add_bias(float *x, const float *b, size_t n)
{
    for (size_t j = 0; j < n; j++) x[j] += b[j];
}

static void rope_range(void *arg, size_t i0, size_t i1)
{
    struct tok_ctx *c = arg;
    const kvt_llama_weights *w = c->w;
    const kvt_llama_layer *ly = c->ly;
    size_t hd = ly->hd, nk = c->k ? ly->Hkv : 0;
    for (size_t i = i0; i < i1; i++) {
        float *q = c->q + i * ly->QD, *k = c->k ? c->k + i * ly->KV : NULL, *v = c->v ? c->v + i * ly->KV : NULL;
        if (ly->bq) {
            add_bias(q, ly->bq, ly->QD);
            add_bias(k, ly->bk, ly->KV);
            add_bias(v, ly->bv, ly->KV);
        }
        if (ly->qn) {
            for (size_t h = 0; h < ly->H; h++) kvt_rmsnorm(q + h * hd, q + h * hd, ly->qn, hd, w->eps);
            for (size_t h = 0; h < nk; h++) kvt_rmsnorm(k + h * hd, k + h * hd, ly->kn, hd, w->eps);
        }
        if (w->fam->v_norm) /* V's heads RMS-normed, without a weight */
            for (size_t h = 0; h < nk; h++)
                kvt_rmsnorm(v + h * hd, v + h * hd, kvt_llama_fault == KVT_LLAMA_FAULT_V_NORM_WEIGHT ? ly->kn : NULL,
                            hd, w->eps);
        kvt_rope_heads(q, ly->H, k, nk, hd, ly->n_rot, c->pos[i], ly->base, ly->ff,
                       w->fam->neox && kvt_llama_fault != KVT_LLAMA_FAULT_ROPE_PAIRS);
        /* K and V as every reader will see them: rounded once to the rows'
         * types (the same bytes when stored) */
        if (kvt_llama_fault == KVT_LLAMA_FAULT_ROWS_UNROUNDED) continue; /* tests */
        if (k) kvt_rows_round(w->type_k, k, ly->KV);
        if (v) kvt_rows_round(w->type_v, v, ly->KV);
    }
}

/* Softmax router probabilities of the n tokens' logits (wk->lg), their Eu
 * best (kvt_moe_select), those probabilities normalised to sum 1, as
 * llama.cpp's build_moe_ffn with norm_w (or the choice kvt_force imposes,
 * for the tests). */
static void moe_route(llama_work *wk, const kvt_llama_weights *w, size_t l, size_t n)
{
    size_t E = w->E, Eu = w->Eu;
    for (size_t i = 0; i < n; i++) {
        float *p = wk->lg + i * E, m = p[0], z = 0;
        for (size_t e = 1; e < E; e++) m = p[e] > m ? p[e] : m;
        for (size_t e = 0; e < E; e++) { p[e] = kvt_expf(p[e] - m); z += p[e]; }
        for (size_t e = 0; e < E; e++) p[e] /= z;
        uint32_t *ex = wk->ex + i * Eu;
        kvt_moe_select(p, E, Eu, ex);
        const kvt_forced *fz = kvt_force;
        if (fz && wk->pos[i] < fz->n && fz->Eu == Eu && l < 64 && fz->ex[l])
            kvt_moe_force_choice(fz->ex[l], fz->ex_gap[l], wk->pos[i], ex, Eu, p, E, false);
        for (size_t j = 0; j < Eu; j++) wk->ew[i * Eu + j] = p[ex[j]];
        if (kvt_llama_fault != KVT_LLAMA_FAULT_MOE_WEIGHTS) kvt_moe_normalise(wk->ew + i * Eu, Eu);
        if (w->moe_scale != 0.0f && w->moe_scale != 1.0f)
            for (size_t j = 0; j < Eu; j++) wk->ew[i * Eu + j] *= w->moe_scale;
    }
}

/* The routed experts of layer l over n tokens h (n, D), their weighted sum
 * into wk->mo. */
static void moe_experts(kvt_pool *pool, llama_work *wk, const kvt_llama_weights *w, size_t l, const float *h, size_t n)
{
    const kvt_llama_layer *ly = &w->layers[l];
    size_t D = w->D;
    memset(wk->mo, 0, n * D * sizeof(float));
    kvt_moe m = {&ly->gate_x, ly->gate_up ? &ly->gate_x : &ly->up_x, &ly->down_x, w->E, w->Eu, w->Fe, D, 0.0f,
                 w->fam->layer_experts, ly->down_s, ly->gate_up ? 2 * (size_t)w->Fe : 0, ly->gate_up ? w->Fe : 0};
    kvt_moe_run(pool, &m, h, n, wk->ex, wk->ew, &wk->ms, wk->mo);
}

/* qwen3moe's FFN: the routed experts of xb (n, D), their output into xb. */
static void moe_ffn(kvt_pool *pool, llama_work *wk, const kvt_llama_weights *w, size_t l, float *xb, size_t n)
{
    kvt_matmul(pool, wk->lg, w->layers[l].gate_inp, xb, n, w->D, w->E);
    moe_route(wk, w, l, n);
    moe_experts(pool, wk, w, l, xb, n);
    memcpy(xb, wk->mo, n * w->D * sizeof(float));
}

/* qwen35moe's shared expert on the FFN input xb: its SwiGLU MLP into
 * wk->sh, its gate's logit (sh_inp . x) into wk->shg. */
static void shared_expert(kvt_pool *pool, llama_work *wk, const kvt_llama_weights *w, const kvt_llama_layer *ly, size_t n)
{
    size_t D = w->D;
    kvt_matmul_w(pool, wk->h1, &ly->sh_gate, wk->xb, n, wk->qx);
    kvt_matmul_w_next(pool, wk->h3, &ly->sh_up, &ly->sh_gate, wk->xb, n, wk->qx);
    kvt_swiglu(wk->h1, wk->h3, n * w->Fs);
    kvt_matmul_w(pool, wk->sh, &ly->sh_down, wk->h1, n, wk->qx);
    for (size_t i = 0; i < n; i++) wk->shg[i] = kvt_dot(ly->sh_inp, wk->xb + i * D, D);
}

/* Tokens a thread takes at least in those steps (a decode step runs them
 * without waking the pool). */
#define TOK_MIN 32

/* gemma4's per-token steps around its experts, over a range of tokens:
 * before (stage 0), the shared MLP's output xb normed (post_ffw_norm_1),
 * the experts' input m2 (pre_ffw_norm_2 of the residual x) and the
 * router's input mo (x RMS-normed without a weight, times 1 / sqrt(D), times
 * ffn_gate_inp.scale); after (stage 1), xb += the experts' sum mo normed
 * (post_ffw_norm_2). */
struct g4_ctx { const kvt_llama_weights *w; const kvt_llama_layer *ly; llama_work *wk; int stage; };

static void g4_moe_range(void *arg, size_t i0, size_t i1)
{
    struct g4_ctx *c = arg;
    const kvt_llama_weights *w = c->w;
    const kvt_llama_layer *ly = c->ly;
    size_t D = w->D;
    float rs = 1.0f / sqrtf((float)D);
    for (size_t i = i0; i < i1; i++) {
        float *xb = c->wk->xb + i * D, *x = c->wk->x + i * D, *mo = c->wk->mo + i * D;
        if (c->stage == 0) {
            kvt_rmsnorm(xb, xb, ly->post_ffn1, D, w->eps);
            kvt_rmsnorm(c->wk->m2 + i * D, x, ly->pre_ffn2, D, w->eps);
            kvt_rmsnorm(mo, x, NULL, D, w->eps);
            for (size_t j = 0; j < D; j++) mo[j] = mo[j] * rs * ly->gate_inp_s[j];
        } else {
            kvt_rmsnorm(mo, mo, ly->post_ffn2, D, w->eps);
            for (size_t j = 0; j < D; j++) xb[j] += mo[j];
        }
    }
}

/* gemma4's FFN of a layer with experts: x holds the residual, xb its
 * ffn_norm; the shared MLP's output xb (h1, h3 are the MLP's), then xb =
 * that normed plus the experts' sum normed. */
static void g4_moe_ffn(kvt_pool *pool, llama_work *wk, const kvt_llama_weights *w, size_t l, size_t n)
{
    const kvt_llama_layer *ly = &w->layers[l];
    struct g4_ctx gc = {w, ly, wk, 0};
    kvt_pool_for(pool, n, TOK_MIN, g4_moe_range, &gc);
    kvt_matmul(pool, wk->lg, ly->gate_inp, wk->mo, n, w->D, w->E);
    moe_route(wk, w, l, n);
    moe_experts(pool, wk, w, l, wk->m2, n);
    gc.stage = 1;
    kvt_pool_for(pool, n, TOK_MIN, g4_moe_range, &gc);
}

/* gemma4's per-layer embeddings, per token over a range: stage 0, the
 * layers' inputs pl (n, L, n_pl) from the projection of the scaled
 * embedding (in pl) and the token's row (pl0); stage 1, layer l's gate pg
 * = gelu(pg) * its input (ggml's GELU, kvt_geglu's); stage 2, the residual
 * scaled by the layer's output scale. */
struct ple_ctx { const kvt_llama_weights *w; llama_work *wk; const int32_t *tok; size_t l; int stage; };

static void ple_range(void *arg, size_t i0, size_t i1)
{
    struct ple_ctx *c = arg;
    const kvt_llama_weights *w = c->w;
    size_t np = w->n_pl, NP = np * w->L;
    float rd = 1.0f / sqrtf((float)w->D), rp = sqrtf((float)np), r2 = 1.0f / sqrtf(2.0f);
    for (size_t i = i0; i < i1; i++) {
        if (c->stage == 1) {
            kvt_geglu(c->wk->pg + i * np, c->wk->pl + i * NP + c->l * np, np);
            continue;
        }
        if (c->stage == 2) {
            float sc = *w->layers[c->l].out_scale, *x = c->wk->x + i * w->D;
            for (size_t j = 0; j < w->D; j++) x[j] *= sc;
            continue;
        }
        float *p = c->wk->pl + i * NP, *p0 = c->wk->pl0 + i * NP;
        const uint8_t *row = w->ple_embd.data + (size_t)c->tok[i] * w->ple_embd.row_bytes;
        kvt_quant_to_f32(w->ple_embd.type, row, p0, NP);
        for (size_t l = 0; l < w->L; l++) {
            float *a = p + l * np;
            for (size_t j = 0; j < np; j++) a[j] *= rd;
            kvt_rmsnorm(a, a, w->ple_norm, np, w->eps);
        }
        for (size_t j = 0; j < NP; j++) p[j] = (p[j] + p0[j] * rp) * r2;
    }
}

/* K and V rows of a pass's last min(n, W) positions into a window layer's
 * rings (KV elements each, stored in the rows' types). */
static void ring_put(const kvt_llama_weights *w, uint8_t *ring, size_t KV, const float *k, const float *v, size_t n,
                     size_t pos0)
{
    size_t W = w->swa, rk = kvt_rows_bytes(w->type_k, KV), rv = kvt_rows_bytes(w->type_v, KV);
    for (size_t i = n > W ? n - W : 0; i < n; i++) {
        size_t slot = (pos0 + i) % W;
        kvt_rows_put(w->type_k, ring + slot * rk, k + i * KV, KV);
        kvt_rows_put(w->type_v, ring + W * rk + slot * rv, v + i * KV, KV);
    }
}

static uint8_t *ring_of(const kvt_session *s, const kvt_llama_weights *w, int32_t at)
{
    return at < 0 ? s->cache->state + w->ring_at[-1 - at] : NULL;
}

/* A pass's tokens and positions into the scratch (wk->tok, wk->pos), n of
 * them, and nl: the rows that want logits. */
static int pass_tokens(llama_work *wk, const kvt_llama_weights *w, const kvt_seg *sg, size_t k, size_t *n_out,
                       size_t *nl_out)
{
    size_t n = 0, nl = 0;
    for (size_t g = 0; g < k; g++) {
        for (size_t i = 0; i < sg[g].n; i++, n++) {
            int32_t t = sg[g].tok[i];
            if (t < 0 || (uint32_t)t >= w->V) return kvt_fail(KVT_EINVAL, "token id %d out of range [0, %u)", t, w->V);
            wk->tok[n] = t;
            wk->pos[n] = kvt_llama_fault == KVT_LLAMA_FAULT_BATCH_POS && k > 1 ? n : sg[g].pos0 + i;
        }
        nl += sg[g].logits && sg[g].lfrom < sg[g].n ? sg[g].n - sg[g].lfrom : 0;
    }
    *n_out = n;
    *nl_out = nl;
    return KVT_OK;
}

/* Where several segments' nl logit rows go first, together (then to each
 * segment: pass_logits); NULL for one segment, whose rows go to it. */
static int logit_rows(llama_work *wk, const kvt_llama_weights *w, size_t k, size_t nl, float **lgb)
{
    *lgb = NULL;
    if (k < 2 || !nl) return KVT_OK;
    if (wk->lgb_rows < nl) {
        float *p = kvt_malloc(nl * (size_t)w->V * sizeof(float));
        if (!p) return kvt_fail(KVT_ENOMEM, "logits of %zu rows", nl);
        free(wk->lgb);
        wk->lgb = p;
        wk->lgb_rows = nl;
    }
    *lgb = wk->lgb;
    return KVT_OK;
}

/* The n tokens' embeddings into x (embd_scale: times sqrt(D)), and with
 * per-layer embeddings their layers' inputs (wk->pl). */
static void embed(kvt_pool *pool, llama_work *wk, const kvt_llama_weights *w, size_t n, bool ple, struct ple_ctx *pc)
{
    size_t D = w->D;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *row = w->tok_embd.data + (size_t)wk->tok[i] * w->tok_embd.row_bytes;
        kvt_quant_to_f32(w->tok_embd.type, row, wk->x + i * D, D);
        if (w->fam->embd_scale)
            for (size_t j = 0; j < D; j++) wk->x[i * D + j] *= sqrtf((float)D);
    }
    if (ple) {
        kvt_matmul_w(pool, wk->pl, &w->ple_proj, wk->x, n, wk->qx);
        kvt_pool_for(pool, n, TOK_MIN, ple_range, pc);
    }
}

/* Layer l's attention over the pass's n tokens (its input normed in
 * wk->xb, tc set for its rows), its output into wk->xb: the queries (and
 * gated_attn's gates), K and V unless the layer shares them, RoPE, each
 * segment's rows or ring kept and its attention over its own cache, then
 * attn_output. */
static int attention(kvt_pool *pool, llama_work *wk, const kvt_llama_weights *w, size_t l, const kvt_seg *sg, size_t k,
                     size_t n, struct tok_ctx *tc)
{
    const kvt_llama_layer *ly = &w->layers[l];
    int32_t at = w->kv_at[l];
    size_t window = at < 0 ? w->swa : 0; /* a window layer: the positions its ring holds and its own */
    size_t KV = ly->KV, hd = ly->hd;
    float *xb = wk->xb, *q = wk->q, *att = wk->att;
    float *kk = (int32_t)l == w->swa_src ? wk->sk : wk->k, *v = (int32_t)l == w->swa_src ? wk->sv : wk->v;
    bool gated = w->fam->gated_attn;
    kvt_matmul_w(pool, gated ? wk->qg : q, &ly->wq, xb, n, wk->qx);
    if (gated) /* each head's queries, then its gate: the queries on their own */
        for (size_t i = 0; i < n; i++)
            for (size_t h = 0; h < ly->H; h++)
                memcpy(q + i * ly->QD + h * hd, wk->qg + (i * ly->H + h) * 2 * hd, hd * sizeof(float));
    if (!ly->shared) {
        kvt_matmul_w_next(pool, kk, &ly->wk, &ly->wq, xb, n, wk->qx);
        if (ly->wv.rows) kvt_matmul_w_next(pool, v, &ly->wv, &ly->wk, xb, n, wk->qx);
        else memcpy(v, kk, n * KV * sizeof(float)); /* v_norm without attn_v: V is K's projection */
    }
    kvt_pool_for(pool, n, TOK_MIN, rope_range, tc);
    for (size_t g = 0, off = 0; g < k; off += sg[g++].n) {
        kvt_session *s = sg[g].s;
        size_t sn = sg[g].n, pos0 = sg[g].pos0;
        uint8_t *ring = ring_of(s, w, at);
        for (size_t i = 0; i < sn && !ring && !ly->shared; i++) {
            void *kr = kvt_cache_row(s->cache, (size_t)at, pos0 + i);
            void *vr = kvt_cache_row(s->cache, (size_t)at + 1, pos0 + i);
            if (!kr || !vr) return kvt_fail(KVT_ENOMEM, "cache row %zu", pos0 + i);
            kvt_rows_put(w->type_k, kr, kk + (off + i) * KV, KV);
            kvt_rows_put(w->type_v, vr, v + (off + i) * KV, KV);
        }
        /* a shared window layer: its source's ring as before the pass,
         * and its source's rows of the pass */
        const float *kp = (ly->shared ? wk->sk : kk) + off * KV, *vp = (ly->shared ? wk->sv : v) + off * KV;
        struct attn_ctx ac = {w, ly, s->cache, ring ? 0 : (size_t)at, pos0, sn, window, ring, kp, vp,
                              q + off * ly->QD, att + off * ly->QD, wk->scores, wk->n_ctx};
        /* one (token group, KV head) scores and mixes up to pos0 + sn
         * rows per query head and token: give a thread at least 128K
         * multiply-adds (measured in bench/README.md), so a tiny model's
         * decode step does not pay for waking the pool */
        size_t span = window && window < pos0 + sn ? window : pos0 + sn;
        size_t ng = (sn + ATT_TOKS - 1) / ATT_TOKS,
               per = 2 * span * hd * (ly->H / ly->Hkv) * (sn < ATT_TOKS ? sn : ATT_TOKS);
        kvt_pool_for_part(pool, ng * ly->Hkv, (131072 + per - 1) / per, attn_range, &ac);
        /* only now does a window layer's ring take the pass's last rows
         * (the shared layers' source: once they all have read it) */
        if (ring && !ly->shared &&
            ((int32_t)l != w->swa_src || kvt_llama_fault == KVT_LLAMA_FAULT_SOURCE_RING_EARLY))
            ring_put(w, ring, KV, kk + off * KV, v + off * KV, sn, pos0);
    }
    if (gated) /* the output times sigmoid(gate) */
        for (size_t i = 0; i < n; i++)
            for (size_t h = 0; h < ly->H; h++) {
                const float *gt = wk->qg + (i * ly->H + h) * 2 * hd + hd;
                float *o = att + i * ly->QD + h * hd;
                for (size_t j = 0; j < hd; j++) o[j] *= 1.0f / (1.0f + kvt_expf(-gt[j]));
            }
    kvt_matmul_w(pool, xb, &ly->wo, att, n, wk->qx);
    return KVT_OK;
}

/* Layer l's FFN of its normed input wk->xb, into wk->xb: the routed
 * experts (moe; with qwen35moe's shared expert), or the MLP (SwiGLU or
 * geglu) and, for a layer_experts layer with a router, its experts. */
static void ffn(kvt_pool *pool, llama_work *wk, const kvt_llama_weights *w, size_t l, size_t n)
{
    const kvt_llama_layer *ly = &w->layers[l];
    float *xb = wk->xb, *h1 = wk->h1;
    size_t D = w->D;
    if (ly->gate_inp && !w->fam->layer_experts) {
        if (w->Fs) shared_expert(pool, wk, w, ly, n);
        moe_ffn(pool, wk, w, l, xb, n);
        if (w->Fs) /* qwen35moe: + the shared expert times sigmoid(its gate) */
            for (size_t i = 0; i < n; i++) {
                float gt = 1.0f / (1.0f + kvt_expf(-wk->shg[i]));
                for (size_t j = 0; j < D; j++) xb[i * D + j] += wk->sh[i * D + j] * gt;
            }
        return;
    }
    kvt_matmul_w(pool, h1, &ly->w1, xb, n, wk->qx);
    kvt_matmul_w_next(pool, wk->h3, &ly->w3, &ly->w1, xb, n, wk->qx);
    struct swiglu_ctx sc = {h1, wk->h3, w->fam->geglu};
    kvt_pool_for(pool, n * ly->F, 16384, swiglu_range, &sc);
    kvt_matmul_w(pool, xb, &ly->w2, h1, n, wk->qx);
    if (ly->gate_inp) g4_moe_ffn(pool, wk, w, l, n);
}

/* ple: layer l's end, its FFN's residual added now (post-normed), then the
 * per-layer embedding (when ple_on), then the output scale. */
static void layer_end(kvt_pool *pool, llama_work *wk, const kvt_llama_weights *w, size_t l, size_t n, bool ple_on,
                      struct tok_ctx *tc, struct ple_ctx *pc)
{
    const kvt_llama_layer *ly = &w->layers[l];
    tc->add = wk->xb;
    tc->norm = NULL;
    tc->post = ly->post_ffn;
    kvt_pool_for(pool, n, TOK_MIN, add_norm_range, tc);
    if (ple_on) {
        pc->l = l;
        pc->stage = 1;
        kvt_matmul_w(pool, wk->pg, &ly->inp_gate, wk->x, n, wk->qx);
        kvt_pool_for(pool, n, TOK_MIN, ple_range, pc);
        kvt_matmul_w(pool, wk->xb, &ly->proj, wk->pg, n, wk->qx);
        tc->post = ly->ple_post;
        kvt_pool_for(pool, n, TOK_MIN, add_norm_range, tc);
    }
    if (ly->out_scale) {
        pc->l = l;
        pc->stage = 2;
        kvt_pool_for(pool, n, TOK_MIN, ple_range, pc);
    }
}

/* After the layers: the shared layers' source ring takes the pass's rows,
 * the last layer's residual is added (pending), and the rows with logits
 * are normed, projected (soft-capped where the model has it) and handed
 * to their segments. */
static void pass_logits(kvt_pool *pool, llama_work *wk, const kvt_llama_weights *w, const kvt_seg *sg, size_t k,
                        size_t n, size_t nl, float *lgb, bool pending)
{
    size_t D = w->D;
    float *x = wk->x, *xb = wk->xb;
    if (w->swa_src >= 0) /* the shared layers' source ring, read by all of them */
        for (size_t g = 0, off = 0; g < k; off += sg[g++].n)
            ring_put(w, ring_of(sg[g].s, w, w->kv_at[w->swa_src]), w->layers[w->swa_src].KV,
                     wk->sk + off * w->layers[w->swa_src].KV, wk->sv + off * w->layers[w->swa_src].KV, sg[g].n,
                     sg[g].pos0);
    /* the last layer's residual */
    struct tok_ctx tc = {w, NULL, x, xb, wk->q, NULL, NULL, pending ? xb : NULL, NULL, wk->pos,
                         pending ? w->layers[w->L - 1].post_ffn : NULL};
    if (pending) kvt_pool_for(pool, n, TOK_MIN, add_norm_range, &tc);
    if (!nl) return;
    /* the rows with logits, normed into xb one after another */
    for (size_t g = 0, off = 0, r = 0; g < k; off += sg[g++].n)
        for (size_t i = sg[g].logits ? sg[g].lfrom : sg[g].n; i < sg[g].n; i++, r++)
            kvt_rmsnorm(xb + r * D, x + (off + i) * D, w->out_norm, D, w->eps);
    float *lg = lgb ? lgb : sg[0].logits;
    kvt_matmul_w(pool, lg, &w->out, xb, nl, wk->qx);
    if (w->softcap > 0) { /* the final soft-capping, as ggml: tanh(logit * (1 / cap)) * cap */
        float rc = 1.0f / w->softcap;
        for (size_t j = 0; j < nl * w->V; j++) lg[j] = tanhf(lg[j] * rc) * w->softcap;
    }
    if (lgb)
        for (size_t g = 0, r = 0; g < k; g++) {
            if (!sg[g].logits || sg[g].lfrom >= sg[g].n) continue;
            size_t m = sg[g].n - sg[g].lfrom;
            memcpy(sg[g].logits, lgb + r * w->V, m * w->V * sizeof(float));
            r += m;
        }
}

/* ---- the MTP (nextn) layer: qwen35's (its math: llama_mtp.c) ---- */

/* After a pass (wk->x: its tokens' final residuals), with mtp_rows: each
 * token's h_nextn, then the MTP layer's K and V of each position from its
 * token and the h_nextn of the position before (a segment's first: the one
 * its session keeps), into the session's stream; the last h_nextn kept.
 * Per-token steps and products whose rows are their own: the same bytes
 * whatever the chunks, threads or segments beside. */
static int mtp_rows_pass(kvt_pool *pool, llama_work *wk, const kvt_llama_weights *w, const kvt_seg *sg, size_t k,
                         size_t n)
{
    const kvt_llama_layer *ly = w->mtp;
    size_t D = w->D, KV = ly->KV, st = kvt_llama_mtp_stream(w);
    for (size_t i = 0; i < n; i++) kvt_rmsnorm(wk->hn + i * D, wk->x + i * D, w->out_norm, D, w->eps);
    for (size_t g = 0, off = 0; g < k; off += sg[g++].n)
        for (size_t i = 0; i < sg[g].n; i++) {
            const float *h = i ? wk->hn + (off + i - 1) * D : kvt_llama_mtp_pending(sg[g].s, w);
            kvt_llama_mtp_input(w, wk->cat + (off + i) * 2 * D, wk->tok[off + i], h);
        }
    kvt_matmul_w(pool, wk->x, &w->eh, wk->cat, n, wk->qx);
    for (size_t i = 0; i < n; i++) kvt_rmsnorm(wk->xb + i * D, wk->x + i * D, ly->attn_norm, D, w->eps);
    kvt_matmul_w(pool, wk->k, &ly->wk, wk->xb, n, wk->qx);
    kvt_matmul_w(pool, wk->v, &ly->wv, wk->xb, n, wk->qx);
    for (size_t g = 0, off = 0; g < k; off += sg[g++].n) {
        kvt_session *s = sg[g].s;
        for (size_t i = 0; i < sg[g].n; i++) {
            float *kk = wk->k + (off + i) * KV, *v = wk->v + (off + i) * KV;
            kvt_llama_mtp_qkv(w, NULL, 0, kk, v, sg[g].pos0 + i);
            size_t p = sg[g].pos0 + i;
            void *kr = kvt_cache_row(s->cache, st, p), *vr = kvt_cache_row(s->cache, st + 1, p);
            if (!kr || !vr) return kvt_fail(KVT_ENOMEM, "cache row %zu", p);
            kvt_rows_put(w->type_k, kr, kk, KV);
            kvt_rows_put(w->type_v, vr, v, KV);
        }
        memcpy(kvt_llama_mtp_pending(s, w), wk->hn + (off + sg[g].n - 1) * D, D * sizeof(float));
    }
    return KVT_OK;
}

/* A pass over k segments (kvt_seg) of distinct sessions, their tokens one
 * after another in the scratch, at most ch in all. Every step on a token
 * on its own and every matrix product runs over all the pass's tokens
 * (each row of a product is its own dot products, in the order of its
 * columns: the same bytes whatever the other rows); what reads or writes a
 * session's cache (attention, the rows and rings kept, the DeltaNet state)
 * runs per segment on that session's own. So a segment's results are those
 * of a pass of it alone. */
static int llama_pass(llama_work *wk, const kvt_seg *sg, size_t k)
{
    kvt_pool *pool = sg[0].s->pool;
    const kvt_llama_weights *w = sg[0].s->m->weights;
    size_t D = w->D, n = 0, nl = 0;
    float *lgb;
    int rc;
    if ((rc = pass_tokens(wk, w, sg, k, &n, &nl)) || (rc = logit_rows(wk, w, k, nl, &lgb))) return rc;
    bool ple = w->n_pl && kvt_llama_fault != KVT_LLAMA_FAULT_NO_PLE;
    struct ple_ctx pc = {w, wk, wk->tok, 0, 0};
    embed(pool, wk, w, n, ple, &pc);
    bool pending = false; /* xb holds the layer before's FFN output, not yet added to x */
    for (size_t l = 0; l < w->L; l++) {
        const kvt_llama_layer *ly = &w->layers[l];
        /* this layer's K and V rows: the scratch's, or those kept for the
         * shared layers (those layers computing none) */
        float *kk = (int32_t)l == w->swa_src ? wk->sk : wk->k, *v = (int32_t)l == w->swa_src ? wk->sv : wk->v;
        /* the residual of the layer before (none before the first, or it
         * was added at its end), then this layer's attention norm */
        struct tok_ctx tc = {w, ly, wk->x, wk->xb, wk->q, ly->shared ? NULL : kk, ly->shared ? NULL : v,
                             pending ? wk->xb : NULL, ly->attn_norm, wk->pos,
                             pending ? w->layers[l - 1].post_ffn : NULL};
        kvt_pool_for(pool, n, TOK_MIN, add_norm_range, &tc);
        if (ly->recr) { /* a DeltaNet layer: its output into xb, each segment on its own state */
            kvt_gdn_fault_grouped = kvt_llama_fault == KVT_LLAMA_FAULT_GDN_GROUPED;
            for (size_t g = 0, off = 0; g < k; off += sg[g++].n)
                kvt_gdn_forward(pool, &w->gdn, &ly->gdn, rec_state(sg[g].s, w, l), &wk->gw, wk->xb + off * D,
                                sg[g].n, wk->xb + off * D, wk->qx);
        } else if ((rc = attention(pool, wk, w, l, sg, k, n, &tc))) {
            return rc;
        }
        tc.add = wk->xb;
        tc.norm = ly->ffn_norm;
        tc.post = ly->post_attn;
        kvt_pool_for(pool, n, TOK_MIN, add_norm_range, &tc);
        ffn(pool, wk, w, l, n);
        pending = true;
        if (!w->fam->ple) continue;
        layer_end(pool, wk, w, l, n, ple, &tc, &pc);
        pending = false;
    }
    pass_logits(pool, wk, w, sg, k, n, nl, lgb, pending);
    return w->mtp_rows ? mtp_rows_pass(pool, wk, w, sg, k, n) : KVT_OK;
}

/* Before a forward of s from pos0: the scores fit the pool, the tokens the
 * context; a DeltaNet layer starts from zero state at position 0. */
static int forward_ready(kvt_session *s, llama_work *wk, size_t n, size_t pos0)
{
    int rc = scores_fit(wk, kvt_pool_size(s->pool));
    if (rc) return rc;
    if (pos0 + n > wk->n_ctx || pos0 + n > s->n_ctx)
        return kvt_fail(KVT_ECTX, "tokens up to %zu exceed the context", pos0 + n);
    const kvt_llama_weights *w = s->m->weights;
    if (pos0 == 0 && w->n_rec) memset(s->cache->state + w->rec_at, 0, kvt_llama_weights_state_bytes(w) - w->rec_at);
    return KVT_OK;
}

static int llama_forward(kvt_session *s, const int32_t *tok, size_t n, size_t pos0,
                         float *logits, size_t lfrom)
{
    llama_work *wk = s->work;
    int rc = forward_ready(s, wk, n, pos0);
    /* passes of at most ch tokens: every token's result is that of any
     * other chunking (above), so this changes nothing but the scratch */
    for (size_t done = 0; done < n && !rc;) {
        size_t m = n - done < wk->ch ? n - done : wk->ch;
        size_t lf = lfrom > done ? lfrom - done : 0; /* the pass's first row with logits */
        float *lg = NULL;
        if (logits && lf < m) lg = logits + (done + lf - lfrom) * (size_t)s->m->info.n_vocab;
        else lf = m;
        kvt_seg one = {s, tok + done, m, pos0 + done, lg, lf};
        rc = llama_pass(wk, &one, 1);
        done += m;
    }
    return rc;
}

/* Segments of at most the first session's ch tokens in all go through one
 * pass, on its scratch (the others' contexts no larger than its); a longer
 * batch runs as forwards one after another. */
static int llama_forward_batch(const kvt_seg *sg, size_t k)
{
    if (!k) return KVT_OK;
    llama_work *wk = sg[0].s->work;
    size_t total = 0;
    for (size_t g = 0; g < k; g++) total += sg[g].n;
    bool one = total <= wk->ch;
    for (size_t g = 0; g < k && one; g++) one = sg[g].s->n_ctx <= wk->n_ctx && sg[g].n;
    if (!one) {
        for (size_t g = 0; g < k; g++) {
            int rc = llama_forward(sg[g].s, sg[g].tok, sg[g].n, sg[g].pos0, sg[g].logits, sg[g].lfrom);
            if (rc) return rc;
        }
        return KVT_OK;
    }
    for (size_t g = 0; g < k; g++) {
        int rc = forward_ready(sg[g].s, wk, sg[g].n, sg[g].pos0);
        if (rc) return rc;
    }
    return llama_pass(wk, sg, k);
}

/* ---- the window rings as the session's state ----
 *
 * In logical order: for each window layer, its K rows of the positions
 * max(0, n - W) .. n - 1, oldest first, then its V rows of the same
 * positions; the same bytes whatever slot each was in. */

static void llama_state_save(const kvt_session *s, kvt_wbuf *b)
{
    const kvt_llama_weights *w = s->m->weights;
    size_t n = s->n, W = w->swa;
    for (size_t r = 0; r < w->n_ring; r++) {
        const uint8_t *ring = s->cache->state + w->ring_at[r];
        size_t KV = w->ring_kv[r], rk = kvt_rows_bytes(w->type_k, KV), rv = kvt_rows_bytes(w->type_v, KV);
        for (int v = 0; v < 2; v++)
            for (size_t t = n > W ? n - W : 0; t < n; t++)
                kvt_wbuf_put(b, ring + (v ? W * rk + t % W * rv : t % W * rk), v ? rv : rk);
    }
    /* the DeltaNet layers' states as they are (their layout is logical) */
    if (w->n_rec) kvt_wbuf_put(b, s->cache->state + w->rec_at, kvt_llama_weights_state_bytes(w) - w->rec_at);
}

static int llama_state_load(kvt_session *s, size_t n, kvt_rbuf *rb)
{
    const kvt_llama_weights *w = s->m->weights;
    size_t W = w->swa;
    for (size_t r = 0; r < w->n_ring; r++) {
        uint8_t *ring = s->cache->state + w->ring_at[r];
        size_t KV = w->ring_kv[r], rk = kvt_rows_bytes(w->type_k, KV), rv = kvt_rows_bytes(w->type_v, KV);
        if (kvt_llama_fault == KVT_LLAMA_FAULT_RING_TYPES) { /* tests: K's and V's types crossed */
            rk = rv;
            rv = kvt_rows_bytes(w->type_k, KV);
        }
        for (int v = 0; v < 2; v++)
            for (size_t t = n > W ? n - W : 0; t < n; t++)
                if (!kvt_rbuf_get(rb, ring + (v ? W * rk + t % W * rv : t % W * rk), v ? rv : rk))
                    return kvt_fail(KVT_EFORMAT, "%s state: the window rings of %zu tokens are truncated",
                                    w->fam->name, n);
        if (kvt_llama_fault == KVT_LLAMA_FAULT_RING && n) ring[(n > W ? n - W : 0) % W * rk] ^= 1;
    }
    if (w->n_rec) {
        uint8_t *st = s->cache->state + w->rec_at;
        /* tests: the MTP layer's h_nextn forgotten (left as it was) */
        bool forget = w->mtp_rows && kvt_llama_fault == KVT_LLAMA_FAULT_MTP_PENDING;
        float *keep = forget ? kvt_malloc((size_t)w->D * sizeof(float)) : NULL;
        if (keep) memcpy(keep, kvt_llama_mtp_pending(s, w), (size_t)w->D * sizeof(float));
        bool got = kvt_rbuf_get(rb, st, kvt_llama_weights_state_bytes(w) - w->rec_at);
        if (got && keep) memcpy(kvt_llama_mtp_pending(s, w), keep, (size_t)w->D * sizeof(float));
        free(keep);
        if (!got) return kvt_fail(KVT_EFORMAT, "%s state: the DeltaNet layers' states are truncated", w->fam->name);
        if (kvt_llama_fault == KVT_LLAMA_FAULT_RING && n) ((float *)st)[0] += 1.0f;
    }
    return KVT_OK;
}

/* The cache at ctx tokens: full K and V rows of the global layers in
 * their types, the window layers' rings (in the same types) and the
 * DeltaNet layers' state (f32; both fixed). */
static int llama_plan(const kvt_model *m, uint64_t ctx, kvt_plan *out)
{
    const kvt_llama_weights *w = m->weights;
    memset(out, 0, sizeof *out);
    uint64_t row = 0;
    for (size_t i = 0; i < w->n_global; i++)
        row += kvt_rows_bytes(w->type_k, w->stream_kv[i]) + kvt_rows_bytes(w->type_v, w->stream_kv[i]);
    kvt_plan_add(out, "window", w->ring_at[w->n_ring], true);
    kvt_plan_add(out, "full rows", ctx * row, false);
    /* the MTP layer's rows (mtp_rows); its h_nextn is the state's last, in
     * the recurrent part a snapshot stores as its own */
    uint64_t mrow = w->mtp_rows ? kvt_rows_bytes(w->type_k, w->mtp->KV) + kvt_rows_bytes(w->type_v, w->mtp->KV) : 0;
    if (mrow) kvt_plan_add(out, "mtp rows", ctx * mrow, false);
    if (w->n_rec) kvt_plan_add(out, "recurrent", kvt_llama_weights_state_bytes(w) - w->rec_at, true);
    out->per_token_x1000 = 1000ull * (row + mrow);
    out->type_k = w->type_k;
    out->type_v = w->type_v;
    return KVT_OK;
}

static bool llama_routed(const kvt_model *m)
{
    const kvt_llama_weights *w = m->weights;
    bool r = w->fam->moe;
    for (uint32_t l = 0; l < w->L && !r; l++) r = w->layers[l].gate_inp != NULL;
    return r;
}

static int llama_cache_types(const kvt_model *m, kvt_row_type type_k, kvt_row_type type_v)
{
    return kvt_llama_weights_rows(m->weights, type_k, type_v, true);
}

#define LLAMA_OPS                                                                 \
    .handles = kvt_llama_weights_handles, .load = llama_load,                                 \
    .cache_types = llama_cache_types, .cache_new = llama_cache_new, .forward = llama_forward, .forward_batch = llama_forward_batch, \
    .fingerprint = kvt_llama_weights_fingerprint, .routed = llama_routed, \
    .weights_pack = kvt_llama_weights_pack, .weights_free = kvt_llama_weights_free, .plan = llama_plan,   \
    .work_new = llama_work_new, .work_free = llama_work_free, .work_bytes = llama_work_bytes

/* A model with window layers: the same operations and its state. */
static const kvt_arch arch_llama_window = {
    .name = "llama",
    LLAMA_OPS,
    .state_save = llama_state_save,
    .state_load = llama_state_load,
};

/* ---- the MTP layer's operations (kvt_mtp_ops) ---- */

static uint32_t llama_mtp_layers(const kvt_model *m) { return ((const kvt_llama_weights *)m->weights)->mtp ? 1 : 0; }

static size_t llama_mtp_hidden_floats(const kvt_model *m) { return ((const kvt_llama_weights *)m->weights)->D; }

static size_t llama_mtp_window(const kvt_model *m)
{
    (void)m;
    return KVT_LLAMA_MTP_RING;
}

static size_t llama_mtp_ring_bytes(const kvt_model *m)
{
    const kvt_llama_weights *w = m->weights;
    size_t KV = w->mtp ? w->mtp->KV : 0;
    return KVT_LLAMA_MTP_RING * (kvt_rows_bytes(w->type_k, KV) + kvt_rows_bytes(w->type_v, KV));
}

/* The h_nextn of the session's last position, which its state keeps. */
static int llama_mtp_hidden(const kvt_session *s, size_t pos, float *out)
{
    const kvt_llama_weights *w = s->m->weights;
    if (!w->mtp_rows || !s->cache || pos + 1 != s->n) return KVT_ENOENT;
    memcpy(out, kvt_llama_mtp_pending(s, w), (size_t)w->D * sizeof(float));
    return KVT_OK;
}

/* One step of the layer for token tok at position pos (>= s->n: a draft's)
 * and h_nextn hin of pos - 1: its row into the ring; unless row_only, its
 * h_nextn into hout and the logits of the token at pos + 1. */
static int llama_mtp_step(kvt_session *s, uint16_t *ring, const float *hin, int32_t tok, size_t pos, bool row_only,
                          float *hout, float *logits)
{
    const kvt_llama_weights *w = s->m->weights;
    const kvt_llama_layer *ly = w->mtp;
    llama_work *wk = s->work;
    if (!ly || !w->mtp_rows)
        return kvt_fail(KVT_EUNSUPPORTED, "the model keeps no MTP rows (kvt_model_set_mtp_rows before its sessions)");
    if (!wk) return kvt_fail(KVT_EINVAL, "MTP: the session has no scratch");
    if (tok < 0 || (uint32_t)tok >= w->V)
        return kvt_fail(KVT_EINVAL, "MTP: token id %d out of range [0, %u)", tok, w->V);
    if (pos >= wk->n_ctx || pos < s->n)
        return kvt_fail(KVT_ECTX, "MTP: position %zu outside [%zu, %zu)", pos, s->n, wk->n_ctx);
    kvt_pool *pool = s->pool;
    size_t D = w->D, hd = ly->hd, KV = ly->KV;
    float *x = wk->x, *xb = wk->xb, *q = wk->q;
    wk->tok[0] = tok; /* as a pass of one token would have them (the routers' test hooks read pos) */
    wk->pos[0] = pos;
    kvt_llama_mtp_input(w, wk->cat, tok, hin);
    kvt_matmul_w(pool, x, &w->eh, wk->cat, 1, wk->qx);
    kvt_rmsnorm(xb, x, ly->attn_norm, D, w->eps);
    kvt_matmul_w(pool, wk->qg, &ly->wq, xb, 1, wk->qx);
    kvt_matmul_w(pool, wk->k, &ly->wk, xb, 1, wk->qx);
    kvt_matmul_w(pool, wk->v, &ly->wv, xb, 1, wk->qx);
    for (size_t h = 0; h < ly->H; h++) memcpy(q + h * hd, wk->qg + h * 2 * hd, hd * sizeof(float));
    kvt_llama_mtp_qkv(w, q, ly->H, wk->k, wk->v, pos);
    size_t rk = kvt_rows_bytes(w->type_k, KV);
    uint8_t *row = (uint8_t *)ring + pos % KVT_LLAMA_MTP_RING * (rk + kvt_rows_bytes(w->type_v, KV));
    kvt_rows_put(w->type_k, row, wk->k, KV);
    kvt_rows_put(w->type_v, row + rk, wk->v, KV);
    if (row_only) return KVT_OK;
    kvt_llama_mtp_attend(s, w, (const uint8_t *)ring, q, wk->qg + hd, pos, wk->scores, wk->att);
    kvt_matmul_w(pool, xb, &ly->wo, wk->att, 1, wk->qx);
    for (size_t j = 0; j < D; j++) x[j] += xb[j];
    kvt_rmsnorm(xb, x, ly->ffn_norm, D, w->eps);
    ffn(pool, wk, w, w->L, 1); /* layers[L]: the MTP layer's own FFN */
    for (size_t j = 0; j < D; j++) x[j] += xb[j];
    kvt_rmsnorm(hout, x, w->mtp_norm ? w->mtp_norm : w->out_norm, D, w->eps);
    kvt_matmul_w(pool, logits, w->mtp_head.data ? &w->mtp_head : &w->out, hout, 1, wk->qx);
    return KVT_OK;
}

static int llama_mtp_keep_rows(kvt_model *m, bool on)
{
    kvt_llama_weights *w = m->weights;
    if (!w->mtp) return kvt_fail(KVT_EUNSUPPORTED, "the model has no MTP layer");
    w->mtp_rows = on;
    return KVT_OK;
}

static bool llama_mtp_rows_kept(const kvt_model *m) { return ((const kvt_llama_weights *)m->weights)->mtp_rows; }

static const kvt_mtp_ops llama_mtp = {
    .layers = llama_mtp_layers,
    .hidden_floats = llama_mtp_hidden_floats,
    .window = llama_mtp_window,
    .ring_bytes = llama_mtp_ring_bytes,
    .hidden = llama_mtp_hidden,
    .step = llama_mtp_step,
    .keep_rows = llama_mtp_keep_rows,
    .rows_kept = llama_mtp_rows_kept,
};

/* qwen35 with its MTP layer: the DeltaNet state and the layer. */
static const kvt_arch arch_llama_mtp = {
    .name = "llama",
    LLAMA_OPS,
    .state_save = llama_state_save,
    .state_load = llama_state_load,
    .mtp = &llama_mtp,
};

const kvt_arch kvt_arch_llama = {
    .name = "llama",
    LLAMA_OPS,
};
