/* kvtier serve: the OpenAI- and Anthropic-compatible HTTP server and its
 * cache tiers.
 *
 * Transport: libmicrohttpd, one thread per connection, loopback by default.
 * Request bodies are bounded; the API shapes (parsing, response JSON, SSE
 * events, error bodies) live in api.c, the chat templates and their markers
 * (the turn markers the prefill checkpoints at) in template.c.
 *
 * Inference: one worker thread runs jobs from a bounded queue (the CPU is
 * the bottleneck; a full queue answers 429 with Retry-After). Streaming
 * responses read from the job's output buffer; while a long prefill runs the
 * reader sends an SSE comment at least every KEEPALIVE seconds, and a client
 * that goes away cancels the prefill at its next chunk (what was computed
 * stays in the session, and checkpoint saves still happen).
 *
 * Tiers, in the order a request tries them:
 *   1. RAM: a pool of live sessions under --kv-ram-mb. The request goes to
 *      the session with the longest reusable prefix, matched on token ids or,
 *      when the client resent the conversation as text, on the rendered bytes
 *      of the session's exact sampled tokens (only the new suffix is then
 *      tokenized, so a sampled token that the tokenizer would split
 *      differently does not break reuse). Least recently used sessions are
 *      saved to disk (reason evict) and dropped beyond the budget.
 *   2. Disk: the store (store.c), when it covers more of the prompt.
 *   3. Prefill, with snapshot saves per the save policy (policy.c).
 *
 * With several API keys every key is a tenant with its own cache namespace:
 * sessions of one key are never candidates for another's requests, each key
 * has its own share of the RAM budget and its own disk store directory with
 * an equal share of --kv-disk-mb, and its own metrics: no key can read, time
 * or evict another's entries, nor read its figures on /metrics. Keys are
 * compared as keyed 128-bit digests (a per-process random secret), in
 * constant time and against every configured key, so the time a check takes
 * says nothing of a configured key's bytes or length.
 */
#include "api.h"
#include "model.h"
#include "server.h"
#include "snapshot.h"
#include "store.h"
#include "util.h"

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <microhttpd.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#define KEEPALIVE 2          /* seconds between SSE comments while waiting */
#define MAX_POOL 64

/* ---- metrics ---- */

static const double hist_bounds[] = {0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60};
#define N_BOUNDS (sizeof hist_bounds / sizeof hist_bounds[0])
typedef struct hist { uint64_t bucket[N_BOUNDS + 1]; double sum; uint64_t count; } hist;

static void hist_add(hist *h, double v)
{
    size_t i = 0;
    while (i < N_BOUNDS && v > hist_bounds[i]) i++;
    h->bucket[i]++;
    h->sum += v;
    h->count++;
}

typedef struct metrics {
    uint64_t requests[5][6];      /* endpoint x status class (2xx..5xx, 429 separately) */
    uint64_t prompt_tokens, prefilled, generated;
    uint64_t reused_ram, reused_disk, hits_ram, hits_disk, misses;
    uint64_t ram_evictions, disk_saves, disk_save_errors, canceled;
    hist load, save, prefill;
} metrics;

/* ---- jobs ---- */

typedef struct job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;                     /* handler/response + worker */
    kvt_request req;
    kvt_api api;
    bool stream, done, canceled;
    int status;                   /* HTTP status when done */
    char *body;                   /* non-streaming: the full response */
    kvt_wbuf out;                 /* streaming: SSE bytes produced so far */
    size_t sent;
    char tier[16];
    size_t reused;
    int tenant;
    int32_t *toks;                /* the prompt's tokens (tokenized by the handler) */
    size_t n_toks;
    struct job *next;
} job;

typedef struct pooled {
    kvt_session *s;
    uint64_t last_used;
    int tenant;
} pooled;

/* One cache namespace per API key: its own RAM share, its own disk store
 * (an equal share of the disk budget) and its own metrics, so no key can
 * hit, time or evict another key's entries or read its figures. */
typedef struct tenant {
    const char *key;          /* NULL: the open server's only tenant */
    uint8_t digest[16];       /* key_digest(key) */
    kvt_store *store;
    char dir[4200];
    char ns[24];              /* "ns-<hash>": the directory's name, the operator view's label */
    metrics mx;               /* under server.mu */
    size_t ram, ram_entries;  /* the pool's bytes and sessions, published by the worker (server.mu) */
    size_t queued;            /* jobs waiting (server.mu) */
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
    char model_id[128];
    tenant tn[MAX_TENANTS];
    size_t n_tn;
    pooled pool[MAX_POOL];
    size_t n_pool;
    uint64_t clock;
    pthread_mutex_t mu;           /* queue, metrics */
    pthread_cond_t cv;
    job *head, *tail;
    size_t queued;
    bool stopping, busy;
    pthread_t worker;
    uint64_t refused;             /* requests of no tenant: 401s, metrics-key 403s (server.mu) */
    uint8_t secret[192];          /* random per process: the key digests' secret */
    uint8_t metrics_digest[16];
    bool has_metrics_key;
    long started;
} server;

static job *job_new(void)
{
    job *j = kvt_calloc(1, sizeof *j);
    if (!j) return NULL;
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->refs = 2;
    return j;
}

static void job_unref(job *j)
{
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left) return;
    kvt_request_free(&j->req);
    free(j->toks);
    free(j->body);
    kvt_wbuf_free(&j->out);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

static void job_emit(job *j, char *sse)
{
    if (!sse) return;
    pthread_mutex_lock(&j->mu);
    kvt_wbuf_put(&j->out, sse, strlen(sse));
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    free(sse);
}

static bool job_canceled(job *j)
{
    pthread_mutex_lock(&j->mu);
    bool c = j->canceled;
    pthread_mutex_unlock(&j->mu);
    return c;
}

static void job_finish(job *j, int status, char *body)
{
    pthread_mutex_lock(&j->mu);
    j->status = status;
    if (j->stream && body) {
        kvt_wbuf_put(&j->out, body, strlen(body));
        free(body);
    } else {
        j->body = body;
    }
    j->done = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

/* ---- the RAM tier ---- */

/* RAM held by a tenant's sessions (all tenants: -1). */
static size_t pool_bytes(server *sv, int t)
{
    size_t b = 0;
    for (size_t i = 0; i < sv->n_pool; i++)
        if (t < 0 || sv->pool[i].tenant == t) b += kvt_session_bytes(sv->pool[i].s);
    return b;
}

static size_t pool_count(server *sv, int t)
{
    size_t n = 0;
    for (size_t i = 0; i < sv->n_pool; i++) n += sv->pool[i].tenant == t;
    return n;
}

static void pool_drop(server *sv, size_t i, const char *reason)
{
    kvt_session *s = sv->pool[i].s;
    kvt_store *store = sv->tn[sv->pool[i].tenant].store;
    if (store && kvt_session_len(s) >= sv->o.policy.min_tokens) {
        double t0 = kvt_now();
        bool created = false;
        int rc = kvt_store_save_new(store, s, kvt_session_len(s), reason, NULL, &created);
        metrics *mx = &sv->tn[sv->pool[i].tenant].mx;
        pthread_mutex_lock(&sv->mu);
        hist_add(&mx->save, kvt_now() - t0);
        if (rc) mx->disk_save_errors++;
        else if (created) mx->disk_saves++;
        pthread_mutex_unlock(&sv->mu);
    }
    kvt_session_free(s);
    sv->pool[i] = sv->pool[--sv->n_pool];
}

/* Longest prefix of a session's exact tokens whose rendered bytes start the
 * prompt text: the retokenization defence. Returns the token count. */
static size_t text_match(const kvt_model *m, const kvt_session *s, const char *text, size_t len)
{
    const int32_t *t = kvt_session_tokens(s);
    size_t n = kvt_session_len(s), off = 0, k = 0;
    for (; k < n; k++) {
        const char *p;
        size_t pl;
        if (kvt_token_piece(m, t[k], &p, &pl) != KVT_OK || pl > len - off || memcmp(text + off, p, pl)) break;
        off += pl;
    }
    return k;
}

/* Tokens of the prompt for a session whose first k tokens render the start
 * of the prompt text: its exact tokens, then the suffix tokenized alone. */
static int splice(const kvt_model *m, const kvt_session *s, size_t k, const char *text, size_t len,
                  int32_t **out, size_t *n)
{
    const int32_t *t = kvt_session_tokens(s);
    size_t off = 0;
    for (size_t i = 0; i < k; i++) {
        const char *p;
        size_t pl;
        kvt_token_piece(m, t[i], &p, &pl);
        off += pl;
    }
    int32_t *suf = NULL;
    size_t ns = 0;
    int rc = kvt_tokenizer_encode(m->tok, text + off, len - off, false, true, &suf, &ns);
    if (rc) return rc;
    int32_t *all = kvt_malloc((k + ns + 1) * sizeof *all);
    if (!all) { free(suf); return KVT_ENOMEM; }
    memcpy(all, t, k * sizeof *all);
    memcpy(all + k, suf, ns * sizeof *all);
    free(suf);
    *out = all;
    *n = k + ns;
    return KVT_OK;
}

static size_t common_prefix(const int32_t *a, size_t na, const int32_t *b, size_t nb)
{
    size_t n = na < nb ? na : nb, i = 0;
    while (i < n && a[i] == b[i]) i++;
    return i;
}

/* ---- running a job ---- */

struct prog { server *sv; job *j; double last; };

static bool on_progress(void *user, size_t done, size_t total)
{
    struct prog *p = user;
    if (job_canceled(p->j)) return false;
    double now = kvt_now();
    if (p->j->stream && now - p->last >= 1.0) {
        char buf[96];
        snprintf(buf, sizeof buf, ": prefill %zu/%zu\n\n", done, total);
        job_emit(p->j, kvt_strndup(buf, strlen(buf)));
        p->last = now;
    }
    return true;
}

/* Emit text that is complete: hold back a partial UTF-8 sequence at the end
 * and anything that could still become a stop sequence. */
static size_t safe_len(const char *text, size_t len, const kvt_request *r)
{
    size_t keep = len;
    for (size_t i = 0; i < r->n_stop; i++) {
        size_t sl = strlen(r->stop[i]);
        for (size_t k = sl > 1 ? sl - 1 : 0; k > 0; k--)
            if (k <= len && !memcmp(text + len - k, r->stop[i], k)) {
                if (len - k < keep) keep = len - k;
                break;
            }
    }
    /* back up to a UTF-8 boundary */
    size_t b = keep;
    while (b > 0 && b > keep - 4 && ((unsigned char)text[b - 1] & 0xC0) == 0x80) b--;
    if (b > 0) {
        unsigned char c = (unsigned char)text[b - 1];
        size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        if (keep - (b - 1) < need) keep = b - 1;
    }
    return keep;
}

/* A prompt over the context, in the words clients recognise (Claude Code
 * "prompt is too long", OpenAI code "context_length_exceeded"), so that they
 * compact or stop instead of retrying. */
static char *ctx_error(kvt_api api, size_t n, uint32_t ctx, bool stream)
{
    char msg[200];
    if (api == KVT_API_MESSAGES)
        snprintf(msg, sizeof msg, "prompt is too long: %zu tokens > %u maximum", n, ctx);
    else
        snprintf(msg, sizeof msg, "This model's maximum context length is %u tokens, but the prompt has %zu tokens: "
                 "it exceeds the context window.", ctx, n);
    char *body = stream ? kvt_stream_error(api, 400, msg) : kvt_error_json(api, 400, msg);
    if (!body || api == KVT_API_MESSAGES || stream) return body;
    json_t *o = json_loads(body, 0, NULL);
    json_t *e = o ? json_object_get(o, "error") : NULL;
    if (json_is_object(e)) {
        json_object_set_new(e, "code", json_string("context_length_exceeded"));
        char *t = kvt_json_dumps(o, JSON_COMPACT);
        if (t) { free(body); body = t; }
    }
    json_decref(o);
    return body;
}

static void remember_calls(server *sv, int tenant, const char *text, const kvt_tool_call *calls, size_t n)
{
    pthread_mutex_lock(&sv->replay_mu);
    for (size_t i = 0; i < n; i++) {
        replay *e = &sv->rp[sv->rp_next++ % MAX_REPLAY];
        free(e->text);
        e->text = kvt_strndup(text + calls[i].raw_off, calls[i].raw_len);
        e->len = e->text ? calls[i].raw_len : 0;
        e->tenant = tenant;
        snprintf(e->id, sizeof e->id, "%s", calls[i].id ? calls[i].id : "");
    }
    pthread_mutex_unlock(&sv->replay_mu);
}

struct replay_ctx { server *sv; int tenant; };

/* Called by the parser with replay_mu held. */
static const char *replay_lookup(void *user, const char *call_id, size_t *len)
{
    struct replay_ctx *rc = user;
    for (size_t i = 0; i < MAX_REPLAY; i++) {
        const replay *e = &rc->sv->rp[i];
        if (e->text && e->tenant == rc->tenant && !strcmp(e->id, call_id)) {
            *len = e->len;
            return e->text;
        }
    }
    return NULL;
}

/* The log-probabilities of the sampled tokens, for a request that asked:
 * per token its own and its n_top most likely alternatives (kvt_logprob
 * entries), computed from the logits it was sampled from. The pieces follow
 * each other in the text, so a token's text offset is the sum of the
 * lengths before it. An append that fails stops both lists (the wbuf's oom
 * is sticky), so what was recorded stays a consistent prefix. */
typedef struct lp_rec {
    kvt_wbuf tok, top;
    size_t n_top;
    size_t sent, sent_end;      /* tokens gone out with a delta; where the next begins */
} lp_rec;

static void lp_add(lp_rec *l, const kvt_model *m, int32_t id, double lp, const int32_t *top_id,
                   const double *top_lp)
{
    kvt_logprob e = {"", 0, lp};
    if (kvt_token_piece(m, id, &e.bytes, &e.len) != KVT_OK) e.bytes = "", e.len = 0;
    for (size_t k = 0; k < l->n_top; k++) {
        kvt_logprob a = {"", 0, top_lp[k]};
        if (kvt_token_piece(m, top_id[k], &a.bytes, &a.len) != KVT_OK) a.bytes = "", a.len = 0;
        kvt_wbuf_put(&l->top, &a, sizeof a);
    }
    if (!l->top.oom) kvt_wbuf_put(&l->tok, &e, sizeof e);
}

static size_t lp_count(const lp_rec *l)
{
    size_t n = l->tok.len / sizeof(kvt_logprob);
    if (l->n_top && l->top.len / (l->n_top * sizeof(kvt_logprob)) < n)
        n = l->top.len / (l->n_top * sizeof(kvt_logprob));
    return n;
}

/* The tokens not sent yet whose text begins before byte end: they go out
 * with the text up to end (a token cut by a stop sequence still counts). */
static kvt_logprobs lp_take(lp_rec *l, size_t end)
{
    const kvt_logprob *tok = (const kvt_logprob *)l->tok.p, *top = (const kvt_logprob *)l->top.p;
    size_t n = lp_count(l), i = l->sent, off = l->sent_end;
    kvt_logprobs v = {tok ? tok + i : NULL, top ? top + i * l->n_top : NULL, 0, l->n_top, off};
    while (i < n && off < end) off += tok[i++].len;
    v.n = i - l->sent;
    l->sent = i;
    l->sent_end = off;
    return v;
}

/* All the tokens whose text begins before end, from the first. */
static kvt_logprobs lp_all(const lp_rec *l, size_t end)
{
    lp_rec from0 = *l;
    from0.sent = from0.sent_end = 0;
    return lp_take(&from0, end);
}

/* Where a thinking-mode reply stands while it streams (kvt_think_parts with
 * the request's template): text[start, end) is certainly reasoning; once
 * answering, the reasoning ended at end and the answer begins at answer
 * (what lies between, the </think> and what the template writes around it,
 * is neither). Outside thinking mode the whole reply is answer: answering
 * from the start, start = end = answer = 0. */
typedef struct think_pos {
    bool answering;
    size_t start, end, answer;
} think_pos;

/* Move the position over the text grown to len bytes. */
static void think_advance(think_pos *t, const kvt_template *tpl, const char *text, size_t len)
{
    if (t->answering) return;
    kvt_think k;
    t->answering = kvt_think_parts(tpl, text, len, true, &k);
    t->start = k.rs;
    t->end = k.re;
    t->answer = k.as;
}

/* Streaming: send what of the reply is settled and not sent yet; *emitted
 * is where the next piece begins. ok: how far the text is settled (no
 * partial character, stop sequence or tool-call opener before it); lp_end
 * (>= ok): the answer piece carries the log-probabilities of the tokens that
 * begin before it. The reasoning goes out as reasoning pieces, the answer as
 * text, and the </think> between them as neither (the template writes it
 * back between the two). */
static void stream_settled(job *j, kvt_request *r, const char *id, const char *model_name, long created,
                           const char *text, size_t ok, size_t lp_end, const think_pos *t, size_t *emitted,
                           lp_rec *lp)
{
    if (*emitted < t->start) *emitted = t->start;
    size_t e = ok < t->end ? ok : t->end;
    if (e > *emitted) {
        kvt_logprobs lv = lp_take(lp, e);
        job_emit(j, kvt_stream_reasoning_lp(r, id, model_name, text + *emitted, e - *emitted, created, &lv));
        *emitted = e;
    }
    if (!t->answering || *emitted < t->end) return;
    if (*emitted < t->answer) *emitted = t->answer;
    if (ok > *emitted) {
        kvt_logprobs lv = lp_take(lp, lp_end);
        job_emit(j, kvt_stream_delta_lp(r, id, model_name, text + *emitted, ok - *emitted, created, &lv));
        *emitted = ok;
    }
}

/* The pool's bytes and sessions per tenant, for /metrics. Only the worker
 * touches the pool's sessions; readers see the figures it publishes here
 * when a job finishes. */
static void pool_publish(server *sv)
{
    size_t ram[MAX_TENANTS], n[MAX_TENANTS];
    for (size_t t = 0; t < sv->n_tn; t++) {
        ram[t] = pool_bytes(sv, (int)t);
        n[t] = pool_count(sv, (int)t);
    }
    pthread_mutex_lock(&sv->mu);
    for (size_t t = 0; t < sv->n_tn; t++) {
        sv->tn[t].ram = ram[t];
        sv->tn[t].ram_entries = n[t];
    }
    pthread_mutex_unlock(&sv->mu);
}

/* job_finish, with the pool's figures published first: a client that reads
 * /metrics after its response sees the pool as its request left it. */
static void job_done(server *sv, job *j, int status, char *body)
{
    pool_publish(sv);
    job_finish(j, status, body);
}

/* Whether the template's marker q (n tokens) is at toks[i]. */
static bool marker_at(const int32_t *q, size_t nq, const int32_t *toks, size_t n, size_t i)
{
    return nq && n - i >= nq && !memcmp(toks + i, q, nq * sizeof *toks);
}

static void run_job(server *sv, job *j)
{
    kvt_model *m = sv->m;
    kvt_request *r = &j->req;
    char id[48];
    snprintf(id, sizeof id, "%s%llx%04x",
             j->api == KVT_API_MESSAGES ? "msg_" : j->api == KVT_API_COMPLETIONS ? "cmpl-"
             : j->api == KVT_API_RESPONSES ? "resp_" : "chatcmpl-",
             (unsigned long long)time(NULL), (unsigned)(sv->clock & 0xffff));
    long created = (long)time(NULL);
    /* The model id goes back as the client sent it (agent clients check it
     * against their own), or the served one when it sent none. */
    const char *model_name = r->model && *r->model ? r->model : sv->model_id;
    int32_t *toks = j->toks;
    size_t n = j->n_toks;
    j->toks = NULL;
    kvt_sampler *smp = NULL;
    kvt_wbuf text = {0};
    int rc;
    /* tier 1: RAM. Per session: the common token prefix, or (when the client
     * resent our output as text) the longer prefix matched on its bytes. */
    size_t best = SIZE_MAX, reuse = 0;
    int32_t *best_alt = NULL;
    size_t best_alt_n = 0;
    kvt_store *store = sv->tn[j->tenant].store;
    metrics *mx = &sv->tn[j->tenant].mx;
    for (size_t i = 0; i < sv->n_pool; i++) {
        if (sv->pool[i].tenant != j->tenant) continue;
        kvt_session *s = sv->pool[i].s;
        size_t c = common_prefix(kvt_session_tokens(s), kvt_session_len(s), toks, n);
        size_t k = text_match(m, s, r->prompt, r->prompt_len);
        int32_t *alt = NULL;
        size_t na = 0;
        if (k > c && splice(m, s, k, r->prompt, r->prompt_len, &alt, &na) == KVT_OK) c = k;
        if (c > reuse) {
            reuse = c;
            best = i;
            free(best_alt);
            best_alt = alt;
            best_alt_n = na;
        } else {
            free(alt);
        }
    }
    if (best_alt) { free(toks); toks = best_alt; n = best_alt_n; }
    if (n > sv->o.n_ctx) {
        job_done(sv, j, 400, ctx_error(j->api, n, sv->o.n_ctx, j->stream));
        free(toks);
        return;
    }
    /* tier 2: disk, when it covers more than RAM does */
    size_t disk_match = 0;
    int64_t disk_id = -1;
    if (store) kvt_store_lookup(store, m, toks, n, &disk_match, &disk_id);
    kvt_session *s = NULL;
    size_t from_disk = 0, reused = reuse;
    const char *tier = reuse ? "ram" : "none";
    /* A session is extended in place when the prompt continues it. A prompt
     * that leaves it part way (another conversation on the same system
     * prompt) gets a copy, so the session it shares a prefix with stays
     * whole; a short shared prefix is not worth a copy. */
    bool extend = best != SIZE_MAX && reuse > 0 && reuse >= disk_match && reuse == kvt_session_len(sv->pool[best].s);
    bool fork = !extend && best != SIZE_MAX && reuse >= 256 && reuse >= disk_match;
    if (extend) {
        s = sv->pool[best].s;
        sv->pool[best].last_used = ++sv->clock;
    } else {
        kvt_session *src = fork ? sv->pool[best].s : NULL;
        if (fork) sv->pool[best].last_used = ++sv->clock; /* keep the source out of the eviction below */
        /* a tenant's share: ram_bytes / tenants and MAX_POOL / tenants sessions */
        size_t share = sv->o.ram_bytes / sv->n_tn, slots = MAX_POOL / sv->n_tn;
        while (pool_count(sv, j->tenant) > (fork ? 1u : 0u) &&
               (pool_count(sv, j->tenant) >= slots || pool_bytes(sv, j->tenant) > share)) {
            size_t lru = SIZE_MAX;
            for (size_t i = 0; i < sv->n_pool; i++)
                if (sv->pool[i].tenant == j->tenant && sv->pool[i].s != src &&
                    (lru == SIZE_MAX || sv->pool[i].last_used < sv->pool[lru].last_used))
                    lru = i;
            if (lru == SIZE_MAX) break;
            pool_drop(sv, lru, "evict");
            pthread_mutex_lock(&sv->mu);
            mx->ram_evictions++;
            pthread_mutex_unlock(&sv->mu);
        }
        kvt_session_opts so = {.n_ctx = sv->o.n_ctx, .n_threads = sv->o.n_threads,
                               .checkpoint_interval = kvt_save_policy_grid(&sv->o.policy)};
        if ((rc = kvt_session_new(&s, m, &so)) || (src && (rc = kvt_session_clone(s, src)))) {
            kvt_session_free(s);
            job_done(sv, j, 500, j->stream ? kvt_stream_error(j->api, 500, kvt_errmsg())
                                         : kvt_error_json(j->api, 500, kvt_errmsg()));
            free(toks);
            return;
        }
        sv->pool[sv->n_pool++] = (pooled){s, ++sv->clock, j->tenant};
        reused = src ? reuse : 0;
        tier = src ? "ram" : "none";
        if (!src && disk_match && store) {
            double t0 = kvt_now();
            size_t got = 0;
            rc = kvt_store_restore_prefix(store, s, toks, n, &got);
            pthread_mutex_lock(&sv->mu);
            hist_add(&mx->load, kvt_now() - t0);
            pthread_mutex_unlock(&sv->mu);
            if (!rc && got) { from_disk = reused = got; tier = "disk"; }
        }
    }
    /* tier 3: prefill the rest, leaving a checkpoint where the last user turn
     * begins: the next conversation on the same prompt forks from there */
    const kvt_template *tpl = kvt_template_for(m); /* its turn markers, if it has any */
    kvt_template_tokens tt; /* and the tokens that end its turns: generation stops at them and at EOS */
    kvt_template_tokens_get(tpl, m, &tt);
    size_t mark = 0;
    bool opening = tt.n_assistant > 0; /* no assistant turn before the mark: a conversation's first request */
    for (size_t i = n; tt.n_user && i-- > 1;) {
        if (!mark && marker_at(tt.user, tt.n_user, toks, n, i)) mark = i;
        if (mark && marker_at(tt.assistant, tt.n_assistant, toks, n, i)) opening = false;
    }
    /* the mark goes where the last user message's own text begins, when the
     * template wrote it (after its turn's marker, and in Gemma after the
     * system prompt the first user turn carries): the common prefix of the
     * prompt's tokens and those of the prompt up to there */
    if (r->fork_at != SIZE_MAX && r->fork_at <= r->prompt_len) {
        int32_t *pt = NULL;
        size_t np = 0;
        if (kvt_tokenizer_encode(m->tok, r->prompt, r->fork_at, r->prompt_has_bos ? false : m->info.add_bos,
                                 r->prompt_special, &pt, &np) == KVT_OK) {
            size_t f = common_prefix(pt, np, toks, n);
            if (f > 0 && f < n) { mark = f; opening = r->opening; }
        }
        free(pt);
    }
    kvt_session_set_mark(s, mark);
    struct prog pg = {sv, j, kvt_now()};
    s->progress = on_progress;
    s->progress_user = &pg;
    kvt_usage u = {(uint32_t)n, 0, 0, 0};
    size_t kept = 0;
    double t0 = kvt_now();
    rc = kvt_session_sync(s, toks, n, &kept);
    double t_prefill = kvt_now() - t0;
    s->progress = NULL;
    /* What was really not recomputed: a ds4 session that leaves its old
     * timeline goes back to a checkpoint, which may lie before the match. */
    reused = kept;
    if (!reused) tier = "none";
    u.cached_tokens = (uint32_t)(reused < n ? reused : n);
    snprintf(j->tier, sizeof j->tier, "%s", tier);
    pthread_mutex_lock(&sv->mu);
    mx->prompt_tokens += n;
    if (!strcmp(tier, "ram")) { mx->hits_ram++; mx->reused_ram += reused; }
    else if (!strcmp(tier, "disk")) { mx->hits_disk++; mx->reused_disk += reused; }
    else mx->misses++;
    hist_add(&mx->prefill, t_prefill);
    mx->prefilled += kvt_session_len(s) > kept ? kvt_session_len(s) - kept : 0;
    pthread_mutex_unlock(&sv->mu);
    j->reused = u.cached_tokens;
    /* saves per the policy (also after a cancel: what was computed is kept) */
    if (store) {
        size_t written = 0; /* new entries, not re-saves of stored ones */
        double ts = kvt_now();
        /* a conversation's first request also saves where its last user
         * turn begins: new conversations on the same prompt fork there,
         * after a restart too */
        kvt_store_apply_policy(store, s, &sv->o.policy, kvt_session_len(s), from_disk, opening ? mark : 0,
                               &written);
        pthread_mutex_lock(&sv->mu);
        if (written) hist_add(&mx->save, kvt_now() - ts);
        mx->disk_saves += written;
        pthread_mutex_unlock(&sv->mu);
        if (written && !rc) {
            size_t cold = (n - sv->o.policy.trim_tokens) / sv->o.policy.align_tokens * sv->o.policy.align_tokens;
            if (cold > u.cached_tokens) u.created_tokens = (uint32_t)(cold - u.cached_tokens);
            if (u.created_tokens + u.cached_tokens > n) u.created_tokens = (uint32_t)(n - u.cached_tokens);
        }
    }
    if (rc) {
        if (rc == KVT_ECANCELED) {
            pthread_mutex_lock(&sv->mu);
            mx->canceled++;
            pthread_mutex_unlock(&sv->mu);
        }
        int status = rc == KVT_ECTX ? 400 : rc == KVT_ECANCELED ? 499 : 500;
        job_done(sv, j, status, j->stream ? kvt_stream_error(j->api, status == 499 ? 400 : status, kvt_errmsg())
                                        : kvt_error_json(j->api, status == 499 ? 400 : status, kvt_errmsg()));
        free(toks);
        return;
    }
    /* generation */
    kvt_sampler_opts sopt = {.temperature = r->temperature, .top_p = r->top_p, .top_k = r->top_k,
                             .seed = r->has_seed ? r->seed : (uint64_t)time(NULL) ^ sv->clock};
    kvt_sampler_new(&smp, &sopt);
    uint32_t max_new = r->max_tokens ? r->max_tokens : sv->o.max_tokens;
    const char *finish = "length", *stop_hit = NULL;
    size_t emitted = 0;
    think_pos th = {.answering = !r->thinking};
    lp_rec lp = {.n_top = r->logprobs ? r->top_logprobs : 0};
    if (lp.n_top > KVT_API_MAX_TOP_LOGPROBS) lp.n_top = KVT_API_MAX_TOP_LOGPROBS; /* the arrays below */
    if (lp.n_top > m->info.n_vocab) lp.n_top = m->info.n_vocab;
    if (j->stream) job_emit(j, kvt_stream_begin(r, id, model_name, &u, created));
    while (u.completion_tokens < max_new && smp) {
        if (job_canceled(j)) { finish = "stop"; break; }
        const float *logits = kvt_session_logits(s);
        int32_t t = kvt_sampler_sample(smp, logits, m->info.n_vocab);
        /* from the raw logits, before temperature and top-p: the model's
         * distribution, which is what OpenAI reports */
        int32_t top_id[KVT_API_MAX_TOP_LOGPROBS] = {0};
        double top_lp[KVT_API_MAX_TOP_LOGPROBS] = {0}, t_lp = 0;
        if (r->logprobs) t_lp = kvt_logprob_top(logits, m->info.n_vocab, t, (uint32_t)lp.n_top, top_id, top_lp);
        bool eos = t == m->info.eos;
        for (size_t k = 0; k < tt.n_end; k++) eos |= t == tt.end[k];
        if (kvt_session_len(s) < sv->o.n_ctx) {
            if (kvt_session_decode(s, t)) break; /* keep the session's timeline complete */
        } else {
            finish = "context";
            break;
        }
        if (eos) { finish = "stop"; break; }
        u.completion_tokens++;
        const char *p;
        size_t pl;
        if (kvt_token_piece(m, t, &p, &pl) == KVT_OK) kvt_wbuf_put(&text, p, pl);
        /* every token through the one that completes </think> is reasoning */
        if (!th.answering) {
            u.reasoning_tokens++;
            think_advance(&th, r->tmpl, text.p ? (const char *)text.p : "", text.len);
        }
        if (r->logprobs) lp_add(&lp, m, t, t_lp, top_id, top_lp);
        for (size_t i = 0; i < r->n_stop && !stop_hit; i++) {
            const char *hit = text.len ? memmem(text.p, text.len, r->stop[i], strlen(r->stop[i])) : NULL;
            if (hit) { stop_hit = r->stop[i]; text.len = (size_t)(hit - (const char *)text.p); }
        }
        if (stop_hit) { finish = "stop"; break; }
        if (j->stream) {
            const char *tx = text.p ? (const char *)text.p : "";
            size_t ok = safe_len(tx, text.len, r);
            /* never stream the start of a tool call as text (a request that
             * offers tools was rendered by a template: r->tmpl is set) */
            if (r->n_tools && th.answering) {
                size_t t_ok = th.answer + r->tmpl->tool_calls_text_len(tx + th.answer, text.len - th.answer);
                if (t_ok < ok) ok = t_ok;
            }
            stream_settled(j, r, id, model_name, created, tx, ok, ok, &th, &emitted, &lp);
        }
    }
    pthread_mutex_lock(&sv->mu);
    mx->generated += u.completion_tokens;
    pthread_mutex_unlock(&sv->mu);
    /* a partial UTF-8 tail left at the end is not text: drop it */
    size_t final_len = safe_len((const char *)text.p, text.len, &(kvt_request){0});
    const char *tp = text.p ? (const char *)text.p : "";
    kvt_tool_call *calls = NULL;
    size_t n_calls = 0, text_end = final_len;
    /* in thinking mode out of the answer only, raw_off still counting from
     * tp (what the replay hook gets back) */
    if (kvt_reply_tool_calls(r, tp, final_len, &calls, &n_calls, &text_end) == KVT_OK && n_calls)
        remember_calls(sv, j->tenant, tp, calls, n_calls);
    /* the text: before the calls when there are some (in thinking mode the
     * reasoning, the </think> and the answer, which the response splits) */
    size_t upto = n_calls ? text_end : final_len;
    /* every generated token before the calls or a stop is reported, also
     * the bytes of a partial character the text leaves out (spelt as bytes) */
    size_t lp_end = n_calls ? text_end : text.len;
    kvt_logprobs all = lp_all(&lp, lp_end);
    if (j->stream) {
        /* the rest: a reply cut inside its reasoning is all reasoning */
        think_pos fin = {.answering = true};
        if (r->thinking) {
            kvt_think k;
            kvt_think_parts(r->tmpl, tp, upto, false, &k);
            fin = (think_pos){true, k.rs, k.re, k.as};
        }
        stream_settled(j, r, id, model_name, created, tp, upto, lp_end, &fin, &emitted, &lp);
        /* the end repeats the text that went out as deltas (Responses) */
        job_done(sv, j, 200, kvt_stream_end_lp(r, id, model_name, tp, upto, calls, n_calls, finish, stop_hit, &u,
                                             created, &all));
    } else {
        job_done(sv, j, 200, kvt_response_json_lp(r, id, model_name, tp, upto, calls, n_calls, finish, stop_hit, &u,
                                                created, &all));
    }
    kvt_tool_calls_free(calls, n_calls);
    kvt_wbuf_free(&lp.tok);
    kvt_wbuf_free(&lp.top);
    kvt_wbuf_free(&text);
    kvt_sampler_free(smp);
    free(toks);
}

static void *worker_main(void *arg)
{
    server *sv = arg;
    for (;;) {
        pthread_mutex_lock(&sv->mu);
        while (!sv->head && !sv->stopping) pthread_cond_wait(&sv->cv, &sv->mu);
        if (!sv->head) { pthread_mutex_unlock(&sv->mu); break; }
        job *j = sv->head;
        sv->head = j->next;
        if (!sv->head) sv->tail = NULL;
        sv->queued--;
        sv->tn[j->tenant].queued--;
        sv->busy = true;
        bool stopping = sv->stopping;
        pthread_mutex_unlock(&sv->mu);
        if (stopping) job_finish(j, 503, kvt_error_json(j->api, 503, "the server is shutting down"));
        else if (job_canceled(j)) job_finish(j, 499, kvt_error_json(j->api, 400, "the client went away"));
        else run_job(sv, j);
        job_unref(j);
        pthread_mutex_lock(&sv->mu);
        sv->busy = false;
        pthread_cond_broadcast(&sv->cv);
        pthread_mutex_unlock(&sv->mu);
    }
    return NULL;
}

/* ---- HTTP ---- */

typedef struct conn {
    kvt_wbuf body;
    bool too_big;
} conn;

static enum MHD_Result send_text(struct MHD_Connection *c, int status, const char *type, const char *text,
                                 const char *extra_h, const char *extra_v)
{
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_MUST_COPY);
    MHD_add_response_header(resp, "Content-Type", type);
    if (extra_h) MHD_add_response_header(resp, extra_h, extra_v);
    enum MHD_Result r = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    return r;
}

static enum MHD_Result send_json(struct MHD_Connection *c, int status, char *json)
{
    enum MHD_Result r = send_text(c, status, "application/json", json ? json : "{}", NULL, NULL);
    free(json);
    return r;
}

static int endpoint_index(kvt_api api)
{
    return api == KVT_API_CHAT ? 0 : api == KVT_API_COMPLETIONS ? 1 : api == KVT_API_MESSAGES ? 2 : 4;
}

/* A request of tenant tnt (-1: of no tenant, refused) with its status. */
static void count_request(server *sv, int tnt, int ep, int status)
{
    int cls = status == 429 ? 5 : status / 100 - 2; /* 2xx 3xx 4xx 5xx, then 429 apart */
    if (cls < 0 || cls > 3) cls = 3;
    pthread_mutex_lock(&sv->mu);
    if (tnt < 0) sv->refused++;
    else sv->tn[tnt].mx.requests[ep][cls]++;
    pthread_mutex_unlock(&sv->mu);
}

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    job *j = cls;
    pthread_mutex_lock(&j->mu);
    for (;;) {
        if (j->out.len > j->sent) {
            size_t n = j->out.len - j->sent;
            if (n > max) n = max;
            memcpy(buf, j->out.p + j->sent, n);
            j->sent += n;
            pthread_mutex_unlock(&j->mu);
            return (ssize_t)n;
        }
        if (j->done) { pthread_mutex_unlock(&j->mu); return MHD_CONTENT_READER_END_OF_STREAM; }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += KEEPALIVE;
        if (pthread_cond_timedwait(&j->cv, &j->mu, &ts) == ETIMEDOUT && j->out.len == j->sent && !j->done) {
            static const char ka[] = ": keepalive\n\n";
            size_t n = sizeof ka - 1 < max ? sizeof ka - 1 : max;
            memcpy(buf, ka, n);
            pthread_mutex_unlock(&j->mu);
            return (ssize_t)n;
        }
    }
    (void)pos;
}

static void stream_free(void *cls)
{
    job *j = cls;
    pthread_mutex_lock(&j->mu);
    if (!j->done) j->canceled = true; /* the client went away */
    pthread_mutex_unlock(&j->mu);
    job_unref(j);
}

/* A key's digest: XXH3-128 keyed with the process's random secret. Keys
 * are compared as digests, so a comparison takes the same time whatever
 * the lengths, and the digests of configured keys are computed once, at
 * start: hashing a request's key takes time that depends on that key
 * alone. The secret makes the digests unpredictable, so a caller cannot
 * choose keys whose digests share bytes with a configured key's. */
static void key_digest(const server *sv, const char *key, uint8_t out[16])
{
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_withSecret(key, strlen(key), sv->secret, sizeof sv->secret));
    memcpy(out, c.digest, 16);
}

/* 1 when the digests are equal, 0 otherwise, in time independent of their
 * bytes (no early exit, no branch on the data). */
static unsigned same_digest(const uint8_t a[16], const uint8_t b[16])
{
    volatile unsigned char d = 0;
    for (size_t i = 0; i < 16; i++) d |= (unsigned char)(a[i] ^ b[i]);
    return 1u & (((unsigned)d - 1u) >> 8);
}

#define KEY_METRICS (-2) /* authorized(): the --metrics-key */

/* The tenant a request belongs to, KEY_METRICS for the metrics key, or -1
 * when its key is missing or wrong. Every configured key is compared, and
 * the match is selected without a branch, so the time taken does not tell
 * which key matched, or whether one did. */
static int authorized(server *sv, struct MHD_Connection *c)
{
    if (!sv->tn[0].key) return 0;
    const char *auth = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    const char *xk = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "x-api-key");
    const char *given = xk ? xk : auth && !strncmp(auth, "Bearer ", 7) ? auth + 7 : NULL;
    if (!given) return -1;
    uint8_t d[16];
    key_digest(sv, given, d);
    int found = -1;
    for (size_t t = 0; t < sv->n_tn; t++) {
        int eq = (int)same_digest(d, sv->tn[t].digest);
        found ^= (found ^ (int)t) & -eq;
    }
    int eq = (int)(same_digest(d, sv->metrics_digest) & (unsigned)sv->has_metrics_key);
    found ^= (found ^ KEY_METRICS) & -eq;
    return found;
}

static char *metrics_text(server *sv, int tnt);

/* Give a JSON object body a max_tokens of 1 when it has none. */
static void add_max_tokens(kvt_wbuf *body)
{
    json_t *o = json_loadb(body->p ? (const char *)body->p : "", body->len, 0, NULL);
    if (json_is_object(o) && !json_object_get(o, "max_tokens")) {
        json_object_set_new(o, "max_tokens", json_integer(1));
        char *t = kvt_json_dumps(o, JSON_COMPACT);
        if (t) {
            body->len = 0;
            kvt_wbuf_put(body, t, strlen(t));
            free(t);
        }
    }
    json_decref(o);
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    server *sv = cls;
    conn *cn = *con_cls;
    if (!cn) {
        cn = kvt_calloc(1, sizeof *cn);
        if (!cn) return MHD_NO;
        *con_cls = cn;
        return MHD_YES;
    }
    if (*upload_size) {
        if (cn->body.len + *upload_size > sv->o.max_body) cn->too_big = true;
        else kvt_wbuf_put(&cn->body, upload, *upload_size);
        *upload_size = 0;
        return MHD_YES;
    }
    (void)version;
    kvt_api api = strstr(url, "/messages") ? KVT_API_MESSAGES
                : !strcmp(url, "/v1/completions") ? KVT_API_COMPLETIONS
                : strstr(url, "/responses") ? KVT_API_RESPONSES : KVT_API_CHAT;
    bool is_get = !strcmp(method, "GET"), is_head = !strcmp(method, "HEAD"), is_post = !strcmp(method, "POST");
    if (is_get && !strcmp(url, "/health")) return send_text(c, 200, "application/json", "{\"status\":\"ok\"}", NULL, NULL);
    if (is_head && !strcmp(url, "/")) return send_text(c, 200, "text/plain", "", NULL, NULL);
    int tnt = authorized(sv, c);
    if (tnt == -1) {
        count_request(sv, -1, 3, 401);
        return send_json(c, 401, kvt_error_json(api, 401, "invalid or missing API key"));
    }
    /* /metrics: a key's own figures; the metrics key's, every key's */
    if (is_get && !strcmp(url, "/metrics")) {
        char *t = metrics_text(sv, tnt);
        enum MHD_Result r = send_text(c, 200, "text/plain; version=0.0.4", t ? t : "", NULL, NULL);
        free(t);
        return r;
    }
    if (tnt == KEY_METRICS) {
        count_request(sv, -1, 3, 403);
        return send_json(c, 403, kvt_error_json(api, 403, "this key reads GET /metrics only"));
    }
    if (is_get && !strcmp(url, "/v1/models")) return send_json(c, 200, kvt_models_json(sv->model_id, sv->started));
    bool counting = !strcmp(url, "/v1/messages/count_tokens");
    bool known = counting || !strcmp(url, "/v1/chat/completions") || !strcmp(url, "/v1/completions") ||
                 !strcmp(url, "/v1/messages") || !strcmp(url, "/chat/completions") || !strcmp(url, "/messages") ||
                 !strcmp(url, "/v1/responses") || !strcmp(url, "/responses");
    if (!known) {
        count_request(sv, tnt, 3, 404);
        char msg[160];
        snprintf(msg, sizeof msg, "no route for %s %.100s", method, url);
        return send_json(c, 404, kvt_error_json(api, 404, msg));
    }
    int ep = endpoint_index(api);
    if (!is_post) {
        count_request(sv, tnt, ep, 405);
        return send_json(c, 405, kvt_error_json(api, 400, "use POST"));
    }
    if (cn->too_big) {
        count_request(sv, tnt, ep, 413);
        char msg[128];
        snprintf(msg, sizeof msg, "request body exceeds %zu bytes", sv->o.max_body);
        return send_json(c, 413, kvt_error_json(api, 413, msg));
    }
    job *j = job_new();
    if (!j) return MHD_NO;
    int status = 400;
    if (counting) add_max_tokens(&cn->body); /* count_tokens bodies carry no max_tokens */
    struct replay_ctx rpc = {sv, tnt};
    kvt_parse_opts po = {.keep_volatile = sv->o.keep_volatile, .replay = replay_lookup, .replay_user = &rpc};
    pthread_mutex_lock(&sv->replay_mu);
    int rc = kvt_request_parse_opts(&j->req, api, cn->body.p ? (const char *)cn->body.p : "", cn->body.len, sv->m,
                                    &po, &status);
    pthread_mutex_unlock(&sv->replay_mu);
    /* By default any model id is served, as llama.cpp's server does: agent
     * clients send their own ids (Claude Code its claude-* names) and
     * would otherwise need configuring; the id is echoed back. */
    if (!rc && sv->o.strict_model && j->req.model && strcmp(j->req.model, sv->model_id)) {
        char msg[512];
        snprintf(msg, sizeof msg, "model '%.200s' is not served here (this server serves '%s')", j->req.model,
                 sv->model_id);
        rc = kvt_fail(KVT_ENOENT, "%s", msg);
        status = 404;
    }
    if (rc) {
        count_request(sv, tnt, ep, status);
        char *body = kvt_error_json(api, status, kvt_errmsg());
        j->refs = 1; /* never queued: no worker reference */
        job_unref(j);
        return send_json(c, status, body);
    }
    /* tokenize here, so that a prompt over the context is a 400 before any
     * streaming starts (the tokenizer is immutable and thread-safe) */
    const kvt_request *rq = &j->req;
    rc = kvt_tokenizer_encode(sv->m->tok, rq->prompt, rq->prompt_len, rq->prompt_has_bos ? false : sv->m->info.add_bos,
                              rq->prompt_special, &j->toks, &j->n_toks);
    if (!rc && counting) {
        char body[64];
        snprintf(body, sizeof body, "{\"input_tokens\":%zu}", j->n_toks);
        j->refs = 1;
        job_unref(j);
        return send_text(c, 200, "application/json", body, NULL, NULL);
    }
    if (!rc && j->n_toks > sv->o.n_ctx) {
        count_request(sv, tnt, ep, 400);
        char *body = ctx_error(api, j->n_toks, sv->o.n_ctx, false);
        j->refs = 1;
        job_unref(j);
        return send_json(c, 400, body);
    }
    if (rc) {
        count_request(sv, tnt, ep, 400);
        char *body = kvt_error_json(api, 400, kvt_errmsg());
        j->refs = 1;
        job_unref(j);
        return send_json(c, 400, body);
    }
    j->api = api;
    j->tenant = tnt;
    j->stream = j->req.stream;
    pthread_mutex_lock(&sv->mu);
    bool full = sv->queued >= sv->o.queue || sv->stopping;
    if (!full) {
        if (sv->tail) sv->tail->next = j;
        else sv->head = j;
        sv->tail = j;
        sv->queued++;
        sv->tn[tnt].queued++;
        pthread_cond_broadcast(&sv->cv);
    }
    pthread_mutex_unlock(&sv->mu);
    if (full) {
        count_request(sv, tnt, ep, sv->stopping ? 503 : 429);
        j->refs = 1;
        job_unref(j);
        if (sv->stopping) return send_json(c, 503, kvt_error_json(api, 503, "the server is shutting down"));
        char *body = kvt_error_json(api, 429, "the inference queue is full; retry shortly");
        enum MHD_Result r = send_text(c, 429, "application/json", body, "Retry-After", "2");
        free(body);
        return r;
    }
    if (j->stream) { /* headers now; keepalive comments while queued or prefilling */
        count_request(sv, tnt, ep, 200);
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, j, stream_free);
        MHD_add_response_header(resp, "Content-Type", "text/event-stream");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        enum MHD_Result r = MHD_queue_response(c, 200, resp);
        MHD_destroy_response(resp);
        return r;
    }
    /* Wait, watching the socket: a client that hangs up cancels its job. */
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    int fd = ci ? ci->connect_fd : -1;
    pthread_mutex_lock(&j->mu);
    while (!j->done) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 250 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        pthread_cond_timedwait(&j->cv, &j->mu, &ts);
        if (!j->done && fd >= 0) {
            struct pollfd pfd = {.fd = fd, .events = POLLRDHUP};
            if (poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR))) j->canceled = true;
        }
    }
    pthread_mutex_unlock(&j->mu);
    int st = j->status == 499 ? 400 : j->status;
    count_request(sv, tnt, ep, st);
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(j->body ? j->body : "{}"),
                                                                j->body ? j->body : "{}", MHD_RESPMEM_MUST_COPY);
    MHD_add_response_header(resp, "Content-Type", "application/json");
    char hv[64];
    snprintf(hv, sizeof hv, "%s; reused=%zu", j->tier[0] ? j->tier : "none", j->reused);
    MHD_add_response_header(resp, "X-KVTier-Cache", hv);
    enum MHD_Result r = MHD_queue_response(c, (unsigned)st, resp);
    MHD_destroy_response(resp);
    job_unref(j);
    return r;
}

static void request_done(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    conn *cn = *con_cls;
    if (!cn) return;
    kvt_wbuf_free(&cn->body);
    free(cn);
    *con_cls = NULL;
    (void)cls; (void)c; (void)toe;
}

/* ---- metrics text ---- */

/* One tenant's figures, copied for printing; lbl is the label that names
 * it in the operator view ("" in a key's own view). */
typedef struct mview {
    metrics mx;
    kvt_store_stats ds;
    size_t ram, ram_entries, queued;
    uint64_t ram_budget;
    char lbl[40];               /* tenant="ns-..." or "" */
} mview;

/* "{tenant=\"ns-..\",extra}", "{extra}", or "" when both are empty. */
static const char *labels(char *out, size_t cap, const mview *v, const char *extra)
{
    const char *sep = v->lbl[0] && extra[0] ? "," : "";
    if (!v->lbl[0] && !extra[0]) out[0] = 0;
    else snprintf(out, cap, "{%s%s%s}", v->lbl, sep, extra);
    return out;
}

static void put_hist(kvt_wbuf *b, const char *name, const char *help, const mview *v, size_t nv, size_t off)
{
    char line[320], l[128], ex[32];
    snprintf(line, sizeof line, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    kvt_wbuf_put(b, line, strlen(line));
    for (size_t k = 0; k < nv; k++) {
        const hist *h = (const hist *)((const char *)&v[k].mx + off);
        uint64_t cum = 0;
        for (size_t i = 0; i <= N_BOUNDS; i++) {
            cum += h->bucket[i];
            if (i < N_BOUNDS) snprintf(ex, sizeof ex, "le=\"%g\"", hist_bounds[i]);
            else snprintf(ex, sizeof ex, "le=\"+Inf\"");
            snprintf(line, sizeof line, "%s_bucket%s %llu\n", name, labels(l, sizeof l, &v[k], ex),
                     (unsigned long long)cum);
            kvt_wbuf_put(b, line, strlen(line));
        }
        labels(l, sizeof l, &v[k], "");
        snprintf(line, sizeof line, "%s_sum%s %.6f\n%s_count%s %llu\n", name, l, h->sum, name, l,
                 (unsigned long long)h->count);
        kvt_wbuf_put(b, line, strlen(line));
    }
}

/* A family's HELP and TYPE lines. */
static void put_head(kvt_wbuf *b, const char *name, const char *type, const char *help)
{
    char line[320];
    snprintf(line, sizeof line, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
    kvt_wbuf_put(b, line, strlen(line));
}

static void put_val(kvt_wbuf *b, const char *name, const mview *v, const char *extra, unsigned long long x)
{
    char line[320], l[128];
    snprintf(line, sizeof line, "%s%s %llu\n", name, labels(l, sizeof l, v, extra), x);
    kvt_wbuf_put(b, line, strlen(line));
}

/* The Prometheus text for tenant tnt, its own figures and nothing of any
 * other key's; for KEY_METRICS every tenant's, each series labelled
 * tenant="ns-<hash>" (the name of its disk directory), and the requests
 * that belong to no tenant. */
static char *metrics_text(server *sv, int tnt)
{
    size_t first = tnt >= 0 ? (size_t)tnt : 0, nv = tnt >= 0 ? 1 : sv->n_tn;
    mview *v = kvt_calloc(nv, sizeof *v);
    if (!v) return NULL;
    for (size_t k = 0; k < nv; k++) {
        const tenant *tt = &sv->tn[first + k];
        if (tt->store && kvt_store_stats_get(tt->store, &v[k].ds) != KVT_OK) memset(&v[k].ds, 0, sizeof v[k].ds);
        v[k].ram_budget = sv->o.ram_bytes / sv->n_tn;
        if (tnt < 0) snprintf(v[k].lbl, sizeof v[k].lbl, "tenant=\"%s\"", tt->ns);
    }
    pthread_mutex_lock(&sv->mu);
    for (size_t k = 0; k < nv; k++) {
        const tenant *tt = &sv->tn[first + k];
        v[k].mx = tt->mx;
        v[k].ram = tt->ram;
        v[k].ram_entries = tt->ram_entries;
        v[k].queued = tt->queued;
    }
    uint64_t refused = sv->refused;
    pthread_mutex_unlock(&sv->mu);

    kvt_wbuf b = {0};
    static const char *eps[] = {"chat_completions", "completions", "messages", "other", "responses"};
    static const char *cls[] = {"2xx", "3xx", "4xx", "5xx", "5xx", "429"};
    char ex[96];
    put_head(&b, "kvtier_requests_total", "counter", "HTTP requests by endpoint and status class.");
    for (size_t k = 0; k < nv; k++)
        for (int e = 0; e < 5; e++)
            for (int c = 0; c < 6; c++)
                if (v[k].mx.requests[e][c]) {
                    snprintf(ex, sizeof ex, "endpoint=\"%s\",status=\"%s\"", eps[e], cls[c]);
                    put_val(&b, "kvtier_requests_total", &v[k], ex, v[k].mx.requests[e][c]);
                }
#define FAMILY(name, type, help, extra, expr)                                  \
    do {                                                                       \
        put_head(&b, name, type, help);                                        \
        for (size_t k = 0; k < nv; k++) {                                      \
            const mview *w = &v[k];                                            \
            put_val(&b, name, w, extra, (unsigned long long)(expr));           \
        }                                                                      \
    } while (0)
#define FAMILY2(name, type, help, e1, x1, e2, x2)                              \
    do {                                                                       \
        put_head(&b, name, type, help);                                        \
        for (size_t k = 0; k < nv; k++) {                                      \
            const mview *w = &v[k];                                            \
            put_val(&b, name, w, e1, (unsigned long long)(x1));                \
            put_val(&b, name, w, e2, (unsigned long long)(x2));                \
        }                                                                      \
    } while (0)
    FAMILY("kvtier_prompt_tokens_total", "counter", "Prompt tokens received.", "", w->mx.prompt_tokens);
    FAMILY("kvtier_prefilled_tokens_total", "counter", "Prompt tokens computed by prefill.", "", w->mx.prefilled);
    FAMILY("kvtier_generated_tokens_total", "counter", "Tokens generated.", "", w->mx.generated);
    FAMILY2("kvtier_reused_tokens_total", "counter", "Prompt tokens reused, by tier.", "tier=\"ram\"",
            w->mx.reused_ram, "tier=\"disk\"", w->mx.reused_disk);
    FAMILY2("kvtier_cache_hits_total", "counter", "Requests served from a tier.", "tier=\"ram\"", w->mx.hits_ram,
            "tier=\"disk\"", w->mx.hits_disk);
    FAMILY("kvtier_cache_misses_total", "counter", "Requests no tier could serve.", "", w->mx.misses);
    FAMILY2("kvtier_cache_bytes", "gauge", "Bytes held, by tier.", "tier=\"ram\"", w->ram, "tier=\"disk\"",
            w->ds.bytes);
    FAMILY2("kvtier_cache_budget_bytes", "gauge", "Bytes a tier may hold (a key's share with several keys).",
            "tier=\"ram\"", w->ram_budget, "tier=\"disk\"", w->ds.budget);
    FAMILY2("kvtier_cache_entries", "gauge", "Entries held, by tier.", "tier=\"ram\"", w->ram_entries,
            "tier=\"disk\"", w->ds.snapshots);
    FAMILY2("kvtier_cache_evictions_total", "counter", "Evictions, by tier.", "tier=\"ram\"", w->mx.ram_evictions,
            "tier=\"disk\"", w->ds.evictions);
    FAMILY("kvtier_disk_saves_total", "counter", "Snapshots written.", "", w->mx.disk_saves);
    FAMILY("kvtier_canceled_total", "counter", "Prefills stopped because the client went away.", "", w->mx.canceled);
    FAMILY("kvtier_queue_depth", "gauge", "Jobs waiting for the worker.", "", w->queued);
#undef FAMILY
#undef FAMILY2
    put_hist(&b, "kvtier_load_seconds", "Time to restore a prefix from disk.", v, nv, offsetof(metrics, load));
    put_hist(&b, "kvtier_save_seconds", "Time to save snapshots.", v, nv, offsetof(metrics, save));
    put_hist(&b, "kvtier_prefill_seconds", "Time to prefill a prompt.", v, nv, offsetof(metrics, prefill));
    if (tnt < 0) {
        mview none = {0};
        put_head(&b, "kvtier_refused_requests_total", "counter",
                 "Requests of no key: a missing or wrong key, or the metrics key on another endpoint.");
        put_val(&b, "kvtier_refused_requests_total", &none, "", refused);
    }
    free(v);
    kvt_wbuf_put(&b, "", 1);
    if (b.oom) { kvt_wbuf_free(&b); return NULL; }
    return (char *)b.p;
}

/* ---- lifecycle ---- */

/* libmicrohttpd's messages, minus the one every client disconnect causes. */
static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    if (strstr(fmt, "Failed to send")) return;
    vfprintf(stderr, fmt, ap);
    (void)cls;
}

static volatile sig_atomic_t got_signal;
static void on_signal(int sig) { got_signal = sig; }

/* n random bytes from the kernel. */
static int fill_random(uint8_t *p, size_t n)
{
    while (n) {
        ssize_t got = getrandom(p, n, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return kvt_fail(KVT_EIO, "getrandom: %s", strerror(errno));
        p += got;
        n -= (size_t)got;
    }
    return KVT_OK;
}

/* The keys: none empty, none repeated, the metrics key none of them. */
static int check_keys(const kvt_server_opts *o)
{
    for (size_t i = 0; i < o->n_keys; i++) {
        if (!o->api_keys[i] || !o->api_keys[i][0]) return kvt_fail(KVT_EINVAL, "API key %zu is empty", i + 1);
        for (size_t k = 0; k < i; k++)
            if (!strcmp(o->api_keys[i], o->api_keys[k]))
                return kvt_fail(KVT_EINVAL, "API key %zu repeats key %zu", i + 1, k + 1);
        if (o->metrics_key && !strcmp(o->api_keys[i], o->metrics_key))
            return kvt_fail(KVT_EINVAL, "the metrics key is also API key %zu", i + 1);
    }
    if (o->metrics_key && (!o->metrics_key[0] || !o->n_keys))
        return kvt_fail(KVT_EINVAL, o->n_keys ? "the metrics key is empty" : "a metrics key needs API keys");
    return KVT_OK;
}

int kvt_serve(const kvt_server_opts *opts)
{
    /* SIGTERM and SIGINT stay blocked in this thread, and so in every
     * thread started below, except while it waits in sigsuspend: a signal
     * can neither land between the check of got_signal and the wait nor
     * go to a thread that does not wait for it. One that comes while the
     * server starts is pending until then. */
    sigset_t stop, old_mask;
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGINT);
    pthread_sigmask(SIG_BLOCK, &stop, &old_mask);
    struct sigaction sa = {.sa_handler = on_signal}, old_term, old_int;
    sigemptyset(&sa.sa_mask);
    got_signal = 0;
    sigaction(SIGTERM, &sa, &old_term);
    sigaction(SIGINT, &sa, &old_int);
    int rc = check_keys(opts);
    server *sv = rc ? NULL : kvt_calloc(1, sizeof *sv);
    if (!sv) { if (!rc) rc = KVT_ENOMEM; goto restore; }
    sv->o = *opts;
    pthread_mutex_init(&sv->mu, NULL);
    pthread_mutex_init(&sv->replay_mu, NULL);
    pthread_cond_init(&sv->cv, NULL);
    sv->started = (long)time(NULL);
    if ((rc = fill_random(sv->secret, sizeof sv->secret))) goto out;
    if ((rc = kvt_model_open(&sv->m, opts->model))) goto out;
    if (!sv->o.n_ctx) sv->o.n_ctx = sv->m->info.n_ctx_train;
    snprintf(sv->model_id, sizeof sv->model_id, "%s", opts->model_id ? opts->model_id : sv->m->info.name);
    sv->n_tn = opts->n_keys ? opts->n_keys : 1;
    if (sv->n_tn > MAX_TENANTS) {
        rc = kvt_fail(KVT_EINVAL, "at most %d API keys", MAX_TENANTS);
        goto out;
    }
    if (opts->metrics_key) {
        key_digest(sv, opts->metrics_key, sv->metrics_digest);
        sv->has_metrics_key = true;
    }
    /* The disk budget is the total across keys: each key's store holds at
     * most an equal share, as each key's sessions hold at most an equal
     * share of the RAM budget. A static share keeps a key's entries out of
     * every other key's reach (no key's use evicts another's, or shows in
     * another's evictions), at the price of the room an idle key leaves
     * unused. */
    uint64_t disk_share = opts->disk_bytes / sv->n_tn;
    if (opts->disk_bytes && !disk_share) disk_share = 1; /* 0 would mean the default */
    for (size_t t = 0; t < sv->n_tn; t++) {
        tenant *tt = &sv->tn[t];
        tt->key = opts->n_keys ? opts->api_keys[t] : NULL;
        if (tt->key) {
            key_digest(sv, tt->key, tt->digest);
            /* a directory per key, named by a hash of it */
            snprintf(tt->ns, sizeof tt->ns, "ns-%016llx", (unsigned long long)XXH3_64bits(tt->key, strlen(tt->key)));
        }
        if (!opts->disk_dir) continue;
        if (tt->key) snprintf(tt->dir, sizeof tt->dir, "%s/%s", opts->disk_dir, tt->ns);
        else snprintf(tt->dir, sizeof tt->dir, "%s", opts->disk_dir);
        if ((rc = kvt_store_open(&tt->store, tt->dir, disk_share))) {
            fprintf(stderr, "kvtier: disk cache disabled for %s: %s\n", tt->dir, kvt_errmsg());
            tt->store = NULL;
        }
    }
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(opts->port)};
    if (inet_pton(AF_INET, opts->host, &addr.sin_addr) != 1) {
        rc = kvt_fail(KVT_EINVAL, "--host '%s' is not an IPv4 address", opts->host);
        goto out;
    }
    if (pthread_create(&sv->worker, NULL, worker_main, sv)) { rc = kvt_fail(KVT_ENOMEM, "worker thread"); goto out; }
    struct MHD_Daemon *d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ITC |
                                                MHD_USE_ERROR_LOG,
                                            opts->port, NULL, NULL, handle, sv,
                                            MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL, MHD_OPTION_SOCK_ADDR, &addr,
                                            MHD_OPTION_NOTIFY_COMPLETED, request_done, sv,
                                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)0, MHD_OPTION_END);
    if (!d) {
        rc = kvt_fail(KVT_EIO, "cannot listen on %s:%u: %s", opts->host, opts->port, strerror(errno));
        pthread_mutex_lock(&sv->mu);
        sv->stopping = true;
        pthread_cond_broadcast(&sv->cv);
        pthread_mutex_unlock(&sv->mu);
        pthread_join(sv->worker, NULL);
        goto out;
    }
    signal(SIGPIPE, SIG_IGN);
    fprintf(stderr, "kvtier: serving %s on http://%s:%u (context %u, disk cache %s)\n", sv->model_id, opts->host,
            opts->port, sv->o.n_ctx, sv->tn[0].store ? opts->disk_dir : "off");
    if (opts->ready) opts->ready(opts->ready_user);
    sigset_t wait = old_mask;  /* the caller's mask, with the two let through */
    sigdelset(&wait, SIGTERM);
    sigdelset(&wait, SIGINT);
    while (!got_signal) sigsuspend(&wait);
    fprintf(stderr, "kvtier: signal %d: stopping\n", (int)got_signal);
    MHD_socket ls = MHD_quiesce_daemon(d); /* stop accepting */
    if (ls != MHD_INVALID_SOCKET) close(ls);
    pthread_mutex_lock(&sv->mu);
    sv->stopping = true;                   /* queued jobs get 503; the running one finishes */
    pthread_cond_broadcast(&sv->cv);
    pthread_mutex_unlock(&sv->mu);
    pthread_join(sv->worker, NULL);
    MHD_stop_daemon(d);
    while (sv->n_pool) pool_drop(sv, sv->n_pool - 1, "shutdown");
    rc = KVT_OK;
out:
    while (sv->n_pool) pool_drop(sv, sv->n_pool - 1, "shutdown");
    for (size_t t = 0; t < sv->n_tn; t++) kvt_store_close(sv->tn[t].store);
    kvt_model_close(sv->m);
    for (size_t i = 0; i < MAX_REPLAY; i++) free(sv->rp[i].text);
    pthread_mutex_destroy(&sv->mu);
    pthread_mutex_destroy(&sv->replay_mu);
    pthread_cond_destroy(&sv->cv);
    explicit_bzero(sv->secret, sizeof sv->secret);
    free(sv);
restore:
    /* the mask first: a signal still pending goes to on_signal, not to the
     * caller's disposition (by default, the end of the process) */
    pthread_sigmask(SIG_SETMASK, &old_mask, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    sigaction(SIGINT, &old_int, NULL);
    return rc;
}
