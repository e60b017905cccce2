/* The API-shape layer of the HTTP server: OpenAI /v1/chat/completions,
 * /v1/completions and /v1/responses, Anthropic /v1/messages.
 *
 * Requests come in as JSON bodies; kvt_request_parse checks every field the
 * server uses, reads the conversation (tool definitions, tool calls and tool
 * results included) into template.h's kvt_chat, and has the model's chat
 * template (template.c, which owns every marker) render it into the prompt
 * text.
 * Responses go out as complete JSON bodies, as Server-Sent Events for
 * streaming, or as error bodies, each in the shape the official `openai` and
 * `@anthropic-ai/sdk` clients (and Codex) parse. Nothing here touches a
 * session or a socket: strings in, malloc'ed strings out, so every shape is
 * testable without a server. docs/API.md documents the templates, which
 * request fields are used or ignored, and how cache tiers show in `usage`.
 *
 * Prompt reuse is the reason for most of the rendering rules: the same tools,
 * sent in any key order by any api, render to the same bytes; per-request
 * metadata (ids, cache keys, user ids) never reaches the prompt; known
 * volatile lines that clients inject are dropped; and a tool call the server
 * sampled can be rendered back with the exact bytes it sampled (the replay
 * hook), so the conversation's next request extends the cached tokens.
 *
 * Ownership: every char * returned is malloc'ed, NUL-terminated, and the
 * caller's to free; NULL means out of memory (or a NULL request). Text passed
 * in (generated text, messages) may be any bytes: invalid UTF-8 is sent as
 * U+FFFD so the JSON is always valid.
 */
#ifndef KVT_API_H
#define KVT_API_H

#include "base/jsonstr.h"   /* kvt_json_dumps */
#include "kvtier.h"
#include "chat/template.h" /* kvt_tool_call, kvt_tool_calls_*, kvt_think_split, kvt_template_name */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    KVT_API_CHAT,        /* POST /v1/chat/completions (OpenAI) */
    KVT_API_COMPLETIONS, /* POST /v1/completions (OpenAI, legacy text) */
    KVT_API_MESSAGES,    /* POST /v1/messages (Anthropic) */
    KVT_API_RESPONSES,   /* POST /v1/responses (OpenAI Responses) */
} kvt_api;

/* Most stop sequences per request: OpenAI documents 4; Anthropic documents
 * no limit, so it gets a generous one that still bounds the server's scan. */
#define KVT_API_MAX_STOP_OPENAI 4
#define KVT_API_MAX_STOP_ANTHROPIC 32

/* Alternatives per token OpenAI allows: chat "top_logprobs" and Responses
 * "top_logprobs" 0 to 20, legacy completions "logprobs" 0 to 5. */
#define KVT_API_MAX_TOP_LOGPROBS 20
#define KVT_API_MAX_LOGPROBS_LEGACY 5

/* A Responses function inside a {"type":"namespace"} tool is shown to the
 * model, and parsed back from it, as NAMESPACE KVT_API_NS_SEP NAME
 * ("github.get_issue"). OpenAI function names cannot contain '.', so the
 * qualified name is never ambiguous. */
#define KVT_API_NS_SEP "."

typedef struct kvt_request {
    kvt_api api;
    char *model;                /* the "model" field (NULL if absent) */
    char *prompt;               /* rendered prompt text, malloc'ed, NUL-terminated */
    size_t prompt_len;          /* bytes, excluding the NUL */
    size_t fork_at;             /* where the last user message's own text begins in the
                                 * prompt (bytes): the next conversation on the same
                                 * system prompt and history diverges there; SIZE_MAX:
                                 * not found (no user text, or none rendered) */
    bool opening;               /* no assistant turn before the last user message: a
                                 * conversation's first request */
    const kvt_template *tmpl;   /* the template that rendered the prompt (chat, messages,
                                 * responses; NULL for completions and for a request
                                 * built by hand: then replies are read in the DSML
                                 * syntax of kvt_tool_calls_parse) */
    bool prompt_has_bos;        /* the template already emitted the BOS text: tokenize
                                 * without adding BOS */
    bool prompt_special;        /* the prompt's markers are special tokens: tokenize with
                                 * special-token parsing (the template's .special) */
    bool thinking;              /* the template rendered the prompt in thinking mode and
                                 * it ends with the generation prompt: the reply is
                                 * REASONING</think>ANSWER (kvt_think_parts with tmpl).
                                 * False for templates without a thinking mode, for
                                 * Responses and completions, and for a prefill (the
                                 * reply continues an answer) */
    bool stream, include_usage; /* include_usage: OpenAI stream_options.include_usage */
    uint32_t max_tokens;        /* 0 when absent (server applies its default); else >= 1 */
    float temperature;          /* default 1.0 (OpenAI and Anthropic default); 0 = greedy */
    float top_p;                /* default 1; a request's 0 is stored as the smallest
                                 * positive float (keep only the top token): the sampler
                                 * reads 0 as "off" */
    uint32_t top_k;             /* default 0 = off */
    uint64_t seed;              /* OpenAI "seed" (negative values wrap); valid if has_seed */
    bool has_seed;
    char **stop;                /* (n_stop) non-empty NUL-terminated strings: OpenAI "stop"
                                 * (string or array), Anthropic "stop_sequences" */
    size_t n_stop;
    size_t n_tools;             /* function tools rendered into the prompt: when 0 the
                                 * client offered none, and generated text is text */
    struct json_t *fns;         /* those functions (kvt_chat.fns: "name", "parameters"),
                                 * whose schemas type the arguments of a call syntax
                                 * that writes them as bare text; NULL when none */
    char **namespaces;          /* (n_namespaces) Responses namespace tool names, to split
                                 * "ns.fn" back into name and namespace in the output */
    size_t n_namespaces;
    bool logprobs;              /* report the log-probabilities of the sampled tokens: chat
                                 * "logprobs": true, completions "logprobs": N, Responses
                                 * "include": ["message.output_text.logprobs"] */
    uint32_t top_logprobs;      /* most likely alternatives per token, 0 to
                                 * KVT_API_MAX_TOP_LOGPROBS (completions: to
                                 * KVT_API_MAX_LOGPROBS_LEGACY) */
    /* Streaming state, advanced by the kvt_stream_* calls (which is why they
     * take a non-const request): the next Responses sequence_number, and
     * whether the text has begun: the Responses message item has been
     * opened, or in thinking mode the first answer piece went out (Anthropic:
     * the thinking block is closed and the text block open). */
    uint32_t sse_seq;
    bool sse_text_open;
} kvt_request;

/* Exact replay (kvt_replay_fn, template.h): called while the request is
 * parsed, from the parsing thread; it appends a copy. */
typedef struct kvt_parse_opts {
    bool keep_volatile;         /* keep the volatile lines clients inject into system
                                 * text (x-anthropic-billing-header: ...); by default
                                 * they are dropped from the prompt */
    kvt_replay_fn replay;       /* NULL: every tool call in history renders canonically */
    void *replay_user;
} kvt_parse_opts;

/* Parse a request body (len bytes, need not be NUL-terminated) for api and
 * render its prompt for model m (the template: kvt_template_name(m)), with
 * the default options (volatile lines dropped, no replay).
 * On success *out owns its strings (free with kvt_request_free) and *status
 * is 200. On failure *out is left empty, the return is KVT_EINVAL (or
 * KVT_ENOMEM), kvt_errmsg() is a message fit for the client naming the field,
 * and *status (may be NULL) is the HTTP status to send: 400 for malformed JSON,
 * wrong types, values out of range, missing fields and unsupported content
 * (images, audio, n > 1, stored-response references, log-probabilities out of
 * OpenAI's range); 500 for KVT_ENOMEM. Whether "model" names a model served
 * is the server's to decide, not the parser's. */
int kvt_request_parse(kvt_request *out, kvt_api api, const char *body, size_t len,
                      const kvt_model *m, int *status);
/* The same with options (opts NULL: the defaults). replay is called during
 * the parse only, once per tool call in the history that carries an id, by
 * the deepseek template (the plain one renders every call canonically). */
int kvt_request_parse_opts(kvt_request *out, kvt_api api, const char *body, size_t len,
                           const kvt_model *m, const kvt_parse_opts *opts, int *status);
/* Free what a parse put in r and zero it (accepts NULL and a zeroed r). */
void kvt_request_free(kvt_request *r);

/* ---- tool calls and thinking in generated text ------------------------ *
 *
 * The syntax is the template's (template.h: kvt_tool_calls_parse,
 * kvt_tool_calls_text_len, kvt_think_split). */

/* The tool calls of a finished reply to r (len bytes): none when r offered
 * no tools (r->n_tools 0: *n = 0, *text_end = len); in thinking mode parsed
 * out of the answer only (reasoning may quote the markup), so without a
 * </think> there are none. Otherwise as kvt_tool_calls_parse, with raw_off
 * and *text_end counted from the start of text, reasoning included (keep
 * text + raw_off for the replay hook: the first call's bytes begin where the
 * answer's text ends). */
int kvt_reply_tool_calls(const kvt_request *r, const char *text, size_t len, kvt_tool_call **calls, size_t *n,
                         size_t *text_end);

/* ---- responses --------------------------------------------------------- */

typedef struct kvt_usage {
    uint32_t prompt_tokens, completion_tokens;
    uint32_t cached_tokens;   /* prompt tokens reused from a cache tier (RAM or disk) */
    uint32_t created_tokens;  /* prompt tokens newly written to the disk tier by this request */
    uint32_t reasoning_tokens; /* completion tokens of the reasoning (thinking mode), the
                                * one that completes </think> included; part of
                                * completion_tokens (clamped to it) */
    uint32_t passes;          /* decoding passes of the reply (speculative decoding: fewer than tokens) */
    uint32_t drafted, accepted; /* tokens drafted, and of them accepted (kept) */
} kvt_usage;

/* ---- log-probabilities ---------------------------------------------------- *
 *
 * What the server reports for a request with r->logprobs: per sampled token
 * its log-probability under the model and its r->top_logprobs most likely
 * alternatives, from the logits it was sampled from. */
typedef struct kvt_logprob {
    const char *bytes;          /* the token's bytes as they appear in the text (borrowed) */
    size_t len;
    double logprob;             /* natural log of its probability; non-finite values and
                                 * values below -9999 are written as -9999.0 (OpenAI's
                                 * "too unlikely to score") */
} kvt_logprob;

/* The tokens of a piece of text (a whole reply, or one streamed delta). */
typedef struct kvt_logprobs {
    const kvt_logprob *tok;     /* n sampled tokens, in text order */
    const kvt_logprob *top;     /* n * n_top alternatives: token i's are top[i * n_top ..
                                 * i * n_top + n_top), most likely first */
    size_t n, n_top;
    size_t offset;              /* byte offset of tok[0] in the generated text (the
                                 * pieces follow each other: legacy "text_offset") */
} kvt_logprobs;

/* Log-softmax of logits (n_vocab raw model scores) in double precision:
 * returns the log-probability of token id, and writes the min(n_top, n_vocab)
 * most likely tokens to top_id / top_lp (may be NULL when n_top is 0), by
 * log-probability descending, the lower id first on ties. NaN scores count
 * as -infinity. id outside [0, n_vocab) or no logits: NaN. */
double kvt_logprob_top(const float *logits, uint32_t n_vocab, int32_t id, uint32_t n_top,
                       int32_t *top_id, double *top_lp);

/* Complete (non-streaming) response body for text (len bytes) and tool calls
 * (n_calls, may be 0). In thinking mode (r->thinking) text is the whole reply
 * up to the calls, REASONING</think>ANSWER, and the body splits it
 * (kvt_think_split): OpenAI chat gives the reasoning as
 * message.reasoning_content next to content, Anthropic as a
 * {"type":"thinking","thinking":...,"signature":""} block before the text
 * block; without a </think> it is all reasoning and the answer is empty.
 * finish: "stop", "length" or "tool_calls" (NULL:
 * "stop"; with n_calls > 0 anything but "length" is "tool_calls"). For Anthropic
 * "stop" becomes "end_turn", or "stop_sequence" with stop_sequence = stop_seq
 * when stop_seq is not NULL, "length" becomes "max_tokens" and "tool_calls"
 * "tool_use"; for Responses "length" makes the status "incomplete". id and
 * model_name are echoed (NULL: ""); id is the response id ("resp_..." for
 * Responses: its output item ids are derived from it). u may be NULL (all
 * zero). Tool calls are not part of the legacy completions shape: ignored
 * there. */
char *kvt_response_json_calls(const kvt_request *r, const char *id, const char *model_name,
                              const char *text, size_t len, const kvt_tool_call *calls, size_t n_calls,
                              const char *finish, const char *stop_seq, const kvt_usage *u, long created);
/* The same with the log-probabilities of the text's tokens (lp NULL: none),
 * reported when r->logprobs: OpenAI chat "logprobs":{"content":[{token,
 * logprob, bytes, top_logprobs}], "refusal":null}, completions
 * "logprobs":{tokens, token_logprobs, top_logprobs, text_offset}, Responses
 * "logprobs" on the output_text part; otherwise as kvt_response_json_calls. */
char *kvt_response_json_lp(const kvt_request *r, const char *id, const char *model_name,
                           const char *text, size_t len, const kvt_tool_call *calls, size_t n_calls,
                           const char *finish, const char *stop_seq, const kvt_usage *u, long created,
                           const kvt_logprobs *lp);
/* The same without tool calls. */
char *kvt_response_json(const kvt_request *r, const char *id, const char *model_name,
                        const char *text, size_t len, const char *finish, const char *stop_seq,
                        const kvt_usage *u, long created);

/* Streaming. Each returns SSE text to write as is: "data: {...}\n\n" events
 * (OpenAI chat and completions) or "event: X\ndata: {...}\n\n" events
 * (Anthropic, Responses), possibly several concatenated, possibly "" when the
 * api has nothing to say at that point. Call them in order: begin, delta per
 * piece of text, end (or error).
 *
 *   begin   OpenAI chat: a chunk whose delta is {role:"assistant", content:""};
 *           completions: nothing; Anthropic: message_start (input-side usage
 *           from u, output_tokens = u->completion_tokens), content_block_start
 *           (index 0, an empty text block; in thinking mode an empty
 *           thinking block {type:"thinking", thinking:"", signature:""}) and
 *           a ping; Responses: response.created and response.in_progress.
 *   reasoning  (thinking mode, before the first delta) len bytes of the
 *           reasoning: a chunk whose delta is {reasoning_content: ...}
 *           (OpenAI chat) or a content_block_delta at index 0 with a
 *           thinking_delta (Anthropic); "" when len is 0, for the other apis,
 *           outside thinking mode and after the first delta.
 *   delta   len bytes of text (in thinking mode: of the answer): a chunk with
 *           the text (OpenAI) or a content_block_delta with a text_delta
 *           (Anthropic; in thinking mode the first one is preceded by
 *           content_block_stop for the thinking block and content_block_start
 *           of the text block at index 1, where its deltas go), or
 *           response.output_text.delta (Responses; the first one is preceded
 *           by output_item.added and content_part.added); "" when len is 0.
 *   end     tool calls, then the close: OpenAI chat: a chunk per tool call,
 *           then the chunk with finish_reason, then a chunk with empty choices
 *           and usage when include_usage, then "data: [DONE]\n\n";
 *           Anthropic: content_block_stop for the text (in thinking mode,
 *           when no delta opened it, first the thinking block's stop and the
 *           text block's start), a tool_use block per call at the next
 *           indices (start, one input_json_delta, stop), message_delta
 *           (stop_reason, stop_sequence, usage with output_tokens and the input
 *           fields repeated), message_stop; Responses: the text's done events,
 *           a function_call item per call (added, arguments delta and done,
 *           item done), then response.completed with the whole response.
 *           text is the whole text (all deltas together): only Responses uses
 *           it; kvt_stream_end passes none (use kvt_stream_end_calls for
 *           Responses).
 *
 * With include_usage every OpenAI chunk before the usage chunk carries
 * "usage": null, as OpenAI sends them. */
char *kvt_stream_begin(kvt_request *r, const char *id, const char *model_name,
                       const kvt_usage *u, long created);
char *kvt_stream_reasoning(kvt_request *r, const char *id, const char *model_name,
                           const char *text, size_t len, long created);
char *kvt_stream_delta(kvt_request *r, const char *id, const char *model_name,
                       const char *text, size_t len, long created);
char *kvt_stream_end_calls(kvt_request *r, const char *id, const char *model_name,
                           const char *text, size_t len, const kvt_tool_call *calls, size_t n_calls,
                           const char *finish, const char *stop_seq, const kvt_usage *u, long created);
char *kvt_stream_end(kvt_request *r, const char *id, const char *model_name,
                     const char *finish, const char *stop_seq, const kvt_usage *u, long created);
/* delta and end with log-probabilities (lp NULL: none), reported when
 * r->logprobs: a delta carries those of its own tokens (OpenAI chat
 * "logprobs":{"content":[...],"refusal":null}, completions the legacy object,
 * Responses the delta event's "logprobs"); end carries those of the whole
 * text, which only Responses repeats (output_text.done, the part, the item
 * and response.completed). Chunks without text carry "logprobs": null, except
 * the completions finish chunk, whose "" text has empty lists. */
char *kvt_stream_delta_lp(kvt_request *r, const char *id, const char *model_name,
                          const char *text, size_t len, long created, const kvt_logprobs *lp);
/* reasoning with the log-probabilities of its tokens (OpenAI chat, as a
 * delta carries them): thinking mode reports every generated token, the
 * reasoning's and the </think> included. */
char *kvt_stream_reasoning_lp(kvt_request *r, const char *id, const char *model_name,
                              const char *text, size_t len, long created, const kvt_logprobs *lp);
char *kvt_stream_end_lp(kvt_request *r, const char *id, const char *model_name,
                        const char *text, size_t len, const kvt_tool_call *calls, size_t n_calls,
                        const char *finish, const char *stop_seq, const kvt_usage *u, long created,
                        const kvt_logprobs *lp);
/* An error after the stream began (the HTTP status is already sent): OpenAI
 * "data: {"error":{...}}\n\n" (the openai client throws on it), Anthropic
 * "event: error\ndata: {"type":"error",...}\n\n", Responses an error event
 * (with "error" for the openai client) then response.failed (what Codex
 * reads). */
char *kvt_stream_error(kvt_api api, int status, const char *message);

/* Error body in the api's shape: OpenAI (chat, completions, Responses)
 * {"error":{"message","type","param","code"}}, Anthropic
 * {"type":"error","error":{"type","message"}}. The type
 * follows the status: 400 invalid_request_error, 401 authentication_error,
 * 403 permission_error, 404 not_found_error, 413 request_too_large,
 * 429 rate_limit_error, 500 api_error, 503 overloaded_error; another 4xx is
 * invalid_request_error, anything else api_error. */
char *kvt_error_json(kvt_api api, int status, const char *message);
/* The error type string for a status (static). */
const char *kvt_error_type(int status);

/* GET /v1/models body listing one model, readable by both clients: OpenAI's
 * {"object":"list","data":[{id, object:"model", created, owned_by}]} and
 * Anthropic's {data:[{id, type:"model", display_name, created_at}], has_more,
 * first_id, last_id} merged into one object. created: Unix seconds. */
char *kvt_models_json(const char *model_id, long created);

#endif
