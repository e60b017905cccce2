/* redis-server processes for the tests of the remote tier and the Redis
 * client's transports (tests/test_remote.c, tests/test_tls.c,
 * tests/test_cluster.c): started with the arguments a test gives, on
 * ports from fx_free_port(), in a temporary directory, and waited for with
 * the client under test; killed, and their directories removed, whatever
 * the checks say (the runner's cleanup list, test.h). */
#ifndef KVT_TEST_REDIS_FX_H
#define KVT_TEST_REDIS_FX_H

#include "fixture.h"
#include "test.h"
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
    char url[64];      /* redis://127.0.0.1:PORT */
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
 * the port themselves: then `port` is only remembered; a port given again
 * starts a Redis anew where one was killed). Waits until a client for
 * probe (its TLS files too; NULL: r->url) answers PING, with the
 * --requirepass of args; false (the log printed) if not in 10 s. */
static __attribute__((unused)) bool rfx_start(rfx *r, int port, const char *const *args, bool args_set_port,
                                              const kvt_redis_url *probe)
{
    memset(r, 0, sizeof *r);
    snprintf(r->dir, sizeof r->dir, "/tmp/kvtier-rfx-XXXXXX");
    if (!kvt_test_mkdtemp(r->dir)) return false; /* removed after the test whatever happens */
    char dir[sizeof r->dir];
    memcpy(dir, r->dir, sizeof dir);
    snprintf(r->log, sizeof r->log, "%s/redis.log", dir);
    r->port = port ? port : fx_free_port();
    snprintf(r->url, sizeof r->url, "redis://127.0.0.1:%d", r->port);
    kvt_redis_url plain;
    if (!probe && kvt_redis_parse_url(r->url, &plain)) return false;
    if (!probe) probe = &plain;
    const char *pw = NULL;
    for (int i = 0; args && args[i]; i++)
        if (!strcmp(args[i], "--requirepass") && args[i + 1]) pw = args[i + 1];
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
    kvt_test_defer_pid(pid); /* killed after the test when a check left it running */
    for (double end = fx_now() + 10; fx_now() < end; fx_sleep_ms(20)) {
        kvt_redis *c = NULL;
        const char *ping[1] = {"PING"};
        bool up = !kvt_redis_new(&c, probe, pw) && rfx_cmd(c, NULL, 1, ping);
        kvt_redis_free(c);
        if (up) return true;
        int st;
        if (waitpid(r->pid, &st, WNOHANG) == r->pid) { kvt_test_forget_pid(r->pid); r->pid = 0; break; }
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
        kvt_test_forget_pid(r->pid);
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


/* ---- two servers through a remote tier ---- */

/* POST the file body to base/path: the answer's body in out, its headers
 * in hdr; the HTTP status (-1: no answer). */
static __attribute__((unused)) int rfx_post(const char *base, const char *path, const char *body, const char *out,
                                            const char *hdr)
{
    char c[1024];
    snprintf(c, sizeof c, "curl -s -o '%s' -D '%s' -w '%%{http_code}' --max-time 60 -H 'content-type: application/json' "
             "--data-binary @'%s' '%s%s'", out, hdr, body, base, path);
    FILE *f = popen(c, "r");
    if (!f) return -1;
    char code[16] = {0};
    size_t n = fread(code, 1, sizeof code - 1, f);
    code[n] = 0;
    pclose(f);
    return atoi(code) > 0 ? atoi(code) : -1;
}

/* From "choices" on: the reply and its logprobs, without the usage (its
 * cached-token counts differ by design). */
static __attribute__((unused)) char *rfx_choices(const char *path)
{
    char *s = kvt_test_read_file(path, NULL);
    char *c = s ? strstr(s, "\"choices\"") : NULL;
    char *out = c ? strdup(c) : strdup("(no choices)");
    char *u = strstr(out, "\"usage\"");
    if (u) *u = 0;
    free(s);
    return out;
}

/* One request of a 700-character prompt to a server started with remote
 * (the --kv-remote flags) and an empty disk of its own: the reply's
 * choices (*reply, malloc'ed), its X-KVTier-Cache header line (*cache);
 * its log in *log (malloc'ed) when log is given. false when the server
 * did not start or answer 200. */
static __attribute__((unused)) bool rfx_serve_once(const char *name, const char *const *remote, char **reply,
                                                   char *cache, size_t cap, char **log)
{
    fx_server s = {0};
    *reply = NULL;
    cache[0] = 0;
    if (!fx_tmpdir_make(&s, name)) return false;
    char body[160], out[160], hdr[160], kv[128];
    snprintf(body, sizeof body, "%s/req.json", s.dir);
    snprintf(out, sizeof out, "%s/out.json", s.dir);
    snprintf(hdr, sizeof hdr, "%s/out.hdr", s.dir);
    snprintf(kv, sizeof kv, "%s/kv", s.dir);
    FILE *f = fopen(body, "w");
    if (!f) return false;
    fputs("{\"model\":\"m\",\"max_tokens\":6,\"temperature\":0,\"logprobs\":true,\"top_logprobs\":5,"
          "\"messages\":[{\"role\":\"user\",\"content\":\"", f);
    for (int i = 0; i < 700; i++) fputc("abcdefghijklmnopqrstuvwxyz 0123456789"[i * 11 % 37], f);
    fputs("\"}]}", f);
    fclose(f);
    /* a load's deadline from a prefill rate of 50 tokens/s (13 s), not
     * from the FLOPs of ds4-tiny's prefill (20 ms, counted from the
     * lookup's start, which connects to every master first): a slow CI
     * machine, or a sanitizer build, must not turn the hit into a miss */
    const char *args[32] = {"--model", "ds4-tiny", "--kv-disk-dir", kv, "--kv-remote-timeout-ms", "1000",
                            "--kv-remote-prefill-tps", "50"};
    int a = 8;
    for (int i = 0; remote[i] && a < 31; i++) args[a++] = remote[i];
    args[a] = NULL;
    bool ok = fx_server_start(&s, args);
    int code = ok ? rfx_post(s.base, "/v1/chat/completions", body, out, hdr) : -1;
    ok = ok && fx_server_stop(&s) && code == 200; /* stopped: its saves, then their uploads, are done */
    if (code != 200) printf("    %s: HTTP %d\n", name, code);
    *reply = rfx_choices(out);
    char *h = kvt_test_read_file(hdr, NULL), *line = h ? strstr(h, "X-KVTier-Cache: ") : NULL;
    if (line) snprintf(cache, cap, "%.*s", (int)strcspn(line, "\r\n"), line);
    free(h);
    if (log) *log = kvt_test_read_file(s.log, NULL);
    fx_server_kill(&s);
    fx_tmpdir_remove(&s);
    return ok;
}

/* ---- certificates for TLS (tests/test_tls.c, tests/test_cluster.c) ---- */

typedef struct certs {
    char dir[64];
    char ca[96], ca2[96], srv[96], srv_key[96], other[96], other_key[96], cli[96], cli_key[96];
} certs;

static __attribute__((unused)) const char *no_tls_tools(void)
{
    const char *why = rfx_absent();
    if (why) return why;
    if (system("command -v openssl >/dev/null 2>&1")) return "the openssl command is absent (it makes the certificates)";
    return NULL;
}

/* A CA (ca.crt), another CA (ca2.crt), and certificates signed by the
 * first: srv (127.0.0.1, localhost), other (other.example only), cli (a
 * client's). EC P-256 keys: quick to make. */
static __attribute__((unused)) bool make_certs(certs *c)
{
    snprintf(c->dir, sizeof c->dir, "/tmp/kvtier-tls-XXXXXX");
    if (!kvt_test_mkdtemp(c->dir)) return false;
    char cmd[3000];
    snprintf(cmd, sizeof cmd,
             "cd '%s' && K='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes' && "
             "openssl req -x509 $K -keyout ca.key -out ca.crt -days 2 -subj /CN=kvtier-test-ca && "
             "openssl req -x509 $K -keyout ca2.key -out ca2.crt -days 2 -subj /CN=kvtier-test-ca && "
             "for n in srv other cli; do openssl req $K -keyout $n.key -out $n.csr -subj /CN=$n || exit 1; done && "
             "echo 'subjectAltName=IP:127.0.0.1,DNS:localhost' > srv.ext && "
             "echo 'subjectAltName=DNS:other.example' > other.ext && "
             "echo 'extendedKeyUsage=clientAuth' > cli.ext && "
             "for n in srv other cli; do openssl x509 -req -in $n.csr -CA ca.crt -CAkey ca.key -CAcreateserial "
             "-out $n.crt -days 2 -extfile $n.ext || exit 1; done",
             c->dir);
    char full[3200];
    snprintf(full, sizeof full, "(%s) >'%s/openssl.log' 2>&1", cmd, c->dir);
    if (system(full)) {
        char log[128];
        snprintf(log, sizeof log, "%s/openssl.log", c->dir);
        fx_print_file("openssl", log);
        return false;
    }
#define P(f, name) snprintf(c->f, sizeof c->f, "%s/" name, c->dir)
    P(ca, "ca.crt"); P(ca2, "ca2.crt"); P(srv, "srv.crt"); P(srv_key, "srv.key");
    P(other, "other.crt"); P(other_key, "other.key"); P(cli, "cli.crt"); P(cli_key, "cli.key");
#undef P
    return true;
}

static __attribute__((unused)) void certs_remove(certs *c)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", c->dir);
    if (c->dir[0] && system(cmd)) {}
}

/* Debian's redis-server is built with TLS (BUILD_TLS=yes: it links
 * libssl); a build without it refuses --tls-port at start. */
static __attribute__((unused)) const char *redis_without_tls(void)
{
    if (system("ldd \"$(command -v redis-server)\" 2>/dev/null | grep -q libssl"))
        return "this redis-server is built without TLS (it does not link libssl: --tls-port would be refused)";
    return NULL;
}

#endif
