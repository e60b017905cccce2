/* CPU detection and the choice of the kernels' instruction set (cpu.h). */
#include "kernels/cpu.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

/* The OS saves the vector state of these XCR0 bits. */
static bool os_saves(unsigned bits)
{
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    return (lo & bits) == bits;
}

/* AVX2, FMA and F16C from cpuid, with the OS's consent to the AVX state
 * (OSXSAVE, XCR0 bits 1-2); then AVX-512 F, BW and VL, with the OS saving
 * the opmask and upper registers (XCR0 bits 5-7). Read directly rather than
 * through __builtin_cpu_supports, whose feature strings differ between
 * compilers (clang 14 has no "f16c"). */
static kvt_isa detect_isa(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1) || !os_saves(6)) return KVT_ISA_SCALAR;
    bool fma = c >> 12 & 1, f16c = c >> 29 & 1;
    if (!fma || !f16c || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b >> 5 & 1)) return KVT_ISA_SCALAR;
    if (!(b >> 16 & 1) || !(b >> 30 & 1) || !(b >> 31 & 1) || !os_saves(0xe6)) return KVT_ISA_AVX2;
    return KVT_ISA_AVX512;
}

/* AVX-512 VNNI: cpuid leaf 7, ecx bit 11 (asked only once AVX-512 is in). */
static bool detect_vnni(void)
{
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c >> 11 & 1);
}
#else
static kvt_isa detect_isa(void) { return KVT_ISA_SCALAR; }
static bool detect_vnni(void) { return false; }
#endif

/* KVT_ISA (scalar, avx2 or avx512) caps the choice at that instruction
 * set: a benchmark compares the paths on one machine, every path giving
 * the same bits. It never raises the choice above what the CPU has; any
 * other value is ignored. */
static kvt_isa env_cap(kvt_isa isa)
{
    const char *e = getenv("KVT_ISA");
    static const char *const names[KVT_ISA_COUNT] = {"scalar", "avx2", "avx512"};
    for (int i = 0; e && i < KVT_ISA_COUNT; i++)
        if (!strcmp(e, names[i])) return (kvt_isa)i < isa ? (kvt_isa)i : isa;
    return isa;
}

static pthread_once_t detect_once = PTHREAD_ONCE_INIT;
static kvt_isa detected;
static bool detected_vnni;
static void detect(void)
{
    const char *e = getenv("KVT_VNNI");
    detected = env_cap(detect_isa());
    detected_vnni = detected == KVT_ISA_AVX512 && detect_vnni() && !(e && !strcmp(e, "0"));
}

/* The choice: -1 until the first call; written under lock, read without. */
atomic_int kvt_cpu_chosen = -1;
static atomic_bool vnni_chosen;
static pthread_mutex_t choose_lock = PTHREAD_MUTEX_INITIALIZER;
static bool forced_scalar, forced_avx2, forced_novnni; /* under choose_lock */

/* Sets kvt_cpu_chosen from the CPU and the switches; choose_lock held. */
static kvt_isa choose(void)
{
    pthread_once(&detect_once, detect);
    kvt_isa isa = detected;
    if (forced_avx2 && isa > KVT_ISA_AVX2) isa = KVT_ISA_AVX2;
    if (forced_scalar) isa = KVT_ISA_SCALAR;
    atomic_store_explicit(&vnni_chosen, isa == KVT_ISA_AVX512 && detected_vnni && !forced_novnni, memory_order_relaxed);
    atomic_store_explicit(&kvt_cpu_chosen, (int)isa, memory_order_release);
    return isa;
}

kvt_isa kvt_cpu_choose(void)
{
    pthread_mutex_lock(&choose_lock);
    kvt_isa r = choose();
    pthread_mutex_unlock(&choose_lock);
    return r;
}

static bool force(bool *flag, bool on)
{
    pthread_mutex_lock(&choose_lock);
    bool old = *flag;
    *flag = on;
    choose();
    pthread_mutex_unlock(&choose_lock);
    return old;
}

bool kvt_kernels_force_scalar(bool on) { return force(&forced_scalar, on); }
bool kvt_kernels_force_avx2(bool on) { return force(&forced_avx2, on); }
bool kvt_kernels_simd(void) { return kvt_cpu_isa() >= KVT_ISA_AVX2; }
bool kvt_kernels_avx512(void) { return kvt_cpu_isa() == KVT_ISA_AVX512; }
bool kvt_kernels_force_novnni(bool on) { return force(&forced_novnni, on); }

bool kvt_cpu_vnni(void)
{
    kvt_cpu_isa(); /* the choice made (an acquire: vnni_chosen was stored before it) */
    return atomic_load_explicit(&vnni_chosen, memory_order_relaxed);
}

const char *kvt_cpu_isa_name(void)
{
    static const char *const names[KVT_ISA_COUNT] = {"scalar", "avx2", "avx512"};
    return names[kvt_cpu_isa()];
}
