/* Gate of a gated linear unit: out[t, f] = act(gate_up[t, f]) * gate_up[t, F + f], in float32, act =
 * relu2 or silu (bn_glu). Layout gate_up [T, 2F] (gate columns first), out [T, F]. Grid-stride over
 * 8-element (16-byte) groups when F % 8 == 0 and the arrays are 16-byte aligned, else over single
 * elements. Bytes: 4TF read + 2TF written (bf16/f16); not benchmarked separately (a plain
 * streaming kernel). Launched with programmatic dependent launch. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attention_common.cuh"

namespace {

/* Each thread handles groups of W consecutive elements of one row (W = 8 or 1). */
template <typename T, int W, int ACT>
__global__ void glu_gate_kernel(const T *__restrict__ gate_up, T *__restrict__ out, int64_t T_rows,
                                int64_t F) {
    bn_pdl_wait();
    bn_pdl_launch_dependents();
    const int64_t groups_per_row = F / W, groups = T_rows * groups_per_row;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < groups;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / groups_per_row, f = i % groups_per_row * W;
        const T *gate = gate_up + t * 2 * F + f, *up = gate + F;
        T *dst = out + t * F + f;
        if constexpr (W == 8) {
            float g[8], u[8];
            unpack8<T>(*reinterpret_cast<const uint4 *>(gate), g);
            unpack8<T>(*reinterpret_cast<const uint4 *>(up), u);
            uint4 result;
            result.x = pack2<T>(bn_glu<ACT>(g[0], u[0]), bn_glu<ACT>(g[1], u[1]));
            result.y = pack2<T>(bn_glu<ACT>(g[2], u[2]), bn_glu<ACT>(g[3], u[3]));
            result.z = pack2<T>(bn_glu<ACT>(g[4], u[4]), bn_glu<ACT>(g[5], u[5]));
            result.w = pack2<T>(bn_glu<ACT>(g[6], u[6]), bn_glu<ACT>(g[7], u[7]));
            *reinterpret_cast<uint4 *>(dst) = result;
        } else {
            *dst = from_float<T>(bn_glu<ACT>(to_float(*gate), to_float(*up)));
        }
    }
}

template <typename T, int ACT>
bitnet_status launch(int64_t T_rows, int64_t F, const void *gate_up, void *out, cudaStream_t stream) {
    const bool vector = F % 8 == 0 && ((uintptr_t)gate_up | (uintptr_t)out) % 16 == 0;
    const int64_t groups = T_rows * F / (vector ? 8 : 1);
    const unsigned blocks = (unsigned)(groups < 256 * 4096 ? bn_ceil_div(groups, 256) : 4096);
    auto kernel = vector ? glu_gate_kernel<T, 8, ACT> : glu_gate_kernel<T, 1, ACT>;
    BN_CUDA_TRY(bn_launch_pdl(kernel, dim3(blocks), dim3(256), 0, stream,
                              static_cast<const T *>(gate_up), static_cast<T *>(out), T_rows, F));
    return BITNET_OK;
}

template <typename T>
bitnet_status launch(int32_t activation, int64_t T_rows, int64_t F, const void *gate_up, void *out,
                     cudaStream_t stream) {
    return activation == BITNET_ACTIVATION_SILU
               ? launch<T, BITNET_ACTIVATION_SILU>(T_rows, F, gate_up, out, stream)
               : launch<T, BITNET_ACTIVATION_RELU2>(T_rows, F, gate_up, out, stream);
}

} // namespace

bitnet_status bn_cuda_glu_gate(int32_t device, int32_t dtype, int64_t T, int64_t F,
                               int32_t activation, const void *gate_up, void *out, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    auto run = dtype == BITNET_DTYPE_BF16 ? launch<__nv_bfloat16> : launch<__half>;
    return run(activation, T, F, gate_up, out, bn_stream(stream));
}
