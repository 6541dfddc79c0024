"""Host time of eager calls: what one call of an op costs the calling thread, outside any CUDA graph.

    python tools/bench_host.py [--device cpu|cuda] [--baseline DIR] [--rounds N]

An eager decode step makes a few hundred such calls, so their host time, not the kernels', sets its
pace (a CUDA graph replay, as the demo uses, has none of it). Each case is a loop of 2000 calls with
small inputs, timed with perf_counter; the GPU queue is drained before and after, and the kernels
are shorter than the calls, so the loop measures the host. The figure is the median over rounds
(and the minimum, the least disturbed round). On the GPU, torch tensors and torch's own eager ops
beside ours; on the CPU, numpy arrays (the CPU ops' own time is included: tiny shapes).

--baseline DIR compares with another version of the Python package, interleaved in one process:
DIR holds that version's bitnet_ffi/ and native/include/bitnet.h, for example
    mkdir /tmp/base && git archive 5a22711 bitnet_ffi native/include | tar -x -C /tmp/base
Both load the same libbitnet.so (BITNET_LIB, else the one found for this checkout).
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import bitnet_ffi
from bitnet_ffi import _ffi

CALLS = 2000


def load_baseline(directory):
    """The bitnet_ffi package under DIR, imported as bitnet_ffi_baseline."""
    init = Path(directory) / "bitnet_ffi" / "__init__.py"
    spec = importlib.util.spec_from_file_location("bitnet_ffi_baseline", init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def gpu_cases(bn):
    import torch
    rng = np.random.default_rng(0)
    tw = bn.quantize_i2s(rng.standard_normal((2560, 2560)).astype(np.float32)).to("cuda")
    tw_ffn = bn.quantize_i2s(rng.standard_normal((13824, 2560)).astype(np.float32)).to("cuda")
    x = torch.randn(1, 2560, device="cuda", dtype=torch.bfloat16)
    x_q, s = bn.quantize_a8(x)
    y = torch.empty_like(x)
    x8_q, s8 = bn.quantize_a8(torch.randn(8, 2560, device="cuda", dtype=torch.bfloat16))
    y8 = torch.empty(8, 13824, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.randn(2560, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 1, 20, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 4096, 5, 128, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(q)
    workspace = torch.empty(bn.attention_workspace_size(0, 1, 1, 20, 5, 128, 4096), device="cuda",
                            dtype=torch.uint8)
    return {
        "gemv_w2a8 2560x2560, 1 token, out given":
            lambda: bn.gemv_w2a8(tw, x_q, s, out_dtype="bfloat16", out=y),
        "gemv_w2a8 13824x2560, 8 tokens, out given (planned over 3 launch shapes)":
            lambda: bn.gemv_w2a8(tw_ffn, x8_q, s8, out_dtype="bfloat16", out=y8),
        "quantize_a8 [1, 2560], outputs allocated": lambda: bn.quantize_a8(x),
        "rmsnorm [1, 2560], out given": lambda: bn.rmsnorm(x, norm_w, out=y),
        "attention decode 20/5 heads, L 4096, out and workspace given":
            lambda: bn.attention(q, kv, kv, out=o, workspace=workspace),
    }


def torch_cases():
    import torch
    import torch.nn.functional as F
    x = torch.randn(1, 2560, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2560, 2560, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.randn(2560, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 20, 1, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 5, 4096, 128, device="cuda", dtype=torch.bfloat16)
    return {
        "torch F.linear 2560x2560 bf16": lambda: F.linear(x, w),
        "torch F.rms_norm [1, 2560]": lambda: F.rms_norm(x, (2560,), norm_w),
        "torch SDPA decode 20/5 heads, L 4096": lambda: F.scaled_dot_product_attention(
            q, kv, kv, enable_gqa=True),
    }


def cpu_cases(bn):
    rng = np.random.default_rng(0)
    tw = bn.quantize_i2s(rng.standard_normal((16, 128)).astype(np.float32))
    x = rng.standard_normal((1, 128)).astype(np.float32)
    x_q, s = bn.quantize_a8(x)
    y, y_norm = np.empty((1, 16), np.float32), np.empty_like(x)
    norm_w = np.ones(128, np.float32)
    return {
        "gemv_w2a8 16x128, 1 token, out given": lambda: bn.gemv_w2a8(tw, x_q, s, out=y),
        "quantize_a8 [1, 128], outputs allocated": lambda: bn.quantize_a8(x),
        "rmsnorm [1, 128], out given": lambda: bn.rmsnorm(x, norm_w, out=y_norm),
    }


def host_us(call, sync):
    for _ in range(100):
        call()
    sync()
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / CALLS * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda where torch sees a GPU, else cpu")
    parser.add_argument("--baseline", help="a directory with another bitnet_ffi/ to compare with")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if "BITNET_LIB" not in os.environ:  # the baseline loads the library this checkout finds
        os.environ["BITNET_LIB"] = next(
            (str(p) for p in _ffi.library_candidates() if p.is_file()), "")
    device = args.device
    if device is None:
        try:
            import torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            device = "cpu"
    versions = {"this tree": bitnet_ffi}
    if args.baseline:
        versions = {"baseline": load_baseline(args.baseline), **versions}
    if device == "cuda":
        import torch
        sync = torch.cuda.synchronize
        cases = {tag: gpu_cases(bn) for tag, bn in versions.items()}
        reference = torch_cases()
    else:
        sync = lambda: None  # noqa: E731
        cases = {tag: cpu_cases(bn) for tag, bn in versions.items()}
        reference = {}
    times = {}
    for _ in range(args.rounds):
        for name in cases["this tree"]:
            for tag in versions:
                times.setdefault((name, tag), []).append(host_us(cases[tag][name], sync))
        for name, call in reference.items():
            times.setdefault((name, "torch"), []).append(host_us(call, sync))
    print(f"device: {device}; {args.rounds} rounds of {CALLS} calls; µs per call, median (min)")
    print("| call | " + " | ".join(versions) + " |")
    print("| --- |" + " --- |" * len(versions))
    for name in cases["this tree"]:
        cells = [times[(name, tag)] for tag in versions]
        print(f"| {name} | " + " | ".join(f"{statistics.median(t):.1f} ({min(t):.1f})" for t in cells)
              + " |")
    if reference:
        print("\n| torch, the same work | µs per call, median (min) |\n| --- | --- |")
    for name in reference:
        t = times[(name, "torch")]
        print(f"| {name} | {statistics.median(t):.1f} ({min(t):.1f}) |")


if __name__ == "__main__":
    main()
