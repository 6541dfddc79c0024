"""The demo's model: the CPU path against a float64 numpy reference of the same model at small size
(tier 1), the GPU against the CPU (`demo --check`, tier 3), and the demo's command line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from bitnet_ffi import _arrays
from bitnet_ffi.errors import InvalidArgumentError
from bitnet_ffi.model import TINY, Session, random_weights
from conftest import real_gpu_count

REPO = Path(__file__).resolve().parents[1]


def f64(array):
    host = array if isinstance(array, np.ndarray) else array.numpy()
    return host.astype(np.float64)


def ternary(weights):
    return f64(weights.unpack()) * f64(weights.scales)[:, None]


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def quantize(y):
    """The int8 activation rule, applied exactly, returned dequantized."""
    s = 127.0 / np.maximum(np.abs(y).max(axis=-1, keepdims=True), 1e-5)
    return np.clip(np.rint(y * s), -128, 127) / s


def rope(x, positions, theta):
    half = x.shape[-1] // 2
    inv_freq = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    angle = positions[:, None, None] * inv_freq  # [S, 1, D/2]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                           x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)


def bf16(x):
    """Rounds to bfloat16 and back: where the model stores an activation."""
    return x.astype(ml_dtypes.bfloat16).astype(np.float64)


def reference_logits(weights, ids):
    """Logits after each token of one sequence (`ids`), every token through every layer: float64
    arithmetic, with activations rounded to bfloat16 where the model stores them."""
    c = weights.config
    layers = [{"qkv": ternary(L.qkv), "o": ternary(L.o), "gate_up": ternary(L.gate_up),
               "down": ternary(L.down), **{n: f64(getattr(L, n)) for n in
                                           ("attn_norm", "attn_sub_norm", "ffn_norm", "ffn_sub_norm")}}
              for L in weights.layers]
    table, S = f64(weights.embedding), len(ids)
    h = table[ids]
    group = c.heads // c.kv_heads
    causal = np.triu(np.full((S, S), -np.inf), 1)
    for L in layers:
        qkv = bf16(quantize(rmsnorm(h, L["attn_norm"], c.eps)) @ L["qkv"].T)
        q = bf16(rope(qkv[:, :c.hidden].reshape(S, c.heads, c.head_dim), np.arange(S), c.theta))
        k = bf16(rope(qkv[:, c.hidden:c.hidden + c.kv_dim].reshape(S, c.kv_heads, c.head_dim),
                      np.arange(S), c.theta))
        v = qkv[:, c.hidden + c.kv_dim:].reshape(S, c.kv_heads, c.head_dim)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(c.head_dim) + causal
        p = np.exp(scores - scores.max(-1, keepdims=True))
        attn = bf16(np.einsum("hij,jhd->ihd", p / p.sum(-1, keepdims=True), v).reshape(S, c.hidden))
        h = bf16(h + bf16(quantize(rmsnorm(attn, L["attn_sub_norm"], c.eps)) @ L["o"].T))
        gate_up = bf16(quantize(rmsnorm(h, L["ffn_norm"], c.eps)) @ L["gate_up"].T)
        gate, up = gate_up[:, :c.intermediate], gate_up[:, c.intermediate:]
        gated = bf16(np.maximum(gate, 0) ** 2 * up)
        h = bf16(h + bf16(quantize(rmsnorm(gated, L["ffn_sub_norm"], c.eps)) @ L["down"].T))
    return bf16(rmsnorm(h, f64(weights.final_norm), c.eps)) @ table.T


# With bfloat16 rounding at the same points, the library and the reference differ only by float32
# against float64 sums: about 1e-7 relative (EXACT_BOUND). But a value that lands within that of a
# bfloat16 or int8 rounding boundary rounds the other way, and in this small random network such a
# flip moves the logits by about 1e-3 to 1e-2 of their norm (up to 0.44 when it moves a token's
# int8 scale); it stays in the KV cache for the later steps. Over 350 seeds, a quarter of the
# sequences flipped within their prompt, the median of a run's errors stayed under 0.021 and the
# largest error under 0.44. Wrong wiring gives unrelated logits, about sqrt(2) apart. So: every
# step under FLIP_BOUND and the run's median error under MEDIAN_BOUND.
EXACT_BOUND, MEDIAN_BOUND, FLIP_BOUND = 1e-5, 0.1, 0.9


def check_steps(errors):
    assert all(e < FLIP_BOUND for e in errors), errors
    assert np.median(errors) < MEDIAN_BOUND, errors


def run_session(device, seed, decode_steps, forced=None):
    """Prefill and decode; `forced` (another run's steps) feeds that run's tokens as the inputs."""
    weights = random_weights(TINY, device, seed)
    session = Session(weights, 2, 24, device)
    prompt = np.random.default_rng(seed + 1).integers(0, TINY.vocab, (2, 7))
    first = session.prefill(prompt)
    steps = [(f64(session.logits), first)]
    for i in range(decode_steps):
        tokens = session.decode(None if forced is None else forced[i][1])
        steps.append((f64(session.decode_buffers["logits"]), tokens))
    return weights, prompt, steps


def relative(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.cpu
def test_cpu_decode_matches_the_float64_reference(rng):
    seed = int(rng.integers(1 << 30))
    weights, prompt, steps = run_session(_arrays.CPU, seed, decode_steps=3)
    errors = []
    for b in range(2):
        ids = list(prompt[b])
        for logits, tokens in steps:
            want = reference_logits(weights, np.array(ids))[-1]
            errors.append(relative(logits[b], want))
            # the greedy pick is the reference's best token, up to the error of this step
            assert want[tokens[b]] >= want.max() - 2 * errors[-1] * np.linalg.norm(want)
            ids.append(tokens[b])  # teacher forcing: the reference follows the library's tokens
    check_steps(errors)


@pytest.mark.gpu
def test_gpu_decode_matches_cpu(rng):
    seed = int(rng.integers(1 << 30))
    _, _, cpu = run_session(_arrays.CPU, seed, decode_steps=4)
    _, _, gpu = run_session(0, seed, decode_steps=4, forced=cpu)  # the CPU's tokens as inputs
    errors = [relative(g[0], c[0]) for c, g in zip(cpu, gpu)]
    # The GPU's attention rounds the softmax probabilities to bfloat16 for the tensor cores (the
    # CPU keeps float32), so flips are common here: only FLIP_BOUND holds for every step.
    assert all(e < FLIP_BOUND for e in errors), errors
    for error, (_, cpu_tokens), (_, gpu_tokens) in zip(errors, cpu, gpu):
        if error < EXACT_BOUND:  # equal logits, equal greedy picks
            np.testing.assert_array_equal(gpu_tokens, cpu_tokens)


@pytest.mark.gpu
def test_time_decode_times_real_steps_and_puts_the_positions_back(rng):
    """Every timed replay runs inside the KV cache from the same positions (a step past the cache's
    end computes nothing and would time as fast), and the session goes on as if untimed."""
    seed = int(rng.integers(1 << 30))
    print("seed", seed)
    weights = random_weights(TINY, 0, seed)
    prompt = np.random.default_rng(seed + 1).integers(0, TINY.vocab, (2, 7))
    timed, untimed = Session(weights, 2, 16, 0), Session(weights, 2, 16, 0)
    for session in (timed, untimed):
        session.prefill(prompt)
        session.decode()
    positions = timed.download(timed.positions).copy()
    step_ms, op_ms = timed.time_decode(replays=7)  # 8 + 7 = 15 of the 16 rows
    # an unfused step of two sequences issues every kind but the fused layer's, the one-sequence
    # forms (the QKV projection with RoPE, the GEMVs with the input norms) and the two ops that
    # attention_rope_append_kv replaces
    assert step_ms > 0 and set(op_ms) == set(Session.KINDS) - {
        "decode layer (fused)", "qkv + rope + kv append", "gemv_w2a8 + norm", "rope + kv append",
        "attention"}
    np.testing.assert_array_equal(timed.download(timed.positions), positions)
    np.testing.assert_array_equal(timed.decode(), untimed.decode())
    with pytest.raises(InvalidArgumentError, match="overflow the KV cache of 16"):
        timed.time_decode(replays=8)


@pytest.mark.gpu
def test_repeated_prompt_length_replays_a_graph_with_the_eager_results(rng):
    """The second prefill of a length captures its pass and later ones replay it: each gives the
    logits and tokens of a fresh session's eager prefill of the same prompt, bit for bit."""
    seed = int(rng.integers(1 << 30))
    print("seed", seed)
    weights = random_weights(TINY, 0, seed)
    prompts = np.random.default_rng(seed + 1).integers(0, TINY.vocab, (4, 2, 7))
    session = Session(weights, 2, 24, 0)
    for i, prompt in enumerate(prompts):
        tokens = session.prefill(prompt)
        assert (session.extend_graph is not None) == (i > 0)
        fresh = Session(weights, 2, 24, 0)
        np.testing.assert_array_equal(tokens, fresh.prefill(prompt))
        np.testing.assert_array_equal(session.download(session.logits),
                                      fresh.download(fresh.logits))
        np.testing.assert_array_equal(session.decode(), fresh.decode())
    session.prefill(prompts[0][:, :5])  # another length: eager again, new buffers
    assert session.extend_graph is None and session.extend_buffers[0] == 5


@pytest.mark.parametrize("device", [pytest.param(_arrays.CPU, marks=pytest.mark.cpu),
                                    pytest.param(0, marks=pytest.mark.gpu)])
def test_blocks_of_one_length_padded_differently_give_the_eager_results(device, rng):
    """Prefills and extends of one T (graph replays on the GPU), right-padded differently each
    time: every block gives the tokens, logits and positions of a session that runs each block
    eagerly in new buffers, bit for bit, and so do the decode steps after them."""
    seed = int(rng.integers(1 << 30))
    print("seed", seed)
    weights = random_weights(TINY, device, seed)
    ids = np.random.default_rng(seed + 1).integers(0, TINY.vocab, (6, 2, 6))
    blocks = [("prefill", None, [6, 6]), ("prefill", [6, 6], [6, 6]), ("prefill", [3, 6], [3, 6]),
              ("extend", [5, 2], [8, 8]), ("extend", [5, 2], [13, 10]), ("extend", None, [19, 16])]
    session, eager = Session(weights, 2, 24, device), Session(weights, 2, 24, device)
    for block, (how, lengths, positions) in zip(ids, blocks):
        tokens = getattr(session, how)(block, lengths)
        eager.extend_buffers = None  # new buffers: the block runs op by op
        np.testing.assert_array_equal(tokens, getattr(eager, how)(block, lengths))
        np.testing.assert_array_equal(session.download(session.logits),
                                      eager.download(eager.logits))
        assert session.download(session.positions).tolist() == positions
        assert session.download(session.seq_lens).tolist() == [p + 1 for p in positions]
    assert session.extend_graph is not None or device == _arrays.CPU
    for _ in range(2):
        np.testing.assert_array_equal(session.decode(), eager.decode())


@pytest.mark.gpu
def test_torch_anchor_prefill_equals_its_decode_steps(rng):
    """The demo's torch bf16 model prefills in one causal pass and decodes one token at a time
    through its KV cache: fed the same prompt, both give the last token's logits within bfloat16
    rounding (each layer stores bf16 activations, about 0.4% each, along different SDPA paths)."""
    torch = pytest.importorskip("torch")
    from bitnet_ffi.torch_model import TorchModel
    seed = int(rng.integers(1 << 30))
    print("seed", seed)
    model = TorchModel(random_weights(TINY, 0, seed), 2, 16)
    prompt = torch.as_tensor(np.random.default_rng(seed + 1).integers(0, TINY.vocab, (2, 7)),
                             device="cuda")
    model.prefill(prompt)
    prefilled = model.logits.double().cpu().numpy()
    model.pos.fill_(0)
    for t in range(prompt.shape[1]):
        model.ids.copy_(prompt[:, t])
        model.step()
    stepped = model.logits.double().cpu().numpy()
    assert relative(stepped, prefilled) < 0.03
    assert int(model.pos) == 7


def demo(*args, **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("BITNET_DEVICE")}
    environment.update(env)
    return subprocess.run([sys.executable, "-m", "bitnet_ffi", "demo", *args], capture_output=True,
                          text=True, cwd=str(REPO), env=environment, timeout=600)


@pytest.mark.cpu
def test_demo_cpu_json_reports_every_figure():
    result = demo("--device", "cpu", "--layers", "1", "--prompt-len", "5", "--tokens", "3",
                  "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["device"] == "cpu" and report["layers"] == 1
    assert len(report["tokens_first_sequence"]) == 3
    for key in ("prefill_tokens_per_s", "decode_ms_per_token", "decode_tokens_per_s", "decode_gbps"):
        assert report[key] > 0
    assert set(report["op_ms"]) >= {"gemv_w2a8", "attention", "output head", "rmsnorm (+int8)"}
    # The per-op times come from the same two timed steps as the step time: their sum is a part
    # of it (the rest is Python between the ops), never more.
    assert report["timing"] == "wall time, mean of 2 steps"
    assert sum(report["op_ms"].values()) <= report["decode_ms_per_token"]
    # The bars show in a log too (stderr is a pipe here), each ending at 100%.
    for bar in ("quantizing layers: 100%", "prefill: 100%", "decoding: 100%"):
        assert bar in result.stderr, result.stderr


@pytest.mark.cpu
@pytest.mark.parametrize("args,message", [
    (("--tokens", "1"), "argument --tokens: must be at least 2, got 1"),
    (("--seed", "-1"), "argument --seed: must be at least 0, got -1"),
    (("--layers", "0"), "argument --layers: must be at least 1, got 0"),
    (("--batch", "two"), "argument --batch: expected an integer, got 'two'"),
])
def test_demo_refuses_bad_options_with_a_usage_error(args, message):
    result = demo("--device", "cpu", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.cpu
def test_demo_help_gives_every_option_a_default():
    result = subprocess.run([sys.executable, "-m", "bitnet_ffi", "demo", "--help"],
                            capture_output=True, text=True, cwd=str(REPO))
    options = result.stdout.split("options:", 1)[1]  # after the usage line
    for option in ("--device", "--layers", "--prompt-len", "--tokens", "--batch", "--seed"):
        text = options.split(option, 1)[1].split("\n  -", 1)[0]
        assert "default" in text, f"{option}: {text}"


@pytest.mark.cpu
def test_demo_check_without_a_gpu_says_it_needs_one():
    result = demo("--check", "--device", "cpu")
    assert result.returncode == 2 and "--check compares the GPU with the CPU, so it needs a CUDA GPU" \
        in result.stderr, result.stderr
    if real_gpu_count() == 0:
        result = demo("--check")
        assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr, result.stderr


@pytest.mark.cpu
def test_demo_on_a_fake_gpu_is_refused():
    result = demo("--device", "cuda", "--layers", "1", BITNET_GPU_FAKE="cuda")
    if result.returncode == 0:  # a real GPU is there: cuda selects it
        return
    assert result.returncode == 2 and "NoDeviceError" in result.stderr


@pytest.mark.gpu
def test_demo_check_passes_on_the_gpu():
    result = demo("--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("PASS")
