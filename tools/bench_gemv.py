"""Benchmark of the W2A8 GEMV and the ternary/int8 quantizers, side by side with torch bf16 F.linear
and with Microsoft's BitNet kernel (figures of /work/shared/ANCHORS.md, same H100 model).

GPU (default): every figure is the median of 7 replays of a CUDA graph of many calls; "cold" calls
rotate through copies of the weights totalling >= 512 MiB (> 4x the 50 MiB L2), so no call finds
its weights in L2. Read bandwidth is measured in the same run (torch.sum over 2 GiB, graph-timed).
Bytes counted for the GEMV: M*K/4 packed weights + N*K int8 x + 4*N*M output.
  python tools/bench_gemv.py [--json PATH]
Block-scaled weights (--block-scaled, llama.cpp's TQ files whose blocks differ): that GEMV beside
the plain one at the 2B4T shapes, 1, 8, 16 and 960 tokens (bytes also count the block scales).
  python tools/bench_gemv.py --block-scaled [--json PATH]
CPU (--cpu): GB/s of the packed-weight stream against a numpy memcpy of 1 GiB, and the time of the
numpy reference of the tests at the same shape.
  python tools/bench_gemv.py --cpu [--json PATH]
"""
import argparse
import math
import time

import numpy as np

import bitnet_ffi as bn
from cpu_bench import available_isas, memory_bandwidths, time_s
from gpu_bench import graph_time_us, read_bandwidth_gbps
from report import ANCHORS, MICROSOFT_2B4T_US, PROJECTIONS_2B4T, emit

ROTATE_BYTES = 512 << 20

def random_packed(torch, M, K, copies):
    """`copies` packed weight matrices of valid codes (0..2 in every 2-bit field)."""
    def one():
        codes = torch.randint(0, 3, (4, M, K // 4), dtype=torch.uint8, device="cuda")
        return codes[0] | codes[1] << 2 | codes[2] << 4 | codes[3] << 6
    return [one() for _ in range(copies)]


def bench_gemv_shape(torch, M, K, N, read_gbps, with_torch=True, block_scaled=False):
    copies = max(1, math.ceil(ROTATE_BYTES / (M * K // 4)))
    blocks = (lambda: torch.rand(M, K // 256, device="cuda") + 0.5) if block_scaled else lambda: None
    weights = [bn.TernaryWeights(p, torch.rand(M, device="cuda") + 0.5, blocks())
               for p in random_packed(torch, M, K, copies)]
    x_q = torch.randint(-128, 128, (N, K), dtype=torch.int8, device="cuda")
    x_s = torch.rand(N, device="cuda") + 1.0
    y = torch.empty((N, M), dtype=torch.float32, device="cuda")
    calls = max(copies, 20)
    us = graph_time_us(lambda i: bn.gemv_w2a8(weights[i], x_q, x_s, out=y), copies, calls)
    nbytes = M * K // 4 + N * K + 4 * N * M + (M * K // 256 * 4 if block_scaled else 0)
    gbps = nbytes / us / 1e3
    del weights
    row = {"op": "gemv_w2a8 block-scaled" if block_scaled else "gemv_w2a8", "M": M, "K": K, "N": N, "us": us, "GBps": gbps,
           "pct_read_bw": 100 * gbps / read_gbps}
    if (M, K) in ANCHORS and N == 1:
        row["microsoft_cold_us"] = ANCHORS[(M, K)][0]
        row["speedup_vs_microsoft"] = ANCHORS[(M, K)][0] / us
    if not with_torch:
        return row
    bf16_copies = max(1, math.ceil(ROTATE_BYTES / (2 * M * K)))
    dense = [torch.randn(M, K, dtype=torch.bfloat16, device="cuda") for _ in range(bf16_copies)]
    x = torch.randn(N, K, dtype=torch.bfloat16, device="cuda")
    calls = max(bf16_copies, 20)
    torch_us = graph_time_us(lambda i: torch.nn.functional.linear(x, dense[i]), bf16_copies, calls)
    del dense
    row["torch_bf16_us"], row["speedup_vs_torch"] = torch_us, torch_us / us
    return row


LAYER_BYTES_2B4T = sum(M * K // 4 for M, K in PROJECTIONS_2B4T)


def layer_row_2b4t(op, us, read_gbps):
    """A row for the four 2B4T projections taking `us` together, beside Microsoft's 30.3 µs."""
    gbps = LAYER_BYTES_2B4T / us / 1e3
    return {"op": op, "us": us, "GBps": gbps, "pct_read_bw": 100 * gbps / read_gbps,
            "microsoft_cold_us": MICROSOFT_2B4T_US, "speedup_vs_microsoft": MICROSOFT_2B4T_US / us}


def bench_2b4t(torch, read_gbps):
    layers = math.ceil(ROTATE_BYTES / LAYER_BYTES_2B4T)
    weights = [[bn.TernaryWeights(random_packed(torch, M, K, 1)[0], torch.rand(M, device="cuda"))
                for M, K in PROJECTIONS_2B4T] for _ in range(layers)]
    xs = {K: torch.randint(-128, 128, (1, K), dtype=torch.int8, device="cuda") for _, K in PROJECTIONS_2B4T}
    x_s = torch.ones(1, device="cuda")
    ys = [torch.empty((1, M), device="cuda") for M, _ in PROJECTIONS_2B4T]

    def layer(i):
        for j, (M, K) in enumerate(PROJECTIONS_2B4T):
            bn.gemv_w2a8(weights[i][j], xs[K], x_s, out=ys[j])

    return layer_row_2b4t("2B4T layer: 4 projections back to back", graph_time_us(layer, layers),
                          read_gbps)


def sum_2b4t_alone(rows, read_gbps):
    """The four projections' batch-1 rows of this run, summed: how ANCHORS.md's 30.3 µs for
    Microsoft's kernel is made (each shape timed alone, cold). None unless all four were run."""
    alone = {(r["M"], r["K"]): r["us"] for r in rows if r.get("N") == 1 and "M" in r}
    if not all(shape in alone for shape in PROJECTIONS_2B4T):
        return None
    return layer_row_2b4t("2B4T layer: the 4 projections each timed alone, summed",
                          sum(alone[shape] for shape in PROJECTIONS_2B4T), read_gbps)


def eager_time_us(torch, call, repeats=20):
    """Median µs of call() run eagerly and waited for, after one warm-up call."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return sorted(times)[repeats // 2]


def bench_quantizers(torch, read_gbps):
    rows = []
    M, K = 16384, 4096  # 256 MiB of float32
    w = torch.randn(M, K, device="cuda")
    # quantize_i2s waits on the host for its check of the weights (no NaN or inf), so it cannot
    # be captured: eager calls, each waited for, host time included. It reads W twice.
    us = eager_time_us(torch, lambda: bn.quantize_i2s(w, row_segments=[M // 2, M // 2]))
    nbytes = 2 * w.numel() * 4 + M * K // 4
    rows.append({"op": "quantize_i2s f32 [16384, 4096]", "us": us, "GBps": nbytes / us / 1e3,
                 "pct_read_bw": 100 * nbytes / us / 1e3 / read_gbps,
                 "note": "eager, synchronous; bytes = 2 reads of W + packed write"})
    us = graph_time_us(lambda _: bn.quantize_a8(w))
    nbytes = w.numel() * 4 + w.numel() + 4 * M
    rows.append({"op": "quantize_a8 f32 [16384, 4096]", "us": us, "GBps": nbytes / us / 1e3,
                 "pct_read_bw": 100 * nbytes / us / 1e3 / read_gbps,
                 "note": "bytes = read x + write x_q (the second read of each row hits L2)"})
    return rows


def run_gpu(quick, gemv_only):
    import torch
    read_gbps = read_bandwidth_gbps()
    print(f"read bandwidth (torch.sum over 2 GiB): {read_gbps:.0f} GB/s", flush=True)
    rows = []
    shapes = list(ANCHORS) if not quick else [(13824, 2560), (55296, 5120)]
    for M, K in shapes:
        for N in (1, 8):
            rows.append(bench_gemv_shape(torch, M, K, N, read_gbps, with_torch=not gemv_only))
            print(rows[-1], flush=True)
    rows.append(bench_2b4t(torch, read_gbps))
    print(rows[-1], flush=True)
    summed = sum_2b4t_alone(rows, read_gbps)
    if summed:
        rows.append(summed)
    if not gemv_only:
        rows += bench_quantizers(torch, read_gbps)
        print(rows[-2:], flush=True)
    return {"tool": "gemv", "device": torch.cuda.get_device_name(), "read_bandwidth_GBps": read_gbps,
            "rows": rows}


def run_block_scaled():
    import torch
    read_gbps = read_bandwidth_gbps()
    print(f"read bandwidth (torch.sum over 2 GiB): {read_gbps:.0f} GB/s", flush=True)
    rows = []
    for M, K in PROJECTIONS_2B4T:
        for N in (1, 8, 16, 960):
            for block_scaled in (False, True):
                rows.append(bench_gemv_shape(torch, M, K, N, read_gbps, with_torch=False,
                                             block_scaled=block_scaled))
            rows[-1]["x_plain"] = rows[-1]["us"] / rows[-2]["us"]
            print(rows[-2], rows[-1], sep="\n", flush=True)
    return {"tool": "gemv", "device": torch.cuda.get_device_name(), "read_bandwidth_GBps": read_gbps,
            "rows": rows}


def run_cpu():
    rng = np.random.default_rng(0)
    copy_gbps, read_gbps = memory_bandwidths()
    valid = np.array([b for b in range(256) if all((b >> s) & 3 != 3 for s in (0, 2, 4, 6))],
                     np.uint8)
    rows = []
    # 768 MiB of packed weights: larger than the caches (this VM reports a 480 MiB L3).
    M, K = 196608, 16384
    block = valid[rng.integers(0, len(valid), (4096, K // 4))]
    big = bn.TernaryWeights(np.tile(block, (M // 4096, 1)), np.ones(M, np.float32))
    x_q = rng.integers(-128, 128, (1, K), dtype=np.int8)
    x_s = np.ones(1, np.float32)
    for isa in available_isas():
        bn.set_cpu_isa(isa)
        t = time_s(lambda: bn.gemv_w2a8(big, x_q, x_s), repeats=1 if isa == "portable" else 3)
        rows.append({"op": f"gemv_w2a8 cpu {isa}", "M": M, "K": K, "N": 1, "s": t,
                     "GBps": M * K / 4 / t / 1e9})
        print(rows[-1], flush=True)
    bn.set_cpu_isa("auto")
    del big
    M, K = 3840, 2560
    w_q = rng.integers(-1, 2, (M, K), dtype=np.int8)
    tw = bn.pack_ternary(w_q, 1.0)
    x_q = rng.integers(-128, 128, (1, K), dtype=np.int8)
    t_lib = time_s(lambda: bn.gemv_w2a8(tw, x_q, x_s), repeats=10)
    t_ref = time_s(lambda: x_q.astype(np.int64) @ tw.unpack().astype(np.int64).T, repeats=1)
    rows.append({"op": "gemv_w2a8 cpu vs numpy reference", "M": M, "K": K, "N": 1, "s": t_lib,
                 "GBps": M * K / 4 / t_lib / 1e9, "numpy_reference_s": t_ref,
                 "speedup_vs_numpy": t_ref / t_lib})
    print(rows[-1], flush=True)
    return {"tool": "gemv", "device": "cpu", "memcpy_GBps": copy_gbps, "numpy_read_GBps": read_gbps,
            "rows": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="benchmark the CPU backend")
    parser.add_argument("--quick", action="store_true", help="GPU: two shapes only")
    parser.add_argument("--gemv-only", action="store_true",
                        help="GPU: the GEMV rows only (no torch anchors, no quantizers)")
    parser.add_argument("--block-scaled", action="store_true",
                        help="GPU: the block-scaled GEMV beside the plain one (2B4T shapes)")
    parser.add_argument("--json", help="write the results to this path")
    args = parser.parse_args()
    result = (run_cpu() if args.cpu else run_block_scaled() if args.block_scaled
              else run_gpu(args.quick, args.gemv_only))
    emit(result, args.json)


if __name__ == "__main__":
    main()
