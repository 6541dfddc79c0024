/* CPU bitnet_decode_layer: the unfused decode step of one layer for one token, op by op, through
 * the CPU backend functions the public ops call, so that its values are theirs bit for bit. The
 * intermediates live in the workspace, each at a 64-byte boundary (layout_of). The last residual
 * add, which the model runtime leaves to the next layer's norm, is the rmsnorm residual add's
 * arithmetic: float32 sum, rounded once to the dtype. */
#include <math.h>

#include "../internal.h"

typedef struct {
    int64_t qkv, q, attn, proj, gate_up, x_q, x_s, bytes; /* offsets into the workspace, its size */
} layout;

static int64_t take(int64_t *end, int64_t bytes) {
    int64_t at = *end;
    *end += (bytes + 63) / 64 * 64;
    return at;
}

/* dtype [Q + 2 KV] qkv, [Q] q, [Q] attention output, [H] projection output (o, then down),
 * [2 I] gate|up, int8 codes of the widest GEMV input, their float32 scale. */
static layout layout_of(int32_t dtype, const bitnet_decode_layer_config *c) {
    const int64_t size = bn_dtype_size(dtype), Q = c->Hq * c->D, KV = c->Hkv * c->D;
    const int64_t widest = c->H > c->I ? (c->H > Q ? c->H : Q) : (c->I > Q ? c->I : Q);
    layout l;
    l.bytes = 0;
    l.qkv = take(&l.bytes, (Q + 2 * KV) * size);
    l.q = take(&l.bytes, Q * size);
    l.attn = take(&l.bytes, Q * size);
    l.proj = take(&l.bytes, c->H * size);
    l.gate_up = take(&l.bytes, 2 * c->I * size);
    l.x_q = take(&l.bytes, widest);
    l.x_s = take(&l.bytes, (int64_t)sizeof(float));
    return l;
}

int64_t bn_cpu_decode_layer_workspace_size(int32_t dtype, const bitnet_decode_layer_config *c) {
    return layout_of(dtype, c).bytes;
}

/* The codes of x [n] for the next GEMV: rmsnorm_quantize with a weight, quantize_a8 without. */
static bitnet_status norm_quantize(int32_t dtype, int64_t n, const void *x, const void *weight,
                                   float eps, int8_t *x_q, float *x_s) {
    return weight ? bn_cpu_rmsnorm(dtype, 1, n, x, NULL, weight, eps, NULL, x_q, x_s)
                  : bn_cpu_quantize_a8(x, dtype, 1, n, x_q, x_s);
}

/* h += x, as bn_cpu_rmsnorm adds its residual: float32, one rounding to the dtype. */
static void add_residual(int32_t dtype, int64_t n, const void *x, void *h) {
    enum { CHUNK = 256 };
    float a[CHUNK], b[CHUNK];
    for (int64_t c = 0; c < n; c += CHUNK) {
        const int64_t m = n - c < CHUNK ? n - c : CHUNK;
        bn_load_floats(dtype, x, c, m, a);
        bn_load_floats(dtype, h, c, m, b);
        for (int64_t i = 0; i < m; i++) b[i] += a[i];
        bn_store_floats(dtype, b, m, h, c);
    }
}

bitnet_status bn_cpu_decode_layer(int32_t dtype, const bitnet_decode_layer_config *c,
                                  const bitnet_decode_layer_weights *w, void *h, void *k_cache,
                                  void *v_cache, int64_t C, const int32_t *position,
                                  void *workspace) {
    const layout l = layout_of(dtype, c);
    char *ws = workspace;
    void *qkv = ws + l.qkv, *q = ws + l.q, *attn = ws + l.attn, *proj = ws + l.proj;
    void *gate_up = ws + l.gate_up;
    int8_t *x_q = (int8_t *)(ws + l.x_q);
    float *x_s = (float *)(ws + l.x_s);
    const int64_t H = c->H, I = c->I, Q = c->Hq * c->D, KV = c->Hkv * c->D;
    const int32_t seq_len = *position + 1;
    const float scale = c->attention_scale == 0.0f ? 1.0f / sqrtf((float)c->D) : c->attention_scale;

    /* attention block: h += o(sub_norm(attention(rope(qkv(norm(h)))))) */
    BN_TRY(bn_cpu_rmsnorm(dtype, 1, H, h, NULL, w->attn_norm, c->eps, NULL, x_q, x_s));
    BN_TRY(bn_cpu_gemv_w2a8(w->qkv.w_packed, w->qkv.w_scales, Q + 2 * KV, H, x_q, x_s, 1, qkv,
                            dtype));
    BN_TRY(bn_cpu_rope_append_kv(dtype, 1, 1, c->Hq, c->Hkv, c->D, qkv, q, k_cache, v_cache, C,
                                 position, c->theta));
    BN_TRY(bn_cpu_attention(dtype, 1, 1, c->Hq, c->Hkv, c->D, q, k_cache, v_cache, C, &seq_len, 1,
                            scale, attn));
    BN_TRY(norm_quantize(dtype, Q, attn, w->attn_sub_norm, c->attn_sub_eps, x_q, x_s));
    BN_TRY(bn_cpu_gemv_w2a8(w->o.w_packed, w->o.w_scales, H, Q, x_q, x_s, 1, proj, dtype));
    /* FFN block: h += down(sub_norm(act(gate) * up)), its input norm fused with the add above */
    BN_TRY(bn_cpu_rmsnorm(dtype, 1, H, proj, h, w->ffn_norm, c->eps, NULL, x_q, x_s));
    BN_TRY(bn_cpu_gemv_w2a8(w->gate_up.w_packed, w->gate_up.w_scales, 2 * I, H, x_q, x_s, 1,
                            gate_up, dtype));
    BN_TRY(bn_cpu_glu_rmsnorm(dtype, 1, I, c->activation, gate_up, w->ffn_sub_norm,
                              c->ffn_sub_eps, NULL, x_q, x_s));
    BN_TRY(bn_cpu_gemv_w2a8(w->down.w_packed, w->down.w_scales, H, I, x_q, x_s, 1, proj, dtype));
    add_residual(dtype, H, proj, h);
    return BITNET_OK;
}
