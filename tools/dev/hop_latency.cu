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
 *   GEMV stage       a 2560 x 2560 packed-ternary GEMV stage in the design of 2026-11-27-37: each
 *                    warp loads its rows' weights (an L2-resident matrix) into registers before the
 *                    wait; after the counter, every block reads the previous round's output (2560
 *                    float32) and the 132 blocks' max slots, quantizes it to int8 codes in shared
 *                    memory, takes its rows' dp4a dots, stores them and its max slot; variants
 *                    leave parts out or change the dot's shape (gemv_rounds)
 *   L2 chase         one thread's dependent loads through an L2-resident ring (L2 hit latency)
 *     nvcc -O3 -arch=sm_90 -o /tmp/hop_latency tools/dev/hop_latency.cu && /tmp/hop_latency */
#include <cooperative_groups.h>
#include <cstdio>
#include <algorithm>
#include <vector>

#include "cuda_check.h"

namespace cg = cooperative_groups;

constexpr int kThreads = 512, kIters = 2000, kChase = 4096;

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

constexpr int kM = 2560, kK = 2560, kChunks = kK / 64; /* 16-byte chunks of 64 weights a row */

/* Byte offset of 16-byte piece q of chunk c of the codes in shared memory: gemv_dp4a.cuh's
 * x_offset (SWIZZLE), or plain. */
template <bool SWIZZLE> __device__ __forceinline__ int code_offset(int c, int q) {
    return c * 64 + 16 * (SWIZZLE ? q ^ ((c >> 1) & 3) : q);
}

/* READ: the previous round's output read and quantized (else codes of zeros); DOT: the dots taken
 * (else the rows' outputs are their weights' first words); the two off are parts of the stage left
 * out, to see what each costs. LANES lanes a row; FAST: 4 accumulators (the codes masked in place,
 * as gemv_w2a8.cu's one-token kernel) and swizzled codes, else one chain and plain codes.
 * Rounds alternate between the two halves of y [2][kM] and slots [2][gridDim.x]. */
template <bool READ, bool DOT, int LANES, bool FAST>
__global__ void gemv_rounds(unsigned *counters, const uint4 *w, float *y, float *slots, float *sink) {
    constexpr int kRowsPerWarp = 32 / LANES, kChunksPerLane = (kChunks + LANES - 1) / LANES;
    constexpr int kPasses = LANES == 32 ? 2 : 1; /* rows over the grid's 132 x 16 warps */
    __shared__ alignas(16) int8_t codes[kK];
    __shared__ float partial[kThreads / 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane % LANES;
    const int warps = gridDim.x * (kThreads / 32), global_warp = blockIdx.x * (kThreads / 32) + warp;
    auto row_of = [&](int pass) { return (global_warp + pass * warps) * kRowsPerWarp + lane / LANES; };
    float checksum = 0.0f;
    for (int i = 0; i < kIters; i++) {
        uint4 held[kPasses][kChunksPerLane];
#pragma unroll
        for (int r = 0; r < kPasses; r++)
#pragma unroll
            for (int c = 0; c < kChunksPerLane; c++) {
                const int row = row_of(r), chunk = sub + LANES * c;
                held[r][c] = row < kM && chunk < kChunks ? __ldcg(w + (size_t)row * kChunks + chunk) : make_uint4(0, 0, 0, 0);
            }
        counter_wait(counters + i);
        const float *y_in = y + (size_t)((i + 1) % 2) * kM, *slots_in = slots + (size_t)((i + 1) % 2) * gridDim.x;
        float v[kK / kThreads], max_v = threadIdx.x < (int)gridDim.x ? __ldcg(slots_in + threadIdx.x) : 0.0f;
#pragma unroll
        for (int e = 0; e < kK / kThreads; e++) v[e] = READ ? __ldcg(y_in + e * kThreads + threadIdx.x) : 0.0f;
        for (int o = 16; o > 0; o /= 2) max_v = fmaxf(max_v, __shfl_xor_sync(~0u, max_v, o));
        if (lane == 0) partial[warp] = max_v;
        __syncthreads();
        for (int k = 0; k < kThreads / 32; k++) max_v = fmaxf(max_v, partial[k]);
        const float scale = 127.0f / fmaxf(max_v, 1e-5f);
#pragma unroll
        for (int e = 0; e < kK / kThreads; e++) {
            const int k = e * kThreads + threadIdx.x;
            codes[code_offset<FAST>(k / 64, k % 64 / 16) + k % 16] = (int8_t)rintf(v[e] * scale);
        }
        __syncthreads();
        float block_max = 0.0f;
#pragma unroll
        for (int r = 0; r < kPasses; r++) {
            int acc[4] = {DOT ? 0 : (int)held[r][0].x, 0, 0, 0};
#pragma unroll
            for (int c = 0; c < kChunksPerLane; c++) {
                const int chunk = sub + LANES * c;
                if (!DOT || chunk >= kChunks) break;
                const uint32_t word[4] = {held[r][c].x, held[r][c].y, held[r][c].z, held[r][c].w};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int4 x = *reinterpret_cast<const int4 *>(codes + code_offset<FAST>(chunk, q));
                    if (FAST) {
                        acc[0] = __dp4a((int)(word[q] & 0x03030303u), x.x, acc[0]);
                        acc[1] = __dp4a((int)(word[q] & 0x0C0C0C0Cu), x.y, acc[1]);
                        acc[2] = __dp4a((int)(word[q] & 0x30303030u), x.z, acc[2]);
                        acc[3] = __dp4a((int)(word[q] & 0xC0C0C0C0u), x.w, acc[3]);
                    } else {
                        acc[0] = __dp4a((int)(word[q] & 0x03030303u), x.x, acc[0]);
                        acc[0] = __dp4a((int)((word[q] >> 2) & 0x03030303u), x.y, acc[0]);
                        acc[0] = __dp4a((int)((word[q] >> 4) & 0x03030303u), x.z, acc[0]);
                        acc[0] = __dp4a((int)((word[q] >> 6) & 0x03030303u), x.w, acc[0]);
                    }
                }
            }
            int dot = acc[0] + (acc[1] >> 2) + (acc[2] >> 4) + (acc[3] >> 6);
            for (int o = LANES / 2; o > 0; o /= 2) dot += __shfl_xor_sync(~0u, dot, o);
            const int row = row_of(r);
            const float out = (float)dot / (scale * 64.0f);
            if (sub == 0 && row < kM) y[(size_t)(i % 2) * kM + row] = out;
            block_max = fmaxf(block_max, row < kM ? fabsf(out) : 0.0f);
        }
        for (int o = 16; o >= LANES; o /= 2) block_max = fmaxf(block_max, __shfl_xor_sync(~0u, block_max, o));
        __syncthreads(); /* partial is reused */
        if (lane == 0) partial[warp] = block_max;
        __syncthreads();
        if (threadIdx.x == 0) {
            float m = 0.0f;
            for (int k = 0; k < kThreads / 32; k++) m = fmaxf(m, partial[k]);
            slots[(size_t)(i % 2) * gridDim.x + blockIdx.x] = m;
            checksum += m;
        }
    }
    if (threadIdx.x == 0) sink[blockIdx.x] = checksum;
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
    uint4 *weights;
    float *y, *y_slots;
    cudaMalloc(&weights, (size_t)kM * kChunks * sizeof(uint4));
    cudaMemset(weights, 0x55, (size_t)kM * kChunks * sizeof(uint4));
    cudaMalloc(&y, 2 * kM * sizeof(float));
    cudaMalloc(&y_slots, 2 * sms * sizeof(float));
    void *gemv_args[] = {&counters, &weights, &y, &y_slots, &sink_f};
    auto gemv_us = [&](void *kernel) {
        return median_us([&] {
            cudaMemsetAsync(counters, 0, sizeof(unsigned) * kIters);
            cudaMemsetAsync(y, 0, 2 * kM * sizeof(float));
            cudaMemsetAsync(y_slots, 0, 2 * sms * sizeof(float));
            cooperative(kernel, gemv_args);
        });
    };
    const float stage_us = gemv_us((void *)gemv_rounds<true, true, 32, false>);
    const float no_read_us = gemv_us((void *)gemv_rounds<false, true, 32, false>);
    const float no_dot_us = gemv_us((void *)gemv_rounds<true, false, 32, false>);
    const float fast32_us = gemv_us((void *)gemv_rounds<true, true, 32, true>);
    const float fast8_us = gemv_us((void *)gemv_rounds<true, true, 8, true>);
    const float fast8_no_dot_us = gemv_us((void *)gemv_rounds<true, false, 8, true>);
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
           "| flags + slots | %.3f |\n| GEMV stage | %.3f |\n| GEMV stage, no read of the input | %.3f |\n"
           "| GEMV stage, no dots | %.3f |\n| GEMV stage, 4 accumulators, swizzled codes | %.3f |\n"
           "| GEMV stage, 4 accumulators, swizzled codes, 8 lanes a row | %.3f |\n"
           "| the same, no dots | %.3f |\n| L2 chase (one load) | %.3f |\n",
           sync_us, counter_us, slot_us, flag_us, flag_slot_us, stage_us, no_read_us, no_dot_us,
           fast32_us, fast8_us, fast8_no_dot_us, chase_us);
    return 0;
}
