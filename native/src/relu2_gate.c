/* Public entry point of the squared-ReLU gate: argument checks and dispatch to cpu/relu2_gate.c or
 * cuda/relu2_gate.cu. */
#include "internal.h"

bitnet_status bitnet_relu2_gate(int32_t device, int32_t dtype, int64_t T, int64_t F,
                                const void *gate_up, void *out, void *stream) {
    static const char fn[] = "bitnet_relu2_gate";
    BN_TRY(bn_check_device(device));
    int on_gpu = device != BITNET_DEVICE_CPU;
    BN_TRY(bn_check_activation_dtype(fn, device, dtype));
    BN_CHECK(T > 0 && F > 0, "%s: T and F must be positive, got %lld and %lld", fn, (long long)T,
             (long long)F);
    BN_CHECK(F <= INT32_MAX && T <= INT64_MAX / (2 * F), "%s: T * 2F overflows", fn);
    const int64_t size = bn_dtype_size(dtype); /* also the arrays' alignment */
    BN_TRY(bn_check_size(fn, 2 * T * F, size));
    const bn_array arrays[] = {{"gate_up", gate_up, 2 * T * F * size, size, BN_READ},
                               {"out", out, T * F * size, size, BN_WRITTEN}};
    BN_CHECK_ARRAYS(fn, device, arrays, BN_NO_OVERLAP);
    return on_gpu ? BN_CUDA(bn_cuda_relu2_gate(device, dtype, T, F, gate_up, out, stream))
                  : bn_cpu_relu2_gate(dtype, T, F, gate_up, out);
}
