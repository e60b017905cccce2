/* A small Redis client for the remote tier (redis.c): hiredis 0.14's reply
 * parser (redisReader) over a non-blocking socket of our own, so that the
 * connect and every round trip have a deadline (poll), which hiredis 0.14's
 * blocking context does not give per request. Commands are pipelined: a
 * caller appends several and reads all their replies in one round trip.
 *
 * One connection is used by one thread at a time. A transport failure
 * (timeout, reset, a reply that does not parse) closes the connection: the
 * replies still in flight cannot be matched to their commands any more;
 * the next round trip connects again. */
#ifndef KVT_REDIS_H
#define KVT_REDIS_H

#include "kvtier.h"
#include <hiredis/hiredis.h>
#include <stddef.h>

typedef struct kvt_redis_url {
    char host[256];
    int port;          /* 6379 unless given */
    char user[128];    /* empty: AUTH with the password only (the default user) */
    int db;            /* SELECT db when > 0 */
} kvt_redis_url;

/* Parse redis://[user@]host:port[/db] (host may be [v6addr]). rediss://
 * (TLS) and redis-cluster:// are recognised and refused as not supported
 * yet (KVT_EUNSUPPORTED); anything else is KVT_EINVAL naming what is wrong.
 * A password in the URL is refused: it belongs in a file. */
int kvt_redis_parse_url(const char *url, kvt_redis_url *out);

typedef struct kvt_redis kvt_redis;

/* A client for u (copied); password (copied, may be NULL) is sent with
 * AUTH after each connect, then SELECT. Nothing is connected yet: the
 * first round trip connects, within its own deadline. */
int kvt_redis_new(kvt_redis **out, const kvt_redis_url *u, const char *password);
void kvt_redis_free(kvt_redis *r);

/* Resolve the host (getaddrinfo, which has no deadline) now, so that no
 * round trip does: the addresses are kept for every connect after. Done
 * by the first connect otherwise. KVT_EIO when the name does not resolve. */
int kvt_redis_resolve(kvt_redis *r);

/* Queue one command (argv[i] of lens[i] bytes; lens NULL: NUL-terminated
 * strings). KVT_ENOMEM only; the command is sent by kvt_redis_exec. */
int kvt_redis_append(kvt_redis *r, int argc, const char *const *argv, const size_t *lens);
/* Printf-style append, arguments split by spaces; %s and %b as hiredis's
 * redisFormatCommand reads them. */
int kvt_redis_appendf(kvt_redis *r, const char *fmt, ...);

/* Send every queued command and read one reply for each, connecting first
 * when needed, all within timeout_ms. *replies (malloc'ed, *n of them, in
 * command order; free with kvt_redis_replies_free) are hiredis replies; an
 * error reply of one command is that command's result, not a failure.
 * KVT_EIO naming the cause (timeout, refused, reset, authentication) on a
 * transport failure: the queue is emptied and the connection closed. */
int kvt_redis_exec(kvt_redis *r, int timeout_ms, redisReply ***replies, size_t *n);
void kvt_redis_replies_free(redisReply **replies, size_t n);
/* Drop the queued commands without sending them (a caller that could not
 * queue all of a pipeline). */
void kvt_redis_discard(kvt_redis *r);

/* Whether a connection is open (a connect succeeded and nothing failed
 * since). */
bool kvt_redis_connected(const kvt_redis *r);

#endif
