/* A kvtier server child process for end-to-end tests, and the process, file
 * and environment plumbing that test_e2e.c and test_agents.c share.
 *
 * Children are fork + execvp with stdout + stderr redirected to a file in
 * the test's temp dir, so a failing test can print what the server or the
 * client said; waits poll waitpid(WNOHANG) against a monotonic clock so no
 * child can hang the test run. The llama.cpp peer's install is shared by
 * test_peer.c and test_quant.c; the golden files' write-or-compare by
 * test_snapshot.c, test_deltanet.c and test_store.c. See fixture.h for the
 * interface. */
#include "fixture.h"
#include "test.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

double fx_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

void fx_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) && errno == EINTR) {}
}

bool fx_env_is(const char *name, const char *value)
{
    const char *v = getenv(name);
    return v && !strcmp(v, value);
}

void fx_print_file(const char *what, const char *path)
{
    char *text = kvt_test_read_file(path, NULL);
    printf("    --- %s (%s) ---\n", what, path);
    if (!text) { printf("    (unreadable)\n"); return; }
    const char *p = text;
    size_t len = strlen(text);
    if (len > 12000) { p = text + len - 12000; printf("    ...\n"); }
    while (*p) {
        const char *nl = strchr(p, '\n');
        int n = nl ? (int)(nl - p) : (int)strlen(p);
        printf("    | %.*s\n", n, p);
        p += n + (nl ? 1 : 0);
    }
    free(text);
}

int fx_free_port(void)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int port = -1;
    if (!bind(s, (struct sockaddr *)&a, sizeof a) && !getsockname(s, (struct sockaddr *)&a, &len))
        port = ntohs(a.sin_port);
    close(s);
    return port;
}

bool fx_tmpdir_make(fx_server *s, const char *name)
{
    snprintf(s->dir, sizeof s->dir, "/tmp/%s-XXXXXX", name);
    if (kvt_test_mkdtemp(s->dir)) return true; /* removed after the test whatever happens */
    int err = errno;
    s->dir[0] = 0; /* nothing for fx_tmpdir_remove to remove */
    errno = err;
    return false;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st; (void)flag; (void)ftw;
    remove(path);
    return 0;
}

void fx_rm_tree(const char *dir) { nftw(dir, rm_entry, 32, FTW_DEPTH | FTW_PHYS); }

void fx_tmpdir_remove(fx_server *s)
{
    if (s->dir[0]) fx_rm_tree(s->dir);
}

bool fx_npm_ci(const char *dir, const char *name, const char *what)
{
    char log[96];
    snprintf(log, sizeof log, "/tmp/%s-npm-XXXXXX", name);
    int lf = mkstemp(log);
    if (lf >= 0) close(lf);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "npm ci --prefix %s --no-audit --no-fund --loglevel=error >%s 2>&1", dir,
             lf >= 0 ? log : "/dev/null");
    printf("    installing the %s: npm ci --prefix %s\n", what, dir);
    fflush(stdout);
    bool ok = system(cmd) == 0;
    if (!ok && lf >= 0) fx_print_file("npm ci", log);
    if (lf >= 0) unlink(log);
    return ok;
}

/* node-llama-cpp FX_PEER_VERSION and its linux-x64 binaries are in node_modules. */
static bool peer_present(void)
{
    if (access(FX_PEER_BINS "/llama-addon.node", R_OK) != 0 ||
        access(FX_PEER_BINS "/libggml-base.so", R_OK) != 0)
        return false;
    char *pkg = kvt_test_read_file(FX_PEER_DIR "/node_modules/node-llama-cpp/package.json", NULL);
    bool ok = pkg && strstr(pkg, "\"version\": \"" FX_PEER_VERSION "\"");
    free(pkg);
    return ok;
}

const char *fx_peer_skip_reason(void)
{
    if (fx_env_is("KVT_PEER", "0")) return "KVT_PEER=0";
    struct utsname u;
    if (uname(&u) != 0 || strcmp(u.sysname, "Linux") != 0 || strcmp(u.machine, "x86_64") != 0)
        return "the peer is node-llama-cpp's prebuilt linux-x64 llama.cpp (not this machine)";
    if (access(FX_PEER_DIR "/package-lock.json", R_OK) != 0)
        return "run from the repository root (" FX_PEER_DIR " not found)";
    if (!peer_present() && system("command -v npm >/dev/null 2>&1") != 0) return "npm is not on PATH";
    return NULL;
}

bool fx_peer_ensure(double *seconds)
{
    *seconds = -1;
    int fd = open(FX_PEER_DIR "/package.json", O_RDONLY);
    if (fd < 0) return false;
    flock(fd, LOCK_EX);
    bool ok = peer_present();
    if (!ok) {
        const char *old = getenv("npm_config_omit");
        char *saved = old ? strdup(old) : NULL;
        setenv("npm_config_omit", "optional", 1);
        double t0 = fx_now();
        ok = fx_npm_ci(FX_PEER_DIR, "kvtier-peer", "llama.cpp peer (node-llama-cpp " FX_PEER_VERSION ")") &&
             peer_present();
        *seconds = fx_now() - t0;
        if (saved) setenv("npm_config_omit", saved, 1);
        else unsetenv("npm_config_omit");
        free(saved);
    }
    flock(fd, LOCK_UN);
    close(fd);
    return ok;
}

/* fork + execvp argv with stdout in out and stderr in err (in out too when
 * err is NULL); the child's pid, or -1. */
static pid_t spawn(const char *const *argv, const char *out, const char *err)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid != 0) return pid;
    int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int fe = err ? open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644) : fd;
    if (fd >= 0) dup2(fd, 1);
    if (fe >= 0) dup2(fe, 2);
    if (fd > 2) close(fd);
    if (fe > 2 && fe != fd) close(fe);
    execvp(argv[0], (char *const *)argv);
    _exit(127);
}

pid_t fx_spawn(const char *const *argv, const char *out)
{
    pid_t pid = spawn(argv, out, NULL);
    kvt_test_defer_pid(pid);
    return pid;
}

int fx_run(const char *const *argv, const char *out, double timeout, int *status)
{
    return fx_run_split(argv, out, NULL, timeout, status);
}

int fx_run_split(const char *const *argv, const char *out, const char *err, double timeout, int *status)
{
    pid_t pid = spawn(argv, out, err);
    if (pid < 0) return -1;
    double t0 = fx_now();
    pid_t got = 0;
    *status = 0;
    while (fx_now() - t0 < timeout && (got = waitpid(pid, status, WNOHANG)) == 0) fx_sleep_ms(50);
    if (got == pid) return 1;
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return 0;
}

bool fx_health_ok(const fx_server *s)
{
    char cmd[160];
    snprintf(cmd, sizeof cmd, "curl -s -o /dev/null -w '%%{http_code}' --max-time 2 %s/health", s->base);
    FILE *f = popen(cmd, "r");
    if (!f) return false;
    char code[16] = {0};
    size_t n = fread(code, 1, sizeof code - 1, f);
    code[n] = 0;
    pclose(f);
    return atoi(code) == 200;
}

bool fx_server_start(fx_server *s, const char *const *args)
{
    const char *bin = kvt_test_bin();
    for (int attempt = 0; attempt < 3; attempt++) {
        s->port = fx_free_port();
        if (s->port <= 0) return false;
        snprintf(s->base, sizeof s->base, "http://127.0.0.1:%d", s->port);
        snprintf(s->log, sizeof s->log, "%s/server-%d.log", s->dir, ++s->n_logs);
        char port[16];
        snprintf(port, sizeof port, "%d", s->port);
        const char *argv[48] = {bin, "serve", "--host", "127.0.0.1", "--port", port};
        size_t n = 6;
        for (size_t i = 0; args[i] && n + 1 < sizeof argv / sizeof argv[0]; i++) argv[n++] = args[i];
        argv[n] = NULL;
        pid_t pid = spawn(argv, s->log, NULL);
        if (pid < 0) return false;
        s->pid = pid;
        kvt_test_defer_pid(pid); /* killed after the test when a check left it running */
        double t0 = fx_now();
        while (fx_now() - t0 < FX_START_TIMEOUT) {
            int st;
            if (waitpid(pid, &st, WNOHANG) == pid) {
                s->pid = 0;
                kvt_test_forget_pid(pid);
                char *log = kvt_test_read_file(s->log, NULL);
                bool port_taken = log && strstr(log, "cannot listen");
                free(log);
                if (port_taken) break; /* try another port */
                printf("    the server exited before answering /health (status 0x%x)\n", st);
                fx_print_file("server log", s->log);
                return false;
            }
            if (fx_health_ok(s)) return true;
            fx_sleep_ms(100);
        }
        if (s->pid) {
            printf("    no answer on %s/health within %.0f s\n", s->base, FX_START_TIMEOUT);
            fx_print_file("server log", s->log);
            fx_server_kill(s);
            return false;
        }
    }
    return false;
}

bool fx_server_stop(fx_server *s)
{
    if (!s->pid) return false;
    kill(s->pid, SIGTERM);
    double t0 = fx_now();
    int st = 0;
    pid_t got = 0;
    while (fx_now() - t0 < FX_STOP_TIMEOUT && (got = waitpid(s->pid, &st, WNOHANG)) == 0) fx_sleep_ms(50);
    bool ok = got == s->pid && WIFEXITED(st) && WEXITSTATUS(st) == 0;
    if (got == 0) {
        printf("    the server did not exit within %.0f s of SIGTERM\n", FX_STOP_TIMEOUT);
        kill(s->pid, SIGKILL);
        waitpid(s->pid, NULL, 0);
    } else if (!ok) {
        printf("    the server ended with %s %d after SIGTERM\n", WIFEXITED(st) ? "exit status" : "signal",
               WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? WTERMSIG(st) : -1);
    }
    if (!ok) fx_print_file("server log", s->log);
    kvt_test_forget_pid(s->pid);
    s->pid = 0;
    return ok;
}

void fx_server_kill(fx_server *s)
{
    if (!s->pid) return;
    kill(s->pid, SIGKILL);
    waitpid(s->pid, NULL, 0);
    kvt_test_forget_pid(s->pid);
    s->pid = 0;
}

bool fx_write_file(const char *path, const void *bytes, size_t len)
{
    FILE *f = fopen(path, "wb");
    bool ok = f && fwrite(bytes, 1, len, f) == len;
    if (f) ok &= fclose(f) == 0;
    if (!ok) printf("    %s: not written: %s\n", path, strerror(errno));
    return ok;
}

bool fx_golden_writing(void) { return fx_env_is("KVT_WRITE_GOLDEN", "1"); }

uint8_t *fx_golden(const char *path, const void *bytes, size_t len, bool same, size_t *glen)
{
    if (fx_golden_writing()) {
        char dir[512];
        snprintf(dir, sizeof dir, "%s", path);
        char *slash = strrchr(dir, '/');
        if (slash) { *slash = 0; mkdir(dir, 0755); }
        if (!bytes || !fx_write_file(path, bytes, len)) {
            if (!bytes) printf("    %s: KVT_WRITE_GOLDEN=1 but nothing to write\n", path);
            return NULL;
        }
        printf("    %s: written anew (%zu bytes)\n", path, len);
    }
    size_t n = 0;
    uint8_t *g = (uint8_t *)kvt_test_read_file(path, &n);
    if (!g) { printf("    %s: missing or unreadable (KVT_WRITE_GOLDEN=1 writes it)\n", path); return NULL; }
    if (same && (n != len || memcmp(g, bytes, len))) {
        size_t at = 0;
        while (at < n && at < len && g[at] == ((const uint8_t *)bytes)[at]) at++;
        printf("    %s: the encoder no longer writes it: %zu bytes written, %zu in the file, first difference at "
               "byte %zu\n", path, len, n, at);
        free(g);
        return NULL;
    }
    if (glen) *glen = n;
    return g;
}
