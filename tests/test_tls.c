/* rediss:// (src/store/tls.c over src/store/conn.c) against a real
 * redis-server started with --tls-port and --port 0 and certificates each
 * test makes with the openssl command: a CA, a server certificate for
 * 127.0.0.1 and localhost, another CA, a certificate of the right CA for
 * another name, a client certificate. The right CA hits bit for bit as
 * plain redis:// does; another CA and another name are refused (a miss
 * naming the check, the prompt prefilled), and hit when the check is
 * faulted away (the negative controls); a server that asks for a client
 * certificate refuses a tier without one; a stopped server costs the
 * handshake its deadline. */
#include "test.h"
#include "fixture.h"
#include "ds4_tiny.h"
#include "redis_fx.h"
#include "store/remote.h"
#include "store/tls.h"
#include "arch/model.h"

#include <signal.h>

/* redis-server on TLS only (--port 0), serving cert/key, its clients'
 * certificates checked against the test CA as `clients` says (no,
 * optional, yes). */
static bool tls_start(rfx *r, const certs *c, const char *cert, const char *key, const char *clients, char *url,
                      size_t cap)
{
    int port = fx_free_port();
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    const char *args[] = {"--port", "0", "--tls-port", ps, "--tls-cert-file", cert, "--tls-key-file", key,
                          "--tls-ca-cert-file", c->ca, "--tls-auth-clients", clients, NULL};
    snprintf(url, cap, "rediss://127.0.0.1:%d", port);
    /* waited for with the faults that let any certificate through: the
     * server's own checks are not what this waits for */
    int f = kvt_tls_fault;
    kvt_tls_fault = KVT_TLS_FAULT_NO_CHAIN | KVT_TLS_FAULT_NO_HOST;
    kvt_redis_url u;
    bool ok = !kvt_redis_parse_url(url, &u);
    if (!strcmp(clients, "yes")) { /* the probe needs a client certificate */
        u.cert = c->cli;
        u.key = c->cli_key;
    }
    ok = ok && rfx_start(r, port, args, true, &u);
    kvt_tls_fault = f;
    return ok;
}

static kvt_remote *tls_tier(kvt_model *m, const char *url, const char *ca, const char *cert, const char *key,
                            int lookup_ms)
{
    kvt_remote_opts o = {.url = url, .tls_ca = ca, .tls_cert = cert, .tls_key = key, .lookup_ms = lookup_ms,
                         .load_ms = 2000, .connect_ms = lookup_ms, .quiet = true};
    kvt_remote *t = NULL;
    if (kvt_remote_open(&t, m, &o)) printf("    kvt_remote_open: %s\n", kvt_errmsg());
    return t;
}

enum { N = 300 };

/* A cold session of t[0..n), uploaded through rt. */
static kvt_session *cold_upload(kvt_remote *rt, kvt_model *m, const int32_t *t, size_t n)
{
    kvt_session *s = NULL;
    if (kvt_session_new(&s, m, NULL) || kvt_session_sync(s, t, n, NULL)) return NULL;
    kvt_remote_upload(rt, 0, s, n);
    if (!kvt_remote_drain(rt, 10)) printf("    the upload queue did not drain\n");
    return s;
}

/* Restore t[0..n) through rt into a new session: the hit's length in *got;
 * then the rest prefilled, as a request would. */
static kvt_session *restore(kvt_remote *rt, kvt_model *m, const int32_t *t, size_t n, size_t *got)
{
    kvt_session *s = NULL;
    *got = 0;
    if (kvt_session_new(&s, m, NULL)) return NULL;
    kvt_remote_restore(rt, 0, s, t, n, 0, got);
    if (kvt_session_sync(s, t, n, NULL)) { kvt_session_free(s); return NULL; }
    return s;
}

#define TLS_TEST(name)                                                      \
    static void name##_body(certs *c);                                      \
    TEST(name)                                                              \
    {                                                                       \
        const char *why_ = no_tls_tools();                                  \
        if (why_) SKIP("%s", why_);                                         \
        certs c_;                                                           \
        CHECKF(make_certs(&c_), "the test certificates were not made");     \
        name##_body(&c_);                                                   \
        certs_remove(&c_);                                                  \
    }                                                                       \
    static void name##_body(certs *c)

/* The right CA: a second tier (another server's) hits what the first
 * uploaded, by address and by name, bit for bit with the cold run. */
TLS_TEST(tls_good_ca_hits)
{
    const char *why = redis_without_tls();
    if (why) SKIP("%s", why);
    rfx r;
    char url[96], by_name[96];
    CHECKF(tls_start(&r, c, c->srv, c->srv_key, "no", url, sizeof url), "redis-server with TLS did not start");
    snprintf(by_name, sizeof by_name, "rediss://localhost:%d", r.port);
    kvt_model *m = tiny();
    int32_t t[N + 40];
    seqb(t, N + 40, 21);
    kvt_remote *a = tls_tier(m, url, c->ca, NULL, NULL, 1000), *b = tls_tier(m, by_name, c->ca, NULL, NULL, 1000);
    CHECK(a && b);
    kvt_session *cold = cold_upload(a, m, t, N);
    CHECK(cold);
    kvt_remote_stats st;
    kvt_remote_stats_get(a, &st);
    CHECKF(st.uploads == 1 && st.errors == 0, "uploads %llu errors %llu (%s)", (unsigned long long)st.uploads,
           (unsigned long long)st.errors, st.last_error);
    size_t got;
    kvt_session *s = restore(b, m, t, N, &got);
    kvt_remote_stats_get(b, &st);
    CHECKF(got == N, "a hit of %zu tokens over TLS, want %d (%s)", got, N, st.last_error);
    CHECK(s && kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    kvt_session_free(s);
    /* a pipeline far larger than the socket buffers, each way: SSL_write
     * and SSL_read wait on poll for what they want, the bytes come back
     * whole */
    kvt_redis_url u;
    kvt_redis *k = NULL;
    CHECK_OK(kvt_redis_parse_url(url, &u));
    u.ca = c->ca;
    CHECK_OK(kvt_redis_new(&k, &u, NULL));
    enum { BIG = 4 << 20, PIPE = 4 };
    uint8_t *big = malloc(BIG);
    CHECK(big);
    for (size_t i = 0; i < BIG; i++) big[i] = (uint8_t)(i * 2654435761u >> 13);
    char name[PIPE][16];
    for (int i = 0; i < PIPE; i++) {
        snprintf(name[i], sizeof name[i], "big%d", i);
        const char *a3[3] = {"SET", name[i], (const char *)big};
        size_t l3[3] = {3, strlen(name[i]), BIG};
        CHECK_OK(kvt_redis_append(k, 3, a3, l3));
    }
    for (int i = 0; i < PIPE; i++) {
        const char *a2[2] = {"GET", name[i]};
        CHECK_OK(kvt_redis_append(k, 2, a2, NULL));
    }
    redisReply **rep = NULL;
    size_t nr = 0;
    double t0 = fx_now();
    CHECK_OK(kvt_redis_exec(k, 20000, &rep, &nr));
    double dt = fx_now() - t0;
    bool same = nr == 2 * PIPE;
    for (int i = 0; same && i < PIPE; i++)
        same = rep[PIPE + i]->type == REDIS_REPLY_STRING && rep[PIPE + i]->len == BIG &&
               !memcmp(rep[PIPE + i]->str, big, BIG);
    printf("    %d MiB sent and read back over TLS in one pipeline: %.0f ms\n", 2 * PIPE * (BIG >> 20), dt * 1000);
    CHECK(same);
    kvt_redis_replies_free(rep, nr);
    kvt_redis_free(k);
    free(big);
    kvt_session_free(cold);
    kvt_remote_close(a);
    kvt_remote_close(b);
    kvt_model_close(m);
    rfx_stop(&r);
}

/* A certificate the tier refuses, one row each: the server's chain to
 * another CA than the one given, and a certificate of the right CA for
 * another name than the host connected to. Each is refused by the
 * handshake: the lookup is a miss naming the check, its errors count
 * one, the prompt is prefilled to the cold run's state, and an upload is
 * dropped unsent. The negative control of each row: with its check
 * faulted away (kvt_tls_fault), the same tier hits. */
typedef struct refusal {
    const char *what;
    bool other_cert;     /* the server serves other.example's certificate, else 127.0.0.1's */
    bool other_ca;       /* the tier is given the second CA */
    int upload_fault;    /* what the uploading tier needs to get in */
    int control;         /* the check faulted away */
    const char *says;    /* in the lookup's error */
} refusal;

static const refusal refusals[] = {
    {"another CA", false, true, 0, KVT_TLS_FAULT_NO_CHAIN, "certificate"},
    {"a certificate for other.example at 127.0.0.1", true, false, KVT_TLS_FAULT_NO_HOST, KVT_TLS_FAULT_NO_HOST,
     "mismatch"},
};

static void refused_row(const certs *c, const refusal *f, uint64_t seed)
{
    rfx r;
    char url[96];
    CHECKF(tls_start(&r, c, f->other_cert ? c->other : c->srv, f->other_cert ? c->other_key : c->srv_key, "no", url,
                     sizeof url),
           "%s: redis-server with TLS did not start", f->what);
    kvt_model *m = tiny();
    int32_t t[N];
    seqb(t, N, seed);
    kvt_tls_fault = f->upload_fault;
    kvt_remote *a = tls_tier(m, url, c->ca, NULL, NULL, 1000);
    kvt_session *cold = a ? cold_upload(a, m, t, N) : NULL;
    kvt_tls_fault = 0;
    kvt_remote *bad = tls_tier(m, url, f->other_ca ? c->ca2 : c->ca, NULL, NULL, 1000);
    size_t got = 0;
    kvt_session *s = cold && bad ? restore(bad, m, t, N, &got) : NULL;
    kvt_remote_stats st = {0};
    if (bad) kvt_remote_stats_get(bad, &st);
    printf("    %s: %s\n", f->what, st.last_error);
    bool refused = cold && bad && got == 0 && st.misses == 1 && st.errors == 1 && strstr(st.last_error, f->says);
    bool prefilled = s && kvt_test_digest(s, m) == kvt_test_digest(cold, m);
    kvt_session_free(s);
    s = NULL;
    if (bad) kvt_remote_stats_get(bad, &st);
    uint64_t dropped = st.dropped;
    if (refused) kvt_remote_upload(bad, 0, cold, N); /* its upload is refused too: nothing of it is sent */
    if (bad) kvt_remote_stats_get(bad, &st);
    bool no_upload = st.uploads == 0 && st.dropped == dropped + 1;
    kvt_remote_close(bad);
    kvt_tls_fault = f->control;
    bad = tls_tier(m, url, f->other_ca ? c->ca2 : c->ca, NULL, NULL, 1000);
    size_t ctl = 0;
    s = bad && cold ? restore(bad, m, t, N, &ctl) : NULL;
    kvt_tls_fault = 0;
    kvt_session_free(s);
    kvt_session_free(cold);
    kvt_remote_close(a);
    kvt_remote_close(bad);
    kvt_model_close(m);
    rfx_stop(&r);
    CHECKF(refused && prefilled && no_upload, "%s: a hit of %zu, errors %llu, '%s'; prefilled %d, upload refused %d",
           f->what, got, (unsigned long long)st.errors, st.last_error, prefilled, no_upload);
    CHECKF(ctl == N, "the control of %s: with the check faulted away the tier hits (got %zu)", f->what, ctl);
}

TLS_TEST(tls_refused_certificates_miss)
{
    const char *why = redis_without_tls();
    if (why) SKIP("%s", why);
    for (size_t i = 0; i < sizeof refusals / sizeof refusals[0] && !kvt_test_failed(); i++)
        refused_row(c, &refusals[i], 22 + i);
}

/* Mutual TLS: a server that asks for a client certificate refuses a tier
 * without one, and serves one with --kv-remote-cert/--kv-remote-key. */
TLS_TEST(tls_client_certificate)
{
    const char *why = redis_without_tls();
    if (why) SKIP("%s", why);
    rfx r;
    char url[96];
    CHECKF(tls_start(&r, c, c->srv, c->srv_key, "yes", url, sizeof url), "redis-server with TLS did not start");
    kvt_model *m = tiny();
    int32_t t[N];
    seqb(t, N, 24);
    kvt_remote *with = tls_tier(m, url, c->ca, c->cli, c->cli_key, 1000), *without = tls_tier(m, url, c->ca, NULL, NULL, 1000);
    CHECK(with && without);
    kvt_session *cold = cold_upload(with, m, t, N);
    CHECK(cold);
    size_t got;
    kvt_session *s = restore(without, m, t, N, &got);
    kvt_remote_stats st;
    kvt_remote_stats_get(without, &st);
    printf("    no client certificate: %s\n", st.last_error);
    CHECKF(got == 0 && st.errors == 1, "without a client certificate: a hit of %zu", got);
    kvt_session_free(s);
    kvt_remote *b = tls_tier(m, url, c->ca, c->cli, c->cli_key, 1000);
    s = b ? restore(b, m, t, N, &got) : NULL;
    kvt_remote_stats_get(b, &st);
    CHECKF(got == N, "with the client certificate: a hit of %zu (%s)", got, st.last_error);
    CHECK(s && kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    kvt_session_free(s);
    kvt_session_free(cold);
    kvt_remote_close(with);
    kvt_remote_close(without);
    kvt_remote_close(b);
    kvt_model_close(m);
    rfx_stop(&r);
}

/* A stopped server (SIGSTOP) accepts the TCP connection in the kernel but
 * never answers the handshake: the lookup ends by its deadline, a miss. */
TLS_TEST(tls_stopped_server_deadline)
{
    const char *why = redis_without_tls();
    if (why) SKIP("%s", why);
    rfx r;
    char url[96];
    CHECKF(tls_start(&r, c, c->srv, c->srv_key, "no", url, sizeof url), "redis-server with TLS did not start");
    kvt_model *m = tiny();
    int32_t t[N];
    seqb(t, N, 25);
    kill(r.pid, SIGSTOP);
    kvt_remote *b = tls_tier(m, url, c->ca, NULL, NULL, 100);
    CHECK(b);
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    size_t got = 1;
    double t0 = fx_now();
    kvt_remote_restore(b, 0, s, t, N, 0, &got);
    double dt = fx_now() - t0;
    kvt_remote_stats st;
    kvt_remote_stats_get(b, &st);
    printf("    a lookup with a 100 ms deadline, the server stopped: %.0f ms, %s\n", dt * 1000, st.last_error);
    /* 100 ms deadline; 1 s is the margin of a loaded CI machine */
    CHECKF(got == 0 && dt < 1.0 && strstr(st.last_error, "timed out"), "got %zu in %.0f ms: %s", got, dt * 1000,
           st.last_error);
    kill(r.pid, SIGCONT);
    kvt_session_free(s);
    kvt_remote_close(b);
    kvt_model_close(m);
    rfx_stop(&r);
}

/* Through kvtier serve: server A answers a prompt cold over rediss:// and
 * uploads it; server B, with an empty disk, answers it from the remote
 * tier (X-KVTier-Cache: remote) with A's reply and top-5 logprobs; server
 * C, given another CA, answers it too (200, prefilled, the same reply),
 * its log naming the refused certificate. Run against a build without TLS
 * (KVT_BIN=/work/main/build/kvtier) server A does not start. */
TLS_TEST(tls_serve_two_servers)
{
    const char *why = redis_without_tls();
    if (why) SKIP("%s", why);
    if (system("command -v curl >/dev/null 2>&1")) SKIP("curl is not on PATH");
    rfx r;
    char url[96];
    CHECKF(tls_start(&r, c, c->srv, c->srv_key, "no", url, sizeof url), "redis-server with TLS did not start");
    const char *good[] = {"--kv-remote", url, "--kv-remote-ca", c->ca, NULL};
    const char *bad[] = {"--kv-remote", url, "--kv-remote-ca", c->ca2, NULL};
    char *cold = NULL, *warm = NULL, *refused = NULL, *log = NULL, ca[96], cb[96], cc[96];
    CHECK(rfx_serve_once("kvtier-tls-a", good, &cold, ca, sizeof ca, NULL));
    CHECK(rfx_serve_once("kvtier-tls-b", good, &warm, cb, sizeof cb, NULL));
    CHECK(rfx_serve_once("kvtier-tls-c", bad, &refused, cc, sizeof cc, &log));
    printf("    A: %s; B: %s; C (another CA): %s\n", ca, cb, cc);
    CHECKF(strstr(cb, "remote"), "server B did not hit the remote tier over TLS: %s", cb);
    CHECKF(!strcmp(cold, warm), "server B's reply differs from A's cold run:\n%.300s\n%.300s", cold, warm);
    CHECKF(!strstr(cc, "remote") && !strcmp(cold, refused), "server C: %s\n%.300s", cc, refused);
    const char *say = log ? strstr(log, "certificate is refused") : NULL;
    printf("    C's log: %.*s\n", say ? (int)strcspn(say, "\n") : 4, say ? say : "none");
    CHECK(say);
    /* cache ls over TLS lists the entry A uploaded */
    char ls[600], lsout[] = "/tmp/kvtier-tls-ls-XXXXXX";
    int fd = mkstemp(lsout);
    CHECK(fd >= 0);
    if (fd >= 0) close(fd);
    snprintf(ls, sizeof ls, "%s cache ls --kv-remote '%s' --kv-remote-ca '%s' > '%s' 2>&1", kvt_test_bin(), url, c->ca,
             lsout);
    int st = system(ls);
    char *lst = kvt_test_read_file(lsout, NULL);
    unlink(lsout);
    CHECKF(st == 0 && lst && strstr(lst, ":open ") && strstr(lst, " 672 "), "cache ls over TLS:\n%s", lst);
    free(lst);
    free(cold); free(warm); free(refused); free(log);
    rfx_stop(&r);
}
