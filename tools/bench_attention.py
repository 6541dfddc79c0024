"""Benchmark: bitnet_ffi.attention against torch SDPA (enable_gqa=True) on the same GPU, one process.

Decode: bf16, 20 query heads, 5 KV heads, head_dim 128, one new token per sequence over a full cache;
GB/s counts the K and V bytes read (2 * B * L * Hkv * D * 2), and % is of the read bandwidth measured
in the same run (torch.sum over 2 GiB). Prefill: causal self-attention over L tokens, 20 heads,
TFLOP/s from 2 * L^2 * D * H causal FLOPs. Every figure is the median over 7 replays of a CUDA graph
of `--calls` calls (100, as ../shared/ANCHORS.md measures torch; prefill fewer, see run_gpu), rotating
through input sets totalling >= 512 MiB so L2 (50 MiB) is cold. torch's calls are SDPA alone: its
output is a fresh tensor of the graph's pool, and copying it into a fixed one would time a second
kernel.

    python tools/bench_attention.py [--json results.json] [--quick]

--heads 12/4/256 sets the heads and head_dim (Falcon3-10B's, D = 256) for every GPU case.

For A/B runs of kernel variants (tools/dev/ab_variants.sh): --no-torch times our calls alone (torch SDPA
still checks the first call's output), --decode-cases picks the decode cases, e.g. 1x4096,8x4096,
and --prefill-cases the prefill lengths, e.g. 960,4096.

CPU (--cpu): the same heads, causal, bf16 and float32, on every CPU SIMD path this machine runs,
side by side with a float32 numpy implementation (einsum, softmax); GB/s counts the K and V bytes
(each row once), against a numpy sum over 1 GiB measured in the same run, and GFLOP/s counts
4 * Hq * D per (query, seen key). Median of 3 calls.

    python tools/bench_attention.py --cpu [--json results.json]
"""
import argparse
import math

import numpy as np

import bitnet_ffi
from cpu_bench import available_isas, memory_bandwidths, time_s
from gpu_bench import graph_time_us, read_bandwidth_gbps
from report import emit

HQ, HKV, D = 20, 5, 128
ROTATE_BYTES = 512 << 20
DECODE_CASES = [(1, 1024), (1, 4096), (1, 32768), (8, 4096), (8, 32768), (1, 131072)]
PREFILL_CASES = [1024, 4096, 16384]


def decode_kv_bytes(B, L):
    """The bf16 K and V bytes that a decode call over a full cache of L reads."""
    return 2 * B * L * HKV * D * 2


def random_sets(B, Sq, L, n_sets):
    """n_sets sets of (q, k, v, out), bf16 on the GPU in our layout: Sq queries and L keys."""
    import torch
    sets = []
    for _ in range(n_sets):
        q = torch.randn(B, Sq, HQ, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(B, L, HKV, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(B, L, HKV, D, dtype=torch.bfloat16, device="cuda")
        sets.append((q, k, v, torch.empty_like(q)))
    return sets


def torch_layout(sets):
    """(q, k, v) of each set in torch's own layout [B, H, S, D], contiguous."""
    return [tuple(x.transpose(1, 2).contiguous() for x in (q, k, v)) for q, k, v, _ in sets]


def decode_inputs(B, L):
    """Sets of (q, k, v, out) for one new token per sequence over a full cache of L, enough of them
    that their K and V total ROTATE_BYTES: rotated, every call is L2-cold."""
    return random_sets(B, 1, L, max(1, math.ceil(ROTATE_BYTES / decode_kv_bytes(B, L))))


def bench_decode(B, L, calls, read_bw, with_torch=True):
    import torch
    import torch.nn.functional as F
    kv_bytes = decode_kv_bytes(B, L)
    ours = decode_inputs(B, L)
    n_sets = len(ours)
    theirs = torch_layout(ours)
    ws = torch.empty(bitnet_ffi.attention_workspace_size(0, B, 1, HQ, HKV, D, L), dtype=torch.uint8,
                     device="cuda")

    def run_ours(i):
        q, k, v, out = ours[i]
        bitnet_ffi.attention(q, k, v, causal=True, out=out, workspace=ws)

    def run_torch(i):
        q, k, v = theirs[i]
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    run_ours(0)
    ref = F.scaled_dot_product_attention(*theirs[0], enable_gqa=True).transpose(1, 2)
    err = (ours[0][3].float() - ref.float()).abs().max().item()
    us_ours = graph_time_us(run_ours, n_sets, calls)
    gbps_ours = kv_bytes / us_ours / 1e3
    result = dict(kind="decode", B=B, L=L, us=us_ours, gbps=gbps_ours, pct_read_bw=100 * gbps_ours / read_bw,
                  max_abs_diff_vs_torch=err)
    if with_torch:
        us_torch = graph_time_us(run_torch, n_sets, calls)
        gbps_torch = kv_bytes / us_torch / 1e3
        result.update(torch_us=us_torch, torch_gbps=gbps_torch, torch_pct_read_bw=100 * gbps_torch / read_bw)
    return result


def bench_prefill(L, calls, with_torch=True):
    import torch.nn.functional as F
    set_bytes = L * (HQ + 2 * HKV) * D * 2
    n_sets = max(2, min(8, math.ceil(ROTATE_BYTES / set_bytes)))
    ours = random_sets(1, L, L, n_sets)
    theirs = torch_layout(ours)

    def run_ours(i):
        q, k, v, out = ours[i]
        bitnet_ffi.attention(q, k, v, causal=True, out=out)

    def run_torch(i):
        q, k, v = theirs[i]
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    run_ours(0)
    ref = F.scaled_dot_product_attention(*theirs[0], is_causal=True, enable_gqa=True).transpose(1, 2)
    err = (ours[0][3].float() - ref.float()).abs().max().item()
    flops = 2 * L * L * D * HQ
    us_ours = graph_time_us(run_ours, n_sets, calls)
    result = dict(kind="prefill", B=1, L=L, us=us_ours, tflops=flops / us_ours / 1e6, max_abs_diff_vs_torch=err)
    if with_torch:
        us_torch = graph_time_us(run_torch, n_sets, calls)
        result.update(torch_us=us_torch, torch_tflops=flops / us_torch / 1e6)
    return result


CPU_CASES = [(1, 1, 4096), (8, 1, 4096), (1, 1, 32768), (1, 512, 512)]  # (B, Sq, L)


def numpy_attention(q, k, v):
    """Causal attention in float32 numpy, the queries the last Sq positions (the anchor)."""
    B, Sq, Hq, _ = q.shape
    L, G = k.shape[1], Hq // k.shape[2]
    out = np.empty(q.shape, np.float32)
    hidden = np.arange(L)[None, :] > (L - Sq + np.arange(Sq))[:, None]
    for b in range(B):
        kb, vb = (np.repeat(x[b].astype(np.float32), G, axis=1) for x in (k, v))
        s = np.einsum("ihd,jhd->hij", q[b].astype(np.float32), kb, optimize=True) / np.sqrt(D)
        s[:, hidden] = -np.inf
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        out[b] = np.einsum("hij,jhd->ihd", p / p.sum(axis=-1, keepdims=True), vb, optimize=True)
    return out


def run_cpu():
    import ml_dtypes
    _, read_gbps = memory_bandwidths()
    isas = available_isas()
    cases = [(dtype, B, Sq, L) for dtype in ("bfloat16", "float32") for B, Sq, L in CPU_CASES]

    def inputs(index):
        dtype, B, Sq, L = cases[index]
        rng = np.random.default_rng(index)
        numpy_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
        return [rng.standard_normal(shape).astype(numpy_dtype)
                for shape in ((B, Sq, HQ, D), (B, L, HKV, D), (B, L, HKV, D))]

    results = []
    for index, (dtype, B, Sq, L) in enumerate(cases):
        q, k, v = inputs(index)
        kv_bytes = 2 * B * L * HKV * D * k.itemsize  # each K and V row once
        flops = 4 * HQ * D * B * sum(L - Sq + i + 1 for i in range(Sq))  # q.k and p.v, causal
        for isa in isas:
            bitnet_ffi.set_cpu_isa(isa)
            s = time_s(lambda: bitnet_ffi.attention(q, k, v, causal=True))
            gbps = kv_bytes / s / 1e9
            results.append(dict(kind="cpu", dtype=dtype, B=B, Sq=Sq, L=L, isa=isa, ms=1e3 * s,
                                gbps=gbps, pct_read_bw=100 * gbps / read_gbps,
                                gflops=flops / s / 1e9))
            print(results[-1], flush=True)
    bitnet_ffi.set_cpu_isa("auto")
    # numpy last: its BLAS threads keep spinning for a while after a call, which slowed the library
    # calls timed right after it
    for index, case in enumerate(cases):
        q, k, v = inputs(index)
        numpy_s = time_s(lambda: numpy_attention(q, k, v), repeats=1)
        for r in results:
            if (r["dtype"], r["B"], r["Sq"], r["L"]) == case:
                r.update(numpy_ms=1e3 * numpy_s, speedup_vs_numpy=numpy_s / (r["ms"] / 1e3))
    return dict(tool="attention", device="cpu", numpy_read_gbps=read_gbps, results=results)


def run_gpu(args):
    import torch
    global HQ, HKV, D
    HQ, HKV, D = args.heads
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    read_bw = read_bandwidth_gbps()
    results = []
    for B, L in (args.decode_cases or DECODE_CASES) if args.only != "prefill" else []:
        if args.quick and B * L > 8 * 32768 // 2:
            continue
        results.append(bench_decode(B, L, args.calls, read_bw, not args.no_torch))
        torch.cuda.empty_cache()
    for L in (args.prefill_cases or PREFILL_CASES) if args.only != "decode" else []:
        if args.quick and L > 4096:
            continue
        results.append(bench_prefill(L, max(2, args.calls // max(1, L // 1024)), not args.no_torch))
        torch.cuda.empty_cache()

    return dict(tool="attention", device=name, torch=torch.__version__, heads=[HQ, HKV, D],
                read_bandwidth_gbps=read_bw, results=results)


def decode_cases(text):
    """'1x4096,8x4096' -> [(1, 4096), (8, 4096)]."""
    try:
        cases = [tuple(int(n) for n in case.split("x")) for case in text.split(",")]
    except ValueError:
        cases = []
    if not cases or any(len(case) != 2 or min(case) < 1 for case in cases):
        raise argparse.ArgumentTypeError(f"{text!r}: expected cases like 1x4096,8x4096")
    return cases


def prefill_cases(text):
    """'960,4096' -> [960, 4096]."""
    try:
        cases = [int(n) for n in text.split(",")]
    except ValueError:
        cases = []
    if not cases or min(cases) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected lengths like 960,4096")
    return cases


def heads(text):
    """'12/4/256' -> (12, 4, 256): query heads, KV heads, head_dim."""
    try:
        hq, hkv, d = (int(n) for n in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected Hq/Hkv/D, e.g. 12/4/256") from None
    if min(hq, hkv, d) < 1 or hq % hkv or d not in (64, 128, 256):
        raise argparse.ArgumentTypeError(f"{text!r}: Hq a multiple of Hkv, D 64, 128 or 256")
    return hq, hkv, d


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--cpu", action="store_true", help="benchmark the CPU backend")
    parser.add_argument("--calls", type=int, default=100, help="GPU: calls per CUDA graph")
    parser.add_argument("--quick", action="store_true", help="GPU: skip the largest cases")
    parser.add_argument("--only", choices=("decode", "prefill"), help="GPU: run one kind of case")
    parser.add_argument("--no-torch", action="store_true", help="GPU: time our calls only")
    parser.add_argument("--heads", type=heads, default=(HQ, HKV, D), metavar="HQ/HKV/D",
                        help="GPU: query heads, KV heads and head_dim (default 20/5/128)")
    parser.add_argument("--decode-cases", type=decode_cases, metavar="BxL,...",
                        help="GPU: these decode cases instead of the default ones")
    parser.add_argument("--prefill-cases", type=prefill_cases, metavar="L,...",
                        help="GPU: these prefill lengths instead of the default ones")
    args = parser.parse_args()
    result = run_cpu() if args.cpu else run_gpu(args)
    emit(result, args.json)


if __name__ == "__main__":
    main()
