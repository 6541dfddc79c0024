/* CPU ternary weight quantization (quantize_i2s), int8 activation quantization (quantize_a8) and
 * the packing of ternary values (docs/weight_format.md). OpenMP over rows. The float32 arithmetic
 * (division, multiplication, rintf = round half to even) matches the CUDA backend bit for bit. */
#include <math.h>

#include "internal.h"

enum { CHUNK = 256 }; /* elements of a row converted to float32 at a time (a multiple of 16) */

/* Weight 16g+4i+b of a row goes to byte 4g+b, bits 2i..2i+1, as code = value + 1. */
static void pack_word(const int8_t values[16], uint8_t *bytes) {
    for (int b = 0; b < 4; b++) {
        uint8_t byte = 0;
        for (int i = 0; i < 4; i++) byte |= (uint8_t)((values[4 * i + b] + 1) << (2 * i));
        bytes[b] = byte;
    }
}

/* The clamps are fmaxf then fminf, as on the GPU: a NaN becomes the lower bound on both. */
static int8_t quantize_weight(float w, float scale) {
    return (int8_t)fminf(fmaxf(rintf(w / scale), -1.0f), 1.0f);
}

/* True where a float of `dtype` held in `bits` is NaN or ±inf: all its exponent bits are set. */
static inline int non_finite_bits(uint32_t bits, uint32_t exponent) { return (bits & exponent) == exponent; }

/* The first column of row `row` of w [M, K] that is NaN or ±inf, or -1. A chunk is first tested
 * as a whole (a loop the compiler vectorizes), and searched only where it holds one. */
static int64_t first_non_finite_in_row(const void *w, int32_t dtype, int64_t row, int64_t K) {
    const int wide = dtype == BITNET_DTYPE_F32;
    const uint32_t exponent = wide ? 0x7f800000u : dtype == BITNET_DTYPE_F16 ? 0x7c00u : 0x7f80u;
    const uint32_t *w32 = (const uint32_t *)w + row * K;
    const uint16_t *w16 = (const uint16_t *)w + row * K;
    for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
        const int64_t n = K - k0 < CHUNK ? K - k0 : CHUNK;
        int any = 0;
        if (wide)
            for (int64_t k = k0; k < k0 + n; k++) any |= non_finite_bits(w32[k], exponent);
        else
            for (int64_t k = k0; k < k0 + n; k++) any |= non_finite_bits(w16[k], exponent);
        if (!any) continue;
        for (int64_t k = k0; k < k0 + n; k++)
            if (non_finite_bits(wide ? w32[k] : w16[k], exponent)) return k;
    }
    return -1;
}

bitnet_status bn_cpu_quantize_i2s(const void *w, int32_t w_dtype, int64_t M, int64_t K,
                                  const int64_t *row_segments, int64_t n_segments,
                                  uint8_t *w_packed, float *w_scales) {
    /* Weights must be finite: checked before anything is written. */
    int64_t first = INT64_MAX;
#pragma omp parallel for schedule(static) reduction(min : first) \
    if (M * K >= BN_CPU_PARALLEL_MIN_WORK)
    for (int64_t m = 0; m < M; m++) {
        const int64_t k = m * K < first ? first_non_finite_in_row(w, w_dtype, m, K) : -1;
        if (k >= 0 && m * K + k < first) first = m * K + k;
    }
    if (first != INT64_MAX) {
        float value;
        bn_load_floats(w_dtype, w, first, 1, &value);
        return bn_fail_non_finite_weight(first, K, value);
    }
    /* Row sums of |w| in float64, kept in w_packed (M * 8 <= M * K / 4 bytes) until the codes
     * overwrite them, so that segment sums are added in one fixed order. */
    double *row_sums = (double *)(void *)w_packed;
#pragma omp parallel for schedule(static) if (M * K >= BN_CPU_PARALLEL_MIN_WORK)
    for (int64_t m = 0; m < M; m++) {
        double sum = 0.0;
        float chunk[CHUNK];
        for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
            const int64_t n = K - k0 < CHUNK ? K - k0 : CHUNK;
            bn_load_floats(w_dtype, w, m * K + k0, n, chunk);
            for (int64_t k = 0; k < n; k++) sum += fabs((double)chunk[k]);
        }
        row_sums[m] = sum;
    }
    int64_t row = 0;
    for (int64_t s = 0; s < n_segments; s++) {
        int64_t rows = row_segments ? row_segments[s] : M;
        double sum = 0.0;
        for (int64_t m = row; m < row + rows; m++) sum += row_sums[m];
        double mean = sum / ((double)rows * (double)K);
        float scale = (float)(mean > 1e-5 ? mean : 1e-5);
        for (int64_t m = row; m < row + rows; m++) w_scales[m] = scale;
        row += rows;
    }
#pragma omp parallel for schedule(static) if (M * K >= BN_CPU_PARALLEL_MIN_WORK)
    for (int64_t m = 0; m < M; m++) {
        float chunk[CHUNK];
        for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
            const int64_t n = K - k0 < CHUNK ? K - k0 : CHUNK;
            bn_load_floats(w_dtype, w, m * K + k0, n, chunk);
            for (int64_t j0 = 0; j0 < n; j0 += 16) {
                int8_t values[16];
                for (int j = 0; j < 16; j++)
                    values[j] = quantize_weight(chunk[j0 + j], w_scales[m]);
                pack_word(values, w_packed + (m * K + k0 + j0) / 4);
            }
        }
    }
    return BITNET_OK;
}

bitnet_status bn_cpu_pack_ternary(const int8_t *w_q, int64_t M, int64_t K, uint8_t *w_packed) {
    int64_t count = M * K, bad = INT64_MAX; /* the first value that is not ternary */
#pragma omp parallel for schedule(static) reduction(min : bad) \
    if (count >= BN_CPU_PARALLEL_MIN_WORK)
    for (int64_t i = 0; i < count; i++)
        if (w_q[i] < -1 || w_q[i] > 1) bad = i < bad ? i : bad;
    if (bad != INT64_MAX)
        return bn_fail(BITNET_ERR_INVALID_ARGUMENT, "bitnet_pack_ternary: w_q[%lld, %lld] = %d is "
                       "not -1, 0 or 1", (long long)(bad / K), (long long)(bad % K), w_q[bad]);
#pragma omp parallel for schedule(static) if (count >= BN_CPU_PARALLEL_MIN_WORK)
    for (int64_t i = 0; i < count; i += 16) pack_word(w_q + i, w_packed + i / 4);
    return BITNET_OK;
}

bitnet_status bn_cpu_unpack_ternary(const uint8_t *w_packed, int64_t M, int64_t K, int8_t *w_q) {
    int64_t count = M * K;
#pragma omp parallel for schedule(static) if (count >= BN_CPU_PARALLEL_MIN_WORK)
    for (int64_t i = 0; i < count; i += 16)
        for (int i2 = 0; i2 < 4; i2++)
            for (int b = 0; b < 4; b++)
                w_q[i + 4 * i2 + b] = (int8_t)(((w_packed[i / 4 + b] >> (2 * i2)) & 3) - 1);
    return BITNET_OK;
}

bitnet_status bn_cpu_quantize_a8(const void *x, int32_t x_dtype, int64_t N, int64_t K, int8_t *x_q,
                                 float *x_scales) {
#pragma omp parallel for schedule(static) if (N * K >= BN_CPU_PARALLEL_MIN_WORK)
    for (int64_t n = 0; n < N; n++) {
        float max_abs = 0.0f, chunk[CHUNK];
        for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
            const int64_t len = K - k0 < CHUNK ? K - k0 : CHUNK;
            bn_load_floats(x_dtype, x, n * K + k0, len, chunk);
            for (int64_t k = 0; k < len; k++) max_abs = bn_max_or_nan(max_abs, fabsf(chunk[k]));
        }
        /* A row holding a NaN or ±inf gets the scale NaN, and so codes -128 (fmaxf(NaN, -128)):
         * its GEMV outputs are NaN. */
        float scale = isfinite(max_abs) ? 127.0f / fmaxf(max_abs, 1e-5f) : NAN;
        for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
            const int64_t len = K - k0 < CHUNK ? K - k0 : CHUNK;
            bn_load_floats(x_dtype, x, n * K + k0, len, chunk);
            for (int64_t k = 0; k < len; k++) {
                float q = rintf(chunk[k] * scale);
                x_q[n * K + k0 + k] = (int8_t)fminf(fmaxf(q, -128.0f), 127.0f);
            }
        }
        x_scales[n] = scale;
    }
    return BITNET_OK;
}
