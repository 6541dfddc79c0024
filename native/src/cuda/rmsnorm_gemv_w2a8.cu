/* RMSNorm and the per-token int8 quantization fused into the one-token W2A8 GEMV: for each token t,
 * y[t] = gemv_w2a8(W, rmsnorm_quantize(x[t])) (+ residual[t]), bit for bit what bitnet_rmsnorm (or
 * bitnet_relu2_rmsnorm, gated) into int8 codes followed by bitnet_gemv_w2a8 give on the same GPU,
 * without the norm's launch. The kernel is gemv_w2a8.cu's one-token kernel with another input:
 * after the PDL wait every block normalizes the token's row itself (x [K] or gate_up [2K] and the
 * norm weight, from L2 after the first block reads them). It reads them twice: first for the
 * float32 sum of squares and max |v * w|, summed in exactly the order of the norm kernel that
 * bitnet_rmsnorm launches for such rows (register_layout: the block's 256 threads play that
 * kernel's row_threads, thread i those of index i mod 256); then for the codes, which go straight
 * into the GEMV's shared x tile. The residual is added in the epilogue, where each output has one
 * owner, so y may be the residual itself. One launch per token: the weights are read T times.
 * Bytes per token: M*K/4 + 4M weights, and per block K (x2 gated) elements of x + K of weight from
 * L2. */
#define BN_GEMV_W2A8_ONE_TOKEN_ONLY
#include "gemv_w2a8.cu"
#include "rmsnorm_math.cuh"

namespace {

struct NormArgs {
    const void *x;        /* the token's row: x [K], or gated gate_up [2K] */
    const void *weight;   /* [K] */
    const void *residual; /* the token's [M] of y's dtype, added to y; or nullptr */
    float eps;            /* > 0 */
    int row_threads, v;   /* bitnet_rmsnorm's layout of such a row (register_layout) */
};

/* The reduction of rmsnorm.cu's row_reduce over layout.row_threads threads, as the GEMV's block
 * runs it: thread i computes value(vt) for the norm kernel's threads vt = i, i + kThreads, ...,
 * each virtual warp is reduced by shuffles, then the warps' partials in one warp. row_threads is a
 * multiple of 32, so every branch is uniform over a warp. The result is in every thread. */
template <typename A, typename F> __device__ __forceinline__ A row_reduce_as_norm(int row_threads, F value) {
    __shared__ A partial[32];
    const int lane = threadIdx.x % 32;
    __syncthreads(); /* an earlier reduction's readers are done with `partial` */
    for (int vt = threadIdx.x; vt < row_threads; vt += kThreads) {
        const A v = warp_reduce(value(vt));
        if (lane == 0) partial[vt / 32] = v;
    }
    __syncthreads();
    return warp_reduce(lane < row_threads / 32 ? partial[lane] : A{});
}

/* y of the output type Y = residual + y as stored. The residual is read before store() writes y,
 * which may be the residual. */
template <typename Y>
__device__ __forceinline__ void store_with_residual(const GemvArgs &a, const void *residual, int m, int dot,
                                                    float w_scale, float x_scale) {
    const float r = to_float(static_cast<const Y *>(residual)[m]);
    store(a, 0, m, dot, w_scale, x_scale);
    Y *y = static_cast<Y *>(a.y);
    y[m] = from_float<Y>(r + to_float(y[m]));
}

/* The one-token kernel's input (gemv_w2a8.cu, Int8Input): x normalized and quantized by the block. */
template <typename T, bool GATED> struct NormInput {
    static constexpr int N = 16 / sizeof(T);
    NormArgs n;

    /* Vector vec (N elements) of the normalized row's input v: x, or relu2(gate, up) as stored. */
    __device__ __forceinline__ Pack<T, N> input(const GemvArgs &a, int vec) const {
        if constexpr (GATED) return relu2_gate(load<T, N>(n.x, vec * N), load<T, N>(n.x, a.K + vec * N));
        else return load<T, N>(n.x, vec * N);
    }

    __device__ int stage(const GemvArgs &a, int8_t *x_tile, float &x_scale) const {
        const int vectors = a.K / N;
        /* The norm kernel's thread vt holds the vectors k * row_threads + vt, k < v. */
        const SumMax acc = row_reduce_as_norm<SumMax>(n.row_threads, [&](int vt) {
            SumMax s = {0.0f, 0.0f};
            for (int k = 0; k < n.v; k++) {
                const int vec = k * n.row_threads + vt;
                float p[N];
                if (vec < vectors) accumulate<T, N, true>(s, input(a, vec), load<T, N>(n.weight, vec * N), p);
            }
            return s;
        });
        const float r = inverse_rms(acc.sum, a.K, n.eps, [&] {
            return row_reduce_as_norm<double>(n.row_threads, [&](int vt) {
                double s = 0.0;
                for (int k = 0; k < n.v; k++) {
                    const int vec = k * n.row_threads + vt;
                    if (vec < vectors) s += sum_squares64(input(a, vec));
                }
                return s;
            });
        });
        const bool finite = isfinite(acc.max);
        float max = acc.max;
        if (isnan(max)) { /* rare: a NaN product; the scale comes from the others (any order) */
            max = row_reduce_as_norm<SumMax>(n.row_threads, [&](int vt) {
                float m = 0.0f;
                for (int k = 0; k < n.v; k++) {
                    const int vec = k * n.row_threads + vt;
                    float p[N];
                    SumMax unused = {0.0f, 0.0f};
                    if (vec < vectors) {
                        accumulate<T, N, false>(unused, input(a, vec), load<T, N>(n.weight, vec * N), p);
                        m = max_abs_of_numbers(m, p);
                    }
                }
                return SumMax{0.0f, m};
            }).max;
        }
        const float scale = 127.0f / fmaxf(max * r, 1e-5f), r_scale = r * scale;
        x_scale = scale;
        /* The codes, into the tile as stage_x lays x out; any thread may take any vector now. */
        int sum = 0;
        for (int vec = threadIdx.x; vec < vectors; vec += kThreads) {
            float p[N];
            SumMax unused = {0.0f, 0.0f};
            accumulate<T, N, false>(unused, input(a, vec), load<T, N>(n.weight, vec * N), p);
            Pack<int8_t, N> q;
#pragma unroll
            for (int j = 0; j < N; j++) {
                q.e[j] = finite ? int8_code<true>(p[j], r_scale) : int8_code<false>(p[j], r_scale);
                sum += q.e[j];
            }
            const int k = vec * N;
            *reinterpret_cast<Pack<int8_t, N> *>(x_tile + x_offset(k / 64, k % 64 / 16) + k % 16) = q;
        }
        return sum;
    }

    __device__ __forceinline__ void store_row(const GemvArgs &a, int m, int dot, float w_scale, float x_scale) const {
        if (n.residual == nullptr) store(a, 0, m, dot, w_scale, x_scale);
        else if (a.y_dtype == BITNET_DTYPE_F32) store_with_residual<float>(a, n.residual, m, dot, w_scale, x_scale);
        else if (a.y_dtype == BITNET_DTYPE_F16) store_with_residual<__half>(a, n.residual, m, dot, w_scale, x_scale);
        else store_with_residual<__nv_bfloat16>(a, n.residual, m, dot, w_scale, x_scale);
    }
};

template <typename T, bool GATED, int PREFETCH, bool BLOCK_MAJOR_TAIL>
__global__ __launch_bounds__(kThreads) void rmsnorm_gemv_one_token(const GemvArgs a, const NormArgs n) {
    one_token<PREFETCH, BLOCK_MAJOR_TAIL>(a, NormInput<T, GATED>{n});
}

using FusedKernel = void (*)(GemvArgs, NormArgs);

template <typename T, bool GATED> FusedKernel fused_kernel(const OneTokenShape &s) {
    return s.long_rows ? (s.rounds ? rmsnorm_gemv_one_token<T, GATED, kPrefetchSteps, true>
                                   : rmsnorm_gemv_one_token<T, GATED, kPrefetchSteps, false>)
                       : (s.rounds ? rmsnorm_gemv_one_token<T, GATED, 0, true>
                                   : rmsnorm_gemv_one_token<T, GATED, 0, false>);
}

template <typename T> FusedKernel fused_kernel(const OneTokenShape &s, bool gated) {
    return gated ? fused_kernel<T, true>(s) : fused_kernel<T, false>(s);
}

}  // namespace

bitnet_status bn_cuda_rmsnorm_gemv_w2a8(int32_t device, int32_t dtype, int64_t T, int64_t K,
                                        const void *x, int32_t gated, const void *weight, float eps,
                                        const uint8_t *w_packed, const float *w_scales, int64_t M,
                                        const void *residual, void *y, int32_t y_dtype, void *stream) {
    const char *fn = "bitnet_rmsnorm_gemv_w2a8";
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    if (M > INT32_MAX / 2)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: M = %lld is over the CUDA kernel's limit (%d)", fn,
                       (long long)M, INT32_MAX / 2);
    /* bitnet_rmsnorm takes its register kernels, whose order the fused kernel repeats, only for
     * eps > 0 and 16-byte aligned rows (K % 128 == 0 keeps every row as aligned as the first). */
    if (!(eps > 0.0f) || (uintptr_t)x % 16 || (uintptr_t)weight % 16)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: the GPU kernel needs eps > 0 and x (gate_up) and weight "
                       "aligned to 16 bytes (got eps = %g, x %% 16 = %d, weight %% 16 = %d); "
                       "bitnet_rmsnorm then bitnet_gemv_w2a8 take any", fn, (double)eps,
                       (int)((uintptr_t)x % 16), (int)((uintptr_t)weight % 16));
    BnGpu gpu{device, 0};
    BN_TRY(bn_cuda_sm_count(device, &gpu.sms));
    const int64_t size = bn_dtype_size(dtype), y_size = bn_dtype_size(y_dtype);
    RegisterLayout layout;
    if (!register_layout(K * size / 16, T, gpu.sms, false, &layout))
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: K = %lld is over the GPU kernel's limit (%d %s)", fn,
                       (long long)K, BLOCK_MAX_THREADS * BLOCK_MAX_V * 16 / (int)size, bn_dtype_name(dtype));
    const OneTokenShape shape = one_token_shape(gpu, M, K);
    const FusedKernel kernel = dtype == BITNET_DTYPE_F32   ? fused_kernel<float>(shape, gated)
                               : dtype == BITNET_DTYPE_F16 ? fused_kernel<__half>(shape, gated)
                                                           : fused_kernel<__nv_bfloat16>(shape, gated);
    int resident = 0;
    BN_TRY(bn_cuda_kernel_occupancy(device, reinterpret_cast<const void *>(kernel), kThreads, shape.shared_bytes,
                                    &resident));
    const int64_t per_sm = resident < 1 ? 1 : resident < shape.per_sm ? resident : shape.per_sm;
    const int64_t resident_blocks = (int64_t)gpu.sms * per_sm;
    const int64_t blocks = shape.work_blocks < resident_blocks ? shape.work_blocks : resident_blocks;
    const int64_t x_row = K * (gated ? 2 : 1) * size;
    for (int64_t t = 0; t < T; t++) {
        GemvArgs a;
        a.w = reinterpret_cast<const uint4 *>(w_packed);
        a.w_scales = w_scales;
        a.x_q = nullptr;
        a.x_scales = nullptr;
        a.y = static_cast<char *>(y) + t * M * y_size;
        a.y_dtype = y_dtype;
        a.M = static_cast<int>(M);
        a.K = static_cast<int>(K);
        a.n_valid = 1;
        const NormArgs n = {static_cast<const char *>(x) + t * x_row, weight,
                            residual ? static_cast<const char *>(residual) + t * M * y_size : nullptr, eps,
                            layout.row_threads, layout.v};
        BN_CUDA_TRY(bn_launch_pdl(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), shape.shared_bytes,
                                  bn_stream(stream), a, n));
    }
    return BITNET_OK;
}
