/* Public entry points of the W2A8 GEMV and its block-scaled form. The work is in
 * cpu/gemv_w2a8.c, cuda/gemv_w2a8.cu and cuda/gemv_w2a8_block_scaled.cu. */
#include <stdio.h>

#include "internal.h"

/* The checks of both entry points' sizes: M rows of K weights, N tokens, y of y_size bytes each. */
static bitnet_status check_sizes(const char *op, int64_t M, int64_t K, int64_t N, int64_t y_size) {
    BN_TRY(bn_check_ternary_shape(op, "M", M, K));
    BN_CHECK(N >= 1, "%s: N must be at least 1, got %lld", op, (long long)N);
    char x_q[96], y[96];
    snprintf(x_q, sizeof x_q, "%s: x_q", op);
    snprintf(y, sizeof y, "%s: y", op);
    BN_TRY(bn_check_size(x_q, N, K));
    BN_TRY(bn_check_size(y, N, M));
    return bn_check_size(y, N * M, y_size);
}

bitnet_status bitnet_gemv_w2a8(int32_t device, const uint8_t *w_packed, const float *w_scales,
                               int64_t M, int64_t K, const int8_t *x_q, const float *x_scales,
                               int64_t N, void *y, int32_t y_dtype, void *stream) {
    const char *op = "bitnet_gemv_w2a8";
    BN_TRY(bn_check_device(device));
    BN_CHECK(bn_dtype_size(y_dtype) != 0, "%s: y_dtype = %d is not a bitnet_dtype", op, y_dtype);
    if (y_dtype != BITNET_DTYPE_I32) BN_TRY(bn_check_float_dtype(op, "y_dtype", y_dtype));
    const int64_t y_size = bn_dtype_size(y_dtype);
    BN_TRY(check_sizes(op, M, K, N, y_size));
    const bn_array arrays[] = {{"w_packed", w_packed, M * K / 4, 16, BN_READ},
                               {"w_scales", w_scales, M * 4, 4, BN_READ},
                               {"x_q", x_q, N * K, 16, BN_READ},
                               {"x_scales", x_scales, N * 4, 4, BN_READ},
                               {"y", y, N * M * y_size, y_size, BN_WRITTEN}};
    BN_CHECK_ARRAYS(op, device, arrays, BN_NO_OVERLAP);
    return device == BITNET_DEVICE_CPU
               ? bn_cpu_gemv_w2a8(w_packed, w_scales, M, K, x_q, x_scales, N, y, y_dtype)
               : BN_CUDA(bn_cuda_gemv_w2a8(device, w_packed, w_scales, M, K, x_q, x_scales, N, y,
                                           y_dtype, stream));
}

bitnet_status bitnet_gemv_w2a8_block_scaled(int32_t device, const uint8_t *w_packed,
                                            const float *w_scales, const float *block_scales,
                                            int64_t M, int64_t K, const int8_t *x_q,
                                            const float *x_scales, int64_t N, void *y,
                                            int32_t y_dtype, void *stream) {
    const char *op = "bitnet_gemv_w2a8_block_scaled";
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_float_dtype(op, "y_dtype", y_dtype));
    const int64_t y_size = bn_dtype_size(y_dtype);
    BN_TRY(check_sizes(op, M, K, N, y_size));
    if (K % BN_SCALE_BLOCK != 0)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: K = %lld is not a multiple of the scale "
                       "block (%d weights)", op, (long long)K, BN_SCALE_BLOCK);
    const bn_array arrays[] = {{"w_packed", w_packed, M * K / 4, 16, BN_READ},
                               {"w_scales", w_scales, M * 4, 4, BN_READ},
                               {"block_scales", block_scales, M * (K / BN_SCALE_BLOCK) * 4, 4,
                                BN_READ},
                               {"x_q", x_q, N * K, 16, BN_READ},
                               {"x_scales", x_scales, N * 4, 4, BN_READ},
                               {"y", y, N * M * y_size, y_size, BN_WRITTEN}};
    BN_CHECK_ARRAYS(op, device, arrays, BN_NO_OVERLAP);
    return device == BITNET_DEVICE_CPU
               ? bn_cpu_gemv_w2a8_block_scaled(w_packed, w_scales, block_scales, M, K, x_q,
                                               x_scales, N, y, y_dtype)
               : BN_CUDA(bn_cuda_gemv_w2a8_block_scaled(device, w_packed, w_scales, block_scales,
                                                        M, K, x_q, x_scales, N, y, y_dtype,
                                                        stream));
}
