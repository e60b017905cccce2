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
 *                              and is none), with the same control.
 *   generate_reply_scripted    the reply loop (kvt_gen_start / _next /
 *                              _took / _finish) through a scripted model:
 *                              before each step the test writes the
 *                              session's logits so that one byte of a
 *                              script is the argmax, and runs nothing.
 *                              The reply, streamed and whole, is the
 *                              script's text up to max_tokens ("length"),
 *                              up to a stop sequence (cut before it,
 *                              "stop"), up to the end-of-turn token
 *                              ("stop"), up to a cancel ("stop"), or
 *                              nothing at the context's end ("length",
 *                              as the chat API spells "context");
 *                              completion_tokens counts the tokens taken.
 *                              Control: the loop run without the stop
 *                              sequence gives another text, which fails
 *                              the same check. */
#include "test.h"
#include "serve/api.h"
#include "serve/generate.h"
#include "arch/model.h"
#include "chat/template.h"

#include <stdlib.h>
#include <string.h>
#include <jansson.h>

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

/* ---- the reply loop through a scripted model ---- */

typedef struct script {
    const int32_t *ids;   /* the tokens the "model" gives, in order */
    size_t n, at;
    size_t cancel_after;  /* the canceled callback says true after this many steps (0: never) */
    char deltas[512];     /* the streamed text, from the deltas */
    size_t dl;
} script;

static bool script_canceled(void *user)
{
    script *sc = user;
    return sc->cancel_after && sc->at >= sc->cancel_after;
}

/* The text of every chat delta in an SSE event appended to sc->deltas. */
static void script_emit(void *user, char *sse)
{
    script *sc = user;
    for (const char *p = sse; p && (p = strstr(p, "data: ")); p++) {
        const char *e = strchr(p, '\n');
        json_t *j = json_loadb(p + 6, e ? (size_t)(e - p - 6) : strlen(p + 6), 0, NULL);
        const char *c = json_string_value(json_object_get(
            json_object_get(json_array_get(json_object_get(j, "choices"), 0), "delta"), "content"));
        size_t cl = c ? strlen(c) : 0;
        if (cl && sc->dl + cl < sizeof sc->deltas) { memcpy(sc->deltas + sc->dl, c, cl); sc->dl += cl; }
        json_decref(j);
    }
    free(sse);
}

typedef struct reply { char text[512]; char finish[32]; long long completion; } reply;

/* One reply to body through the step API, the session's logits written
 * before each step to make sc's next id the argmax. stream: the reply's
 * text is taken from the deltas, and the finish reason from the end
 * events' last chunk. */
static bool run_script(kvt_model *m, const char *body, bool stream, uint32_t max_new, int ctx_room, script *sc,
                       reply *out)
{
    kvt_request r;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    kvt_session *s = NULL;
    kvt_model_info mi;
    kvt_model_info_get(m, &mi);
    bool ok = kvt_request_parse(&r, KVT_API_CHAT, body, strlen(body), m, NULL) == KVT_OK &&
              kvt_tokenize(m, r.prompt, r.prompt_len, r.prompt_has_bos ? 0 : 1, r.prompt_special, &ids, &n_ids) ==
                  KVT_OK &&
              kvt_session_new(&s, m, &(kvt_session_opts){.n_threads = 1}) == KVT_OK &&
              kvt_session_sync(s, ids, n_ids, NULL) == KVT_OK;
    memset(out, 0, sizeof *out);
    if (ok) {
        kvt_gen g = {.m = m, .s = s, .r = &r, .id = "chatcmpl-1", .model_name = "m", .stream = stream,
                     .max_new = max_new, .n_ctx = (uint32_t)((int)n_ids + ctx_room), .seed = 1};
        kvt_usage u = {.prompt_tokens = (uint32_t)n_ids};
        kvt_gen_out o = {.emit = script_emit, .canceled = script_canceled, .user = sc};
        kvt_gen_run *R = kvt_gen_start(&g, &u, &o);
        ok = R != NULL;
        float *lg = (float *)kvt_session_logits(s); /* the session's own buffer: the "model" writes it */
        for (int32_t t; ok;) {
            for (uint32_t i = 0; i < mi.n_vocab; i++) lg[i] = 0;
            if (sc->at < sc->n) lg[sc->ids[sc->at]] = 10;
            if (!kvt_gen_next(R, &t)) break;
            ok = sc->at < sc->n && t == sc->ids[sc->at];
            if (!ok) printf("    step %zu: token %d, the script has %d\n", sc->at, t, sc->at < sc->n ? sc->ids[sc->at] : -1);
            sc->at++;
            if (ok && !kvt_gen_took(R, KVT_OK)) break;
        }
        char *end = kvt_gen_finish(R);
        out->completion = u.completion_tokens;
        if (stream && end) {
            script_emit(sc, strdup(end));
            const char *f = NULL;
            for (const char *p = end; (p = strstr(p, "\"finish_reason\":\"")); p++) f = p + 17;
            if (f) snprintf(out->finish, sizeof out->finish, "%.*s", (int)strcspn(f, "\""), f);
            snprintf(out->text, sizeof out->text, "%.*s", (int)sc->dl, sc->deltas);
        } else if (end) {
            json_t *j = json_loads(end, 0, NULL), *c0 = json_array_get(json_object_get(j, "choices"), 0);
            const char *t = json_string_value(json_object_get(json_object_get(c0, "message"), "content"));
            const char *f = json_string_value(json_object_get(c0, "finish_reason"));
            snprintf(out->text, sizeof out->text, "%s", t ? t : "");
            snprintf(out->finish, sizeof out->finish, "%s", f ? f : "");
            json_decref(j);
        }
        ok = ok && end;
        free(end);
    }
    kvt_session_free(s);
    free(ids);
    kvt_request_free(&r);
    return ok;
}

/* The ids of text's bytes, one token each (the byte tokenizer). */
static size_t byte_ids(const kvt_model *m, const char *text, int32_t *ids)
{
    kvt_model_info mi;
    kvt_model_info_get(m, &mi);
    size_t n = 0;
    for (const char *c = text; *c; c++)
        for (uint32_t id = 0; id < mi.n_vocab; id++) {
            const char *p;
            size_t pl;
            if (kvt_token_piece(m, (int32_t)id, &p, &pl) == KVT_OK && pl == 1 && *p == *c) { ids[n++] = (int32_t)id; break; }
        }
    return n;
}

static bool reply_is(const reply *r, const char *text, const char *finish, long long completion, const char *what)
{
    bool ok = !strcmp(r->text, text) && !strcmp(r->finish, finish) && r->completion == completion;
    if (!ok)
        printf("    %s: \"%s\" %s %lld tokens, want \"%s\" %s %lld\n", what, kvt_test_esc(r->text, strlen(r->text)),
               r->finish, r->completion, text, finish, completion);
    return ok;
}

TEST(generate_reply_scripted)
{
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_preset(&m, "ds4-tiny", 1, NULL));
    int32_t ids[64];
    size_t n = byte_ids(m, "Hello world, again.", ids);
    static const char plain[] = "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"temperature\":0}";
    static const char stop[] = "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"temperature\":0,"
                               "\"stop\":[\"o w\"]}";
    reply r;
    bool ok = n == 19;
    for (int stream = 0; ok && stream < 2; stream++) {
        const char *how = stream ? "streamed" : "whole";
        script a = {ids, n, 0, 0, "", 0};
        ok = run_script(m, plain, stream, 5, 100, &a, &r) && reply_is(&r, "Hello", "length", 5, how);
        script b = {ids, n, 0, 0, "", 0};
        ok = ok && run_script(m, stop, stream, 100, 100, &b, &r) && reply_is(&r, "Hell", "stop", 7, how);
        script c = {ids, n, 0, 3, "", 0};
        ok = ok && run_script(m, plain, stream, 100, 100, &c, &r) && reply_is(&r, "Hel", "stop", 3, how);
        script d = {ids, n, 0, 0, "", 0};
        ok = ok && run_script(m, plain, stream, 100, 0, &d, &r) && reply_is(&r, "", "length", 0, how);
        /* the end of the turn: the template's end token after "Hi" */
        kvt_template_tokens tt;
        kvt_template_tokens_get(kvt_template_for(m), m, &tt);
        kvt_model_info mi;
        kvt_model_info_get(m, &mi);
        int32_t eot[3] = {ids[0], ids[4], tt.n_end ? tt.end[0] : mi.eos};
        script e = {eot, 3, 0, 0, "", 0};
        ok = ok && eot[2] >= 0 && run_script(m, plain, stream, 100, 100, &e, &r) && reply_is(&r, "Ho", "stop", 2, how);
        /* the whole script: 19 tokens, then the end of the turn */
        int32_t all[20];
        memcpy(all, ids, sizeof(int32_t) * n);
        all[n] = eot[2];
        script f = {all, n + 1, 0, 0, "", 0};
        ok = ok && run_script(m, plain, stream, 100, 100, &f, &r) &&
             reply_is(&r, "Hello world, again.", "stop", 19, how);
    }
    /* control: without the stop sequence the same check fails */
    script g = {ids, n, 0, 0, "", 0};
    bool control = run_script(m, plain, false, (uint32_t)n, 100, &g, &r) && !reply_is(&r, "Hell", "stop", 7, "control");
    kvt_model_close(m);
    CHECK(ok);
    CHECKF(control, "the reply without its stop sequence passed the stop check");
}
