/* Connections to Redis servers with deadlines (see conn.h).
 *
 * hiredis 0.14's blocking context has one timeout per connection and its
 * async context needs an event loop; the remote tier needs neither. Here
 * each connection is a small state machine (connecting, the TLS handshake,
 * sending and reading) stepped without blocking, and one poll over every
 * connection of a round trip waits for whichever can move, with the time
 * left. Writing and reading overlap: a long pipeline is read while it is
 * still being sent, so neither side blocks on a full buffer. */
#include "store/conn.h"
#include "base/util.h"

#include <errno.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <time.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

enum { PH_RESOLVE, PH_CONNECT, PH_WAIT_TCP, PH_TLS, PH_IO, PH_DONE };

int kvt_conn_fault;

typedef struct resolve_job resolve_job;
static void job_drop(resolve_job *j);

#define TLS_CHUNK 16384 /* a record's worth: a write that would block is repeated with the same bytes */
#define POLL_STACK 64   /* connections a round trip polls from the stack; more from the heap */

/* ---- a reader whose arrays are bounded ----
 *
 * hiredis 0.14's reader allocates an array's element pointers as soon as
 * it reads the array's header ("*2000000000"), before any element has
 * come, and has no bound of its own: the array functions are wrapped so
 * that a header naming more than KVT_CONN_MAX_ELEMENTS is refused (the
 * reader's "Out of memory", a reply that does not parse: the connection
 * closes). Nesting is bounded by hiredis itself (7 levels). */
static redisReplyObjectFunctions bounded_fn;
static void *(*default_array)(const redisReadTask *, int);
static pthread_once_t bounded_once = PTHREAD_ONCE_INIT;
static bool bounded_ok;

static void *bounded_array(const redisReadTask *t, int elements)
{
    if (elements > KVT_CONN_MAX_ELEMENTS) return NULL;
    return default_array(t, elements);
}

/* hiredis's own functions (one static table, the same for every reader),
 * with createArray wrapped. */
static void bounded_init(void)
{
    redisReader *r = redisReaderCreate();
    if (!r) return;
    bounded_fn = *r->fn;
    default_array = r->fn->createArray;
    bounded_fn.createArray = bounded_array;
    bounded_ok = default_array != NULL;
    redisReaderFree(r);
}

static redisReader *reader_new(void)
{
    pthread_once(&bounded_once, bounded_init);
    if (!bounded_ok) return NULL;
    redisReader *r = redisReaderCreate();
    if (r) r->fn = &bounded_fn;
    return r;
}

void kvt_conn_init(kvt_conn *c, const char *host, int port, const kvt_conn_auth *auth)
{
    memset(c, 0, sizeof *c);
    snprintf(c->host, sizeof c->host, "%s", host);
    c->port = port;
    c->auth = auth;
    c->fd = -1;
}

void kvt_conn_disconnect(kvt_conn *c)
{
    if (c->ssl) SSL_free(c->ssl);
    c->ssl = NULL;
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    if (c->rd) redisReaderFree(c->rd);
    c->rd = NULL;
}

void kvt_conn_close(kvt_conn *c)
{
    kvt_conn_disconnect(c);
    if (c->rj) job_drop(c->rj); /* a thread still resolving frees it when done */
    c->rj = NULL;
    if (c->addrs) freeaddrinfo(c->addrs);
    c->addrs = NULL;
    free(c->hs);
    c->hs = NULL;
}

/* ---- names resolved by a deadline ----
 *
 * getaddrinfo blocks for as long as the resolver takes (a DNS server that
 * does not answer: timeout x attempts x servers, 10 s and more). A name is
 * resolved on a detached thread of its own, which signals an eventfd the
 * round trip polls with its sockets; a round trip that ends first leaves
 * the job running, and the next one waits for it. The job is freed by
 * whichever of the thread and the connection lets go of it last. Chosen
 * over c-ares (libc-ares-dev) so that a name resolves as it does for every
 * other program on the machine (nsswitch: /etc/hosts, systemd-resolved,
 * a container's resolver), and over getaddrinfo_a, which runs the same
 * blocking call on glibc's threads without a way to inject the hang the
 * tests need. */
struct resolve_job {
    pthread_mutex_t mu;
    int refs, efd, gai;
    bool done;
    struct addrinfo *addrs;
    char host[256], port[16];
};

static void job_drop(resolve_job *j)
{
    pthread_mutex_lock(&j->mu);
    bool last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (!last) return;
    if (j->addrs) freeaddrinfo(j->addrs);
    close(j->efd);
    pthread_mutex_destroy(&j->mu);
    free(j);
}

static void *resolve_main(void *arg)
{
    resolve_job *j = arg;
    if (kvt_conn_fault & KVT_RESOLV_FAULT_HANG) {
        struct timespec ts = {1, 0};
        nanosleep(&ts, NULL);
    }
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
    int g = getaddrinfo(j->host, j->port, &hints, &ai);
    pthread_mutex_lock(&j->mu);
    j->gai = g;
    j->addrs = g ? NULL : ai;
    j->done = true;
    pthread_mutex_unlock(&j->mu);
    uint64_t one = 1;
    if (write(j->efd, &one, sizeof one) != sizeof one) {} /* the poll sees it, or the flag does */
    job_drop(j);
    return NULL;
}

/* Start resolving c's host: KVT_OK resolved (c->addrs), 1 under way on
 * a thread (c->rj), KVT_EIO (the message set) when it cannot be. */
static int resolve_start(kvt_conn *c)
{
    if (c->addrs) return KVT_OK;
    if (c->rj) return 1;
    char port[16];
    snprintf(port, sizeof port, "%d", c->port);
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICHOST};
    if (!getaddrinfo(c->host, port, &hints, &c->addrs)) return KVT_OK; /* an address: no resolver asked */
    c->addrs = NULL;
    if (kvt_conn_fault & KVT_RESOLV_FAULT_BLOCKING) { /* the control: no deadline */
        if (kvt_conn_fault & KVT_RESOLV_FAULT_HANG) {
            struct timespec ts = {1, 0};
            nanosleep(&ts, NULL);
        }
        struct addrinfo h = {.ai_socktype = SOCK_STREAM};
        int g = getaddrinfo(c->host, port, &h, &c->addrs);
        if (g) c->addrs = NULL;
        return g ? kvt_fail(KVT_EIO, "redis %s:%d: %s", c->host, c->port, gai_strerror(g)) : KVT_OK;
    }
    resolve_job *j = kvt_calloc(1, sizeof *j);
    if (!j) return kvt_fail(KVT_EIO, "redis %s:%d: no memory to resolve it", c->host, c->port);
    snprintf(j->host, sizeof j->host, "%s", c->host);
    snprintf(j->port, sizeof j->port, "%s", port);
    j->refs = 2;
    pthread_mutex_init(&j->mu, NULL);
    j->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    pthread_attr_t at;
    pthread_t t;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    bool ok = j->efd >= 0 && !pthread_create(&t, &at, resolve_main, j);
    pthread_attr_destroy(&at);
    if (!ok) {
        if (j->efd >= 0) close(j->efd);
        pthread_mutex_destroy(&j->mu);
        free(j);
        return kvt_fail(KVT_EIO, "redis %s:%d: cannot start resolving it", c->host, c->port);
    }
    c->rj = j;
    return 1;
}

/* Whether c's resolution is over: KVT_OK resolved, 1 not yet, KVT_EIO the
 * name does not resolve (the message set; the next round trip asks anew). */
static int resolve_poll(kvt_conn *c)
{
    resolve_job *j = c->rj;
    if (!j) return c->addrs ? KVT_OK : KVT_EIO;
    pthread_mutex_lock(&j->mu);
    bool done = j->done;
    int g = j->gai;
    if (done) {
        c->addrs = j->addrs;
        j->addrs = NULL;
    }
    pthread_mutex_unlock(&j->mu);
    if (!done) return 1;
    c->rj = NULL;
    job_drop(j);
    if (g) return kvt_fail(KVT_EIO, "redis %s:%d: %s", c->host, c->port, gai_strerror(g));
    return KVT_OK;
}

int kvt_conn_resolve(kvt_conn *c, double deadline)
{
    int r = resolve_start(c);
    while (r == 1) {
        double left = deadline - kvt_now();
        if (left <= 0) return kvt_fail(KVT_EIO, "redis %s:%d: resolving the name: timed out", c->host, c->port);
        struct pollfd pf = {c->rj->efd, POLLIN, 0};
        poll(&pf, 1, (int)(left * 1000) + 1);
        r = resolve_poll(c);
    }
    return r;
}

static int ms_left(double deadline)
{
    double d = (deadline - kvt_now()) * 1000.0;
    return d <= 0 ? 0 : d > 1e9 ? 1000000000 : (int)d + 1;
}

/* c failed: its message kept, its replies freed, the connection closed. */
static void fail(kvt_conn *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(kvt_conn *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(c->err, sizeof c->err, "redis %s:%d: ", c->host, c->port);
    vsnprintf(c->err + n, sizeof c->err - (size_t)n, fmt, ap);
    va_end(ap);
    c->rc = KVT_EIO;
    for (size_t i = 0; c->rep && i < c->q_n; i++)
        if (c->rep[i]) freeReplyObject(c->rep[i]);
    free(c->rep);
    c->rep = NULL;
    for (int i = 0; i < 2; i++)
        if (c->hs_rep[i]) freeReplyObject(c->hs_rep[i]);
    memset(c->hs_rep, 0, sizeof c->hs_rep);
    kvt_conn_disconnect(c);
    c->phase = PH_DONE;
}

/* AUTH and SELECT, formatted into c->hs (hs_n commands). */
static int handshake_cmds(kvt_conn *c)
{
    const kvt_conn_auth *a = c->auth;
    free(c->hs);
    c->hs = NULL;
    c->hs_len = c->hs_n = 0;
    char *cmd[2] = {NULL, NULL};
    int len[2] = {0, 0}, k = 0;
    if (a && a->password) {
        bool u = a->user && a->user[0];
        len[k] = u ? redisFormatCommand(&cmd[k], "AUTH %s %s", a->user, a->password)
                   : redisFormatCommand(&cmd[k], "AUTH %s", a->password);
        if (len[k++] < 0) return KVT_ENOMEM;
    }
    if (a && a->db > 0) {
        len[k] = redisFormatCommand(&cmd[k], "SELECT %d", a->db);
        if (len[k++] < 0) { free(cmd[0]); return KVT_ENOMEM; }
    }
    int rc = KVT_OK;
    if (k) {
        c->hs = kvt_malloc((size_t)len[0] + (size_t)len[1] + 1);
        if (!c->hs) rc = KVT_ENOMEM;
        for (int i = 0; i < k && c->hs; i++) {
            memcpy(c->hs + c->hs_len, cmd[i], (size_t)len[i]);
            c->hs_len += (size_t)len[i];
        }
        c->hs_n = c->hs ? (size_t)k : 0;
    }
    for (int i = 0; i < k; i++) free(cmd[i]);
    return rc;
}

static void start_tls_or_io(kvt_conn *c)
{
    if (!(c->rd = reader_new())) { fail(c, "no memory for a reader"); return; }
    if (c->auth && c->auth->tls) {
        if (!(c->ssl = kvt_tls_open(c->auth->tls, c->fd, c->host))) { fail(c, "%s", kvt_errmsg()); return; }
        c->phase = PH_TLS;
    } else {
        c->phase = PH_IO;
    }
}

/* Move c as far as it goes without blocking; revents: what poll saw. */
static void step(kvt_conn *c, short revents)
{
    char in[65536];
    for (;;) {
        switch (c->phase) {
        case PH_RESOLVE: {
            int r = resolve_poll(c);
            if (r == 1) { c->ev = POLLIN; return; }
            if (r) { fail(c, "%s", ""); snprintf(c->err, sizeof c->err, "%s", kvt_errmsg()); return; }
            c->ai = c->addrs;
            c->phase = PH_CONNECT;
            continue;
        }
        case PH_CONNECT: {
            if (!c->ai) { fail(c, "connect: %s", strerror(c->sys_err ? c->sys_err : EIO)); return; }
            struct addrinfo *a = c->ai;
            int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
            if (fd < 0) { c->sys_err = errno; c->ai = a->ai_next; continue; }
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            c->fd = fd;
            if (!connect(fd, a->ai_addr, a->ai_addrlen)) { start_tls_or_io(c); continue; }
            if (errno == EINPROGRESS) { c->phase = PH_WAIT_TCP; c->ev = POLLOUT; return; }
            c->sys_err = errno;
            close(fd);
            c->fd = -1;
            c->ai = a->ai_next;
            continue;
        }
        case PH_WAIT_TCP: {
            if (!(revents & (POLLOUT | POLLERR | POLLHUP))) return;
            int err = 0;
            socklen_t sl = sizeof err;
            if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &sl)) err = errno;
            if (err) { /* the next address, if any */
                close(c->fd);
                c->fd = -1;
                c->ai = c->ai->ai_next;
                c->phase = PH_CONNECT;
                c->sys_err = err;
                revents = 0;
                continue;
            }
            start_tls_or_io(c);
            continue;
        }
        case PH_TLS: {
            int h = kvt_tls_handshake(c->ssl, &c->ev);
            if (h < 0) { fail(c, "%s", kvt_errmsg()); return; }
            if (h == 0) return;
            c->phase = PH_IO;
            continue;
        }
        case PH_IO: {
            size_t total = c->hs_len + c->q_len, want = c->hs_n + c->q_n;
            c->ev = 0;
            while (c->sent < total) {
                const char *p = c->sent < c->hs_len ? c->hs + c->sent : c->q + (c->sent - c->hs_len);
                size_t l = c->sent < c->hs_len ? c->hs_len - c->sent : total - c->sent;
                ssize_t w;
                short ev = POLLOUT;
                if (c->ssl) {
                    w = kvt_tls_write(c->ssl, p, l < TLS_CHUNK ? l : TLS_CHUNK, &ev);
                    if (w < 0) { fail(c, "%s", kvt_errmsg()); return; }
                } else {
                    w = send(c->fd, p, l, MSG_NOSIGNAL);
                    if (w < 0 && errno != EAGAIN && errno != EINTR) { fail(c, "send: %s", strerror(errno)); return; }
                    if (w < 0) w = 0;
                }
                if (w == 0) { c->ev |= ev; break; }
                c->sent += (size_t)w;
            }
            while (c->got < want) {
                void *reply = NULL;
                if (redisReaderGetReply(c->rd, &reply) != REDIS_OK) {
                    fail(c, "a reply that does not parse: %s%s", c->rd->errstr,
                         strstr(c->rd->errstr, "memory") ? " (or an array longer than the client takes)" : "");
                    return;
                }
                if (reply) {
                    if (c->got < c->hs_n) c->hs_rep[c->got] = reply;
                    else c->rep[c->got - c->hs_n] = reply;
                    c->got++;
                    continue;
                }
                ssize_t k;
                short ev = POLLIN;
                if (c->ssl) {
                    k = kvt_tls_read(c->ssl, in, sizeof in, &ev);
                    if (k < 0) { fail(c, "%s", kvt_errmsg()); return; }
                } else {
                    k = recv(c->fd, in, sizeof in, 0);
                    if (k == 0) { fail(c, "connection closed"); return; }
                    if (k < 0 && errno != EAGAIN && errno != EINTR) { fail(c, "recv: %s", strerror(errno)); return; }
                    if (k < 0) k = 0;
                }
                if (k == 0) { c->ev |= ev; break; }
                if (redisReaderFeed(c->rd, in, (size_t)k) != REDIS_OK) { fail(c, "%s", c->rd->errstr); return; }
            }
            if (c->got < want) return;
            for (size_t i = 0; i < c->hs_n; i++)
                if (c->hs_rep[i]->type == REDIS_REPLY_ERROR) {
                    bool auth = i == 0 && c->auth && c->auth->password;
                    char why[160];
                    snprintf(why, sizeof why, "%s", c->hs_rep[i]->str);
                    fail(c, "%s refused: %s", auth ? "authentication" : "SELECT", why);
                    return;
                }
            for (size_t i = 0; i < c->hs_n; i++) freeReplyObject(c->hs_rep[i]);
            memset(c->hs_rep, 0, sizeof c->hs_rep);
            c->hs_n = c->hs_len = 0;
            c->phase = PH_DONE;
            return;
        }
        default:
            return;
        }
    }
}

static void timed_out(kvt_conn *c)
{
    if (c->phase == PH_RESOLVE) fail(c, "resolving the name: timed out");
    else if (c->phase == PH_CONNECT || c->phase == PH_WAIT_TCP) fail(c, "connect: timed out");
    else if (c->phase == PH_TLS) fail(c, "TLS handshake: timed out");
    else fail(c, "timed out (%zu of %zu replies)", c->got > c->hs_n ? c->got - c->hs_n : 0, c->q_n);
}

size_t kvt_conn_run(kvt_conn *const *cs, size_t n, double deadline)
{
    struct pollfd pf_stack[POLL_STACK], *pf = pf_stack;
    kvt_conn *act_stack[POLL_STACK], **act = act_stack;
    size_t failed = 0;
    if (n > POLL_STACK) { /* a cluster's many masters */
        pf = kvt_malloc(n * sizeof *pf);
        act = kvt_malloc(n * sizeof *act);
        if (!pf || !act) {
            if (pf != pf_stack) free(pf);
            free(act == act_stack ? NULL : act);
            for (size_t i = 0; i < n; i++) {
                cs[i]->rc = KVT_ENOMEM;
                snprintf(cs[i]->err, sizeof cs[i]->err, "redis: no memory for %zu connections in one round trip", n);
            }
            return n;
        }
    }
    for (size_t i = 0; i < n; i++) {
        kvt_conn *c = cs[i];
        c->rc = KVT_OK;
        c->err[0] = 0;
        c->sent = c->got = 0;
        c->hs_len = c->hs_n = 0;
        c->rep = c->q_n ? kvt_calloc(c->q_n, sizeof *c->rep) : NULL;
        c->phase = PH_IO;
        if (c->q_n && !c->rep) { fail(c, "no memory for %zu replies", c->q_n); continue; }
        if (c->fd < 0) {
            if (handshake_cmds(c)) { fail(c, "no memory"); continue; }
            c->sys_err = 0;
            c->phase = PH_RESOLVE; /* at once for an address, or one resolved before */
            if (resolve_start(c) < 0) {
                char why[224];
                snprintf(why, sizeof why, "%s", kvt_errmsg());
                fail(c, "%s", "");
                snprintf(c->err, sizeof c->err, "%s", why); /* it names the host already */
                continue;
            }
        }
        step(c, 0);
    }
    for (;;) {
        size_t k = 0;
        for (size_t i = 0; i < n; i++)
            if (cs[i]->phase != PH_DONE) {
                act[k] = cs[i];
                pf[k++] = (struct pollfd){cs[i]->phase == PH_RESOLVE ? cs[i]->rj->efd : cs[i]->fd,
                                          cs[i]->ev ? cs[i]->ev : POLLIN, 0};
            }
        if (!k) break;
        int left = ms_left(deadline);
        if (left == 0) {
            for (size_t i = 0; i < k; i++) timed_out(act[i]);
            break;
        }
        int pr = poll(pf, k, left);
        if (pr < 0 && errno != EINTR) {
            for (size_t i = 0; i < k; i++) fail(act[i], "poll: %s", strerror(errno));
            break;
        }
        for (size_t i = 0; pr > 0 && i < k; i++)
            if (pf[i].revents) step(act[i], pf[i].revents);
    }
    for (size_t i = 0; i < n; i++) failed += cs[i]->rc != KVT_OK;
    if (pf != pf_stack) free(pf);
    if (act != act_stack) free(act);
    return failed;
}
