"""Launches the kernels whose performance targets are still open, for Nsight Compute to profile.

Each case runs twice (profile the second launch: the first one loads the module), bf16, on fresh
random inputs. Run it under ncu on the GPU machine, for example:

    ncu --section SpeedOfLight --section SchedulerStats --section Occupancy \\
        -k regex:rmsnorm --launch-skip 1 --launch-count 1 python3 tools/dev/profile_cases.py norm-int8

ncu flushes the caches between kernels and runs the SM at its base clock, so its durations are
longer than bench_*.py's graph replays; compare the ratios it reports (issue, DRAM throughput,
occupancy), not the times. docs/rmsnorm.md has a table made this way."""
import argparse

import torch

import bitnet_ffi as bn


def attention(B, L):
    q = torch.randn(B, 1, 20, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, L, 5, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(B, L, 5, 128, dtype=torch.bfloat16, device="cuda")
    workspace = torch.empty(bn.attention_workspace_size(0, B, 1, 20, 5, 128, L), dtype=torch.uint8,
                            device="cuda")
    out = torch.empty_like(q)
    for _ in range(2):
        bn.attention(q, k, v, causal=True, out=out, workspace=workspace)


def gemv(M, K, N):
    codes = torch.randint(-1, 2, (M, K), dtype=torch.int8, device="cuda")
    weights = bn.pack_ternary(codes, torch.rand(M, device="cuda") + 0.5)
    x_q = torch.randint(-128, 128, (N, K), dtype=torch.int8, device="cuda")
    x_scales = torch.rand(N, device="cuda") + 1.0
    y = torch.empty((N, M), dtype=torch.float32, device="cuda")
    for _ in range(2):
        bn.gemv_w2a8(weights, x_q, x_scales, out=y)


def norm(T, H, int8):
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)
    for _ in range(2):
        if int8:
            bn.rmsnorm_quantize(x, weight, 1e-5)
        else:
            bn.rmsnorm(x, weight, 1e-5)


def decode_layer(L):
    """One fused 2B4T layer (bitnet_decode_layer) at position L - 1 of a cache of L rows, its
    arrays DeviceArrays as model.Session's."""
    import numpy as np
    from bitnet_ffi import _arrays
    from bitnet_ffi.model import BITNET_2B4T, Config, random_weights
    config = Config(**{**BITNET_2B4T.__dict__, "layers": 1})
    layer = random_weights(config, 0).layers[0]
    rng, bf16 = np.random.default_rng(0), _arrays.numpy_dtype("bfloat16")

    def put(shape):
        return bn.DeviceArray.from_numpy(rng.standard_normal(shape).astype(bf16), 0)

    h, k, v = put(config.hidden), put((L, config.kv_heads, config.head_dim)), \
        put((L, config.kv_heads, config.head_dim))
    position = bn.DeviceArray.from_numpy(np.array([L - 1], np.int32), 0)
    workspace = bn.DeviceArray((bn.decode_layer_workspace_size(config, 0),), "uint8", 0)
    for _ in range(2):
        bn.decode_layer(config, layer, h, k, v, position, workspace=workspace)


CASES = {
    "decode-1024": lambda: attention(1, 1024),
    "decode-4096": lambda: attention(1, 4096),
    "decode-32768": lambda: attention(1, 32768),
    "gemv-5120x27648": lambda: gemv(5120, 27648, 1),
    "gemv-13824x2560": lambda: gemv(13824, 2560, 1),
    "gemm-13824x2560x16": lambda: gemv(13824, 2560, 16),
    "gemm-55296x5120x16": lambda: gemv(55296, 5120, 16),
    "gemm-2560x2560x64": lambda: gemv(2560, 2560, 64),
    "gemm-2560x2560x256": lambda: gemv(2560, 2560, 256),
    "gemm-2560x2560x4096": lambda: gemv(2560, 2560, 4096),
    "gemm-13824x2560x960": lambda: gemv(13824, 2560, 960),
    "norm-int8": lambda: norm(4096, 2560, True),
    "norm": lambda: norm(4096, 2560, False),
    "decode-layer-1024": lambda: decode_layer(1024),
    "decode-layer-4096": lambda: decode_layer(4096),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"any of {', '.join(CASES)} (default: all)")
    names = parser.parse_args().cases or list(CASES)
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}: choose from {', '.join(CASES)}")
    for name in names:
        CASES[name]()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
