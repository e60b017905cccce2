/* Chat templates (template.h): the neutral conversation (kvt_chat) that
 * api.c reads out of every api's request body, rendered into the model's
 * prompt text; and the model's markup read back out of what it generates.
 *
 * This file owns the table that picks a template for a model, the
 * DeepSeek-V4 markers and fixed texts (tools header and footer,
 * reasoning-effort preambles), the plain template's tools heading, the JSON
 * writer of the templates' `tojson` filter, the deepseek and plain
 * renderers, the DSML tool-call parser of generated text, the split of a
 * thinking-mode reply and the helpers the other template files share
 * (template_impl.h). api.c (request parsing) and reply.c (response and SSE
 * bodies) know none of it; src/app/server.c gets the turn markers it checkpoints at and the
 * tokens that end a turn from the table (kvt_template_tokens_get).
 *
 * Why it is shaped so:
 *  - Templates render message text byte for byte, with fixed separators and
 *    markers, so that a conversation resent with one more turn renders to a
 *    string that extends the previous rendering. That append-only growth is
 *    what lets the session and the disk tier reuse the cached prefix. Tool
 *    definitions and call arguments arrive here already canonical (api.c),
 *    and a tool call the server sampled can be rendered back with the bytes
 *    it sampled (the replay hook, deepseek).
 *  - Each family's template is the model's own chat template byte for byte
 *    (tests/test_template.c renders both), except where that template would
 *    rewrite the history (it drops earlier turns' reasoning): there kvtier
 *    keeps what the model saw. The markers are special tokens of the
 *    model's vocabulary, and each family's parser reads its own tool-call
 *    syntax back out of generated text.
 *  - A template is picked by the model's GGUF chat template text (texts
 *    distinctive of the family, so a template of another layout is never
 *    rendered as one it resembles), else by the architecture, else plain.
 *  - A thinking-mode reply (REASONING</think>ANSWER) is split at its first
 *    </think>, only what the template writes around the parts trimmed, so
 *    that the reasoning a client sends back with the turn renders to the
 *    bytes the model sampled.
 *  - A new template family is a render function and a row of kvt_templates.
 *
 * docs/API.md is the user-facing description of the templates.
 */
#include "chat/template_impl.h"
#include "base/jsonstr.h"
#include "base/util.h"

#include <jansson.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The DeepSeek-V4 chat markers; each of BOS, EOS, User, Assistant, the
 * think tags, ｜DSML｜ and the tool_result tags is one special token of the
 * built-in byte tokenizer (src/text/tokenizer.c, ids 256..264). ｜ is U+FF5C,
 * ▁ is U+2581. */
#define FW_BAR "\xef\xbd\x9c"
#define SP_MARK "\xe2\x96\x81"
#define DS_MARK(words) "<" FW_BAR words FW_BAR ">"
#define DS_BOS DS_MARK("begin" SP_MARK "of" SP_MARK "sentence")
#define DS_EOS DS_MARK("end" SP_MARK "of" SP_MARK "sentence")
#define DS_USER DS_MARK("User")
#define DS_ASSISTANT DS_MARK("Assistant")
#define THINK_BEGIN "<think>"
#define THINK_END "</think>"
#define DSML FW_BAR "DSML" FW_BAR
#define DS_CALLS_BEGIN "<" DSML "tool_calls>"
#define DS_CALLS_END "</" DSML "tool_calls>"
#define DS_INVOKE "<" DSML "invoke name=\""
#define DS_INVOKE_END "</" DSML "invoke>"
#define DS_PARAM "<" DSML "parameter name=\""
#define DS_PARAM_END "</" DSML "parameter>"
#define DS_RESULT_BEGIN "<tool_result>"
#define DS_RESULT_END "</tool_result>"
/* Between system texts, and between (plain template) messages. */
#define SEP KVT_CHAT_SEP

/* The tool definitions in the plain template: this heading, then one
 * canonical JSON object per line. */
#define TOOLS_HEAD "## Tools\n\nYou can call these functions, each given as JSON with its name, description " \
                   "and parameters (a JSON Schema):\n\n"

/* The DeepSeek-V4-Flash template's texts around the tool schemas (in the
 * system part) and the reasoning-effort preambles (before it). */
#define V4_TOOLS_HEADER                                                                                            \
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by " \
    "writing a \"" DS_CALLS_BEGIN "\" block like the following:\n\n" DS_CALLS_BEGIN "\n" DS_INVOKE              \
    "$TOOL_NAME\">\n" DS_PARAM "$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE" DS_PARAM_END "\n...\n" \
    DS_INVOKE_END "\n" DS_INVOKE "$TOOL_NAME2\">\n...\n" DS_INVOKE_END "\n" DS_CALLS_END "\n\nString parameters " \
    "should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, "       \
    "objects), pass the value in JSON format and set `string=\"false\"`.\n\nIf thinking_mode is enabled "         \
    "(triggered by " THINK_BEGIN "), you MUST output your complete reasoning inside " THINK_BEGIN "..."           \
    THINK_END " BEFORE any tool calls or final response.\n\nOtherwise, output directly after " THINK_END         \
    " with tool calls or final response.\n\n### Available Tool Schemas\n\n"
#define V4_TOOLS_FOOTER "\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
#define V4_EFFORT_HIGH                                                                                               \
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your thinking " \
    "and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic "  \
    "against all potential paths, edge cases, and adversarial scenarios.\nExplicitly write out your entire "      \
    "deliberation process, documenting every intermediate step, considered alternative, and rejected "             \
    "hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
#define V4_EFFORT_MAX                                                                                                \
    "Reasoning Effort: Beyond maximum \xe2\x80\x94 exhaustive, relentless, and uncompromising.\nYou MUST reason "  \
    "with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose the problem "  \
    "into its most fundamental components, trace every causal chain to its root, and resolve the underlying "     \
    "cause rather than any surface symptom.\nDo not stop reasoning until you have independently verified the "    \
    "solution from multiple angles and are certain that no assumption remains unchecked and no error remains "    \
    "undiscovered.\n\n"
/* ---- the conversation ----------------------------------------------------- */

void kvt_turn_free(kvt_turn *t)
{
    for (size_t k = 0; k < t->n_calls; k++) {
        free(t->calls[k].id);
        free(t->calls[k].name);
        free(t->calls[k].args);
        json_decref(t->calls[k].argv);
    }
    free(t->calls);
    free(t->text);
    free(t->reasoning);
    *t = (kvt_turn){0};
}

void kvt_chat_free(kvt_chat *c)
{
    for (size_t i = 0; i < c->n; i++) kvt_turn_free(&c->t[i]);
    free(c->t);
    kvt_wbuf_free(&c->tools);
    json_decref(c->fns);
    *c = (kvt_chat){0};
}

/* ---- template JSON (template_impl.h) -------------------------------------- */

void kvt_tpl_js_number(kvt_wbuf *b, double d)
{
    char e[40], out[64];
    if (d == 0) { kvt_wbuf_puts(b, "0"); return; }
    int p = 0;
    for (; p < 17; p++) {
        snprintf(e, sizeof e, "%.*e", p, d);
        if (strtod(e, NULL) == d) break;
    }
    /* e: [-]D[.DDD]e±XX -> the digits s (k of them) and n, x = 0.s x 10^n */
    const char *q = e;
    size_t o = 0;
    if (*q == '-') out[o++] = *q++;
    char dig[24];
    int k = 0;
    for (; *q && *q != 'e'; q++)
        if (*q != '.') dig[k++] = *q;
    while (k > 1 && dig[k - 1] == '0') k--;
    int n = atoi(q + 1) + 1;
    if (k <= n && n <= 21) {
        memcpy(out + o, dig, (size_t)k), o += (size_t)k;
        for (int i = k; i < n; i++) out[o++] = '0';
    } else if (0 < n && n <= 21) {
        memcpy(out + o, dig, (size_t)n), o += (size_t)n;
        out[o++] = '.';
        memcpy(out + o, dig + n, (size_t)(k - n)), o += (size_t)(k - n);
    } else if (-6 < n && n <= 0) {
        out[o++] = '0', out[o++] = '.';
        for (int i = 0; i < -n; i++) out[o++] = '0';
        memcpy(out + o, dig, (size_t)k), o += (size_t)k;
    } else {
        out[o++] = dig[0];
        if (k > 1) {
            out[o++] = '.';
            memcpy(out + o, dig + 1, (size_t)(k - 1)), o += (size_t)(k - 1);
        }
        o += (size_t)snprintf(out + o, sizeof out - o, "e%c%d", n - 1 < 0 ? '-' : '+', abs(n - 1));
    }
    kvt_wbuf_put(b, out, o);
}

void kvt_tpl_py_real(kvt_wbuf *b, double d)
{
    char e[40], out[64];
    if (d == 0) { kvt_wbuf_puts(b, signbit(d) ? "-0.0" : "0.0"); return; }
    int p = 0;
    for (; p < 17; p++) {
        snprintf(e, sizeof e, "%.*e", p, d);
        if (strtod(e, NULL) == d) break;
    }
    const char *q = e;
    size_t o = 0;
    if (*q == '-') out[o++] = *q++;
    char dig[24];
    int k = 0;
    for (; *q && *q != 'e'; q++)
        if (*q != '.') dig[k++] = *q;
    while (k > 1 && dig[k - 1] == '0') k--;
    int x = atoi(q + 1); /* d = D.DDD x 10^x */
    if (x >= -4 && x < 16) {
        int n = x + 1; /* digits before the point */
        if (n <= 0) {
            out[o++] = '0', out[o++] = '.';
            for (int i = 0; i < -n; i++) out[o++] = '0';
            memcpy(out + o, dig, (size_t)k), o += (size_t)k;
        } else if (k <= n) {
            memcpy(out + o, dig, (size_t)k), o += (size_t)k;
            for (int i = k; i < n; i++) out[o++] = '0';
            out[o++] = '.', out[o++] = '0';
        } else {
            memcpy(out + o, dig, (size_t)n), o += (size_t)n;
            out[o++] = '.';
            memcpy(out + o, dig + n, (size_t)(k - n)), o += (size_t)(k - n);
        }
    } else {
        out[o++] = dig[0];
        if (k > 1) {
            out[o++] = '.';
            memcpy(out + o, dig + 1, (size_t)(k - 1)), o += (size_t)(k - 1);
        }
        o += (size_t)snprintf(out + o, sizeof out - o, "e%c%02d", x < 0 ? '-' : '+', abs(x));
    }
    kvt_wbuf_put(b, out, o);
}

/* A new line and depth levels of indent spaces (nothing without indent). */
static void json_pad(kvt_wbuf *b, int indent, int depth)
{
    if (indent <= 0) return;
    kvt_wbuf_puts(b, "\n");
    for (int i = 0; i < indent * depth; i++) kvt_wbuf_put(b, " ", 1);
}

static void tojson_at(kvt_wbuf *b, const json_t *v, int indent, int depth)
{
    const char *key;
    json_t *x;
    size_t i = 0;
    const char *sep = indent > 0 ? "," : ", ";
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        kvt_wbuf_put(b, "{", 1);
        json_object_foreach((json_t *)v, key, x) {
            if (i++) kvt_wbuf_puts(b, sep);
            json_pad(b, indent, depth + 1);
            kvt_json_string(b, key, strlen(key));
            kvt_wbuf_puts(b, ": ");
            tojson_at(b, x, indent, depth + 1);
        }
        if (i) json_pad(b, indent, depth);
        kvt_wbuf_put(b, "}", 1);
        return;
    case JSON_ARRAY:
        kvt_wbuf_put(b, "[", 1);
        for (; i < json_array_size(v); i++) {
            if (i) kvt_wbuf_puts(b, sep);
            json_pad(b, indent, depth + 1);
            tojson_at(b, json_array_get(v, i), indent, depth + 1);
        }
        if (i) json_pad(b, indent, depth);
        kvt_wbuf_put(b, "]", 1);
        return;
    case JSON_REAL: kvt_tpl_js_number(b, json_real_value(v)); return;
    default: kvt_json_scalar(b, v); return;
    }
}

void kvt_tpl_tojson(kvt_wbuf *b, const json_t *v, int indent) { tojson_at(b, v, indent, 0); }

static void tojson(kvt_wbuf *b, const json_t *v) { tojson_at(b, v, 0, 0); }

void kvt_tpl_tool_json(kvt_wbuf *b, const json_t *fn, int indent)
{
    kvt_wbuf_put(b, "{", 1);
    json_pad(b, indent, 1);
    kvt_wbuf_puts(b, indent > 0 ? "\"type\": \"function\"," : "\"type\": \"function\", ");
    json_pad(b, indent, 1);
    kvt_wbuf_puts(b, "\"function\": ");
    tojson_at(b, fn, indent, 1);
    json_pad(b, indent, 0);
    kvt_wbuf_put(b, "}", 1);
}

void kvt_tpl_args_json(kvt_wbuf *b, const kvt_turn_call *c)
{
    if (c->argv) tojson(b, c->argv);
    else if (c->args_json) kvt_wbuf_put(b, c->args, c->args_len);
    else kvt_json_string(b, c->args, c->args_len);
}

const char *kvt_tpl_role(int role)
{
    switch (role) {
    case KVT_ROLE_USER: return "user";
    case KVT_ROLE_ASSISTANT: return "assistant";
    case KVT_ROLE_TOOL: return "tool";
    default: return "system";
    }
}

/* ---- templates ------------------------------------------------------------ */

/* One assistant tool call in the DSML markup: the bytes the server sampled
 * for it when the replay hook has them (for the first call they include the
 * separator and the <｜DSML｜tool_calls> opener, and every call its trailing
 * whitespace; see kvt_tool_calls_parse), else as the template writes it:
 * the opener before the first call, then
 *   <｜DSML｜invoke name="NAME">\n
 *   <｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>\n   (string values)
 *   <｜DSML｜parameter name="KEY" string="false">JSON</｜DSML｜parameter>\n   (any other value)
 *   </｜DSML｜invoke>\n
 * with a bare "\n" for a call without arguments (or with arguments that are
 * not a JSON object, which the template cannot take apart). */
static void render_call(kvt_wbuf *b, const kvt_turn_call *c, size_t k, kvt_replay_fn replay, void *replay_user)
{
    if (c->id && replay && replay(replay_user, c->id, b)) return;
    if (k == 0) kvt_wbuf_puts(b, "\n\n" DS_CALLS_BEGIN "\n");
    kvt_wbuf_puts(b, DS_INVOKE);
    kvt_wbuf_puts(b, c->name);
    kvt_wbuf_puts(b, "\">\n");
    const char *key;
    json_t *v;
    json_object_foreach(c->argv, key, v) {
        kvt_wbuf_puts(b, DS_PARAM);
        kvt_wbuf_puts(b, key);
        if (json_is_string(v)) {
            kvt_wbuf_puts(b, "\" string=\"true\">");
            kvt_wbuf_put(b, json_string_value(v), json_string_length(v));
        } else {
            kvt_wbuf_puts(b, "\" string=\"false\">");
            tojson(b, v);
        }
        kvt_wbuf_puts(b, DS_PARAM_END "\n");
    }
    if (!json_object_size(c->argv)) kvt_wbuf_puts(b, "\n");
    kvt_wbuf_puts(b, DS_INVOKE_END "\n");
}

/* deepseek: the DeepSeek-V4-Flash chat template
 * (models/templates/deepseek-ai-DeepSeek-V4-Flash-0731.jinja in llama.cpp),
 * byte for byte:
 *
 *   BOS, in thinking mode the reasoning-effort preamble ("high", "max"), then
 *   the system part: every system text joined with "\n\n", and with tools
 *   the tools header, each function's JSON on its own line, the footer.
 *   user, developer <｜User｜>text; a user, developer or tool message right
 *               after another of them continues the same turn after "\n\n"
 *   tool        <｜User｜><tool_result>text</tool_result> (or continued likewise)
 *   assistant   <｜Assistant｜></think>text<｜end▁of▁sentence｜>, in thinking mode
 *               <｜Assistant｜><think>reasoning</think>text<｜end▁of▁sentence｜>;
 *               tool calls after the text (render_call) closed by
 *               </｜DSML｜tool_calls>
 *
 * then <｜Assistant｜></think> (thinking: <｜Assistant｜><think>) to prompt the
 * reply. Thinking mode keeps every turn's reasoning, which is the template
 * with drop_thinking = false: the template's default drops the reasoning of
 * turns before the last user message, which would rewrite the cached prefix
 * at every new user turn. A conversation that ends with an assistant turn
 * without tool calls is a prefill: the template's rendering without
 * the generation prompt and without that turn's final end-of-sentence, so the
 * reply continues its text. Either way each rendering is a prefix of the
 * next one. Returns whether the rendering ends with the generation prompt
 * (false for a prefill): only then does a thinking-mode reply begin with its
 * reasoning. */
static bool render_deepseek(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user)
{
    kvt_wbuf_puts(b, DS_BOS);
    if (ch->thinking && ch->effort) kvt_wbuf_puts(b, ch->effort == 2 ? V4_EFFORT_MAX : V4_EFFORT_HIGH);
    size_t n_sys = 0, sys_len = 0, last = SIZE_MAX;
    for (size_t i = 0; i < ch->n; i++) {
        if (ch->t[i].role != KVT_ROLE_SYSTEM) { last = i; continue; }
        if (n_sys++) kvt_wbuf_puts(b, SEP), sys_len += LIT(SEP);
        kvt_wbuf_put(b, ch->t[i].text, ch->t[i].len);
        sys_len += ch->t[i].len;
    }
    if (ch->n_tools) {
        if (sys_len) kvt_wbuf_puts(b, SEP);
        kvt_wbuf_puts(b, V4_TOOLS_HEADER);
        for (size_t i = 0; i < json_array_size(ch->fns); i++) {
            tojson(b, json_array_get(ch->fns, i));
            kvt_wbuf_puts(b, "\n");
        }
        kvt_wbuf_puts(b, V4_TOOLS_FOOTER);
    }
    bool in_user = false;
    for (size_t i = 0; i < ch->n; i++) {
        const kvt_turn *t = &ch->t[i];
        if (t->role == KVT_ROLE_SYSTEM) continue;
        if (t->role != KVT_ROLE_ASSISTANT) {
            kvt_wbuf_puts(b, in_user ? SEP : DS_USER);
            in_user = true;
            if (t->role == KVT_ROLE_TOOL) kvt_wbuf_puts(b, DS_RESULT_BEGIN);
            kvt_wbuf_put(b, t->text, t->len);
            if (t->role == KVT_ROLE_TOOL) kvt_wbuf_puts(b, DS_RESULT_END);
            continue;
        }
        in_user = false;
        kvt_wbuf_puts(b, DS_ASSISTANT);
        if (ch->thinking) {
            kvt_wbuf_puts(b, THINK_BEGIN);
            if (t->reasoning) kvt_wbuf_put(b, t->reasoning, t->rlen);
        }
        kvt_wbuf_puts(b, THINK_END);
        kvt_wbuf_put(b, t->text, t->len);
        for (size_t k = 0; k < t->n_calls; k++) render_call(b, &t->calls[k], k, replay, replay_user);
        if (t->n_calls) kvt_wbuf_puts(b, DS_CALLS_END);
        if (i != last || t->n_calls) kvt_wbuf_puts(b, DS_EOS);
    }
    if (last != SIZE_MAX && ch->t[last].role == KVT_ROLE_ASSISTANT && !ch->t[last].n_calls) return false;
    kvt_wbuf_puts(b, ch->thinking ? DS_ASSISTANT THINK_BEGIN : DS_ASSISTANT THINK_END);
    return true;
}

/* One piece of the plain rendering: SEP before every piece but the first. */
static void plain_piece(kvt_wbuf *b, size_t *k, const void *p, size_t n)
{
    if ((*k)++) kvt_wbuf_puts(b, SEP);
    kvt_wbuf_put(b, p, n);
}

/* plain: the text of every message in order, joined with SEP, no markers;
 * the tool definitions after the leading system messages; an assistant's
 * tool calls after its text as {"name":…,"arguments":…} lines; a tool
 * result as its text. For models trained on raw text, the reply continues
 * the last message: there is no generation prompt (false). Every call
 * renders canonically (no replay). */
static bool render_plain(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user)
{
    size_t k = 0;
    bool tools_done = ch->n_tools == 0;
    for (size_t i = 0; i <= ch->n; i++) {
        const kvt_turn *t = i < ch->n ? &ch->t[i] : NULL;
        if (!tools_done && (!t || !kvt_role_is_system(t->role))) {
            plain_piece(b, &k, TOOLS_HEAD, LIT(TOOLS_HEAD));
            kvt_wbuf_put(b, ch->tools.p, ch->tools.len);
            tools_done = true;
        }
        if (!t) break;
        if (!t->n_calls || t->len) plain_piece(b, &k, t->text, t->len);
        for (size_t c = 0; c < t->n_calls; c++) {
            const kvt_turn_call *x = &t->calls[c];
            plain_piece(b, &k, "{\"name\":", 8);
            kvt_json_string(b, x->name, strlen(x->name));
            kvt_wbuf_puts(b, ",\"arguments\":");
            if (x->args_json) kvt_wbuf_put(b, x->args, x->args_len);
            else kvt_json_string(b, x->args, x->args_len);
            kvt_wbuf_puts(b, "}");
        }
    }
    return false;
}

/* ---- the table ------------------------------------------------------------ */

/* The markers of the other families, for the rows (their renderers write
 * them in their own files). */
#define L3_EOT "<|eot_id|>"
#define IM_START "<|im_start|>"
#define GEMMA_START "<start_of_turn>"
#define QW_CALL_FORMAT "<args-json-object>" /* Qwen's JSON tool-call instructions */

static int dsml_tool_calls(const char *text, size_t len, const json_t *fns, kvt_tool_call **calls, size_t *n,
                           size_t *text_end);
static size_t dsml_scan(kvt_tool_scan *s, const char *text, size_t len);

/* In lookup order: a template text is matched against the rows top down, so
 * a row whose marks another's include comes first (Qwen 3 before Qwen 2.5:
 * both are ChatML). */
const kvt_template kvt_templates[] = {
    /* DeepSeek-V4's markers are the built-in byte tokenizer's: by architecture */
    {.name = "deepseek", .arches = {"deepseek4"}, .render = render_deepseek, .has_bos = true, .special = true,
     .thinking = true, .tool_calls = dsml_tool_calls, .tool_calls_text_len = kvt_tool_calls_text_len,
     .tool_calls_scan = dsml_scan,
     .user_turn = DS_USER, .assistant_turn = DS_ASSISTANT, .end_turn = {DS_EOS}},
    /* Llama 3.1, 3.2, 3.3 (the 3.1 layout: a system header with the dates) */
    {.name = "llama3",
     .marks = {"<|start_header_id|>", L3_EOT, "Cutting Knowledge Date", "please respond with a JSON for a function call"},
     .render = kvt_render_llama3, .has_bos = true, .special = true, .tool_calls = kvt_llama3_tool_calls,
     .tool_calls_text_len = kvt_llama3_tool_calls_text_len,
     .tool_calls_scan = kvt_llama3_tool_calls_scan, .user_turn = "<|start_header_id|>user<|end_header_id|>",
     .assistant_turn = "<|start_header_id|>assistant<|end_header_id|>", .end_turn = {L3_EOT, "<|eom_id|>", "<|end_of_text|>"}},
    /* Qwen 3.5 (ChatML, XML tool calls, the prompt opens <think>) */
    {.name = "qwen3.5",
     .marks = {IM_START, "<function=example_function_name>", "enable_thinking is defined and enable_thinking is false"},
     .arches = {"qwen35", "qwen35moe"}, .render = kvt_render_qwen35, .special = true, .thinking = true,
     .thinking_default = true, .think_ws = 2, .tool_calls = kvt_qwen35_tool_calls,
     .tool_calls_text_len = kvt_qwen_tool_calls_text_len,
     .tool_calls_scan = kvt_qwen_tool_calls_scan, .user_turn = IM_START "user",
     .assistant_turn = IM_START "assistant", .end_turn = {"<|im_end|>", "<|endoftext|>"}},
    /* Qwen 3 (ChatML with <think> and enable_thinking) */
    {.name = "qwen3", .marks = {IM_START, QW_CALL_FORMAT, "reasoning_content.strip('\\n')", "enable_thinking"},
     .arches = {"qwen3", "qwen3moe"},
     .render = kvt_render_qwen3, .special = true, .thinking = true, .thinking_default = true,
     .think_open = "<think>", .think_ws = 1, .tool_calls = kvt_qwen_tool_calls,
     .tool_calls_text_len = kvt_qwen_tool_calls_text_len,
     .tool_calls_scan = kvt_qwen_tool_calls_scan, .user_turn = IM_START "user",
     .assistant_turn = IM_START "assistant",
     .end_turn = {"<|im_end|>", "<|endoftext|>"}},
    /* Qwen 2.5 (ChatML with Qwen's default system prompt) */
    {.name = "qwen2.5", .marks = {IM_START, "You are Qwen, created by Alibaba Cloud.", QW_CALL_FORMAT},
     .arches = {"qwen2"},
     .render = kvt_render_qwen25, .special = true, .tool_calls = kvt_qwen_tool_calls,
     .tool_calls_text_len = kvt_qwen_tool_calls_text_len,
     .tool_calls_scan = kvt_qwen_tool_calls_scan, .user_turn = IM_START "user",
     .assistant_turn = IM_START "assistant",
     .end_turn = {"<|im_end|>", "<|endoftext|>"}},
    /* Gemma 4 (its current template: results after their calls, in the model's turn) */
    {.name = "gemma4", .marks = {"<|turn>", "<|tool_call>", "format_tool_response_block"}, .arches = {"gemma4"},
     .render = kvt_render_gemma4, .has_bos = true, .special = true, .thinking = true,
     .think_open = "<|channel>thought", .think_close = "<channel|>", .think_ws = 2,
     .tool_calls = kvt_gemma4_tool_calls, .tool_calls_text_len = kvt_gemma4_tool_calls_text_len,
     .tool_calls_scan = kvt_gemma4_tool_calls_scan,
     .user_turn = "<|turn>user", .assistant_turn = "<|turn>model", .end_turn = {"<turn|>", "<|tool_response>", "<eos>"}},
    /* Gemma 3 (and Gemma 2's layout): no tool syntax */
    {.name = "gemma3", .marks = {GEMMA_START, "<end_of_turn>"}, .arches = {"gemma3"}, .render = kvt_render_gemma3,
     .has_bos = true, .special = true, .tool_calls = kvt_tool_calls_none,
     .tool_calls_text_len = kvt_tool_calls_none_text_len,
     .tool_calls_scan = kvt_tool_calls_none_scan, .user_turn = GEMMA_START "user",
     .assistant_turn = GEMMA_START "model",
     .end_turn = {"<end_of_turn>", "<eos>"}},
    /* the fallback: no markers; a reply's tool calls are still read in DSML */
    {.name = "plain", .render = render_plain, .tool_calls = dsml_tool_calls,
     .tool_calls_text_len = kvt_tool_calls_text_len, .tool_calls_scan = dsml_scan},
};
const size_t kvt_n_templates = sizeof kvt_templates / sizeof *kvt_templates;

static bool marks_match(const kvt_template *t, const char *src)
{
    if (!t->marks[0]) return false;
    for (size_t k = 0; k < sizeof t->marks / sizeof *t->marks && t->marks[k]; k++)
        if (!strstr(src, t->marks[k])) return false;
    return true;
}

const kvt_template *kvt_template_pick(const char *chat_template, const char *arch)
{
    const size_t last = kvt_n_templates - 1;
    for (size_t i = 0; chat_template && i < last; i++)
        if (marks_match(&kvt_templates[i], chat_template)) return &kvt_templates[i];
    for (size_t i = 0; arch && i < last; i++)
        for (size_t k = 0; k < sizeof kvt_templates[i].arches / sizeof *kvt_templates[i].arches; k++)
            if (kvt_templates[i].arches[k] && !strcmp(arch, kvt_templates[i].arches[k])) return &kvt_templates[i];
    return &kvt_templates[last];
}

const kvt_template *kvt_template_for(const kvt_model *m)
{
    kvt_model_info info = {0};
    if (m) kvt_model_info_get(m, &info);
    return kvt_template_pick(info.chat_template, info.arch);
}

const kvt_template *kvt_template_named(const char *name)
{
    for (size_t i = 0; name && i < kvt_n_templates; i++)
        if (!strcmp(kvt_templates[i].name, name)) return &kvt_templates[i];
    return NULL;
}

const char *kvt_template_name(const kvt_model *m) { return kvt_template_for(m)->name; }

/* text as one token of m, or -1. */
static int32_t one_token(const kvt_model *m, const char *text, size_t len)
{
    int32_t *ids = NULL, id = -1;
    size_t n = 0;
    if (kvt_tokenize(m, text, len, 0, true, &ids, &n) == KVT_OK && n == 1) id = ids[0];
    free(ids);
    return id;
}

/* A turn marker: its tokens when its opener (through the first '>') is one
 * token and they are at most 4. */
static size_t marker_tokens(const kvt_model *m, const char *text, int32_t out[4])
{
    const char *gt = text ? strchr(text, '>') : NULL;
    int32_t open = gt ? one_token(m, text, (size_t)(gt - text) + 1) : -1;
    int32_t *ids = NULL;
    size_t n = 0, got = 0;
    if (open >= 0 && kvt_tokenize(m, text, strlen(text), 0, true, &ids, &n) == KVT_OK && n && n <= 4 &&
        ids[0] == open) {
        memcpy(out, ids, n * sizeof *ids);
        got = n;
    }
    free(ids);
    return got;
}

void kvt_template_tokens_get(const kvt_template *t, const kvt_model *m, kvt_template_tokens *out)
{
    *out = (kvt_template_tokens){{0}, {0}, {0}, 0, 0, 0};
    if (!t || !m) return;
    out->n_user = marker_tokens(m, t->user_turn, out->user);
    out->n_assistant = marker_tokens(m, t->assistant_turn, out->assistant);
    for (size_t k = 0; k < sizeof t->end_turn / sizeof *t->end_turn && t->end_turn[k]; k++) {
        int32_t id = one_token(m, t->end_turn[k], strlen(t->end_turn[k]));
        if (id >= 0) out->end[out->n_end++] = id;
    }
}

/* ---- reading helpers (template_impl.h) ------------------------------------- */

bool kvt_tpl_is_space(char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

void kvt_tpl_trim(const char *s, size_t *a, size_t *b)
{
    while (*a < *b && kvt_tpl_is_space(s[*a])) (*a)++;
    while (*b > *a && kvt_tpl_is_space(s[*b - 1])) (*b)--;
}

void kvt_tpl_strip_char(const char *s, size_t *a, size_t *b, char c, bool left, bool right)
{
    while (left && *a < *b && s[*a] == c) (*a)++;
    while (right && *b > *a && s[*b - 1] == c) (*b)--;
}

void kvt_tpl_put_trim(kvt_wbuf *b, const char *s, size_t n)
{
    size_t x = 0, y = n;
    if (s) kvt_tpl_trim(s, &x, &y);
    if (y > x) kvt_wbuf_put(b, s + x, y - x);
}

const char *kvt_tpl_find(const char *s, size_t from, size_t to, const char *needle, size_t nl)
{
    return s && to > from ? memmem(s + from, to - from, needle, nl) : NULL;
}

size_t kvt_tpl_partial_tail(const char *text, size_t len, const char *marker)
{
    for (size_t k = strlen(marker) - 1; k > 0; k--)
        if (k <= len && !memcmp(text + len - k, marker, k)) return k;
    return 0;
}

bool kvt_tpl_utf8_ok(const char *s, size_t a, size_t b)
{
    const unsigned char *u = (const unsigned char *)s;
    for (size_t k; a < b; a += k)
        if (!u[a] || !(k = kvt_utf8_char(u + a, b - a))) return false;
    return true;
}

int kvt_tool_calls_none(const char *text, size_t len, const json_t *fns, kvt_tool_call **calls, size_t *n,
                        size_t *text_end)
{
    (void)fns;
    if (!calls || !n || !text_end || (!text && len)) return kvt_fail(KVT_EINVAL, "tool calls: NULL argument");
    *calls = NULL;
    *n = 0;
    *text_end = len;
    return KVT_OK;
}

size_t kvt_tool_calls_none_text_len(const char *text, size_t len) { return text ? len : 0; }

size_t kvt_tool_calls_none_scan(kvt_tool_scan *s, const char *text, size_t len)
{
    (void)s;
    return text ? len : 0;
}

/* ---- the streaming scan ------------------------------------------------------ */

_Atomic unsigned long long kvt_tool_scan_bytes;
int kvt_tool_scan_fault;

void kvt_tpl_scan_ws(kvt_tool_scan *s, const char *text, size_t to)
{
    for (size_t i = s->done; i < to; i++)
        if (kvt_tpl_is_space(text[i])) {
            if (s->run_end != i) s->run = i;
            s->run_end = i + 1;
        }
}

size_t kvt_tpl_scan_opener(kvt_tool_scan *s, const char *text, size_t len, const char *opener)
{
    if (!text) return 0;
    if (kvt_tool_scan_fault || len < s->done) *s = (kvt_tool_scan){0};
    if (s->found) return s->text_end;
    /* an opener may have begun in the last ol - 1 bytes looked at */
    size_t ol = strlen(opener), from = s->done >= ol - 1 ? s->done - (ol - 1) : 0;
    atomic_fetch_add_explicit(&kvt_tool_scan_bytes, len - from, memory_order_relaxed);
    const char *a = kvt_tpl_find(text, from, len, opener, ol);
    size_t e = a ? (size_t)(a - text) : len;
    kvt_tpl_scan_ws(s, text, e);
    if (a) {
        s->found = true;
        s->text_end = s->run_end == e ? s->run : e;
        return s->text_end;
    }
    s->done = len;
    e = len - kvt_tpl_partial_tail(text, len, opener); /* the tail is no whitespace: the opener has none */
    return s->run_end == e ? s->run : e;
}

/* ---- tool calls in generated text ---------------------------------------- */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* "call_" + 16 hex digits: a counter through a bijective mix, so ids never
 * repeat within a run, offset by a seed from the clock and the process id so
 * that they are unlikely to repeat across runs (a client's history may hold
 * ids from an earlier run of the server). */
static void new_call_id(char out[24])
{
    static _Atomic uint64_t seed, counter;
    uint64_t s = atomic_load(&seed);
    if (!s) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t x = mix64((uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec) ^
                     mix64((uint64_t)getpid() << 20 ^ (uint64_t)(uintptr_t)out);
        uint64_t zero = 0;
        atomic_compare_exchange_strong(&seed, &zero, x | 1);
        s = atomic_load(&seed);
    }
    uint64_t v = mix64(s + atomic_fetch_add(&counter, 1) * 0x9e3779b97f4a7c15ULL);
    snprintf(out, 24, "call_%016llx", (unsigned long long)v);
}

int kvt_tpl_calls_add(kvt_tpl_calls *c, const char *name, size_t nl, const json_t *args, size_t raw_off,
                      size_t raw_len)
{
    if (c->n == c->cap) {
        size_t c2 = c->cap ? c->cap * 2 : 4, bytes;
        kvt_tool_call *p = kvt_mul_ok(c2, sizeof *p, &bytes) ? realloc(c->v, bytes) : NULL;
        if (!p) return KVT_ENOMEM;
        c->v = p;
        c->cap = c2;
    }
    kvt_tool_call *t = &c->v[c->n++];
    memset(t, 0, sizeof *t);
    char id[24];
    new_call_id(id);
    t->id = kvt_strndup(id, strlen(id));
    t->name = kvt_strndup(name, nl);
    t->arguments = kvt_json_dumps(args, JSON_COMPACT);
    t->valid = true;
    t->raw_off = raw_off;
    t->raw_len = raw_len;
    return t->id && t->name && t->arguments ? KVT_OK : KVT_ENOMEM;
}

static const char *find(const char *s, size_t from, size_t to, const char *needle, size_t nl)
{
    return to > from ? memmem(s + from, to - from, needle, nl) : NULL;
}

static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* [*a, *b) without surrounding whitespace. */
static void trim(const char *s, size_t *a, size_t *b)
{
    while (*a < *b && is_space(s[*a])) (*a)++;
    while (*b > *a && is_space(s[*b - 1])) (*b)--;
}

void kvt_tool_calls_free(kvt_tool_call *calls, size_t n)
{
    if (!calls) return;
    for (size_t i = 0; i < n; i++) {
        free(calls[i].id);
        free(calls[i].name);
        free(calls[i].arguments);
    }
    free(calls);
}

#define utf8_ok kvt_tpl_utf8_ok

/* s[*p, to) starts with lit (after whitespace when skip): move *p past it. */
static bool eat(const char *s, size_t *p, size_t to, const char *lit, bool skip)
{
    size_t q = *p, n = strlen(lit);
    while (skip && q < to && is_space(s[q])) q++;
    if (to - q < n || memcmp(s + q, lit, n)) return false;
    *p = q + n;
    return true;
}

/* A quoted attribute value: s[*p..) up to the next '"', which must be
 * followed by tail; [*va, *vb) receives the value, *p moves past tail. A
 * value holds no control bytes and no '<'. */
static bool attr(const char *s, size_t *p, size_t to, const char *tail, size_t *va, size_t *vb)
{
    const char *q = memchr(s + *p, '"', to - *p);
    if (!q) return false;
    *va = *p;
    *vb = (size_t)(q - s);
    for (size_t i = *va; i < *vb; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f || s[i] == '<') return false;
    size_t r = *vb + 1;
    if (!eat(s, &r, to, tail, false)) return false;
    *p = r;
    return true;
}

/* One <｜DSML｜invoke name="NAME">...</｜DSML｜invoke> at s[*p..) (after
 * whitespace): its name and its parameters as a JSON object, in the order
 * written; a string="true" value is the string as written, a string="false"
 * value is read as JSON (a value that is not JSON stays a string). *p moves
 * past the invoke end and the whitespace after it. 1: a call; 0: no
 * (complete) call here; -1: out of memory. */
static int dsml_invoke(const char *s, size_t *p, size_t to, size_t *na, size_t *nb, json_t **args)
{
    size_t q = *p;
    *args = NULL;
    if (!eat(s, &q, to, DS_INVOKE, true) || !attr(s, &q, to, ">", na, nb) || *nb == *na || !utf8_ok(s, *na, *nb))
        return 0;
    json_t *obj = json_object();
    if (!obj) return -1;
    for (;;) {
        if (eat(s, &q, to, DS_INVOKE_END, true)) break;
        size_t ka, kb;
        if (!eat(s, &q, to, DS_PARAM, true) || !attr(s, &q, to, " string=\"", &ka, &kb)) goto no;
        bool str;
        if (eat(s, &q, to, "true\">", false)) str = true;
        else if (eat(s, &q, to, "false\">", false)) str = false;
        else goto no;
        const char *e = find(s, q, to, DS_PARAM_END, LIT(DS_PARAM_END));
        if (!e || !utf8_ok(s, q, (size_t)(e - s)) || !utf8_ok(s, ka, kb)) goto no;
        size_t va = q, vb = (size_t)(e - s);
        json_t *v = NULL;
        if (!str) {
            size_t ta = va, tb = vb;
            trim(s, &ta, &tb);
            json_error_t je;
            v = json_loadb(s + ta, tb - ta, JSON_DECODE_ANY, &je);
            if (!v && json_error_code(&je) == json_error_out_of_memory) goto oom;
        }
        if (!v) v = json_stringn(s + va, vb - va);
        char *key = kvt_strndup(s + ka, kb - ka);
        int bad_set = !v || !key || json_object_set_new(obj, key, v);
        free(key);
        if (bad_set) goto oom;
        q = vb + LIT(DS_PARAM_END);
    }
    while (q < to && is_space(s[q])) q++;
    *p = q;
    *args = obj;
    return 1;
no:
    json_decref(obj);
    return 0;
oom:
    json_decref(obj);
    return -1;
}

int kvt_tool_calls_parse(const char *text, size_t len, kvt_tool_call **calls, size_t *n, size_t *text_end)
{
    if (!calls || !n || !text_end || (!text && len)) return kvt_fail(KVT_EINVAL, "tool calls: NULL argument");
    *calls = NULL;
    *n = 0;
    *text_end = len;
    const char *cb = find(text, 0, len, DS_CALLS_BEGIN, LIT(DS_CALLS_BEGIN));
    if (!cb) return KVT_OK;
    size_t start = (size_t)(cb - text), pos = start + LIT(DS_CALLS_BEGIN);
    while (start > 0 && is_space(text[start - 1])) start--;
    kvt_tool_call *v = NULL;
    size_t nv = 0, cap = 0, from = start;
    for (;;) {
        size_t na, nb;
        json_t *args;
        int got = dsml_invoke(text, &pos, len, &na, &nb, &args);
        if (got < 0) goto nomem;
        if (!got) break; /* unfinished or malformed: what follows is not read as calls */
        if (nv == cap) {
            size_t c2 = cap ? cap * 2 : 4, bytes;
            kvt_tool_call *p = kvt_mul_ok(c2, sizeof *p, &bytes) ? realloc(v, bytes) : NULL;
            if (!p) { json_decref(args); goto nomem; }
            v = p;
            cap = c2;
        }
        kvt_tool_call *c = &v[nv++];
        memset(c, 0, sizeof *c);
        char id[24];
        new_call_id(id);
        c->id = kvt_strndup(id, strlen(id));
        c->name = kvt_strndup(text + na, nb - na);
        c->arguments = kvt_json_dumps(args, JSON_COMPACT);
        c->valid = true;
        c->raw_off = from;
        c->raw_len = pos - from;
        json_decref(args);
        if (!c->id || !c->name || !c->arguments) goto nomem;
        from = pos;
    }
    if (!nv) {
        free(v);
        return KVT_OK;
    }
    *text_end = start;
    *calls = v;
    *n = nv;
    return KVT_OK;
nomem:
    kvt_tool_calls_free(v, nv);
    return kvt_fail(KVT_ENOMEM, "tool calls: out of memory");
}

/* The table's row: DSML writes each value's type (string="true|false"). */
static int dsml_tool_calls(const char *text, size_t len, const json_t *fns, kvt_tool_call **calls, size_t *n,
                           size_t *text_end)
{
    (void)fns;
    return kvt_tool_calls_parse(text, len, calls, n, text_end);
}

/* Streaming: the text before <｜DSML｜tool_calls>, a tail that may start one
 * held back (a marker may be arriving), and the whitespace before either,
 * which the reply's text loses when calls follow. */
static size_t dsml_scan(kvt_tool_scan *s, const char *text, size_t len)
{
    return kvt_tpl_scan_opener(s, text, len, DS_CALLS_BEGIN);
}

size_t kvt_tool_calls_text_len(const char *text, size_t len)
{
    kvt_tool_scan s = {0};
    return dsml_scan(&s, text, len);
}

/* ---- thinking mode ---------------------------------------------------------- */

/* The first </think> ends the reasoning: the template writes one per turn,
 * and a reasoning cannot hold the special token's text (the tokenizer would
 * read it back as the token). Nothing is trimmed on either side: the client
 * sends both parts back and the template renders them around </think>, so
 * the turn is the bytes the model sampled. */
/* kvt_think_split with the search for </think> from byte from on (none
 * begins before it). */
static bool split_from(const char *text, size_t len, bool partial, size_t from, size_t *reasoning, size_t *answer)
{
    if (!text) len = 0;
    size_t rs = len, as = len;
    const char *e = find(text, from < len ? from : len, len, THINK_END, LIT(THINK_END));
    if (e) {
        rs = (size_t)(e - text);
        as = rs + LIT(THINK_END);
    } else if (partial) {
        /* the closing tag may be arriving (a byte at a time, when the model
         * spells it out): hold back a tail that starts it */
        for (size_t k = LIT(THINK_END) - 1; k > 0; k--)
            if (k <= len && !memcmp(text + len - k, THINK_END, k)) { rs = len - k; break; }
    }
    if (reasoning) *reasoning = rs;
    if (answer) *answer = as;
    return e != NULL;
}

bool kvt_think_split(const char *text, size_t len, bool partial, size_t *reasoning, size_t *answer)
{
    return split_from(text, len, partial, 0, reasoning, answer);
}

static bool think_ws(int mode, char c) { return mode == 1 ? c == '\n' : mode == 2 && kvt_tpl_is_space(c); }

/* kvt_think_parts with the search for the closing tag from byte from on
 * (none begins before it); *close_at receives where it begins (SIZE_MAX:
 * not found). */
static bool parts_from(const kvt_template *t, const char *text, size_t len, bool partial, size_t from,
                       kvt_think *out, size_t *close_at)
{
    if (!text) len = 0;
    *close_at = SIZE_MAX;
    const char *open = t ? t->think_open : NULL;
    int ws = t ? t->think_ws : 0;
    if (!open && !ws && !(t && t->think_close)) {
        size_t rs, as;
        bool closed = split_from(text, len, partial, from, &rs, &as);
        *out = (kvt_think){0, rs, as};
        if (as > rs) *close_at = rs;
        return closed;
    }
    size_t p = 0;
    if (open) {
        size_t ol = strlen(open);
        if (len >= ol && !memcmp(text, open, ol)) p = ol;
        else if (len < ol && !memcmp(text, open, len) && (partial || !len)) { /* the opener may be arriving */
            *out = (kvt_think){0, 0, len};
            return false;
        } else { /* a reply that opens no reasoning is all answer */
            *out = (kvt_think){0, 0, 0};
            return true;
        }
    }
    while (p < len && think_ws(ws, text[p])) p++;
    const char *close = t->think_close ? t->think_close : THINK_END;
    size_t cl = strlen(close);
    const char *e = kvt_tpl_find(text, p > from ? p : from, len, close, cl);
    if (e) *close_at = (size_t)(e - text);
    size_t re = e ? (size_t)(e - text) : len;
    if (!e && partial) re -= kvt_tpl_partial_tail(text, len, close);
    if (re < p) re = p;
    if (e || partial)
        while (re > p && think_ws(ws, text[re - 1])) re--;
    *out = (kvt_think){p, re, len};
    if (!e) return false;
    size_t as = (size_t)(e - text) + cl;
    while (as < len && think_ws(ws, text[as])) as++;
    if (partial && as == len) return false; /* what begins the answer is still to come */
    out->as = as;
    return true;
}

bool kvt_think_parts(const kvt_template *t, const char *text, size_t len, bool partial, kvt_think *out)
{
    size_t close_at;
    return parts_from(t, text, len, partial, 0, out, &close_at);
}

bool kvt_think_parts_resume(const kvt_template *t, const char *text, size_t len, size_t *searched, kvt_think *out)
{
    size_t close_at;
    bool closed = parts_from(t, text, len, true, *searched, out, &close_at);
    if (close_at != SIZE_MAX) {
        *searched = close_at; /* found: found again at once */
    } else {
        const char *close = t && t->think_close ? t->think_close : THINK_END;
        size_t keep = strlen(close) - 1, next = len > keep ? len - keep : 0;
        if (next > *searched) *searched = next; /* a tag may have begun in the last bytes */
    }
    return closed;
}
