/* ds4-tiny for the tests that run the engine's session and snapshot code
 * through it (tests/test_ds4.c, tests/test_session.c,
 * tests/test_snapshot.c): the model, token sequences, and a session's
 * state captured and compared. Static: each file has its own copy of what
 * it uses. */
#ifndef KVT_TEST_DS4_TINY_H
#define KVT_TEST_DS4_TINY_H

#include "test.h"
#include "session/testing.h"
#include "session/snapshot.h"
#include "base/buf.h"

#include <stdlib.h>
#include <string.h>

#define TINY_SEED 7

static __attribute__((unused)) kvt_model *tiny(void)
{
    kvt_model *m = NULL;
    if (kvt_model_preset(&m, "ds4-tiny", TINY_SEED, NULL) != KVT_OK) {
        printf("    ds4-tiny: %s\n", kvt_errmsg());
        return NULL;
    }
    return m;
}

/* BOS then pseudo-random bytes. */
static __attribute__((unused)) void seqb(int32_t *t, size_t n, uint64_t seed)
{
    t[0] = 256;
    for (size_t i = 1; i < n; i++) t[i] = (int32_t)(kvt_test_rand(&seed) % 256);
}

typedef struct state { float *logits; uint8_t *cache; size_t len; uint32_t V; } state;

static __attribute__((unused)) void state_free(state *s) { free(s->logits); free(s->cache); *s = (state){0}; }

static __attribute__((unused)) int capture(const kvt_session *s, const kvt_model *m, state *o)
{
    kvt_model_info i;
    kvt_model_info_get(m, &i);
    o->V = i.n_vocab;
    o->logits = malloc(i.n_vocab * sizeof(float));
    if (!o->logits) return KVT_ENOMEM;
    memcpy(o->logits, kvt_session_logits(s), i.n_vocab * sizeof(float));
    return kvt_session_cache_bytes(s, &o->cache, &o->len);
}

static __attribute__((unused)) bool equal(const state *a, const state *b)
{
    return a->V == b->V && !memcmp(a->logits, b->logits, a->V * sizeof(float)) && a->len == b->len &&
           !memcmp(a->cache, b->cache, a->len);
}

static __attribute__((unused)) int run(kvt_model *m, const int32_t *t, size_t n, const uint32_t *ch, size_t nc, uint32_t th, state *o)
{
    kvt_session *s = NULL;
    kvt_session_opts so = {.n_threads = th};
    int rc = kvt_session_new(&s, m, &so);
    if (!rc) rc = ch ? kvt_session_sync_chunks(s, t, n, ch, nc, NULL) : kvt_session_sync(s, t, n, NULL);
    if (!rc) rc = capture(s, m, o);
    kvt_session_free(s);
    return rc;
}

/* The same RAM snapshot with its record stored without the state. */
static __attribute__((unused)) int without_state(const uint8_t *snap, size_t len, uint8_t **out, size_t *olen)
{
    kvt_snap_info in;
    kvt_wbuf b = {0};
    int rc = kvt_snap_parse_raw(snap, len, &in);
    if (!rc) rc = kvt_snap_without_state(snap, in.rec_len, &b);
    if (!rc && b.len == 0) kvt_wbuf_put(&b, snap, in.rec_len); /* nothing to drop */
    kvt_wbuf_put(&b, snap + in.rec_len, len - in.rec_len);
    if (!rc && b.oom) rc = KVT_ENOMEM;
    if (rc) { kvt_wbuf_free(&b); return rc; }
    *out = b.p;
    *olen = b.len;
    return KVT_OK;
}

#endif
