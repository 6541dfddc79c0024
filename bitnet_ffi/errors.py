"""The exception hierarchy: every non-OK status of libbitnet becomes one of these."""


class BitNetError(Exception):
    """Base class of every error raised by bitnet_ffi. ``status`` is the C status code (or None)."""

    status = None

    def __init__(self, message, status=None):
        super().__init__(message)
        if status is not None:
            self.status = status


class InvalidArgumentError(BitNetError, ValueError):
    """A bad pointer, size, shape, dtype or value (BITNET_ERR_INVALID_ARGUMENT)."""

    status = 1


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type: None or another object where an array is expected, a float
    where an integer is, a single number where a sequence is. A TypeError by Python's convention,
    and an InvalidArgumentError too, so that code catching that keeps working."""


class UnsupportedError(BitNetError, NotImplementedError):
    """Valid, but not implemented for this shape, dtype or backend (BITNET_ERR_UNSUPPORTED)."""

    status = 2


class NoDeviceError(BitNetError, RuntimeError):
    """No such CUDA device, a CPU-only build, or a fake GPU asked to run a kernel."""

    status = 3


class OutOfMemoryError(BitNetError, MemoryError):
    """The device is out of memory (BITNET_ERR_OUT_OF_MEMORY)."""

    status = 4


class CudaError(BitNetError, RuntimeError):
    """The CUDA runtime or driver failed (BITNET_ERR_CUDA)."""

    status = 5


class InternalError(BitNetError, RuntimeError):
    """A bug in libbitnet (BITNET_ERR_INTERNAL)."""

    status = 6


class LibraryNotFoundError(BitNetError, OSError):
    """libbitnet.so could not be found or loaded."""


class ConfigurationError(BitNetError, ValueError):
    """A BITNET_* environment variable has a value that cannot be used."""


class CorruptFileError(BitNetError, ValueError):
    """A model file is truncated or malformed, or its tensors do not match the model (the
    message names the file and the tensor)."""


class CommunicationError(BitNetError, RuntimeError):
    """A collective between ranks failed: an NCCL error (``status`` is then the ncclResult_t), a
    libnccl that cannot be loaded, or a rank that could not start."""


class RankFailedError(CommunicationError):
    """Another rank of a multi-GPU run failed (or timed out); ``failed_rank`` names it (None when
    no single rank is to blame, e.g. a timeout of several)."""

    def __init__(self, message, failed_rank=None):
        super().__init__(message)
        self.failed_rank = failed_rank


BY_STATUS = {cls.status: cls for cls in (InvalidArgumentError, UnsupportedError, NoDeviceError,
                                         OutOfMemoryError, CudaError, InternalError)}
# ncclResult_t -> exception (bitnet_ffi.nccl): usage errors are ours, CUDA errors CUDA's.
BY_NCCL_RESULT = {1: CudaError, 2: CommunicationError, 3: InternalError, 4: InvalidArgumentError,
                  5: InvalidArgumentError, 6: CommunicationError, 8: CommunicationError}
