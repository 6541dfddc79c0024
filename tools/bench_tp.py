"""Tensor-parallel decode ms/token of random-weight BitNet models at TP = 1, 2, 4 (as many as the
machine has GPUs), for the 2B4T, Falcon3-10B and 70B shapes, through `python -m bitnet_ffi tp`'s
code (bitnet_ffi/tp_demo.py): batch 1, a 16-token prompt, the decode step a CUDA graph per rank,
timed by replays (median of 3 runs of 20), the slowest rank. A shape that a TP size cannot run
(head dim 256 attention, say) is reported with the reason.

    python tools/bench_tp.py [--shapes 2b4t 70b] [--tp 1 2 4] [--method peer] [--json out.json]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    from bitnet_ffi import _ffi, tp_demo
    from bitnet_ffi.errors import BitNetError
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(tp_demo.SHAPES),
                        choices=list(tp_demo.SHAPES))
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--method", choices=("peer", "nccl"), default="peer")
    parser.add_argument("--layers", type=int, help="override every shape's layer count")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    count = _ffi.ffi.new("int32_t *")
    _ffi.call("device_count", count, _ffi.ffi.NULL)
    results = []
    for shape in args.shapes:
        config = tp_demo.SHAPES[shape]
        if args.layers:
            config = tp_demo.Config(**{**config.__dict__, "layers": args.layers})
        base = None
        for tp in [t for t in args.tp if t <= count[0]]:
            row = {"shape": shape, "layers": config.layers, "tp": tp, "method": args.method}
            try:
                row.update(tp_demo.run(config, tp, method=args.method))
            except BitNetError as exc:
                row["error"] = str(exc).splitlines()[0][:300]
            if "ms_per_token" in row:
                base = base or (row["ms_per_token"] if tp == 1 else None)
                row["speedup"] = base / row["ms_per_token"] if base else None
            results.append(row)
            speed = f", {row['speedup']:.2f}x TP=1" if row.get("speedup") else ""
            print(f"{shape:12s} TP={tp}: " + (f"{row['ms_per_token']:.3f} ms/token{speed}, "
                                              f"tokens {row['tokens'][:4]}"
                                              if "ms_per_token" in row else row["error"]),
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"tool": "bench_tp", "results": results}, indent=2))


if __name__ == "__main__":
    main()
