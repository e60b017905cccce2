/* toolcall: the tool-call parser on any model output (kvt_tool_calls_parse,
 * kvt_tool_calls_text_len), and the responses built from what it returns.
 * What must hold:
 *   - text_end is len when no call was found, else it is where a
 *     <｜tool▁calls▁begin｜> or <｜tool▁call▁begin｜> starts;
 *   - the calls' raw spans tile the bytes after the text: the first starts
 *     at text_end (after <｜tool▁calls▁begin｜> when that is there), each
 *     next one where the previous ends, and each ends with
 *     <｜tool▁call▁end｜>;
 *   - names are non-empty single lines; a valid call's arguments are a JSON
 *     object, and rendering the call canonically and parsing that again
 *     gives the same name and arguments (or, for a -0, arguments that are
 *     stable from then on: "-0" reads back as the integer 0);
 *   - while streaming, no prefix of the text ever shows more than the final
 *     parse calls text (kvt_tool_calls_text_len <= text_end at every cut
 *     point, never more than the cut, and never shrinking as text grows);
 *   - the response bodies and streams for these calls are valid JSON and
 *     SSE, whatever bytes the text holds (one api per input, by its hash). */
#include "fuzz.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#define FW "\xef\xbd\x9c"
#define SPM "\xe2\x96\x81"
#define CSB "<" FW "tool" SPM "calls" SPM "begin" FW ">"
#define CB "<" FW "tool" SPM "call" SPM "begin" FW ">"
#define CE "<" FW "tool" SPM "call" SPM "end" FW ">"
#define TSEP "<" FW "tool" SPM "sep" FW ">"
#define LIT(s) (sizeof(s) - 1)

static bool starts(const char *p, size_t n, const char *lit, size_t ln) { return n >= ln && !memcmp(p, lit, ln); }

/* Requests with tools for each api, parsed once. */
static kvt_request req[4];
static bool have_req[4];

static void init(void)
{
    static const char *const bodies[4] = {
        [KVT_API_CHAT] = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\","
                         "\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\"}}}]}",
        [KVT_API_COMPLETIONS] = "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}",
        [KVT_API_MESSAGES] = "{\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":"
                             "[{\"name\":\"f\",\"input_schema\":{\"type\":\"object\"}}]}",
        [KVT_API_RESPONSES] = "{\"input\":\"x\",\"tools\":[{\"type\":\"function\",\"name\":\"f\",\"parameters\":"
                              "{\"type\":\"object\"}},{\"type\":\"namespace\",\"name\":\"ns\",\"tools\":"
                              "[{\"type\":\"function\",\"name\":\"g\",\"parameters\":{\"type\":\"object\"}}]}]}",
    };
    for (int a = 0; a < 4; a++) {
        int st;
        have_req[a] = kvt_request_parse(&req[a], (kvt_api)a, bodies[a], strlen(bodies[a]), fuzz_ds4(1), &st) == KVT_OK;
        if (!have_req[a]) {
            /* a namespace tool is newer than the rest: try without it */
            static const char plain[] = "{\"input\":\"x\",\"tools\":[{\"type\":\"function\",\"name\":\"f\","
                                        "\"parameters\":{\"type\":\"object\"}}]}";
            have_req[a] = a == KVT_API_RESPONSES &&
                          kvt_request_parse(&req[a], (kvt_api)a, plain, strlen(plain), fuzz_ds4(1), &st) == KVT_OK;
        }
    }
}

/* name and arguments rendered as the deepseek template renders a canonical
 * call; NULL unless that parses as one valid call (malloc'ed) */
static kvt_tool_call *reparse(const char *name, const char *args, size_t *n)
{
    size_t nl = strlen(name), al = strlen(args), o = 0, te = 0;
    char *t = malloc(LIT(CB "function" TSEP) + nl + 9 + al + 4 + LIT(CE) + 1);
    if (!t) return NULL;
    memcpy(t + o, CB "function" TSEP, LIT(CB "function" TSEP)), o += LIT(CB "function" TSEP);
    memcpy(t + o, name, nl), o += nl;
    memcpy(t + o, "\n```json\n", 9), o += 9;
    memcpy(t + o, args, al), o += al;
    memcpy(t + o, "\n```" CE, 4 + LIT(CE)), o += 4 + LIT(CE);
    kvt_tool_call *d = NULL;
    *n = 0;
    int rc = kvt_tool_calls_parse(t, o, &d, n, &te);
    free(t);
    return rc ? NULL : d;
}

/* A valid call rendered canonically parses back to the same name and to
 * arguments that are canonical already: the same, or (-0 is written "-0",
 * which reads back as the integer 0) arguments that then stay as they are. */
static void check_canonical(const kvt_tool_call *c, const char *text)
{
    /* markers in the text make another parse */
    if (!c->valid || strstr(c->arguments, FW) || strstr(c->name, FW)) return;
    size_t n = 0, n2 = 0;
    kvt_tool_call *d = reparse(c->name, c->arguments, &n), *e = NULL;
    bool ok = d && n == 1 && d[0].valid && !strcmp(d[0].name, c->name);
    if (ok && strcmp(d[0].arguments, c->arguments)) {
        e = reparse(d[0].name, d[0].arguments, &n2);
        ok = e && n2 == 1 && e[0].valid && !strcmp(e[0].arguments, d[0].arguments);
    }
    FUZZ_CHECK(ok, "a call rendered canonically parses back differently: '%.200s' '%.200s'", c->name, c->arguments);
    kvt_tool_calls_free(d, n);
    kvt_tool_calls_free(e, n2);
}

/* The responses of one api (the checks cost more than the parse: one api
 * per input, chosen by its hash). */
static void check_responses(const char *text, size_t te, const kvt_tool_call *calls, size_t n, int a)
{
    if (!have_req[a]) return;
    kvt_usage u = {.prompt_tokens = 3, .completion_tokens = 2};
    kvt_request *r = &req[a];
    r->sse_seq = 0;
    r->sse_text_open = false;
    char *s = kvt_response_json_calls(r, a == KVT_API_RESPONSES ? "resp_1" : "id", "m", text, te, calls, n,
                                      n ? "tool_calls" : "stop", NULL, &u, 1);
    FUZZ_CHECK(s && fuzz_json_ok(s, strlen(s)), "api %d: response with %zu calls is not JSON: %.300s", a, n,
               s ? s : "(null)");
    free(s);
    char *parts[3] = {kvt_stream_begin(r, "id", "m", &u, 1), kvt_stream_delta(r, "id", "m", text, te, 1),
                      kvt_stream_end_calls(r, "id", "m", text, te, calls, n, "length", NULL, &u, 1)};
    for (int i = 0; i < 3; i++) {
        FUZZ_CHECK(fuzz_sse_ok(parts[i]), "api %d: stream part %d is not SSE: %.300s", a, i,
                   parts[i] ? parts[i] : "(null)");
        free(parts[i]);
    }
}

int fuzz_toolcall(const uint8_t *data, size_t size)
{
    static bool ready;
    if (!ready) { ready = true; init(); }
    const char *text = (const char *)data;
    kvt_tool_call *c = NULL;
    size_t n = 0, te = 0;
    int rc = kvt_tool_calls_parse(size ? text : NULL, size, &c, &n, &te);
    FUZZ_CHECK(rc == KVT_OK, "parse: %s", kvt_errmsg());
    if (rc) return 0;
    FUZZ_CHECK(te <= size, "text_end %zu past %zu", te, size);
    if (n == 0) {
        FUZZ_CHECK(te == size && !c, "no calls, but text ends at %zu of %zu", te, size);
    } else {
        FUZZ_CHECK(te < size && (starts(text + te, size - te, CSB, LIT(CSB)) || starts(text + te, size - te, CB, LIT(CB))),
                   "the text ends at %zu, not at a marker", te);
        size_t at = te + (starts(text + te, size - te, CSB, LIT(CSB)) ? LIT(CSB) : 0);
        for (size_t i = 0; i < n; i++) {
            FUZZ_CHECK(c[i].raw_off == at && c[i].raw_len <= size - at && c[i].raw_len >= LIT(CE) &&
                           !memcmp(text + at + c[i].raw_len - LIT(CE), CE, LIT(CE)),
                       "call %zu spans %zu+%zu, expected it at %zu", i, c[i].raw_off, c[i].raw_len, at);
            at = c[i].raw_off + c[i].raw_len;
            FUZZ_CHECK(c[i].id && c[i].name && c[i].arguments, "call %zu: NULL field", i);
            if (!c[i].id || !c[i].name || !c[i].arguments) continue;
            FUZZ_CHECK(!strchr(c[i].name, '\n'), "call %zu: name '%.100s'", i, c[i].name);
            /* regress/toolcall/nul-in-name: a NUL byte in the name cuts the C string */
            FUZZ_CHECK(c[i].name[0], "call %zu: an empty name", i);
            if (c[i].valid) {
                json_t *j = json_loads(c[i].arguments, 0, NULL);
                FUZZ_CHECK(json_is_object(j), "call %zu: valid arguments are not an object: %.200s", i, c[i].arguments);
                json_decref(j);
            }
            check_canonical(&c[i], text);
        }
    }
    /* streaming: the text shown at any cut never exceeds what the final parse calls text */
    size_t last = 0;
    for (size_t j = 0; j <= 64; j++) {
        size_t k = size * j / 64;
        size_t tl = kvt_tool_calls_text_len(size ? text : NULL, k);
        FUZZ_CHECK(tl <= k && tl >= last && (n == 0 || tl <= te),
                   "text_len at %zu is %zu (previous cut %zu, final text %zu of %zu)", k, tl, last, te, size);
        last = tl;
    }
    check_responses(text, te, c, n, (int)(fuzz_hash(data, size) % 4));
    kvt_tool_calls_free(c, n);
    return 0;
}
