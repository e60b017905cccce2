/* The cache tiers a request runs on (tiers.c): the RAM pool of live
 * sessions and the choice, per prompt, of the session to run on and how
 * much of the prompt it already holds (RAM, disk, or nothing).
 *
 * Nothing here knows of HTTP, jobs or the server's threads: one caller at
 * a time (the server's worker) owns a kvt_tiers and every session in it;
 * the sessions run on the worker threads the tiers own. What the
 * tiers do that the caller may want to count (a save of a dropped session,
 * an eviction, a restore from disk) is reported through kvt_tier_hooks as
 * it happens. */
#ifndef KVT_TIERS_H
#define KVT_TIERS_H

#include "kvtier.h"
#include "store/policy.h"
#include "session/snapshot.h"
#include "base/threads.h"

#define KVT_TIERS_MAX_POOL 64   /* sessions in RAM, across tenants */
#define KVT_TIERS_MAX_BUSY 16   /* sessions in use at once (the server's --parallel at most) */

/* Optional callbacks, each called with the tenant concerned; NULL ones are
 * skipped. */
typedef struct kvt_tier_hooks {
    /* a dropped session was saved to its tenant's store: rc the save's
     * result, created whether a new entry was written */
    void (*saved)(void *user, int tenant, double seconds, int rc, bool created);
    void (*evicted)(void *user, int tenant);          /* a session left RAM (whole) for the budget */
    void (*loaded)(void *user, int tenant, double seconds); /* a disk restore was tried */
    void *user;
    /* Take a dropped session s, to be saved to store (reason given) later
     * and freed: s is the callee's from then on. false: not taken, saved
     * here. (The server's store threads, storeq.h.) */
    bool (*hand_off)(void *user, int tenant, kvt_store *store, kvt_session *s, const char *reason);
    /* Bytes of the tenant's sessions handed off and not yet saved: they
     * count against its share of the RAM budget until then. */
    size_t (*held)(void *user, int tenant);
    /* blocks of a session were let go for the budget, the session kept:
     * it holds `to` tokens of `from` now */
    void (*trimmed)(void *user, int tenant, size_t from, size_t to);
} kvt_tier_hooks;

typedef struct kvt_tiers_opts {
    size_t ram_bytes;          /* the RAM budget; each tenant gets ram_bytes / n_tenants */
    size_t n_tenants;          /* >= 1; each also gets KVT_TIERS_MAX_POOL / n_tenants sessions */
    uint32_t n_ctx, n_threads; /* of the sessions the pool makes */
    kvt_save_policy policy;    /* the checkpoint grid of new sessions; min_tokens for saves on drop */
    kvt_tier_hooks hooks;
    bool defer_loads;          /* a disk restore is the caller's (kvt_tier_pick.load), not done in
                                * kvt_tiers_select */
    kvt_key_scope keys;        /* the chain the index keys blocks by (snapshot.h): the records'
                                * (0) when a session can reach the disk or remote tier, whose keys
                                * it shares; KVT_KEYS_PROCESS when nothing pooled ever leaves the
                                * process (no store to any select): no model fingerprint made */
} kvt_tiers_opts;

/* A live session, its tenant and when a request last ran on it (the
 * pool's clock: larger is more recent); busy while a request runs on it
 * (from kvt_tiers_select to kvt_tiers_release). */
typedef struct kvt_pooled {
    kvt_session *s;
    uint64_t last_used;
    int tenant;
    bool busy;
    bool loading;              /* a disk restore into it runs on another thread (defer_loads):
                                * neither read nor counted until kvt_tiers_loaded */
    size_t prompt_end;         /* the length of the last prompt picked for it: past it, its reply */
    bool saved;                /* saved to the store for the budget (reason evict) since a request
                                * last ran on it: a later trim or drop does not save it again */
    uint64_t *ik;              /* (nik) the chained keys of its full blocks, as the index holds them */
    size_t nik;
    kvt_session *draft;        /* its companion (NULL: none): the draft model's session of the last
                                * reply on s (kvt_tiers_keep_draft), counted in its bytes, saved,
                                * dropped and evicted with it; out with the request while s is busy */
} kvt_pooled;

/* An entry of the index over the full blocks in RAM: the block b of
 * session s of tenant, whose chained key (kvt_snap_keys_in, in the pool's
 * scope: kvt_tiers_opts.keys) is key. s NULL: an empty slot. */
typedef struct kvt_tier_ix {
    uint64_t key;
    const kvt_session *s;
    uint32_t b;
    int tenant;
} kvt_tier_ix;

/* The sessions run on one set of worker threads, and only busy ones hold
 * scratch: a session that is released gives its scratch to the spares,
 * which the next session picked takes (so there are never more scratch
 * sets than sessions were busy at once). A parked session holds its cache,
 * tokens, logits and checkpoints, all of it counted in its bytes; a busy
 * one its scratch too. The spares count against the budget as well: they
 * are freed first when the sessions and they exceed it. */
typedef struct kvt_tiers {
    kvt_tiers_opts o;
    kvt_model *m;
    kvt_pooled pool[KVT_TIERS_MAX_POOL + KVT_TIERS_MAX_BUSY];  /* (n) in no order; busy ones may
                                                               * take a tenant past its share */
    size_t n;
    uint64_t clock;            /* advances once per use of a session */
    kvt_pool *threads;         /* o.n_threads workers, every session's */
    void *spare[KVT_TIERS_MAX_BUSY];   /* (n_spare) scratch of released sessions (kvt_session_park) */
    size_t n_spare;
    size_t freed;              /* bytes of sessions dropped since memory was last given back */
    kvt_tier_ix *ix;           /* (ix_cap, a power of 2; ix_n used) the index: open addressing on key */
    size_t ix_cap, ix_n;
    size_t reserved[KVT_TIERS_MAX_POOL]; /* per tenant: bytes held outside the pool (kvt_tiers_reserve) */
} kvt_tiers;

/* The prompt a request brings, beside its tokens: its rendered text (to
 * match a session whose sampled tokens the client resent as text) and
 * where a conversation on it can fork (the checkpoint mark). */
typedef struct kvt_tier_prompt {
    const char *text;          /* (len) bytes, the rendered prompt */
    size_t len;
    bool has_bos;              /* the text carries BOS: tokenize without adding it */
    bool special;              /* tokenize with special-token parsing */
    size_t fork_at;            /* where the last user message's own text begins (bytes);
                                * SIZE_MAX: not known */
    bool opening;              /* no assistant turn before fork_at */
} kvt_tier_prompt;

/* What kvt_tiers_select chose. */
typedef struct kvt_tier_pick {
    kvt_session *s;            /* in the pool (owned by it); NULL on failure */
    size_t reused;             /* prompt tokens s holds already (before the prefill) */
    size_t from_disk;          /* of those, restored from the store (0 unless tier is disk) */
    const char *tier;          /* "ram", "disk" or "none"; static */
    bool extended, forked;     /* s is the pooled session itself; a copy of one */
    size_t mark;               /* set on s: the prefill also checkpoints here (0: none) */
    bool opening;              /* the prompt is a conversation's first request: save at mark */
    size_t load;               /* with defer_loads: the store holds this prefix of the prompt; the
                                * caller restores it into s (new, empty), then kvt_tiers_loaded */
    int64_t load_id;           /* the store's entry that holds it (kvt_store_restore_found) */
} kvt_tier_pick;

/* A pool for model m (borrowed: it must outlive the pool). Free with
 * kvt_tiers_free, which frees the sessions left without saving them
 * (kvt_tiers_drop saves first). */
int kvt_tiers_new(kvt_tiers **out, kvt_model *m, const kvt_tiers_opts *o);
void kvt_tiers_free(kvt_tiers *t);

/* Choose the session for tenant's prompt *toks (*n tokens, the caller's
 * malloc'ed array) and make it ready to be synced to it:
 *   1. RAM: the tenant's session with the longest reusable prefix, on token
 *      ids or on the rendered text of its exact tokens (then *toks becomes
 *      those tokens plus the rest of the text tokenized alone: *toks is
 *      freed and replaced, and the caller owns the new array).
 *   2. Disk: store (NULL: none), when it covers more than RAM does. With
 *      defer_loads the lookup does not wait for the store
 *      (kvt_store_lookup_try: a busy store is a miss) and the restore is
 *      left to the caller (pick.load).
 * A prompt that continues the best session extends it in place, unless
 * another request runs on it (busy); so does one that leaves it inside
 * the reply to its last prompt (the next turn of the same conversation,
 * the reply resent otherwise than sampled, or a regeneration: the reply's
 * tail is dropped, not copied); one that leaves it before that, or
 * continues a busy one, after at least 256 shared tokens gets a copy (the
 * session stays whole: a busy session is consistent between steps, so
 * copying it is exact); otherwise a new session, restored from the store
 * when it holds a prefix. Making room beyond the tenant's share takes the
 * tail blocks no other session holds from its least recently used session,
 * one 128-token block at a time, then that session whole (saved to store
 * before it loses anything, reason evict, once); never from a fork's
 * source, a busy session or another tenant's. The RAM match goes through
 * the index over the tenant's full blocks (kvt_tier_ix). Sets the checkpoint
 * mark; the chosen session is busy until kvt_tiers_release.
 * KVT_ECTX (nothing changed but *toks) when the prompt, spliced, exceeds
 * n_ctx; KVT_EINVAL when KVT_TIERS_MAX_BUSY sessions are busy already; the error of
 * kvt_session_new or kvt_session_clone otherwise. */
int kvt_tiers_select(kvt_tiers *t, int tenant, kvt_store *store, const kvt_tier_prompt *p, int32_t **toks,
                     size_t *n, kvt_tier_pick *out);

/* A new, empty session of pick (tier "none") that the caller restores
 * from elsewhere (the remote tier): kept out of every other choice, as a
 * deferred load's is, until kvt_tiers_loaded. */
void kvt_tiers_defer(kvt_tiers *t, kvt_tier_pick *pick);

/* The deferred restore of pick->load tokens into pick->s is over, got of
 * them restored (0: none): s can be read and counted again, and pick says
 * where the prompt comes from (tier, reused, from_disk). */
void kvt_tiers_loaded(kvt_tiers *t, kvt_tier_pick *pick, size_t got);

/* The request on s (a pooled session) is over: s may be extended, copied
 * or evicted for others again. */
void kvt_tiers_release(kvt_tiers *t, const kvt_session *s);

/* The draft model's session of a reply that ran on pooled session s, kept
 * as s's companion (taken: parked, its scratch freed) when the tenant's
 * sessions, reservations and saves queued stay within its share with it;
 * false (d still the caller's, to free): no such session, one already, or
 * it does not fit. Call after the reply's reservations are given back. */
bool kvt_tiers_keep_draft(kvt_tiers *t, const kvt_session *s, kvt_session *d);
/* Take pooled session s's companion (NULL: none) for a request on s: the
 * caller's from then on, out of s's bytes. */
kvt_session *kvt_tiers_take_draft(kvt_tiers *t, const kvt_session *s);

/* Test hook, to show a test catches it: a released session keeps its
 * scratch (as every pooled session did before they shared it). */
extern bool kvt_tiers_fault_keep_scratch;

/* Drop pooled session i (not busy): save it to store first (NULL: no save) when it
 * holds at least policy.min_tokens, with the reason given ("evict",
 * "shutdown"), then free it; or hand it to hooks.hand_off to do both. Its
 * companion goes the same way (a record of the draft model: its own key
 * chain), after it. The last session takes index i. */
void kvt_tiers_drop(kvt_tiers *t, size_t i, kvt_store *store, const char *reason);

/* RAM held by a tenant's sessions and their companions (-1: all tenants;
 * sessions loading are not counted), and their count. */
size_t kvt_tiers_bytes(const kvt_tiers *t, int tenant);
/* Of those, the companions' (the draft model's sessions kept). */
size_t kvt_tiers_draft_bytes(const kvt_tiers *t, int tenant);
/* Entries of the index over the blocks in RAM: full blocks of a
 * tenant's sessions (-1: all tenants) as last indexed (kvt_tiers_select
 * brings them up to date). */
size_t kvt_tiers_index_entries(const kvt_tiers *t, int tenant);
/* RAM held by the spare scratch (not any session's). */
size_t kvt_tiers_spare_bytes(const kvt_tiers *t);
size_t kvt_tiers_count(const kvt_tiers *t, int tenant);
/* Sessions busy, across tenants. */
size_t kvt_tiers_busy(const kvt_tiers *t);

/* RAM a tenant's requests hold outside the pool (the draft model's
 * sessions of its replies in progress) counts against its share as its
 * pooled sessions do: a select makes room for it (make_room) as for them.
 * kvt_tiers_reserve adds bytes, kvt_tiers_unreserve takes back what was
 * added; kvt_tiers_reserved is the tenant's sum (-1: every tenant's). */
void kvt_tiers_reserve(kvt_tiers *t, int tenant, size_t bytes);
void kvt_tiers_unreserve(kvt_tiers *t, int tenant, size_t bytes);
size_t kvt_tiers_reserved(const kvt_tiers *t, int tenant);

/* Test hook, to show a test catches such a bug: KVT_TIERS_FAULT_PREFIX_SHORT
 * makes the common prefix of a prompt and a pooled session one token
 * short; KVT_TIERS_FAULT_TRIM_SHARED makes the eviction take blocks as
 * if no other session held them, busy sessions' included;
 * KVT_TIERS_FAULT_UNRESERVED leaves the reserved bytes out of the budget;
 * KVT_TIERS_FAULT_SPARES_UNHELD frees the spare scratch while the
 * sessions, reservations and spares exceed the budget, the saves queued
 * (hooks.held) left out, as before they counted there;
 * KVT_TIERS_FAULT_DRAFT_UNCOUNTED leaves the companions out of
 * kvt_tiers_bytes (and so out of the budget). */
enum { KVT_TIERS_FAULT_NONE, KVT_TIERS_FAULT_PREFIX_SHORT, KVT_TIERS_FAULT_TRIM_SHARED, KVT_TIERS_FAULT_UNRESERVED,
       KVT_TIERS_FAULT_SPARES_UNHELD, KVT_TIERS_FAULT_DRAFT_UNCOUNTED };
extern int kvt_tiers_fault;

#endif
