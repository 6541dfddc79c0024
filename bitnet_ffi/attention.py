"""Grouped-query attention over a KV cache (decode) or a prompt (causal prefill)."""
import math

import numpy as np

from . import _arrays, _ffi
from ._arrays import DTYPE_CODES, FLOAT_DTYPES
from .errors import InvalidArgumentError


def attention(q, k, v, causal=True, scale=None, seq_lens=None, out=None, workspace=None,
              stream=None):
    """Grouped-query attention with an online softmax accumulated in float32.

    ``out[b, i, h] = sum_j softmax_j(q[b, i, h] . k[b, j, h // G] * scale + mask[i, j]) v[b, j, h // G]``
    with ``G = Hq // Hkv`` and keys ``j < L = seq_lens[b]`` (all C when seq_lens is None). The Sq
    queries are the last Sq positions of their sequence: with ``causal=True`` query i sees keys
    ``0 .. L - Sq + i`` (FlashAttention's kv-cache convention; Sq = L is causal prefill). A key
    that a query does not see never reaches its output, even where k or v hold inf or NaN there.

    Parameters
    ----------
    q : array [B, Sq, Hq, D]
        float16 or bfloat16 (float32 too on the CPU); D is 64, 128 or 256.
    k, v : arrays [B, C, Hkv, D]
        The keys and values (a KV cache of capacity C), same dtype and device as q.
    causal : bool
    scale : float, optional
        Defaults to 1 / sqrt(D).
    seq_lens : sequence of int, or int32 array [B] on q's device, optional
        Valid lengths, each in [Sq, C] (causal) or [1, C]. Host values (a list, tuple or numpy
        array) are checked here and, for a GPU op, uploaded to the device with an explicit copy
        (this waits for the copy; pass a device array to keep the call asynchronous and
        capturable in a CUDA graph). A device array is not read by the host: a sequence whose
        length is out of range gets NaN outputs, and no memory outside the arrays is read.
    out : array [B, Sq, Hq, D], optional
        Written in place and returned; a new array of q's kind otherwise.
    workspace : uint8 array on q's device, optional
        Split-KV scratch of ``attention_workspace_size(...)`` bytes; allocated per call when
        None and needed. Pass one to make the call allocation-free (CUDA graphs).
    stream : optional
        CUDA stream; by default the current stream of q's framework.

    Returns
    -------
    out
    """
    arrays, device, handle = _arrays.prepare(
        {"q": q, "k": k, "v": v, "out": out, "workspace": workspace}, stream,
        writes=("out", "workspace"), optional=("out", "workspace"))
    qa = _arrays.check(arrays["q"], "q", FLOAT_DTYPES, (None, None, None, None))
    B, Sq, Hq, D = qa.shape
    ka = _arrays.check(arrays["k"], "k", qa.dtype, (B, None, None, D))
    C, Hkv = ka.shape[1], ka.shape[2]
    _arrays.check(arrays["v"], "v", qa.dtype, (B, C, Hkv, D))
    if Hkv == 0 or Hq % Hkv:
        raise InvalidArgumentError(f"q has {Hq} heads, which is not a multiple of the {Hkv} "
                                   "heads of k and v")
    scale = attention_scale(scale)
    lens = _seq_lens(seq_lens, qa, B, Sq, C, causal)
    out, outa = _arrays.output(arrays, "out", out, qa, (B, Sq, Hq, D), qa.dtype)
    wsa = arrays["workspace"]
    if wsa is None:  # a given one's size is checked by the C call
        ws_bytes = attention_workspace_size(device, B, Sq, Hq, Hkv, D, C)
        if ws_bytes:
            wsa = _arrays.as_array(_arrays.new_like(qa, (ws_bytes,), "uint8"), "workspace")
    ffi = _ffi.ffi
    _ffi.call("attention", device, DTYPE_CODES[qa.dtype], B, Sq, Hq, Hkv, D,
              qa.cptr(), ka.cptr(), arrays["v"].cptr(), C,
              ffi.NULL if lens is None else lens.cptr("int32_t *"), int(bool(causal)), scale,
              outa.cptr(),
              ffi.NULL if wsa is None else wsa.cptr(),
              0 if wsa is None else wsa.size * _arrays.ITEMSIZE[wsa.dtype], handle)
    return out


def attention_scale(scale):
    """The scale as the C call takes it, checked: a finite float, 0.0 for None (1 / sqrt(D))."""
    if scale is None:
        return 0.0
    scale = _arrays.number(scale, "scale")
    if not math.isfinite(scale):
        raise InvalidArgumentError(f"scale must be finite, got {scale}")
    return float(scale)


def attention_workspace_size(device, B, Sq, Hq, Hkv, D, C):
    """Bytes of split-KV workspace ``attention`` needs for these sizes on ``device``: a CUDA
    device index (-1: the CPU) or a name, "cpu", "cuda" or "cuda:N"."""
    if isinstance(device, str):
        from .device import resolve
        device = resolve(device)
    nbytes = _ffi.ffi.new("int64_t *")
    sizes = {"B": B, "Sq": Sq, "Hq": Hq, "Hkv": Hkv, "D": D, "C": C}
    _ffi.call("attention_workspace_size", _arrays.integer(device, "device"),
              *(_arrays.integer(value, name) for name, value in sizes.items()), nbytes)
    return nbytes[0]


def _seq_lens(seq_lens, qa, B, Sq, C, causal):
    """seq_lens as an int32 Array on q's device: host values checked, then uploaded for a GPU op."""
    if seq_lens is None:
        return None
    low = Sq if causal else 1

    def check_range(host):
        bad = np.flatnonzero((host < low) | (host > C))
        if bad.size:
            raise InvalidArgumentError(f"seq_lens[{bad[0]}] = {host[bad[0]]} is outside "
                                       f"[{low}, C = {C}]")

    return _arrays.int32_per_row(seq_lens, "seq_lens", B, qa, check_range)
