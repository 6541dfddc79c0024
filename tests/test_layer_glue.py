"""Layer glue: RoPE fused with the KV-cache append, and the squared-ReLU gate; CPU and CUDA against
float64 numpy references, GPU against CPU; bad input."""
import numpy as np
import pytest

import bitnet_ffi
from bitnet_ffi import _arrays

from reference import (GATE_ATOL, GATE_TOL, ROPE_TOL, cast, cpu_isas, reference_relu2_gate, reference_rope,
                       rope_case, to_torch)


def check_rope(q_before, q_after, k, v, k_cache, v_cache, positions, theta, dtype):
    """q_after, the caches' rows at positions against the float64 rotation, v copied bit for bit,
    the caches' other rows still NaN."""
    S = q_before.shape[1]
    tol = ROPE_TOL[dtype]
    np.testing.assert_allclose(np.asarray(q_after, np.float64),
                               reference_rope(q_before, positions, theta), rtol=0, atol=tol * 4)
    k_rot = reference_rope(k, positions, theta)
    for b, p in enumerate(positions):
        np.testing.assert_allclose(np.asarray(k_cache[b, p:p + S], np.float64), k_rot[b],
                                   rtol=0, atol=tol * 4)
        np.testing.assert_array_equal(np.asarray(v_cache[b, p:p + S]).view(np.uint8),
                                      np.asarray(v[b]).view(np.uint8))
        rest = np.ones(k_cache.shape[1], bool)
        rest[p:p + S] = False
        assert np.isnan(np.asarray(k_cache[b, rest], np.float32)).all()
        assert np.isnan(np.asarray(v_cache[b, rest], np.float32)).all()


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", [(1, 1, 20, 5, 128, 50), (3, 7, 8, 8, 64, 31), (2, 5, 8, 1, 6, 9),
                                  (2, 3, 12, 4, 256, 40)])
def test_cpu_rope_append_kv(rng, dtype, case):
    B, S, Hq, Hkv, D, C = case
    q, k, v, qkv, k_cache, v_cache = rope_case(rng, dtype, B, S, Hq, Hkv, D, C)
    positions = [int(x) for x in rng.integers(0, C - S + 1, B)]
    positions[0] = C - S
    out = np.full(q.shape, np.nan, q.dtype)
    assert bitnet_ffi.rope_append_kv(qkv, k_cache, v_cache, positions, theta=500000.0,
                                     out=out) is out
    check_rope(q, out, k, v, k_cache, v_cache, positions, 500000.0, dtype)


@pytest.mark.cpu
def test_cpu_rope_large_positions_and_theta(rng):
    q, k, v, qkv, k_cache, v_cache = rope_case(rng, "float32", 2, 3, 4, 2, 128, 40000)
    positions = [39997, 12345]
    out = bitnet_ffi.rope_append_kv(qkv, k_cache, v_cache, positions, theta=10000.0)
    check_rope(q, out, k, v, k_cache, v_cache, positions, 10000.0, "float32")


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 2 * 6912), (7, 2 * 13), (3, 5, 2 * 40)])
def test_cpu_relu2_gate(rng, dtype, shape):
    gate_up = cast(rng.standard_normal(shape) * 2, dtype)
    gate_up.reshape(-1)[:4] = [0.0, -0.0, -3.0, 1.5]    # edges: zero, negative zero, negative
    ref = reference_relu2_gate(gate_up)
    out = np.full(ref.shape, np.nan, dtype=gate_up.dtype)
    assert bitnet_ffi.relu2_gate(gate_up, out=out) is out
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=GATE_TOL[dtype],
                               atol=GATE_ATOL[dtype])
    fresh = bitnet_ffi.relu2_gate(gate_up)
    np.testing.assert_array_equal(np.asarray(fresh).view(np.uint8), np.asarray(out).view(np.uint8))


def float16_edge_row(rng, n):
    """float16 values across the range: normals, subnormals, the largest finite, zeros, inf, NaN."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    row = bits.view(np.float16).copy()
    row[:8] = [np.float16(6e-8), np.float16(-6e-8), np.float16(65504), np.float16(-0.0),
               np.float16(np.inf), np.float16(-np.inf), np.float16(np.nan), np.float16(1.0)]
    return row


@pytest.mark.cpu
def test_cpu_float16_rows_convert_exactly_on_every_path(rng):
    """The CPU ops convert float16 rows with F16C above the portable path and with bit operations
    on it (cpu/convert.c): relu2_gate's float32 products rounded to float16 equal numpy's rounding
    (overflow to inf, subnormals, ties), and every float16 op gives the same bits on every path
    (NaN positions for NaN)."""
    T, F = 3, 1000
    gate_up = np.stack([float16_edge_row(rng, 2 * F) for _ in range(T)])
    x = rng.standard_normal((T, 1024)).astype(np.float16)
    x[0, :8] = float16_edge_row(rng, 8)[:6].tolist() + [1.0, 2.0]  # no NaN: finite codes compare
    weight = rng.uniform(0.5, 2.0, 1024).astype(np.float16)
    w = rng.standard_normal((64, 1024)).astype(np.float16)
    g, up = gate_up[:, :F].astype(np.float32), gate_up[:, F:].astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        want_gate = (np.maximum(g, 0) ** 2 * up).astype(np.float16)
    results = {}
    try:
        for isa in cpu_isas():
            bitnet_ffi.set_cpu_isa(isa)
            out = bitnet_ffi.relu2_gate(gate_up)
            same = ~np.isnan(want_gate)
            np.testing.assert_array_equal(np.isnan(out), ~same)
            np.testing.assert_array_equal(out.view(np.uint16)[same], want_gate.view(np.uint16)[same])
            results[isa] = [out, bitnet_ffi.rmsnorm(x, weight), *bitnet_ffi.rmsnorm_quantize(x, weight),
                            *bitnet_ffi.quantize_a8(x), bitnet_ffi.quantize_i2s(w).unpack()]
    finally:
        bitnet_ffi.set_cpu_isa("auto")
    portable = results["portable"]
    for isa, got in results.items():
        for a, b in zip(got, portable):
            a, b = np.asarray(a), np.asarray(b)
            np.testing.assert_array_equal(np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32)))
            keep = ~np.isnan(b.astype(np.float32))
            np.testing.assert_array_equal(a[keep], b[keep], f"{isa} differs from portable")


# ---- tiers 2 and 3: CUDA ----


def to_numpy(t, dtype):
    import torch
    if t.dtype == torch.bfloat16:
        return t.cpu().view(torch.int16).numpy().view(_arrays.numpy_dtype(dtype))
    return t.cpu().numpy()


@pytest.mark.gpu_smoke
def test_gpu_smoke_relu2_gate(rng):
    import torch
    gate_up = torch.randn(4, 2 * 64, device="cuda", dtype=torch.float16)
    out = bitnet_ffi.relu2_gate(gate_up)
    ref = reference_relu2_gate(gate_up.double().cpu().numpy())
    np.testing.assert_allclose(out.double().cpu().numpy(), ref, rtol=GATE_TOL["float16"],
                               atol=GATE_ATOL["float16"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 2 * 6912), (9, 2 * 13), (300, 2 * 6912), (2, 3, 2 * 40)])
def test_gpu_relu2_gate_matches_cpu_bitwise(rng, dtype, shape):
    pytest.importorskip("ml_dtypes")
    gate_up = cast(rng.standard_normal(shape) * 2, dtype)
    gate_up.reshape(-1)[:3] = [0.0, -0.0, -3.0]
    cpu = bitnet_ffi.relu2_gate(gate_up)
    gpu = bitnet_ffi.relu2_gate(to_torch(gate_up))
    np.testing.assert_array_equal(to_numpy(gpu, dtype).view(np.uint16), cpu.view(np.uint16))


def to_torch_at(x, offset):
    """x on the GPU, starting `offset` elements into its allocation (offset 1: only 2-byte
    aligned, which leaves the kernel's scalar path)."""
    t = to_torch(x.reshape(-1))
    padded = t.new_empty(t.numel() + offset)
    padded[offset:] = t
    return padded[offset:].view(x.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", [(1, 1, 20, 5, 128, 4096), (3, 7, 8, 8, 64, 40000), (2, 17, 32, 8, 128, 100),
                                  (1, 1, 12, 4, 256, 4096), (2, 9, 12, 4, 256, 300),
                                  (2, 5, 32, 32, 100, 64), (1, 3, 3, 1, 6, 9), (1, 2, 40, 40, 128, 8)])
@pytest.mark.parametrize("offset", [0, 1])
def test_gpu_rope_append_kv_matches_reference_and_cpu(rng, dtype, case, offset):
    """Every vector width of the kernel (8 pairs where D/2 % 8 == 0 and the arrays are 16-byte
    aligned, 2 where D/2 is even and they are 4-byte aligned, else 1), and blocks of more items
    than threads (40 + 40 heads)."""
    pytest.importorskip("ml_dtypes")
    B, S, Hq, Hkv, D, C = case
    q, k, v, qkv, k_cache, v_cache = rope_case(rng, dtype, B, S, Hq, Hkv, D, C)
    positions = [int(x) for x in rng.integers(0, C - S + 1, B)]
    positions[-1] = C - S
    tqkv, tq, tkc, tvc = (to_torch_at(x, offset) for x in (qkv, np.full_like(q, np.nan), k_cache,
                                                           v_cache))
    assert bitnet_ffi.rope_append_kv(tqkv, tkc, tvc, positions, out=tq) is tq
    q_gpu, kc_gpu, vc_gpu = (to_numpy(t, dtype) for t in (tq, tkc, tvc))
    check_rope(q, q_gpu, k, v, kc_gpu, vc_gpu, positions, 500000.0, dtype)
    q_cpu = bitnet_ffi.rope_append_kv(qkv, k_cache, v_cache, positions)
    # Same float64 angles, float32 rotation: at most 1 ulp apart (fma contraction may differ).
    np.testing.assert_allclose(q_gpu.astype(np.float64), q_cpu.astype(np.float64),
                               rtol=ROPE_TOL[dtype], atol=ROPE_TOL[dtype])


@pytest.mark.gpu
def test_gpu_rope_device_positions_out_of_range_are_skipped(rng):
    import torch
    q, k, v, qkv, k_cache, v_cache = (to_torch(x) for x in
                                      rope_case(rng, "float16", 3, 2, 4, 2, 64, 10))
    q_before = q.clone()
    positions = torch.tensor([3, 9, -1], dtype=torch.int32, device="cuda")
    bitnet_ffi.rope_append_kv(qkv, k_cache, v_cache, positions, out=q)
    torch.cuda.synchronize()
    assert torch.equal(q[1:], q_before[1:]) and not torch.equal(q[0], q_before[0])
    assert torch.isnan(k_cache[1:]).all() and torch.isnan(v_cache[1:]).all()
    assert torch.equal(v_cache[0, 3:5], v[0])
