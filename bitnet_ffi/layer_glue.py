"""The glue of a BitNet layer around attention and the MLP: RoPE fused with the KV-cache append (also
with the QKV projection before it, for one token, or with the attention after it, for a decode
step), and the gate of the gated linear unit (squared ReLU or SiLU)."""
import math
import numbers

import numpy as np

from . import _arrays, _ffi
from ._arrays import DTYPE_CODES, FLOAT_DTYPES
from .attention import attention_scale, attention_workspace_size
from .errors import ArgumentTypeError, InvalidArgumentError, UnsupportedError
from .ternary import TernaryWeights

BITNET_ROPE_THETA = 500000.0


def rope_theta(theta):
    """The RoPE base as a float, checked: finite and > 1."""
    theta = _arrays.number(theta, "theta")
    if not (math.isfinite(theta) and theta > 1):
        raise InvalidArgumentError(f"theta must be finite and > 1, got {theta}")
    return theta


def rope_append_kv(qkv, k_cache, v_cache, positions, theta=BITNET_ROPE_THETA, out=None,
                   stream=None):
    """RoPE (rotate-half, Llama/HF convention) on the output of a fused QKV projection, appending
    the keys and values to the KV cache; returns the rotated queries.

    Each token's row of ``qkv`` holds Hq query heads, then Hkv key heads, then Hkv value heads (the
    order of a model's fused QKV weights). Token s of sequence b sits at position
    ``p = positions[b] + s``. In every q and k head, each pair ``(x[i], x[i + D/2])``, ``i < D/2``,
    turns by the angle ``p * theta ** (-2 i / D)``::

        x'[i] = x[i] cos - x[i + D/2] sin,    x'[i + D/2] = x[i + D/2] cos + x[i] sin

    then ``out[b, s] = rotated q heads``, ``k_cache[b, p] = rotated k heads`` and
    ``v_cache[b, p] = v heads``. Angles, cos and sin are computed in float64 (both backends), the
    rotation in float32.

    Parameters
    ----------
    qkv : array [B, S, Hq + 2 Hkv, D]
    k_cache, v_cache : arrays [B, C, Hkv, D], rows positions[b] .. positions[b] + S - 1 written
    positions : sequence of int, or int32 array [B] on qkv's device
        Host values are checked (0 <= positions[b] <= C - S) and uploaded explicitly for a GPU op
        (a synchronous copy; pass a device array to stay asynchronous). For a device array the
        host cannot check: a GPU sequence out of range is skipped (its out and cache rows
        untouched).
    theta : float
        RoPE base (BitNet b1.58 uses 500000).
    out : array [B, S, Hq, D], optional

    Returns
    -------
    out
    """
    arrays, device, handle = _arrays.prepare(
        {"qkv": qkv, "k_cache": k_cache, "v_cache": v_cache, "out": out}, stream,
        writes=("k_cache", "v_cache", "out"), optional=("out",))
    qkva, kc, (B, S, Hq, Hkv, D, C) = _qkv_and_caches(arrays)
    theta = rope_theta(theta)
    out, oa = _arrays.output(arrays, "out", out, qkva, (B, S, Hq, D), qkva.dtype)
    pos = _positions(positions, qkva, B, S, C)
    _ffi.call("rope_append_kv", device, DTYPE_CODES[qkva.dtype], B, S, Hq, Hkv, D, qkva.cptr(),
              oa.cptr(), kc.cptr(), arrays["v_cache"].cptr(), C, pos.cptr("int32_t *"),
              float(theta), handle)
    return out


def attention_rope_append_kv(qkv, k_cache, v_cache, positions, theta=BITNET_ROPE_THETA,
                             scale=None, out=None, workspace=None, stream=None):
    """Attention of a decode step with RoPE and the KV-cache append: the values of
    ``attention(rope_append_kv(qkv, k_cache, v_cache, positions, theta), k_cache, v_cache,
    causal=True, scale=scale, seq_lens=positions + 1)`` without the rotated q in between (on a
    GPU one kernel). One new token per sequence.

    Parameters
    ----------
    qkv : array [B, 1, Hq + 2 Hkv, D]
        Each sequence's new token: Hq query heads, then Hkv key heads, then Hkv value heads.
        float16 or bfloat16 (float32 too on the CPU); D is 64, 128 or 256; on a GPU at most 64
        query heads per KV head.
    k_cache, v_cache : arrays [B, C, Hkv, D]
        Row ``positions[b]`` of sequence b is written (rotated k, v), then keys
        ``0 .. positions[b]`` are attended to.
    positions : sequence of int, or int32 array [B] on qkv's device
        Host values are checked (0 <= positions[b] < C) and uploaded explicitly for a GPU op
        (a synchronous copy; pass a device array to stay asynchronous). For a device array the
        host cannot check: on a GPU a sequence out of range gets NaN outputs and its cache rows
        are left as they were.
    theta : float
        RoPE base (BitNet b1.58 uses 500000).
    scale : float, optional
        Defaults to 1 / sqrt(D).
    out : array [B, 1, Hq, D], optional
    workspace : uint8 array on qkv's device, optional
        Split-KV scratch of ``attention_workspace_size(device, B, 1, Hq, Hkv, D, C)`` bytes;
        allocated per call when None and needed. Pass one to make the call allocation-free (CUDA
        graphs).
    stream : optional
        CUDA stream; by default the current stream of qkv's framework.

    Returns
    -------
    out
    """
    arrays, device, handle = _arrays.prepare(
        {"qkv": qkv, "k_cache": k_cache, "v_cache": v_cache, "out": out, "workspace": workspace},
        stream, writes=("k_cache", "v_cache", "out", "workspace"), optional=("out", "workspace"))
    qkva, kc, (B, S, Hq, Hkv, D, C) = _qkv_and_caches(arrays)
    if S != 1:
        raise InvalidArgumentError(f"qkv holds {S} tokens per sequence; attention_rope_append_kv "
                                   "takes one (a decode step)")
    theta = rope_theta(theta)
    scale = attention_scale(scale)
    out, oa = _arrays.output(arrays, "out", out, qkva, (B, 1, Hq, D), qkva.dtype)
    pos = _positions(positions, qkva, B, 1, C)
    wsa = arrays["workspace"]
    if wsa is None:  # a given one's size is checked by the C call
        ws_bytes = attention_workspace_size(device, B, 1, Hq, Hkv, D, C)
        if ws_bytes:
            wsa = _arrays.as_array(_arrays.new_like(qkva, (ws_bytes,), "uint8"), "workspace")
    ffi = _ffi.ffi
    _ffi.call("attention_rope_append_kv", device, DTYPE_CODES[qkva.dtype], B, Hq, Hkv, D,
              qkva.cptr(), kc.cptr(), arrays["v_cache"].cptr(), C, pos.cptr("int32_t *"),
              float(theta), scale, oa.cptr(), ffi.NULL if wsa is None else wsa.cptr(),
              0 if wsa is None else wsa.size * _arrays.ITEMSIZE[wsa.dtype], handle)
    return out


def _qkv_and_caches(arrays):
    """qkv [B, S, Hq + 2 Hkv, D] and the caches [B, C, Hkv, D], checked; (B, S, Hq, Hkv, D, C)."""
    qkva = _arrays.check(arrays["qkv"], "qkv", FLOAT_DTYPES, (None, None, None, None))
    B, S, heads, D = qkva.shape
    kc = _arrays.check(arrays["k_cache"], "k_cache", qkva.dtype, (B, None, None, D))
    C, Hkv = kc.shape[1], kc.shape[2]
    _arrays.check(arrays["v_cache"], "v_cache", qkva.dtype, (B, C, Hkv, D))
    Hq = heads - 2 * Hkv
    if Hq < 1:
        raise InvalidArgumentError(f"qkv: {heads} heads per token leave no query heads beside "
                                   f"2 x {Hkv} key and value heads (the caches' head count)")
    return qkva, kc, (B, S, Hq, Hkv, D, C)


def _positions(positions, qkva, B, S, C):
    """positions as an int32 Array on qkv's device: host values checked (S new tokens fit)."""
    def check_range(host):
        bad = np.flatnonzero((host < 0) | (host > C - S))
        if bad.size:
            raise InvalidArgumentError(f"positions[{bad[0]}] = {host[bad[0]]}: {S} new tokens do "
                                       f"not fit a cache of C = {C}")

    return _arrays.int32_per_row(positions, "positions", B, qkva, check_range)


def gemv_w2a8_rope_append_kv(w, x_q, s, k_cache, v_cache, position, theta=BITNET_ROPE_THETA,
                             out=None, stream=None):
    """The fused QKV projection of one token with RoPE and the KV-cache append: the values of
    ``rope_append_kv(gemv_w2a8(w, x_q, s, out_dtype=k_cache's dtype)[None, None], k_cache,
    v_cache, [position], theta)`` without the qkv row in between (on a GPU one kernel). For a
    decode step of one sequence.

    Parameters
    ----------
    w : TernaryWeights [(Hq + 2 Hkv) D, K], without block_scales
    x_q : int8 array [1, K] (from quantize_a8)
    s : float32 array [1], its scale
    k_cache, v_cache : arrays [1, C, Hkv, D] (float16 or bfloat16 on a GPU), D % 4 == 0; row
        ``position`` is written
    position : int (checked, 0 <= position < C, and uploaded for a GPU op), or an int32 array [1]
        on the caches' device (not checked: on a GPU a position out of range writes nothing)
    theta : float, the RoPE base
    out : array [1, 1, Hq, D] of the caches' dtype, optional: the rotated queries

    Returns
    -------
    out
    """
    if not isinstance(w, TernaryWeights):
        raise ArgumentTypeError(f"w: expected TernaryWeights, got {type(w).__name__}")
    if w.block_scales is not None:
        raise UnsupportedError("gemv_w2a8_rope_append_kv: weights with block_scales take "
                               "gemv_w2a8 and rope_append_kv")
    arrays, device, handle = _arrays.prepare(
        {"w.packed": w.packed, "w.scales": w.scales, "x_q": x_q, "s": s, "k_cache": k_cache,
         "v_cache": v_cache, "out": out}, stream, writes=("k_cache", "v_cache", "out"),
        optional=("out",))
    M, K = w.shape
    xa = _arrays.check(arrays["x_q"], "x_q", "int8", (1, K))
    sa = _arrays.check(arrays["s"], "s", "float32", (1,))
    theta = rope_theta(theta)
    kc, heads, out, oa, pos = qkv_rope_arrays(arrays, M, FLOAT_DTYPES, out, position)
    _ffi.call("gemv_w2a8_rope_append_kv", device, DTYPE_CODES[kc.dtype],
              arrays["w.packed"].cptr("uint8_t *"), arrays["w.scales"].cptr("float *"), K,
              xa.cptr("int8_t *"), sa.cptr("float *"), *heads, oa.cptr(), kc.cptr(),
              arrays["v_cache"].cptr(), kc.shape[1], pos.cptr("int32_t *"), float(theta),
              handle)
    return out


def qkv_rope_arrays(arrays, M, dtypes, out, position):
    """The checked caches of a fused QKV + RoPE op over M weight rows: (k_cache's Array, (Hq, Hkv,
    D), out, out's Array, the position as an int32 array [1] on the caches' device)."""
    kc = _arrays.check(arrays["k_cache"], "k_cache", dtypes, (1, None, None, None))
    _, C, Hkv, D = kc.shape
    _arrays.check(arrays["v_cache"], "v_cache", kc.dtype, (1, C, Hkv, D))
    if M % D or M // D <= 2 * Hkv:
        raise InvalidArgumentError(f"w: {M} rows are not Hq + 2 x {Hkv} heads of D = {D} (the "
                                   "caches' head count and size) with Hq >= 1")
    Hq = M // D - 2 * Hkv

    def check_range(host):
        if not 0 <= host[0] < C:
            raise InvalidArgumentError(f"position = {host[0]} is outside the cache of C = {C}")

    out, oa = _arrays.output(arrays, "out", out, kc, (1, 1, Hq, D), kc.dtype)
    positions = [position] if isinstance(position, numbers.Integral) else position
    pos = _arrays.int32_per_row(positions, "position", 1, kc, check_range)
    return kc, (Hq, Hkv, D), out, oa, pos


ACTIVATIONS = {"relu2": 0, "silu": 1}  # bitnet_activation


def activation_code(activation):
    """The bitnet_activation of "relu2" or "silu"."""
    if activation not in ACTIVATIONS:
        raise InvalidArgumentError(f"activation must be 'relu2' or 'silu', got {activation!r}")
    return ACTIVATIONS[activation]


def glu_gate(gate_up, activation="relu2", out=None, stream=None):
    """Gate of a gated linear unit on the fused gate|up projection, in float32::

        out[..., f] = act(gate_up[..., f]) * gate_up[..., F + f]
        relu2: act(g) = max(g, 0) ** 2          silu: act(g) = g / (1 + exp(-g))

    then rounded to the dtype. SiLU is computed as ``g / (1 + expf(-g)) * u`` in float32: within
    about 4 ulp of float32 (relative 5e-7) of the float64 value before that rounding (expf within
    2 ulp, three roundings), or 1e-37 absolute where exp(-g) overflows (g < -88); the CPU and GPU
    may differ by an ulp of float32, so by one step of float16 or bfloat16 at rounding ties.

    Parameters
    ----------
    gate_up : array [..., 2F]
        float16 or bfloat16 (float32 too on the CPU): the gate in the first F columns, up in the
        last F.
    activation : "relu2" or "silu"
    out : array [..., F], optional
    stream : CUDA stream, optional

    Returns
    -------
    out
    """
    code = activation_code(activation)
    arrays, device, handle = _arrays.prepare({"gate_up": gate_up, "out": out}, stream,
                                             writes=("out",), optional=("out",))
    ga = arrays["gate_up"]
    if len(ga.shape) == 0 or ga.shape[-1] % 2:
        raise InvalidArgumentError(f"gate_up: expected shape [..., 2F], got {list(ga.shape)}")
    _arrays.check(ga, "gate_up", FLOAT_DTYPES, (None,) * len(ga.shape))
    F = ga.shape[-1] // 2
    shape = ga.shape[:-1] + (F,)
    T = math.prod(ga.shape[:-1])
    out, outa = _arrays.output(arrays, "out", out, ga, shape, ga.dtype)
    _ffi.call("glu_gate", device, DTYPE_CODES[ga.dtype], T, F, code, ga.cptr(), outa.cptr(),
              handle)
    return out


def relu2_gate(gate_up, out=None, stream=None):
    """Squared-ReLU gate: ``glu_gate(gate_up, "relu2", out, stream)``, that is
    ``out[..., f] = max(gate_up[..., f], 0) ** 2 * gate_up[..., F + f]`` in float32."""
    return glu_gate(gate_up, "relu2", out, stream)
