/* Speculative decoding (src/serve/draft.c, src/serve/draft_model.c, the pass loop of
 * src/serve/generate.c, kvt_session_keep in src/session/session.c):
 *
 *   speculate_ngram          the n-gram drafter proposes what followed the
 *                            latest earlier match of the last 3 tokens
 *                            (else 2; a single token is no match), up to
 *                            max, repeating with
 *                            the match's period past the context's end,
 *                            and nothing without a match; --draft parses.
 *   speculate_tune           the drafts' tuning given each pass's time:
 *                            on a simulated model whose passes cost about
 *                            what their tokens do (stories260K) with half
 *                            the drafts kept, a reply costs at most 3%
 *                            more than plain decoding; with cheap extra
 *                            tokens the same drafts are kept and pay;
 *                            drafts all kept never stop to time a pass
 *                            without. Control: KVT_DRAFT_FAULT_NO_COST
 *                            (the tuning blind to cost, as untimed passes
 *                            are) loses more than 3% there.
 *   speculate_tune_replies   the tuning across one server's replies (a
 *                            record each starts from and hands back, a
 *                            fake clock): replies whose drafts all miss
 *                            where a rejection costs a pass draft in at
 *                            most 2% of passes after the first 3; paying
 *                            drafts (half kept) draft in every pass of
 *                            later replies, the first included; drafts
 *                            that turn from losing to paying are on again
 *                            within N = 130 passes. Controls:
 *                            KVT_DRAFT_FAULT_FRESH (each reply fresh)
 *                            drafts in more than 2% and times passes
 *                            without drafts; KVT_DRAFT_FAULT_STALE_MEAN
 *                            (a probe an eighth of the old mean) misses N.
 *   speculate_learned        replies starting from a record (alone,
 *                            batched, deep in a losing streak; the tuning
 *                            blind to the clock, so what each drafts is
 *                            fixed) equal plain decoding and draft as the
 *                            record says; control: the record ignored
 *                            (KVT_DRAFT_FAULT_FRESH) drafts where the
 *                            streak says none.
 *   speculate_auto           --draft auto (the default) is ngram for the
 *                            dense models whose cache is rows alone
 *                            (llama, qwen3) and none, with its reason,
 *                            for routed experts (qwen3moe) and for fixed
 *                            state (gemma3's windows, qwen35's recurrent
 *                            state, ds4-tiny). Control:
 *                            KVT_DRAFT_FAULT_AUTO_NGRAM (ngram for every
 *                            model) gives ngram where none is due, and the
 *                            test says so.
 *   speculate_ds4            ds4-tiny (window, frontiers, compressed rows)
 *   speculate_llama          the llama family's full rows (llama)
 *   speculate_gemma3         window rings (gemma3)
 *   speculate_qwen35         recurrent state (qwen35)
 *                            each: a prompt that repeats a block of tokens,
 *                            replied to greedily and sampled (seeded,
 *                            temperature, top-k), alone (kvt_generate_run)
 *                            and two replies batched in one pass per step
 *                            (kvt_session_step, as the server's scheduler):
 *                            with --draft ngram the response (text, every
 *                            token's log-probability and alternatives), the
 *                            session's tokens and its digest (logits and
 *                            cache bytes) equal plain decoding's, drafts
 *                            were accepted (the check sees speculation at
 *                            work) and rejected ones rolled back. Control:
 *                            with KVT_SESSION_FAULT_KEEP_ONE_MORE (a
 *                            rollback that keeps one token too many) the
 *                            same comparison fails (run with the drafter
 *                            that knows the reply: its drafts are
 *                            rejected by design). And a reply that runs
 *                            into the context's end mid-draft is the same.
 *   speculate_model_ds4      --draft model: ds4-tiny drafted for by another
 *                            copy of itself (greedy drafts all accepted,
 *                            sampled ones partly) and by a narrower
 *                            ds4-tiny+D=32 of other weights (same
 *                            vocabulary; its drafts rejected): greedy and
 *                            sampled, alone and batched, the response, the
 *                            session's tokens and digest equal plain
 *                            decoding's, and the draft session, brought to
 *                            the reply's tokens, equals a fresh session of
 *                            the draft model synced to them (logits and
 *                            cache bytes). Controls: the draft session's
 *                            state saved one token late before each pass
 *                            (KVT_DRAFT_FAULT_SAVE_LATE, an off-by-one
 *                            rollback) leaves it unequal; a rejected first
 *                            draft accepted (KVT_DRAFT_FAULT_ACCEPT_FIRST)
 *                            changes the reply.
 *   speculate_mtp_ds4        --draft mtp: ds4-tiny+mtp=1 (ds4-tiny's weights
 *                            and an MTP layer after them), greedy and
 *                            sampled, alone and batched, with the layer's
 *                            own guesses and with the knowing drafter's in
 *                            their place (the layer still running): the
 *                            response, tokens and digest equal plain
 *                            decoding's, which equal ds4-tiny's; the
 *                            layer's window, brought to the reply's
 *                            tokens, equals one made on a session synced
 *                            to them in one pass. Control:
 *                            KVT_DRAFT_FAULT_MTP_KEEP (a pass's first
 *                            chained row kept as verified, an off-by-one
 *                            rollback of the window) leaves it unequal;
 *                            ds4-tiny without the layer is refused.
 *   speculate_mtp_ds4_batched  --draft mtp, two requests whose verify
 *                            passes share ds4's batched pass: each reply,
 *                            with its logprobs, tokens, digest, passes,
 *                            drafts and acceptances, equals the request
 *                            alone. Control: KVT_DS4_FAULT_BATCH_POS (the
 *                            second segment rotated as if it went on from
 *                            the first) changes the second reply only.
 *   speculate_mtp_file_ds4   --draft mtp --model-draft FILE: ds4-tiny+mtp=1's
 *                            layer written as ds4.c's separate file
 *                            (mtp.0.*) and attached to ds4-tiny: two chained
 *                            steps of the layer give the in-file layer's
 *                            logits, streams and rows bit for bit; replies
 *                            give the same response, digest, drafted and
 *                            accepted counts, plain decoding's; the file's
 *                            own head norm is the one used (doubled: the
 *                            logits double exactly). Control:
 *                            KVT_DS4_FAULT_MTP_BIND (e_proj and h_proj
 *                            swapped) makes the layer's bits differ.
 *                            Refused naming the problem, the model left
 *                            as it was: another shape (the tensor named),
 *                            a truncated file, a foreign architecture, a
 *                            model with its own layer.
 *   speculate_mtp_file_memory  the attached file is mapped with the model,
 *                            and counted so: after attaching it to
 *                            ds4-tiny opened from a GGUF, the model's
 *                            mapped bytes (kvt_model_memory: `info`, the
 *                            memory note) grow by the tensor data the
 *                            file's header declares, type by type; the
 *                            count from the paths alone (info of a header,
 *                            the note at start) is the same; with the
 *                            available memory between the two, the note
 *                            says the weights no longer fit; `kvtier info
 *                            --draft mtp --model-draft FILE` prints it.
 *                            Control: KVT_MEMORY_FAULT_NO_MTP (the count
 *                            before the file was counted) leaves mapped
 *                            as it was: the checks fail.
 *   speculate_model_llama    the same with each family's synthetic model
 *   speculate_model_gemma3   drafting for another copy of itself: the
 *   speculate_model_qwen35   draft session's rollback through full rows,
 *                            window rings and recurrent state (the late
 *                            save is no fault for llama's full rows, which
 *                            are only truncated: its control is not
 *                            required to bite there).
 *   speculate_server         `kvtier serve` (KVT_BIN) on ds4-tiny, --parallel
 *                            2: completions with repeating prompts, greedy
 *                            and seeded sampling with logprobs, two at once
 *                            (batched in one pass per step) and one alone,
 *                            give the same bodies (but id and created) with
 *                            --draft ngram as with --draft none, and
 *                            /metrics counts the drafts, at least one
 *                            accepted, and fewer passes than tokens; the
 *                            same with --draft model --model-draft
 *                            ds4-tiny, its drafts counted under
 *                            drafter="model"; and with --draft mtp on
 *                            ds4-tiny+mtp=1 served as ds4-tiny, under
 *                            drafter="mtp". On a
 *                            build without speculation (main before it)
 *                            the server refuses --draft: the test fails.
 *   speculate_run            `kvtier run` (KVT_BIN) on ds4-tiny: the ids of
 *                            --draft ngram equal --draft none's, greedy and
 *                            sampled, drafts accepted in the greedy one;
 *                            so are --draft model --model-draft ds4-tiny's;
 *                            a draft model whose vocabulary differs at one
 *                            token is refused (exit 2) naming the token,
 *                            and serve refuses to start with it;
 *                            --draft mtp on ds4-tiny is refused (no MTP
 *                            layer), and with --model-draft FILE (ds4.c's
 *                            file from model new --mtp-out) it drafts and
 *                            gives --draft none's ids (a model with its
 *                            own layer refuses the file, exit 2),
 *                            --draft model without --model-draft,
 *                            --model-draft with --draft ngram, --draft x
 *                            and --draft-max 65 are usage errors. On main
 *                            (no --draft model) it fails.
 *   speculate_model_kept     the draft session kept from reply to reply
 *                            (ds4-tiny by itself and by ds4-tiny+D=32): a
 *                            second turn extending the first reply, on the
 *                            session the first gave back (release, adopt),
 *                            runs only the tokens it lacks and one a pass;
 *                            saved to a store it is found by the draft
 *                            model's key chain and restored gives the same;
 *                            a damaged record is a clean miss; each time
 *                            the reply, logprobs and digest are plain
 *                            decoding's and the session given back equals a
 *                            fresh synced one. Control:
 *                            KVT_DRAFT_FAULT_ADOPT_LONG (an adopted session
 *                            one token long left so) fails that comparison.
 *   speculate_server_kept    the same through `kvtier serve` on stories260K:
 *                            the second turn's draft session kept in RAM
 *                            (from="ram"), then after a restart restored
 *                            from the disk store (from="store"), then with
 *                            every record damaged a clean miss, then under
 *                            --kv-ram-mb 2 dropped (counted); the replies
 *                            (text, logprobs) are --draft none's. */
#include "test.h"
#include "fam_state.h"
#include "fixture.h"
#include "serve/api.h"
#include "serve/draft.h"
#include "serve/generate.h"
#include "arch/model.h"
#include "arch/ds4.h"
#include "arch/llama.h"
#include "arch/llama_weights.h"
#include "session/memory.h"
#include "session/snapshot.h"
#include "base/util.h"
#include "store/store.h"
#include "store/testing.h"

#include <fcntl.h>
#include <jansson.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

TEST(speculate_ngram)
{
    int32_t out[8];
    const int32_t a[] = {5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6};
    /* context a + 7: "6 7" last matched at 5..6 (3-gram "5 6 7" at 0..2 is the longest) */
    size_t n = kvt_draft_ngram(a, 11, 7, 8, out);
    CHECKF(n == 8 && out[0] == 8 && out[1] == 1 && out[7] == 6, "3-gram: %zu drafts, first %d", n, n ? out[0] : -1);
    n = kvt_draft_ngram(a, 11, 7, 2, out);
    CHECK(n == 2 && out[0] == 8 && out[1] == 1);
    /* context b + 4: "9 4" 3 tokens back (no 3-gram), followed by 3 9 4,
     * then the same again */
    const int32_t b[] = {1, 9, 4, 3, 9};
    n = kvt_draft_ngram(b, 5, 4, 8, out);
    CHECKF(n == 8 && out[0] == 3 && out[2] == 4 && out[3] == 3 && out[7] == 9, "2-gram: %zu drafts", n);
    /* context b + 3: only the 1-gram "3": no draft */
    n = kvt_draft_ngram(b, 5, 3, 8, out);
    CHECKF(n == 0, "1-gram: %zu drafts", n);
    /* context d + 9: "3 9" 2 back (a 2-gram): 3 9 3 9 ... */
    const int32_t d[] = {1, 3, 9, 3};
    n = kvt_draft_ngram(d, 4, 9, 8, out);
    CHECKF(n == 8 && out[0] == 3 && out[1] == 9 && out[6] == 3 && out[7] == 9, "2-gram, period 2: %zu drafts", n);
    /* a token over and over */
    const int32_t c[] = {1, 5, 5};
    n = kvt_draft_ngram(c, 3, 5, 4, out);
    CHECKF(n == 4 && out[0] == 5 && out[3] == 5, "a repeated token: %zu drafts", n);
    n = kvt_draft_ngram(b, 5, 12, 8, out);
    CHECK(n == 0);
    n = kvt_draft_ngram(b, 0, 12, 8, out);
    CHECK(n == 0);
    kvt_draft_kind k;
    CHECK(kvt_draft_parse("ngram", &k) == KVT_OK && k == KVT_DRAFT_NGRAM);
    CHECK(kvt_draft_parse("none", &k) == KVT_OK && k == KVT_DRAFT_NONE);
    CHECK(kvt_draft_parse("model", &k) == KVT_OK && k == KVT_DRAFT_MODEL);
    CHECK(kvt_draft_parse("mtp", &k) == KVT_OK && k == KVT_DRAFT_MTP);
    CHECK(kvt_draft_parse("x", &k) == KVT_EINVAL);
}

/* A reply of `tokens` tokens decoded under the drafts' tuning by a
 * drafter that keeps the first half of what it drafts (all of it when
 * `all`), each pass costing cost(k) = a + b k seconds for k tokens (the
 * clock the tuner is given): returns the reply's seconds, and the passes
 * without drafts in *plain. */
static double tune_sim(double a, double b, bool all, bool timed, size_t tokens, size_t *plain)
{
    kvt_draft_tune t;
    kvt_draft_tune_init(&t, 8);
    double secs = 0;
    *plain = 0;
    for (size_t got = 0; got < tokens;) {
        size_t d = kvt_draft_tune_len(&t), kept = all ? d : d / 2;
        double c = a + b * (double)(1 + d);
        secs += c;
        got += 1 + kept;
        *plain += !d;
        kvt_draft_tune_after(&t, d, kept, timed ? c : -1);
    }
    return secs;
}

TEST(speculate_tune)
{
    /* a model bound by arithmetic (stories260K: a pass of k tokens costs
     * about 0.25 + 0.75 k of one) whose drafts are half kept: drafting
     * loses, and the tuning, timing the passes, loses at most 3% to
     * plain decoding (2000 tokens: 2000 s) */
    size_t plain, plain_nc;
    double lose = tune_sim(0.25, 0.75, false, true, 2000, &plain);
    CHECKF(lose <= 2000 * 1.03, "half-kept drafts, passes cost their tokens: %.0f s against 2000 plain", lose);
    /* control: the tuning blind to the cost keeps drafting and loses more */
    kvt_draft_fault = KVT_DRAFT_FAULT_NO_COST;
    double blind = tune_sim(0.25, 0.75, false, true, 2000, &plain_nc);
    kvt_draft_fault = KVT_DRAFT_FAULT_NONE;
    CHECKF(blind > 2000 * 1.03, "control: the tuning blind to cost should lose more than 3%%, %.0f s", blind);
    /* untimed passes (secs < 0) leave the tuning blind to cost */
    double untimed = tune_sim(0.25, 0.75, false, false, 2000, &plain_nc);
    CHECKF(untimed > 2000 * 1.03, "untimed: %.0f s", untimed);
    /* a model whose weights stream from memory (a pass of k tokens costs
     * 0.95 + 0.05 k): the same drafts pay, and the tuning keeps them */
    double win = tune_sim(0.95, 0.05, false, true, 2000, &plain);
    CHECKF(win < 2000 * 0.7, "half-kept drafts, cheap extra tokens: %.0f s against 2000 plain", win);
    /* drafts all kept ask for no pass without drafts to time */
    double copy = tune_sim(0.25, 0.75, true, true, 2000, &plain);
    CHECKF(plain == 0 && copy < 2000, "all kept: %zu passes without drafts, %.0f s", plain, copy);
    printf("    2000 tokens, plain 2000 s; arithmetic-bound %.0f s (blind %.0f s), "
            "memory-bound %.0f s, all kept %.0f s\n", lose, blind, win, copy);
}

/* A pass's cost on the fake clock (plain passes cost 1): a model whose
 * rejected drafts are costly to undo (fixed state restored, the kept
 * tokens run again: Qwen 3.5's MTP layer on a file whose guesses all
 * miss) or one whose extra tokens are cheap (weights streamed from
 * memory). */
static double cost_undo(size_t d, size_t kept) { return d ? 2.0 + 0.1 * (double)d + 0.2 * (double)kept : 1.0; }
static double cost_cheap(size_t d, size_t kept) { return 1.0 + 0.05 * (double)d; }
/* Rejections that cost little (a rollback that is a truncation) but drafts
 * a pass's first 8 too many: losses at first, then 1-token probes within
 * the margin. */
static double cost_near(size_t d, size_t kept) { return d ? 1.1 + 0.02 * (double)d + (d > 4 ? 0.3 : 0) : 1.0; }

typedef struct reply_sim {
    size_t passes, drafting, plain_in_reply; /* passes, of which with drafts, without */
    size_t first_drafts;                     /* the reply's first pass drafted */
    size_t gap_to_on;                        /* passes from the reply's start to drafts on for good (0: never) */
} reply_sim;

/* One reply of `tokens` tokens under the tuning, the tuning starting from
 * rec (a server's record; handed back at the end), a drafter whose drafts
 * are kept in the fraction keep (0: all rejected, 1: all kept, else half),
 * each pass timed by the fake clock cost(). */
static reply_sim tune_reply(kvt_draft_tune *rec, size_t tokens, double keep, double (*cost)(size_t, size_t))
{
    kvt_draft_tune t;
    kvt_draft_tune_resume(&t, rec, 8);
    reply_sim r = {0};
    size_t run = 0; /* passes with drafts in a row */
    for (size_t got = 0; got < tokens; r.passes++) {
        size_t d = kvt_draft_tune_len(&t), kept = keep >= 1 ? d : keep > 0 ? d / 2 : 0;
        if (!r.passes) r.first_drafts = d > 0;
        r.drafting += d > 0;
        r.plain_in_reply += !d;
        run = d ? run + 1 : 0;
        if (run == 8 && !r.gap_to_on) r.gap_to_on = r.passes - 7;
        got += 1 + kept;
        kvt_draft_tune_after(&t, d, kept, cost(d, kept));
    }
    kvt_draft_tune_keep(rec, &t);
    return r;
}

/* Replies 4..n of 64 tokens each whose drafts all miss on a model where a
 * rejected draft costs a pass and more: the share of passes with drafts. */
static double losing_share(size_t n, kvt_draft_tune *rec, double (*cost)(size_t, size_t))
{
    size_t drafting = 0, passes = 0;
    for (size_t i = 0; i < n; i++) {
        reply_sim r = tune_reply(rec, 64, 0, cost);
        if (i >= 3) drafting += r.drafting, passes += r.passes;
    }
    return (double)drafting / (double)passes;
}

TEST(speculate_tune_replies)
{
    /* drafts that always fail, 40 replies of one server: after the first
     * 3, at most 2% of passes draft (each reply alone: a reply is over
     * before its tuning has learned) */
    kvt_draft_tune rec = {0}, near = {0};
    double share = losing_share(40, &rec, cost_undo), share_near = losing_share(40, &near, cost_near);
    kvt_draft_fault = KVT_DRAFT_FAULT_FRESH;
    kvt_draft_tune fresh = {0};
    double share_fresh = losing_share(40, &fresh, cost_undo);
    kvt_draft_fault = KVT_DRAFT_FAULT_NONE;
    printf("    drafts all missing, replies 4..40 of 64 tokens: %.2f%% of passes draft (rejections cheap, "
           "probes within the margin: %.2f%%; control, each reply fresh: %.2f%%)\n", 100 * share,
           100 * share_near, 100 * share_fresh);
    CHECKF(share <= 0.02 && share_near <= 0.02, "losing drafts: %.2f%% (%.2f%%) of passes still draft",
           100 * share, 100 * share_near);
    CHECKF(share_fresh > 0.02, "control: replies that start fresh should draft in more than 2%% of passes, %.2f%%",
           100 * share_fresh);
    /* drafts that pay (half kept, cheap extra tokens): after the first
     * reply, every pass of every reply drafts, the first included (a
     * reply alone stops drafting for passes to time without) */
    kvt_draft_tune pay = {0};
    size_t plain_later = 0, first_all = 1;
    for (size_t i = 0; i < 10; i++) {
        reply_sim r = tune_reply(&pay, 64, 0.5, cost_cheap);
        if (i) plain_later += r.plain_in_reply, first_all &= r.first_drafts;
    }
    kvt_draft_fault = KVT_DRAFT_FAULT_FRESH;
    kvt_draft_tune pay_f = {0};
    size_t plain_fresh = 0;
    for (size_t i = 0; i < 10; i++) {
        reply_sim r = tune_reply(&pay_f, 64, 0.5, cost_cheap);
        if (i) plain_fresh += r.plain_in_reply;
    }
    kvt_draft_fault = KVT_DRAFT_FAULT_NONE;
    printf("    paying drafts, replies 2..10: %zu passes without drafts, every first pass drafts: %s (control, "
           "each reply fresh: %zu passes without)\n", plain_later, first_all ? "yes" : "NO", plain_fresh);
    CHECKF(plain_later == 0 && first_all, "paying drafts: %zu passes without drafts in later replies", plain_later);
    CHECKF(plain_fresh > 0, "control: fresh replies should time passes without drafts");
    /* from losing to paying: after the 40 losing replies the drafts
     * begin to pay; the next probe finds it (probes at most 129 passes
     * apart at this cost: N = 130) and drafts stay on */
    enum { N = 130 };
    kvt_draft_tune flip = rec, flip_c = rec;
    reply_sim on = tune_reply(&flip, 400, 1, cost_cheap);
    kvt_draft_fault = KVT_DRAFT_FAULT_STALE_MEAN;
    reply_sim on_c = tune_reply(&flip_c, 400, 1, cost_cheap);
    kvt_draft_fault = KVT_DRAFT_FAULT_NONE;
    printf("    losing, then paying: drafts on for good after %zu passes (N = %d; control, the probe an "
           "eighth of the old mean: %zu)\n", on.gap_to_on, N, on_c.gap_to_on);
    CHECKF(on.gap_to_on > 0 && on.gap_to_on <= N, "paying drafts found again after %zu passes", on.gap_to_on);
    CHECKF(on_c.gap_to_on == 0 || on_c.gap_to_on > N, "control: the stale mean found them after %zu passes",
           on_c.gap_to_on);
}

/* One reply's outcome. */
typedef struct outcome {
    char *body;
    uint64_t digest;
    int32_t *toks;
    size_t n;
    kvt_usage u;
    bool draft_exact;           /* --draft model: the draft session equals a fresh one synced to toks */
} outcome;

static void outcome_free(outcome *o)
{
    free(o->body);
    free(o->toks);
    memset(o, 0, sizeof *o);
}

typedef struct setting {
    const char *what;
    float temperature;
    uint32_t top_k;
} setting;

static const setting settings[] = {{"greedy", 0, 0}, {"sampled", 0.7f, 3}};

static kvt_request request(const setting *st, uint32_t max_new)
{
    return (kvt_request){.api = KVT_API_COMPLETIONS, .max_tokens = max_new, .temperature = st->temperature,
                         .top_p = 1, .top_k = st->top_k, .seed = 7, .has_seed = true, .logprobs = true,
                         .top_logprobs = 2};
}

enum { MAX_NEW = 48, BATCH = 2 };

/* Tokens the sessions have room for after the prompt (0: the reply's and
 * more): less ends the reply at the context, in the middle of a pass. */
static size_t ctx_room;
/* KVT_DRAFT_MODEL's draft model. */
static kvt_model *draft_m;
/* What earlier replies learned (kvt_gen.learned, as a server's record);
 * NULL: each reply learns alone. */
static kvt_draft_tune *learned_rec;

/* The draft session of dm, brought to the reply's tokens, equals a
 * session of the draft model synced to them: logits and cache bytes. */
static bool draft_session_exact(kvt_draft_model *dm, const int32_t *toks, size_t n, const kvt_session_opts *so)
{
    kvt_session *f = NULL;
    bool ok = kvt_draft_model_follow(dm, toks, n) == KVT_OK && kvt_session_new(&f, draft_m, so) == KVT_OK &&
              kvt_session_sync(f, toks, n, NULL) == KVT_OK &&
              kvt_session_len(kvt_draft_model_session(dm)) == n &&
              kvt_test_digest(kvt_draft_model_session(dm), draft_m) == kvt_test_digest(f, draft_m);
    kvt_session_free(f);
    return ok;
}

/* The MTP drafter mt, brought to the reply's tokens, holds the window a
 * drafter on a session of m synced to them in one pass holds: the same
 * rows, each made from the model's hidden state (none from a draft's). */
static bool mtp_exact(kvt_draft_mtp *mt, kvt_model *m, const int32_t *toks, size_t n, const kvt_session_opts *so)
{
    kvt_session *f = NULL;
    kvt_draft_mtp *fm = NULL;
    bool ok = kvt_draft_mtp_follow(mt, toks, n) == KVT_OK && kvt_session_new(&f, m, so) == KVT_OK &&
              kvt_session_sync(f, toks, n, NULL) == KVT_OK && kvt_draft_mtp_new(&fm, f) == KVT_OK &&
              kvt_draft_mtp_follow(fm, toks, n) == KVT_OK && kvt_draft_mtp_digest(mt, n) == kvt_draft_mtp_digest(fm, n);
    kvt_draft_mtp_free(fm);
    kvt_session_free(f);
    return ok;
}

/* k replies of prompt p[i] (n tokens each), with draft d, batched in one
 * pass per step when k > 1 (the server's scheduler), alone otherwise. */
static bool replies(kvt_model *m, int32_t *const *p, size_t n, size_t k, const setting *st, kvt_draft_kind d,
                    outcome *o)
{
    kvt_session *s[BATCH] = {0};
    kvt_request r[BATCH];
    kvt_gen g[BATCH];
    kvt_gen_run *R[BATCH] = {0};
    kvt_draft_model *dm[BATCH] = {0};
    kvt_draft_mtp *mt[BATCH] = {0};
    kvt_gen_out out = {0};
    bool ok = true, live[BATCH] = {0};
    kvt_session_opts so = {.n_ctx = (uint32_t)(n + (ctx_room ? ctx_room : MAX_NEW + 8)), .n_threads = 1};
    for (size_t i = 0; i < k && ok; i++) {
        memset(&o[i], 0, sizeof o[i]);
        r[i] = request(st, MAX_NEW);
        ok = kvt_session_new(&s[i], m, &so) == KVT_OK && kvt_session_sync(s[i], p[i], n, NULL) == KVT_OK;
        g[i] = (kvt_gen){.m = m, .s = s[i], .r = &r[i], .id = "cmpl-1", .model_name = "m", .max_new = MAX_NEW,
                         .n_ctx = so.n_ctx, .seed = 1, .draft = d, .draft_max = 6, .learned = learned_rec};
        /* the draft session prefills in chunks of 40: the prompt comes in
         * over the first passes, one chunk a pass, before any draft */
        kvt_session_opts dso = so;
        dso.chunk = 40;
        if (ok && d == KVT_DRAFT_MODEL) ok = kvt_draft_model_new(&dm[i], m, draft_m, &dso, NULL) == KVT_OK;
        if (ok && d == KVT_DRAFT_MTP) ok = kvt_draft_mtp_new(&mt[i], s[i]) == KVT_OK;
        g[i].dm = dm[i];
        g[i].mtp = mt[i];
    }
    if (ok && k == 1) {
        o[0].body = kvt_generate_run(&g[0], &o[0].u, &out);
    } else if (ok) {
        for (size_t i = 0; i < k && ok; i++) ok = (R[i] = kvt_gen_start(&g[i], &o[i].u, &out)) != NULL, live[i] = ok;
        for (size_t left = k; ok && left;) {
            kvt_step stp[BATCH];
            size_t who[BATCH], j = 0;
            for (size_t i = 0; i < k; i++) {
                kvt_gen_pass ps;
                if (!live[i]) continue;
                if (!kvt_gen_next_pass(R[i], &ps)) {
                    o[i].body = kvt_gen_finish(R[i]);
                    R[i] = NULL;
                    live[i] = false;
                    left--;
                    continue;
                }
                stp[j] = (kvt_step){s[i], ps.tok, ps.n, false, 0, ps.rows, ps.save};
                who[j++] = i;
            }
            if (!j) break;
            size_t budget = 0;
            for (size_t i = 0; i < j; i++) budget += stp[i].n;
            int rc = kvt_session_step(stp, j, budget);
            for (size_t i = 0; i < j; i++)
                if (!kvt_gen_took_pass(R[who[i]], rc, stp[i].done)) {
                    o[who[i]].body = kvt_gen_finish(R[who[i]]);
                    R[who[i]] = NULL;
                    live[who[i]] = false;
                    left--;
                }
        }
    }
    for (size_t i = 0; i < k; i++) {
        if (R[i]) o[i].body = kvt_gen_finish(R[i]);
        if (s[i] && ok) {
            o[i].digest = kvt_test_digest(s[i], m);
            o[i].n = kvt_session_len(s[i]);
            o[i].toks = malloc(o[i].n * sizeof(int32_t) + 1);
            if (o[i].toks) memcpy(o[i].toks, kvt_session_tokens(s[i]), o[i].n * sizeof(int32_t));
            if (o[i].toks && dm[i])
                o[i].draft_exact = !kvt_draft_model_failed(dm[i]) && draft_session_exact(dm[i], o[i].toks, o[i].n, &so);
            if (o[i].toks && mt[i])
                o[i].draft_exact = !kvt_draft_mtp_failed(mt[i]) && mtp_exact(mt[i], m, o[i].toks, o[i].n, &so);
        }
        kvt_draft_model_free(dm[i]);
        kvt_draft_mtp_free(mt[i]);
        ok = ok && o[i].body && o[i].toks;
        kvt_session_free(s[i]);
    }
    return ok;
}

static bool same(const outcome *a, const outcome *b)
{
    return a->body && b->body && !strcmp(a->body, b->body) && a->digest == b->digest && a->n == b->n &&
           !memcmp(a->toks, b->toks, a->n * sizeof(int32_t)) && a->u.completion_tokens == b->u.completion_tokens;
}

/* BOS, then a block of `blk` tokens from seed repeated to n tokens. */
static void repeating_prompt(int32_t *t, size_t n, size_t blk, uint64_t seed, int32_t lo, int32_t span)
{
    t[0] = 1;
    int32_t b[64];
    for (size_t i = 0; i < blk; i++) b[i] = lo + (int32_t)(kvt_test_rand(&seed) % (uint64_t)span);
    for (size_t i = 1; i < n; i++) t[i] = b[(i - 1) % blk];
}

enum { PROMPT = 97 };

/* The plain runs' tokens (prompt and reply) of the prompts in a test: a
 * drafter that knows them drafts the reply, every third pass with its
 * second draft wrong, so drafts are accepted and rejected on any model. */
static const int32_t *known[BATCH];
static size_t n_known[BATCH];

static size_t knowing(const int32_t *ctx, size_t n, int32_t last, size_t max, int32_t *out)
{
    for (size_t b = 0; b < BATCH; b++) {
        if (!known[b] || n_known[b] <= n || memcmp(known[b], ctx, PROMPT * sizeof *ctx) || known[b][n] != last) continue;
        size_t got = 0;
        for (size_t i = n + 1; i < n_known[b] && got < max; i++) out[got++] = known[b][i];
        if (n % 3 == 0 && got > 1) out[1] ^= 1;
        return got;
    }
    return 0;
}

/* Every setting, alone and batched: speculation changes nothing; with the
 * fault it does. bos: the tokenizer's BOS id; the prompts' other tokens
 * are blocks of ids in [lo, lo + span) repeated; ngram_hits: the model
 * repeats them enough that n-gram drafts must be accepted (a synthetic
 * model may never say what its prompt holds: the knowing drafter still
 * exercises acceptance there). */
static void speculation_exact(kvt_model *m, const char *what, int32_t bos, int32_t lo, int32_t span, bool ngram_hits)
{
    int32_t pa[PROMPT], pb[PROMPT];
    repeating_prompt(pa, PROMPT, 24, 11, lo, span);
    repeating_prompt(pb, PROMPT, 17, 12, lo, span);
    pa[0] = pb[0] = bos;
    int32_t *ps[BATCH] = {pa, pb};
    uint32_t accepted[2] = {0}, drafted[2] = {0}, rejected[2] = {0};
    for (size_t si = 0; si < sizeof settings / sizeof *settings; si++) {
        const setting *st = &settings[si];
        for (size_t k = 1; k <= BATCH; k++) {
            outcome plain[BATCH];
            CHECKF(replies(m, ps, PROMPT, k, st, KVT_DRAFT_NONE, plain), "%s %s: a reply failed: %s", what, st->what,
                   kvt_errmsg());
            for (size_t i = 0; i < BATCH; i++) {
                known[i] = i < k ? plain[i].toks : NULL;
                n_known[i] = i < k ? plain[i].n : 0;
            }
            /* the n-gram drafter, then one that knows the reply; the
             * control (a rollback that keeps one token too many) with the
             * knowing one, whose drafts are rejected by design: the same
             * comparison and the same rollback as the n-gram drafter's,
             * which a control of its own would repeat (a fifth of the
             * test's time) */
            for (int oracle = 0; oracle < 2; oracle++) {
                outcome spec[BATCH], bad[BATCH] = {0};
                kvt_gen_test_drafter = oracle ? knowing : NULL;
                bool ran = replies(m, ps, PROMPT, k, st, KVT_DRAFT_NGRAM, spec);
                kvt_session_fault = KVT_SESSION_FAULT_KEEP_ONE_MORE;
                ran = ran && (!oracle || replies(m, ps, PROMPT, k, st, KVT_DRAFT_NGRAM, bad));
                kvt_session_fault = KVT_SESSION_FAULT_NONE;
                kvt_gen_test_drafter = NULL;
                CHECKF(ran, "%s %s: a reply failed: %s", what, st->what, kvt_errmsg());
                for (size_t i = 0; i < k; i++) {
                    bool eq = same(&plain[i], &spec[i]), eq_bad = oracle && same(&plain[i], &bad[i]);
                    printf("    %s %s %s %s reply %zu: %u tokens in %u passes (plain %u), %u drafted, %u accepted: "
                           "%s%s%s\n",
                           what, st->what, k > 1 ? "batched" : "alone", oracle ? "knowing" : "ngram", i,
                           spec[i].u.completion_tokens, spec[i].u.passes, plain[i].u.passes, spec[i].u.drafted,
                           spec[i].u.accepted, eq ? "same" : "DIFFERENT", oracle ? "; control " : "",
                           oracle ? (eq_bad ? "same" : "differs") : "");
                    CHECKF(eq, "%s %s: speculation changed the reply or the session", what, st->what);
                    /* the control bites where a draft was rejected */
                    if (spec[i].u.accepted < spec[i].u.drafted) {
                        rejected[oracle]++;
                        CHECKF(!oracle || !eq_bad, "%s %s: the off-by-one rollback went unseen", what, st->what);
                    }
                    accepted[oracle] += spec[i].u.accepted;
                    drafted[oracle] += spec[i].u.drafted;
                    outcome_free(&spec[i]);
                    outcome_free(&bad[i]);
                }
            }
            for (size_t i = 0; i < k; i++) {
                CHECKF(plain[i].u.drafted == 0 && plain[i].u.passes >= plain[i].u.completion_tokens,
                       "plain decoding: %u passes for %u tokens", plain[i].u.passes, plain[i].u.completion_tokens);
                outcome_free(&plain[i]);
                known[i] = NULL;
            }
        }
    }
    printf("    %s: n-gram drafts %u of %u accepted; knowing drafts %u of %u\n", what, accepted[0], drafted[0],
           accepted[1], drafted[1]);
    CHECKF(accepted[1] > 0 && rejected[1] > 0, "%s: %u of %u known drafts accepted, %u replies with a rejection: "
           "both must be exercised", what, accepted[1], drafted[1], rejected[1]);
    CHECKF(!ngram_hits || accepted[0] > 0, "%s: no n-gram draft accepted on a repeating prompt", what);
    /* a reply that ends at the context: drafts stop short of it */
    outcome plain, spec;
    kvt_gen_test_drafter = NULL;
    ctx_room = 21;
    bool ran = replies(m, ps, PROMPT, 1, &settings[0], KVT_DRAFT_NONE, &plain);
    kvt_gen_test_drafter = knowing;
    for (size_t i = 0; ran && i < BATCH; i++) {
        known[i] = i ? NULL : plain.toks;
        n_known[i] = i ? 0 : plain.n;
    }
    ran = ran && replies(m, ps, PROMPT, 1, &settings[0], KVT_DRAFT_NGRAM, &spec);
    kvt_gen_test_drafter = NULL;
    ctx_room = 0;
    known[0] = NULL;
    bool eq = ran && same(&plain, &spec);
    printf("    %s at the context's end: %u tokens, %u passes (plain %u), %u drafted, %u accepted: %s\n", what,
           spec.u.completion_tokens, spec.u.passes, plain.u.passes, spec.u.drafted, spec.u.accepted,
           eq ? "same" : "DIFFERENT");
    bool short_reply = ran && plain.n == PROMPT + 21;
    outcome_free(&plain);
    outcome_free(&spec);
    CHECKF(ran && eq, "%s: a reply that ends at the context differs with drafts", what);
    CHECKF(short_reply, "%s: the reply did not run to the context's end", what);
}

/* The draft model dmodel drafting for m, every setting, alone and
 * batched: the replies, log-probabilities and sessions are plain
 * decoding's, and the draft session ends equal to a fresh session of the
 * draft model synced to the reply's tokens. Controls: a draft session
 * rolled back to the state one token late (KVT_DRAFT_FAULT_SAVE_LATE)
 * ends unequal in some reply; accepting a pass's first draft though it
 * was rejected (KVT_DRAFT_FAULT_ACCEPT_FIRST) changes every reply whose
 * first draft plain decoding would not have made. state_bites: the draft
 * model has state a rollback restores (not the llama family's full rows,
 * which are only truncated, where saving late is no fault). *acc_out: the
 * drafts accepted. */
static void speculation_model(kvt_model *m, kvt_model *dmodel, const char *what, int32_t bos, int32_t lo,
                              int32_t span, bool state_bites, uint32_t *acc_out)
{
    int32_t pa[PROMPT], pb[PROMPT];
    repeating_prompt(pa, PROMPT, 24, 11, lo, span);
    repeating_prompt(pb, PROMPT, 17, 12, lo, span);
    pa[0] = pb[0] = bos;
    int32_t *ps[BATCH] = {pa, pb};
    uint32_t accepted = 0, drafted = 0, late_seen = 0, rollbacks = 0;
    *acc_out = 0;
    draft_m = dmodel;
    CHECKF(kvt_draft_vocab_check(m, dmodel) == KVT_OK, "%s: %s", what, kvt_errmsg());
    for (size_t si = 0; si < sizeof settings / sizeof *settings; si++) {
        const setting *st = &settings[si];
        for (size_t k = 1; k <= BATCH; k++) {
            outcome plain[BATCH], spec[BATCH], late[BATCH], acc[BATCH];
            bool ran = replies(m, ps, PROMPT, k, st, KVT_DRAFT_NONE, plain);
            ran = ran && replies(m, ps, PROMPT, k, st, KVT_DRAFT_MODEL, spec);
            kvt_draft_fault = KVT_DRAFT_FAULT_SAVE_LATE;
            ran = ran && replies(m, ps, PROMPT, k, st, KVT_DRAFT_MODEL, late);
            kvt_draft_fault = KVT_DRAFT_FAULT_ACCEPT_FIRST;
            ran = ran && replies(m, ps, PROMPT, k, st, KVT_DRAFT_MODEL, acc);
            kvt_draft_fault = KVT_DRAFT_FAULT_NONE;
            CHECKF(ran, "%s %s: a reply failed: %s", what, st->what, kvt_errmsg());
            for (size_t i = 0; i < k; i++) {
                bool eq = same(&plain[i], &spec[i]), eq_acc = same(&plain[i], &acc[i]);
                printf("    %s %s %s reply %zu: %u tokens in %u passes (plain %u), %u drafted, %u accepted: %s, "
                       "draft session %s; controls: save late %s, accept first %s\n",
                       what, st->what, k > 1 ? "batched" : "alone", i, spec[i].u.completion_tokens, spec[i].u.passes,
                       plain[i].u.passes, spec[i].u.drafted, spec[i].u.accepted, eq ? "same" : "DIFFERENT",
                       spec[i].draft_exact ? "exact" : "NOT EXACT", late[i].draft_exact ? "unseen" : "seen",
                       eq_acc ? "unseen" : "seen");
                CHECKF(eq, "%s %s: --draft model changed the reply or the session", what, st->what);
                CHECKF(spec[i].draft_exact, "%s %s: the draft session is not the draft model's", what, st->what);
                CHECKF(spec[i].u.drafted > 0, "%s %s: nothing drafted", what, st->what);
                /* the first pass's drafts all rejected: the control keeps one */
                if (spec[i].u.accepted == 0)
                    CHECKF(!eq_acc, "%s %s: a rejected draft accepted went unseen", what, st->what);
                rollbacks += spec[i].u.accepted < spec[i].u.drafted;
                late_seen += !late[i].draft_exact;
                accepted += spec[i].u.accepted;
                drafted += spec[i].u.drafted;
                outcome_free(&plain[i]);
                outcome_free(&spec[i]);
                outcome_free(&late[i]);
                outcome_free(&acc[i]);
            }
        }
    }
    draft_m = NULL;
    *acc_out = accepted;
    printf("    %s: %u of %u drafts accepted; %u replies rolled the draft session back, the late save seen in %u\n",
           what, accepted, drafted, rollbacks, late_seen);
    CHECKF(rollbacks > 0, "%s: the draft session's rollback must be exercised", what);
    CHECKF(!state_bites || late_seen > 0, "%s: the draft session's state saved late went unseen", what);
}

/* Two models with the same vocabulary: ds4-tiny drafting for itself
 * (another copy of the same weights: the greedy drafts are all accepted)
 * and a narrower ds4-tiny (D=32) of other weights drafting for it. */
TEST(speculate_model_ds4)
{
    kvt_model *m = NULL, *same_w = NULL, *narrow = NULL;
    CHECK_OK(kvt_model_preset(&m, "ds4-tiny", 7, NULL));
    CHECK_OK(kvt_model_preset(&same_w, "ds4-tiny", 7, NULL));
    CHECK_OK(kvt_model_preset(&narrow, "ds4-tiny+D=32", 3, NULL));
    kvt_model_info in;
    kvt_model_info_get(m, &in);
    int32_t bos = in.bos >= 0 ? in.bos : 256;
    uint32_t acc = 0, acc_narrow = 0;
    speculation_model(m, same_w, "ds4-tiny by itself", bos, 32, 90, true, &acc);
    CHECKF(acc > 0, "ds4-tiny drafting for itself: no draft accepted");
    speculation_model(m, narrow, "ds4-tiny by ds4-tiny+D=32", bos, 32, 90, true, &acc_narrow);
    kvt_model_close(narrow);
    kvt_model_close(same_w);
    kvt_model_close(m);
}

/* A family's synthetic model drafting for another copy of itself (the
 * file opened twice): greedy drafts accepted, sampled ones partly, the
 * draft session rolled back through the family's own state. */
static void family_drafts_itself(const fam_spec *f, bool state_bites)
{
    char dir[] = "/tmp/kvt-spec-XXXXXX", path[256], what[64];
    kvt_model *m = fam_open(f, dir, path, sizeof path), *d = NULL;
    if (!m) return;
    snprintf(what, sizeof what, "%s by itself", f->arch);
    uint32_t acc = 0;
    if (kvt_model_open(&d, path) == KVT_OK) speculation_model(m, d, what, 1, 3, 2000, state_bites, &acc);
    else kvt_test_fail(__FILE__, __LINE__, "loading %s again: %s", path, kvt_errmsg());
    kvt_model_close(d);
    fam_close(m, dir, path);
    CHECKF(acc > 0, "%s: no draft accepted", what);
}

/* --draft auto on each kind of model: how many models got another kind
 * than due (each named when report). */
static int auto_wrong(bool report)
{
    static const struct { fam_spec f; kvt_draft_kind want; } cases[] = {
        {{"llama", false, false, FAM_HEAD_DIM, false, false, false}, KVT_DRAFT_NGRAM},
        {{"qwen3", false, true, FAM_HEAD_DIM, false, false, false}, KVT_DRAFT_NGRAM},
        {{"qwen3moe", false, true, FAM_HEAD_DIM, false, true, false}, KVT_DRAFT_NONE},
        {{"gemma3", false, true, FAM_HEAD_DIM, false, false, true}, KVT_DRAFT_NONE},
        {{"qwen35", .qwen35 = FAM_Q35_DENSE}, KVT_DRAFT_NONE},
    };
    int wrong = 0;
    for (size_t i = 0; i <= sizeof cases / sizeof *cases; i++) {
        char dir[] = "/tmp/kvt-spec-XXXXXX", path[256];
        bool ds4 = i == sizeof cases / sizeof *cases;
        kvt_model *m = NULL;
        if (ds4 && kvt_model_preset(&m, "ds4-tiny", 7, NULL)) m = NULL;
        else if (!ds4) m = fam_open(&cases[i].f, dir, path, sizeof path);
        if (!m) {
            kvt_test_fail(__FILE__, __LINE__, "opening case %zu: %s", i, kvt_errmsg());
            return wrong + 1;
        }
        const char *why = NULL;
        kvt_draft_kind k = kvt_draft_auto(m, &why), want = ds4 ? KVT_DRAFT_NONE : cases[i].want;
        if (report) printf("    %s: --draft auto is %s%s%s\n", ds4 ? "ds4-tiny" : cases[i].f.arch, kvt_draft_name(k),
                           why ? ": " : "", why ? why : "");
        if (k != want || (k == KVT_DRAFT_NONE) != (why != NULL)) {
            wrong++;
            if (report)
                kvt_test_fail(__FILE__, __LINE__, "%s: --draft auto is %s, not %s", ds4 ? "ds4-tiny" : cases[i].f.arch,
                              kvt_draft_name(k), kvt_draft_name(want));
        }
        if (ds4) kvt_model_close(m);
        else fam_close(m, dir, path);
    }
    return wrong;
}

TEST(speculate_auto)
{
    CHECKF(kvt_draft_parse("auto", &(kvt_draft_kind){0}) == KVT_OK, "--draft auto does not parse");
    CHECK(auto_wrong(true) == 0);
    kvt_draft_fault = KVT_DRAFT_FAULT_AUTO_NGRAM;
    int w = auto_wrong(false);
    kvt_draft_fault = KVT_DRAFT_FAULT_NONE;
    printf("    with KVT_DRAFT_FAULT_AUTO_NGRAM: %d models drafted where none is due\n", w);
    CHECKF(w == 4, "KVT_DRAFT_FAULT_AUTO_NGRAM (ngram for every model) went unseen: %d of 4 models wrong", w);
}

TEST(speculate_model_llama)
{
    static const fam_spec f = {"llama", false, false, FAM_HEAD_DIM, false, false, false};
    family_drafts_itself(&f, false);
}

TEST(speculate_model_gemma3)
{
    static const fam_spec f = {"gemma3", false, true, FAM_HEAD_DIM, false, false, true};
    family_drafts_itself(&f, true);
}

TEST(speculate_model_qwen35)
{
    static const fam_spec f = {"qwen35", .qwen35 = FAM_Q35_DENSE};
    family_drafts_itself(&f, true);
}

/* The five runs of an MTP test on prompts ps (k of them, setting st):
 * plain decoding on m and on base (the model without the layer, or with
 * its rows off), --draft mtp on m, the same with the layer's guesses
 * replaced by the knowing drafter's (the layer still runs its chain each
 * pass: drafts accepted and rejected, its rows rolled back through both),
 * and that again with fault(true) in force (the test's negative control).
 * False when a run failed. */
static bool mtp_runs(kvt_model *m, kvt_model *base, int32_t *const *ps, size_t k, const setting *st,
                     void (*fault)(bool on), outcome *plain, outcome *trunk, outcome *spec, outcome *know,
                     outcome *bad)
{
    bool ran = replies(m, ps, PROMPT, k, st, KVT_DRAFT_NONE, plain);
    ran = ran && replies(base, ps, PROMPT, k, st, KVT_DRAFT_NONE, trunk);
    ran = ran && replies(m, ps, PROMPT, k, st, KVT_DRAFT_MTP, spec);
    for (size_t i = 0; ran && i < BATCH; i++) {
        known[i] = i < k ? plain[i].toks : NULL;
        n_known[i] = i < k ? plain[i].n : 0;
    }
    kvt_gen_test_drafter = knowing;
    ran = ran && replies(m, ps, PROMPT, k, st, KVT_DRAFT_MTP, know);
    fault(true);
    ran = ran && replies(m, ps, PROMPT, k, st, KVT_DRAFT_MTP, bad);
    fault(false);
    kvt_gen_test_drafter = NULL;
    for (size_t i = 0; i < BATCH; i++) known[i] = NULL;
    return ran;
}

/* ds4's control: the row of a pass's first chained guess kept as verified. */
static void ds4_keep_fault(bool on) { kvt_draft_fault = on ? KVT_DRAFT_FAULT_MTP_KEEP : KVT_DRAFT_FAULT_NONE; }
/* Qwen 3.5's: the layer's hidden input not restored with the state. */
static void pending_fault(bool on) { kvt_llama_fault = on ? KVT_LLAMA_FAULT_MTP_PENDING : KVT_LLAMA_FAULT_NONE; }

/* The MTP tests' two prompts (PROMPT tokens each, m's BOS first). */
static void mtp_prompts(const kvt_model *m, int32_t *pa, int32_t *pb)
{
    kvt_model_info in;
    kvt_model_info_get(m, &in);
    repeating_prompt(pa, PROMPT, 24, 11, 32, 90);
    repeating_prompt(pb, PROMPT, 17, 12, 32, 90);
    pa[0] = pb[0] = in.bos >= 0 ? in.bos : 256;
}

/* --draft mtp: ds4-tiny with an MTP layer (ds4-tiny+mtp=1: the model's
 * weights are ds4-tiny's, the layer's come after them), greedy and
 * sampled, alone and batched: the response, the session's tokens and
 * digest equal plain decoding's, which equal ds4-tiny's without the layer,
 * and the layer's window, brought to the reply's tokens, is the one a
 * drafter on a session synced to them in one pass holds. Control:
 * KVT_DRAFT_FAULT_MTP_KEEP (a pass's first chained row kept as verified:
 * an off-by-one rollback of the window) leaves some window unequal. And
 * ds4-tiny without the layer is refused. */
TEST(speculate_mtp_ds4)
{
    kvt_model *m = NULL, *base = NULL;
    CHECK_OK(kvt_model_preset(&m, "ds4-tiny+mtp=1", 7, NULL));
    CHECK_OK(kvt_model_preset(&base, "ds4-tiny", 7, NULL));
    CHECK_OK(kvt_draft_mtp_check(m, "ds4-tiny+mtp=1"));
    CHECK(kvt_draft_mtp_check(base, "ds4-tiny") == KVT_EUNSUPPORTED && strstr(kvt_errmsg(), "no MTP"));
    int32_t pa[PROMPT], pb[PROMPT];
    mtp_prompts(m, pa, pb);
    int32_t *ps[BATCH] = {pa, pb};
    uint32_t accepted = 0, drafted = 0, rolled = 0, kept_seen = 0;
    for (size_t si = 0; si < sizeof settings / sizeof *settings; si++) {
        const setting *st = &settings[si];
        for (size_t k = 1; k <= BATCH; k++) {
            outcome plain[BATCH], trunk[BATCH], spec[BATCH], know[BATCH], bad[BATCH];
            bool ran = mtp_runs(m, base, ps, k, st, ds4_keep_fault, plain, trunk, spec, know, bad);
            CHECKF(ran, "mtp %s: a reply failed: %s", st->what, kvt_errmsg());
            for (size_t i = 0; i < k; i++) {
                bool eq = same(&plain[i], &spec[i]), eq_know = same(&plain[i], &know[i]),
                     eq_bad = same(&plain[i], &bad[i]);
                printf("    mtp %s %s reply %zu with the knowing drafter: %u passes, %u drafted, %u accepted: %s, "
                       "window %s\n", st->what, k > 1 ? "batched" : "alone", i, know[i].u.passes, know[i].u.drafted,
                       know[i].u.accepted, eq_know ? "same" : "DIFFERENT", know[i].draft_exact ? "exact" : "NOT EXACT");
                CHECKF(eq_know && know[i].draft_exact, "mtp %s: with accepted drafts, the reply or the window differs",
                       st->what);
                CHECKF(know[i].u.accepted > 0, "mtp %s: no draft accepted with the knowing drafter", st->what);
                bool eq_trunk = plain[i].body && trunk[i].body && !strcmp(plain[i].body, trunk[i].body);
                printf("    mtp %s %s reply %zu: %u tokens in %u passes (plain %u), %u drafted, %u accepted: %s, "
                       "window %s; without the layer %s; control: reply %s, window %s\n",
                       st->what, k > 1 ? "batched" : "alone", i, spec[i].u.completion_tokens, spec[i].u.passes,
                       plain[i].u.passes, spec[i].u.drafted, spec[i].u.accepted, eq ? "same" : "DIFFERENT",
                       spec[i].draft_exact ? "exact" : "NOT EXACT", eq_trunk ? "same" : "DIFFERENT",
                       eq_bad ? "same" : "differs", bad[i].draft_exact ? "exact" : "unequal");
                CHECKF(eq, "mtp %s: --draft mtp changed the reply or the session", st->what);
                CHECKF(eq_trunk, "mtp %s: the MTP layer changed plain decoding", st->what);
                CHECKF(spec[i].draft_exact, "mtp %s: the MTP window is not the verified tokens'", st->what);
                CHECKF(spec[i].u.drafted > 0, "mtp %s: nothing drafted", st->what);
                CHECKF(eq_bad, "mtp %s: the window's fault changed the reply (it may change drafts only)", st->what);
                kept_seen += !bad[i].draft_exact;
                rolled += spec[i].u.accepted < spec[i].u.drafted && know[i].u.accepted < know[i].u.drafted;
                accepted += spec[i].u.accepted;
                drafted += spec[i].u.drafted;
                outcome_free(&plain[i]);
                outcome_free(&trunk[i]);
                outcome_free(&spec[i]);
                outcome_free(&know[i]);
                outcome_free(&bad[i]);
            }
        }
    }
    printf("    mtp: %u of %u drafts accepted; %u replies rolled back; the kept draft row seen in %u\n", accepted,
           drafted, rolled, kept_seen);
    CHECKF(rolled > 0, "mtp: the rollback must be exercised");
    CHECKF(kept_seen > 0, "mtp: the off-by-one rollback of the window went unseen");
    kvt_model_close(base);
    kvt_model_close(m);
}

/* --draft mtp, two requests whose verify passes share ds4's batched pass
 * (kvt_arch.forward_batch; the pass leaves each session's hidden states in
 * its own scratch for its drafter): greedy and sampled, each reply
 * (response with its logprobs, tokens, cache digest) and its drafter's
 * passes, drafts and acceptances equal the request's run alone, and its
 * layer's window is the verified tokens'. Control: the second request's
 * segment rotated as if it went on from the first's
 * (KVT_DS4_FAULT_BATCH_POS) changes its reply. */
TEST(speculate_mtp_ds4_batched)
{
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_preset(&m, "ds4-tiny+mtp=1", 7, NULL));
    kvt_test_defer_model(m);
    int32_t pa[PROMPT], pb[PROMPT];
    mtp_prompts(m, pa, pb);
    int32_t *ps[BATCH] = {pa, pb}, *second[1] = {pb};
    for (size_t si = 0; si < sizeof settings / sizeof *settings; si++) {
        const setting *st = &settings[si];
        outcome alone[BATCH], both[BATCH], bad[BATCH];
        bool ran = replies(m, ps, PROMPT, 1, st, KVT_DRAFT_MTP, &alone[0]) &&
                   replies(m, second, PROMPT, 1, st, KVT_DRAFT_MTP, &alone[1]);
        size_t before = kvt_ds4_batch_passes;
        ran = ran && replies(m, ps, PROMPT, BATCH, st, KVT_DRAFT_MTP, both);
        size_t passes = kvt_ds4_batch_passes - before;
        kvt_ds4_fault = KVT_DS4_FAULT_BATCH_POS;
        ran = ran && replies(m, ps, PROMPT, BATCH, st, KVT_DRAFT_MTP, bad);
        kvt_ds4_fault = KVT_DS4_FAULT_NONE;
        CHECKF(ran, "mtp %s: a reply failed: %s", st->what, kvt_errmsg());
        CHECKF(passes > 0, "mtp %s: the two requests never shared a batched pass", st->what);
        for (size_t i = 0; i < BATCH; i++) {
            bool eq = same(&alone[i], &both[i]) && alone[i].u.passes == both[i].u.passes &&
                      alone[i].u.drafted == both[i].u.drafted && alone[i].u.accepted == both[i].u.accepted;
            printf("    mtp %s reply %zu, %zu batched passes: %u passes, %u drafted, %u accepted (alone %u, %u, %u): "
                   "%s, window %s; control %s\n", st->what, i, passes, both[i].u.passes, both[i].u.drafted,
                   both[i].u.accepted, alone[i].u.passes, alone[i].u.drafted, alone[i].u.accepted,
                   eq ? "same" : "DIFFERENT", both[i].draft_exact ? "exact" : "NOT EXACT",
                   same(&alone[i], &bad[i]) ? "same" : "differs");
            CHECKF(eq, "mtp %s: reply %zu batched differs from alone", st->what, i);
            CHECKF(both[i].draft_exact, "mtp %s: reply %zu's MTP window is not the verified tokens'", st->what, i);
        }
        CHECKF(same(&alone[0], &bad[0]), "mtp %s: the fault changed the first segment", st->what);
        CHECKF(!same(&alone[1], &bad[1]), "mtp %s: the second segment's wrong positions went unnoticed", st->what);
        for (size_t i = 0; i < BATCH; i++) {
            outcome_free(&alone[i]);
            outcome_free(&both[i]);
            outcome_free(&bad[i]);
        }
    }
}

/* A greedy reply of m continued from a snapshot: the session synced to
 * toks[0..k) (a plain reply's prompt and its first tokens), snapshotted,
 * restored into a new session, and the reply's rest generated there with
 * --draft mtp (the drafter on the restored session, the layer's hidden
 * input from its state): o receives that session's tokens and digest. */
static bool mtp_restored(kvt_model *m, const int32_t *toks, size_t k, outcome *o)
{
    kvt_session_opts so = {.n_ctx = (uint32_t)(PROMPT + MAX_NEW + 8), .n_threads = 1};
    kvt_session *a = NULL, *b = NULL;
    kvt_draft_mtp *mt = NULL;
    uint8_t *snap = NULL;
    size_t len = 0;
    memset(o, 0, sizeof *o);
    kvt_request r = request(&settings[0], (uint32_t)(MAX_NEW - (k - PROMPT)));
    bool ok = !kvt_session_new(&a, m, &so) && !kvt_session_sync(a, toks, k, NULL) &&
              !kvt_session_snapshot(a, &snap, &len) && !kvt_session_new(&b, m, &so) &&
              !kvt_session_restore(b, snap, len) && !kvt_draft_mtp_new(&mt, b);
    if (ok) {
        kvt_gen g = {.m = m, .s = b, .r = &r, .id = "cmpl-1", .model_name = "m", .max_new = r.max_tokens,
                     .n_ctx = so.n_ctx, .seed = 1, .draft = KVT_DRAFT_MTP, .draft_max = 6, .mtp = mt};
        kvt_gen_out out = {0};
        o->body = kvt_generate_run(&g, &o->u, &out);
        o->n = kvt_session_len(b);
        o->digest = kvt_test_digest(b, m);
        o->toks = malloc(o->n * sizeof(int32_t) + 1);
        if (o->toks) memcpy(o->toks, kvt_session_tokens(b), o->n * sizeof(int32_t));
        ok = o->body && o->toks;
    }
    kvt_draft_mtp_free(mt);
    kvt_session_free(a);
    kvt_session_free(b);
    free(snap);
    return ok;
}

/* --draft mtp on Qwen 3.5 (synth_family.h with its MTP layer; the rows kept
 * by the session, kvt_model_set_mtp_rows): qwen35 and qwen35moe, greedy and
 * sampled, alone and batched, with the layer's guesses and with the
 * knowing drafter's (drafts accepted and rejected, the session rolled
 * back): the response with its logprobs, the tokens and the cache digest
 * (the layer's rows and the h_nextn in the state included) equal plain
 * decoding's with the rows kept, whose response equals the model's without
 * them. A greedy reply snapshotted 20 tokens in, restored and continued
 * with --draft mtp ends with the same tokens and digest. Control:
 * KVT_LLAMA_FAULT_MTP_PENDING (the h_nextn not restored with the state
 * before the rollback's replay) changes the digest of a rolled-back reply,
 * and the test says so. */
TEST(speculate_mtp_qwen35)
{
    static const fam_spec fs[2] = {{"qwen35", .qwen35 = FAM_Q35_DENSE, .mtp = true},
                                   {"qwen35moe", .qwen35 = FAM_Q35_MOE, .mtp = true}};
    for (int fi = 0; fi < 2; fi++) {
        char dir[] = "/tmp/kvt-spec-XXXXXX", path[256];
        kvt_model *off = fam_open(&fs[fi], dir, path, sizeof path), *m = NULL;
        if (!off) return;
        if (kvt_model_open(&m, path) || kvt_model_set_mtp_rows(m, true)) {
            CHECKF(0, "%s: %s", fs[fi].arch, kvt_errmsg());
            kvt_model_close(m);
            fam_close(off, dir, path);
            return;
        }
        CHECK(kvt_draft_mtp_prepare(off) == KVT_OK); /* no session yet: it turns the rows on */
        CHECK(kvt_model_mtp_rows(off) && kvt_model_set_mtp_rows(off, false) == KVT_OK);
        int32_t pa[PROMPT], pb[PROMPT];
        mtp_prompts(m, pa, pb);
        int32_t *ps[BATCH] = {pa, pb};
        uint32_t accepted = 0, drafted = 0, rolled = 0, seen = 0;
        for (size_t si = 0; si < sizeof settings / sizeof *settings; si++) {
            const setting *st = &settings[si];
            for (size_t k = 1; k <= BATCH; k++) {
                outcome plain[BATCH], trunk[BATCH], spec[BATCH], know[BATCH], bad[BATCH];
                bool ran = mtp_runs(m, off, ps, k, st, pending_fault, plain, trunk, spec, know, bad);
                CHECKF(ran, "%s mtp %s: a reply failed: %s", fs[fi].arch, st->what, kvt_errmsg());
                for (size_t i = 0; ran && i < k; i++) {
                    bool eq = same(&plain[i], &spec[i]), eq_know = same(&plain[i], &know[i]),
                         eq_trunk = plain[i].body && trunk[i].body && !strcmp(plain[i].body, trunk[i].body),
                         eq_bad = same(&plain[i], &bad[i]);
                    printf("    %s mtp %s %s reply %zu: %u tokens in %u passes (plain %u), %u drafted, %u accepted: "
                           "%s; knowing drafter %u of %u accepted: %s; without the rows %s; control %s\n",
                           fs[fi].arch, st->what, k > 1 ? "batched" : "alone", i, spec[i].u.completion_tokens,
                           spec[i].u.passes, plain[i].u.passes, spec[i].u.drafted, spec[i].u.accepted,
                           eq ? "same" : "DIFFERENT", know[i].u.accepted, know[i].u.drafted,
                           eq_know ? "same" : "DIFFERENT", eq_trunk ? "same" : "DIFFERENT",
                           eq_bad ? "same" : "differs");
                    CHECKF(eq, "%s mtp %s: --draft mtp changed the reply or the session", fs[fi].arch, st->what);
                    CHECKF(eq_know, "%s mtp %s: with drafts accepted and rejected the reply or the session differs",
                           fs[fi].arch, st->what);
                    CHECKF(eq_trunk, "%s mtp %s: the kept rows changed plain decoding", fs[fi].arch, st->what);
                    CHECKF(spec[i].u.drafted > 0, "%s mtp %s: nothing drafted", fs[fi].arch, st->what);
                    CHECKF(know[i].u.accepted > 0 && know[i].u.accepted < know[i].u.drafted,
                           "%s mtp %s: the knowing drafter's drafts were not both kept and rolled back", fs[fi].arch,
                           st->what);
                    seen += !eq_bad;
                    rolled += know[i].u.accepted < know[i].u.drafted;
                    accepted += spec[i].u.accepted;
                    drafted += spec[i].u.drafted;
                }
                for (size_t i = 0; i < k; i++) {
                    outcome_free(&plain[i]);
                    outcome_free(&trunk[i]);
                    outcome_free(&spec[i]);
                    outcome_free(&know[i]);
                    outcome_free(&bad[i]);
                }
            }
        }
        /* snapshot mid-reply, restored, continued with --draft mtp */
        outcome plain[1], cont;
        int32_t *one[1] = {pa};
        bool ran = replies(m, one, PROMPT, 1, &settings[0], KVT_DRAFT_NONE, plain) &&
                   mtp_restored(m, plain[0].toks, PROMPT + 20, &cont);
        bool eq = ran && cont.n == plain[0].n && cont.digest == plain[0].digest &&
                  !memcmp(cont.toks, plain[0].toks, cont.n * sizeof(int32_t));
        printf("    %s: restored 20 tokens into the reply and continued with --draft mtp: %u drafted, %u accepted: "
               "%s\n", fs[fi].arch, cont.u.drafted, cont.u.accepted, eq ? "same" : "DIFFERENT");
        CHECKF(eq, "%s: the reply continued from a snapshot differs: %s", fs[fi].arch, ran ? "" : kvt_errmsg());
        CHECKF(!ran || cont.u.drafted > 0, "%s: nothing drafted after the restore", fs[fi].arch);
        outcome_free(&plain[0]);
        outcome_free(&cont);
        printf("    %s mtp: %u of %u drafts accepted; %u replies rolled back; the h_nextn fault seen in %u\n",
               fs[fi].arch, accepted, drafted, rolled, seen);
        CHECKF(rolled > 0, "%s mtp: the rollback must be exercised", fs[fi].arch);
        CHECKF(seen > 0, "%s mtp: the h_nextn left out of the rollback went unseen", fs[fi].arch);
        kvt_model_close(m);
        fam_close(off, dir, path);
    }
}

/* The MTP layer of m on toks (n tokens, n <= a pass): on a session synced
 * to them, the layer's step for the last token from the model's hidden
 * state of the one before it, then a second step chained on the first's
 * output and best guess (a draft's second guess): both steps' logits and
 * output streams, and the ring of rows they wrote, into out (NULL: the
 * step failed). */
static float *mtp_layer_out(kvt_model *m, const int32_t *toks, size_t n, size_t *len)
{
    const kvt_mtp_ops *o = m->arch->mtp;
    size_t V = m->info.n_vocab, hf = o->hidden_floats(m), rb = o->ring_bytes(m);
    *len = 2 * (V + hf) * sizeof(float) + rb;
    float *out = calloc(1, *len), *h = malloc(hf * sizeof *h);
    kvt_session *s = NULL;
    kvt_session_opts so = {.n_ctx = (uint32_t)n + 8, .n_threads = 1};
    bool ok = out && h && kvt_session_new(&s, m, &so) == KVT_OK && kvt_session_sync(s, toks, n, NULL) == KVT_OK &&
              o->hidden(s, n - 2, h) == KVT_OK;
    uint16_t *ring = (uint16_t *)(void *)(out + 2 * (V + hf));
    ok = ok && o->step(s, ring, h, toks[n - 1], n - 1, false, out + V, out) == KVT_OK;
    int32_t best = 0;
    for (size_t v = 1; ok && v < V; v++) best = out[v] > out[best] ? (int32_t)v : best;
    ok = ok && o->step(s, ring, out + V, best, n, false, out + 2 * V + hf, out + V + hf) == KVT_OK;
    kvt_session_free(s);
    free(h);
    if (!ok) free(out);
    return ok ? out : NULL;
}

/* An attach of path to a fresh ds4-tiny refused with rc, its message
 * holding says, the model left without a layer. */
static bool attach_refused(const char *path, int rc_want, const char *says, const char *what)
{
    kvt_model *b = NULL;
    if (kvt_model_preset(&b, "ds4-tiny", 7, NULL)) return false;
    int rc = kvt_draft_mtp_attach(b, path);
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kvt_errmsg());
    bool ok = rc == rc_want && strstr(msg, says) && kvt_draft_mtp_check(b, "ds4-tiny") == KVT_EUNSUPPORTED;
    printf("    %s: %s (%d): %s\n", what, ok ? "refused" : "NOT AS WANTED", rc, msg);
    kvt_model_close(b);
    return ok;
}

/* --draft mtp --model-draft FILE: ds4-tiny+mtp=1's layer written as ds4.c's
 * separate file (mtp.0.*, eh_proj as e_proj and h_proj) and attached to
 * ds4-tiny (the same weights without the layer): the layer's logits,
 * output streams and rows of two chained steps equal the in-file layer's
 * bit for bit, and replies (greedy and sampled, alone and batched) give
 * the same response, tokens, digest, drafted and accepted counts, equal to
 * plain decoding's. Control: KVT_DS4_FAULT_MTP_BIND (e_proj and h_proj
 * bound to each other's place) makes the layer's outputs differ. Refused
 * cleanly, naming the problem, the model left as it was: a layer of
 * another shape (Fe), a truncated file, a foreign architecture, a model
 * that has its own layer; after a refusal a right file still attaches. */
TEST(speculate_mtp_file_ds4)
{
    kvt_model *m = NULL, *sep = NULL, *bad = NULL, *other = NULL;
    char dir[] = "/tmp/kvt-spec-mtp-XXXXXX", file[128], path[128];
    CHECK(kvt_test_mkdtemp(dir) != NULL);
    snprintf(file, sizeof file, "%s/mtp.gguf", dir);
    CHECK_OK(kvt_model_preset(&m, "ds4-tiny+mtp=1", 7, NULL));
    CHECK_OK(kvt_draft_mtp_write(m, file));
    /* refusals first: each on a fresh ds4-tiny, which must stay without a layer */
    CHECK_OK(kvt_model_preset(&other, "ds4-tiny+mtp=1,Fe=64", 7, NULL));
    snprintf(path, sizeof path, "%s/fe64.gguf", dir);
    CHECK_OK(kvt_draft_mtp_write(other, path));
    kvt_model_close(other);
    CHECKF(attach_refused(path, KVT_EFORMAT, "mtp.0.ffn_gate_exps.weight has shape", "a layer of another shape"),
           "a layer of another shape: want a refusal naming the tensor");
    size_t len = 0;
    char *bytes = kvt_test_read_file(file, &len);
    CHECK(bytes && len > 4096);
    snprintf(path, sizeof path, "%s/trunc.gguf", dir);
    CHECK(fx_write_file(path, bytes, len / 2));
    CHECKF(attach_refused(path, KVT_EFORMAT, "run past the end", "a truncated file"),
           "a truncated file: want a refusal");
    char *arch = memmem(bytes, len, "deepseek4", 9); /* general.architecture's value, as long */
    CHECK(arch != NULL);
    memcpy(arch, "deepseek3", 9);
    snprintf(path, sizeof path, "%s/foreign.gguf", dir);
    CHECK(fx_write_file(path, bytes, len));
    free(bytes);
    CHECKF(attach_refused(path, KVT_EFORMAT, "not a deepseek4 file", "a foreign architecture"),
           "a foreign architecture: want a refusal");
    CHECK(kvt_draft_mtp_attach(m, file) == KVT_EINVAL && strstr(kvt_errmsg(), "its own MTP layer"));
    /* the file attached to ds4-tiny after a refusal of another shape */
    CHECK_OK(kvt_model_preset(&sep, "ds4-tiny", 7, NULL));
    snprintf(path, sizeof path, "%s/fe64.gguf", dir);
    CHECK(kvt_draft_mtp_attach(sep, path) == KVT_EFORMAT);
    CHECK_OK(kvt_draft_mtp_attach(sep, file));
    CHECK_OK(kvt_draft_mtp_check(sep, "ds4-tiny with ds4.c's file"));
    CHECK_OK(kvt_model_preset(&bad, "ds4-tiny", 7, NULL));
    kvt_ds4_fault = KVT_DS4_FAULT_MTP_BIND;
    int brc = kvt_draft_mtp_attach(bad, file);
    kvt_ds4_fault = KVT_DS4_FAULT_NONE;
    CHECK_OK(brc);
    /* the layer's outputs, bit for bit */
    int32_t pa[PROMPT], pb[PROMPT];
    mtp_prompts(m, pa, pb);
    size_t la = 0, lb = 0, lc = 0;
    float *a = mtp_layer_out(m, pa, 40, &la), *b = mtp_layer_out(sep, pa, 40, &lb), *c = mtp_layer_out(bad, pa, 40, &lc);
    CHECKF(a && b && c && la == lb && lb == lc, "the MTP layer's steps failed: %s", kvt_errmsg());
    bool eq = !memcmp(a, b, la), eq_bad = !memcmp(a, c, la);
    printf("    the layer's two chained steps (logits, streams, rows): from ds4.c's file %s; control (e_proj and "
           "h_proj swapped) %s\n", eq ? "the same bits" : "DIFFERENT", eq_bad ? "THE SAME" : "differs");
    free(a);
    free(b);
    free(c);
    CHECKF(eq, "the layer from ds4.c's file computes other bits than the same layer inside the model file");
    CHECKF(!eq_bad, "control: the swapped binding went unseen");
    /* the layer's own head norm (ds4.c's mtp.0.norm, llama.cpp's
     * shared_head_norm) is the one used: doubled in the file, the layer's
     * logits double exactly (a power of two scales every product and sum
     * exactly) while its streams and rows stay the same */
    size_t flen = 0;
    char *fb = kvt_test_read_file(file, &flen);
    kvt_gguf *g = NULL;
    CHECK(fb && kvt_gguf_open_mem(&g, fb, flen) == KVT_OK);
    const kvt_gguf_tensor *nt = kvt_gguf_find_tensor(g, "mtp.0.norm.weight");
    CHECK(nt && nt->type == KVT_GGML_F32 && nt->data);
    float *nw = (float *)(void *)(fb + ((const char *)nt->data - fb));
    for (size_t i = 0; i < nt->ne[0]; i++) nw[i] *= 2;
    kvt_gguf_close(g);
    snprintf(path, sizeof path, "%s/norm2.gguf", dir);
    CHECK(fx_write_file(path, fb, flen));
    free(fb);
    kvt_model *n2 = NULL;
    CHECK_OK(kvt_model_preset(&n2, "ds4-tiny", 7, NULL));
    CHECK_OK(kvt_draft_mtp_attach(n2, path));
    kvt_model_info in;
    kvt_model_info_get(m, &in);
    size_t V = in.n_vocab, hf = m->arch->mtp->hidden_floats(m), ln = 0;
    a = mtp_layer_out(m, pa, 40, &la);
    float *d2 = mtp_layer_out(n2, pa, 40, &ln);
    CHECK(a && d2 && ln == la);
    bool doubled = true, differs = false;
    for (size_t v = 0; v < V; v++) doubled &= d2[v] == 2 * a[v], differs |= d2[v] != a[v];
    bool streams = !memcmp(a + V, d2 + V, hf * sizeof(float));
    printf("    the file's head norm doubled: the first step's logits %s, its streams %s\n",
           doubled && differs ? "doubled exactly" : "NOT DOUBLED", streams ? "the same" : "DIFFERENT");
    free(a);
    free(d2);
    kvt_model_close(n2);
    CHECKF(doubled && differs && streams, "the layer's own head norm is not the one its logits use");
    /* the drafters in replies */
    int32_t *ps[BATCH] = {pa, pb};
    for (size_t si = 0; si < sizeof settings / sizeof *settings; si++) {
        const setting *st = &settings[si];
        for (size_t k = 1; k <= BATCH; k++) {
            outcome plain[BATCH], in_file[BATCH], from_ds4c[BATCH];
            bool ran = replies(sep, ps, PROMPT, k, st, KVT_DRAFT_NONE, plain);
            ran = ran && replies(m, ps, PROMPT, k, st, KVT_DRAFT_MTP, in_file);
            ran = ran && replies(sep, ps, PROMPT, k, st, KVT_DRAFT_MTP, from_ds4c);
            CHECKF(ran, "mtp file %s: a reply failed: %s", st->what, kvt_errmsg());
            for (size_t i = 0; i < k; i++) {
                bool same_counts = in_file[i].u.drafted == from_ds4c[i].u.drafted &&
                                   in_file[i].u.accepted == from_ds4c[i].u.accepted &&
                                   in_file[i].u.passes == from_ds4c[i].u.passes;
                bool eq_in = same(&in_file[i], &from_ds4c[i]), eq_plain = same(&plain[i], &from_ds4c[i]);
                printf("    mtp file %s %s reply %zu: %u drafted, %u accepted, %u passes (in the model file: %u, %u, "
                       "%u): %s, %s plain decoding, window %s\n", st->what, k > 1 ? "batched" : "alone", i,
                       from_ds4c[i].u.drafted, from_ds4c[i].u.accepted, from_ds4c[i].u.passes, in_file[i].u.drafted,
                       in_file[i].u.accepted, in_file[i].u.passes, eq_in ? "the same reply" : "DIFFERENT",
                       eq_plain ? "as" : "NOT AS", from_ds4c[i].draft_exact ? "exact" : "NOT EXACT");
                CHECKF(eq_in && same_counts, "mtp file %s: the reply or the counts differ from the in-file layer's",
                       st->what);
                CHECKF(eq_plain && from_ds4c[i].draft_exact, "mtp file %s: not plain decoding's reply", st->what);
                CHECKF(from_ds4c[i].u.drafted > 0, "mtp file %s: nothing drafted", st->what);
                outcome_free(&plain[i]);
                outcome_free(&in_file[i]);
                outcome_free(&from_ds4c[i]);
            }
        }
    }
    kvt_model_close(bad);
    kvt_model_close(sep);
    kvt_model_close(m);
}

/* Whether after counts the MTP file on top of before: mapped grown by its
 * declared tensor data (want, by type want_type, nt tensors), and that
 * much of it the MTP file's. */
static bool mtp_counted(const kvt_memory *before, const kvt_memory *after, uint64_t want, const uint64_t *want_type,
                        size_t nt)
{
    bool types = true;
    for (size_t t = 0; t < KVT_MEMORY_TYPES; t++) types &= after->mapped_type[t] == before->mapped_type[t] + want_type[t];
    return after->mapped == before->mapped + want && after->mapped_mtp == want && before->mapped_mtp == 0 && types &&
           after->n_tensors == before->n_tensors + nt;
}

/* The attached MTP file counts in the model's memory as the model's file
 * does (see the list at the top). */
TEST(speculate_mtp_file_memory)
{
    char dir[] = "/tmp/kvt-spec-mtpmem-XXXXXX", file[128], path[128];
    CHECK(kvt_test_mkdtemp(dir) != NULL);
    snprintf(file, sizeof file, "%s/mtp.gguf", dir);
    snprintf(path, sizeof path, "%s/tiny.gguf", dir);
    kvt_model *w = NULL, *m = NULL;
    CHECK_OK(kvt_model_preset(&w, "ds4-tiny+mtp=1", 7, NULL));
    CHECK_OK(kvt_draft_mtp_write(w, file));
    kvt_model_close(w);
    CHECK_OK(kvt_model_preset(&w, "ds4-tiny", 7, NULL));
    CHECK_OK(kvt_model_save(w, path));
    kvt_model_close(w);
    /* the tensor data the MTP file's header declares */
    kvt_gguf *g = NULL;
    CHECK_OK(kvt_gguf_open_header(&g, file));
    uint64_t want = 0, want_type[KVT_MEMORY_TYPES] = {0};
    size_t nt = kvt_gguf_n_tensors(g);
    for (size_t i = 0; i < nt; i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        want += t->n_bytes;
        if (t->type < KVT_MEMORY_TYPES) want_type[t->type] += t->n_bytes;
    }
    kvt_gguf_close(g);
    CHECK(want > 0 && nt > 0);
    /* the model opened from its file, before and after the attach */
    kvt_memory before, after, fault, hb, ha, hf;
    CHECK_OK(kvt_model_open(&m, path));
    CHECK_OK(kvt_model_memory(path, m, 256, 1, &before));
    CHECK_OK(kvt_draft_mtp_attach(m, file));
    CHECK_OK(kvt_model_memory(path, m, 256, 1, &after));
    /* from the paths alone (info of a header; the note at start) */
    CHECK_OK(kvt_model_memory(path, NULL, 256, 1, &hb));
    ha = hb;
    CHECK_OK(kvt_memory_add_mtp(&ha, file));
    kvt_memory_fault = KVT_MEMORY_FAULT_NO_MTP;
    int frc = kvt_model_memory(path, m, 256, 1, &fault);
    hf = hb;
    frc |= kvt_memory_add_mtp(&hf, file);
    kvt_memory_fault = 0;
    CHECK_OK(frc);
    bool model = mtp_counted(&before, &after, want, want_type, nt), header = mtp_counted(&hb, &ha, want, want_type, nt);
    bool same = before.mapped > 0 && hb.mapped == before.mapped && ha.mapped == after.mapped;
    bool ctl = !mtp_counted(&before, &fault, want, want_type, nt) && !mtp_counted(&hb, &hf, want, want_type, nt);
    printf("    mapped: %llu B, with the MTP file attached %llu B (its header: %llu B in %zu tensors): %s; from the "
           "paths %llu B, %llu B: %s; control (the file left out): %llu B, %s\n",
           (unsigned long long)before.mapped, (unsigned long long)after.mapped, (unsigned long long)want, nt,
           model ? "counted" : "NOT COUNTED", (unsigned long long)hb.mapped, (unsigned long long)ha.mapped,
           header && same ? "the same" : "DIFFERENT", (unsigned long long)fault.mapped, ctl ? "caught" : "NOT CAUGHT");
    CHECKF(model, "the attached MTP file is not counted in the model's mapped bytes");
    CHECKF(header && same, "the count from the paths differs from the model's");
    CHECKF(ctl, "control: the MTP file left out of the count went unseen");
    /* the note: with the available memory between the two counts, the
     * weights fit without the file and not with it */
    char note[256];
    kvt_memory na = after, nb = before, nf = fault;
    na.available = nb.available = nf.available = before.mapped + want / 2;
    bool says = kvt_memory_note(&na, note, sizeof note), quiet = !kvt_memory_note(&nb, note, sizeof note),
         ctl_note = !kvt_memory_note(&nf, note, sizeof note);
    CHECKF(says && quiet, "the memory note leaves the MTP file out");
    CHECKF(ctl_note, "control: the note left the file out and still said so");
    kvt_model_close(m);
    /* `kvtier info --draft mtp --model-draft FILE` (from the header) */
    char out[160];
    snprintf(out, sizeof out, "%s/info.txt", dir);
    const char *const a[] = {kvt_test_bin(), "info", "--model", path, "--ctx", "256", "--draft", "mtp",
                             "--model-draft", file, NULL};
    int st = -1;
    char *txt = fx_run(a, out, 60, &st) == 1 && st == 0 ? kvt_test_read_file(out, NULL) : NULL;
    char line[160];
    snprintf(line, sizeof line, "mapped        %llu B (", (unsigned long long)after.mapped);
    char of[96];
    snprintf(of, sizeof of, "; %llu B of it from the MTP file;", (unsigned long long)want);
    bool printed = txt && strstr(txt, line) && strstr(txt, of);
    if (!printed) printf("    info: exit %d: %s", st, txt ? txt : "(no output)\n");
    free(txt);
    const char *const b[] = {kvt_test_bin(), "info", "--model", path, "--draft", "ngram", NULL};
    st = -1;
    bool refused = fx_run(b, out, 60, &st) == 1 && WIFEXITED(st) && WEXITSTATUS(st) == 2;
    unlink(out);
    unlink(file);
    unlink(path);
    rmdir(dir);
    CHECKF(printed, "info --draft mtp --model-draft: want the mapped line with the MTP file's bytes");
    CHECKF(refused, "info --draft ngram: want a usage error");
}

TEST(speculate_ds4)
{
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_preset(&m, "ds4-tiny", 7, NULL));
    kvt_model_info in;
    kvt_model_info_get(m, &in);
    speculation_exact(m, "ds4-tiny", in.bos >= 0 ? in.bos : 256, 32, 90, true);
    kvt_model_close(m);
}

/* Replies that start from what earlier ones learned (a server's record,
 * kvt_gen.learned): ds4-tiny, greedy and sampled, with the knowing
 * drafter (drafts accepted and rejected; KVT_DRAFT_FAULT_NO_COST, so
 * that no clock decides what is drafted): a reply fills the record, the
 * next ones (alone, and two batched from the same record) start from it
 * and equal plain decoding (response, tokens, digest). A record deep in a
 * losing streak (1000 passes to skip) makes the next reply draft
 * nothing, still plain decoding's reply. Control: KVT_DRAFT_FAULT_FRESH
 * (the record ignored) drafts in that reply, and the test sees it. */
TEST(speculate_learned)
{
    kvt_model *m = NULL;
    CHECK_OK(kvt_model_preset(&m, "ds4-tiny", 7, NULL));
    kvt_model_info in;
    kvt_model_info_get(m, &in);
    int32_t pa[PROMPT], pb[PROMPT];
    repeating_prompt(pa, PROMPT, 24, 11, 32, 90);
    repeating_prompt(pb, PROMPT, 17, 12, 32, 90);
    pa[0] = pb[0] = in.bos >= 0 ? in.bos : 256;
    int32_t *ps[BATCH] = {pa, pb};
    for (size_t si = 0; si < sizeof settings / sizeof *settings; si++) {
        const setting *st = &settings[si];
        outcome plain[BATCH], first, second, both[BATCH], off, off_c;
        bool ran = replies(m, ps, PROMPT, BATCH, st, KVT_DRAFT_NONE, plain);
        for (size_t i = 0; ran && i < BATCH; i++) known[i] = plain[i].toks, n_known[i] = plain[i].n;
        kvt_draft_tune rec = {0};
        learned_rec = &rec;
        kvt_gen_test_drafter = knowing;
        /* the tuning blind to the clock (no timing in a test): what it
         * drafts follows from the counts and the record alone */
        kvt_draft_fault = KVT_DRAFT_FAULT_NO_COST;
        ran = ran && replies(m, ps, PROMPT, 1, st, KVT_DRAFT_NGRAM, &first);
        bool filled = rec.max == 6 && rec.n_draft > 0;
        kvt_draft_tune after_first = rec;
        ran = ran && replies(m, ps, PROMPT, 1, st, KVT_DRAFT_NGRAM, &second);
        rec = after_first;
        ran = ran && replies(m, ps, PROMPT, BATCH, st, KVT_DRAFT_NGRAM, both);
        rec = after_first;
        rec.skip = 1000, rec.losses = 6;
        ran = ran && replies(m, ps, PROMPT, 1, st, KVT_DRAFT_NGRAM, &off);
        kvt_draft_fault = KVT_DRAFT_FAULT_NONE;
        rec = after_first;
        rec.skip = 1000, rec.losses = 6;
        kvt_draft_fault = KVT_DRAFT_FAULT_FRESH;
        ran = ran && replies(m, ps, PROMPT, 1, st, KVT_DRAFT_NGRAM, &off_c);
        kvt_draft_fault = KVT_DRAFT_FAULT_NONE;
        kvt_gen_test_drafter = NULL;
        learned_rec = NULL;
        CHECKF(ran, "%s: a reply failed: %s", st->what, kvt_errmsg());
        bool eq2 = same(&plain[0], &second), eqb = same(&plain[0], &both[0]) && same(&plain[1], &both[1]),
             eqo = same(&plain[0], &off), eqf = same(&plain[0], &first);
        printf("    ds4-tiny %s: first reply %u drafted, %u accepted (%s); the record: %u timed passes with drafts, "
               "%u without; the second from it %u drafted, %u accepted: %s; two batched from it: %s; from a "
               "losing streak: %u drafted, %s (control, the record ignored: %u drafted)\n",
               st->what, first.u.drafted, first.u.accepted, eqf ? "same" : "DIFFERENT", after_first.n_draft,
               after_first.n_plain, second.u.drafted, second.u.accepted, eq2 ? "same" : "DIFFERENT",
               eqb ? "same" : "DIFFERENT", off.u.drafted, eqo ? "same" : "DIFFERENT", off_c.u.drafted);
        CHECKF(filled, "%s: the first reply left nothing in the record", st->what);
        CHECKF(eqf && eq2 && eqb && eqo, "%s: a reply from the record differs from plain decoding", st->what);
        CHECKF(second.u.drafted > 0 && second.u.accepted > 0 && second.u.accepted < second.u.drafted,
               "%s: the second reply must draft, accept and reject", st->what);
        CHECKF(off.u.drafted == 0, "%s: a reply from a record in a losing streak drafted %u", st->what, off.u.drafted);
        CHECKF(off_c.u.drafted > 0, "%s: control: the record ignored went unseen", st->what);
        for (size_t i = 0; i < BATCH; i++) {
            outcome_free(&plain[i]);
            outcome_free(&both[i]);
            known[i] = NULL;
        }
        outcome_free(&first);
        outcome_free(&second);
        outcome_free(&off);
        outcome_free(&off_c);
    }
    kvt_model_close(m);
}

static void family(const fam_spec *f, bool ngram_hits)
{
    char dir[] = "/tmp/kvt-spec-XXXXXX", path[256];
    kvt_model *m = fam_open(f, dir, path, sizeof path);
    if (!m) return;
    speculation_exact(m, f->arch, 1, 3, 2000, ngram_hits);
    fam_close(m, dir, path);
}

TEST(speculate_llama)
{
    static const fam_spec f = {"llama", false, false, FAM_HEAD_DIM, false, false, false};
    family(&f, true);
}

TEST(speculate_gemma3)
{
    static const fam_spec f = {"gemma3", false, true, FAM_HEAD_DIM, false, false, true};
    family(&f, true);
}

TEST(speculate_qwen35)
{
    static const fam_spec f = {"qwen35", .qwen35 = FAM_Q35_DENSE};
    family(&f, false);
}

/* ---- through the server ---- */

enum { N_REQ = 3 };
static const char *const bodies[N_REQ] = {
    "{\"prompt\":\"abcabcabcabcabcabcabc\",\"max_tokens\":64,\"temperature\":0,\"logprobs\":2}",
    "{\"prompt\":\"1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2 3\",\"max_tokens\":64,\"temperature\":0.7,\"top_k\":3,"
    "\"seed\":5,\"logprobs\":2}",
    "{\"prompt\":\"1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2 3\",\"max_tokens\":64,\"temperature\":0,\"logprobs\":2}",
};

/* The value of a /metrics line "name value" in text; -1 when absent. */
static long metric_in(const char *text, const char *name)
{
    char key[128];
    snprintf(key, sizeof key, "\n%s ", name);
    const char *p = text ? strstr(text, key) : NULL;
    return p ? strtol(p + strlen(key), NULL, 10) : -1;
}

/* Remove the value after the first key (up to the character end) from
 * text. */
static void cut_field(char *text, const char *key, char end)
{
    char *p = strstr(text, key);
    if (!p) return;
    p += strlen(key);
    char *q = strchr(p, end);
    if (q) memmove(p, q, strlen(q) + 1);
}

/* The response bodies with --draft d (malloc'ed, without id and created;
 * NULL each when it failed) and the server's /metrics text. */
static bool serve_replies(fx_server *sv, const char *d, char **out, char **metrics)
{
    /* --draft model: ds4-tiny's weights again as the draft model; --draft
     * mtp: ds4-tiny with an MTP layer (the same weights before it), served
     * under ds4-tiny's name */
    bool mtp = !strcmp(d, "mtp");
    const char *const args[] = {"--model", mtp ? "ds4-tiny+mtp=1" : "ds4-tiny", "--model-id", "ds4-tiny", "--no-kv-disk",
                                "--parallel", "2", "--threads", "1", "--draft", d,
                                strcmp(d, "model") ? NULL : "--model-draft", "ds4-tiny", NULL};
    if (!fx_server_start(sv, args)) return false;
    char cmd[4096], path[N_REQ][160], mpath[160];
    for (int i = 0; i < N_REQ; i++) {
        char bp[160];
        snprintf(bp, sizeof bp, "%s/body-%d.json", sv->dir, i);
        snprintf(path[i], sizeof path[i], "%s/out-%s-%d.json", sv->dir, d, i);
        if (!fx_write_file(bp, bodies[i], strlen(bodies[i]))) return false;
    }
    snprintf(mpath, sizeof mpath, "%s/metrics-%s.txt", sv->dir, d);
    /* the first two at once (one pass per step for both), then the third alone */
    snprintf(cmd, sizeof cmd,
             "u=%s/v1/completions; h='Content-Type: application/json'; "
             "curl -sf -H \"$h\" -d @%s/body-0.json -o %s $u & curl -sf -H \"$h\" -d @%s/body-1.json -o %s $u & "
             "wait && curl -sf -H \"$h\" -d @%s/body-2.json -o %s $u && curl -sf -o %s %s/metrics",
             sv->base, sv->dir, path[0], sv->dir, path[1], sv->dir, path[2], mpath, sv->base);
    const char *const argv[] = {"/bin/sh", "-c", cmd, NULL};
    char log[160];
    snprintf(log, sizeof log, "%s/curl-%s.log", sv->dir, d);
    int st = 0, rc = fx_run(argv, log, 60, &st);
    bool ok = fx_server_stop(sv) && rc == 1 && st == 0;
    if (!ok) {
        printf("    --draft %s: the requests exited %d (status %d)\n", d, rc, st);
        fx_print_file("curl", log);
        fx_print_file("server", sv->log);
    }
    for (int i = 0; i < N_REQ; i++) {
        out[i] = ok ? kvt_test_read_file(path[i], NULL) : NULL;
        if (out[i]) { /* the body but its id and time (its text need not be UTF-8: compared as bytes) */
            cut_field(out[i], "\"id\":\"", '"');
            cut_field(out[i], "\"created\":", ',');
        }
        ok = ok && out[i] && strstr(out[i], "\"choices\"");
    }
    *metrics = kvt_test_read_file(mpath, NULL);
    return ok && *metrics;
}

TEST(speculate_server)
{
    fx_server sv = {0};
    CHECKF(fx_tmpdir_make(&sv, "spec"), "mkdtemp");
    char *plain[N_REQ] = {0}, *spec[N_REQ] = {0}, *dmod[N_REQ] = {0}, *dmtp[N_REQ] = {0}, *mp = NULL, *ms = NULL,
         *md = NULL, *mm = NULL;
    bool ran = serve_replies(&sv, "none", plain, &mp) && serve_replies(&sv, "ngram", spec, &ms) &&
               serve_replies(&sv, "model", dmod, &md) && serve_replies(&sv, "mtp", dmtp, &mm);
    if (!ran) fx_server_kill(&sv);
    bool same_all = ran;
    for (int i = 0; i < N_REQ && ran; i++) {
        bool eq = !strcmp(plain[i], spec[i]), eq_m = !strcmp(plain[i], dmod[i]), eq_t = !strcmp(plain[i], dmtp[i]);
        printf("    request %d: ngram %s, model %s, mtp %s\n", i, eq ? "the same body" : "DIFFERENT",
               eq_m ? "the same body" : "DIFFERENT", eq_t ? "the same body" : "DIFFERENT");
        if (!eq) printf("      none:  %.300s\n      ngram: %.300s\n", plain[i], spec[i]);
        if (!eq_m) printf("      none:  %.300s\n      model: %.300s\n", plain[i], dmod[i]);
        if (!eq_t) printf("      none:  %.300s\n      mtp:   %.300s\n", plain[i], dmtp[i]);
        same_all = same_all && eq && eq_m && eq_t;
    }
    /* by drafter: the model's drafts counted as the model's */
    long m_dr = metric_in(md, "kvtier_drafter_tokens_total{drafter=\"model\"}"),
         m_acc = metric_in(md, "kvtier_drafter_accepted_tokens_total{drafter=\"model\"}"),
         m_ng = metric_in(md, "kvtier_drafter_tokens_total{drafter=\"ngram\"}"),
         m_all = metric_in(md, "kvtier_draft_tokens_total"),
         n_dr = metric_in(ms, "kvtier_drafter_tokens_total{drafter=\"ngram\"}"),
         m_gen = metric_in(md, "kvtier_generated_tokens_total"), m_passes = metric_in(md, "kvtier_decode_passes_total");
    printf("    --draft model: %ld tokens in %ld passes, %ld drafted (%ld counted as n-gram), %ld accepted\n", m_gen,
           m_passes, m_dr, m_ng, m_acc);
    long gen = metric_in(ms, "kvtier_generated_tokens_total"), passes = metric_in(ms, "kvtier_decode_passes_total"),
         drafted = metric_in(ms, "kvtier_draft_tokens_total"), acc = metric_in(ms, "kvtier_draft_accepted_tokens_total"),
         drafted0 = metric_in(mp, "kvtier_draft_tokens_total");
    printf("    --draft ngram: %ld tokens in %ld passes, %ld drafted, %ld accepted; --draft none: %ld drafted\n", gen,
           passes, drafted, acc, drafted0);
    long t_dr = metric_in(mm, "kvtier_draft_tokens_total"), t_acc = metric_in(mm, "kvtier_draft_accepted_tokens_total"),
         t_mtp = metric_in(mm, "kvtier_drafter_tokens_total{drafter=\"mtp\"}");
    printf("    --draft mtp: %ld drafted (%ld counted under drafter=\"mtp\"), %ld accepted\n", t_dr, t_mtp, t_acc);
    for (int i = 0; i < N_REQ; i++) {
        free(plain[i]);
        free(spec[i]);
        free(dmod[i]);
        free(dmtp[i]);
    }
    free(mp);
    free(ms);
    free(md);
    free(mm);
    fx_tmpdir_remove(&sv);
    CHECKF(ran, "the servers or their requests failed (a build without --draft refuses it)");
    CHECK(same_all);
    CHECKF(drafted0 == 0 && drafted > 0 && acc > 0 && acc <= drafted && passes > 0 && passes < gen + N_REQ,
           "the /metrics counts of speculation");
    CHECKF(m_dr > 0 && m_dr == m_all && m_ng == 0 && m_acc > 0 && m_acc <= m_dr && n_dr == drafted &&
           m_passes < m_gen,
           "the /metrics counts of the draft model (by drafter)");
    CHECKF(t_dr > 0 && t_mtp == t_dr && t_acc >= 0 && t_acc <= t_dr, "the /metrics counts of the MTP drafter");
}

/* `kvtier run args` on ds4-tiny: its exit status, stdout and stderr
 * (malloc'ed). */
static int run_cli(const char *const *args, char **out, char **err)
{
    const char *argv[32] = {kvt_test_bin(), "run", "--model", "ds4-tiny", "--no-kv-disk", "--threads", "1"};
    size_t n = 7;
    for (size_t i = 0; args[i] && n + 1 < sizeof argv / sizeof *argv; i++) argv[n++] = args[i];
    argv[n] = NULL;
    char po[] = "/tmp/kvt-spec-out-XXXXXX", pe[] = "/tmp/kvt-spec-err-XXXXXX";
    int fo = mkstemp(po), fe = mkstemp(pe), st = -1;
    if (fo >= 0) close(fo);
    if (fe >= 0) close(fe);
    int rc = fx_run_split(argv, po, pe, 60, &st);
    *out = kvt_test_read_file(po, NULL);
    *err = kvt_test_read_file(pe, NULL);
    unlink(po);
    unlink(pe);
    return rc == 1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

TEST(speculate_run)
{
    static const char *const temps[] = {"0", "0.7"};
    /* the draft model: ds4-tiny's weights again (its greedy drafts are
     * accepted), as a separate model with a session of its own */
    static const char *const drafts[] = {"none", "ngram", "model"};
    for (int t = 0; t < 2; t++) {
        char *out[3], *err[3];
        int st[3];
        for (int d = 0; d < 3; d++) {
            const char *const a[] = {"--prompt", "abcabcabcabcabcabcabc", "--output", "ids", "--max-tokens", "64",
                                     "--temperature", temps[t], "--top-k", "3", "--seed", "5", "--draft", drafts[d],
                                     d == 2 ? "--model-draft" : NULL, "ds4-tiny", NULL};
            st[d] = run_cli(a, &out[d], &err[d]);
        }
        for (int d = 1; d < 3; d++) {
            const char *acc = err[d] ? strstr(err[d], " drafted, ") : NULL;
            long accepted = acc ? strtol(acc + 10, NULL, 10) : -1;
            bool eq = st[0] == 0 && st[d] == 0 && out[0] && out[d] && !strcmp(out[0], out[d]);
            printf("    --draft %s, temperature %s: %s; %s", drafts[d], temps[t], eq ? "the same ids" : "DIFFERENT",
                   err[d] ? err[d] : "\n");
            CHECKF(eq, "run --draft %s changed the reply (or a run failed: %d %d)", drafts[d], st[0], st[d]);
            CHECKF(t || accepted > 0, "--draft %s: no draft accepted on a repeating prompt", drafts[d]);
        }
        for (int d = 0; d < 3; d++) {
            free(out[d]);
            free(err[d]);
        }
    }
    /* a draft model whose vocabulary differs at one token: ds4-tiny's
     * file with "<think>" spelt "<thonk>" (as long: the file stays whole) */
    char dir[] = "/tmp/kvt-spec-vocab-XXXXXX", file[128] = "";
    if (kvt_test_mkdtemp(dir)) {
        snprintf(file, sizeof file, "%s/other.gguf", dir);
        const char *const w[] = {kvt_test_bin(), "model", "new", "--preset", "ds4-tiny", "--out", file, NULL};
        int wst = -1;
        size_t len = 0;
        char *g = fx_run(w, "/dev/null", 60, &wst) == 1 && wst == 0 ? kvt_test_read_file(file, &len) : NULL;
        char *at = g ? memmem(g, len, "<think>", 7) : NULL;
        if (at) memcpy(at, "<thonk>", 7);
        bool ok = at && fx_write_file(file, g, len);
        free(g);
        CHECKF(ok, "writing a draft model of another vocabulary");
        const char *const a[] = {"--prompt", "a", "--max-tokens", "4", "--draft", "model", "--model-draft", file, NULL};
        char *out, *err;
        int st = run_cli(a, &out, &err);
        ok = st == 2 && err && strstr(err, "vocabulary differs") && strstr(err, "<think>") && strstr(err, "<thonk>");
        printf("    a draft model of another vocabulary: exit %d: %s", st, err ? err : "\n");
        free(out);
        free(err);
        CHECKF(ok, "run --model-draft of another vocabulary: want exit 2 naming the token");
        /* serve refuses to start with it */
        char port[16], po[] = "/tmp/kvt-spec-serve-XXXXXX";
        snprintf(port, sizeof port, "%d", fx_free_port());
        const char *const sa[] = {kvt_test_bin(), "serve", "--model", "ds4-tiny", "--no-kv-disk", "--port", port,
                                  "--draft", "model", "--model-draft", file, NULL};
        int fd = mkstemp(po), sst = -1;
        if (fd >= 0) close(fd);
        int rc = fx_run(sa, po, 60, &sst);
        char *log = kvt_test_read_file(po, NULL);
        ok = rc == 1 && WIFEXITED(sst) && WEXITSTATUS(sst) != 0 && log && strstr(log, "vocabulary differs") &&
             strstr(log, "token 260");
        printf("    serve with it: %s", log ? log : "(no output)\n");
        free(log);
        unlink(po);
        unlink(file);
        rmdir(dir);
        CHECKF(ok, "serve --model-draft of another vocabulary: want a refusal naming the token");
    }
    /* ds4.c's separate MTP file (model new --mtp-out) for ds4-tiny: the
     * ids of --draft none, drafts made */
    char mdir[] = "/tmp/kvt-spec-mtpf-XXXXXX", mf[128], mm[128];
    if (kvt_test_mkdtemp(mdir)) {
        snprintf(mf, sizeof mf, "%s/mtp.gguf", mdir);
        snprintf(mm, sizeof mm, "%s/model.gguf", mdir);
        const char *const w[] = {kvt_test_bin(), "model", "new", "--preset", "ds4-tiny+mtp=1", "--out", mm,
                                 "--mtp-out", mf, NULL};
        int wst = -1;
        CHECKF(fx_run(w, "/dev/null", 60, &wst) == 1 && wst == 0, "model new --mtp-out failed");
        char *out[2], *err[2];
        int st[2];
        for (int d = 0; d < 2; d++) {
            const char *const a[] = {"--prompt", "abcabcabcabcabcabcabc", "--output", "ids", "--max-tokens", "64",
                                     "--draft", d ? "mtp" : "none", d ? "--model-draft" : NULL, mf, NULL};
            st[d] = run_cli(a, &out[d], &err[d]);
        }
        const char *dr = err[1] ? strstr(err[1], " passes, ") : NULL;
        dr = dr ? strstr(dr, "; ") : NULL;
        long drafted = dr ? strtol(dr + 2, NULL, 10) : -1;
        bool eq = st[0] == 0 && st[1] == 0 && out[0] && out[1] && !strcmp(out[0], out[1]);
        printf("    --draft mtp --model-draft (ds4.c's file): %s; %s", eq ? "the same ids" : "DIFFERENT",
               err[1] ? err[1] : "\n");
        for (int d = 0; d < 2; d++) {
            free(out[d]);
            free(err[d]);
        }
        CHECKF(eq && drafted > 0, "run --draft mtp --model-draft: want plain decoding's ids and drafts made");
        /* the model file that has its own layer refuses a second one */
        const char *const a2[] = {"--prompt", "a", "--max-tokens", "1", "--model", mm, "--draft", "mtp",
                                  "--model-draft", mf, NULL};
        char *o2, *e2;
        int s2 = run_cli(a2, &o2, &e2);
        bool ok = s2 == 2 && e2 && strstr(e2, "its own MTP layer already");
        printf("    the same with a model that has the layer: exit %d: %s", s2, e2 ? e2 : "\n");
        free(o2);
        free(e2);
        CHECKF(ok, "run --draft mtp --model-draft on a model with the layer: want exit 2");
        unlink(mf);
        unlink(mm);
        rmdir(mdir);
    }
    static const struct { const char *opt, *val, *says; } bad[] = {
        {"--draft", "model", "needs --model-draft"}, {"--draft", "mtp", "no MTP (nextn) layer"},
        {"--draft", "x", "--draft must be"}, {"--draft-max", "65", "--draft-max"},
        {"--model-draft", "ds4-tiny", "goes with --draft model"}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        const char *const a[] = {"--prompt", "a", "--max-tokens", "1", bad[i].opt, bad[i].val,
                                 i == 4 ? "--draft" : NULL, "ngram", NULL};
        char *out, *err;
        int st = run_cli(a, &out, &err);
        bool ok = st == 2 && err && strstr(err, bad[i].says);
        if (!ok) printf("    %s %s: exit %d: %s", bad[i].opt, bad[i].val, st, err ? err : "");
        free(out);
        free(err);
        CHECKF(ok, "run %s %s: want exit 2 naming it", bad[i].opt, bad[i].val);
    }
}

/* ---- the draft session kept from reply to reply ---- */

enum { KEPT_CTX = 1024, KEPT_PROMPT = 300, KEPT_MORE = 70 };

/* A released draft session holds a prefix of toks[0..n) (at least one
 * token) and equals a draft-model session synced to that prefix. */
static bool released_exact(kvt_session *d, const int32_t *toks, size_t n, const kvt_session_opts *so)
{
    size_t L = d ? kvt_session_len(d) : 0;
    if (!L || L > n || memcmp(kvt_session_tokens(d), toks, L * sizeof *toks)) return false;
    kvt_session *f = NULL;
    bool ok = kvt_session_new(&f, draft_m, so) == KVT_OK && kvt_session_sync(f, toks, L, NULL) == KVT_OK &&
              kvt_test_digest(d, draft_m) == kvt_test_digest(f, draft_m);
    kvt_session_free(f);
    return ok;
}

/* A greedy reply of m to p[0..n) on a new session: plain (draft false) or
 * drafted for by draft_m from the draft session *ds (taken; NULL: a new
 * one). *ds is then the draft session the drafter gives back
 * (kvt_draft_model_release), o->draft_exact whether it is the draft
 * model's (released_exact), *prefilled the tokens it ran to follow. */
static bool kept_turn(kvt_model *m, const int32_t *p, size_t n, bool draft, kvt_session **ds, outcome *o,
                      size_t *prefilled)
{
    memset(o, 0, sizeof *o);
    kvt_session_opts so = {.n_ctx = KEPT_CTX, .n_threads = 1}, dso = so;
    dso.chunk = 40;
    kvt_session *s = NULL;
    kvt_draft_model *dm = NULL;
    kvt_request r = request(&settings[0], MAX_NEW);
    bool ok = kvt_session_new(&s, m, &so) == KVT_OK && kvt_session_sync(s, p, n, NULL) == KVT_OK;
    if (ok && draft)
        ok = (*ds ? kvt_draft_model_adopt(&dm, m, draft_m, *ds) : kvt_draft_model_new(&dm, m, draft_m, &dso, NULL)) ==
             KVT_OK;
    if (ok && draft) *ds = NULL;
    kvt_gen g = {.m = m, .s = s, .r = &r, .id = "cmpl-1", .model_name = "m", .max_new = MAX_NEW, .n_ctx = KEPT_CTX,
                 .seed = 1, .draft = draft ? KVT_DRAFT_MODEL : KVT_DRAFT_NONE, .draft_max = 6, .dm = dm};
    kvt_gen_out out = {0};
    if (ok) ok = (o->body = kvt_generate_run(&g, &o->u, &out)) != NULL;
    if (ok) {
        o->digest = kvt_test_digest(s, m);
        o->n = kvt_session_len(s);
        ok = (o->toks = malloc(o->n * sizeof(int32_t) + 1)) != NULL;
        if (ok) memcpy(o->toks, kvt_session_tokens(s), o->n * sizeof(int32_t));
    }
    if (ok && dm) {
        *prefilled = kvt_draft_model_prefilled(dm);
        *ds = kvt_draft_model_release(dm, o->toks, o->n);
        o->draft_exact = released_exact(*ds, o->toks, o->n, &so);
    }
    kvt_draft_model_free(dm);
    kvt_session_free(s);
    return ok;
}

/* Flip a byte in the middle of store entry id's record (in its segment). */
static bool damage_record(const char *dir, int64_t id)
{
    char path[300], sql[160];
    snprintf(path, sizeof path, "%s/kvtier.db", dir);
    snprintf(sql, sizeof sql, "SELECT COALESCE(rseg, 0), COALESCE(roff, 0), bytes FROM snaps WHERE id = %lld",
             (long long)id);
    sqlite3 *db = NULL;
    sqlite3_stmt *st = NULL;
    int64_t seg = 0, off = 0, bytes = 0;
    if (sqlite3_open(path, &db) == SQLITE_OK && sqlite3_prepare_v2(db, sql, -1, &st, NULL) == SQLITE_OK &&
        sqlite3_step(st) == SQLITE_ROW) {
        seg = sqlite3_column_int64(st, 0);
        off = sqlite3_column_int64(st, 1);
        bytes = sqlite3_column_int64(st, 2);
    }
    sqlite3_finalize(st);
    sqlite3_close(db);
    if (!seg || bytes <= 0) return false;
    snprintf(path, sizeof path, "%s/kvtier.db-seg%lld", dir, (long long)seg);
    int fd = open(path, O_RDWR);
    uint8_t b = 0;
    off_t at = (off_t)(off + bytes / 2);
    bool ok = fd >= 0 && pread(fd, &b, 1, at) == 1 && (b ^= 0x10, pwrite(fd, &b, 1, at) == 1);
    if (fd >= 0) close(fd);
    return ok;
}

/* A conversation's second turn extends its first reply (an agent resending
 * the conversation): its draft session, kept from the first reply
 * (kvt_draft_model_release, then kvt_draft_model_adopt), runs only the
 * tokens after what it holds; restored from a store it does the same; a
 * damaged record in the store is a clean miss. Each time the reply, its
 * logprobs and the model session's digest equal plain decoding's and the
 * draft session given back equals a fresh draft-model session synced to
 * its tokens. Control: KVT_DRAFT_FAULT_ADOPT_LONG (an adopted session one
 * token longer than the context kept so) fails that comparison. */
static void kept_pair(kvt_model *m, kvt_model *dmodel, const char *what, int32_t bos)
{
    draft_m = dmodel;
    int32_t p1[KEPT_PROMPT];
    repeating_prompt(p1, KEPT_PROMPT, 29, 21, 32, 90);
    p1[0] = bos;
    outcome a = {0}, b = {0}, c = {0}, d = {0}, e = {0}, f = {0};
    kvt_session *ds = NULL, *spare = NULL, *fresh = NULL;
    size_t pf1 = 0, pf2 = 0, pf3 = 0, pf4 = 0, pf5 = 0, unused = 0;
    /* turn 1: plain and drafted from a new draft session */
    bool ran = kept_turn(m, p1, KEPT_PROMPT, false, NULL, &a, &unused) && kept_turn(m, p1, KEPT_PROMPT, true, &ds, &b, &pf1);
    CHECKF(ran && ds, "%s: the first turn failed: %s", what, kvt_errmsg());
    CHECKF(same(&a, &b) && b.draft_exact, "%s: the first turn: the reply or the draft session given back differs",
           what);
    size_t L1 = kvt_session_len(ds);
    /* turn 2: the first turn's tokens and more */
    size_t n2 = b.n + KEPT_MORE;
    int32_t *p2 = malloc(n2 * sizeof *p2);
    CHECK(p2);
    memcpy(p2, b.toks, b.n * sizeof *p2);
    repeating_prompt(p2 + b.n - 1, KEPT_MORE + 1, 13, 22, 32, 90);
    p2[b.n - 1] = b.toks[b.n - 1];
    kvt_session_opts so = {.n_ctx = KEPT_CTX, .n_threads = 1};
    /* a copy of the kept session for the store */
    CHECK_OK(kvt_session_new(&spare, dmodel, &so));
    CHECK_OK(kvt_session_clone(spare, ds));
    outcome plain2 = {0};
    ran = kept_turn(m, p2, n2, false, NULL, &plain2, &unused) && kept_turn(m, p2, n2, true, &ds, &c, &pf2) &&
          kept_turn(m, p2, n2, true, &fresh, &d, &pf3);
    CHECKF(ran, "%s: the second turn failed: %s", what, kvt_errmsg());
    printf("    %s: turn 1 %zu prompt tokens, the draft session ran %zu, kept %zu; turn 2 %zu prompt tokens: kept "
           "session ran %zu (%u passes), a new one %zu; %u drafted, %u accepted\n",
           what, (size_t)KEPT_PROMPT, pf1, L1, n2, pf2, c.u.passes, pf3, c.u.drafted, c.u.accepted);
    CHECKF(same(&plain2, &c) && c.draft_exact, "%s: turn 2 on the kept draft session: the reply or the draft session differs", what);
    CHECKF(same(&plain2, &d) && d.draft_exact, "%s: turn 2 on a new draft session differs", what);
    CHECKF(pf2 <= n2 - L1 + c.u.passes && pf2 < L1, "%s: the kept draft session ran %zu tokens: want at most the %zu "
           "it lacked and one a pass (%u)", what, pf2, n2 - L1, c.u.passes);
    CHECKF(pf3 >= n2, "%s: a new draft session ran %zu tokens of %zu", what, pf3, n2);
    CHECKF(c.u.drafted > 0, "%s: turn 2 drafted nothing", what);
    /* the store: the kept session saved as the draft model's record, found
     * by the draft model's key chain only */
    char dir[] = "/tmp/kvt-spec-kept-XXXXXX";
    CHECK(kvt_test_mkdtemp(dir) != NULL);
    kvt_store *st = NULL;
    int64_t id = -1;
    size_t match_m = 1, match_d = 0, got = 0;
    int64_t fid = -1;
    CHECK_OK(kvt_store_open(&st, dir, 0));
    kvt_store_set_quiet(st, true);
    CHECK_OK(kvt_store_save(st, spare, kvt_session_len(spare), "draft", &id));
    CHECK_OK(kvt_store_lookup(st, m, p2, n2, &match_m, &fid));
    CHECK_OK(kvt_store_lookup(st, dmodel, p2, n2, &match_d, &fid));
    kvt_session *restored = NULL;
    CHECK_OK(kvt_session_new(&restored, dmodel, &so));
    CHECK_OK(kvt_store_restore_found(st, restored, p2, n2, match_d, fid, &got));
    kvt_store_close(st);
    ran = kept_turn(m, p2, n2, true, &restored, &e, &pf4);
    printf("    %s: the store holds the draft session's %zu tokens: the model's lookup finds %zu, the draft model's "
           "%zu, restored %zu; turn 2 from it ran %zu\n", what, kvt_session_len(spare), match_m, match_d, got, pf4);
    /* (a draft model of the model's own weights has the model's key chain:
     * its record is the model's as well, rightly) */
    bool own = kvt_snap_key0(m) != kvt_snap_key0(dmodel);
    CHECKF((match_m == 0) == own && match_d > 0 && got > 0, "%s: the draft record is not the draft model's alone",
           what);
    CHECKF(ran && same(&plain2, &e) && e.draft_exact && pf4 <= n2 - got + e.u.passes,
           "%s: turn 2 on the restored draft session", what);
    /* damaged: a clean miss, then the reply as from a new session */
    CHECK(damage_record(dir, id));
    CHECK_OK(kvt_store_open(&st, dir, 0));
    kvt_store_set_quiet(st, true);
    kvt_session *missed = NULL;
    got = 1;
    match_d = 0;
    CHECK_OK(kvt_session_new(&missed, dmodel, &so));
    kvt_store_lookup(st, dmodel, p2, n2, &match_d, &fid);
    int rrc = kvt_store_restore_found(st, missed, p2, n2, match_d, fid, &got);
    kvt_store_close(st);
    bool clean = got == 0 && kvt_session_len(missed) == 0;
    ran = kept_turn(m, p2, n2, true, &missed, &f, &pf5);
    printf("    %s: the record damaged: restore rc %d, %zu tokens, the session %s; turn 2 ran %zu\n", what, rrc, got,
           clean ? "empty" : "NOT EMPTY", pf5);
    CHECKF(clean, "%s: a damaged draft record restored something", what);
    CHECKF(ran && same(&plain2, &f) && f.draft_exact && pf5 >= n2, "%s: turn 2 after the damaged record", what);
    fx_rm_tree(dir);
    /* a resend that leaves the kept session inside the first reply (the
     * reply resent otherwise): it goes back (to its checkpoint before the
     * divergence when it has fixed state), a chunk a pass from there */
    {
        size_t n3 = b.n - 10 + KEPT_MORE;
        int32_t *p3 = malloc(n3 * sizeof *p3);
        CHECK(p3);
        memcpy(p3, b.toks, (b.n - 10) * sizeof *p3);
        repeating_prompt(p3 + b.n - 11, KEPT_MORE + 1, 11, 23, 32, 90);
        p3[b.n - 11] = b.toks[b.n - 11];
        kvt_session *cp = NULL;
        outcome plain3 = {0}, g = {0};
        size_t pf6 = 0;
        CHECK_OK(kvt_session_new(&cp, dmodel, &so));
        CHECK_OK(kvt_session_clone(cp, spare));
        ran = kept_turn(m, p3, n3, false, NULL, &plain3, &unused) && kept_turn(m, p3, n3, true, &cp, &g, &pf6);
        printf("    %s: the kept session of %zu tokens, a resend that leaves the reply at %zu: it ran %zu; reply %s, "
               "draft session %s\n", what, L1, b.n - 10, pf6, ran && same(&plain3, &g) ? "the same" : "DIFFERENT",
               g.draft_exact ? "exact" : "NOT EXACT");
        CHECKF(ran && same(&plain3, &g) && g.draft_exact, "%s: a resend that leaves the kept session", what);
        kvt_session_free(cp);
        outcome_free(&plain3);
        outcome_free(&g);
        free(p3);
    }
    /* control: an adopted session one token longer than the context */
    size_t L2 = kvt_session_len(ds);
    bool clean_ok = false, fault_ok = true;
    for (int fault = 0; fault < 2; fault++) {
        kvt_session *cp = NULL;
        kvt_draft_model *dm = NULL;
        CHECK_OK(kvt_session_new(&cp, dmodel, &so));
        CHECK_OK(kvt_session_clone(cp, ds));
        CHECK_OK(kvt_draft_model_adopt(&dm, m, dmodel, cp));
        kvt_draft_fault = fault ? KVT_DRAFT_FAULT_ADOPT_LONG : KVT_DRAFT_FAULT_NONE;
        bool ex = draft_session_exact(dm, kvt_session_tokens(ds), L2 - 1, &so);
        kvt_draft_fault = KVT_DRAFT_FAULT_NONE;
        if (fault) fault_ok = ex;
        else clean_ok = ex;
        kvt_draft_model_free(dm);
    }
    printf("    %s: an adopted session one token long synced: %s; control (kept so): %s\n", what,
           clean_ok ? "exact" : "NOT EXACT", fault_ok ? "unseen" : "seen");
    CHECKF(clean_ok, "%s: an adopted session brought back one token is not the draft model's", what);
    CHECKF(!fault_ok, "%s: control: the adopted session left one token long went unseen", what);
    kvt_session_free(ds);
    kvt_session_free(spare);
    kvt_session_free(fresh);
    kvt_session_free(restored);
    kvt_session_free(missed);
    free(p2);
    outcome *all[] = {&a, &b, &c, &d, &e, &f, &plain2};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) outcome_free(all[i]);
    draft_m = NULL;
}

TEST(speculate_model_kept)
{
    kvt_model *m = NULL, *same_w = NULL, *narrow = NULL;
    CHECK_OK(kvt_model_preset(&m, "ds4-tiny", 7, NULL));
    CHECK_OK(kvt_model_preset(&same_w, "ds4-tiny", 7, NULL));
    CHECK_OK(kvt_model_preset(&narrow, "ds4-tiny+D=32", 3, NULL));
    kvt_model_info in;
    kvt_model_info_get(m, &in);
    int32_t bos = in.bos >= 0 ? in.bos : 256;
    kept_pair(m, same_w, "ds4-tiny by itself", bos);
    kept_pair(m, narrow, "ds4-tiny by ds4-tiny+D=32", bos);
    kvt_model_close(narrow);
    kvt_model_close(same_w);
    kvt_model_close(m);
}

/* ---- the draft session kept, through the server ---- */

#define STORIES "../shared/models/stories260K.gguf"

/* POST the completion of prompt (max_tokens max, greedy, logprobs) to sv;
 * the response body (malloc'ed; NULL on failure), file tag k. */
static char *kept_post(fx_server *sv, const char *prompt, int max, int k)
{
    json_t *j = json_pack("{s:s,s:i,s:i,s:i}", "prompt", prompt, "max_tokens", max, "temperature", 0, "logprobs", 2);
    char *body = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    char bp[160], rp[160], log[160], url[128];
    snprintf(bp, sizeof bp, "%s/kb-%d.json", sv->dir, k);
    snprintf(rp, sizeof rp, "%s/kr-%d.json", sv->dir, k);
    snprintf(log, sizeof log, "%s/kc-%d.log", sv->dir, k);
    snprintf(url, sizeof url, "%s/v1/completions", sv->base);
    char at[170];
    snprintf(at, sizeof at, "@%s", bp);
    bool ok = body && fx_write_file(bp, body, strlen(body));
    free(body);
    const char *const argv[] = {"curl", "-sf", "-H", "Content-Type: application/json", "-d", at, "-o", rp, url, NULL};
    int st = 0;
    ok = ok && fx_run(argv, log, 60, &st) == 1 && st == 0;
    return ok ? kvt_test_read_file(rp, NULL) : NULL;
}

/* sv's /metrics (malloc'ed), once the worker published the reply's end. */
static char *kept_metrics(fx_server *sv, int k)
{
    char mp[160], log[160], url[128];
    snprintf(mp, sizeof mp, "%s/km-%d.txt", sv->dir, k);
    snprintf(log, sizeof log, "%s/kmc-%d.log", sv->dir, k);
    snprintf(url, sizeof url, "%s/metrics", sv->base);
    fx_sleep_ms(150);
    const char *const argv[] = {"curl", "-sf", "-o", mp, url, NULL};
    int st = 0;
    return fx_run(argv, log, 30, &st) == 1 && st == 0 ? kvt_test_read_file(mp, NULL) : NULL;
}

/* A response's text and usage figure (prompt_tokens, ...; -1: none). */
static char *kept_text(const char *resp)
{
    json_t *j = resp ? json_loads(resp, 0, NULL) : NULL;
    const char *t = json_string_value(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text"));
    char *o = t ? kvt_strndup(t, strlen(t)) : NULL;
    json_decref(j);
    return o;
}

static long kept_usage(const char *resp, const char *what)
{
    json_t *j = resp ? json_loads(resp, 0, NULL) : NULL;
    json_t *v = json_object_get(json_object_get(j, "usage"), what);
    long n = json_is_integer(v) ? (long)json_integer_value(v) : -1;
    json_decref(j);
    return n;
}

/* What a server did over a conversation's turns. */
typedef struct kept_run {
    char *body[2];            /* the turns' responses up to their usage (turn 1: NULL when not run) */
    char *text1;              /* turn 1's reply text */
    long from[3];             /* kvtier_draft_sessions_total: none, ram, store (at the end) */
    long pf_turn2;            /* draft tokens run during turn 2 */
    long dropped, prompt1, total1, prompt2, completion2;
} kept_run;

static void kept_free(kept_run *r)
{
    free(r->body[0]);
    free(r->body[1]);
    free(r->text1);
    memset(r, 0, sizeof *r);
}

/* The conversation on a server started with args: turn 1 (prompt p1, 40
 * tokens) unless text1 is given (its reply text from another run), then
 * turn 2 (p1, the reply, " Then"; max2 tokens). The server is stopped. */
static bool kept_turns(fx_server *sv, const char *const *args, const char *p1, const char *text1, int max2,
                       kept_run *o)
{
    memset(o, 0, sizeof *o);
    if (!fx_server_start(sv, args)) return false;
    char *m0 = NULL, *m1 = NULL;
    bool ok = true;
    if (!text1) {
        ok = (o->body[0] = kept_post(sv, p1, 40, 1)) != NULL && (o->text1 = kept_text(o->body[0])) != NULL;
        o->prompt1 = kept_usage(o->body[0], "prompt_tokens");
        o->total1 = kept_usage(o->body[0], "total_tokens");
    } else {
        o->text1 = kvt_strndup(text1, strlen(text1));
    }
    ok = ok && (m0 = kept_metrics(sv, 0)) != NULL;
    size_t n1 = strlen(p1), nt = o->text1 ? strlen(o->text1) : 0;
    char *p2 = malloc(n1 + nt + 8);
    if (ok && p2) snprintf(p2, n1 + nt + 8, "%s%s Then", p1, o->text1);
    ok = ok && p2 && (o->body[1] = kept_post(sv, p2, max2, 2)) != NULL && (m1 = kept_metrics(sv, 1)) != NULL;
    free(p2);
    if (ok) {
        o->from[0] = metric_in(m1, "kvtier_draft_sessions_total{from=\"none\"}");
        o->from[1] = metric_in(m1, "kvtier_draft_sessions_total{from=\"ram\"}");
        o->from[2] = metric_in(m1, "kvtier_draft_sessions_total{from=\"store\"}");
        o->pf_turn2 = metric_in(m1, "kvtier_draft_prefilled_tokens_total") -
                      metric_in(m0, "kvtier_draft_prefilled_tokens_total");
        o->dropped = metric_in(m1, "kvtier_draft_sessions_dropped_total");
        o->prompt2 = kept_usage(o->body[1], "prompt_tokens");
        o->completion2 = kept_usage(o->body[1], "completion_tokens");
    }
    for (int i = 0; i < 2; i++) { /* the reply: its choices (its usage says where the prompt came from) */
        char *u = o->body[i] ? strstr(o->body[i], ",\"usage\":") : NULL;
        if (u) *u = 0;
        if (o->body[i]) {
            cut_field(o->body[i], "\"id\":\"", '"');
            cut_field(o->body[i], "\"created\":", ',');
        }
    }
    free(m0);
    free(m1);
    bool stopped = fx_server_stop(sv);
    if (!ok || !stopped) fx_print_file("server", sv->log);
    return ok && stopped;
}

/* Every record of a store damaged (a byte flipped in each, in its
 * segment); how many. */
static int damage_all(const char *dir)
{
    char path[300];
    snprintf(path, sizeof path, "%s/kvtier.db", dir);
    sqlite3 *db = NULL;
    sqlite3_stmt *st = NULL;
    int64_t ids[256];
    int n = 0, done = 0;
    if (sqlite3_open(path, &db) == SQLITE_OK &&
        sqlite3_prepare_v2(db, "SELECT id FROM snaps", -1, &st, NULL) == SQLITE_OK)
        while (n < 256 && sqlite3_step(st) == SQLITE_ROW) ids[n++] = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    sqlite3_close(db);
    for (int i = 0; i < n; i++) done += damage_record(dir, ids[i]);
    return done;
}

/* `kvtier serve --draft model` on stories260K drafting for itself (its
 * replies are text, so the second turn resent as text extends the first
 * reply's exact tokens), with --draft none's replies as the reference:
 *   - two turns, the second extending the first reply: the second turn's
 *     draft session is the first one's, kept with the pooled session
 *     (from="ram"), and runs only the tokens it lacks (and one a pass),
 *     none of the shared prefix; the bodies (text, logprobs) are plain
 *     decoding's;
 *   - restarted on the same disk store: the second turn's draft session is
 *     restored from the store (from="store"), the same guarantees;
 *   - every record of that store damaged: a clean miss (a new draft
 *     session, the whole prompt run), the same body;
 *   - --kv-ram-mb 2 and a long second reply: the companion does not fit
 *     at the reply's end and is dropped (counted), the body the same.
 * (The exactness of the draft session itself, and its control, are
 * speculate_model_kept's; the model and its draft being one file here,
 * their records are one model's.) */
TEST(speculate_server_kept)
{
    if (access(STORIES, R_OK)) SKIP(STORIES " not found");
    fx_server sv = {0};
    CHECKF(fx_tmpdir_make(&sv, "spec-kept"), "mkdtemp");
    char store[128], p1[2048] = "";
    snprintf(store, sizeof store, "%s/store", sv.dir);
    for (int i = 0; i < 20; i++) /* past the store's 512 tokens */
        strcat(p1, "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. ");
    const char *const plain[] = {"--model", STORIES, "--no-kv-disk", "--parallel", "1", "--threads", "1",
                                 "--draft", "none", NULL};
    const char *const kept[] = {"--model", STORIES, "--kv-disk-dir", store, "--parallel", "1", "--threads", "1",
                                "--draft", "model", "--model-draft", STORIES, NULL};
    const char *const tight[] = {"--model", STORIES, "--no-kv-disk", "--kv-ram-mb", "2", "--parallel", "1",
                                 "--threads", "1", "--draft", "model", "--model-draft", STORIES, NULL};
    kept_run a = {0}, b = {0}, c = {0}, d = {0}, e = {0}, f = {0};
    bool ran = kept_turns(&sv, plain, p1, NULL, 40, &a) && kept_turns(&sv, kept, p1, NULL, 40, &b);
    CHECKF(ran, "the servers or their requests failed");
    bool same1 = !strcmp(a.body[0], b.body[0]) && !strcmp(a.body[1], b.body[1]);
    printf("    two turns: %ld then %ld prompt tokens; turn 2's draft session from ram %ld, ran %ld tokens (%ld new, "
           "%ld generated); bodies %s\n", b.prompt1, b.prompt2, b.from[1], b.pf_turn2, b.prompt2 - b.total1,
           b.completion2, same1 ? "the same" : "DIFFERENT");
    CHECKF(same1, "--draft model with the draft session kept changed a body");
    CHECKF(b.from[0] == 1 && b.from[1] == 1 && b.prompt2 > b.total1, "turn 2's draft session: want the kept one");
    CHECKF(b.pf_turn2 <= b.prompt2 - b.total1 + b.completion2 && b.pf_turn2 < b.prompt1,
           "turn 2's draft session ran %ld tokens: the shared prefix again", b.pf_turn2);
    /* restarted on the store */
    ran = kept_turns(&sv, kept, p1, b.text1, 40, &c);
    CHECKF(ran, "the restarted server failed");
    printf("    restarted: turn 2's draft session from the store %ld, ran %ld tokens; body %s\n", c.from[2],
           c.pf_turn2, !strcmp(a.body[1], c.body[1]) ? "the same" : "DIFFERENT");
    if (strcmp(a.body[1], c.body[1])) printf("      plain:     %.600s\n      restarted: %.600s\n", a.body[1], c.body[1]);
    CHECKF(!strcmp(a.body[1], c.body[1]), "the restarted server changed turn 2's reply");
    CHECKF(c.from[2] == 1 && c.pf_turn2 < b.prompt1, "turn 2 after a restart: want the draft session from the store");
    /* every record damaged: clean misses */
    int damaged = damage_all(store);
    ran = kept_turns(&sv, kept, p1, b.text1, 40, &d);
    CHECKF(ran, "the server on the damaged store failed");
    printf("    %d records damaged: turn 2's draft session new %ld, from the store %ld, ran %ld tokens; body %s\n",
           damaged, d.from[0], d.from[2], d.pf_turn2, !strcmp(a.body[1], d.body[1]) ? "the same" : "DIFFERENT");
    CHECKF(damaged > 0 && !strcmp(a.body[1], d.body[1]), "the damaged store changed turn 2's body");
    CHECKF(d.from[0] == 1 && d.from[2] == 0 && d.pf_turn2 >= d.prompt2, "a damaged draft record: want a clean miss");
    /* a tight budget: the companion of a long reply does not fit */
    ran = kept_turns(&sv, plain, p1, NULL, 1500, &e) && kept_turns(&sv, tight, p1, NULL, 1500, &f);
    CHECKF(ran, "the tight servers failed");
    bool same_t = !strcmp(e.body[0], f.body[0]) && !strcmp(e.body[1], f.body[1]);
    printf("    --kv-ram-mb 2, a %ld-token second reply: draft sessions dropped %ld; bodies %s\n", f.completion2,
           f.dropped, same_t ? "the same" : "DIFFERENT");
    CHECKF(same_t, "the tight budget changed a body");
    CHECKF(f.dropped >= 1, "the companion that does not fit: want it dropped");
    kept_free(&a);
    kept_free(&b);
    kept_free(&c);
    kept_free(&d);
    kept_free(&e);
    kept_free(&f);
    fx_tmpdir_remove(&sv);
}
