/* Log-probabilities (src/serve/api.c): the request fields, the top
 * alternatives against an independent log-sum-exp, and their shapes in
 * responses and streams of each API.
 *
 * Every body is parsed from a heap copy of exactly its length, without a NUL,
 * so an over-read shows under `make asan`. Shared helpers: tests/test_api.h. */
#include "test_api.h"

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
