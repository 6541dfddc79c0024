/* The pieces of the one-token W2A8 dot on dp4a that gemv_w2a8.cu's one-token kernel and
 * decode_layer.cu's GEMVs share: x's layout in shared memory, the dp4a of unsigned codes, the dot
 * from the masked partial dots. (The 16 dp4a of a chunk stay in each kernel's loop: as a shared
 * function they change the one-token kernel's machine code.) */
#pragma once

#include "common.cuh"

namespace bn_gemv {

/* Byte offset of 16-byte piece q of chunk c (64 bytes) of x in shared memory. The XOR spreads the
 * 8 consecutive chunks that a row's 8 lanes read over all banks. */
__device__ __forceinline__ int x_offset(int c, int q) { return c * 64 + 16 * (q ^ ((c >> 1) & 3)); }

/* c + sum of 4 products of the unsigned bytes of a and the signed bytes of b. */
__device__ __forceinline__ int dp4a_u8_s8(uint32_t a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

/* The dot of the codes from the partial dots acc[i] of the codes at shift i of each packed word,
 * masked in place (words & 0x03030303 << 2i: 4^i times the codes, no shift per word). */
__device__ __forceinline__ int codes_dot(const int (&acc)[4]) {
    return acc[0] + (acc[1] >> 2) + (acc[2] >> 4) + (acc[3] >> 6);
}

}  // namespace bn_gemv
