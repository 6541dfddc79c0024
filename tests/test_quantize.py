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
from bitnet_ffi.cuda_graph import Graph, Stream
from bitnet_ffi.errors import InvalidArgumentError, UnsupportedError

from reference import (c_quantize_i2s, ref_codes, ref_pack, ref_quantize_a8, ref_scales,
                       status_and_message)


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


def half_scale_rows(rng, M=64):
    """Rows whose mean |w| is exactly c (a random float32 per row, over many binades), holding
    c / 2 and its float neighbours 1-3 ulps away: 128 pairs c/2 ± k·ulp (each summing to c) and
    128 values ±2c, so w / c lands on the tie 0.5 and just beside it. Returns (w, c)."""
    c = (2.0 ** rng.integers(-12, 12, M) * rng.uniform(1, 2, M)).astype(np.float32)
    k = np.arange(128) % 4
    w = np.empty((M, 384), np.float32)
    for m in range(M):
        up, down = np.float32(np.inf), np.float32(0)
        above = np.full(4, c[m] / 2, np.float32)
        below = above.copy()
        for i in (1, 2, 3):
            above[i] = np.nextafter(above[i - 1], up)
            below[i] = np.nextafter(below[i - 1], down)
        pairs = np.concatenate([above[k], below[k]])
        w[m] = np.concatenate([pairs, np.full(128, 2 * c[m], np.float32)])
        w[m] *= rng.choice(np.float32([-1, 1]), 384)
    assert np.all(np.abs(w.astype(np.float64)).mean(axis=1) == c)
    return w, c


def check_half_scale_codes(w, c, tw):
    """The library's codes equal numpy's division and rint: 0 at exactly c / 2, ±1 one ulp above."""
    assert np.all(np.asarray(tw.scales) == c)
    check_i2s(w, tw, [1] * len(c))
    codes = np.asarray(tw.unpack())
    np.testing.assert_array_equal(codes[:, 0], 0)
    np.testing.assert_array_equal(codes[:, 1], np.sign(w[:, 1]))


@pytest.mark.cpu
def test_quantize_i2s_codes_at_half_the_scale_cpu(rng):
    w, c = half_scale_rows(rng)
    check_half_scale_codes(w, c, bn.quantize_i2s(w, row_segments=[1] * len(c)))


@pytest.mark.cpu
def test_pack_unpack_roundtrip_cpu(rng):
    w_q = rng.integers(-1, 2, (37, 1152), dtype=np.int8)
    tw = bn.pack_ternary(w_q, np.linspace(0.5, 2, 37, dtype=np.float32))
    np.testing.assert_array_equal(tw.packed, ref_pack(w_q))
    np.testing.assert_array_equal(tw.unpack(), w_q)
    assert tw.shape == (37, 1152) and tw.device == -1


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


@pytest.mark.gpu
def test_quantize_i2s_codes_at_half_the_scale_gpu(rng):
    w, c = half_scale_rows(rng)
    tw = bn.quantize_i2s(bn.DeviceArray.from_numpy(w), row_segments=[1] * len(c))
    check_half_scale_codes(w, c, bn.TernaryWeights(tw.packed.numpy(), tw.scales.numpy()))


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
def test_quantize_i2s_gpu_refuses_graph_capture(rng):
    """Its finiteness check waits for the stream, so a capture is refused before any work."""
    w = bn.DeviceArray.from_numpy(rng.standard_normal((256, 512)).astype(np.float32))
    packed = bn.DeviceArray.from_numpy(np.full((256, 128), 0x5A, dtype=np.uint8))
    scales = bn.DeviceArray.from_numpy(np.full(256, 7.0, dtype=np.float32))
    stream, ffi = Stream(0), _ffi.ffi
    with pytest.raises(UnsupportedError, match="cannot be captured in a CUDA graph"):
        with Graph.capture(stream):
            _ffi.call("quantize_i2s", 0, ffi.cast("void *", w.ptr), 0, 256, 512, ffi.NULL, 0,
                      ffi.cast("uint8_t *", packed.ptr), ffi.cast("float *", scales.ptr),
                      ffi.cast("void *", stream.handle))
    assert (packed.numpy() == 0x5A).all() and (scales.numpy() == 7.0).all()
    tw = bn.quantize_i2s(w, stream=stream)  # the stream works afterwards
    stream.synchronize()
    np.testing.assert_array_equal(tw.unpack().numpy(), ref_codes(w.numpy(), ref_scales(w.numpy())))


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
