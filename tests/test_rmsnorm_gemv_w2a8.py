"""rmsnorm_gemv_w2a8 and relu2_rmsnorm_gemv_w2a8 (bitnet_rmsnorm_gemv_w2a8): bit for bit the unfused
sequence on the same device (rmsnorm_quantize or relu2_rmsnorm_quantize, then gemv_w2a8, then the
residual add as bitnet_rmsnorm does it), and the float64 reference of the GEMV of those codes: the
CPU in tier 1, the GPU (torch tensors) in tier 3, bad input in Python (the C ABI's cases are in
test_bad_input_matrix.py).

Exactness: the int32 dots are integers; float32 y is float32(float32(dot) * w_scale) / x_scale, two
roundings (3e-7 relative of the float64 value); the residual add is one float32 add of two values
of the dtype, correctly rounded once to the dtype. The codes themselves are checked against the
float64 RMSNorm in test_rmsnorm.py."""
import ml_dtypes
import numpy as np
import pytest

import bitnet_ffi as bn
from bitnet_ffi import InvalidArgumentError, UnsupportedError

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}
OUT_DTYPES = ("int32", "float32", "float16", "bfloat16")


def make_problem(rng, T, M, K, dtype, gated):
    """x (or gate_up) [T, K or 2K], the norm weight [K], packed weights and their unpacked
    ternary values, a residual [T, M] of each float dtype."""
    width = 2 * K if gated else K
    row_scale = 10.0 ** rng.uniform(-1, 1, size=(T, 1))
    x = (rng.standard_normal((T, width)) * row_scale).astype(DTYPES[dtype])
    weight = (rng.choice([-1, 1], K) * rng.uniform(0.25, 2.0, K)).astype(DTYPES[dtype])
    w_q = rng.integers(-1, 2, (M, K), dtype=np.int8)
    w_scales = rng.uniform(0.01, 2.0, M).astype(np.float32)
    residual = {d: (rng.standard_normal((T, M)) * 4).astype(DTYPES[d]) for d in DTYPES}
    return x, weight, bn.pack_ternary(w_q, w_scales), w_q, w_scales, residual


def unfused(x, weight, tw, eps, gated, out_dtype, residual=None):
    """The sequence the fused op stands for, on x's device; also returns the codes and scales."""
    norm = bn.relu2_rmsnorm_quantize if gated else bn.rmsnorm_quantize
    x_q, x_s = norm(x, weight, eps=eps)
    y = bn.gemv_w2a8(tw, x_q, x_s, out_dtype=out_dtype)
    if residual is not None:  # bitnet_rmsnorm's residual add: float32, rounded once to the dtype
        y = residual + y if not isinstance(y, np.ndarray) else (
            residual.astype(np.float32) + y.astype(np.float32)).astype(y.dtype)
    return y, x_q, x_s


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def check_against_float64(y, x_q, x_s, w_q, w_scales, out_dtype):
    """y (no residual) against the float64 GEMV of the codes the norm gave."""
    dot = x_q.astype(np.int64) @ w_q.astype(np.int64).T
    if out_dtype == "int32":
        np.testing.assert_array_equal(y, dot)
        return
    y64 = dot * w_scales.astype(np.float64)[None, :] / x_s.astype(np.float64)[:, None]
    rtol = {"float32": 3e-7, "float16": 2.0**-11 + 3e-7, "bfloat16": 2.0**-8 + 3e-7}[out_dtype]
    np.testing.assert_allclose(np.asarray(y, np.float64), y64, rtol=rtol, atol=2.0**-24)


def fused(x, weight, tw, eps, gated, **kwargs):
    op = bn.relu2_rmsnorm_gemv_w2a8 if gated else bn.rmsnorm_gemv_w2a8
    return op(x, weight, tw, eps=eps, **kwargs)


# ---------------------------------------------------------------- tier 1: CPU


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", (False, True), ids=("norm", "gated"))
@pytest.mark.parametrize("T,M,K", [(1, 1, 128), (3, 7, 384), (2, 333, 2560), (1, 64, 6912)])
def test_cpu_matches_unfused_and_reference(rng, dtype, gated, T, M, K):
    x, weight, tw, w_q, w_scales, residual = make_problem(rng, T, M, K, dtype, gated)
    for out_dtype in OUT_DTYPES:
        out = np.full((T, M), 0x7F, dtype=bn._arrays.numpy_dtype(out_dtype))  # poison
        y = fused(x, weight, tw, 1e-5, gated, out_dtype=out_dtype, out=out)
        assert y is out
        want, x_q, x_s = unfused(x, weight, tw, 1e-5, gated, out_dtype)
        np.testing.assert_array_equal(bits(y), bits(want))
        check_against_float64(y, x_q, x_s, w_q, w_scales, out_dtype)
    for out_dtype in DTYPES:  # with the residual, also in place
        res = residual[out_dtype]
        want, _, _ = unfused(x, weight, tw, 1e-5, gated, out_dtype, residual=res)
        y = fused(x, weight, tw, 1e-5, gated, residual=res)
        assert y.dtype == res.dtype
        np.testing.assert_array_equal(bits(y), bits(want))
        in_place = res.copy()
        assert fused(x, weight, tw, 1e-5, gated, residual=in_place, out=in_place) is in_place
        np.testing.assert_array_equal(bits(in_place), bits(want))


@pytest.mark.cpu
@pytest.mark.parametrize("gated", (False, True), ids=("norm", "gated"))
def test_cpu_special_rows(rng, gated):
    """A zero row, a NaN, an inf, a tiny row with eps = 0 (the float64 path): the same as unfused."""
    x, weight, tw, *_ = make_problem(rng, 5, 9, 256, "float32", gated)
    x[0] = 0.0
    x[1, 3] = np.nan
    x[2, 7] = np.inf
    x[3] *= 1e-30
    for eps in (1e-5, 0.0):
        y = fused(x, weight, tw, eps, gated, out_dtype="int32")
        want, _, _ = unfused(x, weight, tw, eps, gated, "int32")
        np.testing.assert_array_equal(y, want)


@pytest.mark.cpu
def test_cpu_one_dimensional_input(rng):
    x, weight, tw, *_ = make_problem(rng, 1, 5, 128, "bfloat16", False)
    y = bn.rmsnorm_gemv_w2a8(x[0], weight, tw, out_dtype="int32")
    assert y.shape == (5,)
    np.testing.assert_array_equal(y, unfused(x, weight, tw, 1e-5, False, "int32")[0][0])


@pytest.mark.cpu
def test_python_bad_input(rng):
    x, weight, tw, _, _, residual = make_problem(rng, 2, 3, 128, "float32", False)
    res = residual["float32"]
    cases = [
        (lambda: bn.rmsnorm_gemv_w2a8(x, weight, "w"), InvalidArgumentError, "TernaryWeights"),
        (lambda: bn.rmsnorm_gemv_w2a8(x[:, :64].copy(), weight, tw), InvalidArgumentError, "x: expected"),
        (lambda: bn.relu2_rmsnorm_gemv_w2a8(x, weight, tw), InvalidArgumentError, "gate_up"),
        (lambda: bn.rmsnorm_gemv_w2a8(x, weight[:64], tw), InvalidArgumentError, "weight"),
        (lambda: bn.rmsnorm_gemv_w2a8(x, weight.astype(np.float16), tw), InvalidArgumentError,
         "weight: expected dtype float32"),
        (lambda: bn.rmsnorm_gemv_w2a8(x.astype(np.float64), weight, tw), InvalidArgumentError,
         "x: dtype float64"),
        (lambda: bn.rmsnorm_gemv_w2a8(x, weight, tw, out_dtype="int8"), InvalidArgumentError,
         "out_dtype"),
        (lambda: bn.rmsnorm_gemv_w2a8(x, weight, tw, residual=res, out_dtype="int32"),
         InvalidArgumentError, "float out_dtype"),
        (lambda: bn.rmsnorm_gemv_w2a8(x, weight, tw, residual=res, out_dtype="float16"),
         InvalidArgumentError, "residual: expected dtype float16"),
        (lambda: bn.rmsnorm_gemv_w2a8(x, weight, tw, residual=res[:1]), InvalidArgumentError,
         "residual: expected shape"),
        (lambda: bn.rmsnorm_gemv_w2a8(x, weight, tw, out=np.zeros((2, 4), np.float32)),
         InvalidArgumentError, "out: expected shape"),
        (lambda: bn.rmsnorm_gemv_w2a8(x, weight, tw, eps=-1.0), InvalidArgumentError, "eps"),
        (lambda: bn.rmsnorm_gemv_w2a8(x, weight, tw, eps=np.nan), InvalidArgumentError, "eps"),
        (lambda: bn.rmsnorm_gemv_w2a8(x, weight, tw, out=x.reshape(-1)[:6].reshape(2, 3)), InvalidArgumentError,
         "overlap"),
        (lambda: bn.rmsnorm_gemv_w2a8(np.ones((2, 3, 128), np.float32), weight, tw),
         InvalidArgumentError, "expected shape [K] or [N, K]"),
    ]
    read_only = np.zeros((2, 3), np.float32)
    read_only.flags.writeable = False
    cases.append((lambda: bn.rmsnorm_gemv_w2a8(x, weight, tw, out=read_only),
                  InvalidArgumentError, "read-only"))
    for call, error, fragment in cases:
        with pytest.raises(error, match=None) as info:
            call()
        assert fragment in str(info.value), (fragment, str(info.value))


# ---------------------------------------------------------------- tier 3: GPU


def to_gpu(torch, a):
    a = np.asarray(a)
    if a.dtype == DTYPES["bfloat16"]:
        return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(a).cuda()


def from_gpu(torch, t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(DTYPES["bfloat16"])
    return t.cpu().numpy()


def gpu_weights(torch, tw):
    return bn.TernaryWeights(torch.from_numpy(tw.packed).cuda(), torch.from_numpy(tw.scales).cuda())


def gpu_unfused(torch, x, weight, tw, eps, gated, out_dtype, residual=None):
    norm = bn.relu2_rmsnorm_quantize if gated else bn.rmsnorm_quantize
    x_q, x_s = norm(x, weight, eps=eps)
    y = bn.gemv_w2a8(tw, x_q, x_s, out_dtype=out_dtype)
    if residual is not None:  # bitnet_rmsnorm's own residual add, on the GPU
        copy = residual.clone()
        bn.add_rmsnorm(y, copy, torch.ones_like(y[0]))
        y = copy
    return y, x_q, x_s


# The 2B4T decode projections (qkv, o, gate|up, down), awkward M, long rows (K > 10240 takes the
# kernel's L2 prefetch; float32 K = 27648 is over the fused kernel's limit: UnsupportedError), and M
# large enough for two rounds of tiles (BLOCK_MAJOR_TAIL).
GPU_SHAPES = [(3840, 2560, False), (2560, 2560, False), (13824, 2560, False), (2560, 6912, True),
              (1, 128, False), (7, 384, True), (333, 12288, False), (37, 27648, True),
              (40000, 1024, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,gated", GPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", (1, 3))
def test_gpu_matches_unfused(rng, M, K, gated, dtype, T):
    torch = pytest.importorskip("torch")
    x, weight, tw, w_q, w_scales, residual = make_problem(rng, T, M, K, dtype, gated)
    x_g, weight_g, tw_g = to_gpu(torch, x), to_gpu(torch, weight), gpu_weights(torch, tw)
    if K * x.itemsize > 4096 * 16:  # rows bitnet_rmsnorm does not hold in registers
        out = torch.full((T, M), 7.0, device="cuda")
        with pytest.raises(UnsupportedError, match="over the GPU kernel's limit"):
            fused(x_g, weight_g, tw_g, 1e-5, gated, out=out)
        assert (out == 7.0).all()
        return
    for out_dtype in OUT_DTYPES:
        out = torch.full((T, M), 0x7F, dtype=getattr(torch, out_dtype), device="cuda")
        fused(x_g, weight_g, tw_g, 1e-5, gated, out_dtype=out_dtype, out=out)
        want, x_q, x_s = gpu_unfused(torch, x_g, weight_g, tw_g, 1e-5, gated, out_dtype)
        got = from_gpu(torch, out)
        np.testing.assert_array_equal(bits(got), bits(from_gpu(torch, want)))
        check_against_float64(got, x_q.cpu().numpy(), x_s.cpu().numpy(), w_q, w_scales, out_dtype)
    for out_dtype in ("float32", "bfloat16"):
        res = to_gpu(torch, residual[out_dtype])
        want, _, _ = gpu_unfused(torch, x_g, weight_g, tw_g, 1e-5, gated, out_dtype, residual=res)
        fused(x_g, weight_g, tw_g, 1e-5, gated, residual=res, out=res)  # in place
        np.testing.assert_array_equal(bits(from_gpu(torch, res)), bits(from_gpu(torch, want)))


@pytest.mark.gpu
@pytest.mark.parametrize("T", (600, 9000), ids=("narrow-rows", "warp-per-row"))
def test_gpu_many_tokens_follow_the_norms_layout(rng, T):
    """T >= 4 rows per SM (2 vectors per thread) and >= 64 per SM (a warp per row) change the order
    in which bitnet_rmsnorm sums a row; the fused kernel follows it."""
    torch = pytest.importorskip("torch")
    x, weight, tw, *_ = make_problem(rng, T, 5, 1024, "bfloat16", False)
    x_g, weight_g, tw_g = to_gpu(torch, x), to_gpu(torch, weight), gpu_weights(torch, tw)
    got = bn.rmsnorm_gemv_w2a8(x_g, weight_g, tw_g, out_dtype="int32")
    want, _, _ = gpu_unfused(torch, x_g, weight_g, tw_g, 1e-5, False, "int32")
    np.testing.assert_array_equal(got.cpu().numpy(), want.cpu().numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("gated", (False, True), ids=("norm", "gated"))
def test_gpu_special_rows(rng, gated):
    """A zero row, a NaN (the scale from the other products), an inf, a huge row (the float64
    sum): the same as unfused on the GPU."""
    torch = pytest.importorskip("torch")
    x, weight, tw, *_ = make_problem(rng, 5, 9, 2560, "float32", gated)
    x[0] = 0.0
    x[1, 3] = np.nan
    x[2, 7] = np.inf
    x[3] *= 1e25
    x_g, weight_g, tw_g = to_gpu(torch, x), to_gpu(torch, weight), gpu_weights(torch, tw)
    got = fused(x_g, weight_g, tw_g, 1e-5, gated, out_dtype="int32")
    want, _, _ = gpu_unfused(torch, x_g, weight_g, tw_g, 1e-5, gated, "int32")
    np.testing.assert_array_equal(got.cpu().numpy(), want.cpu().numpy())


@pytest.mark.gpu
def test_gpu_unsupported_cases_leave_out_untouched(rng):
    torch = pytest.importorskip("torch")
    x, weight, tw, *_ = make_problem(rng, 2, 3, 128, "bfloat16", False)
    x_g, weight_g, tw_g = to_gpu(torch, x), to_gpu(torch, weight), gpu_weights(torch, tw)
    out = torch.full((2, 3), 7.0, device="cuda")
    with pytest.raises(UnsupportedError, match="eps > 0"):
        bn.rmsnorm_gemv_w2a8(x_g, weight_g, tw_g, eps=0.0, out=out)
    unaligned = torch.empty(2 * 128 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(2, 128)
    unaligned.copy_(x_g)
    with pytest.raises(UnsupportedError, match="aligned to 16 bytes"):
        bn.rmsnorm_gemv_w2a8(unaligned, weight_g, tw_g, out=out)
    assert (out == 7.0).all()


# ---------------------------------------------------------------- the model's decode step


def decode_run(device, seed, fused, steps=5):
    """Batch-1 prefill and greedy decode of the TINY model: (tokens, logits) of each step."""
    from bitnet_ffi.model import TINY, Session, random_weights
    session = Session(random_weights(TINY, device, seed), 1, 24, device, fused=fused)
    prompt = np.random.default_rng(seed + 1).integers(0, TINY.vocab, (1, 7))
    run = [(session.prefill(prompt), session.download(session.prefill_logits).copy())]
    for _ in range(steps):
        tokens = session.decode()
        run.append((tokens, session.download(session.decode_buffers["logits"]).copy()))
    return run


def check_fused_decode(device, seed):
    fused, unfused = decode_run(device, seed, True), decode_run(device, seed, False)
    for (tokens, logits), (want_tokens, want_logits) in zip(fused, unfused):
        np.testing.assert_array_equal(tokens, want_tokens)
        np.testing.assert_array_equal(logits.view(np.uint32), want_logits.view(np.uint32))


@pytest.mark.cpu
def test_cpu_fused_decode_equals_unfused(rng):
    """Greedy tokens and logits, bit for bit, with the norms fused into the GEMVs or not."""
    check_fused_decode(bn._arrays.CPU, int(rng.integers(1 << 30)))


@pytest.mark.gpu
def test_gpu_fused_decode_equals_unfused(rng):
    check_fused_decode(0, int(rng.integers(1 << 30)))
