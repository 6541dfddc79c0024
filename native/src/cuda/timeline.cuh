/* Timeline hooks of decode attention's cluster path, for tools/dev/decode_timeline.py.
 * BN_TIMELINE(code) is `code` in a build with -DBITNET_TIMELINE and nothing otherwise, so the
 * default build's machine code is that of a kernel without hooks (tools/kernel_code_diff.py). In a
 * timeline build, thread 0 of every cluster-path block stamps %globaltimer at kTimelineStamps
 * points into g_timeline, one record per block in launch order; bitnet_timeline_reset and
 * bitnet_timeline_read (exported by that build only, not part of bitnet.h) clear and read them.
 * Stamps: 0 block started, 1 PDL wait returned, 2-4 tiles 0-2 in shared memory, 5 last tile, 6 key
 * loop done, 7 combined and pushed, 8 every partial landed, 9 outputs stored (decode_timeline.py's
 * STAMPS and RECORD follow this layout). Included by attention_decode.cu only. */
#pragma once

#ifdef BITNET_TIMELINE
#define BN_TIMELINE(...) __VA_ARGS__

constexpr int kTimelineStamps = 10;
constexpr unsigned kTimelineCapacity = 1u << 16;

struct TimelineRecord {
    unsigned long long t[kTimelineStamps];
    unsigned smid, bx, by, slot;
    unsigned long long out;
};
__device__ TimelineRecord g_timeline[kTimelineCapacity];
__device__ unsigned g_timeline_count;

__device__ __forceinline__ unsigned long long timeline_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* One block's stamps 0-7 in registers until `store` writes its record (thread 0 only). */
struct TimelineBlock {
    unsigned long long stamp[8] = {};
    unsigned slot = 0;

    __device__ __forceinline__ void start() {
        if (threadIdx.x == 0) {
            stamp[0] = timeline_now();
            slot = atomicAdd(&g_timeline_count, 1u) % kTimelineCapacity;
        }
    }
    __device__ __forceinline__ void at(int s) { stamp[s] = timeline_now(); }
    /* Iteration i of the key loop has its tile in shared memory: stamps 2-4 and 5 (the last). */
    __device__ __forceinline__ void tile(int i, int tile_count) {
        const unsigned long long now = timeline_now();
        if (i == 0) stamp[2] = now;
        if (i == 1) stamp[3] = now;
        if (i == 2) stamp[4] = now;
        if (i == tile_count - 1) stamp[5] = now;
    }
    /* Stamp 7 and the record; its address for stamps 8 and 9, or null for threads other than 0. */
    __device__ __forceinline__ TimelineRecord *store(const void *out) {
        if (threadIdx.x != 0) return nullptr;
        stamp[7] = timeline_now();
        TimelineRecord *record = &g_timeline[slot];
#pragma unroll
        for (int s = 0; s < 8; s++) record->t[s] = stamp[s];
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        record->smid = smid, record->bx = blockIdx.x, record->by = blockIdx.y;
        record->slot = slot, record->out = (unsigned long long)out;
        return record;
    }
};

extern "C" int bitnet_timeline_reset(void) {
    unsigned zero = 0;
    return (int)cudaMemcpyToSymbol(g_timeline_count, &zero, sizeof zero);
}
extern "C" int bitnet_timeline_read(void *records, unsigned *count) {
    cudaError_t status = cudaMemcpyFromSymbol(count, g_timeline_count, sizeof *count);
    if (status == cudaSuccess) status = cudaMemcpyFromSymbol(records, g_timeline, sizeof g_timeline);
    return (int)status;
}
#else
#define BN_TIMELINE(...)
#endif
