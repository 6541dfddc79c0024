/* Public entry points of the one-shot collectives over peer memory and of the CUDA IPC handles
 * that share the peer buffers between processes: the checks here, the work in cuda/allreduce.cu
 * (and cpu/allreduce.c for a single rank). */
#include <math.h>

#include "internal.h"

bitnet_status bitnet_peer_buffer_size(int64_t max_bytes, int64_t *bytes) {
    BN_CHECK(bytes, "bitnet_peer_buffer_size: bytes is NULL");
    BN_CHECK(max_bytes >= 1 && max_bytes <= ((int64_t)1 << 40),
             "bitnet_peer_buffer_size: max_bytes must be in [1, 2^40], got %lld",
             (long long)max_bytes);
    const int64_t slot = (max_bytes + BN_PEER_SLOT_ALIGN - 1) / BN_PEER_SLOT_ALIGN * BN_PEER_SLOT_ALIGN;
    *bytes = BN_PEER_HEADER_BYTES + 2 * slot;
    return BITNET_OK;
}

bitnet_status bitnet_set_current_device(int32_t device) {
    BN_CHECK(device >= 0, "bitnet_set_current_device: device %d is not a CUDA device index", device);
    BN_TRY(bn_check_device(device));
    return BN_CUDA(bn_cuda_set_current_device(device));
}

bitnet_status bitnet_ipc_get_handle(int32_t device, void *ptr, bitnet_ipc_handle *handle) {
    BN_CHECK(handle, "bitnet_ipc_get_handle: handle is NULL");
    BN_CHECK(device >= 0, "bitnet_ipc_get_handle: device %d is not a CUDA device index", device);
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_pointer(device, ptr, 1, "bitnet_ipc_get_handle: ptr"));
    return BN_CUDA(bn_cuda_ipc_get_handle(device, ptr, handle));
}

bitnet_status bitnet_ipc_open_handle(int32_t device, const bitnet_ipc_handle *handle, void **ptr) {
    BN_CHECK(handle && ptr, "bitnet_ipc_open_handle: %s is NULL", handle ? "ptr" : "handle");
    BN_CHECK(device >= 0, "bitnet_ipc_open_handle: device %d is not a CUDA device index", device);
    BN_TRY(bn_check_device(device));
    return BN_CUDA(bn_cuda_ipc_open_handle(device, handle, ptr));
}

bitnet_status bitnet_ipc_close_handle(int32_t device, void *ptr) {
    BN_CHECK(ptr, "bitnet_ipc_close_handle: ptr is NULL");
    BN_CHECK(device >= 0, "bitnet_ipc_close_handle: device %d is not a CUDA device index", device);
    BN_TRY(bn_check_device(device));
    return BN_CUDA(bn_cuda_ipc_close_handle(device, ptr));
}

/* The checks both collectives share: the ranks, the buffer table and its size (the data slot's
 * bytes go to *slot_bytes), the message size, and x, y and this rank's buffer as arrays. */
static bitnet_status check_peer_call(const char *op, int32_t device, int64_t x_bytes,
                                     int64_t y_bytes, int in_place_allowed, const void *x, void *y,
                                     void *const *buffers, int32_t world, int32_t rank,
                                     int64_t buffer_bytes, int64_t *slot_bytes) {
    BN_CHECK(world >= 1 && world <= BN_PEER_MAX_RANKS, "%s: world must be in [1, %d], got %d", op,
             BN_PEER_MAX_RANKS, world);
    BN_CHECK(rank >= 0 && rank < world, "%s: rank %d is not in [0, %d)", op, rank, world);
    BN_CHECK(buffers, "%s: buffers is NULL", op);
    for (int32_t r = 0; r < world; r++)
        BN_CHECK(buffers[r], "%s: buffers[%d] is NULL", op, r);
    const int64_t data = buffer_bytes - BN_PEER_HEADER_BYTES;
    BN_CHECK(data >= 2 * BN_PEER_SLOT_ALIGN && data % (2 * BN_PEER_SLOT_ALIGN) == 0,
             "%s: buffer_bytes = %lld is not a size bitnet_peer_buffer_size gives", op,
             (long long)buffer_bytes);
    *slot_bytes = data / 2;
    BN_CHECK(x_bytes <= *slot_bytes,
             "%s: %lld bytes per rank do not fit buffers made for %lld (bitnet_peer_buffer_size)",
             op, (long long)x_bytes, (long long)*slot_bytes);
    if (device == BITNET_DEVICE_CPU && world > 1)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: the CPU backend has no peers (world must be 1, "
                       "got %d)", op, world);
    const bn_array arrays[] = {
        {"x", x, x_bytes, 16, BN_READ},
        {"y", y, y_bytes, 16, BN_WRITTEN | (in_place_allowed ? BN_MAY_EQUAL(0) : 0)},
        {"buffers[rank]", buffers[rank], buffer_bytes, BN_PEER_SLOT_ALIGN, BN_WRITTEN}};
    BN_CHECK_ARRAYS(op, device, arrays, "y may equal x (same dtype); no other arrays may overlap");
    return BITNET_OK;
}

bitnet_status bitnet_peer_allreduce(int32_t device, int32_t x_dtype, int32_t y_dtype, int64_t n,
                                    const void *x, void *y, void *const *buffers, int32_t world,
                                    int32_t rank, int64_t buffer_bytes, void *stream) {
    const char *op = "bitnet_peer_allreduce";
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_float_dtype(op, "x_dtype", x_dtype));
    BN_TRY(bn_check_float_dtype(op, "y_dtype", y_dtype));
    BN_CHECK(n >= 1, "%s: n must be at least 1, got %lld", op, (long long)n);
    BN_TRY(bn_check_size("bitnet_peer_allreduce: x", n, bn_dtype_size(x_dtype)));
    BN_TRY(bn_check_size("bitnet_peer_allreduce: y", n, bn_dtype_size(y_dtype)));
    int64_t slot_bytes = 0;
    BN_TRY(check_peer_call(op, device, n * bn_dtype_size(x_dtype), n * bn_dtype_size(y_dtype),
                           x_dtype == y_dtype, x, y, buffers, world, rank, buffer_bytes,
                           &slot_bytes));
    if (device == BITNET_DEVICE_CPU) return bn_cpu_peer_allreduce(x_dtype, y_dtype, n, x, y);
    return BN_CUDA(bn_cuda_peer_allreduce(device, x_dtype, y_dtype, n, x, y, buffers, world, rank,
                                          slot_bytes, stream));
}

bitnet_status bitnet_peer_allreduce_rms(int32_t device, int32_t y_dtype, int64_t T, int64_t n,
                                        int64_t norm_cols, float eps, const float *x, void *y,
                                        void *const *buffers, int32_t world, int32_t rank,
                                        int64_t buffer_bytes, void *stream) {
    const char *op = "bitnet_peer_allreduce_rms";
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_float_dtype(op, "y_dtype", y_dtype));
    BN_CHECK(T >= 1 && n >= 1 && norm_cols >= 1,
             "%s: T, n and norm_cols must be at least 1, got T=%lld, n=%lld, norm_cols=%lld", op,
             (long long)T, (long long)n, (long long)norm_cols);
    BN_CHECK(n <= INT64_MAX / T - 1, "%s: T*n + T overflows (T=%lld, n=%lld)", op, (long long)T,
             (long long)n);
    BN_CHECK(isfinite(eps) && eps >= 0.0f, "%s: eps must be finite and >= 0, got %g", op,
             (double)eps);
    BN_TRY(bn_check_size("bitnet_peer_allreduce_rms: x", T * n + T, 4));
    BN_TRY(bn_check_size("bitnet_peer_allreduce_rms: y", T * n, bn_dtype_size(y_dtype)));
    int64_t slot_bytes = 0;
    BN_TRY(check_peer_call(op, device, (T * n + T) * 4, T * n * bn_dtype_size(y_dtype), 0, x, y,
                           buffers, world, rank, buffer_bytes, &slot_bytes));
    if (device == BITNET_DEVICE_CPU)
        return bn_cpu_peer_allreduce_rms(y_dtype, T, n, norm_cols, eps, x, y);
    return BN_CUDA(bn_cuda_peer_allreduce_rms(device, y_dtype, T, n, norm_cols, eps, x, y, buffers,
                                              world, rank, slot_bytes, stream));
}

bitnet_status bitnet_peer_allgather(int32_t device, int32_t dtype, const int64_t *counts,
                                    const void *x, void *y, void *const *buffers, int32_t world,
                                    int32_t rank, int64_t buffer_bytes, void *stream) {
    const char *op = "bitnet_peer_allgather";
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_float_dtype(op, "dtype", dtype));
    BN_CHECK(world >= 1 && world <= BN_PEER_MAX_RANKS, "%s: world must be in [1, %d], got %d", op,
             BN_PEER_MAX_RANKS, world);
    BN_CHECK(counts, "%s: counts is NULL", op);
    const int64_t size = bn_dtype_size(dtype);
    int64_t largest = 0, total = 0;
    for (int32_t r = 0; r < world; r++) {
        BN_CHECK(counts[r] >= 1 && counts[r] <= ((int64_t)1 << 40),
                 "%s: counts[%d] = %lld is not in [1, 2^40]", op, r, (long long)counts[r]);
        largest = counts[r] > largest ? counts[r] : largest;
        total += counts[r];
    }
    BN_CHECK(rank >= 0 && rank < world, "%s: rank %d is not in [0, %d)", op, rank, world);
    int64_t slot_bytes = 0;
    BN_TRY(check_peer_call(op, device, counts[rank] * size, total * size, 0, x, y, buffers, world,
                           rank, buffer_bytes, &slot_bytes));
    BN_CHECK(largest * size <= slot_bytes,
             "%s: the largest piece (%lld bytes) does not fit buffers made for %lld", op,
             (long long)(largest * size), (long long)slot_bytes);
    if (device == BITNET_DEVICE_CPU) return bn_cpu_peer_allreduce(dtype, dtype, total, x, y);
    return BN_CUDA(bn_cuda_peer_allgather(device, dtype, counts, x, y, buffers, world, rank,
                                          slot_bytes, stream));
}

bitnet_status bitnet_peer_abort(int32_t device, void *buffer) {
    BN_CHECK(device >= 0, "bitnet_peer_abort: device %d is not a CUDA device index", device);
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_pointer(device, buffer, BN_PEER_SLOT_ALIGN, "bitnet_peer_abort: buffer"));
    return BN_CUDA(bn_cuda_peer_abort(device, buffer));
}
