/* kvtier's built-in chat rendering against the chat template itself, byte
 * for byte.
 *
 *   template_deepseek_v4   every conversation of the corpus below, sent as
 *                          an OpenAI chat request, renders with the deepseek
 *                          template (ds4-tiny) to exactly what llama.cpp's
 *                          models/templates/deepseek-ai-DeepSeek-V4-Flash-0731.jinja
 *                          renders through @huggingface/jinja, in
 *                          non-thinking and thinking mode
 *
 * The template gets what a client of the transformers chat API would pass:
 * the request's messages and tools as they are, except that tool-call
 * arguments are parsed into objects (the template's from_json filter is not
 * part of @huggingface/jinja, and transformers expects objects there) and
 * content given as text parts is one string with "\n\n" between the parts
 * (the template writes a list as its JSON; kvtier joins parts so),
 * bos_token, add_generation_prompt (false when the conversation ends with an
 * assistant turn without tool calls: kvtier then continues that turn, so its
 * rendering is the template's without the final end-of-sentence), and in
 * thinking mode thinking = true, drop_thinking = false (kvtier keeps every
 * turn's reasoning so that a conversation's renderings only grow; see
 * docs/API.md) and the request's reasoning_effort.
 *
 * Negative control: each case is rendered a second time with the thinking
 * flag flipped, and that rendering must differ from kvtier's (the comparison
 * sees the one-marker difference between the modes); and the template's own
 * default drop_thinking = true differs from kvtier on the multi-turn thinking
 * case, which is the history rewrite kvtier avoids on purpose.
 *
 * Requirements: node, the packages of tests/template/package-lock.json
 * (@huggingface/jinja, installed with npm ci on first use) and of the llama.cpp
 * peer (tests/peer: the template is read from its source bundle). Skips,
 * saying why, when any is missing; KVT_PEER=0 skips it too. About 2 s. */
#include "fixture.h"
#include "test.h"
#include "api.h"
#include "model.h"

#include <fcntl.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#define TPL_DIR "tests/template"
#define TPL_SCRIPT TPL_DIR "/render.mjs"
#define BUNDLE FX_PEER_DIR "/node_modules/node-llama-cpp/llama/gitRelease.bundle"
#define V4_TEMPLATE "models/templates/deepseek-ai-DeepSeek-V4-Flash-0731.jinja"
#define BOS "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"
#define EOS "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"

static const char *skip_reason(void)
{
    const char *why = fx_peer_skip_reason();
    if (why) return why;
    if (system("command -v node >/dev/null 2>&1") != 0) return "node is not on PATH";
    if (system("command -v git >/dev/null 2>&1") != 0) return "git is not on PATH";
    if (access(TPL_SCRIPT, R_OK) != 0) return "run from the repository root (" TPL_SCRIPT " not found)";
    return NULL;
}

static bool jinja_ensure(void)
{
    int fd = open(TPL_DIR "/package.json", O_RDONLY);
    if (fd < 0) return false;
    flock(fd, LOCK_EX);
    bool ok = access(TPL_DIR "/node_modules/@huggingface/jinja/package.json", R_OK) == 0 ||
              fx_npm_ci(TPL_DIR, "kvtier-template", "@huggingface/jinja");
    flock(fd, LOCK_UN);
    close(fd);
    return ok;
}

/* ---- the corpus: OpenAI chat conversations (the "messages" and "tools" of a
 * request; each is also sent in thinking mode) ---- */

#define TOOLS                                                                                                   \
    "[{\"type\":\"function\",\"function\":{\"name\":\"read_file\",\"description\":\"Read a file \\u00e9 \\\"q\\\"\","   \
    "\"parameters\":{\"type\":\"object\",\"properties\":{\"path\":{\"type\":\"string\"},\"limit\":{\"type\":"       \
    "\"integer\",\"default\":2000,\"minimum\":1.5e-7}},\"required\":[\"path\"]}}},{\"type\":\"function\","           \
    "\"function\":{\"name\":\"bash\",\"parameters\":{\"type\":\"object\",\"properties\":{\"cmd\":{\"type\":"       \
    "\"string\"},\"env\":{\"type\":\"object\"}}},\"strict\":true}}]"

typedef struct tcase {
    const char *name;
    const char *messages;
    const char *tools;       /* NULL: none */
    const char *effort;      /* reasoning_effort, NULL: none */
} tcase;

static const tcase corpus[] = {
    {"one user turn", "[{\"role\":\"user\",\"content\":\"Hello?\"}]", NULL, NULL},
    {"system and turns",
     "[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Q1\"},"
     "{\"role\":\"assistant\",\"content\":\"A1\"},{\"role\":\"user\",\"content\":\"Q2\"}]", NULL, NULL},
    {"two systems, one late, empty first",
     "[{\"role\":\"system\",\"content\":\"\"},{\"role\":\"user\",\"content\":\"Q\"},"
     "{\"role\":\"system\",\"content\":\"Late rule.\"},{\"role\":\"user\",\"content\":\"Q again\"}]", TOOLS, NULL},
    {"developer and parts",
     "[{\"role\":\"developer\",\"content\":\"Dev says.\"},{\"role\":\"user\",\"content\":[{\"type\":\"text\","
     "\"text\":\"Part one.\"},{\"type\":\"text\",\"text\":\"Part two.\"}]}]", NULL, "high"},
    {"tools, calls and results",
     "[{\"role\":\"system\",\"content\":\"You are an agent.\"},{\"role\":\"user\",\"content\":\"Look at a.c\"},"
     "{\"role\":\"assistant\",\"content\":\"Reading.\",\"reasoning_content\":\"I should read it.\",\"tool_calls\":["
     "{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"read_file\",\"arguments\":"
     "\"{\\\"path\\\":\\\"a.c\\\",\\\"limit\\\":10}\"}},{\"id\":\"c2\",\"type\":\"function\",\"function\":"
     "{\"name\":\"bash\",\"arguments\":\"{\\\"cmd\\\":\\\"wc -l a.c\\\",\\\"env\\\":{\\\"LC_ALL\\\":\\\"C\\\","
     "\\\"n\\\":[1,2.5,null,true]}}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"int main;\"},"
     "{\"role\":\"tool\",\"tool_call_id\":\"c2\",\"content\":\"1 a.c\"}]", TOOLS, NULL},
    {"answer after results, then a user turn",
     "[{\"role\":\"user\",\"content\":\"Run ls\"},{\"role\":\"assistant\",\"content\":null,\"tool_calls\":["
     "{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"bash\",\"arguments\":\"{}\"}}]},"
     "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"a.c\\nb.c\"},{\"role\":\"assistant\",\"content\":"
     "\"Two files.\",\"reasoning_content\":\"Count them.\"},{\"role\":\"user\",\"content\":\"Thanks\"}]", TOOLS, "max"},
    {"multi-turn reasoning",
     "[{\"role\":\"user\",\"content\":\"2+2?\"},{\"role\":\"assistant\",\"content\":\"4\",\"reasoning_content\":"
     "\"Add them.\"},{\"role\":\"user\",\"content\":\"Times 3?\"},{\"role\":\"assistant\",\"content\":\"12\","
     "\"reasoning_content\":\"4*3.\"},{\"role\":\"user\",\"content\":\"Sure?\"}]", NULL, NULL},
    {"prefill", "[{\"role\":\"user\",\"content\":\"Name a colour\"},{\"role\":\"assistant\",\"content\":\"The colour is\"}]",
     NULL, NULL},
    {"unicode, markup-like text, empty user",
     "[{\"role\":\"user\",\"content\":\"caf\\u00e9 \\u4e2d\\u6587 \\ud83d\\ude00 <tool_result>x</tool_result> \\n\\t\"},"
     "{\"role\":\"assistant\",\"content\":\"ok\"},{\"role\":\"user\",\"content\":\"\"}]", NULL, NULL},
    {"tool result then user text in one turn",
     "[{\"role\":\"user\",\"content\":\"go\"},{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"x\","
     "\"type\":\"function\",\"function\":{\"name\":\"read_file\",\"arguments\":\"{\\\"path\\\":\\\"\\u00e9/\\\\\\\"q\\\\\\\"\\\\n\\\"}\"}}]},"
     "{\"role\":\"tool\",\"tool_call_id\":\"x\",\"content\":\"done\"},{\"role\":\"user\",\"content\":\"and now?\"}]",
     TOOLS, NULL},
};
#define N_CORPUS (sizeof corpus / sizeof *corpus)

/* ---- helpers ---- */

static json_t *must(const char *text)
{
    json_error_t e;
    json_t *v = json_loads(text, 0, &e);
    if (!v) printf("      bad JSON in the corpus: %s: %s\n", e.text, text);
    return v;
}

/* The request body kvtier parses. */
static char *request_body(const tcase *c, bool thinking)
{
    json_t *b = json_object();
    json_object_set_new(b, "messages", must(c->messages));
    if (c->tools) json_object_set_new(b, "tools", must(c->tools));
    if (thinking) json_object_set_new(b, "chat_template_kwargs", json_pack("{s:b}", "thinking", 1));
    if (c->effort) json_object_set_new(b, "reasoning_effort", json_string(c->effort));
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

/* Whether the conversation ends with an assistant turn without tool calls. */
static bool is_prefill(const json_t *msgs)
{
    const json_t *last = json_array_get(msgs, json_array_size(msgs) - 1);
    return !strcmp(json_string_value(json_object_get(last, "role")), "assistant") &&
           json_array_size(json_object_get(last, "tool_calls")) == 0;
}

/* The template context for case c (see the header). */
static json_t *context(const tcase *c, bool thinking, bool drop_thinking)
{
    json_t *msgs = must(c->messages), *ctx = json_object();
    size_t i, k;
    json_t *m, *tc;
    json_array_foreach(msgs, i, m) {
        json_t *parts = json_object_get(m, "content"), *p;
        if (json_is_array(parts)) { /* text parts: one string, "\n\n" between them */
            char *joined = strdup("");
            json_array_foreach(parts, k, p) {
                const char *t = json_string_value(json_object_get(p, "text"));
                size_t a = strlen(joined), b = strlen(t);
                joined = realloc(joined, a + b + 3);
                if (k) strcpy(joined + a, "\n\n"), a += 2;
                strcpy(joined + a, t);
            }
            json_object_set_new(m, "content", json_string(joined));
            free(joined);
        }
        json_array_foreach(json_object_get(m, "tool_calls"), k, tc) {
            json_t *fn = json_object_get(tc, "function");
            const char *args = json_string_value(json_object_get(fn, "arguments"));
            if (args) json_object_set_new(fn, "arguments", must(args));
        }
    }
    json_object_set_new(ctx, "add_generation_prompt", json_boolean(!is_prefill(msgs)));
    json_object_set_new(ctx, "messages", msgs);
    if (c->tools) json_object_set_new(ctx, "tools", must(c->tools));
    json_object_set_new(ctx, "bos_token", json_string(BOS));
    json_object_set_new(ctx, "thinking", json_boolean(thinking));
    json_object_set_new(ctx, "drop_thinking", json_boolean(drop_thinking));
    if (c->effort) json_object_set_new(ctx, "reasoning_effort", json_string(c->effort));
    return ctx;
}

/* Render the contexts with the template: n strings (malloc'ed) in want[];
 * false when the script failed. */
static bool render_all(json_t *contexts, char **want, size_t n)
{
    char dir[] = "/tmp/kvt-tpl-XXXXXX";
    if (!mkdtemp(dir)) return false;
    char in[64], out[64];
    snprintf(in, sizeof in, "%s/cases.json", dir);
    snprintf(out, sizeof out, "%s/out", dir);
    bool ok = json_dump_file(contexts, in, JSON_COMPACT) == 0;
    int st = 0;
    const char *argv[] = {"node", TPL_SCRIPT, BUNDLE, V4_TEMPLATE, in, NULL};
    ok = ok && fx_run(argv, out, 120.0, &st) == 1 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
    size_t len = 0;
    char *text = ok ? kvt_test_read_file(out, &len) : NULL;
    if (!ok) fx_print_file("render.mjs", out);
    char *line = text, *save = NULL;
    for (size_t i = 0; i < n && ok; i++) {
        char *l = strtok_r(i ? NULL : line, "\n", &save);
        json_t *v = l ? json_loads(l, JSON_DECODE_ANY, NULL) : NULL;
        ok = json_is_string(v);
        if (!ok) printf("      render.mjs, case %zu: %s\n", i, l ? l : "(no line)");
        else want[i] = strndup(json_string_value(v), json_string_length(v));
        json_decref(v);
    }
    free(text);
    unlink(in);
    unlink(out);
    rmdir(dir);
    return ok;
}

TEST(template_deepseek_v4)
{
    const char *why = skip_reason();
    if (why) SKIP("%s", why);
    double secs;
    if (!fx_peer_ensure(&secs)) SKIP("the llama.cpp peer packages could not be installed (offline?)");
    if (!jinja_ensure()) SKIP("@huggingface/jinja could not be installed (offline?)");
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_preset(&m, "ds4-tiny", 1, NULL));

    /* per case and mode: the template as kvtier renders it, the mode
     * flipped (negative control), and for thinking the default drop_thinking */
    enum { N = N_CORPUS * 2 };
    json_t *ctxs = json_array();
    for (size_t i = 0; i < N; i++) {
        bool th = i >= N_CORPUS;
        const tcase *c = &corpus[i % N_CORPUS];
        json_array_append_new(ctxs, context(c, th, !th));
    }
    for (size_t i = 0; i < N; i++) {
        bool th = i >= N_CORPUS;
        json_array_append_new(ctxs, context(&corpus[i % N_CORPUS], !th, th));
    }
    for (size_t i = 0; i < N_CORPUS; i++) json_array_append_new(ctxs, context(&corpus[i], true, true));
    size_t total = json_array_size(ctxs);
    char **want = calloc(total, sizeof *want);
    CHECK(want);
    bool rendered = render_all(ctxs, want, total);
    json_decref(ctxs);
    if (!rendered) { free(want); kvt_model_close(m); }
    CHECK(rendered);

    size_t n_same = 0, n_flip_differs = 0, n_drop_differs = 0;
    for (size_t i = 0; i < N; i++) {
        bool th = i >= N_CORPUS;
        const tcase *c = &corpus[i % N_CORPUS];
        char *body = request_body(c, th);
        kvt_request r;
        int rc = kvt_request_parse(&r, KVT_API_CHAT, body, strlen(body), m, NULL);
        free(body);
        if (rc) { printf("      %s: %s\n", c->name, kvt_errmsg()); continue; }
        /* a prefill continues the last turn: no final end-of-sentence */
        json_t *msgs = must(c->messages);
        size_t wl = strlen(want[i]);
        if (is_prefill(msgs) && wl >= strlen(EOS) && !strcmp(want[i] + wl - strlen(EOS), EOS)) wl -= strlen(EOS);
        json_decref(msgs);
        bool same = r.prompt_len == wl && !memcmp(r.prompt, want[i], wl);
        if (same) n_same++;
        else {
            size_t k = 0;
            while (k < wl && k < r.prompt_len && r.prompt[k] == want[i][k]) k++;
            printf("      %s (%s): first difference at byte %zu\n      template '%s'\n", c->name,
                   th ? "thinking" : "non-thinking", k, kvt_test_esc(want[i] + k, wl - k < 160 ? wl - k : 160));
            printf("      kvtier   '%s'\n", kvt_test_esc(r.prompt + k, r.prompt_len - k < 160 ? r.prompt_len - k : 160));
        }
        const char *flip = want[N + i];
        n_flip_differs += strlen(flip) < r.prompt_len || memcmp(flip, r.prompt, r.prompt_len) != 0;
        if (th) {
            const char *drop = want[2 * N + i % N_CORPUS];
            n_drop_differs += strcmp(drop, want[i]) != 0;
        }
        kvt_request_free(&r);
    }
    for (size_t i = 0; i < total; i++) free(want[i]);
    free(want);
    kvt_model_close(m);
    printf("    template_deepseek_v4: %zu of %d renderings byte for byte; the flipped mode differs in %zu; "
           "the default drop_thinking rewrites %zu thinking histories\n",
           n_same, (int)N, n_flip_differs, n_drop_differs);
    CHECK(n_same == N);
    CHECK(n_flip_differs == N);
    CHECK(n_drop_differs >= 1);
}
