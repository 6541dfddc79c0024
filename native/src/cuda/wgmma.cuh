/* Hopper's warpgroup tensor-core instructions (wgmma, sm_90a), as the kernels built for that target
 * alone use them (gemm_w2a8_sm90.cu, attention_prefill_sm90.cu; see the Makefile). */
#pragma once

#include <stdint.h>

/* Inline assembly that needs sm_90a. Launchers run such code only on compute capability 9.0;
 * compiled for any other target it only traps. */
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ != 900 || !defined(__CUDA_ARCH_FEAT_SM90_ALL))
#define BN_SM90A_ASM(...) __trap()
#else
#define BN_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#endif

/* The 8 accumulator registers of a m64n16 wgmma (operands %0 to %7), the 16 of a m64n32 one. */
#define BN_WGMMA_D8_REGS "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define BN_WGMMA_D16_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
/* The 32 accumulator registers of a m64n64 wgmma (operands %0 to %31). */
#define BN_WGMMA_D32_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
/* The 48 of a m64n96 wgmma (operands %0 to %47). */
#define BN_WGMMA_D48_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
/* The 64 accumulator registers of a m64n128 wgmma (operands %0 to %63), and their constraints:
 * BN_WGMMA_D64("+r", d) for int d[64], BN_WGMMA_D64("+f", d) for float d[64]. */
#define BN_WGMMA_D64_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define BN_WGMMA_D8(c, d, i) \
    c(d[i]), c(d[i + 1]), c(d[i + 2]), c(d[i + 3]), c(d[i + 4]), c(d[i + 5]), c(d[i + 6]), c(d[i + 7])
#define BN_WGMMA_D64(c, d)                                                                              \
    BN_WGMMA_D8(c, d, 0), BN_WGMMA_D8(c, d, 8), BN_WGMMA_D8(c, d, 16), BN_WGMMA_D8(c, d, 24), BN_WGMMA_D8(c, d, 32), \
        BN_WGMMA_D8(c, d, 40), BN_WGMMA_D8(c, d, 48), BN_WGMMA_D8(c, d, 56)
#define BN_WGMMA_D16(c, d) BN_WGMMA_D8(c, d, 0), BN_WGMMA_D8(c, d, 8)
#define BN_WGMMA_D32(c, d) BN_WGMMA_D16(c, d), BN_WGMMA_D8(c, d, 16), BN_WGMMA_D8(c, d, 24)
#define BN_WGMMA_D48(c, d) BN_WGMMA_D32(c, d), BN_WGMMA_D8(c, d, 32), BN_WGMMA_D8(c, d, 40)
/* The same for the 80 of a m64n160 wgmma (operands %0 to %79). */
#define BN_WGMMA_D80_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}"
#define BN_WGMMA_D80(c, d) BN_WGMMA_D64(c, d), BN_WGMMA_D8(c, d, 64), BN_WGMMA_D8(c, d, 72)

__device__ __forceinline__ void wgmma_fence() { BN_SM90A_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { BN_SM90A_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
/* Until at most PENDING of this warpgroup's wgmma commit groups are in flight. */
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
    BN_SM90A_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}
/* Orders this thread's generic-proxy accesses of shared memory before later async-proxy ones (wgmma
 * reads, bulk copies). */
__device__ __forceinline__ void fence_async_shared() { BN_SM90A_ASM("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* Descriptor of a shared-memory operand in the 128-byte swizzle (rows of 128 bytes, chunk c of row r
 * at c ^ (r % 8), every 8-row group 1024-aligned) starting `address`. K-major: `stride` bytes between
 * 8-row groups, `leading` unused (16). MN-major: `leading` bytes between 64-element column blocks,
 * `stride` bytes between 8-row groups along K. */
__device__ __forceinline__ uint64_t swizzle128_descriptor(uint32_t address, uint32_t leading, uint32_t stride) {
    return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | (static_cast<uint64_t>(leading >> 4) << 16) |
           (static_cast<uint64_t>(stride >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}
