"""The end of a decode step: the dense bfloat16 output head, greedy argmax, and the embedding lookup
that starts the next step. All three run on the arrays' device, so a GPU decode never visits the
host."""
import numpy as np

from . import _arrays, _ffi
from ._arrays import DTYPE_CODES, FLOAT_DTYPES
from .errors import InvalidArgumentError


def gemv_bf16(w, x, out_dtype="float32", out=None, stream=None):
    """Dense bfloat16 GEMV with float32 accumulation: ``y[n, m] = sum_k x[n, k] * w[m, k]``.

    The output head of a BitNet model (tied to the embedding table), at the memory-bandwidth limit.

    Parameters
    ----------
    w : bfloat16 array [M, K], K a multiple of 8
    x : float32 or bfloat16 array [K] or [N, K], on w's device
    out_dtype : "float32" or "bfloat16"
    out : optional array [N, M] (or [M]) of out_dtype

    Returns
    -------
    y : array [N, M] (or [M] for 1-D x)
    """
    arrays, device, handle = _arrays.prepare({"w": w, "x": x, "out": out}, stream,
                                             writes=("out",), optional=("out",))
    wa = _arrays.check(arrays["w"], "w", "bfloat16", (None, None))
    M, K = wa.shape
    xa = arrays["x"]
    N, Kx, lead = _arrays.tokens(xa.shape, "x")
    _arrays.check(xa, "x", ("float32", "bfloat16"), (*lead, K))
    if out_dtype not in ("float32", "bfloat16"):
        raise InvalidArgumentError(f"out_dtype must be float32 or bfloat16, got {out_dtype!r}")
    out, ya = _arrays.output(arrays, "out", out, wa, (*lead, M), out_dtype)
    _ffi.call("gemv_bf16", device, wa.cptr(), M, K, xa.cptr(), DTYPE_CODES[xa.dtype], N, ya.cptr(),
              DTYPE_CODES[out_dtype], handle)
    return out


def argmax(x, out=None, stream=None):
    """Row-wise argmax with numpy's rules (first maximum; NaN beats every number).

    Parameters
    ----------
    x : float32 array [N, M] (or [M])
    out : optional int32 array [N] (or [] for 1-D x) on x's device

    Returns
    -------
    index : int32 array [N] (or a 0-d array for 1-D x)
    """
    arrays, device, handle = _arrays.prepare({"x": x, "out": out}, stream, writes=("out",),
                                             optional=("out",))
    xa = arrays["x"]
    N, M, lead = _arrays.tokens(xa.shape, "x")
    _arrays.check(xa, "x", "float32", (*lead, M))
    out, oa = _arrays.output(arrays, "out", out, xa, lead, "int32")
    _ffi.call("argmax", device, xa.cptr("float *"), N, M, oa.cptr("int32_t *"),
              handle)
    return out


def embedding(table, ids, out=None, stream=None):
    """Embedding lookup: ``out[n, :] = table[ids[n], :]``.

    Parameters
    ----------
    table : float32, float16 or bfloat16 array [V, H]
    ids : int32 array [N] on table's device, or host integers (checked, then uploaded explicitly
        for a GPU table). Device-resident ids cannot be checked by the host: an id outside [0, V)
        gives a row of NaN.
    out : optional array [N, H] of table's dtype

    Returns
    -------
    out : array [N, H]
    """
    tab = _arrays.as_array(table, "table")
    _arrays.check(tab, "table", FLOAT_DTYPES, (None, None))
    V, H = tab.shape
    if isinstance(ids, (list, tuple, np.ndarray)):
        host = np.asarray(ids)
        if host.ndim != 1 or not np.issubdtype(host.dtype, np.integer):
            raise InvalidArgumentError(f"ids: expected a 1-D integer array, got {host.dtype} "
                                       f"{list(host.shape)}")
        bad = np.flatnonzero((host < 0) | (host >= V))
        if bad.size:
            raise InvalidArgumentError(f"ids[{bad[0]}] = {host[bad[0]]} is outside [0, {V})")
        ids = _arrays.upload_int32(host, tab, "ids")
    arrays, device, handle = _arrays.prepare({"table": tab, "ids": ids, "out": out}, stream,
                                             writes=("out",), optional=("out",))
    ia = _arrays.check(arrays["ids"], "ids", "int32", (None,))
    N = ia.shape[0]
    out, oa = _arrays.output(arrays, "out", out, tab, (N, H), tab.dtype)
    _ffi.call("embedding", device, DTYPE_CODES[tab.dtype], tab.cptr(), V, H, ia.cptr("int32_t *"),
              N, oa.cptr(), handle)
    return out


def add_int32(x, delta, stream=None):
    """``x += delta`` for an int32 array, on its device (wrapping like C): advances the positions
    and lengths of a captured decode step between replays."""
    arrays, device, handle = _arrays.prepare({"x": x}, stream, writes=("x",))
    xa = _arrays.check(arrays["x"], "x", "int32", (None,) * len(arrays["x"].shape))
    _ffi.call("add_int32", device, xa.cptr("int32_t *"), xa.size, _arrays.integer(delta, "delta"),
              handle)
    return x
