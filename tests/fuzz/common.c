/* What the fuzz targets share: failure reporting, the models and sessions
 * made once, JSON and SSE checks, the request checks of the api_* targets,
 * and the integrity fix-ups of snapshot and block records (fuzz.h). */
#include "fuzz.h"
#include "arch/model.h"
#include "session/snapshot.h"
#include "text/tokenizer.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

void (*fuzz_fail_hook)(const char *msg);

void fuzz_fail(const char *file, int line, const char *fmt, ...)
{
    char msg[1024];
    int o = snprintf(msg, sizeof msg, "%s:%d: ", file, line);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg + o, sizeof msg - (size_t)o, fmt, ap);
    va_end(ap);
    if (fuzz_fail_hook) {
        fuzz_fail_hook(msg);
        return;
    }
    fprintf(stderr, "fuzz: property broken: %s\n", msg);
    abort();
}

bool fuzz_known(const char *name)
{
    size_t n = strlen(name);
    for (const char *p = getenv("FUZZ_KNOWN"); p && *p;) {
        size_t l = strcspn(p, ",");
        if (l == n && !memcmp(p, name, n)) return true;
        p += l + (p[l] == ',');
    }
    return false;
}

const char *fuzz_shared(const char *rel)
{
    static char buf[8][4096];
    static int slot;
    const char *root = getenv("KVT_SHARED");
    if (!root) root = "../shared";
    char *p = buf[slot++ % 8];
    snprintf(p, 4096, "%s/%s", root, rel);
    return access(p, R_OK) == 0 ? p : NULL;
}

uint64_t fuzz_hash(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* ---- models and sessions ------------------------------------------------ */

kvt_model *fuzz_ds4(uint64_t seed)
{
    static kvt_model *m[2];
    static bool tried[2];
    int k = seed == 7;
    if (!tried[k]) {
        tried[k] = true;
        if (kvt_model_preset(&m[k], "ds4-tiny", seed, NULL)) {
            fprintf(stderr, "fuzz: ds4-tiny: %s\n", kvt_errmsg());
            abort();
        }
    }
    return m[k];
}

kvt_model *fuzz_stories(void)
{
    static kvt_model *m;
    static bool tried;
    if (!tried) {
        tried = true;
        const char *p = fuzz_shared("models/stories260K.gguf");
        if (p && kvt_model_open(&m, p)) m = NULL;
    }
    return m;
}

kvt_session *fuzz_session(kvt_model *m, int which)
{
    static struct { kvt_model *m; kvt_session *s[2]; } tab[4];
    for (size_t i = 0; i < 4; i++) {
        if (tab[i].m && tab[i].m != m) continue;
        tab[i].m = m;
        if (!tab[i].s[which]) {
            kvt_session_opts o = {.n_ctx = 1024, .n_threads = 1};
            if (kvt_session_new(&tab[i].s[which], m, &o)) {
                fprintf(stderr, "fuzz: session: %s\n", kvt_errmsg());
                abort();
            }
        }
        return tab[i].s[which];
    }
    abort();
}

/* ---- JSON and SSE --------------------------------------------------------- */

bool fuzz_json_ok(const char *s, size_t n)
{
    if (!s) return false;
    json_error_t e;
    json_t *v = json_loadb(s, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, &e);
    json_decref(v);
    return v != NULL;
}

bool fuzz_sse_ok(const char *s)
{
    if (!s) return false;
    size_t n = strlen(s);
    if (n && (n < 2 || memcmp(s + n - 2, "\n\n", 2))) return false;
    for (const char *ev = s; *ev;) {
        const char *end = strstr(ev, "\n\n");
        if (!end || end == ev) return false;
        bool has_data = false;
        for (const char *line = ev; line < end;) {
            const char *nl = memchr(line, '\n', (size_t)(end - line));
            if (!nl) nl = end;
            size_t ll = (size_t)(nl - line);
            if (ll > 6 && !memcmp(line, "event: ", 7)) {
                /* a name, nothing to check */
            } else if (ll >= 6 && !memcmp(line, "data: ", 6)) {
                if (has_data) return false; /* one data line per event */
                has_data = true;
                const char *d = line + 6;
                size_t dl = ll - 6;
                if (!(dl == 6 && !memcmp(d, "[DONE]", 6)) && !fuzz_json_ok(d, dl)) return false;
            } else {
                return false;
            }
            line = nl + 1;
        }
        if (!has_data) return false;
        ev = end + 2;
    }
    return true;
}

/* ---- requests ------------------------------------------------------------- */

#define FW "\xef\xbd\x9c"
#define SPM "\xe2\x96\x81"
#define CB "<" FW "tool" SPM "call" SPM "begin" FW ">"
#define CE "<" FW "tool" SPM "call" SPM "end" FW ">"
#define TSEP "<" FW "tool" SPM "sep" FW ">"

int32_t *fuzz_prompt_tokens(const kvt_model *m, const kvt_request *r, size_t *n)
{
    int32_t *ids = NULL;
    *n = 0;
    bool bos = r->prompt_has_bos ? false : m->info.add_bos;
    if (kvt_tokenizer_encode(m->tok, r->prompt, r->prompt_len, bos, r->prompt_special, &ids, n)) return NULL;
    return ids;
}

/* The replay hook: sampled bytes for some call ids (any bytes: the
 * rendering copies them as they are), none for the others. */
static bool replay(void *user, const char *id, kvt_wbuf *out)
{
    static const char *const texts[] = {
        "", "\n", CB "function" TSEP "f\n```json\n{}\n```" CE, "\xff\xfe\x00x",
    };
    static const size_t lens[] = {0, 1, sizeof(CB "function" TSEP "f\n```json\n{}\n```" CE) - 1, 4};
    (*(int *)user)++;
    uint64_t h = fuzz_hash(id, strlen(id));
    if (h % 5 == 4) return false;
    if (h % 5 == 3) kvt_wbuf_put(out, id, strlen(id));
    else kvt_wbuf_put(out, texts[h % 5], lens[h % 5]);
    return true;
}

static bool prompt_round_trips(const kvt_model *m, const kvt_request *r)
{
    size_t n = 0, blen = 0;
    int32_t *ids = fuzz_prompt_tokens(m, r, &n);
    char *back = NULL;
    /* a BOS the template wrote is text; one the tokenizer added is not */
    int rc = !ids ? KVT_ENOMEM
           : r->prompt_has_bos ? kvt_tokenizer_decode(m->tok, ids, n, &back, &blen)
           : kvt_detokenize(m, ids, n, &back, &blen);
    bool ok = rc == KVT_OK && blen == r->prompt_len && !memcmp(back, r->prompt, blen);
    free(ids);
    free(back);
    return ok;
}

/* The responses a parsed request can get: complete, streamed, with tool
 * calls when it offered tools, and errors; all valid JSON / SSE. */
static void check_responses(kvt_request *r, size_t n_prompt)
{
    const kvt_api api = r->api;
    kvt_usage u = {.prompt_tokens = (uint32_t)n_prompt, .completion_tokens = 3, .cached_tokens = 1};
    const char *id = api == KVT_API_RESPONSES ? "resp_1" : api == KVT_API_MESSAGES ? "msg_1" : "chatcmpl-1";
    const long t = 1700000000;
    char *s = kvt_response_json(r, id, r->model, "out\xff\xc3", 5, "stop", NULL, &u, t);
    FUZZ_CHECK(s && fuzz_json_ok(s, strlen(s)), "api %d: response is not JSON: %.300s", (int)api, s ? s : "(null)");
    free(s);
    if (r->n_stop) {
        s = kvt_response_json(r, id, r->model, "x", 1, "stop", r->stop[0], &u, t);
        FUZZ_CHECK(s && fuzz_json_ok(s, strlen(s)), "api %d: stop response is not JSON", (int)api);
        free(s);
    }
    /* a call to an offered tool name, namespaced when the request has namespaces */
    kvt_tool_call *calls = NULL;
    size_t n_calls = 0, te = 0;
    if (r->n_tools) {
        char text[600];
        const char *ns = r->n_namespaces ? r->namespaces[0] : NULL;
        int k = snprintf(text, sizeof text, "Hi." CB "function" TSEP "%.200s%sfn\n```json\n{\"a\":[1,\"\\u00e9\"]}\n```" CE,
                         ns ? ns : "", ns ? KVT_API_NS_SEP : "");
        size_t tl = k < 0 ? 0 : (size_t)k >= sizeof text ? sizeof text - 1 : (size_t)k;
        FUZZ_CHECK(kvt_tool_calls_parse(text, tl, &calls, &n_calls, &te) == KVT_OK, "tool calls parse failed");
        s = kvt_response_json_calls(r, id, r->model, text, te, calls, n_calls, "tool_calls", NULL, &u, t);
        FUZZ_CHECK(s && fuzz_json_ok(s, strlen(s)), "api %d: tool call response is not JSON: %.300s", (int)api,
                   s ? s : "(null)");
        free(s);
    }
    /* streamed */
    char *parts[4];
    parts[0] = kvt_stream_begin(r, id, r->model, &u, t);
    parts[1] = kvt_stream_delta(r, id, r->model, "a\xe2\x82", 3, t);
    parts[2] = kvt_stream_delta(r, id, r->model, "", 0, t);
    parts[3] = kvt_stream_end_calls(r, id, r->model, "a\xe2\x82", 3, calls, n_calls, n_calls ? "tool_calls" : "length",
                                    NULL, &u, t);
    for (int i = 0; i < 4; i++) {
        FUZZ_CHECK(fuzz_sse_ok(parts[i]), "api %d: stream part %d is not SSE: %.300s", (int)api, i,
                   parts[i] ? parts[i] : "(null)");
        free(parts[i]);
    }
    kvt_tool_calls_free(calls, n_calls);
}

/* One parse of body for api with model m (NULL: the plain template) and
 * options o (NULL: the defaults), and what must hold of its result; with
 * responses, also of the responses to it (they do not depend on the
 * template or the options, so once per body is enough). */
static void check_parse(kvt_api api, const uint8_t *data, size_t size, const kvt_model *m, const kvt_parse_opts *o,
                        bool responses)
{
    kvt_request r;
    memset(&r, 0x5a, sizeof r); /* the parse must not read what it was given */
    int st = -1;
    int rc = kvt_request_parse_opts(&r, api, (const char *)data, size, m, o, &st);
    if (rc != KVT_OK) {
        FUZZ_CHECK((rc == KVT_EINVAL && st == 400) || (rc == KVT_ENOMEM && st == 500),
                   "api %d: refused with %s and status %d", (int)api, kvt_strerror(rc), st);
        FUZZ_CHECK(!r.prompt && !r.model && !r.stop && !r.n_stop && !r.namespaces && !r.n_namespaces,
                   "api %d: a refused request is not left empty", (int)api);
        const char *msg = kvt_errmsg();
        FUZZ_CHECK(msg && *msg, "api %d: refused without a message", (int)api);
        if (!responses) { kvt_request_free(&r); return; }
        char *e = kvt_error_json(api, st, msg);
        FUZZ_CHECK(e && fuzz_json_ok(e, strlen(e)), "api %d: error body is not JSON: %.300s", (int)api,
                   e ? e : "(null)");
        free(e);
        e = kvt_stream_error(api, st, msg);
        FUZZ_CHECK(fuzz_sse_ok(e), "api %d: stream error is not SSE: %.300s", (int)api, e ? e : "(null)");
        free(e);
        kvt_request_free(&r);
        return;
    }
    bool deepseek = !strcmp(kvt_template_name(m), "deepseek");
    FUZZ_CHECK(st == 200 && r.api == api, "api %d: status %d, api %d", (int)api, st, (int)r.api);
    FUZZ_CHECK(r.prompt && r.prompt[r.prompt_len] == 0, "api %d: prompt not NUL-terminated", (int)api);
    FUZZ_CHECK(r.prompt_has_bos == (deepseek && api != KVT_API_COMPLETIONS), "api %d: prompt_has_bos %d", (int)api,
               r.prompt_has_bos);
    size_t max_stop = api == KVT_API_MESSAGES ? KVT_API_MAX_STOP_ANTHROPIC
                    : api == KVT_API_RESPONSES ? 0 : KVT_API_MAX_STOP_OPENAI;
    FUZZ_CHECK(r.n_stop <= max_stop, "api %d: %zu stop sequences", (int)api, r.n_stop);
    for (size_t i = 0; i < r.n_stop; i++) FUZZ_CHECK(r.stop[i] && r.stop[i][0], "api %d: empty stop %zu", (int)api, i);
    FUZZ_CHECK(r.temperature >= 0 && r.temperature <= 2, "temperature %g", (double)r.temperature);
    FUZZ_CHECK(r.top_p > 0 && r.top_p <= 1, "top_p %g", (double)r.top_p);
    FUZZ_CHECK(api != KVT_API_MESSAGES || r.max_tokens >= 1, "messages without max_tokens");
    FUZZ_CHECK(api != KVT_API_COMPLETIONS || r.n_tools == 0, "completions with tools");
    FUZZ_CHECK(r.n_namespaces == 0 || api == KVT_API_RESPONSES, "api %d: namespaces", (int)api);
    size_t n_prompt = 0;
    if (m) {
        FUZZ_CHECK(prompt_round_trips(m, &r), "api %d: the prompt does not round trip through the tokenizer",
                   (int)api);
        int32_t *ids = fuzz_prompt_tokens(m, &r, &n_prompt);
        free(ids);
    }
    if (responses) check_responses(&r, n_prompt);
    kvt_request_free(&r);
    FUZZ_CHECK(!r.prompt && !r.model && !r.stop, "kvt_request_free does not zero the request");
}

void fuzz_request(kvt_api api, const uint8_t *data, size_t size)
{
    int hits = 0;
    const kvt_parse_opts o = {.keep_volatile = true, .replay = replay, .replay_user = &hits};
    const kvt_model *models[2] = {fuzz_ds4(1), NULL};
    for (int k = 0; k < 2; k++) {
        check_parse(api, data, size, models[k], NULL, k == 0);
        check_parse(api, data, size, models[k], &o, false);
    }
}

/* ---- snapshot and block records ------------------------------------------- */

#define REC_FIXED 64 /* the header before the section table (docs/FORMAT.md) */
#define BLK_HDR 48
#define BLK_MIN (BLK_HDR + 512 + 4 + 8)

static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static void wr32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void wr64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

static uint64_t block_key(const uint8_t *p, uint64_t prev)
{
    int32_t ids[KVT_BLOCK];
    for (size_t i = 0; i < KVT_BLOCK; i++) ids[i] = (int32_t)rd32(p + BLK_HDR + 4 * i);
    return kvt_snap_key_next(prev, ids);
}

void fuzz_fix_block(uint8_t *p, size_t len, unsigned mode, size_t rows)
{
    if (len < BLK_MIN) return;
    if (mode & FIX_PAYLOAD) wr32(p + 44, (uint32_t)(len - BLK_HDR - 8));
    /* the text is what the ids and the rows leave */
    if (mode & FIX_TEXT && len - BLK_MIN >= rows) wr32(p + BLK_HDR + 512, (uint32_t)(len - BLK_MIN - rows));
    if (mode & FIX_KEY) wr64(p + 24, block_key(p, rd64(p + 32)));
    wr64(p + len - 8, XXH3_64bits(p, len - 8));
}

/* The section count S at byte 56 when it is one the format has (6, or 7
 * with the recurrent section: docs/FORMAT.md), else 6 (such a record is
 * refused for its count whatever its checksums say). */
static uint32_t rec_sections(const uint8_t *p)
{
    uint32_t s = rd32(p + 56);
    return s == 6 || s == 7 ? s : 6;
}

size_t fuzz_record_header(const uint8_t *p, size_t len)
{
    if (len < REC_FIXED || memcmp(p, "KVTSNAP", 8)) return 0;
    size_t hdr = REC_FIXED + 24 * (size_t)rec_sections(p) + 8;
    return len >= hdr ? hdr : 0;
}

void fuzz_fix_record(uint8_t *p, size_t len)
{
    size_t hdr = fuzz_record_header(p, len);
    if (!hdr) return;
    for (uint32_t i = 0, n = rec_sections(p); i < n; i++) {
        uint8_t *e = p + REC_FIXED + 24 * (size_t)i;
        uint64_t so = rd64(e), sl = rd64(e + 8);
        if (so <= len && sl <= len - so) wr64(e + 16, XXH3_64bits(p + so, sl));
    }
    wr64(p + hdr - 8, XXH3_64bits(p, hdr - 8));
}

/* key0 of the record's chain: kvt_snap_key0 of the fuzz model the record
 * names (ds4-tiny of seed 7, stories260K: what the snapshot target loads
 * it into), which holds the model's row types when its rows are rounded;
 * for another fingerprint the same rule from the header: the two
 * fingerprints, and with them the K and V types (ggml's ids at 60 and 61)
 * in a version 6 record, the version of a model whose rows are rounded. */
static uint64_t key0_of(const uint8_t *p)
{
    uint64_t model = rd64(p + 16);
    kvt_model *known[2] = {fuzz_ds4(7), fuzz_stories()};
    for (int i = 0; i < 2; i++)
        if (known[i] && kvt_model_fingerprint(known[i]) == model && known[i]->tok_fingerprint == rd64(p + 24))
            return kvt_snap_key0(known[i]);
    uint64_t seed[3] = {model, rd64(p + 24), p[60] | (uint64_t)p[61] << 32};
    return XXH3_64bits(seed, rd32(p + 8) == KVT_SNAP_VERSION_TYPED ? sizeof seed : 2 * sizeof seed[0]);
}

void fuzz_fix_snapshot(uint8_t *p, size_t len, unsigned mode, size_t rows)
{
    size_t hdr = fuzz_record_header(p, len);
    if (!hdr) return;
    /* the block keys are section 6; the record ends where its last section
     * ends (the keys, or the recurrent state after them with 7 sections) */
    const uint8_t *last = p + REC_FIXED + 24 * ((size_t)rec_sections(p) - 1);
    uint64_t ko = rd64(p + REC_FIXED + 24 * 5), kl = rd64(p + REC_FIXED + 24 * 5 + 8);
    uint64_t eo = rd64(last), el = rd64(last + 8);
    if (ko < hdr || ko > len || kl > len - ko || eo < hdr || eo > len || el > len - eo) {
        fuzz_fix_record(p, len);
        return;
    }
    size_t off = (size_t)(eo + el);
    uint32_t nb = rd32(p + 36);
    uint64_t prev = key0_of(p);
    uint64_t head = prev;
    for (uint32_t b = 0; len - off >= BLK_MIN; b++) {
        uint8_t *bp = p + off;
        size_t left = len - off, bl = BLK_HDR + (size_t)rd32(bp + 44) + 8;
        /* a block whose length does not fit, or the last one, takes the rest */
        if (bl > left || bl < BLK_MIN || (mode & FIX_PAYLOAD && b + 1 >= nb)) bl = left;
        if (mode & FIX_KEY) wr64(bp + 32, prev);
        fuzz_fix_block(bp, bl, mode, rows);
        prev = rd64(bp + 24);
        if (mode & FIX_KEY && b < nb && 8 * ((uint64_t)b + 1) <= kl) wr64(p + ko + 8 * (size_t)b, prev);
        if (b + 1 == nb) head = prev;
        off += bl;
    }
    if (mode & FIX_KEY) wr64(p + 48, head);
    fuzz_fix_record(p, len);
}
