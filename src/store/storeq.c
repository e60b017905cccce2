/* The store thread: the server's disk saves and loads, off its scheduler.
 *
 * The scheduler steps every active request once per forward pass; a save
 * (seconds for a long prompt, or SQLite's busy timeout when another
 * process holds the store's write lock) or a load run there would stall
 * every request. Here they run on two threads of their own, one for the
 * loads and one for the saves:
 *
 *   - a save owns the session it writes: an evicted or shut-down session
 *     (moved here whole, no copy), or the copy of a live session the
 *     scheduler made after its prefill (rows are not shared between
 *     sessions yet, so the live one may change while the copy is saved);
 *   - a load restores into a pooled session the scheduler leaves alone
 *     until it is done (the request waits in a loading state, the others
 *     keep stepping), then the scheduler is woken (hooks.wake);
 *   - loads never queue behind saves: a request waits on each load,
 *     nobody on a save. The saves' thread keeps the process's CPU
 *     priority (at a lower one it was preempted while holding locks the
 *     scheduler takes, malloc's arena among them, and stalled the steps
 *     for 100 to 500 ms on a loaded machine), except inside the system
 *     calls that write its segments, which hold no lock of the process:
 *     there it runs at SCHED_IDLE (kvt_segs_background) while nothing
 *     else waits for the queue (no load queued or running, no other save
 *     queued, no shutdown), so the page cache copies and writeback it
 *     starts take only the cores the steps leave. Anything waiting, a
 *     shutdown or a backlog of saves puts it back at its priority.
 *   - a save that meets another process's lock is tried again later, the
 *     pause doubling from PAUSE_MIN to PAUSE_MAX, the loads and other
 *     saves going on meanwhile (the store's own busy timeout is short in a
 *     server, so one attempt holds the store briefly), and reported at most
 *     once a minute. At shutdown it is given up SHUTDOWN_WAIT seconds after
 *     the queue was told to stop.
 *
 * Sessions queued to be saved count against their tenant's RAM share
 * (kvt_storeq_held, read by the tiers' eviction), at what they hold when
 * asked: a copy queued while its source was live holds next to nothing of
 * its own (its blocks count in the source), and all of them once the
 * source lets them go. */
#include "store/storeq.h"
#include "arch/model.h"
#include "store/store.h"
#include "store/remote.h"
#include "arch/arch.h"
#include "base/threads.h"
#include "base/util.h"
#include "store/segments.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define MAX_TENANTS 64     /* KVT_TIERS_MAX_POOL: a tiers pool has no more */
#define PAUSE_MIN 0.1      /* seconds before a save that met a lock is tried again, */
#define PAUSE_MAX 2.0      /* doubling up to this */
#define SHUTDOWN_WAIT 30.0 /* seconds a shutdown waits for a locked store */

enum { SAVE, SAVE_POLICY, LOAD };

struct kvt_storeq_job {
    kvt_storeq *q;
    int kind, tenant;
    kvt_store *st;
    kvt_session *s;          /* SAVE*: owned; LOAD: borrowed */
    const char *reason;      /* SAVE: static */
    size_t n, from_disk, fork_at;
    const int32_t *toks;     /* LOAD: (n), borrowed */
    size_t match;            /* LOAD: what the lookup found (match tokens of entry id; */
    int64_t id;              /* id -1: look up) */
    size_t bytes_at_queue;   /* SAVE*: its session's bytes when queued (kvt_storeq_fault_held_at_queue) */
    double next_try, pause;  /* a save that met a lock: when to try again */
    bool done;               /* LOAD: over (under q->mu), got tokens restored */
    size_t got;
    bool remote;             /* LOAD: ask the remote tier too (when set); it gave the tokens */
    bool from_remote;
    struct kvt_storeq_job *next;
};
typedef struct kvt_storeq_job job;

struct kvt_storeq {
    pthread_mutex_t mu;      /* everything below */
    pthread_cond_t cv;
    pthread_t loader, saver;
    job *head;               /* in the order given */
    bool stopping;
    double stop_at;
    job *saving;             /* the save running (unlinked from head), NULL: none */
    size_t saving_bytes;     /* its session's bytes when it started */
    size_t pending[MAX_TENANTS];
    double busy_logged;      /* when saves waiting for a lock were last reported */
    kvt_save_policy policy;
    kvt_storeq_hooks h;
    kvt_remote *remote;      /* NULL: none */
    bool loading;            /* a load runs */
    _Atomic bool quiet;      /* nothing waits: no job queued, no load running, not stopping */
};

static const char REMOTE_REASON[] = "remote";
bool kvt_storeq_fault_no_idle, kvt_storeq_fault_inline;

/* After a change to the jobs: whether nothing waits (under q->mu). */
static void note_quiet(kvt_storeq *q)
{
    atomic_store(&q->quiet, !q->head && !q->loading && !q->stopping);
}

/* The saves' thread's writes are background work while nothing waits
 * (kvt_segs_background: asked at idle priority, so no lock). */
static bool writes_idle(void *arg)
{
    kvt_storeq *q = arg;
    return atomic_load(&q->quiet);
}
static job *job_new(kvt_storeq *q, int kind, kvt_store *st, int tenant, kvt_session *s);
static int push(kvt_storeq *q, job *j);

static bool give_up(kvt_storeq *q, double now)
{
    return q->stopping && now - q->stop_at > SHUTDOWN_WAIT;
}

/* After save j committed: hand its points to the remote tier (a record
 * that came from it is not sent back). */
static void upload_points(kvt_storeq *q, job *j)
{
    if (j->kind == SAVE) {
        if (j->reason != REMOTE_REASON) kvt_remote_upload(q->remote, j->tenant, j->s, kvt_session_len(j->s));
        return;
    }
    size_t cold = kvt_save_policy_cold(&q->policy, j->n);
    if (cold >= q->policy.min_tokens && cold > j->from_disk) kvt_remote_upload(q->remote, j->tenant, j->s, cold);
    if (j->fork_at && j->fork_at != cold && j->fork_at >= q->policy.min_tokens)
        kvt_remote_upload(q->remote, j->tenant, j->s, j->fork_at);
}

/* Run save j (q->mu not held); true when it is over, false to try later. */
static bool run_save(kvt_storeq *q, job *j)
{
    double t0 = kvt_now();
    size_t created = 0;
    bool busy = false;
    int rc;
    if (j->kind == SAVE) {
        bool made = false;
        kvt_store_busy_seen(true);
        rc = kvt_store_save_new(j->st, j->s, kvt_session_len(j->s), j->reason, NULL, &made);
        busy = rc && kvt_store_busy_seen(true);
        created = made;
    } else {
        rc = kvt_store_apply_policy_busy(j->st, j->s, &q->policy, j->n, j->from_disk, j->fork_at, &created, &busy);
    }
    double now = kvt_now();
    pthread_mutex_lock(&q->mu);
    bool later = busy && !give_up(q, now);
    bool report = busy && (now - q->busy_logged >= 60 || !later);
    if (later) {
        j->pause = j->pause ? j->pause * 2 : PAUSE_MIN;
        if (j->pause > PAUSE_MAX) j->pause = PAUSE_MAX;
        j->next_try = now + j->pause;
    }
    if (report) q->busy_logged = now;
    pthread_mutex_unlock(&q->mu);
    if (report)
        fprintf(stderr, later ? "kvtier: cache store busy (another process holds its lock): saves wait and retry\n"
                              : "kvtier: cache store busy (another process holds its lock): a save given up at shutdown\n");
    if (later) return false;
    if (busy && !rc) rc = kvt_fail(KVT_EIO, "cache store busy: save given up");
    if (!rc && q->remote) upload_points(q, j);
    if (q->h.saved) q->h.saved(q->h.user, j->tenant, now - t0, rc, created);
    return true;
}

/* A remote hit goes to the local disk too: a copy of the session is queued
 * to be saved (the scheduler keeps the session itself). */
static void save_copy(kvt_storeq *q, job *j)
{
    kvt_session_opts so = {.n_ctx = j->s->n_ctx, .n_threads = 1};
    kvt_session *c = NULL;
    if (kvt_session_new(&c, j->s->m, &so) || kvt_session_clone(c, j->s)) {
        kvt_session_free(c);
        return;
    }
    job *k = job_new(q, SAVE, j->st, j->tenant, c);
    if (!k) { kvt_session_free(c); return; }
    k->reason = REMOTE_REASON;
    if (push(q, k)) kvt_session_free(c);
}

static void run_load(kvt_storeq *q, job *j)
{
    double t0 = kvt_now();
    size_t got = 0;
    if ((j->match || j->id >= 0) && kvt_store_restore_found(j->st, j->s, j->toks, j->n, j->match, j->id, &got))
        got = 0;
    if (j->remote && q->remote) {
        size_t r = 0;
        kvt_remote_restore(q->remote, j->tenant, j->s, j->toks, j->n, got, &r);
        if (r > got) {
            got = r;
            j->from_remote = true;
            save_copy(q, j);
        } else if (got && kvt_session_len(j->s) != got) {
            /* a remote value failed its checks while loading and emptied s */
            if (kvt_store_restore_found(j->st, j->s, j->toks, j->n, got, -1, &got)) got = 0;
        }
    }
    int tenant = j->tenant;
    if (q->h.loaded) q->h.loaded(q->h.user, tenant, kvt_now() - t0);
    pthread_mutex_lock(&q->mu);
    j->got = got;
    j->done = true; /* j is the scheduler's to free from here on */
    q->pending[tenant]--;
    q->loading = false;
    note_quiet(q);
    pthread_mutex_unlock(&q->mu);
    if (q->h.wake) q->h.wake(q->h.user);
}

/* The next job of its thread to run, unlinked: the first load (loads), or
 * the first save due; NULL: none due, *wake_at when the first waiting save
 * is (0: none waits), *left whether the thread has jobs at all. Under q->mu. */
static job *next_job(kvt_storeq *q, bool loads, double now, double *wake_at, bool *left)
{
    job **pick = NULL;
    *wake_at = 0;
    *left = false;
    for (job **p = &q->head; !pick && *p; p = &(*p)->next) {
        if (((*p)->kind == LOAD) != loads) continue;
        *left = true;
        if ((*p)->next_try <= now) pick = p;
        else if (!*wake_at || (*p)->next_try < *wake_at) *wake_at = (*p)->next_try;
    }
    if (!pick) return NULL;
    job *j = *pick;
    *pick = j->next;
    j->next = NULL;
    return j;
}

/* The loads' thread (loads) or the saves'. */
static void run_thread(kvt_storeq *q, bool loads)
{
    pthread_mutex_lock(&q->mu);
    for (;;) {
        double now = kvt_now(), wake_at;
        bool left;
        job *j = next_job(q, loads, now, &wake_at, &left);
        if (!j) {
            if (!left && q->stopping) break;
            if (!wake_at) {
                pthread_cond_wait(&q->cv, &q->mu);
            } else {
                /* a save waits for a lock: sleep until it is due or a job comes */
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                double d = wake_at - now;
                if (d < 0.001) d = 0.001;
                ts.tv_sec += (time_t)d;
                ts.tv_nsec += (long)((d - (double)(time_t)d) * 1e9);
                if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
                pthread_cond_timedwait(&q->cv, &q->mu, &ts);
            }
            continue;
        }
        if (j->kind == LOAD) q->loading = true;
        note_quiet(q);
        pthread_mutex_unlock(&q->mu);
        if (j->kind == LOAD) {
            run_load(q, j);
            pthread_mutex_lock(&q->mu);
            continue;
        }
        size_t bytes = kvt_storeq_fault_held_at_queue ? j->bytes_at_queue : kvt_session_bytes(j->s);
        pthread_mutex_lock(&q->mu);
        q->saving = j;
        q->saving_bytes = bytes;
        pthread_mutex_unlock(&q->mu);
        bool over = run_save(q, j);
        pthread_mutex_lock(&q->mu);
        q->saving = NULL;
        if (over) {
            q->pending[j->tenant]--;
            pthread_mutex_unlock(&q->mu);
            kvt_session_free(j->s);
            free(j);
            pthread_mutex_lock(&q->mu);
        } else { /* back at the front: it keeps its turn among the saves */
            j->next = q->head;
            q->head = j;
            note_quiet(q);
        }
    }
    pthread_mutex_unlock(&q->mu);
}

static void *load_main(void *arg) { run_thread(arg, true); return NULL; }
static void *save_main(void *arg)
{
    if (!kvt_storeq_fault_no_idle && kvt_thread_idle_ok()) kvt_segs_background(writes_idle, arg);
    run_thread(arg, false);
    return NULL;
}

int kvt_storeq_new(kvt_storeq **out, const kvt_save_policy *policy, const kvt_storeq_hooks *h)
{
    *out = NULL;
    kvt_storeq *q = kvt_calloc(1, sizeof *q);
    if (!q) return KVT_ENOMEM;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->policy = *policy;
    if (h) q->h = *h;
    note_quiet(q);
    if (pthread_create(&q->loader, NULL, load_main, q)) {
        pthread_mutex_destroy(&q->mu);
        pthread_cond_destroy(&q->cv);
        free(q);
        return kvt_fail(KVT_ENOMEM, "store thread");
    }
    if (pthread_create(&q->saver, NULL, save_main, q)) {
        pthread_mutex_lock(&q->mu);
        q->stopping = true;
        pthread_cond_broadcast(&q->cv);
        pthread_mutex_unlock(&q->mu);
        pthread_join(q->loader, NULL);
        pthread_mutex_destroy(&q->mu);
        pthread_cond_destroy(&q->cv);
        free(q);
        return kvt_fail(KVT_ENOMEM, "store thread");
    }
    *out = q;
    return KVT_OK;
}

void kvt_storeq_free(kvt_storeq *q)
{
    if (!q) return;
    pthread_mutex_lock(&q->mu);
    q->stopping = true;
    q->stop_at = kvt_now();
    note_quiet(q);
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    pthread_join(q->loader, NULL);
    pthread_join(q->saver, NULL);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    free(q);
}

static int push(kvt_storeq *q, job *j)
{
    if (j->tenant < 0 || j->tenant >= MAX_TENANTS) {
        int t = j->tenant;
        free(j);
        return kvt_fail(KVT_EINVAL, "tenant %d of the store queue", t);
    }
    if (kvt_storeq_fault_inline && j->kind != LOAD && run_save(q, j)) { /* the fault: on the caller's thread */
        kvt_session_free(j->s);
        free(j);
        return KVT_OK;
    }
    pthread_mutex_lock(&q->mu);
    job **p = &q->head;
    while (*p) p = &(*p)->next;
    *p = j;
    q->pending[j->tenant]++;
    note_quiet(q);
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return KVT_OK;
}

static job *job_new(kvt_storeq *q, int kind, kvt_store *st, int tenant, kvt_session *s)
{
    job *j = kvt_calloc(1, sizeof *j);
    if (!j) return NULL;
    *j = (job){.q = q, .kind = kind, .tenant = tenant, .st = st, .s = s};
    if (kind != LOAD) j->bytes_at_queue = kvt_session_bytes(s);
    return j;
}

int kvt_storeq_save(kvt_storeq *q, kvt_store *st, int tenant, kvt_session *s, const char *reason)
{
    job *j = job_new(q, SAVE, st, tenant, s);
    if (!j) return KVT_ENOMEM;
    j->reason = reason;
    return push(q, j);
}

int kvt_storeq_save_policy(kvt_storeq *q, kvt_store *st, int tenant, kvt_session *s, size_t n, size_t from_disk,
                           size_t fork_at)
{
    job *j = job_new(q, SAVE_POLICY, st, tenant, s);
    if (!j) return KVT_ENOMEM;
    j->n = n;
    j->from_disk = from_disk;
    j->fork_at = fork_at;
    return push(q, j);
}

int kvt_storeq_load(kvt_storeq *q, kvt_store *st, int tenant, kvt_session *s, const int32_t *toks, size_t n,
                    size_t match, int64_t id, kvt_storeq_ticket **out)
{
    *out = NULL;
    job *j = job_new(q, LOAD, st, tenant, s);
    if (!j) return KVT_ENOMEM;
    j->toks = toks;
    j->n = n;
    j->match = match;
    j->id = id;
    j->remote = q->remote != NULL;
    int rc = push(q, j);
    if (!rc) *out = j;
    return rc;
}

bool kvt_storeq_load_done(kvt_storeq_ticket *ld, size_t *got, bool *from_remote)
{
    pthread_mutex_lock(&ld->q->mu);
    bool done = ld->done;
    pthread_mutex_unlock(&ld->q->mu);
    if (!done) return false;
    *got = ld->got;
    if (from_remote) *from_remote = ld->from_remote;
    free(ld);
    return true;
}

bool kvt_storeq_fault_held_at_queue;

size_t kvt_storeq_held(kvt_storeq *q, int tenant)
{
    size_t b = 0;
    pthread_mutex_lock(&q->mu);
    /* the queued sessions are nobody else's until the saves' thread takes
     * one (under q->mu): read here as they are now */
    for (const job *j = q->head; j; j = j->next)
        if (j->kind != LOAD && j->tenant == tenant)
            b += kvt_storeq_fault_held_at_queue ? j->bytes_at_queue : kvt_session_bytes(j->s);
    if (q->saving && q->saving->tenant == tenant) b += q->saving_bytes;
    pthread_mutex_unlock(&q->mu);
    return b;
}

size_t kvt_storeq_pending(kvt_storeq *q, int tenant)
{
    if (tenant < 0 || tenant >= MAX_TENANTS) return 0;
    pthread_mutex_lock(&q->mu);
    size_t n = q->pending[tenant];
    pthread_mutex_unlock(&q->mu);
    return n;
}

void kvt_storeq_set_remote(kvt_storeq *q, kvt_remote *r) { q->remote = r; }
