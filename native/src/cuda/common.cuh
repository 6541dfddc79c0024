/* Shared by the CUDA sources: error checking that turns CUDA errors into a status and a message,
 * and a guard that makes a device current for one scope and restores the caller's afterwards. */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../internal.h"

/* float32 to and from the storage dtypes, rounding to nearest even. */
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

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

/* Inline assembly that needs sm_80 or newer. Launchers never run such code on older GPUs; compiled
 * for them it only traps, which keeps the multi-architecture build going. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define BN_SM80_ASM(...) __trap()
#else
#define BN_SM80_ASM(...) asm volatile(__VA_ARGS__)
#endif

/* The compute capability's major number of the current device. */
static inline cudaError_t bn_current_cc_major(int *major) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    return err != cudaSuccess ? err
                              : cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device);
}

/* Whether `device` runs the kernels built for sm_90a alone (the *_sm90.cu files): compute capability
 * exactly 9.0. */
static inline cudaError_t bn_runs_sm90a(int32_t device, bool *yes) {
    int major = 0, minor = 0;
    cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    *yes = err == cudaSuccess && major == 9 && minor == 0;
    return err;
}

/* Programmatic dependent launch (sm_90 and newer; no-ops before). A kernel launched by
 * bn_launch_pdl may start while the previous kernel on its stream still runs: bn_pdl_wait() returns
 * once that kernel has finished and its writes are visible, so nothing that kernel may write is
 * touched before it; bn_pdl_launch_dependents() lets the next kernel start launching early. */
__device__ __forceinline__ void bn_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void bn_pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Asks L2 for the 128-byte lines that hold p[first, first + count) (floats, first a multiple of 32),
 * up to p[end - 1]: one line for each thread numbered 0, 1, ... by `thread`. A kernel whose last
 * steps read such values (the scales of its epilogue) then waits on L2 there, not on DRAM. */
__device__ __forceinline__ void bn_prefetch_l2(const float *p, int first, int count, int end, int thread) {
    const int i = first + 32 * thread;
    if (thread >= 0 && 32 * thread < count && i < end) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i));
}

/* kernel<<<grid, block, shared_bytes, stream>>>(args...) in thread-block clusters of `cluster`
 * blocks along x (1: none; more needs sm_90), with programmatic stream serialization on GPUs that
 * have it. */
template <typename... Params, typename... Args>
cudaError_t bn_launch_pdl_cluster(void (*kernel)(Params...), dim3 grid, dim3 block,
                                  size_t shared_bytes, unsigned cluster, cudaStream_t stream,
                                  Args... args) {
    int major = 0;
    cudaError_t err = bn_current_cc_major(&major);
    if (err != cudaSuccess) return err;
    cudaLaunchAttribute attributes[2] = {};
    unsigned count = 0;
    if (major >= 9) {
        attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attributes[count++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (cluster > 1) {
        attributes[count].id = cudaLaunchAttributeClusterDimension;
        attributes[count++].val.clusterDim = {cluster, 1, 1};
    }
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = shared_bytes;
    config.stream = stream;
    config.attrs = attributes;
    config.numAttrs = count;
    return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

/* The GPU that a call plans its launches for: its index and its SM count. */
struct BnGpu {
    int32_t device;
    int32_t sms;
};

template <typename... Params, typename... Args>
cudaError_t bn_launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                          cudaStream_t stream, Args... args) {
    return bn_launch_pdl_cluster(kernel, grid, block, shared_bytes, 1, stream, args...);
}

/* c += a (16x16, row) * b (16x8, col), 16-bit floats (T: __nv_bfloat16 or __half), f32 accumulate:
 * mma.sync m16n8k16, sm_80. */
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                   uint32_t b1) {
    BN_SM80_ASM("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
    BN_SM80_ASM("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static inline unsigned bn_ceil_div(int64_t a, int64_t b) { return (unsigned)((a + b - 1) / b); }

/* The gate of a gated linear unit for one element, in float32: act(gate) * up with act = relu2,
 * max(gate, 0)^2 (a NaN gate stays NaN), or silu, gate / (1 + e^-gate) (IEEE division and expf,
 * within 2 ulp, as the CPU's). ACT is a bitnet_activation. The one definition the CUDA kernels
 * share (bitnet_glu_rmsnorm; bitnet_glu_gate); the CPU's is bn_cpu_glu_span. */
template <int ACT> __device__ __forceinline__ float bn_glu(float gate, float up) {
    if constexpr (ACT == BITNET_ACTIVATION_SILU) {
        return gate / (1.0f + expf(-gate)) * up;
    } else {
        const float relu = gate < 0.0f ? 0.0f : gate;
        return relu * relu * up;
    }
}

/* A W2A8 output from its dot with the codes (exact, or a block-scaled sum) and the scales:
 * dot * w_scale / x_scale in float32, IEEE multiply then divide. The one rule of every W2A8
 * kernel (GEMV, GEMM, block-scaled, decode_layer), so that they give the same bits. */
__device__ __forceinline__ float bn_w2a8_scaled(float dot, float w_scale, float x_scale) {
    return __fdiv_rn(__fmul_rn(dot, w_scale), x_scale);
}

/* RoPE's angle of pair i of D at position p, p * theta^(-2i/D) in float64 (log2_theta =
 * log2(theta)), the product of p and the pair's inverse frequency; its cos and sin are taken in float64 and rounded to float32. With bn_rope_rotate,
 * the arithmetic of bitnet_rope_append_kv that every kernel applying RoPE shares. */
__device__ __forceinline__ double bn_rope_inv_freq(int i, int D, double log2_theta) {
    return exp2(-2.0 * i / D * log2_theta);
}
__device__ __forceinline__ double bn_rope_angle(int p, int i, int D, double log2_theta) {
    return (double)p * bn_rope_inv_freq(i, D, log2_theta);
}

/* The pair (a, c) = (x[i], x[i + D/2]) turned by the angle of (cs, sn), in float32, rounded to T. */
template <typename T>
__device__ __forceinline__ void bn_rope_rotate(float a, float c, float cs, float sn, T &lo, T &hi) {
    lo = from_float<T>(a * cs - c * sn);
    hi = from_float<T>(c * cs + a * sn);
}

/* The sum of every thread's v over a block of WARPS warps, in every thread; scratch holds WARPS
 * values in shared memory. */
template <int WARPS, typename V> __device__ __forceinline__ V bn_block_sum(V v, V *scratch) {
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(~0u, v, offset);
    __syncthreads();
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    V total = 0;
    for (int w = 0; w < WARPS; w++) total += scratch[w];
    return total;
}

/* max(a, b), or NaN if either is NaN (fmaxf returns the other operand): the activation
 * quantizers' row maxima, so that a non-finite input shows in the maximum (bn_max_or_nan on the
 * CPU). */
__device__ __forceinline__ float bn_fmax_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    float m;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
    return m;
#else
    return isnan(a) || isnan(b) ? __int_as_float(0x7fffffff) : fmaxf(a, b);
#endif
}

/* The scale of a quantized row with a value that is not finite: the quiet NaN of the CPU
 * backend's NAN, so that both backends store the same bits. */
__device__ __forceinline__ float bn_nan() { return __int_as_float(0x7fc00000); }
