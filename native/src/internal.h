/* Internal helpers shared by the public entry points and both backends. Not installed. */
#ifndef BITNET_INTERNAL_H
#define BITNET_INTERNAL_H

#include "bitnet.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BN_VERSION_MAJOR 0
#define BN_VERSION_MINOR 1
#define BN_VERSION_PATCH 0

/* Records a printf-style message for the calling thread and returns `status`. */
bitnet_status bn_fail(bitnet_status status, const char *format, ...)
    __attribute__((format(printf, 2, 3)));

#define BN_CHECK(cond, ...) \
    do { if (!(cond)) return bn_fail(BITNET_ERR_INVALID_ARGUMENT, __VA_ARGS__); } while (0)
#define BN_TRY(call) \
    do { bitnet_status bn_s_ = (call); if (bn_s_ != BITNET_OK) return bn_s_; } while (0)

/* Size of one element of `dtype`, or 0 for a value outside the enum. */
int64_t bn_dtype_size(int32_t dtype);
const char *bn_dtype_name(int32_t dtype);

/* Checks that count * elem_size fits in int64 and is positive. */
bitnet_status bn_check_size(const char *what, int64_t count, int64_t elem_size);

/* Checks that `ptr` is non-NULL, aligned to `align` bytes and, for a GPU op, points into the memory
 * of `device`. `name` names the argument in the message. */
bitnet_status bn_check_pointer(int32_t device, const void *ptr, int64_t align, const char *name);

/* Checks that `device` is the CPU or an existing CUDA device. */
bitnet_status bn_check_device(int32_t device);

/* The CUDA backend, present only when BITNET_HAVE_CUDA is defined. BN_CUDA(call) evaluates to the
 * call in a CUDA build and to a no-device error in a CPU-only build. */
#define BN_NO_CUDA_MESSAGE "this libbitnet was built without CUDA (no nvcc at build time)"
#ifdef BITNET_HAVE_CUDA
#define BN_CUDA(call) (call)
#else
/* sizeof names the call's arguments without evaluating it, so they count as used. */
#define BN_CUDA(call) (sizeof(call) ? bn_fail(BITNET_ERR_NO_DEVICE, BN_NO_CUDA_MESSAGE) : BITNET_OK)
#endif

bitnet_status bn_cuda_device_count(int32_t *count, const char **reason);
bitnet_status bn_cuda_device_get_info(int32_t device, bitnet_device_info *info);
bitnet_status bn_cuda_pointer_device(const void *ptr, int32_t *device);
bitnet_status bn_cuda_malloc(int32_t device, int64_t nbytes, void **ptr);
bitnet_status bn_cuda_free(int32_t device, void *ptr);
/* `device` is the device of the device-side pointer (of dst for device-to-device copies). */
bitnet_status bn_cuda_memcpy(int32_t device, void *dst, const void *src, int64_t nbytes,
                             bitnet_copy_kind kind, void *stream);
bitnet_status bn_cuda_memset(int32_t device, void *ptr, int32_t byte_value, int64_t nbytes,
                             void *stream);
bitnet_status bn_cuda_device_synchronize(int32_t device);
bitnet_status bn_cuda_stream_synchronize(void *stream);

/* Each op adds its backend entry points below: bn_cpu_<op> and bn_cuda_<op>, with the public
 * signature's arguments after validation. */

/* ---- W2A8 GEMV and ternary / int8 quantization ---- */

/* ---- RMSNorm ---- */

/* ---- Attention and layer glue ---- */

#ifdef __cplusplus
}
#endif

#endif /* BITNET_INTERNAL_H */
