"""Padded layouts: a checkpoint whose head dimension is not one that attention runs (64, 128, 256)
or whose intermediate size is not a multiple of 128 (the GEMV's K) runs with zeros added, and
computes what the checkpoint does (1bitLLM's bitnet_b1_58-large: head dim 96; -3B: head dim 100,
intermediate 8640).

- Each head of D dimensions becomes one of Dp (the next of 64, 128, 256): its first half at
  0 .. D/2 - 1, its second half at Dp/2 .. Dp/2 + D/2 - 1, zeros elsewhere (zero rows in q, k and
  v). Rotate-half RoPE then pairs the same dimensions, and RoPE with theta ** (Dp / D) over Dp
  turns each pair by the angle theta ** (-2i / D) of the checkpoint. q . k sums no more than the
  real dimensions; attention's scale stays 1/sqrt(D); o takes zero columns at the padding.
- The intermediate I becomes Ip (a multiple of 128): zero rows in gate and up (act(0) * 0 = 0) and
  zero columns in down.
- A sub-norm over the padded width (n_pad instead of n values) divides the same sum of squares by
  n_pad: with eps * n / n_pad its RMS is the real one times sqrt(n / n_pad), and the int8 codes
  after it do not change (absmax scaling), only their scale. The next projection's row scales
  (o's, down's) take the factor sqrt(n / n_pad) that undoes it.

Costs: the padded KV cache, attention and q/k/v rows (Dp / D: 1.28x for head dim 100), and the
padded FFN columns (Ip / I: 1.007x for 8640)."""
import dataclasses

import numpy as np

from .errors import UnsupportedError
from .ternary import TernaryWeights, pack_ternary, quantize_i2s

ATTENTION_HEAD_DIMS = (64, 128, 256)
GEMV_K_MULTIPLE = 128
ZERO_CODES = 0x55  # a byte of four 2-bit codes 1: four zero weights (docs/weight_format.md)


def padded_config(config, head_dim=None, intermediate=None):
    """The config the runtime runs `config` in: itself when nothing needs padding. head_dim and
    intermediate choose other padded sizes than the smallest that run."""
    D, I = config.head_dim, config.intermediate
    Dp = head_dim or next(d for d in ATTENTION_HEAD_DIMS if d >= D)
    Ip = intermediate or -(-I // GEMV_K_MULTIPLE) * GEMV_K_MULTIPLE
    if (Dp, Ip) == (D, I):
        return config
    return dataclasses.replace(config, head_dim=Dp, intermediate=Ip,
                               theta=config.theta ** (Dp / D), padded_from=(D, I))


def head_slots(heads, D, Dp):
    """Index in the padded layout of each of `heads` heads' D dimensions."""
    i = np.arange(D)
    within = np.where(i < D // 2, i, i - D // 2 + Dp // 2)
    return (np.arange(heads)[:, None] * Dp + within).reshape(-1)


def pad_layer(layer, config, padded):
    """A Layer of host arrays (numpy TernaryWeights and norms) of `config` laid out for `padded`
    (padded_config(config))."""
    D, Dp, I, Ip = config.head_dim, padded.head_dim, config.intermediate, padded.intermediate
    q, kv = head_slots(config.heads, D, Dp), head_slots(config.kv_heads, D, Dp)
    qkv_rows = np.concatenate([q, padded.q_dim + kv, padded.q_dim + padded.kv_dim + kv])
    gate_up_rows = np.concatenate([np.arange(I), Ip + np.arange(I)])
    attn_factor = np.sqrt(D / Dp) if config.sub_norms else 1.0
    ffn_factor = np.sqrt(I / Ip) if config.sub_norms else 1.0
    return dataclasses.replace(
        layer,
        qkv=_rows(layer.qkv, qkv_rows, padded.q_dim + 2 * padded.kv_dim),
        o=_columns(layer.o, q, padded.q_dim, attn_factor),
        gate_up=_rows(layer.gate_up, gate_up_rows, 2 * Ip),
        down=_columns(layer.down, np.arange(I), Ip, ffn_factor),
        attn_sub_norm=_spread(layer.attn_sub_norm, q, padded.q_dim),
        ffn_sub_norm=_spread(layer.ffn_sub_norm, np.arange(I), Ip))


def _rows(w, slots, rows):
    """w's rows at `slots` of a matrix of `rows` rows, zero weights elsewhere."""
    packed = np.full((rows, w.packed.shape[1]), ZERO_CODES, np.uint8)
    scales = np.zeros(rows, np.float32)
    packed[slots], scales[slots] = w.packed, w.scales
    if w.block_scales is None:
        return TernaryWeights(packed, scales)
    block_scales = np.zeros((rows, w.block_scales.shape[1]), np.float32)
    block_scales[slots] = w.block_scales
    return TernaryWeights(packed, scales, block_scales)


def _columns(w, slots, cols, factor):
    """w's columns at `slots` of a matrix of `cols` columns, zero weights elsewhere; the row
    scales times `factor`."""
    if w.block_scales is not None:
        raise UnsupportedError(f"a padded layout ({w.shape[1]} columns spread over {cols}) of "
                               "weights with block scales (TQ1_0, TQ2_0) is not supported")
    scales = (w.scales * np.float32(factor)).astype(np.float32)
    if np.array_equal(slots, np.arange(w.shape[1])):  # appended columns: whole groups of 16
        extra = np.full((w.shape[0], (cols - w.shape[1]) // 4), ZERO_CODES, np.uint8)
        return TernaryWeights(np.concatenate([w.packed, extra], axis=1), scales)
    codes = np.zeros((w.shape[0], cols), np.int8)
    codes[:, slots] = w.unpack()
    return pack_ternary(codes, scales)


def _spread(weight, slots, width):
    if weight is None:
        return None
    out = np.zeros(width, weight.dtype)
    out[slots] = weight
    return out


def flat_ternary(matrix, scale=None):
    """TernaryWeights [M, K] of a host matrix whose K is a multiple of 16 but maybe not of 128,
    which the ops need: int8 codes packed with one `scale`, or float weights quantized with one
    absmean (scale None). The packed layout groups 16 weights, so the matrix flattened into rows of
    128 (M K a multiple of 128) packs to the same bytes."""
    M, K = matrix.shape
    flat = np.ascontiguousarray(matrix).reshape(-1, GEMV_K_MULTIPLE)
    w = quantize_i2s(flat) if scale is None else pack_ternary(flat, scale)
    return TernaryWeights(w.packed.reshape(M, K // 4), np.full(M, w.scales[0], np.float32))
