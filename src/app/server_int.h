/* kvtier serve's private types (server.c): the scheduler's jobs, the
 * tenants and their figures, and the server; the metrics text
 * (server_metrics.c) reads them. */
#ifndef KVT_SERVER_INT_H
#define KVT_SERVER_INT_H

#include "app/server_opts.h"
#include "serve/api.h"
#include "store/remote.h"
#include "store/store.h"
#include "store/storeq.h"
#include "serve/tiers.h"
#include "base/util.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct MHD_Connection;

/* ---- metrics ---- */

#define N_BOUNDS 10          /* a histogram's finite bounds (server_metrics.c) */
typedef struct hist { uint64_t bucket[N_BOUNDS + 1]; double sum; uint64_t count; } hist;

/* Counts v in h. */
void kvt_server_hist_add(hist *h, double v);

typedef struct metrics {
    uint64_t requests[5][6];      /* endpoint x status class (2xx..5xx, 429 separately) */
    uint64_t prompt_tokens, prefilled, generated;
    uint64_t decode_passes, drafted, accepted; /* speculative decoding: passes of replies, drafts, kept */
    uint64_t drafted_by[3], accepted_by[3];    /* the same by drafter: [0] n-gram, [1] the draft model, [2] MTP */
    uint64_t draft_from[3];       /* replies' draft model sessions: [0] new, [1] the pooled session's
                                   * companion (RAM), [2] restored from the store (disk, remote) */
    uint64_t draft_prefilled;     /* tokens the draft sessions ran to follow their contexts */
    uint64_t draft_dropped;       /* draft sessions not kept at a reply's end: no room in the share */
    uint64_t reused_ram, reused_disk, reused_remote, hits_ram, hits_disk, hits_remote, misses;
    uint64_t ram_evictions, disk_saves, disk_save_errors, canceled;
    uint64_t ram_blocks_evicted;  /* 128-token blocks sessions kept in RAM gave back to the budget */
    hist load, save, prefill;
    hist ttft, itl;               /* time to the first token (from arrival), between tokens */
} metrics;

/* ---- jobs ---- */

typedef struct job {
    pthread_mutex_t mu;
    int refs;                     /* handler/response + worker */
    kvt_request req;
    kvt_api api;
    bool stream, done, canceled;
    int status;                   /* HTTP status when done */
    char *body;                   /* non-streaming: the full response */
    kvt_wbuf out;                 /* streaming: SSE bytes not yet sent from out.p + sent */
    size_t sent;
    struct MHD_Connection *c;     /* the request's connection, resumed when there is news */
    bool suspended;               /* c waits for this job, suspended (j->mu) */
    bool ping;                    /* streaming: a keepalive comment is due */
    bool overflow;                /* streaming: more than STREAM_MAX_UNSENT bytes unsent */
    double t_sent;                /* streaming: when the reader last gave bytes, or bytes became pending */
    char tier[16];
    size_t reused;
    int tenant;
    int32_t *toks;                /* the prompt's tokens (tokenized by the handler) */
    size_t n_toks;
    double t_queued;              /* when it joined the queue */
    struct job *next;
} job;

/* One cache namespace per API key: its own RAM share, its own disk store
 * (an equal share of the disk budget) and its own metrics, so no key can
 * hit, time or evict another key's entries or read its figures. */
typedef struct tenant {
    const char *key;          /* NULL: the open server's only tenant */
    uint8_t digest[16];       /* key_digest(key) */
    kvt_store *store;
    char dir[4200];
    char label[40];           /* the operator view's label: the key's NAME (--api-key NAME=KEY) or
                               * "key<i>", nothing of the key itself */
    metrics mx;               /* under server.mu */
    size_t ram, ram_entries;  /* the pool's bytes and sessions, published by the worker (server.mu) */
    size_t draft_ram;         /* the draft sessions' bytes reserved in the pool, likewise */
    size_t draft_kept;        /* the companions' bytes (in ram), likewise */
    size_t queued;            /* jobs waiting (server.mu) */
    size_t active;            /* requests the scheduler runs (server.mu) */
    uint64_t admitted;        /* when the scheduler last started one of its jobs (server.admissions) */
} tenant;
#define MAX_TENANTS 32

/* Exact text of sampled tool calls by call id, so a replayed call renders
 * byte for byte as it was sampled (per tenant, bounded, oldest first out). */
#define MAX_REPLAY 4096
typedef struct replay { int tenant; char id[48]; char *text; size_t len; } replay;

typedef struct server {
    kvt_server_opts o;
    pthread_mutex_t replay_mu;
    replay rp[MAX_REPLAY];
    size_t rp_next;
    kvt_model *m;
    kvt_model *dmodel;            /* --draft model: the draft model (its sessions: each slot's drafter) */
    size_t dscratch;              /* a draft session's scratch (measured at start) */
    kvt_draft_tune learned;       /* what replies learned of the drafter (--draft): each reply's
                                   * tuning starts from it and hands it back; the worker's alone */
    char model_id[128];
    tenant tn[MAX_TENANTS];
    size_t n_tn;
    kvt_tiers *tiers;             /* the RAM pool; the worker's alone */
    kvt_storeq *q;                /* the store threads: saves and disk loads (storeq.h) */
    kvt_remote *remote;           /* the remote tier (remote.h); NULL: none */
    uint64_t loads_done;          /* disk loads over, for the worker to wake on (server.mu) */
    double skip_logged;           /* when a save skipped for RAM was last reported (the worker's) */
    pthread_mutex_t mu;           /* queue, metrics */
    pthread_cond_t cv;
    job *head, *tail;
    size_t queued;
    size_t parallel, active;      /* requests run at once: at most, now */
    uint64_t admissions;          /* jobs the scheduler started (server.mu) */
    uint64_t steps, step_reqs, step_max; /* forward passes, requests in them, the most in one (server.mu) */
    uint64_t steps_waited;        /* scheduler rounds (a step, an admission) that entered the store's
                                     blocking lock: waited on a save or a load (server.mu; 0 by design) */
    bool stopping;
    pthread_t worker;
    uint64_t refused;             /* requests of no tenant: 401s, metrics-key 403s (server.mu) */
    uint8_t secret[192];          /* random per process: the key digests' secret */
    uint8_t metrics_digest[16];
    bool has_metrics_key;
    long started;
} server;

#define KEY_METRICS (-2) /* authorized(): the --metrics-key */

/* The Prometheus text for tenant tnt (KEY_METRICS: the operator's view of
 * every tenant), or NULL out of memory; the caller frees it. */
char *kvt_server_metrics_text(server *sv, int tnt);

#endif
