/* RoPE (rotate-half) on q in place and on k, fused with the KV-cache append: token s of sequence b at
 * p = positions[b] + s turns each pair (x[i], x[i + D/2]) by p * theta^(-2i/D), then rotated k and
 * plain v go to cache row p. Grid (token, group of heads_per_block() heads of q then k): thread (i, h)
 * owns pair i of one head, so that every load of a token is in flight at once; its angle, cos and
 * sin are computed in float64, the rotation in float32. Bytes: q read + written, k and v read, two
 * cache rows written: tiny next to attention (not benchmarked separately). Launched with
 * programmatic dependent launch, waiting for the previous kernel before reading anything. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention_common.cuh"

namespace {

/* Heads per block: as many as fit kBlockThreads threads of D / 2 pairs each (one from D = 1024). */
constexpr int kBlockThreads = 256;
int heads_per_block(int64_t D) { return D / 2 >= kBlockThreads ? 1 : (int)(kBlockThreads / (D / 2)); }

template <typename T>
__global__ void rope_append_kv_kernel(T *__restrict__ q, const T *__restrict__ k,
                                      const T *__restrict__ v, T *__restrict__ k_cache,
                                      T *__restrict__ v_cache, const int32_t *__restrict__ positions,
                                      int S, int Hq, int Hkv, int D, int C, double log2_theta) {
    bn_pdl_wait();
    bn_pdl_launch_dependents();
    const int64_t token = blockIdx.x;
    const int b = (int)(token / S), half = D / 2, i = threadIdx.x;
    const int head = blockIdx.y * blockDim.y + threadIdx.y; /* q heads, then k (and v) heads */
    if (head >= Hq + Hkv) return;
    const int first = positions[b];
    if (first < 0 || first > C - S) return; /* out of range: leave q and the cache untouched */
    const int p = first + (int)(token % S);
    double sin_d, cos_d;
    sincos((double)p * exp2(-2.0 * i / D * log2_theta), &sin_d, &cos_d);
    const float sn = (float)sin_d, cs = (float)cos_d;

    if (head < Hq) {
        T *x = q + (token * Hq + head) * D;
        const float a = to_float(x[i]), c = to_float(x[i + half]);
        x[i] = from_float<T>(a * cs - c * sn);
        x[i + half] = from_float<T>(c * cs + a * sn);
    } else {
        const int h = head - Hq;
        const int64_t src = (token * Hkv + h) * D, dst = (((int64_t)b * C + p) * Hkv + h) * D;
        const float a = to_float(k[src + i]), c = to_float(k[src + i + half]);
        k_cache[dst + i] = from_float<T>(a * cs - c * sn);
        k_cache[dst + i + half] = from_float<T>(c * cs + a * sn);
        v_cache[dst + i] = v[src + i];
        v_cache[dst + i + half] = v[src + i + half];
    }
}

template <typename T>
bitnet_status launch(int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, void *q,
                     const void *k, const void *v, void *k_cache, void *v_cache, int64_t C,
                     const int32_t *positions, float theta, cudaStream_t stream) {
    if (B * S > INT32_MAX)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_rope_append_kv: B * S = %lld tokens is too "
                       "many for one launch", (long long)(B * S));
    const int per_block = heads_per_block(D);
    const int64_t head_blocks = (Hq + Hkv + per_block - 1) / per_block;
    if (head_blocks > 65535)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_rope_append_kv: Hq + Hkv = %lld heads is too "
                       "many for one launch", (long long)(Hq + Hkv));
    BN_CUDA_TRY(bn_launch_pdl(rope_append_kv_kernel<T>, dim3((unsigned)(B * S), (unsigned)head_blocks),
                              dim3((unsigned)(D / 2), (unsigned)per_block), 0, stream, static_cast<T *>(q), static_cast<const T *>(k),
                              static_cast<const T *>(v), static_cast<T *>(k_cache),
                              static_cast<T *>(v_cache), positions, (int)S, (int)Hq, (int)Hkv,
                              (int)D, (int)C, log2((double)theta)));
    return BITNET_OK;
}

} // namespace

bitnet_status bn_cuda_rope_append_kv(int32_t device, int32_t dtype, int64_t B, int64_t S,
                                     int64_t Hq, int64_t Hkv, int64_t D, void *q, const void *k,
                                     const void *v, void *k_cache, void *v_cache, int64_t C,
                                     const int32_t *positions, float theta, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    auto run = dtype == BITNET_DTYPE_BF16 ? launch<__nv_bfloat16> : launch<__half>;
    return run(B, S, Hq, Hkv, D, q, k, v, k_cache, v_cache, C, positions, theta, bn_stream(stream));
}
