/* Row-wise argmax on the device (greedy sampling): one block of 1024 threads per row; each thread
 * scans a strided slice (16-byte loads where the row allows), then warps and the block reduce
 * (value, index) pairs. numpy's rules: the
 * first maximum wins, and a NaN beats every number. Bytes: N*M*4 read. */
#include "common.cuh"

namespace {

constexpr int THREADS = 1024;
constexpr int UNROLL = 4;

/* Whether candidate (a, ia) should replace (b, ib). */
__device__ inline bool better(float a, int ia, float b, int ib) {
    if (isnan(a)) return !isnan(b) || ia < ib;
    if (isnan(b)) return false;
    return a > b || (a == b && ia < ib);
}

__device__ inline void warp_reduce(float &value, int &index) {
    for (int offset = 16; offset > 0; offset /= 2) {
        float other = __shfl_xor_sync(0xffffffffu, value, offset);
        int other_index = __shfl_xor_sync(0xffffffffu, index, offset);
        if (better(other, other_index, value, index)) value = other, index = other_index;
    }
}

__device__ inline void consider(float candidate, int64_t m, float &value, int &index) {
    if (better(candidate, (int)m, value, index)) value = candidate, index = (int)m;
}

__global__ void __launch_bounds__(THREADS) argmax_kernel(const float *x, int64_t M, int32_t *out) {
    __shared__ float warp_value[THREADS / 32];
    __shared__ int warp_index[THREADS / 32];
    const float *row = x + (int64_t)blockIdx.x * M;
    float value = row[0];
    int index = 0;
    if (M % 4 == 0 && (uintptr_t)row % 16 == 0) {
        /* One block streams the whole row: UNROLL 16-byte loads in flight per thread. */
        const float4 *row4 = reinterpret_cast<const float4 *>(row);
        const int64_t M4 = M / 4;
        for (int64_t base = threadIdx.x; base < M4; base += THREADS * UNROLL) {
            float4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++)
                if (base + u * THREADS < M4) v[u] = __ldcs(row4 + base + u * THREADS);
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                const int64_t m = 4 * (base + u * THREADS);
                if (m >= M) break;
                consider(v[u].x, m, value, index);
                consider(v[u].y, m + 1, value, index);
                consider(v[u].z, m + 2, value, index);
                consider(v[u].w, m + 3, value, index);
            }
        }
    } else {
        for (int64_t m = threadIdx.x; m < M; m += THREADS) consider(row[m], m, value, index);
    }
    warp_reduce(value, index);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_value[warp] = value, warp_index[warp] = index;
    __syncthreads();
    if (warp != 0) return;
    value = warp_value[lane];
    index = warp_index[lane];
    warp_reduce(value, index);
    if (lane == 0) out[blockIdx.x] = index;
}

}  // namespace

bitnet_status bn_cuda_argmax(int32_t device, const float *x, int64_t N, int64_t M, int32_t *index,
                             void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BN_CHECK(N <= INT32_MAX, "argmax: N = %lld rows is more than one launch takes", (long long)N);
    argmax_kernel<<<(unsigned)N, THREADS, 0, bn_stream(stream)>>>(x, M, index);
    BN_CUDA_CHECK_LAUNCH("argmax_kernel");
    return BITNET_OK;
}
