/* Batched steps (kvt_session_step, kvt_arch.forward_batch): several
 * sessions advanced by one forward pass must each get the bits they get
 * alone. For every architecture the same request (a prompt, then greedy
 * decoding) runs once alone, by kvt_session_sync and kvt_session_decode,
 * and then inside batches of 1 to 7 random others, which join and leave
 * at random steps, prefill in random chunks or decode; the step's token
 * budget is random too, so the request's prompt is cut differently every
 * time. After its prefill and after every token, its logits must be the
 * alone run's bit for bit, its sampled tokens the same, and at the end
 * its cache bytes and checkpoints (kvt_test_digest_ckpt: their positions,
 * logits and state) too.
 *
 *   batch_llama          stories260K (global attention)
 *   batch_window         gemma3 (window rings) and gemma4 (shared layers,
 *                        per-layer embeddings)
 *   batch_recurrent      qwen35 and qwen35moe (DeltaNet state, experts)
 *   batch_moe            qwen3moe and gemma4 with experts (experts chosen
 *                        per token of a batch)
 *   batch_family         llama 3 (rope_freqs), qwen2 (biases), qwen3 (head
 *                        norms)
 *   batch_ds4            ds4-tiny (hash-routed and compressed layers,
 *                        the indexer's selection)
 *   batch_ds4_segments   ds4's batched pass (kvt_arch.forward_batch) case
 *                        by case: 1 to 4 segments of different lengths and
 *                        positions (across a 128-token compression block,
 *                        around the window, decode steps beside prefill
 *                        chunks), each segment's logits of every row, cache
 *                        and checkpoints, session length and MTP hidden
 *                        state equal to the session stepped alone, that the
 *                        batched pass ran (a batch over the scratch's pass
 *                        runs one after another), 1 and 3 threads; ds4-tiny
 *                        with an MTP layer, a wider ds4-tiny stored as
 *                        q8_0 (integer kernels) and ds4-mini
 *   batch_ds4_fault_detected  its control: later segments rotated as if
 *                        they went on from the one before them in the pass
 *                        (KVT_DS4_FAULT_BATCH_POS) must be caught in every
 *                        batched pass of two or more
 *   llama_batch_q4k      (tests/test_llama.c) a Q4_K llama: quantised
 *                        activations and integer dot products
 *   batch_fault_detected the negative control: a batched pass that gives
 *                        a segment the positions of the pass, not its own
 *                        (KVT_LLAMA_FAULT_BATCH_POS), must be caught
 *   batch_ckpt_fault_detected  the checkpoints' control: a batched step
 *                        that leaves out the checkpoint at the mark
 *                        (KVT_SESSION_FAULT_STEP_MARK) must be caught
 *
 * Each model runs its rounds with its cache in f16 (the default), then a
 * round with f32, bf16 and q8_0 rows each (stories260K: no q8_0, its heads
 * are 8 long), and with q8_0 K and f16 V where it has window rings.
 *
 * A synthetic model that cannot be written or loaded fails the test; only
 * an absent vocabulary (../shared/vocab) skips it.
 *   batch_step_checks    what kvt_session_step refuses, and that a refused
 *                        or failed step leaves every session as it was
 */
#include "test.h"
#include "arch/model.h"
#include "arch/llama.h"
#include "arch/ds4.h"
#include "synth_family.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

enum { MAX_OTHERS = 7, MAX_TOK = 400, DECODE = 12 };

static int32_t argmax(const float *l, size_t n)
{
    size_t b = 0;
    for (size_t i = 1; i < n; i++) b = l[i] > l[b] ? i : b;
    return (int32_t)b;
}

static uint64_t logits_hash(const kvt_session *s, const kvt_model *m)
{
    kvt_model_info mi;
    kvt_model_info_get(m, &mi);
    return XXH3_64bits(kvt_session_logits(s), (size_t)mi.n_vocab * sizeof(float));
}

/* A request: its prompt, then greedy tokens; what it saw (the hash of its
 * logits after the prompt and after every token, the tokens). */
typedef struct req {
    kvt_session *s;
    int32_t tok[MAX_TOK + DECODE + 1];
    size_t n_prompt, n_dec, want_dec;
    uint64_t seen[DECODE + 1];
    size_t n_ckpt;           /* alone: the checkpoints it ended with */
    int32_t next;            /* decoding: the token to run next */
    bool prefilled;
} req;

static void rand_prompt(kvt_model *m, int32_t *t, size_t n, uint64_t *rng)
{
    kvt_model_info mi;
    kvt_model_info_get(m, &mi);
    for (size_t i = 0; i < n; i++) t[i] = (int32_t)(3 + kvt_test_rand(rng) % (mi.n_vocab - 3));
}

/* The request alone: sync, then decode. */
static bool run_alone(kvt_model *m, const kvt_session_opts *so, req *r, uint64_t *digest)
{
    kvt_model_info mi;
    kvt_model_info_get(m, &mi);
    kvt_session *s = NULL;
    bool ok = !kvt_session_new(&s, m, so);
    if (ok) kvt_session_set_mark(s, r->n_prompt / 2);
    ok = ok && !kvt_session_sync(s, r->tok, r->n_prompt, NULL);
    for (size_t d = 0; ok && d <= r->want_dec; d++) {
        r->seen[d] = logits_hash(s, m);
        if (d == r->want_dec) break;
        int32_t t = argmax(kvt_session_logits(s), mi.n_vocab);
        r->tok[r->n_prompt + d] = t;
        ok = !kvt_session_decode(s, t);
    }
    if (ok) *digest = kvt_test_digest_ckpt(s, m);
    if (ok) r->n_ckpt = s->n_ckpt;
    kvt_session_free(s);
    return ok;
}

/* One round: the target inside batches of random others. Returns whether
 * everything the target saw is what it saw alone (a message otherwise). */
static bool run_batched(kvt_model *m, const kvt_session_opts *so, const req *alone, uint64_t want, uint64_t *rng,
                        size_t *steps, size_t *max_k)
{
    kvt_model_info mi;
    kvt_model_info_get(m, &mi);
    req *rs = calloc(MAX_OTHERS + 1, sizeof *rs);
    if (!rs) return false;
    size_t live = 1 + kvt_test_rand(rng) % (MAX_OTHERS + 1); /* requests at once, the target's seat among them */
    bool ok = true, target_done = false;
    size_t target = 0;
    rs[0] = *alone;
    rs[0].n_dec = 0;
    rs[0].prefilled = false;
    if (kvt_session_new(&rs[0].s, m, so)) { free(rs); return false; }
    /* the others join at random steps; each has a random prompt and decodes a random count */
    kvt_session_set_mark(rs[0].s, alone->n_prompt / 2);
    size_t n = 1;
    for (size_t guard = 0; ok && !target_done && guard < 4 * (MAX_TOK + DECODE); guard++) {
        while (n < live && kvt_test_rand(rng) % 3 == 0) {
            req *o = &rs[n];
            o->n_prompt = 1 + kvt_test_rand(rng) % 300;
            o->want_dec = kvt_test_rand(rng) % (DECODE + 1);
            rand_prompt(m, o->tok, o->n_prompt, rng);
            if (kvt_session_new(&o->s, m, so)) { ok = false; break; }
            n++;
        }
        /* a step over every live request */
        kvt_step st[MAX_OTHERS + 1];
        size_t who[MAX_OTHERS + 1], k = 0;
        for (size_t i = 0; i < n; i++) {
            req *r = &rs[i];
            if (!r->s) continue;
            size_t at = kvt_session_len(r->s);
            if (!r->prefilled) st[k] = (kvt_step){r->s, r->tok + at, r->n_prompt - at, true, 0};
            else st[k] = (kvt_step){r->s, &r->next, 1, false, 0};
            who[k++] = i;
        }
        /* the order of the segments in the pass, shuffled */
        for (size_t i = k; i > 1; i--) {
            size_t j = kvt_test_rand(rng) % i;
            kvt_step t = st[i - 1]; st[i - 1] = st[j]; st[j] = t;
            size_t w = who[i - 1]; who[i - 1] = who[j]; who[j] = w;
        }
        size_t budget = k + kvt_test_rand(rng) % 200;
        if (kvt_session_step(st, k, budget)) {
            printf("    step of %zu: %s\n", k, kvt_errmsg());
            ok = false;
            break;
        }
        (*steps)++;
        if (k > *max_k) *max_k = k;
        for (size_t q = 0; q < k; q++) {
            req *r = &rs[who[q]];
            if (!r->prefilled && kvt_session_len(r->s) < r->n_prompt) continue;
            if (r->prefilled) r->n_dec++;
            r->prefilled = true;
            if (who[q] == target) {
                uint64_t h = logits_hash(r->s, m);
                if (h != alone->seen[r->n_dec]) {
                    printf("    the target's logits after %zu prompt + %zu tokens differ in a batch of %zu\n",
                           r->n_prompt, r->n_dec, k);
                    ok = false;
                }
            }
            if (r->n_dec == r->want_dec) { /* it leaves */
                if (who[q] == target) {
                    if (kvt_test_digest_ckpt(r->s, m) != want) {
                        printf("    the target's cache and checkpoints differ from the alone run's (%zu "
                               "checkpoints alone, %zu batched)\n", alone->n_ckpt, r->s->n_ckpt);
                        ok = false;
                    }
                    target_done = true;
                }
                kvt_session_free(r->s);
                r->s = NULL;
                continue;
            }
            r->next = argmax(kvt_session_logits(r->s), mi.n_vocab);
            if (who[q] == target && r->next != alone->tok[r->n_prompt + r->n_dec]) {
                printf("    the target sampled another token at %zu\n", r->n_dec);
                ok = false;
            }
        }
    }
    if (ok && !target_done) { printf("    the target did not finish\n"); ok = false; }
    for (size_t i = 0; i <= MAX_OTHERS; i++) kvt_session_free(rs[i].s);
    free(rs);
    return ok;
}

int kvt_test_batch_invariance(kvt_model *m, const char *what, size_t rounds, uint64_t seed)
{
    kvt_session_opts so = {.n_ctx = 1024, .n_threads = 2, .checkpoint_interval = 128};
    uint64_t rng = seed;
    size_t good = 0, steps = 0, max_k = 0;
    for (size_t i = 0; i < rounds; i++) {
        req *r = calloc(1, sizeof *r);
        if (!r) return 0;
        r->n_prompt = 1 + kvt_test_rand(&rng) % MAX_TOK;
        r->want_dec = 1 + kvt_test_rand(&rng) % DECODE;
        rand_prompt(m, r->tok, r->n_prompt, &rng);
        r->tok[0] = 1;
        uint64_t want = 0;
        bool ok = run_alone(m, &so, r, &want) && run_batched(m, &so, r, want, &rng, &steps, &max_k);
        if (!ok) printf("    %s round %zu (prompt %zu, %zu tokens): differs\n", what, i, r->n_prompt, r->want_dec);
        good += ok;
        free(r);
    }
    printf("    %s: %zu of %zu requests bit-identical alone and batched (%zu steps, up to %zu sessions a step)\n",
           what, good, rounds, steps, max_k);
    return (int)good;
}

/* The synthetic model f, written to dir; NULL when the test is skipped
 * (the vocabulary is absent) or failed (the model could not be written or
 * loaded: the message says why). */
static kvt_model *synth(const fam_spec *f, char *dir, char *path, size_t cap)
{
    const char *vocab = kvt_test_shared("vocab/ggml-vocab-llama-spm.gguf");
    if (!vocab) { kvt_test_skip("../shared/vocab absent"); return NULL; }
    char v[1024];
    snprintf(v, sizeof v, "%s", vocab);
    if (!kvt_test_mkdtemp(dir)) { kvt_test_fail(__FILE__, __LINE__, "mkdtemp %s: %s", dir, strerror(errno)); return NULL; }
    snprintf(path, cap, "%s/%s.gguf", dir, f->arch);
    kvt_model *m = NULL;
    int rc = fam_write(path, v, 9, FAM_ROPE_BASE, f, false);
    if (rc) kvt_test_fail(__FILE__, __LINE__, "writing %s: %s: %s", path, kvt_strerror(rc), kvt_errmsg());
    else if ((rc = kvt_model_open(&m, path)))
        kvt_test_fail(__FILE__, __LINE__, "loading %s: %s: %s", path, kvt_strerror(rc), kvt_errmsg());
    if (rc) { unlink(path); rmdir(dir); }
    return m;
}

/* The row types a batch runs with beyond the default (f16), a round each:
 * f32, bf16, q8_0, and for the models with window rings q8_0 K with f16 V
 * (rings whose K and V rows differ in size). */
static const struct { kvt_row_type k, v; } more_rows[] = {
    {KVT_ROWS_F32, KVT_ROWS_F32}, {KVT_ROWS_BF16, KVT_ROWS_BF16}, {KVT_ROWS_Q8_0, KVT_ROWS_Q8_0},
    {KVT_ROWS_Q8_0, KVT_ROWS_F16}};

/* m (its file at path): rounds rounds in the default row types, then a
 * round in each of the first nmore of more_rows, the model opened anew. */
static void typed_rounds(kvt_model *m, const char *path, const char *name, size_t rounds, size_t nmore)
{
    uint64_t seed = kvt_test_seed(name);
    int good = kvt_test_batch_invariance(m, name, rounds, seed);
    CHECK(good == (int)rounds);
    for (size_t r = 0; r < nmore; r++) {
        kvt_model *mt = NULL;
        char what[96];
        snprintf(what, sizeof what, "%s, K %s, V %s", name, kvt_row_type_name(more_rows[r].k),
                 kvt_row_type_name(more_rows[r].v));
        CHECK_OK(kvt_model_open(&mt, path));
        int rc = kvt_model_set_cache_types(mt, more_rows[r].k, more_rows[r].v);
        good = rc ? 0 : kvt_test_batch_invariance(mt, what, 1, seed + 1 + r);
        kvt_model_close(mt);
        CHECK_OK(rc);
        CHECKF(good == 1, "%s: differs", what);
    }
}

static void synth_case(const fam_spec *f, size_t rounds)
{
    char dir[] = "/tmp/kvtier-batch-XXXXXX", path[96];
    kvt_model *m = synth(f, dir, path, sizeof path);
    if (!m) return;
    typed_rounds(m, path, f->arch, rounds, f->gemma || f->gemma4 ? 4 : 3);
    kvt_model_close(m);
    unlink(path);
    rmdir(dir);
}

/* stories260K; its heads are 8 long: no q8_0 rows */
TEST(batch_llama)
{
    const char *p = kvt_test_shared("models/stories260K.gguf");
    if (!p) SKIP("../shared absent");
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_open(&m, p));
    typed_rounds(m, p, "stories260K", 8, 2);
    kvt_model_close(m);
}

TEST(batch_window)
{
    synth_case(&(fam_spec){"gemma3", false, true, FAM_HEAD_DIM, false, false, true}, 4);
    synth_case(&(fam_spec){"gemma4", .gemma4 = FAM_G4_DENSE}, 3);
}

TEST(batch_recurrent)
{
    synth_case(&(fam_spec){"qwen35", .qwen35 = FAM_Q35_DENSE}, 4);
    synth_case(&(fam_spec){"qwen35moe", .qwen35 = FAM_Q35_MOE}, 3);
}

TEST(batch_moe)
{
    synth_case(&(fam_spec){"qwen3moe", false, true, FAM_HEAD_DIM, false, true, false}, 4);
    synth_case(&(fam_spec){"gemma4", .gemma4 = FAM_G4_MOE}, 3);
}

/* The family's other rows: llama 3 (rope_freqs), qwen2 (biases), qwen3
 * (head norms). */
TEST(batch_family)
{
    synth_case(&(fam_spec){"llama", false, false, FAM_HEAD_DIM, true, false, false}, 3);
    synth_case(&(fam_spec){"qwen2", true, false, FAM_HEAD_DIM, false, false, false}, 3);
    synth_case(&(fam_spec){"qwen3", false, true, 128, false, false, false}, 3);
}

TEST(batch_ds4)
{
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_preset(&m, "ds4-tiny", 7, NULL));
    int good = kvt_test_batch_invariance(m, "ds4-tiny", 4, kvt_test_seed("batch_ds4"));
    kvt_model_close(m);
    CHECK(good == 4);
}

/* A batch of ds4_batch_segments: segment g holds pos tokens, then takes n
 * more in the step (rows: the logits of every one of them). */
typedef struct dseg { size_t pos, n; bool rows; } dseg;
typedef struct dcase { size_t k; dseg g[4]; } dcase;

static const dcase ds4_cases[] = {
    {1, {{0, 40, true}}},
    {2, {{120, 16, true}, {37, 1, false}}},                          /* across block 128; a decode step */
    {3, {{0, 130, false}, {250, 1, true}, {14, 5, true}}},           /* a prefill chunk beside decode */
    {4, {{127, 2, true}, {300, 1, false}, {60, 30, true}, {255, 3, false}}},
    {4, {{5, 1, false}, {9, 1, false}, {140, 1, false}, {511, 1, true}}}, /* decode steps only */
    {2, {{0, 200, false}, {64, 100, true}}},                         /* over the pass: one after another */
};

/* One case on m with threads threads: each segment stepped alone, then all
 * of them in one step, in twin sessions. Returns whether every segment got
 * the same bits; *batched: whether the step ran one batched pass. */
static bool ds4_case(kvt_model *m, uint32_t threads, const dcase *dc, uint64_t seed, bool *batched)
{
    kvt_model_info mi;
    kvt_model_info_get(m, &mi);
    size_t V = mi.n_vocab, hf = kvt_ds4_mtp_layers(m) ? kvt_ds4_hidden_floats(m) : 0, total = 0;
    kvt_session_opts so = {.n_ctx = 1024, .n_threads = threads};
    kvt_session *a[4] = {0}, *b[4] = {0};
    int32_t *t[4] = {0};
    float *ra[4] = {0}, *rb[4] = {0}, *ha = hf ? malloc(2 * hf * sizeof(float)) : NULL, *hb = ha ? ha + hf : NULL;
    kvt_step st[4];
    bool ok = !hf || ha;
    for (size_t g = 0; g < dc->k && ok; g++) {
        const dseg *sg = &dc->g[g];
        total += sg->n;
        ok = (t[g] = malloc((sg->pos + sg->n) * sizeof(int32_t))) && !kvt_session_new(&a[g], m, &so) &&
             !kvt_session_new(&b[g], m, &so);
        if (ok && sg->rows)
            ok = (ra[g] = malloc(sg->n * V * sizeof(float))) && (rb[g] = malloc(sg->n * V * sizeof(float)));
        if (!ok) break;
        kvt_test_tokens(t[g], sg->pos + sg->n, seed + g);
        ok = !sg->pos ||
             (!kvt_session_sync(a[g], t[g], sg->pos, NULL) && !kvt_session_sync(b[g], t[g], sg->pos, NULL));
        kvt_step one = {a[g], t[g] + sg->pos, sg->n, false, 0, ra[g], NULL};
        ok = ok && !kvt_session_step(&one, 1, sg->n) && one.done == sg->n;
        st[g] = (kvt_step){b[g], t[g] + sg->pos, sg->n, false, 0, rb[g], NULL};
    }
    if (!ok) printf("    sessions alone: %s\n", kvt_errmsg());
    size_t before = kvt_ds4_batch_passes;
    if (ok && kvt_session_step(st, dc->k, total)) {
        printf("    step of %zu: %s\n", dc->k, kvt_errmsg());
        ok = false;
    }
    *batched = kvt_ds4_batch_passes == before + 1;
    for (size_t g = 0; g < dc->k && ok; g++) {
        const dseg *sg = &dc->g[g];
        size_t end = sg->pos + sg->n;
        bool same = st[g].done == sg->n && kvt_session_len(b[g]) == end && kvt_session_len(a[g]) == end &&
                    kvt_test_digest_ckpt(a[g], m) == kvt_test_digest_ckpt(b[g], m) &&
                    (!sg->rows || !memcmp(ra[g], rb[g], sg->n * V * sizeof(float)));
        if (same && hf) /* the MTP layer's input: the tap of the session's last pass */
            same = !kvt_ds4_hidden(a[g], end - 1, ha) && !kvt_ds4_hidden(b[g], end - 1, hb) &&
                   !memcmp(ha, hb, hf * sizeof(float));
        if (!same) printf("    segment %zu (%zu tokens at %zu) of %zu differs\n", g, sg->n, sg->pos, dc->k);
        ok = same;
    }
    for (size_t g = 0; g < dc->k; g++) {
        kvt_session_free(a[g]);
        kvt_session_free(b[g]);
        free(t[g]);
        free(ra[g]);
        free(rb[g]);
    }
    free(ha);
    return ok;
}

/* Every case on m at 1 and 3 threads: how many were bit-identical, and
 * how many of those with two or more segments in one pass differed
 * (*caught), for the control. */
static size_t ds4_cases_run(kvt_model *m, const char *what, uint64_t seed, size_t *caught)
{
    size_t good = 0, ran = 0;
    *caught = 0;
    for (uint32_t th = 1; th <= 3; th += 2)
        for (size_t c = 0; c < sizeof ds4_cases / sizeof ds4_cases[0]; c++, ran++) {
            const dcase *dc = &ds4_cases[c];
            size_t total = 0;
            for (size_t g = 0; g < dc->k; g++) total += dc->g[g].n;
            bool batched = false, same = ds4_case(m, th, dc, seed + 16 * c, &batched);
            bool want = dc->k > 1 && total <= 256; /* the sessions' pass: the default chunk */
            if (batched != want) {
                printf("    %s case %zu, %u threads: %s\n", what, c, th,
                       want ? "no batched pass" : "batched over the pass");
                same = false;
            }
            if (!same) printf("    %s case %zu, %u threads: differs\n", what, c, th);
            good += same;
            *caught += !same && want;
        }
    printf("    %s: %zu of %zu cases bit-identical alone and batched\n", what, good, ran);
    return good;
}

/* The models of the ds4 cases: ds4-tiny with an MTP layer, a wider
 * ds4-tiny as a q8_0 file (the integer kernels), ds4-mini; NULL when it
 * cannot be had (the test fails). */
static kvt_model *ds4_model(int which, char *dir)
{
    kvt_model *m = NULL;
    int rc;
    if (which == 1) {
        char path[96];
        if (!kvt_test_mkdtemp(dir)) {
            kvt_test_fail(__FILE__, __LINE__, "mkdtemp %s: %s", dir, strerror(errno));
            return NULL;
        }
        snprintf(path, sizeof path, "%s/tiny-q8_0.gguf", dir);
        rc = kvt_model_write_preset("ds4-tiny+D=128,Fe=64", 7, NULL, "q8_0", path);
        if (!rc) rc = kvt_model_open(&m, path);
    } else {
        rc = kvt_model_preset(&m, which ? "ds4-mini" : "ds4-tiny+mtp=1", 7, NULL);
    }
    if (rc) kvt_test_fail(__FILE__, __LINE__, "ds4 model %d: %s: %s", which, kvt_strerror(rc), kvt_errmsg());
    kvt_test_defer_model(m);
    return m;
}

static const char *const ds4_names[] = {"ds4-tiny+mtp=1", "ds4-tiny+D=128,Fe=64 q8_0", "ds4-mini"};

TEST(batch_ds4_segments)
{
    uint64_t seed = kvt_test_seed("batch_ds4_segments");
    size_t n = sizeof ds4_cases / sizeof ds4_cases[0], caught;
    for (int w = 0; w < 3; w++) {
        char dir[] = "/tmp/kvtier-batch-XXXXXX";
        kvt_model *m = ds4_model(w, dir);
        if (!m) return;
        size_t good = ds4_cases_run(m, ds4_names[w], seed, &caught);
        CHECKF(good == 2 * n, "%s: %zu of %zu cases differ", ds4_names[w], 2 * n - good, 2 * n);
    }
}

/* The control: later segments rotated as if they went on from the one
 * before them. Every batched case must be caught (no case's segment starts
 * where the one before it ends); a case run one after another is not
 * affected. */
TEST(batch_ds4_fault_detected)
{
    char dir[] = "/tmp/kvtier-batch-XXXXXX";
    kvt_model *m = ds4_model(0, dir);
    if (!m) return;
    size_t caught, want = 0;
    for (size_t c = 0; c < sizeof ds4_cases / sizeof ds4_cases[0]; c++) {
        size_t total = 0;
        for (size_t g = 0; g < ds4_cases[c].k; g++) total += ds4_cases[c].g[g].n;
        want += 2 * (ds4_cases[c].k > 1 && total <= 256);
    }
    kvt_ds4_fault = KVT_DS4_FAULT_BATCH_POS;
    ds4_cases_run(m, "ds4-tiny+mtp=1 with the fault", 99, &caught);
    kvt_ds4_fault = KVT_DS4_FAULT_NONE;
    CHECKF(caught == want, "%zu of %zu batched cases caught", caught, want);
}

/* The negative control: a batched pass that turns every segment's tokens
 * by their place in the pass, not their positions. */
TEST(batch_fault_detected)
{
    const char *p = kvt_test_shared("models/stories260K.gguf");
    if (!p) SKIP("../shared absent");
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_open(&m, p));
    kvt_llama_fault = KVT_LLAMA_FAULT_BATCH_POS;
    int good = kvt_test_batch_invariance(m, "stories260K with the fault", 6, 77);
    kvt_llama_fault = KVT_LLAMA_FAULT_NONE;
    kvt_model_close(m);
    CHECKF(good < 6, "positions of the pass instead of the segments' went unnoticed");
}

/* The negative control of the checkpoints: a batched step that leaves out
 * the checkpoint at the mark (KVT_SESSION_FAULT_STEP_MARK) changes neither
 * logits nor cache, only the checkpoints; every round must be caught (the
 * seed is fixed: no round's mark is 0 or on the 128-token grid). */
TEST(batch_ckpt_fault_detected)
{
    const char *p = kvt_test_shared("models/stories260K.gguf");
    if (!p) SKIP("../shared absent");
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_open(&m, p));
    kvt_session_fault = KVT_SESSION_FAULT_STEP_MARK;
    int good = kvt_test_batch_invariance(m, "stories260K without the mark's checkpoint", 4, 78);
    kvt_session_fault = KVT_SESSION_FAULT_NONE;
    kvt_model_close(m);
    CHECKF(good == 0, "%d of 4 rounds missed a checkpoint left out", good);
}

/* What a step refuses (nothing changes), and a step whose cache blocks
 * cannot be had (every session as it was, and the same step retried gives
 * the bits of the sessions run alone). */
TEST(batch_step_checks)
{
    const char *p = kvt_test_shared("models/stories260K.gguf");
    if (!p) SKIP("../shared absent");
    kvt_model *m = NULL, *m2 = NULL;
    CHECK_OK(kvt_model_open(&m, p));
    CHECK_OK(kvt_model_open(&m2, p));
    kvt_session_opts so = {.n_ctx = 512, .n_threads = 2};
    kvt_session *a = NULL, *b = NULL, *c = NULL;
    CHECK_OK(kvt_session_new(&a, m, &so));
    CHECK_OK(kvt_session_new(&b, m, &so));
    CHECK_OK(kvt_session_new(&c, m2, &so));
    int32_t t[300];
    uint64_t rng = 5;
    rand_prompt(m, t, 300, &rng);
    /* a and b just before a block of cache rows ends: the step allocates */
    CHECK_OK(kvt_session_sync(a, t, KVT_BLOCK - 1, NULL));
    CHECK_OK(kvt_session_sync(b, t + 7, KVT_BLOCK - 2, NULL));
    uint64_t da = kvt_test_digest(a, m), db = kvt_test_digest(b, m);
    int32_t bad = 1 << 30;
    kvt_step twice[2] = {{a, t, 3, false, 0}, {a, t, 3, false, 0}};
    kvt_step models[2] = {{a, t, 3, false, 0}, {c, t, 3, false, 0}};
    kvt_step range[2] = {{a, t, 3, false, 0}, {b, &bad, 1, false, 0}};
    kvt_step empty[2] = {{a, t, 3, false, 0}, {b, t, 0, false, 0}};
    CHECK(kvt_session_step(twice, 2, 0) == KVT_EINVAL);
    CHECK(kvt_session_step(models, 2, 0) == KVT_EINVAL);
    CHECK(kvt_session_step(range, 2, 0) == KVT_EINVAL);
    CHECK(kvt_session_step(empty, 2, 0) == KVT_EINVAL);
    CHECK(kvt_test_digest(a, m) == da && kvt_test_digest(b, m) == db);
    /* allocation failures, one at a time, until the step goes through */
    size_t failed = 0;
    for (long k = 0; k < 16; k++) {
        kvt_step st[2] = {{a, t + KVT_BLOCK - 1, 4, true, 0}, {b, t + 7 + KVT_BLOCK - 2, 5, true, 0}};
        kvt_test_fail_alloc(k);
        int rc = kvt_session_step(st, 2, 0);
        kvt_test_fail_alloc(-1);
        if (!rc) break;
        failed++;
        CHECKF(kvt_test_digest(a, m) == da && kvt_test_digest(b, m) == db,
               "a step failing at allocation %ld changed a session", k);
    }
    printf("    %zu failed steps left both sessions as they were\n", failed);
    CHECK(failed >= 1);
    CHECK(kvt_session_len(a) == KVT_BLOCK + 3 && kvt_session_len(b) == KVT_BLOCK + 3);
    CHECK(kvt_test_digest(a, m) == kvt_test_twin(m, t, KVT_BLOCK + 3));
    CHECK(kvt_test_digest(b, m) == kvt_test_twin(m, t + 7, KVT_BLOCK + 3));
    /* a full context */
    kvt_session_opts tiny = {.n_ctx = 4, .n_threads = 1};
    kvt_session *f = NULL;
    CHECK_OK(kvt_session_new(&f, m, &tiny));
    CHECK_OK(kvt_session_sync(f, t, 4, NULL));
    kvt_step full = {f, t, 1, false, 0};
    CHECK(kvt_session_step(&full, 1, 0) == KVT_ECTX);
    kvt_session_free(f);
    kvt_session_free(a);
    kvt_session_free(b);
    kvt_session_free(c);
    kvt_model_close(m);
    kvt_model_close(m2);
}
