/* Thinking mode (src/serve/api.c): the split of reasoning from the
 * answer, the request fields that turn it on, and the reasoning in
 * responses, streams and history of each API.
 *
 * Every body is parsed from a heap copy of exactly its length, without a NUL,
 * so an over-read shows under `make asan`. Shared helpers: tests/test_api.h. */
#include "test_api.h"

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
