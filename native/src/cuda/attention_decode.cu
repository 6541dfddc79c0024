/* Decode attention over a KV cache, split-KV: out = softmax(q.k^T * scale + causal mask) v, float32
 * online softmax. Layout q/out [B, Sq, Hq, D], k/v [B, C, Hkv, D] (bf16/f16, D = 64 or 128).
 * Grid (split, KV head x block of 16 query rows, sequence): the rows are one KV head's query heads x
 * new tokens, so each K/V byte is read once per 16 rows. A block of 4 warps streams its share of
 * the keys through shared memory (cp.async, double-buffered 64-key tiles); each warp does q.k and
 * p.v for 16 keys of a tile with mma.sync m16n8k16. With several splits, partials go to the
 * workspace and a merge kernel combines them. Both use programmatic dependent launch. Bytes moved: the K
 * and V rows up to seq_len. H100, bf16, 20/5 heads, d = 128, L2 cold, with the merge: B = 8,
 * L = 32768 at 2907 GB/s (94% of the 3081 GB/s read bandwidth); B = 1: 37.1 us at 32768 (73%),
 * 11.6 us at 4096, 6.7 us at 1024 (docs/attention.md). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention_common.cuh"

namespace {

constexpr int kRows = BN_ATTENTION_DECODE_BLOCK_ROWS; /* query rows per block: one m16 tile */
constexpr int kTileKeys = BN_ATTENTION_DECODE_TILE_KEYS;
constexpr int kWarps = 4, kThreads = kWarps * 32;
constexpr int kWarpKeys = kTileKeys / kWarps; /* each warp takes 16 keys of every tile */

/* Shared memory of one block: double-buffered K and V tiles and the q rows, 16-byte chunks
 * XOR-swizzled for ldmatrix. After the key loop the tiles hold the warps' partial results. */
template <int D>
struct DecodeShared {
    uint4 k[2][kTileKeys][D / 8];
    uint4 v[2][kTileKeys][D / 8];
    uint4 q[kRows][D / 8];
};
template <int D>
struct DecodeCombine { /* overlays DecodeShared::k and ::v */
    float o[kWarps][kRows][D];
    float m[kWarps][kRows];
    float l[kWarps][kRows];
};

/* Copies keys [key0, key0 + kTileKeys) of one KV head into a stage; rows at or past `keys_end`
 * become zeros (nothing is read there). */
template <typename T, int D>
__device__ __forceinline__ void load_tile(uint4 (*k_dst)[D / 8], uint4 (*v_dst)[D / 8], const T *k,
                                          const T *v, int64_t stride, int key0, int keys_end) {
    constexpr int kChunks = D / 8;
#pragma unroll
    for (int i = threadIdx.x; i < kTileKeys * kChunks; i += kThreads) {
        int key = i / kChunks, chunk = i % kChunks;
        bool inside = key0 + key < keys_end;
        int64_t offset = inside ? (int64_t)(key0 + key) * stride + chunk * 8 : 0;
        cp_async_16(&k_dst[key][swizzle(key, chunk)], k + offset, inside);
        cp_async_16(&v_dst[key][swizzle(key, chunk)], v + offset, inside);
    }
}

/* Block (split, KV head + row block, sequence). Row r of the block is query row row0 + r of its KV
 * head: token (row0 + r) / G, head kvh * G + (row0 + r) % G. Warp w computes, for every 64-key
 * tile, S = Q K^T over keys [16w, 16w + 16) and O += P V with mma.sync, keeping its own running
 * max and sum; the 4 warps are combined at the end. Fragment coordinates as in PTX m16n8k16: lane
 * 4g + t holds rows g and g + 8, columns 2t and 2t + 1 of each 8-wide n tile. */
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
decode_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
              const int32_t *__restrict__ seq_lens, int C, int Sq, int Hq, int Hkv, int causal,
              float scale_log2, int num_splits, T *__restrict__ out,
              float *__restrict__ partial_out, float *__restrict__ partial_ml) {
    constexpr int kChunks = D / 8, kDimTiles = D / 8;
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    auto &sm = *reinterpret_cast<DecodeShared<D> *>(smem_bytes);
    auto &combine = *reinterpret_cast<DecodeCombine<D> *>(smem_bytes);
    bn_pdl_wait(); /* q, the cache and seq_lens may come from the previous kernel */
    const int split = blockIdx.x, kvh = blockIdx.y % Hkv, b = blockIdx.z;
    const int group = Hq / Hkv, row0 = blockIdx.y / Hkv * kRows;
    const int rows = min(kRows, Sq * group - row0);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int L = seq_lens ? seq_lens[b] : C;
    auto out_row = [&](int r) { /* the row of out (and of q) that block row r is */
        int row = row0 + r;
        return ((int64_t)b * Sq + row / group) * Hq + kvh * group + row % group;
    };
    if (!valid_seq_len(L, C, Sq, causal)) {
        if (num_splits == 1)
            for (int i = threadIdx.x; i < rows * D; i += kThreads)
                out[out_row(i / D) * D + i % D] = from_float<T>(__int_as_float(0x7fc00000));
        return; /* with splits, the merge kernel writes the NaNs */
    }

    const int tiles = (L + kTileKeys - 1) / kTileKeys;
    const int tiles_per_split = (tiles + num_splits - 1) / num_splits;
    const int tile_begin = split * tiles_per_split;
    const int tile_end = min(tiles, tile_begin + tiles_per_split);
    const int64_t stride = (int64_t)Hkv * D;
    const T *k_head = k + ((int64_t)b * C * Hkv + kvh) * D;
    const T *v_head = v + ((int64_t)b * C * Hkv + kvh) * D;

    if (tile_begin < tile_end)
        load_tile<T, D>(sm.k[0], sm.v[0], k_head, v_head, stride, tile_begin * kTileKeys, L);
    for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
        int r = i / kChunks, chunk = i % kChunks;
        cp_async_16(&sm.q[r][swizzle(r, chunk)], q + (r < rows ? out_row(r) * D + chunk * 8 : 0),
                    r < rows);
    }
    cp_async_commit();

    /* This lane's rows g and g + 8 see keys up to last_key[.] (rows past `rows` are padding). */
    int last_key[2];
#pragma unroll
    for (int half = 0; half < 2; half++)
        last_key[half] = causal ? L - Sq + (row0 + g + 8 * half) / group : L - 1;

    uint32_t qf[D / 16][4];
    float o[kDimTiles][4] = {};
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    for (int tile = tile_begin; tile < tile_end; tile++) {
        const int stage = (tile - tile_begin) % 2;
        if (tile + 1 < tile_end)
            load_tile<T, D>(sm.k[stage ^ 1], sm.v[stage ^ 1], k_head, v_head, stride,
                            (tile + 1) * kTileKeys, L);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (tile == tile_begin) {
#pragma unroll
            for (int kc = 0; kc < D / 16; kc++) {
                int row = lane % 8 + 8 * (lane / 8 % 2);
                ldmatrix_x4(qf[kc], &sm.q[row][swizzle(row, 2 * kc + lane / 16)]);
            }
        }

        const int key_row0 = warp * kWarpKeys; /* this warp's 16 keys within the tile */
        float s[2][4] = {};
#pragma unroll
        for (int kc = 0; kc < D / 16; kc++) {
            uint32_t kb[4];
            int row = key_row0 + lane % 8 + 8 * (lane / 16);
            ldmatrix_x4(kb, &sm.k[stage][row][swizzle(row, 2 * kc + lane / 8 % 2)]);
            mma<T>(s[0], qf[kc], kb[0], kb[1]);
            mma<T>(s[1], qf[kc], kb[2], kb[3]);
        }
        const int key0 = tile * kTileKeys + key_row0;
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int key = key0 + nt * 8 + 2 * t + e % 2;
                float x = key < L && key <= last_key[e / 2] ? s[nt][e] * scale_log2 : -INFINITY;
                s[nt][e] = x;
                tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
            }
        }
        float rescale[2], base[2];
        online_softmax_step(tile_max, m_run, l_run, base, rescale);
        uint32_t pf[4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++) softmax_probs<T>(s[nt], base, l_run, pf[2 * nt], pf[2 * nt + 1]);
#pragma unroll
        for (int dp = 0; dp < kDimTiles / 2; dp++) {
            uint32_t vb[4];
            int row = key_row0 + lane % 8 + 8 * (lane / 8 % 2);
            ldmatrix_x4_trans(vb, &sm.v[stage][row][swizzle(row, 2 * dp + lane / 16)]);
#pragma unroll
            for (int half = 0; half < 2; half++) {
                o[2 * dp + half][0] *= rescale[0];
                o[2 * dp + half][1] *= rescale[0];
                o[2 * dp + half][2] *= rescale[1];
                o[2 * dp + half][3] *= rescale[1];
            }
            mma<T>(o[2 * dp], pf, vb[0], vb[1]);
            mma<T>(o[2 * dp + 1], pf, vb[2], vb[3]);
        }
        __syncthreads(); /* the stage is refilled next iteration */
    }
    cp_async_wait<0>();
    __syncthreads(); /* every warp is done with the tiles before they hold partial results */
    bn_pdl_launch_dependents();

    /* Combine the warps: each writes its unnormalized rows, max and sum to shared memory. */
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int r = g + 8 * half;
        float l = quad_sum(l_run[half]);
        if (t == 0) {
            combine.m[warp][r] = m_run[half];
            combine.l[warp][r] = l;
        }
#pragma unroll
        for (int dt = 0; dt < kDimTiles; dt++) {
            combine.o[warp][r][dt * 8 + 2 * t] = o[dt][2 * half];
            combine.o[warp][r][dt * 8 + 2 * t + 1] = o[dt][2 * half + 1];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * D; i += kThreads) {
        const int r = i / D, d = i % D;
        float m_tot = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; w++) m_tot = fmaxf(m_tot, combine.m[w][r]);
        const float base = m_tot == -INFINITY ? 0.0f : m_tot;
        float l_tot = 0.0f, acc = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; w++) {
            float weight = exp2f(combine.m[w][r] - base);
            l_tot += weight * combine.l[w][r];
            acc += weight * combine.o[w][r][d];
        }
        const int64_t row = out_row(r);
        if (num_splits == 1) {
            out[row * D + d] = from_float<T>(acc / l_tot);
        } else {
            const int64_t slot = row * num_splits + split;
            partial_out[slot * D + d] = acc;
            if (d == 0) {
                partial_ml[2 * slot] = m_tot;
                partial_ml[2 * slot + 1] = l_tot;
            }
        }
    }
}

/* One block per output row: w_s = 2^(m_s - max m), out = sum_s w_s acc_s / sum_s w_s l_s. Each warp
 * takes every 8th split, loading 8 splits' partials before using them so their latencies overlap. */
constexpr int kMergeWarps = 8, kMergeBatch = 8;

template <typename T, int D>
__global__ void __launch_bounds__(kMergeWarps * 32)
merge_kernel(const float *__restrict__ partial_out, const float *__restrict__ partial_ml,
             const int32_t *__restrict__ seq_lens, int C, int Sq, int Hq, int causal, int num_splits,
             T *__restrict__ out) {
    constexpr int kDimsPerLane = D / 32;
    __shared__ float weight[BN_ATTENTION_MAX_SPLITS];
    __shared__ float reduce[kMergeWarps][D];
    __shared__ float warp_result[kMergeWarps];
    const int64_t row = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int b = (int)(row / ((int64_t)Sq * Hq));
    const int L = seq_lens ? seq_lens[b] : C;
    bn_pdl_wait();
    if (!valid_seq_len(L, C, Sq, causal)) {
        for (int d = threadIdx.x; d < D; d += blockDim.x)
            out[row * D + d] = from_float<T>(__int_as_float(0x7fc00000));
        return;
    }
    const float *ml = partial_ml + 2 * row * num_splits;
    float m_max = -INFINITY;
    for (int s = threadIdx.x; s < num_splits; s += blockDim.x) m_max = fmaxf(m_max, ml[2 * s]);
    m_max = warp_max(m_max);
    if (lane == 0) warp_result[warp] = m_max;
    __syncthreads();
    m_max = warp_result[0];
    for (int w = 1; w < kMergeWarps; w++) m_max = fmaxf(m_max, warp_result[w]);
    float l = 0.0f;
    for (int s = threadIdx.x; s < num_splits; s += blockDim.x) {
        float w = exp2f(ml[2 * s] - m_max);
        weight[s] = w;
        l += w * ml[2 * s + 1];
    }
    l = warp_sum(l);
    __syncthreads(); /* everyone has read warp_result and written weight */
    if (lane == 0) warp_result[warp] = l;

    float acc[kDimsPerLane] = {};
    const float *part = partial_out + row * num_splits * D + lane * kDimsPerLane;
    for (int s0 = warp; s0 < num_splits; s0 += kMergeWarps * kMergeBatch) {
        float loaded[kMergeBatch][kDimsPerLane];
#pragma unroll
        for (int i = 0; i < kMergeBatch; i++) {
            int s = s0 + i * kMergeWarps;
#pragma unroll
            for (int d = 0; d < kDimsPerLane; d++) loaded[i][d] = s < num_splits ? part[(int64_t)s * D + d] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < kMergeBatch; i++) {
            int s = s0 + i * kMergeWarps;
            float w = s < num_splits ? weight[s] : 0.0f;
#pragma unroll
            for (int d = 0; d < kDimsPerLane; d++) acc[d] += w * loaded[i][d];
        }
    }
#pragma unroll
    for (int d = 0; d < kDimsPerLane; d++) reduce[warp][lane * kDimsPerLane + d] = acc[d];
    __syncthreads();
    l = 0.0f;
    for (int w = 0; w < kMergeWarps; w++) l += warp_result[w];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < kMergeWarps; w++) sum += reduce[w][d];
        out[row * D + d] = from_float<T>(sum / l);
    }
}

template <typename T, int D>
bitnet_status launch_decode(int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv, const void *q,
                            const void *k, const void *v, int64_t C, const int32_t *seq_lens,
                            int32_t causal, float scale, void *out, void *workspace,
                            int64_t num_splits, cudaStream_t stream) {
    const int64_t row_blocks = (Sq * (Hq / Hkv) + kRows - 1) / kRows;
    if (Hkv * row_blocks > 65535 || B > 65535 || B * Sq * Hq > INT32_MAX)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_attention: B = %lld or Hkv = %lld too large "
                       "for the decode grid", (long long)B, (long long)Hkv);
    const size_t smem = sizeof(DecodeShared<D>);
    static_assert(sizeof(DecodeCombine<D>) <= sizeof(DecodeShared<D>), "combine overlay too big");
    auto kernel = decode_kernel<T, D>;
    BN_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const int64_t rows = B * Sq * Hq;
    float *partial_out = static_cast<float *>(workspace);
    float *partial_ml = partial_out ? partial_out + rows * num_splits * D : nullptr;
    dim3 grid((unsigned)num_splits, (unsigned)(Hkv * row_blocks), (unsigned)B);
    BN_CUDA_TRY(bn_launch_pdl(kernel, grid, dim3(kThreads), smem, stream, static_cast<const T *>(q),
                              static_cast<const T *>(k), static_cast<const T *>(v), seq_lens, (int)C,
                              (int)Sq, (int)Hq, (int)Hkv, causal, scale * 1.4426950408889634f,
                              (int)num_splits, static_cast<T *>(out), partial_out, partial_ml));
    if (num_splits > 1) {
        /* The merge grid is set up while the decode grid drains. */
        BN_CUDA_TRY(bn_launch_pdl(merge_kernel<T, D>, dim3((unsigned)rows), dim3(kMergeWarps * 32),
                                  0, stream, (const float *)partial_out, (const float *)partial_ml,
                                  seq_lens, (int)C, (int)Sq, (int)Hq, (int)causal, (int)num_splits,
                                  static_cast<T *>(out)));
    }
    return BITNET_OK;
}

} // namespace

bitnet_status bn_cuda_attention(int32_t device, int32_t dtype, int64_t B, int64_t Sq, int64_t Hq,
                                int64_t Hkv, int64_t D, const void *q, const void *k, const void *v,
                                int64_t C, const int32_t *seq_lens, int32_t causal, float scale,
                                void *out, void *workspace, int64_t num_splits, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    int major = 0;
    BN_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    if (major < 8)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_attention: CUDA device %d has compute "
                       "capability %d.x; the attention kernels need 8.0 or newer", device, major);
    cudaStream_t s = bn_stream(stream);
    if (!bn_attention_uses_decode(Sq, Hq, Hkv))
        return bn_cuda_attention_prefill(dtype, B, Sq, Hq, Hkv, D, q, k, v, C, seq_lens, causal,
                                         scale, out, s);
    bool bf16 = dtype == BITNET_DTYPE_BF16;
    auto launch = D == 64 ? (bf16 ? launch_decode<__nv_bfloat16, 64> : launch_decode<__half, 64>)
                          : (bf16 ? launch_decode<__nv_bfloat16, 128> : launch_decode<__half, 128>);
    return launch(B, Sq, Hq, Hkv, q, k, v, C, seq_lens, causal, scale, out, workspace, num_splits, s);
}
