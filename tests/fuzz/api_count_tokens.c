/* api_count_tokens: bodies of POST /v1/messages/count_tokens, handled as
 * the server handles them (src/app/server.c): a body without "max_tokens" gets
 * "max_tokens": 1 (count_tokens bodies carry none), then it is parsed as a
 * messages request and its prompt tokenized as for generation. What must
 * hold besides what fuzz_request checks: the token ids decode back to the
 * prompt, with ds4-tiny's byte tokenizer (deepseek template, special
 * tokens parsed) and with stories260K's SentencePiece one (plain template;
 * when ../shared has it, and for prompts without a literal U+2581, which
 * SentencePiece cannot tell from an escaped space). */
#include "fuzz.h"
#include "arch/model.h"
#include "text/tokenizer.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

/* src/app/server.c's add_max_tokens. */
static char *with_max_tokens(const uint8_t *data, size_t size, size_t *len)
{
    json_t *o = json_loadb((const char *)data, size, 0, NULL);
    char *t = NULL;
    if (json_is_object(o) && !json_object_get(o, "max_tokens")) {
        json_object_set_new(o, "max_tokens", json_integer(1));
        t = json_dumps(o, JSON_COMPACT);
    }
    json_decref(o);
    if (t) {
        *len = strlen(t);
        return t;
    }
    t = malloc(size ? size : 1);
    if (t) memcpy(t, data, size);
    *len = size;
    return t;
}

static void count(const kvt_model *m, const char *body, size_t len)
{
    kvt_request r;
    int st = 0;
    if (kvt_request_parse(&r, KVT_API_MESSAGES, body, len, m, &st) != KVT_OK) return;
    size_t n = 0, blen = 0;
    int32_t *ids = fuzz_prompt_tokens(m, &r, &n);
    char *back = NULL;
    bool spm = !strcmp(kvt_tokenizer_model(m->tok), "llama");
    bool ambiguous = spm && memmem(r.prompt, r.prompt_len, "\xe2\x96\x81", 3);
    FUZZ_CHECK(ids, "count_tokens: the prompt does not tokenize: %s", kvt_errmsg());
    if (ids && !ambiguous) {
        int rc = r.prompt_has_bos ? kvt_tokenizer_decode(m->tok, ids, n, &back, &blen)
                                  : kvt_detokenize(m, ids, n, &back, &blen);
        FUZZ_CHECK(rc == KVT_OK && blen == r.prompt_len &&
                       !memcmp(back, r.prompt, blen),
                   "count_tokens: %zu tokens of a %zu-byte prompt do not decode to it (%s)", n, r.prompt_len,
                   kvt_tokenizer_model(m->tok));
    }
    FUZZ_CHECK(!r.prompt_has_bos || n >= 1, "a deepseek prompt without tokens");
    free(back);
    free(ids);
    kvt_request_free(&r);
}

int fuzz_api_count_tokens(const uint8_t *data, size_t size)
{
    size_t len = 0;
    char *body = with_max_tokens(data, size, &len);
    if (!body) return 0;
    fuzz_request(KVT_API_MESSAGES, (const uint8_t *)body, len);
    count(fuzz_ds4(1), body, len);
    if (fuzz_stories()) count(fuzz_stories(), body, len);
    free(body);
    return 0;
}
