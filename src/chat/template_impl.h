/* What the template files share (template.c: the table, the deepseek and
 * plain templates, the helpers below; template_llama3.c, template_qwen.c,
 * template_gemma.c: the other families). Private to them: everything else
 * sees template.h only. */
#ifndef KVT_TEMPLATE_IMPL_H
#define KVT_TEMPLATE_IMPL_H

#include "chat/template.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#define LIT(s) (sizeof(s "") - 1)

/* ---- writing --------------------------------------------------------------- */

/* What a chat template's `tojson` filter writes (as @huggingface/jinja
 * implements it, Python's json.dumps without ensure_ascii): keys in the
 * order given; without indent ", " and ": " between items; with indent > 0
 * each item on its own line indented by indent spaces a level, "," and ": "
 * between items (an empty object or array stays {} or []); strings as
 * JavaScript's JSON.stringify escapes them; numbers as JavaScript prints
 * them (1.0 is 1, 1e21 is 1e+21). */
void kvt_tpl_tojson(kvt_wbuf *b, const json_t *v, int indent);
/* An OpenAI tool as the client sent it: {"type": "function", "function": FN}
 * through kvt_tpl_tojson. */
void kvt_tpl_tool_json(kvt_wbuf *b, const json_t *fn, int indent);
/* A history call's arguments as `arguments | tojson` writes them: the
 * client's object in its key order; arguments that are JSON but no object
 * as their canonical text; anything else as a JSON string. */
void kvt_tpl_args_json(kvt_wbuf *b, const kvt_turn_call *c);
/* A number as JavaScript's String() prints it (what tojson writes). */
void kvt_tpl_js_number(kvt_wbuf *b, double d);
/* A real as Python's str() writes it (what a template prints a float as in
 * transformers and llama.cpp): the shortest digits that read back, fixed
 * notation with at least one decimal for exponents -4..15, else d.ddde±XX. */
void kvt_tpl_py_real(kvt_wbuf *b, double d);

/* The role as the templates spell it ("system" for developer too: OpenAI's
 * developer messages are system text to every template but deepseek's, as
 * llama.cpp passes them). */
const char *kvt_tpl_role(int role);

/* ---- reading --------------------------------------------------------------- */

bool kvt_tpl_is_space(char c); /* ASCII whitespace: " \t\n\v\f\r" */
/* s[*a, *b) without surrounding ASCII whitespace (Jinja's trim as llama.cpp's
 * engine applies it; Python also trims Unicode spaces). */
void kvt_tpl_trim(const char *s, size_t *a, size_t *b);
/* The same for one character (Python's strip(c), lstrip, rstrip). */
void kvt_tpl_strip_char(const char *s, size_t *a, size_t *b, char c, bool left, bool right);
/* Append s[0, n) trimmed. */
void kvt_tpl_put_trim(kvt_wbuf *b, const char *s, size_t n);
/* memmem within s[from, to), NULL when absent. */
const char *kvt_tpl_find(const char *s, size_t from, size_t to, const char *needle, size_t nl);
/* How many of the last bytes of text[0, len) begin marker (a partial marker
 * that may be arriving), 0 when none; a whole marker is not counted. */
size_t kvt_tpl_partial_tail(const char *text, size_t len, const char *marker);
/* s[a, b) is well-formed UTF-8 without NUL (what a JSON string can hold). */
bool kvt_tpl_utf8_ok(const char *s, size_t a, size_t b);

/* The streaming scan for a call syntax that opens with a fixed text
 * (opener: no whitespace in it): the text before the first opener, without
 * a trailing partial opener, without the whitespace before either; resumed
 * from s (kvt_tool_scan). */
size_t kvt_tpl_scan_opener(kvt_tool_scan *s, const char *text, size_t len, const char *opener);
/* Note ws runs in text[s->done, to) (kvt_tool_scan.run). */
void kvt_tpl_scan_ws(kvt_tool_scan *s, const char *text, size_t to);

/* Tool calls being collected out of generated text. */
typedef struct kvt_tpl_calls {
    kvt_tool_call *v;
    size_t n, cap;
} kvt_tpl_calls;
/* Append a call: a fresh id, name[0, nl), the arguments (a JSON object)
 * dumped compact, raw_off/raw_len. KVT_OK or KVT_ENOMEM (calls kept). */
int kvt_tpl_calls_add(kvt_tpl_calls *c, const char *name, size_t nl, const json_t *args, size_t raw_off,
                      size_t raw_len);

/* ---- arguments typed by the request's schemas (template_schema.c) ---------- *
 *
 * For a call syntax whose values are bare text (Qwen 3.5's XML): the
 * parameters schema of function name[0, nl) among fns (the request's
 * functions, kvt_chat.fns), NULL when it has none; and the value of the text
 * of parameter key under such a schema (string: the text as written; other
 * types parsed when the text parses as one; enum, const, anyOf, oneOf,
 * local $refs, nested properties and items followed), a new reference, or
 * NULL when the schema gives the parameter no type (the caller converts it
 * as without schemas). Bounded in depth, $ref hops and steps whatever the
 * schema. */
const json_t *kvt_tpl_fn_schema(const json_t *fns, const char *name, size_t nl);
json_t *kvt_tpl_typed_arg(const json_t *params, const char *key, const char *text, size_t n);

/* ---- the families of the other files ------------------------------------ */

bool kvt_render_llama3(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user);
int kvt_llama3_tool_calls(const char *text, size_t len, const json_t *fns, kvt_tool_call **calls, size_t *n, size_t *text_end);
size_t kvt_llama3_tool_calls_text_len(const char *text, size_t len);
size_t kvt_llama3_tool_calls_scan(kvt_tool_scan *s, const char *text, size_t len);

bool kvt_render_qwen25(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user);
bool kvt_render_qwen3(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user);
int kvt_qwen_tool_calls(const char *text, size_t len, const json_t *fns, kvt_tool_call **calls, size_t *n, size_t *text_end);
size_t kvt_qwen_tool_calls_text_len(const char *text, size_t len);
size_t kvt_qwen_tool_calls_scan(kvt_tool_scan *s, const char *text, size_t len);
bool kvt_render_qwen35(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user);
int kvt_qwen35_tool_calls(const char *text, size_t len, const json_t *fns, kvt_tool_call **calls, size_t *n, size_t *text_end);

bool kvt_render_gemma3(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user);
bool kvt_render_gemma4(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user);
int kvt_gemma4_tool_calls(const char *text, size_t len, const json_t *fns, kvt_tool_call **calls, size_t *n, size_t *text_end);
size_t kvt_gemma4_tool_calls_text_len(const char *text, size_t len);
size_t kvt_gemma4_tool_calls_scan(kvt_tool_scan *s, const char *text, size_t len);

/* A template without a tool-call syntax: no calls, all of it text. */
int kvt_tool_calls_none(const char *text, size_t len, const json_t *fns, kvt_tool_call **calls, size_t *n, size_t *text_end);
size_t kvt_tool_calls_none_text_len(const char *text, size_t len);
size_t kvt_tool_calls_none_scan(kvt_tool_scan *s, const char *text, size_t len);

#endif
