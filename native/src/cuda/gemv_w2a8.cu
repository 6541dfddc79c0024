/* CUDA W2A8 GEMV: y[n, m] = (dot(codes[m], x_q[n]) - sum(x_q[n])) * w_scales[m] / x_scales[n],
 * codes = W_q + 1 (docs/weight_format.md: (word >> 2i) & 0x03030303 is the codes of 4 consecutive
 * weights). The weights are streamed from HBM exactly once per launch.
 * - 1 token, dp4a: x is staged in shared memory (16-byte pieces swizzled so that the reads are
 *   conflict-free), its sum found on the way; for rows of more than 2 steps, the second step is
 *   prefetched into L2 meanwhile. A warp owns 4 rows, 8 lanes per row; a lane loads 10
 *   16-byte chunks of its row at a time and prefetches the next 10 while it computes (10 takes
 *   K = 5120 in one step; it beat 8 and 12 at the one-token anchor shapes:
 *   docs/log/2026-11-22.md#2026-11-22-11).
 * - 2..16 tokens, int8 tensor cores (mma.m16n8k32): a block owns 16 rows and 8 tokens (9 to 16
 *   tokens: two rows of blocks), its 8 warps split K (5 or 6 warps where that takes as many steps
 *   and lets more blocks run at once, and 32 rows where that then takes one round: plan_mma8);
 *   lane (g, t) loads 16 bytes of rows g and g+8 at chunk 4s+t, which feed 8 mma steps; the mma's
 *   k order is a permutation of K, applied to x alike. x is read straight from global memory into
 *   the B fragments (L1 serves it again to later tiles and to the SM's other blocks). The warps'
 *   partial tiles meet in shared memory, and 128 threads finish one output each. The sums of x that
 *   turn codes into W_q are taken during a block's first tile, which is compiled apart.
 * Both mask the codes in place where they can (dp4a and mma with unsigned weight bytes, partial
 * dots 4^i times too big, shifted back once at the end): one operation fewer per 4 weights.
 * - The fused one-token forms (gemv_one_token_fused), one kernel each:
 *   - bitnet_gemv_w2a8_rope_append_kv, a RoPE epilogue: rope_row's order puts the two rows of each
 *     RoPE pair in lanes l and l ^ 8 of a warp, which rotate them as they store them to q and the
 *     KV cache;
 *   - bitnet_gemv_w2a8_add_norm_stats, an epilogue that adds each output to the residual and leaves
 *     the block's sum of squares and max |v w| of the new residual in its stats slot;
 *   - bitnet_rmsnorm_gemv_w2a8 (and its RoPE form), a prologue that makes x from h and those slots:
 *     every warp sums the slots and every block quantizes the RMSNorm of h itself, so no norm
 *     kernel runs between the two GEMVs.
 * Programmatic dependent launch: the first weight loads and the weight scales are issued before
 * griddepcontrol.wait, x and its scales are read after it. Bytes: M*K/4 + N*K + N*M*4. H100, L2
 * cold (bench_gemv.py, BENCHMARKS.md, 2026-11-26): 55296x5120 24.0 us = 2960 GB/s (95% of read
 * BW), 5120x27648 13.3 us (85%), 2560x2560 1.84 us; 8 tokens: 13824x2560 5.5 us, 2560x6912 4.6 us,
 * 2560x2560 2.6 us. Why each constant has its value: docs/developing.md's rules and docs/log/. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <float.h>

#include <type_traits>

#include "common.cuh"
#include "gemv_dp4a.cuh"

namespace {

using namespace bn_gemv;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

/* dp4a kernel, one token */
constexpr int kLanesPerRow = 8;
constexpr int kRowsPerWarp = 32 / kLanesPerRow;
constexpr int kChunksPerLane = 10;
constexpr int kOneTokenBlocksPerSm = 2;
constexpr int kPrefetchSteps = 1; /* for rows of more than 2 steps: see gemv_one_token */

/* mma kernel, up to 16 tokens */
constexpr int kRowsPerBlock = 16;
constexpr int kStepsPerLoad = 2; /* 64-byte chunk quads per warp per load */
constexpr int kMmaBlocksPerSm = 3;      /* blocks of 8 warps */
constexpr int kMmaSmallBlocksPerSm = 4; /* blocks of 5 or 6 warps (plan_mma8) */

/* From this many tokens on, sm_80+ GPUs take the tensor-core GEMM (gemm_w2a8.cu) instead of the
 * launches of 16 tokens that read the weights again each. Measured crossover on an H100:
 * docs/log/2026-11-26.md#2026-11-26-10 (built with -DBN_GEMM_MIN_TOKENS=n to time other choices). */
#ifndef BN_GEMM_MIN_TOKENS
#define BN_GEMM_MIN_TOKENS 17
#endif
constexpr int64_t kGemmMinTokens = BN_GEMM_MIN_TOKENS;
/* On compute capability 9.0, matrices of at least 2^25 weights take the GEMM's 16-token tiles from
 * 9 tokens on: 13824 x 2560 at 16 tokens 11.4 -> 9.4 us, 5120 x 27648 34.7 -> 22.7, 55296 x 5120
 * 58.9 -> 41.6, the batch-16 decode step 1.693 -> 1.618 ms; below 2^25, and at 8 tokens, the GEMV
 * is faster (2560 x 6912 at 16: 6.0 against 8.1; H200, docs/log/2026-12-03.md#2026-12-03-2). */
constexpr int64_t kGemmLargeMinTokens = 9, kGemmLargeWeights = int64_t{1} << 25;

struct GemvArgs {
    const uint4 *w;        /* [M, K/64]: 16-byte chunks of 64 weights */
    const float *w_scales;
    const int8_t *x_q;     /* first token of this launch */
    const float *x_scales; /* first token of this launch */
    void *y;               /* first token of this launch: y[n * M + m] */
    int32_t y_dtype;
    int M, K, n_valid;
};

/* sum + the 16 signed bytes of v. */
__device__ __forceinline__ int add_bytes(const int4 &v, int sum) {
    return __dp4a(v.x, 0x01010101, __dp4a(v.y, 0x01010101, __dp4a(v.z, 0x01010101, __dp4a(v.w, 0x01010101, sum))));
}

/* Copies x of the one token into the tile; returns the sum of the x bytes this thread copied. The
 * caller syncs before reading the tile. */
__device__ int stage_x(const GemvArgs &a, int8_t *x_tile) {
    int sum = 0;
    for (int piece = threadIdx.x; piece < a.K / 16; piece += kThreads) {
        const int4 v = reinterpret_cast<const int4 *>(a.x_q)[piece];
        *reinterpret_cast<int4 *>(x_tile + x_offset(piece / 4, piece % 4)) = v;
        sum = add_bytes(v, sum);
    }
    return sum;
}

/* The codes of 4 consecutive weights, shift i of a packed word (docs/weight_format.md), masked in
 * place: codes << 2 for odd i, which saves the shift of (word >> 2i) & 0x03030303. */
__device__ __forceinline__ uint32_t masked_codes(uint32_t word, int i) {
    return (i < 2 ? word : word >> 4) & (i % 2 ? 0x0C0C0C0Cu : 0x03030303u);
}

__device__ __forceinline__ int component(const int4 &v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/* y[n, m] from the exact dot; the scales were loaded ahead (0 where the output is not stored). */
__device__ __forceinline__ void store(const GemvArgs &a, int n, int m, int dot, float w_scale, float x_scale) {
    int64_t index = static_cast<int64_t>(n) * a.M + m;
    if (a.y_dtype == BITNET_DTYPE_I32) {
        static_cast<int *>(a.y)[index] = dot;
        return;
    }
    float value = bn_w2a8_scaled(static_cast<float>(dot), w_scale, x_scale);
    if (a.y_dtype == BITNET_DTYPE_F32) static_cast<float *>(a.y)[index] = value;
    else if (a.y_dtype == BITNET_DTYPE_F16) static_cast<__half *>(a.y)[index] = __float2half_rn(value);
    else static_cast<__nv_bfloat16 *>(a.y)[index] = __float2bfloat16_rn(value);
}

/* The RoPE epilogue of bitnet_gemv_w2a8_rope_append_kv: the M = (Hq + 2 Hkv) D rows of a fused QKV
 * projection go to q and row *position of the caches, each q and k head's pairs (i, i + D/2) turned
 * as bitnet_rope_append_kv turns them. */
struct RopeArgs {
    void *q, *k_cache, *v_cache;
    const int32_t *position;
    double log2_theta;
    int Hq, Hkv, D, C;
};

/* Rows in the order the RoPE epilogue takes them: in the q and k heads, virtual row 4u + r (a warp's
 * tile u, the lanes of r = lane / 8) is pair i = 2u' + r / 2 of its head (u' the tile within the
 * head), row i for even r and i + D/2 for odd r, so that lanes l and l ^ 8 hold the two rows of a
 * pair (D % 4 == 0: a tile never straddles two heads); the v heads keep their order. */
__device__ __forceinline__ int rope_row(const RopeArgs &r, int row) {
    if (row >= (r.Hq + r.Hkv) * r.D) return row;
    const int head = row / r.D, j = row - head * r.D;
    return head * r.D + j / 2 + (j % 2) * (r.D / 2);
}

/* Stores the output of (physical) row `row`, value `y` rounded to T, its pair's partner's from lane
 * ^ 8: rotated q and k rows to q and the k cache, v rows to the v cache. Every lane of the warp
 * calls it (the shuffle); the lanes with store set write. */
template <typename T>
__device__ __forceinline__ void store_rope(const RopeArgs &r, int row, float y, float cs, float sn, int p,
                                           bool store) {
    const float mine = to_float(from_float<T>(y));
    const float other = __shfl_xor_sync(~0u, mine, kLanesPerRow);
    if (!store || p < 0 || p >= r.C) return; /* a position out of range writes nothing */
    const int rotated = (r.Hq + r.Hkv) * r.D;
    const int64_t cache_row = static_cast<int64_t>(p) * r.Hkv * r.D;
    if (row >= rotated) {
        static_cast<T *>(r.v_cache)[cache_row + row - rotated] = from_float<T>(mine);
        return;
    }
    const int head = row / r.D, j = row - head * r.D;
    const bool first = j < r.D / 2; /* x[i], whose partner is x[i + D/2] */
    T lo, hi;
    bn_rope_rotate(first ? mine : other, first ? other : mine, cs, sn, lo, hi);
    const T out = first ? lo : hi;
    if (head < r.Hq) static_cast<T *>(r.q)[row] = out;
    else static_cast<T *>(r.k_cache)[cache_row + row - r.Hq * r.D] = out;
}

/* The norm statistics that bitnet_gemv_w2a8_add_norm_stats leaves for bitnet_rmsnorm_gemv_w2a8: per
 * slot (a block of the producer; the slots past its grid zero) the float32 sum of v^2 and the max
 * |v w| (NaN if any product is) of its rows of the new residual v, w the next norm's weight. */
struct NormStats {
    float sum, max;
};

/* The producer's epilogue (kAddStats): residual[m] += y[m] as bitnet_rmsnorm's residual add does
 * (y rounded to T, the sum rounded to T), the statistics of the stored values into the slots. */
struct AddStatsArgs {
    void *residual;
    const void *norm_weight;
    NormStats *stats;
    int slots;
};

/* The consumer's prologue (kNormed): x = the int8 codes of rmsnorm(h) * norm_weight with eps, as
 * bitnet_rmsnorm's y_q and y_scales, 1 / RMS from the summed slots. */
struct NormedInputArgs {
    const void *h;
    const void *norm_weight;
    const NormStats *stats;
    int slots;
    float eps;
};

enum OneTokenInput { kCodes, kNormed };
enum OneTokenOutput { kStore, kRope, kAddStats };

struct FusedArgs {
    RopeArgs rope;
    AddStatsArgs add;
    NormedInputArgs in;
};

/* The normed input: K <= 16 * kThreads * kNormedPieces, and at most 32 * kSlotsPerLane slots (the
 * entry points check both). */
constexpr int kNormedPieces = 2;
constexpr int kSlotsPerLane = 16;
static_assert(16 * kThreads * kNormedPieces == BN_CUDA_NORMED_MAX_K && 32 * kSlotsPerLane == BN_CUDA_NORMED_MAX_SLOTS,
              "internal.h states the normed input's limits");

__device__ __forceinline__ NormStats combine(NormStats a, NormStats b) {
    return {a.sum + b.sum, bn_fmax_nan(a.max, b.max)};
}

__device__ __forceinline__ NormStats shuffle_combine(NormStats v, int lane_mask) {
    return combine(v, {__shfl_xor_sync(~0u, v.sum, lane_mask), __shfl_xor_sync(~0u, v.max, lane_mask)});
}

/* The slots summed by one warp, in a fixed order (every warp of every block finds the same):
 * lane l takes slots l, l + 32, ..., then the lanes' partials meet by shuffles. No barrier. */
__device__ __forceinline__ NormStats sum_slots(const NormedInputArgs &in) {
    const int lane = threadIdx.x % 32;
    NormStats slot[kSlotsPerLane];
#pragma unroll
    for (int j = 0; j < kSlotsPerLane; j++)
        if (lane + 32 * j < in.slots) {
            /* a plain load: the read-only path (ld.global.nc) may serve a line cached before the
             * producer wrote it */
            const float2 v = reinterpret_cast<const float2 *>(in.stats)[lane + 32 * j];
            slot[j] = {v.x, v.y};
        } else {
            slot[j] = {0.0f, 0.0f};
        }
    NormStats v = slot[0];
#pragma unroll
    for (int j = 1; j < kSlotsPerLane; j++) v = combine(v, slot[j]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v = shuffle_combine(v, offset);
    return v;
}

/* Element j (0..7) of 8 values of T packed in 16 bytes, as float, without taking the vector's address
 * (which would put it in local memory). */
template <typename T> __device__ __forceinline__ float element(const uint4 &v, int j) {
    const uint32_t word = j < 2 ? v.x : j < 4 ? v.y : j < 6 ? v.z : v.w;
    const uint32_t bits = j % 2 ? word >> 16 : word & 0xFFFFu;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(bits << 16);
    else return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

/* This thread's pieces of a K-vector of T for the normed input: 16 values (two 16-byte vectors) at
 * piece threadIdx.x + i * kThreads, zeros past K / 16. */
__device__ __forceinline__ void load_pieces(const void *src, int K, uint4 (&out)[kNormedPieces][2]) {
#pragma unroll
    for (int i = 0; i < kNormedPieces; i++) {
        const int piece = threadIdx.x + i * kThreads;
        if (piece < K / 16) {
            out[i][0] = static_cast<const uint4 *>(src)[2 * piece];
            out[i][1] = static_cast<const uint4 *>(src)[2 * piece + 1];
        }
    }
}

/* 16 codes of the normed input from 16 values of h and of the norm weight (two 16-byte vectors
 * each), with rmsnorm.cu's write_outputs rule; returns them as one int4. */
template <typename T>
__device__ __forceinline__ int4 normed_codes(const uint4 (&h)[2], const uint4 (&w)[2], float r_scale, bool finite) {
    uint32_t words[4];
#pragma unroll
    for (int q = 0; q < 4; q++) {
        uint32_t word = 0;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            const int j = (q % 2) * 4 + b;
            const float p = element<T>(h[q / 2], j) * element<T>(w[q / 2], j);
            const float c = finite ? p * r_scale : fminf(fmaxf(p * r_scale, -128.0f), 127.0f);
            word |= (__float_as_uint(__fadd_rn(c, 12582912.0f)) & 0xFFu) << (8 * b);
        }
        words[q] = word;
    }
    return make_int4(words[0], words[1], words[2], words[3]);
}

/* PREFETCH: how many steps after the first the kernel requests into L2 while it stages x (see
 * below); 0 for rows of at most 2 steps. BLOCK_MAJOR_TAIL: where the tiles take more than one
 * round of the grid's warps (see below). T: void for the plain GEMV, else the dtype of the fused
 * forms' h, residual, q and caches. INPUT: x as codes, or normed from h (NormedInputArgs). OUTPUT:
 * y stored, rotated (RopeArgs: the rows in rope_row's order) or added (AddStatsArgs). */
template <int PREFETCH, bool BLOCK_MAJOR_TAIL, typename T, int INPUT, int OUTPUT>
__device__ __forceinline__ void one_token(const GemvArgs &a, const FusedArgs &f) {
    constexpr bool kRotate = OUTPUT == kRope;
    const RopeArgs &rope = f.rope;
    extern __shared__ int4 shared[];
    int8_t *x_tile = reinterpret_cast<int8_t *>(shared);
    int *warp_x_sums = reinterpret_cast<int *>(x_tile + a.K);

    const int lane = threadIdx.x % 32, sub = lane % kLanesPerRow;
    const int chunks_per_row = a.K / 64;
    const int iterations = (chunks_per_row + kLanesPerRow * kChunksPerLane - 1) / (kLanesPerRow * kChunksPerLane);
    const int tiles = (a.M + kRowsPerWarp - 1) / kRowsPerWarp;
    /* The first round of tiles is numbered warp-major, which spreads them evenly over the blocks,
     * hence over the SMs. With BLOCK_MAJOR_TAIL the later rounds are numbered block-major: the
     * last round's tiles then sit in the first blocks, and the other blocks exit after one round,
     * so that the next kernel's blocks take their places early and issue their weight loads (PDL)
     * (docs/log/2026-11-24.md#2026-11-24-6). */
    const int warp_stride = gridDim.x * kWarps;
    int tile = (threadIdx.x / 32) * gridDim.x + blockIdx.x;
    const int second_tile = warp_stride + blockIdx.x * kWarps + threadIdx.x / 32;
    auto next_of = [&](int tile_) {
        return BLOCK_MAJOR_TAIL && tile_ < warp_stride ? second_tile : tile_ + warp_stride;
    };

    /* This lane's row of a tile, and its chunk u of a step of that row. */
    auto lane_row = [&](int tile_) {
        const int row = tile_ * kRowsPerWarp + lane / kLanesPerRow;
        return kRotate ? rope_row(rope, row) : row;
    };
    auto lane_chunk = [&](int iteration, int u) { return (iteration * kChunksPerLane + u) * kLanesPerRow + sub; };

    auto load = [&](uint4 (&w)[kChunksPerLane], int tile_, int iteration) {
        int row = lane_row(tile_);
#pragma unroll
        for (int u = 0; u < kChunksPerLane; u++) {
            int chunk = lane_chunk(iteration, u);
            w[u] = row < a.M && chunk < chunks_per_row
                       ? __ldcs(a.w + static_cast<int64_t>(row) * chunks_per_row + chunk)
                       : make_uint4(0, 0, 0, 0);
        }
    };

    /* L2 prefetches of this lane's chunks of one step: requests in flight that hold no registers. */
    auto prefetch = [&](int tile_, int iteration) {
        int row = lane_row(tile_);
#pragma unroll
        for (int u = 0; u < kChunksPerLane; u++) {
            int chunk = lane_chunk(iteration, u);
            if (row < a.M && chunk < chunks_per_row)
                asm volatile("prefetch.global.L2 [%0];"
                             ::"l"(a.w + static_cast<int64_t>(row) * chunks_per_row + chunk));
        }
    };

    auto row_scale = [&](int tile_) {
        int row = lane_row(tile_);
        return tile_ < tiles && row < a.M ? a.w_scales[row] : 0.0f;
    };

    /* RoPE: the inverse frequency of this lane's pair in a tile (0 past the last tile) */
    auto inv_freq = [&](int tile_) {
        return kRotate && tile_ < tiles ? bn_rope_inv_freq(lane_row(tile_) % rope.D % (rope.D / 2), rope.D,
                                                         rope.log2_theta)
                                      : 0.0;
    };

    /* AddStats: the next norm's weight of this lane's row (the residual is read after the wait) */
    auto row_norm_weight = [&](int tile_) {
        int row = lane_row(tile_);
        if constexpr (OUTPUT == kAddStats)
            return tile_ < tiles && row < a.M ? to_float(static_cast<const T *>(f.add.norm_weight)[row]) : 0.0f;
        return 0.0f;
    };
    auto row_residual = [&](int tile_) {
        int row = lane_row(tile_);
        if constexpr (OUTPUT == kAddStats)
            return tile_ < tiles && row < a.M ? to_float(static_cast<const T *>(f.add.residual)[row]) : 0.0f;
        return 0.0f;
    };

    /* The weights, their scales, RoPE's frequencies and the norm weights never depend on the
     * previous kernel. */
    uint4 w[kChunksPerLane];
    if (tile < tiles) load(w, tile, 0);
    float w_scale = row_scale(tile);
    double freq = inv_freq(tile);
    float norm_w = row_norm_weight(tile);
    uint4 in_w[kNormedPieces][2] = {};
    if constexpr (INPUT == kNormed) load_pieces(f.in.norm_weight, a.K, in_w);
    bn_pdl_launch_dependents();
    bn_pdl_wait();
    const int position = kRotate ? *rope.position : 0;
    float residual = row_residual(tile);
    /* Long rows: staging x (K bytes per block) keeps the loop from issuing the second step's loads,
     * so HBM would idle for this SM meanwhile; an L2 prefetch of that one step fills the gap (two
     * steps, or before the PDL wait, did worse). Rows of at most 2 steps take PREFETCH = 0, where a
     * prefetch was slower (docs/log/2026-11-23.md#2026-11-23-26). */
    for (int step = 1; step <= PREFETCH && step < iterations && tile < tiles; step++)
        prefetch(tile, step);
    float x_scale;
    int x_sum = 0;
    if constexpr (INPUT == kNormed) {
        uint4 h[kNormedPieces][2] = {};
        load_pieces(f.in.h, a.K, h);
        const NormStats all = sum_slots(f.in);
        /* 1 / RMS and the code scale, with bitnet_rmsnorm's rules (inverse_rms with eps > 0,
         * row_scale in rmsnorm.cu): where the float32 mean square is not a normal float, from the
         * float64 sum of squares of h (every thread takes this branch or none) */
        const float mean_square = all.sum / static_cast<float>(a.K) + f.in.eps;
        float r;
        if (mean_square >= FLT_MIN && mean_square <= FLT_MAX) {
            r = 1.0f / sqrtf(mean_square);
        } else {
            double sum = 0.0;
#pragma unroll
            for (int i = 0; i < kNormedPieces; i++)
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    const double v = element<T>(h[i][j / 8], j % 8);
                    sum += v * v;
                }
            __shared__ double warp_sums[kWarps];
            sum = bn_block_sum<kWarps>(sum, warp_sums);
            r = static_cast<float>(1.0 / sqrt(sum / a.K + static_cast<double>(f.in.eps)));
        }
        const float max_y = all.max * r;
        x_scale = isfinite(max_y) ? 127.0f / fmaxf(max_y, 1e-5f) : bn_nan();
        const float r_scale = r * x_scale;
        const bool finite = !isnan(x_scale);
#pragma unroll
        for (int i = 0; i < kNormedPieces; i++) {
            const int piece = threadIdx.x + i * kThreads;
            if (piece < a.K / 16) {
                const int4 codes = normed_codes<T>(h[i], in_w[i], r_scale, finite);
                *reinterpret_cast<int4 *>(x_tile + x_offset(piece / 4, piece % 4)) = codes;
                x_sum = add_bytes(codes, x_sum);
            }
        }
    } else {
        x_scale = a.x_scales[0];
        x_sum = stage_x(a, x_tile);
    }
    for (int offset = 16; offset > 0; offset /= 2) x_sum += __shfl_xor_sync(~0u, x_sum, offset);
    if (lane == 0) warp_x_sums[threadIdx.x / 32] = x_sum;
    __syncthreads();
    x_sum = 0;
    for (int warp = 0; warp < kWarps; warp++) x_sum += warp_x_sums[warp];

    NormStats stats = {0.0f, 0.0f}; /* AddStats: this lane's rows of the new residual */
    for (; tile < tiles; tile = next_of(tile)) {
        const float next_w_scale = row_scale(next_of(tile));
        const float next_norm_w = row_norm_weight(next_of(tile)), next_residual = row_residual(next_of(tile));
        /* RoPE: the cos and sin of this lane's pair (bn_rope_angle's p * inverse frequency) */
        float cs = 0.0f, sn = 0.0f;
        if constexpr (kRotate) {
            double sin_d, cos_d;
            sincos(static_cast<double>(position) * freq, &sin_d, &cos_d);
            cs = static_cast<float>(cos_d);
            sn = static_cast<float>(sin_d);
            freq = inv_freq(next_of(tile));
        }
        /* acc[i]: the dot of the codes at shift i, masked in place (4^i times the codes), so that
         * no shift is needed per word; they are exact multiples of 4^i. */
        int acc[4] = {};
        for (int iteration = 0; iteration < iterations; iteration++) {
            uint4 next[kChunksPerLane];
            int next_tile = iteration + 1 < iterations ? tile : next_of(tile);
            if (next_tile < tiles) load(next, next_tile, iteration + 1 < iterations ? iteration + 1 : 0);
#pragma unroll
            for (int u = 0; u < kChunksPerLane; u++) {
                int chunk = lane_chunk(iteration, u);
                if (chunk >= chunks_per_row) break;
                const uint32_t words[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    int4 x = *reinterpret_cast<const int4 *>(x_tile + x_offset(chunk, q));
                    /* x word 4q+j holds k = 16q+4j..+3 of the chunk: packed word q, shift j */
                    acc[0] = dp4a_u8_s8(words[q] & 0x03030303u, x.x, acc[0]);
                    acc[1] = dp4a_u8_s8(words[q] & 0x0C0C0C0Cu, x.y, acc[1]);
                    acc[2] = dp4a_u8_s8(words[q] & 0x30303030u, x.z, acc[2]);
                    acc[3] = dp4a_u8_s8(words[q] & 0xC0C0C0C0u, x.w, acc[3]);
                }
            }
#pragma unroll
            for (int u = 0; u < kChunksPerLane; u++) w[u] = next[u];
        }
        int dot = codes_dot(acc);
        for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(~0u, dot, offset);
        int row = lane_row(tile);
        if constexpr (OUTPUT == kRope) {
            store_rope<T>(rope, row, bn_w2a8_scaled(static_cast<float>(dot - x_sum), w_scale, x_scale), cs, sn,
                          position, sub == 0 && row < a.M);
        } else if constexpr (OUTPUT == kAddStats) {
            if (sub == 0 && row < a.M) {
                const float y = to_float(from_float<T>(bn_w2a8_scaled(static_cast<float>(dot - x_sum), w_scale, x_scale)));
                const T stored = from_float<T>(residual + y);
                static_cast<T *>(f.add.residual)[row] = stored;
                const float v = to_float(stored);
                stats = combine(stats, {v * v, fabsf(v * norm_w)});
            }
        } else if (sub == 0 && row < a.M) {
            store(a, 0, row, dot - x_sum, w_scale, x_scale);
        }
        w_scale = next_w_scale;
        norm_w = next_norm_w;
        residual = next_residual;
    }
    if constexpr (OUTPUT == kAddStats) {
        /* the block's slot: the warps' rows (lanes 0, 8, 16, 24), then the warps, in a fixed order */
        __shared__ NormStats warps[kWarps];
        stats = shuffle_combine(shuffle_combine(stats, 8), 16);
        if (lane == 0) warps[threadIdx.x / 32] = stats;
        for (int slot = blockIdx.x + gridDim.x * (threadIdx.x + 1); slot < f.add.slots; slot += gridDim.x * kThreads)
            f.add.stats[slot] = {0.0f, 0.0f};
        __syncthreads();
        if (threadIdx.x < 32) {
            stats = lane < kWarps ? warps[lane] : NormStats{0.0f, 0.0f};
            for (int offset = kWarps / 2; offset > 0; offset /= 2) stats = shuffle_combine(stats, offset);
            if (lane == 0) f.add.stats[blockIdx.x] = stats;
        }
    }
}

template <int PREFETCH, bool BLOCK_MAJOR_TAIL>
__global__ __launch_bounds__(kThreads) void gemv_one_token(const GemvArgs a) {
    one_token<PREFETCH, BLOCK_MAJOR_TAIL, void, kCodes, kStore>(a, FusedArgs{});
}

template <int PREFETCH, bool BLOCK_MAJOR_TAIL, typename T, int INPUT, int OUTPUT>
__global__ __launch_bounds__(kThreads) void gemv_one_token_fused(const GemvArgs a, const FusedArgs f) {
    one_token<PREFETCH, BLOCK_MAJOR_TAIL, T, INPUT, OUTPUT>(a, f);
}

/* d += A B, A 16x32 unsigned bytes, B 32x8 signed bytes. */
__device__ __forceinline__ void mma_u8_s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, int b0, int b1) {
    BN_SM80_ASM(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* The B fragments of the 8 mma steps of one chunk, read from global memory (L1 keeps x for the
 * block's later tiles and the SM's other blocks): x[q] holds x of token n at bytes 16q..16q+15 of
 * the chunk, zeros past the row's end and for tokens past n_valid. */
__device__ __forceinline__ void load_x_fragment(int4 (&x)[4], const GemvArgs &a, int n, int chunk) {
    const bool inside = chunk < a.K / 64 && n < a.n_valid;
    const int4 *src = reinterpret_cast<const int4 *>(a.x_q + static_cast<int64_t>(n) * a.K + chunk * 64);
#pragma unroll
    for (int q = 0; q < 4; q++) x[q] = inside ? __ldg(src + q) : make_int4(0, 0, 0, 0);
}

/* 8 tokens per block, from token 8 * blockIdx.y on (a grid of 2 rows of blocks takes 16). Lane (g,
 * t) = (lane / 4, lane % 4), as in the mma fragment layouts: A row g and g+8 of each 16 rows, B
 * column (token) g, D rows g, g+8 x tokens 2t, 2t+1.
 * RTILES: row tiles of 16 per block. With 1, each warp loads the block's next tile while it computes
 * this one. With 2 (rows of one step per warp, grids of one round: see plan_mma8), the two share
 * each x fragment, and the first tile's weights, all of them, are loaded before the PDL wait.
 * MIN_BLOCKS: the launch bound's blocks per SM (0: none), which sets ptxas's register budget. */
template <int WARPS, int RTILES, int MIN_BLOCKS>
__global__ __launch_bounds__(WARPS * 32, MIN_BLOCKS) void gemv_tokens_mma(const GemvArgs a) {
    constexpr int kTileOutputs = 128;
    constexpr int kOutputs = RTILES * kTileOutputs;
    constexpr int kPerThread = (kOutputs + WARPS * 32 - 1) / (WARPS * 32);
    static_assert(RTILES == 1 || RTILES == 2, "1 or 2 row tiles per block");
    static_assert(kTileOutputs <= WARPS * 32, "a finisher per output of a tile");
    extern __shared__ int4 shared[];
    int *partial = reinterpret_cast<int *>(shared); /* [WARPS][kOutputs] */

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int n0 = 8 * blockIdx.y;
    const int chunks_per_row = a.K / 64;
    const int quads = (chunks_per_row + 3) / 4;              /* chunk quads per row */
    const int warp_quads = (quads - warp + WARPS - 1) / WARPS; /* quads warp, warp + WARPS, ... */
    const int iterations = (warp_quads + kStepsPerLoad - 1) / kStepsPerLoad;
    constexpr int kRows = RTILES * kRowsPerBlock;
    const int tiles = (a.M + kRows - 1) / kRows;

    /* w[s][h]: row g + 8h, chunk 4 * quad + t, quad = warp + WARPS * (iteration * 2 + s) */
    auto load = [&](uint4 (&w)[kStepsPerLoad][2 * RTILES], int tile_, int iteration) {
#pragma unroll
        for (int s = 0; s < kStepsPerLoad; s++) {
            int quad = warp + WARPS * (iteration * kStepsPerLoad + s);
            int chunk = 4 * quad + t;
#pragma unroll
            for (int h = 0; h < 2 * RTILES; h++) {
                int row = tile_ * kRows + g + 8 * h;
                w[s][h] = row < a.M && quad < quads && chunk < chunks_per_row
                              ? __ldcs(a.w + static_cast<int64_t>(row) * chunks_per_row + chunk)
                              : make_uint4(0, 0, 0, 0);
            }
        }
    };

    /* Thread o < kOutputs finishes output o (and o + WARPS * 32, ...) of each block of rows: D
     * element r = (o / 32) % 4 of lane o % 32 of row tile o / 128 of the warps' partial tiles. */
    bool finisher[kPerThread];
    int o_n[kPerThread], o_row[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; i++) {
        const int o = threadIdx.x + i * WARPS * 32, o_lane = o % 32, o_r = (o / 32) % 4;
        const int row_tile = RTILES == 1 ? 0 : o / kTileOutputs;
        finisher[i] = o < kOutputs;
        o_n[i] = n0 + 2 * (o_lane % 4) + o_r % 2;
        o_row[i] = kRowsPerBlock * row_tile + o_lane / 4 + 8 * (o_r / 2);
    }
    auto row_scale = [&](int i, int tile_) {
        int row = tile_ * kRows + o_row[i];
        return finisher[i] && tile_ < tiles && row < a.M ? a.w_scales[row] : 0.0f;
    };

    /* The weights and their scales never depend on the previous kernel. */
    int tile = blockIdx.x;
    uint4 w[kStepsPerLoad][2 * RTILES];
    if (tile < tiles && iterations > 0) load(w, tile, 0);
    float w_scale[kPerThread], x_scale[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; i++) w_scale[i] = row_scale(i, tile);
    bn_pdl_launch_dependents();
    bn_pdl_wait();
#pragma unroll
    for (int i = 0; i < kPerThread; i++) x_scale[i] = finisher[i] && o_n[i] < a.n_valid ? a.x_scales[o_n[i]] : 0.0f;

    /* x_neg[r] = -sum of x of D element r's token over this warp's quads, added to the dots so
     * that the codes (W_q + 1) give W_q . x; the same for every tile, found during the first. */
    int x_neg[4];
    /* One block of rows: its dots into shared memory, then the finishers' outputs. `first` is
     * std::true_type for the block's first tile, so that later tiles are compiled without the sums. */
    auto run_tile = [&](auto first) {
        constexpr bool kFirst = decltype(first)::value;
        float next_w_scale[kPerThread];
#pragma unroll
        for (int i = 0; i < kPerThread; i++) next_w_scale[i] = row_scale(i, tile + gridDim.x);
        int d[RTILES][2][4] = {}; /* [.][i % 2]: from masked_codes(., i), 4 times too big for odd i */
        int x_sum = 0; /* lane (g, t): x of token g over its chunks, first tile only */
        for (int iteration = 0; iteration < iterations; iteration++) {
            /* RTILES = 1: the next step's weights load while this step's are used. RTILES = 2: this
             * step's load here (the first tile's first step was loaded before the PDL wait). */
            [[maybe_unused]] uint4 next[kStepsPerLoad][2]; /* RTILES = 1 only */
            if constexpr (RTILES == 1) {
                const int next_tile = iteration + 1 < iterations ? tile : tile + gridDim.x;
                if (next_tile < tiles) load(next, next_tile, iteration + 1 < iterations ? iteration + 1 : 0);
            } else if (!(kFirst && iteration == 0)) {
                load(w, tile, iteration);
            }
#pragma unroll
            for (int s = 0; s < kStepsPerLoad; s++) {
                int quad = warp + WARPS * (iteration * kStepsPerLoad + s);
                if (quad >= quads) break;
                int4 x[4];
                load_x_fragment(x, a, n0 + g, 4 * quad + t);
                if (kFirst) {
#pragma unroll
                    for (int q = 0; q < 4; q++) x_sum = add_bytes(x[q], x_sum);
                }
#pragma unroll
                for (int rt = 0; rt < RTILES; rt++) {
                    const uint4 &lo = w[s][2 * rt], &hi = w[s][2 * rt + 1];
                    const uint32_t lo_words[4] = {lo.x, lo.y, lo.z, lo.w}, hi_words[4] = {hi.x, hi.y, hi.z, hi.w};
                    /* mma step (p, i): k = 16q + 4i of the lane's chunk for words q = 2p and 2p + 1 */
#pragma unroll
                    for (int p = 0; p < 2; p++)
#pragma unroll
                        for (int i = 0; i < 4; i++)
                            mma_u8_s8(d[rt][i % 2], masked_codes(lo_words[2 * p], i), masked_codes(hi_words[2 * p], i),
                                      masked_codes(lo_words[2 * p + 1], i), masked_codes(hi_words[2 * p + 1], i),
                                      component(x[2 * p], i), component(x[2 * p + 1], i));
                }
            }
            if constexpr (RTILES == 1) {
#pragma unroll
                for (int s = 0; s < kStepsPerLoad; s++) w[s][0] = next[s][0], w[s][1] = next[s][1];
            }
        }
        if (kFirst) {
            /* The sums over t meet in lanes 4g..4g+3; D element r of lane (g, t) has token 2t + r % 2. */
            x_sum += __shfl_xor_sync(~0u, x_sum, 1);
            x_sum += __shfl_xor_sync(~0u, x_sum, 2);
            const int even = __shfl_sync(~0u, x_sum, 8 * t), odd = __shfl_sync(~0u, x_sum, 8 * t + 4);
            x_neg[0] = x_neg[2] = -even;
            x_neg[1] = x_neg[3] = -odd;
        }
        /* The warps' partial tiles meet in shared memory; each finisher adds up its outputs. */
#pragma unroll
        for (int rt = 0; rt < RTILES; rt++)
#pragma unroll
            for (int r = 0; r < 4; r++)
                partial[(warp * RTILES * 4 + rt * 4 + r) * 32 + lane] = d[rt][0][r] + (d[rt][1][r] >> 2) + x_neg[r];
        __syncthreads();
#pragma unroll
        for (int i = 0; i < kPerThread; i++) {
            if (finisher[i]) {
                const int o = threadIdx.x + i * WARPS * 32;
                int dot = 0;
#pragma unroll
                for (int w2 = 0; w2 < WARPS; w2++) dot += partial[w2 * kOutputs + o];
                int row = tile * kRows + o_row[i];
                if (row < a.M && o_n[i] < a.n_valid) store(a, o_n[i], row, dot, w_scale[i], x_scale[i]);
            }
            w_scale[i] = next_w_scale[i];
        }
        __syncthreads();
    };
    if (tile < tiles) run_tile(std::true_type());
    for (tile += gridDim.x; tile < tiles; tile += gridDim.x) run_tile(std::false_type());
}

using GemvKernel = void (*)(GemvArgs);

/* A launch shape: blocks of `threads`, and how many of them the GPU holds at once (at most
 * blocks_per_sm per SM, fewer where the SM has room for fewer). */
struct Launch {
    GemvKernel kernel;
    int threads;
    size_t shared_bytes;
    int64_t resident_blocks;
};

/* The blocks of `kernel` the GPU holds at once: at most blocks_per_sm per SM, fewer where the SM
 * has room for fewer. */
bitnet_status resident_blocks(const BnGpu &gpu, const void *kernel, int threads, int blocks_per_sm,
                              size_t shared_bytes, int64_t *out) {
    int resident = 0;
    BN_TRY(bn_cuda_kernel_occupancy(gpu.device, kernel, threads, shared_bytes, &resident));
    *out = (int64_t)gpu.sms * (resident < 1 ? 1 : resident < blocks_per_sm ? resident : blocks_per_sm);
    return BITNET_OK;
}

bitnet_status plan(const BnGpu &gpu, GemvKernel kernel, int threads, int blocks_per_sm, size_t shared_bytes,
                   Launch *out) {
    *out = {kernel, threads, shared_bytes, 0};
    return resident_blocks(gpu, reinterpret_cast<const void *>(kernel), threads, blocks_per_sm, shared_bytes,
                           &out->resident_blocks);
}

template <int WARPS, int RTILES = 1, int MIN_BLOCKS = 0>
bitnet_status plan_mma(const BnGpu &gpu, int blocks_per_sm, Launch *out) {
    const size_t partial_bytes = static_cast<size_t>(WARPS) * RTILES * 128 * sizeof(int);
    return plan(gpu, gemv_tokens_mma<WARPS, RTILES, MIN_BLOCKS>, WARPS * 32, blocks_per_sm, partial_bytes, out);
}

/* The launch for nt tokens (1, 8 or 16): its blocks of work (tiles of rows) and rows of blocks (the
 * mma kernel's 8 tokens each; 1 for one token), the same for every launch of one call. */
struct TokensLaunch {
    Launch launch;
    int64_t work_blocks;
    int token_rows;
};

/* Launches with programmatic stream serialization token_rows rows of blocks, in all at most the
 * resident blocks (fewer if work_blocks a row is smaller); the kernels loop over the rest of their
 * work. */
bitnet_status launch(const TokensLaunch &t, const GemvArgs &a, cudaStream_t stream) {
    const Launch &l = t.launch;
    const int64_t row_blocks = l.resident_blocks / t.token_rows > 1 ? l.resident_blocks / t.token_rows : 1;
    const int64_t blocks = t.work_blocks < row_blocks ? t.work_blocks : row_blocks;
    BN_CUDA_TRY(bn_launch_pdl(l.kernel, dim3(static_cast<unsigned>(blocks), t.token_rows), dim3(l.threads),
                              l.shared_bytes, stream, a));
    return BITNET_OK;
}

/* The mma kernel for out->token_rows x 8 tokens and K: blocks of 8 warps split K's chunk quads, some
 * warps taking one step more than others when 8 does not divide them; each row of the grid's blocks
 * takes 8 tokens (at 9 to 16 tokens that beat blocks of 16 tokens: 2560x2560 at 16 3.52 -> 2.96
 * us, the batch-16 decode step 1.623 -> 1.592 ms on an H200, docs/log/2026-12-04.md#2026-12-04-8).
 * - Told 1 block per SM, ptxas gives them 96 registers instead of 80, so 2 blocks fit per SM
 *   instead of 3. Where the tiles take one round of those, that is faster; where they do not, it
 *   is slower (docs/log/2026-11-24.md#2026-11-24-7).
 * - Where 5 or 6 warps take them in as many steps (K = 1152 to 1536, 2176 to 3072, 4224 to 4608)
 *   and the tiles outnumber the 8-warp blocks the GPU holds at once, the smaller blocks fit more per
 *   SM and so take fewer rounds of tiles (docs/log/2026-11-22.md#2026-11-22-9).
 * - Where 5 warps take K in one step each (K = 2176 to 2560) and blocks of 2 tiles then fit in one
 *   round, a block takes 2 tiles at once (docs/log/2026-11-24.md#2026-11-24-7); not with 2 rows of
 *   blocks (3840x2560 at 16 tokens 4.06 against 3.53 us, docs/log/2026-12-04.md#2026-12-04-8). */
bitnet_status plan_mma8(const BnGpu &gpu, int64_t M, int64_t K, TokensLaunch *out) {
    const int token_rows = out->token_rows;
    out->work_blocks = (M + kRowsPerBlock - 1) / kRowsPerBlock;
    BN_TRY((plan_mma<8, 1, 1>(gpu, kMmaBlocksPerSm, &out->launch)));
    if (out->work_blocks * token_rows <= out->launch.resident_blocks) return BITNET_OK;
    BN_TRY((plan_mma<8>(gpu, kMmaBlocksPerSm, &out->launch)));
    const int64_t quads = (K / 64 + 3) / 4;
    const int64_t steps = (quads + kWarps - 1) / kWarps;
    const int64_t fewest = (quads + steps - 1) / steps;
    if (out->work_blocks * token_rows <= out->launch.resident_blocks || (fewest != 5 && fewest != 6))
        return BITNET_OK;
    if (fewest == 5 && steps == kStepsPerLoad && token_rows == 1) {
        BN_TRY((plan_mma<5, 2, kMmaSmallBlocksPerSm>(gpu, kMmaSmallBlocksPerSm, &out->launch)));
        const int64_t pairs = (out->work_blocks + 1) / 2;
        if (pairs <= out->launch.resident_blocks) {
            out->work_blocks = pairs;
            return BITNET_OK;
        }
    }
    return fewest == 5 ? plan_mma<5>(gpu, kMmaSmallBlocksPerSm, &out->launch)
                       : plan_mma<6>(gpu, kMmaSmallBlocksPerSm, &out->launch);
}

/* The one-token kernel's launch for M x K: its tiles (work_blocks), blocks per SM, shared memory,
 * and which instance (PREFETCH: long_rows; BLOCK_MAJOR_TAIL: rounds). */
struct OneTokenPlan {
    int64_t work_blocks;
    int per_sm;
    size_t shared_bytes;
    bool long_rows, rounds;
};

OneTokenPlan plan_one_token(const BnGpu &gpu, int64_t M, int64_t K) {
    OneTokenPlan p;
    p.shared_bytes = static_cast<size_t>(K) + kWarps * sizeof(int); /* x, the warps' x sums */
    /* Where one block per SM has a warp for every tile, the grid takes one block per SM: the next
     * kernel's blocks then fit beside it and issue their weight loads early (PDL)
     * (docs/log/2026-11-22.md#2026-11-22-9; every shape at one block per SM was slower:
     * docs/log/2026-11-23.md#2026-11-23-21). */
    p.work_blocks = (M + kRowsPerWarp - 1) / kRowsPerWarp;
    p.per_sm = p.work_blocks <= (int64_t)gpu.sms * kWarps ? 1 : kOneTokenBlocksPerSm;
    p.long_rows = K > 2 * kChunksPerLane * kLanesPerRow * 64; /* more than 2 steps */
    /* One-round grids keep the plain numbering: the other one's code made 2560x6912 slower
     * (docs/log/2026-11-24.md#2026-11-24-6). */
    p.rounds = p.work_blocks > (int64_t)gpu.sms * kWarps * p.per_sm;
    return p;
}

bitnet_status plan_tokens(const BnGpu &gpu, int nt, int64_t M, int64_t K, TokensLaunch *out) {
    out->token_rows = nt == 1 ? 1 : nt / 8;
    if (nt == 1) {
        const OneTokenPlan p = plan_one_token(gpu, M, K);
        out->work_blocks = p.work_blocks;
        GemvKernel kernel = p.long_rows ? (p.rounds ? gemv_one_token<kPrefetchSteps, true>
                                                    : gemv_one_token<kPrefetchSteps, false>)
                                        : (p.rounds ? gemv_one_token<0, true> : gemv_one_token<0, false>);
        return plan(gpu, kernel, kThreads, p.per_sm, p.shared_bytes, &out->launch);
    }
    return plan_mma8(gpu, M, K, out);
}

/* The kernel arguments of one launch (sizes checked against the kernels' int limits). */
GemvArgs gemv_args(const uint8_t *w_packed, const float *w_scales, int64_t M, int64_t K, const int8_t *x_q,
                   const float *x_scales, void *y, int32_t y_dtype, int64_t n_valid) {
    GemvArgs a;
    a.w = reinterpret_cast<const uint4 *>(w_packed);
    a.w_scales = w_scales;
    a.x_q = x_q;
    a.x_scales = x_scales;
    a.y = y;
    a.y_dtype = y_dtype;
    a.M = static_cast<int>(M);
    a.K = static_cast<int>(K);
    a.n_valid = static_cast<int>(n_valid);
    return a;
}

/* A fused form of the one-token launch: the plain GEMV's plan for M x K. With `max_blocks` > 0 a
 * grid of more blocks is refused (the producer's stats slots). */
template <typename T, int INPUT, int OUTPUT>
bitnet_status launch_fused(const BnGpu &gpu, const GemvArgs &a, const FusedArgs &f, int64_t max_blocks,
                           cudaStream_t stream) {
    const OneTokenPlan p = plan_one_token(gpu, a.M, a.K);
    auto kernel = p.long_rows ? (p.rounds ? gemv_one_token_fused<kPrefetchSteps, true, T, INPUT, OUTPUT>
                                          : gemv_one_token_fused<kPrefetchSteps, false, T, INPUT, OUTPUT>)
                              : (p.rounds ? gemv_one_token_fused<0, true, T, INPUT, OUTPUT>
                                          : gemv_one_token_fused<0, false, T, INPUT, OUTPUT>);
    int64_t resident = 0;
    BN_TRY(resident_blocks(gpu, reinterpret_cast<const void *>(kernel), kThreads, p.per_sm, p.shared_bytes,
                           &resident));
    const int64_t blocks = p.work_blocks < resident ? p.work_blocks : resident;
    if (max_blocks > 0 && blocks > max_blocks)
        return bn_fail(BITNET_ERR_INVALID_ARGUMENT, "bitnet_gemv_w2a8_add_norm_stats: stats has %lld slots, the "
                       "launch needs %lld (bitnet_norm_stats_slots gives the count)", (long long)max_blocks,
                       (long long)blocks);
    BN_CUDA_TRY(bn_launch_pdl(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), p.shared_bytes,
                              stream, a, f));
    return BITNET_OK;
}

/* A fused form's launch on `device` (current for the call), in either dtype of the fused forms. */
template <int INPUT, int OUTPUT>
bitnet_status launch_fused(int32_t device, int32_t dtype, const GemvArgs &a, const FusedArgs &f, int64_t max_blocks,
                           void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BnGpu gpu{device, 0};
    BN_TRY(bn_cuda_sm_count(device, &gpu.sms));
    cudaStream_t s = bn_stream(stream);
    return dtype == BITNET_DTYPE_BF16 ? launch_fused<__nv_bfloat16, INPUT, OUTPUT>(gpu, a, f, max_blocks, s)
                                      : launch_fused<__half, INPUT, OUTPUT>(gpu, a, f, max_blocks, s);
}

/* The one-token kernel's row limit. */
bitnet_status check_rows(const char *fn, int64_t M) {
    if (M > INT32_MAX / 2)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: M = %lld is over the CUDA kernel's limit (%d)", fn, (long long)M,
                       INT32_MAX / 2);
    return BITNET_OK;
}

RopeArgs rope_args(void *q, void *k_cache, void *v_cache, const int32_t *position, float theta, int64_t Hq,
                   int64_t Hkv, int64_t D, int64_t C) {
    return RopeArgs{q, k_cache, v_cache, position, log2(static_cast<double>(theta)), static_cast<int>(Hq),
                    static_cast<int>(Hkv), static_cast<int>(D), static_cast<int>(C)};
}

NormedInputArgs normed_input(const void *h, const void *norm_weight, const float *stats, int64_t slots, float eps) {
    return NormedInputArgs{h, norm_weight, reinterpret_cast<const NormStats *>(stats), static_cast<int>(slots), eps};
}

}  // namespace

bitnet_status bn_cuda_gemv_w2a8(int32_t device, const uint8_t *w_packed, const float *w_scales,
                                int64_t M, int64_t K, const int8_t *x_q, const float *x_scales,
                                int64_t N, void *y, int32_t y_dtype, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BN_TRY(check_rows("bitnet_gemv_w2a8", M));
    cudaStream_t s = bn_stream(stream);
    int64_t y_size = bn_dtype_size(y_dtype);
    /* From kGemmMinTokens tokens on, the GEMM (sm_80+), and on sm_90 from kGemmLargeMinTokens for
     * large matrices. Else tokens per launch: 1 (dp4a), else 8 or
     * 16 (mma). The int8 tensor-core kernels need sm_80; older GPUs take one token per launch. */
    int major = 0;
    BN_CUDA_TRY(bn_current_cc_major(&major));
    bool gemm = N >= kGemmMinTokens;
    if (!gemm && N >= kGemmLargeMinTokens && M * K >= kGemmLargeWeights) BN_CUDA_TRY(bn_runs_sm90a(device, &gemm));
    if (major >= 8 && gemm && N <= BN_GEMM_MAX_N && M <= BN_GEMM_MAX_M)
        return bn_cuda_gemm_w2a8(device, w_packed, w_scales, M, K, x_q, x_scales, N, y, y_dtype, stream);
    BnGpu gpu{device, 0};
    BN_TRY(bn_cuda_sm_count(device, &gpu.sms));
    TokensLaunch launches[3] = {}; /* for 1, 8 and 16 tokens, planned when first needed */
    for (int64_t n0 = 0; n0 < N;) {
        int64_t left = N - n0;
        int nt = left == 1 || major < 8 ? 1 : left <= 8 ? 8 : 16;
        TokensLaunch &l = launches[nt == 1 ? 0 : nt == 8 ? 1 : 2];
        if (l.launch.kernel == nullptr) BN_TRY(plan_tokens(gpu, nt, M, K, &l));
        const GemvArgs a = gemv_args(w_packed, w_scales, M, K, x_q + n0 * K, x_scales + n0,
                                     static_cast<char *>(y) + n0 * M * y_size, y_dtype, left < nt ? left : nt);
        BN_TRY(launch(l, a, s));
        n0 += a.n_valid;
    }
    return BITNET_OK;
}

bitnet_status bn_cuda_gemv_w2a8_rope_append_kv(int32_t device, int32_t dtype, const uint8_t *w_packed,
                                               const float *w_scales, int64_t K, const int8_t *x_q,
                                               const float *x_scale, int64_t Hq, int64_t Hkv, int64_t D,
                                               void *q, void *k_cache, void *v_cache, int64_t C,
                                               const int32_t *position, float theta, void *stream) {
    const int64_t M = (Hq + 2 * Hkv) * D; /* < 2^28 by the entry point's limits on Hq, Hkv and D */
    FusedArgs f{};
    f.rope = rope_args(q, k_cache, v_cache, position, theta, Hq, Hkv, D, C);
    return launch_fused<kCodes, kRope>(device, dtype, gemv_args(w_packed, w_scales, M, K, x_q, x_scale, nullptr, dtype, 1),
                                       f, 0, stream);
}

bitnet_status bn_cuda_norm_stats_slots(int32_t device, int64_t *slots) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    int sms = 0;
    BN_TRY(bn_cuda_sm_count(device, &sms));
    *slots = static_cast<int64_t>(sms) * kOneTokenBlocksPerSm;
    return BITNET_OK;
}

bitnet_status bn_cuda_gemv_w2a8_add_norm_stats(int32_t device, int32_t dtype, const uint8_t *w_packed,
                                               const float *w_scales, int64_t M, int64_t K, const int8_t *x_q,
                                               const float *x_scale, void *residual, const void *norm_weight,
                                               float *stats, int64_t slots, void *stream) {
    BN_TRY(check_rows("bitnet_gemv_w2a8_add_norm_stats", M));
    FusedArgs f{};
    f.add = AddStatsArgs{residual, norm_weight, reinterpret_cast<NormStats *>(stats),
                         static_cast<int>(slots < INT32_MAX ? slots : INT32_MAX)};
    return launch_fused<kCodes, kAddStats>(device, dtype,
                                           gemv_args(w_packed, w_scales, M, K, x_q, x_scale, nullptr, dtype, 1), f,
                                           slots, stream);
}

bitnet_status bn_cuda_rmsnorm_gemv_w2a8(int32_t device, int32_t dtype, const void *h, const void *norm_weight,
                                        const float *stats, int64_t slots, float eps, const uint8_t *w_packed,
                                        const float *w_scales, int64_t M, int64_t K, void *y, int32_t y_dtype,
                                        void *stream) {
    BN_TRY(check_rows("bitnet_rmsnorm_gemv_w2a8", M));
    FusedArgs f{};
    f.in = normed_input(h, norm_weight, stats, slots, eps);
    return launch_fused<kNormed, kStore>(device, dtype,
                                         gemv_args(w_packed, w_scales, M, K, nullptr, nullptr, y, y_dtype, 1), f, 0,
                                         stream);
}

bitnet_status bn_cuda_rmsnorm_gemv_w2a8_rope_append_kv(int32_t device, int32_t dtype, const void *h,
                                                       const void *norm_weight, const float *stats,
                                                       int64_t slots, float eps, const uint8_t *w_packed,
                                                       const float *w_scales, int64_t K, int64_t Hq, int64_t Hkv,
                                                       int64_t D, void *q, void *k_cache, void *v_cache, int64_t C,
                                                       const int32_t *position, float theta, void *stream) {
    const int64_t M = (Hq + 2 * Hkv) * D; /* < 2^28 by the entry point's limits on Hq, Hkv and D */
    FusedArgs f{};
    f.rope = rope_args(q, k_cache, v_cache, position, theta, Hq, Hkv, D, C);
    f.in = normed_input(h, norm_weight, stats, slots, eps);
    return launch_fused<kNormed, kRope>(device, dtype,
                                        gemv_args(w_packed, w_scales, M, K, nullptr, nullptr, nullptr, dtype, 1), f, 0,
                                        stream);
}
