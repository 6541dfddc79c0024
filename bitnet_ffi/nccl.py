"""NCCL's C API bound through cffi, as vLLM's pynccl binds it with ctypes: a communicator object per
process, every collective issued on the caller's stream (so that it can be captured in a CUDA
graph), every ncclResult_t turned into an exception of bitnet_ffi.errors.

libnccl.so.2 is looked for in $BITNET_NCCL_LIB (only there, when set), then in the
``nvidia-nccl-cu13`` / ``-cu12`` wheels (site-packages/nvidia/nccl/lib), then by the system's
loader. NVLink multicast (NVLS) is always turned off before NCCL starts: NCCL_NVLS_ENABLE=0."""
import os
import site
import sys
import threading
from pathlib import Path

import cffi
import numpy as np

from . import _arrays, _ffi
from ._arrays import CPU
from .errors import BY_NCCL_RESULT, CommunicationError, InvalidArgumentError

_CDEF = """
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct ncclComm *ncclComm_t;
int ncclGetVersion(int *version);
int ncclGetUniqueId(ncclUniqueId *uniqueId);
int ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
int ncclCommDestroy(ncclComm_t comm);
int ncclCommAbort(ncclComm_t comm);
int ncclCommGetAsyncError(ncclComm_t comm, int *asyncError);
const char *ncclGetErrorString(int result);
const char *ncclGetLastError(ncclComm_t comm);
int ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op,
                  ncclComm_t comm, void *stream);
int ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, int datatype,
                  ncclComm_t comm, void *stream);
int ncclGroupStart(void);
int ncclGroupEnd(void);
"""
UNIQUE_ID_BYTES = 128
# ncclDataType_t and ncclRedOp_t values (nccl.h)
DATATYPES = {"int8": 0, "uint8": 1, "int32": 2, "float16": 6, "float32": 7, "bfloat16": 9}
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}

ffi = cffi.FFI()
ffi.cdef(_CDEF)
_lib = None
_lock = threading.Lock()


def disable_nvls():
    """NVLink multicast stays off on these machines: forced, whatever the environment says. And
    unless told otherwise, NCCL connects every transport at init rather than at the first
    collective that needs it, which may be inside a CUDA graph capture."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")


def library_candidates():
    override = os.environ.get("BITNET_NCCL_LIB")
    if override:
        return [override]
    roots = list(sys.path)
    try:
        roots += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # some virtualenvs lack getsitepackages
        pass
    found = [str(Path(r) / "nvidia" / "nccl" / "lib" / "libnccl.so.2") for r in roots if r]
    return [p for p in dict.fromkeys(found) if Path(p).is_file()] + ["libnccl.so.2"]


def lib():
    """The loaded libnccl (loaded on first use, with NVLS turned off first)."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                disable_nvls()
                tried = []
                for path in library_candidates():
                    try:
                        _lib = ffi.dlopen(path)
                        break
                    except OSError as exc:
                        tried.append(f"{path} ({exc})")
                else:
                    raise CommunicationError("libnccl.so.2 could not be loaded. Tried: " +
                                             "; ".join(tried) + ". pip install nvidia-nccl-cu13, "
                                             "or set BITNET_NCCL_LIB to its path.")
    return _lib


def check(result, what, comm=None):
    """Raises the exception that matches a non-zero ncclResult_t, with NCCL's messages."""
    if result == 0:
        return
    message = ffi.string(lib().ncclGetErrorString(result)).decode(errors="replace")
    detail = lib().ncclGetLastError(comm if comm is not None else ffi.NULL)
    if detail != ffi.NULL and ffi.string(detail):
        message += ": " + ffi.string(detail).decode(errors="replace")
    cls = BY_NCCL_RESULT.get(int(result), CommunicationError)
    raise cls(f"{what}: NCCL error {int(result)}: {message}", status=int(result))


def version():
    """NCCL's version code (e.g. 22803 for 2.28.3)."""
    out = ffi.new("int *")
    check(lib().ncclGetVersion(out), "ncclGetVersion")
    return out[0]


def unique_id():
    """A new ncclUniqueId as bytes, for rank 0 to hand to every rank (the process that makes it
    hosts NCCL's bootstrap until the ranks have joined)."""
    uid = ffi.new("ncclUniqueId *")
    check(lib().ncclGetUniqueId(uid), "ncclGetUniqueId")
    return bytes(ffi.buffer(uid))


class Communicator:
    """One rank's NCCL communicator on CUDA device `device`. Collectives run on the stream given
    (or, without one, on the caller's framework stream, as the ops do), and can be captured in a
    CUDA graph. ``abort()`` may be called from another thread to end collectives that wait for a
    rank that failed."""

    def __init__(self, uid, world, rank, device):
        if len(uid) != UNIQUE_ID_BYTES:
            raise InvalidArgumentError(f"uid: expected {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        if not 0 <= rank < world:
            raise InvalidArgumentError(f"rank {rank} is not in [0, {world})")
        self.world, self.rank, self.device = int(world), int(rank), int(device)
        handle = ffi.new("ncclUniqueId *")
        ffi.memmove(handle, uid, UNIQUE_ID_BYTES)
        comm = ffi.new("ncclComm_t *")
        _ffi.call("set_current_device", self.device)  # NCCL binds a communicator to it
        check(lib().ncclCommInitRank(comm, self.world, handle[0], self.rank),
              f"ncclCommInitRank (rank {rank} of {world}, cuda:{device})")
        self._comm = comm[0]
        self._closed = False

    def _arrays(self, named, stream, writes):
        arrays, device, handle = _arrays.prepare(named, stream, writes=writes)
        if device == CPU or device != self.device:
            raise InvalidArgumentError(f"NCCL collectives take arrays on cuda:{self.device}, got "
                                       f"{_arrays.device_name(device)}")
        for name, a in arrays.items():
            if a is not None and a.dtype not in DATATYPES:
                raise InvalidArgumentError(f"{name}: dtype {a.dtype} has no NCCL type")
        return arrays, handle

    def _live(self):
        if self._closed:
            raise CommunicationError(f"the communicator of rank {self.rank} is closed or aborted")
        return self._comm

    def all_reduce(self, x, out=None, op="sum", stream=None):
        """out = the element-wise `op` (sum, prod, max, min) of x over all ranks; in place when
        out is None or x."""
        if op not in OPS:
            raise InvalidArgumentError(f"op must be one of {', '.join(OPS)}, got {op!r}")
        out = x if out is None else out
        arrays, handle = self._arrays({"x": x, "out": out}, stream, ("out",))
        xa, oa = arrays["x"], arrays["out"]
        _arrays.check(oa, "out", xa.dtype, xa.shape)
        check(lib().ncclAllReduce(ffi.cast("void *", _ptr(xa)), ffi.cast("void *", _ptr(oa)),
                                  xa.size, DATATYPES[xa.dtype], OPS[op], self._live(), handle),
              "ncclAllReduce", self._comm)
        return out

    def all_gather(self, x, out, stream=None):
        """out [world, *x.shape] = every rank's x, in rank order."""
        arrays, handle = self._arrays({"x": x, "out": out}, stream, ("out",))
        xa, oa = arrays["x"], arrays["out"]
        if oa.size != xa.size * self.world or oa.dtype != xa.dtype:
            raise InvalidArgumentError(f"out: expected {self.world * xa.size} {xa.dtype} "
                                       f"elements, got {oa.describe()}")
        check(lib().ncclAllGather(ffi.cast("void *", _ptr(xa)), ffi.cast("void *", _ptr(oa)),
                                  xa.size, DATATYPES[xa.dtype], self._live(), handle),
              "ncclAllGather", self._comm)
        return out

    def all_gather_bytes(self, data):
        """Every rank's `data` (bytes of one length on all ranks), in rank order: for small
        set-up exchanges such as IPC handles. Synchronous."""
        host = np.frombuffer(bytes(data), dtype=np.uint8)
        send = _arrays.DeviceArray.from_numpy(host, self.device)
        recv = _arrays.DeviceArray((self.world, host.size), "uint8", self.device)
        self.all_gather(send, recv, stream=0)
        _ffi.call("device_synchronize", self.device)
        return [row.tobytes() for row in recv.numpy()]

    def async_error(self):
        """NCCL's asynchronous error state of this communicator (raises it, if any)."""
        state = ffi.new("int *")
        check(lib().ncclCommGetAsyncError(self._live(), state), "ncclCommGetAsyncError")
        check(state[0], "NCCL asynchronous error", self._comm)

    def abort(self):
        """Ends this communicator's pending collectives at once (any thread); it is then unusable."""
        if not self._closed:
            self._closed = True
            lib().ncclCommAbort(self._comm)

    def close(self):
        if not self._closed:
            self._closed = True
            check(lib().ncclCommDestroy(self._comm), "ncclCommDestroy")


def _ptr(array):
    """The array's address as an int (cdata of libbitnet's FFI do not cross into this one)."""
    return int(_ffi.ffi.cast("uintptr_t", array.cptr()))
