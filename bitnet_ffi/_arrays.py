"""Arrays as the ops see them: numpy arrays on the CPU; on a GPU, the library's DeviceArray, PyTorch
tensors and any object with ``__cuda_array_interface__`` (CuPy), all used zero-copy.

``as_array`` turns a caller's object into an ``Array`` (pointer, shape, dtype, device), checking
that it is dense; ``check`` validates dtype and shape with messages that show what was received;
``prepare`` does both for all of an op's arguments, checks that they share one device and finds the
stream to run on. Nothing here ever copies between host and device behind the caller's back."""
import math
import numbers
import operator
import weakref

import numpy as np

from . import _ffi
from .errors import ArgumentTypeError, InvalidArgumentError

CPU = -1
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3, "int32": 4, "uint8": 5}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "int32": 4, "uint8": 1}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
_TYPESTR = {"<f4": "float32", "<f2": "float16", "|i1": "int8", "<i4": "int32", "|u1": "uint8"}
_TYPESTR_OF = {v: k for k, v in _TYPESTR.items()}


def numpy_dtype(name):
    """The numpy dtype for a dtype name; bfloat16 comes from the ml_dtypes package."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as exc:
            raise InvalidArgumentError("bfloat16 numpy arrays need the ml_dtypes package "
                                       "(pip install ml_dtypes)") from exc
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def device_name(device):
    return "cpu" if device == CPU else f"cuda:{device}"


class Array:
    """A dense array the library can read or write: `obj` is the caller's object, `kind` one of
    numpy, torch, cupy, cai (another __cuda_array_interface__ exporter) or bitnet (DeviceArray),
    `ptr` its address (an int, or for numpy a cffi view of its buffer: anything ffi.cast takes)."""

    __slots__ = ("obj", "kind", "ptr", "shape", "dtype", "device", "cai_stream")

    def __init__(self, obj, kind, ptr, shape, dtype, device, cai_stream=None):
        """shape: a tuple of Python ints (the callers convert, once)."""
        self.obj, self.kind, self.ptr = obj, kind, ptr
        self.shape, self.dtype, self.device = shape, dtype, device
        self.cai_stream = cai_stream

    @property
    def size(self):
        return math.prod(self.shape)

    def cptr(self, ctype="void *"):
        return _ffi.ffi.cast(ctype, self.ptr)

    def describe(self):
        return f"{self.dtype}{list(self.shape)} on {device_name(self.device)}"


def _dense_strides(shape, itemsize):
    strides, step = [], itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def integer(value, name):
    """value as a Python int. A float (even 2.0), None or a string is an ArgumentTypeError: never
    truncated."""
    try:
        return operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{name}: expected an integer, got {value!r} "
                                f"({type(value).__name__})") from None


def number(value, name):
    """value (an int or a float, numpy's included) as a Python float; anything else is an
    ArgumentTypeError."""
    if isinstance(value, numbers.Real):
        return float(value)
    raise ArgumentTypeError(f"{name}: expected a number, got {value!r} ({type(value).__name__})")


def _type_name(obj):
    kind = type(obj)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def as_array(obj, name):
    """Wraps obj without copying. Anything that is not an array (None, a list, a torch module) is
    an ArgumentTypeError; an array that is not dense or of a known dtype an InvalidArgumentError."""
    if isinstance(obj, Array):
        return obj
    if isinstance(obj, DeviceArray):
        return Array(obj, "bitnet", obj.ptr, obj.shape, obj.dtype, obj.device)
    if isinstance(obj, np.ndarray):
        dtype = _NUMPY_DTYPES.get(obj.dtype) or _numpy_dtype_name(obj.dtype, name)
        if not obj.flags.c_contiguous:
            raise InvalidArgumentError(f"{name}: the array is not C-contiguous (strides "
                                       f"{obj.strides}); pass np.ascontiguousarray({name})")
        # A cffi buffer view as the pointer: 0.4 us, where obj.ctypes.data takes 1.9.
        return Array(obj, "numpy", _ffi.ffi.from_buffer(obj), obj.shape, dtype, CPU)
    if type(obj).__module__.split(".")[0] == "torch" and _is_torch_tensor(obj):
        return _torch_array(obj, name)
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is not None:
        return _cai_array(obj, interface, name)
    hint = f"; pass np.asarray({name})" if isinstance(obj, (list, tuple, numbers.Number)) else ""
    raise ArgumentTypeError(f"{name}: expected a numpy array, a bitnet_ffi.DeviceArray, a "
                            f"PyTorch tensor or a CUDA array (__cuda_array_interface__), "
                            f"got {_type_name(obj)}{hint}")


def _is_torch_tensor(obj):
    import torch  # already imported: obj comes from it
    return isinstance(obj, torch.Tensor)


# dtype objects -> our dtype names, so that an array's dtype costs one dict lookup: numpy's
# dtype.name takes 3 us (eager ops' host time: docs/developing.md). numpy: the native byte order
# only, bfloat16 added once seen; torch: filled as dtypes are first seen.
_NUMPY_DTYPES = {np.dtype(n): n for n in DTYPE_CODES if n != "bfloat16"}
_TORCH_DTYPES = {}


def _numpy_dtype_name(dtype, name):
    """The dtype name of a numpy dtype that is not (yet) in _NUMPY_DTYPES, or an error."""
    if dtype.name not in DTYPE_CODES:
        raise InvalidArgumentError(f"{name}: dtype {dtype} is not supported "
                                   f"(expected one of {', '.join(DTYPE_CODES)})")
    if not dtype.isnative:
        raise InvalidArgumentError(f"{name}: dtype {dtype.str} is not in this machine's byte "
                                   f"order; pass {name}.astype({dtype.name!r})")
    _NUMPY_DTYPES[dtype] = dtype.name
    return dtype.name


def _torch_array(tensor, name):
    dtype = _TORCH_DTYPES.get(tensor.dtype)
    if dtype is None:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPE_CODES:
            raise InvalidArgumentError(f"{name}: dtype {tensor.dtype} is not supported "
                                       f"(expected one of {', '.join(DTYPE_CODES)})")
        _TORCH_DTYPES[tensor.dtype] = dtype
    if not tensor.is_contiguous():
        raise InvalidArgumentError(f"{name}: the tensor is not contiguous (strides "
                                   f"{tuple(tensor.stride())}); pass {name}.contiguous()")
    if tensor.is_neg():  # its memory holds -x: reading it would drop the sign
        raise InvalidArgumentError(f"{name}: the tensor is a lazy negative view (_neg_view); "
                                   f"pass {name}.resolve_neg()")
    device = tensor.get_device()  # the CUDA index, -1 (CPU) for host tensors
    return Array(tensor, "torch", tensor.data_ptr(), tuple(tensor.shape), dtype,
                 device if device >= 0 else CPU)


def _cai_array(obj, interface, name):
    dtype = _TYPESTR.get(interface["typestr"])
    if dtype is None:
        raise InvalidArgumentError(f"{name}: typestr {interface['typestr']!r} is not supported")
    shape = tuple(int(d) for d in interface["shape"])
    strides = interface.get("strides")
    if strides is not None and tuple(strides) != _dense_strides(shape, ITEMSIZE[dtype]):
        raise InvalidArgumentError(f"{name}: the array is not C-contiguous (strides {strides})")
    ptr = interface["data"][0]
    if interface["data"][1]:
        raise InvalidArgumentError(f"{name}: the array is read-only")
    device = CPU
    if ptr:
        where = _ffi.ffi.new("int32_t *")
        _ffi.call("pointer_device", _ffi.ffi.cast("void *", ptr), where)
        device = where[0]
    kind = "cupy" if type(obj).__module__.split(".")[0] == "cupy" else "cai"
    return Array(obj, kind, ptr, shape, dtype, device, interface.get("stream"))


def check(array, name, dtypes, shape):
    """Checks dtype (a name or a tuple of names) and shape (ints, None for any size)."""
    dtypes = (dtypes,) if isinstance(dtypes, str) else tuple(dtypes)
    if array.dtype not in dtypes:
        raise InvalidArgumentError(f"{name}: expected dtype {' or '.join(dtypes)}, "
                                   f"got {array.dtype}")
    if len(array.shape) != len(shape) or any(
            want is not None and want != got for want, got in zip(shape, array.shape)):
        expected = "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"
        raise InvalidArgumentError(f"{name}: expected shape {expected}, got {list(array.shape)}")
    return array


def tokens(shape, name):
    """(N, K, the leading shape of a per-token result) for an array of shape [K] or [N, K]."""
    if len(shape) == 1:
        return 1, shape[0], ()
    if len(shape) == 2:
        return shape[0], shape[1], (shape[0],)
    raise InvalidArgumentError(f"{name}: expected shape [K] or [N, K], got {list(shape)}")


def stream_handle(stream):
    """A cudaStream_t value from an int, a bitnet_ffi.Stream, a torch.cuda.Stream or a cupy
    Stream."""
    for attribute in ("cuda_stream", "ptr"):
        if hasattr(stream, attribute):
            return int(getattr(stream, attribute))
    from .cuda_graph import Stream
    if isinstance(stream, (numbers.Integral, Stream)):
        return int(stream)
    raise ArgumentTypeError(f"stream: expected a CUDA stream (a bitnet_ffi.Stream, a torch or CuPy "
                            f"stream, or a cudaStream_t as an int), got {_type_name(stream)}")


def prepare(named, stream=None, writes=(), optional=()):
    """Wraps each (name, obj) of ``named``, checks that all live on one device and that those
    named in ``writes`` are writable, and returns (arrays, device, stream) with the stream as the
    ``void *`` the C ops take (NULL on the CPU). Only the names in
    ``optional`` may be None (and stay None). Without an explicit stream, a GPU op runs on the
    current stream of the caller's framework, so it orders with the caller's own work."""
    handle = None if stream is None else stream_handle(stream)  # checked on the CPU too
    arrays = {}
    for name, obj in named.items():
        if obj is None and name not in optional:
            raise ArgumentTypeError(f"{name}: expected an array, got None")
        arrays[name] = None if obj is None else as_array(obj, name)
    for name in writes:  # C cannot tell, and writing a read-only memory map would crash
        a = arrays[name]
        if a is not None and a.kind == "numpy" and not a.obj.flags.writeable:
            raise InvalidArgumentError(f"{name}: the array is read-only, and the op writes it")
    present = [(name, a) for name, a in arrays.items() if a is not None]
    device = present[0][1].device
    for name, a in present:
        if a.device != device:
            where = ", ".join(f"{n} on {device_name(x.device)}" for n, x in present)
            raise InvalidArgumentError(f"arrays are on different devices: {where}")
    if device == CPU:
        handle = 0
    elif handle is None:
        handle = _framework_stream(present, device)
    return arrays, device, _ffi.ffi.cast("void *", handle)


def _framework_stream(present, device):
    kinds = {a.kind for _, a in present}
    if "torch" in kinds:
        return _torch_current_stream(device)
    if "cupy" in kinds:
        import cupy
        return cupy.cuda.get_current_stream().ptr
    for _, a in present:
        if a.cai_stream is not None:
            return 0 if a.cai_stream == 1 else int(a.cai_stream)  # 1 is the legacy default stream
    return 0


def _torch_current_stream(device):
    """torch's current cudaStream_t on `device`. torch.cuda.current_stream builds a Stream object
    (3.5 us on the H100 machine's CPU, the largest part of an eager op's host time), so the raw
    accessor that Triton also calls is used where this torch has it (0.1 us)."""
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device)
    return torch.cuda.current_stream(device).cuda_stream


def output(arrays, name, obj, reference, shape, dtype):
    """An op's output: `obj` as given, checked for dtype and shape, or a new array like `reference`
    when it is None. Returns (the object to return to the caller, its Array)."""
    if obj is None:
        obj = new_like(reference, shape, dtype)
        arrays[name] = as_array(obj, name)
    return obj, check(arrays[name], name, dtype, shape)


def new_like(reference, shape, dtype):
    """A new uninitialised array of the same kind and device as `reference`."""
    if reference.kind == "numpy":
        return np.empty(shape, dtype=numpy_dtype(dtype))
    if reference.kind == "torch":
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype), device=reference.obj.device)
    if reference.kind == "cupy":
        import cupy
        with cupy.cuda.Device(reference.device):
            return cupy.empty(shape, dtype=dtype)
    return DeviceArray(shape, dtype, reference.device)


def upload_int32(host, reference, name):
    """Checked host integers as an int32 array on the reference's device: the caller asked for a
    GPU op with host-side metadata, so this is an explicit, synchronous copy (complete before any
    stream reads it)."""
    host = np.ascontiguousarray(host, dtype=np.int32)
    if reference.device == CPU:
        return as_array(host, name)
    if reference.kind == "torch":
        import torch
        uploaded = torch.from_numpy(host).to(reference.obj.device)
        torch.cuda.current_stream(reference.device).synchronize()
        return as_array(uploaded, name)
    if reference.kind == "cupy":
        import cupy
        with cupy.cuda.Device(reference.device):
            uploaded = cupy.asarray(host)
            cupy.cuda.get_current_stream().synchronize()
        return as_array(uploaded, name)
    return as_array(DeviceArray.from_numpy(host, reference.device), name)


def int32_per_row(values, name, count, reference, check_host=None):
    """An int32 array [count] on the reference's device, from host integers (a list, tuple or numpy
    array: checked, `check_host(host)` too, then uploaded by upload_int32) or from an array already
    on that device (checked for dtype and shape only: the host cannot read it)."""
    if isinstance(values, (list, tuple, np.ndarray)):
        host = np.asarray(values)
        if host.shape != (count,) or not np.issubdtype(host.dtype, np.integer):
            raise InvalidArgumentError(f"{name}: expected {count} integers, got {host.dtype} "
                                       f"{list(host.shape)}")
        if host.size and (host.min() < -2**31 or host.max() >= 2**31):
            raise InvalidArgumentError(f"{name}: values must fit int32")
        if check_host:
            check_host(host)
        return upload_int32(host, reference, name)
    array = as_array(values, name)
    if array.device != reference.device:
        raise InvalidArgumentError(f"{name} is on {device_name(array.device)}, but the op's arrays "
                                   f"are on {device_name(reference.device)}")
    return check(array, name, "int32", (count,))


class DeviceArray:
    """Memory on a CUDA device, allocated and freed by libbitnet. Exports
    ``__cuda_array_interface__`` (except for bfloat16, which the interface cannot describe), so
    ``torch.as_tensor(a, device="cuda")`` and ``cupy.asarray(a)`` view it without copying."""

    def __init__(self, shape, dtype, device=0):
        if dtype not in DTYPE_CODES:
            raise InvalidArgumentError(f"DeviceArray: dtype {dtype!r} is not one of "
                                       f"{', '.join(DTYPE_CODES)}")
        if isinstance(shape, (str, bytes)) or not isinstance(shape, (numbers.Integral, tuple, list)):
            raise ArgumentTypeError(f"DeviceArray: shape must be an integer or a tuple of "
                                    f"integers, got {shape!r}")
        shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
        shape = tuple(integer(d, "DeviceArray: shape") for d in shape)
        if any(d < 0 for d in shape):
            raise InvalidArgumentError(f"DeviceArray: negative dimension in shape {list(shape)}")
        self.shape, self.dtype, self.device = shape, dtype, integer(device, "DeviceArray: device")
        self.nbytes = math.prod(shape) * ITEMSIZE[dtype]  # Python ints: no silent wrap-around
        if self.nbytes >= 1 << 63:
            raise InvalidArgumentError(f"DeviceArray: shape {list(shape)} of {dtype} is "
                                       f"{self.nbytes} bytes, more than a 64-bit size holds")
        out = _ffi.ffi.new("void **")
        _ffi.call("malloc", self.device, self.nbytes, out)
        self.ptr = int(_ffi.ffi.cast("uintptr_t", out[0]))
        self._finalizer = weakref.finalize(self, _free, self.device, self.ptr)

    @classmethod
    def _view(cls, base, ptr, shape):
        view = cls.__new__(cls)
        view.shape, view.dtype, view.device = tuple(int(d) for d in shape), base.dtype, base.device
        view.nbytes = math.prod(view.shape) * ITEMSIZE[base.dtype]
        view.ptr, view._base = ptr, base  # the base owns the memory; the view keeps it alive
        view._finalizer = lambda: None
        return view

    def reshape(self, *shape):
        """A view with another shape of the same number of elements."""
        shape = tuple(shape[0]) if len(shape) == 1 and not np.isscalar(shape[0]) else shape
        if -1 in shape:
            known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
            shape = tuple(self.nbytes // ITEMSIZE[self.dtype] // known if d == -1 else d
                          for d in shape)
        if math.prod(shape) * ITEMSIZE[self.dtype] != self.nbytes:
            raise InvalidArgumentError(f"cannot reshape {list(self.shape)} to {list(shape)}")
        return DeviceArray._view(self, self.ptr, shape)

    def __getitem__(self, rows):
        """A view of a range of rows (the leading axis), which is contiguous."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise InvalidArgumentError("DeviceArray supports only contiguous row slices a[i:j]")
        start, stop, _ = rows.indices(self.shape[0])
        stop = max(start, stop)
        row_bytes = self.nbytes // self.shape[0] if self.shape[0] else 0
        return DeviceArray._view(self, self.ptr + start * row_bytes,
                                 (stop - start, *self.shape[1:]))

    @classmethod
    def from_numpy(cls, array, device=0):
        """A device copy of a numpy array (synchronous)."""
        host = as_array(np.asarray(array), "array")
        result = cls(host.shape, host.dtype, device)
        if result.nbytes:
            _ffi.call("memcpy", _ffi.ffi.cast("void *", result.ptr), host.cptr(), result.nbytes,
                      _ffi.lib().BITNET_COPY_HOST_TO_DEVICE, _ffi.ffi.NULL)
        return result

    def numpy(self):
        """A host copy (synchronous: waits for the legacy default stream)."""
        host = np.empty(self.shape, dtype=numpy_dtype(self.dtype))
        if self.nbytes:
            _ffi.call("memcpy", _ffi.ffi.cast("void *", host.ctypes.data),
                      _ffi.ffi.cast("void *", self.ptr), self.nbytes,
                      _ffi.lib().BITNET_COPY_DEVICE_TO_HOST, _ffi.ffi.NULL)
        return host

    def free(self):
        """Frees the memory now rather than when the object is collected."""
        self._finalizer()
        self.ptr = 0

    @property
    def __cuda_array_interface__(self):
        if self.dtype not in _TYPESTR_OF:
            raise AttributeError(f"__cuda_array_interface__ cannot describe {self.dtype}")
        return {"shape": self.shape, "typestr": _TYPESTR_OF[self.dtype], "data": (self.ptr, False),
                "strides": None, "version": 3, "stream": None}

    def __repr__(self):
        return f"DeviceArray(shape={list(self.shape)}, dtype={self.dtype}, device=cuda:{self.device})"


def _free(device, ptr):
    if ptr:
        _ffi.lib().bitnet_free(device, _ffi.ffi.cast("void *", ptr))


def first_rows(array, rows, width):
    """The [rows, width] view of a buffer's first rows * width elements (numpy or DeviceArray)."""
    return array.reshape(-1)[:rows * width].reshape(rows, width)
