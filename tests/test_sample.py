"""Sampling (temperature, top-k, top-p, a Philox draw per row and counter): CPU and CUDA against a
float64 reference of the rule (tokens equal wherever the draw is not within rounding of a
boundary), the distribution by a chi-square test, GPU against CPU, CUDA graph capture; bad input."""
import math

import numpy as np
import pytest

import bitnet_ffi
from bitnet_ffi import _ffi
from bitnet_ffi.errors import InvalidArgumentError

MASK32 = 0xFFFFFFFF


def philox_uniform(seed, row, counter):
    """bn_sample_uniform in Python integers: Philox-4x32-10 of (counter, row, 0x53414D50)."""
    c = [counter & MASK32, row & MASK32, (row >> 32) & MASK32, 0x53414D50]
    k0, k1 = seed & MASK32, seed >> 32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & MASK32, p1 & MASK32, ((p0 >> 32) ^ c[3] ^ k1) & MASK32,
             p0 & MASK32]
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return ((c[0] >> 5) * 67108864.0 + (c[1] >> 6)) / 9007199254740992.0


def order(x):
    """Indices by descending logit, equal logits by lower index (NaN first, -0 after +0)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    key = np.where(bits >> 31 == 1, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    key = np.where(np.isnan(x), 0xFFFFFFFF, key)
    return np.lexsort((np.arange(x.size), -key.astype(np.float64)))


def reference_sample(x, u, temperature, top_k, top_p, margin=5e-7):
    """(token, ok): the rule of docs/sampling.md in float64 (the probabilities from the same float32
    (x - max) / temperature); ok is False where u * mass or the top-p threshold lies within
    `margin` (relative to the mass) of a cumulative boundary, where float rounding may pick either
    side: each float32 expf is within 2 ulp (2.4e-7 relative), so every cumulative sum is within
    2.4e-7 of its float64 value relative to itself (the float64 sums add 1e-16 per term), and the
    top-p threshold's distance to one within 2.4e-7 (top_p z + cum) <= 4.8e-7 z. Without top-k
    and top-p at V = 131072 about 13% of draws fall that close to a boundary (a token's share of
    the mass is often under 1e-5 there)."""
    x = np.asarray(x, np.float32)
    if temperature == 0:
        return int(np.argmax(x)), True
    ranked = order(x)
    best = ranked[0]
    m = x[best]
    if not np.isfinite(m):
        return int(best), True
    p = np.exp(((x - m) / np.float32(temperature)).astype(np.float64))
    if top_k == 0 and top_p >= 1:
        cand, z = np.arange(x.size), p.sum()
    else:
        cand = ranked[:min(top_k or 1024, x.size)]
        z = p[cand].sum() if top_k else p.sum()
    cum = np.cumsum(p[cand])
    ok = True
    kept = cand.size
    if top_p < 1:
        threshold = top_p * z
        kept = min(cand.size, int(np.sum(cum < threshold)) + 1)
        ok &= np.abs(cum - threshold).min() > margin * z
    target = u * cum[kept - 1]
    j = int(np.sum(cum[:kept] <= target))
    ok &= np.abs(cum[:kept] - target).min() > margin * cum[kept - 1]
    return int(cand[min(j, kept - 1)]), bool(ok)


def check_against_reference(index, logits, seed, counters, temperature, top_k, top_p):
    """Every row whose draw has a margin gives the reference's token; returns the rows compared."""
    compared = 0
    for n, row in enumerate(logits):
        want, ok = reference_sample(row, philox_uniform(seed, n, int(counters[n])), temperature,
                                    top_k, top_p)
        if ok:
            assert int(index[n]) == want, f"row {n}: {int(index[n])} != {want}"
            compared += 1
    return compared


def chi_square_limit(df, z=4.75):
    """The chi-square value exceeded with probability about 1e-6 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def expected_distribution(x, temperature, top_k, top_p):
    """The probability of each token under the rule, in float64."""
    x = np.asarray(x, np.float64)
    p = np.exp((x - x.max()) / temperature)
    ranked = order(x.astype(np.float32))
    keep = np.zeros(x.size, bool)
    keep[ranked[:top_k or x.size]] = True
    z = p[keep].sum()
    if top_p < 1:
        cum = np.cumsum(p[ranked][keep[ranked]]) / z
        kept = min(int(np.sum(cum < top_p)) + 1, keep.sum())
        keep[:] = False
        keep[ranked[:kept]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def check_distribution(index, probabilities):
    counts = np.bincount(np.asarray(index).astype(np.int64), minlength=probabilities.size)
    assert counts[probabilities == 0].sum() == 0, "a token outside the kept set was drawn"
    live = probabilities > 0
    expected = probabilities[live] * counts.sum()
    chi2 = float(((counts[live] - expected) ** 2 / expected).sum())
    assert chi2 < chi_square_limit(max(int(live.sum()) - 1, 1)), (chi2, counts, expected)


MODES = [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.9), (40, 0.95), (1024, 1.0), (3, 0.5), (0, 0.3)]


# ---- tier 1: CPU ----

@pytest.mark.cpu
def test_philox_matches_the_python_reference(rng):
    """The CPU's draws are bn_sample_uniform's: with one candidate per unit interval (V equal
    logits, top_k = V, temperature 1), row n draws token floor(u * V) up to rounding."""
    seed = int(rng.integers(0, 2**63)) * 2 + 1
    V = 1000
    logits = np.zeros((64, V), np.float32)
    counters = rng.integers(-2**31, 2**31, 64).astype(np.int32)
    index = bitnet_ffi.sample(logits, seed, counters, top_k=V)
    for n in range(64):
        u = philox_uniform(seed, n, int(counters[n]))
        if abs(u * V - round(u * V)) > 1e-6:
            assert int(index[n]) == int(u * V)


@pytest.mark.cpu
@pytest.mark.parametrize("top_k,top_p", MODES)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
@pytest.mark.parametrize("N,V", [(300, 7), (40, 1000), (6, 5000), (8, 131072)])
def test_cpu_matches_reference(rng, top_k, top_p, temperature, N, V):
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    logits = (rng.standard_normal((N, V)) * 3).astype(np.float32)
    counters = rng.integers(0, 2**31, N).astype(np.int32)
    index = np.full(N, -7, np.int32)
    assert bitnet_ffi.sample(logits, seed, counters, temperature, top_k, top_p, out=index) is index
    compared = check_against_reference(index, logits, seed, counters, temperature, top_k, top_p)
    assert compared >= N // 2
    again = bitnet_ffi.sample(logits, seed, counters, temperature, top_k, top_p)
    np.testing.assert_array_equal(again, index)  # reproducible


@pytest.mark.cpu
def test_cpu_temperature_zero_is_argmax_and_non_finite_rows_give_their_argmax(rng):
    logits = rng.standard_normal((6, 300)).astype(np.float32)
    np.testing.assert_array_equal(bitnet_ffi.sample(logits, 1, np.zeros(6, np.int32), 0.0),
                                  logits.argmax(1))
    logits[1, 17] = np.nan
    logits[1, 40] = np.nan
    logits[2, 99] = np.inf
    logits[3, :] = -np.inf
    logits[4, 5] = -np.inf  # a -inf among finite logits: probability 0, never drawn
    for top_k, top_p in MODES:
        index = bitnet_ffi.sample(logits, 3, np.arange(6, dtype=np.int32), 1.0, top_k, top_p)
        assert list(index[1:4]) == [17, 99, 0]
        assert index[4] != 5


@pytest.mark.cpu
@pytest.mark.parametrize("V", [20, 5000])
def test_cpu_ties_keep_the_lowest_indices(rng, V):
    """Equal logits: top-k keeps the lowest indices, top-p counts them in index order."""
    logits = np.zeros((400, V), np.float32)
    counters = np.arange(400, dtype=np.int32)
    index = bitnet_ffi.sample(logits, 11, counters, top_k=7)
    assert index.max() < 7 and len(set(index.tolist())) == 7
    index = bitnet_ffi.sample(logits, 11, counters, top_p=5.5 / V)
    assert index.max() < 6
    logits[:, 3] = 1.0  # one above, then ties
    index = bitnet_ffi.sample(logits, 11, counters, top_k=3, temperature=0.5)
    assert set(index.tolist()) <= {3, 0, 1}


@pytest.mark.cpu
@pytest.mark.parametrize("top_k,top_p,temperature", [(0, 1.0, 1.0), (3, 1.0, 1.0), (0, 0.8, 1.0),
                                                     (5, 0.9, 0.6), (0, 1.0, 3.0)])
def test_cpu_distribution_chi_square(rng, top_k, top_p, temperature):
    """40000 draws of one small row over counters 0..39999 (and a random seed) follow the rule's
    distribution: the chi-square statistic under its 1e-6 quantile, nothing outside the kept set."""
    x = np.array([1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -3.0, 0.7], np.float32)
    N = 40000
    logits = np.broadcast_to(x, (N, x.size)).copy()
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    index = bitnet_ffi.sample(logits, seed, np.arange(N, dtype=np.int32), temperature, top_k, top_p)
    expected = expected_distribution(x, temperature, top_k, top_p)
    check_distribution(index, expected)
    # the rows alone (one counter for all), and one row over its counters (one call per draw)
    check_distribution(bitnet_ffi.sample(logits, seed, np.full(N, 7, np.int32), temperature, top_k,
                                         top_p), expected)
    one_row = [int(bitnet_ffi.sample(x, seed, [c], temperature, top_k, top_p)) for c in range(400)]
    for c in range(400):
        want, ok = reference_sample(x, philox_uniform(seed, 0, c), temperature, top_k, top_p)
        assert one_row[c] == want or not ok
    assert len(set(one_row)) >= min(3, int((expected > 0).sum()))  # the counter changes the draw


@pytest.mark.cpu
def test_cpu_bad_input(rng):
    lib, ffi = _ffi.lib(), _ffi.ffi
    logits = rng.standard_normal((2, 10)).astype(np.float32)
    out = np.full(2, -7, np.int32)
    counters = np.zeros(2, np.int32)
    cases = [(dict(seed=-1), "seed"), (dict(seed=2**64), "seed"), (dict(seed=1.5), "seed"),
             (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
             (dict(temperature=math.inf), "temperature"), (dict(top_k=-1), "top_k"),
             (dict(top_k=1025), "top_k"), (dict(top_k=2.0), "top_k"), (dict(top_p=0.0), "top_p"),
             (dict(top_p=1.5), "top_p"), (dict(top_p=math.nan), "top_p"),
             (dict(counters=[0]), "counters"), (dict(counters=np.zeros(2, np.int64) + 2**40), "int32"),
             (dict(counters=np.zeros(3, np.int32)), "counters"),
             (dict(logits=logits.astype(np.float16)), "dtype"),
             (dict(logits=np.zeros((2, 3, 4), np.float32)), "shape"),
             (dict(out=np.zeros(3, np.int32)), "out")]
    for change, fragment in cases:
        args = dict(logits=logits, seed=1, counters=counters, out=out) | change
        with pytest.raises(InvalidArgumentError, match=fragment):
            bitnet_ffi.sample(**args)
    assert (out == -7).all()
    p = ffi.cast("float *", logits.ctypes.data)
    c = ffi.cast("int32_t *", counters.ctypes.data)
    o = ffi.cast("int32_t *", out.ctypes.data)
    for args, fragment in [((1.0, 1025, 1.0), "top_k"), ((1.0, 0, 0.0), "top_p"),
                           ((-1.0, 0, 1.0), "temperature"), ((math.nan, 0, 1.0), "temperature")]:
        assert lib.bitnet_sample(-1, p, 2, 10, 1, c, *args, o, ffi.NULL) == lib.BITNET_ERR_INVALID_ARGUMENT
        assert fragment in _ffi.last_error()
    assert (out == -7).all()


# ---- tiers 2 and 3: CUDA ----

def gpu_sample(logits, seed, counters, *args, **kwargs):
    import torch
    out = torch.full((logits.shape[0],), -7, dtype=torch.int32, device="cuda")
    bitnet_ffi.sample(torch.from_numpy(logits).cuda(), seed,
                      torch.from_numpy(np.asarray(counters, np.int32)).cuda(), *args, out=out,
                      **kwargs)
    return out.cpu().numpy()


@pytest.mark.gpu_smoke
def test_gpu_smoke_sample(rng):
    logits = (rng.standard_normal((4, 32000)) * 2).astype(np.float32)
    counters = np.arange(4, dtype=np.int32)
    np.testing.assert_array_equal(gpu_sample(logits, 9, counters, 0.0), logits.argmax(1))
    index = gpu_sample(logits, 9, counters, 0.8, 40, 0.95)
    assert check_against_reference(index, logits, 9, counters, 0.8, 40, 0.95) >= 3


@pytest.mark.gpu
@pytest.mark.parametrize("top_k,top_p", MODES)
@pytest.mark.parametrize("N,V", [(300, 7), (64, 1000), (16, 32000), (8, 131072), (8, 151936)])
def test_gpu_matches_reference_and_cpu(rng, top_k, top_p, N, V):
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    temperature = float(rng.choice([0.6, 1.0, 1.7]))
    logits = (rng.standard_normal((N, V)) * 3).astype(np.float32)
    counters = rng.integers(0, 2**31, N).astype(np.int32)
    gpu = gpu_sample(logits, seed, counters, temperature, top_k, top_p)
    assert check_against_reference(gpu, logits, seed, counters, temperature, top_k, top_p) >= N // 2
    cpu = bitnet_ffi.sample(logits, seed, counters, temperature, top_k, top_p)
    differ = np.flatnonzero(cpu != gpu)
    for n in differ:  # only where the draw is within rounding of a boundary
        assert not reference_sample(logits[n], philox_uniform(seed, int(n), int(counters[n])),
                                    temperature, top_k, top_p)[1]


@pytest.mark.gpu
def test_gpu_ties_non_finite_and_argmax(rng):
    logits = np.zeros((200, 5000), np.float32)
    counters = np.arange(200, dtype=np.int32)
    index = gpu_sample(logits, 11, counters, 1.0, 7)  # radix select: only some of the ties
    assert index.max() < 7 and len(set(index.tolist())) == 7
    np.testing.assert_array_equal(index, bitnet_ffi.sample(logits, 11, counters, top_k=7))
    index = gpu_sample(logits, 11, counters, 1.0, 0, 5.5 / 5000)
    assert index.max() < 6
    x = rng.standard_normal((5, 70000)).astype(np.float32)
    x[1, 17] = x[1, 40] = np.nan
    x[2, 99] = np.inf
    x[3, :] = -np.inf
    for top_k, top_p in MODES:
        index = gpu_sample(x, 3, np.arange(5, dtype=np.int32), 1.0, top_k, top_p)
        assert list(index[1:4]) == [17, 99, 0]
    np.testing.assert_array_equal(gpu_sample(x, 3, np.zeros(5, np.int32), 0.0),
                                  bitnet_ffi.argmax(x))


@pytest.mark.gpu
@pytest.mark.parametrize("top_k,top_p", [(40, 1.0), (0, 0.9), (1024, 0.95)])
@pytest.mark.parametrize("spread", ["distinct", "coarse", "flat"])
def test_gpu_candidate_paths_match_cpu(rng, top_k, top_p, spread):
    """The candidates come from the first pass's top bins staged in shared memory, or where those
    hold more than 8192 logits (coarse: 20000 equal top logits; flat: all equal) from a radix
    select over the row: both keep what the CPU keeps."""
    N, V = 6, 100000
    if spread == "distinct":
        logits = (rng.standard_normal((N, V)) * 3).astype(np.float32)
    elif spread == "coarse":
        logits = np.round(rng.standard_normal((N, V))).astype(np.float32)
        logits[:, rng.permutation(V)[:20000]] = 3.0
    else:
        logits = np.zeros((N, V), np.float32)
    counters = rng.integers(0, 2**31, N).astype(np.int32)
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    gpu = gpu_sample(logits, seed, counters, 1.0, top_k, top_p)
    cpu = bitnet_ffi.sample(logits, seed, counters, 1.0, top_k, top_p)
    for n in np.flatnonzero(cpu != gpu):
        assert not reference_sample(logits[n], philox_uniform(seed, int(n), int(counters[n])), 1.0,
                                    top_k, top_p)[1]
    assert check_against_reference(gpu, logits, seed, counters, 1.0, top_k, top_p) >= N // 2


@pytest.mark.gpu
@pytest.mark.parametrize("top_k,top_p,temperature", [(0, 1.0, 1.0), (3, 1.0, 1.0), (0, 0.8, 1.0),
                                                     (5, 0.9, 0.6)])
def test_gpu_distribution_chi_square(rng, top_k, top_p, temperature):
    x = np.array([1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -3.0, 0.7], np.float32)
    N = 40000
    logits = np.broadcast_to(x, (N, x.size)).copy()
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    index = gpu_sample(logits, seed, np.arange(N, dtype=np.int32), temperature, top_k, top_p)
    check_distribution(index, expected_distribution(x, temperature, top_k, top_p))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_counters_advanced_on_the_device(rng):
    """sample + add_int32 captured in one graph: each replay draws at the next counters, as eager
    calls at those counters do, with no host involvement."""
    import torch
    N, V = 4, 50000
    logits = torch.from_numpy((rng.standard_normal((N, V)) * 2).astype(np.float32)).cuda()
    counters = torch.tensor([0, 10, 20, 30], dtype=torch.int32, device="cuda")
    out = torch.full((N,), -1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        bitnet_ffi.sample(logits, 5, counters, 0.9, 50, 0.9, out=out)  # warm-up (reads only)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            bitnet_ffi.sample(logits, 5, counters, 0.9, 50, 0.9, out=out)
            bitnet_ffi.add_int32(counters, 1)
    stream.synchronize()
    host = logits.cpu().numpy()
    for step in range(3):
        graph.replay()
        torch.cuda.synchronize()
        want = bitnet_ffi.sample(host, 5, np.array([0, 10, 20, 30], np.int32) + step, 0.9, 50, 0.9)
        np.testing.assert_array_equal(out.cpu().numpy(), want)


@pytest.mark.gpu
def test_gpu_bad_input(rng):
    import torch
    lib, ffi = _ffi.lib(), _ffi.ffi
    logits = torch.randn(2, 100, device="cuda")
    out = torch.full((2,), -7, dtype=torch.int32, device="cuda")
    counters = torch.zeros(2, dtype=torch.int32, device="cuda")
    host = np.zeros(2, np.int32)
    status = lib.bitnet_sample(0, ffi.cast("float *", logits.data_ptr()), 2, 100, 1,
                               ffi.cast("int32_t *", host.ctypes.data), 1.0, 0, 1.0,
                               ffi.cast("int32_t *", out.data_ptr()), ffi.NULL)
    assert status == lib.BITNET_ERR_INVALID_ARGUMENT and "host memory" in _ffi.last_error()
    with pytest.raises(InvalidArgumentError, match="counters is on cpu"):
        bitnet_ffi.sample(logits, 1, torch.zeros(2, dtype=torch.int32), out=out)
    with pytest.raises(InvalidArgumentError, match="top_k"):
        bitnet_ffi.sample(logits, 1, counters, top_k=2000, out=out)
    torch.cuda.synchronize()
    assert (out == -7).all()
