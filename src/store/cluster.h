/* Redis Cluster routing for the Redis client (cluster.c): the slot map
 * read with CLUSTER SLOTS, each command sent to the master that serves its
 * key's slot (CRC16 of the key, or of its {hash tag}), one connection per
 * master (conn.h), the nodes of a pipeline asked at once. MOVED is
 * followed once (the map read again, the command sent to the new owner),
 * ASK with ASKING on the node named, TRYAGAIN (a multi-key command during
 * a migration) after a short wait, all within the caller's deadline.
 *
 * Every command the remote tier sends names one key first, or several
 * keys of one slot (a value, its parts and its MAC share a hash tag:
 * docs/FORMAT.md "Remote tier keys"). Commands without a key go to the
 * master of slot 0, except SCAN, which walks every master in turn behind
 * a cursor of its own ("NODE-CURSOR"). */
#ifndef KVT_CLUSTER_H
#define KVT_CLUSTER_H

#include "kvtier.h"
#include "store/conn.h"

#define KVT_CLUSTER_SLOTS 16384
#define KVT_CLUSTER_MAX_SEEDS 16
/* The nodes a client knows (its seeds, the masters CLUSTER SLOTS names,
 * the nodes redirects name): a table that grows with the cluster, up to
 * Redis Cluster's own ceiling, one master a slot. A map naming more is
 * refused. */
#define KVT_CLUSTER_MAX_NODES KVT_CLUSTER_SLOTS

/* A round trip's outcome by shard: a cluster's masters numbered in the
 * order of their first slot (a replica that takes over a master's slots
 * takes its number too), or shard 0, the one server. The caller sets
 * skip (the commands bound for those shards are not sent); the rest is
 * the outcome. The four arrays have cap entries each (malloc'ed, grown by
 * kvt_shards_grow: the exec grows them to the shards it knows); a
 * kvt_shards starts zeroed and ends with kvt_shards_free. */
typedef struct kvt_shards {
    bool *skip;        /* in: not asked (their replies NULL) */
    bool *asked;       /* sent a command */
    bool *failed;      /* the round trip failed (timed out, refused, reset): replies NULL */
    bool *refused;     /* answered an error reply (NOAUTH, an ACL, OOM, CLUSTERDOWN) */
    size_t cap;        /* entries of each array */
    size_t n;          /* shards known (1 before a cluster's map is read) */
    char refusal[160]; /* the first error reply's text */
    char why[224];     /* the first failure's message */
} kvt_shards;

/* Make sh's arrays hold at least n shards (the new entries false):
 * KVT_ENOMEM (sh unchanged), or n > KVT_CLUSTER_MAX_NODES (KVT_EINVAL). */
int kvt_shards_grow(kvt_shards *sh, size_t n);
/* Clear the outcome (asked, failed, refused, the messages), skip kept. */
void kvt_shards_clear(kvt_shards *sh);
void kvt_shards_free(kvt_shards *sh);

typedef struct kvt_cluster kvt_cluster;

/* A cluster known by its seeds (hosts[i]:ports[i], copied); nothing is
 * connected yet. auth is borrowed (it outlives the cluster). */
int kvt_cluster_new(kvt_cluster **out, const char (*hosts)[256], const int *ports, size_t n,
                    const kvt_conn_auth *auth);
void kvt_cluster_free(kvt_cluster *c);
/* Resolve the seeds' names by deadline (kvt_conn_resolve; the first
 * failure, KVT_EIO; the others are still resolved). The nodes the map
 * names are resolved by the round trips that first ask them, within
 * their deadlines. */
int kvt_cluster_resolve(kvt_cluster *c, double deadline);
/* Whether some master has an open connection. */
bool kvt_cluster_connected(const kvt_cluster *c);

/* Run the n commands of cmds (formatted, back to back; command i is
 * cmds[offs[i]..offs[i+1])) by deadline, each on the master of its slot;
 * rep[i] its reply (the caller frees), in command order. barriers[0..nb)
 * (ascending command indices): the commands from a barrier on are sent
 * once every command before it has its reply, and not at all when one of
 * those has none. A master whose round trip fails (its connection
 * closed, the map read again by the next call) or whose shard sh->skip
 * names leaves its commands' replies NULL, marked in sh; the other
 * masters' replies are theirs. KVT_EIO when no slot map can be read, or
 * a slot has no master (no replies then). */
int kvt_cluster_exec(kvt_cluster *c, const char *cmds, const size_t *offs, size_t n, const size_t *barriers,
                     size_t nb, double deadline, kvt_shards *sh, redisReply **rep);

/* The shard of a key (-1 before the map is read, or when its slot has no
 * master), and the shards known (0 before the map is read). */
int kvt_cluster_shard_of(const kvt_cluster *c, const char *key, size_t len);
size_t kvt_cluster_n_shards(const kvt_cluster *c);
/* Free each node's command queue whose allocation passed keep bytes (the
 * queues are spent between round trips): the bytes freed. Then the bytes
 * the queues hold. */
size_t kvt_cluster_trim(kvt_cluster *c, size_t keep);
size_t kvt_cluster_queue_bytes(const kvt_cluster *c);

/* The slot of a key (Redis's keyHashSlot: CRC16/XMODEM of the key, or of
 * the first non-empty {tag} in it, modulo 16384). */
unsigned kvt_cluster_slot(const char *key, size_t len);

/* Tests: KVT_CLUSTER_FAULT_NO_MOVED hands MOVED replies to the caller
 * instead of following them, KVT_CLUSTER_FAULT_NO_ASK the same for ASK
 * (the negative controls of the migration test);
 * KVT_CLUSTER_FAULT_64_NODES gives the node table the fixed 64 entries it
 * had before it grew (the negative control of the large cluster test). */
enum { KVT_CLUSTER_FAULT_NO_MOVED = 1, KVT_CLUSTER_FAULT_NO_ASK = 2, KVT_CLUSTER_FAULT_64_NODES = 4 };
extern int kvt_cluster_fault;

#endif
