"""Every rule of device detection and selection (bitnet_ffi/device.py), under each environment
combination. Expectations account for real GPUs, so the same tests hold on a GPU machine."""
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import bitnet_ffi
from bitnet_ffi import device
from bitnet_ffi.errors import ConfigurationError, NoDeviceError
from conftest import real_gpu_count

REPO = Path(__file__).resolve().parents[1]
REAL = real_gpu_count()
pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("value,expected", [
    ("cuda", ["cuda"]), ("CUDA", ["cuda"]), ("gpu", ["cuda"]), ("rocm", ["rocm"]),
    ("metal", ["metal"]), ("cuda,rocm", ["cuda", "rocm"]), ("Metal; cuda  rocm", ["metal", "cuda", "rocm"]),
    ("cuda,,gpu", ["cuda"]), ("", []), ("none", []), ("NONE", []), ("0", []), ("  ", []), (None, []),
])
def test_fake_list_parsing(value, expected):
    assert device.parse_fake(value) == expected


def test_unknown_fake_backend_is_an_error():
    with pytest.raises(ConfigurationError, match="unknown backend 'tpu'"):
        device.parse_fake("cuda,tpu")


def test_no_fake_sees_only_real_devices(clean_env):
    detection = device.detect()
    assert not detection.fake and not detection.strict
    assert [d.fake for d in detection.devices] == [False] * REAL
    assert detection.backends == (["cuda"] if REAL else []) + ["cpu"]
    if not REAL:
        assert detection.no_gpu_reason


def test_fake_devices_are_added_and_marked(clean_env):
    clean_env.setenv("BITNET_GPU_FAKE", "gpu;rocm")
    detection = device.detect()
    fakes = [d for d in detection.devices if d.fake]
    assert [(d.backend, d.index) for d in fakes] == [("cuda", REAL), ("rocm", 0)]
    assert all("(fake)" in d.label for d in fakes)
    assert "rocm(fake)" in detection.summary_detected()
    assert ("cuda(fake)" in detection.summary_detected()) == (REAL == 0)


def test_auto_selects_the_first_real_gpu_else_the_cpu(clean_env):
    selection = device.select()
    assert selection.requested == "auto"
    assert selection.selected == ("cuda:0" if REAL else "cpu")
    assert selection.summary().startswith(f"requested=auto detected=[")
    assert selection.summary().split()[2] == f"selected={selection.selected}"


def test_auto_with_only_a_fake_gpu_falls_back_to_the_cpu_and_says_so(clean_env):
    clean_env.setenv("BITNET_GPU_FAKE", "cuda")
    selection = device.select()
    if REAL:
        assert selection.selected == "cuda:0" and not selection.fake
    else:
        assert selection.selected == "cpu" and not selection.fake
        assert "fell back to the CPU" in selection.summary()


def test_cuda_on_a_fake_gpu_is_selected_as_fake_but_never_runs(clean_env):
    clean_env.setenv("BITNET_GPU_FAKE", "cuda")
    clean_env.setenv("BITNET_DEVICE", f"cuda:{REAL}")
    selection = device.select()
    assert selection.selected == f"cuda:{REAL}" and selection.fake
    assert "(fake)" in selection.summary()
    with pytest.raises(NoDeviceError, match="fake GPU"):
        bitnet_ffi.resolve()


def test_cuda_without_any_gpu_is_an_error_not_a_fallback(clean_env):
    clean_env.setenv("BITNET_DEVICE", "cuda")
    if REAL:
        assert device.select().selected == "cuda:0"
    else:
        with pytest.raises(NoDeviceError, match="BITNET_DEVICE=cuda: no such CUDA device"):
            device.select()


def test_out_of_range_cuda_index_is_an_error(clean_env):
    clean_env.setenv("BITNET_DEVICE", f"cuda:{REAL + 3}")
    with pytest.raises(NoDeviceError, match=f"cuda:{REAL + 3}: no such CUDA device"):
        device.select()


def test_cpu_is_always_selectable(clean_env):
    clean_env.setenv("BITNET_GPU_FAKE", "cuda")
    clean_env.setenv("BITNET_DEVICE", "cpu")
    assert device.select().selected == "cpu"
    assert bitnet_ffi.resolve() == -1


@pytest.mark.parametrize("value", ["tpu", "cuda:x", "gpu0", "cuda:-1"])
def test_bad_device_request_is_an_error(clean_env, value):
    clean_env.setenv("BITNET_DEVICE", value)
    with pytest.raises(ConfigurationError, match="expected auto, cpu, cuda or cuda:N \\(gpu, gpu:N\\)"):
        device.select()


def test_strict_mode_ignores_the_fake(clean_env):
    clean_env.setenv("BITNET_GPU_FAKE", "cuda,rocm")
    clean_env.setenv("BITNET_STRICT_MODE", "1")
    with pytest.warns(UserWarning, match="BITNET_STRICT_MODE=1 ignores BITNET_GPU_FAKE='cuda,rocm'"):
        detection = device.detect()
    assert detection.strict and not detection.fake
    assert not any(d.fake for d in detection.devices)
    assert "rocm" not in detection.backends
    with pytest.warns(UserWarning):
        assert "ignores BITNET_GPU_FAKE='cuda,rocm'" in device.select().summary()
    clean_env.setenv("BITNET_DEVICE", "cuda")
    if not REAL:
        with pytest.raises(NoDeviceError), pytest.warns(UserWarning):
            device.select()


@pytest.mark.parametrize("name", ["gpu", "GPU:0", "cuda"])
def test_gpu_is_another_name_for_cuda(clean_env, name):
    """As in BITNET_GPU_FAKE, gpu means cuda: in BITNET_DEVICE, resolve() and .to()."""
    clean_env.setenv("BITNET_DEVICE", name)
    if REAL:
        assert device.select().selected == "cuda:0" and bitnet_ffi.resolve(name) == 0
        return
    with pytest.raises(NoDeviceError, match="no such CUDA device"):
        device.select()
    clean_env.setenv("BITNET_GPU_FAKE", "cuda")
    tw = bitnet_ffi.pack_ternary(np.zeros((1, 128), np.int8), 1.0)
    with pytest.raises(NoDeviceError, match="fake GPU"):
        tw.to(name)


def test_a_device_that_is_not_a_name_or_an_index_is_a_type_error(clean_env):
    with pytest.raises(bitnet_ffi.ArgumentTypeError, match="device: expected a name"):
        bitnet_ffi.resolve(0.5)


def test_strict_no_fake_gpu_with_a_fake_is_an_error(clean_env):
    clean_env.setenv("BITNET_STRICT_NO_FAKE_GPU", "1")
    device.detect()  # no fake set: fine
    clean_env.setenv("BITNET_GPU_FAKE", "none")
    device.detect()  # "none" is no fake
    clean_env.setenv("BITNET_GPU_FAKE", "cuda")
    with pytest.raises(ConfigurationError, match="BITNET_STRICT_NO_FAKE_GPU=1 forbids fake GPUs"):
        device.detect()


def test_detection_works_without_pynvml(clean_env):
    clean_env.setitem(sys.modules, "pynvml", None)  # import pynvml now raises ImportError
    detection = device.detect()
    assert all(d.used_memory_bytes is None for d in detection.devices)
    assert len(detection.devices) == REAL


def test_resolve_accepts_ints_and_names(clean_env):
    assert bitnet_ffi.resolve(-1) == -1
    assert bitnet_ffi.resolve("cpu") == -1
    if REAL:
        assert bitnet_ffi.resolve(0) == 0 and bitnet_ffi.resolve("cuda") == 0


def run_cli(*args, **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("BITNET_")}
    environment.update(env)
    return subprocess.run([sys.executable, "-m", "bitnet_ffi", *args], capture_output=True,
                          text=True, env=environment, cwd=str(REPO))


def test_cli_info_prints_summary_and_table():
    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("requested=auto detected=[")
    assert lines[1].split()[:2] == ["device", "name"]
    assert any(line.startswith("cpu ") for line in lines)


def test_cli_info_json_has_the_documented_keys():
    result = run_cli("info", "--json", BITNET_GPU_FAKE="cuda")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert {"requested", "selected", "detected", "fake", "strict", "devices"} <= info.keys()
    assert info["requested"] == "auto" and info["fake"] is True and info["strict"] is False
    assert info["selected"] == ("cuda:0" if REAL else "cpu")
    assert info["detected"] == (["cuda"] if REAL else ["cuda(fake)"]) + ["cpu"]  # marked as in text
    fake = [d for d in info["devices"] if d["fake"]]
    assert len(fake) == 1 and fake[0]["backend"] == "cuda"
    for key in ("name", "compute_capability", "total_memory_bytes", "free_memory_bytes", "sm_count",
                "l2_cache_bytes", "peak_bandwidth_gbps", "supports_bf16", "driver_version"):
        assert key in fake[0]


def test_cli_strict_json():
    result = run_cli("info", "--json", BITNET_GPU_FAKE="cuda", BITNET_STRICT_MODE="1")
    info = json.loads(result.stdout)
    assert info["strict"] is True and info["fake"] is False
    assert not any(d["fake"] for d in info["devices"])
    assert "BITNET_STRICT_MODE=1 ignores BITNET_GPU_FAKE='cuda'" in info["note"]
    assert "BITNET_STRICT_MODE=1 ignores BITNET_GPU_FAKE='cuda'" in result.stderr  # the warning


def test_cli_info_cpu_row_shows_the_isa_and_threads():
    result = run_cli("info", OMP_NUM_THREADS="3")
    row = next(line for line in result.stdout.splitlines() if line.startswith("cpu "))
    assert f"host CPU ({bitnet_ffi.cpu_isa()}, 3 threads)" in row


def test_cli_info_into_a_closed_pipe_ends_quietly():
    """`info | head -1`: the reader may be gone before info writes. A pipe whose read end is
    closed before the process starts makes that certain: no traceback, exit code 1."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("BITNET_")}
    result = subprocess.run([sys.executable, "-m", "bitnet_ffi", "info", "--json"],
                            stdout=write_end, stderr=subprocess.PIPE, text=True, env=environment,
                            cwd=str(REPO))
    os.close(write_end)
    assert result.returncode == 1 and result.stderr == "", result.stderr


def test_no_gpu_reason_tells_no_driver_from_no_device(clean_env):
    """A CUDA build on a machine without libcuda.so.1 says there is no NVIDIA driver (the CUDA
    runtime calls that an insufficient driver); with a driver, the reason never says so."""
    flag = bitnet_ffi._ffi.ffi.new("int32_t *")
    bitnet_ffi._ffi.call("has_cuda", flag)
    if not flag[0]:
        pytest.skip("a CPU-only libbitnet: the reason is the build (tested elsewhere)")
    try:
        ctypes.CDLL("libcuda.so.1")
        driver = True
    except OSError:
        driver = False
    reason = device.detect().no_gpu_reason
    if driver:
        assert "no NVIDIA driver" not in reason
    else:
        assert reason.startswith("no NVIDIA driver: libcuda.so.1 is not installed"), reason
        assert "insufficient for CUDA runtime version" not in reason


def test_cli_reports_errors_without_a_traceback():
    result = run_cli("info", BITNET_DEVICE="tpu")
    assert result.returncode == 2
    assert result.stderr.startswith("error: ConfigurationError: BITNET_DEVICE='tpu'")
    assert "Traceback" not in result.stderr
