/* Internal definitions shared by the model loader, the architectures and the
 * session: the model object, the per-architecture operations and the session
 * object they operate on. Not part of the public API. */
#ifndef KVT_MODEL_H
#define KVT_MODEL_H

#include "kvtier.h"
#include "buf.h"
#include "cache.h"
#include "gguf.h"
#include "kernels.h"
#include "threads.h"
#include "tokenizer.h"

/* One session's part of a batched forward pass (kvt_arch.forward_batch):
 * tokens tok[0..n) at positions pos0.. of session s, logits of rows >= lfrom
 * into logits, as kvt_arch.forward takes them. */
typedef struct kvt_seg {
    kvt_session *s;
    const int32_t *tok;
    size_t n, pos0;
    float *logits;
    size_t lfrom;
} kvt_seg;

/* What an architecture provides. */
typedef struct kvt_arch {
    const char *name;
    /* Create s->cache for a context of s->n_ctx tokens. */
    int (*cache_new)(kvt_session *s);
    /* Run tokens tok[0..n) at absolute positions pos0..pos0+n-1; the cache
     * holds valid state for [0, pos0) and gains [pos0, pos0+n). For every row
     * i >= lfrom, logits[(i - lfrom) * n_vocab ...] receives its next-token
     * logits (logits may be NULL when lfrom >= n). */
    int (*forward)(kvt_session *s, const int32_t *tok, size_t n, size_t pos0,
                   float *logits, size_t lfrom);
    /* The same for k segments of distinct sessions of this model at once,
     * every matrix read once for all of their tokens. Each segment's
     * results are bit-identical to its own forward (the kernels treat
     * every row on its own). On failure each session is as after a failed
     * forward. NULL: the segments run one after another. */
    int (*forward_batch)(const kvt_seg *seg, size_t k);
    /* Append the fixed state (window, frontier) for the s->n held tokens in
     * logical order: only entries valid at s->n, oldest first. The
     * recurrent layers' state (plan.recurrent bytes, the same at every n)
     * comes last: a snapshot stores it in a section of its own. NULL: none. */
    void (*state_save)(const kvt_session *s, kvt_wbuf *b);
    /* Inverse of state_save for n tokens; KVT_EFORMAT when r is short. */
    int (*state_load)(kvt_session *s, size_t n, kvt_rbuf *r);
    /* Rebuild the fixed state for the s->n held tokens from the token ids,
     * the stream rows and s->logits alone (a snapshot stored without its
     * state); KVT_ECORRUPT when the rebuilt state disagrees with them.
     * NULL: the architecture cannot (it has no state to rebuild). */
    int (*state_rebuild)(kvt_session *s);
    /* Hash over the architecture config and every weight. */
    uint64_t (*fingerprint)(const void *w);
    /* After the fingerprint: rearrange weights for the kernels (copies
     * that replace the file's pages, which kvt_gguf_release may drop; g
     * is the file the weights borrow from). NULL: nothing to do. */
    int (*weights_pack)(void *w, const kvt_gguf *g);
    void (*weights_free)(void *w);
    /* The KV cache plan for a context of ctx tokens. */
    int (*plan)(const kvt_model *m, uint64_t ctx, kvt_plan *out);
    /* A session's scratch (s->work), sized from its context and chunk:
     * made when it is created, or for a session on a shared pool when it
     * first runs (kvt_session_work); NULL: none. Freed with work_free;
     * work_bytes is the memory it holds. Nothing in it outlives a call:
     * sessions of the same model, context and chunk may hand it on. */
    int (*work_new)(kvt_session *s);
    void (*work_free)(void *work);
    size_t (*work_bytes)(const void *work);
} kvt_arch;

struct kvt_model {
    kvt_model_info info;
    uint64_t fingerprint;      /* model: config + weights */
    uint64_t tok_fingerprint;  /* tokenizer: vocabulary, scores, merges, specials */
    char *name;
    char *chat_template;     /* tokenizer.chat_template, NULL: none (info.chat_template) */
    const kvt_arch *arch;
    void *weights;           /* architecture-specific */
    kvt_gguf *file;          /* the mapped GGUF whose tensors the weights borrow; NULL: they own theirs */
    kvt_tokenizer *tok;
};

/* A rollback point: the fixed state and logits at a position (the streams'
 * rows are append-only, so truncating them restores the rest). */
typedef struct kvt_checkpoint {
    size_t pos;
    float *logits;            /* (n_vocab) */
    kvt_wbuf state;
} kvt_checkpoint;

struct kvt_session {
    kvt_model *m;
    kvt_cache *cache;
    kvt_pool *pool;
    bool own_pool;           /* false: borrowed (kvt_session_new_on) */
    uint32_t n_threads;
    uint32_t n_ctx, chunk;
    bool rolling;
    kvt_progress_fn progress;
    void *progress_user;
    int32_t *tokens;         /* (n_ctx) exact ids held */
    size_t n;                /* tokens held */
    float *logits;           /* (n_vocab) after tokens[n-1] when n > 0 */
    uint64_t rebuilds;
    kvt_checkpoint *ckpt;      /* (n_ckpt) by increasing pos; architectures with state only */
    size_t n_ckpt, cap_ckpt;
    uint32_t ckpt_interval;    /* tokens between grid checkpoints */
    size_t mark;               /* also checkpoint here during prefill (0: none) */
    size_t save_mark;          /* and here: the save policy's cold point (0: none) */
    void *work;                /* the architecture's scratch (kvt_arch.work_new) */
};

/* Session checkpoints (session.c): remember the state at the current
 * position; forget all. */
void kvt_session_checkpoint(kvt_session *s);
void kvt_session_ckpt_clear(kvt_session *s);
/* Make dst an exact copy of src (same model; dst's context must hold it):
 * rows, state, tokens, logits and checkpoints. */
int kvt_session_clone(kvt_session *dst, const kvt_session *src);
/* Make later syncs also leave a checkpoint at pos (0: none). */
void kvt_session_set_mark(kvt_session *s, size_t pos);
/* The same for the save policy's cold point (kvt_save_policy_cold), which
 * is off the grid: a second mark, so the two never displace each other. */
void kvt_session_set_save_mark(kvt_session *s, size_t pos);
/* RAM held by a session: its cache (rows, state, block tables), checkpoints,
 * token and logit arrays, scratch (while it has some) and the session
 * itself. */
size_t kvt_session_bytes(const kvt_session *s);

/* Sessions for a pool of them (tiers.c). kvt_session_new_on makes a
 * session as kvt_session_new does, except that it runs on pool (borrowed:
 * it must outlive the session; kvt_session_set_threads gives it a pool of
 * its own) rather than starting threads of its own, and makes its scratch
 * only when it first runs. kvt_session_work makes s's scratch when it has
 * none (every call that runs the model does so first). kvt_session_park
 * leaves s holding its cache, tokens, logits and checkpoints alone: it
 * drops the cache's spare arena and takes the scratch away, returned for
 * kvt_session_lend to another session of the same model, context and
 * chunk (or kvt_session_scratch_free); NULL when s had none.
 * kvt_session_lend gives scratch to a session that has none (else frees
 * it). */
int kvt_session_new_on(kvt_session **out, kvt_model *m, const kvt_session_opts *opts, kvt_pool *pool);
int kvt_session_work(kvt_session *s);
void *kvt_session_park(kvt_session *s);
void kvt_session_lend(kvt_session *s, void *work);
void kvt_session_scratch_free(const kvt_model *m, void *work);
size_t kvt_session_scratch_bytes(const kvt_model *m, const void *work);

/* One session's share of a batched step (kvt_session_step): append up to n
 * tokens tok[0..n) at s->n. The step may take fewer (done): it never
 * crosses a checkpoint position (the grid, the marks), so every session
 * leaves the same checkpoints as a sync of the same tokens would (and a
 * decoded token the grid's, as kvt_session_decode). end: the n tokens end
 * a prompt (a checkpoint when all of them are taken, as at the end of
 * kvt_session_sync). */
typedef struct kvt_step {
    kvt_session *s;
    const int32_t *tok;
    size_t n;
    bool end;
    size_t done;                 /* out: tokens taken */
} kvt_step;
/* Advance k distinct sessions of one model by one forward pass over all
 * their tokens (at most max_tokens in all, 0: the first session's chunk;
 * each session gets at least one). After it, each s->logits follow its
 * last token. A session's logits, cache and checkpoints are bit-identical
 * to those of kvt_session_decode / kvt_session_sync of the same tokens
 * alone. On an error no session advances (each is as after a failed
 * decode). KVT_EINVAL: a token out of range, a session twice or full,
 * another model. */
int kvt_session_step(kvt_step *st, size_t k, size_t max_tokens);
/* The first part of kvt_session_sync: validate the prompt (*tokens, *n:
 * in rolling mode its last n_ctx tokens) and go back to the longest
 * restorable prefix of it; *reused is what s holds of it after. The rest,
 * (*tokens)[s->n .. *n), is the caller's to step (the last step with end). */
int kvt_session_sync_prepare(kvt_session *s, const int32_t **tokens, size_t *n, size_t *reused);

/* Architectures. */
extern const kvt_arch kvt_arch_llama;
/* A model from an open GGUF (path names it in messages): the architecture
 * general.architecture names, the tokenizer, the fingerprints, the packed
 * weights. The model does not own g, which must outlive it (its weights may
 * borrow g's tensors) unless given to it as m->file. */
int kvt_model_from_gguf(kvt_model **out, const kvt_gguf *g, const char *path);
int kvt_llama_load(kvt_model *m, const kvt_gguf *g);
/* Whether general.architecture is one of the llama family kvt_llama_load
 * runs (llama, qwen2, qwen3). */
bool kvt_llama_handles(const kvt_gguf *g);
extern const kvt_arch kvt_arch_ds4;
int kvt_ds4_load(kvt_model *m, const kvt_gguf *g);
/* A ds4 preset ("ds4-tiny", "ds4-mini") with synthetic weights from seed and
 * the given tokenizer (taken over by the model). KVT_ENOENT: no such preset. */
int kvt_ds4_preset(kvt_model *m, const char *preset, uint64_t seed, kvt_tokenizer *tok);
/* Write a ds4 model (config, weights, tokenizer) as GGUF. */
int kvt_ds4_write_gguf(const kvt_model *m, const char *path);

/* Indices of the k best scores (ties: lower index), sorted ascending;
 * scratch holds k + 1 (score, index) pairs. Returns min(n, k). */
size_t kvt_ds4_topk(const float *score, size_t n, size_t k, uint32_t *sel, void *scratch);
/* Tests against another implementation: its discrete choices imposed, so
 * that everything else can be compared position by position (ds4, and the
 * routed experts of the llama family's qwen3moe). For each
 * layer l with sel[l] (ds4's ratio 4) the rows the indexer keeps at position t
 * (< n; K per token, any order) replace kvtier's own choice wherever it
 * chooses (more than K rows visible); ex[l] (Eu per token) does the same for
 * the routed experts. kvtier still makes its own choice first and records
 * in sel_gap[l][t] / ex_gap[l][t] (n floats each, when given) -1 where the
 * two agree, else how close its own choice was: the gap between its K-th
 * (Eu-th) and (K+1)-th ((Eu+1)-th) score relative to the largest score
 * (INFINITY for a hash layer's table). */
typedef struct kvt_forced {
    size_t n;
    uint32_t K, Eu;
    const int32_t *sel[64], *ex[64];
    float *sel_gap[64], *ex_gap[64];
} kvt_forced;
extern kvt_forced *kvt_force;
/* Fault injection for the tests that must prove they catch such bugs. */
enum { KVT_DS4_FAULT_NONE, KVT_DS4_FAULT_MASK, KVT_DS4_FAULT_FRONTIER, KVT_DS4_FAULT_REPLAY, KVT_DS4_FAULT_YARN };
extern int kvt_ds4_fault;
/* Test hooks of the llama family, to show a test catches such bugs:
 * KVT_LLAMA_FAULT_ROPE_PAIRS turns NEOX heads (qwen2, qwen3) on adjacent
 * pairs, as llama's; KVT_LLAMA_FAULT_MOE_WEIGHTS leaves the chosen experts'
 * weights unnormalised (qwen3moe); KVT_LLAMA_FAULT_NO_WINDOW lets gemma3's
 * window layers see every position (their rows kept in full, as a global
 * layer's; set before the model is loaded); KVT_LLAMA_FAULT_RING restores
 * a window ring with its oldest K value off by one; gemma4's:
 * KVT_LLAMA_FAULT_OWN_KV lets the shared layers compute and keep K and V
 * of their own, from the attn_k and attn_v a file may still hold for them
 * (set before loading); KVT_LLAMA_FAULT_NO_PLE leaves the per-layer
 * embeddings out; KVT_LLAMA_FAULT_V_NORM_WEIGHT norms V with attn_k_norm's
 * weight; KVT_LLAMA_FAULT_GDN_GROUPED pairs a DeltaNet layer's V head h
 * with K head h / (Hv / Hk), not h % Hk (the converter's tiled order);
 * KVT_LLAMA_FAULT_BATCH_POS turns the tokens of a batched pass of several
 * segments by their place in the pass, not their positions;
 * KVT_LLAMA_FAULT_WINDOW_CHUNK starts every token's window at the one of
 * its pass's first token (gemma3's window anchored to the chunk);
 * KVT_LLAMA_FAULT_SOURCE_RING_EARLY writes gemma4's shared layers' source
 * ring right after its own layer, before the shared layers read it. */
enum { KVT_LLAMA_FAULT_NONE, KVT_LLAMA_FAULT_ROPE_PAIRS, KVT_LLAMA_FAULT_MOE_WEIGHTS, KVT_LLAMA_FAULT_NO_WINDOW,
       KVT_LLAMA_FAULT_RING, KVT_LLAMA_FAULT_OWN_KV, KVT_LLAMA_FAULT_NO_PLE, KVT_LLAMA_FAULT_V_NORM_WEIGHT,
       KVT_LLAMA_FAULT_GDN_GROUPED, KVT_LLAMA_FAULT_BATCH_POS, KVT_LLAMA_FAULT_WINDOW_CHUNK,
       KVT_LLAMA_FAULT_SOURCE_RING_EARLY };
extern int kvt_llama_fault;
/* Test hook of session.c, to show a test catches such a bug:
 * KVT_SESSION_FAULT_STEP_MARK makes a batched step (kvt_session_step)
 * leave out the checkpoint at the mark, which a sync of the same tokens
 * keeps. */
enum { KVT_SESSION_FAULT_NONE, KVT_SESSION_FAULT_STEP_MARK };
extern int kvt_session_fault;
/* Tokens a ds4 snapshot of n tokens stored without its state replays on load. */
size_t kvt_ds4_replay_tokens(const kvt_model *m, size_t n);
/* ds4 plan for a preset name (m NULL) or a loaded ds4 model. */
int kvt_ds4_plan(const char *preset, const kvt_model *m, uint64_t ctx, kvt_plan *out);
/* Whether general.architecture is deepseek4. */
bool kvt_ds4_handles(const kvt_gguf *g);
/* The shape, details and plan of a deepseek4 GGUF from its header. */
int kvt_ds4_describe(const kvt_gguf *g, uint64_t ctx, kvt_model_info *info, char *detail, size_t dlen,
                     kvt_plan *plan);

/* Dequantise a named tensor of the expected shape into a new f32 array. */
int kvt_model_tensor_f32(const kvt_gguf *g, const char *name, uint64_t ne0, uint64_t ne1,
                         float **out);
/* A named matrix of the expected shape (ne0 elements per row, ne1 rows), in
 * place in the mapped file, in its own type. */
int kvt_model_tensor_mat(const kvt_gguf *g, const char *name, uint64_t ne0, uint64_t ne1, kvt_wmat *out);
/* Add a matrix's bytes as stored to a fingerprint: an f32 matrix hashes as
 * its values alone (as before weights stayed in place), any other type with
 * its type id first. st is an XXH3_state_t. */
struct XXH3_state_s;
void kvt_model_hash_mat(struct XXH3_state_s *st, const kvt_wmat *m);
/* The same for a 3-D tensor (ne0, ne1, ne2): ne1 * ne2 rows (a mixture's
 * experts, expert e's rows e * ne1 ..). */
int kvt_model_tensor_mat3(const kvt_gguf *g, const char *name, uint64_t ne0, uint64_t ne1, uint64_t ne2,
                          kvt_wmat *out);

#endif
