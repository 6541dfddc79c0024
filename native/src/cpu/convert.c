/* Rows of float32, float16 and bfloat16 converted to float32 and back (round to nearest even), for
 * the CPU ops that work on float32 chunks. float16 takes F16C's conversions where bn_cpu_isa() is
 * above portable (its AVX2 level includes F16C), and otherwise the bit operations below, which the
 * compiler vectorizes: the same values either way (NaN payloads aside). A per-element conversion
 * of _Float16 without F16C is a library call, 3-4x slower. */
#include <string.h>

#include "../internal.h"

static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static float bf16_to_f32(uint16_t h) { return float_of((uint32_t)h << 16); }

static uint16_t f32_to_bf16(float f) {
    uint32_t u = bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* round to nearest even */
}

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0x1f) return float_of(sign | 0x7f800000u | mantissa << 13);
    if (exponent == 0) return float_of(sign | bits_of((float)mantissa * 0x1p-24f));
    return float_of(sign | (exponent + 112) << 23 | mantissa << 13);
}

static uint16_t f32_to_f16(float f) {
    uint32_t u = bits_of(f), sign = (u >> 16) & 0x8000u, h;
    u &= 0x7fffffffu;
    if (u >= 0x47800000u) { /* |f| >= 65536: infinity, or NaN */
        h = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (u < 0x38800000u) {
        /* |f| < 2^-14, subnormal or zero: adding 0.5 leaves |f| in units of 2^-24 (the subnormal
         * step) in the low mantissa bits, rounded to nearest even by the addition itself. */
        h = bits_of(float_of(u) + 0.5f) - 0x3f000000u;
    } else {
        /* Rebias the exponent from 127 to 15 and round the 13 dropped bits to nearest even; a
         * carry into the exponent is the correct rounding, up to infinity above 65520. */
        h = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
    }
    return (uint16_t)(sign | h);
}

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
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else if (bn_cpu_isa() != BN_ISA_PORTABLE) {
        f16_row_to_f32_f16c((const _Float16 *)src + offset, n, dst);
    } else {
        for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32(s[i]);
    }
}

void bn_store_floats(int32_t dtype, const float *src, int64_t n, void *dst, int64_t offset) {
    uint16_t *d = (uint16_t *)dst + offset;
    if (dtype == BITNET_DTYPE_F32) {
        memcpy((float *)dst + offset, src, (size_t)n * sizeof(float));
    } else if (dtype == BITNET_DTYPE_BF16) {
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else if (bn_cpu_isa() != BN_ISA_PORTABLE) {
        f32_row_to_f16_f16c(src, n, (_Float16 *)dst + offset);
    } else {
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_f16(src[i]);
    }
}
