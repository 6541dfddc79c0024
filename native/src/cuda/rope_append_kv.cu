/* RoPE (rotate-half) on a fused QKV projection's output, with the KV-cache append: token s of
 * sequence b at p = positions[b] + s turns each pair (x[i], x[i + D/2]) of its q and k heads by
 * p * theta^(-2i/D); rotated q heads go to q, rotated k and plain v heads to cache row p.
 * Grid (token, group of kBlockThreads items); an item is VEC consecutive pairs of one q or k head,
 * or VEC elements of v. Each thread first loads its item with vector loads, then its block computes
 * the token's D/2 angles, cos and sin in float64 into shared memory, then the thread rotates in
 * float32 and stores: the loads are in flight while the angles are computed.
 * Launched with programmatic dependent launch, waiting for the previous kernel before reading. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

constexpr int kMaxHalf = 512; /* D <= 1024, checked by the entry point */
constexpr int kBlockThreads = 128;

template <typename T, int VEC> struct alignas(sizeof(T) * VEC) Pack {
    T x[VEC];
};

/* The items of one token: VEC pairs of one q or k head ((Hq + Hkv) * D / 2 / VEC of them), then
 * VEC elements of v (Hkv * D / VEC). */
struct TokenItems {
    int Hq, Hkv, D, groups, rotated, total;
    __device__ TokenItems(int Hq_, int Hkv_, int D_, int vec)
        : Hq(Hq_), Hkv(Hkv_), D(D_), groups(D_ / 2 / vec), rotated((Hq_ + Hkv_) * (D_ / 2 / vec)),
          total((Hq_ + Hkv_) * (D_ / 2 / vec) + Hkv_ * D_ / vec) {}
};

template <typename T, int VEC>
__device__ __forceinline__ void load_item(const T *row, const TokenItems &t, int item,
                                          Pack<T, VEC> &lo, Pack<T, VEC> &hi) {
    if (item < t.rotated) {
        const T *x = row + (item / t.groups) * t.D + (item % t.groups) * VEC;
        lo = *reinterpret_cast<const Pack<T, VEC> *>(x);
        hi = *reinterpret_cast<const Pack<T, VEC> *>(x + t.D / 2);
    } else {
        lo = *reinterpret_cast<const Pack<T, VEC> *>(row + (t.Hq + t.Hkv) * t.D +
                                                       (item - t.rotated) * VEC);
    }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_item(const TokenItems &t, int item, Pack<T, VEC> lo,
                                           Pack<T, VEC> hi, const float *cosines,
                                           const float *sines, T *q_row, T *k_row, T *v_row) {
    if (item >= t.rotated) {
        *reinterpret_cast<Pack<T, VEC> *>(v_row + (item - t.rotated) * VEC) = lo;
        return;
    }
    const int head = item / t.groups, first = (item % t.groups) * VEC;
    T *dst = (head < t.Hq ? q_row + head * t.D : k_row + (head - t.Hq) * t.D) + first;
    Pack<T, VEC> out_lo, out_hi;
#pragma unroll
    for (int e = 0; e < VEC; e++)
        bn_rope_rotate(to_float(lo.x[e]), to_float(hi.x[e]), cosines[first + e], sines[first + e],
                       out_lo.x[e], out_hi.x[e]);
    *reinterpret_cast<Pack<T, VEC> *>(dst) = out_lo;
    *reinterpret_cast<Pack<T, VEC> *>(dst + t.D / 2) = out_hi;
}

template <typename T, int VEC>
__global__ void rope_append_kv_kernel(const T *__restrict__ qkv, T *__restrict__ q,
                                      T *__restrict__ k_cache, T *__restrict__ v_cache,
                                      const int32_t *__restrict__ positions, int S, int Hq, int Hkv,
                                      int D, int C, double log2_theta) {
    __shared__ float cosines[kMaxHalf], sines[kMaxHalf];
    bn_pdl_wait();
    bn_pdl_launch_dependents();
    const int64_t token = blockIdx.x;
    const int b = (int)(token / S);
    const int first = positions[b];
    if (first < 0 || first > C - S) return; /* out of range: leave q and the cache untouched */
    const int p = first + (int)(token % S);
    const TokenItems t(Hq, Hkv, D, VEC);
    const int item = blockIdx.y * blockDim.x + threadIdx.x;

    Pack<T, VEC> lo, hi;
    if (item < t.total) load_item(qkv + token * (Hq + 2 * Hkv) * D, t, item, lo, hi);
    for (int i = threadIdx.x; i < D / 2; i += blockDim.x) {
        double sin_d, cos_d;
        sincos(bn_rope_angle(p, i, D, log2_theta), &sin_d, &cos_d);
        cosines[i] = (float)cos_d;
        sines[i] = (float)sin_d;
    }
    __syncthreads();
    if (item >= t.total) return;
    const int64_t cache_row = ((int64_t)b * C + p) * Hkv * D;
    store_item(t, item, lo, hi, cosines, sines, q + token * Hq * D, k_cache + cache_row,
               v_cache + cache_row);
}

bool aligned(const void *p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename T, int VEC>
cudaError_t launch(int64_t tokens, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, const void *qkv,
                   void *q, void *k_cache, void *v_cache, int64_t C, const int32_t *positions,
                   float theta, cudaStream_t stream) {
    const int64_t items = (Hq + Hkv) * D / 2 / VEC + Hkv * D / VEC;
    const int64_t blocks = (items + kBlockThreads - 1) / kBlockThreads;
    return bn_launch_pdl(rope_append_kv_kernel<T, VEC>, dim3((unsigned)tokens, (unsigned)blocks),
                         dim3(kBlockThreads), 0,
                         stream, static_cast<const T *>(qkv), static_cast<T *>(q),
                         static_cast<T *>(k_cache), static_cast<T *>(v_cache), positions, (int)S,
                         (int)Hq, (int)Hkv, (int)D, (int)C, log2((double)theta));
}

/* The widest vector (8, 2 or 1 elements) that divides D / 2 and that every array's alignment
 * allows. */
template <typename T>
cudaError_t launch_widest(int64_t tokens, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                          const void *qkv, void *q, void *k_cache, void *v_cache, int64_t C,
                          const int32_t *positions, float theta, cudaStream_t stream) {
    auto all_aligned = [&](int bytes) {
        return aligned(qkv, bytes) && aligned(q, bytes) && aligned(k_cache, bytes) &&
               aligned(v_cache, bytes);
    };
    if (D / 2 % 8 == 0 && all_aligned(8 * sizeof(T)))
        return launch<T, 8>(tokens, S, Hq, Hkv, D, qkv, q, k_cache, v_cache, C, positions, theta,
                            stream);
    if (D / 2 % 2 == 0 && all_aligned(2 * sizeof(T)))
        return launch<T, 2>(tokens, S, Hq, Hkv, D, qkv, q, k_cache, v_cache, C, positions, theta,
                            stream);
    return launch<T, 1>(tokens, S, Hq, Hkv, D, qkv, q, k_cache, v_cache, C, positions, theta,
                        stream);
}

} // namespace

bitnet_status bn_cuda_rope_append_kv(int32_t device, int32_t dtype, int64_t B, int64_t S,
                                     int64_t Hq, int64_t Hkv, int64_t D, const void *qkv, void *q,
                                     void *k_cache, void *v_cache, int64_t C,
                                     const int32_t *positions, float theta, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    /* the grid: B * S tokens, and up to (Hq + 3 Hkv) * D / 2 items per token (vectors of 1) */
    if (B * S > INT32_MAX || (Hq + 3 * Hkv) * D / 2 > 65535LL * kBlockThreads)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_rope_append_kv: B * S = %lld tokens of "
                       "Hq + 2 Hkv = %lld heads of D = %lld are too many for one launch",
                       (long long)(B * S), (long long)(Hq + 2 * Hkv), (long long)D);
    auto run = dtype == BITNET_DTYPE_BF16 ? launch_widest<__nv_bfloat16> : launch_widest<__half>;
    BN_CUDA_TRY(run(B * S, S, Hq, Hkv, D, qkv, q, k_cache, v_cache, C, positions, theta,
                    bn_stream(stream)));
    return BITNET_OK;
}
