"""Loads a checkpoint onto a device: a Hugging Face directory (config.json + safetensors) or a GGUF
file. Tensors stream one at a time from the memory-mapped files: each is converted on the host to
the library's packed format (docs/weight_format.md) and copied to the device, so host memory
peaks at about one fused projection. Anything missing, extra, misshapen or of an unknown type
raises before the model exists, and what was already on the device is freed.

Scales (docs/models.md): with ``quantization_config.linear_class == "autobitlinear"`` a stored
``weight_scale`` is the absmean (W = codes * scale); otherwise (BitLinear) it is 1 / absmean.
GGUF I2_S holds the absmean; TQ1_0 / TQ2_0 hold one fp16 scale per 256 weights, converted exactly
when all blocks of a row share it (per-row scales; blocks of scale 0, all zeros, aside) and refused
otherwise."""
import dataclasses
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import _arrays, _ffi
from .config import Config
from .errors import BitNetError, CorruptFileError, UnsupportedError
from .gguf_file import GGUFFile, require
from .model import Layer, Weights
from .padding import GEMV_K_MULTIPLE, flat_ternary, pad_layer, padded_config
from .safetensors_file import SafetensorsCheckpoint
from .ternary import SCALE_BLOCK, TernaryWeights, pack_ternary, quantize_i2s
from . import weight_names as names

BF16 = _arrays.numpy_dtype("bfloat16")
FLOAT_KINDS = ("bfloat16", "float16", "float32")
CHUNK_ROWS = 128  # rows per task in the host conversions
_pool = ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1)))


def open_source(path):
    """The checkpoint at `path` (a model directory or a .gguf file), its config read: ``.config``,
    and ``.load(device, progress)`` for the Weights."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return HFSource(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such model directory or file")
    if path.endswith(".gguf") or _is_gguf(path):
        return GGUFSource(path)
    raise UnsupportedError(f"{path}: neither a model directory (config.json + safetensors) nor "
                           "a GGUF file")


def _is_gguf(path):
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# ---- packed-format conversions (host, numpy; vectorized, chunked over threads) -----------------

def _transpose_fields(words):
    """Transposes the 4x4 matrix of 2-bit fields in each uint32: field k of byte i (bit 8i + 2k)
    moves to field i of byte k (bit 8k + 2i). Two delta swaps."""
    t = ((words >> 12) ^ words) & 0x0000F0F0
    words = words ^ t ^ (t << 12)
    t = ((words >> 6) ^ words) & 0x00CC00CC
    return words ^ t ^ (t << 6)


def _check_codes(packed, what):
    """Code 3 (2 bits set) is no ternary value: a corrupt tensor."""
    if np.any((packed & (packed >> 1)) & 0x55):
        raise CorruptFileError(f"{what}: holds the 2-bit code 3, which is no ternary value")


def _chunked(fn, rows, *arrays, chunk=CHUNK_ROWS):
    """fn over row chunks of the arrays, on the thread pool (numpy releases the GIL)."""
    spans = [(r, min(rows, r + chunk)) for r in range(0, rows, chunk)]
    list(_pool.map(lambda s: fn(s, *arrays), spans))


def hf_packed_to_ternary(P, what):
    """Hugging Face packed weights, uint8 [O/4, I] with W[k O/4 + r, c] = ((P[r, c] >> 2k) & 3)
    - 1, to the library's layout uint8 [O, I/4] (weight 16g + 4i + b of a row in byte 4g + b,
    bits 2i)."""
    R, I = P.shape
    out = np.empty((4, R, I // 16, 4), np.uint8)  # [k, r, g, b]: byte k of each word

    def convert(span, src):
        lo, hi = span
        block = src[lo:hi].reshape(hi - lo, I // 16, 4, 4)            # [r, g, i, b]
        _check_codes(block, what)
        words = np.ascontiguousarray(block.transpose(0, 1, 3, 2)).view("<u4")[..., 0]
        fields = _transpose_fields(words)                             # byte k: codes of row k R + r
        out[:, lo:hi] = fields[..., None].view(np.uint8).transpose(3, 0, 1, 2)
    _chunked(convert, R, P)
    return out.reshape(4 * R, I // 4)


def i2s_to_ternary(raw, rows, cols, what):
    """bitnet.cpp I2_S: rows * cols / 4 code bytes, 128-weight blocks of the row-major data,
    weight j of block b in byte 32 b + j % 32 at bit 6 - 2 (j / 32), codes 0, 1, 2 = -1, 0, +1;
    then the float32 absmean. Blocks may cross rows (cols a multiple of 16, not of 128): the
    library's layout of the row-major data is the rows' layouts one after another. Returns (packed
    uint8 [rows, cols / 4], scale)."""
    n = rows * cols // 4
    scale = float(np.frombuffer(raw[n:n + 4].tobytes(), "<f4")[0])
    blocks = raw[:n].reshape(-1, 2, 4, 4)                             # [block, h, i, b]: j = 16h + 4i + b
    out = np.empty((blocks.shape[0], 4, 2, 4), np.uint8)              # [block, q, h, b]: group 2q + h

    def convert(span, src):
        lo, hi = span
        block = src[lo:hi]
        _check_codes(block, what)
        words = np.ascontiguousarray(block.transpose(0, 1, 3, 2)).view("<u4")[..., 0]
        fields = _transpose_fields(words)[..., None].view(np.uint8)   # [block, h, b, f], q = 3 - f
        out[lo:hi] = fields.transpose(0, 3, 1, 2)[:, ::-1]
    _chunked(convert, blocks.shape[0], blocks, chunk=CHUNK_ROWS * 32)
    return out.reshape(rows, cols // 4), scale


def tq_to_codes(raw, kind, rows, cols, what):
    """llama.cpp TQ1_0 / TQ2_0 (256-weight blocks, one fp16 scale each) to (int8 codes, a scale
    per row, block scales): where every block of a row has one scale, that is the row's scale and
    block scales are None; else the rows' scales are 1 and the block scales are the file's (float32
    [rows, cols / 256]). Exact either way (docs/models.md)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    qtype = GGMLQuantizationType[kind]
    raw = raw.reshape(rows, -1)
    d = raw.reshape(rows, cols // 256, -1)[..., -2:].copy().view("<f2")[..., 0].astype(np.float32)
    if not np.isfinite(d).all():
        r = np.flatnonzero(~np.isfinite(d).all(axis=1))[0]
        raise CorruptFileError(f"{what}: {kind} row {r} has a block scale that is not finite")
    # a block of scale 0 holds zeros whatever its codes: it agrees with any row scale
    nonzero = d != 0
    scales = d[np.arange(rows), nonzero.argmax(axis=1)]
    block_scales = d if (nonzero & (d != scales[:, None])).any() else None
    if block_scales is not None:
        scales = np.ones(rows, np.float32)
    codes = np.empty((rows, cols), np.int8)

    def convert(span, src):
        lo, hi = span
        values = dequantize(src[lo:hi], qtype)
        s = scales[lo:hi, None] if block_scales is None else np.repeat(d[lo:hi], 256, axis=1)
        codes[lo:hi] = np.rint(np.divide(values, s, out=np.zeros_like(values), where=s != 0))
    _chunked(convert, rows, raw)
    return codes, scales, block_scales


def float_to_codes(values, what):
    """Float weights that are already ternary (every |w| is 0 or one magnitude m, as llama.cpp's
    and bitnet.cpp's converters write them): (int8 codes, m). llama.cpp multiplies by them as
    they are, so latent (unquantized) weights cannot be run exactly and are refused."""
    values = np.asarray(values, dtype=np.float32)
    m = float(np.abs(values).max()) if values.size else 0.0
    codes = np.rint(values / m) if m > 0 else np.zeros_like(values)
    if m > 0 and not np.array_equal(codes * np.float32(m), values):
        raise UnsupportedError(f"{what}: float weights that are not ternary (0 or +-{m}) are "
                               "not supported in GGUF (llama.cpp would run them unquantized)")
    return codes.astype(np.int8), m


# ---- sources --------------------------------------------------------------------------------

class Source:
    """What a container must say about a model; ``load`` is the same for every container."""

    path = None
    config = None
    embedding = final_norm = head = layer_prefix = None
    ternary_names = norm_names = None
    ignored = ()

    def load(self, device, progress, each_layer=None):
        """model.Weights on `device`; each_layer(layer), where given, replaces every layer as soon
        as it is read (tensor_parallel.load_shard keeps a rank's slices of it)."""
        c = self.config
        runtime = padded_config(c)
        H, I, V, kv = c.hidden, c.intermediate, c.vocab, c.kv_dim
        layer_device = _arrays.CPU if runtime is not c else device  # padded on the host first
        self.used = set()
        layers = []
        bar = _progress(c.layers + 2, progress)
        try:
            embedding = self.put(self.dense(self.embedding, (V, H)), device)
            bar.update(1)
            for i in range(c.layers):
                prefix = self.layer_prefix.format(i)
                parts = {"qkv": ([H, kv, kv], H), "o": ([H], H), "gate_up": ([I, I], H),
                         "down": ([H], I)}
                ternary = {part: self.ternary(prefix, part, rows, cols, layer_device)
                           for part, (rows, cols) in parts.items()}
                norms = {part: self.norm(prefix, part, I if part == "ffn_sub_norm" else H,
                                         layer_device)
                         for part in self.norm_names}
                layer = Layer(**ternary, **norms)
                if runtime is not c:
                    layer = self.to_device(pad_layer(layer, c, runtime), device)
                layers.append(each_layer(layer) if each_layer else layer)
                bar.update(1)
            final_norm = self.put(self.dense(self.final_norm, (H,)), device)
            head = None if c.tied_head else self.put(self.dense(self.head, (V, H)), device)
            bar.update(1)
            extra = sorted(set(self.names()) - self.used - set(self.ignored_names()))
            if extra:
                raise CorruptFileError(f"{self.where(extra[0])}: tensor {extra[0]} is not part "
                                       f"of the model ({len(extra)} such tensors: "
                                       f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''})")
            if device != _arrays.CPU:  # quantize_i2s's work ends before any GEMV reads it
                _ffi.call("device_synchronize", device)
            return Weights(runtime, layers, final_norm, embedding, head)
        except BaseException:
            layers.clear()  # frees what is already on the device (the exception keeps frames)
            embedding = final_norm = head = None
            raise
        finally:
            bar.close()

    def ignored_names(self):
        return [n for n in self.names() if n.endswith(self.ignored)] + \
            ([self.head] if self.config.tied_head and self.head in self.names() else [])

    def take(self, name):
        if name not in self.names():
            raise CorruptFileError(f"{self.path}: tensor {name} is missing")
        self.used.add(name)
        return name

    def dense(self, name, shape):
        """A float tensor as bfloat16 numpy of the given shape."""
        self.take(name)
        kind, got = self.kind(name), self.shape(name)
        if kind not in FLOAT_KINDS:
            raise UnsupportedError(f"{self.where(name)}: tensor {name}: type {kind} is not "
                                   f"supported here (supported: {', '.join(FLOAT_KINDS)})")
        if tuple(got) != tuple(shape):
            raise CorruptFileError(f"{self.where(name)}: tensor {name}: shape {list(got)}, "
                                   f"expected {list(shape)}")
        return np.asarray(self.values(name)).astype(BF16, copy=False)

    def norm(self, prefix, part, width, device):
        if part in names.SUB_NORMS and not self.config.sub_norms:
            return None
        options = [prefix + n for n in self.norm_names[part]]
        present = [n for n in options if n in self.names()]
        return self.put(self.dense(present[0] if present else options[0], (width,)), device)

    def ternary(self, prefix, part, rows, cols, device):
        """The fused projection `part` (its pieces stacked by rows) as TernaryWeights."""
        pieces = [self.piece(prefix + n, r, cols) for n, r in zip(self.ternary_names[part], rows)]
        if all(p[0] == "float" for p in pieces):
            dense = _stack([p[1] for p in pieces])
            if cols % GEMV_K_MULTIPLE:  # down of a padded model, on the host
                return flat_ternary(self.put(dense, _arrays.CPU))
            return quantize_i2s(self.put(dense, device), row_segments=rows)
        if any(p[0] == "float" for p in pieces):
            raise UnsupportedError(f"{self.path}: {prefix}{part}: quantized and unquantized "
                                   "pieces cannot be fused")
        packed, scales = _stack([p[1] for p in pieces]), _stack([p[2] for p in pieces])
        block_scales = None
        if any(p[3] is not None for p in pieces):
            # a piece with one scale per row gets block scales of 1 beside one with block scales
            block_scales = self.put(_stack([np.ones((len(p[2]), cols // SCALE_BLOCK), np.float32)
                                            if p[3] is None else p[3] for p in pieces]), device)
        return TernaryWeights(self.put(packed, device), self.put(scales, device), block_scales)

    def to_device(self, layer, device):
        """A Layer of host arrays copied to `device`."""
        def move(value):
            if value is None:
                return None
            return value.to(device) if isinstance(value, TernaryWeights) else self.put(value, device)
        return Layer(**{f.name: move(getattr(layer, f.name)) for f in dataclasses.fields(layer)})

    @staticmethod
    def put(host, device):
        host = np.ascontiguousarray(host)
        if device == _arrays.CPU:  # the ops take writable arrays aligned to 16 bytes
            aligned = host.ctypes.data % 16 == 0
            return host if host.flags.writeable and aligned else host.copy()
        return _arrays.DeviceArray.from_numpy(host, device)


def _stack(arrays):
    """The arrays stacked by rows (one array as it is, not copied)."""
    return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]


def _progress(total, enabled):
    from tqdm import tqdm
    return tqdm(total=total, desc="loading", unit="layer", disable=not enabled, leave=False)


class HFSource(Source):
    embedding, final_norm, head = names.HF_EMBEDDING, names.HF_FINAL_NORM, names.HF_HEAD
    layer_prefix, ternary_names, norm_names = (names.HF_LAYER_PREFIX, names.HF_TERNARY,
                                               names.HF_NORMS)
    ignored = names.HF_IGNORED

    def __init__(self, directory):
        self.path = directory
        config_path = os.path.join(directory, "config.json")
        try:
            with open(config_path) as f:
                hf = json.load(f)
        except FileNotFoundError:
            raise CorruptFileError(f"{config_path}: missing (a model directory needs "
                                   "config.json)") from None
        except ValueError as exc:
            raise CorruptFileError(f"{config_path}: not JSON ({exc})") from None
        self.config = Config.from_hf(hf, config_path)
        quant = hf.get("quantization_config") or {}
        if quant and quant.get("quant_method") != "bitnet":
            raise UnsupportedError(f"{config_path}: quantization {quant.get('quant_method')!r} "
                                   "is not supported (bitnet only)")
        if quant.get("use_rms_norm"):
            raise UnsupportedError(f"{config_path}: quantization_config.use_rms_norm (a norm "
                                   "inside every linear layer) is not supported")
        self.scale_is_absmean = quant.get("linear_class") == "autobitlinear"
        self.checkpoint = SafetensorsCheckpoint(directory)
        self._names = set(self.checkpoint.names())

    def names(self):
        return self._names

    def where(self, name):
        return self.checkpoint.file_of(name) if name in self._names else self.path

    def kind(self, name):
        return self.checkpoint.dtype(name)

    def shape(self, name):
        return self.checkpoint.shape(name)

    def values(self, name):
        return self.checkpoint.tensor(name)

    def piece(self, name, rows, cols):
        weight = self.take(name + ".weight")
        what = f"{self.where(weight)}: tensor {weight}"
        kind, shape = self.kind(weight), self.shape(weight)
        if kind in FLOAT_KINDS:
            if shape != (rows, cols):
                raise CorruptFileError(f"{what}: shape {list(shape)}, expected [{rows}, {cols}]")
            return "float", self.values(weight), None, None
        if kind != "uint8":
            raise UnsupportedError(f"{what}: type {kind} is not supported (packed uint8, "
                                   f"{', '.join(FLOAT_KINDS)})")
        if shape != (rows // 4, cols):
            raise CorruptFileError(f"{what}: packed shape {list(shape)}, expected "
                                   f"[{rows // 4}, {cols}] (4 weights a byte)")
        scale_name = self.take(name + ".weight_scale")
        scale = np.asarray(self.values(scale_name), dtype=np.float32).reshape(-1)
        if scale.size not in (1, rows):
            raise CorruptFileError(f"{self.where(scale_name)}: tensor {scale_name}: "
                                   f"{scale.size} scales for {rows} rows")
        if not self.scale_is_absmean:
            scale = np.float32(1) / scale
        scales = np.broadcast_to(scale, (rows,)).astype(np.float32)
        return "packed", hf_packed_to_ternary(self.values(weight), what), scales, None


class GGUFSource(Source):
    embedding, final_norm, head = names.GGUF_EMBEDDING, names.GGUF_FINAL_NORM, names.GGUF_HEAD
    layer_prefix, ternary_names, norm_names = (names.GGUF_LAYER_PREFIX, names.GGUF_TERNARY,
                                               names.GGUF_NORMS)
    ignored = names.GGUF_IGNORED
    KINDS = {"F16": "float16", "F32": "float32", "BF16": "bfloat16"}

    def __init__(self, path):
        self.path = path
        self.file = GGUFFile(path)
        if names.GGUF_EMBEDDING not in self.file.tensors:
            raise CorruptFileError(f"{path}: tensor {names.GGUF_EMBEDDING} is missing")
        vocab = self.file.shape(names.GGUF_EMBEDDING)[0]
        self.config = Config.from_gguf(self.file.metadata, vocab,
                                       tied_head=names.GGUF_HEAD not in self.file.tensors,
                                       source=path)
        # llama.cpp stores a llama model's q and k rows permuted for its interleaved RoPE
        self.permuted_qk = self.file.metadata.get("general.architecture") == "llama"

    def names(self):
        return self.file.tensors.keys()

    def where(self, name):
        return self.path

    def kind(self, name):
        kind = self.file.kind(name)
        return self.KINDS.get(kind, kind)

    def shape(self, name):
        return self.file.shape(name)

    def values(self, name):
        raw = self.file.raw(name)  # gguf hands BF16 out as its bytes
        return raw.view(BF16) if self.file.kind(name) == "BF16" else raw

    def piece(self, name, rows, cols):
        weight = self.take(name + ".weight")
        what = f"{self.path}: tensor {weight}"
        kind = require(self.file, weight, ("I2_S", "TQ1_0", "TQ2_0", "F16", "F32", "BF16"))
        shape = self.file.shape(weight)
        if shape != (rows, cols):
            raise CorruptFileError(f"{what}: shape {list(shape)}, expected [{rows}, {cols}]")
        extra = 1.0
        if name + ".scale" in self.names():  # llama.cpp's optional per-tensor factor
            extra = float(np.asarray(self.values(self.take(name + ".scale"))).reshape(-1)[0])
        if kind in self.KINDS:
            codes, scale = float_to_codes(self.values(weight), what)
            packed = flat_ternary(codes, scale * extra).packed
            return ("packed", self.unpermute(name, packed),
                    np.full(rows, scale * extra, np.float32), None)
        block_scales = None
        if kind == "I2_S":
            packed, scale = i2s_to_ternary(self.values(weight), rows, cols, what)
            scales = np.full(rows, scale * extra, np.float32)
        else:
            codes, scales, block_scales = tq_to_codes(self.values(weight), kind, rows, cols, what)
            try:
                packed = pack_ternary(codes, scales).packed
            except BitNetError as exc:
                raise CorruptFileError(f"{what}: {exc}") from None
            scales = scales * np.float32(extra)
        if block_scales is not None:
            block_scales = self.unpermute(name, block_scales)
        return ("packed", self.unpermute(name, packed), self.unpermute(name, scales),
                block_scales)

    def unpermute(self, name, rows):
        """Undoes llama.cpp's q/k row permutation (interleaved RoPE pairs back to halves)."""
        if not self.permuted_qk or not name.endswith(("attn_q", "attn_k")):
            return rows
        c = self.config
        heads = c.heads if name.endswith("attn_q") else c.kv_heads
        shape = rows.shape
        return np.ascontiguousarray(rows.reshape(heads, c.head_dim // 2, 2, *shape[1:])
                                    .swapaxes(1, 2)).reshape(shape)
