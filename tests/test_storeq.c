/* The server's store thread (src/store/storeq.c) end to end: the scheduler never
 * waits on the disk or on another process's lock of a store.
 *
 *   storeq_locked_store  ds4-tiny: another process holds BEGIN
 *                  IMMEDIATE on the store's kvtier.db for HOLD seconds
 *                  while a request's save meets the lock; short requests
 *                  answer within 1 s each meanwhile, and the save is
 *                  committed once the lock is released
 *   storeq_save_itl  the synthetic llama (tests/synth_family.h, heads
 *                  of 128: 8 KB of cache rows per token): two streams'
 *                  times between tokens while three other keys' sessions
 *                  of 3,600 tokens (29 MB) are evicted and saved; the 99th
 *                  percentile is at most three times the median
 *                  (tests/e2e/storeq.mjs)
 *
 *   storeq_held_follows_copies  ds4-tiny, in process: a copy of a
 *                  session (its blocks by reference) queued to be saved
 *                  while the store is locked counts next to nothing while
 *                  its source lives, and the source's rows once the source
 *                  is freed (kvt_storeq_held: the tiers' RAM budget); with
 *                  kvt_storeq_fault_held_at_queue (the count taken when
 *                  queued) it stays next to nothing, and the test says so
 *
 *   storeq_save_writes_idle  ds4-tiny, in process: the saves' thread
 *                  writes a save's segments at SCHED_IDLE (the policy the
 *                  kernel reports for the writing thread, sched_getscheduler,
 *                  at each piece written), and a save on another thread at
 *                  its own policy; with kvt_storeq_fault_no_idle the saves'
 *                  thread writes at its own policy too, and the test says so
 *
 * The first two fail on a build whose scheduler saves in line (KVT_BIN of a tree
 * before the store thread): the short requests wait for the lock, the
 * streams stop for every save. They need curl (and node for the second),
 * and skip without them. */
#include "ds4_tiny.h"
#include "fixture.h"
#include "synth_family.h"
#include "test.h"
#include "arch/model.h"
#include "store/store.h"
#include "store/storeq.h"
#include "base/threads.h"
#include "base/util.h"
#include "store/segments.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define HOLD 30        /* seconds the other process holds the store's write lock */
#define SHORT_MAX 1.0  /* seconds a short request may take meanwhile */

static const char *skip_reason(bool node)
{
    if (fx_env_is("KVT_E2E", "0")) return "KVT_E2E=0";
    if (system("command -v curl >/dev/null 2>&1") != 0) return "curl is not on PATH";
    if (node && system("command -v node >/dev/null 2>&1") != 0) return "node is not on PATH";
    if (node && access("tests/e2e/package.json", R_OK) != 0) return "run from the repository root";
    if (access(kvt_test_bin(), X_OK) != 0) return "the kvtier binary is not built";
    return NULL;
}

/* A completion request started in the background: curl's status line
 * ("CODE SECONDS") is read by req_end. */
static FILE *req_start(const fx_server *s, const char *body_file)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "curl -s -o /dev/null -w '%%{http_code} %%{time_total}' --max-time 120 "
             "-H 'content-type: application/json' --data-binary @%s %s/v1/completions",
             body_file, s->base);
    return popen(cmd, "r");
}

/* Wait for it: its HTTP status (-1: none) and *seconds. */
static int req_end(FILE *f, double *seconds)
{
    char line[64] = {0};
    size_t n = f ? fread(line, 1, sizeof line - 1, f) : 0;
    if (f) pclose(f);
    line[n] = 0;
    int code = -1;
    *seconds = -1;
    if (sscanf(line, "%d %lf", &code, seconds) != 2) code = -1;
    return code;
}

static bool write_body(const char *path, const char *prompt_head, int n, int max_tokens)
{
    FILE *f = fopen(path, "w");
    if (!f) return false;
    fprintf(f, "{\"prompt\":\"%s", prompt_head);
    for (int i = 0; i < n; i++) fputc("abcdefghijklmnopqrstuvwxyz 0123456789"[i * 7 % 37], f);
    fprintf(f, "\",\"max_tokens\":%d,\"temperature\":0}", max_tokens);
    return fclose(f) == 0;
}

/* kvtier_disk_saves_total of the server's /metrics (-1: unreadable). */
static long saves_total(const fx_server *s)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd, "curl -s --max-time 5 %s/metrics | sed -n 's/^kvtier_disk_saves_total //p'", s->base);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    long v = -1;
    if (fscanf(f, "%ld", &v) != 1) v = -1;
    pclose(f);
    return v;
}

/* The other process: BEGIN IMMEDIATE on db, a byte on fd once it holds
 * the lock, HOLD seconds, ROLLBACK. */
static void hold_lock(const char *db, int fd)
{
    sqlite3 *c = NULL;
    int ok = sqlite3_open_v2(db, &c, SQLITE_OPEN_READWRITE, NULL) == SQLITE_OK &&
             sqlite3_exec(c, "BEGIN IMMEDIATE", NULL, NULL, NULL) == SQLITE_OK;
    char b = ok ? 'y' : 'n';
    if (write(fd, &b, 1) != 1) _exit(2);
    if (!ok) _exit(1);
    sleep(HOLD);
    sqlite3_exec(c, "ROLLBACK", NULL, NULL, NULL);
    sqlite3_close(c);
    _exit(0);
}

static void locked_store(fx_server *s)
{
    char kv[128], db[160], long_body[128], short_body[128];
    snprintf(kv, sizeof kv, "%s/kv", s->dir);
    snprintf(db, sizeof db, "%s/kvtier.db", kv);
    snprintf(long_body, sizeof long_body, "%s/long.json", s->dir);
    snprintf(short_body, sizeof short_body, "%s/short.json", s->dir);
    CHECK(write_body(long_body, "", 600, 2) && write_body(short_body, "hi ", 0, 2));
    /* a 600-token prompt saves a cold snapshot at 512 tokens */
    const char *args[] = {"--model", "ds4-tiny", "--kv-disk-dir", kv, "--kv-cache-min-tokens", "128",
                          "--kv-cache-align-tokens", "128", NULL};
    CHECKF(fx_server_start(s, args), "kvtier serve did not come up");
    long before = saves_total(s);
    CHECKF(before == 0, "kvtier_disk_saves_total %ld before any request", before);
    int p[2];
    CHECK(pipe(p) == 0);
    pid_t holder = fork();
    CHECK(holder >= 0);
    if (holder == 0) {
        close(p[0]);
        hold_lock(db, p[1]);
    }
    close(p[1]);
    char b = 0;
    bool locked = read(p[0], &b, 1) == 1 && b == 'y';
    close(p[0]);
    double t_locked = fx_now();
    if (!locked) waitpid(holder, NULL, 0);
    CHECKF(locked, "the other process could not take the lock of %s", db);
    /* the long request's save meets the lock; the short ones need no save */
    FILE *lr = req_start(s, long_body);
    fx_sleep_ms(300);
    double worst = 0;
    int bad = 0;
    for (int i = 0; i < 3; i++) {
        if (i) fx_sleep_ms(HOLD * 1000 / 4); /* spread over the hold: at its start, middle and end */
        double sec;
        int code = req_end(req_start(s, short_body), &sec);
        printf("    short request %d during the lock: HTTP %d in %.3f s\n", i + 1, code, sec);
        if (code != 200) bad = code;
        if (sec > worst) worst = sec;
    }
    double long_sec;
    int long_code = req_end(lr, &long_sec);
    printf("    the request whose save met the lock: HTTP %d in %.3f s\n", long_code, long_sec);
    int st = 0;
    waitpid(holder, &st, 0);
    double released = fx_now();
    printf("    the lock held %.1f s\n", released - t_locked);
    CHECKF(!bad && long_code == 200, "a request answered HTTP %d / %d while the store was locked", bad, long_code);
    CHECKF(worst < SHORT_MAX, "a short request took %.3f s while another process held the store's lock "
           "(the scheduler waited on it)", worst);
    CHECKF(long_sec < SHORT_MAX + 1, "the request whose save met the lock took %.3f s", long_sec);
    CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the lock holder failed");
    /* the save waited and is committed once the lock is gone */
    long after = -1;
    while (fx_now() - released < 10 && (after = saves_total(s)) < 1) fx_sleep_ms(100);
    printf("    saves committed %.2f s after the release: %ld\n", fx_now() - released, after);
    CHECKF(after >= 1, "no save committed within 10 s of the lock's release (kvtier_disk_saves_total %ld)", after);
    CHECKF(fx_server_stop(s), "kvtier serve did not exit 0 after SIGTERM");
}

TEST(storeq_locked_store)
{
    const char *why = skip_reason(false);
    if (why) SKIP("%s", why);
    fx_server s = {0};
    CHECKF(fx_tmpdir_make(&s, "kvtier-storeq"), "mkdtemp: %s", strerror(errno));
    locked_store(&s);
    fx_server_kill(&s);
    fx_tmpdir_remove(&s);
}

/* ---- times between tokens while sessions are saved ---- */

#define ITL_KEYS 32 /* two pooled sessions per key: a third evicts */
#define ITL_CTX 4096

static void save_itl(fx_server *s, const char *model)
{
    char kv[128], keyfile[128];
    snprintf(kv, sizeof kv, "%s/kv", s->dir);
    snprintf(keyfile, sizeof keyfile, "%s/keys", s->dir);
    FILE *f = fopen(keyfile, "w");
    CHECK(f);
    for (int i = 0; i < ITL_KEYS; i++) fprintf(f, "k%02d\n", i);
    CHECK(fclose(f) == 0);
    /* nothing saved at the end of a prefill (the aligned point is past the
     * context): each long session is saved whole when it is evicted */
    const char *args[] = {"--model", model, "--kv-disk-dir", kv, "--parallel", "4", "--threads", "1",
                          "--api-key-file", keyfile,
                          "--kv-cache-align-tokens", "8192", "--kv-cache-continued-interval", "8192", NULL};
    CHECKF(fx_server_start(s, args), "kvtier serve did not come up");
    char nk[8], out[128];
    snprintf(nk, sizeof nk, "%d", ITL_KEYS);
    snprintf(out, sizeof out, "%s/storeq.out", s->dir);
    const char *argv[] = {"node", "tests/e2e/storeq.mjs", s->base, nk, NULL};
    int st = 0;
    int ran = fx_run(argv, out, 300, &st);
    bool ok = ran == 1 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
    fx_print_file("storeq.mjs", out);
    if (!ok) fx_print_file("server log", s->log);
    CHECKF(ok, "node tests/e2e/storeq.mjs failed (see above)");
    CHECKF(fx_server_stop(s), "kvtier serve did not exit 0 after SIGTERM");
}

TEST(storeq_save_itl)
{
    const char *why = skip_reason(true);
    if (why) SKIP("%s", why);
    const char *vocab = kvt_test_shared("vocab/ggml-vocab-llama-spm.gguf");
    if (!vocab) SKIP("../shared/vocab absent");
    char v[4096], path[256];
    snprintf(v, sizeof v, "%s", vocab);
    fx_server s = {0};
    CHECKF(fx_tmpdir_make(&s, "kvtier-storeq"), "mkdtemp: %s", strerror(errno));
    snprintf(path, sizeof path, "%s/llama.gguf", s.dir);
    /* heads of 128: 8 KB of cache rows per token, a 3,600-token session
     * 29 MB to save */
    const fam_spec llama = {"llama", false, false, 128, false, false, false};
    if (fam_write_ctx(path, v, 5, FAM_ROPE_BASE, &llama, false, ITL_CTX) != 0)
        kvt_test_fail(__FILE__, __LINE__, "writing the synthetic llama");
    else
        save_itl(&s, path);
    fx_server_kill(&s);
    fx_tmpdir_remove(&s);
}

/* ---- what a queued save holds ---- */

/* Queue a copy of a 1,000-token session to be saved into a locked store,
 * free the source, and wait (up to wait_s) for kvt_storeq_held to count
 * the source's rows; *before and *after are the counts with the source
 * live and after it is gone, *rows what the source's cache counts beyond
 * the copy's (the blocks they share). */
static void held_copy(double wait_s, size_t *before, size_t *after, size_t *rows)
{
    kvt_model *m = tiny();
    CHECK(m);
    if (!m) return;
    char dir[] = "/tmp/kvtier-storeq-held-XXXXXX";
    CHECK(mkdtemp(dir));
    kvt_store *st = NULL;
    kvt_storeq *q = NULL;
    kvt_session *a = NULL, *c = NULL;
    sqlite3 *db = NULL;
    char path[256];
    snprintf(path, sizeof path, "%s/kvtier.db", dir);
    enum { N = 1000 };
    int32_t t[N];
    seqb(t, N, 5);
    kvt_save_policy pol = KVT_SAVE_POLICY_DEFAULT;
    CHECK_OK(kvt_store_open(&st, dir, 0));
    kvt_store_set_busy(st, 20);
    CHECK(sqlite3_open(path, &db) == SQLITE_OK);
    CHECK(sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL) == SQLITE_OK);
    CHECK_OK(kvt_storeq_new(&q, &pol, &(kvt_storeq_hooks){0}));
    CHECK_OK(kvt_session_new(&a, m, NULL));
    CHECK_OK(kvt_session_new(&c, m, NULL));
    CHECK_OK(kvt_session_sync(a, t, N, NULL));
    CHECK_OK(kvt_session_clone(c, a));
    *rows = kvt_cache_bytes_held(a->cache) - kvt_cache_bytes_held(c->cache);
    CHECK_OK(kvt_storeq_save(q, st, 0, c, "manual"));
    c = NULL;
    *before = kvt_storeq_held(q, 0);
    kvt_session_free(a);
    double t0 = kvt_now();
    do {
        *after = kvt_storeq_held(q, 0);
        if (*after >= *before + *rows) break;
        usleep(20000);
    } while (kvt_now() - t0 < wait_s);
    CHECK(kvt_storeq_held(q, 1) == 0);
    CHECK(sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL) == SQLITE_OK);
    sqlite3_close(db);
    kvt_storeq_free(q); /* the save runs now */
    kvt_store_close(st);
    kvt_model_close(m);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

TEST(storeq_held_follows_copies)
{
    size_t before, after, rows;
    held_copy(10, &before, &after, &rows);
    printf("    a queued copy counts %zu bytes beside its source, %zu once the source is gone (rows they share: %zu)\n",
           before, after, rows);
    CHECKF(after >= before + rows, "the copy counts %zu bytes once its source is gone: not the %zu of its rows", after,
           before + rows);
    /* negative control: counted when queued, the copy stays at next to
     * nothing (the budget misses the source's rows it keeps alive) */
    kvt_storeq_fault_held_at_queue = true;
    held_copy(1, &before, &after, &rows);
    kvt_storeq_fault_held_at_queue = false;
    CHECKF(after == before, "with the count taken when queued, the copy went from %zu to %zu", before, after);
}

/* ---- the saves' thread writes at idle priority ---- */

/* *seen: the policy of the thread that wrote a save of a 1,000-token
 * session: the saves' thread of a queue (queued), or this thread (in
 * line); -1 when nothing was written. */
static void save_write_policy(bool queued, int *seen)
{
    *seen = -1;
    kvt_model *m = tiny();
    CHECK(m);
    char dir[] = "/tmp/kvtier-storeq-idle-XXXXXX";
    CHECK(mkdtemp(dir));
    kvt_store *st = NULL;
    kvt_storeq *q = NULL;
    kvt_session *a = NULL;
    enum { N = 1000 };
    int32_t t[N];
    seqb(t, N, 9);
    kvt_save_policy pol = KVT_SAVE_POLICY_DEFAULT;
    CHECK_OK(kvt_store_open(&st, dir, 0));
    CHECK_OK(kvt_session_new(&a, m, NULL));
    CHECK_OK(kvt_session_sync(a, t, N, NULL));
    kvt_segs_probe = true;
    kvt_segs_seen_policy = -1;
    if (queued) {
        CHECK_OK(kvt_storeq_new(&q, &pol, &(kvt_storeq_hooks){0}));
        CHECK_OK(kvt_storeq_save(q, st, 0, a, "manual"));
        a = NULL;
        /* done before the queue is told to stop (a shutdown writes at the
         * thread's own priority) */
        for (double t0 = kvt_now(); kvt_storeq_pending(q, 0) && kvt_now() - t0 < 60;) usleep(10000);
        CHECK(kvt_storeq_pending(q, 0) == 0);
        kvt_storeq_free(q);
    } else {
        CHECK_OK(kvt_store_save(st, a, N, "manual", NULL));
    }
    *seen = kvt_segs_seen_policy;
    kvt_segs_probe = false;
    kvt_session_free(a);
    kvt_store_stats ss;
    CHECK_OK(kvt_store_stats_get(st, &ss));
    CHECK(ss.snapshots == 1);
    kvt_store_close(st);
    kvt_model_close(m);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

TEST(storeq_save_writes_idle)
{
    if (!kvt_thread_idle_ok()) SKIP("this process cannot move a thread back out of SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE 0)");
    int before = sched_getscheduler(0);
    int queued, in_line;
    save_write_policy(true, &queued);
    save_write_policy(false, &in_line);
    printf("    segment writes: policy %d on the saves' thread, %d in line (SCHED_IDLE is %d)\n", queued, in_line,
           SCHED_IDLE);
    CHECKF(queued == SCHED_IDLE, "the saves' thread wrote at policy %d, not SCHED_IDLE", queued);
    CHECKF(in_line == before, "a save on the caller's thread wrote at policy %d, not its own %d", in_line, before);
    CHECK(sched_getscheduler(0) == before);
    /* negative control: without the idle writes, the check above fails */
    kvt_storeq_fault_no_idle = true;
    save_write_policy(true, &queued);
    kvt_storeq_fault_no_idle = false;
    CHECKF(queued == before, "negative control: the saves' thread wrote at policy %d", queued);
}
