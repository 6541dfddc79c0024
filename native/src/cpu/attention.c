/* CPU attention: for each (sequence, KV head, query), the G query heads of the group stream once over
 * the keys, KEY_BLOCK at a time, with an online softmax in float32: per block, s_j = q.k_j * scale;
 * m' = max(m, max_j s_j); acc = acc * e^(m - m') + sum_j e^(s_j - m') v_j; l likewise;
 * out = acc / l. Each block's K and V rows are converted to float once for the whole group, and
 * the dot products keep 8 partial sums, so that the compiler vectorizes them. OpenMP over
 * (sequence, KV head, query). */
#include <math.h>
#include <stdlib.h>

#include "../internal.h"

enum { KEY_BLOCK = 32 };

static void load_row(const void *src, int32_t dtype, int64_t offset, int64_t n, float *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = bn_load_float(src, dtype, offset + i);
}

/* a . b over n elements, n a multiple of 8 (D = 64 or 128). */
static float dot(const float *a, const float *b, int64_t n) {
    float part[8] = {0.0f};
    for (int64_t d = 0; d < n; d += 8)
        for (int u = 0; u < 8; u++) part[u] += a[d + u] * b[d + u];
    return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

bitnet_status bn_cpu_attention(int32_t dtype, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv,
                               int64_t D, const void *q, const void *k, const void *v, int64_t C,
                               const int32_t *seq_lens, int32_t causal, float scale, void *out) {
    int64_t G = Hq / Hkv;
    /* Per task: G query rows, G accumulators, G running maxima and sums, a block of K and V rows and
     * the G rows of its scores. */
    int64_t floats_per_task = 2 * G * D + 2 * G + 2 * KEY_BLOCK * D + G * KEY_BLOCK;
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
            float *kf = l + G, *vf = kf + KEY_BLOCK * D, *s = vf + KEY_BLOCK * D;
            int64_t L = seq_lens ? seq_lens[b] : C;
            int64_t keys = causal ? L - Sq + i + 1 : L;
            int64_t q_row = ((b * Sq + i) * Hq + kvh * G) * D; /* the G heads are contiguous */
            load_row(q, dtype, q_row, G * D, qf);
            for (int64_t g = 0; g < G; g++) {
                m[g] = -INFINITY;
                l[g] = 0.0f;
            }
            for (int64_t x = 0; x < G * D; x++) acc[x] = 0.0f;

            for (int64_t j0 = 0; j0 < keys; j0 += KEY_BLOCK) {
                int64_t n = keys - j0 < KEY_BLOCK ? keys - j0 : KEY_BLOCK;
                for (int64_t t = 0; t < n; t++) {
                    int64_t kv_row = ((b * C + j0 + t) * Hkv + kvh) * D;
                    load_row(k, dtype, kv_row, D, kf + t * D);
                    load_row(v, dtype, kv_row, D, vf + t * D);
                }
                for (int64_t g = 0; g < G; g++) {
                    float *sg = s + g * KEY_BLOCK, *ag = acc + g * D;
                    float block_max = -INFINITY; /* a NaN score is left out here, and makes p NaN */
                    for (int64_t t = 0; t < n; t++) {
                        sg[t] = dot(qf + g * D, kf + t * D, D) * scale;
                        block_max = sg[t] > block_max ? sg[t] : block_max;
                    }
                    float m_new = block_max > m[g] ? block_max : m[g];
                    float rescale = expf(m[g] - m_new);
                    l[g] *= rescale;
                    for (int64_t d = 0; d < D; d++) ag[d] *= rescale;
                    for (int64_t t = 0; t < n; t++) {
                        float p = expf(sg[t] - m_new);
                        const float *vt = vf + t * D;
                        l[g] += p;
                        for (int64_t d = 0; d < D; d++) ag[d] += p * vt[d];
                    }
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
