/* The ds4 architecture: DeepSeek-V4 as llama.cpp runs it (`deepseek4`):
 * hyper-connections, hybrid compressed attention with an indexer, and a
 * mixture of experts. docs/ds4.md gives the math, the GGUF layout and the
 * presets; the notes there say where kvtier follows llama.cpp rather than
 * the original checkpoint's code.
 *
 * Per layer the cache holds three entry classes:
 *
 *   window     the last W raw rows k_t (binary16), a ring indexed by t mod W,
 *              in the cache's fixed state area;
 *   frontier   the pooling inputs (ckv, csc) of the block not yet complete
 *              (for ratio 4 also the previous block's 4 entries the next row
 *              still needs), f32 rings indexed by t mod 8 (ratio 4) or t mod
 *              128 (ratio 128), also in the fixed state area;
 *   blocks     completed compressed rows (binary16) in cache streams: per
 *              128-token block a ratio-4 layer gains 32 rows plus 32 indexer
 *              rows, a ratio-128 layer 1 row.
 *
 * The residual is 4 hyper-connection streams per token; they live only in
 * the pass's scratch, never in the cache.
 *
 * Exactness: tokens of a chunk are pooled in position order by one thread, a
 * row becomes visible at the token that completes it, and attention for
 * position t reads exactly the rows visible at t in the canonical order
 * (compressed by increasing index, then window by increasing position), each
 * through the fixed-order kernels. The window ring is updated only after the
 * chunk's attention, reading rows of the chunk from the chunk's own buffer, so
 * chunk size never changes what a position sees. Experts run per token on
 * the rows routed to them; each output is a fixed-order dot product, so
 * which other tokens share a pass changes nothing: a batched pass
 * (forward_batch) runs several sessions' tokens through every matrix at
 * once, and what touches a session's state per segment on its own cache.
 *
 * The model's files are ds4_weights.c's: the configuration (presets, GGUF
 * metadata), the tensor table, the synthetic weights, the GGUF writers and
 * ds4.c's separate MTP file. This file runs the weights; the row's entries
 * that take a model check that it is a ds4 model, then hand its weights
 * there.
 */
#include "kernels/kernels.h"
#include "arch/ds4.h"
#include "arch/ds4_weights.h"
#include "arch/tensor.h"
#include "arch/moe.h"
#include "kernels/qkernels.h"
#include "format/quant.h"
#include "base/util.h"

#include <errno.h>
#include <malloc.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <unistd.h>
#include <xxhash.h>
#include <stdlib.h>
#include <string.h>

/* ---- cache ---- */

static int ds4_cache_new(kvt_session *s)
{
    const ds4_weights *w = s->m->weights;
    const ds4_config *c = &w->c;
    uint32_t spec[2 * MAX_LAYERS][2];
    for (uint32_t l = 0; l < c->L; l++) {
        const ds4_layer *ly = &w->layers[l];
        uint32_t r = c->ratio[l];
        if (ly->s_comp >= 0) { spec[ly->s_comp][0] = c->Dh * 2; spec[ly->s_comp][1] = KVT_BLOCK / r; }
        if (ly->s_idx >= 0) { spec[ly->s_idx][0] = c->Di * 2; spec[ly->s_idx][1] = KVT_BLOCK / 4; }
    }
    s->cache = kvt_cache_new(w->n_streams, (const uint32_t (*)[2])spec, s->n_ctx, w->state_bytes);
    return s->cache ? KVT_OK : KVT_ENOMEM;
}

static inline uint16_t *win_row(const kvt_cache *cache, const ds4_layer *ly, const ds4_config *c, size_t t)
{
    return (uint16_t *)(cache->state + ly->off_win) + (t % c->W) * c->Dh;
}

/* Frontier slot of token t: (ckv, csc) of width cw each. */
static inline float *front_slot(const kvt_cache *cache, size_t off, uint32_t r, size_t cw, size_t t)
{
    size_t slots = r == 4 ? 8 : 128;
    return (float *)(cache->state + off) + (t % slots) * 2 * cw;
}

#define to_f16 kvt_f32_row_to_f16
#define from_f16 kvt_f16_row_to_f32

/* Pool the block of ratio r that token t completes into out (width d), then
 * normalise, rotate and round it: one compressed row. Inputs come from the
 * frontier ring at offset off (slots of (ckv, csc), each cw = c*d wide). */
static void emit_row(const kvt_cache *cache, size_t off, uint32_t r, size_t d, size_t t, const float *norm_w,
                     float eps, size_t n_rot, float base, const kvt_yarn *y, size_t had, float *p, uint16_t *out)
{
    size_t b = (t + 1) / r - 1, first = b * r, cw = (r == 4 ? 2 : 1) * d;
    for (size_t j = 0; j < d; j++) {
        /* scores in canonical order: previous block (ratio 4), then this block */
        float m = -INFINITY, z = 0, acc = 0;
        size_t s0 = (r == 4 && b > 0) ? first - 4 : first;
        for (size_t s = s0; s <= t; s++) {
            const float *sl = front_slot(cache, off, r, cw, s);
            size_t col = (r == 4 && s >= first) ? d + j : j;
            float sc = sl[cw + col];
            m = sc > m ? sc : m;
        }
        for (size_t s = s0; s <= t; s++) {
            const float *sl = front_slot(cache, off, r, cw, s);
            size_t col = (r == 4 && s >= first) ? d + j : j;
            float e = kvt_expf(sl[cw + col] - m);
            z += e;
            acc = fmaf(e, sl[col], acc);
        }
        p[j] = acc / z;
    }
    kvt_rmsnorm(p, p, norm_w, d, eps);
    kvt_rope_ext(p + d - n_rot, n_rot, first, base, y, 1.0f);
    for (size_t j = 0; had && j < d; j += had) kvt_hadamard(p + j, had);
    to_f16(out, p, d);
}

/* ---- forward ---- */

/* Frontier tokens valid at n: the incomplete block, plus for ratio 4 the
 * previous complete block. */
static size_t front_start(uint32_t r, size_t n)
{
    size_t b = n / r * r;
    return r == 4 ? (b >= 4 ? b - 4 : 0) : b;
}

typedef struct cand { float score; uint32_t c; } cand;

/* A session's scratch, allocated when it is created (ds4_work_new) and sized
 * from its context: the activations of up to ch tokens (a longer chunk runs
 * in passes of ch, which changes nothing but the scratch: every position's
 * result is that of any chunking), the indexer's keys and dot products, and
 * per part of the pool the keys one token attends to with their scores and
 * the indexer's scores and heap. */
typedef struct ds4_work {
    size_t ch, n_ctx, parts;
    size_t maxc4;      /* indexer rows at n_ctx (0: no ratio-4 layer) */
    size_t nk;         /* keys one position attends to at most */
    float *x;          /* (ch, 4, D) the residual's hyper-connection streams */
    float *xn;         /* (ch, 4, D) the streams normed; then the next streams */
    float *mix;        /* (ch, 24) hyper-connection mixes */
    float *hc;         /* (ch, 24) per token pre (4), post (4), comb (16: [src][dst]) */
    float *h;          /* (ch, D) normed input */
    float *qr;         /* (ch, Rq) */
    float *q;          /* (ch, H*Dh) */
    float *kv;         /* (ch, Dh) */
    uint16_t *rows;    /* (ch, Dh) binary16 raw rows */
    float *ckv, *csc;  /* (ch, 2*max(Dh, Di)) compressor inputs and scores */
    float *iq;         /* (ch, Hi*Di) */
    float *iw;         /* (ch, Hi) */
    float *att;        /* (ch, H*Dh) */
    float *og;         /* (ch, H*Dh/og + 2*og*orank) one output group's inputs, the low-rank outputs, a group's */
    float *f1, *f3;    /* (ch, Fe * max(Es, Eu)): the shared experts, or one expert's tokens */
    float *lg;         /* (ch, E) router logits, then probabilities */
    uint32_t *ex;      /* (ch, Eu) each token's experts, in routing order */
    float *ew;         /* (ch, Eu) their weights */
    float *eo;         /* (ch, Eu, D) their outputs */
    uint32_t *rt;      /* (ch, Eu) the (token, slot) pairs one expert runs on */
    float *xe;         /* (ch, Eu, D) their inputs */
    float *tmp;        /* (ch, max(D, H*Dh, 24)) */
    uint8_t *qx;       /* a matmul's activations quantised for an integer-type matrix (qkernels.h); NULL: none */
    float *p;          /* (max(Dh, Di)) a pooled row */
    uint16_t *chk;     /* (max(Dh, Di)) a replayed row */
    uint32_t *sel;     /* (ch, K) selected indexer rows; NULL when K >= maxc4 (never selects) */
    uint32_t *nsel;    /* (ch) */
    float *kI;         /* (maxc4, Di) indexer keys */
    float *dots;       /* (slice, Hi, maxc) for slices of at most ndots floats */
    float *keys;       /* (parts, nk, Dh) */
    float *sc;         /* (parts, nk) */
    float *isc;        /* (parts, maxc4 + 1) when sel */
    cand *heap;        /* (parts, K + 1) when sel */
    /* the tap: x holds the final streams of the tokens tap_tok (tap_n of
     * them, from tap_pos0) of session tap_s's last pass (NULL: none) */
    const kvt_session *tap_s;
    size_t tap_pos0, tap_n;
    int32_t *tap_tok;  /* (ch) */
    int32_t *tok;      /* (ch) the pass's token ids, its segments' one after another */
    size_t *pos;       /* (ch) their RoPE positions */
    float *lgb;        /* (lgb_rows, V) a batched pass's logits, before each segment takes its own; made on demand */
    size_t lgb_rows;
} ds4_work;

typedef struct fwd {
    kvt_pool *pool;
    kvt_session *s;
    const kvt_cache *cache;    /* the window rings' (the session's, or the MTP drafter's ring) */
    size_t w_first;            /* the window's first position with a row (the MTP layer's: 1) */
    const ds4_weights *w;
    const ds4_layer *ly;
    ds4_work *wk;
    uint32_t l;
    size_t n, pos0;
    const float *q;        /* (n, H*Dh) rotated, normed queries */
    const uint16_t *rows;  /* (n, Dh) this chunk's raw rows */
    const float *iq;       /* (n, Hi*Di) indexer queries */
    const float *iw;       /* (n, Hi) indexer head weights */
    float *att;            /* (n, H*Dh) */
    /* indexer selection (ratio 4 with more than K visible rows) */
    const float *dots;     /* (ns, Hi, maxc) qI · kI for tokens [i_base, i_base + ns) */
    size_t i_base, maxc;
} fwd;

/* Is a better than b: higher score, then lower index. */
static inline bool better(cand a, cand b) { return a.score > b.score || (a.score == b.score && a.c < b.c); }

/* Min-heap on `better`; heap[0] is the worst of the kept. */
static void heap_sift(cand *h, size_t n, size_t i)
{
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && better(h[m], h[l])) m = l;
        if (r < n && better(h[m], h[r])) m = r;
        if (m == i) return;
        cand t = h[i]; h[i] = h[m]; h[m] = t;
        i = m;
    }
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

size_t kvt_ds4_topk(const float *score, size_t n, size_t k, uint32_t *sel, void *scratch)
{
    if (n <= k) {
        for (size_t i = 0; i < n; i++) sel[i] = (uint32_t)i;
        return n;
    }
    cand *heap = scratch;
    for (size_t i = 0; i < k; i++) heap[i] = (cand){score[i], (uint32_t)i};
    for (size_t j = k / 2 + 1; j-- > 0;) heap_sift(heap, k, j);
    for (size_t i = k; i < n; i++) {
        cand cd = {score[i], (uint32_t)i};
        if (better(cd, heap[0])) { heap[0] = cd; heap_sift(heap, k, 0); }
    }
    for (size_t j = 0; j < k; j++) sel[j] = heap[j].c;
    qsort(sel, k, sizeof *sel, cmp_u32);
    return k;
}

_Atomic size_t kvt_ds4_batch_passes;

/* Indexer top-k for tokens [i_base + j0, i_base + j1) from precomputed dots:
 * score_c = sum_h wI_h * relu(qI_h · kI_c), heads in order. */
static void select_range(void *arg, uint32_t part, size_t j0, size_t j1)
{
    fwd *f = arg;
    const ds4_config *c = &f->w->c;
    ds4_work *wk = f->wk;
    size_t Hi = c->Hi, maxc = f->maxc;
    float *isc = wk->isc + part * (wk->maxc4 + 1);
    cand *heap = wk->heap + part * ((size_t)c->K + 1);
    for (size_t j = j0; j < j1; j++) {
        size_t i = f->i_base + j, t = f->pos0 + i, ncomp = (t + 1) / 4;
        if (ncomp <= c->K) continue;
        const float *wi = f->iw + i * Hi, *d = f->dots + j * Hi * maxc;
        for (size_t k = 0; k < ncomp; k++) {
            float s = 0;
            for (size_t h = 0; h < Hi; h++) {
                float v = d[h * maxc + k];
                s = fmaf(wi[h], v > 0 ? v : 0, s);
            }
            isc[k] = s;
        }
        wk->nsel[i] = (uint32_t)kvt_ds4_topk(isc, ncomp, c->K, wk->sel + i * c->K, heap);
        const kvt_forced *fz = kvt_force;
        if (fz && t < fz->n && fz->K == c->K && fz->sel[f->l])
            kvt_moe_force_choice(fz->sel[f->l], fz->sel_gap[f->l], t, wk->sel + i * c->K, c->K, isc, ncomp, true);
    }
}

/* Score all visible indexer rows for every token of the chunk as one matrix
 * product per slice of tokens (each score is still one fixed-order dot
 * product), then select per token. */
static void index_select(fwd *f)
{
    const ds4_config *c = &f->w->c;
    ds4_work *wk = f->wk;
    size_t Di = c->Di, Hi = c->Hi, maxc = f->maxc;
    size_t slice = (size_t)(1u << 22) / (Hi * maxc); /* ~16 MB of dots (ds4_work_new sizes them) */
    if (slice < 1) slice = 1;
    if (slice > f->n) slice = f->n;
    for (size_t k = 0; k < maxc; k++) from_f16(wk->kI + k * Di, kvt_cache_row_ro(f->s->cache, f->ly->s_idx, k), Di);
    for (size_t i0 = 0; i0 < f->n; i0 += slice) {
        size_t ns = f->n - i0 < slice ? f->n - i0 : slice;
        kvt_matmul(f->pool, wk->dots, wk->kI, f->iq + i0 * Hi * Di, ns * Hi, Di, maxc);
        f->dots = wk->dots;
        f->i_base = i0;
        kvt_pool_for_part(f->pool, ns, 1, select_range, f);
    }
}

static void attn_range(void *arg, uint32_t part, size_t i0, size_t i1)
{
    fwd *f = arg;
    const ds4_config *c = &f->w->c;
    const ds4_layer *ly = f->ly;
    const kvt_cache *cache = f->cache;
    ds4_work *wk = f->wk;
    uint32_t r = c->ratio[f->l];
    size_t Dh = c->Dh, H = c->H;
    float *keys = wk->keys + part * wk->nk * Dh, *sc = wk->sc + part * wk->nk;
    float scale = 1.0f / sqrtf((float)Dh);
    for (size_t i = i0; i < i1; i++) {
        size_t t = f->pos0 + i, ncomp = r ? (t + 1) / r : 0, nsel = ncomp;
        const uint32_t *sel = NULL; /* NULL: every compressed row, in order */
        if (r == 4 && ncomp > c->K) { sel = wk->sel + i * c->K; nsel = wk->nsel[i]; }
        size_t nk = 0;
        for (size_t k = 0; k < nsel; k++)
            from_f16(keys + nk++ * Dh, kvt_cache_row_ro(cache, ly->s_comp, sel ? sel[k] : k), Dh);
        size_t w0 = t + 1 > c->W ? t + 1 - c->W : 0;
        if (w0 < f->w_first) w0 = f->w_first;
        if (kvt_ds4_fault == KVT_DS4_FAULT_MASK && w0 < t) w0++; /* tests: an off-by-one window */
        for (size_t p = w0; p <= t; p++) {
            const uint16_t *row = p >= f->pos0 ? f->rows + (p - f->pos0) * Dh : win_row(cache, ly, c, p);
            from_f16(keys + nk++ * Dh, row, Dh);
        }
        for (size_t h = 0; h < H; h++) {
            const float *q = f->q + (i * H + h) * Dh;
            float z = ly->sinks[h], m = z;
            kvt_dots_rows(sc, 1, q, Dh, 1, keys, Dh, nk, Dh, scale);
            for (size_t k = 0; k < nk; k++) m = sc[k] > m ? sc[k] : m;
            float den = kvt_expf(z - m);
            for (size_t k = 0; k < nk; k++) { sc[k] = kvt_expf(sc[k] - m); den += sc[k]; }
            float *o = f->att + (i * H + h) * Dh;
            memset(o, 0, Dh * sizeof(float));
            kvt_axpys_rows(o, Dh, sc, 0, 1, keys, Dh, nk, Dh);
            for (size_t d = 0; d < Dh; d++) o[d] /= den;
            kvt_rope_ext(o + Dh - c->Dr, c->Dr, t, r ? c->cbase : c->base, r ? &f->w->yarn : NULL, -1.0f);
        }
    }
}

#define WORK_BUFS 39
#define WB_KEYS 30 /* keys, sc, isc, heap: the per-part buffers, in work_bufs' order */

/* Every allocation of the scratch but k itself, WORK_BUFS of them. */
static void work_bufs(const ds4_work *k, void **b)
{
    void *all[WORK_BUFS] = {k->x, k->xn, k->mix, k->hc, k->h, k->qr, k->q, k->kv, k->rows, k->ckv, k->csc, k->iq,
                            k->iw, k->att, k->og, k->f1, k->f3, k->lg, k->ex, k->ew, k->eo, k->rt, k->xe, k->tmp,
                            k->p, k->chk, k->sel, k->nsel, k->kI, k->dots, k->keys, k->sc, k->isc, k->heap, k->qx,
                            k->tap_tok, k->tok, k->pos, k->lgb};
    memcpy(b, all, sizeof all);
}

static void ds4_work_free(void *p)
{
    ds4_work *k = p;
    if (!k) return;
    void *b[WORK_BUFS];
    work_bufs(k, b);
    for (size_t i = 0; i < WORK_BUFS; i++) free(b[i]);
    free(k);
}

static size_t ds4_work_bytes(const void *p)
{
    const ds4_work *k = p;
    void *b[WORK_BUFS];
    work_bufs(k, b);
    size_t n = malloc_usable_size((void *)k);
    for (size_t i = 0; i < WORK_BUFS; i++) n += malloc_usable_size(b[i]);
    return n;
}

static void work_sizes(const ds4_config *c, size_t ch, size_t n_ctx, size_t parts, size_t qb, size_t *sz,
                       size_t *maxc4, size_t *nk);

/* The per-part scratch for the pool's parts (again when the pool grew). */
static int parts_fit(ds4_work *k, const ds4_config *c, size_t parts)
{
    if (k->parts >= parts) return KVT_OK;
    size_t sz[WORK_BUFS], m4, nk;
    work_sizes(c, k->ch, k->n_ctx, parts, 0, sz, &m4, &nk);
    float *keys = kvt_malloc(sz[WB_KEYS]);
    float *sc = kvt_malloc(sz[WB_KEYS + 1]);
    float *isc = k->sel ? kvt_malloc(sz[WB_KEYS + 2]) : NULL;
    cand *heap = k->sel ? kvt_malloc(sz[WB_KEYS + 3]) : NULL;
    if (!keys || !sc || (k->sel && (!isc || !heap))) {
        free(keys); free(sc); free(isc); free(heap);
        return kvt_fail(KVT_ENOMEM, "ds4 attention scratch for %zu threads", parts);
    }
    free(k->keys); free(k->sc); free(k->isc); free(k->heap);
    k->keys = keys; k->sc = sc; k->isc = isc; k->heap = heap;
    k->parts = parts;
    return KVT_OK;
}

/* Tokens of one pass through the layers at most: the session's chunk, up to
 * this. A pass routes each token to Eu of E experts and runs each expert
 * once over its tokens, so a longer pass gives each expert more tokens a
 * matmul (Flash: about 6 of 256 per 256 tokens, 12 per 512), where the
 * low-bit kernels' panels pay (kernels/qlowbit.c, LB_TILE_FROM). */
#define MAX_PASS 512
/* The pass of a session with the default chunk (session.c: 256), which
 * info's estimate of the scratch assumes. */
#define DEFAULT_PASS 256

/* The bytes of each of a scratch's buffers (in work_bufs' order; 0: none)
 * for chunk ch, context n_ctx, parts of the pool and qb bytes of quantised
 * activations, with the scratch's maxc4 and nk: the one sizing ds4_work_new
 * allocates by and kvt_arch.work_estimate reports. Every size is bounded by
 * finish_config's limits and n_ctx <= 2^24: none overflows a 64-bit size_t. */
static void work_sizes(const ds4_config *c, size_t ch, size_t n_ctx, size_t parts, size_t qb, size_t *sz,
                       size_t *maxc4, size_t *nk)
{
    size_t D = c->D, Dh = c->Dh, HD = (size_t)c->H * c->Dh, Rq = c->Rq, Di = c->Di, Hi = c->Hi;
    size_t E = c->E, Eu = c->Eu, F = (size_t)c->Fe * (c->Es > Eu ? c->Es : Eu); /* the shared, or one expert's rows */
    size_t wide = Dh > Di ? Dh : Di, CW = 2 * wide, K = c->K;
    size_t OG = HD / c->og + 2 * (size_t)c->og * c->orank; /* a group's inputs, the low-rank outputs, one group's */
    size_t TW = D > HD ? D : HD;
    if (TW < HC_MIX) TW = HC_MIX;
    size_t nc = 0, m4 = 0; /* compressed rows one position attends to at most */
    for (uint32_t l = 0; l < c->L; l++) {
        size_t r = c->ratio[l], m = r ? n_ctx / r : 0;
        if (r == 4 && m > K) m = K;
        if (r == 4) m4 = n_ctx / 4;
        nc = m > nc ? m : nc;
    }
    size_t nkk = nc + c->W, f = sizeof(float);
    bool sel = m4 > K;
    /* the dots of index_select's slices: slice * Hi * maxc floats, where
     * slice = clamp(2^22 / (Hi * maxc), 1, n) with maxc <= maxc4 and n <= ch */
    size_t all = ch * Hi * m4, one = Hi * m4, big = one > (1u << 22) ? one : (1u << 22);
    size_t v[WORK_BUFS] = {
        ch * HC * D * f, ch * HC * D * f, ch * HC_MIX * f, ch * HC_MIX * f, ch * D * f, ch * Rq * f, ch * HD * f,
        ch * Dh * f, ch * Dh * 2, ch * CW * f, ch * CW * f, ch * Hi * Di * f, ch * Hi * f, ch * HD * f, ch * OG * f,
        ch * F * f, ch * F * f, ch * E * f, ch * Eu * sizeof(uint32_t), ch * Eu * f, ch * Eu * D * f,
        ch * Eu * sizeof(uint32_t), ch * Eu * D * f, ch * TW * f, wide * f, wide * 2,
        sel ? ch * K * sizeof(uint32_t) : 0, ch * sizeof(uint32_t), sel ? m4 * Di * f : 0,
        sel ? (all < big ? all : big) * f : 0, parts * nkk * Dh * f, parts * nkk * f,
        sel ? parts * (m4 + 1) * f : 0, sel ? parts * ((size_t)K + 1) * sizeof(cand) : 0, qb, ch * sizeof(int32_t),
        ch * sizeof(int32_t), ch * sizeof(size_t), 0};
    memcpy(sz, v, sizeof v);
    *maxc4 = m4;
    *nk = nkk;
}

/* The largest activations the integer kernels quantise: at most ch tokens
 * through any matrix of the model. */
static size_t work_qbytes(const ds4_weights *w, size_t ch, int *rc)
{
    size_t qb = 0;
    tdesc *t = kvt_malloc(MAX_TENSORS * sizeof *t);
    if (!t) { *rc = KVT_ENOMEM; return 0; }
    size_t n = kvt_ds4_tensors((ds4_weights *)w, t);
    for (size_t i = 0; i < n; i++) {
        size_t b = t[i].mat ? kvt_q_act_bytes(t[i].mat->type, ch, t[i].mat->cols) : 0;
        qb = b > qb ? b : qb;
    }
    free(t);
    *rc = KVT_OK;
    return qb;
}

static int ds4_work_new(kvt_session *s)
{
    const ds4_weights *w = s->m->weights;
    const ds4_config *c = &w->c;
    size_t ch = s->chunk < MAX_PASS ? (s->chunk ? s->chunk : 1) : MAX_PASS, n_ctx = s->n_ctx;
    int rc;
    size_t qb = work_qbytes(w, ch, &rc);
    if (rc) return rc;
    ds4_work *k = kvt_calloc(1, sizeof *k);
    if (!k) return KVT_ENOMEM;
    k->ch = ch;
    k->n_ctx = n_ctx;
    size_t sz[WORK_BUFS];
    /* the per-part buffers come from parts_fit, which sizes them again as the pool grows */
    work_sizes(c, ch, n_ctx, 0, qb, sz, &k->maxc4, &k->nk);
    void **dst[WORK_BUFS] = {
        (void **)&k->x, (void **)&k->xn, (void **)&k->mix, (void **)&k->hc, (void **)&k->h, (void **)&k->qr,
        (void **)&k->q, (void **)&k->kv, (void **)&k->rows, (void **)&k->ckv, (void **)&k->csc, (void **)&k->iq,
        (void **)&k->iw, (void **)&k->att, (void **)&k->og, (void **)&k->f1, (void **)&k->f3, (void **)&k->lg,
        (void **)&k->ex, (void **)&k->ew, (void **)&k->eo, (void **)&k->rt, (void **)&k->xe, (void **)&k->tmp,
        (void **)&k->p, (void **)&k->chk, (void **)&k->sel, (void **)&k->nsel, (void **)&k->kI, (void **)&k->dots,
        (void **)&k->keys, (void **)&k->sc, (void **)&k->isc, (void **)&k->heap, (void **)&k->qx,
        (void **)&k->tap_tok, (void **)&k->tok, (void **)&k->pos, (void **)&k->lgb};
    bool ok = true;
    for (size_t i = 0; i < WORK_BUFS && ok; i++)
        if (sz[i] && !(*dst[i] = kvt_malloc(sz[i]))) ok = false;
    rc = ok ? parts_fit(k, c, kvt_pool_size(s->pool)) : KVT_ENOMEM;
    if (rc) {
        ds4_work_free(k);
        return rc == KVT_ENOMEM ? kvt_fail(KVT_ENOMEM, "ds4 scratch for %zu tokens of a %zu-token context", ch, n_ctx)
                                : rc;
    }
    s->work = k;
    return KVT_OK;
}

static inline float sigm(float v) { return 1.0f / (1.0f + kvt_expf(-v)); }

/* Sinkhorn on a token's comb (4 x 4, [src][dst]): softmax over dst, plus
 * eps, a column normalisation, then iters - 1 times rows and columns, each
 * sum plus eps (llama.cpp's build_hc_sinkhorn). */
static void sinkhorn(float *cb, uint32_t iters, float eps)
{
    for (size_t s = 0; s < HC; s++) {
        float *r = cb + s * HC, m = r[0], z = 0;
        for (size_t d = 1; d < HC; d++) m = r[d] > m ? r[d] : m;
        for (size_t d = 0; d < HC; d++) { r[d] = kvt_expf(r[d] - m); z += r[d]; }
        for (size_t d = 0; d < HC; d++) r[d] = r[d] / z + eps;
    }
    for (uint32_t it = 0; it < iters; it++) {
        if (it > 0)
            for (size_t s = 0; s < HC; s++) {
                float z = eps;
                for (size_t d = 0; d < HC; d++) z += cb[s * HC + d];
                for (size_t d = 0; d < HC; d++) cb[s * HC + d] /= z;
            }
        for (size_t d = 0; d < HC; d++) {
            float z = eps;
            for (size_t s = 0; s < HC; s++) z += cb[s * HC + d];
            for (size_t s = 0; s < HC; s++) cb[s * HC + d] /= z;
        }
    }
}

/* The mixes of n tokens' streams x (n, 4, D) through fn (out, 4D): each
 * token's streams normed as one vector of 4D. */
static void hc_mixes(kvt_pool *pool, ds4_work *wk, const ds4_config *c, const float *x, size_t n, const float *fn,
                     size_t out)
{
    size_t W4 = (size_t)HC * c->D;
    for (size_t i = 0; i < n; i++) kvt_rmsnorm(wk->xn + i * W4, x + i * W4, NULL, W4, c->eps);
    kvt_matmul(pool, wk->mix, fn, wk->xn, n, W4, out);
}

/* Collapse each token's streams with weights pre (stride apart) into h (n, D). */
static void hc_collapse(const float *x, size_t n, size_t D, const float *pre, size_t stride, float *h)
{
    for (size_t i = 0; i < n; i++) {
        const float *xi = x + i * HC * D, *p = pre + i * stride;
        float *o = h + i * D;
        for (size_t d = 0; d < D; d++) {
            float v = xi[d] * p[0];
            for (size_t k = 1; k < HC; k++) v = v + xi[k * D + d] * p[k];
            o[d] = v;
        }
    }
}

/* A sublayer's input: the hyper-connection coefficients of every token into
 * wk->hc, then the collapsed streams into h. */
static void hc_pre(kvt_pool *pool, ds4_work *wk, const ds4_config *c, const float *x, size_t n, const float *fn,
                   const float *base, const float *scale, float *h)
{
    hc_mixes(pool, wk, c, x, n, fn, HC_MIX);
    for (size_t i = 0; i < n; i++) {
        const float *m = wk->mix + i * HC_MIX;
        float *k = wk->hc + i * HC_MIX;
        for (size_t j = 0; j < HC; j++) k[j] = sigm(m[j] * scale[0] + base[j]) + c->hc_eps;
        for (size_t j = HC; j < 2 * HC; j++) k[j] = 2.0f * sigm(m[j] * scale[1] + base[j]);
        for (size_t j = 2 * HC; j < HC_MIX; j++) k[j] = m[j] * scale[2] + base[j];
        sinkhorn(k + 2 * HC, c->iters, c->hc_eps);
    }
    hc_collapse(x, n, c->D, wk->hc, HC_MIX, h);
}

/* The streams after a sublayer with output f (n, D): stream dst becomes
 * f * post[dst] + sum over src of x[src] * comb[src][dst]. */
static void hc_post(ds4_work *wk, const ds4_config *c, float *x, size_t n, const float *f)
{
    size_t D = c->D;
    for (size_t i = 0; i < n; i++) {
        const float *k = wk->hc + i * HC_MIX, *cb = k + 2 * HC, *xi = x + i * HC * D, *fi = f + i * D;
        float *o = wk->xn + i * HC * D;
        for (size_t dst = 0; dst < HC; dst++)
            for (size_t d = 0; d < D; d++) {
                float v = fi[d] * k[HC + dst];
                for (size_t src = 0; src < HC; src++) v = v + xi[src * D + d] * cb[src * HC + dst];
                o[dst * D + d] = v;
            }
    }
    memcpy(x, wk->xn, n * HC * D * sizeof(float));
}

/* The feed-forward of n tokens h (n, D) with ids tok at positions pos into
 * out (n, D): the routed experts, weighted, plus the shared experts. Every
 * matrix runs over all n tokens (of one session or of several), the
 * experts each over the tokens routed to it. */
static void moe(kvt_pool *pool, ds4_work *wk, const ds4_weights *w, uint32_t l, const int32_t *tok, const size_t *pos,
                const float *h, size_t n, float *out)
{
    const ds4_config *c = &w->c;
    const ds4_layer *ly = &w->layers[l];
    size_t D = c->D, E = c->E, Eu = c->Eu, Fe = c->Fe, Fs = (size_t)c->Fe * c->Es;
    kvt_matmul(pool, wk->lg, ly->gate_inp, h, n, D, E);
    for (size_t i = 0; i < n; i++) {
        float *p = wk->lg + i * E, *wt = wk->ew + i * Eu;
        uint32_t *ex = wk->ex + i * Eu;
        for (size_t e = 0; e < E; e++) p[e] = sqrtf(p[e] > 20.0f ? p[e] : logf(1.0f + expf(p[e])));
        float sc[1024]; /* the selection scores: p + bias (E <= 1024: finish_config) */
        for (size_t e = 0; e < E; e++) sc[e] = p[e] + (ly->probs_b ? ly->probs_b[e] : 0);
        if (l < c->n_hash) {
            for (size_t j = 0; j < Eu; j++) ex[j] = (uint32_t)ly->tid2eid[(size_t)tok[i] * Eu + j];
        } else {
            kvt_moe_select(sc, E, Eu, ex);
        }
        const kvt_forced *fz = kvt_force;
        if (fz && pos[i] < fz->n && fz->Eu == Eu && fz->ex[l])
            kvt_moe_force_choice(fz->ex[l], fz->ex_gap[l], pos[i], ex, Eu, l < c->n_hash ? NULL : sc, E, false);
        for (size_t j = 0; j < Eu; j++) wt[j] = p[ex[j]];
        if (c->wnorm) kvt_moe_normalise(wt, Eu);
        if (c->wscale != 0.0f && c->wscale != 1.0f) /* llama.cpp: 0 is "no scale" too */
            for (size_t j = 0; j < Eu; j++) wt[j] *= c->wscale;
    }
    /* the shared experts, then the routed ones added to them */
    kvt_matmul_w(pool, wk->f1, &ly->gate_s, h, n, wk->qx);
    kvt_matmul_w_next(pool, wk->f3, &ly->up_s, &ly->gate_s, h, n, wk->qx);
    kvt_moe_swiglu(wk->f1, wk->f3, n * Fs, c->clamp_sh[l]);
    kvt_matmul_w(pool, out, &ly->down_s, wk->f1, n, wk->qx);
    kvt_moe m = {&ly->gate_x, &ly->up_x, &ly->down_x, E, Eu, Fe, D, c->clamp_exp[l]};
    kvt_moe_scratch sc = {wk->xe, wk->eo, wk->f1, wk->f3, wk->rt, wk->qx};
    kvt_moe_run(pool, &m, h, n, wk->ex, wk->ew, &sc, out);
}

/* Layer l over the streams xl of k segments' tokens one after another (nn
 * in all, ids tok, RoPE positions pos): matrix products and per-token steps
 * over all of them; what reads or writes a session's state (frontiers,
 * compressed rows, the indexer's selection, attention, the window ring in
 * win, or each session's cache when win is NULL) per segment on its own.
 * lead, replay, replay_from: forward_pass's replay of one segment (it
 * recomputes and compares the compressed rows it can make exact).
 * row_only: stop once the window ring holds the tokens' raw rows (the MTP
 * layer's rows of positions already verified: the streams are left). */
static int layer_run(kvt_pool *pool, ds4_work *wk, const kvt_seg *sg, size_t k, const kvt_cache *win, uint32_t l,
                     float *xl, const int32_t *tok, const size_t *pos, bool replay, size_t replay_from, size_t lead,
                     bool row_only)
{
    const ds4_weights *w = sg[0].s->m->weights;
    const ds4_config *c = &w->c;
    size_t D = c->D, Dh = c->Dh, HD = (size_t)c->H * c->Dh, Rq = c->Rq, Di = c->Di, Hi = c->Hi;
    size_t og = c->og, orank = c->orank, gd = HD / og, nn = 0;
    for (size_t g = 0; g < k; g++) nn += sg[g].n;
    float *h = wk->h, *qr = wk->qr, *q = wk->q, *kv = wk->kv, *ckv = wk->ckv, *csc = wk->csc;
    float *iq = wk->iq, *iw = wk->iw, *att = wk->att, *tmp = wk->tmp, *p = wk->p;
    uint16_t *rows = wk->rows, *chk = wk->chk;
    const ds4_layer *ly = &w->layers[l];
    uint32_t r = c->ratio[l];
    float base = r ? c->cbase : c->base;
    const kvt_yarn *yarn = r && kvt_ds4_fault != KVT_DS4_FAULT_YARN ? &w->yarn : NULL; /* tests: plain RoPE */
    hc_pre(pool, wk, c, xl, nn, ly->hca_fn, ly->hca_base, ly->hca_scale, h);
    for (size_t i = 0; i < nn; i++) kvt_rmsnorm(h + i * D, h + i * D, ly->attn_norm, D, c->eps);
    /* raw rows: key and value at once */
    kvt_matmul_w(pool, kv, &ly->wkv, h, nn, wk->qx);
    for (size_t i = 0; i < nn; i++) {
        float *kr = kv + i * Dh;
        kvt_rmsnorm(kr, kr, ly->kv_norm, Dh, c->eps);
        kvt_rope_ext(kr + Dh - c->Dr, c->Dr, pos[i], base, yarn, 1.0f);
        to_f16(rows + i * Dh, kr, Dh);
    }
    if (row_only) {
        for (size_t g = 0, off = 0; g < k; off += sg[g++].n)
            for (size_t i = sg[g].n > c->W ? sg[g].n - c->W : 0; i < sg[g].n; i++)
                memcpy(win_row(win ? win : sg[g].s->cache, ly, c, sg[g].pos0 + i), rows + (off + i) * Dh, Dh * 2);
        return KVT_OK;
    }
    /* queries */
    kvt_matmul_w(pool, tmp, &ly->wqa, h, nn, wk->qx);
    for (size_t i = 0; i < nn; i++) kvt_rmsnorm(qr + i * Rq, tmp + i * Rq, ly->q_norm, Rq, c->eps);
    kvt_matmul_w(pool, q, &ly->wqb, qr, nn, wk->qx);
    for (size_t i = 0; i < nn; i++)
        for (size_t hh = 0; hh < c->H; hh++) {
            float *qh = q + (i * c->H + hh) * Dh;
            kvt_rmsnorm(qh, qh, NULL, Dh, c->eps);
            kvt_rope_ext(qh + Dh - c->Dr, c->Dr, pos[i], base, yarn, 1.0f);
        }
    /* compressors: each segment pooled in position order into its own
     * session's frontier, rows emitted as blocks complete */
    for (int pass = 0; pass < (r == 4 ? 2 : r ? 1 : 0); pass++) {
        bool idx = pass == 1;
        size_t d = idx ? Di : Dh, cw = (r == 4 ? 2 : 1) * d, off = idx ? ly->off_if : ly->off_cf;
        int stream = idx ? ly->s_idx : ly->s_comp;
        const kvt_wmat *wkv_c = idx ? &ly->i_kv : &ly->c_kv, *wg_c = idx ? &ly->i_gate : &ly->c_gate;
        kvt_matmul_w(pool, ckv, wkv_c, h, nn, wk->qx);
        kvt_matmul_w_next(pool, csc, wg_c, wkv_c, h, nn, wk->qx);
        const float *ape = idx ? ly->i_ape : ly->c_ape;
        for (size_t g = 0, o = 0; g < k; o += sg[g++].n) {
            kvt_cache *cache = sg[g].s->cache;
            size_t end = o + sg[g].n, p0 = sg[g].pos0; /* locals: the memcpy below could reach sg, as far as C knows */
            for (size_t i = o; i < end; i++) {
                size_t t = p0 + (i - o);
                float *sl = front_slot(cache, off, r, cw, t);
                memcpy(sl, ckv + i * cw, cw * sizeof(float));
                for (size_t j = 0; j < cw; j++) sl[cw + j] = csc[i * cw + j] + ape[(t % r) * cw + j];
                if ((t + 1) % r) continue;
                size_t row = (t + 1) / r - 1;
                uint16_t *out = chk; /* a replay recomputes rows its exact region pools, to compare */
                if (replay && replay_from && (r == 4 && row > 0 ? row * r - 4 : row * r) < lead) continue;
                if (!replay && !(out = kvt_cache_row(cache, (size_t)stream, row)))
                    return kvt_fail(KVT_ENOMEM, "ds4: compressed row for token %zu", t);
                emit_row(cache, off, r, d, t, idx ? ly->i_norm : ly->c_norm, c->eps, c->Dr, c->cbase, &w->yarn,
                         idx ? w->hd_idx : 0, p, out);
                if (replay && memcmp(chk, kvt_cache_row_ro(cache, (size_t)stream, row), d * 2))
                    return kvt_fail(KVT_ECORRUPT, "ds4 replay: layer %u row %zu differs from the stored row", l, row);
            }
        }
    }
    if (r == 4) {
        kvt_matmul_w(pool, iq, &ly->i_qb, qr, nn, wk->qx);
        size_t hd = w->hd_idx;
        for (size_t i = 0; i < nn; i++)
            for (size_t hh = 0; hh < Hi; hh++) {
                float *v = iq + (i * Hi + hh) * Di;
                kvt_rope_ext(v + Di - c->Dr, c->Dr, pos[i], c->cbase, &w->yarn, 1.0f);
                for (size_t j = 0; j < Di; j += hd) kvt_hadamard(v + j, hd);
            }
        kvt_matmul_w(pool, iw, &ly->i_proj, h, nn, wk->qx);
        float isc = 1.0f / sqrtf((float)(Di * Hi));
        for (size_t j = 0; j < nn * Hi; j++) iw[j] *= isc;
    }
    /* attention, each segment over its own session's rows; only after it
     * does the segment's ring take its rows. The MTP layer has no row at
     * position 0 (its first pair is the hidden state of 0 with the token
     * at 1, at position 1). */
    for (size_t g = 0, o = 0; g < k; o += sg[g++].n) {
        const kvt_cache *wc = win ? win : sg[g].s->cache;
        size_t n = sg[g].n, p0 = sg[g].pos0;
        fwd fa = {pool, sg[g].s, wc, l < c->L ? 0 : 1, w, ly, wk, l, n, p0, q + o * HD, rows + o * Dh,
                  iq + o * Hi * Di, iw + o * Hi, att + o * HD};
        fa.maxc = r ? (p0 + n) / r : 0;
        if (r == 4 && fa.maxc > c->K) index_select(&fa);
        kvt_pool_for_part(pool, n, 1, attn_range, &fa);
        for (size_t i = n > c->W ? n - c->W : 0; i < n; i++)
            memcpy(win_row(wc, ly, c, p0 + i), rows + (o + i) * Dh, Dh * 2);
    }
    /* grouped low-rank output: group g's heads through rows g*orank.. of wo_a */
    float *xg = wk->og, *oa = xg + nn * gd, *go = oa + nn * og * orank;
    for (size_t g = 0; g < og; g++) {
        for (size_t i = 0; i < nn; i++) memcpy(xg + i * gd, att + i * HD + g * gd, gd * sizeof(float));
        kvt_wmat wa = kvt_wmat_rows(&ly->woa, g * orank, orank);
        kvt_matmul_w(pool, go, &wa, xg, nn, wk->qx);
        for (size_t i = 0; i < nn; i++) memcpy(oa + (i * og + g) * orank, go + i * orank, orank * sizeof(float));
    }
    kvt_matmul_w(pool, tmp, &ly->wob, oa, nn, wk->qx);
    hc_post(wk, c, xl, nn, tmp);
    /* feed-forward */
    hc_pre(pool, wk, c, xl, nn, ly->hcf_fn, ly->hcf_base, ly->hcf_scale, h);
    for (size_t i = 0; i < nn; i++) kvt_rmsnorm(h + i * D, h + i * D, ly->ffn_norm, D, c->eps);
    moe(pool, wk, w, l, tok, pos, h, nn, tmp);
    hc_post(wk, c, xl, nn, tmp);
    return KVT_OK;
}

/* The output head over nl tokens' streams, xs's rows ri[0..nl) (NULL: its
 * first nl): the streams collapsed by the head's mixes, normed, through the
 * output matrix into logits (nl, V). The head is the model's, or for the
 * MTP layer (ly) its own parts where it has them. */
static void head_run(kvt_pool *pool, const ds4_weights *w, ds4_work *wk, const float *xs, size_t nl,
                     const uint32_t *ri, float *logits, const ds4_layer *ly)
{
    const ds4_config *c = &w->c;
    size_t D = c->D, W4 = (size_t)HC * D;
    float *h = wk->h;
    bool own = ly && ly->hh_fn && ly->hh_base && ly->hh_scale;
    const float *fn = own ? ly->hh_fn : w->hch_fn, *base = own ? ly->hh_base : w->hch_base;
    const float *scale = own ? ly->hh_scale : w->hch_scale;
    const float *norm = ly && ly->head_norm ? ly->head_norm : w->out_norm;
    const kvt_wmat *out = ly && ly->head.data ? &ly->head : &w->out;
    /* hc_mixes and hc_collapse, row by row from where each row is */
    for (size_t i = 0; i < nl; i++) kvt_rmsnorm(wk->xn + i * W4, xs + (ri ? ri[i] : i) * W4, NULL, W4, c->eps);
    kvt_matmul(pool, wk->mix, fn, wk->xn, nl, W4, HC);
    for (size_t i = 0; i < nl; i++) {
        for (size_t k = 0; k < HC; k++)
            wk->mix[i * HC + k] = sigm(wk->mix[i * HC + k] * scale[0] + base[k]) + c->hc_eps;
        hc_collapse(xs + (ri ? ri[i] : i) * W4, 1, D, wk->mix + i * HC, HC, h + i * D);
        kvt_rmsnorm(h + i * D, h + i * D, norm, D, c->eps);
    }
    kvt_matmul_w(pool, logits, out, h, nl, wk->qx);
}

/* A batched pass's logits: the nl rows of the segments that want them
 * through the head at once (into wk->lgb, which ds4_forward_batch sized),
 * then each segment's into its own buffer. */
static void batch_logits(kvt_pool *pool, const ds4_weights *w, ds4_work *wk, const kvt_seg *sg, size_t k, size_t nl)
{
    size_t V = w->c.V;
    uint32_t *ri = wk->rt; /* (ch * Eu) free after the layers */
    size_t r = 0;
    for (size_t g = 0, off = 0; g < k; off += sg[g++].n)
        for (size_t i = sg[g].logits ? sg[g].lfrom : sg[g].n; i < sg[g].n; i++) ri[r++] = (uint32_t)(off + i);
    head_run(pool, w, wk, wk->x, nl, ri, wk->lgb, NULL);
    r = 0;
    for (size_t g = 0; g < k; g++) {
        if (!sg[g].logits || sg[g].lfrom >= sg[g].n) continue;
        size_t m = sg[g].n - sg[g].lfrom;
        memcpy(sg[g].logits, wk->lgb + r * V, m * V * sizeof(float));
        r += m;
    }
}

/* Session s's tap (kvt_ds4_hidden) in its own scratch: the final streams x
 * of its n tokens tok from pos0, their last ones where its scratch holds
 * fewer (a batched pass ran them in the first session's scratch). */
static void tap_set(const kvt_session *s, const float *x, const int32_t *tok, size_t n, size_t pos0)
{
    ds4_work *o = s->work;
    if (!o) return;
    size_t W4 = kvt_ds4_hidden_floats(s->m), keep = n < o->ch ? n : o->ch, skip = n - keep;
    if (o->x != x) memcpy(o->x, x + skip * W4, keep * W4 * sizeof(float));
    memcpy(o->tap_tok, tok + skip, keep * sizeof *tok);
    o->tap_s = s;
    o->tap_pos0 = pos0 + skip;
    o->tap_n = keep;
}

/* One pass of the k segments' tokens (at most wk->ch in all) on the
 * scratch wk; every segment's results are those of a pass of it alone (see
 * layer_run). replay_from is SIZE_MAX for a normal pass. Otherwise the pass
 * (of one segment) is part of a replay that started at replay_from over a
 * cache whose stream rows are already complete (see ds4_state_rebuild):
 * the compressed rows are not written, and each one whose inputs the replay
 * has already made exact is recomputed and must equal the stored row. A
 * normal pass leaves each segment's final streams in its session's scratch
 * (the tap: what the MTP layer reads, kvt_ds4_hidden). */
static int forward_pass(kvt_pool *pool, ds4_work *wk, const kvt_seg *sg, size_t k, size_t replay_from)
{
    const ds4_weights *w = sg[0].s->m->weights;
    const ds4_config *c = &w->c;
    size_t D = c->D, W4 = (size_t)HC * D, n = 0, nl = 0;
    float *x = wk->x;
    bool replay = replay_from != SIZE_MAX;
    wk->tap_s = NULL;
    for (size_t g = 0; g < k; g++) {
        for (size_t i = 0; i < sg[g].n; i++, n++) {
            int32_t t = sg[g].tok[i];
            if (t < 0 || (uint32_t)t >= c->V) return kvt_fail(KVT_EINVAL, "token id %d out of range [0, %u)", t, c->V);
            wk->tok[n] = t;
            bool fault = kvt_ds4_fault == KVT_DS4_FAULT_BATCH_POS && g > 0; /* tests: the one before's positions on */
            wk->pos[n] = (fault ? sg[g - 1].pos0 + sg[g - 1].n : sg[g].pos0) + i;
            const kvt_wmat *te = &w->tok_embd;
            kvt_quant_to_f32(te->type, te->data + (size_t)t * te->row_bytes, x + n * W4, D);
            for (size_t j = 1; j < HC; j++) memcpy(x + n * W4 + j * D, x + n * W4, D * sizeof(float));
        }
        nl += sg[g].logits && sg[g].lfrom < sg[g].n ? sg[g].n - sg[g].lfrom : 0;
    }
    for (uint32_t l = 0; l < c->L; l++) {
        /* A replay skips the positions whose values at this layer cannot
         * reach what it keeps (see replay_start): they start exact at
         * replay_from + l(W-1). */
        size_t skip = 0, lead = replay ? replay_from + (size_t)l * (c->W - 1) : 0;
        if (replay && replay_from && lead > sg[0].pos0) skip = lead - sg[0].pos0 < n ? lead - sg[0].pos0 : n;
        if (skip == n) continue;
        kvt_seg one = {sg[0].s, sg[0].tok + skip, sg[0].n - skip, sg[0].pos0 + skip, NULL, SIZE_MAX};
        int rc = layer_run(pool, wk, skip ? &one : sg, k, NULL, l, x + skip * W4, wk->tok + skip, wk->pos + skip,
                           replay, replay_from, lead, false);
        if (rc) return rc;
    }
    if (k == 1 && sg[0].lfrom < n)
        head_run(pool, w, wk, x + sg[0].lfrom * W4, n - sg[0].lfrom, NULL, sg[0].logits, NULL);
    if (k > 1 && nl) batch_logits(pool, w, wk, sg, k, nl);
    if (replay) return KVT_OK;
    for (size_t g = 0, off = 0; g < k; off += sg[g++].n)
        tap_set(sg[g].s, x + off * W4, sg[g].tok, sg[g].n, sg[g].pos0);
    return KVT_OK;
}

/* ---- the MTP (nextn) layer ----
 *
 * As llama.cpp's deepseek4 MTP graph: the position's hidden streams h (the
 * model's final streams, before the output head) and the next token's
 * embedding e are normed (hnorm per stream, enorm), each stream becomes
 * eh_proj [e, h], and the streams go through a layer of raw attention over
 * a window ring of its own and a routed feed-forward, then the model's
 * output head. */

uint32_t kvt_ds4_mtp_layers(const kvt_model *m)
{
    return m->arch == &kvt_arch_ds4 ? ((const ds4_weights *)m->weights)->c.nextn : 0;
}

size_t kvt_ds4_hidden_floats(const kvt_model *m) { return (size_t)HC * ((const ds4_weights *)m->weights)->c.D; }

size_t kvt_ds4_mtp_window(const kvt_model *m) { return ((const ds4_weights *)m->weights)->c.W; }

size_t kvt_ds4_mtp_ring_bytes(const kvt_model *m)
{
    const ds4_config *c = &((const ds4_weights *)m->weights)->c;
    return (size_t)c->W * c->Dh * 2;
}

int kvt_ds4_hidden(const kvt_session *s, size_t pos, float *out)
{
    const ds4_work *wk = s->work;
    if (!wk || wk->tap_s != s || pos < wk->tap_pos0 || pos >= wk->tap_pos0 + wk->tap_n || pos >= s->n ||
        memcmp(wk->tap_tok, s->tokens + wk->tap_pos0, (pos + 1 - wk->tap_pos0) * sizeof(int32_t)))
        return KVT_ENOENT;
    size_t W4 = kvt_ds4_hidden_floats(s->m);
    memcpy(out, wk->x + (pos - wk->tap_pos0) * W4, W4 * sizeof(float));
    return KVT_OK;
}

int kvt_ds4_mtp_step(kvt_session *s, uint16_t *ring, const float *hin, int32_t tok, size_t pos, bool row_only,
                     float *hout, float *logits)
{
    const ds4_weights *w = s->m->weights;
    const ds4_config *c = &w->c;
    if (s->m->arch != &kvt_arch_ds4 || !c->nextn) return kvt_fail(KVT_EUNSUPPORTED, "the model has no MTP layer");
    ds4_work *wk = s->work;
    int rc;
    if (!wk || wk->ch < HC) return kvt_fail(KVT_EINVAL, "MTP: the session has no scratch of %d tokens", HC);
    if (tok < 0 || (uint32_t)tok >= c->V) return kvt_fail(KVT_EINVAL, "MTP: token id %d out of range [0, %u)", tok, c->V);
    if (pos >= wk->n_ctx || pos == 0) return kvt_fail(KVT_ECTX, "MTP: position %zu outside [1, %zu)", pos, wk->n_ctx);
    if ((rc = parts_fit(wk, c, kvt_pool_size(s->pool)))) return rc;
    wk->tap_s = NULL; /* the streams are the MTP's from here */
    const ds4_layer *ly = &w->layers[c->L];
    size_t D = c->D;
    float *cat = kvt_malloc(2 * HC * D * sizeof(float));
    if (!cat) return KVT_ENOMEM;
    const kvt_wmat *te = ly->emb.data ? &ly->emb : &w->tok_embd; /* as llama.cpp: its own rows when it has them */
    kvt_quant_to_f32(te->type, te->data + (size_t)tok * te->row_bytes, cat, D);
    kvt_rmsnorm(cat, cat, ly->enorm, D, c->eps);
    for (size_t k = 0; k < HC; k++) {
        if (k) memcpy(cat + k * 2 * D, cat, D * sizeof(float));
        kvt_rmsnorm(cat + k * 2 * D + D, hin + k * D, ly->hnorm, D, c->eps);
    }
    kvt_matmul_w(s->pool, wk->x, &ly->eh, cat, HC, wk->qx); /* the token's HC streams */
    free(cat);
    kvt_cache ring_cache;
    memset(&ring_cache, 0, sizeof ring_cache);
    ring_cache.state = (uint8_t *)ring;
    ring_cache.state_bytes = kvt_ds4_mtp_ring_bytes(s->m);
    kvt_seg one = {s, &tok, 1, pos, NULL, 1};
    wk->tok[0] = tok;
    wk->pos[0] = pos;
    rc = layer_run(s->pool, wk, &one, 1, &ring_cache, c->L, wk->x, wk->tok, wk->pos, false, SIZE_MAX, 0, row_only);
    if (rc || row_only) return rc;
    memcpy(hout, wk->x, (size_t)HC * D * sizeof(float));
    head_run(s->pool, w, wk, wk->x, 1, NULL, logits, ly);
    return KVT_OK;
}

/* Tokens [pos0, pos0 + n) in passes of at most wk->ch (see forward_pass). */
static int forward_chunk(kvt_session *s, const int32_t *tok, size_t n, size_t pos0, float *logits, size_t lfrom,
                         size_t replay_from)
{
    ds4_work *wk = s->work;
    int rc = parts_fit(wk, &((const ds4_weights *)s->m->weights)->c, kvt_pool_size(s->pool));
    if (rc) return rc;
    if (pos0 + n > wk->n_ctx) return kvt_fail(KVT_ECTX, "tokens up to %zu exceed the context", pos0 + n);
    size_t V = s->m->info.n_vocab;
    for (size_t done = 0; done < n && !rc;) {
        size_t m = n - done < wk->ch ? n - done : wk->ch;
        size_t lf = lfrom > done ? lfrom - done : 0; /* the pass's first row with logits */
        float *lg = NULL;
        if (logits && lf < m) lg = logits + (done + lf - lfrom) * V;
        else lf = m;
        kvt_seg one = {s, tok + done, m, pos0 + done, lg, lf};
        rc = forward_pass(s->pool, wk, &one, 1, replay_from);
        done += m;
    }
    return rc;
}

static int ds4_forward(kvt_session *s, const int32_t *tok, size_t n, size_t pos0, float *logits, size_t lfrom)
{
    return forward_chunk(s, tok, n, pos0, logits, lfrom, SIZE_MAX);
}

/* Segments of at most the first session's pass (wk->ch tokens) in all go
 * through one pass on its scratch (the others' contexts no larger than
 * its, which sizes the attention's and the indexer's scratch); a longer
 * batch runs as forwards one after another. */
static int ds4_forward_batch(const kvt_seg *sg, size_t k)
{
    ds4_work *wk = k ? sg[0].s->work : NULL;
    size_t total = 0, nl = 0, V = k ? sg[0].s->m->info.n_vocab : 0;
    bool one = k > 1 && wk;
    for (size_t g = 0; g < k && one; g++) {
        one = sg[g].n && sg[g].s->m == sg[0].s->m && sg[g].s->n_ctx <= wk->n_ctx && (!g || sg[g].s->work != wk);
        total += sg[g].n;
        nl += sg[g].logits && sg[g].lfrom < sg[g].n ? sg[g].n - sg[g].lfrom : 0;
    }
    int rc = KVT_OK;
    if (!one || total > wk->ch) {
        for (size_t g = 0; g < k && !rc; g++)
            rc = ds4_forward(sg[g].s, sg[g].tok, sg[g].n, sg[g].pos0, sg[g].logits, sg[g].lfrom);
        return rc;
    }
    if (wk->lgb_rows < nl) { /* the logits' rows, before any session changes */
        float *p = kvt_malloc(nl * V * sizeof(float));
        if (!p) return kvt_fail(KVT_ENOMEM, "ds4: logits of %zu rows", nl);
        free(wk->lgb);
        wk->lgb = p;
        wk->lgb_rows = nl;
    }
    kvt_pool *pool = sg[0].s->pool;
    rc = parts_fit(wk, &((const ds4_weights *)sg[0].s->m->weights)->c, kvt_pool_size(pool));
    for (size_t g = 0; g < k && !rc; g++)
        if (sg[g].pos0 + sg[g].n > sg[g].s->n_ctx)
            rc = kvt_fail(KVT_ECTX, "tokens up to %zu exceed the context", sg[g].pos0 + sg[g].n);
    if (!rc) rc = forward_pass(pool, wk, sg, k, SIZE_MAX);
    if (!rc) kvt_ds4_batch_passes++;
    return rc;
}

/* Where a replay that ends at n must start so that everything it leaves is
 * exact. Layer 0's input (the embedding) is exact at every position, and
 * attention at t reads the window rows t-W+1..t of its layer (the stored
 * compressed rows are exact), so the input of layer l is exact from
 * q + l(W-1) on. The state at n needs that for layer L-1 at the window's
 * first position n-W, at the first frontier token of every compressing
 * layer, and (for the logits, which check the replay) at n-1 after the last
 * layer. */
static size_t replay_start(const ds4_config *c, size_t n)
{
    if (n == 0) return 0;
    size_t w1 = c->W - 1, win = n > c->W ? n - c->W : 0, lead = (size_t)c->L * w1;
    size_t need = n - 1 > lead ? n - 1 - lead : 0; /* the logits, after the last layer */
    for (uint32_t l = 0; l < c->L; l++) {
        size_t first = win; /* the first position layer l's state holds */
        if (c->ratio[l] && front_start(c->ratio[l], n) < first) first = front_start(c->ratio[l], n);
        lead = (size_t)l * w1;
        size_t q = first > lead ? first - lead : 0;
        if (q < need) need = q;
    }
    if (kvt_ds4_fault == KVT_DS4_FAULT_REPLAY && need > 0) need++; /* tests: one token short */
    return need;
}

/* Rebuild the fixed state at s->n from the token ids and the stream rows
 * alone: replay the last tokens from a zeroed state, then check the replay
 * against the stored logits. */
static int ds4_state_rebuild(kvt_session *s)
{
    const ds4_config *c = &((const ds4_weights *)s->m->weights)->c;
    size_t n = s->n, q = replay_start(c, n), chunk = ((ds4_work *)s->work)->ch;
    if (n == 0) return KVT_OK;
    float *lg = kvt_malloc((size_t)c->V * sizeof(float));
    if (!lg) return KVT_ENOMEM;
    memset(s->cache->state, 0, s->cache->state_bytes);
    int rc = KVT_OK;
    for (size_t pos = q; pos < n && !rc; pos += chunk) {
        size_t k = n - pos < chunk ? n - pos : chunk;
        rc = forward_chunk(s, s->tokens + pos, k, pos, lg, pos + k == n ? k - 1 : k, q);
    }
    if (!rc && memcmp(lg, s->logits, (size_t)c->V * sizeof(float)))
        rc = kvt_fail(KVT_ECORRUPT, "ds4 replay: the logits after %zu tokens differ from the stored ones", n);
    free(lg);
    return rc;
}

size_t kvt_ds4_replay_tokens(const kvt_model *m, size_t n)
{
    return n - replay_start(&((const ds4_weights *)m->weights)->c, n);
}

/* ---- state in logical order ---- */

static void ds4_state_save(const kvt_session *s, kvt_wbuf *b)
{
    const ds4_weights *w = s->m->weights;
    const ds4_config *c = &w->c;
    size_t n = s->n;
    for (uint32_t l = 0; l < c->L; l++) {
        const ds4_layer *ly = &w->layers[l];
        uint32_t r = c->ratio[l];
        for (size_t t = n > c->W ? n - c->W : 0; t < n; t++) kvt_wbuf_put(b, win_row(s->cache, ly, c, t), c->Dh * 2);
        for (int pass = 0; pass < (r == 4 ? 2 : r ? 1 : 0); pass++) {
            size_t d = pass ? c->Di : c->Dh, cw = (r == 4 ? 2 : 1) * d;
            for (size_t t = front_start(r, n); t < n; t++)
                kvt_wbuf_put(b, front_slot(s->cache, pass ? ly->off_if : ly->off_cf, r, cw, t), 2 * cw * sizeof(float));
        }
    }
}

static int ds4_state_load(kvt_session *s, size_t n, kvt_rbuf *rb)
{
    const ds4_weights *w = s->m->weights;
    const ds4_config *c = &w->c;
    for (uint32_t l = 0; l < c->L; l++) {
        const ds4_layer *ly = &w->layers[l];
        uint32_t r = c->ratio[l];
        for (size_t t = n > c->W ? n - c->W : 0; t < n; t++)
            if (!kvt_rbuf_get(rb, win_row(s->cache, ly, c, t), c->Dh * 2))
                return kvt_fail(KVT_EFORMAT, "ds4 state: window of layer %u truncated", l);
        for (int pass = 0; pass < (r == 4 ? 2 : r ? 1 : 0); pass++) {
            size_t d = pass ? c->Di : c->Dh, cw = (r == 4 ? 2 : 1) * d;
            for (size_t t = front_start(r, n); t < n; t++) {
                float *sl = front_slot(s->cache, pass ? ly->off_if : ly->off_cf, r, cw, t);
                if (!kvt_rbuf_get(rb, sl, 2 * cw * sizeof(float)))
                    return kvt_fail(KVT_EFORMAT, "ds4 state: frontier of layer %u truncated", l);
                if (kvt_ds4_fault == KVT_DS4_FAULT_FRONTIER) sl[0] += 1.0f; /* tests: a corrupt frontier */
            }
        }
    }
    return KVT_OK;
}

/* ---- memory accounting ---- */

/* The cache of a shape at ctx tokens, as kvtier lays it out: binary16 window
 * rings, compressed and indexer rows, f32 frontiers. */
static void plan_config(const ds4_config *c, uint64_t ctx, kvt_plan *out)
{
    memset(out, 0, sizeof *out);
    out->type_k = out->type_v = KVT_ROWS_F16; /* the model's own rows, whatever cache types are asked */
    out->rows_own = true;
    /* every part, even at 0 bytes: four names, in room for KVT_PLAN_MAX_PARTS */
    kvt_plan_add(out, "window", 0, true);
    kvt_plan_add(out, "compressed", 0, false);
    kvt_plan_add(out, "indexer", 0, false);
    kvt_plan_add(out, "frontier", 0, true);
    for (uint32_t l = 0; l < c->L; l++) {
        uint32_t r = c->ratio[l];
        kvt_plan_add(out, "window", (uint64_t)c->W * c->Dh * 2, true);
        if (r) {
            kvt_plan_add(out, "compressed", ctx / r * c->Dh * 2, false);
            out->per_token_x1000 += 1000ull * c->Dh * 2 / r;
            kvt_plan_add(out, "frontier", r == 4 ? 8ull * 4 * c->Dh * 4 : 128ull * 2 * c->Dh * 4, true);
        }
        if (r == 4) {
            kvt_plan_add(out, "indexer", ctx / 4 * c->Di * 2, false);
            out->per_token_x1000 += 1000ull * c->Di * 2 / 4;
            kvt_plan_add(out, "frontier", 8ull * 4 * c->Di * 4, true);
        }
    }
}

/* ---- ds4 files (general.architecture deepseek4), header only ---- */

static int ds4_describe(const kvt_gguf *g, uint64_t ctx, kvt_model_info *info, char *detail, size_t dlen,
                        kvt_plan *plan)
{
    ds4_config c;
    int rc = kvt_ds4_header_config(g, &c);
    if (rc) return rc;
    uint32_t count[3] = {0};
    for (uint32_t l = 0; l < c.L; l++) count[c.ratio[l] == 0 ? 0 : c.ratio[l] == 4 ? 1 : 2]++;
    uint64_t np = 0, bytes = 0;
    for (size_t i = 0; i < kvt_gguf_n_tensors(g); i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        np += t->n_elem;
        bytes += t->n_bytes;
    }
    *info = (kvt_model_info){.arch = "deepseek4", .name = "", .n_vocab = c.V, .n_ctx_train = c.ctx, .n_embd = c.D,
                             .n_layer = c.L, .n_head = c.H, .n_head_kv = 1, .head_dim = c.Dh, .n_ff = c.Fe,
                             .n_params = np, .bos = -1, .eos = -1, .tokenizer = ""};
    if (detail)
        snprintf(detail, dlen,
                 "experts %u (%u used, %u shared, first %u layers hash-routed), %u streams, window %u, "
                 "layers by compression ratio 0/4/128: %u/%u/%u, indexer %u heads x %u top-%u, "
                 "output %u groups of rank %u, %u prediction layers, %u tensors of %.2f GB",
                 c.E, c.Eu, c.Es, c.n_hash, HC, c.W, count[0], count[1], count[2], c.Hi, c.Di, c.K, c.og, c.orank,
                 c.nextn, (unsigned)kvt_gguf_n_tensors(g), bytes / 1e9);
    if (plan) plan_config(&c, ctx, plan);
    return KVT_OK;
}

/* The scratch ds4_work_new makes for a session of ctx tokens, the default
 * chunk (DEFAULT_PASS) and parts threads, from the header alone: the same
 * sizes (work_sizes), the quantised activations from the header's matrix
 * types (a file's types are kept as they are), without the allocator's
 * rounding. */
static int ds4_work_estimate(const kvt_gguf *g, uint64_t ctx, uint32_t parts, uint64_t *bytes)
{
    ds4_config c;
    int rc = kvt_ds4_header_config(g, &c);
    if (rc) return rc;
    if (ctx == 0 || ctx > (1u << 24)) return kvt_fail(KVT_EINVAL, "context of %llu tokens is out of range",
                                                      (unsigned long long)ctx);
    size_t qb = 0;
    for (size_t i = 0; i < kvt_gguf_n_tensors(g); i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        size_t b = t->n_dims >= 2 ? kvt_q_act_bytes(t->type, DEFAULT_PASS, t->ne[0]) : 0;
        qb = b > qb ? b : qb;
    }
    size_t sz[WORK_BUFS], m4, nk;
    work_sizes(&c, DEFAULT_PASS, ctx, parts ? parts : 1, qb, sz, &m4, &nk);
    uint64_t n = sizeof(ds4_work);
    for (size_t i = 0; i < WORK_BUFS; i++) n += sz[i];
    *bytes = n;
    return KVT_OK;
}

static int ds4_plan_preset(const char *preset, uint64_t ctx, kvt_plan *out)
{
    ds4_config c;
    if (!preset || !kvt_ds4_preset_config(preset, &c)) return kvt_fail(KVT_ENOENT, "no ds4 preset '%s'", preset ? preset : "");
    plan_config(&c, ctx, out);
    return KVT_OK;
}

static int ds4_plan(const kvt_model *m, uint64_t ctx, kvt_plan *out)
{
    if (m->arch != &kvt_arch_ds4) return kvt_fail(KVT_EINVAL, "not a ds4 model");
    plan_config(&((const ds4_weights *)m->weights)->c, ctx, out);
    return KVT_OK;
}

/* A preset, or a shape variant of one ("ds4-tiny+W=32,K=4": docs/ds4.md). */
static bool ds4_is_preset(const char *name)
{
    return !strcmp(name, "ds4-tiny") || !strcmp(name, "ds4-mini") || !strncmp(name, "ds4-tiny+", 9) ||
           !strncmp(name, "ds4-mini+", 9) || !strcmp(name, "ds4-flash-bench") || !strncmp(name, "ds4-flash-bench+", 16);
}

static bool ds4_handles(const kvt_gguf *g)
{
    const char *a;
    size_t n;
    return kvt_gguf_get_str(g, "general.architecture", &a, &n) == KVT_OK && n == 9 && !memcmp(a, "deepseek4", 9);
}

/* ---- the row's entries to the model's files (ds4_weights.c) ---- */

static int ds4_load(kvt_model *m, const kvt_gguf *g)
{
    int rc = kvt_ds4_weights_load(m, g);
    if (!rc) m->arch = &kvt_arch_ds4;
    return rc;
}

static int ds4_preset(kvt_model *m, const char *preset, uint64_t seed, kvt_tokenizer *tok)
{
    int rc = kvt_ds4_weights_preset(m, preset, seed, tok);
    if (!rc) m->arch = &kvt_arch_ds4;
    return rc;
}

int kvt_ds4_write_gguf(const kvt_model *m, const char *path)
{
    if (m->arch != &kvt_arch_ds4) return kvt_fail(KVT_EINVAL, "not a ds4 model");
    return kvt_ds4_weights_write_gguf(m, path);
}

int kvt_ds4_mtp_attach(kvt_model *m, kvt_gguf *g)
{
    if (m->arch != &kvt_arch_ds4) return kvt_fail(KVT_EUNSUPPORTED, "an MTP file goes with a deepseek4 model");
    return kvt_ds4_weights_mtp_attach(m, g);
}

int kvt_ds4_mtp_write_ds4c(const kvt_model *m, const char *path)
{
    if (m->arch != &kvt_arch_ds4 || !((const ds4_weights *)m->weights)->c.nextn)
        return kvt_fail(KVT_EINVAL, "not a ds4 model with an MTP layer");
    return kvt_ds4_weights_mtp_write(m, path);
}

/* The separate MTP file the layer borrows from (kvt_mtp_ops.file). */
static const kvt_gguf *ds4_mtp_file(const kvt_model *m) { return ((const ds4_weights *)m->weights)->mtp_file; }

static const kvt_mtp_ops ds4_mtp = {
    .layers = kvt_ds4_mtp_layers,
    .hidden_floats = kvt_ds4_hidden_floats,
    .window = kvt_ds4_mtp_window,
    .ring_bytes = kvt_ds4_mtp_ring_bytes,
    .hidden = kvt_ds4_hidden,
    .step = kvt_ds4_mtp_step,
    .attach = kvt_ds4_mtp_attach,
    .write_file = kvt_ds4_mtp_write_ds4c,
    .file = ds4_mtp_file,
};

/* Every DeepSeek-V4 layer routes its tokens to experts. */
static bool ds4_routed(const kvt_model *m)
{
    (void)m;
    return true;
}

const kvt_arch kvt_arch_ds4 = {
    .name = "ds4",
    .handles = ds4_handles,
    .load = ds4_load,
    .describe = ds4_describe,
    .work_estimate = ds4_work_estimate,
    .is_preset = ds4_is_preset,
    .presets = "ds4-tiny, ds4-mini",
    .preset = ds4_preset,
    .plan_preset = ds4_plan_preset,
    .write_gguf = kvt_ds4_write_gguf,
    .write_preset = kvt_ds4_write_preset,
    .replay_tokens = kvt_ds4_replay_tokens,
    .plan = ds4_plan,
    .cache_new = ds4_cache_new,
    .forward = ds4_forward,
    .forward_batch = ds4_forward_batch,
    .routed = ds4_routed,
    .state_save = ds4_state_save,
    .state_load = ds4_state_load,
    .state_rebuild = ds4_state_rebuild,
    .fingerprint = kvt_ds4_weights_fingerprint,
    .weights_free = kvt_ds4_weights_free,
    .work_new = ds4_work_new,
    .work_free = ds4_work_free,
    .work_bytes = ds4_work_bytes,
    .mtp = &ds4_mtp,
};
