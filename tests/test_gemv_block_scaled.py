"""gemv_w2a8 on weights with a scale per 256-weight block (bitnet_gemv_w2a8_block_scaled) against
a float64 numpy reference: every CPU SIMD path the machine runs (tier 1), the GPU (tier 3), bad
input in Python (at the C ABI: test_bad_input_matrix.py).

Bound (bitnet.h): each block's dot is exact; its product with the block scale and the float32 sum
of the K/256 products, then the row and token scales, are K/256 + 3 float32 roundings at most, so
the float32 result is within (K/256 + 3) * 2^-24 * S of the exact value, S = sum_b |block_scale *
dot_b * w_scale / x_scale|. float16 and bfloat16 add half a unit of their last place of the
result."""
import numpy as np
import pytest

import bitnet_ffi as bn
from bitnet_ffi.errors import InvalidArgumentError

from reference import make_problem

BLOCK = 256
HALF_ULP = {"float32": 0.0, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def block_problem(rng, M, K, N):
    w_q, w_scales, x_q, x_scales = make_problem(rng, M, K, N)
    block_scales = rng.uniform(0.25, 4.0, (M, K // BLOCK)).astype(np.float32)
    block_scales[0, 0] = 0.0  # a block of scale 0, as llama.cpp writes for a block of zeros
    return w_q, w_scales, block_scales, x_q, x_scales


def ref_block_gemv(w_q, w_scales, block_scales, x_q, x_scales):
    """(float64 y [N, M], the bound's S [N, M])."""
    N, K = x_q.shape
    blocks = K // BLOCK
    dots = np.einsum("nbk,mbk->nmb", x_q.reshape(N, blocks, BLOCK).astype(np.float64),
                     w_q.reshape(-1, blocks, BLOCK).astype(np.float64))
    terms = dots * block_scales.astype(np.float64)[None] * \
        (w_scales.astype(np.float64)[None, :] / x_scales.astype(np.float64)[:, None])[..., None]
    return terms.sum(axis=2), np.abs(terms).sum(axis=2)


FLOAT16_TO_INF = 65520.0  # float16 rounds this magnitude and above to inf


def check(y, y64, s, K, out_dtype):
    y = np.asarray(y, dtype=np.float64)
    bound = (K // BLOCK + 3) * 2.0 ** -24 * s * (1 + HALF_ULP[out_dtype]) + \
        HALF_ULP[out_dtype] * np.abs(y64) * 1.0001 + 1e-30
    inside = np.ones(y.shape, bool)
    if out_dtype == "float16":  # outside its range: inf of the value's sign
        over = np.abs(y64) - bound > FLOAT16_TO_INF
        np.testing.assert_array_equal(y[over], np.copysign(np.inf, y64[over]))
        inside = np.abs(y64) + bound < FLOAT16_TO_INF
    assert np.isfinite(y[inside]).all()
    err = np.abs(y - y64)[inside]
    assert (err <= bound[inside]).all(), f"max error / bound {np.max(err / bound[inside]):.3f}"


def run(tw, x_q, x_scales, out_dtype, like):
    out = np.full((x_q.shape[0], tw.shape[0]), 0x7F, bn._arrays.numpy_dtype(out_dtype))  # poison
    if like is not None:
        out = like(out)
    y = bn.gemv_w2a8(tw, x_q, x_scales, out_dtype=out_dtype, out=out)
    assert y is out
    return y


# ---------------------------------------------------------------- tier 1: CPU


@pytest.mark.cpu
@pytest.mark.parametrize("M,K,N", [(1, 256, 1), (7, 768, 3), (333, 2560, 8), (64, 1280, 33),
                                   (37, 6912, 5), (5, 27648, 2)])
def test_block_scaled_cpu_matches_reference(rng, isa, M, K, N):
    w_q, w_scales, block_scales, x_q, x_scales = block_problem(rng, M, K, N)
    tw = bn.pack_ternary(w_q, w_scales, block_scales=block_scales)
    y64, s = ref_block_gemv(w_q, w_scales, block_scales, x_q, x_scales)
    for out_dtype in ("float32", "float16", "bfloat16"):
        y = run(tw, x_q, x_scales, out_dtype, None)
        check(y.astype(np.float32), y64, s, K, out_dtype)


@pytest.mark.cpu
def test_block_scaled_with_equal_scales_is_the_plain_gemv(rng):
    """Every block scale 1: the same float32 values as the plain GEMV (one product by 1, exact sums
    of integers in float32 while they stay under 2^24)."""
    w_q, w_scales, _, x_q, x_scales = block_problem(rng, 40, 1024, 4)
    plain = bn.gemv_w2a8(bn.pack_ternary(w_q, w_scales), x_q, x_scales)
    ones = np.ones((40, 1024 // BLOCK), np.float32)
    blocked = bn.gemv_w2a8(bn.pack_ternary(w_q, w_scales, block_scales=ones), x_q, x_scales)
    np.testing.assert_array_equal(blocked, plain)


@pytest.mark.cpu
def test_block_scaled_weights_in_python(rng):
    w_q = rng.integers(-1, 2, (3, 512), dtype=np.int8)
    block_scales = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    tw = bn.pack_ternary(w_q, 0.5, block_scales=block_scales)
    assert "block_scales" in repr(tw) and tw.to("cpu") is tw
    dense = tw.unpack() * tw.scales[:, None] * np.repeat(tw.block_scales, BLOCK, axis=1)
    np.testing.assert_array_equal(dense, w_q * 0.5 * np.repeat(block_scales, BLOCK, axis=1))
    x_q, s = bn.quantize_a8(rng.standard_normal((2, 512)).astype(np.float32))
    with pytest.raises(InvalidArgumentError, match="int32"):
        bn.gemv_w2a8(tw, x_q, s, out_dtype="int32")
    with pytest.raises(InvalidArgumentError, match="multiple of the scale block"):
        bn.pack_ternary(w_q[:, :384].copy(), 1.0, block_scales=np.ones((3, 1), np.float32))
    with pytest.raises(InvalidArgumentError, match="block_scales"):
        bn.pack_ternary(w_q, 1.0, block_scales=np.ones((3, 3), np.float32))
    with pytest.raises(InvalidArgumentError, match="block_scales"):
        bn.TernaryWeights(tw.packed, tw.scales, np.ones((3, 2), np.float64))


# ---------------------------------------------------------------- tier 3: GPU


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(1, 256), (7, 768), (2560, 2560), (3840, 2560), (2560, 6912),
                                 (333, 27648), (4099, 8448)])
@pytest.mark.parametrize("N", [1, 3, 8, 17, 40])
def test_block_scaled_gpu_matches_reference(rng, M, K, N):
    torch = pytest.importorskip("torch")
    w_q, w_scales, block_scales, x_q, x_scales = block_problem(rng, M, K, N)
    tw_cpu = bn.pack_ternary(w_q, w_scales, block_scales=block_scales)
    tw = tw_cpu.to("cuda")
    y64, s = ref_block_gemv(w_q, w_scales, block_scales, x_q, x_scales)
    x_gpu, xs_gpu = torch.from_numpy(x_q).cuda(), torch.from_numpy(x_scales).cuda()
    for out_dtype in ("float32", "float16", "bfloat16"):
        out = torch.full((N, M), 0x7F, dtype=getattr(torch, out_dtype), device="cuda")
        assert bn.gemv_w2a8(tw, x_gpu, xs_gpu, out_dtype=out_dtype, out=out) is out
        check(out.float().cpu().numpy(), y64, s, K, out_dtype)


@pytest.mark.gpu
def test_block_scaled_gpu_in_a_graph_on_the_torch_stream(rng):
    torch = pytest.importorskip("torch")
    w_q, w_scales, block_scales, x_q, x_scales = block_problem(rng, 2560, 6912, 1)
    tw = bn.pack_ternary(w_q, w_scales, block_scales=block_scales).to("cuda")
    y64, s = ref_block_gemv(w_q, w_scales, block_scales, x_q, x_scales)
    x_in = torch.zeros((1, 6912), dtype=torch.int8, device="cuda")
    xs_gpu = torch.from_numpy(x_scales).cuda()
    out = torch.zeros((1, 2560), device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            bn.gemv_w2a8(tw, x_in, xs_gpu, out=out)
        x_in.copy_(torch.from_numpy(x_q).cuda())
        graph.replay()
    stream.synchronize()
    check(out.cpu().numpy(), y64, s, 6912, "float32")
