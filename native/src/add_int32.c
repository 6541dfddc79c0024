/* Public entry of the int32 increment (decode bookkeeping on the device). */
#include "internal.h"

bitnet_status bitnet_add_int32(int32_t device, int32_t *x, int64_t n, int32_t delta, void *stream) {
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_size("add_int32: n", n, 4));
    BN_TRY(bn_check_pointer(device, x, 4, "add_int32: x"));
    if (device == BITNET_DEVICE_CPU) return bn_cpu_add_int32(x, n, delta);
    return BN_CUDA(bn_cuda_add_int32(device, x, n, delta, stream));
}
