/* Public entry of the row-wise argmax (greedy sampling on the device). */
#include "internal.h"

bitnet_status bitnet_argmax(int32_t device, const float *x, int64_t N, int64_t M, int32_t *index,
                            void *stream) {
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_matrix("argmax: x", N, M, 4));
    BN_CHECK(M <= INT32_MAX, "argmax: M = %lld does not fit the int32 index", (long long)M);
    const bn_array arrays[] = {{"x", x, N * M * 4, 4, BN_READ},
                               {"index", index, N * 4, 4, BN_WRITTEN}};
    BN_CHECK_ARRAYS("argmax", device, arrays, BN_NO_OVERLAP);
    if (device == BITNET_DEVICE_CPU) return bn_cpu_argmax(x, N, M, index);
    return BN_CUDA(bn_cuda_argmax(device, x, N, M, index, stream));
}
