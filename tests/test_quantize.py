"""quantize_i2s, pack/unpack_ternary and quantize_a8 against a plain numpy reference, on the CPU and
(tier 3) on the GPU, plus bad input at the C ABI and in Python.

The rules are exact (docs/weight_format.md), so codes, packed bytes, int8 activations and their
scales are compared bit for bit. One exception: the weight scale is a float64 mean whose summation
order differs from numpy's, so it is asserted within 1 float32 ulp of the reference, and the codes
are asserted exactly against the rule applied with the library's own scale."""
import numpy as np
import pytest

import bitnet_ffi as bn
from bitnet_ffi import _ffi
from bitnet_ffi.errors import InvalidArgumentError, UnsupportedError


def ref_scales(w, row_segments=None):
    """Per-row float32 scales: mean |w| of the row's segment in float64, floored at 1e-5."""
    counts = row_segments or [w.shape[0]]
    absw = np.abs(w.astype(np.float64))
    scales, row = [], 0
    for rows in counts:
        scale = np.float32(max(absw[row:row + rows].mean(), 1e-5))
        scales += [scale] * rows
        row += rows
    return np.array(scales, dtype=np.float32)


def ref_codes(w, scales):
    """clamp(rint(w / scale), -1, 1) in float32 (numpy's rint rounds half to even)."""
    q = np.rint(w.astype(np.float32) / scales[:, None].astype(np.float32))
    return np.clip(q, -1, 1).astype(np.int8)


def ref_pack(w_q):
    """Weight 16g+4i+b of a row -> byte 4g+b, bits 2i..2i+1, as code w+1."""
    M, K = w_q.shape
    codes = (w_q.astype(np.int16) + 1).astype(np.uint8).reshape(M, K // 16, 4, 4)  # [m, g, i, b]
    return (codes << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(
        axis=2, dtype=np.uint8).reshape(M, K // 4)


def ref_quantize_a8(x):
    x = x.astype(np.float32)
    s = (np.float32(127) / np.maximum(np.abs(x).max(axis=-1), np.float32(1e-5))).astype(np.float32)
    q = np.clip(np.rint(x * s[..., None]), -128, 127).astype(np.int8)
    return q, s


def float_array(rng, shape, dtype):
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "float32":
        return x
    return x.astype(pytest.importorskip("ml_dtypes").bfloat16 if dtype == "bfloat16" else np.float16)


def assert_within_one_ulp(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.all(np.abs(got - want) <= np.spacing(want)), (got, want)


def check_i2s(w, tw, row_segments=None):
    scales = np.asarray(tw.scales)
    assert_within_one_ulp(scales, ref_scales(w, row_segments))
    codes = ref_codes(w.astype(np.float32), scales)
    np.testing.assert_array_equal(np.asarray(tw.unpack()), codes)
    np.testing.assert_array_equal(np.asarray(tw.packed), ref_pack(codes))


def status_and_message(status):
    return int(status), _ffi.last_error()


# ---------------------------------------------------------------- tier 1: CPU


@pytest.mark.cpu
def test_layout_worked_example():
    """The example of docs/weight_format.md, down to the bytes."""
    w_q = np.zeros((1, 128), np.int8)
    w_q[0, :16] = [1, 0, -1, 1, 0, 0, 1, -1, -1, -1, 0, 1, 1, 1, 1, 0]
    tw = bn.pack_ternary(w_q, 1.0)
    assert bytes(tw.packed[0, :4]).hex() == "86859862"
    assert bytes(tw.packed[0, 4:8]).hex() == "55555555"  # sixteen zeros: code 1 everywhere
    np.testing.assert_array_equal(tw.unpack(), w_q)


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 128), (7, 384), (333, 2560)])
def test_quantize_i2s_cpu(rng, dtype, shape):
    w = float_array(rng, shape, dtype)
    w[0, :3] = [0.0, 1e4, -1e4]  # zero and clamped extremes
    check_i2s(w, bn.quantize_i2s(w))


@pytest.mark.cpu
def test_quantize_i2s_segments_cpu(rng):
    w = rng.standard_normal((333, 640)).astype(np.float32)
    w[100:300] *= 7.5          # a segment of another magnitude
    w[300:] = 0.0              # an all-zero segment: scale floored at 1e-5, all codes 0
    segments = [100, 200, 33]
    tw = bn.quantize_i2s(w, row_segments=segments)
    check_i2s(w, tw, segments)
    assert np.all(tw.scales[300:] == np.float32(1e-5))
    assert np.all(tw.unpack()[300:] == 0)
    assert len(set(tw.scales[:300].tolist())) == 2


@pytest.mark.cpu
def test_quantize_i2s_ties_round_to_even():
    """mean |w| = 1 exactly, so w / scale = +-0.5 are ties: rint gives 0 (half to even)."""
    w = np.where(np.arange(128) % 2 == 0, 1.0, -1.0).astype(np.float32)[None, :]
    w[0, :4] = [0.5, -0.5, 1.5, -1.5]
    tw = bn.quantize_i2s(w)
    assert tw.scales[0] == 1.0
    np.testing.assert_array_equal(tw.unpack()[0, :6], [0, 0, 1, -1, 1, -1])


@pytest.mark.cpu
def test_pack_unpack_roundtrip_cpu(rng):
    w_q = rng.integers(-1, 2, (37, 1152), dtype=np.int8)
    tw = bn.pack_ternary(w_q, np.linspace(0.5, 2, 37, dtype=np.float32))
    np.testing.assert_array_equal(tw.packed, ref_pack(w_q))
    np.testing.assert_array_equal(tw.unpack(), w_q)
    assert tw.shape == (37, 1152) and tw.device == -1


@pytest.mark.cpu
@pytest.mark.parametrize("bad", [2, -2, 127, -128])
def test_pack_rejects_non_ternary_untouched(rng, bad):
    w_q = rng.integers(-1, 2, (5, 256), dtype=np.int8)
    w_q[3, 200] = bad
    packed = np.full((5, 64), 0xA5, np.uint8)
    status, message = status_and_message(_ffi.lib().bitnet_pack_ternary(
        -1, _ffi.ffi.cast("int8_t *", w_q.ctypes.data), 5, 256,
        _ffi.ffi.cast("uint8_t *", packed.ctypes.data), _ffi.ffi.NULL))
    assert status == 1 and f"w_q[3, 200] = {bad} is not -1, 0 or 1" in message
    assert np.all(packed == 0xA5)
    with pytest.raises(InvalidArgumentError):
        bn.pack_ternary(w_q, 1.0)


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(128,), (1, 2560), (33, 384)])
def test_quantize_a8_cpu(rng, dtype, shape):
    x = float_array(rng, shape, dtype)
    if len(shape) == 2:
        x[0] = 0            # all zero: s = 127 / 1e-5, x_q = 0
        x[-1, :2] = [1e30, -1e30] if dtype != "float16" else [6e4, -6e4]  # +-127 after scaling
    x_q, s = bn.quantize_a8(x)
    want_q, want_s = ref_quantize_a8(x)
    np.testing.assert_array_equal(x_q, want_q)
    np.testing.assert_array_equal(s, np.atleast_1d(want_s))


@pytest.mark.cpu
def test_quantize_a8_extremes():
    """max |x| = 127 gives s = 1: ties round half to even, the extremes map to +-127."""
    x = np.zeros((1, 128), np.float32)
    x[0, :7] = [127, 0.5, 1.5, 2.5, -0.5, -2.5, -127]
    x_q, s = bn.quantize_a8(x)
    assert s[0] == 1.0
    np.testing.assert_array_equal(x_q[0, :7], [127, 0, 2, 2, 0, -2, -127])
    np.testing.assert_array_equal(x_q, ref_quantize_a8(x)[0])


# ---------------------------------------------------------------- non-finite values
# Weights: quantize_i2s refuses NaN and +-inf, naming the first; activations: quantize_a8 gives a
# row holding one the scale NaN and codes -128, so the GEMV gives NaN for that token only.

NON_FINITE = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def non_finite_weights(rng, dtype, special):
    """w [5, 256] whose first non-finite value, of two, is at [3, 200]."""
    w = float_array(rng, (5, 256), dtype)
    w[3, 200] = w[4, 7] = special
    return w


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("special", NON_FINITE)
def test_quantize_i2s_rejects_non_finite_untouched(rng, dtype, special):
    w = non_finite_weights(rng, dtype, NON_FINITE[special])
    packed = np.full((5, 64), 0x5A, np.uint8)
    scales = np.full(5, 7.0, np.float32)
    ffi = _ffi.ffi
    status, message = c_quantize_i2s(ffi.cast("void *", w.ctypes.data), 5, 256, ffi.NULL, 0,
                                     ffi.cast("uint8_t *", packed.ctypes.data),
                                     ffi.cast("float *", scales.ctypes.data),
                                     dtype={"float32": 0, "float16": 1, "bfloat16": 2}[dtype])
    assert status == 1 and f"w[3, 200] is {special}; weights must be finite" in message, message
    assert np.all(packed == 0x5A) and np.all(scales == 7.0)
    with pytest.raises(InvalidArgumentError, match=rf"w\[3, 200\] is {special}"):
        bn.quantize_i2s(w, row_segments=[2, 3])


def assert_non_finite_token(x, x_q, s, row):
    """Row `row` of x holds a NaN or +-inf: scale NaN, codes -128; the other rows as the reference;
    and the GEMV of the codes is NaN for that token only."""
    want_q, want_s = ref_quantize_a8(np.delete(x, row, axis=0))
    assert np.isnan(s[row]) and np.all(x_q[row] == -128)
    np.testing.assert_array_equal(np.delete(x_q, row, axis=0), want_q)
    np.testing.assert_array_equal(np.delete(s, row), want_s)
    w_q = np.random.default_rng(0).integers(-1, 2, (40, x.shape[1]), dtype=np.int8)
    y = bn.gemv_w2a8(bn.pack_ternary(w_q, 0.5), x_q, s)
    assert np.isnan(y[row]).all() and np.isfinite(np.delete(y, row, axis=0)).all()


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("special", NON_FINITE)
def test_quantize_a8_non_finite_token_gives_nan(rng, dtype, special):
    x = float_array(rng, (4, 384), dtype)
    x[2, 300] = NON_FINITE[special]
    x_q, s = bn.quantize_a8(x)
    assert_non_finite_token(x.astype(np.float32), x_q, s, 2)


# ---------------------------------------------------------------- bad input


def c_quantize_i2s(w, M, K, segments, n_segments, packed, scales, dtype=0, device=-1):
    return status_and_message(_ffi.lib().bitnet_quantize_i2s(
        device, w, dtype, M, K, segments, n_segments, packed, scales, _ffi.ffi.NULL))


@pytest.mark.cpu
def test_quantize_i2s_bad_input_c_abi():
    ffi = _ffi.ffi
    w = np.ones((4, 256), np.float32)
    packed = np.full((4, 64), 0x5A, np.uint8)
    scales = np.full(4, np.nan, np.float32)
    wp, pp, sp = (ffi.cast("void *", w.ctypes.data), ffi.cast("uint8_t *", packed.ctypes.data),
                  ffi.cast("float *", scales.ctypes.data))
    cases = [
        (c_quantize_i2s(wp, 4, 200, ffi.NULL, 0, pp, sp), 2, "multiple of 128"),
        (c_quantize_i2s(wp, 0, 256, ffi.NULL, 0, pp, sp), 1, "M must be"),
        (c_quantize_i2s(wp, 4, 256, ffi.NULL, 0, pp, sp, dtype=3), 2, "int8"),
        (c_quantize_i2s(wp, 4, 256, ffi.NULL, 0, pp, sp, dtype=17), 1, "not a bitnet_dtype"),
        (c_quantize_i2s(ffi.NULL, 4, 256, ffi.NULL, 0, pp, sp), 1, "w is NULL"),
        (c_quantize_i2s(wp, 4, 256, ffi.NULL, 0, ffi.NULL, sp), 1, "w_packed is NULL"),
        (c_quantize_i2s(wp, 4, 256, ffi.NULL, 0, pp + 1, sp), 1, "not aligned"),
        (c_quantize_i2s(wp, 4, 256, ffi.new("int64_t[]", [3, 2]), 2, pp, sp), 1, "sum to M"),
        (c_quantize_i2s(wp, 4, 256, ffi.new("int64_t[]", [4, 0]), 2, pp, sp), 1, ">= 1 rows"),
        (c_quantize_i2s(wp, 4, 256, ffi.NULL, 3, pp, sp), 1, "n_segments"),
        (c_quantize_i2s(wp, 2 ** 62, 256, ffi.NULL, 0, pp, sp), 1, "overflow"),
        (c_quantize_i2s(wp, 4, 2 ** 23, ffi.NULL, 0, pp, sp), 2, "largest supported K"),
    ]
    for (status, message), want_status, want_text in cases:
        assert status == want_status and want_text in message, (status, message, want_text)
    assert np.all(packed == 0x5A) and np.all(np.isnan(scales))


@pytest.mark.cpu
def test_quantize_a8_bad_input_c_abi():
    ffi = _ffi.ffi
    x = np.ones((2, 128), np.float32)
    x_q = np.full((2, 128), 7, np.int8)
    s = np.full(2, np.nan, np.float32)
    lib = _ffi.lib()

    def call(xp, dtype, N, K, qp, sp):
        return status_and_message(lib.bitnet_quantize_a8(-1, xp, dtype, N, K, qp, sp, ffi.NULL))

    xp, qp, sp = (ffi.cast("void *", x.ctypes.data), ffi.cast("int8_t *", x_q.ctypes.data),
                  ffi.cast("float *", s.ctypes.data))
    assert call(xp, 0, 2, 100, qp, sp)[0] == 2
    assert call(xp, 4, 2, 128, qp, sp)[0] == 2
    assert call(xp, -1, 2, 128, qp, sp)[0] == 1
    assert call(xp, 0, 2, 128, qp, ffi.NULL)[0] == 1
    assert call(xp, 0, -2, 128, qp, sp)[0] == 1
    assert call(xp + 2, 0, 2, 128, qp, sp)[0] == 1
    assert np.all(x_q == 7) and np.all(np.isnan(s))


@pytest.mark.cpu
def test_python_bad_input(rng):
    with pytest.raises(InvalidArgumentError, match="dtype"):
        bn.quantize_i2s(np.ones((4, 128), np.int32))
    with pytest.raises(InvalidArgumentError, match="shape"):
        bn.quantize_i2s(np.ones(128, np.float32))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        bn.quantize_i2s(np.ones((128, 8), np.float32).T)
    with pytest.raises(UnsupportedError, match="multiple of 128"):
        bn.quantize_i2s(np.ones((4, 96), np.float32))
    with pytest.raises(InvalidArgumentError, match="row_segments"):
        bn.quantize_i2s(np.ones((4, 128), np.float32), row_segments=[1, 2])
    with pytest.raises(InvalidArgumentError, match="integer row counts"):  # not truncated to [2, 2]
        bn.quantize_i2s(np.ones((4, 128), np.float32), row_segments=[2.7, 2.2])
    with pytest.raises(InvalidArgumentError, match="N must be at least 1"):
        bn.quantize_a8(np.ones((0, 128), np.float32))
    with pytest.raises(InvalidArgumentError, match="dtype"):
        bn.quantize_a8(np.ones((2, 128), np.int8))
    with pytest.raises(InvalidArgumentError, match="dtype"):
        bn.pack_ternary(np.ones((2, 128), np.int32), 1.0)
    with pytest.raises(InvalidArgumentError, match="shape"):
        bn.pack_ternary(np.ones((2, 128), np.int8), np.ones(3, np.float32))
    with pytest.raises(InvalidArgumentError, match="a scalar or 2 values"):
        bn.pack_ternary(np.ones((2, 128), np.int8), [1.0, 2.0, 3.0])


@pytest.mark.cpu
def test_to_same_device_and_fake_gpu(clean_env):
    tw = bn.pack_ternary(np.zeros((2, 128), np.int8), 1.0)
    assert tw.to("cpu") is tw
    clean_env.setenv("BITNET_GPU_FAKE", "cuda")
    if bn.detect().devices and not bn.detect().devices[0].fake:
        pytest.skip("a real GPU is present: cuda:0 is not the fake")
    with pytest.raises(bn.NoDeviceError):
        tw.to("cuda:0")


# ---------------------------------------------------------------- tier 3: GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(7, 384), (3840, 2560), (2560, 6912)])
def test_quantize_i2s_gpu_matches_cpu(rng, dtype, shape):
    torch = pytest.importorskip("torch")
    w = torch.randn(shape, dtype=getattr(torch, dtype), device="cuda")
    segments = [shape[0] - shape[0] // 3, shape[0] // 3]
    tw = bn.quantize_i2s(w, row_segments=segments)
    torch.cuda.synchronize()
    host = w.cpu().float().numpy()
    check_i2s(host, bn.TernaryWeights(tw.packed.cpu().numpy(), tw.scales.cpu().numpy()), segments)
    cpu = bn.quantize_i2s(host, row_segments=segments)
    assert_within_one_ulp(tw.scales.cpu().numpy(), cpu.scales)
    assert isinstance(tw.unpack(), torch.Tensor) and tw.unpack().is_cuda


def torch_to_numpy(t):
    """A host numpy copy of a torch tensor, bfloat16 included (through ml_dtypes)."""
    import torch
    if t.dtype == torch.bfloat16:
        return t.cpu().view(torch.int16).numpy().view(pytest.importorskip("ml_dtypes").bfloat16)
    return t.cpu().numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_quantize_a8_gpu_matches_cpu(rng, dtype):
    torch = pytest.importorskip("torch")
    x = torch.randn(33, 2560, dtype=getattr(torch, dtype), device="cuda")
    x[0] = 0
    x_q, s = bn.quantize_a8(x)
    want_q, want_s = bn.quantize_a8(torch_to_numpy(x))
    np.testing.assert_array_equal(x_q.cpu().numpy(), want_q)
    np.testing.assert_array_equal(s.cpu().numpy(), want_s)


@pytest.mark.gpu
def test_pack_unpack_gpu_device_array(rng):
    w_q = rng.integers(-1, 2, (333, 1280), dtype=np.int8)
    tw = bn.pack_ternary(bn.DeviceArray.from_numpy(w_q), 0.25)
    assert isinstance(tw.packed, bn.DeviceArray)
    np.testing.assert_array_equal(tw.packed.numpy(), ref_pack(w_q))
    np.testing.assert_array_equal(tw.unpack().numpy(), w_q)
    back = tw.to("cpu")
    np.testing.assert_array_equal(back.packed, ref_pack(w_q))
    np.testing.assert_array_equal(back.to(0).unpack().numpy(), w_q)


@pytest.mark.gpu
def test_pack_gpu_rejects_non_ternary_untouched(rng):
    torch = pytest.importorskip("torch")
    w_q = torch.randint(-1, 2, (64, 512), dtype=torch.int8, device="cuda")
    w_q[63, 511] = 2
    packed = torch.full((64, 128), 0xA5, dtype=torch.uint8, device="cuda")
    status, message = status_and_message(_ffi.lib().bitnet_pack_ternary(
        0, _ffi.ffi.cast("int8_t *", w_q.data_ptr()), 64, 512,
        _ffi.ffi.cast("uint8_t *", packed.data_ptr()),
        _ffi.ffi.cast("void *", torch.cuda.current_stream().cuda_stream)))
    assert status == 1 and "w_q[63, 511] = 2 is not -1, 0 or 1" in message
    assert bool((packed == 0xA5).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("special", NON_FINITE)
def test_quantize_i2s_gpu_rejects_non_finite_untouched(rng, dtype, special):
    torch = pytest.importorskip("torch")
    w = torch.randn(4096, 1024, dtype=getattr(torch, dtype), device="cuda")
    w[4000, 1000] = NON_FINITE[special]
    w[100, 1023] = NON_FINITE[special]
    w[4095, 0] = NON_FINITE[special]
    packed = torch.full((4096, 256), 0x5A, dtype=torch.uint8, device="cuda")
    scales = torch.full((4096,), 7.0, device="cuda")
    ffi = _ffi.ffi
    status, message = status_and_message(_ffi.lib().bitnet_quantize_i2s(
        0, ffi.cast("void *", w.data_ptr()), {"float32": 0, "float16": 1, "bfloat16": 2}[dtype],
        4096, 1024, ffi.NULL, 0, ffi.cast("uint8_t *", packed.data_ptr()),
        ffi.cast("float *", scales.data_ptr()),
        ffi.cast("void *", torch.cuda.current_stream().cuda_stream)))
    assert status == 1 and f"w[100, 1023] is {special}; weights must be finite" in message, message
    assert bool((packed == 0x5A).all()) and bool((scales == 7.0).all())
    with pytest.raises(InvalidArgumentError, match=rf"w\[100, 1023\] is {special}"):
        bn.quantize_i2s(w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("special", NON_FINITE)
def test_quantize_a8_gpu_non_finite_token_gives_nan(rng, dtype, special):
    torch = pytest.importorskip("torch")
    x = torch.randn(5, 2560, dtype=getattr(torch, dtype), device="cuda")
    x[3, 2559] = NON_FINITE[special]
    x_q, s = bn.quantize_a8(x)
    host_q, host_s = x_q.cpu().numpy(), s.cpu().numpy()
    assert_non_finite_token(torch_to_numpy(x).astype(np.float32), host_q, host_s, 3)
    cpu_q, cpu_s = bn.quantize_a8(torch_to_numpy(x))  # the same bits on both backends
    np.testing.assert_array_equal(host_q, cpu_q)
    assert host_s.tobytes() == cpu_s.tobytes()
    w_q = torch.randint(-1, 2, (40, 2560), dtype=torch.int8, device="cuda")
    y = bn.gemv_w2a8(bn.pack_ternary(w_q, 0.5), x_q, s).cpu().numpy()
    assert np.isnan(y[3]).all() and np.isfinite(np.delete(y, 3, axis=0)).all()


@pytest.mark.gpu
def test_gpu_bad_input(rng):
    torch = pytest.importorskip("torch")
    ffi = _ffi.ffi
    host = np.ones((4, 128), np.float32)
    packed = torch.full((4, 32), 0x5A, dtype=torch.uint8, device="cuda")
    scales = torch.full((4,), float("nan"), device="cuda")
    status, message = c_quantize_i2s(ffi.cast("void *", host.ctypes.data), 4, 128, ffi.NULL, 0,
                                     ffi.cast("uint8_t *", packed.data_ptr()),
                                     ffi.cast("float *", scales.data_ptr()), device=0)
    assert status == 1 and "host memory" in message
    assert bool((packed == 0x5A).all()) and bool(scales.isnan().all())
    with pytest.raises(InvalidArgumentError, match="different devices"):
        bn.pack_ternary(torch.zeros((4, 128), dtype=torch.int8, device="cuda"),
                        np.ones(4, np.float32))


@pytest.mark.cpu
def test_quantize_a8_into_given_buffers(rng):
    """out=(x_q, s) writes the caller's buffers (allocation-free, for a captured decode step),
    exactly what the allocating form returns; wrong buffers are refused untouched."""
    x = rng.standard_normal((3, 256)).astype(np.float32)
    x_q, s = np.full((3, 256), 99, np.int8), np.full(3, np.nan, np.float32)
    assert bn.quantize_a8(x, out=(x_q, s))[0] is x_q
    expected_q, expected_s = bn.quantize_a8(x)
    np.testing.assert_array_equal(x_q, expected_q)
    np.testing.assert_array_equal(s, expected_s)
    bad_q = np.full((3, 128), 99, np.int8)
    with pytest.raises(InvalidArgumentError, match="x_q"):
        bn.quantize_a8(x, out=(bad_q, s))
    assert (bad_q == 99).all()
    with pytest.raises(InvalidArgumentError, match="pair"):
        bn.quantize_a8(x, out=x_q)
