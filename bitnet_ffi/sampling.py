"""Sampling the next token on the device: temperature, top-k, top-p, and a counter-based random
draw, so that a decode step with its sampling can be captured in one CUDA graph (docs/sampling.md)."""
import math

import numpy as np

from . import _arrays, _ffi
from .errors import InvalidArgumentError

MAX_TOP_K = 1024  # BN_SAMPLE_MAX_CANDIDATES


def sample(logits, seed, counters, temperature=1.0, top_k=0, top_p=1.0, out=None, stream=None):
    """One token per row of logits: temperature, then top-k, softmax, top-p, and a draw.

    For row n with x = logits[n] (temperature 0: ``argmax(x)``, numpy's rules)::

        p = exp((x - max(x)) / temperature)              (float32; sums in float64)
        keep the top_k largest (0: all; equal logits by the lower index), in that order
        keep the smallest prefix of them whose share of the softmax reaches top_p (1: all)
        u = uniform(seed, n, counters[n])                (Philox-4x32-10, in [0, 1))
        index[n] = the first kept token whose cumulative probability exceeds u * (kept mass)

    Without top-k and top-p the whole vocabulary is drawn from, in index order. top_p alone ranks
    the 1024 most likely tokens (its softmax still over all V): a nucleus wider than that is cut
    there. A row with a NaN or +inf logit, or only -inf, gives its argmax. The same inputs give
    the same token on the CPU and the GPU, except where u falls within float rounding of a
    boundary between two tokens (or of the top-p cut). counters are read, not advanced.

    Parameters
    ----------
    logits : float32 array [N, V] (or [V])
    seed : int in [0, 2**64)
    counters : int32 array [N] (or [1]) on logits' device, or host integers (uploaded explicitly
        for a GPU op: a synchronous copy; pass a device array to keep the call capturable). The
        draw of row n depends on (seed, n, counters[n]) only: advance them between steps (e.g.
        add_int32, or pass the sequences' positions).
    temperature : float, finite and >= 0 (0: argmax)
    top_k : int in [0, 1024] (0: off)
    top_p : float in (0, 1] (1: off)
    out : optional int32 array [N] (or [] for 1-D logits) on logits' device
    stream : CUDA stream, optional (default: the current stream of logits' framework)

    Returns
    -------
    index : int32 array [N] (or a 0-d array for 1-D logits)
    """
    _check_settings(seed, temperature, top_k, top_p)
    arrays, device, handle = _arrays.prepare({"logits": logits, "out": out}, stream,
                                             writes=("out",), optional=("out",))
    xa = arrays["logits"]
    N, V, lead = _arrays.tokens(xa.shape, "logits")
    _arrays.check(xa, "logits", "float32", (*lead, V))
    ca = _arrays.int32_per_row(counters, "counters", N, xa)
    out, oa = _arrays.output(arrays, "out", out, xa, lead, "int32")
    _ffi.call("sample", device, xa.cptr("float *"), N, V, int(seed), ca.cptr("int32_t *"),
              float(temperature), int(top_k), float(top_p), oa.cptr("int32_t *"),
              handle)
    return out


def sampling_settings(temperature=0.0, top_k=0, top_p=1.0, seed=0):
    """A decode step's draw, checked as sample checks it: None for greedy (temperature 0), else
    sample's keyword arguments (seed, temperature, top_k, top_p)."""
    _check_settings(seed, temperature, top_k, top_p)
    if temperature == 0:
        return None
    return dict(seed=int(seed), temperature=float(temperature), top_k=int(top_k),
                top_p=float(top_p))


def _check_settings(seed, temperature, top_k, top_p):
    if not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 1 << 64:
        raise InvalidArgumentError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidArgumentError(f"temperature must be finite and >= 0, got {temperature}")
    if not isinstance(top_k, (int, np.integer)) or not 0 <= top_k <= MAX_TOP_K:
        raise InvalidArgumentError(f"top_k must be an integer in [0, {MAX_TOP_K}], got {top_k!r}")
    if not 0 < top_p <= 1:
        raise InvalidArgumentError(f"top_p must be in (0, 1], got {top_p}")
