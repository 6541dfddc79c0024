"""The performance targets of the issues (tools/report.py, TARGETS), checked on the run that
BENCHMARKS.md shows (tier 1) and measured afresh on this machine's GPU (tier 4: an H100, since the
targets are H100 figures; the benchmarks and the demo run as tools/gpu_run.sh runs them; with
BITNET_RESULTS_DIR set, their JSONs are kept there: the makings of a docs/results/ run)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import report  # noqa: E402  (tools/report.py)


def committed_run():
    """The newest run under docs/results/ (the one BENCHMARKS.md is generated from)."""
    runs = sorted((REPO / "docs" / "results").glob("*.json"))
    assert runs, "no run under docs/results/"
    return json.loads(runs[-1].read_text())


@pytest.mark.cpu
def test_the_committed_run_meets_every_target():
    run = committed_run()
    assert {r["tool"] for r in run["results"]} == {"gemv", "gemm", "rmsnorm", "attention", "demo"}
    measured = [measure(run["results"]) for _, _, measure, *_ in report.TARGETS]
    assert len(measured) == len(report.TARGETS) >= 20
    assert report.unmet_targets(run["results"]) == []


@pytest.mark.cpu
def test_the_results_page_is_generated_from_the_committed_run():
    """BENCHMARKS.md is report.py's page of that run, as committed, and README.md quotes its
    headline figures: after a new run, regenerate the page (python tools/report.py --page
    docs/results/<run>.json > BENCHMARKS.md) and copy the headlines into README.md."""
    runs = sorted((REPO / "docs" / "results").glob("*.json"))
    page = report.page_markdown(runs[-1].relative_to(REPO).as_posix(), draw=False)
    assert page == (REPO / "BENCHMARKS.md").read_text()
    readme = (REPO / "README.md").read_text()
    headlines = report.headline_markdown(committed_run()["results"]).splitlines()
    assert len(headlines) == 3 and all(line in readme for line in headlines), headlines


@pytest.mark.perf
def test_this_gpu_meets_every_target(cuda, tmp_path):
    torch = pytest.importorskip("torch")
    name = torch.cuda.get_device_name(cuda)
    if "H100" not in name:
        pytest.skip(f"the targets are H100 figures; this GPU is {name}")
    keep = Path(os.environ.get("BITNET_RESULTS_DIR", tmp_path))  # where the run's JSONs stay
    keep.mkdir(parents=True, exist_ok=True)
    results = []
    for tool, options in (("gemv", []), ("gemm", ["--tokens", "16,64,960,4096"]), ("rmsnorm", []),
                          ("attention", [])):
        path = keep / f"bench_{tool}.json"
        subprocess.run([sys.executable, str(REPO / "tools" / f"bench_{tool}.py"), *options, "--json",
                        str(path)], cwd=REPO, check=True, capture_output=True, timeout=600)
        results.append(json.loads(path.read_text()))
    for batch in (1, 8):
        demo = subprocess.run([sys.executable, "-m", "bitnet_ffi", "demo", "--json", "--batch", str(batch)],
                              cwd=REPO, check=True, capture_output=True, text=True, timeout=600)
        results.append(json.loads(demo.stdout))
        (keep / f"demo_b{batch}.json").write_text(demo.stdout)
    assert report.unmet_targets(results) == []
