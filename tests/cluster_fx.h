/* A fake Redis Cluster of many masters in the test process, for the
 * routing of clusters larger than real redis-servers can be started for
 * (tests/test_cluster.c): one thread polls a listening socket per master,
 * each on an address of its own on the loopback (127.0.X.Y, a free port
 * picked by the kernel), and answers:
 *
 *   CLUSTER SLOTS   the map (cfx.slots_reply when set: a hostile reply
 *                   sent as is; else each master's slots, and a replica
 *                   entry per range naming a node that does not listen)
 *   SET k v / GET k the value kept by the master of k's slot, and MOVED to
 *                   that master on any other (counted: a client that
 *                   routes right never meets one)
 *   HGETALL         an empty hash (the remote tier's index: no entry)
 *   anything else   +OK
 *
 * Master i serves the slots [first[i], first[i + 1]). A master marked
 * dead closes its sockets: its connections are refused. */
#ifndef KVT_TEST_CLUSTER_FX_H
#define KVT_TEST_CLUSTER_FX_H

#include "store/cluster.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdarg.h>
#include <strings.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

typedef struct cfx_kv {
    char *k, *v;
    struct cfx_kv *next;
} cfx_kv;

typedef struct cfx_conn {
    int fd, node;
    char *in;
    size_t len, cap;
} cfx_conn;

typedef struct cfx {
    size_t n;                   /* masters */
    char (*host)[32];           /* [n] each master's address */
    int *port;                  /* [n] */
    int *lfd;                   /* [n] listening sockets (-1: dead) */
    unsigned *first;            /* [n + 1] master i: slots [first[i], first[i + 1]) */
    cfx_kv **kv;                /* [n] each master's keys */
    unsigned long *sets, *gets; /* [n] commands each master served */
    cfx_conn *c;                /* client connections */
    size_t nc, cc;
    const char *slots_reply;    /* a hostile CLUSTER SLOTS reply (borrowed); NULL: the map */
    size_t slots_len;
    atomic_ulong moved;         /* MOVED replies sent */
    atomic_int dead;            /* a master to kill (-1 none): its sockets are closed */
    atomic_bool stop;
    pthread_t t;
} cfx;

static int cfx_owner(const cfx *f, unsigned slot)
{
    size_t lo = 0, hi = f->n; /* first[lo] <= slot < first[hi] */
    while (hi - lo > 1) {
        size_t mid = (lo + hi) / 2;
        if (f->first[mid] <= slot) lo = mid;
        else hi = mid;
    }
    return (int)lo;
}

static void cfx_put(cfx_conn *c, int *ok, const char *p, size_t n)
{
    while (*ok && n) {
        ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL);
        if (w <= 0) { *ok = 0; return; } /* blocking sockets: the client reads */
        p += w;
        n -= (size_t)w;
    }
}

static void cfx_putf(cfx_conn *c, int *ok, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void cfx_putf(cfx_conn *c, int *ok, const char *fmt, ...)
{
    char b[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b, sizeof b, fmt, ap);
    va_end(ap);
    cfx_put(c, ok, b, (size_t)n);
}

static void cfx_map(cfx *f, cfx_conn *c, int *ok)
{
    if (f->slots_reply) { cfx_put(c, ok, f->slots_reply, f->slots_len); return; }
    cfx_putf(c, ok, "*%zu\r\n", f->n);
    for (size_t i = 0; i < f->n && *ok; i++) {
        /* the replica: an address no master has, not listening */
        char rep[32];
        snprintf(rep, sizeof rep, "127.1.%zu.%zu", (i + 1) / 250, (i + 1) % 250 + 1);
        cfx_putf(c, ok, "*4\r\n:%u\r\n:%u\r\n*3\r\n$%zu\r\n%s\r\n:%d\r\n$2\r\nm%zu\r\n*3\r\n$%zu\r\n%s\r\n:%d\r\n$2\r\nr%zu\r\n",
                 f->first[i], f->first[i + 1] - 1, strlen(f->host[i]), f->host[i], f->port[i], i % 10,
                 strlen(rep), rep, f->port[i], i % 10);
    }
}

/* One command (argc arguments av[i] of al[i] bytes) on c's master. */
static void cfx_cmd(cfx *f, cfx_conn *c, int argc, char **av, size_t *al, int *ok)
{
    int me = c->node;
    if (argc >= 2 && !strcasecmp(av[0], "CLUSTER") && !strcasecmp(av[1], "SLOTS")) { cfx_map(f, c, ok); return; }
    if (argc >= 2 && !strcasecmp(av[0], "HGETALL")) { cfx_put(c, ok, "*0\r\n", 4); return; }
    bool set = argc == 3 && !strcasecmp(av[0], "SET"), get = argc == 2 && !strcasecmp(av[0], "GET");
    if (!set && !get) { cfx_put(c, ok, "+OK\r\n", 5); return; }
    unsigned slot = kvt_cluster_slot(av[1], al[1]);
    int owner = cfx_owner(f, slot);
    if (owner != me) {
        atomic_fetch_add(&f->moved, 1);
        cfx_putf(c, ok, "-MOVED %u %s:%d\r\n", slot, f->host[owner], f->port[owner]);
        return;
    }
    cfx_kv *e = f->kv[me];
    while (e && strcmp(e->k, av[1])) e = e->next;
    if (set) {
        f->sets[me]++;
        if (!e) {
            e = calloc(1, sizeof *e);
            if (!e) { *ok = 0; return; }
            e->k = strdup(av[1]);
            e->next = f->kv[me];
            f->kv[me] = e;
        }
        free(e->v);
        e->v = strdup(av[2]);
        cfx_put(c, ok, "+OK\r\n", 5);
        return;
    }
    f->gets[me]++;
    if (!e) cfx_put(c, ok, "$-1\r\n", 5);
    else cfx_putf(c, ok, "$%zu\r\n%s\r\n", strlen(e->v), e->v);
}

/* The commands complete in c's buffer answered; false: close it. */
static bool cfx_serve(cfx *f, cfx_conn *c)
{
    size_t at = 0;
    int ok = 1;
    for (;;) {
        char *p = c->in + at, *end = c->in + c->len, *nl;
        if (p >= end) break;
        if (*p != '*' || !(nl = memchr(p, '\n', (size_t)(end - p)))) break;
        int argc = atoi(p + 1);
        if (argc < 1 || argc > 16) return false;
        char *av[16];
        size_t al[16];
        char *q = nl + 1;
        int i;
        for (i = 0; i < argc; i++) {
            if (q >= end || *q != '$' || !(nl = memchr(q, '\n', (size_t)(end - q)))) break;
            size_t l = strtoul(q + 1, NULL, 10);
            if ((size_t)(end - nl - 1) < l + 2) break;
            av[i] = nl + 1;
            al[i] = l;
            q = nl + 1 + l + 2;
        }
        if (i < argc) break; /* the rest has not come */
        for (i = 0; i < argc; i++) av[i][al[i]] = 0; /* over the \r */
        cfx_cmd(f, c, argc, av, al, &ok);
        if (!ok) return false;
        at = (size_t)(q - c->in);
    }
    memmove(c->in, c->in + at, c->len - at);
    c->len -= at;
    return true;
}

static void cfx_close_conn(cfx *f, size_t i)
{
    close(f->c[i].fd);
    free(f->c[i].in);
    f->c[i] = f->c[--f->nc];
}

static void *cfx_main(void *arg)
{
    cfx *f = arg;
    struct pollfd *pf = NULL;
    size_t pcap = 0;
    while (!atomic_load(&f->stop)) {
        int d = atomic_exchange(&f->dead, -1);
        if (d >= 0 && (size_t)d < f->n) {
            if (f->lfd[d] >= 0) close(f->lfd[d]);
            f->lfd[d] = -1;
            for (size_t i = f->nc; i-- > 0;)
                if (f->c[i].node == d) cfx_close_conn(f, i);
        }
        size_t np = f->n + f->nc;
        if (np > pcap) {
            struct pollfd *p = realloc(pf, np * sizeof *p);
            if (!p) break;
            pf = p;
            pcap = np;
        }
        for (size_t i = 0; i < f->n; i++) pf[i] = (struct pollfd){f->lfd[i], POLLIN, 0};
        for (size_t i = 0; i < f->nc; i++) pf[f->n + i] = (struct pollfd){f->c[i].fd, POLLIN, 0};
        if (poll(pf, np, 20) <= 0) continue;
        for (size_t i = 0; i < f->n; i++) {
            if (!(pf[i].revents & POLLIN) || f->lfd[i] < 0) continue;
            int fd = accept(f->lfd[i], NULL, NULL);
            if (fd < 0) continue;
            if (f->nc == f->cc) {
                size_t cap = f->cc ? f->cc * 2 : 64;
                cfx_conn *c = realloc(f->c, cap * sizeof *c);
                if (!c) { close(fd); continue; }
                f->c = c;
                f->cc = cap;
            }
            f->c[f->nc++] = (cfx_conn){.fd = fd, .node = (int)i};
        }
        size_t nc0 = np - f->n; /* the connections polled (accepts above come after them) */
        for (size_t k = nc0; k-- > 0;) {
            if (!pf[f->n + k].revents) continue;
            cfx_conn *c = &f->c[k];
            if (c->cap - c->len < 65536) {
                char *b = realloc(c->in, c->cap + 65536);
                if (!b) { cfx_close_conn(f, k); continue; }
                c->in = b;
                c->cap += 65536;
            }
            ssize_t r = recv(c->fd, c->in + c->len, c->cap - c->len - 1, 0);
            if (r <= 0 || (c->len += (size_t)r, !cfx_serve(f, c))) cfx_close_conn(f, k);
        }
    }
    free(pf);
    return NULL;
}

/* n masters, 127.0.X.Y each; first[] their slots (NULL: as even as can be).
 * false when a socket cannot be made (the caller skips). */
static __attribute__((unused)) bool cfx_start(cfx *f, size_t n, const unsigned *first)
{
    memset(f, 0, sizeof *f);
    f->n = n;
    atomic_init(&f->dead, -1);
    f->host = calloc(n, sizeof *f->host);
    f->port = calloc(n, sizeof *f->port);
    f->lfd = calloc(n, sizeof *f->lfd);
    f->first = calloc(n + 1, sizeof *f->first);
    f->kv = calloc(n, sizeof *f->kv);
    f->sets = calloc(n, sizeof *f->sets);
    f->gets = calloc(n, sizeof *f->gets);
    if (!f->host || !f->port || !f->lfd || !f->first || !f->kv || !f->sets || !f->gets) return false;
    for (size_t i = 0; i <= n; i++) f->first[i] = first ? first[i] : (unsigned)(i * KVT_CLUSTER_SLOTS / n);
    for (size_t i = 0; i < n; i++) f->lfd[i] = -1;
    for (size_t i = 0; i < n; i++) {
        snprintf(f->host[i], sizeof f->host[i], "127.0.%zu.%zu", (i + 1) / 250, (i + 1) % 250 + 1);
        int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in a = {.sin_family = AF_INET};
        socklen_t len = sizeof a;
        inet_pton(AF_INET, f->host[i], &a.sin_addr);
        if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) || listen(s, 64) ||
            getsockname(s, (struct sockaddr *)&a, &len)) {
            if (s >= 0) close(s);
            printf("    cannot listen on %s: %s\n", f->host[i], strerror(errno));
            return false;
        }
        f->lfd[i] = s;
        f->port[i] = ntohs(a.sin_port);
    }
    return !pthread_create(&f->t, NULL, cfx_main, f);
}

static __attribute__((unused)) void cfx_stop(cfx *f)
{
    if (f->t) {
        atomic_store(&f->stop, true);
        pthread_join(f->t, NULL);
    }
    while (f->nc) cfx_close_conn(f, 0);
    free(f->c);
    for (size_t i = 0; i < f->n; i++) {
        if (f->lfd && f->lfd[i] >= 0) close(f->lfd[i]);
        for (cfx_kv *e = f->kv ? f->kv[i] : NULL, *nx; e; e = nx) {
            nx = e->next;
            free(e->k);
            free(e->v);
            free(e);
        }
    }
    free(f->host); free(f->port); free(f->lfd); free(f->first); free(f->kv); free(f->sets); free(f->gets);
    memset(f, 0, sizeof *f);
}

/* The seed URL: redis-cluster://the first master. */
static __attribute__((unused)) void cfx_url(const cfx *f, char *url, size_t cap)
{
    snprintf(url, cap, "redis-cluster://%s:%d", f->host[0], f->port[0]);
}

#endif
