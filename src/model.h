/* Internal definitions shared by the model loader, the architectures and the
 * session: the model object, the per-architecture operations and the session
 * object they operate on. Not part of the public API. */
#ifndef KVT_MODEL_H
#define KVT_MODEL_H

#include "kvtier.h"
#include "cache.h"
#include "gguf.h"
#include "threads.h"
#include "tokenizer.h"

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
    /* Append the canonical bytes of the state for tokens [0, n) to buf. */
    int (*cache_bytes)(const kvt_session *s, size_t n, uint8_t **buf, size_t *len);
    void (*weights_free)(void *w);
} kvt_arch;

struct kvt_model {
    kvt_model_info info;
    char *name;
    const kvt_arch *arch;
    void *weights;           /* architecture-specific */
    kvt_tokenizer *tok;
};

struct kvt_session {
    kvt_model *m;
    kvt_cache *cache;
    kvt_pool *pool;
    uint32_t n_threads;
    uint32_t n_ctx, chunk;
    bool rolling;
    kvt_progress_fn progress;
    void *progress_user;
    int32_t *tokens;         /* (n_ctx) exact ids held */
    size_t n;                /* tokens held */
    float *logits;           /* (n_vocab) after tokens[n-1] when n > 0 */
    uint64_t rebuilds;
};

/* Architectures. */
extern const kvt_arch kvt_arch_llama;
int kvt_llama_load(kvt_model *m, const kvt_gguf *g);

/* Dequantise a named tensor of the expected shape into a new f32 array. */
int kvt_model_tensor_f32(const kvt_gguf *g, const char *name, uint64_t ne0, uint64_t ne1,
                         float **out);

#endif
