/* End to end with the real agent CLIs: Claude Code, Codex and Pi, installed
 * from npm (tests/agents/package.json pins them) and run headless against
 * `kvtier serve` over loopback.
 *
 * Each test takes one client in one of its API modes through the same
 * sequence. The server is the built binary (KVT_BIN):
 *
 *   serve --model ds4-tiny --ctx 131072 --api-key K1 --api-key K2
 *         --max-tokens 64 --kv-disk-dir DIR
 *
 * (no model flag: Claude Code and Codex send their own model names, which a
 * server serves by default; --max-tokens caps every reply at 64 tokens,
 * Claude Code's max_tokens of 32,000 included: the checks are about the
 * prompts' reuse, not the replies, which the test models' random weights
 * make noise anyway, and short replies keep the turns quick; the save
 * policy is the default: a new conversation forks where the last one's
 * user turn began, from RAM or, after a restart, from disk.) Every session
 * runs the client through
 * tests/agents/run.mjs, which puts a recording proxy (tests/agents/proxy.mjs)
 * between client and server, reads /metrics around each request, and checks
 * what it saw; see run.mjs for the checks. All sessions of a test share the
 * client's HOME and working directory, as one user's sessions in one
 * project do (both are part of the clients' system prompts).
 *
 *   server 1, fresh disk dir A:
 *     K1, prompt 1   cold: the client completes a turn and exits 0
 *     K1, prompt 2   >= 90% of the prompt reused from RAM
 *     K2, prompt 1   key 2's first request reuses nothing, although key 1
 *                    holds the same prefix in RAM and on disk
 *   SIGTERM (exit 0 within 30 s)
 *   server 2, fresh disk dir B:
 *     K1, prompt 1   cold
 *   SIGTERM; server 3 on dir B (RAM empty, key 1's snapshots on disk):
 *     K2, prompt 1   key 2's first request reuses nothing from key 1's disk
 *     K1, prompt 3   >= 90% of the prompt restored from disk
 *   SIGTERM
 *
 *   agents_claude        Claude Code, POST /v1/messages?beta=true
 *   agents_codex         Codex exec, POST /v1/responses
 *   agents_pi_chat       Pi, api "openai-completions" (/v1/chat/completions)
 *   agents_pi_responses  Pi, api "openai-responses" (/v1/responses)
 *   agents_pi_messages   Pi, api "anthropic-messages" (/v1/messages)
 *
 * Requirements: node and npm on PATH, and the clients of
 * tests/agents/package-lock.json, installed with `npm ci --prefix
 * tests/agents` on first use (about 1 GB: both Claude Code and Codex ship a
 * native binary) and kept in tests/agents/node_modules; curl. The tests skip
 * when node or npm is missing or the install fails (offline). Run from the
 * repository root. docs/CLIENTS.md has each client's configuration.
 *
 * Environment:
 *   KVT_AGENTS=0|1        skip every test / run them under a sanitizer build
 *                         too (by default they skip when KVT_BIN's path
 *                         contains "asan")
 *   KVT_AGENTS_VERBOSE=1  print the sessions' output when they pass too
 *   KVT_AGENTS_KEEP=1     keep each test's temp dir (client homes, proxy
 *                         logs of every exchange, server logs)
 *
 * The five tests take about a minute on 2 cores once the clients are
 * installed (the install takes 20 to 30 s with a warm npm cache), most of it
 * the cold prefills of Claude Code's (48,000 tokens) and Codex's (38,000
 * tokens) prompts. */
#include "fixture.h"
#include "synth_family.h"
#include "test.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#define AGENTS_DIR "tests/agents"
#define SESSION_TIMEOUT 240  /* seconds for one run.mjs (it stops the client at 180) */

typedef struct agt {
    fx_server s;             /* s.dir: /tmp/kvtier-agents-XXXXXX */
    char state[96];          /* s.dir/state: client homes, the shared work dir, proxy logs */
    int n_runs;
    char model[128];         /* a model file (the family tests); empty: ds4-tiny */
} agt;

/* Why these tests cannot run here (NULL: they can). */
static const char *skip_reason(void)
{
    if (fx_env_is("KVT_AGENTS", "0")) return "KVT_AGENTS=0";
    if (!fx_env_is("KVT_AGENTS", "1") && strstr(kvt_test_bin(), "asan"))
        return "agent CLIs against a sanitizer build (KVT_AGENTS=1 forces them)";
    if (system("command -v node >/dev/null 2>&1") != 0) return "node is not on PATH";
    if (system("command -v npm >/dev/null 2>&1") != 0) return "npm is not on PATH";
    if (system("command -v curl >/dev/null 2>&1") != 0) return "curl is not on PATH";
    if (access(AGENTS_DIR "/package-lock.json", R_OK) != 0)
        return "run from the repository root (" AGENTS_DIR " not found)";
    if (access(kvt_test_bin(), X_OK) != 0) return "the kvtier binary is not built";
    return NULL;
}

/* The pinned clients in tests/agents/node_modules, installed with `npm ci`
 * when they are missing or differ. NULL when they are there; else why not
 * (the npm log is printed). An exclusive lock on package.json keeps two
 * test runs from installing at once. */
static const char *ensure_clients(void)
{
    static int state; /* 0 unknown, 1 installed, -1 failed */
    if (state) return state > 0 ? NULL : "the agent CLIs could not be installed (see above)";
    int fd = open(AGENTS_DIR "/package.json", O_RDONLY);
    if (fd < 0) return "cannot open " AGENTS_DIR "/package.json";
    flock(fd, LOCK_EX);
    const char *check = "node " AGENTS_DIR "/run.mjs check >/dev/null 2>&1";
    bool ok = system(check) == 0;
    if (!ok) {
        double t0 = fx_now();
        ok = fx_npm_ci(AGENTS_DIR, "kvtier-agents", "agent CLIs");
        if (ok) printf("    installed in %.0f s\n", fx_now() - t0);
        if (ok && system("node " AGENTS_DIR "/run.mjs check") != 0) {
            printf("    npm ci succeeded but the clients are not usable (see above)\n");
            ok = false;
        }
    }
    flock(fd, LOCK_UN);
    close(fd);
    state = ok ? 1 : -1;
    return ok ? NULL : "npm ci --prefix " AGENTS_DIR " failed (offline?); the agent CLIs are not installed";
}

/* Start the server (on t->model, ds4-tiny when empty) on the disk dir kv
 * and wait until /health answers. */
static bool server_start(agt *t, const char *kv)
{
    const char *const args[] = {"--model", t->model[0] ? t->model : "ds4-tiny", "--ctx", "131072", "--api-key", "K1",
                                "--api-key", "K2", "--max-tokens", "64",
                                "--kv-disk-dir", kv, NULL};
    return fx_server_start(&t->s, args);
}

/* One client session: `node tests/agents/run.mjs BASE CLIENT KEY CHECK
 * PROMPT STATE`. Its output is printed when it fails (or with
 * KVT_AGENTS_VERBOSE=1), and the server log with it on failure. */
static bool session(agt *t, const char *client, const char *key, const char *expect, const char *prompt)
{
    char out[128];
    snprintf(out, sizeof out, "%s/run-%d.out", t->s.dir, ++t->n_runs);
    const char *argv[] = {"node", AGENTS_DIR "/run.mjs", t->s.base, client, key, expect, prompt, t->state, NULL};
    double t0 = fx_now();
    int st = 0;
    int ran = fx_run(argv, out, SESSION_TIMEOUT, &st);
    if (ran < 0) return false;
    if (ran == 0) printf("    %s %s %s: no exit within %d s\n", client, key, expect, SESSION_TIMEOUT);
    bool ok = ran > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
    if (!ok || fx_env_is("KVT_AGENTS_VERBOSE", "1")) {
        printf("    %s, %s, %s: %.1f s%s\n", client, key, expect, fx_now() - t0, ok ? "" : ", failed");
        fx_print_file("run.mjs", out);
    }
    if (!ok && t->s.pid) fx_print_file("server log", t->s.log);
    return ok;
}

static bool begin(agt *t)
{
    *t = (agt){0};
    const char *why = skip_reason();
    if (!why) why = ensure_clients();
    if (why) { kvt_test_skip("%s", why); return false; }
    if (!fx_tmpdir_make(&t->s, "kvtier-agents")) {
        kvt_test_fail(__FILE__, __LINE__, "mkdtemp: %s", strerror(errno));
        return false;
    }
    snprintf(t->state, sizeof t->state, "%s/state", t->s.dir);
    return true;
}

static void end(agt *t)
{
    fx_server_kill(&t->s);
    if (!t->s.dir[0]) return;
    if (fx_env_is("KVT_AGENTS_KEEP", "1")) {
        printf("    kept %s\n", t->s.dir);
        return;
    }
    if (kvt_test_failed())
        printf("    KVT_AGENTS_KEEP=1 keeps the temp dir: the client's home, every exchange "
               "(state/CLIENT/session-N.jsonl), the server logs\n");
    fx_tmpdir_remove(&t->s);
}

#define START(t, kv) CHECKF(server_start(t, kv), "kvtier serve did not come up")
#define STOP(t)                                                                                  \
    CHECKF(fx_server_stop(&(t)->s), "kvtier serve did not exit 0 within %.0f s of SIGTERM", FX_STOP_TIMEOUT)
#define SESSION(t, client, key, expect, prompt)                                                  \
    CHECKF(session(t, client, key, expect, prompt), "%s session under %s (%s) failed", client, key, expect)

/* Short prompts: the cold snapshot lies at least 32 tokens before the end of
 * a prompt, so a prompt that differs only in its last 32 tokens finds it. */
#define P1 "Say hello."
#define P2 "Name one prime."
#define P3 "Say goodbye."

static void sequence(agt *t, const char *client)
{
    char kv_a[128], kv_b[128];
    snprintf(kv_a, sizeof kv_a, "%s/kv-a", t->s.dir);
    snprintf(kv_b, sizeof kv_b, "%s/kv-b", t->s.dir);
    START(t, kv_a);
    SESSION(t, client, "K1", "cold", P1);
    SESSION(t, client, "K1", "ram", P2);
    SESSION(t, client, "K2", "isolated", P1);
    STOP(t);
    START(t, kv_b);
    SESSION(t, client, "K1", "cold", P1);
    STOP(t);
    START(t, kv_b);
    SESSION(t, client, "K2", "isolated", P1);
    SESSION(t, client, "K1", "disk", P3);
    STOP(t);
}

static void agents_test(const char *client)
{
    agt t;
    if (!begin(&t)) return;
    sequence(&t, client);
    end(&t);
}

/* ---- the families ----
 *
 * Every client on one synthetic model of each family of the llama layout
 * (tests/synth_family.h, context 131072), each with its family's own
 * vocabulary from the llama.cpp source bundle, so its chat template (picked
 * by architecture: Llama 3, Qwen 3, Gemma) has its markers as special
 * tokens: llama with llama-bpe, qwen3 with qwen2's, gemma3 (window rings)
 * with gemma-4's. The sequence is the part that depends on the model:
 *
 *   server 1, fresh disk dir:  K1 prompt 1 cold, K1 prompt 2 from RAM
 *   SIGTERM; server 2 on the same dir:  K1 prompt 3 from disk
 *
 * (the keys' isolation is the server's, tested above). The clients' system
 * prompts (Claude Code's 48,000 tokens) run through full attention on every
 * layer of llama and qwen3, so these take most of the set's time. */
static void family_test(const char *arch, const char *vocab_file, const fam_spec *f)
{
    agt t;
    if (!begin(&t)) return;
    char vocab[512];
    const char *why = NULL;
    if (!kvt_test_bundle_vocab(vocab_file, vocab, sizeof vocab, &why)) {
        end(&t);
        SKIP("%s", why);
    }
    snprintf(t.model, sizeof t.model, "%s/%s.gguf", t.s.dir, arch);
    CHECK_OK(fam_write_ctx(t.model, vocab, 17, FAM_ROPE_BASE, f, false, 131072));
    static const char *const clients[] = {"claude", "codex", "pi-chat", "pi-responses", "pi-messages"};
    for (size_t i = 0; i < sizeof clients / sizeof *clients && !kvt_test_failed(); i++) {
        char kv[160];
        snprintf(kv, sizeof kv, "%s/kv-%s", t.s.dir, clients[i]);
        double t0 = fx_now();
        START(&t, kv);
        SESSION(&t, clients[i], "K1", "cold", P1);
        /* Claude Code sends its environment as a system message after the
         * user's text, and these templates render it there: only what
         * precedes the user's text can be reused (measured: 80% of the
         * prompt on llama and qwen3; 41% on gemma3, whose template has no
         * tools and folds the system prompt into the user's turn); the
         * others reuse all but the user's text (>= 96%) */
        const char *ram = "ram", *disk = "disk";
        if (!strcmp(clients[i], "claude")) {
            ram = f->gemma ? "ram:35" : "ram:75";
            disk = f->gemma ? "disk:35" : "disk:75";
        }
        SESSION(&t, clients[i], "K1", ram, P2);
        STOP(&t);
        START(&t, kv);
        SESSION(&t, clients[i], "K1", disk, P3);
        STOP(&t);
        printf("    %s on %s: cold, RAM, disk in %.0f s\n", clients[i], arch, fx_now() - t0);
    }
    end(&t);
}

TEST(agents_family_llama)
{
    const fam_spec f = {"llama", false, false, FAM_HEAD_DIM, true, false, false};
    family_test("llama", "ggml-vocab-llama-bpe.gguf", &f);
}

TEST(agents_family_qwen3)
{
    const fam_spec f = {"qwen3", false, true, 128, false, false, false};
    family_test("qwen3", "ggml-vocab-qwen2.gguf", &f);
}

TEST(agents_family_gemma3)
{
    const fam_spec f = {"gemma3", false, true, FAM_HEAD_DIM, false, false, true};
    family_test("gemma3", "ggml-vocab-gemma-4.gguf", &f);
}

TEST(agents_claude) { agents_test("claude"); }
TEST(agents_codex) { agents_test("codex"); }
TEST(agents_pi_chat) { agents_test("pi-chat"); }
TEST(agents_pi_responses) { agents_test("pi-responses"); }
TEST(agents_pi_messages) { agents_test("pi-messages"); }
