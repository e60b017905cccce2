/* Byte buffers for serialisation: a growing writer and a bounds-checked
 * reader. Every read states how many bytes it needs and fails (without
 * reading) when fewer remain, so parsers built on it cannot over-read. */
#ifndef KVT_BUF_H
#define KVT_BUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_wbuf {
    uint8_t *p;
    size_t len, cap;
    bool oom;          /* sticky: an append failed */
} kvt_wbuf;

void kvt_wbuf_put(kvt_wbuf *b, const void *data, size_t n);
/* Append the bytes of a NUL-terminated string (without the NUL). */
void kvt_wbuf_puts(kvt_wbuf *b, const char *s);
void kvt_wbuf_u32(kvt_wbuf *b, uint32_t v);
void kvt_wbuf_u64(kvt_wbuf *b, uint64_t v);
void kvt_wbuf_free(kvt_wbuf *b);

typedef struct kvt_rbuf {
    const uint8_t *p;
    size_t len, off;
} kvt_rbuf;

/* Copy n bytes out (false, nothing consumed, when fewer remain). */
bool kvt_rbuf_get(kvt_rbuf *r, void *out, size_t n);
bool kvt_rbuf_u32(kvt_rbuf *r, uint32_t *v);
bool kvt_rbuf_u64(kvt_rbuf *r, uint64_t *v);
/* Borrow n bytes in place (NULL when fewer remain). */
const uint8_t *kvt_rbuf_take(kvt_rbuf *r, size_t n);
static inline size_t kvt_rbuf_left(const kvt_rbuf *r) { return r->len - r->off; }

#endif
