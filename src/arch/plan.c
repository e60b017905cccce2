/* A KV cache plan (kvt_plan, kvtier.h): the parts an architecture's cache
 * has, by name, and their sums. The architectures fill it (their plan
 * rows); the command line, the bench and the server read it. */
#include "kvtier.h"
#include "base/util.h"

#include <string.h>

static kvt_plan_part *find(const kvt_plan *p, const char *name)
{
    for (size_t i = 0; i < p->n_parts && i < KVT_PLAN_MAX_PARTS; i++)
        if (!strcmp(p->part[i].name, name)) return (kvt_plan_part *)&p->part[i];
    return NULL;
}

uint64_t kvt_plan_bytes(const kvt_plan *p, const char *name)
{
    const kvt_plan_part *q = find(p, name);
    return q ? q->bytes : 0;
}

int kvt_plan_add(kvt_plan *p, const char *name, uint64_t bytes, bool fixed)
{
    kvt_plan_part *q = find(p, name);
    if (!q) {
        if (p->n_parts >= KVT_PLAN_MAX_PARTS) return kvt_fail(KVT_EINVAL, "plan: more than %d parts", KVT_PLAN_MAX_PARTS);
        q = &p->part[p->n_parts++];
        *q = (kvt_plan_part){name, 0, fixed};
    }
    q->bytes += bytes;
    p->total += bytes;
    if (q->fixed) p->fixed += bytes;
    return KVT_OK;
}
