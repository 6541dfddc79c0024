/* CPU embedding lookup: one row copy per token (ids were checked by the public entry). */
#include <string.h>

#include "../internal.h"

bitnet_status bn_cpu_embedding(int32_t dtype, const void *table, int64_t V, int64_t H,
                               const int32_t *ids, int64_t N, void *out) {
    (void)V;
    size_t row_bytes = (size_t)(H * bn_dtype_size(dtype));
    for (int64_t n = 0; n < N; n++)
        memcpy((char *)out + n * row_bytes, (const char *)table + ids[n] * row_bytes, row_bytes);
    return BITNET_OK;
}
