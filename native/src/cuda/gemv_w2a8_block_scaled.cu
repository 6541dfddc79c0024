/* CUDA W2A8 GEMV with a scale per 256-weight block (bitnet_gemv_w2a8_block_scaled):
 * y[n, m] = (sum_b block_scales[m, b] * dot_b) * w_scales[m] / x_scales[n], dot_b the exact dot
 * of block b, = dot(codes, x) - sum(x) over the block (codes = W_q + 1, docs/weight_format.md).
 * A warp takes one row at a time; lane l takes blocks l, l + 32, ... of it (64 bytes of weights,
 * 256 bytes of x each, both read through L1) for up to kTokens tokens at once, sums its scaled
 * dots in block order, and the warp adds up its lanes' sums. The weights are read again for every
 * kTokens tokens: this kernel serves the rare checkpoints whose blocks carry different scales,
 * not prefill speed (docs/models.md). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kTokens = 8;
constexpr int kBlockChunks = BN_SCALE_BLOCK / 64; /* 16-byte chunks of 64 weights per block */

struct BlockScaledArgs {
    const uint4 *w; /* [M, K/64] */
    const float *w_scales, *block_scales;
    const int8_t *x_q;
    const float *x_scales;
    void *y;
    int64_t M, K, N;
};

/* The exact dot of one block's codes and x (its 256 bytes), less the sum of x. */
__device__ __forceinline__ int block_dot(const uint4 (&w)[kBlockChunks], const int4 *x) {
    int dot = 0, x_sum = 0;
#pragma unroll
    for (int c = 0; c < kBlockChunks; c++) {
        const uint32_t words[4] = {w[c].x, w[c].y, w[c].z, w[c].w};
#pragma unroll
        for (int g = 0; g < 4; g++) {
            /* x bytes 16g..16g+15 of the chunk; component i pairs with word g shifted by 2i */
            const int4 v = __ldg(x + c * 4 + g);
            const int xs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                dot = __dp4a(static_cast<int>((words[g] >> (2 * i)) & 0x03030303u), xs[i], dot);
                x_sum = __dp4a(xs[i], 0x01010101, x_sum);
            }
        }
    }
    return dot - x_sum;
}

template <typename T>
__global__ __launch_bounds__(kThreads) void gemv_block_scaled(const BlockScaledArgs a) {
    bn_pdl_launch_dependents();
    bn_pdl_wait();
    const int lane = threadIdx.x % 32;
    const int64_t blocks = a.K / BN_SCALE_BLOCK, warps = int64_t(gridDim.x) * (kThreads / 32);
    for (int64_t row = blockIdx.x * int64_t(kThreads / 32) + threadIdx.x / 32; row < a.M; row += warps) {
        const uint4 *w_row = a.w + row * (a.K / 64);
        for (int64_t n0 = 0; n0 < a.N; n0 += kTokens) {
            const int tokens = a.N - n0 < kTokens ? static_cast<int>(a.N - n0) : kTokens;
            float sum[kTokens] = {};
            for (int64_t b = lane; b < blocks; b += 32) {
                uint4 w[kBlockChunks];
#pragma unroll
                for (int c = 0; c < kBlockChunks; c++) w[c] = __ldg(w_row + b * kBlockChunks + c);
                const float scale = a.block_scales[row * blocks + b];
#pragma unroll
                for (int t = 0; t < kTokens; t++) {
                    if (t >= tokens) break;
                    const int4 *x = reinterpret_cast<const int4 *>(a.x_q + (n0 + t) * a.K + b * BN_SCALE_BLOCK);
                    sum[t] = __fadd_rn(sum[t], __fmul_rn(scale, static_cast<float>(block_dot(w, x))));
                }
            }
#pragma unroll
            for (int t = 0; t < kTokens; t++) {
                for (int offset = 16; offset > 0; offset /= 2)
                    sum[t] = __fadd_rn(sum[t], __shfl_xor_sync(~0u, sum[t], offset));
            }
            if (lane < tokens) {
                float value = 0.0f;
#pragma unroll
                for (int t = 0; t < kTokens; t++) value = lane == t ? sum[t] : value;
                value = __fdiv_rn(__fmul_rn(value, a.w_scales[row]), a.x_scales[n0 + lane]);
                static_cast<T *>(a.y)[(n0 + lane) * a.M + row] = from_float<T>(value);
            }
        }
    }
}

}  // namespace

bitnet_status bn_cuda_gemv_w2a8_block_scaled(int32_t device, const uint8_t *w_packed,
                                             const float *w_scales, const float *block_scales,
                                             int64_t M, int64_t K, const int8_t *x_q,
                                             const float *x_scales, int64_t N, void *y,
                                             int32_t y_dtype, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    int sms = 0;
    BN_TRY(bn_cuda_sm_count(device, &sms));
    const BlockScaledArgs a{reinterpret_cast<const uint4 *>(w_packed), w_scales, block_scales, x_q,
                            x_scales, y, M, K, N};
    const int64_t row_blocks = (M + kThreads / 32 - 1) / (kThreads / 32);
    const int64_t most = int64_t(sms) * (2048 / kThreads);
    const dim3 grid(static_cast<unsigned>(row_blocks < most ? row_blocks : most));
    cudaStream_t s = bn_stream(stream);
    if (y_dtype == BITNET_DTYPE_F32)
        BN_CUDA_TRY(bn_launch_pdl(gemv_block_scaled<float>, grid, dim3(kThreads), 0, s, a));
    else if (y_dtype == BITNET_DTYPE_F16)
        BN_CUDA_TRY(bn_launch_pdl(gemv_block_scaled<__half>, grid, dim3(kThreads), 0, s, a));
    else
        BN_CUDA_TRY(bn_launch_pdl(gemv_block_scaled<__nv_bfloat16>, grid, dim3(kThreads), 0, s, a));
    return BITNET_OK;
}
