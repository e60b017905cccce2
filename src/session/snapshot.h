/* The serializer behind RAM snapshots and the disk tier (see snapshot.c and
 * docs/FORMAT.md). Records are byte strings; nothing here does I/O. */
#ifndef KVT_SNAPSHOT_H
#define KVT_SNAPSHOT_H

#include "base/buf.h"
#include "kvtier.h"

#include <stdatomic.h>
#include <sys/uio.h>

#define KVT_SNAP_VERSION 2
#define KVT_SNAP_VERSION_REPLAY 4    /* a snapshot record stored without its state, with its digest */
#define KVT_SNAP_VERSION_REPLAY_V3 3 /* the same without the digest: still read, no longer written */
#define KVT_SNAP_VERSION_RECURRENT 5 /* a whole record of a model with recurrent layers: a seventh section */
#define KVT_SNAP_VERSION_TYPED 6     /* any record of a model whose rows are rounded to a cache type: the
                                      * types in its header; 7 sections with a recurrent state */
#define KVT_SNAP_VERSION_MAX 6       /* the newest version this build reads; a store skips newer ones */
#define KVT_SNAP_INLINE 1u   /* flag: block records follow the snapshot record */
#define KVT_SNAP_REPLAY 2u   /* flag: the state section holds only the state's digest; loading rebuilds it by replay */

/* Chained block keys: key0 from the model and tokenizer fingerprints, then
 * one step per 128 token ids. tail_hash covers ids after the last block. */
uint64_t kvt_snap_key0(const kvt_model *m);
/* The scope a chain of block keys is made for; its seed is
 * kvt_snap_key0_in(m, scope), and the rest of the chain the same steps.
 *   KVT_KEYS_RECORDS  the keys of records (the disk tier, the remote tier, a
 *                     RAM snapshot handed out): seeded by kvt_snap_key0, so
 *                     equal prefixes of equal models have equal keys in
 *                     every process. Its first use makes the model's
 *                     fingerprint (every weight read, unless remembered:
 *                     fpcache.h).
 *   KVT_KEYS_PROCESS  keys that never leave the process (the RAM index of a
 *                     pool with neither a disk nor a remote tier): seeded
 *                     by the model's address, tokenizer fingerprint and
 *                     row types, so making them reads no weight. Unique
 *                     among the live models of the process; never written
 *                     anywhere, and equal to no record's but by a 64-bit
 *                     collision (which the RAM match's token comparison
 *                     catches). */
typedef enum { KVT_KEYS_RECORDS, KVT_KEYS_PROCESS } kvt_key_scope;
uint64_t kvt_snap_key0_in(const kvt_model *m, kvt_key_scope scope);
uint64_t kvt_snap_key_next(uint64_t prev, const int32_t *ids);
/* Tests: the blocks kvt_snap_key_next has hashed (what a save, a lookup
 * or a load costs in key steps). */
extern _Atomic uint64_t kvt_snap_key_steps;
uint64_t kvt_snap_tail_hash(uint64_t head, const int32_t *ids, size_t n);

/* The chained keys of s's first nb blocks (nb * 128 <= its length; NULL
 * otherwise) in the records' scope: kept on the session's cache
 * (kvt_cache.keys), computed once for the tokens it holds; valid until the
 * session next changes or its keys are asked in another scope. */
const uint64_t *kvt_snap_keys(kvt_session *s, size_t nb);
/* The same in scope: the cache keeps one scope's chain; asked in the
 * other, it is made again from that scope's seed. */
const uint64_t *kvt_snap_keys_in(kvt_session *s, size_t nb, kvt_key_scope scope);
/* Test hook, to show a test catches it: KVT_SNAP_FAULT_PROCESS_SEED_FINGERPRINTED
 * seeds the process scope's chains as the records' (kvt_snap_key0: the
 * model's fingerprint made), as every chain was before there were scopes. */
enum { KVT_SNAP_FAULT_NONE, KVT_SNAP_FAULT_PROCESS_SEED_FINGERPRINTED };
extern int kvt_snap_fault;

/* True when the state at n tokens can be saved: n is the session's length
 * or one of its checkpoints. */
bool kvt_snap_can_save(const kvt_session *s, size_t n);
/* Append the snapshot record for the first n tokens to rec (flags 0 or
 * KVT_SNAP_INLINE; kvt_snap_without_state makes a record without its state);
 * *keys (malloc'ed, n / 128 entries; may be NULL) receives the block keys. */
int kvt_snap_encode(kvt_session *s, size_t n, uint32_t flags, kvt_wbuf *rec, uint64_t **keys);
/* Append to out the same record without its state (flag KVT_SNAP_REPLAY;
 * version 4, or 6 for a record of version 6, its row types kept): its
 * state section holds the XXH3-64 of the state it leaves out instead.
 * Appends nothing when the record has no state to drop (or has dropped it
 * already), or a recurrent state (version 5, or 6 with 7 sections), which
 * cannot be rebuilt. */
int kvt_snap_without_state(const uint8_t *rec, size_t len, kvt_wbuf *out);
/* Append block record b (prev: key of block b - 1, or key0); *key gets its key. */
int kvt_snap_block(const kvt_session *s, uint32_t b, uint64_t prev, kvt_wbuf *out, uint64_t *key);
/* The same record in pieces, for a writer that sends the rows from where
 * they lie instead of copying them: the bytes before the rows are appended
 * to head; runs[] (room for kvt_snap_block_runs_max entries) receives the
 * rows in record order, *n_runs how many; the record ends with the 8 bytes
 * (little-endian) of kvt_snap_block_sum over head's bytes from the record's
 * start and the runs. The runs point into the session's rows: valid while
 * it is neither changed nor freed. */
int kvt_snap_block_parts(const kvt_session *s, uint32_t b, uint64_t prev, kvt_wbuf *head, uint64_t *key,
                         struct iovec *runs, size_t *n_runs);
size_t kvt_snap_block_runs_max(const kvt_session *s);
/* The checksum that ends a block record: XXH3-64 of head's bytes from
 * `from` on, then of the runs. */
uint64_t kvt_snap_block_sum(const kvt_wbuf *head, size_t from, const struct iovec *runs, size_t n_runs);

typedef struct kvt_snap_info {
    uint32_t version, flags, n, nb, n_vocab, n_streams;
    uint32_t nsec;                 /* sections: 6, or 7 with a recurrent state (version 5, or 6) */
    uint32_t ggml_k, ggml_v;       /* version 6: the K and V rows' types (ggml's ids, header offset 60);
                                    * 0 (f32) before it */
    uint64_t model, tok;           /* fingerprints */
    uint64_t head;                 /* key of the last whole block (key0 if none) */
    const uint8_t *sec[8];         /* section bytes, by section id 1..6 (7: the recurrent state) */
    size_t sec_len[8];
    size_t rec_len;                /* bytes of the record itself */
} kvt_snap_info;

/* Validate a snapshot record's header, section table and checksums
 * (KVT_EFORMAT, KVT_ECORRUPT with a reason), without a model. */
int kvt_snap_parse_raw(const uint8_t *rec, size_t len, kvt_snap_info *out);
/* Bytes at the head of a snapshot record that hold its header, section
 * table and tail ids (the tokens section, first: at most 127 ids). */
#define KVT_SNAP_TAIL_HEAD (64 + 7 * 24 + 8 + 4 * (KVT_BLOCK - 1))
/* kvt_snap_parse_raw of the first len bytes of a record (at least its
 * tokens section, e.g. KVT_SNAP_TAIL_HEAD of them, or the whole): header,
 * its checksum and the sections within len, with their checksums; the
 * others are left unset. So a store can read a record's tail ids without
 * reading its rows. */
int kvt_snap_parse_head(const uint8_t *rec, size_t len, kvt_snap_info *out);
/* Whether m's cache is rows per token and nothing else (no window, no
 * recurrent state, no compressed rows): the first k tokens of a record
 * are a session of k tokens, which a session goes back to by dropping the
 * rest (kvt_session_sync). */
bool kvt_snap_rows_per_token(const kvt_model *m);
/* Check a block record on its own: magic, checksum, version, and that its
 * ids hash to its key. *key (may be NULL) receives the key. */
int kvt_snap_block_check(const uint8_t *p, size_t len, uint64_t *key);
/* The same checks of a record of len bytes that lies in pieces, parts[0..n)
 * in order (a value read in parts), without joining them: what it says of
 * the record is what kvt_snap_block_check says of the joined bytes. */
int kvt_snap_block_check_parts(const struct iovec *parts, size_t n, size_t len, uint64_t *key);
/* Bytes at the head of a block record that kvt_snap_block_names reads. */
#define KVT_SNAP_BLOCK_HEAD 48
/* Whether the first KVT_SNAP_BLOCK_HEAD bytes of a record (its header, not
 * its checksum) say it is the block of key, len bytes long. */
bool kvt_snap_block_names(const uint8_t *head, uint64_t key, size_t len);
/* The text of a (checked) block record, borrowed from p. */
int kvt_snap_block_text(const uint8_t *p, size_t len, const uint8_t **text, size_t *tlen);
/* kvt_snap_parse_raw plus the model's fingerprints and row types
 * (KVT_EMISMATCH). */
int kvt_snap_parse(const kvt_model *m, const uint8_t *rec, size_t len, kvt_snap_info *out);
/* Whether a parsed record's rows are of m's types: a version 6 record's
 * types must equal m's, and a record of an earlier version (f32 rows, or
 * DeepSeek-V4's own) loads only into a model whose rows are not rounded.
 * KVT_EMISMATCH naming both otherwise: a record of other cache types is a
 * miss, never converted, and a store keeps it for a model of its types. */
int kvt_snap_rows_check(const kvt_model *m, const kvt_snap_info *in);
/* Tests only: when set, kvt_snap_rows_check passes every record (the
 * negative control that shows the type check is what refuses them). */
extern bool kvt_snap_skip_row_types;
/* Text section of a parsed record: the text of the ids after the last block. */
static inline const uint8_t *kvt_snap_text(const kvt_snap_info *in, size_t *len)
{
    *len = in->sec_len[3];
    return in->sec[3];
}
/* Block records come from the caller (inline bytes or the disk store). */
typedef int (*kvt_block_get_fn)(void *user, uint32_t b, uint64_t key, const uint8_t **p, size_t *len);
/* Replace the session's state with a record and its blocks; on failure the
 * session is left empty. */
int kvt_snap_load(kvt_session *s, const uint8_t *rec, size_t len, kvt_block_get_fn get, void *user);
/* Where the rows of a block record go when read in place: the session's
 * rows of that block, one piece per stream in the record's order (n pieces,
 * bytes in all). */
typedef struct kvt_block_rows {
    const struct iovec *iov;
    int n;
    size_t bytes;
} kvt_block_rows;
/* Block records read into a buffer of the caller's: *buf (of *cap bytes,
 * grown with realloc as needed) receives block b's record, *len its
 * length, and *in_place is false. Given rows (may be NULL), the reader may
 * instead read the record's rows (the rows->bytes bytes before its last 8)
 * straight into rows->iov and the rest of it, in order, into *buf (so *buf
 * holds *len - rows->bytes bytes), and set *in_place. Called from the
 * thread that calls kvt_snap_load_read_start, and with concurrent set from
 * one other thread of the session's pool as well.
 *
 * *checked (false on entry): the reader sets it when it has checked the
 * record itself, kvt_snap_block_check or kvt_snap_block_check_parts over
 * the very bytes it hands over (its XXH3-64 and its ids against the key in
 * its header), copied from where they were checked, never read again from
 * their source in between. The loader then does not hash the record again
 * (each block's bytes are hashed once on a load); it still checks
 * everything else it relies on: magic, version, length, block index,
 * fingerprint, key and the key before it, ids, text length. */
typedef int (*kvt_block_read_fn)(void *user, uint32_t b, uint64_t key, const kvt_block_rows *rows, uint8_t **buf,
                                 size_t *cap, size_t *len, bool *in_place, bool *checked);
/* Tests: the bytes the block checks have hashed (kvt_snap_block_check,
 * kvt_snap_block_check_parts, a load's check of a block): what a load
 * costs in hashing. */
extern _Atomic uint64_t kvt_snap_block_hashed;
/* Tests: true makes a load hash again a block its reader reports checked,
 * as loads did before *checked (the negative control of the count of bytes
 * hashed by a remote hit). */
extern bool kvt_snap_fault_hash_checked;
/* kvt_snap_load_start with blocks read by read. concurrent: read may be
 * called from two threads at once (for different blocks); then, on a
 * session whose pool has two threads or more, the pool's threads share the
 * blocks, each reading and checking its own. Either way the outcome is the
 * one of reading and checking the blocks one after the other: the first
 * block whose read or check fails is the failure. *bad_block and *bad_key
 * receive that block's index and key (UINT32_MAX: the failure is not a
 * block's). */
int kvt_snap_load_read_start(kvt_session *s, const uint8_t *rec, size_t len, kvt_block_read_fn read, bool concurrent,
                             void *user, bool *rebuild, uint32_t *bad_block, uint64_t *bad_key);
/* kvt_snap_load in two steps, so that a caller can release what it read the
 * blocks from before the slow part: _start checks and copies everything in
 * and sets *rebuild when the state must still be rebuilt by replay (keeping
 * the record's state digest in s->cache); _finish does that, checks the
 * rebuilt state against the digest (a failure empties the session) and
 * leaves the restore checkpoint. */
int kvt_snap_load_start(kvt_session *s, const uint8_t *rec, size_t len, kvt_block_get_fn get, void *user,
                        bool *rebuild);
int kvt_snap_load_finish(kvt_session *s, bool rebuild);
/* Empty the session, as a failed load leaves it. */
void kvt_snap_empty(kvt_session *s);
/* Tests only: when set, a rebuilt state is not checked against the record's
 * digest (version 4 records load as version 3 ones do), the negative
 * control that shows the digest is what refuses a wrong rebuilt state. */
extern bool kvt_snap_skip_state_digest;

#endif
