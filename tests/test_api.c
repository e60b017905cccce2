/* The request and response shapes every API shares (src/serve/api.c):
 * every refusal with its status, usage counts clamped, invalid UTF-8
 * repaired, error and model bodies, stream errors, a seeded mutation fuzz
 * of the parser and every allocation failure. Each API's own shapes are
 * in tests/test_api_<api>.c (chat, completions, messages, responses), the
 * rendered prompt in tests/test_api_prompt.c, tool calls, log-probabilities
 * and thinking in tests/test_api_tools.c, _logprobs.c and _thinking.c.
 *
 * Every body is parsed from a heap copy of exactly its length, without a NUL,
 * so an over-read shows under `make asan`. Shared helpers: tests/test_api.h. */
#include "test_api.h"

typedef struct bad_case {
    kvt_api api;
    const char *body;
    const char *needle; /* in the message */
} bad_case;

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
