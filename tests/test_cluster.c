/* redis-cluster:// (src/store/cluster.c) against a real 3-master Redis
 * Cluster each test starts (3 redis-server --cluster-enabled yes in
 * temporary directories, joined by redis-cli --cluster create): a second
 * tier with nothing of its own hits what the first uploaded, bit for bit,
 * its keys spread over the masters; a slot migration in the middle (ASK,
 * then MOVED once it is done) is followed, and is a miss with following
 * faulted away (the negative controls); a killed master costs lookups
 * their deadline, opens the breaker, never hangs. Clusters larger than
 * can be started here (1,024 masters) and hostile slot maps run on a
 * fake cluster in the test process (cluster_fx.h). */
#include "test.h"
#include "fixture.h"
#include "ds4_tiny.h"
#include "redis_fx.h"
#include "cluster_fx.h"
#include "store/cluster.h"
#include "store/conn.h"
#include "store/remote.h"
#include "store/tls.h"
#include "arch/model.h"
#include "session/snapshot.h"

#include <inttypes.h>
#include <signal.h>

enum { NODES = 3, N = 300 };

typedef struct cluster {
    rfx n[NODES];
    char url[400];
    const char *ca;      /* a TLS cluster's CA (its nodes on TLS ports only); NULL plain */
} cluster;

static kvt_redis *node_client(const cluster *c, int i)
{
    char url[64];
    snprintf(url, sizeof url, "%s://127.0.0.1:%d", c->ca ? "rediss" : "redis", c->n[i].port);
    return rfx_client(url, c->ca);
}

/* A reply's text (status or string) of one command on node i; "" when none. */
static bool node_cmd(const cluster *c, int i, char *out, size_t cap, int argc, const char *const *argv)
{
    kvt_redis *k = node_client(c, i);
    redisReply *x = NULL;
    bool ok = k && rfx_cmd(k, &x, argc, argv);
    if (out) snprintf(out, cap, "%s", x && x->str ? x->str : "");
    if (!ok && x && x->str) printf("    node %d: %s: %s\n", i, argv[0], x->str);
    if (x) freeReplyObject(x);
    kvt_redis_free(k);
    return ok;
}

static void cluster_stop(cluster *c)
{
    for (int i = 0; i < NODES; i++) rfx_stop(&c->n[i]);
}

/* 3 masters with extra (NULL-terminated, or NULL) as each node's further
 * arguments; tls: the nodes' certificate, key and CA (the cluster bus
 * and the clients on TLS, no plain port), NULL a plain cluster. The URL
 * names the nodes by address (url_host "127.0.0.1") or by name. */
static bool cluster_start_with(cluster *c, const char *const *extra, const char *const tls[3], const char *url_host)
{
    memset(c, 0, sizeof *c);
    c->ca = tls ? tls[2] : NULL;
    int len = snprintf(c->url, sizeof c->url, "%s://", tls ? "rediss-cluster" : "redis-cluster");
    char create[1200];
    int cl = snprintf(create, sizeof create, "redis-cli");
    if (tls) cl += snprintf(create + cl, sizeof create - (size_t)cl, " --tls --cacert '%s'", tls[2]);
    cl += snprintf(create + cl, sizeof create - (size_t)cl, " --cluster create");
    for (int i = 0; i < NODES; i++) {
        int port = fx_free_port(), bus = fx_free_port();
        char bs[16], ps[16];
        snprintf(bs, sizeof bs, "%d", bus);
        snprintf(ps, sizeof ps, "%d", port);
        /* a master lost without a replica costs its own shard only: the
         * others go on serving their slots (docs/STORE.md "Remote tier") */
        const char *args[40] = {"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", bs,
                                "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no"};
        int a = 10;
        if (tls) {
            const char *t[] = {"--port", "0", "--tls-port", ps, "--tls-cluster", "yes", "--tls-replication", "yes",
                               "--tls-cert-file", tls[0], "--tls-key-file", tls[1], "--tls-ca-cert-file", tls[2],
                               "--tls-auth-clients", "no"};
            for (size_t k = 0; k < sizeof t / sizeof t[0]; k++) args[a++] = t[k];
        }
        for (int k = 0; extra && extra[k] && a < 39; k++) args[a++] = extra[k];
        args[a] = NULL;
        char url[64];
        snprintf(url, sizeof url, "%s://127.0.0.1:%d", tls ? "rediss" : "redis", port);
        kvt_redis_url u;
        if (kvt_redis_parse_url(url, &u)) { cluster_stop(c); return false; }
        u.ca = c->ca;
        if (!rfx_start(&c->n[i], port, args, tls != NULL, &u)) { cluster_stop(c); return false; }
        len += snprintf(c->url + len, sizeof c->url - (size_t)len, "%s%s:%d", i ? "," : "", url_host, port);
        cl += snprintf(create + cl, sizeof create - (size_t)cl, " 127.0.0.1:%d", port);
    }
    snprintf(create + cl, sizeof create - (size_t)cl, " --cluster-yes >'%s/create.log' 2>&1", c->n[0].dir);
    if (system(create)) {
        char log[128];
        snprintf(log, sizeof log, "%s/create.log", c->n[0].dir);
        fx_print_file("redis-cli --cluster create", log);
        cluster_stop(c);
        return false;
    }
    for (double end = fx_now() + 20; fx_now() < end; fx_sleep_ms(50)) {
        int ok = 0;
        for (int i = 0; i < NODES; i++) {
            char info[2048];
            const char *a[2] = {"CLUSTER", "INFO"};
            if (node_cmd(c, i, info, sizeof info, 2, a) && strstr(info, "cluster_state:ok")) ok++;
        }
        if (ok == NODES) return true;
    }
    printf("    the cluster did not reach cluster_state:ok\n");
    cluster_stop(c);
    return false;
}

static bool cluster_start(cluster *c) { return cluster_start_with(c, NULL, NULL, "127.0.0.1"); }

#define CLUSTER_NEEDS()                                                     \
    do {                                                                    \
        const char *why_ = rfx_absent();                                    \
        if (why_) SKIP("%s", why_);                                         \
        if (system("command -v redis-cli >/dev/null 2>&1"))                 \
            SKIP("redis-cli absent (Debian's redis-tools, with redis-server)"); \
    } while (0)

#define CLUSTER_TEST(name)                                                  \
    static void name##_body(cluster *c);                                    \
    TEST(name)                                                              \
    {                                                                       \
        CLUSTER_NEEDS();                                                    \
        cluster c_;                                                         \
        CHECKF(cluster_start(&c_), "the 3-master cluster did not start");   \
        name##_body(&c_);                                                   \
        cluster_stop(&c_);                                                  \
    }                                                                       \
    static void name##_body(cluster *c)

static kvt_remote *tier_on(const char *url, kvt_model *m, const char *secret_file, int lookup_ms, int load_ms)
{
    kvt_remote_opts o = {.url = url, .secret_file = secret_file, .lookup_ms = lookup_ms, .load_ms = load_ms,
                         .connect_ms = lookup_ms, .quiet = true};
    kvt_remote *t = NULL;
    if (kvt_remote_open(&t, m, &o)) printf("    kvt_remote_open: %s\n", kvt_errmsg());
    return t;
}

static kvt_session *cold_upload(kvt_remote *rt, kvt_model *m, const int32_t *t, size_t n)
{
    kvt_session *s = NULL;
    if (kvt_session_new(&s, m, NULL) || kvt_session_sync(s, t, n, NULL)) return NULL;
    kvt_remote_upload(rt, 0, s, n);
    if (!kvt_remote_drain(rt, 10)) printf("    the upload queue did not drain\n");
    return s;
}

/* Restore t[0..n) into a new session: *got the hit's length; *dt its time. */
static kvt_session *restore(kvt_remote *rt, kvt_model *m, const int32_t *t, size_t n, size_t *got, double *dt)
{
    kvt_session *s = NULL;
    *got = 0;
    if (kvt_session_new(&s, m, NULL)) return NULL;
    double t0 = fx_now();
    kvt_remote_restore(rt, 0, s, t, n, 0, got);
    if (dt) *dt = fx_now() - t0;
    return s;
}

static long long dbsize(const cluster *c, int i)
{
    char out[32];
    kvt_redis *k = node_client(c, i);
    redisReply *x = NULL;
    const char *a[1] = {"DBSIZE"};
    long long n = k && rfx_cmd(k, &x, 1, a) && x->type == REDIS_REPLY_INTEGER ? x->integer : -1;
    (void)out;
    if (x) freeReplyObject(x);
    kvt_redis_free(k);
    return n;
}

/* The node holding the first key matching pattern (not a part or a MAC):
 * its index, the key in key. -1 when none does. */
static int find_key(const cluster *c, const char *pattern, char *key, size_t cap)
{
    for (int i = 0; i < NODES; i++) {
        kvt_redis *k = node_client(c, i);
        redisReply *x = NULL;
        const char *a[2] = {"KEYS", pattern};
        bool ok = k && rfx_cmd(k, &x, 2, a) && x->type == REDIS_REPLY_ARRAY;
        int found = -1;
        for (size_t e = 0; ok && e < x->elements && found < 0; e++)
            if (x->element[e]->str[0] != '{') {
                snprintf(key, cap, "%s", x->element[e]->str);
                found = i;
            }
        if (x) freeReplyObject(x);
        kvt_redis_free(k);
        if (found >= 0) return found;
    }
    return -1;
}

/* Server B with nothing of its own hits what A uploaded, bit for bit,
 * with a secret (each value's MAC beside it) and values in parts (the
 * hash tag keeps each value's MSET on one slot); the keys are spread over
 * the masters; cache ls over the cluster (SCAN on every master) lists the
 * entry. A plain redis:// tier on one of the masters misses (the keys on
 * the others answer MOVED): the routing is what makes the hit. */
CLUSTER_TEST(cluster_hit_bit_exact)
{
    kvt_model *m = tiny();
    char secret[128];
    snprintf(secret, sizeof secret, "%s/secret", c->n[0].dir);
    CHECK(fx_write_file(secret, "a fleet's shared secret\n", 24));
    size_t part = kvt_remote_part_bytes;
    kvt_remote_part_bytes = 4096; /* values in parts */
    int32_t t[N + 40];
    seqb(t, N + 40, 31);
    kvt_remote *a = tier_on(c->url, m, secret, 1000, 2000), *b = tier_on(c->url, m, secret, 1000, 2000);
    CHECK(a && b);
    kvt_session *cold = cold_upload(a, m, t, N);
    CHECK(cold);
    kvt_remote_stats st;
    kvt_remote_stats_get(a, &st);
    CHECKF(st.uploads == 1 && st.errors == 0 && st.dropped == 0, "uploads %llu errors %llu dropped %llu (%s)",
           (unsigned long long)st.uploads, (unsigned long long)st.errors, (unsigned long long)st.dropped,
           st.last_error);
    size_t got;
    double dt;
    kvt_session *s = restore(b, m, t, N + 40, &got, &dt);
    kvt_remote_stats_get(b, &st);
    CHECKF(got == N, "a hit of %zu tokens over the cluster, want %d (%s)", got, N, st.last_error);
    CHECK(s && kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    CHECK_OK(kvt_session_sync(s, t, N + 40, NULL));
    CHECK_OK(kvt_session_sync(cold, t, N + 40, NULL));
    CHECK(kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    kvt_session_free(s);
    int holding = 0;
    long long keys[NODES];
    for (int i = 0; i < NODES; i++) holding += (keys[i] = dbsize(c, i)) > 0;
    printf("    keys on the masters: %lld %lld %lld; the hit in %.1f ms (%.0f KB)\n", keys[0], keys[1], keys[2],
           dt * 1000, st.bytes_read / 1024.0);
    CHECK(holding >= 2);
    kvt_remote_opts lo = {.url = c->url};
    kvt_remote_entry *e = NULL;
    size_t ne = 0;
    CHECK_OK(kvt_remote_list(&lo, &e, &ne));
    CHECKF(ne == 1 && e[0].n_tokens == N, "cache ls over the cluster: %zu entries", ne);
    free(e);
    /* the control: one master as a plain Redis */
    char plain[64];
    snprintf(plain, sizeof plain, "redis://127.0.0.1:%d", c->n[0].port);
    kvt_remote *p = tier_on(plain, m, secret, 1000, 2000);
    s = p ? restore(p, m, t, N, &got, NULL) : NULL;
    kvt_remote_stats_get(p, &st);
    printf("    one master as plain redis://: %s\n", st.last_error);
    CHECKF(got == 0 && strstr(st.last_error, "MOVED"), "one master as plain Redis: a hit of %zu", got);
    kvt_session_free(s);
    kvt_remote_part_bytes = part;
    kvt_session_free(cold);
    kvt_remote_close(a);
    kvt_remote_close(b);
    kvt_remote_close(p);
    kvt_model_close(m);
}

/* One command on node i, false (said) on an error. */
static bool on(const cluster *c, int i, int argc, const char *const *argv)
{
    return node_cmd(c, i, NULL, 0, argc, argv);
}

/* The slot of the snapshot record moves from its master to another in the
 * middle of the lookups: with the record MIGRATEd and the slot still
 * MIGRATING, a tier follows ASK (ASKING on the new master) and hits; once
 * the slot is the new master's (SETSLOT NODE), a tier whose map still
 * names the old one follows MOVED (the map read again) and hits. With
 * ASK, then MOVED, not followed (kvt_cluster_fault), the same lookups are
 * misses: the negative controls. */
CLUSTER_TEST(cluster_migration_followed)
{
    kvt_model *m = tiny();
    int32_t t[N];
    seqb(t, N, 32);
    kvt_remote *a = tier_on(c->url, m, NULL, 1000, 2000), *b = tier_on(c->url, m, NULL, 1000, 2000),
               *x = tier_on(c->url, m, NULL, 1000, 2000);
    CHECK(a && b && x);
    kvt_session *cold = cold_upload(a, m, t, N);
    CHECK(cold);
    size_t got;
    kvt_session *s;
    /* b and x read the map and hit before the migration */
    s = restore(b, m, t, N, &got, NULL);
    CHECK(got == N);
    kvt_session_free(s);
    s = restore(x, m, t, N, &got, NULL);
    CHECK(got == N);
    kvt_session_free(s);
    char snap[200];
    int src = find_key(c, "*:s:*", snap, sizeof snap), dst = (src + 1) % NODES;
    CHECK(src >= 0);
    unsigned slot = kvt_cluster_slot(snap, strlen(snap));
    char src_id[64], dst_id[64], slot_s[16], dst_port[16];
    snprintf(slot_s, sizeof slot_s, "%u", slot);
    snprintf(dst_port, sizeof dst_port, "%d", c->n[dst].port);
    const char *myid[2] = {"CLUSTER", "MYID"};
    CHECK(node_cmd(c, src, src_id, sizeof src_id, 2, myid) && node_cmd(c, dst, dst_id, sizeof dst_id, 2, myid));
    printf("    slot %u (the snapshot record's) moves from master %d to master %d\n", slot, src, dst);
    const char *imp[5] = {"CLUSTER", "SETSLOT", slot_s, "IMPORTING", src_id};
    const char *mig[5] = {"CLUSTER", "SETSLOT", slot_s, "MIGRATING", dst_id};
    const char *mv[9] = {"MIGRATE", "127.0.0.1", dst_port, "", "0", "5000", "KEYS", snap, NULL};
    CHECK(on(c, dst, 5, imp) && on(c, src, 5, mig) && on(c, src, 8, mv));
    /* in the middle: the record is on dst, the slot still src's: ASK */
    kvt_cluster_fault = KVT_CLUSTER_FAULT_NO_ASK;
    s = restore(x, m, t, N, &got, NULL);
    kvt_cluster_fault = 0;
    kvt_remote_stats st;
    kvt_remote_stats_get(x, &st);
    printf("    mid-migration, ASK not followed: a hit of %zu (%s)\n", got, st.last_error);
    CHECKF(got == 0 && strstr(st.last_error, "ASK"), "the control: ASK not followed, yet a hit of %zu", got);
    kvt_session_free(s);
    s = restore(b, m, t, N, &got, NULL);
    kvt_remote_stats_get(b, &st);
    CHECKF(got == N, "mid-migration: a hit of %zu, want %d (%s)", got, N, st.last_error);
    CHECK(s && kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    kvt_session_free(s);
    /* done: the rest of the slot's keys moved, the slot dst's everywhere */
    const char *gk[4] = {"CLUSTER", "GETKEYSINSLOT", slot_s, "1000"};
    kvt_redis *k = node_client(c, src);
    redisReply *rest = NULL;
    CHECK(k && rfx_cmd(k, &rest, 4, gk) && rest->type == REDIS_REPLY_ARRAY);
    for (size_t i = 0; rest && i < rest->elements; i++) {
        const char *mv2[8] = {"MIGRATE", "127.0.0.1", dst_port, "", "0", "5000", "KEYS", rest->element[i]->str};
        CHECK(on(c, src, 8, mv2));
    }
    if (rest) freeReplyObject(rest);
    kvt_redis_free(k);
    const char *own[5] = {"CLUSTER", "SETSLOT", slot_s, "NODE", dst_id};
    for (int i = 0; i < NODES; i++) CHECK(on(c, (dst + i) % NODES, 5, own));
    kvt_cluster_fault = KVT_CLUSTER_FAULT_NO_MOVED;
    s = restore(x, m, t, N, &got, NULL);
    kvt_cluster_fault = 0;
    kvt_remote_stats_get(x, &st);
    printf("    migrated, MOVED not followed: a hit of %zu (%s)\n", got, st.last_error);
    CHECKF(got == 0 && strstr(st.last_error, "MOVED"), "the control: MOVED not followed, yet a hit of %zu", got);
    kvt_session_free(s);
    s = restore(b, m, t, N, &got, NULL);
    kvt_remote_stats_get(b, &st);
    CHECKF(got == N, "migrated: a hit of %zu, want %d (%s)", got, N, st.last_error);
    CHECK(s && kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    kvt_session_free(s);
    kvt_session_free(cold);
    kvt_remote_close(a);
    kvt_remote_close(b);
    kvt_remote_close(x);
    kvt_model_close(m);
}

/* A master stopped (SIGSTOP) under the tier: a lookup ends by its
 * deadline, a miss. Then killed (SIGKILL): every lookup answers by its
 * deadline (a miss), the breaker opens after three failures and then
 * answers at once; uploads are dropped, nothing hangs. */
CLUSTER_TEST(cluster_master_killed)
{
    kvt_model *m = tiny();
    int32_t t[N];
    seqb(t, N, 33);
    kvt_remote *a = tier_on(c->url, m, NULL, 200, 500), *b = tier_on(c->url, m, NULL, 200, 500);
    CHECK(a && b);
    kvt_session *cold = cold_upload(a, m, t, N);
    CHECK(cold);
    size_t got;
    kvt_session *s = restore(b, m, t, N, &got, NULL);
    CHECK(got == N);
    kvt_session_free(s);
    char snap[200];
    int victim = find_key(c, "*:s:*", snap, sizeof snap);
    CHECK(victim >= 0);
    /* stopped first (SIGSTOP): the master accepts connections in the kernel
     * but answers nothing; a lookup ends by its deadline */
    kill(c->n[victim].pid, SIGSTOP);
    kvt_remote *d = tier_on(c->url, m, NULL, 200, 500);
    double dt_stopped = 0;
    s = d ? restore(d, m, t, N, &got, &dt_stopped) : NULL;
    kvt_remote_stats sd;
    kvt_remote_stats_get(d, &sd);
    printf("    master %d stopped: a lookup with a 200 ms deadline %.0f ms, a miss (%s)\n", victim, dt_stopped * 1000,
           sd.last_error);
    /* 200 ms to read the map and look up; 2 s is the margin of a loaded CI machine */
    CHECKF(got == 0 && dt_stopped >= 0.15 && dt_stopped < 2.0 && strstr(sd.last_error, "timed out"),
           "stopped master: a hit of %zu in %.0f ms (%s)", got, dt_stopped * 1000, sd.last_error);
    kvt_session_free(s);
    kvt_remote_close(d);
    rfx_kill(&c->n[victim]); /* SIGCONT, SIGKILL */
    double worst = 0;
    for (int i = 0; i < 6; i++) {
        double dt;
        s = restore(b, m, t, N, &got, &dt);
        if (dt > worst) worst = dt;
        CHECKF(got == 0, "lookup %d with a master killed: a hit of %zu", i, got);
        kvt_session_free(s);
    }
    double t0 = fx_now();
    kvt_remote_upload(a, 0, cold, N);
    kvt_remote_drain(a, 10);
    double up = fx_now() - t0;
    kvt_remote_stats st;
    kvt_remote_stats_get(b, &st);
    printf("    master %d killed: 6 lookups, the slowest %.0f ms (deadlines 200 + 500 ms); breaker %d after %llu "
           "errors (%s); an upload %.0f ms\n", victim, worst * 1000, st.breaker, (unsigned long long)st.errors,
           st.last_error, up * 1000);
    /* 700 ms of deadlines; 2 s is the margin of a loaded CI machine */
    CHECK(worst < 2.0 && up < 3.0);
    CHECK(st.breaker == 1 && st.breaker_trips == 1 && st.misses == 6);
    kvt_session_free(cold);
    kvt_remote_close(a);
    kvt_remote_close(b);
    kvt_model_close(m);
}

/* owner[slot]: the node (index in c->n) serving each slot, from CLUSTER
 * SLOTS; *first the first slot of each node. */
static bool slot_owners(const cluster *c, int *owner, int *first)
{
    kvt_redis *k = node_client(c, 0);
    redisReply *x = NULL;
    const char *a[2] = {"CLUSTER", "SLOTS"};
    bool ok = k && rfx_cmd(k, &x, 2, a) && x->type == REDIS_REPLY_ARRAY;
    for (int i = 0; i < NODES; i++) first[i] = KVT_CLUSTER_SLOTS;
    for (size_t s = 0; s < KVT_CLUSTER_SLOTS; s++) owner[s] = -1;
    for (size_t e = 0; ok && e < x->elements; e++) {
        redisReply *r = x->element[e], *m = r->element[2];
        int node = -1;
        for (int i = 0; i < NODES; i++)
            if (c->n[i].port == m->element[1]->integer) node = i;
        for (long long s = r->element[0]->integer; node >= 0 && s <= r->element[1]->integer; s++) owner[s] = node;
        if (node >= 0 && r->element[0]->integer < first[node]) first[node] = (int)r->element[0]->integer;
    }
    if (x) freeReplyObject(x);
    kvt_redis_free(k);
    return ok;
}

static int owner_of(const int *owner, const char *key) { return owner[kvt_cluster_slot(key, strlen(key))]; }

enum { LONG = 5 * 128 };

/* For prompt t[0..LONG) saved at every block boundary, and master v lost:
 * the longest entry none of whose keys (index, snapshot, blocks) is on v
 * (0: none), and whether v holds an index key a lookup of t asks. */
static size_t reachable(const int *owner, const char *ns, uint64_t key0, const int32_t *t, int v, bool *asks_v)
{
    uint64_t keys[LONG / 128];
    char name[200];
    size_t best = 0;
    *asks_v = false;
    for (size_t b = 0; b < LONG / 128; b++) keys[b] = kvt_snap_key_next(b ? keys[b - 1] : key0, t + b * 128);
    for (size_t nb = 0; nb <= LONG / 128; nb++) {
        uint64_t head = nb ? keys[nb - 1] : key0;
        snprintf(name, sizeof name, "%si:%016" PRIx64, ns, head);
        bool on_v = owner_of(owner, name) == v;
        *asks_v |= on_v;
        if (!nb) continue;
        snprintf(name, sizeof name, "%ss:%016" PRIx64 ":%zu:%016" PRIx64, ns, head, nb * 128,
                 kvt_snap_tail_hash(head, t + nb * 128, 0));
        on_v |= owner_of(owner, name) == v;
        for (size_t b = 0; b < nb && !on_v; b++) {
            snprintf(name, sizeof name, "%sb:%016" PRIx64, ns, keys[b]);
            on_v = owner_of(owner, name) == v;
        }
        if (!on_v) best = nb * 128;
    }
    return best;
}

/* A breaker per master: a prompt saved at each of its five block
 * boundaries, one master killed (the cluster goes on serving the other
 * slots: cluster-require-full-coverage no). The seed and the master are
 * chosen so that the lost master holds an index key every lookup asks
 * and a value of the longest entry, and some shorter entry lies wholly on
 * the others: each of six lookups is then that shorter hit, bit for bit
 * with a cold run of it, while the lost master's breaker alone opens.
 * The negative control: one breaker for the whole tier
 * (kvt_remote_fault_one_breaker, a failure of one master failing the
 * round trip) misses every lookup. */
CLUSTER_TEST(cluster_shard_breaker)
{
    kvt_model *m = tiny();
    int owner[KVT_CLUSTER_SLOTS], first[NODES];
    CHECK(slot_owners(c, owner, first));
    char ns[96];
    snprintf(ns, sizeof ns, "kvt:r2:%016" PRIx64 ":open:", kvt_snap_key0(m));
    int32_t t[LONG];
    size_t want = 0;
    int v = -1;
    uint64_t seed;
    for (seed = 40; seed < 200 && v < 0; seed++) {
        seqb(t, LONG, seed);
        for (int i = 0; i < NODES && v < 0; i++) {
            bool asks;
            size_t r = reachable(owner, ns, kvt_snap_key0(m), t, i, &asks);
            if (asks && r > 0 && r < LONG) { v = i; want = r; }
        }
    }
    CHECKF(v >= 0, "no seed gives a lost master a shorter hit");
    int shard = 0; /* the lost master's shard: its place in the order of first slots */
    for (int i = 0; i < NODES; i++) shard += first[i] < first[v];
    printf("    seed %" PRIu64 ": master %d (shard %d) lost, the longest entry the others hold %zu of %d tokens\n",
           seed - 1, v, shard, want, LONG);
    kvt_remote *a = tier_on(c->url, m, NULL, 1000, 2000);
    CHECK(a);
    kvt_session *cold = NULL;
    CHECK_OK(kvt_session_new(&cold, m, NULL));
    for (size_t at = 128; at <= LONG; at += 128) {
        CHECK_OK(kvt_session_sync(cold, t, at, NULL));
        kvt_remote_upload(a, 0, cold, at);
        CHECK(kvt_remote_drain(a, 10));
    }
    kvt_remote_stats st;
    kvt_remote_stats_get(a, &st);
    CHECKF(st.uploads == LONG / 128 && st.dropped == 0, "uploads %llu dropped %llu (%s)",
           (unsigned long long)st.uploads, (unsigned long long)st.dropped, st.last_error);
    kvt_session *ref = NULL; /* a cold run of the hit's tokens */
    CHECK_OK(kvt_session_new(&ref, m, NULL));
    CHECK_OK(kvt_session_sync(ref, t, want, NULL));
    kvt_remote *b = tier_on(c->url, m, NULL, 300, 2000);
    size_t got;
    kvt_session *s = restore(b, m, t, LONG, &got, NULL);
    CHECKF(got == LONG, "before the loss: a hit of %zu", got);
    kvt_session_free(s);
    rfx_kill(&c->n[v]);
    double worst = 0;
    for (int i = 0; i < 6; i++) {
        double dt;
        s = restore(b, m, t, LONG, &got, &dt);
        if (dt > worst) worst = dt;
        kvt_remote_stats_get(b, &st);
        CHECKF(got == want, "lookup %d with master %d lost: a hit of %zu, want %zu (%s)", i, v, got, want,
               st.last_error);
        CHECK(s && (got != want || kvt_test_digest(s, m) == kvt_test_digest(ref, m)));
        kvt_session_free(s);
    }
    kvt_remote_stats_get(b, &st);
    int br[NODES] = {0}, open = 0;
    size_t nbr = kvt_remote_shard_breakers(b, br, NODES);
    for (size_t i = 0; i < nbr && i < NODES; i++) open += br[i] != 0;
    printf("    6 lookups: hits of %zu tokens, the slowest %.0f ms; breakers %d %d %d (%s)\n", want, worst * 1000,
           br[0], br[1], br[2], st.last_error);
    CHECKF(st.n_shards == NODES && nbr == NODES && open == 1 && st.shards_open == 1 && br[shard] == 1 &&
               st.breaker_trips == 1,
           "%zu shards, %d breakers open, shard %d's %d, trips %llu", st.n_shards, open, shard, br[shard],
           (unsigned long long)st.breaker_trips);
    CHECK(worst < 2.0); /* 300 ms lookups; 2 s is the margin of a loaded CI machine */
    /* the control: one breaker for the tier, a master's failure the round trip's */
    kvt_remote_fault_one_breaker = true;
    kvt_remote *one = tier_on(c->url, m, NULL, 300, 2000);
    size_t hits = 0;
    for (int i = 0; one && i < 6; i++) {
        s = restore(one, m, t, LONG, &got, NULL);
        hits += got > 0;
        kvt_session_free(s);
    }
    kvt_remote_stats_get(one, &st);
    kvt_remote_fault_one_breaker = false;
    printf("    the control, one breaker: %zu hits of 6, breaker %d (%s)\n", hits, st.breaker, st.last_error);
    CHECKF(one && hits == 0 && st.breaker == 1, "one breaker: %zu hits", hits);
    kvt_session_free(ref);
    kvt_session_free(cold);
    kvt_remote_close(a);
    kvt_remote_close(b);
    kvt_remote_close(one);
    kvt_model_close(m);
}

/* Host names under the deadline. The nodes announce the name localhost
 * (cluster-announce-hostname, cluster-preferred-endpoint-type hostname),
 * so CLUSTER SLOTS names them by it, as the URL does: a second tier hits
 * what the first uploaded, bit for bit. A tier whose URL names the nodes
 * by address meets the names in the map only, at its first lookup: with a
 * resolver that does not answer for a second (KVT_RESOLV_FAULT_HANG), the
 * lookup with a 200 ms deadline ends by it, a miss saying so, and the
 * resolution goes on: a lookup after it answered hits. The negative
 * control: resolved on the caller's thread (KVT_RESOLV_FAULT_BLOCKING, as
 * before), the same first lookup takes the resolver's second. */
static void names_body(cluster *c)
{
    kvt_model *m = tiny();
    int32_t t[N];
    seqb(t, N, 34);
    const char *slots[2] = {"CLUSTER", "SLOTS"};
    kvt_redis *k = node_client(c, 0);
    redisReply *x = NULL;
    CHECK(k && rfx_cmd(k, &x, 2, slots) && x->type == REDIS_REPLY_ARRAY && x->elements > 0);
    const char *host = x->element[0]->element[2]->element[0]->str;
    printf("    CLUSTER SLOTS names the nodes '%s'; the URL %s\n", host, c->url);
    bool named = !strcmp(host, "localhost");
    freeReplyObject(x);
    kvt_redis_free(k);
    CHECK(named);
    kvt_remote *a = tier_on(c->url, m, NULL, 1000, 2000), *b = tier_on(c->url, m, NULL, 1000, 2000);
    CHECK(a && b);
    kvt_session *cold = cold_upload(a, m, t, N);
    CHECK(cold);
    size_t got;
    kvt_session *s = restore(b, m, t, N, &got, NULL);
    kvt_remote_stats st;
    kvt_remote_stats_get(b, &st);
    CHECKF(got == N && kvt_test_digest(s, m) == kvt_test_digest(cold, m), "by name: a hit of %zu (%s)", got,
           st.last_error);
    kvt_session_free(s);
    char by_addr[200];
    int len = snprintf(by_addr, sizeof by_addr, "redis-cluster://");
    for (int i = 0; i < NODES; i++)
        len += snprintf(by_addr + len, sizeof by_addr - (size_t)len, "%s127.0.0.1:%d", i ? "," : "", c->n[i].port);
    /* a resolver that does not answer: the lookup ends by its deadline */
    kvt_conn_fault = KVT_RESOLV_FAULT_HANG;
    double t0 = fx_now(), dt_open, dt = 0;
    kvt_remote *h = tier_on(by_addr, m, NULL, 200, 500);
    dt_open = fx_now() - t0;
    s = h ? restore(h, m, t, N, &got, &dt) : NULL;
    kvt_remote_stats_get(h, &st);
    printf("    the resolver hangs 1 s: open %.0f ms, a lookup with a 200 ms deadline %.0f ms, a hit of %zu (%s)\n",
           dt_open * 1000, dt * 1000, got, st.last_error);
    /* 200 ms; 0.8 s is the margin of a loaded CI machine, under the 1 s hang */
    CHECKF(h && got == 0 && dt < 0.8 && strstr(st.last_error, "resolving the name: timed out"),
           "a hanging resolver: %.0f ms, a hit of %zu (%s)", dt * 1000, got, st.last_error);
    kvt_session_free(s);
    fx_sleep_ms(1300); /* the resolver answers; its addresses wait for the next round trip */
    kvt_conn_fault = 0;
    for (int i = 0; i < 6 && got != N; i++) { /* the breaker of a shard that failed may wait its second */
        s = restore(h, m, t, N, &got, NULL);
        kvt_session_free(s);
        if (got != N) fx_sleep_ms(300);
    }
    kvt_remote_stats_get(h, &st);
    CHECKF(got == N, "after the resolver answered: a hit of %zu (%s)", got, st.last_error);
    kvt_remote_close(h);
    /* the control: resolved on the caller's thread, the lookup waits the resolver out */
    kvt_conn_fault = KVT_RESOLV_FAULT_HANG | KVT_RESOLV_FAULT_BLOCKING;
    h = tier_on(by_addr, m, NULL, 200, 500);
    s = h ? restore(h, m, t, N, &got, &dt) : NULL;
    kvt_conn_fault = 0;
    printf("    the control, resolved on the caller's thread: a lookup %.0f ms\n", dt * 1000);
    CHECKF(dt >= 0.9, "the control: the blocking resolution took %.0f ms", dt * 1000);
    kvt_session_free(s);
    kvt_remote_close(h);
    kvt_session_free(cold);
    kvt_remote_close(a);
    kvt_remote_close(b);
    kvt_model_close(m);
}

TEST(cluster_host_names_by_deadline)
{
    CLUSTER_NEEDS();
    cluster c;
    const char *names[] = {"--cluster-announce-hostname", "localhost", "--cluster-preferred-endpoint-type", "hostname",
                           NULL};
    CHECKF(cluster_start_with(&c, names, NULL, "localhost"), "the 3-master cluster did not start");
    names_body(&c);
    kvt_conn_fault = 0;
    cluster_stop(&c);
}

/* rediss-cluster://: 3 masters on TLS ports only, the cluster bus on TLS
 * too (tls-cluster yes), each node serving the test CA's certificate for
 * 127.0.0.1: a second tier hits what the first uploaded, bit for bit, its
 * keys spread over the masters (each connection verified). A tier given
 * another CA misses, saying why; with the chain check faulted away
 * (KVT_TLS_FAULT_NO_CHAIN) it hits: the negative control. */
static void tls_body(cluster *c, const certs *ct)
{
    kvt_model *m = tiny();
    int32_t t[N];
    seqb(t, N, 35);
    kvt_remote_opts o = {.url = c->url, .tls_ca = ct->ca, .lookup_ms = 1000, .load_ms = 2000, .connect_ms = 1000,
                         .quiet = true};
    kvt_remote *a = NULL, *b = NULL, *bad = NULL;
    CHECK_OK(kvt_remote_open(&a, m, &o));
    CHECK_OK(kvt_remote_open(&b, m, &o));
    kvt_session *cold = cold_upload(a, m, t, N);
    CHECK(cold);
    size_t got;
    double dt;
    kvt_session *s = restore(b, m, t, N, &got, &dt);
    kvt_remote_stats st;
    kvt_remote_stats_get(b, &st);
    int holding = 0;
    for (int i = 0; i < NODES; i++) holding += dbsize(c, i) > 0;
    printf("    %s: a hit of %zu in %.1f ms, keys on %d masters, %zu shards (%s)\n", c->url, got, dt * 1000, holding,
           st.n_shards, st.last_error);
    CHECKF(got == N && st.n_shards == NODES && holding >= 2, "a hit of %zu over the TLS cluster", got);
    CHECK(s && kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    kvt_session_free(s);
    o.tls_ca = ct->ca2;
    CHECK_OK(kvt_remote_open(&bad, m, &o));
    s = restore(bad, m, t, N, &got, NULL);
    kvt_remote_stats_get(bad, &st);
    printf("    another CA: a hit of %zu (%s)\n", got, st.last_error);
    CHECKF(got == 0 && strstr(st.last_error, "certificate"), "another CA: a hit of %zu (%s)", got, st.last_error);
    kvt_session_free(s);
    kvt_remote_close(bad);
    bad = NULL;
    kvt_tls_fault = KVT_TLS_FAULT_NO_CHAIN;
    int rc = kvt_remote_open(&bad, m, &o);
    s = rc ? NULL : restore(bad, m, t, N, &got, NULL);
    kvt_tls_fault = 0;
    CHECKF(!rc && got == N, "the control: without the chain check another CA's tier hits (got %zu)", got);
    kvt_session_free(s);
    kvt_session_free(cold);
    kvt_remote_close(a);
    kvt_remote_close(b);
    kvt_remote_close(bad);
    kvt_model_close(m);
}

TEST(cluster_tls_hit_bit_exact)
{
    CLUSTER_NEEDS();
    const char *why = no_tls_tools();
    if (!why) why = redis_without_tls();
    if (why) SKIP("%s", why);
    certs ct;
    CHECKF(make_certs(&ct), "the test certificates were not made");
    cluster c;
    const char *tls[3] = {ct.srv, ct.srv_key, ct.ca};
    bool up = cluster_start_with(&c, NULL, tls, "127.0.0.1");
    if (up) tls_body(&c, &ct);
    else kvt_test_fail(__FILE__, __LINE__, "the 3-master TLS cluster did not start");
    kvt_tls_fault = 0;
    if (up) cluster_stop(&c);
    certs_remove(&ct);
}

/* Through kvtier serve: server A answers a prompt cold on the cluster;
 * server B, with an empty disk, answers it from the remote tier with A's
 * reply and top-5 logprobs. */
CLUSTER_TEST(cluster_serve_two_servers)
{
    if (system("command -v curl >/dev/null 2>&1")) SKIP("curl is not on PATH");
    const char *remote[] = {"--kv-remote", c->url, NULL};
    char *cold = NULL, *warm = NULL, ca[96], cb[96];
    CHECK(rfx_serve_once("kvtier-cluster-a", remote, &cold, ca, sizeof ca, NULL));
    CHECK(rfx_serve_once("kvtier-cluster-b", remote, &warm, cb, sizeof cb, NULL));
    printf("    A: %s; B: %s\n", ca, cb);
    CHECKF(strstr(cb, "remote"), "server B did not hit the remote tier on the cluster: %s", cb);
    CHECKF(!strcmp(cold, warm), "server B's reply differs from A's cold run:\n%.300s\n%.300s", cold, warm);
    free(cold); free(warm);
}

/* ---- clusters larger than the old 64-node table (a fake, cluster_fx.h) ---- */

enum { BIG = 1024 };

/* The first 64 masters one slot each, the other 960 the rest: every
 * shard past the old table's 64 holds slots, and the most keys. */
static void big_first(unsigned *first)
{
    for (unsigned i = 0; i < 64; i++) first[i] = i;
    for (unsigned i = 64; i < BIG; i++) first[i] = 64 + (i - 64) * (KVT_CLUSTER_SLOTS - 64) / (BIG - 64);
    first[BIG] = KVT_CLUSTER_SLOTS;
}

#define BIG_START(f)                                                         \
    do {                                                                     \
        unsigned first_[BIG + 1];                                            \
        big_first(first_);                                                   \
        if (!cfx_start(f, BIG, first_)) {                                    \
            cfx_stop(f);                                                     \
            SKIP_ENV("%d listening sockets on 127.0.X.Y cannot be had", BIG); \
        }                                                                    \
    } while (0)

/* n SETs (value "v<i>" for key "key:<i>:<seed>"), then n GETs, each in one
 * pipeline over the cluster: true when every reply is right (*why says
 * which is not). */
static bool big_round(kvt_redis *k, size_t n, char *why, size_t cap)
{
    char key[48], val[32];
    redisReply **rep = NULL;
    size_t nr = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < n; i++) {
            snprintf(key, sizeof key, "key:%zu:{%zu}", i, i * 7919);
            snprintf(val, sizeof val, "v%zu", i);
            const char *set[3] = {"SET", key, val}, *get[2] = {"GET", key};
            kvt_redis_append(k, pass ? 2 : 3, pass ? get : set, NULL);
        }
        if (kvt_redis_exec(k, 20000, &rep, &nr) || nr != n) {
            snprintf(why, cap, "%s: %s", pass ? "GET" : "SET", kvt_errmsg());
            return false;
        }
        for (size_t i = 0; i < n; i++) {
            snprintf(val, sizeof val, "v%zu", i);
            redisReply *x = rep[i];
            bool ok = pass ? x->type == REDIS_REPLY_STRING && !strcmp(x->str, val)
                           : x->type == REDIS_REPLY_STATUS && !strcmp(x->str, "OK");
            if (!ok) {
                snprintf(why, cap, "%s %zu: reply %d '%s'", pass ? "GET" : "SET", i, x->type, x->str ? x->str : "");
                kvt_redis_replies_free(rep, nr);
                return false;
            }
        }
        kvt_redis_replies_free(rep, nr);
    }
    return true;
}

/* 1,024 masters (and a replica each in the map: 2,048 nodes named), more
 * than the 64 the node table held: 6,000 keys SET and read back in one
 * pipeline each, every command on its slot's master at once (no MOVED
 * met, 950 masters and more asked), each key's shard the rank of its
 * master; the client knows the 1,024 shards. The negative control: the
 * table back at 64 nodes (KVT_CLUSTER_FAULT_64_NODES) reads no map and
 * fails the round trip, saying so. */
TEST(cluster_large_routes)
{
    cfx f;
    BIG_START(&f);
    char url[96], why[300] = "";
    cfx_url(&f, url, sizeof url);
    kvt_redis *k = rfx_client(url, NULL);
    CHECK(k);
    enum { KEYS = 6000 };
    double t0 = fx_now();
    bool ok = big_round(k, KEYS, why, sizeof why);
    double dt = fx_now() - t0;
    size_t asked = 0, wrong = 0;
    unsigned long sets = 0;
    for (size_t i = 0; i < BIG; i++) { asked += f.sets[i] > 0; sets += f.sets[i]; }
    char key[48];
    for (size_t i = 0; i < KEYS; i++) {
        snprintf(key, sizeof key, "key:%zu:{%zu}", i, i * 7919);
        wrong += kvt_redis_shard_of(k, key, strlen(key)) != cfx_owner(&f, kvt_cluster_slot(key, strlen(key)));
    }
    printf("    %d masters: %d keys set and read in %.0f ms (under load), %zu masters asked, %lu MOVED, %zu shards, "
           "%zu keys on the wrong shard\n", BIG, KEYS, dt * 1000, asked, (unsigned long)atomic_load(&f.moved),
           kvt_redis_n_shards(k), wrong);
    CHECKF(ok, "%s", why);
    CHECK(sets == KEYS && asked >= 950 && atomic_load(&f.moved) == 0 && wrong == 0);
    CHECK(kvt_redis_n_shards(k) == BIG);
    kvt_redis_free(k);
    /* the control: the table of 64 nodes */
    kvt_cluster_fault = KVT_CLUSTER_FAULT_64_NODES;
    k = rfx_client(url, NULL);
    why[0] = 0;
    ok = k && big_round(k, 10, why, sizeof why);
    kvt_cluster_fault = 0;
    printf("    the control, 64 nodes: %s\n", why);
    CHECKF(k && !ok && strstr(why, "more than the client takes (64)"), "the control: 64 nodes routed (%s)", why);
    kvt_redis_free(k);
    cfx_stop(&f);
}

/* A breaker a shard, past the 64th: a remote tier over the 1,024
 * masters, the master holding the index key every lookup of a prompt asks
 * first killed: four lookups miss, its breaker alone opens (the shard of
 * its place in the order of first slots), the 1,023 others closed. */
TEST(cluster_large_shard_breaker)
{
    cfx f;
    BIG_START(&f);
    char url[96];
    cfx_url(&f, url, sizeof url);
    kvt_model *m = tiny();
    char idx[160];
    snprintf(idx, sizeof idx, "kvt:r2:%016" PRIx64 ":open:i:%016" PRIx64, kvt_snap_key0(m), kvt_snap_key0(m));
    int victim = cfx_owner(&f, kvt_cluster_slot(idx, strlen(idx)));
    kvt_remote *t = tier_on(url, m, NULL, 2000, 2000);
    CHECK(t);
    int32_t toks[N];
    seqb(toks, N, 36);
    size_t got;
    kvt_session *s = restore(t, m, toks, N, &got, NULL); /* the map read, every shard closed */
    kvt_session_free(s);
    atomic_store(&f.dead, victim);
    fx_sleep_ms(100);
    for (int i = 0; i < 4; i++) {
        s = restore(t, m, toks, N, &got, NULL);
        kvt_session_free(s);
    }
    kvt_remote_stats st;
    kvt_remote_stats_get(t, &st);
    int *br = calloc(BIG, sizeof *br);
    CHECK(br);
    size_t n = kvt_remote_shard_breakers(t, br, BIG), open = 0;
    for (size_t i = 0; i < n && i < BIG; i++) open += br[i] != 0;
    printf("    master %d (shard %d) killed: %zu shards, %zu breakers open, shard %d's %d, trips %llu (%s)\n", victim,
           victim, n, open, victim, br[victim], (unsigned long long)st.breaker_trips, st.last_error);
    CHECK(victim >= 64);
    CHECKF(n == BIG && st.n_shards == BIG && open == 1 && st.shards_open == 1 && br[victim] == 1 &&
               st.breaker_trips == 1,
           "%zu shards, %zu open", n, open);
    free(br);
    kvt_remote_close(t);
    kvt_model_close(m);
    cfx_stop(&f);
}

/* A hostile CLUSTER SLOTS reply is refused, the round trip a clean
 * failure saying why, within its deadline, its memory bounded: array
 * headers of millions of elements (refused by the reader before it
 * allocates), nesting past hiredis's 7 levels, more ranges than slots,
 * slots out of range, reversed or named twice, bad ports and hosts,
 * 16,384 masters each on a host of its own (with the seed, one node more
 * than the table takes), elements of the wrong type. The positive
 * control: the same fake with its own map routes. */
TEST(cluster_hostile_slots_refused)
{
    cfx f;
    unsigned first[3] = {0, 8192, KVT_CLUSTER_SLOTS};
    if (!cfx_start(&f, 2, first)) { cfx_stop(&f); SKIP_ENV("no listening socket on 127.0.X.Y"); }
    char url[96];
    cfx_url(&f, url, sizeof url);
    char ep[64];
    snprintf(ep, sizeof ep, "*2\r\n$%zu\r\n%s\r\n:%d\r\n", strlen(f.host[0]), f.host[0], f.port[0]);
    kvt_wbuf many = {0}, wide = {0}, nodes = {0}, nest = {0};
    kvt_wbuf_put(&many, "*16385\r\n", 8);
    for (int i = 0; i < 16385; i++) {
        char r[128];
        int l = snprintf(r, sizeof r, "*3\r\n:%d\r\n:%d\r\n%s", i % 16384, i % 16384, ep);
        kvt_wbuf_put(&many, r, (size_t)l);
    }
    kvt_wbuf_put(&nodes, "*16384\r\n", 8);
    for (int i = 0; i < 16384; i++) {
        char r[128], h[32];
        snprintf(h, sizeof h, "10.9.%d.%d", i / 200, i % 200);
        int l = snprintf(r, sizeof r, "*3\r\n:%d\r\n:%d\r\n*2\r\n$%zu\r\n%s\r\n:7000\r\n", i, i, strlen(h), h);
        kvt_wbuf_put(&nodes, r, (size_t)l);
    }
    char host300[400] = "", r300[600];
    memset(host300, 'h', 300);
    snprintf(r300, sizeof r300, "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$300\r\n%s\r\n:7000\r\n", host300);
    kvt_wbuf_put(&wide, "*3000000\r\n", 10);
    for (int i = 0; i < 1000; i++) kvt_wbuf_put(&wide, "*3\r\n:0\r\n:0\r\n*0\r\n", 17);
    for (int i = 0; i < 9; i++) kvt_wbuf_put(&nest, "*1\r\n", 4);
    kvt_wbuf_put(&nest, ":1\r\n", 4);
    char out_of_range[160], negative[160], reversed[160], twice[256], port0[160], port_big[160];
    snprintf(out_of_range, sizeof out_of_range, "*1\r\n*3\r\n:0\r\n:16384\r\n%s", ep);
    snprintf(negative, sizeof negative, "*1\r\n*3\r\n:-1\r\n:16383\r\n%s", ep);
    snprintf(reversed, sizeof reversed, "*1\r\n*3\r\n:9\r\n:3\r\n%s", ep);
    snprintf(twice, sizeof twice, "*2\r\n*3\r\n:0\r\n:100\r\n%s*3\r\n:50\r\n:16383\r\n%s", ep, ep);
    snprintf(port0, sizeof port0, "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:0\r\n");
    snprintf(port_big, sizeof port_big, "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:70000\r\n");
    struct { const char *name, *p; size_t len; const char *says; } cases[] = {
        {"an array of 3,000,000 ranges", (char *)wide.p, wide.len, "does not parse"},
        {"an array of 2,000,000,000", "*2000000000\r\n", 0, "does not parse"},
        {"nesting 9 deep", (char *)nest.p, nest.len, "nested"},
        {"16,385 ranges", (char *)many.p, many.len, "16385 slot ranges"},
        {"16,384 masters on hosts of their own", (char *)nodes.p, nodes.len, "more than the client takes"},
        {"slot 16384", out_of_range, strlen(out_of_range), "slots 0-16384"},
        {"slot -1", negative, strlen(negative), "slots -1-16383"},
        {"slots 9-3", reversed, strlen(reversed), "slots 9-3"},
        {"a slot named twice", twice, strlen(twice), "named twice"},
        {"port 0", port0, strlen(port0), "bad endpoint"},
        {"port 70000", port_big, strlen(port_big), "bad endpoint"},
        {"a 300-byte host", r300, strlen(r300), "bad endpoint"},
        {"a range that is a string", "*1\r\n$3\r\nabc\r\n", 0, "unknown shape"},
        {"a master that is a number", "*1\r\n*3\r\n:0\r\n:16383\r\n:5\r\n", 0, "unknown shape"},
        {"an empty map", "*0\r\n", 0, "unknown shape"},
        {"an error", "-ERR This instance has cluster support disabled\r\n", 0, "cluster support disabled"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        f.slots_reply = cases[i].p;
        f.slots_len = cases[i].len ? cases[i].len : strlen(cases[i].p);
        fx_sleep_ms(30); /* the fake's thread reads it at its next command */
        kvt_redis *k = rfx_client(url, NULL);
        CHECK(k);
        redisReply **rep = NULL;
        size_t n = 0;
        const char *get[2] = {"GET", "x"};
        kvt_redis_append(k, 2, get, NULL);
        double t0 = fx_now();
        int rc = kvt_redis_exec(k, 1000, &rep, &n);
        double dt = fx_now() - t0;
        char msg[300];
        snprintf(msg, sizeof msg, "%s", rc ? kvt_errmsg() : "");
        printf("    %s: %s in %.0f ms\n", cases[i].name, msg, dt * 1000);
        CHECKF(rc == KVT_EIO && !rep && strstr(msg, cases[i].says), "%s: rc %d (%s)", cases[i].name, rc, msg);
        CHECK(dt < 1.5); /* 1 s deadline; a refused map ends sooner */
        kvt_redis_free(k);
    }
    /* the positive control: the fake's own map */
    f.slots_reply = NULL;
    fx_sleep_ms(30);
    kvt_redis *k = rfx_client(url, NULL);
    char why[300] = "";
    CHECKF(k && big_round(k, 50, why, sizeof why), "the fake's own map: %s", why);
    kvt_redis_free(k);
    kvt_wbuf_free(&many);
    kvt_wbuf_free(&wide);
    kvt_wbuf_free(&nodes);
    kvt_wbuf_free(&nest);
    cfx_stop(&f);
}
