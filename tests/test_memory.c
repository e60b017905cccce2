/* The server's memory under --kv-ram-mb (issue 36, item 4): what the RAM
 * pool holds is what the budget counts, plus a fixed overhead.
 *
 *   memory_ram_bound  the built binary (KVT_BIN) serves ds4-tiny with
 *                  --no-kv-disk --kv-ram-mb 64; 200 distinct prompts of
 *                  300 tokens go to /v1/completions over CONNS connections
 *                  at once (max_tokens 2). From /proc/PID/status: VmRSS
 *                  after them, and at its highest while they ran, stays
 *                  within RAM_SLACK_MIB of the RSS once the server was
 *                  ready (the model loaded): 64 MiB of budget plus the
 *                  documented fixed overhead (README.md, --kv-ram-mb); what
 *                  RSS grew stays within the RAM bytes /metrics reports plus
 *                  the fixed overhead; the thread count stays within a few
 *                  of the ready server's plus one per connection (the
 *                  sessions share the server's worker threads).
 *
 *   memory_draft_bound  the same server with --draft model --model-draft
 *                  ds4-tiny, --kv-ram-mb 6, --parallel 1: 30 distinct
 *                  prompts of 600 tokens one after the other (max_tokens
 *                  32). After each reply, /metrics's RAM bytes plus what a
 *                  draft session is reserved (kvt_draft_model_reserve:
 *                  its cache at the reply's end, checkpoints, arrays,
 *                  rows of logits, scratch; computed here as the server
 *                  does) stay within the budget plus one session's bytes
 *                  (the reply's own session grows after its select made
 *                  room), the draft sessions kept with their pooled
 *                  sessions left out (kvtier_draft_kept_bytes: what
 *                  the next select frees first of a session); with
 *                  them, the RAM bytes stay within the budget plus a
 *                  session; kvtier_draft_session_bytes is 0 after the
 *                  last (the reservations given back).
 *
 * Skipped for a sanitizer build (KVT_BIN's path names asan), whose RSS
 * is not the server's.
 *
 * Negative controls: built from d5ab4de (a thread pool and scratch per
 * pooled session), KVT_BIN=that/kvtier ./build/kvtier-tests memory_ram_bound
 * fails all three checks; KVT_BIN=/work/main/build/kvtier (draft sessions
 * outside the budget) fails memory_draft_bound's bound from the 11th reply
 * (and its /metrics lacks the draft gauge). The tiers' own count of a
 * reservation has an in-process control, tiers_reserve_counts_in_share. */
#include "fixture.h"
#include "test.h"
#include "arch/model.h"
#include "serve/draft.h"
#include "session/memory.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#define PROMPTS 200
#define PROMPT_BYTES 300     /* ds4-tiny's byte tokenizer: a token per byte */
#define CONNS 4
#define BUDGET_MIB 64
#define FIXED_MIB 32         /* README.md: the fixed overhead over the budget */
#define RAM_SLACK_MIB (BUDGET_MIB + FIXED_MIB)
#define THREAD_SLACK 8       /* over the ready server's and CONNS */

/* VmRSS (KiB) and Threads of pid; false when unreadable. */
static bool proc_status(pid_t pid, long *rss_kib, long *threads)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    *rss_kib = *threads = -1;
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, "VmRSS:", 6)) *rss_kib = atol(line + 6);
        else if (!strncmp(line, "Threads:", 8)) *threads = atol(line + 8);
    }
    fclose(f);
    return *rss_kib >= 0 && *threads >= 0;
}

/* One HTTP/1.1 exchange with Connection: close: the status, and the
 * response (malloc'ed, NUL-terminated) in *resp when resp is not NULL; -1
 * when the exchange failed. */
static int http(int port, const char *req, size_t len, char **resp)
{
    if (resp) *resp = NULL;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct timeval tv = {60, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) { close(fd); return -1; }
    for (size_t off = 0; off < len;) {
        ssize_t k = write(fd, req + off, len - off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) { close(fd); return -1; }
        off += (size_t)k;
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (!buf) { close(fd); return -1; }
        if (n + 1 == cap) {
            char *b = realloc(buf, cap *= 2);
            if (!b) { free(buf); close(fd); return -1; }
            buf = b;
        }
        ssize_t k = read(fd, buf + n, cap - 1 - n);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) { free(buf); close(fd); return -1; }
        if (k == 0) break;
        n += (size_t)k;
    }
    close(fd);
    buf[n] = 0;
    int status = -1;
    if (sscanf(buf, "HTTP/1.%*d %d", &status) != 1) status = -1;
    if (resp) *resp = buf;
    else free(buf);
    return status;
}

typedef struct load {
    int port;
    _Atomic int next, done, failed;
    _Atomic int last_status;
} load;

/* Prompt i: its number, then seeded lowercase letters and spaces, so no
 * two share more than a few tokens (every request is a new session). */
static void *client(void *arg)
{
    load *l = arg;
    char req[1024], body[PROMPT_BYTES + 128], text[PROMPT_BYTES + 1];
    for (int i; (i = atomic_fetch_add(&l->next, 1)) < PROMPTS;) {
        uint64_t st = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1);
        int k = snprintf(text, sizeof text, "%d ", i);
        for (; k < PROMPT_BYTES; k++) text[k] = "abcdefghijklmnopqrstuvwxyz "[kvt_test_rand(&st) % 27];
        text[PROMPT_BYTES] = 0;
        int bl = snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":2,\"temperature\":0}", text);
        int rl = snprintf(req, sizeof req,
                          "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          "Connection: close\r\nContent-Length: %d\r\n\r\n%s", bl, body);
        int status = http(l->port, req, (size_t)rl, NULL);
        if (status != 200) {
            atomic_fetch_add(&l->failed, 1);
            atomic_store(&l->last_status, status);
        }
        atomic_fetch_add(&l->done, 1);
    }
    return NULL;
}

/* The value of the /metrics line "name value"; -1 when not found. */
static long long metric(int port, const char *name)
{
    static const char req[] = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    char *resp = NULL, key[128];
    long long v = -1;
    snprintf(key, sizeof key, "\n%s ", name);
    if (http(port, req, sizeof req - 1, &resp) == 200) {
        const char *p = strstr(resp, key);
        if (p) v = atoll(p + strlen(key));
    }
    free(resp);
    return v;
}

/* kvtier_cache_bytes{tier="ram"} from /metrics; -1 when not found. With
 * kept: of those, the draft sessions kept with their pooled sessions
 * (kvtier_draft_kept_bytes), from the same scrape. */
static long long ram_and_kept(int port, long long *kept)
{
    static const char req[] = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    char *resp = NULL;
    long long v = -1;
    *kept = -1;
    if (http(port, req, sizeof req - 1, &resp) == 200) {
        const char *p = strstr(resp, "\nkvtier_cache_bytes{tier=\"ram\"} "), *q = strstr(resp, "\nkvtier_draft_kept_bytes ");
        if (p) v = atoll(p + strlen("\nkvtier_cache_bytes{tier=\"ram\"} "));
        if (q) *kept = atoll(q + strlen("\nkvtier_draft_kept_bytes "));
    }
    free(resp);
    return v;
}

/* kvtier_cache_bytes{tier="ram"} from /metrics; -1 when not found. */
static long long ram_reported(int port) { return metric(port, "kvtier_cache_bytes{tier=\"ram\"}"); }

TEST(memory_ram_bound)
{
    if (fx_env_is("KVT_E2E", "0")) SKIP("KVT_E2E=0");
    if (access(kvt_test_bin(), X_OK) != 0) SKIP("the kvtier binary is not built");
    if (strstr(kvt_test_bin(), "asan"))
        SKIP("RSS of a sanitizer build (its quarantine holds freed memory, its shadow maps the rest)");
    long rss0, th0;
    if (!proc_status(getpid(), &rss0, &th0)) SKIP("no /proc/PID/status here");
    fx_server s = {0};
    CHECKF(fx_tmpdir_make(&s, "kvtier-ram"), "mkdtemp: %s", strerror(errno));
    const char *const args[] = {"--model", "ds4-tiny", "--no-kv-disk", "--kv-ram-mb", "64", NULL};
    if (!fx_server_start(&s, args)) {
        fx_tmpdir_remove(&s);
        CHECKF(false, "kvtier serve did not come up");
    }
    long ready_rss, ready_th;
    bool ok = proc_status(s.pid, &ready_rss, &ready_th);
    load l = {.port = s.port};
    pthread_t tid[CONNS];
    size_t started = 0;
    for (; ok && started < CONNS; started++)
        if (pthread_create(&tid[started], NULL, client, &l)) break;
    long peak_rss = ready_rss, peak_th = ready_th, rss, th;
    double t0 = fx_now();
    while (ok && atomic_load(&l.done) < PROMPTS && started == CONNS) {
        if (proc_status(s.pid, &rss, &th)) {
            peak_rss = rss > peak_rss ? rss : peak_rss;
            peak_th = th > peak_th ? th : peak_th;
        }
        fx_sleep_ms(20);
    }
    for (size_t i = 0; i < started; i++) pthread_join(tid[i], NULL);
    double secs = fx_now() - t0;
    long after_rss = -1, after_th = -1;
    ok = ok && proc_status(s.pid, &after_rss, &after_th);
    long long reported = ram_reported(s.port);
    bool stopped = fx_server_stop(&s);
    printf("    ready: RSS %.1f MiB, %ld threads; after %d prompts (%.1f s): RSS %.1f MiB (highest %.1f), "
           "%ld threads (highest %ld); /metrics RAM %.1f MiB\n",
           ready_rss / 1024.0, ready_th, PROMPTS, secs, after_rss / 1024.0, peak_rss / 1024.0, after_th, peak_th,
           reported / 1048576.0);
    if (!ok || started < CONNS || atomic_load(&l.failed) || reported < 0) fx_print_file("server log", s.log);
    fx_server_kill(&s);
    fx_tmpdir_remove(&s);
    CHECKF(ok && started == CONNS, "the server's /proc/PID/status, or the client threads");
    CHECKF(!atomic_load(&l.failed), "%d of %d requests failed (the last: HTTP %d)", atomic_load(&l.failed), PROMPTS,
           atomic_load(&l.last_status));
    CHECKF(reported >= 0, "no kvtier_cache_bytes{tier=\"ram\"} in /metrics");
    CHECKF(stopped, "kvtier serve did not exit 0 within %.0f s of SIGTERM", FX_STOP_TIMEOUT);
    /* each check on its own, so that a failing binary shows all it breaks */
    long bound = ready_rss + RAM_SLACK_MIB * 1024L;
    if (after_rss > bound || peak_rss > bound)
        kvt_test_fail(__FILE__, __LINE__, "RSS %.1f MiB after, %.1f at the highest: over the ready %.1f + %d MiB "
                      "of budget + %d fixed", after_rss / 1024.0, peak_rss / 1024.0, ready_rss / 1024.0, BUDGET_MIB,
                      FIXED_MIB);
    if (after_rss - ready_rss > reported / 1024 + FIXED_MIB * 1024L)
        kvt_test_fail(__FILE__, __LINE__, "RSS grew %.1f MiB, the pool reports %.1f MiB: more than %d MiB it does "
                      "not count", (after_rss - ready_rss) / 1024.0, reported / 1048576.0, FIXED_MIB);
    if (peak_th > ready_th + CONNS + THREAD_SLACK || after_th > ready_th + THREAD_SLACK)
        kvt_test_fail(__FILE__, __LINE__, "threads: %ld ready, %ld at the highest, %ld after (worker threads per "
                      "session?)", ready_th, peak_th, after_th);
}

#define DRAFT_PROMPTS 30
#define DRAFT_PROMPT_BYTES 600
#define DRAFT_MAX_NEW 32
#define DRAFT_BUDGET_MIB 6

/* The draft model's sessions count against --kv-ram-mb (issue 46). */
TEST(memory_draft_bound)
{
    /* what the server reserves for a reply's draft session: ds4-tiny's
     * plan at the reply's end (BOS, the prompt, the reply), its scratch
     * at the default context, the default --draft-max */
    kvt_model *dm = NULL;
    kvt_memory mm;
    CHECK_OK(kvt_model_preset(&dm, "ds4-tiny", 7, NULL));
    CHECK_OK(kvt_model_memory(NULL, dm, dm->info.n_ctx_train, 1, &mm));
    long long reserve = (long long)kvt_draft_model_reserve(dm, dm->info.n_ctx_train,
                                                           1 + DRAFT_PROMPT_BYTES + DRAFT_MAX_NEW,
                                                           KVT_DRAFT_MAX_DEFAULT, (size_t)mm.scratch);
    kvt_model_close(dm);
    fx_server s = {0};
    CHECKF(fx_tmpdir_make(&s, "kvtier-draft-ram"), "mkdtemp: %s", strerror(errno));
    char mib[16];
    snprintf(mib, sizeof mib, "%d", DRAFT_BUDGET_MIB);
    const char *const args[] = {"--model", "ds4-tiny", "--no-kv-disk", "--kv-ram-mb", mib, "--parallel", "1",
                                "--threads", "1", "--draft", "model", "--model-draft", "ds4-tiny", NULL};
    if (!fx_server_start(&s, args)) {
        fx_tmpdir_remove(&s);
        CHECKF(false, "kvtier serve did not come up");
    }
    long long budget = (long long)DRAFT_BUDGET_MIB << 20, one = -1, worst = 0, kept_max = 0, all_max = 0;
    int failed = 0, over_at = 0;
    char req[2048], body[DRAFT_PROMPT_BYTES + 128], text[DRAFT_PROMPT_BYTES + 1];
    for (int i = 0; i < DRAFT_PROMPTS; i++) {
        uint64_t st = 0x51ed27aa1c3b9f01ull * (uint64_t)(i + 1);
        int k = snprintf(text, sizeof text, "%d ", i);
        for (; k < DRAFT_PROMPT_BYTES; k++) text[k] = "abcdefghijklmnopqrstuvwxyz "[kvt_test_rand(&st) % 27];
        text[DRAFT_PROMPT_BYTES] = 0;
        int bl = snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0}", text,
                          DRAFT_MAX_NEW);
        int rl = snprintf(req, sizeof req,
                          "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          "Connection: close\r\nContent-Length: %d\r\n\r\n%s", bl, body);
        failed += http(s.port, req, (size_t)rl, NULL) != 200;
        /* the draft sessions kept (companions) fill the room the reply's
         * reservation leaves, within the budget (checked); they are what
         * the next select frees first of their sessions, as it makes room
         * for the next reservation: the bound is on the rest */
        long long kept = 0, all = ram_and_kept(s.port, &kept), ram = all - kept;
        if (kept > kept_max) kept_max = kept;
        if (all > all_max) all_max = all;
        if (i == 0) one = ram; /* the first reply's session alone */
        long long over = ram + reserve - budget;
        if (over > worst) worst = over;
        if (over > one && !over_at) over_at = i + 1;
    }
    fx_sleep_ms(100);
    long long draft_after = metric(s.port, "kvtier_draft_session_bytes");
    bool stopped = fx_server_stop(&s);
    printf("    a reply's draft session reserved %.2f MiB, one session %.0f KiB; the pool and the reservation at "
           "most %.0f KiB over the %d MiB budget%s; /metrics's draft bytes %lld after the last\n",
           reserve / 1048576.0, one / 1024.0, worst / 1024.0, DRAFT_BUDGET_MIB,
           over_at ? " (more than a session: from reply" : "", draft_after);
    if (over_at) printf("    ... %d on)\n", over_at);
    printf("    draft sessions kept at most %.0f KiB; the pool with them at most %.0f KiB\n", kept_max / 1024.0,
           all_max / 1024.0);
    if (failed || !stopped) fx_print_file("server log", s.log);
    fx_server_kill(&s);
    fx_tmpdir_remove(&s);
    CHECKF(!failed, "%d of %d requests failed", failed, DRAFT_PROMPTS);
    CHECKF(one > 0, "no kvtier_cache_bytes{tier=\"ram\"} in /metrics");
    CHECKF(stopped, "kvtier serve did not exit 0 within %.0f s of SIGTERM", FX_STOP_TIMEOUT);
    CHECKF(kept_max >= 0 && all_max <= budget + one, "the pool with its draft sessions kept: %lld bytes, over the "
           "budget by more than a session", all_max);
    CHECKF(!over_at, "the pool and the draft sessions exceed the RAM budget by more than the reply's own session "
           "(%lld bytes over, a session %lld): the draft sessions are not counted", worst, one);
    CHECKF(draft_after == 0, "kvtier_draft_session_bytes: %lld with no reply running (want 0)", draft_after);
}
