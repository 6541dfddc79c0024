"""RMSNorm and the int8 quantization fused into the W2A8 GEMV (one bitnet_rmsnorm_gemv_w2a8 call):
the form a decode step uses, bit for bit the unfused ops on the same device."""
from . import _arrays, _ffi
from ._arrays import DTYPE_CODES, FLOAT_DTYPES
from .errors import InvalidArgumentError
from .ternary import OUT_DTYPES, TernaryWeights


def rmsnorm_gemv_w2a8(x, weight, w, eps=1e-5, residual=None, out_dtype=None, out=None,
                      stream=None):
    """``gemv_w2a8(w, *rmsnorm_quantize(x, weight, eps))``, plus ``residual`` when given, in one call
    that never writes the int8 codes::

        x_q, s = rmsnorm_quantize(x, weight, eps)
        y = gemv_w2a8(w, x_q, s, out_dtype)               (rounded to out_dtype)
        y = residual + y                                  (float32, rounded to out_dtype)

    Bit for bit what those ops give one after the other on the same device. On a GPU one launch per
    token reads the weights once (a decode step's batch-1 form; with T tokens, T times) and needs
    eps > 0 and 16-byte aligned x and weight (else UnsupportedError).

    Parameters
    ----------
    x : array [K] or [T, K], float32, float16 or bfloat16; K % 128 == 0
    weight : array [K], the dtype of x (the norm's weight)
    w : TernaryWeights of shape (M, K)
    eps : float, finite and >= 0
    residual : array [M] or [T, M] of out_dtype, optional (float dtypes only); may be ``out``
    out_dtype : "float32", "float16", "bfloat16" or "int32" (the exact dot); default the
        residual's dtype, else "float32"
    out : array [M] or [T, M] of out_dtype, optional (may be residual: in place)
    stream : CUDA stream, optional

    Returns
    -------
    y : array [M] or [T, M], out if given
    """
    return _fused(x, weight, w, eps, residual, out_dtype, out, stream, gated=False)


def relu2_rmsnorm_gemv_w2a8(gate_up, weight, w, eps=1e-5, residual=None, out_dtype=None, out=None,
                            stream=None):
    """``gemv_w2a8(w, *relu2_rmsnorm_quantize(gate_up, weight, eps))``, plus ``residual`` when given,
    in one call: rmsnorm_gemv_w2a8 of v = relu2_gate(gate_up) (rounded to gate_up's dtype as
    relu2_gate stores it), without writing v or its codes. Bit for bit the unfused ops.

    Parameters
    ----------
    gate_up : array [2K] or [T, 2K]: the gate in the first K columns, up in the last K
    weight : array [K], the dtype of gate_up
    w : TernaryWeights of shape (M, K)
    eps, residual, out_dtype, out, stream : as for rmsnorm_gemv_w2a8

    Returns
    -------
    y : array [M] or [T, M], out if given
    """
    return _fused(gate_up, weight, w, eps, residual, out_dtype, out, stream, gated=True)


def _fused(x, weight, w, eps, residual, out_dtype, out, stream, gated):
    name = "gate_up" if gated else "x"
    if not isinstance(w, TernaryWeights):
        raise InvalidArgumentError(f"w: expected TernaryWeights (from quantize_i2s or "
                                   f"pack_ternary), got {type(w).__name__}")
    arrays, device, handle = _arrays.prepare(
        {name: x, "weight": weight, "w.packed": w.packed, "w.scales": w.scales,
         "residual": residual, "out": out}, stream, writes=("out",))
    M, K = w.shape
    xa = arrays[name]
    T, width, lead = _arrays.tokens(xa.shape, name)
    _arrays.check(xa, name, FLOAT_DTYPES, (*lead, 2 * K if gated else K))
    _arrays.check(arrays["weight"], "weight", xa.dtype, (K,))
    ra = arrays["residual"]
    if out_dtype is None:
        out_dtype = ra.dtype if ra is not None else "float32"
    if out_dtype not in OUT_DTYPES:
        raise InvalidArgumentError(f"out_dtype must be one of {', '.join(OUT_DTYPES)}, "
                                   f"got {out_dtype!r}")
    if ra is not None:
        if out_dtype == "int32":
            raise InvalidArgumentError("residual: needs a float out_dtype, got int32")
        _arrays.check(ra, "residual", out_dtype, (*lead, M))
    if out is None:
        out = _arrays.new_like(xa, (*lead, M), out_dtype)
        arrays["out"] = _arrays.as_array(out, "out")
    ya = _arrays.check(arrays["out"], "out", out_dtype, (*lead, M))
    _ffi.call("rmsnorm_gemv_w2a8", device, DTYPE_CODES[xa.dtype], T, K, xa.cptr(), int(gated),
              arrays["weight"].cptr(), float(eps), arrays["w.packed"].cptr("uint8_t *"),
              arrays["w.scales"].cptr("float *"), M,
              _ffi.ffi.NULL if ra is None else ra.cptr(), ya.cptr(), DTYPE_CODES[out_dtype],
              _ffi.ffi.cast("void *", handle))
    return out
