/* Anthropic Messages (/v1/messages, src/serve/api.c): a realistic request
 * body parsed, and the response and the SSE stream parsed back field by
 * field.
 *
 * Every body is parsed from a heap copy of exactly its length, without a NUL,
 * so an over-read shows under `make asan`. Shared helpers: tests/test_api.h. */
#include "test_api.h"

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
