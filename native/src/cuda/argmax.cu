/* Row-wise argmax on the device (greedy sampling): a block of 1024 threads per row, or on sm_90 a
 * cluster of up to 8 blocks per long row (one SM alone streams a 128256-float row in about 14 us);
 * each thread scans a strided share of its block's slice (16-byte loads where the row allows), then
 * warps, the block and the cluster reduce (value, index) pairs. numpy's rules: the first maximum
 * wins, and a NaN beats every number. Launched with programmatic dependent launch. Bytes: N*M*4. */

#include <cooperative_groups.h>

#include "common.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int THREADS = 1024;
constexpr int UNROLL = 4;
/* Rows of at least 2 * MIN_SLICE floats are split over up to MAX_SLICES blocks (a cluster). */
constexpr int64_t MIN_SLICE = 8192;
constexpr int MAX_SLICES = 8;

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

/* Block `slice` of row blockIdx.x / slices scans its share of the row; with several slices (one
 * thread-block cluster per row, sm_90) the slices' winners meet in the shared memory of rank 0.
 * A block may write another's shared memory only once that block runs: every block arrives on the
 * cluster barrier at its start and waits on it before its write. */
__global__ void __launch_bounds__(THREADS) argmax_kernel(const float *x, int64_t M, int slices,
                                                        int32_t *out) {
    __shared__ float warp_value[THREADS / 32];
    __shared__ int warp_index[THREADS / 32];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (slices > 1) cg::this_cluster().barrier_arrive();
#endif
    bn_pdl_wait();
    bn_pdl_launch_dependents();
    const int64_t row_index = blockIdx.x / slices;
    const int slice = blockIdx.x % slices;
    const float *row = x + row_index * M;
    const bool vector = M % 4 == 0 && (uintptr_t)row % 16 == 0;
    /* Slice bounds, in float4s on the vector path; every slice is non-empty (M >= slices). */
    const int64_t units = vector ? M / 4 : M;
    const int64_t begin = units * slice / slices, end = units * (slice + 1) / slices;
    float value = row[vector ? 4 * begin : begin];
    int index = (int)(vector ? 4 * begin : begin);
    if (vector) {
        /* UNROLL 16-byte loads in flight per thread. */
        const float4 *row4 = reinterpret_cast<const float4 *>(row);
        for (int64_t base = begin + threadIdx.x; base < end; base += THREADS * UNROLL) {
            float4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++)
                if (base + u * THREADS < end) v[u] = __ldcs(row4 + base + u * THREADS);
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                if (base + u * THREADS >= end) break;
                const int64_t m = 4 * (base + u * THREADS);
                consider(v[u].x, m, value, index);
                consider(v[u].y, m + 1, value, index);
                consider(v[u].z, m + 2, value, index);
                consider(v[u].w, m + 3, value, index);
            }
        }
    } else {
        for (int64_t m = begin + threadIdx.x; m < end; m += THREADS) consider(row[m], m, value, index);
    }
    warp_reduce(value, index);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_value[warp] = value, warp_index[warp] = index;
    __syncthreads();
    if (warp == 0) {
        value = warp_value[lane];
        index = warp_index[lane];
        warp_reduce(value, index);
    }
    if (slices == 1) {
        if (threadIdx.x == 0) out[row_index] = index;
        return;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ float slice_value[MAX_SLICES];
    __shared__ int slice_index[MAX_SLICES];
    cg::cluster_group cluster = cg::this_cluster();
    cluster.barrier_wait();
    if (threadIdx.x == 0) {
        *cluster.map_shared_rank(&slice_value[slice], 0) = value;
        *cluster.map_shared_rank(&slice_index[slice], 0) = index;
    }
    cluster.sync();
    if (slice == 0 && threadIdx.x == 0) {
        for (int s = 1; s < slices; s++) consider(slice_value[s], slice_index[s], value, index);
        out[row_index] = index;
    }
#endif
}

/* The largest cluster of argmax blocks (at most MAX_SLICES, a power of two) that `device` can place
 * (the occupancy queries are cached per device): a GPU or MIG partition with few SMs per GPC may
 * not fit 8 blocks of 1024 threads, and a cluster that cannot be placed fails to launch. Sizes that
 * fit are monotonic. */
bitnet_status placeable_slices(int32_t device, int *slices) {
    int fit = MAX_SLICES;
    for (; fit > 1; fit /= 2) {
        int clusters = 0;
        BN_TRY(bn_cuda_cluster_occupancy(device, reinterpret_cast<const void *>(argmax_kernel), fit, THREADS,
                                         0, &clusters));
        if (clusters > 0) break;
    }
    *slices = fit;
    return BITNET_OK;
}
}  // namespace

bitnet_status bn_cuda_argmax(int32_t device, const float *x, int64_t N, int64_t M, int32_t *index,
                             void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    int major = 0;
    BN_CUDA_TRY(bn_current_cc_major(&major));
    int64_t slices = major >= 9 ? M / MIN_SLICE : 1;
    slices = slices < 1 ? 1 : slices > MAX_SLICES ? MAX_SLICES : slices;
    if (slices > 1) {
        int placeable = 1;
        BN_TRY(placeable_slices(device, &placeable));
        slices = slices > placeable ? placeable : slices;
    }
    BN_CHECK(N <= INT32_MAX / slices, "argmax: N = %lld rows is more than one launch takes", (long long)N);
    BN_CUDA_TRY(bn_launch_pdl_cluster(argmax_kernel, dim3((unsigned)(N * slices)), dim3(THREADS), 0,
                                      (unsigned)slices, bn_stream(stream), x, M, (int)slices, index));
    return BITNET_OK;
}
