"""RMSNorm and its fused variants (rmsnorm, add_rmsnorm, rmsnorm_quantize, relu2_rmsnorm_quantize)
against a float64 numpy reference: the CPU backend in tier 1, the CUDA backend (torch tensors and
DeviceArray) in tiers 2-3. relu2_rmsnorm_quantize is also compared bit for bit with relu2_gate
followed by rmsnorm_quantize on the same device."""

import math

import numpy as np
import pytest

import bitnet_ffi
from bitnet_ffi import DeviceArray, InvalidArgumentError, _ffi

from reference import (Buffers, RMSNORM_DTYPES as DTYPES, UINT, assert_close,
                       assert_rmsnorm_bit_identical as assert_bit_identical, check_gated, check_quantized,
                       check_rmsnorm as check, make_rmsnorm_inputs as make_inputs, raw_call,
                       reference_rmsnorm as reference, reference_rmsnorm_quantize as reference_quantize,
                       relu2_values, run_gated, run_rmsnorm as run, run_two_ops, torch_put)

CODES = {"float32": 0, "float16": 1, "bfloat16": 2}


VARIANTS = ("norm", "add", "quant", "add_quant_y")
WIDTHS = (1, 7, 2560, 6912, 8192)


def make_extreme(rng, T, H, dtype, magnitude):
    """x and residual with |values| in [magnitude / 2, magnitude], random signs (so that for
    float16 near its top, residual + x stays finite); weights as make_inputs."""
    x, weight, _ = make_inputs(rng, T, H, dtype)
    def values():
        return (rng.choice([-1, 1], (T, H)) * rng.uniform(0.5, 1.0, (T, H)) * magnitude).astype(DTYPES[dtype])
    return values(), weight, values()


def numpy_copy(a):
    return np.array(a, copy=True)


# ---- tier 1: the CPU backend ----

CPU_SHAPES = [(T, H) for H in WIDTHS for T in (1, 5)] + [(4096, 1), (4096, 7), (4096, 2560)]


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,H", CPU_SHAPES)
def test_cpu_matches_reference(rng, dtype, variant, T, H):
    x, weight, residual = make_inputs(rng, T, H, dtype)
    got = run(variant, x, weight, 1e-5, residual, numpy_copy, numpy_copy)
    check(variant, got, x, weight, 1e-5, residual)


# Magnitudes at the edges: float32 sums of squares that overflow (1e30; 1e18 over 8192 terms) or
# underflow (1e-30 with eps = 0) and are summed again in float64; float16 near its top and in its
# subnormals.
MAGNITUDES = [("float32", 1e30, 1e-5), ("float32", 1e18, 1e-5), ("float32", 1e-30, 1e-5),
              ("float32", 1e-30, 0.0), ("bfloat16", 1e30, 1e-5), ("bfloat16", 1e-30, 0.0),
              ("float16", 3e4, 1e-5), ("float16", 1e-6, 0.0)]


@pytest.mark.cpu
@pytest.mark.parametrize("dtype,magnitude,eps", MAGNITUDES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_cpu_extreme_magnitudes(rng, dtype, magnitude, eps, variant):
    x, weight, residual = make_extreme(rng, 3, 8192, dtype, magnitude)
    got = run(variant, x, weight, eps, residual, numpy_copy, numpy_copy)
    check(variant, got, x, weight, eps, residual)


@pytest.mark.cpu
def test_cpu_one_huge_value_among_small(rng):
    x, weight, residual = make_inputs(rng, 2, 2560, "float32")
    x[:, 17] = 3e37
    got = run("add_quant_y", x, weight, 1e-5, residual * 0, numpy_copy, numpy_copy)
    check("add_quant_y", got, x, weight, 1e-5, residual * 0)


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_in_place_and_allocated_outputs(rng, dtype):
    x, weight, residual = make_inputs(rng, 6, 2560, dtype)
    y_ref, _ = reference(x, weight, 1e-6)
    fresh = bitnet_ffi.rmsnorm(x, weight, eps=1e-6)
    assert fresh.dtype == x.dtype and fresh.shape == x.shape
    assert_close(fresh, y_ref, dtype)
    q, s = bitnet_ffi.rmsnorm_quantize(x, weight, eps=1e-6)
    assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (6,)
    check_quantized(q, s, y_ref)
    in_place = x.copy()
    assert bitnet_ffi.rmsnorm(in_place, weight, eps=1e-6, out=in_place) is in_place
    np.testing.assert_array_equal(in_place.view(UINT[dtype]), fresh.view(UINT[dtype]))


@pytest.mark.cpu
def test_cpu_leading_dimensions_are_rows(rng):
    x, weight, residual = make_inputs(rng, 6, 64, "bfloat16")
    flat = bitnet_ffi.rmsnorm(x, weight)
    shaped = bitnet_ffi.rmsnorm(x.reshape(2, 3, 64), weight)
    assert shaped.shape == (2, 3, 64)
    np.testing.assert_array_equal(shaped.reshape(6, 64).view(np.uint16), flat.view(np.uint16))
    q, s = bitnet_ffi.rmsnorm_quantize(x[0], weight)
    assert q.shape == (64,) and s.shape == ()


# ---- relu2_rmsnorm_quantize: the squared-ReLU gate fused into the norm ----

GATE_WIDTHS = (1, 7, 2560, 6912)


def make_gate_up(rng, T, F, dtype, magnitude=None):
    """gate_up [T, 2F] and weight [F] of `dtype`. Without `magnitude`: normal values, each row scaled
    by 10^U(-1, 1) (about half the gates negative, so v has zeros); with it: |values| in
    [magnitude / 2, magnitude], random signs. Weights as make_inputs."""
    if magnitude is None:
        gate_up, weight, _ = make_inputs(rng, T, 2 * F, dtype)
    else:
        gate_up = make_extreme(rng, T, 2 * F, dtype, magnitude)[0]
        # A positive gate in every row, so that no row of v is all zero: the extreme magnitudes
        # come with eps = 0, where such a row's norm is 0 / 0 (test_zero_row_with_eps_0_...).
        gate_up[:, 0] = np.abs(gate_up[:, 0])
    return gate_up, make_inputs(rng, 1, F, dtype)[1]


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_y", (False, True), ids=("quant", "quant_y"))
@pytest.mark.parametrize("T", (1, 5))
@pytest.mark.parametrize("F", GATE_WIDTHS)
def test_cpu_relu2_rmsnorm_matches_reference_and_two_ops(rng, dtype, with_y, T, F):
    gate_up, weight = make_gate_up(rng, T, F, dtype)
    got = run_gated(gate_up, weight, 1e-5, with_y, numpy_copy, numpy_copy)
    check_gated(got, gate_up, weight, 1e-5)
    assert_bit_identical(got, run_two_ops(gate_up, weight, 1e-5, with_y, numpy_copy, numpy_copy))


# gate_up magnitudes whose v = relu2(gate) * up (up to magnitude^3) has a float32 sum of squares
# that overflows (1e12) or underflows with eps = 0 (1e-10): summed again in float64 from v
# recomputed out of gate_up; float16 near its top (v up to 8000) and v among its subnormals.
GATED_MAGNITUDES = [("float32", 1e12, 1e-5), ("float32", 1e-10, 0.0), ("bfloat16", 1e12, 1e-5),
                    ("bfloat16", 1e-10, 0.0), ("float16", 20.0, 1e-5), ("float16", 0.02, 0.0)]


@pytest.mark.cpu
@pytest.mark.parametrize("dtype,magnitude,eps", GATED_MAGNITUDES)
def test_cpu_relu2_rmsnorm_extreme_magnitudes(rng, dtype, magnitude, eps):
    gate_up, weight = make_gate_up(rng, 3, 6912, dtype, magnitude)
    got = run_gated(gate_up, weight, eps, True, numpy_copy, numpy_copy)
    check_gated(got, gate_up, weight, eps)
    assert_bit_identical(got, run_two_ops(gate_up, weight, eps, True, numpy_copy, numpy_copy))


@pytest.mark.cpu
def test_cpu_relu2_rmsnorm_shapes_and_allocated_outputs(rng):
    gate_up, weight = make_gate_up(rng, 6, 64, "bfloat16")
    q, s = bitnet_ffi.relu2_rmsnorm_quantize(gate_up.reshape(2, 3, 128), weight)
    assert q.shape == (2, 3, 64) and q.dtype == np.int8
    assert s.shape == (2, 3) and s.dtype == np.float32
    flat_q, flat_s = bitnet_ffi.relu2_rmsnorm_quantize(gate_up, weight)
    np.testing.assert_array_equal(q.reshape(6, 64), flat_q)
    np.testing.assert_array_equal(s.reshape(6), flat_s)
    q1, s1 = bitnet_ffi.relu2_rmsnorm_quantize(gate_up[0], weight)
    assert q1.shape == (64,) and s1.shape == ()
    np.testing.assert_array_equal(q1, flat_q[0])


# ---- bad input ----


@pytest.mark.cpu
def test_abi_accepts_in_place(rng):
    b = Buffers(rng)
    expected, _ = reference(b.x, b.weight, 1e-5)
    status = raw_call(**b.args(y=b.ptr("x"), y_q=None, y_scales=None, residual=None))
    assert status == _ffi.lib().BITNET_OK
    assert_close(b.x, expected, "float32")


# ---- tiers 2 and 3: the CUDA backend ----


def torch_get(t):
    import torch
    torch.cuda.synchronize()
    if t.dtype == torch.bfloat16:
        return t.cpu().view(torch.int16).numpy().view(DTYPES["bfloat16"])
    return t.cpu().numpy()


def device_array_put(a):
    return DeviceArray.from_numpy(a)


def device_array_get(a):
    bitnet_ffi.device_synchronize(a.device)
    return a.numpy()


@pytest.mark.gpu_smoke
def test_gpu_smoke(rng):
    x, weight, residual = make_inputs(rng, 5, 2560, "bfloat16")
    got = run("add_quant_y", x, weight, 1e-5, residual, torch_put, torch_get)
    check("add_quant_y", got, x, weight, 1e-5, residual)


# Enough rows for a warp per row: 20000 of 256, and 9001 of 3072 (the widest row a warp holds in
# 16-bit dtypes: 12 vectors per lane).
# At T = 4096 the add variant is left out: add_quant_y covers the same path.
GPU_SHAPES = [(T, H) for H in WIDTHS for T in (1, 5, 4096)] + [(20000, 256), (9001, 3072)]
GPU_CASES = [(T, H, variant) for T, H in GPU_SHAPES for variant in VARIANTS
             if not (T == 4096 and variant == "add")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,variant", GPU_CASES)
def test_gpu_matches_reference_and_cpu(rng, dtype, variant, T, H):
    x, weight, residual = make_inputs(rng, T, H, dtype)
    got = run(variant, x, weight, 1e-5, residual, torch_put, torch_get)
    y_ref = check(variant, got, x, weight, 1e-5, residual)
    cpu = run(variant, x, weight, 1e-5, residual, numpy_copy, numpy_copy)
    check(variant, cpu, x, weight, 1e-5, residual)
    if "y_q" in got:  # GPU and CPU codes agree except at near-ties
        near_tie = reference_quantize(y_ref)[2]
        assert not np.any((got["y_q"] != cpu["y_q"]) & ~near_tie)


# Shapes for each kernel: a warp per row staged in shared memory (many rows of 2560), a block per
# row (few rows; 6912), and the two-pass loop for an unaligned width (7, 2561) and for a row too
# long for registers (40000).
KERNEL_SHAPES = [(600, 2560), (3, 2560), (3, 6912), (3, 7), (3, 2561), (3, 40000)]


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", KERNEL_SHAPES)
@pytest.mark.parametrize("dtype,magnitude,eps", MAGNITUDES)
@pytest.mark.parametrize("variant", ("norm", "add_quant_y"))
def test_gpu_extreme_magnitudes(rng, T, H, dtype, magnitude, eps, variant):
    x, weight, residual = make_extreme(rng, T, H, dtype, magnitude)
    got = run(variant, x, weight, eps, residual, torch_put, torch_get)
    check(variant, got, x, weight, eps, residual)


BACKENDS = (pytest.param("cpu", marks=pytest.mark.cpu), pytest.param("gpu", marks=pytest.mark.gpu))


def backend_io(backend):
    return (numpy_copy, numpy_copy) if backend == "cpu" else (torch_put, torch_get)


def assert_non_finite_row_codes(got, rows):
    """The rule for a row with a y that is not finite (docs/rmsnorm.md): scale NaN, codes -128."""
    assert np.isnan(got["scales"][rows]).all(), "scale of a row with a non-finite y"
    assert (got["y_q"][rows] == -128).all(), "codes of a row with a non-finite y"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,H", KERNEL_SHAPES + [(20000, 256), (3, 2560 - 8)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ("quant", "add_quant_y"))
def test_nan_weights_give_nan_scales(rng, backend, T, H, dtype, variant):
    """A NaN weight makes its products NaN in every row: y is NaN there and as the reference
    elsewhere, and every row's scale is NaN with codes -128, so the GEMV after it gives NaN rather
    than finite values. The GPU register kernels spot such a row by a NaN-propagating max."""
    x, weight, residual = make_inputs(rng, T, H, dtype)
    nan_cols = np.zeros(H, bool)
    nan_cols[rng.choice(H, size=max(1, H // 97), replace=False)] = True
    weight[nan_cols] = np.nan
    got = run(variant, x, weight, 1e-5, residual, *backend_io(backend))
    assert_non_finite_row_codes(got, slice(None))
    if "y" in got:
        assert np.isnan(got["y"][:, nan_cols].astype(np.float32)).all()
        keep = ~nan_cols
        y_ref, _ = reference(x, weight, 1e-5, residual if "add" in variant else None)
        assert_close(got["y"][:, keep], y_ref[:, keep], dtype)


# A width of each kernel kind at T = 3 (the block-per-row registers, the loop for an unaligned width
# and for a row too long for registers) and a warp per row (many rows).
NON_FINITE_SHAPES = [(3, 2560), (3, 2561), (3, 40000), (600, 2560)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,H", NON_FINITE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("special", (math.nan, math.inf, -math.inf), ids=("nan", "inf", "-inf"))
@pytest.mark.parametrize("variant", ("quant", "add_quant_y", "relu2"))
def test_non_finite_token_gives_nan_scale_and_leaves_the_others(rng, backend, T, H, dtype, special,
                                                                 variant):
    """One value of token 1 is NaN or +-inf (in x, or in the gate's up half): that token's scale is
    NaN and its codes -128, so gemv_w2a8 gives NaN for it; every other token is as without it."""
    put, get = backend_io(backend)
    row, col = 1, H // 3
    if variant == "relu2":
        gate_up, weight = make_gate_up(rng, T, H, dtype)
        gate_up[:, 0] = np.abs(gate_up[:, 0]) + 1  # no row all zero
        gate_up[row, H + col] = special            # up: NaN or +-inf times relu(gate)^2
        gate_up[row, col] = abs(gate_up[row, col]) + 1
        got = run_gated(gate_up, weight, 1e-5, True, put, get)
        check_gated(other_rows(got, row), np.delete(gate_up, row, axis=0), weight, 1e-5)
    else:
        x, weight, residual = make_inputs(rng, T, H, dtype)
        x[row, col] = special
        got = run(variant, x, weight, 1e-5, residual, put, get)
        check(variant, other_rows(got, row), np.delete(x, row, axis=0), weight, 1e-5,
              np.delete(residual, row, axis=0))
    assert_non_finite_row_codes(got, row)
    if "y" in got:
        assert not np.isfinite(got["y"][row].astype(np.float32)).all()
    if H % 128 == 0:  # what the codes feed: the W2A8 GEMV of every token
        tw = bitnet_ffi.pack_ternary(put(rng.integers(-1, 2, (64, H), dtype=np.int8)), 0.5)
        y = get(bitnet_ffi.gemv_w2a8(tw, put(got["y_q"]), put(got["scales"])))
        assert np.isnan(y[row]).all() and np.isfinite(np.delete(y, row, axis=0)).all()


def assert_zero_row_outputs(got, row):
    """Row `row` of a norm with eps = 0 over an all-zero row: y = 0 / 0 = NaN, as in the float64
    reference and torch; so, by the rule for a non-finite y, scale NaN and codes -128."""
    if "y" in got:
        assert np.isnan(got["y"][row].astype(np.float32)).all()
    if "y_q" in got:
        assert_non_finite_row_codes(got, row)


def other_rows(got, row):
    return {name: np.delete(a, row, axis=0) for name, a in got.items()}


@pytest.mark.parametrize("backend", (pytest.param("cpu", marks=pytest.mark.cpu),
                                     pytest.param("gpu", marks=pytest.mark.gpu)))
@pytest.mark.parametrize("H", (7, 2560))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ("norm", "add_quant_y", "relu2"))
def test_zero_row_with_eps_0_is_nan_and_leaves_the_other_rows(rng, backend, H, dtype, variant):
    """With eps = 0 a row whose values are all zero (x + residual = 0, or gates all <= 0 for the
    gated norm) has RMS 0: its outputs follow assert_zero_row_outputs, the other rows are as
    usual."""
    put, get = (numpy_copy, numpy_copy) if backend == "cpu" else (torch_put, torch_get)
    row = 1
    if variant == "relu2":
        gate_up, weight = make_gate_up(rng, 3, H, dtype)
        gate_up[:, 0] = np.abs(gate_up[:, 0])  # no other row all zero
        gate_up[row, :H] = -np.abs(gate_up[row, :H])
        got = run_gated(gate_up, weight, 0.0, True, put, get)
        assert_zero_row_outputs(got, row)
        check_gated(other_rows(got, row), np.delete(gate_up, row, axis=0), weight, 0.0)
        return
    x, weight, residual = make_inputs(rng, 3, H, dtype)
    x[row] = 0
    residual[row] = 0
    got = run(variant, x, weight, 0.0, residual, put, get)
    assert_zero_row_outputs(got, row)
    check(variant, other_rows(got, row), np.delete(x, row, axis=0), weight, 0.0,
          np.delete(residual, row, axis=0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,H", [(3, 2560), (1000, 1024), (2, 6912), (70, 40000), (33, 7)])
def test_gpu_device_array(rng, dtype, variant, T, H):
    x, weight, residual = make_inputs(rng, T, H, dtype)
    got = run(variant, x, weight, 1e-5, residual, device_array_put, device_array_get)
    check(variant, got, x, weight, 1e-5, residual)


def unaligned_torch_put(a):
    """A 16-bit array on the GPU starting 2 bytes past a 16-byte boundary."""
    import torch
    t = torch_put(a.reshape(-1))
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    flat[1:] = t
    return flat[1:].view(a.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_unaligned_rows_take_the_scalar_path(rng, variant):
    """Arrays starting 2 bytes past a 16-byte boundary: the vector kernels cannot be used."""
    x, weight, residual = make_inputs(rng, 9, 2560, "bfloat16")
    got = run(variant, x, weight, 1e-5, residual, unaligned_torch_put, torch_get)
    check(variant, got, x, weight, 1e-5, residual)


@pytest.mark.gpu
def test_gpu_allocated_outputs_on_a_side_stream(rng):
    import torch
    x, weight, residual = make_inputs(rng, 4096, 2560, "bfloat16")
    y_ref, res_ref = reference(x, weight, 1e-5, residual)
    xd, wd, rd = torch_put(x), torch_put(weight), torch_put(residual)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q, s = bitnet_ffi.rmsnorm_quantize(xd, wd, residual=rd)
        y = bitnet_ffi.rmsnorm(rd, wd)
    assert q.is_cuda and q.dtype == torch.int8 and s.shape == (4096,)
    side.synchronize()
    assert_close(torch_get(y), y_ref, "bfloat16")
    check_quantized(torch_get(q), torch_get(s), y_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(1000, 2560), (100, 6912), (5, 7)])
def test_gpu_in_place(rng, T, H):
    x, weight, _ = make_inputs(rng, T, H, "float16")
    y_ref, _ = reference(x, weight, 1e-5)
    xd, wd = torch_put(x), torch_put(weight)
    assert bitnet_ffi.rmsnorm(xd, wd, out=xd) is xd
    assert_close(torch_get(xd), y_ref, "float16")


# ---- relu2_rmsnorm_quantize on the GPU ----

@pytest.mark.gpu_smoke
def test_gpu_relu2_rmsnorm_smoke(rng):
    gate_up, weight = make_gate_up(rng, 5, 6912, "bfloat16")
    got = run_gated(gate_up, weight, 1e-5, True, torch_put, torch_get)
    check_gated(got, gate_up, weight, 1e-5)
    assert_bit_identical(got, run_two_ops(gate_up, weight, 1e-5, True, torch_put, torch_get))


# Each kernel: a warp per row (600 and 4096 rows of 2560), a block per row (few rows), the loop for
# unaligned widths (1, 7, 2561) and for a row too long for registers (40000).
GATED_GPU_SHAPES = [(T, F) for F in GATE_WIDTHS for T in (1, 5)] + [
    (600, 2560), (4096, 2560), (20000, 256), (3, 2561), (3, 40000), (33, 7)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_y", (False, True), ids=("quant", "quant_y"))
@pytest.mark.parametrize("T,F", GATED_GPU_SHAPES)
def test_gpu_relu2_rmsnorm_matches_reference_two_ops_and_cpu(rng, dtype, with_y, T, F):
    """Within the reference bounds; bit for bit the GPU's relu2_gate + rmsnorm_quantize (for
    float32 the gate runs on the CPU: the same float32 products); codes as the CPU's except at
    near-ties (the sums of squares are added in another order)."""
    gate_up, weight = make_gate_up(rng, T, F, dtype)
    got = run_gated(gate_up, weight, 1e-5, with_y, torch_put, torch_get)
    y_ref = check_gated(got, gate_up, weight, 1e-5)
    assert_bit_identical(got, run_two_ops(gate_up, weight, 1e-5, with_y, torch_put, torch_get,
                                          gate_on_cpu=dtype == "float32"))
    cpu = run_gated(gate_up, weight, 1e-5, with_y, numpy_copy, numpy_copy)
    near_tie = reference_quantize(y_ref)[2]
    assert not np.any((got["y_q"] != cpu["y_q"]) & ~near_tie)


@pytest.mark.gpu
@pytest.mark.parametrize("T,F", KERNEL_SHAPES)
@pytest.mark.parametrize("dtype,magnitude,eps", GATED_MAGNITUDES)
def test_gpu_relu2_rmsnorm_extreme_magnitudes(rng, T, F, dtype, magnitude, eps):
    """The float64 sums recompute v from gate_up in every kernel."""
    gate_up, weight = make_gate_up(rng, T, F, dtype, magnitude)
    got = run_gated(gate_up, weight, eps, True, torch_put, torch_get)
    check_gated(got, gate_up, weight, eps)
    assert_bit_identical(got, run_two_ops(gate_up, weight, eps, True, torch_put, torch_get,
                                          gate_on_cpu=dtype == "float32"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_relu2_rmsnorm_device_array_and_unaligned(rng, dtype):
    gate_up, weight = make_gate_up(rng, 9, 2560, dtype)
    got = run_gated(gate_up, weight, 1e-5, True, device_array_put, device_array_get)
    check_gated(got, gate_up, weight, 1e-5)
    if dtype != "float32":  # 2 bytes past a 16-byte boundary: the loop over global memory
        got = run_gated(gate_up, weight, 1e-5, True, unaligned_torch_put, torch_get)
        check_gated(got, gate_up, weight, 1e-5)
        # the two ops with v as misaligned, so that rmsnorm takes the same loop
        assert_bit_identical(got, run_two_ops(gate_up, weight, 1e-5, True, unaligned_torch_put,
                                              torch_get, gate_on_cpu=True))


@pytest.mark.gpu
def test_gpu_relu2_rmsnorm_on_a_side_stream_and_mixed_devices(rng):
    import torch
    gate_up, weight = make_gate_up(rng, 4096, 2560, "bfloat16")
    y_ref, _ = reference(relu2_values(gate_up), weight, 1e-5)
    gd, wd = torch_put(gate_up), torch_put(weight)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q, s = bitnet_ffi.relu2_rmsnorm_quantize(gd, wd)
    assert q.is_cuda and q.dtype == torch.int8 and q.shape == (4096, 2560) and s.shape == (4096,)
    side.synchronize()
    check_quantized(torch_get(q), torch_get(s), y_ref)
    with pytest.raises(InvalidArgumentError, match="different devices"):
        bitnet_ffi.relu2_rmsnorm_quantize(gd, weight)
