"""bitnet_ffi: BitNet b1.58 inference kernels (CUDA and CPU) behind a plain C ABI, for numpy,
PyTorch and CuPy arrays."""
from ._arrays import DeviceArray
from .device import detect, resolve, select
from .errors import (BitNetError, ConfigurationError, CudaError, InternalError,
                     InvalidArgumentError, LibraryNotFoundError, NoDeviceError, OutOfMemoryError,
                     UnsupportedError)

__version__ = "0.1.0"


def library_version():
    """The (major, minor, patch) version of the loaded libbitnet."""
    from . import _ffi
    parts = [_ffi.ffi.new("int32_t *") for _ in range(3)]
    _ffi.call("get_version", *parts)
    return tuple(p[0] for p in parts)


def device_synchronize(device=0):
    """Waits for all work on a CUDA device."""
    from . import _ffi
    _ffi.call("device_synchronize", int(device))
