/* What the W2A8 GEMM kernels share (gemm_w2a8.cu: mma.sync, sm_80+; gemm_w2a8_sm90.cu: wgmma,
 * sm_90a): the arguments, the shared-memory tile layouts (which the sm_90a kernel's TMA swizzles
 * reproduce) and the epilogue's rule (common.cuh's bn_w2a8_scaled for an int32 dot). */
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

/* Byte offset of 16-byte chunk c of row r in a stage's x tile (rows of 128 bytes): the XOR puts the 8
 * rows that one ldmatrix matrix reads in 8 different chunks, so all 32 banks. */
__device__ __forceinline__ int x_tile_offset(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }
/* Byte offset of half h (16 bytes) of row n in a stage's weight tile (rows of 32 bytes): the 8 rows
 * that lanes g = 0..7 read at once land in 8 different bank quads. */
__device__ __forceinline__ int w_tile_offset(int n, int h) { return n * 32 + ((h ^ ((n >> 2) & 1)) << 4); }

__device__ __forceinline__ float scaled(int dot, float w_scale, float x_scale) {
    return bn_w2a8_scaled(static_cast<float>(dot), w_scale, x_scale);
}

/* The wgmma kernel (gemm_w2a8_sm90.cu, compute capability 9.0 only): blocks of `tokens` (64, 96 or 128)
 * tokens x `rows` (128, or 256 with 128 tokens) weight rows, or 160 tokens x 128 rows (one per SM, 8
 * stages, whole tiles), at most INT32_MAX blocks; one_per_sm: 128-row blocks of 64 to 128 tokens with
 * 10 stages, one per SM.
 * 128-row blocks split K over clusters of `split` (1, 2, 4 or 8) blocks, each taking >= 1 tile of K.
 * With split 1 and 128 tokens, `pieces` > 1 splits the tiles after the first `full_tiles` (128-row blocks, 5 stages)
 * over that many blocks each along K, each taking >= 1 tile of K; the last piece of a tile to finish
 * adds up the others' dots from scratch memory and stores the tile. */
bitnet_status gemm_w2a8_sm90(int32_t device, const GemmArgs &a, int rows, int tokens, bool one_per_sm, int split,
                             int64_t full_tiles, int pieces, cudaStream_t stream);

}  // namespace bn_gemm
