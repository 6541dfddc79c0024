/* CUDA bitnet_decode_layer: one BitNet layer of a one-token decode step as one cooperative kernel
 * whose blocks (all resident at once) run the layer's stages back to back, a grid barrier
 * (cooperative_groups' grid sync) between a stage and the next that reads all of its output:
 *   1. the input RMSNorm + int8 codes of h, in every block (h is 2H bytes; no barrier needed),
 *      then the QKV GEMV;                                                           | barrier
 *   2. attention over the KV cache split into Hkv x S units (a KV head's G query heads, a range of
 *      positions): RoPE on the unit's q heads; the unit whose range holds p also rotates k and
 *      writes cache row p; an online softmax over tiles of kTile positions; unnormalized partials;
 *                                                                                  | barrier
 *   3. the partials combined per query head, rounded to dtype;                     | barrier
 *   4. the sub-norm + codes of that, in every block, then the o GEMV; h += its output;  | barrier
 *   5. the post-attention RMSNorm + codes of h, in every block, then the gate|up GEMV, a warp
 *      holding gate rows and their up rows, storing act(gate) * up;                | barrier
 *   6. the sub-norm + codes of that, in every block, then the down GEMV; h += its output.
 * Weights never depend on the layer's data: at the start every block requests its share of the
 * four weight matrices into L2 (17 MB for 2B4T: L2 holds them), in stage order, and before the
 * first barrier the attention units request their cache rows; HBM streams while the stages wait on
 * each other. GEMVs: dp4a, LANES lanes per row (chosen per stage so that one round of the grid's
 * warps covers the rows), x in shared memory as in gemv_w2a8.cu's one-token kernel. Data written in
 * this kernel is read with ld.global.cg (L2), never from a possibly stale L1.
 * Numerics: the integer dots are exact and every value the unfused sequence stores in dtype is
 * rounded to dtype here too; only float32 sum orders differ (norms, softmax): docs/decode_layer.md. */
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>

#include "common.cuh"
#include "gemv_dp4a.cuh"

namespace cg = cooperative_groups;

namespace {

using namespace bn_gemv;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 64;             /* attention positions per softmax step */
constexpr int kMaxGroupDims = 2048;   /* G * D: 4 accumulators per thread */
constexpr int kChunksPerLoad = 10;    /* 16-byte weight chunks a lane holds at once */
constexpr int kNormBatch = 4;         /* 16-byte loads per thread in flight in a norm */
constexpr int kPrefetchPiece = 4096;  /* bytes per L2 bulk prefetch */

/* A build with -DBITNET_TIMELINE (tools/dev/decode_timeline.py build) stamps %globaltimer in thread
 * 0 of every block at the stage boundaries (STAMP(s), after a block barrier), launch n's stamps in
 * g_layer_stamps[n % kStampCalls]; tools/dev/decode_layer_timeline.py reads them through
 * bitnet_decode_layer_timeline. The default build compiles the stamps to nothing. */
#ifdef BITNET_TIMELINE
constexpr int kStamps = 17, kStampCalls = 64, kStampBlocks = 192;
__device__ unsigned long long g_layer_stamps[kStampCalls][kStampBlocks][kStamps];
__device__ unsigned g_layer_tickets;
#define STAMP(s)                                                                                   \
    do {                                                                                           \
        __syncthreads();                                                                           \
        unsigned long long now;                                                                    \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));                                   \
        if (threadIdx.x == 0 && blockIdx.x < kStampBlocks) g_layer_stamps[stamp_call][blockIdx.x][s] = now; \
    } while (0)
#else
#define STAMP(s)
#endif

template <typename T> struct LayerArgs {
    int H, I, Hq, Hkv, D, C, splits;
    float eps, attn_sub_eps, ffn_sub_eps, scale_log2;
    double log2_theta;
    const uint4 *w_qkv, *w_o, *w_gate_up, *w_down;
    const float *s_qkv, *s_o, *s_gate_up, *s_down;
    const T *attn_norm, *attn_sub_norm, *ffn_norm, *ffn_sub_norm;
    T *h, *k_cache, *v_cache;
    const int32_t *position;
    /* workspace */
    T *qkv, *attn, *glu;
    float *partial_o; /* [splits][Hq][D] */
    float *partial_ml; /* [splits][Hq][2]: running max (log2 units) and sum */
};

/* Requests [p, p + bytes) into L2, this block's share being piece-sized requests spread over its
 * threads (bytes a multiple of 16, p 16-byte aligned). */
__device__ void prefetch_l2(const void *p, int64_t bytes) {
    const char *base = static_cast<const char *>(p);
    for (int64_t offset = (int64_t)threadIdx.x * kPrefetchPiece; offset < bytes;
         offset += (int64_t)kThreads * kPrefetchPiece) {
        const int64_t size = bytes - offset < kPrefetchPiece ? bytes - offset : kPrefetchPiece;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + offset), "r"((int)size)
                     : "memory");
#else
        for (int64_t line = 0; line < size; line += 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(base + offset + line));
#endif
    }
}

/* This block's 1/gridDim share of an array, in 16-byte units. */
__device__ void prefetch_share(const void *p, int64_t bytes) {
    const int64_t units = bytes / 16, per_block = (units + gridDim.x - 1) / gridDim.x;
    const int64_t first = per_block * blockIdx.x, count = units - first < per_block ? units - first : per_block;
    if (count > 0) prefetch_l2(static_cast<const char *>(p) + first * 16, count * 16);
}

struct SumMax {
    float sum, max;
};

/* The block-wide sum and max (NaN-propagating) of every thread's pair, in every thread. */
__device__ SumMax block_sum_max(SumMax v, float *scratch) {
    for (int offset = 16; offset > 0; offset /= 2) {
        v.sum += __shfl_xor_sync(~0u, v.sum, offset);
        v.max = bn_fmax_nan(v.max, __shfl_xor_sync(~0u, v.max, offset));
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads(); /* scratch may still be read by a previous reduction */
    if (lane == 0) {
        scratch[warp] = v.sum;
        scratch[kWarps + warp] = v.max;
    }
    __syncthreads();
    SumMax total = {0.0f, 0.0f};
    for (int w = 0; w < kWarps; w++) total = {total.sum + scratch[w], bn_fmax_nan(total.max, scratch[kWarps + w])};
    return total;
}


template <typename T> __device__ __forceinline__ void to_floats(const uint4 &raw, float (&f)[8]) {
    const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
    for (int j = 0; j < 8; j++) f[j] = to_float(e[j]);
}

struct Codes {
    int sum;     /* of the K codes */
    float scale; /* x_scale: codes = x * scale */
};

/* bitnet_rmsnorm's int8 codes of v [K] (a row written in this kernel) with weight w (NULL:
 * quantize_a8's rule), into x_tile; the CPU backend's formulas (cpu/rmsnorm.c), float32 sums in
 * this block's order. Every block computes the same codes. v passes through v_stage (K elements of
 * shared memory), so that it is read from L2 once, kNormBatch vectors per thread in flight. */
template <typename T>
__device__ Codes norm_codes(const T *v, const T *w, int K, float eps, int8_t *x_tile, uint4 *v_stage,
                            float *scratch) {
    const int vectors = K / 8;
    SumMax acc = {0.0f, 0.0f};
    for (int base = threadIdx.x; base < vectors; base += kThreads * kNormBatch) {
        uint4 raw[kNormBatch], weight[kNormBatch];
#pragma unroll
        for (int u = 0; u < kNormBatch; u++) {
            const int i = base + u * kThreads;
            raw[u] = i < vectors ? __ldcg(reinterpret_cast<const uint4 *>(v) + i) : make_uint4(0, 0, 0, 0);
            if (w) weight[u] = i < vectors ? __ldg(reinterpret_cast<const uint4 *>(w) + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kNormBatch; u++) {
            const int i = base + u * kThreads;
            if (i >= vectors) break;
            v_stage[i] = raw[u];
            float x[8], g[8];
            to_floats<T>(raw[u], x);
            if (w) to_floats<T>(weight[u], g);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                acc.sum += x[j] * x[j];
                acc.max = bn_fmax_nan(acc.max, fabsf(w ? x[j] * g[j] : x[j]));
            }
        }
    }
    acc = block_sum_max(acc, scratch); /* its barriers also publish v_stage */
    float r = 1.0f;
    if (w) {
        const float mean_square = acc.sum / (float)K + eps;
        if (mean_square >= FLT_MIN && mean_square <= FLT_MAX) {
            r = 1.0f / sqrtf(mean_square);
        } else { /* the float32 sum overflowed or underflowed: again in float64 */
            double sum64 = 0.0;
            for (int i = threadIdx.x; i < vectors; i += kThreads) {
                float x[8];
                to_floats<T>(v_stage[i], x);
#pragma unroll
                for (int j = 0; j < 8; j++) sum64 += (double)x[j] * x[j];
            }
            sum64 = bn_block_sum<kWarps>(sum64, reinterpret_cast<double *>(scratch + 2 * kWarps));
            r = (float)(1.0 / sqrt(sum64 / (double)K + (double)eps));
        }
    }
    const float max_y = acc.max * r;
    const float scale = isfinite(max_y) ? 127.0f / fmaxf(max_y, 1e-5f) : bn_nan(), r_scale = r * scale;
    int sum = 0;
    for (int i = threadIdx.x; i < vectors; i += kThreads) {
        float x[8], g[8];
        to_floats<T>(v_stage[i], x);
        if (w) to_floats<T>(__ldg(reinterpret_cast<const uint4 *>(w) + i), g);
        uint32_t packed[2] = {0, 0};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float p = w ? x[j] * g[j] : x[j];
            const int code = (int)rintf(fminf(fmaxf(p * r_scale, -128.0f), 127.0f));
            sum += code;
            packed[j / 4] |= (uint32_t)(code & 0xff) << (8 * (j % 4));
        }
        const int k = 8 * i;
        *reinterpret_cast<uint2 *>(x_tile + x_offset(k / 64, (k % 64) / 16) + k % 16) = make_uint2(packed[0], packed[1]);
    }
    sum = bn_block_sum<kWarps>(sum, reinterpret_cast<int *>(scratch + 2 * kWarps));
    return {sum, scale};
}

/* The exact dot of packed row `row` (K weights) with the codes in x_tile, summed over the LANES
 * lanes of the row (sub = this lane's index among them); the result in every lane of the row. */
template <int LANES>
__device__ int row_dot(const uint4 *w, int64_t row, int K, int sub, const int8_t *x_tile, bool valid) {
    const int chunks = K / 64;
    int acc[4] = {0, 0, 0, 0};
    for (int first = 0; first < chunks; first += LANES * kChunksPerLoad) {
        uint4 words[kChunksPerLoad];
#pragma unroll
        for (int u = 0; u < kChunksPerLoad; u++) {
            const int chunk = first + u * LANES + sub;
            words[u] = valid && chunk < chunks ? __ldcs(w + row * chunks + chunk) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kChunksPerLoad; u++) {
            const int chunk = first + u * LANES + sub;
            if (chunk >= chunks) break;
            const uint32_t word[4] = {words[u].x, words[u].y, words[u].z, words[u].w};
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int4 x = *reinterpret_cast<const int4 *>(x_tile + x_offset(chunk, q));
                acc[0] = dp4a_u8_s8(word[q] & 0x03030303u, x.x, acc[0]);
                acc[1] = dp4a_u8_s8(word[q] & 0x0C0C0C0Cu, x.y, acc[1]);
                acc[2] = dp4a_u8_s8(word[q] & 0x30303030u, x.z, acc[2]);
                acc[3] = dp4a_u8_s8(word[q] & 0xC0C0C0C0u, x.w, acc[3]);
            }
        }
    }
    int dot = codes_dot(acc);
    for (int offset = LANES / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(~0u, dot, offset);
    return dot;
}

/* A GEMV over the grid's warps, 32 / LANES rows per warp task. Epilogue(row, value) stores. */
template <int LANES, typename Epilogue>
__device__ void gemv_rows(const uint4 *w, const float *scales, int M, int K, const int8_t *x_tile,
                          Codes x, Epilogue epilogue) {
    constexpr int kRows = 32 / LANES;
    const int lane = threadIdx.x % 32, sub = lane % LANES;
    const int total_warps = gridDim.x * kWarps;
    for (int task = blockIdx.x * kWarps + threadIdx.x / 32; task * kRows < M; task += total_warps) {
        const int row = task * kRows + lane / LANES;
        const bool valid = row < M;
        const int dot = row_dot<LANES>(w, row, K, sub, x_tile, valid) - x.sum;
        if (valid && sub == 0) epilogue(row, bn_w2a8_scaled(static_cast<float>(dot), scales[row], x.scale));
    }
}

/* The gate|up GEMV, a warp task holding gate rows i .. i + kRows/2 - 1 and their up rows; the
 * gate's lanes store act(gate) * up, both rounded to T first (as the unfused pass stores them). */
template <int LANES, int ACT, typename T>
__device__ void gemv_glu(const LayerArgs<T> &a, const int8_t *x_tile, Codes x) {
    constexpr int kRows = 32 / LANES, kPairs = kRows / 2;
    const int lane = threadIdx.x % 32, sub = lane % LANES, slot = lane / LANES;
    const int total_warps = gridDim.x * kWarps;
    for (int task = blockIdx.x * kWarps + threadIdx.x / 32; task * kPairs < a.I; task += total_warps) {
        const int i = task * kPairs + slot % kPairs;
        const bool valid = i < a.I;
        const int row = slot < kPairs ? i : a.I + i;
        const int dot = row_dot<LANES>(a.w_gate_up, row, a.H, sub, x_tile, valid) - x.sum;
        const float value = valid ? bn_w2a8_scaled(static_cast<float>(dot), a.s_gate_up[row], x.scale) : 0.0f;
        const float rounded = to_float(from_float<T>(value));
        const float up = __shfl_down_sync(~0u, rounded, kPairs * LANES);
        if (valid && slot < kPairs && sub == 0) a.glu[i] = from_float<T>(bn_glu<ACT>(rounded, up));
    }
}

/* The lanes per row of a GEMV over M rows (pairs: M gate|up pairs, two rows a pair): the most, up
 * to max_lanes and down to 4, for which one round of the grid's warps covers every row. */
__device__ __forceinline__ int lanes_for(int M, int max_lanes, int pairs) {
    const int total_warps = gridDim.x * kWarps;
    int lanes = max_lanes;
    while (lanes > 4 && (int64_t)M * lanes / (pairs ? 16 : 32) > total_warps) lanes /= 2;
    return lanes;
}

template <typename Epilogue>
__device__ void gemv_stage(const uint4 *w, const float *scales, int M, int K, const int8_t *x_tile,
                           Codes x, Epilogue epilogue) {
    switch (lanes_for(M, 32, 0)) {
    case 32: gemv_rows<32>(w, scales, M, K, x_tile, x, epilogue); break;
    case 16: gemv_rows<16>(w, scales, M, K, x_tile, x, epilogue); break;
    case 8: gemv_rows<8>(w, scales, M, K, x_tile, x, epilogue); break;
    default: gemv_rows<4>(w, scales, M, K, x_tile, x, epilogue); break;
    }
}

template <int ACT, typename T>
__device__ void glu_stage(const LayerArgs<T> &a, const int8_t *x_tile, Codes x) {
    switch (lanes_for(a.I, 16, 1)) {
    case 16: gemv_glu<16, ACT>(a, x_tile, x); break;
    case 8: gemv_glu<8, ACT>(a, x_tile, x); break;
    default: gemv_glu<4, ACT>(a, x_tile, x); break;
    }
}

/* Attention's shared memory. */
struct AttentionShared {
    float *q;               /* [G][D], rotated and rounded to T */
    float *scores;          /* [G][kTile], then the weights p */
    float *cosines, *sines; /* [D / 2] */
    float *alpha, *m, *l;   /* [G] */
    uint4 *k_tile, *v_tile; /* [kTile][D] elements of T each */
};

/* The positions [first, last) of unit `split` of S over L positions. */
__device__ __forceinline__ void unit_range(int L, int S, int split, int &first, int &last) {
    const int chunk = (L + S - 1) / S;
    first = split * chunk;
    last = min(L, first + chunk);
}

/* Pair i of a head x (written in this kernel) rotated by RoPE and rounded to T. */
template <typename T>
__device__ __forceinline__ void rotate(const T *x, int D, int i, const AttentionShared &sm, T &lo, T &hi) {
    bn_rope_rotate(to_float(__ldcg(x + i)), to_float(__ldcg(x + i + D / 2)), sm.cosines[i], sm.sines[i],
                   lo, hi);
}

template <typename T>
__device__ void attention_unit(const LayerArgs<T> &a, int p, const AttentionShared &sm) {
    const int G = a.Hq / a.Hkv, D = a.D, L = p + 1;
    const int j = blockIdx.x / a.splits, split = blockIdx.x % a.splits;
    int first, last;
    unit_range(L, a.splits, split, first, last);
    if (first >= last) return;
    const int row_stride = a.Hkv * D;
    const T *qkv = a.qkv;

    for (int e = threadIdx.x; e < G * D / 2; e += kThreads) {
        const int g = e / (D / 2), i = e % (D / 2);
        T lo, hi;
        rotate(qkv + (j * G + g) * D, D, i, sm, lo, hi);
        sm.q[g * D + i] = to_float(lo);
        sm.q[g * D + i + D / 2] = to_float(hi);
    }
    if (first <= p && p < last) { /* this unit appends row p */
        T *k_row = a.k_cache + (int64_t)p * row_stride + j * D, *v_row = a.v_cache + (int64_t)p * row_stride + j * D;
        const T *v_new = qkv + (a.Hq + a.Hkv + j) * D;
        for (int i = threadIdx.x; i < D / 2; i += kThreads) rotate(qkv + (a.Hq + j) * D, D, i, sm, k_row[i], k_row[i + D / 2]);
        for (int i = threadIdx.x; i < D; i += kThreads) v_row[i] = __ldcg(v_new + i);
    }
    if (threadIdx.x < G) {
        sm.m[threadIdx.x] = -INFINITY;
        sm.l[threadIdx.x] = 0.0f;
    }
    __syncthreads();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int per_lane = D / 32, row_vectors = D / 8;
    const T *k_tile = reinterpret_cast<const T *>(sm.k_tile), *v_tile = reinterpret_cast<const T *>(sm.v_tile);
    float acc[kMaxGroupDims / kThreads] = {};
    for (int tile = first; tile < last; tile += kTile) {
        const int count = min(kTile, last - tile), vectors = count * row_vectors;
        for (int base = threadIdx.x; base < vectors; base += kThreads * kNormBatch) {
            uint4 k[kNormBatch], v[kNormBatch];
#pragma unroll
            for (int u = 0; u < kNormBatch; u++) {
                const int e = base + u * kThreads;
                const int64_t offset = (int64_t)(tile + e / row_vectors) * row_stride + j * D + e % row_vectors * 8;
                if (e < vectors) {
                    k[u] = __ldcg(reinterpret_cast<const uint4 *>(a.k_cache + offset));
                    v[u] = __ldcg(reinterpret_cast<const uint4 *>(a.v_cache + offset));
                }
            }
#pragma unroll
            for (int u = 0; u < kNormBatch; u++) {
                const int e = base + u * kThreads;
                if (e < vectors) {
                    sm.k_tile[e] = k[u];
                    sm.v_tile[e] = v[u];
                }
            }
        }
        __syncthreads();
        for (int t = warp; t < count; t += kWarps) {
            float kv[8];
#pragma unroll
            for (int e = 0; e < 8; e++) kv[e] = e < per_lane ? to_float(k_tile[t * D + lane * per_lane + e]) : 0.0f;
            for (int g = 0; g < G; g++) {
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; e++)
                    if (e < per_lane) dot += sm.q[g * D + lane * per_lane + e] * kv[e];
                for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(~0u, dot, offset);
                if (lane == 0) sm.scores[g * kTile + t] = dot * a.scale_log2;
            }
        }
        __syncthreads();
        for (int g = warp; g < G; g += kWarps) {
            float tile_max = -INFINITY;
            for (int t = lane; t < count; t += 32) tile_max = fmaxf(tile_max, sm.scores[g * kTile + t]);
            for (int offset = 16; offset > 0; offset /= 2) tile_max = fmaxf(tile_max, __shfl_xor_sync(~0u, tile_max, offset));
            const float m_old = sm.m[g], m_new = fmaxf(m_old, tile_max);
            float sum = 0.0f;
            for (int t = lane; t < count; t += 32) {
                const float weight = exp2f(sm.scores[g * kTile + t] - m_new);
                sm.scores[g * kTile + t] = weight;
                sum += weight;
            }
            for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(~0u, sum, offset);
            __syncwarp();
            if (lane == 0) {
                const float alpha = exp2f(m_old - m_new); /* 0 for the first tile: m_old = -inf */
                sm.alpha[g] = alpha;
                sm.m[g] = m_new;
                sm.l[g] = sm.l[g] * alpha + sum;
            }
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < kMaxGroupDims / kThreads; k++) {
            const int o = k * kThreads + threadIdx.x;
            if (o >= G * D) break;
            const int g = o / D, d = o % D;
            float sum = acc[k] * sm.alpha[g];
            for (int t = 0; t < count; t++) sum += sm.scores[g * kTile + t] * to_float(v_tile[t * D + d]);
            acc[k] = sum;
        }
        __syncthreads();
    }
#pragma unroll
    for (int k = 0; k < kMaxGroupDims / kThreads; k++) {
        const int o = k * kThreads + threadIdx.x;
        if (o >= G * D) break;
        a.partial_o[((int64_t)split * a.Hq + j * G) * D + o] = acc[k];
    }
    if (threadIdx.x < G) {
        float *ml = a.partial_ml + ((int64_t)split * a.Hq + j * G + threadIdx.x) * 2;
        ml[0] = sm.m[threadIdx.x];
        ml[1] = sm.l[threadIdx.x];
    }
}

/* attn[h, d] = sum over the used units of 2^(m - max) o / sum of 2^(m - max) l, rounded to T; a
 * warp per 32 elements of a head, its loads batched kNormBatch * 2 splits at a time. */
template <typename T> __device__ void combine(const LayerArgs<T> &a, int p) {
    constexpr int kBatch = 2 * kNormBatch;
    const int L = p + 1, chunk = (L + a.splits - 1) / a.splits, used = (L + chunk - 1) / chunk;
    const int lane = threadIdx.x % 32;
    auto m_of = [&](int s, int h) { return __ldcg(a.partial_ml + ((int64_t)s * a.Hq + h) * 2); };
    for (int task = blockIdx.x * kWarps + threadIdx.x / 32; task * 32 < a.Hq * a.D; task += gridDim.x * kWarps) {
        const int o = task * 32 + lane, h = o / a.D; /* one head per warp: D >= 64 */
        float m_max = -INFINITY;
        for (int s = lane; s < used; s += 32) m_max = fmaxf(m_max, m_of(s, h));
        for (int offset = 16; offset > 0; offset /= 2) m_max = fmaxf(m_max, __shfl_xor_sync(~0u, m_max, offset));
        float l = 0.0f;
        for (int s = lane; s < used; s += 32) l += exp2f(m_of(s, h) - m_max) * __ldcg(a.partial_ml + ((int64_t)s * a.Hq + h) * 2 + 1);
        for (int offset = 16; offset > 0; offset /= 2) l += __shfl_xor_sync(~0u, l, offset);
        float sum = 0.0f;
        for (int first = 0; first < used; first += kBatch) {
            float m[kBatch], part[kBatch];
#pragma unroll
            for (int u = 0; u < kBatch; u++) {
                const int s = first + u;
                m[u] = s < used ? m_of(s, h) : -INFINITY;
                part[u] = s < used ? __ldcg(a.partial_o + (int64_t)s * a.Hq * a.D + o) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < kBatch; u++) sum += exp2f(m[u] - m_max) * part[u];
        }
        a.attn[o] = from_float<T>(sum / l);
    }
}

template <typename T> __device__ __forceinline__ void add_to_h(const LayerArgs<T> &a, int row, float value) {
    const float rounded = to_float(from_float<T>(value));
    a.h[row] = from_float<T>(to_float(__ldcg(a.h + row)) + rounded);
}

template <typename T, int ACT>
__global__ __launch_bounds__(kThreads, 1) void decode_layer_kernel(const LayerArgs<T> a) {
    extern __shared__ int4 shared[];
    cg::grid_group grid = cg::this_grid();
    const int p = *a.position;
    if (p < 0 || p >= a.C) return; /* every block returns: no barrier is left waiting */
#ifdef BITNET_TIMELINE
    __shared__ unsigned stamp_call_shared;
    if (threadIdx.x == 0) stamp_call_shared = atomicAdd(&g_layer_tickets, 1u) / gridDim.x % kStampCalls;
    __syncthreads();
    const unsigned stamp_call = stamp_call_shared;
#endif
    STAMP(0);

    const int G = a.Hq / a.Hkv, Q = a.Hq * a.D, KV = a.Hkv * a.D;
    const int K_max = max(max(a.H, a.I), Q), tile_vectors = kTile * a.D / 8;
    int8_t *x_tile = reinterpret_cast<int8_t *>(shared);
    uint4 *v_stage = reinterpret_cast<uint4 *>(x_tile + K_max);
    AttentionShared sm;
    sm.k_tile = v_stage + K_max / 8;
    sm.v_tile = sm.k_tile + tile_vectors;
    float *scratch = reinterpret_cast<float *>(sm.v_tile + tile_vectors); /* 4 * kWarps floats */
    sm.q = scratch + 4 * kWarps;
    sm.scores = sm.q + G * a.D;
    sm.cosines = sm.scores + G * kTile;
    sm.sines = sm.cosines + a.D / 2;
    sm.alpha = sm.sines + a.D / 2;
    sm.m = sm.alpha + G;
    sm.l = sm.m + G;

    /* What does not depend on this layer's data: the weights and the attention unit's cache rows
     * into L2, RoPE's angles. */
    prefetch_share(a.w_qkv, (int64_t)(Q + 2 * KV) * a.H / 4);
    prefetch_share(a.w_o, (int64_t)a.H * Q / 4);
    prefetch_share(a.w_gate_up, (int64_t)2 * a.I * a.H / 4);
    prefetch_share(a.w_down, (int64_t)a.H * a.I / 4);
    const bool attends = blockIdx.x < a.Hkv * a.splits;
    if (attends) {
        for (int i = threadIdx.x; i < a.D / 2; i += kThreads) {
            double sin_d, cos_d;
            sincos(bn_rope_angle(p, i, a.D, a.log2_theta), &sin_d, &cos_d);
            sm.cosines[i] = (float)cos_d;
            sm.sines[i] = (float)sin_d;
        }
        int first, last;
        unit_range(p + 1, a.splits, blockIdx.x % a.splits, first, last);
        const int j = blockIdx.x / a.splits, row_bytes = a.D * (int)sizeof(T);
        for (int t = first + threadIdx.x / 32; t < last; t += kWarps)
            for (int byte = (threadIdx.x % 32) * 128; byte < row_bytes; byte += 32 * 128) {
                const int64_t offset = ((int64_t)t * KV + j * a.D) * sizeof(T) + byte;
                asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char *>(a.k_cache) + offset));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char *>(a.v_cache) + offset));
            }
    }
    STAMP(1);

    /* 1. norm, QKV */
    Codes x = norm_codes(a.h, a.attn_norm, a.H, a.eps, x_tile, v_stage, scratch);
    STAMP(2);
    gemv_stage(a.w_qkv, a.s_qkv, Q + 2 * KV, a.H, x_tile, x,
               [&](int row, float value) { a.qkv[row] = from_float<T>(value); });
    STAMP(3);
    grid.sync();
    STAMP(4);

    /* 2. attention partials; 3. their combination */
    if (attends) attention_unit(a, p, sm);
    STAMP(5);
    grid.sync();
    STAMP(6);
    combine(a, p);
    STAMP(7);
    grid.sync();
    STAMP(8);

    /* 4. sub-norm, o, residual */
    x = norm_codes(a.attn, a.attn_sub_norm, Q, a.attn_sub_eps, x_tile, v_stage, scratch);
    STAMP(9);
    gemv_stage(a.w_o, a.s_o, a.H, Q, x_tile, x, [&](int row, float value) { add_to_h(a, row, value); });
    STAMP(10);
    grid.sync();
    STAMP(11);

    /* 5. norm, gate|up, the GLU's gate */
    x = norm_codes(a.h, a.ffn_norm, a.H, a.eps, x_tile, v_stage, scratch);
    STAMP(12);
    glu_stage<ACT>(a, x_tile, x);
    STAMP(13);
    grid.sync();
    STAMP(14);

    /* 6. sub-norm, down, residual */
    x = norm_codes(a.glu, a.ffn_sub_norm, a.I, a.ffn_sub_eps, x_tile, v_stage, scratch);
    STAMP(15);
    gemv_stage(a.w_down, a.s_down, a.H, a.I, x_tile, x, [&](int row, float value) { add_to_h(a, row, value); });
    STAMP(16);
}

int64_t align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

/* Dynamic shared memory of a launch: x's codes, the norm's staged input, attention's K and V tiles,
 * reduction scratch, attention's float arrays (decode_layer_kernel's carving). */
size_t shared_bytes(int32_t dtype, const bitnet_decode_layer_config *c) {
    const int64_t G = c->Hq / c->Hkv, K_max = std::max(std::max(c->H, c->I), c->Hq * c->D);
    const int64_t size = bn_dtype_size(dtype);
    return (size_t)(K_max * (1 + size) + 2 * kTile * c->D * size +
                    4 * (4 * kWarps + G * c->D + G * kTile + c->D + 3 * G));
}

template <typename T, int ACT> void *kernel_for() { return reinterpret_cast<void *>(decode_layer_kernel<T, ACT>); }

void *kernel_of(int32_t dtype, int32_t activation) {
    if (dtype == BITNET_DTYPE_BF16)
        return activation == BITNET_ACTIVATION_SILU ? kernel_for<__nv_bfloat16, BITNET_ACTIVATION_SILU>()
                                                    : kernel_for<__nv_bfloat16, BITNET_ACTIVATION_RELU2>();
    return activation == BITNET_ACTIVATION_SILU ? kernel_for<__half, BITNET_ACTIVATION_SILU>()
                                                : kernel_for<__half, BITNET_ACTIVATION_RELU2>();
}

/* The grid (all blocks resident: one per SM that fits) and the attention splits per KV head. */
bitnet_status plan(int32_t device, int32_t dtype, const bitnet_decode_layer_config *c, int *blocks, int *splits) {
    if (c->Hq / c->Hkv * c->D > kMaxGroupDims)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_decode_layer: Hq / Hkv * D = %lld is over %d",
                       (long long)(c->Hq / c->Hkv * c->D), kMaxGroupDims);
    const size_t shared = shared_bytes(dtype, c);
    const void *kernel = kernel_of(dtype, c->activation);
    BN_TRY(bn_cuda_kernel_shared_memory(device, kernel, shared));
    int per_sm = 0, sms = 0;
    BN_TRY(bn_cuda_kernel_occupancy(device, kernel, kThreads, shared, &per_sm));
    BN_TRY(bn_cuda_sm_count(device, &sms));
    if (per_sm < 1)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_decode_layer: the kernel does not fit an SM "
                       "with %zu bytes of shared memory", shared);
    *blocks = sms; /* one per SM: more would not speed up the GEMVs' latency-bound rounds */
    if (c->Hkv > *blocks)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_decode_layer: Hkv = %lld KV heads exceed the "
                       "%d blocks of one launch", (long long)c->Hkv, *blocks);
    *splits = *blocks / (int)c->Hkv;
    return BITNET_OK;
}

struct Workspace {
    int64_t qkv, attn, glu, partial_o, partial_ml, total;
};

Workspace layout(int32_t dtype, const bitnet_decode_layer_config *c, int splits) {
    const int64_t size = bn_dtype_size(dtype), Q = c->Hq * c->D;
    Workspace w;
    w.qkv = 0;
    w.attn = w.qkv + align256((Q + 2 * c->Hkv * c->D) * size);
    w.glu = w.attn + align256(Q * size);
    w.partial_o = w.glu + align256(c->I * size);
    w.partial_ml = w.partial_o + align256((int64_t)splits * Q * 4);
    w.total = w.partial_ml + align256((int64_t)splits * c->Hq * 2 * 4);
    return w;
}

template <typename T>
LayerArgs<T> make_args(const bitnet_decode_layer_config *c, const bitnet_decode_layer_weights *w, void *h,
                       void *k_cache, void *v_cache, int64_t C, const int32_t *position, void *workspace,
                       const Workspace &ws, int splits) {
    LayerArgs<T> a;
    a.H = (int)c->H, a.I = (int)c->I, a.Hq = (int)c->Hq, a.Hkv = (int)c->Hkv, a.D = (int)c->D;
    a.C = (int)C, a.splits = splits;
    a.eps = c->eps, a.attn_sub_eps = c->attn_sub_eps, a.ffn_sub_eps = c->ffn_sub_eps;
    const float scale = c->attention_scale > 0.0f ? c->attention_scale : 1.0f / sqrtf((float)c->D);
    a.scale_log2 = scale * 1.4426950408889634f;
    a.log2_theta = log2((double)c->theta);
    a.w_qkv = reinterpret_cast<const uint4 *>(w->qkv.w_packed), a.s_qkv = w->qkv.w_scales;
    a.w_o = reinterpret_cast<const uint4 *>(w->o.w_packed), a.s_o = w->o.w_scales;
    a.w_gate_up = reinterpret_cast<const uint4 *>(w->gate_up.w_packed), a.s_gate_up = w->gate_up.w_scales;
    a.w_down = reinterpret_cast<const uint4 *>(w->down.w_packed), a.s_down = w->down.w_scales;
    a.attn_norm = static_cast<const T *>(w->attn_norm), a.attn_sub_norm = static_cast<const T *>(w->attn_sub_norm);
    a.ffn_norm = static_cast<const T *>(w->ffn_norm), a.ffn_sub_norm = static_cast<const T *>(w->ffn_sub_norm);
    a.h = static_cast<T *>(h), a.k_cache = static_cast<T *>(k_cache), a.v_cache = static_cast<T *>(v_cache);
    a.position = position;
    char *base = static_cast<char *>(workspace);
    a.qkv = reinterpret_cast<T *>(base + ws.qkv), a.attn = reinterpret_cast<T *>(base + ws.attn);
    a.glu = reinterpret_cast<T *>(base + ws.glu);
    a.partial_o = reinterpret_cast<float *>(base + ws.partial_o);
    a.partial_ml = reinterpret_cast<float *>(base + ws.partial_ml);
    return a;
}

template <typename T>
cudaError_t launch(const LayerArgs<T> &a, int32_t activation, int blocks, size_t shared, cudaStream_t stream) {
    cudaLaunchAttribute attribute = {};
    attribute.id = cudaLaunchAttributeCooperative;
    attribute.val.cooperative = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = shared;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
    return activation == BITNET_ACTIVATION_SILU
               ? cudaLaunchKernelEx(&config, decode_layer_kernel<T, BITNET_ACTIVATION_SILU>, a)
               : cudaLaunchKernelEx(&config, decode_layer_kernel<T, BITNET_ACTIVATION_RELU2>, a);
}

} // namespace

#ifdef BITNET_TIMELINE
extern "C" int bitnet_decode_layer_timeline(void *stamps, unsigned *tickets) {
    cudaError_t status = cudaMemcpyFromSymbol(tickets, g_layer_tickets, sizeof *tickets);
    if (status == cudaSuccess) status = cudaMemcpyFromSymbol(stamps, g_layer_stamps, sizeof g_layer_stamps);
    unsigned zero = 0;
    if (status == cudaSuccess) status = cudaMemcpyToSymbol(g_layer_tickets, &zero, sizeof zero);
    return (int)status;
}
#endif

bitnet_status bn_cuda_decode_layer_workspace_size(int32_t device, int32_t dtype,
                                                  const bitnet_decode_layer_config *c, int64_t *bytes) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    int blocks = 0, splits = 0;
    BN_TRY(plan(device, dtype, c, &blocks, &splits));
    *bytes = layout(dtype, c, splits).total;
    return BITNET_OK;
}

bitnet_status bn_cuda_decode_layer(int32_t device, int32_t dtype, const bitnet_decode_layer_config *c,
                                   const bitnet_decode_layer_weights *w, void *h, void *k_cache,
                                   void *v_cache, int64_t C, const int32_t *position, void *workspace,
                                   void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    int cooperative = 0;
    BN_CUDA_TRY(cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device));
    if (!cooperative)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_decode_layer: device %d has no cooperative launch", device);
    int blocks = 0, splits = 0;
    BN_TRY(plan(device, dtype, c, &blocks, &splits));
    const Workspace ws = layout(dtype, c, splits);
    const size_t shared = shared_bytes(dtype, c);
    if (dtype == BITNET_DTYPE_BF16)
        BN_CUDA_TRY(launch(make_args<__nv_bfloat16>(c, w, h, k_cache, v_cache, C, position, workspace, ws, splits),
                           c->activation, blocks, shared, bn_stream(stream)));
    else
        BN_CUDA_TRY(launch(make_args<__half>(c, w, h, k_cache, v_cache, C, position, workspace, ws, splits),
                           c->activation, blocks, shared, bn_stream(stream)));
    return BITNET_OK;
}
