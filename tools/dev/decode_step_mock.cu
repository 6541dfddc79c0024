/* How fast could one persistent kernel run the 30 layers of a 2B4T decode step of one sequence
 * (issue 40; the design of docs/log 2026-11-27-37, measured as a whole rather than stage by stage)?
 * A mock with the real shapes and the real data movement, not the real numerics (no norm weights,
 * RoPE or cache append; made-up scales): one block of 512 threads per SM, all resident
 * (cooperative launch), five stages a layer, each waiting on a counter that its producers raise:
 *   S1 QKV      3840 x 2560   every block; input h and the previous stage's 132 statistics slots
 *   S2 attention               Hkv x L/64 blocks, 64 positions of one KV head each, whose K and V
 *                              rows sit in shared memory before S1 ends (loaded while the blocks
 *                              run the previous layer's later stages); partials, and the last
 *                              unit of a KV head combines them and writes its statistics slot
 *   S3 o        2560 x 2560   input attention's output and its Hkv slots; h += y, a slot a block
 *   S4 gate|up  13824 x 2560  input h; a warp holds gate rows and their up rows, stores
 *                              relu(gate)^2 * up and a slot a block
 *   S5 down     2560 x 6912   input the gate's output; h += y, a slot a block
 * A GEMV stage: each block's rows of each matrix are contiguous; thread 0 has the copy engine bring
 * them (cp.async.bulk, an mbarrier counting the bytes) into a shared-memory buffer of that stage a
 * layer ahead, as soon as the block has read the buffer's previous contents. After the stage's
 * counter, every block reads the input vector and the slots (one L2 round trip), makes int8 codes
 * in shared memory, takes dp4a dots (4 accumulators, swizzled codes) of the weights from shared
 * memory, stores, writes its slot and raises the stage's counter (red.release.gpu; with `release`
 * off, a fence and atomicAdd). The slots are read by every warp of a block (as gemv_w2a8.cu's
 * normed GEMVs read theirs) or, with `one_warp_slots`, by its warp 0 for all of them.
 * Per-layer buffers, so no stage overwrites what a slower block may still read.
 *     nvcc -O3 -arch=sm_90 -Inative/include -o /tmp/decode_step_mock tools/dev/decode_step_mock.cu && /tmp/decode_step_mock
 * Prints µs per step (30 layers; the output head, about 145 µs on an H200 at batch 1, comes on
 * top) at context 1024, with the attention stage and without, the slots read either way, and the
 * timeline of layer 15 of each (docs/log/2026-12-04.md#2026-12-04-3). */
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "../../native/src/cuda/gemv_dp4a.cuh" /* the one-token kernel's x layout and dp4a dot */
#include "cuda_check.h"

constexpr int kThreads = 512, kWarps = kThreads / 32, kSms = 132;
constexpr int kLayers = 30, kH = 2560, kI = 6912, kHq = 20, kHkv = 5, kD = 128, kG = kHq / kHkv;
constexpr int kQkv = (kHq + 2 * kHkv) * kD, kUnitPositions = 64, kStages = 5;

/* Attention's units: per KV head, L split into units of kUnitPositions (L <= kUnitPositions * kSms / Hkv). */
struct UnitPlan {
    int per_head, positions;
};
__host__ __device__ inline UnitPlan unit_plan(int L) { return {(L + kUnitPositions - 1) / kUnitPositions, kUnitPositions}; }

/* %globaltimer in thread 0 of every block at the events of a layer (after a block barrier):
 * stamps[layer][event][block] of the last launch. */
constexpr int kEvents = 16;
__device__ unsigned long long g_stamps[kLayers][kEvents][kSms];
#define STAMP(l, e)                                                                                  \
    do {                                                                                             \
        unsigned long long now;                                                                      \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));                                     \
        if (threadIdx.x == 0) g_stamps[l][e][blockIdx.x] = now;                                      \
    } while (0)

struct Layer {
    const uint4 *qkv, *o, *gate_up, *down; /* [M][K / 64] 16-byte chunks of packed codes */
    const __nv_bfloat16 *k_cache, *v_cache; /* [L][Hkv][D] */
    __nv_bfloat16 *qkv_out, *attn, *glu;
    float *partial; /* [units][G][D + 2]: o, then m and l */
    float2 *slots;  /* [kStages][kSms]: per stage, each producer's sum of squares and max */
};

struct Args {
    const Layer *layers;
    __nv_bfloat16 *h;
    const float2 *first_slots;
    unsigned *counters; /* [kLayers][kStages], zero at launch; [kLayers][kHkv] head arrivals after */
    int L;              /* context: positions attended */
    bool attention;     /* false: S2 left out (S3 reads S1's output in its place) */
    bool release;       /* counters raised by red.release.gpu, not __threadfence + atomicAdd */
    bool one_warp_slots; /* a block's warp 0 reads the slots for all its warps */
};

__device__ __forceinline__ void arrive(unsigned *counter, bool release) {
    __syncthreads();
    if (threadIdx.x == 0) {
        if (release) {
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
        } else {
            __threadfence();
            atomicAdd(counter, 1u);
        }
    }
}

__device__ __forceinline__ void wait_for(const unsigned *counter, unsigned target) {
    if (threadIdx.x == 0)
        while (load_acquire(counter) < target) {}
    __syncthreads();
}

__device__ __forceinline__ uint32_t smem_address(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* One GEMV stage's rows in this block: LANES lanes a row, PASSES rounds of the grid's warps; in
 * pass p the block owns the kRows contiguous rows from row0(p), which the copy engine brings into
 * `buffer` (kRows x K / 4 bytes a pass) under the mbarrier `landed`. */
template <int LANES, int PASSES, int K, int M> struct Stage {
    static constexpr int kChunks = K / 64, kCpl = (kChunks + LANES - 1) / LANES, kRowsPerWarp = 32 / LANES;
    static constexpr int kRows = kWarps * kRowsPerWarp, kRowBytes = K / 4;
    static constexpr int kBufferBytes = PASSES * kRows * kRowBytes;
    static_assert(PASSES * kSms * kRows >= M, "the passes cover the rows");
    uint4 *buffer;
    uint64_t *landed;
    __device__ static int row0(int p) { return (p * kSms + blockIdx.x) * kRows; }
    __device__ static int local_row() { return threadIdx.x / 32 * kRowsPerWarp + threadIdx.x % 32 / LANES; }
    __device__ static int row(int p) { return row0(p) + local_row(); }
    __device__ static int chunk(int c) { return threadIdx.x % LANES + LANES * c; }
    /* Thread 0: the copies of this block's rows of w, counted by `landed`. */
    __device__ void request(const uint4 *w) const {
        uint32_t bytes = 0;
#pragma unroll
        for (int p = 0; p < PASSES; p++)
            if (row0(p) < M) bytes += (uint32_t)(min(kRows, M - row0(p)) * kRowBytes);
        const uint32_t bar = smem_address(landed);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#pragma unroll
        for (int p = 0; p < PASSES; p++)
            if (row0(p) < M)
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                             ::"r"(smem_address(buffer + p * kRows * kRowBytes / 16)),
                             "l"(w + (int64_t)row0(p) * kChunks), "r"((uint32_t)(min(kRows, M - row0(p)) * kRowBytes)),
                             "r"(bar) : "memory");
    }
    __device__ void wait(int parity) const {
        asm volatile("{\n.reg .pred p;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT_%=;\n}\n"
                     ::"r"(smem_address(landed)), "r"(parity) : "memory");
    }
    /* The exact dot of pass p's row with the codes, in every lane of the row. */
    __device__ int dot(int p, const int8_t *codes) const {
        const uint4 *w = buffer + (p * kRows + local_row()) * kChunks;
        int acc[4] = {0, 0, 0, 0};
#pragma unroll
        for (int c = 0; c < kCpl; c++) {
            if (chunk(c) >= kChunks) break;
            const uint4 v = w[chunk(c)];
            const uint32_t word[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int4 x = *reinterpret_cast<const int4 *>(codes + bn_gemv::x_offset(chunk(c), q));
                acc[0] = bn_gemv::dp4a_u8_s8(word[q] & 0x03030303u, x.x, acc[0]);
                acc[1] = bn_gemv::dp4a_u8_s8(word[q] & 0x0C0C0C0Cu, x.y, acc[1]);
                acc[2] = bn_gemv::dp4a_u8_s8(word[q] & 0x30303030u, x.z, acc[2]);
                acc[3] = bn_gemv::dp4a_u8_s8(word[q] & 0xC0C0C0C0u, x.w, acc[3]);
            }
        }
        int d = bn_gemv::codes_dot(acc);
#pragma unroll
        for (int o = LANES / 2; o > 0; o /= 2) d += __shfl_xor_sync(~0u, d, o);
        return d;
    }
};

struct Codes {
    float step; /* value of one code step: the dots times this are the outputs */
    int sum;
};

/* Every block: the int8 codes of the K-vector x (written in this kernel: read through L2) scaled by
 * the slots' max, 1 / RMS from their sums, into shared memory. All loads (x as 16-byte vectors of 8
 * values, kSlotsPerLane slots a lane) are issued before any is used: one L2 round trip. */
constexpr int kSlotsPerLane = (kSms + 31) / 32;
template <int K>
__device__ Codes make_codes(const __nv_bfloat16 *x, const float2 *slots, int n_slots, bool one_warp, int8_t *codes,
                            int *scratch) {
    constexpr int kVectors = K / 8, kPer = (kVectors + kThreads - 1) / kThreads;
    uint4 v[kPer];
#pragma unroll
    for (int e = 0; e < kPer; e++) {
        const int i = e * kThreads + threadIdx.x;
        v[e] = i < kVectors ? __ldcg(reinterpret_cast<const uint4 *>(x) + i) : make_uint4(0, 0, 0, 0);
    }
    /* the slots: read by warp 0 and shared (one_warp), or by every warp */
    __shared__ float2 total;
    float sum = 0.0f, max = 0.0f;
    if (!one_warp || threadIdx.x < 32) {
        float2 slot[kSlotsPerLane];
#pragma unroll
        for (int j = 0; j < kSlotsPerLane; j++) {
            const int i = threadIdx.x % 32 + 32 * j;
            slot[j] = i < n_slots ? __ldcg(slots + i) : make_float2(0.0f, 0.0f);
        }
#pragma unroll
        for (int j = 0; j < kSlotsPerLane; j++) {
            sum += slot[j].x;
            max = fmaxf(max, slot[j].y);
        }
        for (int o = 16; o > 0; o /= 2) {
            sum += __shfl_xor_sync(~0u, sum, o);
            max = fmaxf(max, __shfl_xor_sync(~0u, max, o));
        }
        if (one_warp && threadIdx.x == 0) total = make_float2(sum, max);
    }
    if (one_warp) {
        __syncthreads();
        sum = total.x;
        max = total.y;
    }
    const float r = rsqrtf(sum / K + 1e-5f), scale = 127.0f / fmaxf(max * r, 1e-5f);
    int code_sum = 0;
#pragma unroll
    for (int e = 0; e < kPer; e++) {
        const int i = e * kThreads + threadIdx.x;
        if (i < kVectors) {
            const uint32_t words[4] = {v[e].x, v[e].y, v[e].z, v[e].w};
            uint32_t packed[2] = {0, 0};
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float value = __uint_as_float(j % 2 ? words[j / 2] & 0xffff0000u : words[j / 2] << 16);
                const int code = (int)rintf(fminf(fmaxf(value * r * scale, -127.0f), 127.0f));
                packed[j / 4] |= (uint32_t)(code & 0xff) << (8 * (j % 4));
                code_sum += code;
            }
            const int k = 8 * i;
            *reinterpret_cast<uint2 *>(codes + bn_gemv::x_offset(k / 64, k % 64 / 16) + k % 16) = make_uint2(packed[0], packed[1]);
        }
    }
    for (int o = 16; o > 0; o /= 2) code_sum += __shfl_xor_sync(~0u, code_sum, o);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = code_sum;
    __syncthreads();
    code_sum = 0;
    for (int w = 0; w < kWarps; w++) code_sum += scratch[w];
    return {1.0f / (scale * 64.0f * 32.0f), code_sum};
}

/* The block's slot: the sum of its threads' (sum, max) pairs. */
__device__ void write_slot(float2 v, float2 *slot, float2 *scratch) {
    for (int o = 16; o > 0; o /= 2) v = make_float2(v.x + __shfl_xor_sync(~0u, v.x, o), fmaxf(v.y, __shfl_xor_sync(~0u, v.y, o)));
    __syncthreads(); /* scratch may hold the codes' sums still being read */
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float2 t = make_float2(0.0f, 0.0f);
        for (int w = 0; w < kWarps; w++) t = make_float2(t.x + scratch[w].x, fmaxf(t.y, scratch[w].y));
        *slot = t;
    }
}

/* h[row] += value, its statistics added to acc. */
__device__ __forceinline__ void add_to_h(__nv_bfloat16 *h, int row, float value, float2 &acc) {
    const float v = __bfloat162float(__float2bfloat16(__bfloat162float(__ldcg(h + row)) + value));
    h[row] = __float2bfloat16(v);
    acc = make_float2(acc.x + v * v, fmaxf(acc.y, fabsf(v)));
}

/* The positions [first, first + count) of unit `unit`, and its KV head. */
__device__ inline void unit_range(int unit, int L, int &j, int &first, int &count) {
    const UnitPlan plan = unit_plan(L);
    j = unit / plan.per_head;
    first = unit % plan.per_head * plan.positions;
    count = min(plan.positions, L - first);
}

/* Loads (cp.async) the unit's K and V rows into shared memory. */
__device__ void load_unit(const Layer &layer, int unit, int L, __nv_bfloat16 *k_tile, __nv_bfloat16 *v_tile) {
    int j, first, count;
    unit_range(unit, L, j, first, count);
    const int vectors = count * kD / 8;
    for (int e = threadIdx.x; e < vectors; e += kThreads) {
        const int64_t offset = ((int64_t)(first + e / (kD / 8)) * kHkv + j) * kD + e % (kD / 8) * 8;
        const uint32_t k_dst = (uint32_t)__cvta_generic_to_shared(k_tile + e * 8);
        const uint32_t v_dst = (uint32_t)__cvta_generic_to_shared(v_tile + e * 8);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(k_dst), "l"(layer.k_cache + offset));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(v_dst), "l"(layer.v_cache + offset));
    }
    asm volatile("cp.async.commit_group;");
}

/* The unit's G query heads over its positions (K and V in shared memory): unnormalized partials;
 * the unit that arrives last at its KV head combines the head's partials into attn and its slot. */
__device__ void attend(int l, const Layer &layer, unsigned *head_arrivals, int unit, int L, const __nv_bfloat16 *k_tile,
                       const __nv_bfloat16 *v_tile, float *scores, float *q, float *stats, unsigned *stage_counter) {
    const int units_per_head = unit_plan(L).per_head;
    int j, first, count;
    unit_range(unit, L, j, first, count);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int e = threadIdx.x; e < kG * kD; e += kThreads) q[e] = __bfloat162float(__ldcg(layer.qkv_out + j * kG * kD + e));
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    STAMP(l, 14);
    /* scores: a warp a position at a time, a lane 4 dims, the G heads' dots reduced over the warp */
    float q4[kG][4];
#pragma unroll
    for (int g = 0; g < kG; g++)
#pragma unroll
        for (int e = 0; e < 4; e++) q4[g][e] = q[g * kD + lane * 4 + e];
    for (int t = warp; t < count; t += kWarps) {
        const uint2 raw = *reinterpret_cast<const uint2 *>(k_tile + t * kD + lane * 4);
        const float k4[4] = {__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u),
                             __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xffff0000u)};
        float dots[kG];
#pragma unroll
        for (int g = 0; g < kG; g++) {
            dots[g] = 0.0f;
#pragma unroll
            for (int e = 0; e < 4; e++) dots[g] += q4[g][e] * k4[e];
        }
#pragma unroll
        for (int o = 16; o > 0; o /= 2)
#pragma unroll
            for (int g = 0; g < kG; g++) dots[g] += __shfl_xor_sync(~0u, dots[g], o);
#pragma unroll
        for (int g = 0; g < kG; g++)
            if (lane == g) scores[g * kUnitPositions + t] = dots[g] * 0.1275f;
    }
    __syncthreads();
    if (warp < kG) { /* softmax statistics of head `warp` */
        float m = -INFINITY, l = 0.0f;
        for (int t = lane; t < count; t += 32) m = fmaxf(m, scores[warp * kUnitPositions + t]);
        for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
        for (int t = lane; t < count; t += 32) {
            const float p = exp2f(scores[warp * kUnitPositions + t] - m);
            scores[warp * kUnitPositions + t] = p;
            l += p;
        }
        for (int o = 16; o > 0; o /= 2) l += __shfl_xor_sync(~0u, l, o);
        if (lane == 0) {
            stats[2 * warp] = m;
            stats[2 * warp + 1] = l;
        }
    }
    __syncthreads();
    float *partial = layer.partial + (int64_t)unit * kG * (kD + 2);
    static_assert(kG * kD == kThreads, "a thread an output");
    {
        const int g = threadIdx.x / kD, d = threadIdx.x % kD;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        int t = 0;
        for (; t + 4 <= count; t += 4)
#pragma unroll
            for (int u = 0; u < 4; u++) acc[u] += scores[g * kUnitPositions + t + u] * __bfloat162float(v_tile[(t + u) * kD + d]);
        for (; t < count; t++) acc[0] += scores[g * kUnitPositions + t] * __bfloat162float(v_tile[t * kD + d]);
        partial[g * (kD + 2) + d] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
    if (threadIdx.x < kG) {
        partial[threadIdx.x * (kD + 2) + kD] = stats[2 * threadIdx.x];
        partial[threadIdx.x * (kD + 2) + kD + 1] = stats[2 * threadIdx.x + 1];
    }
    __shared__ unsigned last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(head_arrivals + j, 1u) == (unsigned)units_per_head - 1;
        __threadfence();
    }
    __syncthreads();
    STAMP(l, 15);
    if (!last) return;
    /* the head's combine: a thread an output over the head's units, their loads in batches of 8 */
    float2 acc_stats = make_float2(0.0f, 0.0f);
    {
        const int g = threadIdx.x / kD, d = threadIdx.x % kD;
        const float *base = layer.partial + (int64_t)j * units_per_head * kG * (kD + 2) + g * (kD + 2);
        constexpr int kBatch = 8;
        float m = -INFINITY, sum = 0.0f, l = 0.0f;
        for (int u0 = 0; u0 < units_per_head; u0 += kBatch) {
            float mu[kBatch], lu[kBatch], ou[kBatch];
#pragma unroll
            for (int b = 0; b < kBatch; b++) {
                const float *p = base + (int64_t)(u0 + b) * kG * (kD + 2);
                const bool in = u0 + b < units_per_head;
                mu[b] = in ? __ldcg(p + kD) : -INFINITY;
                lu[b] = in ? __ldcg(p + kD + 1) : 0.0f;
                ou[b] = in ? __ldcg(p + d) : 0.0f;
            }
#pragma unroll
            for (int b = 0; b < kBatch; b++) {
                const float m_new = fmaxf(m, mu[b]);
                const float old_w = exp2f(m - m_new), w = exp2f(mu[b] - m_new);
                sum = sum * old_w + w * ou[b];
                l = l * old_w + w * lu[b];
                m = m_new;
            }
        }
        const float v = __bfloat162float(__float2bfloat16(sum / l));
        layer.attn[j * kG * kD + threadIdx.x] = __float2bfloat16(v);
        acc_stats = make_float2(v * v, fabsf(v));
    }
    write_slot(acc_stats, layer.slots + 1 * kSms + j, reinterpret_cast<float2 *>(scores));
    arrive(stage_counter, false);
}

/* The o and down stages' epilogue: h += y over the block's rows (a row a warp, two passes), and
 * the statistics of the new h into the block's slot. */
template <typename S>
__device__ void project_add(const S &stage, const int8_t *codes, Codes x, __nv_bfloat16 *h, float2 *slot,
                            float2 *scratch) {
    static_assert(S::kRowsPerWarp == 1, "lane 0 stores");
    float2 acc = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const int row = stage.row(p), d = stage.dot(p, codes) - x.sum;
        if (threadIdx.x % 32 == 0 && row < kH) add_to_h(h, row, d * x.step, acc);
    }
    write_slot(acc, slot, scratch);
}

using QkvStage = Stage<16, 1, kH, kQkv>;
using OStage = Stage<32, 2, kH, kH>;
using GateUpStage = Stage<8, 2, kH, 2 * kI>;
using DownStage = Stage<32, 2, kI, kH>;
constexpr int kWeightBytes = QkvStage::kBufferBytes + OStage::kBufferBytes + GateUpStage::kBufferBytes +
                             DownStage::kBufferBytes;
constexpr int kAttentionBytes = 2 * kUnitPositions * kD * 2 + 4 * (kG * kUnitPositions + kG * kD + 2 * kG);
constexpr size_t kSharedBytes = kWeightBytes + kI + kAttentionBytes;

__global__ __launch_bounds__(kThreads, 1) void decode_step(const Args a) {
    extern __shared__ int4 shared[];
    __shared__ uint64_t landed[4];
    QkvStage qkv{reinterpret_cast<uint4 *>(shared), &landed[0]};
    OStage o{qkv.buffer + QkvStage::kBufferBytes / 16, &landed[1]};
    GateUpStage gate_up{o.buffer + OStage::kBufferBytes / 16, &landed[2]};
    DownStage down{gate_up.buffer + GateUpStage::kBufferBytes / 16, &landed[3]};
    int8_t *codes = reinterpret_cast<int8_t *>(down.buffer + DownStage::kBufferBytes / 16); /* kI bytes */
    __nv_bfloat16 *k_tile = reinterpret_cast<__nv_bfloat16 *>(codes + kI); /* kUnitPositions x D */
    __nv_bfloat16 *v_tile = k_tile + kUnitPositions * kD;
    float *scores = reinterpret_cast<float *>(v_tile + kUnitPositions * kD); /* G x kUnitPositions */
    float *q = scores + kG * kUnitPositions;                                 /* G x D */
    float *stats = q + kG * kD;                                              /* 2 G */
    __shared__ int scratch[kWarps];
    __shared__ float2 slot_scratch[kWarps];
    const int units = kHkv * unit_plan(a.L).per_head;
    const bool attends = a.attention && (int)blockIdx.x < units;

    if (threadIdx.x == 0) {
        for (int i = 0; i < 4; i++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(&landed[i])));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        qkv.request(a.layers[0].qkv);
        o.request(a.layers[0].o);
        gate_up.request(a.layers[0].gate_up);
        down.request(a.layers[0].down);
    }
    if (attends) load_unit(a.layers[0], blockIdx.x, a.L, k_tile, v_tile);
    for (int l = 0; l < kLayers; l++) {
        const Layer &layer = a.layers[l];
        const Layer *next = l + 1 < kLayers ? &a.layers[l + 1] : nullptr;
        unsigned *counter = a.counters + l * kStages;
        const float2 *h_slots = l == 0 ? a.first_slots : a.layers[l - 1].slots + 4 * kSms;
        const int parity = l & 1;
        /* A GEMV stage's start: its counter reached, the codes of its input made; stamps e, e + 1 */
        auto take_input = [&](const unsigned *wait_counter, unsigned target, int e, auto k, const __nv_bfloat16 *input,
                              const float2 *slots, int n_slots) {
            wait_for(wait_counter, target);
            STAMP(l, e);
            const Codes codes_of_input = make_codes<decltype(k)::value>(input, slots, n_slots, a.one_warp_slots, codes, scratch);
            STAMP(l, e + 1);
            return codes_of_input;
        };
        /* A GEMV stage's end: its counter raised, its buffer refilled with the next layer's rows */
        auto finish = [&](unsigned *stage_counter, const auto &stage, const uint4 *next_rows, int e) {
            arrive(stage_counter, a.release); /* its barrier: every thread is done with the buffer */
            if (threadIdx.x == 0 && next) stage.request(next_rows);
            STAMP(l, e);
        };
        using KH = std::integral_constant<int, kH>;

        /* S1: QKV */
        Codes x = take_input(l > 0 ? a.counters + (l - 1) * kStages + 4 : a.counters, l > 0 ? kSms : 0, 0, KH(), a.h,
                             h_slots, kSms);
        qkv.wait(parity);
        {
            const int row = qkv.row(0), d = qkv.dot(0, codes) - x.sum;
            if (threadIdx.x % 16 == 0 && row < kQkv) layer.qkv_out[row] = __float2bfloat16(d * x.step);
        }
        finish(counter + 0, qkv, next ? next->qkv : nullptr, 2);

        /* S2: attention */
        const __nv_bfloat16 *o_input = layer.qkv_out;
        const float2 *o_slots = a.first_slots;
        int o_slot_count = kSms;
        if (a.attention) {
            if (attends) {
                wait_for(counter + 0, kSms);
                STAMP(l, 12);
                attend(l, layer, a.counters + kLayers * kStages + l * kHkv, blockIdx.x, a.L, k_tile, v_tile, scores,
                       q, stats, counter + 1);
                STAMP(l, 13);
                if (next) load_unit(*next, blockIdx.x, a.L, k_tile, v_tile);
            }
            o_input = layer.attn;
            o_slots = layer.slots + 1 * kSms;
            o_slot_count = kHkv;
        }

        /* S3: o, h += y */
        x = take_input(a.attention ? counter + 1 : counter + 0, a.attention ? kHkv : kSms, 3, KH(), o_input, o_slots,
                       o_slot_count);
        o.wait(parity);
        project_add(o, codes, x, a.h, layer.slots + 2 * kSms + blockIdx.x, slot_scratch);
        finish(counter + 2, o, next ? next->o : nullptr, 5);

        /* S4: gate|up, g = relu(gate)^2 * up */
        x = take_input(counter + 2, kSms, 6, KH(), a.h, layer.slots + 2 * kSms, kSms);
        gate_up.wait(parity);
        {
            float2 acc = make_float2(0.0f, 0.0f);
#pragma unroll
            for (int p = 0; p < 2; p++) {
                /* rows are virtual: lanes 0-15 of a warp hold gate rows i, i + 1, lanes 16-31 their up rows */
                const float y = (gate_up.dot(p, codes) - x.sum) * x.step;
                const float up = __shfl_down_sync(~0u, y, 16);
                const int i = gate_up.row(p) / 4 * 2 + threadIdx.x % 16 / 8;
                if (threadIdx.x % 32 < 16 && threadIdx.x % 8 == 0 && i < kI) {
                    const float g = __bfloat162float(__float2bfloat16(fmaxf(y, 0.0f) * fmaxf(y, 0.0f) * up));
                    layer.glu[i] = __float2bfloat16(g);
                    acc = make_float2(acc.x + g * g, fmaxf(acc.y, fabsf(g)));
                }
            }
            write_slot(acc, layer.slots + 3 * kSms + blockIdx.x, slot_scratch);
        }
        finish(counter + 3, gate_up, next ? next->gate_up : nullptr, 8);

        /* S5: down, h += y */
        x = take_input(counter + 3, kSms, 9, std::integral_constant<int, kI>(), layer.glu, layer.slots + 3 * kSms, kSms);
        down.wait(parity);
        project_add(down, codes, x, a.h, layer.slots + 4 * kSms + blockIdx.x, slot_scratch);
        finish(counter + 4, down, next ? next->down : nullptr, 11);
    }
}

int units(int L) { return kHkv * unit_plan(L).per_head; }

/* Layer kLayers / 2 of the last launch: each event's median and latest block, µs after the
 * previous layer's last S5 arrival (attention events over the attention blocks only). */
std::string timeline(const char *name, int attention_blocks) {
    static unsigned long long stamps[kLayers][kEvents][kSms];
    if (cudaMemcpyFromSymbol(stamps, g_stamps, sizeof stamps) != cudaSuccess) return "no stamps\n";
    const int l = kLayers / 2;
    const unsigned long long t0 = *std::max_element(stamps[l - 1][11], stamps[l - 1][11] + kSms);
    static const char *names[kEvents] = {"S1 waited", "S1 codes", "S1 arrived", "S3 waited", "S3 codes",
                                         "S3 arrived", "S4 waited", "S4 codes", "S4 arrived", "S5 waited",
                                         "S5 codes", "S5 arrived", "S2 waited", "S2 done", "S2 q, K, V",
                                         "S2 partials"};
    std::string out = std::string("\n") + name + ", layer 15, µs after layer 14's last arrival: median / latest block\n";
    char line[160];
    for (int e = 0; e < kEvents; e++) {
        const int blocks = e >= 12 ? attention_blocks : kSms;
        if (blocks == 0) continue;
        std::vector<double> t;
        for (int b = 0; b < blocks; b++) t.push_back(((double)stamps[l][e][b] - (double)t0) / 1000.0);
        std::sort(t.begin(), t.end());
        snprintf(line, sizeof line, "  %-11s %7.2f %7.2f\n", names[e], t[t.size() / 2], t.back());
        out += line;
    }
    return out;
}

int main() {
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    if (sms != kSms) {
        fprintf(stderr, "the mock is laid out for %d SMs, this GPU has %d\n", kSms, sms);
        return 1;
    }
    constexpr int kMaxL = 1024, kMaxUnits = kSms;
    std::vector<Layer> layers(kLayers);
    auto alloc_fill = [](size_t bytes, int byte) {
        void *p = nullptr;
        if (cudaMalloc(&p, bytes) != cudaSuccess || cudaMemset(p, byte, bytes) != cudaSuccess) return (void *)nullptr;
        return p;
    };
    for (Layer &layer : layers) {
        layer.qkv = static_cast<const uint4 *>(alloc_fill((size_t)kQkv * kH / 4, 0x59));
        layer.o = static_cast<const uint4 *>(alloc_fill((size_t)kH * kH / 4, 0x65));
        layer.gate_up = static_cast<const uint4 *>(alloc_fill((size_t)2 * kI * kH / 4, 0x96));
        layer.down = static_cast<const uint4 *>(alloc_fill((size_t)kH * kI / 4, 0x5a));
        layer.k_cache = static_cast<const __nv_bfloat16 *>(alloc_fill((size_t)kMaxL * kHkv * kD * 2, 0x3c));
        layer.v_cache = static_cast<const __nv_bfloat16 *>(alloc_fill((size_t)kMaxL * kHkv * kD * 2, 0x3b));
        layer.qkv_out = static_cast<__nv_bfloat16 *>(alloc_fill((size_t)kQkv * 2, 0));
        layer.attn = static_cast<__nv_bfloat16 *>(alloc_fill((size_t)kHq * kD * 2, 0));
        layer.glu = static_cast<__nv_bfloat16 *>(alloc_fill((size_t)kI * 2, 0));
        layer.partial = static_cast<float *>(alloc_fill((size_t)kMaxUnits * kG * (kD + 2) * 4, 0));
        layer.slots = static_cast<float2 *>(alloc_fill((size_t)kStages * kSms * 8, 0));
        if (!layer.qkv || !layer.o || !layer.gate_up || !layer.down || !layer.k_cache || !layer.v_cache ||
            !layer.qkv_out || !layer.attn || !layer.glu || !layer.partial || !layer.slots) {
            fprintf(stderr, "out of device memory\n");
            return 1;
        }
    }
    Layer *d_layers;
    CHECK(cudaMalloc(&d_layers, sizeof(Layer) * kLayers));
    CHECK(cudaMemcpy(d_layers, layers.data(), sizeof(Layer) * kLayers, cudaMemcpyHostToDevice));
    const size_t counter_bytes = sizeof(unsigned) * kLayers * (kStages + kHkv);
    Args a = {};
    a.layers = d_layers;
    CHECK(cudaMalloc(&a.h, kH * 2));
    CHECK(cudaMemset(a.h, 0x3c, kH * 2));
    std::vector<float2> first(kSms, make_float2(1.0f, 1.0f));
    float2 *first_slots;
    CHECK(cudaMalloc(&first_slots, kSms * 8));
    CHECK(cudaMemcpy(first_slots, first.data(), kSms * 8, cudaMemcpyHostToDevice));
    a.first_slots = first_slots;
    CHECK(cudaMalloc(&a.counters, counter_bytes));
    const size_t shared = kSharedBytes;
    CHECK(cudaFuncSetAttribute(decode_step, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared));
    int per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_step, kThreads, shared));
    if (per_sm < 1) {
        fprintf(stderr, "the kernel does not fit an SM\n");
        return 1;
    }
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("%s: a mock 2B4T decode step (30 layers, batch 1) as one persistent kernel, %zu bytes of shared memory\n"
           "| case | µs a step (median of 9) | min |\n| --- | --- | --- |\n", prop.name, shared);
    struct Case {
        const char *name;
        int L;
        bool attention, release, one_warp_slots;
    } cases[] = {{"context 1024", 1024, true, true, false},
                 {"no attention stage", 1024, false, true, false},
                 {"context 1024, slots read by one warp a block", 1024, true, true, true},
                 {"no attention stage, slots read by one warp a block", 1024, false, true, true}};
    std::vector<std::string> timelines;
    for (const Case &c : cases) {
        a.L = c.L;
        a.attention = c.attention;
        a.release = c.release;
        a.one_warp_slots = c.one_warp_slots;
        void *args[] = {&a};
        std::vector<float> us;
        for (int run = 0; run < 10; run++) {
            CHECK(cudaMemsetAsync(a.counters, 0, counter_bytes));
            CHECK(cudaEventRecord(start));
            CHECK(cudaLaunchCooperativeKernel((void *)decode_step, dim3(kSms), dim3(kThreads), args, shared, nullptr));
            CHECK(cudaEventRecord(stop));
            CHECK(cudaEventSynchronize(stop));
            float ms = 0.0f;
            CHECK(cudaEventElapsedTime(&ms, start, stop));
            if (run > 0) us.push_back(ms * 1000.0f);
        }
        CHECK(cudaGetLastError());
        std::sort(us.begin(), us.end());
        printf("| %s | %.1f | %.1f |\n", c.name, us[us.size() / 2], us[0]);
        timelines.push_back(timeline(c.name, c.attention ? units(c.L) : 0));
    }
    for (const std::string &t : timelines) printf("%s", t.c_str());
    return 0;
}
