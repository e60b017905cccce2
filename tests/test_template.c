/* kvtier's built-in chat templates against the chat templates themselves,
 * byte for byte, over one corpus of conversations; and the tool-call
 * parsers and the template choice, without them.
 *
 *   template_deepseek_v4   the deepseek template (ds4-tiny, picked by its
 *                          architecture) against llama.cpp's
 *                          models/templates/deepseek-ai-DeepSeek-V4-Flash-0731.jinja,
 *                          in non-thinking and thinking mode
 *   template_llama3        llama3 against the Llama 3.1, 3.2 and 3.3
 *                          templates (the same without builtin_tools)
 *   template_qwen          qwen2.5 against Qwen-Qwen2.5-7B-Instruct.jinja,
 *                          qwen3 against Qwen-Qwen3-0.6B.jinja and qwen3.5
 *                          against Qwen3.5-4B.jinja with enable_thinking
 *                          false and true
 *   template_gemma         gemma3 against google-gemma-2-2b-it.jinja with
 *                          Gemma 3's system message (below), gemma4 against
 *                          google-gemma-4-31B-it.jinja with enable_thinking
 *                          false and true
 *   template_qwen35_typed_roundtrip
 *                          Qwen 3.5's arguments typed by the request's
 *                          schema through the api, and the call echoed
 *                          back rendering the sampled bytes (the replay
 *                          hook); no node needed, the vocabulary below
 *   template_units_pick, template_tool_calls_*, template_units_think_parts
 *                          the choice by chat template text and
 *                          architecture, each family's tool-call parser
 *                          (malformed input included) and the split of a
 *                          thinking reply; no node needed
 *
 * For a family kvtier loads a model whose GGUF's tokenizer.chat_template is
 * the template's own text (tokenizer keys of ../shared/vocab/
 * ggml-vocab-llama-spm.gguf), so the text picks the renderer; every
 * conversation of the corpus goes in as an OpenAI chat request and its
 * prompt must equal the template's rendering. The template gets what a
 * client of the transformers chat API passes, as llama.cpp's server passes
 * it: the request's messages and tools as they are, except that tool-call
 * arguments are parsed into objects (the from_json filter is not part of
 * @huggingface/jinja, and transformers expects objects there), content
 * given as text parts is one string with "\n\n" between the parts (kvtier
 * joins parts so), and for every template but deepseek's a developer
 * message is a system message and null content is "" (llama.cpp's
 * workarounds); bos_token, add_generation_prompt (false when the
 * conversation ends with an assistant turn without tool calls: kvtier then
 * continues that turn, so its rendering is the template's without what
 * ends the turn), and the thinking flags.
 *
 * Where kvtier renders differently on purpose, the difference is written as
 * a patch of the template (render.mjs applies it; each text it replaces must
 * be there exactly once), and kvtier must equal the patched template in
 * every case, and the template as it is wherever the patch changes nothing:
 *  - deepseek: drop_thinking = false, and qwen3, qwen3.5, gemma4: the
 *    history rule below.
 *    The templates drop the reasoning of the turns before the last user
 *    message, which rewrites the cached prefix at every new user turn;
 *    kvtier renders every turn as the template renders the turns after the
 *    last query (docs/API.md). Control: the template as it is differs on the
 *    multi-turn reasoning cases (the rewrite kvtier avoids).
 *  - gemma3: Gemma 3's template is not in llama.cpp's tree; Gemma 2's is,
 *    and Gemma 3's differs only in the system message, which it writes
 *    before the first turn's text followed by "\n\n" where Gemma 2's raises.
 *    The reference is Gemma 2's template with that change.
 *  - gemma4: @huggingface/jinja prints none as "", where transformers and
 *    llama.cpp print Python's None (as kvtier does); the reference says None.
 * A case the (patched) template raises on is left out of the comparison
 * (each family says which, and how many it expects); kvtier must still
 * render it.
 *
 * Negative controls, per family: the same contexts with
 * add_generation_prompt flipped must differ from kvtier in every compared
 * case (but where the template writes no generation prompt: Gemma 4 after
 * a tool result); with the thinking flag flipped in every compared case that ends
 * with the generation prompt; and another template (a sibling, or a flag
 * the template has) must differ in at least one case.
 *
 * And every rendering only grows: the request cut before each assistant
 * turn renders to a prefix of the whole (not for a turn with reasoning in
 * non-thinking mode: that turn was not generated in that mode).
 *
 * Requirements: node, the packages of tests/template/package-lock.json
 * (@huggingface/jinja, installed with npm ci on first use) and of the
 * llama.cpp peer (tests/peer: the templates are read from its source
 * bundle), and for all but deepseek the vocabulary above. Skips, saying
 * why, when any is missing; KVT_PEER=0 skips it too. About 2 s a test. */
#include "fixture.h"
#include "test.h"
#include "serve/api.h"
#include "format/gguf.h"
#include "arch/model.h"
#include "chat/template.h"

#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#define TPL_DIR "tests/template"
#define TPL_SCRIPT TPL_DIR "/render.mjs"
#define BUNDLE FX_PEER_DIR "/node_modules/node-llama-cpp/llama/gitRelease.bundle"
#define VOCAB "vocab/ggml-vocab-llama-spm.gguf"
#define DS_BOS "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"
#define DS_EOS "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"

static const char *skip_reason(void)
{
    const char *why = fx_peer_skip_reason();
    if (why) return why;
    if (system("command -v node >/dev/null 2>&1") != 0) return "node is not on PATH";
    if (system("command -v git >/dev/null 2>&1") != 0) return "git is not on PATH";
    if (access(TPL_SCRIPT, R_OK) != 0) return "run from the repository root (" TPL_SCRIPT " not found)";
    return NULL;
}

static bool jinja_ensure(void)
{
    int fd = open(TPL_DIR "/package.json", O_RDONLY);
    if (fd < 0) return false;
    flock(fd, LOCK_EX);
    bool ok = access(TPL_DIR "/node_modules/@huggingface/jinja/package.json", R_OK) == 0 ||
              fx_npm_ci(TPL_DIR, "kvtier-template", "@huggingface/jinja");
    flock(fd, LOCK_UN);
    close(fd);
    return ok;
}

/* ---- the corpus: OpenAI chat conversations (the "messages" and "tools" of a
 * request; each is also sent in thinking mode) ---- */

#define TOOLS                                                                                                   \
    "[{\"type\":\"function\",\"function\":{\"name\":\"read_file\",\"description\":\"Read a file \\u00e9 \\\"q\\\"\","   \
    "\"parameters\":{\"type\":\"object\",\"properties\":{\"path\":{\"type\":\"string\"},\"limit\":{\"type\":"       \
    "\"integer\",\"default\":2000,\"minimum\":1.5e-7}},\"required\":[\"path\"]}}},{\"type\":\"function\","           \
    "\"function\":{\"name\":\"bash\",\"parameters\":{\"type\":\"object\",\"properties\":{\"cmd\":{\"type\":"       \
    "\"string\"},\"env\":{\"type\":\"object\"}}},\"strict\":true}}]"

typedef struct tcase {
    const char *name;
    const char *messages;
    const char *tools;       /* NULL: none */
    const char *effort;      /* reasoning_effort, NULL: none */
} tcase;

static const tcase corpus[] = {
    {"one user turn", "[{\"role\":\"user\",\"content\":\"Hello?\"}]", NULL, NULL},
    {"system and turns",
     "[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Q1\"},"
     "{\"role\":\"assistant\",\"content\":\"A1\"},{\"role\":\"user\",\"content\":\"Q2\"}]", NULL, NULL},
    {"two systems, one late, empty first",
     "[{\"role\":\"system\",\"content\":\"\"},{\"role\":\"user\",\"content\":\"Q\"},"
     "{\"role\":\"system\",\"content\":\"Late rule.\"},{\"role\":\"user\",\"content\":\"Q again\"}]", TOOLS, NULL},
    {"developer and parts",
     "[{\"role\":\"developer\",\"content\":\"Dev says.\"},{\"role\":\"user\",\"content\":[{\"type\":\"text\","
     "\"text\":\"Part one.\"},{\"type\":\"text\",\"text\":\"Part two.\"}]}]", NULL, "high"},
    {"tools, calls and results",
     "[{\"role\":\"system\",\"content\":\"You are an agent.\"},{\"role\":\"user\",\"content\":\"Look at a.c\"},"
     "{\"role\":\"assistant\",\"content\":\"Reading.\",\"reasoning_content\":\"I should read it.\",\"tool_calls\":["
     "{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"read_file\",\"arguments\":"
     "\"{\\\"path\\\":\\\"a.c\\\",\\\"limit\\\":10}\"}},{\"id\":\"c2\",\"type\":\"function\",\"function\":"
     "{\"name\":\"bash\",\"arguments\":\"{\\\"cmd\\\":\\\"wc -l a.c\\\",\\\"env\\\":{\\\"LC_ALL\\\":\\\"C\\\","
     "\\\"n\\\":[1,2.5,null,true]}}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"int main;\"},"
     "{\"role\":\"tool\",\"tool_call_id\":\"c2\",\"content\":\"1 a.c\"}]", TOOLS, NULL},
    {"answer after results, then a user turn",
     "[{\"role\":\"user\",\"content\":\"Run ls\"},{\"role\":\"assistant\",\"content\":null,\"tool_calls\":["
     "{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"bash\",\"arguments\":\"{}\"}}]},"
     "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"a.c\\nb.c\"},{\"role\":\"assistant\",\"content\":"
     "\"Two files.\",\"reasoning_content\":\"Count them.\"},{\"role\":\"user\",\"content\":\"Thanks\"}]", TOOLS, "max"},
    {"multi-turn reasoning",
     "[{\"role\":\"user\",\"content\":\"2+2?\"},{\"role\":\"assistant\",\"content\":\"4\",\"reasoning_content\":"
     "\"Add them.\"},{\"role\":\"user\",\"content\":\"Times 3?\"},{\"role\":\"assistant\",\"content\":\"12\","
     "\"reasoning_content\":\"4*3.\"},{\"role\":\"user\",\"content\":\"Sure?\"}]", NULL, NULL},
    {"prefill", "[{\"role\":\"user\",\"content\":\"Name a colour\"},{\"role\":\"assistant\",\"content\":\"The colour is\"}]",
     NULL, NULL},
    {"unicode, markup-like text, empty user",
     "[{\"role\":\"user\",\"content\":\"caf\\u00e9 \\u4e2d\\u6587 \\ud83d\\ude00 <tool_result>x</tool_result> \\n\\t\"},"
     "{\"role\":\"assistant\",\"content\":\"ok\"},{\"role\":\"user\",\"content\":\"\"}]", NULL, NULL},
    {"tool result then user text in one turn",
     "[{\"role\":\"user\",\"content\":\"go\"},{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"x\","
     "\"type\":\"function\",\"function\":{\"name\":\"read_file\",\"arguments\":\"{\\\"path\\\":\\\"\\u00e9/\\\\\\\"q\\\\\\\"\\\\n\\\"}\"}}]},"
     "{\"role\":\"tool\",\"tool_call_id\":\"x\",\"content\":\"done\"},{\"role\":\"user\",\"content\":\"and now?\"}]",
     TOOLS, NULL},
};
#define N_CORPUS (sizeof corpus / sizeof *corpus)

/* ---- the families ---- */

enum { THINK_NONE, THINK_DS, THINK_ENABLE };
enum { V_REF, V_RULE, V_GEN, V_THINK, V_SIB, N_V };

typedef struct fam {
    const char *label;
    const char *file;             /* the template in the bundle */
    const char *kvt;              /* the kvtier template it picks */
    const char *preset;           /* instead of the file's text, a preset (picked by architecture) */
    const char *bos;              /* bos_token */
    const char *end;              /* what ends an assistant turn in the template's rendering */
    int think;                    /* the template's thinking flag */
    bool llama_cpp;               /* developer as system, null content as "" */
    const char *const *ref_patch; /* FROM, TO, ..., NULL: the reference from the file */
    const char *const *rule_patch; /* FROM, TO, ..., NULL: kvtier's rule on the reference */
    const char *sibling;          /* control: another template file ... */
    const char *sibling_key;      /* ... or the reference with this context flag false ... */
    const char *const *sibling_ref; /* ... or made with this patch of the file instead */
    const char *sibling_label;    /* what the control is, for the output */
    int n_raise;                  /* renderings (of every mode) the template raises on */
    const char *raise_note;
    int n_gen_same;               /* renderings add_generation_prompt does not change (gemma4:
                                   * after a tool result it writes no generation prompt) */
} fam;

static const fam deepseek = {"deepseek", "models/templates/deepseek-ai-DeepSeek-V4-Flash-0731.jinja", "deepseek",
                             "ds4-tiny", DS_BOS, DS_EOS, THINK_DS, false, NULL, NULL, NULL, NULL, NULL,
                             "the default drop_thinking", 0, NULL};

#define L3_RAISE "the parallel calls (\"This model only supports single tool-calls at once!\"; kvtier writes each)"
static const fam llama31 = {"llama3 / Llama 3.1", "models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja",
                            "llama3", NULL, "<|begin_of_text|>", "<|eot_id|>", THINK_NONE, true, NULL, NULL, NULL,
                            "tools_in_user_message", NULL, "tools_in_user_message false", 1, L3_RAISE};
static const fam llama32 = {"llama3 / Llama 3.2", "models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja",
                            "llama3", NULL, "<|begin_of_text|>", "<|eot_id|>", THINK_NONE, true, NULL, NULL, NULL,
                            "tools_in_user_message", NULL, "tools_in_user_message false", 1, L3_RAISE};
static const fam llama33 = {"llama3 / Llama 3.3", "models/templates/meta-llama-Llama-3.3-70B-Instruct.jinja",
                            "llama3", NULL, "<|begin_of_text|>", "<|eot_id|>", THINK_NONE, true, NULL, NULL, NULL,
                            "tools_in_user_message", NULL, "tools_in_user_message false", 1, L3_RAISE};

#define QWEN25 "models/templates/Qwen-Qwen2.5-7B-Instruct.jinja"
#define QWEN3 "models/templates/Qwen-Qwen3-0.6B.jinja"
static const fam qwen25 = {"qwen2.5", QWEN25, "qwen2.5", NULL, "", "<|im_end|>\n", THINK_NONE, true, NULL, NULL,
                           QWEN3, NULL, NULL, "Qwen 3's template", 0, NULL};
/* kvtier's history: every assistant turn as the template writes the turns
 * after the last user query, and without thinking with the empty block the
 * generation prompt had */
static const char *const qwen3_rule[] = {
    "{%- if loop.index0 > ns.last_query_index %}", "{%- if true %}",
    "{%- if loop.last or (not loop.last and reasoning_content) %}",
    "{%- if loop.last or reasoning_content or enable_thinking is false %}", NULL};
static const fam qwen3 = {"qwen3", QWEN3, "qwen3", NULL, "", "<|im_end|>\n", THINK_ENABLE, true, NULL, qwen3_rule,
                          QWEN25, NULL, NULL, "Qwen 2.5's template", 0, NULL};

/* kvtier's history: every assistant turn as the template writes the turns
 * after the last user query (the generation prompt opened the block) */
static const char *const qwen35_rule[] = {"{%- if loop.index0 > ns.last_query_index %}", "{%- if true %}", NULL};
static const fam qwen35 = {"qwen3.5", "models/templates/Qwen3.5-4B.jinja", "qwen3.5", NULL, "", "<|im_end|>\n",
                           THINK_ENABLE, true, NULL, qwen35_rule, QWEN3, NULL, NULL, "Qwen 3's template", 2,
                           "the late system message (\"System message must be at the beginning.\"; kvtier writes a "
                           "system turn there)"};

/* Gemma 3's system message on Gemma 2's template */
static const char *const gemma3_ref[] = {
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}",
    "{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}",
    "+ message['content'] | trim + '<end_of_turn>",
    "+ (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>", NULL};
/* the control: the system text joined to the first turn's by "\n" (llama.cpp's
 * merge for a template without a system role) */
static const char *const gemma3_merge[] = {
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}",
    "{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + '\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}",
    "+ message['content'] | trim + '<end_of_turn>",
    "+ (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>", NULL};
/* Python's str of none where @huggingface/jinja prints "" (transformers and
 * llama.cpp, which kvtier follows, print None): the corpus has a null in a
 * call's arguments */
#define G4_NONE "        {{- argument -}}", "        {{- 'None' if argument is none else argument -}}"
static const char *const gemma4_ref[] = {G4_NONE, NULL};
/* kvtier's history: every turn's reasoning, and outside thinking mode the
 * empty thought channel after each model turn's opening, as the generation
 * prompt had it */
static const char *const gemma4_rule[] = {
    "{%- if thinking_text and loop.index0 > ns_turn.last_user_idx and message.get('tool_calls') -%}",
    "{%- if thinking_text -%}",
    "    {%- if not continue_same_model_turn -%}\n        {{- '<|turn>' + role + '\\n' }}\n    {%- endif -%}",
    "    {%- if not continue_same_model_turn -%}\n        {{- '<|turn>' + role + '\\n' }}\n"
    "        {%- if role == 'model' and not (enable_thinking | default(false)) and not (message.get('reasoning') or "
    "message.get('reasoning_content')) -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}\n    {%- endif -%}",
    NULL};
static const fam gemma4 = {"gemma4", "models/templates/google-gemma-4-31B-it.jinja", "gemma4", NULL, "<bos>",
                           "<turn|>\n", THINK_ENABLE, true, gemma4_ref, gemma4_rule,
                           "models/templates/google-gemma-4-31B-it-interleaved.jinja", NULL, NULL,
                           "the interleaved Gemma 4 template", 0, NULL, 2};

static const fam gemma3 = {"gemma3", "models/templates/google-gemma-2-2b-it.jinja", "gemma3", NULL, "<bos>",
                           "<end_of_turn>\n", THINK_NONE, true, gemma3_ref, NULL, NULL, NULL, gemma3_merge,
                           "the system text joined by \"\\n\" (llama.cpp's merge)", 3,
                           "the tool results (\"Conversation roles must alternate user/assistant/user/assistant/...\"; "
                           "kvtier writes each message as its own turn)"};

/* ---- helpers ---- */

static json_t *must(const char *text)
{
    json_error_t e;
    json_t *v = json_loads(text, 0, &e);
    if (!v) printf("      bad JSON in the corpus: %s: %s\n", e.text, text);
    return v;
}

/* The request body kvtier parses: messages (the first n_msgs of them, all
 * when SIZE_MAX) and the mode. */
static char *request_body(const fam *f, const tcase *c, bool thinking, size_t n_msgs)
{
    json_t *b = json_object(), *msgs = must(c->messages);
    while (json_array_size(msgs) > n_msgs) json_array_remove(msgs, json_array_size(msgs) - 1);
    json_object_set_new(b, "messages", msgs);
    if (c->tools) json_object_set_new(b, "tools", must(c->tools));
    if (f->think == THINK_DS && thinking)
        json_object_set_new(b, "chat_template_kwargs", json_pack("{s:b}", "thinking", 1));
    if (f->think == THINK_ENABLE)
        json_object_set_new(b, "chat_template_kwargs", json_pack("{s:b}", "enable_thinking", thinking));
    if (c->effort) json_object_set_new(b, "reasoning_effort", json_string(c->effort));
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

/* Whether the conversation ends with an assistant turn without tool calls. */
static bool is_prefill(const json_t *msgs)
{
    const json_t *last = json_array_get(msgs, json_array_size(msgs) - 1);
    return !strcmp(json_string_value(json_object_get(last, "role")), "assistant") &&
           json_array_size(json_object_get(last, "tool_calls")) == 0;
}

static json_t *patch_of(const char *const *p, json_t *into)
{
    for (size_t i = 0; p && p[i]; i += 2) json_array_append_new(into, json_pack("[s, s]", p[i], p[i + 1]));
    return into;
}

/* The template context for case c in variant v (see the header). */
static json_t *context(const fam *f, const tcase *c, bool thinking, int v)
{
    json_t *msgs = must(c->messages), *ctx = json_object();
    size_t i, k;
    json_t *m, *tc;
    json_array_foreach(msgs, i, m) {
        json_t *parts = json_object_get(m, "content"), *p;
        if (json_is_array(parts)) { /* text parts: one string, "\n\n" between them */
            char *joined = strdup("");
            json_array_foreach(parts, k, p) {
                const char *t = json_string_value(json_object_get(p, "text"));
                size_t a = strlen(joined), b = strlen(t);
                joined = realloc(joined, a + b + 3);
                if (k) strcpy(joined + a, "\n\n"), a += 2;
                strcpy(joined + a, t);
            }
            json_object_set_new(m, "content", json_string(joined));
            free(joined);
        }
        json_array_foreach(json_object_get(m, "tool_calls"), k, tc) {
            json_t *fn = json_object_get(tc, "function");
            const char *args = json_string_value(json_object_get(fn, "arguments"));
            if (args) json_object_set_new(fn, "arguments", must(args));
        }
        if (f->llama_cpp && !strcmp(json_string_value(json_object_get(m, "role")), "developer"))
            json_object_set_new(m, "role", json_string("system"));
        if (f->llama_cpp && json_is_null(json_object_get(m, "content")))
            json_object_set_new(m, "content", json_string(""));
    }
    bool gen = !is_prefill(msgs);
    if (v == V_GEN) gen = !gen;
    if (v == V_THINK) thinking = !thinking;
    json_object_set_new(ctx, "add_generation_prompt", json_boolean(gen));
    json_object_set_new(ctx, "messages", msgs);
    if (c->tools) json_object_set_new(ctx, "tools", must(c->tools));
    json_object_set_new(ctx, "bos_token", json_string(f->bos));
    if (f->think == THINK_DS) {
        json_object_set_new(ctx, "thinking", json_boolean(thinking));
        json_object_set_new(ctx, "drop_thinking", json_boolean(v == V_REF || (v == V_SIB && !f->sibling)));
        if (c->effort) json_object_set_new(ctx, "reasoning_effort", json_string(c->effort));
    }
    if (f->think == THINK_ENABLE) json_object_set_new(ctx, "enable_thinking", json_boolean(thinking));
    if (v == V_SIB && f->sibling_key) json_object_set_new(ctx, f->sibling_key, json_false());
    /* Llama 3: the template's own date, as kvtier renders it (not the clock's) */
    if (!strcmp(f->kvt, "llama3")) json_object_set_new(ctx, "date_string", json_string("26 Jul 2024"));
    json_object_set_new(ctx, "__template", json_string(v == V_SIB && f->sibling ? f->sibling : f->file));
    json_t *patch = json_array();
    if (v == V_SIB && f->sibling_ref) patch_of(f->sibling_ref, patch);
    else if (!(v == V_SIB && f->sibling)) patch_of(f->ref_patch, patch);
    if (v != V_REF && !(v == V_SIB && (f->sibling || f->sibling_ref))) patch_of(f->rule_patch, patch);
    json_object_set_new(ctx, "__patch", patch);
    return ctx;
}

/* Render the contexts: n values in want[] (a string, or the template's
 * error as {"error": ...}); every template read is written to dir. */
static bool render_all(const char *dir, const char *first, json_t *contexts, json_t **want, size_t n)
{
    char in[256], out[256];
    snprintf(in, sizeof in, "%s/cases.json", dir);
    snprintf(out, sizeof out, "%s/out", dir);
    bool ok = json_dump_file(contexts, in, JSON_COMPACT) == 0;
    int st = 0;
    const char *argv[] = {"node", TPL_SCRIPT, BUNDLE, first, in, dir, NULL};
    ok = ok && fx_run(argv, out, 120.0, &st) == 1 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
    size_t len = 0;
    char *text = ok ? kvt_test_read_file(out, &len) : NULL;
    if (!ok) fx_print_file("render.mjs", out);
    char *save = NULL;
    for (size_t i = 0; i < n && ok; i++) {
        char *l = strtok_r(i ? NULL : text, "\n", &save);
        want[i] = l ? json_loads(l, JSON_DECODE_ANY, NULL) : NULL;
        ok = json_is_string(want[i]) || json_is_string(json_object_get(want[i], "error"));
        if (!ok) printf("      render.mjs, case %zu: %s\n", i, l ? l : "(no line)");
    }
    free(text);
    unlink(in);
    unlink(out);
    return ok;
}

/* A model with only a tokenizer: vocab's, with chat_template as its GGUF's
 * tokenizer.chat_template. */
static kvt_model *model_with_template(const char *vocab, const char *chat_template, const char *path)
{
    kvt_gguf *g = NULL;
    kvt_model *m = NULL;
    if (kvt_gguf_open(&g, vocab)) return NULL;
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    int rc = w ? KVT_OK : KVT_ENOMEM;
    for (size_t i = 0; !rc && i < kvt_gguf_n_kv(g); i++)
        if (!strncmp(kvt_gguf_key(g, i), "tokenizer.", 10) && strcmp(kvt_gguf_key(g, i), "tokenizer.chat_template"))
            rc = kvt_gguf_writer_set(w, kvt_gguf_key(g, i), kvt_gguf_val_at(g, i));
    if (!rc) rc = kvt_gguf_writer_set_str(w, "tokenizer.chat_template", chat_template);
    if (!rc) rc = kvt_gguf_writer_write(w, path);
    kvt_gguf_writer_free(w);
    kvt_gguf_close(g);
    if (!rc) rc = kvt_model_open_vocab(&m, path);
    unlink(path);
    return rc ? NULL : m;
}

static const char *str_of(const json_t *v) { return json_is_string(v) ? json_string_value(v) : NULL; }

/* The template's rendering as kvtier renders it: a prefill without what
 * ends the turn. Length into *wl. */
static const char *expected(const fam *f, const json_t *v, bool prefill, size_t *wl)
{
    const char *w = str_of(v);
    if (!w) return NULL;
    *wl = strlen(w);
    size_t el = strlen(f->end);
    if (prefill && *wl >= el && !strcmp(w + *wl - el, f->end)) *wl -= el;
    return w;
}

static bool same(const char *w, size_t wl, const kvt_request *r)
{
    return w && r->prompt_len == wl && !memcmp(r->prompt, w, wl);
}

static void show_difference(const char *what, const char *w, size_t wl, const kvt_request *r)
{
    size_t k = 0;
    while (k < wl && k < r->prompt_len && r->prompt[k] == w[k]) k++;
    printf("      %s: first difference at byte %zu\n      template '%s'\n", what, k,
           kvt_test_esc(w + k, wl - k < 160 ? wl - k : 160));
    printf("      kvtier   '%s'\n", kvt_test_esc(r->prompt + k, r->prompt_len - k < 160 ? r->prompt_len - k : 160));
}

/* Every rendering only grows: for each assistant turn (after a turn of
 * another role) the request cut before it renders to a prefix of the whole.
 * Counts checked and grown into *n, *ok. */
static void check_growth(const fam *f, const kvt_model *m, const tcase *c, bool th, const kvt_request *whole,
                         size_t *n, size_t *ok)
{
    json_t *msgs = must(c->messages);
    for (size_t i = 1; i < json_array_size(msgs); i++) {
        json_t *mi = json_array_get(msgs, i), *prev = json_array_get(msgs, i - 1);
        if (strcmp(json_string_value(json_object_get(mi, "role")), "assistant") ||
            !strcmp(json_string_value(json_object_get(prev, "role")), "assistant"))
            continue;
        if (f->think && !th && json_object_get(mi, "reasoning_content")) continue;
        char *body = request_body(f, c, th, i);
        kvt_request r;
        if (kvt_request_parse(&r, KVT_API_CHAT, body, strlen(body), m, NULL) == KVT_OK) {
            bool grown = r.prompt_len <= whole->prompt_len && !memcmp(r.prompt, whole->prompt, r.prompt_len);
            if (!grown) printf("      %s, %s: the request before message %zu is no prefix\n", f->label, c->name, i);
            *ok += grown;
            kvt_request_free(&r);
        }
        (*n)++;
        free(body);
    }
    json_decref(msgs);
}

/* Render every case of every family with the templates and with kvtier,
 * compare, print one line per family. */
static void run_families(const fam *const *fams, size_t nf)
{
    const char *why = skip_reason();
    if (why) SKIP("%s", why);
    double secs;
    if (!fx_peer_ensure(&secs)) SKIP("the llama.cpp peer packages could not be installed (offline?)");
    if (!jinja_ensure()) SKIP("@huggingface/jinja could not be installed (offline?)");
    const char *vocab = kvt_test_shared(VOCAB);
    for (size_t k = 0; k < nf; k++)
        if (!fams[k]->preset && !vocab) SKIP("../shared/" VOCAB " not found");
    char dir[] = "/tmp/kvt-tpl-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir));

    /* per family, mode and case, the N_V variants */
    json_t *ctxs = json_array();
    for (size_t k = 0; k < nf; k++)
        for (int th = 0; th < (fams[k]->think ? 2 : 1); th++)
            for (size_t i = 0; i < N_CORPUS; i++)
                for (int v = 0; v < N_V; v++) json_array_append_new(ctxs, context(fams[k], &corpus[i], th, v));
    size_t total = json_array_size(ctxs);
    json_t **want = calloc(total, sizeof *want);
    CHECK(want);
    bool rendered = render_all(dir, fams[0]->file, ctxs, want, total);
    json_decref(ctxs);

    size_t at = 0;
    for (size_t k = 0; rendered && k < nf; k++) {
        const fam *f = fams[k];
        kvt_model *m = NULL;
        if (f->preset) {
            CHECK_OK(kvt_model_preset(&m, f->preset, 1, NULL));
        } else {
            char src[512], gguf[512];
            snprintf(src, sizeof src, "%s/%s", dir, strrchr(f->file, '/') + 1);
            snprintf(gguf, sizeof gguf, "%s/model.gguf", dir);
            size_t sl = 0;
            char *text = kvt_test_read_file(src, &sl);
            m = text ? model_with_template(vocab, text, gguf) : NULL;
            free(text);
        }
        CHECKF(m && !strcmp(kvt_template_name(m), f->kvt), "%s: the template's text picks %s, not %s", f->label,
               m ? kvt_template_name(m) : "(no model)", f->kvt);
        size_t n_all = 0, n_raise = 0, n_cmp = 0, n_rule = 0, n_ref = 0, n_rewrite = 0, n_gen = 0, n_think = 0,
               n_think_cmp = 0, n_sib = 0, n_grow = 0, n_grow_ok = 0, n_render = 0, n_gen_eff = 0;
        char rewrites[1024] = "";
        for (int th = 0; th < (f->think ? 2 : 1); th++) {
            for (size_t i = 0; i < N_CORPUS; i++, at += N_V) {
                const tcase *c = &corpus[i];
                json_t *msgs = must(c->messages);
                bool prefill = is_prefill(msgs);
                json_decref(msgs);
                n_all++;
                char *body = request_body(f, c, th, SIZE_MAX);
                kvt_request r;
                int rc = kvt_request_parse(&r, KVT_API_CHAT, body, strlen(body), m, NULL);
                free(body);
                if (rc) { printf("      %s, %s: %s\n", f->label, c->name, kvt_errmsg()); continue; }
                n_render++;
                size_t wl = 0, rl = 0;
                const char *w = expected(f, want[at + V_RULE], prefill, &wl);
                const char *ref = expected(f, want[at + V_REF], prefill, &rl);
                if (!w) {
                    n_raise++;
                    kvt_request_free(&r);
                    continue;
                }
                n_cmp++;
                char what[160];
                snprintf(what, sizeof what, "%s, %s (%s)", f->label, c->name, th ? "thinking" : "non-thinking");
                if (same(w, wl, &r)) n_rule++;
                else show_difference(what, w, wl, &r);
                if (same(ref, rl, &r)) n_ref++;
                else if (!ref || rl != wl || memcmp(ref, w, wl)) {
                    n_rewrite++;
                    size_t ul = strlen(rewrites);
                    snprintf(rewrites + ul, sizeof rewrites - ul, "%s%s (%s)", ul ? ", " : "", c->name,
                             th ? "thinking" : "non-thinking");
                }
                size_t gl = 0;
                const char *g = expected(f, want[at + V_GEN], prefill, &gl);
                n_gen += !same(g, gl, &r);
                n_gen_eff += !g || gl != wl || memcmp(g, w, wl);
                if (f->think && !prefill) {
                    const char *t = expected(f, want[at + V_THINK], prefill, &gl);
                    n_think_cmp++;
                    n_think += !same(t, gl, &r);
                }
                const char *sb = expected(f, want[at + V_SIB], prefill, &gl);
                n_sib += !same(sb, gl, &r);
                check_growth(f, m, c, th, &r, &n_grow, &n_grow_ok);
                kvt_request_free(&r);
            }
        }
        kvt_model_close(m);
        printf("    %s: %zu of %zu renderings byte for byte", f->label, n_rule, n_cmp);
        if (f->rule_patch || f->think == THINK_DS)
            printf(" (with kvtier's history); %zu of them with the template as it is, which rewrites the history "
                   "in the other %zu: %s", n_ref, n_rewrite, rewrites);
        if (n_raise) printf("; the template raises on %zu (%s), kvtier renders them", n_raise, f->raise_note);
        printf("\n      controls: add_generation_prompt flipped differs in %zu of %zu", n_gen, n_cmp);
        if (f->n_gen_same) printf(" (the template writes no generation prompt after a tool result)");
        if (f->think) printf(", the thinking flag flipped in %zu of %zu", n_think, n_think_cmp);
        printf(", %s in %zu of %zu; grows: %zu of %zu prefixes\n", f->sibling_label, n_sib, n_cmp, n_grow_ok,
               n_grow);
        CHECK(n_render == n_all);
        CHECKF(n_raise == (size_t)f->n_raise, "%s: the template raises on %zu renderings, expected %d", f->label,
               n_raise, f->n_raise);
        CHECK(n_cmp > 0 && n_rule == n_cmp);
        CHECK(n_ref + n_rewrite == n_cmp);
        if (f->rule_patch || f->think == THINK_DS) CHECK(n_rewrite >= 1);
        CHECK(n_gen == n_gen_eff && n_gen_eff == n_cmp - (size_t)f->n_gen_same);
        CHECK(n_think == n_think_cmp);
        CHECK(n_sib >= 1);
        CHECK(n_grow_ok == n_grow);
    }
    for (size_t i = 0; i < total; i++) json_decref(want[i]);
    free(want);
    fx_rm_tree(dir); /* the rendered templates and the model made of each */
}

TEST(template_deepseek_v4) { run_families((const fam *const[]){&deepseek}, 1); }
TEST(template_llama3) { run_families((const fam *const[]){&llama31, &llama32, &llama33}, 3); }
TEST(template_qwen) { run_families((const fam *const[]){&qwen25, &qwen3, &qwen35}, 3); }
TEST(template_gemma) { run_families((const fam *const[]){&gemma3, &gemma4}, 2); }

/* ---- Qwen 3.5's typed arguments, through the api and back ---------------- */

/* A chat template text that picks qwen3.5 (its marks, template.c). */
#define Q35_PICK "<|im_start|> <function=example_function_name> enable_thinking is defined and enable_thinking is false"
#define Q35_REPLY                                                                                              \
    "Counting.\n\n<tool_call>\n<function=count>\n<parameter=n>\n10\n</parameter>\n<parameter=flag>\ntrue\n" \
    "</parameter>\n<parameter=opts>\n{\"x\":1}\n</parameter>\n</function>\n</tool_call>"

typedef struct q35_replay { const kvt_tool_call *c; size_t n; } q35_replay;

static bool q35_replay_cb(void *user, const char *id, kvt_wbuf *out)
{
    const q35_replay *q = user;
    for (size_t i = 0; i < q->n; i++)
        if (!strcmp(q->c[i].id, id)) {
            kvt_wbuf_put(out, Q35_REPLY + q->c[i].raw_off, q->c[i].raw_len);
            return true;
        }
    return false;
}

/* r2's prompt is r1's, then the sampled reply, then what ends the turn. */
static bool continues(const kvt_request *r1, const kvt_request *r2)
{
    size_t l1 = r1->prompt_len, gl = strlen(Q35_REPLY);
    return r2->prompt_len > l1 + gl && !memcmp(r2->prompt, r1->prompt, l1) &&
           !memcmp(r2->prompt + l1, Q35_REPLY, gl) && !strncmp(r2->prompt + l1 + gl, "<|im_end|>\n", 11);
}

/* One reply of Qwen 3.5 under two schemas for the same function: all
 * strings, and integer/boolean/object. The arguments the client gets are
 * typed by each (the same text, differently typed values), and the next
 * request, the call echoed back with its result, renders the bytes that
 * were sampled: the cached prefix continues. Controls: without the replay
 * hook the typed call renders as the template writes it (True, {"x": 1}),
 * which is not what was sampled; a client that changed an argument gets its
 * own call rendered, not the sampled bytes. Needs the vocabulary of
 * ../shared/vocab (skips without it). */
TEST(template_qwen35_typed_roundtrip)
{
    const char *vocab = kvt_test_shared(VOCAB);
    if (!vocab) SKIP("../shared/" VOCAB " not found");
    char dir[] = "/tmp/kvt-q35-XXXXXX", gguf[64];
    CHECK(kvt_test_mkdtemp(dir));
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    kvt_model *m = model_with_template(vocab, Q35_PICK, gguf);
    rmdir(dir);
    CHECK(m && !strcmp(kvt_template_name(m), "qwen3.5"));
    static const struct { const char *schema, *args; bool canonical_same; } cases[] = {
        {"{\"type\":\"object\",\"properties\":{\"n\":{\"type\":\"string\"},\"flag\":{\"type\":\"string\"},"
         "\"opts\":{\"type\":\"string\"}}}",
         "{\"n\":\"10\",\"flag\":\"true\",\"opts\":\"{\\\"x\\\":1}\"}", true},
        {"{\"type\":\"object\",\"properties\":{\"n\":{\"type\":\"integer\"},\"flag\":{\"type\":\"boolean\"},"
         "\"opts\":{\"$ref\":\"#/$defs/O\"}},\"$defs\":{\"O\":{\"type\":\"object\"}}}",
         "{\"n\":10,\"flag\":true,\"opts\":{\"x\":1}}", false},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        char body1[1024];
        snprintf(body1, sizeof body1,
                 "{\"messages\":[{\"role\":\"user\",\"content\":\"Count.\"}],\"tools\":[{\"type\":\"function\","
                 "\"function\":{\"name\":\"count\",\"parameters\":%s}}],\"chat_template_kwargs\":"
                 "{\"enable_thinking\":false}}",
                 cases[k].schema);
        kvt_request r1 = {0}, r2 = {0}, r3 = {0}, r4 = {0};
        kvt_tool_call *c = NULL;
        size_t n = 0, te = 0;
        CHECK_OK(kvt_request_parse(&r1, KVT_API_CHAT, body1, strlen(body1), m, NULL));
        CHECK_OK(kvt_reply_tool_calls(&r1, Q35_REPLY, strlen(Q35_REPLY), &c, &n, &te));
        bool ok = n == 1 && te == 9 && !strcmp(c[0].arguments, cases[k].args);
        if (n == 1) printf("    schema %zu: arguments %s\n", k, c[0].arguments);
        char *resp = ok ? kvt_response_json_calls(&r1, "chatcmpl-1", "m", Q35_REPLY, te, c, n, "tool_calls", NULL,
                                                  NULL, 0)
                        : NULL;
        json_t *j = resp ? json_loads(resp, 0, NULL) : NULL, *b = json_loads(body1, 0, NULL);
        json_t *msgs = json_object_get(b, "messages");
        json_array_append(msgs, json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message"));
        json_array_append_new(msgs, json_pack("{s:s, s:s, s:s}", "role", "tool", "tool_call_id", n ? c[0].id : "",
                                              "content", "3"));
        char *body2 = json_dumps(b, JSON_COMPACT);
        /* the client changes n (10 -> 11, whatever its type) */
        json_t *args = json_object_get(json_object_get(json_array_get(json_object_get(json_array_get(msgs, 1),
                                       "tool_calls"), 0), "function"), "arguments");
        json_t *a = json_loads(json_string_value(args), 0, NULL);
        json_object_set_new(a, "n", json_is_string(json_object_get(a, "n")) ? json_string("11") : json_integer(11));
        char *as = json_dumps(a, JSON_COMPACT);
        json_string_set(args, as ? as : "");
        char *body4 = json_dumps(b, JSON_COMPACT);
        q35_replay q = {c, n};
        kvt_parse_opts o = {.replay = q35_replay_cb, .replay_user = &q};
        ok = ok && body2 && body4 && !kvt_request_parse_opts(&r2, KVT_API_CHAT, body2, strlen(body2), m, &o, NULL) &&
             !kvt_request_parse(&r3, KVT_API_CHAT, body2, strlen(body2), m, NULL) &&
             !kvt_request_parse_opts(&r4, KVT_API_CHAT, body4, strlen(body4), m, &o, NULL);
        CHECKF(ok, "schema %zu: %s", k, kvt_errmsg());
        CHECKF(continues(&r1, &r2), "schema %zu: with the replay the next request does not continue: '%s'", k,
               kvt_test_esc(r2.prompt + r1.prompt_len, r2.prompt_len - r1.prompt_len));
        bool canon = continues(&r1, &r3);
        printf("    schema %zu: the call rendered as the template writes it %s what was sampled\n", k,
               canon ? "is" : "is not");
        CHECK(canon == cases[k].canonical_same);
        CHECKF(!continues(&r1, &r4) && memmem(r4.prompt + r1.prompt_len, r4.prompt_len - r1.prompt_len,
                                              "<parameter=n>\n11\n", 17),
               "schema %zu: a changed call was replayed: '%s'", k,
               kvt_test_esc(r4.prompt + r1.prompt_len, r4.prompt_len - r1.prompt_len));
        free(as);
        json_decref(a);
        free(body2);
        free(body4);
        free(resp);
        json_decref(j);
        json_decref(b);
        kvt_tool_calls_free(c, n);
        kvt_request_free(&r1);
        kvt_request_free(&r2);
        kvt_request_free(&r3);
        kvt_request_free(&r4);
    }
    kvt_model_close(m);
}
