/* kvtier: a CPU inference engine whose KV cache is a first-class system.
 *
 * The boundary is two opaque objects:
 *
 *   kvt_model    immutable after open: architecture config, weights, tokenizer.
 *                Safe to share between sessions and threads; close it after
 *                every session over it is freed.
 *   kvt_session  one timeline over a model: the exact token ids it holds, the KV
 *                cache rows for them, and the next-token logits after the last
 *                one. Not thread-safe; one caller at a time (a session may
 *                move between threads between calls).
 *
 * A session is advanced only by kvt_session_sync (make the timeline equal to a
 * given prompt, reusing the longest common token prefix) and kvt_session_decode
 * (append one token). Whatever the chunk schedule or thread count, the logits
 * and cache bytes are bit-identical to one uninterrupted run: every kernel
 * reduces in a fixed order anchored to absolute positions.
 *
 * Errors: functions return KVT_OK (0) or a negative KVT_E* code. The message of
 * the last failure on the calling thread is kvt_errmsg(); it names what was
 * wrong (a key, an offset, a size) and stays valid until the next failure on
 * that thread.
 */
#ifndef KVTIER_H
#define KVTIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library's version (kvtier --version prints it). */
#define KVT_VERSION "0.1.0"

enum {
    KVT_OK = 0,
    KVT_EINVAL = -1,      /* bad argument or request */
    KVT_ENOMEM = -2,      /* allocation failed */
    KVT_EIO = -3,         /* read/write/open failed (errno in message) */
    KVT_EFORMAT = -4,     /* malformed file: bad magic, size, offset, type */
    KVT_ECORRUPT = -5,    /* checksum mismatch */
    KVT_EMISMATCH = -6,   /* well formed, but for another model/tokenizer/prefix */
    KVT_ECTX = -7,        /* the prompt does not fit the context */
    KVT_EUNSUPPORTED = -8,/* valid, but a feature this build does not handle */
    KVT_ENOENT = -9,      /* no such key, tensor, file or entry */
    KVT_ECANCELED = -10,  /* stopped by the caller's progress callback */
};

/* Static string for an error code. */
const char *kvt_strerror(int err);
/* Detail of the last failure on this thread (never NULL; thread-local,
 * overwritten by the thread's next failure). */
const char *kvt_errmsg(void);

/* ---- models ---------------------------------------------------------- */

typedef struct kvt_model kvt_model;

typedef struct kvt_model_info {
    const char *arch;        /* general.architecture: "deepseek4" (the ds4 presets too), or a
                              * llama-family name ("llama", "qwen2", "qwen3", "qwen3moe",
                              * "gemma3", "gemma4", "qwen35", "qwen35moe"); "none" for
                              * kvt_model_open_vocab */
    const char *name;        /* general.name or the preset name */
    uint32_t n_vocab, n_ctx_train, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff;
    uint64_t n_params;
    int32_t bos, eos;        /* -1 when the tokenizer has none */
    bool add_bos;
    const char *tokenizer;   /* "llama" (SentencePiece), "gpt2" (BPE), "gemma4" (gemma4's
                              * BPE) or "bytes" (the presets' byte tokenizer) */
    const char *chat_template; /* the GGUF's tokenizer.chat_template (what picks the chat
                              * template, src/chat/template.h); NULL when it has none */
} kvt_model_info;
/* kvt_model_info's strings belong to the model (or are static) and stay
 * valid until kvt_model_close. */

/* Open a model: a GGUF path, or a built-in preset name ("ds4-tiny",
 * "ds4-mini": synthetic weights from KVT_DEFAULT_SEED with the built-in byte
 * tokenizer), or NULL for the default model (ds4-mini). The model owns
 * everything it needs; the file may be replaced afterwards. Free with
 * kvt_model_close (accepts NULL). */
int kvt_model_open(kvt_model **out, const char *path);
#define KVT_DEFAULT_MODEL "ds4-mini"
#define KVT_DEFAULT_SEED 1

/* Only the tokenizer of a GGUF (a vocabulary file with no tensors is enough)
 * or of a preset, for kvt_tokenize / kvt_detokenize / kvt_token_piece; its
 * info.arch is "none" and kvt_session_new refuses it. Free with
 * kvt_model_close. */
int kvt_model_open_vocab(kvt_model **out, const char *path);
/* A preset with synthetic weights from seed, with the built-in byte tokenizer
 * (vocab_gguf NULL) or the tokenizer of a vocabulary GGUF. */
int kvt_model_preset(kvt_model **out, const char *preset, uint64_t seed, const char *vocab_gguf);
/* Write the model (config, weights as F32, tokenizer) as a GGUF file that
 * kvt_model_open loads back bit-identically. deepseek4 models only (the ds4
 * presets and deepseek4 GGUFs): KVT_EINVAL for a llama-family model. */
int kvt_model_save(const kvt_model *m, const char *path);
/* Write a preset's model with synthetic weights from seed (the same values
 * kvt_model_preset draws) straight to a GGUF file, tensor by tensor, with
 * the projection matrices stored as type ("f32", "f16" or "q8_0"): for
 * presets too large to build in memory (ds4-flash-bench). With "f32" the
 * file equals kvt_model_save's of the same preset. deepseek4 presets only. */
int kvt_model_write_preset(const char *preset, uint64_t seed, const char *vocab_gguf, const char *type,
                           const char *path);
/* Hashes identifying the weights (with config) and the tokenizer. */
uint64_t kvt_model_fingerprint(const kvt_model *m);
uint64_t kvt_model_tokenizer_fingerprint(const kvt_model *m);

/* How the cache stores K and V rows (llama.cpp's cache types): each row is
 * rounded once, when it is written (round-to-nearest-even to f16 or bf16;
 * ggml's reference q8_0 quantisation), and read back exactly, so the type
 * changes the bits a session computes but nothing else does. Window rings
 * follow it; recurrent state stays f32; DeepSeek-V4 keeps the f16 rows its
 * model defines whatever is asked. */
typedef enum kvt_row_type {
    KVT_ROWS_DEFAULT = 0, /* f16, as llama.cpp */
    KVT_ROWS_F32,
    KVT_ROWS_F16,
    KVT_ROWS_BF16,
    KVT_ROWS_Q8_0,
} kvt_row_type;

/* KV cache bytes for a context of ctx tokens, as the parts the
 * architecture's cache has: each a kind of entry, named, with its bytes.
 * The names kvtier's architectures use: "window" (sliding-window rings),
 * "compressed" (completed compressed rows), "indexer" (completed indexer
 * rows), "frontier" (pooling state of incomplete blocks), "full rows" (full
 * K and V rows), "recurrent" (recurrent layers' convolution and delta-rule
 * state). A new kind of entry is a new name, not a new field. */
#define KVT_PLAN_MAX_PARTS 8
typedef struct kvt_plan_part {
    const char *name;     /* static */
    uint64_t bytes;
    bool fixed;           /* the same at every context length */
} kvt_plan_part;
typedef struct kvt_plan {
    size_t n_parts;
    kvt_plan_part part[KVT_PLAN_MAX_PARTS]; /* in the architecture's order, each name once */
    uint64_t fixed, total;    /* the fixed parts' sum, every part's */
    uint64_t per_token_x1000; /* bytes per token x 1000 (may be fractional) */
    kvt_row_type type_k, type_v; /* the types the rows were counted in */
    bool rows_own;            /* the model defines its rows' type (DeepSeek-V4: f16), whatever was asked */
} kvt_plan;
/* The bytes of p's part of this name (0: p has none). */
uint64_t kvt_plan_bytes(const kvt_plan *p, const char *name);
/* Add bytes to p's part of this name (static; a new part at the end when
 * p has none yet), and to p->total and, for a fixed part, p->fixed.
 * KVT_EINVAL when p already has KVT_PLAN_MAX_PARTS others. */
int kvt_plan_add(kvt_plan *p, const char *name, uint64_t bytes, bool fixed);
int kvt_model_plan(const kvt_model *m, uint64_t ctx, kvt_plan *out);
/* The same for a preset shape, without building its weights ("ds4-tiny",
 * "ds4-mini", "ds4-flash"). */
int kvt_plan_preset(const char *preset, uint64_t ctx, kvt_plan *out);
/* A GGUF of an architecture kvtier can describe from its header alone
 * (deepseek4, the DeepSeek-V4 layout llama.cpp reads; kvt_model_open runs
 * it): the metadata and tensor records, no tensor data, so the file may end
 * after its header (the plan of a model too large to load).
 * Fills info (its strings are static), a line of details (NUL-terminated,
 * when detail is not NULL) and the cache plan at ctx tokens (when plan is
 * not NULL). KVT_ENOENT for a file of another architecture (open it with
 * kvt_model_open) or no file; KVT_EFORMAT for a header that is damaged or
 * describes an impossible shape. */
int kvt_model_describe(const char *path, uint64_t ctx, kvt_model_info *info, char *detail, size_t dlen,
                       kvt_plan *plan);
void kvt_model_close(kvt_model *m);

/* "f32", "f16", "bf16", "q8_0" (llama.cpp's names) to a row type;
 * KVT_EINVAL naming the accepted ones otherwise. */
int kvt_row_type_parse(const char *name, kvt_row_type *out);
/* The name of a row type (KVT_ROWS_DEFAULT: "f16"); "?" for no type. */
const char *kvt_row_type_name(kvt_row_type t);
/* The types of the K and V rows of m's sessions (its cache types, part of
 * the identity of every record its sessions save: a record of other types
 * is a miss). Set before the first session of m is made (KVT_EBUSY after);
 * KVT_EINVAL when the model's rows cannot take a type (q8_0 needs a head
 * length that is a multiple of 32). DeepSeek-V4 keeps its own f16 rows:
 * accepted and ignored (kvt_plan.rows_own says so). */
int kvt_model_set_cache_types(kvt_model *m, kvt_row_type type_k, kvt_row_type type_v);
void kvt_model_info_get(const kvt_model *m, kvt_model_info *out);

/* Tokenize text (len bytes, any bytes). add_bos follows the model when
 * add_bos < 0, else forces it on (1) or off (0). User-defined tokens are
 * always split out of the text; control tokens (BOS, chat markers) only with
 * parse_special, as in llama.cpp. *out is malloc'ed; the caller frees it. */
int kvt_tokenize(const kvt_model *m, const char *text, size_t len, int add_bos, bool parse_special,
                 int32_t **out, size_t *n_out);
/* Bytes of one token as it appears in decoded text (borrowed from the model).
 * The SentencePiece dummy-prefix space is not removed here. */
int kvt_token_piece(const kvt_model *m, int32_t id, const char **bytes, size_t *len);
/* Decode ids to text (malloc'ed, NUL-terminated, *len excludes the NUL).
 * decode(tokenize(text)) == text for any text. */
int kvt_detokenize(const kvt_model *m, const int32_t *ids, size_t n, char **out, size_t *len);

/* ---- sessions -------------------------------------------------------- */

typedef struct kvt_session kvt_session;

/* Progress callback for long prefills: done/total tokens of the current sync.
 * Return false to cancel (the tokens done so far stay in the session). */
typedef bool (*kvt_progress_fn)(void *user, size_t done, size_t total);


typedef struct kvt_session_opts {
    uint32_t n_ctx;        /* 0: the model's training context */
    uint32_t n_threads;    /* 0: all cores */
    uint32_t chunk;        /* prefill chunk in tokens; 0: 256 */
    bool rolling;          /* when full, re-prefill the last n_ctx tokens from position 0 */
    uint32_t checkpoint_interval; /* tokens between rollback/save points; 0: 2048 */
    kvt_progress_fn progress;
    void *progress_user;
} kvt_session_opts;

/* A new, empty session over m; m is borrowed and must outlive it. Free with
 * kvt_session_free (accepts NULL). */
int kvt_session_new(kvt_session **out, kvt_model *m, const kvt_session_opts *opts);
void kvt_session_free(kvt_session *s);

/* Make the session hold exactly tokens[0..n): keep the longest common prefix
 * with what it holds (rows are reused only where the token ids match), then
 * prefill the rest. *reused (may be NULL) receives the kept prefix length.
 * KVT_ECTX when n exceeds the context (unless rolling). */
int kvt_session_sync(kvt_session *s, const int32_t *tokens, size_t n, size_t *reused);
/* Append one token (and keep a checkpoint when the session reaches the
 * checkpoint grid, as a prefill does). */
int kvt_session_decode(kvt_session *s, int32_t token);

/* Next-token logits after the last held token (n_vocab floats, borrowed until
 * the session changes); NULL when the session is empty. */
const float *kvt_session_logits(const kvt_session *s);
size_t kvt_session_len(const kvt_session *s);
const int32_t *kvt_session_tokens(const kvt_session *s); /* borrowed until the session changes */
/* Times the context was rebuilt by rolling mode since the session began. */
uint64_t kvt_session_rebuilds(const kvt_session *s);
/* Set the thread count for later work (0: all cores). */
void kvt_session_set_threads(kvt_session *s, uint32_t n);

/* Sum of -log p(tokens[i+1] | tokens[..i]) over i in [0, n-1), computed by
 * syncing tokens[0..n-1); *n_scored receives n - 1. */
int kvt_session_nll(kvt_session *s, const int32_t *tokens, size_t n,
                    double *sum_nll, size_t *n_scored);

/* Bytes of the cache state for the held tokens, in a canonical layout (only
 * valid entries, window rows in logical order): equal bytes mean equal
 * state. Malloc'ed; caller frees. */
int kvt_session_cache_bytes(const kvt_session *s, uint8_t **out, size_t *len);

/* Serialise the session (tokens, logits, cache) into a self-contained,
 * checksummed byte string (docs/FORMAT.md); malloc'ed, caller frees. */
int kvt_session_snapshot(const kvt_session *s, uint8_t **out, size_t *len);
/* Replace the session's state with a snapshot. KVT_EMISMATCH for another
 * model or tokenizer, KVT_ECORRUPT for a checksum failure, KVT_EFORMAT for
 * anything malformed, KVT_ECTX when it exceeds the session's context. On
 * failure the session is left empty (never half-restored). */
int kvt_session_restore(kvt_session *s, const uint8_t *buf, size_t len);

/* ---- the disk tier --------------------------------------------------- *
 *
 * A durable, budgeted store of session snapshots in one directory (an SQLite
 * database in WAL mode; docs/STORE.md). Completed 128-token blocks are
 * stored once, keyed by a chained hash of their token ids, and shared by
 * every snapshot that covers them. Damaged, foreign or unreadable entries
 * are a miss: counted, logged once to stderr, removed (future format
 * versions are skipped, not removed). Several processes may share a
 * directory. */

typedef struct kvt_store kvt_store;
/* Threads: the calls that read or write a store (save, lookup, load, rm,
 * gc, verify, stats, list) take the store's lock, so threads may share it;
 * set its options (kvt_store_set_min_free) before sharing it and close it
 * after the last call. A session given to a store call follows the
 * session's rule (one caller at a time); the store keeps no reference to it. */

/* Open (creating) the store in dir with a byte budget (0: 4096 MiB). A
 * database SQLite reports damaged, now or later, is moved aside
 * (DIR/kvtier.db.damaged-<time>) and replaced by one holding the records
 * that still read and check out; the store goes on. */
int kvt_store_open(kvt_store **out, const char *dir, uint64_t budget_bytes);
/* Open an existing store to inspect it (kvtier cache verify): its
 * database is not written, rebuilt or moved aside. */
int kvt_store_open_inspect(kvt_store **out, const char *dir);
void kvt_store_close(kvt_store *st); /* accepts NULL */
/* Keep `bytes` free on the store's file system (--kv-disk-min-free-mb): a
 * save first evicts least recently used entries until the file system has
 * that much room besides what the save writes, and is skipped when it
 * cannot; a save that meets a full disk evicts and tries once more.
 * KVT_STORE_MIN_FREE_DEFAULT (the default): 5% of the file system's size,
 * at most 1 GiB. */
#define KVT_STORE_MIN_FREE_DEFAULT UINT64_MAX
void kvt_store_set_min_free(kvt_store *st, uint64_t bytes);
/* Report a failed save on stderr ("kvtier: cache: WHAT failed: message"),
 * at most once a minute per store: the lines between are counted and the
 * next line says how many there were. */
void kvt_store_report_save_failure(kvt_store *st, const char *what);

/* Save the session's state at n tokens (its length, or a checkpoint
 * position) with a reason ("cold", "continued", "evict", "shutdown",
 * "manual"). An identical entry is reused. Evicts least recently used
 * entries (never this one) to stay within the budget. *id may be NULL. */
int kvt_store_save(kvt_store *st, kvt_session *s, size_t n, const char *reason, int64_t *id);
/* Longest stored prefix of tokens[0..n) for the session's model: *match
 * tokens (0: none) in entry *id. Linear in n; no file access unless the
 * store changed since the last call. */
int kvt_store_lookup(kvt_store *st, const kvt_model *m, const int32_t *tokens, size_t n,
                     size_t *match, int64_t *id);
/* Replace the session's state with entry id. A damaged entry is removed and
 * reported as KVT_ECORRUPT / KVT_EFORMAT / KVT_EMISMATCH; the session is
 * then empty. */
int kvt_store_load(kvt_store *st, int64_t id, kvt_session *s);
/* Lookup + load + check that the restored ids equal tokens[0..match):
 * the session ends up holding the longest stored prefix, or nothing.
 * *reused receives its length. Errors other than KVT_ENOMEM are a miss. */
int kvt_store_restore_prefix(kvt_store *st, kvt_session *s, const int32_t *tokens, size_t n,
                             size_t *reused);
int kvt_store_rm(kvt_store *st, int64_t id);
/* Rebuild a database that fails SQLite's integrity check, remove records
 * that fail their checks, enforce the budget, drop unreferenced blocks,
 * checkpoint the WAL. */
int kvt_store_gc(kvt_store *st);
/* Check every record: its checksums, and that its row agrees with it.
 * *checked receives the records examined, *bad those damaged (failing a
 * check, unreadable, or a block missing under a snapshot); each is reported
 * on stderr unless quiet. A record of a newer format than this build reads
 * whose shared layout checks out (docs/FORMAT.md) counts as checked, not
 * bad: it is kept for the release that wrote it, and counted in *newer
 * (may be NULL). */
int kvt_store_verify(kvt_store *st, size_t *bad, size_t *checked, size_t *newer);
/* SQLite's integrity check of the database: *problems receives the number
 * of problems it lists (0: sound; a check that cannot run is one), *report
 * (may be NULL; malloc'ed) their text, one a line. */
int kvt_store_integrity(kvt_store *st, size_t *problems, char **report);

typedef struct kvt_store_stats {
    uint64_t snapshots, blocks, bytes, budget;
    uint64_t block_refs;          /* sum over snapshots of blocks referenced */
    uint64_t lookups, hits, misses, saves, evictions, damaged, save_errors;
} kvt_store_stats;
int kvt_store_stats_get(kvt_store *st, kvt_store_stats *out);

typedef struct kvt_store_entry {
    int64_t id;
    uint64_t model, bytes, hits;
    uint32_t n_tokens, n_blocks, shared_blocks;
    double created, used_at;      /* Unix time */
    char reason[16];
    char preview[64];             /* start of the text, printable ASCII */
    bool replay;                  /* stored without its fixed state: rebuilt by replay on load */
} kvt_store_entry;
/* All entries, most recently used first (malloc'ed array). */
int kvt_store_list(kvt_store *st, kvt_store_entry **out, size_t *n);
/* The rendered text of an entry (malloc'ed). */
int kvt_store_text(kvt_store *st, int64_t id, char **text, size_t *len);

/* ---- sampling -------------------------------------------------------- */

typedef struct kvt_sampler_opts {
    float temperature;     /* <= 0: greedy (argmax, lowest id on ties) */
    float top_p;           /* 1: off */
    uint32_t top_k;        /* 0: off */
    uint64_t seed;
} kvt_sampler_opts;

/* A sampler holds its own random state: one caller at a time; the same
 * seed and logits give the same ids on every machine. */
typedef struct kvt_sampler kvt_sampler;
int kvt_sampler_new(kvt_sampler **out, const kvt_sampler_opts *opts);
void kvt_sampler_free(kvt_sampler *s);
/* A token id from n_vocab logits (read, not kept) with the draw of
 * position pos (0: a reply's first token): the draw is output pos + 1 of
 * splitmix64 from the seed, a pure function of (seed, pos), so sampling a
 * position again, or the positions in another order, gives the same ids.
 * -1 when out of memory. */
int32_t kvt_sampler_sample_at(kvt_sampler *s, const float *logits, uint32_t n_vocab, uint64_t pos);
/* The same at the next position: 0 for the sampler's first call, then one
 * more each call. */
int32_t kvt_sampler_sample(kvt_sampler *s, const float *logits, uint32_t n_vocab);

#ifdef __cplusplus
}
#endif
#endif
