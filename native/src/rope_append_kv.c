/* Public entry point of RoPE fused with the KV-cache append: argument checks and dispatch to
 * cpu/rope_append_kv.c or cuda/rope_append_kv.cu. */
#include <math.h>

#include "internal.h"

bitnet_status bitnet_rope_append_kv(int32_t device, int32_t dtype, int64_t B, int64_t S, int64_t Hq,
                                    int64_t Hkv, int64_t D, const void *qkv, void *q,
                                    void *k_cache, void *v_cache, int64_t C,
                                    const int32_t *positions, float theta, void *stream) {
    static const char fn[] = "bitnet_rope_append_kv";
    BN_TRY(bn_check_device(device));
    int on_gpu = device != BITNET_DEVICE_CPU;
    BN_TRY(bn_check_activation_dtype(fn, device, dtype));
    BN_CHECK(B > 0 && S > 0 && Hq > 0 && Hkv > 0 && D > 0 && C > 0,
             "%s: B, S, Hq, Hkv, D and C must be positive, got %lld, %lld, %lld, %lld, %lld, %lld",
             fn, (long long)B, (long long)S, (long long)Hq, (long long)Hkv, (long long)D,
             (long long)C);
    BN_CHECK(D % 2 == 0 && D <= 1024, "%s: head_dim D = %lld must be even and at most 1024", fn,
             (long long)D);
    BN_CHECK(Hq <= 65536 && Hkv <= 65536 && S <= INT32_MAX && C <= INT32_MAX,
             "%s: Hq, Hkv, S or C too large", fn);
    BN_CHECK(B <= INT64_MAX / (S * (Hq + 2 * Hkv) * D) && B <= INT64_MAX / (C * Hkv * D),
             "%s: B * S * (Hq + 2 Hkv) * D or B * C * Hkv * D overflows", fn);
    BN_CHECK(S <= C, "%s: S = %lld new tokens do not fit a cache of C = %lld", fn, (long long)S,
             (long long)C);
    BN_CHECK(isfinite(theta) && theta > 1.0f, "%s: theta must be finite and > 1, got %g", fn,
             (double)theta);
    const int64_t size = bn_dtype_size(dtype); /* also the arrays' alignment */
    /* fit: checked above */
    const int64_t qkv_count = B * S * (Hq + 2 * Hkv) * D, cache_count = B * C * Hkv * D;
    BN_TRY(bn_check_size("bitnet_rope_append_kv: qkv", qkv_count, size));
    BN_TRY(bn_check_size("bitnet_rope_append_kv: k_cache", cache_count, size));
    const int64_t cache = cache_count * size;
    const bn_array arrays[] = {{"qkv", qkv, qkv_count * size, size, BN_READ},
                               {"q", q, B * S * Hq * D * size, size, BN_WRITTEN},
                               {"k_cache", k_cache, cache, size, BN_WRITTEN},
                               {"v_cache", v_cache, cache, size, BN_WRITTEN},
                               {"positions", positions, B * 4, 4, BN_READ}};
    BN_CHECK_ARRAYS(fn, device, arrays, BN_NO_OVERLAP);
    if (!on_gpu)
        for (int64_t b = 0; b < B; b++)
            BN_CHECK(positions[b] >= 0 && positions[b] <= C - S,
                     "%s: positions[%lld] = %d: tokens %d .. %lld do not fit a cache of C = %lld",
                     fn, (long long)b, positions[b], positions[b], (long long)positions[b] + S - 1,
                     (long long)C);
    return on_gpu ? BN_CUDA(bn_cuda_rope_append_kv(device, dtype, B, S, Hq, Hkv, D, qkv, q,
                                                   k_cache, v_cache, C, positions, theta, stream))
                  : bn_cpu_rope_append_kv(dtype, B, S, Hq, Hkv, D, qkv, q, k_cache, v_cache, C,
                                          positions, theta);
}
