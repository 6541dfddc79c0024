"""The tools keep working: tools/gpu_sanitize.sh names test functions (one stale name makes pytest
collect nothing, so the sanitizer would check nothing), tools/bench_host.py runs on the CPU,
tools/bench_gemv.py sums the 2B4T projections as ANCHORS.md sums Microsoft's,
tools/kernel_code_diff.py tells a changed kernel from an unchanged one, the CUDA probes build,
tools/dev/decode_timeline.py instruments the decode kernel and reads its stamps, and the A/B table
of tools/report.py (tools/dev/ab_variants.sh) compares variants' rounds."""
import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import plain_run_only

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.cpu
compiles_cuda = plain_run_only("nvcc never loads the library (and under the preload would load ASan)")


def import_tool(name, folder="tools"):
    """A module of tools/ (or tools/dev/), imported as the tools import each other (its folder
    first on the path)."""
    sys.path.insert(0, str(REPO / folder))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(REPO / folder))


def test_every_test_that_gpu_sanitize_runs_exists():
    listing = subprocess.run(["bash", str(REPO / "tools" / "gpu_sanitize.sh"), "--list"],
                             capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    ids = listing.stdout.split()
    assert len(ids) >= 10 and all(re.fullmatch(r"tests/test_\w+\.py::\w+(\[[^\]]*\])?", i) for i in ids), ids
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
    bench_gemv = import_tool("bench_gemv")
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


@compiles_cuda
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
                             timeout=300)
        assert run.returncode == code, run.stdout + run.stderr
        lines = run.stdout.splitlines()
        assert len(lines) == 1 and lines[0].startswith(verdict) and "add_int32_kernel" in lines[0], run.stdout


@compiles_cuda
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="the CUDA probes in tools/ need nvcc")
@pytest.mark.parametrize("probe", ["read_floor.cu", "cluster_fit.cu", "hop_latency.cu", "pdl_hop.cu",
                                   "decode_step_mock.cu"])
def test_cuda_probes_compile(probe, tmp_path):
    """The standalone probes of tools/dev/ that the log cites build with the line in their header (they run
    only on a GPU machine)."""
    run = subprocess.run(["nvcc", "-arch=sm_90", "-Inative/include", "-o", str(tmp_path / "probe"),
                          str(REPO / "tools" / "dev" / probe)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "probe").stat().st_size > 0


@compiles_cuda
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="building the timeline hooks needs nvcc")
def test_decode_timeline_hooks_compile_only_in_the_timeline_build(tmp_path):
    """attention_decode.cu with -DBITNET_TIMELINE (as `decode_timeline.py build` compiles it) has
    the stamps' buffer and the two exports that `run` reads; without the define it has neither.
    The device code is left as PTX: the symbols are the host object's."""
    timeline = import_tool("decode_timeline", "tools/dev")
    assert timeline.RECORD.itemsize == 8 * len(timeline.STAMPS) + 4 * 4 + 8  # TimelineRecord
    symbols = {}
    for name, defines in (("default", []), ("timeline", ["-DBITNET_TIMELINE"])):
        obj = tmp_path / f"{name}.o"
        run = subprocess.run(["nvcc", "-std=c++17", "-O3", "-gencode=arch=compute_90,code=compute_90",
                              "--expt-relaxed-constexpr", "-Inative/include", "-Inative/src",
                              "-Inative/src/cuda", "-DBITNET_HAVE_CUDA", *defines, "-c",
                              "native/src/cuda/attention_decode.cu", "-o", str(obj)],
                             cwd=REPO, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        nm = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
        symbols[name] = {s for s in ("g_timeline", "bitnet_timeline_reset", "bitnet_timeline_read") if s in nm}
    assert symbols == {"default": set(),
                       "timeline": {"g_timeline", "bitnet_timeline_reset", "bitnet_timeline_read"}}


def test_decode_timeline_reads_a_steady_state():
    """Synthetic records of 2 replays of 50 calls, 6000 ns apart, 5 clusters of 16 blocks whose
    stamps sit at known offsets from the previous call's last store; clusters 0 and 1 start before
    it. Shuffled, they come back as those offsets: the earliest start and the latest other stamps."""
    timeline = import_tool("decode_timeline", "tools/dev")
    calls, clusters, blocks, period, base = timeline.CALLS, 5, 16, 6000, 1_700_000_000_000_000_000
    offsets = [None, 700, 2600, 3300, 3900, 4500, 5000, 5450, 5750, period]
    rng = np.random.default_rng(0)
    replays = []
    for replay in range(2):
        records = np.zeros(calls * clusters * blocks, timeline.RECORD)
        for n in range(calls):
            previous_end = base + replay * 10**9 + n * period
            for c in range(clusters):
                for k in range(blocks):
                    r = records[(n * clusters + c) * blocks + k]
                    start = -2400 if c < 2 else 130
                    r["t"] = [previous_end + start + k] + [previous_end + o - (k if i == 9 else 15 - k)
                                                          for i, o in enumerate(offsets) if i > 0]
                    r["by"], r["bx"], r["out"] = c, k, 4096 + 64 * (n % 49)
        if replay == 1:  # a split with one tile stamps no tile 1 or 2
            records["t"][:, 3:5] = 0
        replays.append(records[rng.permutation(len(records))])
    found, periods, early = timeline.timeline(replays, clusters * blocks, clusters)
    assert (periods == period).all() and len(periods) == 2 * (calls - 8)
    assert early.tolist() == [2 * (calls - 7)] * 2 + [0] * 3
    assert found["early"].shape == (2 * 2 * (calls - 7), 10) and found["late"].shape == (2 * 3 * (calls - 7), 10)
    for kind, start in (("early", -2400), ("late", 130)):
        assert found[kind][:, 0].tolist() == [start] * len(found[kind])
        assert np.nanmedian(found[kind][:, 1:], axis=0).tolist() == offsets[1:]
        assert np.isnan(found[kind][:, 3:5]).sum() == len(found[kind])  # replay 1's rows
    table = timeline.markdown(4096, found, periods, early)
    assert "| tile 0 in shared memory | 2600 [2600, 2600] | 2600 [2600, 2600] |" in table, table
    assert "6000 ns between calls" in table and "started early in 86, 86, 0, 0, 0" in table, table


def test_ab_table_compares_rounds_of_variants():
    report = import_tool("report")
    rounds = [("main", [5.95, 35.2]), ("lazy", [6.10, 35.0]), ("main", [6.01, 34.9]), ("lazy", [6.02, 35.4])]
    named = [(name, {"tool": "attention", "results": [
        {"kind": "decode", "B": 1, "L": 4096, "us": us[0]}, {"kind": "decode", "B": 8, "L": 4096, "us": us[1]}]})
        for name, us in rounds]
    assert report.ab_markdown(named).splitlines() == [
        "| variant | B1 L4096 | B8 L4096 |", "| --- | --- | --- |",
        "| main (2 rounds) | 5.95-6.01 | 34.90-35.20 |", "| lazy (2 rounds) | 6.02-6.10 | 35.00-35.40 |"]
    gemv = {"tool": "gemv", "rows": [{"op": "gemv_w2a8", "M": 2560, "K": 6912, "N": 1, "us": 3.25},
                                     {"op": "quantize_a8 f32 [16384, 4096]", "us": 40.0}]}
    assert report.ab_markdown([("main", gemv)]).splitlines()[0] == (
        "| variant | 2560×6912 N1 | quantize_a8 f32 [16384, 4096] |")


def test_bench_attention_decode_cases_option():
    bench = import_tool("bench_attention")
    assert bench.decode_cases("1x4096,8x32768") == [(1, 4096), (8, 32768)]
    for bad in ("", "1x", "4096", "1x2x3", "0x4096", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.decode_cases(bad)


def test_attention_report_has_a_table_per_kind_of_case_that_ran(tmp_path):
    report = import_tool("report")
    head = {"device": "H100", "torch": "2.11", "read_bandwidth_gbps": 3100.0}
    decode = {"kind": "decode", "B": 1, "L": 4096, "us": 5.94, "gbps": 1764.0, "pct_read_bw": 57.0,
              "max_abs_diff_vs_torch": 5e-4}
    prefill = {"kind": "prefill", "L": 4096, "us": 281.7, "tflops": 305.0, "max_abs_diff_vs_torch": 4e-3,
               "torch_us": 189.3, "torch_tflops": 454.0}
    only_decode = report.attention_markdown(dict(head, results=[decode]))
    assert "| 1 | 4096 | 5.94 | 1764 | 57% | - | - | - | 0.0005 |" in only_decode
    assert "prefill" not in only_decode
    only_prefill = report.attention_markdown(dict(head, results=[prefill]))
    assert "| 4096 | 281.7 | 305 | 189.3 | 454 | 0.004 |" in only_prefill
    assert "Decode" not in only_prefill
    assert report.attention_chart(dict(head, results=[prefill]), str(tmp_path)) is None
    assert list(tmp_path.iterdir()) == []
    both = report.attention_markdown(dict(head, results=[decode, prefill])).splitlines()
    assert both.index("| 1 | 4096 | 5.94 | 1764 | 57% | - | - | - | 0.0005 |") < both.index(
        "| 4096 | 281.7 | 305 | 189.3 | 454 | 0.004 |")


def test_demo_report_names_the_prompt_where_runs_differ_and_fills_every_cell():
    report = import_tool("report")

    def run(batch, prompt_len, torch_ms=None):
        r = {"tool": "demo", "layers": 30, "prompt_len": prompt_len, "tokens": 64, "timing": "graphs",
             "batch": batch, "decode_ms_per_token": 0.9, "decode_tokens_per_s": 1111.0, "decode_gbps": 1400.0,
             "prefill_tokens_per_s": 150000.0, "op_ms": {"attention": 0.1}}
        if torch_ms is not None:
            r.update(torch_ms_per_token=torch_ms, torch_prefill_tokens_per_s=80000.0)
        return r

    same = report.demo_markdown([run(1, 960, 4.5), run(8, 960)]).splitlines()
    assert "prompt 960," in same[0]
    assert "| 1 | 0.900 | 1111 | 1400 | 150000 | 80000 | 4.500 | 5.00 |" in same
    assert "| 8 | 0.900 | 1111 | 1400 | 150000 |  | | |" in same
    assert "| op | batch 1 | batch 8 |" in same
    mixed = report.demo_markdown([run(1, 960), run(1, 4096)]).splitlines()
    assert "prompt 960 / 4096," in mixed[0]
    assert "| op | batch 1, prompt 960 | batch 1, prompt 4096 |" in mixed
    header = next(line for line in mixed if line.startswith("| batch |"))
    rows = [line for line in mixed if line.startswith("| 1, prompt")]
    assert len(rows) == 2 and all(row.count("|") == header.count("|") for row in rows)
