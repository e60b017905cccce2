/* The figures the documentation quotes from a command, checked against the
 * command's output now, so a change to a model or a format cannot leave them
 * stale (the built binary, KVT_BIN; run from the repository root).
 *
 *   docs_quoted_commands  every `$ ./build/kvtier info|plan|tokenize|
 *                         detokenize ...` line in a fenced block of
 *                         README.md, the docs/ pages and bench/README.md is run,
 *                         and the lines quoted after it (up to the next `$ `
 *                         or the fence) must be its output exactly. Those
 *                         four are deterministic and fast; a command whose
 *                         file under ../shared is absent is left out, and
 *                         the test then ends as a skip naming it.
 *   docs_model_figures    figures quoted in prose and tables: ds4-mini's
 *                         parameter count and cache bytes per token in
 *                         README.md, both presets' parameter counts in
 *                         docs/ds4.md, a block record's rows in
 *                         docs/STORE.md, from `info` and `plan`.
 *   docs_bench_quick      the `kvtier bench --quick` table of bench/README.md:
 *                         its ds4-mini header lines, and the deterministic
 *                         columns (B/tok and bytes) of its ds4 and snapshot
 *                         rows, against `bench --quick --suite snapshot
 *                         --reps 1` (one 8192-token prefill: 4 s on 2 idle
 *                         cores) and `plan` at each context. The speeds are
 *                         measurements of their day and are not checked. */
#include "fixture.h"
#include "test.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* Run the binary with args (NULL-terminated); its stdout and stderr,
 * malloc'ed, or NULL when it did not exit 0 within timeout seconds. */
static char *run_bin(const char *const *args, double timeout)
{
    const char *argv[40] = {kvt_test_bin()};
    size_t n = 1;
    for (; args[n - 1] && n + 1 < sizeof argv / sizeof *argv; n++) argv[n] = args[n - 1];
    argv[n] = NULL;
    char out[] = "/tmp/kvtier-docs-XXXXXX";
    int fd = mkstemp(out), st = 0;
    if (fd < 0) return NULL;
    close(fd);
    int rc = fx_run(argv, out, timeout, &st);
    char *text = kvt_test_read_file(out, NULL);
    unlink(out);
    if (rc != 1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        if (text) printf("    %s %s: exit status %d: %.400s\n", kvt_test_bin(), args[0], st, text);
        free(text);
        return NULL;
    }
    return text;
}

/* A value printed by `plan` on the line starting with key ("per token",
 * "total"); -1 when absent. */
static double plan_value(const char *plan, const char *key)
{
    for (const char *l = plan; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
        if (!strncmp(l, key, strlen(key)) && l[strlen(key)] == ' ') return strtod(l + strlen(key), NULL);
    return -1;
}

static bool doc_has(const char *doc, const char *file, const char *want)
{
    if (doc && strstr(doc, want)) return true;
    printf("    %s does not say \"%s\"\n", file, want);
    return false;
}

/* ---- commands quoted with their output ---- */

/* Shell words of a simple command line into w (pointers into buf): plain
 * words and '...' or "..." quoted ones; false for anything the shell would
 * expand or redirect. */
static bool shell_words(const char *line, char *buf, size_t cap, char **w, size_t max, size_t *nw)
{
    if (strpbrk(line, "$`|<>;&~\\*?")) return false;
    size_t o = 0;
    *nw = 0;
    for (const char *p = line; *p;) {
        while (*p == ' ') p++;
        if (!*p) break;
        if (*nw == max) return false;
        w[(*nw)++] = buf + o;
        while (*p && *p != ' ') {
            if (*p == '"' || *p == '\'') {
                char q = *p++;
                while (*p && *p != q) { if (o + 1 >= cap) return false; buf[o++] = *p++; }
                if (*p != q) return false;
                p++;
            } else {
                if (o + 1 >= cap) return false;
                buf[o++] = *p++;
            }
        }
        if (o + 1 >= cap) return false;
        buf[o++] = 0;
    }
    return *nw > 0;
}

/* s without trailing blanks, as a new string */
static char *rtrim_dup(const char *s, size_t n)
{
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\n')) n--;
    char *r = malloc(n + 1);
    if (r) { memcpy(r, s, n); r[n] = 0; }
    return r;
}

/* Every line of text with its trailing blanks removed, and trailing empty
 * lines dropped. */
static char *norm_lines(const char *text)
{
    size_t n = strlen(text), o = 0;
    char *r = malloc(n + 1);
    if (!r) return NULL;
    for (const char *l = text; *l;) {
        const char *e = strchr(l, '\n');
        size_t len = e ? (size_t)(e - l) : strlen(l);
        while (len && (l[len - 1] == ' ' || l[len - 1] == '\t')) len--;
        memcpy(r + o, l, len);
        o += len;
        r[o++] = '\n';
        l = e ? e + 1 : l + strlen(l);
    }
    while (o && r[o - 1] == '\n') o--;
    r[o] = 0;
    return r;
}

static const char *const DOCS[] = {"README.md", "bench/README.md", "docs/API.md", "docs/STORE.md",
                                   "docs/FORMAT.md", "docs/ds4.md", "docs/CLIENTS.md"};

TEST(docs_quoted_commands)
{
    if (access("README.md", R_OK) || access(kvt_test_bin(), X_OK))
        SKIP("not run from the repository root, or %s absent", kvt_test_bin());
    int checked = 0, differ = 0, left_out = 0;
    char missing[512] = "";
    for (size_t d = 0; d < sizeof DOCS / sizeof *DOCS; d++) {
        char *doc = kvt_test_read_file(DOCS[d], NULL);
        if (!doc) continue;
        bool fenced = false;
        int line_no = 0;
        for (char *l = doc; *l;) {
            char *e = strchr(l, '\n');
            size_t len = e ? (size_t)(e - l) : strlen(l);
            line_no++;
            char *next = e ? e + 1 : l + len;
            if (!strncmp(l, "```", 3)) { fenced = !fenced; l = next; continue; }
            const char *cmd = NULL;
            if (fenced && !strncmp(l, "$ ./build/kvtier ", 17)) cmd = l + 17;
            else if (fenced && !strncmp(l, "$ kvtier ", 9)) cmd = l + 9;
            char *line = cmd ? rtrim_dup(cmd, len - (size_t)(cmd - l)) : NULL;
            char buf[1024], *w[32];
            size_t nw = 0;
            bool simple = line && shell_words(line, buf, sizeof buf, w, 31, &nw) &&
                          (!strcmp(w[0], "info") || !strcmp(w[0], "plan") || !strcmp(w[0], "tokenize") ||
                           !strcmp(w[0], "detokenize"));
            if (!simple) { free(line); l = next; continue; }
            /* the quoted output: up to the next command or the fence */
            char *q = next, *qe = next;
            while (*qe && strncmp(qe, "$ ", 2) && strncmp(qe, "```", 3)) {
                char *x = strchr(qe, '\n');
                qe = x ? x + 1 : qe + strlen(qe);
            }
            char *want = rtrim_dup(q, (size_t)(qe - q));
            /* a file under ../shared it names must be there */
            bool have = true;
            for (size_t i = 1; i < nw; i++)
                if (!strncmp(w[i], "../shared/", 10) && !kvt_test_shared(w[i] + 10)) have = false;
            if (!have) {
                left_out++;
                size_t o = strlen(missing);
                snprintf(missing + o, sizeof missing - o, "%s%s:%d", o ? ", " : "", DOCS[d], line_no);
            } else {
                /* ../shared/X as the tests find it ($KVT_SHARED) */
                for (size_t i = 1; i < nw; i++)
                    if (!strncmp(w[i], "../shared/", 10)) w[i] = (char *)kvt_test_shared(w[i] + 10);
                w[nw] = NULL;
                char *out = run_bin((const char *const *)w, 60);
                char *got = out ? norm_lines(out) : NULL, *exp = want ? norm_lines(want) : NULL;
                checked++;
                if (!got || !exp || strcmp(got, exp)) {
                    differ++;
                    printf("    %s:%d: `kvtier %s` prints\n%s\n    the document quotes\n%s\n", DOCS[d], line_no, line,
                           got ? got : "(failed)", exp ? exp : "");
                }
                free(out);
                free(got);
                free(exp);
            }
            free(want);
            free(line);
            l = next;
        }
        free(doc);
    }
    printf("    %d quoted commands run, %d differ from their output\n", checked, differ);
    CHECKF(differ == 0, "%d quoted outputs are stale (see above)", differ);
    CHECKF(checked >= 4, "only %d quoted commands found: the documents' layout changed?", checked);
    if (left_out) kvt_test_skip("%d quoted commands left out, their ../shared files absent: %s", left_out, missing);
}

/* ---- figures in prose and tables ---- */

/* `info`'s parameter count of a preset; 0 on failure */
static long preset_params(const char *preset)
{
    const char *const args[] = {"info", "--model", preset, NULL};
    char *out = run_bin(args, 60);
    const char *p = out ? strstr(out, "\nparameters ") : NULL;
    long n = p ? strtol(p + 12, NULL, 10) : 0;
    free(out);
    return n;
}

TEST(docs_model_figures)
{
    if (access("README.md", R_OK) || access(kvt_test_bin(), X_OK))
        SKIP("not run from the repository root, or %s absent", kvt_test_bin());
    long mini = preset_params("ds4-mini"), tiny = preset_params("ds4-tiny");
    const char *const pa[] = {"plan", "--preset", "ds4-mini", "--ctx", "131072", NULL};
    char *plan = run_bin(pa, 60);
    double bpt = plan ? plan_value(plan, "per token") : -1;
    free(plan);
    CHECKF(mini > 0 && tiny > 0 && bpt > 0, "info or plan failed (see above)");
    char *readme = kvt_test_read_file("README.md", NULL), *ds4 = kvt_test_read_file("docs/ds4.md", NULL),
         *store = kvt_test_read_file("docs/STORE.md", NULL);
    char want[256];
    bool ok = true;
    snprintf(want, sizeof want, "ds4-mini (DeepSeek-V4 shape, %.1fM parameters)", mini / 1e6);
    ok &= doc_has(readme, "README.md", want);
    snprintf(want, sizeof want, "| ds4-mini cache per token | %.0f B (plan) |", bpt);
    ok &= doc_has(readme, "README.md", want);
    snprintf(want, sizeof want, "| parameters (byte tokenizer) | %ld | %ld |", tiny, mini);
    ok &= doc_has(ds4, "docs/ds4.md", want);
    /* a block record carries 128 tokens' compressed and indexer rows */
    long block = (long)(bpt * 128 + 0.5);
    snprintf(want, sizeof want, "ds4-mini %ld,%03ld bytes of compressed and indexer rows, i.e. %.0f B per token",
             block / 1000, block % 1000, bpt);
    ok &= doc_has(store, "docs/STORE.md", want);
    printf("    ds4-mini: %ld parameters, %.1f B per token; ds4-tiny: %ld parameters\n", mini, bpt, tiny);
    free(readme);
    free(ds4);
    free(store);
    CHECKF(ok, "the documents quote stale figures (see above)");
}

/* ---- bench/README.md's --quick table ---- */

typedef struct brow {
    char suite[16], test[48], bpt[24], bytes[24];
    long ctx;
} brow;

/* The rows of a bench table in text (lines "suite test... ctx tokens thr
 * seconds tok/s ratio... B/tok bytes RSS"), of the ds4 and snapshot suites. */
static size_t bench_rows(const char *text, brow *r, size_t cap)
{
    size_t n = 0;
    for (const char *l = text; l && *l && n < cap; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        if (strncmp(l, "ds4 ", 4) && strncmp(l, "snapshot ", 9)) continue;
        char line[512], *w[32];
        size_t len = strcspn(l, "\n"), nw = 0;
        if (len >= sizeof line) continue;
        memcpy(line, l, len);
        line[len] = 0;
        for (char *s = NULL, *t = strtok_r(line, " ", &s); t && nw < 32; t = strtok_r(NULL, " ", &s)) w[nw++] = t;
        size_t i = 1;
        while (i < nw && !isdigit((unsigned char)w[i][0])) i++;
        if (nw < 10 || i >= nw) continue;
        brow *b = &r[n++];
        memset(b, 0, sizeof *b);
        snprintf(b->suite, sizeof b->suite, "%s", w[0]);
        for (size_t k = 1; k < i; k++) {
            size_t o = strlen(b->test);
            snprintf(b->test + o, sizeof b->test - o, "%s%s", k > 1 ? " " : "", w[k]);
        }
        b->ctx = strtol(w[i], NULL, 10);
        snprintf(b->bpt, sizeof b->bpt, "%s", w[nw - 3]);
        snprintf(b->bytes, sizeof b->bytes, "%s", w[nw - 2]);
    }
    return n;
}

/* The line of text starting with prefix, copied into out; false if none. */
static bool line_starting(const char *text, const char *prefix, char *out, size_t cap)
{
    for (const char *l = text; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
        if (!strncmp(l, prefix, strlen(prefix))) {
            snprintf(out, cap, "%.*s", (int)strcspn(l, "\n"), l);
            return true;
        }
    return false;
}

TEST(docs_bench_quick)
{
    char *doc = kvt_test_read_file("bench/README.md", NULL);
    if (!doc || access(kvt_test_bin(), X_OK)) {
        free(doc);
        SKIP("not run from the repository root, or %s absent", kvt_test_bin());
    }
    /* the section of the --quick run, up to the next heading */
    char *sec = strstr(doc, "### `kvtier bench --quick`"), *end = sec ? strstr(sec + 4, "\n### ") : NULL;
    if (end) *end = 0;
    const char *const ba[] = {"bench", "--quick", "--suite", "snapshot", "--reps", "1", NULL};
    char *out = sec ? run_bin(ba, 600) : NULL;
    if (!sec || !out) { free(doc); free(out); CHECKF(false, "no --quick section in bench/README.md, or the bench failed"); }
    brow got[8], want[16];
    size_t ng = bench_rows(out, got, 8), nw = bench_rows(sec, want, 16);
    char head[160], dhead[160], dds4[160];
    bool ok = ng == 3 && line_starting(out, "snapshot suite: ", head, sizeof head);
    if (!ok) printf("    the bench printed:\n%s\n", out);
    if (ok && !(line_starting(sec, "snapshot suite: ", dhead, sizeof dhead) && !strcmp(head, dhead))) {
        printf("    bench/README.md: \"%s\"; the bench: \"%s\"\n", line_starting(sec, "snapshot suite: ", dhead, sizeof dhead) ? dhead : "(none)", head);
        ok = false;
    }
    /* the ds4 suite runs the same model */
    if (ok && !(line_starting(sec, "ds4 suite: ", dds4, sizeof dds4) && !strcmp(dds4 + 11, head + 16))) {
        printf("    bench/README.md's ds4 suite: \"%s\"; the model is \"%s\"\n", dds4, head + 16);
        ok = false;
    }
    int rows = 0;
    for (size_t i = 0; ok && i < nw; i++) {
        const brow *w = &want[i];
        char bpt[24] = "", bytes[24] = "";
        if (!strcmp(w->suite, "snapshot")) {
            for (size_t k = 0; k < ng; k++)
                if (!strcmp(got[k].test, w->test) && got[k].ctx == w->ctx) {
                    snprintf(bpt, sizeof bpt, "%s", got[k].bpt);
                    snprintf(bytes, sizeof bytes, "%s", got[k].bytes);
                }
        } else {
            /* ds4 rows: the plan's bytes per token and cache bytes at the context */
            char ctx[24];
            snprintf(ctx, sizeof ctx, "%ld", w->ctx);
            const char *const pa[] = {"plan", "--preset", "ds4-mini", "--ctx", ctx, NULL};
            char *plan = run_bin(pa, 60);
            if (plan) {
                snprintf(bpt, sizeof bpt, "%.1f", plan_value(plan, "per token"));
                snprintf(bytes, sizeof bytes, "%.0f", plan_value(plan, "total"));
            }
            free(plan);
        }
        rows++;
        if (strcmp(bpt, w->bpt) || strcmp(bytes, w->bytes)) {
            printf("    bench/README.md: %s %s at %ld: %s B/tok, %s bytes; now %s, %s\n", w->suite, w->test, w->ctx,
                   w->bpt, w->bytes, bpt[0] ? bpt : "?", bytes[0] ? bytes : "?");
            ok = false;
        }
    }
    printf("    %d rows of bench/README.md's --quick table checked\n", rows);
    free(out);
    free(doc);
    CHECKF(ok, "bench/README.md's --quick table is stale (see above)");
    CHECKF(rows >= 5, "only %d ds4 and snapshot rows found in the --quick table", rows);
}
