"""Ternary (1.58-bit) weights and the W2A8 GEMV: quantize_i2s, pack_ternary, quantize_a8 and
gemv_w2a8. The packed layout and the exact rounding rules are in docs/weight_format.md."""
import numbers

import numpy as np

from . import _arrays, _ffi
from ._arrays import CPU, DTYPE_CODES, FLOAT_DTYPES, DeviceArray
from .errors import ArgumentTypeError, InvalidArgumentError

OUT_DTYPES = ("float32", "float16", "bfloat16", "int32")
SCALE_BLOCK = 256  # weights per block scale (TernaryWeights.block_scales)


class TernaryWeights:
    """Packed ternary weights of shape (M, K): ``packed`` is uint8 [M, K/4] (2 bits per weight,
    docs/weight_format.md) and ``scales`` float32 [M], both on ``device`` (-1 for the CPU), of the
    same array kind (numpy, torch, cupy or DeviceArray). The weight matrix they stand for is
    ``unpack() * scales[:, None]``; with ``block_scales`` (float32 [M, K/256], a scale per block
    of 256 weights, as llama.cpp's TQ1_0 and TQ2_0 keep them; K a multiple of 256) it is
    ``unpack() * scales[:, None] * np.repeat(block_scales, 256, axis=1)``, and gemv_w2a8 takes
    the block-scaled kernel (docs/models.md says what that costs)."""

    def __init__(self, packed, scales, block_scales=None):
        arrays, device, _ = _arrays.prepare({"packed": packed, "scales": scales,
                                             "block_scales": block_scales},
                                            optional=("block_scales",))
        pa = _arrays.check(arrays["packed"], "packed", "uint8", (None, None))
        M, K = pa.shape[0], pa.shape[1] * 4
        _arrays.check(arrays["scales"], "scales", "float32", (M,))
        if block_scales is not None:
            if K % SCALE_BLOCK:
                raise InvalidArgumentError(f"block_scales: K = {K} is not a multiple of the "
                                           f"scale block ({SCALE_BLOCK} weights)")
            _arrays.check(arrays["block_scales"], "block_scales", "float32",
                          (M, K // SCALE_BLOCK))
        self.packed, self.scales, self.block_scales = packed, scales, block_scales
        self.shape, self.device = (M, K), device

    def __repr__(self):
        blocks = ", block_scales" if self.block_scales is not None else ""
        return (f"TernaryWeights(shape={self.shape}{blocks}, "
                f"device={_arrays.device_name(self.device)})")

    def unpack(self, stream=None):
        """The ternary values, int8 [M, K] in {-1, 0, 1}, as the same kind of array as ``packed``."""
        arrays, device, handle = _arrays.prepare({"packed": self.packed}, stream)
        pa = arrays["packed"]
        M, K = self.shape
        out = _arrays.new_like(pa, (M, K), "int8")
        _ffi.call("unpack_ternary", device, pa.cptr("uint8_t *"), M, K,
                  _arrays.as_array(out, "out").cptr("int8_t *"), handle)
        return out

    def to(self, device):
        """A copy on `device` ("cpu", "cuda", "cuda:N" or an int; see bitnet_ffi.device.resolve),
        or self if the weights are there already. The copy is explicit and synchronous."""
        from .device import resolve
        target = resolve(device)
        if target == self.device:
            return self
        return TernaryWeights(_copy(self.packed, target), _copy(self.scales, target),
                              None if self.block_scales is None
                              else _copy(self.block_scales, target))


def _host(obj):
    """A numpy copy of a GPU array of any supported kind."""
    kind = _arrays.as_array(obj, "array").kind
    if kind == "numpy":
        return obj
    if kind == "torch":
        return obj.detach().cpu().numpy()
    if kind == "cupy":
        return obj.get()
    if kind == "bitnet":
        return obj.numpy()
    import cupy  # another __cuda_array_interface__ exporter
    return cupy.asarray(obj).get()


def _copy(obj, target):
    """obj copied to `target` (-1 for the CPU): torch tensors stay torch tensors, other GPU
    arrays become numpy or DeviceArray."""
    if _arrays.as_array(obj, "array").kind == "torch":
        return obj.to("cpu" if target == CPU else f"cuda:{target}")
    host = np.ascontiguousarray(_host(obj))
    return host if target == CPU else DeviceArray.from_numpy(host, target)


def _scales_like(reference, scales, M):
    """Per-row float32 scales on the reference array's device from a scalar, a sequence or an
    array; an array already on that device is used as is (after checks)."""
    if isinstance(scales, (numbers.Real, list, tuple)):
        try:
            values = np.asarray(scales, dtype=np.float32)
        except (TypeError, ValueError):
            raise ArgumentTypeError(f"scales: expected numbers, got {scales!r}") from None
        if values.ndim > 1 or values.size not in (1, M):
            raise InvalidArgumentError(f"scales: expected a scalar or {M} values (one per row), "
                                       f"got shape {list(values.shape)}")
        host = np.array(np.broadcast_to(values, (M,)))  # a writable copy
        if reference.device == CPU:
            return host
        if reference.kind == "torch":
            import torch
            return torch.from_numpy(host).to(reference.obj.device)
        return DeviceArray.from_numpy(host, reference.device)
    sa = _arrays.as_array(scales, "scales")
    if sa.device != reference.device:
        raise InvalidArgumentError(f"arrays are on different devices: w_q on "
                                   f"{_arrays.device_name(reference.device)}, scales on "
                                   f"{_arrays.device_name(sa.device)}")
    _arrays.check(sa, "scales", "float32", (M,))
    return scales


def quantize_i2s(w, row_segments=None, stream=None):
    """Ternary quantization of a weight matrix, BitNet b1.58 style (absmean).

    ``scale = mean(|W|)`` over the tensor or over each row segment (float64 sum, float32 result,
    floored at 1e-5); ``W_q = clamp(rint(w / scale), -1, 1)`` in float32 arithmetic. w must be
    finite: a NaN or inf raises InvalidArgumentError naming the first one (on a GPU the check waits
    for the stream).

    Parameters
    ----------
    w : float32, float16 or bfloat16 array [M, K], K a multiple of 128
    row_segments : optional sequence of positive integer row counts summing to M (e.g. the Q, K,
        V blocks of a fused projection), each quantized with its own scale
    stream : optional CUDA stream (default: the framework's current stream)

    Returns
    -------
    TernaryWeights on w's device (packed uint8 [M, K/4], scales float32 [M])
    """
    arrays, device, handle = _arrays.prepare({"w": w}, stream)
    wa = _arrays.check(arrays["w"], "w", FLOAT_DTYPES, (None, None))
    M, K = wa.shape
    segments = _ffi.ffi.NULL
    n_segments = 0
    if row_segments is not None:
        if not isinstance(row_segments, (list, tuple, np.ndarray)):
            raise ArgumentTypeError(f"row_segments must be a sequence of integer row counts, got "
                                    f"{row_segments!r}")
        counts = list(row_segments)
        if not all(isinstance(c, numbers.Integral) for c in counts):  # never truncated
            raise ArgumentTypeError(f"row_segments must be integer row counts, got {counts!r}")
        counts = [int(c) for c in counts]
        if not counts or min(counts) < 1 or sum(counts) != M:
            raise InvalidArgumentError(f"row_segments {counts} must be positive row counts "
                                       f"summing to M = {M}")
        segments, n_segments = _ffi.ffi.new("int64_t[]", counts), len(counts)
    packed = _arrays.new_like(wa, (M, K // 4), "uint8")
    scales = _arrays.new_like(wa, (M,), "float32")
    _ffi.call("quantize_i2s", device, wa.cptr(), DTYPE_CODES[wa.dtype], M, K, segments, n_segments,
              _arrays.as_array(packed, "packed").cptr("uint8_t *"),
              _arrays.as_array(scales, "scales").cptr("float *"), handle)
    return TernaryWeights(packed, scales)


def pack_ternary(w_q, scales, stream=None, *, block_scales=None):
    """Packs ternary values that are already quantized.

    Parameters
    ----------
    w_q : int8 array [M, K] with values in {-1, 0, 1}, K a multiple of 128 (any other value
        raises InvalidArgumentError; on a GPU the check waits for the stream)
    scales : a scalar, or float32 [M] per-row scales on w_q's device
    stream : optional CUDA stream (default: the framework's current stream)
    block_scales : optional float32 [M, K/256] on w_q's device, a scale per 256-weight block on
        top of the row's (see TernaryWeights)

    Returns
    -------
    TernaryWeights on w_q's device
    """
    arrays, device, handle = _arrays.prepare({"w_q": w_q}, stream)
    qa = _arrays.check(arrays["w_q"], "w_q", "int8", (None, None))
    M, K = qa.shape
    scales = _scales_like(qa, scales, M)
    packed = _arrays.new_like(qa, (M, K // 4), "uint8")
    weights = TernaryWeights(packed, scales, block_scales)  # checks block_scales before packing
    _ffi.call("pack_ternary", device, qa.cptr("int8_t *"), M, K,
              _arrays.as_array(packed, "packed").cptr("uint8_t *"), handle)
    return weights


def quantize_a8(x, out=None, stream=None):
    """Per-token absmax int8 quantization of activations.

    ``s = 127 / max(max|x[n]|, 1e-5)``, ``x_q = clamp(rint(x * s), -128, 127)``, in float32.
    A token holding a NaN or inf gets ``s = NaN`` and codes -128, so gemv_w2a8 gives NaN for it.

    Parameters
    ----------
    x : float32, float16 or bfloat16 array [K] or [N, K], K a multiple of 128
    out : optional (x_q, s): int8 of x's shape and float32 [N] ([1] for 1-D x), on x's device

    Returns
    -------
    (x_q, s) : int8 array of x's shape and float32 scales [N] ([1] for 1-D x), on x's device
    """
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 2):
        raise InvalidArgumentError("out: expected a pair (x_q, s)")
    x_q, s = out if out is not None else (None, None)
    arrays, device, handle = _arrays.prepare({"x": x, "x_q": x_q, "s": s}, stream,
                                             writes=("x_q", "s"), optional=("x_q", "s"))
    xa = arrays["x"]
    N, K, lead = _arrays.tokens(xa.shape, "x")
    _arrays.check(xa, "x", FLOAT_DTYPES, (*lead, K))
    if out is None:
        x_q = _arrays.new_like(xa, (*lead, K), "int8")
        s = _arrays.new_like(xa, (N,), "float32")
        arrays["x_q"], arrays["s"] = _arrays.as_array(x_q, "x_q"), _arrays.as_array(s, "s")
    _arrays.check(arrays["x_q"], "x_q", "int8", (*lead, K))
    _arrays.check(arrays["s"], "s", "float32", (N,))
    _ffi.call("quantize_a8", device, xa.cptr(), DTYPE_CODES[xa.dtype], N, K,
              arrays["x_q"].cptr("int8_t *"), arrays["s"].cptr("float *"), handle)
    return x_q, s


def gemv_w2a8(w, x_q, s, out_dtype="float32", out=None, stream=None):
    """Ternary-weight, int8-activation GEMV: ``y[n, m] = dot(x_q[n], W_q[m]) * scales[m] / s[n]``.

    The dot is exact in int32; the scaling is float32, then rounded to out_dtype. "int32" gives
    the raw dot. Weights with block_scales: each 256-weight block's exact dot times its scale,
    summed in float32 (bitnet.h's bitnet_gemv_w2a8_block_scaled states the bound), then as above;
    no "int32".

    Parameters
    ----------
    w : TernaryWeights of shape (M, K)
    x_q : int8 array [K] or [N, K] on w's device (from quantize_a8)
    s : float32 activation scales [N] ([1] or [] for 1-D x_q)
    out_dtype : "float32", "float16", "bfloat16" or "int32"
    out : optional array [N, M] ([M] for 1-D x_q) of out_dtype on w's device

    Returns
    -------
    y : array [N, M] ([M] for 1-D x_q)
    """
    if not isinstance(w, TernaryWeights):
        raise ArgumentTypeError(f"w: expected TernaryWeights (from quantize_i2s or "
                                   f"pack_ternary), got {type(w).__name__}")
    if out_dtype not in OUT_DTYPES:
        raise InvalidArgumentError(f"out_dtype must be one of {', '.join(OUT_DTYPES)}, "
                                   f"got {out_dtype!r}")
    blocked = w.block_scales is not None
    if blocked and out_dtype == "int32":
        raise InvalidArgumentError("out_dtype int32: weights with block_scales have no integer "
                                   "dot; use a float out_dtype")
    arrays, device, handle = _arrays.prepare(
        {"w.packed": w.packed, "w.scales": w.scales, "w.block_scales": w.block_scales,
         "x_q": x_q, "s": s, "out": out}, stream, writes=("out",),
        optional=("out", "w.block_scales"))
    M, K = w.shape
    xa = arrays["x_q"]
    N, _, lead = _arrays.tokens(xa.shape, "x_q")
    _arrays.check(xa, "x_q", "int8", (*lead, K))
    sa = arrays["s"]
    _arrays.check(sa, "s", "float32", sa.shape if not lead and sa.size == 1 else (N,))
    out, ya = _arrays.output(arrays, "out", out, xa, (*lead, M), out_dtype)
    op, block_scales = (("gemv_w2a8_block_scaled", [arrays["w.block_scales"].cptr("float *")])
                        if blocked else ("gemv_w2a8", []))
    _ffi.call(op, device, arrays["w.packed"].cptr("uint8_t *"), arrays["w.scales"].cptr("float *"),
              *block_scales, M, K, xa.cptr("int8_t *"), sa.cptr("float *"), N, ya.cptr(),
              DTYPE_CODES[out_dtype], handle)
    return out


def cpu_isa():
    """The CPU SIMD path the ternary ops and attention use: "portable", "avx2" or "avx512-vnni"
    (attention runs its AVX2 code on that last one)."""
    isa = _ffi.ffi.new("int32_t *")
    _ffi.call("cpu_get_isa", isa)
    return CPU_ISAS[isa[0]]


def set_cpu_isa(name):
    """Forces a CPU SIMD path ("auto", "portable", "avx2", "avx512-vnni"); a path this CPU cannot
    run raises UnsupportedError."""
    if name not in CPU_ISAS:
        raise InvalidArgumentError(f"CPU path must be one of {', '.join(CPU_ISAS)}, got {name!r}")
    _ffi.call("cpu_set_isa", CPU_ISAS.index(name))


CPU_ISAS = ["auto", "portable", "avx2", "avx512-vnni"]
