/* The arithmetic of the RMSNorm kernels (rmsnorm.cu) that another kernel must repeat exactly to give
 * bitnet_rmsnorm's results bit for bit: the float32 sum of squares and max |v * w| of a row, their
 * reduction over a warp, 1 / RMS, the int8 codes, and the register layout that fixes the order of
 * the sum (register_layout). Shared by rmsnorm.cu and rmsnorm_gemv_w2a8.cu. */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <float.h>

#include "common.cuh"

namespace {

constexpr int WARP_ROWS_PER_BLOCK = 4; /* warp-per-row kernels: 128 threads */
constexpr int WARP_MAX_V = 12;         /* a warp per row up to 32 * 12 vectors */
/* Rows that a warp could hold (up to 32 * WARP_MAX_V vectors) take a warp per row from
 * WARP_MIN_ROWS_PER_SM rows per SM. From BLOCK_NARROW_MIN_ROWS_PER_SM they take a block per row of
 * 2 vectors per thread: at T = 4096, H = 2560 (31 rows per SM on an H100) that reached 86% of
 * read bandwidth, against 84-85% with a warp per row, whose 10 vectors per thread leave room for
 * only 16 rows per SM. Fewer rows are bound by the latency of one row, which more threads per row
 * (BLOCK_PREFERRED_THREADS) cut. */
constexpr int WARP_MIN_ROWS_PER_SM = 64;
constexpr int BLOCK_NARROW_MIN_ROWS_PER_SM = 4;
constexpr int BLOCK_PREFERRED_THREADS = 320;
constexpr int BLOCK_MAX_THREADS = 512;
constexpr int BLOCK_MAX_V = 8; /* a block per row up to 512 * 8 vectors */
constexpr int LOOP_THREADS = 512;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

/* N consecutive elements, loaded and stored as one access (16 bytes for the vector paths). */
template <typename T, int N> struct alignas(sizeof(T) * N) Pack {
    T e[N];
};

template <typename T, int N> __device__ __forceinline__ Pack<T, N> load(const void *base, int64_t i) {
    return *reinterpret_cast<const Pack<T, N> *>(static_cast<const T *>(base) + i);
}

template <typename T, int N>
__device__ __forceinline__ void store(void *base, int64_t i, const Pack<T, N> &p) {
    *reinterpret_cast<Pack<T, N> *>(static_cast<T *>(base) + i) = p;
}

/* The gated input: bn_relu2(gate, up) rounded to T, as bitnet_relu2_gate stores it. */
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> relu2_gate(const Pack<T, N> &gate, const Pack<T, N> &up) {
    Pack<T, N> v;
#pragma unroll
    for (int j = 0; j < N; j++) v.e[j] = from_float<T>(bn_relu2(to_float(gate.e[j]), to_float(up.e[j])));
    return v;
}


struct SumMax {
    float sum, max;
};

/* max(a, b), or NaN if either is NaN (fmaxf returns the other operand). */
__device__ __forceinline__ float max_or_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    float m;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
    return m;
#else
    return isnan(a) || isnan(b) ? __int_as_float(0x7fffffff) : fmaxf(a, b);
#endif
}

/* The sum of squares and max |p|; the max is NaN if any p is, so that a finite max says that every
 * product of the row is finite. */
__device__ __forceinline__ SumMax combine(SumMax a, SumMax b) { return {a.sum + b.sum, max_or_nan(a.max, b.max)}; }
__device__ __forceinline__ double combine(double a, double b) { return a + b; }
__device__ __forceinline__ SumMax shuffle_xor(SumMax v, int lane_mask) {
    return {__shfl_xor_sync(0xffffffffu, v.sum, lane_mask), __shfl_xor_sync(0xffffffffu, v.max, lane_mask)};
}
__device__ __forceinline__ double shuffle_xor(double v, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}

template <typename A> __device__ __forceinline__ A warp_reduce(A v) {
#pragma unroll
    for (int m = 16; m > 0; m /= 2) v = combine(v, shuffle_xor(v, m));
    return v;
}


template <typename T, int N> __device__ __forceinline__ double sum_squares64(const Pack<T, N> &v) {
    double sum = 0.0;
#pragma unroll
    for (int j = 0; j < N; j++) sum += (double)to_float(v.e[j]) * to_float(v.e[j]);
    return sum;
}

/* Adds v^2 to the sum of squares, sets p = (v * pre) * w and, for the codes, takes max |p|. pre is
 * 1 but for a tiny row (rmsnorm_loop). */
template <int N, bool QUANT>
__device__ __forceinline__ void accumulate(SumMax &acc, const float (&v)[N], const float (&w)[N],
                                           float (&p)[N], float pre = 1.0f) {
#pragma unroll
    for (int j = 0; j < N; j++) {
        p[j] = v[j] * pre * w[j];
        acc.sum += v[j] * v[j];
        if (QUANT) acc.max = max_or_nan(acc.max, fabsf(p[j]));
    }
}
template <typename T, int N, bool QUANT>
__device__ __forceinline__ void accumulate(SumMax &acc, const Pack<T, N> &v, const Pack<T, N> &w,
                                           float (&p)[N], float pre = 1.0f) {
    float vf[N], wf[N];
#pragma unroll
    for (int j = 0; j < N; j++) vf[j] = to_float(v.e[j]), wf[j] = to_float(w.e[j]);
    accumulate<N, QUANT>(acc, vf, wf, p, pre);
}


/* max |p| over the products that are not NaN: the scale's rule (NaN codes are -128). */
template <int N> __device__ __forceinline__ float max_abs_of_numbers(float m, const float (&p)[N]) {
#pragma unroll
    for (int j = 0; j < N; j++) m = fmaxf(m, fabsf(p[j]));
    return m;
}


/* 1 / sqrt(mean + eps) from the float32 sum of squares; where that mean square is not a normal
 * float (the sum overflowed, or underflowed with eps too small to dominate), from a float64 sum of
 * the same values, which sum_squares64() gives (a reduction over the row's threads). With eps > 0
 * the result is at most 1 / sqrt(2^-149), a float; with eps = 0 it may not be (tiny_row_scale). */
template <typename F>
__device__ __forceinline__ double inverse_rms(float sum, int64_t cols, float eps, F sum_squares64) {
    const float mean_square = sum / (float)cols + eps;
    if (mean_square >= FLT_MIN && mean_square <= FLT_MAX) return 1.0f / sqrtf(mean_square);
    return 1.0 / sqrt(sum_squares64() / (double)cols + (double)eps);
}

/* The int8 code of the product p: rint(clamp(p * r_scale, -128, 127)). FINITE: every product of the
 * row is finite, so the clamp cannot bind (|p| <= max |p|) and is left out; otherwise it is there
 * for NaN, which fmaxf turns into -128 exactly as the CPU backend does. rint(c) for |c| <= 2^22 is
 * in the low bits of c + 1.5 * 2^23 (the addition rounds half to even), and its int8 in the low
 * byte: cheaper than a float-to-int conversion. */
template <bool FINITE> __device__ __forceinline__ int8_t int8_code(float p, float r_scale) {
    const float c = FINITE ? p * r_scale : fminf(fmaxf(p * r_scale, -128.0f), 127.0f);
    return (int8_t)__float_as_uint(__fadd_rn(c, 12582912.0f));
}

/* Vectors per thread that have a kernel: up to WARP_MAX_V with a warp per row, BLOCK_MAX_V with a
 * block per row. */
constexpr int V_CHOICES[] = {1, 2, 3, 4, 6, 8, 10, 12};

/* The fewest vectors per thread (a V_CHOICES entry) covering `needed`, or 0 if none does. */
inline int smallest_v(int64_t needed) {
    for (int v : V_CHOICES)
        if (v >= needed) return v;
    return 0;
}

/* How rmsnorm_registers holds rows of `vectors` 16-byte vectors: thread `lane` of a row's
 * row_threads holds the vectors k * row_threads + lane, k < v, and the row's sums are reduced over
 * those threads in a fixed order (row_reduce). That order sets the float32 sum of squares, so a
 * kernel that must match bitnet_rmsnorm bit for bit (rmsnorm_gemv_w2a8.cu) takes the same layout.
 * Returns false where the rows take rmsnorm_loop instead (too long for registers). */
struct RegisterLayout {
    bool warp_per_row;
    int v, row_threads;
};
inline bool register_layout(int64_t vectors, int64_t rows, int sms, bool residual, RegisterLayout *out) {
    const bool warp_sized = vectors <= 32 * WARP_MAX_V; /* a warp could hold a row */
    /* With the residual's second stream of loads, a block per row was faster at every T. */
    if (!residual && warp_sized && rows >= (int64_t)WARP_MIN_ROWS_PER_SM * sms) {
        *out = {true, smallest_v((vectors + 31) / 32), 32};
        return true;
    }
    if (vectors > (int64_t)BLOCK_MAX_THREADS * BLOCK_MAX_V) return false;
    const bool narrow = warp_sized && rows >= (int64_t)BLOCK_NARROW_MIN_ROWS_PER_SM * sms;
    int v = narrow ? 2 : smallest_v((vectors + BLOCK_PREFERRED_THREADS - 1) / BLOCK_PREFERRED_THREADS);
    if (v == 0 || v > BLOCK_MAX_V) v = BLOCK_MAX_V;
    *out = {false, v, (int)(((vectors + v - 1) / v + 31) / 32 * 32)};
    return true;
}

}  // namespace
