/* Connections to Redis servers with deadlines (conn.c): a non-blocking
 * socket each, plain or TLS (tls.h), replies parsed by hiredis 0.14's
 * redisReader, and one poll loop that runs the round trips of several
 * connections at once (a cluster's nodes), so that a pipeline spread over
 * three nodes costs the slowest node's round trip, not the sum.
 *
 * A connection connects on its first round trip: TCP, the TLS handshake,
 * then AUTH and SELECT sent in front of the first commands (no round trip
 * of their own). Any failure (timeout, reset, refused authentication, a
 * reply that does not parse) closes the connection: replies still in
 * flight cannot be matched to their commands any more. */
#ifndef KVT_CONN_H
#define KVT_CONN_H

#include "kvtier.h"
#include "store/tls.h"
#include <hiredis/hiredis.h>
#include <netdb.h>

/* What every connection of a client sends after connecting (borrowed: it
 * outlives the connections). */
typedef struct kvt_conn_auth {
    const char *user;        /* NULL or "": AUTH with the password only */
    const char *password;    /* NULL: no AUTH */
    int db;                  /* SELECT when > 0 */
    kvt_tls *tls;            /* NULL: plain TCP */
} kvt_conn_auth;

typedef struct kvt_conn {
    char host[256];
    int port;
    const kvt_conn_auth *auth;
    struct addrinfo *addrs;  /* the host resolved once, kept */
    struct resolve_job *rj;  /* a name being resolved on a thread of its own (conn.c), NULL none */
    int fd;                  /* -1: not connected */
    SSL *ssl;
    redisReader *rd;
    /* a round trip: the caller sets q (q_n commands, q_len bytes, borrowed)
     * before kvt_conn_run; rep (q_n replies, malloc'ed, the caller takes
     * them) and rc (KVT_OK, or the failure, err its message) after */
    const char *q;
    size_t q_len, q_n;
    redisReply **rep;
    int rc;
    char err[224];
    /* conn.c's own state during a round trip */
    struct addrinfo *ai;
    int phase, sys_err;
    short ev;
    char *hs;                /* AUTH and SELECT, formatted */
    size_t hs_len, hs_n, sent, got;
    redisReply *hs_rep[2];
} kvt_conn;

/* An unconnected connection to host:port (host copied, NUL-terminated,
 * shorter than 256 bytes). */
void kvt_conn_init(kvt_conn *c, const char *host, int port, const kvt_conn_auth *auth);
/* Disconnect and free what c holds; c can connect again after. */
void kvt_conn_close(kvt_conn *c);
/* Resolve the host by deadline (kvt_now() seconds), so no round trip has
 * to: an address literal at once, a name on a thread of its own
 * (getaddrinfo has no deadline; the system's resolver, /etc/hosts and
 * nsswitch as every other program on the machine sees them). KVT_EIO when
 * the name does not resolve, or not by the deadline: the resolution then
 * goes on, and the next round trip waits for it within its own deadline. */
int kvt_conn_resolve(kvt_conn *c, double deadline);
/* Drop the connection (not the resolved addresses). */
void kvt_conn_disconnect(kvt_conn *c);

/* The most elements an array of a reply may have: its header is refused
 * before the reader allocates anything for it (conn.c). A cluster's map
 * has at most 16,384 slot ranges; the tier's own replies are far shorter. */
#define KVT_CONN_MAX_ELEMENTS (1 << 20)

/* The round trips of cs[0..n) at once, by deadline (kvt_now() seconds):
 * each connects when needed, sends its q and reads q_n replies. Returns
 * how many failed (each with its rc and err, closed); the replies of the
 * others are theirs. */
size_t kvt_conn_run(kvt_conn *const *cs, size_t n, double deadline);

/* Tests: KVT_RESOLV_FAULT_HANG makes the resolution of a name (not of an
 * address literal) sleep 1 s first, a resolver that does not answer;
 * KVT_RESOLV_FAULT_BLOCKING resolves on the caller's thread, as before
 * resolutions had a deadline (the negative control). */
enum { KVT_RESOLV_FAULT_HANG = 1, KVT_RESOLV_FAULT_BLOCKING = 2 };
extern int kvt_conn_fault;

#endif
