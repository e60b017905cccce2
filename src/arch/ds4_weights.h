/* The ds4 architecture's weights (ds4_weights.c), shared by the file that
 * makes, reads and writes them and the one that runs them (ds4.c): the
 * configuration, each layer's tensors and the model's, and the tensor
 * table that lists them. Not part of the public API. */
#ifndef KVT_DS4_WEIGHTS_H
#define KVT_DS4_WEIGHTS_H

#include "arch/arch.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_LAYERS 64
#define HC 4 /* hyper-connection streams (llama.cpp supports 4 only) */
#define HC_MIX ((2 + HC) * HC)

enum { SCALE_NONE, SCALE_LINEAR, SCALE_YARN };

typedef struct ds4_config {
    uint32_t V, D, L, H, Dh, Dr, Rq, W, Hi, Di, K, ctx;
    uint32_t E, Eu, Es, Fe, iters, n_hash, og, orank, nextn, yarn_orig;
    uint32_t scaling;           /* compressed layers' RoPE scaling: SCALE_NONE, _LINEAR (by 1/factor), _YARN */
    float eps, hc_eps, base, cbase, wscale, yarn_factor;
    bool wnorm;
    uint32_t ratio[MAX_LAYERS];
    float clamp_exp[MAX_LAYERS], clamp_sh[MAX_LAYERS];
} ds4_config;

/* The projection matrices are kvt_wmat: in the file's own type, in place in
 * the mapped file (a synthetic preset's f32 arrays, or a type kvtier only
 * dequantises, are owned copies), so a quantised file runs on the integer
 * kernels (src/kernels/qkernels.h) and resident memory stays that of the file. The
 * vectors, the hyper-connection mixes and the router stay f32 copies. */
typedef struct ds4_layer {
    float *attn_norm, *sinks;       /* (D), (H) */
    kvt_wmat wqa, wqb;              /* (Rq, D), (H*Dh, Rq) */
    float *q_norm;                  /* (Rq) */
    kvt_wmat wkv;                   /* (Dh, D) */
    float *kv_norm;                 /* (Dh) */
    kvt_wmat woa, wob;              /* (og*orank, H*Dh/og): group g's rows g*orank..; (D, og*orank) */
    float *hca_fn, *hca_base, *hca_scale; /* (24, 4D), (24), (3) */
    float *hcf_fn, *hcf_base, *hcf_scale;
    kvt_wmat c_kv, c_gate;          /* (c*Dh, D) x2; ratio > 0 */
    float *c_ape, *c_norm;          /* (r, c*Dh), (Dh) */
    kvt_wmat i_proj, i_qb;          /* (Hi, D), (Hi*Di, Rq); ratio 4 */
    kvt_wmat i_kv, i_gate;          /* (2*Di, D) x2 */
    float *i_ape, *i_norm;          /* (4, 2*Di), (Di) */
    float *ffn_norm, *gate_inp, *probs_b; /* (D), (E, D), (E) when not hash-routed */
    int32_t *tid2eid;               /* (V, Eu) when hash-routed */
    kvt_wmat gate_x, up_x, down_x;  /* (E*Fe, D), (E*Fe, D), (E*D, Fe): expert e's rows e*Fe.. (e*D..) */
    kvt_wmat gate_s, up_s, down_s;  /* (Es*Fe, D) x2, (D, Es*Fe) */
    kvt_wmat eh;                    /* the MTP layer's (D, 2D): [embedding, hidden] to the streams */
    float *enorm, *hnorm;           /* (D) x2, the MTP layer's */
    /* the MTP layer's optional own embedding and head (NULL data: the
     * model's): token rows, head norm, output, and (ds4.c's file) the
     * head's stream mixes */
    kvt_wmat emb, head;             /* (V, D) x2 */
    float *head_norm;               /* (D) */
    float *hh_fn, *hh_base, *hh_scale; /* (4, 4D), (4), (1) */
    /* cache geometry */
    int s_comp, s_idx;              /* stream ids (-1: none) */
    size_t off_win, off_cf, off_if; /* state offsets: window ring, frontiers */
} ds4_layer;

typedef struct ds4_weights {
    ds4_config c;
    uint64_t seed;
    kvt_wmat tok_embd, out;                 /* (V, D) x2 */
    float *out_norm;                        /* (D) */
    float *hch_fn, *hch_base, *hch_scale;   /* (4, 4D), (4), (1) */
    float **own;                            /* (n_own) the matrices' owned f32 arrays */
    size_t n_own;
    ds4_layer layers[MAX_LAYERS];
    kvt_gguf *mtp_file;                     /* a separate MTP file the layer borrows from (kvt_ds4_mtp_attach) */
    kvt_yarn yarn;                          /* compressed layers' RoPE */
    size_t n_streams, state_bytes, hd_idx;  /* hd_idx: the indexer's Hadamard order */
} ds4_weights;

/* ---- tensor table: one list drives generation, loading, writing ---- */

enum init { INIT_MAT, INIT_EMBED, INIT_SMALL, INIT_ONE, INIT_ZERO, INIT_ROUTE };

typedef struct tdesc {
    char name[56];
    uint32_t nd;
    uint64_t ne[3];             /* ne[0] = input (contiguous) width */
    enum init init;
    float **slot;               /* f32 tensors */
    kvt_wmat *mat;              /* matrices (ne[0] columns, ne[1] * ne[2] rows) */
    int32_t **islot;            /* the I32 routing table */
    uint8_t opt;                /* OPT_*: whether a file must have it */
} tdesc;

/* OPT_FILE: optional in either layout (llama.cpp's optional nextn
 * tensors); OPT_DS4C: read from ds4.c's separate MTP file only (llama.cpp's
 * layout has no such tensor: the model's is used). Optional tensors are
 * neither drawn nor written by the presets. */
enum { OPT_NO, OPT_FILE, OPT_DS4C };

#define MAX_TENSORS (8 + MAX_LAYERS * 37)

/* The tensors of w's configuration into t (room for MAX_TENSORS), in the
 * order the synthetic weights are drawn and the files are written; their
 * count. */
size_t kvt_ds4_tensors(ds4_weights *w, tdesc *t);

/* The configuration of a preset or a shape variant of one (docs/ds4.md,
 * "Shape variants"), without its vocabulary (V 0): false when there is no
 * such preset. */
bool kvt_ds4_preset_config(const char *name, ds4_config *c);
/* The configuration a file's header gives, with the loader's reading and
 * checks, without the weights. */
int kvt_ds4_header_config(const kvt_gguf *g, ds4_config *c);

/* m's weights (m->weights) and info from g, or a preset's synthetic weights
 * drawn from seed, with the tokenizer tok (m takes it on success); the row
 * (ds4.c) sets m->arch. */
int kvt_ds4_weights_load(kvt_model *m, const kvt_gguf *g);
int kvt_ds4_weights_preset(kvt_model *m, const char *preset, uint64_t seed, kvt_tokenizer *tok);
/* kvt_arch.weights_free and kvt_arch.fingerprint (the configuration and
 * every weight). */
void kvt_ds4_weights_free(void *w);
uint64_t kvt_ds4_weights_fingerprint(const void *w);

/* kvt_ds4_write_gguf, kvt_ds4_mtp_attach and kvt_ds4_mtp_write_ds4c
 * (ds4.h) for m, a ds4 model (those check it; for the last, one with an
 * MTP layer). */
int kvt_ds4_weights_write_gguf(const kvt_model *m, const char *path);
int kvt_ds4_weights_mtp_attach(kvt_model *m, kvt_gguf *g);
int kvt_ds4_weights_mtp_write(const kvt_model *m, const char *path);
/* Write a ds4 preset (also one too large to build in memory, such as
 * ds4-flash-bench) with its synthetic weights from seed and the tokenizer
 * tok as GGUF, streaming: the projection matrices stored as type (f32, f16
 * or q8_0, ggml's reference quantisers), the rest as the in-memory writer
 * stores it. With f32 the file equals kvt_ds4_write_gguf's of the same
 * preset byte for byte. Written to path.part.PID and renamed into place. */
int kvt_ds4_write_preset(const char *preset, uint64_t seed, const kvt_tokenizer *tok, uint32_t type,
                         const char *path);

/* Fault injection for the tests that must prove they catch such bugs. */
enum { KVT_DS4_FAULT_NONE, KVT_DS4_FAULT_MASK, KVT_DS4_FAULT_FRONTIER, KVT_DS4_FAULT_REPLAY, KVT_DS4_FAULT_YARN,
       KVT_DS4_FAULT_MTP_BIND, /* a separate MTP file's e_proj and h_proj bound to each other's place */
       KVT_DS4_FAULT_BATCH_POS /* a batched pass's later segments rotated as if they went on from the one
                                * before them in the pass */ };
extern int kvt_ds4_fault;

#endif
