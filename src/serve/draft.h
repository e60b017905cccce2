/* Drafters for speculative decoding (draft.c): tokens that may follow a
 * reply, proposed cheaply, which the generation loop (generate.c) verifies
 * against the model in one pass and keeps only where plain decoding would
 * have sampled them, so a draft changes the speed of a reply, never its
 * tokens. */
#ifndef KVT_DRAFT_H
#define KVT_DRAFT_H

#include <stddef.h>
#include <stdint.h>

#include "kvtier.h"
#include "base/threads.h"

typedef enum kvt_draft_kind {
    KVT_DRAFT_NONE = 0,
    KVT_DRAFT_NGRAM,        /* prompt lookup: the session's own tokens */
    KVT_DRAFT_MODEL,        /* a draft model sharing the tokenizer (--model-draft) */
    KVT_DRAFT_MTP,          /* the model's MTP (nextn) layer (DeepSeek-V4) */
    KVT_DRAFT_AUTO,         /* ngram where it pays, else none (kvt_draft_auto) */
} kvt_draft_kind;

/* The drafter unless --draft says otherwise: prompt lookup where it pays
 * (kvt_draft_auto). It never changes a reply. */
#define KVT_DRAFT_DEFAULT KVT_DRAFT_AUTO
/* Tokens drafted at most per pass unless --draft-max says otherwise. */
#define KVT_DRAFT_MAX_DEFAULT 8
/* The longest --draft-max (the verify pass's rows are held per reply). */
#define KVT_DRAFT_MAX_LIMIT 64

/* "ngram", "none", "model", "mtp", "auto" to a kind: KVT_OK, KVT_EINVAL
 * naming the accepted ones for anything else. */
int kvt_draft_parse(const char *name, kvt_draft_kind *out);
const char *kvt_draft_name(kvt_draft_kind k);

/* What --draft auto means for model m: KVT_DRAFT_NGRAM where a pass of
 * several tokens costs little more than a pass of one and a rejected draft
 * costs nothing to undo: a dense model (no routed experts: a pass of k
 * tokens reads up to k tokens' experts) whose cache is rows alone (a model
 * with fixed state, window rings, recurrent state or DeepSeek-V4's
 * frontiers, restores it and runs the kept tokens again after a rejected
 * draft). KVT_DRAFT_NONE elsewhere, with *why (may be NULL) saying why
 * (static text). On DeepSeek-V4's ds4-mini a copy-heavy reply of 37
 * tokens, 27% of its n-gram drafts kept, took 0.79x plain decoding's
 * speed: the tuning below needs more passes than that to learn what
 * drafts cost, which a server's later replies inherit (kvt_gen.learned)
 * but `run`'s single reply does not. */
kvt_draft_kind kvt_draft_auto(const struct kvt_model *m, const char **why);

/* Prompt lookup: the context is ctx[0..n) followed by last. Find the
 * latest earlier occurrence of its last 3 tokens (else 2), p
 * tokens before the context's end, and propose the tokens that followed
 * it there, up to max of them, into out; past the context's end they
 * repeat with period p (the tokens p back). Returns how many (0: no
 * match, else max). Linear in n. */
size_t kvt_draft_ngram(const int32_t *ctx, size_t n, int32_t last, size_t max, int32_t *out);

/* How much to draft, from how drafts fared: a pass whose drafts were all
 * kept doubles the next one's length (up to max); one that kept a of
 * them drafts a + 1 next; a pass that kept none also makes the next
 * 1, 2, 4 ... 16 passes (one more step each such pass in a row) draft
 * nothing, so text the drafts miss costs few wasted rows.
 *
 * And from what passes cost: kept drafts pay only where a pass of k
 * tokens costs much less than k passes of one, which holds for a model
 * whose weights stream from memory and not for one small enough to be
 * bound by arithmetic (stories260K: a pass of 8 tokens costs 6 of one),
 * nor for a draft model whose guesses cost their own passes. So the
 * caller gives each pass's wall time (the drafting, the pass, the
 * rollback) and the tuner keeps two running means (each new pass an
 * eighth of the mean, cut to twice the mean: a preempted pass counts
 * little): seconds per pass without drafts, and seconds per
 * token a pass with drafts yielded (its kept drafts and the sampled
 * token). Passes without drafts come from the back-off above and from
 * drafts that find nothing; when drafts keep only part of what they
 * propose and fewer than 4 such passes were timed, the next ones draft
 * nothing to time them (drafts that are all kept always pay, and ask for
 * none). Once each mean has 4 passes behind it, a pass with drafts
 * while the second mean is above the first by a fifth (the clock is
 * noisy, and a false loss stops drafts that pay) counts as a loss, whether it
 * kept some or none: the next 4, 8 ... 128 passes draft nothing (one
 * more step each loss in a row) and the next drafts are no longer than
 * the loss kept plus one; a pass with drafts that wins ends the streak
 * (and the back-off for misses above applies again). The
 * drafts never change a reply: only its passes depend on the clock.
 *
 * A reply is short next to what this learning takes (4 timed passes of
 * each kind, then losses 4, 8 ... passes apart), so a server keeps what
 * its replies learned: one record per drafter of the served model
 * (kvt_gen.learned), owned by the scheduler's thread. A reply's tuning
 * starts from it (kvt_draft_tune_resume: the means already timed, a
 * back-off or a losing streak carried on) and gives back what it learned
 * when it ends (kvt_draft_tune_keep); replies that overlap each keep
 * their own tuning meanwhile, and the last to end is what the next
 * starts from. One server's replies then tune as one long reply would.
 * Stale knowledge: once losses run to 5 in a row (drafts off for 64
 * passes and more), a pass with drafts (a probe) is judged on its own
 * time, the mean restarting from it, so drafts that begin to pay are
 * on again after one probe; and the probes come 128 passes apart or
 * further, as far as keeps a probe's extra time within 1% of the passes
 * between (at most 1024 passes apart: paying drafts are found again
 * within that many passes). `run` (one reply) starts from nothing. */
typedef struct kvt_draft_tune {
    uint32_t len, max, skip, misses, losses;
    uint32_t n_plain, n_draft; /* passes behind each mean */
    bool partial;              /* the last pass with drafts kept only part of them */
    double plain_s, draft_s;   /* s per pass without drafts; s per token yielded by a pass with drafts */
} kvt_draft_tune;
void kvt_draft_tune_init(kvt_draft_tune *t, uint32_t max);
/* t starts from what earlier replies learned: the record rec (NULL, or
 * zeroed: nothing learned yet; then as kvt_draft_tune_init), its length
 * cut to max. */
void kvt_draft_tune_resume(kvt_draft_tune *t, const kvt_draft_tune *rec, uint32_t max);
/* A reply's tuning t gives back what it learned: rec becomes t. */
void kvt_draft_tune_keep(kvt_draft_tune *rec, const kvt_draft_tune *t);
/* Tokens to draft in the next pass (0: none this pass). */
size_t kvt_draft_tune_len(kvt_draft_tune *t);
/* A pass drafted `drafted` tokens (0: a pass without drafts) and kept
 * `kept` of them, in secs seconds of wall time (negative: not timed; the
 * means are left alone). */
void kvt_draft_tune_after(kvt_draft_tune *t, size_t drafted, size_t kept, double secs);

/* ---- the draft model (draft_model.c) ----
 *
 * A smaller model with the same vocabulary proposes the next tokens
 * greedily from a session of its own, which follows the tokens the
 * model accepted: the pass that drafted them is rolled back to the ones
 * kept exactly as a verify pass is (kvt_session_keep, the state saved
 * before the pass), so the draft session always equals a session of the
 * draft model synced to the same tokens. */

/* KVT_OK when the two models' vocabularies are equal token by token (the
 * same count, every id the same bytes); else KVT_EMISMATCH naming the first
 * id that differs. */
int kvt_draft_vocab_check(const kvt_model *target, const kvt_model *draft);

typedef struct kvt_draft_model kvt_draft_model;
/* A drafter on model `draft` (borrowed, must outlive it) for replies of
 * `target`, its session of opts->n_ctx tokens on pool (borrowed; NULL: a
 * pool of its own of opts->n_threads). The caller has checked the
 * vocabularies once (kvt_draft_vocab_check: a server makes a drafter per
 * reply). Free with kvt_draft_model_free (accepts NULL). */
int kvt_draft_model_new(kvt_draft_model **out, const kvt_model *target, kvt_model *draft,
                        const kvt_session_opts *opts, kvt_pool *pool);
void kvt_draft_model_free(kvt_draft_model *d);
/* A drafter as kvt_draft_model_new's, on session s of model draft (taken:
 * the drafter frees it) holding whatever it holds: the first follow brings
 * it to the context as kvt_session_sync does (the longest common prefix
 * kept), so the contract below holds from any start. KVT_EINVAL: s is of
 * another model (s is still the caller's). */
int kvt_draft_model_adopt(kvt_draft_model **out, const kvt_model *target, kvt_model *draft, kvt_session *s);
/* The reply is over, the model's session holding ctx[0..n): the draft
 * session, rolled back to the tokens of its last pass that ctx kept, goes
 * to the caller (the drafter keeps the rest until freed). NULL: none to
 * give (the drafter failed, its session held, or the rollback failed). */
kvt_session *kvt_draft_model_release(kvt_draft_model *d, const int32_t *ctx, size_t n);
/* While on: no drafts, the session untouched (a restore into it runs on
 * another thread). */
void kvt_draft_model_hold(kvt_draft_model *d, bool on);
/* Tokens the draft session ran to follow the context (the prompt, the
 * tokens of a pass it lacked), drafts not counted. */
size_t kvt_draft_model_prefilled(const kvt_draft_model *d);
/* Same contract as kvt_draft_ngram: the context is ctx[0..n) followed by
 * last; propose up to max tokens, the draft model's greedy continuation.
 * The draft session first follows the context: the previous pass rolled
 * back to the drafts the context kept, then any tokens it lacks run (a
 * prompt the first time: more than a chunk of them run a chunk a call,
 * with no drafts until the last). Returns 0 when max is 0 or the drafter
 * failed (it is then off for good, with the reason on stderr). */
size_t kvt_draft_model_propose(kvt_draft_model *d, const int32_t *ctx, size_t n, int32_t last, size_t max,
                               int32_t *out);
/* Make the draft session hold exactly ctx[0..n) (as propose does first).
 * For tests: the session then equals a draft-model session synced to ctx. */
int kvt_draft_model_follow(kvt_draft_model *d, const int32_t *ctx, size_t n);
/* The draft session (borrowed), and whether the drafter is off after an error. */
kvt_session *kvt_draft_model_session(const kvt_draft_model *d);
bool kvt_draft_model_failed(const kvt_draft_model *d);
/* The RAM a drafter holds now: its session (rows, checkpoints, arrays,
 * scratch), its rows of logits and its saved state. */
size_t kvt_draft_model_bytes(const kvt_draft_model *d);
/* The RAM a drafter of model draft may come to hold over a reply that
 * ends at `tokens` tokens (prompt and reply) on sessions of n_ctx: the
 * cache's plan at that length, the session's arrays, draft_max rows of
 * logits and `scratch` (a draft session's scratch, measured once). What
 * the server reserves in the RAM budget when a reply starts. */
size_t kvt_draft_model_reserve(const kvt_model *draft, uint32_t n_ctx, size_t tokens, uint32_t draft_max,
                               size_t scratch);

/* ---- the MTP layer (draft_mtp.c) ----
 *
 * DeepSeek-V4's and Qwen 3.5's multi-token prediction layer, run on the
 * model's session: its guesses chain from the model's hidden state of the
 * last token. DeepSeek-V4's window of rows is rewritten from the model's
 * hidden states of the verified positions before each pass (the rollback
 * of its cache); Qwen 3.5's rows of the verified positions are the
 * session's own (kvt_draft_mtp_prepare). */

/* KVT_OK when m has an MTP layer; else KVT_EUNSUPPORTED saying that what
 * (the model's file or name) has none. */
int kvt_draft_mtp_check(const kvt_model *m, const char *what);
/* Before m's first session, for --draft mtp: KVT_OK when m has an MTP
 * layer (else as kvt_draft_mtp_check), its sessions then keeping the rows
 * the layer needs where its architecture keeps them in the session (Qwen
 * 3.5: kvt_model_set_mtp_rows). */
int kvt_draft_mtp_prepare(kvt_model *m);
/* The MTP layer from path, ds4.c's separate MTP file (mtp.0.* tensors,
 * given to ds4.c with --mtp), into m, a DeepSeek-V4 model without one:
 * --draft mtp --model-draft FILE. Before any session of m exists. Every
 * tensor is checked against m's shape; a file that does not fit is
 * refused naming the tensor, and m is left as it was. */
int kvt_draft_mtp_attach(kvt_model *m, const char *path);
/* m's MTP layer as that separate file, at path (`model new --mtp-out`). */
int kvt_draft_mtp_write(const kvt_model *m, const char *path);
typedef struct kvt_draft_mtp kvt_draft_mtp;
/* A drafter on the model's session s (borrowed: its scratch holds the
 * hidden states the layer reads, and runs the layer between passes). Free
 * with kvt_draft_mtp_free (accepts NULL). */
int kvt_draft_mtp_new(kvt_draft_mtp **out, kvt_session *s);
void kvt_draft_mtp_free(kvt_draft_mtp *d);
/* Same contract as kvt_draft_ngram, called every pass (max 0 too: the
 * drafter takes the hidden states of the model's last pass then, which
 * its window needs); the session holds ctx[0..n). Returns 0 when max is 0
 * or the drafter failed (it is then off for good, the reason on stderr). */
size_t kvt_draft_mtp_propose(kvt_draft_mtp *d, const int32_t *ctx, size_t n, int32_t last, size_t max,
                             int32_t *out);
/* Bring the layer's window to the rows of ctx[0..n) (the last token's
 * excepted: its next token is not known), as propose does first; and the
 * digest of those rows (with how each was made). For tests: a drafter
 * that followed a reply equals one made on a session synced to its tokens
 * in one pass. */
int kvt_draft_mtp_follow(kvt_draft_mtp *d, const int32_t *ctx, size_t n);
uint64_t kvt_draft_mtp_digest(const kvt_draft_mtp *d, size_t n);
bool kvt_draft_mtp_failed(const kvt_draft_mtp *d);
/* The RAM it holds (a window of rows and of hidden states). */
size_t kvt_draft_mtp_bytes(const kvt_draft_mtp *d);

/* Test hooks (defined in draft.c): KVT_DRAFT_FAULT_SAVE_LATE saves the draft
 * session's state one token late before a pass (an off-by-one rollback
 * of the draft session: its tokens right, its state not);
 * KVT_DRAFT_FAULT_ACCEPT_FIRST makes the generation loop (generate.c,
 * and run) accept a pass's first draft even when plain decoding samples
 * another token there; KVT_DRAFT_FAULT_MTP_KEEP keeps the row of a pass's
 * first chained MTP guess as if the model had verified it (an off-by-one
 * rollback of the MTP layer's window: one draft row too many survives);
 * KVT_DRAFT_FAULT_NO_COST makes the drafts' tuning (draft.c) ignore what
 * passes cost, as it did before it timed them; KVT_DRAFT_FAULT_AUTO_NGRAM
 * makes --draft auto choose ngram for every model;
 * KVT_DRAFT_FAULT_ADOPT_LONG leaves an adopted draft session that holds the
 * context and one token more as it is (not synced: one token too long);
 * KVT_DRAFT_FAULT_FRESH makes kvt_draft_tune_resume ignore the record
 * (each reply starts from nothing, as before replies shared it);
 * KVT_DRAFT_FAULT_STALE_MEAN makes a probe after a long losing streak
 * count an eighth of the old mean, as any pass does. */
enum {
    KVT_DRAFT_FAULT_NONE,
    KVT_DRAFT_FAULT_SAVE_LATE,
    KVT_DRAFT_FAULT_ACCEPT_FIRST,
    KVT_DRAFT_FAULT_MTP_KEEP,
    KVT_DRAFT_FAULT_NO_COST,
    KVT_DRAFT_FAULT_AUTO_NGRAM,
    KVT_DRAFT_FAULT_ADOPT_LONG,
    KVT_DRAFT_FAULT_FRESH,
    KVT_DRAFT_FAULT_STALE_MEAN,
};
extern int kvt_draft_fault;

#endif
