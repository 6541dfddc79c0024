/* Public entry of the embedding lookup. */
#include "internal.h"

bitnet_status bitnet_embedding(int32_t device, int32_t dtype, const void *table, int64_t V,
                               int64_t H, const int32_t *ids, int64_t N, void *out, void *stream) {
    BN_TRY(bn_check_device(device));
    BN_CHECK(dtype == BITNET_DTYPE_F32 || dtype == BITNET_DTYPE_F16 || dtype == BITNET_DTYPE_BF16,
             "embedding: dtype must be float32, float16 or bfloat16, got %s (%d)",
             bn_dtype_name(dtype), dtype);
    int64_t elem = bn_dtype_size(dtype);
    BN_TRY(bn_check_matrix("embedding: table", V, H, elem));
    BN_TRY(bn_check_matrix("embedding: out", N, H, elem));
    BN_CHECK(V <= INT32_MAX, "embedding: V = %lld does not fit the int32 ids", (long long)V);
    const bn_array arrays[] = {{"table", table, V * H * elem, elem, BN_READ},
                               {"ids", ids, N * 4, 4, BN_READ},
                               {"out", out, N * H * elem, elem, BN_WRITTEN}};
    BN_CHECK_ARRAYS("embedding", device, arrays, BN_NO_OVERLAP);
    if (device == BITNET_DEVICE_CPU) {
        for (int64_t n = 0; n < N; n++)
            BN_CHECK(ids[n] >= 0 && ids[n] < V, "embedding: ids[%lld] = %d is outside [0, %lld)",
                     (long long)n, ids[n], (long long)V);
        return bn_cpu_embedding(dtype, table, V, H, ids, N, out);
    }
    return BN_CUDA(bn_cuda_embedding(device, dtype, table, V, H, ids, N, out, stream));
}
