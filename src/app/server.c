/* kvtier serve: the OpenAI- and Anthropic-compatible HTTP server and its
 * cache tiers.
 *
 * Transport: libmicrohttpd in epoll mode with a small thread pool (see
 * the HTTP section), loopback by default. Request bodies, the time to send
 * a request, the connections per address and in all, and a stream's
 * unsent bytes are bounded; the API shapes live in api.c (parsing) and
 * reply.c (response JSON, SSE events, error bodies), the chat templates and their markers
 * (the turn markers the prefill checkpoints at) in template.c. Every URL the
 * server answers is a row of one route table (routes[], below).
 *
 * Inference: one worker thread, the scheduler (below), runs up to
 * --parallel requests at once, batched into one forward pass per step; the
 * requests behind them wait in a bounded queue (the CPU is the bottleneck;
 * a full queue answers 429 with Retry-After). Streaming responses read from
 * the job's output buffer; while a long prefill runs the reader sends an
 * SSE comment at least every KEEPALIVE seconds, and a client that goes
 * away frees its slot at the next step (a prefill's computed part stays in
 * the session, and checkpoint saves still happen).
 *
 * A request runs in three parts: the tiers (tiers.c) pick the session and
 * how much of the prompt it holds (RAM pool under --kv-ram-mb, then the disk
 * store); the prefill computes the rest, a chunk per step, with snapshot
 * saves per the save policy (policy.c) when it is done; the generation loop
 * (generate.c) samples the reply a token per step and emits its events into
 * the job's output buffer. The scheduler never waits on the disk: saves and
 * disk loads run on the store threads (storeq.c), a request whose prefix is
 * loading waits out of the steps, and a lookup that cannot get the store
 * within a few ms is a miss. The scheduler's thread counts every round in
 * which it entered the store's blocking lock all the same
 * (kvt_store_mark_stepper): kvtier_steps_waited_on_store_total, 0 unless
 * a save or a load runs on it (tests/test_storeq.c).
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
#include "serve/api.h"
#include "serve/generate.h"
#include "arch/model.h"
#include "app/server_int.h"
#include "session/memory.h"
#include "session/snapshot.h"
#include "store/store.h"
#include "store/storedir.h"
#include "store/storeq.h"
#include "store/remote.h"
#include "serve/tiers.h"
#include "base/util.h"

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <linux/sockios.h>
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
#include <strings.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#define KEEPALIVE 2          /* seconds between SSE comments while waiting */
#define STREAM_MAX_UNSENT (1u << 20) /* bytes a stream buffers for a client that does not read */
#define PREFILL_BESIDE_DECODE 128 /* prompt tokens in a pass that also decodes (else a session chunk) */
#define STORE_BUSY_MS 200    /* the store threads' writes wait this long for another process's lock,
                              * then retries later (storeq.c) */

/* The jobs, tenants and server types are in server_int.h; the /metrics
 * text in server_metrics.c. */

static job *job_new(void)
{
    job *j = kvt_calloc(1, sizeof *j);
    if (!j) return NULL;
    pthread_mutex_init(&j->mu, NULL);
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
    free(j);
}

/* The connection waiting for the job goes on (under j->mu, so that a
 * wakeup is never lost: the handler and the stream reader suspend it
 * under the same lock, after seeing nothing to send). libmicrohttpd's
 * resume of a connection that is not suspended would cancel its next
 * suspend, so only a suspended one is resumed. */
static void job_wake(job *j)
{
    if (!j->suspended) return;
    j->suspended = false;
    MHD_resume_connection(j->c);
}

/* Bytes for the stream's client (under j->mu). When none were pending,
 * the client's time to take them starts now (t_sent). */
static void out_put(job *j, const char *p, size_t n)
{
    if (j->out.len == j->sent) j->t_sent = kvt_now();
    kvt_wbuf_put(&j->out, p, n);
}

/* Streaming output. A client that stops reading gets no more than
 * STREAM_MAX_UNSENT bytes buffered: past that its request ends as if it
 * had hung up (the job is canceled, its connection shut down). */
static void job_emit(job *j, char *sse)
{
    if (!sse) return;
    size_t n = strlen(sse);
    pthread_mutex_lock(&j->mu);
    if (!j->overflow && j->out.len - j->sent + n > STREAM_MAX_UNSENT) {
        j->overflow = j->canceled = true;
        kvt_wbuf_free(&j->out);
        j->sent = 0;
    }
    if (!j->overflow) out_put(j, sse, n);
    job_wake(j);
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
        if (!j->overflow) out_put(j, body, strlen(body));
        free(body);
    } else {
        j->body = body;
    }
    j->done = true;
    job_wake(j);
    pthread_mutex_unlock(&j->mu);
}

/* ---- running a job ---- */

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

/* Called by the parser, on the request's own thread: the lock is held for
 * the copy alone, so requests parse and render side by side. */
static bool replay_lookup(void *user, const char *call_id, kvt_wbuf *out)
{
    struct replay_ctx *rc = user;
    bool found = false;
    pthread_mutex_lock(&rc->sv->replay_mu);
    for (size_t i = 0; i < MAX_REPLAY && !found; i++) {
        const replay *e = &rc->sv->rp[i];
        if (e->text && e->tenant == rc->tenant && !strcmp(e->id, call_id)) {
            kvt_wbuf_put(out, e->text, e->len);
            found = true;
        }
    }
    pthread_mutex_unlock(&rc->sv->replay_mu);
    return found;
}

/* The pool's bytes and sessions per tenant, for /metrics. Only the worker
 * touches the pool's sessions; readers see the figures it publishes here
 * when a job finishes. */
static void pool_publish(server *sv)
{
    size_t ram[MAX_TENANTS], n[MAX_TENANTS], dr[MAX_TENANTS], dk[MAX_TENANTS];
    for (size_t t = 0; t < sv->n_tn; t++) {
        ram[t] = kvt_tiers_bytes(sv->tiers, (int)t);
        dk[t] = kvt_tiers_draft_bytes(sv->tiers, (int)t);
        dr[t] = kvt_tiers_reserved(sv->tiers, (int)t);
        n[t] = kvt_tiers_count(sv->tiers, (int)t);
    }
    pthread_mutex_lock(&sv->mu);
    for (size_t t = 0; t < sv->n_tn; t++) {
        sv->tn[t].ram = ram[t];
        sv->tn[t].ram_entries = n[t];
        sv->tn[t].draft_ram = dr[t];
        sv->tn[t].draft_kept = dk[t];
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

/* The tiers' reports, counted in the tenant's metrics as they happen. */
static void tier_saved(void *user, int t, double seconds, int rc, bool created)
{
    server *sv = user;
    metrics *mx = &sv->tn[t].mx;
    pthread_mutex_lock(&sv->mu);
    kvt_server_hist_add(&mx->save, seconds);
    if (rc) mx->disk_save_errors++;
    else if (created) mx->disk_saves++;
    pthread_mutex_unlock(&sv->mu);
}

static void tier_evicted(void *user, int t)
{
    server *sv = user;
    pthread_mutex_lock(&sv->mu);
    sv->tn[t].mx.ram_evictions++;
    pthread_mutex_unlock(&sv->mu);
}

static void tier_trimmed(void *user, int t, size_t from, size_t to)
{
    server *sv = user;
    pthread_mutex_lock(&sv->mu);
    sv->tn[t].mx.ram_blocks_evicted += (from + KVT_BLOCK - 1) / KVT_BLOCK - (to + KVT_BLOCK - 1) / KVT_BLOCK;
    pthread_mutex_unlock(&sv->mu);
}

static void tier_loaded(void *user, int t, double seconds)
{
    server *sv = user;
    pthread_mutex_lock(&sv->mu);
    kvt_server_hist_add(&sv->tn[t].mx.load, seconds);
    pthread_mutex_unlock(&sv->mu);
}

/* The store threads' reports (storeq.h), on those threads. */
static void queue_saved(void *user, int t, double seconds, int rc, size_t created)
{
    server *sv = user;
    metrics *mx = &sv->tn[t].mx;
    pthread_mutex_lock(&sv->mu);
    if (created || rc) kvt_server_hist_add(&mx->save, seconds);
    if (rc) mx->disk_save_errors++;
    mx->disk_saves += created;
    pthread_mutex_unlock(&sv->mu);
}

static void queue_wake(void *user)
{
    server *sv = user;
    pthread_mutex_lock(&sv->mu);
    sv->loads_done++;
    pthread_cond_broadcast(&sv->cv);
    pthread_mutex_unlock(&sv->mu);
}

/* The tiers' evictions and shutdown saves go to the store threads whole. */
static bool tier_hand_off(void *user, int t, kvt_store *store, kvt_session *s, const char *reason)
{
    server *sv = user;
    return sv->q && kvt_storeq_save(sv->q, store, t, s, reason) == KVT_OK;
}

static size_t tier_held(void *user, int t)
{
    server *sv = user;
    return sv->q ? kvt_storeq_held(sv->q, t) : 0;
}

/* Save every pooled session to its tenant's store (reason shutdown) and
 * drop it: queued to the store threads, which kvt_storeq_free waits for. */
static void pool_shutdown(server *sv)
{
    while (sv->tiers && sv->tiers->n) {
        size_t i = sv->tiers->n - 1;
        kvt_tiers_drop(sv->tiers, i, sv->tn[sv->tiers->pool[i].tenant].store, "shutdown");
    }
}

/* The generation loop's output for a job: its output buffer, its cancel
 * flag, and the server's replay store for the tool calls it samples. */
struct gen_ctx { server *sv; job *j; };

static void gen_emit(void *user, char *sse) { job_emit(((struct gen_ctx *)user)->j, sse); }
static bool gen_canceled(void *user) { return job_canceled(((struct gen_ctx *)user)->j); }

static void gen_calls(void *user, const char *text, const kvt_tool_call *calls, size_t n)
{
    struct gen_ctx *g = user;
    remember_calls(g->sv, g->j->tenant, text, calls, n);
}

/* ---- the scheduler ----
 *
 * Continuous batching: the worker keeps up to `parallel` requests active,
 * each on a session of its own (the tiers never hand one session to two
 * requests), and advances all of them by one forward pass per step
 * (kvt_session_step): one token of every request that is generating, then
 * the rest of the step's token budget to the prefills, those with the
 * fewest tokens left first. The budget is a session chunk (256 tokens), or
 * PREFILL_BESIDE_DECODE while replies are being generated: a long prefill
 * so delays a reply's tokens by a short pass each, not by the whole
 * prompt, and a short prompt behind it waits one pass. Requests join between steps, picked from the queue
 * by their key's share of the active slots (the key with the fewest active
 * requests first, then the oldest request), and leave when their reply
 * ends or their client went away. A request's logits do not depend on the
 * others in its step: every kernel treats each row on its own, in a fixed
 * order (tests/test_batch.c). */

/* An active request. */
typedef struct slot {
    job *j;
    kvt_session *s;
    int32_t *toks;                /* the prompt, as the tiers spliced it */
    size_t n;
    kvt_tier_pick pick;
    kvt_storeq_ticket *load;      /* a disk load of the session in progress: the slot waits */
    size_t kept;                  /* prompt tokens the session held before the prefill */
    double t_queued, t_start, t_tok, t_note;
    double t_ready;               /* when the prefill began (after any load) */
    bool generating, first_done;
    bool counted;                 /* in the active counts (count_active) */
    kvt_gen_pass pass;            /* this step's tokens, when generating: the sampled one, the drafts */
    char id[48];
    kvt_usage u;
    kvt_gen g;
    struct gen_ctx gc;
    kvt_gen_out out;
    kvt_gen_run *run;
    kvt_draft_model *dm;          /* --draft model: the drafter, on dsess or a new session */
    kvt_session *dsess;           /* the draft session the reply begins on (taken by dm when made):
                                   * the pooled session's companion, or one a store load fills */
    kvt_storeq_ticket *dload;     /* that load, in progress: dm held (no drafts) until it is over */
    int dfrom;                    /* where dsess came from: 0 new, 1 RAM, 2 the store (metrics.draft_from) */
    bool saved;                   /* a copy of s was handed to the store per the policy */
    kvt_draft_mtp *mtp;           /* --draft mtp: the MTP drafter, on s */
    size_t dm_held;               /* its bytes reserved in the tenant's RAM share (kvt_tiers_reserve;
                                   * 0: no draft session for this reply) */
    size_t rows_held;             /* the verify passes' logits rows (any drafter), reserved the same way */
} slot;

static char *error_body(const job *j, int status, const char *msg)
{
    return j->stream ? kvt_stream_error(j->api, status, msg) : kvt_error_json(j->api, status, msg);
}

/* The reply's draft session stays with its pooled session as its companion
 * (kvt_tiers_keep_draft), rolled back to the tokens the reply kept, when
 * it fits the tenant's share (after the reply's reservation went back);
 * else it is dropped. When a copy of the model's session went to the store
 * per the policy, a copy of the companion follows it (reason "draft"). */
static void draft_keep(server *sv, slot *sl)
{
    if (sl->dload) { /* its restore is on a store thread: over soon (the draft model is small) */
        size_t got;
        while (!kvt_storeq_load_done(sl->dload, &got, NULL)) nanosleep(&(struct timespec){0, 1000000L}, NULL);
        sl->dload = NULL;
        if (sl->dm) kvt_draft_model_hold(sl->dm, false);
    }
    kvt_session *d = sl->dm && sl->s ? kvt_draft_model_release(sl->dm, kvt_session_tokens(sl->s), kvt_session_len(sl->s))
                                     : sl->dsess;
    sl->dsess = NULL;
    if (!d) return;
    if (!sl->s || !kvt_tiers_keep_draft(sv->tiers, sl->s, d)) {
        kvt_session_free(d);
        if (sl->s) {
            pthread_mutex_lock(&sv->mu);
            sv->tn[sl->j->tenant].mx.draft_dropped++;
            pthread_mutex_unlock(&sv->mu);
        }
        return;
    }
    kvt_store *store = sv->tn[sl->j->tenant].store;
    if (!store || !sl->saved || kvt_session_len(d) < sv->o.policy.min_tokens || !kvt_session_logits(d)) return;
    kvt_session_opts so = {.n_ctx = sv->o.n_ctx, .n_threads = 1};
    kvt_session *c = NULL;
    if (kvt_session_new_on(&c, sv->dmodel, &so, sv->tiers->threads) || kvt_session_clone(c, d) ||
        kvt_storeq_save(sv->q, store, sl->j->tenant, c, "draft")) {
        fprintf(stderr, "kvtier: cache: a save of a draft session skipped: %s\n", kvt_errmsg());
        kvt_session_free(c);
    }
}

/* The slot's request is over: answer it, give its session back to the pool. */
static void slot_end(server *sv, slot *sl, int status, char *body)
{
    if (sl->s) kvt_tiers_release(sv->tiers, sl->s);
    if (sl->counted) { /* out of the counts before the answer: a client reading /metrics after it sees it gone */
        pthread_mutex_lock(&sv->mu);
        sv->tn[sl->j->tenant].active--;
        sv->active--;
        pthread_mutex_unlock(&sv->mu);
    }
    size_t dm_now = sl->dm ? kvt_draft_model_bytes(sl->dm) : 0;
    if (dm_now > sl->dm_held) { /* grew past its reservation */
        kvt_tiers_reserve(sv->tiers, sl->j->tenant, dm_now - sl->dm_held);
        sl->dm_held = dm_now;
    }
    job_done(sv, sl->j, status, body);
    if (sl->dm_held || sl->rows_held) {
        kvt_tiers_unreserve(sv->tiers, sl->j->tenant, sl->dm_held + sl->rows_held);
        draft_keep(sv, sl);
        pool_publish(sv);
    }
    job_unref(sl->j);
    kvt_draft_model_free(sl->dm);
    kvt_draft_mtp_free(sl->mtp);
    free(sl->toks);
    free(sl);
}

/* Hand the store threads a copy of s to save per the policy (from_disk,
 * fork_at: kvt_store_apply_policy), so the steps go on while it writes.
 * false: nothing to save, or not handed: the copies queued already hold
 * the tenant's RAM share (reported at most once a minute) or no memory. */
static bool save_copy(server *sv, int tenant, kvt_store *store, const kvt_session *s, size_t from_disk, size_t fork_at)
{
    size_t n = kvt_session_len(s);
    if (!kvt_save_policy_points(&sv->o.policy, s, n, from_disk, fork_at)) return false;
    size_t held = kvt_storeq_held(sv->q, tenant), share = sv->o.ram_bytes / sv->n_tn;
    if (held && held + kvt_session_bytes(s) > share) {
        if (kvt_now() - sv->skip_logged >= 60) {
            fprintf(stderr, "kvtier: cache: a save skipped: %zu bytes wait to be saved already (a busy or slow "
                    "store)\n", held);
            sv->skip_logged = kvt_now();
        }
        return false;
    }
    kvt_session_opts so = {.n_ctx = sv->o.n_ctx, .n_threads = 1,
                           .checkpoint_interval = kvt_save_policy_grid(&sv->o.policy)};
    kvt_session *c = NULL;
    /* on the tiers' threads and without scratch: a copy is only encoded */
    if (kvt_session_new_on(&c, sv->m, &so, sv->tiers->threads) || kvt_session_clone(c, s) ||
        kvt_storeq_save_policy(sv->q, store, tenant, c, n, from_disk, fork_at)) {
        fprintf(stderr, "kvtier: cache: a save skipped: %s\n", kvt_errmsg());
        kvt_session_free(c);
        return false;
    }
    return true;
}

/* The prompt is in the session (rc 0) or its prefill stopped (rc): count
 * it, save per the policy (also after a cancel: what was computed is
 * kept), then start the reply or answer the error. false: the slot ended. */
static bool slot_prefilled(server *sv, slot *sl, int rc)
{
    job *j = sl->j;
    kvt_session *s = sl->s;
    size_t n = sl->n;
    metrics *mx = &sv->tn[j->tenant].mx;
    kvt_store *store = sv->tn[j->tenant].store;
    const char *tier = sl->kept ? sl->pick.tier : "none";
    sl->u = (kvt_usage){(uint32_t)n, 0, 0, 0};
    sl->u.cached_tokens = (uint32_t)(sl->kept < n ? sl->kept : n);
    snprintf(j->tier, sizeof j->tier, "%s", tier);
    pthread_mutex_lock(&sv->mu);
    mx->prompt_tokens += n;
    if (!strcmp(tier, "ram")) { mx->hits_ram++; mx->reused_ram += sl->kept; }
    else if (!strcmp(tier, "disk")) { mx->hits_disk++; mx->reused_disk += sl->kept; }
    else if (!strcmp(tier, "remote")) { mx->hits_remote++; mx->reused_remote += sl->kept; }
    else mx->misses++;
    kvt_server_hist_add(&mx->prefill, kvt_now() - sl->t_start);
    size_t computed = kvt_session_len(s) > sl->kept ? kvt_session_len(s) - sl->kept : 0;
    mx->prefilled += computed;
    if (rc == KVT_ECANCELED) mx->canceled++;
    pthread_mutex_unlock(&sv->mu);
    /* this machine's prefill rate under its load: what a remote load's
     * deadline is scaled by */
    if (sv->remote && !rc) kvt_remote_note_prefill(sv->remote, sl->kept, sl->kept + computed, kvt_now() - sl->t_ready);
    j->reused = sl->u.cached_tokens;
    /* a conversation's first request also saves where its last user turn
     * begins: new conversations on the same prompt fork there, after a
     * restart too. The tokens the saves write are reported with the
     * response, as the save is handed on (it commits after). */
    if (store && (sl->saved = save_copy(sv, j->tenant, store, s, sl->pick.from_disk,
                                         sl->pick.opening ? sl->pick.mark : 0)) && !rc) {
        size_t cold = kvt_save_policy_cold(&sv->o.policy, n);
        kvt_usage *u = &sl->u;
        if (cold > u->cached_tokens) u->created_tokens = (uint32_t)(cold - u->cached_tokens);
        if (u->created_tokens + u->cached_tokens > n) u->created_tokens = (uint32_t)(n - u->cached_tokens);
    }
    if (rc) {
        int status = rc == KVT_ECTX ? 400 : rc == KVT_ECANCELED ? 499 : 500;
        const char *msg = rc == KVT_ECANCELED ? "the client went away" : kvt_errmsg();
        slot_end(sv, sl, status, error_body(j, status == 499 ? 400 : status, msg));
        return false;
    }
    kvt_request *r = &j->req;
    /* The model id goes back as the client sent it (agent clients check it
     * against their own), or the served one when it sent none. */
    sl->g = (kvt_gen){.m = sv->m, .s = s, .r = r, .id = sl->id,
                      .model_name = r->model && *r->model ? r->model : sv->model_id, .created = (long)time(NULL),
                      .stream = j->stream, .max_new = r->max_tokens ? r->max_tokens : sv->o.max_tokens,
                      .n_ctx = sv->o.n_ctx, .seed = (uint64_t)time(NULL) ^ sv->tiers->clock,
                      .draft = sv->o.draft, .draft_max = sv->o.draft_max, .learned = &sv->learned};
    /* The draft model's session: the one draft_begin found (the pooled
     * session's companion, or one the store restores into: held until its
     * load is over), else a new one. It catches up with the prompt over
     * the first passes, a chunk a pass, from the longest prefix it holds
     * (docs/API.md). No session: no drafts. */
    if (sl->dm_held) {
        kvt_session_opts dso = {.n_ctx = sv->o.n_ctx, .n_threads = 1};
        int drc = sl->dsess ? kvt_draft_model_adopt(&sl->dm, sv->m, sv->dmodel, sl->dsess)
                            : kvt_draft_model_new(&sl->dm, sv->m, sv->dmodel, &dso, sv->tiers->threads);
        if (drc) fprintf(stderr, "kvtier: the draft model is off for a reply: %s\n", kvt_errmsg());
        if (!drc) sl->dsess = NULL; /* the drafter's */
        if (sl->dm && sl->dload) kvt_draft_model_hold(sl->dm, true);
        sl->g.dm = sl->dm;
    }
    /* the MTP drafter's windows (rows, hidden states) count in the share too */
    if (sv->o.draft == KVT_DRAFT_MTP && kvt_draft_mtp_new(&sl->mtp, s))
        fprintf(stderr, "kvtier: the MTP drafter is off for a reply: %s\n", kvt_errmsg());
    if (sl->mtp) {
        kvt_tiers_reserve(sv->tiers, j->tenant, kvt_draft_mtp_bytes(sl->mtp));
        sl->dm_held += kvt_draft_mtp_bytes(sl->mtp);
    }
    sl->g.mtp = sl->mtp;
    /* a drafting reply holds the logits of a verify pass's rows
     * (kvt_gen_start): in the share as well */
    if (sv->o.draft) {
        uint32_t dmax = sv->o.draft_max ? sv->o.draft_max : KVT_DRAFT_MAX_DEFAULT;
        sl->rows_held = (size_t)(1 + dmax) * sv->m->info.n_vocab * sizeof(float);
        kvt_tiers_reserve(sv->tiers, j->tenant, sl->rows_held);
    }
    sl->gc = (struct gen_ctx){sv, j};
    sl->out = (kvt_gen_out){gen_emit, gen_canceled, gen_calls, &sl->gc};
    if (!(sl->run = kvt_gen_start(&sl->g, &sl->u, &sl->out))) {
        slot_end(sv, sl, 500, error_body(j, 500, "out of memory"));
        return false;
    }
    sl->generating = true;
    sl->t_tok = kvt_now();
    return true;
}

/* The reply is over: its closing events or response, its figures. */
static void slot_reply_done(server *sv, slot *sl)
{
    char *body = kvt_gen_finish(sl->run);
    sl->run = NULL;
    pthread_mutex_lock(&sv->mu);
    metrics *mx = &sv->tn[sl->j->tenant].mx;
    mx->generated += sl->u.completion_tokens;
    mx->decode_passes += sl->u.passes;
    mx->drafted += sl->u.drafted;
    mx->accepted += sl->u.accepted;
    if (sl->dm) {
        mx->draft_from[sl->dfrom]++;
        mx->draft_prefilled += kvt_draft_model_prefilled(sl->dm);
    }
    if (sv->o.draft == KVT_DRAFT_NGRAM || sv->o.draft == KVT_DRAFT_MODEL || sv->o.draft == KVT_DRAFT_MTP) {
        int by = sv->o.draft == KVT_DRAFT_MODEL ? 1 : sv->o.draft == KVT_DRAFT_MTP ? 2 : 0;
        mx->drafted_by[by] += sl->u.drafted;
        mx->accepted_by[by] += sl->u.accepted;
    }
    pthread_mutex_unlock(&sv->mu);
    slot_end(sv, sl, 200, body);
}

static bool slot_ready(server *sv, slot *sl);

#define DRAFT_LOOKUP_MS 5 /* a store busy for longer: the draft session starts new */

/* The draft session a reply begins on: the companion of the pooled session
 * it extends (RAM); else, when the model's own prefix comes from a store
 * thread (waits), a new one that the store thread then restores the draft
 * model's longest record for the prompt into (looked up there, the remote
 * tier asked too), queued after the model's load so that it never delays
 * it; else, when the store holds such a record (a bounded lookup here), the
 * same; else none (a new one when the reply starts). */
static void draft_begin(server *sv, slot *sl, kvt_store *store, bool waits)
{
    if (sl->pick.extended && (sl->dsess = kvt_tiers_take_draft(sv->tiers, sl->s))) {
        sl->dfrom = 1;
        return;
    }
    size_t match = 0;
    int64_t id = -1;
    if (!store) return;
    if (waits) match = sl->n; /* id -1: the store thread looks the prompt up */
    else if (kvt_store_lookup_try(store, sv->dmodel, sl->toks, sl->n, DRAFT_LOOKUP_MS, &match, &id) || !match)
        return;
    kvt_session_opts dso = {.n_ctx = sv->o.n_ctx, .n_threads = 1};
    if (kvt_session_new_on(&sl->dsess, sv->dmodel, &dso, sv->tiers->threads) ||
        kvt_storeq_load(sv->q, store, sl->j->tenant, sl->dsess, sl->toks, sl->n, match, id, &sl->dload)) {
        kvt_session_free(sl->dsess);
        sl->dsess = NULL;
        sl->dload = NULL;
    }
}

/* A queued job becomes active: the tiers pick its session, which goes back
 * to the longest prefix of the prompt it can restore. NULL: the job was
 * answered (an error). */
static slot *slot_start(server *sv, job *j)
{
    slot *sl = kvt_calloc(1, sizeof *sl);
    if (!sl) {
        job_done(sv, j, 500, error_body(j, 500, "out of memory"));
        job_unref(j);
        return NULL;
    }
    sl->j = j;
    sl->t_queued = j->t_queued;
    sl->t_start = sl->t_note = kvt_now();
    snprintf(sl->id, sizeof sl->id, "%s%llx%04x",
             j->api == KVT_API_MESSAGES ? "msg_" : j->api == KVT_API_COMPLETIONS ? "cmpl-"
             : j->api == KVT_API_RESPONSES ? "resp_" : "chatcmpl-",
             (unsigned long long)time(NULL), (unsigned)(sv->tiers->clock & 0xffff));
    sl->toks = j->toks;
    sl->n = j->n_toks;
    j->toks = NULL;
    kvt_request *r = &j->req;
    kvt_tier_prompt tp = {r->prompt, r->prompt_len, r->prompt_has_bos, r->prompt_special, r->fork_at, r->opening};
    kvt_store *store = sv->tn[j->tenant].store;
    /* The reply's draft session counts against the tenant's RAM share from
     * the start, at what it may come to hold, so the pool makes room for
     * it as for any session; one larger than the share drafts nothing. */
    if (sv->dmodel) {
        uint32_t dmax = sv->o.draft_max ? sv->o.draft_max : KVT_DRAFT_MAX_DEFAULT;
        size_t share = sv->o.ram_bytes / sv->n_tn, max_new = r->max_tokens ? r->max_tokens : sv->o.max_tokens;
        size_t need = kvt_draft_model_reserve(sv->dmodel, sv->o.n_ctx, sl->n + max_new, dmax, sv->dscratch);
        if (need <= share) kvt_tiers_reserve(sv->tiers, j->tenant, sl->dm_held = need);
        else
            fprintf(stderr, "kvtier: the draft model is off for a reply: its session would hold up to %zu bytes, "
                    "more than the RAM share of %zu (--kv-ram-mb)\n", need, share);
    }
    int rc = kvt_tiers_select(sv->tiers, j->tenant, store, &tp, &sl->toks, &sl->n, &sl->pick);
    if (rc) {
        if (sl->n > sv->o.n_ctx) slot_end(sv, sl, 400, ctx_error(j->api, sl->n, sv->o.n_ctx, j->stream));
        else slot_end(sv, sl, 500, error_body(j, 500, kvt_errmsg()));
        return NULL;
    }
    sl->s = sl->pick.s;
    /* a new session for a prompt long enough to have been saved: the remote
     * tier may hold it (asked on a store thread, as a disk load) */
    bool remote = !sl->pick.load && sv->remote && store && !strcmp(sl->pick.tier, "none") &&
                  sl->n >= sv->o.policy.min_tokens;
    if (remote) {
        kvt_tiers_defer(sv->tiers, &sl->pick);
        sl->pick.load_id = -1;
    }
    /* the store holds a prefix: the slot waits while a store thread
     * restores it, the other requests step on */
    bool waits = (sl->pick.load || remote) && !kvt_storeq_load(sv->q, store, j->tenant, sl->s, sl->toks, sl->n,
                                                               sl->pick.load, sl->pick.load_id, &sl->load);
    if (sl->dm_held) draft_begin(sv, sl, store, waits);
    if (waits) return sl;
    if (remote) kvt_tiers_loaded(sv->tiers, &sl->pick, 0);
    if (sl->pick.load) kvt_tiers_loaded(sv->tiers, &sl->pick, 0);
    return slot_ready(sv, sl) ? sl : NULL;
}

/* The slot's session holds what the tiers found: bring it to the prompt's
 * longest prefix it holds, and answer at once when that is all of it.
 * false: the slot ended. */
static bool slot_ready(server *sv, slot *sl)
{
    job *j = sl->j;
    const int32_t *t = sl->toks;
    size_t n = sl->n;
    sl->t_ready = kvt_now();
    int rc = kvt_session_sync_prepare(sl->s, &t, &n, &sl->kept);
    if (rc) {
        int status = rc == KVT_ECTX ? 400 : 500;
        slot_end(sv, sl, status, error_body(j, status, kvt_errmsg()));
        return false;
    }
    return kvt_session_len(sl->s) != sl->n || slot_prefilled(sv, sl, KVT_OK);
}

/* A streaming prefill says how far it is, at most once a second. */
static void slot_note(slot *sl)
{
    double now = kvt_now();
    if (!sl->j->stream || now - sl->t_note < 1.0) return;
    char buf[96];
    snprintf(buf, sizeof buf, ": prefill %zu/%zu\n\n", kvt_session_len(sl->s), sl->n);
    job_emit(sl->j, kvt_strndup(buf, strlen(buf)));
    sl->t_note = now;
}

/* One step of every active slot; returns how many are left, compacted at
 * the front of act. */
static size_t step(server *sv, slot **act, size_t na)
{
    kvt_step st[KVT_TIERS_MAX_BUSY];
    slot *who[KVT_TIERS_MAX_BUSY];
    size_t k = 0;
    /* the slots whose disk load is over join this step */
    for (size_t i = 0; i < na; i++) {
        size_t got;
        bool from_remote = false;
        if (!act[i]->load || !kvt_storeq_load_done(act[i]->load, &got, &from_remote)) continue;
        act[i]->load = NULL;
        kvt_tiers_loaded(sv->tiers, &act[i]->pick, got);
        if (got && from_remote) act[i]->pick.tier = "remote";
        if (!slot_ready(sv, act[i])) act[i] = NULL;
    }
    /* the draft sessions whose restore is over: drafts from now on */
    for (size_t i = 0; i < na; i++) {
        size_t got;
        if (!act[i] || !act[i]->dload || !kvt_storeq_load_done(act[i]->dload, &got, NULL)) continue;
        act[i]->dload = NULL;
        if (got) act[i]->dfrom = 2;
        if (act[i]->dm) kvt_draft_model_hold(act[i]->dm, false);
    }
    /* one token for every reply, then the prefills */
    size_t n_dec = 0, dec_toks = 0;
    for (int pass = 0; pass < 2; pass++)
        for (size_t i = 0; i < na; i++) {
            slot *sl = act[i];
            if (!sl || sl->load || sl->generating != (pass == 0)) continue;
            if (sl->generating) {
                if (!kvt_gen_next_pass(sl->run, &sl->pass)) { slot_reply_done(sv, sl); act[i] = NULL; continue; }
                st[k] = (kvt_step){sl->s, sl->pass.tok, sl->pass.n, false, 0, sl->pass.rows, sl->pass.save};
                n_dec++;
                dec_toks += sl->pass.n;
            } else {
                if (job_canceled(sl->j)) { slot_prefilled(sv, sl, KVT_ECANCELED); act[i] = NULL; continue; }
                size_t at = kvt_session_len(sl->s);
                st[k] = (kvt_step){sl->s, sl->toks + at, sl->n - at, true, 0};
            }
            who[k++] = sl;
        }
    /* The prefills with the fewest tokens left first: the step's budget
     * goes to them in this order, so a short prompt that arrives during a
     * long one's prefill is done in one step, not a token per step. */
    for (size_t i = n_dec + 1; i < k; i++)
        for (size_t j = i; j > n_dec && st[j].n < st[j - 1].n; j--) {
            kvt_step ts = st[j];
            st[j] = st[j - 1];
            st[j - 1] = ts;
            slot *tw = who[j];
            who[j] = who[j - 1];
            who[j - 1] = tw;
        }
    /* While replies are being generated a pass takes fewer prefill tokens,
     * so each of their tokens waits for a short pass, not a whole chunk */
    size_t budget = n_dec ? dec_toks + PREFILL_BESIDE_DECODE : 0;
    int rcs[KVT_TIERS_MAX_BUSY] = {0};
    if (k && kvt_session_step(st, k, budget)) /* then each alone, to find which one failed */
        for (size_t i = 0; i < k; i++) rcs[i] = kvt_session_step(&st[i], 1, st[i].rows ? st[i].n : 0);
    pthread_mutex_lock(&sv->mu);
    sv->steps += k > 0;
    sv->step_reqs += k;
    if (k > sv->step_max) sv->step_max = k;
    pthread_mutex_unlock(&sv->mu);
    double now = kvt_now();
    for (size_t i = 0; i < k; i++) {
        slot *sl = who[i];
        size_t a = 0;
        while (act[a] != sl) a++;
        metrics *mx = &sv->tn[sl->j->tenant].mx;
        if (sl->generating) {
            uint32_t had = sl->u.completion_tokens;
            bool more = kvt_gen_took_pass(sl->run, rcs[i], st[i].done);
            if (sl->u.completion_tokens > had) { /* a token of the reply */
                pthread_mutex_lock(&sv->mu);
                if (!sl->first_done) kvt_server_hist_add(&mx->ttft, now - sl->t_queued);
                else kvt_server_hist_add(&mx->itl, now - sl->t_tok);
                pthread_mutex_unlock(&sv->mu);
                sl->first_done = true;
                sl->t_tok = now;
            }
            if (!more) { slot_reply_done(sv, sl); act[a] = NULL; }
        } else if (rcs[i] || kvt_session_len(sl->s) == sl->n) {
            if (!slot_prefilled(sv, sl, rcs[i])) act[a] = NULL;
        } else {
            slot_note(sl);
        }
    }
    size_t left = 0;
    for (size_t i = 0; i < na; i++)
        if (act[i]) act[left++] = act[i];
    return left;
}

/* The queued job to start next, unlinked from the queue: of the key with
 * the fewest active requests, then the key admitted longest ago (so keys
 * take turns at a freed slot), its oldest job. Under sv->mu. */
static job *dequeue(server *sv, slot *const *act, size_t na)
{
    size_t busy[MAX_TENANTS] = {0};
    for (size_t i = 0; i < na; i++) busy[act[i]->j->tenant]++;
    job *best = NULL, *best_prev = NULL;
    for (job *j = sv->head, *prev = NULL; j; prev = j, j = j->next) {
        const tenant *a = &sv->tn[j->tenant], *b = best ? &sv->tn[best->tenant] : NULL;
        if (!best || busy[j->tenant] < busy[best->tenant] ||
            (busy[j->tenant] == busy[best->tenant] && a->admitted < b->admitted)) {
            best = j;
            best_prev = prev;
        }
    }
    if (!best) return NULL;
    if (best_prev) best_prev->next = best->next;
    else sv->head = best->next;
    if (sv->tail == best) sv->tail = best_prev;
    best->next = NULL;
    sv->queued--;
    sv->tn[best->tenant].queued--;
    sv->tn[best->tenant].admitted = ++sv->admissions;
    return best;
}

/* The active requests' count, in all and per key, for /metrics and the
 * admission of the next job. Under sv->mu. */
static void count_active(server *sv, slot *const *act, size_t na)
{
    for (size_t t = 0; t < sv->n_tn; t++) sv->tn[t].active = 0;
    for (size_t i = 0; i < na; i++) {
        sv->tn[act[i]->j->tenant].active++;
        act[i]->counted = true;
    }
    sv->active = na;
}

static void *worker_main(void *arg)
{
    server *sv = arg;
    slot *act[KVT_TIERS_MAX_BUSY];
    size_t na = 0;
    uint64_t loads_seen = 0;
    kvt_store_mark_stepper(true);
    unsigned long waits = kvt_store_stepper_waits();
    for (;;) {
        unsigned long w = kvt_store_stepper_waits();
        pthread_mutex_lock(&sv->mu);
        sv->steps_waited += w != waits; /* the round before this one */
        waits = w;
        count_active(sv, act, na);
        pthread_cond_broadcast(&sv->cv);
        /* wait for a job, or (when every active slot waits on a disk load)
         * for a load to end */
        for (;;) {
            size_t runnable = 0;
            for (size_t i = 0; i < na; i++) runnable += !act[i]->load;
            bool admit = sv->head && (na < sv->parallel || sv->stopping);
            if (runnable || admit || sv->loads_done != loads_seen || (!na && sv->stopping)) break;
            pthread_cond_wait(&sv->cv, &sv->mu);
        }
        loads_seen = sv->loads_done; /* step() looks at every load after this */
        bool stopping = sv->stopping;
        if (!na && !sv->head) { pthread_mutex_unlock(&sv->mu); break; }
        /* while stopping, queued jobs are answered 503 and the active ones finish */
        job *j = na < sv->parallel || stopping ? dequeue(sv, act, na) : NULL;
        pthread_mutex_unlock(&sv->mu);
        if (!j) {
            na = step(sv, act, na);
        } else if (stopping) {
            job_finish(j, 503, kvt_error_json(j->api, 503, "the server is shutting down"));
            job_unref(j);
        } else if (job_canceled(j)) {
            job_finish(j, 499, kvt_error_json(j->api, 400, "the client went away"));
            job_unref(j);
        } else {
            /* admit every queued job that fits before the next step */
            slot *sl = slot_start(sv, j);
            if (sl) act[na++] = sl;
        }
    }
    return NULL;
}

/* ---- HTTP ---- */

/* libmicrohttpd runs in epoll mode with a small pool of threads, so a
 * connection costs a descriptor and some memory, not a thread, and no
 * handler ever blocks a pool thread: a request waiting for its job (or a
 * stream waiting for its next bytes) suspends its connection, and the
 * worker's job_emit/job_finish resume it. A ticker thread does what a
 * suspended connection cannot: it watches for hang-ups (the job is
 * canceled), resumes streams for their keepalive comments, and shuts down
 * connections that have not completed their request within
 * --request-timeout (libmicrohttpd's own timeout restarts at every byte,
 * so a client trickling a byte a second would never meet it) and streams
 * whose client stopped reading (STREAM_MAX_UNSENT bytes unsent, or none
 * taken for --request-timeout). */

#define FD_RESERVE 256   /* descriptors kept for the store's files, the model, logs */
#define TICK_MS 250      /* the ticker's period: how soon a hang-up cancels */
#define STOP_DRAIN 5.0   /* seconds a stop waits for answers still being sent */

/* One TCP connection, from accept to close (libmicrohttpd's socket
 * context). Under net.mu; the list holds only open connections: the
 * connection leaves it in the CLOSED notification, which libmicrohttpd
 * sends before it closes the socket, so fd is never a reused descriptor
 * while the ticker holds net.mu. */
typedef struct peer {
    int fd;
    double t_req;            /* its current request began (or the previous one ended) */
    bool complete;           /* the request has fully arrived: no deadline */
    bool cut;                /* shut down by the ticker */
    bool over;               /* accepted past --max-connections: answered 503 */
    int outq;                /* the socket's unsent and unacknowledged bytes at the last tick (SIOCOUTQ) */
    double t_out;            /* when they last changed */
    job *j;                  /* the request's job (a reference), NULL when none */
    struct peer *prev, *next;
} peer;

typedef struct net {
    server *sv;
    pthread_mutex_t mu;      /* the peers; taken before a job's mu, never after */
    pthread_cond_t cv;
    peer *head;
    size_t n_peers;
    unsigned max_conns;      /* past it: 503 */
    unsigned hard;           /* libmicrohttpd's limit: past it new connections are closed */
    double timeout;          /* --request-timeout */
    bool stop, started;
    pthread_t ticker;
} net;

/* One request on a connection (libmicrohttpd's request context). */
typedef struct conn {
    kvt_wbuf body;
    bool too_big;
    peer *p;
    job *j;                  /* non-streaming: the job whose answer is awaited */
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
    int cls = status / 100 - 2; /* 2xx 3xx 4xx 5xx, then 429 apart */
    if (cls < 0 || cls > 3) cls = 3;
    if (status == 429) cls = 5;
    pthread_mutex_lock(&sv->mu);
    if (tnt < 0) sv->refused++;
    else sv->tn[tnt].mx.requests[ep][cls]++;
    pthread_mutex_unlock(&sv->mu);
}

/* The stream's next bytes: what the worker has emitted, or a keepalive
 * comment the ticker asked for; with nothing to send the connection is
 * suspended until job_wake. Sent bytes leave the buffer, so it holds only
 * what the client has not yet read. */
static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    job *j = cls;
    ssize_t r = 0;
    pthread_mutex_lock(&j->mu);
    if (j->overflow) {
        r = MHD_CONTENT_READER_END_WITH_ERROR;
    } else if (j->out.len > j->sent) {
        size_t n = j->out.len - j->sent;
        if (n > max) n = max;
        memcpy(buf, j->out.p + j->sent, n);
        j->sent += n;
        if (j->sent == j->out.len) j->sent = j->out.len = 0;
        else if (j->sent >= (64u << 10)) {
            memmove(j->out.p, j->out.p + j->sent, j->out.len - j->sent);
            j->out.len -= j->sent;
            j->sent = 0;
        }
        r = (ssize_t)n;
    } else if (j->done) {
        r = MHD_CONTENT_READER_END_OF_STREAM;
    } else if (j->ping) {
        static const char ka[] = ": keepalive\n\n";
        r = (ssize_t)(sizeof ka - 1 < max ? sizeof ka - 1 : max);
        memcpy(buf, ka, (size_t)r);
    } else {
        j->suspended = true;
        MHD_suspend_connection(j->c);
    }
    j->ping = false;
    if (r > 0) j->t_sent = kvt_now();
    pthread_mutex_unlock(&j->mu);
    (void)pos;
    return r;
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

/* ---- routes ---- */

/* A request as a route's handler gets it. */
typedef struct call {
    server *sv;
    net *nt;
    struct MHD_Connection *c;
    conn *cn;                 /* the body read so far */
    const char *url, *method;
    kvt_api api;              /* the shape of error bodies, from the URL */
    int tnt;                  /* the tenant, KEY_METRICS; 0 on open routes (no key checked) */
} call;

static enum MHD_Result get_health(const call *q)
{
    return send_text(q->c, 200, "application/json", "{\"status\":\"ok\"}", NULL, NULL);
}

static enum MHD_Result head_root(const call *q) { return send_text(q->c, 200, "text/plain", "", NULL, NULL); }

/* /metrics: a key's own figures; the metrics key's, every key's */
static enum MHD_Result get_metrics(const call *q)
{
    char *t = kvt_server_metrics_text(q->sv, q->tnt);
    enum MHD_Result r = send_text(q->c, 200, "text/plain; version=0.0.4", t ? t : "", NULL, NULL);
    free(t);
    return r;
}

static enum MHD_Result get_models(const call *q)
{
    return send_json(q->c, 200, kvt_models_json(q->sv->model_id, q->sv->started));
}

/* A non-streaming request's answer once its job is done; until then the
 * connection is suspended (job_wake resumes it, and libmicrohttpd calls
 * handle() again, which comes back here). */
static enum MHD_Result reply_job(const call *q)
{
    conn *cn = q->cn;
    job *j = cn->j;
    pthread_mutex_lock(&j->mu);
    if (!j->done) {
        j->suspended = true;
        MHD_suspend_connection(q->c);
        pthread_mutex_unlock(&j->mu);
        return MHD_YES;
    }
    pthread_mutex_unlock(&j->mu);
    cn->j = NULL;
    int st = j->status == 499 ? 400 : j->status;
    count_request(q->sv, j->tenant, endpoint_index(j->api), st);
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(j->body ? j->body : "{}"),
                                                                j->body ? j->body : "{}", MHD_RESPMEM_MUST_COPY);
    MHD_add_response_header(resp, "Content-Type", "application/json");
    char hv[64];
    snprintf(hv, sizeof hv, "%s; reused=%zu", j->tier[0] ? j->tier : "none", j->reused);
    MHD_add_response_header(resp, "X-KVTier-Cache", hv);
    enum MHD_Result r = MHD_queue_response(q->c, (unsigned)st, resp);
    MHD_destroy_response(resp);
    job_unref(j);
    return r;
}

/* The answer to an inference request that never reaches the worker (an
 * error, a token count, a full queue): j (NULL: none made yet; never
 * queued, so no worker reference) goes, the JSON body (malloc'ed; NULL:
 * out of memory) is sent, with a Retry-After on a 429. counted: the
 * request counts under its status. */
static enum MHD_Result answer_now(const call *q, job *j, int status, char *body, bool counted)
{
    if (counted) count_request(q->sv, q->tnt, endpoint_index(q->api), status);
    if (j) {
        j->refs = 1;
        job_unref(j);
    }
    enum MHD_Result r = send_text(q->c, status, "application/json", body ? body : "{}", status == 429 ? "Retry-After" : NULL,
                                  status == 429 ? "2" : NULL);
    free(body);
    return r;
}

/* Read the request body into j->req (counting: a count_tokens body, which
 * carries no max_tokens) and hold it to the server's limits: the model it
 * serves when --strict-model, --max-tokens. On a failure *status is the
 * HTTP status to answer with. */
static int parse_job(const call *q, job *j, bool counting, int *status)
{
    server *sv = q->sv;
    conn *cn = q->cn;
    if (counting) add_max_tokens(&cn->body);
    struct replay_ctx rpc = {sv, q->tnt};
    kvt_parse_opts po = {.keep_volatile = sv->o.keep_volatile, .replay = replay_lookup, .replay_user = &rpc};
    int rc = kvt_request_parse_opts(&j->req, q->api, cn->body.p ? (const char *)cn->body.p : "", cn->body.len, sv->m,
                                    &po, status);
    if (rc) return rc;
    /* By default any model id is served, as llama.cpp's server does: agent
     * clients send their own ids (Claude Code its claude-* names) and
     * would otherwise need configuring; the id is echoed back. */
    if (sv->o.strict_model && j->req.model && strcmp(j->req.model, sv->model_id)) {
        *status = 404;
        return kvt_fail(KVT_ENOENT, "model '%.200s' is not served here (this server serves '%s')", j->req.model,
                        sv->model_id);
    }
    /* --max-tokens is the default and the most a request gets: a larger
     * max_tokens is cut to it (the reply ends "length") */
    if (j->req.max_tokens > sv->o.max_tokens) j->req.max_tokens = sv->o.max_tokens;
    return KVT_OK;
}

/* Queue j for the worker; 0, or the status that refuses it (429: the queue
 * is full, 503: the server is stopping). */
static int enqueue(server *sv, job *j)
{
    pthread_mutex_lock(&sv->mu);
    int refused = sv->stopping ? 503 : sv->queued >= sv->o.queue ? 429 : 0;
    if (!refused) {
        if (sv->tail) sv->tail->next = j;
        else sv->head = j;
        sv->tail = j;
        sv->queued++;
        sv->tn[j->tenant].queued++;
        j->t_queued = kvt_now();
        pthread_cond_broadcast(&sv->cv);
    }
    pthread_mutex_unlock(&sv->mu);
    return refused;
}

/* The connection's reference to a queued job, for the ticker: hang-ups,
 * keepalives, a stream whose client stopped reading. */
static void attach(const call *q, job *j)
{
    pthread_mutex_lock(&q->nt->mu);
    pthread_mutex_lock(&j->mu);
    j->c = q->c;
    j->t_sent = kvt_now();
    if (q->cn->p && !q->cn->p->j) {
        q->cn->p->j = j;
        j->refs++;
    }
    pthread_mutex_unlock(&j->mu);
    pthread_mutex_unlock(&q->nt->mu);
}

/* An inference request (counting: count_tokens, answered with the prompt's
 * length): parsed and tokenized here, then queued for the worker; a
 * streaming response reads the job's output as it grows, any other waits
 * for the job to finish. */
static enum MHD_Result infer(const call *q, bool counting)
{
    server *sv = q->sv;
    kvt_api api = q->api;
    if (q->cn->too_big) {
        char msg[128];
        snprintf(msg, sizeof msg, "request body exceeds %zu bytes", sv->o.max_body);
        return answer_now(q, NULL, 413, kvt_error_json(api, 413, msg), true);
    }
    job *j = job_new();
    if (!j) return MHD_NO;
    int status = 400;
    if (parse_job(q, j, counting, &status)) return answer_now(q, j, status, kvt_error_json(api, status, kvt_errmsg()), true);
    /* tokenize here, so that a prompt over the context is a 400 before any
     * streaming starts (the tokenizer is immutable and thread-safe) */
    const kvt_request *rq = &j->req;
    if (kvt_tokenizer_encode(sv->m->tok, rq->prompt, rq->prompt_len, rq->prompt_has_bos ? false : sv->m->info.add_bos,
                             rq->prompt_special, &j->toks, &j->n_toks))
        return answer_now(q, j, 400, kvt_error_json(api, 400, kvt_errmsg()), true);
    if (counting) {
        char body[64];
        snprintf(body, sizeof body, "{\"input_tokens\":%zu}", j->n_toks);
        char *copy = kvt_strndup(body, strlen(body));
        return answer_now(q, j, copy ? 200 : 500, copy, false);
    }
    if (j->n_toks > sv->o.n_ctx) return answer_now(q, j, 400, ctx_error(api, j->n_toks, sv->o.n_ctx, false), true);
    j->api = api;
    j->tenant = q->tnt;
    j->stream = j->req.stream;
    int refused = enqueue(sv, j);
    if (refused)
        return answer_now(q, j, refused,
                          kvt_error_json(api, refused, refused == 503 ? "the server is shutting down"
                                                                      : "the inference queue is full; retry shortly"),
                          true);
    attach(q, j);
    if (j->stream) { /* headers now; keepalive comments while queued or prefilling */
        count_request(sv, q->tnt, endpoint_index(api), 200);
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, j, stream_free);
        MHD_add_response_header(resp, "Content-Type", "text/event-stream");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        enum MHD_Result r = MHD_queue_response(q->c, 200, resp);
        MHD_destroy_response(resp);
        return r;
    }
    q->cn->j = j;
    return reply_job(q);
}

static enum MHD_Result post_infer(const call *q) { return infer(q, false); }
static enum MHD_Result post_count_tokens(const call *q) { return infer(q, true); }

enum {
    R_OPEN = 1,         /* answered before the key is checked */
    R_METRICS_KEY = 2,  /* the metrics key may call it */
    R_POST_ONLY = 4,    /* another method on the path: 405 (not 404) */
};

/* Every URL the server answers. handle() finds the row whose method and
 * path are the request's (exact matches); open rows answer at once, the
 * others once the key is checked. A path known under another method is a
 * 405 when its row says so, anything else a 404. */
static const struct route {
    const char *method, *path;
    unsigned flags;
    enum MHD_Result (*fn)(const call *q);
} routes[] = {
    {"GET", "/health", R_OPEN, get_health},
    {"HEAD", "/", R_OPEN, head_root},
    {"GET", "/metrics", R_METRICS_KEY, get_metrics},
    {"GET", "/v1/models", 0, get_models},
    {"POST", "/v1/chat/completions", R_POST_ONLY, post_infer},
    {"POST", "/chat/completions", R_POST_ONLY, post_infer},
    {"POST", "/v1/completions", R_POST_ONLY, post_infer},
    {"POST", "/v1/messages", R_POST_ONLY, post_infer},
    {"POST", "/messages", R_POST_ONLY, post_infer},
    {"POST", "/v1/messages/count_tokens", R_POST_ONLY, post_count_tokens},
    {"POST", "/v1/responses", R_POST_ONLY, post_infer},
    {"POST", "/responses", R_POST_ONLY, post_infer},
};
#define N_ROUTES (sizeof routes / sizeof routes[0])

/* A response that closes the connection after it: for requests answered
 * before their body is read, and past --max-connections. */
static enum MHD_Result send_closing(struct MHD_Connection *c, int status, char *json, const char *extra_h,
                                    const char *extra_v)
{
    const char *t = json ? json : "{}";
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(t), (void *)t, MHD_RESPMEM_MUST_COPY);
    free(json);
    MHD_add_response_header(resp, "Content-Type", "application/json");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    if (extra_h) MHD_add_response_header(resp, extra_h, extra_v);
    enum MHD_Result r = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    return r;
}

static kvt_api url_api(const char *url)
{
    return strstr(url, "/messages") ? KVT_API_MESSAGES
         : !strcmp(url, "/v1/completions") ? KVT_API_COMPLETIONS
         : strstr(url, "/responses") ? KVT_API_RESPONSES : KVT_API_CHAT;
}

#define DRAIN_MAX (16u << 20)

/* The first call, once the headers are in: a connection past
 * --max-connections is answered 503, a Content-Length over the body limit
 * by more than the limit or DRAIN_MAX, whichever is larger (or over it at
 * all with Expect: 100-continue) 413, both at once and with
 * the connection closed after: libmicrohttpd reads no body once a response
 * is queued. A smaller excess is read and dropped before its 413
 * (infer()): most clients send the whole body before they read, and a
 * close with their body still coming would reset the connection under
 * their answer. Otherwise NO_ANSWER. */
#define NO_ANSWER ((enum MHD_Result) - 1)
static enum MHD_Result first_call(net *nt, struct MHD_Connection *c, conn *cn, const char *url)
{
    server *sv = nt->sv;
    bool over = false;
    pthread_mutex_lock(&nt->mu);
    if (cn->p) over = cn->p->over;
    pthread_mutex_unlock(&nt->mu);
    kvt_api api = url_api(url);
    if (over) {
        count_request(sv, -1, 3, 503);
        return send_closing(c, 503, kvt_error_json(api, 503, "too many connections; retry shortly"), "Retry-After",
                            "2");
    }
    const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        char *end;
        errno = 0;
        unsigned long long n = strtoull(cl, &end, 10);
        const char *ex = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
        bool waits = ex && !strcasecmp(ex, "100-continue"); /* sends no body before an answer */
        size_t drain = sv->o.max_body > DRAIN_MAX ? sv->o.max_body : DRAIN_MAX; /* excess read before a 413 */
        if (end != cl && (errno == ERANGE || (n > sv->o.max_body && (waits || n - sv->o.max_body > drain)))) {
            int tnt = authorized(sv, c);
            count_request(sv, tnt >= 0 ? tnt : -1, endpoint_index(api), 413);
            char msg[128];
            snprintf(msg, sizeof msg, "request body exceeds %zu bytes", sv->o.max_body);
            return send_closing(c, 413, kvt_error_json(api, 413, msg), NULL, NULL);
        }
    }
    return NO_ANSWER;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    net *nt = cls;
    server *sv = nt->sv;
    conn *cn = *con_cls;
    if (!cn) {
        cn = kvt_calloc(1, sizeof *cn);
        if (!cn) return MHD_NO;
        *con_cls = cn;
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        cn->p = ci ? ci->socket_context : NULL;
        enum MHD_Result r = first_call(nt, c, cn, url);
        return r == NO_ANSWER ? MHD_YES : r;
    }
    if (*upload_size) {
        if (cn->body.len + *upload_size > sv->o.max_body) cn->too_big = true;
        else kvt_wbuf_put(&cn->body, upload, *upload_size);
        *upload_size = 0;
        return MHD_YES;
    }
    (void)version;
    call q = {sv, nt, c, cn, url, method, url_api(url), 0};
    if (cn->j) return reply_job(&q); /* resumed: the job is done (or not yet: suspend again) */
    pthread_mutex_lock(&nt->mu);
    if (cn->p) cn->p->complete = true; /* the whole request is in: no deadline from here */
    pthread_mutex_unlock(&nt->mu);
    const struct route *rt = NULL, *other = NULL; /* other: the path's row under another method */
    for (size_t i = 0; i < N_ROUTES && !rt; i++)
        if (!strcmp(url, routes[i].path)) {
            if (!strcmp(method, routes[i].method)) rt = &routes[i];
            else other = &routes[i];
        }
    if (rt && (rt->flags & R_OPEN)) return rt->fn(&q);
    q.tnt = authorized(sv, c);
    if (q.tnt == -1) {
        count_request(sv, -1, 3, 401);
        return send_json(c, 401, kvt_error_json(q.api, 401, "invalid or missing API key"));
    }
    if (rt && (rt->flags & R_METRICS_KEY)) return rt->fn(&q);
    if (q.tnt == KEY_METRICS) {
        count_request(sv, -1, 3, 403);
        return send_json(c, 403, kvt_error_json(q.api, 403, "this key reads GET /metrics only"));
    }
    if (rt) return rt->fn(&q);
    if (other && (other->flags & R_POST_ONLY)) {
        count_request(sv, q.tnt, endpoint_index(q.api), 405);
        return send_json(c, 405, kvt_error_json(q.api, 400, "use POST"));
    }
    count_request(sv, q.tnt, 3, 404);
    char msg[160];
    snprintf(msg, sizeof msg, "no route for %s %.100s", method, url);
    return send_json(c, 404, kvt_error_json(q.api, 404, msg));
}

/* A request is over (answered, or its connection closed): the next one
 * on a keep-alive connection has --request-timeout from now, idle time
 * included. */
static void request_done(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    net *nt = cls;
    conn *cn = *con_cls;
    if (!cn) return;
    pthread_mutex_lock(&nt->mu);
    if (cn->p) {
        if (cn->p->j) job_unref(cn->p->j);
        cn->p->j = NULL;
        cn->p->t_req = kvt_now();
        cn->p->complete = false;
    }
    pthread_mutex_unlock(&nt->mu);
    if (cn->j) { /* answered without its job (the connection closed while it waited) */
        pthread_mutex_lock(&cn->j->mu);
        if (!cn->j->done) cn->j->canceled = true;
        pthread_mutex_unlock(&cn->j->mu);
        job_unref(cn->j);
    }
    kvt_wbuf_free(&cn->body);
    free(cn);
    *con_cls = NULL;
    (void)c; (void)toe;
}

/* Connections come and go: each is a peer on the ticker's list, the ones
 * past --max-connections marked to be answered 503. */
static void conn_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                        enum MHD_ConnectionNotificationCode code)
{
    net *nt = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        peer *p = kvt_calloc(1, sizeof *p);
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        *socket_context = p;
        if (!p) return;
        p->fd = ci ? ci->connect_fd : -1;
        p->t_req = kvt_now();
        pthread_mutex_lock(&nt->mu);
        p->over = nt->n_peers >= nt->max_conns;
        p->next = nt->head;
        if (nt->head) nt->head->prev = p;
        nt->head = p;
        nt->n_peers++;
        pthread_mutex_unlock(&nt->mu);
        return;
    }
    peer *p = *socket_context;
    if (code != MHD_CONNECTION_NOTIFY_CLOSED || !p) return;
    pthread_mutex_lock(&nt->mu);
    if (p->prev) p->prev->next = p->next;
    else nt->head = p->next;
    if (p->next) p->next->prev = p->prev;
    nt->n_peers--;
    if (p->j) job_unref(p->j);
    pthread_mutex_unlock(&nt->mu);
    free(p);
    *socket_context = NULL;
}

/* One peer's turn on the ticker (under net.mu): the request deadline, a
 * stream over its buffer, a hang-up while suspended, a keepalive due. */
static void tick_peer(net *nt, peer *p, double now)
{
    bool cut = !p->complete && now - p->t_req > nt->timeout;
    /* An answer whose client took nothing of it for the timeout (the
     * socket's unsent and unacknowledged bytes unchanged, none taken
     * through a stream's reader): it stopped reading, and its connection
     * (with up to STREAM_MAX_UNSENT bytes of a stream) would otherwise
     * stay for as long as it stays. */
    int q = 0;
    if (p->fd < 0 || ioctl(p->fd, SIOCOUTQ, &q)) q = 0;
    if (q != p->outq) {
        p->outq = q;
        p->t_out = now;
    }
    bool stalled = q > 0 && now - p->t_out > nt->timeout;
    job *j = p->j;
    if (j) {
        pthread_mutex_lock(&j->mu);
        cut |= j->overflow;
        double t_took = j->t_sent > p->t_out ? j->t_sent : p->t_out;
        stalled = (q > 0 || (j->stream && j->out.len > j->sent)) && now - t_took > nt->timeout;
        if (j->suspended && p->fd >= 0) { /* libmicrohttpd does not watch it now */
            struct pollfd pfd = {.fd = p->fd, .events = POLLRDHUP};
            if (poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR))) j->canceled = true;
            else if (j->stream && now - j->t_sent >= KEEPALIVE - TICK_MS / 1000.0) { /* the tick's jitter */
                j->ping = true;
                job_wake(j);
            }
        }
        pthread_mutex_unlock(&j->mu);
    }
    cut |= stalled;
    if (cut && p->fd >= 0) {
        shutdown(p->fd, SHUT_RDWR); /* libmicrohttpd sees the end and closes it */
        p->cut = true;
    }
}

static void *ticker_main(void *arg)
{
    net *nt = arg;
    pthread_mutex_lock(&nt->mu);
    while (!nt->stop) {
        double now = kvt_now();
        for (peer *p = nt->head; p; p = p->next)
            if (!p->cut) tick_peer(nt, p, now);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += TICK_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        pthread_cond_timedwait(&nt->cv, &nt->mu, &ts);
    }
    pthread_mutex_unlock(&nt->mu);
    return NULL;
}

/* ---- lifecycle ---- */

/* libmicrohttpd's messages, minus the ones every client that goes away
 * causes (mid-answer, or before its request was whole): a line each would
 * let any client fill the log at the rate it connects. */
static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    if (strstr(fmt, "Failed to send") || strstr(fmt, "closed by remote side with incomplete request")) return;
    vfprintf(stderr, fmt, ap);
    (void)cls;
}

static volatile sig_atomic_t got_signal;
static void on_signal(int sig) { got_signal = sig; }

/* The connection limits: the soft descriptor limit raised to the hard one,
 * libmicrohttpd's own limit (past which it closes new connections) at it
 * less FD_RESERVE, --max-connections below that, so that there is room to
 * answer 503. */
static void net_init(net *nt, server *sv)
{
    nt->sv = sv;
    pthread_mutex_init(&nt->mu, NULL);
    pthread_cond_init(&nt->cv, NULL);
    nt->timeout = sv->o.request_timeout ? sv->o.request_timeout : 30;
    struct rlimit rl;
    unsigned fds = 1024;
    if (!getrlimit(RLIMIT_NOFILE, &rl)) {
        if (rl.rlim_cur < rl.rlim_max) {
            rlim_t want = rl.rlim_max;
            rl.rlim_cur = want;
            if (setrlimit(RLIMIT_NOFILE, &rl)) getrlimit(RLIMIT_NOFILE, &rl);
        }
        fds = rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > (1u << 20) ? 1u << 20 : (unsigned)rl.rlim_cur;
    }
    unsigned hard = fds > 2 * FD_RESERVE ? fds - FD_RESERVE : fds / 2;
    unsigned want = sv->o.max_connections ? sv->o.max_connections : 4096;
    nt->max_conns = want;
    if (nt->max_conns > hard - hard / 16) nt->max_conns = hard - hard / 16;
    if (nt->max_conns < want)
        fprintf(stderr, "kvtier: --max-connections %u: at most %u with %u descriptors (ulimit -n)\n", want,
                nt->max_conns, fds);
    nt->hard = hard;
}

static struct MHD_Daemon *net_start(net *nt, const struct sockaddr_in *addr)
{
    const kvt_server_opts *o = &nt->sv->o;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    unsigned pool = cores < 2 ? 2 : cores > 8 ? 8 : (unsigned)cores;
    struct MHD_Daemon *d = MHD_start_daemon(
        MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG, o->port, NULL, NULL, handle, nt,
        MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL, MHD_OPTION_SOCK_ADDR, addr,
        MHD_OPTION_THREAD_POOL_SIZE, pool, MHD_OPTION_CONNECTION_LIMIT, nt->hard,
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)(o->max_conn_per_addr ? o->max_conn_per_addr : 256),
        MHD_OPTION_LISTEN_BACKLOG_SIZE, 4096u, MHD_OPTION_NOTIFY_CONNECTION, conn_notify, nt,
        MHD_OPTION_NOTIFY_COMPLETED, request_done, nt, MHD_OPTION_CONNECTION_TIMEOUT, 0u, MHD_OPTION_END);
    if (!d) return NULL;
    if (pthread_create(&nt->ticker, NULL, ticker_main, nt)) {
        MHD_stop_daemon(d);
        errno = EAGAIN;
        return NULL;
    }
    nt->started = true;
    return d;
}

/* A connection still sending a request's answer (its request not over). */
static bool answers_unsent(const net *nt)
{
    for (const peer *p = nt->head; p; p = p->next)
        if (p->j) return true;
    return false;
}

/* Once the worker is done: the answers it gave (the running requests'
 * ends, the queued ones' 503s) go out, for at most STOP_DRAIN seconds, the
 * ticker still cutting the clients that stopped reading; then every
 * connection closes. */
static void net_stop(net *nt, struct MHD_Daemon *d)
{
    double until = kvt_now() + STOP_DRAIN;
    pthread_mutex_lock(&nt->mu);
    while (answers_unsent(nt) && kvt_now() < until) {
        pthread_mutex_unlock(&nt->mu);
        nanosleep(&(struct timespec){0, 20 * 1000000L}, NULL);
        pthread_mutex_lock(&nt->mu);
    }
    nt->stop = true;
    pthread_cond_broadcast(&nt->cv);
    pthread_mutex_unlock(&nt->mu);
    if (nt->started) pthread_join(nt->ticker, NULL);
    nt->started = false;
    MHD_stop_daemon(d); /* closes every connection: the peers leave the list */
}

static void net_free(net *nt)
{
    if (!nt) return;
    pthread_mutex_destroy(&nt->mu);
    pthread_cond_destroy(&nt->cv);
    free(nt);
}

/* --parallel, or by default two requests per core (a decode step reads
 * every weight once for all of them, and a second request hides the
 * first's sampling and HTTP time) as far as the RAM budget holds them at
 * the full context, at least one. */
static int parallel_default(server *sv)
{
    _Static_assert(KVT_SERVE_MAX_PARALLEL == KVT_TIERS_MAX_BUSY, "one bound for both");
    if (sv->o.parallel > KVT_SERVE_MAX_PARALLEL)
        return kvt_fail(KVT_EINVAL, "--parallel %u: at most %d", sv->o.parallel, KVT_SERVE_MAX_PARALLEL);
    sv->parallel = sv->o.parallel;
    if (!sv->parallel) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        size_t n = cores > 0 ? 2 * (size_t)cores : 2;
        if (n > KVT_SERVE_MAX_PARALLEL) n = KVT_SERVE_MAX_PARALLEL;
        kvt_plan pl;
        if (kvt_model_plan(sv->m, sv->o.n_ctx, &pl) == KVT_OK && pl.total) {
            uint64_t fit = sv->o.ram_bytes / pl.total;
            if (fit < n) n = fit ? (size_t)fit : 1;
        }
        sv->parallel = n;
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
    net *nt = rc ? NULL : kvt_calloc(1, sizeof *nt);
    if (!sv || !nt) { if (!rc) rc = KVT_ENOMEM; free(sv); free(nt); goto restore; }
    sv->o = *opts;
    net_init(nt, sv);
    pthread_mutex_init(&sv->mu, NULL);
    pthread_mutex_init(&sv->replay_mu, NULL);
    pthread_cond_init(&sv->cv, NULL);
    sv->started = (long)time(NULL);
    if ((rc = kvt_fill_random(sv->secret, sizeof sv->secret))) goto out;
    char note[256];
    if (kvt_model_memory_note(opts->model, opts->draft == KVT_DRAFT_MTP ? opts->model_draft : NULL, note, sizeof note))
        fprintf(stderr, "kvtier: %s: %s\n", opts->model, note);
    char fpdir[4200]; /* the fingerprint cache: in the disk store's directory (docs/FORMAT.md) */
    if (opts->disk_dir) snprintf(fpdir, sizeof fpdir, "%s/fingerprints", opts->disk_dir);
    if ((rc = kvt_model_open(&sv->m, opts->model)) ||
        (rc = kvt_model_set_cache_types(sv->m, opts->type_k, opts->type_v)) ||
        (opts->disk_dir && (rc = kvt_model_set_fingerprint_dir(sv->m, fpdir))))
        goto out;
    if (!sv->o.n_ctx) sv->o.n_ctx = sv->m->info.n_ctx_train;
    if (sv->o.draft == KVT_DRAFT_AUTO) {
        const char *why = NULL;
        sv->o.draft = kvt_draft_auto(sv->m, &why);
        if (why) fprintf(stderr, "kvtier: speculative decoding off for this model (--draft ngram turns it on): %s\n", why);
    }
    if (sv->o.draft == KVT_DRAFT_MODEL &&
        ((rc = kvt_model_open(&sv->dmodel, opts->model_draft)) ||
         (rc = kvt_model_set_cache_types(sv->dmodel, opts->type_k, opts->type_v)) ||
         (rc = kvt_draft_vocab_check(sv->m, sv->dmodel)))) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", kvt_errmsg());
        rc = kvt_fail(rc, "--model-draft %s: %s", opts->model_draft ? opts->model_draft : "(none)", msg);
        goto out;
    }
    if (sv->o.draft == KVT_DRAFT_MTP && opts->model_draft && (rc = kvt_draft_mtp_attach(sv->m, opts->model_draft)))
        goto out; /* ds4.c's separate MTP file, before any session */
    if (sv->o.draft == KVT_DRAFT_MTP && (rc = kvt_draft_mtp_check(sv->m, opts->model ? opts->model : sv->m->info.name)))
        goto out;
    if (sv->o.draft == KVT_DRAFT_MTP && (rc = kvt_draft_mtp_prepare(sv->m))) goto out; /* Qwen 3.5: rows kept */
    if (sv->dmodel) { /* a draft session's scratch, which its reservation counts */
        kvt_memory mm;
        if ((rc = kvt_model_memory(NULL, sv->dmodel, sv->o.n_ctx, 1, &mm))) goto out;
        sv->dscratch = (size_t)mm.scratch;
    }
    snprintf(sv->model_id, sizeof sv->model_id, "%s", opts->model_id ? opts->model_id : sv->m->info.name);
    sv->n_tn = opts->n_keys ? opts->n_keys : 1;
    if (sv->n_tn > MAX_TENANTS) {
        rc = kvt_fail(KVT_EINVAL, "at most %d API keys", MAX_TENANTS);
        goto out;
    }
    if ((rc = parallel_default(sv))) goto out;
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
    /* the root holds the secret the keys' directory names are keyed with */
    bool disk = opts->disk_dir != NULL;
    if (disk && opts->n_keys && kvt_storedir_prepare(opts->disk_dir) != KVT_OK) {
        fprintf(stderr, "kvtier: disk cache disabled: %s\n", kvt_errmsg());
        disk = false;
    }
    for (size_t t = 0; t < sv->n_tn; t++) {
        tenant *tt = &sv->tn[t];
        tt->key = opts->n_keys ? opts->api_keys[t] : NULL;
        if (tt->key) {
            key_digest(sv, tt->key, tt->digest);
            const char *name = opts->api_key_names ? opts->api_key_names[t] : NULL;
            if (name && *name) snprintf(tt->label, sizeof tt->label, "%s", name);
            else snprintf(tt->label, sizeof tt->label, "key%zu", t + 1);
        }
        if (!disk) continue;
        if (tt->key) {
            /* a directory per key, named by a keyed hash of it (storedir.h) */
            char ns[64];
            if (kvt_storedir_ns(opts->disk_dir, tt->key, strlen(tt->key), ns, sizeof ns) != KVT_OK) {
                fprintf(stderr, "kvtier: disk cache disabled for %s: %s\n", tt->label, kvt_errmsg());
                continue;
            }
            snprintf(tt->dir, sizeof tt->dir, "%s/%s", opts->disk_dir, ns);
        } else {
            snprintf(tt->dir, sizeof tt->dir, "%s", opts->disk_dir);
        }
        if ((rc = kvt_store_open(&tt->store, tt->dir, disk_share))) {
            fprintf(stderr, "kvtier: disk cache disabled for %s: %s\n", tt->dir, kvt_errmsg());
            tt->store = NULL;
        } else {
            kvt_store_set_min_free(tt->store, opts->disk_min_free);
        }
    }
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(opts->port)};
    if (inet_pton(AF_INET, opts->host, &addr.sin_addr) != 1) {
        rc = kvt_fail(KVT_EINVAL, "--host '%s' is not an IPv4 address", opts->host);
        goto out;
    }
    kvt_storeq_hooks qh = {queue_saved, tier_loaded, queue_wake, sv};
    /* tests/test_storeq.c's negative control: saves on the scheduler */
    const char *inl = getenv("KVT_FAULT_SAVES_INLINE");
    kvt_storeq_fault_inline = inl && !strcmp(inl, "1");
    if ((rc = kvt_storeq_new(&sv->q, &sv->o.policy, &qh))) goto out;
    if (opts->remote_url) {
        if (!sv->tn[0].store) {
            rc = kvt_fail(KVT_EINVAL, "--kv-remote needs the disk tier (--kv-disk-dir): a remote hit is kept there");
            goto out;
        }
        kvt_remote_opts ro = {.url = opts->remote_url, .password_file = opts->remote_password_file,
                              .tls_ca = opts->remote_tls_ca, .tls_cert = opts->remote_tls_cert,
                              .tls_key = opts->remote_tls_key,
                              .secret_file = opts->remote_secret_file, .tenants = opts->n_keys ? opts->api_keys : NULL,
                              .n_tenants = opts->n_keys, .keyed_tenants = opts->n_keys > 0,
                              .lookup_ms = (int)opts->remote_lookup_ms, .prefill_tps = opts->remote_prefill_tps};
        if ((rc = kvt_remote_open(&sv->remote, sv->m, &ro))) goto out;
        kvt_storeq_set_remote(sv->q, sv->remote);
    }
    /* the RAM index keys blocks by the records' chain when a session can
     * be saved or looked up (a store; the remote tier needs one), else by
     * one that never leaves the process and needs no fingerprint of every
     * weight (the first prompt of a whole block would read the whole file) */
    bool any_store = false;
    /* tests/test_server.c's negative control: the process chain seeded by
     * the fingerprint, as every chain was */
    const char *seed = getenv("KVT_FAULT_PROCESS_SEED_FINGERPRINTED");
    kvt_snap_fault = seed && !strcmp(seed, "1") ? KVT_SNAP_FAULT_PROCESS_SEED_FINGERPRINTED : KVT_SNAP_FAULT_NONE;
    for (size_t t = 0; t < sv->n_tn; t++) any_store |= sv->tn[t].store != NULL;
    kvt_tiers_opts to = {.ram_bytes = sv->o.ram_bytes, .n_tenants = sv->n_tn, .n_ctx = sv->o.n_ctx,
                         .n_threads = sv->o.n_threads, .policy = sv->o.policy,
                         .hooks = {.saved = tier_saved, .evicted = tier_evicted, .loaded = tier_loaded,
                                   .trimmed = tier_trimmed, .user = sv,
                                   .hand_off = tier_hand_off, .held = tier_held},
                         .defer_loads = true,
                         .keys = any_store || sv->remote ? KVT_KEYS_RECORDS : KVT_KEYS_PROCESS};
    if ((rc = kvt_tiers_new(&sv->tiers, sv->m, &to))) goto out;
    for (size_t t = 0; t < sv->n_tn; t++)
        if (sv->tn[t].store) kvt_store_set_busy(sv->tn[t].store, STORE_BUSY_MS);
    if (pthread_create(&sv->worker, NULL, worker_main, sv)) { rc = kvt_fail(KVT_ENOMEM, "worker thread"); goto out; }
    struct MHD_Daemon *d = net_start(nt, &addr);
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
    fprintf(stderr, "kvtier: serving %s on http://%s:%u (context %u, %zu requests at once, disk cache %s%s%s)\n",
            sv->model_id, opts->host, opts->port, sv->o.n_ctx, sv->parallel, sv->tn[0].store ? opts->disk_dir : "off",
            sv->remote ? ", remote tier " : "", sv->remote ? opts->remote_url : "");
    if (sv->o.draft)
        fprintf(stderr, "kvtier: speculative decoding: --draft %s%s%s, up to %u tokens drafted a pass\n",
                kvt_draft_name(sv->o.draft), opts->model_draft ? " " : "", opts->model_draft ? opts->model_draft : "",
                sv->o.draft_max ? sv->o.draft_max : KVT_DRAFT_MAX_DEFAULT);
    if (opts->ready) opts->ready(opts->ready_user);
    sigset_t wait = old_mask;  /* the caller's mask, with the two let through */
    sigdelset(&wait, SIGTERM);
    sigdelset(&wait, SIGINT);
    while (!got_signal) sigsuspend(&wait);
    fprintf(stderr, "kvtier: signal %d: stopping\n", (int)got_signal);
    MHD_socket ls = MHD_quiesce_daemon(d); /* stop accepting */
    pthread_mutex_lock(&sv->mu);
    sv->stopping = true;                   /* queued jobs get 503; the running one finishes */
    pthread_cond_broadcast(&sv->cv);
    pthread_mutex_unlock(&sv->mu);
    pthread_join(sv->worker, NULL);
    /* every job is done, so no connection is suspended (libmicrohttpd
     * must not stop with one) and none will be */
    net_stop(nt, d);
    if (ls != MHD_INVALID_SOCKET) close(ls); /* after the stop: a pool thread may use it until then */
    pool_shutdown(sv);
    rc = KVT_OK;
out:
    pool_shutdown(sv);
    kvt_storeq_free(sv->q); /* the queued saves first */
    kvt_remote_close(sv->remote); /* then their uploads, a second at most */
    kvt_tiers_free(sv->tiers);
    for (size_t t = 0; t < sv->n_tn; t++) kvt_store_close(sv->tn[t].store);
    kvt_model_close(sv->m);
    kvt_model_close(sv->dmodel);
    for (size_t i = 0; i < MAX_REPLAY; i++) free(sv->rp[i].text);
    pthread_mutex_destroy(&sv->mu);
    pthread_mutex_destroy(&sv->replay_mu);
    pthread_cond_destroy(&sv->cv);
    explicit_bzero(sv->secret, sizeof sv->secret);
    free(sv);
    net_free(nt);
restore:
    /* the mask first: a signal still pending goes to on_signal, not to the
     * caller's disposition (by default, the end of the process) */
    pthread_sigmask(SIG_SETMASK, &old_mask, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    sigaction(SIGINT, &old_int, NULL);
    return rc;
}
