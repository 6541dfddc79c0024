"""gemv_w2a8_rope_append_kv, the QKV projection of one token fused with RoPE and the KV-cache
append: against the two ops it fuses (bit for bit: the CPU runs them; the GPU kernel shares their
arithmetic) and against float64 (the GEMV's rounding to the dtype, then RoPE's float32 rotation,
bounded by ROPE_TOL); the GPU against the CPU; bad input. The model's use: test_model.py."""
import re

import numpy as np
import pytest

import bitnet_ffi as bn
from bitnet_ffi import _arrays
from bitnet_ffi.errors import ArgumentTypeError, InvalidArgumentError, UnsupportedError

from reference import ROPE_TOL, cast, float32_rule, reference_rope, to_torch

THETA = 500000.0
# (Hq, Hkv, D, K, C): 2B4T's heads; the smallest D; D = 256; rows of 3 steps (the one-token
# kernel's L2 prefetch); more tiles than one round of warps (its block-major tail)
CASES = [(20, 5, 128, 2560, 40), (3, 1, 4, 128, 5), (4, 2, 256, 384, 9), (2, 1, 64, 6912, 3),
         (64, 8, 128, 256, 4)]


def make_case(rng, Hq, Hkv, D, K):
    """Ternary QKV weights (a scale per part) and one token's int8 input."""
    M = (Hq + 2 * Hkv) * D
    w_q = rng.integers(-1, 2, (M, K), dtype=np.int8)
    scales = np.repeat(rng.uniform(0.01, 0.05, 3), [Hq * D, Hkv * D, Hkv * D]).astype(np.float32)
    x_q = rng.integers(-127, 128, (1, K), dtype=np.int8)
    x_s = np.array([rng.uniform(20.0, 60.0)], np.float32)
    return bn.pack_ternary(w_q, scales), w_q, scales, x_q, x_s


def unfused(w, x_q, x_s, k_cache, v_cache, position, dtype, D):
    """The two ops the fused one replaces (the model's path for more than one sequence)."""
    qkv = bn.gemv_w2a8(w, x_q, x_s, out_dtype=dtype)
    return bn.rope_append_kv(qkv.reshape(1, 1, -1, D), k_cache, v_cache, [position], theta=THETA)


def nan_caches(C, Hkv, D, dtype):
    cache = np.full((1, C, Hkv, D), np.nan, _arrays.numpy_dtype(dtype))
    return cache, cache.copy()


def bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_cpu_fused_equals_the_two_ops_and_float64(rng, dtype, case):
    Hq, Hkv, D, K, C = case
    w, w_q, scales, x_q, x_s = make_case(rng, Hq, Hkv, D, K)
    position = int(rng.integers(0, C))
    k_cache, v_cache = nan_caches(C, Hkv, D, dtype)
    k_want, v_want = nan_caches(C, Hkv, D, dtype)
    q = np.full((1, 1, Hq, D), np.nan, k_cache.dtype)
    assert bn.gemv_w2a8_rope_append_kv(w, x_q, x_s, k_cache, v_cache, position, THETA,
                                       out=q) is q
    q_want = unfused(w, x_q, x_s, k_want, v_want, position, dtype, D)
    for got, want in ((q, q_want), (k_cache, k_want), (v_cache, v_want)):
        np.testing.assert_array_equal(bits(got), bits(want))
    # float64: the projection rounded to the dtype as the GEMV rounds it, then rotated exactly
    dot = x_q.astype(np.int64) @ w_q.astype(np.int64).T
    qkv = cast(float32_rule(dot, scales, x_s), dtype).astype(np.float64).reshape(1, 1, -1, D)
    rotated = reference_rope(qkv[:, :, :Hq + Hkv], [position], THETA)[0, 0]
    got = np.concatenate([q[0, 0], k_cache[0, position]]).astype(np.float64)  # the q heads, then k's
    head_size = np.abs(rotated).max(axis=-1, keepdims=True)
    np.testing.assert_array_less(np.abs(got - rotated),
                                 np.broadcast_to(4 * ROPE_TOL[dtype] * head_size, rotated.shape))
    np.testing.assert_array_equal(np.asarray(v_cache[0, position], np.float64),
                                  qkv[0, 0, Hq + Hkv:])
    others = np.arange(C) != position
    assert np.isnan(np.asarray(k_cache[0, others], np.float32)).all()
    assert np.isnan(np.asarray(v_cache[0, others], np.float32)).all()


@pytest.mark.cpu
def test_cpu_rejects_and_leaves_the_outputs(rng):
    w, _, _, x_q, x_s = make_case(rng, 2, 1, 8, 128)
    k_cache, v_cache = nan_caches(3, 1, 8, "bfloat16")
    q = np.full((1, 1, 2, 8), np.nan, k_cache.dtype)
    outputs = (q, k_cache, v_cache)
    before = [a.tobytes() for a in outputs]
    bad = [
        (lambda: bn.gemv_w2a8_rope_append_kv(w, x_q, x_s, k_cache, v_cache, 3, out=q),
         InvalidArgumentError, "position = 3 is outside the cache of C = 3"),
        (lambda: bn.gemv_w2a8_rope_append_kv(w, x_q, x_s, k_cache, v_cache, -1, out=q),
         InvalidArgumentError, "outside the cache"),
        (lambda: bn.gemv_w2a8_rope_append_kv(w, x_q, x_s, *nan_caches(3, 2, 8, "bfloat16"), 0),
         InvalidArgumentError, "32 rows are not Hq + 2 x 2 heads of D = 8"),
        (lambda: bn.gemv_w2a8_rope_append_kv(w, np.zeros((2, 128), np.int8), x_s, k_cache,
                                             v_cache, 0, out=q),
         InvalidArgumentError, "x_q: expected shape [1, 128]"),
        (lambda: bn.gemv_w2a8_rope_append_kv(w, x_q, x_s, k_cache, v_cache, 0,
                                             out=q[:, :, :1].copy()),
         InvalidArgumentError, "out"),
        (lambda: bn.gemv_w2a8_rope_append_kv(w, x_q, x_s, k_cache, v_cache, 0, theta=1.0, out=q),
         InvalidArgumentError, "theta must be finite and > 1"),
        (lambda: bn.gemv_w2a8_rope_append_kv(x_q, x_q, x_s, k_cache, v_cache, 0, out=q),
         ArgumentTypeError, "w: expected TernaryWeights"),
    ]
    for call, error, fragment in bad:
        with pytest.raises(error, match=re.escape(fragment)):
            call()
        assert [a.tobytes() for a in outputs] == before, fragment
    w256, _, _, x256, s256 = make_case(rng, 2, 1, 8, 256)
    blocked = bn.TernaryWeights(w256.packed, w256.scales, np.ones((32, 1), np.float32))
    with pytest.raises(UnsupportedError, match="block_scales"):
        bn.gemv_w2a8_rope_append_kv(blocked, x256, s256, k_cache, v_cache, 0, out=q)
    assert [a.tobytes() for a in outputs] == before
    # a head dim that is not a multiple of 4: the C check (D = 6, 4 heads of 6 = 24 rows)
    w6, _, _, x6, s6 = make_case(rng, 2, 1, 6, 128)
    k6, v6 = nan_caches(3, 1, 6, "bfloat16")
    with pytest.raises(InvalidArgumentError, match="must be a multiple of 4"):
        bn.gemv_w2a8_rope_append_kv(w6, x6, s6, k6, v6, 0)
    assert np.isnan(np.asarray(k6, np.float32)).all()


# ---- tiers 2 and 3: CUDA ----


def to_host(t, dtype):
    import torch
    if t.dtype == torch.bfloat16:
        return t.cpu().view(torch.int16).numpy().view(_arrays.numpy_dtype(dtype))
    return t.cpu().numpy()


def gpu_weights(w):
    import torch
    return bn.TernaryWeights(torch.from_numpy(w.packed).cuda(), torch.from_numpy(w.scales).cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_gpu_fused_equals_the_two_ops_on_the_gpu_and_the_cpu(rng, dtype, case):
    """Bit for bit against gemv_w2a8 then rope_append_kv on the GPU (the same kernels'
    arithmetic); within RoPE's bound of the CPU's (cos and sin may differ by an ulp of float64)."""
    import torch
    Hq, Hkv, D, K, C = case
    w, _, _, x_q, x_s = make_case(rng, Hq, Hkv, D, K)
    position = int(rng.integers(0, C))
    tw, tx, ts = gpu_weights(w), torch.from_numpy(x_q).cuda(), torch.from_numpy(x_s).cuda()
    k_host, v_host = nan_caches(C, Hkv, D, dtype)
    k_cache, v_cache, k_want, v_want = (to_torch(a) for a in (k_host, v_host, k_host, v_host))
    q = to_torch(np.full((1, 1, Hq, D), np.nan, k_host.dtype))
    pos = torch.tensor([position], dtype=torch.int32, device="cuda")
    assert bn.gemv_w2a8_rope_append_kv(tw, tx, ts, k_cache, v_cache, pos, THETA, out=q) is q
    q_want = unfused(tw, tx, ts, k_want, v_want, position, dtype, D)
    for got, want in ((q, q_want), (k_cache, k_want), (v_cache, v_want)):
        np.testing.assert_array_equal(bits(to_host(got, dtype)), bits(to_host(want, dtype)))
    q_cpu = bn.gemv_w2a8_rope_append_kv(w, x_q, x_s, k_host, v_host, position, THETA)
    tol = ROPE_TOL[dtype]
    np.testing.assert_allclose(to_host(q, dtype).astype(np.float64), q_cpu.astype(np.float64),
                               rtol=tol, atol=tol)
    np.testing.assert_allclose(to_host(k_cache, dtype).astype(np.float64),
                               k_host.astype(np.float64), rtol=tol, atol=tol)
    np.testing.assert_array_equal(bits(to_host(v_cache, dtype)), bits(v_host))


@pytest.mark.gpu
def test_gpu_device_position_out_of_range_writes_nothing(rng):
    import torch
    w, _, _, x_q, x_s = make_case(rng, 4, 2, 64, 256)
    tw, tx, ts = gpu_weights(w), torch.from_numpy(x_q).cuda(), torch.from_numpy(x_s).cuda()
    for position in (-1, 5):
        k_cache, v_cache = (to_torch(a) for a in nan_caches(5, 2, 64, "bfloat16"))
        q = torch.full((1, 1, 4, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
        pos = torch.tensor([position], dtype=torch.int32, device="cuda")
        bn.gemv_w2a8_rope_append_kv(tw, tx, ts, k_cache, v_cache, pos, out=q)
        torch.cuda.synchronize()
        assert q.isnan().all() and k_cache.isnan().all() and v_cache.isnan().all()
