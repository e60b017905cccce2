/* OpenAI Completions (/v1/completions, src/serve/api.c): a request body
 * parsed, and the response and the SSE stream parsed back field by field.
 *
 * Every body is parsed from a heap copy of exactly its length, without a NUL,
 * so an over-read shows under `make asan`. Shared helpers: tests/test_api.h. */
#include "test_api.h"

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
