/* Test runner: see test.h. */
#include "test.h"
#include "arch/model.h"
#include "arch/fpcache.h"
#include "session/snapshot.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <signal.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

struct entry { const char *name, *file; kvt_test_fn fn; };
static struct entry tests[512];
static int n_tests, cur_failed, cur_skipped, cur_env;
static char cur_why[256]; /* the current test's first skip reason */

void kvt_test_register(const char *name, const char *file, kvt_test_fn fn)
{
    if (n_tests < (int)(sizeof tests / sizeof tests[0]))
        tests[n_tests++] = (struct entry){name, file, fn};
    else
        fprintf(stderr, "kvtier-tests: more than %zu tests: %s is not run (tests/main.c)\n",
                sizeof tests / sizeof tests[0], name);
}

void kvt_test_fail(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stdout, "    %s:%d: ", file, line);
    vfprintf(stdout, fmt, ap);
    fputc('\n', stdout);
    va_end(ap);
    cur_failed = 1;
}

static void skip_v(int env, const char *fmt, va_list ap)
{
    char why[sizeof cur_why];
    vsnprintf(why, sizeof why, fmt, ap);
    fprintf(stdout, "    skipped: %s\n", why);
    if (!cur_skipped) {
        snprintf(cur_why, sizeof cur_why, "%s", why);
        cur_env = env;
    }
    cur_skipped = 1;
}

void kvt_test_skip(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    skip_v(0, fmt, ap);
    va_end(ap);
}

void kvt_test_skip_env(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    skip_v(1, fmt, ap);
    va_end(ap);
}

int kvt_test_failed(void) { return cur_failed; }

/* ---- the cleanup list (test.h) ---- */

static struct deferred { kvt_test_cleanup_fn fn; void *arg; } *deferred;
static size_t n_deferred, cap_deferred;
bool kvt_test_fault_no_cleanup;

void kvt_test_defer(kvt_test_cleanup_fn fn, void *arg)
{
    if (n_deferred == cap_deferred) {
        size_t cap = cap_deferred ? 2 * cap_deferred : 32;
        struct deferred *d = realloc(deferred, cap * sizeof *d);
        if (!d) { /* nothing registered: say so, and do it now rather than never */
            kvt_test_fail(__FILE__, __LINE__, "the cleanup list: no memory (done now)");
            fn(arg);
            return;
        }
        deferred = d;
        cap_deferred = cap;
    }
    deferred[n_deferred++] = (struct deferred){fn, arg};
}

/* Take arg's entries (of fn, or any when fn is NULL) off the list, running
 * them when run. */
static void take(kvt_test_cleanup_fn fn, void *arg, bool run)
{
    for (size_t i = n_deferred; i-- > 0;) {
        if (deferred[i].arg != arg || (fn && deferred[i].fn != fn)) continue;
        struct deferred d = deferred[i];
        memmove(deferred + i, deferred + i + 1, (n_deferred - i - 1) * sizeof *deferred);
        n_deferred--;
        if (run) d.fn(d.arg);
    }
}

void kvt_test_release(void *arg) { take(NULL, arg, true); }
void kvt_test_forget(void *arg) { take(NULL, arg, false); }

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st; (void)flag; (void)ftw;
    remove(path);
    return 0;
}

static void rm_dir(void *arg)
{
    nftw(arg, rm_entry, 32, FTW_DEPTH | FTW_PHYS); /* links not followed */
    free(arg);
}

void kvt_test_defer_dir(const char *dir)
{
    /* only what a test makes: a slip (an empty path, "/") removes nothing */
    if (!dir || strncmp(dir, "/tmp/", 5) || !dir[5] || strstr(dir, "/..")) {
        kvt_test_fail(__FILE__, __LINE__, "the cleanup list takes directories under /tmp/ only, not %s",
                      dir ? dir : "(null)");
        return;
    }
    char *copy = strdup(dir);
    if (copy) kvt_test_defer(rm_dir, copy);
}

void kvt_test_forget_dir(const char *dir)
{
    for (size_t i = n_deferred; i-- > 0;)
        if (deferred[i].fn == rm_dir && !strcmp(deferred[i].arg, dir)) {
            free(deferred[i].arg);
            memmove(deferred + i, deferred + i + 1, (n_deferred - i - 1) * sizeof *deferred);
            n_deferred--;
        }
}

char *kvt_test_mkdtemp(char *tmpl)
{
    char *d = mkdtemp(tmpl);
    if (d) kvt_test_defer_dir(d);
    return d;
}

/* Kill the child when it is still one of ours and running (a pid the test
 * reaped already may name another process by now: waitpid says whether it
 * is still our child). */
static void reap(void *arg)
{
    pid_t pid = (pid_t)(intptr_t)arg;
    if (waitpid(pid, NULL, WNOHANG) != 0) return; /* exited (reaped now) or not ours */
    kill(pid, SIGCONT);
    kill(pid, SIGKILL);
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {}
}

void kvt_test_defer_pid(int pid)
{
    if (pid > 0) kvt_test_defer(reap, (void *)(intptr_t)pid);
}

void kvt_test_forget_pid(int pid) { take(reap, (void *)(intptr_t)pid, false); }

static void free_session(void *p) { kvt_session_free(p); }
static void close_model(void *p) { kvt_model_close(p); }
void kvt_test_defer_free(void *p) { if (p) kvt_test_defer(free, p); }
void kvt_test_defer_session(kvt_session *s) { if (s) kvt_test_defer(free_session, s); }
void kvt_test_defer_model(kvt_model *m) { if (m) kvt_test_defer(close_model, m); }

/* After a test: its list, last registered first (an entry may register
 * more: they run too). */
static void run_deferred(void)
{
    if (kvt_test_fault_no_cleanup) n_deferred = 0;
    while (n_deferred) {
        struct deferred d = deferred[--n_deferred];
        d.fn(d.arg);
    }
}

/* One test, as the runner runs it: fresh state, the test, its cleanup. */
static void run_one(kvt_test_fn fn)
{
    cur_failed = cur_skipped = cur_env = 0;
    cur_why[0] = 0;
    n_deferred = 0;
    fn();
    run_deferred();
}

/* The default directory of the fingerprint cache for the models the tests
 * open (src/arch/fpcache.h): the runner's own, removed at its exit (not a
 * forked child's), so that a run leaves nothing in the user's
 * ~/.cache/kvtier. */
static char fp_dir[64];
static pid_t fp_owner;
static void fp_dir_remove(void)
{
    char cmd[96];
    snprintf(cmd, sizeof cmd, "rm -rf %s", fp_dir);
    if (getpid() == fp_owner && system(cmd)) fprintf(stderr, "kvtier-tests: could not remove %s\n", fp_dir);
}

int kvt_test_run_child(kvt_test_fn fn)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        run_one(fn);
        fflush(stdout);
        _exit(cur_failed ? 1 : 0);
    }
    int st = 0;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR) return -1;
    return WIFEXITED(st) && WEXITSTATUS(st) <= 1 ? WEXITSTATUS(st) : -1;
}

/* Whether file is tests/test_<stem>.c (any directory before it). */
static bool file_is(const char *file, const char *stem)
{
    const char *b = strrchr(file, '/');
    b = b ? b + 1 : file;
    size_t n = strlen(stem);
    return !strncmp(b, "test_", 5) && !strncmp(b + 5, stem, n) && !strcmp(b + 5 + n, ".c");
}

const char *kvt_test_shared(const char *rel)
{
    static char buf[8][4096];
    static int slot;
    const char *root = getenv("KVT_SHARED");
    if (!root) root = "../shared";
    char *p = buf[slot++ % 8];
    snprintf(p, 4096, "%s/%s", root, rel);
    return access(p, R_OK) == 0 ? p : NULL;
}

const char *kvt_test_bin(void)
{
    const char *b = getenv("KVT_BIN");
    return b ? b : "build/kvtier";
}

uint64_t kvt_test_rand(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t kvt_test_seed(const char *test)
{
    const char *e = getenv("KVT_TEST_SEED");
    uint64_t seed = e ? strtoull(e, NULL, 0) : (uint64_t)time(NULL) ^ (uint64_t)getpid();
    fprintf(stdout, "    %s: seed %llu (set KVT_TEST_SEED to repeat)\n", test,
            (unsigned long long)seed);
    return seed;
}

const char *kvt_test_esc(const char *s, size_t n)
{
    static char buf[8192];
    size_t o = 0;
    for (size_t i = 0; i < n && o + 8 < sizeof buf; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') o += (size_t)snprintf(buf + o, sizeof buf - o, "\\n");
        else if (c == '\t') o += (size_t)snprintf(buf + o, sizeof buf - o, "\\t");
        else if (c < 0x20 || c == 0x7f) o += (size_t)snprintf(buf + o, sizeof buf - o, "\\x%02x", c);
        else buf[o++] = (char)c;
    }
    buf[o] = 0;
    return buf;
}

void kvt_test_print_ids(const char *label, const int32_t *ids, size_t n)
{
    printf("        %s (%zu):", label, n);
    for (size_t i = 0; i < n && i < 48; i++) printf(" %d", ids[i]);
    printf("%s\n", n > 48 ? " ..." : "");
}

void kvt_test_tokens(int32_t *t, size_t n, uint64_t seed)
{
    t[0] = 256;
    for (size_t i = 1; i < n; i++) t[i] = (int32_t)(kvt_test_rand(&seed) % 256);
}

uint8_t *kvt_test_repack(const uint8_t *rec, size_t len, uint32_t version, uint32_t flags, int nsec,
                         const uint8_t *const *sec, const size_t *sl, size_t *out_len)
{
    enum { FIXED = 64, ENTRY = 24 };
    kvt_snap_info in;
    if (kvt_snap_parse_raw(rec, len, &in) || nsec < 1 || nsec > 7) return NULL;
    size_t hdr = FIXED + (size_t)nsec * ENTRY + 8, body = 0, rest = len - in.rec_len;
    for (int i = 1; i <= nsec; i++) body += sl[i];
    uint8_t *o = malloc(hdr + body + rest);
    if (!o) return NULL;
    memcpy(o, rec, FIXED);
    memcpy(o + 8, &version, 4); /* u32 LE: the host's order (FORMAT.md) */
    memcpy(o + 12, &flags, 4);
    uint32_t ns = (uint32_t)nsec;
    memcpy(o + 56, &ns, 4);
    uint64_t off = hdr;
    uint8_t *q = o + hdr;
    for (int i = 1; i <= nsec; i++) {
        uint64_t l = sl[i], h = XXH3_64bits(sec[i], l);
        uint8_t *e = o + FIXED + (size_t)(i - 1) * ENTRY;
        memcpy(e, &off, 8);
        memcpy(e + 8, &l, 8);
        memcpy(e + 16, &h, 8);
        if (l) memcpy(q, sec[i], l);
        q += l;
        off += l;
    }
    uint64_t hh = XXH3_64bits(o, hdr - 8);
    memcpy(o + hdr - 8, &hh, 8);
    memcpy(q, rec + in.rec_len, rest);
    *out_len = hdr + body + rest;
    return o;
}

/* A value no digest of a session gives twice: what a digest that failed
 * returns (the test already failed), so that two failures never agree. */
static uint64_t digest_failed(void)
{
    static uint64_t n;
    return 0x9e3779b97f4a7c15ull * ++n;
}

uint64_t kvt_test_digest(const kvt_session *s, const kvt_model *m)
{
    kvt_model_info i;
    kvt_model_info_get(m, &i);
    uint8_t *c = NULL;
    size_t len = 0;
    int rc = kvt_session_cache_bytes(s, &c, &len);
    if (rc) {
        kvt_test_fail(__FILE__, __LINE__, "digest: the session's cache bytes: %s: %s", kvt_strerror(rc), kvt_errmsg());
        return digest_failed();
    }
    uint64_t h = XXH3_64bits(c, len) ^ XXH3_64bits(kvt_session_logits(s), i.n_vocab * sizeof(float)) * 3;
    free(c);
    return h ^ kvt_session_len(s);
}

uint64_t kvt_test_digest_ckpt(const kvt_session *s, const kvt_model *m)
{
    uint64_t h = kvt_test_digest(s, m);
    size_t V = s->m->info.n_vocab;
    h = XXH3_64bits_withSeed(&s->n_ckpt, sizeof s->n_ckpt, h);
    for (size_t i = 0; i < s->n_ckpt; i++) {
        const kvt_checkpoint *c = &s->ckpt[i];
        uint64_t e[3] = {c->pos, XXH3_64bits(c->logits, V * sizeof(float)), XXH3_64bits(c->state.p, c->state.len)};
        h = XXH3_64bits_withSeed(e, sizeof e, h);
    }
    return h;
}

uint64_t kvt_test_twin(kvt_model *m, const int32_t *t, size_t n)
{
    kvt_session *s = NULL;
    int rc = kvt_session_new(&s, m, NULL);
    if (!rc) rc = kvt_session_sync(s, t, n, NULL);
    uint64_t h = rc ? digest_failed() : kvt_test_digest(s, m);
    if (rc) kvt_test_fail(__FILE__, __LINE__, "twin of %zu tokens: %s: %s", n, kvt_strerror(rc), kvt_errmsg());
    kvt_session_free(s);
    return h;
}

void kvt_test_clear_dir(const char *dir)
{
    DIR *d = opendir(dir);
    char path[4200];
    for (struct dirent *e; d && (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        unlink(path);
    }
    if (d) closedir(d);
    mkdir(dir, 0755);
}

char *kvt_test_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) { free(buf); buf = NULL; }
    fclose(f);
    if (buf) { buf[n] = 0; if (len) *len = (size_t)n; }
    return buf;
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

/* The slowest first; ties by name, so that two runs list alike. */
static int by_time(const void *a, const void *b)
{
    const struct { const char *name; double ms; } *x = a, *y = b;
    return x->ms < y->ms ? 1 : x->ms > y->ms ? -1 : strcmp(x->name, y->name);
}

/* In CI (CI=true in the environment, as .ci/run sets it) the machine is
 * set up to run every suite: a skip for anything that set-up provides
 * (../shared, the npm packages, the repository root) means a suite did not
 * run, and counts as a failure. Only kvt_test_skip_env's skips stay skips
 * there: hardware the CPU lacks or a limit of the machine. Either way the
 * skips are listed by reason before the last line, "N passed, N failed"
 * (.ci/run's contract: keep it last). */
int main(int argc, char **argv)
{
    bool list = argc > 1 && !strcmp(argv[1], "--list");
    const char *pat = argc > 1 + list ? argv[1 + list] : NULL, *ci = getenv("CI");
    /* a pattern that names a test file (tests/test_<pat>.c) selects exactly
     * its tests; any other selects the tests whose name contains it */
    bool by_file = false;
    for (int i = 0; pat && i < n_tests && !by_file; i++) by_file = file_is(tests[i].file, pat);
#define SELECTED(i) (!pat || (by_file ? file_is(tests[i].file, pat) : strstr(tests[i].name, pat) != NULL))
    if (list) {
        for (int i = 0; i < n_tests; i++)
            if (SELECTED(i)) printf("%s %s\n", tests[i].name, tests[i].file);
        return 0;
    }
    snprintf(fp_dir, sizeof fp_dir, "/tmp/kvtier-fingerprints-XXXXXX");
    if (mkdtemp(fp_dir)) {
        fp_owner = getpid();
        atexit(fp_dir_remove);
        kvt_fpcache_dir_for_tests = fp_dir;
    }
    const bool in_ci = ci && (!strcmp(ci, "true") || !strcmp(ci, "1"));
    /* KVT_TEST_TIMES=1: each test's wall time on the line after its result,
     * and the slowest 20 listed before the summary */
    const char *tt = getenv("KVT_TEST_TIMES");
    const bool times = tt && *tt && strcmp(tt, "0");
    static struct { const char *name; double ms; } took[512];
    int n_took = 0;
    int passed = 0, failed = 0, skipped = 0, n_why = 0;
    static struct { const char *name; char why[sizeof cur_why]; bool failed; } whys[512];
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 0; i < n_tests; i++) {
        if (!SELECTED(i)) continue;
        double t0 = now_ms();
        run_one(tests[i].fn);
        double ms = now_ms() - t0;
        bool ci_fail = !cur_failed && cur_skipped && in_ci && !cur_env;
        if (cur_skipped && !cur_failed) {
            whys[n_why].name = tests[i].name;
            whys[n_why].failed = ci_fail;
            snprintf(whys[n_why++].why, sizeof cur_why, "%s", cur_why);
        }
        if (cur_failed || ci_fail) {
            failed++;
            printf("FAIL %s%s\n", tests[i].name, ci_fail ? " (skipped, and CI=true: a suite CI must run)" : "");
        }
        else if (cur_skipped) { skipped++; printf("skip %s\n", tests[i].name); }
        else { passed++; printf("ok   %s\n", tests[i].name); }
        if (times) {
            printf("  %.0f ms\n", ms);
            took[n_took].name = tests[i].name;
            took[n_took++].ms = ms;
        }
    }
    if (times && n_took) {
        qsort(took, (size_t)n_took, sizeof took[0], by_time);
        double all = 0;
        for (int k = 0; k < n_took; k++) all += took[k].ms;
        printf("slowest (of %d tests, %.1f s in all):\n", n_took, all / 1e3);
        for (int k = 0; k < n_took && k < 20; k++)
            printf("  %8.1f s  %s\n", took[k].ms / 1e3, took[k].name);
    }
    if (n_why) printf("skips%s:\n", in_ci ? " (CI=true: each one not the machine's hardware or limits fails)" : "");
    for (int k = 0; k < n_why; k++)
        printf("  %-30s %s%s\n", whys[k].name, whys[k].failed ? "FAILED IN CI: " : "", whys[k].why);
    if (skipped) printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    else printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
