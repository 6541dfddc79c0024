/* CPU sampling, one row at a time (OpenMP over rows), the rule of docs/sampling.md: probabilities
 * p = expf((x - max) / temperature) in float32, sums and cumulative sums in float64, in candidate
 * order (index order without top-k and top-p). The candidates (top-k, or the
 * BN_SAMPLE_MAX_CANDIDATES most likely for top-p alone) are the row's ranks (bn_sample_rank) sorted
 * in descending order: the GPU keeps the same set in the same order. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "../internal.h"

static int descending(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* The token of one row; ranks: room for V ranks. */
static int64_t sample_row(const float *x, int64_t V, double u, float temperature, int32_t top_k,
                          float top_p, uint64_t *ranks) {
    uint64_t first = 0;
    for (int64_t i = 0; i < V; i++) {
        const uint64_t rank = bn_sample_rank(x[i], i);
        first = rank > first ? rank : first;
    }
    const int64_t best = bn_sample_rank_index(first);
    const float m = x[best];
    if (!isfinite(m)) return best; /* a NaN or +inf logit, or all -inf: the argmax */

    if (top_k == 0 && top_p >= 1.0f) { /* the whole vocabulary, in index order */
        double total = 0.0, cum = 0.0;
        for (int64_t i = 0; i < V; i++) total += expf((x[i] - m) / temperature);
        const double target = u * total;
        int64_t last = best;
        for (int64_t i = 0; i < V; i++) {
            const float p = expf((x[i] - m) / temperature);
            last = p > 0.0f ? i : last;
            cum += p;
            if (cum > target) return i;
        }
        return last; /* target rounded up to the total */
    }

    const int64_t limit = top_k > 0 ? top_k : BN_SAMPLE_MAX_CANDIDATES, K = limit < V ? limit : V;
    for (int64_t i = 0; i < V; i++) ranks[i] = bn_sample_rank(x[i], i);
    qsort(ranks, (size_t)V, sizeof *ranks, descending);
    double cum[BN_SAMPLE_MAX_CANDIDATES], sum = 0.0;
    for (int64_t j = 0; j < K; j++) {
        sum += expf((x[bn_sample_rank_index(ranks[j])] - m) / temperature);
        cum[j] = sum;
    }
    int64_t kept = K;
    if (top_p < 1.0f) {
        double z = cum[K - 1]; /* top-k's softmax, or without top-k, the whole vocabulary's */
        if (top_k == 0) {
            z = 0.0;
            for (int64_t i = 0; i < V; i++) z += expf((x[i] - m) / temperature);
        }
        const double threshold = (double)top_p * z;
        for (kept = 1; kept < K && cum[kept - 1] < threshold; kept++) {}
    }
    const double target = u * cum[kept - 1];
    int64_t j = 0;
    while (j < kept && cum[j] <= target) j++;
    if (j == kept) /* target rounded up to the kept mass: the last kept token with p > 0 */
        for (j = kept - 1; j > 0 && cum[j] == cum[j - 1]; j--) {}
    return bn_sample_rank_index(ranks[j]);
}

bitnet_status bn_cpu_sample(const float *logits, int64_t N, int64_t V, uint64_t seed,
                            const int32_t *counters, float temperature, int32_t top_k, float top_p,
                            int32_t *index) {
    /* Each thread sorts its rows' ranks in its own slice: allocated before any row is written. */
    const int sorts = top_k > 0 || top_p < 1.0f, threads = omp_get_max_threads();
    uint64_t *ranks = sorts ? malloc((size_t)threads * (size_t)V * sizeof *ranks) : NULL;
    if (sorts && !ranks) return bn_fail(BITNET_ERR_OUT_OF_MEMORY, "bitnet_sample: out of host memory");
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) \
    if (N * V >= BN_CPU_PARALLEL_MIN_WORK)
    for (int64_t n = 0; n < N; n++) {
        const double u = bn_sample_uniform(seed, n, counters[n]);
        uint64_t *mine = sorts ? ranks + (size_t)omp_get_thread_num() * (size_t)V : NULL;
        index[n] = (int32_t)sample_row(logits + n * V, V, u, temperature, top_k, top_p, mine);
    }
    free(ranks);
    return BITNET_OK;
}
