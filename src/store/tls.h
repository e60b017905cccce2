/* TLS for the Redis client (tls.c): OpenSSL over a non-blocking socket that
 * conn.c owns, so that the handshake and every read and write keep the
 * round trip's deadline (the caller polls for what OpenSSL wants next).
 *
 * The server's certificate is always verified: its chain against the CA
 * file given (--kv-remote-ca), or the system's store without one, and its
 * name against the host connected to (SSL_set1_host for a name, the IP
 * address field for an address literal). There is no switch that turns
 * either check off: a remote tier that accepted any certificate would hand
 * its records, and the fleet's prompts, to whoever sits on the path. */
#ifndef KVT_TLS_H
#define KVT_TLS_H

#include "kvtier.h"
#include <openssl/ssl.h>
#include <sys/types.h>

typedef struct kvt_tls kvt_tls;

/* A context: ca (NULL: the system's CAs), cert and key (both or neither:
 * the client's certificate, for a server with tls-auth-clients). Each
 * file is read now: KVT_EIO naming the file and OpenSSL's reason. */
int kvt_tls_new(kvt_tls **out, const char *ca, const char *cert, const char *key);
void kvt_tls_free(kvt_tls *t);

/* A TLS session on the connected socket fd to host (the name or address
 * the certificate must carry); NULL with the reason (kvt_errmsg) when it
 * cannot be made. Free with SSL_free. */
SSL *kvt_tls_open(kvt_tls *t, int fd, const char *host);

/* One step of the handshake: 1 done, 0 not yet (*events: what to poll
 * for), KVT_EIO naming the reason (a certificate that does not verify
 * says which check it failed). */
int kvt_tls_handshake(SSL *s, short *events);

/* Non-blocking read and write: the bytes moved (> 0), 0 when it would
 * block (*events: what to poll for), -1 on an error or a closed
 * connection (kvt_errmsg says which). A write that returned 0 must be
 * repeated with the same bytes. */
ssize_t kvt_tls_read(SSL *s, void *buf, size_t len, short *events);
ssize_t kvt_tls_write(SSL *s, const void *buf, size_t len, short *events);

/* Tests: faults that weaken the verification, the negative controls of
 * the bad-CA and wrong-name tests: KVT_TLS_FAULT_NO_CHAIN accepts any
 * chain, KVT_TLS_FAULT_NO_HOST any name. */
enum { KVT_TLS_FAULT_NO_CHAIN = 1, KVT_TLS_FAULT_NO_HOST = 2 };
extern int kvt_tls_fault;

#endif
