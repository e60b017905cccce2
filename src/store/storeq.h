/* The store thread (storeq.c): the server's disk saves and loads, run off
 * its scheduler, so that no step waits on the disk or on another process's
 * lock of a store.
 *
 * Two threads per server run the jobs of every tenant's store: one the
 * loads (a request waits on each), one the saves (nobody waits on them:
 * its segment writes run at SCHED_IDLE while no other job waits), each in
 * the order given. A save
 * that fails on another process's lock (SQLite busy) is tried again later,
 * with a growing pause, while loads go on. */
#ifndef KVT_STOREQ_H
#define KVT_STOREQ_H

#include "kvtier.h"
#include "store/policy.h"

typedef struct kvt_storeq kvt_storeq;
typedef struct kvt_storeq_job kvt_storeq_ticket; /* a load in progress */

/* Reports, called on the store thread without any of its locks held; NULL
 * ones are skipped. */
typedef struct kvt_storeq_hooks {
    /* a save job is over: rc its result (KVT_EIO when it was given up on
     * another process's lock at shutdown), created the new entries it
     * wrote */
    void (*saved)(void *user, int tenant, double seconds, int rc, size_t created);
    void (*loaded)(void *user, int tenant, double seconds); /* a disk restore was tried */
    void (*wake)(void *user);                                /* a load is done */
    void *user;
} kvt_storeq_hooks;

/* A queue and its threads; the policy (copied) drives kvt_storeq_save_policy
 * jobs. */
int kvt_storeq_new(kvt_storeq **out, const kvt_save_policy *policy, const kvt_storeq_hooks *h);
/* Run every job still queued (the saves of a shutdown), then stop the
 * threads and free the queue. A save that still finds its store locked by
 * another process SHUTDOWN_WAIT seconds after this call is given up. */
void kvt_storeq_free(kvt_storeq *q);

/* Save session s (taken: the queue frees it once saved) to st for tenant:
 * whole, with reason (kvt_store_save_new), or per the policy
 * (kvt_store_apply_policy of its n, from_disk, fork_at). Its bytes count
 * as held for tenant until then (kvt_storeq_held). KVT_ENOMEM: not queued,
 * s is still the caller's. */
int kvt_storeq_save(kvt_storeq *q, kvt_store *st, int tenant, kvt_session *s, const char *reason);
int kvt_storeq_save_policy(kvt_storeq *q, kvt_store *st, int tenant, kvt_session *s, size_t n, size_t from_disk,
                           size_t fork_at);

/* Restore into s the longest prefix of toks[0..n) that st holds: entry
 * id, which a lookup of toks found to hold match tokens, or another when
 * it cannot serve (kvt_store_restore_found; id -1: look toks up). s and
 * toks are borrowed: the caller neither touches nor frees them until
 * kvt_storeq_load_done says the load is over. KVT_ENOMEM: not queued. */
int kvt_storeq_load(kvt_storeq *q, kvt_store *st, int tenant, kvt_session *s, const int32_t *toks, size_t n,
                    size_t match, int64_t id, kvt_storeq_ticket **out);
/* Whether the load is over: then *got holds the tokens restored (0: none),
 * *from_remote (may be NULL) whether the remote tier gave them, and ld is
 * freed. */
bool kvt_storeq_load_done(kvt_storeq_ticket *ld, size_t *got, bool *from_remote);

/* The remote tier (borrowed; set before the first job, NULL: none): every
 * load (match 0 and id -1: the remote tier only) also asks it for a longer
 * prefix, a remote hit is queued to be saved to the load's store, and the
 * points a save committed are handed to it for upload (remote.h). */
struct kvt_remote;
void kvt_storeq_set_remote(kvt_storeq *q, struct kvt_remote *r);

/* Bytes of the sessions queued to be saved for tenant, as they hold them
 * now (kvt_session_bytes; the one being saved: when its save began), and
 * the jobs of tenant queued or running (for /metrics). */
size_t kvt_storeq_held(kvt_storeq *q, int tenant);
/* Test hook: kvt_storeq_held counts each session at its bytes when it was
 * queued (a copy queued beside its live source: next to nothing, however
 * much it holds once the source is gone), to show a test catches it. */
extern bool kvt_storeq_fault_held_at_queue;
/* Test hook: queues made while it is set write their saves at the
 * process's priority throughout (as before the idle writes). */
extern bool kvt_storeq_fault_no_idle;
/* Test hook: kvt_storeq_save and kvt_storeq_save_policy run the save on
 * the caller's thread before they return (as the scheduler saved before
 * the store thread); a save that meets another process's lock is queued
 * as usual. The server sets it when KVT_FAULT_SAVES_INLINE=1 is in its
 * environment (tests/test_storeq.c: the steps then wait on the store). */
extern bool kvt_storeq_fault_inline;
size_t kvt_storeq_pending(kvt_storeq *q, int tenant);

#endif
