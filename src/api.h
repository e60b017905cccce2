/* The API-shape layer of the HTTP server: OpenAI /v1/chat/completions and
 * /v1/completions, Anthropic /v1/messages.
 *
 * Requests come in as JSON bodies; kvt_request_parse checks every field the
 * server uses and renders the conversation into the model's prompt text with
 * a chat template. Responses go out as complete JSON bodies, as Server-Sent
 * Events for streaming, or as error bodies, each in the shape the official
 * `openai` and `@anthropic-ai/sdk` clients parse. Nothing here touches a
 * session or a socket: strings in, malloc'ed strings out, so every shape is
 * testable without a server. docs/API.md documents the templates, which
 * request fields are used or ignored, and how cache tiers show in `usage`.
 *
 * Ownership: every char * returned is malloc'ed, NUL-terminated, and the
 * caller's to free; NULL means out of memory (or a NULL request). Text passed
 * in (generated text, messages) may be any bytes: invalid UTF-8 is sent as
 * U+FFFD so the JSON is always valid.
 */
#ifndef KVT_API_H
#define KVT_API_H

#include "kvtier.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    KVT_API_CHAT,        /* POST /v1/chat/completions (OpenAI) */
    KVT_API_COMPLETIONS, /* POST /v1/completions (OpenAI, legacy text) */
    KVT_API_MESSAGES,    /* POST /v1/messages (Anthropic) */
} kvt_api;

/* Most stop sequences per request: OpenAI documents 4; Anthropic documents
 * no limit, so it gets a generous one that still bounds the server's scan. */
#define KVT_API_MAX_STOP_OPENAI 4
#define KVT_API_MAX_STOP_ANTHROPIC 32

typedef struct kvt_request {
    kvt_api api;
    char *model;                /* the "model" field (NULL if absent) */
    char *prompt;               /* rendered prompt text, malloc'ed, NUL-terminated */
    size_t prompt_len;          /* bytes, excluding the NUL */
    bool prompt_has_bos;        /* the template already emitted the BOS text: tokenize
                                 * without adding BOS, with special-token parsing */
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
} kvt_request;

/* Parse a request body (len bytes, need not be NUL-terminated) for api and
 * render its prompt for model m (the template: kvt_template_name(m)).
 * On success *out owns its strings (free with kvt_request_free) and *status
 * is 200. On failure *out is left empty, the return is KVT_EINVAL (or
 * KVT_ENOMEM), kvt_errmsg() is a message fit for the client naming the field,
 * and *status (may be NULL) is the HTTP status to send: 400 for malformed JSON,
 * wrong types, values out of range, missing fields and unsupported content
 * (images, audio, tools, n > 1); 500 for KVT_ENOMEM. An unknown model is the
 * server's 404, not decided here. */
int kvt_request_parse(kvt_request *out, kvt_api api, const char *body, size_t len,
                      const kvt_model *m, int *status);
/* Free what a parse put in r and zero it (accepts NULL and a zeroed r). */
void kvt_request_free(kvt_request *r);

/* The chat template for a model: "deepseek" for arch "ds4", "plain" otherwise
 * (also for m NULL). Static string. */
const char *kvt_template_name(const kvt_model *m);

typedef struct kvt_usage {
    uint32_t prompt_tokens, completion_tokens;
    uint32_t cached_tokens;   /* prompt tokens reused from a cache tier (RAM or disk) */
    uint32_t created_tokens;  /* prompt tokens newly written to the disk tier by this request */
} kvt_usage;

/* Complete (non-streaming) response body. finish: "stop" or "length" (NULL:
 * "stop"); for Anthropic "stop" becomes "end_turn", or "stop_sequence" with
 * stop_sequence = stop_seq when stop_seq is not NULL, and "length" becomes
 * "max_tokens". text is len bytes. id and model_name are echoed (NULL: "").
 * u may be NULL (all zero). */
char *kvt_response_json(const kvt_request *r, const char *id, const char *model_name,
                        const char *text, size_t len, const char *finish, const char *stop_seq,
                        const kvt_usage *u, long created);

/* Streaming. Each returns SSE text to write as is: "data: {...}\n\n" events
 * (OpenAI) or "event: X\ndata: {...}\n\n" events (Anthropic), possibly several
 * concatenated, possibly "" when the api has nothing to say at that point.
 *
 *   begin   OpenAI chat: a chunk whose delta is {role:"assistant", content:""};
 *           completions: nothing; Anthropic: message_start (input-side usage
 *           from u, output_tokens = u->completion_tokens), content_block_start
 *           (index 0, an empty text block) and a ping.
 *   delta   len bytes of text: a chunk with the text (OpenAI) or a
 *           content_block_delta with a text_delta (Anthropic); "" when len is 0.
 *   end     OpenAI: the chunk with finish_reason, then a chunk with empty
 *           choices and usage when include_usage, then "data: [DONE]\n\n";
 *           Anthropic: content_block_stop, message_delta (stop_reason,
 *           stop_sequence, usage with output_tokens and the input fields
 *           repeated), message_stop.
 *
 * With include_usage every OpenAI chunk before the usage chunk carries
 * "usage": null, as OpenAI sends them. */
char *kvt_stream_begin(const kvt_request *r, const char *id, const char *model_name,
                       const kvt_usage *u, long created);
char *kvt_stream_delta(const kvt_request *r, const char *id, const char *model_name,
                       const char *text, size_t len, long created);
char *kvt_stream_end(const kvt_request *r, const char *id, const char *model_name,
                     const char *finish, const char *stop_seq, const kvt_usage *u, long created);
/* An error after the stream began (the HTTP status is already sent): OpenAI
 * "data: {"error":{...}}\n\n" (the openai client throws on it), Anthropic
 * "event: error\ndata: {"type":"error",...}\n\n". */
char *kvt_stream_error(kvt_api api, int status, const char *message);

/* Error body in the api's shape: OpenAI {"error":{"message","type","param",
 * "code"}}, Anthropic {"type":"error","error":{"type","message"}}. The type
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
