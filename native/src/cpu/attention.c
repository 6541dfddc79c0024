/* CPU attention: for each (sequence, KV head, query), the G query heads of the group stream once over
 * the keys with an online softmax in float32: per key, s = q.k * scale; m' = max(m, s);
 * acc = acc * e^(m - m') + e^(s - m') v; l likewise; out = acc / l. Each K and V row is converted to
 * float once for the whole group. OpenMP over (sequence, KV head, query). */
#include <math.h>
#include <stdlib.h>

#include "../internal.h"

static void load_row(const void *src, int32_t dtype, int64_t offset, int64_t n, float *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = bn_load_float(src, dtype, offset + i);
}

bitnet_status bn_cpu_attention(int32_t dtype, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv,
                               int64_t D, const void *q, const void *k, const void *v, int64_t C,
                               const int32_t *seq_lens, int32_t causal, float scale, void *out) {
    int64_t G = Hq / Hkv;
    /* Per task: G query rows, G accumulators, G running maxima and sums, one K and one V row. */
    int64_t floats_per_task = 2 * G * D + 2 * G + 2 * D;
    int64_t tasks = B * Hkv * Sq;
    int failed = 0;

#pragma omp parallel reduction(|| : failed)
    {
        float *buffer = malloc((size_t)floats_per_task * sizeof(float));
        failed = buffer == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (!buffer) continue;
            int64_t b = task / (Hkv * Sq), kvh = task / Sq % Hkv, i = task % Sq;
            float *qf = buffer, *acc = qf + G * D, *m = acc + G * D, *l = m + G;
            float *kf = l + G, *vf = kf + D;
            int64_t L = seq_lens ? seq_lens[b] : C;
            int64_t last_key = causal ? L - Sq + i : L - 1;
            int64_t q_row = ((b * Sq + i) * Hq + kvh * G) * D; /* the G heads are contiguous */
            load_row(q, dtype, q_row, G * D, qf);
            for (int64_t g = 0; g < G; g++) {
                m[g] = -INFINITY;
                l[g] = 0.0f;
            }
            for (int64_t x = 0; x < G * D; x++) acc[x] = 0.0f;

            for (int64_t j = 0; j <= last_key; j++) {
                int64_t kv_row = ((b * C + j) * Hkv + kvh) * D;
                load_row(k, dtype, kv_row, D, kf);
                load_row(v, dtype, kv_row, D, vf);
                for (int64_t g = 0; g < G; g++) {
                    const float *qg = qf + g * D;
                    float *ag = acc + g * D;
                    float s = 0.0f;
                    for (int64_t d = 0; d < D; d++) s += qg[d] * kf[d];
                    s *= scale;
                    float m_new = s > m[g] ? s : m[g];
                    float rescale = expf(m[g] - m_new), p = expf(s - m_new);
                    for (int64_t d = 0; d < D; d++) ag[d] = ag[d] * rescale + p * vf[d];
                    l[g] = l[g] * rescale + p;
                    m[g] = m_new;
                }
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t d = 0; d < D; d++)
                    bn_store_float(out, dtype, q_row + g * D + d, acc[g * D + d] / l[g]);
        }
        free(buffer);
    }
    if (failed) return bn_fail(BITNET_ERR_OUT_OF_MEMORY, "bitnet_attention: out of host memory");
    return BITNET_OK;
}
