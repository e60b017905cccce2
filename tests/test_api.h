/* What the tests of the request and response shapes (tests/test_api*.c)
 * share: the deepseek template's markers, a few models, parsing from an
 * exact-size heap copy, JSON and SSE readers, and the bodies, usages and
 * streams more than one API's file checks. Static: each file has its own
 * copy of what it uses. */
#ifndef KVT_TEST_API_H
#define KVT_TEST_API_H

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

static __attribute__((unused)) kvt_model *tiny(void)
{
    kvt_model *m = NULL;
    if (kvt_model_preset(&m, "ds4-tiny", 1, NULL)) return NULL;
    return m;
}

static __attribute__((unused)) kvt_model *stories(void)
{
    const char *p = kvt_test_shared("models/stories260K.gguf");
    kvt_model *m = NULL;
    if (!p || kvt_model_open(&m, p)) return NULL;
    return m;
}

/* Parse body from an exact-size heap copy (no NUL after it). */
static __attribute__((unused)) int parse(kvt_request *r, kvt_api api, const char *body, const kvt_model *m, int *status)
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
static __attribute__((unused)) int parse_o(kvt_request *r, kvt_api api, const char *body, const kvt_model *m, const kvt_parse_opts *o)
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

static __attribute__((unused)) bool prompt_is(const kvt_request *r, const char *want)
{
    size_t n = strlen(want);
    bool ok = r->prompt && r->prompt_len == n && !memcmp(r->prompt, want, n) && r->prompt[n] == 0;
    if (!ok) {
        printf("      want '%s'\n", kvt_test_esc(want, n));
        if (r->prompt) printf("      got  '%s'\n", kvt_test_esc(r->prompt, r->prompt_len));
    }
    return ok;
}

static __attribute__((unused)) json_t *load(const char *s)
{
    json_error_t e;
    json_t *v = s ? json_loads(s, 0, &e) : NULL;
    if (s && !v) printf("      bad JSON (%s): %s\n", e.text, s);
    return v;
}

/* The value at "a.b.0.c" (array elements by index), or NULL. */
static __attribute__((unused)) json_t *at(const json_t *o, const char *path)
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

static __attribute__((unused)) const char *sget(const json_t *o, const char *path) { return json_string_value(at(o, path)); }
static __attribute__((unused)) long long iget(const json_t *o, const char *path)
{
    json_t *v = at(o, path);
    return json_is_integer(v) ? json_integer_value(v) : -999;
}
static __attribute__((unused)) bool streq(const char *a, const char *b) { return a && b && !strcmp(a, b); }
static __attribute__((unused)) bool is_null(const json_t *o, const char *path) { return json_is_null(at(o, path)); }

/* One SSE event: its "event:" name (or "") and parsed data (NULL for [DONE]). */
typedef struct event { char name[64]; json_t *data; bool done; } event;

/* Split SSE text into events; every event must be well formed: optional
 * "event: X\n", then one "data: ...\n", then a blank line. */
static __attribute__((unused)) int split_sse(const char *s, event *ev, int max)
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

static __attribute__((unused)) void free_events(event *ev, int n)
{
    for (int i = 0; i < n; i++) json_decref(ev[i].data);
}

/* Append a string to a growing event text. */
static __attribute__((unused)) void cat(char **acc, char *s)
{
    if (!s) return;
    size_t a = *acc ? strlen(*acc) : 0, b = strlen(s);
    char *p = realloc(*acc, a + b + 1);
    if (p) { memcpy(p + a, s, b + 1); *acc = p; }
    free(s);
}

static __attribute__((unused)) bool is_prefix(const kvt_request *a, const kvt_request *b)
{
    return a->prompt_len <= b->prompt_len && !memcmp(a->prompt, b->prompt, a->prompt_len);
}

#define U "[{\"role\":\"user\",\"content\":\"x\"}]"

static __attribute__((unused)) const kvt_usage U1 = {.prompt_tokens = 100, .completion_tokens = 20, .cached_tokens = 60, .created_tokens = 30};

static __attribute__((unused)) bool openai_usage_ok(const json_t *u, long long prompt, long long completion, long long cached)
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

static __attribute__((unused)) bool anthropic_usage_ok(const json_t *u, long long input, long long output, long long read,
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

/* Run a whole stream for r with the deltas and return the SSE text. */
static __attribute__((unused)) char *stream_all(kvt_request *r, const char *const *deltas, int nd, const char *finish,
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

static __attribute__((unused)) const char *const deltas[] = {"Hel", "lo", " w\xc3\xb6rld", "\n"};

#define N_DELTAS 4

static __attribute__((unused)) const char *const w_chat[] = {
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

static __attribute__((unused)) const char *const w_msgs[] = {
    "{\"role\":\"user\",\"content\":\"Weather in Paris and Rome?\"}",
    "{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"Checking.\"},{\"type\":\"tool_use\",\"id\":\"c1\","
    "\"name\":\"get_weather\",\"input\":{\"city\":\"Paris\"}},{\"type\":\"tool_use\",\"id\":\"c2\",\"name\":\"get_weather\","
    "\"input\":{\"city\":\"Rome\"},\"cache_control\":{\"type\":\"ephemeral\"}}]}",
    "{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"tool_use_id\":\"c1\",\"content\":\"18C\"},"
    "{\"type\":\"tool_result\",\"tool_use_id\":\"c2\",\"content\":[{\"type\":\"text\",\"text\":\"21C\"}],\"is_error\":false}]}",
    "{\"role\":\"assistant\",\"content\":\"Paris 18C, Rome 21C.\"}",
    "{\"role\":\"user\",\"content\":\"Thanks\"}",
};

static __attribute__((unused)) const char *const w_resp[] = {
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

static __attribute__((unused)) const convo_api weather[] = {
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
static __attribute__((unused)) char *body_k(const convo_api *c, size_t k)
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

/* Claude Code 2.1-like /v1/messages body: three system blocks, the first a
 * billing line whose hash changes per prompt; tools with "$schema"; a system
 * message after the user turn; thinking, context_management, output_config,
 * metadata.user_id and cache_control everywhere. */
static __attribute__((unused)) char *claude_code_body(const char *hash)
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

/* Codex 0.171-like /v1/responses body: instructions, two developer items, an
 * environment item, the prompt, ids on every item, a namespace tool and a
 * hosted web_search, a reasoning item, replayed function_call and
 * function_call_output items (one of a namespace function), and the fields
 * Codex sends that mean nothing for the prompt. */
static __attribute__((unused)) const char codex_body[] =
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

/* What a model might write: text, then two calls with the arguments in its
 * own key order, one string value written as JSON (string="false"). */
static __attribute__((unused)) const char gen_text[] = "Checking.\n\n" CSB "\n" INVOKE("get_weather", PSTR("city", "Paris"))
                               INVOKE("get_weather", PJSON("units", "\"C\"") PSTR("city", "Rome")) CSE;

#define GEN_LEN (sizeof gen_text - 1)

#define GEN_TEXT_END 9 /* "Checking." */

/* The replay hook of the round trip: the raw bytes of each call, by id. */
typedef struct replay_map {
    const kvt_tool_call *calls;
    size_t n;
    const char *text;
    int hits;
} replay_map;

static __attribute__((unused)) bool replay_cb(void *user, const char *id, kvt_wbuf *out)
{
    replay_map *rm = user;
    for (size_t i = 0; i < rm->n; i++)
        if (!strcmp(rm->calls[i].id, id)) {
            rm->hits++;
            kvt_wbuf_put(out, rm->text + rm->calls[i].raw_off, rm->calls[i].raw_len);
            return true;
        }
    return false;
}

/* The next request a client sends after the response j to request body1:
 * the reply as the client got it, then the two results. */
static __attribute__((unused)) char *next_body(kvt_api api, const char *body1, const json_t *j, const kvt_tool_call *c)
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

static __attribute__((unused)) int gen_calls(kvt_tool_call **c, size_t *n)
{
    size_t te;
    return kvt_tool_calls_parse(gen_text, GEN_LEN, c, n, &te);
}

/* The Response object as the openai client types it and Codex reads it. */
static __attribute__((unused)) bool response_ok(const json_t *j, const char *id, const char *status, size_t n_out)
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

/* A whole stream: begin, the text in pieces, the end with the calls. */
static __attribute__((unused)) char *stream_calls(kvt_request *r, const char *id, const char *text, const kvt_tool_call *c, size_t n,
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

/* Every Responses event: named as its type, sequence numbers 0, 1, 2, ... */
static __attribute__((unused)) bool responses_events_ok(const event *ev, int n, const char *const *names)
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

#endif
