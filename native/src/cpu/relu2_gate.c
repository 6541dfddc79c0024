/* CPU squared-ReLU gate: out[t, f] = max(gate_up[t, f], 0)^2 * gate_up[t, F + f] in float32,
 * stored in the dtype. bn_cpu_relu2_span is also what the CPU bitnet_relu2_rmsnorm normalizes. */
#include "../internal.h"

void bn_cpu_relu2_span(int32_t dtype, const void *gate_up, int64_t gate, int64_t F, int64_t n,
                       void *out, int64_t out_offset) {
    for (int64_t i = 0; i < n; i++) {
        float g = bn_load_float(gate_up, dtype, gate + i);
        float up = bn_load_float(gate_up, dtype, gate + F + i);
        float relu = g < 0.0f ? 0.0f : g; /* NaN stays NaN */
        bn_store_float(out, dtype, out_offset + i, relu * relu * up);
    }
}

bitnet_status bn_cpu_relu2_gate(int32_t dtype, int64_t T, int64_t F, const void *gate_up, void *out) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) bn_cpu_relu2_span(dtype, gate_up, t * 2 * F, F, F, out, t * F);
    return BITNET_OK;
}
