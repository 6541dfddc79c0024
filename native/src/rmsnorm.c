/* bitnet_rmsnorm, bitnet_glu_rmsnorm and its squared-ReLU form bitnet_relu2_rmsnorm, and the split
 * rows' halves bitnet_rmsnorm_partial / bitnet_glu_rmsnorm_partial: argument checks (one shared
 * routine), then the CPU or CUDA backend. */
#include <math.h>
#include <stdio.h>

#include "internal.h"

/* What differs between the entry points: the function's name, the input read per row, x [T, H] or
 * (gated) gate_up [T, 2F] with the width called F, and whether the weight may be NULL (no norm). */
typedef struct {
    const char *fn;
    int gated;
    int weight_optional;
} norm_op;

/* Every check of the entry points. `in` is x, or gate_up when gated; residual is NULL when gated;
 * sumsq is given by the partial ones only (with y NULL and y_q required). */
static bitnet_status check_norm(const norm_op *op, int32_t device, int32_t dtype, int64_t T,
                                int64_t H, const void *in, const void *residual, const void *weight,
                                float eps, const void *y, const int8_t *y_q, const float *y_scales,
                                const float *sumsq) {
    const char *fn = op->fn, *in_name = op->gated ? "gate_up" : "x", *width = op->gated ? "F" : "H";
    const int64_t factor = op->gated ? 2 : 1; /* input elements per output element */
    BN_TRY(bn_check_device(device));
    BN_CHECK(dtype == BITNET_DTYPE_F32 || dtype == BITNET_DTYPE_F16 || dtype == BITNET_DTYPE_BF16,
             "%s: dtype %d (%s) is not float32, float16 or bfloat16", fn, dtype,
             bn_dtype_name(dtype));
    BN_CHECK(T >= 1 && H >= 1, "%s: T and %s must be >= 1, got T=%lld, %s=%lld", fn, width,
             (long long)T, width, (long long)H);
    BN_CHECK(H <= INT64_MAX / factor && T <= INT64_MAX / (factor * H),
             "%s: T*%s%s overflows (T=%lld, %s=%lld)", fn, op->gated ? "2" : "", width,
             (long long)T, width, (long long)H);
    const int64_t size = bn_dtype_size(dtype), in_cols = factor * H;
    char name[64];
    snprintf(name, sizeof name, "%s: %s", fn, in_name);
    BN_TRY(bn_check_size(name, T * in_cols, size));
    BN_CHECK(isfinite(eps) && eps >= 0.0f, "%s: eps must be finite and >= 0, got %g", fn,
             (double)eps);
    BN_CHECK(y || y_q, "%s: y and y_q are both NULL; ask for at least one output", fn);
    BN_CHECK(!y_q == !y_scales, "%s: y_q and y_scales go together (y_q %s, y_scales %s)", fn,
             y_q ? "given" : "NULL", y_scales ? "given" : "NULL");

    /* Only y == x may overlap (not y == gate_up: a row of y would overwrite gate_up rows other
     * rows still read). */
    const int64_t bytes = T * H * size;
    const bn_array arrays[] = {{in_name, in, T * in_cols * size, size, BN_READ},
                               {"weight", weight, H * size, size,
                                BN_READ | (op->weight_optional ? BN_OPTIONAL : 0)},
                               {"residual", residual, bytes, size, BN_WRITTEN | BN_OPTIONAL},
                               {"y", y, bytes, size,
                                BN_WRITTEN | BN_OPTIONAL | (op->gated ? 0 : BN_MAY_EQUAL(0))},
                               {"y_q", y_q, T * H, 1, BN_WRITTEN | BN_OPTIONAL},
                               {"y_scales", y_scales, T * 4, 4, BN_WRITTEN | BN_OPTIONAL},
                               {"sumsq", sumsq, T * 4, 4, BN_WRITTEN | BN_OPTIONAL}};
    return bn_check_arrays(fn, device, arrays, BN_COUNT(arrays),
                           op->gated ? "no arrays may overlap" : "only y == x, in place, is allowed");
}

bitnet_status bitnet_rmsnorm(int32_t device, int32_t dtype, int64_t T, int64_t H, const void *x,
                             void *residual, const void *weight, float eps, void *y, int8_t *y_q,
                             float *y_scales, void *stream) {
    static const norm_op op = {"bitnet_rmsnorm", 0, 0};
    BN_TRY(check_norm(&op, device, dtype, T, H, x, residual, weight, eps, y, y_q, y_scales, NULL));
    return device == BITNET_DEVICE_CPU
               ? bn_cpu_rmsnorm(dtype, T, H, x, residual, weight, eps, y, y_q, y_scales)
               : BN_CUDA(bn_cuda_rmsnorm(device, dtype, T, H, x, residual, weight, eps, y, y_q,
                                         y_scales, stream));
}

static bitnet_status glu_rmsnorm(const norm_op *op, int32_t device, int32_t dtype, int64_t T,
                                 int64_t F, int32_t activation, const void *gate_up,
                                 const void *weight, float eps, void *y, int8_t *y_q,
                                 float *y_scales, void *stream) {
    BN_TRY(bn_check_activation(op->fn, activation));
    BN_TRY(check_norm(op, device, dtype, T, F, gate_up, NULL, weight, eps, y, y_q, y_scales, NULL));
    BN_CHECK(weight || y_q, "%s: without a weight (no norm) y is the gate alone: ask for y_q too, "
             "or call bitnet_glu_gate", op->fn);
    return device == BITNET_DEVICE_CPU
               ? bn_cpu_glu_rmsnorm(dtype, T, F, activation, gate_up, weight, eps, y, y_q, y_scales)
               : BN_CUDA(bn_cuda_glu_rmsnorm(device, dtype, T, F, activation, gate_up, weight, eps,
                                             y, y_q, y_scales, stream));
}

bitnet_status bitnet_glu_rmsnorm(int32_t device, int32_t dtype, int64_t T, int64_t F,
                                 int32_t activation, const void *gate_up, const void *weight,
                                 float eps, void *y, int8_t *y_q, float *y_scales, void *stream) {
    static const norm_op op = {"bitnet_glu_rmsnorm", 1, 1};
    return glu_rmsnorm(&op, device, dtype, T, F, activation, gate_up, weight, eps, y, y_q, y_scales,
                       stream);
}

bitnet_status bitnet_relu2_rmsnorm(int32_t device, int32_t dtype, int64_t T, int64_t F,
                                   const void *gate_up, const void *weight, float eps, void *y,
                                   int8_t *y_q, float *y_scales, void *stream) {
    static const norm_op op = {"bitnet_relu2_rmsnorm", 1, 0};
    return glu_rmsnorm(&op, device, dtype, T, F, BITNET_ACTIVATION_RELU2, gate_up, weight, eps, y,
                       y_q, y_scales, stream);
}

/* Both partial entry points: activation -1 for x [T, H], else gate_up [T, 2H]. No eps (the
 * division is the caller's): the shared checks get 1. */
static bitnet_status rmsnorm_partial(const norm_op *op, int32_t device, int32_t dtype, int64_t T,
                                     int64_t H, int32_t activation, const void *x,
                                     const void *weight, int8_t *y_q, float *y_scales, float *sumsq,
                                     void *stream) {
    if (op->gated) BN_TRY(bn_check_activation(op->fn, activation));
    BN_CHECK(y_q && y_scales && sumsq, "%s: %s is NULL", op->fn,
             !y_q ? "y_q" : !y_scales ? "y_scales" : "sumsq");
    BN_TRY(check_norm(op, device, dtype, T, H, x, NULL, weight, 1.0f, NULL, y_q, y_scales, sumsq));
    return device == BITNET_DEVICE_CPU
               ? bn_cpu_rmsnorm_partial(dtype, T, H, activation, x, weight, y_q, y_scales, sumsq)
               : BN_CUDA(bn_cuda_rmsnorm_partial(device, dtype, T, H, activation, x, weight, y_q,
                                                 y_scales, sumsq, stream));
}

bitnet_status bitnet_rmsnorm_partial(int32_t device, int32_t dtype, int64_t T, int64_t H,
                                     const void *x, const void *weight, int8_t *y_q,
                                     float *y_scales, float *sumsq, void *stream) {
    static const norm_op op = {"bitnet_rmsnorm_partial", 0, 0};
    return rmsnorm_partial(&op, device, dtype, T, H, -1, x, weight, y_q, y_scales, sumsq, stream);
}

bitnet_status bitnet_glu_rmsnorm_partial(int32_t device, int32_t dtype, int64_t T, int64_t F,
                                         int32_t activation, const void *gate_up,
                                         const void *weight, int8_t *y_q, float *y_scales,
                                         float *sumsq, void *stream) {
    static const norm_op op = {"bitnet_glu_rmsnorm_partial", 1, 0};
    return rmsnorm_partial(&op, device, dtype, T, F, activation, gate_up, weight, y_q, y_scales,
                           sumsq, stream);
}
