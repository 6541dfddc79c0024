/* The CPU path every CPU op takes: portable C, AVX2 (+ FMA, F16C) or AVX-512 VNNI, detected once
 * at run time (never by global -m flags) and forced by bitnet_cpu_set_isa (native/src/isa.c). Each op
 * compiles its SIMD copies with __attribute__((target(...))) and picks one by bn_cpu_isa(). */
#include "internal.h"

static int32_t chosen_isa = BN_ISA_AUTO;

int bn_cpu_isa_supported(int32_t isa) {
    switch (isa) {
    case BN_ISA_AUTO: case BN_ISA_PORTABLE: return 1;
    /* What the AVX2 code needs (attention.c's copy also uses FMA, convert.c's float16 rows F16C);
     * each level includes the one below, since the AVX-512 path runs that code too. */
    case BN_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    case BN_ISA_AVX512_VNNI:
        return bn_cpu_isa_supported(BN_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    default: return 0;
    }
}

void bn_cpu_set_isa(int32_t isa) { __atomic_store_n(&chosen_isa, isa, __ATOMIC_RELAXED); }

/* The best path this CPU runs, found once (bn_load_floats asks for every row). */
static int32_t detected_isa(void) {
    static int32_t detected = BN_ISA_AUTO;
    int32_t isa = __atomic_load_n(&detected, __ATOMIC_RELAXED);
    if (isa == BN_ISA_AUTO) {
        isa = bn_cpu_isa_supported(BN_ISA_AVX512_VNNI) ? BN_ISA_AVX512_VNNI
              : bn_cpu_isa_supported(BN_ISA_AVX2)      ? BN_ISA_AVX2
                                                       : BN_ISA_PORTABLE;
        __atomic_store_n(&detected, isa, __ATOMIC_RELAXED);
    }
    return isa;
}

int32_t bn_cpu_isa(void) {
    int32_t isa = __atomic_load_n(&chosen_isa, __ATOMIC_RELAXED);
    return isa != BN_ISA_AUTO ? isa : detected_isa();
}
