/* Rows of float32, float16 and bfloat16 converted to float32 and back (round to nearest even), for
 * the CPU ops that work on float32 chunks. float16 takes F16C's conversions where bn_cpu_isa() is
 * above portable (its AVX2 level includes F16C), and otherwise the bit operations of internal.h,
 * which the compiler vectorizes: the same values either way (NaN payloads aside). A _Float16
 * conversion per element is a library call without F16C, 3-4x slower. */
#include <string.h>

#include "../internal.h"

__attribute__((target("f16c"))) static void f16_row_to_f32_f16c(const _Float16 *src, int64_t n,
                                                               float *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = (float)src[i];
}

__attribute__((target("f16c"))) static void f32_row_to_f16_f16c(const float *src, int64_t n,
                                                               _Float16 *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = (_Float16)src[i];
}

void bn_load_floats(int32_t dtype, const void *src, int64_t offset, int64_t n, float *dst) {
    const uint16_t *s = (const uint16_t *)src + offset;
    if (dtype == BITNET_DTYPE_F32) {
        memcpy(dst, (const float *)src + offset, (size_t)n * sizeof(float));
    } else if (dtype == BITNET_DTYPE_BF16) {
        for (int64_t i = 0; i < n; i++) dst[i] = bn_bf16_to_float(s[i]);
    } else if (bn_cpu_isa() != BN_ISA_PORTABLE) {
        f16_row_to_f32_f16c((const _Float16 *)src + offset, n, dst);
    } else {
        for (int64_t i = 0; i < n; i++) dst[i] = bn_f16_to_float(s[i]);
    }
}

void bn_store_floats(int32_t dtype, const float *src, int64_t n, void *dst, int64_t offset) {
    uint16_t *d = (uint16_t *)dst + offset;
    if (dtype == BITNET_DTYPE_F32) {
        memcpy((float *)dst + offset, src, (size_t)n * sizeof(float));
    } else if (dtype == BITNET_DTYPE_BF16) {
        for (int64_t i = 0; i < n; i++) d[i] = bn_float_to_bf16(src[i]);
    } else if (bn_cpu_isa() != BN_ISA_PORTABLE) {
        f32_row_to_f16_f16c(src, n, (_Float16 *)dst + offset);
    } else {
        for (int64_t i = 0; i < n; i++) d[i] = bn_float_to_f16(src[i]);
    }
}
