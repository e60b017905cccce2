/* A small Redis client for the remote tier (redis.c): hiredis 0.14's reply
 * parser (redisReader) over non-blocking sockets of our own (conn.h), so
 * that the connect and every round trip have a deadline (poll), which
 * hiredis 0.14's blocking context does not give per request. Commands are
 * pipelined: a caller appends several and reads all their replies in one
 * round trip.
 *
 * Four kinds of remote, one interface: redis:// (one server, plain TCP),
 * rediss:// (one server over TLS, tls.h), redis-cluster:// (a Redis
 * Cluster, cluster.h: each command goes to the master of its key's slot,
 * the masters of one pipeline asked at once) and rediss-cluster:// (a
 * cluster over TLS: every master's connection verified as rediss://'s).
 *
 * One client is used by one thread at a time. A transport failure
 * (timeout, reset, a reply that does not parse) closes the connection: the
 * replies still in flight cannot be matched to their commands any more;
 * the next round trip connects again. */
#ifndef KVT_REDIS_H
#define KVT_REDIS_H

#include "kvtier.h"
#include "store/cluster.h"
#include <hiredis/hiredis.h>
#include <stddef.h>

#define KVT_REDIS_MAX_SEEDS 16

typedef struct kvt_redis_url {
    char host[256];
    int port;          /* 6379 unless given */
    char user[128];    /* empty: AUTH with the password only (the default user) */
    int db;            /* SELECT db when > 0 */
    bool tls;          /* rediss://, rediss-cluster:// */
    bool cluster;      /* redis-cluster://, rediss-cluster://: host:port is seeds[0] */
    size_t n_seeds;    /* a cluster's nodes given in the URL */
    char seeds[KVT_REDIS_MAX_SEEDS][256];
    int seed_ports[KVT_REDIS_MAX_SEEDS];
    /* TLS files (rediss:// only; borrowed, read by kvt_redis_new): the CA
     * the server's certificate must chain to (NULL: the system's CAs), the
     * client's certificate and key (both or neither) */
    const char *ca, *cert, *key;
} kvt_redis_url;

/* Parse redis://[user@]host:port[/db], rediss://[user@]host:port[/db]
 * (TLS), redis-cluster://[user@]host:port[,host:port...] (the cluster's
 * nodes to ask for its slot map; no /db, a cluster has one database) or
 * rediss-cluster://... (the same over TLS);
 * a host may be [v6addr]. Anything else is KVT_EINVAL naming what is
 * wrong. A password in the URL is refused: it belongs in a file. */
int kvt_redis_parse_url(const char *url, kvt_redis_url *out);

typedef struct kvt_redis kvt_redis;

/* A client for u (copied); password (copied, may be NULL) is sent with
 * AUTH after each connect, then SELECT. The TLS files are read now
 * (KVT_EIO naming the file; KVT_EINVAL when they are given without
 * rediss://). Nothing is connected yet: the first round trip connects,
 * within its own deadline. */
int kvt_redis_new(kvt_redis **out, const kvt_redis_url *u, const char *password);
void kvt_redis_free(kvt_redis *r);

/* Resolve the host (a cluster's seeds) within timeout_ms, so that no round
 * trip has to: the addresses are kept for every connect after. Done by
 * the first connect otherwise, within its deadline (conn.h). KVT_EIO when
 * the name does not resolve, or not in time (it goes on resolving). */
int kvt_redis_resolve(kvt_redis *r, int timeout_ms);

/* Queue one command (argv[i] of lens[i] bytes; lens NULL: NUL-terminated
 * strings). KVT_ENOMEM only; the command is sent by kvt_redis_exec. */
int kvt_redis_append(kvt_redis *r, int argc, const char *const *argv, const size_t *lens);
/* Printf-style append, arguments split by spaces; %s and %b as hiredis's
 * redisFormatCommand reads them. */
int kvt_redis_appendf(kvt_redis *r, const char *fmt, ...);

/* Commands queued after a barrier are sent once every command queued
 * before it has its reply. One server runs a connection's commands in
 * order anyway; on a cluster the nodes do not wait for each other, and
 * the barrier is what keeps "values, then the index entry that names
 * them" in that order. */
int kvt_redis_barrier(kvt_redis *r);

/* Send every queued command and read one reply for each, connecting first
 * when needed, all within timeout_ms. *replies (malloc'ed, *n of them, in
 * command order; free with kvt_redis_replies_free) are hiredis replies; an
 * error reply of one command is that command's result, not a failure.
 * KVT_EIO naming the cause (timeout, refused, reset, authentication) on a
 * transport failure: the queue is emptied and the connection closed. */
int kvt_redis_exec(kvt_redis *r, int timeout_ms, redisReply ***replies, size_t *n);
void kvt_redis_replies_free(redisReply **replies, size_t n);

/* kvt_redis_exec, one shard's failure its own (a cluster's masters,
 * cluster.h's kvt_shards; one server is shard 0): the commands bound
 * for the shards sh->skip names are not sent, and those of a shard whose
 * round trip fails get no reply; their replies are NULL, the others'
 * stand (*n is every command's count). Commands after a barrier are not
 * sent when one before it has no reply. sh says which shards were asked,
 * failed (sh->why) or answered an error reply (sh->refusal). KVT_OK
 * unless memory runs out: a cluster whose map cannot be read fails every
 * shard known. */
int kvt_redis_exec_shards(kvt_redis *r, int timeout_ms, kvt_shards *sh, redisReply ***replies, size_t *n);
/* The shard of a key, -1 when not known yet (a cluster's map is read by
 * the first round trip); the shards known (1 until then). */
int kvt_redis_shard_of(const kvt_redis *r, const char *key, size_t len);
size_t kvt_redis_n_shards(const kvt_redis *r);
/* Drop the queued commands without sending them (a caller that could not
 * queue all of a pipeline). A round trip empties the queue the same way.
 * An emptied queue (and, on a cluster, each node's) whose allocation grew
 * past kvt_redis_keep_bytes is freed: a large upload's pipeline does not
 * stay allocated on the connection after it is sent. */
void kvt_redis_discard(kvt_redis *r);
/* The bytes a command queue keeps allocated once emptied (1 MiB): what
 * lookups and restores' GETs need; the values of an upload pass it. */
extern size_t kvt_redis_keep_bytes;
/* Tests: true keeps every queue's allocation, as the client did before
 * (the negative control of remote_upload_in_windows). */
extern bool kvt_redis_fault_keep_queue;
/* The bytes of the commands queued now (formatted). */
size_t kvt_redis_queued(const kvt_redis *r);
/* The bytes the client holds allocated for command queues: its own and,
 * on a cluster, each node's. */
size_t kvt_redis_queue_bytes(const kvt_redis *r);

/* Whether a connection is open (a connect succeeded and nothing failed
 * since). */
bool kvt_redis_connected(const kvt_redis *r);

#endif
