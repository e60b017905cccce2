/* kvtier serve's /metrics: the Prometheus text of a tenant's figures, or
 * of every tenant's for the metrics key (server.c gathers them). */
#include "app/server_int.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define METRICS_STORE_WAIT_MS 5 /* /metrics waits this long for a store a save holds (then: its last figures) */

static const double hist_bounds[N_BOUNDS] = {0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60};

void kvt_server_hist_add(hist *h, double v)
{
    size_t i = 0;
    while (i < N_BOUNDS && v > hist_bounds[i]) i++;
    h->bucket[i]++;
    h->sum += v;
    h->count++;
}

/* ---- metrics text ---- */

/* One tenant's figures, copied for printing; lbl is the label that names
 * it in the operator view ("" in a key's own view). */
typedef struct mview {
    metrics mx;
    kvt_store_stats ds;
    size_t ram, ram_entries, queued, active;
    size_t draft_ram, draft_kept;
    size_t store_jobs, store_held;  /* the store threads' queue (storeq.h) */
    uint64_t ram_budget;
    char lbl[64];               /* tenant="NAME" or "" */
} mview;

/* "{tenant=\"NAME\",extra}", "{extra}", or "" when both are empty. */
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

/* The remote tier's families (remote.h's figures). */
static void remote_metrics(kvt_remote *r, kvt_wbuf *b)
{
    kvt_remote_stats st;
    kvt_remote_stats_get(r, &st);
    mview none = {0};
    char line[160];
    static const struct { const char *name, *type, *help; } f[] = {
        {"kvtier_remote_lookups_total", "counter", "Remote tier lookups, by result (hit, miss)."},
        {"kvtier_remote_errors_total", "counter", "Remote tier round trips that failed or timed out (each a miss)."},
        {"kvtier_remote_bad_values_total", "counter", "Values read from the remote tier that failed a check (deleted)."},
        {"kvtier_remote_stale_total", "counter", "Remote index entries whose values were gone (evicted), dropped."},
        {"kvtier_remote_hit_tokens_total", "counter", "Prompt tokens restored from the remote tier."},
        {"kvtier_remote_bytes_total", "counter", "Bytes moved to and from the remote tier, by direction."},
        {"kvtier_remote_uploads_total", "counter", "Snapshots uploaded to the remote tier."},
        {"kvtier_remote_dropped_total", "counter", "Uploads not queued or not sent (queue full, breaker open, errors)."},
        {"kvtier_remote_upload_queue", "gauge", "Uploads waiting to be sent."},
        {"kvtier_remote_upload_queue_bytes", "gauge", "Bytes of the uploads waiting to be sent."},
        {"kvtier_remote_seconds_total", "counter", "Time spent in remote lookups, and in the loads of hits."},
        {"kvtier_remote_breaker", "gauge", "The circuit breaker: 0 closed, 1 open, 2 half-open (probing)."},
        {"kvtier_remote_breaker_trips_total", "counter", "Times the circuit breaker opened."},
        {"kvtier_remote_abandoned_total", "counter",
         "Remote loads given up at their deadline (slower than the prefill they would save)."},
        {"kvtier_remote_load_peak_bytes", "gauge",
         "The most bytes of values one remote restore held at once (its snapshot record and a window of blocks)."},
        {"kvtier_remote_shard_breaker", "gauge",
         "Each shard's circuit breaker (a cluster's masters by the order of their first slot; shard 0 one server)."},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        put_head(b, f[i].name, f[i].type, f[i].help);
        switch (i) {
        case 0:
            put_val(b, f[i].name, &none, "result=\"hit\"", st.hits);
            put_val(b, f[i].name, &none, "result=\"miss\"", st.misses);
            break;
        case 1: put_val(b, f[i].name, &none, "", st.errors); break;
        case 2: put_val(b, f[i].name, &none, "", st.bad); break;
        case 3: put_val(b, f[i].name, &none, "", st.stale); break;
        case 4: put_val(b, f[i].name, &none, "", st.hit_tokens); break;
        case 5:
            put_val(b, f[i].name, &none, "direction=\"read\"", st.bytes_read);
            put_val(b, f[i].name, &none, "direction=\"written\"", st.bytes_written);
            break;
        case 6: put_val(b, f[i].name, &none, "", st.uploads); break;
        case 7: put_val(b, f[i].name, &none, "", st.dropped); break;
        case 8: put_val(b, f[i].name, &none, "", st.queue_len); break;
        case 9: put_val(b, f[i].name, &none, "", st.queue_bytes); break;
        case 10:
            snprintf(line, sizeof line, "%s{phase=\"lookup\"} %.6f\n%s{phase=\"hit_load\"} %.6f\n", f[i].name,
                     st.lookup_seconds, f[i].name, st.load_seconds);
            kvt_wbuf_put(b, line, strlen(line));
            break;
        case 11: put_val(b, f[i].name, &none, "", (unsigned long long)st.breaker); break;
        case 12: put_val(b, f[i].name, &none, "", st.breaker_trips); break;
        case 13: put_val(b, f[i].name, &none, "", st.abandoned); break;
        case 14: put_val(b, f[i].name, &none, "", st.load_peak_bytes); break;
        default: {
            /* a cluster's masters, as many as it has (a thousand and more) */
            int *br = kvt_calloc(st.n_shards ? st.n_shards : 1, sizeof *br);
            size_t n = br ? kvt_remote_shard_breakers(r, br, st.n_shards) : 0;
            for (size_t k = 0; k < n && k < st.n_shards; k++) {
                char shard[32];
                snprintf(shard, sizeof shard, "shard=\"%zu\"", k);
                put_val(b, f[i].name, &none, shard, (unsigned long long)br[k]);
            }
            free(br);
            break;
        }
        }
    }
}

/* The Prometheus text for tenant tnt, its own figures and nothing of any
 * other key's; for KEY_METRICS every tenant's, each series labelled
 * tenant="NAME" (--api-key NAME=KEY, or key1, key2, ... in the order
 * the keys were given: nothing derived from a key), and the requests
 * that belong to no tenant. */
char *kvt_server_metrics_text(server *sv, int tnt)
{
    size_t first = tnt >= 0 ? (size_t)tnt : 0, nv = tnt >= 0 ? 1 : sv->n_tn;
    mview *v = kvt_calloc(nv, sizeof *v);
    if (!v) return NULL;
    for (size_t k = 0; k < nv; k++) {
        const tenant *tt = &sv->tn[first + k];
        /* the queue first: when it is empty, the figures read after it
         * count every save it held */
        if (sv->q) {
            v[k].store_jobs = kvt_storeq_pending(sv->q, (int)(first + k));
            v[k].store_held = kvt_storeq_held(sv->q, (int)(first + k));
        }
        /* a save holds the store for seconds: the figures it last had then
         * (a scrape must not hold an HTTP thread, nor many scrapes all of
         * them, while it runs) */
        bool stale;
        if (tt->store && kvt_store_stats_try(tt->store, &v[k].ds, METRICS_STORE_WAIT_MS, &stale) != KVT_OK)
            memset(&v[k].ds, 0, sizeof v[k].ds);
        v[k].ram_budget = sv->o.ram_bytes / sv->n_tn;
        if (tnt < 0) snprintf(v[k].lbl, sizeof v[k].lbl, "tenant=\"%s\"", tt->label);
    }
    pthread_mutex_lock(&sv->mu);
    for (size_t k = 0; k < nv; k++) {
        const tenant *tt = &sv->tn[first + k];
        v[k].mx = tt->mx;
        v[k].ram = tt->ram;
        v[k].ram_entries = tt->ram_entries;
        v[k].draft_ram = tt->draft_ram;
        v[k].draft_kept = tt->draft_kept;
        v[k].queued = tt->queued;
        v[k].active = tt->active;
    }
    uint64_t refused = sv->refused, steps[4] = {sv->steps, sv->step_reqs, sv->step_max, sv->steps_waited};
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
#define FAMILY3(name, type, help, e1, x1, e2, x2, e3, x3)                      \
    do {                                                                       \
        put_head(&b, name, type, help);                                        \
        for (size_t k = 0; k < nv; k++) {                                      \
            const mview *w = &v[k];                                            \
            put_val(&b, name, w, e1, (unsigned long long)(x1));                \
            put_val(&b, name, w, e2, (unsigned long long)(x2));                \
            put_val(&b, name, w, e3, (unsigned long long)(x3));                \
        }                                                                      \
    } while (0)
    FAMILY("kvtier_prompt_tokens_total", "counter", "Prompt tokens received.", "", w->mx.prompt_tokens);
    FAMILY("kvtier_prefilled_tokens_total", "counter", "Prompt tokens computed by prefill.", "", w->mx.prefilled);
    FAMILY("kvtier_generated_tokens_total", "counter", "Tokens generated.", "", w->mx.generated);
    FAMILY("kvtier_decode_passes_total", "counter",
           "Forward passes of replies (speculative decoding: a pass may take several tokens).", "",
           w->mx.decode_passes);
    FAMILY("kvtier_draft_tokens_total", "counter", "Tokens drafted for speculative decoding.", "", w->mx.drafted);
    FAMILY("kvtier_draft_accepted_tokens_total", "counter",
           "Drafted tokens accepted (each the token plain decoding samples there).", "", w->mx.accepted);
    FAMILY3("kvtier_drafter_tokens_total", "counter", "Tokens drafted, by drafter.", "drafter=\"ngram\"",
            w->mx.drafted_by[0], "drafter=\"model\"", w->mx.drafted_by[1], "drafter=\"mtp\"", w->mx.drafted_by[2]);
    FAMILY3("kvtier_drafter_accepted_tokens_total", "counter", "Drafted tokens accepted, by drafter.",
            "drafter=\"ngram\"", w->mx.accepted_by[0], "drafter=\"model\"", w->mx.accepted_by[1], "drafter=\"mtp\"",
            w->mx.accepted_by[2]);
    FAMILY3("kvtier_draft_sessions_total", "counter",
            "Draft model sessions replies began on: new, kept in RAM with the model's session, restored from the "
            "store.", "from=\"none\"", w->mx.draft_from[0], "from=\"ram\"", w->mx.draft_from[1], "from=\"store\"",
            w->mx.draft_from[2]);
    FAMILY("kvtier_draft_prefilled_tokens_total", "counter",
           "Tokens the draft model's sessions ran to follow their replies' contexts (drafts not counted).", "",
           w->mx.draft_prefilled);
    FAMILY("kvtier_draft_sessions_dropped_total", "counter",
           "Draft model sessions dropped at a reply's end: no room for them in the RAM share.", "",
           w->mx.draft_dropped);
    FAMILY3("kvtier_reused_tokens_total", "counter", "Prompt tokens reused, by tier.", "tier=\"ram\"",
            w->mx.reused_ram, "tier=\"disk\"", w->mx.reused_disk, "tier=\"remote\"", w->mx.reused_remote);
    FAMILY3("kvtier_cache_hits_total", "counter", "Requests served from a tier.", "tier=\"ram\"", w->mx.hits_ram,
            "tier=\"disk\"", w->mx.hits_disk, "tier=\"remote\"", w->mx.hits_remote);
    FAMILY("kvtier_cache_misses_total", "counter", "Requests no tier could serve.", "", w->mx.misses);
    FAMILY2("kvtier_cache_bytes", "gauge", "Bytes held, by tier.", "tier=\"ram\"", w->ram, "tier=\"disk\"",
            w->ds.bytes);
    FAMILY2("kvtier_cache_budget_bytes", "gauge", "Bytes a tier may hold (a key's share with several keys).",
            "tier=\"ram\"", w->ram_budget, "tier=\"disk\"", w->ds.budget);
    FAMILY2("kvtier_cache_entries", "gauge", "Entries held, by tier.", "tier=\"ram\"", w->ram_entries,
            "tier=\"disk\"", w->ds.snapshots);
    FAMILY2("kvtier_cache_evictions_total", "counter", "Evictions, by tier.", "tier=\"ram\"", w->mx.ram_evictions,
            "tier=\"disk\"", w->ds.evictions);
    FAMILY("kvtier_ram_blocks_evicted_total", "counter",
           "128-token blocks that sessions kept in RAM gave back to the budget.", "", w->mx.ram_blocks_evicted);
    FAMILY("kvtier_disk_saves_total", "counter", "Snapshots written.", "", w->mx.disk_saves);
    FAMILY("kvtier_disk_queue", "gauge", "Disk saves and loads queued or running on the store threads.", "",
           w->store_jobs);
    FAMILY("kvtier_disk_queue_bytes", "gauge", "RAM held by sessions queued to be saved (counted in the RAM budget).",
           "", w->store_held);
    FAMILY("kvtier_draft_session_bytes", "gauge",
           "RAM reserved for drafting by replies in progress: draft model sessions, MTP windows, verify rows (counted "
           "in the RAM budget).", "",
           w->draft_ram);
    FAMILY("kvtier_draft_kept_bytes", "gauge",
           "RAM held by draft model sessions kept with their pooled sessions (part of kvtier_cache_bytes{tier=\"ram\"}).",
           "", w->draft_kept);
    FAMILY("kvtier_canceled_total", "counter", "Prefills stopped because the client went away.", "", w->mx.canceled);
    FAMILY("kvtier_queue_depth", "gauge", "Jobs waiting for a slot.", "", w->queued);
    FAMILY("kvtier_active_requests", "gauge", "Requests the scheduler runs now.", "", w->active);
#undef FAMILY
#undef FAMILY2
#undef FAMILY3
    put_hist(&b, "kvtier_load_seconds", "Time to restore a prefix from disk.", v, nv, offsetof(metrics, load));
    put_hist(&b, "kvtier_save_seconds", "Time to save snapshots.", v, nv, offsetof(metrics, save));
    put_hist(&b, "kvtier_prefill_seconds", "Time to prefill a prompt.", v, nv, offsetof(metrics, prefill));
    put_hist(&b, "kvtier_time_to_first_token_seconds", "Time from a request's arrival to its first token.", v, nv,
             offsetof(metrics, ttft));
    put_hist(&b, "kvtier_inter_token_seconds", "Time between two tokens of a reply.", v, nv, offsetof(metrics, itl));
    /* the passes mix every key's requests: the operator's view, or the one key's */
    if (tnt < 0 || sv->n_tn == 1) {
        mview none = {0};
        put_head(&b, "kvtier_steps_total", "counter", "Forward passes of the scheduler.");
        put_val(&b, "kvtier_steps_total", &none, "", steps[0]);
        put_head(&b, "kvtier_step_requests_total", "counter", "Requests advanced by those passes, summed.");
        put_val(&b, "kvtier_step_requests_total", &none, "", steps[1]);
        put_head(&b, "kvtier_step_requests_max", "gauge", "The most requests one pass advanced.");
        put_val(&b, "kvtier_step_requests_max", &none, "", steps[2]);
        put_head(&b, "kvtier_steps_waited_on_store_total", "counter",
                 "Scheduler rounds that waited on the disk store (a save or load run on the scheduler; 0 by design).");
        put_val(&b, "kvtier_steps_waited_on_store_total", &none, "", steps[3]);
    }
    /* the remote tier's figures mix every key's lookups: the operator's view, or the one key's */
    if (sv->remote && (tnt < 0 || sv->n_tn == 1)) remote_metrics(sv->remote, &b);
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

