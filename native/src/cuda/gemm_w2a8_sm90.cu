/* CUDA W2A8 GEMM on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a; built for that target
 * alone, see the Makefile): y[n, m] = dot(x_q[n], W_q[m]) * w_scales[m] / x_scales[n].
 * - A block owns TOKENS tokens (16, 32, 64, 96, 128 or 160) x ROWS weight rows (128 or 256); two warpgroups of
 *   ROWS / 2 rows each. K goes by tiles of 128: thread 0 has the tensor memory accelerator (TMA) copy
 *   the packed weights (ROWS x 32 bytes, the 32-byte swizzle) and x (min(TOKENS, N) x 128 bytes, the
 *   128-byte swizzle that wgmma reads) into shared-memory stages, each stage's arrival counted by an
 *   mbarrier; weight rows past M arrive as zeros. Where N < TOKENS the stage's rows from N on hold
 *   whatever was there: their dots are never stored.
 * - wgmma m64nTOKENSk32: A = the weights from registers, B = x from shared memory (descriptor). Lane (g,
 *   t) of warp w holds k = 4t..4t+3 (+16) of rows 16w + g (+8) of a 64-row tile: packed word 2s (2s + 1)
 *   of the row at shift t (docs/weight_format.md), turned into W_q = code - 1 as signed bytes by
 *   ((v & 0x03030303) + 0x7F7F7F7F) ^ 0x80808080 (no carry crosses a byte), so no sum(x) is needed.
 *   The weights go straight from their packed bytes to the A registers: no int8 weight tile exists.
 * - The wgmmas of tile kt + 1 are issued before those of tile kt are awaited: the tensor cores always
 *   have a tile queued while the warps expand the next one and copy the one after.
 * - Epilogue: float32(float32(dot) * w_scale) / x_scale (the GEMV's rule), or the int32 dot, put in
 *   shared memory as [token][row] and stored from there by 8 consecutive rows per thread.
 * Launched by bn_cuda_gemm_w2a8 (gemm_w2a8.cu) on compute capability 9.0 for large problems.
 * Measured numbers: docs/gemm.md. */
#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "gemm_w2a8.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

using namespace bn_gemm;

namespace {

constexpr int kThreads = 256;

/* Blocks are taken in groups of this many token tiles: the blocks that run at once share the x of
 * the group and the weights of one range of rows (for large N, x is not read again for every row tile). */
constexpr int kGroupTokenTiles = 8;

/* k-tile stages of the 16- and 32-token tiles. 16 tokens, H200, µs for 3 / 4 / 6 / 8 / 14 stages:
 * 5120 x 27648 23.1 / 22.7 / 23.1 / 24.0 / 30.6, 55296 x 5120 48.6 / 41.6 / 41.3 / 42.3 / 46.0
 * (docs/log/2026-12-03.md#2026-12-03-2). */
constexpr int kNarrowStages = 4;

/* ROWS = 64 MT x 2 weight rows per block, TOKENS tokens (16 to 160), STAGES k tiles in
 * shared memory (STAGES - 2 of them copied ahead of the one being expanded). 256 rows or 160 tokens:
 * one block per SM (the accumulators take 128 or 80 registers a thread); 128 rows x 64 to 128 tokens:
 * two blocks per SM (5 stages), so one block's epilogue overlaps another's loop. */
template <int MT, int STAGES, int TOKENS = 128>
struct Shape {
    static constexpr int kRows = 128 * MT, kTokens = TOKENS;
    static constexpr int kStages = STAGES;
    static constexpr int kBlocksPerSM = MT == 1 && TOKENS <= 128 ? 2 : 1;
    static constexpr int kXBytes = kTokens * kTileK, kWBytes = kRows * kTileKBytesW;
    static constexpr int kStageBytes = kXBytes + kWBytes; /* a multiple of 1024: x tiles stay 1024-aligned */
    /* The epilogue's tile, [token][row] words; rows padded by 4 words so that the 32 lanes of a store
     * (rows g, tokens 2t) fall in 32 banks. */
    static constexpr int kOutStride = kRows + 4;
    static constexpr size_t kSharedBytes = static_cast<size_t>(kStages) * kStageBytes + 1024; /* + alignment */
    static_assert(kStageBytes % 1024 == 0, "the 128-byte swizzle repeats every 1024 bytes");
    static_assert(TOKENS == 16 || TOKENS == 32 || TOKENS == 64 || TOKENS == 96 || TOKENS == 128 || TOKENS == 160,
                  "the wgmma shapes of wgmma_s8");
    static_assert(static_cast<size_t>(kTokens) * kOutStride * 4 <= kStages * kStageBytes, "the epilogue's tile");
};

/* wgmma_s8(d, a, b): d (64 rows x TOKENS tokens, int32; TOKENS / 2 registers a thread) += A (64 x 32
 * signed bytes, registers) B (32 x TOKENS signed bytes, shared memory, descriptor b), one overload
 * per shape. The operands: the accumulators %0 .. %(TOKENS / 2 - 1), then A_OPS (a), B_OP (b) and
 * P_OP (1: scale-d, so d is added to). */
#define WGMMA_S8(TOKENS, D_REGS, A_OPS, B_OP, P_OP, ...)                                                   \
    __device__ __forceinline__ void wgmma_s8(int (&d)[TOKENS / 2], const uint32_t (&a)[4], uint64_t b) { \
        BN_SM90A_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, " P_OP ", 0;\n"                                 \
                     "wgmma.mma_async.sync.aligned.m64n" #TOKENS "k32.s32.s8.s8 " D_REGS ", {" A_OPS "}, " \
                     B_OP ", p;\n}\n"                                                                    \
                     : __VA_ARGS__                                                                        \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));                      \
    }
WGMMA_S8(16, BN_WGMMA_D8_REGS, "%8, %9, %10, %11", "%12", "%13", BN_WGMMA_D8("+r", d, 0))
WGMMA_S8(32, BN_WGMMA_D16_REGS, "%16, %17, %18, %19", "%20", "%21", BN_WGMMA_D16("+r", d))
WGMMA_S8(64, BN_WGMMA_D32_REGS, "%32, %33, %34, %35", "%36", "%37", BN_WGMMA_D32("+r", d))
WGMMA_S8(96, BN_WGMMA_D48_REGS, "%48, %49, %50, %51", "%52", "%53", BN_WGMMA_D48("+r", d))
WGMMA_S8(128, BN_WGMMA_D64_REGS, "%64, %65, %66, %67", "%68", "%69", BN_WGMMA_D64("+r", d))
WGMMA_S8(160, BN_WGMMA_D80_REGS, "%80, %81, %82, %83", "%84", "%85", BN_WGMMA_D80("+r", d))
#undef WGMMA_S8

/* Descriptor of a K-major x tile of rows of 128 bytes, starting `address` (1024-aligned, plus 32 s for
 * k32 step s). */
__device__ __forceinline__ uint64_t x_descriptor(uint32_t address) { return swizzle128_descriptor(address, 16, 1024); }

/* Every thread of the cluster; its shared-memory writes before, visible to the cluster after. */
__device__ __forceinline__ void cluster_sync() {
    BN_SM90A_ASM("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
/* The cluster barrier in halves and without the release (a GPU-scope fence, which waits for this
 * thread's stores): for ordering execution alone. */
__device__ __forceinline__ void cluster_arrive_relaxed() { BN_SM90A_ASM("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { BN_SM90A_ASM("barrier.cluster.wait.aligned;\n" ::: "memory"); }

/* The shared::cluster address of shared-memory address `address` in block `rank` of the cluster. */
__device__ __forceinline__ uint32_t cluster_address(uint32_t address, int rank) {
    uint32_t mapped = 0;
    BN_SM90A_ASM("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(mapped) : "r"(address), "r"(rank));
    return mapped;
}

/* W_q of 4 consecutive weights as signed bytes: shift `shift` of a packed word. */
__device__ __forceinline__ uint32_t signed_codes(uint32_t word, int shift) {
    return (((word >> shift) & 0x03030303u) + 0x7F7F7F7Fu) ^ 0x80808080u;
}

/* y[n, m .. m + 7] from 8 words of the epilogue's tile (float32 values or int32 dots); `vector`: one
 * or two 16-byte stores (every m + 8 <= M), else one element at a time up to M. */
__device__ __forceinline__ void store8(const GemmArgs &a, int n, int m, const uint4 &lo, const uint4 &hi,
                                       bool vector) {
    const int64_t index = static_cast<int64_t>(n) * a.M + m;
    const uint32_t v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    if (a.y_dtype == BITNET_DTYPE_I32 || a.y_dtype == BITNET_DTYPE_F32) {
        uint32_t *y = static_cast<uint32_t *>(a.y) + index;
        if (vector) {
            reinterpret_cast<uint4 *>(y)[0] = lo;
            reinterpret_cast<uint4 *>(y)[1] = hi;
        } else {
            for (int i = 0; i < 8 && m + i < a.M; i++) y[i] = v[i];
        }
        return;
    }
    uint16_t h[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float f = __uint_as_float(v[i]);
        h[i] = a.y_dtype == BITNET_DTYPE_F16 ? __half_as_ushort(__float2half_rn(f))
                                             : __bfloat16_as_ushort(__float2bfloat16_rn(f));
    }
    uint16_t *y = static_cast<uint16_t *>(a.y) + index;
    if (vector) {
        *reinterpret_cast<uint4 *>(y) = make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16,
                                                   h[6] | h[7] << 16);
    } else {
        for (int i = 0; i < 8 && m + i < a.M; i++) y[i] = h[i];
    }
}

/* The tiles from `full_tiles` on are each split along K over `pieces` blocks (block full_tiles +
 * `pieces` i + p is piece p of tile full_tiles + i). Scratch: arrivals[i], zero before the launch,
 * counts the pieces of tile i that are done; partials[i][p] holds piece p's int32 dots. */
struct Remainder {
    int full_tiles, pieces;
    int *arrivals;
    int4 *partials;
};

/* A remainder tile's piece (this block, blockIdx.x >= full_tiles): stores its dots in its slot; the
 * piece that arrives last adds the others' into acc and returns true (it stores the tile), the others
 * return false. Slots are [int4 i][thread]: each thread reads back its own accumulators' positions,
 * and a warp's stores are contiguous. */
template <int MT>
__device__ bool gather_pieces(const Remainder &rem, int (&acc)[MT][64]) {
    constexpr int kVectors = MT * 16;
    const int slot = (static_cast<int>(blockIdx.x) - rem.full_tiles) / rem.pieces;
    const int piece = (static_cast<int>(blockIdx.x) - rem.full_tiles) % rem.pieces;
    int4 *tile = rem.partials + static_cast<int64_t>(slot) * rem.pieces * kVectors * kThreads + threadIdx.x;
    int4 *mine = tile + static_cast<int64_t>(piece) * kVectors * kThreads;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int v = 0; v < 16; v++)
            mine[(mt * 16 + v) * kThreads] = make_int4(acc[mt][4 * v], acc[mt][4 * v + 1], acc[mt][4 * v + 2],
                                                       acc[mt][4 * v + 3]);
    __threadfence();
    __syncthreads();
    int last = 0;
    if (threadIdx.x == 0) last = atomicAdd(&rem.arrivals[slot], 1) == rem.pieces - 1;
    if (!__syncthreads_or(last)) return false;
    __threadfence();
    for (int p = 0; p < rem.pieces; p++) {
        if (p == piece) continue;
        const int4 *other = tile + static_cast<int64_t>(p) * kVectors * kThreads;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int v = 0; v < 16; v++) {
                const int4 d = __ldcg(other + (mt * 16 + v) * kThreads);
                acc[mt][4 * v] += d.x;
                acc[mt][4 * v + 1] += d.y;
                acc[mt][4 * v + 2] += d.z;
                acc[mt][4 * v + 3] += d.w;
            }
    }
    return true;
}

/* `vector`: M % 8 == 0 and y 16-byte aligned (every 8-row store of a block is then aligned). A 1-D
 * grid of token tiles x row tiles (x SPLIT: the blocks of a cluster take equal shares of K, then each
 * adds up one SPLIT-th of the tile over the cluster's blocks; PIECES: the Remainder's tiles in
 * pieces), in groups of kGroupTokenTiles token tiles: tile b of a group is token tile
 * b % (tiles in the group) and row tile b / (tiles in the group). */
template <int MT, int STAGES, int SPLIT, bool PIECES, int TOKENS>
__global__ __launch_bounds__(kThreads, (Shape<MT, STAGES, TOKENS>::kBlocksPerSM)) void gemm_w2a8_wgmma(
    const GemmArgs a, const bool vector, const Remainder rem, const __grid_constant__ CUtensorMap x_map,
    const __grid_constant__ CUtensorMap w_map) {
    using S = Shape<MT, STAGES, TOKENS>;
    constexpr int kStages = S::kStages, kStageBytes = S::kStageBytes, kXBytes = S::kXBytes, kTokens = TOKENS;
    static_assert(TOKENS != 160 || SPLIT == 1, "160-token tiles are whole tiles");
    static_assert(!PIECES || TOKENS == 128, "remainder pieces are 128-token tiles");
    extern __shared__ int4 shared[];
    const uint32_t smem_base = (shared_address(shared) + 1023) & ~1023u;
    uint8_t *smem = reinterpret_cast<uint8_t *>(shared) + (smem_base - shared_address(shared));

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, t = lane % 4;
    const int warpgroup = warp / 4, warp_in_group = warp % 4;
    const int row_tiles = (a.M + S::kRows - 1) / S::kRows, token_tiles = (a.N + kTokens - 1) / kTokens;
    /* Its tile, and its share of K: split of `parts` (a cluster's SPLIT, or a remainder tile's pieces). */
    const bool piece = PIECES && static_cast<int>(blockIdx.x) >= rem.full_tiles;
    const int parts = piece ? rem.pieces : SPLIT;
    const int tile = piece ? rem.full_tiles + (static_cast<int>(blockIdx.x) - rem.full_tiles) / parts
                           : static_cast<int>(blockIdx.x) / SPLIT;
    const int split = piece ? (static_cast<int>(blockIdx.x) - rem.full_tiles) % parts
                            : static_cast<int>(blockIdx.x) % SPLIT;
    const int group = tile / (kGroupTokenTiles * row_tiles);
    const int in_group = tile - group * kGroupTokenTiles * row_tiles;
    const int group_tiles = min(kGroupTokenTiles, token_tiles - group * kGroupTokenTiles);
    /* The tile's tokens from `first`; its x box from token0, which for a last tile short of kTokens
     * is N - kTokens (where N >= kTokens), so that the box ends at token N: boxes past the tensor's
     * end took 3-5 us more (H200). The box's tokens before `first` are the previous tile's. Where
     * N < kTokens the box has N rows. */
    const int first = (group * kGroupTokenTiles + in_group % group_tiles) * kTokens;
    const int token0 = min(first, max(a.N - kTokens, 0));
    const int row0 = in_group / group_tiles * S::kRows;
    const int kt0 = static_cast<int>(static_cast<int64_t>(a.K / kTileK) * split / parts);
    const int k_tiles = static_cast<int>(static_cast<int64_t>(a.K / kTileK) * (split + 1) / parts) - kt0;

    /* landed[s]: the stage's tile has arrived (one phase per tile: tile kt in phase kt / kStages). */
    __shared__ alignas(8) uint64_t landed[kStages], summed;
    const uint32_t landed0 = shared_address(landed);
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < kStages; s++) BN_SM90A_ASM("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(landed0 + 8 * s));
        BN_SM90A_ASM("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(shared_address(&summed)));
        BN_SM90A_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    /* Thread 0 requests a stage: the weights (kRows x 32 bytes, the 32-byte swizzle: w_tile_offset),
     * with the whole stage's bytes expected, then x (the box's rows x 128 bytes, the 128-byte
     * swizzle); weight rows past M arrive as zeros. */
    const uint32_t stage_bytes = min(a.N, kTokens) * kTileK + S::kWBytes;
    auto request_weights = [&](int s, int kt) {
        const uint32_t bar = landed0 + 8 * s;
        arrive_expect_bytes(bar, stage_bytes);
        tma_load(smem_base + s * kStageBytes + kXBytes, w_map, (kt0 + kt) * kTileKBytesW, row0, bar);
    };
    auto request_x = [&](int s, int kt) {
        tma_load(smem_base + s * kStageBytes, x_map, (kt0 + kt) * kTileK, token0, landed0 + 8 * s);
    };
    /* The weights and their scales never depend on the previous kernel: the first stages' weights
     * and the block's row scales are requested before the PDL wait, the token scales right after it;
     * the scales are awaited only in the epilogue (thread i holds row i's and token i's). */
    const bool scaled_out = a.y_dtype != BITNET_DTYPE_I32;
    if (tid == 0) {
        prefetch_tensor_map(w_map);
        prefetch_tensor_map(x_map);
#pragma unroll
        for (int s = 0; s < kStages - 1; s++)
            if (s < k_tiles) request_weights(s, s);
    }
    const float row_scale = scaled_out && tid < S::kRows && row0 + tid < a.M ? a.w_scales[row0 + tid] : 0.0f;
    bn_pdl_wait();
    const float token_scale = scaled_out && tid < kTokens && token0 + tid < a.N ? a.x_scales[token0 + tid] : 1.0f;
    auto wait_tile = [&](int kt) { wait_phase(landed0 + 8 * (kt % kStages), (kt / kStages) & 1); };

    /* This lane's weight rows: tile mt (64 rows) of its warpgroup, rows r and r + 8. */
    const int a_row = warpgroup * 64 * MT + warp_in_group * 16 + g;
    const int a_swizzle = (g >> 2) & 1; /* w_tile_offset's, the same for r + 8 and every tile */
    const int shift = 2 * t;

    /* af[mt][s]: the A fragment of k32 step s of row tile mt, from the stage of tile kt. */
    auto expand = [&](uint32_t (&af)[MT][4][4], int kt) {
        const uint8_t *w_tile = smem + (kt % kStages) * kStageBytes + kXBytes;
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int r = a_row + 64 * mt + 8 * half;
                const uint4 lo = *reinterpret_cast<const uint4 *>(w_tile + r * 32 + ((0 ^ a_swizzle) << 4));
                const uint4 hi = *reinterpret_cast<const uint4 *>(w_tile + r * 32 + ((1 ^ a_swizzle) << 4));
                const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
                for (int s = 0; s < 4; s++) {
                    af[mt][s][half] = signed_codes(words[2 * s], shift);
                    af[mt][s][2 + half] = signed_codes(words[2 * s + 1], shift);
                }
            }
        }
    };

    int acc[MT][TOKENS / 2] = {};
    uint32_t af[2][MT][4][4]; /* [kt % 2]: tile kt + 1's fragments are made while the tensor cores run
                                 tile kt's (compile-time index: the loop goes by two tiles) */
    /* Stage s holds tiles s + kStages j; the stage of tile -1 (kStages - 1) starts empty. */
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < kStages - 1; s++)
            if (s < k_tiles) request_x(s, s);
    }
    wait_tile(0);
    expand(af[0], 0);
    /* Tile kt: its wgmmas are issued (one commit group) while tile kt - 1's may still run; once those
     * are done in this warpgroup (wait_group 1), af[(kt - 1) % 2] is free; tile kt + 1's mbarrier
     * says it has landed; the block barrier that follows means every warpgroup is done with tile
     * kt - 1, whose stage then takes tile kt + kStages - 1. */
    auto run_tile = [&](auto cur, int kt) {
        constexpr int c = decltype(cur)::value;
        const uint32_t x_tile = smem_base + (kt % kStages) * kStageBytes;
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < 4; s++) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++) wgmma_s8(acc[mt], af[c][mt][s], x_descriptor(x_tile + 32 * s));
        }
        wgmma_commit();
        wgmma_wait<1>();
        if (kt + 1 < k_tiles) {
            wait_tile(kt + 1);
            __syncthreads();
            if (tid == 0 && kt + kStages - 1 < k_tiles) {
                request_weights((kt + kStages - 1) % kStages, kt + kStages - 1);
                request_x((kt + kStages - 1) % kStages, kt + kStages - 1);
            }
            expand(af[c ^ 1], kt + 1);
        }
    };
    for (int kt = 0; kt < k_tiles; kt += 2) {
        run_tile(std::integral_constant<int, 0>(), kt);
        if (kt + 1 < k_tiles) run_tile(std::integral_constant<int, 1>(), kt + 1);
    }
    wgmma_wait<0>();
    bn_pdl_launch_dependents();
    if constexpr (PIECES)
        if (static_cast<int>(blockIdx.x) >= rem.full_tiles && !gather_pieces<MT>(rem, acc)) return;

    /* acc[mt][4 j + 2 half + e]: row a_row + 64 mt + 8 half, token 8 j + 2 t + e. The scales of the
     * block's rows and tokens: 0 past M, 1 past N. */
    __shared__ float row_scales[S::kRows], token_scales[kTokens];
    if (tid < S::kRows) row_scales[tid] = row_scale;
    if (tid < kTokens) token_scales[tid] = token_scale;
    __syncthreads(); /* every warpgroup is done with the stages: they take the epilogue's tile */
    /* The tile holds the outputs, or with SPLIT > 1 this block's int32 dots, which the cluster adds
     * up below before scaling them. */
    const bool scale_here = SPLIT == 1 && scaled_out;
    uint32_t *out = reinterpret_cast<uint32_t *>(smem);
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int half = 0; half < 2; half++)
#pragma unroll
            for (int j = 0; j < TOKENS / 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int dot = acc[mt][4 * j + 2 * half + e];
                    out[(8 * j + 2 * t + e) * S::kOutStride + a_row + 64 * mt + 8 * half] =
                        scale_here ? __float_as_uint(scaled(dot, row_scales[a_row + 64 * mt + 8 * half],
                                                            token_scales[8 * j + 2 * t + e]))
                                   : static_cast<uint32_t>(dot);
                }
    /* With SPLIT > 1, block `split` of the cluster stores tokens split * kShareTokens .. + kShareTokens
     * - 1 of the tile: the others add their dots of those tokens into its tile by bulk reductions
     * (counted by its mbarrier `summed`), then it scales and stores them. */
    constexpr int kChunks = S::kRows / 8, kShareTokens = kTokens / SPLIT;
    constexpr uint32_t kShareBytes = kShareTokens * S::kOutStride * 4;
    static_assert(kTokens % SPLIT == 0 && kShareBytes % 16 == 0, "shares of whole tokens, 16-byte aligned");
    if constexpr (SPLIT > 1) {
        fence_async_shared(); /* the tile's writes, before the bulk reductions read it and add to it */
        const uint32_t out_address = shared_address(out), summed_address = shared_address(&summed);
        if (tid == 0) arrive_expect_bytes(summed_address, (SPLIT - 1) * kShareBytes);
        cluster_sync();
        if (tid == 0) {
#pragma unroll 1
            for (int rank = 0; rank < SPLIT; rank++) {
                if (rank == split) continue;
                const uint32_t share = out_address + rank * kShareBytes;
                BN_SM90A_ASM("cp.reduce.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes.add.u32 "
                             "[%0], [%1], %2, [%3];\n" ::"r"(cluster_address(share, rank)), "r"(share),
                             "r"(kShareBytes), "r"(cluster_address(summed_address, rank)) : "memory");
            }
        }
        wait_phase(summed_address, 0);
        /* This block's share has every reduction into it, so the others' tiles are done with their
         * reductions into it; once all have arrived, every tile has been read (below). */
        cluster_arrive_relaxed();
    } else {
        __syncthreads();
    }
    /* Thread tid stores rows 8 (c % (kRows / 8)) .. + 7 of token c / (kRows / 8), c = c_begin + tid +
     * kThreads i. */
    const int c_begin = SPLIT > 1 ? split * kShareTokens * kChunks : 0;
#pragma unroll 4
    for (int c = c_begin + tid; c < c_begin + kShareTokens * kChunks; c += kThreads) {
        const int n_local = c / kChunks, m_local = 8 * (c % kChunks);
        const int n = token0 + n_local, m = row0 + m_local;
        if (n < first || n >= a.N || m >= a.M) continue;
        const uint4 *src = reinterpret_cast<const uint4 *>(out + n_local * S::kOutStride + m_local);
        uint32_t v[8] = {src[0].x, src[0].y, src[0].z, src[0].w, src[1].x, src[1].y, src[1].z, src[1].w};
        if (SPLIT > 1 && scaled_out) {
#pragma unroll
            for (int i = 0; i < 8; i++)
                v[i] = __float_as_uint(scaled(static_cast<int>(v[i]), row_scales[m_local + i], token_scales[n_local]));
        }
        store8(a, n, m, make_uint4(v[0], v[1], v[2], v[3]), make_uint4(v[4], v[5], v[6], v[7]), vector && m + 8 <= a.M);
    }
    if constexpr (SPLIT > 1) cluster_wait(); /* every block's tile stays until the others' reductions have read it */
}

template <int MT, int STAGES, int SPLIT, bool PIECES = false, int TOKENS = 128>
bitnet_status launch(int32_t device, const GemmArgs &a, cudaStream_t stream,
                     Remainder rem = {INT32_MAX, 1, nullptr, nullptr}) {
    static_assert(!PIECES || SPLIT == 1, "a remainder tile's pieces are not in clusters");
    using S = Shape<MT, STAGES, TOKENS>;
    auto kernel = gemm_w2a8_wgmma<MT, STAGES, SPLIT, PIECES, TOKENS>;
    BN_TRY(bn_cuda_kernel_shared_memory(device, reinterpret_cast<const void *>(kernel), S::kSharedBytes));
    const bool vector = a.M % 8 == 0 && reinterpret_cast<uintptr_t>(a.y) % 16 == 0;
    /* <= INT32_MAX: the caller's */
    const int64_t tiles = bn_ceil_div(a.N, TOKENS) * bn_ceil_div(a.M, S::kRows);
    const dim3 grid(rem.full_tiles < tiles ? rem.full_tiles + (tiles - rem.full_tiles) * rem.pieces
                                           : tiles * SPLIT);
    CUtensorMap x_map, w_map;
    BN_TRY(bn_tensor_map("bitnet_gemv_w2a8", &x_map, a.x, a.N, a.K, std::min(a.N, TOKENS), kTileK, CU_TENSOR_MAP_SWIZZLE_128B));
    BN_TRY(bn_tensor_map("bitnet_gemv_w2a8", &w_map, a.w, a.M, a.K / 4, S::kRows, kTileKBytesW, CU_TENSOR_MAP_SWIZZLE_32B));
    BN_CUDA_TRY(bn_launch_pdl_cluster(kernel, grid, dim3(kThreads), S::kSharedBytes, SPLIT, stream, a, vector,
                                      rem, x_map, w_map));
    return BITNET_OK;
}

/* 128-row blocks, 5 stages, the tiles from full_tiles on in `pieces` pieces each (Remainder). */
bitnet_status launch_remainder(int32_t device, const GemmArgs &a, int64_t full_tiles, int pieces,
                               cudaStream_t stream) {
    const int64_t split_tiles = bn_ceil_div(a.N, 128) * bn_ceil_div(a.M, 128) - full_tiles;
    const int64_t partial_bytes = split_tiles * pieces * kThreads * 64 * sizeof(int);
    void *scratch = nullptr;
    BN_TRY(bn_cuda_scratch_alloc(device, partial_bytes + split_tiles * sizeof(int), stream, &scratch));
    Remainder rem = {static_cast<int>(full_tiles), pieces,
                     reinterpret_cast<int *>(static_cast<char *>(scratch) + partial_bytes),
                     static_cast<int4 *>(scratch)};
    cudaError_t err = cudaMemsetAsync(rem.arrivals, 0, split_tiles * sizeof(int), stream);
    bitnet_status status = err == cudaSuccess ? launch<1, 5, 1, true>(device, a, stream, rem) : BITNET_OK;
    const cudaError_t free_err = cudaFreeAsync(scratch, stream);
    BN_CUDA_TRY(err);
    BN_TRY(status);
    BN_CUDA_TRY(free_err);
    return BITNET_OK;
}

template <int STAGES, int TOKENS>
bitnet_status launch_split(int32_t device, const GemmArgs &a, int split, cudaStream_t stream) {
    switch (split) {
        case 1: return launch<1, STAGES, 1, false, TOKENS>(device, a, stream);
        case 2: return launch<1, STAGES, 2, false, TOKENS>(device, a, stream);
        case 4: return launch<1, STAGES, 4, false, TOKENS>(device, a, stream);
        default: return launch<1, STAGES, 8, false, TOKENS>(device, a, stream);
    }
}

}  // namespace

bitnet_status bn_gemm::gemm_w2a8_sm90(int32_t device, const GemmArgs &a, int rows, int tokens, bool one_per_sm,
                                      int split, int64_t full_tiles, int pieces, cudaStream_t stream) {
    if (tokens == 16) return launch_split<kNarrowStages, 16>(device, a, split, stream);
    if (tokens == 32) return launch_split<kNarrowStages, 32>(device, a, split, stream);
    if (tokens == 160) return launch<1, 8, 1, false, 160>(device, a, stream);
    if (rows == 256) return launch<2, 8, 1>(device, a, stream);
    if (pieces > 1) return launch_remainder(device, a, full_tiles, pieces, stream);
    if (tokens == 64)
        return one_per_sm ? launch_split<10, 64>(device, a, split, stream) : launch_split<5, 64>(device, a, split, stream);
    if (tokens == 96)
        return one_per_sm ? launch_split<10, 96>(device, a, split, stream) : launch_split<5, 96>(device, a, split, stream);
    return one_per_sm ? launch_split<10, 128>(device, a, split, stream) : launch_split<5, 128>(device, a, split, stream);
}
