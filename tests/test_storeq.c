/* The server's store thread (src/store/storeq.c) end to end: the scheduler never
 * waits on the disk or on another process's lock of a store.
 *
 *   storeq_locked_store  ds4-tiny: another process holds BEGIN
 *                  IMMEDIATE on the store's kvtier.db until the test lets
 *                  it go; a request whose save meets the lock and three
 *                  short requests all answer while the lock is still held,
 *                  nothing is committed and no round of the scheduler
 *                  entered the store's lock meanwhile
 *                  (kvtier_steps_waited_on_store_total 0: a count and an
 *                  order, not a time); the save is committed once the lock
 *                  is released. With KVT_FAULT_SAVES_INLINE=1 in the
 *                  server's environment (the saves on the scheduler, which
 *                  waits for the lock STORE_BUSY_MS at a time) the count
 *                  is not 0, and the test says so
 *   storeq_steps_never_wait  ds4-tiny: a reply of 400 tokens decodes
 *                  while three other prompts are prefilled and saved (the
 *                  save policy's copies); once the saves are committed the
 *                  server's kvtier_steps_waited_on_store_total (rounds of
 *                  the scheduler that entered a store's blocking lock:
 *                  kvt_store_mark_stepper) is 0. A count, not a time: it
 *                  holds on a loaded machine. With KVT_FAULT_SAVES_INLINE=1
 *                  in the server's environment (kvt_storeq_fault_inline:
 *                  the saves on the scheduler) it counts one at least per
 *                  save, and the test says so. The times between tokens
 *                  while sessions are saved are measured in bench/
 *                  (bench/storeq.sh, bench/SERVE.md)
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
 * scheduler enters the store for every save. They need curl, and skip
 * without it. */
#include "ds4_tiny.h"
#include "fixture.h"
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

#define HOLD_MAX 300 /* seconds the other process holds the store's write lock at most */
#define REQ_MAX 60   /* seconds curl waits for a request made while the lock is held */

static const char *skip_reason(void)
{
    if (fx_env_is("KVT_E2E", "0")) return "KVT_E2E=0";
    if (system("command -v curl >/dev/null 2>&1") != 0) return "curl is not on PATH";
    if (access(kvt_test_bin(), X_OK) != 0) return "the kvtier binary is not built";
    return NULL;
}

/* A completion request started in the background (curl gives up after
 * max_s seconds: a scheduler stuck on the lock fails the request, it does
 * not hang the test): curl's status line ("CODE SECONDS") is read by req_end. */
static FILE *req_start(const fx_server *s, const char *body_file, int max_s)
{
    char cmd[768];
    snprintf(cmd, sizeof cmd,
             "curl -s -o /dev/null -w '%%{http_code} %%{time_total}' --max-time %d "
             "-H 'content-type: application/json' --data-binary @%s %s/v1/completions",
             max_s, body_file, s->base);
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

/* The value of metric `name` (a line "name VALUE") on the server's
 * /metrics; -1 when unreadable. */
static long metric(const fx_server *s, const char *name)
{
    char cmd[320];
    snprintf(cmd, sizeof cmd, "curl -s --max-time 5 %s/metrics | sed -n 's/^%s //p'", s->base, name);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    long v = -1;
    if (fscanf(f, "%ld", &v) != 1) v = -1;
    pclose(f);
    return v;
}

/* kvtier_disk_saves_total of the server's /metrics (-1: unreadable). */
static long saves_total(const fx_server *s) { return metric(s, "kvtier_disk_saves_total"); }

/* The other process: BEGIN IMMEDIATE on db, a byte on fd once it holds
 * the lock, then the lock held until release is readable (a byte or the
 * test's end; HOLD_MAX s at most), ROLLBACK. */
static void hold_lock(const char *db, int fd, int release)
{
    sqlite3 *c = NULL;
    int ok = sqlite3_open_v2(db, &c, SQLITE_OPEN_READWRITE, NULL) == SQLITE_OK &&
             sqlite3_exec(c, "BEGIN IMMEDIATE", NULL, NULL, NULL) == SQLITE_OK;
    char b = ok ? 'y' : 'n';
    if (write(fd, &b, 1) != 1) _exit(2);
    if (!ok) _exit(1);
    alarm(HOLD_MAX);
    if (read(release, &b, 1) < 0) _exit(3);
    sqlite3_exec(c, "ROLLBACK", NULL, NULL, NULL);
    sqlite3_close(c);
    _exit(0);
}

/* The other process takes the store's lock; the requests are made while
 * it holds it. inline_saves: the server saves on its scheduler
 * (KVT_FAULT_SAVES_INLINE=1). *answered: the requests answered HTTP 200
 * before the lock was let go (of 4); *steps_waited and *saved: the
 * server's counters read while the lock was held; *saved_after: the saves
 * committed within 30 s of the release. */
static void locked_store(fx_server *s, bool inline_saves, int *answered, long *steps_waited, long *saved,
                         long *saved_after)
{
    char kv[128], db[160], long_body[128], short_body[128];
    *answered = 0;
    *steps_waited = *saved = *saved_after = -1;
    snprintf(kv, sizeof kv, "%s/kv", s->dir);
    snprintf(db, sizeof db, "%s/kvtier.db", kv);
    snprintf(long_body, sizeof long_body, "%s/long.json", s->dir);
    snprintf(short_body, sizeof short_body, "%s/short.json", s->dir);
    CHECK(write_body(long_body, "", 600, 2) && write_body(short_body, "hi ", 0, 2));
    /* a 600-token prompt saves a cold snapshot at 512 tokens */
    const char *args[] = {"--model", "ds4-tiny", "--kv-disk-dir", kv, "--kv-cache-min-tokens", "128",
                          "--kv-cache-align-tokens", "128", NULL};
    if (inline_saves) setenv("KVT_FAULT_SAVES_INLINE", "1", 1);
    bool up = fx_server_start(s, args);
    unsetenv("KVT_FAULT_SAVES_INLINE");
    CHECKF(up, "kvtier serve did not come up");
    long before = saves_total(s);
    CHECKF(before == 0, "kvtier_disk_saves_total %ld before any request", before);
    int p[2], rel[2];
    CHECK(pipe(p) == 0);
    CHECK(pipe(rel) == 0);
    pid_t holder = fork();
    CHECK(holder >= 0);
    if (holder == 0) {
        close(p[0]);
        close(rel[1]);
        hold_lock(db, p[1], rel[0]);
    }
    close(p[1]);
    close(rel[0]);
    char b = 0;
    bool locked = read(p[0], &b, 1) == 1 && b == 'y';
    close(p[0]);
    if (!locked) {
        close(rel[1]);
        waitpid(holder, NULL, 0);
    }
    CHECKF(locked, "the other process could not take the lock of %s", db);
    /* the long request's save meets the lock; the short ones need no save */
    FILE *lr = req_start(s, long_body, REQ_MAX);
    fx_sleep_ms(300);
    int bad = 0;
    for (int i = 0; i < 3; i++) {
        double sec;
        int code = req_end(req_start(s, short_body, REQ_MAX), &sec);
        printf("    short request %d during the lock: HTTP %d in %.3f s\n", i + 1, code, sec);
        if (code == 200) ++*answered;
        else bad = code;
        if (code != 200) break; /* the scheduler is stuck: the next would wait as long */
    }
    double long_sec;
    int long_code = req_end(lr, &long_sec);
    printf("    the request whose save met the lock: HTTP %d in %.3f s\n", long_code, long_sec);
    if (long_code == 200) ++*answered;
    /* still held: nothing committed, no step of the scheduler entered the store's lock */
    *steps_waited = metric(s, "kvtier_steps_waited_on_store_total");
    *saved = saves_total(s);
    printf("    while the lock is held: %d of 4 requests answered, steps waited on the store %ld, saves committed %ld\n",
           *answered, *steps_waited, *saved);
    b = 'r';
    if (write(rel[1], &b, 1) != 1) kill(holder, SIGKILL);
    close(rel[1]);
    int st = 0;
    waitpid(holder, &st, 0);
    double released = fx_now();
    CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the lock holder failed");
    (void)bad;
    /* the save waited and is committed once the lock is gone */
    while (fx_now() - released < 30 && (*saved_after = saves_total(s)) < 1) fx_sleep_ms(100);
    printf("    saves committed %.2f s after the release: %ld\n", fx_now() - released, *saved_after);
    CHECKF(fx_server_stop(s), "kvtier serve did not exit 0 after SIGTERM");
}

TEST(storeq_locked_store)
{
    const char *why = skip_reason();
    if (why) SKIP("%s", why);
    int answered;
    long waited, saved, after;
    for (int inl = 0; inl < 2; inl++) {
        fx_server s = {0};
        CHECKF(fx_tmpdir_make(&s, "kvtier-storeq"), "mkdtemp: %s", strerror(errno));
        locked_store(&s, inl, &answered, &waited, &saved, &after);
        fx_server_kill(&s);
        fx_tmpdir_remove(&s);
        if (!inl) {
            CHECKF(answered == 4, "%d of 4 requests answered while another process held the store's lock "
                   "(the scheduler waited on it)", answered);
            CHECKF(waited == 0, "%ld scheduler rounds entered the store's lock while it was held", waited);
            CHECKF(saved == 0, "%ld saves committed while another process held the lock", saved);
            CHECKF(after >= 1, "no save committed within 30 s of the lock's release (kvtier_disk_saves_total %ld)",
                   after);
        } else {
            /* negative control: saves on the scheduler wait for the lock */
            CHECKF(waited > 0, "with KVT_FAULT_SAVES_INLINE=1 no round of the scheduler entered the store's lock "
                   "while it was held (%d of 4 answered): the test cannot tell a scheduler that waits",
                   answered);
        }
    }
}

/* ---- no step waits on a save ---- */


#define SAVERS 3 /* prompts whose saves run while a reply decodes */

/* A server of ds4-tiny whose save policy saves a 600-token prompt at 512
 * tokens: one reply of 400 tokens decodes while SAVERS other prompts are
 * prefilled and saved (the policy's copies), then the saves are waited
 * for. *waited: kvtier_steps_waited_on_store_total then, *saves
 * kvtier_disk_saves_total, *steps kvtier_steps_total (-1: unread). With
 * inline, the server runs with KVT_FAULT_SAVES_INLINE=1 (the saves on its
 * scheduler). */
static void saves_beside_decode(bool inline_saves, long *waited, long *saves, long *steps)
{
    *waited = *saves = *steps = -1;
    fx_server s = {0};
    CHECKF(fx_tmpdir_make(&s, "kvtier-storeq"), "mkdtemp: %s", strerror(errno));
    char kv[128], dec_body[128], body[SAVERS][128];
    snprintf(kv, sizeof kv, "%s/kv", s.dir);
    snprintf(dec_body, sizeof dec_body, "%s/decode.json", s.dir);
    FILE *f = fopen(dec_body, "w");
    CHECK(f);
    fprintf(f, "{\"prompt\":\"a reply that decodes\",\"max_tokens\":400,\"temperature\":0,\"ignore_eos\":true}");
    CHECK(fclose(f) == 0);
    for (int i = 0; i < SAVERS; i++) {
        snprintf(body[i], sizeof body[i], "%s/save%d.json", s.dir, i);
        char head[16];
        snprintf(head, sizeof head, "p%d ", i); /* a prompt of its own: a save of its own */
        CHECK(write_body(body[i], head, 600, 1));
    }
    const char *args[] = {"--model", "ds4-tiny", "--kv-disk-dir", kv, "--kv-cache-min-tokens", "128",
                          "--kv-cache-align-tokens", "128", "--parallel", "4", NULL};
    if (inline_saves) setenv("KVT_FAULT_SAVES_INLINE", "1", 1);
    bool up = fx_server_start(&s, args);
    unsetenv("KVT_FAULT_SAVES_INLINE");
    CHECKF(up, "kvtier serve did not come up");
    FILE *dr = req_start(&s, dec_body, 120);
    fx_sleep_ms(100);
    for (int i = 0; i < SAVERS; i++) {
        double sec;
        int code = req_end(req_start(&s, body[i], 120), &sec);
        CHECKF(code == 200, "prompt %d: HTTP %d", i, code);
    }
    double dsec;
    int dcode = req_end(dr, &dsec);
    CHECKF(dcode == 200, "the decoding request: HTTP %d", dcode);
    /* the saves commit after their responses: wait for them */
    for (double t0 = fx_now(); fx_now() - t0 < 30 && (*saves = metric(&s, "kvtier_disk_saves_total")) < SAVERS;)
        fx_sleep_ms(100);
    *waited = metric(&s, "kvtier_steps_waited_on_store_total");
    *steps = metric(&s, "kvtier_steps_total");
    printf("    %s: %ld steps, %ld saves committed, %ld rounds of the scheduler waited on the store (decode %.2f s)\n",
           inline_saves ? "saves in line (KVT_FAULT_SAVES_INLINE=1)" : "saves on the store thread", *steps, *saves,
           *waited, dsec);
    CHECKF(fx_server_stop(&s), "kvtier serve did not exit 0 after SIGTERM");
}

TEST(storeq_steps_never_wait)
{
    const char *why = skip_reason();
    if (why) SKIP("%s", why);
    long waited, saves, steps;
    saves_beside_decode(false, &waited, &saves, &steps);
    if (kvt_test_failed()) return;
    CHECKF(saves >= SAVERS, "%ld saves committed, not %d: the test saw no saves to wait on", saves, SAVERS);
    CHECKF(steps > 0, "kvtier_steps_total %ld", steps);
    CHECKF(waited == 0, "%ld rounds of the scheduler waited on the store (a save or a load ran on it)", waited);
    /* negative control: saves run on the scheduler are counted */
    saves_beside_decode(true, &waited, &saves, &steps);
    if (kvt_test_failed()) return;
    CHECKF(saves >= SAVERS && waited >= SAVERS, "with the saves in line the scheduler waited %ld times for %ld saves: "
           "the count cannot tell a step that waits from one that does not", waited, saves);
}
/* ---- what a queued save holds ---- */

/* For the cleanup list (test.h): what a failed check leaves is let go
 * after the test. */
static void close_store(void *p) { kvt_store_close(p); }
static void free_queue(void *p) { kvt_storeq_free(p); }
static void close_db(void *p) { sqlite3_close(p); } /* an open transaction rolls back */
static void probe_off(void *p) { (void)p; kvt_segs_probe = false; }

/* Queue a copy of a 1,000-token session to be saved into a locked store,
 * free the source, and wait (up to wait_s) for kvt_storeq_held to count
 * the source's rows; *before and *after are the counts with the source
 * live and after it is gone, *rows what the source's cache counts beyond
 * the copy's (the blocks they share). */
static void held_copy(double wait_s, size_t *before, size_t *after, size_t *rows)
{
    kvt_model *m = tiny();
    CHECK(m);
    kvt_test_defer_model(m);
    char dir[] = "/tmp/kvtier-storeq-held-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir));
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
    kvt_test_defer(close_store, st);
    kvt_store_set_busy(st, 20);
    CHECK(sqlite3_open(path, &db) == SQLITE_OK);
    kvt_test_defer(close_db, db);
    CHECK(sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL) == SQLITE_OK);
    CHECK_OK(kvt_storeq_new(&q, &pol, &(kvt_storeq_hooks){0}));
    kvt_test_defer(free_queue, q); /* after the lock's release (last registered, first run) */
    CHECK_OK(kvt_session_new(&a, m, NULL));
    kvt_test_defer_session(a);
    CHECK_OK(kvt_session_new(&c, m, NULL));
    kvt_test_defer_session(c);
    CHECK_OK(kvt_session_sync(a, t, N, NULL));
    CHECK_OK(kvt_session_clone(c, a));
    *rows = kvt_cache_bytes_held(a->cache) - kvt_cache_bytes_held(c->cache);
    kvt_test_forget(c); /* the queue's once queued */
    int rc = kvt_storeq_save(q, st, 0, c, "manual");
    if (rc) kvt_test_defer_session(c);
    CHECK_OK(rc);
    c = NULL;
    *before = kvt_storeq_held(q, 0);
    kvt_test_release(a);
    double t0 = kvt_now();
    do {
        *after = kvt_storeq_held(q, 0);
        if (*after >= *before + *rows) break;
        usleep(20000);
    } while (kvt_now() - t0 < wait_s);
    CHECK(kvt_storeq_held(q, 1) == 0);
    CHECK(sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL) == SQLITE_OK);
    kvt_test_release(db);
    kvt_test_release(q); /* the save runs now */
    kvt_test_release(st);
    kvt_test_release(m);
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
    kvt_test_defer_model(m);
    char dir[] = "/tmp/kvtier-storeq-idle-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir));
    kvt_store *st = NULL;
    kvt_storeq *q = NULL;
    kvt_session *a = NULL;
    enum { N = 1000 };
    int32_t t[N];
    seqb(t, N, 9);
    kvt_save_policy pol = KVT_SAVE_POLICY_DEFAULT;
    CHECK_OK(kvt_store_open(&st, dir, 0));
    kvt_test_defer(close_store, st);
    CHECK_OK(kvt_session_new(&a, m, NULL));
    kvt_test_defer_session(a);
    CHECK_OK(kvt_session_sync(a, t, N, NULL));
    kvt_segs_probe = true;
    kvt_test_defer(probe_off, &kvt_segs_probe);
    kvt_segs_seen_policy = -1;
    if (queued) {
        CHECK_OK(kvt_storeq_new(&q, &pol, &(kvt_storeq_hooks){0}));
        kvt_test_defer(free_queue, q);
        kvt_test_forget(a); /* the queue's once queued */
        int rc = kvt_storeq_save(q, st, 0, a, "manual");
        if (rc) kvt_test_defer_session(a);
        CHECK_OK(rc);
        a = NULL;
        /* done before the queue is told to stop (a shutdown writes at the
         * thread's own priority) */
        for (double t0 = kvt_now(); kvt_storeq_pending(q, 0) && kvt_now() - t0 < 60;) usleep(10000);
        CHECK(kvt_storeq_pending(q, 0) == 0);
        kvt_test_release(q);
    } else {
        CHECK_OK(kvt_store_save(st, a, N, "manual", NULL));
    }
    *seen = kvt_segs_seen_policy;
    kvt_test_release(&kvt_segs_probe); /* off */
    kvt_test_release(a);
    kvt_store_stats ss;
    CHECK_OK(kvt_store_stats_get(st, &ss));
    CHECK(ss.snapshots == 1);
    kvt_test_release(st);
    kvt_test_release(m);
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
