/* Tool calls in generated text (src/serve/api.c): parsed from the
 * deepseek template's markup, their text end, and round trips through each
 * API (a call answered, then sent back as history), in responses and
 * streams; a seeded mutation fuzz of the parser.
 *
 * Every body is parsed from a heap copy of exactly its length, without a NUL,
 * so an over-read shows under `make asan`. Shared helpers: tests/test_api.h. */
#include "test_api.h"

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
