"""Benchmark of gemv_w2a8 at many tokens (the tensor-core GEMM from N = 17 on, from 9 for large
matrices on sm_90: docs/gemm.md) beside torch bf16 F.linear and torch._int_mm (int8 x int8 -> int32),
one process, one GPU.

Every figure is the median of 7 replays of a CUDA graph; each path rotates through copies of its
weights totalling >= 512 MiB (> 4x the 50 MiB L2), so no call finds its weights in L2. Ours writes
bfloat16 like F.linear. TOP/s = 2 * N * M * K / time.
  python tools/bench_gemm.py [--shapes 2560x2560,...] [--tokens 16,32,...] [--no-torch] [--json PATH]
"""
import argparse
import json
import math

import bitnet_ffi as bn
from gpu_bench import graph_time_us
from report import emit

ROTATE_BYTES = 512 << 20
SHAPES = [(2560, 2560), (3840, 2560), (13824, 2560), (2560, 6912), (5120, 27648), (55296, 5120)]
TOKENS = [16, 32, 64, 128, 256, 960, 4096, 16384]


def calls_for(copies, ops):
    """Calls per graph: every copy once, and at least ~2 ms of work (20 calls at most)."""
    return max(copies, min(20, math.ceil(2e-3 / (ops / 1e15))))


def time_rotating(torch, make_weight, bytes_per_copy, call, ops):
    copies = max(1, math.ceil(ROTATE_BYTES / bytes_per_copy))
    weights = [make_weight() for _ in range(copies)]
    us = graph_time_us(lambda i: call(weights[i]), copies, calls_for(copies, ops))
    del weights
    torch.cuda.empty_cache()
    return us


def bench_shape(torch, M, K, N, with_torch):
    ops = 2 * N * M * K

    def packed_weight():
        codes = torch.randint(0, 3, (4, M, K // 4), dtype=torch.uint8, device="cuda")
        return bn.TernaryWeights(codes[0] | codes[1] << 2 | codes[2] << 4 | codes[3] << 6,
                                 torch.rand(M, device="cuda") + 0.5)

    x_q = torch.randint(-128, 128, (N, K), dtype=torch.int8, device="cuda")
    x_s = torch.rand(N, device="cuda") + 1.0
    y = torch.empty((N, M), dtype=torch.bfloat16, device="cuda")
    us = time_rotating(torch, packed_weight, M * K // 4,
                       lambda w: bn.gemv_w2a8(w, x_q, x_s, out_dtype="bfloat16", out=y), ops)
    row = {"M": M, "K": K, "N": N, "us": us, "TOPs": ops / us / 1e6}
    if with_torch:
        x = torch.randn(N, K, dtype=torch.bfloat16, device="cuda")
        bf16_us = time_rotating(torch, lambda: torch.randn(M, K, dtype=torch.bfloat16, device="cuda"),
                                2 * M * K, lambda w: torch.nn.functional.linear(x, w), ops)
        row.update(torch_bf16_us=bf16_us, torch_bf16_TOPs=ops / bf16_us / 1e6, vs_bf16=bf16_us / us)
        if N > 16:  # torch._int_mm needs more than 16 rows
            int_w = lambda: torch.randint(-1, 2, (M, K), dtype=torch.int8, device="cuda").t()
            int_us = time_rotating(torch, int_w, M * K, lambda w: torch._int_mm(x_q, w), ops)
            row.update(torch_int_mm_us=int_us, torch_int_mm_TOPs=ops / int_us / 1e6, vs_int_mm=int_us / us)
    del x_q, y
    torch.cuda.empty_cache()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", help="comma-separated MxK (default: the six of the issue)")
    parser.add_argument("--tokens", help="comma-separated N (default: 16 ... 16384)")
    parser.add_argument("--no-torch", action="store_true", help="ours only")
    parser.add_argument("--json", help="write the results to this path")
    args = parser.parse_args()
    import torch
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    tokens = [int(n) for n in args.tokens.split(",")] if args.tokens else TOKENS
    rows = []
    for M, K in shapes:
        for N in tokens:
            rows.append(bench_shape(torch, M, K, N, not args.no_torch))
            print(json.dumps(rows[-1]), flush=True)
    emit({"tool": "gemm", "device": torch.cuda.get_device_name(), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
