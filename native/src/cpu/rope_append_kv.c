/* CPU RoPE + KV-cache append on a fused QKV projection's output: for token s of sequence b at
 * p = positions[b] + s, the pairs (x[i], x[i + D/2]) of every q and k head turn by p * theta^(-2i/D)
 * (angle, cos and sin in float64, the rotation in float32); rotated q heads go to q, rotated k and
 * plain v heads to row p of the caches. OpenMP over tokens. */
#include <math.h>
#include <string.h>

#include "../internal.h"

static void rotate_head(const void *x, int32_t dtype, int64_t offset, int64_t half,
                        const float *cosines, const float *sines, void *dst, int64_t dst_offset) {
    for (int64_t i = 0; i < half; i++) {
        float a = bn_load_float(x, dtype, offset + i), b = bn_load_float(x, dtype, offset + half + i);
        bn_store_float(dst, dtype, dst_offset + i, a * cosines[i] - b * sines[i]);
        bn_store_float(dst, dtype, dst_offset + half + i, b * cosines[i] + a * sines[i]);
    }
}

bitnet_status bn_cpu_rope_append_kv(int32_t dtype, int64_t B, int64_t S, int64_t Hq, int64_t Hkv,
                                    int64_t D, const void *qkv, void *q, void *k_cache,
                                    void *v_cache, int64_t C, const int32_t *positions, float theta) {
    int64_t half = D / 2, elem = bn_dtype_size(dtype), heads = Hq + 2 * Hkv;
#pragma omp parallel for schedule(static) if (B * S * heads * D >= BN_CPU_PARALLEL_MIN_WORK)
    for (int64_t token = 0; token < B * S; token++) {
        int64_t b = token / S, p = positions[b] + token % S;
        float cosines[512], sines[512];
        for (int64_t i = 0; i < half; i++) {
            double angle = (double)p * pow((double)theta, -2.0 * (double)i / (double)D);
            cosines[i] = (float)cos(angle);
            sines[i] = (float)sin(angle);
        }
        int64_t row = token * heads * D, cache_row = (b * C + p) * Hkv * D;
        for (int64_t h = 0; h < Hq; h++)
            rotate_head(qkv, dtype, row + h * D, half, cosines, sines, q, (token * Hq + h) * D);
        for (int64_t h = 0; h < Hkv; h++)
            rotate_head(qkv, dtype, row + (Hq + h) * D, half, cosines, sines, k_cache,
                        cache_row + h * D);
        memcpy((char *)v_cache + cache_row * elem, (const char *)qkv + (row + (Hq + Hkv) * D) * elem,
               (size_t)(Hkv * D * elem));
    }
    return BITNET_OK;
}
