/* CPU int32 increment; wraps around like the GPU (unsigned arithmetic, no undefined overflow). */
#include "../internal.h"

bitnet_status bn_cpu_add_int32(int32_t *x, int64_t n, int32_t delta) {
    for (int64_t i = 0; i < n; i++) x[i] = (int32_t)((uint32_t)x[i] + (uint32_t)delta);
    return BITNET_OK;
}
