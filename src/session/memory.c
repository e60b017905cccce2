/* What a run of a model needs in memory (memory.h). */
#include "session/memory.h"
#include "arch/model.h"
#include "format/gguf.h"
#include "base/util.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

int kvt_memory_fault;

uint64_t kvt_mem_available(void)
{
    uint64_t kb = 0;
    if (!kvt_proc_kib("/proc/meminfo", "MemAvailable", &kb)) return 0;
    return kb > UINT64_MAX / 1024 ? 0 : kb * 1024;
}

/* The tensor data g (named path) declares, by type, added to out's counts
 * (all or, on an error, none of it); mtp: into mapped_mtp too. */
static int count_tensors(const kvt_gguf *g, const char *path, bool mtp, kvt_memory *out)
{
    if (mtp && kvt_memory_fault == KVT_MEMORY_FAULT_NO_MTP) return KVT_OK; /* tests: the MTP file left out */
    kvt_memory add = {0};
    for (size_t i = 0; i < kvt_gguf_n_tensors(g); i++) {
        const kvt_gguf_tensor *t = kvt_gguf_tensor_at(g, i);
        if (t->type >= KVT_MEMORY_TYPES)
            return kvt_fail(KVT_EFORMAT, "%s: tensor %zu has type %u, past the types kvtier reads", path, i, t->type);
        add.mapped += t->n_bytes;
        add.mapped_type[t->type] += t->n_bytes;
        add.n_tensors++;
    }
    out->mapped += add.mapped;
    if (mtp) out->mapped_mtp += add.mapped;
    for (size_t k = 0; k < KVT_MEMORY_TYPES; k++) out->mapped_type[k] += add.mapped_type[k];
    out->n_tensors += add.n_tensors;
    return KVT_OK;
}

/* The tensor data a file's header declares, by type (no data read). */
static int mapped_bytes(const char *path, bool mtp, kvt_memory *out)
{
    kvt_gguf *g = NULL;
    int rc = kvt_gguf_open_header(&g, path);
    if (rc) return rc;
    rc = count_tensors(g, path, mtp, out);
    kvt_gguf_close(g);
    return rc;
}

int kvt_memory_add_mtp(kvt_memory *out, const char *mtp_path) { return mapped_bytes(mtp_path, true, out); }

int kvt_model_memory(const char *path, kvt_model *m, uint64_t ctx, uint32_t threads, kvt_memory *out)
{
    memset(out, 0, sizeof *out);
    if (!m && !path) return kvt_fail(KVT_EINVAL, "memory: neither a model nor a file");
    int rc;
    kvt_model_info i;
    if (m) {
        kvt_model_info_get(m, &i);
        out->ctx = ctx ? ctx : i.n_ctx_train;
        if ((rc = kvt_model_plan(m, out->ctx, &out->kv))) return rc;
        /* the scratch a session of that context makes, measured */
        kvt_session *s = NULL;
        kvt_session_opts so = {.n_ctx = (uint32_t)out->ctx, .n_threads = threads};
        if (out->ctx > (1u << 24)) return kvt_fail(KVT_EINVAL, "context of %llu tokens is out of range",
                                                   (unsigned long long)out->ctx);
        if ((rc = kvt_session_new(&s, m, &so))) return rc;
        out->scratch = kvt_session_scratch_bytes(m, s->work);
        out->scratch_known = out->scratch_measured = true;
        kvt_session_free(s);
    } else {
        if ((rc = kvt_model_describe(path, 0, &i, NULL, 0, NULL))) return rc;
        out->ctx = ctx ? ctx : i.n_ctx_train;
        if ((rc = kvt_model_describe(path, out->ctx, &i, NULL, 0, &out->kv))) return rc;
        /* the scratch work_new would make, sized from the header; a pool of
         * threads, or of every online core as a session's default */
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        uint32_t parts = threads ? threads : cores > 0 ? (uint32_t)cores : 1;
        rc = kvt_model_scratch_estimate(path, out->ctx, parts, &out->scratch);
        if (rc && rc != KVT_ENOENT) return rc;
        out->scratch_known = rc == KVT_OK;
    }
    out->arrays = out->ctx * sizeof(int32_t) + (uint64_t)i.n_vocab * sizeof(float);
    if (path && access(path, R_OK) == 0 && (rc = mapped_bytes(path, false, out))) return rc;
    /* a separate MTP file attached to the model is mapped as its file is */
    const kvt_gguf *mf = m && m->arch && m->arch->mtp && m->arch->mtp->file ? m->arch->mtp->file(m) : NULL;
    if (mf && (rc = count_tensors(mf, "the MTP file", true, out))) return rc;
    if (kvt_memory_fault == KVT_MEMORY_FAULT_DROP_PART && out->kv.n_parts > 1)
        out->kv.total -= out->kv.part[1].bytes; /* tests: one entry class left out of the sum */
    out->resident = out->kv.total + out->scratch + out->arrays;
    out->available = kvt_mem_available();
    return KVT_OK;
}

bool kvt_memory_note(const kvt_memory *mm, char *buf, size_t n)
{
    if (n) buf[0] = 0;
    if (!mm->available || mm->mapped <= mm->available) return false;
    snprintf(buf, n,
             "the weights (%.2f GiB, mapped read-only) are larger than the available memory (%.2f GiB): "
             "the run goes on with their pages read from the file as they are needed, slowly",
             mm->mapped / 1073741824.0, mm->available / 1073741824.0);
    return true;
}

/* The note needs the two figures it compares only: the available memory
 * (read first: unknown, nothing else is read) and the tensor data the
 * header declares; not the plan, the scratch or the arrays. */
bool kvt_model_memory_note(const char *path, const char *mtp_path, char *buf, size_t n)
{
    if (n) buf[0] = 0;
    if (!path || access(path, R_OK) != 0) return false;
    kvt_memory mm = {.available = kvt_mem_available()};
    if (!mm.available) return false;
    if (mapped_bytes(path, false, &mm)) return false; /* opening it says why */
    if (mtp_path && access(mtp_path, R_OK) == 0) mapped_bytes(mtp_path, true, &mm); /* an error: attaching says why */
    return kvt_memory_note(&mm, buf, n);
}
