/* What a persistent kernel's stage-to-stage dependency costs (issue 40, docs/log 2026-11-27-37):
 * one block per SM, 512 threads, all resident (cooperative launch), kIters dependent rounds, µs per
 * round from CUDA events around the launch, each case the median of 5 launches:
 *   grid.sync        cooperative_groups' grid barrier
 *   counter          every block: fence, atomicAdd on this round's counter, thread 0 polls it with
 *                    ld.acquire.gpu until all blocks arrived, block barrier (a barrier by counters)
 *   counter + slots  the same, each block first writing 2 floats to its slot of the round (a norm's
 *                    partial sum of squares and max), then every block reading all the slots (one
 *                    L2 round trip) and reducing them (a block reduction): a stage's overhead
 *                    without its GEMV in the design of 2026-11-27-37
 *   flags            every block: block barrier, thread 0 stores its flag of the round with
 *                    st.release.gpu; threads 0 .. blocks-1 poll one flag each with ld.acquire.gpu;
 *                    block barrier (a barrier with no atomic and no single hot address)
 *   flags + slots    the slots of "counter + slots" with the flags' barrier
 *   L2 chase         one thread's dependent loads through an L2-resident ring (L2 hit latency)
 *     nvcc -O3 -arch=sm_90 -o /tmp/hop_latency tools/dev/hop_latency.cu && /tmp/hop_latency */
#include <cooperative_groups.h>
#include <cstdio>
#include <algorithm>
#include <vector>

namespace cg = cooperative_groups;

constexpr int kThreads = 512, kIters = 2000, kChase = 4096;

__device__ __forceinline__ unsigned load_acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release(unsigned *p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* flags [gridDim.x]: this round's, zero before it. */
__device__ void flag_wait(unsigned *flags) {
    __syncthreads();
    if (threadIdx.x == 0) store_release(flags + blockIdx.x, 1u);
    for (int b = threadIdx.x; b < (int)gridDim.x; b += kThreads)
        while (load_acquire(flags + b) == 0) {}
    __syncthreads();
}

__device__ void counter_wait(unsigned *counter) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1u);
        while (load_acquire(counter) < gridDim.x) {}
    }
    __syncthreads();
}

__global__ void grid_sync_rounds() {
    cg::grid_group grid = cg::this_grid();
    for (int i = 0; i < kIters; i++) grid.sync();
}

__global__ void counter_rounds(unsigned *counters) {
    for (int i = 0; i < kIters; i++) counter_wait(counters + i);
}

__global__ void flag_rounds(unsigned *flags) {
    for (int i = 0; i < kIters; i++) flag_wait(flags + (size_t)i * gridDim.x);
}

/* FLAGS: the flags' barrier (sync points at kIters x gridDim.x flags), else the counters'. */
template <bool FLAGS> __global__ void slot_rounds(unsigned *sync, float2 *slots, float *sink) {
    __shared__ float partial[kThreads / 32];
    float total = 0.0f;
    for (int i = 0; i < kIters; i++) {
        float2 *round = slots + (size_t)i * gridDim.x;
        if (threadIdx.x == 0) round[blockIdx.x] = make_float2(1.0f + blockIdx.x, (float)i);
        if (FLAGS) flag_wait(sync + (size_t)i * gridDim.x);
        else counter_wait(sync + i);
        float v = 0.0f;
        for (int b = threadIdx.x; b < (int)gridDim.x; b += kThreads) v += __ldcg(&round[b].x);
        for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(~0u, v, o);
        if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
        __syncthreads();
        float sum = 0.0f;
        for (int w = 0; w < kThreads / 32; w++) sum += partial[w];
        total += sum;
        __syncthreads();
    }
    if (threadIdx.x == 0) sink[blockIdx.x] = total;
}

__global__ void chase(const unsigned *ring, unsigned *sink) {
    unsigned at = 0;
    for (int i = 0; i < kIters; i++) at = __ldcg(ring + at);
    *sink = at;
}

template <typename Launch> float median_us(Launch launch) {
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    std::vector<float> us;
    for (int run = 0; run < 6; run++) {
        cudaEventRecord(start);
        launch();
        cudaEventRecord(stop);
        cudaEventSynchronize(stop);
        float ms = 0.0f;
        cudaEventElapsedTime(&ms, start, stop);
        if (run > 0) us.push_back(ms * 1000.0f / kIters);
    }
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
}

int main() {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    unsigned *counters, *ring, *sink_u;
    float2 *slots;
    float *sink_f;
    const size_t sync_bytes = sizeof(unsigned) * kIters * sms;
    cudaMalloc(&counters, sync_bytes);
    cudaMalloc(&slots, sizeof(float2) * kIters * sms);
    cudaMalloc(&sink_f, sizeof(float) * sms);
    cudaMalloc(&ring, sizeof(unsigned) * kChase);
    cudaMalloc(&sink_u, sizeof(unsigned));
    std::vector<unsigned> next(kChase);
    for (int i = 0; i < kChase; i++) next[i] = (unsigned)((i + 1031) % kChase); /* 4 KB strides */
    cudaMemcpy(ring, next.data(), sizeof(unsigned) * kChase, cudaMemcpyHostToDevice);

    const dim3 grid(sms), block(kThreads);
    auto cooperative = [&](void *kernel, void **args) {
        cudaLaunchCooperativeKernel(kernel, grid, block, args, 0, nullptr);
    };
    const float sync_us = median_us([&] { cooperative((void *)grid_sync_rounds, nullptr); });
    void *counter_args[] = {&counters};
    const float counter_us = median_us([&] {
        cudaMemsetAsync(counters, 0, sizeof(unsigned) * kIters);
        cooperative((void *)counter_rounds, counter_args);
    });
    void *slot_args[] = {&counters, &slots, &sink_f};
    const float slot_us = median_us([&] {
        cudaMemsetAsync(counters, 0, sizeof(unsigned) * kIters);
        cooperative((void *)slot_rounds<false>, slot_args);
    });
    const float flag_us = median_us([&] {
        cudaMemsetAsync(counters, 0, sync_bytes);
        cooperative((void *)flag_rounds, counter_args);
    });
    const float flag_slot_us = median_us([&] {
        cudaMemsetAsync(counters, 0, sync_bytes);
        cooperative((void *)slot_rounds<true>, slot_args);
    });
    const float chase_us = median_us([&] { chase<<<1, 1>>>(ring, sink_u); });
    const cudaError_t status = cudaDeviceSynchronize();
    if (status != cudaSuccess) {
        printf("CUDA error: %s\n", cudaGetErrorString(status));
        return 1;
    }
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    printf("%s, %d SMs, %d threads a block, %d rounds (the counter and flag cases include a memset "
           "of their sync array)\n", prop.name, sms, kThreads, kIters);
    printf("| case | µs a round |\n| --- | --- |\n");
    printf("| grid.sync | %.3f |\n| counter | %.3f |\n| counter + slots | %.3f |\n| flags | %.3f |\n"
           "| flags + slots | %.3f |\n| L2 chase (one load) | %.3f |\n",
           sync_us, counter_us, slot_us, flag_us, flag_slot_us, chase_us);
    return 0;
}
