"""ci/tiers.py: a GPU tier asked for on a machine without a GPU fails saying why; auto runs what the
machine can (tier 1 and the soak everywhere)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import real_gpu_count

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.cpu

spec = importlib.util.spec_from_file_location("tiers", REPO / "ci" / "tiers.py")
tiers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiers)


@pytest.mark.parametrize("tier", ["2", "3", "4"])
def test_a_gpu_tier_without_a_gpu_is_refused(tier):
    message = tiers.refusal(tier, 0, "no NVIDIA driver")
    assert f"tier {tier} ({tiers.TIERS[tier][0]}" in message
    assert "needs a real CUDA GPU" in message and "(no NVIDIA driver)" in message
    assert tiers.refusal(tier, 1, "") is None


@pytest.mark.parametrize("tier", ["1", "soak", "auto"])
def test_tiers_that_run_anywhere_are_not_refused(tier):
    assert tiers.refusal(tier, 0, "no NVIDIA driver") is None


def test_auto_runs_tier_1_and_the_soak_and_the_gpu_tiers_only_with_a_gpu():
    run, skipped = tiers.choose("auto", 0, "no NVIDIA driver")
    assert [m for m, _ in run] == ["cpu", "soak"]
    assert {m for m, _ in skipped} == {"gpu_smoke", "gpu", "multi_gpu", "perf"}
    run, _ = tiers.choose("auto", 1, "")
    assert [m for m, _ in run] == ["cpu", "soak", "gpu_smoke", "gpu"]


def test_only_runs_without_gpu_tests_spread_over_the_cores():
    cpu_only = ["-n", "auto"] if importlib.util.find_spec("xdist") else []
    assert tiers.workers(["cpu", "soak"]) == cpu_only
    assert tiers.workers(["cpu", "soak", "gpu_smoke", "gpu"]) == []
    assert tiers.workers(["perf"]) == []


@pytest.mark.skipif(real_gpu_count() > 0, reason="this machine has a GPU: tier 3 would run")
def test_tier_3_on_this_machine_fails_and_says_why():
    done = subprocess.run([sys.executable, str(REPO / "ci" / "tiers.py"), "--tier", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "[tiers] error: tier 3 (gpu: GPU integration and parity) needs a real CUDA GPU" \
        in done.stderr
    assert "pytest" not in done.stdout
