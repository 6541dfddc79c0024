/* bitnet_rmsnorm: argument checks, then the CPU or CUDA backend. */
#include <math.h>

#include "internal.h"

typedef struct {
    const char *name;
    const void *ptr; /* NULL: not given */
    int64_t bytes;
    int written;
} buffer;

static int overlap(const buffer *a, const buffer *b) {
    uintptr_t pa = (uintptr_t)a->ptr, pb = (uintptr_t)b->ptr;
    return a->ptr && b->ptr && pa < pb + (uintptr_t)b->bytes && pb < pa + (uintptr_t)a->bytes;
}

bitnet_status bitnet_rmsnorm(int32_t device, int32_t dtype, int64_t T, int64_t H, const void *x,
                             void *residual, const void *weight, float eps, void *y, int8_t *y_q,
                             float *y_scales, void *stream) {
    BN_TRY(bn_check_device(device));
    BN_CHECK(dtype == BITNET_DTYPE_F32 || dtype == BITNET_DTYPE_F16 || dtype == BITNET_DTYPE_BF16,
             "bitnet_rmsnorm: dtype %d (%s) is not float32, float16 or bfloat16", dtype,
             bn_dtype_name(dtype));
    BN_CHECK(T >= 1 && H >= 1, "bitnet_rmsnorm: T and H must be >= 1, got T=%lld, H=%lld",
             (long long)T, (long long)H);
    BN_CHECK(T <= INT64_MAX / H, "bitnet_rmsnorm: T*H overflows (T=%lld, H=%lld)", (long long)T,
             (long long)H);
    const int64_t size = bn_dtype_size(dtype);
    BN_TRY(bn_check_size("bitnet_rmsnorm: x", T * H, size));
    BN_CHECK(isfinite(eps) && eps >= 0.0f, "bitnet_rmsnorm: eps must be finite and >= 0, got %g",
             (double)eps);
    BN_CHECK(y || y_q, "bitnet_rmsnorm: y and y_q are both NULL; ask for at least one output");
    BN_CHECK(!y_q == !y_scales, "bitnet_rmsnorm: y_q and y_scales go together (y_q %s, y_scales %s)",
             y_q ? "given" : "NULL", y_scales ? "given" : "NULL");

    BN_TRY(bn_check_pointer(device, x, size, "bitnet_rmsnorm: x"));
    BN_TRY(bn_check_pointer(device, weight, size, "bitnet_rmsnorm: weight"));
    if (residual) BN_TRY(bn_check_pointer(device, residual, size, "bitnet_rmsnorm: residual"));
    if (y) BN_TRY(bn_check_pointer(device, y, size, "bitnet_rmsnorm: y"));
    if (y_q) {
        BN_TRY(bn_check_pointer(device, y_q, 1, "bitnet_rmsnorm: y_q"));
        BN_TRY(bn_check_pointer(device, y_scales, sizeof(float), "bitnet_rmsnorm: y_scales"));
    }

    /* Every pair of arrays with one of them written must be disjoint; only y == x is allowed. */
    const int64_t bytes = T * H * size;
    const buffer buffers[] = {{"x", x, bytes, 0},           {"weight", weight, H * size, 0},
                              {"residual", residual, bytes, 1}, {"y", y, bytes, 1},
                              {"y_q", y_q, T * H, 1},       {"y_scales", y_scales, T * 4, 1}};
    const int n = (int)(sizeof buffers / sizeof *buffers);
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++) {
            const buffer *a = &buffers[i], *b = &buffers[j];
            int in_place = i == 0 && j == 3 && x == y;
            BN_CHECK(!(a->written || b->written) || in_place || !overlap(a, b),
                     "bitnet_rmsnorm: %s and %s overlap (only y == x, in place, is allowed)",
                     a->name, b->name);
        }

    return device == BITNET_DEVICE_CPU
               ? bn_cpu_rmsnorm(dtype, T, H, x, residual, weight, eps, y, y_q, y_scales)
               : BN_CUDA(bn_cuda_rmsnorm(device, dtype, T, H, x, residual, weight, eps, y, y_q,
                                         y_scales, stream));
}
