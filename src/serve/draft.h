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
 * latest earlier occurrence of its last 3 tokens (else 2, else 1) and
 * propose the tokens that followed it there, up to max of them, into
 * out. Returns how many (0: no match). Linear in n. */
size_t kvt_draft_ngram(const int32_t *ctx, size_t n, int32_t last, size_t max, int32_t *out);

#endif
