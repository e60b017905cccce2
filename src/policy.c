/* The save policy shared by the server and the CLI (see kvtier.h): which
 * prefixes of a session become disk snapshots, and why. */
#include "model.h"
#include "snapshot.h"
#include "store.h"
#include "util.h"

#include <stdio.h>

static uint32_t gcd(uint32_t a, uint32_t b)
{
    while (b) { uint32_t t = a % b; a = b; b = t; }
    return a;
}

uint32_t kvt_save_policy_grid(const kvt_save_policy *p)
{
    uint32_t g = gcd(p->align_tokens, p->continued_interval);
    return g ? g : 2048;
}

static int save_one(kvt_store *st, kvt_session *s, size_t at, const char *why, size_t *saved)
{
    if (!kvt_snap_can_save(s, at)) return KVT_OK;
    bool created = false;
    int rc = kvt_store_save_new(st, s, at, why, NULL, &created);
    if (rc == KVT_ENOMEM) return rc;
    if (rc) fprintf(stderr, "kvtier: cache: %s save at %zu tokens failed: %s\n", why, at, kvt_errmsg());
    else if (saved && created) (*saved)++;
    return KVT_OK;
}

int kvt_store_apply_policy(kvt_store *st, kvt_session *s, const kvt_save_policy *p, size_t n,
                           size_t from_disk, size_t fork_at, size_t *saved)
{
    if (saved) *saved = 0;
    if (!st) return KVT_OK;
    size_t cold = 0;
    if (p->align_tokens && n > p->trim_tokens) {
        cold = (n - p->trim_tokens) / p->align_tokens * p->align_tokens;
        if (cold < p->min_tokens || cold <= from_disk) cold = 0;
    }
    int rc;
    if (cold && (rc = save_one(st, s, cold, "cold", saved))) return rc;
    if (fork_at >= p->min_tokens && fork_at > from_disk && fork_at != cold && fork_at <= n &&
        (rc = save_one(st, s, fork_at, "cold", saved)))
        return rc;
    if (p->continued_interval)
        for (size_t g = (from_disk / p->continued_interval + 1) * (size_t)p->continued_interval; g <= s->n;
             g += p->continued_interval)
            if (g != cold && g >= p->min_tokens && (rc = save_one(st, s, g, "continued", saved))) return rc;
    return KVT_OK;
}
