/* Public entry points of the fused decode layer (bitnet_decode_layer and its workspace size):
 * argument checks, one config check shared by both, and dispatch to cpu/decode_layer.c or
 * cuda/decode_layer.cu. */
#include <math.h>

#include "internal.h"

/* H, I and Hq D: the widths of the layer's GEMVs and norms, at most this. */
enum { MAX_WIDTH = 65536 };

static bitnet_status check_width(const char *fn, const char *name, int64_t width) {
    if (width > MAX_WIDTH)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: config %s = %lld is over the largest supported "
                       "width (%d)", fn, name, (long long)width, MAX_WIDTH);
    if (width % 128 != 0)
        return bn_fail(BITNET_ERR_UNSUPPORTED, "%s: config %s = %lld is not a multiple of 128", fn,
                       name, (long long)width);
    return BITNET_OK;
}

static bitnet_status check_eps(const char *fn, const char *name, float eps) {
    BN_CHECK(isfinite(eps) && eps > 0.0f, "%s: config %s must be finite and > 0, got %g", fn, name,
             (double)eps);
    return BITNET_OK;
}

/* Every check of the device, the dtype and the config, shared by both entry points. */
static bitnet_status check_config(const char *fn, int32_t device, int32_t dtype,
                                  const bitnet_decode_layer_config *c) {
    BN_TRY(bn_check_device(device));
    BN_TRY(bn_check_activation_dtype(fn, device, dtype));
    BN_CHECK(c, "%s: config is NULL", fn);
    BN_CHECK(c->H > 0 && c->I > 0 && c->Hq > 0 && c->Hkv > 0 && c->D > 0,
             "%s: config H, I, Hq, Hkv and D must be positive, got %lld, %lld, %lld, %lld, %lld",
             fn, (long long)c->H, (long long)c->I, (long long)c->Hq, (long long)c->Hkv,
             (long long)c->D);
    if (c->D != 64 && c->D != 128 && c->D != 256)
        return bn_fail(BITNET_ERR_UNSUPPORTED,
                       "%s: head_dim D = %lld is not supported (64, 128 or 256)", fn,
                       (long long)c->D);
    BN_CHECK(c->Hq % c->Hkv == 0, "%s: Hq (%lld) is not a multiple of Hkv (%lld)", fn,
             (long long)c->Hq, (long long)c->Hkv);
    BN_TRY(check_width(fn, "H", c->H));
    BN_TRY(check_width(fn, "I", c->I));
    if (c->Hq > MAX_WIDTH) BN_TRY(check_width(fn, "Hq", c->Hq)); /* before Hq * D can overflow */
    BN_TRY(check_width(fn, "Hq * D", c->Hq * c->D));
    BN_TRY(bn_check_activation(fn, c->activation));
    BN_TRY(check_eps(fn, "eps", c->eps));
    BN_TRY(check_eps(fn, "attn_sub_eps", c->attn_sub_eps));
    BN_TRY(check_eps(fn, "ffn_sub_eps", c->ffn_sub_eps));
    BN_CHECK(isfinite(c->theta) && c->theta > 1.0f, "%s: config theta must be finite and > 1, "
             "got %g", fn, (double)c->theta);
    BN_CHECK(isfinite(c->attention_scale) && c->attention_scale >= 0.0f,
             "%s: config attention_scale must be finite and >= 0 (0 for 1/sqrt(D)), got %g", fn,
             (double)c->attention_scale);
    return BITNET_OK;
}

/* The workspace of a checked config. */
static bitnet_status workspace_size(int32_t device, int32_t dtype,
                                    const bitnet_decode_layer_config *c, int64_t *bytes) {
    if (device != BITNET_DEVICE_CPU)
        return BN_CUDA(bn_cuda_decode_layer_workspace_size(device, dtype, c, bytes));
    *bytes = bn_cpu_decode_layer_workspace_size(dtype, c);
    return BITNET_OK;
}

bitnet_status bitnet_decode_layer_workspace_size(int32_t device, int32_t dtype,
                                                 const bitnet_decode_layer_config *config,
                                                 int64_t *bytes) {
    static const char fn[] = "bitnet_decode_layer_workspace_size";
    BN_CHECK(bytes, "%s: bytes is NULL", fn);
    BN_TRY(check_config(fn, device, dtype, config));
    return workspace_size(device, dtype, config, bytes);
}

bitnet_status bitnet_decode_layer(int32_t device, int32_t dtype,
                                  const bitnet_decode_layer_config *config,
                                  const bitnet_decode_layer_weights *weights, void *h,
                                  void *k_cache, void *v_cache, int64_t C,
                                  const int32_t *position, void *workspace,
                                  int64_t workspace_bytes, void *stream) {
    static const char fn[] = "bitnet_decode_layer";
    BN_TRY(check_config(fn, device, dtype, config));
    BN_CHECK(weights, "%s: weights is NULL", fn);
    /* p + 1, attention's sequence length, is an int32: C <= 2^31 - 1 (and with Hkv D <= 65536,
     * C * Hkv * D * 4 stays below 2^49). */
    BN_CHECK(C > 0 && C <= INT32_MAX, "%s: C = %lld must be in [1, 2^31 - 1]", fn, (long long)C);
    BN_CHECK(workspace_bytes >= 0, "%s: workspace_bytes is negative (%lld)", fn,
             (long long)workspace_bytes);
    int64_t needed = 0;
    BN_TRY(workspace_size(device, dtype, config, &needed));
    BN_CHECK(workspace_bytes >= needed,
             "%s: workspace of %lld bytes is too small, this config needs %lld "
             "(bitnet_decode_layer_workspace_size)", fn, (long long)workspace_bytes,
             (long long)needed);

    const bitnet_decode_layer_config *c = config;
    const bitnet_decode_layer_weights *w = weights;
    const int on_gpu = device != BITNET_DEVICE_CPU;
    const int64_t H = c->H, I = c->I, Q = c->Hq * c->D, KV = c->Hkv * c->D;
    const int64_t size = bn_dtype_size(dtype), align = on_gpu ? 16 : size, cache = C * KV * size;
    const bn_array arrays[] = {
        {"weights.qkv.w_packed", w->qkv.w_packed, (Q + 2 * KV) * H / 4, 16, BN_READ},
        {"weights.qkv.w_scales", w->qkv.w_scales, (Q + 2 * KV) * 4, 4, BN_READ},
        {"weights.o.w_packed", w->o.w_packed, H * Q / 4, 16, BN_READ},
        {"weights.o.w_scales", w->o.w_scales, H * 4, 4, BN_READ},
        {"weights.gate_up.w_packed", w->gate_up.w_packed, 2 * I * H / 4, 16, BN_READ},
        {"weights.gate_up.w_scales", w->gate_up.w_scales, 2 * I * 4, 4, BN_READ},
        {"weights.down.w_packed", w->down.w_packed, H * I / 4, 16, BN_READ},
        {"weights.down.w_scales", w->down.w_scales, H * 4, 4, BN_READ},
        {"weights.attn_norm", w->attn_norm, H * size, align, BN_READ},
        {"weights.attn_sub_norm", w->attn_sub_norm, Q * size, align, BN_READ | BN_OPTIONAL},
        {"weights.ffn_norm", w->ffn_norm, H * size, align, BN_READ},
        {"weights.ffn_sub_norm", w->ffn_sub_norm, I * size, align, BN_READ | BN_OPTIONAL},
        {"h", h, H * size, align, BN_WRITTEN},
        {"k_cache", k_cache, cache, align, BN_WRITTEN},
        {"v_cache", v_cache, cache, align, BN_WRITTEN},
        {"position", position, 4, 4, BN_READ},
        {"workspace", workspace, needed, 16, BN_WRITTEN}};
    BN_CHECK_ARRAYS(fn, device, arrays, BN_NO_OVERLAP);
    if (!on_gpu)
        BN_CHECK(*position >= 0 && *position < C, "%s: position = %d is outside [0, C = %lld)", fn,
                 *position, (long long)C);
    return on_gpu ? BN_CUDA(bn_cuda_decode_layer(device, dtype, c, w, h, k_cache, v_cache, C,
                                                 position, workspace, stream))
                  : bn_cpu_decode_layer(dtype, c, w, h, k_cache, v_cache, C, position, workspace);
}
