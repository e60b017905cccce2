/* kvtier's tokenizers against llama.cpp itself, id for id.
 *
 *   peer_tokenizer_vocabs  for each of ../shared/vocab/ggml-vocab-{llama-spm,
 *                          deepseek-llm,gpt-2}.gguf and ../shared/models/
 *                          stories260K.gguf: kvt_tokenizer_encode (no BOS)
 *                          gives the ids llama_tokenize gives (add_special =
 *                          false) on the same text, with parse_special false
 *                          and true
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
 *   - a few words with non-ASCII letters ("Ünïcödé wörds", "Führer", ...)
 * Only valid UTF-8 goes in: on invalid UTF-8 kvtier differs on purpose (see
 * src/tokenizer.c), and a token text that is not valid UTF-8 is left out
 * (counted in the report).
 *
 * Requirements: linux x86_64, node and npm on PATH, and the packages of
 * tests/peer/package-lock.json, installed with `npm ci --omit=optional` on
 * first use (about 85 MB; the optional CUDA/Vulkan builds, 600 MB more, are
 * not needed for a CPU tokenizer). The test skips, saying why, when any of
 * these is missing, when npm ci fails (offline), or when none of the vocab
 * files is there; KVT_PEER=0 skips it too. KVT_PEER_ALL=1 tries every
 * user-defined, control and unknown token instead of at most MAX_USER and
 * MAX_CONTROL. Run from the repository root. About 5 s after the install. */
#include "fixture.h"
#include "test.h"
#include "tokenizer.h"

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

enum kind { K_INP, K_USER, K_CONTROL, K_TEXT, N_KINDS };
static const char *const kind_name[N_KINDS] = {".inp", "user-defined", "control/unknown", "text"};

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

/* Every case of the vocab's .inp file (split as tests/test_tokenizer.c does). */
static void add_inp_cases(caseset *cs, const char *inp_rel)
{
    const char *ip = kvt_test_shared(inp_rel);
    size_t ilen;
    char *inp = ip ? kvt_test_read_file(ip, &ilen) : NULL;
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
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) add2(cs, K_TEXT, texts[i], strlen(texts[i]));
}

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

/* One vocabulary against the peer. Adds to *n_diff the cases that differ;
 * false when the comparison could not run (a message was printed). */
static bool compare_vocab(fx_server *dir, const char *name, const char *rel, const char *inp_rel,
                          size_t *n_diff, bool *header_shown)
{
    const char *p = kvt_test_shared(rel);
    if (!p) { printf("    %s: %s not found under ../shared, left out\n", name, rel); return true; }
    char model[4096];
    snprintf(model, sizeof model, "%s", p);

    kvt_gguf *g = NULL;
    kvt_tokenizer *t = NULL;
    int rc = kvt_gguf_open(&g, model);
    if (!rc) rc = kvt_tokenizer_from_gguf(&t, g);
    caseset cs = {.json = json_array()};
    vocabinfo vi = {0};
    if (!rc && !cs.json) rc = KVT_ENOMEM;
    if (!rc && inp_rel) add_inp_cases(&cs, inp_rel);
    if (!rc) rc = add_token_cases(&cs, g, &vi);
    if (!rc) add_text_cases(&cs);
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

TEST(peer_tokenizer_vocabs)
{
    static const struct { const char *name, *rel, *inp; } vocabs[] = {
        {"llama-spm", "vocab/ggml-vocab-llama-spm.gguf", "vocab/ggml-vocab-llama-spm.gguf.inp"},
        {"deepseek-llm", "vocab/ggml-vocab-deepseek-llm.gguf", "vocab/ggml-vocab-deepseek-llm.gguf.inp"},
        {"gpt-2", "vocab/ggml-vocab-gpt-2.gguf", "vocab/ggml-vocab-gpt-2.gguf.inp"},
        {"stories260K", "models/stories260K.gguf", NULL},
    };
    const size_t n_vocabs = sizeof vocabs / sizeof vocabs[0];
    const char *why = skip_reason();
    if (why) SKIP("%s", why);
    size_t n_present = 0;
    for (size_t i = 0; i < n_vocabs; i++) n_present += kvt_test_shared(vocabs[i].rel) != NULL;
    if (!n_present) SKIP("none of the vocab files is under ../shared");
    double install_s;
    if (!fx_peer_ensure(&install_s))
        SKIP("npm ci --prefix " FX_PEER_DIR " failed (offline?): no llama.cpp peer");
    if (install_s >= 0) printf("    npm ci took %.1f s\n", install_s);

    fx_server dir = {0};
    CHECKF(fx_tmpdir_make(&dir, "kvtier-peer"), "mkdtemp: %s", strerror(errno));
    size_t n_diff = 0, n_failed = 0;
    bool header_shown = false;
    for (size_t i = 0; i < n_vocabs; i++)
        if (!compare_vocab(&dir, vocabs[i].name, vocabs[i].rel, vocabs[i].inp, &n_diff, &header_shown))
            n_failed++;
    fx_tmpdir_remove(&dir);
    CHECKF(n_failed == 0, "%zu vocabularies could not be compared with llama.cpp (see above)", n_failed);
    CHECKF(n_diff == 0, "%zu cases differ from llama.cpp (see above)", n_diff);
}
