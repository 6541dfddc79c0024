/* CPU backend of bitnet_rmsnorm and bitnet_glu_rmsnorm. Rows run in parallel (OpenMP); each row
 * is read in chunks that are converted to float32 and worked on in LANES partial sums the compiler
 * vectorizes. Passes over a row: (1) residual add and store, sum of squares and max |v*w|; (1b)
 * only where the float32 mean square is not a normal float: the sum again in float64; (2) y and/or
 * the int8 codes. Gated (bitnet_glu_rmsnorm), every pass computes its chunk of v from the gate_up
 * row with bn_cpu_glu_span, rounded to the dtype as bitnet_glu_gate stores it; without a weight,
 * the weights are ones and 1 / RMS is 1 (no norm: y = v, the codes quantize_a8's). Partial
 * (bitnet_rmsnorm_partial): 1 / RMS is 1 with the weight applied, and the float32 sum of squares is
 * written per row. */
#include <float.h>
#include <math.h>

#include "../internal.h"

enum { CHUNK = 256, LANES = BN_CPU_NORM_LANES };
/* A row whose 1 / RMS is beyond float32 is normalized as v * TINY_ROW_SCALE (norm_row). */
static const float TINY_ROW_SCALE = 0x1p64f;

typedef struct {
    int32_t dtype;
    int64_t H;
    int gated;     /* x is gate_up [T, 2H] and v = glu_gate(x, activation) */
    int32_t activation;
    const void *x;
    void *residual;
    const void *weight; /* NULL: no norm (gated only) */
    float eps;
    void *y;
    int8_t *y_q;
    float *y_scales;
    float *sumsq; /* not NULL: partial (no division by the RMS) */
} norm_args;

/* v[0..n) = elements [c, c+n) of row `row` of the values normalized as float32: x, the residual
 * (after pass 1 stored it), or gated, the gate of the gate_up row stored in the dtype and read back. */
static void load_v(const norm_args *a, int64_t row, int64_t c, int n, float *v) {
    if (a->gated) {
        union { float f32[CHUNK]; uint16_t u16[CHUNK]; } stored;
        bn_cpu_glu_span(a->dtype, a->activation, a->x, row * 2 * a->H + c, a->H, n, &stored, 0);
        bn_load_floats(a->dtype, &stored, 0, n, v);
    } else {
        bn_load_floats(a->dtype, a->residual ? a->residual : a->x, row * a->H + c, n, v);
    }
}

/* Loads chunk [c, c+n) of row `row` of v and of the weight, zero-padded to a multiple of LANES. */
static int load_chunk(const norm_args *a, int64_t row, int64_t c, float *v, float *w) {
    int n = (int)(a->H - c < CHUNK ? a->H - c : CHUNK), padded = (n + LANES - 1) / LANES * LANES;
    load_v(a, row, c, n, v);
    if (a->weight)
        bn_load_floats(a->dtype, a->weight, c, n, w);
    else
        for (int i = 0; i < n; i++) w[i] = 1.0f;
    for (int i = n; i < padded; i++) v[i] = w[i] = 0.0f;
    return n;
}

static void norm_row(const norm_args *a, int64_t row) {
    const int64_t H = a->H, base = row * H;
    float v[CHUNK], w[CHUNK], lane_sum[LANES] = {0}, lane_max[LANES] = {0};

    for (int64_t c = 0; c < H; c += CHUNK) {
        if (a->residual) {
            int n = (int)(H - c < CHUNK ? H - c : CHUNK);
            bn_load_floats(a->dtype, a->x, base + c, n, v);
            bn_load_floats(a->dtype, a->residual, base + c, n, w);
            for (int i = 0; i < n; i++) w[i] += v[i];
            bn_store_floats(a->dtype, w, n, a->residual, base + c);
        }
        int n = load_chunk(a, row, c, v, w);
        for (int i = 0; i < n; i += LANES)
            for (int l = 0; l < LANES; l++) {
                float p = fabsf(v[i + l] * w[i + l]);
                lane_sum[l] += v[i + l] * v[i + l];
                lane_max[l] = bn_max_or_nan(lane_max[l], p);
            }
    }
    float sum = 0.0f, max_vw = 0.0f;
    for (int l = 0; l < LANES; l++) {
        sum += lane_sum[l];
        max_vw = bn_max_or_nan(max_vw, lane_max[l]);
    }

    /* Where the float32 mean square is not a normal float, 1 / RMS comes from a float64 sum. An
     * RMS under 2^-128 (only with eps = 0: a positive float32 eps is at least 2^-149) has a
     * reciprocal beyond float32: the products are then taken as (v * pre) * w with pre =
     * TINY_ROW_SCALE, exact, and 1 / RMS is divided by pre (as the CUDA loop kernel does). */
    const float mean_square = sum / (float)H + a->eps;
    float r, pre = 1.0f;
    if (!a->weight || a->sumsq) {
        r = 1.0f;
    } else if (mean_square >= FLT_MIN && mean_square <= FLT_MAX) {
        r = 1.0f / sqrtf(mean_square);
    } else {
        double sum64 = 0.0;
        for (int64_t c = 0; c < H; c += CHUNK) {
            int n = load_chunk(a, row, c, v, w);
            for (int i = 0; i < n; i++) sum64 += (double)v[i] * v[i];
        }
        double r64 = 1.0 / sqrt(sum64 / (double)H + a->eps);
        if (r64 > FLT_MAX) {
            pre = TINY_ROW_SCALE;
            r64 /= TINY_ROW_SCALE;
            max_vw = 0.0f;
            for (int64_t c = 0; c < H; c += CHUNK) {
                int n = load_chunk(a, row, c, v, w);
                for (int i = 0; i < n; i++) max_vw = bn_max_or_nan(max_vw, fabsf(v[i] * pre * w[i]));
            }
        }
        r = (float)r64;
    }
    /* max |y| = max |v * w| * r. Where it is not finite (some y is NaN or ±inf: a non-finite
     * input, or 0 / 0 for an all-zero row with eps = 0) the scale is NaN and every code -128
     * (fmaxf(NaN, -128)), so that what consumes the codes turns NaN too. */
    const float max_y = max_vw * r;
    const float scale = isfinite(max_y) ? 127.0f / fmaxf(max_y, 1e-5f) : NAN, r_scale = r * scale;

    for (int64_t c = 0; c < H; c += CHUNK) {
        int n = load_chunk(a, row, c, v, w);
        if (pre != 1.0f)
            for (int i = 0; i < n; i++) v[i] *= pre;
        for (int i = 0; i < n; i++) v[i] *= w[i]; /* the products v * w */
        if (a->y_q)
            for (int i = 0; i < n; i++)
                a->y_q[base + c + i] = (int8_t)rintf(fminf(fmaxf(v[i] * r_scale, -128.0f), 127.0f));
        if (a->y) {
            for (int i = 0; i < n; i++) v[i] *= r;
            bn_store_floats(a->dtype, v, n, a->y, base + c);
        }
    }
    if (a->y_q) a->y_scales[row] = scale;
    if (a->sumsq) a->sumsq[row] = sum;
}

static bitnet_status norm_rows(const norm_args *a, int64_t T) {
#pragma omp parallel for schedule(static) if (T * a->H >= BN_CPU_PARALLEL_MIN_WORK)
    for (int64_t t = 0; t < T; t++) norm_row(a, t);
    return BITNET_OK;
}

bitnet_status bn_cpu_rmsnorm(int32_t dtype, int64_t T, int64_t H, const void *x, void *residual,
                             const void *weight, float eps, void *y, int8_t *y_q,
                             float *y_scales) {
    const norm_args args = {dtype, H, 0, 0, x, residual, weight, eps, y, y_q, y_scales, NULL};
    return norm_rows(&args, T);
}

bitnet_status bn_cpu_glu_rmsnorm(int32_t dtype, int64_t T, int64_t F, int32_t activation,
                                 const void *gate_up, const void *weight, float eps, void *y,
                                 int8_t *y_q, float *y_scales) {
    const norm_args args = {dtype, F, 1, activation, gate_up, NULL, weight, eps, y, y_q, y_scales,
                            NULL};
    return norm_rows(&args, T);
}

bitnet_status bn_cpu_rmsnorm_partial(int32_t dtype, int64_t T, int64_t H, int32_t activation,
                                     const void *x, const void *weight, int8_t *y_q,
                                     float *y_scales, float *sumsq) {
    const norm_args args = {dtype, H, activation >= 0, activation, x, NULL, weight, 1.0f, NULL,
                            y_q, y_scales, sumsq};
    return norm_rows(&args, T);
}
