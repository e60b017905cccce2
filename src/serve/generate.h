/* The generation loop (generate.c): sample a reply on a synced session,
 * stream its settled pieces through a callback, and build the response.
 * It knows the API shapes (api.c, reply.c) but nothing of HTTP or of the server's
 * jobs: what goes to the client goes through kvt_gen_out. */
#ifndef KVT_GENERATE_H
#define KVT_GENERATE_H

#include "serve/api.h"
#include "chat/template.h"
#include "serve/draft.h"

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
    kvt_draft_kind draft;      /* speculative decoding's drafter (KVT_DRAFT_NONE: a token a pass) */
    uint32_t draft_max;        /* tokens drafted at most a pass (0: KVT_DRAFT_MAX_DEFAULT) */
    kvt_draft_model *dm;       /* KVT_DRAFT_MODEL's drafter, following s (NULL: no drafts) */
    kvt_draft_mtp *mtp;        /* KVT_DRAFT_MTP's drafter, on s (NULL: no drafts) */
    kvt_draft_tune *learned;   /* what earlier replies learned of the drafter (a server's record,
                                * kvt_draft_tune_resume): read by kvt_gen_start, written by
                                * kvt_gen_finish, so both on the thread that owns it; NULL: the
                                * reply learns alone */
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

/* Speculative decoding, a pass at a time: kvt_gen_next_pass gives the
 * sampled token and the tokens drafted after it (p->n in all, at most
 * 1 + draft_max; the drafts never run past max_new or the context); the
 * caller runs them through g->s in one pass (kvt_session_verify, or a
 * kvt_session_step with p->rows and p->save, which are NULL when p->n is
 * 1: then a plain step) and reports to kvt_gen_took_pass how many the
 * pass took (done; 1 for a plain step). It keeps the drafts plain
 * decoding would have sampled at their positions from the same logits and
 * draws, takes them as kvt_gen_took would one at a time, and rolls the
 * session back to the last one kept (kvt_session_keep): the reply, its
 * log-probabilities and the session's cache are those of plain decoding.
 * Returns false when the reply ends there. The usage counts the passes,
 * the tokens drafted and those accepted. */
typedef struct kvt_gen_pass {
    const int32_t *tok;        /* the sampled token, then the drafts (the run's) */
    size_t n;
    float *rows;               /* room for n rows of logits (n > 1), the run's */
    kvt_wbuf *save;            /* the state before the pass (n > 1), the run's */
} kvt_gen_pass;
bool kvt_gen_next_pass(kvt_gen_run *R, kvt_gen_pass *p);
/* Test hook: when set, the drafter's replacement (same contract as
 * kvt_draft_ngram), so a test can draft what it knows the reply to be,
 * right or deliberately wrong, on a model that rarely repeats itself. */
extern size_t (*kvt_gen_test_drafter)(const int32_t *ctx, size_t n, int32_t last, size_t max, int32_t *out);
bool kvt_gen_took_pass(kvt_gen_run *R, int rc, size_t done);

#endif
