/* Public attention entry points: argument checks, the split-KV workspace size, and dispatch to the
 * CPU (cpu/attention.c) or CUDA (cuda/attention_decode.cu, cuda/attention_prefill.cu) backend. */
#include <math.h>

#include "internal.h"

int bn_attention_uses_decode(int64_t Sq, int64_t Hq, int64_t Hkv) {
    return Sq * (Hq / Hkv) <= BN_ATTENTION_DECODE_MAX_ROWS;
}

int64_t bn_attention_num_splits(int32_t sm_count, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv,
                                int64_t D, int64_t C) {
    if (!bn_attention_uses_decode(Sq, Hq, Hkv)) return 1;
    int64_t rows = Sq * (Hq / Hkv);
    int64_t row_blocks = (rows + BN_ATTENTION_DECODE_BLOCK_ROWS - 1) / BN_ATTENTION_DECODE_BLOCK_ROWS;
    int64_t blocks_per_split = B * Hkv * row_blocks;
    /* Fill one wave of about three blocks per SM (one at D = 256, whose tiles take 136 KB of shared
     * memory), without splits shorter than one key tile. */
    int64_t splits = (D > 128 ? 1 : 3) * (int64_t)sm_count / blocks_per_split;
    int64_t tiles = (C + BN_ATTENTION_DECODE_TILE_KEYS - 1) / BN_ATTENTION_DECODE_TILE_KEYS;
    if (splits > tiles) splits = tiles;
    if (splits > BN_ATTENTION_MAX_SPLITS) splits = BN_ATTENTION_MAX_SPLITS;
    return splits < 1 ? 1 : splits;
}

int64_t bn_attention_workspace_bytes(int64_t num_splits, int64_t B, int64_t Sq, int64_t Hq, int64_t D) {
    /* Per split and query row: D partial outputs, then the row's running max and sum. */
    return num_splits > 1 ? num_splits * B * Sq * Hq * (D + 2) * (int64_t)sizeof(float) : 0;
}

bitnet_status bn_attention_check_sizes(const char *fn, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv,
                                       int64_t D, int64_t C, int64_t *q_count, int64_t *kv_count) {
    BN_CHECK(B > 0 && Sq > 0 && Hq > 0 && Hkv > 0 && D > 0 && C > 0,
             "%s: B, Sq, Hq, Hkv, D and C must be positive, got %lld, %lld, %lld, %lld, %lld, %lld",
             fn, (long long)B, (long long)Sq, (long long)Hq, (long long)Hkv, (long long)D,
             (long long)C);
    BN_CHECK(Hq % Hkv == 0, "%s: Hq (%lld) is not a multiple of Hkv (%lld)", fn, (long long)Hq,
             (long long)Hkv);
    BN_CHECK(D <= 4096 && Hq <= 65536 && Sq <= INT32_MAX && C <= INT32_MAX,
             "%s: D, Hq, Sq or C too large (%lld, %lld, %lld, %lld)", fn, (long long)D,
             (long long)Hq, (long long)Sq, (long long)C);
    /* With those bounds Sq * Hq * D and C * Hkv * D stay below 2^59: only the factor B can overflow. */
    BN_CHECK(B <= INT64_MAX / (Sq * Hq * D) && B <= INT64_MAX / (C * Hkv * D),
             "%s: B * Sq * Hq * D or B * C * Hkv * D overflows", fn);
    *q_count = B * Sq * Hq * D;
    *kv_count = B * C * Hkv * D;
    BN_TRY(bn_check_size(fn, *q_count, 4));
    return bn_check_size(fn, *kv_count, 4);
}

bitnet_status bn_attention_splits(int32_t device, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv,
                                  int64_t D, int64_t C, int64_t *splits) {
    *splits = 1;
    if (device == BITNET_DEVICE_CPU) return BITNET_OK;
    int32_t sm_count = 0;
    BN_TRY(BN_CUDA(bn_cuda_sm_count(device, &sm_count)));
    *splits = bn_attention_num_splits(sm_count, B, Sq, Hq, Hkv, D, C);
    return BITNET_OK;
}

bitnet_status bitnet_attention_workspace_size(int32_t device, int64_t B, int64_t Sq, int64_t Hq,
                                              int64_t Hkv, int64_t D, int64_t C, int64_t *bytes) {
    static const char fn[] = "bitnet_attention_workspace_size";
    BN_CHECK(bytes, "%s: bytes is NULL", fn);
    BN_TRY(bn_check_device(device));
    int64_t q_count = 0, kv_count = 0, splits = 1;
    BN_TRY(bn_attention_check_sizes(fn, B, Sq, Hq, Hkv, D, C, &q_count, &kv_count));
    BN_TRY(bn_attention_splits(device, B, Sq, Hq, Hkv, D, C, &splits));
    *bytes = bn_attention_workspace_bytes(splits, B, Sq, Hq, D);
    return BITNET_OK;
}

bitnet_status bitnet_attention(int32_t device, int32_t dtype, int64_t B, int64_t Sq, int64_t Hq,
                               int64_t Hkv, int64_t D, const void *q, const void *k, const void *v,
                               int64_t C, const int32_t *seq_lens, int32_t causal, float scale,
                               void *out, void *workspace, int64_t workspace_bytes, void *stream) {
    static const char fn[] = "bitnet_attention";
    BN_TRY(bn_check_device(device));
    int on_gpu = device != BITNET_DEVICE_CPU;
    BN_TRY(bn_check_activation_dtype(fn, device, dtype));
    int64_t q_count = 0, kv_count = 0;
    BN_TRY(bn_attention_check_sizes(fn, B, Sq, Hq, Hkv, D, C, &q_count, &kv_count));
    if (D != 64 && D != 128 && D != 256)
        return bn_fail(BITNET_ERR_UNSUPPORTED,
                       "%s: head_dim D = %lld is not supported (64, 128 or 256)", fn, (long long)D);
    BN_CHECK(causal == 0 || causal == 1, "%s: causal must be 0 or 1, got %d", fn, causal);
    BN_CHECK(isfinite(scale), "%s: scale must be finite (0 for 1/sqrt(D)), got %g", fn, (double)scale);
    BN_CHECK(seq_lens || !causal || Sq <= C,
             "%s: causal with Sq = %lld queries needs at least as many keys, but C = %lld", fn,
             (long long)Sq, (long long)C);
    BN_CHECK(workspace_bytes >= 0, "%s: workspace_bytes is negative (%lld)", fn,
             (long long)workspace_bytes);

    int64_t splits = 1;
    BN_TRY(bn_attention_splits(device, B, Sq, Hq, Hkv, D, C, &splits));
    const int64_t needed = bn_attention_workspace_bytes(splits, B, Sq, Hq, D); /* 0: none used */
    BN_CHECK(workspace_bytes >= needed,
             "%s: workspace of %lld bytes is too small, these sizes need %lld "
             "(bitnet_attention_workspace_size)", fn, (long long)workspace_bytes, (long long)needed);

    const int64_t size = bn_dtype_size(dtype), align = on_gpu ? 16 : size;
    const bn_array arrays[] = {{"q", q, q_count * size, align, BN_READ},
                               {"k", k, kv_count * size, align, BN_READ},
                               {"v", v, kv_count * size, align, BN_READ},
                               {"seq_lens", seq_lens, B * 4, 4, BN_READ | BN_OPTIONAL},
                               {"out", out, q_count * size, align, BN_WRITTEN},
                               {"workspace", workspace, needed, 16, BN_WRITTEN}};
    BN_CHECK_ARRAYS(fn, device, arrays, BN_NO_OVERLAP);

    if (!on_gpu) {
        int64_t min_len = causal ? Sq : 1;
        for (int64_t b = 0; seq_lens && b < B; b++)
            BN_CHECK(seq_lens[b] >= min_len && seq_lens[b] <= C,
                     "%s: seq_lens[%lld] = %d is outside [%lld, C = %lld]", fn, (long long)b,
                     seq_lens[b], (long long)min_len, (long long)C);
    }
    if (scale == 0.0f) scale = 1.0f / sqrtf((float)D);
    return on_gpu ? BN_CUDA(bn_cuda_attention(device, dtype, B, Sq, Hq, Hkv, D, q, k, v, C, seq_lens,
                                              causal, scale, out, workspace, splits, stream))
                  : bn_cpu_attention(dtype, B, Sq, Hq, Hkv, D, q, k, v, C, seq_lens, causal, scale,
                                     out);
}
