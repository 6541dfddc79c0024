/* One-shot all-reduce and all-gather over NVLink peer memory, for decode's small messages.
 * Each rank's block b copies its part of x into its own buffer's data slot (the slot of the call's
 * epoch parity), raises flags[b][rank] in every rank's buffer to the epoch (release, system scope),
 * waits until flags[b][r] >= epoch for every r (acquire), then reads part b of every rank's slot
 * and sums (float32, ranks in order 0 .. world - 1) or gathers it into y. Grid: BN_PEER_BLOCKS
 * blocks of 512 threads on every rank, block b taking the same contiguous range of 16-byte chunks
 * everywhere, so that one block's flags cover exactly the data it reads. Two slots suffice: a rank
 * writes slot e & 1 in call e only after all ranks arrived at call e - 1, which they started after
 * their call e - 2 (the last reader of that slot) ended. The epoch counters live in the buffer and
 * advance on the device, so a captured graph of these calls replays any number of times.
 * 2 H100s (NVLink), in a graph: 5.0-5.2 us per call at 5-32 KB, 5.5 at 64 KB, 6.7-7.5 at 128 KB;
 * NCCL 2.28.9 6.6-7.1 us (tools/bench_allreduce.py).
 * The RMS form (bitnet_peer_allreduce_rms) also sums each row's trailing sum of squares and scales
 * the row by 1 / sqrt(sum / norm_cols + eps); those sums may sit in any block's range, so each of its
 * blocks waits for every block's flags. With world = 1 no buffer is touched: x is read directly. */
#include "common.cuh"

namespace {

constexpr int kThreads = 512;
constexpr unsigned long long kTimeoutNs = 30ull * 1000 * 1000 * 1000;

struct Peers {
    char *p[BN_PEER_MAX_RANKS];
    int64_t counts[BN_PEER_MAX_RANKS];  // the all-gather's piece of each rank
};

/* The RMS form's rows: x = [rows * cols partial sums | rows sums of squares]. */
struct Rms {
    int64_t rows, cols, norm_cols;
    float eps;
};

__device__ __forceinline__ uint32_t *flag_at(char *buffer, int block, int rank) {
    return reinterpret_cast<uint32_t *>(buffer + BN_PEER_FLAGS_OFFSET) + block * BN_PEER_MAX_RANKS + rank;
}

__device__ __forceinline__ void store_release(uint32_t *p, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* This block's flag exchange for `epoch`, after its part of the data is in this rank's slot; with
 * every_block, the wait covers every block's flags (all the data), not only its own. Returns true
 * when the call was aborted (bitnet_peer_abort); traps after kTimeoutNs. */
__device__ bool arrive_and_wait(const Peers &peers, int world, int rank, uint32_t epoch,
                                bool every_block) {
    __shared__ int aborted;
    if (threadIdx.x == 0) aborted = 0;
    __syncthreads();  // the block's data stores happen before the flags below
    // No fence before the release: it is cumulative, so it also publishes the block's data
    // stores ordered before it by the barrier (vLLM's custom all-reduce relies on the same).
    // A __threadfence_system() here cost 1.5 us per call (6.6 -> 5.1 us, 2 H100s).
    if (threadIdx.x < world) store_release(flag_at(peers.p[threadIdx.x], blockIdx.x, rank), epoch);
    const int waiters = every_block ? world * (int)gridDim.x : world;
    if ((int)threadIdx.x < waiters) {
        const int block = every_block ? (int)threadIdx.x / world : (int)blockIdx.x;
        const uint32_t *mine = flag_at(peers.p[rank], block, (int)threadIdx.x % world);
        const volatile uint32_t *abort_word =
            reinterpret_cast<const volatile uint32_t *>(peers.p[rank] + BN_PEER_ABORT_OFFSET);
        const unsigned long long start = global_ns();
        while ((int32_t)(load_acquire(mine) - epoch) < 0) {
            if (*abort_word) {
                aborted = 1;
                break;
            }
            if (global_ns() - start > kTimeoutNs) __trap();
        }
    }
    __syncthreads();
    return aborted != 0;
}

/* kGather: y = the ranks' pieces (peers.counts[r] elements each) end to end, n the largest piece,
 * this rank's x of peers.counts[rank]; otherwise y[i] = sum_r x_r[i], x of n elements; kRms (float
 * x): y[t, i] = that sum / sqrt(sum_r x_r[rows * cols + t] / norm_cols + eps), for i < cols. */
template <typename TX, typename TY, bool kGather, bool kRms>
__global__ void __launch_bounds__(kThreads)
    peer_kernel(Peers peers, int world, int rank, const TX *__restrict__ x, TY *y, int64_t n,
                int64_t slot_bytes, Rms rms) {
    constexpr int kPer = 16 / sizeof(TX);  // elements per 16-byte chunk
    char *own = peers.p[rank];
    uint32_t *epochs = reinterpret_cast<uint32_t *>(own + BN_PEER_EPOCHS_OFFSET);
    bn_pdl_wait();
    const int64_t chunks = (n + kPer - 1) / kPer;
    const int64_t per_block = (chunks + gridDim.x - 1) / gridDim.x;
    const int64_t begin = blockIdx.x * per_block;
    const int64_t end = min(chunks, begin + per_block);
    const int64_t own_n = kGather ? peers.counts[rank] : n;
    int64_t slot = 0;  // of every rank's buffer; world = 1 reads x itself
    if (world > 1) {
        const uint32_t epoch = epochs[blockIdx.x] + 1;
        slot = BN_PEER_HEADER_BYTES + (int64_t)(epoch & 1) * slot_bytes;
        TX *own_slot = reinterpret_cast<TX *>(own + slot);
        for (int64_t c = begin + threadIdx.x; c < end; c += blockDim.x) {
            const int64_t i0 = c * kPer;
            if (i0 + kPer <= own_n) {
                *reinterpret_cast<uint4 *>(own_slot + i0) = *reinterpret_cast<const uint4 *>(x + i0);
            } else {
                for (int64_t i = i0; i < own_n; i++) own_slot[i] = x[i];
            }
        }
        const bool aborted = arrive_and_wait(peers, world, rank, epoch, kRms);
        if (threadIdx.x == 0) epochs[blockIdx.x] = epoch;
        bn_pdl_launch_dependents();
        if (aborted) return;
    } else {
        bn_pdl_launch_dependents();
    }
    const auto data = [&](int r) -> const char * {
        return world > 1 ? peers.p[r] + slot : reinterpret_cast<const char *>(x);
    };
    int64_t factor_row = -1;  // kRms: the row whose factor is in `factor`
    float factor = 0.0f;

    for (int64_t c = begin + threadIdx.x; c < end; c += blockDim.x) {
        const int64_t i0 = c * kPer;
        if constexpr (kGather) {
            int64_t offset = 0;
            for (int r = 0; r < world; r++) {
                const int64_t count = peers.counts[r];
                if (i0 < count) {
                    uint4 v = __ldcv(reinterpret_cast<const uint4 *>(data(r)) + c);
                    const TX *e = reinterpret_cast<const TX *>(&v);
                    const int valid = (int)min((int64_t)kPer, count - i0);
                    for (int k = 0; k < valid; k++) y[offset + i0 + k] = e[k];
                }
                offset += count;
            }
        } else {
            const int valid = (int)min((int64_t)kPer, n - i0);
            float acc[kPer];
            for (int k = 0; k < kPer; k++) acc[k] = 0.0f;
            for (int r = 0; r < world; r++) {
                uint4 v = __ldcv(reinterpret_cast<const uint4 *>(data(r)) + c);
                const TX *e = reinterpret_cast<const TX *>(&v);
                for (int k = 0; k < kPer; k++) acc[k] += to_float(e[k]);
            }
            if constexpr (kRms) {
                const int64_t outputs = rms.rows * rms.cols;
                for (int k = 0; k < valid && i0 + k < outputs; k++) {
                    const int64_t row = (i0 + k) / rms.cols;
                    if (row != factor_row) {
                        float sumsq = 0.0f;
                        for (int r = 0; r < world; r++)
                            sumsq += __ldcv(reinterpret_cast<const float *>(data(r)) + outputs + row);
                        factor = 1.0f / sqrtf(sumsq / (float)rms.norm_cols + rms.eps);
                        factor_row = row;
                    }
                    y[i0 + k] = from_float<TY>(acc[k] * factor);
                }
            } else {
                for (int k = 0; k < valid; k++) y[i0 + k] = from_float<TY>(acc[k]);
            }
        }
    }
}

Peers peers_of(void *const *buffers, const int64_t *counts, int32_t world) {
    Peers peers = {};
    for (int32_t r = 0; r < world; r++) {
        peers.p[r] = static_cast<char *>(buffers[r]);
        peers.counts[r] = counts ? counts[r] : 0;
    }
    return peers;
}

template <typename TX, typename TY, bool kGather, bool kRms = false>
cudaError_t launch(const Peers &peers, int world, int rank, const void *x, void *y, int64_t n,
                   int64_t slot_bytes, cudaStream_t stream, Rms rms = {}) {
    return bn_launch_pdl(peer_kernel<TX, TY, kGather, kRms>, dim3(BN_PEER_BLOCKS), dim3(kThreads), 0,
                         stream, peers, world, rank, static_cast<const TX *>(x),
                         static_cast<TY *>(y), n, slot_bytes, rms);
}

template <typename TX>
cudaError_t launch_reduce(int32_t y_dtype, const Peers &peers, int world, int rank, const void *x,
                          void *y, int64_t n, int64_t slot_bytes, cudaStream_t stream) {
    switch (y_dtype) {
    case BITNET_DTYPE_F32: return launch<TX, float, false>(peers, world, rank, x, y, n, slot_bytes, stream);
    case BITNET_DTYPE_F16: return launch<TX, __half, false>(peers, world, rank, x, y, n, slot_bytes, stream);
    default: return launch<TX, __nv_bfloat16, false>(peers, world, rank, x, y, n, slot_bytes, stream);
    }
}

}  // namespace

bitnet_status bn_cuda_peer_allreduce(int32_t device, int32_t x_dtype, int32_t y_dtype, int64_t n,
                                     const void *x, void *y, void *const *buffers, int32_t world,
                                     int32_t rank, int64_t slot_bytes, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    const Peers peers = peers_of(buffers, NULL, world);
    cudaStream_t s = bn_stream(stream);
    switch (x_dtype) {
    case BITNET_DTYPE_F32: BN_CUDA_TRY((launch_reduce<float>(y_dtype, peers, world, rank, x, y, n, slot_bytes, s))); break;
    case BITNET_DTYPE_F16: BN_CUDA_TRY((launch_reduce<__half>(y_dtype, peers, world, rank, x, y, n, slot_bytes, s))); break;
    default: BN_CUDA_TRY((launch_reduce<__nv_bfloat16>(y_dtype, peers, world, rank, x, y, n, slot_bytes, s))); break;
    }
    return BITNET_OK;
}

bitnet_status bn_cuda_peer_allreduce_rms(int32_t device, int32_t y_dtype, int64_t T, int64_t n,
                                         int64_t norm_cols, float eps, const float *x, void *y,
                                         void *const *buffers, int32_t world, int32_t rank,
                                         int64_t slot_bytes, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    const Peers peers = peers_of(buffers, NULL, world);
    const Rms rms = {T, n, norm_cols, eps};
    cudaStream_t s = bn_stream(stream);
    const int64_t total = T * n + T;
    switch (y_dtype) {
    case BITNET_DTYPE_F32: BN_CUDA_TRY((launch<float, float, false, true>(peers, world, rank, x, y, total, slot_bytes, s, rms))); break;
    case BITNET_DTYPE_F16: BN_CUDA_TRY((launch<float, __half, false, true>(peers, world, rank, x, y, total, slot_bytes, s, rms))); break;
    default: BN_CUDA_TRY((launch<float, __nv_bfloat16, false, true>(peers, world, rank, x, y, total, slot_bytes, s, rms))); break;
    }
    return BITNET_OK;
}

bitnet_status bn_cuda_peer_allgather(int32_t device, int32_t dtype, const int64_t *counts,
                                     const void *x, void *y, void *const *buffers, int32_t world,
                                     int32_t rank, int64_t slot_bytes, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    const Peers peers = peers_of(buffers, counts, world);
    cudaStream_t s = bn_stream(stream);
    int64_t n = 0;
    for (int32_t r = 0; r < world; r++) n = counts[r] > n ? counts[r] : n;
    switch (dtype) {
    case BITNET_DTYPE_F32: BN_CUDA_TRY((launch<float, float, true>(peers, world, rank, x, y, n, slot_bytes, s))); break;
    case BITNET_DTYPE_F16: BN_CUDA_TRY((launch<__half, __half, true>(peers, world, rank, x, y, n, slot_bytes, s))); break;
    default: BN_CUDA_TRY((launch<__nv_bfloat16, __nv_bfloat16, true>(peers, world, rank, x, y, n, slot_bytes, s))); break;
    }
    return BITNET_OK;
}

bitnet_status bn_cuda_set_current_device(int32_t device) {
    BN_CUDA_TRY(cudaSetDevice(device));
    return BITNET_OK;
}

bitnet_status bn_cuda_ipc_get_handle(int32_t device, void *ptr, bitnet_ipc_handle *handle) {
    static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(bitnet_ipc_handle), "IPC handle size");
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    cudaIpcMemHandle_t h;
    BN_CUDA_TRY(cudaIpcGetMemHandle(&h, ptr));
    memcpy(handle->bytes, &h, sizeof h);
    return BITNET_OK;
}

bitnet_status bn_cuda_ipc_open_handle(int32_t device, const bitnet_ipc_handle *handle, void **ptr) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    cudaIpcMemHandle_t h;
    memcpy(&h, handle->bytes, sizeof h);
    void *p = NULL;
    BN_CUDA_TRY(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    *ptr = p;
    return BITNET_OK;
}

bitnet_status bn_cuda_ipc_close_handle(int32_t device, void *ptr) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BN_CUDA_TRY(cudaIpcCloseMemHandle(ptr));
    return BITNET_OK;
}

bitnet_status bn_cuda_peer_abort(int32_t device, void *buffer) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    cudaStream_t own = NULL;
    BN_CUDA_TRY(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
    cudaError_t err = cudaMemsetAsync(static_cast<char *>(buffer) + BN_PEER_ABORT_OFFSET, 0xFF,
                                      sizeof(uint32_t), own);
    if (err == cudaSuccess) err = cudaStreamSynchronize(own);
    cudaStreamDestroy(own);
    BN_CUDA_TRY(err);
    return BITNET_OK;
}
