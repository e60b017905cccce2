/* Error strings, the per-thread failure detail, checked allocation and the
 * half-precision conversions used by GGUF tensors and the ds4 cache rows. */
#include "base/util.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

static _Thread_local char errbuf[512];

const char *kvt_strerror(int err)
{
    switch (err) {
    case KVT_OK: return "ok";
    case KVT_EINVAL: return "invalid argument";
    case KVT_ENOMEM: return "out of memory";
    case KVT_EIO: return "i/o error";
    case KVT_EFORMAT: return "malformed file";
    case KVT_ECORRUPT: return "checksum mismatch";
    case KVT_EMISMATCH: return "does not match";
    case KVT_ECTX: return "context overflow";
    case KVT_EUNSUPPORTED: return "unsupported";
    case KVT_ENOENT: return "not found";
    case KVT_ECANCELED: return "canceled";
    }
    return "unknown error";
}

const char *kvt_errmsg(void) { return errbuf; }

int kvt_fail(int err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errbuf, sizeof errbuf, fmt, ap);
    va_end(ap);
    return err;
}

void *kvt_malloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) kvt_fail(KVT_ENOMEM, "out of memory allocating %zu bytes", n);
    return p;
}

void *kvt_calloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) kvt_fail(KVT_ENOMEM, "out of memory allocating %zu x %zu bytes", n, size);
    return p;
}

void *kvt_grow(void *p, size_t *cap, size_t need, size_t elem, int *rc)
{
    *rc = KVT_OK;
    if (need <= *cap) return p;
    size_t nc = *cap ? *cap : 16, bytes;
    while (nc < need) nc *= 2;
    if (!kvt_mul_ok(nc, elem, &bytes)) { *rc = kvt_fail(KVT_ENOMEM, "array of %zu items is too large", nc); return p; }
    void *q = realloc(p, bytes);
    if (!q) {
        *rc = kvt_fail(KVT_ENOMEM, "out of memory growing an array to %zu bytes", bytes);
        return p;
    }
    *cap = nc;
    return q;
}

char *kvt_strndup(const char *s, size_t n)
{
    char *p = kvt_malloc(n + 1);
    if (p) { memcpy(p, s, n); p[n] = 0; }
    return p;
}

float kvt_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal: renormalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | man << 13 | (man ? 0x400000u : 0); /* NaNs quiet, as F16C */
    else bits = sign | (exp + 112) << 23 | man << 13;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t kvt_f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds to inf */
    if (ax < 0x38800000u) { /* subnormal or zero in f16 */
        if (ax < 0x33000000u) return (uint16_t)sign;
        uint32_t e = ax >> 23, m = (ax & 0x7fffff) | 0x800000;
        uint32_t shift = 126 - e; /* 14..24 */
        uint32_t v = m >> (shift - 0) >> 0;
        /* value = m * 2^(e-150); f16 subnormal unit = 2^-24 -> v = m >> (126 - e) */
        uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (v & 1))) v++;
        return (uint16_t)(sign | v);
    }
    uint32_t v = ((ax - 0x38000000u) >> 13);
    uint32_t rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (v & 1))) v++;
    return (uint16_t)(sign | v);
}

float kvt_bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t kvt_f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

double kvt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

bool kvt_proc_kib(const char *path, const char *field, uint64_t *kib)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char line[256];
    size_t n = strlen(field);
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        unsigned long long v;
        char unit[4];
        if (strncmp(line, field, n) || line[n] != ':') continue;
        if (sscanf(line + n + 1, " %llu %3s", &v, unit) == 2 && !strcmp(unit, "kB")) {
            *kib = v;
            found = true;
        }
    }
    fclose(f);
    return found;
}

int kvt_fill_random(uint8_t *p, size_t n)
{
    while (n) {
        ssize_t got = getrandom(p, n, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return kvt_fail(KVT_EIO, "getrandom: %s", strerror(errno));
        p += (size_t)got;
        n -= (size_t)got;
    }
    return KVT_OK;
}
