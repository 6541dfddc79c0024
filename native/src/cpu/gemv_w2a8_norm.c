/* CPU backend of the input RMSNorm fused into the GEMVs (bitnet_gemv_w2a8_add_norm_stats,
 * bitnet_rmsnorm_gemv_w2a8 and its RoPE form): the plain ops through rows of their own. The producer
 * leaves the whole row's statistics in slot 0, its sum of squares added in the order of the CPU
 * norm (so that the CPU's codes are bitnet_rmsnorm's, bit for bit); the consumers sum every slot in order, so that they
 * also take a GPU producer's slots, and where the float32 mean square is not a normal float they
 * sum h's squares again in float64, as cpu/rmsnorm.c does. */
#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "../internal.h"

bitnet_status bn_cpu_gemv_w2a8_add_norm_stats(int32_t dtype, const uint8_t *w_packed,
                                              const float *w_scales, int64_t M, int64_t K,
                                              const int8_t *x_q, const float *x_scale, void *h,
                                              const void *norm_weight, float *stats,
                                              int64_t slots) {
    void *y = malloc((size_t)(M * bn_dtype_size(dtype)));
    if (y == NULL)
        return bn_fail(BITNET_ERR_OUT_OF_MEMORY, "bitnet_gemv_w2a8_add_norm_stats: no host memory "
                       "for the projection's row (%lld values)", (long long)M);
    bitnet_status status = bn_cpu_gemv_w2a8(w_packed, w_scales, M, K, x_q, x_scale, 1, y, dtype);
    if (status == BITNET_OK) {
        float lane_sum[BN_CPU_NORM_LANES] = {0}, sum = 0.0f, max = 0.0f;
        for (int64_t m = 0; m < M; m++) {
            bn_store_float(h, dtype, m, bn_load_float(h, dtype, m) + bn_load_float(y, dtype, m));
            const float v = bn_load_float(h, dtype, m);
            lane_sum[m % BN_CPU_NORM_LANES] += v * v;
            max = bn_max_or_nan(max, fabsf(v * bn_load_float(norm_weight, dtype, m)));
        }
        for (int l = 0; l < BN_CPU_NORM_LANES; l++) sum += lane_sum[l];
        stats[0] = sum;
        stats[1] = max;
        for (int64_t s = 2; s < 2 * slots; s++) stats[s] = 0.0f;
    }
    free(y);
    return status;
}

/* x_q[0..K) and *x_scale: the codes of rmsnorm(h) * norm_weight from the slots' statistics, with
 * bitnet_rmsnorm's rules (cpu/rmsnorm.c's norm_row for eps > 0). */
static void normed_codes(int32_t dtype, const void *h, const void *norm_weight,
                         const float *stats, int64_t slots, float eps, int64_t K, int8_t *x_q,
                         float *x_scale) {
    float sum = 0.0f, max_vw = 0.0f;
    for (int64_t s = 0; s < slots; s++) {
        sum += stats[2 * s];
        max_vw = bn_max_or_nan(max_vw, stats[2 * s + 1]);
    }
    const float mean_square = sum / (float)K + eps;
    float r;
    if (mean_square >= FLT_MIN && mean_square <= FLT_MAX) {
        r = 1.0f / sqrtf(mean_square);
    } else {
        double sum64 = 0.0;
        for (int64_t k = 0; k < K; k++) {
            const double v = bn_load_float(h, dtype, k);
            sum64 += v * v;
        }
        r = (float)(1.0 / sqrt(sum64 / (double)K + eps));
    }
    const float max_y = max_vw * r;
    const float scale = isfinite(max_y) ? 127.0f / fmaxf(max_y, 1e-5f) : NAN, r_scale = r * scale;
    for (int64_t k = 0; k < K; k++) {
        const float p = bn_load_float(h, dtype, k) * bn_load_float(norm_weight, dtype, k);
        x_q[k] = (int8_t)rintf(fminf(fmaxf(p * r_scale, -128.0f), 127.0f));
    }
    *x_scale = scale;
}

static bitnet_status no_memory(const char *fn, int64_t K) {
    return bn_fail(BITNET_ERR_OUT_OF_MEMORY, "%s: no host memory for the codes (%lld bytes)", fn,
                   (long long)K);
}

bitnet_status bn_cpu_rmsnorm_gemv_w2a8(int32_t dtype, const void *h, const void *norm_weight,
                                       const float *stats, int64_t slots, float eps,
                                       const uint8_t *w_packed, const float *w_scales, int64_t M,
                                       int64_t K, void *y, int32_t y_dtype) {
    int8_t *x_q = malloc((size_t)K);
    if (x_q == NULL) return no_memory("bitnet_rmsnorm_gemv_w2a8", K);
    float x_scale;
    normed_codes(dtype, h, norm_weight, stats, slots, eps, K, x_q, &x_scale);
    bitnet_status status = bn_cpu_gemv_w2a8(w_packed, w_scales, M, K, x_q, &x_scale, 1, y, y_dtype);
    free(x_q);
    return status;
}

bitnet_status bn_cpu_rmsnorm_gemv_w2a8_rope_append_kv(
    int32_t dtype, const void *h, const void *norm_weight, const float *stats, int64_t slots,
    float eps, const uint8_t *w_packed, const float *w_scales, int64_t K, int64_t Hq, int64_t Hkv,
    int64_t D, void *q, void *k_cache, void *v_cache, int64_t C, const int32_t *position,
    float theta) {
    int8_t *x_q = malloc((size_t)K);
    if (x_q == NULL) return no_memory("bitnet_rmsnorm_gemv_w2a8_rope_append_kv", K);
    float x_scale;
    normed_codes(dtype, h, norm_weight, stats, slots, eps, K, x_q, &x_scale);
    bitnet_status status = bn_cpu_gemv_w2a8_rope_append_kv(dtype, w_packed, w_scales, K, x_q,
                                                           &x_scale, Hq, Hkv, D, q, k_cache,
                                                           v_cache, C, position, theta);
    free(x_q);
    return status;
}
