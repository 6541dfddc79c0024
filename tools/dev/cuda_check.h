// What the standalone CUDA probes in tools/ share: CHECK(call), which on an error prints the call
// and the runtime's message and returns 1 from the enclosing function, and load_acquire, a
// GPU-scope acquire load (the polling side of a counter or flag).
#pragma once

#include <cstdio>

#include <cuda_runtime.h>

#define CHECK(call)                                                                                \
    do {                                                                                           \
        cudaError_t e = (call);                                                                    \
        if (e != cudaSuccess) {                                                                    \
            fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e));                             \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

__device__ __forceinline__ unsigned load_acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
