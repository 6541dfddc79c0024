"""Tensor-parallel decode of the BitNet model over `world` ranks (one process per GPU, or threads on
the CPU for tests), in the Megatron layout:

- QKV and gate|up split by output rows (each rank has heads / world query heads, kv_heads / world
  KV heads and its KV cache, intermediate / world FFN columns); o and down split by input columns.
- BitNet's sub-norms (before o and before down) need the whole row's sum of squares, a scalar per
  token, and nothing else of the other ranks: each rank applies its slice of the norm's weight to
  its own slice of the row, quantizes it to int8 with its own scale (rmsnorm_partial: not divided
  by the RMS), runs its part of the projection into float32 partial sums, and appends its slice's
  sum of squares; one all-reduce sums both and divides each row by sqrt(sum / width + eps), rounded
  to bfloat16 once (comm's all_reduce_rms). Each rank's int8 grid is at least as fine as one scale
  for the whole row would be, so each value differs from one GPU's by at most one of one GPU's
  int8 steps: the projections differ by int8 rounding noise, which a random model's later layers
  amplify (docs/tensor_parallel.md gives the figures; greedy tokens may part at near-ties).
- Models without those sub-norms (the Llama layout: Falcon3, Llama3-1.58) quantize each rank's
  slice of o's and down's inputs to int8 with its own scale, and the all-reduce sums the float32
  partial outputs.
- The output head is split by vocabulary; the ranks' logits are all-gathered and every rank takes
  the same argmax (numpy's tie rule over the whole vocabulary, as one GPU), or, with
  set_sampling, the same draw of the sample op.
The ranks agree bit for bit (the all-reduce adds in rank order on every rank).

Per layer a decode step makes 2 collectives (the all-reduces after o and down), plus one gather
for the head; on one rank none, and the step is the unsplit model's (model.Session's ops, in its
order).

The exact layout (``exact=True``: ``exact_split``) gives one GPU's logits bit for bit, so the same
greedy tokens, for more work per rank: every rank computes Q, K, V and attention for all heads
(its KV cache holds every head), then o, gate|up and down are split by output rows and each
projection's rows are all-gathered. Every norm and int8 quantization then sees the whole row, as on
one GPU, and a row's output is an exact integer dot scaled by the same rule whatever rows the
kernel runs beside it. Per layer 3 all-gathers; the QKV weights and attention are not divided.

The step is captured as one CUDA graph per rank (the collectives run on the step's stream). Batch 1
only; a prompt goes through the same ops in passes of up to PREFILL_CHUNK tokens (in the exact
layout one token at a time where the ranks' pieces differ in size), a pass of that many tokens
captured as a graph too. Pieces may differ in size (``split``: 5 KV heads over 2 ranks are 3 and
2). The model needs only the Config and ``Shard``s: ``shard_weights`` slices a full model
(model.Weights on the host; ``load_shard`` reads a checkpoint for it), ``random_shard`` makes a
rank's random weights directly in packed form on its device (a 70B shape's 17 GB would take far
too long to quantize from floats)."""
import itertools
import time
from dataclasses import dataclass

import numpy as np

from . import _arrays, _ffi
from ._arrays import CPU, DeviceArray
from .attention import attention, attention_workspace_size
from .cuda_graph import Graph, Stream
from .errors import InvalidArgumentError, RankFailedError, UnsupportedError
from .head import add_int32, argmax, embedding, gemv_bf16
from .layer_glue import gemv_w2a8_rope_append_kv, rope_append_kv
from .model import qkv_rope_supported
from .norm import (add_rmsnorm, glu_rmsnorm_partial, glu_rmsnorm_quantize, rmsnorm_partial,
                   rmsnorm_quantize)
from .padding import GEMV_K_MULTIPLE, padded_config
from .sampling import sample, sampling_settings
from .ternary import SCALE_BLOCK, TernaryWeights, gemv_w2a8, quantize_a8

BF16 = "bfloat16"
TABLE_BLOCK_ROWS = 4096  # random_shard's embedding: this many random rows, repeated
PREFILL_CHUNK = 256  # most prompt tokens a prefill pass takes (fewer where peer buffers are small)
PEER_BYTES = 16 << 20  # peer buffers for a pass of PREFILL_CHUNK tokens up to hidden 16383


@dataclass(frozen=True)
class Split:
    """How a Config divides over `world` ranks, per rank: KV heads (each with its G = heads /
    kv_heads query heads), FFN columns and vocabulary rows. As even as the units allow (5 KV heads
    over 2 ranks: 3 and 2), so every rank's pieces may differ in size."""
    world: int
    kv_heads: tuple
    heads: tuple
    intermediate: tuple
    vocab: tuple

    @staticmethod
    def start(sizes, rank):
        return sum(sizes[:rank])


@dataclass(frozen=True)
class ExactSplit:
    """The exact layout over `world` ranks, per rank: rows of o and of down (`hidden`), rows of the
    fused gate|up projection (`gate_up`) and vocabulary rows. Attention is not divided."""
    world: int
    hidden: tuple
    gate_up: tuple
    vocab: tuple

    start = staticmethod(Split.start)


ROW_UNIT = 16  # the exact layout's pieces are multiples of this many rows where the size allows


def _even(units, world):
    return tuple(units // world + (1 if r < units % world else 0) for r in range(world))


def split(config, world):
    """The Split of `config` over `world` ranks; UnsupportedError names every constraint broken."""
    c = config
    problems = []
    if padded_config(c) is not c:
        problems.append(f"head dim {c.head_dim} and intermediate {c.intermediate} run in a padded "
                        "layout: split padded_config(config)")
    if c.heads % c.kv_heads:
        problems.append(f"heads = {c.heads} is not a multiple of kv_heads = {c.kv_heads}")
    if c.kv_heads < world:
        problems.append(f"kv_heads = {c.kv_heads} < world = {world} (KV heads are not replicated; "
                        "the exact layout, --tp-exact, runs attention whole on every rank)")
    if problems:
        raise UnsupportedError(f"tensor parallelism over {world} ranks: " + "; ".join(problems))
    kv = _even(c.kv_heads, world)
    heads = tuple(k * (c.heads // c.kv_heads) for k in kv)
    widths = [h * c.head_dim for h in heads]
    if any(w % GEMV_K_MULTIPLE for w in widths):
        raise UnsupportedError(f"tensor parallelism over {world} ranks: the ranks' attention "
                               f"widths {widths} (the o projection's K) must be multiples of "
                               f"{GEMV_K_MULTIPLE}")
    inter = tuple(GEMV_K_MULTIPLE * u for u in _even(c.intermediate // GEMV_K_MULTIPLE, world))
    return Split(world, kv, heads, inter, _even(c.vocab, world))


def _even_rows(rows, world):
    if rows % ROW_UNIT or rows // ROW_UNIT < world:
        return _even(rows, world)
    return tuple(ROW_UNIT * u for u in _even(rows // ROW_UNIT, world))


def exact_split(config, world):
    """The ExactSplit of `config` over `world` ranks (every piece at least one row)."""
    c = config
    if padded_config(c) is not c:
        raise UnsupportedError(f"tensor parallelism over {world} ranks: head dim {c.head_dim} and "
                               f"intermediate {c.intermediate} run in a padded layout: split "
                               "padded_config(config)")
    if min(c.hidden, c.vocab) < world:
        raise UnsupportedError(f"tensor parallelism over {world} ranks: hidden {c.hidden} or "
                               f"vocab {c.vocab} has fewer rows than ranks")
    return ExactSplit(world, _even_rows(c.hidden, world), _even_rows(2 * c.intermediate, world),
                      _even(c.vocab, world))


@dataclass
class ShardLayer:
    """One layer's pieces. Split layout: qkv [(heads_r + 2 kv_heads_r) * head_dim, H], this rank's
    Q, K, V rows; o [H, heads_r * head_dim], its input columns; gate_up [2 I_r, H], its gate rows
    then its up rows; down [H, I_r]; the sub-norms' slices [heads_r * head_dim] and [I_r]. Exact
    layout: qkv and the norms whole; o, gate_up and down this rank's rows (ExactSplit)."""
    qkv: object
    o: object
    gate_up: object
    down: object
    attn_norm: object
    attn_sub_norm: object
    ffn_norm: object
    ffn_sub_norm: object


@dataclass
class Shard:
    config: object
    split: Split
    rank: int
    layers: list
    final_norm: object
    embedding: object  # bfloat16 [V, H], whole (the lookup needs every row)
    head: object       # bfloat16 [V_r, H]: this rank's vocabulary rows of the output head


def _rows(ranges):
    """Row indices of several (start, stop) ranges, in order."""
    return np.concatenate([np.arange(a, b) for a, b in ranges])


class _Slicer:
    """Cuts rank `rank`'s pieces out of full host layers (split or exact layout) and uploads them
    to `device`."""

    def __init__(self, config, rank, world, device, exact=False):
        c, D = config, config.head_dim
        self.config, self.rank, self.device, self.exact = c, rank, device, exact
        self.split = sp = exact_split(c, world) if exact else split(c, world)
        if exact:
            self.h0, self.h = sp.start(sp.hidden, rank), sp.hidden[rank]
            self.g0, self.g = sp.start(sp.gate_up, rank), sp.gate_up[rank]
        else:
            self.q0, self.q = sp.start(sp.heads, rank) * D, sp.heads[rank] * D
            self.k0, self.kv = sp.start(sp.kv_heads, rank) * D, sp.kv_heads[rank] * D
            self.f0, self.inter = sp.start(sp.intermediate, rank), sp.intermediate[rank]
        self.v0, self.vocab = sp.start(sp.vocab, rank), sp.vocab[rank]

    def put(self, host):
        host = np.ascontiguousarray(host)
        return host if self.device == CPU else DeviceArray.from_numpy(host, self.device)

    def rows(self, tw, ranges):
        index = _rows(ranges)
        blocks = None if tw.block_scales is None else self.put(np.asarray(tw.block_scales)[index])
        return TernaryWeights(self.put(np.asarray(tw.packed)[index]),
                              self.put(np.asarray(tw.scales)[index]), blocks)

    def norm(self, weight, start=0, width=None):
        """A norm's weight, or its slice [start, start + width); None (no such sub-norm) stays."""
        if weight is None:
            return None
        return self.put(weight if width is None else weight[start:start + width])

    def cols(self, tw, start, width):
        packed = np.asarray(tw.packed)[:, start // 4:(start + width) // 4]
        blocks = None
        if tw.block_scales is not None:
            if start % SCALE_BLOCK or width % SCALE_BLOCK:
                raise UnsupportedError(f"columns {start}..{start + width} of a projection with "
                                       f"block scales: a rank's share must be whole blocks of "
                                       f"{SCALE_BLOCK} (another tensor-parallel size may fit)")
            blocks = self.put(np.asarray(tw.block_scales)[:, start // SCALE_BLOCK:
                                                          (start + width) // SCALE_BLOCK])
        return TernaryWeights(self.put(packed), self.put(np.asarray(tw.scales)), blocks)

    def layer(self, layer):
        """The ShardLayer of one full layer (model.Layer of numpy arrays)."""
        if self.exact:
            h0, h, g0, g = self.h0, self.h, self.g0, self.g
            return ShardLayer(
                qkv=self.rows(layer.qkv, [(0, len(layer.qkv.scales))]),
                o=self.rows(layer.o, [(h0, h0 + h)]),
                gate_up=self.rows(layer.gate_up, [(g0, g0 + g)]),
                down=self.rows(layer.down, [(h0, h0 + h)]),
                **{name: self.norm(getattr(layer, name))
                   for name in ("attn_norm", "attn_sub_norm", "ffn_norm", "ffn_sub_norm")})
        c, Q, I = self.config, self.config.q_dim, self.config.intermediate
        q0, q, k0, kv, f0, inter = self.q0, self.q, self.k0, self.kv, self.f0, self.inter
        return ShardLayer(
            qkv=self.rows(layer.qkv, [(q0, q0 + q), (Q + k0, Q + k0 + kv),
                                      (Q + c.kv_dim + k0, Q + c.kv_dim + k0 + kv)]),
            o=self.cols(layer.o, q0, q),
            gate_up=self.rows(layer.gate_up, [(f0, f0 + inter), (I + f0, I + f0 + inter)]),
            down=self.cols(layer.down, f0, inter),
            attn_norm=self.put(layer.attn_norm),
            attn_sub_norm=self.norm(layer.attn_sub_norm, q0, q),
            ffn_norm=self.put(layer.ffn_norm),
            ffn_sub_norm=self.norm(layer.ffn_sub_norm, f0, inter))

    def shard(self, weights, layers):
        """The Shard of `weights` (host arrays but for `layers`, already this rank's)."""
        table = self.put(weights.embedding)  # a tied head is a view of the table's rows
        rows = slice(self.v0, self.v0 + self.vocab)
        head = table[rows] if weights.head is None else self.put(weights.head[rows])
        return Shard(self.config, self.split, self.rank, layers, self.put(weights.final_norm),
                     table, head)


def shard_weights(weights, rank, world, device, exact=False):
    """Rank `rank`'s shard of full host weights (model.Weights of numpy arrays), on `device`, in
    the split layout or the exact one."""
    slicer = _Slicer(weights.config, rank, world, device, exact)
    return slicer.shard(weights, [slicer.layer(layer) for layer in weights.layers])


def load_shard(path, rank, world, device, exact=False):
    """Rank `rank`'s shard (split or exact layout) of the checkpoint at `path` (a model directory
    or a .gguf file). The loader reads it into host memory a layer at a time, and each layer's
    slices go to `device` before the next is read: host memory holds the embedding, the head and
    one layer."""
    from .loader import open_source
    source = open_source(path)
    slicer = _Slicer(padded_config(source.config), rank, world, device, exact)
    weights = source.load(CPU, progress=False, each_layer=slicer.layer)
    return slicer.shard(weights, weights.layers)


def generate_shard(group, path, prompt, tokens, sampling=None, exact=False):
    """One rank's continuation of `prompt` (token ids) by `tokens` tokens, with its shard (split
    or exact layout) of the checkpoint at `path`: greedy, or drawn as `sampling`
    (set_sampling's keyword arguments) says; `group` holds its collectives (comm.Group, or a
    comm.ThreadGroup on the CPU). Returns the new ids and the timings (host clock,
    generate.speed_timings)."""
    from .generate import speed_timings
    session = TPSession(load_shard(path, group.rank, group.world, group.device, exact), group,
                        len(prompt) + tokens)
    session.set_sampling(**(sampling or {}))
    try:
        start = time.perf_counter()
        ids = [session.prefill(prompt)]
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(tokens - 1):
            ids.append(session.decode())
        return ids, speed_timings(len(prompt), prefill_s, 1, tokens - 1,
                                  time.perf_counter() - start)
    finally:
        session.close()


def generate_rank(ctx, path, prompt, tokens, method, sampling=None, exact=False):
    """launcher.run_ranks' target: generate_shard on the rank's GPU, collectives by `method`."""
    from . import comm
    group = comm.Group(ctx, method=method, max_bytes=PEER_BYTES)
    try:
        return generate_shard(group, path, prompt, tokens, sampling, exact)
    finally:
        group.close()


def chat_rank(ctx, path, capacity, sampling, exact):
    """launcher.run_ranks' target for a chat over the ranks: the checkpoint's shard (rank 0 then
    replies "ready"), then the caller's commands (RankSession) until None; rank 0 replies with
    each next token."""
    from . import comm
    group = comm.Group(ctx, method="peer", max_bytes=PEER_BYTES)
    session = TPSession(load_shard(path, ctx.rank, ctx.world, ctx.device, exact), group, capacity)
    session.set_sampling(**sampling)
    if ctx.rank == 0:
        ctx.reply("ready")
    try:
        while (command := ctx.receive()) is not None:
            kind, argument = command
            if kind == "rewind":
                session.rewind(argument)
                continue
            token = session.extend(argument) if kind == "extend" else session.decode()
            if ctx.rank == 0:
                ctx.reply(token)
    finally:
        session.close()
        group.close()


class RankSession:
    """model.Session's rewind / extend / decode / capacity for generate.chat_turns, run by the
    ranks of chat_over_ranks; a rank failure ends the wait for a token with its error."""

    def __init__(self, commands, replies, capacity, outcome):
        self.commands, self.replies, self.outcome = commands, replies, outcome
        self.capacity = capacity

    def rewind(self, length):
        self.commands.put(("rewind", int(length)))

    def extend(self, ids):
        self.commands.put(("extend", [int(t) for t in ids[0]]))
        return [self._reply()]

    def decode(self):
        self.commands.put(("decode", None))
        return [self._reply()]

    def wait_ready(self):
        """Until rank 0 holds its shard (chat_rank's first reply), or a rank's error."""
        self._reply()

    def _reply(self):
        reply = self.replies.get()
        if reply is None:  # chat_over_ranks' thread: the ranks ended
            raise self.outcome.get("error") or RankFailedError("the ranks ended", failed_rank=None)
        return reply


def chat_over_ranks(path, world, capacity, sampling, exact, turns):
    """Runs turns(session) (generate.chat_turns) in this process with a RankSession over
    `world` ranks (chat_rank, one process per GPU); returns what turns returns. Interactive: no
    timeout."""
    import queue
    import threading

    from .launcher import run_ranks
    commands, replies, outcome = queue.Queue(), queue.Queue(), {}

    def ranks():
        try:
            run_ranks(chat_rank, world, args=(path, capacity, sampling, exact),
                      timeout=float("inf"), commands=commands, replies=replies)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            outcome["error"] = exc
        replies.put(None)

    thread = threading.Thread(target=ranks, daemon=True)
    thread.start()
    try:
        session = RankSession(commands, replies, capacity, outcome)
        session.wait_ready()  # a failure to load shows now, not after the first turn is typed
        return turns(session)
    finally:
        commands.put(None)
        thread.join()
        if "error" in outcome:
            raise outcome["error"]


# Bytes whose four 2-bit codes are each 0, 1 or 2 (weights -1, 0, 1; docs/weight_format.md).
_TERNARY_BYTES = np.array([a | b << 2 | c << 4 | d << 6
                           for a, b, c, d in itertools.product(range(3), repeat=4)], np.uint8)


def random_shard(config, rank, world, device, seed=0, exact=False):
    """A rank's shard of random weights (split or exact layout), made in packed form: one random
    matrix per distinct shape, generated on the host and uploaded once, then copied on the device
    into every layer's own memory (so a step still reads every layer's bytes). Scales 1 / sqrt(K);
    norms 1; the embedding table is TABLE_BLOCK_ROWS random rows repeated (generating 128256 x
    8192 floats on the host would take longer than the run)."""
    c = config
    H, D, Q, I = c.hidden, c.head_dim, c.q_dim, c.intermediate
    if exact:
        sp = exact_split(c, world)
        h, q, inter = sp.hidden[rank], Q, I
        shapes = {"qkv": (Q + 2 * c.kv_dim, H), "o": (h, Q), "gate_up": (sp.gate_up[rank], H),
                  "down": (h, I)}
    else:
        sp = split(c, world)
        q, inter = sp.heads[rank] * D, sp.intermediate[rank]
        shapes = {"qkv": (q + 2 * sp.kv_heads[rank] * D, H), "o": (H, q), "gate_up": (2 * inter, H),
                  "down": (H, inter)}
    rng = np.random.default_rng(seed * 1009 + rank)
    pools = {}
    for name, (m, k) in shapes.items():
        packed = _TERNARY_BYTES[rng.integers(0, 81, size=(m, k // 4), dtype=np.uint8)]
        pools[name] = (DeviceArray.from_numpy(packed, device),
                       DeviceArray.from_numpy(np.full(m, k ** -0.5, np.float32), device))

    def copy(source):
        target = DeviceArray(source.shape, source.dtype, device)
        _ffi.call("memcpy", _ffi.ffi.cast("void *", target.ptr),
                  _ffi.ffi.cast("void *", source.ptr), source.nbytes,
                  _ffi.lib().BITNET_COPY_DEVICE_TO_DEVICE, _ffi.ffi.NULL)
        return target

    bf16 = _arrays.numpy_dtype(BF16)
    ones = {w: DeviceArray.from_numpy(np.ones(w, bf16), device) for w in (H, q, inter)}
    layers = [ShardLayer(**{name: TernaryWeights(copy(p), copy(s)) for name, (p, s) in pools.items()},
                         attn_norm=ones[H], attn_sub_norm=ones[q], ffn_norm=ones[H],
                         ffn_sub_norm=ones[inter])
              for _ in range(c.layers)]
    table = DeviceArray((c.vocab, H), BF16, device)
    block = DeviceArray.from_numpy(
        (0.5 * rng.standard_normal((min(c.vocab, TABLE_BLOCK_ROWS), H), np.float32)).astype(bf16),
        device)
    for start in range(0, c.vocab, block.shape[0]):  # the table: one random block, repeated
        rows = min(block.shape[0], c.vocab - start)
        _ffi.call("memcpy", _ffi.ffi.cast("void *", table[start:start + rows].ptr),
                  _ffi.ffi.cast("void *", block.ptr), rows * H * 2,
                  _ffi.lib().BITNET_COPY_DEVICE_TO_DEVICE, _ffi.ffi.NULL)
    v0 = sp.start(sp.vocab, rank)
    _ffi.call("device_synchronize", device)
    return Shard(c, sp, rank, layers, ones[H], table, table[v0:v0 + sp.vocab[rank]])


class TPSession:
    """One rank's decode state: KV cache of its heads (every head in the exact layout), buffers,
    the step (a CUDA graph on a GPU).
    `group` does the collectives (comm.Group, or comm.ThreadGroup on the CPU); every rank calls
    the same methods in the same order."""

    def __init__(self, shard, group, capacity):
        c, sp, r = shard.config, shard.split, shard.rank
        if group.world != sp.world or group.rank != r:
            raise InvalidArgumentError(f"the shard is rank {r} of {sp.world}, the group rank "
                                       f"{group.rank} of {group.world}")
        self.shard, self.group, self.config, self.capacity = shard, group, c, capacity
        self.device = group.device
        self.stream = Stream(self.device) if self.device != CPU else None
        self.graphs = {}  # pass length -> its captured step (1: the decode step)
        self.sampling = None
        self.solo = sp.world == 1  # no collectives: the unsplit model's step
        self.fuse_qkv_rope = qkv_rope_supported(c, shard.layers, 1)  # for the decode step
        whole = isinstance(sp, ExactSplit)  # every head on every rank
        self.exact = whole and not self.solo
        H, I, D = c.hidden, c.intermediate, c.head_dim
        hq, hkv = (c.heads, c.kv_heads) if whole else (sp.heads[r], sp.kv_heads[r])
        gate_up = 2 * I if whole else 2 * sp.intermediate[r]
        self.vocab_counts = list(sp.vocab)
        cache = (1, capacity, hkv, D)
        self.k_cache = [self.alloc(cache, BF16) for _ in range(c.layers)]
        self.v_cache = [self.alloc(cache, BF16) for _ in range(c.layers)]
        self.positions, self.seq_lens = self.alloc((1,), "int32"), self.alloc((1,), "int32")
        # A prompt goes through in passes of up to `chunk` tokens. The exact layout's all-gathers
        # put rank-major pieces together: for n tokens a row gather (gather_ids) puts them in row
        # order, where every rank's piece has as many rows; otherwise one token a pass.
        even = not self.exact or all(len(set(rows)) == 1 for rows in (sp.hidden, sp.gate_up))
        self.chunk = min(PREFILL_CHUNK, capacity) if even else 1
        limit = getattr(group, "max_bytes", None)  # None: any size (comm.ThreadGroup)
        if limit is not None:  # a pass's partial sums and sums of squares, or pieces, fit a message
            piece = 2 * max(sp.hidden + sp.gate_up) if self.exact else 4 * (H + 1)
            self.chunk = max(1, min(self.chunk, limit // piece))
        T = self.chunk
        # Buffers of T rows; a pass of n tokens takes the first n. part: o's or down's
        # float32 partial sums [n, H], then the rows' sums of squares [n].
        b = {"ids": self.alloc((T,), "int32"), "h": self.alloc((T, H), BF16),
             "proj": self.alloc((T, H), BF16), "part": self.alloc((T * (H + 1),), "float32"),
             "x_q": self.alloc((T, max(H, I, c.q_dim)), "int8"), "x_s": self.alloc((T,), "float32"),
             "qkv": self.alloc((T, (hq + 2 * hkv) * D), BF16),
             "q": self.alloc((T, hq * D), BF16), "attn": self.alloc((T, hq * D), BF16),
             "gate_up": self.alloc((T, gate_up), BF16),
             "y": self.alloc((T, H), BF16),
             "logits_part": self.alloc((1, sp.vocab[r]), "float32"),
             "logits": self.alloc((1, c.vocab), "float32"), "sync": self.alloc((4,), "float32")}
        if self.solo:  # the head's output is the whole row
            b["logits_part"] = b["logits"]
        if self.exact:  # this rank's rows of o or down, and of gate|up, before the all-gathers
            b["proj_part"] = self.alloc((T, sp.hidden[r]), BF16)
            b["gate_up_part"] = self.alloc((T, sp.gate_up[r]), BF16)
            self.row_counts = {"proj": list(sp.hidden), "gate_up": list(sp.gate_up)}
            if T > 1:  # the pieces of a pass of n > 1 tokens, rank-major, before the row gather
                b["gathered"] = self.alloc((T * max(H, 2 * I),), BF16)
        self.gather_rows = {}  # pass length n > 1 -> gather_ids(n)
        ws = max(attention_workspace_size(self.device, 1, n, hq, hkv, D, capacity)
                 for n in range(1, T + 1))  # a pass of any length up to T
        b["workspace"] = self.alloc((ws,), "uint8") if ws else None
        self.b = b
        self.reset()

    def alloc(self, shape, dtype):
        if self.device == CPU:
            return np.zeros(shape, dtype=_arrays.numpy_dtype(dtype))
        return DeviceArray(shape, dtype, self.device)

    def upload(self, host, target):
        host = np.ascontiguousarray(host, dtype=np.int32)
        if self.device == CPU:
            target[...] = host.reshape(target.shape)
            return
        self.synchronize()
        _ffi.call("memcpy", _ffi.ffi.cast("void *", target.ptr),
                  _ffi.ffi.cast("void *", host.ctypes.data), host.nbytes,
                  _ffi.lib().BITNET_COPY_HOST_TO_DEVICE, _ffi.ffi.NULL)

    def download(self, array):
        return np.array(array if self.device == CPU else array.numpy())

    def synchronize(self):
        if self.stream is not None:
            self.stream.synchronize()
        self.group.check()

    def set_sampling(self, temperature=0.0, top_k=0, top_p=1.0, seed=0):
        """Greedy (argmax) at temperature 0, else the sample op on the gathered logits, inside the
        step (model.Session.set_sampling's settings and draw)."""
        sampling = sampling_settings(temperature, top_k, top_p, seed)
        if sampling != self.sampling:
            self.close()  # the captured step holds the old draw
            self.sampling = sampling

    def reset(self):
        """An empty sequence: the next token goes to position 0."""
        self.rewind(0)

    def rewind(self, length):
        """Forgets the tokens from position `length` on (their cache rows get overwritten)."""
        self.upload([length], self.positions)
        self.upload([length + 1], self.seq_lens)

    def time_decode(self, replays):
        """Device ms per decode step (the graph, after at least one decode), every timed run of
        `replays` replays starting from the position and input token now, which are put back
        afterwards (replays past the KV cache's end would time steps whose attention does no
        work). Before each run the ranks meet in a collective on the stream, so that no rank's
        timed run includes waiting for another's host-side reset."""
        position = int(self.download(self.positions)[0])
        ids = int(self.download(self.b["ids"])[0])
        if position + replays + 1 > self.capacity:
            raise InvalidArgumentError(f"time_decode: {replays} replays from position {position} "
                                       f"overflow the KV cache of {self.capacity}")

        def reset():
            self.upload([position], self.positions)
            self.upload([position + 1], self.seq_lens)
            self.upload([ids], self.b["ids"])
            if self.stream is not None:
                self.group.all_reduce(self.b["sync"], self.b["sync"], stream=self.stream)

        ms = self.graphs[1].time_ms(replays, reset)
        reset()
        self.synchronize()
        return ms

    def close(self):
        """Destroys the step's graphs (before the group is closed: Group.close says why)."""
        if self.graphs:
            self.synchronize()
        for graph in self.graphs.values():
            graph.close()
        self.graphs = {}

    def step(self, n=1):
        """n tokens (n <= chunk) at positions p .. p + n - 1 through every layer, p =
        self.positions: their ids in b["ids"], the greedy (or drawn) successor of the last
        written over b["ids"][0], p advanced by n. Between passes seq_lens = p + 1; a pass of n
        tokens sees p + n keys."""
        c, s, b = self.config, self.shard, self.b
        H, D, st = c.hidden, c.head_dim, self.stream
        kw = {"stream": st}
        h, proj, y, qkv = (b[k][:n] for k in ("h", "proj", "y", "qkv"))
        q, attn = (b[k][:n].reshape(1, n, -1, D) for k in ("q", "attn"))
        if n > 1:
            add_int32(self.seq_lens, n - 1, **kw)
        embedding(s.embedding, b["ids"][:n], out=h, **kw)
        residual = None
        for index, layer in enumerate(s.layers):
            x_q, x_s = _arrays.first_rows(b["x_q"], n, H), b["x_s"][:n]
            if residual is None:
                rmsnorm_quantize(h, layer.attn_norm, eps=c.eps, out=(x_q, x_s), **kw)
            else:
                rmsnorm_quantize(proj, layer.attn_norm, eps=c.eps, residual=residual,
                                 out=(x_q, x_s), **kw)
            if n == 1 and self.fuse_qkv_rope:
                gemv_w2a8_rope_append_kv(layer.qkv, x_q, x_s, self.k_cache[index],
                                         self.v_cache[index], self.positions, theta=c.theta,
                                         out=q, **kw)
            else:
                gemv_w2a8(layer.qkv, x_q, x_s, out_dtype=BF16, out=qkv, **kw)
                rope_append_kv(qkv.reshape(1, n, -1, D), self.k_cache[index],
                               self.v_cache[index], self.positions, theta=c.theta, out=q, **kw)
            attention(q, self.k_cache[index], self.v_cache[index], causal=True,
                      scale=c.attention_scale, seq_lens=self.seq_lens, out=attn,
                      workspace=b["workspace"], **kw)
            self.row_parallel(layer.o, attn.reshape(n, -1), layer.attn_sub_norm, None,
                              c.q_dim, c.attn_sub_eps)
            rmsnorm_quantize(proj, layer.ffn_norm, eps=c.eps, residual=h, out=(x_q, x_s), **kw)
            self.project(layer.gate_up, x_q, x_s, "gate_up", n)
            self.row_parallel(layer.down, b["gate_up"][:n], layer.ffn_sub_norm,
                              c.activation, c.intermediate, c.ffn_sub_eps)
            residual = h
        add_rmsnorm(proj, h, s.final_norm, eps=c.eps, out=y, **kw)
        gemv_bf16(s.head, y[n - 1:n], out=b["logits_part"], **kw)
        if not self.solo:
            self.group.all_gather(b["logits_part"], b["logits"], counts=self.vocab_counts,
                                  stream=st)
        if self.sampling is None:
            argmax(b["logits"], out=b["ids"][:1], **kw)
        else:  # every rank has the whole row and the same settings: every rank draws the same
            sample(b["logits"], counters=self.positions, out=b["ids"][:1], **self.sampling, **kw)
        add_int32(self.positions, n, **kw)
        add_int32(self.seq_lens, 1, **kw)

    def project(self, weights, x_q, x_s, name, n):
        """b[name]'s first n rows = the bfloat16 projection of the n int8 rows; in the exact
        layout (n = 1) this rank's rows go to b[name + "_part"] and the all-gather puts the
        ranks' rows together in b[name]."""
        b, st = self.b, self.stream
        if not self.exact:
            gemv_w2a8(weights, x_q, x_s, out_dtype=BF16, out=b[name][:n], stream=st)
            return
        part, counts = b[name + "_part"][:n], self.row_counts[name]
        gemv_w2a8(weights, x_q, x_s, out_dtype=BF16, out=part, stream=st)
        if n == 1:
            self.group.all_gather(part, b[name][:1], counts=counts, stream=st)
            return
        world, rows = len(counts), counts[0]
        gathered = b["gathered"][:n * world * rows]
        self.group.all_gather(part, gathered, counts=[n * rows] * world, stream=st)
        embedding(gathered.reshape(world * n, rows), self.gather_rows[n],
                  out=b[name][:n].reshape(n * world, rows), stream=st)

    def gather_ids(self, n):
        """Makes, once per pass length n > 1 of the exact layout, the row gather that puts the
        all-gathered pieces [world, n, rows] in row order [n, world, rows]: row t * world + r of
        the result is row r * n + t of the pieces. (Uploaded here, before any capture.)"""
        if n > 1 and self.exact and n not in self.gather_rows:
            world = len(self.row_counts["proj"])
            t, r = np.divmod(np.arange(n * world), world)
            self.gather_rows[n] = self.alloc((n * world,), "int32")
            self.upload(r * n + t, self.gather_rows[n])

    def row_parallel(self, weights, x, norm_weight, activation, width, eps):
        """b["proj"] = W subnorm(v) for the o or down projection W, v a row of `width` (x itself,
        or with an activation the GLU gate of the gate|up projection x), the norm's eps `eps`
        (the config's sub-norm eps, which a padded layout scales). On one rank, and in the exact
        layout (v whole on every rank), the unsplit model's ops: the norm, int8, the GEMV into
        bfloat16 (project). Otherwise W is split by input columns and v is this rank's slice: the
        norm's first half on the slice (its own int8 scale), this rank's float32 partial sums
        with the slice's sum of squares after them, and the all-reduce that sums both and
        divides by the whole row's RMS. Without the sub-norm (norm_weight None, the Llama
        layout) v goes to int8 as it is (quantize_a8, or the gate's output), and split ranks add
        their float32 partial sums with a plain all-reduce."""
        b, st = self.b, self.stream
        H = self.config.hidden
        n, cols = x.shape[0], x.shape[-1] // (2 if activation else 1)
        x_q, x_s = _arrays.first_rows(b["x_q"], n, cols), b["x_s"][:n]
        part = b["part"][:n * (H + 1)]
        sums, sumsq = part[:n * H].reshape(n, H), part[n * H:]
        whole_row = self.solo or self.exact  # v is the whole row on this rank
        split_norm = not whole_row and norm_weight is not None
        if split_norm:
            if activation:
                glu_rmsnorm_partial(x, norm_weight, activation=activation, out=(x_q, x_s),
                                    sumsq=sumsq, stream=st)
            else:
                rmsnorm_partial(x, norm_weight, out=(x_q, x_s), sumsq=sumsq, stream=st)
        elif activation:  # with no weight: quantize_a8 of the gate's output
            glu_rmsnorm_quantize(x, norm_weight, activation=activation, eps=eps, out=(x_q, x_s),
                                 stream=st)
        elif norm_weight is None:
            quantize_a8(x, out=(x_q, x_s), stream=st)
        else:
            rmsnorm_quantize(x, norm_weight, eps=eps, out=(x_q, x_s), stream=st)
        if whole_row:
            self.project(weights, x_q, x_s, "proj", n)
            return
        gemv_w2a8(weights, x_q, x_s, out_dtype="float32", out=sums, stream=st)
        if split_norm:
            self.group.all_reduce_rms(part, b["proj"][:n], width, eps, stream=st)
        else:  # no sub-norm: a plain sum of the ranks' partial sums
            self.group.all_reduce(sums, b["proj"][:n], stream=st)

    def decode(self, token=None):
        """One step; `token` (a host int) replaces the step's input, which is otherwise the last
        step's output. Returns the greedy next token."""
        if token is not None:
            self.upload([token], self.b["ids"][:1])
        self.run_pass(1)
        self.synchronize()
        return int(self.download(self.b["ids"])[0])

    def run_pass(self, n):
        """step(n): on a GPU as the graph captured at its first run of that length."""
        if self.stream is None:
            self.step(n)
            return
        if n not in self.graphs:
            with Graph.capture(self.stream) as graph:
                self.step(n)
            self.graphs[n] = graph
        self.graphs[n].launch()

    def prefill(self, prompt):
        """Starts afresh with `prompt` (host ints); returns the next token (extend)."""
        self.reset()
        return self.extend(prompt)

    def extend(self, ids):
        """Appends `ids` (host ints) at the sequence's position in passes of up to `chunk` tokens
        (a pass of `chunk` tokens is a CUDA graph, captured once, run_pass; a shorter last pass
        runs op by op). Returns the next token; logits() are the last token's."""
        ids = [int(t) for t in ids]
        position = int(self.download(self.positions)[0])
        if not ids or position + len(ids) > self.capacity:
            raise InvalidArgumentError(f"extend: expected 1 to {self.capacity - position} tokens "
                                       f"(the KV cache from position {position}), got {len(ids)}")
        for start in range(0, len(ids), self.chunk):
            part = ids[start:start + self.chunk]
            self.upload(part, self.b["ids"][:len(part)])
            self.gather_ids(len(part))
            if len(part) == self.chunk:
                self.run_pass(self.chunk)
            else:
                self.step(len(part))
        self.synchronize()
        return int(self.download(self.b["ids"])[0])

    def logits(self):
        return self.download(self.b["logits"])[0]

    def generate(self, prompt, tokens):
        """The continuation of `prompt` (host ints) by `tokens` new tokens, greedy or drawn as
        set_sampling says: the prompt in prefill's passes, then a decode step per token."""
        generated = [self.prefill(prompt)]
        for _ in range(tokens - 1):
            generated.append(self.decode())
        return generated
