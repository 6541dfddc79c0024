/* The argument checks shared by every entry point: sizes, dtypes, devices, pointers (NULL,
 * alignment, which device's memory) and overlapping arrays. Below them: the device count and a
 * pointer's device, asked of the CUDA backend (device.c's entry points return the same). */
#include <stdio.h>

#include "internal.h"

int64_t bn_dtype_size(int32_t dtype) {
    switch (dtype) {
    case BITNET_DTYPE_F32: case BITNET_DTYPE_I32: return 4;
    case BITNET_DTYPE_F16: case BITNET_DTYPE_BF16: return 2;
    case BITNET_DTYPE_I8: case BITNET_DTYPE_U8: return 1;
    default: return 0;
    }
}

const char *bn_dtype_name(int32_t dtype) {
    static const char *names[] = {"float32", "float16", "bfloat16", "int8", "int32", "uint8"};
    return dtype >= 0 && dtype < (int32_t)(sizeof names / sizeof *names) ? names[dtype] : "unknown";
}

bitnet_status bn_device_count(int32_t *count, const char **reason) {
#ifdef BITNET_HAVE_CUDA
    return bn_cuda_device_count(count, reason);
#else
    *count = 0;
    if (reason) *reason = BN_NO_CUDA_MESSAGE;
    return BITNET_OK;
#endif
}

bitnet_status bn_pointer_device(const void *ptr, int32_t *device) {
#ifdef BITNET_HAVE_CUDA
    return bn_cuda_pointer_device(ptr, device);
#else
    (void)ptr;
    *device = BITNET_DEVICE_CPU;
    return BITNET_OK;
#endif
}

bitnet_status bn_check_size(const char *what, int64_t count, int64_t elem_size) {
    BN_CHECK(count > 0, "%s: size must be positive, got %lld", what, (long long)count);
    BN_CHECK(count <= INT64_MAX / elem_size,
             "%s: %lld elements of %lld bytes overflow a 64-bit byte count", what,
             (long long)count, (long long)elem_size);
    return BITNET_OK;
}

bitnet_status bn_check_matrix(const char *what, int64_t rows, int64_t cols, int64_t elem_size) {
    BN_CHECK(rows > 0 && cols > 0, "%s: size must be positive, got [%lld, %lld]", what,
             (long long)rows, (long long)cols);
    int64_t bytes;
    BN_CHECK(!__builtin_mul_overflow(cols, elem_size, &bytes) &&
                 !__builtin_mul_overflow(rows, bytes, &bytes),
             "%s: [%lld, %lld] elements of %lld bytes overflow a 64-bit byte count", what,
             (long long)rows, (long long)cols, (long long)elem_size);
    return BITNET_OK;
}

bitnet_status bn_check_activation_dtype(const char *op, int32_t device, int32_t dtype) {
    BN_CHECK(dtype == BITNET_DTYPE_F32 || dtype == BITNET_DTYPE_F16 || dtype == BITNET_DTYPE_BF16,
             "%s: dtype %d (%s) is not float32, float16 or bfloat16", op, dtype, bn_dtype_name(dtype));
    if (device != BITNET_DEVICE_CPU && dtype == BITNET_DTYPE_F32)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: float32 runs on the CPU only; use float16 or "
                       "bfloat16 on a GPU", op);
    return BITNET_OK;
}

bitnet_status bn_check_device(int32_t device) {
    if (device == BITNET_DEVICE_CPU) return BITNET_OK;
    BN_CHECK(device >= 0, "device %d is neither the CPU (-1) nor a CUDA device index", device);
    int32_t count = 0;
    const char *reason = "";
    BN_TRY(bn_device_count(&count, &reason));
    if (device >= count)
        return bn_fail(BITNET_ERR_NO_DEVICE, "CUDA device %d does not exist (%d found%s%s)", device,
                       count, count ? "" : ": ", reason);
    return BITNET_OK;
}

static int overlap(const bn_array *a, const bn_array *b) {
    if (!a->ptr || !b->ptr || a->bytes <= 0 || b->bytes <= 0) return 0;
    uintptr_t pa = (uintptr_t)a->ptr, pb = (uintptr_t)b->ptr;
    uintptr_t ea = pa + (uintptr_t)a->bytes, eb = pb + (uintptr_t)b->bytes;
    if (ea < pa) ea = UINTPTR_MAX; /* sizes past the address space: to its end */
    if (eb < pb) eb = UINTPTR_MAX;
    return pa < eb && pb < ea;
}

bitnet_status bn_check_disjoint(const char *fn, const bn_array *arrays, int n, const char *rule) {
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++) {
            const bn_array *a = &arrays[i], *b = &arrays[j];
            const int in_place = (BN_MAY_EQUAL_INDEX(a->flags) == j ||
                                  BN_MAY_EQUAL_INDEX(b->flags) == i) &&
                                 a->ptr == b->ptr && a->bytes == b->bytes;
            const int written = (a->flags | b->flags) & BN_WRITTEN;
            BN_CHECK(!written || in_place || !overlap(a, b), "%s: %s and %s overlap (%s)", fn,
                     a->name, b->name, rule);
        }
    return BITNET_OK;
}

bitnet_status bn_check_arrays(const char *fn, int32_t device, const bn_array *arrays, int n,
                              const char *rule) {
    for (int i = 0; i < n; i++) {
        const bn_array *a = &arrays[i];
        if (a->bytes == 0 || (!a->ptr && (a->flags & BN_OPTIONAL))) continue;
        char name[96];
        snprintf(name, sizeof name, "%s: %s", fn, a->name);
        BN_TRY(bn_check_pointer(device, a->ptr, a->align, name));
    }
    return bn_check_disjoint(fn, arrays, n, rule);
}

bitnet_status bn_check_pointer(int32_t device, const void *ptr, int64_t align, const char *name) {
    BN_CHECK(ptr != NULL, "%s is NULL", name);
    BN_CHECK((uintptr_t)ptr % (uintptr_t)align == 0, "%s (%p) is not aligned to %lld bytes", name,
             ptr, (long long)align);
    int32_t where = BITNET_DEVICE_CPU;
    BN_TRY(bn_pointer_device(ptr, &where));
    if (device == BITNET_DEVICE_CPU) {
        BN_CHECK(where == BITNET_DEVICE_CPU,
                 "%s (%p) is memory of CUDA device %d, but the op runs on the CPU", name, ptr, where);
        return BITNET_OK;
    }
    if (where == BITNET_DEVICE_CPU)
        return bn_fail(BITNET_ERR_INVALID_ARGUMENT,
                       "%s (%p) is host memory, but the op runs on CUDA device %d", name, ptr, device);
    BN_CHECK(where == device, "%s (%p) is on CUDA device %d, but the op runs on CUDA device %d", name,
             ptr, where, device);
    return BITNET_OK;
}
