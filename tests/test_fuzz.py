"""Property tests (hypothesis) of every op against the float64 / exact numpy references of the op
test files: shapes, dtypes, batch sizes and head counts drawn at random, values from tiny
(subnormal) to large magnitudes, and NaN / infinity in float inputs where the op's behaviour with
them is documented (docs/reliability.md, "Non-finite inputs"). Each test runs on the CPU (tier 1)
and on CUDA device 0 with torch tensors (tier 3), checked against the same reference.

Example counts come from the hypothesis profile (tests/conftest.py): HYPOTHESIS_PROFILE=ci (the
default, fast) or deep (the GPU machine). Run with --hypothesis-show-statistics to see them."""
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import bitnet_ffi as bn
from bitnet_ffi import _arrays

from reference import (ATTENTION_TOL, GATE_ATOL, GATE_TOL, RMSNORM_RTOL, ROPE_TOL,
                       assert_rmsnorm_bit_identical, check_gated, check_quantized, check_rmsnorm, cpu_isas,
                       float32_rule, make_attention_inputs, make_rmsnorm_inputs, ref_codes, ref_gemv,
                       ref_pack, ref_quantize_a8, ref_scales, reference_attention, reference_relu2_gate,
                       reference_rmsnorm, reference_rope, run_gated, run_rmsnorm, run_two_ops)

FLOATS = ("float32", "float16", "bfloat16")
GPU_FLOATS = ("float16", "bfloat16")  # attention and the layer glue run float32 on the CPU only
# Magnitudes (powers of ten) of ordinary values, and the factor that makes values subnormal.
EXPONENTS = {"float32": (-30.0, 30.0), "bfloat16": (-30.0, 30.0), "float16": (-2.0, 3.0)}
SUBNORMAL = {"float32": 1e-40, "bfloat16": 1e-40, "float16": 1e-6}
NON_FINITE = (math.nan, math.inf, -math.inf)
# The spacing of each dtype's subnormals: the absolute error of a result rounded there.
SUBNORMAL_STEP = {"float32": 2.0**-149, "float16": 2.0**-24, "bfloat16": 2.0**-133}

BACKENDS = [pytest.param("cpu", marks=pytest.mark.cpu), pytest.param("gpu", marks=pytest.mark.gpu)]


# ---------------------------------------------------------------- arrays on either backend


def to_backend(backend, a):
    """A copy of numpy array `a` where the op runs: numpy on the CPU, a torch tensor on cuda:0."""
    a = np.ascontiguousarray(a)
    if backend == "cpu":
        return a.copy()
    import torch
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).cuda().view(torch.bfloat16)
    return torch.from_numpy(a.copy()).cuda()


def to_numpy(a):
    if isinstance(a, np.ndarray):
        return a.copy()
    import torch
    if a.dtype == torch.bfloat16:
        return a.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return a.cpu().numpy()


def float_dtypes(backend, cpu_only_float32=False):
    return GPU_FLOATS if backend == "gpu" and cpu_only_float32 else FLOATS


def draw_floats(data, shape, dtype, exponents=None, subnormals=True, non_finite=False, label="x"):
    """Normal values times 10^e (e drawn once per array), some of them made subnormal, and up to
    two NaN / +-inf at drawn positions; returns an array of `dtype`."""
    low, high = exponents or EXPONENTS[dtype]
    seed = data.draw(st.integers(0, 2**32 - 1), label=f"{label} seed")
    exponent = data.draw(st.floats(low, high), label=f"{label} exponent")
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape) * 10.0 ** exponent
    if subnormals and data.draw(st.booleans(), label=f"{label} subnormals"):
        values = np.where(rng.random(shape) < 0.25, values / 10.0 ** exponent * SUBNORMAL[dtype],
                          values)
    values = values.astype(np.float32).astype(_arrays.numpy_dtype(dtype))
    if non_finite:
        flat = values.reshape(-1)
        for index, special in data.draw(st.lists(st.tuples(st.integers(0, flat.size - 1),
                                                           st.sampled_from(NON_FINITE)),
                                                 max_size=2), label=f"{label} non-finite"):
            flat[index] = special
    return values


def assert_ieee_close(got, ref, dtype, rtol, atol, special_ref=None):
    """Where the reference (or special_ref), rounded to `dtype`, is NaN or +-inf, got is the same;
    elsewhere |got - ref| <= rtol |ref| + atol + a subnormal step of `dtype` (the rounding of a
    result that lands among the subnormals)."""
    got = np.asarray(got, np.float64)
    special_ref = ref if special_ref is None else special_ref
    rounded = np.asarray(special_ref).astype(_arrays.numpy_dtype(dtype)).astype(np.float64)
    special = ~np.isfinite(rounded)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(rounded), "NaN positions")
    np.testing.assert_array_equal(got[special & ~np.isnan(got)],
                                  rounded[special & ~np.isnan(rounded)], "infinities")
    with np.errstate(invalid="ignore"):
        err = np.abs(got - ref)[~special]
        bound = np.broadcast_to(rtol * np.abs(ref) + atol + SUBNORMAL_STEP[dtype],
                                ref.shape)[~special]
    assert np.all(err <= bound), f"max excess {np.max(err - bound):.3g}"


@pytest.fixture
def cpu_isa_reset():
    yield
    bn.set_cpu_isa("auto")


def choose_isa(data, backend):
    if backend == "cpu":
        bn.set_cpu_isa(data.draw(st.sampled_from(cpu_isas()), label="isa"))


# ---------------------------------------------------------------- ternary ops


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_fuzz_quantize_a8(backend, data, cpu_isa_reset):
    """Finite rows: codes and scales exact. A row holding a NaN or +-inf: scale NaN and every
    code -128 (docs/weight_format.md), the other rows as if it were not there."""
    choose_isa(data, backend)
    dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
    N, K = data.draw(st.integers(1, 5), label="N"), 128 * data.draw(st.integers(1, 4), label="K/128")
    x = draw_floats(data, (N, K), dtype, non_finite=True)
    x_q, s = (to_numpy(a) for a in bn.quantize_a8(to_backend(backend, x)))
    x32 = x.astype(np.float32)
    special = ~np.isfinite(x32).all(axis=1)
    want_q, want_s = ref_quantize_a8(np.where(special[:, None], 0, x32))
    want_s[special] = np.nan
    want_q[special] = -128
    np.testing.assert_array_equal(s, want_s)
    np.testing.assert_array_equal(x_q, want_q)


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_fuzz_quantize_i2s(backend, data, cpu_isa_reset):
    """Finite w: scales within one float32 ulp of the float64 mean, codes exact. A NaN or +-inf
    anywhere: InvalidArgumentError naming the first one's [row, col]."""
    choose_isa(data, backend)
    dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
    M, K = data.draw(st.integers(1, 24), label="M"), 128 * data.draw(st.integers(1, 3), label="K/128")
    segments = None
    if M > 1 and data.draw(st.booleans(), label="segmented"):
        cut = data.draw(st.integers(1, M - 1), label="cut")
        segments = [cut, M - cut]
    w = draw_floats(data, (M, K), dtype, non_finite=True)
    w32 = w.astype(np.float32)
    finite = np.isfinite(w32)
    if not finite.all():
        row, col = np.argwhere(~finite)[0]
        with pytest.raises(bn.InvalidArgumentError, match=rf"w\[{row}, {col}\] is -?(nan|inf)"):
            bn.quantize_i2s(to_backend(backend, w), row_segments=segments)
        return
    tw = bn.quantize_i2s(to_backend(backend, w), row_segments=segments)
    scales, codes = to_numpy(tw.scales), to_numpy(tw.unpack())
    want = ref_scales(w32, segments)
    assert np.all(np.abs(scales - want) <= np.spacing(want))
    np.testing.assert_array_equal(codes, ref_codes(w32, scales))
    np.testing.assert_array_equal(to_numpy(tw.packed), ref_pack(codes))


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_fuzz_pack_unpack(backend, data, cpu_isa_reset):
    choose_isa(data, backend)
    M, K = data.draw(st.integers(1, 40), label="M"), 128 * data.draw(st.integers(1, 4), label="K/128")
    w_q = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).integers(-1, 2, (M, K),
                                                                             dtype=np.int8)
    tw = bn.pack_ternary(to_backend(backend, w_q), 1.0)
    np.testing.assert_array_equal(to_numpy(tw.packed), ref_pack(w_q))
    np.testing.assert_array_equal(to_numpy(tw.unpack()), w_q)


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_fuzz_gemv_w2a8(backend, data, cpu_isa_reset):
    """int32 exact; float32 = the float32 rule (IEEE: a NaN or infinite scale, or a zero x scale,
    gives what float32 arithmetic gives); float16 / bfloat16 that value rounded."""
    choose_isa(data, backend)
    M, N = data.draw(st.integers(1, 40), label="M"), data.draw(st.integers(1, 6), label="N")
    K = 128 * data.draw(st.integers(1, 4), label="K/128")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    w_q = rng.integers(-1, 2, (M, K), dtype=np.int8)
    x_q = rng.integers(-128, 128, (N, K), dtype=np.int8)
    if data.draw(st.booleans(), label="extreme activations"):
        x_q[:, :] = data.draw(st.sampled_from([-128, 127]), label="extreme")
    specials = [0.0, 1e-40, 3e38, *NON_FINITE]
    w_scales = draw_floats(data, (M,), "float32", (-3, 3), label="w_scales").astype(np.float32)
    x_scales = np.abs(draw_floats(data, (N,), "float32", (-1, 3), label="x_scales"))
    if data.draw(st.booleans(), label="special scale"):
        w_scales[0] = data.draw(st.sampled_from(specials), label="w_scale[0]")
        x_scales[-1] = data.draw(st.sampled_from(specials), label="x_scale[-1]")
    out_dtype = data.draw(st.sampled_from(("int32", "float32", "float16", "bfloat16")))
    tw = bn.pack_ternary(to_backend(backend, w_q), to_backend(backend, w_scales))
    y = to_numpy(bn.gemv_w2a8(tw, to_backend(backend, x_q), to_backend(backend, x_scales),
                              out_dtype=out_dtype))
    with np.errstate(all="ignore"):
        dot, _ = ref_gemv(w_q, w_scales, x_q, x_scales)
    if out_dtype == "int32":
        np.testing.assert_array_equal(y, dot)
        return
    with np.errstate(all="ignore"):
        want = float32_rule(dot, w_scales, x_scales).astype(_arrays.numpy_dtype(out_dtype))
    np.testing.assert_array_equal(np.isnan(y.astype(np.float32)), np.isnan(want.astype(np.float32)))
    np.testing.assert_array_equal(y[~np.isnan(want.astype(np.float32))],
                                  want[~np.isnan(want.astype(np.float32))])


# ---------------------------------------------------------------- RMSNorm


# y = (v * w) * r in float32: where v * w is subnormal its rounding (up to 2^-150) is scaled by
# r = 1 / RMS, then y is rounded to the dtype (a step of its subnormal grid, SUBNORMAL_STEP): the
# absolute part of the bound. test_rmsnorm's ATOL assumes one rounding.


def check_ordinary_rows(variant, got, x, weight, eps, residual):
    y_ref, residual_ref = reference_rmsnorm(x, weight, eps, residual if "add" in variant else None)
    if residual_ref is not None:
        np.testing.assert_array_equal(got["residual"].view(np.uint8), residual_ref.view(np.uint8))
    if "y" in got:
        v = (residual_ref if residual_ref is not None else x).astype(np.float64)
        r = 1 / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
        err = np.abs(got["y"].astype(np.float64) - y_ref)
        bound = (RMSNORM_RTOL[x.dtype.name] * np.abs(y_ref) + SUBNORMAL_STEP[x.dtype.name]
                 + 2.0**-150 * r)
        assert np.all(err <= bound), f"y: max excess {np.nanmax(err - bound):.3g}"
    if "y_q" in got:
        check_quantized(got["y_q"], got["scales"], y_ref)


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_fuzz_rmsnorm(backend, data):
    """Finite rows against the float64 reference (the bounds of test_rmsnorm). A row whose
    normalized values (x, or the stored residual) hold a NaN: y all NaN. A row with +-inf and no
    NaN: y NaN at the infinities and 0 elsewhere. Either way scale NaN and codes all -128."""
    dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
    variant = data.draw(st.sampled_from(("norm", "add", "quant", "add_quant_y")), label="variant")
    T, H = data.draw(st.integers(1, 6), label="T"), data.draw(st.integers(1, 600), label="H")
    eps = data.draw(st.sampled_from([0.0, 1e-6, 1e-5, 1e-2]), label="eps")
    x = draw_floats(data, (T, H), dtype, non_finite=True)
    residual = draw_floats(data, (T, H), dtype, non_finite=True, label="residual")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="weight seed"))
    weight = (rng.choice([-1.0, 1.0], H) * rng.uniform(0.25, 2.0, H)).astype(x.dtype)  # never 0
    got = run_rmsnorm(variant, x, weight, eps, residual, lambda a: to_backend(backend, a), to_numpy)
    v = x.astype(np.float32)
    if "add" in variant:
        with np.errstate(invalid="ignore", over="ignore"):  # inf + -inf, float16 overflow
            v = (residual.astype(np.float32) + v).astype(x.dtype).astype(np.float32)
    nan_rows, inf_rows = np.isnan(v).any(axis=1), np.isinf(v).any(axis=1) & ~np.isnan(v).any(axis=1)
    ordinary = ~(nan_rows | inf_rows)
    # With eps = 0, a row whose RMS is in [2^-128, 2^-126) holds subnormal values whose products
    # v * w round on the subnormal grid, an error that 1 / RMS (up to 2^128) magnifies past the
    # bound. Under 2^-128 the row is normalized as v * 2^64, exactly (docs/rmsnorm.md,
    # test_rmsnorm_of_tiny_rows_with_eps_0). An all-zero row is 0/0.
    v64 = np.nan_to_num(v.astype(np.float64), posinf=0.0, neginf=0.0)
    rms = np.sqrt(np.mean(v64 * v64, axis=1))
    ordinary &= (rms >= 2.0**-126) | ((rms < 2.0**-128) & (rms > 0)) | (eps > 0)
    note(f"rows: {ordinary.sum()} ordinary, {nan_rows.sum()} with NaN, {inf_rows.sum()} with inf")
    if ordinary.any():
        check_ordinary_rows(variant, {k: a[ordinary] for k, a in got.items()}, x[ordinary], weight,
                            eps, residual[ordinary])
    if "y" in got:
        y = got["y"].astype(np.float32)
        assert np.isnan(y[nan_rows]).all()
        np.testing.assert_array_equal(np.isnan(y[inf_rows]), np.isinf(v[inf_rows]))
        assert np.all(y[inf_rows][~np.isinf(v[inf_rows])] == 0)
    if "y_q" in got:
        special = nan_rows | inf_rows
        assert (got["y_q"][special] == -128).all()
        assert np.isnan(got["scales"][special]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_fuzz_relu2_rmsnorm(backend, data):
    """relu2_rmsnorm_quantize is relu2_gate followed by rmsnorm_quantize on the same backend, for
    any input (subnormals, NaN and +-inf included): the codes and scales bit for bit, y bit for bit
    with any NaN matching any NaN (a NaN's payload is not specified). On the GPU, float32's gate
    runs on the CPU (the GPU relu2_gate has no float32): the same float32 products."""
    dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
    T, F = data.draw(st.integers(1, 5), label="T"), data.draw(st.integers(1, 300), label="F")
    eps = data.draw(st.sampled_from([0.0, 1e-6, 1e-5, 1e-2]), label="eps")
    with_y = data.draw(st.booleans(), label="with y")
    low, high = {"float16": (-0.6, 0.8)}.get(dtype, (-10.0, 10.0))  # relu2 is cubic
    gate_up = draw_floats(data, (T, 2 * F), dtype, (low, high), non_finite=True)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="weight seed"))
    weight = (rng.choice([-1.0, 1.0], F) * rng.uniform(0.25, 2.0, F)).astype(gate_up.dtype)
    def put(a):
        return to_backend(backend, a)
    got = run_gated(gate_up, weight, eps, with_y, put, to_numpy)
    want = run_two_ops(gate_up, weight, eps, with_y, put, to_numpy,
                       gate_on_cpu=backend == "gpu" and dtype == "float32")
    np.testing.assert_array_equal(got["y_q"], want["y_q"])
    np.testing.assert_array_equal(got["scales"].view(np.uint32), want["scales"].view(np.uint32))
    if with_y:
        y, y_want = got["y"].astype(np.float32), want["y"].astype(np.float32)
        np.testing.assert_array_equal(np.isnan(y), np.isnan(y_want), "NaN positions")
        same = ~np.isnan(y_want)
        np.testing.assert_array_equal(got["y"].view(np.uint8).reshape(T, F, -1)[same],
                                      want["y"].view(np.uint8).reshape(T, F, -1)[same])


# ---------------------------------------------------------------- attention and layer glue


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_fuzz_attention(backend, data, cpu_isa_reset):
    """Against the float64 reference (test_attention's bound, relative to max |v|). A NaN in q, k
    or v makes exactly the outputs that depend on it NaN, as in the reference: a query's head row
    for q, the head rows that see the key for k, one column of them for v."""
    choose_isa(data, backend)
    dtype = data.draw(st.sampled_from(float_dtypes(backend, True)), label="dtype")
    B, Sq = data.draw(st.integers(1, 3), label="B"), data.draw(st.integers(1, 5), label="Sq")
    Hkv, G = data.draw(st.integers(1, 3), label="Hkv"), data.draw(st.integers(1, 4), label="G")
    D = data.draw(st.sampled_from((64, 128)), label="D")
    causal = data.draw(st.booleans(), label="causal")
    C = data.draw(st.integers(Sq if causal else 1, 40), label="C")
    lens = None
    if data.draw(st.booleans(), label="seq_lens"):
        lens = data.draw(st.lists(st.integers(Sq if causal else 1, C), min_size=B, max_size=B))
    scale = data.draw(st.sampled_from([None, 0.01, 0.5]), label="scale")
    shape_q, shape_kv = (B, Sq, Hkv * G, D), (B, C, Hkv, D)
    q = draw_floats(data, shape_q, dtype, (-1, 0.5), subnormals=False, label="q")
    k = draw_floats(data, shape_kv, dtype, (-1, 0.5), subnormals=False, label="k")
    v = draw_floats(data, shape_kv, dtype, (-3, 3), label="v")
    where = data.draw(st.sampled_from(["none", "q", "k", "v"]), label="NaN in")
    if where != "none":
        target = {"q": q, "k": k, "v": v}[where]
        at = data.draw(st.integers(0, target.size - 1), label="NaN at")
        target.reshape(-1)[at] = np.nan
    if where == "v":  # which queries see the NaN's key
        b, j, kvh, d = np.unravel_index(at, shape_kv)
        L = C if lens is None else lens[b]
        seen_by = [i for i in range(Sq) if j < L and (not causal or j <= L - Sq + i)]
    out = to_numpy(bn.attention(*(to_backend(backend, a) for a in (q, k, v)), causal=causal,
                                scale=scale, seq_lens=lens))
    with np.errstate(invalid="ignore"):
        ref = reference_attention(q, k, np.nan_to_num(v.astype(np.float64), nan=0.0), causal,
                                  scale, lens)
    if where == "v":  # the reference's einsum would also multiply masked keys' 0 weight by NaN
        ref[b, seen_by, kvh * G:(kvh + 1) * G, d] = np.nan
    out64 = out.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(out64), np.isnan(ref), "NaN positions")
    finite_v = np.nan_to_num(v.astype(np.float64), nan=0.0)
    bound = ATTENTION_TOL[dtype] * np.abs(finite_v).max()
    err = np.abs(out64 - ref)[~np.isnan(ref)]
    assert err.size == 0 or err.max() <= bound, f"max error {err.max():.3g} > {bound:.3g}"


def largest_finite(a):
    a = a.astype(np.float64)
    return max(float(np.abs(a[np.isfinite(a)]).max(initial=0.0)), 1e-30)


# (B, Sq, Hq, Hkv, D, C, seq_lens), each through one GPU path: the decode kernel with one split, in a
# cluster (one block per SM, and 64 groups of blocks two per SM on sm_90), and with the merge kernel
# (128 groups), the last three also with several tiles per split
# (a split takes every n-th tile, and so does the redo that a hidden non-finite value triggers);
# the prefill kernel with 64-row and 128-row blocks, and the wgmma kernel on an H100, in several
# waves and in about one (the demo's 960-token prompt; the last three on the GPU only: they are
# large for a CPU test).
HIDDEN_KEY_CASES = [
    ((1, 2, 1, 1, 64, 3, None), "decode", BACKENDS),
    ((1, 4, 20, 5, 128, 1000, None), "decode-cluster", BACKENDS),
    ((1, 4, 20, 5, 128, 8000, None), "decode-cluster-long", BACKENDS),
    ((4, 3, 16, 16, 64, 2000, [2000, 777, 3, 1300]), "decode-cluster-shared-sms", BACKENDS),
    ((4, 3, 32, 32, 64, 200, [200, 77, 3, 130]), "decode-merge", BACKENDS),
    ((4, 3, 32, 32, 64, 2000, [2000, 777, 3, 1300]), "decode-merge-long", BACKENDS),
    ((2, 150, 4, 2, 128, 300, [300, 151]), "prefill", BACKENDS),
    ((1, 1100, 32, 8, 64, 1100, None), "prefill-wide", BACKENDS[1:]),
    ((1, 1500, 32, 8, 128, 1500, None), "prefill-wgmma", BACKENDS[1:]),
    ((1, 960, 20, 5, 128, 960, None), "prefill-wgmma-one-wave", BACKENDS[1:]),
]


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case,backend", [
    pytest.param(case, backend.values[0], marks=backend.marks, id=f"{name}-{backend.values[0]}")
    for case, name, backends in HIDDEN_KEY_CASES for backend in backends])
def test_attention_nonfinite_value_at_a_causally_hidden_key(rng, case, backend, dtype, value):
    """A KV cache holds whatever was written last: an inf or NaN value at a key the causal mask
    hides from a query must not reach that query's output (on the GPU the P V mma would add
    0 * NaN), while the queries that see it get a non-finite output in that column. Keys past
    seq_len (here with inf or NaN in k and v) reach no query. The finite outputs meet the
    reference with the non-finite values taken as 0."""
    B, Sq, Hq, Hkv, D, C, lens = case
    G = Hq // Hkv
    q, k, v = make_attention_inputs(rng, dtype, B, Sq, Hq, Hkv, D, C)
    seen = np.zeros(q.shape, bool)  # outputs that see a non-finite value
    for b in range(B):
        L = C if lens is None else lens[b]
        first = L - Sq + 1  # keys first .. L - 1 are hidden from query 0; query i sees up to L - Sq + i
        for j in {first, L - 1, *rng.integers(first, L, 3).tolist()}:
            kvh, d = rng.integers(Hkv), rng.integers(D)
            v[b, j, kvh, d] = value
            seen[b, j - first + 1:, kvh * G:(kvh + 1) * G, d] = True
        if L < C:  # past the sequence's end
            for a in (k, v):
                a[b, L + rng.integers(C - L), rng.integers(Hkv), rng.integers(D)] = value
    out = to_backend(backend, np.full(q.shape, 1000, q.dtype))  # poison: finite, far from any output
    bn.attention(*(to_backend(backend, a) for a in (q, k, v)), causal=True, seq_lens=lens, out=out)
    out = to_numpy(out).astype(np.float64)
    assert np.isfinite(out[~seen]).all(), "a hidden non-finite value reached a query"
    assert not np.isfinite(out[seen]).any(), "a visible non-finite value was lost"
    rows = np.unique(np.r_[0, 1, Sq - 2, Sq - 1, rng.integers(0, Sq, 12)]) if Sq > 4 else None
    finite_v = np.where(np.isfinite(v), v, 0).astype(np.float64)
    ref = reference_attention(q, np.where(np.isfinite(k), k, 0), finite_v, True, None, lens, rows)
    take = ~seen & ~np.isnan(ref)
    err = np.abs(out[take] - ref[take]).max()
    assert err <= ATTENTION_TOL[dtype] * np.abs(finite_v).max(), f"max error {err:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_fuzz_rope_append_kv(backend, data):
    """q and the k cache against the float64 rotation (NaN and +-inf propagate as IEEE arithmetic
    of the formula in the reference), v copied bit for bit, other cache rows untouched."""
    dtype = data.draw(st.sampled_from(float_dtypes(backend, True)), label="dtype")
    B, S = data.draw(st.integers(1, 3), label="B"), data.draw(st.integers(1, 4), label="S")
    Hq, Hkv = data.draw(st.integers(1, 4), label="Hq"), data.draw(st.integers(1, 3), label="Hkv")
    D = 2 * data.draw(st.integers(1, 40), label="D/2")
    big = data.draw(st.booleans(), label="large positions")
    positions = data.draw(st.lists(st.integers(0, 2000 if big else 30), min_size=B, max_size=B))
    C = max(positions) + S + data.draw(st.integers(0, 3), label="spare")
    theta = data.draw(st.sampled_from([10000.0, 500000.0, 1.5, 1e7]), label="theta")
    q = draw_floats(data, (B, S, Hq, D), dtype, (-2, 2), non_finite=True, label="q")
    k = draw_floats(data, (B, S, Hkv, D), dtype, (-2, 2), non_finite=True, label="k")
    v = draw_floats(data, (B, S, Hkv, D), dtype, label="v")
    cache = np.full((B, C, Hkv, D), np.nan, _arrays.numpy_dtype(dtype))
    qkv = np.concatenate([q, k, v], axis=2)
    qkvb, kc, vc = (to_backend(backend, a) for a in (qkv, cache, cache))
    q_after = to_numpy(bn.rope_append_kv(qkvb, kc, vc, positions, theta))
    k_cache, v_cache = to_numpy(kc), to_numpy(vc)
    # test_layer_glue's bound, relative to the largest finite value (the angle's float32 rounding
    # on the GPU, p * 2^-24 <= 1.2e-4 rad, stays well inside it)
    atol = 4 * ROPE_TOL[dtype] * largest_finite(q)
    katol = 4 * ROPE_TOL[dtype] * largest_finite(k)
    with np.errstate(invalid="ignore"):
        assert_ieee_close(q_after, reference_rope(q, positions, theta), dtype, 0, atol)
        k_rot = reference_rope(k, positions, theta)
    written = np.zeros((B, C), bool)
    for b, p in enumerate(positions):
        with np.errstate(invalid="ignore"):
            assert_ieee_close(k_cache[b, p:p + S], k_rot[b], dtype, 0, katol)
        np.testing.assert_array_equal(v_cache[b, p:p + S].view(np.uint8), v[b].view(np.uint8))
        written[b, p:p + S] = True
    assert np.isnan(k_cache[~written].astype(np.float32)).all()
    assert np.isnan(v_cache[~written].astype(np.float32)).all()


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_fuzz_relu2_gate(backend, data):
    """Against max(g, 0)^2 * u in float64; NaN and +-inf where the float32 formula
    (max(g, 0) * max(g, 0)) * u gives them (NaN gate -> NaN, -inf gate -> 0 * u, inf * 0 -> NaN,
    including a square that underflows to 0 times an infinite u)."""
    dtype = data.draw(st.sampled_from(float_dtypes(backend, True)), label="dtype")
    T, F = data.draw(st.integers(1, 5), label="T"), data.draw(st.integers(1, 300), label="F")
    # a third of the magnitude range, since the result is cubic; float16 stays below ~1.5e4
    low, high = {"float16": (-0.6, 0.8)}.get(dtype, (-10.0, 10.0))
    gate_up = draw_floats(data, (T, 2 * F), dtype, (low, high), non_finite=True)
    out = to_numpy(bn.relu2_gate(to_backend(backend, gate_up)))
    with np.errstate(invalid="ignore", over="ignore"):
        ref = reference_relu2_gate(gate_up)
        g32, u32 = np.split(gate_up.astype(np.float32), 2, axis=-1)
        relu = np.where(g32 < 0, np.float32(0), g32)
        assert_ieee_close(out, ref, dtype, GATE_TOL[dtype], GATE_ATOL[dtype],
                          special_ref=relu * relu * u32)


# ---------------------------------------------------------------- model glue


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_fuzz_gemv_bf16(backend, data):
    """Against the float64 product: each output within (K + 2) 2^-24 sum |x w| (float32
    accumulation) + K 2^-150 (products rounded in the subnormal range) plus the output rounding;
    NaN and +-inf as in the reference (IEEE)."""
    M, N = data.draw(st.integers(1, 40), label="M"), data.draw(st.integers(1, 4), label="N")
    K = 8 * data.draw(st.integers(1, 40), label="K/8")
    x_dtype = data.draw(st.sampled_from(("float32", "bfloat16")), label="x dtype")
    out_dtype = data.draw(st.sampled_from(("float32", "bfloat16")), label="out dtype")
    w = draw_floats(data, (M, K), "bfloat16", (-3, 3), non_finite=True, label="w")
    x = draw_floats(data, (N, K), x_dtype, (-3, 3), non_finite=True, label="x")
    y = to_numpy(bn.gemv_bf16(to_backend(backend, w), to_backend(backend, x),
                              out_dtype=out_dtype)).astype(np.float64)
    w64, x64 = w.astype(np.float64), x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = x64 @ w64.T
        magnitude = np.abs(x64) @ np.abs(w64).T
    rounding = 2.0**-8 if out_dtype == "bfloat16" else 2.0**-24
    assert_ieee_close(y, ref, out_dtype, 0, (K + 2) * 2.0**-24 * magnitude + K * 2.0**-150
                      + rounding * np.abs(np.nan_to_num(ref)))


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_fuzz_argmax(backend, data):
    """Exactly numpy.argmax: the first maximum, a NaN beating every number, ties included."""
    N, M = data.draw(st.integers(1, 5), label="N"), data.draw(st.integers(1, 3000), label="M")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    if data.draw(st.booleans(), label="ties"):
        x = rng.integers(-3, 4, (N, M)).astype(np.float32)
    else:
        x = draw_floats(data, (N, M), "float32")
    flat = x.reshape(-1)
    for index, special in data.draw(st.lists(st.tuples(st.integers(0, flat.size - 1),
                                                       st.sampled_from(NON_FINITE)), max_size=3)):
        flat[index] = special
    got = to_numpy(bn.argmax(to_backend(backend, x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=1))


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_fuzz_embedding(backend, data):
    """Rows copied bit for bit, whatever they hold (NaN payloads, infinities, subnormals)."""
    dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
    V, H = data.draw(st.integers(1, 60), label="V"), data.draw(st.integers(1, 70), label="H")
    N = data.draw(st.integers(1, 12), label="N")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    bits = rng.integers(0, 256, V * H * _arrays.ITEMSIZE[dtype], dtype=np.uint8)
    table = bits.view(_arrays.numpy_dtype(dtype)).reshape(V, H)
    ids = rng.integers(0, V, N).astype(np.int32)
    out = to_numpy(bn.embedding(to_backend(backend, table), to_backend(backend, ids)))
    np.testing.assert_array_equal(out.view(np.uint8), table[ids].view(np.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_fuzz_add_int32(backend, data):
    """x + delta with two's-complement wrap-around, for the whole int32 range."""
    n = data.draw(st.integers(1, 5000), label="n")
    delta = data.draw(st.integers(-2**31, 2**31 - 1), label="delta")
    x = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).integers(
        -2**31, 2**31, n, dtype=np.int64).astype(np.int32)
    xb = to_backend(backend, x)
    bn.add_int32(xb, delta)
    want = ((x.astype(np.int64) + delta + 2**31) % 2**32 - 2**31).astype(np.int32)
    np.testing.assert_array_equal(to_numpy(xb), want)


# With eps = 0 the CUDA backend takes its loop kernel (docs/rmsnorm.md): one element per thread
# (H = 5, not a multiple of the 16-byte vector), vectors, wide rows (H = 40000), and more rows than
# its grid (T = 8500 on an H100), so that blocks loop over rows. On the CPU they take the same code.
TINY_ROW_SHAPES = [(1, 5), (3, 2560), (2, 40000), (8500, 256)]


def with_tiny_rows(rng, a, rows):
    """a with `rows` replaced by values of magnitude 2^-130 .. 2^-134 and random signs: an RMS
    under 2^-128, so 1 / RMS is beyond float32 (subnormals of float32 and bfloat16)."""
    a = a.copy()
    shape = (len(rows), a.shape[1])
    a[rows] = (rng.choice([-1, 1], shape) * rng.uniform(1 / 16, 1, shape) * 2.0**-130).astype(a.dtype)
    return a


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["norm", "add", "quant", "add_quant_y"])
@pytest.mark.parametrize("T,H", TINY_ROW_SHAPES)
def test_rmsnorm_of_tiny_rows_with_eps_0(rng, backend, dtype, variant, T, H):
    """With eps = 0, a row whose RMS is under 2^-128 has a reciprocal beyond float32: it is
    normalized as v times 2^64, exactly (docs/rmsnorm.md). Its y, codes and scales, and the
    ordinary rows around it, meet the bounds of any row."""
    x, weight, residual = make_rmsnorm_inputs(rng, T, H, dtype)
    tiny = sorted({0, T // 2, T - 1})
    x, residual = with_tiny_rows(rng, x, tiny), with_tiny_rows(rng, residual, tiny)
    v = x if "add" not in variant else reference_rmsnorm(x, weight, 0.0, residual)[1]
    v64 = v[tiny].astype(np.float64)
    assert (np.sqrt(np.mean(v64 * v64, axis=1)) < 2.0**-128).all() and (v64 != 0).any(axis=1).all()
    got = run_rmsnorm(variant, x, weight, 0.0, residual, lambda a: to_backend(backend, a), to_numpy)
    check_rmsnorm(variant, got, x, weight, 0.0, residual)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,F", [(1, 5), (3, 2560), (8500, 256)])
def test_relu2_rmsnorm_of_tiny_rows_with_eps_0(rng, backend, T, F):
    """The gated kernels on tiny rows (relu2(gate) * up about 2^-132): bit for bit the two ops,
    relu2_gate then rmsnorm_quantize, and within the bounds of the float64 norm."""
    gate_up = rng.uniform(0.5, 2.0, (T, 2 * F)).astype(ml_dtypes.bfloat16)
    tiny = sorted({0, T // 2, T - 1})
    gate_up[tiny] = (gate_up[tiny].astype(np.float64) * 2.0**-44).astype(ml_dtypes.bfloat16)
    weight = rng.uniform(0.5, 1.5, F).astype(ml_dtypes.bfloat16)
    put = lambda a: to_backend(backend, a)
    got = run_gated(gate_up, weight, 0.0, True, put, to_numpy)
    assert_rmsnorm_bit_identical(got, run_two_ops(gate_up, weight, 0.0, True, put, to_numpy))
    check_gated(got, gate_up, weight, 0.0)
