/* Decode attention over a KV cache, split-KV: out = softmax(q.k^T * scale + causal mask) v, float32
 * online softmax. Layout q/out [B, Sq, Hq, D], k/v [B, C, Hkv, D] (bf16/f16, D = 64, 128 or 256).
 * Grid (split, KV head x block of 16 query rows, sequence): the rows are one KV head's query heads x
 * new tokens, so each K/V byte is read once per 16 rows. A block of 4 warps streams every
 * num_splits-th 64-key tile through shared memory (cp.async); each warp does q.k and p.v for 16
 * keys of a tile with mma.sync m16n8k16. The splits of a group merge in one of two ways:
 * - cluster path (sm_90, few groups, e.g. batch 1): the splits are one thread-block cluster, one
 *   block per SM with 4 to 6 tile stages (with more groups, e.g. batch 8, two blocks per SM with
 *   2); each pushes its partial into the shared memory of the blocks that own the outputs
 *   (st.async), which finish them: no workspace, no second kernel;
 * - split path: about 3 blocks per SM (1 at D = 256, whose 2 stages take 136 KB), 2 tile stages,
 *   partials in the workspace and a merge kernel. D = 256 always takes it.
 * The NEW_TOKEN kernels are bitnet_attention_rope_append_kv: q is a decode step's qkv rows; each block
 * rotates its q rows (RoPE) into shared memory once its first loads are issued, and the block
 * whose keys hold the new token's position p places the rotated k row and the v row among them
 * (the copy from the cache stops below p) and writes them to the cache (see NewToken).
 * Before waiting for the previous kernel (programmatic dependent launch), each block prefetches its
 * first tiles into L2 when there are no seq_lens (L = C): see prefetch_tiles. Bytes moved: the K
 * and V rows up to seq_len. Tiles with keys that the causal mask hides from some rows are scanned
 * for inf and NaN values (see attend_row). H100, bf16, 20/5 heads, d = 128, L2 cold (BENCHMARKS.md,
 * 2026-11-26): B = 1 at 3.7 us (L = 1024), 5.9 us (4096), 89% of read bandwidth (32768); B = 8,
 * L = 32768 at 94%. Why each constant has its value: docs/attention.md, tuning rules, and docs/log/. */
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "attention_common.cuh"
#include "timeline.cuh"

namespace {

namespace cg = cooperative_groups;

constexpr int kRows = BN_ATTENTION_DECODE_BLOCK_ROWS; /* query rows per block: one m16 tile */
constexpr int kTileKeys = BN_ATTENTION_DECODE_TILE_KEYS;
constexpr int kWarps = 4, kThreads = kWarps * 32;
constexpr int kWarpKeys = kTileKeys / kWarps; /* each warp takes 16 keys of every tile */
/* The splits of one (sequence, KV head, row block) in a thread-block cluster merge in distributed
 * shared memory (sm_90): at most this many, the largest cluster size CUDA allows (non-portable). */
constexpr int kMaxClusterSplits = 16;
/* The cluster path is taken with at least this many splits per group, each of at most this many
 * tiles; otherwise the split path did as well or better on an H100 (batch 8: 3 splits per group;
 * L = 131072: 128 tiles per split, where streaming on every SM wins and the merge is cheap). */
constexpr int kMinClusterSplits = 4, kMaxClusterTilesPerSplit = 64;
/* Blocks per SM of the cluster kernel with kSplitStages stages at D = 128 (80 KB each): see
 * cluster_splits. */
constexpr int kSharedClusterBlocksPerSm = 2;

/* n / d and n % d by one multiply-high, exact where n * d < 2^32: magic = ceil(2^32 / d), made on
 * the host. The decode kernel's divisions are all in that range: blockIdx.y by the KV heads (both at
 * most 65535), a block's rows and output float4s by the group size and the split count, and the
 * cluster path's tile count. A generic 32-bit division takes about 20 dependent instructions, and
 * the tail of a call (the warps' combine, the pushes, the finishing step) is a chain of such
 * indices, so none of them is a generic division (docs/log/2026-11-24.md#2026-11-24-8). */
struct SmallDivisor {
    uint32_t d, magic;
    static SmallDivisor of(uint32_t d) { return {d, (uint32_t)(((1ull << 32) + d - 1) / d)}; }
    __device__ __forceinline__ int div(int n) const { return d == 1 ? n : (int)__umulhi((uint32_t)n, magic); }
    __device__ __forceinline__ int mod(int n) const { return n - div(n) * (int)d; }
};

/* Tile stages (shared-memory buffers) per block: 2 where several blocks share an SM (the split path,
 * and the cluster path's shared SMs); on the cluster path's one block per SM, 4 to 6 by the tiles of
 * a split (cluster_stages). How many of them are in flight: see kAhead in decode_kernel. */
constexpr int kSplitStages = 2;

/* The cluster path's stages per block, 128 to 192 KB at D = 128: 5, 4 where a split has at most 4
 * tiles, 6 where it has 16 or more: the fastest count for each split length on an H100
 * (docs/log/2026-11-23.md#2026-11-23-19). */
int cluster_stages(int64_t split_tiles) { return split_tiles <= 4 ? 4 : split_tiles < 16 ? 5 : 6; }

/* Tiles that a block prefetches into L2 before its PDL wait: its first load's, except on the cluster
 * path where a split has more tiles than that load takes: there only 2. The blocks that start
 * early, beside the previous call, would otherwise delay its last loads with their burst; more
 * than 2 was slower (docs/log/2026-11-23.md#2026-11-23-19). */
template <bool CLUSTER, int STAGES> __device__ __forceinline__ int prefetch_tiles(int split_tiles) {
    return CLUSTER && split_tiles > STAGES - 1 ? 2 : STAGES;
}

/* The cluster kernel for splits of at most 4 tiles (4 stages) moves a row's running max only where a
 * tile's max passes it by more than kLazyMaxStep (log2 units), and rescales the accumulators only
 * then, on a warp-uniform branch: with random scores, at the first tile only. In between, the
 * weights reach up to 2^kLazyMaxStep, which the float32 sums and the bf16 or f16 probabilities hold
 * with the same relative rounding. Only the 4-stage kernel is lazy: the longer splits keep
 * online_softmax_step's exact max, which was faster for them (docs/log/2026-11-24.md#2026-11-24-9). */
constexpr int kLazyRescaleStages = 4;
constexpr float kLazyMaxStep = 8.0f;

/* online_softmax_step with the lazy max; true where some row of the warp moved its max, whose
 * accumulators then need rescale[half] (1 for the rows that did not move). */
__device__ __forceinline__ bool lazy_softmax_step(const float (&tile_max)[2], float (&m_run)[2],
                                                  float (&l_run)[2], float (&base)[2], float (&rescale)[2]) {
    bool moved = false;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const float m_tile = quad_max(tile_max[half]);
        const bool move = m_tile > m_run[half] + kLazyMaxStep;
        rescale[half] = move ? exp2_weight(m_run[half] - m_tile) : 1.0f;
        m_run[half] = move ? m_tile : m_run[half];
        l_run[half] *= rescale[half];
        base[half] = m_run[half] == -INFINITY ? 0.0f : m_run[half];
        moved |= move;
    }
    return __any_sync(0xffffffffu, moved);
}

/* Cluster path: what the cluster's blocks push into this block's shared memory for its share of the
 * outputs (see push_partial), and the barrier that completes once all of it has landed. */
template <int D>
struct ClusterInbox {
    float4 o[kRows * D / 4 + kMaxClusterSplits]; /* [split][owned float4], ceil(n4 / splits) each */
    float2 ml[kMaxClusterSplits][kRows];         /* every split's (max, sum) of each row */
    uint64_t landed;                             /* mbarrier, one phase */

    /* The row block's output float4s (n4), each split's share of them (ceil(n4 / splits), the
     * size of its slot in o), and how many of them block `rank` owns (see push_partial). */
    __device__ static int float4s(int rows) { return rows * D / 4; }
    __device__ static int per_split(int rows, SmallDivisor splits) {
        return splits.div(float4s(rows) + (int)splits.d - 1);
    }
    __device__ static int owned(int rows, int splits, int rank) {
        return (float4s(rows) - rank + splits - 1) / splits;
    }
};
struct NoInbox {};

/* A new token's RoPE cos and sin, its rotated k row and its v row (NEW_TOKEN kernels). */
template <int D>
struct NewRows {
    float cos[D / 2], sin[D / 2];
    uint4 k[D / 8], v[D / 8];
};

/* Shared memory of one block: the K and V tile stages and the q rows, 16-byte chunks XOR-swizzled
 * for ldmatrix. After the key loop the tiles hold the warps' partial results. */
template <int D, bool CLUSTER, int STAGES, bool NEW_TOKEN>
struct DecodeShared {
    uint4 k[STAGES][kTileKeys][D / 8];
    uint4 v[STAGES][kTileKeys][D / 8];
    uint4 q[kRows][D / 8];
    std::conditional_t<CLUSTER, ClusterInbox<D>, NoInbox> inbox;
    std::conditional_t<NEW_TOKEN, NewRows<D>, NoInbox> new_rows;
};

/* bitnet_attention_rope_append_kv (the NEW_TOKEN kernels): q points at a decode step's qkv rows
 * ([B, 1, Hq + 2 Hkv, D]), whose q and k heads the kernel rotates (RoPE) and whose k and v rows it
 * appends to the cache at p = positions[b], then attends to keys 0 .. p. */
template <typename T>
struct NewToken {
    const int32_t *positions;
    T *k_cache, *v_cache;
    double log2_theta;
};

/* The keys a sequence attends to: positions[b] + 1 for a new token (0, which valid_seq_len
 * refuses, where that position is outside [0, C)), else seq_lens[b], or all C without them. */
template <bool NEW_TOKEN>
__device__ __forceinline__ int sequence_keys(const int32_t *seq_lens, const int32_t *positions, int b, int C) {
    if constexpr (NEW_TOKEN) return positions[b] >= 0 && positions[b] < C ? positions[b] + 1 : 0;
    return seq_lens ? seq_lens[b] : C;
}

/* Rows padded by 8 floats: a warp's float2 stores of its accumulator fragments (rows g, columns 2t)
 * then hit 32 different banks; unpadded they conflict 8 ways (docs/log/2026-11-22.md#2026-11-22-10). */
constexpr int kCombinePad = 8;
template <int D>
struct DecodeCombine { /* overlays DecodeShared::k and ::v */
    float o[kWarps][kRows][D + kCombinePad];
    float m[kWarps][kRows];
    float l[kWarps][kRows];
};

/* Copies keys [key0, key0 + kTileKeys) of one KV head into a stage; rows at or past `keys_end`
 * become zeros (nothing is read there). Prefill's load_rows issues the same copies in the same
 * order with the offset computed once per thread; here that was slower on the cluster path
 * (docs/log/2026-11-24.md#2026-11-24-3). */
template <typename T, int D>
__device__ __forceinline__ void load_tile(uint4 (*k_dst)[D / 8], uint4 (*v_dst)[D / 8], const T *k,
                                          const T *v, int64_t stride, int key0, int keys_end) {
    constexpr int kChunks = D / 8;
#pragma unroll
    for (int i = threadIdx.x; i < kTileKeys * kChunks; i += kThreads) {
        int key = i / kChunks, chunk = i % kChunks;
        bool inside = key0 + key < keys_end;
        int64_t offset = inside ? (int64_t)(key0 + key) * stride + chunk * 8 : 0;
        cp_async_16(&k_dst[key][swizzle(key, chunk)], k + offset, inside);
        cp_async_16(&v_dst[key][swizzle(key, chunk)], v + offset, inside);
    }
}

/* Hints that keys [key_begin, key_end) of a head will be read soon: L2 prefetches (sm_90, where
 * programmatic dependent launch lets them run before the previous kernel ends). L2 is where the
 * previous kernel's writes land, so a prefetch issued before waiting for it cannot make a later
 * load stale. One prefetch.global.L2 per 128-byte line: cp.async.bulk.prefetch of whole rows was
 * slower (docs/log/2026-11-25.md#2026-11-25-3). */
template <typename T, int D>
__device__ __forceinline__ void prefetch_keys_l2(const T *k, const T *v, int64_t stride, int key_begin,
                                                 int key_end) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    for (int key = key_begin + threadIdx.x; key < key_end; key += kThreads) {
#pragma unroll
        for (int dim = 0; dim < D; dim += 128 / sizeof(T)) { /* one 128-byte L2 line at a time */
            asm volatile("prefetch.global.L2 [%0];" ::"l"(k + key * stride + dim));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(v + key * stride + dim));
        }
    }
#endif
}

/* Cluster path (sm_90): the splits' partials of a row block meet in the shared memory of their owners.
 * Of the n4 = rows * D / 4 float4s of the row block's outputs (row-major), float4 j belongs to block
 * j % splits. Every block pushes its partial of float4 j into the owner's inbox.o[split * per_split +
 * j / splits] (per_split = ceil(n4 / splits)) and its (max, sum) of every row into every block's
 * inbox.ml[split], with st.async, whose bytes complete the owner's mbarrier `landed`. A block may
 * write another's shared memory only once that block runs and has initialized its mbarrier: each
 * block does so, then arrives on the cluster barrier, and waits on it before its first push. No
 * block exits before all the bytes pushed to it have landed: each owns at least float4 `rank`
 * (n4 >= D / 4 >= kMaxClusterSplits), so its thread 0 waits for them. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t shared_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ uint32_t cluster_addr(const void *local, int rank) {
    uint32_t addr;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(addr) : "r"(shared_addr(local)), "r"(rank));
    return addr;
}
#endif

template <int D>
__device__ void inbox_open(ClusterInbox<D> &inbox, int rank, int splits, int rows) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0) {
        const int owned = ClusterInbox<D>::owned(rows, splits, rank);
        const uint32_t bytes = splits * (owned * sizeof(float4) + rows * sizeof(float2));
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_addr(&inbox.landed)));
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     ::"r"(shared_addr(&inbox.landed)), "r"(bytes) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); /* the fence released the init */
#endif
}

/* Block `rank`'s partial of output float4 j (unnormalized, with its row's max and sum) to its owner. */
template <int D>
__device__ __forceinline__ void push_partial(ClusterInbox<D> &inbox, int rank, SmallDivisor splits,
                                             int rows, int j, float4 acc, float m, float l) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static_assert(D / 4 >= kMaxClusterSplits, "a row's float4s must cover every split");
    const int per_split = ClusterInbox<D>::per_split(rows, splits), owner = splits.mod(j);
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                 ::"r"(cluster_addr(&inbox.o[rank * per_split + splits.div(j)], owner)), "f"(acc.x),
                 "f"(acc.y), "f"(acc.z), "f"(acc.w), "r"(cluster_addr(&inbox.landed, owner)) : "memory");
    const int r = j / (D / 4), to = j % (D / 4); /* float4 `to` of row r sends its (max, sum) to block `to` */
    if (to < (int)splits.d)
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
                     ::"r"(cluster_addr(&inbox.ml[rank][r], to)), "f"(m), "f"(l),
                     "r"(cluster_addr(&inbox.landed, to)) : "memory");
#endif
}

/* acc += weight * o, per component. */
__device__ __forceinline__ void add_scaled(float4 &acc, float weight, float4 o) {
    acc.x += weight * o.x, acc.y += weight * o.y, acc.z += weight * o.z, acc.w += weight * o.w;
}

/* out[0..3] = acc / l as T (out 8-byte aligned), by one division and four multiplies. */
template <typename T>
__device__ __forceinline__ void store4(T *out, float4 acc, float l) {
    const float inv = 1.0f / l;
    *reinterpret_cast<uint2 *>(out) =
        make_uint2(pack2<T>(acc.x * inv, acc.y * inv), pack2<T>(acc.z * inv, acc.w * inv));
}

/* Block `rank` finishes the float4s it owns once every split's partial has landed:
 * out = sum_s w_s o_s / sum_s w_s l_s with w_s = 2^(m_s - max m). */
template <typename T, int D, typename OutRow>
__device__ void finish_owned(const ClusterInbox<D> &inbox, int rank, SmallDivisor splits, int rows,
                             OutRow out_row, T *__restrict__ out BN_TIMELINE(, TimelineRecord *record)) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const int n4 = ClusterInbox<D>::float4s(rows), per_split = ClusterInbox<D>::per_split(rows, splits);
    const int n_splits = (int)splits.d;
    if (rank + (int)threadIdx.x * n_splits >= n4) return; /* nothing owned; thread 0 always owns one */
    uint32_t landed = 0;
    while (!landed)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;"
                     " selp.u32 %0, 1, 0, p; }" : "=r"(landed) : "r"(shared_addr(&inbox.landed)) : "memory");
    BN_TIMELINE(if (record) record->t[8] = timeline_now();)
    for (int local = threadIdx.x; rank + local * n_splits < n4; local += kThreads) {
        const int j = rank + local * n_splits, r = j / (D / 4), d = j % (D / 4) * 4;
        float m[kMaxClusterSplits], l[kMaxClusterSplits];
        float4 o[kMaxClusterSplits];
        float m_max = -INFINITY;
#pragma unroll
        for (int s = 0; s < kMaxClusterSplits; s++) { /* all the loads in flight at once */
            m[s] = -INFINITY, l[s] = 0.0f, o[s] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (s < n_splits) {
                m[s] = inbox.ml[s][r].x, l[s] = inbox.ml[s][r].y;
                o[s] = inbox.o[s * per_split + local];
            }
            m_max = fmaxf(m_max, m[s]);
        }
        const float base = m_max == -INFINITY ? 0.0f : m_max;
        float l_tot = 0.0f;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int s = 0; s < kMaxClusterSplits; s++) {
            const float weight = exp2_weight(m[s] - base);
            l_tot += weight * l[s];
            add_scaled(acc, weight, o[s]);
        }
        store4(out + out_row(r) * D + d, acc, l_tot);
    }
    BN_TIMELINE(if (record) record->t[9] = timeline_now();)
#endif
}

/* See attend_row: warp w's slots of the block's combine redone over every 4th of its tiles, from
 * its w-th on (tile_at(i), i < tile_count, as in decode_kernel). Out of line, so that its registers
 * stay out of the key loop's. */
template <typename T, int D, typename TileAt, typename OutRow>
__device__ __noinline__ void redo_warp_rows(const T *q, const T *k_head, const T *v_head, int64_t stride,
                                            DecodeCombine<D> &combine, int rows, int row0, SmallDivisor group,
                                            int Sq, int L, int causal, TileAt tile_at, int tile_count,
                                            float scale_log2, OutRow out_row) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = 0; r < rows; r++) {
        const int keys_end = causal ? L - Sq + group.div(row0 + r) + 1 : L;
        float o_row[D / 32] = {}, m = -INFINITY, l = 0.0f;
        for (int i = warp; i < tile_count; i += kWarps) {
            const int key0 = tile_at(i) * kTileKeys;
            attend_row<T, D>(q + out_row(r) * D, k_head, v_head, stride, key0,
                             min(keys_end, key0 + kTileKeys), scale_log2, o_row, m, l);
        }
        combine.m[warp][r] = m, combine.l[warp][r] = l;
#pragma unroll
        for (int i = 0; i < D / 32; i++) combine.o[warp][r][lane * (D / 32) + i] = o_row[i];
    }
}

/* A sequence whose device-resident length is out of range gets NaN outputs (valid_seq_len). */
template <typename T, int D, typename OutRow>
__device__ __forceinline__ void write_nan_rows(T *__restrict__ out, int rows, OutRow out_row) {
    for (int i = threadIdx.x; i < rows * D; i += kThreads)
        out[out_row(i / D) * D + i % D] = from_float<T>(__int_as_float(0x7fc00000));
}

/* The key loop's prologue: the first `AHEAD` tiles of this block (keys below keys_end), one cp.async
 * group each; unless a new token's q is rotated into place (load_q false), the first group also
 * brings the block's q rows (rows past `rows` become zeros). */
template <typename T, int D, int AHEAD, typename Shared, typename TileAt, typename OutRow>
__device__ __forceinline__ void issue_first_tiles(Shared &sm, const T *k_head, const T *v_head, int64_t stride,
                                                  const T *__restrict__ q, bool load_q, int rows,
                                                  int tile_count, TileAt tile_at, OutRow out_row,
                                                  int keys_end) {
    constexpr int kChunks = D / 8;
    for (int i = 0; i < AHEAD; i++) {
        if (i < tile_count)
            load_tile<T, D>(sm.k[i], sm.v[i], k_head, v_head, stride, tile_at(i) * kTileKeys, keys_end);
        for (int j = threadIdx.x; load_q && i == 0 && j < kRows * kChunks; j += kThreads) {
            int r = j / kChunks, chunk = j % kChunks;
            cp_async_16(&sm.q[r][swizzle(r, chunk)], q + (r < rows ? out_row(r) * D + chunk * 8 : 0),
                        r < rows);
        }
        cp_async_commit();
    }
}

/* A new token's prologue, after the block's first loads are issued: RoPE's cos and sin of position
 * p (float64, rounded to float32) and the rotated q rows, in shared memory as the key loop reads
 * them (rows past `rows` zeros); where `appends` (the block whose keys hold p), its rotated k row
 * and its v row too, which the first row block of its KV head also writes to the cache. The
 * arithmetic is bitnet_rope_append_kv's (bn_rope_angle, bn_rope_rotate), so the values are that
 * op's. Ends with a barrier. */
template <typename T, int D, typename Shared, typename QRow>
__device__ void rotate_new_token(Shared &sm, const NewToken<T> &token, const T *__restrict__ qkv, int rows,
                                 QRow q_row, int p, bool appends, const T *k_row, const T *v_row,
                                 int64_t cache_row, bool writes_cache) {
    constexpr int kHalf = D / 2;
    auto &rope = sm.new_rows;
    for (int i = threadIdx.x; i < kHalf; i += kThreads) {
        double sin_d, cos_d;
        sincos(bn_rope_angle(p, i, D, token.log2_theta), &sin_d, &cos_d);
        rope.cos[i] = (float)cos_d;
        rope.sin[i] = (float)sin_d;
    }
    __syncthreads();
    auto element = [](uint4 *row, int r, int e) -> T & {
        return reinterpret_cast<T *>(&row[swizzle(r, e / 8)])[e % 8];
    };
    for (int j = threadIdx.x; j < kRows * kHalf; j += kThreads) {
        const int r = j / kHalf, i = j % kHalf;
        T lo = from_float<T>(0.0f), hi = lo;
        if (r < rows) {
            const T *src = qkv + q_row(r) * D;
            bn_rope_rotate(to_float(src[i]), to_float(src[i + kHalf]), rope.cos[i], rope.sin[i], lo, hi);
        }
        element(sm.q[r], r, i) = lo;
        element(sm.q[r], r, i + kHalf) = hi;
    }
    if (appends) {
        T *new_k = reinterpret_cast<T *>(rope.k), *new_v = reinterpret_cast<T *>(rope.v);
        for (int i = threadIdx.x; i < kHalf; i += kThreads) {
            bn_rope_rotate(to_float(k_row[i]), to_float(k_row[i + kHalf]), rope.cos[i], rope.sin[i],
                           new_k[i], new_k[i + kHalf]);
            new_v[i] = v_row[i], new_v[i + kHalf] = v_row[i + kHalf];
            if (writes_cache) {
                token.k_cache[cache_row + i] = new_k[i], token.k_cache[cache_row + i + kHalf] = new_k[i + kHalf];
                token.v_cache[cache_row + i] = new_v[i], token.v_cache[cache_row + i + kHalf] = new_v[i + kHalf];
            }
        }
    }
    __syncthreads();
}

/* A new token's k and v rows into the stage that holds its key, `key` of the tile. The stage's copy
 * left that row zero (its loads end below the key); each of its chunks is written by the thread
 * that issued its copy (load_tile's order), after that thread's wait for it, so no barrier is
 * needed before the one that follows the wait. */
template <int D>
__device__ __forceinline__ void place_new_row(uint4 (*k_stage)[D / 8], uint4 (*v_stage)[D / 8], const uint4 *new_k,
                                              const uint4 *new_v, int key) {
    constexpr int kChunks = D / 8;
    const int chunk = ((int)threadIdx.x - key * kChunks % kThreads + kThreads) % kThreads;
    if (chunk < kChunks) {
        k_stage[key][swizzle(key, chunk)] = new_k[chunk];
        v_stage[key][swizzle(key, chunk)] = new_v[chunk];
    }
}

/* Combine the warps, first step: each writes its unnormalized rows, max and sum to shared memory
 * (rows 8-15 only where they are not all padding). */
template <int D>
__device__ __forceinline__ void store_warp_partials(DecodeCombine<D> &combine, const float (&o)[D / 8][4],
                                                    const float (&m_run)[2], const float (&l_run)[2],
                                                    int rows, int warp, int lane) {
    constexpr int kDimTiles = D / 8;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        if (half == 1 && rows <= 8) break;
        int r = g + 8 * half;
        float l = quad_sum(l_run[half]);
        if (t == 0) {
            combine.m[warp][r] = m_run[half];
            combine.l[warp][r] = l;
        }
#pragma unroll
        for (int dt = 0; dt < kDimTiles; dt++)
            *reinterpret_cast<float2 *>(&combine.o[warp][r][dt * 8 + 2 * t]) =
                make_float2(o[dt][2 * half], o[dt][2 * half + 1]);
    }
}

/* Combine the warps, second step, one output float4 per thread at a time: the block's result,
 * stored (one split), pushed to its owner (cluster path) or written to the workspace with its row's
 * max and sum (split path, for merge_kernel). */
template <typename T, int D, bool CLUSTER, typename Shared, typename OutRow>
__device__ __forceinline__ void write_block_outputs(const DecodeCombine<D> &combine, Shared &sm, int rows,
                                                    int split, SmallDivisor splits, OutRow out_row,
                                                    T *__restrict__ out, float *__restrict__ partial_out,
                                                    float *__restrict__ partial_ml) {
    const int num_splits = (int)splits.d;
    for (int j = threadIdx.x; j < rows * (D / 4); j += kThreads) { /* output float4s */
        const int r = j / (D / 4), d = j % (D / 4) * 4;
        float m_tot = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; w++) m_tot = fmaxf(m_tot, combine.m[w][r]);
        const float base = m_tot == -INFINITY ? 0.0f : m_tot;
        float l_tot = 0.0f;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int w = 0; w < kWarps; w++) {
            const float weight = exp2_weight(combine.m[w][r] - base);
            const float4 o = *reinterpret_cast<const float4 *>(&combine.o[w][r][d]);
            l_tot += weight * combine.l[w][r];
            add_scaled(acc, weight, o);
        }
        const int64_t row = out_row(r);
        if (num_splits == 1) {
            store4(out + row * D + d, acc, l_tot);
        } else if constexpr (CLUSTER) {
            push_partial(sm.inbox, split, splits, rows, j, acc, m_tot, l_tot);
        } else {
            const int64_t slot = row * num_splits + split;
            float *dst = partial_out + slot * D + d;
            dst[0] = acc.x, dst[1] = acc.y, dst[2] = acc.z, dst[3] = acc.w;
            if (d == 0) {
                partial_ml[2 * slot] = m_tot;
                partial_ml[2 * slot + 1] = l_tot;
            }
        }
    }
}

/* The key loop's first stage: S = Q K^T for this warp's 16 keys (key_row0 within the tile, key0 in
 * the sequence) with mma.sync, in log2 units; keys at or past L, or past a row's last key, are
 * -inf. tile_max: the max of each of the lane's two rows (g and g + 8). */
template <typename T, int D>
__device__ __forceinline__ void tile_scores(const uint4 (*k_tile)[D / 8], const uint32_t (&qf)[D / 16][4],
                                            int key_row0, int key0, int L, const int (&last_key)[2],
                                            float scale_log2, float (&s)[2][4], float (&tile_max)[2]) {
    const int lane = threadIdx.x % 32, t = lane % 4;
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[nt][e] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < D / 16; kc++) {
        uint32_t kb[4];
        int row = key_row0 + lane % 8 + 8 * (lane / 16);
        ldmatrix_x4(kb, &k_tile[row][swizzle(row, 2 * kc + lane / 8 % 2)]);
        mma<T>(s[0], qf[kc], kb[0], kb[1]);
        mma<T>(s[1], qf[kc], kb[2], kb[3]);
    }
    tile_max[0] = tile_max[1] = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int key = key0 + nt * 8 + 2 * t + e % 2;
            float x = key < L && key <= last_key[e / 2] ? s[nt][e] * scale_log2 : -INFINITY;
            s[nt][e] = x;
            tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
        }
    }
}

/* The key loop's second stage: P = 2^(S - base) rounded to T (the row sums added to l_run), and
 * O += P V over the warp's 16 keys of the tile; O rescaled first where RESCALE. */
template <typename T, int D, bool RESCALE>
__device__ __forceinline__ void accumulate_pv(const uint4 (*v_tile)[D / 8], float (&s)[2][4],
                                              const float (&base)[2], const float (&rescale)[2], int key_row0,
                                              float (&l_run)[2], float (&o)[D / 8][4]) {
    const int lane = threadIdx.x % 32;
    uint32_t pf[4];
#pragma unroll
    for (int nt = 0; nt < 2; nt++) softmax_probs<T>(s[nt], base, l_run, pf[2 * nt], pf[2 * nt + 1]);
#pragma unroll
    for (int dp = 0; dp < D / 16; dp++) {
        uint32_t vb[4];
        int row = key_row0 + lane % 8 + 8 * (lane / 8 % 2);
        ldmatrix_x4_trans(vb, &v_tile[row][swizzle(row, 2 * dp + lane / 16)]);
        if constexpr (RESCALE) {
            rescale_rows(o[2 * dp], rescale);
            rescale_rows(o[2 * dp + 1], rescale);
        }
        mma<T>(o[2 * dp], pf, vb[0], vb[1]);
        mma<T>(o[2 * dp + 1], pf, vb[2], vb[3]);
    }
}

/* Block (split, KV head + row block, sequence). Row r of the block is query row row0 + r of its KV
 * head: token (row0 + r) / G, head kvh * G + (row0 + r) % G. Warp w computes, for every 64-key
 * tile, S = Q K^T over keys [16w, 16w + 16) and O += P V with mma.sync, keeping its own running
 * max and sum; the 4 warps are combined at the end. Fragment coordinates as in PTX m16n8k16: lane
 * 4g + t holds rows g and g + 8, columns 2t and 2t + 1 of each 8-wide n tile. The parameters come in
 * the order the prologue first reads them: a block on an SM that has not run this kernel yet (the
 * clusters that start only once the previous call ends) misses the constant cache on each line of
 * parameters in turn, and the prologue's share the first (44 bytes)
 * (docs/log/2026-11-24.md#2026-11-24-9). */
template <typename T, int D, bool CLUSTER, int STAGES, bool NEW_TOKEN>
__global__ void __launch_bounds__(kThreads)
decode_kernel(const int32_t *__restrict__ seq_lens, const T *__restrict__ k, const T *__restrict__ v, int C,
              SmallDivisor splits, SmallDivisor kv_heads, const T *__restrict__ q, SmallDivisor group, int Sq,
              int Hq, int causal, float scale_log2, T *__restrict__ out,
              float *__restrict__ partial_out, float *__restrict__ partial_ml, NewToken<T> token) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    if (CLUSTER) return; /* launched on sm_90 only (cluster_splits): no code for older GPUs */
#endif
    constexpr int kDimTiles = D / 8, kStageCount = STAGES;
    constexpr bool kLazy = CLUSTER && STAGES == kLazyRescaleStages;
    BN_TIMELINE(TimelineBlock timeline; if (CLUSTER) timeline.start();)
    /* Tiles issued ahead of the one computed. The 5- and 6-stage kernels issue one less than their
     * stages allow: iteration i then refills the stage that iteration i - 2 read, which every warp
     * has left once it passes iteration i - 1's barrier, so their key loop needs one barrier per
     * tile instead of two (docs/log/2026-11-26.md#2026-11-26-1). The others keep every stage
     * but one in flight: the 4-stage kernel takes all of its split's tiles at once, and the split
     * path has only 2 stages. */
    constexpr int kAhead = CLUSTER && STAGES > kLazyRescaleStages ? kStageCount - 2 : kStageCount - 1;
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    auto &sm = *reinterpret_cast<DecodeShared<D, CLUSTER, STAGES, NEW_TOKEN> *>(smem_bytes);
    auto &combine = *reinterpret_cast<DecodeCombine<D> *>(smem_bytes);
    const int Hkv = (int)kv_heads.d, num_splits = (int)splits.d;
    const int split = blockIdx.x, kvh = kv_heads.mod(blockIdx.y), b = blockIdx.z;
    const int64_t stride = (int64_t)Hkv * D;
    const T *k_head = k + ((int64_t)b * C * Hkv + kvh) * D;
    const T *v_head = v + ((int64_t)b * C * Hkv + kvh) * D;
    /* This block's keys: every num_splits-th 64-key tile below L, from tile `split` on, so that the
     * splits of all heads read neighbouring tiles at the same time (contiguous shares per split
     * were slower: docs/log/2026-11-24.md#2026-11-24-3). */
    int tile_count;
    auto split_tiles = [&](int keys) {
        const int tiles = (keys + kTileKeys - 1) / kTileKeys;
        const int rounds = tiles - split + num_splits - 1; /* cluster path: below 65 * 16, see SmallDivisor */
        tile_count = split < tiles ? (CLUSTER ? splits.div(rounds) : rounds / num_splits) : 0;
    };
    auto tile_at = [=](int i) { return split + i * num_splits; };
    const int row0 = kv_heads.div(blockIdx.y) * kRows;
    const int rows = min(kRows, Sq * (int)group.d - row0);
    /* Without seq_lens or positions, L = C is known before the wait, and so are the first tiles:
     * prefetch them. Otherwise L may come from the previous kernel: nothing is prefetched, since
     * guessing L = C would fetch tiles past L. */
    if (!NEW_TOKEN && seq_lens == nullptr) {
        split_tiles(C);
        const int n = min(tile_count, prefetch_tiles<CLUSTER, STAGES>(tile_count));
        for (int i = 0; i < n; i++)
            prefetch_keys_l2<T, D>(k_head, v_head, stride, tile_at(i) * kTileKeys,
                                   min(C, (tile_at(i) + 1) * kTileKeys));
    }
    bn_pdl_wait(); /* q, the cache, seq_lens and positions may come from the previous kernel */
    BN_TIMELINE(timeline.at(1);)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
    const int L = sequence_keys<NEW_TOKEN>(seq_lens, token.positions, b, C);
    const int q_heads = NEW_TOKEN ? Hq + 2 * Hkv : Hq; /* per token in q, or in qkv */
    auto head_row = [=](int r, int heads) { /* block row r's row of an array of `heads` per token */
        int row = row0 + r;
        return ((int64_t)b * Sq + group.div(row)) * heads + kvh * (int)group.d + group.mod(row);
    };
    auto out_row = [=](int r) { return head_row(r, Hq); };
    auto q_row = [=](int r) { return head_row(r, q_heads); };
    if (!valid_seq_len(L, C, Sq, causal)) {
        if (num_splits == 1 || (CLUSTER && split == 0)) write_nan_rows<T, D>(out, rows, out_row);
        return; /* the whole cluster returns here; with a merge kernel, it writes the NaNs */
    }
    if (NEW_TOKEN || seq_lens) split_tiles(L); /* else L = C: counted above */

    /* A new token's key, the last, is not copied from the cache but placed from its qkv row. */
    const int keys_end = NEW_TOKEN ? L - 1 : L, new_tile = NEW_TOKEN ? (L - 1) / kTileKeys : -1;
    issue_first_tiles<T, D, kAhead>(sm, k_head, v_head, stride, q, !NEW_TOKEN, rows, tile_count,
                                    tile_at, q_row, keys_end);
    if constexpr (NEW_TOKEN) {
        const T *k_row = q + ((int64_t)b * q_heads + Hq + kvh) * D, *v_row = k_row + (int64_t)Hkv * D;
        rotate_new_token<T, D>(sm, token, q, rows, q_row, L - 1, new_tile % num_splits == split, k_row, v_row,
                               (((int64_t)b * C + L - 1) * Hkv + kvh) * D, row0 == 0);
    }

    /* Here, behind the first loads: the fence of its mbarrier's initialization delays whatever
     * follows it, so it must not precede the PDL wait or the loads
     * (docs/log/2026-11-26.md#2026-11-26-4). */
    if constexpr (CLUSTER) inbox_open(sm.inbox, split, num_splits, rows);
    /* This lane's rows g and g + 8 see keys up to last_key[.] (rows past `rows` are padding). */
    int last_key[2];
#pragma unroll
    for (int half = 0; half < 2; half++)
        last_key[half] = causal ? L - Sq + group.div(row0 + g + 8 * half) : L - 1;

    /* Keys after the block's first row's last key are hidden from some of its rows. */
    const int first_row_last_key = causal ? L - Sq + group.div(row0) : L - 1;
    bool hidden_nonfinite_v = false; /* an inf or NaN value at a hidden key: see attend_row */

    uint32_t qf[D / 16][4];
    float o[kDimTiles][4] = {};
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    for (int i = 0; i < tile_count; i++) {
        const int tile = tile_at(i), stage = i % kStageCount;
        const int ahead = i + kAhead; /* into the stage that iteration i - 1 or i - 2 read */
        if (ahead < tile_count) {
            const int ahead_stage = ahead % kStageCount;
            load_tile<T, D>(sm.k[ahead_stage], sm.v[ahead_stage], k_head, v_head, stride,
                            tile_at(ahead) * kTileKeys, keys_end);
        }
        /* The cluster path lets the next kernel launch once this block has issued its last load,
         * so that its blocks start on the free SMs and prefetch while this one finishes. Where the
         * prologue issued every tile, that waits for the end of the key loop: launching at the
         * kernel's start was slower (docs/log/2026-11-26.md#2026-11-26-4). */
        if (CLUSTER && ahead == tile_count) bn_pdl_launch_dependents();
        cp_async_commit();
        cp_async_wait<kAhead>();
        if constexpr (NEW_TOKEN)
            if (tile == new_tile)
                place_new_row<D>(sm.k[stage], sm.v[stage], sm.new_rows.k, sm.new_rows.v, (L - 1) % kTileKeys);
        if (first_row_last_key < L - 1 && (tile + 1) * kTileKeys - 1 > first_row_last_key)
            hidden_nonfinite_v |= __syncthreads_or(
                copied_chunks_nonfinite<T, D, kTileKeys, kThreads>(sm.v[stage]));
        else
            __syncthreads();
        BN_TIMELINE(timeline.tile(i, tile_count);)
        if (i == 0) {
#pragma unroll
            for (int kc = 0; kc < D / 16; kc++) {
                int row = lane % 8 + 8 * (lane / 8 % 2);
                ldmatrix_x4(qf[kc], &sm.q[row][swizzle(row, 2 * kc + lane / 16)]);
            }
        }

        const int key_row0 = warp * kWarpKeys; /* this warp's 16 keys within the tile */
        float s[2][4], tile_max[2];
        tile_scores<T, D>(sm.k[stage], qf, key_row0, tile * kTileKeys + key_row0, L, last_key, scale_log2, s,
                          tile_max);
        float rescale[2], base[2];
        if constexpr (kLazy) {
            if (lazy_softmax_step(tile_max, m_run, l_run, base, rescale) && i > 0) { /* else o is zero */
#pragma unroll
                for (int dt = 0; dt < kDimTiles; dt++) rescale_rows(o[dt], rescale);
            }
        } else {
            online_softmax_step(tile_max, m_run, l_run, base, rescale);
        }
        accumulate_pv<T, D, !kLazy>(sm.v[stage], s, base, rescale, key_row0, l_run, o); /* the lazy step rescaled o */
        if (kAhead == kStageCount - 1) __syncthreads(); /* the stage is refilled next iteration */
    }
    cp_async_wait<0>();
    __syncthreads(); /* every warp is done with the tiles before they hold partial results */
    BN_TIMELINE(timeline.at(6);)
    if (!CLUSTER || tile_count < kAhead) bn_pdl_launch_dependents(); /* see above */

    store_warp_partials<D>(combine, o, m_run, l_run, rows, warp, lane);
    if (hidden_nonfinite_v) {
        __syncwarp(); /* after the lanes' writes above */
        redo_warp_rows<T, D>(q, k_head, v_head, stride, combine, rows, row0, group, Sq, L, causal,
                             tile_at, tile_count, scale_log2, q_row); /* never with a new token: Sq = 1 */
    }
    __syncthreads();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (CLUSTER) cg::this_cluster().barrier_wait(); /* every block may receive pushes */
#endif
    write_block_outputs<T, D, CLUSTER>(combine, sm, rows, split, splits, out_row, out, partial_out,
                                       partial_ml);
    BN_TIMELINE(TimelineRecord *record = CLUSTER ? timeline.store(out) : nullptr;)
    if constexpr (CLUSTER) finish_owned(sm.inbox, split, splits, rows, out_row, out BN_TIMELINE(, record));
}

/* One block per output row: w_s = 2^(m_s - max m), out = sum_s w_s acc_s / sum_s w_s l_s. Each warp
 * takes every 8th split, loading 8 splits' partials before using them so their latencies overlap. */
constexpr int kMergeWarps = 8, kMergeBatch = 8;

template <typename T, int D, bool NEW_TOKEN>
__global__ void __launch_bounds__(kMergeWarps * 32)
merge_kernel(const float *__restrict__ partial_out, const float *__restrict__ partial_ml,
             const int32_t *__restrict__ seq_lens, int C, int Sq, int Hq, int causal, int num_splits,
             T *__restrict__ out, const int32_t *__restrict__ positions) {
    constexpr int kDimsPerLane = D / 32;
    __shared__ float weight[BN_ATTENTION_MAX_SPLITS];
    __shared__ float reduce[kMergeWarps][D];
    __shared__ float warp_result[kMergeWarps];
    const int64_t row = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int b = (int)(row / ((int64_t)Sq * Hq));
    /* Before the wait: the decode kernel before this one read seq_lens (or positions) after its own
     * wait, so whatever wrote them has finished. */
    const int L = sequence_keys<NEW_TOKEN>(seq_lens, positions, b, C);
    bn_pdl_wait();
    if (!valid_seq_len(L, C, Sq, causal)) {
        for (int d = threadIdx.x; d < D; d += blockDim.x)
            out[row * D + d] = from_float<T>(__int_as_float(0x7fc00000));
        return;
    }
    const float *ml = partial_ml + 2 * row * num_splits;
    float m_max = -INFINITY;
    for (int s = threadIdx.x; s < num_splits; s += blockDim.x) m_max = fmaxf(m_max, ml[2 * s]);
    m_max = warp_max(m_max);
    if (lane == 0) warp_result[warp] = m_max;
    __syncthreads();
    m_max = warp_result[0];
    for (int w = 1; w < kMergeWarps; w++) m_max = fmaxf(m_max, warp_result[w]);
    float l = 0.0f;
    for (int s = threadIdx.x; s < num_splits; s += blockDim.x) {
        float w = exp2_weight(ml[2 * s] - m_max);
        weight[s] = w;
        l += w * ml[2 * s + 1];
    }
    l = warp_sum(l);
    __syncthreads(); /* everyone has read warp_result and written weight */
    if (lane == 0) warp_result[warp] = l;

    float acc[kDimsPerLane] = {};
    const float *part = partial_out + row * num_splits * D + lane * kDimsPerLane;
    for (int s0 = warp; s0 < num_splits; s0 += kMergeWarps * kMergeBatch) {
        float loaded[kMergeBatch][kDimsPerLane];
#pragma unroll
        for (int i = 0; i < kMergeBatch; i++) {
            int s = s0 + i * kMergeWarps;
#pragma unroll
            for (int d = 0; d < kDimsPerLane; d++) loaded[i][d] = s < num_splits ? part[(int64_t)s * D + d] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < kMergeBatch; i++) {
            int s = s0 + i * kMergeWarps;
            float w = s < num_splits ? weight[s] : 0.0f;
#pragma unroll
            for (int d = 0; d < kDimsPerLane; d++) acc[d] += w * loaded[i][d];
        }
    }
#pragma unroll
    for (int d = 0; d < kDimsPerLane; d++) reduce[warp][lane * kDimsPerLane + d] = acc[d];
    __syncthreads();
    l = 0.0f;
    for (int w = 0; w < kMergeWarps; w++) l += warp_result[w];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < kMergeWarps; w++) sum += reduce[w][d];
        out[row * D + d] = from_float<T>(sum / l);
    }
}

/* A cluster kernel, for one stage count, and its shared memory (every instance for T has the type
 * of this one). */
template <typename T>
struct ClusterKernel {
    decltype(&decode_kernel<T, 64, true, 4, false>) kernel;
    size_t shared_bytes;
};

/* The cluster kernel with STAGES tile stages, and how many clusters of `size` blocks fit at once
 * (which also sets its attributes; older GPUs would refuse them: its shared memory is over sm_86's
 * limit). */
template <typename T, int D, bool NEW_TOKEN, int STAGES>
bitnet_status cluster_fit(int32_t device, int size, ClusterKernel<T> *cluster, int *fit) {
    *cluster = {decode_kernel<T, D, true, STAGES, NEW_TOKEN>, sizeof(DecodeShared<D, true, STAGES, NEW_TOKEN>)};
    return bn_cuda_cluster_occupancy(device, reinterpret_cast<const void *>(cluster->kernel), size, kThreads,
                                     cluster->shared_bytes, fit);
}

template <typename T, int D, bool NEW_TOKEN>
bitnet_status cluster_fit(int32_t device, int size, int stages, ClusterKernel<T> *cluster, int *fit) {
    return stages == kSplitStages ? cluster_fit<T, D, NEW_TOKEN, kSplitStages>(device, size, cluster, fit)
         : stages == 4 ? cluster_fit<T, D, NEW_TOKEN, 4>(device, size, cluster, fit)
         : stages == 5 ? cluster_fit<T, D, NEW_TOKEN, 5>(device, size, cluster, fit)
                       : cluster_fit<T, D, NEW_TOKEN, 6>(device, size, cluster, fit);
}

/* The largest cluster size from `want` down to kMinClusterSplits whose splits have at most
 * kMaxClusterTilesPerSplit tiles and whose clusters of the `stages`-stage kernel fit all `groups` at
 * once, with that kernel; 0 splits where none does. */
template <typename T, int D, bool NEW_TOKEN>
bitnet_status largest_cluster(int32_t device, int64_t groups, int64_t tiles, int64_t want, int stages, int *splits,
                              ClusterKernel<T> *cluster) {
    *splits = 0;
    want = want < tiles ? want : tiles;
    want = want < kMaxClusterSplits ? want : kMaxClusterSplits;
    for (int size = (int)want; size >= kMinClusterSplits; size--) {
        if ((tiles + size - 1) / size > kMaxClusterTilesPerSplit) break;
        int fit = 0;
        BN_TRY((cluster_fit<T, D, NEW_TOKEN>(device, size, stages, cluster, &fit)));
        if (fit >= groups) {
            *splits = size;
            break;
        }
    }
    return BITNET_OK;
}

/* Splits per (sequence, KV head, row block) on the cluster path and its kernel, or 0 splits where
 * it does not apply. It needs sm_90 and kMinClusterSplits to kMaxClusterSplits splits per group of
 * at most kMaxClusterTilesPerSplit tiles, with room for all the groups' clusters at once: one block
 * per SM (5 stages, then the stages that the split's tiles take where those fit too), or with too
 * many groups for that, two blocks per SM of kSplitStages stages. Those shared SMs made the 2B4T
 * decode step at batch 8 1.223 -> 1.182 ms at context 1024 and 1.712 -> 1.637 at 4096, and with
 * RoPE and attention as two ops 1.278 -> 1.226 and 1.763 -> 1.690 (H200), though calls of the op
 * alone back to back took longer (B = 8, L = 4096: 23.2 -> 27.3 us; the next call's clusters wait
 * for this one's SMs): docs/log/2026-12-03.md#2026-12-03-6. */
template <typename T, int D, bool NEW_TOKEN>
bitnet_status cluster_splits(int32_t device, int64_t groups, int64_t C, int *splits,
                             ClusterKernel<T> *cluster) {
    *splits = 0;
    int major = 0, sms = 0;
    BN_CUDA_TRY(bn_current_cc_major(&major));
    if (major < 9) return BITNET_OK;
    BN_TRY(bn_cuda_sm_count(device, &sms));
    const int64_t tiles = (C + kTileKeys - 1) / kTileKeys;
    BN_TRY((largest_cluster<T, D, NEW_TOKEN>(device, groups, tiles, sms / groups, 5, splits, cluster)));
    if (*splits > 0) {
        const int stages = cluster_stages((tiles + *splits - 1) / *splits);
        if (stages != 5) {
            ClusterKernel<T> staged;
            int fit = 0;
            BN_TRY((cluster_fit<T, D, NEW_TOKEN>(device, *splits, stages, &staged, &fit)));
            if (fit >= groups) *cluster = staged;
        }
        return BITNET_OK;
    }
    return largest_cluster<T, D, NEW_TOKEN>(device, groups, tiles, kSharedClusterBlocksPerSm * sms / groups,
                                            kSplitStages, splits, cluster);
}

template <typename T, int D, bool NEW_TOKEN>
bitnet_status launch_decode(int32_t device, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv,
                            const void *q, const void *k, const void *v, int64_t C,
                            const int32_t *seq_lens, const int32_t *positions, float theta,
                            int32_t causal, float scale, void *out, void *workspace, int64_t num_splits,
                            cudaStream_t stream) {
    const int64_t row_blocks = (Sq * (Hq / Hkv) + kRows - 1) / kRows;
    if (Hkv * row_blocks > 65535 || B > 65535 || B * Sq * Hq > INT32_MAX)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "bitnet_attention: B = %lld or Hkv = %lld too large "
                       "for the decode grid", (long long)B, (long long)Hkv);
    static_assert(sizeof(DecodeCombine<D>) <= sizeof(DecodeShared<D, false, kSplitStages, false>::k) +
                                                sizeof(DecodeShared<D, false, kSplitStages, false>::v),
                  "the warps' combine must fit over the tiles");
    const float scale_log2 = scale * 1.4426950408889634f;
    const SmallDivisor kv_heads = SmallDivisor::of((uint32_t)Hkv), group = SmallDivisor::of((uint32_t)(Hq / Hkv));
    dim3 grid(1, (unsigned)(Hkv * row_blocks), (unsigned)B);
    /* For a new token, k and v are the caches it goes to (writable: see the entry point). */
    const NewToken<T> token{positions, NEW_TOKEN ? static_cast<T *>(const_cast<void *>(k)) : nullptr,
                            NEW_TOKEN ? static_cast<T *>(const_cast<void *>(v)) : nullptr,
                            NEW_TOKEN ? log2((double)theta) : 0.0};

    /* Where the splits fit in clusters, they merge there: no workspace, no merge kernel. */
    int splits = 0;
    ClusterKernel<T> cluster{};
    if constexpr (D <= 128) /* at D = 256, 4 tile stages are over an SM's shared memory */
        BN_TRY((cluster_splits<T, D, NEW_TOKEN>(device, B * Hkv * row_blocks, C, &splits, &cluster)));
    if (splits > 0) {
        grid.x = (unsigned)splits;
        BN_CUDA_TRY(bn_launch_pdl_cluster(cluster.kernel, grid, dim3(kThreads), cluster.shared_bytes,
                                          (unsigned)splits, stream,
                                          seq_lens, static_cast<const T *>(k), static_cast<const T *>(v),
                                          (int)C, SmallDivisor::of((uint32_t)splits), kv_heads,
                                          static_cast<const T *>(q), group, (int)Sq, (int)Hq, causal,
                                          scale_log2, static_cast<T *>(out),
                                          (float *)nullptr, (float *)nullptr, token));
        return BITNET_OK;
    }

    auto kernel = decode_kernel<T, D, false, kSplitStages, NEW_TOKEN>;
    const size_t smem = sizeof(DecodeShared<D, false, kSplitStages, NEW_TOKEN>);
    BN_TRY(bn_cuda_kernel_shared_memory(device, reinterpret_cast<const void *>(kernel), smem));
    const int64_t rows = B * Sq * Hq;
    float *partial_out = static_cast<float *>(workspace);
    float *partial_ml = partial_out ? partial_out + rows * num_splits * D : nullptr;
    grid.x = (unsigned)num_splits;
    BN_CUDA_TRY(bn_launch_pdl(kernel, grid, dim3(kThreads), smem, stream, seq_lens,
                              static_cast<const T *>(k), static_cast<const T *>(v), (int)C,
                              SmallDivisor::of((uint32_t)num_splits), kv_heads, static_cast<const T *>(q),
                              group, (int)Sq, (int)Hq, causal, scale_log2, static_cast<T *>(out), partial_out,
                              partial_ml, token));
    if (num_splits > 1) {
        /* The merge grid is set up while the decode grid drains. */
        BN_CUDA_TRY(bn_launch_pdl(merge_kernel<T, D, NEW_TOKEN>, dim3((unsigned)rows), dim3(kMergeWarps * 32),
                                  0, stream, (const float *)partial_out, (const float *)partial_ml,
                                  seq_lens, (int)C, (int)Sq, (int)Hq, (int)causal, (int)num_splits,
                                  static_cast<T *>(out), positions));
    }
    return BITNET_OK;
}

/* launch_decode for a dtype and D (64, 128 or 256). */
template <bool NEW_TOKEN> auto launch_for(int32_t dtype, int64_t D) {
    const bool bf16 = dtype == BITNET_DTYPE_BF16;
    return D == 64    ? (bf16 ? launch_decode<__nv_bfloat16, 64, NEW_TOKEN> : launch_decode<__half, 64, NEW_TOKEN>)
           : D == 128 ? (bf16 ? launch_decode<__nv_bfloat16, 128, NEW_TOKEN> : launch_decode<__half, 128, NEW_TOKEN>)
                      : (bf16 ? launch_decode<__nv_bfloat16, 256, NEW_TOKEN> : launch_decode<__half, 256, NEW_TOKEN>);
}

} // namespace

bitnet_status bn_cuda_attention_decode(int32_t device, int32_t dtype, int64_t B, int64_t Sq, int64_t Hq,
                                       int64_t Hkv, int64_t D, const void *q, const void *k, const void *v,
                                       int64_t C, const int32_t *seq_lens, const int32_t *positions,
                                       float theta, int32_t causal, float scale, void *out, void *workspace,
                                       int64_t num_splits, cudaStream_t stream) {
    auto launch = positions ? launch_for<true>(dtype, D) : launch_for<false>(dtype, D);
    return launch(device, B, Sq, Hq, Hkv, q, k, v, C, seq_lens, positions, theta, causal, scale, out,
                  workspace, num_splits, stream);
}
