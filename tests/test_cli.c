/* The kvtier command, run as a user runs it: the built binary (KVT_BIN) in a
 * child process, its stdout, stderr and exit status checked. Greedy ids on
 * stories260K must equal the golden file token for token; `model new` must
 * write exactly the weights the in-memory preset uses (and another seed must
 * give other weights); a prompt served from the disk cache must generate
 * what a cold run generates; bad input must end in exit status 2 (arguments)
 * or 1 (runtime), with a message on stderr and never a signal or a sanitizer
 * report; the main job (`make run`) must show a prompt reused from RAM and
 * from disk. Every child gets its own XDG_CACHE_HOME under /tmp, so the tests
 * never touch the user's disk cache. Everything but the main job stays small,
 * so the whole file runs in a few seconds (the main job's cold prefill of
 * 4,224 ds4-mini tokens: 1.5 s on 2 idle cores). */
#include "test.h"

#include <ftw.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define STORIES "models/stories260K.gguf"
#define GOLDEN "golden/stories260K-greedy.jsonl"

/* ---- running the binary ---- */

typedef struct proc {
    int status;   /* exit status, or -signal when killed by one */
    char *out;    /* stdout, NUL-terminated */
    char *err;    /* stderr, NUL-terminated */
} proc;

static void proc_free(proc *p)
{
    free(p->out);
    free(p->err);
    *p = (proc){0};
}

/* Append s to the command line single-quoted, after a space when sep. */
static bool put_quoted(char *cmd, size_t cap, size_t *len, const char *s, bool sep)
{
    size_t n = *len;
    if (n + 2 >= cap) return false;
    if (sep) cmd[n++] = ' ';
    cmd[n++] = '\'';
    for (; *s; s++) {
        if (*s == '\'') {
            if (n + 4 >= cap) return false;
            memcpy(cmd + n, "'\\''", 4);
            n += 4;
        } else {
            if (n + 1 >= cap) return false;
            cmd[n++] = *s;
        }
    }
    if (n + 2 >= cap) return false;
    cmd[n++] = '\'';
    cmd[n] = 0;
    *len = n;
    return true;
}

/* Append s as one more shell word. */
static bool put_word(char *cmd, size_t cap, size_t *len, const char *s) { return put_quoted(cmd, cap, len, s, true); }

static char *read_stream(FILE *f)
{
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t got = fread(buf + len, 1, cap - len - 1, f);
        len += got;
        if (got == 0) break;
        if (len + 1 == cap) {
            char *p = realloc(buf, cap *= 2);
            if (!p) { free(buf); buf = NULL; }
            else buf = p;
        }
    }
    if (buf) buf[len] = 0;
    return buf;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st; (void)flag; (void)ftw;
    remove(path);
    return 0;
}

/* Remove a directory tree this file created. */
static void rm_tree(const char *dir)
{
    if (dir && dir[0]) nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static char cache_home[64];

static void rm_cache_home(void) { rm_tree(cache_home); }

/* The XDG_CACHE_HOME of every child: a fresh directory, removed at exit. */
static const char *child_cache_home(void)
{
    if (!cache_home[0]) {
        strcpy(cache_home, "/tmp/kvtier-cli-home-XXXXXX");
        if (!mkdtemp(cache_home)) strcpy(cache_home, "/tmp");
        else atexit(rm_cache_home);
    }
    return cache_home;
}

/* Run the binary with args (NULL-terminated, the binary itself excluded).
 * The shell execs the binary, so a signal shows up in the wait status. */
static bool run_cli(proc *p, const char *const *args)
{
    *p = (proc){0};
    char errpath[] = "/tmp/kvtier-cli-err-XXXXXX";
    int fd = mkstemp(errpath);
    if (fd < 0) return false;
    close(fd);
    static char cmd[8192];
    size_t len = (size_t)snprintf(cmd, sizeof cmd, "XDG_CACHE_HOME=");
    bool ok = put_quoted(cmd, sizeof cmd, &len, child_cache_home(), false);
    if (ok && len + 32 < sizeof cmd) len += (size_t)snprintf(cmd + len, sizeof cmd - len, "; export XDG_CACHE_HOME; exec");
    else ok = false;
    ok = ok && put_word(cmd, sizeof cmd, &len, kvt_test_bin());
    for (size_t i = 0; ok && args[i]; i++) ok = put_word(cmd, sizeof cmd, &len, args[i]);
    if (ok && len + 3 < sizeof cmd) { strcpy(cmd + len, " 2>"); len += 3; }
    else ok = false;
    ok = ok && put_word(cmd, sizeof cmd, &len, errpath);
    FILE *f = ok ? popen(cmd, "r") : NULL;
    if (f) {
        p->out = read_stream(f);
        int st = pclose(f);
        p->status = st == -1 ? -1000 : WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? -WTERMSIG(st) : -1000;
        p->err = kvt_test_read_file(errpath, NULL);
    }
    unlink(errpath);
    if (!f || !p->out || !p->err) { proc_free(p); return false; }
    return true;
}

/* No sanitizer report and no crash (signals and 128+ statuses). */
static bool clean(const proc *p)
{
    return p->status >= 0 && p->status < 128 && !strstr(p->err, "Sanitizer") &&
           !strstr(p->err, "runtime error");
}

static void show(const proc *p)
{
    printf("    exit %d\n    stdout: %.300s\n    stderr: %.600s\n", p->status, p->out, p->err);
}

#define RUN(p, ...)                                                                 \
    do {                                                                            \
        const char *const args_[] = {__VA_ARGS__, NULL};                            \
        CHECKF(run_cli(p, args_), "could not run %s", kvt_test_bin());              \
        if (!clean(p)) show(p);                                                     \
        CHECKF(clean(p), "%s %s: crashed or reported a sanitizer error", kvt_test_bin(), args_[0]); \
    } while (0)

/* Run and require exit 0. */
#define RUN_OK(p, ...)                                                              \
    do {                                                                            \
        RUN(p, __VA_ARGS__);                                                        \
        if ((p)->status != 0) show(p);                                              \
        CHECKF((p)->status == 0, "exit status %d", (p)->status);                    \
    } while (0)

static bool have_bin(void) { return access(kvt_test_bin(), X_OK) == 0; }

/* Space-separated decimal ids; false on anything else. */
static bool parse_ids(const char *s, long *ids, size_t cap, size_t *n)
{
    *n = 0;
    for (;;) {
        while (*s == ' ' || *s == '\n') s++;
        if (!*s) return true;
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || *n == cap) return false;
        ids[(*n)++] = v;
        s = end;
    }
}

/* A temp file under /tmp holding data; path receives its name. */
static bool temp_file(char path[64], const void *data, size_t len)
{
    strcpy(path, "/tmp/kvtier-cli-XXXXXX");
    int fd = mkstemp(path);
    if (fd < 0) return false;
    bool ok = write(fd, data, len) == (ssize_t)len;
    close(fd);
    if (!ok) unlink(path);
    return ok;
}

/* The line of out that starts with prefix (NULL when none). */
static const char *line_of(const char *out, const char *prefix)
{
    size_t k = strlen(prefix);
    for (const char *l = out; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
        if (!strncmp(l, prefix, k)) return l;
    return NULL;
}

/* ---- tests ---- */

TEST(cli_run_stories_golden_ids)
{
    const char *model = kvt_test_shared(STORIES), *gpath = kvt_test_shared(GOLDEN);
    if (!model || !gpath || !have_bin()) SKIP("../shared or %s absent", kvt_test_bin());
    char mpath[4096];
    snprintf(mpath, sizeof mpath, "%s", model);
    /* The first golden case: its prompt and greedy ids. */
    FILE *f = fopen(gpath, "r");
    CHECK(f);
    char *line = NULL;
    size_t cap = 0;
    ssize_t got = getline(&line, &cap, f);
    fclose(f);
    json_error_t je;
    json_t *j = got > 0 ? json_loads(line, 0, &je) : NULL;
    free(line);
    CHECKF(j, "%s: first line is not JSON", gpath);
    json_t *ga = json_object_get(j, "greedy_ids");
    const char *prompt = json_string_value(json_object_get(j, "prompt"));
    enum { N = 40 };
    long want[N];
    bool shape = prompt && json_is_array(ga) && json_array_size(ga) >= N;
    for (size_t i = 0; shape && i < N; i++) want[i] = (long)json_integer_value(json_array_get(ga, i));
    char prompt_copy[256];
    snprintf(prompt_copy, sizeof prompt_copy, "%s", shape ? prompt : "");
    json_decref(j);
    CHECKF(shape, "%s: first case has no prompt or fewer than %d greedy ids", gpath, N);

    proc p;
    RUN_OK(&p, "run", "--model", mpath, "--prompt", prompt_copy, "--output", "ids", "--max-tokens", "40");
    long ids[N + 8];
    size_t n = 0;
    bool parsed = parse_ids(p.out, ids, N + 8, &n);
    if (!parsed || n != N) show(&p);
    proc_free(&p);
    CHECKF(parsed && n == N, "expected %d ids, got %zu", N, n);
    for (size_t i = 0; i < N; i++) CHECKF(ids[i] == want[i], "id %zu: %ld, golden %ld", i, ids[i], want[i]);

    /* --max-tokens 0 generates nothing: an empty line. */
    RUN_OK(&p, "run", "--model", mpath, "--prompt", prompt_copy, "--max-tokens", "0", "--output", "ids");
    bool empty = !strcmp(p.out, "\n");
    proc_free(&p);
    CHECK(empty);
}

TEST(cli_tokenize_stories)
{
    const char *model = kvt_test_shared(STORIES);
    if (!model || !have_bin()) SKIP("../shared or %s absent", kvt_test_bin());
    proc p;
    RUN_OK(&p, "tokenize", "--model", model, "--text", "Once upon a time");
    bool eq = !strcmp(p.out, "1 403 407 261 378\n");
    if (!eq) show(&p);
    proc_free(&p);
    CHECK(eq);
    /* --no-bos drops the leading 1; the byte tokenizer maps bytes to ids. */
    RUN_OK(&p, "tokenize", "--model", model, "--text", "Once upon a time", "--no-bos");
    eq = !strcmp(p.out, "403 407 261 378\n");
    proc_free(&p);
    CHECK(eq);
    RUN_OK(&p, "tokenize", "--model", "ds4-tiny", "--text", "hi");
    eq = !strcmp(p.out, "256 104 105\n");
    proc_free(&p);
    CHECK(eq);
}

static bool refused(const char *const *args, int want);

/* tokenize and detokenize need only a tokenizer: llama.cpp's vocabulary
 * files (no tensors) are enough, user-defined tokens split out as llama.cpp
 * splits them (deepseek-llm's "ö" is 100003, not 7962 "ö" as bytes), control
 * tokens only with --special, and detokenize gives back the exact text. */
TEST(cli_tokenize_vocab_file)
{
    const char *spm = kvt_test_shared("vocab/ggml-vocab-llama-spm.gguf");
    const char *ds = kvt_test_shared("vocab/ggml-vocab-deepseek-llm.gguf");
    if (!spm || !ds || !have_bin()) SKIP("../shared/vocab or %s absent", kvt_test_bin());
    proc p;
    RUN_OK(&p, "tokenize", "--model", spm, "--text", "hi");
    bool eq = !strcmp(p.out, "1 7251\n");
    if (!eq) show(&p);
    proc_free(&p);
    CHECK(eq);
    const char *text = "\xc3\x9cn\xc3\xaf" "c\xc3\xb6" "d\xc3\xa9 w\xc3\xb6rds";
    RUN_OK(&p, "tokenize", "--model", ds, "--text", text, "--no-bos");
    long ids[64];
    size_t n = 0;
    bool parsed = parse_ids(p.out, ids, 64, &n);
    size_t n_o = 0, n_7962 = 0;
    for (size_t i = 0; parsed && i < n; i++) n_o += ids[i] == 100003, n_7962 += ids[i] == 7962;
    char idlist[512];
    snprintf(idlist, sizeof idlist, "%s", p.out);
    idlist[strcspn(idlist, "\n")] = 0;
    if (n_o != 2) show(&p);
    proc_free(&p);
    CHECK(parsed);
    CHECKF(n_o == 2 && n_7962 == 0, "want the user-defined token 100003 for both 'ö'");
    RUN_OK(&p, "detokenize", "--model", ds, "--ids", idlist);
    eq = !strcmp(p.out, text);
    if (!eq) show(&p);
    proc_free(&p);
    CHECKF(eq, "detokenize(tokenize(x)) != x");
    /* A control token's text is text unless --special is given. */
    const char *bos = "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
    RUN_OK(&p, "tokenize", "--model", ds, "--text", bos, "--no-bos");
    bool plain = strcmp(p.out, "100000\n") && !strstr(p.out, "100000");
    proc_free(&p);
    RUN_OK(&p, "tokenize", "--model", ds, "--text", bos, "--no-bos", "--special");
    bool special = !strcmp(p.out, "100000\n");
    proc_free(&p);
    CHECK(plain && special);
    /* A leading BOS is not text; ids outside the vocabulary or not numbers are refused. */
    RUN_OK(&p, "detokenize", "--model", "ds4-tiny", "--ids", "256 104,105");
    eq = !strcmp(p.out, "hi");
    proc_free(&p);
    CHECK(eq);
    CHECK(refused((const char *const[]){"detokenize", "--model", ds, "--ids", "1 x", NULL}, 2));
    CHECK(refused((const char *const[]){"detokenize", "--model", ds, "--ids", "-1", NULL}, 2));
    CHECK(refused((const char *const[]){"detokenize", "--model", ds, "--ids", "99999999", NULL}, 1));
    CHECK(refused((const char *const[]){"detokenize", "--model", ds, NULL}, 2));
    /* A vocabulary file is not a model to run. */
    CHECK(refused((const char *const[]){"run", "--model", ds, "--prompt", "hi", NULL}, 1));
}

TEST(cli_info)
{
    const char *model = kvt_test_shared(STORIES);
    if (!model || !have_bin()) SKIP("../shared or %s absent", kvt_test_bin());
    proc p;
    RUN_OK(&p, "info", "--model", model);
    const char *arch = line_of(p.out, "architecture"), *voc = line_of(p.out, "vocabulary");
    bool ok = arch && voc && strstr(arch, "llama") && strstr(voc, "512");
    if (!ok) show(&p);
    proc_free(&p);
    CHECKF(ok, "info does not report a llama model with 512 tokens");
    RUN_OK(&p, "info");
    arch = line_of(p.out, "architecture");
    const char *name = line_of(p.out, "name");
    ok = arch && name && strstr(arch, "deepseek4") && strstr(name, KVT_DEFAULT_MODEL);
    if (!ok) show(&p);
    proc_free(&p);
    CHECKF(ok, "info without --model does not describe " KVT_DEFAULT_MODEL);
}

TEST(cli_plan)
{
    if (!have_bin()) SKIP("%s absent", kvt_test_bin());
    proc p;
    /* 2 (K, V) x 80 layers x 8 heads x 128 dims x 2 bytes x 32768 tokens */
    RUN_OK(&p, "plan", "--ctx", "32768", "--layers", "80", "--kv-heads", "8", "--head-dim", "128");
    const char *total = line_of(p.out, "total");
    bool ok = total && strstr(total, "10737418240");
    if (!ok) show(&p);
    proc_free(&p);
    CHECK(ok);
    /* ds4-mini: 3 x (128 + 64)/4 x 2 B + 3 x 128/128 x 2 B = 294 B per token */
    RUN_OK(&p, "plan", "--preset", "ds4-mini", "--ctx", "1000");
    const char *per = line_of(p.out, "per token");
    ok = per && strstr(per, "294.000");
    if (!ok) show(&p);
    proc_free(&p);
    CHECK(ok);
    /* a bare shape needs all three dimensions */
    RUN(&p, "plan", "--ctx", "100", "--layers", "2");
    ok = p.status == 2 && p.err[0];
    proc_free(&p);
    CHECK(ok);
}

static bool same_out(const proc *a, const proc *b) { return !strcmp(a->out, b->out); }

TEST(cli_model_new_matches_preset)
{
    if (!have_bin()) SKIP("%s absent", kvt_test_bin());
    char m1[64], m3[64], txt[64];
    static const char text[] = "Once upon a time there was a cache that never forgot a token.";
    CHECK(temp_file(m1, "", 0));
    if (!temp_file(m3, "", 0)) { unlink(m1); CHECK(false); }
    if (!temp_file(txt, text, sizeof text - 1)) { unlink(m1); unlink(m3); CHECK(false); }
    proc w1 = {0}, w3 = {0}, a = {0}, b = {0}, c = {0}, pa = {0}, pb = {0}, pc = {0}, sa = {0}, sc = {0};
    const char *const w1a[] = {"model", "new", "--preset", "ds4-tiny", "--seed", "1", "--out", m1, NULL};
    const char *const w3a[] = {"model", "new", "--preset", "ds4-tiny", "--seed", "3", "--out", m3, NULL};
    bool ran = run_cli(&w1, w1a) && run_cli(&w3, w3a);
    /* KVT_DEFAULT_SEED is 1: `--model ds4-tiny` is seed 1's weights in memory. */
    const char *const ra[] = {"run", "--model", "ds4-tiny", "--prompt", "hi", "--output", "ids", "--max-tokens", "8", NULL};
    const char *const rb[] = {"run", "--model", m1, "--prompt", "hi", "--output", "ids", "--max-tokens", "8", NULL};
    const char *const rc[] = {"run", "--model", m3, "--prompt", "hi", "--output", "ids", "--max-tokens", "8", NULL};
    const char *const qa[] = {"perplexity", "--model", "ds4-tiny", "--file", txt, NULL};
    const char *const qb[] = {"perplexity", "--model", m1, "--file", txt, NULL};
    const char *const qc[] = {"perplexity", "--model", m3, "--file", txt, NULL};
    const char *const ta[] = {"run", "--model", m1, "--prompt", "Once upon a time", "--output", "ids",
                              "--max-tokens", "16", "--temperature", "1", "--seed", "5", NULL};
    const char *const tc[] = {"run", "--model", m3, "--prompt", "Once upon a time", "--output", "ids",
                              "--max-tokens", "16", "--temperature", "1", "--seed", "5", NULL};
    ran = ran && run_cli(&a, ra) && run_cli(&b, rb) && run_cli(&c, rc) && run_cli(&pa, qa) &&
          run_cli(&pb, qb) && run_cli(&pc, qc) && run_cli(&sa, ta) && run_cli(&sc, tc);
    unlink(m1);
    unlink(m3);
    unlink(txt);
    proc *all[] = {&w1, &w3, &a, &b, &c, &pa, &pb, &pc, &sa, &sc};
    bool ok = ran;
    for (size_t i = 0; ok && i < sizeof all / sizeof *all; i++)
        if (!clean(all[i]) || all[i]->status != 0) { show(all[i]); ok = false; }
    size_t n = 0;
    long ids[16];
    bool eight = ok && parse_ids(a.out, ids, 16, &n) && n == 8;
    bool wrote = ok && strstr(w1.out, "seed 1") && strstr(w3.out, "seed 3");
    bool same_ids = ok && same_out(&a, &b), same_ppl = ok && same_out(&pa, &pb);
    bool other_ppl = ok && !same_out(&pa, &pc), other_sampled = ok && !same_out(&sa, &sc);
    if (ok && !(same_ids && same_ppl && other_ppl && other_sampled)) {
        printf("    ds4-tiny: %s    seed 1:   %s    seed 3:   %s", a.out, b.out, c.out);
        printf("    perplexity ds4-tiny: %s    seed 1: %s    seed 3: %s", pa.out, pb.out, pc.out);
        printf("    sampled seed 1: %s    sampled seed 3: %s", sa.out, sc.out);
    }
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) proc_free(all[i]);
    CHECKF(ran, "could not run %s", kvt_test_bin());
    CHECK(ok);
    CHECK(eight);
    CHECK(wrote);
    CHECKF(same_ids, "the GGUF written with --seed 1 generates other ids than --model ds4-tiny");
    CHECKF(same_ppl, "the GGUF written with --seed 1 scores text differently from --model ds4-tiny");
    /* Negative controls: another seed is another model. */
    CHECKF(other_ppl, "--seed 3 scores text exactly like --seed 1");
    CHECKF(other_sampled, "--seed 3 samples exactly like --seed 1");
}

/* `model new --type`: the preset written tensor by tensor from its seed.
 * As f32 it is the in-memory writer's file byte for byte; as f16 and q8_0
 * the same model stored coarser (perplexity within 0.3% of the f32 file's
 * on synthetic weights); a preset too large for memory (ds4-flash-bench) is
 * refused by run with the command that writes it. Negative controls:
 * another seed is another file; main's binary has no --type. */
TEST(cli_model_new_streamed)
{
    if (!have_bin()) SKIP("%s absent", kvt_test_bin());
    static const char text[] = "Once upon a time there was a cache that never forgot a token.";
    char mem[64], f[3][64], other[64], txt[64];
    static const char *const types[3] = {"f32", "f16", "q8_0"};
    bool made = temp_file(mem, "", 0) && temp_file(other, "", 0) && temp_file(txt, text, sizeof text - 1);
    for (int i = 0; i < 3; i++) made = made && temp_file(f[i], "", 0);
    CHECK(made);
    const char *preset = "ds4-tiny+D=128,Fe=64";
    proc w = {0}, ws[3] = {{0}}, wo = {0}, pp[3] = {{0}}, big = {0};
    const char *const wa[] = {"model", "new", "--preset", preset, "--seed", "7", "--out", mem, NULL};
    const char *const oa[] = {"model", "new", "--preset", preset, "--seed", "8", "--type", "f32", "--out", other, NULL};
    const char *const ba[] = {"run", "--model", "ds4-flash-bench", "--prompt", "hi", NULL};
    bool ran = run_cli(&w, wa) && run_cli(&wo, oa) && run_cli(&big, ba);
    for (int i = 0; i < 3 && ran; i++) {
        const char *const sa[] = {"model", "new", "--preset", preset, "--seed", "7", "--type", types[i], "--out", f[i], NULL};
        const char *const qa[] = {"perplexity", "--model", f[i], "--file", txt, NULL};
        ran = run_cli(&ws[i], sa) && run_cli(&pp[i], qa);
    }
    bool ok = ran && clean(&w) && w.status == 0 && clean(&wo) && wo.status == 0;
    for (int i = 0; ok && i < 3; i++)
        if (!clean(&ws[i]) || ws[i].status != 0 || !clean(&pp[i]) || pp[i].status != 0) { show(&ws[i]); show(&pp[i]); ok = false; }
    if (!ok) { show(&w); show(&wo); }
    /* the files' bytes */
    size_t n[3] = {0}, nm = 0, no = 0;
    char *b[3] = {NULL}, *bm = ok ? kvt_test_read_file(mem, &nm) : NULL, *bo = ok ? kvt_test_read_file(other, &no) : NULL;
    for (int i = 0; ok && i < 3; i++) b[i] = kvt_test_read_file(f[i], &n[i]);
    bool same = ok && bm && b[0] && nm == n[0] && !memcmp(bm, b[0], nm);
    bool differs = ok && bo && b[0] && (no != n[0] || memcmp(bo, b[0], no));
    bool smaller = ok && b[1] && b[2] && n[2] < n[1] && n[1] < n[0];
    double ppl[3] = {0};
    for (int i = 0; ok && i < 3; i++) {
        const char *q = strstr(pp[i].out, "perplexity ");
        ppl[i] = q ? atof(q + 11) : 0;
    }
    bool close = ok && ppl[0] > 1 && fabs(ppl[1] / ppl[0] - 1) < 3e-3 && fabs(ppl[2] / ppl[0] - 1) < 3e-3;
    printf("    %s: f32 %zu B (in memory %zu B), f16 %zu B, q8_0 %zu B; perplexity %.4f, %.4f, %.4f\n", preset, n[0],
           nm, n[1], n[2], ppl[0], ppl[1], ppl[2]);
    bool refused = ran && big.status != 0 && big.err && strstr(big.err, "model new --preset ds4-flash-bench --type q8_0");
    if (ran && !refused) show(&big);
    free(bm);
    free(bo);
    for (int i = 0; i < 3; i++) { free(b[i]); unlink(f[i]); proc_free(&ws[i]); proc_free(&pp[i]); }
    unlink(mem);
    unlink(other);
    unlink(txt);
    proc_free(&w);
    proc_free(&wo);
    proc_free(&big);
    CHECKF(ran, "could not run %s", kvt_test_bin());
    CHECK(ok);
    CHECKF(same, "--type f32 wrote %zu B, the in-memory writer %zu B, or other bytes", n[0], nm);
    CHECKF(differs, "--seed 8 wrote the same file as --seed 7");
    CHECK(smaller);
    CHECKF(close, "perplexity f32 %.4f, f16 %.4f, q8_0 %.4f", ppl[0], ppl[1], ppl[2]);
    CHECK(refused);
}

TEST(cli_perplexity_stories)
{
    const char *model = kvt_test_shared(STORIES);
    if (!model || !have_bin()) SKIP("../shared or %s absent", kvt_test_bin());
    char path[64];
    static const char text[] = "Once upon a time, there was a little girl named Lily. She loved to play outside.\n";
    CHECK(temp_file(path, text, sizeof text - 1));
    proc p;
    const char *const args[] = {"perplexity", "--model", model, "--file", path, NULL};
    bool ran = run_cli(&p, args);
    unlink(path);
    CHECKF(ran, "could not run %s", kvt_test_bin());
    if (!clean(&p) || p.status != 0) show(&p);
    bool ok = clean(&p) && p.status == 0;
    const char *at = ok ? strstr(p.out, "perplexity ") : NULL, *tk = ok ? strstr(p.out, "tokens ") : NULL;
    double ppl = at ? strtod(at + 11, NULL) : NAN;
    long ntok = tk ? strtol(tk + 7, NULL, 10) : 0;
    if (ok && !(isfinite(ppl) && ppl >= 1 && ntok > 0)) show(&p);
    proc_free(&p);
    CHECK(ok);
    CHECKF(isfinite(ppl) && ppl >= 1, "perplexity %g", ppl);
    CHECKF(ntok > 0, "scored %ld tokens", ntok);
}

/* Expect a refusal: status want (1 runtime, 2 arguments), a message on stderr,
 * nothing on stdout. */
static bool refused(const char *const *args, int want)
{
    proc p;
    if (!run_cli(&p, args)) { printf("    could not run %s\n", kvt_test_bin()); return false; }
    bool ok = clean(&p) && p.status == want && strstr(p.err, "kvtier") && !p.out[0];
    if (!ok) {
        printf("    %s %s ...: want exit %d with a message\n", kvt_test_bin(), args[0], want);
        show(&p);
    }
    proc_free(&p);
    return ok;
}

/* `kvtier cache` takes the budget flags (gc enforces them) and its help
 * lists them: on a full disk, gc with a smaller budget is the way out. */
TEST(cli_cache_budget_flags)
{
    if (!have_bin()) SKIP("%s absent", kvt_test_bin());
    char dir[] = "/tmp/kvtier-cli-budget-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir));
    proc p;
    const char *const gc[] = {"cache", "gc", "--kv-disk-dir", dir, "--kv-disk-mb", "2", "--kv-disk-min-free-mb", "0", NULL};
    CHECK(run_cli(&p, gc));
    bool ok = clean(&p) && p.status == 0 && strstr(p.out, "of 2097152 budget");
    if (!ok) show(&p);
    proc_free(&p);
    CHECKF(ok, "cache gc --kv-disk-mb 2 --kv-disk-min-free-mb 0");
    const char *const bad[] = {"cache", "stats", "--kv-disk-dir", dir, "--kv-disk-min-free-mb", "x", NULL};
    CHECK(run_cli(&p, bad));
    ok = p.status == 2 && strstr(p.err, "--kv-disk-min-free-mb");
    if (!ok) show(&p);
    proc_free(&p);
    CHECKF(ok, "cache stats --kv-disk-min-free-mb x: not refused");
    const char *const help[] = {"cache", "bogus", NULL};
    CHECK(run_cli(&p, help));
    ok = p.status == 2 && strstr(p.err, "--kv-disk-mb") && strstr(p.err, "--kv-disk-min-free-mb");
    if (!ok) show(&p);
    proc_free(&p);
    CHECKF(ok, "the cache usage line does not list the budget flags");
    RUN_OK(&p, "--help");
    ok = strstr(p.out, "--kv-disk-min-free-mb") != NULL;
    proc_free(&p);
    CHECKF(ok, "--help does not list --kv-disk-min-free-mb");
    rm_tree(dir);
}

TEST(cli_bad_input)
{
    if (!have_bin()) SKIP("%s absent", kvt_test_bin());
    const char *model = kvt_test_shared(STORIES);
    char mpath[4096] = "build/kvtier-no-such-model.gguf";
    if (model) snprintf(mpath, sizeof mpath, "%s", model);
    /* 100 bytes of noise, and a real GGUF cut short, given as --model */
    uint8_t noise[100];
    uint64_t st = kvt_test_seed("cli_bad_input");
    for (size_t i = 0; i < sizeof noise; i++) noise[i] = (uint8_t)kvt_test_rand(&st);
    noise[0] = 'X'; /* never the GGUF magic */
    char garbage[64], cut[64];
    CHECK(temp_file(garbage, noise, sizeof noise));
    size_t glen = 0;
    char *gguf = model ? kvt_test_read_file(model, &glen) : NULL;
    bool have_cut = gguf && glen > 4096 && temp_file(cut, gguf, 4096);
    free(gguf);
    char missing[80];
    snprintf(missing, sizeof missing, "%s.missing", garbage);

    struct { const char *args[12]; int want; } cases[] = {
        {{"run", "--prompt", "hi", "--bogus"}, 2},
        {{"run", "--prompt", "hi", "--max-tokens", "-1"}, 2},
        {{"run", "--prompt", "hi", "--max-tokens", "12x"}, 2},
        {{"run", "--prompt", "hi", "--temperature", "abc"}, 2},
        {{"run", "--prompt", "hi", "--temperature", "nan"}, 2},
        {{"run", "--prompt", "hi", "--top-p", "2"}, 2},
        {{"run", "--prompt", "hi", "--output", "xml"}, 2},
        {{"run", "--prompt"}, 2},
        {{"tokenize", "--model", mpath}, 2},
        {{"plan"}, 2},
        {{"model", "new", "--preset", "ds4-tiny"}, 2},
        {{"model", "old"}, 2},
        {{"frobnicate"}, 2},
        {{"run", "--model", missing, "--prompt", "hi"}, 1},
        {{"run", "--model", garbage, "--prompt", "hi"}, 1},
        {{"info", "--model", garbage}, 1},
        {{"tokenize", "--model", garbage, "--text", "hi"}, 1},
        {{"perplexity", "--model", garbage, "--file", garbage}, 1},
        {{"perplexity", "--model", "ds4-tiny", "--file", missing}, 1},
        {{"plan", "--ctx", "10", "--preset", "no-such-preset"}, 1},
        {{"model", "new", "--preset", "no-such-preset", "--out", missing}, 1},
        {{"run", "--model", "ds4-tiny", "--prompt", "hello", "--ctx", "3"}, 1},
        {{"run", "--model", have_cut ? cut : garbage, "--prompt", "hi"}, 1},
        {{"run", "--prompt", "hi", "--kv-cache-align-tokens", "0"}, 2},
        {{"run", "--prompt", "hi", "--kv-cache-continued-interval", "100"}, 2},
        {{"run", "--prompt", "hi", "--kv-disk-mb", "0"}, 2},
        {{"cache", "frob"}, 2},
    };
    bool ok = true;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) ok = refused(cases[i].args, cases[i].want) && ok;
    unlink(garbage);
    if (have_cut) unlink(cut);
    CHECK(ok);
    CHECKF(access(missing, F_OK) != 0, "a failed `model new` left %s behind", missing);
}

TEST(cli_default_model)
{
    if (!have_bin()) SKIP("%s absent", kvt_test_bin());
    proc p;
    RUN_OK(&p, "run", "--prompt", "hi", "--max-tokens", "4", "--output", "ids");
    long ids[8];
    size_t n = 0;
    bool ok = parse_ids(p.out, ids, 8, &n) && n == 4;
    for (size_t i = 0; ok && i < n; i++) ok = ids[i] >= 0 && ids[i] < 271; /* the byte tokenizer */
    if (!ok) show(&p);
    proc_free(&p);
    CHECKF(ok, "expected 4 ids of the built-in byte vocabulary");
}

TEST(cli_usage)
{
    if (!have_bin()) SKIP("%s absent", kvt_test_bin());
    proc p;
    RUN_OK(&p, "--help");
    static const char *const cmds[] = {"run", "tokenize", "info", "perplexity", "model new", "plan"};
    bool ok = true;
    for (size_t i = 0; i < sizeof cmds / sizeof *cmds; i++) ok = ok && strstr(p.out, cmds[i]);
    proc_free(&p);
    CHECKF(ok, "--help does not list every command");
    /* no command at all: usage on stderr, status 2 */
    const char *const none[] = {NULL};
    CHECK(run_cli(&p, none));
    ok = clean(&p) && p.status == 2 && strstr(p.err, "usage") && !p.out[0];
    if (!ok) show(&p);
    proc_free(&p);
    CHECK(ok);
}

/* --version prints "kvtier " and the KVT_VERSION the library was built
 * with, on stdout, and exits 0 (a binary without the flag: "unknown
 * command", status 2). */
TEST(cli_version)
{
    if (!have_bin()) SKIP("%s absent", kvt_test_bin());
    proc p;
    RUN_OK(&p, "--version");
    bool ok = !strcmp(p.out, "kvtier " KVT_VERSION "\n");
    if (!ok) show(&p);
    proc_free(&p);
    CHECKF(ok, "--version does not print \"kvtier %s\"", KVT_VERSION);
}

TEST(cli_disk_cache_round_trip)
{
    if (!have_bin()) SKIP("%s absent", kvt_test_bin());
    char dir[] = "/tmp/kvtier-cli-disk-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir));
    char prompt[400] = "";
    for (int i = 0; i < 7; i++) strcat(prompt, "The quick brown fox jumps over the lazy dog. ");
    /* 316 tokens with BOS: a cold save at 256 with a 128-token grid. */
#define DISK "--kv-disk-dir", dir, "--kv-cache-min-tokens", "128", "--kv-cache-align-tokens", "128", \
             "--kv-cache-continued-interval", "0"
/* seed 6: twelve tokens before any EOS under the draws per position (seed 5
 * drew EOS at the seventh) */
#define GEN "--model", "ds4-tiny", "--prompt", prompt, "--output", "ids", "--max-tokens", "12", \
            "--temperature", "1", "--seed", "6"
    const char *const a1[] = {"run", GEN, DISK, NULL};
    const char *const a3[] = {"run", GEN, "--no-kv-disk", NULL};
    const char *const av[] = {"cache", "verify", "--kv-disk-dir", dir, NULL};
    const char *const al[] = {"cache", "ls", "--kv-disk-dir", dir, NULL};
#undef DISK
#undef GEN
    proc cold = {0}, warm = {0}, off = {0}, ver = {0}, ls = {0};
    bool ran = run_cli(&cold, a1) && run_cli(&warm, a1) && run_cli(&off, a3) && run_cli(&ver, av) &&
               run_cli(&ls, al);
    rm_tree(dir);
    proc *all[] = {&cold, &warm, &off, &ver, &ls};
    bool ok = ran;
    for (size_t i = 0; ok && i < sizeof all / sizeof *all; i++)
        if (!clean(all[i]) || all[i]->status != 0) { show(all[i]); ok = false; }
    long ids[16];
    size_t n = 0;
    bool twelve = ok && parse_ids(cold.out, ids, 16, &n) && n == 12;
    bool cold_miss = ok && strstr(cold.err, " 0 from the disk cache");
    bool warm_hit = ok && strstr(warm.err, " 256 from the disk cache");
    bool same = ok && same_out(&cold, &warm) && same_out(&cold, &off);
    bool verified = ok && strstr(ver.out, " 0 damaged");
    bool listed = ok && strstr(ls.out, " 256 ");
    if (ok && !(twelve && cold_miss && warm_hit && same && verified && listed))
        for (size_t i = 0; i < sizeof all / sizeof *all; i++) show(all[i]);
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) proc_free(all[i]);
    CHECKF(ran, "could not run %s", kvt_test_bin());
    CHECK(ok);
    CHECK(twelve);
    CHECKF(cold_miss, "the first run found something in an empty disk cache");
    CHECKF(warm_hit, "the second run did not restore the 256-token prefix from disk");
    CHECKF(same, "a prompt restored from disk (or run without it) generates other ids");
    CHECK(verified);
    CHECK(listed);
}

/* ---- the main job: `make run` ---- */

/* The arguments of the Makefile's `run` target (its recipe `./$(BIN) ARGS`),
 * split at blanks into buf; false when the target is not found. */
static bool make_run_args(char *buf, size_t cap, const char **args, size_t max)
{
    char *mk = kvt_test_read_file("Makefile", NULL);
    const char *r = mk ? strstr(mk, "\nrun: $(BIN)\n\t./$(BIN) ") : NULL;
    bool ok = r != NULL;
    if (ok) {
        r += strlen("\nrun: $(BIN)\n\t./$(BIN) ");
        snprintf(buf, cap, "%.*s", (int)strcspn(r, "\n"), r);
        size_t n = 0;
        for (char *sp = NULL, *w = strtok_r(buf, " ", &sp); w && n + 1 < max; w = strtok_r(NULL, " ", &sp))
            args[n++] = w;
        args[n] = NULL;
        ok = n > 0;
    }
    free(mk);
    return ok;
}

/* A row of the demonstration's table: the label, then prompt tokens,
 * tokens reused, the tier they came from, tokens prefilled and the time to
 * the first token in seconds. */
typedef struct demo_row { size_t prompt, reused, prefilled; char tier[8]; double ttft; bool found; } demo_row;

static demo_row demo_row_of(const char *out, const char *label)
{
    demo_row r = {0};
    const char *l = line_of(out, label);
    if (l && strlen(l) > 26)
        r.found = sscanf(l + 26, "%zu %zu %7s %zu %lf", &r.prompt, &r.reused, r.tier, &r.prefilled, &r.ttft) == 5;
    return r;
}

/* `make run` shows the cache at work: a prompt of thousands of tokens
 * computed cold, a second turn on the same session reusing all of it from
 * RAM, and the prompt in a new session restored from the disk cache the
 * first turn saved to, each sooner to its first token than the cold turn,
 * the restored reply equal to the cold one; the synthetic weights said so,
 * and no reply printed (they are not language). */
TEST(cli_main_job_shows_reuse)
{
    if (!have_bin() || access("Makefile", R_OK)) SKIP("%s absent, or not run from the repository root", kvt_test_bin());
    char buf[512];
    const char *args[32];
    CHECKF(make_run_args(buf, sizeof buf, args, 32), "no `run: $(BIN)` target running ./$(BIN) in the Makefile");
    proc p;
    CHECKF(run_cli(&p, args), "could not run %s", kvt_test_bin());
    if (!clean(&p) || p.status != 0) show(&p);
    CHECKF(clean(&p) && p.status == 0, "`make run` exited with status %d", p.status);
    demo_row cold = demo_row_of(p.out, "turn 1, cold"), ram = demo_row_of(p.out, "turn 2, same session"),
             disk = demo_row_of(p.out, "turn 1 in a new session");
    bool rows = cold.found && ram.found && disk.found;
    bool is_cold = rows && cold.reused == 0 && cold.prefilled == cold.prompt && cold.prompt >= 2000;
    bool from_ram = rows && !strcmp(ram.tier, "RAM") && ram.reused >= cold.prompt && ram.reused < ram.prompt &&
                    ram.reused + ram.prefilled == ram.prompt;
    bool from_disk = rows && !strcmp(disk.tier, "disk") && disk.prompt == cold.prompt && disk.reused >= 2048 &&
                     disk.reused + disk.prefilled == disk.prompt;
    /* the hits prefill 1% and 3% of the cold turn's tokens: half its time is a wide margin */
    bool sooner = rows && ram.ttft < cold.ttft / 2 && disk.ttft < cold.ttft / 2;
    bool same = strstr(p.out, "the new session's reply equals turn 1's, token for token") != NULL;
    bool synthetic = strstr(p.out, "weights are synthetic") != NULL, quiet = !strstr(p.out, "reply:");
    bool ok = rows && is_cold && from_ram && from_disk && sooner && same && synthetic && quiet;
    if (!ok) show(&p);
    else
        printf("    %zu tokens: cold %.3f s; RAM %zu reused, %.3f s; disk %zu reused, %.3f s\n", cold.prompt, cold.ttft,
               ram.reused, ram.ttft, disk.reused, disk.ttft);
    proc_free(&p);
    CHECKF(rows, "`make run` did not print the cold, RAM and disk rows");
    CHECKF(is_cold, "the first turn was not a cold prefill of thousands of tokens");
    CHECKF(from_ram, "the second turn did not reuse the first from RAM");
    CHECKF(from_disk, "the new session did not restore the prompt from disk");
    CHECKF(sooner, "a hit was not sooner to its first token than half the cold turn's time");
    CHECKF(same, "the reply from disk does not equal the cold one");
    CHECKF(synthetic && quiet, "the synthetic weights are not said, or a reply was printed unasked");
}

/* "prompt N tokens: D from the disk cache, P prefilled" of a run's stderr. */
static bool run_figures(const proc *p, size_t *n, size_t *from_disk, size_t *prefilled)
{
    const char *s = p->err ? strstr(p->err, "kvtier: prompt ") : NULL;
    return s && sscanf(s, "kvtier: prompt %zu tokens: %zu from the disk cache, %zu prefilled", n, from_disk,
                       prefilled) == 3;
}

/* Run a 2,822-token prompt (ds4 presets: a token per byte, and BOS) twice
 * on an empty store, with `align` as --kv-cache-align-tokens (NULL: the
 * default): *disk and *pre receive the second run's figures, *same whether
 * it generates the first run's ids. */
static bool restart_runs(const char *align, size_t *disk, size_t *pre, bool *same)
{
    enum { N = 2822 };
    char dir[] = "/tmp/kvtier-cli-restart-XXXXXX";
    if (!kvt_test_mkdtemp(dir)) return false;
    char *prompt = malloc(N);
    if (!prompt) return false;
    for (int i = 0; i < N - 1; i++) prompt[i] = "abcdefghijklmnopqrstuvwxyz 0123456789.,"[(i * 7 + i / 39) % 39];
    prompt[N - 1] = 0;
    const char *const a[] = {"run", "--model", "ds4-tiny", "--prompt", prompt, "--output", "ids", "--max-tokens", "4",
                             "--temperature", "0", "--kv-disk-dir", dir, align ? "--kv-cache-align-tokens" : NULL,
                             align, NULL};
    proc cold = {0}, warm = {0};
    bool ran = run_cli(&cold, a) && run_cli(&warm, a);
    rm_tree(dir);
    free(prompt);
    size_t n[2] = {0}, d0 = 1, p0 = 0;
    bool ok = ran && clean(&cold) && clean(&warm) && cold.status == 0 && warm.status == 0 &&
              run_figures(&cold, &n[0], &d0, &p0) && run_figures(&warm, &n[1], disk, pre) && n[0] == N &&
              n[1] == N && d0 == 0 && p0 == N;
    *same = ok && same_out(&cold, &warm);
    if (!ok || !*same) { show(&cold); show(&warm); }
    else printf("    --kv-cache-align-tokens %s: the second run restored %zu tokens, prefilled %zu\n",
                align ? align : "(default)", *disk, *pre);
    proc_free(&cold);
    proc_free(&warm);
    return ok;
}

/* With the default save policy a second run of a 2,822-token prompt
 * restores all of it from disk but the trim: 2,822 - 32 = 2,790 tokens; 32
 * prefilled again. With --kv-cache-align-tokens 128 the save stays on the
 * block grid: 2,790 down to 2,688, 134 prefilled again (the default of the
 * previous release); 2,048 (the one before) prefilled 774. */
TEST(cli_restart_reprefills_the_trim)
{
    if (!have_bin()) SKIP("%s absent", kvt_test_bin());
    size_t disk = 0, pre = 0;
    bool same = false;
    CHECKF(restart_runs(NULL, &disk, &pre, &same), "the two runs of %s failed", kvt_test_bin());
    CHECKF(disk == 2790 && pre == 32, "the second run: %zu from disk, %zu prefilled (2790, 32 expected: the trim)",
           disk, pre);
    CHECKF(same, "the run restored from disk generates other ids");
    CHECK(restart_runs("128", &disk, &pre, &same));
    CHECKF(disk == 2688 && pre == 134, "--kv-cache-align-tokens 128, the second run: %zu from disk, %zu prefilled "
           "(2688, 134 expected)", disk, pre);
    CHECKF(same, "the run restored from disk generates other ids");
}
