/* Dense bfloat16 GEMV, the output head: y[n, m] = sum_k x[n, k] * w[m, k], float32 accumulation.
 * One warp per weight row; each lane streams 16-byte chunks (8 weights) of its row, UNROLL chunks in
 * flight, and multiplies each chunk with the same chunk of every token of the tile (x is small and
 * stays in L1/L2). Up to TILE_TOKENS tokens per launch; more tokens loop over tiles.
 * Bytes: M*K*2 of weights, read once per tile, dominate. */
#include <cuda_bf16.h>

#include "common.cuh"

namespace {

constexpr int WARPS_PER_BLOCK = 8;
constexpr int UNROLL = 4;
constexpr int TILE_TOKENS = 8;

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

template <typename XT>
bitnet_status launch_tiles(const __nv_bfloat16 *w, int64_t M, int64_t K, const XT *x, int64_t N,
                           void *y, int32_t y_dtype, cudaStream_t stream) {
    const bool y_is_bf16 = y_dtype == BITNET_DTYPE_BF16;
    const int64_t y_elem = bn_dtype_size(y_dtype);
    const dim3 grid(bn_ceil_div(M, WARPS_PER_BLOCK)), block(WARPS_PER_BLOCK * 32);
    for (int64_t n0 = 0; n0 < N; n0 += TILE_TOKENS) {
        const int tokens = (int)(N - n0 < TILE_TOKENS ? N - n0 : TILE_TOKENS);
        const XT *x_tile = x + n0 * K;
        void *y_tile = static_cast<char *>(y) + n0 * M * y_elem;
        if (tokens == 1)
            gemv_bf16_kernel<1><<<grid, block, 0, stream>>>(w, M, K, x_tile, tokens, y_tile, y_is_bf16);
        else if (tokens == 2)
            gemv_bf16_kernel<2><<<grid, block, 0, stream>>>(w, M, K, x_tile, tokens, y_tile, y_is_bf16);
        else if (tokens <= 4)
            gemv_bf16_kernel<4><<<grid, block, 0, stream>>>(w, M, K, x_tile, tokens, y_tile, y_is_bf16);
        else
            gemv_bf16_kernel<8><<<grid, block, 0, stream>>>(w, M, K, x_tile, tokens, y_tile, y_is_bf16);
        BN_CUDA_CHECK_LAUNCH("gemv_bf16_kernel");
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
        return launch_tiles(weights, M, K, static_cast<const __nv_bfloat16 *>(x), N, y, y_dtype,
                            bn_stream(stream));
    return launch_tiles(weights, M, K, static_cast<const float *>(x), N, y, y_dtype, bn_stream(stream));
}
