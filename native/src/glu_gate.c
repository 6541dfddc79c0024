/* Public entry points of the gate of a gated linear unit (bitnet_glu_gate, and bitnet_relu2_gate,
 * its squared-ReLU form): argument checks and dispatch to cpu/glu_gate.c or cuda/glu_gate.cu. */
#include "internal.h"

bitnet_status bn_check_activation(const char *fn, int32_t activation) {
    BN_CHECK(activation == BITNET_ACTIVATION_RELU2 || activation == BITNET_ACTIVATION_SILU,
             "%s: activation %d is not BITNET_ACTIVATION_RELU2 (0) or BITNET_ACTIVATION_SILU (1)",
             fn, activation);
    return BITNET_OK;
}

static bitnet_status glu_gate(const char *fn, int32_t device, int32_t dtype, int64_t T, int64_t F,
                              int32_t activation, const void *gate_up, void *out, void *stream) {
    BN_TRY(bn_check_device(device));
    int on_gpu = device != BITNET_DEVICE_CPU;
    BN_TRY(bn_check_activation_dtype(fn, device, dtype));
    BN_TRY(bn_check_activation(fn, activation));
    BN_CHECK(T > 0 && F > 0, "%s: T and F must be positive, got %lld and %lld", fn, (long long)T,
             (long long)F);
    BN_CHECK(F <= INT32_MAX && T <= INT64_MAX / (2 * F), "%s: T * 2F overflows", fn);
    const int64_t size = bn_dtype_size(dtype); /* also the arrays' alignment */
    BN_TRY(bn_check_size(fn, 2 * T * F, size));
    const bn_array arrays[] = {{"gate_up", gate_up, 2 * T * F * size, size, BN_READ},
                               {"out", out, T * F * size, size, BN_WRITTEN}};
    BN_CHECK_ARRAYS(fn, device, arrays, BN_NO_OVERLAP);
    return on_gpu ? BN_CUDA(bn_cuda_glu_gate(device, dtype, T, F, activation, gate_up, out, stream))
                  : bn_cpu_glu_gate(dtype, T, F, activation, gate_up, out);
}

bitnet_status bitnet_glu_gate(int32_t device, int32_t dtype, int64_t T, int64_t F,
                              int32_t activation, const void *gate_up, void *out, void *stream) {
    return glu_gate("bitnet_glu_gate", device, dtype, T, F, activation, gate_up, out, stream);
}

bitnet_status bitnet_relu2_gate(int32_t device, int32_t dtype, int64_t T, int64_t F,
                                const void *gate_up, void *out, void *stream) {
    return glu_gate("bitnet_relu2_gate", device, dtype, T, F, BITNET_ACTIVATION_RELU2, gate_up, out,
                    stream);
}
