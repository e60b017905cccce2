/* The disk tier's segment files: where block records live (docs/STORE.md).
 *
 * DIR/kvtier.db-seg<N> (N >= 1) are append-only files of block records laid
 * end to end; the database says where each block is (seg, off, bytes). A
 * save appends its new blocks to the current segment and syncs it before
 * the transaction that names them commits, so a committed row never points
 * at bytes the disk may not hold. A load reads a snapshot's blocks with one
 * read each, in order, from ranges that are contiguous when they were saved
 * together. Space of removed blocks is given back to the file system (holes
 * punched, a segment without blocks deleted).
 *
 * Writes, syncs and truncation go through SQLite's default VFS, so a VFS
 * shim that models a disk (tests/test_store_power.c) sees them as it sees
 * the database's. Reads and the punching of holes use a descriptor of the
 * segment's own: the VFS reads into one buffer a call, and a load reads a
 * block's pieces into the session's rows with one. That descriptor also
 * starts the writeback of what a writer appends, every 8 MiB
 * (sync_file_range): only when bytes reach the disk changes, not what the
 * sync before a commit makes durable. Callers serialise writers (the
 * database's write lock). */
#ifndef KVT_SEGMENTS_H
#define KVT_SEGMENTS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

typedef struct kvt_segs kvt_segs;

/* The segments beside the database at db_path; NULL when out of memory. */
kvt_segs *kvt_segs_new(const char *db_path);
void kvt_segs_free(kvt_segs *g);
/* Close every open segment (another process may have removed or replaced
 * them); the next call opens them again. */
void kvt_segs_close_all(kvt_segs *g);

/* len bytes at off of segment seg. KVT_EFORMAT when the segment or the
 * range is missing (a block that is not there), KVT_EIO on a read error. */
int kvt_segs_read(kvt_segs *g, uint32_t seg, uint64_t off, void *p, size_t len);
/* The same into the n pieces of iov, in order, with one system call where
 * it can (a load reads a block straight into the session's rows); iov is
 * used up (changed). Two threads may call it at once (and nothing else
 * meanwhile). */
int kvt_segs_readv(kvt_segs *g, uint32_t seg, uint64_t off, struct iovec *iov, int n);

/* The segment's size in bytes (0 when it does not exist). */
int kvt_segs_size(kvt_segs *g, uint32_t seg, uint64_t *size);
/* Write len bytes at off of seg (created when missing). KVT_EIO on failure,
 * "disk full" in its message when the disk (or the cap, kvt_segs_cap) is. */
int kvt_segs_write(kvt_segs *g, uint32_t seg, uint64_t off, const void *p, size_t len);
/* The same from the n pieces of iov, in order (a save writes a block's rows
 * from where they lie); seen (may be NULL) is given each piece just before
 * it is written, at the priority of the write (kvt_segs_background): it
 * must take no lock. */
int kvt_segs_writev(kvt_segs *g, uint32_t seg, uint64_t off, const struct iovec *iov, int n,
                    void (*seen)(void *, const void *, size_t), void *arg);
/* Whether a write failed for lack of room (a full disk, or the cap) since
 * the last call; clears it. */
bool kvt_segs_took_full(kvt_segs *g);
/* Sync every segment written since the last sync (a new one's directory
 * entry too). */
int kvt_segs_sync(kvt_segs *g);
/* Cut seg back to size bytes (the tail a failed or interrupted save left). */
int kvt_segs_truncate(kvt_segs *g, uint32_t seg, uint64_t size);
/* Give the file system back the whole pages inside [off, off + len) of seg
 * (best effort: the bytes are no longer referenced). */
void kvt_segs_release(kvt_segs *g, uint32_t seg, uint64_t off, uint64_t len);
/* Delete seg. */
int kvt_segs_remove(kvt_segs *g, uint32_t seg);
/* This thread's writes are background work while test(arg) says so
 * (asked before each MiB): they run at SCHED_IDLE (kvt_thread_idle), on a
 * core no other thread wants. test runs at that priority: it must take no
 * lock. NULL: never (the default of every thread). */
void kvt_segs_background(bool (*test)(void *), void *arg);
/* Tests: writeback steps started (sync_file_range calls that succeeded);
 * kvt_segs_fault_no_wb leaves the writeback to the kernel and the sync, as
 * before the steps. With kvt_segs_probe set, every piece written records
 * the writing thread's policy (sched_getscheduler) in
 * kvt_segs_seen_policy, and is shown to kvt_segs_probe_piece when set
 * (where its bytes came from). */
extern _Atomic uint64_t kvt_segs_wb_steps;
extern bool kvt_segs_fault_no_wb;
extern bool kvt_segs_probe;
extern _Atomic int kvt_segs_seen_policy;
extern void (*kvt_segs_probe_piece)(const void *p, size_t len);
/* Tests: writes that would take the segments past `bytes` in all fail as on
 * a full disk (0: no cap). */
void kvt_segs_cap(kvt_segs *g, uint64_t bytes);

#endif
