/* End to end: `kvtier serve` over loopback, driven by real clients.
 *
 * Each test starts the built binary (KVT_BIN) as a child with its own port
 * and its own fresh --kv-disk-dir under /tmp, waits for GET /health, runs
 * one of the Node scripts in tests/e2e/ against it (the official `openai`
 * and `@anthropic-ai/sdk` clients, or raw fetch()), or curl for raw HTTP,
 * then stops it with SIGTERM the way a service manager does: the server
 * must exit 0 within 30 s with no sanitizer report in its log, and where
 * the test left a live session of at least the save policy's minimum (512
 * tokens by default), `kvtier cache ls` must then list it with reason
 * "shutdown".
 *
 *   e2e_clients        ds4-tiny: both clients, streaming and not, usage
 *                      fields, sampling parameters, stop sequences
 *   e2e_errors         ds4-tiny --strict-model: malformed and mistyped
 *                      requests, unknown model (404 only with --strict-model)
 *                      and route, error bodies in each API's shape
 *   e2e_any_model      ds4-tiny: any model id is served by default and echoed
 *                      in every API, streaming and not; the served id when
 *                      none is sent
 *   e2e_thinking       ds4-tiny: thinking mode in chat and messages, the
 *                      reasoning apart from the answer, the same streaming
 *                      or not, and accepted back in the next turn
 *   e2e_logprobs       ds4-tiny, and stories260K when present: logprobs in
 *                      chat, completions and Responses through the openai
 *                      client (shapes, streaming, 400s), and the values
 *                      checked against the logits of the same prompt run
 *                      through the library
 *   e2e_context_limit  --ctx 256: a longer prompt is a 400
 *   e2e_body_limit     --max-body-mb 1: a 2 MB body is a 413
 *   e2e_api_key        --api-key: 401 without it, 200 with either header
 *   e2e_tenant_metrics two keys and --metrics-key: /metrics needs a key and
 *                      reports that key's figures only; the metrics key
 *                      reads every key's, labelled, and nothing else
 *   e2e_tenant_keys    keys of three lengths, one a prefix of another:
 *                      prefixes, extensions and near misses are 401, each
 *                      key is its own namespace; repeated or empty keys and
 *                      a metrics key equal to an API key are usage errors
 *   e2e_tenant_disk_budget  three keys, --kv-disk-mb 1: each key's store
 *                      within a third (store stats after SIGTERM too), the
 *                      three within the total; two keys' heavy use leaves
 *                      the light key's entries whole, and they restore from
 *                      disk after a restart
 *   e2e_restart_reprefill  ds4-tiny, the default save policy: a 2,821-byte
 *                      completion and chat, a restart, the same requests:
 *                      the trim (32 tokens) prefilled again and nothing
 *                      more; after another restart a completion that
 *                      continues the first reuses as much
 *   e2e_restart_reprefill_align  the same with --kv-cache-align-tokens 128:
 *                      the saves stay on the block grid (2,688 of the
 *                      completion's 2,822 tokens)
 *   e2e_sigterm_ready  12 rounds: SIGTERM or SIGINT the moment the server
 *                      writes that it is serving; it must exit 0
 *   e2e_queue_full     --parallel 1 --queue 1: concurrent long requests meet
 *                      a 429
 *   e2e_batch_same_ds4, e2e_batch_same_stories  requests alone, then again
 *                      inside batches of up to 8 random others on a fresh
 *                      server (--parallel 8): the same text, tokens and
 *                      logprobs to the bit (tests/e2e/batch.mjs)
 *   e2e_batch_draft_ds4, e2e_batch_draft_stories  the same, alone on a
 *                      server with --draft none, batched on one with
 *                      --draft ngram: speculation inside the batches
 *                      changes no bit (on main, without --draft, the
 *                      server does not start)
 *   e2e_batch_cancel_fair  ds4-mini: clients that hang up mid-prefill and
 *                      mid-reply free their slots; with two keys and
 *                      --parallel 1 one key's burst does not hold the
 *                      other's request behind all of it
 *   e2e_tiers_stories  stories260K (a trained model: its text depends on
 *                      the whole prompt): cold, RAM and disk give equal text;
 *                      skipped without ../shared/models/stories260K.gguf
 *   e2e_tiers_gemma3   the synthetic gemma3 (window rings and full rows): the
 *                      same phases, the restarted server reusing its prefix
 *                      from disk; skipped without ../shared/vocab
 *   e2e_agent_tiers    ds4-mini, a 25,000-token system prompt: cold turn,
 *                      RAM turn, restart, disk turn, and a cold server, with
 *                      X-KVTier-Cache, usage and /metrics
 *   e2e_agent_prefill  ds4-mini: SSE comments during a long prefill, and a
 *                      client that goes away cancels it
 *
 * Requirements: node on PATH (the tests skip without it) and the packages
 * of tests/e2e/package-lock.json, installed with `npm ci` on first use when
 * tests/e2e/node_modules lacks them; curl. Run from the repository root.
 *
 * Environment:
 *   KVT_E2E=0          skip every e2e test
 *   KVT_E2E_AGENT=0|1  skip / run the two ds4-mini agent tests. By default
 *                      they are skipped when KVT_BIN's path contains "asan"
 *                      (`make asan`: ~10x slower, and their 25,000-token
 *                      prefills would take minutes)
 *   KVT_E2E_VERBOSE=1  print the scripts' output when they pass too
 *
 * The whole set takes 60 to 90 s on 2 cores, most of it the two cold
 * 25,000-token and the two 20,000-token ds4-mini prefills (one of those is
 * cancelled after a second); without the agent tests it takes about 10 s. */
#include "serve/api.h"
#include "fixture.h"
#include "arch/model.h"
#include "synth_family.h"
#include "test.h"
#include "text/tokenizer.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <dirent.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <xxhash.h>
#include <time.h>
#include <unistd.h>

#define E2E_DIR "tests/e2e"
#define STORIES "models/stories260K.gguf"

/* ---- the test's world: a temp dir, at most one server, its files ---- */

typedef struct e2e {
    fx_server s;             /* s.dir: /tmp/kvtier-e2e-XXXXXX, removed at the end */
    char kv[96];             /* s.dir/kv: the server's --kv-disk-dir */
    int n_runs;
} e2e;

/* Why the e2e tests cannot run here (NULL: they can). */
static const char *skip_reason(bool agent)
{
    if (fx_env_is("KVT_E2E", "0")) return "KVT_E2E=0";
    if (system("command -v node >/dev/null 2>&1") != 0) return "node is not on PATH";
    if (system("command -v curl >/dev/null 2>&1") != 0) return "curl is not on PATH";
    if (access(E2E_DIR "/package.json", R_OK) != 0) return "run from the repository root (" E2E_DIR " not found)";
    if (access(kvt_test_bin(), X_OK) != 0) return "the kvtier binary is not built";
    if (agent) {
        if (fx_env_is("KVT_E2E_AGENT", "0")) return "KVT_E2E_AGENT=0";
        if (!fx_env_is("KVT_E2E_AGENT", "1") && strstr(kvt_test_bin(), "asan"))
            return "ds4-mini agent session under a sanitizer build (KVT_E2E_AGENT=1 forces it)";
    }
    return NULL;
}

/* Install the Node packages when they are missing. An exclusive lock on
 * package.json keeps two test runs from installing at once. */
static bool ensure_deps(void)
{
    static bool done;
    if (done) return true;
    int fd = open(E2E_DIR "/package.json", O_RDONLY);
    if (fd < 0) return false;
    flock(fd, LOCK_EX);
    bool ok = access(E2E_DIR "/node_modules/openai/package.json", R_OK) == 0 &&
              access(E2E_DIR "/node_modules/@anthropic-ai/sdk/package.json", R_OK) == 0;
    if (!ok) ok = fx_npm_ci(E2E_DIR, "kvtier-e2e", "Node packages");
    flock(fd, LOCK_UN);
    close(fd);
    done = ok;
    return ok;
}

/* The HTTP status of a curl request (args: shell words, already quoted as
 * needed), its body written to dir/curl.out and its headers to
 * dir/curl.hdr; -1 when curl could not connect. */
static int curl(e2e *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int curl(e2e *t, const char *fmt, ...)
{
    char args[2048], cmd[2600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "curl -s -o %s/curl.out -D %s/curl.hdr -w '%%{http_code}' --max-time 60 %s",
             t->s.dir, t->s.dir, args);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    char code[16] = {0};
    size_t n = fread(code, 1, sizeof code - 1, f);
    code[n] = 0;
    pclose(f);
    int c = atoi(code);
    return c > 0 ? c : -1;
}

/* The body or headers of the last curl() (malloc'ed; "" when unreadable). */
static char *curl_file(e2e *t, const char *which)
{
    char path[128];
    snprintf(path, sizeof path, "%s/curl.%s", t->s.dir, which);
    char *s = kvt_test_read_file(path, NULL);
    return s ? s : calloc(1, 1);
}

/* SIGTERM (fx_server_stop); and a clean exit must leave no sanitizer
 * report in the server log. */
static bool server_stop(e2e *t)
{
    if (!fx_server_stop(&t->s)) return false;
    /* a sanitizer build reports and usually exits non-zero; say why */
    char *log = kvt_test_read_file(t->s.log, NULL);
    bool ok = !(log && (strstr(log, "Sanitizer") || strstr(log, "runtime error")));
    free(log);
    if (!ok) {
        printf("    the server log holds a sanitizer report\n");
        fx_print_file("server log", t->s.log);
    }
    return ok;
}

/* `node tests/e2e/SCRIPT base args...` (args NULL-terminated); its output
 * is printed when it fails (or with KVT_E2E_VERBOSE=1). */
static bool node_run(e2e *t, const char *script, const char *const *args, double timeout)
{
    char path[128], out[128];
    snprintf(path, sizeof path, E2E_DIR "/%s", script);
    snprintf(out, sizeof out, "%s/node-%d.out", t->s.dir, ++t->n_runs);
    const char *argv[16] = {"node", path, t->s.base};
    size_t n = 3;
    for (size_t i = 0; args && args[i] && n + 1 < sizeof argv / sizeof argv[0]; i++) argv[n++] = args[i];
    argv[n] = NULL;
    int st = 0;
    int ran = fx_run(argv, out, timeout, &st);
    if (ran < 0) return false;
    if (ran == 0)
        printf("    node %s %s: no exit within %.0f s\n", script, args && args[0] ? args[0] : "", timeout);
    bool ok = ran > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
    if (!ok || fx_env_is("KVT_E2E_VERBOSE", "1")) {
        if (!ok && ran > 0)
            printf("    node %s %s: exit status %d\n", script, args && args[0] ? args[0] : "",
                   WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
        fx_print_file(script, out);
    }
    if (!ok && t->s.pid) fx_print_file("server log", t->s.log);
    return ok;
}

/* `KVT_BIN cache ls --kv-disk-dir DIR` (malloc'ed; NULL on failure). */
static char *cache_ls(e2e *t, const char *kv)
{
    char cmd[512], path[128];
    snprintf(path, sizeof path, "%s/cache-ls.out", t->s.dir);
    snprintf(cmd, sizeof cmd, "'%s' cache ls --kv-disk-dir '%s' >%s 2>&1", kvt_test_bin(), kv, path);
    if (system(cmd) != 0) { fx_print_file("cache ls", path); return NULL; }
    return kvt_test_read_file(path, NULL);
}

/* An entry of `cache ls` with this reason (the REASON column). */
static bool has_reason(const char *ls, const char *reason)
{
    char word[32];
    snprintf(word, sizeof word, " %s ", reason);
    return ls && strstr(ls, word);
}

static bool e2e_begin(e2e *t, bool agent)
{
    *t = (e2e){0};
    const char *why = skip_reason(agent);
    if (why) { kvt_test_skip("%s", why); return false; }
    if (!fx_tmpdir_make(&t->s, "kvtier-e2e")) {
        kvt_test_fail(__FILE__, __LINE__, "mkdtemp: %s", strerror(errno));
        return false;
    }
    snprintf(t->kv, sizeof t->kv, "%s/kv", t->s.dir);
    if (!ensure_deps()) {
        kvt_test_fail(__FILE__, __LINE__, "npm ci --prefix " E2E_DIR " failed (see above)");
        fx_tmpdir_remove(&t->s);
        return false;
    }
    return true;
}

/* Kill a server a failed check left running; remove the temp dir. */
static void e2e_end(e2e *t)
{
    fx_server_kill(&t->s);
    fx_tmpdir_remove(&t->s);
}

#define START(t, ...)                                                       \
    do {                                                                    \
        const char *const a_[] = {__VA_ARGS__, NULL};                       \
        CHECKF(fx_server_start(&(t)->s, a_), "kvtier serve did not come up"); \
    } while (0)

#define NODE(t, timeout, script, ...)                                       \
    do {                                                                    \
        const char *const a_[] = {__VA_ARGS__, NULL};                       \
        CHECKF(node_run(t, script, a_, timeout), "node %s failed", script); \
    } while (0)

#define STOP(t) CHECKF(server_stop(t), "kvtier serve did not exit 0 within %.0f s of SIGTERM", FX_STOP_TIMEOUT)

/* A live session of 600 prompt tokens, enough for a shutdown save (the
 * save policy's minimum is 512). ds4 presets: one token per byte. */
static void long_session(e2e *t)
{
    char path[128];
    snprintf(path, sizeof path, "%s/long.json", t->s.dir);
    FILE *f = fopen(path, "w");
    CHECK(f);
    fputs("{\"prompt\":\"", f);
    for (int i = 0; i < 600; i++) fputc("abcdefghijklmnopqrstuvwxyz 0123456789"[i * 7 % 37], f);
    fputs("\",\"max_tokens\":1,\"temperature\":0}", f);
    fclose(f);
    int code = curl(t, "-H 'content-type: application/json' --data-binary @%s %s/v1/completions", path, t->s.base);
    char *body = curl_file(t, "out");
    CHECKF(code == 200, "600-token completion: HTTP %d %.300s", code, body);
    free(body);
}

/* Stop the server and require a "shutdown" entry in its disk tier. */
static void stop_expect_shutdown_save(e2e *t)
{
    STOP(t);
    char *ls = cache_ls(t, t->kv);
    if (!has_reason(ls, "shutdown")) printf("    cache ls:\n%s\n", ls ? ls : "(failed)");
    CHECKF(has_reason(ls, "shutdown"), "no snapshot with reason shutdown after SIGTERM");
    free(ls);
}

/* ---- the tests ---- */

static void clients(e2e *t)
{
    START(t, "--model", "ds4-tiny", "--kv-disk-dir", t->kv);
    NODE(t, 300, "clients.mjs", "ds4-tiny");
    long_session(t);
    if (kvt_test_failed()) return;
    stop_expect_shutdown_save(t);
}

TEST(e2e_clients)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    clients(&t);
    e2e_end(&t);
}

static void errors(e2e *t)
{
    START(t, "--model", "ds4-tiny", "--kv-disk-dir", t->kv, "--strict-model");
    NODE(t, 300, "errors.mjs", "basic");
    /* the same cases as raw HTTP */
    const char *json = "-H 'content-type: application/json'";
    int code = curl(t, "%s -d '{\"messages\": [' %s/v1/chat/completions", json, t->s.base);
    char *body = curl_file(t, "out");
    CHECKF(code == 400 && strstr(body, "{\"error\":{\"message\":"), "curl, malformed JSON on chat: %d %s", code, body);
    free(body);
    code = curl(t, "%s -d '{\"messages\": [' %s/v1/messages", json, t->s.base);
    body = curl_file(t, "out");
    CHECKF(code == 400 && strstr(body, "{\"type\":\"error\",\"error\":{"), "curl, malformed JSON on messages: %d %s",
           code, body);
    free(body);
    code = curl(t, "%s -d '{\"messages\":\"hi\"}' %s/v1/chat/completions", json, t->s.base);
    CHECKF(code == 400, "curl, messages not an array: %d", code);
    code = curl(t, "%s -d '{\"max_tokens\":\"abc\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}' %s/v1/messages",
                json, t->s.base);
    CHECKF(code == 400, "curl, max_tokens \"abc\": %d", code);
    code = curl(t, "%s -d '{\"model\":\"nope\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}' %s/v1/chat/completions",
                json, t->s.base);
    CHECKF(code == 404, "curl, unknown model with --strict-model: %d", code);
    code = curl(t, "%s -d '{\"model\":\"ds4-tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                "\"max_tokens\":1}' %s/v1/chat/completions", json, t->s.base);
    CHECKF(code == 200, "curl, the served id with --strict-model: %d", code);
    code = curl(t, "%s -d '{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,"
                "\"top_logprobs\":21}' %s/v1/chat/completions", json, t->s.base);
    body = curl_file(t, "out");
    CHECKF(code == 400 && strstr(body, "\"type\":\"invalid_request_error\"") && strstr(body, "top_logprobs"),
           "curl, top_logprobs 21: %d %s", code, body);
    free(body);
    code = curl(t, "%s -d '{\"prompt\":\"x\",\"logprobs\":6}' %s/v1/completions", json, t->s.base);
    body = curl_file(t, "out");
    CHECKF(code == 400 && strstr(body, "\"type\":\"invalid_request_error\"") && strstr(body, "logprobs"),
           "curl, completions logprobs 6: %d %s", code, body);
    free(body);
    CHECKF(fx_health_ok(&t->s), "/health after the errors");
    long_session(t);
    if (kvt_test_failed()) return;
    stop_expect_shutdown_save(t);
}

TEST(e2e_errors)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    errors(&t);
    e2e_end(&t);
}

/* Any model id, by default: served, and echoed in the body (every chunk and
 * event of a stream too); the served id when the request names none. */
static void any_model(e2e *t)
{
    START(t, "--model", "ds4-tiny", "--kv-disk-dir", t->kv);
    static const struct { const char *path, *body, *want; } cases[] = {
        {"/v1/chat/completions", "{\"model\":\"gpt-4o-mini\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                                 "\"max_tokens\":2}", "\"model\":\"gpt-4o-mini\""},
        {"/v1/chat/completions", "{\"model\":\"gpt-4o-mini\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                                 "\"max_tokens\":2,\"stream\":true}", "\"model\":\"gpt-4o-mini\""},
        {"/v1/completions", "{\"model\":\"davinci-002\",\"prompt\":\"x\",\"max_tokens\":2}", "\"model\":\"davinci-002\""},
        {"/v1/completions", "{\"model\":\"davinci-002\",\"prompt\":\"x\",\"max_tokens\":2,\"stream\":true}",
         "\"model\":\"davinci-002\""},
        {"/v1/messages", "{\"model\":\"claude-opus-4-1\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                         "\"max_tokens\":2}", "\"model\":\"claude-opus-4-1\""},
        {"/v1/messages", "{\"model\":\"claude-opus-4-1\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                         "\"max_tokens\":2,\"stream\":true}", "\"model\":\"claude-opus-4-1\""},
        {"/v1/responses", "{\"model\":\"gpt-5-codex\",\"input\":\"x\",\"max_output_tokens\":2}", "\"model\":\"gpt-5-codex\""},
        {"/v1/responses", "{\"model\":\"gpt-5-codex\",\"input\":\"x\",\"max_output_tokens\":2,\"stream\":true}",
         "\"model\":\"gpt-5-codex\""},
        {"/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":2}",
         "\"model\":\"ds4-tiny\""},
        {"/v1/messages", "{\"model\":\"\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":2}",
         "\"model\":\"ds4-tiny\""},
    };
    char path[128];
    snprintf(path, sizeof path, "%s/req.json", t->s.dir);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        FILE *f = fopen(path, "w");
        CHECK(f);
        fputs(cases[i].body, f);
        fclose(f);
        int code = curl(t, "-H 'content-type: application/json' --data-binary @%s %s%s", path, t->s.base,
                        cases[i].path);
        char *body = curl_file(t, "out");
        /* every "model" in the body or stream is the one expected */
        size_t seen = 0, other = 0;
        for (const char *p = strstr(body, "\"model\":"); p; p = strstr(p + 1, "\"model\":"))
            strncmp(p, cases[i].want, strlen(cases[i].want)) ? other++ : seen++;
        CHECKF(code == 200 && seen >= 1 && !other, "%s %s: HTTP %d, %zu \"model\" as expected, %zu others: %.400s",
               cases[i].path, cases[i].body, code, seen, other, body);
        free(body);
    }
    STOP(t);
}

TEST(e2e_any_model)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    any_model(&t);
    e2e_end(&t);
}

/* ---- thinking mode ---- */

/* A reply's two parts, as a client gets them. */
typedef struct think_reply {
    char reasoning[8192], answer[8192];
    long long reasoning_tokens;  /* chat usage.completion_tokens_details; -1 when absent */
} think_reply;

/* v is a string equal to s. */
static bool jstr_is(const json_t *v, const char *s)
{
    return json_is_string(v) && !strcmp(json_string_value(v), s);
}

static bool add_text(char *buf, const char *s)
{
    size_t a = strlen(buf), b = s ? strlen(s) : 0;
    if (a + b >= sizeof ((think_reply *)0)->reasoning) return false;
    memcpy(buf + a, s ? s : "", b + 1);
    return true;
}

/* One chat or messages request (the body in dir/req.json): the reasoning
 * and the answer of the reply, from the body or joined from the stream's
 * events, which must put every reasoning piece before the first answer
 * piece (Anthropic: the thinking block at index 0, closed before the text
 * block opens at 1). */
static bool think_request(e2e *t, kvt_api api, const char *body, bool stream, think_reply *out)
{
    char path[128];
    snprintf(path, sizeof path, "%s/req.json", t->s.dir);
    FILE *f = fopen(path, "w");
    if (!f) return false;
    fputs(body, f);
    fclose(f);
    int code = curl(t, "-H 'content-type: application/json' --data-binary @%s %s%s", path, t->s.base,
                    api == KVT_API_CHAT ? "/v1/chat/completions" : "/v1/messages");
    char *txt = curl_file(t, "out");
    *out = (think_reply){.reasoning_tokens = -1};
    bool ok = code == 200;
    if (ok && !stream) {
        json_t *j = json_loads(txt, 0, NULL), *c = json_object_get(j, "content");
        if (api == KVT_API_CHAT) {
            json_t *msg = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
            ok = json_is_string(json_object_get(msg, "reasoning_content")) &&
                 add_text(out->reasoning, json_string_value(json_object_get(msg, "reasoning_content"))) &&
                 add_text(out->answer, json_string_value(json_object_get(msg, "content")));
            json_t *d = json_object_get(json_object_get(json_object_get(j, "usage"), "completion_tokens_details"),
                                        "reasoning_tokens");
            if (json_is_integer(d)) out->reasoning_tokens = json_integer_value(d);
        } else {
            json_t *b0 = json_array_get(c, 0), *b1 = json_array_get(c, 1);
            ok = json_array_size(c) == 2 && jstr_is(json_object_get(b0, "type"), "thinking") &&
                 json_is_string(json_object_get(b0, "signature")) && jstr_is(json_object_get(b1, "type"), "text") &&
                 add_text(out->reasoning, json_string_value(json_object_get(b0, "thinking"))) &&
                 add_text(out->answer, json_string_value(json_object_get(b1, "text")));
        }
        json_decref(j);
    }
    /* the stream: "event: X" (Anthropic) and "data: {...}" lines */
    bool answering = false;
    long long open = -1, next = 0;
    char event[64] = "";
    for (char *line = stream ? txt : NULL, *nl; ok && line && *line; line = nl ? nl + 1 : NULL) {
        nl = strchr(line, '\n');
        if (nl) *nl = 0;
        if (!strncmp(line, "event: ", 7)) snprintf(event, sizeof event, "%s", line + 7);
        if (strncmp(line, "data: ", 6) || !strcmp(line, "data: [DONE]")) continue;
        json_t *d = json_loads(line + 6, 0, NULL);
        ok = d != NULL;
        if (ok && api == KVT_API_CHAT) {
            json_t *delta = json_object_get(json_array_get(json_object_get(d, "choices"), 0), "delta");
            const char *rc = json_string_value(json_object_get(delta, "reasoning_content"));
            const char *cc = json_string_value(json_object_get(delta, "content"));
            if (rc) ok = !answering && add_text(out->reasoning, rc);
            if (cc && *cc) {
                ok = ok && add_text(out->answer, cc);
                answering = true;
            }
            json_t *rt = json_object_get(json_object_get(json_object_get(d, "usage"), "completion_tokens_details"),
                                         "reasoning_tokens");
            if (json_is_integer(rt)) out->reasoning_tokens = json_integer_value(rt);
        } else if (ok) {
            long long index = json_integer_value(json_object_get(d, "index"));
            json_t *blk = json_object_get(d, "content_block"), *delta = json_object_get(d, "delta");
            json_t *bt = json_object_get(blk, "type"), *dt = json_object_get(delta, "type");
            if (!strcmp(event, "content_block_start")) {
                ok = open < 0 && index == next++ &&
                     jstr_is(bt, index == 0 ? "thinking" : index == 1 ? "text" : "tool_use");
                open = index;
            } else if (!strcmp(event, "content_block_stop")) {
                ok = index == open;
                open = -1;
            } else if (!strcmp(event, "content_block_delta")) {
                /* the reasoning in the thinking block, the answer in the text block */
                const char *piece = json_string_value(json_object_get(delta, index == 0 ? "thinking" : "text"));
                ok = index == open;
                if (ok && index == 0) ok = jstr_is(dt, "thinking_delta") && add_text(out->reasoning, piece);
                if (ok && index == 1) ok = jstr_is(dt, "text_delta") && add_text(out->answer, piece);
            }
        }
        json_decref(d);
    }
    if (!ok) printf("    %s%s: HTTP %d %.600s\n", api == KVT_API_CHAT ? "chat" : "messages", stream ? ", stream" : "",
                    code, txt);
    free(txt);
    return ok && (api == KVT_API_CHAT || !stream || next >= 2);
}

/* Thinking mode through the server: the generated reasoning goes out apart
 * from the answer, the same streaming or not (greedy), its tokens counted,
 * and it is accepted back in the next turn. The random ds4-tiny writes no
 * </think> in a few tokens (greedy, so always the same reply), so the reply
 * is all reasoning cut by max_tokens: what this exercises is the server's
 * search for </think> as the text grows, its reasoning pieces and the end
 * of a reply cut inside its reasoning. The answer goes out through the
 * ordinary text path, which every other test streams; tests/test_api_thinking.c
 * checks the split itself. */
static void thinking(e2e *t)
{
    START(t, "--model", "ds4-tiny", "--kv-disk-dir", t->kv);
    static const struct { kvt_api api; const char *body; } cases[] = {
        {KVT_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"Think about rivers.\"}],\"max_tokens\":16,"
                       "\"temperature\":0,\"chat_template_kwargs\":{\"thinking\":true},\"stream_options\":"
                       "{\"include_usage\":true}"},
        {KVT_API_MESSAGES, "{\"messages\":[{\"role\":\"user\",\"content\":\"Think about rivers.\"}],\"max_tokens\":16,"
                           "\"temperature\":0,\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":1024}"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char body[512];
        static think_reply a, b;
        snprintf(body, sizeof body, "%s}", cases[i].body);
        bool ok = think_request(t, cases[i].api, body, false, &a);
        snprintf(body, sizeof body, "%s,\"stream\":true}", cases[i].body);
        ok = ok && think_request(t, cases[i].api, body, true, &b);
        CHECKF(ok, "case %zu: a thinking reply in the wrong shape", i);
        CHECKF(a.reasoning[0] && !strcmp(a.reasoning, b.reasoning) && !strcmp(a.answer, b.answer),
               "case %zu: the stream differs from the body: '%s' '%s' / '%s' '%s'", i, a.reasoning, a.answer,
               b.reasoning, b.answer);
        if (cases[i].api == KVT_API_CHAT)
            CHECKF(a.reasoning_tokens >= 1 && a.reasoning_tokens <= 16 && a.reasoning_tokens == b.reasoning_tokens,
                   "reasoning_tokens %lld, streamed %lld", a.reasoning_tokens, b.reasoning_tokens);
        /* the reasoning sent back with the turn is accepted where it was sent */
        json_t *req = json_loads(body, 0, NULL), *msgs = json_object_get(req, "messages");
        if (cases[i].api == KVT_API_CHAT)
            json_array_append_new(msgs, json_pack("{s:s, s:s, s:s}", "role", "assistant", "content", a.answer,
                                                  "reasoning_content", a.reasoning));
        else
            json_array_append_new(msgs, json_pack("{s:s, s:[{s:s, s:s, s:s}, {s:s, s:s}]}", "role", "assistant",
                                                  "content", "type", "thinking", "thinking", a.reasoning, "signature",
                                                  "", "type", "text", "text", a.answer));
        json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", "And lakes?"));
        char *next = json_dumps(req, JSON_COMPACT);
        json_decref(req);
        ok = next && think_request(t, cases[i].api, next, true, &b);
        free(next);
        CHECKF(ok, "case %zu: the next turn, with the reasoning sent back", i);
    }
    STOP(t);
}

TEST(e2e_thinking)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    thinking(&t);
    e2e_end(&t);
}

/* ---- log-probabilities against the model's own logits ---- */

/* The server computes each log-probability in double from the float logits
 * it sampled from, and jansson writes it with 17 significant digits, which
 * parses back as the same double. The reference here is long double over
 * the same logits (bit-identical: same model, same prompt tokens; the
 * engine's logits do not depend on chunking, threads or reuse). The two
 * differ only by double rounding in one sum of n_vocab exponentials, a log
 * and a subtraction: relative 1e-16 per step on values below ~100, far
 * under 1e-12. A value from other logits (another position, after a
 * temperature) or computed in float (errors near 1e-7) misses it by
 * orders of magnitude. */
#define LP_TOL 1e-12

typedef struct rep_tok { char b[96]; size_t len; double lp; } rep_tok;
typedef struct rep { rep_tok t; rep_tok top[KVT_API_MAX_TOP_LOGPROBS]; size_t n_top; } rep;

static bool rep_bytes(const json_t *arr, rep_tok *o)
{
    if (!json_is_array(arr) || json_array_size(arr) > sizeof o->b) return false;
    o->len = json_array_size(arr);
    for (size_t i = 0; i < o->len; i++) {
        json_t *v = json_array_get(arr, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 255) return false;
        o->b[i] = (char)json_integer_value(v);
    }
    return true;
}

/* {token, logprob, bytes}: the bytes and the value */
static bool rep_entry(const json_t *e, rep_tok *o)
{
    json_t *lp = json_object_get(e, "logprob");
    if (!json_is_number(lp)) return false;
    o->lp = json_number_value(lp);
    return rep_bytes(json_object_get(e, "bytes"), o);
}

/* A legacy token text back to bytes: OpenAI's "bytes:\xNN..." spelling, or
 * the text itself. */
static bool rep_text(const char *s, size_t n, rep_tok *o)
{
    if (n >= 6 && !memcmp(s, "bytes:", 6)) {
        o->len = 0;
        for (size_t i = 6; i + 4 <= n; i += 4) {
            unsigned x;
            if (s[i] != '\\' || s[i + 1] != 'x' || sscanf(s + i + 2, "%2x", &x) != 1 || o->len == sizeof o->b)
                return false;
            o->b[o->len++] = (char)x;
        }
        return true;
    }
    if (n > sizeof o->b) return false;
    memcpy(o->b, s, n);
    o->len = n;
    return true;
}

/* The reported tokens of a response body (chat, completions or Responses,
 * per api) into reps (at most max); -1 when it is not the documented shape. */
static int rep_parse(kvt_api api, const json_t *j, rep *reps, size_t max)
{
    if (api == KVT_API_COMPLETIONS) {
        json_t *lp = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs");
        json_t *toks = json_object_get(lp, "tokens"), *vals = json_object_get(lp, "token_logprobs"),
               *tops = json_object_get(lp, "top_logprobs");
        size_t n = json_array_size(toks);
        if (!json_is_array(toks) || n > max || json_array_size(vals) != n || json_array_size(tops) != n) return -1;
        for (size_t i = 0; i < n; i++) {
            json_t *tk = json_array_get(toks, i), *v = json_array_get(vals, i), *top = json_array_get(tops, i);
            if (!json_is_string(tk) || !json_is_number(v) || !json_is_object(top) ||
                !rep_text(json_string_value(tk), json_string_length(tk), &reps[i].t) ||
                json_object_size(top) > KVT_API_MAX_TOP_LOGPROBS)
                return -1;
            reps[i].t.lp = json_number_value(v);
            reps[i].n_top = 0;
            const char *key;
            size_t klen;
            json_t *a;
            json_object_keylen_foreach(top, key, klen, a) {
                rep_tok *o = &reps[i].top[reps[i].n_top++];
                if (!json_is_number(a) || !rep_text(key, klen, o)) return -1;
                o->lp = json_number_value(a);
            }
        }
        return (int)n;
    }
    json_t *list = api == KVT_API_CHAT
                       ? json_object_get(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs"),
                                         "content")
                       : json_object_get(json_array_get(json_object_get(json_array_get(json_object_get(j, "output"), 0),
                                                                        "content"),
                                                        0),
                                         "logprobs");
    size_t n = json_array_size(list);
    if (!json_is_array(list) || n > max) return -1;
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(list, i), *top = json_object_get(e, "top_logprobs");
        if (!rep_entry(e, &reps[i].t) || !json_is_array(top) || json_array_size(top) > KVT_API_MAX_TOP_LOGPROBS)
            return -1;
        reps[i].n_top = json_array_size(top);
        for (size_t k = 0; k < reps[i].n_top; k++)
            if (!rep_entry(json_array_get(top, k), &reps[i].top[k])) return -1;
    }
    return (int)n;
}

static bool piece_is(const kvt_model *m, int32_t id, const rep_tok *r)
{
    const char *p;
    size_t pl;
    return kvt_token_piece(m, id, &p, &pl) == KVT_OK && pl == r->len && !memcmp(p, r->b, pl);
}

/* Walk the reported tokens through a session of m holding the request's
 * prompt (rendered by api.c and tokenized as the server does): at every
 * position the sampled token's value and the alternatives must be the
 * log-softmax of the session's logits, the alternatives the k most likely
 * (score descending, lower id first; any order for the legacy object, whose
 * keys are unordered), and greedy sampling must have taken the most
 * likely. Then the sampled token is decoded, as the server did. */
static bool check_values(kvt_model *m, kvt_api api, const char *body, const rep *reps, size_t n, size_t k,
                         bool greedy, long long prompt_tokens)
{
    kvt_request rq;
    int st;
    int32_t *toks = NULL;
    size_t nt = 0;
    kvt_session *s = NULL;
    bool ok = kvt_request_parse(&rq, api, body, strlen(body), m, &st) == KVT_OK;
    if (!ok) printf("    the request does not parse: %s\n", kvt_errmsg());
    ok = ok && kvt_tokenizer_encode(m->tok, rq.prompt, rq.prompt_len, rq.prompt_has_bos ? false : m->info.add_bos,
                                    rq.prompt_has_bos, &toks, &nt) == KVT_OK;
    if (ok && (long long)nt != prompt_tokens) {
        printf("    %zu prompt tokens here, %lld in the response's usage\n", nt, prompt_tokens);
        ok = false;
    }
    ok = ok && kvt_session_new(&s, m, NULL) == KVT_OK && kvt_session_sync(s, toks, nt, NULL) == KVT_OK;
    uint32_t V = m->info.n_vocab;
    int32_t best[KVT_API_MAX_TOP_LOGPROBS];
    double worst = 0;
    for (size_t i = 0; ok && i < n; i++) {
        const float *lg = kvt_session_logits(s);
        long double mx = -INFINITY, sum = 0;
        for (uint32_t v = 0; v < V; v++)
            if (lg[v] > mx) mx = lg[v];
        for (uint32_t v = 0; v < V; v++) sum += expl((long double)lg[v] - mx);
        long double lse = mx + logl(sum);
        /* the k best: score descending, lower id first */
        for (size_t q = 0; q < k; q++) {
            int32_t b = -1;
            for (uint32_t v = 0; v < V; v++) {
                bool taken = false;
                for (size_t u = 0; u < q; u++) taken |= best[u] == (int32_t)v;
                if (!taken && (b < 0 || lg[v] > lg[b])) b = (int32_t)v;
            }
            best[q] = b;
        }
        /* the sampled id: of the ids with its bytes, the one whose value it is */
        int32_t id = -1;
        for (uint32_t v = 0; v < V; v++)
            if (piece_is(m, (int32_t)v, &reps[i].t) &&
                (id < 0 || fabsl(lg[v] - lse - reps[i].t.lp) < fabsl(lg[id] - lse - reps[i].t.lp)))
                id = (int32_t)v;
        double d = id < 0 ? INFINITY : (double)fabsl((long double)lg[id] - lse - reps[i].t.lp);
        if (d > worst) worst = d;
        if (!(d <= LP_TOL)) {
            printf("    position %zu: token %d logprob %.17g, the logits give %.17Lg\n", i, id, reps[i].t.lp,
                   id < 0 ? 0.0L : (long double)lg[id] - lse);
            ok = false;
        }
        if (ok && greedy && k && id != best[0]) {
            printf("    position %zu: greedy sampled %d, the most likely is %d\n", i, id, best[0]);
            ok = false;
        }
        if (ok && (reps[i].n_top > k || (api != KVT_API_COMPLETIONS && reps[i].n_top != k))) {
            printf("    position %zu: %zu alternatives, %zu asked for\n", i, reps[i].n_top, k);
            ok = false;
        }
        for (size_t q = 0; ok && q < reps[i].n_top; q++) {
            const rep_tok *a = &reps[i].top[q];
            size_t at = q;
            if (api == KVT_API_COMPLETIONS) /* keyed by text: the first of the best with these bytes */
                for (at = 0; at < k && !piece_is(m, best[at], a); at++) {}
            long double want = at < k ? (long double)lg[best[at]] - lse : 0;
            d = at < k && piece_is(m, best[at], a) ? (double)fabsl(want - a->lp) : INFINITY;
            if (d > worst) worst = d;
            if (!(d <= LP_TOL)) {
                printf("    position %zu, alternative %zu ('%.*s'): logprob %.17g, the logits give %.17Lg (id %d)\n",
                       i, q, (int)a->len, a->b, a->lp, want, at < k ? best[at] : -1);
                ok = false;
            }
        }
        ok = ok && kvt_session_decode(s, id) == KVT_OK;
    }
    if (ok) printf("    %zu positions x %zu alternatives: largest difference %.3g\n", n, k, worst);
    kvt_session_free(s);
    free(toks);
    kvt_request_free(&rq);
    return ok;
}

/* One request over HTTP, then its values against the logits. */
static void logprob_values(e2e *t, kvt_model *m, kvt_api api, const char *body, size_t k, bool greedy)
{
    static const char *const paths[] = {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"};
    char path[128];
    snprintf(path, sizeof path, "%s/req.json", t->s.dir);
    FILE *f = fopen(path, "w");
    CHECK(f);
    fputs(body, f);
    fclose(f);
    int code = curl(t, "-H 'content-type: application/json' --data-binary @%s %s%s", path, t->s.base, paths[api]);
    char *out = curl_file(t, "out");
    /* a token may be a NUL byte: "\u0000" in its "token" string */
    json_t *j = json_loads(out, JSON_ALLOW_NUL, NULL);
    CHECKF(code == 200 && j, "%s %s: HTTP %d %.300s", paths[api], body, code, out);
    free(out);
    static rep reps[64];
    int n = rep_parse(api, j, reps, 64);
    json_t *u = json_object_get(j, "usage");
    long long prompt = json_integer_value(json_object_get(u, api == KVT_API_RESPONSES ? "input_tokens" : "prompt_tokens"));
    long long completion =
        json_integer_value(json_object_get(u, api == KVT_API_RESPONSES ? "output_tokens" : "completion_tokens"));
    json_decref(j);
    CHECKF(n > 0 && n == completion, "%s %s: %d tokens reported, %lld generated", paths[api], body, n, completion);
    printf("    %s, %s%zu alternatives:\n", paths[api], greedy ? "greedy, " : "sampled, ", k);
    CHECKF(check_values(m, api, body, reps, (size_t)n, k, greedy, prompt), "%s %s: the values are not the model's",
           paths[api], body);
}

/* served: the id the server reports (NULL: logprobs.mjs asks /v1/models) */
static void logprobs(e2e *t, const char *model, const char *served)
{
    START(t, "--model", model, "--kv-disk-dir", t->kv);
    printf("    %s\n", strrchr(model, '/') ? strrchr(model, '/') + 1 : model);
    NODE(t, 300, "logprobs.mjs", served);
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_open(&m, model));
    logprob_values(t, m, KVT_API_CHAT,
                   "{\"messages\":[{\"role\":\"user\",\"content\":\"Write one line about rivers.\"}],"
                   "\"max_tokens\":8,\"temperature\":0,\"logprobs\":true,\"top_logprobs\":5}", 5, true);
    /* sampled hot and narrow: the values are still the model's own */
    if (!kvt_test_failed())
        logprob_values(t, m, KVT_API_CHAT,
                       "{\"messages\":[{\"role\":\"user\",\"content\":\"Tell a story.\"}],\"max_tokens\":8,"
                       "\"temperature\":1.5,\"top_p\":0.5,\"seed\":3,\"logprobs\":true,\"top_logprobs\":3}", 3, false);
    if (!kvt_test_failed())
        logprob_values(t, m, KVT_API_COMPLETIONS,
                       "{\"prompt\":\"Once upon a time, the river\",\"max_tokens\":8,\"temperature\":0,\"logprobs\":5}",
                       5, true);
    if (!kvt_test_failed())
        logprob_values(t, m, KVT_API_RESPONSES,
                       "{\"input\":\"Write one line about rivers.\",\"max_output_tokens\":8,\"temperature\":0,"
                       "\"include\":[\"message.output_text.logprobs\"],\"top_logprobs\":20}", 20, true);
    kvt_model_close(m);
    if (kvt_test_failed()) return;
    STOP(t);
}

TEST(e2e_logprobs)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    logprobs(&t, "ds4-tiny", "ds4-tiny");
    e2e_end(&t);
    const char *stories = kvt_test_shared(STORIES);
    if (kvt_test_failed() || !stories) return;
    /* a trained model with a SentencePiece vocabulary: multi-byte pieces,
     * leading spaces, byte-fallback tokens */
    char path[4096];
    snprintf(path, sizeof path, "%s", stories);
    if (!e2e_begin(&t, false)) return;
    logprobs(&t, path, NULL);
    e2e_end(&t);
}

static void context_limit(e2e *t)
{
    START(t, "--model", "ds4-tiny", "--kv-disk-dir", t->kv, "--ctx", "256");
    NODE(t, 300, "errors.mjs", "ctx");
    STOP(t);
}

TEST(e2e_context_limit)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    context_limit(&t);
    e2e_end(&t);
}

static void body_limit(e2e *t)
{
    START(t, "--model", "ds4-tiny", "--kv-disk-dir", t->kv, "--max-body-mb", "1");
    NODE(t, 300, "errors.mjs", "body");
    /* curl sends a large body after "Expect: 100-continue": the server may
     * answer before reading it, or read and discard it; 413 either way */
    char path[128];
    snprintf(path, sizeof path, "%s/big.json", t->s.dir);
    FILE *f = fopen(path, "w");
    CHECK(f);
    fputs("{\"messages\":[{\"role\":\"user\",\"content\":\"", f);
    for (int i = 0; i < (2 << 20); i++) fputc('q', f);
    fputs("\"}]}", f);
    fclose(f);
    int code = curl(t, "-H 'content-type: application/json' --data-binary @%s %s/v1/chat/completions", path, t->s.base);
    char *body = curl_file(t, "out");
    CHECKF(code == 413 && strstr(body, "request_too_large"), "curl, 2 MB body: %d %.200s", code, body);
    free(body);
    code = curl(t, "-H 'content-type: application/json' -H 'Expect:' --data-binary @%s %s/v1/messages", path, t->s.base);
    body = curl_file(t, "out");
    CHECKF(code == 413 && strstr(body, "\"type\":\"error\""), "curl, 2 MB body without Expect: %d %.200s", code, body);
    free(body);
    CHECKF(fx_health_ok(&t->s), "/health after the oversized bodies");
    STOP(t);
}

TEST(e2e_body_limit)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    body_limit(&t);
    e2e_end(&t);
}

static void api_key(e2e *t)
{
    START(t, "--model", "ds4-tiny", "--kv-disk-dir", t->kv, "--api-key", "K");
    NODE(t, 300, "errors.mjs", "auth");
    const char *req = "-H 'content-type: application/json' -d '{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                      "\"max_tokens\":1}'";
    int code = curl(t, "%s %s/v1/chat/completions", req, t->s.base);
    CHECKF(code == 401, "curl, no key: %d", code);
    code = curl(t, "-H 'Authorization: Bearer K' %s %s/v1/chat/completions", req, t->s.base);
    CHECKF(code == 200, "curl, Authorization: Bearer K: %d", code);
    code = curl(t, "-H 'x-api-key: K' %s %s/v1/messages", req, t->s.base);
    CHECKF(code == 200, "curl, x-api-key: K: %d", code);
    code = curl(t, "-H 'Authorization: Bearer k' %s %s/v1/chat/completions", req, t->s.base);
    CHECKF(code == 401, "curl, a key that differs in case: %d", code);
    CHECKF(fx_health_ok(&t->s), "/health without the key");
    STOP(t);
}

TEST(e2e_api_key)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    api_key(&t);
    e2e_end(&t);
}

static void queue_full(e2e *t)
{
    /* ds4-mini: 2000 tokens take seconds, so the requests overlap */
    START(t, "--model", "ds4-mini", "--kv-disk-dir", t->kv, "--parallel", "1", "--queue", "1");
    NODE(t, 600, "errors.mjs", "queue");
    STOP(t);
}

TEST(e2e_queue_full)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    queue_full(&t);
    e2e_end(&t);
}

static void tiers_stories(e2e *t, const char *model)
{
    char state[128];
    snprintf(state, sizeof state, "%s/state.json", t->s.dir);
    /* the save policy scaled to a 2048-token context */
#define STORIES_ARGS "--model", model, "--kv-disk-dir", t->kv, "--kv-cache-min-tokens", "128", \
                     "--kv-cache-align-tokens", "256", "--kv-cache-continued-interval", "1024"
    START(t, STORIES_ARGS);
    NODE(t, 300, "tiers.mjs", "ram", state);
    stop_expect_shutdown_save(t);
    if (kvt_test_failed()) return;
    START(t, STORIES_ARGS);
    NODE(t, 300, "tiers.mjs", "disk", state);
    STOP(t);
#undef STORIES_ARGS
}

/* Run fn on a synthetic model of the llama family (tests/synth_family.h,
 * with the llama SPM vocabulary of ../shared: skipped without it) of a
 * context of ctx tokens, written into the test's directory. */
static void on_family(const fam_spec *f, uint32_t ctx, void (*fn)(e2e *t, const char *model))
{
    const char *vocab = kvt_test_shared("vocab/ggml-vocab-llama-spm.gguf");
    if (!vocab) SKIP("../shared/vocab absent");
    char v[4096], path[256];
    snprintf(v, sizeof v, "%s", vocab);
    e2e t;
    if (!e2e_begin(&t, false)) return;
    snprintf(path, sizeof path, "%s/%s.gguf", t.s.dir, f->arch);
    CHECK_OK(fam_write_ctx(path, v, 5, FAM_ROPE_BASE, f, false, ctx));
    if (!kvt_test_failed()) fn(&t, path);
    e2e_end(&t);
}

/* gemma3's window layers keep rings, and a restart must find them on
 * disk: the synthetic gemma3 (a 64-token window on every other layer)
 * through the same cold, RAM and disk phases. */
TEST(e2e_tiers_gemma3)
{
    static const fam_spec g = {"gemma3", false, true, FAM_HEAD_DIM, false, false, true};
    on_family(&g, FAM_CTX, tiers_stories);
}

/* Run fn on stories260K from ../shared (skipped without it). */
static void on_stories(void (*fn)(e2e *t, const char *model))
{
    const char *model = kvt_test_shared(STORIES);
    if (!model) SKIP("%s not found under ../shared", STORIES);
    char path[4096];
    snprintf(path, sizeof path, "%s", model);
    e2e t;
    if (!e2e_begin(&t, false)) return;
    fn(&t, path);
    e2e_end(&t);
}

TEST(e2e_tiers_stories) { on_stories(tiers_stories); }

static void agent_tiers(e2e *t)
{
    char state[128], kv2[128];
    snprintf(state, sizeof state, "%s/state.json", t->s.dir);
    snprintf(kv2, sizeof kv2, "%s/kv-fresh", t->s.dir);
    START(t, "--model", "ds4-mini", "--kv-disk-dir", t->kv);
    NODE(t, 600, "agent.mjs", "turns", state);
    STOP(t);
    char *ls = cache_ls(t, t->kv);
    bool ok = has_reason(ls, "cold") && has_reason(ls, "shutdown");
    if (!ok) printf("    cache ls:\n%s\n", ls ? ls : "(failed)");
    free(ls);
    CHECKF(ok, "after turn 1 and SIGTERM the disk tier lacks a \"cold\" or a \"shutdown\" snapshot");
    START(t, "--model", "ds4-mini", "--kv-disk-dir", t->kv);
    NODE(t, 600, "agent.mjs", "disk", state);
    STOP(t);
    START(t, "--model", "ds4-mini", "--kv-disk-dir", kv2);
    NODE(t, 600, "agent.mjs", "cold", state);
    STOP(t);
}

TEST(e2e_agent_tiers)
{
    e2e t;
    if (!e2e_begin(&t, true)) return;
    agent_tiers(&t);
    e2e_end(&t);
}

static void agent_prefill(e2e *t)
{
    char state[128];
    snprintf(state, sizeof state, "%s/state.json", t->s.dir);
    START(t, "--model", "ds4-mini", "--kv-disk-dir", t->kv);
    NODE(t, 600, "agent.mjs", "prefill", state);
    STOP(t);
}

TEST(e2e_agent_prefill)
{
    e2e t;
    if (!e2e_begin(&t, true)) return;
    agent_prefill(&t);
    e2e_end(&t);
}

/* ---- tenants: one per API key, none sees another ---- */

/* The save policy scaled down: a 1,000-token prompt saves a snapshot. */
#define SMALL_POLICY "--kv-cache-min-tokens", "128", "--kv-cache-align-tokens", "128"

/* The keys' directories tell nothing of the keys: not named by an unkeyed
 * hash of one (which a short key is recovered from), the secret they are
 * keyed with private. */
static void check_ns_names(e2e *t, const char *const *keys, size_t n)
{
    char path[600];
    struct stat sb;
    snprintf(path, sizeof path, "%s/kvtier.secret", t->kv);
    CHECKF(lstat(path, &sb) == 0 && S_ISREG(sb.st_mode) && (sb.st_mode & 0777) == 0600,
           "%s: missing, or not a 0600 file", path);
    CHECKF(stat(t->kv, &sb) == 0 && (sb.st_mode & 0777) == 0700, "%s: mode %04o, not 0700", t->kv,
           (int)(sb.st_mode & 07777));
    size_t found = 0;
    DIR *d = opendir(t->kv);
    for (struct dirent *e; d && (e = readdir(d));) {
        if (strncmp(e->d_name, "ns-", 3)) continue;
        found++;
        for (size_t i = 0; i < n; i++) {
            char plain[40];
            snprintf(plain, sizeof plain, "ns-%016llx", (unsigned long long)XXH3_64bits(keys[i], strlen(keys[i])));
            CHECKF(!strstr(e->d_name, plain + 3), "%s/%s is named by the unkeyed hash of key %zu", t->kv, e->d_name, i + 1);
        }
    }
    if (d) closedir(d);
    CHECKF(found == n, "%zu key directories in %s, %zu keys", found, t->kv, n);
}

static void tenant_metrics(e2e *t)
{
    /* K2 is named: its series are labelled tenant="second", K1's "key1" */
    START(t, "--model", "ds4-tiny", "--kv-disk-dir", t->kv, "--api-key", "K1", "--api-key", "second=K2",
          "--metrics-key", "M", SMALL_POLICY);
    NODE(t, 300, "tenants.mjs", "metrics");
    /* the name is not part of the key */
    int code0 = curl(t, "-H 'Authorization: Bearer second=K2' %s/metrics", t->s.base);
    CHECKF(code0 == 401, "curl, GET /metrics with the key's name=key: %d", code0);
    /* the same over curl: no key, 401; a key, its own figures */
    int code = curl(t, "%s/metrics", t->s.base);
    CHECKF(code == 401, "curl, GET /metrics without a key: %d", code);
    code = curl(t, "-H 'Authorization: Bearer K2' %s/metrics", t->s.base);
    char *body = curl_file(t, "out");
    CHECKF(code == 200 && strstr(body, "kvtier_prompt_tokens_total ") && !strstr(body, "tenant=\""),
           "curl, GET /metrics with K2: %d %.300s", code, body);
    free(body);
    STOP(t);
    check_ns_names(t, (const char *const[]){"K1", "K2"}, 2);
}

TEST(e2e_tenant_metrics)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    tenant_metrics(&t);
    e2e_end(&t);
}

/* `KVT_BIN serve args...` that must be refused as a usage error (exit 2)
 * before it serves anything. */
static void serve_refused(e2e *t, const char *const *args, const char *why)
{
    const char *argv[24] = {kvt_test_bin(), "serve", "--model", "ds4-tiny", "--no-kv-disk", "--port", "1"};
    size_t n = 7;
    for (size_t i = 0; args[i] && n + 1 < sizeof argv / sizeof argv[0]; i++) argv[n++] = args[i];
    argv[n] = NULL;
    char out[128];
    snprintf(out, sizeof out, "%s/refused.out", t->s.dir);
    int st = 0;
    int ran = fx_run(argv, out, 30, &st);
    bool ok = ran == 1 && WIFEXITED(st) && WEXITSTATUS(st) == 2;
    if (!ok) fx_print_file("serve", out);
    CHECKF(ok, "serve with %s: not refused with exit status 2", why);
}

static void tenant_keys(e2e *t)
{
    /* keys of three lengths, one a prefix of another */
    START(t, "--model", "ds4-tiny", "--kv-disk-dir", t->kv, "--api-key", "abc", "--api-key", "abcdef", "--api-key",
          "xyz-0123456789", SMALL_POLICY);
    NODE(t, 300, "tenants.mjs", "keys");
    STOP(t);
    if (kvt_test_failed()) return;
    serve_refused(t, (const char *const[]){"--api-key", "a", "--api-key", "a", NULL}, "a key given twice");
    serve_refused(t, (const char *const[]){"--api-key", "", NULL}, "an empty key");
    serve_refused(t, (const char *const[]){"--api-key", "a", "--metrics-key", "a", NULL}, "the metrics key an API key");
    serve_refused(t, (const char *const[]){"--metrics-key", "m", NULL}, "a metrics key without API keys");
    /* --api-key NAME=KEY: keys with '=' that are not NAME=KEY stay whole
     * (base64 padding, a trailing '='), a key that would read as one is
     * given with a name, and two keys never share a label */
    serve_refused(t, (const char *const[]){"--api-key", "n=a", "--api-key", "n=b", NULL}, "two keys of one name");
    serve_refused(t, (const char *const[]){"--api-key", "key2=a", "--api-key", "b", NULL},
                  "a name that is another key's label");
    char kf[300];
    snprintf(kf, sizeof kf, "%s/keys.txt", t->s.dir);
    FILE *f = fopen(kf, "w");
    CHECK(f && fputs("# a named key on a line of --api-key-file\nn1=p=q\n", f) >= 0 && fclose(f) == 0);
    START(t, "--model", "ds4-tiny", "--no-kv-disk", "--api-key", "dGVzdA==", "--api-key", "abc=", "--api-key-file", kf,
          "--metrics-key", "M");
    const char *ok_keys[] = {"dGVzdA==", "abc=", "p=q"}, *not_keys[] = {"dGVzdA", "abc", "n1=p=q", "n1"};
    for (size_t i = 0; i < 3; i++) {
        int code = curl(t, "-H 'Authorization: Bearer %s' %s/metrics", ok_keys[i], t->s.base);
        CHECKF(code == 200, "Bearer %s: %d, not 200", ok_keys[i], code);
    }
    for (size_t i = 0; i < 4; i++) {
        int code = curl(t, "-H 'Authorization: Bearer %s' %s/metrics", not_keys[i], t->s.base);
        CHECKF(code == 401, "Bearer %s: %d, not 401", not_keys[i], code);
    }
    int code = curl(t, "-H 'Authorization: Bearer M' %s/metrics", t->s.base);
    char *body = curl_file(t, "out");
    CHECKF(code == 200 && strstr(body, "tenant=\"key1\"") && strstr(body, "tenant=\"key2\"") &&
           strstr(body, "tenant=\"n1\""), "the operator view's labels: %d %.400s", code, body);
    free(body);
    STOP(t);
}

TEST(e2e_tenant_keys)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    tenant_keys(&t);
    e2e_end(&t);
}

/* The bytes and snapshots `kvtier cache stats` reports for a store, and
 * the bytes of its files (du); false when the command fails. */
static bool store_stats(e2e *t, const char *dir, unsigned long long *bytes, unsigned long long *snaps,
                        unsigned long long *files)
{
    char cmd[1200], path[160];
    if ((size_t)snprintf(path, sizeof path, "%s/stats.out", t->s.dir) >= sizeof path ||
        (size_t)snprintf(cmd, sizeof cmd, "'%s' cache stats --kv-disk-dir '%s' >%s 2>&1", kvt_test_bin(), dir, path) >=
            sizeof cmd)
        return false;
    if (system(cmd) != 0) { fx_print_file("cache stats", path); return false; }
    char *s = kvt_test_read_file(path, NULL);
    const char *b = s ? strstr(s, "\nbytes") : NULL, *n = s ? strstr(s, "\nsnapshots") : NULL;
    bool ok = b && n && sscanf(b + 6, " %llu", bytes) == 1 && sscanf(n + 10, " %llu", snaps) == 1;
    if (!ok) fx_print_file("cache stats", path);
    free(s);
    *files = 0;
    snprintf(cmd, sizeof cmd, "du -sb '%s'", dir);
    FILE *f = popen(cmd, "r");
    if (f) {
        if (fscanf(f, "%llu", files) != 1) *files = 0;
        pclose(f);
    }
    return ok;
}

/* The stores of the keys (DIR/ns-*) after the server stopped: each within
 * its share of the total, the sum within the total. */
static void check_stores(e2e *t, unsigned long long total, size_t keys, const char *when)
{
    DIR *d = opendir(t->kv);
    CHECKF(d, "%s: opendir %s: %s", when, t->kv, strerror(errno));
    unsigned long long sum = 0, sum_files = 0, share = total / keys;
    size_t n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, "ns-", 3)) continue;
        char dir[512];
        snprintf(dir, sizeof dir, "%s/%s", t->kv, e->d_name);
        unsigned long long bytes = 0, snaps = 0, files = 0;
        bool ok = store_stats(t, dir, &bytes, &snaps, &files);
        CHECKF(ok, "%s: cache stats of %s failed", when, dir);
        printf("    %s: %s %llu B in %llu snapshots (files %llu B)\n", when, e->d_name, bytes, snaps, files);
        CHECKF(bytes <= share, "%s: %s holds %llu B, over its share %llu B", when, e->d_name, bytes, share);
        sum += bytes;
        sum_files += files;
        n++;
    }
    closedir(d);
    printf("    %s: %zu stores, %llu B of %llu B (files %llu B)\n", when, n, sum, total, sum_files);
    CHECKF(n == keys, "%s: %zu key stores, %zu keys", when, n, keys);
    CHECKF(sum <= total, "%s: the stores hold %llu B, over the total %llu B", when, sum, total);
}

/* --kv-disk-mb is the total across keys: three keys, 1 MiB, each key's
 * store at most a third; one key's heavy use evicts only its own entries. */
static void tenant_disk_budget(e2e *t)
{
#define BUDGET_ARGS "--model", "ds4-tiny", "--kv-disk-dir", t->kv, "--api-key", "K1", "--api-key", "K2", \
                    "--api-key", "K3", "--metrics-key", "M", "--kv-disk-mb", "1", SMALL_POLICY
    START(t, BUDGET_ARGS);
    NODE(t, 300, "tenants.mjs", "budget");
    STOP(t); /* the live sessions' shutdown saves go to their own keys' stores too */
    check_stores(t, 1ull << 20, 3, "after the heavy use and SIGTERM");
    if (kvt_test_failed()) return;
    START(t, BUDGET_ARGS);
    NODE(t, 300, "tenants.mjs", "budget-disk");
    STOP(t);
    check_stores(t, 1ull << 20, 3, "after the restart");
#undef BUDGET_ARGS
}

TEST(e2e_tenant_disk_budget)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    tenant_disk_budget(&t);
    e2e_end(&t);
}

/* ---- a signal right after the server says it is up ---- */

/* Read what the child wrote to the pipe into *buf (NUL-terminated) until
 * `want` appears in it, the pipe closes (the child exited) or `timeout`
 * seconds pass. True when want was seen (want NULL: when the pipe closed). */
static bool read_until(int fd, char *buf, size_t cap, size_t *len, const char *want, double timeout)
{
    double t0 = fx_now();
    while (fx_now() - t0 < timeout) {
        if (want && strstr(buf, want)) return true;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 50) <= 0) continue;
        char tmp[4096];
        ssize_t n = read(fd, tmp, sizeof tmp);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return !want || strstr(buf, want);
        size_t k = (size_t)n < cap - 1 - *len ? (size_t)n : cap - 1 - *len;
        memcpy(buf + *len, tmp, k);
        *len += k;
        buf[*len] = 0;
    }
    return want && strstr(buf, want);
}

/* Write a request with a prompt (completions) or a user message (chat) of
 * `bytes` bytes to s.dir/name; ds4 presets: a token per byte. */
static void restart_body(e2e *t, const char *name, bool chat, int bytes, char *path, size_t cap)
{
    snprintf(path, cap, "%s/%s", t->s.dir, name);
    FILE *f = fopen(path, "w");
    CHECK(f);
    fputs(chat ? "{\"messages\":[{\"role\":\"user\",\"content\":\"" : "{\"prompt\":\"", f);
    /* (a text of its own for chat: a model without a chat template renders
     * the messages as the text itself) */
    for (int i = 0; i < bytes; i++) fputc("abcdefghijklmnopqrstuvwxyz 0123456789.,"[(i * 7 + i / 39 + chat) % 39], f);
    fputs(chat ? "\"}],\"max_tokens\":2,\"temperature\":0}" : "\",\"max_tokens\":2,\"temperature\":0}", f);
    fclose(f);
}

/* POST the body at path; *prompt and *cached from its usage. */
static bool restart_post(e2e *t, const char *api, const char *path, long *prompt, long *cached)
{
    int code = curl(t, "-H 'content-type: application/json' --data-binary @%s %s%s", path, t->s.base, api);
    char *body = curl_file(t, "out");
    json_t *j = json_loads(body, 0, NULL), *u = json_object_get(j, "usage");
    *prompt = (long)json_integer_value(json_object_get(u, "prompt_tokens"));
    *cached = (long)json_integer_value(json_object_get(json_object_get(u, "prompt_tokens_details"), "cached_tokens"));
    bool ok = code == 200 && *prompt > 0;
    if (!ok) printf("    %s: HTTP %d %.300s\n", api, code, body);
    json_decref(j);
    free(body);
    return ok;
}

/* With the default save policy a prompt comes back after a restart but for
 * the trim (32 tokens): the server prefills only those again (at 128, the
 * previous release's alignment, 134 of the completion's 2,822; at 2,048,
 * the one before, 774). With align (not NULL: --kv-cache-align-tokens)
 * the saves stay on its grid: the completion restores `want` tokens. */
/* model: a GGUF of a model whose rows are per token (its shutdown records,
 * the prompt and the reply's first token, serve the prompt whole: its last
 * token is computed again), or NULL: ds4-tiny, which prefills the trim. */
static void restart_reprefill(e2e *t, const char *model, const char *align, long want)
{
    char comp[128], chat[128];
    restart_body(t, "comp.json", false, 2821, comp, sizeof comp);
    restart_body(t, "chat.json", true, 2821, chat, sizeof chat);
    long p[2][2], c[2][2]; /* [before, after the restart][completion, chat] */
#define SERVE "--model", model ? model : "ds4-tiny", "--kv-disk-dir", t->kv, align ? "--kv-cache-align-tokens" : NULL, align
    START(t, SERVE);
    CHECK(restart_post(t, "/v1/completions", comp, &p[0][0], &c[0][0]));
    CHECK(restart_post(t, "/v1/chat/completions", chat, &p[0][1], &c[0][1]));
    STOP(t);
    START(t, SERVE);
    CHECK(restart_post(t, "/v1/completions", comp, &p[1][0], &c[1][0]));
    CHECK(restart_post(t, "/v1/chat/completions", chat, &p[1][1], &c[1][1]));
    STOP(t);
    /* a prompt that continues the saved one (300 bytes more) hits it too */
    char more[128];
    long pm, cm;
    restart_body(t, "more.json", false, 3121, more, sizeof more);
    START(t, SERVE);
    CHECK(restart_post(t, "/v1/completions", more, &pm, &cm));
    STOP(t);
#undef SERVE
    printf("    --kv-cache-align-tokens %s: after a restart completion %ld of %ld cached, chat %ld of %ld; a longer "
           "completion %ld of %ld\n", align ? align : "(default)", c[1][0], p[1][0], c[1][1], p[1][1], cm, pm);
    /* (its ids may leave the saved prompt's near its end, where the text
     * goes on: the cold record before the trim serves it) */
    long cold = align ? c[1][0] : p[0][0] - 32;
    CHECKF(pm > p[0][0] + (model ? 30 : 299) && cm >= cold, "a prompt continuing the saved one: %ld of %ld tokens cached "
           "(%ld expected at least)", cm, pm, cold);
    const char *what[2] = {"completion", "chat"};
    for (int k = 0; k < 2; k++) {
        CHECKF((model || p[0][k] >= 2822) && p[1][k] == p[0][k], "%s: prompts of %ld and %ld tokens", what[k], p[0][k], p[1][k]);
        CHECKF(c[0][k] < 128, "%s: %ld tokens cached on an empty server", what[k], c[0][k]);
        if (!align && model) /* (none when the session ended with the prompt: a record of it alone) */
            CHECKF(p[1][k] - c[1][k] <= 1, "%s after a restart: %ld of %ld tokens cached, %ld prefilled again "
                   "(at most 1, the prompt's last token, expected)", what[k], c[1][k], p[1][k], p[1][k] - c[1][k]);
        else if (!align)
            CHECKF(p[1][k] - c[1][k] == 32, "%s after a restart: %ld of %ld tokens cached, %ld prefilled again "
                   "(the trim, 32, expected)", what[k], c[1][k], p[1][k], p[1][k] - c[1][k]);
    }
    if (align)
        CHECKF(c[1][0] == want, "--kv-cache-align-tokens %s: the completion after a restart: %ld of %ld tokens "
               "cached (%ld expected)", align, c[1][0], p[1][0], want);
}

TEST(e2e_restart_reprefill)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    restart_reprefill(&t, NULL, NULL, 0);
    e2e_end(&t);
}

/* The synthetic llama, whose rows are per token: after a restart the
 * shutdown record serves each prompt whole. */
static void restart_reprefill_model(e2e *t, const char *model) { restart_reprefill(t, model, NULL, 0); }

TEST(e2e_restart_reprefill_llama)
{
    static const fam_spec f = {"llama", false, false, FAM_HEAD_DIM, false, false, false};
    on_family(&f, 4096, restart_reprefill_model);
}

TEST(e2e_restart_reprefill_align)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    restart_reprefill(&t, NULL, "128", 2688);
    e2e_end(&t);
}

/* Start the server with its stderr on a pipe, SIGTERM (SIGINT every other
 * round) it the moment the pipe carries the "serving" line, and require
 * exit 0: a signal that lands just before the server starts waiting for
 * one must still stop it. */
static void sigterm_ready(e2e *t)
{
    const int rounds = 12;
    static char out[65536];
    for (int i = 0, tries = 0; i < rounds && tries < 3 * rounds; tries++) {
        int port = fx_free_port(), pfd[2];
        CHECKF(port > 0, "no free port");
        CHECKF(pipe(pfd) == 0, "pipe: %s", strerror(errno));
        char ports[16], log[128];
        snprintf(ports, sizeof ports, "%d", port);
        snprintf(log, sizeof log, "%s/ready-%d.log", t->s.dir, tries);
        fflush(stdout);
        pid_t pid = fork();
        CHECKF(pid >= 0, "fork: %s", strerror(errno));
        if (pid == 0) {
            close(pfd[0]);
            dup2(pfd[1], 1);
            dup2(pfd[1], 2);
            close(pfd[1]);
            execl(kvt_test_bin(), kvt_test_bin(), "serve", "--model", "ds4-tiny", "--host", "127.0.0.1", "--port",
                  ports, "--kv-disk-dir", t->kv, "--api-key", "K", (char *)NULL);
            _exit(127);
        }
        close(pfd[1]);
        size_t len = 0;
        out[0] = 0;
        bool ready = read_until(pfd[0], out, sizeof out, &len, "kvtier: serving", FX_START_TIMEOUT);
        int sig = i % 2 ? SIGINT : SIGTERM, st = 0;
        if (ready) kill(pid, sig);
        bool closed = read_until(pfd[0], out, sizeof out, &len, NULL, FX_STOP_TIMEOUT);
        close(pfd[0]);
        pid_t got = 0;
        double t0 = fx_now();
        while (fx_now() - t0 < (closed ? FX_STOP_TIMEOUT : 0.5) && (got = waitpid(pid, &st, WNOHANG)) == 0)
            fx_sleep_ms(10);
        if (got != pid) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
        }
        FILE *f = fopen(log, "w");
        if (f) { fputs(out, f); fclose(f); }
        if (!ready && got == pid && strstr(out, "cannot listen")) continue; /* the port was taken: another */
        bool ok = ready && got == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0 && strstr(out, "stopping");
        if (!ok) fx_print_file("server log", log);
        CHECKF(ready, "round %d: no ready line within %.0f s", i, FX_START_TIMEOUT);
        CHECKF(got == pid, "round %d: no exit within %.0f s of %s right after the ready line", i, FX_STOP_TIMEOUT,
               sig == SIGINT ? "SIGINT" : "SIGTERM");
        CHECKF(ok, "round %d: %s right after the ready line: %s %d", i, sig == SIGINT ? "SIGINT" : "SIGTERM",
               WIFEXITED(st) ? "exit status" : "signal", WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
        i++;
    }
    printf("    %d rounds: each server exited 0 after a signal sent right after its ready line\n", rounds);
}

TEST(e2e_sigterm_ready)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    sigterm_ready(&t);
    e2e_end(&t);
}

/* ---- several requests at once ---- */

/* The same requests alone (one server) and inside batches of random others
 * (a fresh one, nothing cached, --parallel 8): the same bits. */
static void batch_same(e2e *t, const char *model)
{
    char state[128];
    snprintf(state, sizeof state, "%s/batch.json", t->s.dir);
    START(t, "--model", model, "--no-kv-disk", "--parallel", "8");
    NODE(t, 300, "batch.mjs", "alone", state);
    STOP(t);
    if (kvt_test_failed()) return;
    START(t, "--model", model, "--no-kv-disk", "--parallel", "8");
    NODE(t, 300, "batch.mjs", "batched", state);
    STOP(t);
}

TEST(e2e_batch_same_ds4)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    batch_same(&t, "ds4-tiny");
    e2e_end(&t);
}

TEST(e2e_batch_same_stories) { on_stories(batch_same); }

/* The same with speculative decoding: the requests alone on a server that
 * drafts nothing, then inside batches on one that drafts (--draft ngram):
 * the same bits (drafts and prefills of several requests in one pass). */
static void batch_same_draft(e2e *t, const char *model)
{
    char state[128];
    snprintf(state, sizeof state, "%s/batch.json", t->s.dir);
    START(t, "--model", model, "--no-kv-disk", "--parallel", "8", "--draft", "none");
    NODE(t, 300, "batch.mjs", "alone", state);
    STOP(t);
    if (kvt_test_failed()) return;
    START(t, "--model", model, "--no-kv-disk", "--parallel", "8", "--draft", "ngram");
    NODE(t, 300, "batch.mjs", "batched", state);
    CHECKF(curl(t, "%s/metrics", t->s.base) == 200, "GET /metrics");
    char *m = curl_file(t, "out");
    const char *d = strstr(m, "\nkvtier_draft_tokens_total "), *a = strstr(m, "\nkvtier_draft_accepted_tokens_total ");
    long drafted = d ? strtol(d + 27, NULL, 10) : -1, accepted = a ? strtol(a + 36, NULL, 10) : -1;
    free(m);
    printf("    %s, batched with --draft ngram: %ld tokens drafted, %ld accepted\n", model, drafted, accepted);
    CHECKF(drafted > 0, "no token drafted: the check saw no speculation");
    STOP(t);
}

TEST(e2e_batch_draft_ds4)
{
    e2e t;
    if (!e2e_begin(&t, false)) return;
    batch_same_draft(&t, "ds4-tiny");
    e2e_end(&t);
}

TEST(e2e_batch_draft_stories) { on_stories(batch_same_draft); }

/* Clients that hang up free their slots; a burst of one key's requests
 * does not hold another key's behind all of it (ds4-mini: its prefills
 * take long enough to overlap). */
TEST(e2e_batch_cancel_fair)
{
    e2e t;
    if (!e2e_begin(&t, true)) return;
    START(&t, "--model", "ds4-mini", "--no-kv-disk", "--parallel", "4");
    NODE(&t, 300, "batch.mjs", "cancel");
    STOP(&t);
    START(&t, "--model", "ds4-mini", "--no-kv-disk", "--parallel", "1", "--api-key", "KA", "--api-key", "KB");
    NODE(&t, 300, "batch.mjs", "fair", "KA", "KB");
    STOP(&t);
    e2e_end(&t);
}
