/* CUDA backend of the device and memory entry points (device.c holds the argument checks). */
#include <stdio.h>
#include <string.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "common.cuh"

bitnet_status bn_cuda_fail(cudaError_t err, const char *call, const char *file, int line) {
    bitnet_status status = err == cudaErrorMemoryAllocation ? BITNET_ERR_OUT_OF_MEMORY
                           : err == cudaErrorNoDevice || err == cudaErrorInvalidDevice ||
                                     err == cudaErrorInsufficientDriver
                               ? BITNET_ERR_NO_DEVICE
                               : BITNET_ERR_CUDA;
    cudaGetLastError(); /* clear a non-sticky error so that later calls start clean */
    return bn_fail(status, "%s: %s (%s) at %s:%d", call, cudaGetErrorString(err),
                   cudaGetErrorName(err), file, line);
}

/* "X.Y" of a CUDA version number such as 12040. */
static void cuda_version(char (&text)[16], int version) {
    snprintf(text, sizeof text, "%d.%d", version / 1000, version % 1000 / 10);
}

/* Why cudaGetDeviceCount failed, in the user's terms: no NVIDIA driver at all (the runtime reports
 * that as an insufficient driver, with driver version 0), a driver older than the runtime this
 * library was built with, no device, or the runtime's own words. */
static void explain_no_device(cudaError_t err, char *why, size_t size) {
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver); /* 0 where no driver is installed */
    cudaRuntimeGetVersion(&runtime);
    cudaGetLastError();
    char have[16], need[16];
    cuda_version(have, driver);
    cuda_version(need, runtime);
    if (err == cudaErrorInsufficientDriver && driver == 0)
        snprintf(why, size, "no NVIDIA driver: libcuda.so.1 is not installed or cannot be loaded "
                 "(cudaGetDeviceCount: %s)", cudaGetErrorName(err));
    else if (err == cudaErrorInsufficientDriver)
        snprintf(why, size, "the NVIDIA driver is too old: it supports CUDA %s, and this libbitnet "
                 "was built with the CUDA %s runtime; update the driver, or build with an older "
                 "toolkit (cudaErrorInsufficientDriver)", have, need);
    else if (err == cudaErrorNoDevice)
        snprintf(why, size, "the NVIDIA driver (CUDA %s) finds no CUDA device (cudaErrorNoDevice)",
                 have);
    else
        snprintf(why, size, "cudaGetDeviceCount: %s (%s)", cudaGetErrorString(err),
                 cudaGetErrorName(err));
}

bitnet_status bn_cuda_device_count(int32_t *count, const char **reason) {
    static thread_local char why[384];
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        cudaGetLastError(); /* no device is an answer here, not an error to keep */
        explain_no_device(err, why, sizeof why);
        n = 0;
    } else {
        snprintf(why, sizeof why, "%s", n > 0 ? "" : "the CUDA runtime reports no device");
    }
    *count = n;
    if (reason) *reason = why;
    return BITNET_OK;
}

static cudaError_t get_attribute(int32_t *value, cudaDeviceAttr attr, int device) {
    int v = 0;
    cudaError_t err = cudaDeviceGetAttribute(&v, attr, device);
    *value = v;
    return err;
}

bitnet_status bn_cuda_device_get_info(int32_t device, bitnet_device_info *info) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    bitnet_device_info out;
    memset(&out, 0, sizeof out);
    out.index = device;

    cudaDeviceProp prop;
    BN_CUDA_TRY(cudaGetDeviceProperties(&prop, device));
    snprintf(out.name, sizeof out.name, "%s", prop.name);
    BN_CUDA_TRY(cudaDeviceGetPCIBusId(out.pci_bus_id, sizeof out.pci_bus_id, device));
    out.shared_memory_per_block_bytes = (int64_t)prop.sharedMemPerBlock;
    out.shared_memory_per_block_optin_bytes = (int64_t)prop.sharedMemPerBlockOptin;

    int32_t l2 = 0;
    BN_CUDA_TRY(get_attribute(&out.compute_capability_major, cudaDevAttrComputeCapabilityMajor, device));
    BN_CUDA_TRY(get_attribute(&out.compute_capability_minor, cudaDevAttrComputeCapabilityMinor, device));
    BN_CUDA_TRY(get_attribute(&out.sm_count, cudaDevAttrMultiProcessorCount, device));
    BN_CUDA_TRY(get_attribute(&out.max_threads_per_block, cudaDevAttrMaxThreadsPerBlock, device));
    BN_CUDA_TRY(get_attribute(&l2, cudaDevAttrL2CacheSize, device));
    BN_CUDA_TRY(get_attribute(&out.memory_bus_width_bits, cudaDevAttrGlobalMemoryBusWidth, device));
    BN_CUDA_TRY(get_attribute(&out.memory_clock_khz, cudaDevAttrMemoryClockRate, device));
    out.l2_cache_bytes = l2;
    /* Double data rate: two transfers per clock over the whole bus. */
    out.peak_bandwidth_gbps =
        2.0 * out.memory_clock_khz * 1e3 * (out.memory_bus_width_bits / 8.0) / 1e9;

    int cc = out.compute_capability_major * 10 + out.compute_capability_minor;
    out.supports_fp16 = cc >= 53;
    out.supports_bf16 = cc >= 80;
    out.supports_int8_dot = cc >= 61;

    size_t free_bytes = 0, total_bytes = 0;
    BN_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
    out.free_memory_bytes = (int64_t)free_bytes;
    out.total_memory_bytes = (int64_t)total_bytes;

    int driver = 0, runtime = 0;
    BN_CUDA_TRY(cudaDriverGetVersion(&driver));
    BN_CUDA_TRY(cudaRuntimeGetVersion(&runtime));
    out.driver_version = driver;
    out.runtime_version = runtime;

    *info = out;
    return BITNET_OK;
}

bitnet_status bn_cuda_sm_count(int32_t device, int32_t *sm_count) {
    int count = 0;
    BN_CUDA_TRY(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    *sm_count = count;
    return BITNET_OK;
}

namespace {
/* The occupancy answers found so far, per (device, kernel, threads, shared bytes, cluster size; 0
 * for blocks per SM), and the dynamic shared memory limit set per (device, kernel), which only
 * grows, so that a launch planned from a remembered answer stays within it. */
std::mutex occupancy_lock;
std::map<std::tuple<int32_t, const void *, int, size_t, int>, int> occupancy_known;
std::map<std::pair<int32_t, const void *>, size_t> shared_limits;

/* With occupancy_lock held. */
bitnet_status raise_shared_limit(int32_t device, const void *kernel, size_t shared_bytes) {
    size_t &limit = shared_limits[{device, kernel}];
    if (shared_bytes > 48 * 1024 && shared_bytes > limit) {
        BN_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(shared_bytes)));
        limit = shared_bytes;
    }
    return BITNET_OK;
}

/* Blocks per SM (cluster 0) or clusters of `cluster` blocks per GPU. */
bitnet_status occupancy(int32_t device, const void *kernel, int threads, size_t shared_bytes, int cluster,
                        int *count) {
    std::lock_guard<std::mutex> guard(occupancy_lock);
    const auto key = std::make_tuple(device, kernel, threads, shared_bytes, cluster);
    auto found = occupancy_known.find(key);
    if (found != occupancy_known.end()) {
        *count = found->second;
        return BITNET_OK;
    }
    BN_TRY(raise_shared_limit(device, kernel, shared_bytes));
    int n = 0;
    if (cluster == 0) {
        BN_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, shared_bytes));
    } else {
        if (cluster > 8)
            BN_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        cudaLaunchAttribute attribute = {};
        attribute.id = cudaLaunchAttributeClusterDimension;
        attribute.val.clusterDim = {(unsigned)cluster, 1, 1};
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3((unsigned)cluster);
        config.blockDim = dim3((unsigned)threads);
        config.dynamicSmemBytes = shared_bytes;
        config.attrs = &attribute;
        config.numAttrs = 1;
        BN_CUDA_TRY(cudaOccupancyMaxActiveClusters(&n, kernel, &config));
    }
    occupancy_known[key] = n;
    *count = n;
    return BITNET_OK;
}
} // namespace

bitnet_status bn_cuda_kernel_occupancy(int32_t device, const void *kernel, int threads, size_t shared_bytes,
                                       int *blocks) {
    return occupancy(device, kernel, threads, shared_bytes, 0, blocks);
}

bitnet_status bn_cuda_cluster_occupancy(int32_t device, const void *kernel, int cluster, int threads,
                                        size_t shared_bytes, int *clusters) {
    return occupancy(device, kernel, threads, shared_bytes, cluster, clusters);
}

bitnet_status bn_cuda_kernel_shared_memory(int32_t device, const void *kernel, size_t shared_bytes) {
    std::lock_guard<std::mutex> guard(occupancy_lock);
    return raise_shared_limit(device, kernel, shared_bytes);
}

namespace {
std::mutex scratch_lock;
std::map<int32_t, cudaMemPool_t> scratch_pools;

cudaError_t create_pool(int32_t device, cudaMemPool_t *pool) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaError_t err = cudaMemPoolCreate(pool, &props);
    if (err != cudaSuccess) return err;
    uint64_t keep_all = UINT64_MAX;
    err = cudaMemPoolSetAttribute(*pool, cudaMemPoolAttrReleaseThreshold, &keep_all);
    if (err != cudaSuccess) cudaMemPoolDestroy(*pool);
    return err;
}

/* With scratch_lock held. The first call may come while this thread captures a graph (the GEMM's
 * first pieces inside a captured model pass): the pool is made in the relaxed capture mode, since
 * the thread-local mode refuses cudaMemPoolCreate; it is not a stream operation, so the graph is
 * unaffected. */
bitnet_status scratch_pool(int32_t device, cudaMemPool_t *pool) {
    auto found = scratch_pools.find(device);
    if (found != scratch_pools.end()) {
        *pool = found->second;
        return BITNET_OK;
    }
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    BN_CUDA_TRY(cudaThreadExchangeStreamCaptureMode(&mode));
    const cudaError_t err = create_pool(device, pool);
    BN_CUDA_TRY(cudaThreadExchangeStreamCaptureMode(&mode));
    BN_CUDA_TRY(err);
    scratch_pools[device] = *pool;
    return BITNET_OK;
}
} // namespace

bitnet_status bn_cuda_scratch_alloc(int32_t device, int64_t nbytes, void *stream, void **ptr) {
    cudaMemPool_t pool;
    {
        std::lock_guard<std::mutex> guard(scratch_lock);
        BN_TRY(scratch_pool(device, &pool));
    }
    BN_CUDA_TRY(cudaMallocFromPoolAsync(ptr, static_cast<size_t>(nbytes), pool, bn_stream(stream)));
    return BITNET_OK;
}

bitnet_status bn_cuda_pointer_device(const void *ptr, int32_t *device) {
    cudaPointerAttributes attr;
    cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
    if (err != cudaSuccess) {
        /* No driver or no device: nothing can be device memory. */
        cudaGetLastError();
        *device = BITNET_DEVICE_CPU;
        return BITNET_OK;
    }
    bool on_device = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
    *device = on_device ? attr.device : BITNET_DEVICE_CPU;
    return BITNET_OK;
}

bitnet_status bn_cuda_malloc(int32_t device, int64_t nbytes, void **ptr) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    void *p = NULL;
    BN_CUDA_TRY(cudaMalloc(&p, (size_t)nbytes));
    *ptr = p;
    return BITNET_OK;
}

bitnet_status bn_cuda_free(int32_t device, void *ptr) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BN_CUDA_TRY(cudaFree(ptr));
    return BITNET_OK;
}

bitnet_status bn_cuda_memcpy(int32_t device, void *dst, const void *src, int64_t nbytes,
                             bitnet_copy_kind kind, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BN_CUDA_TRY(cudaMemcpyAsync(dst, src, (size_t)nbytes, cudaMemcpyDefault, bn_stream(stream)));
    if (kind != BITNET_COPY_DEVICE_TO_DEVICE) BN_CUDA_TRY(cudaStreamSynchronize(bn_stream(stream)));
    return BITNET_OK;
}

bitnet_status bn_cuda_memset(int32_t device, void *ptr, int32_t byte_value, int64_t nbytes,
                             void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BN_CUDA_TRY(cudaMemsetAsync(ptr, byte_value, (size_t)nbytes, bn_stream(stream)));
    return BITNET_OK;
}

bitnet_status bn_cuda_device_synchronize(int32_t device) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BN_CUDA_TRY(cudaDeviceSynchronize());
    return BITNET_OK;
}

bitnet_status bn_cuda_stream_synchronize(void *stream) {
    BN_CUDA_TRY(cudaStreamSynchronize(bn_stream(stream)));
    return BITNET_OK;
}
