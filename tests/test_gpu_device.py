"""device_info on a real GPU, checked against NVML (nvidia-ml-py)."""
import pytest

from bitnet_ffi import device

pytestmark = pytest.mark.gpu_smoke


def test_device_info_matches_nvml(clean_env):
    pynvml = pytest.importorskip("pynvml")
    detection = device.detect()
    first = detection.devices[0]
    assert not first.fake and first.backend == "cuda"
    assert first.sm_count > 0 and first.max_threads_per_block >= 512
    assert first.l2_cache_bytes > 0 and first.peak_bandwidth_gbps > 100
    assert first.supports_fp16 and first.supports_int8_dot
    assert 0 < first.free_memory_bytes <= first.total_memory_bytes
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(first.pci_bus_id)
        name = pynvml.nvmlDeviceGetName(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    finally:
        pynvml.nvmlShutdown()
    assert (name if isinstance(name, str) else name.decode()) == first.name
    assert f"{major}.{minor}" == first.compute_capability
    # cudaMemGetInfo leaves out memory the driver reserves: within 2% of NVML's total.
    assert abs(memory.total - first.total_memory_bytes) <= 0.02 * memory.total
    assert first.used_memory_bytes is not None and first.utilization_percent is not None
    assert first.driver_version.count(".") >= 1


def test_cli_shows_the_real_gpu(clean_env):
    selection = device.select("auto")
    assert selection.selected == "cuda:0" and not selection.fake
    assert selection.summary().startswith("requested=auto detected=[cuda,cpu] selected=cuda:0")
