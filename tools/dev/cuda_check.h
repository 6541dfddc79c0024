// CHECK(call) for the standalone CUDA probes in tools/: on an error, prints the call and the
// runtime's message and returns 1 from the enclosing function.
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
