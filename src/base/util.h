/* Small shared helpers: error reporting with a detail message, checked
 * allocation sizes, little-endian access. Everything here is file-format and
 * architecture neutral. */
#ifndef KVT_UTIL_H
#define KVT_UTIL_H

#include "kvtier.h"
#include <stdint.h>
#include <string.h>

/* Record a detail message for the calling thread and return err. */
int kvt_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* a*b (and a*b*c) without overflow; false when it would overflow. */
static inline bool kvt_mul_ok(size_t a, size_t b, size_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}

/* malloc/calloc that record KVT_ENOMEM detail; return NULL on failure. */
void *kvt_malloc(size_t n);
void *kvt_calloc(size_t n, size_t size);
char *kvt_strndup(const char *s, size_t n);
/* Grow p, an array of elem-sized items with capacity *cap, to hold at least
 * need items (doubling, from 16); returns the array, or p itself with *rc
 * set to KVT_ENOMEM when it cannot (p stays valid). Use KVT_GROW. */
void *kvt_grow(void *p, size_t *cap, size_t need, size_t elem, int *rc);
#define KVT_GROW(ptr, cap, need, rc) ((ptr) = kvt_grow((ptr), (cap), (need), sizeof *(ptr), &(rc)))

static inline uint16_t kvt_rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t kvt_rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t kvt_rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* IEEE binary16 / bfloat16 <-> f32, round to nearest even. */
float kvt_f16_to_f32(uint16_t h);
uint16_t kvt_f32_to_f16(float f);
float kvt_bf16_to_f32(uint16_t h);
uint16_t kvt_f32_to_bf16(float f);

/* Monotonic seconds. */
double kvt_now(void);

/* The "<field>: <n> kB" line of a /proc file (/proc/meminfo's MemAvailable,
 * /proc/self/status's VmHWM), in KiB into *kib: false when the file or the
 * field is absent, or its figure does not parse. */
bool kvt_proc_kib(const char *path, const char *field, uint64_t *kib);

/* n random bytes from the kernel (getrandom); KVT_EIO when it cannot give them. */
int kvt_fill_random(uint8_t *p, size_t n);

#endif
