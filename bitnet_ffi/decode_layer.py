"""One BitNet layer of a one-token decode step as one op (bitnet.h's bitnet_decode_layer,
docs/decode_layer.md): on a GPU a single cooperative kernel, on the CPU the unfused op sequence."""
from . import _arrays, _ffi
from ._arrays import DTYPE_CODES
from .config import Config
from .errors import ArgumentTypeError, InvalidArgumentError, UnsupportedError
from .layer_glue import activation_code
from .ternary import TernaryWeights

PROJECTIONS = ("qkv", "o", "gate_up", "down")
NORMS = ("attn_norm", "attn_sub_norm", "ffn_norm", "ffn_sub_norm")
SUB_NORMS = ("attn_sub_norm", "ffn_sub_norm")


def decode_layer(config, layer, h, k_cache, v_cache, position, workspace=None, stream=None):
    """One layer for one new token of one sequence at position ``p``, updating ``h`` in place::

        h += o(sub_norm(attention(rope(qkv(norm(h))), cache rows 0 .. p)))
        h += down(sub_norm(act(gate) * up))        gate|up = gate_up(norm(h))

    the same values as the model runtime's unfused ops (``Session.forward`` for one token), every
    intermediate rounded to h's dtype where that sequence stores it; each ternary projection's input
    is quantized to int8 by the norm before it (by ``quantize_a8``'s rule where the layer has no
    sub-norm). Row p of the KV cache is written. The CPU runs that op sequence and gives its bits;
    a GPU differs from it only by float32 sum orders (docs/decode_layer.md gives the bound).

    Parameters
    ----------
    config : bitnet_ffi.config.Config
        hidden H, intermediate I, heads Hq, kv_heads Hkv, head_dim D (64, 128 or 256), activation,
        eps, theta, attn_sub_eps, ffn_sub_eps, attention_scale. H, I and Hq D: multiples of 128,
        at most 65536.
    layer : object with attributes qkv [Hq D + 2 Hkv D, H], o [H, Hq D], gate_up [2 I, H] and
        down [H, I] (TernaryWeights with one scale per row: no block_scales), and attn_norm [H],
        ffn_norm [H], attn_sub_norm [Hq D] or None, ffn_sub_norm [I] or None (arrays of h's
        dtype; a None sub-norm only quantizes), as bitnet_ffi.model.Layer
    h : array [H] or [1, H], float16 or bfloat16 (float32 too on the CPU), updated in place
    k_cache, v_cache : arrays [C, Hkv, D] or [1, C, Hkv, D] of h's dtype; row p is written
    position : int32 array [1] on h's device, or a host integer sequence [1]
        Host values are checked (0 <= p < C) and, for a GPU op, uploaded with a synchronous copy;
        a device array is not read by the host: on a GPU a p outside [0, C) leaves h and the caches
        untouched (on the CPU it is an InvalidArgumentError).
    workspace : uint8 array on h's device, optional
        ``decode_layer_workspace_size(config, device, dtype)`` bytes for the intermediates. When
        None one is allocated per call; passing one avoids that allocation, and is needed inside
        a CUDA graph capture.
    stream : CUDA stream, optional (default: the current stream of h's framework)

    Returns
    -------
    h
    """
    cfg = _config_struct(config)
    parts = _layer_parts(layer)
    named = {"h": h, "k_cache": k_cache, "v_cache": v_cache, "workspace": workspace}
    for name in PROJECTIONS:
        named[f"layer.{name}.packed"] = parts[name].packed
        named[f"layer.{name}.scales"] = parts[name].scales
    named.update({f"layer.{name}": parts[name] for name in NORMS})
    arrays, device, handle = _arrays.prepare(
        named, stream, writes=("h", "k_cache", "v_cache", "workspace"),
        optional=("workspace",) + tuple(f"layer.{name}" for name in SUB_NORMS))
    H, I, Hq, Hkv, D = (config.hidden, config.intermediate, config.heads, config.kv_heads,
                        config.head_dim)
    Q, KV = Hq * D, Hkv * D
    ha = arrays["h"]
    _arrays.check(ha, "h", _arrays.FLOAT_DTYPES, (H,) if len(ha.shape) == 1 else (1, H))
    kc = _arrays.check(arrays["k_cache"], "k_cache", ha.dtype, (None, Hkv, D)
                       if len(arrays["k_cache"].shape) == 3 else (1, None, Hkv, D))
    C = kc.shape[-3]
    _arrays.check(arrays["v_cache"], "v_cache", ha.dtype, kc.shape)
    for name, shape in {"qkv": (Q + 2 * KV, H), "o": (H, Q), "gate_up": (2 * I, H),
                        "down": (H, I)}.items():
        if parts[name].shape != shape:
            raise InvalidArgumentError(f"layer.{name}: expected weights of shape {list(shape)}, "
                                       f"got {list(parts[name].shape)}")
    for name, width in {"attn_norm": H, "attn_sub_norm": Q, "ffn_norm": H,
                        "ffn_sub_norm": I}.items():
        if arrays[f"layer.{name}"] is not None:
            _arrays.check(arrays[f"layer.{name}"], f"layer.{name}", ha.dtype, (width,))

    def check_range(host):
        if not 0 <= host[0] < C:
            raise InvalidArgumentError(f"position = {host[0]} is outside [0, C = {C})")

    pos = _arrays.int32_per_row(position, "position", 1, ha, check_range)
    wsa = arrays["workspace"]
    if wsa is None:  # a given one's size is checked by the C call
        nbytes = _workspace_bytes(cfg, device, ha.dtype)
        wsa = _arrays.as_array(_arrays.new_like(ha, (nbytes,), "uint8"), "workspace")
    ffi = _ffi.ffi

    def pointer(name, ctype="void *"):
        return ffi.NULL if arrays[name] is None else arrays[name].cptr(ctype)

    weights = ffi.new("bitnet_decode_layer_weights *", {
        **{name: {"w_packed": pointer(f"layer.{name}.packed", "uint8_t *"),
                  "w_scales": pointer(f"layer.{name}.scales", "float *")} for name in PROJECTIONS},
        **{name: pointer(f"layer.{name}") for name in NORMS}})
    _ffi.call("decode_layer", device, DTYPE_CODES[ha.dtype], cfg, weights, ha.cptr(), kc.cptr(),
              arrays["v_cache"].cptr(), C, pos.cptr("int32_t *"), wsa.cptr(),
              wsa.size * _arrays.ITEMSIZE[wsa.dtype], handle)
    return h


def decode_layer_workspace_size(config, device, dtype="bfloat16"):
    """Bytes of workspace ``decode_layer`` needs for ``config`` with activations of ``dtype`` on
    ``device``: a CUDA device index (-1: the CPU) or a name, "cpu", "cuda" or "cuda:N"."""
    cfg = _config_struct(config)
    if isinstance(device, str):
        from .device import resolve
        device = resolve(device)
    if dtype not in DTYPE_CODES:
        raise InvalidArgumentError(f"dtype must be one of {', '.join(DTYPE_CODES)}, got {dtype!r}")
    return _workspace_bytes(cfg, _arrays.integer(device, "device"), dtype)


def fused_layer_supported(weights, device, dtype="bfloat16"):
    """Whether ``decode_layer`` runs every layer of ``weights`` (a bitnet_ffi.model.Weights) with
    activations of ``dtype`` on ``device``: one scale per weight row (no block_scales), and a
    config that the device's backend takes (bitnet_decode_layer_workspace_size accepts it)."""
    if any(getattr(layer, name).block_scales is not None
           for layer in weights.layers for name in PROJECTIONS):
        return False
    try:
        decode_layer_workspace_size(weights.config, device, dtype)
    except ArgumentTypeError:
        raise
    except (InvalidArgumentError, UnsupportedError):
        return False
    return True


def _workspace_bytes(cfg, device, dtype):
    nbytes = _ffi.ffi.new("int64_t *")
    _ffi.call("decode_layer_workspace_size", device, DTYPE_CODES[dtype], cfg, nbytes)
    return nbytes[0]


def _config_struct(config):
    """The bitnet_decode_layer_config of a Config."""
    if not isinstance(config, Config):
        raise ArgumentTypeError(f"config: expected a bitnet_ffi.config.Config, got "
                                f"{type(config).__name__}")
    sizes = {"H": "hidden", "I": "intermediate", "Hq": "heads", "Hkv": "kv_heads", "D": "head_dim"}
    floats = ("eps", "attn_sub_eps", "ffn_sub_eps", "theta", "attention_scale")
    values = {**{field: _arrays.integer(getattr(config, name), f"config.{name}")
                 for field, name in sizes.items()},
              "activation": activation_code(config.activation),
              **{name: _arrays.number(getattr(config, name), f"config.{name}") for name in floats}}
    _ffi.lib()  # loading the library declares the header's types to cffi
    try:
        return _ffi.ffi.new("bitnet_decode_layer_config *", values)
    except OverflowError as exc:  # a size past int64_t
        raise InvalidArgumentError(f"config: {exc}") from None


def _layer_parts(layer):
    """layer's projections (TernaryWeights with a scale per row) and norms, by name."""
    missing = [name for name in PROJECTIONS + NORMS if not hasattr(layer, name)]
    if missing:
        raise ArgumentTypeError(f"layer: expected an object with attributes "
                                f"{', '.join(PROJECTIONS + NORMS)} (bitnet_ffi.model.Layer), got "
                                f"{type(layer).__name__} without {', '.join(missing)}")
    parts = {name: getattr(layer, name) for name in PROJECTIONS + NORMS}
    for name in PROJECTIONS:
        if not isinstance(parts[name], TernaryWeights):
            raise ArgumentTypeError(f"layer.{name}: expected TernaryWeights, got "
                                    f"{type(parts[name]).__name__}")
        if parts[name].block_scales is not None:
            raise UnsupportedError(f"layer.{name} has block_scales: the fused layer needs one "
                                   "scale per row (run the unfused ops, gemv_w2a8 takes them)")
    return parts
