/* A kvtier server child process for end-to-end tests (tests/test_e2e.c,
 * tests/test_agents.c), and the plumbing around it.
 *
 * fx_server_start runs the built binary (KVT_BIN) as
 * `serve --host 127.0.0.1 --port P args...` on a free loopback port, its
 * stdout + stderr in DIR/server-N.log, and waits for GET /health;
 * fx_server_stop sends SIGTERM the way a service manager does and says
 * whether it exited 0. Around it: a temp dir per test, a child run with a
 * timeout and its output in a file, `npm ci` under a lock, environment
 * switches, printing a log when a check fails, and the golden files the
 * format tests pin (fx_golden).
 *
 * Nothing here calls CHECK or kvt_test_fail: the functions say what went
 * wrong on stdout and return false, and the test decides what fails. */
#ifndef KVT_FIXTURE_H
#define KVT_FIXTURE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define FX_START_TIMEOUT 30.0   /* seconds until /health answers */
#define FX_STOP_TIMEOUT 30.0    /* seconds from SIGTERM to exit */

/* A test's temp dir and at most one server running in it. Zero it before
 * use; dir is set by fx_tmpdir_make. */
typedef struct fx_server {
    char dir[64];            /* /tmp/kvtier-NAME-XXXXXX: the test's files, the server logs */
    pid_t pid;               /* the running server, 0 when none */
    int port;
    char base[64];           /* http://127.0.0.1:PORT */
    char log[128];           /* the current server's stdout + stderr */
    int n_logs;              /* server logs written so far */
} fx_server;

double fx_now(void);                                  /* monotonic seconds */
void fx_sleep_ms(int ms);
bool fx_env_is(const char *name, const char *value);  /* getenv(name) equals value */

/* Print a file (a log, a script's output), each line indented; at most its
 * last 12 KB, which is what explains a failure. */
void fx_print_file(const char *what, const char *path);

/* A port nobody listens on right now (the kernel's pick for port 0); -1 on
 * failure. */
int fx_free_port(void);

/* Make s->dir a fresh /tmp/NAME-XXXXXX; false (errno set) on failure.
 * fx_tmpdir_remove removes it and everything below it; the runner removes
 * it after the test in any case (kvt_test_defer_dir). */
bool fx_tmpdir_make(fx_server *s, const char *name);
void fx_tmpdir_remove(fx_server *s);
/* Remove dir and everything below it (links not followed). */
void fx_rm_tree(const char *dir);

/* `npm ci --prefix DIR`, its log in a temp file /tmp/NAME-npm-XXXXXX that is
 * printed when npm fails; what names the packages in the progress line.
 * Locking DIR/package.json against a concurrent install is the caller's. */
bool fx_npm_ci(const char *dir, const char *name, const char *what);

/* The llama.cpp peer: node-llama-cpp FX_PEER_VERSION with its prebuilt
 * linux-x64 CPU binaries (llama-addon.node, libggml-base.so), the packages
 * of tests/peer/package-lock.json installed into tests/peer/node_modules.
 * Paths are relative to the repository root, where the tests run. */
#define FX_PEER_DIR "tests/peer"
#define FX_PEER_VERSION "3.22.1"
#define FX_PEER_BINS FX_PEER_DIR "/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64"

/* Why the peer cannot be used here (KVT_PEER=0, not linux x86_64, not run
 * from the repository root, npm missing while the packages are not
 * installed); NULL when it can. */
const char *fx_peer_skip_reason(void);
/* Install the packages when they are missing (`npm ci`, optional packages
 * omitted: the linux-x64 CPU binaries are a direct dependency), under an
 * exclusive lock on package.json so that two test runs never install at
 * once. True when they are in place; *seconds is the install's duration,
 * -1 when nothing was installed. */
bool fx_peer_ensure(double *seconds);

/* Run argv (argv[0] looked up on PATH) with stdout + stderr in the file out
 * and wait up to timeout seconds. 1: it exited, *status holds its wait
 * status; 0: it did not exit in time and was killed; -1: fork failed. */
int fx_run(const char *const *argv, const char *out, double timeout, int *status);
/* Start argv (looked up on PATH) in the background with stdout + stderr in
 * the file out; its pid (-1: fork failed). The runner kills it after the
 * test when it still runs (kvt_test_defer_pid); a test that reaps it
 * itself calls kvt_test_forget_pid. */
pid_t fx_spawn(const char *const *argv, const char *out);
/* fx_run with stdout in the file out and stderr in the file err, for a
 * check of what a command prints on which. */
int fx_run_split(const char *const *argv, const char *out, const char *err, double timeout, int *status);

/* GET /health answers 200 within 2 s. */
bool fx_health_ok(const fx_server *s);

/* Start `KVT_BIN serve --host 127.0.0.1 --port P args...` (args
 * NULL-terminated) and wait until /health answers, at most
 * FX_START_TIMEOUT. The runner kills a server still running after the
 * test (a check that failed before fx_server_stop). A port taken between fx_free_port() and the bind is
 * retried on another one. On failure the server log is printed. */
bool fx_server_start(fx_server *s, const char *const *args);

/* SIGTERM; true when the server exited with status 0 within
 * FX_STOP_TIMEOUT (killed otherwise). The server log is printed when not. */
bool fx_server_stop(fx_server *s);

/* SIGKILL a server a failed check left running; nothing when none. */
void fx_server_kill(fx_server *s);

/* Write bytes[0..len) to path (created or truncated); false after saying
 * why on stdout. */
bool fx_write_file(const char *path, const void *bytes, size_t len);

/* Golden files (tests/golden/, docs/FORMAT.md): bytes a format version
 * wrote, which today's encoder must write byte for byte and today's
 * decoder must load. KVT_WRITE_GOLDEN=1 writes them anew, only when a
 * format version changes or the model a file holds does:
 * fx_golden_writing() says whether it is set. */
bool fx_golden_writing(void);

/* The golden file at path. When fx_golden_writing(), bytes[0..len) are
 * written to it first (its directory made when missing). Then it is read
 * and, when same, compared with bytes[0..len). Returns its contents
 * (malloc'ed, NUL after the last byte, *glen bytes; the caller frees), or
 * NULL after saying why on stdout: not written, missing, or other bytes
 * (the sizes and the first offset that differs). bytes may be NULL when
 * not writing and not same (the caller checks the file its own way). */
uint8_t *fx_golden(const char *path, const void *bytes, size_t len, bool same, size_t *glen);

#endif
