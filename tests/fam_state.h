/* The proofs a llama-family cache's fixed state (gemma's window rings,
 * qwen35's convolution and delta-rule state) must pass: everything a
 * session does with it gives the bits of one uninterrupted run
 * (tests/fam_state.c; the tests: tests/test_window.c, tests/test_deltanet.c).
 * Each fails the current test with a message, or skips it when
 * ../shared/vocab is absent. */
#ifndef KVT_TEST_FAM_STATE_H
#define KVT_TEST_FAM_STATE_H

#include "kvtier.h"
#include "synth_family.h"

/* The synthetic model f written in dir (a mkdtemp template) as path, and
 * opened; NULL: the test is skipped or has failed. */
kvt_model *fam_open(const fam_spec *f, char *dir, char *path, size_t cap);
/* Close it and remove its file and dir. */
void fam_close(kvt_model *m, const char *dir, const char *path);
/* BOS (1) then n - 1 ids from a seed. */
void fam_prompt(int32_t *t, size_t n, uint64_t seed);
/* The types of K and V rows a proof runs with. */
typedef struct fam_rows { kvt_row_type k, v; } fam_rows;
/* The row types the state proofs run with beyond the default (f16): f32,
 * bf16, q8_0, and q8_0 K with f16 V (a layout where K's and V's rows
 * differ in size). */
extern const fam_rows fam_rows_more[4];
/* The model file at path opened anew with its cache in r (printed); NULL:
 * the test has failed (the message says why). */
kvt_model *fam_reopen(const char *path, fam_rows r);
/* Snapshots at positions around the window's edge (FAM_GEMMA_SWA), on and
 * off the 128-token grid, restored and run on to 420 tokens, equal the
 * uninterrupted run, and so does one saved to a disk store, closed and
 * restored from it; with KVT_LLAMA_FAULT_RING they do not, and where K's
 * and V's row types differ, with KVT_LLAMA_FAULT_RING_TYPES neither.
 * light: 4 positions, run on to 300 (for the row types beyond the
 * default). */
void fam_restore_all(kvt_model *m, bool light);
/* A prompt that diverges from the one a session holds goes back to a
 * checkpoint and is exact; so are a strict prefix and a regeneration: for
 * the default row types with its negative control, then for those of
 * fam_rows_more. */
void fam_checkpoints(const fam_spec *f);
/* Damaged and truncated records, and a record stored without its state,
 * are refused and leave the session empty. */
void fam_damaged_state(const fam_spec *f);

#endif
