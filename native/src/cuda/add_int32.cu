/* Device int32 increment: x[i] += delta (wrapping), one thread per element, launched with
 * programmatic dependent launch. */
#include "common.cuh"

namespace {

__global__ void add_int32_kernel(int32_t *x, int64_t n, int32_t delta) {
    bn_pdl_wait();
    bn_pdl_launch_dependents();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = (int32_t)((uint32_t)x[i] + (uint32_t)delta);
}

}  // namespace

bitnet_status bn_cuda_add_int32(int32_t device, int32_t *x, int64_t n, int32_t delta, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BN_CUDA_TRY(bn_launch_pdl(add_int32_kernel, dim3(bn_ceil_div(n, 256)), dim3(256), 0,
                              bn_stream(stream), x, n, delta));
    return BITNET_OK;
}
