"""Where a decode call's time goes on the cluster path: per-block %globaltimer stamps, in the steady
state of back-to-back calls as bench_attention.py times them.

    python tools/dev/decode_timeline.py build             # build-timeline/libbitnet.so (sm_90)
    python tools/dev/decode_timeline.py run 4096 1024     # on the GPU machine, after build

`build` compiles the library with -DBITNET_TIMELINE, which turns on the hooks of
native/src/cuda/timeline.cuh in attention_decode.cu (the default build compiles them to nothing;
the same build serves tools/dev/decode_layer_timeline.py):
thread 0 of every block of the cluster kernels stamps its start, the PDL wait's return, tiles 0,
1, 2 and the last in shared memory (the key loop's barrier), the loop's end, the warps' combine
and pushes, every partial landed in its inbox, and its outputs stored. `run` times B = 1 decode
(bf16, 20/5 heads, d = 128, inputs rotated through 512 MiB) in a CUDA graph of 50 calls with that
library (BITNET_LIB, default build-timeline/libbitnet.so), replays it 5 times with the stamps
recorded, and prints, for the clusters that started before the previous call's last store
("early") and after it ("late"), the median and 10th-90th percentiles of each stamp in ns after
that store. The stamps cost about 0.5 µs per call at L = 4096 (docs/log/2026-11-25.md#2026-11-25-1).
"""
import argparse
import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from gpu_bench import graph_time_us  # noqa: E402

BUILD_DIR = "build-timeline"
CALLS, REPLAYS, CAPACITY = 50, 5, 1 << 16  # CAPACITY: kTimelineCapacity of timeline.cuh
STAMPS = ["block started", "PDL wait returned", "tile 0 in shared memory", "tile 1", "tile 2",
          "last tile", "key loop done", "combined and pushed", "every partial landed",
          "outputs stored"]
# TimelineRecord of native/src/cuda/timeline.cuh
RECORD = np.dtype([("t", "<u8", len(STAMPS)), ("smid", "<u4"), ("bx", "<u4"), ("by", "<u4"),
                   ("slot", "<u4"), ("out", "<u8")])


def calls_of(records, blocks):
    """The records of one graph replay, split into calls ordered by their last store: blocks that
    wrote the same output belong to calls that are far apart, so they split by start time."""
    calls = []
    for out in np.unique(records["out"]):
        same = records[records["out"] == out]
        same = same[np.argsort(same["t"][:, 0])]
        calls += [same[i:i + blocks] for i in range(0, len(same), blocks)]
    return sorted(calls, key=lambda c: c["t"][:, 9].max())


def timeline(replays, blocks, clusters):
    """{"early"/"late": [per stamp: ns after the previous call's last store, one value per (call,
    cluster): the latest block's stamp, or the earliest block's for the start]}, the periods between
    calls' last stores, and how often each cluster started early. The first 5 and last 2 calls of
    a replay are left out (warm-up and drain)."""
    offsets = {"early": [], "late": []}
    periods, early = [], np.zeros(clusters, int)
    for records in replays:
        calls = calls_of(records, blocks)
        ends = [int(c["t"][:, 9].max()) for c in calls]
        periods += list(np.diff(ends)[5:-2])
        for n in range(5, len(calls) - 2):
            for cluster in range(clusters):
                stamps = calls[n][calls[n]["by"] == cluster]["t"]
                t = stamps.astype(np.int64) - ends[n - 1]
                values = [t[:, 0].min()] + [np.nan if (stamps[:, s] == 0).any() else t[:, s].max()
                                            for s in range(1, len(STAMPS))]
                kind = "early" if values[0] < 0 else "late"
                early[cluster] += kind == "early"
                offsets[kind].append(values)
    return {k: np.array(v, float) for k, v in offsets.items() if v}, np.array(periods), early


def cell(values):
    """median [10th, 90th percentile], or '-' where the stamp was not taken (a split's tile 1 or
    2 when it has fewer tiles)."""
    if np.isnan(values).all():
        return "-"
    low, mid, high = np.nanpercentile(values, [10, 50, 90])
    return f"{mid:.0f} [{low:.0f}, {high:.0f}]"


def markdown(L, offsets, periods, early):
    kinds = list(offsets)
    calls = sum(len(offsets[k]) for k in kinds) // len(early)
    lines = [f"L = {L}: {np.median(periods):.0f} ns between calls' last stores (median). Of {calls} "
             f"calls, cluster 0, 1, ... started early in {', '.join(map(str, early))}.", "",
             "| stamp (ns after the previous call's last store) | "
             + " | ".join(f"{k} clusters ({len(offsets[k])})" for k in kinds) + " |",
             "| --- |" + " --- |" * len(kinds)]
    for s, name in enumerate(STAMPS):
        lines.append(f"| {name} | " + " | ".join(cell(offsets[k][:, s]) for k in kinds) + " |")
    return "\n".join(lines)


def run(lengths):
    import torch
    import bitnet_ffi
    from bench_attention import HKV, decode_inputs
    lib = ctypes.CDLL(os.environ["BITNET_LIB"])  # set by main before bitnet_ffi loads it
    buffer, count = np.zeros(CAPACITY, RECORD), ctypes.c_uint(0)
    for L in lengths:
        sets = decode_inputs(1, L)
        n_sets = len(sets)

        def call(i):
            q, k, v, out = sets[i]
            bitnet_ffi.attention(q, k, v, causal=True, out=out)

        print(f"L = {L}: {graph_time_us(call, n_sets, CALLS):.2f} µs per call with the stamps")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(CALLS):
                call(i % n_sets)
        replays = []
        for _ in range(REPLAYS):
            assert lib.bitnet_timeline_reset() == 0
            graph.replay()
            torch.cuda.synchronize()
            assert lib.bitnet_timeline_read(buffer.ctypes.data_as(ctypes.c_void_p), ctypes.byref(count)) == 0
            replays.append(buffer[:count.value].copy())
        blocks = len(replays[0]) // CALLS
        if blocks == 0 or any(len(r) != CALLS * blocks for r in replays):
            raise SystemExit(f"L = {L}: {[len(r) for r in replays]} records for {CALLS} calls: "
                             "this case does not take the cluster path")
        print(markdown(L, *timeline(replays, blocks, HKV)), flush=True)
        del graph, sets
        torch.cuda.empty_cache()


def build():
    """make BUILD_DIR=build-timeline CUDA_ARCHS=90 with -DBITNET_TIMELINE added to the Makefile's
    NVCCFLAGS (through the environment: the Makefile appends its own flags to it)."""
    env = dict(os.environ, NVCCFLAGS="-O3 -DBITNET_TIMELINE")
    subprocess.run(["make", f"BUILD_DIR={BUILD_DIR}", "CUDA_ARCHS=90"], cwd=REPO, env=env, check=True)
    return REPO / BUILD_DIR / "libbitnet.so"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help=f"build {BUILD_DIR}/libbitnet.so with the timeline hooks")
    sub.add_parser("run", help=f"print the timelines (BITNET_LIB: default {BUILD_DIR}/libbitnet.so)").add_argument(
        "lengths", nargs="*", type=int, default=[4096, 1024])
    args = parser.parse_args()
    if args.command == "build":
        print(build())
    else:
        os.environ.setdefault("BITNET_LIB", str(REPO / BUILD_DIR / "libbitnet.so"))
        run(args.lengths)


if __name__ == "__main__":
    main()
