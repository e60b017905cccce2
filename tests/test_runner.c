/* Tests of the test runner itself (tests/main.c).
 *
 *   runner_cleans_after_failure  a test run as the runner runs one, in a
 *                  child (kvt_test_run_child), makes a temp dir
 *                  (fx_tmpdir_make) and starts a child process (fx_spawn:
 *                  `sleep 600`), then fails a CHECK before the lines that
 *                  would remove and stop them. Afterwards the dir is gone
 *                  and the process is dead: the runner's cleanup list ran.
 *                  With kvt_test_fault_no_cleanup (the list dropped, as
 *                  before there was one) both are left behind, and the test
 *                  says so (then removes and kills them itself). */
#include "fixture.h"
#include "test.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int report_fd = -1; /* where the failing test writes what it made */

/* Fails on purpose, leaving its dir and child to the cleanup list. */
static void fails_midway(void)
{
    fx_server s = {0};
    CHECK(fx_tmpdir_make(&s, "kvtier-runner"));
    char out[128];
    snprintf(out, sizeof out, "%s/sleep.log", s.dir);
    const char *argv[] = {"sleep", "600", NULL};
    pid_t pid = fx_spawn(argv, out);
    CHECK(pid > 0);
    char line[128];
    int n = snprintf(line, sizeof line, "%d %s\n", (int)pid, s.dir);
    CHECK(write(report_fd, line, (size_t)n) == n);
    printf("    (the failure below is the runner test's, on purpose)\n");
    CHECKF(false, "a check fails before the test removes its dir and stops its child");
    kill(pid, SIGKILL); /* not reached */
    fx_tmpdir_remove(&s);
}

/* Run fails_midway in a child; *pid and dir: what it made. false when it
 * could not be run or did not fail as meant. */
static bool run_failing(pid_t *pid, char *dir, size_t cap)
{
    int p[2];
    if (pipe(p)) return false;
    report_fd = p[1];
    int rc = kvt_test_run_child(fails_midway);
    close(p[1]);
    char buf[256] = {0};
    ssize_t got = read(p[0], buf, sizeof buf - 1);
    close(p[0]);
    int ipid = 0;
    char d[128] = "";
    bool ok = rc == 1 && got > 0 && sscanf(buf, "%d %127s", &ipid, d) == 2;
    if (!ok) printf("    the failing test: result %d, report \"%s\"\n", rc, buf);
    *pid = ipid;
    snprintf(dir, cap, "%s", d);
    return ok;
}

static bool dir_exists(const char *d)
{
    struct stat st;
    return stat(d, &st) == 0;
}

/* Whether pid still names a live process (a zombie waiting for init's
 * reaping counts as dead: give init a moment). */
static bool alive(pid_t pid)
{
    for (int i = 0; i < 50; i++) {
        if (kill(pid, 0) != 0 && errno == ESRCH) return false;
        char path[64], state = 0;
        snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
        FILE *f = fopen(path, "r");
        if (f) {
            if (fscanf(f, "%*d %*s %c", &state) != 1) state = 0;
            fclose(f);
        }
        if (f && state != 'Z') return true;
        fx_sleep_ms(20);
    }
    return true;
}

TEST(runner_cleans_after_failure)
{
    pid_t pid;
    char dir[128];
    CHECKF(run_failing(&pid, dir, sizeof dir), "the runner's child test did not fail as meant");
    bool left_dir = dir_exists(dir), left_proc = alive(pid);
    printf("    after the failing test: %s %s, child %d %s\n", dir, left_dir ? "left" : "removed", (int)pid,
           left_proc ? "still running" : "gone");
    if (left_proc) kill(pid, SIGKILL);
    if (left_dir) fx_rm_tree(dir);
    CHECKF(!left_dir && !left_proc, "a failing test left its temp dir or its child process behind");

    /* negative control: without the cleanup list both stay */
    kvt_test_fault_no_cleanup = true;
    bool ran = run_failing(&pid, dir, sizeof dir);
    kvt_test_fault_no_cleanup = false;
    CHECKF(ran, "the runner's child test did not fail as meant (fault run)");
    left_dir = dir_exists(dir);
    left_proc = alive(pid);
    printf("    with kvt_test_fault_no_cleanup: %s %s, child %d %s (removed and killed here)\n", dir,
           left_dir ? "left" : "removed", (int)pid, left_proc ? "still running" : "gone");
    if (left_proc) kill(pid, SIGKILL);
    if (left_dir) fx_rm_tree(dir);
    CHECKF(left_dir && left_proc, "with the cleanup list off the failing test still left nothing: this test "
           "cannot tell the list's work from no work");
}
