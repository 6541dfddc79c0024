"""RMSNorm and its fused variants: the residual add or the gate of a GLU before it and the int8
quantization after it (docs/rmsnorm.md), and the half of it that one rank of a tensor-parallel
model runs on its slice of a row (rmsnorm_partial). Every function runs one C call."""
import math

from . import _arrays, _ffi
from ._arrays import DTYPE_CODES, FLOAT_DTYPES
from .errors import InvalidArgumentError
from .layer_glue import activation_code


def rmsnorm(x, weight, eps=1e-5, out=None, stream=None):
    """RMSNorm over the last dimension, accumulated in float32::

        y = x / sqrt(mean(x ** 2, axis=-1) + eps) * weight

    Parameters
    ----------
    x : array [..., H], float32, float16 or bfloat16
    weight : array [H], the dtype of x
    eps : float, finite and >= 0. On a GPU, eps = 0 takes a slower two-pass kernel (1.2x, or
        1.5x with the int8 codes, at T = 4096), the one that handles rows whose RMS is under
        2^-128 (docs/rmsnorm.md).
    out : array [..., H] of x's dtype, optional (may be x itself: in place)
    stream : CUDA stream, optional (default: the current stream of x's framework)

    Returns
    -------
    y : array [..., H], out if given
    """
    return _rmsnorm(x, weight, eps, None, out, False, None, stream)[0]


def add_rmsnorm(x, residual, weight, eps=1e-5, out=None, stream=None):
    """The residual add fused with the RMSNorm of its result::

        residual += x            (in place, rounded to the dtype as stored)
        y = rmsnorm(residual, weight, eps)

    y equals rmsnorm() of the stored residual.

    Parameters
    ----------
    x : array [..., H], float32, float16 or bfloat16
    residual : array of x's shape and dtype, updated in place
    weight : array [H], the dtype of x
    eps : float, finite and >= 0
    out : array [..., H] of x's dtype, optional
    stream : CUDA stream, optional

    Returns
    -------
    y : array [..., H], out if given
    """
    return _rmsnorm(x, weight, eps, residual, out, False, None, stream)[0]


def rmsnorm_quantize(x, weight, eps=1e-5, residual=None, out=None, y_out=None, stream=None):
    """RMSNorm fused with per-token int8 quantization (the quantize_a8 rule), reading x once::

        y = rmsnorm(x, weight, eps)                      (float32, not rounded to x's dtype)
        scales = 127 / max(max(|y|, axis=-1), 1e-5)      (float32)
        y_q = clip(rint(y * scales[..., None]), -128, 127)

    With ``residual``, first ``residual += x`` in place and the stored residual is normalized. A row
    with a y that is not finite (a NaN or inf input) gets the scale NaN and codes -128.

    Parameters
    ----------
    x : array [..., H], float32, float16 or bfloat16
    weight : array [H], the dtype of x
    eps : float, finite and >= 0
    residual : array of x's shape and dtype, optional, updated in place
    out : (y_q, scales) with y_q int8 [..., H] and scales float32 [...], optional
    y_out : array [..., H] of x's dtype, optional: also write y there (rounded to x's dtype)
    stream : CUDA stream, optional

    Returns
    -------
    (y_q, scales)
    """
    y_q, scales = _quantized_pair(out)
    _, y_q, scales = _rmsnorm(x, weight, eps, residual, y_out, True, (y_q, scales), stream)
    return y_q, scales


def glu_rmsnorm_quantize(gate_up, weight, activation="relu2", eps=1e-5, out=None, y_out=None,
                         stream=None):
    """The gate of a GLU fused with rmsnorm_quantize of its result, reading gate_up once::

        v = glu_gate(gate_up, activation)                (float32, rounded to gate_up's dtype)
        y = rmsnorm(v, weight, eps)                      (float32, not rounded)
        scales = 127 / max(max(|y|, axis=-1), 1e-5)      (float32)
        y_q = clip(rint(y * scales[..., None]), -128, 127)

    Bit for bit what glu_gate() followed by rmsnorm_quantize() gives on the same device, without
    writing v. With ``weight=None`` there is no norm: y = v, and (y_q, scales) are quantize_a8(v),
    bit for bit (models without a sub-norm before down_proj). Unlike glu_gate, float32 runs on a
    GPU too.

    Parameters
    ----------
    gate_up : array [..., 2F], float32, float16 or bfloat16: the gate in the first F columns, up in
        the last F
    weight : array [F] of gate_up's dtype, or None (no norm)
    activation : "relu2" or "silu" (glu_gate)
    eps : float, finite and >= 0 (unused without a weight)
    out : (y_q, scales) with y_q int8 [..., F] and scales float32 [...], optional
    y_out : array [..., F] of gate_up's dtype, optional: also write y there (rounded to the dtype)
    stream : CUDA stream, optional

    Returns
    -------
    (y_q, scales)
    """
    code = activation_code(activation)
    y_q, scales = _quantized_pair(out)
    _, y_q, scales = _rmsnorm(gate_up, weight, eps, None, y_out, True, (y_q, scales), stream,
                              gate=code)
    return y_q, scales


def relu2_rmsnorm_quantize(gate_up, weight, eps=1e-5, out=None, y_out=None, stream=None):
    """``glu_rmsnorm_quantize(gate_up, weight, "relu2", eps, out, y_out, stream)``: the
    squared-ReLU gate, ``v = max(g, 0) ** 2 * u``, fused with rmsnorm_quantize of v."""
    if weight is None:
        raise InvalidArgumentError("weight: expected an array [F], got None "
                                   "(glu_rmsnorm_quantize takes None: no norm)")
    return glu_rmsnorm_quantize(gate_up, weight, "relu2", eps, out, y_out, stream)


def rmsnorm_partial(x, weight, out=None, sumsq=None, stream=None):
    """One rank's half of an RMSNorm whose rows are split across ranks (tensor parallelism: x is
    this rank's slice of each row, weight the same slice of the norm's weight), fused with the
    per-token int8 quantization, for a row-parallel projection after it::

        p = x * weight                                   (float32, not divided by the RMS)
        scales = 127 / max(max(|p|, axis=-1), 1e-5)      (float32)
        y_q = clip(rint(p * scales[..., None]), -128, 127)
        sumsq = sum(x ** 2, axis=-1)                     (float32)

    The ranks' projections of the codes, summed, divided by ``sqrt(sum of the ranks' sumsq /
    width + eps)`` (width: the whole row's), give the projection of the whole row's RMSNorm:
    comm's ``all_reduce_rms`` does that. Each rank's scale comes from its own slice's max, so its
    codes are at least as fine as one scale for the whole row.

    Parameters
    ----------
    x : array [..., H], float32, float16 or bfloat16
    weight : array [H], the dtype of x
    out : (y_q, scales) with y_q int8 [..., H] and scales float32 [...], optional
    sumsq : float32 array [...], optional
    stream : CUDA stream, optional

    Returns
    -------
    (y_q, scales, sumsq)
    """
    return _partial(x, weight, None, out, sumsq, stream)


def glu_rmsnorm_partial(gate_up, weight, activation="relu2", out=None, sumsq=None, stream=None):
    """rmsnorm_partial of ``v = glu_gate(gate_up, activation)`` (rounded to gate_up's dtype, as
    glu_rmsnorm_quantize computes it), reading gate_up [..., 2F] once: this rank's slice of the
    FFN's gated activations before a row-parallel down projection. weight: [F]. Returns
    (y_q [..., F], scales, sumsq)."""
    return _partial(gate_up, weight, activation_code(activation), out, sumsq, stream)


def _partial(x, weight, gate, out, sumsq, stream):
    """The one bitnet_rmsnorm_partial or bitnet_glu_rmsnorm_partial call."""
    gated = gate is not None
    y_q, scales = _quantized_pair(out)
    name = "gate_up" if gated else "x"
    arrays, device, handle = _arrays.prepare(
        {name: x, "weight": weight, "y_q": y_q, "scales": scales, "sumsq": sumsq}, stream,
        writes=("y_q", "scales", "sumsq"), optional=("y_q", "scales", "sumsq"))
    xa = arrays[name]
    if len(xa.shape) == 0 or (gated and xa.shape[-1] % 2):
        raise InvalidArgumentError(f"{name}: expected an array [..., {'2F' if gated else 'H'}], "
                                   f"got {list(xa.shape)}")
    _arrays.check(xa, name, FLOAT_DTYPES, xa.shape)
    H, T = xa.shape[-1] // (2 if gated else 1), math.prod(xa.shape[:-1])
    _arrays.check(arrays["weight"], "weight", xa.dtype, (H,))
    rows = xa.shape[:-1]
    y_q, qa = _arrays.output(arrays, "y_q", y_q, xa, rows + (H,), "int8")
    scales, sa = _arrays.output(arrays, "scales", scales, xa, rows, "float32")
    sumsq, ssa = _arrays.output(arrays, "sumsq", sumsq, xa, rows, "float32")
    tail = (arrays["weight"].cptr(), qa.cptr("int8_t *"), sa.cptr("float *"), ssa.cptr("float *"),
            handle)
    if gated:
        _ffi.call("glu_rmsnorm_partial", device, DTYPE_CODES[xa.dtype], T, H, gate, xa.cptr(), *tail)
    else:
        _ffi.call("rmsnorm_partial", device, DTYPE_CODES[xa.dtype], T, H, xa.cptr(), *tail)
    return y_q, scales, sumsq


def _quantized_pair(out):
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 2):
        raise InvalidArgumentError("out: expected a pair (y_q, scales)")
    return out if out is not None else (None, None)


def _rmsnorm(x, weight, eps, residual, y, quantize, quantized, stream, gate=None):
    """The one C call: returns (y, y_q, scales), None for what was not asked for. With a gate (a
    bitnet_activation), x is gate_up [..., 2F] (no residual), the outputs are [..., F] and weight
    may be None: bitnet_glu_rmsnorm."""
    gated = gate is not None
    y_q, scales = quantized if quantize else (None, None)
    name = "gate_up" if gated else "x"
    y_name = "y_out" if quantize else "out"  # the parameter y comes from
    arrays, device, handle = _arrays.prepare(
        {name: x, "weight": weight, "residual": residual, y_name: y, "y_q": y_q, "scales": scales},
        stream, writes=("residual", y_name, "y_q", "scales"),
        optional=("residual", y_name, "y_q", "scales") + (("weight",) if gated else ()))
    xa = arrays[name]
    if len(xa.shape) == 0:
        raise InvalidArgumentError(f"{name}: expected an array [..., {'2F' if gated else 'H'}], "
                                   "got a scalar")
    if gated and xa.shape[-1] % 2:
        raise InvalidArgumentError(f"gate_up: expected shape [..., 2F], got {list(xa.shape)}")
    _arrays.check(xa, name, FLOAT_DTYPES, xa.shape)
    H, T = xa.shape[-1] // (2 if gated else 1), math.prod(xa.shape[:-1])
    shape = xa.shape[:-1] + (H,)  # of y and y_q
    if weight is not None or not gated:
        _arrays.check(arrays["weight"], "weight", xa.dtype, (H,))
    if residual is not None:
        _arrays.check(arrays["residual"], "residual", xa.dtype, shape)
    if y is not None:
        _arrays.check(arrays[y_name], y_name, xa.dtype, shape)
    elif not quantize:
        y = _arrays.new_like(xa, shape, xa.dtype)
        arrays[y_name] = _arrays.as_array(y, y_name)
    if quantize:
        if y_q is None:
            y_q = _arrays.new_like(xa, shape, "int8")
            arrays["y_q"] = _arrays.as_array(y_q, "y_q")
        if scales is None:
            scales = _arrays.new_like(xa, xa.shape[:-1], "float32")
            arrays["scales"] = _arrays.as_array(scales, "scales")
        _arrays.check(arrays["y_q"], "y_q", "int8", shape)
        _arrays.check(arrays["scales"], "scales", "float32", xa.shape[:-1])

    def pointer(name, ctype="void *"):
        return _ffi.ffi.NULL if arrays[name] is None else arrays[name].cptr(ctype)

    outputs = (pointer("weight"), _arrays.number(eps, "eps"), pointer(y_name), pointer("y_q", "int8_t *"),
               pointer("scales", "float *"), handle)
    if gated:
        _ffi.call("glu_rmsnorm", device, DTYPE_CODES[xa.dtype], T, H, gate, xa.cptr(), *outputs)
    else:
        _ffi.call("rmsnorm", device, DTYPE_CODES[xa.dtype], T, H, xa.cptr(), pointer("residual"),
                  *outputs)
    return y, y_q, scales
