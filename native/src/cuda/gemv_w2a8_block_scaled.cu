/* CUDA W2A8 GEMV with a scale per 256-weight block (bitnet_gemv_w2a8_block_scaled):
 * y[n, m] = (sum_b block_scales[m, b] * dot_b) * w_scales[m] / x_scales[n], dot_b the exact dot
 * of block b. The codes (W_q + 1, docs/weight_format.md) are made signed in registers
 * (__vsub4(codes, 0x01010101)), so no sums of x are needed. Each block's dot is exact in int32;
 * a lane turns it into float32 once and adds it to its sum in block order, and the lanes' (or
 * warps') sums meet at the end.
 * - One token (and every token before sm_80), dp4a: a warp per row; lane l takes the 16-byte
 *   chunks l, l + 32, ... of it, so 4 lanes share a block: their dots meet by two shuffles, and
 *   the first of them adds the scaled dot.
 * - From 2 tokens on, int8 tensor cores (mma.m16n8k32, signed): a warp owns 16 rows x 16 tokens
 *   and turns its int32 tiles into float32 after every block. Up to 16 tokens, the 4 warps of a
 *   block share 16 rows and take every fourth block of K each; with more, each warp takes its own
 *   16 rows and all of K.
 * H100, 2B4T shapes, against the plain GEMV: 1.8-2.6x at one token, 1.6-5.2x at 8 and 16, 5.6-8.8x
 * at 960 (docs/log/2026-11-27.md#2026-11-27-29). It serves the rare checkpoints whose blocks carry
 * different scales. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

constexpr int kBlockChunks = BN_SCALE_BLOCK / 64; /* 16-byte chunks (64 weights) per block */

/* dp4a kernel */
constexpr int kThreads = 256;
constexpr int kStepsPerLoad = 4; /* chunks a lane loads at once */

/* mma kernel */
constexpr int kMmaWarps = 4;
constexpr int kMmaRows = 16, kMmaTokens = 16;

struct BlockScaledArgs {
    const uint4 *w; /* [M, K/64] */
    const float *w_scales, *block_scales;
    const int8_t *x_q;
    const float *x_scales;
    void *y;
    int64_t M, K, N;
};

/* The 4 signed weights of shift i of a packed word. */
__device__ __forceinline__ int signed_weights(uint32_t word, int i) {
    return static_cast<int>(__vsub4((word >> (2 * i)) & 0x03030303u, 0x01010101u));
}

template <typename T>
__device__ __forceinline__ void store(const BlockScaledArgs &a, int64_t n, int64_t row, float sum) {
    const float value = bn_w2a8_scaled(sum, a.w_scales[row], a.x_scales[n]);
    static_cast<T *>(a.y)[n * a.M + row] = from_float<T>(value);
}

template <typename T>
__global__ __launch_bounds__(kThreads) void gemv_block_scaled_dp4a(const BlockScaledArgs a) {
    bn_pdl_launch_dependents();
    bn_pdl_wait();
    const int lane = threadIdx.x % 32;
    const int64_t chunks = a.K / 64, blocks = a.K / BN_SCALE_BLOCK, steps = (chunks + 31) / 32;
    const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
    for (int64_t row = blockIdx.x * int64_t(kThreads / 32) + threadIdx.x / 32; row < a.M; row += warps) {
        for (int64_t n = 0; n < a.N; n++) {
            float sum = 0.0f;
            for (int64_t s0 = 0; s0 < steps; s0 += kStepsPerLoad) {
                uint4 w[kStepsPerLoad];
#pragma unroll
                for (int u = 0; u < kStepsPerLoad; u++) {
                    const int64_t c = (s0 + u) * 32 + lane;
                    w[u] = c < chunks ? __ldg(a.w + row * chunks + c) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int u = 0; u < kStepsPerLoad; u++) {
                    if (s0 + u >= steps) break;
                    const int64_t c = (s0 + u) * 32 + lane;
                    const bool inside = c < chunks;
                    int dot = 0;
                    if (inside) {
                        const uint32_t words[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
                        const int4 *x = reinterpret_cast<const int4 *>(a.x_q + n * a.K + c * 64);
#pragma unroll
                        for (int g = 0; g < 4; g++) {
                            /* x bytes 16g..16g+15 of the chunk; component i pairs with word g's shift i */
                            const int4 v = __ldg(x + g);
                            dot = __dp4a(signed_weights(words[g], 0), v.x, dot);
                            dot = __dp4a(signed_weights(words[g], 1), v.y, dot);
                            dot = __dp4a(signed_weights(words[g], 2), v.z, dot);
                            dot = __dp4a(signed_weights(words[g], 3), v.w, dot);
                        }
                    }
                    dot += __shfl_xor_sync(~0u, dot, 1);
                    dot += __shfl_xor_sync(~0u, dot, 2);
                    if (inside && lane % kBlockChunks == 0)
                        sum = __fadd_rn(sum, __fmul_rn(a.block_scales[row * blocks + c / kBlockChunks],
                                                       static_cast<float>(dot)));
                }
            }
            /* lanes 0, 4, 8, ... hold the sums of their blocks */
            for (int offset = kBlockChunks; offset < 32; offset *= 2)
                sum = __fadd_rn(sum, __shfl_xor_sync(~0u, sum, offset));
            if (lane == 0) store<T>(a, n, row, sum);
        }
    }
}

/* d += A B, A 16x32 signed bytes (row), B 32x8 signed bytes (col). */
__device__ __forceinline__ void mma_s8(int (&d)[4], const int (&a)[4], int b0, int b1) {
    BN_SM80_ASM(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Lane (g, t) = (lane / 4, lane % 4), as in the mma fragment layouts: A rows g and g + 8 at k =
 * 4t..4t+3 and 16+4t..; B token g at the same k; D rows g, g + 8 x tokens 2t, 2t + 1. The weights
 * 16q + 4i..+3 of a chunk are word q's shift i, so a k step of 32 takes words 2s and 2s + 1 at
 * shift t. */
template <typename T, bool SPLIT_K>
__global__ __launch_bounds__(kMmaWarps * 32) void gemv_block_scaled_mma(const BlockScaledArgs a) {
    constexpr int kTiles = kMmaTokens / 8;
    constexpr int kBlockRows = SPLIT_K ? kMmaRows : kMmaRows * kMmaWarps;
    __shared__ float partial[SPLIT_K ? kMmaWarps - 1 : 1][kTiles * 4][32];
    bn_pdl_launch_dependents();
    bn_pdl_wait();
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int64_t chunks = a.K / 64, blocks = a.K / BN_SCALE_BLOCK;
    const int64_t token_tiles = (a.N + kMmaTokens - 1) / kMmaTokens;
    const int64_t row_tiles = (a.M + kBlockRows - 1) / kBlockRows;
    for (int64_t tile = blockIdx.x; tile < row_tiles * token_tiles; tile += gridDim.x) {
        const int64_t row0 = tile / token_tiles * kBlockRows + (SPLIT_K ? 0 : warp * kMmaRows);
        const int64_t n0 = tile % token_tiles * kMmaTokens;
        const int64_t rows[2] = {row0 + g, row0 + g + 8};
        float sum[kTiles][4] = {};
        for (int64_t b = SPLIT_K ? warp : 0; b < blocks; b += SPLIT_K ? kMmaWarps : 1) {
            int d[kTiles][4] = {};
#pragma unroll
            for (int c4 = 0; c4 < kBlockChunks; c4++) {
                const int64_t c = b * kBlockChunks + c4;
                uint4 w[2];
#pragma unroll
                for (int h = 0; h < 2; h++)
                    w[h] = rows[h] < a.M ? __ldg(a.w + rows[h] * chunks + c) : make_uint4(0, 0, 0, 0);
                int x[kTiles][4]; /* token g of tile j: 4 bytes at 4t, 16 + 4t, 32 + 4t, 48 + 4t */
#pragma unroll
                for (int j = 0; j < kTiles; j++) {
                    const int64_t n = n0 + 8 * j + g;
                    const int *src = reinterpret_cast<const int *>(a.x_q + n * a.K + c * 64) + t;
#pragma unroll
                    for (int q = 0; q < 4; q++) x[j][q] = n < a.N ? __ldg(src + 4 * q) : 0;
                }
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    const uint32_t lo[2] = {s ? w[0].z : w[0].x, s ? w[0].w : w[0].y};
                    const uint32_t hi[2] = {s ? w[1].z : w[1].x, s ? w[1].w : w[1].y};
                    const int frag[4] = {signed_weights(lo[0], t), signed_weights(hi[0], t),
                                         signed_weights(lo[1], t), signed_weights(hi[1], t)};
#pragma unroll
                    for (int j = 0; j < kTiles; j++) mma_s8(d[j], frag, x[j][2 * s], x[j][2 * s + 1]);
                }
            }
            const float scales[2] = {rows[0] < a.M ? a.block_scales[rows[0] * blocks + b] : 0.0f,
                                     rows[1] < a.M ? a.block_scales[rows[1] * blocks + b] : 0.0f};
#pragma unroll
            for (int j = 0; j < kTiles; j++)
#pragma unroll
                for (int r = 0; r < 4; r++)
                    sum[j][r] = __fadd_rn(sum[j][r], __fmul_rn(scales[r / 2], static_cast<float>(d[j][r])));
        }
        if constexpr (SPLIT_K) { /* warp w summed blocks w, w + 4, ...: warp 0 adds the others' */
            __syncthreads();
            if (warp > 0)
#pragma unroll
                for (int j = 0; j < kTiles; j++)
#pragma unroll
                    for (int r = 0; r < 4; r++) partial[warp - 1][j * 4 + r][lane] = sum[j][r];
            __syncthreads();
            if (warp > 0) continue;
#pragma unroll
            for (int w = 0; w < kMmaWarps - 1; w++)
#pragma unroll
                for (int j = 0; j < kTiles; j++)
#pragma unroll
                    for (int r = 0; r < 4; r++) sum[j][r] = __fadd_rn(sum[j][r], partial[w][j * 4 + r][lane]);
        }
#pragma unroll
        for (int j = 0; j < kTiles; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int64_t n = n0 + 8 * j + 2 * t + r % 2, row = rows[r / 2];
                if (n < a.N && row < a.M) store<T>(a, n, row, sum[j][r]);
            }
    }
}

template <typename T>
bitnet_status launch(const BlockScaledArgs &a, int sms, bool mma, cudaStream_t stream) {
    if (mma) {
        /* one row of tiles of tokens: the warps split K, else each takes its own rows */
        const bool split_k = a.N <= kMmaTokens;
        const int64_t rows = split_k ? kMmaRows : kMmaRows * kMmaWarps;
        const int64_t tiles = (a.M + rows - 1) / rows * ((a.N + kMmaTokens - 1) / kMmaTokens);
        const dim3 grid(static_cast<unsigned>(tiles < int64_t(sms) * 16 ? tiles : int64_t(sms) * 16));
        BN_CUDA_TRY(split_k ? bn_launch_pdl(gemv_block_scaled_mma<T, true>, grid, dim3(kMmaWarps * 32), 0, stream, a)
                            : bn_launch_pdl(gemv_block_scaled_mma<T, false>, grid, dim3(kMmaWarps * 32), 0, stream, a));
        return BITNET_OK;
    }
    const int64_t blocks = (a.M + kThreads / 32 - 1) / (kThreads / 32), most = int64_t(sms) * 8;
    BN_CUDA_TRY(bn_launch_pdl(gemv_block_scaled_dp4a<T>, dim3(static_cast<unsigned>(blocks < most ? blocks : most)),
                              dim3(kThreads), 0, stream, a));
    return BITNET_OK;
}

}  // namespace

bitnet_status bn_cuda_gemv_w2a8_block_scaled(int32_t device, const uint8_t *w_packed,
                                             const float *w_scales, const float *block_scales,
                                             int64_t M, int64_t K, const int8_t *x_q,
                                             const float *x_scales, int64_t N, void *y,
                                             int32_t y_dtype, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    int major = 0, sms = 0;
    BN_CUDA_TRY(bn_current_cc_major(&major));
    BN_TRY(bn_cuda_sm_count(device, &sms));
    const BlockScaledArgs a{reinterpret_cast<const uint4 *>(w_packed), w_scales, block_scales, x_q,
                            x_scales, y, M, K, N};
    const bool mma = major >= 8 && N >= 2; /* int8 mma needs sm_80 */
    cudaStream_t s = bn_stream(stream);
    return y_dtype == BITNET_DTYPE_F32   ? launch<float>(a, sms, mma, s)
           : y_dtype == BITNET_DTYPE_F16 ? launch<__half>(a, sms, mma, s)
                                         : launch<__nv_bfloat16>(a, sms, mma, s);
}
