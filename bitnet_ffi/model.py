"""A BitNet b1.58 model run entirely through libbitnet's ops: the main job (`python -m bitnet_ffi
demo`).

The shapes are BitNet b1.58 2B4T's: hidden 2560, intermediate 6912, 30 layers, 20 query and 5 KV
heads of dimension 128, vocabulary 128256, RMSNorm eps 1e-5, RoPE theta 500000, a squared-ReLU
gated FFN, sub-norms before the output and down projections, no biases, the embedding tied to the
output head. Weights are seeded random floats quantized by ``quantize_i2s`` (one scale per part of
the fused QKV and gate|up projections). Activations and the residual stream are bfloat16; each
ternary layer's input is quantized to int8 per token by the norm before it.

On a GPU every buffer is a ``DeviceArray`` and the decode step is captured once as a CUDA graph and
replayed: no host round trip, allocation or synchronization per token.
"""
import time
from dataclasses import dataclass

import numpy as np

from . import _arrays, _ffi
from .attention import attention, attention_workspace_size
from .config import Config
from .cuda_graph import Graph, Stream
from .decode_layer import decode_layer, decode_layer_workspace_size, fused_layer_supported
from .errors import InvalidArgumentError
from .fused_norm import (gemv_w2a8_add_norm_stats, norm_stats_slots, rmsnorm_gemv_w2a8,
                         rmsnorm_gemv_w2a8_rope_append_kv)
from .head import add_int32, argmax, embedding, gemv_bf16
from .layer_glue import attention_rope_append_kv, gemv_w2a8_rope_append_kv, rope_append_kv
from .norm import (add_rmsnorm, glu_rmsnorm_quantize, relu2_rmsnorm_quantize, rmsnorm,
                   rmsnorm_quantize)
from .sampling import sample, sampling_settings
from .ternary import gemv_w2a8, quantize_a8, quantize_i2s

BF16 = "bfloat16"


BITNET_2B4T = Config()
# Small enough for a numpy reference and a CPU test, with every kernel's constraints still met.
TINY = Config(hidden=256, intermediate=384, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=1000)


@dataclass
class Layer:
    qkv: object          # TernaryWeights [q_dim + 2 kv_dim, H], scales per part (Q, K, V)
    o: object            # [H, q_dim]
    gate_up: object      # [2 I, H], scales per part (gate, up)
    down: object         # [H, I]
    attn_norm: object    # bfloat16 [H] each, the o sub-norm [q_dim], the down sub-norm [I]
    ffn_norm: object
    attn_sub_norm: object = None  # None where the config has no sub-norms
    ffn_sub_norm: object = None


@dataclass
class Weights:
    config: Config
    layers: list
    final_norm: object
    embedding: object    # bfloat16 [V, H]
    head: object = None  # bfloat16 [V, H]; None: tied to the embedding

    @property
    def output_head(self):
        return self.embedding if self.head is None else self.head


def random_weights(config, device, seed=0, progress=None):
    """Seeded random weights, the ternary ones quantized by quantize_i2s on `device`."""
    rng = np.random.default_rng(seed)
    H, I, Q, kv = config.hidden, config.intermediate, config.q_dim, config.kv_dim
    bf16 = _arrays.numpy_dtype(BF16)

    def put(host):
        return host if device == _arrays.CPU else _arrays.DeviceArray.from_numpy(host, device)

    def ternary(rows, cols, segments=None):
        dense = put(rng.standard_normal((rows, cols), dtype=np.float32))
        return quantize_i2s(dense, row_segments=segments)

    def norm(width):
        return put((1.0 + 0.1 * rng.standard_normal(width)).astype(bf16))

    layers = []
    for index in range(config.layers):
        layers.append(Layer(
            qkv=ternary(Q + 2 * kv, H, [Q, kv, kv]),
            o=ternary(H, Q), gate_up=ternary(2 * I, H, [I, I]), down=ternary(H, I),
            attn_norm=norm(H), attn_sub_norm=norm(Q), ffn_norm=norm(H), ffn_sub_norm=norm(I)))
        if progress:
            progress(index + 1, config.layers)
    table = put((0.5 * rng.standard_normal((config.vocab, H), dtype=np.float32)).astype(bf16))
    return Weights(config, layers, norm(H), table)


def qkv_rope_supported(config, layers, batch):
    """Whether a decode step of `batch` sequences can take gemv_w2a8_rope_append_kv for each
    layer's QKV projection and RoPE: one sequence, a head dim that is a multiple of 4, one scale
    per row of the QKV weights."""
    return (batch == 1 and config.head_dim % 4 == 0
            and all(layer.qkv.block_scales is None for layer in layers))


def rope_attention_supported(config, device):
    """Whether a decode step can take attention_rope_append_kv for each layer's RoPE, KV-cache
    append and attention: a head dim of 64, 128 or 256 and, on a GPU, at most 64 query heads per
    KV head."""
    return config.head_dim in (64, 128, 256) and (
        device == _arrays.CPU or config.heads // config.kv_heads <= 64)


def fuse_norms_supported(config, layers, batch):
    """Whether a decode step of `batch` sequences can take the input norms inside the GEMVs around
    them (bitnet_ffi.fused_norm): one sequence, a hidden size the GPU kernel takes (K <= 8192),
    eps > 0, and one scale per row of the QKV, o, gate|up and down weights."""
    return (batch == 1 and config.hidden <= 8192 and config.eps > 0
            and all(getattr(layer, name).block_scales is None
                    for layer in layers for name in ("qkv", "o", "gate_up", "down")))


class Session:
    """Buffers, KV cache and the step function for `batch` sequences of up to `capacity` tokens.

    ``prefill(prompt)`` runs a [batch, P] prompt and returns the first tokens; ``decode()`` then
    produces one token per sequence per call, ``extend(ids)`` appends a block of tokens (a chat
    turn), ``logits`` is the float32 [batch, V] of the last step. ``only`` (a set of op kinds) makes a step issue
    just those ops, for the per-op time breakdown.

    fused: a one-sequence decode step runs each layer as one ``decode_layer`` op (the same values
    up to float32 sum orders) instead of the op sequence. Off by default: on the GPU that kernel
    is still slower than the op sequence (docs/decode_layer.md); tools/bench_decode.py compares
    the two.

    fuse_qkv_rope: where qkv_rope_supported, a one-sequence decode step takes the QKV projection,
    RoPE and the KV-cache append as one ``gemv_w2a8_rope_append_kv`` op (the same values as the
    two ops it replaces). On by default; off, for comparing the two.

    fuse_norms: where fuse_norms_supported, a one-sequence decode step runs each input norm inside
    the GEMVs around it: the o and down projections add to h and leave the norm's statistics, the
    QKV and gate|up projections quantize rmsnorm(h) from them (bitnet_ffi.fused_norm; the same
    codes up to the float32 rounding of the sum of squares). On by default; off, for comparing.

    fuse_rope_attention: where rope_attention_supported, a decode step that does not take the
    QKV projection with RoPE (more than one sequence) runs RoPE, the KV-cache append and attention
    as one ``attention_rope_append_kv`` op (the same values as the two ops it replaces; a decode
    step's seq_lens are its positions + 1). On by default; off, for comparing."""

    KINDS = ("embedding", "rmsnorm (+int8)", "gemv_w2a8", "rope + kv append",
             "qkv + rope + kv append", "gemv_w2a8 + norm", "attention",
             "rope + kv append + attention",
             "decode layer (fused)", "output head", "argmax", "bookkeeping")

    def __init__(self, weights, batch, capacity, device, fused=False, fuse_qkv_rope=True,
                 fuse_norms=True, fuse_rope_attention=True):
        self.w, self.config, self.batch, self.capacity = weights, weights.config, batch, capacity
        self.device = device
        self.stream = Stream(device) if device != _arrays.CPU else None
        self.only = None
        self.times = None  # on the CPU: seconds per op kind of the last step, when not None
        c = self.config
        cache = (batch, capacity, c.kv_heads, c.head_dim)
        self.k_cache = [self.alloc(cache, BF16) for _ in range(c.layers)]
        self.v_cache = [self.alloc(cache, BF16) for _ in range(c.layers)]
        # positions[b]: where sequence b's next token goes; seq_lens[b]: the keys its next step sees.
        # One allocation, so that one copy sets both (set_counters).
        self.counters = self.alloc((2, batch), "int32")
        self.positions = self.counters[0:1].reshape(batch)
        self.seq_lens = self.counters[1:2].reshape(batch)
        if fused and not (batch == 1 and fused_layer_supported(weights, device)):
            raise InvalidArgumentError("Session: fused decode layers need batch 1 and weights "
                                       "that decode_layer supports (fused_layer_supported)")
        self.fused = fused
        self.fuse_qkv_rope = fuse_qkv_rope and qkv_rope_supported(c, weights.layers, batch)
        self.fuse_norms = fuse_norms and fuse_norms_supported(c, weights.layers, batch)
        self.fuse_rope_attention = fuse_rope_attention and rope_attention_supported(c, device)
        self.decode_buffers = self.buffers(1)
        self.extend_buffers = None  # (steps, the buffers of the last extend), kept for the next
        self.extend_graph = None    # their forward pass, captured when the same steps come again
        self.extend_last_rows = None  # what their last_rows holds
        self.graph = None
        self.sampling = None
        self.logits = None

    def alloc(self, shape, dtype):
        if self.device == _arrays.CPU:
            return np.empty(shape, dtype=_arrays.numpy_dtype(dtype))
        return _arrays.DeviceArray(shape, dtype, self.device)

    def upload(self, host, target):
        """Copies host values into an existing buffer (outside any timed or captured region)."""
        host = np.ascontiguousarray(host, dtype=target.dtype if isinstance(target, np.ndarray)
                                    else _arrays.numpy_dtype(target.dtype))
        if self.device == _arrays.CPU:
            target[...] = host.reshape(target.shape)
            return
        self.synchronize()  # the buffer may still be in use on the session's stream
        _ffi.call("memcpy", _ffi.ffi.cast("void *", target.ptr),
                  _ffi.ffi.cast("void *", host.ctypes.data), host.nbytes,
                  _ffi.lib().BITNET_COPY_HOST_TO_DEVICE, _ffi.ffi.NULL)

    def download(self, array):
        return array if self.device == _arrays.CPU else array.numpy()

    def copy(self, source, target):
        """Copies one buffer into another of the same size, on the session's stream."""
        if self.device == _arrays.CPU:
            target[...] = source
            return
        _ffi.call("memcpy", _ffi.ffi.cast("void *", target.ptr),
                  _ffi.ffi.cast("void *", source.ptr), source.nbytes,
                  _ffi.lib().BITNET_COPY_DEVICE_TO_DEVICE,
                  _ffi.ffi.cast("void *", _arrays.stream_handle(self.stream)))

    def set_counters(self, positions, seq_lens):
        """positions and seq_lens (host integers, one per sequence) in one copy."""
        self.upload(np.stack([positions, seq_lens]), self.counters)

    def synchronize(self):
        if self.stream is not None:
            self.stream.synchronize()

    def buffers(self, steps):
        """The activations of `steps` tokens per sequence (1 for decode, P for a prompt)."""
        c, N = self.config, self.batch * steps
        H, I = c.hidden, c.intermediate
        q_shape = (self.batch, steps, c.heads, c.head_dim)
        b = {"ids": self.alloc((N,), "int32"), "h": self.alloc((N, H), BF16),
             "x_q": self.alloc((N, max(H, I, c.q_dim)), "int8"), "x_s": self.alloc((N,), "float32"),
             "attn": self.alloc(q_shape, BF16),
             "proj": self.alloc((N, H), BF16), "gate_up": self.alloc((N, 2 * I), BF16),
             "y": self.alloc((N, H), BF16),
             "last": self.alloc((self.batch, H), BF16),
             "logits": self.alloc((self.batch, c.vocab), "float32")}
        # decode writes the next ids over the ones it has read; a prompt has more ids than that
        b["next"] = b["ids"] if steps == 1 else self.alloc((self.batch,), "int32")
        b["qkv"] = self.alloc((N, c.q_dim + 2 * c.kv_dim), BF16)
        b["q"] = self.alloc(q_shape, BF16)
        ws = attention_workspace_size(self.device, self.batch, steps, c.heads, c.kv_heads,
                                      c.head_dim, self.capacity)
        b["workspace"] = self.alloc((ws,), "uint8") if ws else None
        if steps == 1 and self.fuse_norms:
            b["stats"] = self.alloc((norm_stats_slots(self.device), 2), "float32")
        if steps == 1 and self.fused:
            b["layer_workspace"] = self.alloc(
                (decode_layer_workspace_size(c, self.device, BF16),), "uint8")
        if steps > 1:  # rows of each sequence's last token, to gather for the output head (extend)
            b["last_rows"] = self.alloc((self.batch,), "int32")
        return b

    def op(self, kind, fn, *args, **kwargs):
        """Runs one op on the session's stream, unless `only` leaves its kind out."""
        if self.only is not None and kind not in self.only:
            return None
        if self.times is None:
            return fn(*args, stream=self.stream, **kwargs)
        start = time.perf_counter()
        result = fn(*args, stream=self.stream, **kwargs)
        self.times[kind] = self.times.get(kind, 0.0) + time.perf_counter() - start
        return result

    def norm_quantize(self, x, weight, b, residual=None, eps=None):
        """int8 rows of rmsnorm(x), or of rmsnorm(residual += x), for the next ternary layer;
        with no weight (a model without that sub-norm), of x itself. eps: the config's by
        default."""
        rows, width = x.shape[0], x.shape[1]
        x_q, x_s = _arrays.first_rows(b["x_q"], rows, width), b["x_s"][:rows]
        if weight is None:
            self.op("rmsnorm (+int8)", quantize_a8, x, out=(x_q, x_s))
        else:
            self.op("rmsnorm (+int8)", rmsnorm_quantize, x, weight,
                    eps=self.config.eps if eps is None else eps, residual=residual,
                    out=(x_q, x_s))
        return x_q, x_s

    def gate_quantize(self, gate_up, weight, b):
        """int8 rows of [rmsnorm](act(gate) * up) from the [rows, 2 I] gate|up projection."""
        c = self.config
        rows = gate_up.shape[0]
        x_q, x_s = _arrays.first_rows(b["x_q"], rows, c.intermediate), b["x_s"][:rows]
        if c.activation == "relu2" and weight is not None:
            self.op("rmsnorm (+int8)", relu2_rmsnorm_quantize, gate_up, weight,
                    eps=c.ffn_sub_eps, out=(x_q, x_s))
        else:
            self.op("rmsnorm (+int8)", glu_rmsnorm_quantize, gate_up, weight,
                    activation=c.activation, eps=c.ffn_sub_eps, out=(x_q, x_s))
        return x_q, x_s

    def project(self, weights, x_q, x_s, out):
        self.op("gemv_w2a8", gemv_w2a8, weights, x_q, x_s, out_dtype=BF16, out=out)

    def layers(self, b, steps, progress=None):
        """Every layer as a sequence of ops over `steps` tokens per sequence, from b["h"]; leaves
        the last layer's down projection in b["proj"], still to be added to b["h"]."""
        c, w = self.config, self.w
        N = self.batch * steps
        fuse_norms = steps == 1 and self.fuse_norms
        qkv_rope = steps == 1 and self.fuse_qkv_rope  # RoPE in the QKV projection
        rope_attention = steps == 1 and not qkv_rope and self.fuse_rope_attention  # in attention
        residual = None
        for index, layer in enumerate(w.layers):
            # attention block: h += o_proj(sub_norm(attention(rope(qkv(norm(h))))))
            normed = fuse_norms and index > 0  # the previous down projection left the stats
            if not normed:
                x_q, x_s = (self.norm_quantize(b["h"], layer.attn_norm, b) if residual is None else
                            self.norm_quantize(b["proj"], layer.attn_norm, b, residual=residual))
            if qkv_rope:
                if normed:
                    self.op("gemv_w2a8 + norm", rmsnorm_gemv_w2a8_rope_append_kv, b["h"],
                            layer.attn_norm, b["stats"], layer.qkv, self.k_cache[index],
                            self.v_cache[index], self.positions, eps=c.eps, theta=c.theta,
                            out=b["q"])
                else:
                    self.op("qkv + rope + kv append", gemv_w2a8_rope_append_kv, layer.qkv, x_q,
                            x_s, self.k_cache[index], self.v_cache[index], self.positions,
                            theta=c.theta, out=b["q"])
            else:
                if normed:
                    self.op("gemv_w2a8 + norm", rmsnorm_gemv_w2a8, b["h"], layer.attn_norm,
                            b["stats"], layer.qkv, eps=c.eps, out_dtype=BF16, out=b["qkv"])
                else:
                    self.project(layer.qkv, x_q, x_s, b["qkv"])
                qkv = b["qkv"].reshape(self.batch, steps, c.heads + 2 * c.kv_heads, c.head_dim)
            if rope_attention:
                self.op("rope + kv append + attention", attention_rope_append_kv, qkv,
                        self.k_cache[index], self.v_cache[index], self.positions, theta=c.theta,
                        scale=c.attention_scale, out=b["attn"], workspace=b["workspace"])
            else:
                if not qkv_rope:
                    self.op("rope + kv append", rope_append_kv, qkv, self.k_cache[index],
                            self.v_cache[index], self.positions, theta=c.theta, out=b["q"])
                self.op("attention", attention, b["q"], self.k_cache[index], self.v_cache[index],
                        causal=True, scale=c.attention_scale, seq_lens=self.seq_lens,
                        out=b["attn"], workspace=b["workspace"])
            attn = _arrays.first_rows(b["attn"], N, c.q_dim)
            a_q, a_s = self.norm_quantize(attn, layer.attn_sub_norm, b, eps=c.attn_sub_eps)
            # FFN block: h += down(sub_norm(act(gate) * up)), its input norm fused with the add
            if fuse_norms:
                self.op("gemv_w2a8 + norm", gemv_w2a8_add_norm_stats, layer.o, a_q, a_s, b["h"],
                        layer.ffn_norm, stats=b["stats"])
                self.op("gemv_w2a8 + norm", rmsnorm_gemv_w2a8, b["h"], layer.ffn_norm,
                        b["stats"], layer.gate_up, eps=c.eps, out_dtype=BF16, out=b["gate_up"])
            else:
                self.project(layer.o, a_q, a_s, b["proj"])
                f_q, f_s = self.norm_quantize(b["proj"], layer.ffn_norm, b, residual=b["h"])
                self.project(layer.gate_up, f_q, f_s, b["gate_up"])
            g_q, g_s = self.gate_quantize(b["gate_up"], layer.ffn_sub_norm, b)
            if fuse_norms and index + 1 < len(w.layers):
                self.op("gemv_w2a8 + norm", gemv_w2a8_add_norm_stats, layer.down, g_q, g_s,
                        b["h"], w.layers[index + 1].attn_norm, stats=b["stats"])
            else:
                self.project(layer.down, g_q, g_s, b["proj"])
            residual = b["h"]
            if progress:
                progress(index + 1, len(w.layers))

    def forward(self, b, steps, progress=None):
        """One pass of every layer over `steps` tokens per sequence whose ids are in b["ids"];
        writes the greedy next token of each sequence to b["next"]. progress(done, total) is called
        after each layer's ops are issued."""
        c, w = self.config, self.w
        self.op("embedding", embedding, w.embedding, b["ids"], out=b["h"])
        if steps == 1 and self.fused:
            for index, layer in enumerate(w.layers):
                self.op("decode layer (fused)", decode_layer, c, layer, b["h"],
                        self.k_cache[index], self.v_cache[index], self.positions,
                        workspace=b["layer_workspace"])
                if progress:
                    progress(index + 1, len(w.layers))
            self.op("rmsnorm (+int8)", rmsnorm, b["h"], w.final_norm, eps=c.eps, out=b["y"])
        else:
            self.layers(b, steps, progress)
            self.op("rmsnorm (+int8)", add_rmsnorm, b["proj"], b["h"], w.final_norm, eps=c.eps,
                    out=b["y"])
        last = b["y"]
        if steps > 1:  # only each sequence's last token goes through the output head
            self.op("output head", embedding, b["y"], b["last_rows"], out=b["last"])
            last = b["last"]
        self.op("output head", gemv_bf16, w.output_head, last, out=b["logits"])
        if self.sampling is None:
            self.op("argmax", argmax, b["logits"], out=b["next"])
        else:  # the draw of row n is a function of (seed, n, positions[n])
            self.op("argmax", sample, b["logits"], counters=self.positions, out=b["next"],
                    **self.sampling)
        # the new tokens now sit in the cache: the next step starts after them and sees one more
        self.op("bookkeeping", add_int32, self.positions, steps)
        self.op("bookkeeping", add_int32, self.seq_lens, 1)

    def prefill(self, prompt, lengths=None, progress=None):
        """Starts every sequence afresh with a [batch, P] prompt (row b's first lengths[b] ids,
        all P by default); returns the next token of each sequence. progress: as forward's."""
        return self._extend(prompt, lengths, progress, np.zeros(self.batch, dtype=np.int32))

    def extend(self, ids, lengths=None, progress=None):
        """Appends a [batch, T] block of ids (row b's first lengths[b]) to every sequence at its
        position and returns the next token of each (argmax, or drawn as set_sampling says).
        Rows are right-padded: a padding token's cache row is overwritten by the next step. The
        activation buffers of T tokens stay for the next block of the same T (session.logits is
        one of them); on a GPU, that next block captures the pass as a CUDA graph, which every
        later block of T tokens replays. progress: as forward's."""
        return self._extend(ids, lengths, progress, self.download(self.positions).copy())

    def _extend(self, ids, lengths, progress, start):
        """extend from the sequences' positions `start` (host integers). Each host copy waits
        for the device, so there are as few as a block needs: a block of the last block's T with
        every length T takes three (the counters, the ids, the new tokens), and extend one more
        to read the positions."""
        ids = np.asarray(ids, dtype=np.int32)
        steps = ids.shape[1]
        lengths = np.full(self.batch, steps) if lengths is None else np.asarray(lengths)
        if ids.shape[0] != self.batch or lengths.shape != (self.batch,) or \
                (lengths < 1).any() or (lengths > steps).any():
            raise InvalidArgumentError(f"extend: expected ids [{self.batch}, T] and {self.batch} "
                                       f"lengths in [1, T], got {list(ids.shape)} and {lengths}")
        if (start + steps > self.capacity).any():
            raise InvalidArgumentError(f"extend: {steps} more tokens overflow the KV cache of "
                                       f"{self.capacity} (positions {start.tolist()})")
        repeated = self.extend_buffers is not None and self.extend_buffers[0] == steps
        if not repeated:
            self.extend_buffers = self.extend_graph = None  # the old ones go before the new come
            self.extend_buffers = (steps, self.buffers(steps))
            self.extend_last_rows = None
        b = self.extend_buffers[1]
        self.upload(ids.reshape(-1), b["ids"])
        last_rows = np.arange(self.batch) * steps + lengths - 1
        if steps > 1 and not np.array_equal(last_rows, self.extend_last_rows):
            self.upload(last_rows, b["last_rows"])
            self.extend_last_rows = last_rows
        self.set_counters(start, start + steps)
        if self.stream is not None and repeated:
            if self.extend_graph is None:
                with Graph.capture(self.stream) as graph:
                    self.forward(b, steps)
                self.extend_graph = graph
            self.extend_graph.launch()
            if progress:
                progress(len(self.w.layers), len(self.w.layers))
        else:
            self.forward(b, steps, progress)
        self.copy(b["next"], self.decode_buffers["ids"])
        if (lengths != steps).any():  # forward's bookkeeping counted all `steps` tokens
            self.set_counters(start + lengths, start + lengths + 1)
        self.synchronize()
        self.logits = b["logits"]
        return self.download(b["next"]).copy()

    def rewind(self, length):
        """Forgets every sequence's tokens from `length` on (their cache rows get overwritten)."""
        self.set_counters(np.full(self.batch, length), np.full(self.batch, length + 1))

    def set_sampling(self, temperature=0.0, top_k=0, top_p=1.0, seed=0):
        """Greedy (argmax) at temperature 0, else the device's sample op inside the step."""
        sampling = sampling_settings(temperature, top_k, top_p, seed)
        if sampling != self.sampling:
            # the captured steps hold the old draw: capture again
            self.sampling, self.graph, self.extend_graph = sampling, None, None

    def capture(self):
        """The decode step as a CUDA graph (GPU only)."""
        with Graph.capture(self.stream) as graph:
            self.forward(self.decode_buffers, 1)
        return graph

    def time_decode(self, replays):
        """(ms per step, {op kind: ms}) of the captured decode step on a GPU, every timed run of
        `replays` back-to-back replays starting from the sequences' positions and input tokens now,
        which are put back afterwards. Each op kind's time comes from its ops captured alone and
        replayed the same way. The replays must stay inside the KV cache: a step past its end is skipped by the
        kernels (rope and attention do no work), which would time a step that computes nothing."""
        positions = self.download(self.positions).copy()
        seq_lens = self.download(self.seq_lens).copy()
        ids = self.download(self.decode_buffers["ids"]).copy()
        if (positions + replays + 1 > self.capacity).any():
            raise InvalidArgumentError(f"time_decode: {replays} replays from positions "
                                       f"{positions.tolist()} overflow the KV cache of "
                                       f"{self.capacity}")

        def reset():
            self.set_counters(positions, seq_lens)
            self.upload(ids, self.decode_buffers["ids"])

        if self.graph is None:
            self.graph = self.capture()
        step_ms = self.graph.time_ms(replays, reset)
        breakdown = {}
        # the kinds the decode step issues: a fused layer replaces the per-layer projections, RoPE
        # and attention (its norms are inside it too; the final norm stays apart); otherwise RoPE
        # comes with the QKV projection, with attention or apart, and the input norms inside the
        # GEMVs or apart
        absent = ({"gemv_w2a8", "rope + kv append", "qkv + rope + kv append", "gemv_w2a8 + norm",
                   "attention", "rope + kv append + attention"} if self.fused
                  else {"decode layer (fused)"})
        if not self.fused:
            if self.fuse_qkv_rope:
                absent |= {"rope + kv append", "rope + kv append + attention"}
            elif self.fuse_rope_attention:
                absent |= {"qkv + rope + kv append", "rope + kv append", "attention"}
            else:
                absent |= {"qkv + rope + kv append", "rope + kv append + attention"}
            if not self.fuse_norms:
                absent.add("gemv_w2a8 + norm")
        kinds = [k for k in self.KINDS if k not in absent]
        for kind in kinds:
            self.only = {kind}
            breakdown[kind] = self.capture().time_ms(replays, reset)
        self.only = None
        reset()
        return step_ms, breakdown

    def decode(self, ids=None):
        """One decode step (a graph replay on the GPU); returns the tokens it produced. `ids`
        (host integers, one per sequence) replaces the step's input tokens, which are otherwise
        the last step's outputs: teacher forcing, for comparing two runs step by step."""
        if ids is not None:
            self.upload(np.asarray(ids, dtype=np.int32), self.decode_buffers["ids"])
        if self.stream is None:
            self.forward(self.decode_buffers, 1)
        else:
            if self.graph is None:
                self.graph = self.capture()
            self.graph.launch()
            self.stream.synchronize()
        self.logits = self.decode_buffers["logits"]
        return self.download(self.decode_buffers["ids"]).copy()
