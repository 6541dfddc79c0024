/* bitnet.h: the C ABI of libbitnet, BitNet b1.58 inference kernels for NVIDIA GPUs and the CPU.
 *
 * Conventions, for every entry point:
 * - It returns a bitnet_status. On anything but BITNET_OK, bitnet_get_last_error() gives a message
 *   for the calling thread, and outputs are left untouched whenever the arguments were rejected.
 * - The library never prints, exits or aborts.
 * - Sizes and counts are int64_t. Arrays are dense and row-major; shapes are given in comments.
 * - `device` picks the backend: BITNET_DEVICE_CPU (-1) for host memory, N >= 0 for CUDA device N,
 *   whose memory every array pointer must then point into.
 * - `stream` is a cudaStream_t (NULL: the legacy default stream); the CPU backend ignores it.
 *   GPU ops are asynchronous with respect to the host, like any kernel launch.
 *
 * The declarations between the CDEF markers are plain C that the Python package reads with cffi:
 * keep preprocessor lines out of that region.
 */
#ifndef BITNET_H
#define BITNET_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* BITNET_CDEF_BEGIN */

typedef enum {
    BITNET_OK = 0,
    BITNET_ERR_INVALID_ARGUMENT = 1, /* a NULL, misaligned or wrong-device pointer, a bad size or value */
    BITNET_ERR_UNSUPPORTED = 2,      /* valid, but not implemented for this shape, dtype or backend */
    BITNET_ERR_NO_DEVICE = 3,        /* no such CUDA device, or a CPU-only build */
    BITNET_ERR_OUT_OF_MEMORY = 4,
    BITNET_ERR_CUDA = 5,             /* the CUDA runtime or driver failed */
    BITNET_ERR_INTERNAL = 6
} bitnet_status;

typedef enum {
    BITNET_DTYPE_F32 = 0,
    BITNET_DTYPE_F16 = 1,
    BITNET_DTYPE_BF16 = 2,
    BITNET_DTYPE_I8 = 3,
    BITNET_DTYPE_I32 = 4,
    BITNET_DTYPE_U8 = 5
} bitnet_dtype;

enum { BITNET_DEVICE_CPU = -1 };

typedef enum {
    BITNET_COPY_HOST_TO_DEVICE = 0,
    BITNET_COPY_DEVICE_TO_HOST = 1,
    BITNET_COPY_DEVICE_TO_DEVICE = 2
} bitnet_copy_kind;

typedef struct {
    char name[256];
    char pci_bus_id[32];                         /* "0000:3b:00.0", as nvidia-smi shows it */
    int32_t index;
    int32_t compute_capability_major;
    int32_t compute_capability_minor;
    int64_t total_memory_bytes;
    int64_t free_memory_bytes;
    int32_t sm_count;
    int32_t max_threads_per_block;
    int64_t shared_memory_per_block_bytes;       /* without opting in */
    int64_t shared_memory_per_block_optin_bytes; /* the most a kernel can opt in to */
    int64_t l2_cache_bytes;
    int32_t memory_bus_width_bits;
    int32_t memory_clock_khz;
    double peak_bandwidth_gbps;                  /* 2 * clock * bus width: the datasheet figure */
    int32_t supports_fp16;
    int32_t supports_bf16;
    int32_t supports_int8_dot;                   /* dp4a */
    int32_t driver_version;                      /* e.g. 13000 for CUDA 13.0 */
    int32_t runtime_version;
} bitnet_device_info;

/* The thread's last error message ("" if none); valid until the thread's next failing call. */
bitnet_status bitnet_get_last_error(const char **message);

bitnet_status bitnet_get_version(int32_t *major, int32_t *minor, int32_t *patch);

/* 1 if this build has the CUDA backend, else 0. */
bitnet_status bitnet_has_cuda(int32_t *has_cuda);

/* Number of usable CUDA devices. No GPU, no driver or a CPU-only build give 0 with BITNET_OK, and
 * *reason (if reason is not NULL) says why; *reason is "" when count > 0. */
bitnet_status bitnet_device_count(int32_t *count, const char **reason);

bitnet_status bitnet_device_get_info(int32_t device, bitnet_device_info *info);

/* The CUDA device that ptr points into, or BITNET_DEVICE_CPU for host memory. */
bitnet_status bitnet_pointer_device(const void *ptr, int32_t *device);

/* Device memory. Allocations are aligned to at least 256 bytes. nbytes = 0 gives *ptr = NULL. */
bitnet_status bitnet_malloc(int32_t device, int64_t nbytes, void **ptr);
bitnet_status bitnet_free(int32_t device, void *ptr);

/* Copies on `stream`. Copies that touch host memory return once the host buffer may be reused
 * (they synchronize the stream); device-to-device copies are asynchronous. */
bitnet_status bitnet_memcpy(void *dst, const void *src, int64_t nbytes, bitnet_copy_kind kind,
                            void *stream);
bitnet_status bitnet_memset(void *ptr, int32_t byte_value, int64_t nbytes, void *stream);

bitnet_status bitnet_device_synchronize(int32_t device);
bitnet_status bitnet_stream_synchronize(void *stream);

/* ---- W2A8 GEMV and ternary / int8 quantization (docs/weight_format.md) ---- */

/* ---- RMSNorm and its fused variants ---- */

/* ---- Attention and the glue of a BitNet layer ---- */

/* BITNET_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* BITNET_H */
