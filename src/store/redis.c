/* A Redis client with deadlines (see redis.h).
 *
 * The remote tier makes a few pipelined round trips, each of which must
 * end by a deadline of a few milliseconds whatever the server does (a
 * stopped server must cost a lookup its deadline, not a hang). This file
 * owns the URL, the queue of formatted commands (redisFormatCommandArgv)
 * and the choice of transport: one connection (conn.c, plain or TLS) or a
 * cluster's masters (cluster.c); the replies are hiredis's. */
#include "store/redis.h"
#include "store/cluster.h"
#include "store/conn.h"
#include "store/tls.h"
#include "base/util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

struct kvt_redis {
    kvt_redis_url u;
    char *password;
    kvt_conn_auth auth;
    kvt_tls *tls;
    kvt_conn conn;           /* redis://, rediss:// */
    kvt_cluster *cl;         /* redis-cluster:// */
    char *out;               /* queued commands, formatted */
    size_t out_len, out_cap, n_cmds;
    size_t *offs, offs_cap;  /* where each queued command starts in out (n_cmds + 1 used) */
    size_t *bars, n_bars, bars_cap; /* barriers: command indices */
};

/* host:port (host may be [v6]) in s[0..end): false with the reason. */
static int parse_hostport(const char *url, const char *s, const char *end, char *host, int *port)
{
    const char *hs = s, *he, *p;
    if (*s == '[') {
        hs = s + 1;
        he = memchr(hs, ']', (size_t)(end - hs));
        if (!he) return kvt_fail(KVT_EINVAL, "remote tier %s: '[' without ']'", url);
        p = he + 1;
    } else {
        he = memchr(s, ':', (size_t)(end - s));
        if (!he) he = end;
        p = he;
    }
    size_t hl = (size_t)(he - hs);
    if (hl == 0 || hl >= 256) return kvt_fail(KVT_EINVAL, "remote tier %s: no host", url);
    memcpy(host, hs, hl);
    host[hl] = 0;
    if (p < end) {
        if (*p != ':') return kvt_fail(KVT_EINVAL, "remote tier %s: junk after the host", url);
        char *e;
        long v = strtol(p + 1, &e, 10);
        if (e != end || v < 1 || v > 65535) return kvt_fail(KVT_EINVAL, "remote tier %s: bad port", url);
        *port = (int)v;
    }
    return KVT_OK;
}

int kvt_redis_parse_url(const char *url, kvt_redis_url *out)
{
    memset(out, 0, sizeof *out);
    out->port = 6379;
    const char *p;
    if (!strncmp(url, "redis://", 8)) p = url + 8;
    else if (!strncmp(url, "rediss://", 9)) p = url + 9, out->tls = true;
    else if (!strncmp(url, "redis-cluster://", 16)) p = url + 16, out->cluster = true;
    else if (!strncmp(url, "rediss-cluster://", 17)) p = url + 17, out->cluster = out->tls = true;
    else return kvt_fail(KVT_EINVAL, "remote tier %s: the URL must start with redis://, rediss://, redis-cluster:// "
                         "or rediss-cluster://", url);
    const char *at = strchr(p, '@'), *slash = strchr(p, '/');
    if (at && (!slash || at < slash)) {
        size_t ul = (size_t)(at - p);
        if (memchr(p, ':', ul))
            return kvt_fail(KVT_EINVAL, "remote tier %s: a password in the URL is refused; give it with "
                            "--kv-remote-password-file", url);
        if (ul == 0 || ul >= sizeof out->user) return kvt_fail(KVT_EINVAL, "remote tier %s: bad user name", url);
        memcpy(out->user, p, ul);
        p = at + 1;
    }
    const char *end = slash ? slash : p + strlen(p);
    if (out->cluster) {
        if (slash) return kvt_fail(KVT_EINVAL, "remote tier %s: a Redis Cluster has one database: no /DB", url);
        while (p < end) {
            const char *comma = memchr(p, ',', (size_t)(end - p)), *e = comma ? comma : end;
            if (out->n_seeds == KVT_REDIS_MAX_SEEDS)
                return kvt_fail(KVT_EINVAL, "remote tier %s: more than %d nodes", url, KVT_REDIS_MAX_SEEDS);
            out->seed_ports[out->n_seeds] = 6379;
            int rc = parse_hostport(url, p, e, out->seeds[out->n_seeds], &out->seed_ports[out->n_seeds]);
            if (rc) return rc;
            out->n_seeds++;
            p = comma ? comma + 1 : end;
        }
        if (!out->n_seeds) return kvt_fail(KVT_EINVAL, "remote tier %s: no host", url);
        memcpy(out->host, out->seeds[0], sizeof out->host);
        out->port = out->seed_ports[0];
        return KVT_OK;
    }
    int rc = parse_hostport(url, p, end, out->host, &out->port);
    if (rc) return rc;
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
    if ((u->ca || u->cert || u->key) && !u->tls)
        return kvt_fail(KVT_EINVAL, "--kv-remote-ca, --kv-remote-cert and --kv-remote-key need a rediss:// or "
                        "rediss-cluster:// URL (TLS); %s://%s:%d would be plain TCP",
                        u->cluster ? "redis-cluster" : "redis", u->host, u->port);
    kvt_redis *r = kvt_calloc(1, sizeof *r);
    if (!r) return KVT_ENOMEM;
    r->u = *u;
    r->u.ca = r->u.cert = r->u.key = NULL; /* borrowed: read below, not kept */
    int rc = KVT_OK;
    if (password && !(r->password = kvt_strndup(password, strlen(password)))) rc = KVT_ENOMEM;
    if (!rc && u->tls) rc = kvt_tls_new(&r->tls, u->ca, u->cert, u->key);
    r->auth = (kvt_conn_auth){.user = r->u.user, .password = r->password, .db = r->u.db, .tls = r->tls};
    kvt_conn_init(&r->conn, u->host, u->port, &r->auth);
    if (!rc && u->cluster) {
        char hosts[KVT_REDIS_MAX_SEEDS][256];
        memcpy(hosts, u->seeds, sizeof hosts);
        rc = kvt_cluster_new(&r->cl, (const char(*)[256])hosts, u->seed_ports, u->n_seeds, &r->auth);
    }
    if (rc) {
        kvt_redis_free(r);
        return rc;
    }
    *out = r;
    return KVT_OK;
}

void kvt_redis_free(kvt_redis *r)
{
    if (!r) return;
    kvt_conn_close(&r->conn);
    kvt_cluster_free(r->cl);
    kvt_tls_free(r->tls);
    if (r->password) {
        memset(r->password, 0, strlen(r->password));
        free(r->password);
    }
    free(r->out);
    free(r->offs);
    free(r->bars);
    free(r);
}

bool kvt_redis_connected(const kvt_redis *r) { return r->cl ? kvt_cluster_connected(r->cl) : r->conn.fd >= 0; }

int kvt_redis_resolve(kvt_redis *r, int timeout_ms)
{
    double deadline = kvt_now() + timeout_ms / 1000.0;
    return r->cl ? kvt_cluster_resolve(r->cl, deadline) : kvt_conn_resolve(&r->conn, deadline);
}

/* Queue n formatted bytes as one command. */
static int put(kvt_redis *r, const char *cmd, size_t n)
{
    int rc = KVT_OK;
    KVT_GROW(r->offs, &r->offs_cap, r->n_cmds + 2, rc);
    if (rc) return rc;
    if (r->out_len + n > r->out_cap) {
        size_t c = r->out_cap ? r->out_cap : 4096;
        while (c < r->out_len + n) c *= 2;
        char *p = realloc(r->out, c);
        if (!p) return kvt_fail(KVT_ENOMEM, "redis pipeline of %zu bytes", c);
        r->out = p;
        r->out_cap = c;
    }
    r->offs[r->n_cmds] = r->out_len;
    memcpy(r->out + r->out_len, cmd, n);
    r->out_len += n;
    r->n_cmds++;
    r->offs[r->n_cmds] = r->out_len;
    return KVT_OK;
}

int kvt_redis_append(kvt_redis *r, int argc, const char *const *argv, const size_t *lens)
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
    int rc = put(r, cmd, (size_t)n);
    redisFreeCommand(cmd);
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
    int rc = put(r, cmd, (size_t)n);
    free(cmd);
    return rc;
}

int kvt_redis_barrier(kvt_redis *r)
{
    int rc = KVT_OK;
    KVT_GROW(r->bars, &r->bars_cap, r->n_bars + 1, rc);
    if (!rc) r->bars[r->n_bars++] = r->n_cmds;
    return rc;
}

size_t kvt_redis_keep_bytes = 1u << 20;
bool kvt_redis_fault_keep_queue;

void kvt_redis_discard(kvt_redis *r)
{
    r->out_len = 0;
    r->n_cmds = 0;
    r->n_bars = 0;
    if (kvt_redis_fault_keep_queue) return;
    bool freed = r->out_cap > kvt_redis_keep_bytes;
    if (freed) {
        free(r->out);
        r->out = NULL;
        r->out_cap = 0;
    }
    if (r->cl && kvt_cluster_trim(r->cl, kvt_redis_keep_bytes)) freed = true;
#ifdef __GLIBC__
    /* glibc keeps up to twice its mmap threshold (which grows to the size
     * of the last mmapped block freed, up to 32 MiB) of free heap
     * resident: the freed pipeline would stay in the resident set */
    if (freed) malloc_trim(0);
#endif
}

size_t kvt_redis_queued(const kvt_redis *r) { return r->out_len; }

size_t kvt_redis_queue_bytes(const kvt_redis *r) { return r->out_cap + (r->cl ? kvt_cluster_queue_bytes(r->cl) : 0); }

void kvt_redis_replies_free(redisReply **rep, size_t n)
{
    if (!rep) return;
    for (size_t i = 0; i < n; i++)
        if (rep[i]) freeReplyObject(rep[i]);
    free(rep);
}

int kvt_redis_shard_of(const kvt_redis *r, const char *key, size_t len)
{
    return r->cl ? kvt_cluster_shard_of(r->cl, key, len) : 0;
}

size_t kvt_redis_n_shards(const kvt_redis *r)
{
    size_t n = r->cl ? kvt_cluster_n_shards(r->cl) : 1;
    return n ? n : 1;
}

int kvt_redis_exec_shards(kvt_redis *r, int timeout_ms, kvt_shards *sh, redisReply ***replies, size_t *n)
{
    *replies = NULL;
    *n = 0;
    if (kvt_shards_grow(sh, 1)) {
        kvt_redis_discard(r);
        return KVT_ENOMEM;
    }
    kvt_shards_clear(sh);
    double deadline = kvt_now() + timeout_ms / 1000.0;
    size_t want = r->n_cmds;
    redisReply **rep = want ? kvt_calloc(want, sizeof *rep) : NULL;
    if (want && !rep) {
        kvt_redis_discard(r);
        return KVT_ENOMEM;
    }
    if (r->cl) {
        int rc = kvt_cluster_exec(r->cl, r->out, r->offs, want, r->bars, r->n_bars, deadline, sh, rep);
        if (rc == KVT_ENOMEM) {
            kvt_redis_discard(r);
            free(rep);
            return rc;
        }
        if (rc) { /* no map: every shard known failed */
            snprintf(sh->why, sizeof sh->why, "%s", kvt_errmsg());
            for (size_t s = 0; s < sh->n; s++) sh->failed[s] = sh->asked[s] = !sh->skip[s];
        }
    } else {
        sh->n = 1;
        if (!sh->skip[0] && want) {
            kvt_conn *c = &r->conn;
            c->q = r->out;
            c->q_len = r->out_len;
            c->q_n = want;
            sh->asked[0] = true;
            free(rep);
            if (kvt_conn_run(&c, 1, deadline)) {
                sh->failed[0] = true;
                snprintf(sh->why, sizeof sh->why, "%s", c->err);
                rep = want ? kvt_calloc(want, sizeof *rep) : NULL;
                if (!rep) { kvt_redis_discard(r); return KVT_ENOMEM; }
            } else {
                rep = c->rep;
            }
            c->rep = NULL;
            for (size_t i = 0; i < want; i++)
                if (rep[i] && rep[i]->type == REDIS_REPLY_ERROR) {
                    if (!sh->refused[0]) snprintf(sh->refusal, sizeof sh->refusal, "%s", rep[i]->str);
                    sh->refused[0] = true;
                }
        }
    }
    kvt_redis_discard(r);
    if (sh->why[0]) kvt_fail(KVT_EIO, "%s", sh->why);
    *replies = rep;
    *n = want;
    return KVT_OK;
}

int kvt_redis_exec(kvt_redis *r, int timeout_ms, redisReply ***replies, size_t *n)
{
    kvt_shards sh = {0};
    int rc = kvt_redis_exec_shards(r, timeout_ms, &sh, replies, n);
    for (size_t i = 0; !rc && i < *n; i++)
        if (!(*replies)[i]) { /* a shard failed, or a command after a barrier was not sent for it */
            kvt_redis_replies_free(*replies, *n);
            *replies = NULL;
            *n = 0;
            rc = kvt_fail(KVT_EIO, "%s", sh.why[0] ? sh.why : "redis: a command without a reply");
        }
    kvt_shards_free(&sh);
    return rc;
}
