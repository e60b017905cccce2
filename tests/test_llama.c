/* llama engine tests on the real stories260K model: golden greedy output and
 * logits from an independent implementation, the f64 reference, exactness
 * under any chunk schedule / thread count / kernel path, prefix reuse and its
 * negative controls, causality, context overflow and rolling mode. */
#include "test.h"
#include "session/testing.h"
#include "format/gguf.h"
#include "kernels/kernels.h"
#include "arch/model.h"
#include "arch/llama.h"
#include "kernels/qkernels.h"
#include "format/quant.h"
#include "ref.h"
#include "synth_family.h"
#include "base/util.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#define STORIES "models/stories260K.gguf"

static kvt_model *stories(void)
{
    const char *p = kvt_test_shared(STORIES);
    kvt_model *m = NULL;
    if (p && kvt_model_open(&m, p) != KVT_OK) {
        fprintf(stdout, "    open %s: %s\n", p, kvt_errmsg());
        return NULL;
    }
    return m;
}

/* The row types of stories260K's cache the tests below run with: its
 * heads are 8 long, q8_0's blocks 32, so q8_0 is refused (by name). */
static const kvt_row_type stories_types[] = {KVT_ROWS_DEFAULT, KVT_ROWS_F32, KVT_ROWS_BF16};
enum { STORIES_TYPES = sizeof stories_types / sizeof stories_types[0] };

/* stories260K with its cache in rt (printed); NULL when absent. */
static kvt_model *stories_rows(kvt_row_type rt)
{
    kvt_model *m = stories();
    if (m && kvt_model_set_cache_types(m, rt, rt) != KVT_OK) {
        kvt_test_fail(__FILE__, __LINE__, "cache type %s: %s", kvt_row_type_name(rt), kvt_errmsg());
        kvt_model_close(m);
        return NULL;
    }
    if (m) printf("    %s rows\n", kvt_row_type_name(rt));
    return m;
}

typedef struct golden {
    char *prompt;
    int32_t ids[512];      /* prompt ids then greedy ids */
    size_t n_prompt, n_greedy, steps;
    float logits[512];
    size_t n_logits;
} golden;

/* Load the golden cases; returns count (0 when absent). */
static size_t load_golden(golden *g, size_t cap)
{
    const char *p = kvt_test_shared("golden/stories260K-greedy.jsonl");
    if (!p) return 0;
    FILE *f = fopen(p, "r");
    if (!f) return 0;
    size_t n = 0;
    char *line = NULL;
    size_t lcap = 0;
    while (n < cap && getline(&line, &lcap, f) > 0) {
        json_error_t err;
        json_t *j = json_loads(line, 0, &err);
        if (!j) continue;
        golden *c = &g[n];
        memset(c, 0, sizeof *c);
        c->prompt = strdup(json_string_value(json_object_get(j, "prompt")));
        c->steps = (size_t)json_integer_value(json_object_get(j, "steps"));
        json_t *a = json_object_get(j, "prompt_ids"), *b = json_object_get(j, "greedy_ids"),
               *l = json_object_get(j, "last_prompt_logits");
        size_t i;
        json_t *v;
        json_array_foreach(a, i, v) c->ids[c->n_prompt++] = (int32_t)json_integer_value(v);
        json_array_foreach(b, i, v) if (c->n_prompt + c->n_greedy < 512)
            c->ids[c->n_prompt + c->n_greedy++] = (int32_t)json_integer_value(v);
        json_array_foreach(l, i, v) if (c->n_logits < 512) c->logits[c->n_logits++] = (float)json_number_value(v);
        json_decref(j);
        n++;
    }
    free(line);
    fclose(f);
    return n;
}

static void free_golden(golden *g, size_t n)
{
    for (size_t i = 0; i < n; i++) free(g[i].prompt);
}

/* In f32 rows: the golden logits are an f32 implementation's. */
TEST(llama_golden_tokenize_logits_greedy)
{
    static golden g[16];
    size_t ng = load_golden(g, 16);
    kvt_model *m = kvt_test_shared(STORIES) ? stories_rows(KVT_ROWS_F32) : NULL;
    if (!m || !ng) { kvt_model_close(m); free_golden(g, ng); SKIP("../shared absent"); }
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    for (size_t c = 0; c < ng && !kvt_test_failed(); c++) {
        golden *gc = &g[c];
        int32_t *ids = NULL;
        size_t n = 0;
        CHECK_OK(kvt_tokenize(m, gc->prompt, strlen(gc->prompt), -1, false, &ids, &n));
        bool same = n == gc->n_prompt && !memcmp(ids, gc->ids, n * sizeof *ids);
        free(ids);
        CHECKF(same, "case %zu: tokenization of '%s' differs", c, gc->prompt);
        CHECK_OK(kvt_session_sync(s, gc->ids, gc->n_prompt, NULL));
        const float *lg = kvt_session_logits(s);
        double maxd = 0;
        CHECK(gc->n_logits == 512);
        for (size_t i = 0; i < 512; i++) maxd = fmax(maxd, fabs((double)lg[i] - gc->logits[i]));
        /* The golden logits are f32 from an independent implementation with
         * its own summation order; f32 rounding over these dot products
         * (at most 172 terms, 5 layers) stays orders of magnitude below 1e-4. */
        CHECKF(maxd < 1e-4, "case %zu: max |logit - golden| = %g", c, maxd);
        fprintf(stdout, "    case %zu: max |logit - golden| = %.3g\n", c, maxd);
        /* Greedy continuation as llama2.c runs it: positions up to `steps`,
         * stopping before a sampled BOS (id 1). */
        size_t got = 0;
        bool match = true;
        for (;;) {
            int32_t t = 0;
            const float *l = kvt_session_logits(s);
            for (int j = 1; j < 512; j++) if (l[j] > l[t]) t = j;
            if (t == 1) break;
            if (got >= gc->n_greedy || t != gc->ids[gc->n_prompt + got]) { match = false; break; }
            got++;
            if (gc->n_prompt + got == gc->steps + 1) break;
            if (kvt_session_decode(s, t) != KVT_OK) { match = false; break; }
        }
        CHECKF(match && got == gc->n_greedy, "case %zu: greedy diverged at generated token %zu of %zu",
               c, got, gc->n_greedy);
    }
    kvt_session_free(s);
    kvt_model_close(m);
    free_golden(g, ng);
}

/* A deterministic token sequence of length n over the stories vocabulary. */
static void seq(int32_t *t, size_t n, uint64_t seed)
{
    t[0] = 1;
    for (size_t i = 1; i < n; i++) t[i] = (int32_t)(3 + kvt_test_rand(&seed) % 509);
}

/* What a run leaves: its last logits (all n_logits = n_vocab of them) and
 * its cache bytes. */
typedef struct run_out { float *logits; size_t n_logits; uint8_t *cache; size_t cache_len; } run_out;

static int run(kvt_model *m, const int32_t *t, size_t n, const uint32_t *chunks, size_t nc,
               uint32_t threads, run_out *o)
{
    kvt_session *s = NULL;
    kvt_session_opts so = {.n_threads = threads};
    int rc = kvt_session_new(&s, m, &so);
    if (rc) return rc;
    if (chunks) rc = kvt_session_sync_chunks(s, t, n, chunks, nc, NULL);
    else rc = kvt_session_sync(s, t, n, NULL);
    if (!rc) {
        o->n_logits = m->info.n_vocab;
        o->logits = malloc(o->n_logits * sizeof(float));
        if (!o->logits) rc = KVT_ENOMEM;
        else memcpy(o->logits, kvt_session_logits(s), o->n_logits * sizeof(float));
    }
    if (!rc) rc = kvt_session_cache_bytes(s, &o->cache, &o->cache_len);
    kvt_session_free(s);
    return rc;
}

static bool same(const run_out *a, const run_out *b)
{
    return a->n_logits == b->n_logits && !memcmp(a->logits, b->logits, a->n_logits * sizeof(float)) &&
           a->cache_len == b->cache_len &&
           !memcmp(a->cache, b->cache, a->cache_len);
}

static void run_free(run_out *o) { free(o->logits); free(o->cache); }

static void chunk_thread_kernel(kvt_row_type rt);

/* For every row type stories260K takes; q8_0 refused. */
TEST(llama_chunk_thread_kernel_invariance)
{
    if (!kvt_test_shared(STORIES)) SKIP("../shared absent");
    for (size_t r = 0; r < STORIES_TYPES && !kvt_test_failed(); r++) chunk_thread_kernel(stories_types[r]);
    kvt_model *m = stories();
    CHECK(m);
    int rc = kvt_model_set_cache_types(m, KVT_ROWS_Q8_0, KVT_ROWS_Q8_0);
    kvt_model_close(m);
    CHECKF(rc == KVT_EINVAL && strstr(kvt_errmsg(), "not a multiple of 32"), "q8_0 rows on heads of 8: %s",
           kvt_errmsg());
}

static void chunk_thread_kernel(kvt_row_type rt)
{
    kvt_model *m = stories_rows(rt);
    if (!m) return;
    enum { N = 300 }; /* crosses the 128 and 256 block boundaries */
    int32_t t[N];
    seq(t, N, 7);
    run_out base = {0}, o = {0};
    CHECK_OK(run(m, t, N, NULL, 0, 1, &base));
    const uint32_t one[] = {1}, odd[] = {4, 1, 7, 12}, big[] = {N};
    uint32_t rnd[64];
    uint64_t st = kvt_test_seed("llama_chunk_thread_kernel_invariance");
    for (int i = 0; i < 64; i++) rnd[i] = 1 + (uint32_t)(kvt_test_rand(&st) % 150);
    struct { const uint32_t *c; size_t n; uint32_t th; const char *what; } cases[] = {
        {big, 1, 1, "one-shot"}, {one, 1, 1, "1 token at a time"}, {odd, 4, 1, "4/1/7/12"},
        {rnd, 64, 1, "random chunks"}, {NULL, 0, 2, "2 threads"}, {NULL, 0, 3, "3 threads"},
        {odd, 4, 4, "4/1/7/12 on 4 threads"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        CHECK_OK(run(m, t, N, cases[i].c, cases[i].n, cases[i].th, &o));
        bool eq = same(&base, &o);
        run_free(&o);
        CHECKF(eq, "%s differs from the default schedule", cases[i].what);
    }
    for (int path = 1; path <= 2; path++) { /* scalar; AVX2 without AVX-512 */
        bool old = kvt_kernels_force_scalar(path == 1), old2 = kvt_kernels_force_avx2(path == 2);
        int rc = run(m, t, N, odd, 4, 2, &o);
        kvt_kernels_force_scalar(old);
        kvt_kernels_force_avx2(old2);
        CHECK_OK(rc);
        bool eq = same(&base, &o);
        run_free(&o);
        CHECKF(eq, "%s kernels differ from the widest", path == 1 ? "scalar" : "AVX2");
    }
    run_free(&base);
    kvt_model_close(m);
}

/* In f32 rows: the bound below is f32 rounding's (f16 rows of K and V
 * move the logits by about 1e-2). */
TEST(llama_f64_reference)
{
    if (!kvt_test_shared(STORIES)) SKIP("../shared absent");
    kvt_model *m = stories_rows(KVT_ROWS_F32);
    if (!m) return;
    enum { N = 200 };
    int32_t t[N];
    seq(t, N, 11);
    double *ref = NULL;
    uint32_t V = 0;
    CHECK(ref_llama_logits(kvt_test_shared(STORIES), t, N, &ref, &V) == 0 && V == 512);
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    double maxd = 0, maxmag = 0;
    for (size_t i = 0; i < N; i++) {
        CHECK_OK(kvt_session_decode(s, t[i]));
        const float *lg = kvt_session_logits(s);
        for (size_t j = 0; j < V; j++) {
            maxd = fmax(maxd, fabs(lg[j] - ref[i * V + j]));
            maxmag = fmax(maxmag, fabs(ref[i * V + j]));
        }
    }
    fprintf(stdout, "    max |f32 - f64| = %.3g over %d positions (max |logit| %.3g)\n", maxd, N, maxmag);
    /* Tolerance: each f32 operation has relative error 2^-24 ~ 6e-8; the
     * deepest chain is ~5 layers x (norm, 3 matmuls of <= 172 terms, softmax
     * over <= 200 keys), i.e. a few hundred roundings on values of order 10.
     * A worst-case linear bound is ~1e-4; errors random in sign grow like the
     * square root, so 1e-4 leaves a wide margin over the ~1e-5 expected while
     * still catching any real arithmetic mistake (those are >= 1e-2). */
    CHECKF(maxd < 1e-4, "max |f32 - f64| = %g", maxd);
    free(ref);
    kvt_session_free(s);
    kvt_model_close(m);
}

static void prefix_reuse(kvt_row_type rt);

TEST(llama_prefix_reuse_and_wrong_prefix)
{
    if (!kvt_test_shared(STORIES)) SKIP("../shared absent");
    for (size_t r = 0; r < STORIES_TYPES && !kvt_test_failed(); r++) prefix_reuse(stories_types[r]);
}

static void prefix_reuse(kvt_row_type rt)
{
    kvt_model *m = stories_rows(rt);
    if (!m) return;
    enum { N = 160, K = 140 };
    int32_t a[N], b[N];
    seq(a, N, 21);
    memcpy(b, a, sizeof a);
    for (size_t i = 50; i < K; i++) b[i] = (int32_t)(3 + (a[i] + 17) % 509); /* same length, other prefix */
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    size_t reused = 0;
    CHECK_OK(kvt_session_sync(s, a, K, &reused));
    CHECK(reused == 0);
    /* Extend A: all K rows are reused. */
    CHECK_OK(kvt_session_sync(s, a, N, &reused));
    CHECKF(reused == K, "reused %zu of %d", reused, K);
    float la[512];
    memcpy(la, kvt_session_logits(s), sizeof la);
    /* B differs from position 50: the session must reuse exactly 50 rows. */
    CHECK_OK(kvt_session_sync(s, b, N, &reused));
    CHECKF(reused == 50, "reused %zu rows for a prompt that diverges at 50", reused);
    float lb[512];
    memcpy(lb, kvt_session_logits(s), sizeof lb);
    run_out fresh = {0};
    CHECK_OK(run(m, b, N, NULL, 0, 1, &fresh));
    bool eq = !memcmp(fresh.logits, lb, sizeof lb);
    run_free(&fresh);
    CHECKF(eq, "partial reuse differs from a fresh run of B");
    /* Negative control: the same suffix after a different prefix of the same
     * length gives detectably different logits. */
    double maxd = 0;
    for (int j = 0; j < 512; j++) maxd = fmax(maxd, fabs(la[j] - lb[j]));
    CHECKF(maxd > 1e-3, "a different prefix gave the same logits (max diff %g)", maxd);
    /* A prompt that is a strict prefix of what the session holds. */
    CHECK_OK(kvt_session_sync(s, b, 100, &reused));
    CHECK(reused == 99 && kvt_session_len(s) == 100);
    CHECK_OK(run(m, b, 100, NULL, 0, 1, &fresh));
    eq = !memcmp(fresh.logits, kvt_session_logits(s), 512 * sizeof(float));
    run_free(&fresh);
    CHECK(eq);
    kvt_session_free(s);
    kvt_model_close(m);
}

TEST(llama_causality)
{
    kvt_model *m = stories();
    if (!m) SKIP("../shared absent");
    enum { N = 60, P = 40 };
    int32_t a[N], b[N];
    seq(a, N, 5);
    memcpy(b, a, sizeof a);
    b[P] = (int32_t)(3 + (a[P] + 100) % 509);
    kvt_session *sa = NULL, *sb = NULL;
    CHECK_OK(kvt_session_new(&sa, m, NULL));
    CHECK_OK(kvt_session_new(&sb, m, NULL));
    bool early_same = true, late_diff = false;
    for (size_t i = 0; i < N; i++) {
        CHECK_OK(kvt_session_decode(sa, a[i]));
        CHECK_OK(kvt_session_decode(sb, b[i]));
        bool eq = !memcmp(kvt_session_logits(sa), kvt_session_logits(sb), 512 * sizeof(float));
        if (i < P) early_same = early_same && eq;
        else late_diff = late_diff || !eq;
    }
    CHECK(early_same);
    CHECK(late_diff); /* negative control: the change is visible after P */
    kvt_session_free(sa);
    kvt_session_free(sb);
    kvt_model_close(m);
}

TEST(llama_context_overflow_and_rolling)
{
    kvt_model *m = stories();
    if (!m) SKIP("../shared absent");
    int32_t t[13];
    seq(t, 13, 3);
    kvt_session *s = NULL;
    kvt_session_opts so = {.n_ctx = 8};
    CHECK_OK(kvt_session_new(&s, m, &so));
    CHECK(kvt_session_sync(s, t, 9, NULL) == KVT_ECTX);
    CHECK(strstr(kvt_errmsg(), "exceeds the context") != NULL);
    CHECK_OK(kvt_session_sync(s, t, 8, NULL));
    CHECK(kvt_session_decode(s, t[8]) == KVT_ECTX);
    CHECK(kvt_session_len(s) == 8);
    kvt_session_free(s);

    so.rolling = true;
    CHECK_OK(kvt_session_new(&s, m, &so));
    for (size_t i = 0; i < 13; i++) {
        CHECK_OK(kvt_session_decode(s, t[i]));
        CHECKF(kvt_session_rebuilds(s) == (i + 1 > 8 ? i + 1 - 8 : 0), "step %zu: %llu rebuilds", i + 1,
               (unsigned long long)kvt_session_rebuilds(s));
    }
    CHECK(kvt_session_rebuilds(s) == 5);
    /* The rolled state equals a fresh run over the last 8 tokens. */
    CHECK(!memcmp(kvt_session_tokens(s), t + 5, 8 * sizeof(int32_t)));
    run_out fresh = {0};
    CHECK_OK(run(m, t + 5, 8, NULL, 0, 1, &fresh));
    bool eq = !memcmp(fresh.logits, kvt_session_logits(s), 512 * sizeof(float));
    run_free(&fresh);
    CHECK(eq);
    kvt_session_free(s);
    kvt_model_close(m);
}

TEST(llama_nll_matches_stepwise)
{
    kvt_model *m = stories();
    if (!m) SKIP("../shared absent");
    enum { N = 70 };
    int32_t t[N];
    seq(t, N, 9);
    kvt_session *s = NULL;
    kvt_session_opts so = {.chunk = 16};
    CHECK_OK(kvt_session_new(&s, m, &so));
    double nll = 0, step = 0;
    size_t k = 0;
    CHECK_OK(kvt_session_nll(s, t, N, &nll, &k));
    CHECK(k == N - 1);
    kvt_session *s2 = NULL;
    CHECK_OK(kvt_session_new(&s2, m, NULL));
    for (size_t i = 0; i + 1 < N; i++) {
        CHECK_OK(kvt_session_decode(s2, t[i]));
        const float *l = kvt_session_logits(s2);
        double mx = l[0], z = 0;
        for (int j = 1; j < 512; j++) mx = fmax(mx, l[j]);
        for (int j = 0; j < 512; j++) z += exp(l[j] - mx);
        step += log(z) + mx - l[t[i + 1]];
    }
    CHECKF(fabs(nll - step) < 1e-9 * N, "nll %f vs stepwise %f", nll, step);
    /* The session keeps the scored tokens and their logits. */
    CHECK(kvt_session_len(s) == N - 1);
    CHECK(!memcmp(kvt_session_logits(s), kvt_session_logits(s2), 512 * sizeof(float)));
    kvt_session_free(s);
    kvt_session_free(s2);
    kvt_model_close(m);
}

TEST(llama_bad_token_and_model_errors)
{
    kvt_model *m = NULL;
    CHECK(kvt_model_open(&m, "/nonexistent/model.gguf") == KVT_ENOENT);
    CHECK(m == NULL);
    m = stories();
    if (!m) SKIP("../shared absent");
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    int32_t bad[3] = {1, 600, 5};
    CHECK(kvt_session_sync(s, bad, 3, NULL) == KVT_EINVAL);
    CHECK(kvt_session_len(s) == 0);
    CHECK(kvt_session_decode(s, -1) == KVT_EINVAL);
    kvt_session_free(s);
    kvt_model_close(m);
}

/* ---- weights in place, in the file's type ---- */

static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

/* One block of 32 as Q5_0 (q = round(x / d) + 16, d = -max / 16, max the
 * value of largest magnitude) or, with mins, Q4_1 / Q5_1 (q = round((x -
 * min) / d), d = (max - min) / (2^bits - 1)), as ggml's reference
 * quantisers; p gets the block's bytes. */
static void quant_b32(const float *x, uint8_t *p, int bits, bool mins)
{
    float lo = x[0], hi = x[0], amax = 0, mx = 0;
    for (int j = 0; j < 32; j++) {
        lo = x[j] < lo ? x[j] : lo, hi = x[j] > hi ? x[j] : hi;
        if (fabsf(x[j]) > amax) amax = fabsf(x[j]), mx = x[j];
    }
    int qmax = (1 << bits) - 1;
    float d = mins ? (hi - lo) / (float)qmax : mx / -16.0f, id = d ? 1.0f / d : 0;
    put16(p, kvt_f32_to_f16(d));
    if (mins) put16(p + 2, kvt_f32_to_f16(lo));
    uint8_t *qs = p + (mins ? 4 : 2) + (bits == 5 ? 4 : 0);
    uint32_t qh = 0;
    for (int j = 0; j < 32; j++) {
        int q = mins ? (int)((x[j] - lo) * id + 0.5f) : (int)(x[j] * id + 16.5f);
        q = q > qmax ? qmax : q;
        if (j < 16) qs[j] = (uint8_t)(q & 15);
        else qs[j - 16] |= (uint8_t)((q & 15) << 4);
        qh |= (uint32_t)(q >> 4 & 1) << j;
    }
    if (bits == 5) memcpy(p + (mins ? 4 : 2), &qh, 4);
}

/* A copy of the GGUF at src whose matrices (2-D tensors whose rows are
 * whole 32-blocks) are in type, quantised here (Q8_0: the nearest of 255
 * steps of the block's largest magnitude; Q4_1, Q5_0, Q5_1: quant_b32);
 * with back_to_f32 every such matrix is then dequantised again and stored
 * as f32. Vectors stay f32. */
static int retype(const char *src, const char *dst, uint32_t type, bool back_to_f32)
{
    kvt_gguf *g = NULL;
    int rc = kvt_gguf_open(&g, src);
    if (rc) return rc;
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    for (size_t i = 0; !rc && i < kvt_gguf_n_kv(g); i++)
        rc = kvt_gguf_writer_set(w, kvt_gguf_key(g, i), kvt_gguf_val_at(g, i));
    for (size_t i = 0; !rc && i < kvt_gguf_n_tensors(g); i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        size_t n = (size_t)t->n_elem;
        float *f = malloc(n * sizeof *f);
        uint8_t *q = malloc(n * 2 + n / 32 * 2 + 64);
        rc = f && q ? kvt_gguf_tensor_to_f32(t, f, n) : KVT_ENOMEM;
        bool mat = t->n_dims == 2 && t->ne[1] > 1 && t->ne[0] % 32 == 0;
        uint32_t ty = mat ? type : KVT_GGML_F32;
        size_t bytes = kvt_ggml_type_size(ty, n);
        for (size_t b = 0; !rc && mat && b < n / 32; b++) {
            const float *x = f + 32 * b;
            if (type == KVT_GGML_F16) {
                for (int j = 0; j < 32; j++) put16(q + 2 * (32 * b + j), kvt_f32_to_f16(x[j]));
            } else if (type == KVT_GGML_BF16) {
                for (int j = 0; j < 32; j++) {
                    uint32_t u;
                    memcpy(&u, &x[j], 4);
                    put16(q + 2 * (32 * b + j), (uint16_t)((u + 0x7fff + (u >> 16 & 1)) >> 16));
                }
            } else if (type != KVT_GGML_Q8_0) {
                bool mins = type != KVT_GGML_Q5_0;
                quant_b32(x, q + kvt_ggml_type_size(type, 32) * b, type == KVT_GGML_Q4_1 ? 4 : 5, mins);
            } else { /* Q8_0 */
                float amax = 0;
                for (int j = 0; j < 32; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
                float d = amax / 127.0f, id = d ? 1.0f / d : 0;
                uint8_t *p = q + 34 * b;
                put16(p, kvt_f32_to_f16(d));
                for (int j = 0; j < 32; j++) p[2 + j] = (uint8_t)(int8_t)lroundf(x[j] * id);
            }
        }
        if (!rc && mat && back_to_f32) {
            kvt_gguf_tensor tq = *t;
            tq.type = type;
            tq.data = q;
            tq.n_bytes = bytes;
            rc = kvt_gguf_tensor_to_f32(&tq, f, n);
            ty = KVT_GGML_F32;
            bytes = n * 4;
        }
        if (!rc)
            rc = kvt_gguf_writer_add_tensor(w, t->name, ty, t->n_dims, t->ne, ty == KVT_GGML_F32 ? (void *)f : q,
                                            bytes);
        free(f);
        free(q);
    }
    if (!rc) rc = kvt_gguf_writer_write(w, dst);
    kvt_gguf_writer_free(w);
    kvt_gguf_close(g);
    return rc;
}

/* A model whose matrices are F16 or BF16 runs on them in place and gives
 * the logits and cache bytes of the same model with those matrices
 * dequantised to f32, bit for bit: dequantisation is exact and the matmul
 * reduces in the same order whatever the type. Q8_0, Q4_1, Q5_0 and Q5_1 run
 * on the integer kernels: within the activations' rounding of the f32
 * copy. Every schedule, thread count and the scalar path agree too. */
TEST(llama_weights_in_place_every_type)
{
    const char *p = kvt_test_shared(STORIES);
    if (!p) SKIP("../shared absent");
    char dir[] = "/tmp/kvtier-wtype-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir) != NULL);
    enum { N = 300 };
    int32_t t[N];
    seq(t, N, 11);
    const uint32_t types[] = {KVT_GGML_F16, KVT_GGML_BF16, KVT_GGML_Q8_0,
                              KVT_GGML_Q4_1, KVT_GGML_Q5_0, KVT_GGML_Q5_1};
    const uint32_t odd[] = {4, 1, 7, 12};
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        const char *name = kvt_ggml_type_name(types[k]);
        char a[128], b[128];
        snprintf(a, sizeof a, "%s/%s.gguf", dir, name);
        snprintf(b, sizeof b, "%s/%s-as-f32.gguf", dir, name);
        CHECK_OK(retype(p, a, types[k], false));
        CHECK_OK(retype(p, b, types[k], true));
        kvt_model *mq = NULL, *mf = NULL;
        CHECK_OK(kvt_model_open(&mq, a));
        CHECK_OK(kvt_model_open(&mf, b));
        run_out ref = {0}, o = {0}, f32 = {0};
        CHECK_OK(run(mf, t, N, NULL, 0, 1, &f32));
        bool integer = kvt_q_supported(types[k]);
        if (integer) {
            /* integer kernels: the activations are quantised to 8 bits, so
             * the logits move from the f32 copy's by the rounding of each
             * token's activations (at most amax / 254 per element) */
            CHECK_OK(run(mq, t, N, NULL, 0, 1, &ref));
            float md = 0;
            for (int i = 0; i < 512; i++) md = fmaxf(md, fabsf(ref.logits[i] - f32.logits[i]));
            printf("    %s: max |logit - f32 copy's| = %.3g after %d tokens\n", name, md, N);
            CHECKF(md < 0.25f, "%s: logits %.3g from the f32 copy's", name, md);
        } else {
            ref = f32;
            f32.logits = NULL;
            f32.cache = NULL;
        }
        run_free(&f32);
        struct { const uint32_t *c; size_t n; uint32_t th; bool scalar; const char *what; } cases[] = {
            {NULL, 0, 1, false, "one thread"}, {odd, 4, 2, false, "4/1/7/12 on 2 threads"},
            {NULL, 0, 3, true, "scalar on 3 threads"},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            bool old = kvt_kernels_force_scalar(cases[i].scalar);
            int rc = run(mq, t, N, cases[i].c, cases[i].n, cases[i].th, &o);
            kvt_kernels_force_scalar(old);
            CHECK_OK(rc);
            bool eq = same(&ref, &o);
            run_free(&o);
            CHECKF(eq, "%s in place, %s: differs from %s", name, cases[i].what,
                   integer ? "one thread, default schedule" : "its f32 copy");
        }
        /* negative control: the f32 model of another type differs */
        if (k > 0) {
            char c[128];
            snprintf(c, sizeof c, "%s/%s-as-f32.gguf", dir, kvt_ggml_type_name(types[k - 1]));
            kvt_model *mo = NULL;
            CHECK_OK(kvt_model_open(&mo, c));
            CHECK_OK(run(mo, t, N, NULL, 0, 1, &o));
            CHECKF(!same(&ref, &o), "%s and %s give the same logits: the comparison is blind", name,
                   kvt_ggml_type_name(types[k - 1]));
            run_free(&o);
            kvt_model_close(mo);
        }
        printf("    %s: in place %s over %d tokens (3 schedules)\n", name, integer ? "invariant" : "== f32 copy", N);
        run_free(&ref);
        kvt_model_close(mq);
        kvt_model_close(mf);
    }
    kvt_test_clear_dir(dir);
    rmdir(dir);
}

/* Where a block of each type keeps its scales: f16 fields at the offsets
 * given (sane values are written there), or, for mxfp4, its E8M0 byte. */
static const struct { uint32_t type; int f16_at[2]; int e8m0_at; } scale_fields[] = {
    {KVT_GGML_F16, {-1, -1}, -1},    {KVT_GGML_BF16, {-1, -1}, -1},   {KVT_GGML_Q8_0, {0, -1}, -1},
    {KVT_GGML_Q4_0, {0, -1}, -1},    {KVT_GGML_Q4_1, {0, 2}, -1},     {KVT_GGML_Q5_0, {0, -1}, -1},
    {KVT_GGML_Q5_1, {0, 2}, -1},     {KVT_GGML_Q4_K, {0, 2}, -1},     {KVT_GGML_Q5_K, {0, 2}, -1},
    {KVT_GGML_Q6_K, {208, -1}, -1},  {KVT_GGML_IQ4_NL, {0, -1}, -1},  {KVT_GGML_IQ4_XS, {0, -1}, -1},
    {KVT_GGML_MXFP4, {-1, -1}, 0},
    {KVT_GGML_Q2_K, {80, 82}, -1},   {KVT_GGML_Q3_K, {108, -1}, -1},  {KVT_GGML_IQ2_XXS, {0, -1}, -1},
    {KVT_GGML_IQ2_XS, {0, -1}, -1},  {KVT_GGML_IQ2_S, {0, -1}, -1},   {KVT_GGML_IQ3_XXS, {0, -1}, -1},
    {KVT_GGML_IQ3_S, {0, -1}, -1},   {KVT_GGML_IQ1_S, {0, -1}, -1},
    {KVT_GGML_IQ1_M, {-1, -1}, -1}, /* its f16 d: the top nibbles of the scale words at 48..55 */
    {KVT_GGML_TQ1_0, {52, -1}, -1},  {KVT_GGML_TQ2_0, {64, -1}, -1},
};

/* A random (rows, cols) matrix of type k of scale_fields: random bytes with
 * small scales (f16 and bf16: small random values). */
static void rand_matrix(size_t k, uint8_t *p, size_t rows, size_t cols, uint64_t *st)
{
    uint32_t type = scale_fields[k].type;
    size_t blk, bytes;
    kvt_quant_block(type, &blk, &bytes);
    size_t n = rows * cols / blk;
    for (size_t b = 0; b < n; b++) {
        uint8_t *q = p + b * bytes;
        if (type == KVT_GGML_F16 || type == KVT_GGML_BF16) {
            float v = ((float)(kvt_test_rand(st) % 2001) - 1000.0f) * 4e-5f;
            uint32_t u;
            memcpy(&u, &v, 4);
            put16(q, type == KVT_GGML_F16 ? kvt_f32_to_f16(v) : (uint16_t)(u >> 16));
            continue;
        }
        for (size_t j = 0; j < bytes; j++) q[j] = (uint8_t)kvt_test_rand(st);
        for (int f = 0; f < 2; f++)
            if (scale_fields[k].f16_at[f] >= 0)
                put16(q + scale_fields[k].f16_at[f], kvt_f32_to_f16((float)(1 + kvt_test_rand(st) % 100) * 2e-5f));
        if (scale_fields[k].e8m0_at >= 0) q[scale_fields[k].e8m0_at] = (uint8_t)(116 + kvt_test_rand(st) % 4);
        if (type == KVT_GGML_IQ1_M) {
            uint16_t d = kvt_f32_to_f16((float)(1 + kvt_test_rand(st) % 100) * 2e-5f);
            for (int w = 0; w < 4; w++) q[49 + 2 * w] = (uint8_t)((q[49 + 2 * w] & 0x0f) | ((d >> 4 * w) & 15) << 4);
        }
    }
}

/* A synthetic llama (dim 256, 2 layers, 4 heads, 2 KV heads, ffn 512, the
 * stories260K vocabulary) whose every matrix, the embedding and the output
 * included, is in one type. */
typedef struct synth_dims { size_t D, H, HKV, F; } synth_dims;
#define SYNTH_DEFAULT ((synth_dims){256, 4, 2, 512}) /* head dim 64, two query heads per KV head */

static int synth_typed(const char *vocab_from, const char *path, size_t k, uint64_t seed, synth_dims dm)
{
    enum { L = 2, FMAX = 1024 };
    const size_t D = dm.D, H = dm.H, HKV = dm.HKV, F = dm.F;
    if (F > FMAX || D > FMAX) return KVT_EINVAL;
    kvt_gguf *g = NULL;
    int rc = kvt_gguf_open(&g, vocab_from);
    if (rc) return rc;
    const kvt_gguf_tensor *te = kvt_gguf_find_tensor(g, "token_embd.weight");
    size_t V = te ? (size_t)te->ne[1] : 0;
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    for (size_t i = 0; !rc && i < kvt_gguf_n_kv(g); i++)
        if (!strncmp(kvt_gguf_key(g, i), "tokenizer.", 10)) rc = kvt_gguf_writer_set(w, kvt_gguf_key(g, i), kvt_gguf_val_at(g, i));
    const struct { const char *k; uint32_t v; } u[] = {
        {"llama.embedding_length", (uint32_t)D}, {"llama.block_count", L}, {"llama.attention.head_count", (uint32_t)H},
        {"llama.attention.head_count_kv", (uint32_t)HKV}, {"llama.feed_forward_length", (uint32_t)F},
        {"llama.context_length", 512}, {"llama.rope.dimension_count", (uint32_t)(D / H)},
    };
    if (!rc) rc = kvt_gguf_writer_set_str(w, "general.architecture", "llama");
    for (size_t i = 0; !rc && i < sizeof u / sizeof u[0]; i++) rc = kvt_gguf_writer_set_u32(w, u[i].k, u[i].v);
    uint64_t st = seed;
    uint32_t type = scale_fields[k].type;
    float ones[FMAX];
    for (int i = 0; i < FMAX; i++) ones[i] = 1.0f;
    struct { char name[64]; size_t cols, rows; } m[3 + 9 * L];
    size_t nm = 0;
#define MAT(nm_, c_, r_) do { snprintf(m[nm].name, sizeof m[nm].name, "%s", nm_); m[nm].cols = c_; m[nm].rows = r_; nm++; } while (0)
    MAT("token_embd.weight", D, V);
    MAT("output_norm.weight", D, 1);
    MAT("output.weight", D, V);
    for (int l = 0; l < L; l++) {
        const struct { const char *s; size_t c, r; } t[] = {
            {"attn_norm.weight", D, 1}, {"attn_q.weight", D, D}, {"attn_k.weight", D, D / H * HKV},
            {"attn_v.weight", D, D / H * HKV}, {"attn_output.weight", D, D}, {"ffn_norm.weight", D, 1},
            {"ffn_gate.weight", D, F}, {"ffn_up.weight", D, F}, {"ffn_down.weight", F, D},
        };
        for (size_t i = 0; i < 9; i++) {
            char nmb[64];
            snprintf(nmb, sizeof nmb, "blk.%d.%s", l, t[i].s);
            MAT(nmb, t[i].c, t[i].r);
        }
    }
#undef MAT
    for (size_t i = 0; !rc && i < nm; i++) {
        uint64_t ne[2] = {m[i].cols, m[i].rows};
        if (m[i].rows == 1) {
            rc = kvt_gguf_writer_add_tensor(w, m[i].name, KVT_GGML_F32, 1, ne, ones, m[i].cols * 4);
            continue;
        }
        size_t bytes = kvt_ggml_type_size(type, m[i].cols * m[i].rows);
        uint8_t *p = malloc(bytes);
        if (!p) { rc = KVT_ENOMEM; break; }
        rand_matrix(k, p, m[i].rows, m[i].cols, &st);
        rc = kvt_gguf_writer_add_tensor(w, m[i].name, type, 2, ne, p, bytes);
        free(p);
    }
    if (!rc) rc = kvt_gguf_writer_write(w, path);
    kvt_gguf_writer_free(w);
    kvt_gguf_close(g);
    return rc;
}

/* Every weight type kvtier reads, every matrix in it (K-quant rows need
 * 256 elements, so a synthetic model): logits and cache bytes are the same
 * bits whatever the chunk schedule, the thread count or the kernel path. */
TEST(llama_every_type_invariance)
{
    const char *p = kvt_test_shared(STORIES);
    if (!p) SKIP("../shared absent");
    char dir[] = "/tmp/kvtier-alltypes-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir) != NULL);
    enum { N = 200 };
    int32_t t[N];
    seq(t, N, 5);
    const uint32_t odd[] = {4, 1, 7, 12};
    bool wide = kvt_test_kernel_paths();
    for (size_t k = 0; k < sizeof scale_fields / sizeof scale_fields[0]; k++) {
        const char *name = kvt_ggml_type_name(scale_fields[k].type);
        char path[128];
        snprintf(path, sizeof path, "%s/%s.gguf", dir, name);
        CHECK_OK(synth_typed(p, path, k, 7 + k, SYNTH_DEFAULT));
        kvt_model *m = NULL;
        CHECK_OK(kvt_model_open(&m, path));
        run_out ref = {0}, o = {0};
        CHECK_OK(run(m, t, N, NULL, 0, 1, &ref));
        bool finite = true;
        for (int i = 0; i < 512; i++) finite &= isfinite(ref.logits[i]);
        CHECKF(finite, "%s: logits not finite", name);
        /* kernel paths: the widest the CPU has, scalar, AVX2 without AVX-512
         * (the last case; left out when the CPU has no AVX-512) */
        struct { const uint32_t *c; size_t n; uint32_t th; bool scalar, avx2; } cases[] = {
            {odd, 4, 2, false, false}, {NULL, 0, 3, true, false}, {odd, 4, 1, true, false}, {odd, 4, 2, false, true},
        };
        size_t same_n = 0, n_cases = sizeof cases / sizeof cases[0] - !wide;
        for (size_t i = 0; i < n_cases; i++) {
            bool old = kvt_kernels_force_scalar(cases[i].scalar), old2 = kvt_kernels_force_avx2(cases[i].avx2);
            int rc = run(m, t, N, cases[i].c, cases[i].n, cases[i].th, &o);
            kvt_kernels_force_scalar(old);
            kvt_kernels_force_avx2(old2);
            CHECK_OK(rc);
            same_n += same(&ref, &o);
            run_free(&o);
        }
        CHECKF(same_n == n_cases, "%s: %zu of %zu schedules, thread counts and kernel paths agree", name, same_n,
               n_cases);
        printf("    %s: %s, invariant over %d tokens\n", name, kvt_q_supported(scale_fields[k].type) ? "integer kernels" : "f32 path", N);
        run_free(&ref);
        kvt_model_close(m);
    }
    kvt_test_clear_dir(dir);
    rmdir(dir);
}

/* Out of memory anywhere is an error, never a crash: opening a model,
 * making a session and running 40 tokens and a decode step, with the k-th
 * allocation failing, for every k until a run sees no failure. Each call
 * returns KVT_OK or KVT_ENOMEM, and a run that got through gives the logits
 * of a run without failures (so a failure that was swallowed cannot have
 * changed a result); then a snapshot of it, restored into a new session,
 * the same. Under `make asan`, LeakSanitizer also finds what a
 * failure path leaks. On a Q4_K llama (its matrices packed when it loads)
 * and on ds4-tiny. */
static size_t every_allocation_failure(const char *path, size_t *runs_out)
{
    enum { N = 40 };
    int32_t t[N + 1];
    for (int i = 0; i <= N; i++) t[i] = 1 + (3 + 7 * i) % 250; /* ids both vocabularies have */
    float *ref = NULL;
    size_t V = 0, bad = 0, runs = 0, through = 0;
    for (long k = -1; k < 1000000; k++) {
        kvt_model *m = NULL;
        kvt_session *s = NULL;
        unsigned long f0 = kvt_test_failed_allocs();
        kvt_test_fail_alloc(k);
        int rc = kvt_model_open(&m, path);
        kvt_session_opts o = {.n_ctx = 64, .n_threads = 2};
        if (!rc) rc = kvt_session_new(&s, m, &o);
        if (!rc) rc = kvt_session_sync(s, t, N, NULL);
        if (!rc) rc = kvt_session_decode(s, t[N]);
        /* and its snapshot restored into a second session, which then
         * stands in for the first */
        uint8_t *snap = NULL;
        size_t sl = 0;
        kvt_session *s2 = NULL;
        if (!rc) rc = kvt_session_snapshot(s, &snap, &sl);
        if (!rc) rc = kvt_session_new(&s2, m, &o);
        if (!rc) rc = kvt_session_restore(s2, snap, sl);
        free(snap);
        if (!rc) { kvt_session_free(s); s = s2; s2 = NULL; }
        kvt_session_free(s2);
        kvt_test_fail_alloc(-1);
        bool hit = kvt_test_failed_allocs() != f0;
        runs++;
        if (rc != KVT_OK && rc != KVT_ENOMEM) {
            bad++;
            printf("    %s: allocation %ld failed: %s (%s)\n", path, k, kvt_strerror(rc), kvt_errmsg());
        }
        if (rc == KVT_OK && !ref) {
            kvt_model_info mi;
            kvt_model_info_get(m, &mi);
            V = mi.n_vocab;
            ref = malloc(V * sizeof(float));
            if (!ref) bad++;
            else memcpy(ref, kvt_session_logits(s), V * sizeof(float));
        } else if (rc == KVT_OK) {
            through += hit;
            if (memcmp(ref, kvt_session_logits(s), V * sizeof(float))) {
                bad++;
                printf("    %s: allocation %ld failed and the run went on to other logits\n", path, k);
            }
        }
        kvt_session_free(s);
        kvt_model_close(m);
        if (k >= 0 && !hit) break; /* past the last allocation */
    }
    printf("    %s: %zu runs, one allocation failing in each: %zu errors other than KVT_ENOMEM, %zu runs got past it\n",
           path, runs - 2, bad, through);
    free(ref);
    *runs_out = runs;
    return bad;
}

TEST(llama_ds4_every_allocation_failure)
{
    const char *p = kvt_test_shared(STORIES);
    if (!p) SKIP("../shared absent");
    char dir[] = "/tmp/kvtier-nomem-XXXXXX", path[64];
    CHECK(kvt_test_mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/q4k.gguf", dir);
    size_t k4 = 0, runs = 0;
    while (scale_fields[k4].type != KVT_GGML_Q4_K) k4++;
    CHECK_OK(synth_typed(p, path, k4, 11, SYNTH_DEFAULT));
    CHECK(every_allocation_failure(path, &runs) == 0);
    CHECK(runs > 50);
    CHECK(every_allocation_failure("ds4-tiny", &runs) == 0);
    CHECK(runs > 50);
    kvt_test_clear_dir(dir);
    rmdir(dir);
}

/* The attention kernels' blocked paths at model level: head dim 64 and
 * three query heads per KV head (the shape of the 124M benchmark model:
 * keys four or two a call, three heads' values at once, eight tokens per
 * block of K and V rows), 300 tokens so that scores span three blocks of
 * 128 rows. Chunk schedules, 1-3 threads and the scalar path give the same
 * bits (llama_every_type_invariance has two heads per KV head). */
TEST(llama_attention_grouped_heads_invariance)
{
    const char *p = kvt_test_shared(STORIES);
    if (!p) SKIP("../shared absent");
    char dir[] = "/tmp/kvtier-attn3-XXXXXX", path[64];
    CHECK(kvt_test_mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/f16.gguf", dir);
    enum { N = 300 };
    int32_t t[N];
    seq(t, N, 11);
    CHECK_OK(synth_typed(p, path, 0, 21, (synth_dims){192, 3, 1, 256}));
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_open(&m, path));
    run_out ref = {0}, o = {0};
    CHECK_OK(run(m, t, N, NULL, 0, 1, &ref));
    const uint32_t odd[] = {9, 1, 130, 3}, ones[] = {1};
    struct { const uint32_t *c; size_t n; uint32_t th; bool scalar; } cases[] = {
        {odd, 4, 2, false}, {ones, 1, 1, false}, {NULL, 0, 3, false}, {odd, 4, 1, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bool old = kvt_kernels_force_scalar(cases[i].scalar);
        int rc = run(m, t, N, cases[i].c, cases[i].n, cases[i].th, &o);
        kvt_kernels_force_scalar(old);
        CHECK_OK(rc);
        CHECKF(same(&ref, &o), "case %zu (threads %u, %s) differs", i, cases[i].th, cases[i].scalar ? "scalar" : "simd");
        run_free(&o);
    }
    run_free(&ref);
    kvt_model_close(m);
    kvt_test_clear_dir(dir);
    rmdir(dir);
}

/* run() with the forward pass driven chunk by chunk and, with rows (not
 * NULL), every row's logits asked for: *rows is the hash of all of them (n
 * rows of n_vocab); o's are the last row's, all of them. gemma4's shared layers are its last: no later layer reads
 * their output, so a shared layer's mistake at a position inside a pass
 * shows in that position's logits alone, not in the last one's or in the
 * cache. */
static int run_rows(kvt_model *m, const int32_t *t, size_t n, const uint32_t *chunks, size_t nc, uint32_t threads,
                    run_out *o, uint64_t *rows)
{
    kvt_session *s = NULL;
    kvt_session_opts so = {.n_threads = threads};
    int rc = kvt_session_new(&s, m, &so);
    if (rc) return rc;
    size_t V = m->info.n_vocab;
    float *lg = malloc((rows ? n : 1) * V * sizeof(float));
    if (!lg) rc = KVT_ENOMEM;
    for (size_t done = 0, ci = 0; !rc && done < n;) {
        size_t c = chunks ? chunks[ci++ % nc] : n - done;
        if (c > n - done) c = n - done;
        rc = s->m->arch->forward(s, t + done, c, done, rows ? lg + done * V : lg, rows ? 0 : c - 1);
        done += c;
    }
    if (!rc) {
        if (rows) *rows = XXH3_64bits(lg, n * V * sizeof(float));
        o->n_logits = V;
        o->logits = malloc(V * sizeof(float));
        if (!o->logits) rc = KVT_ENOMEM;
        else memcpy(o->logits, lg + (rows ? n - 1 : 0) * V, V * sizeof(float));
    }
    if (!rc) {
        s->n = n; /* what the session holds, for its cache bytes */
        rc = kvt_session_cache_bytes(s, &o->cache, &o->cache_len);
    }
    free(lg);
    kvt_session_free(s);
    return rc;
}

/* The chunk schedules, thread counts and kernel paths of
 * llama_family_invariance; rows: every row's logits compared (the scalar
 * path's output matrix over every row would double the test's time: its
 * last row and cache bytes are compared); n: the first n tokens only (0:
 * all), against a one-pass run of those. fam_cases is the proof at the
 * default row type (f16), fam_light the one at the other types: fewer
 * tokens (FAM_N_LIGHT), the scalar path over a prefix. */
enum { PATH_WIDE, PATH_SCALAR, PATH_AVX2 };
static const uint32_t fam_odd[] = {9, 1, 70, 3}, fam_ones[] = {1};
typedef struct fam_case { const uint32_t *c; size_t n; uint32_t th; int path; bool rows; size_t toks; } fam_case;
static const fam_case fam_cases[] = {
    {fam_odd, 4, 2, PATH_WIDE, true, 0}, {fam_ones, 1, 1, PATH_WIDE, true, 0}, {NULL, 0, 3, PATH_WIDE, true, 0},
    {fam_odd, 4, 1, PATH_SCALAR, false, 0}, {fam_odd, 4, 2, PATH_AVX2, false, 0},
};
static const fam_case fam_light[] = {
    {fam_odd, 4, 2, PATH_WIDE, true, 0}, {NULL, 0, 3, PATH_WIDE, false, 0}, {fam_odd, 4, 4, PATH_AVX2, false, 0},
    {fam_odd, 4, 1, PATH_SCALAR, false, 40},
};
enum { FAM_CASES = sizeof fam_cases / sizeof fam_cases[0], FAM_LIGHT = sizeof fam_light / sizeof fam_light[0],
       FAM_N_LIGHT = 136 /* past the 128-row block and two 64-token windows */ };

/* How many of the cases cs[0..nc) give the bits of one pass on one thread
 * over t[0..n): every row's logits (the last row's where rows is false)
 * and the cache bytes; -1 when a run fails (the test has failed: the
 * message says why). The AVX2-without-AVX-512 case counts as agreeing
 * when the CPU has no AVX-512 (kvt_test_kernel_paths says so). */
static int fam_agree(kvt_model *m, const int32_t *t, size_t n, const fam_case *cs, size_t nc, bool wide)
{
    run_out ref = {0}, o = {0}, pre = {0};
    uint64_t ref_rows = 0, rows = 0;
    int rc = run_rows(m, t, n, NULL, 0, 1, &ref, &ref_rows), agree = 0;
    for (size_t i = 0; !rc && i < nc; i++) {
        if (cs[i].path == PATH_AVX2 && !wide) { agree++; continue; }
        size_t k = cs[i].toks ? cs[i].toks : n;
        if (k != n) rc = run_rows(m, t, k, NULL, 0, 1, &pre, NULL);
        bool old = kvt_kernels_force_scalar(cs[i].path == PATH_SCALAR),
             old2 = kvt_kernels_force_avx2(cs[i].path == PATH_AVX2);
        if (!rc) rc = run_rows(m, t, k, cs[i].c, cs[i].n, cs[i].th, &o, cs[i].rows ? &rows : NULL);
        kvt_kernels_force_scalar(old);
        kvt_kernels_force_avx2(old2);
        agree += !rc && same(k != n ? &pre : &ref, &o) && (!cs[i].rows || rows == ref_rows);
        run_free(&o);
        run_free(&pre);
        o = pre = (run_out){0};
    }
    run_free(&ref);
    if (rc) kvt_test_fail(__FILE__, __LINE__, "run: %s: %s", kvt_strerror(rc), kvt_errmsg());
    return rc ? -1 : agree;
}

/* The row types of the family's proof: the default (f16) with fam_cases,
 * the others with fam_light; each model opened anew for its types (they
 * are set before a model's first session). */
static const kvt_row_type fam_types[] = {KVT_ROWS_DEFAULT, KVT_ROWS_F32, KVT_ROWS_BF16, KVT_ROWS_Q8_0};
enum { FAM_TYPES = sizeof fam_types / sizeof fam_types[0] };

/* The other rows of the llama family (synth_family.h: llama 3's
 * rope_freqs, qwen2's biases, qwen3's head norms and head length, qwen3moe's
 * routed experts, gemma3's window layers, 64 tokens, over 200 tokens so
 * that most positions see past it; gemma4's two shapes, whose shared
 * layers read a ring that the 70-token chunk rewrites whole in one pass;
 * qwen35's two): every position's logits (all of the vocabulary's: one
 * hash of all the rows; the scalar and AVX2 paths' last position's) and
 * every cache byte are the same bits whatever the chunk schedule, the
 * thread count (1-4) or the kernel path (AVX-512, AVX2 without it,
 * scalar), for every row type of the cache: f16 (the default) over 200
 * tokens, f32, bf16 and q8_0 over 136 (fam_light). Window attention starts
 * at a position fixed by the token's own, an expert's rows are its tokens'
 * own, and K and V are rounded to their row type before anyone reads them,
 * so no schedule can move any of them.
 * Negative controls: a window anchored to its pass's first position
 * (KVT_LLAMA_FAULT_WINDOW_CHUNK) leaves gemma3 with 1 of 5 schedules
 * agreeing; gemma4's shared layers' source ring written right after its
 * own layer, before they read it (KVT_LLAMA_FAULT_SOURCE_RING_EARLY),
 * leaves gemma4 with some disagreeing; K and V left unrounded after RoPE
 * (KVT_LLAMA_FAULT_ROWS_UNROUNDED: a pass's window layers read their own
 * tokens' rows as computed, a later pass the stored ones) leaves gemma3 in
 * f16 and in q8_0 with some disagreeing. */
TEST(llama_family_invariance)
{
    const char *vocab = kvt_test_shared("vocab/ggml-vocab-llama-spm.gguf");
    if (!vocab) SKIP("../shared/vocab absent");
    char vpath[1024];
    snprintf(vpath, sizeof vpath, "%s", vocab);
    char dir[] = "/tmp/kvtier-family-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir) != NULL);
    bool wide = kvt_test_kernel_paths();
    static const struct { fam_spec f; int fault; const char *what; bool unrounded; } fams[] = {
        {{"llama", false, false, FAM_HEAD_DIM, true, false, false}, 0, NULL, false},
        {{"qwen2", true, false, FAM_HEAD_DIM, false, false, false}, 0, NULL, false},
        {{"qwen3", false, true, 128, false, false, false}, 0, NULL, false},
        {{"qwen3moe", false, true, 128, false, true, false}, 0, NULL, false},
        {{"gemma3", false, true, FAM_HEAD_DIM, false, false, true}, KVT_LLAMA_FAULT_WINDOW_CHUNK,
         "a window anchored to its pass's first position", true},
        {{"gemma4", .gemma4 = FAM_G4_DENSE}, KVT_LLAMA_FAULT_SOURCE_RING_EARLY,
         "the shared layers' source ring written before they read it", false},
        {{"gemma4", .gemma4 = FAM_G4_MOE}, 0, NULL, false},
        {{"qwen35", .qwen35 = FAM_Q35_DENSE}, 0, NULL, false},
        {{"qwen35moe", .qwen35 = FAM_Q35_MOE}, 0, NULL, false}};
    enum { N = 200 };
    int32_t t[N];
    seq(t, N, 13);
    for (size_t f = 0; f < sizeof fams / sizeof *fams; f++) {
        const fam_spec *fs = &fams[f].f;
        const char *what = fs->gemma4 == FAM_G4_MOE ? " (experts)" : "";
        char path[96];
        snprintf(path, sizeof path, "%s/%s%s.gguf", dir, fs->arch, fs->gemma4 == FAM_G4_MOE ? "-moe" : "");
        CHECK_OK(fam_write(path, vpath, 31 + f, FAM_ROPE_BASE, fs, false));
        for (size_t r = 0; r < FAM_TYPES; r++) {
            kvt_row_type rt = fam_types[r];
            const char *tn = kvt_row_type_name(rt);
            bool full = rt == KVT_ROWS_DEFAULT;
            const fam_case *cs = full ? fam_cases : fam_light;
            size_t nc = full ? FAM_CASES : FAM_LIGHT, n = full ? N : FAM_N_LIGHT;
            kvt_model *m = NULL;
            CHECK_OK(kvt_model_open(&m, path));
            CHECK_OK(kvt_model_set_cache_types(m, rt, rt));
            int agree = fam_agree(m, t, n, cs, nc, wide);
            printf("    %s%s, %s rows: %d of %zu schedules, thread counts and kernel paths give the same bits\n",
                   fs->arch, what, tn, agree, nc);
            if (agree != (int)nc) /* the other families still run */
                kvt_test_fail(__FILE__, __LINE__, "%s%s, %s rows: a schedule, thread count or kernel path changes "
                              "the bits", fs->arch, what, tn);
            if (full && fams[f].fault) { /* the negative control */
                kvt_llama_fault = fams[f].fault;
                agree = fam_agree(m, t, n, cs, nc, wide);
                kvt_llama_fault = KVT_LLAMA_FAULT_NONE;
                printf("    control, %s: %d of %zu agree\n", fams[f].what, agree, nc);
                if (agree == (int)nc)
                    kvt_test_fail(__FILE__, __LINE__, "%s: control: %s went unnoticed", fs->arch, fams[f].what);
            }
            if (fams[f].unrounded && (full || rt == KVT_ROWS_Q8_0)) { /* the rows' control */
                kvt_llama_fault = KVT_LLAMA_FAULT_ROWS_UNROUNDED;
                agree = fam_agree(m, t, FAM_N_LIGHT, fam_light, FAM_LIGHT, wide);
                kvt_llama_fault = KVT_LLAMA_FAULT_NONE;
                printf("    control, %s rows left unrounded after RoPE: %d of %zu agree\n", tn, agree,
                       (size_t)FAM_LIGHT);
                if (agree == (int)FAM_LIGHT)
                    kvt_test_fail(__FILE__, __LINE__, "%s, %s rows: control: K and V unrounded went unnoticed",
                                  fs->arch, tn);
            }
            kvt_model_close(m);
        }
        unlink(path);
    }
    kvt_test_clear_dir(dir);
    rmdir(dir);
}

/* The forward pass allocates nothing but the cache blocks its new rows take
 * (its scratch is the session's, llama_work): a 300-token prefill pass in
 * Q4_K (quantised activations) at 2 threads past the first 128-row block,
 * then one decode step. */
TEST(llama_forward_allocates_no_scratch)
{
    const char *p = kvt_test_shared(STORIES);
    if (!p) SKIP("../shared absent");
    char dir[] = "/tmp/kvtier-alloc-XXXXXX", path[64];
    CHECK(kvt_test_mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/m.gguf", dir);
    enum { N = 501 };
    int32_t t[N];
    seq(t, N, 5);
    size_t k = 0;
    while (scale_fields[k].type != KVT_GGML_Q4_K) k++;
    CHECK_OK(synth_typed(p, path, k, 3, SYNTH_DEFAULT));
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_open(&m, path));
    kvt_session *s = NULL;
    kvt_session_opts so = {.n_ctx = 1024, .n_threads = 2};
    CHECK_OK(kvt_session_new(&s, m, &so));
    bool ok = kvt_test_forward_no_scratch(s, t, 200);
    kvt_session_free(s);
    kvt_model_close(m);
    kvt_test_clear_dir(dir);
    rmdir(dir);
    CHECKF(ok, "the forward pass allocated");
}

/* src copied to dst with key set to *v (v NULL: left out; key NULL: none)
 * and tensor tname's bytes replaced by n floats (absent from src: added as
 * a vector of n; data NULL: left out). */
static int g4_edit(const char *src, const char *dst, const char *key, const kvt_gguf_val *v, const char *tname,
                   const float *data, size_t n)
{
    kvt_gguf *g = NULL;
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    int rc = w ? kvt_gguf_open(&g, src) : KVT_ENOMEM;
    bool found = false;
    for (size_t i = 0; !rc && i < kvt_gguf_n_kv(g); i++)
        if (!key || strcmp(kvt_gguf_key(g, i), key)) rc = kvt_gguf_writer_set(w, kvt_gguf_key(g, i), kvt_gguf_val_at(g, i));
    if (!rc && key && v) rc = kvt_gguf_writer_set(w, key, v);
    for (size_t i = 0; !rc && i < kvt_gguf_n_tensors(g); i++) {
        const kvt_gguf_tensor *x = kvt_gguf_tensor_at(g, i);
        bool it = tname && !strcmp(x->name, tname);
        found |= it;
        if (it && !data) continue;
        rc = kvt_gguf_writer_add_tensor(w, x->name, x->type, x->n_dims, x->ne, it ? (const void *)data : x->data,
                                        it ? n * sizeof(float) : x->n_bytes);
    }
    uint64_t ne[4] = {n, 1, 1, 1};
    if (!rc && tname && data && !found) rc = kvt_gguf_writer_add_tensor(w, tname, KVT_GGML_F32, 1, ne, data, n * 4);
    if (!rc) rc = kvt_gguf_writer_write(w, dst);
    kvt_gguf_writer_free(w);
    kvt_gguf_close(g);
    return rc;
}

/* gemma4's file checks and fingerprint, on its synthetic MoE shape
 * (synth_family.h): a file with one of its hyperparameters or tensors
 * changed loads with another fingerprint, and files llama.cpp refuses or
 * kvtier cannot run are refused with KVT_EFORMAT (KVT_EUNSUPPORTED: an
 * output scale kvtier does not apply) naming the key or tensor. */
TEST(llama_gemma4_format)
{
    const char *vocab = kvt_test_shared("vocab/ggml-vocab-llama-spm.gguf");
    if (!vocab) SKIP("../shared absent");
    char vpath[1024], dir[] = "/tmp/kvtier-g4fmt-XXXXXX", src[96], dst[96];
    snprintf(vpath, sizeof vpath, "%s", vocab);
    CHECK(kvt_test_mkdtemp(dir) != NULL);
    snprintf(src, sizeof src, "%s/g4.gguf", dir);
    snprintf(dst, sizeof dst, "%s/edit.gguf", dir);
    const fam_spec f = {"gemma4", .gemma4 = FAM_G4_MOE};
    CHECK_OK(fam_write(src, vpath, 7, FAM_ROPE_BASE, &f, false));
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_open(&m, src));
    uint64_t fp0 = kvt_model_fingerprint(m);
    kvt_model_close(m);
    kvt_gguf_val u[16], arr = {.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_U32, .n = FAM_G4_LAYERS - 1, .v.arr = u};
    for (int i = 0; i < 16; i++) u[i] = (kvt_gguf_val){.type = KVT_GGUF_U32, .v.u = 2};
#define U32(x) (&(kvt_gguf_val){.type = KVT_GGUF_U32, .v.u = (x)})
#define F32(x) (&(kvt_gguf_val){.type = KVT_GGUF_F32, .v.f = (x)})
    const float two = 2.0f, e8[FAM_MOE_E] = {1, 2, 3, 4, 5, 6, 7, 8};
    float d256[FAM_DIM];
    for (int i = 0; i < FAM_DIM; i++) d256[i] = 1.0f + (float)i / FAM_DIM;
    const struct { const char *key; const kvt_gguf_val *v; const char *t; const float *d; size_t n; } same[] = {
        {"gemma4.attention.shared_kv_layers", U32(0), NULL, NULL, 0},
        {"gemma4.rope.dimension_count_swa", U32(16), NULL, NULL, 0},
        {"gemma4.rope.freq_base_swa", F32(500), NULL, NULL, 0},
        {"gemma4.final_logit_softcapping", F32(20), NULL, NULL, 0},
        {"gemma4.expert_used_count", U32(3), NULL, NULL, 0},
        {"gemma4.attention.sliding_window", U32(32), NULL, NULL, 0},
        {NULL, NULL, "blk.0.layer_output_scale.weight", &two, 1},
        {NULL, NULL, "blk.2.ffn_gate_inp.scale", d256, FAM_DIM},
        {NULL, NULL, "blk.2.ffn_down_exps.scale", e8, FAM_MOE_E},
        {NULL, NULL, "blk.3.post_ffw_norm_2.weight", d256, FAM_DIM},
        {NULL, NULL, "blk.4.pre_ffw_norm_2.weight", d256, FAM_DIM},
        {NULL, NULL, "blk.5.post_ffw_norm_1.weight", d256, FAM_DIM},
        {NULL, NULL, "blk.5.ffn_down_exps.scale", e8, FAM_MOE_E}, /* absent on layer 5: added */
    };
    size_t differ = 0, ns = sizeof same / sizeof *same;
    for (size_t i = 0; i < ns; i++) {
        CHECK_OK(g4_edit(src, dst, same[i].key, same[i].v, same[i].t, same[i].d, same[i].n));
        int rc = kvt_model_open(&m, dst);
        CHECKF(rc == KVT_OK, "%s: %s", same[i].key ? same[i].key : same[i].t, kvt_errmsg());
        bool d = kvt_model_fingerprint(m) != fp0;
        if (!d) printf("    %s changed, the same fingerprint\n", same[i].key ? same[i].key : same[i].t);
        differ += d;
        kvt_model_close(m);
    }
    printf("    %zu of %zu changed hyperparameters and tensors change the fingerprint\n", differ, ns);
    CHECK(differ == ns);
    const struct { const char *key; const kvt_gguf_val *v; const char *t; const float *d; size_t n; int rc;
                   const char *says; } bad[] = {
        {"gemma4.attention.sliding_window_pattern", U32(2), NULL, NULL, 0, KVT_EFORMAT, "sliding_window_pattern"},
        {"gemma4.attention.head_count_kv", &arr, NULL, NULL, 0, KVT_EFORMAT, "gemma4.attention.head_count_kv"},
        {"gemma4.feed_forward_length", &arr, NULL, NULL, 0, KVT_EFORMAT, "gemma4.feed_forward_length"},
        {"gemma4.attention.key_length_swa", NULL, NULL, NULL, 0, KVT_EFORMAT, "gemma4.attention.key_length_swa"},
        {"gemma4.attention.value_length_swa", U32(32), NULL, NULL, 0, KVT_EFORMAT, "value_length_swa"},
        {"gemma4.embedding_length_per_layer_input", NULL, NULL, NULL, 0, KVT_EFORMAT,
         "embedding_length_per_layer_input"},
        {"gemma4.attention.sliding_window", NULL, NULL, NULL, 0, KVT_EFORMAT, "gemma4.attention.sliding_window"},
        {"gemma4.attention.layer_norm_rms_epsilon", NULL, NULL, NULL, 0, KVT_EFORMAT, "layer_norm_rms_epsilon"},
        {"gemma4.attention.shared_kv_layers", U32(5), NULL, NULL, 0, KVT_EFORMAT, "shared_kv_layers"},
        {"gemma4.attention.shared_kv_layers", U32(1), NULL, NULL, 0, KVT_EFORMAT, "another kind"},
        {"gemma4.rope.dimension_count_swa", U32(128), NULL, NULL, 0, KVT_EFORMAT, "rope.dimension_count"},
        {"gemma4.expert_used_count", U32(9), NULL, NULL, 0, KVT_EFORMAT, "expert_used_count"},
        {NULL, NULL, "rope_freqs.weight", NULL, 0, KVT_EFORMAT, "rope_freqs.weight"},
        {NULL, NULL, "blk.1.attn_q.scale", &two, 1, KVT_EUNSUPPORTED, "blk.1.attn_q.scale"},
    };
    size_t refused = 0, nb = sizeof bad / sizeof *bad;
    for (size_t i = 0; i < nb; i++) {
        CHECK_OK(g4_edit(src, dst, bad[i].key, bad[i].v, bad[i].t, bad[i].d, bad[i].n));
        m = NULL;
        int rc = kvt_model_open(&m, dst);
        bool ok = rc == bad[i].rc && strstr(kvt_errmsg(), bad[i].says);
        if (!ok) printf("    %s: %s (%s)\n", bad[i].key ? bad[i].key : bad[i].t, kvt_strerror(rc), rc ? kvt_errmsg() : "");
        refused += ok;
        kvt_model_close(m);
    }
#undef U32
#undef F32
    printf("    %zu of %zu bad files refused, naming the key or tensor\n", refused, nb);
    CHECK(refused == nb);
    kvt_test_clear_dir(dir);
    rmdir(dir);
}

/* Batched steps on a Q4_K llama (tests/test_batch.c): quantised
 * activations per row and integer dot products give each session its bits
 * alone. */
TEST(llama_batch_q4k)
{
    const char *p = kvt_test_shared(STORIES);
    if (!p) SKIP("../shared absent");
    char dir[] = "/tmp/kvtier-batchq-XXXXXX", path[64];
    CHECK(kvt_test_mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/m.gguf", dir);
    size_t k = 0;
    while (scale_fields[k].type != KVT_GGML_Q4_K) k++;
    CHECK_OK(synth_typed(p, path, k, 3, SYNTH_DEFAULT));
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_open(&m, path));
    int good = kvt_test_batch_invariance(m, "Q4_K llama", 4, kvt_test_seed("llama_batch_q4k"));
    kvt_model_close(m);
    kvt_test_clear_dir(dir);
    rmdir(dir);
    CHECK(good == 4);
}
