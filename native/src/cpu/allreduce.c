/* CPU backend of the peer collectives: a single rank (the CPU has no peers), so the all-reduce is
 * x rounded to y's dtype, and the all-gather a copy. */
#include "../internal.h"

bitnet_status bn_cpu_peer_allreduce(int32_t x_dtype, int32_t y_dtype, int64_t n, const void *x,
                                    void *y) {
    enum { CHUNK = 1024 };
    float row[CHUNK];
    for (int64_t i = 0; i < n; i += CHUNK) {
        const int64_t m = n - i < CHUNK ? n - i : CHUNK;
        bn_load_floats(x_dtype, x, i, m, row);
        bn_store_floats(y_dtype, row, m, y, i);
    }
    return BITNET_OK;
}
