/* CPU W2A8 GEMV: y[n, m] = (dot(codes[m], x_q[n]) - sum(x_q[n])) * w_scales[m] / x_scales[n],
 * codes = W_q + 1 in 0..2 (docs/weight_format.md). Tokens go in blocks whose permuted x (at most
 * X_BLOCK_BYTES) stays in a core's L2 while every row passes by: OpenMP over rows within a block;
 * per row, the 2-bit codes of 64 weights (16 packed bytes) are expanded once and applied to every
 * token of the block. The block-scaled form (bitnet_gemv_w2a8_block_scaled) takes the dot of each
 * 256-weight block apart and sums the scaled dots in float32, in block order.
 * SIMD: the 16 packed bytes broadcast to four 128-bit lanes, lane i shifted right by 2i and masked
 * with 0x03 gives byte 4*(4i+g)+b = code of weight 16g+4i+b, so x is permuted once per call into
 * that order (a 4x4 transpose of its 32-bit words in each block of 64) and one vpdpbusd (AVX-512
 * VNNI) or vpmaddubsw + vpmaddwd (AVX2) per 64 weights and token does the dot. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* X_BLOCK_BYTES: at 960 tokens, 2560 x 6912 took 274 ms in one block and 90 ms in blocks of 64 KB
 * (8 tokens); 128 KB to 1 MB were 3-20% slower than 64 KB
 * (docs/log/2026-11-27.md#2026-11-27-21). */
enum { BLOCK = 64, TOKEN_GROUP = 4, X_BLOCK_BYTES = 64 << 10 };

static uint32_t load_u32(const void *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* x_perm word 4i+g of each 64-byte block = x word 4g+i (the order of the SIMD code vectors). */
static void permute_x(const int8_t *x, int64_t count, int8_t *x_perm) {
    for (int64_t block = 0; block < count; block += BLOCK)
        for (int i = 0; i < 4; i++)
            for (int g = 0; g < 4; g++)
                memcpy(x_perm + block + 4 * (4 * i + g), x + block + 4 * (4 * g + i), 4);
}

/* dots[t] = sum_k code[k] * x_perm[t][k], k < K, for `tokens` tokens (x_perm rows are stride
 * apart; K a multiple of 128). */
static void dots_portable(const uint8_t *w_row, const int8_t *x_perm, int64_t K, int64_t stride,
                          int tokens, int32_t *dots) {
    for (int t = 0; t < tokens; t++) {
        const int8_t *x = x_perm + t * stride;
        int32_t acc = 0;
        for (int64_t block = 0; block < K; block += BLOCK) {
            const uint8_t *packed = w_row + block / 4;
            for (int d = 0; d < 16; d++) {
                uint32_t codes = (load_u32(packed + 4 * (d % 4)) >> (2 * (d / 4))) & 0x03030303u;
                for (int b = 0; b < 4; b++)
                    acc += (int32_t)((codes >> (8 * b)) & 0xff) * x[block + 4 * d + b];
            }
        }
        dots[t] = acc;
    }
}

/* Two accumulators per token (even and odd blocks; K / 64 is even) halve the dependency chains. */
__attribute__((target("avx2"))) static inline void dots_avx2_group(
    const uint8_t *w_row, const int8_t *x_perm, int64_t K, int64_t stride, const int tokens,
    int32_t *dots) {
    const __m256i shift_lo = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    const __m256i shift_hi = _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6);
    const __m256i mask = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    __m256i acc[2][TOKEN_GROUP];
    for (int t = 0; t < tokens; t++) acc[0][t] = acc[1][t] = _mm256_setzero_si256();
    for (int64_t block = 0; block < K; block += 2 * BLOCK) {
        for (int half = 0; half < 2; half++) {
            int64_t k = block + half * BLOCK;
            __m256i packed = _mm256_broadcastsi128_si256(
                _mm_loadu_si128((const __m128i *)(w_row + k / 4)));
            __m256i codes_lo = _mm256_and_si256(_mm256_srlv_epi32(packed, shift_lo), mask);
            __m256i codes_hi = _mm256_and_si256(_mm256_srlv_epi32(packed, shift_hi), mask);
            for (int t = 0; t < tokens; t++) {
                const int8_t *x = x_perm + t * stride + k;
                __m256i sum16 = _mm256_add_epi16(
                    _mm256_maddubs_epi16(codes_lo, _mm256_loadu_si256((const __m256i *)x)),
                    _mm256_maddubs_epi16(codes_hi, _mm256_loadu_si256((const __m256i *)(x + 32))));
                acc[half][t] = _mm256_add_epi32(acc[half][t], _mm256_madd_epi16(sum16, ones));
            }
        }
    }
    for (int t = 0; t < tokens; t++) {
        __m256i both = _mm256_add_epi32(acc[0][t], acc[1][t]);
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
        dots[t] = _mm_cvtsi128_si32(s);
    }
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static inline void dots_vnni_group(
    const uint8_t *w_row, const int8_t *x_perm, int64_t K, int64_t stride, const int tokens,
    int32_t *dots) {
    const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    const __m512i mask = _mm512_set1_epi8(3);
    __m512i acc[2][TOKEN_GROUP];
    for (int t = 0; t < tokens; t++) acc[0][t] = acc[1][t] = _mm512_setzero_si512();
    for (int64_t block = 0; block < K; block += 2 * BLOCK) {
        for (int half = 0; half < 2; half++) {
            int64_t k = block + half * BLOCK;
            __m512i packed = _mm512_broadcast_i32x4(
                _mm_loadu_si128((const __m128i *)(w_row + k / 4)));
            __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(packed, shifts), mask);
            for (int t = 0; t < tokens; t++)
                acc[half][t] = _mm512_dpbusd_epi32(
                    acc[half][t], codes, _mm512_loadu_si512((const void *)(x_perm + t * stride + k)));
        }
    }
    for (int t = 0; t < tokens; t++)
        dots[t] = _mm512_reduce_add_epi32(_mm512_add_epi32(acc[0][t], acc[1][t]));
}

/* Dispatches on a constant token count so that each group size gets its own unrolled loop. */
#define BN_GROUP_SWITCH(fn, w_row, x, K, stride, tokens, dots)                  \
    switch (tokens) {                                                           \
    case 1: fn(w_row, x, K, stride, 1, dots); break;                            \
    case 2: fn(w_row, x, K, stride, 2, dots); break;                            \
    case 3: fn(w_row, x, K, stride, 3, dots); break;                            \
    default: fn(w_row, x, K, stride, 4, dots); break;                           \
    }

__attribute__((target("avx2"))) static void dots_avx2(const uint8_t *w_row, const int8_t *x_perm,
                                                       int64_t K, int64_t stride, int tokens,
                                                       int32_t *dots) {
    BN_GROUP_SWITCH(dots_avx2_group, w_row, x_perm, K, stride, tokens, dots)
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void dots_vnni(
    const uint8_t *w_row, const int8_t *x_perm, int64_t K, int64_t stride, int tokens,
    int32_t *dots) {
    BN_GROUP_SWITCH(dots_vnni_group, w_row, x_perm, K, stride, tokens, dots)
}

typedef void (*dots_fn)(const uint8_t *, const int8_t *, int64_t, int64_t, int, int32_t *);

static void store(void *y, int32_t y_dtype, int64_t index, int32_t dot, float w_scale,
                  float x_scale) {
    if (y_dtype == BITNET_DTYPE_I32) ((int32_t *)y)[index] = dot;
    else bn_store_float(y, y_dtype, index, (float)dot * w_scale / x_scale);
}

/* Both GEMVs: block_scales NULL is bitnet_gemv_w2a8 (one block of K weights, y from the exact
 * dot), else bitnet_gemv_w2a8_block_scaled (blocks of BN_SCALE_BLOCK; their scaled dots summed
 * in float32 in block order). */
static bitnet_status gemv(const char *op, const uint8_t *w_packed, const float *w_scales,
                          const float *block_scales, int64_t M, int64_t K, const int8_t *x_q,
                          const float *x_scales, int64_t N, void *y, int32_t y_dtype) {
    const int64_t block = block_scales ? BN_SCALE_BLOCK : K, blocks = K / block;
    int8_t *x_perm = malloc((size_t)(N * K));
    int32_t *x_sums = malloc((size_t)(N * blocks) * sizeof *x_sums); /* [N, blocks] */
    if (!x_perm || !x_sums) {
        free(x_perm);
        free(x_sums);
        return bn_fail(BITNET_ERR_OUT_OF_MEMORY, "%s: no host memory for %lld bytes of permuted "
                       "activations", op, (long long)(N * K));
    }
    int32_t isa = bn_cpu_isa();
    dots_fn dots = isa == BN_ISA_AVX512_VNNI ? dots_vnni
                   : isa == BN_ISA_AVX2      ? dots_avx2
                                             : dots_portable;
    for (int64_t n = 0; n < N; n++) {
        permute_x(x_q + n * K, K, x_perm + n * K);
        for (int64_t b = 0; b < blocks; b++) {
            int32_t sum = 0;
            for (int64_t k = b * block; k < (b + 1) * block; k++) sum += x_q[n * K + k];
            x_sums[n * blocks + b] = sum;
        }
    }
    int64_t block_tokens = X_BLOCK_BYTES / K / TOKEN_GROUP * TOKEN_GROUP;
    if (block_tokens < TOKEN_GROUP) block_tokens = TOKEN_GROUP;
    for (int64_t b0 = 0; b0 < N; b0 += block_tokens) {
        const int64_t b1 = N - b0 < block_tokens ? N : b0 + block_tokens;
#pragma omp parallel for schedule(static) if ((double)M * K * (b1 - b0) >= BN_CPU_PARALLEL_MIN_WORK)
        for (int64_t m = 0; m < M; m++) {
            const uint8_t *w_row = w_packed + m * (K / 4);
            for (int64_t n0 = b0; n0 < b1; n0 += TOKEN_GROUP) {
                int tokens = b1 - n0 < TOKEN_GROUP ? (int)(b1 - n0) : TOKEN_GROUP;
                int32_t group_dots[TOKEN_GROUP], dot[TOKEN_GROUP];
                float sum[TOKEN_GROUP] = {0};
                for (int64_t b = 0; b < blocks; b++) {
                    dots(w_row + b * block / 4, x_perm + n0 * K + b * block, block, K, tokens,
                         group_dots);
                    for (int t = 0; t < tokens; t++) {
                        dot[t] = group_dots[t] - x_sums[(n0 + t) * blocks + b];
                        if (block_scales) sum[t] += block_scales[m * blocks + b] * (float)dot[t];
                    }
                }
                for (int t = 0; t < tokens; t++) {
                    const int64_t index = (n0 + t) * M + m;
                    if (block_scales)
                        bn_store_float(y, y_dtype, index, sum[t] * w_scales[m] / x_scales[n0 + t]);
                    else
                        store(y, y_dtype, index, dot[t], w_scales[m], x_scales[n0 + t]);
                }
            }
        }
    }
    free(x_perm);
    free(x_sums);
    return BITNET_OK;
}

bitnet_status bn_cpu_gemv_w2a8(const uint8_t *w_packed, const float *w_scales, int64_t M,
                               int64_t K, const int8_t *x_q, const float *x_scales, int64_t N,
                               void *y, int32_t y_dtype) {
    return gemv("bitnet_gemv_w2a8", w_packed, w_scales, NULL, M, K, x_q, x_scales, N, y, y_dtype);
}

bitnet_status bn_cpu_gemv_w2a8_block_scaled(const uint8_t *w_packed, const float *w_scales,
                                            const float *block_scales, int64_t M, int64_t K,
                                            const int8_t *x_q, const float *x_scales, int64_t N,
                                            void *y, int32_t y_dtype) {
    return gemv("bitnet_gemv_w2a8_block_scaled", w_packed, w_scales, block_scales, M, K, x_q,
                x_scales, N, y, y_dtype);
}
