/* The chat templates' parts that need no reference renderer
 * (tests/test_template.c compares the renderings):
 *
 *   template_units_pick              the choice by template text, by architecture,
 *                              the fallback, and by name
 *   template_units_pick_bundle       every template of llama.cpp's models/templates
 *                              (the peer's source bundle): the Llama 3.x, Qwen
 *                              2.5, Qwen 3, Qwen 3.5, Gemma 2 and Gemma 4 files
 *                              pick their rows,
 *                              every other file none (the fallback), so no
 *                              other family is rendered in a layout not its own
 *   template_units_tool_calls_qwen   <tool_call>JSON</tool_call>: single, parallel
 *                              with nested arguments, arguments as a string,
 *                              raw spans; malformed, unfinished, non-UTF-8
 *                              and foreign input stays text; the streaming
 *                              hold-back
 *   template_units_tool_calls_llama3 Llama 3.1's JSON calls: alone, after text,
 *                              after <|python_tag|>, parallel, the OpenAI
 *                              wrapper, "arguments"; JSON inside prose, code,
 *                              malformed objects stay text; the hold-back;
 *                              kvtier's own rendering read back
 *   template_units_tool_calls_qwen35 Qwen 3.5's XML calls: values as JSON, Python's
 *                              constants or strings, kvtier's rendering read
 *                              back; malformed and unfinished input is text
 *   template_units_tool_calls_typed  Qwen 3.5's bare-text values typed by the
 *                              request's schema: string, integer, number,
 *                              boolean, null, object, array, type lists,
 *                              enum, const, anyOf, oneOf, $ref, nested
 *                              properties and items; no schema as before;
 *                              hostile schemas end quickly
 *   template_units_tool_calls_gemma4 Gemma 4's <|tool_call>call:NAME{...} in its own
 *                              notation, kvtier's rendering read back;
 *                              malformed and unfinished input is text
 *   template_units_tool_calls_none   gemma3 reads no calls
 *   template_units_think_parts       Qwen 3's reasoning split: the opener the model
 *                              writes, the newlines the template writes, and
 *                              every prefix of a reply consistent with the
 *                              whole (what streaming relies on)
 *   template_units_tokens            the turn markers and end-of-turn tokens the
 *                              server uses, with llama.cpp's Llama 3 and Qwen 2
 *                              vocabularies (from the bundle; skipped without
 *                              it), the built-in one, and one without them */
#include "fixture.h"
#include "test.h"
#include "serve/api.h"
#include "chat/template.h"
#include "base/util.h"

#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define BUNDLE FX_PEER_DIR "/node_modules/node-llama-cpp/llama/gitRelease.bundle"

static const kvt_template *named(const char *n)
{
    const kvt_template *t = kvt_template_named(n);
    if (!t) printf("      no template %s\n", n);
    return t;
}

TEST(template_units_pick)
{
    CHECK(!strcmp(kvt_template_pick(NULL, NULL)->name, "plain"));
    CHECK(!strcmp(kvt_template_pick(NULL, "deepseek4")->name, "deepseek"));
    CHECK(!strcmp(kvt_template_pick(NULL, "qwen2")->name, "qwen2.5"));
    CHECK(!strcmp(kvt_template_pick(NULL, "qwen3")->name, "qwen3"));
    CHECK(!strcmp(kvt_template_pick(NULL, "qwen3moe")->name, "qwen3"));
    CHECK(!strcmp(kvt_template_pick(NULL, "gemma3")->name, "gemma3"));
    CHECK(!strcmp(kvt_template_pick(NULL, "qwen35")->name, "qwen3.5"));
    CHECK(!strcmp(kvt_template_pick(NULL, "gemma4")->name, "gemma4"));
    /* llama's architecture spans many layouts: only the text picks llama3 */
    CHECK(!strcmp(kvt_template_pick(NULL, "llama")->name, "plain"));
    CHECK(!strcmp(kvt_template_pick("{{ messages }}", "llama")->name, "plain"));
    /* the text first, then the architecture */
    const char *q3 = "<|im_start|>... <args-json-object> ... reasoning_content.strip('\\n') ... enable_thinking";
    CHECK(!strcmp(kvt_template_pick(q3, "gemma3")->name, "qwen3"));
    CHECK(!strcmp(kvt_template_pick("{{ messages }}", "qwen2")->name, "qwen2.5"));
    /* every mark is needed: a ChatML template without Qwen's texts is no Qwen one */
    CHECK(!strcmp(kvt_template_pick("<|im_start|>system\n<args-json-object>", NULL)->name, "plain"));
    CHECK(!strcmp(kvt_template_pick("<|im_start|> You are Qwen, created by Alibaba Cloud. <args-json-object>",
                                    NULL)->name, "qwen2.5"));
    CHECK(!strcmp(kvt_template_pick("<start_of_turn>user ... <end_of_turn>", NULL)->name, "gemma3"));
    CHECK(!strcmp(kvt_template_pick("<|start_header_id|><|eot_id|>Cutting Knowledge Date please respond with a "
                                    "JSON for a function call", NULL)->name, "llama3"));
    CHECK(kvt_template_named("qwen3") && !strcmp(kvt_template_named("qwen3")->name, "qwen3"));
    CHECK(!kvt_template_named("nope") && !kvt_template_named(NULL));
    CHECK(!strcmp(kvt_template_name(NULL), "plain"));
    /* the last row is the fallback */
    CHECK(!strcmp(kvt_templates[kvt_n_templates - 1].name, "plain"));
}

TEST(template_units_pick_bundle)
{
    const char *why = fx_peer_skip_reason();
    if (why) SKIP("%s", why);
    if (system("command -v git >/dev/null 2>&1 && command -v tar >/dev/null 2>&1") != 0) SKIP("no git or tar");
    double secs;
    if (access(BUNDLE, R_OK) != 0 && (!fx_peer_ensure(&secs) || access(BUNDLE, R_OK) != 0))
        SKIP("no " BUNDLE " (offline?)");
    char dir[] = "/tmp/kvt-pick-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir));
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "git clone -q --bare %s %s/r.git && git --git-dir %s/r.git archive HEAD models/templates | tar -x -C %s",
             BUNDLE, dir, dir, dir);
    int st = system(cmd);
    snprintf(cmd, sizeof cmd, "%s/models/templates", dir);
    DIR *d = st == 0 ? opendir(cmd) : NULL;
    static const struct { const char *file, *name; } want[] = {
        {"meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"}, {"meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3"},
        {"meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3"}, {"Qwen-Qwen2.5-7B-Instruct.jinja", "qwen2.5"},
        {"Qwen-Qwen3-0.6B.jinja", "qwen3"}, {"Qwen3.5-4B.jinja", "qwen3.5"}, {"google-gemma-2-2b-it.jinja", "gemma3"},
        {"google-gemma-4-31B-it.jinja", "gemma4"},
    };
    size_t n = 0, n_found = 0, n_plain = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        size_t nl = strlen(e->d_name);
        if (nl < 6 || strcmp(e->d_name + nl - 6, ".jinja")) continue;
        char path[1300];
        snprintf(path, sizeof path, "%s/%s", cmd, e->d_name);
        size_t len = 0;
        char *src = kvt_test_read_file(path, &len);
        if (!src) continue;
        const char *got = kvt_template_pick(src, NULL)->name, *exp = "plain";
        for (size_t i = 0; i < sizeof want / sizeof *want; i++)
            if (!strcmp(want[i].file, e->d_name)) exp = want[i].name, n_found++;
        CHECKF(!strcmp(got, exp), "%s picks %s, expected %s", e->d_name, got, exp);
        n++;
        n_plain += !strcmp(got, "plain");
        free(src);
    }
    if (d) closedir(d);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) printf("      could not remove %s\n", dir);
    printf("    template_units_pick_bundle: %zu templates, %zu picked by their text, %zu to the fallback\n", n,
           n - n_plain, n_plain);
    CHECK(st == 0 && n > 50 && n_found == sizeof want / sizeof *want);
}

/* ---- tool calls ---- */

typedef int (*parse_fn)(const char *, size_t, const json_t *, kvt_tool_call **, size_t *, size_t *);

/* Parse text: *n calls, the text's end; calls freed unless kept. */
static kvt_tool_call *parse(parse_fn f, const char *text, size_t *n, size_t *te)
{
    kvt_tool_call *c = NULL;
    *n = 0;
    *te = 0;
    if (f(text, strlen(text), NULL, &c, n, te) != KVT_OK) printf("      parse failed: %s\n", kvt_errmsg());
    return c;
}

static bool call_is(const kvt_tool_call *c, const char *name, const char *args)
{
    bool ok = c && !strcmp(c->name, name) && !strcmp(c->arguments, args) && c->valid && !strncmp(c->id, "call_", 5);
    if (!ok && c) printf("      call %s %s\n", c->name, c->arguments);
    return ok;
}

/* Text that is no call: all of it text, no calls. */
static bool all_text(parse_fn f, const char *text)
{
    size_t n, te;
    kvt_tool_call *c = parse(f, text, &n, &te);
    kvt_tool_calls_free(c, n);
    if (n || te != strlen(text)) printf("      '%s': %zu calls, text to %zu\n", kvt_test_esc(text, strlen(text)), n, te);
    return !n && te == strlen(text);
}

TEST(template_units_tool_calls_qwen)
{
    const kvt_template *t = named("qwen3");
    CHECK(t && t->tool_calls == named("qwen2.5")->tool_calls);
    parse_fn f = t->tool_calls;
    size_t n, te;
    const char *one = "Sure.\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a.c\"}}\n</tool_call>";
    kvt_tool_call *c = parse(f, one, &n, &te);
    CHECK(n == 1 && te == 5 && call_is(&c[0], "read_file", "{\"path\":\"a.c\"}"));
    CHECK(c[0].raw_off == 5 && c[0].raw_off + c[0].raw_len == strlen(one));
    kvt_tool_calls_free(c, n);

    /* parallel, nested arguments in their order, arguments as a JSON string */
    const char *two = "<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"cmd\": \"wc -l\", \"env\": {\"Z\": [1, 2.5, "
                      "null, true], \"A\": {\"b\": \"\\u00e9\"}}}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", "
                      "\"arguments\": \"{\\\"x\\\": 1}\"}\n</tool_call>\n";
    c = parse(f, two, &n, &te);
    CHECK(n == 2 && te == 0);
    CHECK(n == 2 && call_is(&c[0], "bash", "{\"cmd\":\"wc -l\",\"env\":{\"Z\":[1,2.5,null,true],\"A\":{\"b\":\"\xc3\xa9\"}}}"));
    CHECK(n == 2 && call_is(&c[1], "f", "{\"x\":1}"));
    CHECK(n == 2 && c[1].raw_off == c[0].raw_off + c[0].raw_len && c[1].raw_off + c[1].raw_len == strlen(two));
    kvt_tool_calls_free(c, n);

    /* a good call, then a malformed one: the good one only */
    c = parse(f, "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call><tool_call>{oops}</tool_call>", &n, &te);
    CHECK(n == 1 && call_is(&c[0], "a", "{}"));
    kvt_tool_calls_free(c, n);
    /* no arguments: {} */
    c = parse(f, "<tool_call>{\"name\":\"a\"}</tool_call>", &n, &te);
    CHECK(n == 1 && call_is(&c[0], "a", "{}"));
    kvt_tool_calls_free(c, n);

    /* malformed input stays text */
    CHECK(all_text(f, ""));
    CHECK(all_text(f, "plain text"));
    CHECK(all_text(f, "<tool_call>\n{not json}\n</tool_call>"));
    CHECK(all_text(f, "<tool_call>\n{\"name\": \"f\", \"argu"));          /* unfinished (max_tokens) */
    CHECK(all_text(f, "<tool_call>{\"name\": \"f\"</tool_call>"));         /* cut JSON */
    CHECK(all_text(f, "<tool_call>{\"arguments\": {}}</tool_call>"));     /* no name */
    CHECK(all_text(f, "<tool_call>{\"name\": \"\"}</tool_call>"));         /* empty name */
    CHECK(all_text(f, "<tool_call>{\"name\": 3}</tool_call>"));            /* name not a string */
    CHECK(all_text(f, "<tool_call>[1, 2]</tool_call>"));                   /* not an object */
    CHECK(all_text(f, "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>"));
    CHECK(all_text(f, "<tool_call>{\"name\": \"f\", \"arguments\": \"not json\"}</tool_call>"));
    CHECK(all_text(f, "<tool_call>{\"name\": \"\xff\"}</tool_call>"));     /* not UTF-8 */
    CHECK(all_text(f, "<tool_call><tool_call></tool_call></tool_call>"));
    CHECK(all_text(f, "</tool_call>{\"name\": \"f\"}"));
    CHECK(all_text(f, "<\xef\xbd\x9c" "DSML\xef\xbd\x9ctool_calls>")); /* another family's markup */
    CHECK(f(NULL, 0, NULL, &c, &n, &te) == KVT_OK && n == 0 && te == 0);
    CHECK(f(NULL, 3, NULL, &c, &n, &te) == KVT_EINVAL);

    /* streaming: text up to a call's opener, or a partial one, without the
     * whitespace before it */
    size_t (*tl)(const char *, size_t) = t->tool_calls_text_len;
    CHECK(tl("Hi there", 8) == 8);
    CHECK(tl("Hi \n<tool_call>\n{", 17) == 2);
    CHECK(tl("Hi <tool_c", 10) == 2);
    CHECK(tl("Hi <tool_x", 10) == 10);
    CHECK(tl("Hi  ", 4) == 2);
    CHECK(tl(NULL, 0) == 0);
}

TEST(template_units_tool_calls_llama3)
{
    const kvt_template *t = named("llama3");
    CHECK(t);
    parse_fn f = t->tool_calls;
    size_t n, te;
    const char *one = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
    kvt_tool_call *c = parse(f, one, &n, &te);
    CHECK(n == 1 && te == 0 && call_is(&c[0], "get_weather", "{\"city\":\"Paris\"}"));
    CHECK(n == 1 && c[0].raw_off == 0 && c[0].raw_len == strlen(one));
    kvt_tool_calls_free(c, n);
    c = parse(f, "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}", &n, &te);
    CHECK(n == 1 && te == 0 && call_is(&c[0], "f", "{}"));
    kvt_tool_calls_free(c, n);
    c = parse(f, "Let me check.\n\n{\"name\": \"f\", \"parameters\": {\"a\": 1}}\n", &n, &te);
    CHECK(n == 1 && te == 13 && call_is(&c[0], "f", "{\"a\":1}"));
    kvt_tool_calls_free(c, n);
    /* parallel: whitespace, ";" or "," between; nested arguments */
    c = parse(f, "{\"name\":\"a\",\"parameters\":{}}\n{\"name\":\"b\",\"parameters\":{\"x\":{\"y\":[1,{\"z\":null}]}}}; "
                 "{\"name\":\"c\",\"parameters\":{}} , {\"name\":\"d\",\"parameters\":{}}", &n, &te);
    CHECK(n == 4 && te == 0 && call_is(&c[1], "b", "{\"x\":{\"y\":[1,{\"z\":null}]}}") && call_is(&c[3], "d", "{}"));
    kvt_tool_calls_free(c, n);
    /* the OpenAI wrapper, a leading "type", "arguments" */
    c = parse(f, "{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"a\": 1}}} "
                 "{\"type\": \"function\", \"name\": \"g\", \"parameters\": {}} {\"name\": \"h\", \"arguments\": {\"b\": 2}}",
              &n, &te);
    CHECK(n == 3 && call_is(&c[0], "f", "{\"a\":1}") && call_is(&c[1], "g", "{}") && call_is(&c[2], "h", "{\"b\":2}"));
    kvt_tool_calls_free(c, n);

    /* kvtier's own rendering of parallel calls reads back */
    kvt_wbuf b = {0};
    kvt_chat cc = {0};
    kvt_turn turns[2] = {{.role = KVT_ROLE_USER, .text = "go", .len = 2}, {.role = KVT_ROLE_ASSISTANT, .text = "", .len = 0}};
    json_t *a1 = json_pack("{s:[i,i]}", "p", 1, 2), *a2 = json_object();
    kvt_turn_call calls[2] = {{.name = "a", .args = "{\"p\":[1,2]}", .args_len = 11, .args_json = true, .argv = a1},
                              {.name = "b", .args = "{}", .args_len = 2, .args_json = true, .argv = a2}};
    turns[1].calls = calls;
    turns[1].n_calls = 2;
    cc.t = turns;
    cc.n = 2;
    CHECK(t->render(&b, &cc, NULL, NULL));
    const char *hdr = "<|start_header_id|>assistant<|end_header_id|>\n\n";
    const char *p = b.p ? memmem(b.p, b.len, hdr, strlen(hdr)) : NULL;
    const char *e = p ? memmem(p, b.len - (size_t)(p - (const char *)b.p), "<|eot_id|>", 10) : NULL;
    CHECK(p && e);
    if (p && e) {
        p += strlen(hdr);
        char *reply = strndup(p, (size_t)(e - p));
        c = parse(f, reply, &n, &te);
        CHECK(n == 2 && call_is(&c[0], "a", "{\"p\":[1,2]}") && call_is(&c[1], "b", "{}"));
        kvt_tool_calls_free(c, n);
        free(reply);
    }
    kvt_wbuf_free(&b);
    json_decref(a1);
    json_decref(a2);

    /* JSON in prose, code, malformed or foreign objects stay text */
    CHECK(all_text(f, "Use {\"name\": \"x\", \"parameters\": {}} like this."));
    CHECK(all_text(f, "int main() { return 0; }"));
    CHECK(all_text(f, "{\"name\": \"f\", \"parameters\": {\"a\": }"));
    CHECK(all_text(f, "{\"name\": \"f\", \"parameters\": {\"a\": 1}"));  /* unfinished */
    CHECK(all_text(f, "{\"name\": 1, \"parameters\": {}}"));
    CHECK(all_text(f, "{\"name\": \"\", \"parameters\": {}}"));
    CHECK(all_text(f, "{\"parameters\": {}}"));
    CHECK(all_text(f, "{\"name\": \"f\"}"));                            /* no arguments */
    CHECK(all_text(f, "{\"name\": \"f\", \"parameters\": [1]}"));
    CHECK(all_text(f, "{\"type\": \"other\", \"name\": \"f\", \"parameters\": {}}"));
    CHECK(all_text(f, "{\"name\": \"f\", \"parameters\": {}} trailing"));
    CHECK(all_text(f, "{\"name\": \"f\", \"parameters\": {}};"));
    CHECK(all_text(f, "{\"name\": \"\xff\", \"parameters\": {}}"));
    CHECK(all_text(f, "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"));
    CHECK(all_text(f, "{{{{{{{{"));
    CHECK(f(NULL, 0, NULL, &c, &n, &te) == KVT_OK && n == 0 && te == 0);
    CHECK(f(NULL, 3, NULL, &c, &n, &te) == KVT_EINVAL);

    size_t (*tl)(const char *, size_t) = t->tool_calls_text_len;
    CHECK(tl("Hello", 5) == 5);
    CHECK(tl("Hello {\"na", 10) == 5);
    CHECK(tl("Hello {x", 8) == 8);                 /* no call can begin so */
    CHECK(tl("Hello {", 7) == 5);
    CHECK(tl("Hello <|python", 14) == 5);
    CHECK(tl("a {\"k\": 1} b", 12) == 12);         /* an object followed by text is text */
    CHECK(tl("a {\"name\": \"f\", \"parameters\": {}}", 33) == 1);
    CHECK(tl(NULL, 0) == 0);
}

TEST(template_units_tool_calls_qwen35)
{
    const kvt_template *t = named("qwen3.5");
    CHECK(t);
    parse_fn f = t->tool_calls;
    size_t n, te;
    const char *one = "I will read it.\n\n<tool_call>\n<function=read_file>\n<parameter=path>\na.c\n</parameter>\n"
                      "<parameter=limit>\n10\n</parameter>\n</function>\n</tool_call>";
    kvt_tool_call *c = parse(f, one, &n, &te);
    CHECK(n == 1 && te == 15 && call_is(&c[0], "read_file", "{\"path\":\"a.c\",\"limit\":10}"));
    CHECK(n == 1 && c[0].raw_off == 15 && c[0].raw_off + c[0].raw_len == strlen(one));
    kvt_tool_calls_free(c, n);
    /* parallel; a value over lines, JSON, Python's constants */
    c = parse(f, "<tool_call>\n<function=bash>\n<parameter=cmd>\nline 1\nline 2\n</parameter>\n<parameter=env>\n"
                 "{\"A\": [1, 2.5, null]}\n</parameter>\n<parameter=ok>\nTrue\n</parameter>\n</function>\n</tool_call>\n"
                 "<tool_call>\n<function=f>\n</function>\n</tool_call>", &n, &te);
    CHECK(n == 2 && te == 0 && call_is(&c[0], "bash", "{\"cmd\":\"line 1\\nline 2\",\"env\":{\"A\":[1,2.5,null]},\"ok\":true}"));
    CHECK(n == 2 && call_is(&c[1], "f", "{}"));
    kvt_tool_calls_free(c, n);

    /* kvtier's rendering of a call reads back */
    kvt_wbuf b = {0};
    json_t *a = json_pack("{s:s, s:i, s:b, s:n, s:f, s:{s:[i]}}", "s", "x\ny", "i", 3, "b", 1, "z", "r", 2.5, "o", "k", 1);
    kvt_turn_call call = {.name = "g", .args = "", .args_len = 0, .args_json = true, .argv = a};
    kvt_turn turns[2] = {{.role = KVT_ROLE_USER, .text = "go", .len = 2},
                         {.role = KVT_ROLE_ASSISTANT, .text = "", .len = 0, .calls = &call, .n_calls = 1}};
    kvt_chat cc = {.t = turns, .n = 2, .thinking = true};
    CHECK(t->render(&b, &cc, NULL, NULL));
    const char *p = b.p ? memmem(b.p, b.len, "<tool_call>", 11) : NULL;
    const char *e = p ? memmem(p, b.len - (size_t)(p - (const char *)b.p), "<|im_end|>", 10) : NULL;
    CHECK(p && e);
    if (p && e) {
        char *reply = strndup(p, (size_t)(e - p));
        c = parse(f, reply, &n, &te);
        CHECK(n == 1 && call_is(&c[0], "g", "{\"s\":\"x\\ny\",\"i\":3,\"b\":true,\"z\":null,\"r\":2.5,\"o\":{\"k\":[1]}}"));
        kvt_tool_calls_free(c, n);
        free(reply);
    }
    kvt_wbuf_free(&b);
    json_decref(a);

    CHECK(all_text(f, "plain"));
    CHECK(all_text(f, "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n"));     /* unfinished */
    CHECK(all_text(f, "<tool_call>\n<function=f>\n<parameter=a>\n1\n"));
    CHECK(all_text(f, "<tool_call>\n<function=>\n</function>\n</tool_call>"));               /* no name */
    CHECK(all_text(f, "<tool_call>\n<function=a b>\n</function>\n</tool_call>"));
    CHECK(all_text(f, "<tool_call>\n<function=f>\n<param>x</param>\n</function>\n</tool_call>"));
    CHECK(all_text(f, "<tool_call>\n<function=\xff>\n</function>\n</tool_call>"));
    CHECK(all_text(f, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>")); /* Qwen 3's form */
    CHECK(f(NULL, 3, NULL, &c, &n, &te) == KVT_EINVAL);
    CHECK(t->tool_calls_text_len("Hi <tool_ca", 11) == 2);
}

/* The arguments of reply under the function schema params (JSON text; NULL:
 * no tools), compact and in the order written; "" when no call is read. */
static char *typed_args(const char *reply, const char *params)
{
    static char out[1024];
    json_t *fns = params ? json_pack("[{s:s, s:o}]", "name", "f", "parameters", json_loads(params, 0, NULL)) : NULL;
    kvt_tool_call *c = NULL;
    size_t n = 0, te = 0;
    out[0] = 0;
    if (kvt_template_named("qwen3.5")->tool_calls(reply, strlen(reply), fns, &c, &n, &te) == KVT_OK && n == 1)
        snprintf(out, sizeof out, "%s", c[0].arguments);
    kvt_tool_calls_free(c, n);
    json_decref(fns);
    return out;
}

/* One reply's arguments under a schema, against what they must be. */
static bool typed_is(const char *reply, const char *params, const char *want)
{
    const char *got = typed_args(reply, params);
    if (strcmp(got, want)) printf("      under %s\n        got  %s\n        want %s\n", params ? params : "no schema", got, want);
    return !strcmp(got, want);
}

#define Q35_CALL(params) "Let me.\n\n<tool_call>\n<function=f>\n" params "</function>\n</tool_call>"
#define Q35_P(k, v) "<parameter=" k ">\n" v "\n</parameter>\n"

/* Qwen 3.5's XML calls write every value as bare text: the request's schema
 * types it. The same reply under schemas that type its parameters
 * differently gives differently typed arguments; a parameter the schema
 * gives no type is read as without schemas; hostile schemas (cycles, deep
 * nesting, huge enums, exponential anyOf) cost bounded time. Control: the
 * reply without schemas types "10" as a number, which a string parameter's
 * client rejects. */
TEST(template_units_tool_calls_typed)
{
    const char *reply = Q35_CALL(Q35_P("a", "10") Q35_P("b", "true") Q35_P("c", "null") Q35_P("d", "{\"x\": 1}")
                                     Q35_P("e", "[1, 2]") Q35_P("g", "1.50") Q35_P("h", "True") Q35_P("u", "7"));
    /* without schemas: as it reads (the control) */
    CHECK(typed_is(reply, NULL, "{\"a\":10,\"b\":true,\"c\":null,\"d\":{\"x\":1},\"e\":[1,2],\"g\":1.5,\"h\":true,\"u\":7}"));
    /* every parameter a string: the text as written; u unknown: as before */
    CHECK(typed_is(reply,
                   "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"},\"b\":{\"type\":\"string\"},"
                   "\"c\":{\"type\":\"string\"},\"d\":{\"type\":\"string\"},\"e\":{\"type\":\"string\"},"
                   "\"g\":{\"type\":\"string\"},\"h\":{\"type\":\"string\"}}}",
                   "{\"a\":\"10\",\"b\":\"true\",\"c\":\"null\",\"d\":\"{\\\"x\\\": 1}\",\"e\":\"[1, 2]\",\"g\":\"1.50\","
                   "\"h\":\"True\",\"u\":7}"));
    /* each its own type; a text that is not of the type stays a string */
    CHECK(typed_is(reply,
                   "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"boolean\"},"
                   "\"c\":{\"type\":\"null\"},\"d\":{\"type\":\"object\"},\"e\":{\"type\":\"array\"},"
                   "\"g\":{\"type\":\"integer\"},\"h\":{\"type\":\"boolean\"},\"u\":{\"type\":\"boolean\"}}}",
                   "{\"a\":10,\"b\":true,\"c\":null,\"d\":{\"x\":1},\"e\":[1,2],\"g\":\"1.50\",\"h\":true,\"u\":\"7\"}"));
    /* number; a type list; enum by its values' types; const */
    CHECK(typed_is(reply,
                   "{\"properties\":{\"a\":{\"type\":[\"null\",\"string\"]},\"b\":{\"enum\":[\"true\",\"false\"]},"
                   "\"c\":{\"type\":[\"integer\",\"null\"]},\"g\":{\"type\":\"number\"},\"e\":{\"enum\":[[1,2],\"x\"]},"
                   "\"u\":{\"const\":\"7\"},\"h\":{\"enum\":[1,2]}}}",
                   "{\"a\":\"10\",\"b\":\"true\",\"c\":null,\"d\":{\"x\":1},\"e\":[1,2],\"g\":1.5,\"h\":\"True\",\"u\":\"7\"}"));
    /* anyOf and oneOf: the first alternative the text parses as, strings
     * last; $ref into $defs and definitions; nested properties and items */
    CHECK(typed_is(reply,
                   "{\"$defs\":{\"S\":{\"type\":\"string\"},\"N\":{\"$ref\":\"#/definitions/I\"}},"
                   "\"definitions\":{\"I\":{\"type\":\"integer\"}},\"properties\":{"
                   "\"a\":{\"anyOf\":[{\"$ref\":\"#/$defs/S\"},{\"$ref\":\"#/$defs/N\"}]},"
                   "\"b\":{\"oneOf\":[{\"type\":\"string\"},{\"type\":\"integer\"}]},"
                   "\"c\":{\"$ref\":\"#/$defs/S\"},"
                   "\"d\":{\"type\":\"object\",\"properties\":{\"x\":{\"$ref\":\"#/$defs/S\"}}},"
                   "\"e\":{\"items\":{\"type\":\"string\"}},"
                   "\"g\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"number\"}]},"
                   "\"h\":{\"anyOf\":[{\"type\":\"boolean\"},{\"type\":\"null\"}]}}}",
                   "{\"a\":10,\"b\":\"true\",\"c\":\"null\",\"d\":{\"x\":\"1\"},\"e\":[\"1\",\"2\"],\"g\":1.5,\"h\":true,"
                   "\"u\":7}"));
    /* a JSON string inside an object whose schema says integer is read as one */
    CHECK(typed_is(Q35_CALL(Q35_P("d", "{\"n\": \"5\", \"s\": \"5\", \"m\": [\"1\", true]}")),
                   "{\"properties\":{\"d\":{\"properties\":{\"n\":{\"type\":\"integer\"},\"s\":{\"type\":\"string\"},"
                   "\"m\":{\"type\":\"array\",\"items\":{\"type\":[\"number\",\"string\"]}}}}}}",
                   "{\"d\":{\"n\":5,\"s\":\"5\",\"m\":[\"1\",\"true\"]}}"));
    /* a string keeps its text exactly, surrounding spaces and inner newlines */
    CHECK(typed_is(Q35_CALL(Q35_P("s", " 10 \nx")), "{\"properties\":{\"s\":{\"type\":\"string\"}}}",
                   "{\"s\":\" 10 \\nx\"}"));
    /* a function the request does not define, a schema without a type: as without schemas */
    CHECK(typed_is(reply, "{\"properties\":{\"a\":{\"description\":\"x\"},\"b\":{}}}",
                   "{\"a\":10,\"b\":true,\"c\":null,\"d\":{\"x\":1},\"e\":[1,2],\"g\":1.5,\"h\":true,\"u\":7}"));

    /* hostile schemas: a $ref cycle, a self-referencing anyOf (exponential
     * without a bound), a schema nested 5,000 deep, an enum of 200,000
     * values: each ends, quickly, typing what it can */
    double t0 = kvt_now();
    CHECK(typed_is(Q35_CALL(Q35_P("a", "10")),
                   "{\"$defs\":{\"A\":{\"$ref\":\"#/$defs/B\"},\"B\":{\"$ref\":\"#/$defs/A\"}},"
                   "\"properties\":{\"a\":{\"$ref\":\"#/$defs/A\"}}}", "{\"a\":10}"));
    CHECK(typed_is(Q35_CALL(Q35_P("a", "x")),
                   "{\"$defs\":{\"A\":{\"anyOf\":[{\"$ref\":\"#/$defs/A\"},{\"$ref\":\"#/$defs/A\"},{\"type\":\"integer\"}]}},"
                   "\"properties\":{\"a\":{\"$ref\":\"#/$defs/A\"}}}", "{\"a\":\"x\"}"));
    CHECK(typed_is(Q35_CALL(Q35_P("a", "x")), "{\"properties\":{\"a\":{\"$ref\":\"#\"}}}", "{\"a\":\"x\"}"));
    json_t *deep = json_pack("{s:s}", "type", "string"), *big = json_array();
    for (int i = 0; i < 5000; i++) deep = json_pack("{s:[o]}", "anyOf", deep);
    for (int i = 0; i < 200000; i++) json_array_append_new(big, json_integer(i));
    json_t *fns = json_pack("[{s:s, s:{s:{s:o, s:{s:o}, s:{s:O}}}}]", "name", "f", "parameters", "properties",
                            "a", deep, "b", "enum", big, "c", "items", deep);
    const char *hostile = Q35_CALL(Q35_P("a", "10") Q35_P("b", "199999") Q35_P("c", "[[[[1]]]]"));
    kvt_tool_call *c = NULL;
    size_t n = 0, te = 0;
    CHECK_OK(kvt_template_named("qwen3.5")->tool_calls(hostile, strlen(hostile), fns, &c, &n, &te));
    CHECK(n == 1);
    if (n) printf("    hostile schemas: %s\n", c[0].arguments);
    kvt_tool_calls_free(c, n);
    json_decref(fns);
    double secs = kvt_now() - t0;
    printf("    hostile schemas read in %.3f s\n", secs);
    CHECKF(secs < 10, "hostile schemas took %.1f s", secs); /* about 0.2 s alone on 2 cores */
}

TEST(template_units_tool_calls_gemma4)
{
    const kvt_template *t = named("gemma4");
    CHECK(t);
    parse_fn f = t->tool_calls;
    size_t n, te;
    const char *one = "Let me look.<|tool_call>call:read_file{limit:10,path:<|\"|>a.c<|\"|>}<tool_call|>";
    kvt_tool_call *c = parse(f, one, &n, &te);
    CHECK(n == 1 && te == 12 && call_is(&c[0], "read_file", "{\"limit\":10,\"path\":\"a.c\"}"));
    CHECK(n == 1 && c[0].raw_off == 12 && c[0].raw_off + c[0].raw_len == strlen(one));
    kvt_tool_calls_free(c, n);
    c = parse(f, "<|tool_call>call:bash{cmd:<|\"|>ls, -l: {x}<|\"|>,env:{LC_ALL:<|\"|>C<|\"|>,n:[1,2.5,None,true,-3e2]},"
                 "<|\"|>q k<|\"|>:false}<tool_call|>\n<|tool_call>call:f{}<tool_call|>", &n, &te);
    CHECK(n == 2 && te == 0 &&
          call_is(&c[0], "bash", "{\"cmd\":\"ls, -l: {x}\",\"env\":{\"LC_ALL\":\"C\",\"n\":[1,2.5,null,true,-300.0]},\"q k\":false}"));
    CHECK(n == 2 && call_is(&c[1], "f", "{}"));
    kvt_tool_calls_free(c, n);

    /* kvtier's rendering of a call reads back */
    kvt_wbuf b = {0};
    json_t *a = json_pack("{s:s, s:i, s:b, s:n, s:[s, {s:f}]}", "s", "x\ny", "i", 3, "b", 1, "z", "l", "v", "k", 2.5);
    kvt_turn_call call = {.name = "g", .args = "", .args_len = 0, .args_json = true, .argv = a};
    kvt_turn turns[2] = {{.role = KVT_ROLE_USER, .text = "go", .len = 2},
                         {.role = KVT_ROLE_ASSISTANT, .text = "", .len = 0, .calls = &call, .n_calls = 1}};
    kvt_chat cc = {.t = turns, .n = 2};
    CHECK(t->render(&b, &cc, NULL, NULL));
    const char *p = b.p ? memmem(b.p, b.len, "<|tool_call>", 12) : NULL;
    const char *e = p ? memmem(p, b.len - (size_t)(p - (const char *)b.p), "<tool_call|>", 12) : NULL;
    CHECK(p && e);
    if (p && e) {
        char *reply = strndup(p, (size_t)(e - p) + 12);
        c = parse(f, reply, &n, &te);
        CHECK(n == 1 && call_is(&c[0], "g", "{\"b\":true,\"i\":3,\"l\":[\"v\",{\"k\":2.5}],\"s\":\"x\\ny\",\"z\":null}"));
        kvt_tool_calls_free(c, n);
        free(reply);
    }
    kvt_wbuf_free(&b);
    json_decref(a);

    CHECK(all_text(f, "plain"));
    CHECK(all_text(f, "<|tool_call>call:f{a:1"));                          /* unfinished */
    CHECK(all_text(f, "<|tool_call>call:f{a:1}"));
    CHECK(all_text(f, "<|tool_call>call:{a:1}<tool_call|>"));              /* no name */
    CHECK(all_text(f, "<|tool_call>call:f{a:}<tool_call|>"));
    CHECK(all_text(f, "<|tool_call>call:f{a:<|\"|>x}<tool_call|>"));       /* an open string */
    CHECK(all_text(f, "<|tool_call>call:f{a:[1,}<tool_call|>"));
    CHECK(all_text(f, "<|tool_call>call:f{:1}<tool_call|>"));
    CHECK(all_text(f, "<|tool_call>call:f{a:1 2}<tool_call|>"));
    CHECK(all_text(f, "<|tool_call>call:f{a:<|\"|>\xff<|\"|>}<tool_call|>"));
    CHECK(all_text(f, "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"));
    char deep[300];
    size_t k = (size_t)snprintf(deep, sizeof deep, "<|tool_call>call:f{a:");
    for (int i = 0; i < 100; i++) deep[k++] = '[';
    strcpy(deep + k, "1<tool_call|>");
    CHECK(all_text(f, deep));                                             /* nesting bounded */
    CHECK(f(NULL, 3, NULL, &c, &n, &te) == KVT_EINVAL);
    CHECK(t->tool_calls_text_len("Hi <|tool_ca", 12) == 2);
    CHECK(t->tool_calls_text_len("Hi <|tool_call>call:", 20) == 2);

    /* its thinking reply: <|channel>thought\nREASONING<channel|>ANSWER */
    kvt_think th;
    const char *r = "<|channel>thought\nFirst, x.\n<channel|>It is 4.";
    CHECK(kvt_think_parts(t, r, strlen(r), false, &th) && th.rs == 18 && th.re == 27 && th.as == 38);
    CHECK(!kvt_think_parts(t, "<|channel>thou", 14, true, &th) && th.rs == 0 && th.re == 0);
    CHECK(!kvt_think_parts(t, "<|channel>thought\nx<chan", 24, true, &th) && th.rs == 18 && th.re == 19);
}

TEST(template_units_tool_calls_none)
{
    const kvt_template *t = named("gemma3");
    CHECK(t);
    CHECK(all_text(t->tool_calls, "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"));
    CHECK(all_text(t->tool_calls, "{\"name\": \"f\", \"parameters\": {}}"));
    CHECK(t->tool_calls_text_len("abc {", 5) == 5);
}

/* ---- thinking ---- */

static bool parts_are(const kvt_template *t, const char *text, bool partial, bool closed, size_t rs, size_t re,
                      size_t as)
{
    kvt_think k;
    bool got = kvt_think_parts(t, text, strlen(text), partial, &k);
    bool ok = got == closed && k.rs == rs && k.re == re && k.as == as;
    if (!ok) printf("      '%s'%s: %d [%zu, %zu) %zu\n", kvt_test_esc(text, strlen(text)), partial ? " (partial)" : "",
                    got, k.rs, k.re, k.as);
    return ok;
}

TEST(template_units_think_parts)
{
    const kvt_template *q = named("qwen3");
    CHECK(q && q->thinking && q->thinking_default && q->think_open);
    /* <think>\n R \n</think>\n\n A: the newlines are the template's */
    const char *whole = "<think>\nLet me see.\n</think>\n\nIt is 4.";
    CHECK(parts_are(q, whole, false, true, 8, 19, 30));
    CHECK(parts_are(q, whole, true, true, 8, 19, 30));
    CHECK(parts_are(q, "<think>\n\n</think>\n\nA", false, true, 9, 9, 19));
    CHECK(parts_are(q, "R</think>A", false, true, 0, 0, 0));          /* no opener: all answer */
    CHECK(parts_are(q, "Hi", true, true, 0, 0, 0));
    CHECK(parts_are(q, "<think>\nstill", false, false, 8, 13, 13));  /* cut by max_tokens */
    CHECK(parts_are(q, "<think>\nstill\n", false, false, 8, 14, 14));
    CHECK(parts_are(q, "", false, false, 0, 0, 0));
    /* streaming: the opener, the newlines and a partial tag held back */
    CHECK(parts_are(q, "<thi", true, false, 0, 0, 4));
    CHECK(parts_are(q, "<think>", true, false, 7, 7, 7));
    CHECK(parts_are(q, "<think>\nR\n", true, false, 8, 9, 10));
    CHECK(parts_are(q, "<think>\nR\n</th", true, false, 8, 9, 14));
    CHECK(parts_are(q, "<think>\nR\n</think>\n", true, false, 8, 9, 19));
    CHECK(parts_are(q, "<think>\nR\n</think>\n\nA", true, true, 8, 9, 20));
    CHECK(parts_are(q, "<thinking", true, true, 0, 0, 0));             /* not the opener */
    /* DeepSeek's layout (NULL or the deepseek row): kvt_think_split's */
    CHECK(parts_are(NULL, "R</think>A", false, true, 0, 1, 9));
    CHECK(parts_are(named("deepseek"), "\nR\n</think>\nA", false, true, 0, 3, 11));

    /* every prefix of a reply is consistent with the whole: the reasoning
     * and answer settled so far are parts of the final ones */
    const char *replies[] = {whole, "<think>\n\nR1\n\nR2\n\n</think>\n\n\nA\n", "no think</think>x", "<think>x",
                             "<think>\n</think>\n\n", "<thin", "", "<|channel>thought\nR <chan<channel|>\n A",
                             "R</thi</think></think>A"};
    /* for every template with a thinking mode (the resumed search too) */
    const kvt_template *tpls[] = {q, named("qwen3.5"), named("gemma4"), named("deepseek")};
    for (size_t ti = 0; ti < 4 * (sizeof replies / sizeof *replies); ti++) {
        size_t i = ti % (sizeof replies / sizeof *replies);
        q = tpls[ti / (sizeof replies / sizeof *replies)];
        const char *r = replies[i];
        size_t len = strlen(r);
        kvt_think fin;
        bool fc = kvt_think_parts(q, r, len, false, &fin);
        bool bad = false;
        size_t searched = 0;
        for (size_t k = 0; k <= len; k++) {
            kvt_think p, pr;
            bool pc = kvt_think_parts(q, r, k, true, &p);
            /* resumed as the text grows: the same */
            bool rc = kvt_think_parts_resume(q, r, k, &searched, &pr);
            if (rc != pc || pr.rs != p.rs || pr.re != p.re || pr.as != p.as) bad = true;
            if (p.re > p.rs && (p.rs != fin.rs || p.re > fin.re)) bad = true;
            if (pc && (!fc || p.as != fin.as || p.re != fin.re)) bad = true;
            if (!pc && p.as != k) bad = true;
            if (bad) { printf("      %s: '%s' at %zu\n", q->name, kvt_test_esc(r, len), k); break; }
        }
        CHECK(!bad);
    }
}

/* ---- the server's tokens ---- */

bool kvt_test_bundle_vocab(const char *file, char *path, size_t cap, const char **why); /* test_tokenizer.c */

static kvt_model *vocab_model(const char *file)
{
    char path[512];
    const char *why = NULL;
    kvt_model *m = NULL;
    if (!kvt_test_bundle_vocab(file, path, sizeof path, &why)) {
        printf("      %s: %s\n", file, why);
        return NULL;
    }
    return kvt_model_open_vocab(&m, path) == KVT_OK ? m : NULL;
}

TEST(template_units_tokens)
{
    kvt_model *ds = NULL;
    CHECK_OK(kvt_model_preset(&ds, "ds4-tiny", 1, NULL));
    kvt_template_tokens tt;
    kvt_template_tokens_get(named("deepseek"), ds, &tt);
    kvt_model_info info;
    kvt_model_info_get(ds, &info);
    CHECK(tt.n_user == 1 && tt.n_assistant == 1 && tt.n_end == 1 && tt.end[0] == info.eos);
    /* without markers in the vocabulary: none */
    kvt_template_tokens_get(named("qwen3"), ds, &tt);
    CHECK(tt.n_user == 0 && tt.n_assistant == 0 && tt.n_end == 0);
    kvt_template_tokens_get(named("plain"), ds, &tt);
    CHECK(tt.n_user == 0 && tt.n_end == 0);
    kvt_model_close(ds);

    const char *why = fx_peer_skip_reason();
    if (why) SKIP("%s", why);
    kvt_model *l3 = vocab_model("ggml-vocab-llama-bpe.gguf"), *qw = vocab_model("ggml-vocab-qwen2.gguf");
    if (!l3 || !qw) {
        kvt_model_close(l3);
        kvt_model_close(qw);
        SKIP("llama.cpp's vocabularies are not in the bundle");
    }
    /* Llama 3: the header with the role between its specials; <|eot_id|>,
     * <|eom_id|>, <|end_of_text|> end the turn */
    int32_t *ids = NULL;
    size_t n = 0;
    kvt_template_tokens_get(named("llama3"), l3, &tt);
    /* (this is Llama 3.0's vocabulary: no <|eom_id|> yet, 3.1's) */
    CHECK_OK(kvt_tokenize(l3, "<|eot_id|><|end_of_text|>", 25, 0, true, &ids, &n));
    CHECK(n == 2 && tt.n_end == 2 && tt.end[0] == ids[0] && tt.end[1] == ids[1]);
    free(ids);
    CHECK(tt.n_user == 3 && tt.n_assistant == 3 && tt.user[0] == tt.assistant[0] && tt.user[1] != tt.assistant[1]);
    /* the marker is what the prompt holds: found in a rendering */
    const char *lt = "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>";
    CHECK_OK(kvt_tokenize(l3, lt, strlen(lt), 0, true, &ids, &n));
    CHECK(n > 3 && !memcmp(ids, tt.user, sizeof *ids * 3));
    free(ids);
    /* Qwen: <|im_start|> and the role; <|im_end|> and <|endoftext|> */
    kvt_template_tokens_get(named("qwen3"), qw, &tt);
    CHECK(tt.n_user == 2 && tt.n_assistant == 2 && tt.n_end == 2);
    const char *qt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    CHECK_OK(kvt_tokenize(qw, qt, strlen(qt), 0, true, &ids, &n));
    CHECK(n > 6 && !memcmp(ids, tt.user, sizeof *ids * 2));
    bool asst = false, end = false;
    for (size_t i = 0; i + 1 < n; i++) asst |= ids[i] == tt.assistant[0] && ids[i + 1] == tt.assistant[1];
    for (size_t i = 0; i < n; i++) end |= ids[i] == tt.end[0];
    CHECK(asst && end);
    free(ids);
    /* and the llama3 markers are not Qwen's */
    kvt_template_tokens_get(named("llama3"), qw, &tt);
    CHECK(tt.n_user == 0 && tt.n_end == 0);
    kvt_model_close(l3);
    kvt_model_close(qw);
}

/* ---- robustness ---- */

/* Every family's parser over mutations of well-formed replies (bytes
 * replaced, dropped, duplicated, the text cut anywhere): never a failure
 * but out of memory, the text's end and every call's bytes inside the text,
 * calls in order and after the text, the streaming text a prefix no longer
 * than the whole; and the streaming scan resumed over the text as it grows
 * the scan from scratch at every length (Llama 3's: never more), never
 * shrinking. */
TEST(template_units_tool_calls_mutated)
{
    uint64_t rng = kvt_test_seed("template_units_tool_calls_mutated");
    static const char *const seeds[] = {
        "Sure.\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a.c\", \"n\": [1, 2.5]}}\n</tool_call>"
        "\n<tool_call>\n{\"name\": \"b\", \"arguments\": \"{\\\"x\\\": 1}\"}\n</tool_call>",
        "Let me see. <|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": {\"b\": [null, true]}}}; "
        "{\"type\": \"function\", \"function\": {\"name\": \"g\", \"arguments\": {}}}",
        "{\"name\": \"f\", \"parameters\": {}}\n{\"name\": \"caf\xc3\xa9\", \"parameters\": {\"s\": \"<tool_call>\"}}",
        "ok\n\n<tool_call>\n<function=bash>\n<parameter=cmd>\nls -l\n</parameter>\n<parameter=env>\n{\"a\": [1]}\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
        "ok<|tool_call>call:bash{cmd:<|\"|>ls<|\"|>,env:{A:[1,2.5,None,true]}}<tool_call|><|tool_call>call:f{}<tool_call|>",
    };
    static const char alphabet[] = "{}[]\":,; \n<>/|_abcnt\\\xc3\xa9\xff";
    const char *names[] = {"qwen3", "llama3", "gemma3", "deepseek", "qwen3.5", "gemma4"};
    size_t n_calls = 0;
    for (int round = 0; round < 5000; round++) {
        const char *s = seeds[round % 5];
        size_t sl = strlen(s), len = 0;
        char buf[512];
        for (size_t i = 0; i < sl && len + 2 < sizeof buf; i++) {
            uint64_t r = kvt_test_rand(&rng) % 64;
            if (r == 0) continue;                                              /* drop */
            if (r == 1) buf[len++] = alphabet[kvt_test_rand(&rng) % (sizeof alphabet - 1)]; /* replace */
            else if (r == 2) buf[len++] = s[i], buf[len++] = s[i];            /* duplicate */
            else buf[len++] = s[i];
        }
        len = kvt_test_rand(&rng) % 4 ? len : (size_t)(kvt_test_rand(&rng) % (len + 1)); /* cut */
        for (size_t k = 0; k < sizeof names / sizeof *names; k++) {
            const kvt_template *t = kvt_template_named(names[k]);
            kvt_tool_call *c = NULL;
            size_t n = 0, te = 0;
            int rc = t->tool_calls(buf, len, NULL, &c, &n, &te);
            bool ok = rc == KVT_OK && te <= len && (n == 0) == (c == NULL);
            size_t prev = te;
            for (size_t i = 0; ok && i < n; i++) {
                ok = c[i].raw_off >= prev && c[i].raw_off + c[i].raw_len <= len && c[i].id && c[i].name &&
                     c[i].arguments && c[i].arguments[0] == '{';
                prev = c[i].raw_off + c[i].raw_len;
            }
            size_t tl = t->tool_calls_text_len(buf, len);
            ok = ok && tl <= len && (!n || tl <= te);
            /* the streaming scan, resumed over the text growing in random
             * steps: at every length what the scan from scratch says (Llama
             * 3: never more, and the same once the text is whole and the
             * scan has caught up), never less than before */
            kvt_tool_scan sc = {0};
            size_t prev_tl = 0;
            for (size_t L = 0; ok && L <= len; L += 1 + kvt_test_rand(&rng) % 7) {
                size_t inc = t->tool_calls_scan(&sc, buf, L), fresh = t->tool_calls_text_len(buf, L);
                ok = inc <= fresh && inc >= prev_tl && (inc == fresh || !strcmp(names[k], "llama3"));
                if (!ok) printf("      at %zu of %zu: resumed %zu, from scratch %zu, before %zu\n", L, len, inc, fresh, prev_tl);
                prev_tl = inc;
            }
            CHECKF(ok, "%s, round %d: '%s'", names[k], round, kvt_test_esc(buf, len));
            n_calls += n;
            kvt_tool_calls_free(c, n);
            if (!ok) return;
        }
    }
    printf("    template_units_tool_calls_mutated: 5000 texts through %zu parsers, %zu calls parsed\n",
           sizeof names / sizeof *names, n_calls);
}
