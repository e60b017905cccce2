/* libFuzzer targets for kvtier's parsers (tests/fuzz/README.md).
 *
 * tests/fuzz/<target>.c defines int fuzz_<target>(const uint8_t *data,
 * size_t size): one fuzz iteration on one input, returning 0. The libFuzzer
 * binaries wrap it (shim.c; `make fuzz`), and the normal test binary calls
 * the same functions on every file under tests/fuzz/regress/<target>/ and
 * tests/fuzz/seeds/<target>/ (tests/test_fuzz_regress.c), so a crasher
 * found once stays a test.
 *
 * Besides what the sanitizers catch, the targets check properties the
 * headers promise (decode(encode(x)) == x, responses are valid JSON, a
 * restored snapshot restores again to the same state, ...) with FUZZ_CHECK:
 * under libFuzzer a broken one prints its message and aborts, which
 * libFuzzer reports as a crash and saves the input; in the test binary it is
 * a test failure and the target goes on to free what it holds. A call frees
 * everything it allocates (LeakSanitizer is on); the models and sessions
 * the targets share are made on first use and kept. */
#ifndef KVT_FUZZ_H
#define KVT_FUZZ_H

#include "kvtier.h"
#include "serve/api.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Every target, by name: its directory under tests/fuzz/seeds/ and
 * tests/fuzz/regress/, its binary build-fuzz/fuzz-<name>. */
#define FUZZ_TARGETS(X)                                                      \
    X(gguf) X(snapshot) X(block) X(api_chat) X(api_completions)             \
    X(api_responses) X(api_messages) X(api_count_tokens) X(toolcall)        \
    X(template) X(tokenizer)
#define FUZZ_DECLARE(t) int fuzz_##t(const uint8_t *data, size_t size);
FUZZ_TARGETS(FUZZ_DECLARE)
#undef FUZZ_DECLARE

/* A broken property: print and abort, or, with fuzz_fail_hook set (the test
 * binary), pass the message to it and return. */
void fuzz_fail(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
extern void (*fuzz_fail_hook)(const char *msg);
#define FUZZ_CHECK(cond, ...) \
    do { if (!(cond)) fuzz_fail(__FILE__, __LINE__, __VA_ARGS__); } while (0)

/* True when $FUZZ_KNOWN (a comma-separated list) names this finding: a
 * property broken by a reported bug that is not fixed yet, which a long
 * run may then step over (run.sh passes FUZZ_KNOWN on) while its
 * reproducer under tests/fuzz/regress/ keeps failing the tests. Each use
 * names the reproducer. */
bool fuzz_known(const char *name);

/* Path of a file under ../shared (or $KVT_SHARED), NULL when absent (a
 * static buffer per call: copy it to keep two). */
const char *fuzz_shared(const char *rel);

/* Models made once and kept: ds4-tiny with weight seed 1 (what
 * kvt_model_open("ds4-tiny") gives, the deepseek template) or 7 (the golden
 * snapshot files' model), and stories260K (the plain template, a
 * SentencePiece vocabulary; NULL when ../shared lacks it). */
kvt_model *fuzz_ds4(uint64_t seed);
kvt_model *fuzz_stories(void);
/* A session of m kept for the targets (one thread, a context of 1024), and
 * a second one for comparisons (which 0 or 1). */
kvt_session *fuzz_session(kvt_model *m, int which);

/* s[0..n) is one JSON value (jansson, strict). */
bool fuzz_json_ok(const char *s, size_t n);
/* Server-sent events as the kvt_stream_* calls return them: every event is
 * "event: X\n" lines and "data: Y" lines and each Y is JSON or [DONE].
 * NULL is not valid. */
bool fuzz_sse_ok(const char *s);
/* Check one request body for api the way the server parses it, with both
 * templates and both sets of options, and the responses to it (the api_*
 * targets). */
void fuzz_request(kvt_api api, const uint8_t *data, size_t size);

/* The tokens the server makes of a parsed request's prompt with model m
 * (BOS and special-token parsing as the template says); malloc'ed, NULL on
 * failure. */
int32_t *fuzz_prompt_tokens(const kvt_model *m, const kvt_request *r, size_t *n);

/* Recompute what makes a record pass its integrity checks, so that the
 * fuzzer's changes reach the checks behind them. A block record (len bytes,
 * its rows `rows` bytes for the model): its checksum and, by mode bits, its
 * key from its ids (FIX_KEY), its payload length (FIX_PAYLOAD) and its text
 * length (FIX_TEXT). A snapshot record: its section checksums and header
 * checksum (fuzz_fix_record), for either section count the format has
 * (6, or 7 with the recurrent section; another count is taken as 6); with
 * the blocks inline after it (fuzz_fix_snapshot) also theirs by the same
 * mode, FIX_KEY chaining the blocks' keys from key0 into the record's keys
 * section and head. */
enum { FIX_KEY = 1, FIX_PAYLOAD = 2, FIX_TEXT = 4 };
void fuzz_fix_block(uint8_t *p, size_t len, unsigned mode, size_t rows);
void fuzz_fix_record(uint8_t *p, size_t len);
/* The bytes of a snapshot record's header, section table and header
 * checksum (64 + 24·S + 8) as fuzz_fix_record counts them, or 0 when p
 * (len bytes) is not that long or not a snapshot record. */
size_t fuzz_record_header(const uint8_t *p, size_t len);
void fuzz_fix_snapshot(uint8_t *p, size_t len, unsigned mode, size_t rows);

/* 64-bit FNV-1a, to derive options from an input deterministically. */
uint64_t fuzz_hash(const void *p, size_t n);

#endif
