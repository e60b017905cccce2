/* The llama3 template: Llama 3.1, 3.2 and 3.3 Instruct
 * (models/templates/meta-llama-Llama-3.{1-8B,2-3B,3-70B}-Instruct.jinja in
 * llama.cpp, which render alike without builtin_tools), and its JSON tool
 * calls read back out of generated text. template_impl.h lists what it
 * shares with the other template files; docs/API.md describes it. */
#include "chat/template_impl.h"
#include "base/jsonstr.h"
#include "base/util.h"

#include <stdlib.h>
#include <string.h>

#define L3_BOS "<|begin_of_text|>"
#define L3_HEAD(role) "<|start_header_id|>" role "<|end_header_id|>\n\n"
#define L3_EOT "<|eot_id|>"
#define L3_PYTHON "<|python_tag|>"
/* The template's date when the caller gives none (date_string, strftime_now):
 * a date from the clock would change the prompt's first tokens every day,
 * and with them every cached prefix. */
#define L3_DATES "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
#define L3_TOOLS_HEAD                                                                                           \
    "Given the following functions, please respond with a JSON for a function call with its proper arguments " \
    "that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": "   \
    "dictionary of argument name and its value}.Do not use variables.\n\n"

/* llama3, byte for byte (tools_in_user_message, the default):
 *
 *   <|begin_of_text|>, a system header: "Environment: ipython\n" with tools,
 *   the dates, the first message's text trimmed when it is system (or
 *   developer) text, <|eot_id|>; with tools a user header with the tools
 *   instructions, each tool's JSON indented by 4 then "\n\n", and the next
 *   message's text trimmed (the template takes it whatever its role; with
 *   none it raises: kvtier writes an empty one), <|eot_id|>; then per message
 *   user, system  <|start_header_id|>ROLE<|end_header_id|>\n\nTEXT<|eot_id|>,
 *                 TEXT trimmed (a late system message keeps its own header)
 *   assistant     the same; with tool calls {"name": "NAME", "parameters": ARGS}
 *                 in place of its text (the template drops the text), ARGS as
 *                 tojson writes them; the template takes one call only (it
 *                 raises for more): kvtier writes each, "\n" between them,
 *                 which is what kvt_llama3_tool_calls reads back
 *   tool          <|start_header_id|>ipython<|end_header_id|>\n\n"TEXT"<|eot_id|>,
 *                 TEXT as a JSON string (the template's `is iterable` holds for
 *                 a string, so it writes its tojson)
 *
 * then the assistant header to prompt the reply. A conversation that ends
 * with an assistant turn without tool calls is a prefill: that turn without
 * its <|eot_id|>, no generation prompt (false). Every call renders as the
 * template writes it (no replay). */
bool kvt_render_llama3(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user)
{
    size_t i = 0;
    kvt_wbuf_puts(b, L3_BOS L3_HEAD("system"));
    if (ch->n_tools) kvt_wbuf_puts(b, "Environment: ipython\n");
    kvt_wbuf_puts(b, L3_DATES);
    if (ch->n && kvt_role_is_system(ch->t[0].role)) kvt_tpl_put_trim(b, ch->t[0].text, ch->t[i++].len);
    kvt_wbuf_puts(b, L3_EOT);
    if (ch->n_tools) {
        kvt_wbuf_puts(b, L3_HEAD("user") L3_TOOLS_HEAD);
        for (size_t k = 0; k < json_array_size(ch->fns); k++) {
            kvt_tpl_tool_json(b, json_array_get(ch->fns, k), 4);
            kvt_wbuf_puts(b, "\n\n");
        }
        if (i < ch->n) kvt_tpl_put_trim(b, ch->t[i].text, ch->t[i].len), i++;
        kvt_wbuf_puts(b, L3_EOT);
    }
    bool prefill = i < ch->n && ch->t[ch->n - 1].role == KVT_ROLE_ASSISTANT && !ch->t[ch->n - 1].n_calls;
    for (; i < ch->n; i++) {
        const kvt_turn *t = &ch->t[i];
        if (t->role == KVT_ROLE_TOOL) {
            kvt_wbuf_puts(b, L3_HEAD("ipython"));
            kvt_json_string(b, t->text, t->len);
        } else if (t->n_calls) {
            kvt_wbuf_puts(b, L3_HEAD("assistant"));
            for (size_t k = 0; k < t->n_calls; k++) {
                if (k) kvt_wbuf_puts(b, "\n");
                kvt_wbuf_puts(b, "{\"name\": \"");
                kvt_wbuf_puts(b, t->calls[k].name);
                kvt_wbuf_puts(b, "\", \"parameters\": ");
                kvt_tpl_args_json(b, &t->calls[k]);
                kvt_wbuf_puts(b, "}");
            }
        } else {
            kvt_wbuf_puts(b, "<|start_header_id|>");
            kvt_wbuf_puts(b, kvt_tpl_role(t->role));
            kvt_wbuf_puts(b, "<|end_header_id|>\n\n");
            kvt_tpl_put_trim(b, t->text, t->len);
            if (prefill && i == ch->n - 1) return false;
        }
        kvt_wbuf_puts(b, L3_EOT);
    }
    kvt_wbuf_puts(b, L3_HEAD("assistant"));
    return true;
}

/* ---- the tool calls of a reply ------------------------------------------- *
 *
 * Llama 3.1's custom tool call, as its template describes it and llama.cpp's
 * chat parser reads it: the reply's text, then one or more JSON objects to
 * its end, each {"name": NAME, "parameters": {ARGS}} ("arguments" is taken
 * too, and the OpenAI wrapper {"type": "function", "function": {...}} or a
 * leading "type": "function"), separated by whitespace, "," or ";", the
 * first possibly after <|python_tag|>. Objects followed by anything else
 * are text. */

enum { SEQ_FAIL, SEQ_PARTIAL, SEQ_DONE };

/* The call in object v: its name and arguments (a reference into v), or
 * false when v is no call. */
static bool call_shape(json_t *v, const char **name, json_t **args)
{
    json_t *fn = json_object_get(v, "function");
    json_t *ty = json_object_get(v, "type");
    if (ty && (!json_is_string(ty) || strcmp(json_string_value(ty), "function"))) return false;
    if (json_is_object(fn) && !json_object_get(v, "name")) v = fn;
    json_t *nm = json_object_get(v, "name");
    json_t *a = json_object_get(v, "parameters");
    if (!a) a = json_object_get(v, "arguments");
    if (!json_is_string(nm) || !json_string_length(nm) || !json_is_object(a)) return false;
    *name = json_string_value(nm);
    *args = a;
    return true;
}

/* The calls from text[p..len) to its end; cs NULL: only whether there are.
 * partial: the text is still growing, so an object cut short may still
 * become a call (SEQ_PARTIAL). */
static int call_seq(const char *text, size_t p, size_t len, bool partial, kvt_tpl_calls *cs, int *rc)
{
    size_t n = 0;
    for (;;) {
        while (p < len && kvt_tpl_is_space(text[p])) p++;
        if (p == len) return n ? SEQ_DONE : partial ? SEQ_PARTIAL : SEQ_FAIL;
        if (n && (text[p] == ',' || text[p] == ';')) {
            p++;
            while (p < len && kvt_tpl_is_space(text[p])) p++;
            if (p == len) return partial ? SEQ_PARTIAL : SEQ_FAIL;
        }
        if (text[p] != '{') return SEQ_FAIL;
        json_error_t je;
        json_t *v = json_loadb(text + p, len - p, JSON_DISABLE_EOF_CHECK, &je);
        if (!v) {
            if (json_error_code(&je) == json_error_out_of_memory) { *rc = KVT_ENOMEM; return SEQ_FAIL; }
            return partial && json_error_code(&je) == json_error_premature_end_of_input ? SEQ_PARTIAL : SEQ_FAIL;
        }
        size_t used = (size_t)je.position;
        const char *name;
        json_t *args;
        bool ok = call_shape(v, &name, &args) && kvt_tpl_utf8_ok(text, p, p + used);
        if (ok && cs && kvt_tpl_calls_add(cs, name, strlen(name), args, p, used)) *rc = KVT_ENOMEM, ok = false;
        json_decref(v);
        if (!ok) return SEQ_FAIL;
        n++;
        p += used;
    }
}

/* Where calls could begin: each '{' whose next non-space byte is '"' (or
 * not there yet), from *p on; len when there is none. */
static size_t next_open(const char *text, size_t from, size_t len)
{
    for (size_t p = from; p < len; p++) {
        if (text[p] != '{') continue;
        size_t q = p + 1;
        while (q < len && kvt_tpl_is_space(text[q])) q++;
        if (q == len || text[q] == '"') return p;
    }
    return len;
}

/* The text before calls at p: without the <|python_tag|> and the
 * whitespace before them. */
static size_t text_before(const char *text, size_t p)
{
    while (p > 0 && kvt_tpl_is_space(text[p - 1])) p--;
    if (p >= LIT(L3_PYTHON) && !memcmp(text + p - LIT(L3_PYTHON), L3_PYTHON, LIT(L3_PYTHON))) p -= LIT(L3_PYTHON);
    while (p > 0 && kvt_tpl_is_space(text[p - 1])) p--;
    return p;
}

int kvt_llama3_tool_calls(const char *text, size_t len, const json_t *fns, kvt_tool_call **calls, size_t *n,
                          size_t *text_end)
{
    (void)fns; /* the syntax carries the types */
    if (!calls || !n || !text_end || (!text && len)) return kvt_fail(KVT_EINVAL, "tool calls: NULL argument");
    *calls = NULL;
    *n = 0;
    *text_end = len;
    for (size_t p = next_open(text, 0, len); p < len; p = next_open(text, p + 1, len)) {
        kvt_tpl_calls cs = {0};
        int rc = KVT_OK;
        int st = call_seq(text, p, len, false, &cs, &rc);
        if (rc) {
            kvt_tool_calls_free(cs.v, cs.n);
            return kvt_fail(rc, "tool calls: out of memory");
        }
        if (st != SEQ_DONE) {
            kvt_tool_calls_free(cs.v, cs.n);
            continue;
        }
        size_t te = text_before(text, p);
        for (size_t k = 0; k < cs.n; k++) { /* raw: from the end of what comes before */
            size_t from = k ? cs.v[k - 1].raw_off + cs.v[k - 1].raw_len : te;
            cs.v[k].raw_len += cs.v[k].raw_off - from;
            cs.v[k].raw_off = from;
        }
        *calls = cs.v;
        *n = cs.n;
        *text_end = te;
        return KVT_OK;
    }
    return KVT_OK;
}

/* ---- streaming ------------------------------------------------------------- *
 *
 * How much of a growing reply is certainly text: what comes before
 * <|python_tag|> (or a tail that may start it) and before the first '{'
 * that may open a sequence of calls running to the end, without the
 * whitespace before. The scan resumes (kvt_tool_scan): the tag is looked
 * for in the new bytes (and the last ones that may hold its start); a
 * candidate '{' that failed to be a call stays failed as the text grows (a
 * syntax error, an object that is no call, other text after it), so the
 * next one is looked for after it; the candidate in progress is lexed a
 * byte once (strings, escapes, nesting), each of its objects parsed once
 * when it closes, and the object still open parsed again only when the
 * text has doubled since (what finds a syntax error before it closes). A
 * scan that starts afresh parses at once, as kvt_llama3_tool_calls_text_len
 * did before it resumed. */

/* Bytes at the end of a text being generated where a JSON error may only
 * be the text cut short (a UTF-8 character, a number like "2." or "1e"). */
#define CUT_SLACK 8

static void scan_count(size_t n) { atomic_fetch_add_explicit(&kvt_tool_scan_bytes, n, memory_order_relaxed); }

/* The object at text[a, len) read as far as the text goes: false when it
 * has an error that more text cannot mend. An error in the last bytes may
 * be the text cut inside a character or a number: only one before them
 * fails it for good. */
static bool open_ok(const char *text, size_t a, size_t len)
{
    json_error_t je;
    json_t *v = json_loadb(text + a, len - a, JSON_DISABLE_EOF_CHECK, &je);
    scan_count(je.position > 0 ? (size_t)je.position : 0);
    json_decref(v);
    return v || json_error_code(&je) == json_error_premature_end_of_input || (size_t)je.position + CUT_SLACK >= len - a;
}

/* The candidate sequence at s->cand over text[s->lex, len): SEQ_FAIL, or
 * SEQ_PARTIAL while it may still be calls to the end. */
static int seq_advance(kvt_tool_scan *s, const char *text, size_t len)
{
    size_t i = s->lex;
    for (; i < len; i++) {
        char ch = text[i];
        if (s->depth == 0) {
            if (kvt_tpl_is_space(ch)) continue;
            if (s->n_seq && !s->sep && (ch == ',' || ch == ';')) { s->sep = true; continue; }
            if (ch != '{') break;
            s->obj = s->checked = i;
            s->depth = 1;
            s->sep = false;
            continue;
        }
        if (s->in_str) {
            if (s->esc) s->esc = false;
            else if (ch == '\\') s->esc = true;
            else if (ch == '"') s->in_str = false;
        } else if (ch == '"') {
            s->in_str = true;
        } else if (ch == '{' || ch == '[') {
            s->depth++;
        } else if ((ch == '}' || ch == ']') && --s->depth == 0) {
            /* an object of the sequence is complete: a call, or the sequence fails */
            scan_count(i + 1 - s->obj);
            json_t *v = json_loadb(text + s->obj, i + 1 - s->obj, 0, NULL), *args;
            const char *name;
            bool ok = v && call_shape(v, &name, &args) && kvt_tpl_utf8_ok(text, s->obj, i + 1);
            json_decref(v);
            if (!ok) break;
            s->n_seq++;
        }
    }
    scan_count(i - s->lex);
    if (i < len) return SEQ_FAIL; /* a byte that ends the sequence as calls */
    s->lex = len;
    /* the object still open: parsed when the text has doubled since */
    if (s->depth > 0 && len - s->obj >= 2 * (s->checked - s->obj)) {
        s->checked = len;
        if (!open_ok(text, s->obj, len)) return SEQ_FAIL;
    }
    return SEQ_PARTIAL;
}

size_t kvt_llama3_tool_calls_scan(kvt_tool_scan *s, const char *text, size_t len)
{
    if (!text) return 0;
    if (kvt_tool_scan_fault || len < s->done) *s = (kvt_tool_scan){0};
    if (!s->tag_found) {
        size_t from = s->tag_done >= LIT(L3_PYTHON) - 1 ? s->tag_done - (LIT(L3_PYTHON) - 1) : 0;
        scan_count(len - from);
        const char *pt = kvt_tpl_find(text, from, len, L3_PYTHON, LIT(L3_PYTHON));
        if (pt) s->tag_found = true, s->tag = (size_t)(pt - text);
        s->tag_done = len;
    }
    size_t end = s->tag_found ? s->tag : len - kvt_tpl_partial_tail(text, len, L3_PYTHON);
    kvt_tpl_scan_ws(s, text, len);
    s->done = len;
    for (;;) {
        if (!s->in_cand) {
            if (s->next >= end) break;
            size_t p = next_open(text, s->next, end);
            scan_count(p - s->next);
            s->next = p;
            if (p >= end) break;
            s->in_cand = true;
            s->cand = s->obj = s->lex = s->checked = p;
            s->depth = 0, s->in_str = s->esc = s->sep = false, s->n_seq = 0;
            /* read at once: most candidates in prose fail in a few bytes,
             * before the lexer would run to the end of the text */
            if (!open_ok(text, p, len)) {
                s->in_cand = false;
                s->next = p + 1;
                continue;
            }
            s->checked = len;
        }
        if (seq_advance(s, text, len) != SEQ_FAIL) {
            end = s->cand;
            break;
        }
        s->in_cand = false;
        s->next = s->cand + 1;
    }
    /* the text before end: without the whitespace (the last run, when it
     * ends there) and the tag before it (text_before, once per place) */
    if (end == len - kvt_tpl_partial_tail(text, len, L3_PYTHON) && !s->tag_found && !s->in_cand)
        return s->run_end == end ? s->run : end;
    if (!s->found || s->at != end) s->found = true, s->at = end, s->text_end = text_before(text, end);
    return s->text_end;
}

size_t kvt_llama3_tool_calls_text_len(const char *text, size_t len)
{
    kvt_tool_scan s = {0};
    return kvt_llama3_tool_calls_scan(&s, text, len);
}
