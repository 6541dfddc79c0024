/* Sampling on the device (docs/sampling.md), one block of 1024 threads per row, the rule of
 * cpu/sample.c: the row's first rank (the argmax, or its NaN / inf case); then either the whole
 * vocabulary in index order (each warp sums the probabilities of a contiguous 32nd of the row, the
 * warp whose share holds the draw finds it with a scan), or the K candidates. For those, the first
 * pass also counts the order keys' top 11 bits; the bins from the top down to the one that holds
 * the K-th largest key are staged in shared memory by a second pass (up to kStaged ranks) and
 * sorted there. Where they do not fit (many equal logits), a radix select over the row (4 passes of
 * 8-bit digits) finds the K-th key and the ranks above it and the lowest-index ties at it are
 * gathered. The candidates' probabilities are scanned in float64, top-p and the draw come from
 * block counts. No workspace: 90 KB of shared memory. Bytes: the row is read 2 times (the L2 keeps
 * it for the second: 512 KB at V = 131072), or 6-7 on the radix path. Programmatic dependent
 * launch. */
#include "common.cuh"

namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32;
constexpr int kMaxCandidates = BN_SAMPLE_MAX_CANDIDATES;
static_assert(kMaxCandidates == kThreads, "one candidate per thread");
/* The first pass's histogram: the order keys' top kTopBits bits. The ranks staged in dynamic shared
 * memory: up to kStaged (64 KB). */
constexpr int kTopBits = 11, kTopBins = 1 << kTopBits, kStaged = 8192;

struct SampleShared {
    uint64_t rank[kMaxCandidates]; /* candidates' ranks, sorted in descending order */
    double cum[kMaxCandidates];     /* their cumulative probabilities */
    uint32_t histogram[kTopBins];   /* the first kTopBins entries serve the radix select */
    double warp_double[kWarps];
    uint64_t warp_rank[kWarps];
    int64_t warp_index[kWarps];
    int count_above, count_ties; /* gathered candidates */
    int digit, remaining, staged;
    double target;
    int64_t result;
};

__device__ __forceinline__ uint64_t shuffle_xor(uint64_t v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ double shuffle_xor(double v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }

__device__ __forceinline__ uint64_t warp_max(uint64_t v) {
#pragma unroll
    for (int m = 16; m > 0; m /= 2) v = max(v, shuffle_xor(v, m));
    return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
    for (int m = 16; m > 0; m /= 2) v += shuffle_xor(v, m);
    return v;
}

/* Inclusive prefix sum over the warp's lanes. */
__device__ __forceinline__ double warp_scan(double v) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
        const double other = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += other;
    }
    return v;
}

/* Block reductions and scans; every thread of the block calls them and gets the result. */
__device__ uint64_t block_max(uint64_t v, SampleShared &sm) {
    v = warp_max(v);
    __syncthreads(); /* the previous reader of warp_rank is done */
    if (threadIdx.x % 32 == 0) sm.warp_rank[threadIdx.x / 32] = v;
    __syncthreads();
    return warp_max(sm.warp_rank[threadIdx.x % 32]);
}
__device__ double block_sum(double v, SampleShared &sm) {
    v = warp_sum(v);
    __syncthreads();
    if (threadIdx.x % 32 == 0) sm.warp_double[threadIdx.x / 32] = v;
    __syncthreads();
    return warp_sum(sm.warp_double[threadIdx.x % 32]);
}
__device__ double block_inclusive_scan(double v, SampleShared &sm) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_scan(v);
    __syncthreads();
    if (lane == 31) sm.warp_double[warp] = v;
    __syncthreads();
    const double before = warp_scan(sm.warp_double[lane]) - sm.warp_double[lane];
    return v + __shfl_sync(0xffffffffu, before, warp);
}

__device__ __forceinline__ float probability(float x, float m, float temperature) {
    return expf((x - m) / temperature);
}

/* The whole vocabulary, in index order: warp w takes elements [w S, (w + 1) S), S a multiple of 32. */
__device__ int64_t draw_from_all(const float *x, int64_t V, float m, float temperature, double u,
                                 SampleShared &sm) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t share = (V + kThreads - 1) / kThreads * 32;
    const int64_t begin = min(V, warp * share), end = min(V, begin + share);
    double sum = 0.0;
    int64_t last = -1; /* the last index with p > 0 */
    for (int64_t i = begin + lane; i < end; i += 32) {
        const float p = probability(x[i], m, temperature);
        sum += p;
        last = p > 0.0f ? i : last;
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int d = 16; d > 0; d /= 2) last = max(last, (int64_t)__shfl_xor_sync(0xffffffffu, (long long)last, d));
    if (lane == 0) sm.warp_double[warp] = sum, sm.warp_index[warp] = last;
    __syncthreads();
    if (threadIdx.x == 0) { /* the warp whose share holds u * total */
        double total = 0.0;
        for (int w = 0; w < kWarps; w++) total += sm.warp_double[w];
        const double target = u * total;
        double before = 0.0;
        int w = 0;
        while (w < kWarps - 1 && before + sm.warp_double[w] <= target) before += sm.warp_double[w++];
        sm.digit = w;
        sm.target = target - before;
    }
    __syncthreads();
    const int chosen = sm.digit;
    if (warp != chosen) return -1;
    const int64_t chosen_begin = min(V, chosen * share), chosen_end = min(V, chosen_begin + share);
    const double target = sm.target;
    double cum = 0.0;
    for (int64_t i0 = chosen_begin; i0 < chosen_end; i0 += 32) {
        const int64_t i = i0 + lane;
        const double p = i < chosen_end ? probability(x[i], m, temperature) : 0.0;
        const double through = cum + warp_scan(p);
        const unsigned over = __ballot_sync(0xffffffffu, i < chosen_end && through > target);
        if (over) return i0 + __ffs(over) - 1;
        cum = __shfl_sync(0xffffffffu, through, 31);
    }
    /* target rounded up to the share's sum: its last token with p > 0, else the row's */
    int64_t fallback = sm.warp_index[chosen];
    for (int w = chosen - 1; fallback < 0 && w >= 0; w--) fallback = sm.warp_index[w];
    return fallback;
}

/* Adds 1 to histogram[digit] for each lane with `in` set, one atomic per distinct digit. The
 * whole warp calls it. */
__device__ __forceinline__ void count_digit(bool in, uint32_t digit, SampleShared &sm) {
    const unsigned in_mask = __ballot_sync(0xffffffffu, in);
    if (!in) return;
    const unsigned peers = __match_any_sync(in_mask, digit);
    if ((int)(threadIdx.x % 32) == __ffs(peers) - 1) atomicAdd(&sm.histogram[digit], __popc(peers));
}

/* The bin of the first pass's histogram that holds the K-th largest key, and how many keys lie in
 * the bins above it: thread t holds bins kTopBins - 1 - 2t and kTopBins - 2 - 2t. */
__device__ void top_bin(int K, SampleShared &sm, int *bin, int *above) {
    const int hi = kTopBins - 1 - 2 * (int)threadIdx.x;
    const uint32_t a = sm.histogram[hi], b = sm.histogram[hi - 1];
    const double through = block_inclusive_scan((double)(a + b), sm), before = through - (a + b);
    if (before < K && through >= K) {
        const bool first = before + a >= K;
        sm.digit = first ? hi : hi - 1;
        sm.remaining = (int)before + (first ? 0 : (int)a);
    }
    __syncthreads();
    *bin = sm.digit, *above = sm.remaining;
    __syncthreads();
}

/* The K-th largest order key of the row (radix select, most significant digit first); sets
 * sm.remaining to how many elements with that key are among the K (the others are above it). */
__device__ uint32_t kth_key(const float *x, int64_t V, int K, SampleShared &sm) {
    uint32_t prefix = 0, mask = 0;
    int remaining = K;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += kThreads) sm.histogram[b] = 0;
        __syncthreads();
        for (int64_t base = threadIdx.x / 32 * 32; base < V; base += kThreads) {
            const int64_t i = base + threadIdx.x % 32;
            const uint32_t key = i < V ? bn_sample_order_key(x[i]) : 0;
            count_digit(i < V && (key & mask) == prefix, (key >> shift) & 0xFFu, sm);
        }
        __syncthreads();
        if (threadIdx.x < 32) { /* lane l holds digits 255 - 8l .. 248 - 8l, from the top */
            const int lane = threadIdx.x;
            uint32_t counts[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) counts[j] = sm.histogram[255 - 8 * lane - j], sum += counts[j];
            uint32_t through = sum; /* inclusive scan of the lanes' sums */
#pragma unroll
            for (int d = 1; d < 32; d *= 2) {
                const uint32_t other = __shfl_up_sync(0xffffffffu, through, d);
                if (lane >= d) through += other;
            }
            const uint32_t before = through - sum;
            const unsigned holds = __ballot_sync(0xffffffffu, before < (uint32_t)remaining &&
                                                                  through >= (uint32_t)remaining);
            if (lane == __ffs(holds) - 1) {
                uint32_t above = before;
                int j = 0;
                while (above + counts[j] < (uint32_t)remaining) above += counts[j++];
                sm.digit = 255 - 8 * lane - j;
                sm.remaining = remaining - (int)above;
            }
        }
        __syncthreads();
        prefix |= (uint32_t)sm.digit << shift;
        mask |= 0xFFu << shift;
        remaining = sm.remaining;
        __syncthreads(); /* before the next pass clears the histogram and sm.digit is rewritten */
    }
    return prefix;
}

/* The K candidates' ranks into sm.rank[0, K), unsorted: every element with a key above `key`, and
 * the sm.remaining lowest-index elements with the key itself. */
__device__ void gather(const float *x, int64_t V, int K, uint32_t key, SampleShared &sm) {
    const int ties_taken = sm.remaining, above = K - ties_taken;
    const uint32_t ties = sm.histogram[key & 0xFFu]; /* the last pass counted the full key */
    if (threadIdx.x == 0) sm.count_above = 0, sm.count_ties = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
        const uint32_t k = bn_sample_order_key(x[i]);
        if (k > key) sm.rank[atomicAdd(&sm.count_above, 1)] = bn_sample_rank(x[i], i);
        else if (k == key && ties == (uint32_t)ties_taken)
            sm.rank[above + atomicAdd(&sm.count_ties, 1)] = bn_sample_rank(x[i], i);
    }
    if (ties == (uint32_t)ties_taken) return;
    /* Only some of the ties: the lowest indices. Thread t counts those in its contiguous chunk of
     * the row, then takes them in order while their rank among all ties is below ties_taken. */
    const int64_t chunk = (V + kThreads - 1) / kThreads;
    const int64_t begin = min(V, threadIdx.x * chunk), end = min(V, begin + chunk);
    int mine = 0;
    for (int64_t i = begin; i < end; i++) mine += bn_sample_order_key(x[i]) == key;
    int rank = (int)(block_inclusive_scan((double)mine, sm) - mine);
    for (int64_t i = begin; i < end && rank < ties_taken; i++)
        if (bn_sample_order_key(x[i]) == key) sm.rank[above + rank++] = bn_sample_rank(x[i], i);
}

/* Sorts rank[0, n) (shared memory) in descending order, n a power of two (bitonic). */
__device__ void sort_descending(uint64_t *rank, int n) {
    for (int size = 2; size <= n; size *= 2) {
        for (int stride = size / 2; stride > 0; stride /= 2) {
            __syncthreads();
            for (int i = threadIdx.x; i < n; i += kThreads) {
                const int j = i ^ stride;
                if (j > i) {
                    const bool descending = (i & size) == 0;
                    const uint64_t a = rank[i], b = rank[j];
                    if ((a < b) == descending) rank[i] = b, rank[j] = a;
                }
            }
        }
    }
    __syncthreads();
}

__global__ void __launch_bounds__(kThreads)
sample_kernel(const float *__restrict__ logits, int64_t V, uint64_t seed,
              const int32_t *__restrict__ counters, float temperature, int top_k, float top_p,
              int32_t *__restrict__ index) {
    __shared__ SampleShared sm;
    extern __shared__ uint64_t staged[]; /* [kStaged] */
    bn_pdl_wait();
    bn_pdl_launch_dependents();
    const int64_t row = blockIdx.x;
    const float *x = logits + row * V;
    const bool all = top_k == 0 && top_p >= 1.0f;
    const int K = (int)min((int64_t)(top_k > 0 ? top_k : kMaxCandidates), V);
    const bool select = !all && K < V; /* the first pass also counts the keys' top bits */
    if (select) {
        for (int b = threadIdx.x; b < kTopBins; b += kThreads) sm.histogram[b] = 0;
        __syncthreads();
    }
    uint64_t first = 0;
    for (int64_t base = threadIdx.x / 32 * 32; base < V; base += kThreads) { /* whole warps */
        const int64_t i = base + threadIdx.x % 32;
        const uint64_t rank = i < V ? bn_sample_rank(x[i], i) : 0;
        first = max(first, rank);
        if (select) count_digit(i < V, (uint32_t)(rank >> (64 - kTopBits)), sm);
    }
    first = block_max(first, sm);
    const int64_t best = bn_sample_rank_index(first);
    const float m = x[best];
    if (!isfinite(m)) { /* a NaN or +inf logit, or all -inf: the argmax */
        if (threadIdx.x == 0) index[row] = (int32_t)best;
        return;
    }
    const double u = bn_sample_uniform(seed, row, counters[row]);
    if (all) {
        const int64_t token = draw_from_all(x, V, m, temperature, u, sm);
        if (token >= 0 && threadIdx.x % 32 == 0) index[row] = (int32_t)token;
        return;
    }

    /* The candidates, sorted, into ranks[0, K); z_all: the whole vocabulary's sum where top-p
     * alone needs it (-1: not computed yet). */
    uint64_t *ranks = sm.rank;
    double z_all = -1.0;
    int n = 1;
    if (!select) { /* K == V */
        while (n < K) n *= 2;
        for (int i = threadIdx.x; i < n; i += kThreads) ranks[i] = i < V ? bn_sample_rank(x[i], i) : 0;
    } else {
        int bin = 0, above = 0;
        top_bin(K, sm, &bin, &above);
        const int count = above + (int)sm.histogram[bin];
        if (count <= kStaged) { /* the bins from `bin` up, staged and sorted */
            if (threadIdx.x == 0) sm.staged = 0;
            __syncthreads();
            double z = 0.0;
            for (int64_t i = threadIdx.x; i < V; i += kThreads) {
                const uint64_t rank = bn_sample_rank(x[i], i);
                if ((int)(rank >> (64 - kTopBits)) >= bin) staged[atomicAdd(&sm.staged, 1)] = rank;
                if (top_k == 0) z += probability(x[i], m, temperature);
            }
            if (top_k == 0) z_all = block_sum(z, sm);
            while (n < count) n *= 2;
            __syncthreads();
            for (int i = count + threadIdx.x; i < n; i += kThreads) staged[i] = 0; /* below every rank */
            ranks = staged;
        } else { /* too many: a radix select over the row */
            const uint32_t key = kth_key(x, V, K, sm);
            gather(x, V, K, key, sm);
            while (n < K) n *= 2;
            __syncthreads();
            for (int i = K + threadIdx.x; i < n; i += kThreads) ranks[i] = 0;
        }
    }
    sort_descending(ranks, n);

    const int j = threadIdx.x; /* candidate j */
    const float p = j < K ? probability(x[bn_sample_rank_index(ranks[j])], m, temperature) : 0.0f;
    const double cum = block_inclusive_scan(p, sm);
    sm.cum[j] = cum;
    int kept = K;
    if (top_p < 1.0f) {
        double z = z_all; /* top-k's softmax, or without top-k, the whole vocabulary's */
        if (top_k == 0 && z < 0.0) {
            z = 0.0;
            for (int64_t i = threadIdx.x; i < V; i += kThreads) z += probability(x[i], m, temperature);
            z = block_sum(z, sm);
        } else if (top_k > 0) {
            __syncthreads();
            z = sm.cum[K - 1];
        }
        const double threshold = (double)top_p * z;
        kept = min(K, __syncthreads_count(j < K && cum < threshold) + 1);
    }
    __syncthreads();
    const double target = u * sm.cum[kept - 1];
    int chosen = __syncthreads_count(j < kept && cum <= target);
    if (chosen == kept) { /* target rounded up to the kept mass: the last kept token with p > 0 */
        chosen = kept - 1;
        while (chosen > 0 && sm.cum[chosen] == sm.cum[chosen - 1]) chosen--;
    }
    if (threadIdx.x == 0) index[row] = (int32_t)bn_sample_rank_index(ranks[chosen]);
}

} // namespace

bitnet_status bn_cuda_sample(int32_t device, const float *logits, int64_t N, int64_t V,
                             uint64_t seed, const int32_t *counters, float temperature,
                             int32_t top_k, float top_p, int32_t *index, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BN_CHECK(N <= INT32_MAX, "bitnet_sample: N = %lld rows is more than one launch takes", (long long)N);
    const size_t staged_bytes = kStaged * sizeof(uint64_t);
    BN_TRY(bn_cuda_kernel_shared_memory(device, reinterpret_cast<const void *>(sample_kernel), staged_bytes));
    BN_CUDA_TRY(bn_launch_pdl(sample_kernel, dim3((unsigned)N), dim3(kThreads), staged_bytes, bn_stream(stream),
                              logits, V, seed, counters, temperature, (int)top_k, top_p, index));
    return BITNET_OK;
}
