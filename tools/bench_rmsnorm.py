"""Benchmark of bitnet_ffi's RMSNorm kernels against PyTorch, side by side on one GPU.

    python tools/bench_rmsnorm.py [--json PATH] [--quick] [--ours-only]

Every case is timed as CUDA graph replays: one graph of N calls, call i working on buffer slot
i % slots, with slots enough that the buffers total >= 256 MiB (> 4x the H100's 50 MiB L2), so
each call starts L2-cold; the time per call is the median over 7 replays divided by N. Bytes: x
read + y written (+ residual read and written, or int8 codes + float32 scales instead of y) +
weight; for the squared-ReLU gate variant, gate_up [T, 2H] is read instead of x. "% read"
compares with the read bandwidth measured in the same run (torch.sum over 2 GiB, graph-timed).
The anchors: torch.nn.functional.rms_norm; for the residual variant r.add_(x) then rms_norm; for
the quantized variant rms_norm -> absmax -> scale -> round -> int8, unfused; for the gated one
relu(gate)^2 * up first.
"""
import argparse
import math

import torch
import torch.nn.functional as F

import bitnet_ffi
from gpu_bench import graph_time_us, read_bandwidth_gbps
from report import emit

ROTATE_BYTES = 256 << 20
MIN_CALLS, MAX_CALLS = 20, 25600
EPS = 1e-5

# (variant, H, T): norm = rmsnorm, add = add_rmsnorm, quant = rmsnorm_quantize, add_quant = both,
# relu2_quant = relu2_rmsnorm_quantize.
CASES = ([("norm", 2560, t) for t in (1, 16, 256, 4096, 32768)] +
         [("norm", 6912, t) for t in (1, 4096)] +
         [("add", 2560, t) for t in (1, 4096, 32768)] +
         [("quant", 2560, t) for t in (1, 256, 4096, 32768)] +
         [("quant", 6912, 4096), ("add_quant", 2560, 1), ("add_quant", 2560, 4096),
          ("relu2_quant", 6912, 1), ("relu2_quant", 6912, 4096)])
QUICK_CASES = [("norm", 2560, 1), ("norm", 2560, 256), ("norm", 2560, 4096), ("norm", 2560, 32768),
               ("norm", 6912, 4096), ("quant", 2560, 4096), ("add", 2560, 4096)]


def case_bytes(variant, H, T, itemsize):
    x = T * H * itemsize
    moved = (2 if "relu2" in variant else 1) * x + H * itemsize  # x (or gate_up) read, weight read
    moved += T * H + 4 * T if "quant" in variant else x  # codes + scales, or y
    if "add" in variant:
        moved += 2 * x  # residual read and written
    return moved


def bench_case(variant, H, T, dtype, with_torch):
    itemsize = torch.finfo(dtype).bits // 8
    footprint = case_bytes(variant, H, T, itemsize)
    slots = max(2, min(MAX_CALLS, math.ceil(ROTATE_BYTES / footprint)))
    calls = min(max(slots, MIN_CALLS), MAX_CALLS)
    x = torch.randn(slots, T, 2 * H if "relu2" in variant else H, device="cuda").to(dtype)
    weight = (1 + 0.1 * torch.randn(H, device="cuda")).to(dtype)
    residual = torch.randn(slots, T, H, device="cuda").to(dtype) if "add" in variant else None
    y = torch.empty(slots, T, H, device="cuda", dtype=dtype) if "quant" not in variant else None
    q = torch.empty(slots, T, H, device="cuda", dtype=torch.int8) if "quant" in variant else None
    s = torch.empty(slots, T, device="cuda", dtype=torch.float32) if "quant" in variant else None

    def ours(i):
        if variant == "norm":
            bitnet_ffi.rmsnorm(x[i], weight, EPS, out=y[i])
        elif variant == "add":
            bitnet_ffi.add_rmsnorm(x[i], residual[i], weight, EPS, out=y[i])
        elif variant == "relu2_quant":
            bitnet_ffi.relu2_rmsnorm_quantize(x[i], weight, EPS, out=(q[i], s[i]))
        else:
            bitnet_ffi.rmsnorm_quantize(x[i], weight, EPS, residual=None if residual is None
                                        else residual[i], out=(q[i], s[i]))

    kept = []  # torch's outputs stay alive so that each call writes fresh memory, as ours do

    def theirs(i):
        v = x[i]
        if "relu2" in variant:
            gate, up = v[:, :H], v[:, H:]
            v = torch.relu(gate).square().mul(up)
        if "add" in variant:
            v = residual[i].add_(x[i])
        out = F.rms_norm(v, (H,), weight, EPS)
        if "quant" in variant:
            scale = 127.0 / out.abs().amax(-1, keepdim=True).float().clamp_min(1e-5)
            out = ((out.float() * scale).round().clamp(-128, 127).to(torch.int8), scale)
        kept.append(out)

    row = {"variant": variant, "dtype": str(dtype).removeprefix("torch."), "H": H, "T": T,
           "bytes": footprint, "slots": slots, "ours_us": graph_time_us(ours, slots, calls)}
    if with_torch:
        row["torch_us"] = graph_time_us(theirs, slots, calls)
    kept.clear()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="only a few cases")
    parser.add_argument("--ours-only", action="store_true", help="skip the torch anchors")
    args = parser.parse_args()

    device = torch.cuda.get_device_name()
    read_bw = read_bandwidth_gbps()
    rows = []
    for variant, H, T in QUICK_CASES if args.quick else CASES:
        row = bench_case(variant, H, T, torch.bfloat16, not args.ours_only)
        for who in ("ours", "torch"):
            if who + "_us" in row:
                row[who + "_gbps"] = row["bytes"] / row[who + "_us"] / 1e3
                row[who + "_pct_read"] = 100 * row[who + "_gbps"] / read_bw
        rows.append(row)
        torch.cuda.empty_cache()

    result = {"tool": "rmsnorm", "device": device, "read_bandwidth_gbps": read_bw, "rows": rows}
    emit(result, args.json)


if __name__ == "__main__":
    main()
