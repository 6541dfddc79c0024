"""Attention: CPU and CUDA against a float64 numpy reference, the GPU also against the CPU and torch
SDPA; the split-KV decode and mma prefill paths; bad input at the C ABI and in Python."""

import numpy as np
import pytest

import bitnet_ffi

from reference import (ATTENTION_TOL as TOLERANCE, attention_poisoned as poisoned,
                       make_attention_inputs as make_qkv, reference_attention, torch_inputs)


HEADS = [(20, 5), (8, 8), (32, 8), (8, 1)]


def assert_close(out, ref, v, dtype, rows=None):
    out = np.asarray(out, dtype=np.float64)
    if rows is not None:
        out, ref = out[:, rows], ref[:, rows]
    bound = TOLERANCE[dtype] * float(np.abs(np.asarray(v, dtype=np.float64)).max())
    err = np.abs(out - ref)
    assert np.isfinite(out).all(), "non-finite output"
    assert err.max() <= bound, f"max error {err.max():.3g} > bound {bound:.3g}"


# ---- tier 1: CPU ----

CPU_CASES = [  # (B, Sq, Hq, Hkv, D, C)
    (1, 1, 20, 5, 128, 1), (2, 1, 8, 8, 64, 17), (1, 3, 32, 8, 128, 300), (3, 2, 8, 1, 64, 77),
    (1, 45, 20, 5, 128, 45), (2, 33, 8, 1, 64, 33),
    (1, 1, 12, 4, 256, 300), (2, 37, 12, 4, 256, 37), (1, 3, 6, 2, 256, 1000)]  # Falcon3: D = 256


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", CPU_CASES)
def test_cpu_matches_reference(rng, dtype, case, isa):
    B, Sq, Hq, Hkv, D, C = case
    q, k, v = make_qkv(rng, dtype, B, Sq, Hq, Hkv, D, C)
    out = poisoned(q.shape, dtype)
    assert bitnet_ffi.attention(q, k, v, out=out) is out
    assert_close(out, reference_attention(q, k, v), v, dtype)


@pytest.mark.cpu
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_ragged_seq_lens_scale_and_large_scores(rng, causal):
    B, Sq, Hq, Hkv, D, C = 4, 3, 8, 2, 64, 50
    q, k, v = make_qkv(rng, "float32", B, Sq, Hq, Hkv, D, C, spread=8.0)  # scores up to ~±100
    lens = [3, 50, 17, 29]
    out = bitnet_ffi.attention(q, k, v, causal=causal, scale=0.3, seq_lens=lens)
    assert_close(out, reference_attention(q, k, v, causal, 0.3, lens), v, "float32")


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B,Sq,lens", [(2, 1, [2000, 37]), (1, 2, None)])
def test_cpu_long_context_split_over_threads(rng, dtype, causal, B, Sq, lens, isa):
    """One or two (sequence, KV head, query tile) tasks over a long context: the CPU splits each
    task's keys into ranges (at least 2, with any number of threads) and merges them
    (cpu/attention.c); the short sequence leaves some ranges empty."""
    Hq, Hkv, D, C = 4, 1, 64, 2000
    q, k, v = make_qkv(rng, dtype, B, Sq, Hq, Hkv, D, C, spread=3.0)
    out = poisoned(q.shape, dtype)
    bitnet_ffi.attention(q, k, v, causal=causal, seq_lens=lens, out=out)
    assert_close(out, reference_attention(q, k, v, causal, None, lens), v, dtype)
    # a NaN value at key 1500 (a later range of sequence 0) reaches exactly its column there
    v[0, 1500, 0, 5] = np.nan
    bitnet_ffi.attention(q, k, v, causal=causal, seq_lens=lens, out=out)
    nan = np.isnan(out.astype(np.float32))
    assert nan[0, :, :, 5].all() and nan.sum() == Sq * Hq


@pytest.mark.cpu
def test_cpu_non_causal_decode_ignores_keys_past_seq_len(rng):
    q, k, v = make_qkv(rng, "bfloat16", 2, 1, 20, 5, 128, 40)
    first = bitnet_ffi.attention(q, k, v, causal=False, seq_lens=np.array([11, 40]))
    k[0, 11:], v[0, 11:] = np.inf, np.nan   # past the length: never read
    again = bitnet_ffi.attention(q, k, v, causal=False, seq_lens=np.array([11, 40]))
    np.testing.assert_array_equal(first.view(np.uint16), again.view(np.uint16))


@pytest.mark.cpu
def test_cpu_workspace_size_is_zero():
    assert bitnet_ffi.attention_workspace_size(-1, 1, 1, 20, 5, 128, 4096) == 0
    assert bitnet_ffi.attention_workspace_size("cpu", 1, 1, 20, 5, 128, 4096) == 0


# ---- tiers 2 and 3: CUDA ----


def host64(t):
    return t.double().cpu().numpy()


def torch_sdpa(q, k, v, causal, seq_len=None):
    """torch SDPA on [B, S, H, D] tensors for one sequence length (keys cut to it)."""
    import torch
    import torch.nn.functional as F
    L = k.shape[1] if seq_len is None else seq_len
    Sq = q.shape[1]
    mask = None
    if causal:
        mask = torch.ones(Sq, L, dtype=torch.bool, device=q.device).tril(L - Sq)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k[:, :L].transpose(1, 2),
                                         v[:, :L].transpose(1, 2), attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.gpu_smoke
def test_gpu_smoke_decode(rng):
    import torch
    q, k, v = torch_inputs(rng, "bfloat16", 1, 1, 20, 5, 128, 100)
    out = bitnet_ffi.attention(q, k, v)
    torch.cuda.synchronize()
    assert_close(host64(out), reference_attention(host64(q), host64(k), host64(v)), host64(v),
                 "bfloat16")


GPU_DECODE_CASES = [  # (B, Sq, Hq, Hkv, D, C)
    (1, 1, 20, 5, 128, 1), (1, 1, 20, 5, 128, 17), (2, 1, 8, 8, 64, 1000), (1, 1, 32, 8, 128, 4096),
    (3, 1, 8, 1, 128, 4096), (1, 1, 20, 5, 128, 40000), (2, 4, 20, 5, 128, 1000),
    (2, 16, 8, 1, 64, 333), (1, 2, 32, 8, 64, 4096), (2, 5, 20, 5, 128, 300),
    (1, 8, 32, 4, 64, 2000), (1, 1, 8, 1, 64, 70000),  # the last: splits too long for a cluster
    # cluster splits of 9 and 20 tiles: 5 and 6 stages (4 above at C = 4096)
    (1, 1, 20, 5, 128, 9000), (1, 1, 16, 2, 64, 20000),
    # more (sequence, KV head) groups than half the SMs: split-KV with the merge kernel, not clusters
    (12, 1, 48, 8, 128, 2000),
    # 40 groups: clusters of 2-stage blocks, two per SM (sm_90)
    (8, 1, 20, 5, 128, 1000),
    # D = 256 (Falcon3: 12 / 4 heads): always the split path with its merge kernel
    (1, 1, 12, 4, 256, 1), (1, 1, 12, 4, 256, 4096), (3, 1, 12, 4, 256, 1000), (2, 5, 12, 4, 256, 300),
    (1, 1, 12, 4, 256, 40000), (1, 16, 8, 2, 256, 333), (8, 1, 12, 4, 256, 2000)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", GPU_DECODE_CASES)
def test_gpu_decode_matches_reference_and_sdpa(rng, dtype, case):
    import torch
    B, Sq, Hq, Hkv, D, C = case
    q, k, v = torch_inputs(rng, dtype, B, Sq, Hq, Hkv, D, C)
    out = torch.full_like(q, float("nan"))
    bitnet_ffi.attention(q, k, v, out=out)
    ref = reference_attention(host64(q), host64(k), host64(v))
    assert_close(host64(out), ref, host64(v), dtype)
    sdpa = torch_sdpa(q, k, v, True)
    assert_close(host64(sdpa), ref, host64(v), dtype)  # the anchor meets the same bound


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("C", [4096, 1000])
def test_gpu_decode_scores_rising_along_the_context(rng, dtype, C):
    """Keys scaled up along the context (1x to 7x), so that between a split's tiles its running max
    rises by more than the lazy step of the 4-tile cluster kernel (8 in log2 units: C = 4096 splits
    into 16 of 4 tiles) at some tiles and by less at others, where weights above 1 are summed."""
    import torch
    q, k, v = torch_inputs(rng, dtype, 1, 1, 20, 5, 128, C, spread=2.0)
    ramp = 1 + 6 * torch.arange(C, device="cuda", dtype=torch.float32) / C
    k = (k.float() * ramp[None, :, None, None]).to(k.dtype)
    out = torch.full_like(q, float("nan"))
    bitnet_ffi.attention(q, k, v, out=out)
    assert_close(host64(out), reference_attention(host64(q), host64(k), host64(v)), host64(v), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", [(1, 1000, 20, 5, 128), (2, 77, 8, 8, 64), (1, 4096, 32, 8, 128),
                                  (2, 300, 8, 1, 128), (1, 129, 20, 5, 64), (2, 4000, 8, 2, 64),
                                  (1, 1000, 12, 4, 256), (2, 77, 12, 4, 256), (1, 4096, 12, 4, 256),
                                  (1, 2001, 20, 5, 128), (3, 1000, 32, 8, 128)])
def test_gpu_prefill_matches_reference_and_sdpa(rng, dtype, case):
    """Each prefill kernel: 64- and 128-row blocks, D = 256, and on an H100 the wgmma kernel (D = 128
    with 128-row blocks for at least 90% of the SMs: L = 4096, 2001, 1000 with 20 heads and B = 3
    at 1000)."""
    import torch
    B, L, Hq, Hkv, D = case
    q, k, v = torch_inputs(rng, dtype, B, L, Hq, Hkv, D, L)
    out = torch.full_like(q, float("nan"))
    bitnet_ffi.attention(q, k, v, out=out)
    rows = np.unique(np.concatenate([np.arange(min(L, 70)), rng.integers(0, L, 60), [L - 1]]))
    ref = reference_attention(host64(q), host64(k), host64(v), rows=rows)
    assert torch.isfinite(out).all()
    assert_close(host64(out), ref, host64(v), dtype, rows=rows)
    sdpa = torch_sdpa(q, k, v, True)
    assert (out.float() - sdpa.float()).abs().max().item() <= 2 * TOLERANCE[dtype] * v.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("Sq", [1, 3, 100])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_ragged_matches_cpu_and_reference(rng, Sq, causal):
    import torch
    B, Hq, Hkv, D, C = 4, 20, 5, 128, 1500
    lens = [Sq, 1500, 777, Sq + 40]
    q, k, v = make_qkv(rng, "float16", B, Sq, Hq, Hkv, D, C, spread=3.0)
    cpu = bitnet_ffi.attention(q, k, v, causal=causal, seq_lens=lens)
    qg, kg, vg = (torch.from_numpy(x).cuda() for x in (q, k, v))
    gpu = bitnet_ffi.attention(qg, kg, vg, causal=causal, seq_lens=lens)
    ref = reference_attention(q, k, v, causal, None, lens)
    assert_close(host64(gpu), ref, v, "float16")
    assert_close(cpu, ref, v, "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("Hq,Hkv,lens", [(32, 8, [1500, 777]), (20, 5, [1100])])
def test_gpu_wide_prefill_ragged_matches_reference(rng, causal, Hq, Hkv, lens):
    """Grids wide enough for the wgmma kernel on an H100 (2 x 6 x 32 blocks of 128 rows, and 6 x 20,
    about one per SM), with sequences shorter than the cache, a prompt that is not a multiple of
    128 rows and, without the causal mask, keys past the rows."""
    import torch
    B, Sq, D, C = len(lens), 700, 128, 1500
    q, k, v = torch_inputs(rng, "bfloat16", B, Sq, Hq, Hkv, D, C)
    out = torch.full_like(q, float("nan"))
    bitnet_ffi.attention(q, k, v, causal=causal, seq_lens=lens, out=out)
    rows = np.unique(np.concatenate([np.arange(70), rng.integers(0, Sq, 40), [Sq - 1]]))
    ref = reference_attention(host64(q), host64(k), host64(v), causal, None, lens, rows)
    assert_close(host64(out), ref, host64(v), "bfloat16", rows=rows)


@pytest.mark.gpu
def test_gpu_wide_prefill_device_seq_len_out_of_range_gives_nan_for_that_sequence(rng):
    import torch
    B, Sq, Hq, Hkv, D, C = 2, 1024, 32, 8, 128, 1024
    q, k, v = torch_inputs(rng, "float16", B, Sq, Hq, Hkv, D, C)
    lens = torch.tensor([1024, 1023], dtype=torch.int32, device="cuda")  # 1023 < Sq: out of range
    out = bitnet_ffi.attention(q, k, v, seq_lens=lens)
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all()
    rows = np.unique(np.concatenate([np.arange(20), rng.integers(0, Sq, 20), [Sq - 1]]))
    ref = reference_attention(host64(q[:1]), host64(k[:1]), host64(v[:1]), rows=rows)
    assert_close(host64(out[:1]), ref, host64(v), "float16", rows=rows)


@pytest.mark.gpu
@pytest.mark.parametrize("Sq", [1, 3, 100])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_head_dim_256_ragged_matches_cpu_and_reference(rng, Sq, causal):
    """D = 256 on both backends with ragged lengths, decode (Sq 1, 3) and prefill (Sq 100)."""
    import torch
    B, Hq, Hkv, D, C = 3, 12, 4, 256, 700
    lens = [Sq, 700, Sq + 333]
    q, k, v = make_qkv(rng, "float16", B, Sq, Hq, Hkv, D, C, spread=3.0)
    cpu = bitnet_ffi.attention(q, k, v, causal=causal, seq_lens=lens)
    qg, kg, vg = (torch.from_numpy(x).cuda() for x in (q, k, v))
    out = torch.full_like(qg, float("nan"))
    bitnet_ffi.attention(qg, kg, vg, causal=causal, seq_lens=lens, out=out)
    ref = reference_attention(q, k, v, causal, None, lens)
    assert_close(host64(out), ref, v, "float16")
    assert_close(cpu, ref, v, "float16")


@pytest.mark.gpu
def test_gpu_bf16_matches_cpu(rng):
    import torch
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = make_qkv(rng, "bfloat16", 2, 2, 32, 8, 64, 600)
    cpu = bitnet_ffi.attention(q, k, v)
    to_gpu = (lambda x: torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16))
    gpu = bitnet_ffi.attention(to_gpu(q), to_gpu(k), to_gpu(v))
    assert ml_dtypes
    assert_close(host64(gpu), np.asarray(cpu, np.float64), v, "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (192, 24)])  # cluster merge; merge kernel (96 groups)
def test_gpu_device_seq_lens_out_of_range_give_nan_for_that_sequence_only(rng, Hq, Hkv):
    import torch
    for Sq in (1, 100):
        q, k, v = torch_inputs(rng, "bfloat16", 4, Sq, Hq, Hkv, 128, 300)
        lens = torch.tensor([300, 301, Sq - 1 if Sq > 1 else -5, 150], dtype=torch.int32,
                            device="cuda")
        out = bitnet_ffi.attention(q, k, v, seq_lens=lens)
        torch.cuda.synchronize()
        assert torch.isnan(out[1:3]).all()
        good = [0, 3]
        ref = reference_attention(host64(q[good]), host64(k[good]), host64(v[good]),
                                  seq_lens=[300, 150])
        assert_close(host64(out[good]), ref, host64(v), "bfloat16")


@pytest.mark.gpu
def test_gpu_device_array_and_cuda_graph_replay(rng):
    import torch
    B, Sq, Hq, Hkv, D, C = 2, 1, 20, 5, 128, 5000
    q, k, v = make_qkv(rng, "float16", B, Sq, Hq, Hkv, D, C)
    dq, dk, dv = (bitnet_ffi.DeviceArray.from_numpy(x) for x in (q, k, v))
    out = bitnet_ffi.attention(dq, dk, dv, seq_lens=[4000, 123])
    assert isinstance(out, bitnet_ffi.DeviceArray)
    assert_close(out.numpy(), reference_attention(q, k, v, seq_lens=[4000, 123]), v, "float16")

    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    lens = torch.tensor([10, 20], dtype=torch.int32, device="cuda")
    ws = torch.empty(bitnet_ffi.attention_workspace_size(0, B, Sq, Hq, Hkv, D, C),
                     dtype=torch.uint8, device="cuda")
    tout = torch.empty_like(tq)
    bitnet_ffi.attention(tq, tk, tv, seq_lens=lens, out=tout, workspace=ws)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bitnet_ffi.attention(tq, tk, tv, seq_lens=lens, out=tout, workspace=ws)
    for new_lens in ([4999, 1], [37, 5000]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        tout.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(host64(tout), reference_attention(q, k, v, seq_lens=new_lens), v, "float16")


@pytest.mark.gpu
def test_gpu_cluster_decode_first_call_inside_a_graph_capture(first_call_in_a_graph_capture):
    """The first cluster-path decode of a process may come inside a graph capture (the cluster
    sizes the device can place are looked up then): it captures, replays and matches the CPU. A
    fresh process, since the lookup happens once per process."""
    printed = first_call_in_a_graph_capture(
        "import numpy as np, bitnet_ffi\n"
        "rng = np.random.default_rng(5)\n"
        "q, k, v = (rng.standard_normal(s).astype(np.float16) for s in\n"
        "           ((1, 1, 20, 128), (1, 2000, 5, 128), (1, 2000, 5, 128)))\n"
        "qd, kd, vd = (bitnet_ffi.DeviceArray.from_numpy(x) for x in (q, k, v))\n"
        "out = bitnet_ffi.DeviceArray(q.shape, 'float16')\n"
        "ws = bitnet_ffi.DeviceArray((bitnet_ffi.attention_workspace_size(0, 1, 1, 20, 5, 128, 2000),), 'uint8')\n",
        "bitnet_ffi.attention(qd, kd, vd, out=out, workspace=ws, stream=stream)",
        "cpu = bitnet_ffi.attention(q, k, v)\n"
        "print(np.abs(out.numpy().astype(np.float64) - cpu).max(), np.abs(v).max())\n")
    diff, v_max = (float(x) for x in printed.split())
    assert diff <= TOLERANCE["float16"] * v_max
