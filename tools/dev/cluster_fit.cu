// How many thread-block clusters of each size (1 to 16) this GPU runs at once, for a kernel with one
// block per SM (the decode cluster path's case: 128 threads and over half an SM's shared memory).
// A cluster's blocks share one GPC, so the answers show the GPC sizes, which differ from one H100
// to another: at B = 1 a decode call takes 5 clusters of 16, and the next call's clusters start
// early only where more fit (docs/attention.md). Example (an H100 SXM of 2026-11-24):
//   sms 132; clusters at once by size: 1:132 2:66 3:39 4:30 5:22 6:17 7:15 8:15 9:9 10:7 ... 16:7
//   nvcc -arch=sm_90 -o /tmp/cluster_fit tools/dev/cluster_fit.cu && /tmp/cluster_fit
#include <cstdio>

#include <cuda_runtime.h>

#include "cuda_check.h"

constexpr int kThreads = 128, kSharedBytes = 200 << 10;

__global__ void one_block_per_sm(int *sink) {
    extern __shared__ int shared[];
    if (sink) sink[0] = shared[threadIdx.x];
}

int main() {
    CHECK(cudaFuncSetAttribute(one_block_per_sm, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes));
    CHECK(cudaFuncSetAttribute(one_block_per_sm, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    printf("sms %d; clusters at once by size:", sms);
    for (unsigned size = 1; size <= 16; size++) {
        cudaLaunchAttribute attribute = {};
        attribute.id = cudaLaunchAttributeClusterDimension;
        attribute.val.clusterDim = {size, 1, 1};
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(size);
        config.blockDim = dim3(kThreads);
        config.dynamicSmemBytes = kSharedBytes;
        config.attrs = &attribute;
        config.numAttrs = 1;
        int clusters = 0;
        CHECK(cudaOccupancyMaxActiveClusters(&clusters, one_block_per_sm, &config));
        printf(" %u:%d", size, clusters);
    }
    printf("\n");
    return 0;
}
