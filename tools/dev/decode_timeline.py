"""Where a decode call's time goes on the cluster path: per-block %globaltimer stamps, in the steady
state of back-to-back calls as bench_attention.py times them.

    python tools/dev/decode_timeline.py instrument timeline.cu
    tools/dev/ab_variants.sh native/src/cuda/attention_decode.cu 0 timeline.cu   # builds it
    BITNET_LIB=/tmp/ab/timeline/build/libbitnet.so python tools/dev/decode_timeline.py run 4096 1024

`instrument` writes a copy of native/src/cuda/attention_decode.cu in which thread 0 of every block
of the cluster kernels stamps: its start, the PDL wait's return, tiles 0, 1, 2 and the last in
shared memory (the key loop's barrier), the loop's end, the warps' combine and pushes, every
partial landed in its inbox, and its outputs stored. `run` times B = 1 decode (bf16, 20/5 heads,
d = 128, inputs rotated through 512 MiB) in a CUDA graph of 50 calls, replays it 5 times with the
stamps recorded, and prints, for the clusters that started before the previous call's last store
("early") and after it ("late"), the median and 10th-90th percentiles of each stamp in ns after
that store. The stamps cost about 0.5 µs per call at L = 4096 (H100, 2026-11-25).
"""
import argparse
import ctypes
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from gpu_bench import graph_time_us  # noqa: E402
SOURCE = REPO / "native" / "src" / "cuda" / "attention_decode.cu"
CALLS, REPLAYS, CAPACITY = 50, 5, 1 << 16
STAMPS = ["block started", "PDL wait returned", "tile 0 in shared memory", "tile 1", "tile 2",
          "last tile", "key loop done", "combined and pushed", "every partial landed",
          "outputs stored"]
RECORD = np.dtype([("t", "<u8", len(STAMPS)), ("smid", "<u4"), ("bx", "<u4"), ("by", "<u4"),
                   ("slot", "<u4"), ("out", "<u8")])

PROBE = """
/* decode_timeline.py: thread 0's stamps per block, one record per block in launch order. */
struct TimelineRecord {
    unsigned long long t[%d];
    unsigned smid, bx, by, slot;
    unsigned long long out;
};
constexpr unsigned kTimelineCapacity = %du;
__device__ TimelineRecord g_timeline[kTimelineCapacity];
__device__ unsigned g_timeline_count;
__device__ __forceinline__ unsigned long long timeline_now() {
    unsigned long long t;
    asm volatile("mov.u64 %%0, %%%%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned timeline_smid() {
    unsigned s;
    asm volatile("mov.u32 %%0, %%%%smid;" : "=r"(s));
    return s;
}
""" % (len(STAMPS), CAPACITY)

EXPORTS = """
extern "C" int bitnet_timeline_reset(void) {
    unsigned zero = 0;
    return (int)cudaMemcpyToSymbol(g_timeline_count, &zero, sizeof zero);
}
extern "C" int bitnet_timeline_read(void *records, unsigned *count) {
    cudaError_t status = cudaMemcpyFromSymbol(count, g_timeline_count, sizeof *count);
    if (status == cudaSuccess) status = cudaMemcpyFromSymbol(records, g_timeline, sizeof g_timeline);
    return (int)status;
}
"""

# (what, text of attention_decode.cu, its replacement); each text must occur exactly once.
EDITS = [
    ("the probe's globals", "namespace cg = cooperative_groups;\n",
     "namespace cg = cooperative_groups;\n" + PROBE),
    ("finish_owned's parameters", "OutRow out_row, T *__restrict__ out) {\n",
     "OutRow out_row, T *__restrict__ out, TimelineRecord *record) {\n"),
    ("finish_owned's wait for the pushes",
     '" selp.u32 %0, 1, 0, p; }" : "=r"(landed) : "r"(shared_addr(&inbox.landed)) : "memory");\n',
     '" selp.u32 %0, 1, 0, p; }" : "=r"(landed) : "r"(shared_addr(&inbox.landed)) : "memory");\n'
     "    if (record && threadIdx.x == 0) record->t[8] = timeline_now();\n"),
    ("finish_owned's stores", "        store4(out + out_row(r) * D + d, acc, l_tot);\n    }\n",
     "        store4(out + out_row(r) * D + d, acc, l_tot);\n    }\n"
     "    if (record && threadIdx.x == 0) record->t[9] = timeline_now();\n"),
    ("the kernel's start", "    constexpr bool kLazy = CLUSTER && STAGES == kLazyRescaleStages;\n",
     "    constexpr bool kLazy = CLUSTER && STAGES == kLazyRescaleStages;\n"
     "    unsigned long long stamp[8] = {};\n    unsigned slot = 0;\n"
     "    if (CLUSTER && threadIdx.x == 0) {\n        stamp[0] = timeline_now();\n"
     "        slot = atomicAdd(&g_timeline_count, 1u) % kTimelineCapacity;\n    }\n"),
    ("the PDL wait", "    bn_pdl_wait(); /* q, the cache and seq_lens may come from the previous kernel */\n",
     "    bn_pdl_wait(); /* q, the cache and seq_lens may come from the previous kernel */\n"
     "    stamp[1] = timeline_now();\n"),
    ("the key loop's first use of a tile", "        if (i == 0) {\n#pragma unroll\n",
     "        {\n            const unsigned long long now = timeline_now();\n"
     "            if (i == 0) stamp[2] = now;\n"
     "            if (i == 1) stamp[3] = now;\n"
     "            if (i == 2) stamp[4] = now;\n"
     "            if (i == tile_count - 1) stamp[5] = now;\n        }\n"
     "        if (i == 0) {\n#pragma unroll\n"),
    ("the key loop's end",
     "    __syncthreads(); /* every warp is done with the tiles before they hold partial results */\n",
     "    __syncthreads(); /* every warp is done with the tiles before they hold partial results */\n"
     "    stamp[6] = timeline_now();\n"),
    ("the finishing step's call",
     "    if constexpr (CLUSTER) finish_owned(sm.inbox, split, splits, rows, out_row, out);",
     "    TimelineRecord *record = nullptr;\n"
     "    if (CLUSTER && threadIdx.x == 0) {\n        stamp[7] = timeline_now();\n"
     "        record = &g_timeline[slot];\n"
     "#pragma unroll\n        for (int s = 0; s < 8; s++) record->t[s] = stamp[s];\n"
     "        record->smid = timeline_smid(), record->bx = blockIdx.x, record->by = blockIdx.y;\n"
     "        record->slot = slot, record->out = (unsigned long long)out;\n    }\n"
     "    if constexpr (CLUSTER) finish_owned(sm.inbox, split, splits, rows, out_row, out, record);"),
]


def instrument(text):
    """The stamped copy of attention_decode.cu's text; SystemExit naming every place not found."""
    missing = [what for what, old, _ in EDITS if text.count(old) != 1]
    if missing:
        raise SystemExit("decode_timeline.py: attention_decode.cu changed; update EDITS for: "
                         + ", ".join(missing))
    for _, old, new in EDITS:
        text = text.replace(old, new)
    return text + EXPORTS


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
    lib = ctypes.CDLL(os.environ["BITNET_LIB"])
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("instrument", help="write the stamped copy of attention_decode.cu").add_argument("path")
    sub.add_parser("run", help="print the timelines (BITNET_LIB: a build of the copy)").add_argument(
        "lengths", nargs="*", type=int, default=[4096, 1024])
    args = parser.parse_args()
    if args.command == "instrument":
        path = Path(args.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(instrument(SOURCE.read_text()))
    else:
        run(args.lengths)


if __name__ == "__main__":
    main()
