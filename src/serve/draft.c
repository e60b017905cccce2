/* Drafters for speculative decoding. Prompt lookup (n-gram) drafting:
 * replies that repeat what the conversation holds (a file read back with a
 * change, a diff, tool arguments, a story's names) continue as the same
 * tokens continued before, so the tokens after the latest earlier
 * occurrence of the context's last few tokens are a good guess, had with
 * no model at all. Where the continuation reaches the context's end (a
 * match p tokens back, p short), the draft goes on repeating it with
 * period p: a token said over and over, a line repeated. */
#include "serve/draft.h"
#include "base/util.h"

#include <string.h>

/* The suffix lengths matched, longest first. A single token's latest
 * occurrence drafts poorly: on stories260K's free text 1-gram matches
 * brought 131 drafts and 42 kept where 2..3 brought 114 and 54, and
 * fewer passes. */
#define NGRAM_MAX 3
#define NGRAM_MIN 2

int kvt_draft_parse(const char *name, kvt_draft_kind *out)
{
    if (!strcmp(name, "ngram")) *out = KVT_DRAFT_NGRAM;
    else if (!strcmp(name, "none")) *out = KVT_DRAFT_NONE;
    else if (!strcmp(name, "model")) *out = KVT_DRAFT_MODEL;
    else if (!strcmp(name, "mtp")) *out = KVT_DRAFT_MTP;
    else
        return kvt_fail(KVT_EINVAL, "--draft must be ngram, model, mtp or none, not '%s'", name);
    return KVT_OK;
}

const char *kvt_draft_name(kvt_draft_kind k)
{
    return k == KVT_DRAFT_NGRAM ? "ngram" : k == KVT_DRAFT_MODEL ? "model" : k == KVT_DRAFT_MTP ? "mtp" : "none";
}

/* Token i of the context ctx[0..n) + last. */
static inline int32_t at(const int32_t *ctx, size_t n, int32_t last, size_t i) { return i < n ? ctx[i] : last; }

size_t kvt_draft_ngram(const int32_t *ctx, size_t n, int32_t last, size_t max, int32_t *out)
{
    size_t N = n + 1;
    for (size_t len = NGRAM_MAX; len >= NGRAM_MIN; len--) {
        if (N < len + 1) continue;
        /* the match ends before the context's last token: it is followed by one at least */
        for (size_t j = N - len; j-- > 0;) {
            size_t k = 0;
            while (k < len && at(ctx, n, last, j + k) == at(ctx, n, last, N - len + k)) k++;
            if (k < len) continue;
            /* what followed, and past the context's end the same again:
             * the tokens repeat with the period p the match shows */
            size_t p = N - len - j, got = 0;
            for (; got < max; got++) out[got] = got < p ? at(ctx, n, last, N - p + got) : out[got - p];
            return got;
        }
    }
    return 0;
}

void kvt_draft_tune_init(kvt_draft_tune *t, uint32_t max) { *t = (kvt_draft_tune){max, max, 0, 0}; }

size_t kvt_draft_tune_len(kvt_draft_tune *t)
{
    if (t->skip) {
        t->skip--;
        return 0;
    }
    return t->len;
}

void kvt_draft_tune_after(kvt_draft_tune *t, size_t drafted, size_t kept)
{
    if (!drafted) return;
    if (kept == drafted) {
        t->len = 2 * t->len < t->max ? 2 * t->len : t->max;
        t->misses = 0;
        return;
    }
    t->len = kept + 1 < t->max ? (uint32_t)kept + 1 : t->max;
    if (kept) {
        t->misses = 0;
        return;
    }
    t->skip = 1u << (t->misses < 4 ? t->misses : 4);
    t->misses++;
}
