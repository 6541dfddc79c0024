"""The input RMSNorm inside the GEMVs around it (bitnet_ffi.fused_norm): the producer
(gemv_w2a8_add_norm_stats) against gemv_w2a8 then rmsnorm_quantize's residual add, bit for bit,
and its statistics against float64; the consumers (rmsnorm_gemv_w2a8 and its RoPE form) against
rmsnorm_quantize then gemv_w2a8 (bit for bit on the CPU, whose producer sums the squares in the
CPU norm's order) and against the float64 norm (a code moves only at a near-tie); the GPU against
the CPU; bad input. The model's use: test_models.py."""
import re

import numpy as np
import pytest

import bitnet_ffi as bn
from bitnet_ffi import _arrays
from bitnet_ffi.errors import ArgumentTypeError, InvalidArgumentError, UnsupportedError

from reference import (ROPE_TOL, SCALE_RTOL, reference_rmsnorm, reference_rmsnorm_quantize,
                       to_torch)

EPS = 1e-5
THETA = 500000.0
# (M, K) of a producer: 2B4T's o and down; a few rows; rows of several tiles' rounds on a GPU
PRODUCERS = [(2560, 2560), (2560, 6912), (96, 128), (13824, 384)]
# (M, K) of a consumer: 2B4T's QKV and gate|up; K at the GPU kernel's limit; a small one
CONSUMERS = [(3840, 2560), (13824, 2560), (100, 8192), (64, 128)]


def ternary(rng, M, K):
    return bn.pack_ternary(rng.integers(-1, 2, (M, K), dtype=np.int8),
                           rng.uniform(0.01, 0.05, M).astype(np.float32))


def activations(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(_arrays.numpy_dtype(dtype))


def norm_weight(rng, n, dtype):
    return (1.0 + 0.2 * rng.standard_normal(n)).astype(_arrays.numpy_dtype(dtype))


def int8_input(rng, K):
    return (rng.integers(-127, 128, (1, K), dtype=np.int8),
            np.array([rng.uniform(20.0, 60.0)], np.float32))


def bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def produced(rng, M, K, dtype, slots=1):
    """A row h after a producer (the o or down projection added to it) and its stats."""
    w, (x_q, x_s) = ternary(rng, M, K), int8_input(rng, K)
    h, nw = activations(rng, (1, M), dtype, 3.0), norm_weight(rng, M, dtype)
    stats = bn.gemv_w2a8_add_norm_stats(w, x_q, x_s, h, nw,
                                        stats=np.full((slots, 2), np.nan, np.float32))
    return h, nw, stats


def unfused_consumer(h, nw, w, out_dtype):
    x_q, x_s = bn.rmsnorm_quantize(h, nw, eps=EPS)
    return bn.gemv_w2a8(w, x_q, x_s, out_dtype=out_dtype)


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", PRODUCERS)
def test_cpu_producer_adds_as_the_norm_does_and_sums_its_statistics(rng, dtype, shape):
    M, K = shape
    w, (x_q, x_s) = ternary(rng, M, K), int8_input(rng, K)
    h, nw = activations(rng, (1, M), dtype, 3.0), norm_weight(rng, M, dtype)
    want = h.copy()
    bn.rmsnorm_quantize(bn.gemv_w2a8(w, x_q, x_s, out_dtype=dtype), nw, eps=EPS, residual=want)
    stats = np.full((3, 2), np.nan, np.float32)
    assert bn.gemv_w2a8_add_norm_stats(w, x_q, x_s, h, nw, stats=stats) is stats
    np.testing.assert_array_equal(bits(h), bits(want))
    v = h.astype(np.float64)[0]
    # a float32 sum of M squares in 16 partial sums: off by < M/16 * 2^-24 relatively
    np.testing.assert_allclose(stats[0, 0], (v * v).sum(), rtol=max(M / 16, 16) * 2.0**-24)
    assert stats[0, 1] == np.abs(h.astype(np.float32)[0] * nw.astype(np.float32)).max()
    np.testing.assert_array_equal(stats[1:], 0.0)


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", CONSUMERS)
def test_cpu_consumer_is_the_norm_then_the_gemv(rng, dtype, shape):
    """Bit for bit against rmsnorm_quantize then gemv_w2a8 (the CPU producer sums the squares as
    the CPU norm does), in every output dtype."""
    M, K = shape
    h, nw, stats = produced(rng, K, 128, dtype)
    w = ternary(rng, M, K)
    for out_dtype in ("int32", "float32", "bfloat16"):
        out = np.full((1, M), 7, _arrays.numpy_dtype(out_dtype))
        assert bn.rmsnorm_gemv_w2a8(h, nw, stats, w, eps=EPS, out_dtype=out_dtype, out=out) is out
        np.testing.assert_array_equal(bits(out), bits(unfused_consumer(h, nw, w, out_dtype)))


def codes_of(h, nw, stats, dtype="int32"):
    """The consumer's int8 codes (and 1 / x_scale): its GEMV with identity weights of scale 1."""
    K = h.shape[1]
    eye = bn.pack_ternary(np.eye(K, dtype=np.int8), np.ones(K, np.float32))
    codes = bn.rmsnorm_gemv_w2a8(h, nw, stats, eye, eps=EPS, out_dtype="int32")
    y = bn.rmsnorm_gemv_w2a8(h, nw, stats, eye, eps=EPS, out_dtype="float32")
    return codes[0], y[0]


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_consumer_codes_against_float64(rng, dtype):
    """The codes of the float64 norm (quantize_a8's rule) but at near-ties; the scale within the
    norm's float32 bound."""
    h, nw, stats = produced(rng, 1024, 256, dtype)
    codes, y = codes_of(h, nw, stats)
    y64, _ = reference_rmsnorm(h.astype(np.float64), nw, EPS)
    want, want_scale, near_tie = reference_rmsnorm_quantize(y64)
    mismatched = codes != want[0]
    assert not (mismatched & ~near_tie[0]).any()
    nonzero = codes != 0
    np.testing.assert_allclose(codes[nonzero] / y[nonzero], want_scale[0], rtol=4 * SCALE_RTOL)


@pytest.mark.cpu
def test_cpu_consumer_sums_every_slot(rng):
    """Statistics split over slots (exact halves) give the one slot's result; the max is the
    slots' max."""
    h, nw, stats = produced(rng, 512, 128, "bfloat16")
    w = ternary(rng, 96, 512)
    total, top = stats[0]
    split = np.array([[total / 2, top / 4], [total / 4, top], [total / 4, 0.0]], np.float32)
    np.testing.assert_array_equal(bn.rmsnorm_gemv_w2a8(h, nw, split, w, eps=EPS, out_dtype="int32"),
                                  bn.rmsnorm_gemv_w2a8(h, nw, stats, w, eps=EPS, out_dtype="int32"))


@pytest.mark.cpu
def test_cpu_non_finite_and_huge_rows_follow_the_norm(rng):
    """A NaN in h: the norm's NaN scale (codes -128, NaN outputs), as unfused. Values whose
    squares overflow float32: the float64 sum of squares, as the norm's."""
    w = ternary(rng, 64, 256)
    for fill in (np.nan, 1e30):
        h, nw, stats = produced(rng, 256, 128, "float32")
        if np.isnan(fill):
            h[0, 7] = fill
        else:
            h *= np.float32(fill)
        stats = bn.gemv_w2a8_add_norm_stats(ternary(rng, 256, 128), np.zeros((1, 128), np.int8),
                                            np.ones(1, np.float32), h, nw)
        np.testing.assert_array_equal(bn.rmsnorm_gemv_w2a8(h, nw, stats, w, eps=EPS),
                                      unfused_consumer(h, nw, w, "float32"))


def rope_caches(C, Hkv, D, dtype):
    cache = np.full((1, C, Hkv, D), np.nan, _arrays.numpy_dtype(dtype))
    return cache, cache.copy()


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_rope_consumer_is_the_consumer_then_rope(rng, dtype):
    Hq, Hkv, D, C, K = 4, 2, 64, 6, 256
    h, nw, stats = produced(rng, K, 128, dtype)
    w = ternary(rng, (Hq + 2 * Hkv) * D, K)
    k_cache, v_cache = rope_caches(C, Hkv, D, dtype)
    k_want, v_want = rope_caches(C, Hkv, D, dtype)
    q = bn.rmsnorm_gemv_w2a8_rope_append_kv(h, nw, stats, w, k_cache, v_cache, 3, eps=EPS,
                                            theta=THETA)
    qkv = bn.rmsnorm_gemv_w2a8(h, nw, stats, w, eps=EPS, out_dtype=dtype)
    q_want = bn.rope_append_kv(qkv.reshape(1, 1, -1, D), k_want, v_want, [3], theta=THETA)
    for got, want in ((q, q_want), (k_cache, k_want), (v_cache, v_want)):
        np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.cpu
def test_cpu_rejects_and_leaves_the_outputs(rng):
    h, nw, stats = produced(rng, 256, 128, "bfloat16")
    w = ternary(rng, 64, 256)
    w_o, (x_q, x_s) = ternary(rng, 256, 128), int8_input(rng, 128)
    out = np.full((1, 64), np.nan, np.float32)
    k_cache, v_cache = rope_caches(3, 1, 8, "bfloat16")
    w_qkv = ternary(rng, 32, 256)
    outputs = (h, stats, out, k_cache, v_cache)
    before = [a.tobytes() for a in outputs]
    blocked = bn.TernaryWeights(w.packed, w.scales, np.ones((64, 1), np.float32))
    bad = [
        (lambda: bn.rmsnorm_gemv_w2a8(h, nw, stats, w, eps=0.0, out=out), InvalidArgumentError,
         "eps must be finite and > 0"),
        (lambda: bn.rmsnorm_gemv_w2a8(h, nw, stats.astype(np.float16), w, out=out),
         InvalidArgumentError, "stats: expected dtype float32"),
        (lambda: bn.rmsnorm_gemv_w2a8(h, nw, stats[:0], w, out=out), InvalidArgumentError,
         "stats: expected at least one slot"),
        (lambda: bn.rmsnorm_gemv_w2a8(h, nw[:128], stats, w, out=out), InvalidArgumentError,
         "norm_weight: expected shape [256]"),
        (lambda: bn.rmsnorm_gemv_w2a8(h, nw, stats, w, out_dtype="int8"), InvalidArgumentError,
         "out_dtype must be one of"),
        (lambda: bn.rmsnorm_gemv_w2a8(h, nw, stats, blocked, out=out), UnsupportedError,
         "block_scales"),
        (lambda: bn.rmsnorm_gemv_w2a8(h, nw, stats, h, out=out), ArgumentTypeError,
         "w: expected TernaryWeights"),
        (lambda: bn.gemv_w2a8_add_norm_stats(w_o, x_q, x_s, h, nw.astype(np.float32), stats=stats),
         InvalidArgumentError, "norm_weight: expected dtype bfloat16"),
        (lambda: bn.gemv_w2a8_add_norm_stats(w_o, x_q, x_s, h[:, :128].copy(), nw, stats=stats),
         InvalidArgumentError, "h: expected shape [1, 256]"),
        (lambda: bn.rmsnorm_gemv_w2a8_rope_append_kv(h, nw, stats, w_qkv, k_cache, v_cache, 3),
         InvalidArgumentError, "position = 3 is outside the cache of C = 3"),
        (lambda: bn.rmsnorm_gemv_w2a8_rope_append_kv(h, nw, stats, w_qkv, k_cache, v_cache, 0,
                                                     theta=1.0),
         InvalidArgumentError, "theta must be finite and > 1"),
    ]
    for call, error, fragment in bad:
        with pytest.raises(error, match=re.escape(fragment)):
            call()
        assert [a.tobytes() for a in outputs] == before, fragment


# ---- tiers 2 and 3: CUDA ----


def to_gpu(a):
    return to_torch(np.ascontiguousarray(a))


def to_host(t, like):
    import torch
    if t.dtype == torch.bfloat16:
        return t.cpu().view(torch.int16).numpy().view(like.dtype)
    return t.cpu().numpy()


def gpu_weights(w):
    return bn.TernaryWeights(to_gpu(w.packed), to_gpu(w.scales))


def gpu_slots(stats):
    """CPU stats (one slot) padded with zero slots to the GPU's count: the same sums."""
    padded = np.zeros((bn.norm_stats_slots(0), 2), np.float32)
    padded[:len(stats)] = stats
    return to_gpu(padded)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", PRODUCERS)
def test_gpu_producer_against_the_cpu(rng, dtype, shape):
    """h bit for bit; the slots' sum within float32 rounding of the CPU's, the max exact, every
    slot written (the ones past the grid zero)."""
    import torch
    M, K = shape
    w, (x_q, x_s) = ternary(rng, M, K), int8_input(rng, K)
    h, nw = activations(rng, (1, M), dtype, 3.0), norm_weight(rng, M, dtype)
    th = to_gpu(h)
    stats = torch.full((bn.norm_stats_slots(0), 2), float("nan"), device="cuda")
    bn.gemv_w2a8_add_norm_stats(gpu_weights(w), to_gpu(x_q), to_gpu(x_s), th, to_gpu(nw),
                                stats=stats)
    want = bn.gemv_w2a8_add_norm_stats(w, x_q, x_s, h, nw)
    got = stats.cpu().numpy()
    np.testing.assert_array_equal(bits(to_host(th, h)), bits(h))
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got[:, 0].sum(dtype=np.float64), want[0, 0],
                               rtol=max(M / 16, 16) * 2.0**-24)
    assert got[:, 1].max() == want[0, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", CONSUMERS)
def test_gpu_consumer_equals_the_cpu_on_the_same_stats(rng, dtype, shape):
    M, K = shape
    h, nw, stats = produced(rng, K, 128, dtype)
    w = ternary(rng, M, K)
    tw, th, tn, ts = gpu_weights(w), to_gpu(h), to_gpu(nw), gpu_slots(stats)
    for out_dtype in ("int32", "float32", "bfloat16"):
        got = bn.rmsnorm_gemv_w2a8(th, tn, ts, tw, eps=EPS, out_dtype=out_dtype)
        want = bn.rmsnorm_gemv_w2a8(h, nw, stats, w, eps=EPS, out_dtype=out_dtype)
        np.testing.assert_array_equal(bits(to_host(got, want)), bits(want))


@pytest.mark.gpu
def test_gpu_consumer_sums_squares_again_where_they_overflow(rng):
    """Squares beyond float32 (bfloat16 values near 1e30): the float64 sum of h's squares, as the
    CPU's, bit for bit."""
    h = (activations(rng, (1, 2560), "float32") * 1e30).astype(_arrays.numpy_dtype("bfloat16"))
    nw = norm_weight(rng, 2560, "bfloat16")
    v = h.astype(np.float32)[0]
    stats = np.array([[np.inf, np.abs(v * nw.astype(np.float32)).max()]], np.float32)
    w = ternary(rng, 512, 2560)
    got = bn.rmsnorm_gemv_w2a8(to_gpu(h), to_gpu(nw), gpu_slots(stats), gpu_weights(w), eps=EPS)
    want = bn.rmsnorm_gemv_w2a8(h, nw, stats, w, eps=EPS)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(to_host(got, want), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_rope_consumer_equals_the_consumer_then_rope(rng, dtype):
    """Bit for bit against rmsnorm_gemv_w2a8 then rope_append_kv on the GPU; within RoPE's bound
    of the CPU's (cos and sin may differ by an ulp of float64)."""
    Hq, Hkv, D, C, K = 20, 5, 128, 9, 2560
    h, nw, stats = produced(rng, K, 128, dtype)
    w = ternary(rng, (Hq + 2 * Hkv) * D, K)
    tw, th, tn, ts = gpu_weights(w), to_gpu(h), to_gpu(nw), gpu_slots(stats)
    k_host, v_host = rope_caches(C, Hkv, D, dtype)
    k_cache, v_cache, k_want, v_want = (to_gpu(a) for a in (k_host, v_host, k_host, v_host))
    q = bn.rmsnorm_gemv_w2a8_rope_append_kv(th, tn, ts, tw, k_cache, v_cache, 4, eps=EPS,
                                            theta=THETA)
    qkv = bn.rmsnorm_gemv_w2a8(th, tn, ts, tw, eps=EPS, out_dtype=dtype)
    q_want = bn.rope_append_kv(qkv.reshape(1, 1, -1, D), k_want, v_want, [4], theta=THETA)
    for got, want in ((q, q_want), (k_cache, k_want), (v_cache, v_want)):
        np.testing.assert_array_equal(bits(to_host(got, k_host)), bits(to_host(want, k_host)))
    q_cpu = bn.rmsnorm_gemv_w2a8_rope_append_kv(h, nw, stats, w, k_host, v_host, 4, eps=EPS,
                                                theta=THETA)
    tol = ROPE_TOL[dtype]
    np.testing.assert_allclose(to_host(q, k_host).astype(np.float64), q_cpu.astype(np.float64),
                               rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_chain_codes_against_float64(rng, dtype):
    """The GPU producer's slots feeding the GPU consumer: the float64 norm's codes but at
    near-ties, the scale within the norm's float32 bound."""
    K = 2560
    w, (x_q, x_s) = ternary(rng, K, 6912), int8_input(rng, 6912)
    h, nw = activations(rng, (1, K), dtype, 3.0), norm_weight(rng, K, dtype)
    th, tn = to_gpu(h), to_gpu(nw)
    stats = bn.gemv_w2a8_add_norm_stats(gpu_weights(w), to_gpu(x_q), to_gpu(x_s), th, tn)
    eye = bn.pack_ternary(np.eye(K, dtype=np.int8), np.ones(K, np.float32))
    codes = to_host(bn.rmsnorm_gemv_w2a8(th, tn, stats, gpu_weights(eye), eps=EPS,
                                         out_dtype="int32"), h)[0]
    y = to_host(bn.rmsnorm_gemv_w2a8(th, tn, stats, gpu_weights(eye), eps=EPS), h)[0]
    y64, _ = reference_rmsnorm(to_host(th, h).astype(np.float64), nw, EPS)
    want, want_scale, near_tie = reference_rmsnorm_quantize(y64)
    assert not ((codes != want[0]) & ~near_tie[0]).any()
    nonzero = codes != 0
    np.testing.assert_allclose(codes[nonzero] / y[nonzero], want_scale[0], rtol=4 * SCALE_RTOL)
