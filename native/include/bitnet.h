/* bitnet.h: the C ABI of libbitnet, BitNet b1.58 inference kernels for NVIDIA GPUs and the CPU.
 *
 * Conventions, for every entry point:
 * - It returns a bitnet_status. On anything but BITNET_OK, bitnet_get_last_error() gives a message
 *   for the calling thread, and outputs are left untouched whenever the arguments were rejected.
 * - The library never prints, exits or aborts.
 * - Sizes and counts are int64_t. Arrays are dense and row-major; shapes are given in comments.
 * - `device` picks the backend: BITNET_DEVICE_CPU (-1) for host memory, N >= 0 for CUDA device N,
 *   whose memory every array pointer must then point into.
 * - An array an op writes may not overlap any other array of the same call (INVALID_ARGUMENT),
 *   except where the op says it works in place: bitnet_rmsnorm's y == x, bitnet_add_int32's x.
 *   A kernel that wrote memory it still reads would be wrong.
 * - `stream` is a cudaStream_t (NULL: the legacy default stream); the CPU backend ignores it.
 *   GPU ops are asynchronous with respect to the host, like any kernel launch.
 *
 * The declarations between the CDEF markers are plain C that the Python package reads with cffi:
 * keep preprocessor lines out of that region.
 */
#ifndef BITNET_H
#define BITNET_H

#include <stddef.h>
#include <stdint.h>

/* The version of this header; bitnet_get_version gives the loaded library's (the same for a
 * matching pair). The Python package and pyproject.toml carry the same number. */
#define BITNET_VERSION_MAJOR 0
#define BITNET_VERSION_MINOR 1
#define BITNET_VERSION_PATCH 0

#ifdef __cplusplus
extern "C" {
#endif

/* BITNET_CDEF_BEGIN */

typedef enum {
    BITNET_OK = 0,
    BITNET_ERR_INVALID_ARGUMENT = 1, /* a NULL, misaligned or wrong-device pointer, a bad size or value */
    BITNET_ERR_UNSUPPORTED = 2,      /* valid, but not implemented for this shape, dtype or backend */
    BITNET_ERR_NO_DEVICE = 3,        /* no such CUDA device, or a CPU-only build */
    BITNET_ERR_OUT_OF_MEMORY = 4,
    BITNET_ERR_CUDA = 5,             /* the CUDA runtime or driver failed */
    BITNET_ERR_INTERNAL = 6
} bitnet_status;

typedef enum {
    BITNET_DTYPE_F32 = 0,
    BITNET_DTYPE_F16 = 1,
    BITNET_DTYPE_BF16 = 2,
    BITNET_DTYPE_I8 = 3,
    BITNET_DTYPE_I32 = 4,
    BITNET_DTYPE_U8 = 5
} bitnet_dtype;

enum { BITNET_DEVICE_CPU = -1 };

typedef enum {
    BITNET_COPY_HOST_TO_DEVICE = 0,
    BITNET_COPY_DEVICE_TO_HOST = 1,
    BITNET_COPY_DEVICE_TO_DEVICE = 2
} bitnet_copy_kind;

typedef struct {
    char name[256];
    char pci_bus_id[32];                         /* "0000:3b:00.0", as nvidia-smi shows it */
    int32_t index;
    int32_t compute_capability_major;
    int32_t compute_capability_minor;
    int64_t total_memory_bytes;
    int64_t free_memory_bytes;
    int32_t sm_count;
    int32_t max_threads_per_block;
    int64_t shared_memory_per_block_bytes;       /* without opting in */
    int64_t shared_memory_per_block_optin_bytes; /* the most a kernel can opt in to */
    int64_t l2_cache_bytes;
    int32_t memory_bus_width_bits;
    int32_t memory_clock_khz;
    double peak_bandwidth_gbps;                  /* 2 * clock * bus width: the datasheet figure */
    int32_t supports_fp16;
    int32_t supports_bf16;
    int32_t supports_int8_dot;                   /* dp4a */
    int32_t driver_version;                      /* e.g. 13000 for CUDA 13.0 */
    int32_t runtime_version;
} bitnet_device_info;

/* The thread's last error message ("" if none); valid until the thread's next failing call. */
bitnet_status bitnet_get_last_error(const char **message);

bitnet_status bitnet_get_version(int32_t *major, int32_t *minor, int32_t *patch);

/* 1 if this build has the CUDA backend, else 0. */
bitnet_status bitnet_has_cuda(int32_t *has_cuda);

/* Number of usable CUDA devices. No GPU, no driver or a CPU-only build give 0 with BITNET_OK, and
 * *reason (if reason is not NULL) says why; *reason is "" when count > 0. */
bitnet_status bitnet_device_count(int32_t *count, const char **reason);

bitnet_status bitnet_device_get_info(int32_t device, bitnet_device_info *info);

/* The CUDA device that ptr points into, or BITNET_DEVICE_CPU for host memory. */
bitnet_status bitnet_pointer_device(const void *ptr, int32_t *device);

/* Device memory. Allocations are aligned to at least 256 bytes. nbytes = 0 gives *ptr = NULL. */
bitnet_status bitnet_malloc(int32_t device, int64_t nbytes, void **ptr);
bitnet_status bitnet_free(int32_t device, void *ptr);

/* Copies on `stream`. Copies that touch host memory return once the host buffer may be reused
 * (they synchronize the stream); device-to-device copies are asynchronous. */
bitnet_status bitnet_memcpy(void *dst, const void *src, int64_t nbytes, bitnet_copy_kind kind,
                            void *stream);
bitnet_status bitnet_memset(void *ptr, int32_t byte_value, int64_t nbytes, void *stream);

bitnet_status bitnet_device_synchronize(int32_t device);
bitnet_status bitnet_stream_synchronize(void *stream);

/* ---- W2A8 GEMV and ternary / int8 quantization (docs/weight_format.md) ---- */

/* Ternary weights, packed: uint8 [M, K/4], 2 bits per weight (docs/weight_format.md); K % 128 == 0.
 * quantize_i2s: scale = mean |W| over the tensor, or over each row segment (row_segments: a host
 * array of n_segments row counts summing to M, or NULL for one segment), computed in float64,
 * stored as float32, floored at 1e-5; W_q = clamp(rint(w / scale), -1, 1) in float32 arithmetic.
 * w_scales[m] is the scale of row m's segment. On a GPU, w_packed serves as scratch for row sums.
 * w must be finite: a NaN or +-inf is BITNET_ERR_INVALID_ARGUMENT naming the first one (row, column)
 * and nothing is written; on a GPU the host waits for that check (not capturable in a graph). */
bitnet_status bitnet_quantize_i2s(int32_t device, const void *w /* [M, K] */, int32_t w_dtype,
                                  int64_t M, int64_t K, const int64_t *row_segments,
                                  int64_t n_segments, uint8_t *w_packed /* [M, K/4] */,
                                  float *w_scales /* [M] */, void *stream);

/* Packs int8 values in {-1, 0, 1}; any other value is an error and w_packed is left untouched
 * (on a GPU this waits for the stream, so it cannot be captured in a CUDA graph). */
bitnet_status bitnet_pack_ternary(int32_t device, const int8_t *w_q /* [M, K] */, int64_t M,
                                  int64_t K, uint8_t *w_packed /* [M, K/4] */, void *stream);

/* w_q = code - 1 for every 2-bit code. */
bitnet_status bitnet_unpack_ternary(int32_t device, const uint8_t *w_packed /* [M, K/4] */,
                                    int64_t M, int64_t K, int8_t *w_q /* [M, K] */, void *stream);

/* Per row n: s = 127 / max(max |x[n]|, 1e-5), x_q = clamp(rint(x * s), -128, 127), in float32.
 * A row holding a NaN or +-inf gets s = NaN and x_q = -128 throughout: its GEMV outputs are NaN. */
bitnet_status bitnet_quantize_a8(int32_t device, const void *x /* [N, K] */, int32_t x_dtype,
                                 int64_t N, int64_t K, int8_t *x_q /* [N, K] */,
                                 float *x_scales /* [N] */, void *stream);

/* y[n, m] = dot(x_q[n], W_q[m]) * w_scales[m] / x_scales[n] in float32, then rounded to y_dtype
 * (F32, F16, BF16); y_dtype I32 gives the exact integer dot. K % 128 == 0, K <= 2^22. w_packed
 * and x_q aligned to 16 bytes. On a GPU the launch uses programmatic dependent launch: the weight
 * loads may start before the previous kernel on the stream has finished (x is read after it). */
bitnet_status bitnet_gemv_w2a8(int32_t device, const uint8_t *w_packed /* [M, K/4] */,
                               const float *w_scales /* [M] */, int64_t M, int64_t K,
                               const int8_t *x_q /* [N, K] */, const float *x_scales /* [N] */,
                               int64_t N, void *y /* [N, M] */, int32_t y_dtype, void *stream);

/* gemv_w2a8 with a float32 scale per 256-weight block as well (llama.cpp's TQ1_0 and TQ2_0 keep
 * one per block): y[n, m] = (sum over b of block_scales[m, b] * dot_b) * w_scales[m] / x_scales[n],
 * dot_b the exact int32 dot of x_q[n] and W_q[m] over weights 256b .. 256b + 255. Each product is
 * rounded to float32 and summed in float32 in an order of the backend's choosing: the float32
 * value is within (K/256 + 3) * 2^-24 * sum_b |block_scales[m, b] * dot_b * w_scales[m] /
 * x_scales[n]| of the exact one, then rounded to y_dtype (F32, F16 or BF16). K % 256 == 0
 * (else BITNET_ERR_UNSUPPORTED), K <= 2^22; w_packed and x_q aligned to 16 bytes. On a GPU the
 * launch uses programmatic dependent launch; it waits for the previous kernel before any read. */
bitnet_status bitnet_gemv_w2a8_block_scaled(int32_t device,
                                            const uint8_t *w_packed /* [M, K/4] */,
                                            const float *w_scales /* [M] */,
                                            const float *block_scales /* [M, K/256] */,
                                            int64_t M, int64_t K,
                                            const int8_t *x_q /* [N, K] */,
                                            const float *x_scales /* [N] */, int64_t N,
                                            void *y /* [N, M] */, int32_t y_dtype, void *stream);

/* The CPU SIMD path of the ternary ops and attention: 0 auto (the best this CPU runs), 1 portable
 * C, 2 AVX2, 3 AVX-512 VNNI (attention takes its AVX2 code there). Choosing a path this CPU cannot
 * run is BITNET_ERR_UNSUPPORTED. Process-wide. */
bitnet_status bitnet_cpu_set_isa(int32_t isa);
/* The path in use (1, 2 or 3; never 0). */
bitnet_status bitnet_cpu_get_isa(int32_t *isa);

/* ---- RMSNorm and its fused variants ---- */

/* RMSNorm over the last dimension, accumulated in float32 (docs/rmsnorm.md), for each row t:
 *   v = x[t], or with residual: residual[t] += x[t] (stored in dtype) and v = that stored value;
 *   y[t] = v / sqrt(mean(v^2) + eps) * weight;
 *   with y_q: y_scales[t] = 127 / max(max |y[t]|, 1e-5), y_q[t] = clamp(rint(y[t] * y_scales[t]),
 *   -128, 127), from the float32 y before any rounding to dtype (quantize_a8's rule, fused);
 *   a row with a y that is not finite gets y_scales[t] = NaN and y_q[t] = -128 throughout.
 * dtype: float32, float16 or bfloat16, for x, residual, weight and y. eps: finite, >= 0. Give y,
 * y_q (with y_scales) or both. y may be x (in place); no other arrays may overlap. Rows whose
 * float32 sum of squares overflows or underflows are summed again in float64. On a GPU the launch
 * uses programmatic dependent launch: it waits for the previous kernel on the stream before reading
 * or writing any array, and lets the next kernel launch early. */
bitnet_status bitnet_rmsnorm(int32_t device, int32_t dtype, int64_t T, int64_t H,
                             const void *x /* [T, H] */,
                             void *residual /* [T, H] in/out, or NULL */,
                             const void *weight /* [H] */, float eps,
                             void *y /* [T, H] or NULL */, int8_t *y_q /* [T, H] or NULL */,
                             float *y_scales /* [T], with y_q */, void *stream);

/* The activation of a gated linear unit's gate: out = act(gate) * up. */
typedef enum {
    BITNET_ACTIVATION_RELU2 = 0, /* max(g, 0)^2 (BitNet b1.58 2B4T) */
    BITNET_ACTIVATION_SILU = 1   /* g / (1 + e^-g) (Llama-architecture models: SwiGLU) */
} bitnet_activation;

/* The gate of a GLU fused into the RMSNorm after it (docs/rmsnorm.md), reading gate_up once: for
 * each row t, v[f] = act(gate_up[t, f]) * gate_up[t, F + f] in float32 (activation: a
 * bitnet_activation), rounded to dtype exactly as bitnet_glu_gate stores it, then bitnet_rmsnorm
 * without residual on v: y and/or y_q with y_scales, bit-identical to bitnet_glu_gate followed by
 * bitnet_rmsnorm on one device. weight NULL: no norm, y = v and y_q, y_scales = quantize_a8's rule
 * on v (bit-identical to bitnet_glu_gate then bitnet_quantize_a8 on one device; eps unused but
 * checked; y_q required: y alone is bitnet_glu_gate). dtype: float32, float16 or bfloat16 for gate_up, weight and y (float32 on the GPU too).
 * eps: finite, >= 0. Give y, y_q (with y_scales) or both; no arrays may overlap. Programmatic
 * dependent launch on a GPU, as bitnet_rmsnorm. */
bitnet_status bitnet_glu_rmsnorm(int32_t device, int32_t dtype, int64_t T, int64_t F,
                                 int32_t activation, const void *gate_up /* [T, 2F] */,
                                 const void *weight /* [F] or NULL */, float eps,
                                 void *y /* [T, F] or NULL */, int8_t *y_q /* [T, F] or NULL */,
                                 float *y_scales /* [T], with y_q */, void *stream);

/* bitnet_glu_rmsnorm with BITNET_ACTIVATION_RELU2 and a weight (not NULL here). */
bitnet_status bitnet_relu2_rmsnorm(int32_t device, int32_t dtype, int64_t T, int64_t F,
                                   const void *gate_up /* [T, 2F] */,
                                   const void *weight /* [F] */, float eps,
                                   void *y /* [T, F] or NULL */, int8_t *y_q /* [T, F] or NULL */,
                                   float *y_scales /* [T], with y_q */, void *stream);

/* One rank's half of an RMSNorm whose rows are split across ranks (tensor parallelism: this rank
 * holds H of a row's H_total columns), fused with the int8 quantization, for a row-parallel
 * projection after it (docs/tensor_parallel.md). For each row t, v = x[t] and p = v * weight in
 * float32, not divided by the RMS:
 *   y_scales[t] = 127 / max(max |p|, 1e-5), y_q[t] = clamp(rint(p * y_scales[t]), -128, 127),
 *   sumsq[t] = sum of v^2 (float32);
 * a row with a p that is not finite gets y_scales[t] = NaN and y_q[t] = -128 throughout. The sum
 * over ranks of a projection of the codes, divided by sqrt(sum over ranks of sumsq / H_total +
 * eps), is the projection of the whole row's RMSNorm (bitnet_peer_allreduce_rms does both sums
 * and the division). The codes are those of bitnet_rmsnorm's y_q on this slice alone, up to the
 * float32 rounding of the factor 1 / RMS that this op leaves out. dtype: float32, float16 or
 * bfloat16 for x and weight. No arrays may overlap. Programmatic dependent launch on a GPU. */
bitnet_status bitnet_rmsnorm_partial(int32_t device, int32_t dtype, int64_t T, int64_t H,
                                     const void *x /* [T, H] */, const void *weight /* [H] */,
                                     int8_t *y_q /* [T, H] */, float *y_scales /* [T] */,
                                     float *sumsq /* [T] */, void *stream);

/* bitnet_rmsnorm_partial of v = the GLU gate of gate_up (as bitnet_glu_rmsnorm computes it, rounded
 * to dtype): the slice of the FFN's gated activations before a row-parallel down projection. */
bitnet_status bitnet_glu_rmsnorm_partial(int32_t device, int32_t dtype, int64_t T, int64_t F,
                                         int32_t activation, const void *gate_up /* [T, 2F] */,
                                         const void *weight /* [F] */, int8_t *y_q /* [T, F] */,
                                         float *y_scales /* [T] */, float *sumsq /* [T] */,
                                         void *stream);

/* ---- Attention and the glue of a BitNet layer ---- */

/* Grouped-query attention with an online softmax accumulated in float32 (docs/attention.md):
 *   out[b,i,h,:] = sum_j softmax_j(q[b,i,h,:] . k[b,j,h/G,:] * scale + mask[i,j]) v[b,j,h/G,:]
 * with G = Hq / Hkv query heads per KV head and keys j < L = seq_lens[b] (all C when seq_lens is
 * NULL). The Sq queries are the last Sq positions of their sequence: with causal = 1, query i sees
 * keys 0 .. L - Sq + i (FlashAttention's kv-cache convention; Sq = L = C is causal prefill). A key
 * that a query does not see never reaches its output, even where k or v hold inf or NaN there.
 * dtype: float16 or bfloat16 (float32 too on the CPU), the same for q, k, v and out. D: 64, 128
 * or 256.
 * scale: 0 means 1 / sqrt(D). seq_lens: int32 in the op's memory; each must lie in [Sq, C] (causal)
 * or [1, C]. On the CPU they are checked; on a GPU they are not read by the host: a sequence whose
 * device-resident length is out of range gets NaN outputs and no memory outside the arrays is read.
 * workspace: float32 split-KV partials of bitnet_attention_workspace_size bytes (NULL when that is
 * 0); the op allocates nothing, so it can be captured in a CUDA graph. */
bitnet_status bitnet_attention(int32_t device, int32_t dtype, int64_t B, int64_t Sq, int64_t Hq,
                               int64_t Hkv, int64_t D,
                               const void *q /* [B, Sq, Hq, D] */,
                               const void *k /* [B, C, Hkv, D] */,
                               const void *v /* [B, C, Hkv, D] */, int64_t C,
                               const int32_t *seq_lens /* [B] or NULL */, int32_t causal,
                               float scale, void *out /* [B, Sq, Hq, D] */,
                               void *workspace /* [workspace_bytes] or NULL */,
                               int64_t workspace_bytes, void *stream);

/* The workspace bitnet_attention needs for these sizes on `device` (0 on the CPU). */
bitnet_status bitnet_attention_workspace_size(int32_t device, int64_t B, int64_t Sq, int64_t Hq,
                                              int64_t Hkv, int64_t D, int64_t C, int64_t *bytes);

/* RoPE (rotate-half convention) on the output of a fused QKV projection, with the KV-cache append.
 * qkv holds each token's Hq query heads, then Hkv key heads, then Hkv value heads. For token s of
 * sequence b at position p = positions[b] + s, each q and k head's pairs (x[i], x[i + D/2]),
 * i < D/2, rotate by the angle p * theta^(-2i/D):
 *   x'[i] = x[i] cos - x[i + D/2] sin,   x'[i + D/2] = x[i + D/2] cos + x[i] sin
 * Then q[b, s] = rotated q heads, k_cache[b, p, :, :] = rotated k heads and v_cache[b, p, :, :] =
 * the v heads. Angles, cos and sin in float64, the rotation in float32 (both backends).
 * positions: int32 [B] in the op's memory, p + S <= C (checked on the CPU; on a GPU a sequence out
 * of range is skipped, its q and cache rows left as they were). */
bitnet_status bitnet_rope_append_kv(int32_t device, int32_t dtype, int64_t B, int64_t S, int64_t Hq,
                                    int64_t Hkv, int64_t D,
                                    const void *qkv /* [B, S, Hq + 2 Hkv, D] */,
                                    void *q /* [B, S, Hq, D] */,
                                    void *k_cache /* [B, C, Hkv, D] */,
                                    void *v_cache /* [B, C, Hkv, D] */, int64_t C,
                                    const int32_t *positions /* [B] */, float theta, void *stream);

/* Attention of a decode step (one new token per sequence) with RoPE and the KV-cache append: the
 * values of bitnet_rope_append_kv(qkv, k_cache, v_cache, positions, theta) with S = 1, then
 * bitnet_attention(its q, k_cache, v_cache, seq_lens = positions + 1, causal = 1, scale, out); the
 * rotated q is not stored. The sizes, dtypes and scale of bitnet_attention apply with Sq = 1, and
 * its workspace (bitnet_attention_workspace_size with Sq = 1); theta as bitnet_rope_append_kv.
 * positions: int32 [B] in the op's memory, 0 <= positions[b] < C (checked on the CPU; on a GPU a
 * sequence out of range gets NaN outputs and its cache rows are left as they were). On a GPU one
 * kernel (at most 64 query heads per KV head): the decode attention kernel rotates each block's q
 * rows as it loads them, and the block whose keys hold p places the new k and v rows among them
 * and writes them to the cache. */
bitnet_status bitnet_attention_rope_append_kv(int32_t device, int32_t dtype, int64_t B, int64_t Hq,
                                              int64_t Hkv, int64_t D,
                                              const void *qkv /* [B, 1, Hq + 2 Hkv, D] */,
                                              void *k_cache /* [B, C, Hkv, D] */,
                                              void *v_cache /* [B, C, Hkv, D] */, int64_t C,
                                              const int32_t *positions /* [B] */, float theta,
                                              float scale, void *out /* [B, 1, Hq, D] */,
                                              void *workspace /* [workspace_bytes] or NULL */,
                                              int64_t workspace_bytes, void *stream);

/* The fused QKV projection of one token with RoPE and the KV-cache append (a decode step of one
 * sequence): the same values as bitnet_gemv_w2a8 of the M = (Hq + 2 Hkv) D rows into a qkv row
 * of `dtype` (y_dtype = dtype, a dtype of bitnet_rope_append_kv), then bitnet_rope_append_kv of
 * it with B = S = 1; qkv itself is not written. The sizes and alignments of both ops apply, and
 * D % 4 == 0. position: int32 [1] in the op's memory, 0 <= *position < C (checked on the CPU; on
 * a GPU a position out of range writes nothing). On a GPU one kernel: the GEMV takes the rows of
 * each pair (i, i + D/2) in one warp and rotates them as it stores them (programmatic dependent
 * launch, as bitnet_gemv_w2a8). */
bitnet_status bitnet_gemv_w2a8_rope_append_kv(int32_t device, int32_t dtype,
                                              const uint8_t *w_packed /* [M, K/4] */,
                                              const float *w_scales /* [M] */, int64_t K,
                                              const int8_t *x_q /* [K] */,
                                              const float *x_scale /* [1] */, int64_t Hq,
                                              int64_t Hkv, int64_t D, void *q /* [Hq, D] */,
                                              void *k_cache /* [C, Hkv, D] */,
                                              void *v_cache /* [C, Hkv, D] */, int64_t C,
                                              const int32_t *position /* [1] */, float theta,
                                              void *stream);

/* ---- The input RMSNorm fused into the GEMVs around it (one token: a decode step of one sequence) ----
 * A projection whose output is added to the residual h (o, down) leaves the statistics of the next
 * RMSNorm of h in `stats`; the next projection (QKV, gate|up) then quantizes rmsnorm(h) itself from
 * them, so no norm op runs between the two (docs/rmsnorm.md, "The norm inside the GEMVs").
 * stats: float32 [slots, 2], per slot a partial sum of h^2 and max |h * norm_weight| (NaN if any
 * product is); `slots` from bitnet_norm_stats_slots for the device (1 on the CPU). */

/* The slots of a stats array that bitnet_gemv_w2a8_add_norm_stats fills on this device. */
bitnet_status bitnet_norm_stats_slots(int32_t device, int64_t *slots);

/* h[m] += y[m] for the M outputs y of bitnet_gemv_w2a8 of one token (y rounded to dtype, the sum
 * rounded to dtype: bitnet_rmsnorm's residual add, bit for bit), and the statistics of the new h
 * with norm_weight into stats (every slot written). dtype: float16 or bfloat16 (float32 too on the
 * CPU), for h and norm_weight. slots: at least bitnet_norm_stats_slots. The sizes and alignments of
 * bitnet_gemv_w2a8 apply; no arrays may overlap. Programmatic dependent launch on a GPU. */
bitnet_status bitnet_gemv_w2a8_add_norm_stats(int32_t device, int32_t dtype,
                                              const uint8_t *w_packed /* [M, K/4] */,
                                              const float *w_scales /* [M] */, int64_t M,
                                              int64_t K, const int8_t *x_q /* [K] */,
                                              const float *x_scale /* [1] */,
                                              void *h /* [M] in/out */,
                                              const void *norm_weight /* [M] */,
                                              float *stats /* [slots, 2] */, int64_t slots,
                                              void *stream);

/* bitnet_gemv_w2a8 of one token on x = the int8 codes of rmsnorm(h) * norm_weight (eps > 0): the
 * rules of bitnet_rmsnorm's y_q and y_scales, with the sum of squares and max |h * norm_weight|
 * taken from stats (the float32 sum over the slots; where the mean square it gives is not a normal
 * float, h's squares summed again in float64, as bitnet_rmsnorm does). The codes equal
 * bitnet_rmsnorm's wherever the two float32 sums of squares, added in different orders, give the
 * same 1 / RMS (else a code may move by one). dtype: float16 or bfloat16 (float32 too on the CPU)
 * for h and norm_weight; y_dtype as bitnet_gemv_w2a8's. h and norm_weight 16-byte aligned. On a
 * GPU, K <= 8192 and slots <= 512. No arrays may overlap. Programmatic dependent launch on a GPU. */
bitnet_status bitnet_rmsnorm_gemv_w2a8(int32_t device, int32_t dtype, const void *h /* [K] */,
                                       const void *norm_weight /* [K] */,
                                       const float *stats /* [slots, 2] */, int64_t slots,
                                       float eps, const uint8_t *w_packed /* [M, K/4] */,
                                       const float *w_scales /* [M] */, int64_t M, int64_t K,
                                       void *y /* [M] */, int32_t y_dtype, void *stream);

/* bitnet_gemv_w2a8_rope_append_kv on the codes of rmsnorm(h) * norm_weight, made as
 * bitnet_rmsnorm_gemv_w2a8 makes them; the limits of both apply. */
bitnet_status bitnet_rmsnorm_gemv_w2a8_rope_append_kv(int32_t device, int32_t dtype,
                                                      const void *h /* [K] */,
                                                      const void *norm_weight /* [K] */,
                                                      const float *stats /* [slots, 2] */,
                                                      int64_t slots, float eps,
                                                      const uint8_t *w_packed /* [M, K/4] */,
                                                      const float *w_scales /* [M] */, int64_t K,
                                                      int64_t Hq, int64_t Hkv, int64_t D,
                                                      void *q /* [Hq, D] */,
                                                      void *k_cache /* [C, Hkv, D] */,
                                                      void *v_cache /* [C, Hkv, D] */, int64_t C,
                                                      const int32_t *position /* [1] */,
                                                      float theta, void *stream);

/* Gate of a GLU on the fused gate|up projection: out[t, f] = act(gate_up[t, f]) * gate_up[t, F + f],
 * computed in float32; act (a bitnet_activation): relu2 max(g, 0)^2, or silu g / (1 + e^-g) with
 * expf (CPU and GPU may differ by an ulp of float32 before rounding to dtype). */
bitnet_status bitnet_glu_gate(int32_t device, int32_t dtype, int64_t T, int64_t F,
                              int32_t activation, const void *gate_up /* [T, 2F] */,
                              void *out /* [T, F] */, void *stream);

/* bitnet_glu_gate with BITNET_ACTIVATION_RELU2: out[t, f] = max(gate_up[t, f], 0)^2 *
 * gate_up[t, F + f]. */
bitnet_status bitnet_relu2_gate(int32_t device, int32_t dtype, int64_t T, int64_t F,
                                const void *gate_up /* [T, 2F] */, void *out /* [T, F] */,
                                void *stream);

/* ---- One BitNet layer of a one-token decode step, fused (docs/decode_layer.md) ---- */

/* Packed ternary weights of one projection: bitnet_pack_ternary's [M, K/4] bytes (16-byte
 * aligned) and a float32 scale per row. */
typedef struct {
    const uint8_t *w_packed;
    const float *w_scales;
} bitnet_ternary_weights;

/* A layer's shapes and constants: hidden size H, intermediate size I, Hq query and Hkv key/value
 * heads of dimension D; the GLU's activation (a bitnet_activation); the RMSNorm epsilons of the
 * input norms (eps) and of the sub-norms; RoPE's theta; the attention's scale (0: 1 / sqrt(D)). */
typedef struct {
    int64_t H, I, Hq, Hkv, D;
    int32_t activation;
    float eps, attn_sub_eps, ffn_sub_eps, theta, attention_scale;
} bitnet_decode_layer_config;

/* The weights of one layer. The norms' weights are in the call's dtype; a sub-norm's weight may be
 * NULL (a model without that sub-norm: its input is only quantized, bitnet_quantize_a8's rule). */
typedef struct {
    bitnet_ternary_weights qkv;     /* [Hq D + 2 Hkv D, H]: the q heads, then k, then v */
    bitnet_ternary_weights o;       /* [H, Hq D] */
    bitnet_ternary_weights gate_up; /* [2 I, H]: gate rows, then up rows */
    bitnet_ternary_weights down;    /* [H, I] */
    const void *attn_norm;          /* [H] */
    const void *attn_sub_norm;      /* [Hq D] or NULL */
    const void *ffn_norm;           /* [H] */
    const void *ffn_sub_norm;       /* [I] or NULL */
} bitnet_decode_layer_weights;

/* One layer for one new token of one sequence at position p = *position (device-resident on a
 * GPU), updating the residual stream h in place. The same values as this sequence of ops on
 * one device (the model runtime's unfused decode step), every intermediate rounded to dtype where
 * that sequence stores it:
 *   x_q, x_s = bitnet_rmsnorm(h, attn_norm, eps) -> int8
 *   qkv      = bitnet_gemv_w2a8(qkv, x_q, x_s) -> dtype
 *   q        = bitnet_rope_append_kv(qkv, k_cache, v_cache, positions = {p}, theta)
 *   a        = bitnet_attention(q, k_cache, v_cache, seq_lens = {p + 1}, causal, scale)
 *   h       += bitnet_gemv_w2a8(o, bitnet_rmsnorm(a, attn_sub_norm, attn_sub_eps) -> int8)
 *   x_q, x_s = bitnet_rmsnorm(h, ffn_norm, eps) -> int8
 *   g        = bitnet_glu_gate(bitnet_gemv_w2a8(gate_up, x_q, x_s) -> dtype, activation)
 *   h       += bitnet_gemv_w2a8(down, bitnet_rmsnorm(g, ffn_sub_norm, ffn_sub_eps) -> int8)
 * The integer dots are exact; the float results differ from that sequence only by the order of
 * float32 sums (the norms' sums of squares and the attention's softmax), which on a GPU is not the
 * unfused kernels' order: see docs/decode_layer.md for the bound. The KV cache row p is written.
 * dtype: float16 or bfloat16 (float32 too on the CPU). H, I and Hq D: multiples of 128, at most
 * 65536; D: 64, 128 or 256; Hq a multiple of Hkv; eps values finite and > 0; theta finite and > 1.
 * Packed weights and the workspace 16-byte aligned; on a GPU h, the norms' weights and the caches
 * too, and (Hq / Hkv) D at most 2048 (BITNET_ERR_UNSUPPORTED past it). No output (h, the caches,
 * the workspace) may overlap another array.
 * On the CPU, p is checked to lie in [0, C). On a GPU it is read only by the kernel: a p outside
 * [0, C) leaves h and the caches untouched. workspace: bitnet_decode_layer_workspace_size bytes of
 * the op's memory for its intermediates; the op allocates nothing, so it can be captured in a CUDA
 * graph. On a GPU the layer runs as one cooperative kernel, all its blocks resident at once. */
bitnet_status bitnet_decode_layer(int32_t device, int32_t dtype,
                                  const bitnet_decode_layer_config *config,
                                  const bitnet_decode_layer_weights *weights,
                                  void *h /* [H], in/out */,
                                  void *k_cache /* [C, Hkv, D] */,
                                  void *v_cache /* [C, Hkv, D] */, int64_t C,
                                  const int32_t *position /* [1] */,
                                  void *workspace /* [workspace_bytes] */,
                                  int64_t workspace_bytes, void *stream);

/* The workspace bitnet_decode_layer needs for this config on `device`. */
bitnet_status bitnet_decode_layer_workspace_size(int32_t device, int32_t dtype,
                                                 const bitnet_decode_layer_config *config,
                                                 int64_t *bytes);

/* ---- Model glue: the output head, greedy argmax, embedding lookup ---- */

/* y[n, m] = sum_k x[n, k] * w[m, k], accumulated in float32: the bfloat16 output head (or any dense
 * bfloat16 linear layer). x: float32 or bfloat16; y: float32 or bfloat16. K % 8 == 0; w and x
 * 16-byte aligned. */
bitnet_status bitnet_gemv_bf16(int32_t device, const void *w /* [M, K] bfloat16 */, int64_t M,
                               int64_t K, const void *x /* [N, K] */, int32_t x_dtype, int64_t N,
                               void *y /* [N, M] */, int32_t y_dtype, void *stream);

/* index[n] = the first m with x[n, m] maximal (a NaN counts as the maximum, as numpy.argmax). */
bitnet_status bitnet_argmax(int32_t device, const float *x /* [N, M] */, int64_t N, int64_t M,
                            int32_t *index /* [N] */, void *stream);

/* One token per row of logits, drawn on the device (docs/sampling.md). temperature 0: index[n] =
 * bitnet_argmax of row n. Otherwise, for row n with x = logits[n] (V floats):
 *   1. x / temperature; p = expf((x - max x) / temperature) in float32, sums in float64;
 *   2. keep the top_k largest (top_k 0: all; equal logits by the lower index), in that order;
 *   3. softmax over what is kept; then keep its smallest prefix whose cumulative probability
 *      reaches top_p (1: all);
 *   4. u = the uniform draw in [0, 1) of Philox-4x32-10 at (seed, n, counters[n]); index[n] = the
 *      first kept token whose cumulative probability exceeds u (times the kept mass).
 * Without top-k and top-p, the whole vocabulary in index order. top_k <= 1024; top-p alone ranks
 * the 1024 most likely tokens (its softmax over all V): a nucleus wider than that is cut there.
 * A row holding a NaN or +inf, or only -inf, gives its argmax. The CPU and the GPU draw the same
 * token except where u falls within float rounding (expf's ulp, float64 sums in another order) of a
 * boundary between two tokens or of the top-p cut. temperature finite >= 0; top_k in [0, 1024];
 * top_p in (0, 1]. counters: int32 [N] in the op's memory, read, not advanced (advance them with
 * bitnet_add_int32, or pass the sequences' positions). No allocation and no host reads of device
 * data: a GPU call can be captured in a CUDA graph. Programmatic dependent launch. */
bitnet_status bitnet_sample(int32_t device, const float *logits /* [N, V] */, int64_t N, int64_t V,
                            uint64_t seed, const int32_t *counters /* [N] */, float temperature,
                            int32_t top_k, float top_p, int32_t *index /* [N] */, void *stream);

/* out[n, :] = table[ids[n], :]. ids: int32 in the op's memory; on the CPU an id outside [0, V) is an
 * error; on a GPU (ids are not read by the host) its row of out is filled with NaN. */
bitnet_status bitnet_embedding(int32_t device, int32_t dtype, const void *table /* [V, H] */,
                               int64_t V, int64_t H, const int32_t *ids /* [N] */, int64_t N,
                               void *out /* [N, H] */, void *stream);

/* x[i] += delta for i < n, int32: advances positions and lengths between replays of a captured
 * decode step, without the host. */
bitnet_status bitnet_add_int32(int32_t device, int32_t *x /* [n] */, int64_t n, int32_t delta,
                               void *stream);

/* ---- Streams, events and CUDA graphs (so that callers without PyTorch or CuPy can capture and
 * time work) ---- */

bitnet_status bitnet_stream_create(int32_t device, void **stream /* non-blocking */);
bitnet_status bitnet_stream_destroy(int32_t device, void *stream);
bitnet_status bitnet_event_create(int32_t device, void **event);
bitnet_status bitnet_event_destroy(int32_t device, void *event);
bitnet_status bitnet_event_record(void *event, void *stream);
/* Waits for `end`, then gives the milliseconds between the two recorded events. */
bitnet_status bitnet_event_elapsed_ms(void *start, void *end, float *ms);
/* Captures the work then issued by this thread on `stream` (not the legacy default stream) into a
 * graph; capture_end instantiates it. Ops do no allocation or synchronization, so they capture. */
bitnet_status bitnet_graph_capture_begin(void *stream);
bitnet_status bitnet_graph_capture_end(void *stream, void **graph);
bitnet_status bitnet_graph_launch(void *graph, void *stream);
bitnet_status bitnet_graph_destroy(void *graph);

/* ---- Several GPUs: one-shot collectives over peer memory (docs/tensor_parallel.md) ---- */

/* A CUDA IPC memory handle (cudaIpcMemHandle_t's 64 bytes), to send to another process. */
typedef struct {
    uint8_t bytes[64];
} bitnet_ipc_handle;

/* Makes `device` the calling thread's current CUDA device (the ops never change it; NCCL binds a
 * communicator to the current device, so a rank calls this before ncclCommInitRank). */
bitnet_status bitnet_set_current_device(int32_t device);

/* Bytes of the peer buffer each rank allocates (bitnet_malloc) for collectives whose per-rank input
 * is at most max_bytes: a header of flags and epoch counters, then two data slots of max_bytes
 * rounded up to 256. Zero the whole buffer, synchronize, and only then share it. */
bitnet_status bitnet_peer_buffer_size(int64_t max_bytes, int64_t *bytes);

/* cudaIpcGetMemHandle of a bitnet_malloc'ed pointer; the handle opens in another process only. */
bitnet_status bitnet_ipc_get_handle(int32_t device, void *ptr, bitnet_ipc_handle *handle);
/* Maps another process's buffer into `device`'s address space (peer access enabled). */
bitnet_status bitnet_ipc_open_handle(int32_t device, const bitnet_ipc_handle *handle, void **ptr);
bitnet_status bitnet_ipc_close_handle(int32_t device, void *ptr);

/* One-shot all-reduce of `world` ranks, one process per GPU, each holding `buffers`: every rank's
 * peer buffer (this rank's own at buffers[rank], the others opened from their IPC handles; a host
 * array of world pointers). y[i] = sum over ranks r = 0 .. world - 1, in that order, of x_r[i],
 * accumulated in float32 and rounded to y_dtype: every rank gets the same bits. x_dtype, y_dtype:
 * float32, float16 or bfloat16. x and y 16-byte aligned; n * size(x_dtype) <= the max_bytes the
 * buffers were sized for (buffer_bytes = their size). Every rank must make the same sequence of
 * peer calls (same kinds and sizes). Each call copies x into its own buffer, raises its flag in
 * every peer's buffer to the call's epoch (a counter kept in the buffer on the device, so a CUDA
 * graph of these calls may be replayed any number of times) and waits for theirs: no host round
 * trip, capturable. A peer that never arrives: after bitnet_peer_abort (from any thread) the
 * waiting call returns leaving y untouched; after 30 s the kernel traps (a CUDA error at the next
 * synchronization), never a hang. The CPU backend has no peers: world = 1 only (y = x). */
bitnet_status bitnet_peer_allreduce(int32_t device, int32_t x_dtype, int32_t y_dtype, int64_t n,
                                    const void *x /* [n] */, void *y /* [n] */,
                                    void *const *buffers /* [world] */, int32_t world,
                                    int32_t rank, int64_t buffer_bytes, void *stream);

/* The all-reduce after a row-parallel projection of bitnet_rmsnorm_partial's codes, with the
 * norm's division: x = [T * n float32 partial outputs | T float32 sums of squares] on each rank,
 *   y[t, i] = (sum_r x_r[t * n + i]) / sqrt((sum_r x_r[T * n + t]) / norm_cols + eps),
 * both sums in float32, ranks in order 0 .. world - 1, the factor 1 / sqrt(...) in float32 (IEEE
 * sqrt and division), rounded once to y_dtype (float32, float16 or bfloat16): every rank gets the
 * same bits. norm_cols: the whole normalized row's width (all ranks' slices); eps: finite, >= 0.
 * The protocol, buffers and failure rules are bitnet_peer_allreduce's ((T * n + T) * 4 bytes per
 * rank). world = 1: the division alone, of this rank's x (on a GPU the buffer is not touched: the
 * finish of sums made elsewhere, by NCCL say). */
bitnet_status bitnet_peer_allreduce_rms(int32_t device, int32_t y_dtype, int64_t T, int64_t n,
                                        int64_t norm_cols, float eps,
                                        const float *x /* [T * n + T] */, void *y /* [T, n] */,
                                        void *const *buffers /* [world] */, int32_t world,
                                        int32_t rank, int64_t buffer_bytes, void *stream);

/* One-shot all-gather, the same protocol: y = x_0 | x_1 | ... | x_{world-1}, rank r's piece of
 * counts[r] elements (a host array of world counts, the same on every rank; pieces may differ in
 * length, as a split of 5 KV heads over 2 ranks does). dtype: float32, float16 or bfloat16; the
 * largest count * size <= max_bytes. */
bitnet_status bitnet_peer_allgather(int32_t device, int32_t dtype, const int64_t *counts,
                                    const void *x /* [counts[rank]] */,
                                    void *y /* [sum of counts] */,
                                    void *const *buffers /* [world] */, int32_t world,
                                    int32_t rank, int64_t buffer_bytes, void *stream);

/* Marks this rank's peer buffer as aborted, on a stream of its own, so that a peer call waiting
 * for a rank that failed returns, and so do all later ones (the buffer is then unusable). */
bitnet_status bitnet_peer_abort(int32_t device, void *buffer);

/* BITNET_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* BITNET_H */
