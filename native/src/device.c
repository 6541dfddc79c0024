/* Public device and memory entry points: validation here, the work in cuda/device.cu. */
#include "internal.h"

bitnet_status bitnet_has_cuda(int32_t *has_cuda) {
    BN_CHECK(has_cuda, "bitnet_has_cuda: has_cuda is NULL");
#ifdef BITNET_HAVE_CUDA
    *has_cuda = 1;
#else
    *has_cuda = 0;
#endif
    return BITNET_OK;
}

bitnet_status bitnet_device_count(int32_t *count, const char **reason) {
    BN_CHECK(count, "bitnet_device_count: count is NULL");
    return bn_device_count(count, reason);
}

bitnet_status bitnet_device_get_info(int32_t device, bitnet_device_info *info) {
    BN_CHECK(info, "bitnet_device_get_info: info is NULL");
    BN_CHECK(device >= 0, "bitnet_device_get_info: device %d is not a CUDA device index", device);
    BN_TRY(bn_check_device(device));
    return BN_CUDA(bn_cuda_device_get_info(device, info));
}

bitnet_status bitnet_pointer_device(const void *ptr, int32_t *device) {
    BN_CHECK(device, "bitnet_pointer_device: device is NULL");
    BN_CHECK(ptr, "bitnet_pointer_device: ptr is NULL");
    return bn_pointer_device(ptr, device);
}

bitnet_status bitnet_malloc(int32_t device, int64_t nbytes, void **ptr) {
    BN_CHECK(ptr, "bitnet_malloc: ptr is NULL");
    BN_CHECK(nbytes >= 0, "bitnet_malloc: nbytes must not be negative, got %lld", (long long)nbytes);
    BN_CHECK(device >= 0, "bitnet_malloc: device %d is not a CUDA device index", device);
    BN_TRY(bn_check_device(device));
    if (nbytes == 0) {
        *ptr = NULL;
        return BITNET_OK;
    }
    return BN_CUDA(bn_cuda_malloc(device, nbytes, ptr));
}

bitnet_status bitnet_free(int32_t device, void *ptr) {
    if (!ptr) return BITNET_OK;
    BN_CHECK(device >= 0, "bitnet_free: device %d is not a CUDA device index", device);
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_pointer(device, ptr, 1, "bitnet_free: ptr"));
    return BN_CUDA(bn_cuda_free(device, ptr));
}

bitnet_status bitnet_memcpy(void *dst, const void *src, int64_t nbytes, bitnet_copy_kind kind,
                            void *stream) {
    BN_CHECK(nbytes >= 0, "bitnet_memcpy: nbytes must not be negative, got %lld", (long long)nbytes);
    BN_CHECK(kind == BITNET_COPY_HOST_TO_DEVICE || kind == BITNET_COPY_DEVICE_TO_HOST ||
                 kind == BITNET_COPY_DEVICE_TO_DEVICE,
             "bitnet_memcpy: kind %d is not a bitnet_copy_kind", (int)kind);
    if (nbytes == 0) return BITNET_OK;
    BN_TRY(BN_CUDA(BITNET_OK));
    BN_CHECK(dst && src, "bitnet_memcpy: %s is NULL", dst ? "src" : "dst");
    int32_t dst_device = BITNET_DEVICE_CPU, src_device = BITNET_DEVICE_CPU;
    BN_TRY(bitnet_pointer_device(dst, &dst_device));
    BN_TRY(bitnet_pointer_device(src, &src_device));
    int dst_on_host = dst_device == BITNET_DEVICE_CPU, src_on_host = src_device == BITNET_DEVICE_CPU;
    BN_CHECK(dst_on_host == (kind == BITNET_COPY_DEVICE_TO_HOST),
             "bitnet_memcpy: dst (%p) is %s memory, which does not match the copy kind %d", dst,
             dst_on_host ? "host" : "device", (int)kind);
    BN_CHECK(src_on_host == (kind == BITNET_COPY_HOST_TO_DEVICE),
             "bitnet_memcpy: src (%p) is %s memory, which does not match the copy kind %d", src,
             src_on_host ? "host" : "device", (int)kind);
    const bn_array arrays[] = {{"src", src, nbytes, 1, BN_READ}, {"dst", dst, nbytes, 1, BN_WRITTEN}};
    BN_TRY(bn_check_disjoint("bitnet_memcpy", arrays, BN_COUNT(arrays),
                             "a copy's source and destination may not overlap"));
    int32_t device = dst_on_host ? src_device : dst_device;
    return BN_CUDA(bn_cuda_memcpy(device, dst, src, nbytes, kind, stream));
}

bitnet_status bitnet_memset(void *ptr, int32_t byte_value, int64_t nbytes, void *stream) {
    BN_CHECK(nbytes >= 0, "bitnet_memset: nbytes must not be negative, got %lld", (long long)nbytes);
    BN_CHECK(byte_value >= 0 && byte_value <= 255, "bitnet_memset: byte_value %d is not in 0..255",
             byte_value);
    if (nbytes == 0) return BITNET_OK;
    BN_TRY(BN_CUDA(BITNET_OK));
    BN_CHECK(ptr, "bitnet_memset: ptr is NULL");
    int32_t device = BITNET_DEVICE_CPU;
    BN_TRY(bitnet_pointer_device(ptr, &device));
    BN_CHECK(device != BITNET_DEVICE_CPU, "bitnet_memset: ptr (%p) is host memory", ptr);
    return BN_CUDA(bn_cuda_memset(device, ptr, byte_value, nbytes, stream));
}

bitnet_status bitnet_device_synchronize(int32_t device) {
    BN_CHECK(device >= 0, "bitnet_device_synchronize: device %d is not a CUDA device index", device);
    BN_TRY(bn_check_device(device));
    return BN_CUDA(bn_cuda_device_synchronize(device));
}

bitnet_status bitnet_stream_synchronize(void *stream) {
    return BN_CUDA(bn_cuda_stream_synchronize(stream));
}
