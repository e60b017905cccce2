/* kvtier bench: how fast prefill and decode run, and what the cache costs.
 *
 * Speed depends on the machine and on whatever else it is doing, so no
 * absolute number here means much alone. Every speed is therefore reported
 * next to a ratio against a baseline measured in the same run (token-by-token
 * vs chunked prefill, 1 thread vs all, the first context of the list vs the
 * others, re-prefill vs snapshot restore). Each measurement is repeated until
 * it has run for a minimum time and the fastest repetition is kept:
 * interference from other processes only ever makes a run slower.
 *
 * The suites here use only the public API (include/kvtier.h), so they measure
 * what an embedding program would get. --suite store hands over to the disk
 * tier's own suite (bench_store.c), --suite fork to the cost of a copy of a
 * session (bench_fork.c). */
#include "app/bench.h"
#include "app/bench_store.h"
#include "app/bench_fork.h"
#include "kernels/cpu.h"
#include "kvtier.h"
#include "store/store.h"
#include "base/util.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define LLAMA_MODEL "../shared/models/stories260K.gguf"
#define LLAMA_PROMPT 512   /* prompt tokens of the llama suite */
#define LLAMA_CHUNK 256
#define PEER_CHUNK 512   /* the llama-bench form's chunk: llama-bench's default micro-batch (-ub 512) */
#define SNAP_TOKENS 8192   /* tokens held by the snapshot suite's session */
#define MAX_CTX 16         /* entries of --ctx-list */
#define MAX_REPS 1000

/* Progress of the prefill being timed; printed only once it runs > 2 s. */
struct prog {
    char label[64];
    double t0, last;            /* start of the sync, latest line */
    bool shown, tty;
};

typedef struct bench {
    const char *model;          /* --model, NULL: each suite's default */
    uint32_t threads;           /* --threads, 0: all cores */
    uint32_t all;               /* what "all threads" resolves to */
    uint64_t ctx[MAX_CTX];      /* --ctx-list */
    size_t n_ctx;
    uint32_t decode;            /* --decode-tokens */
    uint32_t prompt, gen, depth;/* --prompt, --gen, --depth (llama suite) */
    bool peer;                  /* any of those three given: the llama-bench form */
    uint32_t reps;              /* --reps, 0: repeat for min_s */
    kvt_row_type type_k, type_v;/* --cache-type-k, --cache-type-v (-ctk, -ctv) */
    double min_s;               /* minimum measuring time per measurement */
    FILE *csv;
    const char *suite, *model_name; /* of the rows being emitted */
    const kvt_model *m;
    struct prog prog;
} bench;

/* One line of the table. Speed is tokens / secs; ratio is speed / base_rate. */
typedef struct row {
    const char *test;
    uint64_t ctx, tokens;       /* context (frontier) and tokens timed */
    uint32_t threads;
    double secs, base_rate;     /* base_rate 0: this row is a baseline */
    const char *vs;             /* what base_rate was measured on */
    uint64_t bytes;             /* 0: the KV cache plan at ctx; else a snapshot size */
} row;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint32_t ncpu(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (uint32_t)n : 1;
}

/* ---- machine ---- */

/* Peak resident set of this process in KiB (VmHWM), 0 when unknown. */
static uint64_t peak_rss_kib(void)
{
    uint64_t kib = 0;
    return kvt_proc_kib("/proc/self/status", "VmHWM", &kib) ? kib : 0;
}

static void print_machine(const bench *b)
{
    char model[128] = "unknown", flags[8192] = "", line[8192];
    FILE *f = fopen("/proc/cpuinfo", "r");
    while (f && fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (!colon) continue;
        char *v = colon + 1 + (colon[1] == ' ');
        v[strcspn(v, "\n")] = 0;
        if (!strncmp(line, "model name", 10) && !strcmp(model, "unknown"))
            snprintf(model, sizeof model, "%s", v);
        else if (!strncmp(line, "flags", 5) && !flags[0])
            snprintf(flags, sizeof flags, " %s ", v); /* " avx2 " matches whole words */
    }
    if (f) fclose(f);
    /* Other work on the machine skews every number: say how busy it was. */
    double load = -1;
    if ((f = fopen("/proc/loadavg", "r"))) {
        if (fscanf(f, "%lf", &load) != 1) load = -1;
        fclose(f);
    }
    printf("cpu: %s, %u cores online, cpu flags: avx2 %s, fma %s, f16c %s; threads: %u; "
           "load average %.2f; kernels: %s\n", model, ncpu(), strstr(flags, " avx2 ") ? "yes" : "no",
           strstr(flags, " fma ") ? "yes" : "no", strstr(flags, " f16c ") ? "yes" : "no", b->all, load,
           kvt_cpu_isa_name());
}

/* ---- output ---- */

/* A CSV field, quoted when it holds a comma, quote or newline (a model path). */
static void csv_field(FILE *f, const char *v)
{
    if (!strpbrk(v, ",\"\n")) { fprintf(f, "%s,", v); return; }
    fputc('"', f);
    for (; *v; v++) {
        if (*v == '"') fputc('"', f);
        fputc(*v, f);
    }
    fputs("\",", f);
}

static void emit(bench *b, const row *r)
{
    double rate = r->tokens / r->secs, ratio = r->base_rate > 0 ? rate / r->base_rate : 1.0;
    const char *vs = r->base_rate > 0 ? r->vs : "(baseline)";
    kvt_plan p = {0};
    uint64_t bytes = r->bytes;
    double bpt = r->bytes ? (double)r->bytes / r->ctx : 0;
    if (!bytes && kvt_model_plan(b->m, r->ctx, &p) == KVT_OK) {
        bytes = p.total;
        bpt = p.per_token_x1000 / 1000.0;
    }
    uint64_t rss = peak_rss_kib();
    /* the types the model's rows are in (ds4 keeps its own whatever was asked) */
    kvt_plan tp = {0};
    char kv[24] = "-", tk[8] = "", tv[8] = "";
    if (kvt_model_plan(b->m, 1, &tp) == KVT_OK) {
        snprintf(tk, sizeof tk, "%s", kvt_row_type_name(tp.type_k));
        snprintf(tv, sizeof tv, "%s", kvt_row_type_name(tp.type_v));
        snprintf(kv, sizeof kv, "%s/%s", tk, tv);
    }
    /* fewer decimals for large values keep the columns aligned */
    printf("%-8s %-22s %7llu %7llu %3u %-9s %9.4f %10.*f %7.*f %-14s %8.1f %11llu %8.1f\n", b->suite,
           r->test, (unsigned long long)r->ctx, (unsigned long long)r->tokens, r->threads, kv, r->secs,
           rate < 1e6 ? 1 : 0, rate, ratio < 1e3 ? 2 : 0, ratio, vs, bpt, (unsigned long long)bytes,
           rss / 1024.0);
    fflush(stdout);
    if (b->csv) {
        fprintf(b->csv, "%s,", b->suite);
        csv_field(b->csv, b->model_name);
        fprintf(b->csv, "%s,%llu,%llu,%u,%.6f,%.3f,%.4f,%s,%.3f,%llu,%llu,%s,%s\n",
                r->test, (unsigned long long)r->ctx, (unsigned long long)r->tokens,
                r->threads, r->secs, rate, ratio, r->base_rate > 0 ? r->vs : "",
                bpt, (unsigned long long)bytes, (unsigned long long)rss, tk, tv);
        fflush(b->csv);
    }
}

static bool on_progress(void *user, size_t done, size_t total)
{
    struct prog *p = user;
    double t = now(), el = t - p->t0;
    /* short prefills stay quiet; a log file gets a line every 10 s */
    if (done < total && (el < 2.0 || (p->shown && t - p->last < (p->tty ? 0.5 : 10.0)))) return true;
    if (done == total && !p->shown) return true;
    if (done == total && p->tty) { fputs("\r\033[K", stderr); return true; } /* leave the table clean */
    fprintf(stderr, "%sprefill %s: %zu/%zu tokens, %.0f s, %.0f tok/s%s", p->tty ? "\r" : "",
            p->label, done, total, el, done / el, p->tty ? "\033[K" : "\n");
    p->last = t;
    p->shown = true;
    return true;
}

/* ---- timed jobs ---- */

typedef struct job {
    kvt_session *s, *dst;       /* dst: restore target */
    const int32_t *t;
    size_t from;                /* prefill: tokens kept in the cache, untimed */
    size_t n;                   /* tokens to prefill / the frontier to decode from */
    uint32_t decode;
    uint8_t *snap;              /* the latest snapshot (owned) */
    size_t snap_len;
} job;

typedef int (*job_fn)(bench *b, job *j, double *secs);

/* Run fn until min_s has been spent, and at least 3 times while that costs
 * under 10 min_s (exactly --reps times when given); the fastest run wins. */
static int best_of(bench *b, job_fn fn, job *j, double *best)
{
    double total = 0;
    *best = INFINITY;
    for (int rep = 0; b->reps ? rep < (int)b->reps :
         rep < MAX_REPS && (total < b->min_s || (rep < 3 && total < 10 * b->min_s)); rep++) {
        double dt;
        int rc = fn(b, j, &dt);
        if (rc) return rc;
        total += dt;
        if (dt < *best) *best = dt;
    }
    return KVT_OK;
}

/* Prefill tokens j->from..j->n with the default chunking into a session
 * holding the first j->from (prefilled untimed on the first run only). */
static int run_prefill(bench *b, job *j, double *secs)
{
    int rc = kvt_session_sync(j->s, j->t, j->from, NULL);
    if (rc) return rc;
    b->prog.t0 = now();
    b->prog.shown = false;
    rc = kvt_session_sync(j->s, j->t, j->n, NULL);
    *secs = now() - b->prog.t0;
    return rc;
}

/* The baseline for chunked prefill: the same tokens, decoded one at a time. */
static int run_tbt(bench *b, job *j, double *secs)
{
    int rc = kvt_session_sync(j->s, j->t, 0, NULL);
    double t0 = now();
    for (size_t i = 0; i < j->n && !rc; i++) rc = kvt_session_decode(j->s, j->t[i]);
    *secs = now() - t0;
    return rc;
}

/* Greedy decode of j->decode tokens from the frontier j->n. Going back to the
 * frontier between runs is cheap (truncation, or ds4's checkpoint there). */
static int run_decode(bench *b, job *j, double *secs)
{
    kvt_model_info info;
    kvt_model_info_get(b->m, &info);
    kvt_sampler *greedy = NULL; /* the server's greedy choice (lowest id on ties) */
    int rc = kvt_sampler_new(&greedy, &(kvt_sampler_opts){.temperature = 0, .top_p = 1});
    if (!rc) rc = kvt_session_sync(j->s, j->t, j->n, NULL);
    double t0 = now();
    int32_t best = j->t[0]; /* from frontier 0 the first token is the prompt's first */
    for (uint32_t k = 0; k < j->decode && !rc; k++) {
        if (k || j->n) best = kvt_sampler_sample(greedy, kvt_session_logits(j->s), info.n_vocab);
        rc = kvt_session_decode(j->s, best);
    }
    *secs = now() - t0;
    kvt_sampler_free(greedy);
    return rc;
}

static int run_snapshot(bench *b, job *j, double *secs)
{
    free(j->snap);
    j->snap = NULL;
    double t0 = now();
    int rc = kvt_session_snapshot(j->s, &j->snap, &j->snap_len);
    *secs = now() - t0;
    return rc;
}

static int run_restore(bench *b, job *j, double *secs)
{
    double t0 = now();
    int rc = kvt_session_restore(j->dst, j->snap, j->snap_len);
    *secs = now() - t0;
    return rc;
}

/* ---- suites ---- */

/* BOS, then ids cycling through the vocabulary (skipping BOS and EOS):
 * deterministic, and touches every embedding row. Malloc'ed. */
static int32_t *make_tokens(const kvt_model *m, size_t n)
{
    kvt_model_info i;
    kvt_model_info_get(m, &i);
    int32_t *t = malloc((n ? n : 1) * sizeof *t);
    if (!t) { fprintf(stderr, "kvtier: out of memory for %zu prompt tokens\n", n); return NULL; }
    size_t k = 0;
    uint32_t id = 0;
    if (i.bos >= 0 && n) t[k++] = i.bos;
    while (k < n) {
        if (i.n_vocab < 3 || ((int32_t)id != i.bos && (int32_t)id != i.eos)) t[k++] = (int32_t)id;
        id = (id + 1) % i.n_vocab;
    }
    return t;
}

/* Each suite body returns KVT_OK or an error code with *what naming the step
 * (NULL when it has printed its own message). */
typedef int (*suite_fn)(bench *b, kvt_model *m, const char **what);

static int run_suite(bench *b, const char *suite, const char *dflt, suite_fn body)
{
    const char *path = b->model ? b->model : dflt, *what = path;
    kvt_model *m = NULL;
    int rc = kvt_model_open(&m, path);
    if (!rc) rc = kvt_model_set_cache_types(m, b->type_k, b->type_v);
    if (!rc) {
        kvt_model_info info;
        kvt_model_info_get(m, &info);
        b->suite = suite;
        b->model_name = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
        b->m = m;
        printf("\n%s suite: %s (%s, %llu parameters)\n", suite, path, info.arch,
               (unsigned long long)info.n_params);
        printf("%-8s %-22s %7s %7s %3s %-9s %9s %10s %7s %-14s %8s %11s %8s\n", "suite", "test", "ctx",
               "tokens", "thr", "K/V", "seconds", "tok/s", "ratio", "vs", "B/tok", "bytes", "RSS MiB");
        rc = body(b, m, &what);
    }
    if (rc && what) fprintf(stderr, "kvtier: %s: %s: %s\n", what, kvt_strerror(rc), kvt_errmsg());
    kvt_model_close(m);
    return rc ? 1 : 0;
}

/* The llama-bench form (--prompt, --gen, --depth): a prefill of --prompt
 * tokens on top of --depth cached ones, and a greedy decode of --gen tokens
 * from frontier --depth, each its own baseline row, on --threads only. */
static int llama_peer_body(bench *b, kvt_model *m, const char **what)
{
    size_t d = b->depth, n = d + (b->prompt > b->gen ? b->prompt : b->gen);
    int32_t *t = make_tokens(m, n);
    if (!t) return KVT_ENOMEM;
    kvt_session_opts so = {.n_ctx = (uint32_t)n, .n_threads = b->threads, .chunk = PEER_CHUNK};
    job j = {.t = t};
    double secs;
    int rc;
    *what = "session";
    if ((rc = kvt_session_new(&j.s, m, &so))) goto out;
    *what = "prefill";
    if (b->prompt) {
        j.from = d;
        j.n = d + b->prompt;
        if ((rc = best_of(b, run_prefill, &j, &secs))) goto out;
        emit(b, &(row){"prefill chunk 512", j.n, b->prompt, b->all, secs, 0, NULL});
    }
    *what = "decode";
    if (b->gen) {
        j.n = d;
        j.decode = b->gen;
        if ((rc = best_of(b, run_decode, &j, &secs))) goto out;
        emit(b, &(row){"decode greedy", d, b->gen, b->all, secs, 0, NULL});
    }
out:
    kvt_session_free(j.s);
    free(t);
    return rc;
}

static int llama_body(bench *b, kvt_model *m, const char **what)
{
    if (b->peer) return llama_peer_body(b, m, what);
    size_t n = LLAMA_PROMPT;
    int32_t *t = make_tokens(m, n);
    if (!t) return KVT_ENOMEM;
    kvt_session *s = NULL;
    kvt_session_opts so = {.n_ctx = (uint32_t)(n + b->decode), .n_threads = b->threads,
                           .chunk = LLAMA_CHUNK};
    job j = {.t = t, .n = n, .decode = b->decode};
    double tbt, chunked, one, all;
    int rc;
    *what = "session";
    if ((rc = kvt_session_new(&s, m, &so))) goto out;
    j.s = s;
    /* chunked vs token-by-token, both on all threads */
    *what = "prefill";
    if ((rc = best_of(b, run_tbt, &j, &tbt)) || (rc = best_of(b, run_prefill, &j, &chunked))) goto out;
    emit(b, &(row){"prefill token-by-token", n, n, b->all, tbt, 0, NULL});
    emit(b, &(row){"prefill chunk 256", n, n, b->all, chunked, n / tbt, "token-by-token"});
    /* all threads vs 1, chunked; each pair measured back to back */
    kvt_session_set_threads(s, 1);
    if ((rc = best_of(b, run_prefill, &j, &one))) goto out;
    kvt_session_set_threads(s, b->threads);
    if ((rc = best_of(b, run_prefill, &j, &all))) goto out;
    emit(b, &(row){"prefill chunk 256", n, n, 1, one, 0, NULL});
    emit(b, &(row){"prefill chunk 256", n, n, b->all, all, n / one, "1 thread"});
    /* greedy decode at frontier n, all threads vs 1 */
    *what = "decode";
    kvt_session_set_threads(s, 1);
    if ((rc = best_of(b, run_decode, &j, &one))) goto out;
    kvt_session_set_threads(s, b->threads);
    if ((rc = best_of(b, run_decode, &j, &all))) goto out;
    emit(b, &(row){"decode greedy", n, b->decode, 1, one, 0, NULL});
    emit(b, &(row){"decode greedy", n, b->decode, b->all, all, b->decode / one, "1 thread"});
out:
    kvt_session_free(s);
    free(t);
    return rc;
}

/* One fresh session per context, so the peak RSS column shows what each
 * context costs on top of the ones before. */
static int ds4_body(bench *b, kvt_model *m, const char **what)
{
    uint64_t max = 0;
    for (size_t i = 0; i < b->n_ctx; i++) max = b->ctx[i] > max ? b->ctx[i] : max;
    int32_t *t = make_tokens(m, max);
    if (!t) return KVT_ENOMEM;
    double base_prefill = 0, base_decode = 0;
    char vs[32];
    snprintf(vs, sizeof vs, "ctx %llu", (unsigned long long)b->ctx[0]);
    int rc = KVT_OK;
    for (size_t i = 0; i < b->n_ctx && !rc; i++) {
        uint64_t c = b->ctx[i];
        kvt_session *s = NULL;
        kvt_session_opts so = {.n_ctx = (uint32_t)(c + b->decode), .n_threads = b->threads,
                               .progress = on_progress, .progress_user = &b->prog};
        snprintf(b->prog.label, sizeof b->prog.label, "%s ctx %llu", b->model_name, (unsigned long long)c);
        job j = {.t = t, .n = c, .decode = b->decode};
        double pre, dec;
        *what = "session";
        if (!(rc = kvt_session_new(&s, m, &so))) {
            j.s = s;
            *what = "prefill";
            if (!(rc = best_of(b, run_prefill, &j, &pre)))
                emit(b, &(row){"prefill", c, c, b->all, pre, i ? base_prefill : 0, vs});
        }
        if (!rc) {
            *what = "decode";
            if (!(rc = best_of(b, run_decode, &j, &dec)))
                emit(b, &(row){"decode greedy", c, b->decode, b->all, dec, i ? base_decode : 0, vs});
        }
        if (!rc && !i) { base_prefill = c / pre; base_decode = b->decode / dec; }
        kvt_session_free(s);
    }
    free(t);
    return rc;
}

static int snapshot_body(bench *b, kvt_model *m, const char **what)
{
    size_t n = SNAP_TOKENS;
    int32_t *t = make_tokens(m, n);
    if (!t) return KVT_ENOMEM;
    kvt_model_info info;
    kvt_model_info_get(m, &info);
    kvt_session_opts so = {.n_ctx = (uint32_t)n, .n_threads = b->threads,
                           .progress = on_progress, .progress_user = &b->prog};
    snprintf(b->prog.label, sizeof b->prog.label, "%s ctx %zu", b->model_name, n);
    job j = {.t = t, .n = n};
    double pre, snap, restore;
    int rc;
    *what = "session";
    if ((rc = kvt_session_new(&j.s, m, &so)) || (rc = kvt_session_new(&j.dst, m, &so))) goto out;
    *what = "prefill";
    if ((rc = best_of(b, run_prefill, &j, &pre))) goto out;
    *what = "snapshot";
    if ((rc = best_of(b, run_snapshot, &j, &snap))) goto out;
    *what = "restore";
    if ((rc = best_of(b, run_restore, &j, &restore))) goto out;
    /* A restore that is fast but wrong would be no result: check it. */
    if (kvt_session_len(j.dst) != n ||
        memcmp(kvt_session_logits(j.dst), kvt_session_logits(j.s), info.n_vocab * sizeof(float))) {
        fprintf(stderr, "kvtier: the restored session differs from the snapshotted one\n");
        *what = NULL;
        rc = KVT_EMISMATCH;
        goto out;
    }
    emit(b, &(row){"re-prefill", n, n, b->all, pre, 0, NULL});
    emit(b, &(row){"snapshot", n, n, b->all, snap, n / pre, "re-prefill", j.snap_len});
    emit(b, &(row){"restore", n, n, b->all, restore, n / pre, "re-prefill", j.snap_len});
out:
    free(j.snap);
    kvt_session_free(j.dst);
    kvt_session_free(j.s);
    free(t);
    return rc;
}

/* ---- arguments ---- */

static void usage(FILE *f)
{
    fputs("usage: kvtier bench [--model M] [--suite llama|ds4|snapshot|store|fork|all] [--threads N]\n"
          "                    [--ctx-list 2048,32768,131072] [--decode-tokens N] [--csv FILE] [--quick]\n"
          "                    [--prompt N] [--gen N] [--depth N] [--reps N]\n"
          "                    [--cache-type-k|-ctk T] [--cache-type-v|-ctv T]\n"
          "\n"
          "  llama     prefill of 512 tokens: chunk 256 vs token-by-token, all threads vs 1;\n"
          "            greedy decode at 512: all threads vs 1 (default " LLAMA_MODEL ")\n"
          "            with --prompt/--gen/--depth, as llama-bench -p/-n/-d: a prefill of\n"
          "            --prompt tokens after --depth cached ones (prefilled untimed) in chunks\n"
          "            of 512 (llama-bench's -ub), a decode of --gen tokens from frontier\n"
          "            --depth; --threads only (0: no such row)\n"
          "  ds4       prefill and decode at each context of --ctx-list, relative to the first;\n"
          "            KV cache bytes and peak RSS (default " KVT_DEFAULT_MODEL ")\n"
          "  snapshot  snapshot and restore of 8192 tokens vs re-prefilling them\n"
          "  store     the disk tier: persist and load a long prefix, lookup, nesting\n"
          "            (its own table; --csv appends; not included in all); with --model,\n"
          "            persist and load alone, on that model and its cache types, over the\n"
          "            first --ctx-list entry's tokens (default 20000)\n"
          "  fork      a copy of a session of the first --ctx-list entry's tokens (default\n"
          "            20000; its rows filled, not computed): the time of a copy (--reps,\n"
          "            default 5) and resident memory with 1, 2, 4, 8 and 16 copies (not in all)\n"
          "  all       llama, ds4 and snapshot (default)\n"
          "\n"
          "--model replaces the default model of every selected suite. --quick measures\n"
          "for less time and uses --ctx-list 2048,8192 unless one is given. --reps N runs\n"
          "each measurement exactly N times (default: for 2 s, at least 3 times); the\n"
          "fastest is reported. --cache-type-k and --cache-type-v (f32, f16, bf16, q8_0;\n"
          "default f16) are the K and V rows' types, as for run; the K/V column and the\n"
          "CSV's type_k and type_v say what the rows were (ds4 keeps its own f16).\n", f);
}

static bool parse_u64(const char *s, const char *what, uint64_t lo, uint64_t hi, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-' || s[0] == '+' || s[0] == ' ' || v < lo || v > hi) {
        fprintf(stderr, "kvtier: %s must be an integer in [%llu, %llu], got '%s'\n", what,
                (unsigned long long)lo, (unsigned long long)hi, s);
        return false;
    }
    *out = v;
    return true;
}

static bool parse_ctx_list(bench *b, const char *s)
{
    char buf[512];
    if (strlen(s) >= sizeof buf) { fprintf(stderr, "kvtier: --ctx-list is too long\n"); return false; }
    strcpy(buf, s);
    b->n_ctx = 0;
    for (char *p = buf, *comma;; p = comma + 1) {
        comma = strchr(p, ',');
        if (comma) *comma = 0;
        if (b->n_ctx == MAX_CTX) {
            fprintf(stderr, "kvtier: --ctx-list takes at most %d contexts\n", MAX_CTX);
            return false;
        }
        if (!parse_u64(p, "each --ctx-list entry", 1, 1u << 23, &b->ctx[b->n_ctx++])) return false;
        if (!comma) return true;
    }
}

int kvt_bench_main(int argc, char **argv)
{
    bench b = {.decode = 32, .prog.tty = isatty(2)};
    const char *suite = "all", *csv = NULL, *ctx_list = NULL;
    bool quick = false;
    uint64_t v;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        if (!strcmp(a, "--quick")) { quick = true; continue; }
        if (!strcmp(a, "-ctk")) a = "--cache-type-k";
        if (!strcmp(a, "-ctv")) a = "--cache-type-v";
        if (strcmp(a, "--model") && strcmp(a, "--suite") && strcmp(a, "--threads") &&
            strcmp(a, "--ctx-list") && strcmp(a, "--decode-tokens") && strcmp(a, "--csv") &&
            strcmp(a, "--prompt") && strcmp(a, "--gen") && strcmp(a, "--depth") && strcmp(a, "--reps") &&
            strcmp(a, "--cache-type-k") && strcmp(a, "--cache-type-v")) {
            fprintf(stderr, "kvtier: unknown argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
        if (i + 1 >= argc) { fprintf(stderr, "kvtier: %s needs a value\n", a); return 2; }
        const char *val = argv[++i];
        if (!strcmp(a, "--model")) b.model = val;
        else if (!strcmp(a, "--suite")) suite = val;
        else if (!strcmp(a, "--csv")) csv = val;
        else if (!strcmp(a, "--ctx-list")) ctx_list = val;
        else if (!strncmp(a, "--cache-type-", 13)) {
            if (kvt_row_type_parse(val, a[13] == 'k' ? &b.type_k : &b.type_v)) {
                fprintf(stderr, "kvtier: %s\n", kvt_errmsg());
                return 2;
            }
        }
        else if (!strcmp(a, "--threads")) {
            if (!parse_u64(val, "--threads", 0, 256, &v)) return 2;
            b.threads = (uint32_t)v;
        } else if (!strcmp(a, "--reps")) {
            if (!parse_u64(val, "--reps", 1, MAX_REPS, &v)) return 2;
            b.reps = (uint32_t)v;
        } else if (strcmp(a, "--decode-tokens")) { /* --prompt, --gen, --depth */
            if (!parse_u64(val, a, 0, 1u << 23, &v)) return 2;
            *(!strcmp(a, "--prompt") ? &b.prompt : !strcmp(a, "--gen") ? &b.gen : &b.depth) = (uint32_t)v;
            b.peer = true;
        } else {
            if (!parse_u64(val, "--decode-tokens", 1, 1u << 20, &v)) return 2;
            b.decode = (uint32_t)v;
        }
    }
    bool all = !strcmp(suite, "all"), store = !strcmp(suite, "store"), fork = !strcmp(suite, "fork");
    if (!all && !store && !fork && strcmp(suite, "llama") && strcmp(suite, "ds4") && strcmp(suite, "snapshot")) {
        fprintf(stderr, "kvtier: --suite must be llama, ds4, snapshot, store, fork or all, got '%s'\n", suite);
        return 2;
    }
    if (!parse_ctx_list(&b, ctx_list ? ctx_list : quick ? "2048,8192" : "2048,32768,131072")) return 2;
    if (b.peer && !b.prompt && !b.gen) {
        fprintf(stderr, "kvtier: --prompt, --gen and --depth need a positive --prompt or --gen\n");
        return 2;
    }
    b.min_s = quick ? 0.5 : 2.0;
    b.all = b.threads ? b.threads : ncpu();
    if (store) { /* the disk tier's own suite and table (bench_store.c); not part of all */
        print_machine(&b);
        return kvt_bench_store(csv, quick, b.model, b.type_k, b.type_v, ctx_list ? (size_t)b.ctx[0] : 0) ? 1 : 0;
    }
    if (fork) { /* its own lines (bench_fork.c); not part of all */
        print_machine(&b);
        return kvt_bench_fork(b.model, b.type_k, b.type_v, ctx_list ? (size_t)b.ctx[0] : 0, b.reps);
    }
    if (csv && !(b.csv = fopen(csv, "w"))) {
        fprintf(stderr, "kvtier: %s: %s\n", csv, strerror(errno));
        return 1;
    }
    if (b.csv)
        fputs("suite,model,test,ctx,tokens,threads,seconds,tokens_per_s,ratio,baseline,"
              "bytes_per_token,bytes,peak_rss_kib,type_k,type_v\n", b.csv);
    print_machine(&b);
    int rc = 0;
    if (all || !strcmp(suite, "llama")) {
        if (!b.model && access(LLAMA_MODEL, R_OK))
            printf("\nllama suite: skipped, %s not found (give --model PATH)\n", LLAMA_MODEL);
        else
            rc = run_suite(&b, "llama", LLAMA_MODEL, llama_body);
    }
    if (!rc && (all || !strcmp(suite, "ds4"))) rc = run_suite(&b, "ds4", KVT_DEFAULT_MODEL, ds4_body);
    if (!rc && (all || !strcmp(suite, "snapshot")))
        rc = run_suite(&b, "snapshot", KVT_DEFAULT_MODEL, snapshot_body);
    if (b.csv && fclose(b.csv) && !rc) {
        fprintf(stderr, "kvtier: %s: %s\n", csv, strerror(errno));
        rc = 1;
    }
    return rc;
}
