/* A fixed pool of worker threads for data-parallel loops. kvt_pool_for splits
 * [0, n) into contiguous ranges, a few per thread, which the threads claim
 * one at a time. Kernels never let the split change a result: each output
 * element is computed start to finish by one thread in a fixed order, so
 * any split and any thread count give identical bytes. */
#ifndef KVT_THREADS_H
#define KVT_THREADS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_pool kvt_pool;
typedef void (*kvt_range_fn)(void *ctx, size_t begin, size_t end);
/* A range with the index of the part that runs it, 0 .. kvt_pool_size() - 1:
 * a part is one thread, which may run several ranges of a job one after
 * another (never two at once), so a part may use scratch of its own. Which
 * ranges a part runs differs from run to run. */
typedef void (*kvt_part_fn)(void *ctx, uint32_t part, size_t begin, size_t end);

/* n_threads 0: all online cores. NULL on failure. */
kvt_pool *kvt_pool_new(uint32_t n_threads);
void kvt_pool_free(kvt_pool *p);
uint32_t kvt_pool_size(const kvt_pool *p);
/* Run fn over [0, n) on all threads (the caller is one of them); returns when
 * every range is done, with how many ranges it ran as (1: unsplit). Every
 * range is at least min_per_range long (n shorter: one range). A thread
 * that lost its core holds up only the range it is running: the others
 * take the rest. Several threads may call on one pool: while the workers
 * run one caller's job, another's ranges run one after another on its own
 * thread (the same ranges, all as part 0). */
uint32_t kvt_pool_for(kvt_pool *p, size_t n, size_t min_per_range, kvt_range_fn fn, void *ctx);
/* The same, telling each range its part. */
uint32_t kvt_pool_for_part(kvt_pool *p, size_t n, size_t min_per_range, kvt_part_fn fn, void *ctx);
/* How many ranges the latest kvt_pool_for on p that had its workers ran as
 * (1: unsplit), so tests can show that a split happened. */
uint32_t kvt_pool_last_parts(const kvt_pool *p);
uint32_t kvt_ncpu(void);

/* The calling thread's CPU policy for work nobody waits on (a save's
 * writes): kvt_thread_idle(true, &was) moves it to SCHED_IDLE, where it runs
 * only on a core no other thread wants, and kvt_thread_idle(false, &was)
 * gives it back the policy it had (was: what the first call saw, -1 when
 * it changed nothing: then the second does nothing). Moving a
 * thread back out of SCHED_IDLE takes CAP_SYS_NICE or an RLIMIT_NICE that
 * allows the thread's nice value: kvt_thread_idle_ok says, once a process,
 * whether it can be done here (tried on a thread of its own that then
 * ends), and kvt_thread_idle does nothing without it, nor for a thread
 * under a real-time policy. True when the thread is now as asked. */
bool kvt_thread_idle_ok(void);
bool kvt_thread_idle(bool on, int *was);

/* Whether p's threads spin while they wait now (false for a while after
 * their yields of the CPU came back late for more than a quarter of 20 ms:
 * the cores are crowded). */
bool kvt_pool_spinning(const kvt_pool *p);

/* Tests: KVT_POOL_FAULT_STATIC splits a job into one range a thread, range
 * k on thread k (a thread that lost its core holds up the whole job);
 * KVT_POOL_FAULT_SHARED_PART tells every range it is part 0;
 * KVT_POOL_FAULT_CALM_AT_ONCE stops the spinning at the first late yield. */
enum { KVT_POOL_FAULT_STATIC = 1, KVT_POOL_FAULT_SHARED_PART, KVT_POOL_FAULT_CALM_AT_ONCE };
extern int kvt_pool_fault;
/* Tests: called instead of sched_yield() while a thread spins, when set. */
extern void (*kvt_pool_test_yield)(void);

#endif
