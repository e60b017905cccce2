/* Drafters for speculative decoding (draft.c): tokens that may follow a
 * reply, proposed cheaply, which the generation loop (generate.c) verifies
 * against the model in one pass and keeps only where plain decoding would
 * have sampled them, so a draft changes the speed of a reply, never its
 * tokens. */
#ifndef KVT_DRAFT_H
#define KVT_DRAFT_H

#include <stddef.h>
#include <stdint.h>

typedef enum kvt_draft_kind {
    KVT_DRAFT_NONE = 0,
    KVT_DRAFT_NGRAM,        /* prompt lookup: the session's own tokens */
    KVT_DRAFT_MODEL,        /* a draft model (not supported yet) */
    KVT_DRAFT_MTP,          /* the model's MTP layers (not supported yet) */
} kvt_draft_kind;

/* The drafter unless --draft says otherwise. */
#define KVT_DRAFT_DEFAULT KVT_DRAFT_NONE
/* Tokens drafted at most per pass unless --draft-max says otherwise. */
#define KVT_DRAFT_MAX_DEFAULT 8
/* The longest --draft-max (the verify pass's rows are held per reply). */
#define KVT_DRAFT_MAX_LIMIT 64

/* "ngram", "none", "model", "mtp" to a kind: KVT_OK, KVT_EUNSUPPORTED
 * for "model" and "mtp" (not supported yet), KVT_EINVAL naming the
 * accepted ones for anything else. */
int kvt_draft_parse(const char *name, kvt_draft_kind *out);
const char *kvt_draft_name(kvt_draft_kind k);

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
 * nothing, so text the drafts miss costs few wasted rows. */
typedef struct kvt_draft_tune {
    uint32_t len, max, skip, misses;
} kvt_draft_tune;
void kvt_draft_tune_init(kvt_draft_tune *t, uint32_t max);
/* Tokens to draft in the next pass (0: none this pass). */
size_t kvt_draft_tune_len(kvt_draft_tune *t);
/* A pass drafted `drafted` tokens and kept `kept` of them. */
void kvt_draft_tune_after(kvt_draft_tune *t, size_t drafted, size_t kept);

#endif
