/* bitnet_rmsnorm_gemv_w2a8: argument checks, then the CPU or CUDA backend. */
#include <math.h>

#include "internal.h"

bitnet_status bitnet_rmsnorm_gemv_w2a8(int32_t device, int32_t dtype, int64_t T, int64_t K,
                                       const void *x, int32_t gated, const void *weight, float eps,
                                       const uint8_t *w_packed, const float *w_scales, int64_t M,
                                       const void *residual, void *y, int32_t y_dtype,
                                       void *stream) {
    const char *fn = "bitnet_rmsnorm_gemv_w2a8";
    BN_TRY(bn_check_device(device));
    BN_CHECK(dtype == BITNET_DTYPE_F32 || dtype == BITNET_DTYPE_F16 || dtype == BITNET_DTYPE_BF16,
             "%s: dtype %d (%s) is not float32, float16 or bfloat16", fn, dtype,
             bn_dtype_name(dtype));
    BN_CHECK(gated == 0 || gated == 1, "%s: gated must be 0 or 1, got %d", fn, gated);
    BN_CHECK(bn_dtype_size(y_dtype) != 0, "%s: y_dtype = %d is not a bitnet_dtype", fn, y_dtype);
    if (y_dtype != BITNET_DTYPE_I32) BN_TRY(bn_check_float_dtype(fn, "y_dtype", y_dtype));
    BN_CHECK(!residual || y_dtype != BITNET_DTYPE_I32,
             "%s: a residual needs a float y_dtype (its dtype), got int32", fn);
    BN_TRY(bn_check_ternary_shape(fn, "M", M, K));
    BN_CHECK(T >= 1, "%s: T must be at least 1, got %lld", fn, (long long)T);
    const int64_t size = bn_dtype_size(dtype), y_size = bn_dtype_size(y_dtype);
    BN_TRY(bn_check_size("bitnet_rmsnorm_gemv_w2a8: x", T, K * (gated ? 2 : 1)));
    BN_TRY(bn_check_size("bitnet_rmsnorm_gemv_w2a8: x", T * K * (gated ? 2 : 1), size));
    BN_TRY(bn_check_size("bitnet_rmsnorm_gemv_w2a8: y", T, M));
    BN_TRY(bn_check_size("bitnet_rmsnorm_gemv_w2a8: y", T * M, y_size));
    BN_CHECK(isfinite(eps) && eps >= 0.0f, "%s: eps must be finite and >= 0, got %g", fn,
             (double)eps);
    const bn_array arrays[] = {
        {gated ? "gate_up" : "x", x, T * K * (gated ? 2 : 1) * size, size, BN_READ},
        {"weight", weight, K * size, size, BN_READ},
        {"w_packed", w_packed, M * K / 4, 16, BN_READ},
        {"w_scales", w_scales, M * 4, 4, BN_READ},
        {"residual", residual, T * M * y_size, y_size, BN_READ | BN_OPTIONAL},
        {"y", y, T * M * y_size, y_size, BN_WRITTEN | BN_MAY_EQUAL(4)}};
    BN_CHECK_ARRAYS(fn, device, arrays, "only y == residual, in place, is allowed");
    return device == BITNET_DEVICE_CPU
               ? bn_cpu_rmsnorm_gemv_w2a8(dtype, T, K, x, gated, weight, eps, w_packed, w_scales,
                                          M, residual, y, y_dtype)
               : BN_CUDA(bn_cuda_rmsnorm_gemv_w2a8(device, dtype, T, K, x, gated, weight, eps,
                                                   w_packed, w_scales, M, residual, y, y_dtype,
                                                   stream));
}
