"""RMSNorm and its fused variants (rmsnorm, add_rmsnorm, rmsnorm_quantize, relu2_rmsnorm_quantize)
against a float64 numpy reference: the CPU backend in tier 1, the CUDA backend (torch tensors and
DeviceArray) in tiers 2-3. relu2_rmsnorm_quantize is also compared bit for bit with relu2_gate
followed by rmsnorm_quantize on the same device."""
import math

import ml_dtypes
import numpy as np
import pytest

import bitnet_ffi
from bitnet_ffi import DeviceArray, InvalidArgumentError, _ffi

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}
CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
UINT = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}


def reference(x, weight, eps, residual=None):
    """float64 RMSNorm: (y [T, H] float64, the new residual as it must be stored, or None)."""
    new_residual = None
    if residual is not None:
        # One float32 add rounded once to the dtype is the correctly rounded sum (float32 carries
        # more than 2p + 2 bits for p = 8, 11), so the stored residual is exact: compared bit for bit.
        new_residual = (residual.astype(np.float32) + x.astype(np.float32)).astype(x.dtype)
        x = new_residual
    v = x.astype(np.float64)
    y = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * weight.astype(np.float64)
    return y, new_residual


def reference_quantize(y):
    """quantize_a8 applied to the float64 norm: (codes, float32 scales, mask of near-ties)."""
    scales = (127.0 / np.maximum(np.abs(y).max(axis=-1), 1e-5)).astype(np.float32)
    scaled = y * scales.astype(np.float64)[..., None]
    codes = np.clip(np.rint(scaled), -128, 127).astype(np.int8)
    near_tie = np.abs(scaled - np.floor(scaled) - 0.5) < TIE_BAND
    return codes, scales, near_tie


# |y - ref| <= RTOL * |ref| + ATOL. float32: a sum of squares adds at most H/16 terms per partial
# sum on the CPU (<= 512 here) and fewer on the GPU, so it is off by < 512 * 2^-24 = 3e-5
# relatively, halved by the square root, plus three roundings. The 16-bit dtypes add the final
# rounding to the dtype (2^-11, 2^-8). ATOL: half the dtype's smallest subnormal step.
RTOL = {"float32": 2e-5, "float16": 2.0**-11 + 2e-5, "bfloat16": 2.0**-8 + 2e-5}
ATOL = {"float32": 2.0**-150, "float16": 2.0**-25, "bfloat16": 2.0**-134}
# y * scale = 127 * v * w / max|v * w| exactly (the RMS factor cancels); float32 evaluation leaves
# about 7 roundings, <= 127 * 7 * 2^-24 = 5.3e-5 absolute. A code may differ from the reference by
# one only where the reference y * scale lies within TIE_BAND of a k + 0.5 boundary.
TIE_BAND = 2e-4
# The scales carry the RMS factor's error: the float32 bound.
SCALE_RTOL = RTOL["float32"]

VARIANTS = ("norm", "add", "quant", "add_quant_y")
WIDTHS = (1, 7, 2560, 6912, 8192)


def make_inputs(rng, T, H, dtype, magnitude=1.0):
    """x, weight, residual of `dtype`: normal values, each row scaled by 10^U(-1, 1) * magnitude,
    weights around 1 (none zero)."""
    row_scale = 10.0 ** rng.uniform(-1, 1, size=(T, 1)) * magnitude
    x = (rng.standard_normal((T, H)) * row_scale).astype(DTYPES[dtype])
    residual = (rng.standard_normal((T, H)) * row_scale).astype(DTYPES[dtype])
    weight = (rng.choice([-1, 1], H) * rng.uniform(0.25, 2.0, H)).astype(DTYPES[dtype])
    return x, weight, residual


def make_extreme(rng, T, H, dtype, magnitude):
    """x and residual with |values| in [magnitude / 2, magnitude], random signs (so that for
    float16 near its top, residual + x stays finite); weights as make_inputs."""
    x, weight, _ = make_inputs(rng, T, H, dtype)
    def values():
        return (rng.choice([-1, 1], (T, H)) * rng.uniform(0.5, 1.0, (T, H)) * magnitude).astype(DTYPES[dtype])
    return values(), weight, values()


def poisoned(shape, dtype):
    if dtype == "int8":
        return np.full(shape, 0x7F, np.int8)
    return np.full(shape, np.nan, DTYPES[dtype])


def run(variant, x, weight, eps, residual, put, get):
    """Runs one variant with poisoned outputs passed in; returns host copies of what it wrote."""
    dtype = x.dtype.name
    xd, wd = put(x), put(weight)
    res = put(residual.copy()) if "add" in variant else None
    y = put(poisoned(x.shape, dtype)) if variant != "quant" else None
    q = put(poisoned(x.shape, "int8")) if "quant" in variant else None
    s = put(poisoned(x.shape[:-1], "float32")) if "quant" in variant else None
    if variant == "norm":
        assert bitnet_ffi.rmsnorm(xd, wd, eps, out=y) is y
    elif variant == "add":
        assert bitnet_ffi.add_rmsnorm(xd, res, wd, eps, out=y) is y
    else:
        got = bitnet_ffi.rmsnorm_quantize(xd, wd, eps, residual=res, out=(q, s), y_out=y)
        assert got[0] is q and got[1] is s
    written = {"y": y, "residual": res, "y_q": q, "scales": s}
    return {name: get(a) for name, a in written.items() if a is not None}


def assert_close(got, ref, dtype, what="y"):
    got64 = got.astype(np.float64)
    err = np.abs(got64 - ref)
    bound = RTOL[dtype] * np.abs(ref) + ATOL[dtype]
    bad = ~(err <= bound)  # NaN (an unwritten element) counts as bad
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, np.inf, err / bound)), err.shape)
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} elements out of bounds, e.g. at "
                             f"{i}: got {got64[i]!r}, reference {ref[i]!r}")


def check_quantized(q, s, y_ref):
    """Scales within SCALE_RTOL; codes exact except near-ties, which may be off by one. Returns the
    number of near-tie codes that differ."""
    codes, scales, near_tie = reference_quantize(y_ref)
    assert np.all(np.abs(s.astype(np.float64) - scales) <= SCALE_RTOL * scales), "scales"
    diff = q.astype(np.int32) - codes
    assert np.all(np.abs(diff) <= 1), f"codes off by more than one: {np.argwhere(np.abs(diff) > 1)[:5]}"
    off = diff != 0
    assert not np.any(off & ~near_tie), f"codes differ away from ties at {np.argwhere(off & ~near_tie)[:5]}"
    return int(off.sum())


def check(variant, got, x, weight, eps, residual):
    """Checks every output of `variant` against the reference; returns the reference norm."""
    y_ref, res_ref = reference(x, weight, eps, residual if "add" in variant else None)
    if res_ref is not None:
        u = UINT[x.dtype.name]
        assert np.array_equal(got["residual"].view(u), res_ref.view(u)), "residual not exact"
    if "y" in got:
        assert_close(got["y"], y_ref, x.dtype.name)
    if "y_q" in got:
        off = check_quantized(got["y_q"], got["scales"], y_ref)
        print(f"{variant}: {off} near-tie codes differ by one")
    return y_ref


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


def relu2_values(gate_up):
    """v as bitnet_relu2_gate stores it: max(gate, 0)^2 * up in float32, rounded to the dtype (numpy
    float32 arithmetic is IEEE, and its casts round to nearest even: exact)."""
    g, u = np.split(gate_up.astype(np.float32), 2, axis=-1)
    relu = np.where(g < 0, np.float32(0), g)
    with np.errstate(over="ignore"):
        return (relu * relu * u).astype(gate_up.dtype)


def poisoned_outputs(gate_up, with_y, put):
    """Poisoned y_q [..., F], scales [...] and, with_y, y [..., F] of gate_up's dtype."""
    shape = gate_up.shape[:-1] + (gate_up.shape[-1] // 2,)
    return (put(poisoned(shape, "int8")), put(poisoned(shape[:-1], "float32")),
            put(poisoned(shape, gate_up.dtype.name)) if with_y else None)


def host_outputs(q, s, y, get):
    return {name: get(a) for name, a in {"y": y, "y_q": q, "scales": s}.items() if a is not None}


def run_gated(gate_up, weight, eps, with_y, put, get):
    """relu2_rmsnorm_quantize with poisoned outputs (y_out too when with_y); host copies of them."""
    q, s, y = poisoned_outputs(gate_up, with_y, put)
    got = bitnet_ffi.relu2_rmsnorm_quantize(put(gate_up), put(weight), eps, out=(q, s), y_out=y)
    assert got[0] is q and got[1] is s
    return host_outputs(q, s, y, get)


def run_two_ops(gate_up, weight, eps, with_y, put, get, gate_on_cpu=False):
    """relu2_gate then rmsnorm_quantize, both where `put` puts arrays; with gate_on_cpu the gate
    runs on the CPU and its output is uploaded (the GPU relu2_gate has no float32)."""
    v = put(bitnet_ffi.relu2_gate(gate_up)) if gate_on_cpu else bitnet_ffi.relu2_gate(put(gate_up))
    q, s, y = poisoned_outputs(gate_up, with_y, put)
    bitnet_ffi.rmsnorm_quantize(v, put(weight), eps, out=(q, s), y_out=y)
    return host_outputs(q, s, y, get)


def assert_bit_identical(got, want):
    assert set(got) == set(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), f"{name} differs from the two ops"


def check_gated(got, gate_up, weight, eps):
    """y and the codes against the float64 norm of v = relu2_gate(gate_up) as stored; returns
    the reference y."""
    assert "y_q" in got
    return check("relu2_quant", got, relu2_values(gate_up), weight, eps, None)


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

def raw_call(device=-1, dtype=0, T=4, H=8, x=None, residual=None, weight=None, eps=1e-5, y=None,
             y_q=None, y_scales=None):
    """bitnet_rmsnorm with raw pointers (cffi pointers or None for NULL); returns the status."""
    def cast(p, ctype="void *"):
        return _ffi.ffi.NULL if p is None else _ffi.ffi.cast(ctype, p)
    return _ffi.lib().bitnet_rmsnorm(device, dtype, T, H, cast(x), cast(residual), cast(weight), eps,
                                     cast(y), cast(y_q, "int8_t *"), cast(y_scales, "float *"),
                                     _ffi.ffi.NULL)


class Buffers:
    """Host arrays for T=4, H=8 float32 with poisoned outputs, and their pointers."""

    def __init__(self, rng):
        self.x, self.weight, self.residual = make_inputs(rng, 4, 8, "float32")
        self.residual_before = self.residual.copy()
        self.y, self.y_q, self.s = poisoned((4, 8), "float32"), poisoned((4, 8), "int8"), poisoned(4, "float32")

    def ptr(self, name, offset=0):
        a = getattr(self, name)
        return _ffi.ffi.cast("char *", a.ctypes.data) + offset

    def args(self, **changes):
        base = {"x": self.ptr("x"), "weight": self.ptr("weight"), "y": self.ptr("y"),
                "residual": self.ptr("residual"), "y_q": self.ptr("y_q"), "y_scales": self.ptr("s")}
        base.update(changes)
        return base

    def assert_untouched(self):
        assert np.isnan(self.y).all() and (self.y_q == 0x7F).all() and np.isnan(self.s).all()
        np.testing.assert_array_equal(self.residual, self.residual_before)


BAD_ABI_CASES = {
    "int8 dtype": (dict(dtype=3), "not float32"),
    "dtype outside the enum": (dict(dtype=99), "dtype 99"),
    "T = 0": (dict(T=0), "must be >= 1"),
    "negative H": (dict(H=-8), "must be >= 1"),
    "T*H overflows": (dict(T=2**62, H=8), "overflow"),
    "T*H*size overflows": (dict(T=2**60, H=4), "overflow"),
    "negative eps": (dict(eps=-1e-5), "eps"),
    "NaN eps": (dict(eps=math.nan), "eps"),
    "infinite eps": (dict(eps=math.inf), "eps"),
    "no output": (dict(y=None, y_q=None, y_scales=None), "both NULL"),
    "y_q without scales": (dict(y_scales=None), "go together"),
    "NULL x": (dict(x=None), "x is NULL"),
    "NULL weight": (dict(weight=None), "weight is NULL"),
    "misaligned x": (dict(x="x+2"), "aligned"),
    "misaligned scales": (dict(y_scales="s+1"), "aligned"),
    "y overlaps residual": (dict(y="residual+32"), "overlap"),
    "residual is x": (dict(residual="x"), "overlap"),
    "y_q inside x": (dict(y_q="x+4"), "overlap"),
    "not a device": (dict(device=-2), "neither the CPU"),
}


@pytest.mark.cpu
@pytest.mark.parametrize("case", BAD_ABI_CASES)
def test_abi_rejects_bad_arguments(rng, case):
    changes, message = BAD_ABI_CASES[case]
    b = Buffers(rng)
    args = {}
    for key, value in changes.items():
        if isinstance(value, str):  # "name+offset": a pointer into one of the buffers
            name, _, offset = value.partition("+")
            value = b.ptr(name, int(offset or 0))
        args[key] = value
    status = raw_call(**{k: v for k, v in {**b.args(), **args}.items()})
    assert status == _ffi.lib().BITNET_ERR_INVALID_ARGUMENT, (status, _ffi.last_error())
    assert message in _ffi.last_error()
    b.assert_untouched()


@pytest.mark.cpu
def test_abi_rejects_missing_gpu(rng):
    b = Buffers(rng)
    count = _ffi.ffi.new("int32_t *")
    _ffi.call("device_count", count, _ffi.ffi.NULL)
    status = raw_call(device=count[0], **b.args())
    assert status == _ffi.lib().BITNET_ERR_NO_DEVICE
    assert "does not exist" in _ffi.last_error()
    b.assert_untouched()


@pytest.mark.cpu
def test_abi_accepts_in_place(rng):
    b = Buffers(rng)
    expected, _ = reference(b.x, b.weight, 1e-5)
    status = raw_call(**b.args(y=b.ptr("x"), y_q=None, y_scales=None, residual=None))
    assert status == _ffi.lib().BITNET_OK
    assert_close(b.x, expected, "float32")


def python_bad_cases(rng):
    x, weight, residual = make_inputs(rng, 4, 16, "bfloat16")
    y = poisoned((4, 16), "bfloat16")
    return x, weight, residual, y, {
        "int8 x": (lambda: bitnet_ffi.rmsnorm(x.view(np.int8), weight, out=y), "dtype"),
        "weight dtype": (lambda: bitnet_ffi.rmsnorm(x, weight.astype(np.float32), out=y), "weight"),
        "weight length": (lambda: bitnet_ffi.rmsnorm(x, np.concatenate([weight, weight[:1]]), out=y),
                          r"weight: expected shape \[16\]"),
        "out dtype": (lambda: bitnet_ffi.rmsnorm(x, weight, out=np.zeros((4, 16), np.float32)), "out"),
        "out shape": (lambda: bitnet_ffi.rmsnorm(x, weight, out=y[:2]), "out"),
        "residual shape": (lambda: bitnet_ffi.add_rmsnorm(x, residual[:3], weight, out=y), "residual"),
        "residual dtype": (lambda: bitnet_ffi.add_rmsnorm(x, residual.astype(np.float16), weight, out=y),
                           "residual"),
        "negative eps": (lambda: bitnet_ffi.add_rmsnorm(x, residual, weight, eps=-1.0, out=y), "eps"),
        "NaN eps": (lambda: bitnet_ffi.rmsnorm(x, weight, eps=math.nan, out=y), "eps"),
        "strided x": (lambda: bitnet_ffi.rmsnorm(x[:, ::2], weight[::2].copy(), out=y[:, :8]),
                      "contiguous"),
        "bad out pair": (lambda: bitnet_ffi.rmsnorm_quantize(x, weight, out=y), "pair"),
        "scales shape": (lambda: bitnet_ffi.rmsnorm_quantize(
            x, weight, out=(np.zeros((4, 16), np.int8), np.zeros(5, np.float32))), "scales"),
        "scalar x": (lambda: bitnet_ffi.rmsnorm(np.array(1.0, np.float32), weight), "scalar"),
        "empty x": (lambda: bitnet_ffi.rmsnorm(x[:0], weight), ">= 1"),
    }


@pytest.mark.cpu
@pytest.mark.parametrize("case", python_bad_cases(np.random.default_rng(0))[4])
def test_python_rejects_bad_arguments(rng, case):
    x, weight, residual, y, cases = python_bad_cases(rng)
    before = residual.copy()
    call, message = cases[case]
    with pytest.raises(InvalidArgumentError, match=message):
        call()
    assert np.isnan(y.astype(np.float32)).all()
    np.testing.assert_array_equal(residual.view(np.uint16), before.view(np.uint16))


# ---- tiers 2 and 3: the CUDA backend ----

def torch_put(a):
    import torch
    if a.dtype == DTYPES["bfloat16"]:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


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
GPU_SHAPES = [(T, H) for H in WIDTHS for T in (1, 5, 4096)] + [(20000, 256), (9001, 3072)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,H", GPU_SHAPES)
def test_gpu_matches_reference_and_cpu(rng, dtype, variant, T, H):
    if T == 4096 and variant == "add":
        pytest.skip("T = 4096 runs the add_quant_y variant, which covers the same path")
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


@pytest.mark.gpu
def test_gpu_rejects_host_memory_and_mixed_devices(rng):
    import torch
    b = Buffers(rng)
    xd = torch_put(b.x)
    status = raw_call(device=0, **b.args(x=_ffi.ffi.cast("void *", xd.data_ptr())))
    assert status == _ffi.lib().BITNET_ERR_INVALID_ARGUMENT
    assert "host memory" in _ffi.last_error()
    b.assert_untouched()
    y = torch.full((4, 8), float("nan"), device="cuda")
    with pytest.raises(InvalidArgumentError, match="different devices"):
        bitnet_ffi.rmsnorm(xd, b.weight, out=y)
    with pytest.raises(InvalidArgumentError, match="different devices"):
        bitnet_ffi.add_rmsnorm(xd, b.residual, torch_put(b.weight), out=y)
    assert torch.isnan(y).all()
    np.testing.assert_array_equal(b.residual, b.residual_before)


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
