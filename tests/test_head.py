"""The output head (dense bfloat16 GEMV), argmax and embedding, and graph capture through
libbitnet's own streams: CPU vs the float64 reference (tier 1), GPU vs CPU and reference (tier 3)."""
import numpy as np
import pytest

import bitnet_ffi
from bitnet_ffi import _ffi

from reference import BF16, random_bf16


def gemv_error(got, w, x):
    """The error of got = x·wᵀ relative to |x|·|w|ᵀ, the scale that bounds a float32 dot product's
    rounding: relative to |x·wᵀ| itself, a dot product that cancels (K = 8) inflates it."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    magnitude = np.abs(x64) @ np.abs(w64).T
    return np.linalg.norm(got.astype(np.float64) - x64 @ w64.T) / np.linalg.norm(magnitude)


# float32 accumulation over K products of bfloat16 values: the sum's rounding error is far under
# 1e-5 of |x|·|w|ᵀ; a bfloat16 output adds its own rounding (2^-9 of |y| ≤ |x|·|w|ᵀ).
BOUND = {"float32": 1e-5, "bfloat16": 4e-3}


@pytest.mark.cpu
@pytest.mark.parametrize("M,K,N", [(1, 8, 1), (333, 2560, 1), (1000, 104, 3), (77, 2560, 9)])
@pytest.mark.parametrize("x_dtype,out_dtype", [("bfloat16", "float32"), ("float32", "float32"),
                                               ("bfloat16", "bfloat16")])
def test_gemv_bf16_cpu_matches_reference(rng, M, K, N, x_dtype, out_dtype):
    w = random_bf16(rng, (M, K))
    x = rng.standard_normal((N, K)).astype(BF16 if x_dtype == "bfloat16" else np.float32)
    out = np.full((N, M), np.nan, dtype=BF16 if out_dtype == "bfloat16" else np.float32)
    y = bitnet_ffi.gemv_bf16(w, x, out_dtype=out_dtype, out=out)
    assert y is out and np.isfinite(y.astype(np.float32)).all()
    assert gemv_error(y, w, x) < BOUND[out_dtype]


@pytest.mark.cpu
def test_gemv_bf16_one_token_vector(rng):
    w, x = random_bf16(rng, (50, 64)), random_bf16(rng, (64,))
    y = bitnet_ffi.gemv_bf16(w, x)
    assert y.shape == (50,) and y.dtype == np.float32
    assert gemv_error(y[None], w, x[None]) < BOUND["float32"]


@pytest.mark.cpu
@pytest.mark.parametrize("N,M", [(1, 1), (3, 128256), (5, 1001)])
def test_argmax_cpu_matches_numpy(rng, N, M):
    x = rng.standard_normal((N, M)).astype(np.float32)
    x[0, rng.integers(M)] = 1e30
    np.testing.assert_array_equal(bitnet_ffi.argmax(x), np.argmax(x, axis=1))


@pytest.mark.cpu
def test_argmax_ties_and_nan_follow_numpy():
    x = np.array([[1, 5, 5, 2], [np.nan, 9, np.nan, 1], [-np.inf, -np.inf, -np.inf, -np.inf],
                  [3, 2, 1, np.nan]], dtype=np.float32)
    out = np.full(4, -7, dtype=np.int32)
    bitnet_ffi.argmax(x, out=out)
    np.testing.assert_array_equal(out, np.argmax(x, axis=1))


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
def test_embedding_cpu(rng, dtype):
    table = rng.standard_normal((1000, 72)).astype(dtype)
    ids = np.array([999, 0, 17, 17], dtype=np.int32)
    np.testing.assert_array_equal(bitnet_ffi.embedding(table, ids), table[ids])


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N", [(128256, 2560, 1), (128256, 2560, 8), (1001, 2560, 3),
                                   (333, 96, 2), (77, 136, 11), (16, 64, 17), (333, 96, 16),
                                   (1001, 2560, 33), (128256, 2560, 64), (77, 160, 100),
                                   (77, 128, 9), (1001, 2560, 100), (333, 2560, 200)])
@pytest.mark.parametrize("x_dtype", ["bfloat16", "float32"])
def test_gemv_bf16_gpu_matches_cpu_and_reference(rng, M, K, N, x_dtype):
    """Covers the GPU kernels: one token or float32 x on CUDA cores (tiles of 8 tokens), 2 or
    more bfloat16 tokens (K a multiple of 32) on tensor cores in tiles of 8, 16, 32 or 64, with M
    not a multiple of 16 and more tokens than one tile; on compute capability 9.0, 9 or more
    bfloat16 tokens with K a multiple of 64 on wgmma in tiles of 64 or 128 tokens, short of a tile
    (9, 17, 33, 100) and over two (200)."""
    torch = pytest.importorskip("torch")
    w = random_bf16(rng, (M, K))
    x = random_bf16(rng, (N, K)) if x_dtype == "bfloat16" else rng.standard_normal((N, K)).astype(np.float32)
    cpu = bitnet_ffi.gemv_bf16(w, x)
    wt = torch.from_numpy(w.view(np.int16)).cuda().view(torch.bfloat16)
    xt = (torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16) if x_dtype == "bfloat16"
          else torch.from_numpy(x).cuda())
    out = torch.full((N, M), float("nan"), device="cuda")
    gpu = bitnet_ffi.gemv_bf16(wt, xt, out=out).cpu().numpy()
    assert np.isfinite(gpu).all()
    assert gemv_error(gpu, w, x) < BOUND["float32"] and gemv_error(cpu, w, x) < BOUND["float32"]
    out_bf16 = torch.full((N, M), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = bitnet_ffi.gemv_bf16(wt, xt, out_dtype="bfloat16", out=out_bf16).float().cpu().numpy()
    assert gemv_error(got, w, x) < BOUND["bfloat16"]


@pytest.mark.gpu
@pytest.mark.parametrize("M", [3000, 16384, 40001, 128256])
def test_argmax_gpu_matches_numpy(rng, M):
    """Long rows are split over the blocks of a cluster (sm_90): ties and NaNs in different slices
    still give numpy's answer, the first one."""
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((8, M)).astype(np.float32)
    x[3, :] = 2.0  # all ties: the first index wins
    x[4, [M // 3, M - 5]] = 1e30  # equal maxima in different slices
    x[5, [100, M - 1]] = np.nan
    x[6, M - 1] = np.inf
    x[7, :] = -np.inf
    idx = bitnet_ffi.argmax(torch.from_numpy(x).cuda()).cpu().numpy()
    np.testing.assert_array_equal(idx, np.argmax(x, axis=1))


@pytest.mark.gpu
def test_argmax_first_call_inside_a_graph_capture(first_call_in_a_graph_capture):
    """The first long-row argmax of a process may come inside a graph capture (the cluster size
    the device can place is looked up then): it captures, replays and is right. A fresh process,
    since the lookup happens once per process."""
    printed = first_call_in_a_graph_capture(
        "import numpy as np, bitnet_ffi\n"
        "x = np.zeros((2, 128256), np.float32); x[0, 99999] = 1; x[1, 7] = 1\n"
        "xd = bitnet_ffi.DeviceArray.from_numpy(x)\n"
        "out = bitnet_ffi.DeviceArray((2,), 'int32')\n",
        "bitnet_ffi.argmax(xd, out=out, stream=stream)",
        "print(out.numpy().tolist())\n")
    assert printed.strip() == "[99999, 7]"


@pytest.mark.gpu
def test_embedding_gpu_matches_cpu(rng):
    torch = pytest.importorskip("torch")
    table = random_bf16(rng, (1000, 2560))
    ids = rng.integers(0, 1000, size=9).astype(np.int32)
    table_t = torch.from_numpy(table.view(np.int16)).cuda().view(torch.bfloat16)
    got = bitnet_ffi.embedding(table_t, torch.from_numpy(ids).cuda())
    np.testing.assert_array_equal(got.view(torch.int16).cpu().numpy(), table[ids].view(np.int16))
    bad = bitnet_ffi.embedding(table_t, torch.tensor([1, 5000], dtype=torch.int32, device="cuda"))
    assert torch.isnan(bad[1].float()).all() and torch.equal(bad[0], table_t[1])


@pytest.mark.gpu
def test_graph_capture_replays_the_ops(rng):
    w, x = random_bf16(rng, (4096, 2560)), random_bf16(rng, (1, 2560))
    wd, xd = bitnet_ffi.DeviceArray.from_numpy(w), bitnet_ffi.DeviceArray.from_numpy(x)
    logits = bitnet_ffi.DeviceArray((1, 4096), "float32")
    index = bitnet_ffi.DeviceArray((1,), "int32")
    stream = bitnet_ffi.Stream(0)
    with bitnet_ffi.Graph.capture(stream) as graph:
        bitnet_ffi.gemv_bf16(wd, xd, out=logits, stream=stream)
        bitnet_ffi.argmax(logits, out=index, stream=stream)
    _ffi.call("memset", _ffi.ffi.cast("void *", index.ptr), 0xFF, 4, stream.handle)
    graph.launch()
    stream.synchronize()
    got = logits.numpy()
    assert gemv_error(got, w, x) < BOUND["float32"]
    assert index.numpy()[0] == np.argmax(got[0])  # of the logits it was given: no near-tie flake
    assert graph.time_ms(5) > 0
