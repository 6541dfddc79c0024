/* CPU dense bfloat16 GEMV: y[n, m] = sum_k x[n, k] * w[m, k] in float32, rows split over OpenMP
 * threads; the inner loop converts bfloat16 by a 16-bit shift, which the compiler vectorizes. */
#include <stdlib.h>

#include "../internal.h"

bitnet_status bn_cpu_gemv_bf16(const void *w, int64_t M, int64_t K, const void *x, int32_t x_dtype,
                               int64_t N, void *y, int32_t y_dtype) {
    float *x_float = malloc((size_t)(N * K) * sizeof(float));
    if (!x_float) return bn_fail(BITNET_ERR_OUT_OF_MEMORY, "gemv_bf16: no host memory for x");
    bn_load_floats(x_dtype, x, 0, N * K, x_float);
    const uint16_t *weights = (const uint16_t *)w;
#pragma omp parallel for schedule(static) if ((double)M * K * N >= BN_CPU_PARALLEL_MIN_WORK)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *row = weights + m * K;
        for (int64_t n = 0; n < N; n++) {
            const float *xn = x_float + n * K;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < K; k++) acc += bn_bf16_to_float(row[k]) * xn[k];
            bn_store_float(y, y_dtype, n * M + m, acc);
        }
    }
    free(x_float);
    return BITNET_OK;
}
