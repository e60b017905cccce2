/* API-shape tests (src/api.c): realistic OpenAI and Anthropic request bodies,
 * every refusal with its status, the exact deepseek and plain renderings, the
 * prefix property that prefix caching depends on (with a negative control),
 * response / SSE / error / model bodies parsed back with jansson field by
 * field, and a seeded mutation fuzz of the parser.
 *
 * Every body is parsed from a heap copy of exactly its length, without a NUL,
 * so an over-read shows under `make asan`. */
#include "test.h"
#include "api.h"
#include "model.h"
#include "tokenizer.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#define FW "\xef\xbd\x9c"
#define SPM "\xe2\x96\x81"
#define BOS "<" FW "begin" SPM "of" SPM "sentence" FW ">"
#define EOS "<" FW "end" SPM "of" SPM "sentence" FW ">"
#define USR "<" FW "User" FW ">"
#define AST "<" FW "Assistant" FW ">"

/* ---- helpers ------------------------------------------------------------- */

static kvt_model *tiny(void)
{
    kvt_model *m = NULL;
    if (kvt_model_preset(&m, "ds4-tiny", 1, NULL)) return NULL;
    return m;
}

static kvt_model *stories(void)
{
    const char *p = kvt_test_shared("models/stories260K.gguf");
    kvt_model *m = NULL;
    if (!p || kvt_model_open(&m, p)) return NULL;
    return m;
}

/* Parse body from an exact-size heap copy (no NUL after it). */
static int parse(kvt_request *r, kvt_api api, const char *body, const kvt_model *m, int *status)
{
    size_t n = strlen(body);
    char *copy = malloc(n ? n : 1);
    if (!copy) return KVT_ENOMEM;
    memcpy(copy, body, n);
    int rc = kvt_request_parse(r, api, copy, n, m, status);
    free(copy);
    return rc;
}

/* Printable form of text for failure messages (static buffer). */
static const char *esc(const char *s, size_t n)
{
    static char buf[2048];
    size_t o = 0;
    for (size_t i = 0; i < n && o + 8 < sizeof buf; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') o += (size_t)snprintf(buf + o, sizeof buf - o, "\\n");
        else if (c < 0x20 || c == 0x7f) o += (size_t)snprintf(buf + o, sizeof buf - o, "\\x%02x", c);
        else buf[o++] = (char)c;
    }
    buf[o] = 0;
    return buf;
}

static bool prompt_is(const kvt_request *r, const char *want)
{
    size_t n = strlen(want);
    bool ok = r->prompt && r->prompt_len == n && !memcmp(r->prompt, want, n) && r->prompt[n] == 0;
    if (!ok) {
        printf("      want '%s'\n", esc(want, n));
        if (r->prompt) printf("      got  '%s'\n", esc(r->prompt, r->prompt_len));
    }
    return ok;
}

static json_t *load(const char *s)
{
    json_error_t e;
    json_t *v = s ? json_loads(s, 0, &e) : NULL;
    if (s && !v) printf("      bad JSON (%s): %s\n", e.text, s);
    return v;
}

/* The value at "a.b.0.c" (array elements by index), or NULL. */
static json_t *at(const json_t *o, const char *path)
{
    char key[64];
    json_t *v = (json_t *)o;
    while (v && *path) {
        size_t k = strcspn(path, ".");
        if (k >= sizeof key) return NULL;
        memcpy(key, path, k);
        key[k] = 0;
        path += k + (path[k] == '.');
        if (json_is_array(v)) v = json_array_get(v, strtoul(key, NULL, 10));
        else v = json_object_get(v, key);
    }
    return v;
}

static const char *sget(const json_t *o, const char *path) { return json_string_value(at(o, path)); }
static long long iget(const json_t *o, const char *path)
{
    json_t *v = at(o, path);
    return json_is_integer(v) ? json_integer_value(v) : -999;
}
static bool streq(const char *a, const char *b) { return a && b && !strcmp(a, b); }
static bool is_null(const json_t *o, const char *path) { return json_is_null(at(o, path)); }

/* One SSE event: its "event:" name (or "") and parsed data (NULL for [DONE]). */
typedef struct event { char name[32]; json_t *data; bool done; } event;

/* Split SSE text into events; every event must be well formed: optional
 * "event: X\n", then one "data: ...\n", then a blank line. */
static int split_sse(const char *s, event *ev, int max)
{
    int n = 0;
    while (*s) {
        if (n == max) return -1;
        event *e = &ev[n];
        memset(e, 0, sizeof *e);
        if (!strncmp(s, "event: ", 7)) {
            const char *nl = strchr(s, '\n');
            if (!nl || (size_t)(nl - s - 7) >= sizeof e->name) return -1;
            memcpy(e->name, s + 7, (size_t)(nl - s - 7));
            s = nl + 1;
        }
        if (strncmp(s, "data: ", 6)) return -1;
        const char *end = strstr(s, "\n\n");
        if (!end) return -1;
        char *d = strndup(s + 6, (size_t)(end - s - 6));
        if (!d || strchr(d, '\n')) { free(d); return -1; }
        if (!strcmp(d, "[DONE]")) e->done = true;
        else if (!(e->data = load(d))) { free(d); return -1; }
        free(d);
        s = end + 2;
        n++;
    }
    return n;
}

static void free_events(event *ev, int n)
{
    for (int i = 0; i < n; i++) json_decref(ev[i].data);
}

/* Append a string to a growing event text. */
static void cat(char **acc, char *s)
{
    if (!s) return;
    size_t a = *acc ? strlen(*acc) : 0, b = strlen(s);
    char *p = realloc(*acc, a + b + 1);
    if (p) { memcpy(p + a, s, b + 1); *acc = p; }
    free(s);
}

/* ---- parsing realistic bodies ------------------------------------------- */

TEST(api_parse_chat)
{
    kvt_model *m = tiny();
    CHECK(m);
    CHECK(!strcmp(kvt_template_name(m), "deepseek"));
    /* What the openai client sends for a typical call, plus fields we ignore. */
    const char *body =
        "{\"model\":\"kvtier\",\"messages\":["
        "{\"role\":\"system\",\"content\":\"You are terse.\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Part one.\"},"
        "{\"type\":\"text\",\"text\":\"Part two.\"}],\"name\":\"ann\"}],"
        "\"stream\":true,\"stream_options\":{\"include_usage\":true},"
        "\"max_completion_tokens\":64,\"max_tokens\":9,\"temperature\":0.25,\"top_p\":0.9,"
        "\"seed\":-1,\"stop\":\"\\n\\n\",\"n\":1,\"user\":\"u-1\",\"store\":false,\"metadata\":{\"a\":\"b\"},"
        "\"logprobs\":false,\"frequency_penalty\":0,\"presence_penalty\":null,\"response_format\":{\"type\":\"text\"},"
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"auto\","
        "\"parallel_tool_calls\":true,\"service_tier\":\"auto\",\"top_logprobs\":null}";
    kvt_request r;
    int st = 0;
    CHECK_OK(parse(&r, KVT_API_CHAT, body, m, &st));
    kvt_model_close(m);
    CHECK(st == 200);
    CHECK(r.api == KVT_API_CHAT);
    CHECK(streq(r.model, "kvtier"));
    CHECK(r.stream && r.include_usage);
    CHECK(r.max_tokens == 64); /* max_completion_tokens wins over max_tokens */
    CHECK(r.temperature == 0.25f && r.top_p == 0.9f && r.top_k == 0);
    CHECK(r.has_seed && r.seed == UINT64_MAX);
    CHECK(r.n_stop == 1 && streq(r.stop[0], "\n\n"));
    CHECK(r.prompt_has_bos);
    CHECK(prompt_is(&r, BOS "You are terse." USR "Part one.\n\nPart two." AST));
    kvt_request_free(&r);
    CHECK(!r.prompt && !r.stop && !r.model);
    kvt_request_free(&r); /* twice is fine: the first zeroed it */
    kvt_request_free(NULL);
}

TEST(api_parse_chat_defaults)
{
    kvt_model *m = tiny();
    CHECK(m);
    kvt_request r;
    int st;
    CHECK_OK(parse(&r, KVT_API_CHAT,
                   "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stop\":[\"END\",\"\",\"###\"],"
                   "\"max_tokens\":12.0,\"stream\":false,\"stream_options\":null,\"temperature\":0,\"top_p\":0}",
                   m, &st));
    kvt_model_close(m);
    CHECK(!r.model && !r.stream && !r.include_usage && !r.has_seed);
    CHECK(r.max_tokens == 12);       /* an integral real is an integer */
    CHECK(r.temperature == 0);       /* greedy */
    CHECK(r.top_p > 0 && r.top_p < 1e-30f); /* 0 keeps only the top token */
    CHECK(r.n_stop == 2 && streq(r.stop[0], "END") && streq(r.stop[1], "###")); /* "" dropped */
    CHECK(prompt_is(&r, BOS USR "hi" AST));
    kvt_request_free(&r);

    CHECK_OK(parse(&r, KVT_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", NULL, &st));
    CHECK(r.max_tokens == 0 && r.temperature == 1 && r.top_p == 1 && r.top_k == 0 && r.n_stop == 0 && !r.stop);
    CHECK(!r.prompt_has_bos && prompt_is(&r, "x")); /* no model: plain */
    kvt_request_free(&r);
}

TEST(api_parse_completions)
{
    kvt_model *m = tiny();
    CHECK(m);
    kvt_request r;
    int st;
    CHECK_OK(parse(&r, KVT_API_COMPLETIONS,
                   "{\"model\":\"m\",\"prompt\":\"Once upon a time\",\"max_tokens\":16,\"stream\":true,"
                   "\"stream_options\":{\"include_usage\":false},\"stop\":[\".\",\"!\"],\"top_k\":40,"
                   "\"seed\":7,\"logprobs\":null,\"echo\":false,\"best_of\":1,\"suffix\":null,\"n\":1}",
                   m, &st));
    CHECK(st == 200 && r.api == KVT_API_COMPLETIONS);
    CHECK(!r.prompt_has_bos); /* verbatim, even for a ds4 model */
    CHECK(prompt_is(&r, "Once upon a time"));
    CHECK(r.stream && !r.include_usage && r.max_tokens == 16 && r.top_k == 40 && r.has_seed && r.seed == 7);
    CHECK(r.n_stop == 2 && streq(r.stop[1], "!"));
    kvt_request_free(&r);

    /* An array holding one string; text kept byte for byte. */
    CHECK_OK(parse(&r, KVT_API_COMPLETIONS, "{\"prompt\":[\"  a\\tb \\n\"]}", m, &st));
    CHECK(prompt_is(&r, "  a\tb \n"));
    kvt_request_free(&r);
    CHECK_OK(parse(&r, KVT_API_COMPLETIONS, "{\"prompt\":\"\"}", m, &st));
    CHECK(prompt_is(&r, ""));
    kvt_request_free(&r);
    kvt_model_close(m);
}

TEST(api_parse_messages)
{
    kvt_model *m = tiny();
    CHECK(m);
    /* Shaped like @anthropic-ai/sdk traffic: system blocks with cache_control,
     * string and block content, an assistant turn, metadata. */
    const char *body =
        "{\"model\":\"claude-x\",\"max_tokens\":1024,"
        "\"system\":[{\"type\":\"text\",\"text\":\"Sys A\",\"cache_control\":{\"type\":\"ephemeral\"}},"
        "{\"type\":\"text\",\"text\":\"Sys B\"}],"
        "\"messages\":[{\"role\":\"user\",\"content\":\"Q1\"},"
        "{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"A1\"}]},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Q2\",\"cache_control\":{\"type\":\"ephemeral\"}}]}],"
        "\"stop_sequences\":[\"\\n\\nHuman:\"],\"temperature\":0.7,\"top_k\":5,\"top_p\":0.95,\"stream\":true,"
        "\"metadata\":{\"user_id\":\"x\"},\"tools\":[],\"thinking\":{\"type\":\"disabled\"},\"service_tier\":\"auto\"}";
    kvt_request r;
    int st;
    CHECK_OK(parse(&r, KVT_API_MESSAGES, body, m, &st));
    CHECK(r.api == KVT_API_MESSAGES && streq(r.model, "claude-x"));
    CHECK(r.max_tokens == 1024 && r.top_k == 5 && r.temperature == 0.7f && r.top_p == 0.95f && r.stream);
    CHECK(r.n_stop == 1 && streq(r.stop[0], "\n\nHuman:"));
    CHECK(prompt_is(&r, BOS "Sys A\n\nSys B" USR "Q1" AST "A1" EOS USR "Q2" AST));
    kvt_request_free(&r);

    /* System as a string, and a trailing assistant turn is a prefill: the
     * reply continues it. */
    CHECK_OK(parse(&r, KVT_API_MESSAGES,
                   "{\"max_tokens\":5,\"system\":\"S\",\"messages\":[{\"role\":\"user\",\"content\":\"Q\"},"
                   "{\"role\":\"assistant\",\"content\":\"The answer is\"}]}", m, &st));
    CHECK(prompt_is(&r, BOS "S" USR "Q" AST "The answer is"));
    kvt_request_free(&r);
    /* An empty system is no system. */
    CHECK_OK(parse(&r, KVT_API_MESSAGES,
                   "{\"max_tokens\":5,\"system\":[],\"messages\":[{\"role\":\"user\",\"content\":\"Q\"}]}", m, &st));
    CHECK(prompt_is(&r, BOS USR "Q" AST));
    kvt_request_free(&r);
    kvt_model_close(m);
}

/* ---- templates -------------------------------------------------------------- */

TEST(api_deepseek_two_turns_exact)
{
    kvt_model *m = tiny();
    CHECK(m);
    kvt_request r;
    int st;
    CHECK_OK(parse(&r, KVT_API_CHAT,
                   "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                   "{\"role\":\"user\",\"content\":\"Hello?\"},{\"role\":\"assistant\",\"content\":\"Hi.\"},"
                   "{\"role\":\"user\",\"content\":\"And now?\"}]}", m, &st));
    const char *want = "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>Be brief."
                       "<\xef\xbd\x9cUser\xef\xbd\x9c>Hello?"
                       "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>Hi.<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"
                       "<\xef\xbd\x9cUser\xef\xbd\x9c>And now?"
                       "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>";
    CHECK(prompt_is(&r, want));
    CHECK(r.prompt_has_bos);
    /* Tokenized as the server does (no added BOS, specials parsed), every
     * marker is one special token of the byte tokenizer. */
    int32_t *ids;
    size_t n;
    CHECK_OK(kvt_tokenizer_encode(m->tok, r.prompt, r.prompt_len, false, true, &ids, &n));
    size_t want_n = 1 + 9 + 1 + 6 + 1 + 3 + 1 + 1 + 8 + 1;
    bool ok = n == want_n && ids[0] == 256 && ids[10] == 258 && ids[17] == 259 && ids[21] == 257 &&
              ids[22] == 258 && ids[31] == 259 && ids[1] == 'B';
    if (!ok) {
        printf("      %zu ids:", n);
        for (size_t i = 0; i < n; i++) printf(" %d", ids[i]);
        printf("\n");
    }
    free(ids);
    kvt_request_free(&r);
    kvt_model_close(m);
    CHECK(ok);
}

TEST(api_deepseek_system_hoisted)
{
    kvt_model *m = tiny();
    CHECK(m);
    kvt_request r;
    int st;
    /* system and developer messages anywhere join the system part, in order. */
    CHECK_OK(parse(&r, KVT_API_CHAT,
                   "{\"messages\":[{\"role\":\"developer\",\"content\":\"D1\"},{\"role\":\"user\",\"content\":\"U1\"},"
                   "{\"role\":\"assistant\",\"content\":null},{\"role\":\"system\",\"content\":[{\"type\":\"text\","
                   "\"text\":\"S2\"}]},{\"role\":\"user\",\"content\":\"U2\"}]}", m, &st));
    CHECK(prompt_is(&r, BOS "D1\n\nS2" USR "U1" AST EOS USR "U2" AST));
    kvt_request_free(&r);
    /* Anthropic's "system" comes before system messages (a leniency). */
    CHECK_OK(parse(&r, KVT_API_MESSAGES,
                   "{\"max_tokens\":1,\"system\":\"top\",\"messages\":[{\"role\":\"system\",\"content\":\"inner\"},"
                   "{\"role\":\"user\",\"content\":\"U\"}]}", m, &st));
    CHECK(prompt_is(&r, BOS "top\n\ninner" USR "U" AST));
    kvt_request_free(&r);
    kvt_model_close(m);
}

TEST(api_plain_stories)
{
    kvt_model *m = stories();
    if (!m) SKIP("shared/models/stories260K.gguf not found");
    CHECK(!strcmp(kvt_template_name(m), "plain"));
    CHECK(!strcmp(kvt_template_name(NULL), "plain"));
    kvt_request r;
    int st;
    /* At its position, system text is just text; no markers anywhere. */
    int rc = parse(&r, KVT_API_CHAT,
                   "{\"messages\":[{\"role\":\"user\",\"content\":\"Once upon a time\"},"
                   "{\"role\":\"system\",\"content\":\"there was\"},{\"role\":\"assistant\",\"content\":"
                   "[{\"type\":\"text\",\"text\":\"a cat.\"},{\"type\":\"text\",\"text\":\" It ran. \"}]}]}",
                   m, &st);
    if (rc) { kvt_model_close(m); CHECK_OK(rc); }
    bool ok = prompt_is(&r, "Once upon a time\n\nthere was\n\na cat.\n\n It ran. ") && !r.prompt_has_bos;
    /* The server tokenizes with the model's add_bos: BOS first, then text
     * that decodes back to the prompt. */
    int32_t *ids = NULL;
    size_t n = 0;
    char *back = NULL;
    size_t bl = 0;
    kvt_model_info info;
    kvt_model_info_get(m, &info);
    ok = ok && kvt_tokenize(m, r.prompt, r.prompt_len, -1, &ids, &n) == KVT_OK && n > 1 && info.add_bos &&
         ids[0] == info.bos && kvt_detokenize(m, ids, n, &back, &bl) == KVT_OK && bl == r.prompt_len &&
         !memcmp(back, r.prompt, bl);
    free(ids);
    free(back);
    kvt_request_free(&r);
    CHECK_OK(parse(&r, KVT_API_MESSAGES,
                   "{\"max_tokens\":8,\"system\":\"S\",\"messages\":[{\"role\":\"user\",\"content\":\"Q\"}]}", m, &st));
    ok = ok && prompt_is(&r, "S\n\nQ") && !r.prompt_has_bos;
    kvt_request_free(&r);
    kvt_model_close(m);
    CHECK(ok);
}

/* ---- the prefix property ---------------------------------------------------- */

/* A conversation with awkward text: leading/trailing whitespace, newlines,
 * non-ASCII, JSON escapes, text that looks like the separator, multi-part
 * content, a system prompt and a mid-conversation developer message. Each
 * entry is one JSON message. */
static const char *const convo[] = {
    "{\"role\":\"system\",\"content\":\"  You answer in \\\"quotes\\\".\\n\"}",
    "{\"role\":\"user\",\"content\":\"Hello \\u00e9\\u4e16\\n\\n\"}",
    "{\"role\":\"assistant\",\"content\":\" Hi!  \"}",
    "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"\\n\\npart\"},{\"type\":\"text\",\"text\":\"\\t\"}]}",
    "{\"role\":\"assistant\",\"content\":\"\"}",
    "{\"role\":\"user\",\"content\":\"\\ud83d\\ude00 end \"}",
    "{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"x\\r\\n\"}]}",
    "{\"role\":\"user\",\"content\":\"last\"}",
};
#define N_CONVO (sizeof convo / sizeof *convo)

/* Render convo[0..k) for api (Anthropic: convo[0] becomes "system"). */
static int render_k(kvt_request *r, kvt_api api, const kvt_model *m, size_t k)
{
    char body[4096];
    size_t o = 0;
    size_t first = 0;
    if (api == KVT_API_MESSAGES) {
        o += (size_t)snprintf(body + o, sizeof body - o,
                              "{\"max_tokens\":9,\"system\":[{\"type\":\"text\",\"text\":\"  You answer in "
                              "\\\"quotes\\\".\\n\"}],\"messages\":[");
        first = 1;
    } else {
        o += (size_t)snprintf(body + o, sizeof body - o, "{\"messages\":[");
    }
    for (size_t i = first; i < k; i++)
        o += (size_t)snprintf(body + o, sizeof body - o, "%s%s", i > first ? "," : "", convo[i]);
    snprintf(body + o, sizeof body - o, "]}");
    int st;
    return parse(r, api, body, m, &st);
}

static bool is_prefix(const kvt_request *a, const kvt_request *b)
{
    return a->prompt_len <= b->prompt_len && !memcmp(a->prompt, b->prompt, a->prompt_len);
}

/* Render turns 1..k for k = 2..N (1 for the chat api: a lone system message
 * is a conversation too) and check each rendering is a prefix of the next,
 * in text and, for deepseek, in token ids as the server tokenizes them. */
static void check_prefix(const kvt_model *m, kvt_api api)
{
    kvt_request prev = {0}, cur;
    int32_t *pids = NULL, *ids = NULL;
    size_t pn = 0, n = 0;
    for (size_t k = 2; k <= N_CONVO; k++) {
        CHECK_OK(render_k(&cur, api, m, k));
        if (k > 2) {
            bool ok = is_prefix(&prev, &cur);
            if (!ok) {
                printf("      api %d: turn %zu rendering is not a prefix of turn %zu's\n", (int)api, k - 1, k);
                printf("      prev '%s'\n", esc(prev.prompt, prev.prompt_len));
                printf("      cur  '%s'\n", esc(cur.prompt, cur.prompt_len));
            }
            if (ok && m && cur.prompt_has_bos) {
                if (kvt_tokenizer_encode(m->tok, cur.prompt, cur.prompt_len, false, true, &ids, &n)) ok = false;
                else ok = pn <= n && !memcmp(pids, ids, pn * sizeof *ids);
                if (!ok) printf("      token ids of turn %zu are not a prefix of turn %zu's\n", k - 1, k);
            }
            if (!ok) { free(pids); free(ids); kvt_request_free(&prev); kvt_request_free(&cur); CHECK(ok); }
        } else if (m && cur.prompt_has_bos) {
            CHECK_OK(kvt_tokenizer_encode(m->tok, cur.prompt, cur.prompt_len, false, true, &ids, &n));
        }
        free(pids);
        pids = ids;
        pn = n;
        ids = NULL;
        kvt_request_free(&prev);
        prev = cur;
    }
    free(pids);
    kvt_request_free(&prev);
}

TEST(api_prefix_deepseek)
{
    kvt_model *m = tiny();
    CHECK(m);
    check_prefix(m, KVT_API_CHAT);
    if (!kvt_test_failed()) check_prefix(m, KVT_API_MESSAGES);
    /* The real flow: the prompt for [u1] plus the generated reply and its
     * end-of-sentence token is where the prompt for [u1, a1, u2] begins. */
    kvt_request r1 = {0}, r2 = {0};
    int st;
    if (!kvt_test_failed() &&
        !parse(&r1, KVT_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"u1\"}]}", m, &st) &&
        !parse(&r2, KVT_API_CHAT,
               "{\"messages\":[{\"role\":\"user\",\"content\":\"u1\"},{\"role\":\"assistant\",\"content\":\" a1\\n\"},"
               "{\"role\":\"user\",\"content\":\"u2\"}]}", m, &st)) {
        const char *gen = " a1\n" EOS;
        bool ok = r2.prompt_len > r1.prompt_len + strlen(gen) && is_prefix(&r1, &r2) &&
                  !memcmp(r2.prompt + r1.prompt_len, gen, strlen(gen));
        if (!ok) printf("      r2 '%s'\n", esc(r2.prompt, r2.prompt_len));
        kvt_request_free(&r1);
        kvt_request_free(&r2);
        kvt_model_close(m);
        CHECK(ok);
        return;
    }
    kvt_request_free(&r1);
    kvt_request_free(&r2);
    kvt_model_close(m);
    CHECK(!kvt_test_failed());
}

TEST(api_prefix_plain)
{
    kvt_model *m = stories();
    if (!m) SKIP("shared/models/stories260K.gguf not found");
    check_prefix(m, KVT_API_CHAT);
    if (!kvt_test_failed()) check_prefix(m, KVT_API_MESSAGES);
    kvt_model_close(m);
}

/* Negative control: the check above is not vacuous. Editing an earlier turn,
 * or a template that trimmed whitespace, breaks the property, and the
 * renderer keeps the whitespace that trimming would remove. */
TEST(api_prefix_negative_control)
{
    kvt_model *m = tiny();
    CHECK(m);
    kvt_request a, b;
    int st;
    CHECK_OK(parse(&a, KVT_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"tell me \"}]}", m, &st));
    CHECK_OK(parse(&b, KVT_API_CHAT,
                   "{\"messages\":[{\"role\":\"user\",\"content\":\"tell you \"},"
                   "{\"role\":\"assistant\",\"content\":\"ok\"},{\"role\":\"user\",\"content\":\"more\"}]}", m, &st));
    bool edited = is_prefix(&a, &b);
    bool kept = strstr(a.prompt, USR "tell me " AST) != NULL; /* the trailing space is text */
    kvt_request_free(&a);
    kvt_request_free(&b);
    kvt_model_close(m);
    CHECK(!edited);
    CHECK(kept);
}

/* ---- refusals --------------------------------------------------------------- */

typedef struct bad_case {
    kvt_api api;
    const char *body;
    const char *needle; /* in the message */
} bad_case;

#define U "[{\"role\":\"user\",\"content\":\"x\"}]"
static const bad_case bad_cases[] = {
    {KVT_API_CHAT, "", "empty"},
    {KVT_API_CHAT, "{", "not valid JSON"},
    {KVT_API_CHAT, "{\"messages\":" U "} trailing", "not valid JSON"},
    {KVT_API_CHAT, "[1]", "JSON object"},
    {KVT_API_CHAT, "\"str\"", "not valid JSON"},
    {KVT_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000b\"}]}", "not valid JSON"},
    {KVT_API_CHAT, "{}", "\"messages\": required"},
    {KVT_API_CHAT, "{\"messages\":null}", "\"messages\": required"},
    {KVT_API_CHAT, "{\"messages\":{\"role\":\"user\"}}", "expected an array"},
    {KVT_API_CHAT, "{\"messages\":[]}", "at least one"},
    {KVT_API_CHAT, "{\"messages\":[\"hi\"]}", "messages[0]"},
    {KVT_API_CHAT, "{\"messages\":[{\"content\":\"x\"}]}", "messages[0].role"},
    {KVT_API_CHAT, "{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", "unknown role"},
    {KVT_API_CHAT, "{\"messages\":[{\"role\":\"tool\",\"content\":\"x\",\"tool_call_id\":\"1\"}]}", "tool"},
    {KVT_API_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"1\"}]}]}",
     "tool calls"},
    {KVT_API_CHAT, "{\"messages\":[{\"role\":\"user\"}]}", "messages[0].content\": required"},
    {KVT_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", "messages[0].content"},
    {KVT_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[\"x\"]}]}", "content[0]"},
    {KVT_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"text\":\"x\"}]}]}", "content[0].type"},
    {KVT_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]}", "content[0].text"},
    {KVT_API_CHAT,
     "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"see\"},"
     "{\"type\":\"image_url\",\"image_url\":{\"url\":\"data:image/png;base64,AAAA\"}}]}]}",
     "\"image_url\" is not supported: this model reads text only"},
    {KVT_API_CHAT,
     "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"input_audio\",\"input_audio\":{}}]}]}",
     "\"input_audio\" is not supported"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"max_tokens\":-1}", "\"max_tokens\""},
    {KVT_API_CHAT, "{\"messages\":" U ",\"max_tokens\":0}", "\"max_tokens\""},
    {KVT_API_CHAT, "{\"messages\":" U ",\"max_tokens\":1.5}", "expected an integer"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"max_tokens\":\"10\"}", "expected an integer, got a string"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"max_tokens\":4294967296}", "outside"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"max_completion_tokens\":-5}", "\"max_completion_tokens\""},
    {KVT_API_CHAT, "{\"messages\":" U ",\"temperature\":\"hot\"}", "\"temperature\": expected a number"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"temperature\":2.5}", "outside"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"temperature\":-0.1}", "outside"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"top_p\":1.5}", "\"top_p\""},
    {KVT_API_CHAT, "{\"messages\":" U ",\"top_k\":-1}", "\"top_k\""},
    {KVT_API_CHAT, "{\"messages\":" U ",\"seed\":\"x\"}", "\"seed\""},
    {KVT_API_CHAT, "{\"messages\":" U ",\"stream\":\"yes\"}", "\"stream\": expected a boolean"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"stream\":1}", "\"stream\""},
    {KVT_API_CHAT, "{\"messages\":" U ",\"stream_options\":true}", "\"stream_options\""},
    {KVT_API_CHAT, "{\"messages\":" U ",\"stream_options\":{\"include_usage\":1}}", "include_usage"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}", "at most 4"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"stop\":3}", "\"stop\""},
    {KVT_API_CHAT, "{\"messages\":" U ",\"stop\":[\"a\",3]}", "\"stop[1]\""},
    {KVT_API_CHAT, "{\"messages\":" U ",\"model\":5}", "\"model\""},
    {KVT_API_CHAT, "{\"messages\":" U ",\"n\":2}", "\"n\""},
    {KVT_API_COMPLETIONS, "{\"model\":\"m\"}", "\"prompt\": required"},
    {KVT_API_COMPLETIONS, "{\"prompt\":5}", "\"prompt\": expected a string"},
    {KVT_API_COMPLETIONS, "{\"prompt\":[]}", "empty"},
    {KVT_API_COMPLETIONS, "{\"prompt\":[1,2,3]}", "token-id"},
    {KVT_API_COMPLETIONS, "{\"prompt\":[[1,2]]}", "token-id"},
    {KVT_API_COMPLETIONS, "{\"prompt\":[\"a\",\"b\"]}", "batches of 2"},
    {KVT_API_COMPLETIONS, "{\"prompt\":\"a\",\"echo\":true}", "\"echo\""},
    {KVT_API_COMPLETIONS, "{\"prompt\":\"a\",\"best_of\":3}", "\"best_of\""},
    {KVT_API_COMPLETIONS, "{\"prompt\":\"a\",\"suffix\":\"z\"}", "\"suffix\""},
    {KVT_API_COMPLETIONS, "{\"prompt\":\"a\",\"max_tokens\":-3}", "\"max_tokens\""},
    {KVT_API_MESSAGES, "{\"messages\":" U "}", "\"max_tokens\": required"},
    {KVT_API_MESSAGES, "{\"messages\":" U ",\"max_tokens\":null}", "\"max_tokens\": required"},
    {KVT_API_MESSAGES, "{\"messages\":" U ",\"max_tokens\":-1}", "\"max_tokens\""},
    {KVT_API_MESSAGES, "{\"max_tokens\":5,\"messages\":[]}", "at least one"},
    {KVT_API_MESSAGES, "{\"max_tokens\":5,\"messages\":" U ",\"system\":5}", "\"system\""},
    {KVT_API_MESSAGES, "{\"max_tokens\":5,\"messages\":" U ",\"system\":[{\"type\":\"image\"}]}", "\"system[0]\""},
    {KVT_API_MESSAGES, "{\"max_tokens\":5,\"messages\":" U ",\"stop_sequences\":\"x\"}", "\"stop_sequences\""},
    {KVT_API_MESSAGES, "{\"max_tokens\":5,\"messages\":" U ",\"temperature\":3}", "\"temperature\""},
    {KVT_API_MESSAGES,
     "{\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image\",\"source\":"
     "{\"type\":\"base64\",\"media_type\":\"image/png\",\"data\":\"AAAA\"}}]}]}",
     "\"image\" is not supported: this model reads text only"},
    {KVT_API_MESSAGES,
     "{\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\","
     "\"tool_use_id\":\"t\",\"content\":\"r\"}]}]}",
     "tool calls"},
    {KVT_API_MESSAGES,
     "{\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\","
     "\"content\":[{\"type\":\"tool_use\",\"id\":\"t\",\"name\":\"f\",\"input\":{}}]}]}",
     "messages[1].content[0]"},
};

TEST(api_parse_errors)
{
    kvt_model *m = tiny();
    CHECK(m);
    for (size_t i = 0; i < sizeof bad_cases / sizeof *bad_cases; i++) {
        const bad_case *c = &bad_cases[i];
        kvt_request r;
        memset(&r, 0xAB, sizeof r); /* must come back zeroed */
        int st = 0;
        int rc = parse(&r, c->api, c->body, m, &st);
        kvt_request z = {0};
        bool ok = rc == KVT_EINVAL && st == 400 && strstr(kvt_errmsg(), c->needle) && !memcmp(&r, &z, sizeof r);
        if (!ok) {
            printf("      case %zu (%s): rc %d status %d message '%s'\n", i, c->body, rc, st, kvt_errmsg());
            kvt_request_free(&r);
            kvt_model_close(m);
            CHECK(ok);
        }
    }
    /* status may be NULL; NULL out and unknown apis are caller bugs (500). */
    kvt_request r;
    CHECK(kvt_request_parse(&r, KVT_API_CHAT, "{}", 2, m, NULL) == KVT_EINVAL);
    int st = 0;
    CHECK(kvt_request_parse(NULL, KVT_API_CHAT, "{}", 2, m, &st) == KVT_EINVAL && st == 500);
    CHECK(kvt_request_parse(&r, (kvt_api)9, "{}", 2, m, &st) == KVT_EINVAL && st == 500);
    kvt_model_close(m);
}

/* ---- responses ---------------------------------------------------------------- */

static const kvt_usage U1 = {.prompt_tokens = 100, .completion_tokens = 20, .cached_tokens = 60, .created_tokens = 30};

static bool openai_usage_ok(const json_t *u, long long prompt, long long completion, long long cached)
{
    bool ok = iget(u, "prompt_tokens") == prompt && iget(u, "completion_tokens") == completion &&
              iget(u, "total_tokens") == prompt + completion &&
              iget(u, "prompt_tokens_details.cached_tokens") == cached &&
              iget(u, "prompt_cache_hit_tokens") == cached && iget(u, "prompt_cache_miss_tokens") == prompt - cached;
    if (!ok) {
        char *s = json_dumps(u, JSON_COMPACT);
        printf("      usage %s\n", s ? s : "(null)");
        free(s);
    }
    return ok;
}

static bool anthropic_usage_ok(const json_t *u, long long input, long long output, long long read,
                               long long creation)
{
    bool ok = iget(u, "input_tokens") == input && iget(u, "output_tokens") == output &&
              iget(u, "cache_read_input_tokens") == read && iget(u, "cache_creation_input_tokens") == creation;
    if (!ok) {
        char *s = json_dumps(u, JSON_COMPACT);
        printf("      usage %s\n", s ? s : "(null)");
        free(s);
    }
    return ok;
}

TEST(api_response_chat)
{
    kvt_request r = {.api = KVT_API_CHAT};
    char *s = kvt_response_json(&r, "chatcmpl-1", "kvtier", "Hello \"there\"\n", 14, "stop", NULL, &U1, 1700000000);
    json_t *j = load(s);
    free(s);
    CHECK(j);
    bool ok = streq(sget(j, "id"), "chatcmpl-1") && streq(sget(j, "object"), "chat.completion") &&
              iget(j, "created") == 1700000000 && streq(sget(j, "model"), "kvtier") &&
              json_array_size(at(j, "choices")) == 1 && iget(j, "choices.0.index") == 0 &&
              streq(sget(j, "choices.0.message.role"), "assistant") &&
              streq(sget(j, "choices.0.message.content"), "Hello \"there\"\n") &&
              is_null(j, "choices.0.message.refusal") && is_null(j, "choices.0.logprobs") &&
              streq(sget(j, "choices.0.finish_reason"), "stop") && openai_usage_ok(at(j, "usage"), 100, 20, 60);
    json_decref(j);
    CHECK(ok);
    /* length; text is len bytes, not up to a NUL */
    s = kvt_response_json(&r, "c", "m", "abcdef", 3, "length", NULL, NULL, 0);
    j = load(s);
    free(s);
    ok = j && streq(sget(j, "choices.0.message.content"), "abc") && streq(sget(j, "choices.0.finish_reason"), "length") &&
         openai_usage_ok(at(j, "usage"), 0, 0, 0);
    json_decref(j);
    CHECK(ok);
}

TEST(api_response_completions)
{
    kvt_request r = {.api = KVT_API_COMPLETIONS};
    char *s = kvt_response_json(&r, "cmpl-9", "stories", " there was a cat", 16, "length", NULL, &U1, 5);
    json_t *j = load(s);
    free(s);
    CHECK(j);
    bool ok = streq(sget(j, "id"), "cmpl-9") && streq(sget(j, "object"), "text_completion") &&
              iget(j, "created") == 5 && streq(sget(j, "model"), "stories") &&
              json_array_size(at(j, "choices")) == 1 && streq(sget(j, "choices.0.text"), " there was a cat") &&
              iget(j, "choices.0.index") == 0 && is_null(j, "choices.0.logprobs") &&
              streq(sget(j, "choices.0.finish_reason"), "length") && openai_usage_ok(at(j, "usage"), 100, 20, 60);
    json_decref(j);
    CHECK(ok);
}

TEST(api_response_messages)
{
    kvt_request r = {.api = KVT_API_MESSAGES};
    char *s = kvt_response_json(&r, "msg_1", "kvtier", "Hi.", 3, "stop", NULL, &U1, 0);
    json_t *j = load(s);
    free(s);
    CHECK(j);
    /* input_tokens = prompt - cached - created = 100 - 60 - 30 */
    bool ok = streq(sget(j, "id"), "msg_1") && streq(sget(j, "type"), "message") &&
              streq(sget(j, "role"), "assistant") && streq(sget(j, "model"), "kvtier") &&
              json_array_size(at(j, "content")) == 1 && streq(sget(j, "content.0.type"), "text") &&
              streq(sget(j, "content.0.text"), "Hi.") && streq(sget(j, "stop_reason"), "end_turn") &&
              is_null(j, "stop_sequence") && anthropic_usage_ok(at(j, "usage"), 10, 20, 60, 30);
    json_decref(j);
    CHECK(ok);
    s = kvt_response_json(&r, "msg_2", "kvtier", "A", 1, "stop", "\n\nHuman:", &U1, 0);
    j = load(s);
    free(s);
    ok = j && streq(sget(j, "stop_reason"), "stop_sequence") && streq(sget(j, "stop_sequence"), "\n\nHuman:");
    json_decref(j);
    CHECK(ok);
    s = kvt_response_json(&r, "msg_3", "kvtier", "A", 1, "length", NULL, &U1, 0);
    j = load(s);
    free(s);
    ok = j && streq(sget(j, "stop_reason"), "max_tokens") && is_null(j, "stop_sequence");
    json_decref(j);
    CHECK(ok);
}

TEST(api_usage_clamped)
{
    /* Inconsistent counts never produce negative (wrapped) numbers. */
    kvt_usage u = {.prompt_tokens = 10, .completion_tokens = 1, .cached_tokens = 15, .created_tokens = 4};
    kvt_request ra = {.api = KVT_API_MESSAGES}, ro = {.api = KVT_API_CHAT};
    char *s = kvt_response_json(&ra, "a", "m", "", 0, "stop", NULL, &u, 0);
    json_t *j = load(s);
    free(s);
    bool ok = j && anthropic_usage_ok(at(j, "usage"), 0, 1, 10, 0);
    json_decref(j);
    CHECK(ok);
    u.cached_tokens = 4;
    u.created_tokens = 9;
    s = kvt_response_json(&ra, "a", "m", "", 0, "stop", NULL, &u, 0);
    j = load(s);
    free(s);
    ok = j && anthropic_usage_ok(at(j, "usage"), 0, 1, 4, 6);
    json_decref(j);
    CHECK(ok);
    s = kvt_response_json(&ro, "a", "m", "", 0, "stop", NULL, &u, 0);
    j = load(s);
    free(s);
    ok = j && openai_usage_ok(at(j, "usage"), 10, 1, 4);
    json_decref(j);
    CHECK(ok);
}

TEST(api_invalid_utf8_repaired)
{
    /* A cut character, a stray continuation byte, an overlong and a surrogate:
     * the body stays valid JSON and valid text survives around them. */
    const char text[] = "ok \xe2\x82 mid \x80\x80 x\xc0\xaf y\xed\xa0\x80 \xe4\xb8\x96 end\xf0\x9f";
    kvt_request r = {.api = KVT_API_CHAT};
    char *s = kvt_response_json(&r, "i", "m", text, sizeof text - 1, "stop", NULL, NULL, 0);
    json_t *j = load(s);
    free(s);
    CHECK(j);
    const char *c = sget(j, "choices.0.message.content");
    bool ok = streq(c, "ok \xef\xbf\xbd mid \xef\xbf\xbd x\xef\xbf\xbd y\xef\xbf\xbd \xe4\xb8\x96 end\xef\xbf\xbd");
    if (!ok && c) printf("      got '%s'\n", esc(c, strlen(c)));
    json_decref(j);
    CHECK(ok);
    /* the same in a stream delta and an error message */
    r.api = KVT_API_MESSAGES;
    s = kvt_stream_delta(&r, "i", "m", "\xff", 1, 0);
    event ev[2];
    int n = split_sse(s, ev, 2);
    free(s);
    ok = n == 1 && streq(sget(ev[0].data, "delta.text"), "\xef\xbf\xbd");
    free_events(ev, n > 0 ? n : 0);
    CHECK(ok);
    s = kvt_error_json(KVT_API_CHAT, 400, "bad \xfe");
    j = load(s);
    free(s);
    ok = j && streq(sget(j, "error.message"), "bad \xef\xbf\xbd");
    json_decref(j);
    CHECK(ok);
}

/* ---- streams ---------------------------------------------------------------- */

/* Run a whole stream for r with the deltas and return the SSE text. */
static char *stream_all(const kvt_request *r, const char *const *deltas, int nd, const char *finish,
                        const char *stop_seq, const kvt_usage *u)
{
    char *acc = NULL;
    kvt_usage begin = *u;
    begin.completion_tokens = 0;
    cat(&acc, kvt_stream_begin(r, "id-1", "kvtier", &begin, 77));
    for (int i = 0; i < nd; i++) cat(&acc, kvt_stream_delta(r, "id-1", "kvtier", deltas[i], strlen(deltas[i]), 77));
    cat(&acc, kvt_stream_delta(r, "id-1", "kvtier", "", 0, 77)); /* nothing */
    cat(&acc, kvt_stream_end(r, "id-1", "kvtier", finish, stop_seq, u, 77));
    return acc;
}

static const char *const deltas[] = {"Hel", "lo", " w\xc3\xb6rld", "\n"};
#define N_DELTAS 4

static void check_openai_chat_stream(bool include_usage)
{
    kvt_request r = {.api = KVT_API_CHAT, .stream = true, .include_usage = include_usage};
    char *s = stream_all(&r, deltas, N_DELTAS, "length", NULL, &U1);
    event ev[16];
    int n = split_sse(s, ev, 16);
    if (n < 0) printf("      malformed SSE: %s\n", s ? s : "(null)");
    free(s);
    CHECK(n == N_DELTAS + 3 + include_usage);
    bool ok = true;
    char text[64] = "";
    for (int i = 0; i < n - 1 && ok; i++) {
        json_t *d = ev[i].data;
        ok = !ev[i].name[0] && d && streq(sget(d, "id"), "id-1") && streq(sget(d, "object"), "chat.completion.chunk") &&
             iget(d, "created") == 77 && streq(sget(d, "model"), "kvtier");
        bool last = include_usage && i == n - 2;
        /* with include_usage every chunk carries "usage": null until the usage chunk */
        ok = ok && (include_usage ? (last ? json_is_object(at(d, "usage")) : is_null(d, "usage")) : !at(d, "usage"));
        if (!ok) break;
        if (last) {
            ok = json_is_array(at(d, "choices")) && json_array_size(at(d, "choices")) == 0 &&
                 openai_usage_ok(at(d, "usage"), 100, 20, 60);
            continue;
        }
        ok = json_array_size(at(d, "choices")) == 1 && iget(d, "choices.0.index") == 0 &&
             is_null(d, "choices.0.logprobs");
        if (i == 0) /* the role chunk */
            ok = ok && streq(sget(d, "choices.0.delta.role"), "assistant") && streq(sget(d, "choices.0.delta.content"), "") &&
                 is_null(d, "choices.0.finish_reason");
        else if (i <= N_DELTAS) {
            const char *c = sget(d, "choices.0.delta.content");
            ok = ok && c && !at(d, "choices.0.delta.role") && is_null(d, "choices.0.finish_reason");
            if (ok) strncat(text, c, sizeof text - strlen(text) - 1);
        } else /* the finish chunk */
            ok = ok && json_object_size(at(d, "choices.0.delta")) == 0 &&
                 streq(sget(d, "choices.0.finish_reason"), "length");
    }
    ok = ok && ev[n - 1].done && !ev[n - 1].name[0] && streq(text, "Hello w\xc3\xb6rld\n");
    free_events(ev, n);
    CHECK(ok);
}

TEST(api_stream_chat)
{
    check_openai_chat_stream(false);
    if (!kvt_test_failed()) check_openai_chat_stream(true);
}

TEST(api_stream_completions)
{
    for (int iu = 0; iu < 2; iu++) {
        kvt_request r = {.api = KVT_API_COMPLETIONS, .stream = true, .include_usage = iu};
        char *s = kvt_stream_begin(&r, "c", "m", &U1, 1);
        CHECK(s && !strcmp(s, "")); /* no role chunk for text completions */
        free(s);
        s = stream_all(&r, deltas, N_DELTAS, "stop", NULL, &U1);
        event ev[16];
        int n = split_sse(s, ev, 16);
        free(s);
        CHECK(n == N_DELTAS + 2 + iu);
        bool ok = true;
        char text[64] = "";
        for (int i = 0; i < N_DELTAS + 1 && ok; i++) {
            json_t *d = ev[i].data;
            ok = d && streq(sget(d, "object"), "text_completion") && streq(sget(d, "id"), "id-1") &&
                 iget(d, "choices.0.index") == 0 && sget(d, "choices.0.text") && is_null(d, "choices.0.logprobs") &&
                 (iu ? is_null(d, "usage") : !at(d, "usage"));
            if (ok && i < N_DELTAS) {
                ok = is_null(d, "choices.0.finish_reason");
                strncat(text, sget(d, "choices.0.text"), sizeof text - strlen(text) - 1);
            } else if (ok) {
                ok = streq(sget(d, "choices.0.finish_reason"), "stop") && streq(sget(d, "choices.0.text"), "");
            }
        }
        if (ok && iu)
            ok = json_array_size(at(ev[n - 2].data, "choices")) == 0 &&
                 streq(sget(ev[n - 2].data, "object"), "text_completion") &&
                 openai_usage_ok(at(ev[n - 2].data, "usage"), 100, 20, 60);
        ok = ok && ev[n - 1].done && streq(text, "Hello w\xc3\xb6rld\n");
        free_events(ev, n);
        CHECK(ok);
    }
}

TEST(api_stream_messages)
{
    kvt_request r = {.api = KVT_API_MESSAGES, .stream = true};
    char *s = stream_all(&r, deltas, N_DELTAS, "stop", "\n\nHuman:", &U1);
    event ev[16];
    int n = split_sse(s, ev, 16);
    if (n < 0) printf("      malformed SSE: %s\n", s ? s : "(null)");
    free(s);
    static const char *const names[] = {"message_start", "content_block_start", "ping", "content_block_delta",
                                        "content_block_delta", "content_block_delta", "content_block_delta",
                                        "content_block_stop", "message_delta", "message_stop"};
    CHECK(n == 10);
    bool ok = true;
    char text[64] = "";
    for (int i = 0; i < n && ok; i++) {
        /* the event name and the data's type agree, as the SDK expects */
        ok = streq(ev[i].name, names[i]) && streq(sget(ev[i].data, "type"), names[i]);
        if (!ok) printf("      event %d: '%s'\n", i, ev[i].name);
    }
    json_t *ms = ev[0].data, *cbs = ev[1].data, *md = ev[8].data;
    ok = ok && streq(sget(ms, "message.id"), "id-1") && streq(sget(ms, "message.type"), "message") &&
         streq(sget(ms, "message.role"), "assistant") && streq(sget(ms, "message.model"), "kvtier") &&
         json_is_array(at(ms, "message.content")) && json_array_size(at(ms, "message.content")) == 0 &&
         is_null(ms, "message.stop_reason") && is_null(ms, "message.stop_sequence") &&
         anthropic_usage_ok(at(ms, "message.usage"), 10, 0, 60, 30);
    ok = ok && iget(cbs, "index") == 0 && streq(sget(cbs, "content_block.type"), "text") &&
         streq(sget(cbs, "content_block.text"), "");
    for (int i = 3; i < 7 && ok; i++) {
        ok = iget(ev[i].data, "index") == 0 && streq(sget(ev[i].data, "delta.type"), "text_delta");
        if (ok) strncat(text, sget(ev[i].data, "delta.text"), sizeof text - strlen(text) - 1);
    }
    ok = ok && streq(text, "Hello w\xc3\xb6rld\n") && iget(ev[7].data, "index") == 0;
    ok = ok && streq(sget(md, "delta.stop_reason"), "stop_sequence") &&
         streq(sget(md, "delta.stop_sequence"), "\n\nHuman:") && anthropic_usage_ok(at(md, "usage"), 10, 20, 60, 30);
    free_events(ev, n);
    CHECK(ok);

    /* end_turn / max_tokens with a null stop_sequence */
    s = kvt_stream_end(&r, "id", "m", "length", NULL, &U1, 0);
    n = split_sse(s, ev, 16);
    free(s);
    ok = n == 3 && streq(sget(ev[1].data, "delta.stop_reason"), "max_tokens") && is_null(ev[1].data, "delta.stop_sequence");
    free_events(ev, n > 0 ? n : 0);
    CHECK(ok);
}

TEST(api_stream_error)
{
    char *s = kvt_stream_error(KVT_API_MESSAGES, 503, "busy");
    event ev[2];
    int n = split_sse(s, ev, 2);
    free(s);
    bool ok = n == 1 && streq(ev[0].name, "error") && streq(sget(ev[0].data, "type"), "error") &&
              streq(sget(ev[0].data, "error.type"), "overloaded_error") && streq(sget(ev[0].data, "error.message"), "busy");
    free_events(ev, n > 0 ? n : 0);
    CHECK(ok);
    s = kvt_stream_error(KVT_API_CHAT, 500, "boom");
    n = split_sse(s, ev, 2);
    free(s);
    /* no event name: the openai client looks for data.error on unnamed events */
    ok = n == 1 && !ev[0].name[0] && streq(sget(ev[0].data, "error.message"), "boom") &&
         streq(sget(ev[0].data, "error.type"), "api_error");
    free_events(ev, n > 0 ? n : 0);
    CHECK(ok);
}

/* ---- errors and models ---------------------------------------------------------- */

TEST(api_error_json)
{
    static const struct { int status; const char *type; } t[] = {
        {400, "invalid_request_error"}, {401, "authentication_error"}, {403, "permission_error"},
        {404, "not_found_error"},       {413, "request_too_large"},    {429, "rate_limit_error"},
        {500, "api_error"},             {503, "overloaded_error"},     {405, "invalid_request_error"},
        {502, "api_error"},
    };
    for (size_t i = 0; i < sizeof t / sizeof *t; i++) {
        CHECK(streq(kvt_error_type(t[i].status), t[i].type));
        char *s = kvt_error_json(KVT_API_CHAT, t[i].status, "msg \"q\"");
        json_t *j = load(s);
        free(s);
        bool ok = j && json_object_size(j) == 1 && streq(sget(j, "error.message"), "msg \"q\"") &&
                  streq(sget(j, "error.type"), t[i].type) && is_null(j, "error.param") && is_null(j, "error.code");
        json_decref(j);
        CHECK(ok);
        s = kvt_error_json(KVT_API_COMPLETIONS, t[i].status, "m");
        j = load(s);
        free(s);
        ok = j && streq(sget(j, "error.type"), t[i].type);
        json_decref(j);
        CHECK(ok);
        s = kvt_error_json(KVT_API_MESSAGES, t[i].status, "msg");
        j = load(s);
        free(s);
        ok = j && json_object_size(j) == 2 && streq(sget(j, "type"), "error") &&
             streq(sget(j, "error.type"), t[i].type) && streq(sget(j, "error.message"), "msg");
        json_decref(j);
        CHECK(ok);
    }
    /* A parse failure's message goes out as is. */
    kvt_request r;
    int st;
    CHECK(parse(&r, KVT_API_MESSAGES, "{\"messages\":" U "}", NULL, &st) == KVT_EINVAL);
    char *s = kvt_error_json(KVT_API_MESSAGES, st, kvt_errmsg());
    json_t *j = load(s);
    free(s);
    bool ok = j && streq(sget(j, "error.type"), "invalid_request_error") &&
              streq(sget(j, "error.message"), "\"max_tokens\": required");
    json_decref(j);
    CHECK(ok);
    s = kvt_error_json(KVT_API_CHAT, 500, NULL);
    j = load(s);
    free(s);
    ok = j && streq(sget(j, "error.message"), "");
    json_decref(j);
    CHECK(ok);
}

TEST(api_models_json)
{
    char *s = kvt_models_json("stories260K", 1700000000);
    json_t *j = load(s);
    free(s);
    CHECK(j);
    /* OpenAI's list and Anthropic's page, in one object */
    bool ok = streq(sget(j, "object"), "list") && json_array_size(at(j, "data")) == 1 &&
              streq(sget(j, "data.0.id"), "stories260K") && streq(sget(j, "data.0.object"), "model") &&
              iget(j, "data.0.created") == 1700000000 && streq(sget(j, "data.0.owned_by"), "kvtier") &&
              streq(sget(j, "data.0.type"), "model") && streq(sget(j, "data.0.display_name"), "stories260K") &&
              streq(sget(j, "data.0.created_at"), "2023-11-14T22:13:20Z") && json_is_false(at(j, "has_more")) &&
              streq(sget(j, "first_id"), "stories260K") && streq(sget(j, "last_id"), "stories260K");
    json_decref(j);
    CHECK(ok);
}

/* ---- fuzz ----------------------------------------------------------------------- */

/* Mutated bodies (bytes flipped, inserted, deleted, truncated) must parse or
 * be refused with 400, never crash or leak, and whatever parses must render
 * into responses that are valid JSON. */
TEST(api_parse_fuzz)
{
    static const struct { kvt_api api; const char *body; } seeds[] = {
        {KVT_API_CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\","
                       "\"content\":[{\"type\":\"text\",\"text\":\"hi \\u00e9\"}]}],\"stop\":[\"a\",\"b\"],"
                       "\"max_tokens\":5,\"temperature\":0.5,\"stream\":true,\"stream_options\":{\"include_usage\":true}}"},
        {KVT_API_COMPLETIONS, "{\"prompt\":[\"Once\"],\"max_tokens\":3,\"seed\":4,\"top_p\":0.5,\"stop\":\"x\"}"},
        {KVT_API_MESSAGES, "{\"max_tokens\":9,\"system\":[{\"type\":\"text\",\"text\":\"S\"}],\"messages\":"
                           "[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"a\"}],"
                           "\"stop_sequences\":[\"z\"],\"top_k\":3}"},
    };
    static const char alphabet[] = "{}[]\":,0123456789.-eE tfnulrsa\\\xc3\xa9\xff\x00";
    kvt_model *m = tiny();
    CHECK(m);
    uint64_t st = kvt_test_seed("api_parse_fuzz");
    char buf[512];
    int parsed = 0;
    for (int it = 0; it < 3000; it++) {
        int k = (int)(kvt_test_rand(&st) % 3);
        size_t n = strlen(seeds[k].body);
        memcpy(buf, seeds[k].body, n);
        int edits = 1 + (int)(kvt_test_rand(&st) % 4);
        for (int e = 0; e < edits && n > 0; e++) {
            size_t pos = (size_t)(kvt_test_rand(&st) % n);
            char c = alphabet[kvt_test_rand(&st) % (sizeof alphabet - 1)];
            switch (kvt_test_rand(&st) % 4) {
            case 0: buf[pos] = c; break;
            case 1: if (n + 1 < sizeof buf) { memmove(buf + pos + 1, buf + pos, n - pos); buf[pos] = c; n++; } break;
            case 2: memmove(buf + pos, buf + pos + 1, n - pos - 1); n--; break;
            case 3: n = pos; break;
            }
        }
        char *copy = malloc(n ? n : 1);
        CHECK(copy);
        memcpy(copy, buf, n);
        kvt_request r;
        int status = 0;
        int rc = kvt_request_parse(&r, seeds[k].api, copy, n, m, &status);
        free(copy);
        if (rc) {
            CHECKF(rc == KVT_EINVAL && status == 400, "iteration %d: rc %d status %d", it, rc, status);
            continue;
        }
        parsed++;
        CHECK(status == 200 && r.prompt && r.prompt[r.prompt_len] == 0);
        kvt_usage u = {.prompt_tokens = 3, .completion_tokens = 1};
        char *outs[4] = {
            kvt_response_json(&r, "id", r.model, r.prompt, r.prompt_len, "stop", r.n_stop ? r.stop[0] : NULL, &u, 0),
            kvt_stream_begin(&r, "id", r.model, &u, 0),
            kvt_stream_delta(&r, "id", r.model, r.prompt, r.prompt_len, 0),
            kvt_stream_end(&r, "id", r.model, "stop", r.n_stop ? r.stop[0] : NULL, &u, 0),
        };
        json_t *j = load(outs[0]);
        bool ok = j != NULL;
        json_decref(j);
        for (int i = 1; i < 4; i++) {
            event ev[8];
            int ne = outs[i] ? split_sse(outs[i], ev, 8) : -1;
            if (ne < 0) ok = false;
            else free_events(ev, ne);
        }
        for (int i = 0; i < 4; i++) free(outs[i]);
        kvt_request_free(&r);
        CHECKF(ok, "iteration %d: a response did not render", it);
    }
    printf("    api_parse_fuzz: %d of 3000 mutated bodies parsed\n", parsed);
    kvt_model_close(m);
}
