/* The HTTP listener under idle, slow and greedy clients: `kvtier serve`
 * (KVT_BIN) over loopback, driven by raw sockets. Client sockets bind to
 * other loopback addresses (127.0.0.2 and up) where a test needs them to
 * count apart from the checks' own requests from 127.0.0.1.
 *
 *   server_idle_load   2,000 idle connections and 20 clients trickling
 *                      their headers a byte a second: /health and a short
 *                      completion still answer within 1 s each
 *   server_timeout     ds4-mini, --request-timeout 3: idle connections,
 *                      trickled headers, a body that stops, an idle
 *                      keep-alive connection are closed after 3 s (not
 *                      before), while a streaming request whose prefill
 *                      runs longer is not cut
 *   server_limits      --max-conn-per-addr 10 --max-connections 20: the
 *                      11th connection from one address is refused, the
 *                      21st in all is answered 503 with Connection: close,
 *                      and /health answers again once some close
 *   server_body_413    Content-Length: 2147483648 with no body: 413 at once
 *   server_max_tokens  --max-tokens 8 is a cap: a request for 100 gets 8,
 *                      finish_reason "length" (stop_reason "max_tokens")
 *   server_stream_bound  three streaming clients that never read: each
 *                      stream ends before its end (the server stops
 *                      buffering at 1 MiB unsent), the server's RSS grows
 *                      by less than 12 MiB (about 25 to 40 MiB without the
 *                      bound; not checked in the sanitizer build, whose
 *                      allocator keeps freed memory)
 *   server_stream_stall  --request-timeout 2: a stream whose client has
 *                      taken nothing for 2 s is cut under the 1 MiB bound,
 *                      one whose client reads 64 KB/s is not
 *   server_hangup_quiet  200 clients hanging up mid-headers leave no
 *                      line each in the server log
 *   server_stop_drain  SIGTERM with a finished stream unread and a running
 *                      one: requests queued behind get 503, both streams
 *                      reach their end once their clients read, exit 0
 *   server_active_after_answer  a request has left kvtier_active_requests
 *                      when its answer arrives (another in a long prefill)
 *   server_no_store_no_fingerprint  ds4-tiny written to a file, --no-kv-disk:
 *                      a 200-token prompt served twice (the second a RAM
 *                      hit) leaves no entry in the fingerprint cache
 *                      ($XDG_CACHE_HOME/kvtier/fingerprints): the server
 *                      never hashed every weight; with
 *                      KVT_FAULT_PROCESS_SEED_FINGERPRINTED=1 in its
 *                      environment (the RAM index keyed by the records'
 *                      chain, as before) it leaves one, and the test says so
 *
 * The whole file takes 20 to 30 s on 2 cores (about 80 s in the sanitizer
 * build, with a shorter prompt for the long prefill). server_idle_load
 * needs a descriptor limit (hard) of at least 2,220; skipped with the
 * reason otherwise. */
#include "fixture.h"
#include "test.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define N_IDLE 2000
#define N_TRICKLE 20

/* ---- sockets ---- */

/* A connection from source address src (NULL: any) to 127.0.0.1:port,
 * rcvbuf > 0: that receive buffer; -1 on failure (printed). */
static int tcp_open(const char *src, int port, int rcvbuf)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) { printf("    socket: %s\n", strerror(errno)); return -1; }
    if (rcvbuf > 0) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    if (src) {
        struct sockaddr_in a = {.sin_family = AF_INET};
        inet_pton(AF_INET, src, &a.sin_addr);
        if (bind(fd, (struct sockaddr *)&a, sizeof a)) {
            printf("    bind %s: %s\n", src, strerror(errno));
            close(fd);
            return -1;
        }
    }
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
    if (connect(fd, (struct sockaddr *)&to, sizeof to)) {
        printf("    connect from %s: %s\n", src ? src : "any", strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

static bool send_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0) return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

/* Read into out (cap bytes, NUL-terminated) until the peer closes or
 * timeout seconds pass; the bytes read, -1 when the connection was reset
 * before any byte came. */
static long read_until_close(int fd, char *out, size_t cap, double timeout)
{
    size_t got = 0;
    double t0 = fx_now();
    out[0] = 0;
    while (fx_now() - t0 < timeout) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int ms = (int)((timeout - (fx_now() - t0)) * 1000) + 1;
        if (poll(&p, 1, ms) <= 0) continue;
        char tmp[65536];
        ssize_t r = recv(fd, tmp, sizeof tmp, 0);
        if (r < 0) return got ? (long)got : -1;
        if (r == 0) break;
        size_t keep = (size_t)r < cap - 1 - got ? (size_t)r : cap - 1 - got;
        memcpy(out + got, tmp, keep);
        got += keep;
        out[got] = 0;
    }
    return (long)got;
}

/* One request from src on a fresh connection (the request should say
 * Connection: close), its answer in out; the seconds it took in *secs. */
static long exchange(const char *src, int port, const char *req, char *out, size_t cap, double timeout, double *secs)
{
    double t0 = fx_now();
    int fd = tcp_open(src, port, 0);
    long n = -1;
    if (fd >= 0 && send_all(fd, req, strlen(req))) n = read_until_close(fd, out, cap, timeout);
    if (fd >= 0) close(fd);
    if (secs) *secs = fx_now() - t0;
    return n;
}

/* The socket was closed by the server: EOF or reset (nothing else comes
 * on the connections it is asked of). */
static bool is_closed(int fd)
{
    struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    char b[4096];
    ssize_t r = recv(fd, b, sizeof b, MSG_DONTWAIT);
    return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

/* The soft descriptor limit raised to want (at most the hard one); false
 * when the hard one is lower. */
static bool raise_nofile(rlim_t want)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) || rl.rlim_max < want) return false;
    if (rl.rlim_cur < want) {
        rl.rlim_cur = want;
        if (setrlimit(RLIMIT_NOFILE, &rl)) return false;
    }
    return true;
}

static void close_all(int *fds, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (fds[i] >= 0) close(fds[i]);
}

/* The server's resident memory in KiB (VmRSS), -1 when unknown. */
static long rss_kib(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long kib = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6)) kib = strtol(line + 6, NULL, 10);
    if (f) fclose(f);
    return kib;
}

#define HEALTH "GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"

/* The value of a line of /metrics that begins with name and a space; -1
 * when it cannot be read. */
static long metric(int port, const char *name)
{
    char out[65536], key[160];
    const char *req = "GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n";
    if (exchange("127.0.0.1", port, req, out, sizeof out, 5, NULL) <= 0) return -1;
    snprintf(key, sizeof key, "\n%s ", name);
    const char *p = strstr(out, key);
    return p ? strtol(p + strlen(key), NULL, 10) : -1;
}

/* POST path with a JSON body, Connection: close (a static buffer). */
static const char *post(const char *path, const char *json)
{
    static char req[16384];
    snprintf(req, sizeof req,
             "POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
             "Connection: close\r\n\r\n%s",
             path, strlen(json), json);
    return req;
}

/* ---- the test's world ---- */

typedef struct world {
    fx_server s;
    int idle[N_IDLE];
    int trickle[N_TRICKLE];
    size_t n_idle, n_trickle;
} world;

static bool begin(world *w, const char *name)
{
    memset(w, 0, sizeof *w);
    for (size_t i = 0; i < N_IDLE; i++) w->idle[i] = -1;
    for (size_t i = 0; i < N_TRICKLE; i++) w->trickle[i] = -1;
    if (!fx_tmpdir_make(&w->s, name)) {
        kvt_test_fail(__FILE__, __LINE__, "mkdtemp: %s", strerror(errno));
        return false;
    }
    return true;
}

static void end(world *w)
{
    close_all(w->idle, w->n_idle);
    close_all(w->trickle, w->n_trickle);
    fx_server_kill(&w->s);
    fx_tmpdir_remove(&w->s);
}

#define START(w, ...)                                                       \
    do {                                                                    \
        const char *const a_[] = {__VA_ARGS__, NULL};                       \
        CHECKF(fx_server_start(&(w)->s, a_), "kvtier serve did not come up"); \
    } while (0)

#define STOP(w)                                                             \
    CHECKF(fx_server_stop(&(w)->s), "kvtier serve did not exit 0 within %.0f s of SIGTERM", FX_STOP_TIMEOUT)

/* n idle connections spread over ten source addresses 127.0.0.base.. so
 * that none holds more than 200 (under the default per-address limit). */
static bool open_idle(world *w, size_t n, int base)
{
    for (size_t i = 0; i < n; i++) {
        char src[32];
        snprintf(src, sizeof src, "127.0.0.%d", base + (int)(i % 10));
        if ((w->idle[w->n_idle] = tcp_open(src, w->s.port, 0)) < 0) return false;
        w->n_idle++;
    }
    return true;
}

/* Clients that send their request's headers a byte at a time, from
 * 127.0.0.src. */
static const char trickled[] = "GET /health HTTP/1.1\r\nHost: trickle\r\nX-Padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
static size_t trickle_pos;

static bool open_trickle(world *w, const char *src)
{
    for (size_t i = 0; i < N_TRICKLE; i++) {
        if ((w->trickle[i] = tcp_open(src, w->s.port, 0)) < 0) return false;
        w->n_trickle++;
    }
    trickle_pos = 0;
    return true;
}

/* The next byte of every trickling client (those still open). */
static void trickle_step(world *w)
{
    if (trickle_pos >= sizeof trickled - 2) return; /* never the last byte */
    for (size_t i = 0; i < w->n_trickle; i++)
        if (w->trickle[i] >= 0) send(w->trickle[i], trickled + trickle_pos, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    trickle_pos++;
}

/* ---- the tests ---- */

static void idle_load(world *w)
{
    START(w, "--model", "ds4-tiny", "--no-kv-disk");
    CHECKF(open_idle(w, N_IDLE, 10), "opening %d idle connections", N_IDLE);
    CHECKF(open_trickle(w, "127.0.0.20"), "opening the trickling clients");
    char out[65536];
    for (int round = 0; round < 3; round++) {
        trickle_step(w);
        double secs;
        long n = exchange("127.0.0.1", w->s.port, HEALTH, out, sizeof out, 5, &secs);
        CHECKF(n > 0 && strstr(out, " 200 ") && secs < 1.0,
               "/health with %d idle and %d trickling connections: %ld bytes in %.3f s: %.200s", N_IDLE, N_TRICKLE,
               n, secs, n > 0 ? out : "(reset or nothing)");
        printf("    /health with %d idle + %d trickling connections: %.3f s\n", N_IDLE, N_TRICKLE, secs);
        /* greedy: at the default temperature of 1 the reply may sample its
         * end before 4 tokens, which says nothing of the connections */
        n = exchange("127.0.0.1", w->s.port,
                     post("/v1/completions", "{\"prompt\":\"hello\",\"max_tokens\":4,\"temperature\":0}"), out,
                     sizeof out, 5, &secs);
        CHECKF(n > 0 && strstr(out, " 200 ") && strstr(out, "\"completion_tokens\":") && secs < 1.0,
               "a 4-token completion: %ld bytes in %.3f s: %.300s", n, secs, n > 0 ? out : "(reset or nothing)");
        printf("    4-token completion: %.3f s\n", secs);
        fx_sleep_ms(1000 - (int)(secs * 1000) > 0 ? 1000 - (int)(secs * 1000) : 0);
    }
    size_t open_now = 0;
    for (size_t i = 0; i < w->n_idle; i++) open_now += !is_closed(w->idle[i]);
    CHECKF(open_now == w->n_idle, "%zu of %zu idle connections were closed within the default 30 s timeout",
           w->n_idle - open_now, w->n_idle);
    close_all(w->idle, w->n_idle);
    close_all(w->trickle, w->n_trickle);
    w->n_idle = w->n_trickle = 0;
    STOP(w);
}

TEST(server_idle_load)
{
    if (!raise_nofile(N_IDLE + N_TRICKLE + 200)) SKIP_ENV("the descriptor limit (ulimit -Hn) is under %d", N_IDLE + 220);
    world w;
    if (!begin(&w, "kvtier-listen")) return;
    idle_load(&w);
    end(&w);
}

/* The sanitizer build (`make asan`) runs about ten times slower. */
static bool slow_build(void) { return strstr(kvt_test_bin(), "asan") != NULL; }

/* ds4-mini: a 10,000-token prompt's prefill takes seconds (2,500 tokens in
 * the sanitizer build). */
static const char *long_prompt_stream(void)
{
    static char body[12000];
    size_t n = (size_t)snprintf(body, sizeof body, "{\"prompt\":\"");
    for (int i = 0; i < (slow_build() ? 2500 : 10000); i++) body[n++] = "abcdefghijklmnopqrstuvwxyz 0123456789"[i * 7 % 37];
    snprintf(body + n, sizeof body - n, "\",\"max_tokens\":2,\"stream\":true}");
    return post("/v1/completions", body);
}

#define TIMEOUT 3.0

static void timeout_cuts(world *w)
{
    START(w, "--model", "ds4-mini", "--no-kv-disk", "--request-timeout", "3");
    /* the stream first: its request completes at once, its prefill runs
     * longer than the timeout */
    int st = tcp_open("127.0.0.1", w->s.port, 0);
    CHECK(st >= 0);
    const char *sreq = long_prompt_stream();
    CHECK(send_all(st, sreq, strlen(sreq)));
    double t0 = fx_now();
    CHECKF(open_idle(w, 300, 30), "opening 300 idle connections");
    CHECKF(open_trickle(w, "127.0.0.40"), "opening the trickling clients");
    /* a body that stops halfway */
    int half = tcp_open("127.0.0.41", w->s.port, 0);
    CHECK(half >= 0);
    const char *hreq = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                       "Content-Length: 100\r\n\r\n{\"prompt\":";
    CHECK(send_all(half, hreq, strlen(hreq)));
    /* a keep-alive connection idle after one answer */
    int ka = tcp_open("127.0.0.42", w->s.port, 0);
    CHECK(ka >= 0);
    const char *kreq = "GET /health HTTP/1.1\r\nHost: t\r\n\r\n";
    CHECK(send_all(ka, kreq, strlen(kreq)));
    char out[65536];
    struct pollfd kp = {.fd = ka, .events = POLLIN};
    CHECKF(poll(&kp, 1, 2000) == 1 && recv(ka, out, sizeof out, 0) > 0 && strstr(out, " 200 "),
           "keep-alive /health: no answer");

    /* watch until every one is closed (at most TIMEOUT + 4 s) and the
     * stream ends (at most 60 s) */
    static char stream[1 << 20];
    size_t sgot = 0;
    bool sdone = false;
    double s_end = 0, first_close = 0, last_close = 0;
    size_t n_watch = w->n_idle + w->n_trickle + 2, closed = 0;
    bool *seen = calloc(n_watch, 1);
    CHECK(seen);
    double last_trickle = 0;
    while (fx_now() - t0 < (closed < n_watch ? TIMEOUT + 4 : 60) && (closed < n_watch || !sdone)) {
        double now = fx_now();
        if (now - last_trickle >= 1.0) { trickle_step(w); last_trickle = now; }
        if (!sdone) {
            struct pollfd p = {.fd = st, .events = POLLIN};
            if (poll(&p, 1, 20) == 1) {
                ssize_t r = recv(st, stream + sgot, sizeof stream - 1 - sgot, 0);
                if (r > 0) { sgot += (size_t)r; stream[sgot] = 0; }
                if (r <= 0 || strstr(stream, "[DONE]")) { sdone = true; s_end = fx_now() - t0; }
            }
        } else {
            fx_sleep_ms(20);
        }
        for (size_t i = 0; i < n_watch; i++) {
            if (seen[i]) continue;
            int fd = i < w->n_idle ? w->idle[i] : i < w->n_idle + w->n_trickle ? w->trickle[i - w->n_idle]
                   : i == n_watch - 2 ? half : ka;
            if (!is_closed(fd)) continue;
            seen[i] = true;
            closed++;
            double at = fx_now() - t0;
            if (!first_close) first_close = at;
            last_close = at;
        }
    }
    free(seen);
    close(half);
    close(ka);
    close(st);
    printf("    %zu of %zu slow connections closed, the first at %.2f s, the last at %.2f s (timeout %.0f s)\n",
           closed, n_watch, first_close, last_close, TIMEOUT);
    printf("    the streaming request: %zu bytes, ended at %.2f s\n", sgot, s_end);
    CHECKF(closed == n_watch, "%zu of %zu idle, trickling, half-sent and keep-alive connections still open %.0f s "
           "after the %.0f s timeout", n_watch - closed, n_watch, 4.0, TIMEOUT);
    CHECKF(first_close >= TIMEOUT - 0.2, "a connection was closed at %.2f s, before the %.0f s timeout", first_close,
           TIMEOUT);
    CHECKF(sdone && strstr(stream, " 200 ") && strstr(stream, "data: [DONE]"),
           "the streaming request was cut: %zu bytes: ...%.300s", sgot, sgot > 300 ? stream + sgot - 300 : stream);
    CHECKF(strstr(stream, ": prefill"), "no prefill progress comment in the stream");
    CHECKF(s_end > TIMEOUT, "the stream ended at %.2f s, within the %.0f s timeout: it proves nothing", s_end, TIMEOUT);
    STOP(w);
}

TEST(server_timeout)
{
    if (!raise_nofile(512)) SKIP_ENV("the descriptor limit (ulimit -Hn) is under 512");
    world w;
    if (!begin(&w, "kvtier-listen")) return;
    timeout_cuts(&w);
    end(&w);
}

static void limits(world *w)
{
    START(w, "--model", "ds4-tiny", "--no-kv-disk", "--max-conn-per-addr", "10", "--max-connections", "20");
    char out[8192];
    /* ten from 127.0.0.2 are served; the eleventh is closed unanswered */
    for (int i = 0; i < 10; i++) {
        CHECKF((w->idle[w->n_idle] = tcp_open("127.0.0.2", w->s.port, 0)) >= 0, "connection %d", i + 1);
        w->n_idle++;
    }
    long n;
    double t0 = fx_now();
    do {
        fx_sleep_ms(100);
        n = exchange("127.0.0.2", w->s.port, HEALTH, out, sizeof out, 3, NULL);
    } while (n > 0 && fx_now() - t0 < 3);
    CHECKF(n <= 0, "the 11th connection from 127.0.0.2 was served: %.200s", out);
    n = exchange("127.0.0.3", w->s.port, HEALTH, out, sizeof out, 3, NULL);
    CHECKF(n > 0 && strstr(out, " 200 "), "another address after 10 from 127.0.0.2: %.200s", n > 0 ? out : "reset");
    /* ten more from 127.0.0.3: 20 in all; the 21st is answered 503 */
    for (int i = 0; i < 10; i++) {
        CHECKF((w->idle[w->n_idle] = tcp_open("127.0.0.3", w->s.port, 0)) >= 0, "connection %d", i + 11);
        w->n_idle++;
    }
    /* the server takes the 20 in first (a pool thread may lag behind) */
    double secs;
    t0 = fx_now();
    do {
        fx_sleep_ms(100);
        n = exchange("127.0.0.4", w->s.port, HEALTH, out, sizeof out, 3, &secs);
    } while (n > 0 && strstr(out, " 200 ") && fx_now() - t0 < 3);
    CHECKF(n > 0 && strstr(out, " 503 ") && strcasestr(out, "connection: close") && secs < 1.0,
           "the 21st connection: %ld bytes in %.2f s: %.300s", n, secs, n > 0 ? out : "reset");
    printf("    the 21st connection: 503 in %.3f s\n", secs);
    /* room again once some close */
    for (int i = 0; i < 5; i++) close(w->idle[--w->n_idle]);
    fx_sleep_ms(300);
    n = exchange("127.0.0.4", w->s.port, HEALTH, out, sizeof out, 3, NULL);
    CHECKF(n > 0 && strstr(out, " 200 "), "/health after 5 closed: %.200s", n > 0 ? out : "reset");
    close_all(w->idle, w->n_idle);
    w->n_idle = 0;
    STOP(w);
}

TEST(server_limits)
{
    world w;
    if (!begin(&w, "kvtier-listen")) return;
    limits(&w);
    end(&w);
}

static void body_413(world *w)
{
    START(w, "--model", "ds4-tiny", "--no-kv-disk");
    char out[8192];
    double secs;
    const char *req = "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      "Content-Length: 2147483648\r\n\r\n";
    long n = exchange("127.0.0.1", w->s.port, req, out, sizeof out, 3, &secs);
    CHECKF(n > 0 && strstr(out, " 413 ") && strstr(out, "request_too_large") && secs < 1.0,
           "Content-Length 2147483648: %ld bytes in %.2f s: %.300s", n, secs, n > 0 ? out : "(nothing)");
    printf("    Content-Length 2147483648: 413 in %.3f s\n", secs);
    CHECKF(fx_health_ok(&w->s), "/health after the 413");
    STOP(w);
}

TEST(server_body_413)
{
    world w;
    if (!begin(&w, "kvtier-listen")) return;
    body_413(&w);
    end(&w);
}

static void max_tokens_cap(world *w)
{
    START(w, "--model", "ds4-tiny", "--no-kv-disk", "--max-tokens", "8");
    char out[65536];
    /* "a" at temperature 0 runs to the context in ds4-tiny */
    long n = exchange("127.0.0.1", w->s.port,
                      post("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],"
                                                   "\"max_tokens\":100,\"temperature\":0}"),
                      out, sizeof out, 10, NULL);
    CHECKF(n > 0 && strstr(out, "\"completion_tokens\":8,") && strstr(out, "\"finish_reason\":\"length\""),
           "chat, max_tokens 100 under --max-tokens 8: %.400s", n > 0 ? out : "(nothing)");
    n = exchange("127.0.0.1", w->s.port,
                 post("/v1/messages", "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],"
                                      "\"max_tokens\":100,\"temperature\":0}"),
                 out, sizeof out, 10, NULL);
    CHECKF(n > 0 && strstr(out, "\"output_tokens\":8") && strstr(out, "\"stop_reason\":\"max_tokens\""),
           "messages, max_tokens 100 under --max-tokens 8: %.400s", n > 0 ? out : "(nothing)");
    /* under the cap a request's own value holds */
    n = exchange("127.0.0.1", w->s.port,
                 post("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],"
                                              "\"max_tokens\":3,\"temperature\":0}"),
                 out, sizeof out, 10, NULL);
    CHECKF(n > 0 && strstr(out, "\"completion_tokens\":3,"), "chat, max_tokens 3: %.400s", n > 0 ? out : "(nothing)");
    STOP(w);
}

TEST(server_max_tokens)
{
    world w;
    if (!begin(&w, "kvtier-listen")) return;
    max_tokens_cap(&w);
    end(&w);
}

#define N_STALL 3

static void stream_bound(world *w)
{
    START(w, "--model", "ds4-tiny", "--no-kv-disk", "--max-tokens", "100000");
    /* "a" at temperature 0 runs to the context: about 7 MB of events with
     * 20 top logprobs each */
    const char *req = post("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],"
                                                   "\"max_tokens\":100000,\"temperature\":0,\"stream\":true,"
                                                   "\"logprobs\":true,\"top_logprobs\":20}");
    static char out[16 << 20];
    /* a reading client first: the full stream, and the slots' memory in
     * place before the baseline */
    long full = exchange("127.0.0.1", w->s.port, req, out, sizeof out, 30, NULL);
    CHECKF(full > (4 << 20) && strstr(out, "data: [DONE]"), "a reading client: %ld bytes", full);
    long base = rss_kib(w->s.pid);
    CHECK(base > 0);
    int fd[N_STALL];
    for (int i = 0; i < N_STALL; i++) {
        fd[i] = tcp_open("127.0.0.1", w->s.port, 4096);
        CHECK(fd[i] >= 0);
        if (!send_all(fd[i], req, strlen(req))) { close_all(fd, (size_t)i + 1); CHECKF(false, "send: %s", strerror(errno)); }
    }
    /* until their requests are over: ended by the bound, or generated
     * whole into the server's memory */
    double t0 = fx_now();
    bool over = false;
    while (fx_now() - t0 < 120 && !over) {
        fx_sleep_ms(200);
        over = metric(w->s.port, "kvtier_requests_total{endpoint=\"chat_completions\",status=\"2xx\"}") ==
                   1 + N_STALL &&
               metric(w->s.port, "kvtier_queue_depth") == 0 && metric(w->s.port, "kvtier_active_requests") == 0;
    }
    CHECKF(over, "the requests of the clients that do not read still run after 120 s");
    long grown = rss_kib(w->s.pid) - base;
    bool ended[N_STALL];
    long got[N_STALL];
    for (int i = 0; i < N_STALL; i++) {
        got[i] = read_until_close(fd[i], out, sizeof out, 10);
        ended[i] = got[i] >= 0 && !strstr(out, "data: [DONE]");
        close(fd[i]);
    }
    printf("    %d clients that do not read: server RSS +%ld KiB; they got %ld, %ld, %ld bytes of %ld\n", N_STALL,
           grown, got[0], got[1], got[2], full);
    for (int i = 0; i < N_STALL; i++)
        CHECKF(ended[i], "client %d that did not read got the whole stream (%ld bytes): it was buffered", i, got[i]);
    /* ASan's allocator keeps what is freed (its quarantine): no bound there */
    CHECKF(slow_build() || grown < 12 * 1024, "server RSS grew by %ld KiB for %d clients that do not read", grown,
           N_STALL);
    CHECKF(fx_health_ok(&w->s), "/health after the streams");
    STOP(w);
}

TEST(server_stream_bound)
{
    world w;
    if (!begin(&w, "kvtier-listen")) return;
    stream_bound(&w);
    end(&w);
}

/* SIGTERM while answers are still unsent. --parallel 1; S: a stream of
 * 300 tokens with 20 logprobs each (about 500 KB of events), generated
 * whole before the signal, its client not reading; L: a stream to the
 * context (about 650 KB, a second or more), running at the signal, its
 * client not reading either; three requests queued behind L. After the
 * signal the queued ones get 503; once L is over (the server would exit
 * then without the drain) S and L are read: both whole, to their end. */
static void stop_drain(world *w)
{
    START(w, "--model", "ds4-tiny", "--no-kv-disk", "--parallel", "1", "--max-tokens", "100000");
    int port = w->s.port;
    static char rs[16384], rl[16384];
    snprintf(rs, sizeof rs, "%s",
             post("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"max_tokens\":300,"
                                          "\"temperature\":0,\"stream\":true,\"logprobs\":true,\"top_logprobs\":20}"));
    snprintf(rl, sizeof rl, "%s",
             post("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],"
                                          "\"max_tokens\":100000,\"temperature\":0,\"stream\":true}"));
    const char *rq = post("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":4}");
    int fs = tcp_open("127.0.0.1", port, 4096);
    CHECK(fs >= 0);
    CHECK(send_all(fs, rs, strlen(rs)));
    double t0 = fx_now();
    while (fx_now() - t0 < 60 && metric(port, "kvtier_generated_tokens_total") < 300) fx_sleep_ms(50);
    CHECKF(metric(port, "kvtier_generated_tokens_total") == 300, "S was not generated within 60 s");
    int fl = tcp_open("127.0.0.1", port, 4096), fq[3];
    CHECK(fl >= 0);
    CHECK(send_all(fl, rl, strlen(rl)));
    t0 = fx_now();
    while (fx_now() - t0 < 10 && metric(port, "kvtier_active_requests") < 1) fx_sleep_ms(5);
    for (int i = 0; i < 3; i++) {
        fq[i] = tcp_open("127.0.0.1", port, 0);
        CHECK(fq[i] >= 0);
        CHECK(send_all(fq[i], rq, strlen(rq)));
    }
    t0 = fx_now();
    while (fx_now() - t0 < 10 && metric(port, "kvtier_queue_depth") < 3) fx_sleep_ms(5);
    long active = metric(port, "kvtier_active_requests"), queued = metric(port, "kvtier_queue_depth");
    kill(w->s.pid, SIGTERM);
    static char out[2 << 20];
    int n503 = 0;
    for (int i = 0; i < 3; i++) {
        read_until_close(fq[i], out, sizeof out, 10);
        n503 += !strncmp(out, "HTTP/1.1 503", 12);
        close(fq[i]);
    }
    /* L runs for a second or more after the signal (several in the
     * sanitizer build): its end, or the server's exit without the drain,
     * within 2.5 s, under the drain's 5 s */
    int st = 0;
    pid_t gone = 0;
    t0 = fx_now();
    while (fx_now() - t0 < 2.5 && (gone = waitpid(w->s.pid, &st, WNOHANG)) == 0) fx_sleep_ms(20);
    long gs = read_until_close(fs, out, sizeof out, 20);
    bool s_end = strstr(out, "data: [DONE]") != NULL;
    long gl = read_until_close(fl, out, sizeof out, 30);
    bool l_end = strstr(out, "data: [DONE]") != NULL;
    close(fs);
    close(fl);
    printf("    at the signal: %ld active, %ld queued; %d answered 503; S %ld bytes, L %ld bytes\n", active, queued, n503,
           gs, gl);
    CHECKF(active == 1 && queued == 3, "L was not running with three queued at the signal (%ld, %ld)", active, queued);
    CHECKF(n503 == 3, "%d of 3 queued requests were answered 503", n503);
    CHECKF(s_end, "S, generated before the signal, was cut at %ld bytes", gs);
    CHECKF(l_end, "L, running at the signal, was cut at %ld bytes", gl);
    if (gone == w->s.pid) { /* exited already (reaped here) */
        w->s.pid = 0;
        CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "kvtier serve ended with status %d after SIGTERM", st);
        return;
    }
    STOP(w);
}

TEST(server_stop_drain)
{
    world w;
    if (!begin(&w, "kvtier-listen")) return;
    stop_drain(&w);
    end(&w);
}

/* A request leaves kvtier_active_requests before its answer: ds4-mini,
 * --parallel 2; B, a long prefill, runs while A (a short prompt, 2 tokens)
 * is answered three times; /metrics read right after each answer counts B
 * alone. The worker used to count at the top of its loop, after the next
 * pass (here B's next prefill chunk, a tenth of a second or more). */
static void active_after_answer(world *w)
{
    START(w, "--model", "ds4-mini", "--no-kv-disk", "--parallel", "2");
    int port = w->s.port;
    int fb = tcp_open("127.0.0.1", port, 0);
    CHECK(fb >= 0);
    const char *rb = long_prompt_stream();
    CHECK(send_all(fb, rb, strlen(rb)));
    double t0 = fx_now();
    while (fx_now() - t0 < 10 && metric(port, "kvtier_active_requests") < 1) fx_sleep_ms(5);
    long seen[3];
    static char out[65536];
    const char *ra = post("/v1/completions", "{\"prompt\":\"hello\",\"max_tokens\":2}");
    bool answered = true;
    for (int i = 0; i < 3; i++) {
        answered &= exchange("127.0.0.1", port, ra, out, sizeof out, 30, NULL) > 0 && !strncmp(out, "HTTP/1.1 200", 12);
        seen[i] = metric(port, "kvtier_active_requests");
    }
    long after = metric(port, "kvtier_prefilled_tokens_total");
    long b_on = metric(port, "kvtier_active_requests");
    close(fb);
    printf("    active right after each answer: %ld, %ld, %ld; B still running after them: %s (%ld tokens prefilled)\n",
           seen[0], seen[1], seen[2], b_on >= 1 ? "yes" : "no", after);
    CHECKF(answered, "A was not answered 200");
    CHECKF(b_on >= 1, "B's prefill ended before A's three answers: no check made");
    for (int i = 0; i < 3; i++) CHECKF(seen[i] == 1, "answer %d: %ld active requests, A still counted", i + 1, seen[i]);
    STOP(w);
}

TEST(server_active_after_answer)
{
    world w;
    if (!begin(&w, "kvtier-listen")) return;
    active_after_answer(&w);
    end(&w);
}

/* --request-timeout 2: two streams of 20 top logprobs a token (about
 * 1.7 KB) sized to what the sockets take (measured: the bytes a client
 * that does not read gets of a stream to the context, which the 1 MiB
 * bound ends) plus 512 KiB, so that about that much waits in the server
 * for a client that does not read (under the bound). X's client never reads: its connection is
 * closed once it has taken nothing for 2 s, and the bytes still in the
 * server are dropped. Y's client reads 16 KB every quarter second: never cut,
 * it gets the whole stream. */
static void stream_stall(world *w)
{
    START(w, "--model", "ds4-tiny", "--no-kv-disk", "--max-tokens", "100000", "--request-timeout", "2");
    static char out[16 << 20];
    const char *full = post("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],"
                                                    "\"max_tokens\":100000,\"temperature\":0,\"stream\":true,"
                                                    "\"logprobs\":true,\"top_logprobs\":20}");
    int x0 = tcp_open("127.0.0.1", w->s.port, 4096);
    CHECK(x0 >= 0);
    CHECK(send_all(x0, full, strlen(full)));
    fx_sleep_ms(3000); /* not read before its cut (the bound, or 2 s without progress) */
    long took = read_until_close(x0, out, sizeof out, 20);
    close(x0);
    long n = (took + (512 << 10)) / 1700;
    if (n > 4000) n = 4000;
    char body[512];
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"max_tokens\":%ld,\"temperature\":0,"
             "\"stream\":true,\"logprobs\":true,\"top_logprobs\":20}", n);
    const char *req = post("/v1/chat/completions", body);
    int x = tcp_open("127.0.0.1", w->s.port, 4096), y = tcp_open("127.0.0.1", w->s.port, 65536);
    CHECK(x >= 0 && y >= 0);
    CHECK(send_all(x, req, strlen(req)) && send_all(y, req, strlen(req)));
    size_t got_y = 0;
    bool y_cut = false;
    double t0 = fx_now();
    while (fx_now() - t0 < 6 && !y_cut) { /* three timeouts */
        fx_sleep_ms(250);
        ssize_t r = recv(y, out + got_y, 16384, MSG_DONTWAIT);
        if (r > 0) got_y += (size_t)r;
        else y_cut = r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK);
    }
    long gx = read_until_close(x, out + got_y, sizeof out - got_y, 10);
    bool x_end = strstr(out + got_y, "data: [DONE]") != NULL;
    out[got_y] = 0;
    long gy = read_until_close(y, out + got_y, sizeof out - got_y, 20);
    bool y_end = gy > 0 && strstr(out + got_y, "data: [DONE]") != NULL;
    close(x);
    close(y);
    printf("    the sockets took %ld bytes; of %ld tokens, the client that does not read got %ld bytes, the slow one %zu "
           "in 6 s, then %ld\n", took, n, gx, got_y, gy);
    CHECKF(!x_end, "a client that took nothing for 6 s (timeout 2 s) got its whole stream: never cut");
    CHECKF(!y_cut && y_end, "a client reading 64 KB/s was cut (%s)", y_cut ? "within 6 s" : "before its end");
    CHECKF(fx_health_ok(&w->s), "/health after the streams");
    STOP(w);
}

TEST(server_stream_stall)
{
    world w;
    if (!begin(&w, "kvtier-listen")) return;
    stream_stall(&w);
    end(&w);
}

/* 200 clients that send half their headers and hang up: the server log
 * gains no line for them (one each would let any client fill it). */
static void hangup_quiet(world *w)
{
    START(w, "--model", "ds4-tiny", "--no-kv-disk");
    for (int i = 0; i < 200; i++) {
        int fd = tcp_open("127.0.0.1", w->s.port, 0);
        CHECK(fd >= 0);
        CHECK(send_all(fd, "GET /health HTTP/1.1\r\nHo", 24));
        fx_sleep_ms(2);
        close(fd);
    }
    CHECKF(fx_health_ok(&w->s), "/health after the hang-ups");
    STOP(w);
    FILE *f = fopen(w->s.log, "r");
    CHECK(f);
    char line[512];
    int n = 0;
    while (fgets(line, sizeof line, f)) n += strstr(line, "incomplete request") != NULL;
    fclose(f);
    printf("    200 hang-ups mid-request: %d log lines about them\n", n);
    CHECKF(n == 0, "%d log lines for 200 clients that hung up mid-request", n);
}

TEST(server_hangup_quiet)
{
    world w;
    if (!begin(&w, "kvtier-listen")) return;
    hangup_quiet(&w);
    end(&w);
}

/* A 200-token prompt (ds4-tiny's tokenizer: a byte a token, after BOS)
 * served twice by a server on model (no disk tier), XDG_CACHE_HOME xdg;
 * fault: KVT_FAULT_PROCESS_SEED_FINGERPRINTED=1 in its environment. *hits:
 * its RAM hits; *entries: the files left in its fingerprint cache. */
static void serve_twice(world *w, const char *model, const char *xdg, bool fault, long *hits, int *entries)
{
    *hits = -1;
    *entries = -1;
    char *old = getenv("XDG_CACHE_HOME") ? strdup(getenv("XDG_CACHE_HOME")) : NULL;
    setenv("XDG_CACHE_HOME", xdg, 1);
    if (fault) setenv("KVT_FAULT_PROCESS_SEED_FINGERPRINTED", "1", 1);
    const char *const args[] = {"--model", model, "--no-kv-disk", NULL};
    bool up = fx_server_start(&w->s, args);
    unsetenv("KVT_FAULT_PROCESS_SEED_FINGERPRINTED");
    if (old) setenv("XDG_CACHE_HOME", old, 1);
    else unsetenv("XDG_CACHE_HOME");
    free(old);
    CHECKF(up, "kvtier serve did not come up");
    char text[201], body[512], out[65536];
    for (int i = 0; i < 199; i++) text[i] = (char)('a' + (i * 7 + i / 26) % 26);
    text[199] = 0;
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":2,\"temperature\":0}", text);
    for (int i = 0; i < 2; i++)
        CHECKF(exchange("127.0.0.1", w->s.port, post("/v1/completions", body), out, sizeof out, 30, NULL) > 0 &&
                   !strncmp(out, "HTTP/1.1 200", 12),
               "request %d: %.300s", i + 1, out);
    *hits = metric(w->s.port, "kvtier_cache_hits_total{tier=\"ram\"}");
    STOP(w);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "ls -A %s/kvtier/fingerprints 2>/dev/null | wc -l", xdg);
    FILE *p = popen(cmd, "r");
    if (p && fscanf(p, "%d", entries) != 1) *entries = -1;
    if (p) pclose(p);
}

static void no_fingerprint(world *w)
{
    char model[128], xdg[2][128];
    snprintf(model, sizeof model, "%s/tiny.gguf", w->s.dir);
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_preset(&m, "ds4-tiny", 7, NULL));
    int rc = kvt_model_save(m, model);
    kvt_model_close(m);
    CHECK_OK(rc);
    fx_sleep_ms(2200); /* a file written in the last 2 s is not remembered (docs/FORMAT.md) */
    for (int fault = 0; fault < 2; fault++) {
        snprintf(xdg[fault], sizeof xdg[fault], "%s/xdg%d", w->s.dir, fault);
        long hits;
        int entries;
        serve_twice(w, model, xdg[fault], fault, &hits, &entries);
        printf("    %s: %ld RAM hit, %d fingerprint cache entries\n",
               fault ? "negative control, KVT_FAULT_PROCESS_SEED_FINGERPRINTED=1" : "--no-kv-disk", hits, entries);
        CHECKF(hits == 1, "the second request was not a RAM hit (%ld)", hits);
        if (!fault) CHECKF(entries == 0, "the server made the fingerprint (%d entries)", entries);
        else CHECKF(entries == 1, "control: the fingerprinted seed left %d entries, not 1", entries);
    }
}

TEST(server_no_store_no_fingerprint)
{
    world w;
    if (!begin(&w, "kvtier-listen")) return;
    no_fingerprint(&w);
    end(&w);
}
