"""rope_append_kv alone at 2B4T's heads (20 q, 5 kv, D = 128), bfloat16: µs per call (median of
15 replays of a CUDA graph of 50 calls) and GB/s, at 1 and 8 tokens (decode) and 960 and 4096
(prefill). Calls either form of the op (q, k, v apart before b9ae537; the fused qkv since), so one
script times both sides of an A/B (docs/log/2026-11-27.md#2026-11-27-5).

    BITNET_LIB=path/to/libbitnet.so python tools/dev/rope_bench.py
"""
import inspect, json, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bitnet_ffi as bn
from graph_timer import graph_us
fused = "qkv" in inspect.signature(bn.rope_append_kv).parameters
Hq, Hkv, D = 20, 5, 128
out = {}
for B, S in ((1, 1), (8, 1), (1, 960), (1, 4096)):
    C = S + 8
    qkv = torch.randn(B, S, Hq + 2 * Hkv, D, device="cuda", dtype=torch.bfloat16)
    q = torch.empty(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = qkv[:, :, Hq:Hq + Hkv].contiguous(), qkv[:, :, Hq + Hkv:].contiguous()
    kc = torch.zeros(B, C, Hkv, D, device="cuda", dtype=torch.bfloat16); vc = kc.clone()
    pos = torch.zeros(B, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    call = (lambda: bn.rope_append_kv(qkv, kc, vc, pos, out=q, stream=s)) if fused else \
           (lambda: bn.rope_append_kv(q, k, v, kc, vc, pos, stream=s))
    us = graph_us(call, s, 50)
    gb = B * S * (Hq * D * 4 + Hkv * D * 8) / us / 1e3
    out[f"B{B}_S{S}"] = (round(us, 2), round(gb))
print(json.dumps({"fused": fused, "us_GBps": out}))
