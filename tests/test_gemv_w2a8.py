"""gemv_w2a8 against a float64/int64 numpy reference: every CPU SIMD path the machine runs (tier 1),
the GPU against the CPU (tier 3), bad input at the C ABI and in Python, CUDA streams and graphs.

Integer outputs are exact. Float outputs follow the rule y = float32(float32(dot) * w_scale) /
x_scale, so float32 is compared bit for bit with that rule emulated in numpy and within 3e-7
relative of the float64 reference (two float32 roundings); float16/bfloat16 are that float32 value
rounded to nearest even."""
import warnings

import numpy as np
import pytest

import bitnet_ffi as bn
from bitnet_ffi import _ffi
from bitnet_ffi.errors import InvalidArgumentError

from reference import make_problem, torch_problem, cpu_isas, float32_rule, ref_gemv

PROJECTIONS_2B4T = [(3840, 2560), (2560, 2560), (13824, 2560), (2560, 6912)]


def cast(y32, out_dtype):
    if out_dtype == "bfloat16":
        return y32.astype(pytest.importorskip("ml_dtypes").bfloat16)
    return y32.astype(out_dtype)


def check_outputs(tw, w_q, w_scales, x_q, x_scales, dtypes=("int32", "float32", "float16",
                                                             "bfloat16")):
    dot, y64 = ref_gemv(w_q, w_scales, x_q, x_scales)
    y32 = float32_rule(dot, w_scales, x_scales)
    for out_dtype in dtypes:
        out = np.full(dot.shape, 0x7F, dtype=bn._arrays.numpy_dtype(out_dtype))  # poison
        y = bn.gemv_w2a8(tw, x_q, x_scales, out_dtype=out_dtype, out=out)
        assert y is out
        if out_dtype == "int32":
            np.testing.assert_array_equal(y, dot)
        elif out_dtype == "float32":
            np.testing.assert_array_equal(y, y32)
            np.testing.assert_allclose(y, y64, rtol=3e-7, atol=0)
        else:
            np.testing.assert_array_equal(y.view(np.uint16), cast(y32, out_dtype).view(np.uint16))


# ---------------------------------------------------------------- tier 1: CPU


@pytest.mark.cpu
@pytest.mark.parametrize("M,K,N", [(1, 128, 1), (7, 384, 3), (333, 2560, 8), (333, 1280, 16),
                                   (64, 640, 33), (3840, 2560, 1), (37, 6912, 21), (5, 27648, 9)])
def test_gemv_cpu_matches_reference(rng, isa, M, K, N):
    """Also tokens over several of the CPU kernel's token blocks (6912: 8 tokens a block, the
    last one part full; 27648: blocks of 4, the least)."""
    w_q, w_scales, x_q, x_scales = make_problem(rng, M, K, N)
    check_outputs(bn.pack_ternary(w_q, w_scales), w_q, w_scales, x_q, x_scales)


@pytest.mark.cpu
def test_gemv_cpu_2b4t_projections_int32(rng):
    for M, K in PROJECTIONS_2B4T[1:2] + PROJECTIONS_2B4T[3:]:
        w_q, w_scales, x_q, x_scales = make_problem(rng, M, K, 3)
        check_outputs(bn.pack_ternary(w_q, w_scales), w_q, w_scales, x_q, x_scales, ("int32",))


@pytest.mark.cpu
def test_gemv_extreme_dots(isa):
    """All weights +1 or -1 against all -128 / 127: the largest dots of either sign."""
    K = 4096
    w_q = np.stack([np.ones(K, np.int8), -np.ones(K, np.int8), np.zeros(K, np.int8)])
    x_q = np.stack([np.full(K, -128, np.int8), np.full(K, 127, np.int8)])
    tw = bn.pack_ternary(w_q, 1.0)
    y = bn.gemv_w2a8(tw, x_q, np.ones(2, np.float32), out_dtype="int32")
    np.testing.assert_array_equal(y, [[-128 * K, 128 * K, 0], [127 * K, -127 * K, 0]])


@pytest.mark.cpu
def test_gemv_1d_and_quantized_pipeline(rng):
    """quantize_i2s + quantize_a8 + gemv on a 1-D x approximates the float matmul."""
    w = rng.standard_normal((333, 1024)).astype(np.float32)
    x = rng.standard_normal(1024).astype(np.float32)
    tw = bn.quantize_i2s(w)
    x_q, s = bn.quantize_a8(x)
    y = bn.gemv_w2a8(tw, x_q, s)
    assert y.shape == (333,)
    dot, y64 = ref_gemv(tw.unpack(), tw.scales, x_q[None, :], s)
    np.testing.assert_allclose(y, y64[0], rtol=3e-7)
    # quantization error of ternary weights: loose, only checks the scale conventions
    assert np.corrcoef(y, w @ x)[0, 1] > 0.7


@pytest.mark.cpu
def test_cpu_isa_selection():
    lib = _ffi.lib()
    assert lib.bitnet_cpu_set_isa(4) == 1 and "not 0 (auto)" in _ffi.last_error()
    assert lib.bitnet_cpu_set_isa(-1) == 1
    for index, name in enumerate(bn.ternary.CPU_ISAS[1:], start=1):
        status = lib.bitnet_cpu_set_isa(index)
        if status == 0:
            assert bn.cpu_isa() == name
        else:
            assert status == 2 and "cannot run" in _ffi.last_error()
    bn.set_cpu_isa("auto")
    assert bn.cpu_isa() == cpu_isas()[-1]
    with pytest.raises(InvalidArgumentError):
        bn.set_cpu_isa("sse9")


# ---------------------------------------------------------------- tier 3: GPU


@pytest.mark.gpu
# (7777, 2560) and (6500, 2944): more 16-row tiles than an H100 holds 8-warp blocks of at once, so
# 2 to 8 tokens take the blocks of 5 and 6 warps (plan_mma8); M is not a multiple of 16.
@pytest.mark.parametrize("M,K", PROJECTIONS_2B4T + [(1, 128), (7, 384), (333, 27648), (7777, 2560),
                                 (6500, 2944)])
@pytest.mark.parametrize("N", [1, 3, 8, 9, 16, 33])
def test_gemv_gpu_matches_cpu(rng, M, K, N):
    torch = pytest.importorskip("torch")
    tw, tw_cpu, x_gpu, xs_gpu, x_q, x_scales = torch_problem(torch, rng, M, K, N)
    for out_dtype in ("int32", "float32", "float16", "bfloat16"):
        out = torch.full((N, M), 0x7F, dtype=getattr(torch, out_dtype), device="cuda")
        bn.gemv_w2a8(tw, x_gpu, xs_gpu, out_dtype=out_dtype, out=out)
        want = bn.gemv_w2a8(tw_cpu, x_q, x_scales, out_dtype=out_dtype)
        got = out.cpu()
        if out_dtype in ("float16", "bfloat16"):
            got, want = got.view(torch.int16).numpy(), want.view(np.int16)
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(55296, 5120), (5120, 27648), (20480, 3200)])
@pytest.mark.parametrize("N", [1, 8, 40])
def test_gemv_gpu_large_shapes_int32(rng, M, K, N):
    torch = pytest.importorskip("torch")
    tw, tw_cpu, x_gpu, xs_gpu, x_q, x_scales = torch_problem(torch, rng, M, K, N)
    got = bn.gemv_w2a8(tw, x_gpu, xs_gpu, out_dtype="int32").cpu().numpy()
    np.testing.assert_array_equal(got, bn.gemv_w2a8(tw_cpu, x_q, x_scales, out_dtype="int32"))


@pytest.mark.gpu
def test_gemv_gpu_one_token_over_48k_of_shared_memory_in_any_order(rng):
    """One token keeps x in shared memory (K + 32 bytes). Over 48 KB the kernel's limit is raised,
    and the planner remembers each (kernel, bytes): a smaller K after a larger one (both over 48 KB,
    the same kernel) must leave the limit high enough for the larger one's next call."""
    torch = pytest.importorskip("torch")
    for K in (61440, 53248, 61440):
        tw, tw_cpu, x_gpu, xs_gpu, x_q, x_scales = torch_problem(torch, rng, 37, K, 1)
        got = bn.gemv_w2a8(tw, x_gpu, xs_gpu, out_dtype="int32").cpu().numpy()
        np.testing.assert_array_equal(got, bn.gemv_w2a8(tw_cpu, x_q, x_scales, out_dtype="int32"))


@pytest.mark.gpu
def test_gemv_gpu_device_array_and_quantized_inputs(rng):
    w = rng.standard_normal((2560, 6912)).astype(np.float32)
    x = rng.standard_normal((3, 6912)).astype(np.float32)
    tw = bn.quantize_i2s(bn.DeviceArray.from_numpy(w))
    x_q, s = bn.quantize_a8(bn.DeviceArray.from_numpy(x))
    y = bn.gemv_w2a8(tw, x_q, s, out_dtype="int32")
    assert isinstance(y, bn.DeviceArray)
    tw_cpu = tw.to("cpu")
    np.testing.assert_array_equal(y.numpy(), bn.gemv_w2a8(tw_cpu, x_q.numpy(), s.numpy(),
                                                           out_dtype="int32"))


@pytest.mark.gpu
@pytest.mark.parametrize("scales", (0.75, [0.5, 1.5, 2.0]), ids=("scalar", "list"))
def test_pack_ternary_of_torch_with_host_scales_warns_nothing(rng, scales):
    """Host scales are uploaded beside the torch codes, without torch's warning about a
    read-only numpy array."""
    torch = pytest.importorskip("torch")
    w_q = rng.integers(-1, 2, (3, 128)).astype(np.int8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tw = bn.pack_ternary(torch.from_numpy(w_q).cuda(), scales)
    assert tw.scales.is_cuda
    np.testing.assert_array_equal(tw.scales.cpu().numpy(), np.broadcast_to(np.float32(scales), (3,)))
    np.testing.assert_array_equal(tw.unpack().cpu().numpy(), w_q)


@pytest.mark.gpu
@pytest.mark.parametrize("raw_stream", (True, False), ids=("raw-stream-accessor", "public-api"))
def test_gemv_gpu_on_torch_stream_and_graph(rng, monkeypatch, raw_stream):
    """The op follows torch's current stream (and its graph capture), found by torch's raw
    accessor where it exists, else by torch.cuda.current_stream."""
    torch = pytest.importorskip("torch")
    if not raw_stream:
        monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream", raising=False)
    M, K = 13824, 2560
    tw, tw_cpu, x_gpu, xs_gpu, x_q, x_scales = torch_problem(torch, rng, M, K, 1)
    want = bn.gemv_w2a8(tw_cpu, x_q, x_scales)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x_late = x_gpu.clone()
        torch.cuda._sleep(1_000_000)           # keeps the stream busy: the gemv must wait for it
        x_late.copy_(x_gpu)
        y = bn.gemv_w2a8(tw, x_late, xs_gpu)
    stream.synchronize()
    np.testing.assert_array_equal(y.cpu().numpy(), want)

    out = torch.zeros((1, M), device="cuda")
    x_in = torch.zeros_like(x_gpu)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bn.gemv_w2a8(tw, x_in, xs_gpu, out=out)
    x_in.copy_(x_gpu)
    graph.replay()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(), want)
