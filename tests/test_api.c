/* API-shape tests (src/serve/api.c): realistic OpenAI and Anthropic request bodies,
 * every refusal with its status, the exact deepseek and plain renderings, the
 * prefix property that prefix caching depends on (with a negative control),
 * response / SSE / error / model bodies parsed back with jansson field by
 * field, and a seeded mutation fuzz of the parser.
 *
 * Every body is parsed from a heap copy of exactly its length, without a NUL,
 * so an over-read shows under `make asan`. */
#include "test.h"
#include "serve/api.h"
#include "arch/model.h"
#include "text/tokenizer.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define FW "\xef\xbd\x9c"
#define SPM "\xe2\x96\x81"
#define BOS "<" FW "begin" SPM "of" SPM "sentence" FW ">"
#define EOS "<" FW "end" SPM "of" SPM "sentence" FW ">"
#define USR "<" FW "User" FW ">"
#define AST "<" FW "Assistant" FW ">"
#define NT "</think>"
/* The assistant marker as non-thinking mode writes it. */
#define ASN AST NT
#define DSML FW "DSML" FW
#define CSB "<" DSML "tool_calls>"
#define CSE "</" DSML "tool_calls>"
#define TRB "<tool_result>"
#define TRE "</tool_result>"
/* The tools header and footer of the DeepSeek-V4-Flash template (docs/API.md). */
#define THEAD "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke " \
    "tools by writing a \"" CSB "\" block like the following:\n\n" CSB "\n<" DSML "invoke name=\"$TOOL_NAME\">\n<" \
    DSML "parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</" DSML "parameter>\n...\n</" \
    DSML "invoke>\n<" DSML "invoke name=\"$TOOL_NAME2\">\n...\n</" DSML "invoke>\n" CSE "\n\nString parameters " \
    "should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), " \
    "pass the value in JSON format and set `string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by " \
    "<think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final " \
    "response.\n\nOtherwise, output directly after </think> with tool calls or final response.\n\n### Available " \
    "Tool Schemas\n\n"
/* The plain template's tools heading. */
#define PTHEAD "## Tools\n\nYou can call these functions, each given as JSON with its name, description and " \
               "parameters (a JSON Schema):\n\n"
#define THOWTO "\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
/* A call as the deepseek template renders it: INVOKE(name, PARAM...) inside
 * "\n\n" CSB "\n" ... CSE. */
#define INVOKE(name, params) "<" DSML "invoke name=\"" name "\">\n" params "</" DSML "invoke>\n"
#define PSTR(k, v) "<" DSML "parameter name=\"" k "\" string=\"true\">" v "</" DSML "parameter>\n"
#define PJSON(k, v) "<" DSML "parameter name=\"" k "\" string=\"false\">" v "</" DSML "parameter>\n"
#define CALLS(invokes) "\n\n" CSB "\n" invokes CSE

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

/* The same with parse options. */
static int parse_o(kvt_request *r, kvt_api api, const char *body, const kvt_model *m, const kvt_parse_opts *o)
{
    size_t n = strlen(body);
    char *copy = malloc(n ? n : 1);
    if (!copy) return KVT_ENOMEM;
    memcpy(copy, body, n);
    int st;
    int rc = kvt_request_parse_opts(r, api, copy, n, m, o, &st);
    free(copy);
    return rc;
}

static bool prompt_is(const kvt_request *r, const char *want)
{
    size_t n = strlen(want);
    bool ok = r->prompt && r->prompt_len == n && !memcmp(r->prompt, want, n) && r->prompt[n] == 0;
    if (!ok) {
        printf("      want '%s'\n", kvt_test_esc(want, n));
        if (r->prompt) printf("      got  '%s'\n", kvt_test_esc(r->prompt, r->prompt_len));
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
typedef struct event { char name[64]; json_t *data; bool done; } event;

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

TEST(api_chat_parse)
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
    /* the one tool, a function with a name only, goes into the system part */
    CHECK(r.n_tools == 1);
    CHECK(prompt_is(&r, BOS "You are terse.\n\n" THEAD "{\"name\": \"f\"}\n" THOWTO USR "Part one.\n\nPart two." ASN));
    kvt_request_free(&r);
    CHECK(!r.prompt && !r.stop && !r.model);
    kvt_request_free(&r); /* twice is fine: the first zeroed it */
    kvt_request_free(NULL);
}

TEST(api_chat_parse_defaults)
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
    CHECK(prompt_is(&r, BOS USR "hi" ASN));
    kvt_request_free(&r);

    CHECK_OK(parse(&r, KVT_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", NULL, &st));
    CHECK(r.max_tokens == 0 && r.temperature == 1 && r.top_p == 1 && r.top_k == 0 && r.n_stop == 0 && !r.stop);
    CHECK(!r.prompt_has_bos && prompt_is(&r, "x")); /* no model: plain */
    kvt_request_free(&r);
}

TEST(api_completions_parse)
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

TEST(api_messages_parse)
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
    CHECK(prompt_is(&r, BOS "Sys A\n\nSys B" USR "Q1" ASN "A1" EOS USR "Q2" ASN));
    kvt_request_free(&r);

    /* System as a string, and a trailing assistant turn is a prefill: the
     * reply continues it. */
    CHECK_OK(parse(&r, KVT_API_MESSAGES,
                   "{\"max_tokens\":5,\"system\":\"S\",\"messages\":[{\"role\":\"user\",\"content\":\"Q\"},"
                   "{\"role\":\"assistant\",\"content\":\"The answer is\"}]}", m, &st));
    CHECK(prompt_is(&r, BOS "S" USR "Q" ASN "The answer is"));
    kvt_request_free(&r);
    /* An empty system is no system. */
    CHECK_OK(parse(&r, KVT_API_MESSAGES,
                   "{\"max_tokens\":5,\"system\":[],\"messages\":[{\"role\":\"user\",\"content\":\"Q\"}]}", m, &st));
    CHECK(prompt_is(&r, BOS USR "Q" ASN));
    kvt_request_free(&r);
    kvt_model_close(m);
}

/* ---- templates -------------------------------------------------------------- */

TEST(api_prompt_deepseek_two_turns_exact)
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
                       "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c></think>Hi.<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"
                       "<\xef\xbd\x9cUser\xef\xbd\x9c>And now?"
                       "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c></think>";
    CHECK(prompt_is(&r, want));
    CHECK(r.prompt_has_bos);
    /* Tokenized as the server does (no added BOS, specials parsed), every
     * marker is one special token of the byte tokenizer. */
    int32_t *ids;
    size_t n;
    CHECK_OK(kvt_tokenizer_encode(m->tok, r.prompt, r.prompt_len, false, true, &ids, &n));
    size_t want_n = 1 + 9 + 1 + 6 + 2 + 3 + 1 + 1 + 8 + 2;
    bool ok = n == want_n && ids[0] == 256 && ids[10] == 258 && ids[17] == 259 && ids[18] == 261 && ids[22] == 257 &&
              ids[23] == 258 && ids[32] == 259 && ids[33] == 261 && ids[1] == 'B';
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

TEST(api_prompt_deepseek_system_hoisted)
{
    kvt_model *m = tiny();
    CHECK(m);
    kvt_request r;
    int st;
    /* system messages anywhere join the system part, in order; developer
     * messages are user text to this template, joined with the user
     * message after them. */
    CHECK_OK(parse(&r, KVT_API_CHAT,
                   "{\"messages\":[{\"role\":\"developer\",\"content\":\"D1\"},{\"role\":\"user\",\"content\":\"U1\"},"
                   "{\"role\":\"assistant\",\"content\":null},{\"role\":\"system\",\"content\":[{\"type\":\"text\","
                   "\"text\":\"S2\"}]},{\"role\":\"user\",\"content\":\"U2\"}]}", m, &st));
    CHECK(prompt_is(&r, BOS "S2" USR "D1\n\nU1" ASN EOS USR "U2" ASN));
    kvt_request_free(&r);
    /* to the plain template a developer message is system text */
    CHECK_OK(parse(&r, KVT_API_CHAT,
                   "{\"messages\":[{\"role\":\"user\",\"content\":\"U1\"},{\"role\":\"developer\",\"content\":\"D1\"}],"
                   "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]}", NULL, &st));
    CHECK(prompt_is(&r, PTHEAD "{\"name\":\"f\"}\n\nU1\n\nD1"));
    kvt_request_free(&r);
    /* Anthropic's "system" comes before system messages (a leniency). */
    CHECK_OK(parse(&r, KVT_API_MESSAGES,
                   "{\"max_tokens\":1,\"system\":\"top\",\"messages\":[{\"role\":\"system\",\"content\":\"inner\"},"
                   "{\"role\":\"user\",\"content\":\"U\"}]}", m, &st));
    CHECK(prompt_is(&r, BOS "top\n\ninner" USR "U" ASN));
    kvt_request_free(&r);
    kvt_model_close(m);
}

TEST(api_prompt_plain_stories)
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
    ok = ok && kvt_tokenize(m, r.prompt, r.prompt_len, -1, false, &ids, &n) == KVT_OK && n > 1 && info.add_bos &&
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
                printf("      prev '%s'\n", kvt_test_esc(prev.prompt, prev.prompt_len));
                printf("      cur  '%s'\n", kvt_test_esc(cur.prompt, cur.prompt_len));
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

TEST(api_prompt_prefix_deepseek)
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
        if (!ok) printf("      r2 '%s'\n", kvt_test_esc(r2.prompt, r2.prompt_len));
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

TEST(api_prompt_prefix_plain)
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
TEST(api_prompt_prefix_negative_control)
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
    bool kept = strstr(a.prompt, USR "tell me " ASN) != NULL; /* the trailing space is text */
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
    {KVT_API_CHAT, "{\"messages\":[{\"role\":\"tool\",\"tool_call_id\":\"1\"}]}", "messages[0].content\": required"},
    {KVT_API_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"1\"}]}]}",
     "\"messages[0].tool_calls[0].function\": expected an object"},
    {KVT_API_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":{}}]}", "tool_calls\": expected an array"},
    {KVT_API_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"type\":\"custom\",\"custom\":{}}]}]}",
     "of type \"custom\" are not supported"},
    {KVT_API_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"arguments\":\"{}\"}}]}]}",
     "\"messages[0].tool_calls[0].function.name\": required"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"tools\":{}}", "\"tools\": expected an array"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"tools\":[{\"type\":\"function\"}]}", "\"tools[0].function\""},
    {KVT_API_CHAT, "{\"messages\":" U ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"\"}}]}",
     "\"tools[0].function.name\": must not be empty"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"tools\":[{\"function\":{\"name\":\"f\",\"parameters\":[]}}]}",
     "\"tools[0].function.parameters\": expected an object"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"tools\":[{\"function\":{\"name\":\"f\",\"description\":5}}]}",
     "\"tools[0].function.description\": expected a string"},
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
    /* log-probabilities: OpenAI's ranges, and top_logprobs only with logprobs */
    {KVT_API_CHAT, "{\"messages\":" U ",\"logprobs\":true,\"top_logprobs\":21}", "\"top_logprobs\": 21 is outside [0, 20]"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"logprobs\":true,\"top_logprobs\":-1}", "\"top_logprobs\""},
    {KVT_API_CHAT, "{\"messages\":" U ",\"top_logprobs\":2}", "\"top_logprobs\": requires \"logprobs\": true"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"logprobs\":false,\"top_logprobs\":0}", "requires \"logprobs\": true"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"logprobs\":1}", "\"logprobs\": expected a boolean"},
    {KVT_API_CHAT, "{\"messages\":" U ",\"logprobs\":true,\"top_logprobs\":\"3\"}", "expected an integer"},
    {KVT_API_COMPLETIONS, "{\"prompt\":\"a\",\"logprobs\":6}", "\"logprobs\": 6 is outside [0, 5]"},
    {KVT_API_COMPLETIONS, "{\"prompt\":\"a\",\"logprobs\":-1}", "\"logprobs\""},
    {KVT_API_COMPLETIONS, "{\"prompt\":\"a\",\"logprobs\":true}", "\"logprobs\": expected an integer"},
    {KVT_API_RESPONSES, "{\"input\":\"q\",\"top_logprobs\":21}", "\"top_logprobs\": 21 is outside [0, 20]"},
    {KVT_API_RESPONSES, "{\"input\":\"q\",\"include\":\"message.output_text.logprobs\"}",
     "\"include\": expected an array"},
    {KVT_API_RESPONSES, "{\"input\":\"q\",\"include\":[3]}", "\"include[0]\": expected a string"},
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
     "\"tool_use_id\":\"t\",\"content\":[{\"type\":\"image\",\"source\":{}}]}]}]}",
     "\"messages[0].content[0].content[0]\": content of type \"image\" is not supported: this model reads text only"},
    {KVT_API_MESSAGES,
     "{\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"tool_use\",\"id\":\"t\","
     "\"name\":\"f\",\"input\":{}}]}]}",
     "\"messages[0].content[0]\": content of type \"tool_use\" is not supported in this place"},
    {KVT_API_MESSAGES,
     "{\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\","
     "\"content\":[{\"type\":\"tool_use\",\"id\":\"t\",\"input\":{}}]}]}",
     "\"messages[1].content[0].name\": required"},
    {KVT_API_MESSAGES,
     "{\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\","
     "\"content\":[{\"type\":\"server_tool_use\",\"id\":\"t\",\"name\":\"web_search\",\"input\":{}}]}]}",
     "content of type \"server_tool_use\" is not supported in this place"},
    {KVT_API_MESSAGES, "{\"max_tokens\":5,\"messages\":[{\"role\":\"tool\",\"content\":\"r\"}]}", "unknown role \"tool\""},
    {KVT_API_MESSAGES, "{\"max_tokens\":5,\"messages\":" U ",\"tools\":[{\"description\":\"d\"}]}",
     "\"tools[0].name\": required"},
    {KVT_API_MESSAGES, "{\"max_tokens\":5,\"messages\":" U ",\"tools\":[{\"name\":\"f\",\"input_schema\":\"s\"}]}",
     "\"tools[0].input_schema\": expected an object"},
    {KVT_API_RESPONSES, "{\"model\":\"m\"}", "\"input\": required"},
    {KVT_API_MESSAGES, "{\"max_tokens\":5,\"thinking\":true,\"messages\":" U "}", "\"thinking\": expected an object"},
    {KVT_API_MESSAGES, "{\"max_tokens\":5,\"thinking\":{\"budget_tokens\":9},\"messages\":" U "}",
     "\"thinking.type\": required"},
    {KVT_API_MESSAGES, "{\"max_tokens\":5,\"thinking\":{\"type\":\"sometimes\"},\"messages\":" U "}",
     "unknown type \"sometimes\""},
    {KVT_API_MESSAGES, "{\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\","
     "\"content\":[{\"type\":\"thinking\",\"thinking\":5,\"signature\":\"\"}]}]}",
     "\"messages[1].content[0].thinking\": expected a string"},
    {KVT_API_RESPONSES, "{\"input\":5}", "\"input\": expected a string or an array of items"},
    {KVT_API_RESPONSES, "{\"input\":\"q\",\"instructions\":[]}", "\"instructions\": expected a string"},
    {KVT_API_RESPONSES, "{\"input\":[{\"type\":\"message\",\"content\":\"x\"}]}", "\"input[0].role\""},
    {KVT_API_RESPONSES, "{\"input\":[{\"role\":\"user\"}]}", "\"input[0].content\": required"},
    {KVT_API_RESPONSES, "{\"input\":[{\"role\":\"tool\",\"content\":\"x\"}]}", "unknown role \"tool\""},
    {KVT_API_RESPONSES, "{\"input\":[{\"role\":\"user\",\"content\":[{\"type\":\"input_image\",\"image_url\":\"x\"}]}]}",
     "\"input_image\" is not supported: this model reads text only"},
    {KVT_API_RESPONSES, "{\"input\":[{\"type\":\"function_call\",\"name\":\"f\",\"arguments\":\"{}\"}]}",
     "\"input[0].call_id\": required"},
    {KVT_API_RESPONSES, "{\"input\":[{\"type\":\"function_call\",\"call_id\":\"c\",\"arguments\":\"{}\"}]}",
     "\"input[0].name\": required"},
    {KVT_API_RESPONSES, "{\"input\":[{\"type\":\"item_reference\",\"id\":\"x\"}]}",
     "items of type \"item_reference\" are not supported"},
    {KVT_API_RESPONSES, "{\"input\":[{\"type\":\"function_call_output\",\"call_id\":\"c\",\"output\":5}]}",
     "\"input[0].output\": expected a string or an array"},
    {KVT_API_RESPONSES, "{\"input\":\"q\",\"previous_response_id\":\"resp_1\"}", "\"previous_response_id\": stored"},
    {KVT_API_RESPONSES, "{\"input\":\"q\",\"conversation\":\"conv_1\"}", "\"conversation\""},
    {KVT_API_RESPONSES, "{\"input\":\"q\",\"max_output_tokens\":0}", "\"max_output_tokens\""},
    {KVT_API_RESPONSES, "{\"input\":\"q\",\"tools\":[{\"name\":\"f\"}]}", "\"tools[0].type\": required"},
    {KVT_API_RESPONSES, "{\"input\":\"q\",\"tools\":[{\"type\":\"namespace\",\"name\":\"ns\"}]}",
     "\"tools[0].tools\": expected an array"},
    {KVT_API_RESPONSES, "{\"input\":\"q\",\"tools\":[{\"type\":\"namespace\",\"name\":\"ns\",\"tools\":[{\"type\":\"function\"}]}]}",
     "\"tools[0].tools[0].name\": required"},
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
    CHECK(kvt_request_parse_opts(NULL, KVT_API_RESPONSES, "{}", 2, m, NULL, &st) == KVT_EINVAL && st == 500);
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

TEST(api_chat_response)
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

TEST(api_completions_response)
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

TEST(api_messages_response)
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
    /* one U+FFFD per maximal subpart (as Python's errors="replace" and
     * browsers decode): the cut E2 82 is one, each stray continuation byte
     * one, C0 AF two (C0 starts nothing), ED A0 80 three (ED may not be
     * followed by A0), the cut F0 9F one */
#define R3 "\xef\xbf\xbd"
    bool ok = streq(c, "ok " R3 " mid " R3 R3 " x" R3 R3 " y" R3 R3 R3 " \xe4\xb8\x96 end" R3);
#undef R3
    if (!ok && c) printf("      got '%s'\n", kvt_test_esc(c, strlen(c)));
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
static char *stream_all(kvt_request *r, const char *const *deltas, int nd, const char *finish,
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

TEST(api_chat_stream)
{
    check_openai_chat_stream(false);
    if (!kvt_test_failed()) check_openai_chat_stream(true);
}

TEST(api_completions_stream)
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

TEST(api_messages_stream)
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

/* ---- tools: definitions and history ------------------------------------------- */

/* The weather conversation: system text, one tool, a user turn, an assistant
 * turn with text and two calls, two results, the answer after them, and a
 * user turn; as each api sends it, and as the deepseek template renders it. */
#define WTOOL "{\"name\":\"get_weather\",\"description\":\"Weather\",\"parameters\":{\"properties\":{\"city\":" \
              "{\"type\":\"string\"}},\"required\":[\"city\"],\"type\":\"object\"}}"
/* The same tool as the DeepSeek-V4 template writes it (tojson: the client's
 * key order, which the three bodies below share). */
#define WTOOL4 "{\"name\": \"get_weather\", \"description\": \"Weather\", \"parameters\": {\"type\": \"object\", " \
               "\"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}\n"
#define WCALLS "Checking." CALLS(INVOKE("get_weather", PSTR("city", "Paris")) INVOKE("get_weather", PSTR("city", "Rome")))
static const char weather_want[] = BOS "S\n\n" THEAD WTOOL4 THOWTO USR "Weather in Paris and Rome?" ASN WCALLS EOS
    USR TRB "18C" TRE "\n\n" TRB "21C" TRE ASN "Paris 18C, Rome 21C." EOS USR "Thanks" ASN;

static const char *const w_chat[] = {
    "{\"role\":\"system\",\"content\":\"S\"}",
    "{\"role\":\"user\",\"content\":\"Weather in Paris and Rome?\"}",
    "{\"role\":\"assistant\",\"content\":\"Checking.\",\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\","
    "\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Paris\\\"}\"}},{\"id\":\"c2\","
    "\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Rome\\\"}\"}}]}",
    "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"18C\"}",
    "{\"role\":\"tool\",\"tool_call_id\":\"c2\",\"content\":[{\"type\":\"text\",\"text\":\"21C\"}]}",
    "{\"role\":\"assistant\",\"content\":\"Paris 18C, Rome 21C.\"}",
    "{\"role\":\"user\",\"content\":\"Thanks\"}",
};
static const char *const w_msgs[] = {
    "{\"role\":\"user\",\"content\":\"Weather in Paris and Rome?\"}",
    "{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"Checking.\"},{\"type\":\"tool_use\",\"id\":\"c1\","
    "\"name\":\"get_weather\",\"input\":{\"city\":\"Paris\"}},{\"type\":\"tool_use\",\"id\":\"c2\",\"name\":\"get_weather\","
    "\"input\":{\"city\":\"Rome\"},\"cache_control\":{\"type\":\"ephemeral\"}}]}",
    "{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"tool_use_id\":\"c1\",\"content\":\"18C\"},"
    "{\"type\":\"tool_result\",\"tool_use_id\":\"c2\",\"content\":[{\"type\":\"text\",\"text\":\"21C\"}],\"is_error\":false}]}",
    "{\"role\":\"assistant\",\"content\":\"Paris 18C, Rome 21C.\"}",
    "{\"role\":\"user\",\"content\":\"Thanks\"}",
};
static const char *const w_resp[] = {
    "{\"type\":\"message\",\"role\":\"user\",\"id\":\"msg_u1\",\"content\":[{\"type\":\"input_text\","
    "\"text\":\"Weather in Paris and Rome?\"}]}",
    "{\"type\":\"message\",\"role\":\"assistant\",\"id\":\"msg_a1\",\"status\":\"completed\",\"content\":"
    "[{\"type\":\"output_text\",\"text\":\"Checking.\",\"annotations\":[]}]}",
    "{\"type\":\"function_call\",\"id\":\"fc_1\",\"call_id\":\"c1\",\"name\":\"get_weather\","
    "\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\",\"status\":\"completed\"}",
    "{\"type\":\"function_call\",\"id\":\"fc_2\",\"call_id\":\"c2\",\"name\":\"get_weather\","
    "\"arguments\":\"{ \\\"city\\\" : \\\"Rome\\\" }\"}",
    "{\"type\":\"function_call_output\",\"id\":\"fco_1\",\"call_id\":\"c1\",\"output\":\"18C\"}",
    "{\"type\":\"function_call_output\",\"call_id\":\"c2\",\"output\":[{\"type\":\"input_text\",\"text\":\"21C\"}]}",
    "{\"role\":\"assistant\",\"content\":\"Paris 18C, Rome 21C.\"}",
    "{\"role\":\"user\",\"content\":\"Thanks\"}",
};

typedef struct convo_api {
    kvt_api api;
    const char *head;            /* the body up to the opening of the item array */
    const char *const *items;
    size_t n;
    size_t states[3];            /* item counts at which a client sends a request */
} convo_api;

static const convo_api weather[] = {
    {KVT_API_CHAT,
     "{\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather\","
     "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}}}],"
     "\"messages\":[",
     w_chat, sizeof w_chat / sizeof *w_chat, {2, 5, 7}},
    {KVT_API_MESSAGES,
     "{\"max_tokens\":100,\"system\":\"S\",\"tools\":[{\"name\":\"get_weather\",\"input_schema\":{\"type\":\"object\","
     "\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]},\"description\":\"Weather\"},"
     "{\"type\":\"web_search_20250305\",\"name\":\"web_search\"}],\"messages\":[",
     w_msgs, sizeof w_msgs / sizeof *w_msgs, {1, 3, 5}},
    {KVT_API_RESPONSES,
     "{\"model\":\"m\",\"instructions\":\"S\",\"tools\":[{\"type\":\"function\",\"name\":\"get_weather\","
     "\"description\":\"Weather\",\"strict\":false,\"parameters\":{\"type\":\"object\","
     "\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}},{\"type\":\"web_search\"}],\"input\":[",
     w_resp, sizeof w_resp / sizeof *w_resp, {1, 6, 8}},
};

/* The body of c with its first k items (malloc'ed). */
static char *body_k(const convo_api *c, size_t k)
{
    size_t n = strlen(c->head) + 3;
    for (size_t i = 0; i < k; i++) n += strlen(c->items[i]) + 1;
    char *b = malloc(n);
    if (!b) return NULL;
    strcpy(b, c->head);
    for (size_t i = 0; i < k; i++) {
        if (i) strcat(b, ",");
        strcat(b, c->items[i]);
    }
    strcat(b, "]}");
    return b;
}

static int render_convo(kvt_request *r, const convo_api *c, size_t k, const kvt_model *m, const kvt_parse_opts *o)
{
    char *b = body_k(c, k);
    if (!b) return KVT_ENOMEM;
    int rc = parse_o(r, c->api, b, m, o);
    free(b);
    return rc;
}

/* Occurrences of text s in p[0..n). */
static size_t count(const char *p, size_t n, const char *s)
{
    size_t k = 0, l = strlen(s);
    for (const char *q = p; (q = memmem(q, n - (size_t)(q - p), s, l)); q += l) k++;
    return k;
}

TEST(api_prompt_tool_history_deepseek)
{
    kvt_model *m = tiny();
    CHECK(m);
    for (size_t a = 0; a < 3; a++) {
        kvt_request r;
        int rc = render_convo(&r, &weather[a], weather[a].n, m, NULL);
        if (rc) { kvt_model_close(m); CHECK_OK(rc); }
        bool ok = prompt_is(&r, weather_want) && r.n_tools == 1 && r.prompt_has_bos;
        if (!ok) printf("      api %d\n", (int)weather[a].api);
        /* as the server tokenizes it, every marker is one special token:
         * as many ids >= 256 as marker texts, and ids 262..264 (｜DSML｜ and
         * the tool_result tags) among them */
        int32_t *ids = NULL;
        size_t n = 0, specials = 0, tool_ids = 0;
        if (ok && !kvt_tokenizer_encode(m->tok, r.prompt, r.prompt_len, false, true, &ids, &n)) {
            for (size_t i = 0; i < n; i++) {
                specials += ids[i] >= 256;
                tool_ids += ids[i] >= 262 && ids[i] <= 264;
            }
            static const char *const marks[] = {BOS, EOS, USR, AST, "<think>", NT, DSML, TRB, TRE};
            size_t want = 0, want_tool = 0;
            for (size_t k = 0; k < sizeof marks / sizeof *marks; k++) {
                size_t c = count(r.prompt, r.prompt_len, marks[k]);
                want += c;
                if (k >= 6) want_tool += c;
            }
            /* the history: 2 calls of 4 DSML markers in a block of 2, 2
             * results; then the header's */
            size_t head = count(THEAD, strlen(THEAD), DSML);
            ok = specials == want && tool_ids == want_tool && want_tool == 10 + 4 + head && head == 9;
            if (!ok) printf("      %zu special ids (want %zu), %zu tool ids (want %zu)\n", specials, want, tool_ids, want_tool);
        } else {
            ok = false;
        }
        free(ids);
        kvt_request_free(&r);
        if (!ok) kvt_model_close(m);
        CHECK(ok);
    }
    kvt_model_close(m);
}

/* Append-only growth with tool calls: each request's rendering is a prefix of
 * the next one's, and what the model generated after it (the calls, then the
 * answer after the results), with its end-of-sentence token, is exactly where
 * the next rendering continues. */
TEST(api_prompt_tool_history_prefix)
{
    kvt_model *m = tiny();
    CHECK(m);
    static const char *const gen[] = {WCALLS EOS, "Paris 18C, Rome 21C." EOS};
    for (size_t a = 0; a < 3; a++) {
        kvt_request r[3] = {0};
        bool ok = true;
        for (int s = 0; s < 3 && ok; s++) ok = !render_convo(&r[s], &weather[a], weather[a].states[s], m, NULL);
        for (int s = 0; s < 2 && ok; s++) {
            size_t gl = strlen(gen[s]);
            ok = is_prefix(&r[s], &r[s + 1]) && r[s + 1].prompt_len >= r[s].prompt_len + gl &&
                 !memcmp(r[s + 1].prompt + r[s].prompt_len, gen[s], gl);
            if (!ok) {
                printf("      api %d, request %d:\n      prev '%s'\n", (int)weather[a].api, s, kvt_test_esc(r[s].prompt, r[s].prompt_len));
                printf("      next '%s'\n", kvt_test_esc(r[s + 1].prompt, r[s + 1].prompt_len));
            }
        }
        /* a request that ends with tool results prompts the reply after them */
        size_t l = r[1].prompt_len;
        ok = ok && l > strlen(TRE ASN) && !strcmp(r[1].prompt + l - strlen(TRE ASN), TRE ASN);
        for (int s = 0; s < 3; s++) kvt_request_free(&r[s]);
        if (!ok) kvt_model_close(m);
        CHECK(ok);
    }
    kvt_model_close(m);
}

TEST(api_prompt_tool_history_plain)
{
    static const char want[] = "S\n\n" PTHEAD WTOOL "\n\nWeather in Paris and Rome?\n\nChecking.\n\n"
                               "{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n\n"
                               "{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Rome\"}}\n\n18C\n\n21C\n\n"
                               "Paris 18C, Rome 21C.\n\nThanks";
    for (size_t a = 0; a < 3; a++) {
        kvt_request r;
        CHECK_OK(render_convo(&r, &weather[a], weather[a].n, NULL, NULL));
        bool ok = prompt_is(&r, want) && !r.prompt_has_bos;
        kvt_request_free(&r);
        CHECK(ok);
    }
    /* a call whose arguments are not JSON is quoted */
    kvt_request r;
    CHECK_OK(parse(&r, KVT_API_CHAT,
                   "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"x\",\"function\":{\"name\":\"f\","
                   "\"arguments\":\"not json\"}}]},{\"role\":\"tool\",\"content\":\"r\"}]}", NULL, NULL));
    bool ok = prompt_is(&r, "{\"name\":\"f\",\"arguments\":\"not json\"}\n\nr");
    kvt_request_free(&r);
    CHECK(ok);
}

/* The plain template's one canonical form: compact, keys sorted at every depth (the top level
 * fixed as name, description, parameters), "$schema" dropped from the
 * parameters, reals in their shortest exact form, only the escapes JSON
 * needs. */
TEST(api_prompt_tools_canonical)
{
    kvt_model *m = tiny();
    CHECK(m);
    const char *a = "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"}],\"tools\":[{\"type\":\"function\",\"function\":"
                    "{\"name\":\"t\",\"description\":\"d \\\"q\\\"\\n\",\"strict\":true,\"parameters\":{\"$schema\":"
                    "\"http://json-schema.org/draft-07/schema#\",\"type\":\"object\",\"properties\":{\"z\":{\"type\":"
                    "\"number\",\"default\":0.95,\"minimum\":-1e-7},\"a\":{\"type\":\"string\",\"enum\":[\"\\u00e9\","
                    "\"\\u0001\",\"/\"],\"maxLength\":10}},\"required\":[\"z\"],\"additionalProperties\":false}}}]}";
    /* the same in another key order, other whitespace and number spelling */
    const char *b = "{ \"tools\" : [ { \"function\" : { \"parameters\" : { \"additionalProperties\" : false,"
                    " \"required\" : [ \"z\" ], \"properties\" : { \"a\" : { \"maxLength\" : 10, \"enum\" : [ \"\xc3\xa9\","
                    " \"\\u0001\", \"\\/\" ], \"type\" : \"string\" }, \"z\" : { \"minimum\" : -0.0000001, \"default\" :"
                    " 9.5e-1, \"type\" : \"number\" } }, \"type\" : \"object\" }, \"description\" : \"d \\\"q\\\"\\n\","
                    " \"name\" : \"t\" }, \"type\" : \"function\" } ],\n \"messages\" : [ { \"content\" : \"q\", \"role\" :"
                    " \"user\" } ] }";
    kvt_request ra, rb;
    CHECK_OK(parse(&ra, KVT_API_CHAT, a, NULL, NULL));
    CHECK_OK(parse(&rb, KVT_API_CHAT, b, NULL, NULL));
    bool same = ra.prompt_len == rb.prompt_len && !memcmp(ra.prompt, rb.prompt, ra.prompt_len);
    bool exact = prompt_is(&ra, PTHEAD "{\"name\":\"t\",\"description\":\"d \\\"q\\\"\\n\",\"parameters\":"
                                "{\"additionalProperties\":false,\"properties\":{\"a\":{\"enum\":[\"\xc3\xa9\","
                                "\"\\u0001\",\"/\"],\"maxLength\":10,\"type\":\"string\"},\"z\":{\"default\":0.95,"
                                "\"minimum\":-1e-07,\"type\":\"number\"}},\"required\":[\"z\"],\"type\":\"object\"}}"
                                "\n\nq");
    if (!same) printf("      b '%s'\n", kvt_test_esc(rb.prompt, rb.prompt_len));
    kvt_request_free(&ra);
    kvt_request_free(&rb);
    /* the deepseek template writes the function as its tojson does: every
     * key in the client's order, "$schema" and "strict" kept, ", " and ": ",
     * numbers as JavaScript prints them */
    CHECK_OK(parse(&ra, KVT_API_CHAT, a, m, NULL));
    CHECK_OK(parse(&rb, KVT_API_CHAT, b, m, NULL));
    bool v4 = prompt_is(&ra, BOS THEAD "{\"name\": \"t\", \"description\": \"d \\\"q\\\"\\n\", \"strict\": true, "
                             "\"parameters\": {\"$schema\": \"http://json-schema.org/draft-07/schema#\", \"type\": "
                             "\"object\", \"properties\": {\"z\": {\"type\": \"number\", \"default\": 0.95, \"minimum\": "
                             "-1e-7}, \"a\": {\"type\": \"string\", \"enum\": [\"\xc3\xa9\", \"\\u0001\", \"/\"], "
                             "\"maxLength\": 10}}, \"required\": [\"z\"], \"additionalProperties\": false}}\n" THOWTO USR "q" ASN);
    bool v4b = strstr(rb.prompt, "{\"parameters\": {\"additionalProperties\": false, \"required\": [\"z\"], ") != NULL;
    kvt_request_free(&ra);
    kvt_request_free(&rb);
    CHECK(v4);
    CHECK(v4b);
    kvt_model_close(m);
    CHECK(same);
    CHECK(exact);
}

/* Claude Code 2.1-like /v1/messages body: three system blocks, the first a
 * billing line whose hash changes per prompt; tools with "$schema"; a system
 * message after the user turn; thinking, context_management, output_config,
 * metadata.user_id and cache_control everywhere. */
static char *claude_code_body(const char *hash)
{
    static const char fmt[] =
        "{\"model\":\"claude-sonnet-4-5-20250929\",\"max_tokens\":32000,"
        "\"system\":[{\"type\":\"text\",\"text\":\"x-anthropic-billing-header: cc_version=2.1.3.%s; cc_entrypoint=cli;\"},"
        "{\"type\":\"text\",\"text\":\"You are Claude Code, Anthropic's official CLI for Claude.\","
        "\"cache_control\":{\"type\":\"ephemeral\"}},"
        "{\"type\":\"text\",\"text\":\"You are an interactive CLI tool.\\nUse the tools.\\n\","
        "\"cache_control\":{\"type\":\"ephemeral\",\"ttl\":\"1h\"}}],"
        "\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"<system-reminder>\\nBe brief.\\n"
        "</system-reminder>\"},{\"type\":\"text\",\"text\":\"List the files.\",\"cache_control\":{\"type\":\"ephemeral\"}}]},"
        "{\"role\":\"system\",\"content\":\"Today is 2026-01-01.\"}],"
        "\"tools\":[{\"name\":\"Bash\",\"description\":\"Run a command\",\"input_schema\":{\"$schema\":"
        "\"http://json-schema.org/draft-07/schema#\",\"type\":\"object\",\"properties\":{\"command\":{\"type\":\"string\","
        "\"description\":\"The command\"},\"timeout\":{\"type\":\"number\"}},\"required\":[\"command\"],"
        "\"additionalProperties\":false}},{\"name\":\"Read\",\"description\":\"Read a file\",\"input_schema\":"
        "{\"$schema\":\"http://json-schema.org/draft-07/schema#\",\"type\":\"object\",\"properties\":{\"file_path\":"
        "{\"type\":\"string\"}},\"required\":[\"file_path\"],\"additionalProperties\":false},"
        "\"cache_control\":{\"type\":\"ephemeral\"}}],"
        "\"metadata\":{\"user_id\":\"user_5f2e_account__session_a81c\"},\"stream\":true,"
        "\"thinking\":{\"type\":\"adaptive\"},\"context_management\":{\"edits\":[{\"type\":\"clear_thinking_20251015\","
        "\"keep\":\"all\"}]},\"output_config\":{\"effort\":\"medium\",\"format\":{\"type\":\"json_schema\",\"schema\":"
        "{\"type\":\"object\"}}},\"temperature\":1}";
    size_t n = sizeof fmt + strlen(hash);
    char *b = malloc(n);
    if (b) snprintf(b, n, fmt, hash);
    return b;
}

TEST(api_prompt_claude_code_like)
{
    kvt_model *m = tiny();
    CHECK(m);
    char *b1 = claude_code_body("9f3a1"), *b2 = claude_code_body("07c4e");
    kvt_request r1 = {0}, r2 = {0}, v1 = {0}, v2 = {0};
    kvt_parse_opts keep = {.keep_volatile = true};
    bool ok = b1 && b2 && !parse(&r1, KVT_API_MESSAGES, b1, m, NULL) && !parse(&r2, KVT_API_MESSAGES, b2, m, NULL) &&
              !parse_o(&v1, KVT_API_MESSAGES, b1, m, &keep) && !parse_o(&v2, KVT_API_MESSAGES, b2, m, &keep);
    free(b1);
    free(b2);
    kvt_model_close(m);
    if (!ok) printf("      %s\n", kvt_errmsg());
    CHECK(ok);
    /* "thinking": {"type": "adaptive"} turns thinking mode on: the reply
     * begins with its reasoning */
    ok = r1.stream && r1.max_tokens == 32000 && r1.n_tools == 2 && r1.thinking &&
         prompt_is(&r1, BOS "You are Claude Code, Anthropic's official CLI for Claude.\n\n"
                        "You are an interactive CLI tool.\nUse the tools.\n\n\nToday is 2026-01-01.\n\n" THEAD
                        "{\"name\": \"Bash\", \"description\": \"Run a command\", \"parameters\": {\"$schema\": "
                        "\"http://json-schema.org/draft-07/schema#\", \"type\": \"object\", \"properties\": {\"command\": "
                        "{\"type\": \"string\", \"description\": \"The command\"}, \"timeout\": {\"type\": \"number\"}}, "
                        "\"required\": [\"command\"], \"additionalProperties\": false}}\n"
                        "{\"name\": \"Read\", \"description\": \"Read a file\", \"parameters\": {\"$schema\": "
                        "\"http://json-schema.org/draft-07/schema#\", \"type\": \"object\", \"properties\": {\"file_path\": "
                        "{\"type\": \"string\"}}, \"required\": [\"file_path\"], \"additionalProperties\": false}}\n"
                        THOWTO USR "<system-reminder>\nBe brief.\n</system-reminder>\n\nList the files." AST
                        "<think>");
    /* the billing hash is the only difference: dropped, the prompts are equal */
    bool same = r1.prompt_len == r2.prompt_len && !memcmp(r1.prompt, r2.prompt, r1.prompt_len);
    bool clean = !strstr(r1.prompt, "billing") && !strstr(r1.prompt, "user_5f2e") && !strstr(r1.prompt, "ephemeral") &&
                 !strstr(r1.prompt, "adaptive") && !strstr(r1.prompt, "json_schema");
    /* kept, they differ, and the line is where the client put it */
    bool kept = strstr(v1.prompt, BOS "x-anthropic-billing-header: cc_version=2.1.3.9f3a1; cc_entrypoint=cli;\n\n"
                                      "You are Claude Code") != NULL &&
                !(v1.prompt_len == v2.prompt_len && !memcmp(v1.prompt, v2.prompt, v1.prompt_len));
    kvt_request_free(&r1);
    kvt_request_free(&r2);
    kvt_request_free(&v1);
    kvt_request_free(&v2);
    CHECK(ok);
    CHECK(same);
    CHECK(clean);
    CHECK(kept);
}

TEST(api_prompt_volatile_lines)
{
    /* a volatile line inside a block goes with its newline; the rest stays
     * byte for byte; the match is at line starts only, any case */
    kvt_request r;
    CHECK_OK(parse(&r, KVT_API_MESSAGES,
                   "{\"max_tokens\":1,\"system\":\"A\\nX-Anthropic-Billing-Header: h=1;\\nB \\n"
                   "see x-anthropic-billing-header: kept\",\"messages\":[{\"role\":\"user\",\"content\":\"q\"}]}",
                   NULL, NULL));
    bool ok = prompt_is(&r, "A\nB \nsee x-anthropic-billing-header: kept\n\nq");
    kvt_request_free(&r);
    CHECK(ok);
    /* in a developer message of any api too; a message of nothing else is
     * no message, and an ordinary empty system block stays */
    CHECK_OK(parse(&r, KVT_API_CHAT,
                   "{\"messages\":[{\"role\":\"developer\",\"content\":\"x-anthropic-billing-header: a\"},"
                   "{\"role\":\"system\",\"content\":\"\"},{\"role\":\"user\",\"content\":\"q\"}]}", NULL, NULL));
    ok = prompt_is(&r, "\n\nq");
    kvt_request_free(&r);
    CHECK(ok);
    /* user text is never filtered */
    CHECK_OK(parse(&r, KVT_API_RESPONSES, "{\"input\":\"x-anthropic-billing-header: u\"}", NULL, NULL));
    ok = prompt_is(&r, "x-anthropic-billing-header: u");
    kvt_request_free(&r);
    CHECK(ok);
}

/* Codex 0.171-like /v1/responses body: instructions, two developer items, an
 * environment item, the prompt, ids on every item, a namespace tool and a
 * hosted web_search, a reasoning item, replayed function_call and
 * function_call_output items (one of a namespace function), and the fields
 * Codex sends that mean nothing for the prompt. */
static const char codex_body[] =
    "{\"model\":\"gpt-5.1-codex\",\"instructions\":\"You are Codex.\","
    "\"input\":["
    "{\"type\":\"message\",\"role\":\"developer\",\"id\":\"msg_d1\",\"content\":[{\"type\":\"input_text\",\"text\":"
    "\"<permissions instructions>\\nsandbox: workspace-write\\n</permissions instructions>\"}]},"
    "{\"type\":\"message\",\"role\":\"developer\",\"id\":\"msg_d2\",\"content\":[{\"type\":\"input_text\",\"text\":"
    "\"# AGENTS.md\\nBe careful.\"}]},"
    "{\"type\":\"message\",\"role\":\"user\",\"id\":\"msg_e1\",\"content\":[{\"type\":\"input_text\",\"text\":"
    "\"<environment_context>\\n  <cwd>/work</cwd>\\n</environment_context>\"}]},"
    "{\"type\":\"message\",\"role\":\"user\",\"id\":\"msg_u1\",\"content\":[{\"type\":\"input_text\",\"text\":\"Fix the bug.\"}]},"
    "{\"type\":\"reasoning\",\"id\":\"rs_77\",\"summary\":[],\"encrypted_content\":\"gAAAAB-secret\"},"
    "{\"type\":\"function_call\",\"id\":\"fc_91\",\"call_id\":\"call_A1\",\"name\":\"shell_command\","
    "\"arguments\":\"{\\\"workdir\\\":\\\"/work\\\",\\\"command\\\":\\\"ls\\\"}\"},"
    "{\"type\":\"function_call_output\",\"id\":\"fco_92\",\"call_id\":\"call_A1\",\"output\":\"a.c\\nb.c\"},"
    "{\"type\":\"function_call\",\"id\":\"fc_93\",\"call_id\":\"call_B2\",\"namespace\":\"github\",\"name\":\"get_issue\","
    "\"arguments\":\"{\\\"number\\\":7}\"},"
    "{\"type\":\"function_call_output\",\"call_id\":\"call_B2\",\"output\":[{\"type\":\"input_text\",\"text\":\"Issue 7: crash\"}]}],"
    "\"tools\":[{\"type\":\"function\",\"name\":\"shell_command\",\"description\":\"Runs a shell command\",\"strict\":false,"
    "\"parameters\":{\"type\":\"object\",\"properties\":{\"command\":{\"type\":\"string\"},\"workdir\":{\"type\":\"string\"}},"
    "\"required\":[\"command\"],\"additionalProperties\":false}},"
    "{\"type\":\"namespace\",\"name\":\"github\",\"description\":\"GitHub\",\"tools\":[{\"type\":\"function\",\"name\":"
    "\"get_issue\",\"description\":\"Get an issue\",\"defer_loading\":true,\"parameters\":{\"type\":\"object\",\"properties\":"
    "{\"number\":{\"type\":\"integer\"}}}},{\"type\":\"custom\",\"name\":\"patch\",\"format\":{\"type\":\"text\"}}]},"
    "{\"type\":\"web_search\",\"external_web_access\":false}],"
    "\"tool_choice\":\"auto\",\"parallel_tool_calls\":false,\"reasoning\":{\"effort\":\"medium\",\"summary\":\"auto\"},"
    "\"store\":false,\"stream\":true,\"include\":[\"reasoning.encrypted_content\"],\"prompt_cache_key\":\"0199a2c4-sess\","
    "\"client_metadata\":{\"x-codex-turn\":\"turn-3\"},\"text\":{\"verbosity\":\"low\"},\"service_tier\":\"auto\"}";

#define CODEX_TOOLS "{\"name\": \"shell_command\", \"description\": \"Runs a shell command\", \"parameters\": " \
                    "{\"type\": \"object\", \"properties\": {\"command\": {\"type\": \"string\"}, \"workdir\": "  \
                    "{\"type\": \"string\"}}, \"required\": [\"command\"], \"additionalProperties\": false}}\n"       \
                    "{\"name\": \"github.get_issue\", \"description\": \"Get an issue\", \"parameters\": {\"type\": " \
                    "\"object\", \"properties\": {\"number\": {\"type\": \"integer\"}}}}\n"

TEST(api_prompt_codex_like)
{
    kvt_model *m = tiny();
    CHECK(m);
    kvt_request r;
    int rc = parse(&r, KVT_API_RESPONSES, codex_body, m, NULL);
    kvt_model_close(m);
    CHECK_OK(rc);
    bool ok = r.api == KVT_API_RESPONSES && r.stream && streq(r.model, "gpt-5.1-codex") && r.n_tools == 2 &&
              r.n_namespaces == 1 && streq(r.namespaces[0], "github") && r.max_tokens == 0 && r.n_stop == 0 &&
              prompt_is(&r, BOS "You are Codex.\n\n" THEAD CODEX_TOOLS THOWTO
                            /* the developer items are user text to this template */
                            USR "<permissions instructions>\nsandbox: workspace-write\n"
                            "</permissions instructions>\n\n# AGENTS.md\nBe careful.\n\n"
                            "<environment_context>\n  <cwd>/work</cwd>\n</environment_context>\n\nFix the bug."
                            ASN CALLS(INVOKE("shell_command", PSTR("workdir", "/work") PSTR("command", "ls"))) EOS
                            USR TRB "a.c\nb.c" TRE ASN CALLS(INVOKE("github.get_issue", PJSON("number", "7"))) EOS
                            USR TRB "Issue 7: crash" TRE ASN);
    /* per-request metadata and item ids never reach the prompt */
    static const char *const never[] = {"msg_d1", "msg_u1", "rs_77", "gAAAAB", "fc_91", "fco_92", "call_A1", "call_B2",
                                        "0199a2c4", "turn-3", "x-codex", "web_search", "patch", "verbosity"};
    for (size_t i = 0; i < sizeof never / sizeof *never && ok; i++) {
        ok = !strstr(r.prompt, never[i]);
        if (!ok) printf("      '%s' is in the prompt\n", never[i]);
    }
    kvt_request_free(&r);
    CHECK(ok);
}

/* Pi 0.73-like chat body: messages before tools, content as parts, a
 * developer message, the fields Pi sends. The same request with the keys in
 * another order, and the same conversation through /v1/messages, render to
 * the same prompt. */
TEST(api_prompt_pi_like)
{
    kvt_model *m = tiny();
    CHECK(m);
    static const char pi[] =
        "{\"model\":\"kvtier\",\"messages\":[{\"role\":\"developer\",\"content\":\"You are pi.\"},{\"role\":\"user\","
        "\"content\":[{\"type\":\"text\",\"text\":\"Read a.c\"}]}],"
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"read\",\"description\":\"Read a file\",\"parameters\":"
        "{\"type\":\"object\",\"properties\":{\"path\":{\"type\":\"string\"},\"offset\":{\"type\":\"number\"}},\"required\":"
        "[\"path\"]},\"strict\":false}},{\"type\":\"function\",\"function\":{\"name\":\"bash\",\"description\":\"Run\","
        "\"parameters\":{\"type\":\"object\",\"properties\":{\"command\":{\"type\":\"string\"}},\"required\":[\"command\"]},"
        "\"strict\":false}},{\"type\":\"function\",\"function\":{\"name\":\"edit\",\"description\":\"Edit\",\"parameters\":"
        "{\"type\":\"object\",\"properties\":{}},\"strict\":false}},{\"type\":\"function\",\"function\":{\"name\":\"write\","
        "\"description\":\"Write\",\"parameters\":{\"type\":\"object\",\"properties\":{}},\"strict\":false}}],"
        "\"max_completion_tokens\":4096,\"stream\":true,\"stream_options\":{\"include_usage\":true},\"store\":false,"
        "\"reasoning_effort\":\"medium\"}";
    static const char pi_reordered[] =
        "{\"reasoning_effort\":\"medium\",\"store\":false,\"stream_options\":{\"include_usage\":true},\"stream\":true,"
        "\"tools\":[{\"function\":{\"strict\":false,\"parameters\":{\"required\":[\"path\"],\"properties\":{\"offset\":"
        "{\"type\":\"number\"},\"path\":{\"type\":\"string\"}},\"type\":\"object\"},\"description\":\"Read a file\","
        "\"name\":\"read\"},\"type\":\"function\"},{\"function\":{\"parameters\":{\"required\":[\"command\"],\"properties\":"
        "{\"command\":{\"type\":\"string\"}},\"type\":\"object\"},\"name\":\"bash\",\"description\":\"Run\"},\"type\":"
        "\"function\"},{\"function\":{\"name\":\"edit\",\"description\":\"Edit\",\"parameters\":{\"properties\":{},\"type\":"
        "\"object\"}},\"type\":\"function\"},{\"function\":{\"description\":\"Write\",\"name\":\"write\",\"parameters\":"
        "{\"properties\":{},\"type\":\"object\"}}}],\"max_completion_tokens\":4096,"
        "\"messages\":[{\"content\":\"You are pi.\",\"role\":\"developer\"},{\"content\":[{\"text\":\"Read a.c\",\"type\":"
        "\"text\"}],\"role\":\"user\"}],\"model\":\"kvtier\"}";
    static const char anthropic[] =
        "{\"max_tokens\":4096,\"system\":[{\"type\":\"text\",\"text\":\"You are pi.\"}],\"messages\":[{\"role\":\"user\","
        "\"content\":\"Read a.c\"}],\"tools\":[{\"name\":\"read\",\"description\":\"Read a file\",\"input_schema\":"
        "{\"type\":\"object\",\"properties\":{\"path\":{\"type\":\"string\"},\"offset\":{\"type\":\"number\"}},\"required\":"
        "[\"path\"]}},{\"name\":\"bash\",\"description\":\"Run\",\"input_schema\":{\"type\":\"object\",\"properties\":"
        "{\"command\":{\"type\":\"string\"}},\"required\":[\"command\"]}},{\"name\":\"edit\",\"description\":\"Edit\","
        "\"input_schema\":{\"type\":\"object\",\"properties\":{}}},{\"name\":\"write\",\"description\":\"Write\","
        "\"input_schema\":{\"type\":\"object\",\"properties\":{}}}]}";
    kvt_request a, b, c;
    /* deepseek: the template's rendering (the developer message is user text) */
    CHECK_OK(parse(&a, KVT_API_CHAT, pi, m, NULL));
    kvt_model_close(m);
    bool ok = a.stream && a.include_usage && a.max_tokens == 4096 && a.n_tools == 4 &&
              strstr(a.prompt, BOS THEAD "{\"name\": \"read\", \"description\": \"Read a file\", \"parameters\": "
                               "{\"type\": \"object\", \"properties\": {\"path\": {\"type\": \"string\"}, \"offset\": "
                               "{\"type\": \"number\"}}, \"required\": [\"path\"]}, \"strict\": false}\n") &&
              strstr(a.prompt, THOWTO USR "You are pi.\n\nRead a.c" ASN);
    kvt_request_free(&a);
    /* plain: one canonical rendering whatever the key order or the api */
    CHECK_OK(parse(&a, KVT_API_CHAT, pi, NULL, NULL));
    CHECK_OK(parse(&b, KVT_API_CHAT, pi_reordered, NULL, NULL));
    CHECK_OK(parse(&c, KVT_API_MESSAGES, anthropic, NULL, NULL));
    bool ab = a.prompt_len == b.prompt_len && !memcmp(a.prompt, b.prompt, a.prompt_len);
    bool ac = a.prompt_len == c.prompt_len && !memcmp(a.prompt, c.prompt, a.prompt_len);
    if (!ac) printf("      chat     '%s'\n      messages '%s'\n", kvt_test_esc(a.prompt, a.prompt_len), kvt_test_esc(c.prompt, c.prompt_len));
    kvt_request_free(&a);
    kvt_request_free(&b);
    kvt_request_free(&c);
    CHECK(ok);
    CHECK(ab);
    CHECK(ac);
}

/* ---- tool calls in generated text ----------------------------------------------- */

/* What a model might write: text, then two calls with the arguments in its
 * own key order, one string value written as JSON (string="false"). */
static const char gen_text[] = "Checking.\n\n" CSB "\n" INVOKE("get_weather", PSTR("city", "Paris"))
                               INVOKE("get_weather", PJSON("units", "\"C\"") PSTR("city", "Rome")) CSE;
#define GEN_LEN (sizeof gen_text - 1)
#define GEN_TEXT_END 9 /* "Checking." */
#define INV_END "</" DSML "invoke>\n"

static bool id_ok(const char *id)
{
    if (!id || strlen(id) != 21 || strncmp(id, "call_", 5)) return false;
    for (int i = 5; i < 21; i++)
        if (!strchr("0123456789abcdef", id[i])) return false;
    return true;
}

TEST(api_tools_calls_parse)
{
    kvt_tool_call *c;
    size_t n, te;
    CHECK_OK(kvt_tool_calls_parse(gen_text, GEN_LEN, &c, &n, &te));
    bool ok = n == 2 && te == GEN_TEXT_END && streq(c[0].name, "get_weather") && streq(c[1].name, "get_weather") &&
              streq(c[0].arguments, "{\"city\":\"Paris\"}") && streq(c[1].arguments, "{\"units\":\"C\",\"city\":\"Rome\"}") &&
              c[0].valid && c[1].valid && id_ok(c[0].id) && id_ok(c[1].id) && strcmp(c[0].id, c[1].id);
    /* the raw spans tile the calls: the first starts at the end of the text
     * (with the separator and the block opener), each ends after its invoke
     * end and the newline after it, the block's end is in neither */
    ok = ok && c[0].raw_off == GEN_TEXT_END && c[1].raw_off == c[0].raw_off + c[0].raw_len &&
         c[1].raw_off + c[1].raw_len == GEN_LEN - strlen(CSE) &&
         !memcmp(gen_text + c[0].raw_off + c[0].raw_len - strlen(INV_END), INV_END, strlen(INV_END));
    kvt_tool_calls_free(c, n);
    CHECK(ok);

    /* no markers: all text */
    CHECK_OK(kvt_tool_calls_parse("plain text", 10, &c, &n, &te));
    CHECK(n == 0 && !c && te == 10);
    CHECK_OK(kvt_tool_calls_parse(NULL, 0, &c, &n, &te));
    CHECK(n == 0 && te == 0);
    /* cut by max_tokens inside the second call: the first is complete */
    size_t cut = GEN_LEN - strlen(INV_END CSE) - 10;
    CHECK_OK(kvt_tool_calls_parse(gen_text, cut, &c, &n, &te));
    ok = n == 1 && te == GEN_TEXT_END && streq(c[0].arguments, "{\"city\":\"Paris\"}");
    kvt_tool_calls_free(c, n);
    CHECK(ok);
    /* cut inside the first: no call, so everything is text */
    CHECK_OK(kvt_tool_calls_parse(gen_text, GEN_TEXT_END + 40, &c, &n, &te));
    CHECK(n == 0 && te == GEN_TEXT_END + 40);
    /* any whitespace between the markers, no arguments, JSON values of every
     * kind, a string="false" value that is not JSON (kept as a string), a
     * multi-line string, text after the calls */
    const char *loose = "Hi " CSB "<" DSML "invoke name=\"ls\">  " PJSON("a", " [1, 2.50] ") "\t" PJSON("b", "true")
                        PJSON("c", "{\"x\": null}") "</" DSML "invoke>" "<" DSML "invoke name=\"now\"></" DSML "invoke>\n"
                        INVOKE("bad", PJSON("n", "{oops")) INVOKE("w", PSTR("text", "line 1\n  line 2\n"))
                        CSE " trailing";
    CHECK_OK(kvt_tool_calls_parse(loose, strlen(loose), &c, &n, &te));
    ok = n == 4 && te == 2 && streq(c[0].name, "ls") &&
         streq(c[0].arguments, "{\"a\":[1,2.5],\"b\":true,\"c\":{\"x\":null}}") && c[0].valid &&
         streq(c[1].name, "now") && streq(c[1].arguments, "{}") && c[1].valid && streq(c[2].name, "bad") &&
         streq(c[2].arguments, "{\"n\":\"{oops\"}") && streq(c[3].arguments, "{\"text\":\"line 1\\n  line 2\\n\"}") &&
         c[0].raw_off == 2;
    if (!ok && n == 4)
        for (size_t i = 0; i < n; i++) printf("      %zu: '%s' '%s' %d\n", i, c[i].name, c[i].arguments, c[i].valid);
    kvt_tool_calls_free(c, n);
    CHECK(ok);
    /* malformed: an invoke outside a block, a name without its closing
     * quote, a parameter without string="...", an empty name */
    static const char *const bad[] = {
        "x" INVOKE("f", PSTR("a", "b")),
        "x" CSB "<" DSML "invoke name=\"f>\n" INV_END CSE,
        "x" CSB INVOKE("f", "<" DSML "parameter name=\"a\">b</" DSML "parameter>\n") CSE,
        "x" CSB INVOKE("", "") CSE,
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        CHECK_OK(kvt_tool_calls_parse(bad[i], strlen(bad[i]), &c, &n, &te));
        CHECKF(n == 0 && te == strlen(bad[i]), "malformed case %zu", i);
    }
    CHECK(kvt_tool_calls_parse(gen_text, GEN_LEN, NULL, &n, &te) == KVT_EINVAL);
    kvt_tool_calls_free(NULL, 0);

    /* ids stay unique */
    char seen[64][24];
    for (int i = 0; i < 64; i++) {
        CHECK_OK(kvt_tool_calls_parse(gen_text, GEN_LEN, &c, &n, &te));
        ok = n == 2 && id_ok(c[0].id);
        if (ok) snprintf(seen[i], sizeof seen[i], "%s", c[0].id);
        for (int k = 0; k < i && ok; k++) ok = strcmp(seen[k], seen[i]) != 0;
        kvt_tool_calls_free(c, n);
        CHECK(ok);
    }
}

TEST(api_tools_calls_text_len)
{
    /* streaming: text before a block is safe; a tail that could start one is
     * held back until it can be told apart, and so is trailing whitespace
     * (a reply with calls loses the separator before them) */
    CHECK(kvt_tool_calls_text_len(gen_text, GEN_LEN) == GEN_TEXT_END);
    CHECK(kvt_tool_calls_text_len("abc", 3) == 3);
    CHECK(kvt_tool_calls_text_len("abc<", 4) == 3);
    CHECK(kvt_tool_calls_text_len("abc\n\n", 5) == 3);
    CHECK(kvt_tool_calls_text_len("abc \n<" FW, 9) == 3);
    const char *part = "abc" CSB;
    for (size_t k = 1; k < strlen(CSB); k++) CHECK(kvt_tool_calls_text_len(part, 3 + k) == 3);
    CHECK(kvt_tool_calls_text_len(part, strlen(part)) == 3);
    CHECK(kvt_tool_calls_text_len("a<b", 3) == 3);
    CHECK(kvt_tool_calls_text_len("x <\xef\xbd\x9c" "User", 10) == 10); /* another marker */
    CHECK(kvt_tool_calls_text_len(NULL, 0) == 0);
}

/* The replay hook of the round trip: the raw bytes of each call, by id. */
typedef struct replay_map {
    const kvt_tool_call *calls;
    size_t n;
    const char *text;
    int hits;
} replay_map;

static const char *replay_cb(void *user, const char *id, size_t *len)
{
    replay_map *rm = user;
    for (size_t i = 0; i < rm->n; i++)
        if (!strcmp(rm->calls[i].id, id)) {
            rm->hits++;
            *len = rm->calls[i].raw_len;
            return rm->text + rm->calls[i].raw_off;
        }
    return NULL;
}

/* The next request a client sends after the response j to request body1:
 * the reply as the client got it, then the two results. */
static char *next_body(kvt_api api, const char *body1, const json_t *j, const kvt_tool_call *c)
{
    json_t *b = json_loads(body1, 0, NULL);
    if (!b) return NULL;
    json_t *arr = json_object_get(b, api == KVT_API_RESPONSES ? "input" : "messages");
    static const char *const results[] = {"18C", "21C"};
    if (api == KVT_API_CHAT) {
        json_array_append(arr, at(j, "choices.0.message"));
        for (int i = 0; i < 2; i++)
            json_array_append_new(arr, json_pack("{s:s, s:s, s:s}", "role", "tool", "tool_call_id", c[i].id, "content",
                                                 results[i]));
    } else if (api == KVT_API_MESSAGES) {
        json_array_append_new(arr, json_pack("{s:s, s:O}", "role", "assistant", "content", at(j, "content")));
        json_array_append_new(arr, json_pack("{s:s, s:[{s:s, s:s, s:s}, {s:s, s:s, s:s}]}", "role", "user", "content",
                                             "type", "tool_result", "tool_use_id", c[0].id, "content", results[0],
                                             "type", "tool_result", "tool_use_id", c[1].id, "content", results[1]));
    } else {
        json_array_extend(arr, at(j, "output"));
        for (int i = 0; i < 2; i++)
            json_array_append_new(arr, json_pack("{s:s, s:s, s:s}", "type", "function_call_output", "call_id", c[i].id,
                                                 "output", results[i]));
    }
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

/* The whole loop for each api: a request with tools, the model's forced
 * output parsed into calls, the response the client gets, the client's next
 * request built from that response, and its rendering. With the replay hook
 * the rendering continues exactly where the sampled tokens end; without it
 * the calls render canonically (a negative control: the bytes differ). */
TEST(api_tools_roundtrip)
{
    kvt_model *m = tiny();
    CHECK(m);
    static const char *const ids[] = {"chatcmpl-7", "msg_7", "resp_7"};
    for (size_t a = 0; a < 3; a++) {
        const convo_api *cv = &weather[a];
        char *body1 = body_k(cv, cv->states[0]);
        kvt_request r1 = {0}, r2 = {0}, r3 = {0};
        kvt_tool_call *c = NULL;
        size_t n = 0, te = 0;
        char *resp = NULL, *body2 = NULL;
        json_t *j = NULL;
        bool ok = body1 && !parse(&r1, cv->api, body1, m, NULL) &&
                  !kvt_tool_calls_parse(gen_text, GEN_LEN, &c, &n, &te) && n == 2;
        if (ok) {
            resp = kvt_response_json_calls(&r1, ids[a], "kvtier", gen_text, te, c, n, "stop", NULL, &U1, 1);
            ok = (j = load(resp)) && (body2 = next_body(cv->api, body1, j, c));
        }
        replay_map rm = {c, n, gen_text, 0};
        kvt_parse_opts o = {.replay = replay_cb, .replay_user = &rm};
        ok = ok && !parse_o(&r2, cv->api, body2, m, &o) && !parse(&r3, cv->api, body2, m, NULL);
        if (!ok) printf("      api %d: %s\n", (int)cv->api, kvt_errmsg());
        if (ok) {
            /* prompt 1, the sampled bytes, the end-of-sentence token */
            size_t l1 = r1.prompt_len;
            ok = rm.hits == 2 && is_prefix(&r1, &r2) && r2.prompt_len > l1 + GEN_LEN &&
                 !memcmp(r2.prompt + l1, gen_text, GEN_LEN) &&
                 !strncmp(r2.prompt + l1 + GEN_LEN, EOS USR TRB "18C" TRE "\n\n" TRB "21C" TRE ASN,
                          strlen(EOS USR TRB "18C" TRE "\n\n" TRB "21C" TRE ASN));
            if (!ok) printf("      api %d with replay: '%s'\n", (int)cv->api, kvt_test_esc(r2.prompt, r2.prompt_len));
            const char *canon = "Checking." CALLS(INVOKE("get_weather", PSTR("city", "Paris"))
                                INVOKE("get_weather", PSTR("units", "C") PSTR("city", "Rome"))) EOS;
            bool neg = is_prefix(&r1, &r3) && memcmp(r3.prompt + r1.prompt_len, gen_text, GEN_LEN) != 0 &&
                       !strncmp(r3.prompt + r1.prompt_len, canon, strlen(canon));
            if (!neg) printf("      api %d without replay: '%s'\n", (int)cv->api, kvt_test_esc(r3.prompt, r3.prompt_len));
            ok = ok && neg;
        }
        json_decref(j);
        free(resp);
        free(body1);
        free(body2);
        kvt_tool_calls_free(c, n);
        kvt_request_free(&r1);
        kvt_request_free(&r2);
        kvt_request_free(&r3);
        if (!ok) kvt_model_close(m);
        CHECK(ok);
    }
    kvt_model_close(m);
}

/* A call of a namespace function goes out as name + namespace and comes
 * back (as Codex replays it) to the same rendering. */
TEST(api_tools_namespace_roundtrip)
{
    const char *body = "{\"input\":\"q\",\"tools\":[{\"type\":\"namespace\",\"name\":\"github\",\"description\":\"G\","
                       "\"tools\":[{\"type\":\"function\",\"name\":\"get_issue\",\"parameters\":{\"type\":\"object\"}}]},"
                       "{\"type\":\"function\",\"name\":\"github_x\"}]}";
    kvt_request r;
    CHECK_OK(parse(&r, KVT_API_RESPONSES, body, NULL, NULL));
    const char *gen = CSB INVOKE("github.get_issue", PJSON("number", "7")) INVOKE("github_x", "\n") CSE;
    kvt_tool_call *c;
    size_t n, te;
    CHECK_OK(kvt_tool_calls_parse(gen, strlen(gen), &c, &n, &te));
    char *s = kvt_response_json_calls(&r, "resp_1", "m", gen, te, c, n, NULL, NULL, NULL, 0);
    json_t *j = load(s);
    free(s);
    bool ok = j && n == 2 && te == 0 && json_array_size(at(j, "output")) == 2 &&
              streq(sget(j, "output.0.type"), "function_call") && streq(sget(j, "output.0.name"), "get_issue") &&
              streq(sget(j, "output.0.namespace"), "github") && streq(sget(j, "output.1.name"), "github_x") &&
              !at(j, "output.1.namespace");
    json_t *item = ok ? json_deep_copy(at(j, "output.0")) : NULL;
    json_decref(j);
    kvt_tool_calls_free(c, n);
    kvt_request_free(&r);
    CHECK(ok);
    json_t *b2 = json_pack("{s:[{s:s, s:s}, o, {s:s, s:s, s:s}]}", "input", "role", "user", "content", "q", item,
                           "type", "function_call_output", "call_id", "x", "output", "done");
    char *body2 = json_dumps(b2, JSON_COMPACT);
    json_decref(b2);
    CHECK(body2);
    int rc = parse(&r, KVT_API_RESPONSES, body2, NULL, NULL);
    free(body2);
    CHECK_OK(rc);
    ok = strstr(r.prompt, "{\"name\":\"github.get_issue\",\"arguments\":{\"number\":7}}") != NULL;
    kvt_request_free(&r);
    CHECK(ok);
}

/* ---- responses with tool calls ---------------------------------------------------- */

static int gen_calls(kvt_tool_call **c, size_t *n)
{
    size_t te;
    return kvt_tool_calls_parse(gen_text, GEN_LEN, c, n, &te);
}

TEST(api_tools_response)
{
    kvt_tool_call *c;
    size_t n;
    CHECK_OK(gen_calls(&c, &n));
    /* OpenAI chat: message.tool_calls, finish_reason tool_calls */
    kvt_request r = {.api = KVT_API_CHAT};
    char *s = kvt_response_json_calls(&r, "chatcmpl-1", "kvtier", gen_text, GEN_TEXT_END, c, n, "stop", NULL, &U1, 3);
    json_t *j = load(s);
    free(s);
    bool ok = j && streq(sget(j, "choices.0.message.content"), "Checking.") &&
              json_array_size(at(j, "choices.0.message.tool_calls")) == 2 &&
              streq(sget(j, "choices.0.message.tool_calls.0.id"), c[0].id) &&
              streq(sget(j, "choices.0.message.tool_calls.0.type"), "function") &&
              streq(sget(j, "choices.0.message.tool_calls.1.function.name"), "get_weather") &&
              streq(sget(j, "choices.0.message.tool_calls.1.function.arguments"), "{\"units\":\"C\",\"city\":\"Rome\"}") &&
              streq(sget(j, "choices.0.finish_reason"), "tool_calls") && openai_usage_ok(at(j, "usage"), 100, 20, 60);
    json_decref(j);
    /* only calls: content null */
    s = kvt_response_json_calls(&r, "c", "m", "", 0, c, 1, NULL, NULL, NULL, 0);
    j = load(s);
    free(s);
    ok = ok && j && is_null(j, "choices.0.message.content") && json_array_size(at(j, "choices.0.message.tool_calls")) == 1;
    json_decref(j);
    /* length stays length */
    s = kvt_response_json_calls(&r, "c", "m", "", 0, c, 1, "length", NULL, NULL, 0);
    j = load(s);
    free(s);
    ok = ok && j && streq(sget(j, "choices.0.finish_reason"), "length");
    json_decref(j);
    CHECK(ok);

    /* Anthropic: tool_use blocks with input objects, stop_reason tool_use */
    r.api = KVT_API_MESSAGES;
    s = kvt_response_json_calls(&r, "msg_1", "kvtier", gen_text, GEN_TEXT_END, c, n, "stop", NULL, &U1, 0);
    j = load(s);
    free(s);
    ok = j && json_array_size(at(j, "content")) == 3 && streq(sget(j, "content.0.type"), "text") &&
         streq(sget(j, "content.0.text"), "Checking.") && streq(sget(j, "content.1.type"), "tool_use") &&
         streq(sget(j, "content.1.id"), c[0].id) && streq(sget(j, "content.1.name"), "get_weather") &&
         streq(sget(j, "content.1.input.city"), "Paris") && streq(sget(j, "content.2.input.units"), "C") &&
         streq(sget(j, "stop_reason"), "tool_use") && is_null(j, "stop_sequence") &&
         anthropic_usage_ok(at(j, "usage"), 10, 20, 60, 30);
    json_decref(j);
    /* input keeps every digit of a real */
    kvt_tool_call exact = {.id = "call_1", .name = "f", .arguments = "{\"x\":0.123456789012}", .valid = true};
    s = kvt_response_json_calls(&r, "msg_3", "m", "", 0, &exact, 1, NULL, NULL, NULL, 0);
    j = load(s);
    free(s);
    ok = ok && j && json_real_value(at(j, "content.0.input.x")) == 0.123456789012;
    json_decref(j);
    /* only calls: no empty text block; arguments that are not an object: {} */
    kvt_tool_call odd = {.id = "call_0", .name = "f", .arguments = "not json", .valid = false};
    s = kvt_response_json_calls(&r, "msg_2", "m", "", 0, &odd, 1, NULL, NULL, NULL, 0);
    j = load(s);
    free(s);
    ok = ok && j && json_array_size(at(j, "content")) == 1 && streq(sget(j, "content.0.type"), "tool_use") &&
         json_is_object(at(j, "content.0.input")) && json_object_size(at(j, "content.0.input")) == 0;
    json_decref(j);
    CHECK(ok);

    /* legacy completions: text only */
    r.api = KVT_API_COMPLETIONS;
    s = kvt_response_json_calls(&r, "cmpl", "m", "ab", 2, c, n, "stop", NULL, NULL, 0);
    j = load(s);
    free(s);
    ok = j && streq(sget(j, "choices.0.text"), "ab") && streq(sget(j, "choices.0.finish_reason"), "stop");
    json_decref(j);
    kvt_tool_calls_free(c, n);
    CHECK(ok);
}

/* The Response object as the openai client types it and Codex reads it. */
static bool response_ok(const json_t *j, const char *id, const char *status, size_t n_out)
{
    bool ok = j && streq(sget(j, "id"), id) && streq(sget(j, "object"), "response") && iget(j, "created_at") == 1234 &&
              streq(sget(j, "status"), status) && is_null(j, "error") && streq(sget(j, "model"), "kvtier") &&
              json_array_size(at(j, "output")) == n_out && json_is_true(at(j, "parallel_tool_calls")) &&
              json_is_array(at(j, "tools")) && streq(sget(j, "tool_choice"), "auto") &&
              json_is_number(at(j, "temperature")) && json_is_number(at(j, "top_p")) && json_is_object(at(j, "metadata")) &&
              at(j, "instructions") && at(j, "incomplete_details");
    if (!ok) {
        char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
        printf("      response %s\n", s ? s : "(null)");
        free(s);
    }
    return ok;
}

static bool responses_usage_ok(const json_t *u)
{
    return iget(u, "input_tokens") == 100 && iget(u, "input_tokens_details.cached_tokens") == 60 &&
           iget(u, "output_tokens") == 20 && iget(u, "output_tokens_details.reasoning_tokens") == 0 &&
           iget(u, "total_tokens") == 120;
}

TEST(api_responses_response)
{
    kvt_request r;
    CHECK_OK(parse(&r, KVT_API_RESPONSES, "{\"input\":\"q\",\"temperature\":0.2,\"top_p\":0,\"max_output_tokens\":50}",
                   NULL, NULL));
    char *s = kvt_response_json(&r, "resp_abc", "kvtier", "Hi \"there\"", 10, "stop", NULL, &U1, 1234);
    json_t *j = load(s);
    free(s);
    bool ok = response_ok(j, "resp_abc", "completed", 1) && is_null(j, "incomplete_details") &&
              iget(j, "max_output_tokens") == 50 && json_real_value(at(j, "temperature")) == 0.2 &&
              json_number_value(at(j, "top_p")) == 0 &&
              streq(sget(j, "output.0.type"), "message") && streq(sget(j, "output.0.id"), "msg_abc") &&
              streq(sget(j, "output.0.status"), "completed") && streq(sget(j, "output.0.role"), "assistant") &&
              json_array_size(at(j, "output.0.content")) == 1 && streq(sget(j, "output.0.content.0.type"), "output_text") &&
              streq(sget(j, "output.0.content.0.text"), "Hi \"there\"") &&
              json_array_size(at(j, "output.0.content.0.annotations")) == 0 && responses_usage_ok(at(j, "usage"));
    json_decref(j);
    CHECK(ok);
    /* max_output_tokens reached: incomplete, with the reason */
    s = kvt_response_json(&r, "resp_2", "kvtier", "Hi", 2, "length", NULL, &U1, 1234);
    j = load(s);
    free(s);
    ok = response_ok(j, "resp_2", "incomplete", 1) &&
         streq(sget(j, "incomplete_details.reason"), "max_output_tokens") && streq(sget(j, "output.0.status"), "incomplete");
    json_decref(j);
    CHECK(ok);
    /* tool calls: the message (there is text), then function_call items */
    kvt_tool_call *c;
    size_t n;
    CHECK_OK(gen_calls(&c, &n));
    s = kvt_response_json_calls(&r, "resp_3", "kvtier", gen_text, GEN_TEXT_END, c, n, "stop", NULL, &U1, 1234);
    j = load(s);
    free(s);
    char fid[40];
    snprintf(fid, sizeof fid, "fc_%s", c[1].id + 5);
    ok = response_ok(j, "resp_3", "completed", 3) && streq(sget(j, "output.0.content.0.text"), "Checking.") &&
         streq(sget(j, "output.1.type"), "function_call") && streq(sget(j, "output.1.call_id"), c[0].id) &&
         streq(sget(j, "output.1.name"), "get_weather") && streq(sget(j, "output.1.arguments"), "{\"city\":\"Paris\"}") &&
         streq(sget(j, "output.1.status"), "completed") && streq(sget(j, "output.2.id"), fid) &&
         !at(j, "output.1.namespace");
    json_decref(j);
    /* only calls: no message item */
    s = kvt_response_json_calls(&r, "resp_4", "kvtier", "", 0, c, n, NULL, NULL, &U1, 1234);
    j = load(s);
    free(s);
    ok = ok && response_ok(j, "resp_4", "completed", 2) && streq(sget(j, "output.0.type"), "function_call");
    json_decref(j);
    kvt_tool_calls_free(c, n);
    kvt_request_free(&r);
    CHECK(ok);
    /* errors in the OpenAI shape */
    s = kvt_error_json(KVT_API_RESPONSES, 400, "bad");
    j = load(s);
    free(s);
    ok = j && streq(sget(j, "error.type"), "invalid_request_error") && streq(sget(j, "error.message"), "bad");
    json_decref(j);
    CHECK(ok);
}

/* ---- streams with tool calls, and Responses streams ------------------------------------- */

/* A whole stream: begin, the text in pieces, the end with the calls. */
static char *stream_calls(kvt_request *r, const char *id, const char *text, const kvt_tool_call *c, size_t n,
                          const char *finish)
{
    char *acc = NULL;
    kvt_usage begin = U1;
    begin.completion_tokens = 0;
    size_t len = strlen(text), half = len / 2;
    cat(&acc, kvt_stream_begin(r, id, "kvtier", &begin, 1234));
    cat(&acc, kvt_stream_delta(r, id, "kvtier", text, half, 1234));
    cat(&acc, kvt_stream_delta(r, id, "kvtier", text + half, len - half, 1234));
    cat(&acc, kvt_stream_end_calls(r, id, "kvtier", text, len, c, n, finish, NULL, &U1, 1234));
    return acc;
}

TEST(api_tools_stream_chat)
{
    kvt_tool_call *c;
    size_t n;
    CHECK_OK(gen_calls(&c, &n));
    kvt_request r = {.api = KVT_API_CHAT, .stream = true, .include_usage = true};
    char *s = stream_calls(&r, "chatcmpl-1", "Checking.", c, n, "stop");
    event ev[16];
    int ne = split_sse(s, ev, 16);
    if (ne < 0) printf("      malformed SSE: %s\n", s ? s : "(null)");
    free(s);
    /* role, 2 text chunks, 2 call chunks, finish, usage, [DONE] */
    bool ok = ne == 8;
    /* the openai client merges tool_calls deltas by index */
    for (int k = 0; k < 2 && ok; k++) {
        json_t *d = ev[3 + k].data;
        ok = json_array_size(at(d, "choices.0.delta.tool_calls")) == 1 && iget(d, "choices.0.delta.tool_calls.0.index") == k &&
             streq(sget(d, "choices.0.delta.tool_calls.0.id"), c[k].id) &&
             streq(sget(d, "choices.0.delta.tool_calls.0.type"), "function") &&
             streq(sget(d, "choices.0.delta.tool_calls.0.function.name"), "get_weather") &&
             streq(sget(d, "choices.0.delta.tool_calls.0.function.arguments"), c[k].arguments) &&
             is_null(d, "choices.0.finish_reason") && is_null(d, "usage");
    }
    ok = ok && streq(sget(ev[5].data, "choices.0.finish_reason"), "tool_calls") &&
         json_array_size(at(ev[6].data, "choices")) == 0 && openai_usage_ok(at(ev[6].data, "usage"), 100, 20, 60) &&
         ev[7].done;
    free_events(ev, ne > 0 ? ne : 0);
    kvt_tool_calls_free(c, n);
    CHECK(ok);
}

TEST(api_tools_stream_messages)
{
    kvt_tool_call *c;
    size_t n;
    CHECK_OK(gen_calls(&c, &n));
    kvt_request r = {.api = KVT_API_MESSAGES, .stream = true};
    char *s = stream_calls(&r, "msg_1", "Checking.", c, n, "stop");
    event ev[24];
    int ne = split_sse(s, ev, 24);
    if (ne < 0) printf("      malformed SSE: %s\n", s ? s : "(null)");
    free(s);
    static const char *const names[] = {"message_start", "content_block_start", "ping", "content_block_delta",
                                        "content_block_delta", "content_block_stop",
                                        "content_block_start", "content_block_delta", "content_block_stop",
                                        "content_block_start", "content_block_delta", "content_block_stop",
                                        "message_delta", "message_stop"};
    bool ok = ne == 14;
    for (int i = 0; i < ne && ok; i++) ok = streq(ev[i].name, names[i]) && streq(sget(ev[i].data, "type"), names[i]);
    /* tool_use blocks at indices 1 and 2; the SDK joins partial_json and
     * parses it into the block's input */
    for (int k = 0; k < 2 && ok; k++) {
        json_t *st = ev[6 + 3 * k].data, *d = ev[7 + 3 * k].data, *sp = ev[8 + 3 * k].data;
        json_t *input = load(sget(d, "delta.partial_json"));
        ok = iget(st, "index") == k + 1 && streq(sget(st, "content_block.type"), "tool_use") &&
             streq(sget(st, "content_block.id"), c[k].id) && streq(sget(st, "content_block.name"), "get_weather") &&
             json_object_size(at(st, "content_block.input")) == 0 && iget(d, "index") == k + 1 &&
             streq(sget(d, "delta.type"), "input_json_delta") && json_is_object(input) && iget(sp, "index") == k + 1;
        ok = ok && streq(sget(input, "city"), k ? "Rome" : "Paris");
        json_decref(input);
    }
    ok = ok && iget(ev[5].data, "index") == 0 && streq(sget(ev[12].data, "delta.stop_reason"), "tool_use") &&
         is_null(ev[12].data, "delta.stop_sequence") && anthropic_usage_ok(at(ev[12].data, "usage"), 10, 20, 60, 30);
    free_events(ev, ne > 0 ? ne : 0);
    kvt_tool_calls_free(c, n);
    CHECK(ok);
}

/* Every Responses event: named as its type, sequence numbers 0, 1, 2, ... */
static bool responses_events_ok(const event *ev, int n, const char *const *names)
{
    for (int i = 0; i < n; i++) {
        bool ok = streq(ev[i].name, names[i]) && streq(sget(ev[i].data, "type"), names[i]) &&
                  iget(ev[i].data, "sequence_number") == i;
        if (!ok) {
            printf("      event %d: '%s' (want '%s'), sequence %lld\n", i, ev[i].name, names[i],
                   iget(ev[i].data, "sequence_number"));
            return false;
        }
    }
    return true;
}

TEST(api_responses_stream)
{
    kvt_request r;
    CHECK_OK(parse(&r, KVT_API_RESPONSES, "{\"input\":\"q\",\"stream\":true}", NULL, NULL));
    char *s = stream_calls(&r, "resp_9", "Hello w\xc3\xb6rld", NULL, 0, "stop");
    event ev[16];
    int ne = split_sse(s, ev, 16);
    if (ne < 0) printf("      malformed SSE: %s\n", s ? s : "(null)");
    free(s);
    static const char *const names[] = {"response.created", "response.in_progress", "response.output_item.added",
                                        "response.content_part.added", "response.output_text.delta",
                                        "response.output_text.delta", "response.output_text.done",
                                        "response.content_part.done", "response.output_item.done",
                                        "response.completed"};
    bool ok = ne == 10 && responses_events_ok(ev, ne, names);
    char text[64] = "";
    if (ok) {
        json_t *cr = at(ev[0].data, "response");
        ok = streq(sget(cr, "id"), "resp_9") && streq(sget(cr, "status"), "in_progress") &&
             json_array_size(at(cr, "output")) == 0 && is_null(cr, "usage") &&
             streq(sget(ev[1].data, "response.status"), "in_progress");
        json_t *ia = ev[2].data, *pa = ev[3].data;
        ok = ok && iget(ia, "output_index") == 0 && streq(sget(ia, "item.id"), "msg_9") &&
             streq(sget(ia, "item.type"), "message") && streq(sget(ia, "item.status"), "in_progress") &&
             json_array_size(at(ia, "item.content")) == 0 && streq(sget(pa, "item_id"), "msg_9") &&
             iget(pa, "output_index") == 0 && iget(pa, "content_index") == 0 &&
             streq(sget(pa, "part.type"), "output_text") && streq(sget(pa, "part.text"), "") &&
             json_is_array(at(pa, "part.annotations"));
        for (int i = 4; i < 6 && ok; i++) {
            json_t *d = ev[i].data;
            ok = streq(sget(d, "item_id"), "msg_9") && iget(d, "output_index") == 0 && iget(d, "content_index") == 0 &&
                 json_is_array(at(d, "logprobs")) && sget(d, "delta");
            if (ok) strncat(text, sget(d, "delta"), sizeof text - strlen(text) - 1);
        }
        ok = ok && streq(text, "Hello w\xc3\xb6rld") && streq(sget(ev[6].data, "text"), text) &&
             streq(sget(ev[7].data, "part.text"), text) && streq(sget(ev[8].data, "item.status"), "completed") &&
             streq(sget(ev[8].data, "item.content.0.text"), text);
        /* response.completed carries what the non-streaming body holds */
        char *body = kvt_response_json(&r, "resp_9", "kvtier", text, strlen(text), "stop", NULL, &U1, 1234);
        json_t *j = load(body);
        free(body);
        ok = ok && response_ok(at(ev[9].data, "response"), "resp_9", "completed", 1) &&
             json_equal(at(ev[9].data, "response"), j) && responses_usage_ok(at(ev[9].data, "response.usage"));
        json_decref(j);
    }
    free_events(ev, ne > 0 ? ne : 0);
    CHECK(ok);

    /* nothing generated: the message item still opens and closes, empty */
    s = stream_calls(&r, "resp_10", "", NULL, 0, "stop");
    ne = split_sse(s, ev, 16);
    free(s);
    static const char *const empty[] = {"response.created", "response.in_progress", "response.output_item.added",
                                        "response.content_part.added", "response.output_text.done",
                                        "response.content_part.done", "response.output_item.done", "response.completed"};
    ok = ne == 8 && responses_events_ok(ev, ne, empty) && streq(sget(ev[4].data, "text"), "");
    free_events(ev, ne > 0 ? ne : 0);
    kvt_request_free(&r);
    CHECK(ok);
}

TEST(api_responses_stream_tool_calls)
{
    kvt_request r;
    CHECK_OK(parse(&r, KVT_API_RESPONSES, codex_body, NULL, NULL));
    /* a namespace call and a plain one, after text */
    const char *gen = "On it." CALLS(INVOKE("github.get_issue", PJSON("number", "7"))
                                     INVOKE("shell_command", PSTR("command", "make")));
    kvt_tool_call *c;
    size_t n, te;
    CHECK_OK(kvt_tool_calls_parse(gen, strlen(gen), &c, &n, &te));
    CHECK(n == 2 && te == 6);
    char *s = stream_calls(&r, "resp_5", "On it.", c, n, "stop");
    event ev[32];
    int ne = split_sse(s, ev, 32);
    if (ne < 0) printf("      malformed SSE: %s\n", s ? s : "(null)");
    free(s);
    static const char *const names[] = {
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"};
    bool ok = ne == 18 && responses_events_ok(ev, ne, names);
    for (int k = 0; k < 2 && ok; k++) {
        json_t *added = ev[9 + 4 * k].data, *delta = ev[10 + 4 * k].data, *done = ev[11 + 4 * k].data,
               *item = ev[12 + 4 * k].data;
        char fid[40];
        snprintf(fid, sizeof fid, "fc_%s", c[k].id + 5);
        const char *name = k ? "shell_command" : "get_issue";
        ok = iget(added, "output_index") == 1 + k && streq(sget(added, "item.type"), "function_call") &&
             streq(sget(added, "item.id"), fid) && streq(sget(added, "item.status"), "in_progress") &&
             streq(sget(added, "item.call_id"), c[k].id) && streq(sget(added, "item.name"), name) &&
             streq(sget(added, "item.arguments"), "") && streq(sget(delta, "item_id"), fid) &&
             iget(delta, "output_index") == 1 + k && streq(sget(delta, "delta"), c[k].arguments) &&
             streq(sget(done, "item_id"), fid) && streq(sget(done, "name"), name) &&
             streq(sget(done, "arguments"), c[k].arguments) && iget(item, "output_index") == 1 + k &&
             streq(sget(item, "item.status"), "completed") && streq(sget(item, "item.arguments"), c[k].arguments);
        ok = ok && (k ? !at(added, "item.namespace") : streq(sget(added, "item.namespace"), "github") &&
                                                          streq(sget(item, "item.namespace"), "github"));
    }
    json_t *resp = ok ? at(ev[17].data, "response") : NULL;
    char *body = kvt_response_json_calls(&r, "resp_5", "kvtier", "On it.", 6, c, n, "stop", NULL, &U1, 1234);
    json_t *j = load(body);
    free(body);
    ok = ok && response_ok(resp, "resp_5", "completed", 3) && json_equal(resp, j) &&
         streq(sget(resp, "output.1.arguments"), "{\"number\":7}");
    json_decref(j);
    free_events(ev, ne > 0 ? ne : 0);

    /* only calls: no message item, the first call at output_index 0 */
    s = stream_calls(&r, "resp_6", "", c, 1, "stop");
    ne = split_sse(s, ev, 32);
    free(s);
    static const char *const only[] = {"response.created", "response.in_progress", "response.output_item.added",
                                       "response.function_call_arguments.delta",
                                       "response.function_call_arguments.done", "response.output_item.done",
                                       "response.completed"};
    ok = ok && ne == 7 && responses_events_ok(ev, ne, only) && iget(ev[2].data, "output_index") == 0 &&
         json_array_size(at(ev[6].data, "response.output")) == 1;
    free_events(ev, ne > 0 ? ne : 0);
    kvt_tool_calls_free(c, n);
    kvt_request_free(&r);
    CHECK(ok);
}

TEST(api_responses_stream_error)
{
    char *s = kvt_stream_error(KVT_API_RESPONSES, 503, "busy");
    event ev[4];
    int n = split_sse(s, ev, 4);
    free(s);
    /* the openai client throws on data.error; Codex reads response.failed */
    bool ok = n == 2 && streq(ev[0].name, "error") && streq(sget(ev[0].data, "type"), "error") &&
              streq(sget(ev[0].data, "message"), "busy") && streq(sget(ev[0].data, "error.message"), "busy") &&
              streq(sget(ev[0].data, "error.type"), "overloaded_error") && streq(ev[1].name, "response.failed") &&
              streq(sget(ev[1].data, "type"), "response.failed") && streq(sget(ev[1].data, "response.status"), "failed") &&
              streq(sget(ev[1].data, "response.error.message"), "busy") &&
              iget(ev[1].data, "sequence_number") > iget(ev[0].data, "sequence_number");
    free_events(ev, n > 0 ? n : 0);
    CHECK(ok);
}

/* ---- log-probabilities ------------------------------------------------------------ */

TEST(api_logprobs_parse)
{
    static const struct { kvt_api api; const char *body; bool on; uint32_t top; } cases[] = {
        {KVT_API_CHAT, "{\"messages\":" U "}", false, 0},
        {KVT_API_CHAT, "{\"messages\":" U ",\"logprobs\":false,\"top_logprobs\":null}", false, 0},
        {KVT_API_CHAT, "{\"messages\":" U ",\"logprobs\":true}", true, 0},
        {KVT_API_CHAT, "{\"messages\":" U ",\"logprobs\":true,\"top_logprobs\":20}", true, 20},
        {KVT_API_CHAT, "{\"messages\":" U ",\"logprobs\":true,\"top_logprobs\":3.0}", true, 3},
        {KVT_API_COMPLETIONS, "{\"prompt\":\"a\",\"logprobs\":null}", false, 0},
        {KVT_API_COMPLETIONS, "{\"prompt\":\"a\",\"logprobs\":0}", true, 0},
        {KVT_API_COMPLETIONS, "{\"prompt\":\"a\",\"logprobs\":5}", true, 5},
        {KVT_API_RESPONSES, "{\"input\":\"q\",\"include\":[\"reasoning.encrypted_content\"]}", false, 0},
        {KVT_API_RESPONSES, "{\"input\":\"q\",\"include\":[\"reasoning.encrypted_content\","
                            "\"message.output_text.logprobs\"]}", true, 0},
        {KVT_API_RESPONSES, "{\"input\":\"q\",\"include\":[\"message.output_text.logprobs\"],\"top_logprobs\":3}", true, 3},
        {KVT_API_RESPONSES, "{\"input\":\"q\",\"top_logprobs\":2}", true, 2},
        {KVT_API_RESPONSES, "{\"input\":\"q\",\"top_logprobs\":0,\"include\":null}", false, 0},
        /* Anthropic has no log-probabilities: the fields are unknown there */
        {KVT_API_MESSAGES, "{\"max_tokens\":5,\"messages\":" U ",\"logprobs\":true,\"top_logprobs\":99}", false, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        kvt_request r;
        int st = 0;
        int rc = parse(&r, cases[i].api, cases[i].body, NULL, &st);
        bool ok = rc == KVT_OK && r.logprobs == cases[i].on && r.top_logprobs == cases[i].top;
        if (!ok) printf("      case %zu (%s): rc %d (%s), logprobs %d top %u\n", i, cases[i].body, rc, kvt_errmsg(),
                        r.logprobs, r.top_logprobs);
        kvt_request_free(&r);
        CHECK(ok);
    }
}

/* log-softmax with long double, the reference for kvt_logprob_top */
static long double ref_lse(const float *lg, size_t n)
{
    long double mx = -INFINITY, sum = 0;
    for (size_t i = 0; i < n; i++)
        if (lg[i] > mx) mx = lg[i];
    for (size_t i = 0; i < n; i++)
        if (lg[i] == lg[i]) sum += expl((long double)lg[i] - mx);
    return mx + logl(sum);
}

static int cmp_desc(const void *a, const void *b, void *lg_)
{
    const float *lg = lg_;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (lg[x] != lg[y]) return lg[x] > lg[y] ? -1 : 1;
    return x < y ? -1 : x > y;
}

TEST(api_logprobs_top)
{
    /* ties (ids 1 and 3), -inf, NaN (counts as -inf) */
    const float lg[6] = {0.5f, 2.0f, -INFINITY, 2.0f, NAN, -1.25f};
    long double lse = ref_lse(lg, 6);
    int32_t id[8];
    double lp[8];
    double v = kvt_logprob_top(lg, 6, 3, 8, id, lp); /* n_top over the vocabulary: 6 written */
    static const int32_t want[6] = {1, 3, 0, 5, 2, 4};
    bool ok = fabsl(v - (2.0L - lse)) < 1e-15L;
    for (int k = 0; k < 6 && ok; k++) {
        ok = id[k] == want[k];
        if (ok && k < 4) ok = fabsl(lp[k] - ((long double)lg[want[k]] - lse)) < 1e-15L;
        else if (ok) ok = lp[k] == -INFINITY;
        if (!ok) printf("      rank %d: id %d lp %.17g\n", k, id[k], lp[k]);
    }
    CHECK(ok);
    CHECK(kvt_logprob_top(lg, 6, 2, 0, NULL, NULL) == -INFINITY);
    CHECK(isnan(kvt_logprob_top(lg, 6, 6, 0, NULL, NULL)) && isnan(kvt_logprob_top(lg, 6, -1, 0, NULL, NULL)));
    CHECK(isnan(kvt_logprob_top(NULL, 6, 0, 0, NULL, NULL)));

    /* a random vocabulary with repeated scores: the top 20 are the first 20
     * of a full sort (score descending, lower id first), each within 1e-13
     * of the long double value (the scores are below 16 in magnitude, so
     * double's relative 1.1e-16 per operation over the 1000-term sum stays
     * far below that), and the probabilities sum to 1 */
    uint64_t seed = kvt_test_seed("api_logprobs_top");
    enum { V = 1000 };
    float big[V];
    int32_t order[V];
    for (int i = 0; i < V; i++) {
        big[i] = (float)((int)(kvt_test_rand(&seed) % 4001) - 2000) / 128.0f; /* 1/128 steps: many ties */
        order[i] = i;
    }
    qsort_r(order, V, sizeof *order, cmp_desc, big);
    int32_t tid[KVT_API_MAX_TOP_LOGPROBS];
    double tlp[KVT_API_MAX_TOP_LOGPROBS];
    v = kvt_logprob_top(big, V, order[V - 1], KVT_API_MAX_TOP_LOGPROBS, tid, tlp);
    lse = ref_lse(big, V);
    ok = fabsl(v - ((long double)big[order[V - 1]] - lse)) < 1e-13L;
    for (int k = 0; k < KVT_API_MAX_TOP_LOGPROBS && ok; k++) {
        ok = tid[k] == order[k] && fabsl(tlp[k] - ((long double)big[order[k]] - lse)) < 1e-13L &&
             (k == 0 || tlp[k] <= tlp[k - 1]);
        if (!ok) printf("      rank %d: id %d (want %d) lp %.17g\n", k, tid[k], order[k], tlp[k]);
    }
    CHECK(ok);
    double total = 0;
    for (int i = 0; i < V; i++) total += exp(kvt_logprob_top(big, V, i, 0, NULL, NULL));
    CHECKF(fabs(total - 1) < 1e-12, "the probabilities sum to %.17g", total);
}

/* Three sampled tokens of the text "Hi\xc3\xa9!" ("Hié!"), the é cut between
 * the second and the third (neither is UTF-8 alone), two alternatives each;
 * the third is too unlikely to score, the last two alternatives share a
 * text. */
static const kvt_logprob LP_TOK[3] = {{"Hi", 2, -1.0 / 3}, {"\xc3", 1, -1.5}, {"\xa9!", 2, -INFINITY}};
static const kvt_logprob LP_TOP[6] = {{"Hi", 2, -1.0 / 3}, {"Ho", 2, -2.0},   {"\xc3", 1, -1.5},
                                      {"\xc2", 1, -2.5},   {"a", 1, -0.5},    {"a", 1, -0.75}};
static const kvt_logprobs LP_ALL = {LP_TOK, LP_TOP, 3, 2, 0};
#define LP_TEXT "Hi\xc3\xa9!"

/* A {token, logprob, bytes} entry. */
static bool lp_entry_ok(const json_t *e, const char *token, double logprob, const char *bytes, size_t n)
{
    bool ok = streq(sget(e, "token"), token) && json_is_real(at(e, "logprob")) &&
              json_real_value(at(e, "logprob")) == logprob && json_array_size(at(e, "bytes")) == n;
    for (size_t i = 0; ok && i < n; i++) {
        char k[32];
        snprintf(k, sizeof k, "bytes.%zu", i);
        ok = iget(e, k) == (unsigned char)bytes[i];
    }
    if (!ok) {
        char *s = json_dumps(e, JSON_COMPACT);
        printf("      entry %s (want token %s, logprob %.17g)\n", s ? s : "(null)", token, logprob);
        free(s);
    }
    return ok;
}

/* The chat / Responses list for tokens [from, from + n) of LP_ALL. */
static bool lp_list_ok(const json_t *list, size_t from, size_t n)
{
    static const char *const text[3] = {"Hi", "bytes:\\xc3", "bytes:\\xa9\\x21"};
    static const char *const top_text[6] = {"Hi", "Ho", "bytes:\\xc3", "bytes:\\xc2", "a", "a"};
    bool ok = json_array_size(list) == n;
    for (size_t i = 0; ok && i < n; i++) {
        const kvt_logprob *t = &LP_TOK[from + i];
        json_t *e = json_array_get(list, i);
        ok = lp_entry_ok(e, text[from + i], isfinite(t->logprob) ? t->logprob : -9999.0, t->bytes, t->len) &&
             json_array_size(at(e, "top_logprobs")) == 2;
        for (size_t k = 0; ok && k < 2; k++) {
            const kvt_logprob *a = &LP_TOP[(from + i) * 2 + k];
            ok = lp_entry_ok(json_array_get(at(e, "top_logprobs"), k), top_text[(from + i) * 2 + k], a->logprob,
                             a->bytes, a->len);
        }
    }
    return ok;
}

/* The legacy object for tokens [from, from + n), the prompt prompt_len bytes. */
static bool lp_legacy_ok(const json_t *o, size_t from, size_t n, size_t prompt_len)
{
    static const char *const text[3] = {"Hi", "bytes:\\xc3", "bytes:\\xa9\\x21"};
    static const size_t offset[3] = {0, 2, 3};
    bool ok = json_array_size(at(o, "tokens")) == n && json_array_size(at(o, "token_logprobs")) == n &&
              json_array_size(at(o, "top_logprobs")) == n && json_array_size(at(o, "text_offset")) == n;
    for (size_t i = 0; ok && i < n; i++) {
        size_t t = from + i;
        json_t *top = json_array_get(at(o, "top_logprobs"), i);
        ok = streq(json_string_value(json_array_get(at(o, "tokens"), i)), text[t]) &&
             json_real_value(json_array_get(at(o, "token_logprobs"), i)) ==
                 (isfinite(LP_TOK[t].logprob) ? LP_TOK[t].logprob : -9999.0) &&
             json_integer_value(json_array_get(at(o, "text_offset"), i)) == (json_int_t)(prompt_len + offset[t]);
        /* the more likely of two alternatives with one text is kept */
        if (ok && t == 0)
            ok = json_object_size(top) == 2 && json_real_value(json_object_get(top, "Hi")) == -1.0 / 3 &&
                 json_real_value(json_object_get(top, "Ho")) == -2.0;
        if (ok && t == 1)
            ok = json_object_size(top) == 2 && json_real_value(json_object_get(top, "bytes:\\xc3")) == -1.5 &&
                 json_real_value(json_object_get(top, "bytes:\\xc2")) == -2.5;
        if (ok && t == 2) ok = json_object_size(top) == 1 && json_real_value(json_object_get(top, "a")) == -0.5;
    }
    if (!ok) {
        char *s = json_dumps(o, JSON_COMPACT);
        printf("      legacy logprobs %s\n", s ? s : "(null)");
        free(s);
    }
    return ok;
}

TEST(api_logprobs_response)
{
    /* chat */
    kvt_request r;
    CHECK_OK(parse(&r, KVT_API_CHAT, "{\"messages\":" U ",\"logprobs\":true,\"top_logprobs\":2}", NULL, NULL));
    char *s = kvt_response_json_lp(&r, "c", "kvtier", LP_TEXT, strlen(LP_TEXT), NULL, 0, "stop", NULL, &U1, 0, &LP_ALL);
    json_t *j = load(s);
    free(s);
    bool ok = j && streq(sget(j, "choices.0.message.content"), "Hi\xc3\xa9!") &&
              json_object_size(at(j, "choices.0.logprobs")) == 2 && is_null(j, "choices.0.logprobs.refusal") &&
              lp_list_ok(at(j, "choices.0.logprobs.content"), 0, 3);
    json_decref(j);
    /* no tokens given: an empty list */
    s = kvt_response_json_lp(&r, "c", "kvtier", "", 0, NULL, 0, "stop", NULL, &U1, 0, NULL);
    j = load(s);
    free(s);
    ok = ok && j && json_is_array(at(j, "choices.0.logprobs.content")) &&
         json_array_size(at(j, "choices.0.logprobs.content")) == 0;
    json_decref(j);
    kvt_request_free(&r);
    CHECK(ok);
    /* not asked: null, whatever the caller passes */
    CHECK_OK(parse(&r, KVT_API_CHAT, "{\"messages\":" U "}", NULL, NULL));
    s = kvt_response_json_lp(&r, "c", "kvtier", "x", 1, NULL, 0, "stop", NULL, &U1, 0, &LP_ALL);
    j = load(s);
    free(s);
    ok = j && is_null(j, "choices.0.logprobs");
    json_decref(j);
    kvt_request_free(&r);
    CHECK(ok);

    /* legacy completions: text_offset counts from the start of the prompt */
    CHECK_OK(parse(&r, KVT_API_COMPLETIONS, "{\"prompt\":\"Hello\",\"logprobs\":2}", NULL, NULL));
    s = kvt_response_json_lp(&r, "c", "kvtier", LP_TEXT, strlen(LP_TEXT), NULL, 0, "length", NULL, &U1, 0, &LP_ALL);
    j = load(s);
    free(s);
    ok = j && json_object_size(at(j, "choices.0.logprobs")) == 4 && lp_legacy_ok(at(j, "choices.0.logprobs"), 0, 3, 5);
    json_decref(j);
    kvt_request_free(&r);
    CHECK(ok);

    /* Responses: on the output_text part; every digit kept, and the echoed
     * temperature still reads back as sent */
    CHECK_OK(parse(&r, KVT_API_RESPONSES,
                   "{\"input\":\"q\",\"include\":[\"message.output_text.logprobs\"],\"top_logprobs\":2,"
                   "\"temperature\":0.2,\"top_p\":0.95}", NULL, NULL));
    s = kvt_response_json_lp(&r, "resp_1", "kvtier", LP_TEXT, strlen(LP_TEXT), NULL, 0, "stop", NULL, &U1, 1234,
                             &LP_ALL);
    j = load(s);
    free(s);
    ok = response_ok(j, "resp_1", "completed", 1) && streq(sget(j, "output.0.content.0.text"), LP_TEXT) &&
         lp_list_ok(at(j, "output.0.content.0.logprobs"), 0, 3) && json_real_value(at(j, "temperature")) == 0.2 &&
         json_real_value(at(j, "top_p")) == 0.95;
    json_decref(j);
    kvt_request_free(&r);
    CHECK(ok);
    /* not asked: no logprobs on the part (as before) */
    CHECK_OK(parse(&r, KVT_API_RESPONSES, "{\"input\":\"q\"}", NULL, NULL));
    s = kvt_response_json_lp(&r, "resp_1", "kvtier", "x", 1, NULL, 0, "stop", NULL, &U1, 1234, &LP_ALL);
    j = load(s);
    free(s);
    ok = j && !at(j, "output.0.content.0.logprobs");
    json_decref(j);
    kvt_request_free(&r);
    CHECK(ok);
}

/* A stream of LP_TEXT in two deltas: "Hi" with the first token, the rest
 * with the other two. */
static char *lp_stream(kvt_request *r, const char *id)
{
    kvt_logprobs a = {LP_TOK, LP_TOP, 1, 2, 0}, b = {LP_TOK + 1, LP_TOP + 2, 2, 2, 2};
    kvt_usage begin = U1;
    begin.completion_tokens = 0;
    char *acc = NULL;
    cat(&acc, kvt_stream_begin(r, id, "kvtier", &begin, 1234));
    cat(&acc, kvt_stream_delta_lp(r, id, "kvtier", "Hi", 2, 1234, &a));
    cat(&acc, kvt_stream_delta_lp(r, id, "kvtier", "\xc3\xa9!", 3, 1234, &b));
    cat(&acc, kvt_stream_end_lp(r, id, "kvtier", LP_TEXT, strlen(LP_TEXT), NULL, 0, "length", NULL, &U1, 1234,
                                &LP_ALL));
    return acc;
}

TEST(api_logprobs_stream)
{
    /* chat: the content chunks carry their tokens; the role and finish
     * chunks null */
    kvt_request r;
    CHECK_OK(parse(&r, KVT_API_CHAT, "{\"messages\":" U ",\"stream\":true,\"logprobs\":true,\"top_logprobs\":2}",
                   NULL, NULL));
    char *s = lp_stream(&r, "chatcmpl-1");
    event ev[16];
    int n = split_sse(s, ev, 16);
    free(s);
    bool ok = n == 5 && is_null(ev[0].data, "choices.0.logprobs") &&
              lp_list_ok(at(ev[1].data, "choices.0.logprobs.content"), 0, 1) &&
              is_null(ev[1].data, "choices.0.logprobs.refusal") &&
              lp_list_ok(at(ev[2].data, "choices.0.logprobs.content"), 1, 2) &&
              is_null(ev[3].data, "choices.0.logprobs") && streq(sget(ev[3].data, "choices.0.finish_reason"), "length") &&
              ev[4].done;
    free_events(ev, n > 0 ? n : 0);
    kvt_request_free(&r);
    CHECK(ok);

    /* completions: each text chunk its own lists, offsets from the prompt's
     * start; the finish chunk (text "") empty lists */
    CHECK_OK(parse(&r, KVT_API_COMPLETIONS, "{\"prompt\":\"Hello\",\"stream\":true,\"logprobs\":2}", NULL, NULL));
    s = lp_stream(&r, "cmpl-1");
    n = split_sse(s, ev, 16);
    free(s);
    ok = n == 4 && lp_legacy_ok(at(ev[0].data, "choices.0.logprobs"), 0, 1, 5) &&
         lp_legacy_ok(at(ev[1].data, "choices.0.logprobs"), 1, 2, 5) &&
         lp_legacy_ok(at(ev[2].data, "choices.0.logprobs"), 0, 0, 5) && streq(sget(ev[2].data, "choices.0.text"), "") &&
         ev[3].done;
    free_events(ev, n > 0 ? n : 0);
    kvt_request_free(&r);
    CHECK(ok);

    /* Responses: the deltas their tokens, the done events and
     * response.completed all of them, as the non-streaming body has them */
    CHECK_OK(parse(&r, KVT_API_RESPONSES,
                   "{\"input\":\"q\",\"stream\":true,\"include\":[\"message.output_text.logprobs\"],\"top_logprobs\":2}",
                   NULL, NULL));
    s = lp_stream(&r, "resp_7");
    n = split_sse(s, ev, 16);
    free(s);
    static const char *const names[] = {"response.created", "response.in_progress", "response.output_item.added",
                                        "response.content_part.added", "response.output_text.delta",
                                        "response.output_text.delta", "response.output_text.done",
                                        "response.content_part.done", "response.output_item.done",
                                        "response.completed"};
    ok = n == 10 && responses_events_ok(ev, n, names) && json_array_size(at(ev[3].data, "part.logprobs")) == 0 &&
         lp_list_ok(at(ev[4].data, "logprobs"), 0, 1) && lp_list_ok(at(ev[5].data, "logprobs"), 1, 2) &&
         lp_list_ok(at(ev[6].data, "logprobs"), 0, 3) && lp_list_ok(at(ev[7].data, "part.logprobs"), 0, 3) &&
         lp_list_ok(at(ev[8].data, "item.content.0.logprobs"), 0, 3) &&
         lp_list_ok(at(ev[9].data, "response.output.0.content.0.logprobs"), 0, 3);
    char *body = kvt_response_json_lp(&r, "resp_7", "kvtier", LP_TEXT, strlen(LP_TEXT), NULL, 0, "length", NULL, &U1,
                                      1234, &LP_ALL);
    json_t *j = load(body);
    free(body);
    ok = ok && json_equal(at(ev[9].data, "response"), j);
    json_decref(j);
    free_events(ev, n > 0 ? n : 0);
    kvt_request_free(&r);
    CHECK(ok);
}

/* ---- thinking mode ------------------------------------------------------------------ */

/* A thinking-mode reply: reasoning that quotes the call-block opener (which
 * is no call), the </think>, then gen_text: "Checking." and two calls. */
#define THINK_R "Two cities, so two calls; the " CSB " block takes both."
static const char think_text[] = THINK_R NT "Checking.\n\n" CSB "\n" INVOKE("get_weather", PSTR("city", "Paris"))
                                 INVOKE("get_weather", PJSON("units", "\"C\"") PSTR("city", "Rome")) CSE;
#define THINK_LEN (sizeof think_text - 1)
#define THINK_ANS (sizeof THINK_R - 1 + sizeof NT - 1) /* where the answer begins */

TEST(api_thinking_split)
{
    size_t rs, as;
    /* the first </think> splits, and nothing around it is trimmed */
    const char *t = " R \n" NT "\n A " NT " B";
    CHECK(kvt_think_split(t, strlen(t), false, &rs, &as) && rs == 4 && as == 4 + strlen(NT));
    CHECK(kvt_think_split(t, strlen(t), true, &rs, &as) && rs == 4 && as == 4 + strlen(NT));
    CHECK(kvt_think_split(NT "A", 9, false, &rs, &as) && rs == 0 && as == 8);
    /* no </think> (still thinking, or cut by max_tokens): all reasoning, the
     * answer empty */
    CHECK(!kvt_think_split("still thinking", 14, false, &rs, &as) && rs == 14 && as == 14);
    CHECK(!kvt_think_split("still thinking", 14, true, &rs, &as) && rs == 14 && as == 14);
    CHECK(!kvt_think_split(NULL, 0, true, &rs, &as) && rs == 0 && as == 0);
    CHECK(!kvt_think_split(NULL, 5, false, &rs, &as) && rs == 0 && as == 0);
    CHECK(!kvt_think_split("", 0, false, NULL, NULL));
    /* streaming holds back every partial </think>, the answer not begun;
     * the finished text has none of that: it is all reasoning */
    char buf[32];
    for (size_t k = 1; k <= strlen(NT); k++) {
        size_t n = (size_t)snprintf(buf, sizeof buf, "abc%.*s", (int)k, NT);
        bool whole = k == strlen(NT);
        CHECKF(kvt_think_split(buf, n, true, &rs, &as) == whole && rs == 3 && as == n, "partial, %zu bytes", k);
        CHECKF(kvt_think_split(buf, n, false, &rs, &as) == whole && rs == (whole ? 3 : n) && as == n,
               "finished, %zu bytes", k);
    }
    /* what only looks like a start is reasoning */
    CHECK(!kvt_think_split("a</b", 4, true, &rs, &as) && rs == 4 && as == 4);
    CHECK(!kvt_think_split("</thinking", 10, true, &rs, &as) && rs == 10);
    CHECK(!kvt_think_split("a<", 2, true, &rs, &as) && rs == 1 && as == 2);

    /* </think> followed by calls: they are read from the answer only, and
     * their raw bytes count from the start of the reply (what the server
     * keeps for the replay hook) */
    CHECK(kvt_think_split(think_text, THINK_LEN, false, &rs, &as) && rs == sizeof THINK_R - 1 && as == THINK_ANS);
    kvt_request r = {.api = KVT_API_CHAT, .thinking = true, .n_tools = 1};
    kvt_tool_call *c, *c0;
    size_t n, n0, te, te0;
    CHECK_OK(kvt_reply_tool_calls(&r, think_text, THINK_LEN, &c, &n, &te));
    CHECK_OK(kvt_tool_calls_parse(gen_text, GEN_LEN, &c0, &n0, &te0));
    bool ok = n == 2 && n0 == 2 && te == THINK_ANS + GEN_TEXT_END && te0 == GEN_TEXT_END;
    for (size_t i = 0; ok && i < n; i++)
        ok = c[i].raw_off == THINK_ANS + c0[i].raw_off && c[i].raw_len == c0[i].raw_len &&
             streq(c[i].name, c0[i].name) && streq(c[i].arguments, c0[i].arguments) &&
             !memcmp(think_text + c[i].raw_off, gen_text + c0[i].raw_off, c0[i].raw_len);
    kvt_tool_calls_free(c, n);
    kvt_tool_calls_free(c0, n0);
    CHECK(ok);
    /* negative control: read from the whole reply, the opener the reasoning
     * quotes hides the calls */
    CHECK_OK(kvt_tool_calls_parse(think_text, THINK_LEN, &c, &n, &te));
    kvt_tool_calls_free(c, n);
    CHECK(n == 0 && te == THINK_LEN);
    /* no </think>: markup in the reasoning is no call */
    CHECK_OK(kvt_reply_tool_calls(&r, gen_text, GEN_LEN, &c, &n, &te));
    CHECK(n == 0 && !c && te == GEN_LEN);
    /* outside thinking mode the whole text is read; without tools nothing */
    r.thinking = false;
    CHECK_OK(kvt_reply_tool_calls(&r, gen_text, GEN_LEN, &c, &n, &te));
    ok = n == 2 && te == GEN_TEXT_END && c[0].raw_off == GEN_TEXT_END;
    kvt_tool_calls_free(c, n);
    CHECK(ok);
    r.n_tools = 0;
    CHECK_OK(kvt_reply_tool_calls(&r, think_text, THINK_LEN, &c, &n, &te));
    CHECK(n == 0 && !c && te == THINK_LEN);
    CHECK(kvt_reply_tool_calls(NULL, gen_text, GEN_LEN, &c, &n, &te) == KVT_EINVAL);
    CHECK(kvt_reply_tool_calls(&r, NULL, 3, &c, &n, &te) == KVT_EINVAL);
}

/* Which requests are in thinking mode, and how the reasoning sent back
 * renders (Anthropic thinking blocks included). */
TEST(api_thinking_parse)
{
    kvt_model *m = tiny();
    CHECK(m);
#define TMSG(thinking, msgs) "{\"max_tokens\":5," thinking "\"messages\":" msgs "}"
#define UAU "[{\"role\":\"user\",\"content\":\"Q\"},{\"role\":\"assistant\",\"content\":[" \
    "{\"type\":\"thinking\",\"thinking\":\"R1\",\"signature\":\"EqQBCkYI\"},{\"type\":\"redacted_thinking\",\"data\":\"xx\"}," \
    "{\"type\":\"text\",\"text\":\"A1\"}]},{\"role\":\"user\",\"content\":\"Q2\"}]"
    static const struct {
        kvt_api api;
        const char *body;
        bool thinking;
        const char *prompt;
    } cases[] = {
        /* Anthropic: enabled and adaptive turn it on, disabled and absent
         * leave it off */
        {KVT_API_MESSAGES, TMSG("\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":1024},", U), true,
         BOS USR "x" AST "<think>"},
        {KVT_API_MESSAGES, TMSG("\"thinking\":{\"type\":\"adaptive\"},", U), true, BOS USR "x" AST "<think>"},
        {KVT_API_MESSAGES, TMSG("\"thinking\":{\"type\":\"disabled\"},", U), false, BOS USR "x" ASN},
        {KVT_API_MESSAGES, TMSG("\"thinking\":null,", U), false, BOS USR "x" ASN},
        {KVT_API_MESSAGES, TMSG("", U), false, BOS USR "x" ASN},
        /* a thinking block is the turn's reasoning (its signature unread),
         * redacted_thinking is skipped; several join like text parts */
        {KVT_API_MESSAGES, TMSG("\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":1024},", UAU), true,
         BOS USR "Q" AST "<think>R1" NT "A1" EOS USR "Q2" AST "<think>"},
        {KVT_API_MESSAGES,
         TMSG("\"thinking\":{\"type\":\"adaptive\"},",
              "[{\"role\":\"user\",\"content\":\"Q\"},{\"role\":\"assistant\",\"content\":[{\"type\":\"thinking\","
              "\"thinking\":\"a\"},{\"type\":\"thinking\",\"thinking\":\"b\"},{\"type\":\"text\",\"text\":\"T\"}]},"
              "{\"role\":\"user\",\"content\":\"Q2\"}]"),
         true, BOS USR "Q" AST "<think>a\n\nb" NT "T" EOS USR "Q2" AST "<think>"},
        /* outside thinking mode the reasoning is not rendered */
        {KVT_API_MESSAGES, TMSG("", UAU), false, BOS USR "Q" ASN "A1" EOS USR "Q2" ASN},
        /* chat: chat_template_kwargs; an effort alone does not turn it on */
        {KVT_API_CHAT, "{\"chat_template_kwargs\":{\"thinking\":true},\"messages\":" U "}", true,
         BOS USR "x" AST "<think>"},
        {KVT_API_CHAT, "{\"chat_template_kwargs\":{\"enable_thinking\":false},\"messages\":" U "}", false,
         BOS USR "x" ASN},
        {KVT_API_CHAT, "{\"reasoning_effort\":\"high\",\"messages\":" U "}", false, BOS USR "x" ASN},
        /* Responses: never (its "reasoning" asks for OpenAI's reasoning items) */
        {KVT_API_RESPONSES, "{\"input\":\"x\",\"reasoning\":{\"effort\":\"high\",\"summary\":\"auto\"}}", false,
         BOS USR "x" ASN},
        /* a prefill continues the answer: no reasoning comes */
        {KVT_API_CHAT,
         "{\"chat_template_kwargs\":{\"thinking\":true},\"messages\":[{\"role\":\"user\",\"content\":\"x\"},"
         "{\"role\":\"assistant\",\"content\":\"A\",\"reasoning_content\":\"R\"}]}",
         false, BOS USR "x" AST "<think>R" NT "A"},
        {KVT_API_MESSAGES,
         TMSG("\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":1024},",
              "[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\",\"content\":[{\"type\":\"thinking\","
              "\"thinking\":\"R\"},{\"type\":\"text\",\"text\":\"A\"}]}]"),
         false, BOS USR "x" AST "<think>R" NT "A"},
    };
#undef TMSG
#undef UAU
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        kvt_request r;
        int rc = parse(&r, cases[i].api, cases[i].body, m, NULL);
        bool ok = !rc && r.thinking == cases[i].thinking && prompt_is(&r, cases[i].prompt);
        if (!ok) printf("      case %zu: %s\n", i, rc ? kvt_errmsg() : "");
        kvt_request_free(&r);
        if (!ok) kvt_model_close(m);
        CHECK(ok);
    }
    /* the plain template has no thinking mode */
    kvt_request r;
    CHECK_OK(parse(&r, KVT_API_MESSAGES, "{\"max_tokens\":5,\"thinking\":{\"type\":\"enabled\"},\"messages\":" U "}",
                   NULL, NULL));
    bool ok = !r.thinking && prompt_is(&r, "x");
    kvt_request_free(&r);
    kvt_model_close(m);
    CHECK(ok);
}

TEST(api_thinking_response)
{
    kvt_usage u = U1;
    u.reasoning_tokens = 12;
    const char *t = "Let me think." NT "Hello.";
    /* chat: the reasoning in reasoning_content, the answer in content, the
     * reasoning's tokens in completion_tokens_details */
    kvt_request r = {.api = KVT_API_CHAT, .thinking = true};
    char *s = kvt_response_json(&r, "c", "m", t, strlen(t), "stop", NULL, &u, 0);
    json_t *j = load(s);
    free(s);
    bool ok = j && streq(sget(j, "choices.0.message.reasoning_content"), "Let me think.") &&
              streq(sget(j, "choices.0.message.content"), "Hello.") && streq(sget(j, "choices.0.message.role"), "assistant") &&
              streq(sget(j, "choices.0.finish_reason"), "stop") && openai_usage_ok(at(j, "usage"), 100, 20, 60) &&
              iget(j, "usage.completion_tokens_details.reasoning_tokens") == 12;
    json_decref(j);
    CHECK(ok);
    /* cut inside the reasoning: all of it is reasoning, the answer empty */
    s = kvt_response_json(&r, "c", "m", "Let me th", 9, "length", NULL, NULL, 0);
    j = load(s);
    free(s);
    ok = j && streq(sget(j, "choices.0.message.reasoning_content"), "Let me th") &&
         streq(sget(j, "choices.0.message.content"), "") && streq(sget(j, "choices.0.finish_reason"), "length");
    json_decref(j);
    CHECK(ok);
    /* with calls: the answer before them; content null when it is empty */
    kvt_tool_call *c;
    size_t n, te;
    r.n_tools = 1;
    CHECK_OK(kvt_reply_tool_calls(&r, think_text, THINK_LEN, &c, &n, &te));
    CHECK(n == 2);
    s = kvt_response_json_calls(&r, "c", "m", think_text, te, c, n, "stop", NULL, NULL, 0);
    j = load(s);
    free(s);
    ok = j && streq(sget(j, "choices.0.message.reasoning_content"), THINK_R) &&
         streq(sget(j, "choices.0.message.content"), "Checking.") &&
         json_array_size(at(j, "choices.0.message.tool_calls")) == 2 &&
         streq(sget(j, "choices.0.message.tool_calls.1.id"), c[1].id) &&
         streq(sget(j, "choices.0.finish_reason"), "tool_calls");
    json_decref(j);
    CHECK(ok);
    s = kvt_response_json_calls(&r, "c", "m", "R" NT, 1 + strlen(NT), c, n, "stop", NULL, NULL, 0);
    j = load(s);
    free(s);
    ok = j && streq(sget(j, "choices.0.message.reasoning_content"), "R") && is_null(j, "choices.0.message.content");
    json_decref(j);
    CHECK(ok);
    /* outside thinking mode nothing changes: </think> is text */
    kvt_request rn = {.api = KVT_API_CHAT};
    s = kvt_response_json(&rn, "c", "m", t, strlen(t), "stop", NULL, NULL, 0);
    j = load(s);
    free(s);
    ok = j && streq(sget(j, "choices.0.message.content"), t) && !at(j, "choices.0.message.reasoning_content") &&
         iget(j, "usage.completion_tokens_details.reasoning_tokens") == 0;
    json_decref(j);
    CHECK(ok);

    /* Anthropic: a thinking block (empty signature) before the text block,
     * the tool_use blocks after it */
    kvt_request ra = {.api = KVT_API_MESSAGES, .thinking = true, .n_tools = 1};
    s = kvt_response_json(&ra, "msg_1", "m", t, strlen(t), "stop", NULL, &u, 0);
    j = load(s);
    free(s);
    ok = j && json_array_size(at(j, "content")) == 2 && streq(sget(j, "content.0.type"), "thinking") &&
         streq(sget(j, "content.0.thinking"), "Let me think.") && streq(sget(j, "content.0.signature"), "") &&
         json_object_size(at(j, "content.0")) == 3 && streq(sget(j, "content.1.type"), "text") &&
         streq(sget(j, "content.1.text"), "Hello.") && streq(sget(j, "stop_reason"), "end_turn") &&
         anthropic_usage_ok(at(j, "usage"), 10, 20, 60, 30);
    json_decref(j);
    CHECK(ok);
    s = kvt_response_json_calls(&ra, "msg_1", "m", think_text, te, c, n, "stop", NULL, NULL, 0);
    j = load(s);
    free(s);
    ok = j && json_array_size(at(j, "content")) == 4 && streq(sget(j, "content.0.thinking"), THINK_R) &&
         streq(sget(j, "content.1.text"), "Checking.") && streq(sget(j, "content.2.type"), "tool_use") &&
         streq(sget(j, "content.3.id"), c[1].id) && streq(sget(j, "content.3.input.city"), "Rome") &&
         streq(sget(j, "stop_reason"), "tool_use");
    json_decref(j);
    CHECK(ok);
    /* only calls after the reasoning: no text block; cut in the reasoning:
     * an empty one, as without thinking */
    s = kvt_response_json_calls(&ra, "msg_1", "m", "R" NT, 1 + strlen(NT), c, n, "stop", NULL, NULL, 0);
    j = load(s);
    free(s);
    ok = j && json_array_size(at(j, "content")) == 3 && streq(sget(j, "content.0.thinking"), "R") &&
         streq(sget(j, "content.1.type"), "tool_use");
    json_decref(j);
    CHECK(ok);
    s = kvt_response_json(&ra, "msg_1", "m", "Hm", 2, "length", NULL, NULL, 0);
    j = load(s);
    free(s);
    ok = j && json_array_size(at(j, "content")) == 2 && streq(sget(j, "content.0.thinking"), "Hm") &&
         streq(sget(j, "content.1.text"), "") && streq(sget(j, "stop_reason"), "max_tokens");
    json_decref(j);
    kvt_tool_calls_free(c, n);
    CHECK(ok);
}

/* Append s to the string obj[key]. */
static void str_append(json_t *obj, const char *key, const char *s)
{
    const char *a = json_string_value(json_object_get(obj, key));
    size_t la = a ? strlen(a) : 0, lb = s ? strlen(s) : 0;
    char *p = malloc(la + lb + 1);
    if (!p) return;
    memcpy(p, a ? a : "", la);
    memcpy(p + la, s ? s : "", lb + 1);
    json_object_set_new(obj, key, json_string(p));
    free(p);
}

/* The content blocks a client builds from an Anthropic stream, as the SDK's
 * message stream does: each block as it starts (at the next index), the
 * thinking and text deltas appended, partial_json parsed into input at the
 * block's stop (which must close the block that is open). NULL when the
 * events do not fit together. */
static json_t *anthropic_content(const event *ev, int n)
{
    json_t *content = json_array(), *input = NULL;
    long long open = -1;
    for (int i = 0; content && i < n; i++) {
        json_t *d = ev[i].data, *b = json_array_get(content, (size_t)iget(d, "index"));
        bool ok = true;
        if (streq(ev[i].name, "content_block_start")) {
            ok = open < 0 && iget(d, "index") == (long long)json_array_size(content) &&
                 !json_array_append_new(content, json_deep_copy(at(d, "content_block")));
            open = iget(d, "index");
        } else if (streq(ev[i].name, "content_block_delta")) {
            const char *ty = sget(d, "delta.type");
            ok = b && iget(d, "index") == open;
            if (ok && streq(ty, "thinking_delta")) str_append(b, "thinking", sget(d, "delta.thinking"));
            else if (ok && streq(ty, "text_delta")) str_append(b, "text", sget(d, "delta.text"));
            else if (ok && streq(ty, "input_json_delta")) ok = !input && (input = load(sget(d, "delta.partial_json")));
            else ok = false;
        } else if (streq(ev[i].name, "content_block_stop")) {
            ok = b && iget(d, "index") == open;
            if (ok && input) json_object_set_new(b, "input", input);
            input = NULL;
            open = -1;
        }
        if (!ok) {
            json_decref(content);
            content = NULL;
        }
    }
    json_decref(input);
    return content;
}

TEST(api_thinking_stream_chat)
{
    kvt_request r = {.api = KVT_API_CHAT, .stream = true, .thinking = true, .include_usage = true};
    kvt_usage u = U1;
    u.reasoning_tokens = 4;
    char *acc = NULL;
    cat(&acc, kvt_stream_begin(&r, "c", "kvtier", &U1, 5));
    cat(&acc, kvt_stream_reasoning(&r, "c", "kvtier", "Let me ", 7, 5));
    cat(&acc, kvt_stream_reasoning(&r, "c", "kvtier", "think.", 6, 5));
    cat(&acc, kvt_stream_reasoning(&r, "c", "kvtier", "", 0, 5)); /* nothing */
    cat(&acc, kvt_stream_delta(&r, "c", "kvtier", "Hel", 3, 5));
    cat(&acc, kvt_stream_reasoning(&r, "c", "kvtier", "late", 4, 5)); /* after the answer began: nothing */
    cat(&acc, kvt_stream_delta(&r, "c", "kvtier", "lo.", 3, 5));
    cat(&acc, kvt_stream_end(&r, "c", "kvtier", "stop", NULL, &u, 5));
    event ev[16];
    int n = split_sse(acc, ev, 16);
    if (n < 0) printf("      malformed SSE: %s\n", acc ? acc : "(null)");
    free(acc);
    /* role, 2 reasoning chunks, 2 content chunks, finish, usage, [DONE] */
    bool ok = n == 8 && streq(sget(ev[0].data, "choices.0.delta.role"), "assistant") &&
              streq(sget(ev[0].data, "choices.0.delta.content"), "");
    char reasoning[32] = "", content[32] = "";
    for (int i = 1; ok && i < 5; i++) {
        json_t *d = ev[i].data, *delta = at(d, "choices.0.delta");
        const char *rc = sget(d, "choices.0.delta.reasoning_content"), *cc = sget(d, "choices.0.delta.content");
        ok = json_object_size(delta) == 1 && (i < 3 ? rc != NULL : cc != NULL) && is_null(d, "choices.0.finish_reason") &&
             is_null(d, "choices.0.logprobs") && is_null(d, "usage") && streq(sget(d, "object"), "chat.completion.chunk");
        if (ok) strcat(i < 3 ? reasoning : content, i < 3 ? rc : cc);
    }
    ok = ok && streq(reasoning, "Let me think.") && streq(content, "Hello.") &&
         streq(sget(ev[5].data, "choices.0.finish_reason"), "stop") &&
         iget(ev[6].data, "usage.completion_tokens_details.reasoning_tokens") == 4 && ev[7].done;
    free_events(ev, n > 0 ? n : 0);
    CHECK(ok);
    /* what the client joined is what the complete body says */
    const char *t = "Let me think." NT "Hello.";
    char *s = kvt_response_json(&r, "c", "kvtier", t, strlen(t), "stop", NULL, &u, 5);
    json_t *j = load(s);
    free(s);
    ok = j && streq(sget(j, "choices.0.message.reasoning_content"), reasoning) &&
         streq(sget(j, "choices.0.message.content"), content);
    json_decref(j);
    CHECK(ok);
}

TEST(api_thinking_stream_messages)
{
    kvt_tool_call *c;
    size_t n;
    CHECK_OK(gen_calls(&c, &n));
    kvt_request r = {.api = KVT_API_MESSAGES, .stream = true, .thinking = true, .n_tools = 1};
    kvt_usage begin = U1;
    begin.completion_tokens = 0;
    char *acc = NULL;
    cat(&acc, kvt_stream_begin(&r, "msg_1", "kvtier", &begin, 0));
    cat(&acc, kvt_stream_reasoning(&r, "msg_1", "kvtier", "Let me ", 7, 0));
    cat(&acc, kvt_stream_reasoning(&r, "msg_1", "kvtier", "think.", 6, 0));
    cat(&acc, kvt_stream_delta(&r, "msg_1", "kvtier", "Check", 5, 0));
    cat(&acc, kvt_stream_reasoning(&r, "msg_1", "kvtier", "late", 4, 0)); /* nothing */
    cat(&acc, kvt_stream_delta(&r, "msg_1", "kvtier", "ing.", 4, 0));
    cat(&acc, kvt_stream_end_calls(&r, "msg_1", "kvtier", NULL, 0, c, n, "stop", NULL, &U1, 0));
    event ev[32];
    int ne = split_sse(acc, ev, 32);
    if (ne < 0) printf("      malformed SSE: %s\n", acc ? acc : "(null)");
    free(acc);
    static const char *const names[] = {
        "message_start", "content_block_start", "ping", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"};
    bool ok = ne == 18;
    for (int i = 0; i < ne && ok; i++) {
        ok = streq(ev[i].name, names[i]) && streq(sget(ev[i].data, "type"), names[i]);
        if (!ok) printf("      event %d: '%s'\n", i, ev[i].name);
    }
    /* the thinking block at 0 (thinking_delta), the text block at 1, the
     * tool_use blocks at 2 and 3 */
    ok = ok && iget(ev[1].data, "index") == 0 && streq(sget(ev[1].data, "content_block.type"), "thinking") &&
         streq(sget(ev[1].data, "content_block.thinking"), "") && streq(sget(ev[1].data, "content_block.signature"), "") &&
         iget(ev[3].data, "index") == 0 && streq(sget(ev[3].data, "delta.type"), "thinking_delta") &&
         streq(sget(ev[3].data, "delta.thinking"), "Let me ") && iget(ev[5].data, "index") == 0 &&
         iget(ev[6].data, "index") == 1 && streq(sget(ev[6].data, "content_block.type"), "text") &&
         iget(ev[7].data, "index") == 1 && streq(sget(ev[7].data, "delta.type"), "text_delta") &&
         iget(ev[9].data, "index") == 1 && iget(ev[10].data, "index") == 2 &&
         streq(sget(ev[10].data, "content_block.id"), c[0].id) && iget(ev[13].data, "index") == 3 &&
         iget(ev[15].data, "index") == 3 && streq(sget(ev[16].data, "delta.stop_reason"), "tool_use");
    /* the blocks the client builds are those of the complete body */
    json_t *built = ok ? anthropic_content(ev, ne) : NULL;
    const char *t = "Let me think." NT "Checking.";
    char *s = kvt_response_json_calls(&r, "msg_1", "kvtier", t, strlen(t), c, n, "stop", NULL, &U1, 0);
    json_t *j = load(s);
    free(s);
    ok = ok && built && j && json_equal(built, at(j, "content"));
    if (!ok && built) {
        char *b = json_dumps(built, JSON_COMPACT);
        printf("      built %s\n", b ? b : "(null)");
        free(b);
    }
    json_decref(built);
    json_decref(j);
    free_events(ev, ne > 0 ? ne : 0);
    kvt_tool_calls_free(c, n);
    CHECK(ok);

    /* cut inside the reasoning: the thinking block closes, and the reply
     * still has its (empty) text block */
    acc = NULL;
    cat(&acc, kvt_stream_begin(&r, "msg_2", "kvtier", &begin, 0));
    cat(&acc, kvt_stream_reasoning(&r, "msg_2", "kvtier", "Hm", 2, 0));
    cat(&acc, kvt_stream_end(&r, "msg_2", "kvtier", "length", NULL, &U1, 0));
    ne = split_sse(acc, ev, 32);
    free(acc);
    static const char *const names2[] = {"message_start", "content_block_start", "ping", "content_block_delta",
                                         "content_block_stop", "content_block_start", "content_block_stop",
                                         "message_delta", "message_stop"};
    ok = ne == 9;
    for (int i = 0; i < ne && ok; i++) ok = streq(ev[i].name, names2[i]);
    built = ok ? anthropic_content(ev, ne) : NULL;
    s = kvt_response_json(&r, "msg_2", "kvtier", "Hm", 2, "length", NULL, &U1, 0);
    j = load(s);
    free(s);
    ok = ok && built && j && json_equal(built, at(j, "content")) && iget(ev[6].data, "index") == 1 &&
         streq(sget(ev[7].data, "delta.stop_reason"), "max_tokens");
    json_decref(built);
    json_decref(j);
    free_events(ev, ne > 0 ? ne : 0);
    CHECK(ok);
}

/* body ({...}) with one more field at the front (malloc'ed). */
static char *with_field(const char *body, const char *fld)
{
    size_t n = strlen(body) + strlen(fld) + 2;
    char *b = body ? malloc(n) : NULL;
    if (b) snprintf(b, n, "{%s,%s", fld, body + 1);
    return b;
}

/* The request after response j (no calls) to body: the reply as the client
 * got it, then a user turn. */
static char *next_user(kvt_api api, const char *body, const json_t *j)
{
    json_t *b = json_loads(body, 0, NULL);
    if (!b) return NULL;
    json_t *arr = json_object_get(b, "messages");
    if (api == KVT_API_CHAT) json_array_append(arr, at(j, "choices.0.message"));
    else json_array_append_new(arr, json_pack("{s:s, s:O}", "role", "assistant", "content", at(j, "content")));
    json_array_append_new(arr, json_pack("{s:s, s:s}", "role", "user", "content", "Thanks"));
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

/* Append-only growth in thinking mode, for both apis that have it: the
 * weather conversation with thinking on. The request's rendering, then the
 * sampled REASONING</think>ANSWER, the calls and the end-of-sentence token,
 * is where the next request begins when the client sends the reasoning back
 * (reasoning_content; a thinking block) with the answer and the calls; the
 * same after the results, for an answer without calls. A client that drops
 * the reasoning is the negative control: its turn renders differently. */
TEST(api_thinking_roundtrip)
{
    kvt_model *m = tiny();
    CHECK(m);
    static const char *const fields[] = {"\"chat_template_kwargs\":{\"thinking\":true}",
                                         "\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":2048}"};
    static const char *const ids[] = {"chatcmpl-8", "msg_8"};
    static const char gen2[] = "Both known now." NT "Paris 18C, Rome 21C.";
    for (size_t a = 0; a < 2; a++) {
        const convo_api *cv = &weather[a];
        char *b0 = body_k(cv, cv->states[0]), *body1 = with_field(b0, fields[a]);
        free(b0);
        kvt_request r1 = {0}, r2 = {0}, r3 = {0}, rn = {0};
        kvt_tool_call *c = NULL, *c2 = NULL;
        size_t n = 0, n2 = 0, te = 0, te2 = 0;
        char *resp = NULL, *body2 = NULL, *resp2 = NULL, *body3 = NULL, *bneg = NULL;
        json_t *j = NULL, *j2 = NULL;
        bool ok = body1 && !parse(&r1, cv->api, body1, m, NULL) && r1.thinking &&
                  !kvt_reply_tool_calls(&r1, think_text, THINK_LEN, &c, &n, &te) && n == 2;
        if (ok) {
            resp = kvt_response_json_calls(&r1, ids[a], "kvtier", think_text, te, c, n, "stop", NULL, &U1, 1);
            ok = (j = load(resp)) && (body2 = next_body(cv->api, body1, j, c));
        }
        replay_map rm = {c, n, think_text, 0};
        kvt_parse_opts o = {.replay = replay_cb, .replay_user = &rm};
        ok = ok && !parse_o(&r2, cv->api, body2, m, &o) && r2.thinking;
        if (!ok) printf("      api %d: %s\n", (int)cv->api, kvt_errmsg());
        /* prompt 1, the sampled bytes, the end-of-sentence token, the results */
        static const char after1[] = EOS USR TRB "18C" TRE "\n\n" TRB "21C" TRE AST "<think>";
        size_t l1 = r1.prompt_len;
        if (ok) {
            ok = rm.hits == 2 && is_prefix(&r1, &r2) && r2.prompt_len == l1 + THINK_LEN + strlen(after1) &&
                 !memcmp(r2.prompt + l1, think_text, THINK_LEN) && !strcmp(r2.prompt + l1 + THINK_LEN, after1);
            if (!ok) printf("      api %d, after the calls: '%s'\n", (int)cv->api, kvt_test_esc(r2.prompt, r2.prompt_len));
        }
        /* the answer after the results, sent back with a user turn */
        if (ok) {
            ok = !kvt_reply_tool_calls(&r2, gen2, sizeof gen2 - 1, &c2, &n2, &te2) && n2 == 0 &&
                 (resp2 = kvt_response_json(&r2, ids[a], "kvtier", gen2, te2, "stop", NULL, &U1, 2)) &&
                 (j2 = load(resp2)) && (body3 = next_user(cv->api, body2, j2)) &&
                 !parse_o(&r3, cv->api, body3, m, &o);
            static const char after2[] = EOS USR "Thanks" AST "<think>";
            size_t l2 = r2.prompt_len, g2 = sizeof gen2 - 1;
            ok = ok && is_prefix(&r2, &r3) && r3.prompt_len == l2 + g2 + strlen(after2) &&
                 !memcmp(r3.prompt + l2, gen2, g2) && !strcmp(r3.prompt + l2 + g2, after2);
            if (!ok) printf("      api %d, after the answer: '%s'\n", (int)cv->api, kvt_test_esc(r3.prompt, r3.prompt_len));
        }
        /* negative control: the reply sent back without its reasoning */
        if (ok) {
            json_t *jn = json_deep_copy(j);
            if (cv->api == KVT_API_CHAT) json_object_del(at(jn, "choices.0.message"), "reasoning_content");
            else json_array_remove(at(jn, "content"), 0);
            bneg = next_body(cv->api, body1, jn, c);
            json_decref(jn);
            rm.hits = 0;
            static const char bare[] = NT "Checking."; /* <think></think>, then the answer */
            ok = bneg && !parse_o(&rn, cv->api, bneg, m, &o) && is_prefix(&r1, &rn) && rn.prompt_len > l1 &&
                 memcmp(rn.prompt + l1, think_text, THINK_LEN) != 0 && !strncmp(rn.prompt + l1, bare, strlen(bare));
            if (!ok) printf("      api %d, without reasoning: '%s'\n", (int)cv->api, kvt_test_esc(rn.prompt, rn.prompt_len));
        }
        json_decref(j);
        json_decref(j2);
        free(resp);
        free(resp2);
        free(body1);
        free(body2);
        free(body3);
        free(bneg);
        kvt_tool_calls_free(c, n);
        kvt_tool_calls_free(c2, n2);
        kvt_request_free(&r1);
        kvt_request_free(&r2);
        kvt_request_free(&r3);
        kvt_request_free(&rn);
        if (!ok) kvt_model_close(m);
        CHECK(ok);
    }
    kvt_model_close(m);
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
        {KVT_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":null,"
                       "\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":"
                       "\"{\\\"a\\\":1}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"c\",\"content\":\"r\"}],\"tools\":"
                       "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\"}}}]}"},
        {KVT_API_MESSAGES, "{\"max_tokens\":9,\"system\":\"x-anthropic-billing-header: a;\\nS\",\"messages\":[{\"role\":"
                           "\"assistant\",\"content\":[{\"type\":\"tool_use\",\"id\":\"t\",\"name\":\"f\",\"input\":"
                           "{\"b\":[1.5,null]}}]},{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"tool_use_id\":"
                           "\"t\",\"content\":\"r\"},{\"type\":\"text\",\"text\":\"q\"}]}],\"tools\":[{\"name\":\"f\","
                           "\"input_schema\":{\"$schema\":\"s\",\"type\":\"object\"}}]}"},
        {KVT_API_RESPONSES, "{\"instructions\":\"I\",\"input\":[{\"role\":\"user\",\"content\":\"q\"},{\"type\":"
                            "\"function_call\",\"call_id\":\"c\",\"namespace\":\"n\",\"name\":\"f\",\"arguments\":\"{}\"},"
                            "{\"type\":\"function_call_output\",\"call_id\":\"c\",\"output\":\"r\"}],\"tools\":[{\"type\":"
                            "\"namespace\",\"name\":\"n\",\"tools\":[{\"type\":\"function\",\"name\":\"f\"}]}],"
                            "\"max_output_tokens\":5,\"stream\":true}"},
    };
    const int n_seeds = (int)(sizeof seeds / sizeof *seeds);
    static const char alphabet[] = "{}[]\":,0123456789.-eE tfnulrsa\\\xc3\xa9\xff\x00";
    kvt_model *m = tiny();
    CHECK(m);
    uint64_t st = kvt_test_seed("api_parse_fuzz");
    char buf[1024];
    int parsed = 0;
    for (int it = 0; it < 4000; it++) {
        int k = (int)(kvt_test_rand(&st) % (uint64_t)n_seeds);
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
        /* the prompt as if generated: its tool-call syntax (the how-to and
         * the history) parsed into calls for the responses */
        kvt_tool_call *calls = NULL;
        size_t nc = 0, te = 0;
        CHECK_OK(kvt_tool_calls_parse(r.prompt, r.prompt_len, &calls, &nc, &te));
        char *outs[4] = {
            kvt_response_json_calls(&r, "id", r.model, r.prompt, te, calls, nc, "stop", r.n_stop ? r.stop[0] : NULL, &u, 0),
            kvt_stream_begin(&r, "id", r.model, &u, 0),
            kvt_stream_delta(&r, "id", r.model, r.prompt, te, 0),
            kvt_stream_end_calls(&r, "id", r.model, r.prompt, te, calls, nc, "stop", r.n_stop ? r.stop[0] : NULL, &u, 0),
        };
        json_t *j = load(outs[0]);
        bool ok = j != NULL;
        json_decref(j);
        for (int i = 1; i < 4; i++) {
            event ev[64];
            int ne = outs[i] ? split_sse(outs[i], ev, 64) : -1;
            if (ne < 0) ok = false;
            else free_events(ev, ne);
        }
        for (int i = 0; i < 4; i++) free(outs[i]);
        kvt_tool_calls_free(calls, nc);
        kvt_request_free(&r);
        CHECKF(ok, "iteration %d: a response did not render", it);
    }
    printf("    api_parse_fuzz: %d of 4000 mutated bodies parsed\n", parsed);
    kvt_model_close(m);
}

/* Mutated model output (bytes and marker pieces flipped, inserted, deleted,
 * cut) must parse without reading past the text, and what comes back must be
 * consistent: text_end within the text, spans in order and inside it, each
 * ending with an invoke end (and whitespace), arguments a compact JSON
 * object. */
TEST(api_tools_fuzz)
{
    static const char *const pieces[] = {CSB, CSE, "<" DSML "invoke name=\"", INV_END, "<" DSML "parameter name=\"",
                                         "</" DSML "parameter>", "\" string=\"true\">", "\" string=\"false\">", DSML,
                                         "\">", "\n", "{", "}", "\"", ":", "\xef\xbd", "a", " ", "<", "\0"};
    uint64_t st = kvt_test_seed("api_tools_fuzz");
    char buf[1024];
    size_t total_calls = 0;
    for (int it = 0; it < 3000; it++) {
        size_t n = GEN_LEN;
        memcpy(buf, gen_text, n);
        int edits = 1 + (int)(kvt_test_rand(&st) % 4);
        for (int e = 0; e < edits && n > 0; e++) {
            size_t pos = (size_t)(kvt_test_rand(&st) % n);
            const char *p = pieces[kvt_test_rand(&st) % (sizeof pieces / sizeof *pieces)];
            size_t pl = strlen(p);
            switch (kvt_test_rand(&st) % 4) {
            case 0: if (pos + pl <= n) memcpy(buf + pos, p, pl); break;
            case 1: if (n + pl < sizeof buf) { memmove(buf + pos + pl, buf + pos, n - pos); memcpy(buf + pos, p, pl); n += pl; } break;
            case 2: memmove(buf + pos, buf + pos + 1, n - pos - 1); n--; break;
            case 3: n = pos; break;
            }
        }
        char *copy = malloc(n ? n : 1);
        CHECK(copy);
        memcpy(copy, buf, n);
        kvt_tool_call *c;
        size_t nc, te;
        int rc = kvt_tool_calls_parse(copy, n, &c, &nc, &te);
        bool ok = rc == KVT_OK && te <= n && (nc > 0 || te == n) && kvt_tool_calls_text_len(copy, n) <= n;
        size_t end = te;
        for (size_t i = 0; i < nc && ok; i++) {
            ok = c[i].raw_off >= end && c[i].raw_off + c[i].raw_len <= n && c[i].name && c[i].name[0] &&
                 c[i].arguments && id_ok(c[i].id) && c[i].valid && c[i].raw_len >= strlen(INV_END) - 1;
            size_t e = c[i].raw_off + c[i].raw_len;
            while (ok && e > c[i].raw_off && strchr(" \t\r\n", copy[e - 1])) e--;
            ok = ok && e - c[i].raw_off >= strlen(INV_END) - 1 &&
                 !memcmp(copy + e - (strlen(INV_END) - 1), INV_END, strlen(INV_END) - 1);
            end = c[i].raw_off + c[i].raw_len;
            if (ok) {
                json_t *v = json_loads(c[i].arguments, 0, NULL);
                char *again = v ? json_dumps(v, JSON_COMPACT) : NULL;
                ok = json_is_object(v) && again && !strcmp(again, c[i].arguments);
                free(again);
                json_decref(v);
            }
        }
        total_calls += nc;
        kvt_tool_calls_free(c, nc);
        free(copy);
        CHECKF(ok, "iteration %d: rc %d, %zu calls, text_end %zu of %zu", it, rc, nc, te, n);
    }
    printf("    api_tools_fuzz: %zu calls parsed\n", total_calls);
}

/* Out of memory while a request parses and renders, and while its response
 * and stream events are built, is an error, never a crash or another
 * result: each of those allocations in turn fails once (a Claude Code
 * Messages body with tools; the response and stream of a tool call). A
 * failed parse is KVT_ENOMEM with status 500; a failed response is NULL;
 * whatever succeeds equals the run without failures. */
TEST(api_every_allocation_failure)
{
    /* jansson's allocations through the same counter (malloc here is the
     * wrapper: tests/alloc.c) */
    json_set_alloc_funcs(malloc, free);
    kvt_model *m = tiny();
    CHECK(m);
    char *body = claude_code_body("9f3a1");
    CHECK(body);
    const char *out = "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>Bash<｜tool▁sep｜>{\"command\":\"ls\"}"
                      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    kvt_request ref = {0};
    CHECK_OK(kvt_request_parse(&ref, KVT_API_MESSAGES, body, strlen(body), m, NULL));
    char *ref_js = kvt_response_json(&ref, "id-1", "kvtier", out, strlen(out), "stop", NULL, NULL, 7);
    char *ref_ev = kvt_stream_delta(&ref, "id-1", "kvtier", out, strlen(out), 7);
    CHECK(ref_js && ref_ev);
    size_t rounds = 0, bad = 0, enomem = 0, nulls = 0;
    for (long k = 0; k < 100000; k++) {
        kvt_request r = {0};
        int st = 0;
        unsigned long f0 = kvt_test_failed_allocs();
        kvt_test_fail_alloc(k);
        int rc = kvt_request_parse(&r, KVT_API_MESSAGES, body, strlen(body), m, &st);
        char *js = rc ? NULL : kvt_response_json(&r, "id-1", "kvtier", out, strlen(out), "stop", NULL, NULL, 7);
        char *ev = rc ? NULL : kvt_stream_delta(&r, "id-1", "kvtier", out, strlen(out), 7);
        kvt_test_fail_alloc(-1);
        bool hit = kvt_test_failed_allocs() != f0;
        rounds++;
        if (rc == KVT_ENOMEM) {
            enomem++;
            bad += st != 500;
        } else if (rc) {
            bad++;
            printf("    allocation %ld failed: %s (%s)\n", k, kvt_strerror(rc), kvt_errmsg());
        } else {
            bool wp = r.prompt_len != ref.prompt_len || memcmp(r.prompt, ref.prompt, r.prompt_len);
            bool wj = js && strcmp(js, ref_js), we = ev && strcmp(ev, ref_ev);
            nulls += !js + !ev;
            bad += wp + wj + we;
            if (wp || wj || we)
                printf("    allocation %ld failed, and the %s came out different:\n      %s\n", k,
                       wp ? "prompt" : wj ? "response" : "stream event", wp ? r.prompt : wj ? js : ev);
        }
        free(js);
        free(ev);
        kvt_request_free(&r);
        if (!hit) break;
    }
    printf("    %zu rounds, one allocation failing in each: %zu parses out of memory, %zu NULL responses,"
           " %zu wrong or other errors\n", rounds - 1, enomem, nulls, bad);
    CHECK(bad == 0 && rounds > 100);
    free(ref_js);
    free(ref_ev);
    kvt_request_free(&ref);
    free(body);
    kvt_model_close(m);
}

/* Where two conversations on one prompt part: the last user message's own
 * text (kvt_request.fork_at), found in the rendering whatever the template
 * writes before it, and whether an assistant turn comes before it
 * (opening). Negative control: a user text the history repeats earlier is
 * still found at its last place. */
TEST(api_prompt_fork_point)
{
    kvt_model *m = tiny();
    CHECK(m);
    kvt_request r;
    int st;
    CHECK_OK(parse(&r, KVT_API_CHAT,
                   "{\"messages\":[{\"role\":\"system\",\"content\":\"You help.\"},"
                   "{\"role\":\"user\",\"content\":\"  Say hello.\\n\"}]}", m, &st));
    CHECK(r.fork_at != SIZE_MAX && r.opening);
    CHECK(!strncmp(r.prompt + r.fork_at, "Say hello.", 10));
    kvt_request_free(&r);
    CHECK_OK(parse(&r, KVT_API_CHAT,
                   "{\"messages\":[{\"role\":\"user\",\"content\":\"again\"},{\"role\":\"assistant\",\"content\":\"ok\"},"
                   "{\"role\":\"user\",\"content\":\"again\"},{\"role\":\"system\",\"content\":\"late\"}]}", m, &st));
    CHECK(r.fork_at != SIZE_MAX && !r.opening);
    const char *first = strstr(r.prompt, "again");
    CHECKF(first && r.prompt + r.fork_at > first && !strncmp(r.prompt + r.fork_at, "again", 5),
           "the last user text is at %zu, the first at %td", r.fork_at, first ? first - r.prompt : -1);
    kvt_request_free(&r);
    CHECK_OK(parse(&r, KVT_API_COMPLETIONS, "{\"prompt\":\"plain text\"}", m, &st));
    CHECK(r.fork_at == SIZE_MAX);
    kvt_request_free(&r);
    kvt_model_close(m);
}
