/* Drafters for speculative decoding. Prompt lookup (n-gram) drafting:
 * replies that repeat what the conversation holds (a file read back with a
 * change, a diff, tool arguments, a story's names) continue as the same
 * tokens continued before, so the tokens after the latest earlier
 * occurrence of the context's last few tokens are a good guess, had with
 * no model at all. Where the continuation reaches the context's end (a
 * match p tokens back, p short), the draft goes on repeating it with
 * period p: a token said over and over, a line repeated. */
#include "serve/draft.h"
#include "arch/arch.h"
#include "base/util.h"

#include <string.h>

int kvt_draft_fault; /* the drafters' test hooks (draft.h), here at the bottom of their files */

/* The suffix lengths matched, longest first. A single token's latest
 * occurrence drafts poorly: on stories260K's free text 1-gram matches
 * brought 131 drafts and 42 kept where 2..3 brought 114 and 54, and
 * fewer passes. */
#define NGRAM_MAX 3
#define NGRAM_MIN 2

/* Timed passes of each kind before the tuning compares them. */
#define TUNE_MIN 4
/* How much slower a token of passes with drafts must come than one of
 * passes without before the drafts count as losing: the means are of a
 * noisy clock, and a false loss stops drafts that pay for 4 to 128
 * passes. */
#define TUNE_MARGIN 1.2
/* A streak of this many losses: drafts have been off for 64 passes and
 * more, so what the draft mean says is old. The next pass with drafts (a
 * probe) is judged on its own time: the mean restarts from it, so a
 * conversation whose drafts begin to pay turns them on at the first
 * probe, not after the eighths of many. */
#define TUNE_STALE 5
/* What the probes of a long losing streak may cost: a probe's extra time
 * over the passes it replaces is at most this share of the passes
 * between probes (1%: the drafts' losses within the 3% of issue 46 with
 * room for the clock's noise), and probes come at most every TUNE_GAP_MAX
 * passes (so paying drafts are found again within that many). */
#define TUNE_PROBE_SHARE 0.01
#define TUNE_GAP_MAX 1024u

int kvt_draft_parse(const char *name, kvt_draft_kind *out)
{
    if (!strcmp(name, "ngram")) *out = KVT_DRAFT_NGRAM;
    else if (!strcmp(name, "none")) *out = KVT_DRAFT_NONE;
    else if (!strcmp(name, "model")) *out = KVT_DRAFT_MODEL;
    else if (!strcmp(name, "mtp")) *out = KVT_DRAFT_MTP;
    else if (!strcmp(name, "auto")) *out = KVT_DRAFT_AUTO;
    else
        return kvt_fail(KVT_EINVAL, "--draft must be ngram, model, mtp, auto or none, not '%s'", name);
    return KVT_OK;
}

const char *kvt_draft_name(kvt_draft_kind k)
{
    return k == KVT_DRAFT_NGRAM ? "ngram" : k == KVT_DRAFT_MODEL ? "model" : k == KVT_DRAFT_MTP ? "mtp"
           : k == KVT_DRAFT_AUTO ? "auto" : "none";
}

kvt_draft_kind kvt_draft_auto(const kvt_model *m, const char **why)
{
    const char *w = !m->arch ? "the model has a tokenizer only"
                    : m->arch->state_save ? "a rejected draft restores the model's fixed state and runs the kept "
                                            "tokens again"
                    : m->arch->routed && m->arch->routed(m) ? "a pass of several tokens reads several tokens' experts"
                                                            : NULL;
    if (kvt_draft_fault == KVT_DRAFT_FAULT_AUTO_NGRAM) w = NULL; /* tests */
    if (why) *why = w;
    return w ? KVT_DRAFT_NONE : KVT_DRAFT_NGRAM;
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

void kvt_draft_tune_init(kvt_draft_tune *t, uint32_t max) { *t = (kvt_draft_tune){.len = max, .max = max}; }

void kvt_draft_tune_resume(kvt_draft_tune *t, const kvt_draft_tune *rec, uint32_t max)
{
    if (!rec || !rec->max || kvt_draft_fault == KVT_DRAFT_FAULT_FRESH) { /* nothing learned yet (or tests) */
        kvt_draft_tune_init(t, max);
        return;
    }
    *t = *rec;
    t->max = max;
    if (t->len > max) t->len = max;
    if (!t->len) t->len = 1;
}

void kvt_draft_tune_keep(kvt_draft_tune *rec, const kvt_draft_tune *t)
{
    if (rec && t) *rec = *t;
}

size_t kvt_draft_tune_len(kvt_draft_tune *t)
{
    if (t->skip) {
        t->skip--;
        return 0;
    }
    /* drafts that keep only part need a measure of passes without them */
    if (t->partial && t->n_draft >= TUNE_MIN && t->n_plain < TUNE_MIN) return 0;
    return t->len;
}

/* A running mean: the first value, then each new one an eighth of it,
 * cut to twice the mean first: on a shared machine a pass the scheduler
 * preempted takes many times its cost, and one such pass would otherwise
 * decide for many. */
static void mean_add(double *m, uint32_t *n, double v)
{
    if (*n && v > 2 * *m) v = 2 * *m;
    *m = *n ? *m + (v - *m) / 8 : v;
    if (*n < UINT32_MAX) (*n)++;
}

/* The passes measured say a pass with drafts yields its tokens more
 * slowly than passes without (both means have TUNE_MIN passes behind
 * them). */
static bool drafts_lose(const kvt_draft_tune *t)
{
    if (kvt_draft_fault == KVT_DRAFT_FAULT_NO_COST) return false; /* tests */
    return t->n_plain >= TUNE_MIN && t->n_draft >= TUNE_MIN && t->draft_s > TUNE_MARGIN * t->plain_s;
}

void kvt_draft_tune_after(kvt_draft_tune *t, size_t drafted, size_t kept, double secs)
{
    if (!drafted) {
        if (secs >= 0) mean_add(&t->plain_s, &t->n_plain, secs);
        return;
    }
    if (secs >= 0 && t->losses >= TUNE_STALE && t->n_draft && kvt_draft_fault != KVT_DRAFT_FAULT_STALE_MEAN)
        t->draft_s = secs / (double)(kept + 1); /* a probe after a long pause: judged on its own */
    else if (secs >= 0)
        mean_add(&t->draft_s, &t->n_draft, secs / (double)(kept + 1));
    t->partial = kept < drafted;
    bool all = kept == drafted;
    t->len = all && 2 * t->len < t->max ? 2 * t->len : !all && kept + 1 < t->max ? (uint32_t)kept + 1 : t->max;
    /* drafts that do not pay for their passes (missed or kept): draft
     * again only rarely and few, which bounds what finding that out
     * again costs (a pass every 129 or fewer, once the losses run to 6
     * in a row) */
    /* in a losing streak a probe that kept nothing extends it: a pass
     * that yields one token cannot beat a plain pass, and within the
     * margin it is only the clock's noise */
    if (drafts_lose(t) || (t->losses && !kept)) {
        if (kept + 1 < t->len) t->len = (uint32_t)kept + 1;
        t->skip = 4u << (t->losses < TUNE_STALE ? t->losses : TUNE_STALE);
        /* a long streak: probes far enough apart that their extra time
         * (what a pass with drafts costs over the plain passes of its
         * tokens) stays within TUNE_PROBE_SHARE of the passes between */
        if (t->losses >= TUNE_STALE && t->plain_s > 0) {
            double extra = (t->draft_s - t->plain_s) * (double)(kept + 1) / t->plain_s / TUNE_PROBE_SHARE;
            uint32_t gap = extra >= TUNE_GAP_MAX ? TUNE_GAP_MAX : extra > t->skip ? (uint32_t)extra : t->skip;
            t->skip = gap;
        }
        if (t->losses < UINT32_MAX) t->losses++;
        return;
    }
    t->losses = 0;
    if (kept) {
        t->misses = 0;
        return;
    }
    t->skip = 1u << (t->misses < 4 ? t->misses : 4);
    t->misses++;
}
