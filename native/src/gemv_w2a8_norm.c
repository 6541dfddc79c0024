/* Public entry points of the input RMSNorm fused into the GEMVs around it: argument checks and
 * dispatch to cpu/gemv_w2a8_norm.c or cuda/gemv_w2a8.cu. */
#include <math.h>
#include <stdio.h>

#include "internal.h"

bitnet_status bitnet_norm_stats_slots(int32_t device, int64_t *slots) {
    BN_TRY(bn_check_device(device));
    BN_CHECK(slots != NULL, "bitnet_norm_stats_slots: slots is NULL");
    if (device == BITNET_DEVICE_CPU) {
        *slots = 1;
        return BITNET_OK;
    }
    return BN_CUDA(bn_cuda_norm_stats_slots(device, slots));
}

/* A stats array's slot count: positive, its bytes within int64. */
static bitnet_status check_slots(const char *fn, int64_t slots) {
    BN_CHECK(slots >= 1, "%s: slots must be positive, got %lld", fn, (long long)slots);
    char what[96];
    snprintf(what, sizeof what, "%s: stats", fn);
    return bn_check_size(what, slots, 8);
}

bitnet_status bitnet_gemv_w2a8_add_norm_stats(int32_t device, int32_t dtype,
                                              const uint8_t *w_packed, const float *w_scales,
                                              int64_t M, int64_t K, const int8_t *x_q,
                                              const float *x_scale, void *h,
                                              const void *norm_weight, float *stats,
                                              int64_t slots, void *stream) {
    static const char fn[] = "bitnet_gemv_w2a8_add_norm_stats";
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_activation_dtype(fn, device, dtype));
    BN_TRY(bn_check_ternary_shape(fn, "M", M, K));
    BN_TRY(check_slots(fn, slots));
    const int64_t size = bn_dtype_size(dtype);
    const bn_array arrays[] = {{"w_packed", w_packed, M * K / 4, 16, BN_READ},
                               {"w_scales", w_scales, M * 4, 4, BN_READ},
                               {"x_q", x_q, K, 16, BN_READ},
                               {"x_scale", x_scale, 4, 4, BN_READ},
                               {"h", h, M * size, size, BN_WRITTEN},
                               {"norm_weight", norm_weight, M * size, size, BN_READ},
                               {"stats", stats, slots * 8, 8, BN_WRITTEN}};
    BN_CHECK_ARRAYS(fn, device, arrays, BN_NO_OVERLAP);
    if (device == BITNET_DEVICE_CPU)
        return bn_cpu_gemv_w2a8_add_norm_stats(dtype, w_packed, w_scales, M, K, x_q, x_scale, h,
                                               norm_weight, stats, slots);
    return BN_CUDA(bn_cuda_gemv_w2a8_add_norm_stats(device, dtype, w_packed, w_scales, M, K, x_q,
                                                    x_scale, h, norm_weight, stats, slots,
                                                    stream));
}

/* The checks of the normed input that both consumers take, the GPU kernel's limits included. */
static bitnet_status check_normed_input(const char *fn, int32_t device, int32_t dtype, int64_t K,
                                        int64_t slots, float eps) {
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_activation_dtype(fn, device, dtype));
    BN_CHECK(isfinite(eps) && eps > 0.0f, "%s: eps must be finite and > 0, got %g", fn,
             (double)eps);
    BN_TRY(check_slots(fn, slots));
    if (device == BITNET_DEVICE_CPU) return BITNET_OK;
    if (K > BN_CUDA_NORMED_MAX_K)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: K = %lld is over the CUDA kernel's limit for "
                       "a normed input (%d)", fn, (long long)K, BN_CUDA_NORMED_MAX_K);
    if (slots > BN_CUDA_NORMED_MAX_SLOTS)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: %lld stats slots are over the CUDA kernel's "
                       "limit (%d)", fn, (long long)slots, BN_CUDA_NORMED_MAX_SLOTS);
    return BITNET_OK;
}

bitnet_status bitnet_rmsnorm_gemv_w2a8(int32_t device, int32_t dtype, const void *h,
                                       const void *norm_weight, const float *stats,
                                       int64_t slots, float eps, const uint8_t *w_packed,
                                       const float *w_scales, int64_t M, int64_t K, void *y,
                                       int32_t y_dtype, void *stream) {
    static const char fn[] = "bitnet_rmsnorm_gemv_w2a8";
    BN_TRY(check_normed_input(fn, device, dtype, K, slots, eps));
    BN_CHECK(bn_dtype_size(y_dtype) != 0, "%s: y_dtype = %d is not a bitnet_dtype", fn, y_dtype);
    if (y_dtype != BITNET_DTYPE_I32) BN_TRY(bn_check_float_dtype(fn, "y_dtype", y_dtype));
    BN_TRY(bn_check_ternary_shape(fn, "M", M, K));
    const int64_t size = bn_dtype_size(dtype), y_size = bn_dtype_size(y_dtype);
    const bn_array arrays[] = {{"h", h, K * size, 16, BN_READ},
                               {"norm_weight", norm_weight, K * size, 16, BN_READ},
                               {"stats", stats, slots * 8, 8, BN_READ},
                               {"w_packed", w_packed, M * K / 4, 16, BN_READ},
                               {"w_scales", w_scales, M * 4, 4, BN_READ},
                               {"y", y, M * y_size, y_size, BN_WRITTEN}};
    BN_CHECK_ARRAYS(fn, device, arrays, BN_NO_OVERLAP);
    if (device == BITNET_DEVICE_CPU)
        return bn_cpu_rmsnorm_gemv_w2a8(dtype, h, norm_weight, stats, slots, eps, w_packed,
                                        w_scales, M, K, y, y_dtype);
    return BN_CUDA(bn_cuda_rmsnorm_gemv_w2a8(device, dtype, h, norm_weight, stats, slots, eps,
                                             w_packed, w_scales, M, K, y, y_dtype, stream));
}

bitnet_status bitnet_rmsnorm_gemv_w2a8_rope_append_kv(
    int32_t device, int32_t dtype, const void *h, const void *norm_weight, const float *stats,
    int64_t slots, float eps, const uint8_t *w_packed, const float *w_scales, int64_t K,
    int64_t Hq, int64_t Hkv, int64_t D, void *q, void *k_cache, void *v_cache, int64_t C,
    const int32_t *position, float theta, void *stream) {
    static const char fn[] = "bitnet_rmsnorm_gemv_w2a8_rope_append_kv";
    BN_TRY(check_normed_input(fn, device, dtype, K, slots, eps));
    BN_TRY(bn_check_qkv_rope(fn, K, Hq, Hkv, D, C, theta));
    const int64_t M = (Hq + 2 * Hkv) * D;
    const int64_t size = bn_dtype_size(dtype), cache = C * Hkv * D * size;
    BN_TRY(bn_check_size("bitnet_rmsnorm_gemv_w2a8_rope_append_kv: k_cache", C * Hkv * D, size));
    const bn_array arrays[] = {{"h", h, K * size, 16, BN_READ},
                               {"norm_weight", norm_weight, K * size, 16, BN_READ},
                               {"stats", stats, slots * 8, 8, BN_READ},
                               {"w_packed", w_packed, M * K / 4, 16, BN_READ},
                               {"w_scales", w_scales, M * 4, 4, BN_READ},
                               {"q", q, Hq * D * size, size, BN_WRITTEN},
                               {"k_cache", k_cache, cache, size, BN_WRITTEN},
                               {"v_cache", v_cache, cache, size, BN_WRITTEN},
                               {"position", position, 4, 4, BN_READ}};
    BN_CHECK_ARRAYS(fn, device, arrays, BN_NO_OVERLAP);
    if (device == BITNET_DEVICE_CPU) {
        BN_TRY(bn_check_cpu_position(fn, position, C));
        return bn_cpu_rmsnorm_gemv_w2a8_rope_append_kv(dtype, h, norm_weight, stats, slots, eps,
                                                       w_packed, w_scales, K, Hq, Hkv, D, q,
                                                       k_cache, v_cache, C, position, theta);
    }
    return BN_CUDA(bn_cuda_rmsnorm_gemv_w2a8_rope_append_kv(
        device, dtype, h, norm_weight, stats, slots, eps, w_packed, w_scales, K, Hq, Hkv, D, q,
        k_cache, v_cache, C, position, theta, stream));
}
