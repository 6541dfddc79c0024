"""The input RMSNorm of a decode step fused into the GEMVs around it (one token; docs/rmsnorm.md,
"The norm inside the GEMVs"): the projection whose output is added to the residual h leaves the
statistics of the next norm of h in a small ``stats`` array, and the next projection quantizes
rmsnorm(h) itself from them, so that no norm op runs between the two::

    stats = gemv_w2a8_add_norm_stats(o_proj, a_q, a_s, h, ffn_norm)   # h += o_proj(a)
    gate_up = rmsnorm_gemv_w2a8(h, ffn_norm, stats, gate_up_proj, eps)

``stats`` (float32 [slots, 2]) holds, per slot, the sum of h^2 and max |h * norm_weight| of part
of the row; the producer makes it (or ``new_norm_stats``), and the slots are the library's
business."""
import functools

from . import _arrays, _ffi
from ._arrays import DTYPE_CODES, FLOAT_DTYPES
from .errors import ArgumentTypeError, InvalidArgumentError, UnsupportedError
from .layer_glue import BITNET_ROPE_THETA, qkv_rope_arrays, rope_theta
from .ternary import OUT_DTYPES, TernaryWeights


def norm_stats_slots(device):
    """The slots of a stats array on `device` (an index, or -1 for the CPU): 1 on the CPU, two per
    SM on a GPU."""
    return _slots(_arrays.integer(device, "device"))


@functools.lru_cache(maxsize=None)
def _slots(device):
    slots = _ffi.ffi.new("int64_t *")
    _ffi.call("norm_stats_slots", device, slots)
    return int(slots[0])


def new_norm_stats(like):
    """A stats array (float32 [slots, 2], uninitialised) of the same kind and device as `like`."""
    ref = _arrays.as_array(like, "like")
    return _arrays.new_like(ref, (norm_stats_slots(ref.device), 2), "float32")


def _check_weights(w, name="w"):
    if not isinstance(w, TernaryWeights):
        raise ArgumentTypeError(f"{name}: expected TernaryWeights, got {type(w).__name__}")
    if w.block_scales is not None:
        raise UnsupportedError(f"{name}: weights with block_scales take gemv_w2a8 and the "
                               "unfused norm")


def _check_stats(arrays):
    sa = _arrays.check(arrays["stats"], "stats", "float32", (None, 2))
    slots = sa.shape[0]
    if slots < 1:
        raise InvalidArgumentError("stats: expected at least one slot")
    return sa, slots


def _eps(eps):
    eps = _arrays.number(eps, "eps")
    if not (eps > 0 and eps < float("inf")):
        raise InvalidArgumentError(f"eps must be finite and > 0, got {eps}")
    return eps


def gemv_w2a8_add_norm_stats(w, x_q, s, h, norm_weight, stats=None, stream=None):
    """``h += gemv_w2a8(w, x_q, s)`` for one token, the projection rounded to h's dtype and the sum
    rounded again (rmsnorm_quantize's residual add, bit for bit), and the statistics of the next
    RMSNorm of h with norm_weight into stats, for rmsnorm_gemv_w2a8.

    Parameters
    ----------
    w : TernaryWeights [M, K], without block_scales
    x_q : int8 array [1, K], s : float32 array [1] (from quantize_a8 or a norm)
    h : array [1, M] (float16 or bfloat16 on a GPU; float32 too on the CPU), updated in place
    norm_weight : array [M] of h's dtype: the weight of the norm that reads h next
    stats : float32 array [slots, 2], optional (slots: at least norm_stats_slots(device))
    stream : CUDA stream, optional

    Returns
    -------
    stats
    """
    _check_weights(w)
    arrays, device, handle = _arrays.prepare(
        {"w.packed": w.packed, "w.scales": w.scales, "x_q": x_q, "s": s, "h": h,
         "norm_weight": norm_weight, "stats": stats}, stream, writes=("h", "stats"),
        optional=("stats",))
    M, K = w.shape
    xa = _arrays.check(arrays["x_q"], "x_q", "int8", (1, K))
    sa = _arrays.check(arrays["s"], "s", "float32", (1,))
    ha = _arrays.check(arrays["h"], "h", FLOAT_DTYPES, (1, M))
    wa = _arrays.check(arrays["norm_weight"], "norm_weight", ha.dtype, (M,))
    if stats is None:
        stats = _arrays.new_like(ha, (norm_stats_slots(device), 2), "float32")
        arrays["stats"] = _arrays.as_array(stats, "stats")
    st, slots = _check_stats(arrays)
    _ffi.call("gemv_w2a8_add_norm_stats", device, DTYPE_CODES[ha.dtype],
              arrays["w.packed"].cptr("uint8_t *"), arrays["w.scales"].cptr("float *"), M, K,
              xa.cptr("int8_t *"), sa.cptr("float *"), ha.cptr(), wa.cptr(), st.cptr("float *"),
              slots, handle)
    return stats


def _normed_input(arrays, K):
    ha = _arrays.check(arrays["h"], "h", FLOAT_DTYPES, (1, K))
    wa = _arrays.check(arrays["norm_weight"], "norm_weight", ha.dtype, (K,))
    return ha, wa


def rmsnorm_gemv_w2a8(h, norm_weight, stats, w, eps=1e-5, out_dtype="float32", out=None,
                      stream=None):
    """``gemv_w2a8(w, *rmsnorm_quantize(h, norm_weight, eps))`` for one token, with the norm's sum
    of squares and max taken from stats (left by gemv_w2a8_add_norm_stats on the h given here):
    one kernel on a GPU. The codes are rmsnorm_quantize's wherever its float32 sum of squares and
    the slots', added in another order, give the same 1 / RMS (bitnet.h states the rule).

    Parameters
    ----------
    h : array [1, K] (float16 or bfloat16 on a GPU; float32 too on the CPU)
    norm_weight : array [K] of h's dtype
    stats : float32 array [slots, 2] from gemv_w2a8_add_norm_stats
    w : TernaryWeights [M, K], without block_scales
    eps : float, finite and > 0
    out_dtype : "float32", "float16", "bfloat16" or "int32"
    out : array [1, M] of out_dtype, optional

    Returns
    -------
    out
    """
    _check_weights(w)
    if out_dtype not in OUT_DTYPES:
        raise InvalidArgumentError(f"out_dtype must be one of {', '.join(OUT_DTYPES)}, "
                                   f"got {out_dtype!r}")
    eps = _eps(eps)
    arrays, device, handle = _arrays.prepare(
        {"h": h, "norm_weight": norm_weight, "stats": stats, "w.packed": w.packed,
         "w.scales": w.scales, "out": out}, stream, writes=("out",), optional=("out",))
    M, K = w.shape
    ha, wa = _normed_input(arrays, K)
    st, slots = _check_stats(arrays)
    out, ya = _arrays.output(arrays, "out", out, ha, (1, M), out_dtype)
    _ffi.call("rmsnorm_gemv_w2a8", device, DTYPE_CODES[ha.dtype], ha.cptr(), wa.cptr(),
              st.cptr("float *"), slots, float(eps), arrays["w.packed"].cptr("uint8_t *"),
              arrays["w.scales"].cptr("float *"), M, K, ya.cptr(), DTYPE_CODES[out_dtype], handle)
    return out


def rmsnorm_gemv_w2a8_rope_append_kv(h, norm_weight, stats, w, k_cache, v_cache, position,
                                     eps=1e-5, theta=BITNET_ROPE_THETA, out=None, stream=None):
    """``gemv_w2a8_rope_append_kv`` on the codes that rmsnorm_gemv_w2a8 makes from h, norm_weight
    and stats: the QKV projection of a one-sequence decode step with its input norm, RoPE and the
    KV-cache append in one kernel on a GPU.

    Parameters
    ----------
    h, norm_weight, stats, eps : as rmsnorm_gemv_w2a8's
    w : TernaryWeights [(Hq + 2 Hkv) D, K], without block_scales
    k_cache, v_cache, position, theta, out : as gemv_w2a8_rope_append_kv's

    Returns
    -------
    out : the rotated queries [1, 1, Hq, D]
    """
    _check_weights(w)
    eps = _eps(eps)
    arrays, device, handle = _arrays.prepare(
        {"h": h, "norm_weight": norm_weight, "stats": stats, "w.packed": w.packed,
         "w.scales": w.scales, "k_cache": k_cache, "v_cache": v_cache, "out": out}, stream,
        writes=("k_cache", "v_cache", "out"), optional=("out",))
    M, K = w.shape
    ha, wa = _normed_input(arrays, K)
    st, slots = _check_stats(arrays)
    theta = rope_theta(theta)
    kc, heads, out, oa, pos = qkv_rope_arrays(arrays, M, ha.dtype, out, position)
    _ffi.call("rmsnorm_gemv_w2a8_rope_append_kv", device, DTYPE_CODES[ha.dtype], ha.cptr(),
              wa.cptr(), st.cptr("float *"), slots, float(eps),
              arrays["w.packed"].cptr("uint8_t *"), arrays["w.scales"].cptr("float *"), K, *heads,
              oa.cptr(), kc.cptr(), arrays["v_cache"].cptr(), kc.shape[1], pos.cptr("int32_t *"),
              float(theta), handle)
    return out
