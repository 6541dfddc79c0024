/* Public entry of sampling on the device (docs/sampling.md): argument checks, then the argmax for
 * temperature 0, else cpu/sample.c or cuda/sample.cu. */
#include <math.h>

#include "internal.h"

bitnet_status bitnet_sample(int32_t device, const float *logits, int64_t N, int64_t V,
                            uint64_t seed, const int32_t *counters, float temperature,
                            int32_t top_k, float top_p, int32_t *index, void *stream) {
    static const char fn[] = "bitnet_sample";
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_matrix("bitnet_sample: logits", N, V, 4));
    BN_CHECK(V <= INT32_MAX, "%s: V = %lld does not fit the int32 index", fn, (long long)V);
    BN_CHECK(isfinite(temperature) && temperature >= 0.0f,
             "%s: temperature must be finite and >= 0 (0: argmax), got %g", fn, (double)temperature);
    BN_CHECK(top_k >= 0 && top_k <= BN_SAMPLE_MAX_CANDIDATES,
             "%s: top_k must be in [0, %d] (0: off), got %d", fn, BN_SAMPLE_MAX_CANDIDATES, top_k);
    BN_CHECK(top_p > 0.0f && top_p <= 1.0f, "%s: top_p must be in (0, 1] (1: off), got %g", fn,
             (double)top_p);
    const bn_array arrays[] = {{"logits", logits, N * V * 4, 4, BN_READ},
                               {"counters", counters, N * 4, 4, BN_READ},
                               {"index", index, N * 4, 4, BN_WRITTEN}};
    BN_CHECK_ARRAYS(fn, device, arrays, BN_NO_OVERLAP);
    if (temperature == 0.0f)
        return device == BITNET_DEVICE_CPU
                   ? bn_cpu_argmax(logits, N, V, index)
                   : BN_CUDA(bn_cuda_argmax(device, logits, N, V, index, stream));
    return device == BITNET_DEVICE_CPU
               ? bn_cpu_sample(logits, N, V, seed, counters, temperature, top_k, top_p, index)
               : BN_CUDA(bn_cuda_sample(device, logits, N, V, seed, counters, temperature, top_k,
                                        top_p, index, stream));
}
