"""gemv_w2a8 at many tokens on the GPU, where it runs the tensor-core GEMM (gemm_w2a8.cu): the int32
dot bit-exact against the CPU backend (on a subset of tokens for large N: the CPU's cost is N * M * K)
and against an exact float64 product on the GPU for all tokens (|dot| < 2^31, so float64 is exact);
float outputs bit for bit the rule float32(float32(dot) * w_scale) / x_scale of the GEMV (the same
bound: two float32 roundings, within 3e-7 relative of the float64 value), float16/bfloat16 that
float32 value rounded to nearest even. Outputs are poisoned before each call; seeds are printed."""
import numpy as np
import pytest

import bitnet_ffi as bn

# (M, K, row_segments): the 2B4T projections (QKV fused with its three scales, gate|up with two),
# odd M, M below one block of rows, K of one 128-weight tile.
SHAPES = [(2560, 2560, None), (3840, 2560, [2560, 640, 640]), (13824, 2560, [6912, 6912]),
          (2560, 6912, None), (333, 384, None), (1001, 1280, [500, 501]), (7, 128, None)]
# 5 and 12: the GEMV's 8- and 16-token launches, and on 13824x2560 (2^25+ weights) 12 and 16 the
# wgmma kernel's 16-token tiles (sm_90); 31, 80 and 127: short of its 64-, 96- and 128-token tiles,
# whose x boxes then hold only N rows; 200: the small matrices' 64-token tiles with K split over
# clusters.
TOKENS = [5, 12, 16, 17, 31, 64, 80, 100, 127, 200, 960, 4096]
CPU_TOKENS = 24  # tokens checked against the CPU backend when N is larger


def quantized_problem(torch, rng, M, K, N, row_segments):
    """Weights from quantize_i2s of random floats (scales per row segment); x with its extremes."""
    w = torch.from_numpy(rng.standard_normal((M, K), dtype=np.float32))
    tw_cpu = bn.quantize_i2s(w.numpy(), row_segments=row_segments)
    tw = bn.TernaryWeights(torch.from_numpy(tw_cpu.packed).cuda(), torch.from_numpy(tw_cpu.scales).cuda())
    x_q = rng.integers(-128, 128, (N, K), dtype=np.int8)
    x_q[0, :] = -128  # the extreme dots: every weight at -128 and at 127
    x_q[-1, :] = 127
    x_scales = rng.uniform(1.0, 300.0, N).astype(np.float32)
    return tw, tw_cpu, x_q, x_scales


def checked_tokens(rng, N):
    if N <= CPU_TOKENS:
        return np.arange(N)
    picked = rng.choice(np.arange(1, N - 1), CPU_TOKENS - 2, replace=False)
    return np.sort(np.concatenate([[0, N - 1], picked]))


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,row_segments", SHAPES, ids=[f"{m}x{k}" for m, k, _ in SHAPES])
@pytest.mark.parametrize("N", TOKENS)
def test_gemm_gpu_matches_cpu(rng, M, K, row_segments, N):
    check_against_cpu(rng, M, K, row_segments, N)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [9, 16, 17, 31])
def test_gemm_gpu_narrow_tiles_match_cpu(rng, N):
    """A matrix of 2^26+ weights, where the wgmma kernel (sm_90) takes 16-token tiles from 9 tokens
    and 32-token tiles at 17-32 (on other GPUs the same call runs the GEMV or the mma.sync GEMM)."""
    check_against_cpu(rng, 5120, 13824, [2560, 2560], N)


def check_against_cpu(rng, M, K, row_segments, N):
    """gemv_w2a8 on the GPU in every output dtype: against the exact float64 product and the
    epilogue's rule for all tokens, bit for bit against the CPU backend on checked_tokens."""
    torch = pytest.importorskip("torch")
    tw, tw_cpu, x_q, x_scales = quantized_problem(torch, rng, M, K, N, row_segments)
    x_gpu, xs_gpu = torch.from_numpy(x_q).cuda(), torch.from_numpy(x_scales).cuda()
    w_q = torch.from_numpy(tw_cpu.unpack()).cuda().double()
    exact = x_gpu.double() @ w_q.T  # exact: integers below 2^53
    ws, xs = tw.scales, xs_gpu
    rule = (exact.float() * ws[None, :]) / xs[:, None]  # IEEE float32 multiply and divide
    rows = checked_tokens(rng, N)
    for out_dtype in ("int32", "float32", "float16", "bfloat16"):
        out = torch.full((N, M), 0x7F, dtype=getattr(torch, out_dtype), device="cuda")
        bn.gemv_w2a8(tw, x_gpu, xs_gpu, out_dtype=out_dtype, out=out)
        want_cpu = bn.gemv_w2a8(tw_cpu, x_q[rows], x_scales[rows], out_dtype=out_dtype)
        got = out.cpu()
        if out_dtype == "int32":
            assert torch.equal(out, exact.to(torch.int32))
        elif out_dtype == "float32":
            assert torch.equal(out, rule)
            np.testing.assert_allclose(got.numpy(), (exact * ws.double()[None, :] / xs.double()[:, None])
                                       .cpu().numpy(), rtol=3e-7, atol=0)
        else:
            assert torch.equal(out.view(torch.int16), rule.to(out.dtype).view(torch.int16))
        if out_dtype in ("float16", "bfloat16"):
            got, want_cpu = got.view(torch.int16), want_cpu.view(np.int16)
        np.testing.assert_array_equal(got.numpy()[rows], want_cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,row_segments,N", [
    (2560, 2560, None, 300), (2560, 2560, None, 480), (3840, 2560, [2560, 640, 640], 500),
    (1001, 1280, [500, 501], 333)])
def test_gemm_gpu_small_matrix_tiles_past_256_tokens(rng, M, K, row_segments, N):
    """Matrices of fewer than 2^24 weights at 257-512 tokens, where the wgmma kernel (sm_90, 132 SMs)
    takes 64-, 96- and 128-token tiles with K split over 2 (small_matrix_tokens): 2560x2560 at 300
    and 1001x1280 at 333 the 64-token tiles, 2560x2560 at 480 the 96-token ones, 3840x2560 at 500
    the 128-token ones."""
    check_against_cpu(rng, M, K, row_segments, N)


@pytest.mark.gpu
def test_gemm_gpu_large_shapes_int32(rng):
    """The benchmark's two large shapes at a block-straddling N, against the float64 product."""
    torch = pytest.importorskip("torch")
    for M, K in ((5120, 27648), (55296, 5120)):
        N = 257
        packed = torch.randint(0, 3, (4, M, K // 4), dtype=torch.uint8, device="cuda")
        packed = packed[0] | packed[1] << 2 | packed[2] << 4 | packed[3] << 6
        tw = bn.TernaryWeights(packed, torch.ones(M, device="cuda"))
        x = torch.from_numpy(rng.integers(-128, 128, (N, K), dtype=np.int8)).cuda()
        out = torch.full((N, M), 0x7F, dtype=torch.int32, device="cuda")
        bn.gemv_w2a8(tw, x, torch.ones(N, device="cuda"), out_dtype="int32", out=out)
        w_q = tw.unpack().double()
        assert torch.equal(out, (x.double() @ w_q.T).to(torch.int32))


@pytest.mark.gpu
def test_gemm_gpu_pieces_first_called_inside_a_graph_capture(first_call_in_a_graph_capture):
    """The GEMM's pieces take scratch memory from a pool that the library makes on first use; when
    that first use comes inside a graph capture (a captured model pass, as TPSession.prefill's
    first), the pool is still made and the graph replays the right dots. A fresh process, since the
    pool is made once per process. 2560x6912 at 2048 tokens runs in pieces on an H100."""
    printed = first_call_in_a_graph_capture(
        "import numpy as np, bitnet_ffi\n"
        "rng = np.random.default_rng(3)\n"
        "M, K, N = 2560, 6912, 2048\n"
        "w_q = rng.integers(-1, 2, (M, K), dtype=np.int8)\n"
        "w = bitnet_ffi.pack_ternary(bitnet_ffi.DeviceArray.from_numpy(w_q),\n"
        "                            bitnet_ffi.DeviceArray.from_numpy(np.ones(M, np.float32)))\n"
        "x = rng.integers(-128, 128, (N, K), dtype=np.int8)\n"
        "xd = bitnet_ffi.DeviceArray.from_numpy(x)\n"
        "sd = bitnet_ffi.DeviceArray.from_numpy(np.ones(N, np.float32))\n"
        "out = bitnet_ffi.DeviceArray((N, M), 'int32')\n",
        "bitnet_ffi.gemv_w2a8(w, xd, sd, out_dtype='int32', out=out, stream=stream)",
        "want = x[:64].astype(np.int64) @ w_q.astype(np.int64).T\n"
        "print(int(np.abs(out.numpy()[:64] - want).max()))\n")
    assert int(printed) == 0


@pytest.mark.gpu
def test_gemm_gpu_splits_the_last_tiles_into_pieces(rng):
    """Problems of a few more 128 x 128 tiles than the GPU has SMs (odd M, a part token tile): on
    compute capability 9.0 the tiles past the whole waves run in pieces along K (4, 3 and 2 pieces
    here on 132 SMs), the last piece of each adding up the others' dots (gemm_w2a8.cu). int32
    against the float64 product, a second call (the pieces' counters start from zero again), and
    replays of a CUDA graph that captured it (its scratch memory is then a graph allocation)."""
    torch = pytest.importorskip("torch")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    N = 100
    for rest, K in ((5, 8192), (sms // 3, 8192), (1, 4096)):
        M = 128 * (sms + rest) - 37
        codes = torch.randint(0, 3, (4, M, K // 4), dtype=torch.uint8, device="cuda")
        packed = codes[0] | codes[1] << 2 | codes[2] << 4 | codes[3] << 6
        tw = bn.TernaryWeights(packed, torch.ones(M, device="cuda"))
        x = torch.from_numpy(rng.integers(-128, 128, (N, K), dtype=np.int8)).cuda()
        x_scales = torch.ones(N, device="cuda")
        want = (x.double() @ tw.unpack().double().T).to(torch.int32)
        out = torch.empty((N, M), dtype=torch.int32, device="cuda")
        for _ in range(2):
            out.fill_(0x7F)
            bn.gemv_w2a8(tw, x, x_scales, out_dtype="int32", out=out)
            assert torch.equal(out, want), (M, K)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            bn.gemv_w2a8(tw, x, x_scales, out_dtype="int32", out=out)
        for _ in range(2):
            out.fill_(0x7F)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), (M, K, "graph")


@pytest.mark.gpu
def test_gemm_gpu_wide_tiles_and_a_last_token_tile_box_inside_x(rng):
    """On compute capability 9.0 (gemm_w2a8.cu): odd M of sms // 6 row tiles at 900 tokens takes the
    160-token tiles (one wave of them, where the 128-token ones are more than the SMs), and at 200
    tokens over K = 6912 the 128-token tiles with K split over clusters; in both the last token tile
    is short, so its x box starts before it (at N - 160 or N - 128) and it stores only its own
    tokens. int32 against the float64 product, and float32 against the GEMV's rule."""
    torch = pytest.importorskip("torch")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for M, K, N in ((128 * (sms // 6) - 37, 2560, 900), (2560 - 37, 6912, 200)):
        codes = torch.randint(0, 3, (4, M, K // 4), dtype=torch.uint8, device="cuda")
        packed = codes[0] | codes[1] << 2 | codes[2] << 4 | codes[3] << 6
        tw = bn.TernaryWeights(packed, torch.from_numpy(rng.uniform(0.5, 2.0, M).astype(np.float32)).cuda())
        x = torch.from_numpy(rng.integers(-128, 128, (N, K), dtype=np.int8)).cuda()
        x_scales = torch.from_numpy(rng.uniform(1.0, 300.0, N).astype(np.float32)).cuda()
        exact = x.double() @ tw.unpack().double().T
        for out_dtype, want in (("int32", exact.to(torch.int32)),
                                ("float32", (exact.float() * tw.scales[None, :]) / x_scales[:, None])):
            out = torch.full((N, M), 0x7F, dtype=getattr(torch, out_dtype), device="cuda")
            bn.gemv_w2a8(tw, x, x_scales, out_dtype=out_dtype, out=out)
            assert torch.equal(out, want), (M, K, N, out_dtype)
