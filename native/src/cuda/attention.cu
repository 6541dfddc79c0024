/* Attention on a GPU: checks the compute capability, then takes the decode kernels
 * (attention_decode.cu: split-KV, a few query rows per KV head) or the prefill kernels
 * (attention_prefill.cu: 64- or 128-row tiles), as bn_attention_uses_decode (attention.c) says;
 * the workspace size follows the same rule. A decode step with RoPE and the KV-cache append
 * (bitnet_attention_rope_append_kv) always takes the decode kernels (its entry point checks that
 * bn_attention_uses_decode). */
#include "attention_common.cuh"

/* The attention kernels need compute capability 8.0 or newer (the caller has entered the device). */
static bitnet_status check_compute_capability(const char *fn, int32_t device) {
    int major = 0;
    BN_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    if (major < 8)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: CUDA device %d has compute capability %d.x; the "
                       "attention kernels need 8.0 or newer", fn, device, major);
    return BITNET_OK;
}

bitnet_status bn_cuda_attention(int32_t device, int32_t dtype, int64_t B, int64_t Sq, int64_t Hq,
                                int64_t Hkv, int64_t D, const void *q, const void *k, const void *v,
                                int64_t C, const int32_t *seq_lens, int32_t causal, float scale,
                                void *out, void *workspace, int64_t num_splits, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BN_TRY(check_compute_capability("bitnet_attention", device));
    cudaStream_t s = bn_stream(stream);
    if (!bn_attention_uses_decode(Sq, Hq, Hkv))
        return bn_cuda_attention_prefill(device, dtype, B, Sq, Hq, Hkv, D, q, k, v, C, seq_lens,
                                         causal, scale, out, s);
    return bn_cuda_attention_decode(device, dtype, B, Sq, Hq, Hkv, D, q, k, v, C, seq_lens, nullptr, 0.0f,
                                    causal, scale, out, workspace, num_splits, s);
}

bitnet_status bn_cuda_attention_rope_append_kv(int32_t device, int32_t dtype, int64_t B, int64_t Hq,
                                               int64_t Hkv, int64_t D, const void *qkv, void *k_cache,
                                               void *v_cache, int64_t C, const int32_t *positions,
                                               float theta, float scale, void *out, void *workspace,
                                               int64_t num_splits, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BN_TRY(check_compute_capability("bitnet_attention_rope_append_kv", device));
    return bn_cuda_attention_decode(device, dtype, B, 1, Hq, Hkv, D, qkv, k_cache, v_cache, C, nullptr,
                                    positions, theta, 1, scale, out, workspace, num_splits, bn_stream(stream));
}
