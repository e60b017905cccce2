/* Token sampling: greedy (argmax, lowest id on ties) or temperature with
 * optional top-k and top-p. The uniform draw of the token at position p of
 * a reply is a pure function of (seed, p): output p + 1 of a splitmix64
 * generator started at the seed (splitmix64 is a counter hashed, so any
 * output is had without the ones before it). A reply is then the same
 * whether its tokens were sampled one at a time or verified several in a
 * pass (speculative decoding), and a given seed reproduces a run.
 *
 * The candidates are ordered, largest logit first and the lowest id among
 * equal ones (-0 equals +0), by a radix sort of the logits' bits (four
 * stable passes of 8 bits over the ids in order): the order a comparison
 * sort gives, at a tenth of its time over a 32,000-token vocabulary
 * (each token of a reply at a temperature sorts them all). */
#include "serve/sampler.h"
#include "base/util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int kvt_sampler_fault;

struct kvt_sampler {
    kvt_sampler_opts o;
    uint64_t next;          /* the position kvt_sampler_sample draws at */
    struct cand { float logit; int32_t id; } *cand, *tmp;
    uint32_t *key, *key2;       /* the sort's keys, in the order of cand and tmp */
    double *p;                  /* the candidates' weights */
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
    free(s->tmp);
    free(s->key);
    free(s->key2);
    free(s->p);
    free(s);
}

/* A key that grows as the logit shrinks: the float's bits made to order as
 * unsigned integers, then inverted; -0 is +0 first, so that the two tie. */
static uint32_t desc_key(float f)
{
    if (f == 0 && kvt_sampler_fault != KVT_SAMPLER_FAULT_SIGNED_ZERO) f = 0;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = u >> 31 ? ~u : u | 0x80000000u;
    return ~u;
}

/* s->cand[0, V) ordered: largest logit first, the lowest id among equal
 * ones (LSD radix sort, stable, from the ids in order). */
static void sort_cand(kvt_sampler *s, const float *logits, uint32_t V)
{
    struct cand *a = s->cand, *b = s->tmp;
    uint32_t *ka = s->key, *kb = s->key2;
    for (uint32_t i = 0; i < V; i++) {
        a[i] = (struct cand){logits[i], (int32_t)i};
        ka[i] = desc_key(logits[i]);
    }
    for (int shift = 0; shift < 32; shift += 8) {
        uint32_t count[257] = {0};
        for (uint32_t i = 0; i < V; i++) count[((ka[i] >> shift) & 255) + 1]++;
        if (count[((ka[0] >> shift) & 255) + 1] == V) continue; /* one digit for all: the order stands */
        for (int d = 0; d < 256; d++) count[d + 1] += count[d];
        for (uint32_t i = 0; i < V; i++) {
            uint32_t at = count[(ka[i] >> shift) & 255]++;
            b[at] = a[i];
            kb[at] = ka[i];
        }
        struct cand *tc = a; a = b; b = tc;
        uint32_t *tk = ka; ka = kb; kb = tk;
    }
    if (a != s->cand) memcpy(s->cand, a, (size_t)V * sizeof *a);
}

int32_t kvt_sampler_sample(kvt_sampler *s, const float *logits, uint32_t V)
{
    return kvt_sampler_sample_at(s, logits, V, s->next++);
}

/* Greedy: the id the loop `if (x[i] > x[best]) best = i` from best = 0
 * ends at: the lowest id whose logit equals the largest (-0 equals +0),
 * NaNs never taken unless at id 0, where the loop starts and then stays.
 * That loop's compare reads x[best], which its previous step chose (the
 * compiler makes it a conditional move): a chain of dependent loads, 120 us
 * over 32,000 logits on the 2-core EPYC VM, 2% of a 124.7M model's decode
 * step, during which the pool's other threads wait. Here the largest value
 * is found in LANES independent chains (each taking x > m ? x : m, which
 * skips NaNs as the loop does), then its first occurrence: the same id, in
 * 11.5 us. */
#define LANES 16
uint32_t kvt_sampler_greedy(const float *x, uint32_t V)
{
    if (V < 2 || isnan(x[0])) return 0;
    float m[LANES];
    for (int l = 0; l < LANES; l++) m[l] = x[0];
    uint32_t i = 0;
    for (; i + LANES <= V; i += LANES)
        for (int l = 0; l < LANES; l++) m[l] = x[i + l] > m[l] ? x[i + l] : m[l];
    for (; i < V; i++) m[0] = x[i] > m[0] ? x[i] : m[0];
    float mx = m[0];
    for (int l = 1; l < LANES; l++) mx = m[l] > mx ? m[l] : mx;
    if (kvt_sampler_fault == KVT_SAMPLER_FAULT_GREEDY_LAST) { /* tests: the last of equal logits */
        for (i = V - 1; x[i] != mx; i--) {}
        return i;
    }
    for (i = 0; x[i] != mx; i++) {} /* mx is one of the logits: found */
    return i;
}

int32_t kvt_sampler_sample_at(kvt_sampler *s, const float *logits, uint32_t V, uint64_t pos)
{
    if (!(s->o.temperature > 0)) return (int32_t)kvt_sampler_greedy(logits, V);
    if (s->cap < V) {
        free(s->cand);
        free(s->tmp);
        free(s->key);
        free(s->key2);
        free(s->p);
        s->cand = malloc((size_t)V * sizeof *s->cand);
        s->tmp = malloc((size_t)V * sizeof *s->tmp);
        s->key = malloc((size_t)V * sizeof *s->key);
        s->key2 = malloc((size_t)V * sizeof *s->key2);
        s->p = malloc((size_t)V * sizeof *s->p);
        if (!s->cand || !s->tmp || !s->key || !s->key2 || !s->p) {
            free(s->cand), free(s->tmp), free(s->key), free(s->key2), free(s->p);
            s->cand = s->tmp = NULL;
            s->key = s->key2 = NULL;
            s->p = NULL;
            s->cap = 0;
            return -1;
        }
        s->cap = V;
    }
    sort_cand(s, logits, V);
    uint32_t n = s->o.top_k && s->o.top_k < V ? s->o.top_k : V;
    double mx = s->cand[0].logit, z = 0, *p = s->p;
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
    return id;
}
