/* What a run of a model needs in memory (kvtier info): the tensor data
 * mapped read-only from the file (and from a separate MTP file run with
 * it, ds4.c's: --draft mtp --model-draft), the KV cache at a context (the
 * architecture's plan, the same one its sessions' caches are sized by), a
 * session's scratch and arrays, and the machine's available memory. Not
 * part of the public API. */
#ifndef KVT_MEMORY_H
#define KVT_MEMORY_H

#include "kvtier.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVT_MEMORY_TYPES 64 /* ggml type ids counted (every type kvtier reads is below) */

typedef struct kvt_memory {
    uint64_t ctx;                        /* the context the figures are at */
    uint64_t mapped;                     /* tensor data in the file and in a separate MTP file (0: no file,
                                            a preset without one) */
    uint64_t mapped_type[KVT_MEMORY_TYPES]; /* of it, by ggml type */
    uint64_t mapped_mtp;                 /* of it, the separate MTP file's (0: none) */
    uint64_t n_tensors;
    kvt_plan kv;                         /* the KV cache at ctx tokens */
    bool scratch_known;                  /* false: not known from the header alone */
    bool scratch_measured;               /* on a session (else sized from the header) */
    uint64_t scratch;                    /* one session's scratch (kvt_session_scratch_bytes, or
                                            kvt_model_scratch_estimate from the header) */
    uint64_t arrays;                     /* one session's token ids and logits */
    uint64_t resident;                   /* kv.total + scratch + arrays */
    uint64_t available;                  /* MemAvailable (0: unknown) */
} kvt_memory;

/* The figures for a run at ctx tokens (0: the context a session takes by
 * default, the model's training context). m: the model opened from path
 * (its cache types set), whose plan is asked and whose scratch is measured
 * by making a session of that context and threads (0: a session's default;
 * the scratch has a part per thread) (its cache blocks are made only when
 * rows are written: none are); m NULL: path is described from its header
 * alone (kvt_model_describe), no tensor data read, and the scratch is
 * sized from it (kvt_model_scratch_estimate; not known when its
 * architecture needs the weights for that). path NULL or a preset: nothing mapped
 * from it. A separate MTP file attached to m (kvt_mtp_ops.file) is mapped
 * with it: its tensor data counts in mapped as path's does. */
int kvt_model_memory(const char *path, kvt_model *m, uint64_t ctx, uint32_t threads, kvt_memory *out);

/* Add the tensor data the header of mtp_path declares (a separate MTP
 * file run with the model: --draft mtp --model-draft) to out's mapped
 * counts, as kvt_model_memory counts one attached to the model; for a
 * model described from its header, which has none attached. */
int kvt_memory_add_mtp(kvt_memory *out, const char *mtp_path);

/* The line run, serve and info print when the mapped weights are larger
 * than the available memory: the run goes on, its pages read from the file
 * as they are needed, slowly. Written into buf (n bytes); false, and buf
 * empty, when the weights fit or the available memory is unknown. */
bool kvt_memory_note(const kvt_memory *mm, char *buf, size_t n);

/* The same from a file's header alone (its tensor data, as mapped, and
 * MemAvailable; nothing else of kvt_model_memory is computed): what run,
 * serve and bench say at start. mtp_path: a separate MTP file run with it
 * (--draft mtp --model-draft; NULL: none), whose tensor data is mapped
 * too and counts with path's (one that cannot be read: path's alone;
 * attaching it says why).
 * False when path is not a file (a preset), the available memory is
 * unknown or the header cannot be read (opening it says why). */
bool kvt_model_memory_note(const char *path, const char *mtp_path, char *buf, size_t n);

/* MemAvailable of /proc/meminfo in bytes; 0 when it cannot be read. */
uint64_t kvt_mem_available(void);

/* For tests: KVT_MEMORY_FAULT_DROP_PART leaves the plan's second part
 * (ds4: the compressed rows) out of the KV total, to show that the tests
 * of the figures catch a class missing from the sum; KVT_MEMORY_FAULT_NO_MTP
 * leaves a separate MTP file's tensor data out of mapped (the count before
 * it was counted), to show that the tests catch a file missing from it.
 * 0: none. */
enum { KVT_MEMORY_FAULT_DROP_PART = 1, KVT_MEMORY_FAULT_NO_MTP };
extern int kvt_memory_fault;

#endif
