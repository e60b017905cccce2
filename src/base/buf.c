/* Growing write buffer and bounds-checked read buffer (see buf.h).
 * Integers are little-endian on every host. */
#include "base/buf.h"

#include <stdlib.h>
#include <string.h>

void kvt_wbuf_put(kvt_wbuf *b, const void *data, size_t n)
{
    if (b->oom || n == 0) return;
    if (n > SIZE_MAX - b->len) { b->oom = true; return; }
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap = cap > SIZE_MAX / 2 ? b->len + n : cap * 2;
        uint8_t *p = realloc(b->p, cap);
        if (!p) { b->oom = true; return; }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
}

void kvt_wbuf_puts(kvt_wbuf *b, const char *s) { kvt_wbuf_put(b, s, strlen(s)); }

void kvt_wbuf_u32(kvt_wbuf *b, uint32_t v)
{
    uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    kvt_wbuf_put(b, x, 4);
}

void kvt_wbuf_u64(kvt_wbuf *b, uint64_t v)
{
    kvt_wbuf_u32(b, (uint32_t)v);
    kvt_wbuf_u32(b, (uint32_t)(v >> 32));
}

void kvt_wbuf_free(kvt_wbuf *b)
{
    free(b->p);
    *b = (kvt_wbuf){0};
}

bool kvt_rbuf_get(kvt_rbuf *r, void *out, size_t n)
{
    const uint8_t *p = kvt_rbuf_take(r, n);
    if (!p) return false;
    memcpy(out, p, n);
    return true;
}

const uint8_t *kvt_rbuf_take(kvt_rbuf *r, size_t n)
{
    if (n > r->len - r->off) return NULL;
    const uint8_t *p = r->p + r->off;
    r->off += n;
    return p;
}

bool kvt_rbuf_u32(kvt_rbuf *r, uint32_t *v)
{
    const uint8_t *p = kvt_rbuf_take(r, 4);
    if (!p) return false;
    *v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    return true;
}

bool kvt_rbuf_u64(kvt_rbuf *r, uint64_t *v)
{
    uint32_t lo, hi;
    if (!kvt_rbuf_u32(r, &lo)) return false;
    if (!kvt_rbuf_u32(r, &hi)) { r->off -= 4; return false; }
    *v = (uint64_t)hi << 32 | lo;
    return true;
}
