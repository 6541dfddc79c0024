/* Dense bfloat16 GEMV, the output head: y[n, m] = sum_k x[n, k] * w[m, k], float32 accumulation.
 * One token (or float32 x): one warp per weight row; each lane streams 16-byte chunks (8 weights)
 * of its row, UNROLL chunks in flight, and multiplies each chunk with the same chunk of every token
 * of the tile (x is small and stays in L1/L2). 2 or more bfloat16 tokens: tensor cores, a warp per
 * 16 rows and up to 64 tokens, x staged in shared memory (gemv_bf16_mma_kernel). More tokens loop
 * over tiles of TILE_TOKENS (MMA_TILE_TOKENS on tensor cores). Compute capability 9.0, from
 * BN_HEAD_WGMMA_MIN_TOKENS bfloat16 tokens on with K % 64 == 0: the wgmma kernel of gemv_bf16_sm90.cu,
 * which reads the weights once per 64 or 128 tokens (the 2B4T head at 64 tokens: 0.380 -> 0.172 ms
 * on an H200, docs/log/2026-12-02.md#2026-12-02-8).
 * Launched with programmatic dependent launch.
 * Bytes: M*K*2 of weights, read once per tile, dominate; batch 1 at 128256 x 2560 reads them at
 * about 3.1 TB/s on the H100 (0.211 ms). */
#include <cuda_bf16.h>

#include <type_traits>

#include "common.cuh"

/* gemv_bf16_sm90.cu: the wgmma kernel (compute capability 9.0 only, bfloat16 x, K % 64 == 0). */
bitnet_status bn_cuda_gemv_bf16_sm90(int32_t device, const __nv_bfloat16 *w, int64_t M, int64_t K,
                                     const __nv_bfloat16 *x, int64_t N, void *y, bool y_is_bf16, cudaStream_t stream);

/* From this many bfloat16 tokens on, compute capability 9.0 takes the wgmma kernel (for
 * tools/dev/gemm_variants.sh-style A/B builds: a large value turns it off). */
#ifndef BN_HEAD_WGMMA_MIN_TOKENS
#define BN_HEAD_WGMMA_MIN_TOKENS 9
#endif

namespace {

constexpr int WARPS_PER_BLOCK = 8;
constexpr int UNROLL = 4;
constexpr int TILE_TOKENS = 8;      /* tokens per launch of gemv_bf16_kernel */
constexpr int MMA_TILE_TOKENS = 64; /* tokens per launch of gemv_bf16_mma_kernel */

__device__ inline void bf16x8_to_float(uint4 v, float out[8]) {
    const __nv_bfloat162 *pairs = reinterpret_cast<const __nv_bfloat162 *>(&v);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f = __bfloat1622float2(pairs[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ inline void load8(const __nv_bfloat16 *p, float out[8]) {
    bf16x8_to_float(__ldg(reinterpret_cast<const uint4 *>(p)), out);
}

__device__ inline void load8(const float *p, float out[8]) {
    float4 a = __ldg(reinterpret_cast<const float4 *>(p));
    float4 b = __ldg(reinterpret_cast<const float4 *>(p) + 1);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

template <int TOKENS, typename XT>
__global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
gemv_bf16_kernel(const __nv_bfloat16 *w, int64_t M, int64_t K, const XT *x, int tokens, void *y,
                 bool y_is_bf16) {
    bn_pdl_wait();
    bn_pdl_launch_dependents();
    const int lane = threadIdx.x % 32;
    const int64_t row = (int64_t)blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / 32;
    if (row >= M) return;
    const uint4 *w_row = reinterpret_cast<const uint4 *>(w + row * K);
    const int64_t chunks = K / 8;
    float acc[TOKENS] = {};
    for (int64_t base = lane; base < chunks; base += 32 * UNROLL) {
        uint4 w_chunk[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int64_t c = base + u * 32;
            w_chunk[u] = c < chunks ? __ldcs(w_row + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            int64_t c = base + u * 32;
            if (c >= chunks) break;
            float wf[8];
            bf16x8_to_float(w_chunk[u], wf);
#pragma unroll
            for (int t = 0; t < TOKENS; t++) {
                if (t >= tokens) break;
                float xf[8];
                load8(x + t * K + c * 8, xf);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[t] = fmaf(wf[i], xf[i], acc[t]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < TOKENS; t++) {
        for (int offset = 16; offset > 0; offset /= 2)
            acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], offset);
    }
    if (lane != 0) return;
    for (int t = 0; t < tokens; t++) {
        if (y_is_bf16)
            static_cast<__nv_bfloat16 *>(y)[t * M + row] = __float2bfloat16(acc[t]);
        else
            static_cast<float *>(y)[t * M + row] = acc[t];
    }
}

/* 2..64 bfloat16 tokens on tensor cores (sm_80+, K % 32 == 0): a warp owns 16 rows and NT tiles of
 * 8 tokens; its block's 8 warps share x, staged in shared memory STAGE_CHUNKS chunks of 32 k at a
 * time. Lane (g, t) = (lane / 4, lane % 4) loads 16 bytes of rows g and g+8 at k = 32c + 8t, and
 * reads the same 8 k of token g of every tile; they feed two mma steps per tile, lane t's 8 k
 * standing for the mma's k 2t, 2t+1, 2t+8, 2t+9 of each step. That k order is one permutation
 * applied to both operands, so the dot products are the same. The output fragment of tile j holds
 * rows g, g+8 of its tokens 2t, 2t+1. The weights are read once for all 8 * NT tokens. */
constexpr int STAGE_CHUNKS = 8;
/* bfloat16 per token row of the stage: 32 more than the stage holds put tokens g and g+1 half a
 * 128-byte line apart, so each quarter warp's 16-byte reads fall on distinct banks */
constexpr int STAGE_PITCH = 32 * STAGE_CHUNKS + 32;

template <int NT>
__global__ void __launch_bounds__(WARPS_PER_BLOCK * 32, 2)
gemv_bf16_mma_kernel(const __nv_bfloat16 *w, int64_t M, int64_t K, const __nv_bfloat16 *x,
                     int tokens, void *y, bool y_is_bf16) {
    constexpr int kThreads = WARPS_PER_BLOCK * 32, kPieces = STAGE_CHUNKS * 4; /* 16 bytes each */
    __shared__ __align__(16) __nv_bfloat16 stage[8 * NT][STAGE_PITCH];
    bn_pdl_wait();
    bn_pdl_launch_dependents();
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int64_t row0 = ((int64_t)blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / 32) * 16;
    /* Rows past M load row M - 1 and are never stored; their warps still take part in staging. */
    const int64_t rows[2] = {row0 + g < M ? row0 + g : M - 1, row0 + g + 8 < M ? row0 + g + 8 : M - 1};
    const uint4 *w_lo = reinterpret_cast<const uint4 *>(w + rows[0] * K) + t;
    const uint4 *w_hi = reinterpret_cast<const uint4 *>(w + rows[1] * K) + t;
    const int64_t chunks = K / 32;
    float d[NT][4] = {};
    for (int64_t c0 = 0; c0 < chunks; c0 += STAGE_CHUNKS) {
        const int n = (int)(chunks - c0 < STAGE_CHUNKS ? chunks - c0 : STAGE_CHUNKS);
        uint4 lo[STAGE_CHUNKS], hi[STAGE_CHUNKS];
#pragma unroll
        for (int u = 0; u < STAGE_CHUNKS; u++) {
            if (u < n) {
                lo[u] = __ldcs(w_lo + 4 * (c0 + u));
                hi[u] = __ldcs(w_hi + 4 * (c0 + u));
            }
        }
        __syncthreads(); /* the previous round's reads of the stage are done */
#pragma unroll
        for (int i = threadIdx.x; i < 8 * NT * kPieces; i += kThreads) {
            const int token = i / kPieces, piece = i % kPieces;
            const uint4 v = token < tokens && piece < 4 * n
                ? __ldg(reinterpret_cast<const uint4 *>(x + token * K + 32 * c0) + piece)
                : make_uint4(0, 0, 0, 0);
            *reinterpret_cast<uint4 *>(&stage[token][8 * piece]) = v;
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < STAGE_CHUNKS; u++) {
            if (u >= n) break;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const uint4 b = *reinterpret_cast<const uint4 *>(&stage[g + 8 * j][32 * u + 8 * t]);
                mma<__nv_bfloat16>(d[j], {lo[u].x, hi[u].x, lo[u].y, hi[u].y}, b.x, b.y);
                mma<__nv_bfloat16>(d[j], {lo[u].z, hi[u].z, lo[u].w, hi[u].w}, b.z, b.w);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NT; j++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int64_t row = row0 + g + 8 * (i / 2);
            const int token = 8 * j + 2 * t + i % 2;
            if (row >= M || token >= tokens) continue;
            if (y_is_bf16)
                static_cast<__nv_bfloat16 *>(y)[token * M + row] = __float2bfloat16(d[j][i]);
            else
                static_cast<float *>(y)[token * M + row] = d[j][i];
        }
    }
}

template <typename XT>
bitnet_status launch_tiles(int32_t device, const __nv_bfloat16 *w, int64_t M, int64_t K, const XT *x, int64_t N,
                           void *y, int32_t y_dtype, cudaStream_t stream) {
    const bool y_is_bf16 = y_dtype == BITNET_DTYPE_BF16;
    const int64_t y_elem = bn_dtype_size(y_dtype);
    int major = 0;
    bool sm90a = false;
    BN_CUDA_TRY(bn_current_cc_major(&major));
    BN_CUDA_TRY(bn_runs_sm90a(device, &sm90a));
    if constexpr (std::is_same<XT, __nv_bfloat16>::value) {
        if (sm90a && K % 64 == 0 && N >= BN_HEAD_WGMMA_MIN_TOKENS && M <= INT32_MAX &&
            N <= INT32_MAX && 2 * K <= INT32_MAX)
            return bn_cuda_gemv_bf16_sm90(device, w, M, K, x, N, y, y_is_bf16, stream);
    }
    const bool tensor_cores = std::is_same<XT, __nv_bfloat16>::value && K % 32 == 0 && major >= 8;
    const int tile = tensor_cores ? MMA_TILE_TOKENS : TILE_TOKENS;
    for (int64_t n0 = 0; n0 < N; n0 += tile) {
        const int tokens = (int)(N - n0 < tile ? N - n0 : tile);
        void (*kernel)(const __nv_bfloat16 *, int64_t, int64_t, const XT *, int, void *, bool) =
            tokens == 1 ? gemv_bf16_kernel<1, XT> : tokens == 2 ? gemv_bf16_kernel<2, XT>
            : tokens <= 4 ? gemv_bf16_kernel<4, XT> : gemv_bf16_kernel<8, XT>;
        int64_t rows_per_block = WARPS_PER_BLOCK;
        if constexpr (std::is_same<XT, __nv_bfloat16>::value) {
            if (tokens > 1 && tensor_cores) {
                kernel = tokens <= 8 ? gemv_bf16_mma_kernel<1> : tokens <= 16 ? gemv_bf16_mma_kernel<2>
                         : tokens <= 32 ? gemv_bf16_mma_kernel<4> : gemv_bf16_mma_kernel<8>;
                rows_per_block *= 16;
            }
        }
        BN_CUDA_TRY(bn_launch_pdl(kernel, dim3(bn_ceil_div(M, rows_per_block)),
                                  dim3(WARPS_PER_BLOCK * 32), 0, stream, w, M, K, x + n0 * K, tokens,
                                  static_cast<void *>(static_cast<char *>(y) + n0 * M * y_elem),
                                  y_is_bf16));
    }
    return BITNET_OK;
}

}  // namespace

bitnet_status bn_cuda_gemv_bf16(int32_t device, const void *w, int64_t M, int64_t K, const void *x,
                                int32_t x_dtype, int64_t N, void *y, int32_t y_dtype, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    const __nv_bfloat16 *weights = static_cast<const __nv_bfloat16 *>(w);
    if (x_dtype == BITNET_DTYPE_BF16)
        return launch_tiles(device, weights, M, K, static_cast<const __nv_bfloat16 *>(x), N, y, y_dtype,
                            bn_stream(stream));
    return launch_tiles(device, weights, M, K, static_cast<const float *>(x), N, y, y_dtype, bn_stream(stream));
}
