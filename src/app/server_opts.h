/* kvtier serve's options (server.h's kvt_serve takes them; the server's
 * own files, server_int.h, keep them). */
#ifndef KVT_SERVER_OPTS_H
#define KVT_SERVER_OPTS_H

#include "kvtier.h"
#include "store/policy.h"
#include "serve/draft.h"

#define KVT_SERVE_MAX_PARALLEL 16  /* KVT_TIERS_MAX_BUSY */

typedef struct kvt_server_opts {
    const char *model;        /* GGUF path or preset; NULL: the default model */
    const char *model_id;     /* id clients use; NULL: the model's name */
    kvt_row_type type_k, type_v; /* the cache types (KVT_ROWS_DEFAULT: f16) */
    const char *host;         /* IPv4 address to bind */
    uint16_t port;
    uint32_t n_ctx, n_threads, queue;
    uint32_t max_tokens;      /* tokens a reply gets when the request names none, and the most it may name */
    uint32_t parallel;        /* requests run at once, batched (1..KVT_SERVE_MAX_PARALLEL);
                               * 0: from cores and the RAM budget */
    const char *disk_dir;     /* NULL: no disk tier */
    uint64_t disk_bytes;      /* the disk budget; with API keys the total, split equally */
    uint64_t disk_min_free;   /* bytes kept free on the disk's file system: 0 keeps none,
                               * KVT_STORE_MIN_FREE_DEFAULT 5% of it, at most 1 GiB */
    size_t ram_bytes;         /* budget of the RAM tier; with API keys split equally */
    size_t max_body;          /* request body limit */
    uint32_t request_timeout; /* seconds a connection has to complete its request (headers
                               * and body; also the idle time between keep-alive requests) */
    uint32_t max_conn_per_addr; /* connections from one client address at once */
    uint32_t max_connections; /* connections at once; more are answered 503 (bounded by the
                               * descriptor limit) */
    const char **api_keys;    /* n_keys keys, each its own cache namespace; 0: no authentication */
    size_t n_keys;
    const char **api_key_names; /* NULL, or n_keys names (NULL or "" each: "key<i>"): the
                               * operator view's tenant labels (--api-key NAME=KEY) */
    const char *metrics_key;  /* NULL, or a key that reads GET /metrics only: every key's
                               * figures, labelled tenant="NAME" (needs n_keys > 0) */
    bool strict_model;        /* 404 for a "model" other than model_id; by default any
                               * name is served (agent clients send their own) and
                               * echoed back */
    bool keep_volatile;       /* keep volatile lines (billing headers) in prompts */
    kvt_save_policy policy;
    const char *remote_url;   /* NULL: no remote tier; else redis://, rediss:// or redis-cluster:// (redis.h) */
    const char *remote_password_file; /* NULL: no AUTH */
    const char *remote_tls_ca, *remote_tls_cert, *remote_tls_key; /* rediss:// (remote.h); NULL: none */
    const char *remote_secret_file;   /* NULL: no HMAC (refused with API keys) */
    uint32_t remote_lookup_ms;        /* deadline of a remote lookup (0: 20) */
    double remote_prefill_tps;        /* prefill rate a remote load's deadline is scaled by (0: measured) */
    kvt_draft_kind draft;     /* speculative decoding's drafter (--draft) */
    uint32_t draft_max;       /* tokens drafted at most a pass (--draft-max; 0: the default) */
    const char *model_draft;  /* --model-draft: KVT_DRAFT_MODEL: the draft model's file; KVT_DRAFT_MTP: ds4.c's MTP file */
    void (*ready)(void *user); /* called once listening */
    void *ready_user;
} kvt_server_opts;

#endif
