"""Turns the JSON of the benchmarks (tools/bench_*.py --json) and of the demo
(python -m bitnet_ffi demo --json) into the markdown tables of BENCHMARKS.md and PNG charts.

    python tools/report.py RESULT.json ... [--charts DIR] [--title "H100, 2026-11-22, abc1234"]

Each chart puts ours beside torch's figures of the same run and, for the W2A8 GEMV, beside
Microsoft's (ANCHORS.md); bandwidth is shown as a share of the read bandwidth measured in the run.
"""
import argparse
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def demo_markdown(runs):
    lines = ["Demo (`python -m bitnet_ffi demo --json`): BitNet b1.58 2B4T shapes, "
             f"{runs[0]['layers']} layers, prompt {runs[0]['prompt_len']}, "
             f"{runs[0]['tokens']} tokens; decode timed as {runs[0]['timing']}.", "",
             "| batch | decode ms/step | tokens/s | GB/s | prefill tokens/s | torch bf16 ms/step | "
             "× torch |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        ms, torch_ms = r["decode_ms_per_token"], r.get("torch_ms_per_token")
        torch_cells = "| |" if torch_ms is None else f"| {torch_ms:.3f} | {torch_ms / ms:.2f} |"
        lines.append(f"| {r['batch']} | {ms:.3f} | {r['decode_tokens_per_s']:.0f} | "
                     f"{r['decode_gbps']:.0f} | {r['prefill_tokens_per_s']:.0f} {torch_cells}")
    kinds = list(runs[0]["op_ms"])
    lines += ["", "Per-op time of one decode step (ms; each kind's ops captured and replayed alone):",
              "", "| op | " + " | ".join(f"batch {r['batch']}" for r in runs) + " |",
              "| --- |" + " --- |" * len(runs)]
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(f"{r['op_ms'][kind]:.3f}" for r in runs) + " |")
    return "\n".join(lines)


def bars(path, title, labels, series, ylabel):
    """A grouped bar chart: series is {name: [value per label]} (None: no bar)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels) + 2), 4))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width, label=name)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gemv_chart(result, directory):
    from bench_gemv import ANCHORS
    rows = [r for r in result["rows"] if r.get("N") == 1 and (r["M"], r["K"]) in ANCHORS]
    read = result["read_bandwidth_GBps"]
    labels = [f"{r['M']}×{r['K']}" for r in rows]
    nbytes = [r["M"] * r["K"] / 4 + r["K"] + 4 * r["M"] for r in rows]
    series = {"bitnet-ffi": [r["pct_read_bw"] for r in rows],
              "Microsoft W2A8 (ANCHORS)": [100 * b / ANCHORS[(r["M"], r["K"])][0] / 1e3 / read
                                           for r, b in zip(rows, nbytes)],
              "torch bf16 (same bytes)": [100 * b / r["torch_bf16_us"] / 1e3 / read
                                          if "torch_bf16_us" in r else None
                                          for r, b in zip(rows, nbytes)]}
    return bars(os.path.join(directory, "gemv_w2a8.png"),
                f"W2A8 GEMV, batch 1, L2 cold ({result['device']})", labels, series,
                "% of measured read bandwidth")


def rmsnorm_chart(result, directory):
    rows = result["rows"]
    labels = [f"{r['variant']} H={r['H']} T={r['T']}" for r in rows]
    series = {"bitnet-ffi": [r["ours_pct_read"] for r in rows],
              "torch": [r.get("torch_pct_read") for r in rows]}
    return bars(os.path.join(directory, "rmsnorm.png"), f"RMSNorm, bf16 ({result['device']})",
                labels, series, "% of measured read bandwidth")


def attention_chart(result, directory):
    decode = [r for r in result["results"] if r["kind"] == "decode"]
    labels = [f"B={r['B']} L={r['L']}" for r in decode]
    series = {"bitnet-ffi": [r["pct_read_bw"] for r in decode],
              "torch SDPA": [r["torch_pct_read_bw"] for r in decode]}
    return bars(os.path.join(directory, "attention_decode.png"),
                f"Decode attention, 20/5 heads, d=128 ({result['device']})", labels, series,
                "% of measured read bandwidth (K, V)")


def demo_chart(runs, directory):
    labels = [f"batch {r['batch']}" for r in runs]
    series = {"bitnet-ffi": [r["decode_ms_per_token"] for r in runs],
              "torch bf16": [r.get("torch_ms_per_token") for r in runs]}
    return bars(os.path.join(directory, "demo_decode.png"), "Decode step, BitNet b1.58 2B4T shapes",
                labels, series, "ms per step (lower is better)")


CHARTS = {"gemv": gemv_chart, "rmsnorm": rmsnorm_chart, "attention": attention_chart}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="JSON files from the benchmarks and the demo")
    parser.add_argument("--charts", help="write PNG charts into this folder")
    parser.add_argument("--title", help="a heading for the section (GPU, date, commit)")
    args = parser.parse_args()
    results = [json.load(open(path)) for path in args.results]
    demos = sorted((r for r in results if r["tool"] == "demo"), key=lambda r: r["batch"])
    sections = [f"## {args.title}"] if args.title else []
    charts = []
    for result in results:
        if result["tool"] == "demo":
            continue
        sections.append(importlib.import_module(f"bench_{result['tool']}").markdown(result))
        if args.charts and result["device"] != "cpu":
            charts.append(CHARTS[result["tool"]](result, args.charts))
    if demos:
        sections.append(demo_markdown(demos))
        if args.charts and demos[0]["device"] != "cpu":
            charts.append(demo_chart(demos, args.charts))
    print("\n\n".join(sections))
    if charts:
        print("\nCharts: " + ", ".join(f"![]({path})" for path in charts))


if __name__ == "__main__":
    main()
