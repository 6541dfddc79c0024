/* CUDA ternary weight quantization (quantize_i2s), packing, and int8 activation quantization.
 * quantize_i2s reads W twice and waits for the stream once, at the end: (1) one block per row
 * sums |w| in float64 into a scratch array and flags the first row whose sum is not finite (a NaN
 * or ±inf weight makes it so; a finite row cannot overflow a double), (2) one block per segment
 * adds its row sums in a fixed order and writes the scales, (3) one thread per 32-bit packed word
 * (16 weights) writes codes = clamp(rint(w / scale), -1, 1) + 1. Passes 2 and 3 write nothing
 * when a row is flagged, so a non-finite weight is an error that leaves the outputs untouched.
 * quantize_a8: one block per row, max |x| then x * 127 / max (the second read hits L2).
 * Layout: docs/weight_format.md. Float32 arithmetic is IEEE (__fdiv_rn, __fmul_rn, rintf), so
 * the results equal the CPU backend's bit for bit (scales up to float64 summation order). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

constexpr int kThreads = 256;

/* 16 consecutive elements starting at a multiple of 16 (16-byte aligned rows). */
__device__ __forceinline__ void load16(const void *data, int32_t dtype, int64_t index, float *out) {
    if (dtype == BITNET_DTYPE_F32) {
        const float4 *p = reinterpret_cast<const float4 *>(static_cast<const float *>(data) + index);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float4 v = p[i];
            out[4 * i] = v.x; out[4 * i + 1] = v.y; out[4 * i + 2] = v.z; out[4 * i + 3] = v.w;
        }
        return;
    }
    const uint4 *p = reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(data) + index);
#pragma unroll
    for (int i = 0; i < 2; i++) {
        uint4 v = p[i];
        uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            uint16_t bits = static_cast<uint16_t>(words[j / 2] >> (16 * (j % 2)));
            out[8 * i + j] = dtype == BITNET_DTYPE_F16
                                 ? __half2float(__ushort_as_half(bits))
                                 : __uint_as_float(static_cast<uint32_t>(bits) << 16);
        }
    }
}

template <typename T, typename Op>
__device__ T block_reduce(T value, Op op, T *shared /* [kThreads / 32] */) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(~0u, value, offset));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads(); /* `shared` may still be read by a previous call */
    if (lane == 0) shared[warp] = value;
    __syncthreads();
    value = shared[0];
    for (int w = 1; w < kThreads / 32; w++) value = op(value, shared[w]);
    return value;
}

struct Add {
    template <typename T> __device__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOrNan {
    __device__ float operator()(float a, float b) const { return bn_fmax_nan(a, b); }
};

/* Lowers *first to `index` where that is smaller: the first flagged element wins. */
__device__ __forceinline__ void record_first(unsigned long long *first, int64_t index) {
    atomicMin(first, static_cast<unsigned long long>(index));
}

/* The first NaN or ±inf of w [count], by flat index, into *first. */
__global__ __launch_bounds__(kThreads) void find_non_finite(const void *w, int32_t dtype, int64_t count,
                                                            unsigned long long *first) {
    for (int64_t i = 16 * (blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x); i < count;
         i += 16 * static_cast<int64_t>(gridDim.x) * kThreads) {
        float v[16];
        load16(w, dtype, i, v);
        bool any = false;
#pragma unroll
        for (int j = 0; j < 16; j++) any |= !isfinite(v[j]);
        if (!any) continue;
        for (int j = 0; j < 16; j++)
            if (!isfinite(v[j])) {
                record_first(first, i + j);
                break;
            }
    }
}

constexpr unsigned long long kNoRow = ~0ull;

/* row_sums[row] = sum of |w[row, :]|; the first row whose sum is not finite into *bad_row. */
__global__ __launch_bounds__(kThreads) void row_abs_sums(const void *w, int32_t dtype, int64_t K,
                                                         double *row_sums,
                                                         unsigned long long *bad_row) {
    __shared__ double partial[kThreads / 32];
    int64_t row = blockIdx.x;
    double sum = 0.0;
    for (int64_t k = 16 * threadIdx.x; k < K; k += 16 * kThreads) {
        float v[16];
        load16(w, dtype, row * K + k, v);
#pragma unroll
        for (int j = 0; j < 16; j++) sum += fabs(static_cast<double>(v[j]));
    }
    sum = block_reduce(sum, Add(), partial);
    if (threadIdx.x == 0) {
        row_sums[row] = sum;
        if (!isfinite(sum)) record_first(bad_row, row);
    }
}

__global__ __launch_bounds__(kThreads) void segment_scale(const double *row_sums,
                                                          const unsigned long long *bad_row,
                                                          int64_t first_row, int64_t rows, int64_t K,
                                                          float *w_scales) {
    __shared__ double partial[kThreads / 32];
    if (*bad_row != kNoRow) return;
    double sum = 0.0;
#pragma unroll 8
    for (int64_t m = threadIdx.x; m < rows; m += kThreads) sum += row_sums[first_row + m];
    sum = block_reduce(sum, Add(), partial);
    double mean = sum / (static_cast<double>(rows) * static_cast<double>(K));
    float scale = static_cast<float>(mean > 1e-5 ? mean : 1e-5);
    for (int64_t m = threadIdx.x; m < rows; m += kThreads) w_scales[first_row + m] = scale;
}

/* Weight 16g+4i+b of a row goes to byte 4g+b, bits 2i..2i+1, as code = value + 1. */
__device__ __forceinline__ uint32_t pack_codes(const int *codes /* [16], 0..2 */) {
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int b = 0; b < 4; b++) word |= static_cast<uint32_t>(codes[4 * i + b]) << (8 * b + 2 * i);
    return word;
}

/* rint(w / scale) clamped to [-1, 1] is 1 exactly when w > scale / 2 (and -1 when w < -scale / 2):
 * scale / 2 is a float (scale >= 1e-5 is normal), w / scale at w = scale / 2 is the tie 0.5, which
 * rounds to 0, and the next float above scale / 2, divided by scale, rounds above 0.5. So the
 * comparison gives the CPU backend's division-and-rint codes bit for bit, without a division. */
__global__ __launch_bounds__(kThreads) void pack_scaled(const void *w, int32_t dtype, int64_t K,
                                                        int64_t words, const float *w_scales,
                                                        const unsigned long long *bad_row,
                                                        uint32_t *w_packed) {
    if (*bad_row != kNoRow) return;
    for (int64_t word = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; word < words;
         word += static_cast<int64_t>(gridDim.x) * kThreads) {
        float v[16];
        load16(w, dtype, 16 * word, v);
        const float half = 0.5f * w_scales[16 * word / K];
        int codes[16];
#pragma unroll
        for (int j = 0; j < 16; j++) codes[j] = v[j] > half ? 2 : (v[j] < -half ? 0 : 1);
        w_packed[word] = pack_codes(codes);
    }
}

/* The first value of w_q [count] outside {-1, 0, 1}, by flat index, into *first. */
__global__ __launch_bounds__(kThreads) void find_non_ternary(const int8_t *w_q, int64_t count,
                                                             unsigned long long *first) {
    const uint4 *p = reinterpret_cast<const uint4 *>(w_q);
    for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < count / 16;
         i += static_cast<int64_t>(gridDim.x) * kThreads) {
        uint4 v = p[i];
        uint32_t words[4] = {v.x, v.y, v.z, v.w};
        bool bad = false;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            uint32_t plus_one = __vadd4(words[j], 0x01010101u); /* -1, 0, 1 -> 0, 1, 2 */
            bad |= __vcmpgtu4(plus_one, 0x02020202u) != 0;
        }
        if (!bad) continue;
        for (int j = 0; j < 16; j++) {
            const int value = static_cast<int8_t>(words[j / 4] >> (8 * (j % 4)));
            if (value < -1 || value > 1) {
                record_first(first, 16 * i + j);
                break;
            }
        }
    }
}

__global__ __launch_bounds__(kThreads) void pack_values(const int8_t *w_q, int64_t words,
                                                        uint32_t *w_packed) {
    const uint4 *p = reinterpret_cast<const uint4 *>(w_q);
    for (int64_t word = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; word < words;
         word += static_cast<int64_t>(gridDim.x) * kThreads) {
        uint4 v = p[word];
        uint32_t in[4] = {v.x, v.y, v.z, v.w};
        int codes[16];
#pragma unroll
        for (int j = 0; j < 16; j++) codes[j] = static_cast<int8_t>(in[j / 4] >> (8 * (j % 4))) + 1;
        w_packed[word] = pack_codes(codes);
    }
}

__global__ __launch_bounds__(kThreads) void unpack_values(const uint32_t *w_packed, int64_t words,
                                                          int8_t *w_q) {
    for (int64_t word = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; word < words;
         word += static_cast<int64_t>(gridDim.x) * kThreads) {
        uint32_t packed = w_packed[word];
        uint32_t out[4];
#pragma unroll
        for (int i = 0; i < 4; i++) out[i] = __vsub4((packed >> (2 * i)) & 0x03030303u, 0x01010101u);
        reinterpret_cast<uint4 *>(w_q)[word] = make_uint4(out[0], out[1], out[2], out[3]);
    }
}

__global__ __launch_bounds__(kThreads) void quantize_rows_a8(const void *x, int32_t dtype, int64_t K,
                                                             int8_t *x_q, float *x_scales) {
    __shared__ float partial[kThreads / 32];
    int64_t row = blockIdx.x;
    float max_abs = 0.0f;
    for (int64_t k = 16 * threadIdx.x; k < K; k += 16 * kThreads) {
        float v[16];
        load16(x, dtype, row * K + k, v);
#pragma unroll
        for (int j = 0; j < 16; j++) max_abs = bn_fmax_nan(max_abs, fabsf(v[j]));
    }
    max_abs = block_reduce(max_abs, MaxOrNan(), partial);
    /* A row holding a NaN or ±inf gets the scale NaN, and so codes -128 (fmaxf(NaN, -128)): its
     * GEMV outputs are NaN. */
    float scale = isfinite(max_abs) ? __fdiv_rn(127.0f, fmaxf(max_abs, 1e-5f)) : bn_nan();
    for (int64_t k = 16 * threadIdx.x; k < K; k += 16 * kThreads) {
        float v[16];
        load16(x, dtype, row * K + k, v);
        uint32_t out[4] = {0, 0, 0, 0};
#pragma unroll
        for (int j = 0; j < 16; j++) {
            int q = static_cast<int>(fminf(fmaxf(rintf(__fmul_rn(v[j], scale)), -128.0f), 127.0f));
            out[j / 4] |= (static_cast<uint32_t>(q) & 0xffu) << (8 * (j % 4));
        }
        *reinterpret_cast<uint4 *>(x_q + row * K + k) = make_uint4(out[0], out[1], out[2], out[3]);
    }
    if (threadIdx.x == 0) x_scales[row] = scale;
}

unsigned grid_for(int64_t items) {
    int64_t blocks = (items + kThreads - 1) / kThreads;
    return static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
}

/* An op that waits for the stream to check its input refuses to be captured in a CUDA graph. */
bitnet_status refuse_capture(const char *op, cudaStream_t s) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    BN_CUDA_TRY(cudaStreamIsCapturing(s, &capture));
    if (capture != cudaStreamCaptureStatusNone)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: checks its input on the host (it waits for the "
                       "stream), so it cannot be captured in a CUDA graph", op);
    return BITNET_OK;
}

/* Runs find(first), a launch that records flat indices with record_first, on stream s and waits
 * for it: *index is the smallest recorded, or -1. A check on the host must wait for the stream, so
 * it is refused under graph capture (`op` names the caller). */
template <typename Find>
bitnet_status first_flagged(const char *op, int32_t device, cudaStream_t s, Find find, int64_t *index) {
    BN_TRY(refuse_capture(op, s));
    unsigned long long *first = nullptr, host_first = ~0ull;
    BN_TRY(bn_cuda_scratch_alloc(device, sizeof *first, s, reinterpret_cast<void **>(&first)));
    cudaError_t err = cudaMemsetAsync(first, 0xff, sizeof *first, s);
    if (err == cudaSuccess) {
        find(first);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess) err = cudaMemcpyAsync(&host_first, first, sizeof *first, cudaMemcpyDeviceToHost, s);
    cudaError_t free_err = cudaFreeAsync(first, s);
    if (err == cudaSuccess) err = cudaStreamSynchronize(s);
    if (err == cudaSuccess) err = free_err;
    BN_CUDA_TRY(err);
    *index = host_first == ~0ull ? -1 : static_cast<int64_t>(host_first);
    return BITNET_OK;
}

/* quantize_i2s's passes, row_sums [M] and bad_row being scratch. */
bitnet_status quantize_i2s(int32_t device, const void *w, int32_t w_dtype, int64_t M, int64_t K,
                           const int64_t *row_segments,
                           int64_t n_segments, double *row_sums, unsigned long long *bad_row,
                           uint8_t *w_packed, float *w_scales, cudaStream_t s) {
    BN_CUDA_TRY(cudaMemsetAsync(bad_row, 0xff, sizeof *bad_row, s));
    row_abs_sums<<<static_cast<unsigned>(M), kThreads, 0, s>>>(w, w_dtype, K, row_sums, bad_row);
    BN_CUDA_CHECK_LAUNCH("row_abs_sums");
    int64_t first_row = 0;
    for (int64_t i = 0; i < n_segments; i++) {
        int64_t rows = row_segments ? row_segments[i] : M;
        segment_scale<<<1, kThreads, 0, s>>>(row_sums, bad_row, first_row, rows, K, w_scales);
        BN_CUDA_CHECK_LAUNCH("segment_scale");
        first_row += rows;
    }
    int64_t words = M * K / 16;
    pack_scaled<<<grid_for(words), kThreads, 0, s>>>(w, w_dtype, K, words, w_scales, bad_row,
                                                     reinterpret_cast<uint32_t *>(w_packed));
    BN_CUDA_CHECK_LAUNCH("pack_scaled");
    unsigned long long host_bad_row = kNoRow;
    BN_CUDA_TRY(cudaMemcpyAsync(&host_bad_row, bad_row, sizeof *bad_row, cudaMemcpyDeviceToHost, s));
    BN_CUDA_TRY(cudaStreamSynchronize(s));
    if (host_bad_row == kNoRow) return BITNET_OK;
    const int64_t size = bn_dtype_size(w_dtype);
    const char *row = static_cast<const char *>(w) + static_cast<int64_t>(host_bad_row) * K * size;
    int64_t column = -1;
    BN_TRY(first_flagged("bitnet_quantize_i2s", device, s, [&](unsigned long long *first) {
        find_non_finite<<<grid_for(K / 16), kThreads, 0, s>>>(row, w_dtype, K, first);
    }, &column));
    uint32_t bits = 0; /* the element's bytes, as bn_load_floats reads them */
    BN_CUDA_TRY(cudaMemcpy(&bits, row + column * size, size, cudaMemcpyDeviceToHost));
    float value;
    bn_load_floats(w_dtype, &bits, 0, 1, &value);
    return bn_fail_non_finite_weight(static_cast<int64_t>(host_bad_row) * K + column, K, value);
}

}  // namespace

bitnet_status bn_cuda_quantize_i2s(int32_t device, const void *w, int32_t w_dtype, int64_t M,
                                   int64_t K, const int64_t *row_segments, int64_t n_segments,
                                   uint8_t *w_packed, float *w_scales, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    if (M > INT32_MAX)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_quantize_i2s: M = %lld rows is over the "
                       "CUDA grid limit", (long long)M);
    cudaStream_t s = bn_stream(stream);
    BN_TRY(refuse_capture("bitnet_quantize_i2s", s));
    double *row_sums = nullptr; /* [M], then the flagged row */
    BN_TRY(bn_cuda_scratch_alloc(device, M * sizeof(double) + sizeof(unsigned long long), s,
                                 reinterpret_cast<void **>(&row_sums)));
    const bitnet_status status = quantize_i2s(
        device, w, w_dtype, M, K, row_segments, n_segments, row_sums,
        reinterpret_cast<unsigned long long *>(row_sums + M), w_packed, w_scales, s);
    const cudaError_t free_err = cudaFreeAsync(row_sums, s);
    if (status == BITNET_OK) BN_CUDA_TRY(free_err);
    return status;
}

bitnet_status bn_cuda_pack_ternary(int32_t device, const int8_t *w_q, int64_t M, int64_t K,
                                   uint8_t *w_packed, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    cudaStream_t s = bn_stream(stream);
    int64_t count = M * K, bad = -1;
    BN_TRY(first_flagged("bitnet_pack_ternary", device, s, [&](unsigned long long *first) {
        find_non_ternary<<<grid_for(count / 16), kThreads, 0, s>>>(w_q, count, first);
    }, &bad));
    if (bad >= 0) {
        int8_t value = 0;
        BN_CUDA_TRY(cudaMemcpy(&value, w_q + bad, 1, cudaMemcpyDeviceToHost));
        return bn_fail(BITNET_ERR_INVALID_ARGUMENT, "bitnet_pack_ternary: w_q[%lld, %lld] = %d is "
                       "not -1, 0 or 1", (long long)(bad / K), (long long)(bad % K), value);
    }
    pack_values<<<grid_for(count / 16), kThreads, 0, s>>>(w_q, count / 16,
                                                          reinterpret_cast<uint32_t *>(w_packed));
    BN_CUDA_CHECK_LAUNCH("pack_values");
    return BITNET_OK;
}

bitnet_status bn_cuda_unpack_ternary(int32_t device, const uint8_t *w_packed, int64_t M, int64_t K,
                                     int8_t *w_q, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    int64_t words = M * K / 16;
    unpack_values<<<grid_for(words), kThreads, 0, bn_stream(stream)>>>(
        reinterpret_cast<const uint32_t *>(w_packed), words, w_q);
    BN_CUDA_CHECK_LAUNCH("unpack_values");
    return BITNET_OK;
}

bitnet_status bn_cuda_quantize_a8(int32_t device, const void *x, int32_t x_dtype, int64_t N,
                                  int64_t K, int8_t *x_q, float *x_scales, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    if (N > INT32_MAX)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_quantize_a8: N = %lld rows is over the CUDA "
                       "grid limit", (long long)N);
    quantize_rows_a8<<<static_cast<unsigned>(N), kThreads, 0, bn_stream(stream)>>>(x, x_dtype, K,
                                                                                  x_q, x_scales);
    BN_CUDA_CHECK_LAUNCH("quantize_rows_a8");
    return BITNET_OK;
}
