/* CPU backend of the peer collectives: a single rank (the CPU has no peers), so the all-reduce is
 * x rounded to y's dtype, the all-gather a copy, and the RMS form each row times
 * 1 / sqrt(its sum of squares / norm_cols + eps) in float32, as the GPU computes it. */
#include <math.h>

#include "../internal.h"

bitnet_status bn_cpu_peer_allreduce(int32_t x_dtype, int32_t y_dtype, int64_t n, const void *x,
                                    void *y) {
    enum { CHUNK = 1024 };
    float row[CHUNK];
    for (int64_t i = 0; i < n; i += CHUNK) {
        const int64_t m = n - i < CHUNK ? n - i : CHUNK;
        bn_load_floats(x_dtype, x, i, m, row);
        bn_store_floats(y_dtype, row, m, y, i);
    }
    return BITNET_OK;
}

bitnet_status bn_cpu_peer_allreduce_rms(int32_t y_dtype, int64_t T, int64_t n, int64_t norm_cols,
                                        float eps, const float *x, void *y) {
    enum { CHUNK = 1024 };
    float row[CHUNK];
    for (int64_t t = 0; t < T; t++) {
        const float factor = 1.0f / sqrtf(x[T * n + t] / (float)norm_cols + eps);
        for (int64_t i = 0; i < n; i += CHUNK) {
            const int64_t m = n - i < CHUNK ? n - i : CHUNK;
            for (int64_t k = 0; k < m; k++) row[k] = x[t * n + i + k] * factor;
            bn_store_floats(y_dtype, row, m, y, t * n + i);
        }
    }
    return BITNET_OK;
}
