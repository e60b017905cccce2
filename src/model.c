/* Opening a model: read the GGUF header, pick the architecture from
 * general.architecture, let it load (and dequantise) its weights, and build
 * the tokenizer. The model keeps no reference to the file afterwards. */
#include "model.h"
#include "util.h"

#include <stdlib.h>
#include <string.h>

int kvt_model_tensor_f32(const kvt_gguf *g, const char *name, uint64_t ne0, uint64_t ne1, float **out)
{
    const kvt_gguf_tensor *t = kvt_gguf_find_tensor(g, name);
    if (!t) return kvt_fail(KVT_EFORMAT, "missing tensor %s", name);
    uint64_t a = t->ne[0], b = t->n_elem / (t->ne[0] ? t->ne[0] : 1);
    if (a != ne0 || b != ne1 || t->n_dims > 2)
        return kvt_fail(KVT_EFORMAT, "tensor %s has shape (%llu, %llu), expected (%llu, %llu)", name,
                        (unsigned long long)a, (unsigned long long)b, (unsigned long long)ne0,
                        (unsigned long long)ne1);
    size_t n;
    if (!kvt_mul_ok((size_t)ne0, (size_t)ne1, &n) || n > SIZE_MAX / sizeof(float))
        return kvt_fail(KVT_EFORMAT, "tensor %s too large", name);
    float *p = kvt_malloc(n * sizeof(float));
    if (!p) return KVT_ENOMEM;
    int rc = kvt_gguf_tensor_to_f32(t, p, n);
    if (rc) { free(p); return rc; }
    *out = p;
    return KVT_OK;
}

static void fill_tokenizer_info(kvt_model *m)
{
    m->info.bos = kvt_tokenizer_bos(m->tok);
    m->info.eos = kvt_tokenizer_eos(m->tok);
    m->info.add_bos = kvt_tokenizer_add_bos(m->tok);
    m->info.tokenizer = kvt_tokenizer_model(m->tok);
}

int kvt_model_open(kvt_model **out, const char *path)
{
    *out = NULL;
    kvt_gguf *g = NULL;
    int rc = kvt_gguf_open(&g, path);
    if (rc) return rc;
    kvt_model *m = kvt_calloc(1, sizeof *m);
    if (!m) { kvt_gguf_close(g); return KVT_ENOMEM; }
    const char *arch;
    size_t arch_len;
    rc = kvt_gguf_get_str(g, "general.architecture", &arch, &arch_len);
    if (rc == KVT_ENOENT) rc = kvt_fail(KVT_EFORMAT, "%s: no general.architecture", path);
    if (rc) goto fail;
    if (arch_len == 5 && !memcmp(arch, "llama", 5)) rc = kvt_llama_load(m, g);
    else rc = kvt_fail(KVT_EUNSUPPORTED, "%s: architecture '%.*s' is not supported", path,
                       (int)(arch_len > 64 ? 64 : arch_len), arch);
    if (rc) goto fail;
    const char *nm;
    size_t nl;
    if (kvt_gguf_get_str(g, "general.name", &nm, &nl) == KVT_OK) m->name = kvt_strndup(nm, nl);
    else m->name = kvt_strndup(path, strlen(path));
    if (!m->name) { rc = KVT_ENOMEM; goto fail; }
    m->info.name = m->name;
    if ((rc = kvt_tokenizer_from_gguf(&m->tok, g))) goto fail;
    if (kvt_tokenizer_n_vocab(m->tok) > m->info.n_vocab) {
        rc = kvt_fail(KVT_EFORMAT, "%s: tokenizer has %u tokens, the model only %u", path,
                      kvt_tokenizer_n_vocab(m->tok), m->info.n_vocab);
        goto fail;
    }
    fill_tokenizer_info(m);
    kvt_gguf_close(g);
    *out = m;
    return KVT_OK;
fail:
    kvt_gguf_close(g);
    kvt_model_close(m);
    return rc;
}

void kvt_model_close(kvt_model *m)
{
    if (!m) return;
    if (m->arch && m->arch->weights_free) m->arch->weights_free(m->weights);
    kvt_tokenizer_free(m->tok);
    free(m->name);
    free(m);
}

void kvt_model_info_get(const kvt_model *m, kvt_model_info *out) { *out = m->info; }

int kvt_tokenize(const kvt_model *m, const char *text, size_t len, int add_bos, int32_t **out, size_t *n_out)
{
    bool bos = add_bos < 0 ? m->info.add_bos : add_bos != 0;
    return kvt_tokenizer_encode(m->tok, text, len, bos, false, out, n_out);
}

int kvt_token_piece(const kvt_model *m, int32_t id, const char **bytes, size_t *len)
{
    return kvt_tokenizer_piece(m->tok, id, bytes, len);
}

int kvt_detokenize(const kvt_model *m, const int32_t *ids, size_t n, char **out, size_t *len)
{
    return kvt_tokenizer_decode(m->tok, ids, n, out, len);
}
