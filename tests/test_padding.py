"""Padded layouts (bitnet_ffi/padding.py): a model run padded computes what it computes unpadded,
and the configs of 1bitLLM's published checkpoints get the padded sizes they need."""
import dataclasses

import numpy as np
import pytest

from bitnet_ffi import _arrays
from bitnet_ffi.config import Config
from bitnet_ffi.model import TINY, Session, Weights, random_weights
from bitnet_ffi.padding import head_slots, pad_layer, padded_config
from test_model import check_steps

# Without sub-norms (the Llama layout) the padded run computes the same float32 values: RoPE's
# angles differ by float64 ulps of pow(theta^2, -2i/128) against pow(theta, -2i/64), attention's
# scale is the same float32, the padding adds exact zeros. So its logits are bit-identical.
# With sub-norms, the eps and the next projection's scales carry the factor n / n_pad (float32),
# and a sub-norm's output, scaled by sqrt(n_pad / n), can land an int8 code on the other side of a
# rounding boundary: a change of a few float32 ulps, but one that flips a bfloat16 or int8
# rounding moves this small random network's logits by 1e-3 to 1e-1 (30 seeds: 21 bit-identical
# runs, the largest step error 0.11), as test_model.py's flips do, so its bounds apply: every
# step under FLIP_BOUND, the median under MEDIAN_BOUND.


def run(weights, prompt, steps, forced=None):
    """Greedy tokens and logits of a prefill and `steps` decode steps; `forced` (another run's
    tokens) are fed as the inputs instead of this run's own."""
    session = Session(weights, 1, 32, _arrays.CPU)
    tokens = [int(session.prefill(np.array([prompt], np.int32))[0])]
    logits = [session.logits.copy()]
    for i in range(steps):
        tokens.append(int(session.decode(None if forced is None else [forced[i]])[0]))
        logits.append(session.logits.copy())
    return tokens, np.array(logits, np.float64)


@pytest.mark.cpu
@pytest.mark.parametrize("layout", ["bitnet", "llama"])
def test_padded_model_computes_what_the_unpadded_one_does(layout, rng):
    c = TINY if layout == "bitnet" else dataclasses.replace(TINY, activation="silu",
                                                            sub_norms=False)
    seed = int(rng.integers(1 << 30))
    print("weights seed", seed)
    w = random_weights(c, _arrays.CPU, seed=seed)
    if not c.sub_norms:
        w.layers = [dataclasses.replace(L, attn_sub_norm=None, ffn_sub_norm=None)
                    for L in w.layers]
    padded = padded_config(c, head_dim=128, intermediate=512)
    assert padded.padded_from == (64, 384) and padded.q_dim == 4 * 128
    wp = Weights(padded, [pad_layer(L, c, padded) for L in w.layers], w.final_norm, w.embedding,
                 w.head)
    prompt = rng.integers(0, c.vocab, 9)
    tokens, logits = run(w, prompt, 8)
    tokens_p, logits_p = run(wp, prompt, 8, forced=tokens)
    errors = np.linalg.norm((logits_p - logits)[:, 0], axis=-1) / np.linalg.norm(logits[:, 0], axis=-1)
    print("relative logit errors", errors)
    if c.sub_norms:
        check_steps(errors.tolist())
    else:
        np.testing.assert_array_equal(logits_p, logits)
        assert tokens_p == tokens


@pytest.mark.cpu
def test_head_slots_keep_the_rotate_half_pairs():
    slots = head_slots(2, 100, 128)
    assert slots[:50].tolist() == list(range(50))
    assert slots[50:100].tolist() == list(range(64, 114))  # pair (i, i + 50) -> (i, i + 64)
    assert slots[100] == 128


@pytest.mark.cpu
def test_1bitllm_configs_get_their_padded_sizes():
    three_b = Config.from_hf({
        "architectures": ["BitnetForCausalLM"], "hidden_act": "silu", "hidden_size": 3200,
        "intermediate_size": 8640, "num_hidden_layers": 26, "num_attention_heads": 32,
        "num_key_value_heads": 32, "vocab_size": 32002, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 2048})
    p = padded_config(three_b)
    assert (p.head_dim, p.intermediate, p.padded_from, p.q_dim) == (128, 8704, (100, 8640), 4096)
    assert p.theta == pytest.approx(10000.0 ** 1.28, rel=1e-12)
    assert p.attention_scale == pytest.approx(0.1, rel=1e-7)
    assert p.attn_sub_eps == pytest.approx(1e-5 * 100 / 128)
    assert p.ffn_sub_eps == pytest.approx(1e-5 * 8640 / 8704)
    large = dataclasses.replace(three_b, hidden=1536, intermediate=4096, heads=16, kv_heads=16,
                                head_dim=96)
    assert (padded_config(large).head_dim, padded_config(large).intermediate) == (128, 4096)
    assert padded_config(TINY) is TINY and TINY.attention_scale == np.float32(1 / 8)


@pytest.mark.cpu
def test_tensor_parallelism_splits_the_padded_layout():
    from bitnet_ffi.errors import UnsupportedError
    from bitnet_ffi.tensor_parallel import split
    c = dataclasses.replace(TINY, intermediate=400)
    with pytest.raises(UnsupportedError, match="run in a padded layout"):
        split(c, 2)
    assert split(padded_config(c), 2).intermediate == (256, 256)
