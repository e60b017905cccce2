/* OpenAI Responses (/v1/responses, src/serve/api.c): the response with
 * and without tool calls, its event stream (text, tool calls, errors),
 * parsed back field by field.
 *
 * Every body is parsed from a heap copy of exactly its length, without a NUL,
 * so an over-read shows under `make asan`. Shared helpers: tests/test_api.h. */
#include "test_api.h"

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
