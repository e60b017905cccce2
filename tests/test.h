/* Minimal test harness. Tests register themselves (TEST(name) { ... }) from any
 * test file; the runner (tests/main.c) runs those whose name contains the
 * command-line pattern, prints "ok"/"FAIL"/"skip" per test and closes with
 * the skips' reasons and "N passed, N failed[, N skipped]". CHECK* return
 * from the test function on failure, so use them in the test body (or in
 * void helpers), and register what the test must not leave behind with the
 * cleanup list (kvt_test_defer and the rest, below). */
#ifndef KVT_TEST_H
#define KVT_TEST_H

#include "kvtier.h"
#include <stdint.h>
#include <stdio.h>

typedef void (*kvt_test_fn)(void);
/* A test's name starts with its file's name less "test_" (tests in
 * tests/test_tokenizer.c are tokenizer_*). The runner's pattern, when it
 * names a file (`kvtier-tests tokenizer`: tests/test_tokenizer.c), selects
 * exactly that file's tests; any other pattern the tests whose name
 * contains it. `kvtier-tests --list [PATTERN]` prints the selected tests'
 * names and files without running them. */
void kvt_test_register(const char *name, const char *file, kvt_test_fn fn);
void kvt_test_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A skip, with its reason. kvt_test_skip: the test needs something the
 * machine was not set up with (../shared, npm packages, the repository
 * root); with CI=true in the environment the runner counts it as a failure.
 * kvt_test_skip_env: what it needs is hardware the CPU lacks or a limit of
 * the machine no set-up step raises (an instruction set, the descriptor hard
 * limit): a skip in CI too. The runner lists every skip's reason at the end. */
void kvt_test_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void kvt_test_skip_env(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int kvt_test_failed(void); /* current test has failed */

/* The cleanup list. CHECK returns from the test at the first failure, so
 * what a test frees or removes at its end is left behind when a check
 * fails before it. What a test registers here the runner undoes after the
 * test, last registered first, whatever happened: so a failing test leaves
 * no /tmp/kvtier-* directory, child process or allocation behind. The
 * fixtures register their own (fx_tmpdir_make, fx_server_start,
 * redis_fx.h's servers and certificates, kvt_test_mkdtemp); a test
 * registers what it makes itself.
 *   kvt_test_defer      fn(arg) after the test;
 *   kvt_test_release    run now, and forget, the entries of arg (a test
 *                       that frees in the middle: no double free after);
 *   kvt_test_forget     forget the entries of arg without running them;
 *   kvt_test_defer_dir  dir (copied; under /tmp/ only) and everything
 *                       below it removed after the test, when still there;
 *                       kvt_test_forget_dir for one that outlives the test
 *                       (a cache shared by the tests, removed at exit);
 *   kvt_test_defer_pid  the child pid SIGKILLed and reaped after the test
 *                       when it is still this process's unreaped child;
 *                       kvt_test_forget_pid once the test reaped it;
 *   kvt_test_mkdtemp    mkdtemp(tmpl) and kvt_test_defer_dir of it.
 * The helpers for the engine's objects take NULL (nothing registered). */
typedef void (*kvt_test_cleanup_fn)(void *arg);
void kvt_test_defer(kvt_test_cleanup_fn fn, void *arg);
void kvt_test_release(void *arg);
void kvt_test_forget(void *arg);
void kvt_test_defer_dir(const char *dir);
void kvt_test_forget_dir(const char *dir);
void kvt_test_defer_pid(int pid);
void kvt_test_forget_pid(int pid);
char *kvt_test_mkdtemp(char *tmpl);
void kvt_test_defer_free(void *p);               /* free(p) */
void kvt_test_defer_session(kvt_session *s);     /* kvt_session_free(s) */
void kvt_test_defer_model(kvt_model *m);         /* kvt_model_close(m) */
/* Run fn in a forked child the way the runner runs a test (its state
 * fresh, fn, then its cleanup list) and wait for it: 1 when it failed,
 * 0 when it passed, -1 when the child could not be made or did not exit
 * normally. Its output goes to this process's stdout. */
int kvt_test_run_child(kvt_test_fn fn);
/* Fault switch (tests/test_runner.c): the runner drops the cleanup list
 * after a test without running it, as before there was one. */
extern bool kvt_test_fault_no_cleanup;

/* Path of a file under ../shared (or $KVT_SHARED); NULL when absent. The
 * returned string is static per call site use: copy it if you keep two. */
const char *kvt_test_shared(const char *rel);
/* llama.cpp's models/FILE (a vocabulary and its cases) from the peer's
 * source bundle into path (cap bytes); false and *why when the bundle or
 * the file is not there (tests/test_tokenizer.c). */
bool kvt_test_bundle_vocab(const char *file, char *path, size_t cap, const char **why);
/* The kvtier binary under test ($KVT_BIN, default build/kvtier). */
const char *kvt_test_bin(void);
/* Seed for a random test: $KVT_TEST_SEED when set, else time-based; printed. */
uint64_t kvt_test_seed(const char *test);
uint64_t kvt_test_rand(uint64_t *state); /* splitmix64 */
/* Printable, escaped form of n bytes of text for messages (a static buffer,
 * overwritten by the next call; long texts are cut). */
const char *kvt_test_esc(const char *s, size_t n);
/* "    label (n): id id ..." on stdout, the first 48 ids. */
void kvt_test_print_ids(const char *label, const int32_t *ids, size_t n);
/* A token sequence for the built-in byte tokenizer: BOS (256), then n - 1
 * seeded random bytes. */
void kvt_test_tokens(int32_t *t, size_t n, uint64_t seed);
/* Digest of a session's logits, canonical cache bytes and length: two
 * sessions agree bit for bit when theirs do. When the bytes cannot be had
 * the test fails (the message says why) and the value matches no other. */
uint64_t kvt_test_digest(const kvt_session *s, const kvt_model *m);
/* kvt_test_digest and the session's checkpoints: how many, and each one's
 * position, logits and fixed state. For sessions that ran the same tokens
 * the same way (a loaded or rolled-back session keeps other checkpoints
 * than an uninterrupted run, and the same state). */
uint64_t kvt_test_digest_ckpt(const kvt_session *s, const kvt_model *m);
/* The digest of an uninterrupted run of t[0..n) in a fresh session (the
 * test fails when the run does, as kvt_test_digest). */
uint64_t kvt_test_twin(kvt_model *m, const int32_t *t, size_t n);
/* The snapshot record rec (len bytes, then what follows it: its inline
 * blocks, kept) written anew as format version `version` with flags and
 * the nsec sections sec[1..nsec] (lengths sl[1..nsec]): the other header
 * fields (fingerprints, n, nb, V, streams, head) kept, every checksum made
 * anew. Records as other versions lay them out (docs/FORMAT.md), to prove
 * they are read. malloc'ed; NULL when rec is not a record. */
uint8_t *kvt_test_repack(const uint8_t *rec, size_t len, uint32_t version, uint32_t flags, int nsec,
                         const uint8_t *const *sec, const size_t *sl, size_t *out_len);
/* Empty a flat directory (its files; no subdirectories) and make sure it
 * exists. */
void kvt_test_clear_dir(const char *dir);
/* Read a whole file (malloc'ed, NUL-terminated); NULL on failure. */
char *kvt_test_read_file(const char *path, size_t *len);

/* Allocation calls (malloc, calloc, realloc) so far in this process
 * (tests/alloc.c). */
unsigned long kvt_test_allocs(void);
/* The k-th allocation from now (0: the next) returns NULL, once; -1: none.
 * kvt_test_failed_allocs counts those that did. */
void kvt_test_fail_alloc(long k);
unsigned long kvt_test_failed_allocs(void);
/* Run the architecture's forward pass over tok[0..n) at pos0 directly (the
 * session's token list is not updated: the caller drops the session after)
 * and set *extra to the allocations it made beyond the cache blocks its new
 * rows took. */
int kvt_test_forward_allocs(kvt_session *s, const int32_t *tok, size_t n, size_t pos0, float *logits,
                            size_t lfrom, long *extra);
/* Sync tok[0..n0), then a 300-token pass and a decode step (tok must hold
 * n0 + 301 ids; the session's context too): true when neither allocates
 * beyond its cache blocks (the counts are printed). */
bool kvt_test_forward_no_scratch(kvt_session *s, const int32_t *tok, size_t n0);

/* The kernel paths a test that compares them can run on this CPU
 * (tests/test_kernels.c): prints them and returns true when it has the
 * AVX-512 kernels (F, BW, VL). When it lacks them, the cases that force
 * AVX2 without AVX-512 would repeat the widest path: the test is marked
 * skipped with that reason (kvt_test_skip_env: hardware, a skip in CI too;
 * its other checks still run and can fail) and
 * false tells the caller to leave those cases out; so without AVX2 at
 * all, where every SIMD case would repeat the scalar path. */
bool kvt_test_kernel_paths(void);

/* The same request run alone and inside `rounds` random batches of other
 * sessions of m (tests/test_batch.c): returns how many rounds gave it the
 * alone run's bits everywhere (a message for the others). */
int kvt_test_batch_invariance(kvt_model *m, const char *what, size_t rounds, uint64_t seed);

#define TEST(name)                                                          \
    static void name(void);                                                 \
    __attribute__((constructor)) static void kvt_reg_##name(void)           \
    { kvt_test_register(#name, __FILE__, name); }                                     \
    static void name(void)

#define CHECK(cond)                                                         \
    do { if (!(cond)) { kvt_test_fail(__FILE__, __LINE__, "%s", #cond); return; } } while (0)
#define CHECKF(cond, ...)                                                   \
    do { if (!(cond)) { kvt_test_fail(__FILE__, __LINE__, __VA_ARGS__); return; } } while (0)
#define CHECK_OK(expr)                                                      \
    do { int rc_ = (expr); if (rc_ != KVT_OK) {                             \
        kvt_test_fail(__FILE__, __LINE__, "%s = %s: %s", #expr,             \
                      kvt_strerror(rc_), kvt_errmsg()); return; } } while (0)
#define SKIP(...) do { kvt_test_skip(__VA_ARGS__); return; } while (0)
#define SKIP_ENV(...) do { kvt_test_skip_env(__VA_ARGS__); return; } while (0)

#endif
