/* The set-up a new user runs: the Makefile's dependency check and the one
 * list of Debian packages (tools/debian-packages) that the check, .ci/run and
 * the README share. Run from the repository root, as `make test` does. */
#include "test.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define PKG_LIST "tools/debian-packages"

/* The package names of tools/debian-packages, and the pkg-config checked
 * ones among them (want_pc). Returns the count, at most cap. */
static size_t read_packages(char names[][64], size_t cap, bool want_pc)
{
    char *list = kvt_test_read_file(PKG_LIST, NULL);
    size_t n = 0;
    for (char *line = list ? strtok(list, "\n") : NULL; line && n < cap; line = strtok(NULL, "\n")) {
        char pkg[64], check[128];
        if (line[0] == '#' || sscanf(line, "%63s %127s", pkg, check) != 2) continue;
        if (want_pc && strncmp(check, "pc:", 3)) continue;
        strcpy(names[n++], pkg);
    }
    free(list);
    return n;
}

/* Run a shell command; its stdout and stderr together in *out (malloc'ed). */
static int run_sh(const char *cmd, char **out)
{
    char path[] = "/tmp/kvtier-build-out-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return -1;
    close(fd);
    char full[4096];
    snprintf(full, sizeof full, "(%s) >%s 2>&1", cmd, path);
    int st = system(full);
    *out = kvt_test_read_file(path, NULL);
    unlink(path);
    return st == -1 || !WIFEXITED(st) ? -1 : WEXITSTATUS(st);
}

/* With a pkg-config that finds nothing, `make` stops before compiling and
 * names the missing packages with the apt-get line that installs them. */
TEST(build_missing_packages_named)
{
    if (access("Makefile", R_OK) || access(PKG_LIST, R_OK) || system("command -v make >/dev/null 2>&1"))
        SKIP("not run from the repository root, or make is absent");
    char pc[64][64];
    size_t n_pc = read_packages(pc, 64, true);
    CHECKF(n_pc >= 5, "%s lists %zu pkg-config checked packages", PKG_LIST, n_pc);
    char dir[] = "/tmp/kvtier-build-XXXXXX", empty[] = "/tmp/kvtier-pc-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir) && kvt_test_mkdtemp(empty));
    char cmd[1024], *out = NULL;
    /* KVT_DEPS_INSTALL=0: never call apt-get, as when not root. */
    snprintf(cmd, sizeof cmd,
             "PKG_CONFIG_LIBDIR=%s PKG_CONFIG_PATH= KVT_DEPS_INSTALL=0 make --no-print-directory BUILD=%s/b all",
             empty, dir);
    int st = run_sh(cmd, &out);
    struct stat sb;
    bool compiled = stat(strcat(strcpy((char[128]){0}, dir), "/b/obj"), &sb) == 0;
    snprintf(cmd, sizeof cmd, "rm -rf %s %s", dir, empty);
    if (system(cmd)) printf("    could not remove %s\n", dir);
    CHECK(out);
    bool named = true;
    for (size_t i = 0; i < n_pc; i++) {
        if (!strstr(out, pc[i])) { named = false; printf("    %s is not named\n", pc[i]); }
    }
    bool line = strstr(out, "apt-get install -y ") != NULL;
    bool cc_error = strstr(out, "error:") || strstr(out, ".h: No such file");
    if (st == 0 || !named || !line || cc_error || compiled) printf("    exit %d, output:\n%.2000s\n", st, out);
    free(out);
    CHECKF(st != 0, "make succeeded without its packages");
    CHECK(named && line);
    CHECKF(!cc_error && !compiled, "the compiler ran before the check stopped the build");
}

/* The README names the same packages as the list, and .ci/run runs the
 * README's test command and nothing in its place (before it, it builds the
 * fuzz targets, as the README says). */
TEST(build_one_package_list)
{
    char *readme = kvt_test_read_file("README.md", NULL), *ci = kvt_test_read_file(".ci/run", NULL);
    if (!readme || !ci) { free(readme); free(ci); SKIP("not run from the repository root"); }
    char pkgs[64][64];
    size_t n = read_packages(pkgs, 64, false);
    bool all = n >= 8;
    for (size_t i = 0; i < n; i++) {
        char word[80];
        snprintf(word, sizeof word, "`%s`", pkgs[i]);
        if (!strstr(readme, word)) { all = false; printf("    README.md does not name %s\n", word); }
    }
    bool readme_test = strstr(readme, "\nmake run\nmake test\n") != NULL;
    /* .ci/run: the README's `make test`, its packages through tools/deps.sh */
    bool ci_test = strstr(ci, "\nmake test\n") != NULL && !strstr(ci, "apt-get");
    bool ci_fuzz = strstr(ci, "\nmake -j2 fuzz-build fuzz-seeds ") != NULL && strstr(readme, "`make fuzz-build fuzz-seeds`");
    free(readme);
    free(ci);
    CHECKF(all, "README.md and %s disagree", PKG_LIST);
    CHECKF(readme_test, "README's set-up is not `make run` and `make test`");
    CHECKF(ci_test, ".ci/run does not run exactly `make test`");
    CHECKF(ci_fuzz, ".ci/run and the README disagree on the fuzz targets' build");
}

/* A package whose third column names a make goal is needed by that goal
 * alone: tools/deps.sh checks it only when given the goal (`tools/deps.sh
 * fuzz`), never for the build every user runs; and each goal named in the
 * list is one the Makefile checks for. Run on a copy of deps.sh whose list
 * adds a package that cannot be found, tagged with a goal. */
TEST(build_goal_packages)
{
    if (access("Makefile", R_OK) || access(PKG_LIST, R_OK) || access("tools/deps.sh", R_OK))
        SKIP("not run from the repository root");
    char *list = kvt_test_read_file(PKG_LIST, NULL), *mk = kvt_test_read_file("Makefile", NULL);
    CHECK(list && mk);
    /* the goals of the real list */
    bool goals_ok = true;
    char *copy = strdup(list), *s1 = NULL;
    for (char *line = strtok_r(copy, "\n", &s1); line; line = strtok_r(NULL, "\n", &s1)) {
        char pkg[64], check[128], goals[128], *s2 = NULL;
        if (line[0] == '#' || sscanf(line, "%63s %127s %127s", pkg, check, goals) != 3) continue;
        for (char *g = strtok_r(goals, ",", &s2); g; g = strtok_r(NULL, ",", &s2)) {
            char want[160];
            snprintf(want, sizeof want, "tools/deps.sh %s", g);
            if (!strstr(mk, want)) { goals_ok = false; printf("    %s: the Makefile never runs `%s`\n", pkg, want); }
        }
    }
    free(copy);
    free(mk);
    char dir[] = "/tmp/kvtier-deps-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir));
    char path[128], cmd[512], *out[3] = {NULL, NULL, NULL};
    snprintf(path, sizeof path, "%s/debian-packages", dir);
    FILE *f = fopen(path, "w");
    bool wrote = f && fputs(list, f) >= 0 &&
                 fputs("kvt-test-absent      cmd:kvt-test-no-such-command   other,kvtgoal\n", f) >= 0;
    if (f) fclose(f);
    free(list);
    snprintf(cmd, sizeof cmd, "cp tools/deps.sh %s/", dir);
    bool copied = wrote && system(cmd) == 0;
    int st[3] = {-1, -1, -1};
    static const char *const goal[3] = {"", "kvtgoal", "fuzzless"};
    for (int i = 0; copied && i < 3; i++) {
        snprintf(cmd, sizeof cmd, "KVT_DEPS_INSTALL=0 sh %s/deps.sh %s", dir, goal[i]);
        st[i] = run_sh(cmd, &out[i]);
    }
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) printf("    could not remove %s\n", dir);
    for (int i = 0; i < 3; i++)
        if (out[i] && *out[i]) printf("    deps.sh %s (exit %d): %.500s\n", goal[i], st[i], out[i]);
    bool base = st[0] == 0, tagged = st[1] == 1 && out[1] && strstr(out[1], "apt-get install -y kvt-test-absent"),
         other = st[2] == 0;
    for (int i = 0; i < 3; i++) free(out[i]);
    CHECK(copied);
    CHECKF(base, "without a goal, deps.sh asks for a package only a goal needs");
    CHECKF(tagged, "with its goal, deps.sh does not name the missing package");
    CHECKF(other, "deps.sh asks for a package tagged with another goal");
    CHECK(goals_ok);
}

/* The public header is the library's interface only: no test hook, no
 * server policy (src/session/testing.h, src/store/testing.h,
 * src/store/policy.h hold those), and a KVT_VERSION. $KVT_PUBLIC_HEADER
 * checks another copy (the control: the header before the hooks moved,
 * which fails). */
TEST(build_public_header)
{
    const char *path = getenv("KVT_PUBLIC_HEADER") ? getenv("KVT_PUBLIC_HEADER") : "include/kvtier.h";
    char *h = kvt_test_read_file(path, NULL);
    if (!h) SKIP("%s absent: not run from the repository root", path);
    static const char *const private_names[] = {"kvt_session_sync_chunks", "kvt_store_set_quiet", "kvt_save_policy",
                                                "kvt_store_apply_policy"};
    size_t found = 0;
    for (size_t i = 0; i < sizeof private_names / sizeof *private_names; i++)
        if (strstr(h, private_names[i])) {
            printf("    %s declares %s\n", path, private_names[i]);
            found++;
        }
    bool version = strstr(h, "#define KVT_VERSION \"") != NULL;
    free(h);
    CHECKF(!found, "%zu private names in the public header", found);
    CHECKF(version, "%s defines no KVT_VERSION", path);
}

/* The module graph (tools/modgraph.sh, README "Source layout"): no arrow
 * between files of src/, from an include or a call, points up a layer or
 * forms a cycle. The control: a tree of two files where base/ calls into
 * app/ must be reported. */
TEST(build_module_graph)
{
    if (access("tools/modgraph.sh", X_OK) || system("command -v nm cc >/dev/null 2>&1"))
        SKIP("tools/modgraph.sh absent (not run from the repository root), or nm or cc absent");
    char build[512];
    snprintf(build, sizeof build, "%s", kvt_test_bin());
    char *slash = strrchr(build, '/');
    if (slash) *slash = 0;
    else snprintf(build, sizeof build, ".");
    char cmd[1200], *out = NULL;
    snprintf(cmd, sizeof cmd, "tools/modgraph.sh %s", build);
    int st = run_sh(cmd, &out);
    printf("    %s", out ? out : "(no output)\n");
    bool clean = st == 0 && out && strstr(out, "none points up, no cycle");
    free(out);
    CHECKF(clean, "tools/modgraph.sh %s exited %d: an arrow points up or a cycle (above)", build, st);

    char dir[] = "/tmp/kvtier-modgraph-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir));
    snprintf(cmd, sizeof cmd,
             "cd %s && mkdir -p src/base src/app build/obj/base build/obj/app && "
             "printf 'int up(void);\\nint low(void) { return up(); }\\n' >src/base/low.c && "
             "printf 'int up(void) { return 1; }\\n' >src/app/up.c && "
             "cc -c src/base/low.c -o build/obj/base/low.o && cc -c src/app/up.c -o build/obj/app/up.o && "
             "cd - >/dev/null && MODGRAPH_ROOT=%s tools/modgraph.sh %s/build",
             dir, dir, dir);
    st = run_sh(cmd, &out);
    bool caught = st == 1 && out && strstr(out, "up:    base/low -> app/up (call)");
    if (!caught) printf("    control: exit %d: %s", st, out ? out : "(no output)\n");
    free(out);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) printf("    could not remove %s\n", dir);
    CHECKF(caught, "a call from base/ up into app/ was not reported");
}
