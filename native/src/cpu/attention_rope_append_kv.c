/* CPU bitnet_attention_rope_append_kv: the two ops it fuses, one after the other, through rotated
 * q rows and sequence lengths of its own, so that its values are theirs bit for bit. */
#include <stdlib.h>

#include "../internal.h"

bitnet_status bn_cpu_attention_rope_append_kv(int32_t dtype, int64_t B, int64_t Hq, int64_t Hkv,
                                              int64_t D, const void *qkv, void *k_cache,
                                              void *v_cache, int64_t C, const int32_t *positions,
                                              float theta, float scale, void *out) {
    void *q = malloc((size_t)(B * Hq * D * bn_dtype_size(dtype)));
    int32_t *seq_lens = malloc((size_t)B * sizeof(int32_t));
    bitnet_status status = BITNET_OK;
    if (q == NULL || seq_lens == NULL) {
        status = bn_fail(BITNET_ERR_OUT_OF_MEMORY, "bitnet_attention_rope_append_kv: no host memory "
                         "for the rotated q rows (%lld values)", (long long)(B * Hq * D));
    } else {
        for (int64_t b = 0; b < B; b++) seq_lens[b] = positions[b] + 1;
        status = bn_cpu_rope_append_kv(dtype, B, 1, Hq, Hkv, D, qkv, q, k_cache, v_cache, C,
                                       positions, theta);
        if (status == BITNET_OK)
            status = bn_cpu_attention(dtype, B, 1, Hq, Hkv, D, q, k_cache, v_cache, C, seq_lens, 1,
                                      scale, out);
    }
    free(q);
    free(seq_lens);
    return status;
}
