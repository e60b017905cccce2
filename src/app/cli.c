/* The kvtier command: one binary, one subcommand per job. Argument parsing is
 * strict (unknown flags and malformed numbers are errors, exit 2); runtime
 * failures print kvt_errmsg() and exit 1. This file is the only place that
 * calls exit(). */
#include "kvtier.h"
#include "store/policy.h"
#include "store/remote.h"
#include "arch/model.h"
#include "session/memory.h"
#include "format/gguf.h"
#include "serve/draft.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "app/bench.h"
#include "app/server.h"

/* ---- argument parsing ---- */

typedef struct opt {
    const char *name;   /* "--model" */
    const char *value;  /* NULL when absent; "" for a switch that is present; the last one given */
    bool is_switch;
    const char *vals[32]; /* every value, for options that may repeat */
    size_t n_vals;
} opt;

static void usage(FILE *f);

/* 0: parsed; -1: bad arguments (reported); 1: --help was printed. */
static int parse_opts(int argc, char **argv, opt *opts, size_t n_opts)
{
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 1;
        }
        /* llama.cpp's short names */
        const char *name = !strcmp(argv[i], "-ctk") ? "--cache-type-k" : !strcmp(argv[i], "-ctv") ? "--cache-type-v"
                                                                                                 : argv[i];
        size_t k = 0;
        for (; k < n_opts; k++) if (!strcmp(name, opts[k].name)) break;
        if (k == n_opts) { fprintf(stderr, "kvtier: unknown argument '%s'\n", argv[i]); return -1; }
        if (opts[k].is_switch) { opts[k].value = ""; continue; }
        if (i + 1 >= argc) { fprintf(stderr, "kvtier: %s needs a value\n", argv[i]); return -1; }
        opts[k].value = argv[++i];
        if (opts[k].n_vals == 32) { fprintf(stderr, "kvtier: %s given too often\n", argv[i - 1]); return -1; }
        opts[k].vals[opts[k].n_vals++] = argv[i];
    }
    return 0;
}

static const char *get(const opt *opts, size_t n, const char *name)
{
    for (size_t k = 0; k < n; k++) if (!strcmp(opts[k].name, name)) return opts[k].value;
    return NULL;
}

static bool parse_u64(const char *s, const char *what, uint64_t max, uint64_t *out)
{
    if (!s) return true;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-' || v > max) {
        fprintf(stderr, "kvtier: %s must be an integer in [0, %llu], got '%s'\n", what,
                (unsigned long long)max, s);
        return false;
    }
    *out = v;
    return true;
}

static bool parse_f(const char *s, const char *what, double lo, double hi, double *out)
{
    if (!s) return true;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) {
        fprintf(stderr, "kvtier: %s must be a number in [%g, %g], got '%s'\n", what, lo, hi, s);
        return false;
    }
    *out = v;
    return true;
}

static int fail(int rc, const char *what)
{
    fprintf(stderr, "kvtier: %s: %s: %s\n", what, kvt_strerror(rc), kvt_errmsg());
    return 1;
}

/* ---- shared pieces ---- */

/* --cache-type-k and --cache-type-v (-ctk, -ctv): the K and V rows' types */
#define CACHE_OPTS {"--cache-type-k"}, {"--cache-type-v"}
#define DRAFT_OPTS {"--draft"}, {"--draft-max"}, {"--model-draft"}

/* --draft ngram|model|mtp|none (mtp: the model's MTP layer), --model-draft
 * FILE (the draft model: --draft model, which it implies; with --draft mtp,
 * ds4.c's separate MTP file for a model without the layer) and --draft-max
 * N. */
static bool parse_draft(const opt *o, size_t no, kvt_draft_kind *kind, uint32_t *max, const char **file)
{
    *kind = KVT_DRAFT_DEFAULT;
    *max = KVT_DRAFT_MAX_DEFAULT;
    const char *d = get(o, no, "--draft");
    *file = get(o, no, "--model-draft");
    if (d && kvt_draft_parse(d, kind)) {
        fprintf(stderr, "kvtier: %s\n", kvt_errmsg());
        return false;
    }
    if (!d && *file) *kind = KVT_DRAFT_MODEL;
    if (*kind == KVT_DRAFT_MODEL && !*file) {
        fprintf(stderr, "kvtier: --draft model needs --model-draft FILE (the draft model)\n");
        return false;
    }
    if (*kind != KVT_DRAFT_MODEL && *kind != KVT_DRAFT_MTP && *file) {
        fprintf(stderr, "kvtier: --model-draft goes with --draft model or mtp, not --draft %s\n", d);
        return false;
    }
    uint64_t m = KVT_DRAFT_MAX_DEFAULT;
    if (!parse_u64(get(o, no, "--draft-max"), "--draft-max", KVT_DRAFT_MAX_LIMIT, &m)) return false;
    if (!m) *kind = KVT_DRAFT_NONE, *file = NULL; /* drafting nothing is no drafting */
    *max = (uint32_t)m;
    return true;
}

static bool parse_cache_types(const opt *o, size_t no, kvt_row_type *k, kvt_row_type *v)
{
    *k = *v = KVT_ROWS_DEFAULT;
    const char *tk = get(o, no, "--cache-type-k"), *tv = get(o, no, "--cache-type-v");
    if ((tk && kvt_row_type_parse(tk, k)) || (tv && kvt_row_type_parse(tv, v))) {
        fprintf(stderr, "kvtier: %s\n", kvt_errmsg());
        return false;
    }
    return true;
}

/* ds4.c's separate MTP file of o (--draft mtp --model-draft FILE), which
 * is mapped with the model; NULL: none. */
static const char *mtp_file(const opt *o, size_t no)
{
    const char *d = get(o, no, "--draft");
    return d && !strcmp(d, "mtp") ? get(o, no, "--model-draft") : NULL;
}

/* A GGUF path or a preset name (NULL is the built-in default model), its
 * cache types from o (NULL: the defaults). */
static int open_model(const char *path, const opt *o, size_t no, kvt_model **m)
{
    kvt_row_type tk = KVT_ROWS_DEFAULT, tv = KVT_ROWS_DEFAULT;
    if (o && !parse_cache_types(o, no, &tk, &tv)) return 2;
    char note[256];
    if (kvt_model_memory_note(path, mtp_file(o, no), note, sizeof note))
        fprintf(stderr, "kvtier: %s: %s\n", path, note);
    int rc = kvt_model_open(m, path);
    if (!rc) rc = kvt_model_set_cache_types(*m, tk, tv);
    if (rc) {
        kvt_model_close(*m);
        *m = NULL;
        return fail(rc, path ? path : KVT_DEFAULT_MODEL);
    }
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct progress { double t0; bool shown; };

/* A bar on a terminal; elsewhere a line at most every 2 seconds. */
static bool progress_bar(void *user, size_t done, size_t total)
{
    struct progress *p = user;
    if (total < 512) return true;
    if (!isatty(2)) {
        double now = now_s();
        if (p->t0 == 0) p->t0 = now;
        if (now - p->t0 >= 2.0 || (done == total && p->shown)) {
            fprintf(stderr, "kvtier: prefill %zu/%zu tokens\n", done, total);
            p->t0 = now;
            p->shown = true;
        }
        return true;
    }
    int width = 40, fill = (int)(width * done / total);
    fprintf(stderr, "\rprefill [%.*s%*s] %zu/%zu", fill, "########################################",
            width - fill, "", done, total);
    if (done == total) fputc('\n', stderr);
    p->shown = true;
    return true;
}

/* ---- subcommands ---- */

/* ---- the disk tier's flags (run and serve share them) ---- */

#define DISK_OPTS {"--kv-disk-dir"}, {"--no-kv-disk", NULL, true}, {"--kv-disk-mb"}, {"--kv-disk-min-free-mb"}, \
    {"--kv-cache-min-tokens"}, {"--kv-cache-trim-tokens"}, {"--kv-cache-align-tokens"}, \
    {"--kv-cache-continued-interval"}

/* rediss:// (TLS): the CA the server's certificate must chain to, and the
 * client's certificate and key for a server that asks for one; wherever
 * --kv-remote is taken */
#define REMOTE_TLS_OPTS {"--kv-remote-ca"}, {"--kv-remote-cert"}, {"--kv-remote-key"}
#define REMOTE_NEEDS_URL                                                                               \
    "--kv-remote-password-file, --kv-remote-secret-file, --kv-remote-timeout-ms, --kv-remote-prefill-tps, "  \
    "--kv-remote-ca, --kv-remote-cert and --kv-remote-key need --kv-remote"

/* Whether any option that goes with --kv-remote is given. */
static bool remote_opt_given(const opt *o, size_t no)
{
    static const char *const names[] = {"--kv-remote-password-file", "--kv-remote-secret-file",
                                        "--kv-remote-timeout-ms", "--kv-remote-prefill-tps", "--kv-remote-ca",
                                        "--kv-remote-cert", "--kv-remote-key"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (get(o, no, names[i])) return true;
    return false;
}

typedef struct disk_cfg {
    bool on;
    char dir[4096];
    uint64_t budget;
    uint64_t min_free;  /* bytes kept free on the file system; KVT_STORE_MIN_FREE_DEFAULT */
    kvt_save_policy policy;
} disk_cfg;

static void default_dir(char *out, size_t cap)
{
    const char *x = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (x && *x) snprintf(out, cap, "%s/kvtier", x);
    else snprintf(out, cap, "%s/.cache/kvtier", home && *home ? home : ".");
}

static bool parse_disk(const opt *o, size_t no, disk_cfg *d)
{
    kvt_save_policy def = KVT_SAVE_POLICY_DEFAULT;
    d->policy = def;
    d->on = get(o, no, "--no-kv-disk") == NULL;
    const char *dir = get(o, no, "--kv-disk-dir");
    if (dir) snprintf(d->dir, sizeof d->dir, "%s", dir);
    else default_dir(d->dir, sizeof d->dir);
    uint64_t mb = 4096, v[4] = {def.min_tokens, def.trim_tokens, def.align_tokens, def.continued_interval};
    const char *names[4] = {"--kv-cache-min-tokens", "--kv-cache-trim-tokens", "--kv-cache-align-tokens",
                            "--kv-cache-continued-interval"};
    if (!parse_u64(get(o, no, "--kv-disk-mb"), "--kv-disk-mb", 1ull << 30, &mb)) return false;
    for (int i = 0; i < 4; i++)
        if (!parse_u64(get(o, no, names[i]), names[i], 1u << 24, &v[i])) return false;
    if (!v[2]) {
        fprintf(stderr, "kvtier: --kv-cache-align-tokens must be positive\n");
        return false;
    }
    if (v[3] % 128) {
        fprintf(stderr, "kvtier: %s must be a multiple of 128 (the cache block), got %llu\n", names[3],
                (unsigned long long)v[3]);
        return false;
    }
    if (mb == 0) { fprintf(stderr, "kvtier: --kv-disk-mb must be positive\n"); return false; }
    d->budget = mb << 20;
    uint64_t free_mb = UINT64_MAX;
    if (!parse_u64(get(o, no, "--kv-disk-min-free-mb"), "--kv-disk-min-free-mb", 1ull << 30, &free_mb)) return false;
    d->min_free = free_mb == UINT64_MAX ? KVT_STORE_MIN_FREE_DEFAULT : free_mb << 20;
    d->policy = (kvt_save_policy){(uint32_t)v[0], (uint32_t)v[1], (uint32_t)v[2], (uint32_t)v[3]};
    return true;
}

/* The model's fingerprint cache goes in the disk store's directory
 * (DIR/fingerprints; docs/FORMAT.md), which the default resolves the same
 * way; without the disk tier, the default's. */
static int fingerprints_in(kvt_model *m, const disk_cfg *d)
{
    char dir[sizeof d->dir + 16];
    if (!d->on) return KVT_OK;
    snprintf(dir, sizeof dir, "%s/fingerprints", d->dir);
    return kvt_model_set_fingerprint_dir(m, dir);
}

/* Open the store; a store that cannot be opened is reported and skipped. */
static kvt_store *open_disk(const disk_cfg *d)
{
    if (!d->on) return NULL;
    kvt_store *st = NULL;
    int rc = kvt_store_open(&st, d->dir, d->budget);
    if (rc) {
        fprintf(stderr, "kvtier: disk cache disabled: %s: %s\n", kvt_strerror(rc), kvt_errmsg());
        return NULL;
    }
    kvt_store_set_min_free(st, d->min_free);
    return st;
}

/* ---- run --demo: the cache at work ---- */

/* The demonstration's prompt: an agent's system prompt of about 4,200 bytes
 * (as many tokens with the built-in models' byte tokenizer), long enough
 * that the default save policy keeps 4,096 of them on disk. malloc'ed. */
static char *demo_prompt(void)
{
    static const char *const rules[] = {
        "read the files a change touches before editing them",
        "keep each change small and say what it does and why",
        "run the tests near the change, not the whole suite",
        "name every error after what was wrong, with the value",
        "check every size that comes from a file or a request",
        "never leave a process running after the work is done",
        "measure before claiming a speed-up, and give the figure",
        "write the documentation in the same commit as the code",
    };
    size_t cap = 8192, o = 0;
    char *p = malloc(cap);
    if (!p) return NULL;
    o += (size_t)snprintf(p, cap, "System: You are a careful engineer working in a C code base. The rules "
                                  "below are numbered; follow all of them in every answer.\n");
    for (int i = 0; i < 64; i++) o += (size_t)snprintf(p + o, cap - o, "Rule %d: %s.\n", i + 1, rules[i % 8]);
    snprintf(p + o, cap - o, "User: Which of these rules matters most today?\nAssistant:");
    return p;
}

typedef struct demo_pass {
    size_t n;          /* prompt tokens */
    size_t reused;     /* kept in the session (RAM) or restored from the disk cache */
    double ttft;       /* seconds from the start of the pass to its first token */
    int32_t *ids;      /* the reply (malloc'ed) */
    size_t n_ids;
} demo_pass;

/* One answer: bring s to toks[0..n) (first restoring the longest prefix st
 * holds, when st is given), then sample up to max (>= 1) tokens, feeding
 * each back but the last. 0, or 1 after reporting what failed. */
static int demo_answer(kvt_session *s, kvt_store *st, const kvt_model_info *info, const kvt_sampler_opts *so,
                       const int32_t *toks, size_t n, size_t max, const char *what, demo_pass *p)
{
    kvt_sampler *smp = NULL;
    int rc = kvt_sampler_new(&smp, so);
    if (rc) return fail(rc, "sampler");
    p->n = n;
    if (!(p->ids = malloc(max * sizeof *p->ids))) {
        kvt_sampler_free(smp);
        fprintf(stderr, "kvtier: out of memory\n");
        return 1;
    }
    double t0 = now_s();
    if (st) rc = kvt_store_restore_prefix(st, s, toks, n, &p->reused);
    if (!rc) rc = kvt_session_sync(s, toks, n, st ? NULL : &p->reused);
    while (!rc && p->n_ids < max) {
        int32_t t = kvt_sampler_sample(smp, kvt_session_logits(s), info->n_vocab);
        if (!p->n_ids) p->ttft = now_s() - t0;
        if (t < 0) {
            kvt_sampler_free(smp);
            fprintf(stderr, "kvtier: %s: sampling failed\n", what);
            return 1;
        }
        if (t == info->eos || t == info->bos) break;
        p->ids[p->n_ids++] = t;
        if (p->n_ids < max) rc = kvt_session_decode(s, t);
    }
    kvt_sampler_free(smp);
    return rc ? fail(rc, what) : 0;
}

static void demo_row(const char *what, const demo_pass *p, const char *tier, const demo_pass *cold)
{
    printf("%-26s %7zu %7zu  %-4s %9zu  %8.3f s", what, p->n, p->reused, p->reused ? tier : "-", p->n - p->reused,
           p->ttft);
    double x = cold && p->ttft > 0 ? cold->ttft / p->ttft : 0;
    if (x > 0) printf("  %.*fx sooner", x < 10 ? 1 : 0, x);
    putchar('\n');
}

static void demo_reply(const kvt_model *m, const char *what, const demo_pass *p, bool ids)
{
    printf("%s:", what);
    for (size_t i = 0; i < p->n_ids; i++) {
        const char *piece;
        size_t len;
        if (ids) printf(" %d", p->ids[i]);
        else if (kvt_token_piece(m, p->ids[i], &piece, &len) == KVT_OK) {
            if (!i) putchar(' ');
            fwrite(piece, 1, len, stdout);
        }
    }
    putchar('\n');
}

/* `run --demo`: one prompt answered cold, then a second turn on the same
 * session (its prefix from RAM), then the prompt again in a new session
 * (its prefix from the disk cache, which the cold turn saved to), with the
 * tokens each reused and its time to first token; the last reply must equal
 * the first. The replies themselves only with --output. */
static int run_demo(kvt_model *m, const kvt_model_info *info, const char *model_name, const char *prompt,
                    size_t max, const kvt_sampler_opts *so, const kvt_session_opts *sopts, const disk_cfg *disk,
                    const char *output, bool kv_save)
{
    char *own = prompt ? NULL : demo_prompt();
    static const char follow[] = "\nUser: And which one comes next?\nAssistant:";
    int32_t *toks = NULL, *more = NULL, *toks2 = NULL;
    size_t n = 0, n_more = 0, saved = 0;
    kvt_session *s = NULL, *s2 = NULL;
    kvt_store *store = NULL;
    demo_pass cold = {0}, ram = {0}, disk_pass = {0};
    int ret = 1, rc;
    if (!prompt && !(prompt = own)) { fprintf(stderr, "kvtier: out of memory\n"); goto out; }
    if ((rc = kvt_tokenize(m, prompt, strlen(prompt), -1, false, &toks, &n)) ||
        (rc = kvt_tokenize(m, follow, strlen(follow), 0, false, &more, &n_more))) { fail(rc, "tokenize"); goto out; }
    if (n == 0) {
        fprintf(stderr, "kvtier: the prompt is empty and the model adds no BOS: nothing to condition on\n");
        ret = 2;
        goto out;
    }
    printf("kvtier run --demo: %s answers a %zu-token prompt, then a second turn on it, then the prompt again in "
           "a new session\n", model_name, n);
    if (info->tokenizer && !strcmp(info->tokenizer, "bytes"))
        printf("(%s's weights are synthetic, drawn from a seed: its replies are not language; --output text|ids "
               "prints them)\n", model_name);
    printf("\n%-26s %7s %7s  %-4s %9s  %10s\n", "", "prompt", "reused", "from", "prefilled", "first token");
    fflush(stdout);
    /* turn 1: computed whole (not looked up), then saved by the policy */
    if ((rc = kvt_session_new(&s, m, sopts))) { fail(rc, "session"); goto out; }
    kvt_save_policy_mark(&disk->policy, s, n); /* a checkpoint where the policy saves */
    if (demo_answer(s, NULL, info, so, toks, n, max, "turn 1", &cold)) goto out;
    demo_row("turn 1, cold", &cold, "", NULL);
    fflush(stdout);
    store = open_disk(disk);
    if ((rc = kvt_store_apply_policy(store, s, &disk->policy, n, 0, 0, &saved))) { fail(rc, "disk cache"); goto out; }
    /* turn 2: the prompt, the reply and a follow-up, on the same session */
    size_t n2 = n + cold.n_ids + n_more;
    if (!(toks2 = malloc(n2 * sizeof *toks2))) { fprintf(stderr, "kvtier: out of memory\n"); goto out; }
    memcpy(toks2, toks, n * sizeof *toks);
    memcpy(toks2 + n, cold.ids, cold.n_ids * sizeof *toks);
    memcpy(toks2 + n + cold.n_ids, more, n_more * sizeof *toks);
    if (demo_answer(s, NULL, info, so, toks2, n2, max, "turn 2", &ram)) goto out;
    demo_row("turn 2, same session", &ram, "RAM", &cold);
    if (kv_save && store && (rc = kvt_store_save(store, s, kvt_session_len(s), "manual", NULL)))
        fprintf(stderr, "kvtier: manual save failed: %s\n", kvt_errmsg());
    /* turn 1 again in a new session, as a new process would run it */
    bool same = true;
    if (store) {
        if ((rc = kvt_session_new(&s2, m, sopts))) { fail(rc, "session"); goto out; }
        if (demo_answer(s2, store, info, so, toks, n, max, "new session", &disk_pass)) goto out;
        demo_row("turn 1 in a new session", &disk_pass, "disk", &cold);
        same = disk_pass.n_ids == cold.n_ids && !memcmp(disk_pass.ids, cold.ids, cold.n_ids * sizeof *cold.ids);
        /* the directory with the home directory as ~ */
        const char *home = getenv("HOME"), *dir = disk->dir;
        size_t hl = home ? strlen(home) : 0;
        bool tilde = hl > 1 && !strncmp(dir, home, hl) && dir[hl] == '/';
        printf("\ndisk cache %s%s: turn 1 saved %zu new snapshot%s (--no-kv-disk leaves the disk out)\n",
               tilde ? "~" : "", tilde ? dir + hl : dir, saved, saved == 1 ? "" : "s");
        printf("the new session's reply %s turn 1's, token for token (%zu tokens)\n",
               same ? "equals" : "DIFFERS FROM", cold.n_ids);
    } else
        printf("\nthe disk cache is off: no new session from disk\n");
    if (output) {
        bool ids = !strcmp(output, "ids");
        putchar('\n');
        demo_reply(m, "turn 1 reply", &cold, ids);
        demo_reply(m, "turn 2 reply", &ram, ids);
        if (store) demo_reply(m, "new session reply", &disk_pass, ids);
    }
    if (!same) { fprintf(stderr, "kvtier: the reply restored from disk differs from the cold one\n"); goto out; }
    ret = 0;
out:
    free(cold.ids);
    free(ram.ids);
    free(disk_pass.ids);
    free(toks);
    free(toks2);
    free(more);
    free(own);
    kvt_store_close(store);
    kvt_session_free(s);
    kvt_session_free(s2);
    return ret;
}

static int cmd_run(int argc, char **argv)
{
    opt o[] = {{"--model"}, {"--prompt"}, {"--max-tokens"}, {"--temperature"}, {"--seed"},
               {"--top-p"}, {"--top-k"}, {"--output"}, {"--threads"}, {"--ctx"},
               {"--rolling", NULL, true}, {"--kv-save", NULL, true}, {"--demo", NULL, true}, DISK_OPTS, CACHE_OPTS,
               DRAFT_OPTS, {"--kv-remote"}, {"--kv-remote-password-file"}, {"--kv-remote-secret-file"},
               {"--kv-remote-timeout-ms"}, {"--kv-remote-prefill-tps"}, REMOTE_TLS_OPTS};
    size_t no = sizeof o / sizeof o[0];
    { int pr_ = parse_opts(argc, argv, o, no); if (pr_) return pr_ < 0 ? 2 : 0; }
    disk_cfg disk;
    if (!parse_disk(o, no, &disk)) return 2;
    uint64_t max_tokens = 256, seed = 0, top_k = 0, threads = 0, ctx = 0;
    double temp = 0, top_p = 1;
    if (!parse_u64(get(o, no, "--max-tokens"), "--max-tokens", 1u << 24, &max_tokens) ||
        !parse_u64(get(o, no, "--seed"), "--seed", UINT64_MAX, &seed) ||
        !parse_u64(get(o, no, "--top-k"), "--top-k", 1u << 24, &top_k) ||
        !parse_u64(get(o, no, "--threads"), "--threads", 256, &threads) ||
        !parse_u64(get(o, no, "--ctx"), "--ctx", 1u << 24, &ctx) ||
        !parse_f(get(o, no, "--temperature"), "--temperature", 0, 100, &temp) ||
        !parse_f(get(o, no, "--top-p"), "--top-p", 0, 1, &top_p))
        return 2;
    const char *output = get(o, no, "--output");
    if (output && strcmp(output, "text") && strcmp(output, "ids")) {
        fprintf(stderr, "kvtier: --output must be text or ids\n");
        return 2;
    }
    bool ids_out = output && !strcmp(output, "ids");
    kvt_draft_kind draft;
    uint32_t draft_max;
    const char *draft_file;
    if (!parse_draft(o, no, &draft, &draft_max, &draft_file)) return 2;
    uint64_t remote_ms = 0, remote_tps = 0;
    const char *remote_url = get(o, no, "--kv-remote");
    if (!parse_u64(get(o, no, "--kv-remote-timeout-ms"), "--kv-remote-timeout-ms", 60000, &remote_ms) ||
        !parse_u64(get(o, no, "--kv-remote-prefill-tps"), "--kv-remote-prefill-tps", 1u << 30, &remote_tps))
        return 2;
    if (!remote_url && remote_opt_given(o, no)) {
        fprintf(stderr, "kvtier: %s\n", REMOTE_NEEDS_URL);
        return 2;
    }
    if (remote_url && (!disk.on || get(o, no, "--demo"))) {
        fprintf(stderr, "kvtier: --kv-remote needs the disk tier (a remote hit is kept there), and not --demo\n");
        return 2;
    }
    if (get(o, no, "--demo") && !get(o, no, "--max-tokens")) max_tokens = 32;
    if (get(o, no, "--demo") && !max_tokens) {
        fprintf(stderr, "kvtier: --demo needs --max-tokens of at least 1\n");
        return 2;
    }
    const char *prompt = get(o, no, "--prompt");
    if (!prompt) prompt = "";
    kvt_model *m = NULL;
    int r = open_model(get(o, no, "--model"), o, no, &m);
    if (r) return r;
    if ((r = fingerprints_in(m, &disk))) { kvt_model_close(m); return fail(r, "model"); }
    kvt_model_info info;
    kvt_model_info_get(m, &info);
    if (draft == KVT_DRAFT_AUTO) draft = kvt_draft_auto(m, NULL);
    if (get(o, no, "--demo")) {
        const char *mname = get(o, no, "--model") ? get(o, no, "--model") : KVT_DEFAULT_MODEL;
        kvt_session_opts dso = {.n_ctx = (uint32_t)ctx, .n_threads = (uint32_t)threads,
                                .rolling = get(o, no, "--rolling") != NULL,
                                .checkpoint_interval = kvt_save_policy_grid(&disk.policy)};
        kvt_sampler_opts dsp = {.temperature = (float)temp, .top_p = (float)top_p, .top_k = (uint32_t)top_k,
                                .seed = seed};
        int dr = run_demo(m, &info, mname, get(o, no, "--prompt"), max_tokens, &dsp, &dso, &disk, output,
                          get(o, no, "--kv-save") != NULL);
        kvt_model_close(m);
        return dr;
    }
    int32_t *toks = NULL;
    size_t n = 0;
    kvt_session *s = NULL;
    kvt_sampler *smp = NULL;
    kvt_store *store = NULL;
    kvt_remote *remote = NULL;
    int32_t *gen = NULL;
    float *rows = NULL;
    kvt_wbuf save = {0};
    kvt_model *dmodel = NULL;
    kvt_draft_model *dm = NULL;
    kvt_draft_mtp *mtp = NULL;
    int ret = 1, rc;
    if ((rc = kvt_tokenize(m, prompt, strlen(prompt), -1, false, &toks, &n))) { fail(rc, "tokenize"); goto out; }
    if (n == 0) {
        fprintf(stderr, "kvtier: the prompt is empty and the model adds no BOS: nothing to condition on\n");
        ret = 2;
        goto out;
    }
    struct progress pr = {0};
    kvt_session_opts so = {.n_ctx = (uint32_t)ctx, .n_threads = (uint32_t)threads,
                           .rolling = get(o, no, "--rolling") != NULL,
                           .checkpoint_interval = kvt_save_policy_grid(&disk.policy),
                           .progress = progress_bar, .progress_user = &pr};
    /* ds4.c's separate MTP file: before the session, whose scratch fits every matrix */
    if (draft == KVT_DRAFT_MTP && draft_file && (rc = kvt_draft_mtp_attach(m, draft_file))) {
        fail(rc, "run");
        ret = 2;
        goto out;
    }
    /* the layer's check, and (Qwen 3.5) its rows kept by the session: before it */
    if (draft == KVT_DRAFT_MTP && (rc = kvt_draft_mtp_check(m, get(o, no, "--model") ? get(o, no, "--model") : info.name))) {
        fail(rc, "run");
        ret = 2;
        goto out;
    }
    if (draft == KVT_DRAFT_MTP && (rc = kvt_draft_mtp_prepare(m))) { fail(rc, "--draft mtp"); goto out; }
    if ((rc = kvt_session_new(&s, m, &so))) { fail(rc, "session"); goto out; }
    if (draft == KVT_DRAFT_MTP && (rc = kvt_draft_mtp_check(m, get(o, no, "--model") ? get(o, no, "--model") : info.name))) {
        fail(rc, "run");
        ret = 2;
        goto out;
    }
    if (draft == KVT_DRAFT_MTP && (rc = kvt_draft_mtp_new(&mtp, s))) { fail(rc, "--draft mtp"); goto out; }
    if (draft == KVT_DRAFT_MODEL) { /* its session on the model's threads: the two never run at once */
        kvt_session_opts dso = {.n_ctx = s->n_ctx, .n_threads = (uint32_t)threads};
        if ((ret = open_model(draft_file, o, no, &dmodel))) goto out;
        ret = 1;
        if ((rc = kvt_draft_vocab_check(m, dmodel))) { fail(rc, draft_file); ret = 2; goto out; }
        if ((rc = kvt_draft_model_new(&dm, m, dmodel, &dso, s->pool))) { fail(rc, draft_file); goto out; }
    }
    kvt_save_policy_mark(&disk.policy, s, n); /* a checkpoint where the policy saves */
    store = open_disk(&disk);
    size_t from_disk = 0, saved = 0, from_remote = 0;
    if (store && (rc = kvt_store_restore_prefix(store, s, toks, n, &from_disk))) { fail(rc, "disk cache"); goto out; }
    /* the remote tier, as serve asks it: after the disk, for a longer
     * prefix; a hit is saved to the disk too */
    if (store && remote_url) {
        kvt_remote_opts ro = {.url = remote_url, .password_file = get(o, no, "--kv-remote-password-file"),
                              .secret_file = get(o, no, "--kv-remote-secret-file"), .lookup_ms = (int)remote_ms,
                              .prefill_tps = (double)remote_tps, .tls_ca = get(o, no, "--kv-remote-ca"),
                              .tls_cert = get(o, no, "--kv-remote-cert"), .tls_key = get(o, no, "--kv-remote-key")};
        if ((rc = kvt_remote_open(&remote, m, &ro))) { fail(rc, "--kv-remote"); goto out; }
        if (n >= disk.policy.min_tokens) kvt_remote_restore(remote, 0, s, toks, n, from_disk, &from_remote);
        if (from_remote) {
            from_disk = from_remote;
            if ((rc = kvt_store_save(store, s, from_remote, "remote", NULL)))
                fprintf(stderr, "kvtier: the remote hit was not saved to the disk cache: %s\n", kvt_errmsg());
        } else if (kvt_session_len(s) < from_disk) {
            from_disk = 0; /* a remote value failed while loading and emptied the session: prefilled whole */
        }
    }
    double t0 = now_s();
    size_t kept = 0; /* below from_disk when the record went on past the prompt: its last token again */
    if ((rc = kvt_session_sync(s, toks, n, &kept))) { fail(rc, "prefill"); goto out; }
    /* the draft model's prefill with the model's (a failure: no drafts, as in a pass) */
    if (dm && (rc = kvt_draft_model_follow(dm, toks, n)))
        fprintf(stderr, "kvtier: the draft model's prefill failed: %s\n", kvt_errmsg());
    double t_prefill = now_s() - t0;
    if ((rc = kvt_store_apply_policy(store, s, &disk.policy, n, from_disk, 0, &saved))) { fail(rc, "disk cache"); goto out; }
    if (kept > from_disk) kept = from_disk;
    if (remote) { /* what the policy saved, uploaded behind (a remote hit is not sent back) */
        kvt_remote_note_prefill(remote, kept, n, t_prefill);
        size_t cold = kvt_save_policy_cold(&disk.policy, n);
        if (saved && cold >= disk.policy.min_tokens && cold > from_remote) kvt_remote_upload(remote, 0, s, cold);
    }
    if (store)
        fprintf(stderr, "kvtier: prompt %zu tokens: %zu from the %s cache, %zu prefilled in %.2f s; %zu saved\n", n,
                kept, from_remote ? "remote" : "disk", n - kept, t_prefill, saved);
    kvt_sampler_opts sopt = {.temperature = (float)temp, .top_p = (float)top_p,
                             .top_k = (uint32_t)top_k, .seed = seed};
    if ((rc = kvt_sampler_new(&smp, &sopt))) { fail(rc, "sampler"); goto out; }
    gen = malloc((max_tokens ? max_tokens : 1) * sizeof *gen);
    if (!gen) { fprintf(stderr, "kvtier: out of memory\n"); goto out; }
    if (draft && !(rows = malloc((size_t)(1 + draft_max) * info.n_vocab * sizeof *rows))) draft = KVT_DRAFT_NONE;
    size_t ng = 0, passes = 0, drafted = 0, accepted = 0;
    bool first = true;
    kvt_draft_tune tune;
    kvt_draft_tune_init(&tune, draft_max);
    double t_dec = now_s(), t_pass = t_dec;
    int32_t pass[1 + KVT_DRAFT_MAX_LIMIT];
    /* Token ng is sampled with the draw of position ng, from the session's
     * logits or, for a draft, from its row of the verify pass: a draft is
     * kept only when it is that token (and one plain decoding would run:
     * not the last, not EOS), so the reply is the same with or without. */
    while (ng < max_tokens) {
        int32_t t = kvt_sampler_sample_at(smp, kvt_session_logits(s), info.n_vocab, ng);
        if (t < 0) { fprintf(stderr, "kvtier: sampling failed\n"); goto out; }
        size_t keep = 0, done = 1;
        for (pass[0] = t;;) {
            if (t == info.eos || t == info.bos) break;
            gen[ng++] = t;
            keep++;
            if (!ids_out) {
                const char *piece;
                size_t len;
                if (kvt_token_piece(m, t, &piece, &len) == KVT_OK) {
                    /* A SentencePiece continuation right after BOS carries the dummy-prefix space. */
                    if (first && n == 1 && len && piece[0] == ' ') { piece++; len--; }
                    fwrite(piece, 1, len, stdout);
                    fflush(stdout);
                }
            }
            first = false;
            if (keep == 1) { /* the sampled token: draft after it, run them */
                if (ng == max_tokens) break;
                t_pass = now_s();
                size_t pos = kvt_session_len(s), lim = max_tokens - ng - 1; /* the last token is never run */
                size_t want = draft ? kvt_draft_tune_len(&tune) : 0;
                if (lim > want) lim = want;
                if (pos + 1 + lim > s->n_ctx) lim = s->n_ctx > pos + 1 ? s->n_ctx - pos - 1 : 0;
                /* the MTP layer every pass: it takes the model's hidden states */
                size_t d = !draft  ? 0
                           : mtp   ? kvt_draft_mtp_propose(mtp, kvt_session_tokens(s), pos, t, lim, pass + 1)
                           : !lim  ? 0
                           : dm    ? kvt_draft_model_propose(dm, kvt_session_tokens(s), pos, t, lim, pass + 1)
                                   : kvt_draft_ngram(kvt_session_tokens(s), pos, t, lim, pass + 1);
                passes++;
                if (!d) {
                    if ((rc = kvt_session_decode(s, t))) { fail(rc, "decode"); goto out; }
                    if (draft) kvt_draft_tune_after(&tune, 0, 0, now_s() - t_pass);
                    break;
                }
                drafted += d;
                if ((rc = kvt_session_verify(s, pass, 1 + d, rows, &save, &done))) { fail(rc, "decode"); goto out; }
            }
            if (keep == done) break;
            t = kvt_sampler_sample_at(smp, rows + (keep - 1) * info.n_vocab, info.n_vocab, ng);
            if (t < 0) { fprintf(stderr, "kvtier: sampling failed\n"); goto out; }
            if (t != pass[keep] || t == info.eos || t == info.bos) break;
            accepted++;
        }
        if (keep == 0 || ng == max_tokens) break;
        if (done > 1 && (rc = kvt_session_keep(s, kvt_session_len(s) - done, pass, done, keep, rows, &save))) {
            fail(rc, "decode");
            goto out;
        }
        if (done > 1) kvt_draft_tune_after(&tune, done - 1, keep - 1, now_s() - t_pass);
    }
    t_dec = now_s() - t_dec;
    if (get(o, no, "--draft") || draft_file)
        fprintf(stderr, "kvtier: draft %s: %zu tokens in %zu passes, %.1f tok/s; %zu drafted, %zu accepted\n",
                kvt_draft_name(draft), ng, passes, t_dec > 0 ? ng / t_dec : 0.0, drafted, accepted);
    if (ids_out) {
        for (size_t i = 0; i < ng; i++) printf(i ? " %d" : "%d", gen[i]);
    }
    putchar('\n');
    if (store && get(o, no, "--kv-save") && (rc = kvt_store_save(store, s, kvt_session_len(s), "manual", NULL)))
        fprintf(stderr, "kvtier: manual save failed: %s\n", kvt_errmsg());
    else if (remote && get(o, no, "--kv-save")) kvt_remote_upload(remote, 0, s, kvt_session_len(s));
    if (remote) { /* the uploads finish before the process ends (a minute at most) */
        if (!kvt_remote_drain(remote, 60)) fprintf(stderr, "kvtier: remote tier: uploads still queued after 60 s: dropped\n");
        kvt_remote_stats rs;
        kvt_remote_stats_get(remote, &rs);
        fprintf(stderr, "kvtier: remote tier: %llu tokens read (%llu B in %.3f s, at most %llu B held at once), "
                "%llu snapshot%s uploaded (%llu B)%s%s\n",
                (unsigned long long)rs.hit_tokens, (unsigned long long)rs.bytes_read, rs.load_seconds,
                (unsigned long long)rs.load_peak_bytes, (unsigned long long)rs.uploads,
                rs.uploads == 1 ? "" : "s", (unsigned long long)rs.bytes_written, rs.last_error[0] ? "; last error: " : "",
                rs.last_error);
    }
    ret = 0;
out:
    free(gen);
    free(rows);
    kvt_wbuf_free(&save);
    kvt_draft_model_free(dm);
    kvt_draft_mtp_free(mtp);
    kvt_model_close(dmodel);
    free(toks);
    kvt_remote_close(remote);
    kvt_store_close(store);
    kvt_sampler_free(smp);
    kvt_session_free(s);
    kvt_model_close(m);
    return ret;
}

/* tokenize and detokenize need only the tokenizer, so a vocabulary GGUF
 * (no tensors) is enough and a model file's weights are never read. */
static int open_vocab(const char *path, kvt_model **m)
{
    int rc = kvt_model_open_vocab(m, path);
    if (rc) return fail(rc, path ? path : KVT_DEFAULT_MODEL);
    return 0;
}

static int cmd_tokenize(int argc, char **argv)
{
    opt o[] = {{"--model"}, {"--text"}, {"--no-bos", NULL, true}, {"--special", NULL, true}};
    size_t no = sizeof o / sizeof o[0];
    { int pr_ = parse_opts(argc, argv, o, no); if (pr_) return pr_ < 0 ? 2 : 0; }
    const char *text = get(o, no, "--text");
    if (!text) { fprintf(stderr, "kvtier: --text is required\n"); return 2; }
    kvt_model *m = NULL;
    int r = open_vocab(get(o, no, "--model"), &m);
    if (r) return r;
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = kvt_tokenize(m, text, strlen(text), get(o, no, "--no-bos") ? 0 : -1,
                          get(o, no, "--special") != NULL, &ids, &n);
    if (rc) { kvt_model_close(m); return fail(rc, "tokenize"); }
    for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
    putchar('\n');
    free(ids);
    kvt_model_close(m);
    return 0;
}

/* Ids separated by spaces or commas, each in [0, 2^31). */
static bool parse_ids(const char *s, int32_t **out, size_t *n)
{
    size_t cap = strlen(s) / 2 + 1, k = 0;
    int32_t *v = malloc(cap * sizeof *v);
    if (!v) { fprintf(stderr, "kvtier: out of memory\n"); return false; }
    for (const char *p = s;;) {
        while (*p == ' ' || *p == ',' || *p == '\t' || *p == '\n') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long long x = strtoll(p, &end, 10);
        if (errno || end == p || x < 0 || x > INT32_MAX || (*end && !strchr(" ,\t\n", *end))) {
            int w = (int)strcspn(p, " ,\t\n");
            fprintf(stderr, "kvtier: --ids must be token ids (integers in [0, %d]), got '%.*s'\n",
                    INT32_MAX, w > 64 ? 64 : w, p);
            free(v);
            return false;
        }
        v[k++] = (int32_t)x; /* k < cap: every id takes a digit and a separator but the last */
        p = end;
    }
    *out = v;
    *n = k;
    return true;
}

/* The text of ids, written as its exact bytes (no newline is added). */
static int cmd_detokenize(int argc, char **argv)
{
    opt o[] = {{"--model"}, {"--ids"}};
    size_t no = sizeof o / sizeof o[0];
    { int pr_ = parse_opts(argc, argv, o, no); if (pr_) return pr_ < 0 ? 2 : 0; }
    const char *list = get(o, no, "--ids");
    if (!list) { fprintf(stderr, "kvtier: --ids is required\n"); return 2; }
    int32_t *ids = NULL;
    size_t n = 0;
    if (!parse_ids(list, &ids, &n)) return 2;
    kvt_model *m = NULL;
    int r = open_vocab(get(o, no, "--model"), &m);
    if (r) { free(ids); return r; }
    char *text = NULL;
    size_t len = 0;
    int rc = kvt_detokenize(m, ids, n, &text, &len);
    free(ids);
    kvt_model_close(m);
    if (rc) return fail(rc, "detokenize");
    bool ok = fwrite(text, 1, len, stdout) == len && fflush(stdout) == 0;
    free(text);
    if (!ok) { fprintf(stderr, "kvtier: detokenize: cannot write the text: %s\n", strerror(errno)); return 1; }
    return 0;
}

/* What a run at the context asked needs in memory (kvt_model_memory). */
static void print_memory(const kvt_memory *mm)
{
    char note[256];
    char line[1024];
    size_t at = 0;
    for (uint32_t t = 0; t < KVT_MEMORY_TYPES; t++)
        if (mm->mapped_type[t] && at < sizeof line)
            at += (size_t)snprintf(line + at, sizeof line - at, "%s%s %llu", at ? ", " : "", kvt_ggml_type_name(t),
                                   (unsigned long long)mm->mapped_type[t]);
    if (!mm->n_tensors)
        printf("mapped        none (a preset: its weights are made in memory)\n");
    else if (!mm->mapped_mtp)
        printf("mapped        %llu B (%.2f GiB, read-only from the file; %llu tensors: %s)\n",
           (unsigned long long)mm->mapped, mm->mapped / 1073741824.0, (unsigned long long)mm->n_tensors, line);
    else
        printf("mapped        %llu B (%.2f GiB, read-only; %llu B of it from the MTP file; %llu tensors: %s)\n",
               (unsigned long long)mm->mapped, mm->mapped / 1073741824.0,
               (unsigned long long)mm->mapped_mtp, (unsigned long long)mm->n_tensors, line);
    at = 0;
    line[0] = 0;
    for (size_t i = 0; i < mm->kv.n_parts && at < sizeof line; i++)
        at += (size_t)snprintf(line + at, sizeof line - at, "%s%s %llu", i ? ", " : "", mm->kv.part[i].name,
                               (unsigned long long)mm->kv.part[i].bytes);
    printf("kv cache      %llu B at %llu tokens (%s)\n", (unsigned long long)mm->kv.total,
           (unsigned long long)mm->ctx, line);
    if (mm->scratch_known)
        printf("scratch       %llu B (one session's, %s)\n", (unsigned long long)mm->scratch,
               mm->scratch_measured ? "measured" : "sized from the header");
    else
        printf("scratch       not known from the header alone (run sizes it from the weights)\n");
    printf("session       %llu B (token ids and logits)\n", (unsigned long long)mm->arrays);
    printf("resident      %llu B (%.2f GiB: kv cache + scratch + session%s), next to %llu B mapped\n",
           (unsigned long long)mm->resident, mm->resident / 1073741824.0, mm->scratch_known ? "" : ", scratch left out",
           (unsigned long long)mm->mapped);
    if (!mm->available)
        printf("available     unknown (no MemAvailable in /proc/meminfo)\n");
    else if (kvt_memory_note(mm, note, sizeof note))
        printf("available     %llu B: %s\n", (unsigned long long)mm->available, note);
    else
        printf("available     the mapped weights fit in available memory\n");
}

static int cmd_info(int argc, char **argv)
{
    opt o[] = {{"--model"}, {"--ctx"}, {"--threads"}, CACHE_OPTS, {"--draft"}, {"--model-draft"}};
    size_t no = sizeof o / sizeof o[0];
    { int pr_ = parse_opts(argc, argv, o, no); if (pr_) return pr_ < 0 ? 2 : 0; }
    uint64_t ctx = 0, threads = 0;
    kvt_row_type tk, tv;
    if (!parse_u64(get(o, no, "--ctx"), "--ctx", 1u << 24, &ctx) ||
        !parse_u64(get(o, no, "--threads"), "--threads", 256, &threads) || !parse_cache_types(o, no, &tk, &tv))
        return 2;
    /* ds4.c's separate MTP file, mapped with the model as run and serve map it */
    const char *mtp = mtp_file(o, no), *dk = get(o, no, "--draft");
    /* --draft mtp alone: the cache as run and serve make it for the file's
     * own layer (Qwen 3.5: with the layer's rows) */
    bool mtp_rows = dk && !strcmp(dk, "mtp") && !get(o, no, "--model-draft");
    if ((dk || get(o, no, "--model-draft")) && !mtp && !mtp_rows) {
        fprintf(stderr, "kvtier: info takes --draft mtp [--model-draft FILE (ds4.c's separate MTP file)] only\n");
        return 2;
    }
    kvt_model *m = NULL;
    kvt_model_info i;
    kvt_memory mm;
    char detail[512];
    const char *path = get(o, no, "--model");
    int dr = path ? kvt_model_describe(path, 0, &i, detail, sizeof detail, NULL) : KVT_ENOENT;
    if (dr == KVT_OK) {
        /* described from its header alone: a 160 GB file answers at once */
        if ((dr = kvt_model_memory(path, NULL, ctx, 0, &mm)) || (mtp && (dr = kvt_memory_add_mtp(&mm, mtp))))
            return fail(dr, "info");
        printf("architecture  %s\nparameters    %llu\n", i.arch, (unsigned long long)i.n_params);
        printf("embedding     %u\nlayers        %u\nheads         %u (kv %u, head dim %u)\nexpert ffn    %u\n",
               i.n_embd, i.n_layer, i.n_head, i.n_head_kv, i.head_dim, i.n_ff);
        printf("context       %u (training)\nvocabulary    %u\ndetails       %s\n"
               "weights       not read (from the header alone; run, serve and perplexity load them)\n",
               i.n_ctx_train, i.n_vocab, detail);
        print_memory(&mm);
        return 0;
    }
    if (dr != KVT_ENOENT) return fail(dr, "info");
    int r = open_model(path, o, no, &m);
    if (r) return r;
    if (mtp_rows && (r = kvt_draft_mtp_prepare(m))) {
        kvt_model_close(m);
        fail(r, "info");
        return 2;
    }
    kvt_model_info_get(m, &i);
    if ((r = kvt_model_memory(path, m, ctx, (uint32_t)threads, &mm)) || (mtp && (r = kvt_memory_add_mtp(&mm, mtp)))) {
        kvt_model_close(m);
        return fail(r, "info");
    }
    printf("architecture  %s\nname          %s\nparameters    %llu\n", i.arch, i.name,
           (unsigned long long)i.n_params);
    printf("embedding     %u\nlayers        %u\nheads         %u (kv %u, head dim %u)\nffn           %u\n",
           i.n_embd, i.n_layer, i.n_head, i.n_head_kv, i.head_dim, i.n_ff);
    printf("context       %u (training)\nvocabulary    %u\ntokenizer     %s (bos %d, eos %d, add_bos %s)\n",
           i.n_ctx_train, i.n_vocab, i.tokenizer, i.bos, i.eos, i.add_bos ? "yes" : "no");
    print_memory(&mm);
    kvt_model_close(m);
    return 0;
}

static int cmd_perplexity(int argc, char **argv)
{
    opt o[] = {{"--model"}, {"--file"}, {"--threads"}, {"--ctx"}, CACHE_OPTS};
    size_t no = sizeof o / sizeof o[0];
    { int pr_ = parse_opts(argc, argv, o, no); if (pr_) return pr_ < 0 ? 2 : 0; }
    uint64_t threads = 0, ctx = 0;
    if (!parse_u64(get(o, no, "--threads"), "--threads", 256, &threads) ||
        !parse_u64(get(o, no, "--ctx"), "--ctx", 1u << 24, &ctx))
        return 2;
    const char *path = get(o, no, "--file");
    if (!path) { fprintf(stderr, "kvtier: --file is required\n"); return 2; }
    FILE *f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "kvtier: %s: %s\n", path, strerror(errno)); return 1; }
    size_t cap = 1 << 16, len = 0;
    char *text = malloc(cap);
    for (size_t got; text && (got = fread(text + len, 1, cap - len, f)) > 0;) {
        len += got;
        if (len == cap) { char *t = realloc(text, cap *= 2); if (!t) { free(text); text = NULL; } else text = t; }
    }
    fclose(f);
    if (!text) { fprintf(stderr, "kvtier: out of memory reading %s\n", path); return 1; }
    kvt_model *m = NULL;
    int r = open_model(get(o, no, "--model"), o, no, &m);
    if (r) { free(text); return r; }
    int32_t *ids = NULL;
    size_t n = 0;
    kvt_session *s = NULL;
    int ret = 1, rc;
    if ((rc = kvt_tokenize(m, text, len, -1, false, &ids, &n))) { fail(rc, "tokenize"); goto out; }
    kvt_session_opts so = {.n_ctx = (uint32_t)ctx, .n_threads = (uint32_t)threads};
    if ((rc = kvt_session_new(&s, m, &so))) { fail(rc, "session"); goto out; }
    /* Consecutive windows of at most ctx tokens, each scored from its start. */
    kvt_model_info info;
    kvt_model_info_get(m, &info);
    size_t win = ctx ? ctx : info.n_ctx_train, scored = 0;
    double sum = 0;
    for (size_t b = 0; b + 1 < n; b += win) {
        size_t e = b + win + 1 < n ? b + win + 1 : n, k;
        double part;
        if ((rc = kvt_session_nll(s, ids + b, e - b, &part, &k))) { fail(rc, "perplexity"); goto out; }
        sum += part;
        scored += k;
    }
    if (!scored) { fprintf(stderr, "kvtier: fewer than 2 tokens: nothing to score\n"); goto out; }
    printf("tokens %zu  mean_nll %.6f  perplexity %.4f\n", scored, sum / scored, exp(sum / scored));
    ret = 0;
out:
    free(ids);
    free(text);
    kvt_session_free(s);
    kvt_model_close(m);
    return ret;
}

static int cmd_model(int argc, char **argv)
{
    if (argc < 1 || strcmp(argv[0], "new")) {
        fprintf(stderr, "kvtier: usage: kvtier model new --preset NAME [--seed S] [--vocab VOCAB.gguf] "
                        "[--type f32|f16|q8_0] --out FILE.gguf [--mtp-out MTP.gguf]\n");
        return 2;
    }
    opt o[] = {{"--preset"}, {"--seed"}, {"--vocab"}, {"--out"}, {"--type"}, {"--mtp-out"}};
    size_t no = sizeof o / sizeof o[0];
    { int pr_ = parse_opts(argc - 1, argv + 1, o, no); if (pr_) return pr_ < 0 ? 2 : 0; }
    uint64_t seed = KVT_DEFAULT_SEED;
    if (!parse_u64(get(o, no, "--seed"), "--seed", UINT64_MAX >> 1, &seed)) return 2;
    const char *preset = get(o, no, "--preset"), *out = get(o, no, "--out");
    if (!preset || !out) { fprintf(stderr, "kvtier: --preset and --out are required\n"); return 2; }
    const char *mtp_out = get(o, no, "--mtp-out");
    if (get(o, no, "--type") && mtp_out) {
        fprintf(stderr, "kvtier: --mtp-out goes with a model built in memory, not --type\n");
        return 2;
    }
    if (get(o, no, "--type")) { /* tensor by tensor, without the model in memory */
        int rc = kvt_model_write_preset(preset, seed, get(o, no, "--vocab"), get(o, no, "--type"), out);
        if (rc) return fail(rc, out);
        kvt_model_info i;
        char detail[512];
        if ((rc = kvt_model_describe(out, 0, &i, detail, sizeof detail, NULL))) return fail(rc, out);
        printf("wrote %s: %s, %llu parameters, matrices %s, vocabulary %u, seed %llu\n", out, preset,
               (unsigned long long)i.n_params, get(o, no, "--type"), i.n_vocab, (unsigned long long)seed);
        return 0;
    }
    kvt_model *m = NULL;
    int rc = kvt_model_preset(&m, preset, seed, get(o, no, "--vocab"));
    if (rc) return fail(rc, preset);
    rc = kvt_model_save(m, out);
    if (rc) { kvt_model_close(m); return fail(rc, out); }
    /* the MTP layer again, as ds4.c's separate file (--draft mtp --model-draft) */
    if (mtp_out && (rc = kvt_draft_mtp_write(m, mtp_out))) { kvt_model_close(m); return fail(rc, mtp_out); }
    kvt_model_info i;
    kvt_model_info_get(m, &i);
    printf("wrote %s: %s, %llu parameters, vocabulary %u (%s), seed %llu\n", out, i.name,
           (unsigned long long)i.n_params, i.n_vocab, i.tokenizer, (unsigned long long)seed);
    kvt_model_close(m);
    return 0;
}

static void verify_line(void *user, const char *ns, uint64_t head, size_t tokens, const char *problem)
{
    if (problem) printf("%-40s %016llx %8zu  %s\n", ns, (unsigned long long)head, tokens, problem);
    else if (*(bool *)user) printf("%-40s %016llx %8zu  ok\n", ns, (unsigned long long)head, tokens);
}

/* `cache verify --kv-remote URL --model M`: every entry a remote holds for
 * the model (every tenant's), read and checked as a hit is; the bad ones
 * listed (deleted with --delete). Exit 1 when one is bad. */
static int remote_verify(const opt *o, size_t no)
{
    kvt_model *m = NULL;
    int r = open_model(get(o, no, "--model"), o, no, &m);
    if (r) return r;
    kvt_remote_opts ro = {.url = get(o, no, "--kv-remote"), .password_file = get(o, no, "--kv-remote-password-file"),
                          .secret_file = get(o, no, "--kv-remote-secret-file"), .quiet = true,
                          .tls_ca = get(o, no, "--kv-remote-ca"), .tls_cert = get(o, no, "--kv-remote-cert"),
                          .tls_key = get(o, no, "--kv-remote-key")};
    kvt_remote *rt = NULL;
    int rc = kvt_remote_open(&rt, m, &ro);
    if (rc) { kvt_model_close(m); return fail(rc, "cache verify --kv-remote"); }
    bool del = get(o, no, "--delete") != NULL, all = false;
    kvt_remote_verify_stats st;
    printf("%-40s %-16s %8s  %s\n", "NAMESPACE (LAYOUT:KEY0:TENANT)", "HEAD", "TOKENS", "PROBLEM");
    rc = kvt_remote_verify(rt, del, verify_line, &all, &st);
    kvt_remote_close(rt);
    kvt_model_close(m);
    if (rc) return fail(rc, "cache verify --kv-remote");
    printf("%llu entries of this model: %llu good, %llu bad, %llu with a value evicted%s%s\n",
           (unsigned long long)st.entries, (unsigned long long)st.good, (unsigned long long)st.bad,
           (unsigned long long)st.gone, st.bad + st.gone ? (del ? "; deleted" : "; --delete deletes them") : "",
           ro.secret_file ? "" : " (MACs not checked: no --kv-remote-secret-file)");
    return st.bad ? 1 : 0;
}

static int cmd_cache(int argc, char **argv)
{
    const char *sub = argc > 0 ? argv[0] : "";
    bool need_key = !strcmp(sub, "show") || !strcmp(sub, "rm");
    if (strcmp(sub, "ls") && strcmp(sub, "verify") && strcmp(sub, "gc") && strcmp(sub, "stats") && !need_key) {
        fprintf(stderr, "kvtier: usage: kvtier cache ls|show KEY|verify|rm KEY|gc|stats [--kv-disk-dir DIR]\n"
                        "  [--kv-disk-mb N] [--kv-disk-min-free-mb N]\n");
        return 2;
    }
    int64_t key = 0;
    int skip = 1;
    if (need_key) {
        uint64_t k;
        if (argc < 2) { fprintf(stderr, "kvtier: cache %s needs a KEY (see kvtier cache ls)\n", sub); return 2; }
        if (!parse_u64(argv[1], "KEY", INT64_MAX, &k)) return 2;
        key = (int64_t)k;
        skip = 2;
    }
    opt o[] = {DISK_OPTS, {"--kv-remote"}, {"--kv-remote-password-file"}, {"--kv-remote-secret-file"}, {"--model"},
               {"--delete", NULL, true}, REMOTE_TLS_OPTS, CACHE_OPTS};
    size_t no = sizeof o / sizeof o[0];
    { int pr_ = parse_opts(argc - skip, argv + skip, o, no); if (pr_) return pr_ < 0 ? 2 : 0; }
    if (get(o, no, "--kv-remote") && !strcmp(sub, "verify")) return remote_verify(o, no);
    if (get(o, no, "--delete") || get(o, no, "--kv-remote-secret-file") || get(o, no, "--model")) {
        fprintf(stderr, "kvtier: --delete, --kv-remote-secret-file and --model go with cache verify --kv-remote\n");
        return 2;
    }
    if (get(o, no, "--kv-remote")) {
        if (strcmp(sub, "ls")) {
            fprintf(stderr, "kvtier: cache %s works on the disk tier; --kv-remote goes with cache ls and cache "
                            "verify\n", sub);
            return 2;
        }
        kvt_remote_entry *e = NULL;
        size_t n = 0;
        kvt_remote_opts ro = {.url = get(o, no, "--kv-remote"), .password_file = get(o, no, "--kv-remote-password-file"),
                              .tls_ca = get(o, no, "--kv-remote-ca"), .tls_cert = get(o, no, "--kv-remote-cert"),
                              .tls_key = get(o, no, "--kv-remote-key")};
        int rc = kvt_remote_list(&ro, &e, &n);
        if (rc) return fail(rc, "cache ls --kv-remote");
        printf("%-40s %-16s %8s %7s %12s\n", "NAMESPACE (LAYOUT:KEY0:TENANT)", "HEAD", "TOKENS", "BLOCKS", "BYTES");
        for (size_t i = 0; i < n; i++)
            printf("%-40s %016llx %8u %7u %12llu\n", e[i].ns, (unsigned long long)e[i].head, e[i].n_tokens,
                   e[i].n_blocks, (unsigned long long)e[i].bytes);
        free(e);
        return 0;
    }
    disk_cfg d;
    if (!parse_disk(o, no, &d)) return 2;
    kvt_store *st = NULL;
    /* verify only looks: a damaged store stays as it is for gc to rebuild */
    int rc = !strcmp(sub, "verify") ? kvt_store_open_inspect(&st, d.dir) : kvt_store_open(&st, d.dir, d.budget);
    if (rc == KVT_ENOENT && !strcmp(sub, "verify")) {
        printf("no cache store in %s: nothing to check\n", d.dir);
        return 0;
    }
    if (rc) return fail(rc, d.dir);
    kvt_store_set_min_free(st, d.min_free);
    int ret = 0;
    if (!strcmp(sub, "ls")) {
        kvt_store_entry *e = NULL;
        size_t n = 0;
        if ((rc = kvt_store_list(st, &e, &n))) { ret = fail(rc, "cache ls"); goto out; }
        printf("%6s %8s %12s %7s %5s %-19s %-9s %-6s %s\n", "KEY", "TOKENS", "BYTES", "SHARED", "HITS", "LAST USED",
               "REASON", "STATE", "TEXT");
        for (size_t i = 0; i < n; i++) {
            char when[32];
            time_t t = (time_t)e[i].used_at;
            strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", localtime(&t));
            printf("%6lld %8u %12llu %3u/%-3u %5llu %-19s %-9s %-6s %.40s\n", (long long)e[i].id, e[i].n_tokens,
                   (unsigned long long)e[i].bytes, e[i].shared_blocks, e[i].n_blocks,
                   (unsigned long long)e[i].hits, when, e[i].reason, e[i].replay ? "replay" : "whole", e[i].preview);
        }
        free(e);
    } else if (!strcmp(sub, "show")) {
        kvt_store_entry *e = NULL;
        size_t n = 0;
        char *text = NULL;
        size_t len = 0;
        if ((rc = kvt_store_list(st, &e, &n)) || (rc = kvt_store_text(st, key, &text, &len))) {
            free(e);
            ret = fail(rc, "cache show");
            goto out;
        }
        for (size_t i = 0; i < n; i++)
            if (e[i].id == key)
                printf("key       %lld\ntokens    %u\nblocks    %u (%u shared)\nbytes     %llu (own record)\n"
                       "hits      %llu\nreason    %s\nstate     %s\nmodel     %016llx\ntext      %zu bytes:\n",
                       (long long)key, e[i].n_tokens, e[i].n_blocks, e[i].shared_blocks,
                       (unsigned long long)e[i].bytes, (unsigned long long)e[i].hits, e[i].reason,
                       e[i].replay ? "not stored: rebuilt on load by replaying the last tokens" : "stored",
                       (unsigned long long)e[i].model, len);
        fwrite(text, 1, len, stdout);
        putchar('\n');
        free(text);
        free(e);
    } else if (!strcmp(sub, "verify")) {
        /* SQLite's own check of its pages and indexes, then every record's
         * checksums: each finds damage the other cannot see */
        size_t problems = 0, bad = 0, checked = 0, newer = 0;
        char *report = NULL;
        if ((rc = kvt_store_integrity(st, &problems, &report))) { ret = fail(rc, "cache verify"); goto out; }
        if (!problems) printf("integrity check: ok\n");
        else printf("integrity check: %zu problem%s\n", problems, problems == 1 ? "" : "s");
        for (const char *l = report; problems && l && *l;) {
            size_t len = strcspn(l, "\n");
            printf("  %.*s\n", (int)len, l);
            l += len + (l[len] == '\n');
        }
        free(report);
        if ((rc = kvt_store_verify(st, &bad, &checked, &newer))) { ret = fail(rc, "cache verify"); goto out; }
        /* a newer kvtier's records (a store it shares) are kept, not damage */
        printf("checked %zu records: %zu damaged, %zu of a newer format (kept)\n", checked, bad, newer);
        if (problems || bad) printf("`kvtier cache gc` rebuilds the store from the records that check out\n");
        ret = problems || bad ? 1 : 0;
    } else if (!strcmp(sub, "rm")) {
        if ((rc = kvt_store_rm(st, key))) ret = fail(rc, "cache rm");
    } else if (!strcmp(sub, "gc")) {
        if ((rc = kvt_store_gc(st))) ret = fail(rc, "cache gc");
    }
    if (!ret && (!strcmp(sub, "stats") || !strcmp(sub, "gc"))) {
        kvt_store_stats s;
        kvt_store_stats_get(st, &s);
        printf("directory   %s\nsnapshots   %llu\nblocks      %llu (%llu references)\nbytes       %llu of %llu budget\n"
               "lookups     %llu\nhits        %llu\nmisses      %llu\nsaves       %llu\nevictions   %llu\n"
               "damaged     %llu\nsave errors %llu\n", d.dir,
               (unsigned long long)s.snapshots, (unsigned long long)s.blocks, (unsigned long long)s.block_refs,
               (unsigned long long)s.bytes, (unsigned long long)s.budget, (unsigned long long)s.lookups,
               (unsigned long long)s.hits, (unsigned long long)s.misses, (unsigned long long)s.saves,
               (unsigned long long)s.evictions, (unsigned long long)s.damaged, (unsigned long long)s.save_errors);
    }
out:
    kvt_store_close(st);
    return ret;
}

/* An API key as given to --api-key or on a line of --api-key-file:
 * "NAME=KEY" names the key (its label in the operator's /metrics view)
 * when NAME is a letter then at most 31 letters, digits, '_' or '-', and
 * KEY is not empty and does not start with '=' (so "abc==", base64
 * padding, and "abc=" are keys, not names). Anything else is a key, whole.
 * A key that would read as NAME=KEY is given with a name: "key1=a=b" is
 * the key "a=b" named key1. *name gets the name ("" when none). */
static const char *split_key(const char *arg, char name[33])
{
    name[0] = 0;
    size_t n = 0;
    if (!((arg[0] >= 'A' && arg[0] <= 'Z') || (arg[0] >= 'a' && arg[0] <= 'z'))) return arg;
    while (arg[n] && arg[n] != '=' && n < 33) {
        char c = arg[n];
        if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-'))
            return arg;
        n++;
    }
    if (n > 32 || arg[n] != '=' || !arg[n + 1] || arg[n + 1] == '=') return arg;
    memcpy(name, arg, n);
    name[n] = 0;
    return arg + n + 1;
}

static int cmd_serve(int argc, char **argv)
{
    opt o[] = {{"--model"}, {"--model-id"}, {"--host"}, {"--port"}, {"--ctx"}, {"--threads"}, {"--max-tokens"},
               {"--queue"}, {"--parallel"}, {"--kv-ram-mb"}, {"--api-key"}, {"--api-key-file"}, {"--max-body-mb"},
               {"--request-timeout"}, {"--max-conn-per-addr"}, {"--max-connections"},
               {"--metrics-key"}, {"--metrics-key-file"}, {"--strict-model", NULL, true}, {"--any-model", NULL, true}, {"--keep-volatile-lines", NULL, true},
               {"--kv-remote"}, {"--kv-remote-password-file"}, {"--kv-remote-secret-file"}, {"--kv-remote-timeout-ms"},
               {"--kv-remote-prefill-tps"}, REMOTE_TLS_OPTS, DISK_OPTS, CACHE_OPTS, DRAFT_OPTS};
    size_t no = sizeof o / sizeof o[0];
    { int pr_ = parse_opts(argc, argv, o, no); if (pr_) return pr_ < 0 ? 2 : 0; }
    disk_cfg disk;
    if (!parse_disk(o, no, &disk)) return 2;
    /* --any-model is what serve does by default now; it is still accepted
     * (scripts pass it), but not together with its opposite */
    if (get(o, no, "--strict-model") && get(o, no, "--any-model")) {
        fprintf(stderr, "kvtier: --strict-model and --any-model contradict each other\n");
        return 2;
    }
    uint64_t port = 8000, ctx = 0, threads = 0, max_tokens = 1024, queue = 8, ram_mb = 2048, body_mb = 32,
             parallel = 0, req_timeout = 30, per_addr = 256, max_conns = 4096;
    if (!parse_u64(get(o, no, "--port"), "--port", 65535, &port) ||
        !parse_u64(get(o, no, "--ctx"), "--ctx", 1u << 24, &ctx) ||
        !parse_u64(get(o, no, "--threads"), "--threads", 256, &threads) ||
        !parse_u64(get(o, no, "--max-tokens"), "--max-tokens", 1u << 24, &max_tokens) ||
        !parse_u64(get(o, no, "--queue"), "--queue", 1u << 16, &queue) ||
        !parse_u64(get(o, no, "--parallel"), "--parallel", KVT_SERVE_MAX_PARALLEL, &parallel) ||
        !parse_u64(get(o, no, "--kv-ram-mb"), "--kv-ram-mb", 1u << 30, &ram_mb) ||
        !parse_u64(get(o, no, "--max-body-mb"), "--max-body-mb", 1u << 12, &body_mb) ||
        !parse_u64(get(o, no, "--request-timeout"), "--request-timeout", 86400, &req_timeout) ||
        !parse_u64(get(o, no, "--max-conn-per-addr"), "--max-conn-per-addr", 1u << 20, &per_addr) ||
        !parse_u64(get(o, no, "--max-connections"), "--max-connections", 1u << 20, &max_conns))
        return 2;
    uint64_t remote_ms = 20, remote_tps = 0;
    if (!parse_u64(get(o, no, "--kv-remote-timeout-ms"), "--kv-remote-timeout-ms", 60000, &remote_ms) ||
        !parse_u64(get(o, no, "--kv-remote-prefill-tps"), "--kv-remote-prefill-tps", 1u << 30, &remote_tps))
        return 2;
    if (!get(o, no, "--kv-remote") && remote_opt_given(o, no)) {
        fprintf(stderr, "kvtier: %s\n", REMOTE_NEEDS_URL);
        return 2;
    }
    if (!req_timeout || !per_addr || !max_conns) {
        fprintf(stderr, "kvtier: --request-timeout, --max-conn-per-addr and --max-connections must be at least 1\n");
        return 2;
    }
    /* API keys: --api-key (repeatable), --api-key-file (one per line), or $KVTIER_API_KEY */
    const char *keys[32], *names[32];
    char name_text[32][33];
    size_t n_keys = 0;
    char *file_text = NULL;
    for (size_t k = 0; k < no; k++)
        if (!strcmp(o[k].name, "--api-key"))
            for (size_t i = 0; i < o[k].n_vals; i++, n_keys++) {
                keys[n_keys] = split_key(o[k].vals[i], name_text[n_keys]);
                names[n_keys] = name_text[n_keys];
            }
    const char *kf = get(o, no, "--api-key-file");
    if (kf) {
        FILE *f = fopen(kf, "r");
        if (!f) { fprintf(stderr, "kvtier: %s: %s\n", kf, strerror(errno)); return 1; }
        file_text = calloc(1, 65537);
        size_t got = file_text ? fread(file_text, 1, 65536, f) : 0;
        fclose(f);
        (void)got;
        for (char *line = file_text ? strtok(file_text, "\r\n") : NULL; line; line = strtok(NULL, "\r\n")) {
            while (*line == ' ' || *line == '\t') line++;
            if (!*line || *line == '#') continue;
            if (n_keys == 32) { fprintf(stderr, "kvtier: at most 32 API keys\n"); free(file_text); return 2; }
            keys[n_keys] = split_key(line, name_text[n_keys]);
            names[n_keys] = name_text[n_keys];
            n_keys++;
        }
    }
    const char *env_key = getenv("KVTIER_API_KEY");
    if (!n_keys && env_key && *env_key) { /* a key, whole: never a name */
        name_text[0][0] = 0;
        names[0] = name_text[0];
        keys[n_keys++] = env_key;
    }
    for (size_t i = 0; i < n_keys; i++) {
        bool bad = !*keys[i];
        for (size_t k = 0; k < i && !bad; k++) bad = !strcmp(keys[i], keys[k]);
        if (bad) {
            fprintf(stderr, "kvtier: API key %zu is %s\n", i + 1, *keys[i] ? "given twice" : "empty");
            free(file_text);
            return 2;
        }
        /* the labels (a name, or key<i>) tell the keys apart */
        char li[40], lk[40];
        snprintf(li, sizeof li, "%s", *names[i] ? names[i] : "");
        if (!*li) snprintf(li, sizeof li, "key%zu", i + 1);
        for (size_t k = 0; k < n_keys; k++) {
            if (k == i) continue;
            snprintf(lk, sizeof lk, "%s", *names[k] ? names[k] : "");
            if (!*lk) snprintf(lk, sizeof lk, "key%zu", k + 1);
            if (!strcmp(li, lk)) {
                fprintf(stderr, "kvtier: API keys %zu and %zu are both named %s in /metrics: give them other "
                                "names (--api-key NAME=KEY)\n", k < i ? k + 1 : i + 1, k < i ? i + 1 : k + 1, li);
                free(file_text);
                return 2;
            }
        }
        if (*names[i]) fprintf(stderr, "kvtier: API key %zu is named %s (--api-key NAME=KEY)\n", i + 1, names[i]);
    }
    /* The metrics key: GET /metrics only, every API key's figures
     * (--metrics-key, or the first line of --metrics-key-file) */
    const char *mkey = get(o, no, "--metrics-key");
    char mkey_text[4096] = {0};
    const char *mkf = get(o, no, "--metrics-key-file");
    if (mkey && mkf) {
        fprintf(stderr, "kvtier: give --metrics-key or --metrics-key-file, not both\n");
        free(file_text);
        return 2;
    }
    if (mkf) {
        FILE *f = fopen(mkf, "r");
        if (!f) { fprintf(stderr, "kvtier: %s: %s\n", mkf, strerror(errno)); free(file_text); return 1; }
        char line[sizeof mkey_text];
        while (!mkey_text[0] && fgets(line, sizeof line, f)) {
            char *p = line;
            while (*p == ' ' || *p == '\t') p++;
            p[strcspn(p, "\r\n")] = 0;
            if (*p && *p != '#') snprintf(mkey_text, sizeof mkey_text, "%s", p);
        }
        fclose(f);
        if (!mkey_text[0]) { fprintf(stderr, "kvtier: %s holds no key\n", mkf); free(file_text); return 2; }
        mkey = mkey_text;
    }
    if (mkey && (!*mkey || !n_keys)) {
        fprintf(stderr, "kvtier: %s\n", *mkey ? "--metrics-key needs API keys (--api-key, --api-key-file or "
                                                 "$KVTIER_API_KEY): without them /metrics is open"
                                               : "--metrics-key is empty");
        free(file_text);
        return 2;
    }
    for (size_t i = 0; mkey && i < n_keys; i++)
        if (!strcmp(keys[i], mkey)) {
            fprintf(stderr, "kvtier: the metrics key must differ from every API key\n");
            free(file_text);
            return 2;
        }
    kvt_row_type type_k, type_v;
    if (!parse_cache_types(o, no, &type_k, &type_v)) { free(file_text); return 2; }
    kvt_draft_kind draft;
    uint32_t draft_max;
    const char *draft_file;
    if (!parse_draft(o, no, &draft, &draft_max, &draft_file)) { free(file_text); return 2; }
    kvt_server_opts so = {
        .model = get(o, no, "--model"), .model_id = get(o, no, "--model-id"),
        .type_k = type_k, .type_v = type_v,
        .host = get(o, no, "--host") ? get(o, no, "--host") : "127.0.0.1", .port = (uint16_t)port,
        .n_ctx = (uint32_t)ctx, .n_threads = (uint32_t)threads, .max_tokens = (uint32_t)max_tokens,
        .queue = (uint32_t)(queue ? queue : 1), .parallel = (uint32_t)parallel, .disk_dir = disk.on ? disk.dir : NULL, .disk_bytes = disk.budget,
        .disk_min_free = disk.min_free,
        .ram_bytes = (size_t)ram_mb << 20, .max_body = (size_t)(body_mb ? body_mb : 1) << 20,
        .request_timeout = (uint32_t)req_timeout, .max_conn_per_addr = (uint32_t)per_addr,
        .max_connections = (uint32_t)max_conns,
        .api_keys = keys, .api_key_names = names, .n_keys = n_keys, .metrics_key = mkey, .strict_model = get(o, no, "--strict-model") != NULL,
        .keep_volatile = get(o, no, "--keep-volatile-lines") != NULL, .policy = disk.policy,
        .remote_url = get(o, no, "--kv-remote"), .remote_password_file = get(o, no, "--kv-remote-password-file"),
        .remote_secret_file = get(o, no, "--kv-remote-secret-file"),
        .remote_tls_ca = get(o, no, "--kv-remote-ca"), .remote_tls_cert = get(o, no, "--kv-remote-cert"),
        .remote_tls_key = get(o, no, "--kv-remote-key"), .remote_lookup_ms = (uint32_t)(remote_ms ? remote_ms : 1),
        .remote_prefill_tps = (double)remote_tps,
        .draft = draft, .draft_max = draft_max, .model_draft = draft_file,
    };
    int rc = kvt_serve(&so);
    free(file_text);
    if (rc) return fail(rc, "serve");
    return 0;
}

static void print_bytes(const char *what, uint64_t b)
{
    printf("%-12s %20llu B  %12.3f MiB\n", what, (unsigned long long)b, b / 1048576.0);
}

static int cmd_plan(int argc, char **argv)
{
    opt o[] = {{"--model"}, {"--preset"}, {"--ctx"}, {"--layers"}, {"--kv-heads"}, {"--head-dim"}, {"--bytes"},
               CACHE_OPTS};
    size_t no = sizeof o / sizeof o[0];
    { int pr_ = parse_opts(argc, argv, o, no); if (pr_) return pr_ < 0 ? 2 : 0; }
    uint64_t ctx = 0, L = 0, H = 0, D = 0, B = 2;
    if (!parse_u64(get(o, no, "--ctx"), "--ctx", 1ull << 32, &ctx) ||
        !parse_u64(get(o, no, "--layers"), "--layers", 4096, &L) ||
        !parse_u64(get(o, no, "--kv-heads"), "--kv-heads", 4096, &H) ||
        !parse_u64(get(o, no, "--head-dim"), "--head-dim", 65536, &D) ||
        !parse_u64(get(o, no, "--bytes"), "--bytes", 16, &B))
        return 2;
    if (!get(o, no, "--ctx")) { fprintf(stderr, "kvtier: --ctx N is required\n"); return 2; }
    kvt_plan p = {0};
    const char *what;
    int dr;
    if (get(o, no, "--layers") || get(o, no, "--kv-heads") || get(o, no, "--head-dim")) {
        if (!L || !H || !D || !B) {
            fprintf(stderr, "kvtier: a bare shape needs --layers, --kv-heads, --head-dim (and --bytes, default 2)\n");
            return 2;
        }
        /* full attention: K and V rows, 2 * L * H_kv * D * S * B */
        uint64_t per, full;
        if (__builtin_mul_overflow(2 * L * H, D * B, &per) || __builtin_mul_overflow(per, ctx, &full) ||
            __builtin_mul_overflow(per, 1000, &p.per_token_x1000)) {
            fprintf(stderr, "kvtier: that shape needs more than 2^64 bytes\n");
            return 2;
        }
        kvt_plan_add(&p, "full rows", full, false);
        what = "shape";
    } else if (get(o, no, "--preset")) { /* a preset's shape, without building its weights */
        what = get(o, no, "--preset");
        int rc = kvt_plan_preset(what, ctx, &p);
        if (rc) return fail(rc, what);
    } else if (get(o, no, "--model") &&
               (dr = kvt_model_describe(get(o, no, "--model"), ctx, &(kvt_model_info){0}, NULL, 0, &p)) !=
                   KVT_ENOENT) {
        /* an architecture planned from its header alone */
        if (dr) return fail(dr, "plan");
        what = get(o, no, "--model");
    } else {
        kvt_model *m = NULL;
        what = get(o, no, "--model") ? get(o, no, "--model") : get(o, no, "--preset");
        int r = open_model(what, o, no, &m);
        if (r) return r;
        kvt_model_plan(m, ctx, &p);
        kvt_model_close(m);
        if (!what) what = KVT_DEFAULT_MODEL;
    }
    char rows_kv[32];
    printf("KV cache plan for %s at %llu tokens\n", what, (unsigned long long)ctx);
    /* the rows every plan prints (0 where the architecture has no such
     * part), then any other part it has */
    static const char *const rows[] = {"window", "compressed", "indexer", "frontier", "full rows"};
    size_t nr = sizeof rows / sizeof *rows;
    for (size_t i = 0; i < nr; i++) print_bytes(rows[i], kvt_plan_bytes(&p, rows[i]));
    for (size_t i = 0; i < p.n_parts; i++) {
        size_t j = 0;
        while (j < nr && strcmp(rows[j], p.part[i].name)) j++;
        if (j == nr) print_bytes(p.part[i].name, p.part[i].bytes);
    }
    printf("%-12s %24.3f B\n", "per token", p.per_token_x1000 / 1000.0);
    if (p.type_k) /* the rows' types: what was asked, or the model's own */
        printf("%-12s %26s\n", "rows", p.rows_own ? "f16 (the model's own)"
                                   : p.type_k == p.type_v ? kvt_row_type_name(p.type_k)
                                   : (snprintf(rows_kv, sizeof rows_kv, "K %s, V %s", kvt_row_type_name(p.type_k),
                                               kvt_row_type_name(p.type_v)), rows_kv));
    print_bytes("fixed", p.fixed);
    print_bytes("total", p.total);
    return 0;
}

static void usage(FILE *f)
{
    fputs("usage: kvtier COMMAND [options]\n"
          "\n"
          "  run         [--model M] --prompt TEXT [--max-tokens N] [--temperature T]\n"
          "              [--seed S] [--top-p P] [--top-k K] [--output text|ids]\n"
          "              [--threads N] [--ctx N] [--rolling] [--kv-save] [draft options] [cache types]\n"
          "              [disk options] [--kv-remote URL and serve's --kv-remote-* options]:\n"
          "              with --kv-remote, the remote tier as serve has it: asked after the\n"
          "              disk (a hit kept on the disk), what the run saves uploaded before exit\n"
          "  run --demo  [run's options]: the cache at work (make run): a prompt of 4,224 tokens\n"
          "              (or --prompt) cold, a second turn on it from RAM, then the prompt in\n"
          "              a new session from disk; the replies (--max-tokens 32) only with --output\n"
          "  tokenize    [--model M] --text TEXT [--no-bos] [--special]\n"
          "  detokenize  [--model M] --ids \"ID ID ...\"\n"
          "  info        [--model M] [--ctx N] [--threads N] [cache types] [--draft mtp [--model-draft FILE]]:\n"
          "              the shape, and what a run needs in memory: weights mapped from the file (by\n"
          "              type; and from ds4.c's separate MTP file when given), the KV cache at the\n"
          "              context (default: the model's), a session's scratch, the resident estimate,\n"
          "              and whether the mapped weights exceed available memory\n"
          "  perplexity  [--model M] --file F [--threads N] [--ctx N] [cache types]\n"
          "  model new   --preset ds4-tiny|ds4-mini|ds4-flash-bench [--seed S] [--vocab VOCAB.gguf]\n"
          "              [--type f32|f16|q8_0] --out FILE.gguf [--mtp-out MTP.gguf] (a preset\n"
          "              with +mtp=1: its MTP layer also as ds4.c's separate file)\n"
          "  plan        --ctx N [--model M | --preset ds4-tiny|ds4-mini|ds4-flash-bench|ds4-flash |\n"
          "              --layers L --kv-heads H --head-dim D [--bytes B]] [cache types]\n"
          "  serve       [--model M] [--model-id ID] [--host 127.0.0.1] [--port 8000] [--ctx N]\n"
          "              [--threads N] [--max-tokens N (1024)] [--parallel N] [--queue N (8)]\n"
          "              [--kv-ram-mb N (2048): the RAM pool's bound, scratch and draft\n"
          "              sessions included; over it, least recently used unshared blocks go first]\n"
          "              [--api-key [NAME=]K ... | --api-key-file F | $KVTIER_API_KEY] [--max-body-mb N (32)]\n"
          "              [--metrics-key K | --metrics-key-file F]\n"
          "              [--request-timeout S (30)] [--max-conn-per-addr N (256)]\n"
          "              [--max-connections N (4096)]\n"
          "              [--strict-model] [--keep-volatile-lines] [draft options] [cache types]\n"
          "              [disk options]\n"
          "              each API key is its own cache namespace with an equal share of\n"
          "              --kv-ram-mb and --kv-disk-mb, and reads its own /metrics; the\n"
          "              metrics key reads every key's, labelled tenant=\"NAME\" (NAME: a letter,\n"
          "              then up to 31 letters, digits, _ or -; unnamed keys key1, key2, ...);\n"
          "              --parallel requests run at once,\n"
          "              batched (default from cores and RAM, at most 16), --queue wait\n"
          "              behind them (429 beyond); any model id is served\n"
          "              and echoed unless --strict-model (--any-model: accepted, the default);\n"
          "              --max-tokens is the default reply length and the most a request\n"
          "              gets; a connection has --request-timeout seconds to send its\n"
          "              request (and its client as long to take some of the answer),\n"
          "              at most --max-conn-per-addr come from one address, and\n"
          "              past --max-connections new ones are answered 503\n"
          "              [--kv-remote URL [--kv-remote-password-file F] [--kv-remote-secret-file F]\n"
          "              [--kv-remote-timeout-ms N (20)] [--kv-remote-prefill-tps N (measured)]\n"
          "              [--kv-remote-ca F] [--kv-remote-cert F --kv-remote-key F]]: a third tier\n"
          "              in Redis that servers share (needs the disk tier); URL\n"
          "              redis://[USER@]HOST:PORT[/DB], rediss://... (TLS: the server's\n"
          "              certificate checked against --kv-remote-ca, else the system's CAs,\n"
          "              and against HOST; -cert/-key: a client certificate) or\n"
          "              redis-cluster://HOST:PORT[,HOST:PORT...] (a Redis Cluster, a breaker\n"
          "              per master; rediss-cluster://... over TLS, as rediss://); saves are\n"
          "              uploaded behind, a new session asks it within N ms, then loads for at\n"
          "              most the time a prefill of the tokens it saves takes (at the prefill\n"
          "              rate measured, or N tokens/s); every value is checked, with the secret\n"
          "              by HMAC (required with API keys); a failing Redis is a miss, then not\n"
          "              asked for a while\n"
          "  cache       ls|show KEY|verify|rm KEY|gc|stats [--kv-disk-dir DIR]\n"
          "              [--kv-disk-mb N] [--kv-disk-min-free-mb N] (gc evicts to both)\n"
          "  cache ls --kv-remote URL [--kv-remote-password-file F] [--kv-remote-ca F]\n"
          "              [--kv-remote-cert F --kv-remote-key F]: what a remote tier holds\n"
          "              (every master of a cluster): each snapshot's namespace (model key0,\n"
          "              tenant), tokens, bytes\n"
          "  cache verify --kv-remote URL [--model M] [--kv-remote-password-file F]\n"
          "              [--kv-remote-secret-file F] [TLS files as ls] [--delete]: read every\n"
          "              entry the remote holds for the model (every tenant's) and check it as\n"
          "              a hit is; list the bad ones (exit 1), deleted with --delete\n"
          "  cache types --cache-type-k T (-ctk T), --cache-type-v T (-ctv T): how K and V rows are\n"
          "              kept: f16 (default, as llama.cpp), q8_0, bf16 or f32 (DeepSeek-V4: its own f16)\n"
          "  draft options --draft auto|ngram|model|mtp|none (auto: ngram for a dense model whose cache is\n"
          "              rows alone, else none; mtp: a DeepSeek-V4 or Qwen 3.5 file's MTP layer),\n"
          "              --draft-max N\n"
          "              (8, at most 64), --model-draft FILE (the draft model, same vocabulary;\n"
          "              implies --draft model; with --draft mtp: ds4.c's separate MTP file\n"
          "              of mtp.0.* tensors, for a model without the layer): speculative\n"
          "              decoding, the same output\n"
          "              (see Speculative decoding)\n"
          "  bench       [--suite llama|ds4|snapshot|store|fork|all] [--quick] (see bench/README.md)\n"
          "  --version   print the version (kvtier VERSION)\n"
          "\n"
          "disk options: --kv-disk-dir DIR (default $XDG_CACHE_HOME/kvtier or ~/.cache/kvtier)\n"
          "  --no-kv-disk  --kv-disk-mb N (4096)  --kv-cache-min-tokens N (512)\n"
          "  --kv-cache-trim-tokens N (32)  --kv-cache-align-tokens N (1)\n"
          "  --kv-cache-continued-interval N (8192, a multiple of 128)\n"
          "  a prompt is saved at the largest multiple of the alignment that leaves the\n"
          "  trim after it (by default right before the trim), so a restart prefills\n"
          "  at most align + trim - 1 of its tokens again (the trim by default); a\n"
          "  larger alignment (128: the cache block's grid) saves fewer snapshots\n"
          "  --kv-disk-min-free-mb N (5% of the file system, at most 1024): saves evict\n"
          "  least recently used entries to keep this much free on the disk\n"
          "  the directory is made 0700, its files 0600; one that others may write, or\n"
          "  of another user, is refused\n"
          "\n"
          "--model takes a GGUF path or a preset name (ds4-tiny, ds4-mini); without it\n"
          "the built-in " KVT_DEFAULT_MODEL " is used.\n"
          "KVT_ISA=scalar|avx2|avx512 in the environment caps the kernels' instruction set\n"
          "(default: the CPU's widest; every one gives the same bits).\n", f);
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) {
        printf("kvtier %s\n", KVT_VERSION);
        return 0;
    }
    const char *cmd = argv[1];
    argc -= 2;
    argv += 2;
    if (!strcmp(cmd, "run")) return cmd_run(argc, argv);
    if (!strcmp(cmd, "tokenize")) return cmd_tokenize(argc, argv);
    if (!strcmp(cmd, "detokenize")) return cmd_detokenize(argc, argv);
    if (!strcmp(cmd, "info")) return cmd_info(argc, argv);
    if (!strcmp(cmd, "perplexity")) return cmd_perplexity(argc, argv);
    if (!strcmp(cmd, "model")) return cmd_model(argc, argv);
    if (!strcmp(cmd, "plan")) return cmd_plan(argc, argv);
    if (!strcmp(cmd, "cache")) return cmd_cache(argc, argv);
    if (!strcmp(cmd, "serve")) return cmd_serve(argc, argv);
    if (!strcmp(cmd, "bench")) return kvt_bench_main(argc, argv);
    fprintf(stderr, "kvtier: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
}
