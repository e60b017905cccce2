/* Token sampling: greedy (argmax, lowest id on ties) or temperature with
 * optional top-k and top-p. The uniform draw of the token at position p of
 * a reply is a pure function of (seed, p): output p + 1 of a splitmix64
 * generator started at the seed (splitmix64 is a counter hashed, so any
 * output is had without the ones before it). A reply is then the same
 * whether its tokens were sampled one at a time or verified several in a
 * pass (speculative decoding), and a given seed reproduces a run. */
#include "base/util.h"

#include <math.h>
#include <stdlib.h>

struct kvt_sampler {
    kvt_sampler_opts o;
    uint64_t next;          /* the position kvt_sampler_sample draws at */
    struct cand { float logit; int32_t id; } *cand;
    uint32_t cap;
};

/* Output pos + 1 of splitmix64 from seed. */
static uint64_t draw64(uint64_t seed, uint64_t pos)
{
    uint64_t x = seed + (pos + 1) * 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

int kvt_sampler_new(kvt_sampler **out, const kvt_sampler_opts *opts)
{
    kvt_sampler *s = kvt_calloc(1, sizeof *s);
    if (!s) return KVT_ENOMEM;
    s->o = *opts;
    if (!(s->o.top_p > 0 && s->o.top_p <= 1)) s->o.top_p = 1;
    *out = s;
    return KVT_OK;
}

void kvt_sampler_free(kvt_sampler *s)
{
    if (!s) return;
    free(s->cand);
    free(s);
}

static int cmp_cand(const void *a, const void *b)
{
    const struct cand *x = a, *y = b;
    if (x->logit != y->logit) return x->logit > y->logit ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

int32_t kvt_sampler_sample(kvt_sampler *s, const float *logits, uint32_t V)
{
    return kvt_sampler_sample_at(s, logits, V, s->next++);
}

int32_t kvt_sampler_sample_at(kvt_sampler *s, const float *logits, uint32_t V, uint64_t pos)
{
    if (!(s->o.temperature > 0)) {
        uint32_t best = 0;
        for (uint32_t i = 1; i < V; i++) if (logits[i] > logits[best]) best = i;
        return (int32_t)best;
    }
    if (s->cap < V) {
        free(s->cand);
        s->cand = malloc((size_t)V * sizeof *s->cand);
        if (!s->cand) { s->cap = 0; return -1; }
        s->cap = V;
    }
    for (uint32_t i = 0; i < V; i++) s->cand[i] = (struct cand){logits[i], (int32_t)i};
    qsort(s->cand, V, sizeof *s->cand, cmp_cand);
    uint32_t n = s->o.top_k && s->o.top_k < V ? s->o.top_k : V;
    double mx = s->cand[0].logit, z = 0;
    double *p = malloc((size_t)n * sizeof *p);
    if (!p) return s->cand[0].id;
    for (uint32_t i = 0; i < n; i++) { p[i] = exp((s->cand[i].logit - mx) / s->o.temperature); z += p[i]; }
    uint32_t keep = n;
    double cum = 0;
    for (uint32_t i = 0; i < n; i++) {
        cum += p[i] / z;
        if (cum >= s->o.top_p) { keep = i + 1; break; }
    }
    double mass = 0;
    for (uint32_t i = 0; i < keep; i++) mass += p[i];
    double u = (double)(draw64(s->o.seed, pos) >> 11) * (1.0 / 9007199254740992.0) * mass;
    int32_t id = s->cand[keep - 1].id;
    for (uint32_t i = 0; i < keep; i++) {
        if (u < p[i]) { id = s->cand[i].id; break; }
        u -= p[i];
    }
    free(p);
    return id;
}
