/* The MTP drafter: DeepSeek-V4's and Qwen 3.5's multi-token prediction
 * layer (the file's nextn layer, run by its architecture's row:
 * kvt_arch.mtp) guesses the tokens after the sampled one, and
 * the model verifies them in one pass (generate.c, run in cli.c) as it
 * verifies n-gram drafts.
 *
 * The MTP layer reads the model's hidden state at p (its final streams)
 * and the embedding of the token at p + 1, and predicts the token at
 * p + 2; it runs at the position of that token, p + 1, as llama.cpp's MTP
 * batches do (its RoPE and window: the pair of p holds row p + 1 of the
 * ring). Its attention reads a window ring of its own rows; a
 * row depends on the layer's two inputs at its position alone. The first
 * guess of a pass is the layer at n - 1 (the model's hidden state of the
 * last token the session holds, the token just sampled); each further
 * guess chains on, the layer's own output streams standing for the
 * model's hidden state and the previous guess for the token.
 *
 * The rows of a pass's chained guesses are not the layer's rows of those
 * positions (those read the model's hidden states, which the verify pass
 * computes): they are marked as drafts, and the next pass, once the model
 * ran the kept tokens, writes every row of the window again from the
 * model's hidden states of the kept positions (kvt_mtp_ops.hidden: the
 * session's last forward pass, which is the verify pass or the rollback's
 * replay of the kept tokens). So the ring holds, before each pass's
 * guesses, exactly the rows a run of the layer over the verified tokens
 * would hold: the rollback of the layer's cache is that rewrite. A
 * position whose hidden state the drafter never saw (a prompt longer than
 * the prefill's last pass, by more than the window) gets a row from a zero
 * hidden state, marked as such.
 *
 * Qwen 3.5's layer attends to its rows of every earlier position, not a
 * window: there the session keeps the verified rows itself
 * (kvt_mtp_ops.keep_rows, kvt_model_set_mtp_rows), written by every forward
 * pass with the model's hidden states, and the h of its last position in
 * its state. Nothing is rewritten here: the ring holds a pass's chained
 * guesses' rows alone, the session's rollback is the layer's, and a session
 * restored from a snapshot drafts from its first pass. */
#include "serve/draft.h"
#include "serve/sampler.h"
#include "arch/model.h"
#include "base/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

enum { ROW_NONE, ROW_VERIFIED, ROW_DRAFT, ROW_NO_HIDDEN };

struct kvt_draft_mtp {
    kvt_session *s;             /* the model's session (borrowed) */
    size_t W, hf, rb, V;        /* window rows, floats of a hidden state, bytes of a row, logits */
    uint16_t *ring;             /* (W rows) the layer's window, the pair of p at (p + 1) mod W */
    int64_t *rpos;              /* (W) the pair (its p) each row holds (-1: none) */
    uint8_t *rkind;             /* (W) ROW_* */
    float *hid;                 /* (W + 1, hf) the model's hidden states, position p at p mod (W + 1) */
    int64_t *hpos;              /* (W + 1) */
    float *h, *hout, *zero;     /* (hf) each */
    float *logits;              /* (V) */
    bool failed;
    bool kept;                  /* the session keeps the verified rows (kvt_mtp_ops.rows_kept) */
};

int kvt_draft_mtp_check(const kvt_model *m, const char *what)
{
    if (m->arch->mtp && m->arch->mtp->layers(m) >= 1) return KVT_OK;
    return kvt_fail(KVT_EUNSUPPORTED, "--draft mtp: %s has no MTP (nextn) layer; it needs a DeepSeek-V4 or Qwen 3.5 "
                    "file with one (ARCH.nextn_predict_layers and blk.N.nextn.* tensors)", what ? what : "the model");
}

int kvt_draft_mtp_prepare(kvt_model *m)
{
    int rc = kvt_draft_mtp_check(m, m->info.name);
    if (rc || !m->arch->mtp->keep_rows) return rc;
    return kvt_model_set_mtp_rows(m, true);
}

int kvt_draft_mtp_attach(kvt_model *m, const char *path)
{
    if (!m->arch->mtp || !m->arch->mtp->attach)
        return kvt_fail(KVT_EUNSUPPORTED, "--draft mtp --model-draft %s: the model's architecture has no MTP layer",
                        path);
    if (m->arch->mtp->layers(m))
        return kvt_fail(KVT_EINVAL, "--draft mtp --model-draft %s: the model has its own MTP layer already", path);
    /* the fingerprint is the model's as opened: made (or read from its
     * cache) before the layer's weights join the ones it would hash */
    (void)kvt_model_fingerprint(m);
    kvt_gguf *g = NULL;
    int rc = kvt_gguf_open(&g, path);
    if (!rc && (rc = m->arch->mtp->attach(m, g))) kvt_gguf_close(g);
    if (rc) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", kvt_errmsg());
        return kvt_fail(rc, "--draft mtp --model-draft %s: %s", path, msg);
    }
    return KVT_OK;
}

int kvt_draft_mtp_write(const kvt_model *m, const char *path)
{
    int rc = kvt_draft_mtp_check(m, m->info.name);
    if (!rc && !m->arch->mtp->write_file)
        return kvt_fail(KVT_EUNSUPPORTED, "%s: its MTP layer has no separate file format", m->info.name);
    return rc ? rc : m->arch->mtp->write_file(m, path);
}

int kvt_draft_mtp_new(kvt_draft_mtp **out, kvt_session *s)
{
    *out = NULL;
    int rc = kvt_draft_mtp_check(s->m, s->m->info.name);
    if (rc) return rc;
    const kvt_mtp_ops *o = s->m->arch->mtp;
    if (o->keep_rows && !o->rows_kept(s->m))
        return kvt_fail(KVT_EINVAL, "--draft mtp: %s's sessions keep no MTP rows (kvt_model_set_mtp_rows before its "
                        "first session)", s->m->info.name);
    kvt_draft_mtp *d = kvt_calloc(1, sizeof *d);
    if (!d) return KVT_ENOMEM;
    d->s = s;
    d->kept = o->keep_rows != NULL;
    d->W = o->window(s->m);
    d->hf = o->hidden_floats(s->m);
    d->rb = o->ring_bytes(s->m) / d->W;
    d->V = s->m->info.n_vocab;
    d->ring = kvt_calloc(d->W, d->rb);
    d->rpos = kvt_malloc(d->W * sizeof *d->rpos);
    d->rkind = kvt_calloc(d->W, 1);
    d->hid = kvt_malloc((d->W + 1) * d->hf * sizeof(float));
    d->hpos = kvt_malloc((d->W + 1) * sizeof *d->hpos);
    d->h = kvt_malloc(d->hf * sizeof(float));
    d->hout = kvt_malloc(d->hf * sizeof(float));
    d->zero = kvt_calloc(d->hf, sizeof(float));
    d->logits = kvt_malloc(d->V * sizeof(float));
    if (!d->ring || !d->rpos || !d->rkind || !d->hid || !d->hpos || !d->h || !d->hout || !d->zero || !d->logits) {
        kvt_draft_mtp_free(d);
        return kvt_fail(KVT_ENOMEM, "no memory for the MTP drafter");
    }
    for (size_t i = 0; i < d->W; i++) d->rpos[i] = -1;
    for (size_t i = 0; i <= d->W; i++) d->hpos[i] = -1;
    *out = d;
    return KVT_OK;
}

void kvt_draft_mtp_free(kvt_draft_mtp *d)
{
    if (!d) return;
    free(d->ring);
    free(d->rpos);
    free(d->rkind);
    free(d->hid);
    free(d->hpos);
    free(d->h);
    free(d->hout);
    free(d->zero);
    free(d->logits);
    free(d);
}

bool kvt_draft_mtp_failed(const kvt_draft_mtp *d) { return d->failed; }

size_t kvt_draft_mtp_bytes(const kvt_draft_mtp *d)
{
    return sizeof *d + d->W * (d->rb + sizeof *d->rpos + 1) + (d->W + 1) * (d->hf * sizeof(float) + sizeof *d->hpos) +
           3 * d->hf * sizeof(float) + d->V * sizeof(float);
}

/* The model's hidden state of p, when the drafter holds it (NULL: not). */
static const float *hidden_at(const kvt_draft_mtp *d, size_t p)
{
    size_t k = p % (d->W + 1);
    return d->hpos[k] == (int64_t)p ? d->hid + k * d->hf : NULL;
}

int kvt_draft_mtp_follow(kvt_draft_mtp *d, const int32_t *ctx, size_t n)
{
    kvt_session *s = d->s;
    /* a session that has not run yet (a prompt the cache held whole) gets
     * its scratch now: the layer runs on it */
    int rc = kvt_session_work(s);
    if (rc || d->kept) return rc; /* the session holds the verified rows */
    /* the hidden states the model's last pass left, of the positions the
     * window reads (before any MTP step: it reuses the scratch) */
    for (size_t p = n > d->W + 1 ? n - d->W - 1 : 0; p < n; p++) {
        size_t k = p % (d->W + 1);
        if (d->hpos[k] == (int64_t)p) continue;
        if (s->m->arch->mtp->hidden(s, p, d->hid + k * d->hf) == KVT_OK) d->hpos[k] = (int64_t)p;
    }
    /* every row of the window but the last token's (whose next token is
     * not known yet), from the model's hidden states */
    for (size_t p = n > d->W ? n - d->W : 0; p + 1 < n; p++) {
        size_t k = (p + 1) % d->W;
        const float *h = hidden_at(d, p);
        if (d->rpos[k] == (int64_t)p && d->rkind[k] == ROW_VERIFIED) continue;
        if (!h && d->rpos[k] == (int64_t)p && d->rkind[k] == ROW_NO_HIDDEN) continue;
        rc = s->m->arch->mtp->step(s, d->ring, h ? h : d->zero, ctx[p + 1], p + 1, true, NULL, NULL);
        if (rc) return rc;
        d->rpos[k] = (int64_t)p;
        d->rkind[k] = h ? ROW_VERIFIED : ROW_NO_HIDDEN;
    }
    return KVT_OK;
}

size_t kvt_draft_mtp_propose(kvt_draft_mtp *d, const int32_t *ctx, size_t n, int32_t last, size_t max, int32_t *out)
{
    if (d->failed || !n) return 0;
    if (max > KVT_DRAFT_MAX_LIMIT) max = KVT_DRAFT_MAX_LIMIT;
    int rc = kvt_draft_mtp_follow(d, ctx, n);
    size_t got = 0;
    /* the first guess: the layer at n - 1 on the model's hidden state there
     * and the sampled token; then each on the one before */
    const float *h = d->kept ? NULL : hidden_at(d, n - 1);
    bool have = h != NULL;
    if (h) memcpy(d->h, h, d->hf * sizeof(float));
    if (d->kept && !rc) have = d->s->m->arch->mtp->hidden(d->s, n - 1, d->h) == KVT_OK;
    for (size_t i = 0; !rc && i < max; i++) {
        size_t p = n - 1 + i, k = (p + 1) % d->W;
        rc = d->s->m->arch->mtp->step(d->s, d->ring, i || have ? d->h : d->zero, i ? out[i - 1] : last, p + 1, false,
                                      d->hout, d->logits);
        if (rc) break;
        d->rpos[k] = (int64_t)p;
        d->rkind[k] = i == 0 ? (have ? ROW_VERIFIED : ROW_NO_HIDDEN) : ROW_DRAFT;
        if (i == 1 && kvt_draft_fault == KVT_DRAFT_FAULT_MTP_KEEP) d->rkind[k] = ROW_VERIFIED; /* tests */
        out[got++] = (int32_t)kvt_sampler_greedy(d->logits, (uint32_t)d->V);
        memcpy(d->h, d->hout, d->hf * sizeof(float));
    }
    if (rc) {
        fprintf(stderr, "kvtier: the MTP drafter is off for this reply: %s\n", kvt_errmsg());
        d->failed = true;
        return 0;
    }
    return got;
}

uint64_t kvt_draft_mtp_digest(const kvt_draft_mtp *d, size_t n)
{
    XXH3_state_t *st = XXH3_createState();
    if (!st) return 0;
    XXH3_64bits_reset(st);
    for (size_t p = n > d->W ? n - d->W : 0; p + 1 < n && !d->kept; p++) { /* kept: the session's */
        size_t k = (p + 1) % d->W;
        uint8_t kind = d->rpos[k] == (int64_t)p ? d->rkind[k] : ROW_NONE;
        XXH3_64bits_update(st, &kind, 1);
        if (kind != ROW_NONE) XXH3_64bits_update(st, (const uint8_t *)d->ring + k * d->rb, d->rb);
    }
    uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return h;
}
