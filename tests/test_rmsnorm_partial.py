"""rmsnorm_partial / glu_rmsnorm_partial: one rank's half of an RMSNorm whose rows are split across
ranks (the codes of x * weight with the slice's own scale, and the slice's sum of squares), and
the split sub-norm + row-parallel projection they serve, against float64.

Bounds: the codes and scales follow a float32 rule that numpy reproduces exactly (p = x * w in
float32, scale = 127 / max |p|, codes = rint(p * scale)), so they are compared bit for bit, on
both backends. sumsq is a float32 sum of H non-negative terms in an order of the backend's own:
within H * 2^-24 of the float64 sum, relative. The split projection: each code is within half a
step (1 / (2 scale)) of its float value, so an output of the summed projection is within
sum_k |W[m, k]| * w_scale[m] / (2 scale_r(k)) / rms of the float64 W rmsnorm(v) (plus float32
rounding, 1e-5 relative)."""
import numpy as np
import pytest

import bitnet_ffi as bn
from bitnet_ffi import _arrays, _ffi
from bitnet_ffi._arrays import CPU, DeviceArray
from reference import reference_allreduce_rms

BF16 = _arrays.numpy_dtype("bfloat16")
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": BF16}


def reference(x, w):
    """The codes and scales rule in numpy float32, and the float64 sum of squares."""
    p = x.astype(np.float32) * w.astype(np.float32)
    top = np.abs(p).max(axis=-1)
    scales = np.float32(127) / np.maximum(top, np.float32(1e-5))
    codes = np.clip(np.rint(p * scales[..., None]), -128, 127).astype(np.int8)
    sumsq = (x.astype(np.float64) ** 2).sum(axis=-1)
    return codes, scales.astype(np.float32), sumsq


def run(fn, device, *args, **kwargs):
    """fn on the CPU (numpy) or on `device` (DeviceArrays), outputs poisoned first; host results."""
    rows = args[0].shape[:-1]
    width = args[1].shape[0]
    outs = (np.full(rows + (width,), 0x55, np.int8), np.full(rows, np.nan, np.float32),
            np.full(rows, np.nan, np.float32))
    if device == CPU:
        fn(*args, out=outs[:2], sumsq=outs[2], **kwargs)
        return outs
    put = [DeviceArray.from_numpy(a, device) for a in args]
    dev = [DeviceArray.from_numpy(o, device) for o in outs]
    fn(*put, out=tuple(dev[:2]), sumsq=dev[2], **kwargs)
    _ffi.call("device_synchronize", device)
    return tuple(d.numpy() for d in dev)


def check(got, x, w):
    codes, scales, sumsq = reference(x, w)
    np.testing.assert_array_equal(got[0], codes)
    np.testing.assert_array_equal(got[1], scales)
    H = x.shape[-1]
    np.testing.assert_allclose(got[2], sumsq, rtol=H * 2.0 ** -24 + 1e-7, atol=0)


def cases(rng, dtype):
    for T, H in [(1, 1), (3, 7), (2, 1000), (1, 4096), (5, 4099), (1, 14336)]:
        x = (rng.standard_normal((T, H)) * rng.uniform(0.1, 10)).astype(DTYPES[dtype])
        w = (1 + 0.1 * rng.standard_normal(H)).astype(DTYPES[dtype])
        yield x, w


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cpu_partial_codes_scales_and_sums(dtype, rng):
    for x, w in cases(rng, dtype):
        check(run(bn.rmsnorm_partial, CPU, x, w), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_partial_codes_scales_and_sums(dtype, rng):
    for x, w in cases(rng, dtype):
        check(run(bn.rmsnorm_partial, 0, x, w), x, w)


def gated_check(device, rng, dtype, activation):
    """The gated form: the GLU gate (glu_gate's values, rounded to the dtype), then the plain one."""
    for T, F in [(1, 3), (2, 384), (1, 3456), (3, 1001)]:
        gate_up = rng.standard_normal((T, 2 * F)).astype(DTYPES[dtype])
        w = (1 + 0.1 * rng.standard_normal(F)).astype(DTYPES[dtype])
        v = bn.glu_gate(gate_up, activation) if dtype != "float32" else None
        if v is None:  # glu_gate takes no float32 on a GPU: the float64 gate, rounded once
            g = gate_up.astype(np.float32)
            act = np.maximum(g[:, :F], 0) ** 2 if activation == "relu2" else \
                g[:, :F] / (1 + np.exp(-g[:, :F]))
            v = (act * g[:, F:]).astype(np.float32)
        got = run(bn.glu_rmsnorm_partial, device, gate_up, w, activation=activation)
        if dtype == "float32" and activation == "silu":  # expf may differ by an ulp: codes +-1
            codes, scales, sumsq = reference(v, w)
            assert np.abs(got[0].astype(int) - codes).max() <= 1
            np.testing.assert_allclose(got[1], scales, rtol=1e-5)
            np.testing.assert_allclose(got[2], sumsq, rtol=1e-5)
        else:
            check(got, v, w)


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("activation", ["relu2", "silu"])
def test_cpu_gated_partial_is_the_gate_then_the_partial_norm(dtype, activation, rng):
    gated_check(CPU, rng, dtype, activation)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("activation", ["relu2", "silu"])
def test_gpu_gated_partial_is_the_gate_then_the_partial_norm(dtype, activation, rng):
    gated_check(0, rng, dtype, activation)


@pytest.mark.cpu
@pytest.mark.parametrize("world", [2, 3, 4])
def test_split_projection_is_within_the_int8_bound_of_float64(world, rng):
    """The o / down projection of a tensor-parallel layer, ranks simulated: each rank's slice
    through rmsnorm_partial and its columns of W, the sums finished as the all-reduce does, against
    the float64 W rmsnorm(v), within the bound of the module docstring; and no further from it
    than one rank's rmsnorm_quantize (its single scale is a coarser grid) by more than 10%."""
    T, K, M, eps = 2, 1024, 256, 1e-5
    v = rng.standard_normal((T, K)).astype(BF16)
    w = (1 + 0.1 * rng.standard_normal(K)).astype(BF16)
    W = bn.quantize_i2s(rng.standard_normal((M, K)).astype(np.float32))
    dense = np.stack([bn.gemv_w2a8(W, (np.eye(K, dtype=np.float32)[k:k + 1] * 127).astype(np.int8),
                                   np.array([127.0], np.float32), out_dtype="float32")[0]
                      for k in range(K)], axis=1).astype(np.float64)  # W_q[m, k] * w_scale[m]
    vf, wf = v.astype(np.float64), w.astype(np.float64)
    rms = np.sqrt((vf ** 2).mean(axis=1) + eps)
    want = (vf * wf / rms[:, None]) @ dense.T
    cut = np.linspace(0, K // 128, world + 1).astype(int) * 128
    parts, sumsqs, half_steps = [], [], np.zeros((T, K))
    for a, b in zip(cut[:-1], cut[1:]):
        q, s, ss = bn.rmsnorm_partial(np.ascontiguousarray(v[:, a:b]), np.ascontiguousarray(w[a:b]))
        cols = bn.TernaryWeights(np.ascontiguousarray(np.asarray(W.packed)[:, a // 4:b // 4]),
                                 W.scales)
        parts.append(bn.gemv_w2a8(cols, q, s, out_dtype="float32"))
        sumsqs.append(ss)
        half_steps[:, a:b] = 0.5 / s[:, None]
    got = reference_allreduce_rms([np.concatenate([p.reshape(-1), ss]) for p, ss in
                                   zip(parts, sumsqs)], T, M, K, eps).astype(np.float64)
    bound = (half_steps / rms[:, None]) @ np.abs(dense).T + 1e-5 * np.abs(want).max()
    assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max() / bound.max()
    q1, s1 = bn.rmsnorm_quantize(v, w, eps=eps)
    one = bn.gemv_w2a8(W, q1, s1, out_dtype="float32").astype(np.float64)
    assert np.linalg.norm(got - want) <= 1.1 * np.linalg.norm(one - want)
