/* The remote tier (src/store/remote.c, src/store/redis.c) against a real
 * redis-server each test starts on a free port: a second session with
 * nothing local hits what the first uploaded, bit for bit; damaged, swapped,
 * truncated, foreign and cross-tenant values are misses, deleted; a
 * consistent planted block is refused by the HMAC (and loads without it: the
 * negative control); a stopped Redis costs a lookup its deadline and opens
 * the breaker, which recovers; a wrong password is a miss with a reason; a
 * tiny maxmemory with allkeys-lru gives shorter hits, never errors. */
#include "test.h"
#include "fixture.h"
#include "ds4_tiny.h"
#include "store/redis.h"
#include "store/remote.h"
#include "base/util.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

typedef struct rsrv {
    pid_t pid;
    int port;
    char url[64], dir[64], log[96];
} rsrv;

static const char *no_redis(void)
{
    if (system("command -v redis-server >/dev/null 2>&1"))
        return "redis-server absent (Debian's redis-server, tools/debian-packages)";
    return NULL;
}

static kvt_redis *raw(const rsrv *r, const char *password)
{
    kvt_redis_url u;
    kvt_redis *c = NULL;
    if (kvt_redis_parse_url(r->url, &u) || kvt_redis_new(&c, &u, password)) return NULL;
    return c;
}

/* One command and its reply (the caller frees); NULL on a transport failure. */
static redisReply *cmd(kvt_redis *c, int argc, const char *const *argv, const size_t *lens)
{
    redisReply **rep = NULL;
    size_t n = 0;
    if (kvt_redis_append(c, argc, argv, lens) || kvt_redis_exec(c, 2000, &rep, &n) || n != 1) return NULL;
    redisReply *x = rep[0];
    free(rep);
    return x;
}

static bool cmd_ok(kvt_redis *c, const char *a0, const char *a1, const char *a2)
{
    const char *a[3] = {a0, a1, a2};
    redisReply *x = cmd(c, a2 ? 3 : a1 ? 2 : 1, a, NULL);
    bool ok = x && x->type != REDIS_REPLY_ERROR;
    if (x) freeReplyObject(x);
    return ok;
}

/* redis-server on a free port, no persistence, extra args appended. */
static bool redis_start(rsrv *r, const char *const *extra)
{
    memset(r, 0, sizeof *r);
    snprintf(r->dir, sizeof r->dir, "/tmp/kvtier-redis-XXXXXX");
    if (!mkdtemp(r->dir)) return false;
    snprintf(r->log, sizeof r->log, "%s/redis.log", r->dir);
    r->port = fx_free_port();
    snprintf(r->url, sizeof r->url, "redis://127.0.0.1:%d", r->port);
    char port[16];
    snprintf(port, sizeof port, "%d", r->port);
    const char *argv[40] = {"redis-server", "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                            "--dir", r->dir};
    int a = 11;
    for (int i = 0; extra && extra[i] && a < 38; i++) argv[a++] = extra[i];
    argv[a] = NULL;
    pid_t pid = fork();
    if (pid < 0) return false;
    if (pid == 0) {
        int fd = open(r->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) { dup2(fd, 1); dup2(fd, 2); }
        execvp("redis-server", (char *const *)argv);
        _exit(127);
    }
    r->pid = pid;
    const char *pw = NULL;
    for (int i = 0; extra && extra[i]; i++)
        if (!strcmp(extra[i], "--requirepass") && extra[i + 1]) pw = extra[i + 1];
    for (double end = fx_now() + 10; fx_now() < end; fx_sleep_ms(20)) {
        kvt_redis *c = raw(r, pw);
        bool up = c && cmd_ok(c, "PING", NULL, NULL);
        kvt_redis_free(c);
        if (up) return true;
    }
    fx_print_file("redis-server log", r->log);
    return false;
}

static void redis_stop(rsrv *r)
{
    if (r->pid > 0) {
        kill(r->pid, SIGCONT);
        kill(r->pid, SIGKILL);
        waitpid(r->pid, NULL, 0);
    }
    r->pid = 0;
    char c[128];
    snprintf(c, sizeof c, "rm -rf '%s'", r->dir);
    if (r->dir[0] && system(c)) {}
}

static bool write_file(const char *path, const char *text)
{
    return fx_write_file(path, text, strlen(text));
}

/* A tier on r for model m, the tests' deadlines (generous: a loaded CI
 * machine must not turn a hit into a timeout). */
static kvt_remote *tier(const rsrv *r, kvt_model *m, const char *secret_file, const char *const *tenants,
                        size_t n_tenants)
{
    kvt_remote_opts o = {.url = r->url, .secret_file = secret_file, .tenants = tenants, .n_tenants = n_tenants,
                         .keyed_tenants = tenants != NULL, .lookup_ms = 1000, .load_ms = 2000, .quiet = true};
    kvt_remote *t = NULL;
    if (kvt_remote_open(&t, m, &o)) printf("    kvt_remote_open: %s\n", kvt_errmsg());
    return t;
}

enum { N = 300 };

/* A session of t[0..n) run cold (the reference) and uploaded at n. */
static kvt_session *upload_cold(kvt_remote *rt, int tenant, kvt_model *m, const int32_t *t, size_t n)
{
    kvt_session *s = NULL;
    if (kvt_session_new(&s, m, NULL) || kvt_session_sync(s, t, n, NULL)) return NULL;
    kvt_remote_upload(rt, tenant, s, n);
    if (!kvt_remote_drain(rt, 10)) printf("    the upload queue did not drain\n");
    return s;
}

/* Restore t[0..n) from the tier into a fresh session; *got its length. */
static kvt_session *fetch(kvt_remote *rt, int tenant, kvt_model *m, const int32_t *t, size_t n, size_t *got)
{
    kvt_session *s = NULL;
    *got = 0;
    if (kvt_session_new(&s, m, NULL)) return NULL;
    kvt_remote_restore(rt, tenant, s, t, n, 0, got);
    return s;
}

TEST(remote_hit_bit_exact)
{
    const char *why = no_redis();
    if (why) SKIP("%s", why);
    rsrv r;
    CHECK(redis_start(&r, NULL));
    kvt_model *m = tiny();
    int32_t t[N + 40];
    seqb(t, N + 40, 5);
    kvt_remote *a = tier(&r, m, NULL, NULL, 0), *b = tier(&r, m, NULL, NULL, 0);
    CHECK(a && b);
    kvt_session *cold = upload_cold(a, 0, m, t, N);
    CHECK(cold);
    kvt_remote_stats st;
    kvt_remote_stats_get(a, &st);
    CHECKF(st.uploads == 1 && st.dropped == 0, "uploads %llu dropped %llu", (unsigned long long)st.uploads,
           (unsigned long long)st.dropped);
    /* server B: the same prompt, and a longer one, hit the 300 tokens A saved */
    size_t got = 0;
    kvt_session *s = fetch(b, 0, m, t, N + 40, &got);
    CHECKF(got == N, "hit of %zu tokens, want %d", got, N);
    CHECK(kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    CHECK_OK(kvt_session_sync(s, t, N + 40, NULL));
    CHECK_OK(kvt_session_sync(cold, t, N + 40, NULL));
    CHECK(kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    kvt_remote_stats_get(b, &st);
    CHECK(st.hits == 1 && st.bad == 0 && st.bytes_read > 0);
    /* a second upload of the same prefix sends nothing */
    kvt_remote_upload(b, 0, s, N);
    CHECK(kvt_remote_drain(b, 10));
    kvt_remote_stats_get(b, &st);
    CHECK(st.uploads == 0);
    /* another prompt on the same first block: a miss, no error */
    int32_t u[N];
    memcpy(u, t, sizeof u);
    u[200] ^= 1;
    kvt_session *s2 = fetch(b, 0, m, u, N, &got);
    CHECK(got == 0 && kvt_session_len(s2) == 0);
    /* values in parts: the same prefix through 1000-byte parts */
    kvt_remote_part_bytes = 1000;
    CHECK(cmd_ok(raw(&r, NULL), "FLUSHALL", NULL, NULL));
    kvt_session_free(upload_cold(a, 0, m, t, N));
    kvt_session *s3 = fetch(b, 0, m, t, N, &got);
    kvt_remote_part_bytes = 1u << 20;
    CHECKF(got == N, "hit through parts: %zu tokens", got);
    CHECK_OK(kvt_session_sync(s3, t, N + 40, NULL));
    CHECK(kvt_test_digest(s3, m) == kvt_test_digest(cold, m));
    kvt_session_free(s); kvt_session_free(s2); kvt_session_free(s3); kvt_session_free(cold);
    kvt_remote_close(a);
    kvt_remote_close(b);
    kvt_model_close(m);
    redis_stop(&r);
}
