"""The tools keep working: tools/gpu_sanitize.sh names test functions (one stale name makes pytest
collect nothing, so the sanitizer would check nothing), tools/bench_host.py runs on the CPU,
tools/bench_gemv.py sums the 2B4T projections as ANCHORS.md sums Microsoft's, and
tools/kernel_code_diff.py tells a changed kernel from an unchanged one, and the CUDA probes build."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.cpu


def without_sanitizers():
    """The environment for nvcc, which never loads the library and is not built for the sanitizers
    that make asan-test preloads."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def test_every_test_that_gpu_sanitize_runs_exists():
    script = (REPO / "tools" / "gpu_sanitize.sh").read_text()
    ids = re.findall(r"tests/test_\w+\.py::\w+(?:\[[^\]]*\])?", script)
    assert len(ids) >= 10, ids
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
        cwd=REPO, capture_output=True, text=True)
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    listed = set(collected.stdout.split())
    missing = [test_id for test_id in ids
               if test_id not in listed and not any(item.startswith(test_id + "[") for item in listed)]
    assert not missing, missing


def test_bench_host_compares_with_a_baseline_package_on_the_cpu():
    """One round, this checkout as its own baseline: both columns are filled for every op."""
    run = subprocess.run([sys.executable, str(REPO / "tools" / "bench_host.py"), "--device", "cpu",
                          "--rounds", "1", "--baseline", str(REPO)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| call", "| ---"))]
    assert [row.split(" | ")[0] for row in rows] == [
        "| gemv_w2a8 16x128, 1 token, out given", "| quantize_a8 [1, 128], outputs allocated",
        "| rmsnorm [1, 128], out given"], run.stdout
    for row in rows:
        cells = [cell.strip() for cell in row.strip("| ").split("|")][1:]
        assert len(cells) == 2 and all(re.fullmatch(r"\d+\.\d \(\d+\.\d\)", c) for c in cells), row


def test_bench_gemv_sums_the_2b4t_projections_timed_alone():
    """ANCHORS.md's 30.3 µs for Microsoft is its four batch-1 cold times added up; the benchmark
    adds ours the same way, from the same run's rows, and only when all four are there."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import bench_gemv
    finally:
        sys.path.remove(str(REPO / "tools"))
    times = [2.25, 1.75, 4.5, 3.25]
    rows = [{"op": "gemv_w2a8", "M": M, "K": K, "N": 1, "us": us}
            for (M, K), us in zip(bench_gemv.PROJECTIONS_2B4T, times)]
    rows.append({"op": "gemv_w2a8", "M": 2560, "K": 2560, "N": 8, "us": 100.0})  # batch 8: not summed
    summed = bench_gemv.sum_2b4t_alone(rows, read_gbps=2000.0)
    assert summed["us"] == sum(times) == 11.75
    layer_bytes = sum(M * K // 4 for M, K in bench_gemv.PROJECTIONS_2B4T)
    assert summed["pct_read_bw"] == pytest.approx(100 * layer_bytes / 11.75e3 / 2000.0)
    assert summed["speedup_vs_microsoft"] == pytest.approx(30.3 / 11.75)
    assert bench_gemv.sum_2b4t_alone(rows[1:], read_gbps=2000.0) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="tools/kernel_code_diff.py needs nvcc")
def test_kernel_code_diff_tells_a_changed_kernel_from_an_unchanged_one(tmp_path):
    """The committed add_int32.cu against a copy of itself, then against a copy that subtracts."""
    source = REPO / "native" / "src" / "cuda" / "add_int32.cu"
    text = source.read_text()
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(source)], cwd=REPO).returncode != 0:
        pytest.skip("add_int32.cu has uncommitted changes")
    changed = text.replace("(uint32_t)x[i] + (uint32_t)delta", "(uint32_t)x[i] - (uint32_t)delta")
    assert changed != text
    for name, body, code, verdict in [("same.cu", text, 0, "same"), ("changed.cu", changed, 1, "differs")]:
        (tmp_path / name).write_text(body)
        run = subprocess.run([sys.executable, str(REPO / "tools" / "kernel_code_diff.py"), str(source),
                              "--with", str(tmp_path / name)], cwd=REPO, capture_output=True, text=True,
                             timeout=300, env=without_sanitizers())
        assert run.returncode == code, run.stdout + run.stderr
        lines = run.stdout.splitlines()
        assert len(lines) == 1 and lines[0].startswith(verdict) and "add_int32_kernel" in lines[0], run.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="the CUDA probes in tools/ need nvcc")
@pytest.mark.parametrize("probe", ["read_floor.cu", "cluster_fit.cu"])
def test_cuda_probes_compile(probe, tmp_path):
    """The standalone probes that BENCHMARKS.md cites build with the line in their header (they run
    only on a GPU machine)."""
    run = subprocess.run(["nvcc", "-arch=sm_90", "-o", str(tmp_path / "probe"), str(REPO / "tools" / probe)],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=without_sanitizers())
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "probe").stat().st_size > 0
