// The floor for a kernel that streams N bytes once: a pure read (16-byte streaming loads, 8 in flight
// per thread) timed as tools/gpu_bench.py times ours. A CUDA graph makes back-to-back calls over
// buffers rotated through more than 512 MiB (L2 cold); the figure is the median of 7 replays, best
// over grid shapes. The sizes are the bytes of the open targets (docs/log/2026-11-23.md#2026-11-23-15). Two ways to launch:
// - serialized: each call starts after the previous one ends, as a kernel that reads the previous
//   kernel's output must;
// - PDL, no wait: programmatic dependent launch with no griddepcontrol.wait, so a call's blocks start
//   as soon as the previous call's leave room. No real dependent kernel can do this well.
// With --write-half, each call also writes half as many bytes as it reads (one 16-byte store per two
// loads), the 2:1 of rmsnorm_quantize's bf16 rows to int8 codes; MB then counts both.
//   nvcc -O3 -arch=sm_90 -o /tmp/read_floor tools/dev/read_floor.cu && /tmp/read_floor [--write-half] [MB ...]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "cuda_check.h"

constexpr int kLoadsInFlight = 8;

/* Reads src[0, n) once and, where dst is not null, writes dst[0, n / 2), each store the XOR of two
 * loaded vectors; *sink is written only if the data hashes to a value it never does, so the loads
 * cannot be removed. */
__global__ void stream_read(const uint4 *src, size_t n, uint4 *dst, unsigned *sink, int pdl) {
    if (pdl) asm volatile("griddepcontrol.launch_dependents;");
    unsigned hash = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x * kLoadsInFlight;
    for (size_t i = (size_t)blockIdx.x * blockDim.x * kLoadsInFlight + threadIdx.x; i < n; i += stride) {
        uint4 v[kLoadsInFlight];
#pragma unroll
        for (int u = 0; u < kLoadsInFlight; u++) {
            const size_t at = i + (size_t)u * blockDim.x;
            v[u] = at < n ? __ldcs(src + at) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kLoadsInFlight; u++) hash ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        if (dst == nullptr) continue;
        const size_t out = (i - threadIdx.x) / 2 + threadIdx.x; /* the pass's half, coalesced */
#pragma unroll
        for (int u = 0; u < kLoadsInFlight; u += 2)
            if (i + (size_t)u * blockDim.x < n)
                dst[out + (size_t)u / 2 * blockDim.x] = make_uint4(v[u].x ^ v[u + 1].x, v[u].y ^ v[u + 1].y,
                                                                   v[u].z ^ v[u + 1].z, v[u].w ^ v[u + 1].w);
    }
    if (hash == 0x12345678u) *sink = hash;
}

/* Median µs per call of a graph of `slots` calls, call s reading slot s (and writing slot s of
 * `out`, if not null). */
int time_graph(cudaStream_t stream, const uint4 *buffer, uint4 *out, size_t n, size_t slots, int blocks,
               int threads, int pdl, unsigned *sink, float *us) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (size_t s = 0; s < slots; s++) {
        cudaLaunchAttribute attribute = {};
        attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attribute.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t config = {};
        config.gridDim = blocks;
        config.blockDim = threads;
        config.stream = stream;
        config.attrs = &attribute;
        config.numAttrs = pdl ? 1 : 0;
        CHECK(cudaLaunchKernelEx(&config, stream_read, buffer + s * n, n, out ? out + s * (n / 2) : nullptr,
                                 sink, pdl));
    }
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaStreamSynchronize(stream));
    cudaEvent_t start, end;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&end));
    std::vector<float> times;
    for (int replay = 0; replay < 7; replay++) {
        CHECK(cudaEventRecord(start, stream));
        CHECK(cudaGraphLaunch(exec, stream));
        CHECK(cudaEventRecord(end, stream));
        CHECK(cudaEventSynchronize(end));
        float ms = 0.0f;
        CHECK(cudaEventElapsedTime(&ms, start, end));
        times.push_back(ms * 1e3f / slots);
    }
    std::sort(times.begin(), times.end());
    *us = times[times.size() / 2];
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(end));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    return 0;
}

int main(int argc, char **argv) {
    /* Default sizes: decode attention B = 1 at L = 1024, 4096 (K and V), rmsnorm_quantize
     * T = 4096, gemv 5120x27648, decode attention at L = 32768. */
    std::vector<double> sizes_mb = {2.62, 10.49, 31.47, 35.39, 83.9};
    const bool write_half = argc > 1 && std::string(argv[1]) == "--write-half";
    if (argc > 1 + write_half) sizes_mb.clear();
    for (int i = 1 + write_half; i < argc; i++) sizes_mb.push_back(atof(argv[i]));
    const size_t total = 1ull << 30;
    uint4 *buffer, *out = nullptr;
    unsigned *sink;
    cudaStream_t stream;
    CHECK(cudaMalloc(&buffer, total));
    if (write_half) CHECK(cudaMalloc(&out, total / 2));
    CHECK(cudaMalloc(&sink, sizeof(unsigned)));
    CHECK(cudaMemset(buffer, 1, total));
    CHECK(cudaStreamCreate(&stream));
    for (double mb : sizes_mb) {
        if (mb <= 0.0 || mb * 1e6 * 2 > total) {
            fprintf(stderr, "sizes are MB, from 0 to %zu\n", total / 2000000);
            return 1;
        }
        /* Bytes read: all of mb, or two thirds of it where a third is written. */
        const double moved_per_read = write_half ? 1.5 : 1.0;
        const size_t bytes = (size_t)(mb * 1e6 / moved_per_read) / 32 * 32, n = bytes / 16;
        const size_t slots = std::min(total / bytes, std::max<size_t>(2, (512ull << 20) / bytes + 1));
        for (int pdl = 0; pdl < 2; pdl++) {
            float best = 1e9f;
            int best_blocks = 0, best_threads = 0;
            for (int blocks : {132, 264, 528, 1056}) {
                for (int threads : {256, 512, 1024}) {
                    float us = 0.0f;
                    if (time_graph(stream, buffer, out, n, slots, blocks, threads, pdl, sink, &us)) return 1;
                    if (us < best) best = us, best_blocks = blocks, best_threads = threads;
                }
            }
            const double moved = bytes * moved_per_read;
            printf("%6.2f MB %-11s %-12s %7.2f us  %5.0f GB/s  (%d blocks of %d threads)\n", mb,
                   write_half ? "read+write" : "read", pdl ? "PDL, no wait" : "serialized", best,
                   moved / best / 1e3, best_blocks, best_threads);
        }
    }
    return 0;
}
