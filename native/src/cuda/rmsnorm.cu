/* RMSNorm, optionally fused with the residual add or the gate of a GLU before it and the int8
 * quantization after it: v = x (or residual += x, as stored; or gated, v = act(gate) * up rounded
 * to the dtype, from gate_up [T, 2H], act relu2 or silu), y = v * w / sqrt(mean(v^2) + eps) (gated
 * without a weight: y = v, no norm), q = rint(y * 127 / max|y|). PARTIAL (bitnet_rmsnorm_partial):
 * y = v * w, not divided by the RMS, and the row's float32 sum of v^2 written to sumsq.
 * Layout: [T, H] row-major. A row lives in registers: one warp per row (the plain norm only: no
 * residual, gate or partial sums; H <= 384 vectors of 16 B, >= 64 rows per SM; 4 rows per block)
 * or else one block per row (<= 4096 vectors); each thread holds V vectors strided by the row's
 * thread count. Other rows (huge H, unaligned rows, any call with eps = 0) take a loop over global
 * memory, twice. Launched with programmatic dependent launch; the register kernels prefetch rows
 * into L2 (NormArgs).
 * Bytes: x read + y written (+ residual read and written, + T*H int8 and 4T scale bytes) + weight;
 * gated, gate_up (twice x) is read instead of x.
 * H100, bf16, H = 2560, L2 cold (BENCHMARKS.md, 2026-11-26): 2974 GB/s at T = 32768 (96% of the
 * read bandwidth), 2706 GB/s at T = 4096 (87%), 1.2 us at T = 1; with the int8 codes 3027 GB/s at
 * T = 32768 and 2446 GB/s at T = 4096 (79%); gated, bf16 codes, F = 6912: 2.23 us at T = 1 and
 * 2862 GB/s at T = 4096. Why each constant has its value: docs/rmsnorm.md's rules and docs/log/. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <float.h>

#include <type_traits>

#include "common.cuh"

namespace {

constexpr int WARP_ROWS_PER_BLOCK = 4; /* warp-per-row kernels: 128 threads */
constexpr int WARP_MAX_V = 12;         /* a warp per row up to 32 * 12 vectors */
/* Rows that a warp could hold (up to 32 * WARP_MAX_V vectors) take a warp per row from
 * WARP_MIN_ROWS_PER_SM rows per SM. From BLOCK_NARROW_MIN_ROWS_PER_SM they take a block per row of
 * 2 vectors per thread: at T = 4096, H = 2560 (31 rows per SM on an H100) that was faster than a
 * warp per row, whose 10 vectors per thread leave room for only 16 rows per SM
 * (docs/log/2026-11-26.md#2026-11-26-5). Fewer rows are bound by the latency of one row, which more threads per row
 * (BLOCK_PREFERRED_THREADS) cut. */
constexpr int WARP_MIN_ROWS_PER_SM = 64;
constexpr int BLOCK_NARROW_MIN_ROWS_PER_SM = 4;
constexpr int BLOCK_PREFERRED_THREADS = 320;
constexpr int BLOCK_MAX_THREADS = 512;
constexpr int BLOCK_MAX_V = 8; /* a block per row up to 512 * 8 vectors */
constexpr int LOOP_THREADS = 512;

struct NormArgs {
    const void *x;
    void *residual;
    const void *weight;
    float eps;
    void *y;
    int8_t *y_q;
    float *y_scales;
    int64_t rows, cols;
    /* L2 prefetches of the input (x or gate_up, and the residual): each block's first row before
     * the PDL wait, and each row's input `prefetch_ahead` rows on (0: none). launch() sets them. */
    bool prefetch_first_row;
    int64_t prefetch_ahead;
    float *sumsq; /* PARTIAL kernels: [rows] */
};

/* Programmatic dependent launch: the kernel waits for the previous kernel on the stream before
 * touching any array, then lets the next kernel launch early. Only launch latency overlaps. */
__device__ __forceinline__ void wait_for_previous_kernel() {
    bn_pdl_wait();
    bn_pdl_launch_dependents();
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

/* GATE, a kernel's input: x (NO_GATE), or gate_up with a bitnet_activation. */
constexpr int NO_GATE = -1;

/* The gated input: bn_glu<GATE>(gate, up) rounded to T, as bitnet_glu_gate stores it. */
template <typename T, int N, int GATE>
__device__ __forceinline__ Pack<T, N> glu_gate(const Pack<T, N> &gate, const Pack<T, N> &up) {
    Pack<T, N> v;
#pragma unroll
    for (int j = 0; j < N; j++) v.e[j] = from_float<T>(bn_glu<GATE>(to_float(gate.e[j]), to_float(up.e[j])));
    return v;
}

/* The N elements of the input v at column i of row `row` of src: src [rows, cols], or gated,
 * glu_gate() of src = gate_up [rows, 2 cols] (the gate at column i, up at cols + i). */
template <typename T, int N, int GATE>
__device__ __forceinline__ Pack<T, N> load_input(const NormArgs &a, const void *src, int64_t row, int64_t i) {
    if constexpr (GATE != NO_GATE) {
        const int64_t gate = row * 2 * a.cols + i;
        return glu_gate<T, N, GATE>(load<T, N>(src, gate), load<T, N>(src, gate + a.cols));
    } else {
        return load<T, N>(src, row * a.cols + i);
    }
}

/* The weights at column i; without the norm (NORM false: no weight), ones. */
template <typename T, int N, bool NORM>
__device__ __forceinline__ Pack<T, N> load_weight(const NormArgs &a, int64_t i) {
    if constexpr (NORM) {
        return load<T, N>(a.weight, i);
    } else {
        Pack<T, N> ones;
#pragma unroll
        for (int j = 0; j < N; j++) ones.e[j] = from_float<T>(1.0f);
        return ones;
    }
}

/* The new residual, residual + x rounded to T: the value stored and normalized. */
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> add_residual(const Pack<T, N> &x, const Pack<T, N> &res) {
    Pack<T, N> sum;
#pragma unroll
    for (int j = 0; j < N; j++) sum.e[j] = from_float<T>(to_float(res.e[j]) + to_float(x.e[j]));
    return sum;
}

/* Hints that `row` of the input (x or gate_up, and the residual) is read soon: one L2 prefetch per
 * 128-byte line, spread over the row's threads. Rows past the end are skipped. An L2 prefetch may
 * be issued before the PDL wait: the previous kernel's writes land in L2, so it cannot make a later
 * load stale. */
template <typename T, bool RESIDUAL, int GATE>
__device__ __forceinline__ void prefetch_row_l2(const NormArgs &a, int64_t row, int lane, int row_threads) {
    if (row >= a.rows) return;
    const int64_t bytes = a.cols * (int64_t)sizeof(T) * (GATE != NO_GATE ? 2 : 1);
    const char *x = static_cast<const char *>(a.x) + row * bytes;
    const char *residual = RESIDUAL ? static_cast<const char *>(a.residual) + row * bytes : nullptr;
    for (int64_t at = (int64_t)lane * 128; at < bytes; at += (int64_t)row_threads * 128) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(x + at));
        if (RESIDUAL) asm volatile("prefetch.global.L2 [%0];" ::"l"(residual + at));
    }
}

struct SumMax {
    float sum, max;
};

/* The sum of squares and max |p|; the max is NaN if any p is, so that a finite max says that every
 * product of the row is finite. */
__device__ __forceinline__ SumMax combine(SumMax a, SumMax b) { return {a.sum + b.sum, bn_fmax_nan(a.max, b.max)}; }
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

/* The reduction over a row's threads, its result in every one of them. */
template <bool WARP_PER_ROW, typename A> __device__ __forceinline__ A row_reduce(A v) {
    v = warp_reduce(v);
    if (WARP_PER_ROW) return v;
    __shared__ A partial[32];
    const int warps = blockDim.x / 32;
    __syncthreads(); /* the previous row's readers are done with `partial` */
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    /* Each warp combines the partials in its lanes: one load and a warp reduction, no loop. */
    const int lane = threadIdx.x % 32;
    return warp_reduce(lane < warps ? partial[lane] : A{});
}

/* 1 / sqrt(mean + eps) from the float32 sum of squares; where that mean square is not a normal
 * float (the sum overflowed, or underflowed with eps too small to dominate), from a float64 sum of
 * the same values, which sum_squares64() gives (a reduction over the row's threads). With eps > 0
 * the result is at most 1 / sqrt(2^-149), a float; with eps = 0 it may not be (tiny_row_scale). */
template <typename F>
__device__ __forceinline__ double inverse_rms(float sum, const NormArgs &a, F sum_squares64) {
    const float mean_square = sum / (float)a.cols + a.eps;
    if (mean_square >= FLT_MIN && mean_square <= FLT_MAX) return 1.0f / sqrtf(mean_square);
    return 1.0 / sqrt(sum_squares64() / (double)a.cols + (double)a.eps);
}

/* With eps = 0, a row whose RMS is under 2^-128 has 1 / RMS beyond float32. Such a row is
 * normalized as the CPU backend does it: the products are taken as (v * 2^64) * w, exact, and
 * 1 / RMS is divided by 2^64. Returns that pre-scale (1 for every other row). Only rmsnorm_loop
 * applies it: launch() gives it every call with eps = 0. */
__device__ __forceinline__ float tiny_row_scale(double r) { return r > FLT_MAX ? 0x1p64f : 1.0f; }

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
        if (QUANT) acc.max = bn_fmax_nan(acc.max, fabsf(p[j]));
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

/* 8 bfloat16 from their 16 raw bytes: one shift or mask each, where a conversion of 16-bit
 * values takes two instructions. */
__device__ __forceinline__ void bf16x8_to_floats(const uint4 &raw, float (&f)[8]) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        f[2 * j] = __uint_as_float(words[j] << 16);
        f[2 * j + 1] = __uint_as_float(words[j] & 0xFFFF0000u);
    }
}

/* The scale 127 / max |y| of a row, from max |p| and r (max |y| = max |p| * r), or NaN where that is
 * not finite (some y is NaN or ±inf: a non-finite input, or 0 / 0 for an all-zero row with
 * eps = 0), so that what consumes the codes turns NaN too. The CPU backend's rule. */
__device__ __forceinline__ float row_scale(float max_p, float r) {
    const float max_y = max_p * r;
    return isfinite(max_y) ? 127.0f / fmaxf(max_y, 1e-5f) : bn_nan();
}

/* y = p * r where asked for, and the codes rint(clamp(p * r * scale, -128, 127)). Where the scale
 * is a number (FINITE) the clamp cannot bind (|p| <= max |p|) and is left out; otherwise it is
 * there for the NaN scale, which fmaxf turns into code -128 exactly as the CPU backend does. */
template <typename T, int N, bool QUANT, bool FINITE = false>
__device__ __forceinline__ void write_outputs(const NormArgs &a, int64_t i, const float (&p)[N], float r,
                                              float r_scale) {
    if (a.y) {
        Pack<T, N> y;
#pragma unroll
        for (int j = 0; j < N; j++) y.e[j] = from_float<T>(p[j] * r);
        store<T, N>(a.y, i, y);
    }
    if (QUANT) {
        /* rint(c) for |c| <= 2^22 is in the low bits of c + 1.5 * 2^23 (the addition rounds half to
         * even), and its int8 in the low byte: cheaper than a float-to-int conversion. */
        Pack<int8_t, N> q;
#pragma unroll
        for (int j = 0; j < N; j++) {
            const float c = FINITE ? p[j] * r_scale : fminf(fmaxf(p[j] * r_scale, -128.0f), 127.0f);
            q.e[j] = (int8_t)__float_as_uint(__fadd_rn(c, 12582912.0f));
        }
        store<int8_t, N>(a.y_q, i, q);
    }
}

/* A row held in registers as the products p = v * w: thread `lane` of the row's `row_threads`
 * holds the N-element vectors k * row_threads + lane, k < V. The rare float64 sum rereads v from
 * global memory (x, the residual this thread stored, or gated, recomputed from gate_up) rather
 * than keeping it live. A gate and RESIDUAL are never both set. Without NORM (gated only), the
 * weights are ones and 1 / RMS is 1: y = v and the codes are quantize_a8's. */
template <typename T, int N, int V, bool WARP_PER_ROW, bool RESIDUAL, int GATE, bool QUANT, bool NORM,
          bool PARTIAL>
__global__ void __launch_bounds__(WARP_PER_ROW ? 32 * WARP_ROWS_PER_BLOCK : BLOCK_MAX_THREADS)
rmsnorm_registers(NormArgs a) {
    static_assert(!(RESIDUAL && GATE != NO_GATE), "the residual add and the gate are not fused together");
    static_assert(NORM || GATE != NO_GATE, "only the gate is run without the norm");
    const int row_threads = WARP_PER_ROW ? 32 : blockDim.x;
    const int lane = WARP_PER_ROW ? threadIdx.x % 32 : threadIdx.x;
    const int64_t rows_per_block = WARP_PER_ROW ? WARP_ROWS_PER_BLOCK : 1;
    const int64_t first_row = blockIdx.x * rows_per_block + (WARP_PER_ROW ? threadIdx.x / 32 : 0);
    if (a.prefetch_first_row) prefetch_row_l2<T, RESIDUAL, GATE>(a, first_row, lane, row_threads);
    wait_for_previous_kernel();
    const int vectors = (int)(a.cols / N); /* at most BLOCK_MAX_THREADS * BLOCK_MAX_V here */
    const void *v_src = RESIDUAL ? a.residual : a.x;

    for (int64_t row = first_row; row < a.rows; row += gridDim.x * rows_per_block) {
        const int64_t base = row * a.cols;
        float p[V][N];
        SumMax acc = {0.0f, 0.0f};
        if constexpr (GATE != NO_GATE) {
            /* No branch around the loads (a lane past the row's end loads the row's first vector
             * and drops it), so that every vector's gate, up and weight loads can be issued before
             * the math that waits for them. */
#pragma unroll
            for (int k = 0; k < V; k++) {
                const int64_t vec = (int64_t)k * row_threads + lane;
                const bool in_row = vec < vectors;
                const int64_t at = (in_row ? vec : 0) * N;
                Pack<T, N> v = load_input<T, N, GATE>(a, a.x, row, at), w = load_weight<T, N, NORM>(a, at);
#pragma unroll
                for (int j = 0; j < N; j++) {
                    v.e[j] = in_row ? v.e[j] : from_float<T>(0.0f);
                    w.e[j] = in_row ? w.e[j] : from_float<T>(0.0f);
                }
                accumulate<T, N, QUANT>(acc, v, w, p[k]);
            }
        } else if constexpr (std::is_same_v<T, __nv_bfloat16> && !RESIDUAL) {
            /* bfloat16 kept as raw 16-byte words until converted (bf16x8_to_floats): fewer
             * instructions in these issue-bound kernels (docs/log/2026-11-23.md#2026-11-23-10). */
            const uint4 *x_row = reinterpret_cast<const uint4 *>(static_cast<const T *>(a.x) + base);
            const uint4 *weight = static_cast<const uint4 *>(a.weight);
#pragma unroll
            for (int k = 0; k < V; k++) {
                const int vec = k * row_threads + lane;
                uint4 v = make_uint4(0, 0, 0, 0), w = make_uint4(0, 0, 0, 0);
                if (vec < vectors) v = x_row[vec], w = weight[vec];
                float vf[N], wf[N];
                bf16x8_to_floats(v, vf);
                bf16x8_to_floats(w, wf);
                accumulate<N, QUANT>(acc, vf, wf, p[k]);
            }
        } else {
#pragma unroll
            for (int k = 0; k < V; k++) {
                const int64_t vec = (int64_t)k * row_threads + lane;
                Pack<T, N> v, w;
                if (vec < vectors) {
                    v = load<T, N>(a.x, base + vec * N);
                    w = load<T, N>(a.weight, vec * N);
                    if (RESIDUAL) {
                        v = add_residual(v, load<T, N>(a.residual, base + vec * N));
                        store<T, N>(a.residual, base + vec * N, v);
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < N; j++) v.e[j] = w.e[j] = from_float<T>(0.0f);
                }
                accumulate<T, N, QUANT>(acc, v, w, p[k]);
            }
        }
        if (a.prefetch_ahead) prefetch_row_l2<T, RESIDUAL, GATE>(a, row + a.prefetch_ahead, lane, row_threads);
        acc = row_reduce<WARP_PER_ROW>(acc);
        const float r = !NORM || PARTIAL ? 1.0f : inverse_rms(acc.sum, a, [&] {
            double sum = 0.0;
#pragma unroll
            for (int k = 0; k < V; k++) {
                const int64_t vec = (int64_t)k * row_threads + lane;
                if (vec < vectors) sum += sum_squares64(load_input<T, N, GATE>(a, v_src, row, vec * N));
            }
            return row_reduce<WARP_PER_ROW>(sum);
        });
        const float scale = row_scale(acc.max, r);
        const bool finite = !isnan(scale);
        const auto write_row = [&](auto finite_products) {
#pragma unroll
            for (int k = 0; k < V; k++) {
                const int vec = k * row_threads + lane;
                if (vec < vectors)
                    write_outputs<T, N, QUANT, finite_products.value>(a, base + vec * N, p[k], r, r * scale);
            }
        };
        if (!QUANT || finite) write_row(std::true_type{});
        else write_row(std::false_type{});
        if (QUANT && lane == 0) a.y_scales[row] = scale;
        if (PARTIAL && lane == 0) a.sumsq[row] = acc.sum;
    }
}

/* Any row: one block per row, reading it from global memory once per pass (x, the residual or
 * gate_up again in the second pass; each thread rereads only what it wrote itself). */
template <typename T, int N, bool RESIDUAL, int GATE, bool QUANT, bool NORM, bool PARTIAL>
__global__ void __launch_bounds__(LOOP_THREADS) rmsnorm_loop(NormArgs a) {
    static_assert(!(RESIDUAL && GATE != NO_GATE), "the residual add and the gate are not fused together");
    static_assert(NORM || GATE != NO_GATE, "only the gate is run without the norm");
    wait_for_previous_kernel();
    const void *v_src = RESIDUAL ? a.residual : a.x;
    for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
        const int64_t base = row * a.cols;
        const int64_t first = (int64_t)threadIdx.x * N, step = (int64_t)blockDim.x * N;
        SumMax acc = {0.0f, 0.0f};
        for (int64_t i = first; i < a.cols; i += step) {
            Pack<T, N> v = load_input<T, N, GATE>(a, a.x, row, i);
            if (RESIDUAL) {
                v = add_residual(v, load<T, N>(a.residual, base + i));
                store<T, N>(a.residual, base + i, v);
            }
            float p[N];
            accumulate<T, N, QUANT>(acc, v, load_weight<T, N, NORM>(a, i), p);
        }
        acc = row_reduce<false>(acc);
        const double r64 = !NORM || PARTIAL ? 1.0 : inverse_rms(acc.sum, a, [&] {
            double sum = 0.0;
            for (int64_t i = first; i < a.cols; i += step)
                sum += sum_squares64(load_input<T, N, GATE>(a, v_src, row, i));
            return row_reduce<false>(sum);
        });
        const float pre = tiny_row_scale(r64), r = (float)(r64 / pre);
        /* A tiny row: the products' max again, of the scaled products. */
        if (QUANT && pre != 1.0f) {
            SumMax scaled = {0.0f, 0.0f};
            for (int64_t i = first; i < a.cols; i += step) {
                float p[N];
                accumulate<T, N, true>(scaled, load_input<T, N, GATE>(a, v_src, row, i),
                                       load_weight<T, N, NORM>(a, i), p, pre);
            }
            acc.max = row_reduce<false>(scaled).max;
        }
        const float scale = row_scale(acc.max, r);
        for (int64_t i = first; i < a.cols; i += step) {
            float p[N];
            SumMax unused = {0.0f, 0.0f};
            accumulate<T, N, false>(unused, load_input<T, N, GATE>(a, v_src, row, i),
                                    load_weight<T, N, NORM>(a, i), p, pre);
            write_outputs<T, N, QUANT>(a, base + i, p, r, r * scale);
        }
        if (QUANT && threadIdx.x == 0) a.y_scales[row] = scale;
        if (PARTIAL && threadIdx.x == 0) a.sumsq[row] = acc.sum;
    }
}

/* Vectors per thread that have a kernel: up to WARP_MAX_V with a warp per row, BLOCK_MAX_V with a
 * block per row. */
constexpr int V_CHOICES[] = {1, 2, 3, 4, 6, 8, 10, 12};

template <typename T, int N, bool WARP_PER_ROW, bool RESIDUAL, int GATE, bool QUANT, bool NORM,
          bool PARTIAL, int I = 0>
void (*registers_kernel(int v))(NormArgs) {
    constexpr int count = sizeof V_CHOICES / sizeof *V_CHOICES;
    if constexpr (I == count || V_CHOICES[I] > (WARP_PER_ROW ? WARP_MAX_V : BLOCK_MAX_V)) {
        return nullptr;
    } else {
        if (v == V_CHOICES[I])
            return rmsnorm_registers<T, N, V_CHOICES[I], WARP_PER_ROW, RESIDUAL, GATE, QUANT, NORM, PARTIAL>;
        return registers_kernel<T, N, WARP_PER_ROW, RESIDUAL, GATE, QUANT, NORM, PARTIAL, I + 1>(v);
    }
}

/* The fewest vectors per thread (a V_CHOICES entry) covering `needed`, or 0 if none does. */
int smallest_v(int64_t needed) {
    for (int v : V_CHOICES)
        if (v >= needed) return v;
    return 0;
}

bool aligned(const void *p, int64_t bytes) { return p == nullptr || (uintptr_t)p % bytes == 0; }

/* Picks the kernel and its shape for the row length and alignment, and launches it. Gated, x is
 * gate_up: with cols % N == 0 its gate and up halves are as aligned as its start, so the shape is
 * the one bitnet_rmsnorm picks for the gate's output of the same alignment. */
template <typename T, bool RESIDUAL, int GATE, bool QUANT, bool NORM = true, bool PARTIAL = false>
bitnet_status launch(const NormArgs &a, const BnGpu &gpu, cudaStream_t stream) {
    constexpr int N = 16 / sizeof(T);
    const bool vectorized = a.cols % N == 0 && aligned(a.x, 16) && aligned(a.residual, 16) &&
                            aligned(a.weight, 16) && aligned(a.y, 16) && aligned(a.y_q, N);
    const int64_t vectors = a.cols / N;
    void (*kernel)(NormArgs) = nullptr;
    int64_t threads = 0, grid = 0;
    /* The register kernels need eps > 0, which keeps 1 / RMS a float (tiny_row_scale). Handling
     * tiny rows there too was slower (docs/log/2026-11-26.md#2026-11-26-5). */
    const bool in_registers = vectorized && a.eps > 0.0f;
    const bool warp_sized = in_registers && vectors <= 32 * WARP_MAX_V; /* a warp could hold a row */
    /* With the residual's second stream of loads, a block per row was faster at every T. The
     * gated and partial norms take a block per row too: their warp kernels were half of this
     * file's machine code and build time, for rows that few of their calls have (gate rows of a
     * model are wider than 384 vectors; partial rows are a tensor-parallel slice). */
    constexpr bool warp_kernels = !RESIDUAL && GATE == NO_GATE && !PARTIAL;
    const bool warp_per_row = warp_kernels && warp_sized && a.rows >= (int64_t)WARP_MIN_ROWS_PER_SM * gpu.sms;
    if (warp_per_row) {
        if constexpr (warp_kernels)
            kernel = registers_kernel<T, N, true, false, NO_GATE, QUANT, NORM, false>(smallest_v((vectors + 31) / 32));
        threads = 32 * WARP_ROWS_PER_BLOCK;
        grid = (a.rows + WARP_ROWS_PER_BLOCK - 1) / WARP_ROWS_PER_BLOCK;
    } else if (in_registers && vectors <= (int64_t)BLOCK_MAX_THREADS * BLOCK_MAX_V) {
        const bool narrow = warp_sized && a.rows >= (int64_t)BLOCK_NARROW_MIN_ROWS_PER_SM * gpu.sms;
        int v = narrow ? 2
                       : smallest_v((vectors + BLOCK_PREFERRED_THREADS - 1) / BLOCK_PREFERRED_THREADS);
        if (v == 0 || v > BLOCK_MAX_V) v = BLOCK_MAX_V;
        kernel = registers_kernel<T, N, false, RESIDUAL, GATE, QUANT, NORM, PARTIAL>(v);
        threads = ((vectors + v - 1) / v + 31) / 32 * 32;
        grid = a.rows;
    } else {
        kernel = vectorized ? rmsnorm_loop<T, N, RESIDUAL, GATE, QUANT, NORM, PARTIAL>
                            : rmsnorm_loop<T, 1, RESIDUAL, GATE, QUANT, NORM, PARTIAL>;
        const int64_t per_thread = vectorized ? N : 1;
        threads = (a.cols + per_thread - 1) / per_thread;
        threads = threads > LOOP_THREADS ? LOOP_THREADS : (threads + 31) / 32 * 32;
        grid = a.rows;
    }
    if (kernel == nullptr)
        return bn_fail(BITNET_ERR_INTERNAL, "%s: no kernel for %s=%lld",
                       GATE != NO_GATE ? "bitnet_glu_rmsnorm" : "bitnet_rmsnorm", GATE != NO_GATE ? "F" : "H",
                       (long long)a.cols);
    /* Rows beyond the grid are taken by the blocks' row loops. */
    const int64_t max_grid = (int64_t)gpu.sms * 64;
    grid = grid < max_grid ? grid : max_grid;

    NormArgs args = a;
    if (in_registers) {
        /* With the int8 codes, prefetching the first row and each row's input 9/10 of the resident
         * rows ahead helps at every T; the plain norm gains from the first row's prefetch only
         * where all its rows are resident at once (docs/log/2026-11-23.md#2026-11-23-14). */
        int per_sm = 0;
        BN_TRY(bn_cuda_kernel_occupancy(gpu.device, reinterpret_cast<const void *>(kernel), (int)threads, 0,
                                        &per_sm));
        const int64_t resident_rows = (int64_t)per_sm * gpu.sms * (warp_per_row ? WARP_ROWS_PER_BLOCK : 1);
        args.prefetch_first_row = QUANT || a.rows <= resident_rows;
        args.prefetch_ahead = QUANT ? resident_rows * 9 / 10 : 0;
    }
    BN_CUDA_TRY(bn_launch_pdl(kernel, dim3((unsigned)grid), dim3((unsigned)threads), 0, stream, args));
    return BITNET_OK;
}

/* The gated kernels of one activation: with the norm, with or without the codes; without it (no
 * weight), with the codes (the entry point refuses y alone there: that is bitnet_glu_gate). */
template <typename T, int GATE>
bitnet_status launch_gated(const NormArgs &a, const BnGpu &gpu, cudaStream_t stream) {
    if (!a.weight) return launch<T, false, GATE, true, false>(a, gpu, stream);
    return a.y_q ? launch<T, false, GATE, true>(a, gpu, stream) : launch<T, false, GATE, false>(a, gpu, stream);
}

/* The partial kernels (codes of v * w and the sums of squares) of one input: x, or a gate. */
template <typename T>
bitnet_status launch_partial(const NormArgs &a, int gate, const BnGpu &gpu, cudaStream_t stream) {
    if (gate == BITNET_ACTIVATION_RELU2)
        return launch<T, false, BITNET_ACTIVATION_RELU2, true, true, true>(a, gpu, stream);
    if (gate == BITNET_ACTIVATION_SILU)
        return launch<T, false, BITNET_ACTIVATION_SILU, true, true, true>(a, gpu, stream);
    return launch<T, false, NO_GATE, true, true, true>(a, gpu, stream);
}

/* Gated runs never have a residual. gate: NO_GATE or a bitnet_activation. */
template <typename T>
bitnet_status launch_dtype(const NormArgs &a, int gate, const BnGpu &gpu, cudaStream_t stream) {
    if (gate == BITNET_ACTIVATION_RELU2) return launch_gated<T, BITNET_ACTIVATION_RELU2>(a, gpu, stream);
    if (gate == BITNET_ACTIVATION_SILU) return launch_gated<T, BITNET_ACTIVATION_SILU>(a, gpu, stream);
    if (a.residual)
        return a.y_q ? launch<T, true, NO_GATE, true>(a, gpu, stream)
                     : launch<T, true, NO_GATE, false>(a, gpu, stream);
    return a.y_q ? launch<T, false, NO_GATE, true>(a, gpu, stream)
                 : launch<T, false, NO_GATE, false>(a, gpu, stream);
}

/* Every entry point: x is gate_up [T, 2H] when gated (gate a bitnet_activation; residual then
 * NULL); a.sumsq set: the partial kernels. */
bitnet_status run(int32_t device, int32_t dtype, int gate, const NormArgs &a, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BnGpu gpu{device, 0};
    BN_TRY(bn_cuda_sm_count(device, &gpu.sms));
    cudaStream_t s = bn_stream(stream);
    if (a.sumsq) {
        switch (dtype) {
        case BITNET_DTYPE_F32: return launch_partial<float>(a, gate, gpu, s);
        case BITNET_DTYPE_F16: return launch_partial<__half>(a, gate, gpu, s);
        default: return launch_partial<__nv_bfloat16>(a, gate, gpu, s);
        }
    }
    switch (dtype) {
    case BITNET_DTYPE_F32: return launch_dtype<float>(a, gate, gpu, s);
    case BITNET_DTYPE_F16: return launch_dtype<__half>(a, gate, gpu, s);
    default: return launch_dtype<__nv_bfloat16>(a, gate, gpu, s);
    }
}

}  // namespace

bitnet_status bn_cuda_rmsnorm(int32_t device, int32_t dtype, int64_t T, int64_t H, const void *x,
                              void *residual, const void *weight, float eps, void *y, int8_t *y_q,
                              float *y_scales, void *stream) {
    return run(device, dtype, NO_GATE,
               NormArgs{x, residual, weight, eps, y, y_q, y_scales, T, H, false, 0, nullptr}, stream);
}

bitnet_status bn_cuda_glu_rmsnorm(int32_t device, int32_t dtype, int64_t T, int64_t F,
                                  int32_t activation, const void *gate_up, const void *weight,
                                  float eps, void *y, int8_t *y_q, float *y_scales, void *stream) {
    return run(device, dtype, activation,
               NormArgs{gate_up, nullptr, weight, eps, y, y_q, y_scales, T, F, false, 0, nullptr}, stream);
}

/* eps 1 (unused: no division) keeps the register kernels, which need eps > 0. */
bitnet_status bn_cuda_rmsnorm_partial(int32_t device, int32_t dtype, int64_t T, int64_t H,
                                      int32_t activation, const void *x, const void *weight,
                                      int8_t *y_q, float *y_scales, float *sumsq, void *stream) {
    return run(device, dtype, activation < 0 ? NO_GATE : activation,
               NormArgs{x, nullptr, weight, 1.0f, nullptr, y_q, y_scales, T, H, false, 0, sumsq}, stream);
}
