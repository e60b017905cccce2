/* The prompt a request renders (src/serve/api.c, src/chat/): the exact
 * deepseek and plain renderings, the prefix property that prefix caching
 * depends on (with a negative control), tool definitions and history in
 * every API, the bodies Claude Code, Codex and Pi send, volatile lines,
 * and the fork point of a conversation.
 *
 * Every body is parsed from a heap copy of exactly its length, without a NUL,
 * so an over-read shows under `make asan`. Shared helpers: tests/test_api.h. */
#include "test_api.h"

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
