/* A Redis client with deadlines (see redis.h).
 *
 * hiredis 0.14 offers a blocking context whose timeout is set once per
 * connection, and an async context that needs an event loop. The remote
 * tier needs neither: it makes a few pipelined round trips, each of which
 * must end by a deadline of a few milliseconds whatever the server does (a
 * stopped server must cost a lookup its deadline, not a hang). So this file
 * owns the socket (non-blocking, poll with the time left), formats commands
 * with redisFormatCommandArgv and parses replies with hiredis's
 * redisReader. Writing and reading overlap: a long pipeline is read while
 * it is still being sent, so neither side blocks on a full buffer. */
#include "store/redis.h"
#include "base/util.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

struct kvt_redis {
    kvt_redis_url u;
    char *password;
    int fd;                  /* -1: not connected */
    struct addrinfo *addrs;  /* the host resolved once (getaddrinfo has no deadline), kept */
    redisReader *rd;
    char *out;               /* queued commands, formatted */
    size_t out_len, out_cap, n_cmds;
};

int kvt_redis_parse_url(const char *url, kvt_redis_url *out)
{
    memset(out, 0, sizeof *out);
    out->port = 6379;
    if (!strncmp(url, "rediss://", 9))
        return kvt_fail(KVT_EUNSUPPORTED, "remote tier %s: TLS (rediss://) is not supported yet", url);
    if (!strncmp(url, "redis-cluster://", 16))
        return kvt_fail(KVT_EUNSUPPORTED, "remote tier %s: Redis Cluster (redis-cluster://) is not supported yet", url);
    if (strncmp(url, "redis://", 8))
        return kvt_fail(KVT_EINVAL, "remote tier %s: the URL must start with redis://", url);
    const char *p = url + 8, *at = strchr(p, '@'), *slash = strchr(p, '/');
    if (at && (!slash || at < slash)) {
        size_t ul = (size_t)(at - p);
        if (memchr(p, ':', ul))
            return kvt_fail(KVT_EINVAL, "remote tier %s: a password in the URL is refused; give it with "
                            "--kv-remote-password-file", url);
        if (ul == 0 || ul >= sizeof out->user) return kvt_fail(KVT_EINVAL, "remote tier %s: bad user name", url);
        memcpy(out->user, p, ul);
        p = at + 1;
    }
    const char *end = slash ? slash : p + strlen(p), *hs = p, *he;
    if (*p == '[') {
        hs = p + 1;
        he = memchr(hs, ']', (size_t)(end - hs));
        if (!he) return kvt_fail(KVT_EINVAL, "remote tier %s: '[' without ']'", url);
        p = he + 1;
    } else {
        he = memchr(p, ':', (size_t)(end - p));
        if (!he) he = end;
        p = he;
    }
    size_t hl = (size_t)(he - hs);
    if (hl == 0 || hl >= sizeof out->host) return kvt_fail(KVT_EINVAL, "remote tier %s: no host", url);
    memcpy(out->host, hs, hl);
    if (p < end) {
        if (*p != ':') return kvt_fail(KVT_EINVAL, "remote tier %s: junk after the host", url);
        char *e;
        long port = strtol(p + 1, &e, 10);
        if (e != end || port < 1 || port > 65535) return kvt_fail(KVT_EINVAL, "remote tier %s: bad port", url);
        out->port = (int)port;
    }
    if (slash && slash[1]) {
        char *e;
        long db = strtol(slash + 1, &e, 10);
        if (*e || db < 0 || db > 1000000) return kvt_fail(KVT_EINVAL, "remote tier %s: bad database number", url);
        out->db = (int)db;
    }
    return KVT_OK;
}

int kvt_redis_new(kvt_redis **out, const kvt_redis_url *u, const char *password)
{
    *out = NULL;
    kvt_redis *r = kvt_calloc(1, sizeof *r);
    if (!r) return KVT_ENOMEM;
    r->u = *u;
    r->fd = -1;
    if (password && !(r->password = kvt_strndup(password, strlen(password)))) {
        free(r);
        return KVT_ENOMEM;
    }
    *out = r;
    return KVT_OK;
}

static void disconnect(kvt_redis *r)
{
    if (r->fd >= 0) close(r->fd);
    r->fd = -1;
    if (r->rd) redisReaderFree(r->rd);
    r->rd = NULL;
}

void kvt_redis_free(kvt_redis *r)
{
    if (!r) return;
    disconnect(r);
    if (r->password) {
        memset(r->password, 0, strlen(r->password));
        free(r->password);
    }
    if (r->addrs) freeaddrinfo(r->addrs);
    free(r->out);
    free(r);
}

bool kvt_redis_connected(const kvt_redis *r) { return r->fd >= 0; }

static int ms_left(double deadline)
{
    double d = (deadline - kvt_now()) * 1000.0;
    return d <= 0 ? 0 : d > 1e9 ? 1000000000 : (int)d + 1;
}

int kvt_redis_resolve(kvt_redis *r)
{
    if (r->addrs) return KVT_OK;
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM};
    char port[16];
    snprintf(port, sizeof port, "%d", r->u.port);
    int g = getaddrinfo(r->u.host, port, &hints, &r->addrs);
    if (g) {
        r->addrs = NULL;
        return kvt_fail(KVT_EIO, "redis %s:%d: %s", r->u.host, r->u.port, gai_strerror(g));
    }
    return KVT_OK;
}

static int sock_connect(kvt_redis *r, double deadline)
{
    int grc = kvt_redis_resolve(r);
    if (grc) return grc;
    int rc = KVT_EIO, err = 0;
    for (struct addrinfo *a = r->addrs; a && r->fd < 0; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) { err = errno; continue; }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (connect(fd, a->ai_addr, a->ai_addrlen) && errno != EINPROGRESS) {
            err = errno;
            close(fd);
            continue;
        }
        struct pollfd pf = {fd, POLLOUT, 0};
        int pr = poll(&pf, 1, ms_left(deadline));
        socklen_t sl = sizeof err;
        if (pr <= 0) err = pr == 0 ? ETIMEDOUT : errno;
        else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &sl)) err = errno;
        if (err) { close(fd); continue; }
        r->fd = fd;
    }
    if (r->fd < 0) return kvt_fail(rc, "redis %s:%d: connect: %s", r->u.host, r->u.port, strerror(err ? err : EIO));
    if (!(r->rd = redisReaderCreate())) {
        disconnect(r);
        return KVT_ENOMEM;
    }
    return KVT_OK;
}

static int put_cmd(char **buf, size_t *len, size_t *cap, int argc, const char *const *argv, const size_t *lens)
{
    size_t l[16];
    if (!lens) {
        if (argc > 16) return kvt_fail(KVT_EINVAL, "redis command of %d arguments", argc);
        for (int i = 0; i < argc; i++) l[i] = strlen(argv[i]);
        lens = l;
    }
    char *cmd = NULL;
    int n = redisFormatCommandArgv(&cmd, argc, (const char **)argv, lens);
    if (n < 0 || !cmd) return kvt_fail(KVT_ENOMEM, "redis command");
    int rc = KVT_OK;
    if (*len + (size_t)n > *cap) {
        size_t c = *cap ? *cap : 4096;
        while (c < *len + (size_t)n) c *= 2;
        char *p = realloc(*buf, c);
        if (!p) rc = kvt_fail(KVT_ENOMEM, "redis pipeline of %zu bytes", c);
        else { *buf = p; *cap = c; }
    }
    if (!rc) {
        memcpy(*buf + *len, cmd, (size_t)n);
        *len += (size_t)n;
    }
    redisFreeCommand(cmd);
    return rc;
}

int kvt_redis_append(kvt_redis *r, int argc, const char *const *argv, const size_t *lens)
{
    int rc = put_cmd(&r->out, &r->out_len, &r->out_cap, argc, argv, lens);
    if (!rc) r->n_cmds++;
    return rc;
}

int kvt_redis_appendf(kvt_redis *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *cmd = NULL;
    int n = redisvFormatCommand(&cmd, fmt, ap);
    va_end(ap);
    if (n < 0 || !cmd) return kvt_fail(KVT_ENOMEM, "redis command");
    int rc = KVT_OK;
    if (r->out_len + (size_t)n > r->out_cap) {
        size_t c = r->out_cap ? r->out_cap : 4096;
        while (c < r->out_len + (size_t)n) c *= 2;
        char *p = realloc(r->out, c);
        if (!p) rc = kvt_fail(KVT_ENOMEM, "redis pipeline");
        else { r->out = p; r->out_cap = c; }
    }
    if (!rc) {
        memcpy(r->out + r->out_len, cmd, (size_t)n);
        r->out_len += (size_t)n;
        r->n_cmds++;
    }
    free(cmd);
    return rc;
}

void kvt_redis_discard(kvt_redis *r)
{
    r->out_len = 0;
    r->n_cmds = 0;
}

void kvt_redis_replies_free(redisReply **rep, size_t n)
{
    if (!rep) return;
    for (size_t i = 0; i < n; i++)
        if (rep[i]) freeReplyObject(rep[i]);
    free(rep);
}

/* Send buf[0..len) and read want replies into rep, by the deadline. */
static int round_trip(kvt_redis *r, const char *buf, size_t len, redisReply **rep, size_t want, double deadline)
{
    size_t sent = 0, got = 0;
    char in[65536];
    while (got < want) {
        struct pollfd pf = {r->fd, (short)(POLLIN | (sent < len ? POLLOUT : 0)), 0};
        int left = ms_left(deadline);
        if (left == 0) return kvt_fail(KVT_EIO, "redis %s:%d: timed out (%zu of %zu replies)", r->u.host, r->u.port,
                                       got, want);
        int pr = poll(&pf, 1, left);
        if (pr < 0 && errno == EINTR) continue;
        if (pr < 0) return kvt_fail(KVT_EIO, "redis: poll: %s", strerror(errno));
        if (pr == 0) continue; /* the deadline check above ends it */
        if (pf.revents & POLLOUT && sent < len) {
            ssize_t w = send(r->fd, buf + sent, len - sent, MSG_NOSIGNAL);
            if (w < 0 && errno != EAGAIN && errno != EINTR)
                return kvt_fail(KVT_EIO, "redis %s:%d: send: %s", r->u.host, r->u.port, strerror(errno));
            if (w > 0) sent += (size_t)w;
        }
        if (pf.revents & (POLLIN | POLLHUP | POLLERR)) {
            ssize_t k = recv(r->fd, in, sizeof in, 0);
            if (k == 0) return kvt_fail(KVT_EIO, "redis %s:%d: connection closed", r->u.host, r->u.port);
            if (k < 0 && errno != EAGAIN && errno != EINTR)
                return kvt_fail(KVT_EIO, "redis %s:%d: recv: %s", r->u.host, r->u.port, strerror(errno));
            if (k > 0 && redisReaderFeed(r->rd, in, (size_t)k) != REDIS_OK)
                return kvt_fail(KVT_EIO, "redis: %s", r->rd->errstr);
            while (got < want) {
                void *reply = NULL;
                if (redisReaderGetReply(r->rd, &reply) != REDIS_OK)
                    return kvt_fail(KVT_EIO, "redis: a reply that does not parse: %s", r->rd->errstr);
                if (!reply) break;
                rep[got++] = reply;
            }
        }
    }
    return KVT_OK;
}

/* AUTH and SELECT on a new connection. */
static int handshake(kvt_redis *r, double deadline)
{
    char *buf = NULL;
    size_t len = 0, cap = 0, want = 0;
    int rc = KVT_OK;
    if (r->password) {
        const char *a[3] = {"AUTH", r->u.user[0] ? r->u.user : r->password, r->password};
        rc = put_cmd(&buf, &len, &cap, r->u.user[0] ? 3 : 2, a, NULL);
        want++;
    }
    char db[16];
    snprintf(db, sizeof db, "%d", r->u.db);
    if (!rc && r->u.db > 0) {
        const char *a[2] = {"SELECT", db};
        rc = put_cmd(&buf, &len, &cap, 2, a, NULL);
        want++;
    }
    redisReply *rep[2] = {0};
    if (!rc && want) rc = round_trip(r, buf, len, rep, want, deadline);
    for (size_t i = 0; !rc && i < want; i++)
        if (rep[i]->type == REDIS_REPLY_ERROR)
            rc = kvt_fail(KVT_EIO, "redis %s:%d: %s refused: %s", r->u.host, r->u.port,
                          i == 0 && r->password ? "authentication" : "SELECT", rep[i]->str);
    for (size_t i = 0; i < want; i++)
        if (rep[i]) freeReplyObject(rep[i]);
    free(buf);
    return rc;
}

int kvt_redis_exec(kvt_redis *r, int timeout_ms, redisReply ***replies, size_t *n)
{
    *replies = NULL;
    *n = 0;
    double deadline = kvt_now() + timeout_ms / 1000.0;
    size_t want = r->n_cmds;
    int rc = KVT_OK;
    redisReply **rep = NULL;
    if (r->fd < 0 && !(rc = sock_connect(r, deadline)) && (rc = handshake(r, deadline))) disconnect(r);
    if (!rc && want && !(rep = kvt_calloc(want, sizeof *rep))) rc = KVT_ENOMEM;
    if (!rc && want) rc = round_trip(r, r->out, r->out_len, rep, want, deadline);
    r->out_len = 0;
    r->n_cmds = 0;
    if (rc) {
        kvt_redis_replies_free(rep, want);
        disconnect(r);
        return rc;
    }
    *replies = rep;
    *n = want;
    return KVT_OK;
}
