/* CPU attention: for each (sequence, KV head, query), the G query heads of the group stream once
 * over the keys, KEY_BLOCK at a time, with an online softmax in float32. Per block:
 * s_j = q.k_j * scale; m' = max(m, max_j s_j); acc = acc * e^(m - m') + sum_j e^(s_j - m') v_j;
 * l likewise; and at the end out = acc / l. A task takes up to QUERY_TILE queries of one KV head
 * (their G heads each: the task's rows), so each block's K and V rows are converted to float once
 * for all of them, and the dot products keep 8 partial sums, so that the compiler vectorizes them.
 * OpenMP over (sequence, KV head, query tile) tasks; where they are too few for the threads
 * (decode of one sequence), over contiguous key ranges of them too, merged at the end. The block
 * loop is compiled twice: portable C (SSE2 on x86-64) and AVX2 + FMA, which the vectorizer
 * widens; bn_cpu_isa()'s AVX2 and AVX-512 paths both take the second (an AVX-512 copy of the same
 * C ran at half the speed of the portable one on a 2-core AVX-512 VNNI machine). float16 is
 * converted with the bit operations of bn_load_float, which vectorize on both paths. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "../internal.h"

enum {
    KEY_BLOCK = 32,
    QUERY_TILE = 8,
    SPLIT_KEYS = 256,     /* a task's keys are split in ranges of at least this many, */
    ITEMS_PER_THREAD = 4, /* to give each thread about this many pieces of work */
};

/* Inlined into each path's copy of attend, so compiled for its instruction set. */
#define PATH_INLINE static inline __attribute__((always_inline))

PATH_INLINE void load_row(const void *src, int32_t dtype, int64_t offset, int64_t n, float *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = bn_load_float(src, dtype, offset + i);
}

/* a . b over n elements, n a multiple of 8 (D = 64, 128 or 256). */
PATH_INLINE float dot(const float *a, const float *b, int64_t n) {
    float part[8] = {0.0f};
    for (int64_t d = 0; d < n; d += 8)
        for (int u = 0; u < 8; u++) part[u] += a[d + u] * b[d + u];
    float sum = 0.0f;
    for (int u = 0; u < 8; u++) sum += part[u];
    return sum;
}

/* The online softmax of R query rows qf [R, D] over keys [key_begin, key_end) of one KV head, whose
 * key j sits at element `head + j * stride` of k and v: acc [R, D] (unnormalized), m and l [R].
 * Row r sees keys below row_keys + (r / G) * step (step 1 for the causal mask of consecutive
 * queries, 0 without it). kf, vf: room for KEY_BLOCK rows each; s: for R * KEY_BLOCK scores. */
PATH_INLINE void attend(const float *qf, int64_t R, int64_t G, int64_t D, int32_t dtype,
                        const void *k, const void *v, int64_t head, int64_t stride,
                        int64_t key_begin, int64_t key_end, int64_t row_keys, int64_t step,
                        float scale, float *kf, float *vf, float *s, float *acc, float *m,
                        float *l) {
    for (int64_t r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (int64_t x = 0; x < R * D; x++) acc[x] = 0.0f;
    for (int64_t j0 = key_begin; j0 < key_end; j0 += KEY_BLOCK) {
        int64_t n = key_end - j0 < KEY_BLOCK ? key_end - j0 : KEY_BLOCK;
        for (int64_t t = 0; t < n; t++) {
            load_row(k, dtype, head + (j0 + t) * stride, D, kf + t * D);
            load_row(v, dtype, head + (j0 + t) * stride, D, vf + t * D);
        }
        for (int64_t r = 0; r < R; r++) {
            int64_t seen = row_keys + r / G * step - j0; /* keys of this block the row sees */
            seen = seen < n ? seen : n;
            if (seen <= 0) continue;
            float *sr = s + r * KEY_BLOCK, *ar = acc + r * D;
            float block_max = -INFINITY; /* a NaN score is left out here, and makes p NaN */
            for (int64_t t = 0; t < seen; t++) {
                sr[t] = dot(qf + r * D, kf + t * D, D) * scale;
                block_max = sr[t] > block_max ? sr[t] : block_max;
            }
            float m_new = block_max > m[r] ? block_max : m[r];
            float rescale = expf(m[r] - m_new);
            l[r] *= rescale;
            for (int64_t d = 0; d < D; d++) ar[d] *= rescale;
            for (int64_t t = 0; t < seen; t++) {
                float p = expf(sr[t] - m_new);
                const float *vt = vf + t * D;
                l[r] += p;
                for (int64_t d = 0; d < D; d++) ar[d] += p * vt[d];
            }
            m[r] = m_new;
        }
    }
}

#define ATTEND_PATH(name, target)                                                                \
    target static void name(const float *qf, int64_t R, int64_t G, int64_t D, int32_t dtype,     \
                            const void *k, const void *v, int64_t head, int64_t stride,          \
                            int64_t key_begin, int64_t key_end, int64_t row_keys, int64_t step,  \
                            float scale, float *kf, float *vf, float *s, float *acc, float *m,   \
                            float *l) {                                                          \
        attend(qf, R, G, D, dtype, k, v, head, stride, key_begin, key_end, row_keys, step, scale, \
               kf, vf, s, acc, m, l);                                                            \
    }
ATTEND_PATH(attend_portable, )
ATTEND_PATH(attend_avx2, __attribute__((target("avx2,fma"))))

/* A task's rows: sequence b, KV head kvh, queries i0 .. i0 + rows / G - 1; row r is query
 * i0 + r / G, head kvh * G + r % G. */
struct task {
    int64_t b, kvh, i0, rows;
};

static struct task task_rows(int64_t t, int64_t Hkv, int64_t tiles, int64_t Sq, int64_t G) {
    struct task x = {t / (Hkv * tiles), t / tiles % Hkv, t % tiles * QUERY_TILE, 0};
    x.rows = (Sq - x.i0 < QUERY_TILE ? Sq - x.i0 : QUERY_TILE) * G;
    return x;
}

/* The element of q and out where row r of task x starts. */
static int64_t row_offset(struct task x, int64_t r, int64_t Sq, int64_t Hq, int64_t G, int64_t D) {
    return ((x.b * Sq + x.i0 + r / G) * Hq + x.kvh * G + r % G) * D;
}

/* How many key ranges each task's keys are split into (1: none). */
static int64_t key_splits(int64_t tasks, int64_t C) {
    int64_t want = ((int64_t)omp_get_max_threads() * ITEMS_PER_THREAD + tasks - 1) / tasks;
    int64_t most = C / SPLIT_KEYS;
    return want < most ? want : most < 1 ? 1 : most;
}

bitnet_status bn_cpu_attention(int32_t dtype, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv,
                               int64_t D, const void *q, const void *k, const void *v, int64_t C,
                               const int32_t *seq_lens, int32_t causal, float scale, void *out) {
    int64_t G = Hq / Hkv, rows_max = QUERY_TILE * G, tiles = (Sq + QUERY_TILE - 1) / QUERY_TILE;
    /* Per item: the rows' queries and accumulators, their running maxima and sums, a block of K
     * and V rows and the rows' scores for it. */
    int64_t floats_per_item =
        2 * rows_max * D + 2 * rows_max + 2 * KEY_BLOCK * D + rows_max * KEY_BLOCK;
    int64_t tasks = B * Hkv * tiles, splits = key_splits(tasks, C);
    __typeof__(attend_portable) *attend_path =
        bn_cpu_isa() == BN_ISA_PORTABLE ? attend_portable : attend_avx2;
    /* With splits, item (task, split) leaves acc [R, D], m [R] and l [R] here for the merge. */
    int64_t partial_floats = rows_max * (D + 2);
    float *partials = NULL;
    if (splits > 1) {
        partials = malloc((size_t)(tasks * splits * partial_floats) * sizeof(float));
        if (!partials)
            return bn_fail(BITNET_ERR_OUT_OF_MEMORY, "bitnet_attention: out of host memory");
    }
    int failed = 0;

#pragma omp parallel reduction(|| : failed) \
    if ((double)B * Sq * Hq * C * D >= BN_CPU_PARALLEL_MIN_WORK)
    {
        float *buffer = malloc((size_t)floats_per_item * sizeof(float));
        failed = buffer == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < tasks * splits; item++) {
            if (!buffer) continue;
            int64_t split = item % splits;
            struct task x = task_rows(item / splits, Hkv, tiles, Sq, G);
            int64_t R = x.rows, L = seq_lens ? seq_lens[x.b] : C;
            float *qf = buffer, *acc = qf + rows_max * D, *m = acc + rows_max * D;
            float *l = m + rows_max;
            float *kf = l + rows_max, *vf = kf + KEY_BLOCK * D, *s = vf + KEY_BLOCK * D;
            /* Query i sees keys up to L - Sq + i (causal) or all L: the last row sees most. */
            int64_t row_keys = causal ? L - Sq + x.i0 + 1 : L;
            int64_t keys = row_keys + (causal ? R / G - 1 : 0);
            /* This item's keys: a contiguous range of whole blocks (maybe empty). */
            int64_t per_split = (keys + splits - 1) / splits;
            per_split = (per_split + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
            int64_t begin = split * per_split < keys ? split * per_split : keys;
            int64_t end = begin + per_split < keys ? begin + per_split : keys;
            for (int64_t r = 0; r < R; r += G) /* the G heads of a query are contiguous */
                load_row(q, dtype, row_offset(x, r, Sq, Hq, G, D), G * D, qf + r * D);
            attend_path(qf, R, G, D, dtype, k, v, (x.b * C * Hkv + x.kvh) * D, Hkv * D, begin, end,
                        row_keys, causal ? 1 : 0, scale, kf, vf, s, acc, m, l);
            if (splits > 1) {
                float *partial = partials + item * partial_floats;
                memcpy(partial, acc, (size_t)(R * D) * sizeof(float));
                memcpy(partial + rows_max * D, m, (size_t)R * sizeof(float));
                memcpy(partial + rows_max * D + rows_max, l, (size_t)R * sizeof(float));
                continue;
            }
            for (int64_t r = 0; r < R; r++)
                for (int64_t d = 0; d < D; d++)
                    bn_store_float(out, dtype, row_offset(x, r, Sq, Hq, G, D) + d,
                                   acc[r * D + d] / l[r]);
        }
        free(buffer);
    }
    if (splits > 1 && !failed) {
        /* out = sum_s w_s acc_s / sum_s w_s l_s, w_s = e^(m_s - max_s m_s); an empty range has
         * m = -inf, so its weight is 0. */
#pragma omp parallel for schedule(static) \
    if ((double)tasks * splits * rows_max * D >= BN_CPU_PARALLEL_MIN_WORK)
        for (int64_t task = 0; task < tasks; task++) {
            struct task x = task_rows(task, Hkv, tiles, Sq, G);
            float *first = partials + task * splits * partial_floats;
            /* Split sp's partial starts at first + sp * partial_floats. */
            float *w = first + rows_max * D, *part_l = w + rows_max;
            for (int64_t r = 0; r < x.rows; r++) {
                float m_max = -INFINITY, l_total = 0.0f;
                for (int64_t sp = 0; sp < splits; sp++) {
                    float m_s = w[sp * partial_floats + r];
                    m_max = m_s > m_max ? m_s : m_max;
                }
                for (int64_t sp = 0; sp < splits; sp++) { /* m_s becomes w_s */
                    w[sp * partial_floats + r] = expf(w[sp * partial_floats + r] - m_max);
                    l_total += w[sp * partial_floats + r] * part_l[sp * partial_floats + r];
                }
                for (int64_t d = 0; d < D; d++) {
                    float sum = 0.0f;
                    for (int64_t sp = 0; sp < splits; sp++)
                        sum += w[sp * partial_floats + r] * first[sp * partial_floats + r * D + d];
                    bn_store_float(out, dtype, row_offset(x, r, Sq, Hq, G, D) + d, sum / l_total);
                }
            }
        }
    }
    free(partials);
    if (failed) return bn_fail(BITNET_ERR_OUT_OF_MEMORY, "bitnet_attention: out of host memory");
    return BITNET_OK;
}
