/* The remote tier (remote.c): the disk tier's records shared through Redis
 * by every server of a fleet, so that a prefix one server computed is a hit
 * on the others (docs/STORE.md "Remote tier", docs/FORMAT.md "Remote
 * tier keys").
 *
 * Uploads are write-behind: the saves' thread hands over the records of a
 * save that committed (kvt_remote_upload encodes them), and a thread of the
 * tier's own sends what Redis lacks, from a bounded queue. Loads run on the
 * store's loads thread (kvt_remote_restore): one pipelined round trip for
 * the index, then the entry's values in windows of bounded bytes, one round
 * trip each (so a restore never holds the entry whole beside the session),
 * every round trip with a deadline, every value checked before anything of
 * it is used; a timeout or an error is a miss, and a circuit breaker stops
 * asking a remote that keeps failing. */
#ifndef KVT_REMOTE_H
#define KVT_REMOTE_H

#include "kvtier.h"

typedef struct kvt_remote kvt_remote;

typedef struct kvt_remote_opts {
    const char *url;            /* redis://, rediss://, redis-cluster:// or rediss-cluster:// (redis.h) */
    const char *password_file;  /* NULL: no AUTH */
    const char *tls_ca;         /* TLS: the CA the server's certificate chains to (NULL: the system's) */
    const char *tls_cert, *tls_key; /* TLS: the client's certificate and key (both or neither) */
    const char *secret_file;    /* NULL: no HMAC (refused with tenants) */
    const char *const *tenants; /* n_tenants names (API keys' names); NULL: one tenant, "default" */
    size_t n_tenants;
    bool keyed_tenants;         /* the tenants are API keys: a secret is required */
    int connect_ms;             /* deadline of a connect (0: 200) */
    int lookup_ms;              /* deadline of the index round trip (0: 20) */
    int load_ms;                /* a fixed deadline of a load (0: scaled by the prefill it saves) */
    double prefill_tps;         /* tokens a second this machine prefills the model at, fixed
                                 * (0: the FLOPs of the prefill at a rate measured by
                                 * kvt_remote_note_prefill, kvt_remote_load_deadline) */
    size_t queue_bytes;         /* upload queue (0: 256 MiB); more is dropped, counted */
    bool quiet;                 /* no warnings on stderr (tests) */
} kvt_remote_opts;

/* A tier for model m (borrowed: it must outlive the tier); reads the
 * password and secret files (KVT_EIO naming the file), checks the URL,
 * refuses tenants without a secret (KVT_EINVAL saying why), and asks
 * Redis once for its maxmemory-policy (a warning on stderr when the policy
 * would refuse writes; an unreachable Redis is not an error: the breaker
 * handles it). Starts the upload thread. */
int kvt_remote_open(kvt_remote **out, kvt_model *m, const kvt_remote_opts *o);
/* Stop: the uploads still queued are sent for at most a second, the rest
 * dropped; NULL is a no-op. */
void kvt_remote_close(kvt_remote *r);

/* Queue for upload the records of s at `at` tokens (a point the session
 * can be saved at, kvt_snap_can_save) for tenant: they are encoded here
 * (the caller's thread, s unchanged), sent later. Not queued (counted as
 * dropped) when the queue is full or the breaker is open. */
void kvt_remote_upload(kvt_remote *r, int tenant, kvt_session *s, size_t at);

/* Restore into s (empty, or holding `have` tokens of toks) the longest
 * prefix of toks[0..n) longer than `have` that the remote holds for
 * tenant: *got its length, 0 for a miss (s untouched then, unless the
 * load had begun: a value that failed its checks, or a window of blocks
 * past the first out of reach, leaves s empty and *got 0: the caller's
 * session must then be re-synced). Never fails: every error is a miss,
 * counted. */
void kvt_remote_restore(kvt_remote *r, int tenant, kvt_session *s, const int32_t *toks, size_t n, size_t have,
                        size_t *got);

/* A prefill of positions [from, to) took `seconds` (the server's measure
 * of this model on this machine, under its load): its FLOPs over seconds
 * is the rate a load's deadline is scaled by, unless opts.prefill_tps
 * fixed one. An average over the last few prefills; prefills of fewer
 * than 256 tokens are ignored. */
void kvt_remote_note_prefill(kvt_remote *r, size_t from, size_t to, double seconds);
/* The deadline of a load that would bring a session from `have` tokens to
 * n, in seconds from the start of its lookup: the time a prefill of those
 * positions takes (its FLOPs, 2 a parameter a token and 4 a layer, head
 * and head dimension a position attended, at the measured rate, or 10^12
 * FLOP/s before one is measured; at least 20 ms), or (n - have) /
 * opts.prefill_tps, or
 * opts.load_ms when set. A remote slower than this is abandoned and the
 * request prefills: a miss costs at most this plus the prefill. */
double kvt_remote_load_deadline(kvt_remote *r, size_t have, size_t n);

/* What a remote holds, for `kvtier cache ls --kv-remote URL`: every index
 * entry of every model and tenant (SCAN, then HGETALL, each round trip
 * within 2 s; on a cluster, SCAN walks every master). o: the URL, the
 * password file and the TLS files; the rest is unused. *out is malloc'ed
 * (*n entries), in the order found. */
typedef struct kvt_remote_entry {
    char ns[64];                /* kvt:r2:KEY0:TENANT */
    uint64_t head;              /* the key of its last whole block */
    uint32_t n_tokens, n_blocks;
    uint64_t bytes;             /* its snapshot record and blocks, as the manifest says */
} kvt_remote_entry;
int kvt_remote_list(const kvt_remote_opts *o, kvt_remote_entry **out, size_t *n);

/* `kvtier cache verify --kv-remote URL`: every index entry of r's model
 * (every tenant's) read and checked as a hit is (remote.c, verify_entry),
 * one value at a time (each round trip within 2 s); each(user, ns, head,
 * tokens, problem) is called for each entry, problem NULL when it is good.
 * del: the entries that fail, and their values that failed, are deleted
 * (as a lookup that meets them does). KVT_EIO when Redis fails. */
typedef struct kvt_remote_verify_stats {
    uint64_t entries, good, bad, gone;  /* gone: a value evicted */
} kvt_remote_verify_stats;
typedef void (*kvt_remote_verify_fn)(void *user, const char *ns, uint64_t head, size_t tokens, const char *problem);
int kvt_remote_verify(kvt_remote *r, bool del, kvt_remote_verify_fn each, void *user, kvt_remote_verify_stats *out);

typedef struct kvt_remote_stats {
    uint64_t hits, misses, errors;   /* lookups; transport errors and timeouts */
    uint64_t abandoned;              /* loads given up at their deadline (slower than the prefill they save) */
    uint64_t bad;                    /* values that failed a check (deleted) */
    uint64_t stale;                  /* index entries whose values were gone (evicted), deleted */
    uint64_t hit_tokens, bytes_read, bytes_written;
    uint64_t values_written;         /* values (blocks, snapshots) sent */
    uint64_t uploads, dropped;       /* snapshots sent; not queued or given up */
    uint64_t queue_len, queue_bytes; /* waiting to be sent */
    double lookup_seconds, load_seconds; /* sums, over lookups and over hits */
    uint64_t load_peak_bytes;        /* the most bytes of values one restore held at once (its snapshot
                                      * record and a window of blocks), over the tier's restores */
    uint64_t upload_peak_bytes;      /* the most bytes one upload held at once, at a round trip: the values
                                      * it sends and their pipeline formatted from them (kvt_remote_flush_bytes
                                      * and a block, or its last blocks and its snapshot record, each twice) */
    uint64_t breaker_trips;          /* every shard's */
    int breaker;                     /* the worst shard's: 0 closed, 1 open, 2 half-open (probing) */
    size_t n_shards;                 /* a cluster's masters known (1: one server), each with a breaker */
    size_t shards_open;              /* shards whose breakers are not closed */
    char last_error[192];            /* the last failure's message ("" none) */
} kvt_remote_stats;
void kvt_remote_stats_get(kvt_remote *r, kvt_remote_stats *o);
/* Each shard's breaker (0 closed, 1 open, 2 half-open) into out[0..cap):
 * a cluster's masters in the order of their first slot (as many as the
 * cluster has: kvt_remote_stats.n_shards when read). Returns the shards
 * known, which may be more than cap. */
size_t kvt_remote_shard_breakers(kvt_remote *r, int *out, size_t cap);

/* Tests: true skips the HMAC check of the values read (the negative control
 * of the planted-record tests). */
extern bool kvt_remote_skip_mac;
/* Tests: true skips the checks of each value on its own (a block's
 * checksum and key, the snapshot record's header) made before the load:
 * the load still refuses the damage, but blames the snapshot, so a
 * damaged block shared by other snapshots stays (the negative control of
 * remote_damaged_values_miss). */
extern bool kvt_remote_skip_value_checks;
/* Tests: true skips a restore's one check of each block (its checksum and
 * key, where it lies in the replies) but still hands the blocks to the
 * loader as checked, so nothing hashes them: the negative control that
 * shows this check is what keeps a flipped byte out of the session
 * (remote_later_window_damage). */
extern bool kvt_remote_fault_skip_block_check;
/* Tests: called (with kvt_remote_before_load_arg) between a lookup that
 * found entries and the round trip that loads one (to stop Redis there). */
extern void (*kvt_remote_before_load)(void *arg);
extern void *kvt_remote_before_load_arg;
/* Tests: one breaker for every shard of a cluster, and a shard's failure
 * the whole round trip's, as the tier was before it had a breaker per
 * master (the negative control of cluster_shard_breaker). */
extern bool kvt_remote_fault_one_breaker;
/* Tests: true sends again the blocks an upload still queued carries, as
 * the tier did before it looked in its queue (the negative control of
 * remote_no_double_upload); kvt_remote_hold_uploads (true) keeps the
 * upload thread from taking an upload off the queue. */
extern bool kvt_remote_fault_resend_queued;
extern volatile bool kvt_remote_hold_uploads;
/* Tests: true gives every load the fixed 500 ms deadline the tier had
 * before it was scaled by the prefill saved (the negative control of
 * remote_load_deadline_bounded_by_prefill). */
extern bool kvt_remote_fault_fixed_deadline;
/* The bytes of blocks one round trip of a restore fetches (8 MiB): a
 * window holds the next blocks while their bytes fit, and at least one, so
 * a restore holds at most its snapshot record (and one part beside it
 * while a record in parts is joined) and max(this, its largest block) of
 * values at once (kvt_remote_stats.load_peak_bytes). Tests make it small
 * to have windows. */
extern size_t kvt_remote_window_bytes;
/* Tests: true fetches every block of a restore in one round trip, as the
 * tier did before windows (the negative control of
 * remote_restore_in_windows: the bytes held pass the bound). */
extern bool kvt_remote_fault_one_trip;
/* The bytes of a value's part (1 MiB); tests make it small to have parts. */
extern size_t kvt_remote_part_bytes;
/* The bytes of an upload's blocks past which they are sent at once from
 * the caller's thread, a window at a time, rather than queued (8 MiB, the
 * restore's window): a prefix of a large model is never held whole; an
 * upload holds at most a window and a block of values and their pipeline
 * (kvt_remote_stats.upload_peak_bytes), and the connection frees the
 * pipeline once sent (kvt_redis_keep_bytes). Tests make it small. */
extern size_t kvt_remote_flush_bytes;
/* Tests, after kvt_remote_drain: the bytes the tier's connections keep
 * allocated for command queues between round trips. */
size_t kvt_remote_send_buffers(kvt_remote *r);
/* Tests: wait for the upload queue to be empty, at most timeout seconds;
 * true when it is. */
bool kvt_remote_drain(kvt_remote *r, double timeout);

#endif
