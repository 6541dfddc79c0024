/* CPU bitnet_gemv_w2a8_rope_append_kv: the two ops it fuses, one after the other, through a qkv row
 * of its own, so that its values are theirs bit for bit. */
#include <stdlib.h>

#include "../internal.h"

bitnet_status bn_cpu_gemv_w2a8_rope_append_kv(int32_t dtype, const uint8_t *w_packed,
                                              const float *w_scales, int64_t K, const int8_t *x_q,
                                              const float *x_scale, int64_t Hq, int64_t Hkv,
                                              int64_t D, void *q, void *k_cache, void *v_cache,
                                              int64_t C, const int32_t *position, float theta) {
    const int64_t M = (Hq + 2 * Hkv) * D;
    void *qkv = malloc((size_t)(M * bn_dtype_size(dtype)));
    if (qkv == NULL)
        return bn_fail(BITNET_ERR_OUT_OF_MEMORY, "bitnet_gemv_w2a8_rope_append_kv: no host memory "
                       "for the qkv row (%lld values)", (long long)M);
    bitnet_status status = bn_cpu_gemv_w2a8(w_packed, w_scales, M, K, x_q, x_scale, 1, qkv, dtype);
    if (status == BITNET_OK)
        status = bn_cpu_rope_append_kv(dtype, 1, 1, Hq, Hkv, D, qkv, q, k_cache, v_cache, C,
                                       position, theta);
    free(qkv);
    return status;
}
