/* Qwen 3.5's MTP (nextn) layer (src/arch/llama_mtp.c, the passes of src/arch/llama.c),
 * its rows kept by the session (kvt_model_set_mtp_rows):
 *
 *   qwen35_mtp_off        a file with the layer (synth_family.h, mtp: its
 *                         tensors drawn after the model's), the rows not
 *                         kept: the same logits, cache bytes and plan as
 *                         the file without it, qwen35 and qwen35moe; the
 *                         switch is refused once a session exists and for
 *                         a model without the layer. A file claiming two
 *                         MTP layers, or missing nextn.eh_proj, is refused
 *                         cleanly (KVT_EUNSUPPORTED, KVT_EFORMAT).
 *   qwen35_mtp_rows       rows kept: the plan lists "mtp rows"; logits and
 *                         cache bytes (rows and state) equal under chunks of
 *                         1, 7 and 256, on 1 and 2 threads, and batched with
 *                         another session (kvt_session_step) or alone;
 *                         snapshots restored mid-prompt and run on, and a
 *                         disk store's round trip, equal the uninterrupted
 *                         run; a record saved with the rows is a miss for the
 *                         model without them and the reverse. Control:
 *                         KVT_LLAMA_FAULT_MTP_PENDING (the h_nextn a row
 *                         reads not restored with the state) makes the
 *                         restored run differ, and the test says so.
 *   qwen35_mtp_reference  the layer against an f64 reference written here
 *                         from the file's tensors, as llama.cpp's qwen35
 *                         graph_mtp: the hidden state the session keeps is
 *                         output_norm of the last position's residual (the
 *                         model's logits are output . it), and the layer's
 *                         logits of a step at the end of a prompt, reading
 *                         the session's rows of every earlier position,
 *                         equal the reference's within 1e-4 of max |logit|
 *                         (measured 1.1e-5: f32 products and the rows
 *                         rounded to f16, against f64 and unrounded rows;
 *                         10x that leaves room for another ISA's kernels).
 *                         Control: the reference with [h, e] concatenated
 *                         in the other order, or each row's h one position
 *                         late, is far outside it.
 *   qwen35_mtp_cli        `kvtier run --draft mtp` on the file gives the ids
 *                         of `--draft none` (greedy and sampled) and says
 *                         what it drafted; `kvtier info --draft mtp` lists
 *                         the "mtp rows" in the plan, `info` alone not; on
 *                         the file without the layer --draft mtp is refused
 *                         (exit 2, naming it). */
#include "test.h"
#include "fixture.h"
#include "arch/model.h"
#include "arch/llama.h"
#include "arch/llama_weights.h"
#include "fam_state.h"
#include "synth_family.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static const fam_spec q35[2] = {{"qwen35", .qwen35 = FAM_Q35_DENSE, .mtp = true},
                                {"qwen35moe", .qwen35 = FAM_Q35_MOE, .mtp = true}};

/* f with its MTP layer (mtp) or without it, written in dir as path. */
static bool write_q35(const fam_spec *f, bool mtp, char *dir, char *path, size_t cap)
{
    const char *vocab = kvt_test_shared("vocab/ggml-vocab-llama-spm.gguf");
    if (!vocab) { kvt_test_skip("../shared/vocab absent"); return false; }
    char v[1024];
    snprintf(v, sizeof v, "%s", vocab);
    fam_spec g = *f;
    g.mtp = mtp;
    snprintf(path, cap, "%s/%s%s.gguf", dir, f->arch, mtp ? "-mtp" : "");
    int rc = fam_write(path, v, 5, FAM_ROPE_BASE, &g, false);
    if (rc) kvt_test_fail(__FILE__, __LINE__, "writing %s: %s: %s", path, kvt_strerror(rc), kvt_errmsg());
    return !rc;
}

static kvt_model *open_q35(const char *path, bool rows)
{
    kvt_model *m = NULL;
    int rc = kvt_model_open(&m, path);
    if (!rc && rows) rc = kvt_model_set_mtp_rows(m, true);
    if (rc) {
        kvt_test_fail(__FILE__, __LINE__, "opening %s: %s: %s", path, kvt_strerror(rc), kvt_errmsg());
        kvt_model_close(m);
        return NULL;
    }
    return m;
}

static void rm_dir(const char *dir)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) printf("    (could not remove %s)\n", dir);
}

enum { N = 300 };

/* A session of m synced to t[0..n) with these options: its digest. */
static uint64_t run_with(kvt_model *m, const int32_t *t, size_t n, uint32_t chunk, uint32_t threads)
{
    kvt_session_opts so = {.n_ctx = 512, .n_threads = threads, .chunk = chunk};
    kvt_session *s = NULL;
    uint64_t d = 0;
    if (!kvt_session_new(&s, m, &so) && !kvt_session_sync(s, t, n, NULL)) d = kvt_test_digest(s, m);
    else kvt_test_fail(__FILE__, __LINE__, "a run failed: %s", kvt_errmsg());
    kvt_session_free(s);
    return d;
}

/* The file at path with the first `from` (n bytes) after `after` replaced
 * by `to`, written as out: opened, the error. */
static int patched_open(const char *path, const char *out, const char *after, const void *from, const void *to,
                        size_t n)
{
    size_t len = 0;
    char *f = kvt_test_read_file(path, &len);
    char *k = f ? memmem(f, len, after, strlen(after)) : NULL;
    char *at = k ? memmem(k, len - (size_t)(k - f), from, n) : NULL;
    int rc = KVT_EIO;
    if (at) {
        memcpy(at, to, n);
        FILE *o = fopen(out, "wb");
        if (o && fwrite(f, 1, len, o) == len && !fclose(o)) {
            kvt_model *m = NULL;
            rc = kvt_model_open(&m, out);
            kvt_model_close(m);
        } else if (o) {
            fclose(o);
        }
        unlink(out);
    }
    free(f);
    return rc;
}

TEST(qwen35_mtp_off)
{
    for (int i = 0; i < 2; i++) {
        char dir[] = "/tmp/kvt-q35mtp-XXXXXX", pa[256], pb[256];
        if (!kvt_test_mkdtemp(dir)) { CHECKF(0, "mkdtemp: %s", strerror(errno)); return; }
        if (!write_q35(&q35[i], true, dir, pa, sizeof pa) || !write_q35(&q35[i], false, dir, pb, sizeof pb)) {
            rm_dir(dir);
            return;
        }
        kvt_model *with = open_q35(pa, false), *without = open_q35(pb, false);
        if (with && without) {
            int32_t t[N];
            fam_prompt(t, N, 3);
            uint64_t a = run_with(with, t, N, 0, 1), b = run_with(without, t, N, 0, 1);
            kvt_plan pw, po;
            CHECK_OK(kvt_model_plan(with, 512, &pw));
            CHECK_OK(kvt_model_plan(without, 512, &po));
            printf("    %s: with the layer, rows not kept: digest %016llx, without it %016llx; plan %llu / %llu B\n",
                   q35[i].arch, (unsigned long long)a, (unsigned long long)b, (unsigned long long)pw.total,
                   (unsigned long long)po.total);
            CHECKF(a == b, "%s: the layer changed the cache with its rows off", q35[i].arch);
            CHECKF(pw.total == po.total && pw.per_token_x1000 == po.per_token_x1000 && !kvt_plan_bytes(&pw, "mtp rows"),
                   "%s: the plan changed with the rows off", q35[i].arch);
            CHECK(with->arch->mtp && with->arch->mtp->layers(with) == 1 && !without->arch->mtp);
            CHECK(kvt_model_set_mtp_rows(without, true) == KVT_EUNSUPPORTED);
            /* once a session exists the switch is refused */
            kvt_session *s = NULL;
            CHECK_OK(kvt_session_new(&s, with, NULL));
            CHECK(kvt_model_set_mtp_rows(with, true) == KVT_EINVAL && !kvt_model_mtp_rows(with));
            kvt_session_free(s);
            /* damaged files: two MTP layers claimed, eh_proj missing */
            char bad[300];
            snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
            uint32_t one = 1, two = 2;
            int r2 = patched_open(pa, bad, "nextn_predict_layers", &one, &two, 4);
            int r3 = patched_open(pa, bad, "blk.8.nextn.", "eh_proj", "eh_proX", 7);
            printf("    %s: two MTP layers claimed: %s; eh_proj missing: %s (%s)\n", q35[i].arch, kvt_strerror(r2),
                   kvt_strerror(r3), kvt_errmsg());
            CHECKF(r2 == KVT_EUNSUPPORTED && r3 == KVT_EFORMAT, "%s: damaged MTP files: %d, %d", q35[i].arch, r2, r3);
        }
        kvt_model_close(with);
        kvt_model_close(without);
        rm_dir(dir);
    }
}

/* Two sessions of m run t[0..n) and u[0..n) in batched steps of up to 40
 * tokens each (kvt_session_step: one forward_batch pass): their digests. */
static bool batched(kvt_model *m, const int32_t *t, const int32_t *u, size_t n, uint64_t *da, uint64_t *db)
{
    kvt_session_opts so = {.n_ctx = 512, .n_threads = 1};
    kvt_session *a = NULL, *b = NULL;
    bool ok = !kvt_session_new(&a, m, &so) && !kvt_session_new(&b, m, &so);
    /* the second starts 13 tokens later: the passes' segments differ in length */
    for (size_t pa = 0, pb = 0; ok && (pa < n || pb < n);) {
        kvt_step st[2];
        size_t k = 0, na = n - pa < 40 ? n - pa : 40, nb = n - pb < 40 ? n - pb : 40;
        if (pa == 0) na = 13;
        if (na) st[k++] = (kvt_step){a, t + pa, na, false, 0, NULL, NULL};
        if (nb && pa > 0) st[k++] = (kvt_step){b, u + pb, nb, false, 0, NULL, NULL};
        ok = kvt_session_step(st, k, 0) == KVT_OK;
        for (size_t i = 0; ok && i < k; i++) *(st[i].s == a ? &pa : &pb) += st[i].done;
    }
    if (ok) {
        *da = kvt_test_digest(a, m);
        *db = kvt_test_digest(b, m);
    }
    kvt_session_free(a);
    kvt_session_free(b);
    return ok;
}

/* A snapshot of t[0..k) restored in a new session and run on to n: its
 * digest equals want. */
static bool restored(kvt_model *m, const int32_t *t, size_t n, size_t k, uint64_t want)
{
    kvt_session_opts so = {.n_ctx = 512, .n_threads = 1};
    kvt_session *a = NULL, *b = NULL;
    uint8_t *snap = NULL;
    size_t len = 0;
    bool ok = !kvt_session_new(&a, m, &so) && !kvt_session_sync(a, t, k, NULL) &&
              !kvt_session_snapshot(a, &snap, &len) && !kvt_session_new(&b, m, &so) &&
              !kvt_session_restore(b, snap, len) && kvt_session_len(b) == k && !kvt_session_sync(b, t, n, NULL) &&
              kvt_test_digest(b, m) == want;
    kvt_session_free(a);
    kvt_session_free(b);
    free(snap);
    return ok;
}

/* t[0..k) saved to a store in dir by a session of a, restored by one of b:
 * the tokens reused. */
static size_t store_reuse(kvt_model *a, kvt_model *b, const int32_t *t, size_t k, const char *dir)
{
    kvt_store *st = NULL;
    kvt_session_opts so = {.n_ctx = 512, .n_threads = 1};
    kvt_session *sa = NULL, *sb = NULL;
    size_t reused = 0;
    if (!kvt_store_open(&st, dir, 0) && !kvt_session_new(&sa, a, &so) && !kvt_session_sync(sa, t, k, NULL) &&
        !kvt_store_save(st, sa, k, "manual", NULL) && !kvt_session_new(&sb, b, &so))
        (void)kvt_store_restore_prefix(st, sb, t, k, &reused);
    kvt_session_free(sa);
    kvt_session_free(sb);
    kvt_store_close(st);
    return reused;
}

TEST(qwen35_mtp_rows)
{
    for (int i = 0; i < 2; i++) {
        char dir[] = "/tmp/kvt-q35mtp-XXXXXX", path[256], sdir[300];
        if (!kvt_test_mkdtemp(dir)) { CHECKF(0, "mkdtemp: %s", strerror(errno)); return; }
        if (!write_q35(&q35[i], true, dir, path, sizeof path)) { rm_dir(dir); return; }
        kvt_model *m = open_q35(path, true), *off = open_q35(path, false);
        if (!m || !off) { kvt_model_close(m); kvt_model_close(off); rm_dir(dir); return; }
        kvt_plan p;
        CHECK_OK(kvt_model_plan(m, 512, &p));
        uint64_t mrow = 2 * 2 * FAM_KV_HEADS * FAM_Q35_HEAD_DIM; /* K and V, f16 */
        CHECKF(kvt_plan_bytes(&p, "mtp rows") == 512 * mrow, "%s: the plan's mtp rows: %llu B", q35[i].arch,
               (unsigned long long)kvt_plan_bytes(&p, "mtp rows"));
        int32_t t[N], u[N];
        fam_prompt(t, N, 3);
        fam_prompt(u, N, 4);
        uint64_t want = run_with(m, t, N, 0, 1), want_u = run_with(m, u, N, 0, 1);
        CHECKF(want != run_with(off, t, N, 0, 1), "%s: the rows kept left the cache as without them", q35[i].arch);
        uint64_t c1 = run_with(m, t, N, 1, 1), c7 = run_with(m, t, N, 7, 1), t2 = run_with(m, t, N, 7, 2);
        uint64_t ba = 0, bb = 0;
        bool bok = batched(m, t, u, N, &ba, &bb);
        printf("    %s, rows kept: chunks 256 %016llx, 1 %016llx, 7 %016llx, 7 on 2 threads %016llx, batched %s\n",
               q35[i].arch, (unsigned long long)want, (unsigned long long)c1, (unsigned long long)c7,
               (unsigned long long)t2, bok && ba == want && bb == want_u ? "same" : "DIFFERENT");
        CHECKF(c1 == want && c7 == want && t2 == want, "%s: the rows depend on the chunks or threads", q35[i].arch);
        CHECKF(bok && ba == want && bb == want_u, "%s: batched differs from alone", q35[i].arch);
        static const size_t at[] = {1, 127, 128, 200};
        size_t good = 0, bad = 0;
        for (size_t j = 0; j < sizeof at / sizeof *at; j++) good += restored(m, t, N, at[j], want);
        kvt_llama_fault = KVT_LLAMA_FAULT_MTP_PENDING;
        for (size_t j = 0; j < sizeof at / sizeof *at; j++) bad += !restored(m, t, N, at[j], want);
        kvt_llama_fault = KVT_LLAMA_FAULT_NONE;
        printf("    %s: restored and run on: %zu of 4 exact; with KVT_LLAMA_FAULT_MTP_PENDING %zu of 4 differ\n",
               q35[i].arch, good, bad);
        CHECKF(good == 4, "%s: a snapshot restored and run on differs", q35[i].arch);
        CHECKF(bad == 4, "%s: the h_nextn left out of the restore went unseen", q35[i].arch);
        /* records: with the rows for the model with them, a miss across */
        size_t same = 0, across = 0, back = 0;
        snprintf(sdir, sizeof sdir, "%s/s1", dir);
        if (!mkdir(sdir, 0700)) same = store_reuse(m, m, t, 256, sdir);
        snprintf(sdir, sizeof sdir, "%s/s2", dir);
        if (!mkdir(sdir, 0700)) across = store_reuse(m, off, t, 256, sdir);
        snprintf(sdir, sizeof sdir, "%s/s3", dir);
        if (!mkdir(sdir, 0700)) back = store_reuse(off, m, t, 256, sdir);
        printf("    %s: a record of 256 tokens: reused %zu by the same model, %zu without the rows, %zu the reverse\n",
               q35[i].arch, same, across, back);
        CHECKF(same == 256 && across == 0 && back == 0, "%s: records with and without the rows met", q35[i].arch);
        kvt_model_close(m);
        kvt_model_close(off);
        rm_dir(dir);
    }
}

/* ---- the f64 reference of the layer (llama.cpp's qwen35 graph_mtp) ---- */

enum { D = FAM_DIM, HD = FAM_Q35_HEAD_DIM, NH = FAM_HEADS, NKV = FAM_KV_HEADS, KVD = NKV * HD, ROT = FAM_Q35_ROT,
       P = 24 };

static const float *ten(const kvt_gguf *g, const char *name)
{
    const kvt_gguf_tensor *t = kvt_gguf_find_tensor(g, name);
    return t && t->type == KVT_GGML_F32 ? t->data : NULL;
}

static void rms(double *out, const double *x, const float *w, size_t n)
{
    double ss = 0;
    for (size_t i = 0; i < n; i++) ss += x[i] * x[i];
    double r = 1.0 / sqrt(ss / (double)n + FAM_EPS);
    for (size_t i = 0; i < n; i++) out[i] = x[i] * r * (w ? w[i] : 1.0);
}

/* out (rows) = W (rows, cols; row-major as GGUF's ne[0] = cols) . x */
static void mv(double *out, const float *w, const double *x, size_t cols, size_t rows)
{
    for (size_t r = 0; r < rows; r++) {
        double a = 0;
        for (size_t c = 0; c < cols; c++) a += (double)w[r * cols + c] * x[c];
        out[r] = a;
    }
}

/* NEOX RoPE of one head over its first ROT dims at pos (every pair turns:
 * the synthetic file's sections [3, 3, 2, 0] cover the 8 pairs). */
static void rope(double *v, size_t pos)
{
    for (size_t i = 0; i < ROT / 2; i++) {
        double ang = (double)pos * pow(FAM_ROPE_BASE, -2.0 * (double)i / ROT), c = cos(ang), s = sin(ang);
        double a = v[i], b = v[i + ROT / 2];
        v[i] = a * c - b * s;
        v[i + ROT / 2] = a * s + b * c;
    }
}

/* The layer's rows of positions 0..P from tokens t and hidden inputs h
 * ((P + 1, D): row q's h_nextn of q - 1), then its logits at P into lg (V).
 * swap: [h, e] rather than [e, h] (a control). */
static bool ref_layer(const kvt_gguf *g, const int32_t *t, const double *h, bool swap, double *lg, size_t V)
{
    const char *nm[] = {"token_embd.weight", "output.weight", "blk.8.nextn.eh_proj.weight", "blk.8.nextn.enorm.weight",
                        "blk.8.nextn.hnorm.weight", "blk.8.attn_norm.weight", "blk.8.attn_q.weight",
                        "blk.8.attn_k.weight", "blk.8.attn_v.weight", "blk.8.attn_q_norm.weight",
                        "blk.8.attn_k_norm.weight", "blk.8.attn_output.weight", "blk.8.post_attention_norm.weight",
                        "blk.8.ffn_gate.weight", "blk.8.ffn_up.weight", "blk.8.ffn_down.weight",
                        "blk.8.nextn.shared_head_norm.weight"};
    const float *w[17];
    for (int i = 0; i < 17; i++)
        if (!(w[i] = ten(g, nm[i]))) return false;
    static double K[P + 1][KVD], Vr[P + 1][KVD];
    double cat[2 * D], x[D], xn[D], qf[2 * NH * HD], q[NH * HD], o[NH * HD], a[D], f1[FAM_FFN], f3[FAM_FFN], hn[D];
    for (size_t p = 0; p <= P; p++) {
        double e[D];
        for (size_t j = 0; j < D; j++) e[j] = w[0][(size_t)t[p] * D + j];
        rms(cat + (swap ? D : 0), e, w[3], D);
        rms(cat + (swap ? 0 : D), h + p * D, w[4], D);
        mv(x, w[2], cat, 2 * D, D);
        rms(xn, x, w[5], D);
        mv(K[p], w[7], xn, D, KVD);
        mv(Vr[p], w[8], xn, D, KVD);
        for (size_t k = 0; k < NKV; k++) {
            rms(K[p] + k * HD, K[p] + k * HD, w[10], HD);
            rope(K[p] + k * HD, p);
        }
    }
    /* position P's query (x, xn are its) */
    mv(qf, w[6], xn, D, 2 * NH * HD);
    for (size_t hh = 0; hh < NH; hh++) {
        rms(q + hh * HD, qf + hh * 2 * HD, w[9], HD);
        rope(q + hh * HD, P);
        double sc[P + 1], mx = -INFINITY, z = 0;
        for (size_t j = 0; j <= P; j++) {
            double d = 0;
            for (size_t e = 0; e < HD; e++) d += q[hh * HD + e] * K[j][hh / (NH / NKV) * HD + e];
            sc[j] = d / sqrt((double)HD);
            mx = sc[j] > mx ? sc[j] : mx;
        }
        for (size_t j = 0; j <= P; j++) z += sc[j] = exp(sc[j] - mx);
        for (size_t e = 0; e < HD; e++) {
            double acc = 0;
            for (size_t j = 0; j <= P; j++) acc += sc[j] / z * Vr[j][hh / (NH / NKV) * HD + e];
            o[hh * HD + e] = acc / (1.0 + exp(-qf[hh * 2 * HD + HD + e]));
        }
    }
    mv(a, w[11], o, NH * HD, D);
    for (size_t j = 0; j < D; j++) x[j] += a[j];
    rms(xn, x, w[12], D);
    mv(f1, w[13], xn, D, FAM_FFN);
    mv(f3, w[14], xn, D, FAM_FFN);
    for (size_t j = 0; j < FAM_FFN; j++) f1[j] = f1[j] / (1.0 + exp(-f1[j])) * f3[j];
    mv(a, w[15], f1, FAM_FFN, D);
    for (size_t j = 0; j < D; j++) x[j] += a[j];
    rms(hn, x, w[16], D);
    mv(lg, w[1], hn, D, V);
    return true;
}

/* max |a - b| over max |b| */
static double rel_err(const float *a, const double *b, size_t n)
{
    double mx = 0, d = 0;
    for (size_t i = 0; i < n; i++) {
        mx = fabs(b[i]) > mx ? fabs(b[i]) : mx;
        d = fabs(a[i] - b[i]) > d ? fabs(a[i] - b[i]) : d;
    }
    return mx > 0 ? d / mx : INFINITY;
}

TEST(qwen35_mtp_reference)
{
    char dir[] = "/tmp/kvt-q35mtp-XXXXXX", path[256];
    if (!kvt_test_mkdtemp(dir)) { CHECKF(0, "mkdtemp: %s", strerror(errno)); return; }
    if (!write_q35(&q35[0], true, dir, path, sizeof path)) { rm_dir(dir); return; }
    kvt_model *m = open_q35(path, true);
    kvt_gguf *g = NULL;
    if (!m || kvt_gguf_open(&g, path)) { CHECKF(0, "opening %s", path); kvt_model_close(m); rm_dir(dir); return; }
    size_t V = m->info.n_vocab;
    int32_t t[P + 1];
    fam_prompt(t, P + 1, 9);
    double *h = calloc((P + 2) * D, sizeof *h), *lg = malloc(V * sizeof *lg), *lo = malloc(V * sizeof *lo);
    float *hf = malloc(D * sizeof *hf), *kl = malloc(V * sizeof *kl), *hout = malloc(D * sizeof *hout);
    const float *out = ten(g, "output.weight");
    kvt_session_opts so = {.n_ctx = 64, .n_threads = 1};
    kvt_session *s = NULL;
    bool ok = h && lg && lo && hf && kl && hout && out && !kvt_session_new(&s, m, &so);
    double worst_h = 0;
    /* h[q]: the session's h_nextn of q - 1, which the model's logits after
     * q tokens are the output head of */
    for (size_t q = 1; ok && q <= P; q++) {
        ok = !kvt_session_sync(s, t, q, NULL) && m->arch->mtp->hidden(s, q - 1, hf) == KVT_OK &&
             m->arch->mtp->hidden(s, q - 2 + (q < 2), hf + 0) == (q < 2 ? KVT_OK : KVT_ENOENT);
        ok = ok && m->arch->mtp->hidden(s, q - 1, hf) == KVT_OK;
        for (size_t j = 0; ok && j < D; j++) h[q * D + j] = hf[j];
        double hl[D];
        memcpy(hl, h + q * D, sizeof hl);
        mv(lo, out, hl, D, V);
        double e = rel_err(kvt_session_logits(s), lo, V);
        worst_h = e > worst_h ? e : worst_h;
    }
    CHECKF(ok, "the session's hidden states: %s", kvt_errmsg());
    /* the layer's step at P, on the session's rows of 0..P - 1 */
    size_t rb = m->arch->mtp->ring_bytes(m);
    uint16_t *ring = calloc(1, rb);
    ok = ok && ring && !kvt_session_work(s) &&
         m->arch->mtp->step(s, ring, hf, t[P], P, false, hout, kl) == KVT_OK;
    CHECKF(ok, "the layer's step: %s", kvt_errmsg());
    double e = INFINITY, e_swap = 0, e_late = 0;
    if (ok && ref_layer(g, t, h, false, lg, V)) e = rel_err(kl, lg, V);
    if (ok && ref_layer(g, t, h, true, lg, V)) e_swap = rel_err(kl, lg, V);
    /* each row's h one position late: h of q - 2 */
    double *late = calloc((P + 1) * D, sizeof *late);
    if (late) memcpy(late + 2 * D, h + D, (P - 1) * D * sizeof *late);
    if (ok && late && ref_layer(g, t, late, false, lg, V)) e_late = rel_err(kl, lg, V);
    printf("    the model's logits against output . h_nextn: %.2g of max |logit|; the layer's step at %d against "
           "the f64 reference: %.2g; controls: [h, e] %.2g, h one position late %.2g\n",
           worst_h, P, e, e_swap, e_late);
    CHECKF(worst_h < 1e-4, "the kept hidden state is not output_norm of the residual (%.3g)", worst_h);
    CHECKF(e < 1e-4, "the MTP layer differs from the reference by %.3g of max |logit|", e);
    CHECKF(e_swap > 1e-2 && e_late > 1e-2, "the controls stay within the tolerance: %.3g, %.3g", e_swap, e_late);
    free(late);
    free(ring);
    free(h);
    free(lg);
    free(lo);
    free(hf);
    free(kl);
    free(hout);
    kvt_session_free(s);
    kvt_gguf_close(g);
    kvt_model_close(m);
    rm_dir(dir);
}

/* kvtier with args (argv[0] added), stdout and stderr read back: the exit
 * status (-1: it did not exit). */
static int cli(const char *const *args, char **out, char **err)
{
    const char *argv[32] = {kvt_test_bin()};
    size_t n = 1;
    for (size_t i = 0; args[i] && n + 1 < sizeof argv / sizeof *argv; i++) argv[n++] = args[i];
    argv[n] = NULL;
    char po[] = "/tmp/kvt-q35cli-out-XXXXXX", pe[] = "/tmp/kvt-q35cli-err-XXXXXX";
    int fo = mkstemp(po), fe = mkstemp(pe), st = -1;
    if (fo >= 0) close(fo);
    if (fe >= 0) close(fe);
    int rc = fx_run_split(argv, po, pe, 120, &st);
    *out = kvt_test_read_file(po, NULL);
    *err = kvt_test_read_file(pe, NULL);
    unlink(po);
    unlink(pe);
    return rc == 1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

TEST(qwen35_mtp_cli)
{
    char dir[] = "/tmp/kvt-q35mtp-XXXXXX", path[256], plain[256];
    if (!kvt_test_mkdtemp(dir)) { CHECKF(0, "mkdtemp: %s", strerror(errno)); return; }
    if (!write_q35(&q35[0], true, dir, path, sizeof path) || !write_q35(&q35[0], false, dir, plain, sizeof plain)) {
        rm_dir(dir);
        return;
    }
    static const char *const temps[] = {"0", "0.7"};
    for (int t = 0; t < 2; t++) {
        char *out[2], *err[2];
        int st[2];
        for (int d = 0; d < 2; d++) {
            const char *const a[] = {"run", "--model", path, "--no-kv-disk", "--threads", "1", "--prompt",
                                     "one two three one two three one two three", "--output", "ids", "--max-tokens",
                                     "24", "--temperature", temps[t], "--top-k", "3", "--seed", "5", "--draft",
                                     d ? "mtp" : "none", NULL};
            st[d] = cli(a, &out[d], &err[d]);
        }
        bool eq = st[0] == 0 && st[1] == 0 && out[0] && out[1] && !strcmp(out[0], out[1]);
        printf("    run --draft mtp, temperature %s: %s; %s", temps[t], eq ? "the ids of --draft none" : "DIFFERENT",
               err[1] ? err[1] : "\n");
        CHECKF(eq, "run --draft mtp changed the reply (or a run failed: %d %d)", st[0], st[1]);
        CHECKF(err[1] && strstr(err[1], " drafted"), "run --draft mtp: no line on what it drafted");
        for (int d = 0; d < 2; d++) {
            free(out[d]);
            free(err[d]);
        }
    }
    char *o1 = NULL, *e1 = NULL, *o2 = NULL, *e2 = NULL, *o3 = NULL, *e3 = NULL;
    const char *const i1[] = {"info", "--model", path, "--ctx", "512", "--draft", "mtp", NULL};
    const char *const i2[] = {"info", "--model", path, "--ctx", "512", NULL};
    const char *const r3[] = {"run", "--model", plain, "--no-kv-disk", "--prompt", "a", "--max-tokens", "2",
                              "--draft", "mtp", NULL};
    int s1 = cli(i1, &o1, &e1), s2 = cli(i2, &o2, &e2), s3 = cli(r3, &o3, &e3);
    bool listed = s1 == 0 && o1 && strstr(o1, "mtp rows 262144"), unlisted = s2 == 0 && o2 && !strstr(o2, "mtp rows");
    printf("    info --draft mtp lists the rows: %s; info alone: %s; --draft mtp without the layer: exit %d: %s",
           listed ? "yes" : "NO", unlisted ? "not" : "LISTED", s3, e3 ? e3 : "\n");
    CHECKF(listed && unlisted, "info: the plan's mtp rows (exit %d, %d)", s1, s2);
    CHECKF(s3 == 2 && e3 && strstr(e3, "no MTP"), "run --draft mtp on a file without the layer: want exit 2");
    free(o1);
    free(e1);
    free(o2);
    free(e2);
    free(o3);
    free(e3);
    rm_dir(dir);
}
