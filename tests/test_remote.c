/* The remote tier (src/store/remote.c, src/store/redis.c) against a real
 * redis-server each test starts on a free port: a second session with
 * nothing local hits what the first uploaded, bit for bit; damaged, swapped,
 * truncated, foreign and cross-tenant values are misses, deleted; a
 * consistent planted block is refused by the HMAC (and loads without it: the
 * negative control); a stopped Redis costs a lookup its deadline and opens
 * the breaker, which recovers; a wrong password is a miss with a reason; a
 * tiny maxmemory with allkeys-lru gives shorter hits, never errors; a hit
 * read in windows holds at most its snapshot record and a window of values
 * (the whole entry when fetched in one round trip: the negative control),
 * and a block damaged or gone in a later window leaves the session empty,
 * a miss, the entry deleted. */
#include "test.h"
#include "fixture.h"
#include "ds4_tiny.h"
#include "redis_fx.h"
#include "store/redis.h"
#include "store/remote.h"
#include "session/snapshot.h"
#include "base/util.h"
#include "arch/model.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

typedef rfx rsrv; /* tests/redis_fx.h */

static kvt_redis *raw(const rsrv *r, const char *password)
{
    kvt_redis_url u;
    kvt_redis *c = NULL;
    if (kvt_redis_parse_url(r->url, &u) || kvt_redis_new(&c, &u, password)) return NULL;
    return c;
}

/* One command and its reply (the caller frees); NULL on a transport failure. */
static redisReply *cmd(kvt_redis *c, int argc, const char *const *argv, const size_t *lens)
{
    redisReply **rep = NULL;
    size_t n = 0;
    if (kvt_redis_append(c, argc, argv, lens) || kvt_redis_exec(c, 2000, &rep, &n) || n != 1) return NULL;
    redisReply *x = rep[0];
    free(rep);
    return x;
}

static bool cmd_ok(kvt_redis *c, const char *a0, const char *a1, const char *a2)
{
    const char *a[3] = {a0, a1, a2};
    redisReply *x = cmd(c, a2 ? 3 : a1 ? 2 : 1, a, NULL);
    bool ok = x && x->type != REDIS_REPLY_ERROR;
    if (x) freeReplyObject(x);
    return ok;
}

/* redis-server on a free port, no persistence, extra args appended;
 * port_again: the port of a Redis that was killed, to start anew on it. */
static bool redis_start_on(rsrv *r, const char *const *extra, int port_again)
{
    return rfx_start(r, port_again, extra, false, NULL);
}
static bool redis_start(rsrv *r, const char *const *extra) { return redis_start_on(r, extra, 0); }
static void redis_stop(rsrv *r) { rfx_stop(r); }

/* A test on a redis-server of its own (extra: its arguments, NULL-terminated
 * array or NULL), stopped whatever the body's checks say. */
#define REDIS_TEST(name, extra)                                             \
    TEST(name)                                                              \
    {                                                                       \
        const char *why_ = rfx_absent();                                    \
        if (why_) SKIP("%s", why_);                                         \
        rsrv r_;                                                            \
        CHECKF(redis_start(&r_, extra), "redis-server did not start");      \
        name##_body(&r_);                                                   \
        redis_stop(&r_);                                                    \
    }

static bool write_file(const char *path, const char *text)
{
    return fx_write_file(path, text, strlen(text));
}

/* A tier on r for model m, the tests' deadlines (generous: a loaded CI
 * machine must not turn a hit into a timeout). */
static kvt_remote *tier(const rsrv *r, kvt_model *m, const char *secret_file, const char *const *tenants,
                        size_t n_tenants)
{
    kvt_remote_opts o = {.url = r->url, .secret_file = secret_file, .tenants = tenants, .n_tenants = n_tenants,
                         .keyed_tenants = tenants != NULL, .lookup_ms = 1000, .load_ms = 2000, .quiet = true};
    kvt_remote *t = NULL;
    if (kvt_remote_open(&t, m, &o)) printf("    kvt_remote_open: %s\n", kvt_errmsg());
    return t;
}

enum { N = 300 };

/* A session of t[0..n) run cold (the reference) and uploaded at n. */
static kvt_session *upload_cold(kvt_remote *rt, int tenant, kvt_model *m, const int32_t *t, size_t n)
{
    kvt_session *s = NULL;
    if (kvt_session_new(&s, m, NULL) || kvt_session_sync(s, t, n, NULL)) return NULL;
    kvt_remote_upload(rt, tenant, s, n);
    if (!kvt_remote_drain(rt, 10)) printf("    the upload queue did not drain\n");
    return s;
}

/* Restore t[0..n) from the tier into a fresh session; *got its length. */
static kvt_session *fetch(kvt_remote *rt, int tenant, kvt_model *m, const int32_t *t, size_t n, size_t *got)
{
    kvt_session *s = NULL;
    *got = 0;
    if (kvt_session_new(&s, m, NULL)) return NULL;
    kvt_remote_restore(rt, tenant, s, t, n, 0, got);
    return s;
}

static void remote_hit_bit_exact_body(rsrv *rp)
{
    rsrv r = *rp;
    kvt_model *m = tiny();
    int32_t t[N + 40];
    seqb(t, N + 40, 5);
    kvt_remote *a = tier(&r, m, NULL, NULL, 0), *b = tier(&r, m, NULL, NULL, 0);
    CHECK(a && b);
    kvt_session *cold = upload_cold(a, 0, m, t, N);
    CHECK(cold);
    kvt_remote_stats st;
    kvt_remote_stats_get(a, &st);
    CHECKF(st.uploads == 1 && st.dropped == 0, "uploads %llu dropped %llu", (unsigned long long)st.uploads,
           (unsigned long long)st.dropped);
    /* server B: the same prompt, and a longer one, hit the 300 tokens A saved */
    size_t got = 0;
    kvt_session *s = fetch(b, 0, m, t, N + 40, &got);
    CHECKF(got == N, "hit of %zu tokens, want %d", got, N);
    CHECK(kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    CHECK_OK(kvt_session_sync(s, t, N + 40, NULL));
    CHECK_OK(kvt_session_sync(cold, t, N + 40, NULL));
    CHECK(kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    kvt_remote_stats_get(b, &st);
    CHECK(st.hits == 1 && st.bad == 0 && st.bytes_read > 0);
    /* a second upload of the same prefix sends nothing */
    kvt_remote_upload(b, 0, s, N);
    CHECK(kvt_remote_drain(b, 10));
    kvt_remote_stats_get(b, &st);
    CHECK(st.uploads == 0);
    /* another prompt on the same first block: a miss, no error */
    int32_t u[N];
    memcpy(u, t, sizeof u);
    u[200] ^= 1;
    kvt_session *s2 = fetch(b, 0, m, u, N, &got);
    CHECK(got == 0 && kvt_session_len(s2) == 0);
    /* values in parts: the same prefix through 1000-byte parts */
    kvt_remote_part_bytes = 1000;
    kvt_remote_flush_bytes = 1; /* and each block sent on its own, before the snapshot is queued */
    kvt_redis *c = raw(&r, NULL);
    CHECK(c && cmd_ok(c, "FLUSHALL", NULL, NULL));
    kvt_redis_free(c);
    kvt_session_free(upload_cold(a, 0, m, t, N));
    kvt_session *s3 = fetch(b, 0, m, t, N, &got);
    kvt_remote_part_bytes = 1u << 20;
    kvt_remote_flush_bytes = 8u << 20;
    CHECKF(got == N, "hit through parts: %zu tokens", got);
    CHECK_OK(kvt_session_sync(s3, t, N + 40, NULL));
    CHECK(kvt_test_digest(s3, m) == kvt_test_digest(cold, m));
    kvt_session_free(s); kvt_session_free(s2); kvt_session_free(s3); kvt_session_free(cold);
    kvt_remote_close(a);
    kvt_remote_close(b);
    kvt_model_close(m);
}
REDIS_TEST(remote_hit_bit_exact, NULL)

/* The keys matching pattern, as strings (the caller frees each and the array). */
static size_t keys_of(kvt_redis *c, const char *pattern, char ***out)
{
    const char *a[2] = {"KEYS", pattern};
    redisReply *x = cmd(c, 2, a, NULL);
    *out = NULL;
    if (!x || x->type != REDIS_REPLY_ARRAY) { if (x) freeReplyObject(x); return 0; }
    char **v = calloc(x->elements + 1, sizeof *v);
    for (size_t i = 0; i < x->elements; i++) v[i] = strndup(x->element[i]->str, x->element[i]->len);
    size_t n = x->elements;
    freeReplyObject(x);
    *out = v;
    return n;
}

static void keys_free(char **k, size_t n)
{
    for (size_t i = 0; i < n; i++) free(k[i]);
    free(k);
}

static uint8_t *get_value(kvt_redis *c, const char *key, size_t *len)
{
    const char *a[2] = {"GET", key};
    redisReply *x = cmd(c, 2, a, NULL);
    uint8_t *v = NULL;
    *len = 0;
    if (x && x->type == REDIS_REPLY_STRING) {
        v = malloc(x->len + 1);
        memcpy(v, x->str, x->len);
        *len = x->len;
    }
    if (x) freeReplyObject(x);
    return v;
}

static bool set_value(kvt_redis *c, const char *key, const uint8_t *v, size_t len)
{
    const char *a[3] = {"SET", key, (const char *)v};
    size_t l[3] = {3, strlen(key), len};
    redisReply *x = cmd(c, 3, a, l);
    bool ok = x && x->type == REDIS_REPLY_STATUS;
    if (x) freeReplyObject(x);
    return ok;
}

static bool exists(kvt_redis *c, const char *key)
{
    const char *a[2] = {"EXISTS", key};
    redisReply *x = cmd(c, 2, a, NULL);
    bool e = x && x->type == REDIS_REPLY_INTEGER && x->integer == 1;
    if (x) freeReplyObject(x);
    return e;
}

/* The first key matching pattern other than the MAC and part keys. */
static char *first_key(kvt_redis *c, const char *pattern)
{
    char **k;
    size_t n = keys_of(c, pattern, &k);
    char *best = NULL;
    for (size_t i = 0; i < n; i++)
        if (!strchr(k[i], '#') && (!best || strcmp(k[i], best) < 0)) best = k[i];
    char *out = best ? strdup(best) : NULL;
    keys_free(k, n);
    return out;
}

enum { FLIP, TRUNCATE, SWAP, FOREIGN, N_DAMAGE };
static const char *damage_name[N_DAMAGE] = {"a bit flip in a block", "a truncated snapshot", "two blocks swapped",
                                            "a foreign model's records"};

static void remote_damaged_values_miss_body(rsrv *rp)
{
    rsrv r = *rp;
    kvt_model *m = tiny(), *other = NULL;
    CHECK_OK(kvt_model_preset(&other, "ds4-tiny", TINY_SEED + 1, NULL));
    int32_t t[N];
    seqb(t, N, 9);
    kvt_remote *a = tier(&r, m, NULL, NULL, 0), *fo = tier(&r, other, NULL, NULL, 0);
    kvt_redis *c = raw(&r, NULL);
    CHECK(a && fo && c);
    for (int d = 0; d < N_DAMAGE; d++) {
        CHECK(cmd_ok(c, "FLUSHALL", NULL, NULL));
        kvt_session *cold = upload_cold(a, 0, m, t, N);
        CHECK(cold);
        kvt_remote_stats st0, st1;
        kvt_remote_stats_get(a, &st0);
        char *blk = first_key(c, "*:b:*"), *snap = first_key(c, "*:s:*"), *damaged = NULL;
        CHECK(blk && snap);
        size_t len = 0, len2 = 0;
        uint8_t *v = get_value(c, blk, &len);
        CHECK(v && len > 100);
        if (d == FLIP) {
            v[len / 2] ^= 0x10;
            CHECK(set_value(c, blk, v, len));
            damaged = blk;
        } else if (d == TRUNCATE) {
            free(v);
            v = get_value(c, snap, &len);
            CHECK(set_value(c, snap, v, len - 9));
            damaged = snap;
        } else if (d == SWAP) {
            char **k;
            size_t nk = keys_of(c, "*:b:*", &k);
            CHECK(nk == 2); /* 300 tokens: two blocks */
            uint8_t *w0 = get_value(c, k[0], &len), *w1 = get_value(c, k[1], &len2);
            CHECK(w0 && w1 && set_value(c, k[0], w1, len2) && set_value(c, k[1], w0, len));
            free(w0);
            free(w1);
            free(blk);
            blk = strdup(k[0]); /* both are bad: either is deleted */
            keys_free(k, nk);
            damaged = blk;
        } else {
            /* the other model's records of the same tokens, put under this model's keys */
            kvt_session *o = upload_cold(fo, 0, other, t, N);
            kvt_session_free(o);
            /* each of its values in place of this model's of the same kind and block index */
            char **k;
            size_t nk = keys_of(c, "*", &k);
            size_t moved = 0;
            for (size_t i = 0; i < nk; i++) {
                if (!strncmp(k[i], snap, 23) || strchr(k[i], '#') || strstr(k[i], ":i:")) continue;
                size_t l;
                uint8_t *w = get_value(c, k[i], &l);
                bool is_blk = strstr(k[i], ":b:") != NULL;
                for (size_t j = 0; w && j < nk; j++) {
                    if (strncmp(k[j], snap, 23) || strchr(k[j], '#') || !strstr(k[j], is_blk ? ":b:" : ":s:")) continue;
                    size_t l2;
                    uint8_t *mine = get_value(c, k[j], &l2);
                    if (mine && (!is_blk || kvt_rd32(mine + 12) == kvt_rd32(w + 12))) moved += set_value(c, k[j], w, l);
                    free(mine);
                }
                free(w);
            }
            keys_free(k, nk);
            CHECKF(moved >= 3, "%zu foreign values put in place", moved);
            damaged = snap;
        }
        size_t got = 99;
        kvt_session *s;
        if (d == FLIP) {
            /* the negative control: without the checks of each value, the
             * load still refuses, but the damaged block is left in place */
            kvt_remote_skip_value_checks = true;
            s = fetch(a, 0, m, t, N, &got);
            kvt_remote_skip_value_checks = false;
            CHECK(got == 0);
            CHECKF(exists(c, damaged), "without the checks of each value, the damaged block was deleted anyway");
            kvt_session_free(s);
            kvt_remote_upload(a, 0, cold, N); /* the index entry that load dropped */
            CHECK(kvt_remote_drain(a, 10));
            kvt_remote_stats_get(a, &st0);
        }
        s = fetch(a, 0, m, t, N, &got);
        CHECKF(got == 0, "%s: a hit of %zu tokens", damage_name[d], got);
        CHECK(kvt_session_len(s) == 0);
        kvt_remote_stats_get(a, &st1);
        CHECKF(st1.bad > st0.bad, "%s: not counted as damage", damage_name[d]);
        CHECKF(!exists(c, damaged), "%s: %s not deleted", damage_name[d], damaged);
        /* uploaded anew, the prefix is a hit again, exact */
        kvt_remote_upload(a, 0, cold, N);
        CHECK(kvt_remote_drain(a, 10));
        kvt_session_free(s);
        s = fetch(a, 0, m, t, N, &got);
        CHECKF(got == N, "%s: after a new upload, a hit of %zu", damage_name[d], got);
        CHECK(kvt_test_digest(s, m) == kvt_test_digest(cold, m));
        printf("    %s: a miss, deleted; uploaded anew, a hit\n", damage_name[d]);
        kvt_session_free(s);
        kvt_session_free(cold);
        free(v);
        free(blk);
        free(snap);
    }
    kvt_redis_free(c);
    kvt_remote_close(a);
    kvt_remote_close(fo);
    kvt_model_close(other);
    kvt_model_close(m);
}
REDIS_TEST(remote_damaged_values_miss, NULL)

/* A block record with other rows and a checksum made anew: every check but
 * the HMAC passes. */
/* key with namespace `from` replaced by `to` (wherever it is: a part's
 * or a MAC's name starts with its hash tag's '{'). */
static void in_ns(const char *key, const char *from, const char *to, char *out, size_t cap)
{
    const char *at = strstr(key, from);
    if (!at) { snprintf(out, cap, "%s", key); return; }
    snprintf(out, cap, "%.*s%s%s", (int)(at - key), key, to, at + strlen(from));
}

static void plant(uint8_t *v, size_t len)
{
    v[len - 8 - 5] ^= 0x40;
    uint64_t h = XXH3_64bits(v, len - 8);
    memcpy(v + len - 8, &h, 8);
}

/* The fleet's secret file in r's directory (mode 0600) with text: its
 * path into out. */
static bool secret_file(const rsrv *r, const char *text, char *out, size_t cap)
{
    snprintf(out, cap, "%s/secret", r->dir);
    return write_file(out, text) && chmod(out, 0600) == 0;
}

static void remote_secret_refuses_planted_body(rsrv *rp)
{
    rsrv r = *rp;
    char secret[128];
    CHECK(secret_file(&r, "fleet secret 1\n", secret, sizeof secret));
    kvt_model *m = tiny();
    int32_t t[N], u[N];
    seqb(t, N, 11);
    seqb(u, N, 12);
    const char *tenants[2] = {"alice", "bob"};
    kvt_remote *a = tier(&r, m, secret, tenants, 2), *plain = tier(&r, m, NULL, NULL, 0);
    kvt_redis *c = raw(&r, NULL);
    CHECK(a && plain && c);
    kvt_session *cold = upload_cold(a, 0, m, t, N);
    CHECK(cold);
    size_t got;
    /* bob does not see alice's prefix */
    kvt_session *s = fetch(a, 1, m, t, N, &got);
    CHECK(got == 0);
    kvt_session_free(s);
    /* a consistent planted block: refused with the secret... */
    char **k;
    size_t nk = keys_of(c, "*:b:*", &k);
    char *blk = NULL;
    for (size_t i = 0; i < nk && !blk; i++)
        if (!strchr(k[i], '#')) blk = strdup(k[i]);
    keys_free(k, nk);
    CHECK(blk);
    size_t len;
    uint8_t *orig = get_value(c, blk, &len), *v = malloc(len);
    memcpy(v, orig, len);
    plant(v, len);
    CHECK(kvt_snap_block_check(v, len, NULL) == KVT_OK);
    CHECK(set_value(c, blk, v, len));
    kvt_remote_stats st;
    s = fetch(a, 0, m, t, N, &got);
    kvt_remote_stats_get(a, &st);
    CHECKF(got == 0 && st.bad >= 1, "a planted block with the secret: hit %zu, bad %llu", got,
           (unsigned long long)st.bad);
    CHECK(!exists(c, blk));
    kvt_session_free(s);
    /* ...and, the negative control, loaded when the HMAC is not checked: a
     * wrong cache, which the check is what keeps out */
    CHECK(set_value(c, blk, orig, len));
    kvt_remote_upload(a, 0, cold, N); /* the index entry the failed load dropped */
    CHECK(kvt_remote_drain(a, 10));
    CHECK(set_value(c, blk, v, len));
    kvt_remote_skip_mac = true;
    s = fetch(a, 0, m, t, N, &got);
    kvt_remote_skip_mac = false;
    CHECKF(got == N, "without the HMAC check the planted block is loaded (got %zu)", got);
    CHECK(kvt_test_digest(s, m) != kvt_test_digest(cold, m));
    kvt_session_free(s);
    /* alice's values copied into bob's namespace: refused (the MAC names the key) */
    CHECK(cmd_ok(c, "FLUSHALL", NULL, NULL));
    kvt_session_free(upload_cold(a, 0, m, t, N));
    nk = keys_of(c, "*", &k);
    char alice[96] = "";
    CHECK(nk > 0);
    for (size_t i = 0; i < nk && !alice[0]; i++) /* parts and MACs start with '{' (their hash tag) */
        if (k[i][0] != '{')
            snprintf(alice, sizeof alice, "%.*s", (int)(strstr(k[i] + 24, ":") - k[i] + 1), k[i]); /* kvt:r2:KEY0:NS: */
    kvt_session_free(upload_cold(a, 1, m, u, N)); /* bob's namespace exists */
    char **k2;
    size_t nk2 = keys_of(c, "*", &k2);
    char bob[96] = "";
    for (size_t i = 0; i < nk2; i++)
        if (k2[i][0] != '{' && strncmp(k2[i], alice, strlen(alice)))
            snprintf(bob, sizeof bob, "%.*s", (int)strlen(alice), k2[i]);
    keys_free(k2, nk2);
    CHECK(bob[0] && strcmp(bob, alice));
    for (size_t i = 0; i < nk; i++) {
        size_t l;
        uint8_t *w = get_value(c, k[i], &l);
        char key[300];
        in_ns(k[i], alice, bob, key, sizeof key);
        if (w) CHECK(set_value(c, key, w, l));
        else { /* the index hash */
            const char *a2[3] = {"COPY", k[i], key};
            redisReply *x = cmd(c, 3, a2, NULL);
            if (x) freeReplyObject(x);
        }
        free(w);
    }
    keys_free(k, nk);
    s = fetch(a, 1, m, t, N, &got);
    CHECKF(got == 0, "alice's values copied to bob: a hit of %zu", got);
    kvt_session_free(s);
    /* the negative control: without the HMAC check the copy is a hit in bob's namespace */
    nk = keys_of(c, "*", &k); /* the copy again: the failed load deleted what failed */
    keys_free(k, nk);
    kvt_session_free(upload_cold(a, 0, m, t, N));
    nk = keys_of(c, "*", &k);
    for (size_t i = 0; i < nk; i++) {
        if (!strstr(k[i], alice)) continue;
        size_t l;
        uint8_t *w = get_value(c, k[i], &l);
        char key[300];
        in_ns(k[i], alice, bob, key, sizeof key);
        if (w) set_value(c, key, w, l);
        else {
            const char *a2[3] = {"COPY", k[i], key};
            redisReply *x = cmd(c, 3, a2, NULL);
            if (x) freeReplyObject(x);
        }
        free(w);
    }
    keys_free(k, nk);
    kvt_remote_skip_mac = true;
    s = fetch(a, 1, m, t, N, &got);
    kvt_remote_skip_mac = false;
    CHECKF(got == N, "without the HMAC check the copy is a hit (got %zu)", got);
    kvt_session_free(s);
    /* tenants without a secret: refused, saying why */
    kvt_remote_opts o = {.url = r.url, .tenants = tenants, .n_tenants = 2, .keyed_tenants = true, .quiet = true};
    kvt_remote *bad = NULL;
    CHECK(kvt_remote_open(&bad, m, &o) == KVT_EINVAL && strstr(kvt_errmsg(), "secret"));
    free(blk); free(orig); free(v);
    kvt_session_free(cold);
    kvt_redis_free(c);
    kvt_remote_close(a);
    kvt_remote_close(plain);
    kvt_model_close(m);
}
REDIS_TEST(remote_secret_refuses_planted, NULL)

TEST(remote_url_refusals)
{
    kvt_redis_url u;
    CHECK(kvt_redis_parse_url("redis://h:7000/3", &u) == KVT_OK && u.port == 7000 && u.db == 3 && !strcmp(u.host, "h"));
    CHECK(kvt_redis_parse_url("redis://kv@[::1]:7001", &u) == KVT_OK && !strcmp(u.host, "::1") && !strcmp(u.user, "kv"));
    CHECK(kvt_redis_parse_url("redis://host", &u) == KVT_OK && u.port == 6379);
    CHECK(kvt_redis_parse_url("rediss://kv@host:1/2", &u) == KVT_OK && u.tls && !u.cluster && u.port == 1 && u.db == 2 &&
          !strcmp(u.user, "kv"));
    CHECK(kvt_redis_parse_url("redis-cluster://a:1,[::1]:2,c", &u) == KVT_OK && u.cluster && u.n_seeds == 3 &&
          !strcmp(u.seeds[1], "::1") && u.seed_ports[1] == 2 && u.seed_ports[2] == 6379 && !strcmp(u.host, "a"));
    CHECK(kvt_redis_parse_url("redis-cluster://a:1/1", &u) == KVT_EINVAL && strstr(kvt_errmsg(), "one database"));
    CHECK(kvt_redis_parse_url("redis-cluster://a:1,,b:2", &u) == KVT_EINVAL);
    CHECK(kvt_redis_parse_url("redis-cluster://", &u) == KVT_EINVAL);
    /* TLS files without TLS: refused, never a silent plain connection */
    kvt_redis *c = NULL;
    CHECK(kvt_redis_parse_url("redis://host:1", &u) == KVT_OK);
    u.ca = "/etc/hostname";
    CHECK(kvt_redis_new(&c, &u, NULL) == KVT_EINVAL && strstr(kvt_errmsg(), "rediss://") && !c);
    CHECK(kvt_redis_parse_url("rediss://host:1", &u) == KVT_OK);
    u.ca = "/nonexistent/ca.pem";
    CHECK(kvt_redis_new(&c, &u, NULL) == KVT_EIO && strstr(kvt_errmsg(), "/nonexistent/ca.pem") && !c);
    CHECK(kvt_redis_parse_url("redis://u:pw@host:1", &u) == KVT_EINVAL && strstr(kvt_errmsg(), "password-file"));
    CHECK(kvt_redis_parse_url("redis://host:0", &u) == KVT_EINVAL);
    CHECK(kvt_redis_parse_url("redis://host:1/x", &u) == KVT_EINVAL);
    CHECK(kvt_redis_parse_url("http://host:1", &u) == KVT_EINVAL);
}

static kvt_remote *tier_ms(const rsrv *r, kvt_model *m, const char *password_file, int lookup_ms, int load_ms)
{
    kvt_remote_opts o = {.url = r->url, .password_file = password_file, .lookup_ms = lookup_ms, .load_ms = load_ms,
                         .connect_ms = 200, .quiet = true};
    kvt_remote *t = NULL;
    if (kvt_remote_open(&t, m, &o)) printf("    kvt_remote_open: %s\n", kvt_errmsg());
    return t;
}

/* A stopped Redis (SIGSTOP) during lookups: each costs its deadline and is
 * a miss; after three the breaker opens and lookups cost nothing; once
 * Redis runs again, the probe after the breaker's second finds the prefix. */
static void remote_stopped_redis_body(rsrv *rp)
{
    rsrv r = *rp;
    kvt_model *m = tiny();
    int32_t t[N];
    seqb(t, N, 21);
    enum { LOOKUP_MS = 50 };
    kvt_remote *a = tier_ms(&r, m, NULL, LOOKUP_MS, 500);
    CHECK(a);
    kvt_session *cold = upload_cold(a, 0, m, t, N);
    CHECK(cold);
    CHECK(kill(r.pid, SIGSTOP) == 0);
    kvt_remote_stats st;
    size_t got;
    for (int i = 0; i < 3; i++) {
        double t0 = fx_now();
        kvt_session *s = fetch(a, 0, m, t, N, &got);
        double dt = fx_now() - t0;
        kvt_session_free(s);
        printf("    lookup %d with Redis stopped: %.1f ms, a miss\n", i + 1, dt * 1e3);
        /* the deadline plus scheduling slack on a loaded 2-core machine */
        CHECKF(got == 0 && dt < LOOKUP_MS / 1e3 + 0.5, "lookup %d: %zu tokens in %.3f s", i + 1, got, dt);
    }
    kvt_remote_stats_get(a, &st);
    CHECKF(st.breaker == 1 && st.breaker_trips == 1 && st.errors == 3, "breaker %d, trips %llu, errors %llu",
           st.breaker, (unsigned long long)st.breaker_trips, (unsigned long long)st.errors);
    double t0 = fx_now();
    kvt_session *s = fetch(a, 0, m, t, N, &got);
    double dt = fx_now() - t0;
    kvt_session_free(s);
    kvt_remote_stats_get(a, &st);
    /* not asked: no new error, and far less than a deadline (printed) */
    printf("    with the breaker open: %.2f ms\n", dt * 1e3);
    CHECKF(got == 0 && st.errors == 3 && st.misses == 4, "with the breaker open: asked anyway (errors %llu)",
           (unsigned long long)st.errors);
    CHECK(kill(r.pid, SIGCONT) == 0);
    fx_sleep_ms(1100); /* the breaker's first pause, BREAK_MIN */
    s = fetch(a, 0, m, t, N, &got);
    kvt_remote_stats_get(a, &st);
    CHECKF(got == N && st.breaker == 0, "after Redis came back: %zu tokens, breaker %d", got, st.breaker);
    CHECK(kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    kvt_session_free(s);
    /* the negative control of the time bound: with a 1.5 s deadline, a
     * lookup of a stopped Redis takes it, past the bound above */
    kvt_remote *slow = tier_ms(&r, m, NULL, 1500, 500);
    CHECK(slow);
    CHECK(kill(r.pid, SIGSTOP) == 0);
    t0 = fx_now();
    s = fetch(slow, 0, m, t, N, &got);
    dt = fx_now() - t0;
    kill(r.pid, SIGCONT);
    printf("    the same lookup with a 1500 ms deadline: %.0f ms\n", dt * 1e3);
    CHECK(got == 0 && dt >= 1.4);
    kvt_session_free(s);
    kvt_remote_close(slow);
    kvt_session_free(cold);
    kvt_remote_close(a);
    kvt_model_close(m);
}
REDIS_TEST(remote_stopped_redis, NULL)

/* A load's deadline is the prefill it would save: with Redis stopped
 * after the lookup answered (SIGSTOP before the values' round trip), the
 * time to first token (the restore, a miss, then the prefill) stays within
 * that deadline plus a prefill, where the fixed 500 ms bound of before
 * (kvt_remote_fault_fixed_deadline, the negative control) does not; with
 * Redis running a scaled deadline is a hit. The deadline's arithmetic: a
 * measured rate gives a prefill's time back. */
static void stop_redis(void *arg) { kill(*(pid_t *)arg, SIGSTOP); }

/* A fresh session of t[0..n) from the tier, then prefilled to n: the
 * seconds to its first token (its logits), *prefill the prefill's part. */
static double ttft(kvt_remote *rt, kvt_model *m, const int32_t *t, size_t n, size_t *got, double *prefill)
{
    double t0 = fx_now();
    kvt_session *s = fetch(rt, 0, m, t, n, got);
    double t1 = fx_now();
    if (!s || kvt_session_sync(s, t, n, NULL)) printf("    the prefill failed: %s\n", kvt_errmsg());
    double t2 = fx_now();
    kvt_session_free(s);
    if (prefill) *prefill = t2 - t1;
    return t2 - t0;
}

static void remote_load_deadline_bounded_by_prefill_body(rsrv *rp)
{
    rsrv r = *rp;
    kvt_model *m = tiny();
    int32_t t[N];
    seqb(t, N, 23);
    kvt_remote *a = tier(&r, m, NULL, NULL, 0);
    CHECK(a);
    kvt_session *cold = upload_cold(a, 0, m, t, N);
    CHECK(cold);
    /* a server whose prefill runs at 5,000 tokens/s: a load of 300 tokens
     * has 60 ms */
    kvt_remote_opts o = {.url = r.url, .lookup_ms = 1000, .prefill_tps = 5000, .quiet = true};
    kvt_remote *b = NULL;
    CHECK_OK(kvt_remote_open(&b, m, &o));
    double deadline = kvt_remote_load_deadline(b, 0, N);
    CHECKF(deadline > 0.059 && deadline < 0.061, "deadline %.3f s", deadline);
    /* with Redis running a scaled deadline is a hit (500 tokens/s: 600 ms,
     * room for a loaded machine) */
    kvt_remote_opts ok_o = o;
    ok_o.prefill_tps = 500;
    kvt_remote *ok = NULL;
    CHECK_OK(kvt_remote_open(&ok, m, &ok_o));
    size_t got = 0;
    double hit = ttft(ok, m, t, N, &got, NULL);
    kvt_remote_close(ok);
    printf("    Redis running: a hit of %zu tokens, first token after %.1f ms\n", got, hit * 1e3);
    CHECKF(got == N, "with Redis running the 600 ms deadline gave %zu tokens", got);
    pid_t pid = r.pid;
    kvt_remote_before_load = stop_redis;
    kvt_remote_before_load_arg = &pid;
    double prefill = 0, stopped = ttft(b, m, t, N, &got, &prefill);
    kill(r.pid, SIGCONT);
    kvt_remote_stats st;
    kvt_remote_stats_get(b, &st);
    double bound = deadline + prefill + 0.2; /* slack for a loaded 2-core machine */
    printf("    Redis stopped mid-load: first token after %.1f ms (deadline %.0f ms + its prefill %.1f ms)\n",
           stopped * 1e3, deadline * 1e3, prefill * 1e3);
    CHECKF(got == 0 && st.abandoned == 1, "stopped mid-load: %zu tokens, %llu abandoned, %llu errors (%s)", got,
           (unsigned long long)st.abandoned, (unsigned long long)st.errors, st.last_error);
    CHECKF(stopped <= bound, "time to first token %.3f s past deadline + prefill + slack %.3f s", stopped, bound);
    /* the negative control: the fixed bound of before costs a miss 500 ms */
    kvt_remote_fault_fixed_deadline = true;
    double fixed = ttft(b, m, t, N, &got, &prefill);
    kill(r.pid, SIGCONT);
    kvt_remote_fault_fixed_deadline = false;
    kvt_remote_before_load = NULL;
    bound = deadline + prefill + 0.2;
    printf("    the same with the fixed 500 ms bound: %.1f ms (its prefill %.1f ms)\n", fixed * 1e3, prefill * 1e3);
    CHECKF(got == 0 && fixed > bound, "the fixed bound: %.3f s, within %.3f s", fixed, bound);
    /* the arithmetic: a measured prefill of 0..1000 in 2 s gives 2 s back
     * for it, less for its first half (attention grows with the position) */
    kvt_remote_opts om = {.url = r.url, .quiet = true};
    kvt_remote *c = NULL;
    CHECK_OK(kvt_remote_open(&c, m, &om));
    kvt_remote_note_prefill(c, 0, 1000, 2.0);
    double d = kvt_remote_load_deadline(c, 0, 1000), h = kvt_remote_load_deadline(c, 0, 500);
    CHECKF(d > 1.999 && d < 2.001 && h < 1.0 && h > 0.1, "measured: %.3f s for 1000, %.3f s for 500", d, h);
    kvt_remote_note_prefill(c, 0, 100, 10.0); /* too short to be measured */
    CHECK(kvt_remote_load_deadline(c, 0, 1000) == d);
    kvt_remote_close(c);
    kvt_session_free(cold);
    kvt_remote_close(a);
    kvt_remote_close(b);
    kvt_model_close(m);
}
REDIS_TEST(remote_load_deadline_bounded_by_prefill, NULL)

/* A wrong password: a miss, nothing uploaded, the reason Redis gave kept;
 * the right one: a hit. */
static const char *const with_password[] = {"--requirepass", "right horse", NULL};
static void remote_wrong_password_body(rsrv *rp)
{
    rsrv r = *rp;
    kvt_model *m = tiny();
    int32_t t[N];
    seqb(t, N, 23);
    char good[128], bad[128];
    snprintf(good, sizeof good, "%s/good", r.dir);
    snprintf(bad, sizeof bad, "%s/bad", r.dir);
    CHECK(write_file(good, "right horse\n") && write_file(bad, "wrong horse\n"));
    kvt_remote *w = tier_ms(&r, m, bad, 1000, 2000), *n = tier_ms(&r, m, NULL, 1000, 2000),
               *g = tier_ms(&r, m, good, 1000, 2000);
    CHECK(w && n && g);
    kvt_session *cold = upload_cold(w, 0, m, t, N);
    CHECK(cold);
    size_t got;
    kvt_session *s = fetch(w, 0, m, t, N, &got);
    kvt_remote_stats st;
    kvt_remote_stats_get(w, &st);
    printf("    wrong password: %s\n", st.last_error);
    CHECK(got == 0 && st.uploads == 0 && st.dropped == 1 && strstr(st.last_error, "authentication refused"));
    kvt_session_free(s);
    s = fetch(n, 0, m, t, N, &got);
    kvt_remote_stats_get(n, &st);
    printf("    no password: %s\n", st.last_error);
    CHECK(got == 0 && strstr(st.last_error, "NOAUTH"));
    kvt_session_free(s);
    kvt_remote_upload(g, 0, cold, N);
    CHECK(kvt_remote_drain(g, 10));
    s = fetch(g, 0, m, t, N, &got);
    CHECK(got == N && kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    kvt_session_free(s);
    kvt_session_free(cold);
    kvt_remote_close(w);
    kvt_remote_close(n);
    kvt_remote_close(g);
    kvt_model_close(m);
}
REDIS_TEST(remote_wrong_password, with_password)

/* maxmemory far below what is uploaded, allkeys-lru: values are evicted,
 * so hits get shorter or become misses; never an error, and every hit is
 * the cold run's state at its length. */
static const char *const tiny_memory[] = {"--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru", NULL};
static void remote_maxmemory_lru_body(rsrv *rp)
{
    rsrv r = *rp;
    kvt_model *m = tiny();
    enum { LONG = 1280, OTHERS = 150 };
    int32_t t[LONG], u[N];
    seqb(t, LONG, 31);
    kvt_remote *a = tier_ms(&r, m, NULL, 1000, 2000);
    CHECK(a);
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    for (size_t at = 256; at <= LONG; at += 256) { /* nested prefixes, sharing blocks */
        CHECK_OK(kvt_session_sync(s, t, at, NULL));
        kvt_remote_upload(a, 0, s, at);
    }
    kvt_session_free(s);
    CHECK(kvt_remote_drain(a, 30));
    size_t got;
    kvt_session *h = fetch(a, 0, m, t, LONG, &got);
    CHECKF(got == LONG, "before the others: a hit of %zu", got);
    kvt_session_free(h);
    for (int i = 0; i < OTHERS; i++) {
        seqb(u, N, 100 + (uint64_t)i);
        kvt_session_free(upload_cold(a, 0, m, u, N));
    }
    /* the long prompt and the first others, the least recently used */
    size_t hits = 0;
    h = fetch(a, 0, m, t, LONG, &got);
    printf("    the 1280-token prompt after %d other uploads: a hit of %zu tokens\n", OTHERS, got);
    CHECKF(got < LONG, "nothing of the long prompt was evicted: maxmemory does not bind");
    if (got) CHECKF(kvt_test_digest(h, m) == kvt_test_twin(m, t, got), "a hit of %zu tokens differs from a cold run", got);
    kvt_session_free(h);
    for (int i = 0; i < OTHERS; i += 10) {
        seqb(u, N, 100 + (uint64_t)i);
        h = fetch(a, 0, m, u, N, &got);
        if (got) {
            hits++;
            CHECKF(kvt_test_digest(h, m) == kvt_test_twin(m, u, got), "a hit of %zu tokens differs", got);
        }
        kvt_session_free(h);
    }
    kvt_remote_stats st;
    kvt_remote_stats_get(a, &st);
    printf("    %zu of %d other prompts hit; %llu entries found evicted, errors %llu, dropped %llu\n", hits,
           OTHERS / 10, (unsigned long long)st.stale, (unsigned long long)st.errors, (unsigned long long)st.dropped);
    CHECKF(st.errors == 0 && st.bad == 0, "errors %llu bad %llu: %s", (unsigned long long)st.errors,
           (unsigned long long)st.bad, st.last_error);
    kvt_remote_close(a);
    kvt_model_close(m);
}
REDIS_TEST(remote_maxmemory_lru, tiny_memory)

/* Two servers, one Redis: server A answers a 700-token prompt cold and
 * uploads it; server B, with an empty disk, restores it from Redis (the
 * reply says tier remote) and answers with the same tokens and the same
 * top-5 logprobs as A's cold run; B keeps the hit on its disk. Run against
 * a build without the remote tier (KVT_BIN=/work/main/build/kvtier), the
 * server does not start: the flag is unknown. */
static void two_servers(rsrv *rp, fx_server *pa, fx_server *pb)
{
    rsrv r = *rp;
    char body[160], out[160], hdr[160], kva[128], kvb[128];
    snprintf(body, sizeof body, "%s/req.json", pa->dir);
    snprintf(kva, sizeof kva, "%s/kv", pa->dir);
    snprintf(kvb, sizeof kvb, "%s/kv", pb->dir);
    FILE *f = fopen(body, "w");
    CHECK(f);
    fputs("{\"model\":\"m\",\"max_tokens\":6,\"temperature\":0,\"logprobs\":true,\"top_logprobs\":5,"
          "\"messages\":[{\"role\":\"user\",\"content\":\"", f);
    for (int i = 0; i < 700; i++) fputc("abcdefghijklmnopqrstuvwxyz 0123456789"[i * 11 % 37], f);
    fputs("\"}]}", f);
    fclose(f);
    const char *args_a[] = {"--model", "ds4-tiny", "--kv-disk-dir", kva, "--kv-remote", r.url,
                            "--kv-remote-timeout-ms", "1000", NULL};
    CHECK(fx_server_start(pa, args_a));
    snprintf(out, sizeof out, "%s/a.out", pa->dir);
    snprintf(hdr, sizeof hdr, "%s/a.hdr", pa->dir);
    int code = rfx_post(pa->base, "/v1/chat/completions", body, out, hdr);
    CHECKF(code == 200, "server A: HTTP %d", code);
    char *cold = rfx_choices(out);
    CHECK(fx_server_stop(pa)); /* its saves, then their uploads */
    /* a slow prefill rate: the load's deadline (672 tokens at 50 a
     * second) is generous on a loaded machine */
    const char *args_b[] = {"--model", "ds4-tiny", "--kv-disk-dir", kvb, "--kv-remote", r.url,
                            "--kv-remote-timeout-ms", "1000", "--kv-remote-prefill-tps", "50", NULL};
    CHECK(fx_server_start(pb, args_b));
    snprintf(out, sizeof out, "%s/b.out", pb->dir);
    snprintf(hdr, sizeof hdr, "%s/b.hdr", pb->dir);
    code = rfx_post(pb->base, "/v1/chat/completions", body, out, hdr);
    CHECKF(code == 200, "server B: HTTP %d", code);
    char *h = kvt_test_read_file(hdr, NULL), *warm = rfx_choices(out);
    printf("    server B: %s", h && strstr(h, "X-KVTier-Cache") ? strstr(h, "X-KVTier-Cache") : "(no cache header)\n");
    CHECKF(h && strstr(h, "X-KVTier-Cache: remote"), "server B did not hit the remote tier");
    CHECKF(!strcmp(cold, warm), "server B's reply differs from A's cold run:\n%.400s\n%.400s", cold, warm);
    char mpath[160];
    snprintf(mpath, sizeof mpath, "%s/metrics", pb->dir);
    char c2[400];
    snprintf(c2, sizeof c2, "curl -s --max-time 10 -o '%s' '%s/metrics'", mpath, pb->base);
    CHECK(system(c2) == 0);
    char *mx = kvt_test_read_file(mpath, NULL);
    CHECK(mx && strstr(mx, "kvtier_cache_hits_total{tier=\"remote\"} 1") &&
          strstr(mx, "kvtier_remote_lookups_total{result=\"hit\"} 1") && strstr(mx, "kvtier_remote_breaker 0") &&
          strstr(mx, "kvtier_remote_shard_breaker{shard=\"0\"} 0\n") && !strstr(mx, "shard=\"1\""));
    CHECK(fx_server_stop(pb));
    /* the hit went to B's disk too */
    char ls[600], lsout[160];
    snprintf(lsout, sizeof lsout, "%s/ls.txt", pb->dir);
    snprintf(ls, sizeof ls, "%s cache ls --kv-disk-dir '%s' > '%s' 2>&1", kvt_test_bin(), kvb, lsout);
    CHECK(system(ls) == 0);
    char *lst = kvt_test_read_file(lsout, NULL);
    CHECKF(lst && strstr(lst, " remote "), "B's disk holds no entry saved from the remote tier:\n%s", lst);
    /* and what Redis holds, listed */
    free(lst);
    snprintf(ls, sizeof ls, "%s cache ls --kv-remote '%s' > '%s' 2>&1", kvt_test_bin(), r.url, lsout);
    CHECK(system(ls) == 0);
    lst = kvt_test_read_file(lsout, NULL);
    printf("    cache ls --kv-remote:\n%s", lst ? lst : "(none)\n");
    CHECKF(lst && strstr(lst, "kvt:r2:") && strstr(lst, ":open ") && strstr(lst, " 672 "),
           "cache ls --kv-remote does not list the 672-token entry");
    free(lst); free(mx); free(h); free(cold); free(warm);
}

static void remote_serve_two_servers_body(rsrv *rp)
{
    if (system("command -v curl >/dev/null 2>&1")) SKIP("curl is not on PATH");
    fx_server a = {0}, b = {0};
    CHECK(fx_tmpdir_make(&a, "kvtier-remote-a") && fx_tmpdir_make(&b, "kvtier-remote-b"));
    two_servers(rp, &a, &b);
    fx_server_kill(&a);
    fx_server_kill(&b);
    fx_tmpdir_remove(&a);
    fx_tmpdir_remove(&b);
}
REDIS_TEST(remote_serve_two_servers, NULL)

/* A 700-token chat request body in path, its text from seed. */
static bool write_request(const char *path, int seed)
{
    FILE *f = fopen(path, "w");
    if (!f) return false;
    fputs("{\"model\":\"m\",\"max_tokens\":2,\"temperature\":0,\"messages\":[{\"role\":\"user\",\"content\":\"", f);
    for (int i = 0; i < 700; i++) fputc("abcdefghijklmnopqrstuvwxyz 0123456789"[(i * 11 + seed * 7 + i / 37 * seed) % 37], f);
    fputs("\"}]}", f);
    return fclose(f) == 0;
}

static char *metrics_of(const fx_server *s)
{
    char path[160], c[400];
    snprintf(path, sizeof path, "%s/metrics.txt", s->dir);
    snprintf(c, sizeof c, "curl -s --max-time 10 -o '%s' '%s/metrics'", path, s->base);
    if (system(c)) return NULL;
    return kvt_test_read_file(path, NULL);
}

/* A server whose Redis stops (SIGSTOP): requests still answer, each in
 * about the time of a cold one plus the lookup's deadline; the breaker
 * opens, and closes again once Redis runs. */
static void stopped_server(rsrv *rp, fx_server *s)
{
    char req[160], out[160], hdr[160];
    snprintf(out, sizeof out, "%s/r.out", s->dir);
    snprintf(hdr, sizeof hdr, "%s/r.hdr", s->dir);
    snprintf(req, sizeof req, "%s/req.json", s->dir);
    const char *args[] = {"--model", "ds4-tiny", "--kv-disk-dir", s->dir, "--kv-remote", rp->url,
                          "--kv-remote-timeout-ms", "50", NULL};
    CHECK(fx_server_start(s, args));
    /* cold requests with Redis running: the reference time */
    double cold = 0;
    for (int i = 0; i < 2; i++) {
        CHECK(write_request(req, 1 + i));
        double t0 = fx_now();
        CHECK(rfx_post(s->base, "/v1/chat/completions", req, out, hdr) == 200);
        double dt = fx_now() - t0;
        if (dt > cold) cold = dt;
    }
    CHECK(kill(rp->pid, SIGSTOP) == 0);
    double worst = 0;
    for (int i = 0; i < 4; i++) {
        CHECK(write_request(req, 10 + i));
        double t0 = fx_now();
        int code = rfx_post(s->base, "/v1/chat/completions", req, out, hdr);
        double dt = fx_now() - t0;
        if (dt > worst) worst = dt;
        CHECKF(code == 200, "request %d with Redis stopped: HTTP %d", i, code);
    }
    char *mx = metrics_of(s);
    printf("    cold requests %.0f ms; with Redis stopped at most %.0f ms (deadline 50 ms)\n", cold * 1e3, worst * 1e3);
    /* slack for a loaded 2-core machine; a lookup without a deadline would hang */
    CHECKF(worst < cold + 0.05 + 1.0, "a request took %.3f s with Redis stopped (cold %.3f s)", worst, cold);
    /* open (1), or already half-open (2) when the requests took longer
     * than the breaker's first pause on a loaded machine (measured at load
     * 15: the check read 2 with one trip); either way it tripped */
    bool opened = mx && (strstr(mx, "kvtier_remote_breaker 1\n") || strstr(mx, "kvtier_remote_breaker 2\n")) &&
                  strstr(mx, "kvtier_remote_breaker_trips_total ") &&
                  !strstr(mx, "kvtier_remote_breaker_trips_total 0\n");
    CHECKF(opened, "the breaker did not open:\n%s", mx && strstr(mx, "kvtier_remote_breaker") ? strstr(mx, "kvtier_remote_breaker") : "");
    free(mx);
    CHECK(kill(rp->pid, SIGCONT) == 0);
    /* the breaker's pause, then a request probes: it closes */
    bool closed = false;
    for (int i = 0; i < 20 && !closed; i++) {
        fx_sleep_ms(500);
        CHECK(write_request(req, 30 + i));
        CHECK(rfx_post(s->base, "/v1/chat/completions", req, out, hdr) == 200);
        mx = metrics_of(s);
        closed = mx && strstr(mx, "kvtier_remote_breaker 0");
        free(mx);
    }
    CHECKF(closed, "the breaker did not close once Redis ran again");
    CHECK(fx_server_stop(s));
}

static void remote_serve_stopped_redis_body(rsrv *rp)
{
    if (system("command -v curl >/dev/null 2>&1")) SKIP("curl is not on PATH");
    fx_server s = {0};
    CHECK(fx_tmpdir_make(&s, "kvtier-remote-stop"));
    stopped_server(rp, &s);
    kill(rp->pid, SIGCONT);
    fx_server_kill(&s);
    fx_tmpdir_remove(&s);
}
REDIS_TEST(remote_serve_stopped_redis, NULL)

/* What serve refuses at start, saying why: API keys without a secret, TLS,
 * a password in the URL, a remote tier without the disk tier, the remote
 * flags without --kv-remote. */
TEST(remote_serve_refusals)
{
    fx_server s = {0};
    CHECK(fx_tmpdir_make(&s, "kvtier-remote-ref"));
    char out[160], kv[128];
    snprintf(out, sizeof out, "%s/out.txt", s.dir);
    snprintf(kv, sizeof kv, "%s/kv", s.dir);
    struct { const char *args[12]; int exit; const char *says; } cases[] = {
        {{"--api-key", "k1", "--kv-remote", "redis://127.0.0.1:1"}, 1, "--kv-remote-secret-file"},
        {{"--kv-remote", "rediss://127.0.0.1:1", "--kv-remote-ca", "/nonexistent/ca.pem"}, 1, "/nonexistent/ca.pem"},
        {{"--kv-remote", "redis://127.0.0.1:1", "--kv-remote-ca", "/etc/hostname"}, 1, "need a rediss:// or rediss-cluster:// URL"},
        {{"--kv-remote", "rediss://127.0.0.1:1", "--kv-remote-cert", "/etc/hostname"}, 1, "go together"},
        {{"--kv-remote-ca", "/etc/hostname"}, 2, "need --kv-remote"},
        {{"--kv-remote", "redis://u:pw@127.0.0.1:1"}, 1, "--kv-remote-password-file"},
        {{"--kv-remote", "redis://127.0.0.1:1", "--no-kv-disk"}, 1, "needs the disk tier"},
        {{"--kv-remote-secret-file", "/dev/null"}, 2, "need --kv-remote"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const char *argv[24] = {kvt_test_bin(), "serve", "--model", "ds4-tiny", "--port", "1", "--kv-disk-dir", kv};
        int a = 8;
        for (int i = 0; cases[c].args[i]; i++) argv[a++] = cases[c].args[i];
        argv[a] = NULL;
        int st = 0;
        CHECK(fx_run(argv, out, 30, &st) == 1);
        char *text = kvt_test_read_file(out, NULL);
        CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == cases[c].exit && text && strstr(text, cases[c].says),
               "case %zu: exit %d, want %d and '%s':\n%s", c, WIFEXITED(st) ? WEXITSTATUS(st) : -1, cases[c].exit,
               cases[c].says, text);
        free(text);
    }
    fx_tmpdir_remove(&s);
}

/* Redis killed (SIGKILL) while uploads are queued: they are dropped or
 * refused, lookups miss, nothing hangs; a new, empty Redis on the same port
 * is used again once the breaker lets a probe through, and a prefix
 * uploaded to it is a hit. */
static void remote_killed_redis_body(rsrv *rp)
{
    rsrv r = *rp;
    kvt_model *m = tiny();
    enum { K = 12 };
    int32_t t[K][N];
    kvt_remote *a = tier_ms(&r, m, NULL, 100, 500);
    CHECK(a);
    kvt_session *ss[K];
    for (int i = 0; i < K; i++) {
        seqb(t[i], N, 200 + (uint64_t)i);
        ss[i] = NULL;
        CHECK_OK(kvt_session_new(&ss[i], m, NULL));
        CHECK_OK(kvt_session_sync(ss[i], t[i], N, NULL));
    }
    double t0 = fx_now();
    for (int i = 0; i < K; i++) {
        kvt_remote_upload(a, 0, ss[i], N);
        if (i == K / 2) { kill(rp->pid, SIGKILL); waitpid(rp->pid, NULL, 0); rp->pid = 0; }
    }
    CHECK(kvt_remote_drain(a, 10));
    size_t got;
    kvt_session *s = fetch(a, 0, m, t[0], N, &got);
    kvt_session_free(s);
    kvt_remote_stats st;
    kvt_remote_stats_get(a, &st);
    printf("    Redis killed after %d of %d uploads: %llu sent, %llu dropped, in %.0f ms; breaker %d\n", K / 2 + 1, K,
           (unsigned long long)st.uploads, (unsigned long long)st.dropped, (fx_now() - t0) * 1e3, st.breaker);
    CHECK(got == 0 && st.uploads + st.dropped == K && st.dropped >= K / 2 - 1);
    /* a new Redis on the port: empty; after the breaker's pause a probe gets through */
    rsrv r2;
    CHECK(redis_start_on(&r2, NULL, r.port));
    *rp = r2; /* stopped by the wrapper */
    fx_sleep_ms(1100);
    bool hit = false;
    for (int tries = 0; tries < 40 && !hit; tries++) {
        kvt_remote_upload(a, 0, ss[1], N);
        CHECK(kvt_remote_drain(a, 10));
        s = fetch(a, 0, m, t[1], N, &got);
        hit = got == N && kvt_test_digest(s, m) == kvt_test_digest(ss[1], m);
        kvt_session_free(s);
        if (!hit) fx_sleep_ms(250);
    }
    kvt_remote_stats_get(a, &st);
    CHECKF(hit && st.breaker == 0, "no hit on the new Redis (breaker %d, %s)", st.breaker, st.last_error);
    for (int i = 0; i < K; i++) kvt_session_free(ss[i]);
    kvt_remote_close(a);
    kvt_model_close(m);
    char c[128];
    snprintf(c, sizeof c, "rm -rf '%s'", r.dir);
    if (system(c)) {}
}
REDIS_TEST(remote_killed_redis, NULL)

/* An ACL user that may only read (redis://reader@HOST:PORT, its password
 * from a file): its uploads are refused by Redis (NOPERM), dropped and
 * counted without opening the breaker; its lookups hit what a writer
 * uploaded. */
static void remote_read_only_user_body(rsrv *rp)
{
    rsrv r = *rp;
    kvt_redis *c = raw(&r, NULL);
    const char *acl[] = {"ACL", "SETUSER", "reader", "on", ">read pw", "~*", "+@read", "+@connection"};
    redisReply *x = c ? cmd(c, 8, acl, NULL) : NULL;
    CHECKF(x && x->type == REDIS_REPLY_STATUS, "ACL SETUSER: %s", x && x->str ? x->str : "no reply");
    freeReplyObject(x);
    kvt_redis_free(c);
    char pw[128];
    snprintf(pw, sizeof pw, "%s/reader", r.dir);
    CHECK(write_file(pw, "read pw\n"));
    kvt_model *m = tiny();
    int32_t t[N], u[N];
    seqb(t, N, 41);
    seqb(u, N, 42);
    kvt_remote *w = tier_ms(&r, m, NULL, 1000, 2000);
    rsrv ro = r;
    snprintf(ro.url, sizeof ro.url, "redis://reader@127.0.0.1:%d", r.port);
    kvt_remote *rd = tier_ms(&ro, m, pw, 1000, 2000);
    CHECK(w && rd);
    kvt_session *cold = upload_cold(w, 0, m, t, N);
    CHECK(cold);
    kvt_session *mine = upload_cold(rd, 0, m, u, N);
    CHECK(mine);
    kvt_remote_stats st;
    kvt_remote_stats_get(rd, &st);
    printf("    read-only user: %llu uploaded, %llu dropped, breaker %d\n", (unsigned long long)st.uploads,
           (unsigned long long)st.dropped, st.breaker);
    CHECK(st.uploads == 0 && st.dropped == 1 && st.breaker == 0 && st.errors == 0);
    size_t got;
    kvt_session *s = fetch(rd, 0, m, t, N, &got);
    CHECK(got == N && kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    kvt_session_free(s);
    s = fetch(rd, 0, m, u, N, &got);
    CHECK(got == 0);
    kvt_session_free(s);
    kvt_session_free(cold);
    kvt_session_free(mine);
    kvt_remote_close(w);
    kvt_remote_close(rd);
    kvt_model_close(m);
}
REDIS_TEST(remote_read_only_user, NULL)

typedef struct writer { kvt_remote *t; kvt_session *s; } writer;

static void *write_one(void *arg)
{
    writer *w = arg;
    kvt_remote_upload(w->t, 0, w->s, N);
    return NULL;
}

/* Two servers upload the same prefix at the same moment (with the secret):
 * both uploads succeed or one finds the other's, the values are whole
 * (MSET: a value and its MAC together), and a third server's lookup is a
 * hit, the cold run's state. */
static void remote_two_writers_body(rsrv *rp)
{
    rsrv r = *rp;
    char secret[128];
    CHECK(secret_file(&r, "fleet secret 2\n", secret, sizeof secret));
    kvt_model *m = tiny();
    int32_t t[N];
    seqb(t, N, 51);
    kvt_remote *a = tier(&r, m, secret, NULL, 0), *b = tier(&r, m, secret, NULL, 0), *c = tier(&r, m, secret, NULL, 0);
    CHECK(a && b && c);
    writer w[2] = {{a, NULL}, {b, NULL}};
    for (int i = 0; i < 2; i++) {
        CHECK_OK(kvt_session_new(&w[i].s, m, NULL));
        CHECK_OK(kvt_session_sync(w[i].s, t, N, NULL));
    }
    pthread_t th[2];
    for (int i = 0; i < 2; i++) CHECK(pthread_create(&th[i], NULL, write_one, &w[i]) == 0);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    CHECK(kvt_remote_drain(a, 10) && kvt_remote_drain(b, 10));
    kvt_remote_stats sa, sb;
    kvt_remote_stats_get(a, &sa);
    kvt_remote_stats_get(b, &sb);
    printf("    uploads %llu + %llu, dropped %llu + %llu\n", (unsigned long long)sa.uploads,
           (unsigned long long)sb.uploads, (unsigned long long)sa.dropped, (unsigned long long)sb.dropped);
    CHECK(sa.dropped + sb.dropped == 0 && sa.uploads + sb.uploads >= 1);
    size_t got;
    kvt_session *s = fetch(c, 0, m, t, N, &got);
    kvt_remote_stats st;
    kvt_remote_stats_get(c, &st);
    CHECKF(got == N && st.bad == 0, "a hit of %zu, %llu bad values", got, (unsigned long long)st.bad);
    CHECK(kvt_test_digest(s, m) == kvt_test_digest(w[0].s, m));
    kvt_session_free(s);
    for (int i = 0; i < 2; i++) kvt_session_free(w[i].s);
    kvt_remote_close(a);
    kvt_remote_close(b);
    kvt_remote_close(c);
    kvt_model_close(m);
}
REDIS_TEST(remote_two_writers, NULL)

/* `kvtier run --kv-remote`: a run with an empty disk hits what another
 * run uploaded (the same reply, and the hit kept on its disk); `kvtier
 * cache verify --kv-remote` finds the entry good, then a bit flipped in a
 * block in Redis (exit 1, the entry named), and with --delete deletes the
 * entry and the block, after which a run is a miss that prefills (the same
 * reply). The binary of a build without these fails the first check
 * (KVT_BIN=<that binary>: run refuses --kv-remote). */
static bool run_cli(const char *const *argv, const char *out, const char *err, int want, const char *says_out,
                    const char *says_err)
{
    int st = 0;
    if (fx_run_split(argv, out, err, 120, &st) != 1) { printf("    %s %s: did not finish\n", argv[1], argv[2]); return false; }
    char *o = kvt_test_read_file(out, NULL), *e = kvt_test_read_file(err, NULL);
    bool ok = WIFEXITED(st) && WEXITSTATUS(st) == want && o && e && (!says_out || strstr(o, says_out)) &&
              (!says_err || strstr(e, says_err));
    if (!ok)
        printf("    %s %s: exit %d (want %d), wanted '%s' / '%s' in:\n%s\n%s\n", argv[1], argv[2],
               WIFEXITED(st) ? WEXITSTATUS(st) : -1, want, says_out ? says_out : "", says_err ? says_err : "",
               o ? o : "", e ? e : "");
    free(o);
    free(e);
    return ok;
}

static void remote_run_and_verify_body(rsrv *rp)
{
    rsrv r = *rp;
    fx_server s = {0};
    CHECK(fx_tmpdir_make(&s, "kvtier-remote-run"));
    char prompt[701], out[160], err[160], kva[128], kvb[128], kvc[128];
    for (int i = 0; i < 700; i++) prompt[i] = "abcdefghijklmnopqrstuvwxyz 0123456789"[i * 11 % 37];
    prompt[700] = 0;
    snprintf(out, sizeof out, "%s/out.txt", s.dir);
    snprintf(err, sizeof err, "%s/err.txt", s.dir);
    snprintf(kva, sizeof kva, "%s/a", s.dir);
    snprintf(kvb, sizeof kvb, "%s/b", s.dir);
    snprintf(kvc, sizeof kvc, "%s/c", s.dir);
    const char *bin = kvt_test_bin();
#define RUN(dir, ...) {bin, "run", "--model", "ds4-tiny", "--prompt", prompt, "--max-tokens", "6", "--output", "ids", \
                       "--kv-disk-dir", dir, __VA_ARGS__, NULL}
    const char *run_a[] = RUN(kva, "--kv-remote", r.url);
    CHECK(run_cli(run_a, out, err, 0, NULL, "1 snapshot uploaded"));
    char *cold = kvt_test_read_file(out, NULL);
    CHECK(cold && *cold);
    /* an empty disk: the remote's prefix, the same reply, kept on the disk */
    const char *run_b[] = RUN(kvb, "--kv-remote", r.url, "--kv-remote-prefill-tps", "50");
    CHECK(run_cli(run_b, out, err, 0, cold, "from the remote cache"));
    const char *run_b2[] = RUN(kvb, "--kv-cache-min-tokens", "512");
    CHECK(run_cli(run_b2, out, err, 0, cold, "from the disk cache"));
    char *b2 = kvt_test_read_file(err, NULL);
    CHECKF(b2 && !strstr(b2, " 0 from the disk cache"), "the remote hit was not kept on the disk:\n%s", b2);
    free(b2);
    /* verify: good */
    const char *verify[] = {bin, "cache", "verify", "--kv-remote", r.url, "--model", "ds4-tiny", NULL};
    CHECK(run_cli(verify, out, err, 0, "1 entries of this model: 1 good, 0 bad", NULL));
    /* a bit flipped in a block: found, named, kept until --delete */
    kvt_redis *c = raw(&r, NULL);
    CHECK(c);
    char *blk = first_key(c, "*:b:*");
    size_t len = 0;
    uint8_t *v = blk ? get_value(c, blk, &len) : NULL;
    CHECK(v && len > 100);
    v[len / 2] ^= 0x10;
    CHECK(set_value(c, blk, v, len));
    free(v);
    CHECK(run_cli(verify, out, err, 1, "1 bad", NULL));
    char *vo = kvt_test_read_file(out, NULL);
    printf("    cache verify --kv-remote, a bit flipped in a block:\n%s", vo ? vo : "");
    CHECKF(vo && strstr(vo, "block") && strstr(vo, "--delete deletes them"), "verify does not name the block");
    free(vo);
    CHECK(exists(c, blk));
    const char *verify_del[] = {bin, "cache", "verify", "--kv-remote", r.url, "--model", "ds4-tiny", "--delete", NULL};
    CHECK(run_cli(verify_del, out, err, 1, "deleted", NULL));
    CHECK(!exists(c, blk));
    CHECK(run_cli(verify, out, err, 0, "0 entries of this model", NULL));
    /* the entry is gone: a run with an empty disk prefills, the same reply */
    const char *run_c[] = RUN(kvc, "--kv-remote", r.url, "--kv-remote-prefill-tps", "50");
    CHECK(run_cli(run_c, out, err, 0, cold, " 0 from the disk cache"));
#undef RUN
    free(blk);
    free(cold);
    kvt_redis_free(c);
    fx_tmpdir_remove(&s);
}
REDIS_TEST(remote_run_and_verify, NULL)

/* Two save points of one prompt (the prompt's end at 384 tokens, the
 * reply's at 640: storeq's upload_points), queued before either is sent
 * (kvt_remote_hold_uploads): the second sends only the blocks the first
 * does not carry, so the values written are the 5 blocks and 2 snapshot
 * records, each once; a second server then hits all 640 tokens bit for
 * bit (the second entry's index names blocks the first upload stored).
 * Run with kvt_remote_fault_resend_queued (the tier before it looked in
 * its queue: the negative control), the 3 shared blocks are sent twice:
 * 10 values, and the bytes say by how much. */
static void two_points(rsrv *r, kvt_model *m, kvt_session *at384, kvt_session *cold, bool fault, kvt_remote_stats *st)
{
    kvt_redis *c = raw(r, NULL);
    if (c) cmd_ok(c, "FLUSHALL", NULL, NULL);
    kvt_redis_free(c);
    kvt_remote_fault_resend_queued = fault;
    kvt_remote *a = tier(r, m, NULL, NULL, 0);
    memset(st, 0, sizeof *st);
    if (!a) return;
    kvt_remote_hold_uploads = true;
    kvt_remote_upload(a, 0, at384, 384);
    kvt_remote_upload(a, 0, cold, 640);
    kvt_remote_hold_uploads = false;
    kvt_remote_drain(a, 10);
    kvt_remote_stats_get(a, st);
    kvt_remote_fault_resend_queued = false;
    kvt_remote_close(a);
}

static void remote_no_double_upload_body(rsrv *rp)
{
    rsrv r = *rp;
    kvt_model *m = tiny();
    int32_t t[640];
    seqb(t, 640, 36);
    kvt_session *cold = NULL, *at384 = NULL; /* the session at each point */
    CHECK_OK(kvt_session_new(&cold, m, NULL));
    CHECK_OK(kvt_session_sync(cold, t, 640, NULL));
    CHECK_OK(kvt_session_new(&at384, m, NULL));
    CHECK_OK(kvt_session_sync(at384, t, 384, NULL));
    kvt_remote_stats once, twice;
    two_points(&r, m, at384, cold, true, &twice);
    two_points(&r, m, at384, cold, false, &once);
    printf("    two save points queued at once: %llu values, %llu bytes written; with the queued blocks sent again "
           "(the control): %llu values, %llu bytes\n", (unsigned long long)once.values_written,
           (unsigned long long)once.bytes_written, (unsigned long long)twice.values_written,
           (unsigned long long)twice.bytes_written);
    CHECKF(once.uploads == 2 && once.dropped == 0 && once.values_written == 7, "uploads %llu dropped %llu values %llu",
           (unsigned long long)once.uploads, (unsigned long long)once.dropped, (unsigned long long)once.values_written);
    CHECKF(twice.uploads == 2 && twice.values_written == 10 && twice.bytes_written > once.bytes_written,
           "the control: %llu values", (unsigned long long)twice.values_written);
    kvt_remote *b = tier(&r, m, NULL, NULL, 0);
    size_t got = 0;
    kvt_session *s = b ? fetch(b, 0, m, t, 640, &got) : NULL;
    CHECKF(got == 640, "the second point: a hit of %zu", got);
    CHECK(kvt_test_digest(s, m) == kvt_test_digest(cold, m));
    kvt_session_free(s);
    kvt_remote_close(b);
    kvt_session_free(cold);
    kvt_session_free(at384);
    kvt_model_close(m);
}
REDIS_TEST(remote_no_double_upload, NULL)

/* The one index entry's manifest in Redis: *snap the snapshot record's
 * bytes, *largest and *sum of its blocks'; returns the blocks' count. */
static size_t manifest_of(kvt_redis *c, size_t *snap, size_t *largest, size_t *sum)
{
    char *idx = first_key(c, "*:i:*");
    const char *a[2] = {"HGETALL", idx};
    redisReply *x = idx ? cmd(c, 2, a, NULL) : NULL;
    size_t nb = 0;
    *snap = *largest = *sum = 0;
    if (x && x->type == REDIS_REPLY_ARRAY && x->elements == 2) {
        char *p = x->element[1]->str, *end;
        *snap = strtoull(p, &end, 10);
        for (p = end; *p; p = end) {
            size_t l = strtoull(p, &end, 10);
            if (end == p) break;
            nb++;
            *sum += l;
            if (l > *largest) *largest = l;
        }
    }
    if (x) freeReplyObject(x);
    free(idx);
    return nb;
}

enum { LONG = 1300 }; /* 10 blocks and a 20-token tail */

/* A hit of 10 blocks read in windows of two blocks (kvt_remote_window_bytes
 * set to two blocks' bytes), its values whole and then in parts of 1000
 * bytes (the rows copied from the parts straight into the session): bit
 * for bit the cold run's state, and the most bytes of values the restore
 * held at once (kvt_remote_stats.load_peak_bytes) within the bound,
 * the snapshot record (and a part beside it while a record in parts is
 * joined) and one window. The negative control: every block in one round
 * trip (kvt_remote_fault_one_trip, the tier before windows) holds the
 * entry whole, past the bound, and the test sees it. Each block's bytes
 * are hashed once on the hit (kvt_snap_block_hashed: the window's check,
 * not the loader's again); the control, the loader hashing the blocks
 * their reader checked (kvt_snap_fault_hash_checked, as it did before),
 * hashes them twice, and the count sees it. */
static void in_windows(rsrv *rp)
{
    rsrv r = *rp;
    kvt_model *m = tiny();
    int32_t t[LONG];
    seqb(t, LONG, 21);
    kvt_redis *c = raw(&r, NULL);
    CHECK(m && c);
    kvt_session *cold = NULL;
    CHECK_OK(kvt_session_new(&cold, m, NULL));
    CHECK_OK(kvt_session_sync(cold, t, LONG, NULL));
    uint64_t want = kvt_test_digest(cold, m);
    for (int parts = 0; parts < 2; parts++) {
        kvt_remote_part_bytes = parts ? 1000 : 1u << 20;
        CHECK(cmd_ok(c, "FLUSHALL", NULL, NULL));
        kvt_remote *a = tier(&r, m, NULL, NULL, 0);
        CHECK(a);
        kvt_remote_upload(a, 0, cold, LONG);
        CHECK(kvt_remote_drain(a, 10));
        kvt_remote_close(a);
        size_t snap, largest, sum, nb = manifest_of(c, &snap, &largest, &sum);
        CHECKF(nb == LONG / 128 && largest > 0, "a manifest of %zu blocks", nb);
        size_t window = 2 * largest, bound = snap + (parts && snap > 1000 ? 1000 : 0) + window;
        for (int fault = 0; fault < 2; fault++) {
            kvt_remote_window_bytes = window;
            kvt_remote_fault_one_trip = fault;
            kvt_remote *b = tier(&r, m, NULL, NULL, 0);
            CHECK(b);
            size_t got = 0;
            uint64_t h0 = atomic_load(&kvt_snap_block_hashed);
            kvt_session *s = fetch(b, 0, m, t, LONG, &got);
            uint64_t hashed = atomic_load(&kvt_snap_block_hashed) - h0, once = sum - 8 * nb;
            kvt_remote_fault_one_trip = false;
            kvt_remote_window_bytes = 8u << 20;
            kvt_remote_stats st;
            kvt_remote_stats_get(b, &st);
            printf("    %s, %s: a hit of %zu tokens; %zu blocks of %zu B at most (%zu B in all), snapshot %zu B: "
                   "at most %llu B held at once (bound %zu B)\n", parts ? "parts of 1000 B" : "whole values",
                   fault ? "one round trip (the control)" : "windows of 2 blocks", got, nb, largest, sum, snap,
                   (unsigned long long)st.load_peak_bytes, bound);
            CHECKF(got == LONG, "a hit of %zu tokens", got);
            CHECK(kvt_test_digest(s, m) == want);
            CHECK(st.hits == 1 && st.bad == 0 && st.bytes_read == snap + sum);
            if (!fault) CHECKF(st.load_peak_bytes <= bound && st.load_peak_bytes >= snap + largest,
                               "held %llu B at once, bound %zu", (unsigned long long)st.load_peak_bytes, bound);
            else CHECKF(st.load_peak_bytes > bound && st.load_peak_bytes >= snap + sum,
                        "the control held %llu B at once: not past the bound %zu", (unsigned long long)st.load_peak_bytes,
                        bound);
            /* each block's bytes (all but the checksum they end with) hashed once */
            CHECKF(hashed == once, "the hit hashed %llu B of blocks, %llu B once each", (unsigned long long)hashed,
                   (unsigned long long)once);
            if (!fault) { /* the control: the loader hashes the checked blocks again */
                kvt_snap_fault_hash_checked = true;
                h0 = atomic_load(&kvt_snap_block_hashed);
                kvt_session *s2 = fetch(b, 0, m, t, LONG, &got);
                uint64_t twice = atomic_load(&kvt_snap_block_hashed) - h0;
                kvt_snap_fault_hash_checked = false;
                printf("    hashed by the block checks: %llu B (%llu B of blocks); the control %llu B\n",
                       (unsigned long long)hashed, (unsigned long long)once, (unsigned long long)twice);
                CHECK(got == LONG && kvt_test_digest(s2, m) == want);
                CHECKF(twice == 2 * once && twice != hashed, "the control hashed %llu B: the count does not see it",
                       (unsigned long long)twice);
                kvt_session_free(s2);
            }
            /* the restored session goes on as the cold one does */
            CHECK_OK(kvt_session_sync(s, t, LONG, NULL));
            kvt_session_free(s);
            kvt_remote_close(b);
        }
    }
    kvt_remote_part_bytes = 1u << 20;
    kvt_session_free(cold);
    kvt_redis_free(c);
    kvt_model_close(m);
}
/* The tier's test switches as they were, whatever a failed check left. */
static void switches_reset(void)
{
    kvt_remote_part_bytes = 1u << 20;
    kvt_remote_window_bytes = 8u << 20;
    kvt_remote_fault_one_trip = kvt_remote_skip_value_checks = kvt_remote_skip_mac = false;
    kvt_remote_fault_skip_block_check = kvt_snap_fault_hash_checked = false;
    kvt_remote_flush_bytes = 8u << 20;
    kvt_redis_keep_bytes = 1u << 20;
    kvt_redis_fault_keep_queue = false;
}

static void remote_restore_in_windows_body(rsrv *rp)
{
    in_windows(rp);
    switches_reset();
}
REDIS_TEST(remote_restore_in_windows, NULL)

/* An upload of 10 blocks (1,300 tokens) sent in windows of two blocks
 * (kvt_remote_flush_bytes), the connections' queues kept up to 4 KiB
 * (kvt_redis_keep_bytes): the most it held at once
 * (kvt_remote_stats.upload_peak_bytes: its values and the pipeline
 * formatted from them) is within twice a window and the larger of a block
 * and the snapshot record, and once sent the tier's connections keep at
 * most 4 KiB each (kvt_remote_send_buffers); another tier hits it bit for
 * bit. Two negative controls, one change each: every queue kept whole
 * (kvt_redis_fault_keep_queue, the client before) keeps the window's
 * pipeline allocated after the upload; the upload in one piece (the
 * window past its size, as 32 MiB pieces were for an entry under 32 MiB)
 * holds the entry twice, past the bound. */
static void upload_windows(rsrv *rp)
{
    rsrv r = *rp;
    kvt_model *m = tiny();
    int32_t t[LONG];
    seqb(t, LONG, 24);
    kvt_redis *c = raw(&r, NULL);
    CHECK(m && c);
    kvt_session *cold = NULL;
    CHECK_OK(kvt_session_new(&cold, m, NULL));
    CHECK_OK(kvt_session_sync(cold, t, LONG, NULL));
    uint64_t want = kvt_test_digest(cold, m);
    CHECK(cmd_ok(c, "FLUSHALL", NULL, NULL));
    kvt_remote *a = tier(&r, m, NULL, NULL, 0);
    CHECK(a);
    kvt_remote_upload(a, 0, cold, LONG);
    CHECK(kvt_remote_drain(a, 10));
    kvt_remote_close(a);
    size_t snap, largest, sum, nb = manifest_of(c, &snap, &largest, &sum);
    CHECKF(nb == LONG / 128 && largest > 0, "a manifest of %zu blocks", nb);
    size_t window = 2 * largest, keep = 4096, bound = 2 * (window + (largest > snap ? largest : snap)) + 4096;
    static const char *const how[3] = {"windows of 2 blocks", "queues kept (the control)", "one piece (the control)"};
    for (int k = 0; k < 3; k++) {
        CHECK(cmd_ok(c, "FLUSHALL", NULL, NULL));
        kvt_remote_flush_bytes = k == 2 ? SIZE_MAX : window;
        kvt_redis_keep_bytes = keep;
        kvt_redis_fault_keep_queue = k == 1;
        a = tier(&r, m, NULL, NULL, 0);
        CHECK(a);
        kvt_remote_upload(a, 0, cold, LONG);
        CHECK(kvt_remote_drain(a, 10));
        kvt_remote_stats st;
        kvt_remote_stats_get(a, &st);
        size_t kept = kvt_remote_send_buffers(a);
        kvt_remote_close(a);
        kvt_remote_flush_bytes = 8u << 20;
        kvt_redis_keep_bytes = 1u << 20;
        kvt_redis_fault_keep_queue = false;
        printf("    %s: %llu B written (entry %zu B); at most %llu B held at once (bound %zu B); %zu B of queues "
               "kept after\n", how[k], (unsigned long long)st.bytes_written, snap + sum,
               (unsigned long long)st.upload_peak_bytes, bound, kept);
        CHECK(st.uploads == 1 && st.dropped == 0 && st.bytes_written == snap + sum);
        if (k == 0) {
            CHECKF(st.upload_peak_bytes <= bound && st.upload_peak_bytes >= 2 * window,
                   "held %llu B at once, bound %zu", (unsigned long long)st.upload_peak_bytes, bound);
            CHECKF(kept <= 3 * keep, "%zu B of queues kept after the upload", kept);
        } else if (k == 1) {
            CHECKF(kept > 3 * keep && kept >= 2 * window, "the control kept %zu B of queues: no more than the bound",
                   kept);
        } else {
            CHECKF(st.upload_peak_bytes > bound && st.upload_peak_bytes >= 2 * (snap + sum),
                   "the control held %llu B at once: not past the bound %zu", (unsigned long long)st.upload_peak_bytes,
                   bound);
        }
        /* what was sent is the entry: another tier hits it, bit for bit */
        kvt_remote *b = tier(&r, m, NULL, NULL, 0);
        size_t got = 0;
        kvt_session *s = fetch(b, 0, m, t, LONG, &got);
        CHECKF(got == LONG && kvt_test_digest(s, m) == want, "%s: a hit of %zu", how[k], got);
        kvt_session_free(s);
        kvt_remote_close(b);
    }
    kvt_session_free(cold);
    kvt_redis_free(c);
    kvt_model_close(m);
}

static void remote_upload_in_windows_body(rsrv *rp)
{
    upload_windows(rp);
    switches_reset();
}
REDIS_TEST(remote_upload_in_windows, NULL)

/* The block of index b among the keys "*:b:*" (read from its header). */
static char *block_named(kvt_redis *c, uint32_t b)
{
    char **k;
    size_t nk = keys_of(c, "*:b:*", &k);
    char *out = NULL;
    for (size_t i = 0; i < nk && !out; i++) {
        if (strchr(k[i], '#')) continue;
        size_t len = 0;
        uint8_t *v = get_value(c, k[i], &len);
        if (v && len >= 16 && kvt_rd32(v + 12) == b) out = strdup(k[i]);
        free(v);
    }
    keys_free(k, nk);
    return out;
}

static size_t index_entries(kvt_redis *c)
{
    char **k;
    size_t nk = keys_of(c, "*:i:*", &k);
    keys_free(k, nk);
    return nk;
}

/* A block damaged, or gone, in a later window than the first (windows of
 * one block, values in parts of 1000 bytes, with and without a secret):
 * the load had begun in a session that held 256 of the prompt's tokens, so
 * the session ends empty and *got is 0; the entry and the failed value
 * (every part) are deleted and counted (bad, or stale for the gone one),
 * the good blocks stay; the session prefilled from empty reaches the cold
 * run's state bit for bit, and the prefix uploaded anew is a hit. The
 * negative control: the checks of each value skipped (and the MAC) the
 * load still refuses the damage, but blames the snapshot record: the
 * damaged block stays. */
/* What the damage tests start from: ds4-tiny, a tier secret's file,
 * LONG tokens from seed, a raw connection, the cold session of those
 * tokens and its digest. Check ok: all of it made. */
typedef struct damage_fx {
    char secret[128];
    kvt_model *m;
    int32_t t[LONG];
    kvt_redis *c;
    kvt_session *cold;
    uint64_t want;
    bool ok;
} damage_fx;

static void damage_fx_open(damage_fx *f, rsrv *r, const char *secret_text, int seed)
{
    *f = (damage_fx){0};
    CHECK(secret_file(r, secret_text, f->secret, sizeof f->secret));
    f->m = tiny();
    seqb(f->t, LONG, seed);
    f->c = raw(r, NULL);
    CHECK(f->m && f->c);
    CHECK_OK(kvt_session_new(&f->cold, f->m, NULL));
    CHECK_OK(kvt_session_sync(f->cold, f->t, LONG, NULL));
    f->want = kvt_test_digest(f->cold, f->m);
    f->ok = true;
}

static void damage_fx_close(damage_fx *f)
{
    kvt_session_free(f->cold);
    kvt_redis_free(f->c);
    kvt_model_close(f->m);
}

static void later_window_damage(rsrv *rp)
{
    rsrv r = *rp;
    damage_fx f;
    damage_fx_open(&f, &r, "fleet secret 2\n", 22);
    if (!f.ok) { damage_fx_close(&f); return; }
    kvt_model *m = f.m;
    const int32_t *t = f.t;
    kvt_redis *c = f.c;
    kvt_session *cold = f.cold;
    uint64_t want = f.want;
    const char *secret = f.secret;
    kvt_remote_part_bytes = 1000;
    for (int keyed = 0; keyed < 2; keyed++) {
        CHECK(cmd_ok(c, "FLUSHALL", NULL, NULL));
        kvt_remote *a = tier(&r, m, keyed ? secret : NULL, NULL, 0);
        CHECK(a);
        kvt_remote_upload(a, 0, cold, LONG);
        CHECK(kvt_remote_drain(a, 10));
        kvt_remote_window_bytes = 1; /* a block a window */
        for (int gone = 0; gone < 2; gone++) {
            char *blk = block_named(c, gone ? 8 : 6), *first = block_named(c, 0), part[300];
            CHECK(blk && first);
            snprintf(part, sizeof part, "{%s}#2", blk);
            size_t len = 0;
            uint8_t *v = get_value(c, part, &len);
            CHECK(v && len == 1000);
            kvt_session *s = NULL;
            size_t got = 99;
            CHECK_OK(kvt_session_new(&s, m, NULL));
            if (!gone) {
                v[len / 2] ^= 0x10;
                CHECK(set_value(c, part, v, len));
                /* the control: without the checks of each value the damage is found by the load, blamed on
                 * the snapshot record: the block stays */
                kvt_remote_skip_value_checks = kvt_remote_skip_mac = true;
                kvt_remote_restore(a, 0, s, t, LONG, 0, &got);
                kvt_remote_skip_value_checks = kvt_remote_skip_mac = false;
                CHECK(got == 0 && kvt_session_len(s) == 0);
                CHECKF(exists(c, part), "without the checks of each value, the damaged block was deleted anyway");
                kvt_remote_upload(a, 0, cold, LONG); /* the index entry that load dropped */
                CHECK(kvt_remote_drain(a, 10));
            } else {
                const char *d[2] = {"DEL", part};
                redisReply *x = cmd(c, 2, d, NULL);
                CHECK(x && x->type == REDIS_REPLY_INTEGER && x->integer == 1);
                if (x) freeReplyObject(x);
            }
            kvt_remote_stats st0, st1;
            kvt_remote_stats_get(a, &st0);
            CHECK(index_entries(c) == 1);
            CHECK_OK(kvt_session_sync(s, t, 256, NULL)); /* the session holds a prefix */
            got = 99;
            kvt_remote_restore(a, 0, s, t, LONG, 256, &got);
            kvt_remote_stats_get(a, &st1);
            printf("    %s, block %d %s: a hit of %zu, the session left with %zu tokens; bad %llu, stale %llu\n",
                   keyed ? "a secret" : "no secret", gone ? 8 : 6, gone ? "gone" : "damaged", got,
                   kvt_session_len(s), (unsigned long long)(st1.bad - st0.bad),
                   (unsigned long long)(st1.stale - st0.stale));
            CHECK(got == 0 && kvt_session_len(s) == 0);
            CHECK(st1.misses == st0.misses + 1);
            if (gone) CHECK(st1.stale == st0.stale + 1 && st1.bad == st0.bad);
            else CHECK(st1.bad == st0.bad + 1);
            CHECKF(!exists(c, blk) && !exists(c, part), "the %s block was not deleted", gone ? "gone" : "damaged");
            CHECK(index_entries(c) == 0);
            CHECK(exists(c, first)); /* the good blocks stay */
            CHECK_OK(kvt_session_sync(s, t, LONG, NULL)); /* prefilled from empty */
            CHECK(kvt_test_digest(s, m) == want);
            kvt_session_free(s);
            /* uploaded anew: a hit again, exact */
            kvt_remote_upload(a, 0, cold, LONG);
            CHECK(kvt_remote_drain(a, 10));
            s = fetch(a, 0, m, t, LONG, &got);
            CHECKF(got == LONG, "after a new upload, a hit of %zu", got);
            CHECK(kvt_test_digest(s, m) == want);
            kvt_session_free(s);
            free(v);
            free(blk);
            free(first);
        }
        kvt_remote_window_bytes = 8u << 20;
        kvt_remote_close(a);
    }
    kvt_remote_part_bytes = 1u << 20;
    damage_fx_close(&f);
}
/* A byte flipped in each part of block b in turn (parts of 1000 bytes, a
 * block a window): each a clean miss, counted bad, the damaged block
 * deleted; a block of the first window (b 0) is found before the load
 * starts, so the session keeps the 256 tokens it held; one of a later
 * window (b 6) leaves it empty. The negative control: the restore's one
 * check of each block skipped (kvt_remote_fault_skip_block_check, and the
 * HMAC with a secret), the blocks still said checked: a flip in the rows
 * is loaded, a hit of other bits, which the test sees. keyed: the tier has
 * a secret. */
static void flip_sweep(kvt_redis *c, kvt_remote *a, kvt_model *m, const int32_t *t, kvt_session *cold, uint64_t want,
                       uint32_t b, bool keyed)
{
    char *blk = block_named(c, b);
    CHECK(blk);
    size_t l0 = 0;
    uint8_t *p0 = get_value(c, blk, &l0);
    CHECK(p0 && l0 == 1000);
    size_t len = kvt_rd32(p0 + 44) + 56, text = kvt_rd32(p0 + 48 + 4 * 128);
    size_t rows0 = 48 + 4 * 128 + 4 + text, rows1 = len - 8, np = (len + 999) / 1000, rows_parts = 0, wrong = 0;
    free(p0);
    for (size_t p = 0; p < np; p++) {
        char part[300];
        if (p) snprintf(part, sizeof part, "{%s}#%zu", blk, p);
        else snprintf(part, sizeof part, "%s", blk);
        size_t pl = 0;
        uint8_t *v = get_value(c, part, &pl);
        CHECK(v && pl == (p + 1 < np ? 1000 : len - 1000 * p));
        size_t at = pl / 2, off = 1000 * p + at;
        bool in_rows = off >= rows0 && off < rows1;
        v[at] ^= 0x10;
        CHECK(set_value(c, part, v, pl));
        kvt_remote_stats st0, st1;
        kvt_remote_stats_get(a, &st0);
        kvt_session *s = NULL;
        size_t got = 99;
        CHECK_OK(kvt_session_new(&s, m, NULL));
        CHECK_OK(kvt_session_sync(s, t, 256, NULL));
        kvt_remote_restore(a, 0, s, t, LONG, 256, &got);
        kvt_remote_stats_get(a, &st1);
        CHECKF(got == 0 && kvt_session_len(s) == (b ? 0 : 256) && st1.bad == st0.bad + 1,
               "block %u, a byte flipped at %zu (part %zu): a hit of %zu, the session left with %zu tokens, bad +%llu",
               b, off, p, got, kvt_session_len(s), (unsigned long long)(st1.bad - st0.bad));
        CHECKF(!exists(c, part) && index_entries(c) == 0, "block %u part %zu: the damage was not deleted", b, p);
        kvt_session_free(s);
        /* the control: the same flip with the one check skipped */
        kvt_remote_upload(a, 0, cold, LONG);
        CHECK(kvt_remote_drain(a, 10));
        CHECK(set_value(c, part, v, pl));
        kvt_remote_fault_skip_block_check = true;
        kvt_remote_skip_mac = keyed;
        s = fetch(a, 0, m, t, LONG, &got);
        kvt_remote_fault_skip_block_check = kvt_remote_skip_mac = false;
        if (in_rows) {
            rows_parts++;
            wrong += got == LONG && kvt_test_digest(s, m) != want;
        }
        kvt_session_free(s);
        v[at] ^= 0x10; /* the block as it was, and the entry again if the control's load dropped it */
        CHECK(set_value(c, part, v, pl));
        kvt_remote_upload(a, 0, cold, LONG);
        CHECK(kvt_remote_drain(a, 10));
        CHECK(index_entries(c) == 1);
        free(v);
    }
    printf("    %s, block %u: a byte flipped in each of its %zu parts: each a miss, deleted; the control loaded "
           "%zu of the %zu flips in its rows\n", keyed ? "a secret" : "no secret", b, np, wrong, rows_parts);
    CHECK(rows_parts > 0);
    CHECKF(wrong == rows_parts, "the control loaded %zu of %zu flips in the rows: the check is not the one that "
           "keeps them out", wrong, rows_parts);
    /* a hit again, exact */
    size_t got = 0;
    kvt_session *s = fetch(a, 0, m, t, LONG, &got);
    CHECK(got == LONG && kvt_test_digest(s, m) == want);
    kvt_session_free(s);
    free(blk);
}

static void flips(rsrv *rp)
{
    rsrv r = *rp;
    damage_fx f;
    damage_fx_open(&f, &r, "fleet secret 3\n", 23);
    if (!f.ok) { damage_fx_close(&f); return; }
    kvt_model *m = f.m;
    const int32_t *t = f.t;
    kvt_redis *c = f.c;
    kvt_session *cold = f.cold;
    uint64_t want = f.want;
    const char *secret = f.secret;
    kvt_remote_part_bytes = 1000;
    kvt_remote_window_bytes = 1; /* a block a window */
    for (int keyed = 0; keyed < 2; keyed++) {
        CHECK(cmd_ok(c, "FLUSHALL", NULL, NULL));
        kvt_remote *a = tier(&r, m, keyed ? secret : NULL, NULL, 0);
        CHECK(a);
        kvt_remote_upload(a, 0, cold, LONG);
        CHECK(kvt_remote_drain(a, 10));
        flip_sweep(c, a, m, t, cold, want, 0, keyed);
        flip_sweep(c, a, m, t, cold, want, 6, keyed);
        kvt_remote_close(a);
    }
    damage_fx_close(&f);
}

static void remote_later_window_damage_body(rsrv *rp)
{
    later_window_damage(rp);
    switches_reset();
    flips(rp);
    switches_reset();
}
REDIS_TEST(remote_later_window_damage, NULL)
