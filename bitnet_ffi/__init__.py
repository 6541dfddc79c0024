"""bitnet_ffi: BitNet b1.58 inference kernels (CUDA and CPU) behind a plain C ABI, for numpy,
PyTorch and CuPy arrays."""
from . import _arrays, _ffi
from ._arrays import DeviceArray
from .attention import attention, attention_workspace_size
from .cuda_graph import Event, Graph, Stream
from .decode_layer import decode_layer, decode_layer_workspace_size
from .device import detect, resolve, select
from .errors import (ArgumentTypeError, BitNetError, ConfigurationError, CorruptFileError,
                     CudaError, InternalError, InvalidArgumentError, LibraryNotFoundError,
                     NoDeviceError, OutOfMemoryError, UnsupportedError)
from .fused_norm import (gemv_w2a8_add_norm_stats, new_norm_stats, norm_stats_slots,
                         rmsnorm_gemv_w2a8, rmsnorm_gemv_w2a8_rope_append_kv)
from .head import add_int32, argmax, embedding, gemv_bf16
from .layer_glue import (attention_rope_append_kv, glu_gate, gemv_w2a8_rope_append_kv, relu2_gate,
                         rope_append_kv)
from .norm import (add_rmsnorm, glu_rmsnorm_quantize, relu2_rmsnorm_quantize, rmsnorm,
                   rmsnorm_quantize)
from .norm import glu_rmsnorm_partial, rmsnorm_partial
from .sampling import sample
from .ternary import (TernaryWeights, cpu_isa, gemv_w2a8, pack_ternary, quantize_a8,
                      quantize_i2s, set_cpu_isa)

__all__ = [
    "DeviceArray", "Stream", "Event", "Graph", "detect", "select", "resolve", "quantize_i2s",
    "pack_ternary", "TernaryWeights", "quantize_a8", "gemv_w2a8", "cpu_isa", "set_cpu_isa",
    "rmsnorm", "add_rmsnorm", "rmsnorm_quantize", "relu2_rmsnorm_quantize", "attention",
    "attention_workspace_size", "rope_append_kv", "attention_rope_append_kv",
    "gemv_w2a8_rope_append_kv", "relu2_gate",
    "gemv_bf16", "argmax", "embedding", "add_int32", "glu_gate", "glu_rmsnorm_quantize", "sample", "library_version",
    "device_synchronize", "BitNetError", "InvalidArgumentError", "ArgumentTypeError",
    "UnsupportedError", "NoDeviceError", "OutOfMemoryError", "CudaError", "InternalError",
    "LibraryNotFoundError", "ConfigurationError", "CorruptFileError",
    "rmsnorm_partial", "glu_rmsnorm_partial", "decode_layer", "decode_layer_workspace_size",
    "gemv_w2a8_add_norm_stats", "rmsnorm_gemv_w2a8", "rmsnorm_gemv_w2a8_rope_append_kv",
    "norm_stats_slots", "new_norm_stats",
]

__version__ = "0.1.0"


def library_version():
    """The (major, minor, patch) version of the loaded libbitnet."""
    parts = [_ffi.ffi.new("int32_t *") for _ in range(3)]
    _ffi.call("get_version", *parts)
    return tuple(p[0] for p in parts)


def device_synchronize(device=0):
    """Waits for all work on a CUDA device."""
    _ffi.call("device_synchronize", _arrays.integer(device, "device"))
