/* CPU gate of a gated linear unit: out[t, f] = act(gate_up[t, f]) * gate_up[t, F + f] in float32,
 * act = relu2 (max(g, 0)^2) or silu (g / (1 + e^-g)), stored in the dtype. bn_cpu_glu_span is also
 * what the CPU bitnet_glu_rmsnorm normalizes. */
#include <math.h>

#include "../internal.h"

static inline float relu2(float gate, float up) {
    const float relu = gate < 0.0f ? 0.0f : gate; /* NaN stays NaN */
    return relu * relu * up;
}

static inline float silu(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

/* out[i] = act(g[i]) * up[i], i < n; the activation's branch outside the loop, so that it vectorizes. */
static void gate_floats(int32_t activation, const float *g, const float *up, int64_t n, float *out) {
    if (activation == BITNET_ACTIVATION_SILU)
        for (int64_t i = 0; i < n; i++) out[i] = silu(g[i], up[i]);
    else
        for (int64_t i = 0; i < n; i++) out[i] = relu2(g[i], up[i]);
}

/* float32 directly; the 16-bit dtypes through float32 chunks (bn_load_floats), which for float16
 * are 2-3x faster than converting one element at a time. */
void bn_cpu_glu_span(int32_t dtype, int32_t activation, const void *gate_up, int64_t gate, int64_t F,
                     int64_t n, void *out, int64_t out_offset) {
    if (dtype == BITNET_DTYPE_F32) {
        const float *g = (const float *)gate_up + gate;
        gate_floats(activation, g, g + F, n, (float *)out + out_offset);
        return;
    }
    enum { CHUNK = 256 };
    float g[CHUNK], up[CHUNK];
    for (int64_t c = 0; c < n; c += CHUNK) {
        const int64_t len = n - c < CHUNK ? n - c : CHUNK;
        bn_load_floats(dtype, gate_up, gate + c, len, g);
        bn_load_floats(dtype, gate_up, gate + F + c, len, up);
        gate_floats(activation, g, up, len, g);
        bn_store_floats(dtype, g, len, out, out_offset + c);
    }
}

bitnet_status bn_cpu_glu_gate(int32_t dtype, int64_t T, int64_t F, int32_t activation,
                              const void *gate_up, void *out) {
#pragma omp parallel for schedule(static) if (T * F >= BN_CPU_PARALLEL_MIN_WORK)
    for (int64_t t = 0; t < T; t++)
        bn_cpu_glu_span(dtype, activation, gate_up, t * 2 * F, F, F, out, t * F);
    return BITNET_OK;
}
