/* The tensor memory accelerator (TMA, sm_90a) as the kernels built for that target alone use it
 * (gemm_w2a8_sm90.cu, gemv_bf16_sm90.cu): 2-D boxes of bytes copied global -> shared memory, their
 * arrival counted by an mbarrier, and the tensor maps that describe them, made on the host. */
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include "common.cuh"
#include "wgmma.cuh"

/* A 2-D box of bytes global -> shared memory, completing `landed`'s transaction count; the box's
 * shared-memory layout is the tensor map's swizzle. */
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap &map, int inner, int row, uint32_t landed) {
    BN_SM90A_ASM("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                 "[%4];\n" ::"r"(dst), "l"(reinterpret_cast<uint64_t>(&map)), "r"(inner), "r"(row), "r"(landed)
                 : "memory");
}

/* Fetches a tensor map (a __grid_constant__ parameter) ahead of its first copy. */
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap &map) {
    BN_SM90A_ASM("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
}

/* This thread's arrival on the mbarrier at `barrier`, which then also waits for `bytes` more bytes
 * of copies in its current phase. */
__device__ __forceinline__ void arrive_expect_bytes(uint32_t barrier, uint32_t bytes) {
    BN_SM90A_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes) : "memory");
}

/* Until the mbarrier at `barrier` has completed the phase of this parity. */
__device__ __forceinline__ void wait_phase(uint32_t barrier, uint32_t parity) {
    BN_SM90A_ASM("{\n.reg .pred p;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT_%=;\n}\n"
                 ::"r"(barrier), "r"(parity) : "memory");
}

/* A tensor map of `rows` rows of `row_bytes` bytes at `base`, boxes of box_rows x box_bytes; errors
 * name `op`. */
inline bitnet_status bn_tensor_map(const char *op, CUtensorMap *map, const void *base, int64_t rows, int64_t row_bytes,
                                   uint32_t box_rows, uint32_t box_bytes, CUtensorMapSwizzle swizzle) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void *fn = nullptr;
        cudaDriverEntryPointQueryResult found;
        return cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) ==
                               cudaSuccess && found == cudaDriverEntryPointSuccess
                   ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
                   : nullptr;
    }();
    if (encode == nullptr) return bn_fail(BITNET_ERR_CUDA, "%s: the driver has no cuTensorMapEncodeTiled", op);
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
    const cuuint32_t box[2] = {box_bytes, box_rows}, steps[2] = {1, 1};
    const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void *>(base), dims, strides, box, steps,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) return bn_fail(BITNET_ERR_CUDA, "%s: cuTensorMapEncodeTiled failed (CUresult %d)", op, (int)r);
    return BITNET_OK;
}
