/* Public entry of the dense bfloat16 GEMV (the output head): checks, then the CPU or CUDA backend. */
#include "internal.h"

bitnet_status bitnet_gemv_bf16(int32_t device, const void *w, int64_t M, int64_t K, const void *x,
                               int32_t x_dtype, int64_t N, void *y, int32_t y_dtype, void *stream) {
    BN_TRY(bn_check_device(device));
    BN_CHECK(x_dtype == BITNET_DTYPE_F32 || x_dtype == BITNET_DTYPE_BF16,
             "gemv_bf16: x dtype must be float32 or bfloat16, got %s (%d)", bn_dtype_name(x_dtype),
             x_dtype);
    BN_CHECK(y_dtype == BITNET_DTYPE_F32 || y_dtype == BITNET_DTYPE_BF16,
             "gemv_bf16: y dtype must be float32 or bfloat16, got %s (%d)", bn_dtype_name(y_dtype),
             y_dtype);
    BN_TRY(bn_check_matrix("gemv_bf16: w", M, K, 2));
    const int64_t x_size = bn_dtype_size(x_dtype), y_size = bn_dtype_size(y_dtype);
    BN_TRY(bn_check_matrix("gemv_bf16: x", N, K, x_size));
    BN_TRY(bn_check_matrix("gemv_bf16: y", N, M, y_size));
    BN_CHECK(K % 8 == 0, "gemv_bf16: K must be a multiple of 8, got %lld", (long long)K);
    const bn_array arrays[] = {{"w", w, M * K * 2, 16, BN_READ},
                               {"x", x, N * K * x_size, 16, BN_READ},
                               {"y", y, N * M * y_size, y_size, BN_WRITTEN}};
    BN_CHECK_ARRAYS("gemv_bf16", device, arrays, BN_NO_OVERLAP);
    if (device == BITNET_DEVICE_CPU) return bn_cpu_gemv_bf16(w, M, K, x, x_dtype, N, y, y_dtype);
    return BN_CUDA(bn_cuda_gemv_bf16(device, w, M, K, x, x_dtype, N, y, y_dtype, stream));
}
