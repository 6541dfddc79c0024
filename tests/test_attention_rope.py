"""attention_rope_append_kv, a decode step's attention fused with RoPE and the KV-cache append:
against the two ops it fuses (bit for bit: the CPU runs them; the GPU kernel shares their
arithmetic and takes the same split-KV path), against float64 (RoPE, the rotated q and k rounded to
the dtype as the op stores them, then attention: ATTENTION_TOL), the GPU against the CPU, and a
device position out of range. Bad input: test_bad_input_matrix.py."""
import numpy as np
import pytest

import bitnet_ffi as bn
from bitnet_ffi import _arrays

from reference import ATTENTION_TOL, cast, reference_attention, reference_rope, to_torch

THETA = 500000.0
# (B, Hq, Hkv, D, C): 2B4T's heads; one query head per KV head; D = 64 and 256; 64 query heads per
# KV head (four row blocks, of which the first writes the cache); several sequences
CASES = [(1, 20, 5, 128, 100), (3, 8, 8, 64, 17), (2, 12, 4, 256, 130), (1, 64, 1, 64, 65),
         (5, 20, 5, 128, 1000)]


def make_case(rng, dtype, B, Hq, Hkv, D, C):
    """qkv [B, 1, Hq + 2 Hkv, D], caches [B, C, Hkv, D] of random rows, and positions that include
    the first and last row and a tile boundary. Each sequence's row at its position is NaN (what
    a stale cache row there would hold), so that an op that reads it instead of the new k and v
    shows."""
    qkv = cast(rng.standard_normal((B, 1, Hq + 2 * Hkv, D)), dtype)
    k_cache = cast(rng.standard_normal((B, C, Hkv, D)), dtype)
    v_cache = cast(rng.standard_normal((B, C, Hkv, D)) + 0.5, dtype)
    positions = rng.integers(0, C, B).astype(np.int32)
    positions[:3] = [C - 1, 0, min(63, C - 1)][:B]
    for b, p in enumerate(positions):
        k_cache[b, p] = v_cache[b, p] = np.nan
    return qkv, k_cache, v_cache, positions


def two_ops(qkv, k_cache, v_cache, positions, scale=None, workspace=None):
    q = bn.rope_append_kv(qkv, k_cache, v_cache, positions, theta=THETA)
    return bn.attention(q, k_cache, v_cache, causal=True, scale=scale, seq_lens=positions + 1,
                        workspace=workspace)


def reference(qkv, k_cache, v_cache, positions, dtype, Hq, Hkv):
    """float64: q and the new k rotated and rounded to the dtype, v as given, then attention."""
    rotated = cast(reference_rope(qkv[:, :, :Hq + Hkv], positions, THETA), dtype)
    k, v = k_cache.astype(np.float64), v_cache.astype(np.float64)
    for b, p in enumerate(positions):
        k[b, p] = rotated[b, 0, Hq:]
        v[b, p] = qkv[b, 0, Hq + Hkv:]
    return reference_attention(rotated[:, :, :Hq], k, v, seq_lens=positions + 1), v


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def assert_within(out, ref, v, dtype):
    out = np.asarray(out, np.float64)
    bound = ATTENTION_TOL[dtype] * np.abs(v[np.isfinite(v)]).max()
    assert np.isfinite(out).all(), "non-finite output"
    err = np.abs(out - ref).max()
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g}"


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_cpu_fused_equals_the_two_ops_and_float64(rng, dtype, case):
    B, Hq, Hkv, D, C = case
    qkv, k_cache, v_cache, positions = make_case(rng, dtype, B, Hq, Hkv, D, C)
    k_want, v_want = k_cache.copy(), v_cache.copy()
    out = np.full((B, 1, Hq, D), np.nan, qkv.dtype)
    assert bn.attention_rope_append_kv(qkv, k_cache, v_cache, positions, THETA, out=out) is out
    want = two_ops(qkv, k_want, v_want, positions)
    for got, expected in ((out, want), (k_cache, k_want), (v_cache, v_want)):
        np.testing.assert_array_equal(bits(got), bits(expected))
    ref, v_ref = reference(qkv, k_want, v_want, positions, dtype, Hq, Hkv)
    assert_within(out, ref, v_ref, dtype)


@pytest.mark.cpu
def test_cpu_scale_is_attentions(rng):
    qkv, k_cache, v_cache, positions = make_case(rng, "float32", 2, 8, 2, 64, 40)
    k_want, v_want = k_cache.copy(), v_cache.copy()
    out = bn.attention_rope_append_kv(qkv, k_cache, v_cache, positions, THETA, scale=0.3)
    np.testing.assert_array_equal(out, two_ops(qkv, k_want, v_want, positions, scale=0.3))


# ---- tiers 2 and 3: CUDA ----


def to_host(t, dtype):
    import torch
    if t.dtype == torch.bfloat16:
        return t.cpu().view(torch.int16).numpy().view(_arrays.numpy_dtype(dtype))
    return t.cpu().numpy()


# the split-KV paths the decode kernel takes: (B, Hq, Hkv, D, C) for one sequence at 2B4T's heads
# (a cluster of splits, one block per SM), 7 and 8 sequences and 48 groups at D = 64 (clusters of
# blocks sharing SMs, on sm_90), 64 sequences (one split), and the CPU cases
GPU_CASES = CASES + [(8, 20, 5, 128, 1024), (7, 20, 5, 128, 2000), (12, 16, 4, 64, 700),
                     (64, 20, 5, 128, 300)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_fused_equals_the_two_ops_on_the_gpu_and_the_cpu_within_the_bound(rng, dtype, case):
    """Bit for bit against rope_append_kv then attention on the GPU (the same arithmetic, the same
    splits); within ATTENTION_TOL of float64, as the CPU's result is."""
    import torch
    B, Hq, Hkv, D, C = case
    qkv, k_host, v_host, positions = make_case(rng, dtype, B, Hq, Hkv, D, C)
    tqkv, k_cache, v_cache, k_want, v_want = (to_torch(a) for a in (qkv, k_host, v_host, k_host,
                                                                     v_host))
    pos = torch.from_numpy(positions).cuda()
    out = torch.full((B, 1, Hq, D), float("nan"), dtype=tqkv.dtype, device="cuda")
    assert bn.attention_rope_append_kv(tqkv, k_cache, v_cache, pos, THETA, out=out) is out
    q = bn.rope_append_kv(tqkv, k_want, v_want, pos, theta=THETA)
    want = bn.attention(q, k_want, v_want, causal=True, seq_lens=pos + 1)
    for got, expected in ((out, want), (k_cache, k_want), (v_cache, v_want)):
        np.testing.assert_array_equal(bits(to_host(got, dtype)), bits(to_host(expected, dtype)))
    ref, v_ref = reference(qkv, k_host, v_host, positions, dtype, Hq, Hkv)
    assert_within(to_host(out, dtype), ref, v_ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 16])  # clusters (one block per SM, two); merge kernel
def test_gpu_device_position_out_of_range_gives_nan_and_writes_nothing(rng, B):
    import torch
    Hq, Hkv, D, C = 20, 5, 128, 200
    qkv, k_host, v_host, positions = make_case(rng, "bfloat16", B, Hq, Hkv, D, C)
    for bad in (-1, C):
        tqkv, k_cache, v_cache = (to_torch(a) for a in (qkv, k_host, v_host))
        k_before, v_before = k_cache.clone(), v_cache.clone()
        wrong = positions.copy()
        wrong[0] = bad
        out = torch.zeros((B, 1, Hq, D), dtype=torch.bfloat16, device="cuda")
        bn.attention_rope_append_kv(tqkv, k_cache, v_cache, torch.from_numpy(wrong).cuda(), THETA,
                                    out=out)
        torch.cuda.synchronize()
        assert out[0].isnan().all(), f"position {bad}: sequence 0 is not NaN"
        assert torch.equal(k_cache[0].view(torch.int16), k_before[0].view(torch.int16))
        assert torch.equal(v_cache[0].view(torch.int16), v_before[0].view(torch.int16))
        if B > 1:
            assert not out[1:].isnan().any(), "the sequences in range got NaN"


@pytest.mark.gpu
def test_gpu_captured_in_a_graph_replays_the_step(rng):
    """With device positions and a workspace the op is capturable; a replay after the positions
    advance is the op called there."""
    import torch
    B, Hq, Hkv, D, C = 8, 20, 5, 128, 300
    qkv, k_host, v_host, positions = make_case(rng, "bfloat16", B, Hq, Hkv, D, C)
    positions = np.minimum(positions, C - 2)
    tqkv, k_cache, v_cache, k_want, v_want = (to_torch(a) for a in (qkv, k_host, v_host, k_host,
                                                                     v_host))
    pos = torch.from_numpy(positions).cuda()
    ws = torch.empty(bn.attention_workspace_size(0, B, 1, Hq, Hkv, D, C), dtype=torch.uint8,
                     device="cuda")
    out = torch.empty((B, 1, Hq, D), dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        bn.attention_rope_append_kv(tqkv, k_cache, v_cache, pos, THETA, out=out, workspace=ws)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        bn.attention_rope_append_kv(tqkv, k_cache, v_cache, pos, THETA, out=out, workspace=ws)
    pos += 1
    graph.replay()
    torch.cuda.synchronize()
    for p in (positions, positions + 1):
        q = bn.rope_append_kv(tqkv, k_want, v_want, torch.from_numpy(p).cuda(), theta=THETA)
        want = bn.attention(q, k_want, v_want, causal=True, seq_lens=torch.from_numpy(p + 1).cuda())
    torch.cuda.synchronize()
    np.testing.assert_array_equal(bits(to_host(out, "bfloat16")), bits(to_host(want, "bfloat16")))
    np.testing.assert_array_equal(bits(to_host(k_cache, "bfloat16")),
                                  bits(to_host(k_want, "bfloat16")))
