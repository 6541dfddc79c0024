/* Prefill attention on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a; built for that target
 * alone, see the Makefile), D = 128: out = softmax(q.k^T * scale + causal mask) v, with the schedule,
 * the online softmax and the hidden-key rule of attention_prefill.cu, the products on wgmma.
 * - Grid (query head, query tile of 128 rows, sequence), heaviest causal tiles first. A block is two
 *   warpgroups of 64 query rows, warpgroup 1 half a tile behind warpgroup 0 (see the key loop), so
 *   that one's softmax runs while the other's wgmmas do; one block per SM (the S and O accumulators
 *   take 128 registers a thread).
 * - cp.async copies Q once and 128-key tiles of K (two stages) and V (three) into shared memory in the
 *   128-byte swizzle that wgmma reads: a tile is 2 column blocks of 64 dims, each [rows][128 bytes],
 *   chunk c of row r at c ^ (r % 8).
 * - S = Q K^T: m64n128k16, Q and K from shared memory, both K-major. O += P V: P from registers (the S
 *   accumulators of keys 16kk..16kk+15, rounded to pairs, are the A fragments of step kk as they
 *   stand), V from shared memory read MN-major (dims along N).
 * - A lane holds accumulator rows g and g + 8 of its warp's 16 (g = lane / 4) and columns 8j + 2t,
 *   8j + 2t + 1 (t = lane % 4), the layout of mma.sync m16n8: the softmax helpers are the other
 *   kernel's.
 * Launched by bn_cuda_attention_prefill (attention_prefill.cu) on compute capability 9.0. */
#include <type_traits>

#include "attention_common.cuh"
#include "wgmma.cuh"

namespace {

constexpr int kD = 128;
constexpr int kWarpgroups = 2, kThreads = 128 * kWarpgroups;
/* K tiles in 2 stages, V tiles in 3: warpgroup 1 multiplies by tile j - 1's V while tile j + 1 loads. */
constexpr int kBlockM = 64 * kWarpgroups, kBlockN = 128, kKStages = 2, kVStages = 3;
constexpr int kQBytes = kBlockM * kD * 2, kTileBytes = kBlockN * kD * 2;
constexpr size_t kSharedBytes = kQBytes + (kKStages + kVStages) * kTileBytes + 1024; /* + alignment */
constexpr int kChunks = kD / 8, kRowsPerPass = kThreads / kChunks;
static_assert(kRowsPerPass % 8 == 0, "a thread's rows share a swizzle");

/* Byte offset of 16-byte chunk c (dims 8c..8c+7) of row r in a tile of `rows` rows. */
__device__ __forceinline__ int tile_offset(int rows, int r, int c) {
    return (c / 8) * rows * 128 + r * 128 + (((c % 8) ^ (r % 8)) << 4);
}

/* Rows [row0, row0 + ROWS) of a [*, stride]-strided matrix into `tile`, rows >= rows_end zero-filled.
 * Thread i copies chunks i, i + kThreads, ... of the tile (copied_v_nonfinite reads them back). */
template <typename T, int ROWS>
__device__ __forceinline__ void load_tile(uint8_t *tile, const T *src, int64_t stride, int row0, int rows_end) {
    const int first = threadIdx.x / kChunks, chunk = threadIdx.x % kChunks;
#pragma unroll
    for (int pass = 0; pass < ROWS / kRowsPerPass; pass++) {
        const int row = first + pass * kRowsPerPass;
        const bool inside = row0 + row < rows_end;
        cp_async_16(tile + tile_offset(ROWS, row, chunk),
                    src + (inside ? (int64_t)(row0 + row) * stride + chunk * 8 : 0), inside);
    }
}

/* Whether the chunks of a V tile that this thread copied hold an inf or NaN (see attend_row). */
template <typename T>
__device__ __forceinline__ bool copied_v_nonfinite(const uint8_t *tile) {
    const int first = threadIdx.x / kChunks, chunk = threadIdx.x % kChunks;
    bool found = false;
#pragma unroll
    for (int pass = 0; pass < kBlockN / kRowsPerPass; pass++) {
        const uint4 c = *reinterpret_cast<const uint4 *>(tile + tile_offset(kBlockN, first + pass * kRowsPerPass, chunk));
        found |= pair_nonfinite(c.x, T()) || pair_nonfinite(c.y, T()) || pair_nonfinite(c.z, T()) ||
                 pair_nonfinite(c.w, T());
    }
    return found;
}

/* Descriptor of a K-major tile (Q or K) of `rows` rows from `address`, at k16 step kc (dims 16kc..). */
__device__ __forceinline__ uint64_t k_major(uint32_t address, int rows, int kc) {
    return swizzle128_descriptor(address + (kc / 4) * rows * 128 + (kc % 4) * 32, 16, 1024);
}

/* S (64 rows x 128 keys) = or += A (64 x 16 dims) B (16 dims x 128 keys), both from shared memory. */
template <typename T>
__device__ __forceinline__ void wgmma_qk(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
#define BN_WGMMA_QK(types)                                                                                      \
    BN_SM90A_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                   \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32" types " " BN_WGMMA_D64_REGS ", %64, %65, p, 1, 1, " \
                 "0, 0;\n}\n"                                                                                   \
                 : BN_WGMMA_D64("+f", d)                                                                        \
                 : "l"(a), "l"(b), "r"(accumulate))
    if constexpr (std::is_same_v<T, __nv_bfloat16>) BN_WGMMA_QK(".bf16.bf16");
    else BN_WGMMA_QK(".f16.f16");
#undef BN_WGMMA_QK
}

/* O (64 rows x 128 dims) += P (64 x 16 keys, registers) V (16 keys x 128 dims, shared memory,
 * MN-major: column blocks `leading` bytes apart). */
template <typename T>
__device__ __forceinline__ void wgmma_pv(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
#define BN_WGMMA_PV(types)                                                                                      \
    BN_SM90A_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                   \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32" types " " BN_WGMMA_D64_REGS ", "                 \
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                                  \
                 : BN_WGMMA_D64("+f", d)                                                                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
    if constexpr (std::is_same_v<T, __nv_bfloat16>) BN_WGMMA_PV(".bf16.bf16");
    else BN_WGMMA_PV(".f16.f16");
#undef BN_WGMMA_PV
}

/* Keeps the compiler from moving reads of the accumulators above the wgmma wait that produced them. */
__device__ __forceinline__ void after_wait(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(d[i])::"memory");
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
prefill_wgmma_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                     const int32_t *__restrict__ seq_lens, int C, int Sq, int Hq, int Hkv, int causal,
                     float scale_log2, T *__restrict__ out) {
    extern __shared__ int4 shared[];
    const uint32_t unaligned = (uint32_t)__cvta_generic_to_shared(shared);
    const uint32_t base = (unaligned + 1023) & ~1023u;
    uint8_t *const smem = reinterpret_cast<uint8_t *>(shared) + (base - unaligned);
    auto k_tile = [&](int tile) { return smem + kQBytes + tile % kKStages * kTileBytes; };
    auto v_tile = [&](int tile) { return smem + kQBytes + (kKStages + tile % kVStages) * kTileBytes; };

    const PrefillBlock<T, kD> blk(q, k, v, seq_lens, C, Sq, Hq, Hkv, causal, out, kBlockM);
    const int m0 = blk.m0, L = blk.L, offset = blk.offset, keys = blk.keys;
    const int64_t q_stride = blk.q_stride, kv_stride = blk.kv_stride;
    const T *q_base = blk.q_base, *k_base = blk.k_base, *v_base = blk.v_base;
    T *out_base = blk.out_base;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int warpgroup = warp / 4;
    if (!blk.valid) {
        fill_nan_rows<T, kD>(out_base, q_stride, m0, min(Sq, m0 + kBlockM));
        return;
    }
    const int key_tiles = (keys + kBlockN - 1) / kBlockN;

    load_tile<T, kBlockM>(smem, q_base + (int64_t)m0 * q_stride, q_stride, 0, Sq - m0);
    load_tile<T, kBlockN>(k_tile(0), k_base, kv_stride, 0, keys);
    load_tile<T, kBlockN>(v_tile(0), v_base, kv_stride, 0, keys);
    cp_async_commit();

    float o[16][4] = {};
    float(&o_flat)[64] = reinterpret_cast<float(&)[64]>(o);
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    const int warp_row0 = 64 * warpgroup + 16 * (warp % 4); /* within the block */
    const int row_lo = m0 + warp_row0 + g;                   /* this lane's rows: row_lo, row_lo + 8 */
    const uint32_t q_address = base + 64 * warpgroup * 128;  /* this warpgroup's 64 rows */
    bool hidden_nonfinite_v = false; /* an inf or NaN value at a hidden key: see attend_row */

    /* S of tile j, its softmax into o's running max and sum, and its probabilities into p. */
    uint32_t p[kBlockN / 16][4];
    auto scores = [&](int j, bool hides_keys) {
        const int key0 = j * kBlockN;
        float s[16][4];
        float(&s_flat)[64] = reinterpret_cast<float(&)[64]>(s);
        const uint32_t k_address = (uint32_t)__cvta_generic_to_shared(k_tile(j));
        wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < kD / 16; kc++)
            wgmma_qk<T>(s_flat, k_major(q_address, kBlockM, kc), k_major(k_address, kBlockN, kc), kc > 0);
        wgmma_commit();
        wgmma_wait<0>();
        after_wait(s_flat);

        /* Masking is needed only where the tile reaches past L or past the first row's diagonal. */
        const bool masked = key0 + kBlockN > L || hides_keys;
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = s[nt][e] * scale_log2;
                if (masked) {
                    const int key = key0 + nt * 8 + 2 * t + e % 2, row = row_lo + 8 * (e / 2);
                    if (key >= L || (causal && key > offset + row)) x = -INFINITY;
                }
                s[nt][e] = x;
                tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
            }
        }
        float rescale[2], base_max[2];
        online_softmax_step(tile_max, m_run, l_run, base_max, rescale);
#pragma unroll
        for (int dt = 0; dt < kD / 8; dt++) rescale_rows(o[dt], rescale);
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; nt++)
            softmax_probs<T>(s[nt], base_max, l_run, p[nt / 2][(nt % 2) * 2], p[nt / 2][(nt % 2) * 2 + 1]);
    };
    /* o += p V of tile j. */
    auto multiply_v = [&](int j) {
        const uint32_t v_address = (uint32_t)__cvta_generic_to_shared(v_tile(j));
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; kk++)
            wgmma_pv<T>(o_flat, p[kk], swizzle128_descriptor(v_address + kk * 16 * 128, kBlockN * 128, 1024));
        wgmma_commit();
        wgmma_wait<0>();
        after_wait(o_flat);
    };

    /* Between two barriers warpgroup 0 takes S, softmax, P V of tile j; warpgroup 1 takes P V of tile
     * j - 1, then S and softmax of tile j: while one does its softmax, the other's wgmmas run. */
    for (int j = 0; j < key_tiles; j++) {
        cp_async_wait<0>();
        fence_async_shared();
        const int key0 = j * kBlockN;
        /* Keys past the block's first row's diagonal are hidden from some of its rows. */
        const bool hides_keys = causal && key0 + kBlockN - 1 > offset + m0;
        if (hides_keys) hidden_nonfinite_v |= __syncthreads_or(copied_v_nonfinite<T>(v_tile(j)));
        else __syncthreads();
        /* Free: K of tile j - 1 and V of tile j - 2, whose wgmmas both warpgroups waited for. */
        if (j + 1 < key_tiles) {
            load_tile<T, kBlockN>(k_tile(j + 1), k_base, kv_stride, key0 + kBlockN, keys);
            load_tile<T, kBlockN>(v_tile(j + 1), v_base, kv_stride, key0 + kBlockN, keys);
        }
        cp_async_commit();
        if (warpgroup == 0) {
            scores(j, hides_keys);
            multiply_v(j);
        } else {
            if (j > 0) multiply_v(j - 1);
            scores(j, hides_keys);
        }
    }
    if (warpgroup == 1) multiply_v(key_tiles - 1);
    if (hidden_nonfinite_v) { /* see attend_row */
        redo_rows<T, kD>(q_base, k_base, v_base, q_stride, kv_stride, m0 + warp_row0,
                         min(Sq, m0 + warp_row0 + 16), keys, offset, scale_log2, out_base);
        return;
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = row_lo + 8 * half;
        if (row >= Sq) continue;
        const float inv_l = 1.0f / quad_sum(l_run[half]);
        T *dst = out_base + row * q_stride + 2 * t;
#pragma unroll
        for (int dt = 0; dt < kD / 8; dt++)
            *reinterpret_cast<uint32_t *>(dst + dt * 8) = pack2<T>(o[dt][2 * half] * inv_l, o[dt][2 * half + 1] * inv_l);
    }
}

template <typename T>
bitnet_status launch(int32_t device, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv, const void *q, const void *k,
                     const void *v, int64_t C, const int32_t *seq_lens, int32_t causal, float scale, void *out,
                     cudaStream_t stream) {
    auto kernel = prefill_wgmma_kernel<T>;
    BN_TRY(bn_cuda_kernel_shared_memory(device, reinterpret_cast<const void *>(kernel), kSharedBytes));
    dim3 grid((unsigned)Hq, bn_ceil_div(Sq, kBlockM), (unsigned)B);
    kernel<<<grid, kThreads, kSharedBytes, stream>>>(
        static_cast<const T *>(q), static_cast<const T *>(k), static_cast<const T *>(v), seq_lens, (int)C,
        (int)Sq, (int)Hq, (int)Hkv, causal, scale * 1.4426950408889634f, static_cast<T *>(out));
    BN_CUDA_CHECK_LAUNCH("prefill_wgmma_kernel");
    return BITNET_OK;
}

} // namespace

bitnet_status bn_cuda_attention_prefill_sm90(int32_t device, int32_t dtype, int64_t B, int64_t Sq, int64_t Hq,
                                             int64_t Hkv, const void *q, const void *k, const void *v, int64_t C,
                                             const int32_t *seq_lens, int32_t causal, float scale, void *out,
                                             cudaStream_t stream) {
    return dtype == BITNET_DTYPE_BF16
               ? launch<__nv_bfloat16>(device, B, Sq, Hq, Hkv, q, k, v, C, seq_lens, causal, scale, out, stream)
               : launch<__half>(device, B, Sq, Hq, Hkv, q, k, v, C, seq_lens, causal, scale, out, stream);
}
