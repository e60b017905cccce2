/* TLS for the Redis client (see tls.h): an SSL_CTX that verifies the
 * server, and the non-blocking steps conn.c drives with poll. The socket
 * stays conn.c's: SSL_set_fd, never a BIO of OpenSSL's own, so that one
 * poll loop serves plain and TLS connections alike. */
#include "store/tls.h"
#include "base/util.h"

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <time.h>
#include <string.h>
#include <openssl/err.h>
#include <openssl/x509v3.h>

int kvt_tls_fault;

struct kvt_tls {
    SSL_CTX *ctx;
};

/* OpenSSL's reason for the last failure, its error queue emptied. */
static const char *ssl_reason(char *buf, size_t cap)
{
    unsigned long e = ERR_get_error(), last = e;
    while (e) { last = e; e = ERR_get_error(); }
    if (!last) snprintf(buf, cap, "%s", errno ? strerror(errno) : "unknown error");
    else ERR_error_string_n(last, buf, cap);
    return buf;
}

int kvt_tls_new(kvt_tls **out, const char *ca, const char *cert, const char *key)
{
    *out = NULL;
    char why[256];
    if (!cert != !key)
        return kvt_fail(KVT_EINVAL, "TLS: --kv-remote-cert and --kv-remote-key go together (the client's certificate "
                        "and its key)");
    kvt_tls *t = kvt_calloc(1, sizeof *t);
    if (!t) return KVT_ENOMEM;
    ERR_clear_error();
    int rc = KVT_OK;
    if (!(t->ctx = SSL_CTX_new(TLS_client_method()))) {
        rc = kvt_fail(KVT_ENOMEM, "TLS: no context: %s", ssl_reason(why, sizeof why));
        goto fail;
    }
    SSL_CTX_set_min_proto_version(t->ctx, TLS1_2_VERSION);
    SSL_CTX_set_mode(t->ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    if (ca ? !SSL_CTX_load_verify_locations(t->ctx, ca, NULL) : !SSL_CTX_set_default_verify_paths(t->ctx)) {
        rc = kvt_fail(KVT_EIO, "TLS: --kv-remote-ca %s: %s", ca ? ca : "(the system's CAs)", ssl_reason(why, sizeof why));
        goto fail;
    }
    if (cert && !SSL_CTX_use_certificate_chain_file(t->ctx, cert)) {
        rc = kvt_fail(KVT_EIO, "TLS: --kv-remote-cert %s: %s", cert, ssl_reason(why, sizeof why));
        goto fail;
    }
    if (key && (!SSL_CTX_use_PrivateKey_file(t->ctx, key, SSL_FILETYPE_PEM) || !SSL_CTX_check_private_key(t->ctx))) {
        rc = kvt_fail(KVT_EIO, "TLS: --kv-remote-key %s: %s", key, ssl_reason(why, sizeof why));
        goto fail;
    }
    SSL_CTX_set_verify(t->ctx, kvt_tls_fault & KVT_TLS_FAULT_NO_CHAIN ? SSL_VERIFY_NONE : SSL_VERIFY_PEER, NULL);
    *out = t;
    return KVT_OK;
fail:
    kvt_tls_free(t);
    return rc;
}

void kvt_tls_free(kvt_tls *t)
{
    if (!t) return;
    SSL_CTX_free(t->ctx);
    free(t);
}

SSL *kvt_tls_open(kvt_tls *t, int fd, const char *host)
{
    char why[256];
    ERR_clear_error();
    SSL *s = SSL_new(t->ctx);
    if (!s || !SSL_set_fd(s, fd)) {
        kvt_fail(KVT_ENOMEM, "TLS: %s", ssl_reason(why, sizeof why));
        SSL_free(s);
        return NULL;
    }
    unsigned char addr[16];
    bool is_ip = inet_pton(AF_INET, host, addr) == 1 || inet_pton(AF_INET6, host, addr) == 1;
    int ok = 1;
    if (!(kvt_tls_fault & KVT_TLS_FAULT_NO_HOST)) {
        if (is_ip) ok = X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(s), host);
        else ok = SSL_set1_host(s, host);
    }
    if (ok && !is_ip) ok = SSL_set_tlsext_host_name(s, host); /* SNI: never an address (RFC 6066) */
    if (!ok) {
        kvt_fail(KVT_EINVAL, "TLS: host %s: %s", host, ssl_reason(why, sizeof why));
        SSL_free(s);
        return NULL;
    }
    SSL_set_connect_state(s);
    return s;
}

/* OpenSSL writes to the socket with write(), not send(MSG_NOSIGNAL): a
 * server that closed the connection would raise SIGPIPE, which kills a
 * process that does not ignore it (the CLI, the tests). So SIGPIPE is
 * blocked on this thread around each call, and one it raised is taken
 * before it is unblocked. */
typedef struct nopipe {
    sigset_t old;
    bool was_pending;
} nopipe;

static void nopipe_begin(nopipe *n)
{
    sigset_t pipe, pend;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    sigemptyset(&pend);
    sigpending(&pend);
    n->was_pending = sigismember(&pend, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, &n->old);
}

static void nopipe_end(nopipe *n)
{
    sigset_t pipe, pend;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    sigemptyset(&pend);
    if (!n->was_pending && !sigpending(&pend) && sigismember(&pend, SIGPIPE)) {
        struct timespec zero = {0, 0};
        int e = errno;
        sigtimedwait(&pipe, NULL, &zero);
        errno = e;
    }
    pthread_sigmask(SIG_SETMASK, &n->old, NULL);
}

/* What a failed call wants: 0 would block (*events set), -1 an error. */
static int want(SSL *s, int ret, short *events, const char *what)
{
    int e = SSL_get_error(s, ret);
    if (e == SSL_ERROR_WANT_READ) { *events = POLLIN; return 0; }
    if (e == SSL_ERROR_WANT_WRITE) { *events = POLLOUT; return 0; }
    char why[256];
    if (e == SSL_ERROR_ZERO_RETURN) return kvt_fail(KVT_EIO, "TLS %s: connection closed", what), -1;
    if (e == SSL_ERROR_SYSCALL && !ERR_peek_error())
        return kvt_fail(KVT_EIO, "TLS %s: %s", what, errno ? strerror(errno) : "connection closed"), -1;
    long v = SSL_get_verify_result(s);
    if (v != X509_V_OK)
        return kvt_fail(KVT_EIO, "TLS %s: the server's certificate is refused: %s", what,
                        X509_verify_cert_error_string(v)), -1;
    return kvt_fail(KVT_EIO, "TLS %s: %s", what, ssl_reason(why, sizeof why)), -1;
}

int kvt_tls_handshake(SSL *s, short *events)
{
    ERR_clear_error();
    errno = 0;
    nopipe np;
    nopipe_begin(&np);
    int r = SSL_connect(s);
    nopipe_end(&np);
    if (r == 1) return 1;
    return want(s, r, events, "handshake") ? KVT_EIO : 0;
}

ssize_t kvt_tls_read(SSL *s, void *buf, size_t len, short *events)
{
    ERR_clear_error();
    errno = 0;
    nopipe np;
    nopipe_begin(&np);
    int n = SSL_read(s, buf, len > 1 << 30 ? 1 << 30 : (int)len);
    nopipe_end(&np);
    if (n > 0) return n;
    return want(s, n, events, "read");
}

ssize_t kvt_tls_write(SSL *s, const void *buf, size_t len, short *events)
{
    ERR_clear_error();
    errno = 0;
    nopipe np;
    nopipe_begin(&np);
    int n = SSL_write(s, buf, len > 1 << 30 ? 1 << 30 : (int)len);
    nopipe_end(&np);
    if (n > 0) return n;
    return want(s, n, events, "write");
}
