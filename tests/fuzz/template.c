/* template: the chat templates' append-only property, the one prefix
 * caching rests on (src/serve/api.h, docs/API.md): a conversation resent with
 * more turns renders to a string that extends the earlier rendering.
 *
 * The input is a request body. For each api whose message list it has
 * (chat "messages", Anthropic "messages", Responses "input") and for which
 * it parses, the body is cut at each point where an assistant turn follows
 * a user turn or tool results (the point where the model's reply began)
 * with no system or developer message after it (those are hoisted to the
 * front); the body with the list cut there must parse too, and its prompt
 * must be a prefix of the whole body's prompt, in bytes with both templates
 * (deepseek on ds4-tiny, plain) and, for deepseek, in token ids as the
 * server tokenizes them. Rendering itself runs inside every parse, so the
 * api_chat, api_messages and api_responses targets cover its memory safety
 * on every body; this target checks what the rendering means. */
#include "fuzz.h"
#include "arch/model.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CUTS 8

enum role { R_OTHER, R_USER, R_TOOL, R_ASSISTANT, R_SYSTEM };

static bool is(const json_t *v, const char *s) { return json_is_string(v) && !strcmp(json_string_value(v), s); }

static enum role role_of(kvt_api api, const json_t *item)
{
    const json_t *role = json_object_get(item, "role"), *type = json_object_get(item, "type");
    if (api == KVT_API_RESPONSES && type && !is(type, "message")) {
        if (is(type, "function_call")) return R_ASSISTANT;
        if (is(type, "function_call_output")) return R_TOOL;
        return R_OTHER;
    }
    if (is(role, "user")) return R_USER;
    if (is(role, "assistant")) return R_ASSISTANT;
    if (is(role, "tool") || is(role, "function")) return R_TOOL;
    if (is(role, "system") || is(role, "developer")) return R_SYSTEM;
    return R_OTHER;
}

static bool parse_body(kvt_request *r, kvt_api api, const char *body, size_t len, const kvt_model *m)
{
    int st;
    return kvt_request_parse(r, api, body, len, m, &st) == KVT_OK;
}

static void check_cut(kvt_api api, json_t *root, const char *field, json_t *items, size_t k, const kvt_model *m,
                      const kvt_request *whole)
{
    json_t *cut = json_array();
    for (size_t i = 0; i < k; i++) json_array_append(cut, json_array_get(items, i));
    json_t *copy = json_copy(root);
    json_object_set_new(copy, field, cut);
    char *body = json_dumps(copy, JSON_COMPACT);
    json_decref(copy);
    kvt_request r;
    if (body && parse_body(&r, api, body, strlen(body), m)) {
        bool text = r.prompt_len <= whole->prompt_len && !memcmp(r.prompt, whole->prompt, r.prompt_len);
        FUZZ_CHECK(text, "api %d, %s template: the prompt cut before item %zu is not a prefix of the whole one",
                   (int)api, kvt_template_name(m), k);
        if (text && m && r.prompt_has_bos) {
            size_t na = 0, nb = 0;
            int32_t *a = fuzz_prompt_tokens(m, &r, &na), *b = fuzz_prompt_tokens(m, whole, &nb);
            if (a && b)
                FUZZ_CHECK(na <= nb && !memcmp(a, b, na * sizeof *a),
                           "api %d: the tokens of the prompt cut before item %zu are not a prefix of the whole one's",
                           (int)api, k);
            free(a);
            free(b);
        }
        kvt_request_free(&r);
    }
    free(body);
}

int fuzz_template(const uint8_t *data, size_t size)
{
    const kvt_model *models[2] = {fuzz_ds4(1), NULL};
    json_t *root = json_loadb((const char *)data, size, 0, NULL);
    if (!json_is_object(root)) { json_decref(root); return 0; }
    static const kvt_api apis[] = {KVT_API_CHAT, KVT_API_MESSAGES, KVT_API_RESPONSES};
    for (size_t a = 0; a < sizeof apis / sizeof *apis; a++) {
        kvt_api api = apis[a];
        const char *field = api == KVT_API_RESPONSES ? "input" : "messages";
        json_t *items = json_object_get(root, field);
        if (!json_is_array(items)) continue;
        size_t n = json_array_size(items), cuts[MAX_CUTS], n_cuts = 0;
        /* cut points, the last ones first (they hold the most) */
        bool system_after = false;
        for (size_t k = n; k-- > 1 && n_cuts < MAX_CUTS;) {
            enum role here = role_of(api, json_array_get(items, k)), before = role_of(api, json_array_get(items, k - 1));
            if (here == R_SYSTEM || here == R_OTHER) system_after |= here == R_SYSTEM;
            if (!system_after && here == R_ASSISTANT && (before == R_USER || before == R_TOOL)) cuts[n_cuts++] = k;
        }
        if (!n_cuts) continue;
        for (int k = 0; k < 2; k++) {
            kvt_request whole;
            if (!parse_body(&whole, api, (const char *)data, size, models[k])) continue;
            for (size_t c = 0; c < n_cuts; c++) check_cut(api, root, field, items, cuts[c], models[k], &whole);
            kvt_request_free(&whole);
        }
    }
    json_decref(root);
    return 0;
}
