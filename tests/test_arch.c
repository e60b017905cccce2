/* The architecture table (src/arch/arches.c, src/arch/arch.h) and the
 * cache plan's named parts (src/arch/plan.c).
 *
 *   arch_table_rows      every row has the operations the model layer calls
 *                        unconditionally, a name of its own, and presets only
 *                        with the three fields they need together
 *   arch_only_rows_name  no file of src/ outside the architecture files
 *                        (src/arch/NAME.c, NAME.h, NAME_*.c, NAME_*.h for
 *                        each row's name) and the table names an
 *                        architecture's symbols (kvt_NAME_*, kvt_arch_NAME):
 *                        the model layer and the layers above reach one
 *                        through its row alone. KVT_SRC (default src) points
 *                        the scan at another tree; the negative control is
 *                        KVT_SRC=/work/main/src, where model.c and
 *                        bench_store.c call kvt_ds4_* by name
 *   arch_plan_parts      kvt_plan_add sums parts by name, fixed and total;
 *                        a part not in the plan is 0; a plan full of parts
 *                        refuses another name
 */
#include "test.h"
#include "arch/arch.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

TEST(arch_table_rows)
{
    size_t n = 0;
    for (const kvt_arch *const *a = kvt_arches; *a; a++, n++) {
        const kvt_arch *r = *a;
        CHECKF(r->name && r->handles && r->load && r->cache_new && r->forward && r->fingerprint && r->plan &&
                   r->weights_free,
               "row %zu (%s) lacks an operation the model layer calls", n, r->name ? r->name : "unnamed");
        for (const kvt_arch *const *b = kvt_arches; b != a; b++)
            CHECKF(strcmp((*b)->name, r->name), "two rows are named %s", r->name);
        CHECKF(!r->is_preset == !r->preset && !r->preset == !r->presets && !r->preset == !r->plan_preset,
               "row %s has some of is_preset, presets, preset and plan_preset, not all", r->name);
    }
    CHECKF(n >= 2, "the table has %zu rows", n);
}

/* Whether file (a name in src/L/) belongs to the row named arch: arch.c,
 * arch.h, arch_*.c, arch_*.h in src/arch/. */
static bool of_row(const char *layer, const char *file, const char *arch)
{
    size_t n = strlen(arch);
    if (strcmp(layer, "arch") || strncmp(file, arch, n)) return false;
    return file[n] == '.' || file[n] == '_';
}

/* The first name of an architecture's symbols in text, NULL: none. */
static const char *names_row(const char *text, const char *arch, char *hit, size_t hl)
{
    char sym[2][64];
    snprintf(sym[0], sizeof sym[0], "kvt_%s_", arch);
    snprintf(sym[1], sizeof sym[1], "kvt_arch_%s", arch);
    for (int i = 0; i < 2; i++) {
        const char *p = strstr(text, sym[i]);
        if (p) {
            size_t k = 0;
            while (k + 1 < hl && (p[k] == '_' || (p[k] >= 'a' && p[k] <= 'z') || (p[k] >= '0' && p[k] <= '9'))) {
                hit[k] = p[k];
                k++;
            }
            hit[k] = 0;
            return p;
        }
    }
    return NULL;
}

TEST(arch_only_rows_name)
{
    const char *src = getenv("KVT_SRC") ? getenv("KVT_SRC") : "src";
    DIR *top = opendir(src);
    if (!top) SKIP("no %s (not run from the repository root)", src);
    size_t files = 0, bad = 0;
    struct dirent *le;
    while ((le = readdir(top))) {
        if (le->d_name[0] == '.') continue;
        char dir[512];
        snprintf(dir, sizeof dir, "%s/%s", src, le->d_name);
        DIR *d = opendir(dir);
        if (!d) continue;
        struct dirent *fe;
        while ((fe = readdir(d))) {
            size_t fl = strlen(fe->d_name);
            if (fl < 3 || (strcmp(fe->d_name + fl - 2, ".c") && strcmp(fe->d_name + fl - 2, ".h"))) continue;
            if (!strcmp(le->d_name, "arch") && !strcmp(fe->d_name, "arches.c")) continue; /* the table */
            char path[1024];
            snprintf(path, sizeof path, "%s/%s", dir, fe->d_name);
            char *text = kvt_test_read_file(path, NULL);
            if (!text) continue;
            files++;
            for (const kvt_arch *const *a = kvt_arches; *a; a++) {
                char hit[64];
                if (of_row(le->d_name, fe->d_name, (*a)->name) || !names_row(text, (*a)->name, hit, sizeof hit))
                    continue;
                printf("    %s names %s, of the %s row\n", path, hit, (*a)->name);
                bad++;
            }
            free(text);
        }
        closedir(d);
    }
    closedir(top);
    CHECKF(files > 20, "only %zu source files under %s", files, src);
    CHECKF(bad == 0, "%zu files outside the architecture files name an architecture (above)", bad);
}

TEST(arch_plan_parts)
{
    kvt_plan p = {0};
    CHECK_OK(kvt_plan_add(&p, "window", 100, true));
    CHECK_OK(kvt_plan_add(&p, "full rows", 1000, false));
    CHECK_OK(kvt_plan_add(&p, "window", 20, true));
    CHECK(p.n_parts == 2 && !strcmp(p.part[0].name, "window") && !strcmp(p.part[1].name, "full rows"));
    CHECK(kvt_plan_bytes(&p, "window") == 120 && kvt_plan_bytes(&p, "full rows") == 1000);
    CHECK(kvt_plan_bytes(&p, "indexer") == 0);
    CHECK(p.fixed == 120 && p.total == 1120);
    char names[KVT_PLAN_MAX_PARTS][8];
    for (int i = 2; i < KVT_PLAN_MAX_PARTS; i++) {
        snprintf(names[i], sizeof names[i], "p%d", i);
        CHECK_OK(kvt_plan_add(&p, names[i], 1, false));
    }
    CHECK(kvt_plan_add(&p, "one more", 1, false) == KVT_EINVAL);
    CHECK_OK(kvt_plan_add(&p, "window", 1, true)); /* a part it has still adds */
    CHECK(p.n_parts == KVT_PLAN_MAX_PARTS && p.total == 1121 + KVT_PLAN_MAX_PARTS - 2 && p.fixed == 121);
}
