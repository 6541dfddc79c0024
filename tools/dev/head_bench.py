"""gemv_bf16 alone at the 2B4T head (128256 x 2560), bfloat16 x, float32 out: µs per call (median
of 15 replays of a CUDA graph of 10 calls) at 2 to 128 tokens (docs/log/2026-11-27.md#2026-11-27-8).

    BITNET_LIB=path/to/libbitnet.so python tools/dev/head_bench.py
"""
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bitnet_ffi as bn
from graph_timer import graph_us
w = torch.randn(128256, 2560, device="cuda").to(torch.bfloat16)
out = {}
for N in (2, 8, 16, 33, 64, 128):
    x = torch.randn(N, 2560, device="cuda").to(torch.bfloat16)
    y = torch.empty(N, 128256, device="cuda")
    s = torch.cuda.Stream()
    out[N] = round(graph_us(lambda: bn.gemv_bf16(w, x, out=y, stream=s), s, 10), 1)
print(json.dumps(out))
