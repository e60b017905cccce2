/* The capturing side of capture.h: parse, then save. Per target (for
 * template, per api) at most MAX_OK inputs that parse (bodies) or hold calls
 * (model outputs) and MAX_OTHER others (the tests' refusals come first; the
 * seeded mutation tests that follow add random damage, which the fuzzer
 * makes itself), each at most MAX_LEN bytes and named by its hash, so the
 * same input captured twice is one file. */
#include "serve/api.h"
#include "fuzz.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define MAX_OK 400
#define MAX_OTHER 150
#define MAX_LEN 65536

int fuzz_capture_parse(kvt_request *out, kvt_api api, const char *body, size_t len, const kvt_model *m,
                       int *status);
int fuzz_capture_parse_opts(kvt_request *out, kvt_api api, const char *body, size_t len, const kvt_model *m,
                            const kvt_parse_opts *opts, int *status);
int fuzz_capture_tool_calls_parse(const char *text, size_t len, kvt_tool_call **calls, size_t *n, size_t *text_end);

static void save_as(const char *target, const char *quota, bool ok, const void *p, size_t len)
{
    static struct { const char *target; int n[2]; } counts[16];
    const char *root = getenv("KVT_FUZZ_CAPTURE");
    if (!root || !p || len == 0 || len > MAX_LEN) return;
    size_t i = 0;
    while (i < 16 && counts[i].target && strcmp(counts[i].target, quota)) i++;
    if (i == 16) return;
    counts[i].target = quota;
    if (counts[i].n[ok] >= (ok ? MAX_OK : MAX_OTHER)) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", root, target);
    if (mkdir(path, 0777) && errno != EEXIST) return;
    snprintf(path, sizeof path, "%s/%s/test-%016llx", root, target, (unsigned long long)fuzz_hash(p, len));
    FILE *f = fopen(path, "wbx"); /* x: already saved */
    if (!f) return;
    counts[i].n[ok]++;
    fwrite(p, 1, len, f);
    fclose(f);
}

static void save(const char *target, bool ok, const void *p, size_t len) { save_as(target, target, ok, p, len); }

static int save_body(kvt_api api, const char *body, size_t len, int rc)
{
    bool ok = rc == KVT_OK;
    switch (api) {
    case KVT_API_CHAT:
        save("api_chat", ok, body, len);
        save_as("template", "template-chat", ok, body, len);
        break;
    case KVT_API_COMPLETIONS: save("api_completions", ok, body, len); break;
    case KVT_API_MESSAGES:
        save("api_messages", ok, body, len);
        save("api_count_tokens", ok, body, len);
        save_as("template", "template-messages", ok, body, len);
        break;
    case KVT_API_RESPONSES:
        save("api_responses", ok, body, len);
        save_as("template", "template-responses", ok, body, len);
        break;
    }
    return rc;
}

int fuzz_capture_parse(kvt_request *out, kvt_api api, const char *body, size_t len, const kvt_model *m, int *status)
{
    return save_body(api, body, len, kvt_request_parse(out, api, body, len, m, status));
}

int fuzz_capture_parse_opts(kvt_request *out, kvt_api api, const char *body, size_t len, const kvt_model *m,
                            const kvt_parse_opts *opts, int *status)
{
    return save_body(api, body, len, kvt_request_parse_opts(out, api, body, len, m, opts, status));
}

int fuzz_capture_tool_calls_parse(const char *text, size_t len, kvt_tool_call **calls, size_t *n, size_t *text_end)
{
    int rc = kvt_tool_calls_parse(text, len, calls, n, text_end);
    save("toolcall", rc == KVT_OK && n && *n > 0, text, len);
    return rc;
}
