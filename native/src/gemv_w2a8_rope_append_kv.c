/* Public entry point of the QKV GEMV fused with RoPE and the KV-cache append: argument checks and
 * dispatch to cpu/gemv_w2a8_rope_append_kv.c or cuda/gemv_w2a8.cu. */
#include <math.h>

#include "internal.h"

bitnet_status bn_check_qkv_rope(const char *fn, int64_t K, int64_t Hq, int64_t Hkv, int64_t D,
                                int64_t C, float theta) {
    BN_CHECK(Hq > 0 && Hkv > 0 && D > 0 && C > 0,
             "%s: Hq, Hkv, D and C must be positive, got %lld, %lld, %lld, %lld", fn, (long long)Hq,
             (long long)Hkv, (long long)D, (long long)C);
    BN_CHECK(D % 4 == 0 && D <= 1024, "%s: head_dim D = %lld must be a multiple of 4 and at most "
             "1024", fn, (long long)D);
    BN_CHECK(Hq <= 65536 && Hkv <= 65536 && C <= INT32_MAX, "%s: Hq, Hkv or C too large", fn);
    BN_CHECK(C <= INT64_MAX / (Hkv * D), "%s: C * Hkv * D overflows", fn);
    BN_CHECK(isfinite(theta) && theta > 1.0f, "%s: theta must be finite and > 1, got %g", fn,
             (double)theta);
    return bn_check_ternary_shape(fn, "(Hq + 2 Hkv) * D", (Hq + 2 * Hkv) * D, K);
}

bitnet_status bitnet_gemv_w2a8_rope_append_kv(int32_t device, int32_t dtype,
                                              const uint8_t *w_packed, const float *w_scales,
                                              int64_t K, const int8_t *x_q, const float *x_scale,
                                              int64_t Hq, int64_t Hkv, int64_t D, void *q,
                                              void *k_cache, void *v_cache, int64_t C,
                                              const int32_t *position, float theta, void *stream) {
    static const char fn[] = "bitnet_gemv_w2a8_rope_append_kv";
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_activation_dtype(fn, device, dtype));
    BN_TRY(bn_check_qkv_rope(fn, K, Hq, Hkv, D, C, theta));
    const int64_t M = (Hq + 2 * Hkv) * D;
    const int64_t size = bn_dtype_size(dtype), cache = C * Hkv * D * size;
    BN_TRY(bn_check_size("bitnet_gemv_w2a8_rope_append_kv: k_cache", C * Hkv * D, size));
    const bn_array arrays[] = {{"w_packed", w_packed, M * K / 4, 16, BN_READ},
                               {"w_scales", w_scales, M * 4, 4, BN_READ},
                               {"x_q", x_q, K, 16, BN_READ},
                               {"x_scale", x_scale, 4, 4, BN_READ},
                               {"q", q, Hq * D * size, size, BN_WRITTEN},
                               {"k_cache", k_cache, cache, size, BN_WRITTEN},
                               {"v_cache", v_cache, cache, size, BN_WRITTEN},
                               {"position", position, 4, 4, BN_READ}};
    BN_CHECK_ARRAYS(fn, device, arrays, BN_NO_OVERLAP);
    if (device == BITNET_DEVICE_CPU) {
        BN_TRY(bn_check_cpu_position(fn, position, C));
        return bn_cpu_gemv_w2a8_rope_append_kv(dtype, w_packed, w_scales, K, x_q, x_scale, Hq, Hkv,
                                               D, q, k_cache, v_cache, C, position, theta);
    }
    return BN_CUDA(bn_cuda_gemv_w2a8_rope_append_kv(device, dtype, w_packed, w_scales, K, x_q,
                                                    x_scale, Hq, Hkv, D, q, k_cache, v_cache, C,
                                                    position, theta, stream));
}

bitnet_status bn_check_cpu_position(const char *fn, const int32_t *position, int64_t C) {
    BN_CHECK(*position >= 0 && *position < C, "%s: position = %d is outside the cache of C = %lld",
             fn, *position, (long long)C);
    return BITNET_OK;
}
