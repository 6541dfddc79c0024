/* CPU row-wise argmax with numpy's rules: the first maximum, a NaN beating every number. */
#include <math.h>

#include "../internal.h"

bitnet_status bn_cpu_argmax(const float *x, int64_t N, int64_t M, int32_t *index) {
#pragma omp parallel for schedule(static) if (N * M >= BN_CPU_PARALLEL_MIN_WORK)
    for (int64_t n = 0; n < N; n++) {
        const float *row = x + n * M;
        int64_t best = 0;
        for (int64_t m = 1; m < M && !isnan(row[best]); m++)
            if (isnan(row[m]) || row[m] > row[best]) best = m;
        index[n] = (int32_t)best;
    }
    return BITNET_OK;
}
