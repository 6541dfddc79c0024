"""All-reduce latency of decode's small messages inside a CUDA graph, on every GPU of the machine
(one process each): the library's one-shot peer all-reduce against NCCL's, in one run.

Method: per size, a graph of CALLS back-to-back all-reduces (each rank replays its own graph at the
same time; a call cannot finish before every rank has arrived) is replayed after a warm-up, three
runs of REPLAYS replays timed with events; the figure is the median run per call, the slowest rank.
Sizes are bytes of the message (bfloat16 elements, as the model's sums after rounding; the model's
own all-reduce reads float32 partials, the "f32->bf16" row). No L2 flush: decode's messages are
L2-resident too.

    python tools/bench_allreduce.py [--gpus N] [--json out.json]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES_KB = (5, 8, 16, 32, 64, 128)
CALLS, REPLAYS = 50, 10


ROWS = (("peer bf16", "peer", "bfloat16", "bfloat16", False),
        ("peer f32->bf16", "peer", "float32", "bfloat16", False),
        ("peer all-gather bf16", "peer", "bfloat16", "bfloat16", True),
        ("nccl bf16", "nccl", "bfloat16", "bfloat16", False),
        ("nccl all-gather bf16", "nccl", "bfloat16", "bfloat16", True))


def _rank(ctx, methods):
    from bitnet_ffi import DeviceArray, Graph, Stream, comm
    group = comm.Group(ctx)
    stream = Stream(ctx.device)
    rows = {}
    for label, method, x_dtype, y_dtype, gather in ROWS:
        if method not in methods:
            continue
        group.method = method
        rows[label] = {}
        for kb in SIZES_KB:
            n = kb * 1024 // 2
            if gather:
                x = DeviceArray((n // ctx.world,), x_dtype, ctx.device)
                y = DeviceArray((n // ctx.world * ctx.world,), y_dtype, ctx.device)
            else:
                x, y = DeviceArray((n,), x_dtype, ctx.device), DeviceArray((n,), y_dtype, ctx.device)
            _ffi_zero(x), _ffi_zero(y)
            op = group.all_gather if gather else group.all_reduce
            op(x, y, stream=stream)  # warm-up outside the graph
            with Graph.capture(stream) as graph:
                for _ in range(CALLS):
                    op(x, y, stream=stream)
            rows[label][kb] = 1e3 * graph.time_ms(REPLAYS) / CALLS
            stream.synchronize()
            del graph  # destroyed now, not during the next capture (which that would invalidate)
            ctx.check()
        if ctx.rank == 0:  # as it goes, in case a later row does not finish
            print(f"rank 0, {label}: " + ", ".join(f"{kb} KB {us:.2f} us"
                                                   for kb, us in rows[label].items()), flush=True)
    group.close()
    return rows


def _ffi_zero(array):
    from bitnet_ffi import _ffi
    _ffi.call("memset", _ffi.ffi.cast("void *", array.ptr), 0, array.nbytes, _ffi.ffi.NULL)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, help="ranks (default: every GPU)")
    parser.add_argument("--methods", nargs="+", default=["peer", "nccl"], choices=["peer", "nccl"])
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    from bitnet_ffi import _ffi, nccl
    from bitnet_ffi.launcher import run_ranks
    count = _ffi.ffi.new("int32_t *")
    _ffi.call("device_count", count, _ffi.ffi.NULL)
    world = args.gpus or count[0]
    ranks = run_ranks(_rank, world, args=(args.methods,), timeout=600)
    table = {label: {kb: max(r[label][kb] for r in ranks) for kb in SIZES_KB} for label in ranks[0]}
    result = {"tool": "bench_allreduce", "gpus": world, "nccl_version": nccl.version(),
              "calls_per_graph": CALLS, "us": table}
    print(f"all-reduce in a CUDA graph, {world} GPUs, us per call (slowest rank), NCCL "
          f"{result['nccl_version']}")
    print("| method | " + " | ".join(f"{kb} KB" for kb in SIZES_KB) + " |")
    print("| --- |" + " --- |" * len(SIZES_KB))
    for label, row in table.items():
        print(f"| {label} | " + " | ".join(f"{row[kb]:.2f}" for kb in SIZES_KB) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
