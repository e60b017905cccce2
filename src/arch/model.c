/* Opening a model: map the GGUF, pick the architecture from
 * general.architecture, let it load its weights, and build the tokenizer.
 * An architecture may use tensors in place (kvt_model_tensor_mat): the model
 * then keeps the mapping open (m->file) until it is closed.
 *
 * The model's fingerprint (every weight hashed) is made when first asked
 * for (kvt_model_fingerprint), not at open: only the cache's tiers key
 * entries by it, and hashing reads the whole file (seconds for 8 GB, minutes
 * for a file larger than the memory). A file's fingerprint is remembered
 * across starts (fpcache.c). */
#include "arch/model.h"
#include "arch/fpcache.h"
#include "cache/rows.h"
#include "base/util.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

_Atomic uint64_t kvt_model_fingerprint_runs;

/* The row that runs g (by its general.architecture), NULL: none. */
static const kvt_arch *arch_of(const kvt_gguf *g)
{
    for (const kvt_arch *const *a = kvt_arches; *a; a++)
        if ((*a)->handles(g)) return *a;
    return NULL;
}

/* The row with a preset of this name, NULL: none. */
static const kvt_arch *preset_arch(const char *name)
{
    for (const kvt_arch *const *a = kvt_arches; *a; a++)
        if ((*a)->is_preset && (*a)->is_preset(name)) return *a;
    return NULL;
}

/* The tokenizer's identity is the hash of its GGUF serialisation: every
 * token, score, type, merge and special id, in one canonical form. */
static int tokenizer_fingerprint(kvt_model *m)
{
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc = w ? kvt_tokenizer_to_gguf(m->tok, w) : KVT_ENOMEM;
    if (!rc) rc = kvt_gguf_writer_to_mem(w, &buf, &len);
    if (!rc) m->tok_fingerprint = XXH3_64bits(buf, len);
    free(buf);
    kvt_gguf_writer_free(w);
    return rc;
}

static void fill_tokenizer_info(kvt_model *m)
{
    m->info.bos = kvt_tokenizer_bos(m->tok);
    m->info.eos = kvt_tokenizer_eos(m->tok);
    m->info.add_bos = kvt_tokenizer_add_bos(m->tok);
    m->info.tokenizer = kvt_tokenizer_model(m->tok);
}

/* The GGUF's chat template, kept for kvt_template_for (a string key; a
 * missing or non-string one is none). */
static int keep_chat_template(kvt_model *m, const kvt_gguf *g)
{
    const char *s;
    size_t n;
    if (kvt_gguf_get_str(g, "tokenizer.chat_template", &s, &n) != KVT_OK) return KVT_OK;
    if (!(m->chat_template = kvt_strndup(s, n))) return KVT_ENOMEM;
    m->info.chat_template = m->chat_template;
    return KVT_OK;
}

/* Identity and derived facts, once the weights and tokenizer are in place. */
static int finish(kvt_model *m)
{
    fill_tokenizer_info(m);
    if (m->arch->cache_types) m->type_k = m->type_v = kvt_rows_resolve(KVT_ROWS_DEFAULT);
    return tokenizer_fingerprint(m); /* the model's own: kvt_model_fingerprint, when asked */
}

/* A preset's tokenizer: a vocabulary GGUF's, or the byte tokenizer. */
static int preset_tokenizer(const char *vocab_gguf, kvt_tokenizer **tok)
{
    if (!vocab_gguf) return kvt_tokenizer_new_bytes(tok);
    kvt_gguf *g = NULL;
    int rc = kvt_gguf_open(&g, vocab_gguf);
    if (rc) return rc;
    rc = kvt_tokenizer_from_gguf(tok, g);
    kvt_gguf_close(g);
    return rc;
}

int kvt_model_write_preset(const char *preset, uint64_t seed, const char *vocab_gguf, const char *type,
                           const char *path)
{
    const kvt_arch *arch = preset ? preset_arch(preset) : NULL;
    if (!arch || !arch->write_preset)
        return kvt_fail(KVT_ENOENT, "no preset '%s' that can be written tensor by tensor (the ds4 presets)",
                        preset ? preset : "");
    static const struct { const char *name; uint32_t id; } types[] = {
        {"f32", KVT_GGML_F32}, {"f16", KVT_GGML_F16}, {"q8_0", KVT_GGML_Q8_0}};
    uint32_t id = UINT32_MAX;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (type && !strcmp(type, types[i].name)) id = types[i].id;
    if (id == UINT32_MAX)
        return kvt_fail(KVT_EINVAL, "type '%s': synthetic weights are written as f32, f16 or q8_0", type ? type : "");
    kvt_tokenizer *tok = NULL;
    int rc = preset_tokenizer(vocab_gguf, &tok);
    if (rc) return rc;
    rc = arch->write_preset(preset, seed, tok, id, path);
    kvt_tokenizer_free(tok);
    return rc;
}

int kvt_model_preset(kvt_model **out, const char *preset, uint64_t seed, const char *vocab_gguf)
{
    *out = NULL;
    const kvt_arch *arch = preset ? preset_arch(preset) : NULL;
    if (!arch) {
        char names[256] = "";
        for (const kvt_arch *const *a = kvt_arches; *a; a++)
            if ((*a)->presets)
                snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", names[0] ? ", " : "",
                         (*a)->presets);
        return kvt_fail(KVT_ENOENT, "no preset '%s' (%s)", preset ? preset : "", names);
    }
    kvt_tokenizer *tok = NULL;
    int rc = preset_tokenizer(vocab_gguf, &tok);
    if (rc) return rc;
    kvt_model *m = kvt_calloc(1, sizeof *m);
    if (!m) { kvt_tokenizer_free(tok); return KVT_ENOMEM; }
    if ((rc = arch->preset(m, preset, seed, tok))) {
        kvt_tokenizer_free(tok);
        free(m);
        return rc;
    }
    m->name = kvt_strndup(preset, strlen(preset));
    m->info.name = m->name;
    if (!m->name) rc = KVT_ENOMEM;
    if (!rc) rc = finish(m);
    if (rc) { kvt_model_close(m); return rc; }
    *out = m;
    return KVT_OK;
}

int kvt_model_from_gguf(kvt_model **out, const kvt_gguf *g, const char *path)
{
    *out = NULL;
    kvt_model *m = kvt_calloc(1, sizeof *m);
    if (!m) return KVT_ENOMEM;
    const char *arch;
    size_t arch_len;
    int rc = kvt_gguf_get_str(g, "general.architecture", &arch, &arch_len);
    if (rc == KVT_ENOENT) rc = kvt_fail(KVT_EFORMAT, "%s: no general.architecture", path);
    if (rc) goto fail;
    const kvt_arch *row = arch_of(g);
    if (row) rc = row->load(m, g);
    else rc = kvt_fail(KVT_EUNSUPPORTED, "%s: architecture '%.*s' is not supported", path,
                       (int)(arch_len > 64 ? 64 : arch_len), arch);
    if (rc) goto fail;
    kvt_fp_id id;
    if (kvt_fpcache_id(g, &id)) { /* the file as it is now, for the fingerprint cache */
        if (!(m->fp_id = kvt_malloc(sizeof id))) { rc = KVT_ENOMEM; goto fail; }
        *m->fp_id = id;
    }
    const char *nm;
    size_t nl;
    if (kvt_gguf_get_str(g, "general.name", &nm, &nl) == KVT_OK) m->name = kvt_strndup(nm, nl);
    else m->name = kvt_strndup(path, strlen(path));
    if (!m->name) { rc = KVT_ENOMEM; goto fail; }
    m->info.name = m->name;
    if ((rc = kvt_tokenizer_from_gguf(&m->tok, g)) || (rc = keep_chat_template(m, g))) goto fail;
    if (kvt_tokenizer_n_vocab(m->tok) > m->info.n_vocab) {
        rc = kvt_fail(KVT_EFORMAT, "%s: tokenizer has %u tokens, the model only %u", path,
                      kvt_tokenizer_n_vocab(m->tok), m->info.n_vocab);
        goto fail;
    }
    if ((rc = finish(m))) goto fail;
    if (m->arch->weights_pack && (rc = m->arch->weights_pack(m->weights, g))) goto fail;
    *out = m;
    return KVT_OK;
fail:
    kvt_model_close(m);
    return rc;
}

int kvt_model_describe(const char *path, uint64_t ctx, kvt_model_info *info, char *detail, size_t dlen,
                       kvt_plan *plan)
{
    if (!path || !info) return kvt_fail(KVT_EINVAL, "describe: NULL argument");
    if (detail && dlen) detail[0] = 0;
    kvt_gguf *g = NULL;
    int rc = kvt_gguf_open_header(&g, path);
    if (rc) return rc;
    const kvt_arch *row = arch_of(g);
    if (!row || !row->describe) {
        kvt_gguf_close(g);
        return kvt_fail(KVT_ENOENT, "%s: not an architecture described from its header", path);
    }
    rc = row->describe(g, ctx, info, detail, dlen, plan);
    kvt_gguf_close(g);
    if (rc) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", kvt_errmsg());
        return kvt_fail(rc, "%s: %s", path, msg);
    }
    return KVT_OK;
}

int kvt_model_scratch_estimate(const char *path, uint64_t ctx, uint32_t parts, uint64_t *bytes)
{
    kvt_gguf *g = NULL;
    int rc = kvt_gguf_open_header(&g, path);
    if (rc) return rc;
    const kvt_arch *row = arch_of(g);
    rc = row && row->work_estimate ? row->work_estimate(g, ctx, parts, bytes)
                                   : kvt_fail(KVT_ENOENT, "%s: scratch not known from the header alone", path);
    kvt_gguf_close(g);
    return rc;
}

int kvt_model_open(kvt_model **out, const char *path)
{
    *out = NULL;
    if (!path) path = KVT_DEFAULT_MODEL;
    if (preset_arch(path)) return kvt_model_preset(out, path, KVT_DEFAULT_SEED, NULL);
    kvt_gguf *g = NULL;
    int rc = kvt_gguf_open(&g, path);
    if (rc) return rc;
    if ((rc = kvt_model_from_gguf(out, g, path))) {
        kvt_gguf_close(g); /* after the model: its weights may point into it */
        return rc;
    }
    (*out)->file = g; /* the weights may borrow its tensors */
    return KVT_OK;
}

/* A model with a tokenizer and no weights: what `tokenize` and `detokenize`
 * need, so a vocabulary GGUF (tokenizer.ggml.* keys only, as llama.cpp's
 * vocab files are) is enough, and a full model file is not read past its
 * metadata. Sessions refuse such a model. */
int kvt_model_open_vocab(kvt_model **out, const char *path)
{
    *out = NULL;
    if (!path) path = KVT_DEFAULT_MODEL;
    kvt_model *m = kvt_calloc(1, sizeof *m);
    if (!m) return KVT_ENOMEM;
    kvt_gguf *g = NULL;
    int rc;
    if (preset_arch(path)) rc = kvt_tokenizer_new_bytes(&m->tok);
    else if (!(rc = kvt_gguf_open(&g, path)) && !(rc = kvt_tokenizer_from_gguf(&m->tok, g)))
        rc = keep_chat_template(m, g);
    const char *s = NULL;
    size_t sl = 0;
    if (!rc && !(g && kvt_gguf_get_str(g, "general.name", &s, &sl) == KVT_OK)) s = path, sl = strlen(path);
    if (!rc && !(m->name = kvt_strndup(s, sl))) rc = KVT_ENOMEM;
    kvt_gguf_close(g);
    if (!rc) {
        m->info.name = m->name;
        m->info.arch = "none";
        m->info.n_vocab = kvt_tokenizer_n_vocab(m->tok);
        fill_tokenizer_info(m);
        rc = tokenizer_fingerprint(m);
    }
    if (rc) { kvt_model_close(m); return rc; }
    *out = m;
    return KVT_OK;
}

void kvt_model_close(kvt_model *m)
{
    if (!m) return;
    if (m->arch && m->arch->weights_free) m->arch->weights_free(m->weights);
    kvt_tokenizer_free(m->tok);
    kvt_gguf_close(m->file);
    free(m->fp_id);
    free(m->fp_dir);
    free(m->chat_template);
    free(m->name);
    free(m);
}

int kvt_model_save(const kvt_model *m, const char *path)
{
    if (!m->arch || !m->arch->write_gguf)
        return kvt_fail(KVT_EINVAL, "model '%s': its architecture (%s) has no GGUF writer", m->name,
                        m->arch ? m->arch->name : "none");
    return m->arch->write_gguf(m, path);
}

/* The fingerprint: the cache's entry for the file when it has a valid one,
 * else every weight hashed (and remembered for the next start). */
static uint64_t make_fingerprint(const kvt_model *m)
{
    if (!m->arch) return 0; /* a tokenizer only: no weights */
    char def[4096];
    const char *dir = m->fp_dir ? m->fp_dir : kvt_fpcache_default_dir(def, sizeof def) ? def : NULL;
    uint64_t fp;
    if (m->fp_id && kvt_fpcache_get(dir, m->fp_id, &fp)) return fp;
    atomic_fetch_add(&kvt_model_fingerprint_runs, 1);
    fp = m->arch->fingerprint(m->weights);
    if (m->fp_id && fp && dir) kvt_fpcache_put(dir, m->fp_id, fp); /* 0: the hash failed (memory) */
    return fp;
}

/* One thread makes it, the others that ask meanwhile wait for it (one
 * lock for every model: it is held only to change a model's state, never
 * while hashing, so models hash at the same time). */
static pthread_mutex_t fp_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fp_made = PTHREAD_COND_INITIALIZER;
enum { FP_NOT_YET, FP_MAKING, FP_KNOWN };

uint64_t kvt_model_fingerprint(const kvt_model *cm)
{
    kvt_model *m = (kvt_model *)cm; /* the value is made once, on first use */
    if (atomic_load_explicit(&m->fp_state, memory_order_acquire) == FP_KNOWN) return m->fp_value;
    pthread_mutex_lock(&fp_lock);
    while (atomic_load(&m->fp_state) == FP_MAKING) pthread_cond_wait(&fp_made, &fp_lock);
    if (atomic_load(&m->fp_state) == FP_NOT_YET) {
        atomic_store(&m->fp_state, FP_MAKING);
        pthread_mutex_unlock(&fp_lock);
        uint64_t fp = make_fingerprint(m);
        pthread_mutex_lock(&fp_lock);
        m->fp_value = fp;
        atomic_store_explicit(&m->fp_state, FP_KNOWN, memory_order_release);
        pthread_cond_broadcast(&fp_made);
    }
    pthread_mutex_unlock(&fp_lock);
    return m->fp_value;
}

int kvt_model_set_fingerprint_dir(kvt_model *m, const char *dir)
{
    char *d = dir ? kvt_strndup(dir, strlen(dir)) : NULL;
    if (dir && !d) return KVT_ENOMEM;
    free(m->fp_dir);
    m->fp_dir = d;
    return KVT_OK;
}

uint64_t kvt_model_tokenizer_fingerprint(const kvt_model *m) { return m->tok_fingerprint; }

int kvt_model_plan(const kvt_model *m, uint64_t ctx, kvt_plan *out)
{
    if (!m->arch) return kvt_fail(KVT_EINVAL, "model '%s' has a tokenizer only", m->name);
    return m->arch->plan(m, ctx, out);
}

int kvt_model_set_cache_types(kvt_model *m, kvt_row_type type_k, kvt_row_type type_v)
{
    if (!m->arch) return kvt_fail(KVT_EINVAL, "model '%s' has a tokenizer only", m->name);
    kvt_row_type k = kvt_rows_resolve(type_k), v = kvt_rows_resolve(type_v);
    if (!kvt_rows_fits(k, 0) || !kvt_rows_fits(v, 0))
        return kvt_fail(KVT_EINVAL, "cache types: %d, %d: not a row type", (int)type_k, (int)type_v);
    if (atomic_load(&m->sessions_made))
        return kvt_fail(KVT_EINVAL, "model '%s': cache types are set before its first session", m->name);
    if (!m->arch->cache_types) return KVT_OK; /* rows of its own */
    int rc = m->arch->cache_types(m, k, v);
    if (rc) return rc;
    m->type_k = k;
    m->type_v = v;
    return KVT_OK;
}

int kvt_model_set_mtp_rows(kvt_model *m, bool on)
{
    const kvt_mtp_ops *o = m->arch ? m->arch->mtp : NULL;
    if (!o || !o->keep_rows || !o->layers(m))
        return kvt_fail(KVT_EUNSUPPORTED, "model '%s' has no MTP layer whose rows its sessions keep", m->name);
    if (atomic_load(&m->sessions_made))
        return kvt_fail(KVT_EINVAL, "model '%s': the MTP rows are kept or not from before its first session", m->name);
    return o->keep_rows(m, on);
}

bool kvt_model_mtp_rows(const kvt_model *m)
{
    const kvt_mtp_ops *o = m->arch ? m->arch->mtp : NULL;
    return o && o->rows_kept && o->rows_kept(m);
}

int kvt_plan_preset(const char *preset, uint64_t ctx, kvt_plan *out)
{
    /* the first row that knows the name; else the last row's message */
    int rc = kvt_fail(KVT_ENOENT, "no preset '%s'", preset ? preset : "");
    for (const kvt_arch *const *a = kvt_arches; *a && rc == KVT_ENOENT; a++)
        if ((*a)->plan_preset) rc = (*a)->plan_preset(preset, ctx, out);
    return rc;
}

size_t kvt_model_replay_tokens(const kvt_model *m, size_t n)
{
    return m->arch && m->arch->replay_tokens ? m->arch->replay_tokens(m, n) : 0;
}

void kvt_model_info_get(const kvt_model *m, kvt_model_info *out) { *out = m->info; }

int kvt_tokenize(const kvt_model *m, const char *text, size_t len, int add_bos, bool parse_special,
                 int32_t **out, size_t *n_out)
{
    bool bos = add_bos < 0 ? m->info.add_bos : add_bos != 0;
    return kvt_tokenizer_encode(m->tok, text, len, bos, parse_special, out, n_out);
}

int kvt_token_piece(const kvt_model *m, int32_t id, const char **bytes, size_t *len)
{
    return kvt_tokenizer_piece(m->tok, id, bytes, len);
}

int kvt_detokenize(const kvt_model *m, const int32_t *ids, size_t n, char **out, size_t *len)
{
    /* a leading BOS is what tokenize added, not text */
    if (n && m->info.bos >= 0 && ids[0] == m->info.bos) { ids++; n--; }
    return kvt_tokenizer_decode(m->tok, ids, n, out, len);
}
