/* Device helpers shared by the attention kernels (attention_decode.cu, attention_prefill.cu). */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common.cuh"

/* The two paths of bn_cuda_attention (attention.cu): decode (split-KV, attention_decode.cu) where
 * bn_attention_uses_decode, else prefill (tensor-core tiles, attention_prefill.cu). The caller has
 * entered the device and checked its compute capability. Decode with positions (NULL for plain
 * attention) is bitnet_attention_rope_append_kv: q is the qkv rows, k and v the caches it writes,
 * Sq = 1, causal, no seq_lens. */
bitnet_status bn_cuda_attention_decode(int32_t device, int32_t dtype, int64_t B, int64_t Sq, int64_t Hq,
                                       int64_t Hkv, int64_t D, const void *q, const void *k, const void *v,
                                       int64_t C, const int32_t *seq_lens, const int32_t *positions,
                                       float theta, int32_t causal, float scale, void *out, void *workspace,
                                       int64_t num_splits, cudaStream_t stream);
bitnet_status bn_cuda_attention_prefill(int32_t device, int32_t dtype, int64_t B, int64_t Sq,
                                        int64_t Hq, int64_t Hkv, int64_t D, const void *q,
                                        const void *k, const void *v, int64_t C,
                                        const int32_t *seq_lens, int32_t causal, float scale,
                                        void *out, cudaStream_t stream);
/* The prefill kernel on wgmma (attention_prefill_sm90.cu): D = 128, compute capability 9.0, 128-row
 * blocks (the caller has checked the grid's limits). */
bitnet_status bn_cuda_attention_prefill_sm90(int32_t device, int32_t dtype, int64_t B, int64_t Sq, int64_t Hq,
                                             int64_t Hkv, const void *q, const void *k, const void *v, int64_t C,
                                             const int32_t *seq_lens, int32_t causal, float scale, void *out,
                                             cudaStream_t stream);

/* A device-resident length the host could not check: [Sq, C] when causal, [1, C] otherwise. */
__device__ __forceinline__ bool valid_seq_len(int L, int C, int Sq, int causal) {
    return L <= C && L >= (causal ? Sq : 1);
}

__device__ __forceinline__ float2 to_float2(uint32_t pair, __nv_bfloat16) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&pair));
}
__device__ __forceinline__ float2 to_float2(uint32_t pair, __half) {
    return __half22float2(*reinterpret_cast<const __half2 *>(&pair));
}
/* Two floats as one packed pair of T (the low half is `lo`). */
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&pair);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 pair = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&pair);
}

/* The 8 elements of a 16-byte chunk as floats. */
template <typename T> __device__ __forceinline__ void unpack8(uint4 chunk, float *f) {
    const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 pair = to_float2(words[i], T());
        f[2 * i] = pair.x;
        f[2 * i + 1] = pair.y;
    }
}

/* Elements [lane * N, lane * N + N) of a row as floats (N = 2 or 4). */
template <typename T, int N> __device__ __forceinline__ void unpack_dims(const void *row, int lane, float *f) {
    const uint32_t *words = static_cast<const uint32_t *>(row) + lane * (N / 2);
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        float2 pair = to_float2(words[i], T());
        f[2 * i] = pair.x;
        f[2 * i + 1] = pair.y;
    }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

/* The attention kernels need sm_80 (cp.async, bf16 mma.sync): bn_cuda_attention refuses older GPUs
 * before launching (BN_SM80_ASM, common.cuh). */

/* 16-byte asynchronous global -> shared copy; when `inside` is false the destination gets zeros and
 * nothing is read. */
__device__ __forceinline__ void cp_async_16(void *smem, const void *global, bool inside) {
    BN_SM80_ASM("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                ::"r"((uint32_t)__cvta_generic_to_shared(smem)), "l"(global), "r"(inside ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { BN_SM80_ASM("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    BN_SM80_ASM("cp.async.wait_group %0;\n" ::"n"(N));
}

/* Tensor-core building blocks (mma.sync m16n8k16, ldmatrix) of the decode and prefill kernels. */

/* Chunk c of row r lives at c ^ (r % 8): the 8 rows an ldmatrix reads hit 8 different bank groups. */
__device__ __forceinline__ int swizzle(int row, int chunk) { return chunk ^ (row % 8); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *smem) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    BN_SM80_ASM("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void *smem) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    BN_SM80_ASM("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/* 2^x for x <= 0 (a softmax weight): ex2.approx with subnormal results flushed to 0, one MUFU
 * instruction where exp2f adds a subnormal range check and two multiplies. A weight below 2^-126
 * beside the largest one (1) changes no float32 sum. Faster for decode and prefill
 * (docs/log/2026-11-23.md#2026-11-23-18). */
__device__ __forceinline__ float exp2_weight(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* One step of the online softmax for a lane's accumulator rows g and g + 8 (halves 0 and 1), given
 * the rows' maxima over this lane's scores of a key tile: the running max m_run takes the tile's
 * (over the quad), the running sum l_run is rescaled; `base` is the max the tile's scores are
 * exponentiated against (0 for a row with nothing seen yet, whose zeros then stay zeros) and
 * `rescale` the factor for the output accumulators. */
__device__ __forceinline__ void online_softmax_step(const float (&tile_max)[2], float (&m_run)[2],
                                                    float (&l_run)[2], float (&base)[2],
                                                    float (&rescale)[2]) {
#pragma unroll
    for (int half = 0; half < 2; half++) {
        float m_new = fmaxf(m_run[half], quad_max(tile_max[half]));
        base[half] = m_new == -INFINITY ? 0.0f : m_new;
        rescale[half] = exp2_weight(m_run[half] - base[half]);
        m_run[half] = m_new;
        l_run[half] *= rescale[half];
    }
}

/* An accumulator fragment's rows g (c[0], c[1]) and g + 8 (c[2], c[3]) times their rescale factors. */
__device__ __forceinline__ void rescale_rows(float (&c)[4], const float (&rescale)[2]) {
    c[0] *= rescale[0], c[1] *= rescale[0], c[2] *= rescale[1], c[3] *= rescale[1];
}

/* Whether a packed pair of T holds an inf or NaN (all exponent bits set in either half). */
__device__ __forceinline__ bool pair_nonfinite(uint32_t pair, __nv_bfloat16) {
    return (pair & 0x7f80u) == 0x7f80u || (pair & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ bool pair_nonfinite(uint32_t pair, __half) {
    return (pair & 0x7c00u) == 0x7c00u || (pair & 0x7c000000u) == 0x7c000000u;
}

/* Whether any of the chunks this thread copied into a tile of ROWS swizzled rows holds an inf or
 * NaN. The tile loaders give thread i chunks i, i + THREADS, ... of a tile, so after cp_async_wait
 * the thread sees them without a barrier, and a __syncthreads_or of the results covers the tile. */
template <typename T, int D, int ROWS, int THREADS>
__device__ __forceinline__ bool copied_chunks_nonfinite(const uint4 (*tile)[D / 8]) {
    constexpr int kChunks = D / 8;
    bool found = false;
    for (int i = threadIdx.x; i < ROWS * kChunks; i += THREADS) {
        const int row = i / kChunks;
        const uint4 chunk = tile[row][swizzle(row, i % kChunks)];
        found |= pair_nonfinite(chunk.x, T()) || pair_nonfinite(chunk.y, T()) ||
                 pair_nonfinite(chunk.z, T()) || pair_nonfinite(chunk.w, T());
    }
    return found;
}

/* The P V mma adds 0 * v for a key the causal mask hides from a row, which is NaN where v is inf or
 * NaN. A block whose tiles hold such a value at a hidden key redoes its rows with this instead
 * (slow; rare): one query row against keys [key_begin, key_end) of one KV head (row stride
 * `stride`), all visible, in scalar code on one warp, added to the running unnormalized output o,
 * max m (log2 domain, as the mma loops keep it) and sum l; start from o = 0, m = -inf, l = 0.
 * Lane i holds columns [i D / 32, (i + 1) D / 32) of o, and every lane m and l. */
template <typename T, int D>
__device__ void attend_row(const T *q_row, const T *k, const T *v, int64_t stride, int key_begin,
                           int key_end, float scale_log2, float (&o)[D / 32], float &m, float &l) {
    constexpr int kCols = D / 32;
    const int lane = threadIdx.x % 32;
    float qf[kCols], kf[kCols], vf[kCols];
    unpack_dims<T, kCols>(q_row, lane, qf);
    for (int key = key_begin; key < key_end; key++) {
        unpack_dims<T, kCols>(k + key * stride, lane, kf);
        unpack_dims<T, kCols>(v + key * stride, lane, vf);
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < kCols; i++) dot += qf[i] * kf[i];
        const float score = warp_sum(dot) * scale_log2, m_new = fmaxf(m, score);
        const float base = m_new == -INFINITY ? 0.0f : m_new;
        const float rescale = exp2_weight(m - base), p = exp2_weight(score - base);
        m = m_new, l = l * rescale + p;
#pragma unroll
        for (int i = 0; i < kCols; i++) o[i] = o[i] * rescale + p * vf[i];
    }
}

/* P = exp2(s - base) of one 8-key accumulator tile, added to the running sums, as the two A-fragment
 * registers of the P V product: rows g (lo) and g + 8 (hi). */
template <typename T>
__device__ __forceinline__ void softmax_probs(const float (&s)[4], const float (&base)[2],
                                              float (&l_run)[2], uint32_t &lo, uint32_t &hi) {
    float p0 = exp2_weight(s[0] - base[0]), p1 = exp2_weight(s[1] - base[0]);
    float p2 = exp2_weight(s[2] - base[1]), p3 = exp2_weight(s[3] - base[1]);
    l_run[0] += p0 + p1;
    l_run[1] += p2 + p3;
    lo = pack2<T>(p0, p1);
    hi = pack2<T>(p2, p3);
}

/* Query rows [row_begin, row_end) redone by the calling warp with attend_row and written to out
 * (out of line, so that its registers stay out of the key loop's). */
template <typename T, int D>
__device__ __noinline__ void redo_rows(const T *q_base, const T *k_base, const T *v_base, int64_t q_stride,
                                       int64_t kv_stride, int row_begin, int row_end, int keys,
                                       int offset, float scale_log2, T *out_base) {
    const int lane = threadIdx.x % 32;
    for (int row = row_begin; row < row_end; row++) {
        float o_row[D / 32] = {}, m = -INFINITY, l = 0.0f;
        attend_row<T, D>(q_base + row * q_stride, k_base, v_base, kv_stride, 0,
                         min(keys, offset + row + 1), scale_log2, o_row, m, l);
#pragma unroll
        for (int i = 0; i < D / 32; i++)
            out_base[row * q_stride + lane * (D / 32) + i] = from_float<T>(o_row[i] / l);
    }
}

/* Query rows [row_begin, row_end) of a prefill block all NaN (a device-resident length out of range). */
template <typename T, int D>
__device__ void fill_nan_rows(T *out_base, int64_t q_stride, int row_begin, int row_end) {
    for (int i = threadIdx.x; i < (row_end - row_begin) * D; i += blockDim.x)
        out_base[(row_begin + i / D) * q_stride + i % D] = from_float<T>(__int_as_float(0x7fc00000));
}

/* A prefill block's work: query rows [m0, m0 + BLOCK_M) of head h of sequence b, blocks taken in
 * order x (head) fastest from the last row tile, so the longest causal tiles of every head come
 * first; the K and V rows of its KV head, and the keys its rows see (query row i sits at position
 * offset + i = L - Sq + i and sees keys up to there, causal, or all L). valid is false for a
 * device-resident length out of range. */
template <typename T, int D>
struct PrefillBlock {
    int m0, h, L, offset, keys;
    int64_t q_stride, kv_stride;
    const T *q_base, *k_base, *v_base;
    T *out_base;
    bool valid;

    __device__ __forceinline__ PrefillBlock(const T *q, const T *k, const T *v, const int32_t *seq_lens, int C,
                                            int Sq, int Hq, int Hkv, int causal, T *out, int block_m) {
        m0 = (gridDim.y - 1 - blockIdx.y) * block_m;
        h = blockIdx.x;
        const int b = blockIdx.z, kvh = h / (Hq / Hkv);
        L = seq_lens ? seq_lens[b] : C;
        q_stride = (int64_t)Hq * D, kv_stride = (int64_t)Hkv * D;
        out_base = out + ((int64_t)b * Sq * Hq + h) * D;
        q_base = q + ((int64_t)b * Sq * Hq + h) * D;
        k_base = k + ((int64_t)b * C * Hkv + kvh) * D;
        v_base = v + ((int64_t)b * C * Hkv + kvh) * D;
        valid = valid_seq_len(L, C, Sq, causal);
        offset = L - Sq;
        keys = causal ? min(L, offset + min(m0 + block_m, Sq)) : L;
    }
};
