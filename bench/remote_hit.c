/* A remote hit's own time and CPU, by hand, not in CI (bench/SERVE.md,
 * "Remote tier: one check per block"):
 *
 *   remote_hit MODEL URL TOKENS save      prefill TOKENS synthetic ids (seed
 *                                         7, 2 threads) and upload them (to a
 *                                         Redis without them: FLUSHALL first)
 *   remote_hit MODEL URL TOKENS hit RUNS  restore them RUNS times, each into
 *                                         a new session (2 threads)
 *
 * A hit prints one line: its wall time (kvt_remote_restore, lookup and
 * load), the process's CPU time over it (CLOCK_PROCESS_CPUTIME_ID: every
 * thread's), the bytes read, and an XXH3 of the restored rows' canonical
 * bytes, the same for every build that restores the entry bit for bit. A
 * save prints the upload's time, the process's peak resident set over it
 * (VmHWM, reset after the prefill through /proc/self/clear_refs) and its
 * resident set before and after (VmRSS), in kB.
 * With REMOTE_HIT_SECRET=FILE in the environment the tier has that secret
 * (--kv-remote-secret-file: each value's HMAC written and checked).
 * Built against a build's library, so two builds read the same entry:
 *
 *   cc -O2 -Iinclude -Isrc $(pkg-config --cflags hiredis) bench/remote_hit.c \
 *      build/libkvtier.a $(sed -n 's/^PKG_LIBS := //p' build/config.mk) -lpthread -lm
 */
#include "kvtier.h"
#include "store/remote.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

/* A field of /proc/self/status in kB (VmRSS, VmHWM); -1 unread. */
static long status_kb(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    size_t n = strlen(field);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, field, n) && line[n] == ':') v = strtol(line + n + 1, NULL, 10);
    if (f) fclose(f);
    return v;
}

static double secs(clockid_t c)
{
    struct timespec ts;
    clock_gettime(c, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc < 5 || (strcmp(argv[4], "save") && strcmp(argv[4], "hit"))) {
        fprintf(stderr, "usage: remote_hit MODEL URL TOKENS save | hit RUNS\n");
        return 2;
    }
    size_t n = strtoull(argv[3], NULL, 10);
    int runs = argc > 5 ? atoi(argv[5]) : 1;
    kvt_model *m = NULL;
    if (kvt_model_open(&m, argv[1])) { fprintf(stderr, "%s: %s\n", argv[1], kvt_errmsg()); return 1; }
    kvt_model_info mi;
    kvt_model_info_get(m, &mi);
    int32_t *t = malloc(n * sizeof *t);
    uint64_t x = 7;
    for (size_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        t[i] = (int32_t)(3 + (x >> 33) % (mi.n_vocab - 3));
    }
    kvt_remote_opts o = {.url = argv[2], .secret_file = getenv("REMOTE_HIT_SECRET"), .lookup_ms = 5000,
                         .load_ms = 60000, .quiet = true};
    kvt_remote *r = NULL;
    if (kvt_remote_open(&r, m, &o)) { fprintf(stderr, "%s: %s\n", argv[2], kvt_errmsg()); return 1; }
    kvt_session_opts so = {.n_ctx = (uint32_t)n + 16, .n_threads = 2};
    int rc = 0;
    if (!strcmp(argv[4], "save")) {
        kvt_session *s = NULL;
        if (kvt_session_new(&s, m, &so) || kvt_session_sync(s, t, n, NULL)) {
            fprintf(stderr, "prefill: %s\n", kvt_errmsg());
            rc = 1;
        } else {
            FILE *cr = fopen("/proc/self/clear_refs", "w"); /* the peak from here on */
            if (cr) { fputs("5", cr); fclose(cr); }
            long rss0 = status_kb("VmRSS");
            double w0 = secs(CLOCK_MONOTONIC);
            kvt_remote_upload(r, 0, s, n);
            if (!kvt_remote_drain(r, 600)) rc = 1;
            double wall = secs(CLOCK_MONOTONIC) - w0;
            kvt_remote_stats st;
            kvt_remote_stats_get(r, &st);
            printf("saved %zu tokens: %llu B uploaded in %.3f s; resident %ld kB before, peak %ld kB, %ld kB after\n",
                   n, (unsigned long long)st.bytes_written, wall, rss0, status_kb("VmHWM"), status_kb("VmRSS"));
        }
        kvt_session_free(s);
    }
    for (int i = 0; !strcmp(argv[4], "hit") && i < runs; i++) {
        kvt_session *s = NULL;
        if (kvt_session_new(&s, m, &so)) { rc = 1; break; }
        kvt_remote_stats st0, st1;
        kvt_remote_stats_get(r, &st0);
        size_t got = 0;
        double w0 = secs(CLOCK_MONOTONIC), c0 = secs(CLOCK_PROCESS_CPUTIME_ID);
        kvt_remote_restore(r, 0, s, t, n, 0, &got);
        double wall = secs(CLOCK_MONOTONIC) - w0, cpu = secs(CLOCK_PROCESS_CPUTIME_ID) - c0;
        kvt_remote_stats_get(r, &st1);
        uint8_t *bytes = NULL;
        size_t len = 0;
        uint64_t h = kvt_session_cache_bytes(s, &bytes, &len) ? 0 : XXH3_64bits(bytes, len);
        free(bytes);
        printf("hit %d: %zu tokens, wall %.3f s, cpu %.3f s, %llu B read, rows %016llx\n", i + 1, got, wall, cpu,
               (unsigned long long)(st1.bytes_read - st0.bytes_read), (unsigned long long)h);
        if (got != n) rc = 1;
        kvt_session_free(s);
    }
    kvt_remote_close(r);
    free(t);
    kvt_model_close(m);
    return rc;
}
