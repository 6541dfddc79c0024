"""bitnet_ffi: BitNet b1.58 inference kernels (CUDA and CPU) behind a plain C ABI, for numpy,
PyTorch and CuPy arrays."""
from ._arrays import DeviceArray
from .attention import attention, attention_workspace_size
from .layer import relu2_gate, rope_append_kv
from .cuda_graph import Event, Graph, Stream
from .device import detect, resolve, select
from .head import add_int32, argmax, embedding, gemv_bf16
from .norm import add_rmsnorm, rmsnorm, rmsnorm_quantize
from .ternary import (TernaryWeights, cpu_isa, gemv_w2a8, pack_ternary, quantize_a8,
                      quantize_i2s, set_cpu_isa)
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
