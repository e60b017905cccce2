/* The save policy: which points of a session the disk tier keeps after a
 * prompt (policy.c). Internal to kvtier: the server, the CLI and the store
 * queue use it. */
#ifndef KVT_POLICY_H
#define KVT_POLICY_H

#include "kvtier.h"

/* When to save (the server and the CLI share this policy):
 *   cold       a prompt the disk tier did not already cover: save at
 *              kvt_save_policy_cold() = align_down(n - trim_tokens,
 *              align_tokens) when that is at least min_tokens (a client
 *              that appends text re-merges the last BPE tokens, so the very
 *              end is not worth keeping; align_tokens 1, the default, saves
 *              right before the trim, as a record carries the rows of its
 *              incomplete last block, so a restart prefills the trim again
 *              and nothing more; a larger one writes fewer records), and at
 *              the fork point the caller names (the server: where the first
 *              user turn of a one-turn conversation begins, so a new
 *              conversation on the same system prompt reuses all of it);
 *   continued  every continued_interval tokens on an absolute grid;
 *   evict, shutdown, manual   by the caller, at the session's length.
 * Save points must be checkpoint positions: mark the cold point before the
 * prefill (the server and `kvtier run` do) and use checkpoint_interval =
 * kvt_save_policy_grid(), which holds the continued points. */
typedef struct kvt_save_policy {
    uint32_t min_tokens, trim_tokens, align_tokens, continued_interval;
} kvt_save_policy;
#define KVT_SAVE_POLICY_DEFAULT {512, 32, 1, 8192}
/* The checkpoint grid the policy needs: gcd(2048, continued_interval), so
 * that the continued points are on it and checkpoints stay 2,048 tokens or
 * less apart (the cold point has a mark of its own). */
uint32_t kvt_save_policy_grid(const kvt_save_policy *p);
/* The cold save point of an n-token prompt (0: none; before the min_tokens
 * and from-disk checks). */
size_t kvt_save_policy_cold(const kvt_save_policy *p, size_t n);
/* Before syncing an n-token prompt into s: make the sync leave a
 * checkpoint at its cold point, for the save there. */
void kvt_save_policy_mark(const kvt_save_policy *p, kvt_session *s, size_t n);
/* Save what the policy asks for after a sync of n prompt tokens of which
 * `from_disk` were restored from the store; fork_at (0: none) is a cold save
 * point besides the policy's own, saved when the session holds a checkpoint
 * there. *saved (may be NULL) receives the number of new snapshots written
 * (not re-saves of stored ones). Save failures are reported, not fatal. */
int kvt_store_apply_policy(kvt_store *st, kvt_session *s, const kvt_save_policy *p, size_t n,
                           size_t from_disk, size_t fork_at, size_t *saved);

/* kvt_store_apply_policy that leaves the saves that failed on another
 * process's lock unreported and says so in *busy: the caller tries them
 * again. */
int kvt_store_apply_policy_busy(kvt_store *st, kvt_session *s, const kvt_save_policy *p, size_t n,
                                size_t from_disk, size_t fork_at, size_t *saved, bool *busy);

/* The number of saves kvt_store_apply_policy would make of s with these
 * arguments (0: nothing to save; policy.c). */
size_t kvt_save_policy_points(const kvt_save_policy *p, const kvt_session *s, size_t n, size_t from_disk,
                              size_t fork_at);

#endif
