/* CPU backend of bitnet_rmsnorm_gemv_w2a8: the unfused sequence itself, through a buffer of codes
 * (bn_cpu_rmsnorm or bn_cpu_relu2_rmsnorm, then bn_cpu_gemv_w2a8), so that it is bit for bit the
 * same; with a residual, the GEMV's float32 outputs are rounded to y_dtype and added to it. */
#include <stdlib.h>

#include "../internal.h"

/* v rounded to dtype, as a float. */
static float rounded(int32_t dtype, float v) {
    float stored = 0.0f; /* room for any of the three dtypes */
    bn_store_float(&stored, dtype, 0, v);
    return bn_load_float(&stored, dtype, 0);
}

bitnet_status bn_cpu_rmsnorm_gemv_w2a8(int32_t dtype, int64_t T, int64_t K, const void *x,
                                       int32_t gated, const void *weight, float eps,
                                       const uint8_t *w_packed, const float *w_scales, int64_t M,
                                       const void *residual, void *y, int32_t y_dtype) {
    int8_t *x_q = malloc((size_t)(T * K));
    float *x_scales = malloc((size_t)T * sizeof(float));
    float *dots = residual ? malloc((size_t)(T * M) * sizeof(float)) : NULL;
    bitnet_status status = BITNET_OK;
    if (!x_q || !x_scales || (residual && !dots)) {
        status = bn_fail(BITNET_ERR_OUT_OF_MEMORY, "bitnet_rmsnorm_gemv_w2a8: no host memory for "
                         "the %lld codes of x", (long long)(T * K));
        goto done;
    }
    status = gated ? bn_cpu_relu2_rmsnorm(dtype, T, K, x, weight, eps, NULL, x_q, x_scales)
                   : bn_cpu_rmsnorm(dtype, T, K, x, NULL, weight, eps, NULL, x_q, x_scales);
    if (status != BITNET_OK) goto done;
    status = bn_cpu_gemv_w2a8(w_packed, w_scales, M, K, x_q, x_scales, T, residual ? dots : y,
                              residual ? BITNET_DTYPE_F32 : y_dtype);
    if (status != BITNET_OK || !residual) goto done;
    /* y may be the residual: each element is read before it is written. */
    for (int64_t i = 0; i < T * M; i++)
        bn_store_float(y, y_dtype, i,
                       bn_load_float(residual, y_dtype, i) + rounded(y_dtype, dots[i]));
done:
    free(x_q);
    free(x_scales);
    free(dots);
    return status;
}
