/* The generation loop (src/serve/generate.c):
 *
 *   generate_tool_scan_linear  a streamed reply to a request that offers
 *                              tools: the bytes the tool-call scan looks at
 *                              grow linearly with the reply (ds4-tiny,
 *                              greedy, 1,500 and 3,000 tokens: about a
 *                              token's piece and the opener's length a
 *                              token, and twice as many for twice the
 *                              tokens). Control: with kvt_tool_scan_fault
 *                              every token's scan starts over (the loop
 *                              before it resumed), and the same counts are
 *                              quadratic: they fail both bounds.
 *   generate_tool_scan_families the same per template's scan over a long
 *                              text grown a few bytes at a time (DSML,
 *                              Qwen's, Gemma 4's openers and Llama 3's JSON
 *                              candidates, with text that looks like calls
 *                              and is none), with the same control. */
#include "test.h"
#include "serve/api.h"
#include "serve/generate.h"
#include "arch/model.h"
#include "chat/template.h"

#include <stdlib.h>
#include <string.h>

static void drop(void *user, char *sse)
{
    (*(size_t *)user)++;
    free(sse);
}

/* Stream a greedy reply of n tokens to a chat request with one tool on
 * ds4-tiny; *scanned: the bytes its tool-call scans looked at. */
static bool stream_reply(kvt_model *m, uint32_t n, unsigned long long *scanned, uint32_t *tokens)
{
    const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":\"Write.\"}],\"stream\":true,\"temperature\":0,"
                       "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":"
                       "{\"type\":\"object\"}}}]}";
    kvt_request r;
    int32_t *ids = NULL;
    size_t n_ids = 0, events = 0;
    kvt_session *s = NULL;
    bool ok = kvt_request_parse(&r, KVT_API_CHAT, body, strlen(body), m, NULL) == KVT_OK && r.n_tools == 1 &&
              kvt_tokenize(m, r.prompt, r.prompt_len, r.prompt_has_bos ? 0 : 1, r.prompt_special, &ids, &n_ids) ==
                  KVT_OK;
    kvt_session_opts so = {.n_ctx = (uint32_t)n_ids + n + 64, .n_threads = 1};
    ok = ok && kvt_session_new(&s, m, &so) == KVT_OK && kvt_session_sync(s, ids, n_ids, NULL) == KVT_OK;
    if (ok) {
        kvt_gen g = {.m = m, .s = s, .r = &r, .id = "chatcmpl-1", .model_name = "m", .stream = true, .max_new = n,
                     .n_ctx = so.n_ctx, .seed = 1};
        kvt_usage u = {0};
        kvt_gen_out out = {.emit = drop, .user = &events};
        unsigned long long b0 = kvt_tool_scan_bytes;
        char *end = kvt_generate_run(&g, &u, &out);
        *scanned = kvt_tool_scan_bytes - b0;
        *tokens = u.completion_tokens;
        ok = end && events > n / 4;
        free(end);
    }
    kvt_session_free(s);
    free(ids);
    kvt_request_free(&r);
    return ok;
}

/* Bytes a scan may look at per token: the token's piece (a byte, or a
 * special token's text) and the opener's length before it. */
#define PER_TOKEN 64

TEST(generate_tool_scan_linear)
{
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_preset(&m, "ds4-tiny", 1, NULL));
    unsigned long long s1 = 0, s2 = 0, f1 = 0, f2 = 0;
    uint32_t t1 = 0, t2 = 0, u1 = 0, u2 = 0;
    bool ok = stream_reply(m, 1500, &s1, &t1) && stream_reply(m, 3000, &s2, &t2);
    kvt_tool_scan_fault = 1; /* the control: every scan from the start */
    ok = ok && stream_reply(m, 1500, &f1, &u1) && stream_reply(m, 3000, &f2, &u2);
    kvt_tool_scan_fault = 0;
    kvt_model_close(m);
    CHECK(ok);
    printf("    resumed: %u tokens %llu bytes scanned, %u tokens %llu (x%.2f)\n", t1, s1, t2, s2, (double)s2 / s1);
    printf("    from the start (control): %u tokens %llu bytes scanned, %u tokens %llu (x%.2f)\n", u1, f1, u2, f2,
           (double)f2 / f1);
    CHECKF(t1 == 1500 && t2 == 3000 && u1 == t1 && u2 == t2, "the replies ended early: %u %u %u %u", t1, t2, u1, u2);
    /* linear: a bound per token, and twice the tokens about twice the bytes */
    CHECK(s1 <= (unsigned long long)PER_TOKEN * t1 && s2 <= (unsigned long long)PER_TOKEN * t2);
    CHECK(s2 < 3 * s1);
    /* the control fails both */
    CHECK(f2 > (unsigned long long)PER_TOKEN * u2 && f2 > 3 * f1);
}

/* One scan over text grown step bytes at a time: its bytes looked at. */
static unsigned long long scan_all(const kvt_template *t, const char *text, size_t len, size_t step, size_t *out)
{
    kvt_tool_scan sc = {0};
    unsigned long long b0 = kvt_tool_scan_bytes;
    for (size_t l = 0; l <= len; l += step) *out = t->tool_calls_scan(&sc, text, l);
    *out = t->tool_calls_scan(&sc, text, len);
    return kvt_tool_scan_bytes - b0;
}

TEST(generate_tool_scan_families)
{
    /* 200 KB of prose with things that look like the start of a call */
    static const char unit[] = "Some text <tool and {\"a\": 1} then {\"name\": \"x\"} <|python and \"{\" more.\n  ";
    size_t len = 200000, ul = sizeof unit - 1;
    char *text = malloc(len + 1);
    CHECK(text);
    for (size_t i = 0; i < len; i++) text[i] = unit[i % ul];
    text[len] = 0;
    static const char *const names[] = {"deepseek", "qwen3", "qwen3.5", "gemma4", "llama3", "gemma3"};
    for (size_t k = 0; k < sizeof names / sizeof *names; k++) {
        const kvt_template *t = kvt_template_named(names[k]);
        size_t end = 0, fresh = t->tool_calls_text_len(text, len), cend = 0;
        unsigned long long b = scan_all(t, text, len, 3, &end);
        kvt_tool_scan_fault = 1;
        unsigned long long f = scan_all(t, text, 20000, 3, &cend); /* a tenth of it: the control is quadratic */
        kvt_tool_scan_fault = 0;
        printf("    %-8s %zu bytes grown 3 at a time: %llu bytes scanned; from the start each time, a tenth of "
               "them: %llu\n", names[k], len, b, f);
        CHECKF(end == fresh, "%s: the resumed scan ends the text at %zu, from scratch %zu", names[k], end, fresh);
        CHECKF(b <= 16 * (unsigned long long)len, "%s: %llu bytes scanned for %zu", names[k], b, len);
        if (strcmp(names[k], "gemma3")) /* gemma3 has no tool syntax: nothing to scan */
            CHECKF(f > 16 * 20000ULL, "%s: the control scanned only %llu bytes", names[k], f);
    }
    free(text);
}
