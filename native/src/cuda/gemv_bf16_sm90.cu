/* Dense bfloat16 output head on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a; built for
 * that target alone, see the Makefile): y[n, m] = sum_k x[n, k] w[m, k], bfloat16 x and w, float32
 * accumulation.
 * - A block owns 128 weight rows x TOKENS tokens (64: two blocks per SM; 128: one); two warpgroups of
 *   64 rows each. K goes by tiles of 64 (128 bytes a row): thread 0 has the tensor memory accelerator
 *   copy the weights (128 rows) and x (min(TOKENS, N) rows) into shared-memory stages in the 128-byte
 *   swizzle that wgmma reads, each stage's arrival counted by an mbarrier. Where N < TOKENS the
 *   stage's rows from N on hold whatever was there: their sums are never stored.
 * - wgmma m64nTOKENSk16, both operands K-major from shared memory. The wgmmas of tile kt + 1 are
 *   issued before those of tile kt are awaited; one block barrier a tile frees the stage of tile kt - 1.
 * - The weights never depend on the previous kernel: the first stages' are requested before the PDL
 *   wait. A last token tile short of TOKENS takes its x box from token N - TOKENS and stores only its
 *   own tokens (boxes past the tensor's end are slow: docs/gemm.md).
 * Launched by bn_cuda_gemv_bf16 (gemv_bf16.cu) on compute capability 9.0. */
#include <algorithm>
#include <cuda_bf16.h>

#include "common.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace {

constexpr int kThreads = 256, kRows = 128;
constexpr int kTileK = 64; /* bfloat16 weights per row per stage: 128 bytes */

template <int TOKENS>
struct HeadShape {
    static constexpr int kBlocksPerSM = TOKENS == 64 ? 2 : 1;
    static constexpr int kStages = TOKENS == 64 ? 4 : 6;
    static constexpr int kWBytes = kRows * 128, kXBytes = TOKENS * 128;
    static constexpr int kStageBytes = kWBytes + kXBytes;
    static constexpr size_t kSharedBytes = static_cast<size_t>(kStages) * kStageBytes + 1024; /* + alignment */
    static_assert(kStageBytes % 1024 == 0, "the 128-byte swizzle repeats every 1024 bytes");
};

/* Descriptor of a K-major tile of rows of 128 bytes starting `address` (1024-aligned, plus 32 s for
 * k16 step s). */
__device__ __forceinline__ uint64_t k_major(uint32_t address) { return swizzle128_descriptor(address, 16, 1024); }

/* d (64 rows x 64 or 128 tokens, float32) += A (64 x 16, shared memory) B (16 x 64 or 128, shared memory). */
__device__ __forceinline__ void wgmma_bf16(float (&d)[32], uint64_t a, uint64_t b) {
    BN_SM90A_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " BN_WGMMA_D32_REGS ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : BN_WGMMA_D32("+f", d)
                 : "l"(a), "l"(b), "r"(1));
}
__device__ __forceinline__ void wgmma_bf16(float (&d)[64], uint64_t a, uint64_t b) {
    BN_SM90A_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " BN_WGMMA_D64_REGS ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : BN_WGMMA_D64("+f", d)
                 : "l"(a), "l"(b), "r"(1));
}

/* A 1-D grid of row tiles x token tiles, the token tile fastest (the blocks running at once share
 * weight rows, so a second token tile finds them in L2). K % 64 == 0. */
template <int TOKENS>
__global__ __launch_bounds__(kThreads, HeadShape<TOKENS>::kBlocksPerSM) void head_wgmma(
    const int M, const int K, const int N, void *y, const bool y_is_bf16, const __grid_constant__ CUtensorMap w_map,
    const __grid_constant__ CUtensorMap x_map) {
    using S = HeadShape<TOKENS>;
    constexpr int kStages = S::kStages, kStageBytes = S::kStageBytes;
    extern __shared__ int4 shared[];
    const uint32_t smem_base = (static_cast<uint32_t>(__cvta_generic_to_shared(shared)) + 1023) & ~1023u;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, t = lane % 4, warpgroup = warp / 4;
    const int token_tiles = (N + TOKENS - 1) / TOKENS;
    const int first = static_cast<int>(blockIdx.x % token_tiles) * TOKENS;
    const int token0 = min(first, max(N - TOKENS, 0));
    const int row0 = static_cast<int>(blockIdx.x / token_tiles) * kRows;
    const int k_tiles = K / kTileK;

    /* landed[s]: the stage's tile has arrived (tile kt in phase kt / kStages). */
    __shared__ alignas(8) uint64_t landed[kStages];
    const uint32_t landed0 = static_cast<uint32_t>(__cvta_generic_to_shared(landed));
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < kStages; s++) BN_SM90A_ASM("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(landed0 + 8 * s));
        BN_SM90A_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    /* Stage s: the weights (128 rows x 128 bytes), then x (the box's rows x 128 bytes). */
    const uint32_t stage_bytes = S::kWBytes + min(N, TOKENS) * 128;
    auto request_weights = [&](int s, int kt) {
        const uint32_t bar = landed0 + 8 * s;
        arrive_expect_bytes(bar, stage_bytes);
        tma_load(smem_base + s * kStageBytes, w_map, kt * 128, row0, bar);
    };
    auto request_x = [&](int s, int kt) {
        tma_load(smem_base + s * kStageBytes + S::kWBytes, x_map, kt * 128, token0, landed0 + 8 * s);
    };
    if (tid == 0) {
        prefetch_tensor_map(w_map);
        prefetch_tensor_map(x_map);
#pragma unroll
        for (int s = 0; s < kStages - 1; s++)
            if (s < k_tiles) request_weights(s, s);
    }
    bn_pdl_wait();
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < kStages - 1; s++)
            if (s < k_tiles) request_x(s, s);
    }

    float acc[TOKENS / 2] = {};
    for (int kt = 0; kt < k_tiles; kt++) {
        const int s = kt % kStages;
        wait_phase(landed0 + 8 * s, (kt / kStages) & 1);
        const uint32_t w_tile = smem_base + s * kStageBytes + warpgroup * 64 * 128;
        const uint32_t x_tile = smem_base + s * kStageBytes + S::kWBytes;
        wgmma_fence();
#pragma unroll
        for (int step = 0; step < 4; step++) wgmma_bf16(acc, k_major(w_tile + 32 * step), k_major(x_tile + 32 * step));
        wgmma_commit();
        wgmma_wait<1>(); /* tile kt - 1's wgmmas are done in this warpgroup */
        __syncthreads(); /* ... and in the other: its stage takes tile kt + kStages - 1 */
        if (tid == 0 && kt + kStages - 1 < k_tiles) {
            request_weights((kt + kStages - 1) % kStages, kt + kStages - 1);
            request_x((kt + kStages - 1) % kStages, kt + kStages - 1);
        }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < TOKENS / 2; i++) asm volatile("" : "+f"(acc[i])::"memory");
    bn_pdl_launch_dependents();

    /* acc[4 j + 2 half + e]: row 16 (warp % 4) + g + 8 half of the warpgroup's 64, token 8 j + 2 t + e. */
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int m = row0 + warpgroup * 64 + (warp % 4) * 16 + g + 8 * half;
        if (m >= M) continue;
#pragma unroll
        for (int j = 0; j < TOKENS / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int n = token0 + 8 * j + 2 * t + e;
                if (n < first || n >= N) continue;
                const float v = acc[4 * j + 2 * half + e];
                const int64_t index = static_cast<int64_t>(n) * M + m;
                if (y_is_bf16) static_cast<__nv_bfloat16 *>(y)[index] = __float2bfloat16_rn(v);
                else static_cast<float *>(y)[index] = v;
            }
    }
}

template <int TOKENS>
bitnet_status launch(int32_t device, const __nv_bfloat16 *w, int64_t M, int64_t K, const __nv_bfloat16 *x, int64_t N,
                     void *y, bool y_is_bf16, cudaStream_t stream) {
    using S = HeadShape<TOKENS>;
    auto kernel = head_wgmma<TOKENS>;
    BN_TRY(bn_cuda_kernel_shared_memory(device, reinterpret_cast<const void *>(kernel), S::kSharedBytes));
    CUtensorMap w_map, x_map;
    BN_TRY(bn_tensor_map("bitnet_gemv_bf16", &w_map, w, M, 2 * K, kRows, 128, CU_TENSOR_MAP_SWIZZLE_128B));
    BN_TRY(bn_tensor_map("bitnet_gemv_bf16", &x_map, x, N, 2 * K, static_cast<uint32_t>(std::min<int64_t>(N, TOKENS)),
                         128, CU_TENSOR_MAP_SWIZZLE_128B));
    const dim3 grid(static_cast<unsigned>(bn_ceil_div(M, kRows) * bn_ceil_div(N, TOKENS)));
    BN_CUDA_TRY(bn_launch_pdl(kernel, grid, dim3(kThreads), S::kSharedBytes, stream, static_cast<int>(M),
                              static_cast<int>(K), static_cast<int>(N), y, y_is_bf16, w_map, x_map));
    return BITNET_OK;
}

}  // namespace

bitnet_status bn_cuda_gemv_bf16_sm90(int32_t device, const __nv_bfloat16 *w, int64_t M, int64_t K,
                                     const __nv_bfloat16 *x, int64_t N, void *y, bool y_is_bf16, cudaStream_t stream) {
    return N <= 64 ? launch<64>(device, w, M, K, x, N, y, y_is_bf16, stream)
                   : launch<128>(device, w, M, K, x, N, y, y_is_bf16, stream);
}
