/* The sampler (src/serve/sampler.c) against a reference written here from
 * what kvtier.h and the sampler's header promise, not from its code:
 *
 *   sampler_greedy      temperature <= 0 is argmax, the lowest id on ties
 *                       (also for a NaN or negative temperature)
 *   sampler_reference   seeded draws equal the reference's draw for draw:
 *                       candidates ordered by logit, then id; the first
 *                       top_k of them (0: all); softmax at the temperature;
 *                       the shortest head whose probability reaches top_p;
 *                       the uniform of position i, output i + 1 of
 *                       splitmix64 from the seed, over that head's mass,
 *                       by its cumulative sums. Six
 *                       settings (temperature 0.3 to 2, top-k off, 1, 5 and
 *                       50, top-p off, 0.5 and 0.9) over 1,000 logits with
 *                       ties, 2,000 draws each. Control: the same check
 *                       against the reference without its top-p cut, or
 *                       with another seed, fails.
 *   sampler_frequencies the ids drawn 40,000 times follow the reference's
 *                       probabilities (every id within 5 standard
 *                       deviations plus 0.001 of its probability), and no
 *                       id outside the top-k and top-p head is drawn: a
 *                       check that does not depend on the generator's
 *                       sequence. Control: the probabilities at another
 *                       temperature (0.8 for 1) fail it.
 *   sampler_seeds       one seed gives one sequence; another seed another.
 *   sampler_positions   a position's draw depends on (seed, position) only.
 *   sampler_greedy_lanes greedy's search in independent lanes gives the id
 *                       of the loop `if (x[i] > x[best]) best = i` from 0,
 *                       over 3,000 vectors of 1 to 70 logits and 200 of
 *                       32,000 (sizes that end inside and outside a lane
 *                       group), with ties of the largest, -0 and +0, NaNs
 *                       (also at id 0, which the loop keeps) and
 *                       infinities. Control: the fault switch that takes
 *                       the last of equal largest logits fails it.
 *   sampler_sort_vocab  over a 32,000-token vocabulary with ties, -0 and +0
 *                       and large values, the draws equal those of the
 *                       candidates ordered by a comparison sort (the order
 *                       the reference defines), draw for draw, and -0 ties
 *                       +0 (the lower id first). Control: the sampler's
 *                       fault switch orders -0 after +0, which fails it. */
#include "test.h"
#include "serve/sampler.h"
#include "base/util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- the reference ---- */

typedef struct ref_rng { uint64_t seed, pos; } ref_rng;

static void ref_seed(ref_rng *r, uint64_t seed)
{
    r->seed = seed;
    r->pos = 0;
}

/* the draw of position pos: output pos + 1 of splitmix64 (Steele, Lea and
 * Flood) from the seed, stepped here one output at a time */
static uint64_t ref_next(ref_rng *r)
{
    uint64_t z = r->seed;
    for (uint64_t i = 0; i <= r->pos; i++) z += 0x9e3779b97f4a7c15ull;
    r->pos++;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct ref_dist {
    uint32_t n;      /* ids in the head */
    int32_t id[1024];
    double p[1024];  /* unnormalised weights exp((l - max) / T), in order */
    double mass;     /* their sum */
} ref_dist;

/* The candidates in order by selection (largest logit, then smallest id),
 * cut at top_k, weighted, cut at top_p (no_top_p: not cut). */
static void ref_build(ref_dist *d, const float *lg, uint32_t V, float T, uint32_t top_k, float top_p, bool no_top_p)
{
    static bool used[1024];
    memset(used, 0, sizeof used);
    uint32_t k = top_k && top_k < V ? top_k : V;
    for (uint32_t j = 0; j < k; j++) {
        int32_t best = -1;
        for (uint32_t i = 0; i < V; i++)
            if (!used[i] && (best < 0 || lg[i] > lg[best])) best = (int32_t)i; /* ties: the first, lowest id */
        used[best] = true;
        d->id[j] = best;
    }
    double z = 0;
    for (uint32_t j = 0; j < k; j++) z += (d->p[j] = exp(((double)lg[d->id[j]] - lg[d->id[0]]) / T));
    d->n = k;
    if (!no_top_p && top_p > 0 && top_p < 1) {
        double cum = 0;
        for (uint32_t j = 0; j < k; j++) {
            cum += d->p[j] / z;
            if (cum >= top_p) { d->n = j + 1; break; }
        }
    }
    d->mass = 0;
    for (uint32_t j = 0; j < d->n; j++) d->mass += d->p[j];
}

static int32_t ref_draw(const ref_dist *d, ref_rng *r)
{
    double u = (double)(ref_next(r) >> 11) / 9007199254740992.0 * d->mass, cum = 0;
    for (uint32_t j = 0; j < d->n; j++) {
        cum += d->p[j];
        if (u < cum) return d->id[j];
    }
    return d->id[d->n - 1];
}

/* ---- the logits ---- */

enum { V = 1000 };

/* Logits from a seed, a quarter of them tied in pairs, a few large. */
static void logits(float *lg, uint64_t seed)
{
    for (uint32_t i = 0; i < V; i++) {
        double u = (double)(kvt_test_rand(&seed) >> 11) / 9007199254740992.0;
        lg[i] = (float)(u * 8 - 4);
        if (i % 97 == 0) lg[i] += 6;
    }
    for (uint32_t i = 0; i + 1 < V; i += 8) lg[i + 1] = lg[i];
}

typedef struct setting { float T; uint32_t top_k; float top_p; } setting;
static const setting settings[] = {
    {1.0f, 0, 1.0f}, {0.7f, 50, 1.0f}, {1.3f, 0, 0.9f}, {2.0f, 5, 0.5f}, {0.3f, 0, 0.5f}, {1.0f, 1, 1.0f},
};

/* Draws of the sampler that differ from the reference's, out of n. */
static uint32_t mismatches(const float *lg, const setting *c, uint64_t seed, uint64_t ref_seed_v, bool no_top_p,
                           uint32_t n)
{
    kvt_sampler *s = NULL;
    kvt_sampler_opts o = {.temperature = c->T, .top_p = c->top_p, .top_k = c->top_k, .seed = seed};
    if (kvt_sampler_new(&s, &o)) return n;
    static ref_dist d;
    ref_build(&d, lg, V, c->T, c->top_k, c->top_p, no_top_p);
    ref_rng r;
    ref_seed(&r, ref_seed_v);
    uint32_t bad = 0;
    for (uint32_t i = 0; i < n; i++) bad += kvt_sampler_sample(s, lg, V) != ref_draw(&d, &r);
    kvt_sampler_free(s);
    return bad;
}

TEST(sampler_greedy)
{
    float lg[V];
    logits(lg, 3);
    int32_t want = 0;
    for (int32_t i = 1; i < V; i++) if (lg[i] > lg[want]) want = i;
    lg[want + 1] = lg[want]; /* a tie after it: the lower id wins */
    const float temps[] = {0.0f, -1.0f, NAN};
    for (size_t k = 0; k < sizeof temps / sizeof *temps; k++) {
        kvt_sampler *s = NULL;
        kvt_sampler_opts o = {.temperature = temps[k], .top_p = 0.5f, .top_k = 7, .seed = 9};
        CHECK_OK(kvt_sampler_new(&s, &o));
        int32_t got[3] = {kvt_sampler_sample(s, lg, V), kvt_sampler_sample(s, lg, V), kvt_sampler_sample(s, lg, V)};
        kvt_sampler_free(s);
        CHECKF(got[0] == want && got[1] == want && got[2] == want, "temperature %g: %d %d %d, want %d",
               (double)temps[k], got[0], got[1], got[2], want);
    }
}

/* Logits for the greedy test: small integers (ties), with -0, NaN and
 * infinities sprinkled in, and now and then the largest repeated. */
static void greedy_logits(float *x, uint32_t n, uint64_t *seed)
{
    for (uint32_t i = 0; i < n; i++) {
        uint64_t r = kvt_test_rand(seed);
        float v = (float)((int)(r % 17) - 8);
        switch ((r >> 8) % 64) {
        case 0: v = NAN; break;
        case 1: v = INFINITY; break;
        case 2: v = -INFINITY; break;
        case 3: case 4: v = -0.0f; break;
        case 5: v = 0.0f; break;
        }
        x[i] = v;
    }
    uint64_t r = kvt_test_rand(seed);
    if (n > 2 && r % 3 == 0) { /* the largest twice, at two random places */
        float mx = -INFINITY;
        for (uint32_t i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
        x[(r >> 8) % n] = mx + 1;
        x[(r >> 24) % n] = mx + 1;
    }
    if ((r >> 40) % 50 == 0) x[0] = NAN;
}

/* Vectors whose greedy id differs from the loop's, out of n (the first
 * mismatch printed). */
static uint32_t greedy_mismatches(uint64_t seed, uint32_t n, uint32_t n_min, uint32_t n_max, float *x)
{
    kvt_sampler *s = NULL;
    kvt_sampler_opts o = {.temperature = 0, .seed = 1};
    if (kvt_sampler_new(&s, &o)) return n;
    uint32_t bad = 0;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t len = n_min + (uint32_t)(kvt_test_rand(&seed) % (n_max - n_min + 1));
        greedy_logits(x, len, &seed);
        uint32_t want = 0;
        for (uint32_t i = 1; i < len; i++) if (x[i] > x[want]) want = i;
        int32_t got = kvt_sampler_sample(s, x, len);
        if (got != (int32_t)want && !bad++) printf("    %u logits: id %d, the loop's %u\n", len, got, want);
    }
    kvt_sampler_free(s);
    return bad;
}

TEST(sampler_greedy_lanes)
{
    enum { NV = 32000 };
    float *x = malloc(NV * sizeof *x);
    CHECK(x != NULL);
    if (!x) return;
    uint64_t seed = kvt_test_seed("sampler_greedy_lanes");
    uint32_t bad = greedy_mismatches(seed, 3000, 1, 70, x) + greedy_mismatches(seed + 1, 200, NV - 40, NV, x);
    kvt_sampler_fault = KVT_SAMPLER_FAULT_GREEDY_LAST;
    uint32_t fault = greedy_mismatches(seed, 3000, 1, 70, x);
    kvt_sampler_fault = 0;
    printf("    %u of 3,200 vectors differ; negative control (the last of equal largest): %u of 3,000\n", bad, fault);
    CHECK(bad == 0);
    CHECKF(fault > 0, "negative control: taking the last of equal largest logits went unseen");
    free(x);
}

TEST(sampler_reference)
{
    uint64_t seed = kvt_test_seed("sampler_reference");
    float lg[V];
    logits(lg, seed);
    enum { N = 2000 };
    for (size_t k = 0; k < sizeof settings / sizeof *settings; k++) {
        const setting *c = &settings[k];
        uint32_t bad = mismatches(lg, c, seed + k, seed + k, false, N);
        printf("    T %.1f top_k %u top_p %.1f: %u of %d draws differ from the reference\n", (double)c->T, c->top_k,
               (double)c->top_p, bad, N);
        CHECK(bad == 0);
    }
    /* controls: the check sees a missing top-p cut and another seed */
    uint32_t no_cut = mismatches(lg, &settings[2], seed, seed, true, N);
    uint32_t other = mismatches(lg, &settings[0], seed, seed + 1, false, N);
    printf("    controls: %u (no top-p cut), %u (another seed) of %d draws differ\n", no_cut, other, N);
    CHECKF(no_cut > 0 && other > N / 2, "a check that misses the top-p cut or the seed is no check");
}

/* Ids of n draws outside [p - 5 sd - 0.001, p + 5 sd + 0.001] of the
 * reference's probabilities p (those of d, or of none outside its head). */
static uint32_t off_frequencies(const uint32_t *count, uint32_t n, const ref_dist *d)
{
    static double p[V];
    memset(p, 0, sizeof p);
    for (uint32_t j = 0; j < d->n; j++) p[d->id[j]] = d->p[j] / d->mass;
    uint32_t off = 0;
    for (uint32_t i = 0; i < V; i++) {
        double sd = sqrt(p[i] * (1 - p[i]) / n), f = (double)count[i] / n;
        if (fabs(f - p[i]) > 5 * sd + 0.001 || (p[i] == 0 && count[i])) off++;
    }
    return off;
}

TEST(sampler_frequencies)
{
    uint64_t seed = kvt_test_seed("sampler_frequencies");
    float lg[V];
    logits(lg, seed ^ 0x5a5a);
    enum { N = 40000 };
    static uint32_t count[V];
    static ref_dist d, other;
    for (size_t k = 0; k < sizeof settings / sizeof *settings; k++) {
        const setting *c = &settings[k];
        memset(count, 0, sizeof count);
        kvt_sampler *s = NULL;
        kvt_sampler_opts o = {.temperature = c->T, .top_p = c->top_p, .top_k = c->top_k, .seed = seed + k};
        CHECK_OK(kvt_sampler_new(&s, &o));
        for (uint32_t i = 0; i < N; i++) {
            int32_t id = kvt_sampler_sample(s, lg, V);
            CHECKF(id >= 0 && id < V, "id %d", id);
            count[id]++;
        }
        kvt_sampler_free(s);
        ref_build(&d, lg, V, c->T, c->top_k, c->top_p, false);
        uint32_t off = off_frequencies(count, N, &d);
        printf("    T %.1f top_k %u top_p %.1f: %u ids in the head, %u off their probability\n", (double)c->T,
               c->top_k, (double)c->top_p, d.n, off);
        CHECK(off == 0);
        if (k == 0) {
            /* control: the same counts against another temperature */
            ref_build(&other, lg, V, 0.8f, 0, 1.0f, false);
            uint32_t off2 = off_frequencies(count, N, &other);
            printf("    control (T 0.8's probabilities): %u ids off\n", off2);
            CHECK(off2 > 0);
        }
    }
}

TEST(sampler_seeds)
{
    float lg[V];
    logits(lg, 11);
    int32_t a[64], b[64], c[64];
    kvt_sampler_opts o = {.temperature = 1.0f, .top_p = 1.0f, .seed = 42};
    kvt_sampler *s = NULL;
    CHECK_OK(kvt_sampler_new(&s, &o));
    for (int i = 0; i < 64; i++) a[i] = kvt_sampler_sample(s, lg, V);
    kvt_sampler_free(s);
    CHECK_OK(kvt_sampler_new(&s, &o));
    for (int i = 0; i < 64; i++) b[i] = kvt_sampler_sample(s, lg, V);
    kvt_sampler_free(s);
    o.seed = 43;
    CHECK_OK(kvt_sampler_new(&s, &o));
    for (int i = 0; i < 64; i++) c[i] = kvt_sampler_sample(s, lg, V);
    kvt_sampler_free(s);
    CHECK(!memcmp(a, b, sizeof a));
    CHECK(memcmp(a, c, sizeof a) != 0);
}

/* The draw of a position is a function of (seed, position) alone: positions
 * sampled in reverse, or one again, give the ids of a run in order (what a
 * verify pass of speculative decoding relies on). Control: the same
 * positions from another seed differ. */
TEST(sampler_positions)
{
    float lg[V];
    logits(lg, 5);
    enum { N = 200 };
    int32_t fwd[N], rev[N], other[N];
    kvt_sampler_opts o = {.temperature = 1.0f, .top_p = 0.9f, .top_k = 40, .seed = 17};
    kvt_sampler *a = NULL, *b = NULL, *c = NULL;
    CHECK_OK(kvt_sampler_new(&a, &o));
    CHECK_OK(kvt_sampler_new(&b, &o));
    o.seed = 18;
    CHECK_OK(kvt_sampler_new(&c, &o));
    for (int i = 0; i < N; i++) fwd[i] = kvt_sampler_sample(a, lg, V);
    for (int i = N; i-- > 0;) rev[i] = kvt_sampler_sample_at(b, lg, V, (uint64_t)i);
    int again = kvt_sampler_sample_at(b, lg, V, 7);
    size_t diff = 0;
    for (int i = 0; i < N; i++) diff += (other[i] = kvt_sampler_sample_at(c, lg, V, (uint64_t)i)) != fwd[i];
    kvt_sampler_free(a);
    kvt_sampler_free(b);
    kvt_sampler_free(c);
    CHECK(!memcmp(fwd, rev, sizeof fwd) && again == fwd[7]);
    printf("    control: another seed differs at %zu of %d positions\n", diff, N);
    CHECK(diff > N / 2);
}

/* ---- the order over a whole vocabulary ---- */

struct vcand { float logit; int32_t id; };

static int vcmp(const void *a, const void *b)
{
    const struct vcand *x = a, *y = b;
    if (x->logit != y->logit) return x->logit > y->logit ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The sampler's arithmetic (sampler.c) on candidates ordered by qsort and
 * the comparison the reference defines: what each draw must equal. */
static int32_t sorted_draw(struct vcand *c, const float *lg, uint32_t n_vocab, const setting *o, uint64_t seed,
                           uint64_t pos, double *p)
{
    for (uint32_t i = 0; i < n_vocab; i++) c[i] = (struct vcand){lg[i], (int32_t)i};
    qsort(c, n_vocab, sizeof *c, vcmp);
    uint32_t n = o->top_k && o->top_k < n_vocab ? o->top_k : n_vocab;
    double mx = c[0].logit, z = 0;
    for (uint32_t i = 0; i < n; i++) { p[i] = exp((c[i].logit - mx) / o->T); z += p[i]; }
    uint32_t keep = n;
    double cum = 0;
    for (uint32_t i = 0; i < n; i++) {
        cum += p[i] / z;
        if (cum >= o->top_p) { keep = i + 1; break; }
    }
    double mass = 0;
    for (uint32_t i = 0; i < keep; i++) mass += p[i];
    ref_rng r = {seed, pos};
    double u = (double)(ref_next(&r) >> 11) * (1.0 / 9007199254740992.0) * mass;
    int32_t id = c[keep - 1].id;
    for (uint32_t i = 0; i < keep; i++) {
        if (u < p[i]) { id = c[i].id; break; }
        u -= p[i];
    }
    return id;
}

/* Draws at n positions that differ from sorted_draw's, with each side's
 * time per draw (ms). */
static uint32_t vocab_mismatches(const float *lg, uint32_t n_vocab, const setting *o, uint32_t n, double *ms_new,
                                 double *ms_sort)
{
    struct vcand *c = malloc(n_vocab * sizeof *c);
    double *p = malloc(n_vocab * sizeof *p);
    kvt_sampler *s = NULL;
    kvt_sampler_opts so = {.temperature = o->T, .top_p = o->top_p, .top_k = o->top_k, .seed = 77};
    if (!c || !p || kvt_sampler_new(&s, &so)) { free(c); free(p); return n; }
    uint32_t bad = 0;
    double t_new = 0, t_sort = 0;
    for (uint32_t i = 0; i < n; i++) {
        double t0 = kvt_now();
        int32_t got = kvt_sampler_sample_at(s, lg, n_vocab, i);
        double t1 = kvt_now();
        bad += got != sorted_draw(c, lg, n_vocab, o, 77, i, p);
        t_new += t1 - t0;
        t_sort += kvt_now() - t1;
    }
    *ms_new = t_new * 1e3 / n;
    *ms_sort = t_sort * 1e3 / n;
    kvt_sampler_free(s);
    free(c);
    free(p);
    return bad;
}

TEST(sampler_sort_vocab)
{
    enum { NV = 32000, N = 100 };
    float *lg = malloc(NV * sizeof *lg);
    CHECK(lg != NULL);
    if (!lg) return;
    uint64_t seed = kvt_test_seed("sampler_sort_vocab");
    for (uint32_t i = 0; i < NV; i++) {
        double u = (double)(kvt_test_rand(&seed) >> 11) / 9007199254740992.0;
        lg[i] = (float)(u * 12 - 6);
        if (i % 211 == 0) lg[i] += 9;
        if (i % 13 == 0) lg[i] = (float)(int)lg[i]; /* ties, and zeros */
        if (i % 26 == 0 && lg[i] == 0) lg[i] = -0.0f;
    }
    for (uint32_t i = 0; i + 1 < NV; i += 16) lg[i + 1] = lg[i];
    static const setting vs[] = {{1.0f, 0, 1.0f}, {0.8f, 40, 0.95f}, {1.5f, 0, 0.9f}, {0.2f, 0, 1.0f}};
    double ms_new = 0, ms_sort = 0;
    for (size_t k = 0; k < sizeof vs / sizeof *vs; k++) {
        uint32_t bad = vocab_mismatches(lg, NV, &vs[k], N, &ms_new, &ms_sort);
        printf("    T %.1f top_k %u top_p %.2f: %u of %d draws differ; %.3f ms a draw (a comparison sort's: %.3f)\n",
               (double)vs[k].T, vs[k].top_k, (double)vs[k].top_p, bad, N, ms_new, ms_sort);
        CHECK(bad == 0);
    }
    /* -0 ties +0: the lower id first, whichever sign it has */
    float z[4] = {-1.0f, 0.0f, -0.0f, -3.0f}, zn[4] = {-1.0f, -0.0f, 0.0f, -3.0f};
    setting one = {1.0f, 1, 1.0f};
    uint32_t zbad = vocab_mismatches(z, 4, &one, 4, &ms_new, &ms_sort) + vocab_mismatches(zn, 4, &one, 4, &ms_new, &ms_sort);
    kvt_sampler_fault = KVT_SAMPLER_FAULT_SIGNED_ZERO;
    uint32_t fault = vocab_mismatches(z, 4, &one, 4, &ms_new, &ms_sort) + vocab_mismatches(zn, 4, &one, 4, &ms_new, &ms_sort);
    kvt_sampler_fault = 0;
    printf("    -0 and +0: %u of 8 draws differ; negative control (-0 after +0): %u\n", zbad, fault);
    CHECK(zbad == 0);
    CHECKF(fault > 0, "negative control: ordering -0 after +0 went unseen");
    free(lg);
}
