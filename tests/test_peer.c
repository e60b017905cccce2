/* kvtier's tokenizers against llama.cpp itself, id for id.
 *
 *   peer_tokenizer_vocabs  for each of ../shared/vocab/ggml-vocab-{llama-spm,
 *                          deepseek-llm,gpt-2}.gguf, ../shared/models/
 *                          stories260K.gguf, "deepseek-v3" (below) and
 *                          llama.cpp's models/ggml-vocab-{llama-bpe,qwen2,
 *                          qwen35,gemma-4,starcoder,refact,command-r,mpt,
 *                          falcon,deepseek-coder,phi-3,gpt-neox,aquila}.gguf
 *                          from the peer's source bundle (tests/
 *                          test_tokenizer.c's kvt_test_bundle_vocab):
 *                          kvt_tokenizer_encode (no BOS) gives the ids
 *                          llama_tokenize gives (add_special = false) on the
 *                          same text, with parse_special false and true
 *
 * There is no DeepSeek-V3/V4 vocab file, so "deepseek-v3" is a copy of the
 * deepseek-llm one written to the temp dir with tokenizer.ggml.pre =
 * "deepseek-v3" and a few probe merges (probe_merges: without them that
 * vocabulary cannot show where the new regexes split), run with
 * deepseek-llm's cases plus deepseek_v3_texts. Negative controls, each a
 * change to re_deepseek_v3 in src/text/tokenizer.c run by hand, and the cases of
 * deepseek-v3 (9896) that then differ: the "[\r\n]*" dropped 8; the third
 * regex first and the digit one last 4; PCRE2's \s for WS 2; no \p{M} 2;
 * no CJK regex 4; no first alternative 8; \p{N}+ for \p{N}{1,3} 6; U+00A0
 * and U+3000 kept out of the word prefix 4; deepseek-llm's list 42.
 *
 * gemma-4-no-lf-merges is gemma-4 without its line-feed merges (see
 * write_without_lf_merges). Negative controls for the bundle's
 * vocabularies, each a change to src/text/tokenizer.c run by hand, and the cases
 * that then differ (of the .out files in tests/test_tokenizer.c; here):
 * llama3 \p{N}+ for \p{N}{1,3} 8; 26. llama3 without ignore_merges 1; 2.
 * qwen2 " ?\p{L}+" for [^\r\n\p{L}\p{N}]?\p{L}+ 3; 42. qwen35 \p{L}+ for
 * [\p{L}\p{M}]+ 0; 4. qwen35 without [\r\n]* after punctuation 0; 12.
 * starcoder without its \p{N} pass 1; 6 each for starcoder, refact and
 * command-r. falcon without [0-9][0-9][0-9] 8; 26. default without \p{N}+
 * (no .out); 14 gpt-neox, 18 aquila. deepseek-coder without its \p{N} pass
 * 1; 4. gemma4 \n for \n+ 3; 18. gemma4 merging line-feed runs instead of
 * looking them up 0; 18 (gemma-4-no-lf-merges). No override_types (no .out
 * case); qwen2 1, qwen35 1, gemma-4 8, deepseek-coder 10, phi-3 43, aquila
 * 1. No Phi-3 whitespace stripping 0; 40. \p{N}+ for a lone \p{N} in
 * qwen2, qwen35, starcoder or deepseek-coder changes nothing: none of
 * these vocabularies has a token of two digits.
 *
 * The peer is the llama.cpp that node-llama-cpp ships prebuilt
 * (@node-llama-cpp/linux-x64, CPU build), driven by tests/peer/tokenize.mjs:
 * the GGUF's vocabulary only (vocab_only), one JSON array of ids per case.
 * The cases of a vocabulary, each run with parse_special false and true:
 *   - every case of its .inp file (llama.cpp's vocab test data), when it has one
 *   - the text of every user-defined token (type 4; at most MAX_USER, evenly
 *     spaced over the ids when there are more; deepseek-llm's 2398 all fit),
 *     inside a sentence and glued to letters on both sides, and pairs of
 *     them back to back: llama.cpp's partition splits these out whatever
 *     parse_special says
 *   - the text of control (3) and unknown (2) tokens (at most MAX_CONTROL)
 *     inside text, and next to a user-defined token: split out only with
 *     parse_special
 *   - a few words with non-ASCII letters ("Ünïcödé wörds", "Führer", ...),
 *     and texts llama.cpp makes special by their text ("</s>", "<|im_end|>")
 *   - for the bundle's vocabularies also deepseek_v3_texts (digit runs, CJK,
 *     marks, punctuation, code, every kind of whitespace)
 * Only valid UTF-8 goes in: on invalid UTF-8 kvtier differs on purpose (see
 * src/text/tokenizer.c), and a token text that is not valid UTF-8 is left out
 * (counted in the report).
 *
 * Requirements: linux x86_64, node and npm on PATH, and the packages of
 * tests/peer/package-lock.json, installed with `npm ci --omit=optional` on
 * first use (about 85 MB; the optional CUDA/Vulkan builds, 600 MB more, are
 * not needed for a CPU tokenizer). The test skips, saying why, when any of
 * these is missing, when npm ci fails (offline), or when none of the vocab
 * files is there; KVT_PEER=0 skips it too. KVT_PEER_ALL=1 tries every
 * user-defined, control and unknown token instead of at most MAX_USER and
 * MAX_CONTROL. Run from the repository root. About 40 s after the install
 * (one node process per vocabulary, about 1-5 s each). */
#include "fixture.h"
#include "test.h"
#include "text/tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define PEER_SCRIPT FX_PEER_DIR "/tokenize.mjs"
#define MAX_USER 4096     /* user-defined tokens tried per vocabulary */
#define MAX_CONTROL 40    /* control + unknown tokens tried per vocabulary */
#define MAX_PAIRS 50      /* back-to-back pairs of user-defined tokens */
#define MAX_REPORT 12     /* differing cases printed per vocabulary */

/* ---- the peer: availability (the install is fx_peer_ensure) ---- */

static const char *skip_reason(void)
{
    const char *why = fx_peer_skip_reason();
    if (why) return why;
    if (system("command -v node >/dev/null 2>&1") != 0) return "node is not on PATH";
    if (access(PEER_SCRIPT, R_OK) != 0) return "run from the repository root (" PEER_SCRIPT " not found)";
    return NULL;
}

/* ---- cases ---- */

enum kind { K_INP, K_USER, K_CONTROL, K_TEXT, K_PRE, N_KINDS };
static const char *const kind_name[N_KINDS] = {".inp", "user-defined", "control/unknown", "text",
                                               "pre-tokenizer"};

typedef struct pcase {
    char *text;
    size_t len;
    bool special;
    enum kind kind;
} pcase;

typedef struct caseset {
    pcase *v;
    size_t n, cap;
    json_t *json;            /* [{"text": ..., "special": ...}, ...] in the same order */
    size_t n_kind[N_KINDS];
    size_t n_invalid;        /* texts left out: not valid UTF-8 */
    bool oom;
} caseset;

/* Add text (len bytes) twice, with parse_special false and true. Text that
 * is not valid UTF-8 (json_stringn refuses it) is counted and left out. */
static void add2(caseset *cs, enum kind kind, const char *text, size_t len)
{
    json_t *probe = json_stringn(text, len);
    if (!probe) { cs->n_invalid++; return; }
    json_decref(probe);
    for (int sp = 0; sp < 2; sp++) {
        if (cs->n == cs->cap) {
            size_t cap = cs->cap ? cs->cap * 2 : 256;
            pcase *v = realloc(cs->v, cap * sizeof *v);
            if (!v) { cs->oom = true; return; }
            cs->v = v;
            cs->cap = cap;
        }
        char *copy = malloc(len + 1);
        json_t *o = json_pack("{s:s%,s:b}", "text", text, len, "special", sp);
        if (!copy || !o || json_array_append_new(cs->json, o)) {
            free(copy);
            cs->oom = true;
            return;
        }
        memcpy(copy, text, len);
        copy[len] = 0;
        cs->v[cs->n++] = (pcase){copy, len, sp == 1, kind};
        cs->n_kind[kind]++;
    }
}

/* add2 of a + b + c (b: len bytes; a and c NUL-terminated). */
static void add2_around(caseset *cs, enum kind kind, const char *a, const char *b, size_t len, const char *c)
{
    size_t la = strlen(a), lc = strlen(c);
    char *s = malloc(la + len + lc + 1);
    if (!s) { cs->oom = true; return; }
    memcpy(s, a, la);
    memcpy(s + la, b, len);
    memcpy(s + la + len, c, lc);
    add2(cs, kind, s, la + len + lc);
    free(s);
}

static void caseset_free(caseset *cs)
{
    for (size_t i = 0; i < cs->n; i++) free(cs->v[i].text);
    free(cs->v);
    json_decref(cs->json);
}

/* Every case of the vocab's .inp file ip (split as tests/test_tokenizer.c does). */
static void add_inp_cases(caseset *cs, const char *ip)
{
    size_t ilen;
    char *inp = kvt_test_read_file(ip, &ilen);
    if (!inp) return;
    static const char sep[] = "\n__ggml_vocab_test__\n";
    size_t pos = 0;
    while (pos < ilen) {
        const char *next = strstr(inp + pos, sep);
        size_t clen = next ? (size_t)(next - (inp + pos)) : ilen - pos;
        add2(cs, K_INP, inp + pos, clen);
        pos = next ? (size_t)(next - inp) + sizeof sep - 1 : ilen;
    }
    free(inp);
}

/* Up to max ids of ids[0..n), evenly spaced, in id order (all when n <= max). */
static size_t pick(const uint32_t *ids, size_t n, size_t max, uint32_t *out)
{
    size_t k = n < max ? n : max;
    for (size_t i = 0; i < k; i++) out[i] = ids[(size_t)((uint64_t)i * n / k)];
    return k;
}

typedef struct vocabinfo {
    size_t n_tokens, n_user, n_control, n_unknown; /* in the whole vocabulary */
    size_t user_tried, control_tried;
} vocabinfo;

/* The token-text cases: user-defined, control and unknown tokens in text. */
static int add_token_cases(caseset *cs, const kvt_gguf *g, vocabinfo *vi)
{
    const kvt_gguf_val *tok = NULL, *typ = NULL;
    size_t n_tok = 0, n_typ = 0;
    int rc = kvt_gguf_get_arr(g, "tokenizer.ggml.tokens", KVT_GGUF_STR, &tok, &n_tok);
    if (rc) return rc;
    vi->n_tokens = n_tok;
    rc = kvt_gguf_get_arr(g, "tokenizer.ggml.token_type", KVT_GGUF_I32, &typ, &n_typ);
    if (rc == KVT_ENOENT) return KVT_OK; /* every token normal: nothing to split out */
    if (rc) return rc;
    if (n_typ != n_tok) return KVT_EFORMAT;

    uint32_t *user = malloc(n_tok * sizeof *user), *ctrl = malloc(n_tok * sizeof *ctrl);
    size_t max_user = MAX_USER, max_control = MAX_CONTROL;
    if (fx_env_is("KVT_PEER_ALL", "1")) max_user = max_control = n_tok;
    uint32_t *pu = malloc(max_user * sizeof *pu), *pc = malloc(max_control * sizeof *pc);
    if (!user || !ctrl || !pu || !pc) { free(user); free(ctrl); free(pu); free(pc); return KVT_ENOMEM; }
    size_t nu = 0, nc = 0;
    for (size_t i = 0; i < n_tok; i++) {
        if (tok[i].n == 0) continue;
        int64_t t = typ[i].v.i;
        if (t == 4) { user[nu++] = (uint32_t)i; vi->n_user++; }
        else if (t == 3 || t == 2) {
            ctrl[nc++] = (uint32_t)i;
            if (t == 3) vi->n_control++;
            else vi->n_unknown++;
        }
    }
    size_t ku = pick(user, nu, max_user, pu), kc = pick(ctrl, nc, max_control, pc);
    vi->user_tried = ku;
    vi->control_tried = kc;

    for (size_t i = 0; i < ku; i++) {
        const kvt_gguf_val *t = &tok[pu[i]];
        add2_around(cs, K_USER, "The word ", t->v.str, t->n, " is here.");
        add2_around(cs, K_USER, "x", t->v.str, t->n, "y");
    }
    for (size_t i = 0; i + 1 < ku && i < MAX_PAIRS; i++) {
        const kvt_gguf_val *a = &tok[pu[i]], *b = &tok[pu[ku - 1 - i]];
        char *s = malloc(a->n + b->n);
        if (!s) { cs->oom = true; break; }
        memcpy(s, a->v.str, a->n);
        memcpy(s + a->n, b->v.str, b->n);
        add2_around(cs, K_USER, "", s, a->n + b->n, " ok");
        free(s);
    }
    for (size_t i = 0; i < kc; i++) {
        const kvt_gguf_val *t = &tok[pc[i]];
        add2_around(cs, K_CONTROL, "Hello ", t->v.str, t->n, " world");
        add2_around(cs, K_CONTROL, "a", t->v.str, t->n, "b");
        add2_around(cs, K_CONTROL, "", t->v.str, t->n, "");
        if (ku) { /* a control token right before a user-defined one */
            const kvt_gguf_val *u = &tok[pu[i % ku]];
            char *s = malloc(t->n + u->n);
            if (!s) { cs->oom = true; break; }
            memcpy(s, t->v.str, t->n);
            memcpy(s + t->n, u->v.str, u->n);
            add2_around(cs, K_CONTROL, "go ", s, t->n + u->n, "!");
            free(s);
        }
    }
    free(user);
    free(ctrl);
    free(pu);
    free(pc);
    return cs->oom ? KVT_ENOMEM : KVT_OK;
}

static void add_text_cases(caseset *cs)
{
    static const char *const texts[] = {
        "\xc3\x9cn\xc3\xaf" "c\xc3\xb6" "d\xc3\xa9 w\xc3\xb6rds",  /* Ünïcödé wörds */
        "F\xc3\xbchrer",                                        /* Führer */
        "Der F\xc3\xbchrerschein, \xc3\xa0 la fa\xc3\xa7on, na\xc3\xafve caf\xc3\xa9s.",
        "\xc3\xbc\xc3\xb6\xc3\xa4\xc3\x9f \xc3\x9c\xc3\x96\xc3\x84",  /* üöäß ÜÖÄ */
        "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xd0\xbf\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82 "
        "\xf0\x9f\x98\x80!",                                     /* 日本語 привет 😀! */
        "  two  spaces\t\ttabs\n\nnewlines  ",
        /* texts llama.cpp makes control (or user-defined, or normal again)
         * whatever the GGUF's token type says, see override_types in
         * src/text/tokenizer.c: qwen2's normal "</s>" splits out with parse_special */
        "a</s>b <|endoftext|>c<|im_end|> <|end|>  <eos>\n<turn|> <|tool_response> x",
        "<\xef\xbd\x9c" "fim\xe2\x96\x81" "begin\xef\xbd\x9c>x<|fim_prefix|> <PAD> [PAD] <|file_sep|>"
        "<|channel|> <|return|><|call|>",
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) add2(cs, K_TEXT, texts[i], strlen(texts[i]));
}

/* Texts aimed at the deepseek-v3 pre-tokenizer's three regexes (digit runs,
 * CJK/kana runs, then punctuation + letters, letters + marks, punctuation and
 * symbol runs with their line breaks, and the whitespace alternatives). */
static const char *const deepseek_v3_texts[] = {
    /* \p{N}{1,3}: ASCII, Arabic-Indic, fullwidth, Devanagari digits; No/Nl */
    "1 12 123 1234 12345 123456 1234567",
    "x1234567y 3.14159 2024-01-15 1,000,000 0x7fff",
    /* ١٢٣٤ ١٢٣٤٥٦٧ */
    "\xd9\xa1\xd9\xa2\xd9\xa3\xd9\xa4 \xd9\xa1\xd9\xa2\xd9\xa3\xd9\xa4\xd9\xa5\xd9\xa6\xd9\xa7",
    /* １２３ １２３４５ */
    "\xef\xbc\x91\xef\xbc\x92\xef\xbc\x93 \xef\xbc\x91\xef\xbc\x92\xef\xbc\x93\xef\xbc\x94\xef\xbc\x95",
    /* abc١٢٣٤def 12３４5 १२३४ */
    "abc\xd9\xa1\xd9\xa2\xd9\xa3\xd9\xa4" "def 12\xef\xbc\x93\xef\xbc\x94" "5 \xe0\xa5\xa7\xe0\xa5\xa8\xe0\xa5"
    "\xa9\xe0\xa5\xaa",
    "cols  1  22   333\t\t4444  \xef\xbc\x95 x", /* runs of spaces before digits */
    "x\xc2\xb2 \xc2\xbd \xe2\x85\xb7 \xe3\x80\x87\xe4\xb8\x80\xe4\xba\x8c", /* x² ½ ⅷ 〇一二 */
    /* [一-龥぀-ゟ゠-ヿ]+ next to Latin, Hangul, halfwidth kana, CJK punctuation */
    /* 我爱Python编程，日本語のテキスト。 */
    "\xe6\x88\x91\xe7\x88\xb1Python\xe7\xbc\x96\xe7\xa8\x8b\xef\xbc\x8c\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa"
    "\x9e\xe3\x81\xae\xe3\x83\x86\xe3\x82\xad\xe3\x82\xb9\xe3\x83\x88\xe3\x80\x82",
    /* 東京タワーはTokyo Towerです123 */
    "\xe6\x9d\xb1\xe4\xba\xac\xe3\x82\xbf\xe3\x83\xaf\xe3\x83\xbc\xe3\x81\xafTokyo Tower\xe3\x81\xa7\xe3"
    "\x81\x99" "123",
    /* ひらがなカタ・カナ漢字ABC 日本語のPython ｶﾀｶﾅ */
    "\xe3\x81\xb2\xe3\x82\x89\xe3\x81\x8c\xe3\x81\xaa\xe3\x82\xab\xe3\x82\xbf\xe3\x83\xbb\xe3\x82\xab\xe3"
    "\x83\x8a\xe6\xbc\xa2\xe5\xad\x97" "ABC \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xaePython \xef\xbd"
    "\xb6\xef\xbe\x80\xef\xbd\xb6\xef\xbe\x85",
    /* 한국어 一龥龦 “引号”、 */
    "\xed\x95\x9c\xea\xb5\xad\xec\x96\xb4 \xe4\xb8\x80\xe9\xbe\xa5\xe9\xbe\xa6 \xe2\x80\x9c\xe5\xbc\x95"
    "\xe5\x8f\xb7\xe2\x80\x9d\xe3\x80\x81",
    /* runs of spaces before CJK and kana: split off first: a  日本   カナ\t\tか b */
    "a  \xe6\x97\xa5\xe6\x9c\xac   \xe3\x82\xab\xe3\x83\x8a\t\t\xe3\x81\x8b b",
    /* punctuation followed by ASCII letters */
    "it's John's 'quoted' \"double\" don't I'M",
    "obj.method().field #include <stdio.h> @Override public $var = $_GET['x'];",
    "foo::bar->baz a+b=c -flag --long-option ~/path/to/file_name.txt",
    "50% off!!! ...wait?! <div class=\"x\">text</div> [link](http://ex.com/a?b=c&d=e)",
    ".\xc3\xa9t\xc3\xa9 #\xd0\xbf\xd1\x80\xd0\xb8 'caf\xc3\xa9", /* .été #при 'café */
    /* combining marks: e + U+0301, a mark after a space and at the start, scripts with marks */
    "e\xcc\x81 cafe\xcc\x81 nai\xcc\x88ve \xcc\x81" "abc a \xcc\x81",
    /* हिन्दी नमस्ते */
    "\xe0\xa4\xb9\xe0\xa4\xbf\xe0\xa4\xa8\xe0\xa5\x8d\xe0\xa4\xa6\xe0\xa5\x80 \xe0\xa4\xa8\xe0\xa4\xae"
    "\xe0\xa4\xb8\xe0\xa5\x8d\xe0\xa4\xa4\xe0\xa5\x87",
    /* ภาษาไทย สวัสดี */
    "\xe0\xb8\xa0\xe0\xb8\xb2\xe0\xb8\xa9\xe0\xb8\xb2\xe0\xb9\x84\xe0\xb8\x97\xe0\xb8\xa2 \xe0\xb8\xaa"
    "\xe0\xb8\xa7\xe0\xb8\xb1\xe0\xb8\xaa\xe0\xb8\x94\xe0\xb8\xb5",
    /* مَرْحَبًا שׁלוֹם */
    "\xd9\x85\xd9\x8e\xd8\xb1\xd9\x92\xd8\xad\xd9\x8e\xd8\xa8\xd9\x8b\xd8\xa7 \xd7\xa9\xd7\x81\xd6\xb8"
    "\xd7\x9c\xd7\x95\xd6\xb9\xd7\x9d",
    /* 1⃣ #️⃣ Zalgo */
    "1\xe2\x83\xa3 #\xef\xb8\x8f\xe2\x83\xa3 Z\xcc\xa4\xcd\x94\xcd\xa7\xcc\x91" "a\xcc\x9dl\xcd\x89g\xcc\xb3"
    "o",
    /* symbols and emoji (ZWJ is Cf, VS16 is Mn, skin tones are Sk) */
    /* 😀😃 👍🏽 👨‍👩‍👧 ❤️ 🇺🇸! */
    "\xf0\x9f\x98\x80\xf0\x9f\x98\x83 \xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd \xf0\x9f\x91\xa8\xe2\x80\x8d\xf0"
    "\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7 \xe2\x9d\xa4\xef\xb8\x8f \xf0\x9f\x87\xba\xf0\x9f\x87\xb8!",
    /* ✓ ™ © €50 £ ¥1000 ∑∞≠→★ x²+y², ∀x∈ℝ */
    "\xe2\x9c\x93 \xe2\x84\xa2 \xc2\xa9 \xe2\x82\xac" "50 \xc2\xa3 \xc2\xa5" "1000 \xe2\x88\x91\xe2\x88\x9e\xe2"
    "\x89\xa0\xe2\x86\x92\xe2\x98\x85 x\xc2\xb2+y\xc2\xb2, \xe2\x88\x80x\xe2\x88\x88\xe2\x84\x9d",
    /* word😀word 😀\r\n!!… —dash— */
    "word\xf0\x9f\x98\x80word \xf0\x9f\x98\x80\r\n!!\xe2\x80\xa6 \xe2\x80\x94" "dash\xe2\x80\x94",
    /* \r\n, and runs of spaces and tabs before line breaks and at the end */
    "line1\r\nline2\r\n\r\nline3\r\n",
    "Done.\nNext;\n\nKey:\n\tvalue!\r\n{\n} a \nb \t\n\r\n",
    "a\r\rb\n\rc;\r\n\r\n} !!!\r\n\r\n x.\n\n\n",
    "  \r\n  \r\n\t\r\n \n",
    "a   \n   b trailing   ",
    "tabs\t\t\n\t\tindent \t \n end \n\n  ",
    "word  \t  word\t",
    "   ",
    /* non-ASCII whitespace: U+00A0, U+3000, U+2009, U+2028/2029, U+0085, U+202F, U+205F, U+1680;
     * U+200B and U+180E are none */
    "a\xc2\xa0" "b a\xc2\xa0\xc2\xa0" "b \xc2\xa0\n x\xc2\xa0",
    /* 　全角スペース　text　　 */
    "\xe3\x80\x80\xe5\x85\xa8\xe8\xa7\x92\xe3\x82\xb9\xe3\x83\x9a\xe3\x83\xbc\xe3\x82\xb9\xe3\x80\x80text"
    "\xe3\x80\x80\xe3\x80\x80",
    "x \xc2\x85 y \xc2\x85\n z\xc2\x85 \xc2\x85\xc2\x85",
    "a\xe1\xa0\x8e\nb \xe1\xa0\x8e\n \xe1\xa0\x8e" "c\xe1\xa0\x8e",
    "thin\xe2\x80\x89space x\xe2\x80\xa8y\xe2\x80\xa9z nel\xc2\x85x a\xe2\x80\xaf" "b\xe2\x81\x9f" "c \xe1\x9a"
    "\x80ogham",
    "a\xe2\x80\x8b" "b \xe2\x80\x89\xe2\x80\x89\n\xe3\x80\x80!! \xc2\xa0$x \x1c\x1f y",
    /* code */
    "def foo(x):\n    if x > 0:\n        return x ** 2  # square\n    else:\n        return -x\n\n\nprint"
    "(foo(12345))\n",
    "#include <stdio.h>\n\nint main(void) {\n\tfor (int i = 0; i < 1000; i++) {\n\t\tprintf(\"%d\\n\", i)"
    ";\n\t}\n\treturn 0;\n}\n",
    "const f = (a, b) => { return a?.b ?? 'x'; };\r\n    // \xe6\xb3\xa8\xe9\x87\x8a: sum\r\n\tint s = 0;"
    " /* \xe6\x97\xa5\xe6\x9c\xac */  \r\n",
};

/* ---- running the peer and comparing ---- */

/* `node tokenize.mjs model cases.json` with stdout in out and stderr in err. */
static bool run_peer(const char *model, const char *cases, const char *out, const char *err)
{
    const char *argv[] = {"sh", "-c", "exec node \"$0\" \"$1\" \"$2\" 2>\"$3\"", PEER_SCRIPT, model, cases, err, NULL};
    int st = 0;
    int ran = fx_run(argv, out, 120.0, &st);
    if (ran < 0) { printf("    fork failed: %s\n", strerror(errno)); return false; }
    if (ran == 0) printf("    node %s: no exit within 120 s\n", PEER_SCRIPT);
    bool ok = ran > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
    if (!ok) {
        if (ran > 0)
            printf("    node %s %s: exit status %d\n", PEER_SCRIPT, model,
                   WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
        fx_print_file("stderr", err);
        fx_print_file("stdout", out);
    }
    return ok;
}

/* Merges ("left right", in GPT-2 byte characters: Ċ \n, č \r, ĉ \t, Ġ space)
 * the copy of write_with_pre gains after its last merge, in this order, each
 * with its result as a new normal token after the last id. deepseek-llm's
 * vocabulary has no token holding a line break, two digits, punctuation
 * before a letter, a letter before a mark or CJK before Latin (its own
 * pre-tokenizer never lets one form), so without these no case could tell
 * where deepseek-v3's regexes split there. None of the merges or results is
 * in that vocabulary. */
static const char *const probe_merges[][2] = {
    /* ' ?[\p{P}\p{S}]+[\r\n]*', '\s*[\r\n]+' (punctuation before \r\n, ' \n', '\t\n') */
    {". \xc4\x8a", ".\xc4\x8a"}, {"; \xc4\x8a", ";\xc4\x8a"}, {": \xc4\x8a", ":\xc4\x8a"},
    {"{ \xc4\x8a", "{\xc4\x8a"}, {"! \xc4\x8d", "!\xc4\x8d"},
    {"\xc4\x8d \xc4\x8a", "\xc4\x8d\xc4\x8a"}, {"\xc4\x8a \xc4\x8a", "\xc4\x8a\xc4\x8a"},
    {"\xc4\x8d\xc4\x8a \xc4\x8d\xc4\x8a", "\xc4\x8d\xc4\x8a\xc4\x8d\xc4\x8a"},
    {"\xc4\xa0 \xc4\x8a", "\xc4\xa0\xc4\x8a"}, {"\xc4\x89 \xc4\x8a", "\xc4\x89\xc4\x8a"},
    /* \p{N}{1,3}: "34" outranks "12": 1234 cut into threes is 123|4, left whole 12|34 */
    {"3 4", "34"}, {"1 2", "12"}, {"12 3", "123"},
    /* [!-/:-@[-`{-~][A-Za-z]+ */
    {"' s", "'s"}, {". method", ".method"}, {"# include", "#include"}, {"@ Override", "@Override"},
    {"$ var", "$var"},
    /* [\p{L}\p{M}]+: e U+0301, Devanagari NA VIRAMA */
    {"e \xc3\x8c\xc4\xa3", "e\xc3\x8c\xc4\xa3"},
    {"\xc3\xa0\xc2\xa4\xc2\xa8 \xc3\xa0\xc2\xa5\xc4\xaf", "\xc3\xa0\xc2\xa4\xc2\xa8\xc3\xa0\xc2\xa5\xc4\xaf"},
    /* the CJK/kana regex: 爱Python, のPython */
    {"\xc3\xa7\xc4\xaa\xc2\xb1 Python", "\xc3\xa7\xc4\xaa\xc2\xb1Python"},
    {"\xc3\xa3\xc4\xa3\xc2\xae Python", "\xc3\xa3\xc4\xa3\xc2\xaePython"},
    /* non-ASCII whitespace: U+00A0 and U+3000 as a word's prefix; U+0085 (bytes C2 85)
     * in a run of whitespace */
    {"\xc3\x82\xc5\x82 b", "\xc3\x82\xc5\x82" "b"},
    {"\xc3\xa3\xc4\xa2\xc4\xa2 text", "\xc3\xa3\xc4\xa2\xc4\xa2text"},
    {"\xc3\x82 \xc4\xa7", "\xc3\x82\xc4\xa7"},
    /* U+180E (bytes E1 A0 8E) before \n: whitespace to PCRE2's \s, not to llama.cpp */
    {"\xc4\xb0 \xc4\x8a", "\xc4\xb0\xc4\x8a"},
};
#define N_PROBE_MERGES (sizeof probe_merges / sizeof probe_merges[0])

/* w's key = g's array key with the k values extra appended. */
static int set_appended(kvt_gguf_writer *w, const kvt_gguf *g, const char *key, uint32_t elem,
                        const kvt_gguf_val *extra, size_t k)
{
    const kvt_gguf_val *a = NULL;
    size_t n = 0;
    int rc = kvt_gguf_get_arr(g, key, elem, &a, &n);
    kvt_gguf_val *v = rc ? NULL : malloc((n + k) * sizeof *v);
    if (!rc && !v) rc = KVT_ENOMEM;
    if (!rc) {
        memcpy(v, a, n * sizeof *v);
        memcpy(v + n, extra, k * sizeof *v);
        rc = kvt_gguf_writer_set(w, key, &(kvt_gguf_val){.type = KVT_GGUF_ARR, .elem_type = elem,
                                                         .n = n + k, .v.arr = v});
    }
    free(v);
    return rc;
}

/* src opened into *g and every key and tensor of it set in a new writer
 * *w (both to free by the caller, also on failure). */
static int copy_open(const char *src, kvt_gguf **g, kvt_gguf_writer **w)
{
    *w = kvt_gguf_writer_new();
    int rc = *w ? kvt_gguf_open(g, src) : KVT_ENOMEM;
    for (size_t i = 0; !rc && i < kvt_gguf_n_kv(*g); i++)
        rc = kvt_gguf_writer_set(*w, kvt_gguf_key(*g, i), kvt_gguf_val_at(*g, i));
    for (size_t i = 0; !rc && i < kvt_gguf_n_tensors(*g); i++) {
        const kvt_gguf_tensor *x = kvt_gguf_tensor_at(*g, i);
        rc = kvt_gguf_writer_add_tensor(*w, x->name, x->type, x->n_dims, x->ne, x->data, x->n_bytes);
    }
    return rc;
}

/* Copy the GGUF src to dst with tokenizer.ggml.pre = pre and the
 * probe_merges, every other key and tensor as it is: a vocabulary for a
 * pre-tokenizer no vocab file has. */
static int write_with_pre(const char *src, const char *pre, const char *dst)
{
    kvt_gguf *g = NULL;
    kvt_gguf_writer *w = NULL;
    int rc = copy_open(src, &g, &w);
    kvt_gguf_val tok[N_PROBE_MERGES], typ[N_PROBE_MERGES], mrg[N_PROBE_MERGES];
    for (size_t i = 0; i < N_PROBE_MERGES; i++) {
        const char *m = probe_merges[i][0], *r = probe_merges[i][1];
        mrg[i] = (kvt_gguf_val){.type = KVT_GGUF_STR, .n = strlen(m), .v.str = m};
        tok[i] = (kvt_gguf_val){.type = KVT_GGUF_STR, .n = strlen(r), .v.str = r};
        typ[i] = (kvt_gguf_val){.type = KVT_GGUF_I32, .v.i = 1};
    }
    if (!rc) rc = set_appended(w, g, "tokenizer.ggml.tokens", KVT_GGUF_STR, tok, N_PROBE_MERGES);
    if (!rc) rc = set_appended(w, g, "tokenizer.ggml.token_type", KVT_GGUF_I32, typ, N_PROBE_MERGES);
    if (!rc) rc = set_appended(w, g, "tokenizer.ggml.merges", KVT_GGUF_STR, mrg, N_PROBE_MERGES);
    if (!rc) rc = kvt_gguf_writer_set_str(w, "tokenizer.ggml.pre", pre);
    if (!rc) rc = kvt_gguf_writer_write(w, dst);
    kvt_gguf_writer_free(w);
    kvt_gguf_close(g);
    return rc;
}

/* Copy the GGUF src to dst without the merges that hold a line feed.
 * gemma-4's vocabulary merges every run of up to 31 line feeds into its
 * token, so only without those merges does llama.cpp's Gemma 4 rule (a run
 * of line feeds that is a token is that token, not merged) show. */
static int write_without_lf_merges(const char *src, const char *dst)
{
    kvt_gguf *g = NULL;
    kvt_gguf_writer *w = NULL;
    int rc = copy_open(src, &g, &w);
    const kvt_gguf_val *m = NULL;
    size_t n = 0, k = 0;
    if (!rc) rc = kvt_gguf_get_arr(g, "tokenizer.ggml.merges", KVT_GGUF_STR, &m, &n);
    kvt_gguf_val *keep = rc ? NULL : malloc((n ? n : 1) * sizeof *keep);
    if (!rc && !keep) rc = KVT_ENOMEM;
    for (size_t i = 0; !rc && i < n; i++)
        if (!memchr(m[i].v.str, '\n', m[i].n)) keep[k++] = m[i];
    if (!rc) rc = kvt_gguf_writer_set(w, "tokenizer.ggml.merges", &(kvt_gguf_val){.type = KVT_GGUF_ARR,
                                      .elem_type = KVT_GGUF_STR, .n = k, .v.arr = keep});
    if (!rc) rc = kvt_gguf_writer_write(w, dst);
    free(keep);
    kvt_gguf_writer_free(w);
    kvt_gguf_close(g);
    return rc;
}

/* One vocabulary (the GGUF at path p, its .inp at ip or NULL) against the
 * peer (with pre: a copy of it with that tokenizer.ggml.pre; with no_lf: a
 * copy without its line-feed merges; with pre_texts also deepseek_v3_texts).
 * Adds to *n_diff the cases that differ; false when the comparison could not
 * run (a message was printed). */
static bool compare_vocab(fx_server *dir, const char *name, const char *p, const char *ip,
                          const char *pre, bool no_lf, bool pre_texts, size_t *n_diff, bool *header_shown)
{
    char model[4096];
    snprintf(model, sizeof model, "%s", p);

    kvt_gguf *g = NULL;
    kvt_tokenizer *t = NULL;
    int rc = KVT_OK;
    if (pre || no_lf) {
        char src[4096];
        snprintf(src, sizeof src, "%s", model);
        snprintf(model, sizeof model, "%s/%s.gguf", dir->dir, name);
        rc = pre ? write_with_pre(src, pre, model) : write_without_lf_merges(src, model);
    }
    if (!rc) rc = kvt_gguf_open(&g, model);
    if (!rc) rc = kvt_tokenizer_from_gguf(&t, g);
    caseset cs = {.json = json_array()};
    vocabinfo vi = {0};
    if (!rc && !cs.json) rc = KVT_ENOMEM;
    if (!rc && ip) add_inp_cases(&cs, ip);
    if (!rc) rc = add_token_cases(&cs, g, &vi);
    if (!rc) add_text_cases(&cs);
    for (size_t i = 0; !rc && (pre || pre_texts) && i < sizeof deepseek_v3_texts / sizeof *deepseek_v3_texts; i++)
        add2(&cs, K_PRE, deepseek_v3_texts[i], strlen(deepseek_v3_texts[i]));
    if (!rc && cs.oom) rc = KVT_ENOMEM;
    kvt_gguf_close(g);
    if (rc) {
        printf("    %s: %s: %s\n", name, kvt_strerror(rc), kvt_errmsg());
        kvt_tokenizer_free(t);
        caseset_free(&cs);
        return false;
    }

    char cases_path[160], out_path[160], err_path[160];
    snprintf(cases_path, sizeof cases_path, "%s/%s.json", dir->dir, name);
    snprintf(out_path, sizeof out_path, "%s/%s.ids", dir->dir, name);
    snprintf(err_path, sizeof err_path, "%s/%s.err", dir->dir, name);
    bool ok = json_dump_file(cs.json, cases_path, JSON_COMPACT) == 0;
    if (!ok) printf("    %s: cannot write %s\n", name, cases_path);
    double t0 = fx_now();
    ok = ok && run_peer(model, cases_path, out_path, err_path);
    double peer_s = fx_now() - t0;
    char *out = ok ? kvt_test_read_file(out_path, NULL) : NULL;
    if (ok && !out) { printf("    %s: cannot read %s\n", name, out_path); ok = false; }

    size_t n_equal = 0, n_seen = 0, n_reported = 0;
    size_t eq_kind[N_KINDS] = {0};
    char *line = out;
    for (size_t i = 0; ok && i <= cs.n; i++) {
        char *eol = line ? strchr(line, '\n') : NULL;
        if (!line || !*line) {
            printf("    %s: the peer gave %zu answers for %zu cases\n", name, i ? i - 1 : 0, cs.n);
            ok = false;
            break;
        }
        if (eol) *eol = 0;
        json_error_t jerr;
        json_t *j = json_loads(line, 0, &jerr);
        line = eol ? eol + 1 : NULL;
        if (i == 0) { /* the header */
            if (!*header_shown && json_is_object(j)) {
                printf("    peer: %s (%s build), node-llama-cpp " FX_PEER_VERSION "\n",
                       json_string_value(json_object_get(j, "llama_cpp")),
                       json_string_value(json_object_get(j, "build")));
                *header_shown = true;
            }
            json_decref(j);
            continue;
        }
        const pcase *c = &cs.v[i - 1];
        if (!json_is_array(j)) {
            printf("    %s: answer %zu is not a JSON array: %s\n", name, i - 1, jerr.text);
            json_decref(j);
            ok = false;
            break;
        }
        size_t nw = json_array_size(j);
        int32_t *want = malloc((nw ? nw : 1) * sizeof *want);
        for (size_t k = 0; want && k < nw; k++) want[k] = (int32_t)json_integer_value(json_array_get(j, k));
        json_decref(j);
        int32_t *ids = NULL;
        size_t n = 0;
        int erc = kvt_tokenizer_encode(t, c->text, c->len, false, c->special, &ids, &n);
        bool same = want && !erc && n == nw && (n == 0 || !memcmp(ids, want, n * sizeof *ids));
        n_seen++;
        if (same) { n_equal++; eq_kind[c->kind]++; }
        else if (n_reported++ < MAX_REPORT) {
            printf("    %s: %s case, parse_special=%s: '%s' (%zu bytes) differs%s%s\n", name,
                   kind_name[c->kind], c->special ? "true" : "false", kvt_test_esc(c->text, c->len), c->len,
                   erc ? ": " : "", erc ? kvt_errmsg() : "");
            if (want) kvt_test_print_ids("llama.cpp", want, nw);
            if (!erc) kvt_test_print_ids("kvtier   ", ids, n);
        }
        free(ids);
        free(want);
    }
    free(out);
    if (ok && n_seen == cs.n) {
        if (n_reported > MAX_REPORT) printf("    %s: %zu more differing cases not shown\n", name, n_reported - MAX_REPORT);
        printf("    %s: %zu/%zu cases equal llama.cpp (peer %.1f s)\n", name, n_equal, cs.n, peer_s);
        for (int k = 0; k < N_KINDS; k++)
            if (cs.n_kind[k]) printf("      %-16s %zu/%zu\n", kind_name[k], eq_kind[k], cs.n_kind[k]);
        printf("      vocabulary: %zu tokens, %zu user-defined (%zu tried), %zu control + %zu unknown (%zu tried)",
               vi.n_tokens, vi.n_user, vi.user_tried, vi.n_control, vi.n_unknown, vi.control_tried);
        if (cs.n_invalid) printf(", %zu texts left out as invalid UTF-8", cs.n_invalid);
        printf("\n");
        *n_diff += cs.n - n_equal;
    }
    kvt_tokenizer_free(t);
    caseset_free(&cs);
    return ok;
}

/* tests/test_tokenizer.c: llama.cpp's models/FILE from the peer's source bundle. */

TEST(peer_tokenizer_vocabs)
{
    /* bundle: the files are llama.cpp's models/REL and REL.inp from the peer's
     * source bundle, not ../shared/REL; these also get deepseek_v3_texts. */
    static const struct { const char *name, *rel, *inp, *pre; bool bundle, no_lf; } vocabs[] = {
        {"llama-spm", "vocab/ggml-vocab-llama-spm.gguf", "vocab/ggml-vocab-llama-spm.gguf.inp", NULL, false},
        {"deepseek-llm", "vocab/ggml-vocab-deepseek-llm.gguf", "vocab/ggml-vocab-deepseek-llm.gguf.inp", NULL,
         false},
        /* no DeepSeek-V3/V4 vocab file: deepseek-llm's vocabulary, V3's pre-tokenizer */
        {"deepseek-v3", "vocab/ggml-vocab-deepseek-llm.gguf", "vocab/ggml-vocab-deepseek-llm.gguf.inp",
         "deepseek-v3", false},
        {"gpt-2", "vocab/ggml-vocab-gpt-2.gguf", "vocab/ggml-vocab-gpt-2.gguf.inp", NULL, false},
        {"stories260K", "models/stories260K.gguf", NULL, NULL, false},
        {"llama-bpe", "ggml-vocab-llama-bpe.gguf", "ggml-vocab-llama-bpe.gguf.inp", NULL, true},
        {"qwen2", "ggml-vocab-qwen2.gguf", "ggml-vocab-qwen2.gguf.inp", NULL, true},
        {"qwen35", "ggml-vocab-qwen35.gguf", "ggml-vocab-qwen35.gguf.inp", NULL, true},
        {"gemma-4", "ggml-vocab-gemma-4.gguf", "ggml-vocab-gemma-4.gguf.inp", NULL, true},
        /* gemma-4 without its line-feed merges (see write_without_lf_merges) */
        {"gemma-4-no-lf-merges", "ggml-vocab-gemma-4.gguf", "ggml-vocab-gemma-4.gguf.inp", NULL, true, true},
        {"starcoder", "ggml-vocab-starcoder.gguf", "ggml-vocab-starcoder.gguf.inp", NULL, true},
        {"refact", "ggml-vocab-refact.gguf", "ggml-vocab-refact.gguf.inp", NULL, true},
        {"command-r", "ggml-vocab-command-r.gguf", "ggml-vocab-command-r.gguf.inp", NULL, true},
        {"mpt", "ggml-vocab-mpt.gguf", "ggml-vocab-mpt.gguf.inp", NULL, true},
        {"falcon", "ggml-vocab-falcon.gguf", "ggml-vocab-falcon.gguf.inp", NULL, true},
        {"deepseek-coder", "ggml-vocab-deepseek-coder.gguf", "ggml-vocab-deepseek-coder.gguf.inp", NULL, true},
        {"phi-3", "ggml-vocab-phi-3.gguf", "ggml-vocab-phi-3.gguf.inp", NULL, true},
        /* no tokenizer.ggml.pre ("default"), no .inp */
        {"gpt-neox", "ggml-vocab-gpt-neox.gguf", NULL, NULL, true},
        {"aquila", "ggml-vocab-aquila.gguf", NULL, NULL, true},
    };
    const size_t n_vocabs = sizeof vocabs / sizeof vocabs[0];
    const char *why = skip_reason();
    if (why) SKIP("%s", why);
    double install_s;
    if (!fx_peer_ensure(&install_s))
        SKIP("npm ci --prefix " FX_PEER_DIR " failed (offline?): no llama.cpp peer");
    if (install_s >= 0) printf("    npm ci took %.1f s\n", install_s);

    /* Where each vocabulary's files are; a missing one is left out, and the
     * test then ends as a skip naming them (a failure in CI, tests/main.c):
     * it passes only when every one of them was compared. */
    static char model[sizeof vocabs / sizeof vocabs[0]][4096], inp[sizeof vocabs / sizeof vocabs[0]][4096];
    bool present[sizeof vocabs / sizeof vocabs[0]] = {false};
    size_t n_present = 0;
    for (size_t i = 0; i < n_vocabs; i++) {
        inp[i][0] = 0;
        if (vocabs[i].bundle) {
            const char *bwhy = NULL;
            present[i] = kvt_test_bundle_vocab(vocabs[i].rel, model[i], sizeof model[i], &bwhy) &&
                         (!vocabs[i].inp || kvt_test_bundle_vocab(vocabs[i].inp, inp[i], sizeof inp[i], &bwhy));
            if (!present[i]) printf("    %s: left out: %s\n", vocabs[i].name, bwhy);
        } else {
            const char *p = kvt_test_shared(vocabs[i].rel), *ip = vocabs[i].inp ? kvt_test_shared(vocabs[i].inp) : NULL;
            if (p) snprintf(model[i], sizeof model[i], "%s", p);
            if (ip) snprintf(inp[i], sizeof inp[i], "%s", ip);
            present[i] = p != NULL;
            if (!present[i]) printf("    %s: %s not found under ../shared, left out\n", vocabs[i].name, vocabs[i].rel);
        }
        n_present += present[i];
    }
    if (!n_present) SKIP("none of the vocab files is under ../shared or in the llama.cpp source bundle");
    char missing[512] = "";
    for (size_t i = 0, o = 0; i < n_vocabs; i++)
        if (!present[i] && o < sizeof missing)
            o += (size_t)snprintf(missing + o, sizeof missing - o, "%s%s", o ? ", " : "", vocabs[i].name);

    fx_server dir = {0};
    CHECKF(fx_tmpdir_make(&dir, "kvtier-peer"), "mkdtemp: %s", strerror(errno));
    size_t n_diff = 0, n_failed = 0;
    bool header_shown = false;
    for (size_t i = 0; i < n_vocabs; i++)
        if (present[i] && !compare_vocab(&dir, vocabs[i].name, model[i], inp[i][0] ? inp[i] : NULL, vocabs[i].pre,
                                         vocabs[i].no_lf, vocabs[i].bundle, &n_diff, &header_shown))
            n_failed++;
    fx_tmpdir_remove(&dir);
    CHECKF(n_failed == 0, "%zu vocabularies could not be compared with llama.cpp (see above)", n_failed);
    CHECKF(n_diff == 0, "%zu cases differ from llama.cpp (see above)", n_diff);
    printf("    %zu of %zu vocabularies compared\n", n_present, n_vocabs);
    if (n_present < n_vocabs)
        kvt_test_skip("%zu of %zu vocabularies left out (files absent): %s", n_vocabs - n_present, n_vocabs, missing);
}
