/* Embedding lookup on the device: one block per token copies its row. An id outside [0, V) (the
 * host cannot check device-resident ids) gives a row of NaN instead of an out-of-bounds read.
 * Launched with programmatic dependent launch. */
#include "common.cuh"

namespace {

template <typename T>
__global__ void embedding_kernel(const T *table, int64_t V, int64_t H, const int32_t *ids, T *out,
                                 T nan) {
    bn_pdl_wait();
    bn_pdl_launch_dependents();
    const int32_t id = ids[blockIdx.x];
    const bool valid = id >= 0 && id < V;
    T *dst = out + (int64_t)blockIdx.x * H;
    const T *src = table + (valid ? (int64_t)id * H : 0);
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) dst[h] = valid ? src[h] : nan;
}

}  // namespace

bitnet_status bn_cuda_embedding(int32_t device, int32_t dtype, const void *table, int64_t V,
                                int64_t H, const int32_t *ids, int64_t N, void *out, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BN_CHECK(N <= INT32_MAX, "embedding: N = %lld tokens is more than one launch takes", (long long)N);
    cudaStream_t s = bn_stream(stream);
    if (dtype == BITNET_DTYPE_F32)
        BN_CUDA_TRY(bn_launch_pdl(embedding_kernel<uint32_t>, dim3((unsigned)N), dim3(256), 0, s,
                                  static_cast<const uint32_t *>(table), V, H, ids,
                                  static_cast<uint32_t *>(out), 0x7fc00000u));
    else  /* float16 and bfloat16 move as 16-bit words; only the NaN pattern differs */
        BN_CUDA_TRY(bn_launch_pdl(embedding_kernel<uint16_t>, dim3((unsigned)N), dim3(256), 0, s,
                                  static_cast<const uint16_t *>(table), V, H, ids,
                                  static_cast<uint16_t *>(out),
                                  dtype == BITNET_DTYPE_F16 ? (uint16_t)0x7e00 : (uint16_t)0x7fc0));
    return BITNET_OK;
}
