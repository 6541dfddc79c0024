"""The gate of a gated linear unit (relu2 and SiLU), alone and fused with the RMSNorm and int8
quantization (with a weight, or without: quantize_a8's rule): CPU and CUDA against float64 numpy
references, the fused op against the composed ops bit for bit, GPU against CPU; bad input."""
import numpy as np
import pytest

import bitnet_ffi
from bitnet_ffi import _arrays, _ffi
from bitnet_ffi.errors import InvalidArgumentError


def reference_glu(gate_up, activation):
    """act(gate) * up in float64; gate_up [..., 2F]."""
    gate_up = np.asarray(gate_up, dtype=np.float64)
    F = gate_up.shape[-1] // 2
    g, u = gate_up[..., :F], gate_up[..., F:]
    with np.errstate(over="ignore"):
        act = np.maximum(g, 0) ** 2 if activation == "relu2" else g / (1 + np.exp(-g))
    return act * u


# silu(g) * u is g / (1 + expf(-g)) * u in float32: expf within 2 ulp, then three roundings, so
# within 4 float32 ulp (relative 2^-21 < 5e-7) of the float64 value, or 1e-37 absolute where
# exp(-g) overflows (g < -88, true value below 1e-36); relu2: two roundings. Then one rounding to
# the dtype: half an ulp, 2^-12 relative for float16 (2^-24 absolute in its subnormals), 2^-9 for
# bfloat16.
GLU_RTOL = {"float32": 1e-6, "float16": 2.0 ** -11 + 1e-6, "bfloat16": 2.0 ** -8 + 1e-6}
GLU_ATOL = {"float32": 1e-37, "float16": 2.0 ** -24, "bfloat16": 1e-37}
ACTIVATIONS = ["relu2", "silu"]


def cast(x, dtype):
    return np.asarray(x).astype(_arrays.numpy_dtype(dtype))


def gate_up_values(rng, dtype, shape):
    """Normal values times 3, with edges: zeros, a negative, and gates where exp(-g) overflows."""
    x = rng.standard_normal(shape) * 3
    flat = x.reshape(-1)
    flat[:5] = [0.0, -0.0, -3.0, 1.5, -20.0]
    if dtype != "float16":
        flat[5] = -100.0  # silu: exp(100) overflows float32; silu(-100) * u is about 4e-42 * u
    return cast(x, dtype)


def bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# ---- tier 1: CPU ----

@pytest.mark.cpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 2 * 3072), (7, 2 * 13), (3, 5, 2 * 40), (2, 2 * 23040)])
def test_cpu_glu_gate_matches_reference(rng, activation, dtype, shape):
    gate_up = gate_up_values(rng, dtype, shape)
    ref = reference_glu(gate_up, activation)
    out = np.full(ref.shape, np.nan, dtype=gate_up.dtype)
    assert bitnet_ffi.glu_gate(gate_up, activation, out=out) is out
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=GLU_RTOL[dtype],
                               atol=GLU_ATOL[dtype])
    fresh = bitnet_ffi.glu_gate(gate_up, activation=activation)
    np.testing.assert_array_equal(bits(fresh), bits(out))
    if activation == "relu2":  # the thin form is the same call
        np.testing.assert_array_equal(bits(bitnet_ffi.relu2_gate(gate_up)), bits(out))


@pytest.mark.cpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("T,F", [(1, 3072), (5, 13), (3, 1000)])
def test_cpu_glu_rmsnorm_quantize_equals_gate_then_norm(rng, activation, dtype, T, F):
    """Fused with a weight: bit for bit glu_gate then rmsnorm_quantize; y_out too."""
    gate_up = gate_up_values(rng, dtype, (T, 2 * F))
    weight = cast(rng.uniform(0.5, 1.5, F), dtype)
    codes, scales = np.full((T, F), 0x7F, np.int8), np.full(T, np.nan, np.float32)
    y = np.full((T, F), np.nan, gate_up.dtype)
    got = bitnet_ffi.glu_rmsnorm_quantize(gate_up, weight, activation, eps=1e-6, out=(codes, scales),
                                          y_out=y)
    assert got[0] is codes and got[1] is scales
    v = bitnet_ffi.glu_gate(gate_up, activation)
    want_codes, want_scales = bitnet_ffi.rmsnorm_quantize(v, weight, eps=1e-6)
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(bits(scales), bits(want_scales))
    np.testing.assert_array_equal(bits(y), bits(bitnet_ffi.rmsnorm(v, weight, eps=1e-6)))
    # and against float64: y = v / rms(v) * w, v from the float64 gate (rounded as stored)
    v64 = np.asarray(v, np.float64)
    y64 = v64 / np.sqrt((v64 ** 2).mean(-1, keepdims=True) + 1e-6) * np.asarray(weight, np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float64), y64, rtol=GLU_RTOL[dtype] + 1e-5,
                               atol=1e-6 * np.abs(y64).max())
    if activation == "relu2":
        r_codes, r_scales = bitnet_ffi.relu2_rmsnorm_quantize(gate_up, weight, eps=1e-6)
        np.testing.assert_array_equal(r_codes, codes)
        np.testing.assert_array_equal(bits(r_scales), bits(scales))


@pytest.mark.cpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("T,F", [(1, 23040), (4, 256), (3, 13)])
def test_cpu_glu_without_weight_is_gate_then_quantize_a8(rng, activation, dtype, T, F):
    """weight=None: no norm. y = glu_gate and the codes are quantize_a8's, bit for bit (quantize_a8
    takes K % 128 == 0; other widths against its rule in numpy, float32)."""
    gate_up = gate_up_values(rng, dtype, (T, 2 * F))
    codes, scales = np.full((T, F), 0x7F, np.int8), np.full(T, np.nan, np.float32)
    y = np.full((T, F), np.nan, gate_up.dtype)
    bitnet_ffi.glu_rmsnorm_quantize(gate_up, None, activation, out=(codes, scales), y_out=y)
    v = bitnet_ffi.glu_gate(gate_up, activation)
    np.testing.assert_array_equal(bits(y), bits(v))
    v32 = np.asarray(v, np.float32)
    s = np.float32(127) / np.maximum(np.abs(v32).max(-1), np.float32(1e-5))
    np.testing.assert_array_equal(bits(scales), bits(s.astype(np.float32)))
    np.testing.assert_array_equal(codes, np.clip(np.rint(v32 * s[:, None]), -128, 127).astype(np.int8))
    if F % 128 == 0:
        a8_codes, a8_scales = bitnet_ffi.quantize_a8(v)
        np.testing.assert_array_equal(codes, a8_codes)
        np.testing.assert_array_equal(bits(scales), bits(a8_scales))


@pytest.mark.cpu
def test_cpu_glu_bad_input(rng):
    lib, ffi = _ffi.lib(), _ffi.ffi
    gate_up = gate_up_values(rng, "float32", (3, 10))
    out = np.full((3, 5), np.nan, np.float32)
    for bad in ("gelu", "SILU", 1, None):
        with pytest.raises(InvalidArgumentError, match="activation must be 'relu2' or 'silu'"):
            bitnet_ffi.glu_gate(gate_up, bad, out=out)
        with pytest.raises(InvalidArgumentError, match="activation must be 'relu2' or 'silu'"):
            bitnet_ffi.glu_rmsnorm_quantize(gate_up, None, bad)
    with pytest.raises(InvalidArgumentError, match="weight"):
        bitnet_ffi.relu2_rmsnorm_quantize(gate_up, None)
    with pytest.raises(InvalidArgumentError, match="weight"):
        bitnet_ffi.glu_rmsnorm_quantize(gate_up, np.ones(4, np.float32), "silu")
    with pytest.raises(InvalidArgumentError, match="2F"):
        bitnet_ffi.glu_gate(gate_up[:, :9].copy(), "silu")
    ptr = ffi.cast("void *", gate_up.ctypes.data)
    out_ptr = ffi.cast("void *", out.ctypes.data)
    for activation in (2, -1, 1 << 30):
        assert lib.bitnet_glu_gate(-1, 0, 3, 5, activation, ptr, out_ptr, ffi.NULL) \
            == lib.BITNET_ERR_INVALID_ARGUMENT
        assert "activation" in _ffi.last_error()
        assert lib.bitnet_glu_rmsnorm(-1, 0, 3, 5, activation, ptr, ffi.NULL, 1e-5, out_ptr,
                                      ffi.NULL, ffi.NULL, ffi.NULL) == lib.BITNET_ERR_INVALID_ARGUMENT
        assert "activation" in _ffi.last_error()
    # bitnet_relu2_rmsnorm keeps its weight required; bitnet_glu_rmsnorm takes NULL
    assert lib.bitnet_relu2_rmsnorm(-1, 0, 3, 5, ptr, ffi.NULL, 1e-5, out_ptr, ffi.NULL, ffi.NULL,
                                    ffi.NULL) == lib.BITNET_ERR_INVALID_ARGUMENT
    assert "weight is NULL" in _ffi.last_error()
    # no weight and no codes: y alone is glu_gate's job, refused with a pointer to it
    assert lib.bitnet_glu_rmsnorm(-1, 0, 3, 5, 1, ptr, ffi.NULL, 1e-5, out_ptr, ffi.NULL, ffi.NULL,
                                  ffi.NULL) == lib.BITNET_ERR_INVALID_ARGUMENT
    assert "bitnet_glu_gate" in _ffi.last_error()
    assert np.isnan(out).all()
    codes, scales = np.zeros((3, 5), np.int8), np.zeros(3, np.float32)
    assert lib.bitnet_glu_rmsnorm(-1, 0, 3, 5, 1, ptr, ffi.NULL, 1e-5, out_ptr,
                                  ffi.cast("int8_t *", codes.ctypes.data),
                                  ffi.cast("float *", scales.ctypes.data), ffi.NULL) == lib.BITNET_OK
    np.testing.assert_array_equal(bits(out), bits(bitnet_ffi.glu_gate(gate_up, "silu")))


# ---- tiers 2 and 3: CUDA ----

def to_torch(x):
    import torch
    if x.dtype == _arrays.numpy_dtype("bfloat16"):
        return torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(x).cuda()


def to_numpy(t, dtype):
    import torch
    if dtype == "bfloat16":
        return t.view(torch.int16).cpu().numpy().view(_arrays.numpy_dtype("bfloat16"))
    return t.cpu().numpy()


@pytest.mark.gpu_smoke
def test_gpu_smoke_silu_gate(rng):
    pytest.importorskip("ml_dtypes")
    gate_up = gate_up_values(rng, "bfloat16", (2, 2 * 64))
    out = to_numpy(bitnet_ffi.glu_gate(to_torch(gate_up), "silu"), "bfloat16")
    np.testing.assert_allclose(np.asarray(out, np.float64), reference_glu(gate_up, "silu"),
                               rtol=GLU_RTOL["bfloat16"], atol=GLU_ATOL["bfloat16"])


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 2 * 23040), (9, 2 * 13), (300, 2 * 3072), (2, 3, 2 * 40)])
def test_gpu_glu_gate_matches_reference_and_cpu(rng, activation, dtype, shape):
    """relu2: bit for bit the CPU. silu: expf may differ by an ulp of float32 between the two, so the
    dtype values by at most one step (at a rounding tie), and both meet the float64 bound."""
    import torch
    pytest.importorskip("ml_dtypes")
    gate_up = gate_up_values(rng, dtype, shape)
    cpu = bitnet_ffi.glu_gate(gate_up, activation)
    out = torch.full(shape[:-1] + (shape[-1] // 2,), float("nan"), dtype=getattr(torch, dtype),
                     device="cuda")
    bitnet_ffi.glu_gate(to_torch(gate_up), activation, out=out)
    gpu = to_numpy(out, dtype)
    ref = reference_glu(gate_up, activation)
    np.testing.assert_allclose(np.asarray(gpu, np.float64), ref, rtol=GLU_RTOL[dtype],
                               atol=GLU_ATOL[dtype])
    if activation == "relu2":
        np.testing.assert_array_equal(bits(gpu), bits(cpu))
    else:
        steps = np.abs(bits(gpu).astype(np.int32) - bits(cpu).astype(np.int32))
        assert steps.max() <= 1 and (steps == 0).mean() > 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("T,F,norm", [(1, 23040, True), (1, 23040, False), (64, 3072, True),
                                      (300, 3072, False), (3, 13, True), (3, 13, False)])
def test_gpu_glu_rmsnorm_quantize_equals_composed_ops(rng, activation, dtype, T, F, norm):
    """On the GPU, the fused op is bit for bit its composition there: glu_gate then
    rmsnorm_quantize (with a weight) or then quantize_a8's rule (without); against the CPU, codes
    within 1 and scales within float32 rounding (silu's expf may differ by an ulp)."""
    import torch
    pytest.importorskip("ml_dtypes")
    gate_up = gate_up_values(rng, dtype, (T, 2 * F))
    weight = cast(rng.uniform(0.5, 1.5, F), dtype) if norm else None
    tg = to_torch(gate_up) if dtype != "float32" else torch.from_numpy(gate_up).cuda()
    tw = None if weight is None else (to_torch(weight) if dtype != "float32"
                                      else torch.from_numpy(weight).cuda())
    codes = torch.full((T, F), 0x7F, dtype=torch.int8, device="cuda")
    scales = torch.full((T,), float("nan"), device="cuda")
    y = torch.full((T, F), float("nan"), dtype=tg.dtype, device="cuda")
    bitnet_ffi.glu_rmsnorm_quantize(tg, tw, activation, eps=1e-6, out=(codes, scales), y_out=y)
    torch.cuda.synchronize()
    if dtype == "float32":  # glu_gate takes 16-bit dtypes on a GPU: compose on the CPU's gate
        v = bitnet_ffi.glu_gate(gate_up, activation)
        v_gpu = torch.from_numpy(np.asarray(v)).cuda()
    else:
        v_gpu = bitnet_ffi.glu_gate(tg, activation)
    if norm:
        want_codes, want_scales = bitnet_ffi.rmsnorm_quantize(v_gpu, tw, eps=1e-6)
        want_y = bitnet_ffi.rmsnorm(v_gpu, tw, eps=1e-6)
    else:
        want_y = v_gpu
        if F % 128 == 0:
            want_codes, want_scales = bitnet_ffi.quantize_a8(v_gpu)
        else:
            v32 = v_gpu.float()
            amax = v32.abs().amax(-1).clamp_min(1e-5)
            want_scales = torch.full_like(amax, 127.0) / amax  # (127 / t is a reciprocal times 127)
            want_codes = torch.round(v32 * want_scales[:, None]).clamp(-128, 127).to(torch.int8)
    if dtype == "float32" and activation == "silu":  # the CPU's gate: expf may differ
        assert (codes.int() - want_codes.int()).abs().max().item() <= 1
    else:
        assert torch.equal(codes, want_codes)
        assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))
        assert torch.equal(y.view(torch.int16 if dtype != "float32" else torch.int32),
                           want_y.view(torch.int16 if dtype != "float32" else torch.int32))
    cpu_codes, cpu_scales = bitnet_ffi.glu_rmsnorm_quantize(gate_up, weight, activation, eps=1e-6)
    assert np.abs(codes.cpu().numpy().astype(np.int32) - cpu_codes.astype(np.int32)).max() <= 1
    np.testing.assert_allclose(scales.cpu().numpy(), cpu_scales, rtol=GLU_RTOL[dtype] + 1e-5)


@pytest.mark.gpu
def test_gpu_glu_bad_input(rng):
    import torch
    lib, ffi = _ffi.lib(), _ffi.ffi
    gate_up = torch.randn(3, 10, dtype=torch.bfloat16, device="cuda")
    out = torch.full((3, 5), float("nan"), dtype=torch.bfloat16, device="cuda")
    status = lib.bitnet_glu_gate(0, 2, 3, 5, 7, ffi.cast("void *", gate_up.data_ptr()),
                                 ffi.cast("void *", out.data_ptr()), ffi.NULL)
    assert status == lib.BITNET_ERR_INVALID_ARGUMENT and "activation" in _ffi.last_error()
    host = np.zeros((3, 10), np.float16)
    status = lib.bitnet_glu_gate(0, 1, 3, 5, 1, ffi.cast("void *", host.ctypes.data),
                                 ffi.cast("void *", out.data_ptr()), ffi.NULL)
    assert status == lib.BITNET_ERR_INVALID_ARGUMENT and "host memory" in _ffi.last_error()
    with pytest.raises(InvalidArgumentError, match="different devices"):
        bitnet_ffi.glu_rmsnorm_quantize(gate_up, torch.ones(5, dtype=torch.bfloat16), "silu")
    with pytest.raises(InvalidArgumentError, match="activation"):
        bitnet_ffi.glu_gate(gate_up, "gelu", out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()
