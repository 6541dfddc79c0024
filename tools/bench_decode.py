"""Decode ms per step of a random-weight BitNet model with fused decode layers (decode_layer, one
cooperative kernel a layer) against the unfused op sequence, side by side in one process on one
GPU: 2B4T shapes, batch 1, the KV cache filled to each context length by a prefill, the step a
CUDA graph timed by replays (Session.time_decode), the per-op breakdown of each, and whether the
two give the same greedy tokens over --tokens steps from the same prompt.
    python tools/bench_decode.py [--contexts 1024 4096] [--layers 30] [--tokens 32] [--json out]
        [--fused-only | --unfused-only [--batch B]] [--no-qkv-rope] [--no-fused-norms]
        [--no-rope-attention]
A row's "us" is the fused step's µs, or with --unfused-only the op sequence's (for
tools/dev/ab_variants.sh's table). --batch: sequences per step (the fused layer takes one, so more
need --unfused-only). --no-qkv-rope: the op sequence runs the QKV projection and RoPE as two ops
(Session(fuse_qkv_rope=False)), not as gemv_w2a8_rope_append_kv. --no-fused-norms: the op sequence
runs the input norms as ops of their own (Session(fuse_norms=False)), not inside the GEMVs.
--no-rope-attention: where the QKV projection does not take RoPE, RoPE and attention run as two ops
(Session(fuse_rope_attention=False)), not as attention_rope_append_kv.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPLAYS = 20


def main():
    from bitnet_ffi.model import BITNET_2B4T, Config, Session, random_weights
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096])
    parser.add_argument("--layers", type=int, default=BITNET_2B4T.layers)
    parser.add_argument("--tokens", type=int, default=32, help="greedy steps compared")
    parser.add_argument("--device", type=int, default=0)
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--fused-only", action="store_true",
                      help="time the fused step alone (no comparison)")
    only.add_argument("--unfused-only", action="store_true",
                      help="time the op sequence alone (no comparison)")
    parser.add_argument("--no-qkv-rope", action="store_true",
                        help="the QKV projection and RoPE as two ops")
    parser.add_argument("--no-fused-norms", action="store_true",
                        help="the input norms as ops of their own")
    parser.add_argument("--no-rope-attention", action="store_true",
                        help="RoPE and attention as two ops")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    if args.batch != 1 and not args.unfused_only:
        parser.error("--batch other than 1 needs --unfused-only (a fused layer takes one sequence)")
    config = Config(**{**BITNET_2B4T.__dict__, "layers": args.layers})
    weights = random_weights(config, args.device, seed=0)
    paths = (True,) if args.fused_only else (False,) if args.unfused_only else (False, True)
    rows = []
    for context in args.contexts:
        prompt = np.random.default_rng(context).integers(0, config.vocab,
                                                         (args.batch, context - 1))
        row = {"context": context, "layers": args.layers, "batch": args.batch}
        tokens = {}
        for fused in paths:
            name = "fused" if fused else "unfused"
            session = Session(weights, args.batch, context + args.tokens + REPLAYS + 1,
                              args.device, fused=fused, fuse_qkv_rope=not args.no_qkv_rope,
                              fuse_norms=not args.no_fused_norms,
                              fuse_rope_attention=not args.no_rope_attention)
            first = session.prefill(prompt)
            step_ms, op_ms = session.time_decode(REPLAYS)
            tokens[name] = [int(first[0])] + [int(session.decode()[0]) for _ in range(args.tokens)]
            row[name] = {"step_ms": step_ms, "op_ms": op_ms}
            print(f"context {context}, {name}: {step_ms:.3f} ms per step; "
                  + ", ".join(f"{k} {v:.3f}" for k, v in op_ms.items() if v > 0.0005), flush=True)
            del session
        row["us"] = row["unfused" if args.unfused_only else "fused"]["step_ms"] * 1000.0
        if len(paths) == 1:
            rows.append(row)
            continue
        same = next((i for i, (a, b) in enumerate(zip(tokens["fused"], tokens["unfused"]))
                     if a != b), None)
        row["tokens_identical"] = same is None
        row["first_difference"] = same
        row["speedup"] = row["unfused"]["step_ms"] / row["fused"]["step_ms"]
        print(f"context {context}: fused {row['speedup']:.2f}x; greedy tokens "
              + ("identical" if same is None else f"differ from step {same}")
              + f" over {args.tokens + 1}", flush=True)
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"tool": "bench_decode", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
