/* Shared by the CUDA sources: error checking that turns CUDA errors into a status and a message,
 * and a guard that makes a device current for one scope and restores the caller's afterwards. */
#pragma once

#include <cuda_runtime.h>

#include "../internal.h"

bitnet_status bn_cuda_fail(cudaError_t err, const char *call, const char *file, int line);

/* Evaluates a CUDA runtime call; on error, returns the mapped status from the enclosing function. */
#define BN_CUDA_TRY(call)                                                           \
    do {                                                                            \
        cudaError_t bn_e_ = (call);                                                 \
        if (bn_e_ != cudaSuccess) return bn_cuda_fail(bn_e_, #call, __FILE__, __LINE__); \
    } while (0)

/* After a <<<...>>> launch: reports a bad configuration or a failed launch. */
#define BN_CUDA_CHECK_LAUNCH(name) BN_CUDA_TRY(cudaGetLastError())

class BnDeviceGuard {
  public:
    BnDeviceGuard() = default;
    BnDeviceGuard(const BnDeviceGuard &) = delete;
    BnDeviceGuard &operator=(const BnDeviceGuard &) = delete;
    /* Makes `device` current; restores the previous device when the guard goes out of scope. */
    cudaError_t enter(int device) {
        cudaError_t err = cudaGetDevice(&previous_);
        if (err != cudaSuccess) return err;
        entered_ = true;
        return previous_ == device ? cudaSuccess : cudaSetDevice(device);
    }
    ~BnDeviceGuard() {
        if (entered_) cudaSetDevice(previous_);
    }

  private:
    int previous_ = 0;
    bool entered_ = false;
};

#define BN_CUDA_ENTER(guard, device) BN_CUDA_TRY((guard).enter(device))

static inline cudaStream_t bn_stream(void *stream) { return static_cast<cudaStream_t>(stream); }

static inline unsigned bn_ceil_div(int64_t a, int64_t b) { return (unsigned)((a + b - 1) / b); }
