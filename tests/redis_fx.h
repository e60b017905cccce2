/* redis-server processes for the tests of the Redis client's transports
 * (tests/test_tls.c, tests/test_cluster.c): started with the arguments a
 * test gives, on ports from fx_free_port(), in a temporary directory, and
 * waited for with the client under test; killed whatever the checks say. */
#ifndef KVT_TEST_REDIS_FX_H
#define KVT_TEST_REDIS_FX_H

#include "fixture.h"
#include "store/redis.h"
#include "base/util.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct rfx {
    pid_t pid;
    int port;
    char dir[64], log[96];
} rfx;

static __attribute__((unused)) const char *rfx_absent(void)
{
    if (system("command -v redis-server >/dev/null 2>&1"))
        return "redis-server absent (Debian's redis-server, tools/debian-packages)";
    return NULL;
}

/* One command on c; true when it is answered without an error reply
 * (*out, when given, the reply: the caller frees it). */
static __attribute__((unused)) bool rfx_cmd(kvt_redis *c, redisReply **out, int argc, const char *const *argv)
{
    redisReply **rep = NULL;
    size_t n = 0;
    if (out) *out = NULL;
    if (kvt_redis_append(c, argc, argv, NULL) || kvt_redis_exec(c, 5000, &rep, &n) || n != 1) return false;
    bool ok = rep[0]->type != REDIS_REPLY_ERROR;
    if (out) { *out = rep[0]; free(rep); }
    else kvt_redis_replies_free(rep, n);
    return ok;
}

/* A client for url (ca: the TLS CA, NULL for none). */
static __attribute__((unused)) kvt_redis *rfx_client(const char *url, const char *ca)
{
    kvt_redis_url u;
    kvt_redis *c = NULL;
    if (kvt_redis_parse_url(url, &u)) return NULL;
    u.ca = ca;
    if (kvt_redis_new(&c, &u, NULL)) return NULL;
    return c;
}

/* redis-server with args (NULL-terminated) in a directory of its own, r->port
 * given by the caller (0: a free one, passed as --port unless args name
 * the port themselves: then `port` is only remembered). Waits until a
 * client for probe (its TLS files too) answers PING; false (the log
 * printed) if not in 10 s. */
static __attribute__((unused)) bool rfx_start(rfx *r, int port, const char *const *args, bool args_set_port,
                                              const kvt_redis_url *probe)
{
    memset(r, 0, sizeof *r);
    snprintf(r->dir, sizeof r->dir, "/tmp/kvtier-rfx-XXXXXX");
    if (!mkdtemp(r->dir)) return false;
    snprintf(r->log, sizeof r->log, "%s/redis.log", r->dir);
    r->port = port ? port : fx_free_port();
    char ps[16];
    snprintf(ps, sizeof ps, "%d", r->port);
    const char *argv[48] = {"redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", r->dir};
    int a = 9;
    if (!args_set_port) { argv[a++] = "--port"; argv[a++] = ps; }
    for (int i = 0; args && args[i] && a < 46; i++) argv[a++] = args[i];
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
    for (double end = fx_now() + 10; fx_now() < end; fx_sleep_ms(20)) {
        kvt_redis *c = NULL;
        const char *ping[1] = {"PING"};
        bool up = !kvt_redis_new(&c, probe, NULL) && rfx_cmd(c, NULL, 1, ping);
        kvt_redis_free(c);
        if (up) return true;
        int st;
        if (waitpid(r->pid, &st, WNOHANG) == r->pid) { r->pid = 0; break; }
    }
    fx_print_file("redis-server log", r->log);
    return false;
}

static __attribute__((unused)) void rfx_kill(rfx *r)
{
    if (r->pid > 0) {
        kill(r->pid, SIGCONT);
        kill(r->pid, SIGKILL);
        waitpid(r->pid, NULL, 0);
    }
    r->pid = 0;
}

static __attribute__((unused)) void rfx_stop(rfx *r)
{
    rfx_kill(r);
    char c[128];
    snprintf(c, sizeof c, "rm -rf '%s'", r->dir);
    if (r->dir[0] && system(c)) {}
    r->dir[0] = 0;
}

#endif
