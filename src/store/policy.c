/* The save policy shared by the server and the CLI (policy.h): which
 * prefixes of a session become disk snapshots, and why. */
#include "arch/model.h"
#include "session/snapshot.h"
#include "store/policy.h"
#include "store/store.h"
#include "base/util.h"

#include <stdio.h>

static uint32_t gcd(uint32_t a, uint32_t b)
{
    while (b) { uint32_t t = a % b; a = b; b = t; }
    return a;
}

/* The checkpoint grid when there are no continued saves: a divergence
 * inside a prompt costs a stateful session (ds4, gemma3) at most this much
 * prefill, and each checkpoint holds its state (22 MiB on Gemma 3 1B). */
#define GRID 2048

uint32_t kvt_save_policy_grid(const kvt_save_policy *p) { return gcd(GRID, p->continued_interval); }

size_t kvt_save_policy_cold(const kvt_save_policy *p, size_t n)
{
    if (!p->align_tokens || n <= p->trim_tokens) return 0;
    return (n - p->trim_tokens) / p->align_tokens * p->align_tokens;
}

void kvt_save_policy_mark(const kvt_save_policy *p, kvt_session *s, size_t n)
{
    kvt_session_set_save_mark(s, kvt_save_policy_cold(p, n));
}

/* Save s at `at` tokens to st, or (st NULL) only count the save point.
 * busy (NULL: none): a save that failed on another process's lock is not
 * reported but sets *busy, for the caller to try again. */
static int save_one(kvt_store *st, kvt_session *s, size_t at, const char *why, size_t *saved, bool *busy)
{
    if (!kvt_snap_can_save(s, at)) return KVT_OK;
    if (!st) { (*saved)++; return KVT_OK; }
    bool created = false;
    kvt_store_busy_seen(true);
    int rc = kvt_store_save_new(st, s, at, why, NULL, &created);
    if (rc == KVT_ENOMEM) return rc;
    if (rc && busy && kvt_store_busy_seen(true)) {
        *busy = true;
    } else if (rc) { /* at most a line a minute: a full disk fails every save */
        char what[64];
        snprintf(what, sizeof what, "%s save at %zu tokens", why, at);
        kvt_store_report_save_failure(st, what);
    }
    else if (saved && created) (*saved)++;
    return KVT_OK;
}

/* The highest point at or below `at` that s can save (its length or a
 * checkpoint) and that is on the alignment or on the checkpoint grid, 0 if
 * none: a look at the few checkpoints the session holds (the grid's and up
 * to three off it), not a walk down the positions, which with alignment 1
 * would be one per token. */
static size_t saveable_below(const kvt_save_policy *p, const kvt_session *s, size_t at)
{
    if (kvt_snap_can_save(s, at)) return at;
    size_t grid = kvt_save_policy_grid(p), best = 0;
    if (s->n < at && (s->n % p->align_tokens == 0 || s->n % grid == 0)) best = s->n;
    for (size_t i = 0; i < s->n_ckpt; i++) {
        size_t q = s->ckpt[i].pos;
        if (q <= at && q > best && (q % p->align_tokens == 0 || q % grid == 0)) best = q;
    }
    return best;
}

/* Save points go in increasing length, so each save can drop the state of
 * the shorter continued snapshots it extends (save.c). st NULL: count the
 * points in *saved, save nothing. */
static int walk(kvt_store *st, kvt_session *s, const kvt_save_policy *p, size_t n, size_t from_disk, size_t fork_at,
                size_t *saved, bool *busy)
{
    size_t cold[2] = {0, 0}; /* the policy's cold point and the caller's fork point, ascending */
    /* The caller marked the cold point, so its prefill left a checkpoint
     * there; a prompt that the session held in part already (a RAM hit)
     * may have passed it before it was marked: then the highest point below
     * it on the alignment that has one (the grid's, at worst). */
    cold[0] = kvt_save_policy_cold(p, n);
    if (cold[0]) cold[0] = saveable_below(p, s, cold[0]);
    if (cold[0] < p->min_tokens || cold[0] <= from_disk) cold[0] = 0;
    if (fork_at >= p->min_tokens && fork_at > from_disk && fork_at <= n && fork_at != cold[0]) cold[1] = fork_at;
    if (cold[0] > cold[1]) { size_t t = cold[0]; cold[0] = cold[1]; cold[1] = t; }
    size_t next = p->continued_interval ? (from_disk / p->continued_interval + 1) * (size_t)p->continued_interval : 0;
    size_t c = 0;
    int rc;
    for (;;) {
        size_t g = next && next <= s->n ? next : SIZE_MAX;
        while (c < 2 && (!cold[c] || cold[c] <= g)) {
            if (cold[c] && (rc = save_one(st, s, cold[c], "cold", saved, busy))) return rc;
            c++;
        }
        if (g == SIZE_MAX) return KVT_OK;
        if (g != cold[0] && g != cold[1] && g >= p->min_tokens && (rc = save_one(st, s, g, "continued", saved, busy)))
            return rc;
        next += p->continued_interval;
    }
}

int kvt_store_apply_policy(kvt_store *st, kvt_session *s, const kvt_save_policy *p, size_t n,
                           size_t from_disk, size_t fork_at, size_t *saved)
{
    return kvt_store_apply_policy_busy(st, s, p, n, from_disk, fork_at, saved, NULL);
}

int kvt_store_apply_policy_busy(kvt_store *st, kvt_session *s, const kvt_save_policy *p, size_t n,
                                size_t from_disk, size_t fork_at, size_t *saved, bool *busy)
{
    if (saved) *saved = 0;
    if (busy) *busy = false;
    if (!st) return KVT_OK;
    return walk(st, s, p, n, from_disk, fork_at, saved, busy);
}

size_t kvt_save_policy_points(const kvt_save_policy *p, const kvt_session *s, size_t n, size_t from_disk,
                              size_t fork_at)
{
    size_t points = 0;
    walk(NULL, (kvt_session *)s, p, n, from_disk, fork_at, &points, NULL);
    return points;
}
