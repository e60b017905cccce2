/* The remote tier: the disk tier's records in Redis (see remote.h,
 * docs/STORE.md "Remote tier", docs/FORMAT.md "Remote tier keys").
 *
 * Every key starts with a namespace: "kvt:r2:" (the layout's version:
 * r1 was the layout before values had their {hash tag}; a server of
 * another layout never reads these keys as its own),
 * key0 in hex (the model and tokenizer fingerprints and the row types, the
 * same value the record keys chain from), and the tenant's name (derived
 * with the secret, so one tenant cannot name another's keys). Under it:
 *
 *   b:KEY                a block record, content addressed by its chained
 *                        key: shared by every snapshot and server that
 *                        holds the block
 *   s:HEAD:N:TAIL        a snapshot record of N tokens whose last whole
 *                        block has key HEAD and whose tail ids hash to TAIL
 *   i:HEAD               the index: a hash whose field "N:TAIL" names each
 *                        snapshot standing on HEAD, its value the manifest
 *                        "SNAPLEN BLOCKLEN_0 ... BLOCKLEN_nb-1"
 *   {VALUE}#P            part P >= 1 of a value longer than PART bytes
 *   {VALUE}#mac          the HMAC-SHA256 of (key, value) with a secret
 *
 * The braces are a Redis Cluster hash tag: a value's parts and MAC hash
 * to the value's own slot, so the MSET that writes them all stays one
 * atomic command on a cluster too (and EXISTS of a value and its MAC one
 * command).
 *
 * A lookup asks for the index of every block boundary of the prompt in
 * one pipeline (HGETALL i:key(b)), picks the longest entry whose tail
 * ids are the prompt's, and fetches its snapshot and blocks in windows of
 * bounded bytes, a pipeline each, releasing each window before the next
 * (kvt_remote_window_bytes). The values are the records exactly as the
 * disk store writes them, so the loader checks them as it checks the
 * disk's: checksums, fingerprints, the key chain, sizes; a value that
 * fails is deleted. */
#include "store/remote.h"
#include "store/redis.h"
#include "session/snapshot.h"
#include "cache/cache.h"
#include "base/util.h"

#include <inttypes.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/core_names.h>
#include <openssl/params.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>

#define MAX_VALUE (1ull << 31)     /* a manifest naming a longer value is damage */
#define MAX_TENANTS 64
#define BREAK_AFTER 3              /* consecutive failures that open the breaker */
#define BREAK_MIN 1.0              /* seconds it stays open, doubling on a failed probe */
#define BREAK_MAX 30.0
#define MAX_TRIES 3                /* index entries tried by one lookup */
#define MAC_LEN 32
#define EST_FLOPS 1e12             /* FLOP/s of prefill assumed until one is measured: a fast */
                                   /* server's, so the deadline is shorter than a prefill, not longer */
#define MIN_LOAD 0.02              /* a deadline from FLOPs is at least this: a small model's FLOPs say */
                                   /* little of its prefill's time, which its overheads make */
#define MIN_MEASURED 256           /* prefills of fewer tokens are not measured */
#define LAYOUT "kvt:r2:"            /* the key layout's version (docs/FORMAT.md "Remote tier keys") */
#define CHECK_MS 500               /* deadline of an upload's round trip asking what Redis has */

bool kvt_remote_skip_mac;
bool kvt_remote_skip_value_checks;
bool kvt_remote_fault_skip_block_check;
bool kvt_remote_fault_fixed_deadline;
void (*kvt_remote_before_load)(void *arg);
void *kvt_remote_before_load_arg;
size_t kvt_remote_part_bytes = 1u << 20; /* bytes of a value's part */
size_t kvt_remote_flush_bytes = 8u << 20; /* blocks of one upload sent from the saves' thread in windows of this */
#define PART kvt_remote_part_bytes

/* A circuit breaker: closed (0), open (1: not asked until open_until),
 * half-open (2: one probe in flight, whose result closes or reopens it
 * for twice as long). */
typedef struct breaker {
    int state, fails;
    bool probing;
    double open_until, backoff;
} breaker;

typedef struct upload {
    int tenant;
    char *keys;                    /* the values' keys, NUL-separated, in sending order */
    kvt_wbuf vals;                 /* their bytes, back to back */
    size_t *lens;                  /* of each value */
    size_t n_vals;                 /* blocks first, the snapshot last */
    char index_key[160], field[64];
    kvt_wbuf manifest;
    uint64_t *bkeys;               /* the block keys among the values, in order */
    size_t *blens, n_bkeys;        /* and their lengths */
    uint64_t seq;                  /* its place in the queue (1, 2, ...) */
    uint64_t dep;                  /* the first queued upload it counts on for blocks (0 none) */
    struct upload *next;
} upload;

struct kvt_remote {
    kvt_model *m;
    kvt_remote_opts o;
    kvt_redis_url url;
    char *password;
    uint8_t secret[256];
    size_t secret_len;
    uint64_t key0;
    char ns[MAX_TENANTS][96];
    size_t n_tenants;
    kvt_redis *rd_load, *rd_check, *rd_up; /* one connection per thread that uses it */
    pthread_mutex_t check_mu;      /* rd_check: uploads' checks, from any thread */
    pthread_mutex_t load_mu;       /* rd_load: restores, from any thread */
    pthread_mutex_t mu;            /* the queue, the breakers, the stats */
    pthread_cond_t cv;
    pthread_t thread;
    bool stopping;
    double stop_at;
    upload *head, *tail;
    upload *sending;               /* taken from the queue, being sent (under mu) */
    uint64_t seq, failed_seq;      /* the last upload queued; the last one that was not sent (under mu) */
    breaker *br;                   /* [n_br] one a shard: a cluster's master each, grown with the */
    size_t n_br;                   /* shards the round trips meet (under mu) */
    size_t n_shards;               /* the most shards a round trip knew (under mu) */
    kvt_remote_stats st;
    double refused_logged;         /* when an upload's refusal was last reported (under mu) */
    double w_flops, a_flops;       /* a prefill's FLOPs: 2 a parameter a token, 4 a_flops a token a position */
    double rate;                   /* FLOP/s of prefill: EST_FLOPS, or measured (under mu) */
    bool measured;                 /* rate is an average of measured prefills (under mu) */
};

/* ---- the breakers ---- */

/* One breaker a shard (a cluster's master): a master that fails stops
 * being asked, its keys are missing to the lookups, while the healthy
 * masters serve theirs. kvt_remote_fault_one_breaker: the tier as it was
 * before, one breaker for every shard, a shard's failure the whole round
 * trip's. */
bool kvt_remote_fault_one_breaker;

static breaker *brk(kvt_remote *r, size_t s) { return &r->br[kvt_remote_fault_one_breaker ? 0 : s]; }

/* Under mu: a breaker for each of shards [0, n) (new ones closed); false
 * when memory runs out (the shards past n_br then count as closed, never
 * reported). */
static bool breakers_grow(kvt_remote *r, size_t n)
{
    if (n <= r->n_br) return true;
    breaker *b = realloc(r->br, n * sizeof *b);
    if (!b) return false;
    for (size_t i = r->n_br; i < n; i++) b[i] = (breaker){.backoff = BREAK_MIN};
    r->br = b;
    r->n_br = n;
    return true;
}

/* The shards a lookup saw fail or skipped (their breakers open): the
 * entries with a value on one are out of its reach. Grows with the
 * shards the lookup's round trips meet. */
typedef struct downset {
    bool *v;
    size_t n;
} downset;

static bool is_down(const downset *d, size_t s) { return d && s < d->n && d->v[s]; }

static void mark_down(downset *d, size_t s)
{
    if (s >= d->n) {
        size_t n = s + 1 > 2 * d->n ? s + 1 : 2 * d->n;
        bool *v = realloc(d->v, n * sizeof *v);
        if (!v) return; /* not marked: the shard is asked again, and fails again */
        memset(v + d->n, 0, (n - d->n) * sizeof *v);
        d->v = v;
        d->n = n;
    }
    d->v[s] = true;
}

/* Under mu: whether shard s may be asked (an open breaker past its time
 * lets one probe through, half-open). */
static bool allow_locked(kvt_remote *r, size_t s)
{
    breaker *b = brk(r, s);
    if (b->state == 1 && kvt_now() >= b->open_until && !b->probing) {
        b->state = 2;
        b->probing = true;
        return true;
    }
    return b->state == 0;
}

static void report_locked(kvt_remote *r, size_t s, bool ok, const char *why, bool *opened, bool *closed)
{
    breaker *b = brk(r, s);
    if (ok) {
        *closed = b->state != 0;
        b->state = 0;
        b->fails = 0;
        b->backoff = BREAK_MIN;
    } else {
        r->st.errors++;
        b->fails++;
        snprintf(r->st.last_error, sizeof r->st.last_error, "%.191s", why ? why : "?");
        if (b->state == 2 || (b->state == 0 && b->fails >= BREAK_AFTER)) {
            if (b->state == 2) b->backoff = b->backoff * 2 > BREAK_MAX ? BREAK_MAX : b->backoff * 2;
            else r->st.breaker_trips++;
            *opened = b->state == 0;
            b->state = 1;
            b->open_until = kvt_now() + b->backoff;
        }
    }
    b->probing = false;
}

static void say_breaker(kvt_remote *r, size_t s, bool multi, bool opened, bool closed, const char *why)
{
    if (r->o.quiet || (!opened && !closed)) return;
    char shard[32] = "";
    if (multi && !kvt_remote_fault_one_breaker) snprintf(shard, sizeof shard, " (shard %zu)", s);
    if (opened) fprintf(stderr, "kvtier: remote tier %s%s failing (%s): not asked for %.0f s, then probed\n", r->o.url,
                        shard, why ? why : "?", BREAK_MIN);
    if (closed) fprintf(stderr, "kvtier: remote tier %s%s answers again\n", r->o.url, shard);
}

/* The shards whose breakers are not closed: sh->skip (and down, when
 * given, skipped too: shards a lookup saw fail). sh (zeroed, or a
 * round trip's before) keeps its arrays; the shards no breaker knows yet
 * are asked. KVT_ENOMEM when its arrays cannot hold the shards known. */
static int gate(kvt_remote *r, kvt_shards *sh, const downset *down)
{
    pthread_mutex_lock(&r->mu);
    size_t n = r->n_br > 1 ? r->n_br : 1;
    if (down && down->n > n) n = down->n;
    int rc = kvt_shards_grow(sh, n);
    if (!rc) {
        kvt_shards_clear(sh);
        sh->n = 0;
        memset(sh->skip, 0, sh->cap * sizeof *sh->skip);
        for (size_t s = 0; s < sh->cap; s++) {
            if (is_down(down, s)) sh->skip[s] = true;
            else if (kvt_remote_fault_one_breaker && s) sh->skip[s] = sh->skip[0];
            else if (s < r->n_br) sh->skip[s] = !allow_locked(r, s);
        }
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

/* After a round trip: each shard asked reports to its breaker (a failure,
 * or an error reply when refusals count); a probe let through but not
 * sent is given back. */
static void settle(kvt_remote *r, kvt_shards *sh, const downset *down, bool refusals_fail)
{
    bool any_asked = false, any_bad = false;
    const char *why = NULL;
    for (size_t s = 0; s < sh->cap; s++) {
        bool bad = sh->failed[s] || (refusals_fail && sh->refused[s]);
        any_asked |= sh->asked[s];
        any_bad |= bad;
        if (bad && !why) why = sh->failed[s] ? sh->why : sh->refusal;
    }
    pthread_mutex_lock(&r->mu);
    if (sh->n > r->n_shards) r->n_shards = sh->n;
    /* a breaker for every shard the round trip met */
    size_t nb = breakers_grow(r, sh->cap) ? sh->cap : r->n_br;
    for (size_t s = 0; s < nb; s++) {
        bool opened = false, closed = false;
        bool one = kvt_remote_fault_one_breaker;
        if (one && s) break;
        bool asked = one ? any_asked : sh->asked[s];
        bool bad = one ? any_bad : sh->failed[s] || (refusals_fail && sh->refused[s]);
        if ((is_down(down, s) && !one) || (sh->skip[s] && !asked)) continue;
        if (!asked) { /* let through, not asked: a probe unused */
            breaker *b = brk(r, s);
            if (b->state == 2 && b->probing) { b->state = 1; b->probing = false; }
            continue;
        }
        report_locked(r, s, !bad, bad ? (one ? why : sh->failed[s] ? sh->why : sh->refusal) : NULL, &opened, &closed);
        bool multi = r->n_shards > 1;
        pthread_mutex_unlock(&r->mu);
        say_breaker(r, s, multi, opened, closed, bad ? (one ? why : sh->failed[s] ? sh->why : sh->refusal) : NULL);
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
}

/* One round trip of rd's queued commands by ms, the shards whose
 * breakers are open (or down[] names) skipped: replies NULL for those and
 * for the shards that fail (kvt_redis_exec_shards), every breaker asked
 * told. With kvt_remote_fault_one_breaker a shard's failure is the whole
 * round trip's: no reply stands. Only KVT_ENOMEM fails. */
static int round_trip(kvt_remote *r, kvt_redis *rd, int ms, const downset *down, bool refusals_fail, kvt_shards *sh,
                      redisReply ***rep, size_t *nr)
{
    *rep = NULL;
    *nr = 0;
    if (gate(r, sh, down)) {
        kvt_redis_discard(rd);
        return KVT_ENOMEM;
    }
    int rc = kvt_redis_exec_shards(rd, ms, sh, rep, nr);
    if (rc) {
        if (sh->cap) memset(sh->asked, 0, sh->cap * sizeof *sh->asked);
        settle(r, sh, down, refusals_fail);
        return rc;
    }
    bool failed = false;
    for (size_t s = 0; s < sh->cap; s++) failed |= sh->failed[s];
    if (kvt_remote_fault_one_breaker && failed)
        for (size_t i = 0; i < *nr; i++) {
            if ((*rep)[i]) freeReplyObject((*rep)[i]);
            (*rep)[i] = NULL;
        }
    settle(r, sh, down, refusals_fail);
    return KVT_OK;
}

/* Whether every reply of a round trip came back (none skipped or failed). */
static bool all_replies(redisReply **rep, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!rep[i]) return false;
    return true;
}

/* ---- keys and MACs ---- */

static void hex_bytes(const uint8_t *p, size_t n, char *out)
{
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) { out[2 * i] = d[p[i] >> 4]; out[2 * i + 1] = d[p[i] & 15]; }
    out[2 * n] = 0;
}

/* The HMAC of (key, value), the value in pieces v[0..n) as it lies (a
 * value's parts as they arrive: nothing joined). */
static void mac_of_parts(const kvt_remote *r, const char *key, const struct iovec *v, size_t n, uint8_t out[MAC_LEN])
{
    EVP_MAC *mac = EVP_MAC_fetch(NULL, "HMAC", NULL);
    EVP_MAC_CTX *c = mac ? EVP_MAC_CTX_new(mac) : NULL;
    char digest[] = "SHA256";
    OSSL_PARAM ps[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0), OSSL_PARAM_construct_end()};
    size_t ol = 0;
    uint8_t zero = 0;
    bool ok = c && EVP_MAC_init(c, r->secret, r->secret_len, ps) &&
              EVP_MAC_update(c, (const uint8_t *)key, strlen(key)) && EVP_MAC_update(c, &zero, 1);
    for (size_t i = 0; ok && i < n; i++) ok = EVP_MAC_update(c, v[i].iov_base, v[i].iov_len);
    if (!ok || !EVP_MAC_final(c, out, &ol, MAC_LEN) || ol != MAC_LEN)
        memset(out, 0, MAC_LEN); /* never matches a stored MAC of real bytes */
    EVP_MAC_CTX_free(c);
    EVP_MAC_free(mac);
}

static void mac_of(const kvt_remote *r, const char *key, const uint8_t *v, size_t len, uint8_t out[MAC_LEN])
{
    struct iovec one = {(void *)v, len};
    mac_of_parts(r, key, &one, 1, out);
}

static int read_secret(const char *path, const char *what, char *out, size_t cap, size_t *len, bool quiet)
{
    FILE *f = fopen(path, "rb");
    if (!f) return kvt_fail(KVT_EIO, "%s %s: cannot open", what, path);
    struct stat sb;
    if (!quiet && !fstat(fileno(f), &sb) && (sb.st_mode & 077))
        fprintf(stderr, "kvtier: warning: %s %s is readable by other users (mode %03o)\n", what, path,
                (unsigned)(sb.st_mode & 0777));
    size_t n = fread(out, 1, cap, f);
    bool more = fgetc(f) != EOF;
    fclose(f);
    if (more) return kvt_fail(KVT_EINVAL, "%s %s: longer than %zu bytes", what, path, cap - 1);
    while (n && (out[n - 1] == '\n' || out[n - 1] == '\r')) n--;
    if (!n) return kvt_fail(KVT_EINVAL, "%s %s: empty", what, path);
    out[n] = 0;
    *len = n;
    return KVT_OK;
}

/* ---- open, close ---- */

static void *upload_main(void *arg);

static void check_policy(kvt_remote *r)
{
    redisReply **rep = NULL;
    size_t n = 0;
    kvt_redis_appendf(r->rd_check, "CONFIG GET maxmemory-policy");
    kvt_redis_appendf(r->rd_check, "CONFIG GET maxmemory");
    int rc = kvt_redis_exec(r->rd_check, r->o.connect_ms, &rep, &n);
    if (rc) {
        if (!r->o.quiet)
            fprintf(stderr, "kvtier: remote tier %s does not answer at start (%s): misses until it does\n", r->o.url,
                    kvt_errmsg());
        return;
    }
    const char *v[2] = {NULL, NULL};
    for (size_t i = 0; i < n && i < 2; i++) {
        redisReply *x = rep[i];
        if (x->type == REDIS_REPLY_ARRAY && x->elements == 2 && x->element[1]->type == REDIS_REPLY_STRING)
            v[i] = x->element[1]->str;
    }
    if (!r->o.quiet && v[0] && (!strcmp(v[0], "noeviction") || !strncmp(v[0], "volatile-", 9)))
        fprintf(stderr, "kvtier: warning: remote tier %s has maxmemory-policy %s: once maxmemory is reached it "
                "refuses writes (the tier's keys have no expiry); allkeys-lru keeps it a cache\n", r->o.url, v[0]);
    else if (!r->o.quiet && v[1] && !strcmp(v[1], "0"))
        fprintf(stderr, "kvtier: warning: remote tier %s has no maxmemory: it grows until the machine runs out; "
                "set maxmemory (with allkeys-lru) as the tier's budget\n", r->o.url);
    else if (!r->o.quiet && !v[0])
        fprintf(stderr, "kvtier: remote tier %s: its maxmemory-policy cannot be read (CONFIG refused): "
                "allkeys-lru keeps it a cache\n", r->o.url);
    kvt_redis_replies_free(rep, n);
}

static void upload_free(upload *u)
{
    if (!u) return;
    free(u->keys);
    free(u->lens);
    free(u->bkeys);
    free(u->blens);
    kvt_wbuf_free(&u->vals);
    kvt_wbuf_free(&u->manifest);
    free(u);
}

/* Everything a tier holds but its upload thread (stopped or never
 * started): the queued uploads, the connections, the secret, the locks. */
static void teardown(kvt_remote *r)
{
    while (r->head) {
        upload *u = r->head;
        r->head = u->next;
        upload_free(u);
    }
    kvt_redis_free(r->rd_load);
    kvt_redis_free(r->rd_check);
    kvt_redis_free(r->rd_up);
    OPENSSL_cleanse(r->secret, sizeof r->secret);
    free(r->br);
    pthread_mutex_destroy(&r->mu);
    pthread_mutex_destroy(&r->check_mu);
    pthread_mutex_destroy(&r->load_mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

int kvt_remote_open(kvt_remote **out, kvt_model *m, const kvt_remote_opts *o)
{
    *out = NULL;
    kvt_redis_url url;
    int rc = kvt_redis_parse_url(o->url, &url);
    if (rc) return rc;
    url.ca = o->tls_ca;
    url.cert = o->tls_cert;
    url.key = o->tls_key;
    if (o->keyed_tenants && !o->secret_file)
        return kvt_fail(KVT_EINVAL, "the remote tier with API keys needs --kv-remote-secret-file: without a secret "
                        "every tenant could read and plant another's records in Redis");
    if (o->n_tenants > MAX_TENANTS) return kvt_fail(KVT_EINVAL, "%zu tenants for the remote tier", o->n_tenants);
    kvt_remote *r = kvt_calloc(1, sizeof *r);
    if (!r) return KVT_ENOMEM;
    r->m = m;
    r->o = *o;
    if (!r->o.connect_ms) r->o.connect_ms = 200;
    if (!r->o.lookup_ms) r->o.lookup_ms = 20;
    /* a load's deadline: the prefill it saves, its FLOPs (prefill_flops)
     * at EST_FLOPS until a prefill is measured (kvt_remote_note_prefill) */
    kvt_model_info mi;
    kvt_model_info_get(m, &mi);
    r->w_flops = 2.0 * (double)(mi.n_params ? mi.n_params : 1);
    r->a_flops = (double)mi.n_layer * mi.n_head * mi.head_dim;
    r->rate = EST_FLOPS;
    if (!r->o.queue_bytes) r->o.queue_bytes = 256u << 20;
    r->url = url;
    r->n_shards = 1;
    r->key0 = kvt_snap_key0(m);
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->check_mu, NULL);
    pthread_mutex_init(&r->load_mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    char pw[1024];
    size_t pl = 0;
    if (o->password_file && (rc = read_secret(o->password_file, "--kv-remote-password-file", pw, sizeof pw, &pl,
                                              o->quiet)))
        goto fail;
    if (o->secret_file && (rc = read_secret(o->secret_file, "--kv-remote-secret-file", (char *)r->secret,
                                            sizeof r->secret, &r->secret_len, o->quiet)))
        goto fail;
    r->n_tenants = o->n_tenants ? o->n_tenants : 1;
    for (size_t t = 0; t < r->n_tenants; t++) {
        const char *name = o->tenants ? o->tenants[t] : "default";
        char tn[24] = "open";
        if (r->secret_len) {
            uint8_t mac[MAC_LEN];
            mac_of(r, "kvtier tenant", (const uint8_t *)name, strlen(name), mac);
            hex_bytes(mac, 8, tn);
        }
        snprintf(r->ns[t], sizeof r->ns[t], LAYOUT "%016" PRIx64 ":%s:", r->key0, tn);
    }
    if ((rc = kvt_redis_new(&r->rd_load, &url, pl ? pw : NULL)) || (rc = kvt_redis_new(&r->rd_check, &url, pl ? pw : NULL)) ||
        (rc = kvt_redis_new(&r->rd_up, &url, pl ? pw : NULL)))
        goto fail;
    OPENSSL_cleanse(pw, sizeof pw);
    /* names resolved here, at start, within the connect deadline (one
     * not resolved by then: the first round trips wait for it within
     * their own deadlines, conn.h) */
    double until = kvt_now() + r->o.connect_ms / 1000.0;
    kvt_redis *rds[3] = {r->rd_load, r->rd_check, r->rd_up};
    for (int i = 0; i < 3; i++) {
        int left = (int)((until - kvt_now()) * 1000);
        kvt_redis_resolve(rds[i], left > 0 ? left : 0);
    }
    check_policy(r);
    if (pthread_create(&r->thread, NULL, upload_main, r)) { rc = kvt_fail(KVT_ENOMEM, "remote tier thread"); goto fail; }
    *out = r;
    return KVT_OK;
fail:
    OPENSSL_cleanse(pw, sizeof pw);
    teardown(r);
    return rc;
}

void kvt_remote_close(kvt_remote *r)
{
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->stopping = true;
    r->stop_at = kvt_now();
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->thread, NULL);
    teardown(r);
}

void kvt_remote_stats_get(kvt_remote *r, kvt_remote_stats *o)
{
    pthread_mutex_lock(&r->mu);
    *o = r->st;
    o->n_shards = kvt_remote_fault_one_breaker ? 1 : r->n_shards;
    o->breaker = 0;
    o->shards_open = 0;
    for (size_t i = 0; i < o->n_shards && i < r->n_br; i++) {
        if (r->br[i].state == 1 || (r->br[i].state == 2 && o->breaker == 0)) o->breaker = r->br[i].state;
        o->shards_open += r->br[i].state != 0;
    }
    pthread_mutex_unlock(&r->mu);
}

size_t kvt_remote_shard_breakers(kvt_remote *r, int *out, size_t cap)
{
    pthread_mutex_lock(&r->mu);
    size_t n = kvt_remote_fault_one_breaker ? 1 : r->n_shards;
    for (size_t i = 0; i < n && i < cap; i++) out[i] = i < r->n_br ? r->br[i].state : 0;
    pthread_mutex_unlock(&r->mu);
    return n;
}

/* The FLOPs of a prefill of positions [a, b): the weights' 2 a parameter
 * a token, and attention's 4 a layer, head and dimension a position
 * attended (scores and values), summed: 2 A (b^2 - a^2). */
static double prefill_flops(const kvt_remote *r, size_t a, size_t b)
{
    double x = (double)a, y = (double)b;
    return r->w_flops * (y - x) + 2.0 * r->a_flops * (y * y - x * x);
}

void kvt_remote_note_prefill(kvt_remote *r, size_t from, size_t to, double seconds)
{
    if (!r || r->o.prefill_tps > 0 || to < from + MIN_MEASURED || !(seconds > 0)) return;
    double rate = prefill_flops(r, from, to) / seconds;
    pthread_mutex_lock(&r->mu);
    r->rate = r->measured ? 0.75 * r->rate + 0.25 * rate : rate;
    r->measured = true;
    pthread_mutex_unlock(&r->mu);
}

double kvt_remote_load_deadline(kvt_remote *r, size_t have, size_t n)
{
    if (kvt_remote_fault_fixed_deadline) return 0.5;
    if (r->o.load_ms) return r->o.load_ms / 1000.0;
    if (n <= have) return 0;
    if (r->o.prefill_tps > 0) return (double)(n - have) / r->o.prefill_tps;
    pthread_mutex_lock(&r->mu);
    double rate = r->rate;
    pthread_mutex_unlock(&r->mu);
    double d = prefill_flops(r, have, n) / rate;
    return d > MIN_LOAD ? d : MIN_LOAD;
}

size_t kvt_remote_send_buffers(kvt_remote *r)
{
    pthread_mutex_lock(&r->check_mu);
    size_t n = kvt_redis_queue_bytes(r->rd_check);
    pthread_mutex_unlock(&r->check_mu);
    pthread_mutex_lock(&r->load_mu);
    n += kvt_redis_queue_bytes(r->rd_load);
    pthread_mutex_unlock(&r->load_mu);
    pthread_mutex_lock(&r->mu); /* the upload thread's: read between its uploads */
    n += kvt_redis_queue_bytes(r->rd_up);
    pthread_mutex_unlock(&r->mu);
    return n;
}

bool kvt_remote_drain(kvt_remote *r, double timeout)
{
    double end = kvt_now() + timeout;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        bool empty = !r->head && !r->st.queue_len;
        pthread_mutex_unlock(&r->mu);
        if (empty) return true;
        if (kvt_now() > end) return false;
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
}

/* ---- values: append the commands that write, read or delete one ---- */

static size_t n_parts(size_t len) { return len ? (len + PART - 1) / PART : 1; }

static void part_key(char *out, size_t cap, const char *key, size_t p)
{
    if (p == 0) snprintf(out, cap, "%s", key);
    else snprintf(out, cap, "{%s}#%zu", key, p);
}

static void mac_key(char *out, size_t cap, const char *key) { snprintf(out, cap, "{%s}#mac", key); }

/* MSET of every part (and the MAC): Redis applies it whole. */
static int append_set(kvt_remote *r, kvt_redis *rd, const char *key, const uint8_t *v, size_t len)
{
    size_t np = n_parts(len), argc = 1 + 2 * (np + (r->secret_len ? 1 : 0));
    const char **argv = kvt_calloc(argc, sizeof *argv);
    size_t *lens = kvt_calloc(argc, sizeof *lens);
    char (*names)[200] = kvt_calloc(np + 1, sizeof *names);
    uint8_t mac[MAC_LEN];
    int rc = KVT_ENOMEM;
    if (argv && lens && names) {
        size_t a = 0;
        argv[a] = "MSET";
        lens[a++] = 4;
        for (size_t p = 0; p < np; p++) {
            part_key(names[p], sizeof names[p], key, p);
            argv[a] = names[p];
            lens[a++] = strlen(names[p]);
            size_t off = p * PART, l = len - off < PART ? len - off : PART;
            argv[a] = (const char *)v + off;
            lens[a++] = l;
        }
        if (r->secret_len) {
            mac_key(names[np], sizeof names[np], key);
            mac_of(r, key, v, len, mac);
            argv[a] = names[np];
            lens[a++] = strlen(names[np]);
            argv[a] = (const char *)mac;
            lens[a++] = MAC_LEN;
        }
        rc = kvt_redis_append(rd, (int)a, argv, lens);
    }
    free(argv);
    free(lens);
    free(names);
    return rc;
}

/* GET of every part of a value of len bytes, then its MAC: *cmds of them. */
static int append_get(kvt_remote *r, kvt_redis *rd, const char *key, size_t len, size_t *cmds)
{
    size_t np = n_parts(len);
    char name[200];
    int rc = KVT_OK;
    for (size_t p = 0; p < np && !rc; p++) {
        part_key(name, sizeof name, key, p);
        const char *a[2] = {"GET", name};
        rc = kvt_redis_append(rd, 2, a, NULL);
    }
    if (!rc && r->secret_len) {
        mac_key(name, sizeof name, key);
        const char *a[2] = {"GET", name};
        rc = kvt_redis_append(rd, 2, a, NULL);
    }
    *cmds = np + (r->secret_len ? 1 : 0);
    return rc;
}

static int append_del(kvt_remote *r, kvt_redis *rd, const char *key, size_t len)
{
    size_t np = n_parts(len);
    char name[200];
    int rc = KVT_OK;
    for (size_t p = 0; p <= np && !rc; p++) {
        if (p == np) mac_key(name, sizeof name, key);
        else part_key(name, sizeof name, key, p);
        const char *a[2] = {"DEL", name};
        rc = kvt_redis_append(rd, 2, a, NULL);
    }
    return rc;
}

/* The first error reply's text (NOAUTH, an ACL refusal, OOM), NULL when
 * none: the round trip worked, but Redis refused it, which counts as a
 * failure of the remote (the breaker) rather than of a value. */
static const char *error_reply(redisReply **rep, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (rep[i] && rep[i]->type == REDIS_REPLY_ERROR) return rep[i]->str;
    return NULL;
}

/* ---- uploads ---- */

static int send_values(kvt_remote *r, kvt_redis *rd, const char *keys, const uint8_t *vals, const size_t *lens,
                       size_t n, const char *const *idx, const size_t *idx_len, size_t bytes);

static void block_key(const kvt_remote *r, int t, uint64_t key, char *out, size_t cap)
{
    snprintf(out, cap, "%sb:%016" PRIx64, r->ns[t], key);
}

/* A block another upload of the queue carries already. */
typedef struct pending {
    uint64_t key, seq;
    size_t len;
} pending;

static int cmp_pending(const void *a, const void *b)
{
    const pending *x = a, *y = b;
    return x->key < y->key ? -1 : x->key > y->key;
}

/* The blocks of tenant's uploads queued or being sent, sorted by key:
 * *n of them (malloc'ed; NULL when none, or out of memory: then nothing
 * is skipped). */
static pending *pending_blocks(kvt_remote *r, int tenant, size_t *n)
{
    *n = 0;
    pthread_mutex_lock(&r->mu);
    size_t total = 0;
    for (int pass = 0; pass < 2; pass++)
        for (upload *u = pass ? r->head : r->sending; u; u = pass ? u->next : NULL)
            if (u->tenant == tenant) total += u->n_bkeys;
    pending *p = total ? kvt_malloc(total * sizeof *p) : NULL;
    for (int pass = 0; p && pass < 2; pass++)
        for (upload *u = pass ? r->head : r->sending; u; u = pass ? u->next : NULL)
            for (size_t i = 0; u->tenant == tenant && i < u->n_bkeys; i++)
                p[(*n)++] = (pending){u->bkeys[i], u->seq, u->blens[i]};
    pthread_mutex_unlock(&r->mu);
    if (*n) qsort(p, *n, sizeof *p, cmp_pending);
    return p;
}

/* Tests: true sends again the blocks an upload still queued carries (the
 * tier before it looked in its queue: the negative control of
 * remote_no_double_upload); kvt_remote_hold_uploads keeps the upload
 * thread from sending while it is true. */
bool kvt_remote_fault_resend_queued;
volatile bool kvt_remote_hold_uploads;

void kvt_remote_upload(kvt_remote *r, int tenant, kvt_session *s, size_t at)
{
    if (tenant < 0 || (size_t)tenant >= r->n_tenants || !at || !kvt_snap_can_save(s, at)) return;
    size_t nb = at / KVT_BLOCK, tail = at - nb * KVT_BLOCK;
    const uint64_t *keys = kvt_snap_keys(s, nb);
    if (nb && !keys) return;
    uint64_t head = nb ? keys[nb - 1] : r->key0;
    uint64_t th = kvt_snap_tail_hash(head, kvt_session_tokens(s) + nb * KVT_BLOCK, tail);
    upload *u = kvt_calloc(1, sizeof *u);
    if (!u) return;
    u->tenant = tenant;
    snprintf(u->index_key, sizeof u->index_key, "%si:%016" PRIx64, r->ns[tenant], head);
    snprintf(u->field, sizeof u->field, "%zu:%016" PRIx64, at, th);
    /* what Redis holds already: the index entry, each block (all its parts) */
    pthread_mutex_lock(&r->check_mu);
    kvt_redis *rd = r->rd_check;
    const char *hx[3] = {"HEXISTS", u->index_key, u->field};
    kvt_redis_append(rd, 3, hx, NULL);
    char name[200];
    for (size_t b = 0; b < nb; b++) {
        block_key(r, tenant, keys[b], name, sizeof name);
        char mac[210];
        mac_key(mac, sizeof mac, name);
        const char *a[3] = {"EXISTS", name, mac};
        kvt_redis_append(rd, r->secret_len ? 3 : 2, a, NULL);
    }
    redisReply **rep = NULL;
    size_t nr = 0;
    kvt_shards sh = {0};
    /* a shard whose breaker is open (or that fails now) holds some of what
     * the entry needs: not sent, as the index must never name a value
     * that is not stored */
    int rc = round_trip(r, rd, CHECK_MS, NULL, true, &sh, &rep, &nr);
    kvt_shards_free(&sh);
    pthread_mutex_unlock(&r->check_mu);
    if (rc || !all_replies(rep, nr) || error_reply(rep, nr)) {
        kvt_redis_replies_free(rep, nr);
        pthread_mutex_lock(&r->mu);
        r->st.dropped++;
        pthread_mutex_unlock(&r->mu);
        upload_free(u);
        return;
    }
    if (rep[0]->type == REDIS_REPLY_INTEGER && rep[0]->integer == 1) { /* stored already */
        kvt_redis_replies_free(rep, nr);
        upload_free(u);
        return;
    }
    /* encode the missing blocks, then the snapshot record: not those an
     * upload still queued carries (a save's two points, the prompt's end
     * and the reply's, share their blocks): this one is sent after it,
     * and dropped if it was not sent */
    size_t np = 0;
    pending *pend = kvt_remote_fault_resend_queued ? NULL : pending_blocks(r, tenant, &np);
    kvt_wbuf names = {0};
    size_t cap = nb + 1;
    u->lens = kvt_calloc(cap, sizeof *u->lens);
    u->bkeys = kvt_calloc(cap, sizeof *u->bkeys);
    u->blens = kvt_calloc(cap, sizeof *u->blens);
    bool ok = u->lens && u->bkeys && u->blens;
    kvt_wbuf_u32(&u->manifest, 0); /* placeholder dropped below: keeps the buffer non-empty */
    u->manifest.len = 0;
    for (size_t b = 0; ok && b < nb; b++) {
        bool have = rep[1 + b]->type == REDIS_REPLY_INTEGER && rep[1 + b]->integer == (r->secret_len ? 2 : 1);
        pending want = {keys[b], 0, 0}, *q = np && !have ? bsearch(&want, pend, np, sizeof *pend, cmp_pending) : NULL;
        if (q) { /* queued already: its length for the manifest, nothing to send */
            char num[32];
            snprintf(num, sizeof num, " %zu", q->len);
            kvt_wbuf_puts(&u->manifest, num);
            if (!u->dep || q->seq < u->dep) u->dep = q->seq;
            continue;
        }
        size_t before = u->vals.len;
        uint64_t k;
        ok = kvt_snap_block(s, (uint32_t)b, b ? keys[b - 1] : r->key0, &u->vals, &k) == KVT_OK && !u->vals.oom;
        size_t bl = u->vals.len - before;
        char num[32];
        snprintf(num, sizeof num, " %zu", bl);
        kvt_wbuf_puts(&u->manifest, num);
        if (have) { u->vals.len = before; continue; } /* only its length is needed, for the manifest */
        block_key(r, tenant, keys[b], name, sizeof name);
        kvt_wbuf_put(&names, name, strlen(name) + 1);
        u->lens[u->n_vals++] = bl;
        u->bkeys[u->n_bkeys] = keys[b];
        u->blens[u->n_bkeys++] = bl;
        if (u->vals.len >= kvt_remote_flush_bytes) {
            /* a long prefix is not held whole: its blocks go now, from this
             * thread, in pieces; the snapshot and its index entry follow them */
            pthread_mutex_lock(&r->check_mu);
            int sent = names.oom ? 0 : send_values(r, r->rd_check, (const char *)names.p, u->vals.p, u->lens,
                                                   u->n_vals, NULL, NULL, u->vals.len);
            pthread_mutex_unlock(&r->check_mu);
            if (sent != 1) { ok = false; break; }
            pthread_mutex_lock(&r->mu);
            r->st.bytes_written += u->vals.len;
            r->st.values_written += u->n_vals;
            pthread_mutex_unlock(&r->mu);
            u->vals.len = 0;
            u->n_vals = 0;
            u->n_bkeys = 0; /* stored now: not pending */
            names.len = 0;
        }
    }
    kvt_redis_replies_free(rep, nr);
    free(pend);
    size_t before = u->vals.len;
    ok = ok && kvt_snap_encode(s, at, 0, &u->vals, NULL) == KVT_OK && !u->vals.oom;
    if (ok) {
        size_t sl = u->vals.len - before;
        snprintf(name, sizeof name, "%ss:%016" PRIx64 ":%zu:%016" PRIx64, r->ns[tenant], head, at, th);
        kvt_wbuf_put(&names, name, strlen(name) + 1);
        u->lens[u->n_vals++] = sl;
        char num[32];
        snprintf(num, sizeof num, "%zu", sl);
        kvt_wbuf rest = u->manifest;
        u->manifest = (kvt_wbuf){0};
        kvt_wbuf_puts(&u->manifest, num);
        kvt_wbuf_put(&u->manifest, rest.p, rest.len);
        kvt_wbuf_free(&rest);
        u->keys = (char *)names.p;
        names.p = NULL;
        ok = !names.oom && !u->manifest.oom;
    }
    kvt_wbuf_free(&names);
    pthread_mutex_lock(&r->mu);
    if (ok && r->st.queue_bytes + u->vals.len <= r->o.queue_bytes && !r->stopping) {
        if (r->tail) r->tail->next = u;
        else r->head = u;
        r->tail = u;
        u->seq = ++r->seq;
        r->st.queue_len++;
        r->st.queue_bytes += u->vals.len;
        pthread_cond_broadcast(&r->cv);
        u = NULL;
    } else {
        r->st.dropped++;
    }
    pthread_mutex_unlock(&r->mu);
    upload_free(u);
}

/* MSET each of n values (keys NUL-separated, bytes back to back), then,
 * when idx is given, HSET idx[1..3]: one pipeline (Redis runs a
 * connection's commands in order, so a connection lost part way never
 * leaves an index entry before its values). 1 sent, 0 a transport failure
 * (reported to the breaker), -1 refused by Redis (OOM under noeviction, an
 * ACL without writes: reads may still work, so the breaker is left alone;
 * said once a minute). */
static int send_values(kvt_remote *r, kvt_redis *rd, const char *keys, const uint8_t *vals, const size_t *lens,
                       size_t n, const char *const *idx, const size_t *idx_len, size_t bytes)
{
    const char *k = keys;
    size_t off = 0;
    int rc = KVT_OK;
    for (size_t i = 0; i < n && !rc; i++) {
        rc = append_set(r, rd, k, vals + off, lens[i]);
        off += lens[i];
        k += strlen(k) + 1;
    }
    /* the index entry once its values are all stored (on a cluster they are
     * on other nodes, which do not wait for each other) */
    if (!rc && idx && !(rc = kvt_redis_barrier(rd))) rc = kvt_redis_append(rd, 4, idx, idx_len);
    /* the most an upload holds: its values and the pipeline formatted
     * from them (kvt_remote_stats.upload_peak_bytes) */
    size_t held = bytes + kvt_redis_queued(rd);
    pthread_mutex_lock(&r->mu);
    if (held > r->st.upload_peak_bytes) r->st.upload_peak_bytes = held;
    pthread_mutex_unlock(&r->mu);
    redisReply **rep = NULL;
    size_t nr = 0;
    int ms = 2000 + (int)(bytes / (50u << 10)); /* 2 s plus 50 MB/s */
    kvt_shards sh = {0};
    if (rc) kvt_redis_discard(rd);
    else rc = round_trip(r, rd, ms, NULL, false, &sh, &rep, &nr);
    kvt_shards_free(&sh);
    if (rc || !all_replies(rep, nr)) { /* a shard failed or is open: the index entry was not sent */
        kvt_redis_replies_free(rep, nr);
        return 0;
    }
    const char *refused = error_reply(rep, nr);
    if (refused) {
        double now = kvt_now();
        pthread_mutex_lock(&r->mu);
        bool say = !r->o.quiet && now - r->refused_logged >= 60;
        if (say) r->refused_logged = now;
        pthread_mutex_unlock(&r->mu);
        if (say) fprintf(stderr, "kvtier: remote tier %s refused an upload: %s\n", r->o.url, refused);
    }
    kvt_redis_replies_free(rep, nr);
    return refused ? -1 : 1;
}

/* Send one queued upload: its values, then its index entry. */
static bool send_upload(kvt_remote *r, upload *u)
{
    const char *a[4] = {"HSET", u->index_key, u->field, (const char *)u->manifest.p};
    size_t l[4] = {4, strlen(u->index_key), strlen(u->field), u->manifest.len};
    pthread_mutex_lock(&r->mu);
    /* an upload it counts on for blocks was not sent: its index entry would
     * name values Redis lacks (failures come in queue order, so one at or
     * after that upload may be it) */
    bool orphan = u->dep && r->failed_seq >= u->dep;
    pthread_mutex_unlock(&r->mu);
    bool ok = !orphan && send_values(r, r->rd_up, u->keys, u->vals.p, u->lens, u->n_vals, a, l, u->vals.len) == 1;
    pthread_mutex_lock(&r->mu);
    if (ok) { r->st.uploads++; r->st.bytes_written += u->vals.len; r->st.values_written += u->n_vals; }
    else { r->st.dropped++; r->failed_seq = u->seq; }
    pthread_mutex_unlock(&r->mu);
    return ok;
}

static void *upload_main(void *arg)
{
    kvt_remote *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        if (!r->head) {
            if (r->stopping) break;
            pthread_cond_wait(&r->cv, &r->mu);
            continue;
        }
        if (kvt_remote_hold_uploads && !r->stopping) { /* tests */
            pthread_mutex_unlock(&r->mu);
            struct timespec ts = {0, 2000000};
            nanosleep(&ts, NULL);
            pthread_mutex_lock(&r->mu);
            continue;
        }
        upload *u = r->head;
        r->head = u->next;
        if (!r->head) r->tail = NULL;
        r->sending = u;
        bool late = r->stopping && kvt_now() - r->stop_at > 1.0;
        pthread_mutex_unlock(&r->mu);
        bool tried = !late;
        if (tried) send_upload(r, u); /* counts itself, sent or dropped */
        pthread_mutex_lock(&r->mu);
        if (!tried) { r->st.dropped++; r->failed_seq = u->seq; } /* given up at shutdown */
        r->sending = NULL;
        r->st.queue_len--;
        r->st.queue_bytes -= u->vals.len;
        pthread_mutex_unlock(&r->mu);
        upload_free(u);
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* ---- lookups and loads ---- */

typedef struct cand {
    size_t n, nb;
    uint64_t head, tail;
    size_t *lens;                  /* nb + 1: the snapshot's, then each block's */
} cand;

static int cmp_cand(const void *a, const void *b)
{
    const cand *x = a, *y = b;
    return x->n < y->n ? 1 : x->n > y->n ? -1 : 0;
}

/* Parse "SNAPLEN BLOCKLEN..." with exactly nb + 1 numbers, each sane. */
static size_t *parse_manifest(const char *s, size_t len, size_t nb)
{
    size_t *out = kvt_calloc(nb + 1, sizeof *out), i = 0;
    if (!out) return NULL;
    const char *p = s, *end = s + len;
    while (p < end && i <= nb) {
        uint64_t v = 0;
        size_t dig = 0;
        while (p < end && *p >= '0' && *p <= '9' && dig < 12) { v = v * 10 + (uint64_t)(*p++ - '0'); dig++; }
        if (!dig || v == 0 || v > MAX_VALUE || (p < end && *p != ' ')) break;
        out[i++] = (size_t)v;
        if (p < end) p++;
    }
    if (i != nb + 1 || p != end) { free(out); return NULL; }
    return out;
}

/* The parts of a value of want bytes in its replies (its parts, then its
 * MAC), checked where they lie: each part's length, and the HMAC with a
 * secret. parts (n_parts(want) entries) receives them, pointing into the
 * replies. 1 good, 0 missing (a part or the MAC gone: evicted), -1
 * damaged. */
static int value_parts(kvt_remote *r, const char *key, size_t want, redisReply **rep, struct iovec *parts)
{
    size_t np = n_parts(want), off = 0;
    for (size_t p = 0; p < np; p++)
        if (rep[p]->type == REDIS_REPLY_NIL) return 0;
    if (r->secret_len && rep[np]->type == REDIS_REPLY_NIL) return 0;
    for (size_t p = 0; p < np; p++) {
        size_t l = want - off < PART ? want - off : PART;
        if (rep[p]->type != REDIS_REPLY_STRING || (size_t)rep[p]->len != l) return -1;
        parts[p] = (struct iovec){rep[p]->str, l};
        off += l;
    }
    if (r->secret_len && !kvt_remote_skip_mac) {
        uint8_t mac[MAC_LEN];
        mac_of_parts(r, key, parts, np, mac);
        redisReply *m = rep[np];
        if (m->type != REDIS_REPLY_STRING || m->len != MAC_LEN || CRYPTO_memcmp(mac, m->str, MAC_LEN)) return -1;
    }
    return 1;
}

/* Copy len bytes of the value parts[0..n) hold, from its offset from on, to dst. */
static void copy_range(const struct iovec *parts, size_t n, size_t from, uint8_t *dst, size_t len)
{
    size_t off = 0;
    for (size_t i = 0; i < n && len; i++) {
        size_t l = parts[i].iov_len;
        if (from < off + l) {
            size_t at = from - off, k = l - at < len ? l - at : len;
            memcpy(dst, (const uint8_t *)parts[i].iov_base + at, k);
            dst += k;
            from += k;
            len -= k;
        }
        off += l;
    }
}

/* A value joined from its replies (parts, then the MAC), checked as
 * value_parts checks it; 1 ok (*out malloc'ed), 0 missing, -1 damaged. */
static int assemble(kvt_remote *r, const char *key, size_t want, redisReply **rep, uint8_t **out)
{
    size_t np = n_parts(want);
    struct iovec *parts = kvt_calloc(np, sizeof *parts);
    *out = NULL;
    if (!parts) return 0;
    int a = value_parts(r, key, want, rep, parts);
    if (a == 1 && (*out = kvt_malloc(want ? want : 1))) copy_range(parts, np, 0, *out, want);
    else if (a == 1) a = 0;
    free(parts);
    return a;
}

/* ---- a restore, window by window ----
 *
 * A hit's blocks are fetched in windows of kvt_remote_window_bytes, in
 * order, each one pipelined round trip, and each window's values are
 * released before the next is fetched: a restore holds its snapshot record
 * and one window of values, never the entry whole beside the session
 * (--kv-ram-mb is the session's budget; an entry of a long prompt is
 * gigabytes). The loader reads each block through window_read: the rows
 * are copied from the replies' parts straight into the session's rows, the
 * one copy a restore needs. 8 MiB: a few blocks of a small model, one of a
 * large one (a block is never split: a window holds at least one), and
 * enough bytes in flight that a round trip's latency is a small part of
 * the window's transfer. */
size_t kvt_remote_window_bytes = 8u << 20;
bool kvt_remote_fault_one_trip;

enum { FAIL_NONE, FAIL_VALUES, FAIL_REACH };

/* One index entry's restore (try_cand). Values are numbered as the
 * manifest lists them: 0 the snapshot record, 1 + b block b. */
typedef struct restore {
    kvt_remote *r;
    kvt_redis *rd;
    const cand *c;
    const uint64_t *keys;          /* the prompt's chained keys: block b's is keys[b] */
    char (*names)[200];            /* [nv] each value's key */
    size_t nv;
    double deadline;
    downset *down;
    kvt_shards *sh;
    size_t *bytes;                 /* values read and checked (the stats) */
    redisReply **rep;              /* the window's replies: values [v0, v1) */
    size_t nr, v0, v1, win_bytes;  /* win_bytes: its values' bytes still in rep */
    size_t *first;                 /* [nv + 1]: value i's first reply in rep */
    struct iovec *parts;           /* a value's parts (parts_cap entries) */
    size_t parts_cap;
    redisReply *snap_rep;          /* the snapshot record: its reply when it is one part, */
    uint8_t *snap_copy;            /* or its parts joined */
    const uint8_t *rec;            /* NULL until it is held */
    size_t held, peak;             /* value bytes held now, and at most */
    bool *bad_v, *gone_v;          /* [nv] values that failed a check; values gone */
    bool checked;                  /* the window's blocks were checked by fetch (kvt_snap_block_check_parts) */
    int fail;                      /* FAIL_*: why the last fetch failed */
    bool shard_failed;             /* a shard failed (not only skipped) in a fetch */
} restore;

static void held_add(restore *rs, size_t n)
{
    rs->held += n;
    if (rs->held > rs->peak) rs->peak = rs->held;
}

/* The end of the window of blocks from value v on: the blocks whose bytes
 * fit in kvt_remote_window_bytes, at least one (every one left with
 * kvt_remote_fault_one_trip, the fetch all at once as the tier had it). */
static size_t window_end(const restore *rs, size_t v)
{
    size_t e = v, sum = 0;
    while (e < rs->nv && (e == v || kvt_remote_fault_one_trip || sum + rs->c->lens[e] <= kvt_remote_window_bytes))
        sum += rs->c->lens[e++];
    return e;
}

static struct iovec *parts_for(restore *rs, size_t np)
{
    if (np > rs->parts_cap) {
        struct iovec *p = realloc(rs->parts, np * sizeof *p);
        if (!p) return NULL;
        rs->parts = p;
        rs->parts_cap = np;
    }
    return rs->parts;
}

static void window_free(restore *rs)
{
    kvt_redis_replies_free(rs->rep, rs->nr);
    rs->rep = NULL;
    rs->nr = rs->v0 = rs->v1 = 0;
    rs->held -= rs->win_bytes;
    rs->win_bytes = 0;
}

static void snap_free(restore *rs)
{
    if (!rs->rec) return;
    if (rs->snap_rep) freeReplyObject(rs->snap_rep);
    free(rs->snap_copy);
    rs->snap_rep = NULL;
    rs->snap_copy = NULL;
    rs->rec = NULL;
    rs->held -= rs->c->lens[0];
}

/* Fetch values [v0, v1) in one round trip (the breakers, down[] and the
 * deadline as every round trip of the tier), then check each where it
 * lies: its parts' lengths, its MAC, and a block's record
 * (kvt_snap_block_check_parts) and key, the prompt's chained key at its
 * index. 1 every value good, its replies held in rs->rep; 0 a value gone
 * or damaged (every value of the window is checked: each that failed is
 * marked in gone_v or bad_v); -1 out of reach: a shard skipped, failed or
 * refusing (nothing marked: the entry is not at fault). */
static int fetch(restore *rs, size_t v0, size_t v1)
{
    kvt_remote *r = rs->r;
    size_t cmds = 0;
    rs->fail = FAIL_REACH;
    for (size_t i = v0; i < v1; i++) {
        size_t k = 0;
        rs->first[i] = cmds;
        if (append_get(r, rs->rd, rs->names[i], rs->c->lens[i], &k)) {
            kvt_redis_discard(rs->rd);
            return -1;
        }
        cmds += k;
    }
    int ms = (int)((rs->deadline - kvt_now()) * 1000);
    if (round_trip(r, rs->rd, ms > 1 ? ms : 1, rs->down, true, rs->sh, &rs->rep, &rs->nr)) return -1;
    bool failed = false;
    for (size_t i = 0; i < rs->sh->cap; i++) {
        failed |= rs->sh->failed[i];
        if (rs->sh->failed[i] || rs->sh->refused[i]) mark_down(rs->down, i);
    }
    rs->shard_failed |= failed;
    if (failed && (strstr(rs->sh->why, "timed out") || kvt_now() >= rs->deadline)) { /* slower than the prefill it saves */
        pthread_mutex_lock(&r->mu);
        r->st.abandoned++;
        pthread_mutex_unlock(&r->mu);
    }
    if (rs->nr != cmds || !all_replies(rs->rep, rs->nr) || error_reply(rs->rep, rs->nr)) {
        window_free(rs);
        return -1;
    }
    rs->v0 = v0;
    rs->v1 = v1;
    for (size_t i = v0; i < v1; i++) rs->win_bytes += rs->c->lens[i];
    held_add(rs, rs->win_bytes);
    bool ok = true;
    /* the blocks' one check: window_read tells the loader so, and it does
     * not hash them again (kvt_remote_fault_skip_block_check: the check
     * skipped, the blocks still said checked, the negative control) */
    bool check = !kvt_remote_skip_value_checks && !kvt_remote_fault_skip_block_check;
    rs->checked = !kvt_remote_skip_value_checks;
    for (size_t i = v0; i < v1; i++) {
        size_t len = rs->c->lens[i], np = n_parts(len);
        struct iovec *parts = parts_for(rs, np);
        if (!parts) return -1;
        int a = value_parts(r, rs->names[i], len, rs->rep + rs->first[i], parts);
        if (a == 0) rs->gone_v[i] = true; /* what is left of it (parts, MAC) goes, so an upload sends it whole */
        if (a < 0) rs->bad_v[i] = true;
        if (a > 0) *rs->bytes += len;
        uint64_t k = 0;
        if (a > 0 && i > 0 && check && (kvt_snap_block_check_parts(parts, np, len, &k) || k != rs->keys[i - 1]))
            rs->bad_v[i] = true;
        ok &= a > 0 && !rs->bad_v[i];
    }
    rs->fail = ok ? FAIL_NONE : FAIL_VALUES;
    return ok ? 1 : 0;
}

/* kvt_block_read_fn of a restore: block b from the window held, the next
 * window fetched (and the one before released) when b is past it; the
 * loader asks for the blocks in order. The record's rows are copied from
 * the replies' parts straight into the session's rows, the rest of it
 * into buf. Block b's record was checked whole by fetch, where it lies in
 * the replies these bytes are copied from (not read from Redis again):
 * *checked, and the loader does not hash it a second time. */
static int window_read(void *user, uint32_t b, uint64_t key, const kvt_block_rows *rows, uint8_t **buf,
                       size_t *cap, size_t *len, bool *in_place, bool *checked)
{
    restore *rs = user;
    size_t v = 1 + (size_t)b;
    (void)key; /* the record's chain: the loader checks the block against it */
    *in_place = false;
    *checked = false;
    if (v >= rs->nv) return kvt_fail(KVT_ECORRUPT, "remote block %u of %zu", b, rs->nv - 1);
    if (v < rs->v0 || v >= rs->v1) {
        window_free(rs);
        int f = fetch(rs, v, window_end(rs, v));
        if (f < 1)
            return kvt_fail(f < 0 ? KVT_EIO : KVT_ECORRUPT, "remote blocks from %u (%s): %s", b, rs->names[v],
                            f < 0 ? "out of reach" : "a value gone or damaged");
    }
    size_t l = rs->c->lens[v], np = n_parts(l);
    struct iovec *parts = parts_for(rs, np);
    if (!parts) return kvt_fail(KVT_ENOMEM, "remote block %u", b);
    redisReply **rep = rs->rep + rs->first[v];
    for (size_t p = 0; p < np; p++) parts[p] = (struct iovec){rep[p]->str, (size_t)rep[p]->len};
    bool place = rows && l >= rows->bytes + 8;
    size_t want = place ? l - rows->bytes : l;
    if (want > *cap) {
        uint8_t *nb = realloc(*buf, want);
        if (!nb) return kvt_fail(KVT_ENOMEM, "remote block %u: %zu bytes", b, want);
        *buf = nb;
        *cap = want;
    }
    if (place) { /* the bytes before the rows, the rows, the checksum */
        size_t head = l - 8 - rows->bytes, off = head;
        copy_range(parts, np, 0, *buf, head);
        for (int k = 0; k < rows->n; k++) {
            copy_range(parts, np, off, rows->iov[k].iov_base, rows->iov[k].iov_len);
            off += rows->iov[k].iov_len;
        }
        copy_range(parts, np, off, *buf + head, 8);
    } else {
        copy_range(parts, np, 0, *buf, l);
    }
    *len = l;
    *in_place = place;
    *checked = rs->checked;
    return KVT_OK;
}

/* Try one index entry: 1 restored, 0 not (s untouched), -1 not and s
 * emptied by a load that failed, 2 not tried: a value of it is on a
 * shard down[] names (its breaker open, or failed in this lookup), or on
 * one that fails now (added to down[]).
 *
 * The snapshot record and the first window of blocks come in one round
 * trip and are checked before the load starts, so a value gone or damaged
 * there leaves s untouched (the next entry may serve); the record is then
 * the loader's, and each further window is fetched as the loader reaches
 * it: a value that fails there, or a window out of reach, leaves s
 * emptied (-1: the caller prefills). */
static int try_cand(kvt_remote *r, int t, kvt_session *s, const int32_t *toks, const uint64_t *keys, cand *c,
                    double deadline, downset *down, size_t *bytes)
{
    kvt_redis *rd = r->rd_load;
    kvt_shards sh = {0};
    size_t nv = c->nb + 1;
    restore rs = {.r = r, .rd = rd, .c = c, .keys = keys, .nv = nv, .deadline = deadline, .down = down, .sh = &sh,
                  .bytes = bytes};
    rs.names = kvt_calloc(nv, sizeof *rs.names);
    rs.first = kvt_calloc(nv + 1, sizeof *rs.first);
    rs.bad_v = kvt_calloc(nv, sizeof *rs.bad_v);
    rs.gone_v = kvt_calloc(nv, sizeof *rs.gone_v);
    int state = 0;
    if (!rs.names || !rs.first || !rs.bad_v || !rs.gone_v) goto out;
    snprintf(rs.names[0], sizeof rs.names[0], "%ss:%016" PRIx64 ":%zu:%016" PRIx64, r->ns[t], c->head, c->n, c->tail);
    for (size_t b = 0; b < c->nb; b++) block_key(r, t, keys[b], rs.names[1 + b], sizeof rs.names[1 + b]);
    for (size_t i = 0; i < nv && state == 0; i++) {
        int k = kvt_redis_shard_of(rd, rs.names[i], strlen(rs.names[i]));
        if (k >= 0 && is_down(down, (size_t)k)) state = 2;
    }
    if (state) goto out;
    int f = fetch(&rs, 0, window_end(&rs, 1));
    if (f < 0) { /* not gone: out of reach, the entry stays */
        if (!rs.shard_failed) state = 2; /* a shard this lookup had not seen down: another entry may do */
        goto out;
    }
    /* the record whole (its reply, or its parts joined, each freed once
     * copied) and checked, even when a block of the window failed: a
     * damaged record is named and deleted with them */
    if (!rs.gone_v[0] && !rs.bad_v[0]) {
        size_t np = n_parts(c->lens[0]);
        redisReply **sr = rs.rep + rs.first[0];
        if (np == 1) {
            rs.snap_rep = sr[0];
            sr[0] = NULL;
            rs.rec = (const uint8_t *)rs.snap_rep->str;
        } else {
            if (!(rs.snap_copy = kvt_malloc(c->lens[0]))) goto out;
            if (rs.held + PART > rs.peak) rs.peak = rs.held + PART; /* a part beside the record while joined */
            for (size_t p = 0, off = 0; p < np; p++) {
                memcpy(rs.snap_copy + off, sr[p]->str, sr[p]->len);
                off += sr[p]->len;
                freeReplyObject(sr[p]);
                sr[p] = NULL;
            }
            rs.rec = rs.snap_copy;
        }
        rs.win_bytes -= c->lens[0]; /* held as the record now, past the windows */
        kvt_snap_info in;
        if (!kvt_remote_skip_value_checks &&
            (kvt_snap_parse(r->m, rs.rec, c->lens[0], &in) || in.n != c->n || in.head != c->head))
            rs.bad_v[0] = true;
    }
    if (f > 0 && !rs.bad_v[0]) {
        bool rebuild = false;
        uint32_t bad_block = UINT32_MAX;
        uint64_t bad_key = 0;
        int rc = kvt_snap_load_read_start(s, rs.rec, c->lens[0], window_read, false, &rs, &rebuild, &bad_block,
                                          &bad_key);
        window_free(&rs);
        snap_free(&rs); /* before a replay, which needs neither */
        if (!rc) rc = kvt_snap_load_finish(s, rebuild);
        if (rc) {
            /* a value a window found gone or damaged is marked already;
             * a window out of reach, or memory, is not the entry's fault;
             * anything else is the loader refusing what the record says */
            state = -1;
            if (rs.fail == FAIL_NONE && rc != KVT_ENOMEM && rc != KVT_ECTX) rs.bad_v[0] = true;
        } else if (kvt_session_len(s) != c->n || memcmp(kvt_session_tokens(s), toks, c->n * sizeof *toks)) {
            kvt_snap_empty(s);
            rs.bad_v[0] = true;
            state = -1;
        } else {
            state = 1;
        }
    }
    bool missing = false, bad = false;
    size_t nbad = 0;
    for (size_t i = 0; i < nv; i++) {
        missing |= rs.gone_v[i];
        bad |= rs.bad_v[i];
        nbad += rs.bad_v[i];
    }
    if (missing || bad) { /* the entry cannot serve: drop it, and the values that failed */
        char idx[160], field[64];
        snprintf(idx, sizeof idx, "%si:%016" PRIx64, r->ns[t], c->head);
        snprintf(field, sizeof field, "%zu:%016" PRIx64, c->n, c->tail);
        const char *a[3] = {"HDEL", idx, field};
        kvt_redis_append(rd, 3, a, NULL);
        for (size_t i = 0; i < nv; i++)
            if (rs.bad_v[i] || rs.gone_v[i]) append_del(r, rd, rs.names[i], c->lens[i]);
        redisReply **rep = NULL;
        size_t nr = 0;
        if (round_trip(r, rd, r->o.lookup_ms, down, true, &sh, &rep, &nr) == KVT_OK) kvt_redis_replies_free(rep, nr);
        pthread_mutex_lock(&r->mu);
        r->st.bad += nbad;
        if (missing && !bad) r->st.stale++;
        pthread_mutex_unlock(&r->mu);
        if (bad && !r->o.quiet)
            fprintf(stderr, "kvtier: remote tier: %zu value(s) of a %zu-token entry failed their checks: deleted\n",
                    nbad, c->n);
    }
out:
    window_free(&rs);
    snap_free(&rs);
    pthread_mutex_lock(&r->mu);
    if (rs.peak > r->st.load_peak_bytes) r->st.load_peak_bytes = rs.peak;
    pthread_mutex_unlock(&r->mu);
    kvt_shards_free(&sh);
    free(rs.parts);
    free(rs.names);
    free(rs.first);
    free(rs.bad_v);
    free(rs.gone_v);
    return state;
}

void kvt_remote_restore(kvt_remote *r, int tenant, kvt_session *s, const int32_t *toks, size_t n, size_t have,
                        size_t *got)
{
    *got = 0;
    if (tenant < 0 || (size_t)tenant >= r->n_tenants || n <= have) return;
    double t0 = kvt_now(), t_lookup = 0;
    bool asked = false, hit = false;
    size_t nbp = n / KVT_BLOCK, nb0 = have / KVT_BLOCK, bytes = 0;
    uint64_t *keys = kvt_calloc(nbp + 1, sizeof *keys);
    cand *cs = NULL;
    size_t nc = 0, cc = 0;
    redisReply **rep = NULL;
    size_t nr = 0;
    downset down = {0};
    kvt_shards sh = {0};
    if (!keys) goto out;
    pthread_mutex_lock(&r->load_mu);
    for (size_t b = 0; b < nbp; b++) keys[b] = kvt_snap_key_next(b ? keys[b - 1] : r->key0, toks + b * KVT_BLOCK);
    kvt_redis *rd = r->rd_load;
    char idx[160];
    for (size_t nb = nb0; nb <= nbp; nb++) {
        snprintf(idx, sizeof idx, "%si:%016" PRIx64, r->ns[tenant], nb ? keys[nb - 1] : r->key0);
        const char *a[2] = {"HGETALL", idx};
        if (kvt_redis_append(rd, 2, a, NULL)) {
            kvt_redis_discard(rd);
            goto out_locked;
        }
    }
    /* the index of every boundary at once: the shards whose breakers are
     * open are not asked, and those and the ones that fail now hold no
     * entry for this lookup; the others' entries stand */
    int rc = round_trip(r, rd, r->o.lookup_ms, NULL, true, &sh, &rep, &nr);
    t_lookup = kvt_now() - t0;
    if (rc) goto out_locked;
    for (size_t i = 0; i < sh.cap; i++) {
        asked |= sh.asked[i];
        if (sh.skip[i] || sh.failed[i] || sh.refused[i]) mark_down(&down, i);
    }
    for (size_t i = 0; i < nr; i++) {
        size_t nb = nb0 + i;
        uint64_t head = nb ? keys[nb - 1] : r->key0;
        redisReply *x = rep[i];
        if (!x || x->type != REDIS_REPLY_ARRAY) continue;
        for (size_t e = 0; e + 1 < x->elements; e += 2) {
            redisReply *f = x->element[e], *v = x->element[e + 1];
            if (f->type != REDIS_REPLY_STRING || v->type != REDIS_REPLY_STRING || f->len > 40) continue;
            char fs[48];
            memcpy(fs, f->str, f->len);
            fs[f->len] = 0;
            unsigned long long len_n, th;
            int used = 0;
            if (sscanf(fs, "%llu:%16llx%n", &len_n, &th, &used) != 2 || (size_t)used != f->len) continue;
            if (len_n <= have || len_n > n || len_n / KVT_BLOCK != nb) continue;
            size_t tail = (size_t)len_n - nb * KVT_BLOCK;
            if (kvt_snap_tail_hash(head, toks + nb * KVT_BLOCK, tail) != th) continue;
            size_t *lens = parse_manifest(v->str, v->len, nb);
            if (!lens) continue;
            int grc = KVT_OK;
            KVT_GROW(cs, &cc, nc + 1, grc);
            if (grc) { free(lens); continue; }
            cs[nc++] = (cand){(size_t)len_n, nb, head, th, lens};
        }
    }
    if (nc) qsort(cs, nc, sizeof *cs, cmp_cand);
    if (nc && kvt_remote_before_load) kvt_remote_before_load(kvt_remote_before_load_arg);
    /* each entry's load ends by the time a prefill of the tokens it saves
     * would take, counted from the lookup's start: a slow remote is
     * abandoned before it costs more than the prefill (a fixed load_ms
     * counts from the lookup's end) */
    for (size_t i = 0, tries = 0; i < nc && tries < MAX_TRIES && !hit; i++) {
        bool fixed = r->o.load_ms || kvt_remote_fault_fixed_deadline;
        double deadline = (fixed ? t0 + t_lookup : t0) + kvt_remote_load_deadline(r, have, cs[i].n);
        if (kvt_now() >= deadline) { /* a shorter entry's deadline is earlier still */
            pthread_mutex_lock(&r->mu);
            r->st.abandoned++;
            pthread_mutex_unlock(&r->mu);
            break;
        }
        int st = try_cand(r, tenant, s, toks, keys, &cs[i], deadline, &down, &bytes);
        if (st != 2) tries++; /* an entry out of reach costs no round trip */
        if (st == 1) { hit = true; *got = cs[i].n; }
        if (st == -1) break; /* s was emptied: the caller restores it anew */
    }
out_locked:
    pthread_mutex_unlock(&r->load_mu);
out:
    kvt_shards_free(&sh);
    free(down.v);
    kvt_redis_replies_free(rep, nr);
    for (size_t i = 0; i < nc; i++) free(cs[i].lens);
    free(cs);
    free(keys);
    double dt = kvt_now() - t0;
    pthread_mutex_lock(&r->mu);
    if (hit) { r->st.hits++; r->st.hit_tokens += *got; r->st.load_seconds += dt - t_lookup; }
    else r->st.misses++;
    r->st.bytes_read += bytes;
    if (asked) r->st.lookup_seconds += t_lookup ? t_lookup : dt;
    pthread_mutex_unlock(&r->mu);
}

/* ---- listing ---- */

/* The entries of one index hash (key "NS:i:HEAD") appended to *out. */
static int list_hash(const char *key, const redisReply *x, kvt_remote_entry **out, size_t *n, size_t *cap)
{
    const char *i = strstr(key, ":i:");
    if (!i || x->type != REDIS_REPLY_ARRAY) return KVT_OK;
    kvt_remote_entry e = {0};
    snprintf(e.ns, sizeof e.ns, "%.*s", (int)(i - key), key);
    e.head = strtoull(i + 3, NULL, 16);
    for (size_t k = 0; k + 1 < x->elements; k += 2) {
        const redisReply *f = x->element[k], *v = x->element[k + 1];
        if (f->type != REDIS_REPLY_STRING || v->type != REDIS_REPLY_STRING) continue;
        e.n_tokens = (uint32_t)strtoul(f->str, NULL, 10);
        e.n_blocks = e.n_tokens / KVT_BLOCK;
        size_t *lens = parse_manifest(v->str, v->len, e.n_blocks);
        e.bytes = 0;
        for (size_t b = 0; lens && b <= e.n_blocks; b++) e.bytes += lens[b];
        free(lens);
        int rc = KVT_OK;
        KVT_GROW(*out, cap, *n + 1, rc);
        if (rc) return rc;
        (*out)[(*n)++] = e;
    }
    return KVT_OK;
}

int kvt_remote_list(const kvt_remote_opts *o, kvt_remote_entry **out, size_t *n)
{
    *out = NULL;
    *n = 0;
    const char *url = o->url, *password_file = o->password_file;
    kvt_redis_url u;
    int rc = kvt_redis_parse_url(url, &u);
    if (rc) return rc;
    u.ca = o->tls_ca;
    u.cert = o->tls_cert;
    u.key = o->tls_key;
    char pw[1024];
    size_t pl = 0;
    if (password_file && (rc = read_secret(password_file, "--kv-remote-password-file", pw, sizeof pw, &pl, false)))
        return rc;
    kvt_redis *rd = NULL;
    rc = kvt_redis_new(&rd, &u, pl ? pw : NULL);
    OPENSSL_cleanse(pw, sizeof pw);
    if (rc) return rc;
    size_t cap = 0;
    char cursor[32] = "0";
    do {
        const char *a[6] = {"SCAN", cursor, "MATCH", LAYOUT "*:i:*", "COUNT", "1000"};
        redisReply **rep = NULL, **hr = NULL;
        size_t nr = 0, nh = 0;
        if ((rc = kvt_redis_append(rd, 6, a, NULL)) || (rc = kvt_redis_exec(rd, 2000, &rep, &nr))) break;
        redisReply *x = rep[0];
        if (x->type == REDIS_REPLY_ERROR) rc = kvt_fail(KVT_EIO, "redis %s: SCAN refused: %s", url, x->str);
        else if (x->type != REDIS_REPLY_ARRAY || x->elements != 2 || x->element[0]->type != REDIS_REPLY_STRING ||
                 x->element[1]->type != REDIS_REPLY_ARRAY)
            rc = kvt_fail(KVT_EIO, "redis %s: a SCAN reply of an unknown shape", url);
        if (!rc) {
            snprintf(cursor, sizeof cursor, "%s", x->element[0]->str);
            redisReply *keys = x->element[1];
            for (size_t k = 0; !rc && k < keys->elements; k++) {
                const char *h[2] = {"HGETALL", keys->element[k]->str};
                rc = kvt_redis_append(rd, 2, h, NULL);
            }
            if (!rc && keys->elements) rc = kvt_redis_exec(rd, 2000, &hr, &nh);
            for (size_t k = 0; !rc && k < nh && k < keys->elements; k++)
                rc = list_hash(keys->element[k]->str, hr[k], out, n, &cap);
        }
        kvt_redis_replies_free(hr, nh);
        kvt_redis_replies_free(rep, nr);
    } while (!rc && strcmp(cursor, "0"));
    kvt_redis_free(rd);
    if (rc) {
        free(*out);
        *out = NULL;
        *n = 0;
    }
    return rc;
}

/* ---- verifying what a remote holds ---- */

typedef struct verify_src {
    kvt_remote *r;
    const char *ns;                /* "kvt:r2:KEY0:TENANT:" */
    const size_t *lens;            /* the manifest: snapshot, then each block */
    uint8_t *cur;                  /* the block the load is reading (freed at the next) */
    int64_t bad_block, gone_block; /* -1: none */
} verify_src;

/* Read one value (its parts and MAC) within 2 s: 1 read (*out), 0 gone,
 * -1 damaged (its length or MAC), -2 a transport failure. */
static int read_value(kvt_remote *r, const char *key, size_t len, uint8_t **out)
{
    size_t k = 0;
    redisReply **rep = NULL;
    size_t nr = 0;
    *out = NULL;
    if (append_get(r, r->rd_check, key, len, &k)) { kvt_redis_discard(r->rd_check); return -2; }
    if (kvt_redis_exec(r->rd_check, 2000, &rep, &nr) || nr != k || error_reply(rep, nr)) {
        kvt_redis_replies_free(rep, nr);
        return -2;
    }
    int a = assemble(r, key, len, rep, out);
    kvt_redis_replies_free(rep, nr);
    return a;
}

static int verify_block(void *user, uint32_t b, uint64_t key, const uint8_t **p, size_t *len)
{
    verify_src *v = user;
    free(v->cur);
    v->cur = NULL;
    char name[200];
    snprintf(name, sizeof name, "%sb:%016" PRIx64, v->ns, key);
    int a = read_value(v->r, name, v->lens[1 + b], &v->cur);
    if (a == 0) v->gone_block = b;
    if (a == -1) v->bad_block = b;
    if (a < 1) return kvt_fail(a == -2 ? KVT_EIO : KVT_ECORRUPT, "block %u (%s): %s", b, name,
                               a == 0 ? "gone" : a == -1 ? "its length or MAC" : "not read");
    uint64_t k = 0;
    if (kvt_snap_block_check(v->cur, v->lens[1 + b], &k) || k != key) {
        v->bad_block = b;
        return kvt_fail(KVT_ECORRUPT, "block %u (%s): its checksum or key", b, name);
    }
    *p = v->cur;
    *len = v->lens[1 + b];
    return KVT_OK;
}

/* Check one index entry (NS, HEAD, field "N:TAIL", manifest) as a hit
 * would be checked: its snapshot record (MAC, header, fingerprints, row
 * types, checksums, that it stands on HEAD), then each block as the load
 * reads it (MAC, checksum, its key in the record's chain), the load's own
 * checks, and the restored ids hashed back to HEAD and TAIL. *why names
 * the failure; the values that failed are deleted with del. 1 good, 0 gone
 * (evicted), -1 bad, -2 a transport failure. */
static int verify_entry(kvt_remote *r, const char *ns, uint64_t head, const char *field, const char *man, size_t man_len,
                        bool del, char *why, size_t wcap)
{
    unsigned long long n_ll = 0, th = 0;
    int used = 0;
    *why = 0;
    if (sscanf(field, "%llu:%16llx%n", &n_ll, &th, &used) != 2 || (size_t)used != strlen(field) || n_ll > (1u << 30)) {
        snprintf(why, wcap, "an index field of an unknown shape");
        return -1;
    }
    size_t n = (size_t)n_ll, nb = n / KVT_BLOCK;
    size_t *lens = parse_manifest(man, man_len, nb);
    char snap[200];
    snprintf(snap, sizeof snap, "%ss:%016" PRIx64 ":%zu:%016llx", ns, head, n, th);
    verify_src v = {r, ns, lens, NULL, -1, -1};
    uint8_t *rec = NULL;
    kvt_session *s = NULL;
    kvt_snap_info in;
    memset(&in, 0, sizeof in);
    int res = -1;
    bool bad_snap = false;
    if (!lens) { snprintf(why, wcap, "a manifest of an unknown shape"); goto done; }
    int a = read_value(r, snap, lens[0], &rec);
    if (a == -2) { snprintf(why, wcap, "%s", kvt_errmsg()); res = -2; goto done; }
    if (a == 0) { snprintf(why, wcap, "its snapshot record is gone (evicted)"); res = 0; goto done; }
    if (a < 0 || kvt_snap_parse(r->m, rec, lens[0], &in) || in.n != n || in.head != head) {
        snprintf(why, wcap, "its snapshot record: %s", a < 0 ? "its length or MAC" : kvt_errmsg());
        bad_snap = true;
        goto done;
    }
    kvt_session_opts so = {.n_ctx = (uint32_t)(n + 1)};
    if (kvt_session_new(&s, r->m, &so)) { snprintf(why, wcap, "a session: %s", kvt_errmsg()); res = -2; goto done; }
    int rc = kvt_snap_load(s, rec, lens[0], verify_block, &v);
    if (rc && v.gone_block >= 0) {
        snprintf(why, wcap, "block %lld is gone (evicted)", (long long)v.gone_block);
        res = 0;
        goto done;
    }
    if (rc == KVT_EIO) { snprintf(why, wcap, "%s", kvt_errmsg()); res = -2; goto done; }
    if (rc) {
        snprintf(why, wcap, "%s", kvt_errmsg());
        bad_snap = v.bad_block < 0;
        goto done;
    }
    /* the ids restored are the ones the index names: their chain ends at
     * HEAD, their tail hashes to TAIL */
    const int32_t *ids = kvt_session_tokens(s);
    uint64_t k = r->key0;
    for (size_t b = 0; b < nb; b++) k = kvt_snap_key_next(k, ids + b * KVT_BLOCK);
    if (kvt_session_len(s) != n || k != head || kvt_snap_tail_hash(head, ids + nb * KVT_BLOCK, n - nb * KVT_BLOCK) != th) {
        snprintf(why, wcap, "the ids restored are not the ones its keys name");
        bad_snap = true;
        goto done;
    }
    res = 1;
done:
    if (res < 1 && res != -2 && del) { /* as a hit does: the entry, and the values that failed */
        char idx[160];
        snprintf(idx, sizeof idx, "%si:%016" PRIx64, ns, head);
        const char *d[3] = {"HDEL", idx, field};
        kvt_redis_append(r->rd_check, 3, d, NULL);
        if (bad_snap || (res == 0 && v.gone_block < 0)) append_del(r, r->rd_check, snap, lens ? lens[0] : 1);
        if (v.bad_block >= 0 || v.gone_block >= 0) {
            char name[200];
            const uint8_t *keys = in.sec[6]; /* the block keys: the record parsed before any block was read */
            int64_t b = v.bad_block >= 0 ? v.bad_block : v.gone_block;
            if (keys && (size_t)b < nb) {
                snprintf(name, sizeof name, "%sb:%016" PRIx64, ns, kvt_rd64(keys + 8 * (size_t)b));
                append_del(r, r->rd_check, name, lens[1 + b]);
            }
        }
        redisReply **rep = NULL;
        size_t nr = 0;
        if (kvt_redis_exec(r->rd_check, 2000, &rep, &nr) == KVT_OK) kvt_redis_replies_free(rep, nr);
    }
    kvt_session_free(s);
    free(v.cur);
    free(rec);
    free(lens);
    return res;
}

int kvt_remote_verify(kvt_remote *r, bool del, kvt_remote_verify_fn each, void *user, kvt_remote_verify_stats *out)
{
    memset(out, 0, sizeof *out);
    char pattern[96];
    snprintf(pattern, sizeof pattern, LAYOUT "%016" PRIx64 ":*:i:*", r->key0);
    char cursor[32] = "0";
    int rc = KVT_OK;
    pthread_mutex_lock(&r->check_mu);
    do {
        const char *a[6] = {"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"};
        redisReply **rep = NULL;
        size_t nr = 0;
        if ((rc = kvt_redis_append(r->rd_check, 6, a, NULL)) || (rc = kvt_redis_exec(r->rd_check, 2000, &rep, &nr)))
            break;
        redisReply *x = rep[0];
        if (x->type == REDIS_REPLY_ERROR) rc = kvt_fail(KVT_EIO, "redis %s: SCAN refused: %s", r->o.url, x->str);
        else if (x->type != REDIS_REPLY_ARRAY || x->elements != 2 || x->element[0]->type != REDIS_REPLY_STRING ||
                 x->element[1]->type != REDIS_REPLY_ARRAY)
            rc = kvt_fail(KVT_EIO, "redis %s: a SCAN reply of an unknown shape", r->o.url);
        if (!rc) snprintf(cursor, sizeof cursor, "%s", x->element[0]->str);
        for (size_t k = 0; !rc && k < x->element[1]->elements; k++) {
            const char *key = x->element[1]->element[k]->str, *i = strstr(key, ":i:");
            if (!i || (size_t)(i - key) + 1 > 95) continue;
            char ns[96];
            snprintf(ns, sizeof ns, "%.*s:", (int)(i - key), key);
            uint64_t head = strtoull(i + 3, NULL, 16);
            const char *h[2] = {"HGETALL", key};
            redisReply **hr = NULL;
            size_t nh = 0;
            if ((rc = kvt_redis_append(r->rd_check, 2, h, NULL)) || (rc = kvt_redis_exec(r->rd_check, 2000, &hr, &nh)))
                break;
            redisReply *y = hr[0];
            for (size_t e = 0; y->type == REDIS_REPLY_ARRAY && e + 1 < y->elements; e += 2) {
                redisReply *f = y->element[e], *m = y->element[e + 1];
                if (f->type != REDIS_REPLY_STRING || m->type != REDIS_REPLY_STRING || f->len > 40) continue;
                char field[48], why[256];
                snprintf(field, sizeof field, "%.*s", (int)f->len, f->str);
                int res = verify_entry(r, ns, head, field, m->str, m->len, del, why, sizeof why);
                if (res == -2) { rc = kvt_fail(KVT_EIO, "redis %s: %s", r->o.url, why); break; }
                out->entries++;
                if (res == 1) out->good++;
                else if (res == 0) out->gone++;
                else out->bad++;
                if (each) each(user, ns, head, (size_t)strtoull(field, NULL, 10), res == 1 ? NULL : why);
            }
            kvt_redis_replies_free(hr, nh);
        }
        kvt_redis_replies_free(rep, nr);
    } while (!rc && strcmp(cursor, "0"));
    pthread_mutex_unlock(&r->check_mu);
    return rc;
}
