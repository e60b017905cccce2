/* Sessions (src/session/session.c) on ds4-tiny: a prompt that diverges goes
 * back to the last checkpoint before the divergence and computes what an
 * uninterrupted run does; a regeneration and a strict prefix too; a marked
 * position keeps a checkpoint off the grid (the start of a last turn). */
#include "test.h"
#include "ds4_tiny.h"
#include "arch/model.h"
#include "session/snapshot.h"

#include <stdlib.h>
#include <string.h>

TEST(session_rollback_and_checkpoints)
{
    kvt_model *m = tiny();
    CHECK(m);
    enum { N = 2400, D = 2300 };
    int32_t a[N], b[N];
    seqb(a, N, 13);
    memcpy(b, a, sizeof a);
    for (size_t i = D; i < N; i++) b[i] = (int32_t)((a[i] + 3) % 256);
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    CHECK_OK(kvt_session_sync(s, a, N, NULL));
    /* Diverge at D: the session goes back to its checkpoint at 2048. */
    size_t reused = 0;
    CHECK_OK(kvt_session_sync(s, b, N, &reused));
    CHECKF(reused == 2048, "reused %zu (checkpoint at 2048 expected)", reused);
    state x = {0}, y = {0};
    CHECK_OK(capture(s, m, &x));
    CHECK_OK(run(m, b, N, NULL, 0, 1, &y));
    CHECK(equal(&x, &y));
    state_free(&x); state_free(&y);
    /* Regenerate: the same prompt after decoding reuses all of it, exactly. */
    CHECK_OK(kvt_session_decode(s, 65));
    CHECK_OK(kvt_session_decode(s, 66));
    CHECK_OK(kvt_session_sync(s, b, N, &reused));
    CHECKF(reused == N, "regenerate reused %zu of %d", reused, N);
    CHECK_OK(capture(s, m, &x));
    CHECK_OK(run(m, b, N, NULL, 0, 1, &y));
    CHECK(equal(&x, &y));
    state_free(&x); state_free(&y);
    /* A strict prefix off every checkpoint: recomputed from 2048, exact. */
    CHECK_OK(kvt_session_sync(s, b, 2100, &reused));
    CHECK(reused == 2048);
    CHECK_OK(capture(s, m, &x));
    CHECK_OK(run(m, b, 2100, NULL, 0, 1, &y));
    CHECK(equal(&x, &y));
    state_free(&x); state_free(&y);
    kvt_session_free(s);
    kvt_model_close(m);
}

TEST(session_marked_checkpoint)
{
    kvt_model *m = tiny();
    CHECK(m);
    enum { N = 900, MARK = 777 };
    int32_t a[N], b[N];
    seqb(a, N, 23);
    memcpy(b, a, sizeof a);
    for (size_t i = MARK + 1; i < N; i++) b[i] = (a[i] + 9) % 256; /* another last turn */
    kvt_session *s = NULL;
    CHECK_OK(kvt_session_new(&s, m, NULL));
    kvt_session_set_mark(s, MARK);
    CHECK_OK(kvt_session_sync(s, a, N, NULL));
    size_t reused = 0;
    CHECK_OK(kvt_session_sync(s, b, N, &reused));
    CHECKF(reused == MARK, "reused %zu, the mark is at %d", reused, MARK);
    state x = {0}, y = {0};
    CHECK_OK(capture(s, m, &x));
    CHECK_OK(run(m, b, N, NULL, 0, 1, &y));
    CHECK(equal(&x, &y));
    state_free(&x);
    state_free(&y);
    /* without a mark the same divergence goes back to the start (no grid point below 2048) */
    kvt_session_set_mark(s, 0);
    CHECK_OK(kvt_session_sync(s, a, N, &reused));
    CHECK(reused == MARK); /* the marked checkpoint is still there */
    kvt_session_free(s);
    CHECK_OK(kvt_session_new(&s, m, NULL));
    CHECK_OK(kvt_session_sync(s, a, N, NULL));
    CHECK_OK(kvt_session_sync(s, b, N, &reused));
    CHECK(reused == 0);
    kvt_session_free(s);
    kvt_model_close(m);
}
