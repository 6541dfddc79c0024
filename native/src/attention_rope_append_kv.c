/* Public entry point of a decode step's attention fused with RoPE and the KV-cache append:
 * argument checks and dispatch to cpu/attention_rope_append_kv.c or cuda/attention.cu. */
#include <math.h>

#include "internal.h"

bitnet_status bitnet_attention_rope_append_kv(int32_t device, int32_t dtype, int64_t B, int64_t Hq,
                                              int64_t Hkv, int64_t D, const void *qkv,
                                              void *k_cache, void *v_cache, int64_t C,
                                              const int32_t *positions, float theta, float scale,
                                              void *out, void *workspace, int64_t workspace_bytes,
                                              void *stream) {
    static const char fn[] = "bitnet_attention_rope_append_kv";
    BN_TRY(bn_check_device(device));
    const int on_gpu = device != BITNET_DEVICE_CPU;
    BN_TRY(bn_check_activation_dtype(fn, device, dtype));
    int64_t q_count = 0, kv_count = 0;
    BN_TRY(bn_attention_check_sizes(fn, B, 1, Hq, Hkv, D, C, &q_count, &kv_count));
    if (D != 64 && D != 128 && D != 256)
        return bn_fail(BITNET_ERR_UNSUPPORTED,
                       "%s: head_dim D = %lld is not supported (64, 128 or 256)", fn, (long long)D);
    if (on_gpu && !bn_attention_uses_decode(1, Hq, Hkv))
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: %lld query heads per KV head; a GPU takes at "
                       "most %d", fn, (long long)(Hq / Hkv), BN_ATTENTION_DECODE_MAX_ROWS);
    BN_CHECK(isfinite(theta) && theta > 1.0f, "%s: theta must be finite and > 1, got %g", fn,
             (double)theta);
    BN_CHECK(isfinite(scale), "%s: scale must be finite (0 for 1/sqrt(D)), got %g", fn, (double)scale);
    BN_CHECK(workspace_bytes >= 0, "%s: workspace_bytes is negative (%lld)", fn,
             (long long)workspace_bytes);
    BN_CHECK(B <= INT64_MAX / ((Hq + 2 * Hkv) * D), "%s: B * (Hq + 2 Hkv) * D overflows", fn);
    const int64_t qkv_count = B * (Hq + 2 * Hkv) * D, size = bn_dtype_size(dtype);
    BN_TRY(bn_check_size("bitnet_attention_rope_append_kv: qkv", qkv_count, size));

    int64_t splits = 1;
    BN_TRY(bn_attention_splits(device, B, 1, Hq, Hkv, D, C, &splits));
    const int64_t needed = bn_attention_workspace_bytes(splits, B, 1, Hq, D); /* 0: none used */
    BN_CHECK(workspace_bytes >= needed,
             "%s: workspace of %lld bytes is too small, these sizes need %lld "
             "(bitnet_attention_workspace_size with Sq = 1)", fn, (long long)workspace_bytes,
             (long long)needed);

    const int64_t align = on_gpu ? 16 : size;
    const bn_array arrays[] = {{"qkv", qkv, qkv_count * size, size, BN_READ},
                               {"k_cache", k_cache, kv_count * size, align, BN_WRITTEN},
                               {"v_cache", v_cache, kv_count * size, align, BN_WRITTEN},
                               {"positions", positions, B * 4, 4, BN_READ},
                               {"out", out, q_count * size, align, BN_WRITTEN},
                               {"workspace", workspace, needed, 16, BN_WRITTEN}};
    BN_CHECK_ARRAYS(fn, device, arrays, BN_NO_OVERLAP);
    if (!on_gpu)
        for (int64_t b = 0; b < B; b++)
            BN_CHECK(positions[b] >= 0 && positions[b] < C,
                     "%s: positions[%lld] = %d is outside the cache of C = %lld", fn,
                     (long long)b, positions[b], (long long)C);
    if (scale == 0.0f) scale = 1.0f / sqrtf((float)D);
    return on_gpu ? BN_CUDA(bn_cuda_attention_rope_append_kv(device, dtype, B, Hq, Hkv, D, qkv,
                                                             k_cache, v_cache, C, positions, theta,
                                                             scale, out, workspace, splits, stream))
                  : bn_cpu_attention_rope_append_kv(dtype, B, Hq, Hkv, D, qkv, k_cache, v_cache, C,
                                                    positions, theta, scale, out);
}
