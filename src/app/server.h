/* kvtier serve (server.c): the blocking entry point (its options:
 * server_opts.h). */
#ifndef KVT_SERVER_H
#define KVT_SERVER_H

#include "app/server_opts.h"

/* Serve until SIGTERM/SIGINT, then stop accepting, answer the queued
 * requests 503, let the running ones finish, save live sessions (reason shutdown) and return KVT_OK.
 * SIGTERM and SIGINT are blocked in the calling thread (and so in every
 * thread the server starts) from the start of the call: one that arrives
 * while the server is starting stops it as soon as it is up. The caller's
 * signal mask and handlers are restored on return. */
int kvt_serve(const kvt_server_opts *o);

#endif
