/* The fuzz targets' inputs as ordinary tests (tests/fuzz/README.md): every
 * file under tests/fuzz/regress/<target>/ (a crasher or a broken property
 * the fuzzer found, kept once fixed) and under tests/fuzz/seeds/<target>/
 * goes through the same fuzz_<target> function the libFuzzer binary runs,
 * from an exact-size heap copy, so `make asan` replays them under the
 * sanitizers. A property the target checks (FUZZ_CHECK) fails the test
 * with the file's name. Run from the repository root, as `make test` does. */
#include "test.h"
#include "fuzz/fuzz.h"

#include <dirent.h>
#include <stdlib.h>
#include <string.h>

typedef int (*fuzz_fn)(const uint8_t *, size_t);
static const struct { const char *name; fuzz_fn fn; } targets[] = {
#define FUZZ_ENTRY(t) {#t, fuzz_##t},
    FUZZ_TARGETS(FUZZ_ENTRY)
#undef FUZZ_ENTRY
};

static char failed_msg[1024];
static int n_failed;

static void on_fail(const char *msg)
{
    if (!n_failed++) snprintf(failed_msg, sizeof failed_msg, "%s", msg);
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Run every file of dir/<target>/; the number of files in *n_files. False
 * (with a message) at the first input that breaks a property. */
static bool replay(const char *dir, size_t *n_files)
{
    *n_files = 0;
    for (size_t t = 0; t < sizeof targets / sizeof *targets; t++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, targets[t].name);
        DIR *d = opendir(path);
        if (!d) continue;
        char *names[4096];
        size_t n = 0;
        for (struct dirent *e; (e = readdir(d)) && n < 4096;)
            if (e->d_name[0] != '.' && strcmp(e->d_name, "README.md")) names[n++] = strdup(e->d_name);
        closedir(d);
        qsort(names, n, sizeof *names, by_name);
        bool ok = true;
        for (size_t i = 0; i < n; i++) {
            if (!names[i] || !ok) { free(names[i]); continue; }
            snprintf(path, sizeof path, "%s/%s/%s", dir, targets[t].name, names[i]);
            size_t len = 0;
            char *data = kvt_test_read_file(path, &len);
            if (!data) {
                printf("    cannot read %s\n", path);
                ok = false;
            } else {
                /* exactly len bytes: an over-read is past the allocation */
                uint8_t *copy = malloc(len ? len : 1);
                memcpy(copy, data, len);
                free(data);
                n_failed = 0;
                fuzz_fail_hook = on_fail;
                targets[t].fn(copy, len);
                fuzz_fail_hook = NULL;
                free(copy);
                (*n_files)++;
                if (n_failed) {
                    printf("    %s: %d properties broken, the first: %s\n", path, n_failed, failed_msg);
                    ok = false;
                }
            }
            free(names[i]);
        }
        if (!ok) return false;
    }
    return true;
}

TEST(fuzz_regress)
{
    size_t n = 0;
    bool ok = replay("tests/fuzz/regress", &n);
    printf("    %zu inputs under tests/fuzz/regress/\n", n);
    CHECKF(ok, "a saved fuzz input fails again");
}

TEST(fuzz_regress_seeds)
{
    size_t n = 0;
    bool ok = replay("tests/fuzz/seeds", &n);
    if (n == 0) SKIP("no tests/fuzz/seeds/ (not run from the repository root?)");
    printf("    %zu inputs under tests/fuzz/seeds/\n", n);
    CHECKF(ok, "a seed breaks a property");
}
