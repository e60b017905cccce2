/* Tokenizers: text <-> token ids, matching llama.cpp's SPM and byte-level BPE
 * tokenizers id for id (checked against llama.cpp's own vocab test data), plus
 * a built-in byte tokenizer.
 *
 * Shape. A tokenizer is one flat, immutable vocabulary: all token texts back to
 * back in one buffer, the decoded piece of every token precomputed the same
 * way, and open-addressing hash tables for text -> id and (left id, right id)
 * -> merge rank. Nothing on the encode path scans the vocabulary, and both
 * merge loops use a binary heap of candidate pairs (as llama.cpp does), so a
 * 100k-token prompt encodes in O(n log n). Encoding keeps all its state on the
 * stack/heap of the call, so one tokenizer may be shared by many threads.
 *
 * Encoding, as in llama.cpp:
 *  1. Spans of text equal to a user-defined token's text become that token,
 *     and with parse_special so do spans equal to a control or unknown
 *     token's text; longest texts first (llama.cpp's tokenizer_st_partition,
 *     which splits user-defined tokens out whatever parse_special says); a
 *     trie scan first picks which special texts occur at all.
 *  2. "llama" (SentencePiece): each text span gets a dummy-prefix space when it
 *     starts the text or follows a special token (tokenizer.ggml.
 *     add_space_prefix, default true), spaces become U+2581, the span is split
 *     into UTF-8 characters (a byte that starts no well-formed character is a
 *     symbol of its own; llama.cpp trusts lead bytes, which only differs on
 *     invalid UTF-8 and there breaks the round trip) and the adjacent pair
 *     whose concatenation is a vocabulary token with the highest score is
 *     merged (ties: leftmost) until none is left; a symbol that is no token is
 *     emitted as <0xXX> byte tokens.
 *  3. "gpt2" (byte-level BPE): the pre-tokenizer regexes of tokenizer.ggml.pre
 *     (pre_defs below: default/absent, gpt-2, llama-bpe, qwen2, qwen35,
 *     deepseek-llm, deepseek-coder, deepseek-v3, starcoder, refact,
 *     command-r, mpt, falcon and aliases; any other is KVT_EUNSUPPORTED,
 *     naming it) split the span, each regex splitting the pieces of
 *     the previous one and keeping matched and unmatched parts (PCRE2, UTF
 *     mode; whitespace is Unicode White_Space as in llama.cpp, and the literal
 *     classes of deepseek-llm exclude non-ASCII whitespace because llama.cpp
 *     maps it to \v before matching). Each piece is one symbol per byte
 *     (GPT-2 bytes_to_unicode) merged by lowest merge rank, leftmost first;
 *     with llama.cpp's ignore_merges (llama3) a piece that is a token's text
 *     is that token.
 *     "gemma4" is BPE without the byte map (llama.cpp's byte_encode = false):
 *     spaces become U+2581, the text splits into runs of line feeds and of
 *     other text, a run of line feeds that is a token is that token, and
 *     other runs start as one symbol per UTF-8 character (its token, if any)
 *     and end as byte tokens <0xXX> where no token matches.
 *     Unicode categories are PCRE2's tables, llama.cpp's are its own
 *     (Unicode 15.1): with a PCRE2 on an older Unicode (10.42: 14.0) the
 *     about 5100 code points assigned since (CJK extensions H and I, Kawi,
 *     ...) are unassigned here, and their text may split differently.
 *     Invalid UTF-8 differs on purpose: llama.cpp turns it into
 *     U+FFFD, we match around it (PCRE2_MATCH_INVALID_UTF) and keep the raw
 *     bytes, so decode(encode(x)) == x for every byte string.
 *  4. "bytes": ids 0..255 are the bytes themselves; then the specials a
 *     DeepSeek-V4 chat template needs, in this order (｜ is U+FF5C,
 *     ▁ is U+2581):
 *       256 <｜begin▁of▁sentence｜>  (BOS; add_bos is true)
 *       257 <｜end▁of▁sentence｜>    (EOS)
 *       258 <｜User｜>               259 <｜Assistant｜>
 *       260 <think>                  261 </think>
 *       262 ｜DSML｜ (the tool-call markup's prefix: <｜DSML｜invoke ...>)
 *       263 <tool_result>            264 </tool_result>
 *       265..270 <｜place▁holder▁no▁0｜> .. <｜place▁holder▁no▁5｜> (reserved)
 *     n_vocab is 271. In a GGUF it is tokenizer.ggml.model = "bytes" with the
 *     byte tokens stored as "<0xXX>" (type 6) and the specials as control
 *     tokens (type 3).
 *
 * Token types: llama.cpp overrides some by their text before partitioning
 * (override_types: its end-of-generation and fill-in-the-middle texts become
 * control tokens, a few others user-defined or normal), and for Phi-3 (by
 * general.name) special tokens drop the whitespace after them; kvtier does
 * the same when it reads a GGUF.
 *
 * Pieces (decoding): control, unknown and user-defined tokens give their text;
 * byte tokens <0xXX> give the byte; other SPM and gemma4 tokens give their text with
 * U+2581 -> ' '; other BPE tokens map each character back through
 * bytes_to_unicode (a character outside that map stays as its UTF-8). Unused
 * tokens decode like normal ones (llama.cpp decodes them to nothing) so that
 * decode(encode(x)) == x holds whatever the encoder picked. Two limits remain,
 * both properties of the vocabularies: SPM cannot tell a literal U+2581 in the
 * text from an escaped space, and where a BPE vocabulary's token for a byte is
 * a user-defined token (deepseek-llm: bytes C0, C1, F5..FF, which never occur
 * in valid UTF-8) that byte decodes as the token's text.
 *
 * Every size read from the GGUF is checked before use: array types and
 * lengths agree with the token count, ids are in range, merges name existing
 * tokens, byte tokens are spelled <0xXX>; anything else is KVT_EFORMAT.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memmem */
#endif
#define PCRE2_CODE_UNIT_WIDTH 8

#include "text/tokenizer.h"
#include "base/util.h"

#include <math.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MODEL_SPM, MODEL_BPE, MODEL_BYTES };

/* tokenizer.ggml.token_type values (llama.cpp's llama_token_type). */
enum { TT_UNDEFINED = 0, TT_NORMAL = 1, TT_UNKNOWN = 2, TT_CONTROL = 3,
       TT_USER = 4, TT_UNUSED = 5, TT_BYTE = 6 };

/* Longest text we encode: SPM's escaped text (3 bytes per space) and all
 * symbol indices must fit in int32. */
#define MAX_TEXT ((size_t)(INT32_MAX / 4))
#define MAX_REGEX 6

typedef struct merge { int32_t left, right, result; } merge; /* result -1: no such token */

/* Trie over the special token texts; root children are direct-indexed. */
typedef struct tnode { int32_t child, sibling, special; uint8_t c; } tnode;

struct kvt_tokenizer {
    int model;
    bool gemma4;                /* tokenizer.ggml.model was "gemma4" (BPE) */
    bool raw;                   /* BPE on UTF-8 text, spaces as U+2581 (pre "gemma4") */
    bool ignore_merges;         /* a piece that is a token is that token */
    char *pre;                  /* tokenizer.ggml.pre as read (BPE), or NULL */
    uint32_t n_vocab;
    char *text;                 /* token i: text[text_off[i] .. text_off[i+1]) */
    size_t *text_off;           /* (n_vocab + 1) */
    char *piece;                /* decoded bytes, laid out like text */
    size_t *piece_off;          /* (n_vocab + 1) */
    float *score;               /* (n_vocab), NULL when the GGUF had none */
    int32_t *type;              /* (n_vocab) token types */
    uint32_t *tok_slot;         /* text hash: id + 1, 0 = empty */
    size_t tok_mask;
    merge *merges;              /* (n_merges) in rank order */
    uint32_t n_merges;
    uint32_t *merge_slot;       /* (left, right) hash: rank + 1, 0 = empty */
    size_t merge_mask;
    int32_t byte_tok[256];      /* token for a lone byte (SPM fallback, BPE start) */
    int32_t bos, eos, unk;
    bool add_bos, add_eos, add_space_prefix;
    int32_t *special;           /* (n_special) ids, longest text first */
    uint8_t *special_rstrip;    /* (n_special) 1: whitespace after it is dropped */
    uint8_t fim_keyed;          /* bit g: tokenizer.ggml.fim_*_token_id of fim_texts[g] is set */
    bool phi3;                  /* general.name names Phi-3: specials strip whitespace after them */
    uint32_t n_special;
    tnode *trie;                /* (n_trie) */
    uint32_t n_trie;
    int32_t trie_root[256];
    pcre2_code *re[MAX_REGEX];
    int n_re;
};

/* ---- small helpers ------------------------------------------------------ */

#define FW_BAR "\xef\xbd\x9c"  /* U+FF5C FULLWIDTH VERTICAL LINE */
#define SP_MARK "\xe2\x96\x81" /* U+2581 LOWER ONE EIGHTH BLOCK */

static const char *model_name(const kvt_tokenizer *t)
{
    return t->model == MODEL_SPM ? "llama" : t->model == MODEL_BPE ? (t->gemma4 ? "gemma4" : "gpt2") : "bytes";
}


typedef struct ivec { int32_t *v; size_t n, cap; } ivec;

static int ivec_push(ivec *a, int32_t x)
{
    if (a->n == a->cap) {
        int rc;
        KVT_GROW(a->v, &a->cap, a->n + 1, rc);
        if (rc) return rc;
    }
    a->v[a->n++] = x;
    return KVT_OK;
}

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static uint64_t hash_pair(int32_t a, int32_t b)
{
    uint64_t z = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Power-of-two table size with load factor <= 1/2. */
static size_t table_size(size_t n)
{
    size_t s = 16;
    while (s < 2 * n) s *= 2;
    return s;
}

static inline const char *tok_text(const kvt_tokenizer *t, int32_t id, size_t *len)
{
    *len = t->text_off[id + 1] - t->text_off[id];
    return t->text + t->text_off[id];
}

static int32_t lookup(const kvt_tokenizer *t, const char *s, size_t n)
{
    for (size_t i = hash_bytes(s, n) & t->tok_mask;; i = (i + 1) & t->tok_mask) {
        uint32_t e = t->tok_slot[i];
        if (!e) return -1;
        size_t len;
        const char *x = tok_text(t, (int32_t)(e - 1), &len);
        if (len == n && !memcmp(x, s, n)) return (int32_t)(e - 1);
    }
}

static int32_t merge_rank(const kvt_tokenizer *t, int32_t a, int32_t b)
{
    for (size_t i = hash_pair(a, b) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        uint32_t e = t->merge_slot[i];
        if (!e) return -1;
        const merge *m = &t->merges[e - 1];
        if (m->left == a && m->right == b) return (int32_t)(e - 1);
    }
}

static size_t put_utf8(char *o, uint32_t cp)
{
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xc0 | cp >> 6); o[1] = (char)(0x80 | (cp & 0x3f)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xe0 | cp >> 12); o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f)); return 3;
    }
    o[0] = (char)(0xf0 | cp >> 18); o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3f)); o[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Decode one well-formed UTF-8 character; 0 when s does not start with one. */
static size_t get_utf8(const uint8_t *s, size_t n, uint32_t *cp)
{
    if (!n) return 0;
    if (s[0] < 0x80) { *cp = s[0]; return 1; }
    size_t len = s[0] >= 0xf0 ? 4 : s[0] >= 0xe0 ? 3 : s[0] >= 0xc0 ? 2 : 0;
    if (!len || len > n) return 0;
    uint32_t c = s[0] & (0x7f >> len);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        c = c << 6 | (s[i] & 0x3f);
    }
    static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (c < min[len] || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) return 0;
    *cp = c;
    return len;
}

/* Bytes of the character at s: a well-formed UTF-8 sequence, else 1. */
static size_t char_len(const char *s, size_t n)
{
    uint32_t cp;
    size_t k = get_utf8((const uint8_t *)s, n, &cp);
    return k ? k : 1;
}

/* GPT-2's bytes_to_unicode: printable bytes map to themselves, the other 68
 * to U+0100.. in byte order. */
static uint32_t byte_to_cp(uint8_t b)
{
    if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae) return b;
    uint32_t n = 0;
    for (uint32_t c = 0; c < b; c++)
        if (!((c >= 0x21 && c <= 0x7e) || (c >= 0xa1 && c <= 0xac) || c >= 0xae)) n++;
    return 256 + n;
}

/* "<0xXX>" -> the byte; -1 when text is not spelled so. */
static int parse_byte_token(const char *s, size_t n)
{
    if (n != 6 || memcmp(s, "<0x", 3) || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10
              : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

static bool is_special_type(int32_t type)
{
    return type == TT_CONTROL || type == TT_USER || type == TT_UNKNOWN;
}

/* ---- pre-tokenizer regexes ---------------------------------------------- */

/* Unicode White_Space, llama.cpp's definition of \s. */
#define WS "\\x{9}-\\x{D} \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"

/* llama.cpp's GPT-2 regex as its hand-written matcher runs it (the regex
 * itself has no trailing \s+, the matcher does). */
#define GPT2_RE "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" WS "\\p{L}\\p{N}]+|[" WS "]+(?![^" WS "])|[" WS "]+"

/* The contractions of llama3/qwen2/qwen35, case-insensitive (llama.cpp's
 * matchers lower-case the letters; no non-ASCII letter lower-cases to one of
 * these). */
#define CONTRACTIONS "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

/* The whitespace tail of llama3/qwen2/qwen35: \s*[\r\n]+|\s+(?!\S)|\s+. */
#define WS_TAIL "|[" WS "]*[\\r\\n]+|[" WS "]+(?![^" WS "])|[" WS "]+"

static const char *const re_gpt2[] = {GPT2_RE};

/* LLAMA_VOCAB_PRE_TYPE_DEFAULT (tokenizer.ggml.pre absent or "default"). The
 * first and third run as std::regex on llama.cpp's collapsed text (see
 * re_deepseek_v3), where \p{P} is the code point's category and the ASCII
 * punctuation; the last is std::wregex on code points, ASCII digits only. */
static const char *const re_default[] = {
    "[\\p{P}$+<=>^~|]+", GPT2_RE, "\\p{N}+", "[0-9][0-9][0-9]",
};

/* LLAMA_VOCAB_PRE_TYPE_FALCON: the default list with ` in the first class and
 * no \p{N}+ pass. */
static const char *const re_falcon[] = {
    "[\\p{P}$+<=>^~|`]+", GPT2_RE, "[0-9][0-9][0-9]",
};

/* starcoder, refact, command-r (and the other types llama.cpp gives this
 * list): every digit on its own, then GPT-2. */
static const char *const re_starcoder[] = {"\\p{N}", GPT2_RE};

/* LLAMA_VOCAB_PRE_TYPE_LLAMA3, QWEN2 and QWEN35: llama.cpp matches these with
 * hand-written code (unicode_regex_split_custom_llama3/qwen2/qwen35), which
 * is the regex with \s the Unicode White_Space (WS), \p{L}, \p{N} and \p{M}
 * the code point's category, [^\s\p{L}\p{N}] any other code point (so also
 * unassigned ones) and (?!\S) true at the end of a piece. */
static const char *const re_llama3[] = {
    CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n]*" WS_TAIL,
};
static const char *const re_qwen2[] = {
    CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n]*" WS_TAIL,
};
/* qwen35: a letter run also takes combining marks, and may start with one. */
static const char *const re_qwen35[] = {
    CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^" WS "\\p{L}\\p{M}\\p{N}]+[\\r\\n]*" WS_TAIL,
};

/* The CJK class of deepseek-llm and deepseek-coder ("[一-龥ࠀ-一가-퟿]+" in
 * llama.cpp): it runs as std::wregex on text whose non-ASCII whitespace is
 * \v, so the whitespace inside U+0800..U+4E00 is left out. */
#define DS_CJK ("[\\x{4E00}-\\x{9FA5}\\x{800}-\\x{167F}\\x{1681}-\\x{1FFF}\\x{200B}-\\x{2027}\\x{202A}-\\x{202E}" \
                "\\x{2030}-\\x{205E}\\x{2060}-\\x{2FFF}\\x{3001}-\\x{4E00}\\x{AC00}-\\x{D7FF}]+")

/* LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_CODER: the \s of the second and third is the
 * collapsed text's (WS), [\r\n] is CR and LF only. */
static const char *const re_deepseek_coder[] = {
    "[\\r\\n]", "[" WS "]?\\p{L}+", "[" WS "]?\\p{P}+", DS_CJK, "\\p{N}",
};

/* gemma4 (tokenizer.ggml.model "gemma4"): runs of line feeds and runs of
 * anything else; the text has its spaces as U+2581 by then. */
static const char *const re_gemma4[] = {"[^\\n]+|\\n+"};

/* llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM list, written with code point
 * escapes. The letter class is the cased letters of deepseek's tokenizer.json;
 * the CJK class of the fifth regex excludes the whitespace inside U+0800..U+4E00,
 * and the punctuation class stops at U+3001, because llama.cpp replaces
 * non-ASCII whitespace by \v before running these (std::wregex) patterns. */
static const char *const re_deepseek_llm[] = {
    "[\\r\\n]",
    ("[" WS "]?[A-Za-z\\x{B5}\\x{C0}-\\x{D6}\\x{D8}-\\x{F6}\\x{F8}-\\x{1BA}\\x{1BC}-\\x{1BF}"
     "\\x{1C4}-\\x{293}\\x{295}-\\x{2AF}\\x{370}-\\x{373}\\x{376}\\x{377}\\x{37B}-\\x{37D}\\x{37F}"
     "\\x{386}\\x{388}-\\x{38A}\\x{38C}\\x{38E}-\\x{3A1}\\x{3A3}-\\x{3F5}\\x{3F7}-\\x{481}"
     "\\x{48A}-\\x{52F}\\x{531}-\\x{556}\\x{10A0}-\\x{10C5}\\x{13A0}-\\x{13F5}\\x{13F8}-\\x{13FD}"
     "\\x{1C90}-\\x{1CBA}\\x{1CBD}-\\x{1CBF}\\x{1D00}-\\x{1D2B}\\x{1D6B}-\\x{1D77}\\x{1D79}-\\x{1D9A}"
     "\\x{1E00}-\\x{1F15}\\x{1F18}-\\x{1F1D}\\x{1F20}-\\x{1F45}\\x{1F48}-\\x{1F4D}\\x{1F50}-\\x{1F57}"
     "\\x{1F59}\\x{1F5B}\\x{1F5D}\\x{1F5F}-\\x{1F7D}\\x{1F80}-\\x{1FB4}\\x{1FB6}-\\x{1FBC}\\x{1FBE}"
     "\\x{1FC2}-\\x{1FC4}\\x{1FC6}-\\x{1FCC}\\x{1FD0}-\\x{1FD3}\\x{1FD6}-\\x{1FDB}\\x{1FE0}-\\x{1FEC}"
     "\\x{1FF2}-\\x{1FF4}\\x{1FF6}-\\x{1FFC}\\x{2102}\\x{2107}\\x{210A}-\\x{2113}\\x{2115}"
     "\\x{2119}-\\x{211D}\\x{2124}\\x{2126}\\x{2128}\\x{212A}-\\x{212D}\\x{212F}-\\x{2134}\\x{2139}"
     "\\x{213C}-\\x{213F}\\x{2145}-\\x{2149}\\x{214E}\\x{2183}\\x{2184}\\x{2C00}-\\x{2C7B}"
     "\\x{2C7E}-\\x{2CE4}\\x{2CEB}-\\x{2CEE}\\x{2CF2}\\x{2CF3}\\x{A640}-\\x{A66D}\\x{A680}-\\x{A69B}"
     "\\x{A722}-\\x{A76F}\\x{A771}-\\x{A787}\\x{A78B}-\\x{A78E}\\x{AB70}-\\x{ABBF}\\x{FB00}-\\x{FB06}"
     "\\x{FB13}-\\x{FB17}\\x{FF21}-\\x{FF3A}\\x{FF41}-\\x{FF5A}\\x{10400}-\\x{1044F}"
     "\\x{104B0}-\\x{104D3}\\x{104D8}-\\x{104FB}\\x{10C80}-\\x{10CB2}\\x{10CC0}-\\x{10CF2}"
     "\\x{118A0}-\\x{118DF}\\x{1E900}-\\x{1E943}]+"),
    ("[" WS "]?[\\x{21}-\\x{2F}\\x{3A}-\\x{7E}\\x{FF01}-\\x{FF0F}\\x{FF1A}-\\x{FF5E}\\x{2018}-\\x{201F}"
     "\\x{3001}-\\x{3002}]+"),
    "[" WS "]+$",
    DS_CJK,
    "\\p{N}+",
};

/* llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM list ("deepseek-v3"), as
 * llama.cpp runs it: none of the three has a custom implementation there, so
 * the first and third (they name \p{..}) run as std::regex on the "collapsed"
 * text, where ASCII stays as it is, every non-ASCII code point becomes one
 * byte standing for its category (N, L, P, M, S, or any other) and non-ASCII
 * whitespace becomes \v; the second runs as std::wregex on the code points,
 * again with non-ASCII whitespace as \v. What that comes to, written here:
 *  - \p{N}, \p{L}, \p{M}, \p{P} and \p{S} are the code point's Unicode
 *    category: llama.cpp knows all five (its ASCII spellings are exactly the
 *    ASCII members: P is !"#%&'()*,-./:;?@[\]_{}, S is $+<=>^`|~, M none), so
 *    PCRE2's \p{..} are used as they are. Whitespace is in none of them (as
 *    in PCRE2): U+00A0 or U+3000 can be the optional prefix of a word.
 *  - \s and \S are WS, not PCRE2's \s: C-locale isspace on ASCII (no
 *    \x1C-\x1F) and \v for every non-ASCII White_Space, where PCRE2's \s
 *    also takes U+180E (a format character, no White_Space, to llama.cpp).
 *  - [\r\n] is CR and LF only: U+0085, U+2028 and U+2029 are \v there,
 *    whitespace but no line break.
 *  - [A-Za-z] and the punctuation class of the first alternative (all 32
 *    ASCII punctuation and symbol characters) are ASCII only: a non-ASCII
 *    letter is a non-ASCII byte in the collapsed text.
 *  - The CJK class is code point ranges: U+4E00..U+9FA5, hiragana
 *    U+3040..U+309F, katakana U+30A0..U+30FF (U+3000 is not in it, so the
 *    \v replacement changes nothing there).
 *  - Alternation is leftmost-first and the lookahead ends at the piece, in
 *    ECMAScript as in PCRE2; each regex splits the pieces of the previous one,
 *    so a digit run is cut into threes from its left before anything else. */
static const char *const re_deepseek_v3[] = {
    "\\p{N}{1,3}",
    "[\\x{4E00}-\\x{9FA5}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}]+",
    ("[!-/:-@\\[-`{-~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*"
     "|[" WS "]*[\\r\\n]+|[" WS "]+(?![^" WS "])|[" WS "]+"),
};

#define RE_LIST(x) x, (int)(sizeof x / sizeof *x)

/* tokenizer.ggml.pre -> regexes and the flags llama.cpp sets with them (its
 * llama_vocab::impl::load; each name here gets the same list and flags
 * there). ignore_merges: a piece that is a token's text is that token, not
 * what its merges give. add_bos: the default of tokenizer.ggml.add_bos_token. */
typedef struct pre_def {
    const char *name;
    const char *const *re;
    int n_re;
    bool ignore_merges, add_bos;
    bool raw; /* no GPT-2 byte map: spaces become U+2581, symbols are UTF-8 characters */
} pre_def;

static const pre_def pre_defs[] = {
    {"default", RE_LIST(re_default), false, false},
    {"gpt-2", RE_LIST(re_gpt2), false, false},
    {"phi-2", RE_LIST(re_gpt2), false, false},
    {"mpt", RE_LIST(re_gpt2), false, false},
    {"olmo", RE_LIST(re_gpt2), false, false},
    {"falcon", RE_LIST(re_falcon), false, false},
    {"starcoder", RE_LIST(re_starcoder), false, false},
    {"refact", RE_LIST(re_starcoder), false, false},
    {"command-r", RE_LIST(re_starcoder), false, false},
    {"smollm", RE_LIST(re_starcoder), false, false},
    {"codeshell", RE_LIST(re_starcoder), false, false},
    {"llama3", RE_LIST(re_llama3), true, true},
    {"llama-v3", RE_LIST(re_llama3), true, true},
    {"llama-bpe", RE_LIST(re_llama3), true, true},
    {"falcon3", RE_LIST(re_llama3), true, true},
    {"dbrx", RE_LIST(re_llama3), false, false},
    {"smaug-bpe", RE_LIST(re_llama3), false, false},
    {"qwen2", RE_LIST(re_qwen2), false, false},
    {"deepseek-r1-qwen", RE_LIST(re_qwen2), false, false},
    {"stablelm2", RE_LIST(re_qwen2), false, false},
    {"qwen35", RE_LIST(re_qwen35), false, false},
    {"deepseek-llm", RE_LIST(re_deepseek_llm), false, false},
    {"deepseek-coder", RE_LIST(re_deepseek_coder), false, false},
    {"deepseek-v3", RE_LIST(re_deepseek_v3), false, false},
    /* tokenizer.ggml.model "gemma4", whatever tokenizer.ggml.pre says */
    {"gemma4", RE_LIST(re_gemma4), false, true, true},
};

/* The pre-tokenizer of t->pre (absent: "default"), or KVT_EUNSUPPORTED. */
static int find_pre(const kvt_tokenizer *t, const pre_def **out)
{
    const char *name = t->pre ? t->pre : "default";
    for (size_t i = 0; i < sizeof pre_defs / sizeof *pre_defs; i++)
        if (!strcmp(pre_defs[i].name, name)) { *out = &pre_defs[i]; return KVT_OK; }
    return kvt_fail(KVT_EUNSUPPORTED, "tokenizer: unsupported pre-tokenizer "
                    "tokenizer.ggml.pre = '%s'", t->pre);
}

static int compile_regexes(kvt_tokenizer *t, const pre_def *pd)
{
    const char *const *list = pd->re;
    int n = pd->n_re;
    for (int i = 0; i < n; i++) {
        int err;
        PCRE2_SIZE at;
        t->re[i] = pcre2_compile((PCRE2_SPTR)list[i], PCRE2_ZERO_TERMINATED,
                                 PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF |
                                 PCRE2_DOLLAR_ENDONLY, &err, &at, NULL);
        if (!t->re[i]) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(err, msg, sizeof msg);
            return kvt_fail(KVT_EUNSUPPORTED, "tokenizer: pcre2 cannot compile pre-tokenizer "
                            "regex %d at %zu: %s", i, (size_t)at, (const char *)msg);
        }
        t->n_re = i + 1;
        pcre2_jit_compile(t->re[i], PCRE2_JIT_COMPLETE); /* optional: falls back to the interpreter */
    }
    return KVT_OK;
}

/* ---- building a tokenizer ------------------------------------------------ */

void kvt_tokenizer_free(kvt_tokenizer *t)
{
    if (!t) return;
    free(t->pre);
    free(t->special_rstrip);
    free(t->text);
    free(t->text_off);
    free(t->piece);
    free(t->piece_off);
    free(t->score);
    free(t->type);
    free(t->tok_slot);
    free(t->merges);
    free(t->merge_slot);
    free(t->special);
    free(t->trie);
    for (int i = 0; i < t->n_re; i++) pcre2_code_free(t->re[i]);
    free(t);
}

static int build_hash(kvt_tokenizer *t)
{
    size_t size = table_size(t->n_vocab);
    t->tok_slot = kvt_calloc(size, sizeof *t->tok_slot);
    if (!t->tok_slot) return KVT_ENOMEM;
    t->tok_mask = size - 1;
    for (uint32_t id = 0; id < t->n_vocab; id++) {
        size_t len;
        const char *s = tok_text(t, (int32_t)id, &len);
        size_t i = hash_bytes(s, len) & t->tok_mask;
        for (; t->tok_slot[i]; i = (i + 1) & t->tok_mask) {
            size_t l2;
            const char *s2 = tok_text(t, (int32_t)(t->tok_slot[i] - 1), &l2);
            if (l2 == len && !memcmp(s, s2, len))
                return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.tokens: token %u repeats the "
                                "text of token %u", id, t->tok_slot[i] - 1);
        }
        t->tok_slot[i] = id + 1;
    }
    return KVT_OK;
}

/* Decoded bytes of every token (see the file comment). */
static int build_pieces(kvt_tokenizer *t)
{
    uint8_t cp_to_byte[512];
    bool cp_mapped[512] = {false};
    for (int b = 0; b < 256; b++) {
        uint32_t cp = byte_to_cp((uint8_t)b);
        cp_to_byte[cp] = (uint8_t)b;
        cp_mapped[cp] = true;
    }
    /* A piece is never longer than its text. */
    t->piece = kvt_malloc(t->text_off[t->n_vocab]);
    t->piece_off = kvt_malloc(((size_t)t->n_vocab + 1) * sizeof *t->piece_off);
    if (!t->piece || !t->piece_off) return KVT_ENOMEM;
    size_t o = 0;
    for (uint32_t id = 0; id < t->n_vocab; id++) {
        size_t n;
        const char *s = tok_text(t, (int32_t)id, &n);
        int32_t type = t->type[id];
        t->piece_off[id] = o;
        if (type == TT_BYTE) {
            int b = parse_byte_token(s, n);
            if (b < 0)
                return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.tokens: byte token %u is "
                                "'%.*s', not <0xXX>", id, (int)(n < 32 ? n : 32), s);
            t->piece[o++] = (char)b;
        } else if (is_special_type(type) || t->model == MODEL_BYTES) {
            memcpy(t->piece + o, s, n);
            o += n;
        } else if (t->model == MODEL_SPM || t->raw) {
            for (size_t i = 0; i < n;) {
                if (i + 3 <= n && !memcmp(s + i, "\xe2\x96\x81", 3)) { t->piece[o++] = ' '; i += 3; }
                else t->piece[o++] = s[i++];
            }
        } else {
            for (size_t i = 0; i < n;) {
                uint32_t cp;
                size_t k = get_utf8((const uint8_t *)s + i, n - i, &cp);
                if (k && cp < 512 && cp_mapped[cp]) { t->piece[o++] = (char)cp_to_byte[cp]; i += k; }
                else if (k) { memcpy(t->piece + o, s + i, k); o += k; i += k; }
                else t->piece[o++] = s[i++];
            }
        }
    }
    t->piece_off[t->n_vocab] = o;
    return KVT_OK;
}

typedef struct lenid { size_t len; int32_t id; } lenid;

static int cmp_lenid(const void *a, const void *b)
{
    const lenid *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1; /* longest first */
    return x->id < y->id ? -1 : x->id > y->id;
}

/* The special tokens in partition order, and a trie over their texts. */
static int build_specials(kvt_tokenizer *t)
{
    uint32_t n = 0;
    size_t bytes = 0;
    for (uint32_t id = 0; id < t->n_vocab; id++)
        if (is_special_type(t->type[id]) && t->text_off[id + 1] > t->text_off[id]) {
            n++;
            bytes += t->text_off[id + 1] - t->text_off[id];
        }
    for (int c = 0; c < 256; c++) t->trie_root[c] = -1;
    if (!n) return KVT_OK;
    lenid *order = kvt_malloc(n * sizeof *order);
    t->special = kvt_malloc(n * sizeof *t->special);
    t->trie = kvt_malloc(bytes * sizeof *t->trie);
    if (!order || !t->special || !t->trie) { free(order); return KVT_ENOMEM; }
    uint32_t k = 0;
    for (uint32_t id = 0; id < t->n_vocab; id++)
        if (is_special_type(t->type[id]) && t->text_off[id + 1] > t->text_off[id])
            order[k++] = (lenid){t->text_off[id + 1] - t->text_off[id], (int32_t)id};
    qsort(order, n, sizeof *order, cmp_lenid);
    for (k = 0; k < n; k++) t->special[k] = order[k].id;
    free(order);
    t->n_special = n;
    /* Phi-3 (llama.cpp: general.name containing "phi-3" or "phi3"): every
     * special token but these three drops the whitespace after it. */
    if (!(t->special_rstrip = kvt_calloc(n, 1))) return KVT_ENOMEM;
    for (k = 0; t->phi3 && k < n; k++) {
        size_t len;
        const char *s = tok_text(t, t->special[k], &len);
        t->special_rstrip[k] = !((len == 5 && !memcmp(s, "<unk>", 5)) || (len == 3 && !memcmp(s, "<s>", 3)) ||
                                 (len == 13 && !memcmp(s, "<|endoftext|>", 13)));
    }

    for (k = 0; k < n; k++) {
        size_t len;
        const uint8_t *s = (const uint8_t *)tok_text(t, t->special[k], &len);
        int32_t cur = -1;
        for (size_t i = 0; i < len; i++) {
            int32_t *link = cur < 0 ? &t->trie_root[s[i]] : &t->trie[cur].child, nx = *link;
            while (nx >= 0 && t->trie[nx].c != s[i]) nx = t->trie[nx].sibling;
            if (nx < 0) {
                nx = (int32_t)t->n_trie++;
                t->trie[nx] = (tnode){.child = -1, .sibling = cur < 0 ? -1 : *link,
                                      .special = -1, .c = s[i]};
                if (cur < 0) t->trie_root[s[i]] = nx;
                else t->trie[cur].child = nx;
            }
            cur = nx;
        }
        t->trie[cur].special = (int32_t)k;
    }
    return KVT_OK;
}

/* ---- token types llama.cpp overrides by text ------------------------------
 * llama.cpp's llama_vocab::impl::load changes the attributes of tokens it
 * recognises by their text (its "auto-detect special tokens by text"), and
 * these decide what its partition splits out: */

/* Its end-of-generation texts: each one in the vocabulary becomes a control
 * token (qwen2's "</s>" is a normal token in the GGUF, gemma4's
 * "<|tool_response>" and phi-3's "</s>" user-defined ones). */
static const char *const eog_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<" FW_BAR "end" SP_MARK "of" SP_MARK "sentence" FW_BAR ">", "[e~[",
};

/* Its fill-in-the-middle texts (prefix, suffix, middle, pad, repo, file
 * separator): a control token too, unless the GGUF names that FIM token
 * (tokenizer.ggml.fim_pre_token_id, ...). llama.cpp takes only the first of
 * a group it meets in its hash map's order; a vocabulary with two texts of
 * one group gets both here. */
static const char *const fim_keys[] = {
    "tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.fim_mid_token_id",
    "tokenizer.ggml.fim_pad_token_id", "tokenizer.ggml.fim_rep_token_id", "tokenizer.ggml.fim_sep_token_id",
};
static const char *const fim_texts[][9] = {
    {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<" FW_BAR "fim" SP_MARK "begin" FW_BAR ">", "<PRE>",
     SP_MARK "<PRE>", "<|code_prefix|>", "<|prefix|>", NULL},
    {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<" FW_BAR "fim" SP_MARK "hole" FW_BAR ">", "<SUF>",
     SP_MARK "<SUF>", "<|code_suffix|>", "<|suffix|>", NULL},
    {"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<" FW_BAR "fim" SP_MARK "end" FW_BAR ">", "<MID>",
     SP_MARK "<MID>", "<|code_middle|>", "<|middle|>", NULL},
    {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", NULL},
    {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", NULL},
    {"<|file_sep|>", NULL},
};

static int32_t lookup_str(const kvt_tokenizer *t, const char *s) { return lookup(t, s, strlen(s)); }

static void make_control(kvt_tokenizer *t, const char *text)
{
    int32_t id = lookup_str(t, text);
    if (id >= 0 && t->type[id] != TT_BYTE && t->type[id] != TT_UNKNOWN) t->type[id] = TT_CONTROL;
}

/* The overrides, in llama.cpp's order; then gpt-oss's four texts are
 * user-defined, and so is "<|end|>" next to "<|return|>" and "<|call|>"
 * (o200k_harmony) or "<|call|>"/"<|calls|>" and "<|flush|>" (solar-open);
 * "</s>" is normal again next to "<|tool_response>" (gemma4). */
static void override_types(kvt_tokenizer *t)
{
    for (size_t g = 0; g < sizeof fim_texts / sizeof *fim_texts; g++)
        for (size_t i = 0; !(t->fim_keyed >> g & 1) && fim_texts[g][i]; i++) make_control(t, fim_texts[g][i]);
    for (size_t i = 0; i < sizeof eog_texts / sizeof *eog_texts; i++) make_control(t, eog_texts[i]);
    static const char *const gpt_oss[] = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"};
    for (size_t i = 0; i < 4; i++) {
        int32_t id = lookup_str(t, gpt_oss[i]);
        if (id >= 0) t->type[id] = TT_USER;
    }
    bool call = lookup_str(t, "<|call|>") >= 0 || lookup_str(t, "<|calls|>") >= 0;
    int32_t end = lookup_str(t, "<|end|>"), eos = lookup_str(t, "</s>");
    if (end >= 0 && call && (lookup_str(t, "<|return|>") >= 0 || lookup_str(t, "<|flush|>") >= 0))
        t->type[end] = TT_USER;
    if (eos >= 0 && lookup_str(t, "<|tool_response>") >= 0) t->type[eos] = TT_NORMAL;
}

/* Everything derived from texts and types: hash, pieces, specials, bytes. */
static int build_common(kvt_tokenizer *t)
{
    int rc;
    if ((rc = build_hash(t))) return rc;
    if (t->model != MODEL_BYTES) override_types(t);
    if ((rc = build_pieces(t)) || (rc = build_specials(t))) return rc;
    for (int b = 0; b < 256; b++) {
        char buf[8];
        int32_t id = -1;
        if (t->model == MODEL_BYTES) {
            id = b;
        } else if (t->raw) {
            snprintf(buf, sizeof buf, "<0x%02X>", b);
            id = lookup(t, buf, 6);
        } else if (t->model == MODEL_SPM) {
            snprintf(buf, sizeof buf, "<0x%02X>", b);
            id = lookup(t, buf, 6);
            if (id < 0) { buf[0] = (char)b; id = lookup(t, buf, 1); }
            if (id < 0) id = t->unk;
        } else {
            id = lookup(t, buf, put_utf8(buf, byte_to_cp((uint8_t)b)));
        }
        t->byte_tok[b] = id;
    }
    return KVT_OK;
}

/* An optional token id key: absent -> dflt; -1 / 0xFFFFFFFF -> none. */
static int read_id(const kvt_gguf *g, const char *key, uint32_t n_vocab, int32_t dflt, int32_t *out)
{
    int64_t v;
    int rc = kvt_gguf_get_i64(g, key, &v);
    if (rc == KVT_ENOENT) {
        *out = dflt >= 0 && (uint32_t)dflt < n_vocab ? dflt : -1;
        return KVT_OK;
    }
    if (rc) return kvt_fail(KVT_EFORMAT, "%s is not an integer", key);
    if (v == -1 || v == 0xffffffffll) { *out = -1; return KVT_OK; }
    if (v < 0 || v >= (int64_t)n_vocab)
        return kvt_fail(KVT_EFORMAT, "%s = %lld is outside the vocabulary (%u tokens)", key,
                        (long long)v, n_vocab);
    *out = (int32_t)v;
    return KVT_OK;
}

static int read_bool(const kvt_gguf *g, const char *key, bool dflt, bool *out)
{
    int rc = kvt_gguf_get_bool(g, key, out);
    if (rc == KVT_ENOENT) { *out = dflt; return KVT_OK; }
    return rc ? kvt_fail(KVT_EFORMAT, "%s is not a bool", key) : KVT_OK;
}

static int read_merges(kvt_tokenizer *t, const kvt_gguf *g)
{
    const kvt_gguf_val *items;
    size_t n;
    int rc = kvt_gguf_get_arr(g, "tokenizer.ggml.merges", KVT_GGUF_STR, &items, &n);
    if (rc == KVT_ENOENT) return kvt_fail(KVT_EFORMAT, "gpt2 tokenizer without tokenizer.ggml.merges");
    if (rc) return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.merges is not an array of strings");
    if (n > INT32_MAX) return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.merges: %zu merges", n);
    size_t size = table_size(n);
    t->merges = kvt_malloc((n ? n : 1) * sizeof *t->merges);
    t->merge_slot = kvt_calloc(size, sizeof *t->merge_slot);
    if (!t->merges || !t->merge_slot) return KVT_ENOMEM;
    t->merge_mask = size - 1;
    char *buf = NULL;
    size_t cap = 0;
    for (size_t r = 0; r < n; r++) {
        const char *s = items[r].v.str;
        size_t len = (size_t)items[r].n;
        /* Split at the first space after the first byte, as llama.cpp does. */
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp) {
            free(buf);
            return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.merges[%zu] = '%.*s' is not 'left right'",
                            r, (int)(len < 64 ? len : 64), s);
        }
        size_t nl = (size_t)(sp - s), nr = len - nl - 1;
        int32_t a = lookup(t, s, nl), b = lookup(t, sp + 1, nr);
        if (a < 0 || b < 0) {
            free(buf);
            return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.merges[%zu] = '%.*s' names a token "
                            "that is not in the vocabulary", r, (int)(len < 64 ? len : 64), s);
        }
        if (KVT_GROW(buf, &cap, nl + nr, rc), rc) { free(buf); return rc; }
        memcpy(buf, s, nl);
        memcpy(buf + nl, sp + 1, nr);
        t->merges[r] = (merge){a, b, lookup(t, buf, nl + nr)};
        size_t i = hash_pair(a, b) & t->merge_mask;
        for (; t->merge_slot[i]; i = (i + 1) & t->merge_mask) {
            const merge *m = &t->merges[t->merge_slot[i] - 1];
            if (m->left == a && m->right == b) break; /* repeated pair: the first rank wins */
        }
        if (!t->merge_slot[i]) t->merge_slot[i] = (uint32_t)r + 1;
    }
    free(buf);
    t->n_merges = (uint32_t)n;
    return KVT_OK;
}

/* The bytes model: 256 <0xXX> byte tokens in byte order, then specials. */
static int check_bytes_layout(const kvt_tokenizer *t)
{
    if (t->n_vocab < 256) return kvt_fail(KVT_EFORMAT, "bytes tokenizer with %u tokens", t->n_vocab);
    for (uint32_t id = 0; id < t->n_vocab; id++) {
        size_t n;
        const char *s = tok_text(t, (int32_t)id, &n);
        bool ok = id < 256 ? t->type[id] == TT_BYTE && parse_byte_token(s, n) == (int)id
                           : is_special_type(t->type[id]);
        if (!ok) return kvt_fail(KVT_EFORMAT, "bytes tokenizer: token %u ('%.*s', type %d) is not "
                                 "%s", id, (int)(n < 32 ? n : 32), s, t->type[id],
                                 id < 256 ? "its byte token" : "a special token");
    }
    return KVT_OK;
}

static int from_gguf(kvt_tokenizer *t, const kvt_gguf *g)
{
    const char *s;
    size_t n, len;
    int rc = kvt_gguf_get_str(g, "tokenizer.ggml.model", &s, &len);
    if (rc == KVT_ENOENT) return kvt_fail(KVT_EFORMAT, "no tokenizer.ggml.model");
    if (rc) return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.model is not a string");
    if (len == 5 && !memcmp(s, "llama", 5)) t->model = MODEL_SPM;
    else if (len == 4 && !memcmp(s, "gpt2", 4)) t->model = MODEL_BPE;
    else if (len == 6 && !memcmp(s, "gemma4", 6)) t->model = MODEL_BPE, t->gemma4 = true;
    else if (len == 5 && !memcmp(s, "bytes", 5)) t->model = MODEL_BYTES;
    else return kvt_fail(KVT_EUNSUPPORTED, "unsupported tokenizer.ggml.model '%.*s'",
                         (int)(len < 64 ? len : 64), s);

    const kvt_gguf_val *tok;
    rc = kvt_gguf_get_arr(g, "tokenizer.ggml.tokens", KVT_GGUF_STR, &tok, &n);
    if (rc == KVT_ENOENT) return kvt_fail(KVT_EFORMAT, "no tokenizer.ggml.tokens");
    if (rc) return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.tokens is not an array of strings");
    if (n == 0 || n >= INT32_MAX)
        return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.tokens has %zu tokens", n);
    t->n_vocab = (uint32_t)n;

    /* Texts; an empty token gets llama.cpp's stand-in "[EMPTY_<id>]". */
    size_t total = 0;
    for (size_t i = 0; i < n; i++) total += tok[i].n ? (size_t)tok[i].n : 24;
    t->text = kvt_malloc(total);
    t->text_off = kvt_malloc((n + 1) * sizeof *t->text_off);
    t->type = kvt_malloc(n * sizeof *t->type);
    if (!t->text || !t->text_off || !t->type) return KVT_ENOMEM;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        t->text_off[i] = o;
        if (tok[i].n) {
            memcpy(t->text + o, tok[i].v.str, (size_t)tok[i].n);
            o += (size_t)tok[i].n;
        } else {
            char e[24];
            int k = snprintf(e, sizeof e, "[EMPTY_%zu]", i);
            memcpy(t->text + o, e, (size_t)k);
            o += (size_t)k;
        }
    }
    t->text_off[n] = o;

    const kvt_gguf_val *v = kvt_gguf_get(g, "tokenizer.ggml.scores");
    if (v) {
        if (v->type != KVT_GGUF_ARR || (v->elem_type != KVT_GGUF_F32 && v->elem_type != KVT_GGUF_I32))
            return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.scores is not an array of f32");
        if (v->n != n)
            return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.scores has %llu entries for %zu tokens",
                            (unsigned long long)v->n, n);
        if (!(t->score = kvt_malloc(n * sizeof *t->score))) return KVT_ENOMEM;
        for (size_t i = 0; i < n; i++) {
            float f = v->elem_type == KVT_GGUF_F32 ? (float)v->v.arr[i].v.f : (float)v->v.arr[i].v.i;
            if (isnan(f)) return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.scores[%zu] is NaN", i);
            t->score[i] = f == 0 ? 0.0f : f; /* one zero, for the heap keys */
        }
    }

    const kvt_gguf_val *ty;
    size_t nty;
    rc = kvt_gguf_get_arr(g, "tokenizer.ggml.token_type", KVT_GGUF_I32, &ty, &nty);
    if (rc == KVT_ENOENT) {
        if (t->model == MODEL_BYTES) return kvt_fail(KVT_EFORMAT, "bytes tokenizer without "
                                                     "tokenizer.ggml.token_type");
        for (size_t i = 0; i < n; i++) t->type[i] = TT_NORMAL;
    } else if (rc) {
        return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.token_type is not an array of i32");
    } else {
        if (nty != n)
            return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.token_type has %zu entries for %zu "
                            "tokens", nty, n);
        for (size_t i = 0; i < n; i++) {
            int64_t x = ty[i].v.i;
            if (x < TT_UNDEFINED || x > TT_BYTE)
                return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.token_type[%zu] = %lld is not a "
                                "token type (0..6)", i, (long long)x);
            t->type[i] = (int32_t)x;
        }
    }

    /* The pre-tokenizer first: it sets the default of add_bos_token. llama.cpp
     * names gemma4's "gemma4" whatever tokenizer.ggml.pre says. */
    const pre_def *pd = NULL;
    if (t->model == MODEL_BPE) {
        if (t->gemma4) {
            if (!(t->pre = kvt_strndup("gemma4", 6))) return KVT_ENOMEM;
        } else {
            rc = kvt_gguf_get_str(g, "tokenizer.ggml.pre", &s, &len);
            if (rc && rc != KVT_ENOENT) return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.pre is not a string");
            if (!rc && !(t->pre = kvt_strndup(s, len))) return KVT_ENOMEM;
            if (t->pre && strlen(t->pre) != len) return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.pre holds a NUL");
        }
        if ((rc = find_pre(t, &pd))) return rc;
        t->ignore_merges = pd->ignore_merges;
        t->raw = pd->raw;
    }

    bool spm = t->model == MODEL_SPM;
    if ((rc = read_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab, spm ? 1 : -1, &t->bos)) ||
        (rc = read_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab, spm ? 2 : -1, &t->eos)) ||
        (rc = read_id(g, "tokenizer.ggml.unknown_token_id", t->n_vocab, spm ? 0 : -1, &t->unk)) ||
        (rc = read_bool(g, "tokenizer.ggml.add_bos_token", pd ? pd->add_bos : true, &t->add_bos)) ||
        (rc = read_bool(g, "tokenizer.ggml.add_eos_token", false, &t->add_eos)) ||
        (rc = read_bool(g, "tokenizer.ggml.add_space_prefix", spm, &t->add_space_prefix)))
        return rc;
    if (t->raw) t->add_bos = true; /* llama.cpp overrides a false add_bos_token for Gemma 4 */
    if (t->add_bos && t->bos < 0)
        return kvt_fail(KVT_EFORMAT, "tokenizer.ggml.add_bos_token is true but there is no BOS token");
    if (t->model != MODEL_SPM) t->add_space_prefix = false;

    for (size_t i = 0; i < sizeof fim_keys / sizeof *fim_keys; i++)
        if (kvt_gguf_get(g, fim_keys[i])) t->fim_keyed |= (uint8_t)(1u << i);
    if (!kvt_gguf_get_str(g, "general.name", &s, &len)) {
        char lower[256];
        size_t k = len < sizeof lower - 1 ? len : sizeof lower - 1;
        for (size_t i = 0; i < k; i++) lower[i] = (char)(s[i] >= 'A' && s[i] <= 'Z' ? s[i] - 'A' + 'a' : s[i]);
        lower[k] = 0;
        t->phi3 = strstr(lower, "phi-3") || strstr(lower, "phi3");
    }
    if (t->model == MODEL_BYTES && (rc = check_bytes_layout(t))) return rc;
    if ((rc = build_common(t))) return rc;
    if (t->model == MODEL_BPE && ((rc = read_merges(t, g)) || (rc = compile_regexes(t, pd)))) return rc;
    return KVT_OK;
}

int kvt_tokenizer_from_gguf(kvt_tokenizer **out, const kvt_gguf *g)
{
    if (!out || !g) return kvt_fail(KVT_EINVAL, "tokenizer: NULL argument");
    *out = NULL;
    kvt_tokenizer *t = kvt_calloc(1, sizeof *t);
    if (!t) return KVT_ENOMEM;
    int rc = from_gguf(t, g);
    if (rc) { kvt_tokenizer_free(t); return rc; }
    *out = t;
    return KVT_OK;
}


static const char *const bytes_specials[] = {
    "<" FW_BAR "begin" SP_MARK "of" SP_MARK "sentence" FW_BAR ">",
    "<" FW_BAR "end" SP_MARK "of" SP_MARK "sentence" FW_BAR ">",
    "<" FW_BAR "User" FW_BAR ">",
    "<" FW_BAR "Assistant" FW_BAR ">",
    "<think>",
    "</think>",
    FW_BAR "DSML" FW_BAR,
    "<tool_result>",
    "</tool_result>",
    "<" FW_BAR "place" SP_MARK "holder" SP_MARK "no" SP_MARK "0" FW_BAR ">",
    "<" FW_BAR "place" SP_MARK "holder" SP_MARK "no" SP_MARK "1" FW_BAR ">",
    "<" FW_BAR "place" SP_MARK "holder" SP_MARK "no" SP_MARK "2" FW_BAR ">",
    "<" FW_BAR "place" SP_MARK "holder" SP_MARK "no" SP_MARK "3" FW_BAR ">",
    "<" FW_BAR "place" SP_MARK "holder" SP_MARK "no" SP_MARK "4" FW_BAR ">",
    "<" FW_BAR "place" SP_MARK "holder" SP_MARK "no" SP_MARK "5" FW_BAR ">",
};

int kvt_tokenizer_new_bytes(kvt_tokenizer **out)
{
    if (!out) return kvt_fail(KVT_EINVAL, "tokenizer: NULL argument");
    *out = NULL;
    const size_t ns = sizeof bytes_specials / sizeof *bytes_specials, n = 256 + ns;
    kvt_tokenizer *t = kvt_calloc(1, sizeof *t);
    if (!t) return KVT_ENOMEM;
    size_t total = 256 * 6;
    for (size_t i = 0; i < ns; i++) total += strlen(bytes_specials[i]);
    t->model = MODEL_BYTES;
    t->n_vocab = (uint32_t)n;
    t->text = kvt_malloc(total + 1);
    t->text_off = kvt_malloc((n + 1) * sizeof *t->text_off);
    t->type = kvt_malloc(n * sizeof *t->type);
    int rc = KVT_ENOMEM;
    if (t->text && t->text_off && t->type) {
        size_t o = 0;
        for (size_t i = 0; i < n; i++) {
            t->text_off[i] = o;
            if (i < 256) {
                snprintf(t->text + o, 7, "<0x%02X>", (unsigned)i);
                o += 6;
                t->type[i] = TT_BYTE;
            } else {
                size_t k = strlen(bytes_specials[i - 256]);
                memcpy(t->text + o, bytes_specials[i - 256], k);
                o += k;
                t->type[i] = TT_CONTROL;
            }
        }
        t->text_off[n] = o;
        t->bos = 256;
        t->eos = 257;
        t->unk = -1;
        t->add_bos = true;
        rc = build_common(t);
    }
    if (rc) { kvt_tokenizer_free(t); return rc; }
    *out = t;
    return KVT_OK;
}

/* ---- writing ---------------------------------------------------------- */

static int set_array(kvt_gguf_writer *w, const char *key, uint32_t elem, kvt_gguf_val *items, size_t n)
{
    kvt_gguf_val v = {.type = KVT_GGUF_ARR, .elem_type = elem, .n = n, .v.arr = items};
    return kvt_gguf_writer_set(w, key, &v);
}

static int set_id(kvt_gguf_writer *w, const char *key, int32_t id)
{
    return id >= 0 ? kvt_gguf_writer_set_u32(w, key, (uint32_t)id) : KVT_OK;
}

int kvt_tokenizer_to_gguf(const kvt_tokenizer *t, kvt_gguf_writer *w)
{
    if (!t || !w) return kvt_fail(KVT_EINVAL, "tokenizer: NULL argument");
    size_t n = t->n_vocab;
    kvt_gguf_val *items = kvt_calloc(n > t->n_merges ? n : t->n_merges, sizeof *items);
    char *mbuf = NULL;
    if (!items) return KVT_ENOMEM;
    int rc = kvt_gguf_writer_set_str(w, "tokenizer.ggml.model", model_name(t));
    if (!rc && t->pre) rc = kvt_gguf_writer_set_str(w, "tokenizer.ggml.pre", t->pre);
    if (!rc) {
        for (size_t i = 0; i < n; i++) {
            size_t len;
            const char *s = tok_text(t, (int32_t)i, &len);
            items[i] = (kvt_gguf_val){.type = KVT_GGUF_STR, .n = len, .v.str = s};
        }
        rc = set_array(w, "tokenizer.ggml.tokens", KVT_GGUF_STR, items, n);
    }
    if (!rc && t->score) {
        for (size_t i = 0; i < n; i++) items[i] = (kvt_gguf_val){.type = KVT_GGUF_F32, .v.f = t->score[i]};
        rc = set_array(w, "tokenizer.ggml.scores", KVT_GGUF_F32, items, n);
    }
    if (!rc) {
        for (size_t i = 0; i < n; i++) items[i] = (kvt_gguf_val){.type = KVT_GGUF_I32, .v.i = t->type[i]};
        rc = set_array(w, "tokenizer.ggml.token_type", KVT_GGUF_I32, items, n);
    }
    if (!rc && t->model == MODEL_BPE) {
        /* "left right", rebuilt from the token texts the merges were parsed into. */
        size_t total = 0, o = 0, la, lb;
        for (uint32_t r = 0; r < t->n_merges; r++)
            total += t->text_off[t->merges[r].left + 1] - t->text_off[t->merges[r].left] +
                     t->text_off[t->merges[r].right + 1] - t->text_off[t->merges[r].right] + 1;
        if (!(mbuf = kvt_malloc(total))) rc = KVT_ENOMEM;
        for (uint32_t r = 0; !rc && r < t->n_merges; r++) {
            const char *a = tok_text(t, t->merges[r].left, &la), *b = tok_text(t, t->merges[r].right, &lb);
            items[r] = (kvt_gguf_val){.type = KVT_GGUF_STR, .n = la + lb + 1, .v.str = mbuf + o};
            memcpy(mbuf + o, a, la);
            mbuf[o + la] = ' ';
            memcpy(mbuf + o + la + 1, b, lb);
            o += la + lb + 1;
        }
        if (!rc) rc = set_array(w, "tokenizer.ggml.merges", KVT_GGUF_STR, items, t->n_merges);
    }
    if (!rc) rc = set_id(w, "tokenizer.ggml.bos_token_id", t->bos);
    if (!rc) rc = set_id(w, "tokenizer.ggml.eos_token_id", t->eos);
    if (!rc) rc = set_id(w, "tokenizer.ggml.unknown_token_id", t->unk);
    if (!rc) rc = kvt_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", t->add_bos);
    if (!rc) rc = kvt_gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", t->add_eos);
    if (!rc && t->model == MODEL_SPM)
        rc = kvt_gguf_writer_set_bool(w, "tokenizer.ggml.add_space_prefix", t->add_space_prefix);
    free(mbuf);
    free(items);
    return rc;
}

/* ---- accessors ------------------------------------------------------------ */

const char *kvt_tokenizer_model(const kvt_tokenizer *t) { return model_name(t); }
uint32_t kvt_tokenizer_n_vocab(const kvt_tokenizer *t) { return t->n_vocab; }
int32_t kvt_tokenizer_bos(const kvt_tokenizer *t) { return t->bos; }
int32_t kvt_tokenizer_eos(const kvt_tokenizer *t) { return t->eos; }
bool kvt_tokenizer_add_bos(const kvt_tokenizer *t) { return t->add_bos; }

int32_t kvt_tokenizer_find(const kvt_tokenizer *t, const char *text, size_t len)
{
    if (!t || (!text && len)) return -1;
    return lookup(t, text ? text : "", len);
}

/* ---- encoding: special-token partition ----------------------------------- */

typedef struct frag { size_t off, len; int32_t id; } frag; /* id -1: ordinary text */

typedef struct fvec { frag *v; size_t n, cap; } fvec;

static int fvec_push(fvec *a, size_t off, size_t len, int32_t id)
{
    if (a->n == a->cap) {
        int rc;
        KVT_GROW(a->v, &a->cap, a->n + 1, rc);
        if (rc) return rc;
    }
    a->v[a->n++] = (frag){off, len, id};
    return KVT_OK;
}

/* Split s into text and special-token fragments (llama.cpp's
 * tokenizer_st_partition: each special, longest first, splits every text
 * fragment at its leftmost non-overlapping occurrences). The trie pass only
 * decides which specials need that pass at all. */
static int partition(const kvt_tokenizer *t, const char *s, size_t n, bool parse_special, fvec *out)
{
    int rc = fvec_push(out, 0, n, -1);
    if (rc || !t->n_special) return rc;
    uint8_t *present = kvt_calloc(t->n_special, 1);
    if (!present) return KVT_ENOMEM;
    bool any = false;
    for (size_t i = 0; i < n; i++) {
        int32_t node = t->trie_root[(uint8_t)s[i]];
        for (size_t j = i + 1; node >= 0; j++) {
            int32_t k = t->trie[node].special;
            /* control and unknown tokens only when the caller asks for them */
            if (k >= 0 && (parse_special || t->type[t->special[k]] == TT_USER)) present[k] = 1, any = true;
            if (j == n) break;
            int32_t c = t->trie[node].child;
            while (c >= 0 && t->trie[c].c != (uint8_t)s[j]) c = t->trie[c].sibling;
            node = c;
        }
    }
    fvec next = {0};
    for (uint32_t k = 0; any && k < t->n_special && !rc; k++) {
        if (!present[k]) continue;
        size_t sl;
        const char *st = tok_text(t, t->special[k], &sl);
        next.n = 0;
        for (size_t f = 0; f < out->n && !rc; f++) {
            frag fr = out->v[f];
            if (fr.id >= 0) { rc = fvec_push(&next, fr.off, fr.len, fr.id); continue; }
            size_t pos = fr.off, end = fr.off + fr.len;
            const char *m;
            while (!rc && (m = memmem(s + pos, end - pos, st, sl))) {
                size_t at = (size_t)(m - s);
                if (at > pos) rc = fvec_push(&next, pos, at - pos, -1);
                if (!rc) rc = fvec_push(&next, at, sl, t->special[k]);
                pos = at + sl;
                while (t->special_rstrip[k] && pos < end && strchr(" \t\n\v\f\r", s[pos]) && s[pos]) pos++;
            }
            if (!rc && pos < end) rc = fvec_push(&next, pos, end - pos, -1);
        }
        fvec tmp = *out;
        *out = next;
        next = tmp;
    }
    free(next.v);
    free(present);
    return rc;
}

/* ---- encoding: merge loops ----------------------------------------------- */

/* A symbol: a byte span of the text being merged, in a doubly linked list. */
typedef struct sym { int32_t prev, next, id; uint32_t off, n; } sym;

/* A candidate merge of symbols left and right (adjacent when pushed) into a
 * token id. Min-heap on key: SPM puts the negated score in the high half, BPE
 * the rank; the low half is left, so ties go to the leftmost pair. A candidate
 * is stale when either side has since changed length (symbols only grow, and
 * a symbol absorbed into its left neighbour gets n = 0). */
typedef struct cand { uint64_t key; int32_t left, right, id; uint32_t size; } cand;

typedef struct heap { cand *v; size_t n, cap; } heap;

static int heap_push(heap *h, cand c)
{
    if (h->n == h->cap) {
        int rc;
        KVT_GROW(h->v, &h->cap, h->n + 1, rc);
        if (rc) return rc;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h->v[p].key <= c.key) break;
        h->v[i] = h->v[p];
        i = p;
    }
    h->v[i] = c;
    return KVT_OK;
}

static cand heap_pop(heap *h)
{
    cand top = h->v[0], last = h->v[--h->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && h->v[c + 1].key < h->v[c].key) c++;
        if (last.key <= h->v[c].key) break;
        h->v[i] = h->v[c];
        i = c;
    }
    if (h->n) h->v[i] = last;
    return top;
}

/* Order-preserving map of a float onto uint32. */
static uint32_t float_key(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

/* Scratch shared by the merges of one encode call. */
typedef struct scratch {
    sym *syms; size_t syms_cap;
    heap h;
    char *buf; size_t buf_cap;
    char *enc; size_t enc_cap;  /* a piece in GPT-2 byte characters (ignore_merges) */
    fvec pieces, tmp;
    pcre2_match_data *md;
} scratch;

static int spm_candidate(const kvt_tokenizer *t, scratch *w, const char *s, int32_t l, int32_t r)
{
    if (l < 0 || r < 0) return KVT_OK;
    uint32_t size = w->syms[l].n + w->syms[r].n;
    int32_t id = lookup(t, s + w->syms[l].off, size);
    if (id < 0) return KVT_OK;
    float score = t->score ? t->score[id] : 0.0f;
    uint64_t key = (uint64_t)(~float_key(score)) << 32 | (uint32_t)l;
    return heap_push(&w->h, (cand){key, l, r, id, size});
}

/* Merge loop shared by SPM and BPE; candidates come from the callback. */
typedef int (*cand_fn)(const kvt_tokenizer *, scratch *, const char *, int32_t, int32_t);

static int merge_loop(const kvt_tokenizer *t, scratch *w, const char *s, cand_fn add)
{
    int rc = KVT_OK;
    while (w->h.n && !rc) {
        cand c = heap_pop(&w->h);
        sym *l = &w->syms[c.left], *r = &w->syms[c.right];
        if (!l->n || !r->n || l->n + r->n != c.size) continue;
        l->n += r->n;
        r->n = 0;
        l->id = c.id;
        l->next = r->next;
        if (r->next >= 0) w->syms[r->next].prev = c.left;
        rc = add(t, w, s, l->prev, c.left);
        if (!rc) rc = add(t, w, s, c.left, l->next);
    }
    return rc;
}

/* Emit the surviving symbols: their token, else each byte's token. */
static int emit_symbols(const kvt_tokenizer *t, scratch *w, const char *s, ivec *o)
{
    int rc = KVT_OK;
    for (int32_t i = 0; i >= 0 && !rc; i = w->syms[i].next) {
        const sym *y = &w->syms[i];
        int32_t id = y->id >= 0 ? y->id : y->id == -2 ? lookup(t, s + y->off, y->n) : -1;
        if (id >= 0) { rc = ivec_push(o, id); continue; }
        for (uint32_t k = 0; k < y->n && !rc; k++) {
            int32_t b = t->byte_tok[(uint8_t)s[y->off + k]];
            if (b >= 0) rc = ivec_push(o, b);
        }
    }
    return rc;
}

static int spm_encode(const kvt_tokenizer *t, scratch *w, const char *s, size_t n, bool prefix, ivec *o)
{
    size_t spaces = 0;
    for (size_t i = 0; i < n; i++) spaces += s[i] == ' ';
    size_t m = n + 2 * spaces + (prefix ? 3 : 0);
    int rc;
    KVT_GROW(w->buf, &w->buf_cap, m, rc);
    if (rc) return rc;
    char *e = w->buf;
    size_t k = 0;
    if (prefix) { memcpy(e, SP_MARK, 3); k = 3; }
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') { memcpy(e + k, SP_MARK, 3); k += 3; }
        else e[k++] = s[i];
    }
    /* One symbol per UTF-8 character, a lone byte where none is well formed
     * (llama.cpp trusts the lead byte, which lets an invalid lead swallow the
     * start of a following escaped space and breaks the round trip; for valid
     * UTF-8 both agree). id -2: look the symbol up when it is emitted. */
    size_t ns = 0;
    for (size_t i = 0; i < m; i += char_len(e + i, m - i)) ns++;
    if (KVT_GROW(w->syms, &w->syms_cap, ns, rc), rc) return rc;
    size_t i = 0;
    for (size_t j = 0; j < ns; j++) {
        size_t len = char_len(e + i, m - i);
        w->syms[j] = (sym){(int32_t)j - 1, j + 1 < ns ? (int32_t)j + 1 : -1, -2, (uint32_t)i, (uint32_t)len};
        i += len;
    }
    w->h.n = 0;
    for (size_t j = 1; j < ns && !rc; j++) rc = spm_candidate(t, w, e, (int32_t)j - 1, (int32_t)j);
    if (!rc) rc = merge_loop(t, w, e, spm_candidate);
    if (!rc && ns) rc = emit_symbols(t, w, e, o);
    return rc;
}

static int bpe_candidate(const kvt_tokenizer *t, scratch *w, const char *s, int32_t l, int32_t r)
{
    (void)s;
    if (l < 0 || r < 0 || w->syms[l].id < 0 || w->syms[r].id < 0) return KVT_OK;
    int32_t rank = merge_rank(t, w->syms[l].id, w->syms[r].id);
    if (rank < 0) return KVT_OK;
    uint64_t key = (uint64_t)(uint32_t)rank << 32 | (uint32_t)l;
    return heap_push(&w->h, (cand){key, l, r, t->merges[rank].result, w->syms[l].n + w->syms[r].n});
}

/* One pre-tokenized word: a symbol per byte (raw: per UTF-8 character, its
 * token or none), merged by rank. */
static int bpe_word(const kvt_tokenizer *t, scratch *w, const char *s, size_t n, ivec *o)
{
    int rc;
    KVT_GROW(w->syms, &w->syms_cap, n, rc);
    if (rc) return rc;
    size_t ns = 0;
    for (size_t j = 0; j < n; ns++) {
        size_t k = t->raw ? char_len(s + j, n - j) : 1;
        int32_t id = t->raw ? lookup(t, s + j, k) : t->byte_tok[(uint8_t)s[j]];
        w->syms[ns] = (sym){(int32_t)ns - 1, j + k < n ? (int32_t)ns + 1 : -1, id, (uint32_t)j, (uint32_t)k};
        j += k;
    }
    w->h.n = 0;
    for (size_t j = 1; j < ns && !rc; j++) rc = bpe_candidate(t, w, s, (int32_t)j - 1, (int32_t)j);
    if (!rc) rc = merge_loop(t, w, s, bpe_candidate);
    if (!rc && n) rc = emit_symbols(t, w, s, o);
    return rc;
}

/* Apply the pre-tokenizer regexes in turn; each splits every piece into its
 * matches and the text between them. */
static int pretokenize(const kvt_tokenizer *t, scratch *w, const char *s, size_t n)
{
    w->pieces.n = 0;
    int rc = fvec_push(&w->pieces, 0, n, -1);
    for (int r = 0; r < t->n_re && !rc; r++) {
        w->tmp.n = 0;
        for (size_t p = 0; p < w->pieces.n && !rc; p++) {
            const char *sub = s + w->pieces.v[p].off;
            size_t len = w->pieces.v[p].len, base = w->pieces.v[p].off, pos = 0, prev = 0;
            while (pos < len && !rc) {
                int m = pcre2_match(t->re[r], (PCRE2_SPTR)sub, len, pos, 0, w->md, NULL);
                if (m == PCRE2_ERROR_NOMATCH) break;
                if (m < 0) {
                    PCRE2_UCHAR msg[160];
                    pcre2_get_error_message(m, msg, sizeof msg);
                    return kvt_fail(KVT_EINVAL, "tokenizer: pre-tokenizer regex %d failed: %s",
                                    r, (const char *)msg);
                }
                PCRE2_SIZE *ov = pcre2_get_ovector_pointer(w->md);
                size_t ms = ov[0], me = ov[1];
                if (ms > prev) rc = fvec_push(&w->tmp, base + prev, ms - prev, -1);
                if (!rc && me > ms) rc = fvec_push(&w->tmp, base + ms, me - ms, -1);
                prev = me > ms ? me : prev;
                pos = me > ms ? me : ms + 1; /* no pattern matches empty; never loop */
            }
            if (!rc && prev < len) rc = fvec_push(&w->tmp, base + prev, len - prev, -1);
        }
        fvec x = w->pieces;
        w->pieces = w->tmp;
        w->tmp = x;
    }
    return rc;
}

/* The token whose text is the piece s[0..n) (byte-level: in GPT-2 byte
 * characters), or -1. */
static int32_t whole_piece(const kvt_tokenizer *t, scratch *w, const char *s, size_t n)
{
    if (t->raw) return lookup(t, s, n);
    int rc;
    if (KVT_GROW(w->enc, &w->enc_cap, 2 * n, rc), rc) return -1; /* then merge as usual */
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += put_utf8(w->enc + k, byte_to_cp((uint8_t)s[i]));
    return lookup(t, w->enc, k);
}

/* Raw BPE (gemma4) first writes every space as U+2581 (llama.cpp's
 * escape_whitespaces). A piece that is a token's text is that token with
 * ignore_merges (llama3), and for gemma4 when it is all line feeds
 * (llama.cpp's fix for Gemma 4); any other piece is merged. */
static int bpe_encode(const kvt_tokenizer *t, scratch *w, const char *s, size_t n, ivec *o)
{
    int rc;
    if (t->raw) {
        size_t spaces = 0;
        for (size_t i = 0; i < n; i++) spaces += s[i] == ' ';
        if (KVT_GROW(w->buf, &w->buf_cap, n + 2 * spaces, rc), rc) return rc;
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            if (s[i] == ' ') { memcpy(w->buf + k, SP_MARK, 3); k += 3; }
            else w->buf[k++] = s[i];
        }
        s = w->buf;
        n = k;
    }
    rc = pretokenize(t, w, s, n);
    for (size_t p = 0; p < w->pieces.n && !rc; p++) {
        const char *ps = s + w->pieces.v[p].off;
        size_t pn = w->pieces.v[p].len;
        bool whole = t->ignore_merges;
        if (t->raw) {
            whole = true;
            for (size_t i = 0; i < pn && whole; i++) whole = ps[i] == '\n';
        }
        int32_t id = whole ? whole_piece(t, w, ps, pn) : -1;
        rc = id >= 0 ? ivec_push(o, id) : bpe_word(t, w, ps, pn, o);
    }
    return rc;
}

int kvt_tokenizer_encode(const kvt_tokenizer *t, const char *text, size_t len,
                         bool add_bos, bool parse_special, int32_t **out, size_t *n)
{
    if (!t || !out || !n || (!text && len)) return kvt_fail(KVT_EINVAL, "tokenizer: encode: NULL argument");
    *out = NULL;
    *n = 0;
    if (len > MAX_TEXT)
        return kvt_fail(KVT_EINVAL, "tokenizer: text of %zu bytes is longer than %zu", len, MAX_TEXT);
    if (add_bos && t->bos < 0) return kvt_fail(KVT_EINVAL, "tokenizer: BOS requested but none defined");
    ivec o = {0};
    fvec frags = {0};
    scratch w = {0};
    int rc = add_bos ? ivec_push(&o, t->bos) : KVT_OK;
    if (!rc && len) rc = partition(t, text, len, parse_special, &frags);
    if (!rc && t->model == MODEL_BPE && !(w.md = pcre2_match_data_create(1, NULL)))
        rc = kvt_fail(KVT_ENOMEM, "tokenizer: out of memory for pcre2 match data");
    bool after_special = true; /* SPM: the dummy prefix goes at the start and after specials */
    for (size_t f = 0; f < frags.n && !rc; f++) {
        const frag *fr = &frags.v[f];
        const char *s = text + fr->off;
        if (fr->id >= 0) {
            rc = ivec_push(&o, fr->id);
            after_special = true;
            continue;
        }
        if (t->model == MODEL_SPM) rc = spm_encode(t, &w, s, fr->len, t->add_space_prefix && after_special, &o);
        else if (t->model == MODEL_BPE) rc = bpe_encode(t, &w, s, fr->len, &o);
        else for (size_t i = 0; i < fr->len && !rc; i++) rc = ivec_push(&o, (uint8_t)s[i]);
        after_special = false;
    }
    free(frags.v);
    free(w.syms);
    free(w.h.v);
    free(w.buf);
    free(w.enc);
    free(w.pieces.v);
    free(w.tmp.v);
    pcre2_match_data_free(w.md);
    if (!rc && !o.v && !(o.v = kvt_malloc(sizeof *o.v))) rc = KVT_ENOMEM;
    if (rc) { free(o.v); return rc; }
    *out = o.v;
    *n = o.n;
    return KVT_OK;
}

/* ---- decoding ------------------------------------------------------------- */

int kvt_tokenizer_piece(const kvt_tokenizer *t, int32_t id, const char **bytes, size_t *len)
{
    if (!t || !bytes || !len) return kvt_fail(KVT_EINVAL, "tokenizer: piece: NULL argument");
    if (id < 0 || (uint32_t)id >= t->n_vocab)
        return kvt_fail(KVT_EINVAL, "tokenizer: token id %d outside the vocabulary (%u)", id, t->n_vocab);
    *bytes = t->piece + t->piece_off[id];
    *len = t->piece_off[id + 1] - t->piece_off[id];
    return KVT_OK;
}

int kvt_tokenizer_decode(const kvt_tokenizer *t, const int32_t *ids, size_t n, char **out, size_t *len)
{
    if (!t || !out || !len || (!ids && n)) return kvt_fail(KVT_EINVAL, "tokenizer: decode: NULL argument");
    *out = NULL;
    *len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || (uint32_t)ids[i] >= t->n_vocab)
            return kvt_fail(KVT_EINVAL, "tokenizer: decode: token %zu is %d, outside the "
                            "vocabulary (%u)", i, ids[i], t->n_vocab);
        total += t->piece_off[ids[i] + 1] - t->piece_off[ids[i]];
    }
    char *s = kvt_malloc(total + 1);
    if (!s) return KVT_ENOMEM;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        const char *p = t->piece + t->piece_off[ids[i]];
        size_t k = t->piece_off[ids[i] + 1] - t->piece_off[ids[i]];
        /* The dummy prefix: one space the SPM encoder put before the text. */
        if (i == 0 && t->model == MODEL_SPM && t->add_space_prefix && k && p[0] == ' ') { p++; k--; }
        memcpy(s + o, p, k);
        o += k;
    }
    s[o] = 0;
    *out = s;
    *len = o;
    return KVT_OK;
}
