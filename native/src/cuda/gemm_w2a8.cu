/* CUDA W2A8 GEMM for many tokens, int8 tensor cores (mma.sync m16n8k32, sm_80+):
 * y[n, m] = (dot(x_q[n], codes[m]) - sum(x_q[n])) * w_scales[m] / x_scales[n], codes = W_q + 1.
 * - A block owns BM tokens x BN weight rows; K goes by tiles of 128 (K % 128 == 0). Each tile of x
 *   (BM x 128 bytes) and of the packed weights (BN x 32 bytes) is copied to shared memory by
 *   cp.async, STAGES tiles in flight. x rows are swizzled by 16-byte chunks for ldmatrix.
 * - mma A = x (ldmatrix, 16 tokens x 32), B = weight codes (8 rows x 32): lane (g, t) gets k = 4t..4t+3
 *   of each 16-byte piece of k, which is packed word s of its row at shift t (docs/weight_format.md):
 *   one shift and one AND per 4 weights, read as unsigned bytes (mma s8.u8). The codes' excess sum(x)
 *   is taken by dp4a from the A fragments, one k32 step in WARPS_N per warp, added up at the end.
 * - Fragments are read one k32 step ahead of the mma. Few blocks for the GPU (sm_90): K is split over a
 *   thread-block cluster whose blocks add up the partial dots through distributed shared memory, each
 *   a share of the outputs.
 * - Epilogue: float32(float32(dot) * w_scale) / x_scale (the GEMV's rule), or the int32 dot.
 * The packed weights are the GEMV's: no second copy. Measured numbers: docs/gemm.md. */
#include <algorithm>
#include <cooperative_groups.h>

#include "common.cuh"
#include "gemm_w2a8.cuh"

namespace cg = cooperative_groups;
using namespace bn_gemm;

namespace {

/* 16 bytes global -> shared, zero-filled where !valid (src must still be a mapped address). */
__device__ __forceinline__ void copy16(uint32_t dst, const void *src, bool valid) {
    BN_SM80_ASM("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy_commit() { BN_SM80_ASM("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void copy_wait() {
    BN_SM80_ASM("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

constexpr int kRowsPerBlock = 128;       /* weight rows per block (256 for the largest problems) */
/* k tiles in flight. The smaller blocks have room for more stages; on an H100, 6 and 8 timed the same
 * as 4 within 3% (docs/log/2026-11-26.md#2026-11-26-10). The defines are for tools/dev/gemm_variants.sh. */
#ifndef GEMM_MID_STAGES
#define GEMM_MID_STAGES 6
#endif
#ifndef GEMM_SMALL_STAGES
#define GEMM_SMALL_STAGES 8
#endif
constexpr int kStages = 4;                    /* 128 tokens x 256 rows */
constexpr int kMidStages = GEMM_MID_STAGES;     /* 128 tokens x 128 rows */
constexpr int kSmallStages = GEMM_SMALL_STAGES; /* 32 or 64 tokens x 128 rows */
/* Compute capability 9.0: the wgmma kernel (gemm_w2a8_sm90.cu) for every N from GEMM_WGMMA_MIN_TOKENS
 * on (a large value leaves this mma.sync kernel to every N, for tools/dev/gemm_variants.sh). Its
 * blocks: 64 tokens x 128 rows up to 64 tokens, 96 x 128 up to 96; matrices of fewer than 2^24
 * weights keep 64-token blocks up to GEMM_WGMMA_SMALL_MATRIX_TOKENS (fewer ways of K split: 2560 x 2560
 * at 128 tokens 9.0 -> 7.8 us, at 192 10.1 -> 8.5; H200, docs/log/2026-12-02.md#2026-12-02-7), then
 * to 512 tokens take the blocks of small_matrix_tokens where those fit one wave. Past those, 128
 * tokens x 256 rows where x takes >= 64 MiB (half the passes over x) and they still number 2 per
 * SM, else 128 x 128 (two per SM) or 160 x 128 (below). K is split over clusters where the blocks
 * are too few for the SMs (wgmma_split). Measured: docs/log/2026-11-26.md#2026-11-26-30
 * (the tiles, H100), 2026-12-02-7 (64- and 96-token tiles from 17 tokens on, faster than this kernel
 * at every shape but 2560 x 2560 and 3840 x 2560 at 32 tokens, +1-2%: 13824 x 2560 at 64 tokens 14.5 ->
 * 10.9 us, 55296 x 5120 80 -> 52). GEMM_WGMMA_ROWS = 128 or 256 forces the rows of 128-token
 * blocks. */
#ifndef GEMM_WGMMA_MIN_TOKENS
#define GEMM_WGMMA_MIN_TOKENS 0
#endif
#ifndef GEMM_WGMMA_SMALL_MATRIX_TOKENS
#define GEMM_WGMMA_SMALL_MATRIX_TOKENS 256
#endif

#ifndef GEMM_WGMMA_ROWS
#define GEMM_WGMMA_ROWS 0
#endif
/* GEMM_WGMMA_TOKENS = 128 or 160 forces the tokens of a block (160: 128 rows, no split; for
 * tools/dev/gemm_variants.sh). */
#ifndef GEMM_WGMMA_TOKENS
#define GEMM_WGMMA_TOKENS 0
#endif
/* 0 turns off the split of the last partial wave's tiles (for tools/dev/gemm_variants.sh). */
#ifndef GEMM_WGMMA_REMAINDER
#define GEMM_WGMMA_REMAINDER 1
#endif

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
    BN_SM80_ASM("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                : "r"(address));
}

__device__ __forceinline__ uint2 lds64(uint32_t address) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(address));
    return v;
}

/* d += A B, A 16x32 signed bytes (x), B 32x8 unsigned bytes (codes). */
__device__ __forceinline__ void mma_s8_u8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    BN_SM80_ASM(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* y[n, m] and y[n, m + 1] (the second only where pair). */
__device__ __forceinline__ void store_pair(const GemmArgs &a, int n, int m, int d0, int d1, float ws0, float ws1,
                                           float xs, bool pair) {
    const int64_t index = static_cast<int64_t>(n) * a.M + m;
    const bool vector = pair && (index % 2 == 0);
    if (a.y_dtype == BITNET_DTYPE_I32) {
        int *y = static_cast<int *>(a.y) + index;
        if (vector) *reinterpret_cast<int2 *>(y) = make_int2(d0, d1);
        else {
            y[0] = d0;
            if (pair) y[1] = d1;
        }
        return;
    }
    const float v0 = scaled(d0, ws0, xs), v1 = scaled(d1, ws1, xs);
    if (a.y_dtype == BITNET_DTYPE_F32) {
        float *y = static_cast<float *>(a.y) + index;
        if (vector) *reinterpret_cast<float2 *>(y) = make_float2(v0, v1);
        else {
            y[0] = v0;
            if (pair) y[1] = v1;
        }
    } else if (a.y_dtype == BITNET_DTYPE_F16) {
        __half *y = static_cast<__half *>(a.y) + index;
        if (vector) *reinterpret_cast<__half2 *>(y) = __halves2half2(__float2half_rn(v0), __float2half_rn(v1));
        else {
            y[0] = __float2half_rn(v0);
            if (pair) y[1] = __float2half_rn(v1);
        }
    } else {
        __nv_bfloat16 *y = static_cast<__nv_bfloat16 *>(a.y) + index;
        if (vector) *reinterpret_cast<__nv_bfloat162 *>(y) = __halves2bfloat162(__float2bfloat16_rn(v0), __float2bfloat16_rn(v1));
        else {
            y[0] = __float2bfloat16_rn(v0);
            if (pair) y[1] = __float2bfloat16_rn(v1);
        }
    }
}

template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, int SPLIT>
struct Tiles {
    static constexpr int kThreads = WARPS_M * WARPS_N * 32;
    static constexpr int kWarpTokens = BM / WARPS_M, kWarpRows = BN / WARPS_N;
    static constexpr int kMI = kWarpTokens / 16, kNI = kWarpRows / 8; /* mma tiles per warp */
    static constexpr int kXBytes = BM * kTileK, kWBytes = BN * kTileKBytesW;
    static constexpr int kStageBytes = kXBytes + kWBytes;
    static constexpr size_t kSharedBytes = static_cast<size_t>(STAGES) * kStageBytes;
    static constexpr int kDots = kMI * kNI * 4; /* per thread */
    static_assert(kWarpTokens % 16 == 0 && kWarpRows % 8 == 0, "warp tile");
    static_assert(BM * 8 % kThreads == 0 && BN * 2 % kThreads == 0, "stage copies");
    static_assert((WARPS_N * BM + (SPLIT > 1 ? kDots * kThreads : 0)) * sizeof(int) <= kSharedBytes,
                  "the x sums and the split-K exchange reuse the stages");
};

/* Blocks: x = token tiles times SPLIT (fastest, so that the blocks running at once share weight
 * rows and the weights are read from DRAM about once), y = row tiles. SPLIT > 1 (sm_90): the SPLIT
 * blocks of a cluster take equal shares of K, then each adds up a SPLIT-th of the outputs over the
 * others' partial dots in their shared memory (exact int32) and stores it. */
template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, int SPLIT>
__global__ __launch_bounds__(WARPS_M *WARPS_N * 32, 1) void gemm_w2a8(const GemmArgs a) {
    using T = Tiles<BM, BN, WARPS_M, WARPS_N, STAGES, SPLIT>;
    extern __shared__ int4 shared[];
    uint8_t *smem = reinterpret_cast<uint8_t *>(shared);
    const uint32_t smem_base = shared_address(smem);

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
    const int g = lane / 4, t = lane % 4;
    const int token0 = blockIdx.x / SPLIT * BM, row0 = blockIdx.y * BN;
    const int split = blockIdx.x % SPLIT; /* the block's rank in its cluster */
    const int kt0 = static_cast<int>(static_cast<int64_t>(a.K / kTileK) * split / SPLIT);
    const int k_tiles = static_cast<int>(static_cast<int64_t>(a.K / kTileK) * (split + 1) / SPLIT) - kt0;
    const int64_t w_row_bytes = a.K / 4;

    /* The copies of a stage: thread tid copies x rows tid / 8 + j threads / 8 (chunk tid % 8) and
     * weight rows tid / 2 + j threads / 2 (half tid % 2); the swizzles depend only on tid. */
    constexpr int kXCopies = BM * 8 / T::kThreads, kWCopies = BN * 2 / T::kThreads;
    const int x_r = tid / 8, x_c = tid % 8, w_n = tid / 2, w_h = tid % 2;
    const int8_t *x_src = a.x + static_cast<int64_t>(token0 + x_r) * a.K + x_c * 16;
    const uint8_t *w_src = a.w + static_cast<int64_t>(row0 + w_n) * w_row_bytes + w_h * 16;
    const int x_dst = x_tile_offset(x_r, x_c), w_dst = T::kXBytes + w_tile_offset(w_n, w_h);
    auto load_x = [&](int s, int kt) {
        const uint32_t base = smem_base + s * T::kStageBytes;
#pragma unroll
        for (int j = 0; j < kXCopies; j++) {
            constexpr int kRows = T::kThreads / 8;
            const bool valid = token0 + x_r + kRows * j < a.N;
            copy16(base + x_dst + j * kRows * 128,
                   valid ? x_src + static_cast<int64_t>(kRows * j) * a.K + kt * kTileK : a.x, valid);
        }
    };
    auto load_w = [&](int s, int kt) {
        const uint32_t base = smem_base + s * T::kStageBytes;
#pragma unroll
        for (int j = 0; j < kWCopies; j++) {
            constexpr int kRows = T::kThreads / 2;
            const bool valid = row0 + w_n + kRows * j < a.M;
            copy16(base + w_dst + j * kRows * 32,
                   valid ? w_src + kRows * j * w_row_bytes + kt * kTileKBytesW : a.w, valid);
        }
    };

    /* The weights and their scales never depend on the previous kernel (as in gemm_w2a8_sm90.cu): the
     * first stages' weights (one copy group, ahead of the stages' x groups) and the L2 lines of the
     * block's row scales are requested before the PDL wait, the token scales' lines right after it,
     * so that the epilogue's scale loads hit L2. */
    bn_prefetch_l2(a.w_scales, row0, BN, a.M, tid);
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++)
        if (s < k_tiles) load_w(s, kt0 + s);
    copy_commit();
    bn_pdl_wait();
    bn_prefetch_l2(a.x_scales, token0, BM, a.N, tid - 32);

    /* Fragments of k32 step `step` of a stage. A (x): lane l reads row (l % 8) + 8 ((l / 8) % 2) of a
     * 16-token tile, chunk 2 step + l / 16, swizzled by the row's low 3 bits (the same for every mi).
     * B (weights): row b_row + 8 ni, packed words 2 step and 2 step + 1 of its 32 bytes. */
    const int a_row = warp_m * T::kWarpTokens + (lane % 8) + 8 * ((lane / 8) % 2);
    const int a_swizzle = (lane / 16) ^ (a_row & 7);
    const int b_row = warp_n * T::kWarpRows + g, b_swizzle = (g >> 2) & 1;
    const int shift = 2 * t;
    auto load_fragments = [&](uint32_t (&af)[T::kMI][4], uint2 (&bw)[T::kNI], uint32_t base, int step) {
#pragma unroll
        for (int mi = 0; mi < T::kMI; mi++)
            ldmatrix_x4(af[mi], base + (a_row + 16 * mi) * 128 + ((a_swizzle ^ (2 * step)) << 4));
        const uint32_t w = base + T::kXBytes + b_row * 32 + (((step / 2) ^ b_swizzle) << 4) + 8 * (step % 2);
#pragma unroll
        for (int ni = 0; ni < T::kNI; ni++) bw[ni] = lds64(w + ni * 8 * 32);
    };

    int acc[T::kMI][T::kNI][4] = {};
    int x_sum[T::kMI][2] = {}; /* tokens g, g + 8: x over this lane's bytes of this warp's k32 steps */
    constexpr int kOnes = 0x01010101;

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < k_tiles) load_x(s, kt0 + s);
        copy_commit();
    }
    copy_wait<STAGES - 2>(); /* the weights' group and tile 0's x */
    __syncthreads();

    /* Fragments are read one k32 step ahead of the mma (double buffers). Stage of tile kt: kt %
     * STAGES; the barrier at the last step of tile kt makes tile kt + 1 visible and frees the stage
     * of tile kt for tile kt + STAGES. */
    uint32_t af[2][T::kMI][4];
    uint2 bw[2][T::kNI];
    int stage = 0;
    if (k_tiles > 0) load_fragments(af[0], bw[0], smem_base, 0);
    for (int kt = 0; kt < k_tiles; kt++) {
        if (kt + STAGES - 1 < k_tiles) {
            load_x((kt + STAGES - 1) % STAGES, kt0 + kt + STAGES - 1);
            load_w((kt + STAGES - 1) % STAGES, kt0 + kt + STAGES - 1);
        }
        copy_commit();
#pragma unroll
        for (int step = 0; step < 4; step++) {
            const int cur = step % 2;
            if (step == 3) {
                copy_wait<STAGES - 2>();
                __syncthreads();
                stage = stage + 1 == STAGES ? 0 : stage + 1;
            }
            if (step < 3 || kt + 1 < k_tiles)
                load_fragments(af[cur ^ 1], bw[cur ^ 1], smem_base + stage * T::kStageBytes, (step + 1) % 4);
#pragma unroll
            for (int ni = 0; ni < T::kNI; ni++) {
                const uint32_t b0 = (bw[cur][ni].x >> shift) & 0x03030303u, b1 = (bw[cur][ni].y >> shift) & 0x03030303u;
#pragma unroll
                for (int mi = 0; mi < T::kMI; mi++) mma_s8_u8(acc[mi][ni], af[cur][mi], b0, b1);
            }
            if (step % WARPS_N == warp_n) {
#pragma unroll
                for (int mi = 0; mi < T::kMI; mi++) {
                    x_sum[mi][0] = __dp4a(static_cast<int>(af[cur][mi][0]), kOnes, __dp4a(static_cast<int>(af[cur][mi][2]), kOnes, x_sum[mi][0]));
                    x_sum[mi][1] = __dp4a(static_cast<int>(af[cur][mi][1]), kOnes, __dp4a(static_cast<int>(af[cur][mi][3]), kOnes, x_sum[mi][1]));
                }
            }
        }
    }
    copy_wait<0>();
    bn_pdl_launch_dependents();
    __syncthreads();

    /* The warps of one token range add up their shares of sum(x): sums[warp_n][token in block]. */
    int *sums = reinterpret_cast<int *>(smem);
#pragma unroll
    for (int mi = 0; mi < T::kMI; mi++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int sum = x_sum[mi][half];
            sum += __shfl_xor_sync(~0u, sum, 1);
            sum += __shfl_xor_sync(~0u, sum, 2);
            if (t == 0) sums[warp_n * BM + warp_m * T::kWarpTokens + 16 * mi + g + 8 * half] = sum;
        }
    }
    __syncthreads();

    /* acc becomes the dots (of this block's share of K): codes . x - sum(x). */
#pragma unroll
    for (int mi = 0; mi < T::kMI; mi++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = warp_m * T::kWarpTokens + 16 * mi + g + 8 * half;
            int total = 0;
#pragma unroll
            for (int wn = 0; wn < WARPS_N; wn++) total += sums[wn * BM + r];
#pragma unroll
            for (int ni = 0; ni < T::kNI; ni++) {
                acc[mi][ni][2 * half] -= total;
                acc[mi][ni][2 * half + 1] -= total;
            }
        }
    }
    if constexpr (SPLIT > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        /* exchange[i * threads + tid]: dot i of thread tid, after the x sums. Every block of the
         * cluster puts its dots there; each then adds up the output pairs (mi, half, ni) numbered
         * split mod SPLIT over the others' dots, read through distributed shared memory, and stores
         * those pairs. */
        int *exchange = sums + WARPS_N * BM;
        cg::cluster_group cluster = cg::this_cluster();
#pragma unroll
        for (int mi = 0; mi < T::kMI; mi++)
#pragma unroll
            for (int ni = 0; ni < T::kNI; ni++)
#pragma unroll
                for (int e = 0; e < 4; e++) exchange[((mi * T::kNI + ni) * 4 + e) * T::kThreads + tid] = acc[mi][ni][e];
        cluster.sync();
#pragma unroll 1
        for (int rank = 1; rank < SPLIT; rank++) {
            const int *other = cluster.map_shared_rank(exchange, (split + rank) % SPLIT);
#pragma unroll
            for (int mi = 0; mi < T::kMI; mi++)
#pragma unroll
                for (int half = 0; half < 2; half++)
#pragma unroll
                    for (int ni = 0; ni < T::kNI; ni++) {
                        if (((mi * 2 + half) * T::kNI + ni) % SPLIT != split) continue;
#pragma unroll
                        for (int e = 2 * half; e < 2 * half + 2; e++)
                            acc[mi][ni][e] += other[((mi * T::kNI + ni) * 4 + e) * T::kThreads + tid];
                    }
        }
        cluster.sync(); /* every block's dots stay until the others have read them */
#else
        __trap();
#endif
    }

    /* The scales are loaded before any store (y might alias them as far as the compiler knows). */
    float w_scale[T::kNI][2];
    const bool scaled_out = a.y_dtype != BITNET_DTYPE_I32;
#pragma unroll
    for (int ni = 0; ni < T::kNI; ni++) {
        const int m = row0 + warp_n * T::kWarpRows + 8 * ni + 2 * t;
        w_scale[ni][0] = scaled_out && m < a.M ? a.w_scales[m] : 0.0f;
        w_scale[ni][1] = scaled_out && m + 1 < a.M ? a.w_scales[m + 1] : 0.0f;
    }
    float x_scale[T::kMI][2];
#pragma unroll
    for (int mi = 0; mi < T::kMI; mi++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int n = token0 + warp_m * T::kWarpTokens + 16 * mi + g + 8 * half;
            x_scale[mi][half] = scaled_out && n < a.N ? a.x_scales[n] : 0.0f;
        }
#pragma unroll
    for (int mi = 0; mi < T::kMI; mi++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int n = token0 + warp_m * T::kWarpTokens + 16 * mi + g + 8 * half;
            if (n >= a.N) continue;
#pragma unroll
            for (int ni = 0; ni < T::kNI; ni++) {
                const int m = row0 + warp_n * T::kWarpRows + 8 * ni + 2 * t;
                if (m >= a.M || ((mi * 2 + half) * T::kNI + ni) % SPLIT != split) continue;
                store_pair(a, n, m, acc[mi][ni][2 * half], acc[mi][ni][2 * half + 1], w_scale[ni][0],
                           w_scale[ni][1], x_scale[mi][half], m + 1 < a.M);
            }
        }
    }
}

/* One tile shape: BM tokens x BN rows per block, K split over SPLIT blocks (a cluster; sm_90). */
template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, int SPLIT>
bitnet_status launch(int32_t device, const GemmArgs &a, cudaStream_t stream) {
    using T = Tiles<BM, BN, WARPS_M, WARPS_N, STAGES, SPLIT>;
    auto kernel = gemm_w2a8<BM, BN, WARPS_M, WARPS_N, STAGES, SPLIT>;
    BN_TRY(bn_cuda_kernel_shared_memory(device, reinterpret_cast<const void *>(kernel), T::kSharedBytes));
    const dim3 grid(bn_ceil_div(a.N, BM) * SPLIT, bn_ceil_div(a.M, BN));
    BN_CUDA_TRY(bn_launch_pdl_cluster(kernel, grid, dim3(T::kThreads), T::kSharedBytes, SPLIT, stream, a));
    return BITNET_OK;
}

template <int BM, int WARPS_M, int WARPS_N, int STAGES>
bitnet_status launch_split(int split, int32_t device, const GemmArgs &a, cudaStream_t stream) {
    switch (split) {
    case 8: return launch<BM, kRowsPerBlock, WARPS_M, WARPS_N, STAGES, 8>(device, a, stream);
    case 4: return launch<BM, kRowsPerBlock, WARPS_M, WARPS_N, STAGES, 4>(device, a, stream);
    case 2: return launch<BM, kRowsPerBlock, WARPS_M, WARPS_N, STAGES, 2>(device, a, stream);
    default: return launch<BM, kRowsPerBlock, WARPS_M, WARPS_N, STAGES, 1>(device, a, stream);
    }
}

/* The wgmma kernel's cluster size for `blocks` blocks of 128 rows: too few blocks, K split over
 * clusters, up to one block per SM with >= 4 tiles of K each, or up to three with >= `wide_tiles`
 * (uneven waves of long blocks: 2560 x 6912 at 960 tokens 56.6 -> 47.5 us with 16, where shorter
 * blocks or more of them were slower: log 2026-11-27-13; up to 64 tokens, where the cluster's
 * exchange is small, 8: 13824 x 2560 at 17-64 tokens 10.4-10.9 -> 10.0-10.3 us, log 2026-12-02-10). */
int wgmma_split(int64_t blocks, int64_t K, int sms, int wide_tiles) {
    int split = 1;
    while (split < 8) {
        const int64_t split_blocks = blocks * split * 2;
        const int64_t k_tiles = K / kTileK / (split * 2);
        if (!(split_blocks <= sms ? k_tiles >= 4 : split_blocks <= 3 * sms && k_tiles >= wide_tiles)) break;
        split *= 2;
    }
    return split;
}

/* Tokens per block for a small matrix (< 2^24 weights) at 257 to 512 tokens: the fewest of 64, 96 and
 * 128 whose tiles number at most the SMs, so that with K split over 2 they take one wave of two
 * blocks per SM; 0 where none does (the 128-token path then). H200, µs: 2560 x 2560 at 384 tokens
 * 10.94 -> 9.72 (64), at 512 13.63 -> 11.55 (96); 3840 x 2560 at 288 13.55 -> 11.30 (96), at 512
 * 14.23 -> 13.67 (128): docs/log/2026-12-03.md#2026-12-03-6. */
int small_matrix_tokens(int64_t N, int64_t M, int sms) {
    for (const int tokens : {64, 96, 128})
        if (static_cast<int64_t>(bn_ceil_div(N, tokens)) * bn_ceil_div(M, 128) <= sms) return tokens;
    return 0;
}

}  // namespace

bitnet_status bn_cuda_gemm_w2a8(int32_t device, const uint8_t *w_packed, const float *w_scales, int64_t M,
                                int64_t K, const int8_t *x_q, const float *x_scales, int64_t N, void *y,
                                int32_t y_dtype, void *stream) {
    static_assert(BN_GEMM_MAX_M <= 65535LL * kRowsPerBlock, "blocks of rows: gridDim.y <= 65535");
    if (N > BN_GEMM_MAX_N || M > BN_GEMM_MAX_M)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_gemv_w2a8: N = %lld, M = %lld is over the GEMM's limits "
                       "(N <= %d, M <= %lld)", (long long)N, (long long)M, BN_GEMM_MAX_N, BN_GEMM_MAX_M);
    GemmArgs a;
    a.w = w_packed;
    a.w_scales = w_scales;
    a.x = x_q;
    a.x_scales = x_scales;
    a.y = y;
    a.y_dtype = y_dtype;
    a.M = static_cast<int>(M);
    a.K = static_cast<int>(K);
    a.N = static_cast<int>(N);
    cudaStream_t s = bn_stream(stream);
    int major = 0, sms = 0;
    bool sm90a = false;
    BN_CUDA_TRY(bn_current_cc_major(&major));
    BN_CUDA_TRY(bn_runs_sm90a(device, &sm90a));
    BN_TRY(bn_cuda_sm_count(device, &sms));
    const int64_t token_tiles = bn_ceil_div(N, 128), blocks_128 = token_tiles * bn_ceil_div(M, 128);
    const bool wgmma = sm90a && N >= GEMM_WGMMA_MIN_TOKENS;
    const bool small_matrix = M * K < (1LL << 24);
    const int small_tokens = small_matrix && N > GEMM_WGMMA_SMALL_MATRIX_TOKENS && N <= 512
                                 ? small_matrix_tokens(N, M, sms) : 0;
    if (wgmma && (N <= (small_matrix ? GEMM_WGMMA_SMALL_MATRIX_TOKENS : 96) || small_tokens > 0)) {
        /* 16-token tiles for the N <= 16 that gemv_w2a8 sends here (2^25+ weights), 32-token ones at
         * 17-32 tokens for 2^26+ weights: 5120 x 27648 at 16 tokens 34.7 -> 22.7 us (the GEMV), at 32
         * 33.1 -> 24.3; at 32 tokens 13824 x 2560 took 9.9 -> 10.1 and the batch-32 decode step
         * 2.225 -> 2.270 ms (H200, docs/log/2026-12-03.md#2026-12-03-2). */
        const int tokens = small_tokens > 0                          ? small_tokens
                           : N <= 16                                 ? 16
                           : N <= 32 && M * K >= (1LL << 26)         ? 32
                           : N <= 64 || small_matrix                 ? 64
                                                                     : 96;
        const int64_t blocks = bn_ceil_div(N, tokens) * bn_ceil_div(M, 128);
        int split = wgmma_split(blocks, K, sms, N <= 64 ? 8 : 16);
        /* Small matrices past 128 tokens: K over clusters of 2 where each block keeps 4 tiles (2560 x
         * 2560 at 256 tokens 10.2 -> 9.6 us, H200: docs/log/2026-12-02.md#2026-12-02-8). */
        if (small_matrix && N > 128 && split == 1 && K / kTileK >= 8) split = 2;
        return gemm_w2a8_sm90(device, a, 128, tokens, blocks * split <= sms, split, 0, 1, s);
    }
    if (wgmma && blocks_128 * 8 <= INT32_MAX) {
        const bool large_x = N * K >= (64LL << 20) && token_tiles * bn_ceil_div(M, 256) >= 2 * sms;
        /* 160-token tiles where the 128-token ones are more than the SMs and these are not: one wave
         * of one block per SM, each a quarter larger, in place of a part second wave (2560 x 2560 at
         * 960 tokens 23.7 -> 15.7 us, 5120 x 27648 at 480 127 -> 101: logs 2026-12-02-1 and -2). */
        const bool wide = bn_ceil_div(N, 160) * static_cast<int64_t>(bn_ceil_div(M, 128)) <= sms && blocks_128 > sms;
        const int tokens = GEMM_WGMMA_TOKENS ? GEMM_WGMMA_TOKENS : !large_x && wide ? 160 : 128;
        if (tokens == 160) return gemm_w2a8_sm90(device, a, 128, 160, true, 1, 0, 1, s);
        const int rows = GEMM_WGMMA_ROWS ? GEMM_WGMMA_ROWS : large_x ? 256 : 128;
        const int split = rows == 128 ? wgmma_split(blocks_128, K, sms, 16) : 1;
        /* More tiles than SMs: the tiles past the last whole wave of one per SM are split along K
         * into pieces of >= 16 tiles of K, as many as fill the SMs beside the waves (5120 x 27648 at
         * 960 tokens: 264 tiles whole, 56 in 2 pieces each, 303 -> 264 us; pieces of 5 and 10 tiles
         * of K were slower or no faster: log 2026-11-27-17). */
        const int64_t full_tiles = blocks_128 / sms * sms, rest = blocks_128 - full_tiles;
        int pieces = 1;
        if (GEMM_WGMMA_REMAINDER && rows == 128 && split == 1 && blocks_128 > sms && rest > 0)
            pieces = static_cast<int>(std::min<int64_t>({8, sms / rest, K / kTileK / 16}));
        return gemm_w2a8_sm90(device, a, rows, 128, rows == 128 && blocks_128 * split <= sms, split, full_tiles,
                              pieces, s);
    }
    /* Tokens per block: the fewest of 32, 64, 128 that hold N; rows per block 128, or 256 where
     * that still leaves two waves of blocks. */
    const int bm = N <= 32 ? 32 : N <= 64 ? 64 : 128;
    const int64_t tiles = bn_ceil_div(N, bm) * (int64_t)bn_ceil_div(M, kRowsPerBlock);
    if (bm == 128 && bn_ceil_div(N, bm) * (int64_t)bn_ceil_div(M, 2 * kRowsPerBlock) >= 2 * sms)
        return launch<128, 2 * kRowsPerBlock, 2, 4, kStages, 1>(device, a, s);
    /* Too few blocks for the GPU (sm_90): K split over clusters of 2 to 8 blocks, each taking at
     * least 4 tiles of K, up to one block per SM; two where K >= 16384 (there each block still
     * walks >= 32 tiles: 5120 x 27648 at 17-64 tokens 49 -> 43 us, while two per SM made K = 2560
     * and 6912 slower, 8 -> 10 and 12 -> 13 us: docs/log/2026-11-27.md#2026-11-27-11). */
    const int blocks_per_sm = K >= 16384 ? 2 : 1;
    int split = 1;
    while (major >= 9 && split < 8 && tiles * split * 2 <= blocks_per_sm * sms && K / kTileK >= 4 * split)
        split *= 2;
    if (bm == 32) return launch_split<32, 2, 4, kSmallStages>(split, device, a, s);
    if (bm == 64) return launch_split<64, 2, 4, kSmallStages>(split, device, a, s);
    return launch_split<128, 2, 4, kMidStages>(split, device, a, s);
}
