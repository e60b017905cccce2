/* Segment files of the disk tier (segments.h). */
#include "store/segments.h"
#include "kvtier.h"
#include "base/threads.h"
#include "base/util.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define OPEN_MAX 8 /* segments kept open at once */
/* The unix VFS writes at most 128 KiB - 1 bytes a call (it keeps only the
 * low 17 bits of a write's length): larger ones go in pieces. */
#define PIECE 65536
/* Writeback in steps: once a segment holds WB_STEP bytes written and not
 * yet on their way to the disk, the writer starts their writeback
 * (sync_file_range), then waits for the step before (docs/STORE.md,
 * "Writes that leave the steps alone"). */
#define WB_STEP (8u << 20)
/* A background writer's test (kvt_segs_background) is asked again after
 * this many bytes (a multiple of PIECE). */
#define IDLE_CHECK (1u << 20)

typedef struct seg_file {
    uint32_t seg;          /* 0: a free slot */
    sqlite3_file *f;       /* through the VFS: reads, writes, syncs */
    int fd;                /* for reads and punching holes (-1 until needed) */
    bool dirty;            /* written since its last sync */
    int readers;           /* kvt_segs_readv calls reading it now: not closed */
    uint64_t used;         /* last use, to close the oldest */
    bool wb;               /* wb_from and wb_wait hold (since the first write) */
    uint64_t wb_from;      /* written bytes from here on: writeback not started */
    uint64_t wb_wait;      /* from here to wb_from: started, not waited for */
} seg_file;

struct kvt_segs {
    char *db_path;
    sqlite3_vfs *vfs;
    seg_file open[OPEN_MAX];
    uint64_t clock;
    uint64_t cap;          /* 0: none */
    bool full;             /* a write failed for lack of room (kvt_segs_took_full) */
    pthread_mutex_t mu;    /* the table of open segments, for readv on two threads */
};

kvt_segs *kvt_segs_new(const char *db_path)
{
    kvt_segs *g = kvt_calloc(1, sizeof *g);
    if (!g) return NULL;
    g->db_path = kvt_strndup(db_path, strlen(db_path));
    if (!g->db_path) { free(g); return NULL; }
    for (int i = 0; i < OPEN_MAX; i++) g->open[i].fd = -1;
    pthread_mutex_init(&g->mu, NULL);
    return g;
}

static void close_slot(seg_file *s)
{
    if (s->f) {
        if (s->f->pMethods) s->f->pMethods->xClose(s->f);
        free(s->f);
    }
    if (s->fd >= 0) close(s->fd);
    *s = (seg_file){.fd = -1};
}

void kvt_segs_close_all(kvt_segs *g)
{
    if (!g) return;
    for (int i = 0; i < OPEN_MAX; i++) close_slot(&g->open[i]);
}

void kvt_segs_free(kvt_segs *g)
{
    if (!g) return;
    kvt_segs_close_all(g);
    pthread_mutex_destroy(&g->mu);
    free(g->db_path);
    free(g);
}

void kvt_segs_cap(kvt_segs *g, uint64_t bytes) { g->cap = bytes; }

/* DIR/kvtier.db-seg<N>: a name the unix VFS takes for a file of the
 * database's (its mode copied from the database's). */
static void seg_path(const kvt_segs *g, uint32_t seg, char *out, size_t cap)
{
    snprintf(out, cap, "%s-seg%u", g->db_path, seg);
}

/* The open segment seg, opened (create: made when missing) if need be;
 * NULL when it does not exist (create false) or cannot be opened. */
static seg_file *get(kvt_segs *g, uint32_t seg, bool create, int *rc)
{
    *rc = KVT_OK;
    seg_file *free_slot = NULL, *oldest = NULL;
    for (int i = 0; i < OPEN_MAX; i++) {
        seg_file *s = &g->open[i];
        if (s->seg == seg) { s->used = ++g->clock; return s; }
        if (!s->seg && !free_slot) free_slot = s;
        if (s->seg && !s->dirty && !s->readers && (!oldest || s->used < oldest->used)) oldest = s;
    }
    if (!g->vfs && !(g->vfs = sqlite3_vfs_find(NULL))) { *rc = kvt_fail(KVT_EIO, "cache store: no file system"); return NULL; }
    seg_file *s = free_slot ? free_slot : oldest;
    if (!s) { *rc = kvt_fail(KVT_EIO, "cache store: too many segments written at once"); return NULL; }
    close_slot(s);
    char path[4200];
    seg_path(g, seg, path, sizeof path);
    int exists = 0;
    if (!create && (g->vfs->xAccess(g->vfs, path, SQLITE_ACCESS_EXISTS, &exists) != SQLITE_OK || !exists)) return NULL;
    sqlite3_file *f = kvt_calloc(1, (size_t)g->vfs->szOsFile);
    if (!f) { *rc = KVT_ENOMEM; return NULL; }
    /* the unix VFS opens every file O_NOFOLLOW; a new segment is made
     * O_EXCL too (writers are serialised by the database's write lock, so
     * one that exists already is not this save's) */
    bool make = create && !(g->vfs->xAccess(g->vfs, path, SQLITE_ACCESS_EXISTS, &exists) == SQLITE_OK && exists);
    int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_MAIN_JOURNAL | (make ? SQLITE_OPEN_CREATE | SQLITE_OPEN_EXCLUSIVE : 0);
    int out = 0;
    int r = g->vfs->xOpen(g->vfs, path, f, flags, &out);
    if (r != SQLITE_OK) {
        if (f->pMethods) f->pMethods->xClose(f);
        free(f);
        if (!create) return NULL;
        *rc = kvt_fail(KVT_EIO, "cache store: cannot create %s (SQLite error %d)", path, r);
        return NULL;
    }
    *s = (seg_file){.seg = seg, .f = f, .fd = -1, .used = ++g->clock};
    return s;
}

static int own_fd(kvt_segs *g, seg_file *s)
{
    if (s->fd < 0) {
        char path[4200];
        seg_path(g, s->seg, path, sizeof path);
        s->fd = open(path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
        if (s->fd < 0 && errno != ELOOP) /* a store this process may only read */
            s->fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    }
    return s->fd;
}

int kvt_segs_readv(kvt_segs *g, uint32_t seg, uint64_t off, struct iovec *iov, int n)
{
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        if (iov[i].iov_len > INT32_MAX - len)
            return kvt_fail(KVT_EFORMAT, "segment %u: a read of more than %d bytes", seg, INT32_MAX);
        len += iov[i].iov_len;
    }
    if (off > (uint64_t)INT64_MAX - len)
        return kvt_fail(KVT_EFORMAT, "segment %u: %zu bytes at %llu", seg, len, (unsigned long long)off);
    int rc = KVT_OK, fd = -1;
    pthread_mutex_lock(&g->mu);
    seg_file *s = get(g, seg, false, &rc);
    if (s && (fd = own_fd(g, s)) >= 0) s->readers++;
    pthread_mutex_unlock(&g->mu);
    if (!s) return rc ? rc : kvt_fail(KVT_EFORMAT, "segment %u is missing", seg);
    if (fd < 0) return kvt_fail(KVT_EIO, "segment %u: cannot open it to read (%s)", seg, strerror(errno));
    while (len > 0) {
        ssize_t r = preadv(fd, iov, n < IOV_MAX ? n : IOV_MAX, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { rc = kvt_fail(KVT_EIO, "segment %u: read error (%s)", seg, strerror(errno)); break; }
        if (r == 0) {
            rc = kvt_fail(KVT_EFORMAT, "segment %u ends before %llu", seg, (unsigned long long)(off + len));
            break;
        }
        off += (uint64_t)r;
        len -= (size_t)r;
        /* a short read: go on past what it filled */
        size_t k = (size_t)r;
        while (n > 0 && k >= iov->iov_len) {
            k -= iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + k;
            iov->iov_len -= k;
        }
    }
    pthread_mutex_lock(&g->mu);
    s->readers--;
    pthread_mutex_unlock(&g->mu);
    return rc;
}

int kvt_segs_read(kvt_segs *g, uint32_t seg, uint64_t off, void *p, size_t len)
{
    struct iovec v = {p, len};
    return kvt_segs_readv(g, seg, off, &v, 1);
}

int kvt_segs_size(kvt_segs *g, uint32_t seg, uint64_t *size)
{
    *size = 0;
    int rc;
    seg_file *s = get(g, seg, false, &rc);
    if (!s) return rc;
    sqlite3_int64 n = 0;
    int r = s->f->pMethods->xFileSize(s->f, &n);
    if (r != SQLITE_OK) return kvt_fail(KVT_EIO, "segment %u: size unknown (SQLite error %d)", seg, r);
    *size = (uint64_t)n;
    return KVT_OK;
}

_Atomic uint64_t kvt_segs_wb_steps;
bool kvt_segs_fault_no_wb;
bool kvt_segs_probe;
void (*kvt_segs_probe_piece)(const void *p, size_t len);
_Atomic int kvt_segs_seen_policy = -1;

static _Thread_local bool (*bg_test)(void *);
static _Thread_local void *bg_arg;

void kvt_segs_background(bool (*test)(void *), void *arg)
{
    bg_test = test;
    bg_arg = arg;
}

/* Start the writeback of what seg holds written up to end in steps of
 * WB_STEP, and wait for all but the latest step: a save keeps at most two
 * steps dirty or in flight, and the sync before its commit finds little
 * left. Best effort: the sync is what makes them durable. */
static void writeback(kvt_segs *g, seg_file *s, uint64_t off, uint64_t end)
{
    if (kvt_segs_fault_no_wb || own_fd(g, s) < 0) return;
    if (!s->wb || off < s->wb_wait || off > s->wb_from + WB_STEP) { /* a first write, or not an append */
        s->wb = true;
        s->wb_from = s->wb_wait = off / 4096 * 4096;
    }
    while (end - s->wb_from >= WB_STEP) {
        if (sync_file_range(s->fd, (off_t)s->wb_from, WB_STEP, SYNC_FILE_RANGE_WRITE) == 0) kvt_segs_wb_steps++;
        s->wb_from += WB_STEP;
        if (s->wb_from - s->wb_wait > WB_STEP) {
            sync_file_range(s->fd, (off_t)s->wb_wait, (off_t)(s->wb_from - WB_STEP - s->wb_wait),
                            SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
            s->wb_wait = s->wb_from - WB_STEP;
        }
    }
}

int kvt_segs_writev(kvt_segs *g, uint32_t seg, uint64_t off, const struct iovec *iov, int n,
                    void (*seen)(void *, const void *, size_t), void *arg)
{
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        if (iov[i].iov_len > INT32_MAX - len) return kvt_fail(KVT_EINVAL, "segment write of more than %d bytes", INT32_MAX);
        len += iov[i].iov_len;
    }
    if (off > (uint64_t)INT64_MAX - len) return kvt_fail(KVT_EINVAL, "segment write of %zu bytes", len);
    if (g->cap && off + len > g->cap) {
        g->full = true;
        return kvt_fail(KVT_EIO, "cache store: disk full (segment %u)", seg);
    }
    int rc;
    seg_file *s = get(g, seg, true, &rc);
    if (!s) return rc;
    s->dirty = true;
    /* a background writer's pieces (and what seen does with them) run at
     * idle priority while its test says so: neither holds a lock of this
     * process's */
    bool idle = false;
    int was = -1;
    size_t done = 0, next_check = 0;
    for (int i = 0; i < n; i++) {
        const uint8_t *p = iov[i].iov_base;
        for (size_t at = 0; at < iov[i].iov_len;) {
            if (bg_test && done >= next_check) {
                bool want = bg_test(bg_arg);
                if (want != idle && kvt_thread_idle(want, &was)) idle = want;
                next_check = done + IDLE_CHECK;
            }
            size_t k = iov[i].iov_len - at < PIECE ? iov[i].iov_len - at : PIECE;
            if (kvt_segs_probe) {
                kvt_segs_seen_policy = sched_getscheduler(0);
                if (kvt_segs_probe_piece) kvt_segs_probe_piece(p + at, k);
            }
            if (seen) seen(arg, p + at, k);
            int r = s->f->pMethods->xWrite(s->f, p + at, (int)k, (sqlite3_int64)(off + done));
            if (r != SQLITE_OK) {
                if (idle) kvt_thread_idle(false, &was);
                if ((r & 0xff) == SQLITE_FULL) g->full = true;
                return kvt_fail(KVT_EIO, "cache store: segment %u: %s", seg,
                                (r & 0xff) == SQLITE_FULL ? "disk full" : "write error");
            }
            at += k;
            done += k;
        }
    }
    writeback(g, s, off, off + len);
    if (idle) kvt_thread_idle(false, &was);
    return KVT_OK;
}

int kvt_segs_write(kvt_segs *g, uint32_t seg, uint64_t off, const void *p, size_t len)
{
    if (len > INT32_MAX) return kvt_fail(KVT_EINVAL, "segment write of %zu bytes", len);
    struct iovec v = {(void *)p, len};
    return kvt_segs_writev(g, seg, off, &v, 1, NULL, NULL);
}

bool kvt_segs_took_full(kvt_segs *g)
{
    bool f = g->full;
    g->full = false;
    return f;
}

int kvt_segs_sync(kvt_segs *g)
{
    for (int i = 0; i < OPEN_MAX; i++) {
        seg_file *s = &g->open[i];
        if (!s->seg || !s->dirty) continue;
        int r = s->f->pMethods->xSync(s->f, SQLITE_SYNC_FULL);
        if (r != SQLITE_OK) return kvt_fail(KVT_EIO, "cache store: segment %u: sync failed (SQLite error %d)", s->seg, r);
        s->dirty = false;
    }
    return KVT_OK;
}

int kvt_segs_truncate(kvt_segs *g, uint32_t seg, uint64_t size)
{
    int rc;
    seg_file *s = get(g, seg, false, &rc);
    if (!s) return rc;
    int r = s->f->pMethods->xTruncate(s->f, (sqlite3_int64)size);
    if (r != SQLITE_OK) return kvt_fail(KVT_EIO, "cache store: segment %u: truncate failed (SQLite error %d)", seg, r);
    s->dirty = true;
    s->wb = false;
    return KVT_OK;
}

void kvt_segs_release(kvt_segs *g, uint32_t seg, uint64_t off, uint64_t len)
{
    /* whole pages only: a hole zeroes the partial pages at its ends, which
     * hold the neighbours' bytes */
    const uint64_t page = 4096;
    uint64_t a = (off + page - 1) / page * page, b = (off + len) / page * page;
    if (b <= a) return;
    int rc;
    seg_file *s = get(g, seg, false, &rc);
    if (s && own_fd(g, s) >= 0) fallocate(s->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)a, (off_t)(b - a));
}

int kvt_segs_remove(kvt_segs *g, uint32_t seg)
{
    for (int i = 0; i < OPEN_MAX; i++)
        if (g->open[i].seg == seg) close_slot(&g->open[i]);
    if (!g->vfs && !(g->vfs = sqlite3_vfs_find(NULL))) return kvt_fail(KVT_EIO, "cache store: no file system");
    char path[4200];
    seg_path(g, seg, path, sizeof path);
    int r = g->vfs->xDelete(g->vfs, path, 1);
    if (r != SQLITE_OK && r != SQLITE_IOERR_DELETE_NOENT)
        return kvt_fail(KVT_EIO, "cache store: cannot delete segment %u (SQLite error %d)", seg, r);
    return KVT_OK;
}
