"""Test tiers and shared fixtures.

Every test carries exactly one tier marker (cpu, gpu_smoke, gpu, perf, soak) and may add multi_gpu.
A test that needs a GPU skips with a reason where no real CUDA GPU exists, and fails instead under
BITNET_STRICT_MODE=1. Random inputs come from the `rng` fixture, whose seed is printed (set
BITNET_TEST_SEED to replay one)."""
import os
import secrets
import subprocess
import sys

import numpy as np
import pytest

TIER_MARKERS = ("cpu", "gpu_smoke", "gpu", "perf", "soak")

try:  # hypothesis profiles for the property tests: "ci" (default, keeps tier 1 fast), "deep" (GPU
    # machine). The ISA fixture is reset once per test, not per example: that health check is off.
    from hypothesis import HealthCheck, settings

    _RELAXED = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                HealthCheck.data_too_large]
    settings.register_profile("ci", max_examples=100, deadline=None, print_blob=True,
                              suppress_health_check=_RELAXED)
    settings.register_profile("deep", max_examples=500, deadline=None, print_blob=True,
                              suppress_health_check=_RELAXED)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:
    pass


def real_gpu_count():
    """Real CUDA devices, whatever BITNET_GPU_FAKE says (0 if the library cannot be loaded)."""
    try:
        from bitnet_ffi import _ffi
        count = _ffi.ffi.new("int32_t *")
        _ffi.call("device_count", count, _ffi.ffi.NULL)
        return count[0]
    except Exception:
        return 0


def plain_run_only(why):
    """Skips a test in make asan-test's run of tier 1 (the ASan runtime preloaded), where it would
    check nothing more than the plain run does; `why` says why."""
    return pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                              reason=f"run by the plain tier 1 run; {why}")


builds_the_library = plain_run_only("under the ASan preload every compiler the build starts would load ASan too")


def pytest_collection_modifyitems(config, items):
    wrong = [f"{item.nodeid}: {[m for m in TIER_MARKERS if item.get_closest_marker(m)]}"
             for item in items if sum(bool(item.get_closest_marker(m)) for m in TIER_MARKERS) != 1]
    if wrong:
        raise pytest.UsageError("each test needs exactly one tier marker of "
                                f"{TIER_MARKERS}:\n" + "\n".join(wrong))


def require_gpus(needed):
    """Skips the running test unless `needed` real CUDA GPUs exist; under BITNET_STRICT_MODE=1,
    fails it instead."""
    have = real_gpu_count()
    if have >= needed:
        return
    reason = f"needs {needed} real CUDA GPU(s), found {have}"
    if os.environ.get("BITNET_STRICT_MODE", "").strip() == "1":
        pytest.fail(f"BITNET_STRICT_MODE=1: {reason}", pytrace=False)
    pytest.skip(reason)


def pytest_runtest_setup(item):
    if item.get_closest_marker("multi_gpu"):
        require_gpus(2)
    elif item.get_closest_marker("gpu_smoke") or item.get_closest_marker("gpu"):
        require_gpus(1)


@pytest.fixture
def cuda():
    """For tests outside the GPU tiers (perf: tests/test_targets.py) that need a GPU: the device
    index 0, after the same skip-or-fail rule as the GPU tiers."""
    require_gpus(1)
    return 0


@pytest.fixture
def rng(request):
    """A numpy Generator with a fresh seed per test, printed so that a failure can be replayed."""
    seed = int(os.environ.get("BITNET_TEST_SEED") or secrets.randbits(32))
    print(f"seed={seed} (replay with BITNET_TEST_SEED={seed})")
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.fixture
def clean_env(monkeypatch):
    """Removes every BITNET_* variable that steers detection, so a test sets exactly what it means."""
    for name in ("BITNET_GPU_FAKE", "BITNET_STRICT_MODE", "BITNET_STRICT_NO_FAKE_GPU",
                 "BITNET_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def first_call_in_a_graph_capture():
    """Runs, in a fresh Python process: `setup`, then `op` captured in a CUDA graph on a new
    libbitnet stream (so that it is the process's first call of that op), the graph's launch, and
    `report`, which prints. Returns what it printed; fails with its stderr if it failed."""
    def run(setup, op, report):
        script = (setup + "stream = bitnet_ffi.Stream(0)\n"
                  "with bitnet_ffi.Graph.capture(stream) as graph:\n"
                  "    " + op + "\n"
                  "graph.launch(); stream.synchronize()\n" + report)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout
    return run


@pytest.fixture(params=["portable", "avx2", "avx512-vnni"])
def isa(request):
    """Each CPU SIMD path this machine runs, set for the test (skipped where the CPU lacks it)."""
    import bitnet_ffi as bn
    from reference import cpu_isas
    if request.param not in cpu_isas():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    bn.set_cpu_isa(request.param)
    assert bn.cpu_isa() == request.param
    yield request.param
    bn.set_cpu_isa("auto")
