/* The disk tier against a damaged database file. A populated store is
 * damaged a page at a time, every page of every kind (the header, b-tree
 * interior and leaf pages, overflow pages, freelist pages), at several
 * places in each, and a frame at a time in its WAL. Each time:
 *
 *   - `cache verify` reports exactly what SQLite's integrity check and the
 *     records' own checks find (both computed here independently: the
 *     integrity check on a connection of its own, the records by comparing
 *     every row with its bytes before the damage), exits 1 when either found
 *     something, and leaves the file as it is;
 *   - the next run computes exactly what a run without the disk cache
 *     computes (a miss or a hit, never a wrong state);
 *   - the store then saves and hits again, and `cache gc` leaves it sound.
 *
 * A damaged WAL frame voids the frames from it on, so the store must read
 * as it was after an earlier commit: never a mix of two. */
#include "test.h"
#include "store/testing.h"
#include "session/snapshot.h"
#include "store/store.h"
#include "base/util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#define PAGE 4096

static void rm_rf(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) {}
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static bool write_bytes(const char *path, const uint8_t *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    bool ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

/* ---- the oracle: what the database holds, read on a connection of its own ---- */

/* A row as the checks see it: the columns a snapshot's record must agree
 * with (or a block's bytes), then the record. */
typedef struct row { int64_t id; uint8_t *p; size_t n; int64_t keys[8]; int nk; } row;
typedef struct rows { row *v; size_t n; } rows;

static void rows_free(rows *r)
{
    for (size_t i = 0; i < r->n; i++) free(r->v[i].p);
    free(r->v);
    r->v = NULL;
    r->n = 0;
}

static const row *rows_find(const rows *r, int64_t id)
{
    for (size_t i = 0; i < r->n; i++)
        if (r->v[i].id == id) return &r->v[i];
    return NULL;
}

/* The row of statement s as bytes: ncol int64 columns, then a blob. */
static uint8_t *row_bytes(sqlite3_stmt *s, int c0, int ncol, size_t *n)
{
    size_t bl = (size_t)sqlite3_column_bytes(s, c0 + ncol);
    *n = 8 * (size_t)ncol + bl;
    uint8_t *p = malloc(*n ? *n : 1);
    for (int i = 0; i < ncol; i++) {
        int64_t v = sqlite3_column_int64(s, c0 + i);
        memcpy(p + 8 * i, &v, 8);
    }
    if (bl) memcpy(p + 8 * ncol, sqlite3_column_blob(s, c0 + ncol), bl);
    return p;
}

#define SNAP_Q "SELECT id, model, head, n_tokens, tail, n_blocks, replay, bytes, data, rseg, roff FROM snaps"
#define BLOCK_Q "SELECT key, bytes, data, seg, off FROM blocks"

/* A row (ncol int64 columns from c0, the first of them its bytes when
 * cb = c0 + ncol - 1, then data, seg, off) as bytes: its columns, its
 * data, then the record its segment holds there (read from dir; a marker
 * when it cannot be read). *rec (may be NULL) receives where the record is
 * in the result and *rec_len its length. */
static uint8_t *placed_bytes(const char *dir, sqlite3_stmt *s, int c0, int ncol, int cb, size_t *n, size_t *rec,
                             size_t *rec_len)
{
    size_t head;
    uint8_t *p = row_bytes(s, c0, ncol, &head);
    int cs = c0 + ncol + 1;
    if (rec) {
        *rec = 8 * (size_t)ncol;
        *rec_len = head - *rec;
    }
    if (sqlite3_column_type(s, cs) == SQLITE_NULL) { *n = head; return p; }
    int64_t seg = sqlite3_column_int64(s, cs), off = sqlite3_column_int64(s, cs + 1);
    int64_t bytes = sqlite3_column_int64(s, cb);
    char path[400];
    snprintf(path, sizeof path, "%s/kvtier.db-seg%lld", dir, (long long)seg);
    int fd = bytes > 0 && bytes < (1 << 24) && off >= 0 ? open(path, O_RDONLY) : -1;
    uint8_t *q = realloc(p, head + 1 + (size_t)(bytes > 0 && bytes < (1 << 24) ? bytes : 0));
    if (!q) { free(p); if (fd >= 0) close(fd); *n = 0; return NULL; }
    p = q;
    p[head] = 0xA5; /* a segment's record follows */
    *n = head + 1;
    if (fd >= 0 && pread(fd, p + head + 1, (size_t)bytes, off) == bytes) *n += (size_t)bytes;
    if (fd >= 0) close(fd);
    if (rec) {
        *rec = head + 1;
        *rec_len = *n - *rec;
    }
    return p;
}

static uint8_t *block_bytes(const char *dir, sqlite3_stmt *s, int c0, size_t *n)
{
    return placed_bytes(dir, s, c0, 1, c0, n, NULL, NULL);
}

static sqlite3 *open_raw(const char *dir)
{
    char path[400];
    snprintf(path, sizeof path, "%s/kvtier.db", dir);
    sqlite3 *db = NULL;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READWRITE, NULL) != SQLITE_OK) {
        sqlite3_close(db);
        return NULL;
    }
    sqlite3_db_config(db, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, NULL);
    return db;
}

/* Every snapshot and block row of a sound store. */
static bool read_all(const char *dir, rows *snaps, rows *blocks)
{
    sqlite3 *db = open_raw(dir);
    sqlite3_stmt *s = NULL;
    bool ok = db && sqlite3_prepare_v2(db, SNAP_Q " ORDER BY id", -1, &s, NULL) == SQLITE_OK;
    int r;
    snaps->v = calloc(256, sizeof(row));
    blocks->v = calloc(1024, sizeof(row));
    while (ok && (r = sqlite3_step(s)) == SQLITE_ROW && snaps->n < 256) {
        row *x = &snaps->v[snaps->n++];
        x->id = sqlite3_column_int64(s, 0);
        size_t at = 0, rl = 0;
        x->p = placed_bytes(dir, s, 1, 7, 7, &x->n, &at, &rl);
        kvt_snap_info in;
        if (!x->p || kvt_snap_parse_raw(x->p + at, rl, &in) || in.nb > 8)
            ok = false;
        else
            for (uint32_t b = 0; b < in.nb; b++) x->keys[x->nk++] = (int64_t)kvt_rd64(in.sec[6] + 8 * (size_t)b);
    }
    ok = ok && r == SQLITE_DONE;
    sqlite3_finalize(s);
    s = NULL;
    ok = ok && sqlite3_prepare_v2(db, BLOCK_Q, -1, &s, NULL) == SQLITE_OK;
    while (ok && (r = sqlite3_step(s)) == SQLITE_ROW && blocks->n < 1024) {
        row *x = &blocks->v[blocks->n++];
        x->id = sqlite3_column_int64(s, 0);
        x->p = block_bytes(dir, s, 1, &x->n);
    }
    ok = ok && r == SQLITE_DONE;
    sqlite3_finalize(s);
    sqlite3_close(db);
    return ok;
}

/* SQLite's integrity check, as kvt_store_integrity reports it: its lines
 * other than "ok" and the heading, then how it stopped if it did. */
/* SQLite's integrity check on a read-only connection of its own, as verify
 * runs it: SQLite loads no CHECK constraints there, so the schema's one
 * (totals.one = 1) is checked by a query once the check found nothing. */
static size_t integrity_lines(const char *dir, char *out, size_t cap)
{
    char path[400];
    snprintf(path, sizeof path, "%s/kvtier.db", dir);
    sqlite3 *db = NULL;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK) {
        sqlite3_close(db);
        db = NULL;
    }
    size_t n = 0, k = 0;
    out[0] = 0;
    sqlite3_stmt *s = NULL;
    int r = db ? sqlite3_prepare_v2(db, "PRAGMA integrity_check", -1, &s, NULL) : SQLITE_CANTOPEN;
    while (r == SQLITE_OK && (r = sqlite3_step(s)) == SQLITE_ROW) {
        for (const char *l = (const char *)sqlite3_column_text(s, 0); l && *l;) {
            size_t len = strcspn(l, "\n");
            if (!(len == 2 && !memcmp(l, "ok", 2)) && strncmp(l, "*** in database ", 16)) {
                n++;
                k += (size_t)snprintf(out + k, k < cap ? cap - k : 0, "%.*s\n", (int)len, l);
            }
            l += len + (l[len] == '\n');
        }
        r = SQLITE_OK;
    }
    if (r != SQLITE_DONE) {
        n++;
        k += (size_t)snprintf(out + k, k < cap ? cap - k : 0, "the check stopped: %s\n", db ? sqlite3_errmsg(db) : "");
    }
    sqlite3_finalize(s);
    s = NULL;
    if (!n && sqlite3_prepare_v2(db, "SELECT COUNT(*) FROM totals WHERE NOT (one = 1)", -1, &s, NULL) == SQLITE_OK &&
        sqlite3_step(s) == SQLITE_ROW)
        for (int64_t i = 0, bad = sqlite3_column_int64(s, 0); i < bad; i++, n++)
            k += (size_t)snprintf(out + k, k < cap ? cap - k : 0, "CHECK constraint failed in totals\n");
    sqlite3_finalize(s);
    sqlite3_close(db);
    return n;
}

/* The records of a damaged store against their bytes before the damage
 * (snaps0, blocks0): every row read back is damaged unless it equals a row
 * of before; a row that cannot be read is damaged; a block that an intact
 * snapshot stands on is damaged when missing. The rows are those listed
 * before and those the tables still list. *checked receives the rows
 * examined; returns the damaged ones. */
static size_t oracle_records(const char *dir, const rows *snaps0, const rows *blocks0, size_t *checked)
{
    sqlite3 *db = open_raw(dir);
    *checked = 0;
    if (!db) return 0;
    int64_t ids[512], keys[2048];
    size_t ni = 0, nk = 0, bad = 0;
    for (size_t i = 0; i < snaps0->n; i++) ids[ni++] = snaps0->v[i].id;
    sqlite3_stmt *s = NULL;
    if (sqlite3_prepare_v2(db, "SELECT id FROM snaps NOT INDEXED", -1, &s, NULL) == SQLITE_OK)
        while (sqlite3_step(s) == SQLITE_ROW && ni < 512) ids[ni++] = sqlite3_column_int64(s, 0);
    sqlite3_finalize(s);
    s = NULL;
    if (sqlite3_prepare_v2(db, "SELECT id FROM snaps INDEXED BY sqlite_autoindex_snaps_1", -1, &s, NULL) == SQLITE_OK)
        while (sqlite3_step(s) == SQLITE_ROW && ni < 512) ids[ni++] = sqlite3_column_int64(s, 0);
    sqlite3_finalize(s);
    s = NULL;
    sqlite3_prepare_v2(db, SNAP_Q " WHERE id = ?", -1, &s, NULL);
    for (size_t i = 0; i < ni && s; i++) {
        bool seen = false;
        for (size_t j = 0; j < i; j++) seen |= ids[j] == ids[i];
        if (seen) continue;
        sqlite3_reset(s);
        sqlite3_bind_int64(s, 1, ids[i]);
        int r = sqlite3_step(s);
        if (r == SQLITE_DONE) continue;
        (*checked)++;
        if (r != SQLITE_ROW) { bad++; continue; }
        size_t n;
        uint8_t *p = placed_bytes(dir, s, 1, 7, 7, &n, NULL, NULL);
        const row *was = NULL;
        for (size_t j = 0; j < snaps0->n && !was; j++)
            if (snaps0->v[j].n == n && !memcmp(snaps0->v[j].p, p, n)) was = &snaps0->v[j];
        free(p);
        if (!was) { bad++; continue; }
        for (int k = 0; k < was->nk && nk < 2048; k++) keys[nk++] = was->keys[k];
    }
    sqlite3_finalize(s);
    s = NULL;
    if (sqlite3_prepare_v2(db, "SELECT key FROM blocks", -1, &s, NULL) == SQLITE_OK)
        while (sqlite3_step(s) == SQLITE_ROW && nk < 2048) keys[nk++] = sqlite3_column_int64(s, 0);
    sqlite3_finalize(s);
    s = NULL;
    sqlite3_prepare_v2(db, BLOCK_Q " WHERE key = ?", -1, &s, NULL);
    for (size_t i = 0; i < nk && s; i++) {
        bool seen = false;
        for (size_t j = 0; j < i; j++) seen |= keys[j] == keys[i];
        if (seen) continue;
        sqlite3_reset(s);
        sqlite3_bind_int64(s, 1, keys[i]);
        int r = sqlite3_step(s);
        (*checked)++;
        if (r != SQLITE_ROW) { bad++; continue; }
        size_t n;
        uint8_t *p = block_bytes(dir, s, 1, &n);
        const row *was = rows_find(blocks0, keys[i]);
        if (!was || was->n != n || memcmp(was->p, p, n)) bad++;
        free(p);
    }
    sqlite3_finalize(s);
    sqlite3_close(db);
    return bad;
}

/* Stores opened on a damaged file report it on stderr before a test can
 * make them quiet: hold those lines back while the cases run. */
static void quiet_stderr(bool on)
{
    static int saved = -1;
    fflush(stderr);
    if (on && saved < 0) {
        int nul = open("/dev/null", O_WRONLY);
        saved = dup(2);
        if (nul >= 0) dup2(nul, 2);
        if (nul >= 0) close(nul);
    } else if (!on && saved >= 0) {
        dup2(saved, 2);
        close(saved);
        saved = -1;
    }
}

/* ---- running kvtier ---- */

/* Run the kvtier binary; its exit status (-1: could not run), stdout in
 * out and stderr in err (may be NULL). */
static int run_bin(const char *const *argv, char *out, size_t cap, char *err, size_t err_cap)
{
    char path[2][64];
    for (int k = 0; k < 2; k++) snprintf(path[k], sizeof path[k], "/tmp/kvtier-damage-%s-%d", k ? "err" : "out", (int)getpid());
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(path[0], O_WRONLY | O_CREAT | O_TRUNC, 0600), fe = open(path[1], O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0 || fe < 0) _exit(127);
        dup2(fd, 1);
        dup2(fe, 2);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid) return -1;
    for (int k = 0; k < 2; k++) {
        size_t len = 0;
        char *text = kvt_test_read_file(path[k], &len);
        unlink(path[k]);
        if (k == 0) snprintf(out, cap, "%s", text ? text : "");
        else if (err) snprintf(err, err_cap, "%s", text ? text : "");
        free(text);
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static bool have_bin(void) { return access(kvt_test_bin(), X_OK) == 0; }

/* ---- the damage ---- */

enum { C_HEADER, C_INTERIOR, C_LEAF, C_OVERFLOW, C_FREELIST, C_WAL, C_SEG, N_CLASS };
static const char *const class_name[N_CLASS] = {"header", "interior", "leaf", "overflow", "freelist", "WAL", "segment"};

typedef struct world {
    kvt_model *m;
    int32_t a[700], b[450];
    uint64_t twin_a[4], twin_b;  /* a at 256, 512, 640, 700; b at 450 */
    rows snaps0, blocks0;        /* the pristine store's rows */
    char dir[256], bin_dir[256];
    char segs[320];              /* where the segment files a case starts from are */
    size_t cases[N_CLASS], pages[N_CLASS], rebuilt, hits, misses, verify_found;
    size_t newer;                /* cases whose damage made the schema version a newer build's */
} world;

/* A cold run's digest of a (or b, which shares its first 256 tokens) at n. */
static uint64_t twin_at(const world *w, const int32_t *t, size_t n)
{
    if (t == w->b && n == 450) return w->twin_b;
    return n == 256 ? w->twin_a[0] : t != w->a ? 1 : n == 512 ? w->twin_a[1] : n == 640 ? w->twin_a[2]
                                                   : n == 700 ? w->twin_a[3] : 1;
}

/* How many damaged databases the store moved aside in dir. */
static size_t moved_aside(const char *dir)
{
    DIR *d = opendir(dir);
    size_t found = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        found += strstr(e->d_name, ".damaged-") != NULL && !strstr(e->d_name, "-wal") && !strstr(e->d_name, "-shm");
    if (d) closedir(d);
    return found;
}

/* Move snapshot id's record from its segment into its row. */
static bool record_into_row(const char *dir, int64_t id)
{
    sqlite3 *db = open_raw(dir);
    sqlite3_stmt *q = NULL;
    bool ok = false;
    if (db && sqlite3_prepare_v2(db, "SELECT rseg, roff, bytes FROM snaps WHERE id = ?", -1, &q, NULL) == SQLITE_OK) {
        sqlite3_bind_int64(q, 1, id);
        if (sqlite3_step(q) == SQLITE_ROW) {
            char path[400];
            snprintf(path, sizeof path, "%s/kvtier.db-seg%lld", dir, (long long)sqlite3_column_int64(q, 0));
            int64_t off = sqlite3_column_int64(q, 1), n = sqlite3_column_int64(q, 2);
            uint8_t *p = malloc((size_t)n);
            int fd = open(path, O_RDONLY);
            ok = p && fd >= 0 && pread(fd, p, (size_t)n, off) == n;
            if (fd >= 0) close(fd);
            sqlite3_finalize(q);
            q = NULL;
            ok = ok && sqlite3_prepare_v2(db, "UPDATE snaps SET data = ?, rseg = NULL, roff = NULL WHERE id = ?", -1, &q,
                                          NULL) == SQLITE_OK;
            if (ok) {
                sqlite3_bind_blob(q, 1, p, (int)n, SQLITE_TRANSIENT);
                sqlite3_bind_int64(q, 2, id);
                ok = sqlite3_step(q) == SQLITE_DONE;
            }
            free(p);
        }
    }
    sqlite3_finalize(q);
    sqlite3_close(db);
    return ok;
}

/* Empty dir (the stores of this test are flat). */
/* The pristine store: a conversation saved cold at 256 and continued at
 * 512 (then stored without its state) and 640, a second prompt that shares
 * its first 256 tokens, and a third that was saved and removed (its pages
 * are the freelist). Closing checkpoints everything into the file. */
static bool populate(world *w, const char *dir)
{
    int32_t c[300];
    kvt_test_tokens(w->a, 700, 11);
    memcpy(w->b, w->a, 256 * sizeof(int32_t));
    kvt_test_tokens(w->b + 256, 450 - 256, 12);
    w->b[256] = (w->a[256] + 1) % 256;
    kvt_test_tokens(c, 300, 13);
    rm_rf(dir);
    kvt_store *st = NULL;
    kvt_session *s = NULL;
    kvt_session_opts so = {.checkpoint_interval = 128};
    int64_t cid = -1, bid = -1;
    bool ok = !kvt_store_open(&st, dir, 0) && !kvt_session_new(&s, w->m, &so) && !kvt_session_sync(s, w->a, 700, NULL) &&
              !kvt_store_save(st, s, 256, "cold", NULL) && !kvt_store_save(st, s, 512, "continued", NULL) &&
              !kvt_store_save(st, s, 640, "continued", NULL) && !kvt_session_sync(s, w->b, 450, NULL) &&
              !kvt_store_save(st, s, 450, "cold", &bid);
    /* short prompts, so that the snapshot table spans leaf pages under an
     * interior one (the blocks' records are in the segment, not the tables) */
    for (int k = 0; k < 30 && ok; k++) {
        kvt_test_tokens(c, 130, 40 + (uint64_t)k);
        ok = !kvt_session_sync(s, c, 130, NULL) && !kvt_store_save(st, s, 130, "cold", NULL);
    }
    kvt_test_tokens(c, 300, 13);
    ok = ok && !kvt_session_sync(s, c, 300, NULL) && !kvt_store_save(st, s, 300, "cold", &cid);
    kvt_store_close(st);
    st = NULL;
    /* b's and c's records in their rows, as a store of schema 1 keeps them
     * (overflow pages); c is then removed (free pages) */
    ok = ok && record_into_row(dir, bid) && record_into_row(dir, cid) && !kvt_store_open(&st, dir, 0) &&
         !kvt_store_rm(st, cid);
    kvt_session_free(s);
    kvt_store_close(st);
    return ok;
}

/* Which kind each page of the file is: dbstat names b-tree and overflow
 * pages, the header's freelist chain the free ones. */
static bool classify(const char *dir, const uint8_t *img, size_t n_pages, int *cls)
{
    for (size_t p = 0; p < n_pages; p++) cls[p] = -1;
    cls[0] = C_HEADER;
    sqlite3 *db = open_raw(dir);
    sqlite3_stmt *s = NULL;
    bool counted = db && sqlite3_prepare_v2(db, "PRAGMA page_count", -1, &s, NULL) == SQLITE_OK &&
                   sqlite3_step(s) == SQLITE_ROW && sqlite3_column_int64(s, 0) == (int64_t)n_pages;
    sqlite3_finalize(s);
    s = NULL;
    if (!counted || sqlite3_prepare_v2(db, "SELECT pageno, pagetype FROM dbstat", -1, &s, NULL) != SQLITE_OK) {
        sqlite3_close(db);
        return false;
    }
    while (sqlite3_step(s) == SQLITE_ROW) {
        int64_t pg = sqlite3_column_int64(s, 0);
        const char *t = (const char *)sqlite3_column_text(s, 1);
        if (pg >= 2 && (size_t)pg <= n_pages)
            cls[pg - 1] = !strcmp(t, "internal") ? C_INTERIOR : !strcmp(t, "leaf") ? C_LEAF : C_OVERFLOW;
    }
    sqlite3_finalize(s);
    sqlite3_close(db);
    /* freelist: trunk pages from the header, each listing leaf pages */
    uint32_t trunk = (uint32_t)img[32] << 24 | (uint32_t)img[33] << 16 | (uint32_t)img[34] << 8 | img[35];
    for (int guard = 0; trunk && trunk <= n_pages && guard < 1000; guard++) {
        const uint8_t *t = img + (size_t)(trunk - 1) * PAGE;
        cls[trunk - 1] = C_FREELIST;
        uint32_t nl = (uint32_t)t[4] << 24 | (uint32_t)t[5] << 16 | (uint32_t)t[6] << 8 | t[7];
        for (uint32_t i = 0; i < nl && i < PAGE / 4 - 2; i++) {
            const uint8_t *e = t + 8 + 4 * i;
            uint32_t leaf = (uint32_t)e[0] << 24 | (uint32_t)e[1] << 16 | (uint32_t)e[2] << 8 | e[3];
            if (leaf && leaf <= n_pages) cls[leaf - 1] = C_FREELIST;
        }
        trunk = (uint32_t)t[0] << 24 | (uint32_t)t[1] << 16 | (uint32_t)t[2] << 8 | t[3];
    }
    for (size_t p = 0; p < n_pages; p++)
        if (cls[p] < 0) return false;
    return true;
}

/* Where to damage a page of the file, by kind: its structure (type byte,
 * cell count, a cell pointer, the next-page pointer of an overflow or
 * freelist page, header fields) and its content (a cell's first bytes,
 * payload, the middle and the end of the page). */
static size_t places(const uint8_t *img, size_t pg, int cls, size_t *at)
{
    size_t k = 0, base = pg * PAGE;
    if (cls == C_HEADER) {
        /* magic, page size, versions, reserved bytes, payload fractions, page
         * count, freelist trunk and count, schema cookie and format, vacuum
         * root, text encoding, incremental vacuum, version-valid-for */
        static const size_t hdr[] = {0, 16, 18, 19, 20, 21, 28, 35, 39, 43, 47, 55, 59, 67, 95};
        for (size_t i = 0; i < sizeof hdr / sizeof hdr[0]; i++) at[k++] = hdr[i];
    }
    if (cls == C_HEADER || cls == C_INTERIOR || cls == C_LEAF) {
        size_t h = cls == C_HEADER ? 100 : 0, ptrs = h + (img[base + h] == 2 || img[base + h] == 5 ? 12 : 8);
        size_t first = (size_t)img[base + ptrs] << 8 | img[base + ptrs + 1];
        at[k++] = base + h;         /* page type */
        at[k++] = base + h + 4;     /* cell count, low byte */
        at[k++] = base + ptrs + 1;  /* the first cell pointer, low byte */
        if (first >= ptrs + 2 && first + 8 < PAGE) {
            at[k++] = base + first;     /* the cell's first byte: its payload size or child page */
            at[k++] = base + first + 7; /* into its key or payload */
        }
    }
    if (cls == C_OVERFLOW || cls == C_FREELIST) {
        at[k++] = base + 3; /* next page */
        at[k++] = base + 7; /* content; for a freelist trunk, its leaf count */
        at[k++] = base + 11;
    }
    at[k++] = base + PAGE / 2;
    at[k++] = base + PAGE - 1;
    return k;
}

/* A run of t[0..n) on the store: whatever it restores (*reused tokens) is
 * the state a cold run has there, and the state it ends with is a cold
 * run's; then it saves at save_at (0: no save). */
static void run_prompt(world *w, kvt_store *st, const char *what, const int32_t *t, size_t n, size_t save_at,
                       size_t *reused)
{
    kvt_session_opts so = {.checkpoint_interval = 128};
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, w->m, &so));
    int rc = kvt_store_restore_prefix(st, s, t, n, reused);
    uint64_t h = *reused ? kvt_test_digest(s, w->m) : 0, want = *reused ? twin_at(w, t, *reused) : 0;
    if (!rc) rc = kvt_session_sync(s, t, n, NULL);
    uint64_t end = rc ? 0 : kvt_test_digest(s, w->m);
    if (!rc && save_at) rc = kvt_store_save(st, s, save_at, "cold", NULL);
    kvt_session_free(s);
    CHECK_OK(rc);
    CHECKF(h == want, "%s: %zu tokens restored differ from a cold run's", what, *reused);
    CHECKF(end == twin_at(w, t, n), "%s: the run ends in another state than a cold run", what);
}

/* The schema version meta holds, read raw (-1: none). */
static int64_t meta_schema(const char *dir)
{
    sqlite3 *db = open_raw(dir);
    sqlite3_stmt *q = NULL;
    int64_t v = -1;
    if (db && sqlite3_prepare_v2(db, "SELECT v FROM meta WHERE k = 'schema'", -1, &q, NULL) == SQLITE_OK &&
        sqlite3_step(q) == SQLITE_ROW)
        v = sqlite3_column_int64(q, 0);
    sqlite3_finalize(q);
    sqlite3_close(db);
    return v;
}

/* Whether dir's database holds exactly the bytes db[0, n). */
static bool db_is(const char *dir, const uint8_t *db, size_t n)
{
    char path[400];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/kvtier.db", dir);
    char *now = kvt_test_read_file(path, &len);
    bool same = now && len == n && !memcmp(now, db, n);
    free(now);
    return same;
}

/* Copy the segment files (kvtier.db-seg*) of from into to. */
static bool copy_segs(const char *from, const char *to)
{
    DIR *d = opendir(from);
    bool ok = d != NULL;
    for (struct dirent *e; ok && (e = readdir(d));) {
        if (strncmp(e->d_name, "kvtier.db-seg", 13)) continue;
        char a[600], b[600];
        snprintf(a, sizeof a, "%s/%s", from, e->d_name);
        snprintf(b, sizeof b, "%s/%s", to, e->d_name);
        size_t n = 0;
        uint8_t *p = (uint8_t *)kvt_test_read_file(a, &n);
        ok = p && write_bytes(b, p, n);
        free(p);
    }
    if (d) closedir(d);
    return ok;
}

/* Damage of a segment file: flip the byte at `at` (mask), or cut the file
 * there (mask 0), or delete it (at SIZE_MAX). */
typedef struct seg_damage { int64_t seg; size_t at; uint8_t mask; } seg_damage;

static bool damage_seg(const char *dir, const seg_damage *d)
{
    char path[400];
    snprintf(path, sizeof path, "%s/kvtier.db-seg%lld", dir, (long long)d->seg);
    if (d->at == SIZE_MAX) return unlink(path) == 0;
    if (!d->mask) return truncate(path, (off_t)d->at) == 0;
    int fd = open(path, O_RDWR);
    uint8_t b = 0;
    bool ok = fd >= 0 && pread(fd, &b, 1, (off_t)d->at) == 1;
    b ^= d->mask;
    ok = ok && pwrite(fd, &b, 1, (off_t)d->at) == 1;
    if (fd >= 0) close(fd);
    return ok;
}

/* After damage: verify, then the next run, then saving and hitting again. */
static void one_case(world *w, const char *what, int cls, const uint8_t *db, size_t db_len, const uint8_t *wal,
                     size_t wal_len, const rows *want_snaps, const rows *want_blocks, const seg_damage *sd)
{
    char path[400], expect[8192], got_lines[8192];
    kvt_test_clear_dir(w->dir);
    snprintf(path, sizeof path, "%s/kvtier.db", w->dir);
    CHECK(write_bytes(path, db, db_len));
    if (wal) {
        snprintf(path, sizeof path, "%s/kvtier.db-wal", w->dir);
        CHECK(write_bytes(path, wal, wal_len));
    }
    CHECK(copy_segs(w->segs, w->dir));
    if (sd) CHECK(damage_seg(w->dir, sd));
    w->cases[cls]++;
    /* what the integrity check and the records' bytes say */
    size_t want_problems = integrity_lines(w->dir, expect, sizeof expect), want_checked = 0;
    size_t want_bad = oracle_records(w->dir, want_snaps, want_blocks, &want_checked);
    /* what verify says, in process and through the CLI; neither writes */
    kvt_store *st = NULL;
    size_t problems = 0, bad = 0, checked = 0;
    char *report = NULL;
    CHECK_OK(kvt_store_open_inspect(&st, w->dir));
    kvt_store_set_quiet(st, true);
    CHECK_OK(kvt_store_integrity(st, &problems, &report));
    CHECK_OK(kvt_store_verify(st, &bad, &checked, NULL));
    kvt_store_close(st);
    snprintf(got_lines, sizeof got_lines, "%s", report ? report : "");
    free(report);
    CHECKF(problems == want_problems && !strcmp(got_lines, expect),
           "%s: verify's integrity check found %zu problems:\n%sSQLite's found %zu:\n%s", what, problems, got_lines,
           want_problems, expect);
    CHECKF(bad == want_bad && checked == want_checked, "%s: verify found %zu of %zu records damaged, the bytes %zu of %zu",
           what, bad, checked, want_bad, want_checked);
    w->verify_found += problems || bad;
    if (cls == C_WAL)
        CHECKF(!problems && !bad && checked == want_snaps->n + want_blocks->n,
               "%s: the store is not as it was after an earlier commit (%zu problems, %zu of %zu records differ; %zu+%zu"
               " rows then)", what, problems, bad, checked, want_snaps->n, want_blocks->n);
    if (have_bin() && (w->cases[cls] % 3 == 1 || problems || bad)) {
        char out[8192], line[128];
        const char *const av[] = {kvt_test_bin(), "cache", "verify", "--kv-disk-dir", w->dir, NULL};
        int status = run_bin(av, out, sizeof out, NULL, 0);
        CHECKF(status == (problems || bad ? 1 : 0), "%s: cache verify exits %d:\n%s", what, status, out);
        if (problems) snprintf(line, sizeof line, "integrity check: %zu problem", problems);
        else snprintf(line, sizeof line, "integrity check: ok");
        CHECKF(strstr(out, line), "%s: cache verify printed:\n%s", what, out);
        snprintf(line, sizeof line, "checked %zu records: %zu damaged", checked, bad);
        CHECKF(strstr(out, line), "%s: cache verify printed:\n%s", what, out);
    }
    CHECKF(db_is(w->dir, db, db_len), "%s: verify changed the database", what);
    /* the next run of each prompt: whatever it restores, it computes what a
     * cold run does, and it saves; then both hit */
    size_t reused = 0;
    int orc = kvt_store_open(&st, w->dir, 0);
    if (orc == KVT_EUNSUPPORTED && meta_schema(w->dir) > 2) {
        /* the damage reads as a store of a newer build: left alone for it
         * (nothing is written; the run goes on without the disk tier) */
        CHECKF(db_is(w->dir, db, db_len), "%s: a store of a newer schema was changed", what);
        w->newer++;
        return;
    }
    CHECK_OK(orc);
    kvt_store_set_quiet(st, true);
    run_prompt(w, st, what, w->a, 700, 700, &reused);
    if (kvt_test_failed()) return;
    w->hits += reused > 0;
    w->misses += reused == 0;
    run_prompt(w, st, what, w->b, 450, 450, &reused);
    if (kvt_test_failed()) return;
    kvt_store_close(st);
    CHECK_OK(kvt_store_open(&st, w->dir, 0));
    kvt_store_set_quiet(st, true);
    run_prompt(w, st, what, w->a, 700, 0, &reused);
    if (kvt_test_failed()) return;
    CHECKF(reused == 700, "%s: after saving again, %zu tokens of a restored", what, reused);
    run_prompt(w, st, what, w->b, 450, 0, &reused);
    if (kvt_test_failed()) return;
    CHECKF(reused == 450, "%s: after saving again, %zu tokens of b restored", what, reused);
    /* gc rebuilds what is still damaged; then the store is sound */
    CHECK_OK(kvt_store_gc(st));
    kvt_store_close(st);
    size_t aside = moved_aside(w->dir);
    CHECKF(aside <= 1, "%s: the store was rebuilt %zu times (once is enough)", what, aside);
    w->rebuilt += aside;
    CHECK_OK(kvt_store_open_inspect(&st, w->dir));
    kvt_store_set_quiet(st, true);
    CHECK_OK(kvt_store_integrity(st, &problems, NULL));
    CHECK_OK(kvt_store_verify(st, &bad, &checked, NULL));
    kvt_store_close(st);
    CHECKF(problems == 0 && bad == 0 && checked > 0, "%s: after gc, %zu problems and %zu of %zu records damaged", what,
           problems, bad, checked);
}

TEST(store_damage_pages_and_wal)
{
    double t0 = now_s();
    world *w = calloc(1, sizeof *w);
    CHECK(w);
    CHECK_OK(kvt_model_preset(&w->m, "ds4-tiny", 7, NULL));
    /* tmpfs where there is one: the cases commit (and fsync) a few hundred times */
    const char *root = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(w->dir, sizeof w->dir, "%s/kvtier-damage-%d", root, (int)getpid());
    char pristine[300];
    snprintf(pristine, sizeof pristine, "%s/kvtier-damage-%d-pristine", root, (int)getpid());
    CHECK(populate(w, pristine));
    snprintf(w->segs, sizeof w->segs, "%s", pristine);
    const size_t at_a[4] = {256, 512, 640, 700};
    for (int i = 0; i < 4; i++) w->twin_a[i] = kvt_test_twin(w->m, w->a, at_a[i]);
    w->twin_b = kvt_test_twin(w->m, w->b, 450);
    CHECK(read_all(pristine, &w->snaps0, &w->blocks0));
    char path[400];
    snprintf(path, sizeof path, "%s/kvtier.db", pristine);
    size_t len = 0;
    uint8_t *img = (uint8_t *)kvt_test_read_file(path, &len);
    CHECK(img && len % PAGE == 0 && len / PAGE >= 8 && len / PAGE <= 80);
    size_t n_pages = len / PAGE;
    int *cls = calloc(n_pages, sizeof *cls);
    CHECK(classify(pristine, img, n_pages, cls));
    uint8_t *bad = malloc(len);
    size_t n_cases = 0;
    for (size_t pg = 0; pg < n_pages; pg++) {
        size_t at[32];
        size_t k = places(img, pg, cls[pg], at);
        w->pages[cls[pg]]++;
        for (size_t i = 0; i < k; i++) {
            char what[96];
            static const uint8_t masks[4] = {0xff, 0x01, 0x80, 0x10};
            uint8_t mask = masks[(pg + i) % 4];
            snprintf(what, sizeof what, "page %zu (%s), byte %zu ^ 0x%02x", pg + 1, class_name[cls[pg]], at[i] - pg * PAGE,
                     mask);
            memcpy(bad, img, len);
            bad[at[i]] ^= mask;
            quiet_stderr(true);
            one_case(w, what, cls[pg], bad, len, NULL, 0, &w->snaps0, &w->blocks0, NULL);
            quiet_stderr(false);
            if (kvt_test_failed()) return;
            n_cases++;
        }
    }
    double t_pages = now_s() - t0;
    /* The segments: a byte of each block's record flipped (its magic, its
     * rows, its checksum), the file cut inside the first and the last
     * block, and the file gone. */
    {
        sqlite3 *db = open_raw(pristine);
        sqlite3_stmt *q = NULL;
        seg_damage sd[400];
        size_t nd = 0;
        int64_t first_off = -1, last_off = -1, last_bytes = 0, seg = 0;
        if (db && sqlite3_prepare_v2(db, "SELECT seg, off, bytes FROM blocks WHERE seg IS NOT NULL ORDER BY seg, off",
                                     -1, &q, NULL) == SQLITE_OK)
            while (sqlite3_step(q) == SQLITE_ROW && nd + 3 < 390) {
                int64_t off = sqlite3_column_int64(q, 1), bytes = sqlite3_column_int64(q, 2);
                seg = sqlite3_column_int64(q, 0);
                if (first_off < 0) first_off = off;
                last_off = off;
                last_bytes = bytes;
                sd[nd++] = (seg_damage){seg, (size_t)off + 3, 0x01};
                sd[nd++] = (seg_damage){seg, (size_t)(off + bytes / 2), 0x80};
                sd[nd++] = (seg_damage){seg, (size_t)(off + bytes - 1), 0x10};
            }
        sqlite3_finalize(q);
        sqlite3_close(db);
        CHECK(nd > 0 && seg == 1);
        sd[nd++] = (seg_damage){seg, (size_t)(first_off + 100), 0};
        sd[nd++] = (seg_damage){seg, (size_t)(last_off + last_bytes / 2), 0};
        sd[nd++] = (seg_damage){seg, SIZE_MAX, 0};
        for (size_t i = 0; i < nd; i++) {
            char what[96];
            if (sd[i].at == SIZE_MAX) snprintf(what, sizeof what, "segment %lld deleted", (long long)sd[i].seg);
            else if (!sd[i].mask) snprintf(what, sizeof what, "segment %lld cut at %zu", (long long)sd[i].seg, sd[i].at);
            else snprintf(what, sizeof what, "segment %lld, byte %zu ^ 0x%02x", (long long)sd[i].seg, sd[i].at, sd[i].mask);
            quiet_stderr(true);
            one_case(w, what, C_SEG, img, len, NULL, 0, &w->snaps0, &w->blocks0, &sd[i]);
            quiet_stderr(false);
            if (kvt_test_failed()) return;
            n_cases++;
        }
        w->pages[C_SEG] = 1;
    }
    /* The WAL: two more saves committed and not yet checkpointed. Damage in
     * a frame voids it and every later one: the store reads as it was after
     * the last commit before it. */
    rm_rf(w->dir);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "cp -r '%s' '%s'", pristine, w->dir);
    CHECK(system(cmd) == 0);
    rows states[3][2] = {{w->snaps0, w->blocks0}};
    kvt_store *st = NULL;
    kvt_session *s = NULL;
    int32_t d[300], e[400];
    kvt_test_tokens(d, 300, 21);
    kvt_test_tokens(e, 400, 22);
    CHECK_OK(kvt_store_open(&st, w->dir, 0));
    CHECK_OK(kvt_session_new(&s, w->m, NULL));
    CHECK_OK(kvt_session_sync(s, d, 300, NULL));
    CHECK_OK(kvt_store_save(st, s, 300, "cold", NULL));
    CHECK(read_all(w->dir, &states[1][0], &states[1][1]));
    CHECK_OK(kvt_session_sync(s, e, 400, NULL));
    CHECK_OK(kvt_store_save(st, s, 400, "cold", NULL));
    CHECK(read_all(w->dir, &states[2][0], &states[2][1]));
    kvt_session_free(s);
    char walsegs[320];
    snprintf(walsegs, sizeof walsegs, "%s-segs", pristine);
    rm_rf(walsegs);
    CHECK(mkdir(walsegs, 0755) == 0 && copy_segs(w->dir, walsegs));
    snprintf(w->segs, sizeof w->segs, "%s", walsegs);
    size_t wal_len = 0, db2_len = 0;
    snprintf(path, sizeof path, "%s/kvtier.db-wal", w->dir);
    uint8_t *wal = (uint8_t *)kvt_test_read_file(path, &wal_len);
    snprintf(path, sizeof path, "%s/kvtier.db", w->dir);
    uint8_t *db2 = (uint8_t *)kvt_test_read_file(path, &db2_len);
    kvt_store_close(st);
    CHECK(wal && db2 && wal_len > 32 && (wal_len - 32) % (24 + PAGE) == 0);
    size_t frames = (wal_len - 32) / (24 + PAGE);
    uint8_t *badwal = malloc(wal_len);
    /* the WAL header, then each frame's header fields and page */
    size_t commit_of[4096];
    for (size_t f = 0, c = 0; f < frames && f < 4096; f++) {
        const uint8_t *fh = wal + 32 + f * (24 + PAGE);
        commit_of[f] = c;
        if (fh[4] | fh[5] | fh[6] | fh[7]) c++; /* a commit frame: the database size after it */
    }
    CHECK(frames < 4096 && commit_of[frames - 1] == 1);
    for (size_t f = 0; f <= frames; f++) {
        size_t at[3], k = 0;
        if (f == 0) {
            at[k++] = 3;  /* magic */
            at[k++] = 11; /* page size */
            at[k++] = 19; /* salt */
        } else {
            size_t base = 32 + (f - 1) * (24 + PAGE);
            at[k++] = base + (f % 4 == 0 ? 3 : f % 4 == 1 ? 7 : f % 4 == 2 ? 11 : 19); /* page, size, salt, checksum */
            at[k++] = base + 24 + PAGE / 2;
        }
        size_t state = f == 0 ? 0 : commit_of[f - 1];
        for (size_t i = 0; i < k; i++) {
            char what[96];
            snprintf(what, sizeof what, "WAL %s %zu, byte %zu", f ? "frame" : "header", f, f ? at[i] - 32 - (f - 1) * (24 + PAGE) : at[i]);
            memcpy(badwal, wal, wal_len);
            badwal[at[i]] ^= 0x01;
            quiet_stderr(true);
            one_case(w, what, C_WAL, db2, db2_len, badwal, wal_len, &states[state][0], &states[state][1], NULL);
            quiet_stderr(false);
            if (kvt_test_failed()) return;
            n_cases++;
        }
        w->pages[C_WAL]++;
    }
    printf("    %zu pages (", n_pages);
    for (int c = 0; c < C_WAL; c++) printf("%s%s %zu", c ? ", " : "", class_name[c], w->pages[c]);
    printf(") and %zu WAL frames and the segment damaged in %zu places (", frames, n_cases);
    for (int c = 0; c < N_CLASS; c++) printf("%s%s %zu", c ? ", " : "", class_name[c], w->cases[c]);
    printf("): verify found damage %zu times; the next run hit %zu times, missed %zu; %zu rebuilds; %zu read as a newer"
           " schema; %.1f s (pages %.1f s)\n", w->verify_found, w->hits, w->misses, w->rebuilt, w->newer, now_s() - t0, t_pages);
    for (int c = 0; c < N_CLASS; c++) CHECKF(w->cases[c] > 0, "no %s page damaged", class_name[c]);
    free(badwal);
    free(wal);
    free(db2);
    for (int i = 1; i < 3; i++) {
        rows_free(&states[i][0]);
        rows_free(&states[i][1]);
    }
    free(bad);
    free(cls);
    free(img);
    rows_free(&w->snaps0);
    rows_free(&w->blocks0);
    kvt_model_close(w->m);
    rm_rf(w->dir);
    rm_rf(pristine);
    rm_rf(walsegs);
    free(w);
}

/* The report this file answers, through the command line: a 1,500-word
 * prompt run twice on ds4-tiny, then one byte flipped at two thirds of
 * kvtier.db, in a b-tree page. verify must say so and exit 1; the next run
 * must print what a cold run printed, rebuild the store and save; the one
 * after must restore from it; verify is then clean. */
TEST(store_damage_page_cli)
{
    if (!have_bin()) SKIP("%s absent", kvt_test_bin());
    static const char *const words[] = {"the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
                                        "seven", "cats", "sat", "on", "warm", "mats", "and", "sang", "softly"};
    char *prompt = malloc(1500 * 8);
    CHECK(prompt);
    size_t k = 0;
    uint64_t seed = 3;
    for (int i = 0; i < 1500; i++)
        k += (size_t)sprintf(prompt + k, "%s%s", i ? " " : "", words[kvt_test_rand(&seed) % (sizeof words / sizeof *words)]);
    char dir[256], path[300];
    snprintf(dir, sizeof dir, "%s/kvtier-damage-cli-%d", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp", (int)getpid());
    rm_rf(dir);
    snprintf(path, sizeof path, "%s/kvtier.db", dir);
    const char *const run[] = {kvt_test_bin(), "run", "--model", "ds4-tiny", "--prompt", prompt, "--max-tokens", "8",
                               "--output", "ids", "--ctx", "16384", "--kv-cache-min-tokens", "256", "--kv-disk-dir", dir,
                               NULL};
    const char *const verify[] = {kvt_test_bin(), "cache", "verify", "--kv-disk-dir", dir, NULL};
    static char out[5][4096], err[5][8192], vout[8192];
    for (int r = 0; r < 2; r++) CHECKF(run_bin(run, out[r], sizeof out[r], err[r], sizeof err[r]) == 0, "%s", err[r]);
    CHECKF(strstr(err[0], " 0 from the disk cache") && !strstr(err[1], " 0 from the disk cache") &&
           !strcmp(out[0], out[1]), "the first runs:\n%s%s", err[0], err[1]);
    size_t len = 0;
    uint8_t *img = (uint8_t *)kvt_test_read_file(path, &len);
    CHECK(img && len % PAGE == 0);
    /* a page of the snapshot table, which every run reads (the lookup's
     * index): the blocks' records are in the segment, and a load finds
     * them through its snapshot's row, so a damaged page of the blocks
     * table or an index would wait for verify or gc */
    size_t pg = len / PAGE;
    {
        sqlite3 *db = open_raw(dir);
        sqlite3_stmt *q = NULL;
        if (db && sqlite3_prepare_v2(db, "SELECT pageno FROM dbstat WHERE name = 'snaps' ORDER BY pageno", -1, &q, NULL) ==
                      SQLITE_OK) {
            int64_t pages[64];
            size_t np = 0;
            while (sqlite3_step(q) == SQLITE_ROW && np < 64) pages[np++] = sqlite3_column_int64(q, 0);
            if (np) pg = (size_t)pages[np * 2 / 3] - 1;
        }
        sqlite3_finalize(q);
        sqlite3_close(db);
    }
    CHECK(pg < len / PAGE && (img[pg * PAGE] == 5 || img[pg * PAGE] == 13)); /* a b-tree page's first byte is its type */
    img[pg * PAGE] ^= 0xff;
    CHECK(write_bytes(path, img, len));
    free(img);
    int status = run_bin(verify, vout, sizeof vout, NULL, 0);
    CHECKF(status == 1 && strstr(vout, "integrity check: ") && !strstr(vout, "integrity check: ok"),
           "cache verify of the damaged store exits %d:\n%s", status, vout);
    for (int r = 2; r < 4; r++) CHECKF(run_bin(run, out[r], sizeof out[r], err[r], sizeof err[r]) == 0, "%s", err[r]);
    CHECKF(!strcmp(out[2], out[0]) && !strcmp(out[3], out[0]), "runs on the damaged store print other ids:\n%s%s%s",
           out[0], out[2], out[3]);
    CHECKF(strstr(err[2], "is damaged") && strstr(err[2], "moved to"), "the next run did not rebuild the store:\n%s",
           err[2]);
    CHECKF(!strstr(err[3], " 0 from the disk cache") && !strstr(err[3], "unusable") && !strstr(err[3], "damaged"),
           "the run after the rebuild:\n%s", err[3]);
    status = run_bin(verify, vout, sizeof vout, NULL, 0);
    CHECKF(status == 0 && strstr(vout, "integrity check: ok") && strstr(vout, " 0 damaged"),
           "cache verify after the rebuild exits %d:\n%s", status, vout);
    printf("    page %zu of %zu damaged: %s", pg + 1, len / PAGE, strstr(err[2], "kvtier: prompt") ? strstr(err[2], "kvtier: prompt") : "\n");
    free(prompt);
    rm_rf(dir);
}
