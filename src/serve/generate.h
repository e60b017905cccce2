/* The generation loop (generate.c): sample a reply on a synced session,
 * stream its settled pieces through a callback, and build the response.
 * It knows the API shapes (api.c, reply.c) but nothing of HTTP or of the server's
 * jobs: what goes to the client goes through kvt_gen_out. */
#ifndef KVT_GENERATE_H
#define KVT_GENERATE_H

#include "serve/api.h"
#include "chat/template.h"

/* Where the loop's output goes. Every callback may be NULL. */
typedef struct kvt_gen_out {
    /* a streaming event (SSE bytes, malloc'ed: the callee owns it; NULL when
     * it could not be made) */
    void (*emit)(void *user, char *sse);
    /* true: stop generating, the reply ends there (finish "stop") */
    bool (*canceled)(void *user);
    /* the reply's tool calls, raw_off/raw_len counted in text, before the
     * response is built */
    void (*tool_calls)(void *user, const char *text, const kvt_tool_call *calls, size_t n);
    void *user;
} kvt_gen_out;

/* One reply to generate. */
typedef struct kvt_gen {
    kvt_model *m;
    kvt_session *s;            /* synced to the prompt; decoded into as tokens are sampled */
    kvt_request *r;            /* sampling, stops, logprobs, tools, thinking; its streaming state advances */
    const char *id;            /* the response id */
    const char *model_name;    /* echoed in every event */
    long created;
    bool stream;               /* emit the begin event and the deltas, and return the end events */
    uint32_t max_new;          /* tokens at most (the request's or the server's default) */
    uint32_t n_ctx;            /* the session stops at this length (finish "context") */
    uint64_t seed;             /* the sampler's, unless the request has one */
} kvt_gen;

/* Generate g's reply, u the usage so far (prompt and cache figures): counts
 * completion_tokens and reasoning_tokens in it. Returns the end of the reply
 * as the client gets it, malloc'ed (NULL when it could not be made): with
 * g->stream the closing events, otherwise the whole response JSON. */
char *kvt_generate_run(const kvt_gen *g, kvt_usage *u, const kvt_gen_out *out);

/* The same loop a step at a time, for a caller that runs the tokens itself
 * (the server's scheduler, several replies in one forward pass):
 * kvt_gen_start emits the begin event (NULL: no memory); while
 * kvt_gen_next gives a token, the caller runs it through g->s (the
 * session's logits then follow it) and reports the result to kvt_gen_took,
 * which returns false when the reply ends there; kvt_gen_finish returns
 * what kvt_generate_run returns and frees the run. g, u and out must
 * outlive the run. */
typedef struct kvt_gen_run kvt_gen_run;
kvt_gen_run *kvt_gen_start(const kvt_gen *g, kvt_usage *u, const kvt_gen_out *out);
bool kvt_gen_next(kvt_gen_run *R, int32_t *tok);
bool kvt_gen_took(kvt_gen_run *R, int rc);
char *kvt_gen_finish(kvt_gen_run *R);

#endif
