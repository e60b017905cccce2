/* Durability of the disk tier under power cuts, shown the way SQLite shows
 * its own: a VFS shim over the default "unix" one keeps, for each file, what
 * a disk would keep (its contents as of its last sync) and the writes made
 * since, and cuts the power at a chosen write or sync. The files then get
 * what a disk could hold after the cut: none of the writes since their last
 * sync, a prefix of them with the next one torn, any subset of them (landing
 * out of order), or all; the -shm is gone. Every VFS call after the cut
 * fails, so the store stops where it was.
 *
 * The store is then opened normally, and:
 *   - SQLite's integrity check passes;
 *   - the store's running totals (bytes, snapshots, blocks, references)
 *     equal what its tables add up to;
 *   - it holds exactly the entries it held when the operation in flight
 *     began, or those it would hold had that operation finished (known by
 *     running it on a copy of the state it began from): every entry whose
 *     save returned is there;
 *   - every entry loads, bit for bit, the state of its prefix;
 *   - it saves again.
 *
 * The cuts fall in saves (with evictions and the thinning of extended
 * snapshots), in recording a use (loads), in gc (with its checkpoint) and in
 * closing a store (its checkpoint and the WAL's deletion). The same test with
 * the store at synchronous=OFF must find lost entries: the negative control
 * that shows the checks can see a store that is not durable. */
#include "test.h"
#include "store/testing.h"
#include "store/store.h"
#include "base/util.h"

#include <dirent.h>
#include <fcntl.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

/* ---- the shim ---- */

enum { OP_WRITE, OP_TRUNCATE, OP_CREATE, OP_DELETE };

typedef struct pop { int kind; int64_t off; size_t len; uint8_t *data; uint32_t gen; } pop;

/* One path as the disk keeps it: its durable contents (exists, img, gen:
 * which creation of the file they belong to) and the operations since. */
typedef struct pfile {
    char path[512];
    bool exists;
    uint8_t *img;
    size_t len, cap;
    uint32_t gen, cur_gen;
    pop *ops;
    size_t n_ops, cap_ops;
    size_t op_mark; /* ops before the workload operation in flight */
} pfile;

typedef struct shim_file { sqlite3_file base; pfile *pf; sqlite3_file *real; } shim_file;

static struct {
    sqlite3_vfs vfs;
    sqlite3_vfs *real;
    char dir[300];       /* files under it are modelled */
    pfile *files[16];
    int n_files;
    bool armed;          /* count events and cut */
    bool cut;            /* the power is off: every call fails */
    uint64_t events, cut_at;
    bool cut_on_sync;    /* cut at the first sync from cut_at on, not at cut_at */
    int cut_kind;        /* the event the cut fell on: 0 write, 1 sync, 2 truncate, 3 delete */
} P;

static bool grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return true;
    size_t c = *cap ? *cap : 16, bytes;
    while (c < need) c *= 2;
    if (!kvt_mul_ok(c, elem, &bytes)) return false;
    void *g = realloc(*p, bytes);
    if (!g) return false;
    *p = g;
    *cap = c;
    return true;
}

/* Reload a path's durable contents from the real file (declared durable). */
static void pf_reload(pfile *pf)
{
    for (size_t i = 0; i < pf->n_ops; i++) free(pf->ops[i].data);
    pf->n_ops = pf->op_mark = 0;
    pf->len = 0;
    size_t len = 0;
    char *text = kvt_test_read_file(pf->path, &len);
    pf->exists = text != NULL;
    if (text && grow((void **)&pf->img, &pf->cap, len + 1, 1)) {
        memcpy(pf->img, text, len);
        pf->len = len;
    }
    free(text);
    pf->cur_gen = pf->gen;
}

static pfile *pf_find(const char *path, bool add)
{
    for (int i = 0; i < P.n_files; i++)
        if (!strcmp(P.files[i]->path, path)) return P.files[i];
    if (!add || P.n_files == 16) return NULL;
    pfile *pf = calloc(1, sizeof *pf);
    snprintf(pf->path, sizeof pf->path, "%s", path);
    pf_reload(pf);
    P.files[P.n_files++] = pf;
    return pf;
}

static void pf_push(pfile *pf, int kind, int64_t off, const void *data, size_t len)
{
    if (!grow((void **)&pf->ops, &pf->cap_ops, pf->n_ops + 1, sizeof *pf->ops)) abort();
    pop *o = &pf->ops[pf->n_ops++];
    *o = (pop){kind, off, len, NULL, pf->cur_gen};
    if (kind == OP_WRITE) {
        o->data = malloc(len ? len : 1);
        memcpy(o->data, data, len);
    }
}

/* Apply op o (torn: only its first keep bytes) to an image. */
static void pf_apply(uint8_t **img, size_t *len, size_t *cap, bool *exists, uint32_t *gen, const pop *o, size_t keep)
{
    if (o->kind == OP_CREATE) { *exists = true; *len = 0; *gen = o->gen; return; }
    if (o->kind == OP_DELETE) { *exists = false; *len = 0; return; }
    if (!*exists || o->gen != *gen) return; /* a write to a file whose creation did not land */
    if (o->kind == OP_TRUNCATE) {
        if (!grow((void **)img, cap, (size_t)o->off + 1, 1)) abort();
        if ((size_t)o->off > *len) memset(*img + *len, 0, (size_t)o->off - *len);
        *len = (size_t)o->off;
        return;
    }
    size_t end = (size_t)o->off + keep;
    if (!grow((void **)img, cap, end + 1, 1)) abort();
    if (end > *len) {
        if ((size_t)o->off > *len) memset(*img + *len, 0, (size_t)o->off - *len);
        *len = end;
    }
    memcpy(*img + o->off, o->data, keep);
}

static void pf_sync(pfile *pf)
{
    for (size_t i = 0; i < pf->n_ops; i++) {
        pf_apply(&pf->img, &pf->len, &pf->cap, &pf->exists, &pf->gen, &pf->ops[i], pf->ops[i].len);
        free(pf->ops[i].data);
    }
    pf->n_ops = pf->op_mark = 0;
}

/* One more write, sync, truncate or delete; false when the power goes off
 * at it (it does not happen). */
static bool event(int kind)
{
    if (!P.armed) return true;
    ++P.events;
    if (P.cut_on_sync ? kind == 1 && P.events >= P.cut_at : P.events == P.cut_at) {
        P.cut = true;
        P.cut_kind = kind;
        return false;
    }
    return true;
}

static bool modelled(const char *path) { return P.dir[0] && !strncmp(path, P.dir, strlen(P.dir)); }

#define REAL(f) (((shim_file *)(f))->real)

static int s_close(sqlite3_file *f)
{
    int rc = REAL(f)->pMethods ? REAL(f)->pMethods->xClose(REAL(f)) : SQLITE_OK;
    return rc;
}

static int s_read(sqlite3_file *f, void *buf, int amt, sqlite3_int64 off)
{
    if (P.cut) return SQLITE_IOERR_READ;
    return REAL(f)->pMethods->xRead(REAL(f), buf, amt, off);
}

static int s_write(sqlite3_file *f, const void *buf, int amt, sqlite3_int64 off)
{
    pfile *pf = ((shim_file *)f)->pf;
    if (P.cut) return SQLITE_IOERR_WRITE;
    if (pf && P.armed) {
        if (!event(0)) return SQLITE_IOERR_WRITE;
        pf_push(pf, OP_WRITE, off, buf, (size_t)amt);
    }
    return REAL(f)->pMethods->xWrite(REAL(f), buf, amt, off);
}

static int s_truncate(sqlite3_file *f, sqlite3_int64 size)
{
    pfile *pf = ((shim_file *)f)->pf;
    if (P.cut) return SQLITE_IOERR_TRUNCATE;
    if (pf && P.armed) {
        if (!event(2)) return SQLITE_IOERR_TRUNCATE;
        pf_push(pf, OP_TRUNCATE, size, NULL, 0);
    }
    return REAL(f)->pMethods->xTruncate(REAL(f), size);
}

/* The disk keeps what was written before a sync. No real fsync: the model
 * is the disk. */
static int s_sync(sqlite3_file *f, int flags)
{
    pfile *pf = ((shim_file *)f)->pf;
    if (P.cut) return SQLITE_IOERR_FSYNC;
    if (pf && P.armed) {
        if (!event(1)) return SQLITE_IOERR_FSYNC;
        pf_sync(pf);
    }
    return SQLITE_OK;
}

static int s_size(sqlite3_file *f, sqlite3_int64 *size)
{
    if (P.cut) return SQLITE_IOERR_FSTAT;
    return REAL(f)->pMethods->xFileSize(REAL(f), size);
}

static int s_lock(sqlite3_file *f, int lock)
{
    if (P.cut) return SQLITE_IOERR_LOCK;
    return REAL(f)->pMethods->xLock(REAL(f), lock);
}

static int s_unlock(sqlite3_file *f, int lock) { return REAL(f)->pMethods->xUnlock(REAL(f), lock); }

static int s_reserved(sqlite3_file *f, int *out)
{
    if (P.cut) return SQLITE_IOERR_CHECKRESERVEDLOCK;
    return REAL(f)->pMethods->xCheckReservedLock(REAL(f), out);
}

static int s_fcntl(sqlite3_file *f, int op, void *arg) { return REAL(f)->pMethods->xFileControl(REAL(f), op, arg); }
static int s_sector(sqlite3_file *f) { return REAL(f)->pMethods->xSectorSize(REAL(f)); }
static int s_caps(sqlite3_file *f) { return REAL(f)->pMethods->xDeviceCharacteristics(REAL(f)); }

static int s_shm_map(sqlite3_file *f, int pg, int sz, int extend, void volatile **pp)
{
    if (P.cut) return SQLITE_IOERR_SHMMAP;
    return REAL(f)->pMethods->xShmMap(REAL(f), pg, sz, extend, pp);
}

static int s_shm_lock(sqlite3_file *f, int off, int n, int flags)
{
    if (P.cut && (flags & SQLITE_SHM_LOCK)) return SQLITE_IOERR_SHMLOCK;
    return REAL(f)->pMethods->xShmLock(REAL(f), off, n, flags);
}

static void s_shm_barrier(sqlite3_file *f) { REAL(f)->pMethods->xShmBarrier(REAL(f)); }
static int s_shm_unmap(sqlite3_file *f, int del) { return REAL(f)->pMethods->xShmUnmap(REAL(f), del); }

static const sqlite3_io_methods shim_io = {
    2, s_close, s_read, s_write, s_truncate, s_sync, s_size, s_lock, s_unlock, s_reserved, s_fcntl, s_sector, s_caps,
    s_shm_map, s_shm_lock, s_shm_barrier, s_shm_unmap, NULL, NULL,
};

static int v_open(sqlite3_vfs *vfs, const char *name, sqlite3_file *f, int flags, int *out)
{
    shim_file *sf = (shim_file *)f;
    sf->base.pMethods = NULL;
    sf->real = (sqlite3_file *)(sf + 1);
    sf->pf = NULL;
    if (P.cut) return SQLITE_IOERR;
    bool track = name && modelled(name) && (flags & (SQLITE_OPEN_MAIN_DB | SQLITE_OPEN_WAL | SQLITE_OPEN_MAIN_JOURNAL));
    bool existed = name && access(name, F_OK) == 0;
    if (track && P.armed && !existed && !event(0)) return SQLITE_IOERR;
    int rc = P.real->xOpen(P.real, name, sf->real, flags, out);
    if (rc != SQLITE_OK) return rc;
    sf->base.pMethods = &shim_io;
    if (track) {
        pfile *pf = pf_find(name, false);
        if (!pf && (pf = pf_find(name, true)) && !existed) pf->exists = false; /* the real file is new */
        if (!existed && P.armed && pf) { /* a new file: its directory entry lasts once it is synced */
            pf->cur_gen++;
            pf_push(pf, OP_CREATE, 0, NULL, 0);
        }
        sf->pf = pf;
    }
    return SQLITE_OK;
}

static int v_delete(sqlite3_vfs *vfs, const char *name, int dir_sync)
{
    if (P.cut) return SQLITE_IOERR_DELETE;
    pfile *pf = modelled(name) ? pf_find(name, false) : NULL;
    if (pf && P.armed) {
        if (!event(3)) return SQLITE_IOERR_DELETE;
        pf_push(pf, OP_DELETE, 0, NULL, 0);
        if (dir_sync) pf_sync(pf);
    }
    return P.real->xDelete(P.real, name, dir_sync);
}

static int v_access(sqlite3_vfs *vfs, const char *name, int flags, int *out)
{
    if (P.cut) return SQLITE_IOERR_ACCESS;
    return P.real->xAccess(P.real, name, flags, out);
}

static int v_full(sqlite3_vfs *vfs, const char *name, int n, char *out) { return P.real->xFullPathname(P.real, name, n, out); }
static void *v_dlopen(sqlite3_vfs *vfs, const char *p) { return P.real->xDlOpen(P.real, p); }
static void v_dlerror(sqlite3_vfs *vfs, int n, char *msg) { P.real->xDlError(P.real, n, msg); }
static void (*v_dlsym(sqlite3_vfs *vfs, void *h, const char *s))(void) { return P.real->xDlSym(P.real, h, s); }
static void v_dlclose(sqlite3_vfs *vfs, void *h) { P.real->xDlClose(P.real, h); }
static int v_random(sqlite3_vfs *vfs, int n, char *out) { return P.real->xRandomness(P.real, n, out); }
static int v_sleep(sqlite3_vfs *vfs, int us) { return P.real->xSleep(P.real, us); }
static int v_time(sqlite3_vfs *vfs, double *t) { return P.real->xCurrentTime(P.real, t); }
static int v_error(sqlite3_vfs *vfs, int n, char *msg) { return P.real->xGetLastError(P.real, n, msg); }
static int v_time64(sqlite3_vfs *vfs, sqlite3_int64 *t) { return P.real->xCurrentTimeInt64(P.real, t); }

static bool shim_install(void)
{
    P.real = sqlite3_vfs_find("unix");
    if (!P.real || P.real->iVersion < 2) return false;
    P.vfs = (sqlite3_vfs){2, (int)(sizeof(shim_file) + (size_t)P.real->szOsFile), P.real->mxPathname, NULL,
                          "kvtier-power-cut", NULL, v_open, v_delete, v_access, v_full, v_dlopen, v_dlerror, v_dlsym,
                          v_dlclose, v_random, v_sleep, v_time, v_error, v_time64};
    return sqlite3_vfs_register(&P.vfs, 1) == SQLITE_OK;
}

static void shim_remove(void)
{
    sqlite3_vfs_unregister(&P.vfs);
    sqlite3_vfs_register(P.real, 1);
    for (int i = 0; i < P.n_files; i++) {
        pfile *pf = P.files[i];
        for (size_t k = 0; k < pf->n_ops; k++) free(pf->ops[k].data);
        free(pf->ops);
        free(pf->img);
        free(pf);
    }
    memset(&P, 0, sizeof P);
}

/* Start counting: what the files hold now is on the disk. The power goes
 * off gap events on, or at the first sync from there. */
static void arm(uint64_t gap, bool on_sync)
{
    for (int i = 0; i < P.n_files; i++) pf_reload(P.files[i]);
    P.cut = false;
    P.armed = true;
    P.cut_at = P.events + gap;
    P.cut_on_sync = on_sync;
}

/* The workload operation in flight starts here (for its oracle). */
static void mark_op(void)
{
    for (int i = 0; i < P.n_files; i++) P.files[i]->op_mark = P.files[i]->n_ops;
}

static bool put_file(const char *path, bool exists, const uint8_t *p, size_t len)
{
    if (!exists) return unlink(path) == 0 || access(path, F_OK) != 0;
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return false;
    bool ok = len == 0 || write(fd, p, len) == (ssize_t)len;
    return close(fd) == 0 && ok;
}

enum { LAND_NONE, LAND_TORN_PREFIX, LAND_SUBSET, LAND_ALL, N_LAND };
static const char *const land_name[N_LAND] = {"none land", "a prefix lands, the next torn", "any subset lands",
                                              "all land"};

/* Put on the real files what the disk holds after the cut (the store is
 * closed): each file's durable contents and, by mode, some of its
 * operations since; the -shm is gone. */
static bool power_cut(int mode, uint64_t *rng)
{
    bool ok = true;
    for (int i = 0; i < P.n_files; i++) {
        pfile *pf = P.files[i];
        uint8_t *img = NULL;
        size_t len = 0, cap = 0;
        bool exists = pf->exists;
        uint32_t gen = pf->gen;
        if (!grow((void **)&img, &cap, pf->len + 1, 1)) return false;
        memcpy(img, pf->img, pf->len);
        len = pf->len;
        size_t prefix = pf->n_ops ? kvt_test_rand(rng) % (pf->n_ops + 1) : 0;
        for (size_t k = 0; k < pf->n_ops; k++) {
            const pop *o = &pf->ops[k];
            size_t keep = o->len;
            bool lands = mode == LAND_ALL || (mode == LAND_SUBSET && kvt_test_rand(rng) % 2) ||
                         (mode == LAND_TORN_PREFIX && k <= prefix);
            if (mode == LAND_TORN_PREFIX && k == prefix) { /* torn: a part of it lands */
                if (o->kind != OP_WRITE || o->len < 2) lands = false;
                else keep = 1 + kvt_test_rand(rng) % (o->len - 1);
            } else if (mode == LAND_SUBSET && lands && o->kind == OP_WRITE && o->len > 1 && kvt_test_rand(rng) % 8 == 0) {
                keep = 1 + kvt_test_rand(rng) % (o->len - 1);
            }
            if (lands) pf_apply(&img, &len, &cap, &exists, &gen, o, keep);
        }
        ok &= put_file(pf->path, exists, img, len);
        free(img);
    }
    char shm[600];
    snprintf(shm, sizeof shm, "%s/kvtier.db-shm", P.dir);
    unlink(shm);
    return ok;
}

/* The files as they were when the operation in flight began (every
 * operation before it applied), into dir: the state its oracle runs on. */
static bool state_before_op(const char *dir)
{
    bool ok = true;
    for (int i = 0; i < P.n_files; i++) {
        pfile *pf = P.files[i];
        uint8_t *img = NULL;
        size_t len = pf->len, cap = 0;
        bool exists = pf->exists;
        uint32_t gen = pf->gen;
        if (!grow((void **)&img, &cap, pf->len + 1, 1)) return false;
        memcpy(img, pf->img, pf->len);
        for (size_t k = 0; k < pf->op_mark; k++) pf_apply(&img, &len, &cap, &exists, &gen, &pf->ops[k], pf->ops[k].len);
        char path[700];
        snprintf(path, sizeof path, "%s/%s", dir, pf->path + strlen(P.dir));
        ok &= put_file(path, exists, img, len);
        free(img);
    }
    return ok;
}

/* ---- the workload ---- */

#define N_PROMPTS 10
#define MAX_PTS 5

typedef struct prompt {
    int32_t t[420];
    size_t len;
    size_t pts[MAX_PTS];      /* save points: the checkpoints and the length */
    uint64_t twin[MAX_PTS];   /* a cold run's digest at each */
    int n_pts;
    kvt_session *s;           /* holding t with checkpoints at every save point */
} prompt;

typedef struct entry { int64_t id; int p, k; } entry; /* prompt p at its save point k */

typedef struct world {
    kvt_model *m;
    prompt pr[N_PROMPTS];
    char dir[256], oracle_dir[256];
    uint64_t budget;
    bool synchronous;
    entry known[16384];       /* every entry a save returned, by id (ids of lost saves come back) */
    size_t n_known;
    kvt_session *scratch;
} world;

static bool make_prompts(world *w)
{
    uint64_t seed = 977;
    kvt_session_opts so = {.n_ctx = 512, .checkpoint_interval = 128};
    for (int p = 0; p < N_PROMPTS; p++) {
        prompt *x = &w->pr[p];
        x->len = 150 + kvt_test_rand(&seed) % 270;
        x->t[0] = 256;
        for (size_t i = 1; i < x->len; i++) x->t[i] = (int32_t)(kvt_test_rand(&seed) % 256);
        if (p % 3 == 1) memcpy(x->t, w->pr[p - 1].t, 128 * sizeof(int32_t)); /* a shared first block */
        for (size_t q = 128; q < x->len && x->n_pts < MAX_PTS - 1; q += 128) x->pts[x->n_pts++] = q;
        x->pts[x->n_pts++] = x->len;
        if (kvt_session_new(&x->s, w->m, &so) || kvt_session_sync(x->s, x->t, x->len, NULL)) return false;
        for (int k = 0; k < x->n_pts; k++) {
            kvt_session *s = NULL;
            if (kvt_session_new(&s, w->m, &so) || kvt_session_sync(s, x->t, x->pts[k], NULL)) return false;
            x->twin[k] = kvt_test_digest(s, w->m);
            kvt_session_free(s);
        }
    }
    return !kvt_session_new(&w->scratch, w->m, &so);
}

static const entry *known(const world *w, int64_t id)
{
    for (size_t i = 0; i < w->n_known; i++)
        if (w->known[i].id == id) return &w->known[i];
    return NULL;
}

static void remember(world *w, int64_t id, int p, int k)
{
    for (size_t i = 0; i < w->n_known; i++)
        if (w->known[i].id == id) {
            w->known[i] = (entry){id, p, k};
            return;
        }
    if (w->n_known < sizeof w->known / sizeof w->known[0]) w->known[w->n_known++] = (entry){id, p, k};
}

typedef struct idlist { int64_t v[64]; size_t n; } idlist;

static int list_ids(kvt_store *st, idlist *out)
{
    kvt_store_entry *e = NULL;
    size_t n = 0;
    int rc = kvt_store_list(st, &e, &n);
    out->n = 0;
    for (size_t i = 0; !rc && i < n && out->n < 64; i++) out->v[out->n++] = e[i].id;
    free(e);
    for (size_t i = 1; i < out->n; i++) /* ascending */
        for (size_t j = i; j > 0 && out->v[j - 1] > out->v[j]; j--) {
            int64_t t = out->v[j];
            out->v[j] = out->v[j - 1];
            out->v[j - 1] = t;
        }
    return rc;
}

static bool same_ids(const idlist *a, const idlist *b)
{
    return a->n == b->n && !memcmp(a->v, b->v, a->n * sizeof a->v[0]);
}

static int open_store(world *w, const char *dir, kvt_store **st)
{
    int rc = kvt_store_open(st, dir, w->budget);
    if (rc) return rc;
    kvt_store_set_quiet(*st, true);
    if (!w->synchronous) rc = kvt_store_set_synchronous(*st, false);
    return rc;
}

enum { K_SAVE, K_LOAD, K_RESTORE, K_GC, K_RM, K_REOPEN, N_KIND };
static const char *const kind_name[N_KIND] = {"save", "load (use)", "restore (use)", "gc", "rm", "close and reopen"};

typedef struct op { int kind, p, k; int64_t id; } op;

static op pick_op(world *w, const idlist *now, uint64_t *rng)
{
    op o = {K_SAVE, 0, 0, -1};
    unsigned r = (unsigned)(kvt_test_rand(rng) % 100);
    o.kind = r < 52 ? K_SAVE : r < 70 ? K_LOAD : r < 82 ? K_RESTORE : r < 90 ? K_GC : r < 96 ? K_RM : K_REOPEN;
    if ((o.kind == K_LOAD || o.kind == K_RM) && now->n < (o.kind == K_RM ? 3u : 1u)) o.kind = K_SAVE;
    o.p = (int)(kvt_test_rand(rng) % N_PROMPTS);
    o.k = (int)(kvt_test_rand(rng) % (uint64_t)w->pr[o.p].n_pts);
    if (now->n) o.id = now->v[kvt_test_rand(rng) % now->n];
    return o;
}

/* Run op on the store; the id a save returns in *id. */
static int run_op(world *w, kvt_store **st, const char *dir, const op *o, int64_t *id)
{
    const prompt *x = &w->pr[o->p];
    size_t reused = 0;
    *id = -1;
    switch (o->kind) {
    case K_SAVE: return kvt_store_save(*st, x->s, x->pts[o->k], o->k == x->n_pts - 1 ? "cold" : "continued", id);
    case K_LOAD: return kvt_store_load(*st, o->id, w->scratch);
    case K_RESTORE: return kvt_store_restore_prefix(*st, w->scratch, x->t, x->len, &reused);
    case K_GC: return kvt_store_gc(*st);
    case K_RM: return kvt_store_rm(*st, o->id);
    case K_REOPEN:
        kvt_store_close(*st);
        *st = NULL;
        return open_store(w, dir, st);
    }
    return KVT_EINVAL;
}

/* ---- the checks after a cut ---- */

typedef struct verdict {
    bool integrity_ok;
    bool totals_ok;          /* the running totals equal the tables' sums */
    bool lost;               /* entries present neither before nor after the operation in flight */
    bool committed;          /* the store holds what the operation in flight would have left */
    size_t refused, wrong;   /* entries that do not load, entries that load another state */
    size_t unknown;          /* entries no save returned */
    size_t loaded;
    bool saved_again;
    char why[512];
} verdict;

static size_t integrity_problems(const char *dir, char *first, size_t cap)
{
    char path[400];
    snprintf(path, sizeof path, "%s/kvtier.db", dir);
    sqlite3 *db = NULL;
    size_t n = 0;
    first[0] = 0;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READWRITE, NULL) != SQLITE_OK) {
        snprintf(first, cap, "open: %s", sqlite3_errmsg(db));
        sqlite3_close(db);
        return 1;
    }
    sqlite3_stmt *s = NULL;
    int r = sqlite3_prepare_v2(db, "PRAGMA integrity_check", -1, &s, NULL);
    while (r == SQLITE_OK && (r = sqlite3_step(s)) == SQLITE_ROW) {
        const char *t = (const char *)sqlite3_column_text(s, 0);
        if (t && strcmp(t, "ok")) {
            if (!n) snprintf(first, cap, "%s", t);
            n++;
        }
        r = SQLITE_OK;
    }
    if (r != SQLITE_DONE) {
        if (!n) snprintf(first, cap, "%s", sqlite3_errmsg(db));
        n++;
    }
    sqlite3_finalize(s);
    sqlite3_close(db);
    return n;
}

/* The totals row against what the tables add up to; false (with why) when
 * they differ or cannot be read. */
static bool totals_match(const char *dir, char *why, size_t cap)
{
    char path[400];
    snprintf(path, sizeof path, "%s/kvtier.db", dir);
    sqlite3 *db = NULL;
    sqlite3_stmt *s = NULL;
    bool ok = false;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READWRITE, NULL) == SQLITE_OK &&
        sqlite3_prepare_v2(db, "SELECT bytes = (SELECT COALESCE(SUM(bytes), 0) FROM snaps) + (SELECT COALESCE(SUM(bytes), 0)"
                               " FROM blocks), snaps = (SELECT COUNT(*) FROM snaps), blocks = (SELECT COUNT(*) FROM blocks),"
                               " refs = (SELECT COUNT(*) FROM snap_blocks), bytes FROM totals", -1, &s, NULL) == SQLITE_OK &&
        sqlite3_step(s) == SQLITE_ROW) {
        ok = sqlite3_column_int(s, 0) && sqlite3_column_int(s, 1) && sqlite3_column_int(s, 2) && sqlite3_column_int(s, 3);
        if (!ok) snprintf(why, cap, "the running totals (%lld B) differ from the tables", (long long)sqlite3_column_int64(s, 4));
    } else {
        snprintf(why, cap, "totals: %s", sqlite3_errmsg(db));
    }
    sqlite3_finalize(s);
    sqlite3_close(db);
    return ok;
}

static void check_after_cut(world *w, kvt_store **st, const idlist *before, const idlist *after_op, verdict *v)
{
    char first[300];
    memset(v, 0, sizeof *v);
    v->integrity_ok = integrity_problems(w->dir, first, sizeof first) == 0;
    if (!v->integrity_ok) snprintf(v->why, sizeof v->why, "integrity check: %s", first);
    if (open_store(w, w->dir, st)) {
        snprintf(v->why, sizeof v->why, "reopen: %s", kvt_errmsg());
        v->lost = true;
        return;
    }
    v->totals_ok = totals_match(w->dir, first, sizeof first);
    if (!v->totals_ok) snprintf(v->why, sizeof v->why, "%s", first);
    idlist now;
    if (list_ids(*st, &now)) {
        snprintf(v->why, sizeof v->why, "list: %s", kvt_errmsg());
        v->lost = true;
        return;
    }
    v->committed = after_op && same_ids(&now, after_op) && !same_ids(&now, before);
    if (!same_ids(&now, before) && !(after_op && same_ids(&now, after_op))) {
        v->lost = true;
        size_t k = (size_t)snprintf(v->why, sizeof v->why, "held %zu entries before the operation", before->n);
        if (after_op) k += (size_t)snprintf(v->why + k, sizeof v->why - k, ", %zu after it", after_op->n);
        k += (size_t)snprintf(v->why + k, sizeof v->why - k, "; %zu now:", now.n);
        for (size_t i = 0; i < before->n && k < sizeof v->why; i++) {
            bool there = false;
            for (size_t j = 0; j < now.n; j++) there |= now.v[j] == before->v[i];
            if (!there) k += (size_t)snprintf(v->why + k, sizeof v->why - k, " %lld lost", (long long)before->v[i]);
        }
    }
    for (size_t i = 0; i < now.n; i++) {
        const entry *e = known(w, now.v[i]);
        if (!e) {
            v->unknown++;
            continue;
        }
        const prompt *x = &w->pr[e->p];
        int rc = kvt_store_load(*st, e->id, w->scratch);
        size_t n = x->pts[e->k];
        if (rc) {
            v->refused++;
            snprintf(v->why, sizeof v->why, "entry %lld (%zu tokens) does not load: %s", (long long)e->id, n, kvt_errmsg());
        } else if (kvt_session_len(w->scratch) != n ||
                   memcmp(kvt_session_tokens(w->scratch), x->t, n * sizeof(int32_t)) ||
                   kvt_test_digest(w->scratch, w->m) != x->twin[e->k]) {
            v->wrong++;
            snprintf(v->why, sizeof v->why, "entry %lld (%zu tokens) loads another state", (long long)e->id, n);
        }
        v->loaded++;
    }
}

typedef struct tally {
    size_t rounds, cuts_by_kind[N_KIND], cuts_by_land[N_LAND], cuts_by_event[4], evicting, checked;
    size_t lost_rounds, broken_rounds, refused, wrong, unknown, totals_wrong;
    char first_failure[700];
} tally;

/* The rounds on one store before the next starts afresh. Its current
 * segment only grows (records are appended; what eviction frees is
 * punched out, not cut off), and the model of the files reads, copies and
 * writes back each file whole at every cut (pf_reload, power_cut,
 * state_before_op): one store through all 1,000 rounds of the durability
 * test ended with a segment of about 50 MB (a cut took 30 ms at first,
 * 64 ms after 300 rounds), and the test took 344 s of CPU (10 s with a
 * fresh store every 100 rounds, on the same seed). 100 rounds on one store hold
 * every kind of operation, evictions, reopens and ids of lost saves coming
 * back many times over; what a longer run adds is a larger offset into
 * the segment. */
#define ROUNDS_PER_STORE 100

/* Run the workload on dir with a cut every few events, rounds times. */
static bool cut_rounds(world *w, int rounds, uint64_t seed, tally *t, bool strict)
{
    uint64_t rng = seed;
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s'", w->dir, w->oracle_dir);
    if (system(cmd) != 0) return false;
    snprintf(P.dir, sizeof P.dir, "%s/", w->dir);
    w->n_known = 0;
    kvt_store *st = NULL;
    /* a few entries first, so that every round has some to check */
    if (open_store(w, w->dir, &st)) return false;
    for (int p = 0; p < 3; p++) {
        int64_t id;
        if (kvt_store_save(st, w->pr[p].s, w->pr[p].len, "cold", &id)) return false;
        remember(w, id, p, w->pr[p].n_pts - 1);
    }
    idlist now;
    if (list_ids(st, &now)) return false;
    for (int round = 0; round < rounds; round++) {
        arm(1 + kvt_test_rand(&rng) % 40, kvt_test_rand(&rng) % 4 == 0 && w->synchronous); /* OFF: no syncs */
        op o = {0};
        idlist before = now;
        /* run operations until the power goes off in one */
        for (int guard = 0; guard < 10000; guard++) {
            o = pick_op(w, &now, &rng);
            before = now;
            mark_op();
            int64_t id = -1;
            int rc = run_op(w, &st, w->dir, &o, &id);
            if (P.cut) break;
            if (rc) {
                snprintf(t->first_failure, sizeof t->first_failure, "round %d: %s failed without a cut: %s", round,
                         kind_name[o.kind], kvt_errmsg());
                return false;
            }
            if (o.kind == K_SAVE) remember(w, id, o.p, o.k);
            if (list_ids(st, &now)) return false;
        }
        if (!P.cut) return false;
        t->cuts_by_kind[o.kind]++;
        t->cuts_by_event[P.cut_kind]++;
        kvt_store_close(st); /* every call fails: the process is gone */
        st = NULL;
        P.armed = false;
        P.cut = false;
        /* the oracle: the operation in flight run to its end on the state it began from */
        idlist after_op = before, *after = &after_op;
        int64_t oracle_id = -1;
        if (o.kind == K_SAVE || o.kind == K_GC || o.kind == K_RM) {
            kvt_store *os = NULL;
            int64_t id = -1;
            kvt_test_clear_dir(w->oracle_dir);
            if (!state_before_op(w->oracle_dir) || open_store(w, w->oracle_dir, &os) ||
                run_op(w, &os, w->oracle_dir, &o, &id) || list_ids(os, &after_op)) {
                snprintf(t->first_failure, sizeof t->first_failure, "round %d: the oracle's %s failed: %s", round,
                         kind_name[o.kind], kvt_errmsg());
                kvt_store_close(os);
                return false;
            }
            kvt_store_close(os);
            oracle_id = id;
            if (o.kind == K_SAVE) {
                for (size_t i = 0; i < before.n; i++) {
                    bool kept = false;
                    for (size_t j = 0; j < after_op.n; j++) kept |= after_op.v[j] == before.v[i];
                    if (!kept) { t->evicting++; break; }
                }
            }
        }
        int land = (int)(kvt_test_rand(&rng) % N_LAND);
        t->cuts_by_land[land]++;
        if (!power_cut(land, &rng)) return false;
        verdict v;
        const entry *was = known(w, oracle_id);
        entry saved = was ? *was : (entry){-1, 0, 0};
        if (o.kind == K_SAVE) remember(w, oracle_id, o.p, o.k); /* what the save in flight wrote, if it landed */
        check_after_cut(w, &st, &before, after, &v);
        if (o.kind == K_SAVE && !v.committed && was) remember(w, saved.id, saved.p, saved.k);
        t->rounds++;
        t->checked += v.loaded;
        t->refused += v.refused;
        t->wrong += v.wrong;
        t->unknown += v.unknown;
        bool bad = !v.integrity_ok || !v.totals_ok || v.lost || v.refused || v.wrong || v.unknown || !v.loaded;
        t->totals_wrong += !v.totals_ok;
        t->lost_rounds += v.lost;
        t->broken_rounds += !v.integrity_ok;
        if (bad && !t->first_failure[0])
            snprintf(t->first_failure, sizeof t->first_failure, "round %d, cut at a %s during %s, %s: %s%s", round,
                     (const char *[]){"write", "sync", "truncate", "delete"}[P.cut_kind], kind_name[o.kind],
                     land_name[land], v.why[0] ? v.why : "no entry to check", v.loaded ? "" : " (none loaded)");
        if (bad && strict) {
            kvt_store_close(st);
            return true;
        }
        if (!st || bad || (round + 1) % ROUNDS_PER_STORE == 0) {
            /* start over from a fresh store (after a bad round: the model of the files is void) */
            kvt_store_close(st);
            st = NULL;
            snprintf(cmd, sizeof cmd, "rm -rf '%s'", w->dir);
            if (system(cmd) != 0) return false;
            for (int i = 0; i < P.n_files; i++) pf_reload(P.files[i]);
            if (open_store(w, w->dir, &st)) return false;
            for (int p = 0; p < 3; p++) {
                int64_t id;
                if (kvt_store_save(st, w->pr[p].s, w->pr[p].len, "cold", &id)) return false;
                remember(w, id, p, w->pr[p].n_pts - 1);
            }
        }
        /* ...and it saves again */
        int64_t id;
        const prompt *x = &w->pr[round % N_PROMPTS];
        if (kvt_store_save(st, x->s, x->len, "cold", &id)) {
            snprintf(t->first_failure, sizeof t->first_failure, "round %d: saving after the cut: %s", round, kvt_errmsg());
            return false;
        }
        remember(w, id, round % N_PROMPTS, x->n_pts - 1);
        if (list_ids(st, &now)) return false;
        bool there = false;
        for (size_t i = 0; i < now.n; i++) there |= now.v[i] == id;
        if (!there) return false;
    }
    kvt_store_close(st);
    return true;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static world *make_world(bool synchronous)
{
    world *w = calloc(1, sizeof *w);
    if (!w || kvt_model_preset(&w->m, "ds4-tiny", 7, NULL) || !make_prompts(w)) return w;
    const char *root = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(w->dir, sizeof w->dir, "%s/kvtier-power-%d", root, (int)getpid());
    snprintf(w->oracle_dir, sizeof w->oracle_dir, "%s/kvtier-power-%d-oracle", root, (int)getpid());
    w->budget = 110000; /* about six entries: saves evict */
    w->synchronous = synchronous;
    return w;
}

static void free_world(world *w)
{
    if (!w) return;
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s'", w->dir, w->oracle_dir);
    if (system(cmd) != 0) {}
    for (int p = 0; p < N_PROMPTS; p++) kvt_session_free(w->pr[p].s);
    kvt_session_free(w->scratch);
    kvt_model_close(w->m);
    free(w);
}

static void print_tally(const tally *t, double secs)
{
    printf("    %zu cuts in %.1f s:", t->rounds, secs);
    for (int k = 0; k < N_KIND; k++) printf("%s %zu %s", k ? "," : "", t->cuts_by_kind[k], kind_name[k]);
    printf(" (%zu saves evicting); at a write %zu, sync %zu, truncate %zu, delete %zu;", t->evicting,
           t->cuts_by_event[0], t->cuts_by_event[1], t->cuts_by_event[2], t->cuts_by_event[3]);
    for (int l = 0; l < N_LAND; l++) printf("%s %s %zu", l ? "," : "", land_name[l], t->cuts_by_land[l]);
    printf("; %zu entries loaded and checked; running totals off the tables' sums after %zu cuts\n", t->checked,
           t->totals_wrong);
}

TEST(store_power_cut_durability)
{
    double t0 = now_s();
    world *w = make_world(true);
    CHECK(w && w->scratch);
    CHECK(shim_install());
    tally t = {0};
    uint64_t seed = kvt_test_seed("store_power_cut_durability");
    bool ran = cut_rounds(w, 1000, seed, &t, true);
    shim_remove();
    print_tally(&t, now_s() - t0);
    free_world(w);
    CHECKF(ran && !t.first_failure[0], "%s", t.first_failure[0] ? t.first_failure : "the workload stopped");
    CHECK(t.rounds == 1000);
    CHECK(t.cuts_by_kind[K_SAVE] >= 100 && t.evicting >= 20 && t.cuts_by_kind[K_GC] >= 20 &&
          t.cuts_by_kind[K_LOAD] + t.cuts_by_kind[K_RESTORE] >= 50 && t.cuts_by_kind[K_REOPEN] >= 5);
    CHECK(t.cuts_by_event[1] >= 100);
}

/* The negative control: the same cuts on a store that commits without
 * waiting for the disk (synchronous=OFF) lose entries, and the checks say
 * so. */
TEST(store_power_cut_negative_control)
{
    double t0 = now_s();
    world *w = make_world(false);
    CHECK(w && w->scratch);
    CHECK(shim_install());
    tally t = {0};
    uint64_t seed = kvt_test_seed("store_power_cut_negative_control");
    bool ran = cut_rounds(w, 300, seed, &t, false);
    shim_remove();
    print_tally(&t, now_s() - t0);
    printf("    at synchronous=OFF: %zu of %zu rounds lost entries, %zu failed the integrity check; %zu entries"
           " refused, %zu loaded another state\n", t.lost_rounds, t.rounds, t.broken_rounds, t.refused, t.wrong);
    free_world(w);
    if (t.first_failure[0]) printf("    the first: %s\n", t.first_failure);
    CHECKF(ran && t.rounds == 300, "the workload stopped");
    CHECKF(t.lost_rounds > 0, "no cut lost an entry at synchronous=OFF: the checks cannot see lost entries");
    CHECKF(t.wrong == 0, "a store that is not durable loaded a wrong state: a damaged record passed its checks");
}
