/* tokenizer: encode any bytes with every tokenizer at hand: the built-in
 * byte tokenizer, stories260K's SentencePiece vocabulary and each
 * vocabulary GGUF under ../shared/vocab/ (when ../shared has them), with
 * and without special-token parsing and BOS. What must hold:
 *   - every id is in the vocabulary and has a piece;
 *   - decode(encode(x)) == x (tokenizer.h), with the exceptions
 *     tests/test_tokenizer.c documents: a byte no token of the vocabulary
 *     spells (found once per vocabulary by encoding each byte alone; only
 *     bytes invalid in UTF-8 may be such) is replaced by 'x' first; for
 *     SentencePiece, a literal U+2581 (which it cannot tell from an escaped
 *     space) is changed first, and the parse_special round trip is not
 *     required (a dummy space follows each special);
 *   - with add_bos (and parse_special off), the ids are BOS and then the
 *     ids without it;
 *   - decoding any ids in range (the input read as ids) gives the
 *     concatenation of their pieces (less the one dummy-prefix space). */
#include "fuzz.h"
#include "format/gguf.h"
#include "text/tokenizer.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TOK 8

static struct vocab {
    kvt_tokenizer *t;
    char name[64];
    bool spm;
    bool unspellable[256];
} vocabs[MAX_TOK];
static size_t n_vocabs;

static void add(kvt_tokenizer *t, const char *name)
{
    if (n_vocabs == MAX_TOK) { kvt_tokenizer_free(t); return; }
    struct vocab *v = &vocabs[n_vocabs++];
    v->t = t;
    snprintf(v->name, sizeof v->name, "%s", name);
    v->spm = !strcmp(kvt_tokenizer_model(t), "llama");
    for (int b = 0; b < 256; b++) {
        char c = (char)b, *back = NULL;
        int32_t *ids = NULL;
        size_t n = 0, bl = 0;
        if (kvt_tokenizer_encode(t, &c, 1, false, false, &ids, &n) || kvt_tokenizer_decode(t, ids, n, &back, &bl) ||
            bl != 1 || back[0] != c) {
            v->unspellable[b] = true;
            if (!(b == 0xc0 || b == 0xc1 || b >= 0xf5))
                fprintf(stderr, "fuzz: tokenizer %s cannot spell byte 0x%02x, which is valid in UTF-8\n", name, b);
        }
        free(ids);
        free(back);
    }
}

static void load_gguf(const char *path, const char *name)
{
    kvt_gguf *g = NULL;
    kvt_tokenizer *t = NULL;
    if (kvt_gguf_open(&g, path) == KVT_OK && kvt_tokenizer_from_gguf(&t, g) == KVT_OK) add(t, name);
    kvt_gguf_close(g);
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void init(void)
{
    kvt_tokenizer *t = NULL;
    if (kvt_tokenizer_new_bytes(&t) == KVT_OK) add(t, "bytes");
    const char *p = fuzz_shared("models/stories260K.gguf");
    if (p) load_gguf(p, "stories260K");
    const char *dir = fuzz_shared("vocab");
    DIR *d = dir ? opendir(dir) : NULL;
    char *names[64];
    size_t nn = 0;
    for (struct dirent *e; d && (e = readdir(d)) && nn < 64;) {
        size_t l = strlen(e->d_name);
        if (l > 5 && !strcmp(e->d_name + l - 5, ".gguf")) names[nn++] = strdup(e->d_name);
    }
    if (d) closedir(d);
    qsort(names, nn, sizeof *names, by_name); /* the same order on every machine */
    for (size_t i = 0; i < nn; i++) {
        char path[4096];
        if (names[i]) {
            snprintf(path, sizeof path, "%s/%s", dir, names[i]);
            load_gguf(path, names[i]);
        }
        free(names[i]);
    }
}

static void check(const struct vocab *v, const char *text, size_t len)
{
    const kvt_tokenizer *t = v->t;
    uint32_t nv = kvt_tokenizer_n_vocab(t);
    for (int sp = 0; sp < 2; sp++) {
        int32_t *ids = NULL, *with = NULL;
        size_t n = 0, nw = 0;
        int rc = kvt_tokenizer_encode(t, text, len, false, sp, &ids, &n);
        FUZZ_CHECK(rc == KVT_OK || rc == KVT_ENOMEM, "%s: encode: %s", v->name, kvt_errmsg());
        if (rc) continue;
        bool in_range = true;
        for (size_t i = 0; i < n; i++) in_range &= ids[i] >= 0 && (uint32_t)ids[i] < nv;
        FUZZ_CHECK(in_range, "%s: an id out of range", v->name);
        if (in_range && !(v->spm && sp)) {
            char *back = NULL;
            size_t bl = 0;
            rc = kvt_tokenizer_decode(t, ids, n, &back, &bl);
            FUZZ_CHECK(rc == KVT_OK && bl == len && !memcmp(back, text, len) && back[bl] == 0,
                       "%s: decode(encode(x)) != x (parse_special %d, %zu bytes, %zu ids, %zu bytes back)", v->name,
                       sp, len, n, bl);
            free(back);
        }
        int32_t bos = kvt_tokenizer_bos(t);
        if (!sp && bos >= 0 && kvt_tokenizer_encode(t, text, len, true, sp, &with, &nw) == KVT_OK)
            FUZZ_CHECK(nw == n + 1 && with[0] == bos && !memcmp(with + 1, ids, n * sizeof *ids),
                       "%s: add_bos does not just prepend BOS", v->name);
        free(with);
        free(ids);
    }
}

/* The input read as ids (two bytes each, modulo the vocabulary). */
static void check_decode(const struct vocab *v, const uint8_t *data, size_t size)
{
    uint32_t nv = kvt_tokenizer_n_vocab(v->t);
    size_t n = size / 2;
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) return;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        ids[i] = (int32_t)((data[2 * i] | data[2 * i + 1] << 8) % nv);
        const char *p;
        size_t pl;
        if (kvt_tokenizer_piece(v->t, ids[i], &p, &pl) == KVT_OK) total += pl;
    }
    char *s = NULL;
    size_t sl = 0;
    if (kvt_tokenizer_decode(v->t, ids, n, &s, &sl) == KVT_OK) {
        bool ok = s[sl] == 0 && (sl == total || (v->spm && sl + 1 == total));
        size_t o = 0;
        for (size_t i = 0; ok && i < n; i++) {
            const char *p;
            size_t pl;
            kvt_tokenizer_piece(v->t, ids[i], &p, &pl);
            if (i == 0 && sl + 1 == total) p++, pl--; /* the dummy prefix */
            ok = o + pl <= sl && !memcmp(s + o, p, pl);
            o += pl;
        }
        FUZZ_CHECK(ok, "%s: decode is not the pieces", v->name);
    }
    free(s);
    free(ids);
}

int fuzz_tokenizer(const uint8_t *data, size_t size)
{
    static bool ready;
    if (!ready) { ready = true; init(); }
    char *text = malloc(size ? size : 1);
    if (!text) return 0;
    for (size_t k = 0; k < n_vocabs; k++) {
        const struct vocab *v = &vocabs[k];
        memcpy(text, data, size);
        for (size_t i = 0; i < size; i++)
            if (v->unspellable[(uint8_t)text[i]]) text[i] = 'x';
        for (size_t i = 0; v->spm && i + 2 < size; i++)
            if (!memcmp(text + i, "\xe2\x96\x81", 3)) text[i + 2] = 'x';
        check(v, text, size);
        check_decode(v, data, size);
    }
    free(text);
    return 0;
}
