/* CPU squared-ReLU gate: out[t, f] = max(gate_up[t, f], 0)^2 * gate_up[t, F + f] in float32. */
#include "../internal.h"

bitnet_status bn_cpu_relu2_gate(int32_t dtype, int64_t T, int64_t F, const void *gate_up, void *out) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t f = 0; f < F; f++) {
            float gate = bn_load_float(gate_up, dtype, t * 2 * F + f);
            float up = bn_load_float(gate_up, dtype, t * 2 * F + F + f);
            float relu = gate < 0.0f ? 0.0f : gate; /* NaN stays NaN */
            bn_store_float(out, dtype, t * F + f, relu * relu * up);
        }
    }
    return BITNET_OK;
}
