/* CUDA W2A8 GEMV: y[n, m] = (dot(codes[m], x_q[n]) - sum(x_q[n])) * w_scales[m] / x_scales[n],
 * codes = W_q + 1 (docs/weight_format.md: (word >> 2i) & 0x03030303 is the codes of 4 consecutive
 * weights). x of the launch's tokens is staged in shared memory (16-byte pieces swizzled so that the
 * reads are conflict-free); the weights are streamed from HBM exactly once per launch.
 * - 1 token, dp4a: a warp owns 4 rows, 8 lanes per row; a lane loads 8 16-byte chunks of its row
 *   at a time and prefetches the next 8 while it computes.
 * - 2..16 tokens, int8 tensor cores (mma.m16n8k32): a block owns 16 rows, its 8 warps split K;
 *   lane (g, t) loads 16 bytes of rows g and g+8 at chunk 4s+t, which feed 8 mma steps; the mma's
 *   k order is a permutation of K, applied to x alike. The 8 partial tiles meet in shared memory.
 * Programmatic dependent launch: the first weight loads are issued before griddepcontrol.wait, x
 * and the scales are read after it. Bytes: M*K/4 + N*K + N*M*4. H100, L2 cold (bench_gemv.py):
 * 55296x5120 26.1 us = 2719 GB/s (87% of read BW), 5120x27648 15.4 us (74%), 2560x2560 2.3 us. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kSharedBudget = 160 * 1024; /* the x tile, NT * K bytes */

/* dp4a kernel, one token */
constexpr int kLanesPerRow = 8;
constexpr int kRowsPerWarp = 32 / kLanesPerRow;
constexpr int kChunksPerLane = 8;
constexpr int kOneTokenBlocksPerSm = 2;

/* mma kernel, up to 16 tokens */
constexpr int kRowsPerBlock = 16;
constexpr int kStepsPerLoad = 2; /* 64-byte chunk quads per warp per load */
constexpr int kMmaBlocksPerSm = 3;

struct GemvArgs {
    const uint4 *w;        /* [M, K/64]: 16-byte chunks of 64 weights */
    const float *w_scales;
    const int8_t *x_q;     /* first token of this launch */
    const float *x_scales; /* first token of this launch */
    void *y;               /* first token of this launch: y[n * M + m] */
    int32_t y_dtype;
    int M, K, n_valid;
};

/* Byte offset of 16-byte piece q of chunk c (64 bytes) of token n in the x tile. The XOR spreads
 * over all banks both 8 consecutive chunks of one token and 4 chunks of 2 adjacent tokens. */
__device__ __forceinline__ int x_offset(int K, int n, int c, int q) {
    return n * K + c * 64 + 16 * (q ^ (((c >> 1) + 2 * (n & 1)) & 3));
}

__device__ __forceinline__ uint32_t codes(uint32_t word, int shift) {
    return (word >> (2 * shift)) & 0x03030303u;
}

/* Stages x of NT tokens (zeros past n_valid) and x_sums[n] = sum_k x[n, k]. All threads. */
template <int NT>
__device__ void stage_x(const GemvArgs &a, int8_t *x_tile, int *x_sums) {
    const int pieces = a.K / 16;
    for (int p = threadIdx.x; p < NT * pieces; p += kThreads) {
        int n = p / pieces, piece = p % pieces;
        int4 v = make_int4(0, 0, 0, 0);
        if (n < a.n_valid) v = reinterpret_cast<const int4 *>(a.x_q + static_cast<int64_t>(n) * a.K)[piece];
        *reinterpret_cast<int4 *>(x_tile + x_offset(a.K, n, piece / 4, piece % 4)) = v;
    }
    __syncthreads();
    const int lane = threadIdx.x % 32;
    for (int n = threadIdx.x / 32; n < NT; n += kWarps) {
        const int4 *x = reinterpret_cast<const int4 *>(x_tile + n * a.K);
        int sum = 0;
        for (int piece = lane; piece < pieces; piece += 32) {
            int4 v = x[piece];
            sum = __dp4a(v.x, 0x01010101, __dp4a(v.y, 0x01010101, __dp4a(v.z, 0x01010101, __dp4a(v.w, 0x01010101, sum))));
        }
        for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(~0u, sum, offset);
        if (lane == 0) x_sums[n] = sum;
    }
    __syncthreads();
}

__device__ __forceinline__ void store(const GemvArgs &a, int n, int m, int dot) {
    int64_t index = static_cast<int64_t>(n) * a.M + m;
    if (a.y_dtype == BITNET_DTYPE_I32) {
        static_cast<int *>(a.y)[index] = dot;
        return;
    }
    float value = __fdiv_rn(__fmul_rn(static_cast<float>(dot), a.w_scales[m]), a.x_scales[n]);
    if (a.y_dtype == BITNET_DTYPE_F32) static_cast<float *>(a.y)[index] = value;
    else if (a.y_dtype == BITNET_DTYPE_F16) static_cast<__half *>(a.y)[index] = __float2half_rn(value);
    else static_cast<__nv_bfloat16 *>(a.y)[index] = __float2bfloat16_rn(value);
}

__global__ __launch_bounds__(kThreads) void gemv_one_token(const GemvArgs a) {
    extern __shared__ int4 shared[];
    int8_t *x_tile = reinterpret_cast<int8_t *>(shared);
    int *x_sums = reinterpret_cast<int *>(x_tile + a.K);

    const int lane = threadIdx.x % 32, sub = lane % kLanesPerRow;
    const int chunks_per_row = a.K / 64;
    const int iterations = (chunks_per_row + kLanesPerRow * kChunksPerLane - 1) / (kLanesPerRow * kChunksPerLane);
    const int tiles = (a.M + kRowsPerWarp - 1) / kRowsPerWarp;
    /* Warp-major numbering spreads the tiles evenly over the blocks, hence over the SMs. */
    const int warp_stride = gridDim.x * kWarps;
    int tile = (threadIdx.x / 32) * gridDim.x + blockIdx.x;

    auto load = [&](uint4 (&w)[kChunksPerLane], int tile_, int iteration) {
        int row = tile_ * kRowsPerWarp + lane / kLanesPerRow;
#pragma unroll
        for (int u = 0; u < kChunksPerLane; u++) {
            int chunk = (iteration * kChunksPerLane + u) * kLanesPerRow + sub;
            w[u] = row < a.M && chunk < chunks_per_row
                       ? __ldcs(a.w + static_cast<int64_t>(row) * chunks_per_row + chunk)
                       : make_uint4(0, 0, 0, 0);
        }
    };

    uint4 w[kChunksPerLane];
    if (tile < tiles) load(w, tile, 0); /* the weights never depend on the previous kernel */
    bn_pdl_launch_dependents();
    bn_pdl_wait();
    stage_x<1>(a, x_tile, x_sums);

    for (; tile < tiles; tile += warp_stride) {
        int acc = 0;
        for (int iteration = 0; iteration < iterations; iteration++) {
            uint4 next[kChunksPerLane];
            int next_tile = iteration + 1 < iterations ? tile : tile + warp_stride;
            if (next_tile < tiles) load(next, next_tile, iteration + 1 < iterations ? iteration + 1 : 0);
#pragma unroll
            for (int u = 0; u < kChunksPerLane; u++) {
                int chunk = (iteration * kChunksPerLane + u) * kLanesPerRow + sub;
                if (chunk >= chunks_per_row) break;
                const uint32_t words[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    int4 x = *reinterpret_cast<const int4 *>(x_tile + x_offset(a.K, 0, chunk, q));
                    /* x word 4q+j holds k = 16q+4j..+3 of the chunk: packed word q, shift j */
                    acc = __dp4a(static_cast<int>(codes(words[q], 0)), x.x, acc);
                    acc = __dp4a(static_cast<int>(codes(words[q], 1)), x.y, acc);
                    acc = __dp4a(static_cast<int>(codes(words[q], 2)), x.z, acc);
                    acc = __dp4a(static_cast<int>(codes(words[q], 3)), x.w, acc);
                }
            }
#pragma unroll
            for (int u = 0; u < kChunksPerLane; u++) w[u] = next[u];
        }
#pragma unroll
        for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) acc += __shfl_xor_sync(~0u, acc, offset);
        int row = tile * kRowsPerWarp + lane / kLanesPerRow;
        if (sub == 0 && row < a.M) store(a, 0, row, acc - x_sums[0]);
    }
}

__device__ __forceinline__ void mma_s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, int b0, int b1) {
    BN_SM80_ASM(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* NT = 8 * NTILES tokens. Lane (g, t) = (lane / 4, lane % 4), as in the mma fragment layouts:
 * A row g and g+8 of the block's 16 rows, B column (token) g, D rows g, g+8 x tokens 2t, 2t+1. */
template <int NTILES>
__global__ __launch_bounds__(kThreads) void gemv_tokens_mma(const GemvArgs a) {
    constexpr int NT = 8 * NTILES;
    extern __shared__ int4 shared[];
    int8_t *x_tile = reinterpret_cast<int8_t *>(shared);
    int *x_sums = reinterpret_cast<int *>(x_tile + NT * a.K);
    int *partial = x_sums + NT; /* [kWarps][NTILES][4][32] */

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int chunks_per_row = a.K / 64;
    const int quads = (chunks_per_row + 3) / 4;              /* chunk quads per row */
    const int warp_quads = (quads - warp + kWarps - 1) / kWarps; /* quads warp, warp + 8, ... */
    const int iterations = (warp_quads + kStepsPerLoad - 1) / kStepsPerLoad;
    const int tiles = (a.M + kRowsPerBlock - 1) / kRowsPerBlock;

    /* w[s][0]: row g, w[s][1]: row g+8, chunk 4 * quad + t, quad = warp + 8 * (iteration * 2 + s) */
    auto load = [&](uint4 (&w)[kStepsPerLoad][2], int tile_, int iteration) {
#pragma unroll
        for (int s = 0; s < kStepsPerLoad; s++) {
            int quad = warp + kWarps * (iteration * kStepsPerLoad + s);
            int chunk = 4 * quad + t;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int row = tile_ * kRowsPerBlock + g + 8 * h;
                w[s][h] = row < a.M && quad < quads && chunk < chunks_per_row
                              ? __ldcs(a.w + static_cast<int64_t>(row) * chunks_per_row + chunk)
                              : make_uint4(0, 0, 0, 0);
            }
        }
    };

    int tile = blockIdx.x;
    uint4 w[kStepsPerLoad][2];
    if (tile < tiles && iterations > 0) load(w, tile, 0);
    bn_pdl_launch_dependents();
    bn_pdl_wait();
    stage_x<NT>(a, x_tile, x_sums);

    for (; tile < tiles; tile += gridDim.x) {
        int d[NTILES][4] = {};
        for (int iteration = 0; iteration < iterations; iteration++) {
            uint4 next[kStepsPerLoad][2];
            int next_tile = iteration + 1 < iterations ? tile : tile + gridDim.x;
            if (next_tile < tiles) load(next, next_tile, iteration + 1 < iterations ? iteration + 1 : 0);
#pragma unroll
            for (int s = 0; s < kStepsPerLoad; s++) {
                int quad = warp + kWarps * (iteration * kStepsPerLoad + s);
                int chunk = 4 * quad + t;
                if (quad >= quads) break;
                const uint32_t lo[4] = {w[s][0].x, w[s][0].y, w[s][0].z, w[s][0].w};
                const uint32_t hi[4] = {w[s][1].x, w[s][1].y, w[s][1].z, w[s][1].w};
#pragma unroll
                for (int j = 0; j < NTILES; j++) {
                    int4 x[4] = {};
                    if (chunk < chunks_per_row) {
#pragma unroll
                        for (int q = 0; q < 4; q++)
                            x[q] = *reinterpret_cast<const int4 *>(x_tile + x_offset(a.K, g + 8 * j, chunk, q));
                    }
                    /* mma step q, half e: k = 16q + 4(2e) and 16q + 4(2e+1) of the lane's chunk */
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        mma_s8(d[j], codes(lo[q], 0), codes(hi[q], 0), codes(lo[q], 1), codes(hi[q], 1), x[q].x, x[q].y);
                        mma_s8(d[j], codes(lo[q], 2), codes(hi[q], 2), codes(lo[q], 3), codes(hi[q], 3), x[q].z, x[q].w);
                    }
                }
            }
#pragma unroll
            for (int s = 0; s < kStepsPerLoad; s++) w[s][0] = next[s][0], w[s][1] = next[s][1];
        }
        /* The 8 warps' partial tiles -> warp 0 adds them and stores. */
#pragma unroll
        for (int j = 0; j < NTILES; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) partial[((warp * NTILES + j) * 4 + r) * 32 + lane] = d[j][r];
        __syncthreads();
        if (warp == 0) {
#pragma unroll
            for (int j = 0; j < NTILES; j++)
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    int dot = 0;
                    for (int w2 = 0; w2 < kWarps; w2++) dot += partial[((w2 * NTILES + j) * 4 + r) * 32 + lane];
                    int row = tile * kRowsPerBlock + g + 8 * (r / 2), n = 8 * j + 2 * t + r % 2;
                    if (row < a.M && n < a.n_valid) store(a, n, row, dot - x_sums[n]);
                }
        }
        __syncthreads();
    }
}

/* Launches `kernel` with programmatic stream serialization on a grid of at most `blocks_per_sm`
 * resident blocks per SM (fewer if `work_blocks` is smaller). */
template <typename Kernel>
bitnet_status launch(int device, Kernel kernel, int64_t work_blocks, int blocks_per_sm,
                     size_t shared_bytes, const GemvArgs &a, cudaStream_t stream) {
    if (shared_bytes > 48 * 1024)
        BN_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(shared_bytes)));
    int sms = 0, resident = 0;
    BN_TRY(bn_cuda_sm_count(device, &sms));
    BN_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, shared_bytes));
    int64_t per_sm = resident < 1 ? 1 : resident < blocks_per_sm ? resident : blocks_per_sm;
    int64_t blocks = work_blocks < sms * per_sm ? work_blocks : sms * per_sm;

    BN_CUDA_TRY(bn_launch_pdl(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                              shared_bytes, stream, a));
    return BITNET_OK;
}

}  // namespace

bitnet_status bn_cuda_gemv_w2a8(int32_t device, const uint8_t *w_packed, const float *w_scales,
                                int64_t M, int64_t K, const int8_t *x_q, const float *x_scales,
                                int64_t N, void *y, int32_t y_dtype, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    if (M > INT32_MAX / 2)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_gemv_w2a8: M = %lld is over the CUDA "
                       "kernel's limit (%d)", (long long)M, INT32_MAX / 2);
    cudaStream_t s = bn_stream(stream);
    int64_t y_size = bn_dtype_size(y_dtype);
    /* Tokens per launch: 1 (dp4a), else 8 or 16 (mma) as far as x fits the shared-memory budget;
     * past 16 tokens, or where even 8 do not fit, launches repeat (and read the weights again). */
    int major = 0;
    BN_CUDA_TRY(bn_current_cc_major(&major));
    /* The int8 tensor-core kernel needs sm_80; older GPUs take one token per launch. */
    int64_t tokens_fit = major >= 8 ? kSharedBudget / K : 0;
    for (int64_t n0 = 0; n0 < N;) {
        int64_t left = N - n0;
        int nt = left == 1 || tokens_fit < 8 ? 1 : left <= 8 || tokens_fit < 16 ? 8 : 16;
        GemvArgs a;
        a.w = reinterpret_cast<const uint4 *>(w_packed);
        a.w_scales = w_scales;
        a.x_q = x_q + n0 * K;
        a.x_scales = x_scales + n0;
        a.y = static_cast<char *>(y) + n0 * M * y_size;
        a.y_dtype = y_dtype;
        a.M = static_cast<int>(M);
        a.K = static_cast<int>(K);
        a.n_valid = static_cast<int>(left < nt ? left : nt);
        size_t x_bytes = static_cast<size_t>(nt) * K + nt * sizeof(int);
        if (nt == 1) {
            int64_t warp_tiles = (M + kRowsPerWarp - 1) / kRowsPerWarp;
            BN_TRY(launch(device, gemv_one_token, warp_tiles, kOneTokenBlocksPerSm, x_bytes, a, s));
        } else {
            int64_t tiles = (M + kRowsPerBlock - 1) / kRowsPerBlock;
            size_t partial_bytes = static_cast<size_t>(kWarps) * (nt / 8) * 4 * 32 * sizeof(int);
            size_t bytes = x_bytes + partial_bytes;
            if (nt == 8) BN_TRY(launch(device, gemv_tokens_mma<1>, tiles, kMmaBlocksPerSm, bytes, a, s));
            else BN_TRY(launch(device, gemv_tokens_mma<2>, tiles, kMmaBlocksPerSm, bytes, a, s));
        }
        n0 += a.n_valid;
    }
    return BITNET_OK;
}
