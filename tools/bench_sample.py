"""Benchmark: bitnet_ffi.sample on the GPU beside torch's sampling (softmax, topk, multinomial) and
argmax, for one and eight rows of a 128256-token vocabulary (Llama 3's, 2B4T's), float32 logits,
L2 cold (input sets rotated over 512 MiB), median of CUDA-graph replays of 20 calls.

    python tools/bench_sample.py [--json results.json]
"""
import argparse
import json
import math

import bitnet_ffi
from gpu_bench import graph_time_us

V = 128256
ROTATE_BYTES = 512 << 20
MODES = [("greedy", 0.0, 0, 1.0), ("full", 1.0, 0, 1.0), ("top-k 40", 0.8, 40, 1.0),
         ("top-k 40, top-p 0.95", 0.8, 40, 0.95), ("top-p 0.9", 0.8, 0, 0.9)]


def bench(N, name, temperature, top_k, top_p):
    import torch
    sets = max(1, math.ceil(ROTATE_BYTES / (N * V * 4)))
    logits = [torch.randn(N, V, device="cuda") * 3 for _ in range(sets)]
    counters = torch.arange(N, dtype=torch.int32, device="cuda")
    out = torch.empty(N, dtype=torch.int32, device="cuda")

    def ours(i):
        bitnet_ffi.sample(logits[i], 7, counters, temperature, top_k, top_p, out=out)

    def theirs(i):  # torch's usual sampling step, top-k (or all) then multinomial
        x = logits[i]
        if temperature == 0:
            return x.argmax(-1)
        values, indices = x.topk(top_k, dim=-1) if top_k else (x, None)
        p = torch.softmax(values / temperature, dim=-1)
        drawn = torch.multinomial(p, 1)
        return indices.gather(-1, drawn) if indices is not None else drawn

    result = dict(kind="sample", N=N, V=V, mode=name, us=graph_time_us(ours, sets, 20))
    try:
        result["torch_us"] = graph_time_us(theirs, sets, 20)
    except RuntimeError as error:  # a torch op that cannot be captured: no figure
        result["torch_error"] = str(error).splitlines()[0]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    import torch
    results = [bench(N, *mode) for N in (1, 8) for mode in MODES]
    print(f"Sampling on {torch.cuda.get_device_name()}, V = {V}, float32 logits, L2 cold\n")
    print("| rows | mode | bitnet µs | torch µs (topk, softmax, multinomial) |\n| --- | --- | --- | --- |")
    for r in results:
        torch_cell = f"{r['torch_us']:.1f}" if "torch_us" in r else r["torch_error"]
        print(f"| {r['N']} | {r['mode']} | {r['us']:.1f} | {torch_cell} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(tool="sample", device=torch.cuda.get_device_name(), results=results), f, indent=2)


if __name__ == "__main__":
    main()
