"""Device memory entry points: argument checks anywhere (tier 1), real transfers on a GPU (tier 2)."""
import numpy as np
import pytest

import bitnet_ffi
from bitnet_ffi import _ffi
from bitnet_ffi.errors import InvalidArgumentError, NoDeviceError, OutOfMemoryError

ffi = _ffi.ffi


@pytest.mark.cpu
@pytest.mark.parametrize("call,args,message", [
    ("malloc", (0, -1, "out"), "nbytes must not be negative"),
    ("malloc", (-1, 16, "out"), "not a CUDA device index"),
    ("malloc", (0, 16, None), "ptr is NULL"),
    ("memcpy", ("host", "host", -3, 0), "nbytes must not be negative"),
    ("memcpy", ("host", "host", 8, 7), "kind 7 is not a bitnet_copy_kind"),
    ("memset", ("host", 300, 8), "byte_value 300 is not in 0..255"),
    ("device_synchronize", (-2,), "not a CUDA device index"),
])
def test_bad_arguments_are_rejected(call, args, message):
    host = np.arange(8, dtype=np.uint8)
    before = host.copy()
    converted = []
    for a in args:
        if a == "out":
            a = ffi.new("void **")
        elif a == "host":
            a = ffi.cast("void *", host.ctypes.data)
        elif a is None:
            a = ffi.NULL
        converted.append(a)
    if call in ("memcpy", "memset"):
        converted.append(ffi.NULL)
    status = getattr(_ffi.lib(), "bitnet_" + call)(*converted)
    assert status == _ffi.lib().BITNET_ERR_INVALID_ARGUMENT
    assert message in _ffi.last_error()
    np.testing.assert_array_equal(host, before)


@pytest.mark.cpu
def test_zero_sized_requests_succeed_without_touching_memory():
    out = ffi.new("void **", ffi.cast("void *", 1))
    count = ffi.new("int32_t *")
    _ffi.call("device_count", count, ffi.NULL)
    if count[0]:
        _ffi.call("malloc", 0, 0, out)
        assert out[0] == ffi.NULL
    _ffi.call("memcpy", ffi.NULL, ffi.NULL, 0, 0, ffi.NULL)
    _ffi.call("free", 0, ffi.NULL)


@pytest.mark.cpu
def test_host_pointers_report_the_cpu():
    host = np.ones(4, dtype=np.float32)
    where = ffi.new("int32_t *", 7)
    _ffi.call("pointer_device", ffi.cast("void *", host.ctypes.data), where)
    assert where[0] == -1


@pytest.mark.cpu
def test_memset_of_host_memory_is_refused_or_no_device():
    host = np.full(16, 9, dtype=np.uint8)
    with pytest.raises((InvalidArgumentError, NoDeviceError), match="host memory|without CUDA"):
        _ffi.call("memset", ffi.cast("void *", host.ctypes.data), 0, 16, ffi.NULL)
    assert (host == 9).all()


@pytest.mark.gpu_smoke
def test_round_trip_host_device_device_host(rng):
    data = rng.integers(1, 256, size=1_000_003, dtype=np.uint8)
    first = bitnet_ffi.DeviceArray.from_numpy(data, 0)
    second = bitnet_ffi.DeviceArray(data.shape, "uint8", 0)
    _ffi.call("memset", ffi.cast("void *", second.ptr), 0xAB, second.nbytes, ffi.NULL)
    _ffi.call("memcpy", ffi.cast("void *", second.ptr), ffi.cast("void *", first.ptr),
              first.nbytes, _ffi.lib().BITNET_COPY_DEVICE_TO_DEVICE, ffi.NULL)
    back = second.numpy()
    np.testing.assert_array_equal(back, data)
    where = ffi.new("int32_t *")
    _ffi.call("pointer_device", ffi.cast("void *", second.ptr), where)
    assert where[0] == 0


@pytest.mark.gpu_smoke
def test_memset_and_wrong_direction_copy():
    array = bitnet_ffi.DeviceArray((64,), "uint8", 0)
    _ffi.call("memset", ffi.cast("void *", array.ptr), 0x5C, 64, ffi.NULL)
    assert (array.numpy() == 0x5C).all()
    host = np.zeros(64, dtype=np.uint8)
    with pytest.raises(InvalidArgumentError, match="does not match the copy kind"):
        _ffi.call("memcpy", ffi.cast("void *", host.ctypes.data), ffi.cast("void *", array.ptr), 64,
                  _ffi.lib().BITNET_COPY_HOST_TO_DEVICE, ffi.NULL)
    assert (host == 0).all()


@pytest.mark.gpu_smoke
def test_overlapping_device_copy_is_refused_untouched(rng):
    data = rng.integers(0, 256, 64, dtype=np.uint8)
    array = bitnet_ffi.DeviceArray.from_numpy(data, 0)
    with pytest.raises(InvalidArgumentError, match="src and dst overlap"):
        _ffi.call("memcpy", ffi.cast("void *", array.ptr + 8), ffi.cast("void *", array.ptr), 32,
                  _ffi.lib().BITNET_COPY_DEVICE_TO_DEVICE, ffi.NULL)
    assert (array.numpy() == data).all()


@pytest.mark.gpu_smoke
def test_out_of_memory_is_typed_and_the_library_keeps_working(rng):
    with pytest.raises(OutOfMemoryError, match="cudaErrorMemoryAllocation"):
        bitnet_ffi.DeviceArray((1 << 50,), "uint8", 0)
    data = rng.standard_normal(1000).astype(np.float32)
    np.testing.assert_array_equal(bitnet_ffi.DeviceArray.from_numpy(data, 0).numpy(), data)


@pytest.mark.gpu_smoke
def test_device_array_is_visible_to_torch_without_a_copy(rng):
    torch = pytest.importorskip("torch")
    data = rng.standard_normal((3, 5)).astype(np.float32)
    array = bitnet_ffi.DeviceArray.from_numpy(data, 0)
    tensor = torch.as_tensor(array, device="cuda")
    assert tensor.data_ptr() == array.ptr
    np.testing.assert_array_equal(tensor.cpu().numpy(), data)
