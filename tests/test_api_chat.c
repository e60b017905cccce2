/* OpenAI Chat Completions (/v1/chat/completions, src/serve/api.c): realistic
 * request bodies parsed, and the response and the SSE stream parsed back
 * with jansson field by field.
 *
 * Every body is parsed from a heap copy of exactly its length, without a NUL,
 * so an over-read shows under `make asan`. Shared helpers: tests/test_api.h. */
#include "test_api.h"

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
