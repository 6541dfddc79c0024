/* Public entry points of the ternary weight and int8 activation quantizers, and the shape checks
 * shared with gemv_w2a8.c. The work is in cpu/quantize.c and cuda/quantize.cu. */
#include "internal.h"

bitnet_status bn_check_ternary_shape(const char *op, const char *rows_name, int64_t M, int64_t K) {
    BN_CHECK(M >= 1, "%s: %s must be at least 1, got %lld", op, rows_name, (long long)M);
    BN_CHECK(K >= 1, "%s: K must be at least 1, got %lld", op, (long long)K);
    if (K % 128 != 0)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: K = %lld is not a multiple of 128", op,
                       (long long)K);
    if (K > BN_TERNARY_MAX_K)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: K = %lld is over the largest supported K (%d)",
                       op, (long long)K, BN_TERNARY_MAX_K);
    return bn_check_size(op, M, K); /* M * K bytes fit in int64 */
}

bitnet_status bn_check_float_dtype(const char *op, const char *name, int32_t dtype) {
    BN_CHECK(bn_dtype_size(dtype) != 0, "%s: %s = %d is not a bitnet_dtype", op, name, dtype);
    if (dtype != BITNET_DTYPE_F32 && dtype != BITNET_DTYPE_F16 && dtype != BITNET_DTYPE_BF16)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: %s %s is not supported (float32, float16 or "
                       "bfloat16)", op, name, bn_dtype_name(dtype));
    return BITNET_OK;
}

bitnet_status bn_fail_non_finite_weight(int64_t index, int64_t K, float value) {
    return bn_fail(BITNET_ERR_INVALID_ARGUMENT, "bitnet_quantize_i2s: w[%lld, %lld] is %g; weights "
                   "must be finite (the first NaN or infinity, in row-major order)",
                   (long long)(index / K), (long long)(index % K), (double)value);
}

static bitnet_status check_segments(const int64_t *row_segments, int64_t n_segments, int64_t M) {
    if (!row_segments) {
        BN_CHECK(n_segments == 0 || n_segments == 1, "bitnet_quantize_i2s: row_segments is NULL, "
                 "so n_segments must be 0 or 1, got %lld", (long long)n_segments);
        return BITNET_OK;
    }
    BN_CHECK(n_segments >= 1 && n_segments <= M, "bitnet_quantize_i2s: n_segments = %lld must be "
             "in 1..M (M = %lld)", (long long)n_segments, (long long)M);
    int64_t total = 0;
    for (int64_t i = 0; i < n_segments; i++) {
        BN_CHECK(row_segments[i] >= 1 && row_segments[i] <= M - total,
                 "bitnet_quantize_i2s: row_segments[%lld] = %lld: segments must be >= 1 rows and "
                 "sum to M = %lld", (long long)i, (long long)row_segments[i], (long long)M);
        total += row_segments[i];
    }
    BN_CHECK(total == M, "bitnet_quantize_i2s: row_segments sum to %lld rows, but M = %lld",
             (long long)total, (long long)M);
    return BITNET_OK;
}

bitnet_status bitnet_quantize_i2s(int32_t device, const void *w, int32_t w_dtype, int64_t M,
                                  int64_t K, const int64_t *row_segments, int64_t n_segments,
                                  uint8_t *w_packed, float *w_scales, void *stream) {
    const char *op = "bitnet_quantize_i2s";
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_float_dtype(op, "w_dtype", w_dtype));
    BN_TRY(bn_check_ternary_shape(op, "M", M, K));
    const int64_t w_size = bn_dtype_size(w_dtype);
    BN_TRY(bn_check_size("bitnet_quantize_i2s: w", M * K, w_size));
    BN_TRY(check_segments(row_segments, n_segments, M));
    const bn_array arrays[] = {{"w", w, M * K * w_size, 16, BN_READ},
                               {"w_packed", w_packed, M * K / 4, 16, BN_WRITTEN},
                               {"w_scales", w_scales, M * 4, 4, BN_WRITTEN}};
    BN_CHECK_ARRAYS(op, device, arrays, BN_NO_OVERLAP);
    if (!row_segments) n_segments = 1;
    return device == BITNET_DEVICE_CPU
               ? bn_cpu_quantize_i2s(w, w_dtype, M, K, row_segments, n_segments, w_packed, w_scales)
               : BN_CUDA(bn_cuda_quantize_i2s(device, w, w_dtype, M, K, row_segments, n_segments,
                                              w_packed, w_scales, stream));
}

bitnet_status bitnet_pack_ternary(int32_t device, const int8_t *w_q, int64_t M, int64_t K,
                                  uint8_t *w_packed, void *stream) {
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_ternary_shape("bitnet_pack_ternary", "M", M, K));
    const bn_array arrays[] = {{"w_q", w_q, M * K, 16, BN_READ},
                               {"w_packed", w_packed, M * K / 4, 16, BN_WRITTEN}};
    BN_CHECK_ARRAYS("bitnet_pack_ternary", device, arrays, BN_NO_OVERLAP);
    return device == BITNET_DEVICE_CPU
               ? bn_cpu_pack_ternary(w_q, M, K, w_packed)
               : BN_CUDA(bn_cuda_pack_ternary(device, w_q, M, K, w_packed, stream));
}

bitnet_status bitnet_unpack_ternary(int32_t device, const uint8_t *w_packed, int64_t M, int64_t K,
                                    int8_t *w_q, void *stream) {
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_ternary_shape("bitnet_unpack_ternary", "M", M, K));
    const bn_array arrays[] = {{"w_packed", w_packed, M * K / 4, 16, BN_READ},
                               {"w_q", w_q, M * K, 16, BN_WRITTEN}};
    BN_CHECK_ARRAYS("bitnet_unpack_ternary", device, arrays, BN_NO_OVERLAP);
    return device == BITNET_DEVICE_CPU
               ? bn_cpu_unpack_ternary(w_packed, M, K, w_q)
               : BN_CUDA(bn_cuda_unpack_ternary(device, w_packed, M, K, w_q, stream));
}

bitnet_status bitnet_quantize_a8(int32_t device, const void *x, int32_t x_dtype, int64_t N,
                                 int64_t K, int8_t *x_q, float *x_scales, void *stream) {
    const char *op = "bitnet_quantize_a8";
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_float_dtype(op, "x_dtype", x_dtype));
    BN_TRY(bn_check_ternary_shape(op, "N", N, K));
    const int64_t x_size = bn_dtype_size(x_dtype);
    BN_TRY(bn_check_size("bitnet_quantize_a8: x", N * K, x_size));
    const bn_array arrays[] = {{"x", x, N * K * x_size, 16, BN_READ},
                               {"x_q", x_q, N * K, 16, BN_WRITTEN},
                               {"x_scales", x_scales, N * 4, 4, BN_WRITTEN}};
    BN_CHECK_ARRAYS(op, device, arrays, BN_NO_OVERLAP);
    return device == BITNET_DEVICE_CPU
               ? bn_cpu_quantize_a8(x, x_dtype, N, K, x_q, x_scales)
               : BN_CUDA(bn_cuda_quantize_a8(device, x, x_dtype, N, K, x_q, x_scales, stream));
}
