"""Collectives between the ranks of a tensor-parallel run: the library's one-shot all-reduce and
all-gather over NVLink peer memory (``PeerBuffers``), NCCL (``bitnet_ffi.nccl``), and ``Group``,
one rank's view of both, which the model calls. ``ThreadGroup`` simulates ranks as threads of one
process on the CPU (host sums in the same order as the GPU's), for testing the split model."""
import threading

import numpy as np

from . import _arrays, _ffi
from ._arrays import CPU, DTYPE_CODES, FLOAT_DTYPES, DeviceArray
from .errors import InvalidArgumentError, RankFailedError

# The largest per-rank message the peer collectives take by default (the gathered logits of a
# 128256-word vocabulary split over 2 ranks are 256 KB).
DEFAULT_MAX_BYTES = 1 << 20
# The largest all-reduce that the peer method does itself: on 2 H100s the one-shot kernel took
# 6.7-7.5 us at 128 KB against NCCL's 6.6-7.1 (allreduce.cu), and beyond it falls behind.
PEER_LARGEST = 128 << 10


def peer_buffer_size(max_bytes):
    out = _ffi.ffi.new("int64_t *")
    _ffi.call("peer_buffer_size", int(max_bytes), out)
    return out[0]


class PeerBuffers:
    """This rank's peer buffer and its mappings of every other rank's, for the one-shot
    collectives. `exchange(bytes) -> [bytes per rank]` shares the IPC handles (NCCL's all-gather,
    or anything else that reaches every rank); it must also be a barrier, since every buffer has to
    be zeroed before any rank raises a flag in it."""

    def __init__(self, device, rank, world, exchange, max_bytes=DEFAULT_MAX_BYTES):
        self.device, self.rank, self.world = int(device), int(rank), int(world)
        self.nbytes = peer_buffer_size(max_bytes)
        self.max_bytes = (self.nbytes - 4096) // 2
        self.own = DeviceArray((self.nbytes,), "uint8", self.device)
        _ffi.call("memset", _ffi.ffi.cast("void *", self.own.ptr), 0, self.nbytes, _ffi.ffi.NULL)
        _ffi.call("device_synchronize", self.device)
        self.opened = []
        pointers = [None] * self.world
        pointers[self.rank] = self.own.ptr
        if self.world > 1:
            handle = _ffi.ffi.new("bitnet_ipc_handle *")
            _ffi.call("ipc_get_handle", self.device, _ffi.ffi.cast("void *", self.own.ptr), handle)
            handles = exchange(bytes(_ffi.ffi.buffer(handle)))
            for r, data in enumerate(handles):
                if r == self.rank:
                    continue
                peer = _ffi.ffi.new("bitnet_ipc_handle *")
                _ffi.ffi.memmove(peer, data, len(data))
                out = _ffi.ffi.new("void **")
                _ffi.call("ipc_open_handle", self.device, peer, out)
                pointers[r] = int(_ffi.ffi.cast("uintptr_t", out[0]))
                self.opened.append(pointers[r])
        self.table = _ffi.ffi.new("void *[]", [_ffi.ffi.cast("void *", p) for p in pointers])
        self.own_table = _ffi.ffi.new("void *[]", [_ffi.ffi.cast("void *", self.own.ptr)])

    def _call(self, name, named, stream):
        arrays, device, handle = _arrays.prepare(named, stream, writes=("out",))
        if device != self.device:
            raise InvalidArgumentError(f"peer collectives of this group run on "
                                       f"{_arrays.device_name(self.device)}, got arrays on "
                                       f"{_arrays.device_name(device)}")
        return arrays, handle

    def _peers(self, alone):
        """(world, rank, buffer table) of a call: every rank's buffer, or this rank's x alone."""
        return (1, 0, self.own_table) if alone else (self.world, self.rank, self.table)

    def all_reduce(self, x, out, stream=None, alone=False):
        """out = sum over ranks of x (float32 accumulation; out may have another float dtype).
        ``alone``: this rank's x only, converted to out's dtype (x already summed elsewhere, by
        NCCL)."""
        arrays, handle = self._call("allreduce", {"x": x, "out": out}, stream)
        xa = _arrays.check(arrays["x"], "x", FLOAT_DTYPES, (None,) * len(arrays["x"].shape))
        oa = _arrays.check(arrays["out"], "out", FLOAT_DTYPES, xa.shape)
        world, rank, table = self._peers(alone)
        _ffi.call("peer_allreduce", self.device, DTYPE_CODES[xa.dtype], DTYPE_CODES[oa.dtype],
                  xa.size, xa.cptr(), oa.cptr(), table, world, rank, self.nbytes, handle)
        return out

    def all_reduce_rms(self, x, out, norm_cols, eps, stream=None, alone=False):
        """The all-reduce after a row-parallel projection of rmsnorm_partial's codes, with the
        norm's division (bitnet_peer_allreduce_rms): x float32, [T * n partial outputs | T sums of
        squares]; out [T, n] (or [n]) = the summed outputs of each row / sqrt(its summed sum of
        squares / norm_cols + eps). ``alone``: this rank's x only, the division alone (x already
        summed elsewhere, by NCCL)."""
        arrays, handle = self._call("allreduce_rms", {"x": x, "out": out}, stream)
        oa = _arrays.check(arrays["out"], "out", FLOAT_DTYPES, (None,) * len(arrays["out"].shape))
        if not oa.shape:
            raise InvalidArgumentError("out: expected an array [T, n] or [n], got a scalar")
        n = oa.shape[-1]
        T = oa.size // n
        xa = _arrays.check(arrays["x"], "x", "float32", (None,) * len(arrays["x"].shape))
        if xa.size != T * n + T:
            raise InvalidArgumentError(f"x: expected {T} * {n} outputs and {T} sums of squares "
                                       f"({T * n + T} float32), got {xa.describe()}")
        world, rank, table = self._peers(alone)
        _ffi.call("peer_allreduce_rms", self.device, DTYPE_CODES[oa.dtype], T, n,
                  _arrays.integer(norm_cols, "norm_cols"), _arrays.number(eps, "eps"),
                  xa.cptr("float *"), oa.cptr(), table, world, rank, self.nbytes, handle)
        return out

    def all_gather(self, x, out, counts=None, stream=None):
        """out = the ranks' x end to end, in rank order (flattened): rank r's piece has counts[r]
        elements (default: all as many as this rank's x)."""
        arrays, handle = self._call("allgather", {"x": x, "out": out}, stream)
        xa = _arrays.check(arrays["x"], "x", FLOAT_DTYPES, (None,) * len(arrays["x"].shape))
        counts = _counts(counts, xa.size, self.world, self.rank)
        oa = arrays["out"]
        if oa.size != sum(counts) or oa.dtype != xa.dtype:
            raise InvalidArgumentError(f"out: expected {sum(counts)} {xa.dtype} elements, got "
                                       f"{oa.describe()}")
        _ffi.call("peer_allgather", self.device, DTYPE_CODES[xa.dtype],
                  _ffi.ffi.new("int64_t[]", counts), xa.cptr(), oa.cptr(), self.table,
                  self.world, self.rank, self.nbytes, handle)
        return out

    def abort(self):
        """Releases this rank's waiting peer calls (any thread); the buffers are then unusable."""
        _ffi.call("peer_abort", self.device, _ffi.ffi.cast("void *", self.own.ptr))

    def close(self):
        for ptr in self.opened:
            _ffi.lib().bitnet_ipc_close_handle(self.device, _ffi.ffi.cast("void *", ptr))
        self.opened = []


class Group:
    """One rank's collectives for the model: all_reduce(x, out) and all_gather(x, out) by the
    one-shot peer kernels (``method="peer"``, the default: faster than NCCL at decode's sizes,
    tools/bench_allreduce.py) or by NCCL (``"nccl"``: in-place sums of one dtype). ``ctx`` is the
    rank's launcher.RankContext; on a rank failure elsewhere the launcher aborts both."""

    def __init__(self, ctx, method="peer", max_bytes=DEFAULT_MAX_BYTES):
        if method not in ("peer", "nccl"):
            raise InvalidArgumentError(f"method must be peer or nccl, got {method!r}")
        self.ctx, self.rank, self.world, self.device = ctx, ctx.rank, ctx.world, ctx.device
        self.method = method
        self.nccl = None
        self._padded = {}
        if self.world > 1:
            from . import nccl
            uid = ctx.broadcast(nccl.unique_id() if self.rank == 0 else None)
            self.nccl = nccl.Communicator(uid, self.world, self.rank, self.device)
        exchange = self.nccl.all_gather_bytes if self.nccl else (lambda data: [data])
        self.peer = PeerBuffers(self.device, self.rank, self.world, exchange, max_bytes)
        self.max_bytes = self.peer.max_bytes  # the largest x of one collective
        # The peer calls first: ncclCommAbort frees memory, which waits for the device, and so
        # for any peer kernel still waiting.
        ctx.on_abort(self.peer.abort)
        if self.nccl is not None:
            ctx.on_abort(self.nccl.abort)

    def _sums_by_nccl(self, x):
        """Whether an all-reduce of x goes through NCCL: always with method "nccl"; with "peer"
        above PEER_LARGEST bytes (a prefill pass's rows), where the peer kernel's few blocks are
        slower."""
        if self.nccl is None:
            return False
        xa = _arrays.as_array(x, "x")
        return self.method == "nccl" or xa.size * _arrays.ITEMSIZE[xa.dtype] > PEER_LARGEST

    def all_reduce(self, x, out, stream=None):
        """out = sum over ranks of x. With NCCL and another dtype for out: NCCL's in-place sum of
        x, then the conversion alone (x is overwritten)."""
        if self._sums_by_nccl(x):
            if _arrays.as_array(out, "out").dtype == _arrays.as_array(x, "x").dtype:
                return self.nccl.all_reduce(x, out, stream=stream)
            self.nccl.all_reduce(x, x, stream=stream)
            return self.peer.all_reduce(x, out, stream=stream, alone=True)
        return self.peer.all_reduce(x, out, stream=stream)

    def all_reduce_rms(self, x, out, norm_cols, eps, stream=None):
        """PeerBuffers.all_reduce_rms; with NCCL, its in-place sum of x, then the division alone
        (x is overwritten)."""
        if self._sums_by_nccl(x):
            self.nccl.all_reduce(x, x, stream=stream)
            return self.peer.all_reduce_rms(x, out, norm_cols, eps, stream=stream, alone=True)
        return self.peer.all_reduce_rms(x, out, norm_cols, eps, stream=stream)

    def all_gather(self, x, out, counts=None, stream=None):
        """out = the ranks' x end to end (rank r's piece: counts[r] elements, default equal)."""
        if self.method == "nccl" and self.nccl is not None:
            return self._nccl_gather(x, out, counts, stream)
        return self.peer.all_gather(x, out, counts=counts, stream=stream)

    def _nccl_gather(self, x, out, counts, stream):
        """NCCL gathers equal pieces: uneven ones go through a padded buffer, then one device copy
        per rank into place."""
        xa = _arrays.as_array(x, "x")
        counts = _counts(counts, xa.size, self.world, self.rank)
        if len(set(counts)) == 1:
            return self.nccl.all_gather(x, out, stream=stream)
        size, largest = _arrays.ITEMSIZE[xa.dtype], max(counts)
        key = (xa.dtype, largest)
        if key not in self._padded:
            self._padded[key] = (DeviceArray((largest,), xa.dtype, self.device),
                                 DeviceArray((self.world, largest), xa.dtype, self.device))
        send, gathered = self._padded[key]
        # The copies run on the stream the NCCL call resolves to (the framework's current one).
        arrays, _, handle = _arrays.prepare({"x": x, "out": out}, stream, writes=("out",))
        copy = _ffi.lib().BITNET_COPY_DEVICE_TO_DEVICE
        _ffi.call("memcpy", _ffi.ffi.cast("void *", send.ptr), xa.cptr(), xa.size * size, copy,
                  handle)
        self.nccl.all_gather(send, gathered, stream=stream)
        oa, offset = arrays["out"], 0
        for r, count in enumerate(counts):
            _ffi.call("memcpy", _ffi.ffi.cast("void *", oa.ptr + offset * size),
                      _ffi.ffi.cast("void *", gathered.ptr + r * largest * size), count * size,
                      copy, handle)
            offset += count
        return out

    def check(self):
        """Raises RankFailedError if another rank failed (call after each synchronization)."""
        self.ctx.check()

    def close(self):
        """Frees the buffers and the communicator. Close every graph that captured NCCL calls
        first (Graph.close): NCCL's destroy waits for such graphs (a test that closed its group
        with the graph alive ran past its time limit; closing the graph first, it passed)."""
        self.peer.close()
        if self.nccl is not None:
            self.nccl.close()


class ThreadGroup:
    """Ranks simulated by threads of one process, on the CPU: the same all_reduce / all_gather as
    Group, computed on the host (float32 sums in rank order, as the peer kernel adds)."""

    class Shared:
        def __init__(self, world):
            self.world = world
            self.barrier = threading.Barrier(world, timeout=60)
            self.slots = [None] * world

    def __init__(self, shared, rank):
        self.shared, self.rank, self.world, self.device = shared, rank, shared.world, CPU

    def _exchange(self, x):
        self.shared.slots[self.rank] = np.array(x, copy=True)
        self.shared.barrier.wait()
        values = list(self.shared.slots)
        self.shared.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return values

    def all_reduce(self, x, out, stream=None):
        total = np.zeros(np.shape(x), dtype=np.float32)
        for value in self._exchange(x):
            total += value.astype(np.float32)
        out[...] = total.astype(out.dtype)
        return out

    def all_reduce_rms(self, x, out, norm_cols, eps, stream=None):
        """The peer kernel's arithmetic in numpy float32: sums in rank order, then each row times
        1 / sqrt(sum of squares / norm_cols + eps), rounded once."""
        total = np.zeros(np.size(x), dtype=np.float32)
        for value in self._exchange(x):
            total += value.reshape(-1).astype(np.float32)
        n = out.shape[-1]
        rows = out.size // n
        sums = total[:rows * n].reshape(rows, n)
        factor = np.float32(1) / np.sqrt(total[rows * n:] / np.float32(norm_cols) + np.float32(eps))
        out[...] = (sums * factor[:, None]).astype(out.dtype).reshape(out.shape)
        return out

    def all_gather(self, x, out, counts=None, stream=None):
        pieces = [p.reshape(-1) for p in self._exchange(x)]
        if counts is not None and [p.size for p in pieces] != list(counts):
            raise InvalidArgumentError(f"counts {list(counts)} do not match the pieces "
                                       f"{[p.size for p in pieces]}")
        out[...] = np.concatenate(pieces).reshape(out.shape)
        return out

    def check(self):
        pass


def _counts(counts, own, world, rank):
    """Each rank's piece of an all-gather, as a list of ints; this rank's must be its x's size."""
    counts = [own] * world if counts is None else [int(c) for c in counts]
    if len(counts) != world or counts[rank] != own:
        raise InvalidArgumentError(f"counts {counts}: expected {world} counts with this rank's "
                                   f"({rank}) equal to its x's {own} elements")
    return counts


def run_threads(target, world, *args):
    """Runs target(group, *args) for each simulated rank in its own thread; returns the results
    in rank order, or raises the first rank's exception (naming the rank)."""
    shared = ThreadGroup.Shared(world)
    results, errors = [None] * world, [None] * world

    def body(rank):
        try:
            results[rank] = target(ThreadGroup(shared, rank), *args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[rank] = exc
            shared.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank, exc in enumerate(errors):
        if exc is not None and not isinstance(exc, threading.BrokenBarrierError):
            raise RankFailedError(f"rank {rank} failed: {type(exc).__name__}: {exc}",
                                  failed_rank=rank) from exc
    return results
