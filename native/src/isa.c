/* The public entry points of the CPU path choice (cpu/isa.c): bitnet_cpu_set_isa, bitnet_cpu_get_isa. */
#include "internal.h"

bitnet_status bitnet_cpu_set_isa(int32_t isa) {
    BN_CHECK(isa >= BN_ISA_AUTO && isa <= BN_ISA_AVX512_VNNI,
             "bitnet_cpu_set_isa: isa = %d is not 0 (auto), 1 (portable), 2 (avx2) or "
             "3 (avx512-vnni)", isa);
    if (!bn_cpu_isa_supported(isa))
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_cpu_set_isa: this CPU cannot run path %d "
                       "(%s)", isa, isa == BN_ISA_AVX2 ? "avx2" : "avx512-vnni");
    bn_cpu_set_isa(isa);
    return BITNET_OK;
}

bitnet_status bitnet_cpu_get_isa(int32_t *isa) {
    BN_CHECK(isa, "bitnet_cpu_get_isa: isa is NULL");
    *isa = bn_cpu_isa();
    return BITNET_OK;
}
