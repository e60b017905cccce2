/* The instruction sets the kernels come in, and the one they run on.
 *
 * Each kernel file keeps one static const table of function pointers per
 * instruction set (scalar, AVX2 with FMA and F16C, AVX-512 F/BW/VL on top of
 * those) and calls through the row of kvt_cpu_isa(). That is chosen once:
 * the CPU is asked at first use (cpuid, and the OS's consent to save the
 * vector state), and the answer is kept in an atomic, so worker threads read
 * it without a race. The force switches below lower it for tests, which run
 * every path and compare the bits; they are not meant to be flipped while
 * kernels run on other threads (a call reads the table once at its start).
 * Every path gives the same bits (kernels.h, qkernels.h). */
#ifndef KVT_CPU_H
#define KVT_CPU_H

#include <stdatomic.h>
#include <stdbool.h>

typedef enum kvt_isa {
    KVT_ISA_SCALAR, /* portable C (fmaf); the only one off x86 */
    KVT_ISA_AVX2,   /* AVX2, FMA, F16C */
    KVT_ISA_AVX512, /* AVX2's kernels, some with larger tiles in AVX-512 F/BW/VL (32 vector registers) */
    KVT_ISA_COUNT
} kvt_isa;

/* The choice, -1 before the first call; read it through kvt_cpu_isa. */
extern atomic_int kvt_cpu_chosen;
/* Makes the choice (at the first call) and returns it. */
kvt_isa kvt_cpu_choose(void);
/* The instruction set the kernels use: the CPU's best, lowered by the
 * force switches. One atomic load after the first call (inline: the
 * kernels ask for it at every call, kvt_expf on each element). */
static inline kvt_isa kvt_cpu_isa(void)
{
    int isa = atomic_load_explicit(&kvt_cpu_chosen, memory_order_acquire);
    return isa >= 0 ? (kvt_isa)isa : kvt_cpu_choose();
}

/* The instruction set in use as KVT_ISA spells it: "scalar", "avx2",
 * "avx512". The environment variable KVT_ISA, read at the first choice,
 * caps the choice at the set it names (benchmarks compare the paths). */
const char *kvt_cpu_isa_name(void);

/* Force the scalar kernels (tests); returns the previous setting. */
bool kvt_kernels_force_scalar(bool on);
/* True when the AVX2/FMA kernels (or the AVX-512 ones) are in use. */
bool kvt_kernels_simd(void);
/* Force the AVX-512 kernels off, leaving AVX2's (tests): the same bits.
 * Returns the previous setting. */
bool kvt_kernels_force_avx2(bool on);
/* True when the AVX-512 kernels are in use. */
bool kvt_kernels_avx512(void);
/* True when the AVX-512 kernels are in use and the CPU has AVX-512 VNNI
 * (vpdpbusd, vpdpwssd), which the low-bit prefill's panels use. Cleared by
 * the switch below or by the environment variable KVT_VNNI=0 (benchmarks
 * compare the two); one atomic load. */
bool kvt_cpu_vnni(void);
/* Keep the AVX-512 kernels but not their VNNI ones (tests): the same bits.
 * Returns the previous setting. */
bool kvt_kernels_force_novnni(bool on);

/* How far ahead of itself a decode kernel prefetches its weight stream
 * (rows read one after the other, or packed), in bytes. The hardware's
 * prefetchers alone kept one Q4_K stream at 21 GB/s (1 thread, Zen 5)
 * where it ran at 37 from the cache; 7 KiB ahead, 27 to 33 (4 KiB: 24 to
 * 31, 12 KiB: 26). */
#define KVT_PF_AHEAD 7168

#endif
