"""Resources: repeated op calls (and rejected calls) must not grow host memory; on the GPU, 10,000
DeviceArray alloc -> op -> free cycles must give back device memory (as the library's
bitnet_device_get_info and NVML see it) and host memory; an out-of-memory request raises
OutOfMemoryError and the library keeps working."""
import os

import numpy as np
import pytest

import bitnet_ffi as bn
from bitnet_ffi import _ffi
from bitnet_ffi.errors import InvalidArgumentError, OutOfMemoryError

from reference import backend_io, make_every_op_inputs as make_inputs, run_every_op

MiB = 1 << 20
CPU_ROUNDS = 500
# Host RSS may move by allocator caching and Python's own objects, not by anything per call: a
# leak of even 1 KiB per round of 19 ops would add 9.5 MiB over CPU_ROUNDS.
CPU_RSS_MARGIN = 8 * MiB
GPU_CYCLES = 10_000
# cudaMalloc works in 2 MiB pages; a leak of one 4 KiB array per cycle would be 40 MiB.
DEVICE_MARGIN = 4 * MiB
GPU_RSS_MARGIN = 16 * MiB


def rss_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_rejected_call(inputs):
    with pytest.raises(InvalidArgumentError):
        bn.rmsnorm(inputs["hidden"], inputs["norm_w"], eps=float("nan"))


@pytest.mark.soak
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="ASan's quarantine holds freed memory, so RSS grows without a leak")
def test_cpu_op_calls_do_not_grow_host_memory(capsys):
    inputs = make_inputs(7)
    put, get = backend_io("cpu")
    for _ in range(100):  # warm-up: OpenMP threads, allocator pools, lazily built Python objects
        run_every_op(inputs, put, get)
        one_rejected_call(inputs)
    start = rss_bytes()
    for _ in range(CPU_ROUNDS):
        run_every_op(inputs, put, get)
        one_rejected_call(inputs)
    growth = rss_bytes() - start
    with capsys.disabled():
        print(f"\n[resources] cpu: {CPU_ROUNDS} rounds of every op + a rejected call: host RSS "
              f"{start / MiB:.1f} MiB -> {(start + growth) / MiB:.1f} MiB "
              f"({growth / MiB:+.2f} MiB, margin {CPU_RSS_MARGIN / MiB:.0f} MiB)")
    assert growth <= CPU_RSS_MARGIN


def device_free_bytes(device=0):
    info = _ffi.ffi.new("bitnet_device_info *")
    _ffi.call("device_get_info", device, info)
    return info.free_memory_bytes


def nvml_used_bytes():
    """Device memory in use according to NVML, or None where pynvml is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used
    finally:
        pynvml.nvmlShutdown()


def alloc_op_free(host, counter):
    """One cycle: DeviceArrays allocated by the caller and by the op, an op, then freed."""
    gate_up = bn.DeviceArray.from_numpy(host)
    out = bn.relu2_gate(gate_up)
    ids = bn.DeviceArray.from_numpy(counter)
    bn.add_int32(ids, 1)
    bn.device_synchronize(0)
    for array in (gate_up, out, ids):
        array.free()


@pytest.mark.gpu
def test_gpu_alloc_op_free_cycles_give_memory_back(capsys):
    host = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float16)
    counter = np.arange(1000, dtype=np.int32)
    for _ in range(100):  # warm-up: context, modules loaded lazily, allocator state
        alloc_op_free(host, counter)
    free0, nvml0, rss0 = device_free_bytes(), nvml_used_bytes(), rss_bytes()
    for _ in range(GPU_CYCLES):
        alloc_op_free(host, counter)
    free1, nvml1, rss1 = device_free_bytes(), nvml_used_bytes(), rss_bytes()
    nvml = ("pynvml not installed" if nvml0 is None else
            f"NVML used {nvml0 / MiB:.1f} -> {nvml1 / MiB:.1f} MiB")
    with capsys.disabled():
        print(f"\n[resources] gpu: {GPU_CYCLES} alloc -> op -> free cycles: device free "
              f"{free0 / MiB:.1f} -> {free1 / MiB:.1f} MiB, {nvml}, host RSS {rss0 / MiB:.1f} -> "
              f"{rss1 / MiB:.1f} MiB")
    assert free0 - free1 <= DEVICE_MARGIN
    assert nvml0 is None or nvml1 - nvml0 <= DEVICE_MARGIN
    assert rss1 - rss0 <= GPU_RSS_MARGIN


@pytest.mark.gpu
def test_gpu_out_of_memory_is_typed_and_the_library_keeps_working(capsys):
    host = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float16)
    want = np.maximum(host[:, :32].astype(np.float32), 0) ** 2 * host[:, 32:].astype(np.float32)
    free0 = device_free_bytes()
    too_much = (free0 + (1 << 30),)  # more than the device has free
    for _ in range(100):
        with pytest.raises(OutOfMemoryError):
            bn.DeviceArray(too_much, "uint8")
    with pytest.raises(OutOfMemoryError):
        bn.DeviceArray((1 << 50,), "uint8")
    free1 = device_free_bytes()
    result = bn.relu2_gate(bn.DeviceArray.from_numpy(host)).numpy()
    np.testing.assert_allclose(result.astype(np.float32), want, rtol=1e-3, atol=6e-8)
    with capsys.disabled():
        print(f"\n[resources] gpu: 101 out-of-memory requests: OutOfMemoryError each time, device "
              f"free {free0 / MiB:.1f} -> {free1 / MiB:.1f} MiB, ops work afterwards")
    assert free0 - free1 <= DEVICE_MARGIN
