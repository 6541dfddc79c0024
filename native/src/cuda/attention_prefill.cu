/* Prefill attention on tensor cores (FlashAttention-2 style): out = softmax(q.k^T * scale + causal
 * mask) v, scores never leave registers. Layout q/out [B, Sq, Hq, D], k/v [B, C, Hkv, D] (bf16/f16,
 * D = 64, 128 or 256). Grid (query head, query tile of 128 rows, sequence), heaviest causal tiles first;
 * 4 warps, each owns 32 query rows (two m16 tiles, so each K/V fragment from shared memory feeds
 * two mma): S = Q K^T and O += P V with mma.sync m16n8k16 (f32 accumulate) over 64-key tiles
 * double-buffered in shared memory (cp.async, XOR-swizzled for ldmatrix), 2 blocks per SM; online
 * softmax in f32, P rounded to the input dtype for the P V product. Grids of 128-row tiles that
 * would fill fewer than 2 blocks per SM (short prompts) take 64-row tiles, 16 rows per warp.
 * Diagonal tiles are scanned for inf and NaN values at hidden keys (see attend_row).
 * FLOPs (causal): 2 L^2 D H.
 * H100, bf16, 20/5 heads, d = 128 (BENCHMARKS.md, 2026-11-26): 161 TFLOP/s at L = 1024 (64-row
 * tiles), 307 at 4096, 353 at 16384. On compute capability 9.0, D = 128 grids of 128-row blocks that
 * number at least 90% of the SMs take the wgmma kernel instead (attention_prefill_sm90.cu). */
#include <type_traits>

#include "attention_common.cuh"

/* On compute capability 9.0, D = 128 takes the wgmma kernel (attention_prefill_sm90.cu) where its
 * 128-row blocks number at least this percentage of the SMs (built with
 * -DBN_PREFILL_WGMMA_MIN_SM_PERCENT=n to time others). H200, 20/5 heads: from 120 blocks (768 tokens,
 * 91% of the SMs) it was faster than the mma.sync kernel, 22.5 against 24.5 us, and at 960 tokens
 * 26.5 against 31.4; at 80 blocks (512 tokens) slower, 17.3 against 16.7 (log 2026-12-02-3). */
#ifndef BN_PREFILL_WGMMA_MIN_SM_PERCENT
#define BN_PREFILL_WGMMA_MIN_SM_PERCENT 90
#endif

namespace {

/* 4 warps of ROW_TILES m16 tiles of query rows each: with 2 (128-row blocks), every K and V
 * fragment read from shared memory feeds two mma. 64-key tiles double-buffered: 96 KB (80 KB with
 * 64-row blocks) of shared memory at D = 128 and 2 blocks per SM. D = 256 takes 64-row blocks
 * (ROW_TILES 2 would hold 256 accumulators per thread) and 32-key tiles: 96 KB, 2 blocks per SM. */
constexpr int kWarps = 4;
template <int D> constexpr int kBlockN = D > 128 ? 32 : 64;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 2; /* K/V tiles in flight: one loads while one is used */
template <int ROW_TILES> constexpr int kBlockM = kWarps * 16 * ROW_TILES;

template <int D, int ROW_TILES>
struct PrefillShared {
    uint4 q[kBlockM<ROW_TILES>][D / 8];
    uint4 k[kStages][kBlockN<D>][D / 8];
    uint4 v[kStages][kBlockN<D>][D / 8];
};

/* Rows [row0, row0 + ROWS) of a [*, stride]-strided matrix into shared memory, rows >= `rows_end`
 * zero-filled. Thread i copies chunks i, i + kThreads, ... of the tile. As kThreads is a multiple
 * of the chunks per row, that is one chunk column: every (kThreads / chunks)-th row from row
 * i / chunks, all with the same swizzle, so the offset is computed once and stepped by a constant
 * (faster than computing row and chunk per copy: docs/log/2026-11-24.md#2026-11-24-2). */
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_rows(uint4 (*dst)[D / 8], const T *src, int64_t stride,
                                          int row0, int rows_end) {
    constexpr int kChunks = D / 8, kRowsPerPass = kThreads / kChunks;
    static_assert(kThreads % kChunks == 0 && ROWS % kRowsPerPass == 0, "whole passes over whole rows");
    /* Below D = 256 a pass covers whole swizzle periods (8 rows): a thread's rows share a swizzle. */
    constexpr bool kOneSwizzle = kRowsPerPass % 8 == 0;
    const int first = threadIdx.x / kChunks, chunk = threadIdx.x % kChunks;
    const int column = swizzle(first, chunk);
    const int64_t offset = (int64_t)(row0 + first) * stride + chunk * 8;
#pragma unroll
    for (int pass = 0; pass < ROWS / kRowsPerPass; pass++) {
        const int row = first + pass * kRowsPerPass;
        const bool inside = row0 + row < rows_end;
        cp_async_16(&dst[row][kOneSwizzle ? column : swizzle(row, chunk)],
                    src + (inside ? offset + (int64_t)pass * kRowsPerPass * stride : 0), inside);
    }
}

/* Fragment coordinates (PTX m16n8k16): lane = 4 * g + t holds accumulator rows g and g + 8, columns
 * 2t and 2t + 1 of each 8-wide n tile. Warp w owns query rows 16 (ROW_TILES w + mi) + (g, g + 8),
 * mi < ROW_TILES. */
template <typename T, int D, int ROW_TILES>
__global__ void __launch_bounds__(kThreads, 2)
prefill_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
               const int32_t *__restrict__ seq_lens, int C, int Sq, int Hq, int Hkv, int causal,
               float scale_log2, T *__restrict__ out) {
    constexpr int kDimTiles = D / 8, kKeyTiles = kBlockN<D> / 8, kRowTiles = ROW_TILES;
    constexpr int kBlockM = ::kBlockM<ROW_TILES>;
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    auto &sm = *reinterpret_cast<PrefillShared<D, ROW_TILES> *>(smem_bytes);
    const PrefillBlock<T, D> blk(q, k, v, seq_lens, C, Sq, Hq, Hkv, causal, out, kBlockM);
    const int m0 = blk.m0, L = blk.L, offset = blk.offset, keys = blk.keys;
    const int64_t q_stride = blk.q_stride, kv_stride = blk.kv_stride;
    const T *q_base = blk.q_base, *k_base = blk.k_base, *v_base = blk.v_base;
    T *out_base = blk.out_base;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    if (!blk.valid) {
        fill_nan_rows<T, D>(out_base, q_stride, m0, min(Sq, m0 + kBlockM));
        return;
    }
    const int key_tiles = (keys + kBlockN<D> - 1) / kBlockN<D>;
    load_rows<T, D, kBlockM>(sm.q, q_base + (int64_t)m0 * q_stride, q_stride, 0, Sq - m0);
    for (int j = 0; j < kStages - 1; j++) { /* group j holds tile j (group 0 also q) */
        if (j < key_tiles) {
            load_rows<T, D, kBlockN<D>>(sm.k[j], k_base, kv_stride, j * kBlockN<D>, keys);
            load_rows<T, D, kBlockN<D>>(sm.v[j], v_base, kv_stride, j * kBlockN<D>, keys);
        }
        cp_async_commit();
    }

    float o[kRowTiles][kDimTiles][4] = {};
    float m_run[kRowTiles][2], l_run[kRowTiles][2];
#pragma unroll
    for (int mi = 0; mi < kRowTiles; mi++)
        m_run[mi][0] = m_run[mi][1] = -INFINITY, l_run[mi][0] = l_run[mi][1] = 0.0f;
    const int warp_row0 = warp * 16 * kRowTiles; /* within the block */
    bool hidden_nonfinite_v = false; /* an inf or NaN value at a hidden key: see attend_row */

    for (int j = 0; j < key_tiles; j++) {
        const int stage = j % kStages, ahead = j + kStages - 1;
        if (ahead < key_tiles) { /* into the stage that tile j - 1 used */
            load_rows<T, D, kBlockN<D>>(sm.k[ahead % kStages], k_base, kv_stride, ahead * kBlockN<D>, keys);
            load_rows<T, D, kBlockN<D>>(sm.v[ahead % kStages], v_base, kv_stride, ahead * kBlockN<D>, keys);
        }
        cp_async_commit();
        cp_async_wait<kStages - 1>();
        const int key0 = j * kBlockN<D>;
        /* Keys past the block's first row's diagonal are hidden from some of its rows. */
        const bool hides_keys = causal && key0 + kBlockN<D> - 1 > offset + m0;
        if (hides_keys)
            hidden_nonfinite_v |= __syncthreads_or(
                copied_chunks_nonfinite<T, D, kBlockN<D>, kThreads>(sm.v[stage]));
        else
            __syncthreads();

        /* S = Q K^T; q fragments come from shared memory (registers go to the two row tiles). */
        float s[kRowTiles][kKeyTiles][4] = {};
#pragma unroll
        for (int kc = 0; kc < D / 16; kc++) {
            uint32_t qf[kRowTiles][4];
#pragma unroll
            for (int mi = 0; mi < kRowTiles; mi++) {
                int row = warp_row0 + 16 * mi + lane % 8 + 8 * (lane / 8 % 2);
                ldmatrix_x4(qf[mi], &sm.q[row][swizzle(row, 2 * kc + lane / 16)]);
            }
#pragma unroll
            for (int np = 0; np < kKeyTiles / 2; np++) {
                uint32_t kb[4];
                int row = np * 16 + lane % 8 + 8 * (lane / 16);
                ldmatrix_x4(kb, &sm.k[stage][row][swizzle(row, 2 * kc + lane / 8 % 2)]);
#pragma unroll
                for (int mi = 0; mi < kRowTiles; mi++) {
                    mma<T>(s[mi][2 * np], qf[mi], kb[0], kb[1]);
                    mma<T>(s[mi][2 * np + 1], qf[mi], kb[2], kb[3]);
                }
            }
        }

        /* Masking is needed only where the tile reaches past L or past the first row's diagonal. */
        const bool masked = key0 + kBlockN<D> > L || hides_keys;
        uint32_t pf[kRowTiles][kKeyTiles / 2][4];
#pragma unroll
        for (int mi = 0; mi < kRowTiles; mi++) {
            const int row_lo = m0 + warp_row0 + 16 * mi + g; /* this lane's rows: row_lo, row_lo + 8 */
            float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int nt = 0; nt < kKeyTiles; nt++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float x = s[mi][nt][e] * scale_log2;
                    if (masked) {
                        int key = key0 + nt * 8 + 2 * t + e % 2, row = row_lo + 8 * (e / 2);
                        if (key >= L || (causal && key > offset + row)) x = -INFINITY;
                    }
                    s[mi][nt][e] = x;
                    tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
                }
            }
            float rescale[2], base[2];
            online_softmax_step(tile_max, m_run[mi], l_run[mi], base, rescale);
#pragma unroll
            for (int dt = 0; dt < kDimTiles; dt++) rescale_rows(o[mi][dt], rescale);
            /* P as A fragments: accumulator tiles 2kk and 2kk + 1 form the 16x16 A tile kk. */
#pragma unroll
            for (int nt = 0; nt < kKeyTiles; nt++)
                softmax_probs<T>(s[mi][nt], base, l_run[mi], pf[mi][nt / 2][(nt % 2) * 2],
                                 pf[mi][nt / 2][(nt % 2) * 2 + 1]);
        }
#pragma unroll
        for (int kk = 0; kk < kKeyTiles / 2; kk++) {
#pragma unroll
            for (int dp = 0; dp < kDimTiles / 2; dp++) {
                uint32_t vb[4];
                int row = kk * 16 + lane % 8 + 8 * (lane / 8 % 2);
                ldmatrix_x4_trans(vb, &sm.v[stage][row][swizzle(row, 2 * dp + lane / 16)]);
#pragma unroll
                for (int mi = 0; mi < kRowTiles; mi++) {
                    mma<T>(o[mi][2 * dp], pf[mi][kk], vb[0], vb[1]);
                    mma<T>(o[mi][2 * dp + 1], pf[mi][kk], vb[2], vb[3]);
                }
            }
        }
        __syncthreads(); /* the stage is refilled next iteration */
    }
    cp_async_wait<0>();
    if (hidden_nonfinite_v) { /* see attend_row */
        redo_rows<T, D>(q_base, k_base, v_base, q_stride, kv_stride, m0 + warp_row0,
                        min(Sq, m0 + warp_row0 + 16 * kRowTiles), keys, offset, scale_log2, out_base);
        return;
    }

#pragma unroll
    for (int mi = 0; mi < kRowTiles; mi++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int row = m0 + warp_row0 + 16 * mi + g + 8 * half;
            if (row >= Sq) continue;
            float inv_l = 1.0f / quad_sum(l_run[mi][half]);
            T *dst = out_base + row * q_stride + 2 * t;
#pragma unroll
            for (int dt = 0; dt < kDimTiles; dt++)
                *reinterpret_cast<uint32_t *>(dst + dt * 8) =
                    pack2<T>(o[mi][dt][2 * half] * inv_l, o[mi][dt][2 * half + 1] * inv_l);
        }
    }
}

template <typename T, int D, int ROW_TILES>
bitnet_status launch_kernel(int32_t device, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv, const void *q,
                            const void *k, const void *v, int64_t C, const int32_t *seq_lens,
                            int32_t causal, float scale, void *out, cudaStream_t stream) {
    const size_t smem = sizeof(PrefillShared<D, ROW_TILES>);
    auto kernel = prefill_kernel<T, D, ROW_TILES>;
    BN_TRY(bn_cuda_kernel_shared_memory(device, reinterpret_cast<const void *>(kernel), smem));
    dim3 grid((unsigned)Hq, bn_ceil_div(Sq, kBlockM<ROW_TILES>), (unsigned)B);
    kernel<<<grid, kThreads, smem, stream>>>(
        static_cast<const T *>(q), static_cast<const T *>(k), static_cast<const T *>(v), seq_lens,
        (int)C, (int)Sq, (int)Hq, (int)Hkv, causal, scale * 1.4426950408889634f,
        static_cast<T *>(out));
    BN_CUDA_CHECK_LAUNCH("prefill_kernel");
    return BITNET_OK;
}

template <typename T, int D>
bitnet_status launch_prefill(int32_t device, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv,
                             const void *q, const void *k, const void *v, int64_t C, const int32_t *seq_lens,
                             int32_t causal, float scale, void *out, cudaStream_t stream) {
    if (Sq > 65535LL * kBlockM<2> || B > 65535)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_attention: B = %lld or Sq = %lld too large "
                       "for the prefill grid", (long long)B, (long long)Sq);
    int sms = 0;
    bool sm90a = false;
    BN_TRY(bn_cuda_sm_count(device, &sms));
    BN_CUDA_TRY(bn_runs_sm90a(device, &sm90a));
    const int64_t wide_blocks = Hq * bn_ceil_div(Sq, kBlockM<2>) * B;
    if (D == 128 && sm90a && 100 * wide_blocks >= BN_PREFILL_WGMMA_MIN_SM_PERCENT * sms)
        return bn_cuda_attention_prefill_sm90(device, std::is_same_v<T, __nv_bfloat16> ? BITNET_DTYPE_BF16
                                                                                       : BITNET_DTYPE_F16,
                                              B, Sq, Hq, Hkv, q, k, v, C, seq_lens, causal, scale, out, stream);
    if (D > 128 || wide_blocks < 2LL * sms) /* then Sq is small enough for the narrow grid too */
        return launch_kernel<T, D, 1>(device, B, Sq, Hq, Hkv, q, k, v, C, seq_lens, causal, scale, out, stream);
    if constexpr (D <= 128)
        return launch_kernel<T, D, 2>(device, B, Sq, Hq, Hkv, q, k, v, C, seq_lens, causal, scale, out, stream);
    return BITNET_OK; /* not reached: D = 256 took the narrow grid */
}

} // namespace

bitnet_status bn_cuda_attention_prefill(int32_t device, int32_t dtype, int64_t B, int64_t Sq,
                                        int64_t Hq, int64_t Hkv, int64_t D, const void *q,
                                        const void *k, const void *v, int64_t C,
                                        const int32_t *seq_lens, int32_t causal, float scale,
                                        void *out, cudaStream_t stream) {
    bool bf16 = dtype == BITNET_DTYPE_BF16;
    auto launch = D == 64    ? (bf16 ? launch_prefill<__nv_bfloat16, 64> : launch_prefill<__half, 64>)
                  : D == 128 ? (bf16 ? launch_prefill<__nv_bfloat16, 128> : launch_prefill<__half, 128>)
                             : (bf16 ? launch_prefill<__nv_bfloat16, 256> : launch_prefill<__half, 256>);
    return launch(device, B, Sq, Hq, Hkv, q, k, v, C, seq_lens, causal, scale, out, stream);
}
