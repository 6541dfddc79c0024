"""Tensor-parallel decode ms/token and prefill tokens/s of random-weight BitNet models at TP = 1, 2,
4 (as many as the machine has GPUs), for the 2B4T, Falcon3-10B and 70B shapes, through `python -m
bitnet_ffi tp`'s code (bitnet_ffi/tp_demo.py): batch 1, a 16-token prompt (--prompt-len) and 8
tokens. The decode step is a CUDA graph per rank, timed by replays (median of 3 runs of 20, each
from the same position: TPSession.time_decode); the prompt's prefill (passes of up to 256 tokens,
TPSession.prefill) is timed again by the host clock; both the slowest rank's. One process set per
TP size runs every shape in turn. A shape that a TP size cannot split is reported with the reason.
    python tools/bench_tp.py [--shapes 2b4t 70b] [--tp 1 2 4] [--method peer] [--exact]
        [--prompt-len N] [--json out.json]
--exact times the exact layout (tensor_parallel.exact_split) instead of the split one.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    from bitnet_ffi import _ffi, tensor_parallel, tp_demo
    from bitnet_ffi.errors import BitNetError
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(tp_demo.SHAPES),
                        choices=list(tp_demo.SHAPES))
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--method", choices=("peer", "nccl"), default="peer")
    parser.add_argument("--exact", action="store_true", help="the exact layout")
    parser.add_argument("--layers", type=int, help="override every shape's layer count")
    parser.add_argument("--prompt-len", type=int, default=16,
                        help="prompt tokens, prefilled in passes of up to 256 (default 16)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    count = _ffi.ffi.new("int32_t *")
    _ffi.call("device_count", count, _ffi.ffi.NULL)
    configs = {shape: tp_demo.SHAPES[shape] for shape in args.shapes}
    if args.layers:
        configs = {shape: tp_demo.Config(**{**c.__dict__, "layers": args.layers})
                   for shape, c in configs.items()}
    rows = {}
    for tp in [t for t in args.tp if t <= count[0]]:
        shapes = []
        for shape in args.shapes:
            rows[shape, tp] = {"shape": shape, "layers": configs[shape].layers, "tp": tp,
                               "method": args.method, "exact": args.exact}
            try:
                (tensor_parallel.exact_split if args.exact else tensor_parallel.split)(
                    configs[shape], tp)
                shapes.append(shape)
            except BitNetError as exc:
                rows[shape, tp]["error"] = str(exc)[:300]
        try:  # one process set per TP size, running every shape in turn
            for shape, result in zip(shapes, tp_demo.run_configs([configs[s] for s in shapes], tp,
                                                                 args.prompt_len,
                                                                 method=args.method,
                                                                 exact=args.exact)):
                rows[shape, tp].update(result)
        except BitNetError as exc:
            for shape in shapes:
                rows[shape, tp]["error"] = str(exc).splitlines()[0][:300]
    results = []
    for shape in args.shapes:
        base = rows.get((shape, 1), {}).get("ms_per_token")
        for tp in [t for t in args.tp if (shape, t) in rows]:
            row = rows[shape, tp]
            if "ms_per_token" in row and base:
                row["speedup"] = base / row["ms_per_token"]
            results.append(row)
            speed = f", {row['speedup']:.2f}x TP=1" if row.get("speedup") else ""
            print(f"{shape:12s} TP={tp}: " + (f"{row['ms_per_token']:.3f} ms/token{speed}, "
                                              f"prefill {row['prefill_tokens_per_s']:.0f} "
                                              f"tokens/s, tokens {row['tokens'][:4]}"
                                              if "ms_per_token" in row else row["error"]),
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"tool": "bench_tp", "results": results}, indent=2))


if __name__ == "__main__":
    main()
