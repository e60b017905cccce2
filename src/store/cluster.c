/* Redis Cluster routing (see cluster.h).
 *
 * The map is one byte pair per slot naming a node of c->nodes (masters
 * only: reads and writes both go to masters, so a replica's lag never
 * shows as a miss). The node table grows with the map (a cluster of a
 * thousand nodes and more), to KVT_CLUSTER_MAX_NODES: a CLUSTER SLOTS
 * reply is checked whole (its ranges' count, slots, shapes, a slot named
 * twice) before a node of it is added, and the reader refuses an array
 * longer than conn.c's bound before allocating it, so a hostile reply
 * costs a refused map, never unbounded memory. A command's slot is read from the formatted command
 * itself (its first argument after the name), so the callers queue
 * commands exactly as for one server. A round over the nodes runs their
 * pipelines at once; the replies that redirect (MOVED, ASK, TRYAGAIN) are
 * sent again in a next round, at most ROUNDS rounds, all by the deadline. */
#include "store/cluster.h"
#include "base/util.h"
#include "base/buf.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define NONE 0xffff
#define ROUNDS 4
#define OLD_MAX_NODES 64 /* the fixed table's size before it grew (KVT_CLUSTER_FAULT_64_NODES) */

int kvt_cluster_fault;

typedef struct node {
    kvt_conn c;
    kvt_wbuf q;          /* this round's commands */
    size_t *who;         /* for each, the pending command it answers (SIZE_MAX: ASKING's reply) */
    size_t n_who, cap_who;
    int rank;            /* a master's shard: its place in the order of first slots; -1 not a master */
} node;

struct kvt_cluster {
    const kvt_conn_auth *auth;
    node **nodes;            /* [cap_nodes], n_nodes used; the seeds are nodes[0..n_seeds) */
    size_t n_nodes, cap_nodes, n_seeds;
    uint32_t *by_addr;       /* [cap_by_addr] open addressing over host:port: node index + 1, 0 empty */
    size_t cap_by_addr;
    int *ms;                 /* [cap_nodes] the masters (node indices) in the order of their first slot */
    size_t n_masters;
    uint16_t slot[KVT_CLUSTER_SLOTS];
    bool have_map, stale;
};

/* ---- shards ---- */

int kvt_shards_grow(kvt_shards *sh, size_t n)
{
    if (n <= sh->cap) return KVT_OK;
    if (n > KVT_CLUSTER_MAX_NODES) return kvt_fail(KVT_EINVAL, "redis cluster: %zu shards", n);
    size_t cap = sh->cap ? sh->cap : 4;
    while (cap < n) cap *= 2;
    bool **arr[4] = {&sh->skip, &sh->asked, &sh->failed, &sh->refused};
    for (int a = 0; a < 4; a++) {
        bool *p = realloc(*arr[a], cap * sizeof *p);
        if (!p) return kvt_fail(KVT_ENOMEM, "redis cluster: %zu shards", n);
        memset(p + sh->cap, 0, (cap - sh->cap) * sizeof *p);
        *arr[a] = p; /* grown one by one: each keeps cap entries, the old ones as they were */
    }
    sh->cap = cap;
    return KVT_OK;
}

void kvt_shards_clear(kvt_shards *sh)
{
    if (sh->cap) {
        memset(sh->asked, 0, sh->cap * sizeof *sh->asked);
        memset(sh->failed, 0, sh->cap * sizeof *sh->failed);
        memset(sh->refused, 0, sh->cap * sizeof *sh->refused);
    }
    sh->refusal[0] = sh->why[0] = 0;
}

void kvt_shards_free(kvt_shards *sh)
{
    if (!sh) return;
    free(sh->skip);
    free(sh->asked);
    free(sh->failed);
    free(sh->refused);
    memset(sh, 0, sizeof *sh);
}

/* ---- slots ---- */

static uint16_t crc16(const char *p, size_t n)
{
    uint16_t crc = 0;
    for (size_t i = 0; i < n; i++) {
        crc ^= (uint16_t)((uint8_t)p[i] << 8);
        for (int b = 0; b < 8; b++) crc = crc & 0x8000 ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
    }
    return crc;
}

unsigned kvt_cluster_slot(const char *key, size_t len)
{
    const char *o = memchr(key, '{', len);
    if (o) {
        const char *e = memchr(o + 1, '}', len - (size_t)(o + 1 - key));
        if (e && e > o + 1) return crc16(o + 1, (size_t)(e - o - 1)) & (KVT_CLUSTER_SLOTS - 1);
    }
    return crc16(key, len) & (KVT_CLUSTER_SLOTS - 1);
}

/* Argument i of a formatted command (*N\r\n$L\r\nARG\r\n...): false when
 * there is none. */
static bool resp_arg(const char *cmd, size_t len, size_t i, const char **p, size_t *l)
{
    const char *end = cmd + len, *s = cmd;
    if (s >= end || *s != '*') return false;
    size_t argc = strtoul(s + 1, NULL, 10);
    if (i >= argc || !(s = memchr(s, '\n', (size_t)(end - s)))) return false;
    s++;
    for (size_t k = 0; k <= i; k++) {
        if (s >= end || *s != '$') return false;
        size_t al = strtoul(s + 1, NULL, 10);
        const char *nl = memchr(s, '\n', (size_t)(end - s));
        if (!nl || (size_t)(end - nl - 1) < al + 2) return false;
        if (k == i) { *p = nl + 1; *l = al; return true; }
        s = nl + 1 + al + 2;
    }
    return false;
}

static bool is_cmd(const char *cmd, size_t len, const char *name)
{
    const char *p;
    size_t l;
    return resp_arg(cmd, len, 0, &p, &l) && l == strlen(name) && !strncasecmp(p, name, l);
}

/* The slot a command goes to, -1 when it names no key. */
static int cmd_slot(const char *cmd, size_t len)
{
    static const char *const keyless[] = {"SCAN", "CONFIG", "PING", "INFO", "CLUSTER", "DBSIZE", "ASKING", NULL};
    for (int i = 0; keyless[i]; i++)
        if (is_cmd(cmd, len, keyless[i])) return -1;
    const char *p;
    size_t l;
    return resp_arg(cmd, len, 1, &p, &l) ? (int)kvt_cluster_slot(p, l) : -1;
}

/* ---- nodes and the map ---- */

static size_t addr_hash(const char *host, int port)
{
    uint64_t h = 1469598103934665603ull ^ (uint64_t)port; /* FNV-1a */
    for (const char *p = host; *p; p++) h = (h ^ (uint8_t)*p) * 1099511628211ull;
    return (size_t)(h ^ (h >> 29));
}

/* Where host:port is in c->by_addr, or the empty entry it would take. */
static size_t addr_slot(const kvt_cluster *c, const char *host, int port)
{
    size_t mask = c->cap_by_addr - 1, i = addr_hash(host, port) & mask;
    for (;; i = (i + 1) & mask) {
        uint32_t k = c->by_addr[i];
        if (!k) return i;
        const kvt_conn *n = &c->nodes[k - 1]->c;
        if (n->port == port && !strcmp(n->host, host)) return i;
    }
}

/* Room for one node more: the table, the masters' order and the index
 * by address (kept at most half full) doubled when full. */
static bool nodes_room(kvt_cluster *c)
{
    if (c->n_nodes < c->cap_nodes) return true;
    size_t cap = c->cap_nodes ? c->cap_nodes * 2 : 8;
    if (cap > KVT_CLUSTER_MAX_NODES) cap = KVT_CLUSTER_MAX_NODES;
    if (cap <= c->n_nodes) return false;
    node **nodes = realloc(c->nodes, cap * sizeof *nodes);
    if (!nodes) return false;
    c->nodes = nodes;
    int *ms = realloc(c->ms, cap * sizeof *ms);
    if (!ms) return false;
    c->ms = ms;
    uint32_t *ix = kvt_calloc(cap * 2, sizeof *ix), *old = c->by_addr;
    if (!ix) return false;
    c->by_addr = ix;
    c->cap_by_addr = cap * 2;
    for (size_t i = 0; i < c->n_nodes; i++) c->by_addr[addr_slot(c, c->nodes[i]->c.host, c->nodes[i]->c.port)] = (uint32_t)i + 1;
    free(old);
    c->cap_nodes = cap;
    return true;
}

/* The node host:port, added when new: -1 when the table is full
 * (KVT_CLUSTER_MAX_NODES), memory runs out, or the name is too long. */
static int node_of(kvt_cluster *c, const char *host, int port)
{
    if (strlen(host) >= 256) return -1;
    if (c->cap_by_addr) {
        uint32_t k = c->by_addr[addr_slot(c, host, port)];
        if (k) return (int)k - 1;
    }
    if ((kvt_cluster_fault & KVT_CLUSTER_FAULT_64_NODES) && c->n_nodes >= OLD_MAX_NODES) return -1;
    if (!nodes_room(c)) return -1;
    node *n = kvt_calloc(1, sizeof *n);
    if (!n) return -1;
    kvt_conn_init(&n->c, host, port, c->auth);
    n->rank = -1;
    c->nodes[c->n_nodes] = n;
    c->by_addr[addr_slot(c, host, port)] = (uint32_t)c->n_nodes + 1;
    return (int)c->n_nodes++;
}

int kvt_cluster_new(kvt_cluster **out, const char (*hosts)[256], const int *ports, size_t n, const kvt_conn_auth *auth)
{
    *out = NULL;
    if (!n || n > KVT_CLUSTER_MAX_SEEDS) return kvt_fail(KVT_EINVAL, "redis cluster: %zu seed nodes", n);
    kvt_cluster *c = kvt_calloc(1, sizeof *c);
    if (!c) return KVT_ENOMEM;
    c->auth = auth;
    for (size_t i = 0; i < KVT_CLUSTER_SLOTS; i++) c->slot[i] = NONE;
    for (size_t i = 0; i < n; i++)
        if (node_of(c, hosts[i], ports[i]) < 0) {
            kvt_cluster_free(c);
            return KVT_ENOMEM;
        }
    c->n_seeds = c->n_nodes;
    *out = c;
    return KVT_OK;
}

void kvt_cluster_free(kvt_cluster *c)
{
    if (!c) return;
    for (size_t i = 0; i < c->n_nodes; i++) {
        kvt_conn_close(&c->nodes[i]->c);
        kvt_wbuf_free(&c->nodes[i]->q);
        free(c->nodes[i]->who);
        free(c->nodes[i]);
    }
    free(c->nodes);
    free(c->ms);
    free(c->by_addr);
    free(c);
}

int kvt_cluster_resolve(kvt_cluster *c, double deadline)
{
    int rc = KVT_OK;
    for (size_t i = 0; i < c->n_seeds; i++) {
        int r = kvt_conn_resolve(&c->nodes[i]->c, deadline);
        if (r && !rc) rc = r;
    }
    return rc;
}

bool kvt_cluster_connected(const kvt_cluster *c)
{
    for (size_t i = 0; i < c->n_nodes; i++)
        if (c->nodes[i]->c.fd >= 0) return true;
    return false;
}

/* The map from a CLUSTER SLOTS reply that node `from` gave: false (why
 * said in why) for a reply of another shape, more ranges than slots, a
 * slot out of range or named twice, a bad endpoint, or more nodes than
 * the table takes. The whole reply is checked before a node is added. */
static bool parse_slots(kvt_cluster *c, const redisReply *x, int from, char *why, size_t cap)
{
    if (x->type != REDIS_REPLY_ARRAY || !x->elements) {
        snprintf(why, cap, "%s", x->type == REDIS_REPLY_ERROR ? x->str : "a reply of an unknown shape");
        return false;
    }
    /* the ranges are disjoint and not empty: no more of them than slots */
    if (x->elements > KVT_CLUSTER_SLOTS) {
        snprintf(why, cap, "%zu slot ranges, more than the %d slots", x->elements, KVT_CLUSTER_SLOTS);
        return false;
    }
    uint16_t *map = kvt_malloc(KVT_CLUSTER_SLOTS * sizeof *map);
    if (!map) { snprintf(why, cap, "no memory for a map"); return false; }
    for (size_t i = 0; i < KVT_CLUSTER_SLOTS; i++) map[i] = NONE;
    bool ok = true;
    for (size_t e = 0; e < x->elements && ok; e++) { /* checked: shapes, slots, endpoints (map[]: named) */
        const redisReply *r = x->element[e];
        ok = r->type == REDIS_REPLY_ARRAY && r->elements >= 3 && r->element[0]->type == REDIS_REPLY_INTEGER &&
             r->element[1]->type == REDIS_REPLY_INTEGER && r->element[2]->type == REDIS_REPLY_ARRAY;
        if (!ok) { snprintf(why, cap, "slot range %zu: a reply of an unknown shape", e); break; }
        long long lo = r->element[0]->integer, hi = r->element[1]->integer;
        const redisReply *m = r->element[2];
        if (lo < 0 || hi >= KVT_CLUSTER_SLOTS || lo > hi) {
            snprintf(why, cap, "slot range %zu: slots %lld-%lld", e, lo, hi);
            ok = false;
            break;
        }
        if (m->elements < 2 || m->element[0]->type != REDIS_REPLY_STRING || m->element[0]->len >= 256 ||
            m->element[1]->type != REDIS_REPLY_INTEGER || m->element[1]->integer < 1 || m->element[1]->integer > 65535) {
            snprintf(why, cap, "slot range %zu: a bad endpoint", e);
            ok = false;
            break;
        }
        for (long long s = lo; s <= hi && ok; s++) {
            if (map[s] != NONE) {
                snprintf(why, cap, "slot %lld named twice", s);
                ok = false;
            }
            map[s] = 0;
        }
    }
    size_t n0 = c->n_nodes;
    for (size_t e = 0; e < x->elements && ok; e++) {
        const redisReply *r = x->element[e], *m = r->element[2];
        /* an empty or "?" endpoint: the node's address is the one we asked */
        const char *host = m->element[0]->str;
        if (!host[0] || !strcmp(host, "?")) host = c->nodes[from]->c.host;
        int k = node_of(c, host, (int)m->element[1]->integer);
        if (k < 0) {
            snprintf(why, cap, "%zu nodes or more: more than the client takes (%d), or no memory", c->n_nodes + 1,
                     kvt_cluster_fault & KVT_CLUSTER_FAULT_64_NODES ? OLD_MAX_NODES : KVT_CLUSTER_MAX_NODES);
            ok = false;
            break;
        }
        for (long long s = r->element[0]->integer; s <= r->element[1]->integer; s++) map[s] = (uint16_t)k;
    }
    if (ok) memcpy(c->slot, map, KVT_CLUSTER_SLOTS * sizeof *map);
    else if (c->n_nodes > n0) { /* the nodes a refused map added go (none is connected, or in the map) */
        for (size_t i = n0; i < c->n_nodes; i++) {
            kvt_conn_close(&c->nodes[i]->c);
            free(c->nodes[i]);
        }
        c->n_nodes = n0;
        memset(c->by_addr, 0, c->cap_by_addr * sizeof *c->by_addr);
        for (size_t i = 0; i < n0; i++) c->by_addr[addr_slot(c, c->nodes[i]->c.host, c->nodes[i]->c.port)] = (uint32_t)i + 1;
    }
    free(map);
    return ok;
}

static void rank_masters(kvt_cluster *c);

/* Read the map (CLUSTER SLOTS) from the first node that answers: prefer
 * first, then the nodes connected, then the rest. */
static int refresh(kvt_cluster *c, int prefer, double deadline)
{
    static const char ask[] = "*2\r\n$7\r\nCLUSTER\r\n$5\r\nSLOTS\r\n";
    /* a copy: the nodes a map names are added to the table as it is read */
    int *order = kvt_malloc((c->n_nodes ? c->n_nodes : 1) * sizeof *order), k = 0;
    if (!order) return kvt_fail(KVT_ENOMEM, "redis cluster: no memory to read the map");
    if (prefer >= 0) order[k++] = prefer;
    for (int pass = 0; pass < 2; pass++)
        for (size_t i = 0; i < c->n_nodes; i++)
            if ((int)i != prefer && (c->nodes[i]->c.fd >= 0) == (pass == 0)) order[k++] = (int)i;
    char err[512] = "no node";
    for (int i = 0; i < k && kvt_now() < deadline; i++) {
        kvt_conn *n = &c->nodes[order[i]]->c;
        n->q = ask;
        n->q_len = sizeof ask - 1;
        n->q_n = 1;
        /* half the time left, all of it for the last: a stopped node (its
         * kernel still accepts connections) does not take the whole
         * deadline from the nodes after it */
        double now = kvt_now(), until = i + 1 < k ? now + (deadline - now) / 2 : deadline;
        if (kvt_conn_run(&n, 1, until)) {
            snprintf(err, sizeof err, "%s", n->err);
            continue;
        }
        redisReply *x = n->rep[0];
        free(n->rep);
        n->rep = NULL;
        char why[200];
        bool ok = parse_slots(c, x, order[i], why, sizeof why);
        if (!ok) snprintf(err, sizeof err, "redis %s:%d: CLUSTER SLOTS: %s", n->host, n->port, why);
        freeReplyObject(x);
        if (ok) {
            c->have_map = true;
            c->stale = false;
            rank_masters(c);
            free(order);
            return KVT_OK;
        }
    }
    free(order);
    return kvt_fail(KVT_EIO, "redis cluster: no slot map: %s", err);
}

/* ---- SCAN over every master ---- */

/* Number the masters (each node's rank, c->ms) in the order of their
 * first slot. */
static void rank_masters(kvt_cluster *c)
{
    for (size_t i = 0; i < c->n_nodes; i++) c->nodes[i]->rank = -1;
    size_t n = 0;
    for (size_t s = 0; s < KVT_CLUSTER_SLOTS; s++) {
        int k = c->slot[s];
        if (k == NONE || c->nodes[k]->rank >= 0) continue;
        c->nodes[k]->rank = (int)n;
        c->ms[n++] = k;
    }
    c->n_masters = n;
}

int kvt_cluster_shard_of(const kvt_cluster *c, const char *key, size_t len)
{
    if (!c->have_map) return -1;
    uint16_t k = c->slot[kvt_cluster_slot(key, len)];
    return k == NONE ? -1 : c->nodes[k]->rank;
}

size_t kvt_cluster_n_shards(const kvt_cluster *c) { return c->have_map ? c->n_masters : 0; }

size_t kvt_cluster_trim(kvt_cluster *c, size_t keep)
{
    size_t n = 0;
    for (size_t i = 0; i < c->n_nodes; i++)
        if (c->nodes[i]->q.cap > keep) {
            n += c->nodes[i]->q.cap;
            kvt_wbuf_free(&c->nodes[i]->q);
        }
    return n;
}

size_t kvt_cluster_queue_bytes(const kvt_cluster *c)
{
    size_t n = 0;
    for (size_t i = 0; i < c->n_nodes; i++) n += c->nodes[i]->q.cap;
    return n;
}

/* SCAN "M-C" (master M, its cursor C; "0" starts at master 0) made into
 * SCAN C for master M. *node the master; the rewritten command in *cmd
 * (malloc'ed, *len). */
static int scan_cmd(const kvt_cluster *c, const char *p, size_t len, int *node, size_t *m_i, char **cmd, int *clen)
{
    const int *ms = c->ms;
    size_t nm = c->n_masters;
    const char *argv[16];
    size_t lens[16], argc = strtoul(p + 1, NULL, 10);
    if (argc < 2 || argc > 16 || !nm) return kvt_fail(KVT_EINVAL, "redis cluster: a SCAN it cannot route");
    for (size_t i = 0; i < argc; i++)
        if (!resp_arg(p, len, i, &argv[i], &lens[i])) return kvt_fail(KVT_EINVAL, "redis cluster: a malformed command");
    char cur[48];
    snprintf(cur, sizeof cur, "%.*s", (int)(lens[1] < 40 ? lens[1] : 40), argv[1]);
    char *dash = strchr(cur, '-');
    size_t mi = dash ? strtoul(cur, NULL, 10) : 0;
    const char *inner = dash ? dash + 1 : cur;
    if (mi >= nm) return kvt_fail(KVT_EINVAL, "redis cluster: SCAN cursor %s names no master", cur);
    argv[1] = inner;
    lens[1] = strlen(inner);
    *clen = redisFormatCommandArgv(cmd, (int)argc, argv, lens);
    if (*clen < 0) return KVT_ENOMEM;
    *node = ms[mi];
    *m_i = mi;
    return KVT_OK;
}

/* A master's SCAN reply made to carry the walk's cursor. */
static void scan_reply(const kvt_cluster *c, redisReply *x, size_t mi)
{
    if (x->type != REDIS_REPLY_ARRAY || x->elements != 2 || x->element[0]->type != REDIS_REPLY_STRING) return;
    size_t nm = c->n_masters;
    redisReply *cur = x->element[0];
    char buf[64];
    bool done = !strcmp(cur->str, "0");
    if (done && mi + 1 >= nm) return; /* "0": the walk is over */
    if (done) snprintf(buf, sizeof buf, "%zu-0", mi + 1);
    else snprintf(buf, sizeof buf, "%zu-%.40s", mi, cur->str);
    char *s = strdup(buf);
    if (!s) return;
    free(cur->str);
    cur->str = s;
    cur->len = strlen(s);
}

/* ---- exec ---- */

typedef struct pend {
    size_t i;           /* the command */
    int node, moved, shard;
    bool asking, scan, gone; /* gone: no reply (its shard skipped or failed) */
    size_t scan_m;
    redisReply *last;   /* the last redirect, the result if it is not followed */
} pend;

static int push(node *n, const char *p, size_t l, size_t who)
{
    int rc = KVT_OK;
    KVT_GROW(n->who, &n->cap_who, n->n_who + 1, rc);
    if (rc) return rc;
    kvt_wbuf_put(&n->q, p, l);
    if (n->q.oom) return kvt_fail(KVT_ENOMEM, "redis cluster: a pipeline");
    n->who[n->n_who++] = who;
    return KVT_OK;
}

/* "MOVED 3999 127.0.0.1:6381": its node (added when new), -1 unreadable. */
static int redirect_node(kvt_cluster *c, const char *s, unsigned *slot)
{
    const char *sp = strchr(s, ' ');
    if (!sp) return -1;
    *slot = (unsigned)strtoul(sp + 1, NULL, 10);
    const char *addr = strchr(sp + 1, ' '), *colon = addr ? strrchr(addr, ':') : NULL;
    if (!addr || !colon || colon == addr + 1 || *slot >= KVT_CLUSTER_SLOTS) return -1;
    char host[256];
    snprintf(host, sizeof host, "%.*s", (int)(colon - addr - 1), addr + 1);
    int port = atoi(colon + 1);
    return port > 0 && port < 65536 ? node_of(c, host, port) : -1;
}

/* The commands [from, to): *partial when one of them has no reply (its
 * shard skipped, or its master's round trip failed). */
static int run_phase(kvt_cluster *c, const char *cmds, const size_t *offs, size_t from, size_t to, double deadline,
                     kvt_shards *sh, redisReply **rep, bool *partial)
{
    size_t np = to - from;
    pend *ps = kvt_calloc(np ? np : 1, sizeof *ps);
    if (!ps) return KVT_ENOMEM;
    for (size_t k = 0; k < np; k++) ps[k] = (pend){.i = from + k, .node = -1, .shard = -1};
    int rc = KVT_OK, prefer = -1;
    size_t left = np;
    for (int round = 0; left && !rc && round < ROUNDS; round++) {
        if ((!c->have_map || c->stale) && (rc = refresh(c, prefer, deadline)) && (!c->have_map || rc == KVT_ENOMEM))
            break;
        /* a shard for every master the map names */
        if ((rc = kvt_shards_grow(sh, c->n_masters ? c->n_masters : 1))) break;
        for (size_t i = 0; i < c->n_nodes; i++) { c->nodes[i]->q.len = 0; c->nodes[i]->n_who = 0; }
        for (size_t k = 0; k < np && !rc; k++) {
            pend *p = &ps[k];
            if (rep[p->i] || p->gone) continue;
            const char *cmd = cmds + offs[p->i];
            size_t len = offs[p->i + 1] - offs[p->i];
            char *scan = NULL;
            int slen = 0;
            if (is_cmd(cmd, len, "SCAN")) {
                if ((rc = scan_cmd(c, cmd, len, &p->node, &p->scan_m, &scan, &slen))) break;
                p->scan = true;
                cmd = scan;
                len = (size_t)slen;
            } else if (p->node < 0 || (!p->asking && !p->moved)) {
                int s = cmd_slot(cmd, len);
                p->node = c->slot[s < 0 ? 0 : s];
                if (p->node == NONE) {
                    rc = kvt_fail(KVT_EIO, "redis cluster: slot %d is served by no master (the cluster is down?)",
                                  s < 0 ? 0 : s);
                    p->node = -1;
                    break;
                }
            }
            /* a command's shard is its slot's master's when first routed: a
             * redirect's node answers for that shard */
            if (p->shard < 0) p->shard = c->nodes[p->node]->rank >= 0 ? c->nodes[p->node]->rank : 0;
            if (sh->skip[p->shard]) {
                free(scan);
                p->gone = true;
                left--;
                continue;
            }
            sh->asked[p->shard] = true;
            node *n = c->nodes[p->node];
            static const char asking[] = "*1\r\n$6\r\nASKING\r\n";
            if (p->asking) rc = push(n, asking, sizeof asking - 1, SIZE_MAX);
            if (!rc) rc = push(n, cmd, len, k);
            free(scan);
        }
        if (rc) break;
        /* this round's nodes (a redirect below may add nodes to the table) */
        kvt_conn **run = kvt_malloc(c->n_nodes * sizeof *run);
        if (!run) { rc = kvt_fail(KVT_ENOMEM, "redis cluster: a round"); break; }
        size_t nr = 0;
        for (size_t i = 0; i < c->n_nodes; i++) {
            node *n = c->nodes[i];
            if (!n->n_who) continue;
            n->c.q = (const char *)n->q.p;
            n->c.q_len = n->q.len;
            n->c.q_n = n->n_who;
            run[nr++] = &n->c;
        }
        kvt_conn_run(run, nr, deadline);
        bool tryagain = false, rerank = false;
        prefer = -1;
        for (size_t i = 0; i < nr; i++) {
            node *n = (node *)run[i]; /* c is node's first member */
            if (n->c.rc) { /* this master failed: its commands have no reply; the others' stand */
                if (!sh->why[0]) snprintf(sh->why, sizeof sh->why, "%s", n->c.err);
                for (size_t k = 0; k < n->n_who; k++) {
                    if (n->who[k] == SIZE_MAX) continue;
                    pend *p = &ps[n->who[k]];
                    sh->failed[p->shard] = true;
                    p->gone = true;
                    left--;
                }
                c->stale = true; /* a node gone: a replica may have taken its slots */
                continue;
            }
            for (size_t k = 0; k < n->n_who; k++) {
                redisReply *x = n->c.rep[k];
                if (n->who[k] == SIZE_MAX) { freeReplyObject(x); continue; }
                pend *p = &ps[n->who[k]];
                bool err = x->type == REDIS_REPLY_ERROR;
                unsigned slot;
                int to_node;
                if (err && !strncmp(x->str, "MOVED ", 6) && !(kvt_cluster_fault & KVT_CLUSTER_FAULT_NO_MOVED) &&
                    p->moved < 1 && (to_node = redirect_node(c, x->str, &slot)) >= 0) {
                    p->moved++;
                    p->asking = false;
                    p->node = to_node;
                    c->slot[slot] = (uint16_t)to_node;
                    c->stale = rerank = true;
                    prefer = to_node;
                } else if (err && !strncmp(x->str, "ASK ", 4) && !(kvt_cluster_fault & KVT_CLUSTER_FAULT_NO_ASK) &&
                           (to_node = redirect_node(c, x->str, &slot)) >= 0) {
                    p->asking = true;
                    p->node = to_node;
                } else if (err && !strncmp(x->str, "TRYAGAIN", 8)) {
                    tryagain = true;
                } else {
                    if (p->scan) scan_reply(c, x, p->scan_m);
                    rep[p->i] = x;
                    freeReplyObject(p->last);
                    p->last = NULL;
                    left--;
                    continue;
                }
                freeReplyObject(p->last);
                p->last = x;
            }
            free(n->c.rep);
            n->c.rep = NULL;
        }
        free(run);
        if (rerank) rank_masters(c);
        if (tryagain && left) { /* a migration moving a multi-key command's keys: a moment */
            struct timespec ts = {0, 2000000};
            nanosleep(&ts, NULL);
        }
    }
    /* redirects not followed (a second MOVED, rounds used up): the
     * redirect is the command's reply, an error the caller sees */
    for (size_t k = 0; k < np; k++) {
        pend *p = &ps[k];
        if (!rc && !rep[p->i] && !p->gone) rep[p->i] = p->last, p->last = NULL;
        freeReplyObject(p->last);
        redisReply *x = rep[p->i];
        if (!rc && !x) *partial = true;
        if (!rc && x && x->type == REDIS_REPLY_ERROR && p->shard >= 0) {
            if (!sh->refused[p->shard] && !sh->refusal[0]) snprintf(sh->refusal, sizeof sh->refusal, "%s", x->str);
            sh->refused[p->shard] = true;
        }
    }
    free(ps);
    return rc;
}

int kvt_cluster_exec(kvt_cluster *c, const char *cmds, const size_t *offs, size_t n, const size_t *barriers,
                     size_t nb, double deadline, kvt_shards *sh, redisReply **rep)
{
    size_t from = 0;
    int rc = KVT_OK;
    bool partial = false;
    for (size_t b = 0; b <= nb && !rc && !partial; b++) {
        size_t to = b < nb ? barriers[b] : n;
        if (to > n) to = n;
        if (to > from || (n == 0 && b == nb)) rc = run_phase(c, cmds, offs, from, to, deadline, sh, rep, &partial);
        if (to > from) from = to;
    }
    sh->n = c->have_map && c->n_masters ? c->n_masters : 1;
    int grc = kvt_shards_grow(sh, sh->n);
    if (grc) rc = KVT_ENOMEM;
    if (rc)
        for (size_t i = 0; i < n; i++) {
            if (rep[i]) freeReplyObject(rep[i]);
            rep[i] = NULL;
        }
    return rc;
}
