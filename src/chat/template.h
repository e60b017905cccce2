/* Chat templates: a conversation in, the model's prompt text out, and the
 * model's own markup (tool calls, thinking) read back out of generated text.
 *
 * These modules own every chat marker and fixed text a template writes, the
 * renderers, the JSON writer of the templates' `tojson` filter, the
 * tool-call parsers of generated text and the thinking-mode split:
 * template.c (the table, the choice, the deepseek and plain templates, the
 * DSML parser, the streaming scan), template_llama3.c, template_qwen.c and
 * template_gemma.c (the other families) and template_schema.c (call
 * arguments typed by the request's schemas), sharing template_impl.h. src/serve/api.c reads the request
 * bodies of every api into the neutral kvt_chat below and hands it to the
 * model's template; it knows no marker.
 *
 * Templates are rows of one table (kvt_templates): a name, the texts of a
 * GGUF's tokenizer.chat_template and the architectures that pick it, a
 * render function, and what the server has to know about its prompts
 * (whether they carry BOS, whether their markers are special tokens, the
 * turn markers, the tokens that end a turn) and replies (the tool-call
 * syntax, the thinking mode). A new family is one renderer and one row.
 *
 * Ownership: a kvt_chat owns all it points to (kvt_chat_free); tool calls
 * parsed out of text are malloc'ed (kvt_tool_calls_free). Renderers append
 * to a kvt_wbuf and report out of memory through its oom flag.
 */
#ifndef KVT_TEMPLATE_H
#define KVT_TEMPLATE_H

#include "base/buf.h"
#include "kvtier.h"

#include <stdbool.h>
#include <stdatomic.h>
#include <stddef.h>

struct json_t; /* jansson's */

/* ---- the conversation ----------------------------------------------------- *
 *
 * A request's conversation, whatever the api, reduced to turns: role, text
 * (parts joined with KVT_CHAT_SEP), and for an assistant turn its reasoning
 * and the tool calls after its text; plus the function tools offered and the
 * thinking-mode request. */

/* Between the text parts of one message (api.c joins them so), and in the
 * templates between system texts and between turns that continue one. */
#define KVT_CHAT_SEP "\n\n"

/* OpenAI's developer messages are system text to every template but
 * DeepSeek-V4's, which renders them as user text. */
enum { KVT_ROLE_SYSTEM, KVT_ROLE_USER, KVT_ROLE_ASSISTANT, KVT_ROLE_TOOL, KVT_ROLE_DEVELOPER };
static inline bool kvt_role_is_system(int role) { return role == KVT_ROLE_SYSTEM || role == KVT_ROLE_DEVELOPER; }

typedef struct kvt_turn_call {
    char *id;        /* the client's call id; NULL when it sent none */
    char *name;      /* "ns" KVT_API_NS_SEP "fn" for a Responses namespace function */
    char *args;      /* (args_len) canonical JSON, or the client's bytes when not JSON */
    size_t args_len;
    bool args_json;
    struct json_t *argv; /* the arguments as the client sent them, when a JSON object (a
                          * reference); NULL otherwise */
} kvt_turn_call;

typedef struct kvt_turn {
    int role;        /* KVT_ROLE_* */
    char *text;      /* (len) bytes, malloc'ed, NUL-terminated */
    size_t len;
    char *reasoning; /* (rlen) assistant only: its reasoning as the client sent it back
                      * (reasoning_content, Anthropic thinking blocks); NULL: none */
    size_t rlen;
    kvt_turn_call *calls; /* (n_calls) assistant only */
    size_t n_calls, cap_calls;
} kvt_turn;

typedef struct kvt_chat {
    kvt_turn *t;     /* (n) in request order; Anthropic's "system" and Responses'
                      * "instructions" first */
    size_t n, cap;
    kvt_wbuf tools;  /* (n_tools) canonical function definitions, one per line:
                      * {"name":…,"description":…,"parameters":…} (plain) */
    struct json_t *fns; /* the same functions as OpenAI function objects, in the
                      * client's key order (deepseek); NULL when there are none */
    size_t n_tools;
    bool thinking;   /* the request asked for thinking mode */
    int effort;      /* thinking: 0, or the "high" (1) / "max" (2) reasoning effort */
} kvt_chat;

/* Free what t / c own and zero them (a zeroed one is fine). */
void kvt_turn_free(kvt_turn *t);
void kvt_chat_free(kvt_chat *c);

/* ---- templates ------------------------------------------------------------ */

/* Exact replay: append to out a copy of the text the server sampled for the
 * tool call call_id (as kvt_tool_calls_parse delimited it:
 * kvt_tool_call.raw_off/raw_len) and return true, or false when it has none
 * (out unchanged). A copy, so the hook holds its own lock only while it
 * copies, never through the render. */
typedef bool (*kvt_replay_fn)(void *user, const char *call_id, kvt_wbuf *out);

typedef struct kvt_tool_call kvt_tool_call;

/* While streaming: where the scan for a tool call in a growing reply
 * stands, so that each token's scan resumes where the last one stopped
 * (kvt_template.tool_calls_scan). Zero it before the first call; the text
 * passed must be the same text grown. What it keeps: how far the text has
 * been looked at, the last whitespace run (the text before a call loses
 * it), whether the opener has been seen (a partial opener straddling
 * tokens is looked for again from its first possible byte), and for Llama
 * 3's JSON calls the candidate object being read and the lexer's place in
 * it. */
typedef struct kvt_tool_scan {
    size_t done;            /* bytes of the text looked at */
    size_t run, run_end;    /* the last run of whitespace seen: [run, run_end) */
    bool found;             /* the opener was seen: the text ends at text_end
                             * (Llama 3: text_end is the text before at) */
    size_t text_end, at;
    /* Llama 3 (template_llama3.c): the candidate call sequence from cand */
    bool in_cand;
    size_t next;            /* where the search for the next candidate resumes */
    size_t cand, obj;       /* the candidate; the object being read (its '{') */
    size_t lex;             /* bytes of it lexed */
    size_t checked;         /* the text's length at the last parse of the open object */
    int depth;              /* nesting inside the sequence (0: between objects) */
    bool in_str, esc, sep;  /* in a string, after a backslash; a separator read */
    size_t n_seq;           /* complete calls read in the sequence */
    bool tag_found;         /* <|python_tag|> seen at tag */
    size_t tag, tag_done;
} kvt_tool_scan;

/* Bytes the streaming scans looked at (all of them, since the process
 * started): tests check that a reply's scan is linear in its length. */
extern _Atomic unsigned long long kvt_tool_scan_bytes;
/* Tests: when set, every scan starts over from the beginning of the text
 * (what the server did before the scan resumed). */
extern int kvt_tool_scan_fault;

typedef struct kvt_template {
    const char *name;   /* "deepseek", "llama3", "qwen2.5", "qwen3", "gemma3", "plain", ... */
    /* Picked for a model whose GGUF tokenizer.chat_template holds every one of
     * these texts (the first row that matches, in table order; NULL entries
     * end the list; none: never by the template text) ... */
    const char *marks[4];
    /* ... or, when no row matches the text (or the model has none), for a
     * model of one of these architectures (kvt_model_info.arch). */
    const char *arches[4];
    /* Append the prompt for ch to b. replay (may be NULL) gives the sampled
     * bytes of a tool call in the history. Returns whether the prompt ends
     * with the generation prompt (a new assistant turn), false for a prefill
     * (the reply continues the last assistant turn's text). */
    bool (*render)(kvt_wbuf *b, const kvt_chat *ch, kvt_replay_fn replay, void *replay_user);
    bool has_bos;       /* the prompt begins with the BOS text: tokenize it without
                         * adding BOS */
    bool special;       /* the prompt's markers are special tokens: tokenize it with
                         * special-token parsing */
    bool thinking;      /* has a thinking mode: with ch->thinking and the generation
                         * prompt the reply is REASONING</think>ANSWER (kvt_think_parts) */
    bool thinking_default; /* an OpenAI chat request that does not say asks for it */
    const char *think_open; /* the text a thinking reply opens its reasoning with when
                         * the model writes it itself ("<think>"); NULL: the prompt
                         * opens it */
    const char *think_close; /* the text that closes the reasoning; NULL: "</think>" */
    int think_ws;       /* what the template writes around the reasoning and before the
                         * answer, and so is neither: 0 nothing, 1 newlines (Python's
                         * strip('\n')), 2 any whitespace (trim) */
    /* The tool calls of generated text, and while streaming how much of it is
     * certainly text (kvt_tool_calls_parse, kvt_tool_calls_text_len). fns:
     * the request's functions (kvt_chat.fns; may be NULL), whose parameter
     * schemas type the arguments of a syntax that writes them as bare text
     * (Qwen 3.5's XML); syntaxes that carry the types (JSON, DSML's
     * string="true|false", Gemma 4's quoted strings) read them as written. */
    int (*tool_calls)(const char *text, size_t len, const struct json_t *fns, kvt_tool_call **calls, size_t *n,
                      size_t *text_end);
    size_t (*tool_calls_text_len)(const char *text, size_t len);
    /* The same for a text that grows (streaming): resumes where the last
     * call on the same scan state stopped, so a reply's scans cost its
     * length in all, not its length at every token. Never more than
     * tool_calls_text_len of the same text (a Llama 3 object that has
     * become no call may be noticed a little later, when it closes or the
     * text has doubled since it was last parsed). */
    size_t (*tool_calls_scan)(kvt_tool_scan *s, const char *text, size_t len);
    /* The texts that open a user and an assistant turn (a special token of
     * the model's vocabulary, and the role's name after it where the turns
     * share their opener), for the server's checkpoint where the last user
     * turn begins; NULL when the template has no markers. */
    const char *user_turn, *assistant_turn;
    /* The texts (each one token) that end the model's turn besides the
     * vocabulary's EOS: generation stops at any of them. NULL entries end
     * the list. */
    const char *end_turn[4];
} kvt_template;

/* The table, in lookup order (kvt_n_templates rows; the last is the
 * fallback). */
extern const kvt_template kvt_templates[];
extern const size_t kvt_n_templates;

/* The template for a model: by its GGUF's tokenizer.chat_template (the
 * first row whose marks it holds), else by its architecture, else the
 * fallback (also for m NULL). Never NULL. */
const kvt_template *kvt_template_for(const kvt_model *m);
/* The same from a chat template text and an architecture (each may be NULL). */
const kvt_template *kvt_template_pick(const char *chat_template, const char *arch);
/* By name; NULL when there is no such row. */
const kvt_template *kvt_template_named(const char *name);
/* kvt_template_for(m)->name. Static string. */
const char *kvt_template_name(const kvt_model *m);

/* What the server needs of template t as model m's tokens: the turn
 * markers (each a special token, and the role's name after it where the
 * turns share their opener; n 0 when m's vocabulary does not spell the
 * opener with one token: no marker) and the end-of-turn texts that are one
 * token of it (generation stops at them as at EOS). */
typedef struct kvt_template_tokens {
    int32_t user[4], assistant[4], end[4];
    size_t n_user, n_assistant, n_end;
} kvt_template_tokens;
void kvt_template_tokens_get(const kvt_template *t, const kvt_model *m, kvt_template_tokens *out);

/* ---- tool calls in generated text ------------------------------------- *
 *
 * The model calls tools in the DSML markup of the DeepSeek-V4 template (｜DSML｜
 * is one special token of the built-in tokenizer):
 *
 *   text\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="NAME">\n
 *   <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>\n
 *   </｜DSML｜invoke>\n...</｜DSML｜tool_calls>
 */
struct kvt_tool_call {
    char *id;                   /* "call_" + 16 hex digits, unique per process run and
                                 * unlikely to repeat across runs; the caller may replace
                                 * it (malloc'ed; kvt_tool_calls_free frees it) */
    char *name;                 /* as the model wrote it ("ns.fn" for a namespace tool) */
    char *arguments;            /* canonical JSON (compact, keys sorted) when the model
                                 * wrote a JSON object; otherwise its bytes, trimmed */
    bool valid;                 /* arguments is a JSON object */
    size_t raw_off, raw_len;    /* the generated bytes of this call: from the end of the
                                 * previous call (the first: the end of the text, so the
                                 * separator and <｜DSML｜tool_calls> are in it) through
                                 * its </｜DSML｜invoke> and the whitespace after it.
                                 * Keep them under id for the replay hook. */
};

/* Parse the tool calls out of generated text (len bytes). *text_end receives
 * where ordinary text stops: before the whitespace ahead of the first
 * <｜DSML｜tool_calls>, or len when there is none or no complete call follows
 * it (then all of it is text). *calls (malloc'ed, free with
 * kvt_tool_calls_free) receives the complete calls in order, *n their count;
 * an unfinished last call (cut by max_tokens) is left out, and so is anything
 * after the calls. KVT_ENOMEM, or KVT_EINVAL for NULL arguments. */
int kvt_tool_calls_parse(const char *text, size_t len, kvt_tool_call **calls, size_t *n,
                         size_t *text_end);
void kvt_tool_calls_free(kvt_tool_call *calls, size_t n);
/* While streaming: how many leading bytes of text are certainly ordinary
 * text, i.e. before any tool-call marker and before a trailing partial one. */
size_t kvt_tool_calls_text_len(const char *text, size_t len);

/* ---- thinking mode ------------------------------------------------------ *
 *
 * A prompt rendered in thinking mode (kvt_request.thinking) ends with
 * <｜Assistant｜><think>, so the model first writes its reasoning, closes it
 * with </think> (one special token), then writes the answer, possibly
 * followed by tool calls:
 *
 *   REASONING</think>ANSWER\n\n<｜DSML｜tool_calls>...
 *
 * Clients get the reasoning apart from the answer (OpenAI chat
 * reasoning_content, Anthropic thinking blocks) and send it back with the
 * turn, and the template renders it back as <think>REASONING</think>ANSWER:
 * the same bytes, so the conversation stays append-only. Neither part is
 * trimmed or altered. */

/* Where the reasoning of a thinking-mode reply (len bytes) ends and its
 * answer begins: at the first </think>. True when text holds one: the
 * reasoning is text[0, *reasoning), the </think> text[*reasoning, *answer),
 * the answer text[*answer, len). False when it holds none (the model is
 * still thinking, or max_tokens cut it): all of the text is reasoning,
 * *reasoning = *answer = len. With partial (streaming: the text is still
 * growing) a trailing start of </think> ("</th") is no reasoning yet: then
 * *reasoning stops before it (the next bytes tell what it is) and *answer is
 * len. reasoning and answer may be NULL. */
bool kvt_think_split(const char *text, size_t len, bool partial, size_t *reasoning, size_t *answer);

/* The same for the reply of template t (NULL: deepseek's layout): its
 * reasoning is text[rs, re), its answer text[as, len). A template whose
 * model opens the reasoning itself (t->think_open, Qwen 3's "<think>",
 * Gemma 4's "<|channel>thought"; t->think_close its end, "</think>" or
 * "<channel|>") has
 * rs past that opener when the reply begins with it (a reply that does not
 * is all answer: closed, rs = re = as = 0); one that writes
 * newlines (or whitespace, t->think_ws) around the reasoning and before the
 * answer has them in neither part, so that the parts sent back render to
 * the template's bytes. True when the reasoning is closed: the answer has
 * begun (with partial, when a byte of it that is no such whitespace has
 * arrived). With partial a trailing start of the closing tag, and of the
 * whitespace that may go before it, is held back from the reasoning; while
 * the opener may still be arriving rs = re = 0. False: all of it past rs is
 * reasoning so far, as = len. */
typedef struct kvt_think {
    size_t rs, re, as;
} kvt_think;
struct kvt_template;
bool kvt_think_parts(const struct kvt_template *t, const char *text, size_t len, bool partial, kvt_think *out);
/* The same for a text that grows (streaming, partial): the closing tag is
 * looked for from *searched on (zero it before the first call), which
 * moves to where one may still begin, so a reply's searches cost its
 * length in all. */
bool kvt_think_parts_resume(const struct kvt_template *t, const char *text, size_t len, size_t *searched,
                            kvt_think *out);

#endif
