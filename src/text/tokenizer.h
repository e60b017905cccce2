/* Tokenizers: SentencePiece-style (GGUF tokenizer.ggml.model = "llama": piece
 * scores, byte fallback <0xXX>, dummy-prefix space, U+2581 for spaces) and
 * byte-level BPE ("gpt2": merges ranks, GPT-2 byte<->unicode map, the
 * pre-tokenizer regexes of tokenizer.ggml.pre via PCRE2: "default", "gpt-2",
 * "llama-bpe"/"llama3", "qwen2", "qwen35", "deepseek-llm", "deepseek-coder",
 * "deepseek-v3", "starcoder", "refact", "command-r", "mpt", "falcon" and the
 * aliases llama.cpp treats alike; the list is pre_defs in tokenizer.c), BPE on
 * UTF-8 with U+2581 spaces ("gemma4"), plus a built-in byte tokenizer
 * ("bytes": ids 0..255 are the bytes, then the specials a chat template needs).
 *
 * Decoding is exact: decode(encode(text)) == text for every byte string.
 */
#ifndef KVT_TOKENIZER_H
#define KVT_TOKENIZER_H

#include "format/gguf.h"

typedef struct kvt_tokenizer kvt_tokenizer;

/* From the tokenizer.ggml.* keys of a GGUF (the tokenizer copies what it
 * needs; g may be closed afterwards). KVT_EFORMAT on missing/inconsistent
 * keys, KVT_EUNSUPPORTED on an unknown model or pre-tokenizer. */
int kvt_tokenizer_from_gguf(kvt_tokenizer **out, const kvt_gguf *g);
/* The built-in byte-level tokenizer (documented in tokenizer.c). */
int kvt_tokenizer_new_bytes(kvt_tokenizer **out);
void kvt_tokenizer_free(kvt_tokenizer *t);

/* Copy the tokenizer into tokenizer.ggml.* keys of a GGUF being written. */
int kvt_tokenizer_to_gguf(const kvt_tokenizer *t, kvt_gguf_writer *w);

const char *kvt_tokenizer_model(const kvt_tokenizer *t); /* "llama", "gpt2", "gemma4", "bytes" */
uint32_t kvt_tokenizer_n_vocab(const kvt_tokenizer *t);
int32_t kvt_tokenizer_bos(const kvt_tokenizer *t);  /* -1 if none */
int32_t kvt_tokenizer_eos(const kvt_tokenizer *t);  /* -1 if none */
bool kvt_tokenizer_add_bos(const kvt_tokenizer *t);
/* Id of a token by its exact vocabulary text, or -1. */
int32_t kvt_tokenizer_find(const kvt_tokenizer *t, const char *text, size_t len);

/* Encode len bytes of text. Text spans equal to a user-defined token's text
 * always become that token, and with parse_special so do spans equal to a
 * control or unknown token's text (llama.cpp's partition, id for id). add_bos
 * prepends BOS. *out is malloc'ed (caller frees). */
int kvt_tokenizer_encode(const kvt_tokenizer *t, const char *text, size_t len,
                         bool add_bos, bool parse_special, int32_t **out, size_t *n);
/* The bytes a token stands for in text: U+2581 -> ' ', <0xXX> -> the byte,
 * byte-level BPE unicode -> raw bytes; control tokens give their text.
 * Borrowed from the tokenizer. */
int kvt_tokenizer_piece(const kvt_tokenizer *t, int32_t id, const char **bytes, size_t *len);
/* Concatenate pieces; for SentencePiece with a dummy prefix, the one leading
 * space the encoder added is removed. Malloc'ed, NUL-terminated. */
int kvt_tokenizer_decode(const kvt_tokenizer *t, const int32_t *ids, size_t n,
                         char **out, size_t *len);

#endif
