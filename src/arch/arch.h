/* The architecture table's row type and the objects an architecture works
 * on: the model, the session and its checkpoints. An architecture's files
 * (ds4.c; llama.c and llama_weights.c) include this and the tensor
 * fetchers (tensor.h), never model.h, so that the model layer, which reaches every architecture
 * through its row (arches.c), is not reached back. Not part of the public
 * API. */
#ifndef KVT_ARCH_H
#define KVT_ARCH_H

#include "kvtier.h"
#include "base/buf.h"
#include "cache/cache.h"
#include "format/gguf.h"
#include "kernels/kernels.h"
#include "base/threads.h"
#include "text/tokenizer.h"

#include <stdatomic.h>

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

/* An architecture's multi-token prediction layer (DeepSeek-V4's nextn and
 * Qwen 3.5's, as llama.cpp's MTP graphs run them), for the MTP drafter
 * (serve/draft_mtp.c).
 * layers: the model's count (0 or 1). A position's hidden state is
 * hidden_floats floats; the layer's window ring holds window rows,
 * position p at row p mod window, ring_bytes in all. hidden: the hidden
 * state of position pos from s's last forward pass, when that pass ran pos
 * with the tokens s holds (KVT_OK, else KVT_ENOENT, no message). step: the
 * layer for token tok at position pos and the hidden state hin of pos - 1
 * (the model's, or the previous step's hout); writes the layer's row of
 * pos into ring; row_only: nothing else; otherwise its output hidden state
 * into hout and the logits of the token at pos + 1 into logits. attach:
 * the layer from a separate file g into m, a model without one (on
 * success m owns g; on failure m is unchanged). write_file: m's layer as
 * that separate file, at path. file: the file attach gave m (borrowed: m
 * keeps it mapped until it is closed), NULL: none; its tensor data counts
 * in the model's memory as the model's file does (session/memory.c).
 * keep_rows: whether m's sessions keep the layer's rows of every position
 * they hold, written by their forward passes (set before the first
 * session: kvt_model_set_mtp_rows), and rows_kept reads it; then hidden
 * gives the state's h of the last position s holds alone, the ring holds
 * only a pass's chained guesses, and step reads the session's rows below
 * s->n and the ring from there (no window to rewrite: a rollback of the
 * session is one of the layer's rows). NULL: the drafter keeps the layer's
 * window itself (DeepSeek-V4). attach, write_file, file: NULL when the
 * architecture has no separate MTP file. */
typedef struct kvt_mtp_ops {
    uint32_t (*layers)(const kvt_model *m);
    size_t (*hidden_floats)(const kvt_model *m);
    size_t (*window)(const kvt_model *m);
    size_t (*ring_bytes)(const kvt_model *m);
    int (*hidden)(const kvt_session *s, size_t pos, float *out);
    int (*step)(kvt_session *s, uint16_t *ring, const float *hin, int32_t tok, size_t pos, bool row_only, float *hout,
                float *logits);
    int (*attach)(kvt_model *m, kvt_gguf *g);
    int (*write_file)(const kvt_model *m, const char *path);
    const kvt_gguf *(*file)(const kvt_model *m);
    int (*keep_rows)(kvt_model *m, bool on);
    bool (*rows_kept)(const kvt_model *m);
} kvt_mtp_ops;

/* What an architecture provides: one row per architecture file, all of
 * them in kvt_arches (arches.c). The model layer (model.c) reaches an
 * architecture only through its row. */
typedef struct kvt_arch {
    const char *name;
    /* ---- opening a model ---- */
    /* Whether this row runs a GGUF of this general.architecture. */
    bool (*handles)(const kvt_gguf *g);
    /* Load m's weights and info from g (m->arch is set to this row or a
     * variant of it with the same operations). */
    int (*load)(kvt_model *m, const kvt_gguf *g);
    /* The shape, details and plan of a GGUF from its header alone (no
     * tensor data): as kvt_model_describe. NULL: the row needs the
     * tensors for that. */
    int (*describe)(const kvt_gguf *g, uint64_t ctx, kvt_model_info *info, char *detail, size_t dlen,
                    kvt_plan *plan);
    /* The bytes of the scratch work_new makes for a session of ctx tokens
     * on parts threads (the default chunk), from the GGUF's header alone.
     * NULL: not known without the weights. */
    int (*work_estimate)(const kvt_gguf *g, uint64_t ctx, uint32_t parts, uint64_t *bytes);
    /* ---- built-in presets (synthetic weights); NULL: none ---- */
    /* Whether name is one of its presets (or a shape variant of one). */
    bool (*is_preset)(const char *name);
    /* The presets that have weights, for messages ("a, b"). */
    const char *presets;
    /* A preset's model with synthetic weights from seed and tok (taken over
     * by the model). KVT_ENOENT: no such preset with weights. */
    int (*preset)(kvt_model *m, const char *preset, uint64_t seed, kvt_tokenizer *tok);
    /* A preset's plan without building its weights (also presets without
     * weights). KVT_ENOENT: no such preset. */
    int (*plan_preset)(const char *preset, uint64_t ctx, kvt_plan *out);
    /* Write the model (config, weights, tokenizer) as GGUF that load reads
     * back bit-identically. NULL: the row cannot. */
    int (*write_gguf)(const kvt_model *m, const char *path);
    /* Write a preset with its synthetic weights straight to a GGUF file,
     * matrices stored as type (a ggml type id). NULL: the row cannot. */
    int (*write_preset)(const char *preset, uint64_t seed, const kvt_tokenizer *tok, uint32_t type,
                        const char *path);
    /* Tokens a snapshot of n tokens stored without its state replays when
     * it is loaded (state_rebuild). NULL: none. */
    size_t (*replay_tokens)(const kvt_model *m, size_t n);
    /* ---- running it ---- */
    /* Whether the model's K and V rows can be kept in these types (the
     * arguments resolved, never KVT_ROWS_DEFAULT): KVT_OK, or KVT_EINVAL
     * naming why not. NULL: the model's rows have a type of their own and
     * the cache types do not apply (kvt_model_set_cache_types accepts and
     * ignores them). */
    int (*cache_types)(const kvt_model *m, kvt_row_type type_k, kvt_row_type type_v);
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
    /* Whether m's tokens go through routed experts (a pass of several
     * tokens then reads several tokens' experts). NULL: never. */
    bool (*routed)(const kvt_model *m);
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
    /* Hash over the architecture config and every weight, of the model as
     * loaded (before an MTP layer is attached). Called on the first use of
     * the fingerprint (kvt_model_fingerprint), after weights_pack: it reads
     * the weights as the file stores them, never the packed copies. A
     * change to what it hashes bumps FP_DEFINITION (fpcache.c). */
    uint64_t (*fingerprint)(const void *w);
    /* Rearrange weights for the kernels (copies that replace the file's
     * pages, which kvt_gguf_release may drop: they stay readable, and the
     * fingerprint reads them back from the file; g is the file the weights
     * borrow from). NULL: nothing to do. */
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
    /* ---- drafting ---- */
    /* The MTP layer's operations; NULL: the architecture has none. */
    const kvt_mtp_ops *mtp;
} kvt_arch;

struct kvt_model {
    kvt_model_info info;
    /* The model's fingerprint (config + weights: kvt_arch.fingerprint), made
     * on first use, from the fingerprint cache (fpcache.h) or by hashing
     * every weight: read it with kvt_model_fingerprint (model.c), never here. */
    uint64_t fp_value;
    _Atomic int fp_state;      /* 0: not yet, 1: being made, 2: fp_value holds it */
    struct kvt_fp_id *fp_id;   /* the file's identity at open (fpcache.h); NULL: a preset, a buffer */
    char *fp_dir;              /* the fingerprint cache's directory; NULL: kvt_fpcache_default_dir */
    uint64_t tok_fingerprint;  /* tokenizer: vocabulary, scores, merges, specials */
    char *name;
    char *chat_template;     /* tokenizer.chat_template, NULL: none (info.chat_template) */
    const kvt_arch *arch;
    void *weights;           /* architecture-specific */
    kvt_gguf *file;          /* the mapped GGUF whose tensors the weights borrow; NULL: they own theirs */
    kvt_tokenizer *tok;
    /* The K and V rows' types (kvt_model_set_cache_types; resolved, never
     * KVT_ROWS_DEFAULT), for architectures with a cache_types row; both
     * KVT_ROWS_DEFAULT for the others (their rows are their own). */
    kvt_row_type type_k, type_v;
    _Atomic bool sessions_made; /* a session of it exists or existed: the types are fixed */
};

/* Whether m's rows are rounded to a cache type on writing (a type other
 * than f32 for K or V): the types are then part of its records' identity. */
static inline bool kvt_model_rows_rounded(const kvt_model *m)
{
    return m->type_k != KVT_ROWS_DEFAULT && (m->type_k != KVT_ROWS_F32 || m->type_v != KVT_ROWS_F32);
}

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
    float *logits;           /* (n_vocab) after tokens[n-1] when n > 0 and not logits_stale */
    bool logits_stale;       /* logits are not those after tokens[n-1] (a cut without a
                              * checkpoint there, kvt_session_trim): the next sync
                              * recomputes the last token, and nothing reads or saves them */
    uint64_t rebuilds;
    kvt_checkpoint *ckpt;      /* (n_ckpt) by increasing pos; architectures with state only */
    size_t n_ckpt, cap_ckpt;
    uint32_t ckpt_interval;    /* tokens between grid checkpoints */
    size_t mark;               /* also checkpoint here during prefill (0: none) */
    size_t save_mark;          /* and here: the save policy's cold point (0: none) */
    void *work;                /* the architecture's scratch (kvt_arch.work_new) */
};

/* The architectures, one row per file, ending with NULL (arches.c). */
extern const kvt_arch *const kvt_arches[];

#endif
