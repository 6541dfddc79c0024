/* What a dependency between two kernels of a decode step's chain costs (issue 40): a CUDA graph of
 * kChain kernels, each reading all of the previous kernel's 2560-float output (a GEMV's input) from
 * L2 and writing its share of its own, µs a kernel (graph replays timed by events, median of 5),
 * by how a kernel waits for the previous one:
 *   plain    no programmatic dependent launch: the graph's own kernel-to-kernel edge
 *   pdl      PDL (launch_dependents at the start), griddepcontrol.wait: the previous grid complete
 *            and its writes flushed
 *   counter  PDL, then thread 0 polls the previous kernel's arrival counter (ld.acquire.gpu) until
 *            every one of its blocks has added 1 after its stores (fence + atomicAdd); the last of
 *            this kernel's blocks to pass resets the counter for the next replay
 *   sleep    counter, polling with __nanosleep(64) between loads
 *   late     counter, launch_dependents only after the wait (one waiting grid at a time)
 *   none     PDL and no wait at all (wrong results; the floor of the chain)
 *     nvcc -O3 -arch=sm_90 -o /tmp/pdl_hop tools/dev/pdl_hop.cu && /tmp/pdl_hop */
#include <algorithm>
#include <cstdio>
#include <vector>

#include "cuda_check.h"

constexpr int kThreads = 256, kChain = 210, kN = 2560, kReplays = 20;

enum Mode { kPlain, kPdl, kCounter, kCounterSleep, kCounterLate, kNone };

/* counters[2k]: blocks of kernel k that have stored; counters[2k + 1]: blocks of kernel k + 1 past
 * their wait. */
template <Mode M>
__global__ void __launch_bounds__(kThreads) hop(const float *in, float *out, unsigned *counters, int k,
                                                unsigned prev_blocks, bool signal) {
    __shared__ float partial[kThreads / 32];
    constexpr bool counted = M == kCounter || M == kCounterSleep || M == kCounterLate;
    if (M != kPlain && M != kCounterLate) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (M == kPdl || (counted && k == 0)) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (counted && k > 0) {
        if (threadIdx.x == 0) {
            unsigned *arrived = counters + 2 * (k - 1);
            while (load_acquire(arrived) < prev_blocks)
                if (M == kCounterSleep) __nanosleep(64);
            if (atomicAdd(arrived + 1, 1u) == gridDim.x - 1) {
                atomicExch(arrived, 0u);
                atomicExch(arrived + 1, 0u);
            }
        }
        __syncthreads();
    }
    if (M == kCounterLate) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    float sum = 0.0f;
    for (int i = threadIdx.x; i < kN; i += kThreads) sum += __ldcg(in + i);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(~0u, sum, offset);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
    __syncthreads();
    sum = 0.0f;
    for (int w = 0; w < kThreads / 32; w++) sum += partial[w];
    const int share = (kN + gridDim.x - 1) / gridDim.x;
    for (int i = blockIdx.x * share + threadIdx.x; i < min(kN, (int)(blockIdx.x + 1) * share); i += kThreads)
        out[i] = __ldcg(in + i) * 0.5f + sum * 1e-9f;
    if (counted && signal) {
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(counters + 2 * k, 1u);
        }
    }
}

template <Mode M> int capture(cudaStream_t stream, int blocks, float *buffers, unsigned *counters, cudaGraphExec_t *exec) {
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int k = 0; k < kChain; k++) {
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(blocks);
        config.blockDim = dim3(kThreads);
        config.stream = stream;
        cudaLaunchAttribute attribute = {};
        attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attribute.val.programmaticStreamSerializationAllowed = 1;
        config.attrs = &attribute;
        config.numAttrs = M == kPlain ? 0 : 1;
        const float *in = buffers + (k % 2) * kN;
        float *out = buffers + ((k + 1) % 2) * kN;
        CHECK(cudaLaunchKernelEx(&config, hop<M>, in, out, counters, k, (unsigned)blocks, k + 1 < kChain));
    }
    cudaGraph_t graph;
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(exec, graph, 0));
    CHECK(cudaGraphDestroy(graph));
    return 0;
}

template <Mode M> int run(const char *name, int blocks, float *buffers, unsigned *counters) {
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraphExec_t exec;
    if (capture<M>(stream, blocks, buffers, counters, &exec)) return 1;
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaGraphLaunch(exec, stream));
    std::vector<float> us;
    for (int repeat = 0; repeat < 5; repeat++) {
        CHECK(cudaEventRecord(start, stream));
        for (int r = 0; r < kReplays; r++) CHECK(cudaGraphLaunch(exec, stream));
        CHECK(cudaEventRecord(stop, stream));
        CHECK(cudaEventSynchronize(stop));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, start, stop));
        us.push_back(ms * 1000.0f / (kReplays * kChain));
    }
    std::sort(us.begin(), us.end());
    printf("%-8s %4d blocks  %.3f us a kernel\n", name, blocks, us[2]);
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaStreamDestroy(stream));
    return 0;
}

int main() {
    float *buffers;
    unsigned *counters;
    CHECK(cudaMalloc(&buffers, 2 * kN * sizeof(float)));
    CHECK(cudaMemset(buffers, 0, 2 * kN * sizeof(float)));
    CHECK(cudaMalloc(&counters, 2 * kChain * sizeof(unsigned)));
    CHECK(cudaMemset(counters, 0, 2 * kChain * sizeof(unsigned)));
    for (int blocks : {40, 132, 264, 528}) {
        if (run<kPlain>("plain", blocks, buffers, counters) || run<kPdl>("pdl", blocks, buffers, counters) ||
            run<kCounter>("counter", blocks, buffers, counters) ||
            run<kCounterSleep>("sleep", blocks, buffers, counters) ||
            run<kCounterLate>("late", blocks, buffers, counters) || run<kNone>("none", blocks, buffers, counters))
            return 1;
    }
    return 0;
}
