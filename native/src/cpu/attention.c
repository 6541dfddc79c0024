/* CPU attention: for each (sequence, KV head, query), the G query heads of the group stream once
 * over the keys, KEY_BLOCK at a time, with an online softmax in float32. Per block:
 * s_j = q.k_j * scale; m' = max(m, max_j s_j); acc = acc * e^(m - m') + sum_j e^(s_j - m') v_j;
 * l likewise; and at the end out = acc / l. Each block's K and V rows are converted to float once
 * for the whole group, and the dot products keep 8 partial sums, so that the compiler vectorizes
 * them. OpenMP over (sequence, KV head, query) tasks; where they are too few for the threads
 * (decode of one sequence), over contiguous key ranges of them too, merged at the end. The block
 * loop is compiled twice: portable C (SSE2 on x86-64) and AVX2 + FMA, which the vectorizer widens;
 * bn_cpu_isa()'s AVX2 and AVX-512 paths both take the second (an AVX-512 copy of the same C ran
 * at half the speed of the portable one on a 2-core AVX-512 VNNI machine). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "../internal.h"

enum {
    KEY_BLOCK = 32,
    SPLIT_KEYS = 256,     /* a task's keys are split in ranges of at least this many, */
    ITEMS_PER_THREAD = 4, /* to give each thread about this many pieces of work */
};

/* Inlined into each path's copy of attend, so compiled for its instruction set. */
#define PATH_INLINE static inline __attribute__((always_inline))

PATH_INLINE void load_row(const void *src, int32_t dtype, int64_t offset, int64_t n, float *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = bn_load_float(src, dtype, offset + i);
}

/* a . b over n elements, n a multiple of 8 (D = 64 or 128). */
PATH_INLINE float dot(const float *a, const float *b, int64_t n) {
    float part[8] = {0.0f};
    for (int64_t d = 0; d < n; d += 8)
        for (int u = 0; u < 8; u++) part[u] += a[d + u] * b[d + u];
    float sum = 0.0f;
    for (int u = 0; u < 8; u++) sum += part[u];
    return sum;
}

/* The online softmax of G query rows qf [G, D] over keys [key_begin, key_end) of one KV head, whose
 * key j sits at element `head + j * stride` of k and v: acc [G, D] (unnormalized), m and l [G].
 * kf, vf: room for KEY_BLOCK rows each; s: for G * KEY_BLOCK scores. */
PATH_INLINE void attend(const float *qf, int64_t G, int64_t D, int32_t dtype, const void *k,
                        const void *v, int64_t head, int64_t stride, int64_t key_begin,
                        int64_t key_end, float scale, float *kf, float *vf, float *s, float *acc,
                        float *m, float *l) {
    for (int64_t g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int64_t x = 0; x < G * D; x++) acc[x] = 0.0f;
    for (int64_t j0 = key_begin; j0 < key_end; j0 += KEY_BLOCK) {
        int64_t n = key_end - j0 < KEY_BLOCK ? key_end - j0 : KEY_BLOCK;
        for (int64_t t = 0; t < n; t++) {
            load_row(k, dtype, head + (j0 + t) * stride, D, kf + t * D);
            load_row(v, dtype, head + (j0 + t) * stride, D, vf + t * D);
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
}

#define ATTEND_PATH(name, target)                                                                 \
    target static void name(const float *qf, int64_t G, int64_t D, int32_t dtype, const void *k,  \
                            const void *v, int64_t head, int64_t stride, int64_t key_begin,       \
                            int64_t key_end, float scale, float *kf, float *vf, float *s,         \
                            float *acc, float *m, float *l) {                                     \
        attend(qf, G, D, dtype, k, v, head, stride, key_begin, key_end, scale, kf, vf, s, acc, m, \
               l);                                                                                \
    }
ATTEND_PATH(attend_portable, )
ATTEND_PATH(attend_avx2, __attribute__((target("avx2,fma"))))

/* How many key ranges each task's keys are split into (1: none). */
static int64_t key_splits(int64_t tasks, int64_t C) {
    int64_t want = ((int64_t)omp_get_max_threads() * ITEMS_PER_THREAD + tasks - 1) / tasks;
    int64_t most = C / SPLIT_KEYS;
    return want < most ? want : most < 1 ? 1 : most;
}

bitnet_status bn_cpu_attention(int32_t dtype, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv,
                               int64_t D, const void *q, const void *k, const void *v, int64_t C,
                               const int32_t *seq_lens, int32_t causal, float scale, void *out) {
    int64_t G = Hq / Hkv;
    /* Per item: G query rows, G accumulators, G running maxima and sums, a block of K and V rows
     * and the G rows of its scores. */
    int64_t floats_per_item = 2 * G * D + 2 * G + 2 * KEY_BLOCK * D + G * KEY_BLOCK;
    int64_t tasks = B * Hkv * Sq, splits = key_splits(tasks, C);
    __typeof__(attend_portable) *attend_path =
        bn_cpu_isa() == BN_ISA_PORTABLE ? attend_portable : attend_avx2;
    /* With splits, item (task, split) leaves acc [G, D], m [G] and l [G] here for the merge. */
    int64_t partial_floats = G * (D + 2);
    float *partials = NULL;
    if (splits > 1) {
        partials = malloc((size_t)(tasks * splits * partial_floats) * sizeof(float));
        if (!partials)
            return bn_fail(BITNET_ERR_OUT_OF_MEMORY, "bitnet_attention: out of host memory");
    }
    int failed = 0;

#pragma omp parallel reduction(|| : failed)
    {
        float *buffer = malloc((size_t)floats_per_item * sizeof(float));
        failed = buffer == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < tasks * splits; item++) {
            if (!buffer) continue;
            int64_t task = item / splits, split = item % splits;
            int64_t b = task / (Hkv * Sq), kvh = task / Sq % Hkv, i = task % Sq;
            float *qf = buffer, *acc = qf + G * D, *m = acc + G * D, *l = m + G;
            float *kf = l + G, *vf = kf + KEY_BLOCK * D, *s = vf + KEY_BLOCK * D;
            int64_t L = seq_lens ? seq_lens[b] : C;
            int64_t keys = causal ? L - Sq + i + 1 : L;
            /* This item's keys: a contiguous range of whole blocks (maybe empty). */
            int64_t per_split = (keys + splits - 1) / splits;
            per_split = (per_split + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
            int64_t begin = split * per_split < keys ? split * per_split : keys;
            int64_t end = begin + per_split < keys ? begin + per_split : keys;
            int64_t q_row = ((b * Sq + i) * Hq + kvh * G) * D; /* the G heads are contiguous */
            load_row(q, dtype, q_row, G * D, qf);
            attend_path(qf, G, D, dtype, k, v, (b * C * Hkv + kvh) * D, Hkv * D, begin, end, scale,
                        kf, vf, s, acc, m, l);
            if (splits > 1) {
                float *partial = partials + item * partial_floats;
                memcpy(partial, acc, (size_t)(G * D) * sizeof(float));
                memcpy(partial + G * D, m, (size_t)G * sizeof(float));
                memcpy(partial + G * D + G, l, (size_t)G * sizeof(float));
                continue;
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t d = 0; d < D; d++)
                    bn_store_float(out, dtype, q_row + g * D + d, acc[g * D + d] / l[g]);
        }
        free(buffer);
    }
    if (splits > 1 && !failed) {
        /* out = sum_s w_s acc_s / sum_s w_s l_s, w_s = e^(m_s - max_s m_s); an empty range has
         * m = -inf, so its weight is 0. */
#pragma omp parallel for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t b = task / (Hkv * Sq), kvh = task / Sq % Hkv, i = task % Sq;
            int64_t q_row = ((b * Sq + i) * Hq + kvh * G) * D;
            float *first = partials + task * splits * partial_floats;
            for (int64_t g = 0; g < G; g++) {
                float m_max = -INFINITY, l_total = 0.0f;
                for (int64_t sp = 0; sp < splits; sp++) {
                    float m_s = first[sp * partial_floats + G * D + g];
                    m_max = m_s > m_max ? m_s : m_max;
                }
                for (int64_t sp = 0; sp < splits; sp++) { /* m_s becomes w_s */
                    float *partial = first + sp * partial_floats;
                    partial[G * D + g] = expf(partial[G * D + g] - m_max);
                    l_total += partial[G * D + g] * partial[G * D + G + g];
                }
                for (int64_t d = 0; d < D; d++) {
                    float sum = 0.0f;
                    for (int64_t sp = 0; sp < splits; sp++) {
                        const float *partial = first + sp * partial_floats;
                        sum += partial[G * D + g] * partial[g * D + d];
                    }
                    bn_store_float(out, dtype, q_row + g * D + d, sum / l_total);
                }
            }
        }
    }
    free(partials);
    if (failed) return bn_fail(BITNET_ERR_OUT_OF_MEMORY, "bitnet_attention: out of host memory");
    return BITNET_OK;
}
