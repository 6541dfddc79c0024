/* Internal helpers shared by the public entry points and both backends. Not installed. */
#ifndef BITNET_INTERNAL_H
#define BITNET_INTERNAL_H

#include "bitnet.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Records a printf-style message for the calling thread and returns `status`. */
bitnet_status bn_fail(bitnet_status status, const char *format, ...)
    __attribute__((format(printf, 2, 3)));

#define BN_CHECK(cond, ...) \
    do { if (!(cond)) return bn_fail(BITNET_ERR_INVALID_ARGUMENT, __VA_ARGS__); } while (0)
#define BN_TRY(call) \
    do { bitnet_status bn_s_ = (call); if (bn_s_ != BITNET_OK) return bn_s_; } while (0)

/* Size of one element of `dtype`, or 0 for a value outside the enum. */
int64_t bn_dtype_size(int32_t dtype);
const char *bn_dtype_name(int32_t dtype);

/* Checks that count * elem_size fits in int64 and is positive. */
bitnet_status bn_check_size(const char *what, int64_t count, int64_t elem_size);
/* Checks that rows and cols are positive and rows * cols * elem_size fits in int64. */
bitnet_status bn_check_matrix(const char *what, int64_t rows, int64_t cols, int64_t elem_size);

/* Checks that `ptr` is non-NULL, aligned to `align` bytes and points into the memory of `device`
 * (host memory for a CPU op). `name` names the argument in the message. In a CUDA build on a
 * machine with a GPU, asking the runtime where a pointer lives creates the CUDA context. */
bitnet_status bn_check_pointer(int32_t device, const void *ptr, int64_t align, const char *name);

/* One array of a call, for bn_check_arrays and bn_check_disjoint. An array of 0 bytes is not used
 * by the call and is not checked. */
typedef struct {
    const char *name;
    const void *ptr;
    int64_t bytes;
    int64_t align; /* the alignment bn_check_pointer asks of ptr */
    int flags;     /* BN_READ or BN_WRITTEN, with BN_OPTIONAL and BN_MAY_EQUAL(i) */
} bn_array;
enum { BN_READ = 0, BN_WRITTEN = 1, BN_OPTIONAL = 2 /* NULL means not given */ };
/* The array may coincide exactly (in place) with array i of the table. */
#define BN_MAY_EQUAL(i) (((i) + 1) << 4)
#define BN_MAY_EQUAL_INDEX(flags) (((flags) >> 4) - 1)

/* Checks that no two of the n arrays overlap where one of them is written (a kernel writing an
 * array that another part of it still reads would compute a wrong answer), except an array and the
 * one it may equal, at the same address with the same size. `rule` ends the message. */
bitnet_status bn_check_disjoint(const char *fn, const bn_array *arrays, int n, const char *rule);
/* Every pointer check of an op, in the order of its table: bn_check_pointer on each array (named
 * "fn: name"; a NULL optional one is skipped), then bn_check_disjoint. */
bitnet_status bn_check_arrays(const char *fn, int32_t device, const bn_array *arrays, int n,
                              const char *rule);
#define BN_COUNT(table) ((int)(sizeof(table) / sizeof *(table)))
#define BN_CHECK_ARRAYS(fn, device, arrays, rule) \
    BN_TRY(bn_check_arrays(fn, device, arrays, BN_COUNT(arrays), rule))
/* The rule of the ops without an in-place form. */
#define BN_NO_OVERLAP "no output may overlap another array"

/* Checks that dtype is float32, float16 or bfloat16, and that a GPU op (device >= 0) gets one of
 * the 16-bit ones: the dtype rule of the attention and layer-glue ops. */
bitnet_status bn_check_activation_dtype(const char *op, int32_t device, int32_t dtype);

/* Checks that `device` is the CPU or an existing CUDA device. */
bitnet_status bn_check_device(int32_t device);
/* What the checks rest on (checks.c): the CUDA devices present (0 and a reason in a CPU-only build)
 * and the device whose memory ptr is (BITNET_DEVICE_CPU for host memory). */
bitnet_status bn_device_count(int32_t *count, const char **reason);
bitnet_status bn_pointer_device(const void *ptr, int32_t *device);

/* The CUDA backend, present only when BITNET_HAVE_CUDA is defined. BN_CUDA(call) evaluates to the
 * call in a CUDA build and to a no-device error in a CPU-only build. */
#define BN_NO_CUDA_MESSAGE "this libbitnet was built without CUDA (no nvcc at build time)"
#ifdef BITNET_HAVE_CUDA
#define BN_CUDA(call) (call)
#else
/* sizeof names the call's arguments without evaluating it, so they count as used. */
#define BN_CUDA(call) (sizeof(call) ? bn_fail(BITNET_ERR_NO_DEVICE, BN_NO_CUDA_MESSAGE) : BITNET_OK)
#endif

bitnet_status bn_cuda_device_count(int32_t *count, const char **reason);
bitnet_status bn_cuda_device_get_info(int32_t device, bitnet_device_info *info);
bitnet_status bn_cuda_pointer_device(const void *ptr, int32_t *device);
bitnet_status bn_cuda_malloc(int32_t device, int64_t nbytes, void **ptr);
bitnet_status bn_cuda_free(int32_t device, void *ptr);
/* `device` is the device of the device-side pointer (of dst for device-to-device copies). */
bitnet_status bn_cuda_memcpy(int32_t device, void *dst, const void *src, int64_t nbytes,
                             bitnet_copy_kind kind, void *stream);
bitnet_status bn_cuda_memset(int32_t device, void *ptr, int32_t byte_value, int64_t nbytes,
                             void *stream);
bitnet_status bn_cuda_device_synchronize(int32_t device);
bitnet_status bn_cuda_sm_count(int32_t device, int32_t *sm_count);
/* Occupancy of `kernel` (1-D blocks of `threads`, `shared_bytes` of dynamic shared memory) on the
 * current device, `device`: the blocks one SM holds at once, or the clusters of `cluster` blocks
 * the GPU runs at once (0: it cannot place one). Each first raises the kernel's dynamic shared
 * memory limit to shared_bytes where that is over the 48 KB default (never lowers it), and a
 * cluster over 8 blocks sets the kernel's non-portable cluster size attribute: a launch with the
 * same shape finds both set. Remembered per (device, kernel, threads, shared_bytes, cluster), so
 * that an eager launch does not query the runtime every time. */
bitnet_status bn_cuda_kernel_occupancy(int32_t device, const void *kernel, int threads, size_t shared_bytes,
                                       int *blocks);
bitnet_status bn_cuda_cluster_occupancy(int32_t device, const void *kernel, int cluster, int threads,
                                        size_t shared_bytes, int *clusters);
/* Raises `kernel`'s dynamic shared memory limit on `device` (current) to shared_bytes where
 * needed, as above, for a kernel launched without an occupancy query. */
bitnet_status bn_cuda_kernel_shared_memory(int32_t device, const void *kernel, size_t shared_bytes);
bitnet_status bn_cuda_stream_synchronize(void *stream);
/* Stream-ordered scratch memory on `device` (current) from a pool of the library's own, one per
 * device, that keeps its memory between calls (the default pool gives it back at every
 * synchronization, and taking it again costs about 90 µs). Freed with cudaFreeAsync. */
bitnet_status bn_cuda_scratch_alloc(int32_t device, int64_t nbytes, void *stream, void **ptr);

/* Each op adds its backend entry points below: bn_cpu_<op> and bn_cuda_<op>, with the public
 * signature's arguments after validation. */

/* A CPU op runs its loops on OpenMP threads only from this much work up (elements, or multiply-adds
 * for the GEMVs and attention, counted in double where int64 could overflow): below it, waking and
 * joining the threads costs more than the loop (`#pragma omp parallel ... if (work >= ...)`). */
enum { BN_CPU_PARALLEL_MIN_WORK = 65536 };

/* ---- W2A8 GEMV and ternary / int8 quantization ---- */

/* Shared checks of the ternary ops: M >= 1 (the rows, called rows_name in the message: M, or N
 * tokens), K a multiple of 128 up to BN_TERNARY_MAX_K (so that a dot of codes 0..2 with int8 fits
 * in int32), M * K within int64; a float dtype. */
#define BN_TERNARY_MAX_K (1 << 22)
bitnet_status bn_check_ternary_shape(const char *op, const char *rows_name, int64_t M, int64_t K);
bitnet_status bn_check_float_dtype(const char *op, const char *name, int32_t dtype);
/* The error of bitnet_quantize_i2s for weights that are not all finite: element `index` (flat, of
 * rows of K) is the first NaN or ±inf, `value` its value. */
bitnet_status bn_fail_non_finite_weight(int64_t index, int64_t K, float value);

/* max(a, b), or NaN if either is NaN (fmaxf returns the other operand): the activation quantizers'
 * row maxima, so that a non-finite input shows in the maximum and turns the row's scale NaN. */
static inline float bn_max_or_nan(float a, float b) { return b > a || b != b ? b : a; }

enum { BN_ISA_AUTO = 0, BN_ISA_PORTABLE = 1, BN_ISA_AVX2 = 2, BN_ISA_AVX512_VNNI = 3 };
/* The CPU path in use (never BN_ISA_AUTO), and whether this CPU can run `isa`. */
int32_t bn_cpu_isa(void);
int bn_cpu_isa_supported(int32_t isa);
void bn_cpu_set_isa(int32_t isa);

bitnet_status bn_cpu_quantize_i2s(const void *w, int32_t w_dtype, int64_t M, int64_t K,
                                  const int64_t *row_segments, int64_t n_segments,
                                  uint8_t *w_packed, float *w_scales);
bitnet_status bn_cpu_pack_ternary(const int8_t *w_q, int64_t M, int64_t K, uint8_t *w_packed);
bitnet_status bn_cpu_unpack_ternary(const uint8_t *w_packed, int64_t M, int64_t K, int8_t *w_q);
bitnet_status bn_cpu_quantize_a8(const void *x, int32_t x_dtype, int64_t N, int64_t K, int8_t *x_q,
                                 float *x_scales);
bitnet_status bn_cpu_gemv_w2a8(const uint8_t *w_packed, const float *w_scales, int64_t M,
                               int64_t K, const int8_t *x_q, const float *x_scales, int64_t N,
                               void *y, int32_t y_dtype);

/* bitnet_gemv_w2a8_block_scaled (arguments checked): the weights' blocks of BN_SCALE_BLOCK. */
#define BN_SCALE_BLOCK 256
bitnet_status bn_cpu_gemv_w2a8_block_scaled(const uint8_t *w_packed, const float *w_scales,
                                            const float *block_scales, int64_t M, int64_t K,
                                            const int8_t *x_q, const float *x_scales, int64_t N,
                                            void *y, int32_t y_dtype);
bitnet_status bn_cuda_gemv_w2a8_block_scaled(int32_t device, const uint8_t *w_packed,
                                             const float *w_scales, const float *block_scales,
                                             int64_t M, int64_t K, const int8_t *x_q,
                                             const float *x_scales, int64_t N, void *y,
                                             int32_t y_dtype, void *stream);

bitnet_status bn_cuda_quantize_i2s(int32_t device, const void *w, int32_t w_dtype, int64_t M,
                                   int64_t K, const int64_t *row_segments, int64_t n_segments,
                                   uint8_t *w_packed, float *w_scales, void *stream);
bitnet_status bn_cuda_pack_ternary(int32_t device, const int8_t *w_q, int64_t M, int64_t K,
                                   uint8_t *w_packed, void *stream);
bitnet_status bn_cuda_unpack_ternary(int32_t device, const uint8_t *w_packed, int64_t M, int64_t K,
                                     int8_t *w_q, void *stream);
bitnet_status bn_cuda_quantize_a8(int32_t device, const void *x, int32_t x_dtype, int64_t N,
                                  int64_t K, int8_t *x_q, float *x_scales, void *stream);
bitnet_status bn_cuda_gemv_w2a8(int32_t device, const uint8_t *w_packed, const float *w_scales,
                                int64_t M, int64_t K, const int8_t *x_q, const float *x_scales,
                                int64_t N, void *y, int32_t y_dtype, void *stream);
/* The tensor-core GEMM behind bn_cuda_gemv_w2a8 for many tokens (sm_80+; arguments checked), for
 * M <= BN_GEMM_MAX_M (65535 blocks of 128 rows) and N <= BN_GEMM_MAX_N; larger problems keep the
 * GEMV's launches. */
#define BN_GEMM_MAX_M (65535LL * 128)
#define BN_GEMM_MAX_N (INT32_MAX / 2)
bitnet_status bn_cuda_gemm_w2a8(int32_t device, const uint8_t *w_packed, const float *w_scales,
                                int64_t M, int64_t K, const int8_t *x_q, const float *x_scales,
                                int64_t N, void *y, int32_t y_dtype, void *stream);

/* ---- RMSNorm ---- */

bitnet_status bn_cpu_rmsnorm(int32_t dtype, int64_t T, int64_t H, const void *x, void *residual,
                             const void *weight, float eps, void *y, int8_t *y_q,
                             float *y_scales);
bitnet_status bn_cuda_rmsnorm(int32_t device, int32_t dtype, int64_t T, int64_t H, const void *x,
                              void *residual, const void *weight, float eps, void *y,
                              int8_t *y_q, float *y_scales, void *stream);
/* bitnet_glu_rmsnorm: the same norm of v = glu_gate(gate_up) [T, F], read from gate_up; weight
 * NULL: no norm (y = v, codes by quantize_a8's rule). */
bitnet_status bn_cpu_glu_rmsnorm(int32_t dtype, int64_t T, int64_t F, int32_t activation,
                                 const void *gate_up, const void *weight, float eps, void *y,
                                 int8_t *y_q, float *y_scales);
bitnet_status bn_cuda_glu_rmsnorm(int32_t device, int32_t dtype, int64_t T, int64_t F,
                                  int32_t activation, const void *gate_up, const void *weight,
                                  float eps, void *y, int8_t *y_q, float *y_scales, void *stream);
/* bitnet_rmsnorm_partial (activation -1: x [T, H]) and bitnet_glu_rmsnorm_partial (a
 * bitnet_activation: x is gate_up [T, 2H]): the codes of v * weight, not divided by the RMS, and
 * the sum of v^2 per row. */
bitnet_status bn_cpu_rmsnorm_partial(int32_t dtype, int64_t T, int64_t H, int32_t activation,
                                     const void *x, const void *weight, int8_t *y_q,
                                     float *y_scales, float *sumsq);
bitnet_status bn_cuda_rmsnorm_partial(int32_t device, int32_t dtype, int64_t T, int64_t H,
                                      int32_t activation, const void *x, const void *weight,
                                      int8_t *y_q, float *y_scales, float *sumsq, void *stream);
/* Checks that activation is a bitnet_activation. */
bitnet_status bn_check_activation(const char *fn, int32_t activation);

/* ---- Attention and layer glue ---- */

/* The GPU runs Sq * Hq / Hkv <= BN_ATTENTION_DECODE_MAX_ROWS query rows per KV head with the split-KV
 * decode kernel (in blocks of up to BN_ATTENTION_DECODE_BLOCK_ROWS rows), more with the prefill one. */
#define BN_ATTENTION_DECODE_MAX_ROWS 64
#define BN_ATTENTION_DECODE_BLOCK_ROWS 16
#define BN_ATTENTION_DECODE_TILE_KEYS 64
#define BN_ATTENTION_MAX_SPLITS 1024
int bn_attention_uses_decode(int64_t Sq, int64_t Hq, int64_t Hkv);
/* Split-KV: the number of key ranges a GPU decode splits each sequence into (1: none). */
int64_t bn_attention_num_splits(int32_t sm_count, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv,
                                int64_t D, int64_t C);
/* Bytes of workspace for `num_splits` partials of B * Sq * Hq rows. */
int64_t bn_attention_workspace_bytes(int64_t num_splits, int64_t B, int64_t Sq, int64_t Hq, int64_t D);

/* ---- One-shot collectives over peer memory (allreduce.c) ---- */

/* A rank's peer buffer: flags uint32 [BN_PEER_BLOCKS][BN_PEER_MAX_RANKS] (flags[b][r]: the last
 * epoch at which rank r's block b had its data in place), this rank's epoch counters uint32
 * [BN_PEER_BLOCKS], the abort word, then two data slots (one per epoch parity) from
 * BN_PEER_HEADER_BYTES on. */
#define BN_PEER_MAX_RANKS 8
#define BN_PEER_BLOCKS 16
#define BN_PEER_FLAGS_OFFSET 0
#define BN_PEER_EPOCHS_OFFSET 1024
#define BN_PEER_ABORT_OFFSET 1152
#define BN_PEER_HEADER_BYTES 4096
#define BN_PEER_SLOT_ALIGN 256

bitnet_status bn_cpu_peer_allreduce(int32_t x_dtype, int32_t y_dtype, int64_t n, const void *x,
                                    void *y);
bitnet_status bn_cuda_peer_allreduce(int32_t device, int32_t x_dtype, int32_t y_dtype, int64_t n,
                                     const void *x, void *y, void *const *buffers, int32_t world,
                                     int32_t rank, int64_t slot_bytes, void *stream);
bitnet_status bn_cpu_peer_allreduce_rms(int32_t y_dtype, int64_t T, int64_t n, int64_t norm_cols,
                                        float eps, const float *x, void *y);
bitnet_status bn_cuda_peer_allreduce_rms(int32_t device, int32_t y_dtype, int64_t T, int64_t n,
                                         int64_t norm_cols, float eps, const float *x, void *y,
                                         void *const *buffers, int32_t world, int32_t rank,
                                         int64_t slot_bytes, void *stream);
bitnet_status bn_cuda_peer_allgather(int32_t device, int32_t dtype, const int64_t *counts,
                                     const void *x, void *y, void *const *buffers, int32_t world,
                                     int32_t rank, int64_t slot_bytes, void *stream);
bitnet_status bn_cuda_ipc_get_handle(int32_t device, void *ptr, bitnet_ipc_handle *handle);
bitnet_status bn_cuda_ipc_open_handle(int32_t device, const bitnet_ipc_handle *handle, void **ptr);
bitnet_status bn_cuda_ipc_close_handle(int32_t device, void *ptr);
bitnet_status bn_cuda_peer_abort(int32_t device, void *buffer);
bitnet_status bn_cuda_set_current_device(int32_t device);

/* Elements [offset, offset + n) of a float32 / float16 / bfloat16 array as float32, and back
 * (round to nearest even): rows for the CPU ops (cpu/convert.c). */
void bn_load_floats(int32_t dtype, const void *src, int64_t offset, int64_t n, float *dst);
void bn_store_floats(int32_t dtype, const float *src, int64_t n, void *dst, int64_t offset);

#ifndef __cplusplus
/* Bit patterns of float16 and bfloat16 from and to float32 (round to nearest even), with plain
 * integer and float operations that vectorize without F16C. */
static inline uint32_t bn_bits_of(float f) {
    union { float f; uint32_t u; } bits = {f};
    return bits.u;
}

static inline float bn_float_of(uint32_t u) {
    union { uint32_t u; float f; } bits = {u};
    return bits.f;
}

static inline float bn_bf16_to_float(uint16_t h) { return bn_float_of((uint32_t)h << 16); }

static inline uint16_t bn_float_to_bf16(float f) {
    uint32_t u = bn_bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* round to nearest even */
}

static inline float bn_f16_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0x1f) return bn_float_of(sign | 0x7f800000u | mantissa << 13);
    if (exponent == 0) return bn_float_of(sign | bn_bits_of((float)mantissa * 0x1p-24f));
    return bn_float_of(sign | (exponent + 112) << 23 | mantissa << 13);
}

static inline uint16_t bn_float_to_f16(float f) {
    uint32_t u = bn_bits_of(f), sign = (u >> 16) & 0x8000u, h;
    u &= 0x7fffffffu;
    if (u >= 0x47800000u) { /* |f| >= 65536: infinity, or NaN */
        h = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (u < 0x38800000u) {
        /* |f| < 2^-14, subnormal or zero: adding 0.5 leaves |f| in units of 2^-24 (the subnormal
         * step) in the low mantissa bits, rounded to nearest even by the addition itself. */
        h = bn_bits_of(bn_float_of(u) + 0.5f) - 0x3f000000u;
    } else {
        /* Rebias the exponent from 127 to 15 and round the 13 dropped bits to nearest even; a
         * carry into the exponent is the correct rounding, up to infinity above 65520. */
        h = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
    }
    return (uint16_t)(sign | h);
}

/* Element i of a float32 / float16 / bfloat16 array as float, and back (round to nearest even):
 * for the CPU backend of the attention and glue ops. */
static inline float bn_load_float(const void *p, int32_t dtype, int64_t i) {
    if (dtype == BITNET_DTYPE_F32) return ((const float *)p)[i];
    if (dtype == BITNET_DTYPE_F16) return bn_f16_to_float(((const uint16_t *)p)[i]);
    return bn_bf16_to_float(((const uint16_t *)p)[i]);
}
static inline void bn_store_float(void *p, int32_t dtype, int64_t i, float x) {
    if (dtype == BITNET_DTYPE_F32) ((float *)p)[i] = x;
    else if (dtype == BITNET_DTYPE_F16) ((uint16_t *)p)[i] = bn_float_to_f16(x);
    else ((uint16_t *)p)[i] = bn_float_to_bf16(x);
}
#endif

bitnet_status bn_cpu_attention(int32_t dtype, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv,
                               int64_t D, const void *q, const void *k, const void *v, int64_t C,
                               const int32_t *seq_lens, int32_t causal, float scale, void *out);
bitnet_status bn_cuda_attention(int32_t device, int32_t dtype, int64_t B, int64_t Sq, int64_t Hq,
                                int64_t Hkv, int64_t D, const void *q, const void *k, const void *v,
                                int64_t C, const int32_t *seq_lens, int32_t causal, float scale,
                                void *out, void *workspace, int64_t num_splits, void *stream);
/* bitnet_attention_rope_append_kv (arguments checked): the CPU runs the two ops it fuses
 * (cpu/attention_rope_append_kv.c); the GPU the decode attention kernel, which rotates the new
 * token's q and k and places its k and v row itself (cuda/attention_decode.cu). */
bitnet_status bn_cpu_attention_rope_append_kv(int32_t dtype, int64_t B, int64_t Hq, int64_t Hkv,
                                              int64_t D, const void *qkv, void *k_cache,
                                              void *v_cache, int64_t C, const int32_t *positions,
                                              float theta, float scale, void *out);
bitnet_status bn_cuda_attention_rope_append_kv(int32_t device, int32_t dtype, int64_t B, int64_t Hq,
                                               int64_t Hkv, int64_t D, const void *qkv, void *k_cache,
                                               void *v_cache, int64_t C, const int32_t *positions,
                                               float theta, float scale, void *out, void *workspace,
                                               int64_t num_splits, void *stream);
/* The checks that bitnet_attention and bitnet_attention_rope_append_kv share (attention.c): the
 * sizes (*q_count, *kv_count: the element counts of q and of k), and the split count of a GPU
 * decode (1 on the CPU). */
bitnet_status bn_attention_check_sizes(const char *fn, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv,
                                       int64_t D, int64_t C, int64_t *q_count, int64_t *kv_count);
bitnet_status bn_attention_splits(int32_t device, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv,
                                  int64_t D, int64_t C, int64_t *splits);
bitnet_status bn_cpu_rope_append_kv(int32_t dtype, int64_t B, int64_t S, int64_t Hq, int64_t Hkv,
                                    int64_t D, const void *qkv, void *q, void *k_cache,
                                    void *v_cache, int64_t C, const int32_t *positions, float theta);
bitnet_status bn_cuda_rope_append_kv(int32_t device, int32_t dtype, int64_t B, int64_t S,
                                     int64_t Hq, int64_t Hkv, int64_t D, const void *qkv, void *q,
                                     void *k_cache, void *v_cache, int64_t C,
                                     const int32_t *positions, float theta, void *stream);
/* bitnet_gemv_w2a8_rope_append_kv (arguments checked): the CPU runs the two ops it fuses
 * (cpu/gemv_w2a8_rope_append_kv.c); the GPU the one-token GEMV kernel with a RoPE epilogue
 * (cuda/gemv_w2a8.cu). */
bitnet_status bn_cpu_gemv_w2a8_rope_append_kv(int32_t dtype, const uint8_t *w_packed,
                                              const float *w_scales, int64_t K, const int8_t *x_q,
                                              const float *x_scale, int64_t Hq, int64_t Hkv,
                                              int64_t D, void *q, void *k_cache, void *v_cache,
                                              int64_t C, const int32_t *position, float theta);
bitnet_status bn_cuda_gemv_w2a8_rope_append_kv(int32_t device, int32_t dtype,
                                               const uint8_t *w_packed, const float *w_scales,
                                               int64_t K, const int8_t *x_q, const float *x_scale,
                                               int64_t Hq, int64_t Hkv, int64_t D, void *q,
                                               void *k_cache, void *v_cache, int64_t C,
                                               const int32_t *position, float theta, void *stream);
/* The CPU norms sum a row's squares in this many partial sums, element i into partial i % LANES,
 * then the partials in order (cpu/rmsnorm.c; cpu/gemv_w2a8_norm.c sums in the same order). */
enum { BN_CPU_NORM_LANES = 16 };
/* The scalar checks of the fused QKV + RoPE entry points (gemv_w2a8_rope_append_kv.c), and the
 * CPU's check of the position that their GPU kernels check themselves. */
bitnet_status bn_check_qkv_rope(const char *fn, int64_t K, int64_t Hq, int64_t Hkv, int64_t D,
                                int64_t C, float theta);
bitnet_status bn_check_cpu_position(const char *fn, const int32_t *position, int64_t C);
/* The input RMSNorm fused into the GEMVs (arguments checked; stats as double [slots][2]): the CPU
 * (cpu/gemv_w2a8_norm.c) fills one slot and quantizes into a row of its own before the plain ops;
 * the GPU runs the one-token kernel's fused forms (cuda/gemv_w2a8.cu). */
bitnet_status bn_cpu_gemv_w2a8_add_norm_stats(int32_t dtype, const uint8_t *w_packed,
                                              const float *w_scales, int64_t M, int64_t K,
                                              const int8_t *x_q, const float *x_scale, void *h,
                                              const void *norm_weight, float *stats,
                                              int64_t slots);
bitnet_status bn_cpu_rmsnorm_gemv_w2a8(int32_t dtype, const void *h, const void *norm_weight,
                                       const float *stats, int64_t slots, float eps,
                                       const uint8_t *w_packed, const float *w_scales, int64_t M,
                                       int64_t K, void *y, int32_t y_dtype);
bitnet_status bn_cpu_rmsnorm_gemv_w2a8_rope_append_kv(
    int32_t dtype, const void *h, const void *norm_weight, const float *stats, int64_t slots,
    float eps, const uint8_t *w_packed, const float *w_scales, int64_t K, int64_t Hq, int64_t Hkv,
    int64_t D, void *q, void *k_cache, void *v_cache, int64_t C, const int32_t *position,
    float theta);
/* The CUDA consumers' limits (the one-token kernel's registers and lanes hold that much). */
enum { BN_CUDA_NORMED_MAX_K = 8192, BN_CUDA_NORMED_MAX_SLOTS = 512 };
bitnet_status bn_cuda_norm_stats_slots(int32_t device, int64_t *slots);
bitnet_status bn_cuda_gemv_w2a8_add_norm_stats(int32_t device, int32_t dtype,
                                               const uint8_t *w_packed, const float *w_scales,
                                               int64_t M, int64_t K, const int8_t *x_q,
                                               const float *x_scale, void *h,
                                               const void *norm_weight, float *stats,
                                               int64_t slots, void *stream);
bitnet_status bn_cuda_rmsnorm_gemv_w2a8(int32_t device, int32_t dtype, const void *h,
                                        const void *norm_weight, const float *stats,
                                        int64_t slots, float eps, const uint8_t *w_packed,
                                        const float *w_scales, int64_t M, int64_t K, void *y,
                                        int32_t y_dtype, void *stream);
bitnet_status bn_cuda_rmsnorm_gemv_w2a8_rope_append_kv(
    int32_t device, int32_t dtype, const void *h, const void *norm_weight, const float *stats,
    int64_t slots, float eps, const uint8_t *w_packed, const float *w_scales, int64_t K,
    int64_t Hq, int64_t Hkv, int64_t D, void *q, void *k_cache, void *v_cache, int64_t C,
    const int32_t *position, float theta, void *stream);
/* bitnet_decode_layer: the CPU runs the unfused sequence of its CPU ops through the workspace
 * (cpu/decode_layer.c); the GPU runs one cooperative kernel (cuda/decode_layer.cu). */
int64_t bn_cpu_decode_layer_workspace_size(int32_t dtype, const bitnet_decode_layer_config *c);
bitnet_status bn_cpu_decode_layer(int32_t dtype, const bitnet_decode_layer_config *c,
                                  const bitnet_decode_layer_weights *w, void *h, void *k_cache,
                                  void *v_cache, int64_t C, const int32_t *position,
                                  void *workspace);
bitnet_status bn_cuda_decode_layer_workspace_size(int32_t device, int32_t dtype,
                                                  const bitnet_decode_layer_config *c,
                                                  int64_t *bytes);
bitnet_status bn_cuda_decode_layer(int32_t device, int32_t dtype,
                                   const bitnet_decode_layer_config *c,
                                   const bitnet_decode_layer_weights *w, void *h, void *k_cache,
                                   void *v_cache, int64_t C, const int32_t *position,
                                   void *workspace, void *stream);
bitnet_status bn_cpu_glu_gate(int32_t dtype, int64_t T, int64_t F, int32_t activation,
                              const void *gate_up, void *out);
/* out[out_offset + i] = act(gate_up[gate + i]) * gate_up[gate + F + i] stored in dtype, i < n: the
 * gate of bitnet_glu_gate, shared with the CPU bitnet_glu_rmsnorm. */
void bn_cpu_glu_span(int32_t dtype, int32_t activation, const void *gate_up, int64_t gate,
                     int64_t F, int64_t n, void *out, int64_t out_offset);
bitnet_status bn_cuda_glu_gate(int32_t device, int32_t dtype, int64_t T, int64_t F,
                               int32_t activation, const void *gate_up, void *out, void *stream);

/* ---- Sampling (docs/sampling.md) ---- */

/* Candidates kept by top-k or top-p: top_k <= BN_SAMPLE_MAX_CANDIDATES, and top-p without top-k
 * looks at the BN_SAMPLE_MAX_CANDIDATES most likely tokens. */
#define BN_SAMPLE_MAX_CANDIDATES 1024

#ifdef __CUDACC__
#define BN_HOST_DEVICE __host__ __device__
#else
#define BN_HOST_DEVICE
#endif

/* The uniform draw in [0, 1) of row `row` at `counter`: Philox-4x32-10 (Salmon et al., SC 2011) of
 * the counter block (counter, row low, row high, 0x53414D50) under the key (seed low, seed high),
 * its first two words as a 53-bit fraction. Integer arithmetic, the same on the CPU and the GPU. */
static inline BN_HOST_DEVICE double bn_sample_uniform(uint64_t seed, int64_t row, int32_t counter) {
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(uint64_t)row;
    uint32_t c2 = (uint32_t)((uint64_t)row >> 32), c3 = 0x53414D50u;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int round = 0; round < 10; round++) {
        const uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1, c3 = (uint32_t)p0, c0 = n0, c2 = n2;
        k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
    }
    return ((double)(c0 >> 5) * 67108864.0 + (double)(c1 >> 6)) * (1.0 / 9007199254740992.0);
}

/* A float's place in the order the sampler ranks logits by, as an unsigned integer: larger floats
 * give larger keys (-0 just below +0), and every NaN the largest key (NaN ranks first, as in
 * bitnet_argmax). */
static inline BN_HOST_DEVICE uint32_t bn_sample_order_key(float x) {
    union { float f; uint32_t u; } bits = {x};
    if (x != x) return 0xFFFFFFFFu;
    return bits.u ^ ((bits.u >> 31) ? 0xFFFFFFFFu : 0x80000000u);
}

/* The rank of logit x at index i: larger is ranked first, equal logits by the lower index. */
static inline BN_HOST_DEVICE uint64_t bn_sample_rank(float x, int64_t i) {
    return (uint64_t)bn_sample_order_key(x) << 32 | (0xFFFFFFFFu - (uint32_t)i);
}
static inline BN_HOST_DEVICE int64_t bn_sample_rank_index(uint64_t rank) {
    return (int64_t)(0xFFFFFFFFu - (uint32_t)rank);
}

bitnet_status bn_cpu_sample(const float *logits, int64_t N, int64_t V, uint64_t seed,
                            const int32_t *counters, float temperature, int32_t top_k, float top_p,
                            int32_t *index);
bitnet_status bn_cuda_sample(int32_t device, const float *logits, int64_t N, int64_t V,
                             uint64_t seed, const int32_t *counters, float temperature,
                             int32_t top_k, float top_p, int32_t *index, void *stream);

/* ---- Model glue and graphs ---- */
bitnet_status bn_cpu_gemv_bf16(const void *w, int64_t M, int64_t K, const void *x, int32_t x_dtype,
                               int64_t N, void *y, int32_t y_dtype);
bitnet_status bn_cuda_gemv_bf16(int32_t device, const void *w, int64_t M, int64_t K, const void *x,
                                int32_t x_dtype, int64_t N, void *y, int32_t y_dtype, void *stream);
bitnet_status bn_cpu_argmax(const float *x, int64_t N, int64_t M, int32_t *index);
bitnet_status bn_cuda_argmax(int32_t device, const float *x, int64_t N, int64_t M, int32_t *index,
                             void *stream);
bitnet_status bn_cpu_embedding(int32_t dtype, const void *table, int64_t V, int64_t H,
                               const int32_t *ids, int64_t N, void *out);
bitnet_status bn_cuda_embedding(int32_t device, int32_t dtype, const void *table, int64_t V,
                                int64_t H, const int32_t *ids, int64_t N, void *out, void *stream);
bitnet_status bn_cpu_add_int32(int32_t *x, int64_t n, int32_t delta);
bitnet_status bn_cuda_add_int32(int32_t device, int32_t *x, int64_t n, int32_t delta, void *stream);
bitnet_status bn_cuda_stream_create(int32_t device, void **stream);
bitnet_status bn_cuda_stream_destroy(int32_t device, void *stream);
bitnet_status bn_cuda_event_create(int32_t device, void **event);
bitnet_status bn_cuda_event_destroy(int32_t device, void *event);
bitnet_status bn_cuda_event_record(void *event, void *stream);
bitnet_status bn_cuda_event_elapsed_ms(void *start, void *end, float *ms);
bitnet_status bn_cuda_graph_capture_begin(void *stream);
bitnet_status bn_cuda_graph_capture_end(void *stream, void **graph);
bitnet_status bn_cuda_graph_launch(void *graph, void *stream);
bitnet_status bn_cuda_graph_destroy(void *graph);

#ifdef __cplusplus
}
#endif

#endif /* BITNET_INTERNAL_H */
