/* Measures the durable-write strategies the disk tier could use, for the
 * record in docs/STORE.md: saving one 32K-token ds4-mini prefix (256 blocks
 * of 18,816 bytes plus a 150 KB snapshot record)
 *   (a) as one SQLite transaction (WAL, synchronous=FULL), the store's way;
 *   (b) as one file per block, each temp + fsync + rename, then a directory
 *       fsync (content-addressed files);
 *   (c) as one whole file: temp + fsync + rename + directory fsync.
 * Then reads everything back. Usage: store_io DIR [ROUNDS] */
#include <fcntl.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum { NB = 256, BLK = 18816, REC = 150000 };

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void write_durable(const char *dir, const char *name, const void *p, size_t n)
{
    char tmp[512], dst[512];
    snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, name);
    snprintf(dst, sizeof dst, "%s/%s", dir, name);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || write(fd, p, n) != (ssize_t)n || fsync(fd)) { perror(tmp); exit(1); }
    close(fd);
    if (rename(tmp, dst)) { perror(dst); exit(1); }
}

static void fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) { fsync(fd); close(fd); }
}

static size_t read_file(const char *path, char *buf, size_t cap)
{
    int fd = open(path, O_RDONLY);
    ssize_t n = fd >= 0 ? read(fd, buf, cap) : -1;
    if (fd >= 0) close(fd);
    return n > 0 ? (size_t)n : 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) { fprintf(stderr, "usage: store_io DIR [ROUNDS]\n"); return 2; }
    const char *dir = argv[1];
    int rounds = argc > 2 ? atoi(argv[2]) : 3;
    mkdir(dir, 0755);
    char *data = malloc((size_t)NB * BLK + REC), *back = malloc((size_t)NB * BLK + REC);
    for (size_t i = 0; i < (size_t)NB * BLK + REC; i++) data[i] = (char)(i * 2654435761u >> 13);
    double best[3][2] = {{1e9, 1e9}, {1e9, 1e9}, {1e9, 1e9}};
    for (int r = 0; r < rounds; r++) {
        char path[512];
        /* (a) SQLite */
        snprintf(path, sizeof path, "%s/io.db", dir);
        unlink(path);
        sqlite3 *db;
        sqlite3_open(path, &db);
        sqlite3_exec(db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;"
                         "CREATE TABLE b(k INTEGER PRIMARY KEY, d BLOB)", NULL, NULL, NULL);
        double t0 = now();
        sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
        sqlite3_stmt *st;
        sqlite3_prepare_v2(db, "INSERT INTO b VALUES(?, ?)", -1, &st, NULL);
        for (int i = 0; i <= NB; i++) {
            sqlite3_bind_int(st, 1, i);
            sqlite3_bind_blob(st, 2, data + (size_t)i * BLK, i < NB ? BLK : REC, SQLITE_STATIC);
            sqlite3_step(st);
            sqlite3_reset(st);
        }
        sqlite3_finalize(st);
        sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
        double t1 = now();
        sqlite3_prepare_v2(db, "SELECT d FROM b WHERE k = ?", -1, &st, NULL);
        size_t off = 0;
        for (int i = 0; i <= NB; i++) {
            sqlite3_bind_int(st, 1, i);
            if (sqlite3_step(st) == SQLITE_ROW) {
                size_t n = (size_t)sqlite3_column_bytes(st, 0);
                memcpy(back + off, sqlite3_column_blob(st, 0), n);
                off += n;
            }
            sqlite3_reset(st);
        }
        sqlite3_finalize(st);
        double t2 = now();
        sqlite3_close(db);
        if (t1 - t0 < best[0][0]) best[0][0] = t1 - t0;
        if (t2 - t1 < best[0][1]) best[0][1] = t2 - t1;
        /* (b) one file per block */
        t0 = now();
        for (int i = 0; i <= NB; i++) {
            char name[64];
            snprintf(name, sizeof name, "blk%04d", i);
            write_durable(dir, name, data + (size_t)i * BLK, i < NB ? BLK : REC);
        }
        fsync_dir(dir);
        t1 = now();
        off = 0;
        for (int i = 0; i <= NB; i++) {
            snprintf(path, sizeof path, "%s/blk%04d", dir, i);
            off += read_file(path, back + off, REC);
        }
        t2 = now();
        if (t1 - t0 < best[1][0]) best[1][0] = t1 - t0;
        if (t2 - t1 < best[1][1]) best[1][1] = t2 - t1;
        /* (c) one whole file */
        t0 = now();
        write_durable(dir, "whole", data, (size_t)NB * BLK + REC);
        fsync_dir(dir);
        t1 = now();
        snprintf(path, sizeof path, "%s/whole", dir);
        read_file(path, back, (size_t)NB * BLK + REC);
        t2 = now();
        if (t1 - t0 < best[2][0]) best[2][0] = t1 - t0;
        if (t2 - t1 < best[2][1]) best[2][1] = t2 - t1;
    }
    const char *names[3] = {"sqlite, one transaction", "file per block + fsync", "one whole file + fsync"};
    printf("%-26s %12s %12s   (best of %d, %d blocks of %d B + %d B record)\n", "strategy", "write ms", "read ms",
           rounds, NB, BLK, REC);
    for (int k = 0; k < 3; k++) printf("%-26s %12.2f %12.2f\n", names[k], best[k][0] * 1e3, best[k][1] * 1e3);
    free(data);
    free(back);
    return 0;
}
