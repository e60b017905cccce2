/* The model layer's internal interface, for the layers above it (session,
 * snapshot, store, serve): the objects of arch.h and what model.c adds to
 * them. Not part of the public API. */
#ifndef KVT_MODEL_H
#define KVT_MODEL_H

#include "arch/arch.h"

/* Session checkpoints (session.c): remember the state at the current
 * position; forget all. */
void kvt_session_checkpoint(kvt_session *s);
void kvt_session_ckpt_clear(kvt_session *s);
/* Make dst an exact copy of src (same model; dst's context must hold it):
 * rows, state, tokens, logits and checkpoints. The rows are shared, not
 * copied: dst takes a reference to each of src's blocks, and whichever of
 * the two later writes into a block they share gets its own copy of that
 * block first (cache.h). src and dst may then be used and freed on
 * different threads. */
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
/* kvt_session_bytes by kind, summing to it: rows of whole blocks and of
 * pages (kvt_cache_bytes_parts: what counts in this session), its
 * checkpoints (logits and state), the rest (token and logit arrays, block
 * tables, the cache's state) and its scratch. */
typedef struct kvt_session_parts {
    size_t rows_whole, rows_pages, checkpoints, other, scratch;
} kvt_session_parts;
void kvt_session_bytes_parts(const kvt_session *s, kvt_session_parts *out);

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
/* The scratch a session of ctx tokens on parts threads would make, from a
 * GGUF's header alone (kvt_arch.work_estimate); KVT_ENOENT when its
 * architecture needs the weights for that. */
int kvt_model_scratch_estimate(const char *path, uint64_t ctx, uint32_t parts, uint64_t *bytes);

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
    /* A verify pass (speculative decoding), both NULL otherwise: rows
     * receives the logits of every token taken (done * n_vocab floats,
     * room for n), and save the fixed state before the step, for
     * kvt_session_keep to roll back to (architectures with state only). */
    float *rows;                 /* (n, n_vocab) */
    kvt_wbuf *save;
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
/* After a verify pass of `ran` tokens tok[0..ran) from pos0 (a step with
 * rows and save, or kvt_session_verify): keep the first `keep` of them
 * (1..ran) and roll the rest back exactly, so that the session holds what
 * decoding tok[0..keep) one at a time would have left: rows truncated,
 * logits those of row keep - 1, checkpoints past the end dropped; an
 * architecture with fixed state (window rings, ds4's frontiers, recurrent
 * state) goes back to the state saved before the pass and runs the kept
 * tokens again (chunking changes no bit). */
int kvt_session_keep(kvt_session *s, size_t pos0, const int32_t *tok, size_t ran, size_t keep, const float *rows,
                     const kvt_wbuf *save);
/* A verify pass of one session: kvt_session_step of tok[0..n) with rows
 * and save; *done the tokens taken. */
int kvt_session_verify(kvt_session *s, const int32_t *tok, size_t n, float *rows, kvt_wbuf *save, size_t *done);

/* The first part of kvt_session_sync: validate the prompt (*tokens, *n:
 * in rolling mode its last n_ctx tokens) and go back to the longest
 * restorable prefix of it; *reused is what s holds of it after. The rest,
 * (*tokens)[s->n .. *n), is the caller's to step (the last step with end). */
int kvt_session_sync_prepare(kvt_session *s, const int32_t **tokens, size_t *n, size_t *reused);

/* ---- the model layer (model.c) ---- */
/* A model from an open GGUF (path names it in messages): the architecture
 * general.architecture names, the tokenizer, the fingerprints, the packed
 * weights. The model does not own g, which must outlive it (its weights may
 * borrow g's tensors) unless given to it as m->file. */
int kvt_model_from_gguf(kvt_model **out, const kvt_gguf *g, const char *path);
/* Tokens a snapshot of n tokens stored without its state replays when it
 * is loaded (0: the architecture keeps no state to rebuild). */
size_t kvt_model_replay_tokens(const kvt_model *m, size_t n);
/* The directory of the fingerprint cache's entries for m (fpcache.h;
 * copied; NULL: kvt_fpcache_default_dir): the app gives the disk store's
 * DIR/fingerprints. Before the fingerprint's first use. */
int kvt_model_set_fingerprint_dir(kvt_model *m, const char *dir);
/* Whether m's sessions keep its MTP layer's rows of every position they
 * hold and the hidden state the next one reads (Qwen 3.5's layer, for
 * --draft mtp: kvt_mtp_ops.keep_rows), in their cache, snapshots and
 * records (whose keys then differ: kvt_snap_key0). Before m's first session
 * (KVT_EINVAL after); KVT_EUNSUPPORTED when m has no layer whose rows its
 * sessions can keep. Off by default: m's cache is then what it is without
 * the layer. */
int kvt_model_set_mtp_rows(kvt_model *m, bool on);
bool kvt_model_mtp_rows(const kvt_model *m);
/* Test hook: how many times a model's weights were hashed for its
 * fingerprint (kvt_model_fingerprint's misses of the cache). */
extern _Atomic uint64_t kvt_model_fingerprint_runs;

/* Trimming, for the eviction of blocks (tiers.c). kvt_session_resume_at:
 * the position at or before cut where s resumes exactly (cut itself for
 * rows per token, kvt_snap_rows_per_token; with a window or recurrent
 * state, the latest checkpoint at or before cut); s's length when cut is
 * not below it; 0: none. kvt_session_trim goes back there and lets go of
 * the blocks wholly past it, and returns the new length (0: none, s
 * unchanged; or its state could not be restored, s empty). Rows per
 * token cut where no checkpoint sits have no logits after their last
 * token: the session says so (logits_stale; kvt_session_logits NULL, no
 * save at its length), and a sync of a prompt that ends there computes
 * that token again. */
size_t kvt_session_resume_at(const kvt_session *s, size_t cut);
size_t kvt_session_trim(kvt_session *s, size_t cut);
/* Whether letting go of s's block b (every stream's) frees it: no session
 * of others[0..n) (s among them or not; NULL entries skipped) holds it nor
 * reads it as the base of a block it holds.
 * Holders outside that list (a save's copy in flight) do not count: the
 * block goes when they are done. */
bool kvt_session_block_private(const kvt_session *s, size_t b, const kvt_session *const *others, size_t n);

/* Test hook of session.c, to show a test catches such a bug:
 * KVT_SESSION_FAULT_STEP_MARK makes a batched step (kvt_session_step)
 * leave out the checkpoint at the mark, which a sync of the same tokens
 * keeps; KVT_SESSION_FAULT_STALE_LOGITS makes a session trimmed off its
 * checkpoints serve its stale logits (kvt_session_trim) as if they were
 * those after its last token; KVT_SESSION_FAULT_KEEP_ONE_MORE makes
 * kvt_session_keep keep one token more than asked when it rolls back (an
 * off-by-one rollback). */
enum { KVT_SESSION_FAULT_NONE, KVT_SESSION_FAULT_STEP_MARK, KVT_SESSION_FAULT_STALE_LOGITS,
       KVT_SESSION_FAULT_KEEP_ONE_MORE };
extern int kvt_session_fault;
#endif
