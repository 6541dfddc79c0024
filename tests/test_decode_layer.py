"""bitnet_decode_layer, one BitNet layer of a one-token decode step fused: the CPU against the
unfused op sequence (bit for bit) and a float64 reference; the GPU against the unfused GPU sequence
and the CPU, over a few decode steps and at 2B4T's shapes; a GPU position out of range; a CUDA
graph. The one-argument bad-input cases are in test_bad_input_matrix.py."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import bitnet_ffi as bn
from bitnet_ffi import _arrays
from bitnet_ffi.decode_layer import fused_layer_supported
from bitnet_ffi.errors import InvalidArgumentError
from bitnet_ffi.model import Layer, Weights
from bitnet_ffi.ternary import TernaryWeights

from reference import (decode_config, decode_layer_case, ref_gemv, reference_attention,
                       reference_rmsnorm, reference_rmsnorm_quantize, reference_rope, to_torch)


def reference_layer(config, layer, h, k_cache, v_cache, p):
    """The layer in float64, every intermediate rounded to h's dtype where the op stores it and each
    projection's input quantized to int8 by the rule of the norm before it (quantize_a8's without
    a sub-norm): (h after the layer, k_cache row p, v_cache row p) as float64."""
    def stored(x):
        return np.asarray(x).astype(h.dtype).astype(np.float64)

    def project(w, x, norm, eps):
        y = x if norm is None else reference_rmsnorm(x[None], norm, eps)[0][0]
        codes, scales, _ = reference_rmsnorm_quantize(y[None])
        return stored(ref_gemv(w.unpack(), w.scales, codes, scales)[1][0])

    Hq, Hkv, D, I = config.heads, config.kv_heads, config.head_dim, config.intermediate
    Q, KV = Hq * D, Hkv * D
    qkv = project(layer.qkv, h.astype(np.float64), layer.attn_norm, config.eps)
    q = stored(reference_rope(qkv[:Q].reshape(1, 1, Hq, D), [p], config.theta))
    keys, values = k_cache.astype(np.float64), v_cache.astype(np.float64)
    keys[p] = stored(reference_rope(qkv[Q:Q + KV].reshape(1, 1, Hkv, D), [p], config.theta))[0, 0]
    values[p] = qkv[Q + KV:].reshape(Hkv, D)
    a = stored(reference_attention(q, keys[None], values[None], True, config.attention_scale,
                                   [p + 1]))
    h = stored(h.astype(np.float64) + project(layer.o, a.reshape(Q), layer.attn_sub_norm,
                                              config.attn_sub_eps))
    gate_up = project(layer.gate_up, h, layer.ffn_norm, config.eps)
    g, u = gate_up[:I], gate_up[I:]
    act = np.maximum(g, 0) ** 2 if config.activation == "relu2" else g / (1 + np.exp(-g))
    h = stored(h + project(layer.down, stored(act * u), layer.ffn_sub_norm, config.ffn_sub_eps))
    return h, keys[p], values[p]


# The library and the reference round at the same points, so they differ by float32 against
# float64 arithmetic (about 1e-6 relative) until a value lands within that of a rounding boundary
# of the dtype or of an int8 code and rounds the other way: one step of the dtype on that value,
# or a projection's output moved by a code step (1/127 of its input's largest value), and where the
# flipped value is a vector's largest, every code of that vector rescaled. Over 2560 random cases
# per dtype (these shapes and configs) the largest error was 2.0% of max |h| (0.9% of a cache
# row's largest value), in every dtype: flips, not roundings, set the bound. Wrong wiring (an eps,
# the scale, a residual, a position) moves h by about its own size.
H_BOUND, CACHE_BOUND = 2.0 ** -4, 2.0 ** -6

TINY_SHAPES = [(256, 384, 4, 2, 64), (256, 384, 2, 2, 128), (384, 256, 4, 1, 64),
               (256, 128, 1, 1, 256)]  # H, I, Hq, Hkv, D: TINY; D 128 with Hq = Hkv; Hq D != H
# (activation, sub-norms): 2B4T, Falcon3, 1bitLLM, and relu2 without sub-norms
GLUS = [("relu2", True), ("silu", False), ("silu", True), ("relu2", False)]
ULP = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def unfused_layer(config, layer, h, k_cache, v_cache, position, seq_len):
    """The model runtime's op sequence for this layer and one token (Session.forward at batch 1),
    through the public API on the arrays' device; h [H] and the caches [C, Hkv, D] are updated in
    place. position and seq_len: int32 [1] arrays on that device. The last add, which the runtime
    leaves to the next layer's norm, is that norm's residual add (its output unused)."""
    dtype = _arrays.as_array(h, "h").dtype
    H, Hq, Hkv, D = config.hidden, config.heads, config.kv_heads, config.head_dim
    C = k_cache.shape[0]
    h = h.reshape(1, H)
    kc, vc = k_cache.reshape(1, C, Hkv, D), v_cache.reshape(1, C, Hkv, D)

    def codes(x, weight, eps):
        return bn.quantize_a8(x) if weight is None else bn.rmsnorm_quantize(x, weight, eps=eps)

    x_q, x_s = bn.rmsnorm_quantize(h, layer.attn_norm, eps=config.eps)
    qkv = bn.gemv_w2a8(layer.qkv, x_q, x_s, out_dtype=dtype)
    q = bn.rope_append_kv(qkv.reshape(1, 1, Hq + 2 * Hkv, D), kc, vc, position, theta=config.theta)
    a = bn.attention(q, kc, vc, causal=True, scale=config.attention_scale, seq_lens=seq_len)
    a_q, a_s = codes(a.reshape(1, Hq * D), layer.attn_sub_norm, config.attn_sub_eps)
    proj = bn.gemv_w2a8(layer.o, a_q, a_s, out_dtype=dtype)
    f_q, f_s = bn.rmsnorm_quantize(proj, layer.ffn_norm, eps=config.eps, residual=h)
    gate_up = bn.gemv_w2a8(layer.gate_up, f_q, f_s, out_dtype=dtype)
    g_q, g_s = bn.glu_rmsnorm_quantize(gate_up, layer.ffn_sub_norm, activation=config.activation,
                                       eps=config.ffn_sub_eps)
    down = bn.gemv_w2a8(layer.down, g_q, g_s, out_dtype=dtype)
    bn.add_rmsnorm(down, h, layer.ffn_norm, eps=config.eps)


def host_int32(value):
    return np.array([value], np.int32)


def assert_same_bits(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.tobytes() == want.tobytes(), f"{what} differs from the unfused sequence"


# ---- tier 1: the CPU ----


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("activation,sub_norms", GLUS)
@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_cpu_equals_the_unfused_sequence_bit_for_bit(rng, dtype, activation, sub_norms, shape):
    """h and both caches, whole (the rows after p stay NaN), at the first, a middle and the last
    position of the cache; with the workspace given and allocated by the call."""
    config = decode_config(*shape, activation=activation, sub_norms=sub_norms)
    C = 12
    for p in (0, int(rng.integers(1, C - 1)), C - 1):
        layer, h, k_cache, v_cache = decode_layer_case(rng, config, dtype, C, p)
        want = [h.copy(), k_cache.copy(), v_cache.copy()]
        unfused_layer(config, layer, *want, host_int32(p), host_int32(p + 1))
        for workspace in (None, np.zeros(bn.decode_layer_workspace_size(config, -1, dtype), np.uint8)):
            got = [h.copy(), k_cache.copy(), v_cache.copy()]
            assert bn.decode_layer(config, layer, *got, host_int32(p), workspace=workspace) is got[0]
            for name, a, b in zip(("h", "k_cache", "v_cache"), got, want):
                assert_same_bits(a, b, f"{name} at position {p}")


@pytest.mark.cpu
def test_cpu_decode_steps_feed_h_back(rng):
    """Five steps from position 3, each step's h the next one's input: still the unfused bits."""
    config = decode_config(256, 384, 4, 2, 64)
    layer, h, k_cache, v_cache = decode_layer_case(rng, config, "bfloat16", 10, 3)
    fused, unfused = [h, k_cache, v_cache], [a.copy() for a in (h, k_cache, v_cache)]
    for p in range(3, 8):
        bn.decode_layer(config, layer, *fused, [p])
        unfused_layer(config, layer, *unfused, host_int32(p), host_int32(p + 1))
        for name, a, b in zip(("h", "k_cache", "v_cache"), fused, unfused):
            assert_same_bits(a, b, f"{name} after position {p}")


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("activation,sub_norms", GLUS)
@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_cpu_matches_the_float64_reference(rng, dtype, activation, sub_norms, shape):
    config = decode_config(*shape, activation=activation, sub_norms=sub_norms)
    C = 16
    p = int(rng.integers(0, C))
    layer, h, k_cache, v_cache = decode_layer_case(rng, config, dtype, C, p)
    want_h, want_k, want_v = reference_layer(config, layer, h, k_cache, v_cache, p)
    after = np.isnan(k_cache[p + 1:].astype(np.float32)).all()
    bn.decode_layer(config, layer, h, k_cache, v_cache, [p])
    assert np.abs(h.astype(np.float64) - want_h).max() <= H_BOUND * np.abs(want_h).max()
    for got, want in ((k_cache[p], want_k), (v_cache[p], want_v)):
        assert np.abs(got.astype(np.float64) - want).max() <= CACHE_BOUND * np.abs(want).max()
    assert after and np.isnan(k_cache[p + 1:].astype(np.float32)).all()
    assert np.isnan(v_cache[p + 1:].astype(np.float32)).all()


@pytest.mark.cpu
def test_cpu_shapes_with_a_batch_axis_and_the_workspace_size(rng):
    """h [1, H] and caches [1, C, Hkv, D] (the model runtime's buffers) give the same bits as the
    unbatched forms; a workspace of exactly decode_layer_workspace_size bytes is enough and one
    byte less is refused, with nothing written."""
    config = decode_config(256, 384, 4, 2, 64, activation="silu")
    layer, h, k_cache, v_cache = decode_layer_case(rng, config, "bfloat16", 6, 2)
    size = bn.decode_layer_workspace_size(config, "cpu", "bfloat16")
    assert size == bn.decode_layer_workspace_size(config, -1, "bfloat16") > 0
    flat = [h.copy(), k_cache.copy(), v_cache.copy()]
    bn.decode_layer(config, layer, *flat, [2], workspace=np.zeros(size, np.uint8))
    batched = [h.copy()[None], k_cache.copy()[None], v_cache.copy()[None]]
    before = [a.copy() for a in batched]
    small = np.full(size - 1, 0x5A, np.uint8)
    with pytest.raises(InvalidArgumentError, match=f"workspace of {size - 1} bytes is too small"):
        bn.decode_layer(config, layer, *batched, [2], workspace=small)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(batched, before)) and (small == 0x5A).all()
    bn.decode_layer(config, layer, *batched, np.array([2], np.int32))
    for a, b in zip(batched, flat):
        assert_same_bits(a[0], b, "the batched form")


@pytest.mark.cpu
def test_cpu_position_outside_the_cache_is_refused_untouched(rng):
    config = decode_config(256, 384, 4, 2, 64)
    layer, h, k_cache, v_cache = decode_layer_case(rng, config, "bfloat16", 6, 5)
    before = [a.tobytes() for a in (h, k_cache, v_cache)]
    for p in (6, -1):
        with pytest.raises(InvalidArgumentError, match=rf"position = {p} is outside \[0, C = 6\)"):
            bn.decode_layer(config, layer, h, k_cache, v_cache, [p])
    with pytest.raises(InvalidArgumentError, match=r"position = 7 is outside \[0, C = 6\)"):
        bn.decode_layer(config, layer, h, k_cache, v_cache, host_int32(7))
    assert [a.tobytes() for a in (h, k_cache, v_cache)] == before


@pytest.mark.cpu
def test_cpu_workspace_size_as_the_first_call_of_a_process():
    """The config struct is a type of the header: asking for it first loads the library."""
    code = ("import bitnet_ffi as bn; from reference import decode_config; "
            "print(bn.decode_layer_workspace_size(decode_config(256, 384, 4, 2, 64), 'cpu'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).parent, timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == bn.decode_layer_workspace_size(decode_config(256, 384, 4, 2, 64), -1)


@pytest.mark.cpu
def test_cpu_fused_layer_supported(rng):
    """Every layer with a scale per row and a config the backend takes; block-scaled weights or a
    head dimension the op lacks are not."""
    config = decode_config(256, 384, 4, 2, 64)
    layer = decode_layer_case(rng, config, "bfloat16", 4, 0)[0]
    weights = Weights(config, [layer, layer], layer.attn_norm, None)
    assert fused_layer_supported(weights, "cpu")
    assert not fused_layer_supported(Weights(decode_config(256, 384, 4, 2, 96), [], None, None), -1)
    scaled = bn.pack_ternary(np.zeros((256, 256), np.int8), 1.0,
                             block_scales=np.ones((256, 1), np.float32))
    blocked = Layer(**{**layer.__dict__, "o": scaled})
    assert not fused_layer_supported(Weights(config, [layer, blocked], None, None), -1)


# ---- tier 3: CUDA ----


def gpu_layer(layer):
    """The layer's arrays as torch tensors on cuda:0."""
    def ternary(w):
        return TernaryWeights(to_torch(w.packed), to_torch(w.scales))
    return Layer(**{name: ternary(getattr(layer, name)) for name in ("qkv", "o", "gate_up", "down")},
                 **{name: None if getattr(layer, name) is None else to_torch(getattr(layer, name))
                    for name in ("attn_norm", "attn_sub_norm", "ffn_norm", "ffn_sub_norm")})


def host(t, dtype):
    import torch
    t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_arrays.numpy_dtype(dtype))
    return t.numpy()


def device_int32(value):
    import torch
    return torch.tensor([value], dtype=torch.int32, device="cuda")


# The GPU against the unfused GPU sequence or the CPU: only float32 sum orders differ (the norms'
# sums of squares, the softmax; the unfused GPU attention also rounds its probabilities to bf16),
# moving 1/RMS and the attention output by a few float32 ulps. That changes a stored value by one
# ulp of the dtype, or an int8 code by one, only where it sits at a rounding boundary, and h then
# moves by a projection's code step (docs/decode_layer.md); at a vector's largest value, by up to
# the projection's quantization error, as the flip moves all that vector's codes. Such steps are
# fractions of a code (1/127 of the input's range), not ulps of the dtype: on an H200, over 3000
# random layers (these shapes, 2B4T's too) the largest error was 2.4% of max |h| against the
# unfused GPU sequence and 1.1% against the CPU, in either dtype, where 4 bfloat16 ulps are 1.6%
# and 4 float16 ulps 0.2%: no bound in ulps holds. So: the largest error within GPU_FLIP_BOUND of
# max |h_ref|, and no more than GPU_SHARE of h's elements (measured 4.3%) off by more than
# GPU_TYPICAL (4 bfloat16 ulps) of it; wrong wiring moves all of h by about its own size. A
# written cache row, against the unfused GPU sequence and against the CPU: within CACHE_ULPS of the
# dtype at the row's largest value. The input norm's sum of squares is taken in another order than
# either's, so a code at a near-tie can flip (against the unfused GPU sequence in 5 of 200 random
# 2B4T layers, H200, moving the row by up to 2.04 of those ulps; RoPE's fused multiply-adds add to
# it against the CPU; measured 2.1).
GPU_FLIP_BOUND, GPU_TYPICAL, GPU_SHARE, CACHE_ULPS = 2.0 ** -4, 2.0 ** -6, 0.10, 4


def assert_h_close(got, want, what):
    got, want = got.astype(np.float64), want.astype(np.float64)
    error, scale = np.abs(got - want), np.abs(want).max()
    assert error.max() <= GPU_FLIP_BOUND * scale, \
        f"{what}: max |h - h_ref| = {error.max():.4g}, {error.max() / scale:.3g} of max |h_ref|"
    share = (error > GPU_TYPICAL * scale).mean()
    assert share <= GPU_SHARE, f"{what}: {share:.1%} of h off by more than 2^-6 of max |h_ref|"


def assert_row_close(got, want, dtype, what):
    got, want = got.astype(np.float64), want.astype(np.float64)
    assert np.abs(got - want).max() <= CACHE_ULPS * ULP[dtype] * np.abs(want).max(), what


def run_gpu_steps(rng, config, dtype, C, p0, steps):
    """`steps` decode steps from position p0, each fed the GPU fused op's h: the GPU fused op, the
    unfused GPU sequence and the CPU fused op, each on its own KV cache, checked at every step."""
    import torch
    layer, h, k_cache, v_cache = decode_layer_case(rng, config, dtype, C, p0)
    glayer = gpu_layer(layer)
    fused_caches = [to_torch(k_cache.copy()), to_torch(v_cache.copy())]
    unfused_caches = [to_torch(k_cache.copy()), to_torch(v_cache.copy())]
    cpu_caches = [k_cache.copy(), v_cache.copy()]
    workspace = torch.empty(bn.decode_layer_workspace_size(config, 0, dtype), dtype=torch.uint8,
                            device="cuda")
    for p in range(p0, p0 + steps):
        fused, unfused, cpu = to_torch(h.copy()), to_torch(h.copy()), h.copy()
        bn.decode_layer(config, glayer, fused, *fused_caches, device_int32(p), workspace=workspace)
        unfused_layer(config, glayer, unfused, *unfused_caches, device_int32(p), device_int32(p + 1))
        bn.decode_layer(config, layer, cpu, *cpu_caches, [p])
        for name, a, b, c in zip(("k", "v"), fused_caches, unfused_caches, cpu_caches):
            row = host(a, dtype)[p]
            assert_row_close(row, host(b, dtype)[p], dtype, f"{name}_cache row {p} against the unfused GPU")
            assert_row_close(row, c[p], dtype, f"{name}_cache row {p} against the CPU")
        h = host(fused, dtype)
        assert_h_close(h, host(unfused, dtype), f"GPU against unfused GPU, position {p}")
        assert_h_close(h, cpu, f"GPU against CPU, position {p}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("activation,sub_norms", GLUS[:3])
@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_gpu_decode_steps_match_the_unfused_sequence_and_the_cpu(rng, dtype, activation,
                                                                  sub_norms, shape):
    config = decode_config(*shape, activation=activation, sub_norms=sub_norms)
    run_gpu_steps(rng, config, dtype, 300, int(rng.integers(0, 295)), 5)


@pytest.mark.gpu
def test_gpu_2b4t_shapes_at_position_1000(rng):
    config = decode_config(2560, 6912, 20, 5, 128)
    run_gpu_steps(rng, config, "bfloat16", 1024, 1000, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("p", [-1, 64, 1000])
def test_gpu_position_outside_the_cache_leaves_everything_untouched(rng, p):
    """A device-resident p outside [0, C): the kernel writes neither h nor a cache row."""
    import torch
    config = decode_config(256, 384, 4, 2, 64)
    layer, h, k_cache, v_cache = decode_layer_case(rng, config, "bfloat16", 64, 10)
    arrays = [to_torch(a.copy()) for a in (h, k_cache, v_cache)]
    bn.decode_layer(config, gpu_layer(layer), *arrays, device_int32(p))
    torch.cuda.synchronize()
    for a, want in zip(arrays, (h, k_cache, v_cache)):
        assert host(a, "bfloat16").tobytes() == want.tobytes()


@pytest.mark.gpu
def test_gpu_graph_replay_equals_the_eager_call(rng):
    """Captured on a libbitnet stream with its workspace given (DeviceArrays, no allocation), the
    replayed layer gives the eager call's bits."""
    config = decode_config(256, 384, 4, 2, 64, activation="silu", sub_norms=False)
    layer, h, k_cache, v_cache = decode_layer_case(rng, config, "float16", 32, 7)
    put = bn.DeviceArray.from_numpy
    glayer = Layer(**{name: bn.TernaryWeights(put(getattr(layer, name).packed),
                                              put(getattr(layer, name).scales))
                      for name in ("qkv", "o", "gate_up", "down")},
                   attn_norm=put(layer.attn_norm), ffn_norm=put(layer.ffn_norm))
    position = put(host_int32(7))
    workspace = bn.DeviceArray((bn.decode_layer_workspace_size(config, 0, "float16"),), "uint8")
    eager = [put(a) for a in (h, k_cache, v_cache)]
    bn.decode_layer(config, glayer, *eager, position, workspace=workspace)
    replayed = [put(a) for a in (h, k_cache, v_cache)]
    stream = bn.Stream(0)
    with bn.Graph.capture(stream) as graph:
        bn.decode_layer(config, glayer, *replayed, position, workspace=workspace, stream=stream)
    graph.launch()
    stream.synchronize()
    for a, b in zip(replayed, eager):
        assert a.numpy().tobytes() == b.numpy().tobytes()


@pytest.mark.gpu
def test_gpu_python_bad_input(rng):
    """Arrays of two devices, a CPU position tensor for a GPU op, float32 on a GPU."""
    import torch
    config = decode_config(256, 384, 4, 2, 64)
    layer, h, k_cache, v_cache = decode_layer_case(rng, config, "bfloat16", 8, 2)
    glayer = gpu_layer(layer)
    arrays = [to_torch(a.copy()) for a in (h, k_cache, v_cache)]
    with pytest.raises(InvalidArgumentError, match="different devices"):
        bn.decode_layer(config, layer, *arrays, device_int32(2))
    with pytest.raises(InvalidArgumentError, match="position is on cpu"):
        bn.decode_layer(config, glayer, *arrays, torch.tensor([2], dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match=r"position = 8 is outside \[0, C = 8\)"):
        bn.decode_layer(config, glayer, *arrays, [8])
    with pytest.raises(bn.UnsupportedError, match="float32 runs on the CPU only"):
        bn.decode_layer_workspace_size(config, 0, "float32")
    torch.cuda.synchronize()
    for a, want in zip(arrays, (h, k_cache, v_cache)):
        assert host(a, "bfloat16").tobytes() == want.tobytes()
