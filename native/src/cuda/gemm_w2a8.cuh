/* What the W2A8 GEMM kernels share (gemm_w2a8.cu: mma.sync, sm_80+; gemm_w2a8_sm90.cu: wgmma,
 * sm_90a): the arguments, the cp.async copies, the shared-memory tile layouts and the epilogue. */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace bn_gemm {

constexpr int kTileK = 128;              /* weights per row per stage: 32 packed bytes */
constexpr int kTileKBytesW = kTileK / 4; /* packed bytes of a row per stage */

struct GemmArgs {
    const uint8_t *w; /* [M, K/4] */
    const float *w_scales;
    const int8_t *x; /* [N, K] */
    const float *x_scales;
    void *y; /* [N, M] */
    int32_t y_dtype;
    int M, K, N;
};

__device__ __forceinline__ uint32_t shared_address(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/* 16 bytes global -> shared, zero-filled where !valid (src must still be a mapped address). */
__device__ __forceinline__ void copy16(uint32_t dst, const void *src, bool valid) {
    BN_SM80_ASM("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy_commit() { BN_SM80_ASM("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void copy_wait() {
    BN_SM80_ASM("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

/* Byte offset of 16-byte chunk c of row r in a stage's x tile (rows of 128 bytes): the XOR puts the 8
 * rows that one ldmatrix matrix reads in 8 different chunks, so all 32 banks. */
__device__ __forceinline__ int x_tile_offset(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }
/* Byte offset of half h (16 bytes) of row n in a stage's weight tile (rows of 32 bytes): the 8 rows
 * that lanes g = 0..7 read at once land in 8 different bank quads. */
__device__ __forceinline__ int w_tile_offset(int n, int h) { return n * 32 + ((h ^ ((n >> 2) & 1)) << 4); }

__device__ __forceinline__ float scaled(int dot, float w_scale, float x_scale) {
    return __fdiv_rn(__fmul_rn(static_cast<float>(dot), w_scale), x_scale);
}

/* y[n, m] from the exact dot. */
__device__ __forceinline__ void store_one(const GemmArgs &a, int n, int m, int dot, float w_scale, float x_scale) {
    const int64_t index = static_cast<int64_t>(n) * a.M + m;
    if (a.y_dtype == BITNET_DTYPE_I32) {
        static_cast<int *>(a.y)[index] = dot;
        return;
    }
    const float v = scaled(dot, w_scale, x_scale);
    if (a.y_dtype == BITNET_DTYPE_F32) static_cast<float *>(a.y)[index] = v;
    else if (a.y_dtype == BITNET_DTYPE_F16) static_cast<__half *>(a.y)[index] = __float2half_rn(v);
    else static_cast<__nv_bfloat16 *>(a.y)[index] = __float2bfloat16_rn(v);
}

/* y[n, m] and y[n, m + 1] (the second only where pair). */
__device__ __forceinline__ void store_pair(const GemmArgs &a, int n, int m, int d0, int d1, float ws0, float ws1,
                                           float xs, bool pair) {
    const int64_t index = static_cast<int64_t>(n) * a.M + m;
    const bool vector = pair && (index % 2 == 0);
    if (a.y_dtype == BITNET_DTYPE_I32) {
        int *y = static_cast<int *>(a.y) + index;
        if (vector) *reinterpret_cast<int2 *>(y) = make_int2(d0, d1);
        else {
            y[0] = d0;
            if (pair) y[1] = d1;
        }
        return;
    }
    const float v0 = scaled(d0, ws0, xs), v1 = scaled(d1, ws1, xs);
    if (a.y_dtype == BITNET_DTYPE_F32) {
        float *y = static_cast<float *>(a.y) + index;
        if (vector) *reinterpret_cast<float2 *>(y) = make_float2(v0, v1);
        else {
            y[0] = v0;
            if (pair) y[1] = v1;
        }
    } else if (a.y_dtype == BITNET_DTYPE_F16) {
        __half *y = static_cast<__half *>(a.y) + index;
        if (vector) *reinterpret_cast<__half2 *>(y) = __halves2half2(__float2half_rn(v0), __float2half_rn(v1));
        else {
            y[0] = __float2half_rn(v0);
            if (pair) y[1] = __float2half_rn(v1);
        }
    } else {
        __nv_bfloat16 *y = static_cast<__nv_bfloat16 *>(a.y) + index;
        if (vector) *reinterpret_cast<__nv_bfloat162 *>(y) = __halves2bfloat162(__float2bfloat16_rn(v0), __float2bfloat16_rn(v1));
        else {
            y[0] = __float2bfloat16_rn(v0);
            if (pair) y[1] = __float2bfloat16_rn(v1);
        }
    }
}

}  // namespace bn_gemm
