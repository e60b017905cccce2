/* The Qwen templates, ChatML: qwen2.5 (models/templates/
 * Qwen-Qwen2.5-7B-Instruct.jinja in llama.cpp), qwen3 (Qwen-Qwen3-0.6B.jinja,
 * with its thinking mode) and qwen3.5 (Qwen3.5-4B.jinja), and their tool
 * calls read back out of generated text: <tool_call>JSON</tool_call>, and
 * Qwen 3.5's <tool_call><function=...> XML.
 * template_impl.h lists what it shares with the other template files;
 * docs/API.md describes them. */
#include "chat/template_impl.h"
#include "base/jsonstr.h"
#include "base/util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define IM_START "<|im_start|>"
#define IM_END "<|im_end|>"
#define QW_DEFAULT_SYSTEM "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
#define QW_TOOLS_HEAD                                                                                         \
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with " \
    "function signatures within <tools></tools> XML tags:\n<tools>"
#define QW_TOOLS_FOOT                                                                                            \
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "       \
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "               \
    "<args-json-object>}\n</tool_call>" IM_END "\n"
#define CALL_OPEN "<tool_call>"
#define CALL_CLOSE "</tool_call>"
#define THINK_OPEN "<think>"
#define THINK_CLOSE "</think>"

static void tools_block(kvt_wbuf *b, const kvt_chat *ch)
{
    kvt_wbuf_puts(b, QW_TOOLS_HEAD);
    for (size_t k = 0; k < json_array_size(ch->fns); k++) {
        kvt_wbuf_puts(b, "\n");
        kvt_tpl_tool_json(b, json_array_get(ch->fns, k), 0);
    }
    kvt_wbuf_puts(b, QW_TOOLS_FOOT);
}

static void plain_turn(kvt_wbuf *b, const kvt_turn *t)
{
    kvt_wbuf_puts(b, IM_START);
    kvt_wbuf_puts(b, kvt_tpl_role(t->role));
    kvt_wbuf_puts(b, "\n");
    kvt_wbuf_put(b, t->text, t->len);
}

/* A run of tool results: one user turn, each result in <tool_response>. */
static void tool_result(kvt_wbuf *b, const kvt_chat *ch, size_t i)
{
    if (i == 0 || ch->t[i - 1].role != KVT_ROLE_TOOL) kvt_wbuf_puts(b, IM_START "user");
    kvt_wbuf_puts(b, "\n<tool_response>\n");
    kvt_wbuf_put(b, ch->t[i].text, ch->t[i].len);
    kvt_wbuf_puts(b, "\n</tool_response>");
    if (i + 1 == ch->n || ch->t[i + 1].role != KVT_ROLE_TOOL) kvt_wbuf_puts(b, IM_END "\n");
}

/* {"name": "NAME", "arguments": ARGS} as the templates write a call. */
static void call_json(kvt_wbuf *b, const kvt_turn_call *c, bool raw_string)
{
    kvt_wbuf_puts(b, "<tool_call>\n{\"name\": \"");
    kvt_wbuf_puts(b, c->name);
    kvt_wbuf_puts(b, "\", \"arguments\": ");
    if (raw_string && !c->argv) kvt_wbuf_put(b, c->args, c->args_len);
    else kvt_tpl_args_json(b, c);
    kvt_wbuf_puts(b, "}\n</tool_call>");
}

static bool is_prefill(const kvt_chat *ch)
{
    return ch->n && ch->t[ch->n - 1].role == KVT_ROLE_ASSISTANT && !ch->t[ch->n - 1].n_calls;
}

/* qwen2.5, byte for byte:
 *
 *   the system turn: the first message's text when it is system (or
 *   developer) text, else Qwen's default system prompt; with tools that text,
 *   "\n\n# Tools..." and each tool's JSON on its own line in <tools></tools>,
 *   the instructions for <tool_call>; then per message
 *   user, system, assistant  <|im_start|>ROLE\nTEXT<|im_end|>\n
 *   assistant with calls     <|im_start|>assistant, "\n"TEXT when there is text,
 *                            per call \n<tool_call>\n{"name": "NAME", "arguments":
 *                            ARGS}\n</tool_call>, then <|im_end|>\n
 *   tool                     a run of them is one user turn:
 *                            <|im_start|>user + per result
 *                            \n<tool_response>\nTEXT\n</tool_response>, <|im_end|>\n
 *
 * then <|im_start|>assistant\n. No reasoning is written. A prefill (the last
 * turn an assistant's without calls) leaves out its <|im_end|>\n and the
 * generation prompt (false). Calls render as the template writes them. */
bool kvt_render_qwen25(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user)
{
    bool sys0 = ch->n && kvt_role_is_system(ch->t[0].role);
    kvt_wbuf_puts(b, IM_START "system\n");
    if (sys0) kvt_wbuf_put(b, ch->t[0].text, ch->t[0].len);
    else kvt_wbuf_puts(b, QW_DEFAULT_SYSTEM);
    if (ch->n_tools) {
        kvt_wbuf_puts(b, "\n\n");
        tools_block(b, ch);
    } else {
        kvt_wbuf_puts(b, IM_END "\n");
    }
    for (size_t i = sys0; i < ch->n; i++) {
        const kvt_turn *t = &ch->t[i];
        if (t->role == KVT_ROLE_TOOL) {
            tool_result(b, ch, i);
        } else if (t->n_calls) {
            kvt_wbuf_puts(b, IM_START "assistant");
            if (t->len) kvt_wbuf_puts(b, "\n"), kvt_wbuf_put(b, t->text, t->len);
            for (size_t k = 0; k < t->n_calls; k++) {
                kvt_wbuf_puts(b, "\n");
                call_json(b, &t->calls[k], false);
            }
            kvt_wbuf_puts(b, IM_END "\n");
        } else {
            plain_turn(b, t);
            if (i + 1 == ch->n && is_prefill(ch)) return false;
            kvt_wbuf_puts(b, IM_END "\n");
        }
    }
    kvt_wbuf_puts(b, IM_START "assistant\n");
    return true;
}

/* The reasoning and answer of an assistant turn as the Qwen 3 template
 * takes them: reasoning_content when the client sent it, else what its text
 * holds before a </think> (after the <think> before it; the newlines around
 * it off), the answer being what follows the last </think>. */
typedef struct qw_parts {
    const char *r, *a;
    size_t rl, al;
} qw_parts;

static qw_parts turn_parts(const kvt_turn *t)
{
    qw_parts p = {t->reasoning ? t->reasoning : "", t->text, t->reasoning ? t->rlen : 0, t->len};
    const char *first = t->reasoning ? NULL : kvt_tpl_find(t->text, 0, t->len, THINK_CLOSE, LIT(THINK_CLOSE));
    if (!first) return p;
    const char *last = first;
    for (const char *q; (q = kvt_tpl_find(t->text, (size_t)(last - t->text) + 1, t->len, THINK_CLOSE,
                                          LIT(THINK_CLOSE)));)
        last = q;
    size_t aa = (size_t)(last - t->text) + LIT(THINK_CLOSE), ab = t->len;
    kvt_tpl_strip_char(t->text, &aa, &ab, '\n', true, false);
    size_t ra = 0, rb = (size_t)(first - t->text);
    kvt_tpl_strip_char(t->text, &ra, &rb, '\n', false, true);
    for (const char *q; (q = kvt_tpl_find(t->text, ra, rb, THINK_OPEN, LIT(THINK_OPEN)));)
        ra = (size_t)(q - t->text) + LIT(THINK_OPEN);
    kvt_tpl_strip_char(t->text, &ra, &rb, '\n', true, false);
    return (qw_parts){t->text + ra, t->text + aa, rb - ra, ab - aa};
}

/* qwen3: the Qwen 3 template, byte for byte where it keeps the history:
 *
 *   the system turn as qwen2.5's, but no default prompt (no system turn
 *   without system text or tools) and the tools after the system text and
 *   "\n\n"; user and late system turns as qwen2.5's; tool results likewise;
 *   assistant  <|im_start|>assistant\n<think>\nREASONING\n</think>\n\nANSWER
 *              (REASONING without the newlines around it, ANSWER without the
 *              ones before it), or <|im_start|>assistant\nTEXT; the calls
 *              after it, "\n" before each but a first one after no text,
 *              <tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>;
 *              then <|im_end|>\n
 *
 * then <|im_start|>assistant\n, and outside thinking mode
 * <think>\n\n</think>\n\n after it (enable_thinking false).
 *
 * Which assistant turns get the <think> block: the template writes it for
 * the turns after the last user query only (for one with reasoning, or the
 * last message), and the text alone for every earlier turn, so each new user
 * turn would rewrite the turn before it and everything cached after that.
 * kvtier writes every assistant turn as the template writes it after the
 * last query: with its reasoning when it has some, and as the model saw it
 * (an empty block) outside thinking mode, where the generation prompt ended
 * with the empty block. So each rendering is a prefix of the next. A
 * prefill (the last turn an assistant's without calls) leaves out its
 * <|im_end|>\n and the generation prompt (false). */
bool kvt_render_qwen3(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user)
{
    bool sys0 = ch->n && kvt_role_is_system(ch->t[0].role);
    if (ch->n_tools) {
        kvt_wbuf_puts(b, IM_START "system\n");
        if (sys0) kvt_wbuf_put(b, ch->t[0].text, ch->t[0].len), kvt_wbuf_puts(b, "\n\n");
        tools_block(b, ch);
    } else if (sys0) {
        kvt_wbuf_puts(b, IM_START "system\n");
        kvt_wbuf_put(b, ch->t[0].text, ch->t[0].len);
        kvt_wbuf_puts(b, IM_END "\n");
    }
    for (size_t i = sys0; i < ch->n; i++) {
        const kvt_turn *t = &ch->t[i];
        if (t->role == KVT_ROLE_TOOL) {
            tool_result(b, ch, i);
            continue;
        }
        if (t->role != KVT_ROLE_ASSISTANT) {
            plain_turn(b, t);
            kvt_wbuf_puts(b, IM_END "\n");
            continue;
        }
        qw_parts p = turn_parts(t);
        size_t ra = 0, rb = p.rl, aa = 0, ab = p.al;
        kvt_tpl_strip_char(p.r, &ra, &rb, '\n', true, true);
        kvt_tpl_strip_char(p.a, &aa, &ab, '\n', true, false);
        kvt_wbuf_puts(b, IM_START "assistant\n");
        if (i + 1 == ch->n || p.rl || !ch->thinking) {
            kvt_wbuf_puts(b, THINK_OPEN "\n");
            kvt_wbuf_put(b, p.r + ra, rb - ra);
            kvt_wbuf_puts(b, "\n" THINK_CLOSE "\n\n");
            kvt_wbuf_put(b, p.a + aa, ab - aa);
        } else {
            kvt_wbuf_put(b, p.a, p.al);
        }
        for (size_t k = 0; k < t->n_calls; k++) {
            if (k || p.al) kvt_wbuf_puts(b, "\n");
            call_json(b, &t->calls[k], true);
        }
        if (i + 1 == ch->n && is_prefill(ch)) return false;
        kvt_wbuf_puts(b, IM_END "\n");
    }
    kvt_wbuf_puts(b, IM_START "assistant\n");
    if (!ch->thinking) kvt_wbuf_puts(b, THINK_OPEN "\n\n" THINK_CLOSE "\n\n");
    return true;
}

/* ---- the tool calls of a reply ------------------------------------------- *
 *
 * The reply's text, then calls to its end, each
 *   <tool_call>\n{"name": NAME, "arguments": {ARGS}}\n</tool_call>
 * (any whitespace around the JSON and between calls; arguments may also be
 * a JSON string holding the object). The text loses the whitespace before
 * the first call. An unfinished or malformed call ends the calls: it and
 * what follows are not read (and with no call before it all is text). */

/* The call in object v (its name, and its arguments: a new reference), or
 * false. */
static bool qw_call(json_t *v, const char **name, json_t **args)
{
    json_t *nm = json_object_get(v, "name"), *a = json_object_get(v, "arguments");
    if (!json_is_string(nm) || !json_string_length(nm)) return false;
    if (json_is_string(a)) a = json_loadb(json_string_value(a), json_string_length(a), 0, NULL);
    else if (a) json_incref(a);
    else a = json_object();
    if (!json_is_object(a)) { json_decref(a); return false; }
    *name = json_string_value(nm);
    *args = a;
    return true;
}

int kvt_qwen_tool_calls(const char *text, size_t len, const json_t *fns, kvt_tool_call **calls, size_t *n,
                        size_t *text_end)
{
    (void)fns; /* the syntax carries the types */
    if (!calls || !n || !text_end || (!text && len)) return kvt_fail(KVT_EINVAL, "tool calls: NULL argument");
    *calls = NULL;
    *n = 0;
    *text_end = len;
    const char *first = kvt_tpl_find(text, 0, len, CALL_OPEN, LIT(CALL_OPEN));
    if (!first) return KVT_OK;
    size_t start = (size_t)(first - text), pos = start, from;
    while (start > 0 && kvt_tpl_is_space(text[start - 1])) start--;
    from = start;
    kvt_tpl_calls cs = {0};
    for (;;) {
        while (pos < len && kvt_tpl_is_space(text[pos])) pos++;
        if (len - pos < LIT(CALL_OPEN) || memcmp(text + pos, CALL_OPEN, LIT(CALL_OPEN))) break;
        size_t a = pos + LIT(CALL_OPEN);
        const char *e = kvt_tpl_find(text, a, len, CALL_CLOSE, LIT(CALL_CLOSE));
        if (!e) break; /* unfinished */
        size_t bend = (size_t)(e - text);
        kvt_tpl_trim(text, &a, &bend);
        if (!kvt_tpl_utf8_ok(text, a, bend)) break;
        json_error_t je;
        json_t *v = json_loadb(text + a, bend - a, 0, &je);
        if (!v && json_error_code(&je) == json_error_out_of_memory) goto nomem;
        const char *name;
        json_t *args = NULL;
        bool ok = v && qw_call(v, &name, &args);
        pos = (size_t)(e - text) + LIT(CALL_CLOSE);
        size_t end = pos;
        while (end < len && kvt_tpl_is_space(text[end])) end++;
        int rc = ok ? kvt_tpl_calls_add(&cs, name, strlen(name), args, from, end - from) : KVT_OK;
        json_decref(args);
        json_decref(v);
        if (rc) goto nomem;
        if (!ok) break; /* malformed */
        from = pos = end;
    }
    if (!cs.n) return KVT_OK;
    *calls = cs.v;
    *n = cs.n;
    *text_end = start;
    return KVT_OK;
nomem:
    kvt_tool_calls_free(cs.v, cs.n);
    return kvt_fail(KVT_ENOMEM, "tool calls: out of memory");
}

size_t kvt_qwen_tool_calls_scan(kvt_tool_scan *s, const char *text, size_t len)
{
    return kvt_tpl_scan_opener(s, text, len, CALL_OPEN);
}

size_t kvt_qwen_tool_calls_text_len(const char *text, size_t len)
{
    kvt_tool_scan s = {0};
    return kvt_qwen_tool_calls_scan(&s, text, len);
}

/* ---- qwen3.5 ---------------------------------------------------------------- */

#define Q35_TOOLS_HEAD "# Tools\n\nYou have access to the following functions:\n\n<tools>"
#define Q35_TOOLS_FOOT                                                                                           \
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"      \
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"  \
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple "    \
    "lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow "  \
    "the specified format: an inner <function=...></function> block must be nested within "                   \
    "<tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional "    \
    "reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there " \
    "is no function call available, answer the question like normal with your current knowledge and do not "  \
    "tell the user about function calls\n</IMPORTANT>"

/* One parameter value as the template writes it: an object or array as
 * tojson, anything else through `| string` (Python's str: a string as it
 * is, True, False, None). */
static void q35_value(kvt_wbuf *b, const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT:
    case JSON_ARRAY: kvt_tpl_tojson(b, v, 0); return;
    case JSON_STRING: kvt_wbuf_put(b, json_string_value(v), json_string_length(v)); return;
    case JSON_REAL: kvt_tpl_py_real(b, json_real_value(v)); return;
    case JSON_TRUE: kvt_wbuf_puts(b, "True"); return;
    case JSON_FALSE: kvt_wbuf_puts(b, "False"); return;
    case JSON_NULL: kvt_wbuf_puts(b, "None"); return;
    default: kvt_json_scalar(b, v); return;
    }
}

static int q35_calls(const char *text, size_t len, const json_t *fns, kvt_tool_call **calls, size_t *n,
                     size_t *text_end);

/* A turn's calls as the server sampled them (the replay hook: each call's
 * bytes, the first's with the whitespace after the text, every call's with
 * the whitespace after it), so that the next request continues the cached
 * tokens byte for byte where the template would write a value another way
 * (True for true, ", " in JSON, the model's own whitespace). Only when every
 * call of the turn has its bytes and they read back, under the request's
 * schemas, as that call alone with the arguments the client sent back: a
 * client that changed a call gets it rendered as the template writes it.
 * False (nothing written): render the calls. */
static bool q35_replay(kvt_wbuf *b, const kvt_chat *ch, const kvt_turn *t, kvt_replay_fn replay, void *replay_user)
{
    if (!replay || !t->n_calls) return false;
    size_t mark = b->len;
    for (size_t k = 0; k < t->n_calls; k++) {
        const kvt_turn_call *c = &t->calls[k];
        size_t n = 0, te = 0, at = b->len;
        /* the call's bytes appended, then checked where they lie */
        bool found = c->id && c->argv && replay(replay_user, c->id, b) && !b->oom;
        const char *rp = found ? (const char *)b->p + at : NULL;
        size_t rl = found ? b->len - at : 0;
        kvt_tool_call *got = NULL;
        bool ok = rp && q35_calls(rp, rl, ch->fns, &got, &n, &te) == KVT_OK && n == 1 && te == 0 &&
                  got[0].raw_off == 0 && got[0].raw_len == rl && !strcmp(got[0].name, c->name);
        json_t *args = ok ? json_loads(got[0].arguments, 0, NULL) : NULL;
        ok = args && json_equal(args, c->argv);
        json_decref(args);
        kvt_tool_calls_free(got, n);
        if (!ok) {
            b->len = mark; /* what this turn's earlier calls wrote */
            return false;
        }
    }
    return true;
}

/* qwen3.5: the Qwen 3.5 template (Qwen3.5-4B.jinja in llama.cpp), byte for
 * byte where it keeps the history:
 *
 *   the system turn: with tools the tools block first (each tool's JSON on
 *   its own line in <tools></tools>, the instructions for the XML calls),
 *   then "\n\n" and the first message's system text trimmed when there is
 *   any; without tools the trimmed system text; then per message, text
 *   trimmed:
 *   user       <|im_start|>user\nTEXT<|im_end|>\n
 *   assistant  <|im_start|>assistant\n<think>\nREASONING\n</think>\n\nANSWER,
 *              REASONING trimmed; per call (after "\n\n" when there is
 *              text, "\n" between calls)
 *              <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n
 *              ...</function>\n</tool_call>, then <|im_end|>\n
 *   tool       a run of them is one user turn, as qwen3's (the template
 *              opens none for a first message that is a tool result)
 *
 * then <|im_start|>assistant\n<think>\n, and outside thinking mode
 * <|im_start|>assistant\n<think>\n\n</think>\n\n. The template writes the
 * <think> block for the turns after the last user query only; kvtier for
 * every turn (what the model saw: the generation prompt opened the block),
 * so the history is never rewritten. It raises on a system message that is
 * not the first, another role, or no user query; kvtier writes a late system
 * message as a system turn (<|im_start|>system\nTEXT<|im_end|>\n) and the
 * others all the same. A prefill leaves out <|im_end|>\n and the generation
 * prompt (false). */
bool kvt_render_qwen35(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user)
{
    bool sys0 = ch->n && kvt_role_is_system(ch->t[0].role);
    if (ch->n_tools) {
        kvt_wbuf_puts(b, IM_START "system\n" Q35_TOOLS_HEAD);
        for (size_t k = 0; k < json_array_size(ch->fns); k++) {
            kvt_wbuf_puts(b, "\n");
            kvt_tpl_tool_json(b, json_array_get(ch->fns, k), 0);
        }
        kvt_wbuf_puts(b, Q35_TOOLS_FOOT);
        size_t a = 0, z = sys0 ? ch->t[0].len : 0;
        if (sys0) kvt_tpl_trim(ch->t[0].text, &a, &z);
        if (z > a) kvt_wbuf_puts(b, "\n\n"), kvt_wbuf_put(b, ch->t[0].text + a, z - a);
        kvt_wbuf_puts(b, IM_END "\n");
    } else if (sys0) {
        kvt_wbuf_puts(b, IM_START "system\n");
        kvt_tpl_put_trim(b, ch->t[0].text, ch->t[0].len);
        kvt_wbuf_puts(b, IM_END "\n");
    }
    for (size_t i = sys0; i < ch->n; i++) {
        const kvt_turn *t = &ch->t[i];
        size_t ca = 0, cz = t->len;
        kvt_tpl_trim(t->text, &ca, &cz);
        if (t->role == KVT_ROLE_TOOL) {
            if (i > 0 && ch->t[i - 1].role != KVT_ROLE_TOOL) kvt_wbuf_puts(b, IM_START "user");
            kvt_wbuf_puts(b, "\n<tool_response>\n");
            kvt_wbuf_put(b, t->text + ca, cz - ca);
            kvt_wbuf_puts(b, "\n</tool_response>");
            if (i + 1 == ch->n || ch->t[i + 1].role != KVT_ROLE_TOOL) kvt_wbuf_puts(b, IM_END "\n");
            continue;
        }
        if (t->role != KVT_ROLE_ASSISTANT) {
            kvt_wbuf_puts(b, IM_START);
            kvt_wbuf_puts(b, kvt_tpl_role(t->role));
            kvt_wbuf_puts(b, "\n");
            kvt_wbuf_put(b, t->text + ca, cz - ca);
            kvt_wbuf_puts(b, IM_END "\n");
            continue;
        }
        const char *r = t->reasoning ? t->reasoning : "";
        size_t ra = 0, rz = t->reasoning ? t->rlen : 0;
        const char *e = t->reasoning ? NULL : kvt_tpl_find(t->text, ca, cz, THINK_CLOSE, LIT(THINK_CLOSE));
        if (e) { /* the reasoning before the first </think>, the answer after the last */
            r = t->text, ra = ca, rz = (size_t)(e - t->text);
            kvt_tpl_strip_char(r, &ra, &rz, '\n', false, true);
            for (const char *q; (q = kvt_tpl_find(r, ra, rz, THINK_OPEN, LIT(THINK_OPEN)));)
                ra = (size_t)(q - r) + LIT(THINK_OPEN);
            kvt_tpl_strip_char(r, &ra, &rz, '\n', true, false);
            for (const char *q = e; q; q = kvt_tpl_find(t->text, (size_t)(q - t->text) + 1, cz, THINK_CLOSE,
                                                        LIT(THINK_CLOSE)))
                ca = (size_t)(q - t->text) + LIT(THINK_CLOSE);
            kvt_tpl_strip_char(t->text, &ca, &cz, '\n', true, false);
        }
        kvt_tpl_trim(r, &ra, &rz);
        kvt_wbuf_puts(b, IM_START "assistant\n" THINK_OPEN "\n");
        kvt_wbuf_put(b, r + ra, rz - ra);
        kvt_wbuf_puts(b, "\n" THINK_CLOSE "\n\n");
        kvt_wbuf_put(b, t->text + ca, cz - ca);
        size_t ta = ca, tz = cz;
        kvt_tpl_trim(t->text, &ta, &tz);
        if (q35_replay(b, ch, t, replay, replay_user)) {
            if (i + 1 == ch->n && is_prefill(ch)) return false;
            kvt_wbuf_puts(b, IM_END "\n");
            continue;
        }
        for (size_t k = 0; k < t->n_calls; k++) {
            const kvt_turn_call *c = &t->calls[k];
            kvt_wbuf_puts(b, k ? "\n" : tz > ta ? "\n\n" : "");
            kvt_wbuf_puts(b, "<tool_call>\n<function=");
            kvt_wbuf_puts(b, c->name);
            kvt_wbuf_puts(b, ">\n");
            const char *key;
            json_t *v;
            json_object_foreach(c->argv, key, v) {
                kvt_wbuf_puts(b, "<parameter=");
                kvt_wbuf_puts(b, key);
                kvt_wbuf_puts(b, ">\n");
                q35_value(b, v);
                kvt_wbuf_puts(b, "\n</parameter>\n");
            }
            kvt_wbuf_puts(b, "</function>\n</tool_call>");
        }
        if (i + 1 == ch->n && is_prefill(ch)) return false;
        kvt_wbuf_puts(b, IM_END "\n");
    }
    kvt_wbuf_puts(b, IM_START "assistant\n");
    kvt_wbuf_puts(b, ch->thinking ? THINK_OPEN "\n" : THINK_OPEN "\n\n" THINK_CLOSE "\n\n");
    return true;
}

/* ---- qwen3.5's tool calls ------------------------------------------------ *
 *
 * The reply's text, then calls to its end, each
 *   <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>
 * (any whitespace between the tags; one newline on either side of a value
 * is the template's). The syntax writes every value as bare text, so the
 * schema of the function in the request types it (kvt_tpl_typed_arg: a
 * string parameter is the text as written, an integer one the number it
 * reads as, ...). A parameter the schema gives no type (or a function the
 * request does not define) is read as before: JSON (an object, array,
 * number, true, false, null) as that value, Python's True, False, None as
 * the JSON ones, anything else as the string as written. The text loses the
 * whitespace before the first call; an unfinished or malformed call ends
 * the calls. */

#define Q35_FN "<function="
#define Q35_FN_END "</function>"
#define Q35_PARAM "<parameter="
#define Q35_PARAM_END "</parameter>"

static bool q35_eat(const char *s, size_t *p, size_t to, const char *lit)
{
    size_t q = *p, n = strlen(lit);
    while (q < to && kvt_tpl_is_space(s[q])) q++;
    if (to - q < n || memcmp(s + q, lit, n)) return false;
    *p = q + n;
    return true;
}

/* NAME> at s[*p..): a name without whitespace, '<' or '>' (and UTF-8). */
static bool q35_name(const char *s, size_t *p, size_t to, size_t *a, size_t *z)
{
    const char *gt = memchr(s + *p, '>', to - *p);
    if (!gt || gt == s + *p) return false;
    *a = *p, *z = (size_t)(gt - s);
    for (size_t i = *a; i < *z; i++)
        if (kvt_tpl_is_space(s[i]) || s[i] == '<' || (unsigned char)s[i] < 0x20) return false;
    if (!kvt_tpl_utf8_ok(s, *a, *z)) return false;
    *p = *z + 1;
    return true;
}

/* A value: typed by its parameter's schema in params (the function's, from
 * the request) when that gives it a type; otherwise as without schemas. */
static json_t *q35_read_value(const json_t *params, const char *key, const char *s, size_t a, size_t z)
{
    if (a < z && s[a] == '\n') a++;
    if (z > a && s[z - 1] == '\n') z--;
    json_t *typed = kvt_tpl_typed_arg(params, key, s + a, z - a);
    if (typed) return typed;
    size_t ta = a, tz = z;
    kvt_tpl_trim(s, &ta, &tz);
    json_t *v = NULL;
    if (tz - ta == 4 && !memcmp(s + ta, "True", 4)) return json_true();
    if (tz - ta == 5 && !memcmp(s + ta, "False", 5)) return json_false();
    if (tz - ta == 4 && !memcmp(s + ta, "None", 4)) return json_null();
    if (tz > ta) v = json_loadb(s + ta, tz - ta, JSON_DECODE_ANY, NULL);
    return v ? v : json_stringn(s + a, z - a);
}

/* One call at s[*p..): 1 with *name, *args (new), *p past </tool_call>;
 * 0 none (complete and well-formed) here; -1 out of memory. */
static int q35_call(const char *s, size_t *p, size_t to, const json_t *fns, size_t *na, size_t *nz, json_t **args)
{
    size_t q = *p;
    *args = NULL;
    if (!q35_eat(s, &q, to, CALL_OPEN) || !q35_eat(s, &q, to, Q35_FN) || !q35_name(s, &q, to, na, nz)) return 0;
    const json_t *params = kvt_tpl_fn_schema(fns, s + *na, *nz - *na);
    json_t *obj = json_object();
    if (!obj) return -1;
    for (;;) {
        if (q35_eat(s, &q, to, Q35_FN_END)) break;
        size_t ka, kz;
        if (!q35_eat(s, &q, to, Q35_PARAM) || !q35_name(s, &q, to, &ka, &kz)) goto no;
        const char *e = kvt_tpl_find(s, q, to, Q35_PARAM_END, LIT(Q35_PARAM_END));
        if (!e || !kvt_tpl_utf8_ok(s, q, (size_t)(e - s))) goto no;
        char *key = kvt_strndup(s + ka, kz - ka);
        json_t *v = key ? q35_read_value(params, key, s, q, (size_t)(e - s)) : NULL;
        int bad = !v || !key || json_object_set_new(obj, key, v);
        free(key);
        if (bad) { json_decref(obj); return -1; }
        q = (size_t)(e - s) + LIT(Q35_PARAM_END);
    }
    if (!q35_eat(s, &q, to, CALL_CLOSE)) goto no;
    *p = q;
    *args = obj;
    return 1;
no:
    json_decref(obj);
    return 0;
}

int kvt_qwen35_tool_calls(const char *text, size_t len, const json_t *fns, kvt_tool_call **calls, size_t *n,
                          size_t *text_end)
{
    return q35_calls(text, len, fns, calls, n, text_end);
}

static int q35_calls(const char *text, size_t len, const json_t *fns, kvt_tool_call **calls, size_t *n,
                     size_t *text_end)
{
    if (!calls || !n || !text_end || (!text && len)) return kvt_fail(KVT_EINVAL, "tool calls: NULL argument");
    *calls = NULL;
    *n = 0;
    *text_end = len;
    const char *first = kvt_tpl_find(text, 0, len, CALL_OPEN, LIT(CALL_OPEN));
    if (!first) return KVT_OK;
    size_t start = (size_t)(first - text), pos = start, from;
    while (start > 0 && kvt_tpl_is_space(text[start - 1])) start--;
    from = start;
    kvt_tpl_calls cs = {0};
    for (;;) {
        size_t na, nz;
        json_t *args;
        int got = q35_call(text, &pos, len, fns, &na, &nz, &args);
        if (got < 0) goto nomem;
        if (!got) break;
        size_t end = pos;
        while (end < len && kvt_tpl_is_space(text[end])) end++;
        int rc = kvt_tpl_calls_add(&cs, text + na, nz - na, args, from, end - from);
        json_decref(args);
        if (rc) goto nomem;
        from = pos = end;
    }
    if (!cs.n) return KVT_OK;
    *calls = cs.v;
    *n = cs.n;
    *text_end = start;
    return KVT_OK;
nomem:
    kvt_tool_calls_free(cs.v, cs.n);
    return kvt_fail(KVT_ENOMEM, "tool calls: out of memory");
}
