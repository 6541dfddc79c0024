"""Real checkpoints: every fixture of tests/fixtures/models (written by tools/make_fixtures.py
with transformers' save_pretrained, and GGUF files of the same weights) loads, its logits match
transformers' and its greedy tokens agree; every format of one model gives the same weights; bad
files are refused with errors that name the file and the tensor.

The oracle is transformers in float32 (reference.npz). Bounds:
- Logits: the relative L2 error of every step must stay under LOGIT_BOUND times the largest error
  of transformers' own bfloat16 run of the same model and tokens (also stored) over the 32 steps. This library keeps
  activations, the residual stream and attention's probabilities in bfloat16, as that run does;
  the int8 activation rounding then amplifies a difference that flips one rounding (a whole
  token's int8 scale moves with its largest value), which is why the errors are a few percent
  for both, not bfloat16's 0.4%.
- Greedy tokens: each step is fed transformers' token (teacher forcing), so all 32 steps compare;
  our argmax must equal transformers' wherever its top-2 margin is at least MARGIN standard
  deviations of its logits. Our per-logit error is about 0.04 of that deviation (rel. error x
  rms), so a 0.2 margin is over 3.5 standard deviations of the difference of two errors; closer
  calls flip between any two correct implementations.
"""
import json
import os
import shutil
import struct

import numpy as np
import pytest

import bitnet_ffi
from bitnet_ffi import _arrays
from bitnet_ffi.config import Config
from bitnet_ffi.errors import CorruptFileError, InvalidArgumentError, UnsupportedError
from bitnet_ffi.generate import Model
from bitnet_ffi.loader import hf_packed_to_ternary, i2s_to_ternary
from bitnet_ffi.tokenizer import TextStream, Tokenizer
from reference import reference_sentencepiece_encode

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "models")
LOGIT_BOUND, MARGIN, STEPS = 1.0, 0.2, 32
HF = ["bitnet-packed", "bitnet-bitlinear", "bitnet-bf16", "llama-silu", "bitnet-padded"]
GGUF = {"bitnet-packed-i2_s.gguf": "bitnet-packed", "bitnet-packed-tq2_0.gguf": "bitnet-packed",
        "bitnet-packed-tq1_0.gguf": "bitnet-packed", "llama-silu-tq2_0.gguf": "llama-silu",
        "bitnet-padded-i2_s.gguf": "bitnet-padded"}
DEVICES = [pytest.param("cpu", marks=pytest.mark.cpu), pytest.param("cuda", marks=pytest.mark.gpu)]


def fixture(name):
    return os.path.join(FIXTURES, name)


def reference(name):
    return np.load(os.path.join(FIXTURES, GGUF.get(name, name), "reference.npz"))


def relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def top2_margin(logits):
    top = np.sort(logits)[-2:]
    return (top[1] - top[0]) / logits.std()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", HF + list(GGUF))
def test_fixture_matches_transformers(name, device):
    model = Model.load(fixture(name), device=device, progress=False)
    ref = reference(name)
    prompts = [ref["prompt0"], ref["prompt1"]]  # of different lengths: one batch, right-padded
    padded = np.zeros((2, max(map(len, prompts))), np.int32)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    session = model.session(2, 128)
    tokens = session.prefill(padded, [len(p) for p in prompts])
    bounds = [LOGIT_BOUND * max(relative(h, f) for h, f in zip(ref[f"logits_bf16_{b}"],
                                                                 ref[f"logits{b}"]))
              for b in range(2)]
    compared = 0
    for step in range(STEPS):
        logits = session.download(session.logits).astype(np.float64)
        for b in range(2):
            expected, bound = ref[f"logits{b}"][step], bounds[b]
            error = relative(logits[b], expected)
            assert error <= bound, f"{name} sequence {b} step {step}: logits error {error:.4f} > {bound:.4f}"
            if top2_margin(expected) >= MARGIN:
                assert tokens[b] == ref[f"tokens{b}"][step], f"{name} sequence {b} step {step}"
                compared += 1
        tokens = session.decode([ref["tokens0"][step], ref["tokens1"][step]])
    assert compared >= STEPS  # of the 64 steps, at least half have a clear greedy choice


@pytest.mark.parametrize("device", DEVICES)
def test_generate_is_the_greedy_path_of_transformers(device):
    """Free-running greedy generation (a batch of two prompts) follows transformers' tokens up to
    the first step whose margin is under MARGIN."""
    model = Model.load(fixture("bitnet-packed"), device=device, progress=False)
    ref = reference("bitnet-packed")
    results = model.generate([ref["prompt0"].tolist(), ref["prompt1"].tolist()],
                             max_tokens=STEPS, stop=False)
    for b, result in enumerate(results):
        assert len(result.ids) == STEPS
        for step in range(STEPS):
            if top2_margin(ref[f"logits{b}"][step]) < MARGIN:
                break
            assert result.ids[step] == ref[f"tokens{b}"][step], f"sequence {b} step {step}"
        assert step > 0
        assert result.text == model.tokenizer.decode(result.ids)


@pytest.mark.cpu
@pytest.mark.parametrize("name", ["bitnet-bitlinear", "bitnet-packed-i2_s.gguf",
                                  "bitnet-packed-tq2_0.gguf", "bitnet-packed-tq1_0.gguf"])
def test_formats_hold_the_same_weights(name):
    """Every container and scale convention of bitnet-packed's weights loads to the same packed
    bytes and scales, so the logits are the same to the bit."""
    a = Model.load(fixture("bitnet-packed"), device="cpu", progress=False)
    b = Model.load(fixture(name), device="cpu", progress=False)
    assert a.config == b.config or (a.config.vocab, a.config.hidden) == (b.config.vocab, b.config.hidden)
    for la, lb in zip(a.weights.layers, b.weights.layers):
        for part in ("qkv", "o", "gate_up", "down"):
            np.testing.assert_array_equal(getattr(la, part).packed, getattr(lb, part).packed)
            np.testing.assert_array_equal(getattr(la, part).scales, getattr(lb, part).scales)
        for part in ("attn_norm", "ffn_norm", "attn_sub_norm", "ffn_sub_norm"):
            np.testing.assert_array_equal(getattr(la, part), getattr(lb, part))
    np.testing.assert_array_equal(a.weights.embedding, b.weights.embedding)
    prompt = reference("bitnet-packed")["prompt0"]
    logits = []
    for model in (a, b):
        session = model.session(1, 32)
        session.prefill([prompt])
        logits.append(session.logits.copy())
    np.testing.assert_array_equal(logits[0], logits[1])


def fixture_writer():
    """tools/make_fixtures.py as a module (its writers need only numpy, gguf and tokenizers)."""
    import importlib
    import sys
    tools = os.path.join(os.path.dirname(__file__), "..", "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    return importlib.import_module("make_fixtures")


def write_bitnet_packed_gguf(path, kind, tokenizer=None):
    """bitnet-packed's tensors as a bitnet-25 GGUF of `kind` (a ternary type or "F16", bitnet.cpp's
    unquantized export: the codes and a `.scale` tensor), written with the fixture writer; its
    tokenizer.json's tokenizer unless `tokenizer` (GGUF metadata) is given."""
    from tokenizers import Tokenizer as HFTokenizer
    from bitnet_ffi.safetensors_file import SafetensorsCheckpoint
    st = SafetensorsCheckpoint(fixture("bitnet-packed"))
    weights, ternaries = {}, {}
    for n in st.names():
        if st.dtype(n) == "uint8":  # transformers' packing: row k * O/4 + r in bits 2k of row r
            P = np.asarray(st.tensor(n))
            codes = np.concatenate([((P >> 2 * k) & 3).astype(np.int8) - 1 for k in range(4)])
            scale = float(np.asarray(st.tensor(n + "_scale"), np.float32)[0])
            ternaries[n[:-len(".weight")]] = (codes, scale)
        elif not n.endswith(".weight_scale"):
            weights[n] = np.asarray(st.tensor(n), np.float32)
    config = json.load(open(os.path.join(fixture("bitnet-packed"), "config.json")))
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    tokenizer = tokenizer or HFTokenizer.from_file(os.path.join(fixture("bitnet-packed"),
                                                                "tokenizer.json"))
    fixture_writer().write_gguf(path, "bitnet-25", config, weights, ternaries, kind, tokenizer)


@pytest.mark.cpu
def test_gguf_float_codes_with_a_scale_tensor_hold_the_same_weights(tmp_path):
    """bitnet.cpp's unquantized export: F16 codes and a separate `.scale` tensor; loads to the
    same weights."""
    path = str(tmp_path / "f16.gguf")
    write_bitnet_packed_gguf(path, "F16")
    a, b = load(fixture("bitnet-packed")), load(path)
    for la, lb in zip(a.weights.layers, b.weights.layers):
        for part in ("qkv", "o", "gate_up", "down"):
            np.testing.assert_array_equal(getattr(la, part).packed, getattr(lb, part).packed)
            np.testing.assert_array_equal(getattr(la, part).scales, getattr(lb, part).scales)


@pytest.mark.cpu
def test_gguf_with_a_sentencepiece_tokenizer_generates(tmp_path):
    """A GGUF model whose embedded tokenizer is sentencepiece BPE: the prompt is tokenized as
    llama.cpp does, and the model continues it as the same weights do from those ids."""
    path = str(tmp_path / "spm.gguf")
    metadata = sentencepiece_vocab()
    write_bitnet_packed_gguf(path, "I2_S", metadata)
    model = Model.load(path, device="cpu", progress=False)
    prompt = "The quick brown fox"
    ids = [1] + reference_sentencepiece_encode(prompt, metadata)
    assert model.encode(prompt) == ids
    result = model.generate(prompt, max_tokens=8, stop=False)[0]
    same = Model.load(fixture("bitnet-packed"), device="cpu", progress=False)
    assert result.ids == same.generate(ids, max_tokens=8, stop=False)[0].ids
    assert result.text == model.tokenizer.decode(result.ids)


@pytest.mark.cpu
def test_llama_gguf_undoes_the_qk_permutation():
    """llama.cpp stores a llama model's q/k rows permuted; the loader restores HF's order."""
    a = Model.load(fixture("llama-silu"), device="cpu", progress=False)
    b = Model.load(fixture("llama-silu-tq2_0.gguf"), device="cpu", progress=False)
    assert (b.config.head_dim, b.config.activation, b.config.sub_norms, b.config.tied_head) == \
        (256, "silu", False, False)
    assert a.config.theta == b.config.theta == 1000042.0
    for la, lb in zip(a.weights.layers, b.weights.layers):
        np.testing.assert_array_equal(la.qkv.packed, lb.qkv.packed)
        np.testing.assert_array_equal(la.qkv.scales, lb.qkv.scales)
        assert la.attn_sub_norm is None and lb.attn_sub_norm is None
    np.testing.assert_array_equal(a.weights.head, b.weights.head)


# ---- the layout conversions against the formulas, on random codes ---------------------------

@pytest.mark.cpu
def test_hf_packing_converts_exactly(rng):
    O, I = 96, 256
    codes = rng.integers(0, 3, (O, I)).astype(np.uint8)
    R = O // 4
    packed = codes[:R] | (codes[R:2 * R] << 2) | (codes[2 * R:3 * R] << 4) | (codes[3 * R:] << 6)
    ours = hf_packed_to_ternary(packed, "test")
    got = bitnet_ffi.TernaryWeights(ours, np.ones(O, np.float32)).unpack()
    np.testing.assert_array_equal(got, codes.astype(np.int8) - 1)


@pytest.mark.cpu
@pytest.mark.parametrize("O, I", [(8, 384), (8, 48)])  # 48: 128-weight blocks cross rows
def test_i2s_converts_exactly(rng, O, I):
    codes = rng.integers(0, 3, (O, I)).astype(np.uint8)
    flat = codes.reshape(-1)
    raw = np.zeros(O * I // 4 + 32, np.uint8)
    for j in range(flat.size):  # the layout as bitnet.cpp documents it, one weight at a time
        block, k = divmod(j, 128)
        raw[32 * block + k % 32] |= flat[j] << (6 - 2 * (k // 32))
    raw[O * I // 4:O * I // 4 + 4] = np.frombuffer(np.float32(0.375).tobytes(), np.uint8)
    ours, scale = i2s_to_ternary(raw, O, I, "test")
    assert scale == 0.375
    flat = bitnet_ffi.TernaryWeights(ours.reshape(-1, 32), np.ones(O * I // 128, np.float32))
    np.testing.assert_array_equal(flat.unpack().reshape(O, I), codes.astype(np.int8) - 1)


# ---- configs ---------------------------------------------------------------------------------

TWO_B4T = {"architectures": ["BitNetForCausalLM"], "hidden_act": "relu2", "hidden_size": 2560,
           "intermediate_size": 6912, "num_hidden_layers": 30, "num_attention_heads": 20,
           "num_key_value_heads": 5, "vocab_size": 128256, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 4096, "tie_word_embeddings": True, "bos_token_id": 128000,
           "eos_token_id": 128001}


@pytest.mark.cpu
def test_config_reads_transformers_4_and_5():
    v4 = Config.from_hf({**TWO_B4T, "rope_theta": 500000.0, "rope_scaling": None})
    v5 = Config.from_hf({**TWO_B4T, "rope_parameters": {"rope_theta": 500000.0,
                                                         "rope_type": "default"}})
    assert v4 == v5 == Config(bos_id=128000, eos_ids=(128001,))
    falcon = Config.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
                             "hidden_size": 3072, "intermediate_size": 23040,
                             "num_hidden_layers": 40, "num_attention_heads": 12,
                             "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 131072,
                             "rms_norm_eps": 1e-6, "rope_theta": 1000042})
    assert (falcon.head_dim, falcon.activation, falcon.sub_norms, falcon.tied_head) == \
        (256, "silu", False, False)


@pytest.mark.cpu
@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "not supported"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE type 'llama3'"),
    ({"hidden_size": 2600}, "not a multiple of 128"),
    ({"intermediate_size": 6900}, "not a multiple of 16"),
    ({"num_attention_heads": 8, "num_key_value_heads": 8}, "head dimension 320"),
    ({"num_key_value_heads": 3}, "heads"),
    ({"attention_bias": True}, "biases"),
])
def test_config_refuses_what_it_cannot_run(change, message):
    with pytest.raises(UnsupportedError, match=message):
        Config.from_hf({**TWO_B4T, **change})


# ---- bad files -------------------------------------------------------------------------------

def copy_fixture(tmp_path, name):
    target = tmp_path / name
    (shutil.copytree if os.path.isdir(fixture(name)) else shutil.copy)(fixture(name), target)
    return target


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def load(path):
    return Model.load(path, device="cpu", progress=False)


@pytest.mark.cpu
def test_truncated_safetensors_is_refused(tmp_path):
    d = copy_fixture(tmp_path, "bitnet-packed")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CorruptFileError, match=r"model\.safetensors: tensor .*truncated"):
        load(d)
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CorruptFileError, match="model.safetensors: header length"):
        load(d)


@pytest.mark.cpu
def test_corrupt_safetensors_header_is_refused(tmp_path):
    d = copy_fixture(tmp_path, "bitnet-packed")
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"#not json!!#"
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match="model.safetensors: corrupt header"):
        load(d)


@pytest.mark.cpu
def test_unknown_safetensors_dtype_is_refused(tmp_path):
    d = copy_fixture(tmp_path, "bitnet-packed")
    f = d / "model.safetensors"
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = data[8:8 + n].replace(b'"BF16"', b'"F8Q4"', 1)
    f.write_bytes(data[:8] + header + data[8 + n:])
    with pytest.raises(CorruptFileError, match="unknown dtype 'F8Q4'"):
        load(d)


@pytest.mark.cpu
@pytest.mark.parametrize("change, error, message", [
    ({"intermediate_size": 640}, CorruptFileError, r"tensor model\.layers\.0\.mlp\.gate_proj\.weight: packed shape"),
    ({"num_hidden_layers": 3}, CorruptFileError, r"tensor model\.layers\.2\.\S+ is missing"),
    ({"num_hidden_layers": 1}, CorruptFileError, r"tensor model\.layers\.1\.\S+ is not part of the model"),
    ({"quantization_config": {"quant_method": "gptq"}}, UnsupportedError, "'gptq'"),
])
def test_checkpoint_that_does_not_match_its_config_is_refused(tmp_path, change, error, message):
    d = copy_fixture(tmp_path, "bitnet-packed")
    edit_config(d, **change)
    with pytest.raises(error, match=message):
        load(d)


@pytest.mark.cpu
def test_gguf_truncated_or_corrupt_is_refused(tmp_path):
    f = copy_fixture(tmp_path, "bitnet-packed-i2_s.gguf")
    data = f.read_bytes()
    f.write_bytes(data[:-5000])
    with pytest.raises(CorruptFileError, match=r"i2_s\.gguf: tensor \S+: .*(truncated|does not fit)"):
        load(f)
    f.write_bytes(data[:4] + b"\xff" * 60 + data[64:])
    with pytest.raises(CorruptFileError, match=r"i2_s\.gguf: not a readable GGUF file"):
        load(f)


@pytest.mark.cpu
def test_gguf_unknown_architecture_and_type_are_refused(tmp_path):
    f = copy_fixture(tmp_path, "bitnet-packed-tq2_0.gguf")
    data = f.read_bytes()
    f.write_bytes(data.replace(b"bitnet-25", b"bitnet-99"))
    with pytest.raises(UnsupportedError, match="architecture 'bitnet-99'"):
        load(f)
    from gguf import GGUFReader
    tensor = next(t for t in GGUFReader(fixture("bitnet-packed-tq2_0.gguf")).tensors
                  if t.name == "blk.0.attn_output.weight")
    type_at = tensor.field.offset + sum(p.nbytes for p in tensor.field.parts[:4])
    patched = bytearray(data)
    patched[type_at:type_at + 4] = struct.pack("<I", 99)
    f.write_bytes(bytes(patched))
    with pytest.raises(UnsupportedError, match=r"tensor blk\.0\.attn_output\.weight: type unknown type 99"):
        load(f)


TQ_BLOCK_BYTES = {"tq2_0": 66, "tq1_0": 54}  # 256 weights, then the fp16 scale in the last 2 bytes


def tq_with_block_scale(tmp_path, scale, kind="tq2_0"):
    """bitnet-packed's TQ2_0 (or TQ1_0) file with the fp16 scale of blk.1.ffn_down's row 0, second
    block, set to `scale`."""
    f = copy_fixture(tmp_path, f"bitnet-packed-{kind}.gguf")
    from gguf import GGUFReader
    tensor = next(t for t in GGUFReader(str(f)).tensors if t.name == "blk.1.ffn_down.weight")
    data = bytearray(f.read_bytes())
    d_at = tensor.data_offset + 2 * TQ_BLOCK_BYTES[kind] - 2
    data[d_at:d_at + 2] = np.float16(scale).tobytes()
    f.write_bytes(bytes(data))
    return f


@pytest.mark.cpu
@pytest.mark.parametrize("kind", TQ_BLOCK_BYTES)
def test_gguf_per_block_scales_load_exactly(tmp_path, kind):
    """A TQ2_0 or TQ1_0 row whose 256-weight blocks have different scales loads with block
    scales: the weights they stand for equal the gguf package's dequantization of the tensor, bit
    for bit; the other tensors keep one scale per row."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    f = tq_with_block_scale(tmp_path, 0.1, kind)
    model = load(f)
    tensor = next(t for t in GGUFReader(str(f)).tensors if t.name == "blk.1.ffn_down.weight")
    want = dequantize(tensor.data, tensor.tensor_type).reshape(model.weights.layers[1].down.shape)
    down = model.weights.layers[1].down
    assert down.block_scales is not None
    got = down.unpack() * down.scales[:, None] * np.repeat(down.block_scales, 256, axis=1)
    np.testing.assert_array_equal(got, want)
    assert want[0, 256:512].any() and np.abs(want[0, 256:512]).max() == np.float32(np.float16(0.1))
    assert all(getattr(layer, part).block_scales is None for layer in model.weights.layers
               for part in ("qkv", "o", "gate_up")) and model.weights.layers[0].down.block_scales is None
    session = model.session(1, 32)
    session.prefill([reference("bitnet-packed")["prompt0"]])
    assert np.isfinite(session.logits).all()


def tq2_with_zero_first_blocks(tmp_path, name, scale):
    """bitnet-packed's TQ2_0 file with the first 256-weight block of every ternary tensor's first
    row made zero: its codes 0 (with `scale`), or its scale 0."""
    f = copy_fixture(tmp_path, "bitnet-packed-tq2_0.gguf")
    f = f.rename(f.with_name(name))
    from gguf import GGMLQuantizationType, GGUFReader
    data = bytearray(f.read_bytes())
    for t in GGUFReader(str(f)).tensors:
        if t.tensor_type == GGMLQuantizationType.TQ2_0:
            if scale:
                data[t.data_offset:t.data_offset + 64] = b"\x55" * 64  # code 1: weight 0
            data[t.data_offset + 64:t.data_offset + 66] = np.float16(scale).tobytes()
    f.write_bytes(bytes(data))
    return f


@pytest.mark.parametrize("device", DEVICES)
def test_gguf_block_scaled_path_matches_the_row_scaled_one(tmp_path, device):
    """The same weights through the block-scaled GEMV (a block of zero codes with scale 0.5 in
    every ternary tensor; down's rows, of 2 blocks, then have blocks of different scales) and
    through the plain one (those blocks of scale 0): logits within float32 summation noise, greedy
    tokens identical."""
    from bitnet_ffi.model import Session
    blocked = Model.load(tq2_with_zero_first_blocks(tmp_path, "blocked.gguf", 0.5), device=device,
                         progress=False)
    plain = Model.load(tq2_with_zero_first_blocks(tmp_path, "plain.gguf", 0), device=device,
                       progress=False)
    for model, with_blocks in ((blocked, True), (plain, False)):
        for layer in model.weights.layers:
            assert (layer.down.block_scales is not None) == with_blocks
            assert all(getattr(layer, part).block_scales is None for part in ("qkv", "o", "gate_up"))
    prompt = reference("bitnet-packed")["prompt0"]
    # the input norms as ops of their own in both: the block-scaled weights take that path anyway
    sessions = [Session(model.weights, 1, 64, model.device, fuse_norms=False)
                for model in (blocked, plain)]
    tokens = [s.prefill([prompt]) for s in sessions]
    for step in range(8):
        a, b = (s.download(s.logits).astype(np.float64) for s in sessions)
        assert relative(a, b) < 1e-3, f"step {step}: {relative(a, b)}"
        np.testing.assert_array_equal(tokens[0], tokens[1])
        tokens = [s.decode(tokens[1]) for s in sessions]


@pytest.mark.cpu
def test_gguf_block_of_scale_zero_is_zeros(tmp_path):
    """llama.cpp writes scale 0 for a 256-weight block that is all zeros: such a block agrees with
    the row's scale, and loads as zero weights."""
    f = tq_with_block_scale(tmp_path, 0)
    want = load(fixture("bitnet-packed-tq2_0.gguf")).weights.layers[1].down
    got = load(f).weights.layers[1].down
    np.testing.assert_array_equal(got.scales, want.scales)
    expected = want.unpack()
    expected[0, 256:512] = 0
    np.testing.assert_array_equal(got.unpack(), expected)


@pytest.mark.cpu
def test_code_3_in_packed_weights_is_refused(tmp_path):
    d = copy_fixture(tmp_path, "bitnet-packed")
    f = d / "model.safetensors"
    from bitnet_ffi.safetensors_file import SafetensorsFile
    st = SafetensorsFile(f)
    name = "model.layers.1.mlp.down_proj.weight"
    at = st.data_start + st.entries[name][2]
    data = bytearray(f.read_bytes())
    data[at] = 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match=rf"tensor {name}: holds the 2-bit code 3"):
        load(d)


@pytest.mark.gpu
def test_failed_load_frees_the_device(tmp_path):
    """Layers 0 and 1 reach the device, then layer 2 is missing: no device array stays alive."""
    import gc

    def live_device_arrays():
        gc.collect()
        return sum(isinstance(o, _arrays.DeviceArray) for o in gc.get_objects())
    d = copy_fixture(tmp_path, "bitnet-packed")
    edit_config(d, num_hidden_layers=3)
    before = live_device_arrays()
    with pytest.raises(CorruptFileError, match="is missing") as caught:
        Model.load(d, device="cuda", progress=False)
    del caught
    assert live_device_arrays() == before
    model = Model.load(fixture("bitnet-packed"), device="cuda", progress=False)
    assert live_device_arrays() > before + 20  # the count does see a loaded model
    del model


# ---- tokenizer, chat, CLI --------------------------------------------------------------------

TEXTS = ["The quick brown fox", "Numbers: 12345 and 678!", "  spaces\nand newlines\n\n",
         "<|begin_of_text|>User: hi<|eot_id|>", "héllo wörld ✓"]


@pytest.mark.cpu
def test_gguf_tokenizer_matches_tokenizer_json():
    from_json = Tokenizer.from_directory(fixture("bitnet-packed"))
    from bitnet_ffi.gguf_file import GGUFFile
    from_gguf = Tokenizer.from_gguf(GGUFFile(fixture("bitnet-packed-i2_s.gguf")).metadata)
    for text in TEXTS:
        ids = from_json.encode(text)
        assert from_gguf.encode(text) == ids
        assert from_json.decode(ids) == from_gguf.decode(ids)
    eot = from_json.tokenizer.token_to_id("<|eot_id|>")
    assert eot in from_json.stop_ids and eot in from_gguf.stop_ids
    assert from_json.bos_id == from_gguf.bos_id == from_json.tokenizer.token_to_id("<|begin_of_text|>")


SENTENCEPIECE_TEXTS = TEXTS + ["chuck wood", "naïve café 🙂 中文", "</s>after<s> x  y", "<s>", "",
                              "a" * 40, "\t tab"]


def sentencepiece_vocab():
    return fixture_writer().sentencepiece_vocab()


@pytest.mark.cpu
def test_gguf_sentencepiece_tokenizer_matches_llama_cpp_algorithm():
    """A 'llama' GGUF tokenizer (Llama 2's layout: byte tokens, scores) against the reference of
    llama.cpp's merge loop; decoding gives the text back with the prefixed space."""
    metadata = sentencepiece_vocab()
    tok = Tokenizer.from_gguf(metadata, "sentencepiece")
    for text in SENTENCEPIECE_TEXTS:
        ids = tok.encode(text, bos=False)
        assert ids == reference_sentencepiece_encode(text, metadata), text
        if "<s>" not in text and text:
            assert tok.decode(ids) == " " + text
    assert tok.encode("hi")[0] == tok.bos_id == 1 and tok.stop_ids == {2}
    stream = TextStream(tok)  # a character split over byte tokens waits for its last byte
    pieces = [stream.push(i) for i in tok.encode("🙂 ok", bos=False)] + [stream.flush()]
    assert "".join(pieces) == " 🙂 ok" and "🙂" in pieces and not any("\ufffd" in p for p in pieces)
    metadata["tokenizer.ggml.add_space_prefix"] = False
    assert tok.decode(Tokenizer.from_gguf(metadata).encode("fox", bos=False)) == "fox"
    with pytest.raises(CorruptFileError, match="unknown_token_id = 480 is not one of the 480"):
        Tokenizer.from_gguf({**metadata, "tokenizer.ggml.unknown_token_id": 480})
    del metadata["tokenizer.ggml.scores"][5:]
    with pytest.raises(CorruptFileError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf(metadata)


def train_sentencepiece(path, **options):
    """A sentencepiece BPE model of Llama 2's kind (byte fallback, identity normalization, digits
    split) trained on the fixtures' corpus, written to `path`."""
    import io
    import sentencepiece
    model = io.BytesIO()
    settings = dict(model_type="bpe", vocab_size=420, byte_fallback=True, split_digits=True,
                    normalization_rule_name="identity", hard_vocab_limit=False,
                    allow_whitespace_only_pieces=True, remove_extra_whitespaces=False)
    settings.update(options)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(fixture_writer().CORPUS.splitlines() * 4), model_writer=model,
        minloglevel=2, **settings)
    path.write_bytes(model.getvalue())


@pytest.mark.cpu
def test_sentencepiece_tokenizer_model_matches_sentencepiece(tmp_path):
    """A model directory with tokenizer.model and no tokenizer.json (1bitLLM's, Llama 2's files):
    its ids are sentencepiece's own, its text too but for the space of the dummy prefix, which
    decoding keeps (as for a GGUF 'llama' tokenizer: a continuation keeps its leading space), and
    the model loads and generates with it."""
    import sentencepiece
    d = copy_fixture(tmp_path, "bitnet-padded")
    (d / "tokenizer.json").unlink()
    train_sentencepiece(d / "tokenizer.model")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    tok = Tokenizer.from_directory(str(d))
    for text in [t for t in SENTENCEPIECE_TEXTS if "<s>" not in t] + ["  two  spaces", "x\ty\nz"]:
        ids = tok.encode(text, bos=False)
        assert ids == processor.encode(text), text
        prefix = " " if ids and processor.id_to_piece(ids[0]).startswith("\u2581") else ""
        assert tok.decode(ids) == prefix + processor.decode(ids), text
    model = Model.load(str(d), device="cpu", progress=False)
    result = model.generate([model.tokenizer.encode("The quick brown fox")], max_tokens=4,
                            stop=False)[0]
    assert len(result.ids) == 4 and result.text == model.tokenizer.decode(result.ids)


@pytest.mark.cpu
@pytest.mark.parametrize("options, error, message", [
    ({"model_type": "unigram"}, UnsupportedError, "model type UNIGRAM is not supported"),
    ({"normalization_rule_name": "nmt_nfkc"}, UnsupportedError, "normalization 'nmt_nfkc'"),
    (None, CorruptFileError, "not a sentencepiece model"),
])
def test_sentencepiece_tokenizer_model_refuses_what_it_cannot_read(tmp_path, options, error,
                                                                    message):
    path = tmp_path / "tokenizer.model"
    if options is None:
        path.write_bytes(b"\x0a\xff\xff not a model")
    else:
        train_sentencepiece(path, **options)
    with pytest.raises(error, match=message):
        Tokenizer.from_directory(str(tmp_path))


@pytest.mark.cpu
def test_chat_format_and_template():
    tok = Tokenizer.from_directory(fixture("bitnet-packed"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.chat_text(messages) == ("<|begin_of_text|>System: Be brief.<|eot_id|>"
                                       "User: Hi<|eot_id|>Assistant: ")
    ids = tok.chat(messages)
    assert ids[0] == tok.bos_id and ids.count(tok.tokenizer.token_to_id("<|eot_id|>")) == 2
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                         "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    assert tok.chat_text(messages) == "<|begin_of_text|>[system]Be brief.[user]Hi[assistant]"


@pytest.mark.cpu
def test_extend_after_rewind_equals_one_prefill():
    """What the chat loop does between turns: keep the cache, rewind to the matching prefix,
    prefill the rest. The logits equal one prefill of the whole conversation."""
    model = load(fixture("bitnet-packed"))
    ids = reference("bitnet-packed")["prompt1"].tolist()
    session = model.session(1, 64)
    session.prefill([ids])
    whole = session.logits.copy()
    session.prefill([ids[:5] + [7, 7, 7]])
    session.rewind(5)
    session.extend([ids[5:]])
    np.testing.assert_allclose(session.logits, whole, rtol=0, atol=1e-4 * np.abs(whole).max())


@pytest.mark.cpu
def test_cli_generate_json(capsys):
    from bitnet_ffi.cli import main
    assert main(["generate", "--model", fixture("bitnet-packed"), "--prompt", "The quick brown",
                 "--max-tokens", "8", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = load(fixture("bitnet-packed"))
    expected = model.generate("The quick brown", max_tokens=8)[0]
    assert out["prompt_ids"] == expected.prompt_ids and out["generated_ids"] == expected.ids
    assert out["text"] == expected.text
    assert out["timings"]["prefill_tokens_per_s"] > 0


@pytest.mark.cpu
def test_generate_refuses_bad_requests():
    model = load(fixture("bitnet-packed"))
    with pytest.raises(InvalidArgumentError, match="prompt ids"):
        model.generate([[model.config.vocab]])
    with pytest.raises(InvalidArgumentError, match="exceed"):
        model.generate("hi", max_tokens=model.config.max_positions)
    with pytest.raises(InvalidArgumentError, match="temperature"):
        model.generate("hi", temperature=-1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_is_reproducible(device):
    model = Model.load(fixture("bitnet-packed"), device=device, progress=False)
    runs = [model.generate(["The quick", "Numbers"], max_tokens=16, temperature=0.8, top_k=40,
                           top_p=0.95, seed=s, stop=False) for s in (1, 1, 2)]
    assert [r.ids for r in runs[0]] == [r.ids for r in runs[1]]
    assert [r.ids for r in runs[0]] != [r.ids for r in runs[2]]


@pytest.mark.cpu
def test_demo_times_a_checkpoint(capsys):
    from bitnet_ffi.cli import main
    assert main(["demo", "--model", fixture("bitnet-packed-tq1_0.gguf"), "--device", "cpu",
                 "--prompt-len", "8", "--tokens", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layers"] == 2 and len(report["tokens_first_sequence"]) == 4
    assert report["decode_ms_per_token"] > 0


@pytest.mark.cpu
def test_gguf_latent_float_weights_are_refused():
    from bitnet_ffi.loader import float_to_codes
    codes, m = float_to_codes(np.array([[0.5, -0.5, 0.0]], np.float16), "t")
    assert m == 0.5 and codes.tolist() == [[1, -1, 0]]
    with pytest.raises(UnsupportedError, match="t: float weights that are not ternary"):
        float_to_codes(np.array([[0.5, -0.5, 0.25]], np.float16), "t")


@pytest.mark.cpu
def test_chat_keeps_the_cache_between_turns(monkeypatch, capsys):
    """The second turn prefills only what follows the cached conversation, and its reply is
    the one a fresh prefill of the whole conversation gives."""
    import io
    from bitnet_ffi import generate
    from bitnet_ffi.model import Session
    model = load(fixture("bitnet-packed"))
    prefilled = []
    extend = Session.extend
    monkeypatch.setattr(Session, "extend",
                        lambda self, ids, *a, **k: prefilled.append(len(ids[0])) or
                        extend(self, ids, *a, **k))
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\nAnd then?\n\n"))
    sampling = dict(max_tokens=6, temperature=0.0, top_k=0, top_p=1.0, seed=0)
    assert generate.chat(model, sampling) == 0
    replies = capsys.readouterr().out.splitlines()
    monkeypatch.setattr(Session, "extend", extend)
    assert len(replies) == 2
    tok = model.tokenizer
    first = [{"role": "user", "content": "Hello there"}]
    conversation = tok.chat(first)
    reply1 = model.generate([conversation], max_tokens=6)[0]
    assert replies[0] == reply1.text
    second = tok.chat(first + [{"role": "assistant", "content": reply1.text},
                               {"role": "user", "content": "And then?"}])
    cached = conversation + reply1.ids
    common = next(i for i, (a, b) in enumerate(zip(second, cached + [-1])) if a != b)
    assert common >= len(conversation) and prefilled == [len(conversation), len(second) - common]
    reply2 = model.generate([second], max_tokens=6)[0]
    assert replies[1] == reply2.text


@pytest.mark.cpu
def test_1bitllm_sub_norm_names(tmp_path):
    """1bitLLM's BitnetForCausalLM names its sub-norms self_attn.inner_attn_ln and
    mlp.ffn_layernorm: bitnet-packed renamed so (and kept relu2) loads to the same weights."""
    d = copy_fixture(tmp_path, "bitnet-packed")
    f = d / "model.safetensors"
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = data[8:8 + n].replace(b"self_attn.attn_sub_norm", b"self_attn.inner_attn_ln")
    header = header.replace(b"mlp.ffn_sub_norm", b"mlp.ffn_layernorm")
    header += b" " * (-len(header) % 8)
    f.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n:])
    edit_config(d, architectures=["BitnetForCausalLM"], hidden_act="relu2")
    a, b = load(fixture("bitnet-packed")), load(d)
    assert b.config.sub_norms and b.config.activation == "relu2"
    for la, lb in zip(a.weights.layers, b.weights.layers):
        np.testing.assert_array_equal(la.attn_sub_norm, lb.attn_sub_norm)
        np.testing.assert_array_equal(la.ffn_sub_norm, lb.ffn_sub_norm)


def write_safetensors(path, tensors):
    """tensors: name -> (dtype code, shape, raw bytes)."""
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


@pytest.mark.cpu
def test_sharded_checkpoint_loads_the_same(tmp_path):
    from bitnet_ffi.safetensors_file import DTYPES, SafetensorsFile
    d = copy_fixture(tmp_path, "bitnet-packed")
    single = SafetensorsFile(d / "model.safetensors")
    codes = {v: k for k, v in DTYPES.items()}
    names = single.names()
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in shards.items():
        write_safetensors(d / shard, {n: (codes[single.dtype(n)], single.shape(n),
                                          single.tensor(n).tobytes()) for n in part})
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: s for s, part in shards.items() for n in part}}))
    a, b = load(fixture("bitnet-packed")), load(d)
    for la, lb in zip(a.weights.layers, b.weights.layers):
        np.testing.assert_array_equal(la.gate_up.packed, lb.gate_up.packed)
        np.testing.assert_array_equal(la.qkv.scales, lb.qkv.scales)
    np.testing.assert_array_equal(a.weights.embedding, b.weights.embedding)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                        names[1]: "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CorruptFileError, match="listed in .*index.json, is not in the file"):
        load(d)


@pytest.mark.cpu
def test_cli_errors_are_clear(capsys, tmp_path):
    from bitnet_ffi.cli import main
    assert main(["generate", "--model", str(tmp_path / "nothing"), "--prompt", "x",
                 "--device", "cpu"]) == 2
    assert "no such model directory or file" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["generate", "--model", str(tmp_path / "notes.txt"), "--prompt", "x",
                 "--device", "cpu"]) == 2
    assert "neither a model directory" in capsys.readouterr().err


def teacher_forced(model, ref, **session_options):
    """(tokens, float64 logits of each step) of a one-sequence Session (session_options: its
    fused, fuse_qkv_rope, fuse_norms or fuse_rope_attention) prefilled with the reference's prompt and decoded along
    transformers' tokens."""
    from bitnet_ffi.model import Session
    session = Session(model.weights, 1, 128, model.device, **session_options)
    for option, value in session_options.items():
        assert getattr(session, option) == value, f"Session did not take {option}={value}"
    tokens, logits = [int(session.prefill(np.array([ref["prompt0"]], np.int32))[0])], []
    for step in range(STEPS):
        logits.append(session.download(session.logits)[0].astype(np.float64))
        tokens.append(int(session.decode([ref["tokens0"][step]])[0]))
    return tokens, np.array(logits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["bitnet-packed", "llama-silu", "bitnet-padded"])
def test_fused_qkv_rope_gives_the_unfused_logits(name, device):
    """A decode step whose QKV projection, RoPE and KV-cache append are one
    gemv_w2a8_rope_append_kv op (the default for one sequence) against the step that runs
    gemv_w2a8 then rope_append_kv, teacher-forced along transformers' tokens: the same logits bit
    for bit on the CPU and on a GPU, so the same greedy tokens."""
    model = Model.load(fixture(name), device=device, progress=False)
    ref = reference(name)
    tokens, logits = teacher_forced(model, ref, fuse_qkv_rope=False)
    fused_tokens, fused_logits = teacher_forced(model, ref, fuse_qkv_rope=True)
    np.testing.assert_array_equal(fused_logits, logits)
    assert fused_tokens == tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["bitnet-packed", "llama-silu", "bitnet-padded"])
def test_fused_rope_attention_gives_the_unfused_logits(name, device):
    """A decode step whose RoPE, KV-cache append and attention are one attention_rope_append_kv op
    (the default where the QKV projection does not take RoPE: more than one sequence, here one
    with fuse_qkv_rope off) against the step that runs rope_append_kv then attention,
    teacher-forced along transformers' tokens: the same logits bit for bit on the CPU and on a
    GPU, so the same greedy tokens."""
    model = Model.load(fixture(name), device=device, progress=False)
    ref = reference(name)
    tokens, logits = teacher_forced(model, ref, fuse_qkv_rope=False, fuse_rope_attention=False)
    fused_tokens, fused_logits = teacher_forced(model, ref, fuse_qkv_rope=False,
                                                fuse_rope_attention=True)
    np.testing.assert_array_equal(fused_logits, logits)
    assert fused_tokens == tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["bitnet-packed", "llama-silu", "bitnet-padded"])
def test_fused_norms_give_the_unfused_tokens(name, device):
    """A decode step whose input norms run inside the GEMVs around them (the default for one
    sequence) against the step with norm ops of their own, teacher-forced along transformers'
    tokens: on the CPU the same logits bit for bit (its producer sums the squares in the CPU
    norm's order); on a GPU, where the two sums of squares are added in different orders and a
    code may move by one, logits within the bound of test_fixture_matches_transformers and the
    same greedy token at every step."""
    model = Model.load(fixture(name), device=device, progress=False)
    ref = reference(name)
    tokens, logits = teacher_forced(model, ref, fuse_norms=False)
    fused_tokens, fused_logits = teacher_forced(model, ref, fuse_norms=True)
    assert fused_tokens == tokens
    if device == "cpu":
        np.testing.assert_array_equal(fused_logits, logits)
        return
    bound = LOGIT_BOUND * max(relative(h, f) for h, f in zip(ref["logits_bf16_0"], ref["logits0"]))
    for step in range(STEPS):
        error = relative(fused_logits[step], logits[step])
        assert error <= bound, f"{name} step {step}: logits error {error:.4f} > {bound:.4f}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["bitnet-packed", "llama-silu", "bitnet-padded"])
def test_fused_decode_layers_give_the_unfused_tokens(name, device):
    """Session(fused=True) (one decode_layer op a layer) against the op sequence on a fixture,
    teacher-forced along transformers' tokens: on the CPU the same logits bit for bit; on a GPU
    the same greedy token at every step whose top-2 margin is clear (MARGIN) and logits within
    the bound of test_fixture_matches_transformers (the fixture's bfloat16-against-float32 logit
    difference): the two differ by float32 sum orders and the int8 codes they flip
    (docs/decode_layer.md), less than bfloat16 rounding moves transformers' logits."""
    model = Model.load(fixture(name), device=device, progress=False)
    ref = reference(name)
    tokens, logits = teacher_forced(model, ref, fused=False)
    fused_tokens, fused_logits = teacher_forced(model, ref, fused=True)
    if device == "cpu":
        np.testing.assert_array_equal(fused_logits, logits)
        assert fused_tokens == tokens
        return
    bound = LOGIT_BOUND * max(relative(h, f) for h, f in zip(ref["logits_bf16_0"], ref["logits0"]))
    compared = 0
    for step in range(STEPS):
        error = relative(fused_logits[step], logits[step])
        assert error <= bound, f"{name} step {step}: logits error {error:.4f} > {bound:.4f}"
        if top2_margin(logits[step]) >= MARGIN:
            assert np.argmax(fused_logits[step]) == np.argmax(logits[step]), f"{name} step {step}"
            compared += 1
    assert compared >= STEPS // 2
