"""Writes the model fixtures of tests/test_models.py with Hugging Face transformers as the oracle
(needs torch, transformers, accelerate, tokenizers and gguf; the tests themselves need none of the
first three).

    python tools/make_fixtures.py [--out tests/fixtures/models]
    python tools/make_fixtures.py --full-size DIR   # a full-size random 2B4T checkpoint (not committed)

Small random models, saved by transformers' own save_pretrained:
- bitnet-packed: BitNetForCausalLM in 2B4T's layout (uint8 packed weights, weight_scale the
  absmean, linear_class autobitlinear), with a BPE tokenizer.json trained here;
- bitnet-bitlinear: the same weights in the BitLinear layout (weight_scale = 1 / absmean), its
  config.json written as transformers 4.x writes it (rope_theta at the top level);
- bitnet-bf16: unquantized bfloat16 weights (quantization_mode online: quantized at load);
- llama-silu: LlamaForCausalLM with transformers' BitNet quantizer (BitLinear), SiLU, head dim
  256, untied head (Falcon3-1.58bit's layout);
- bitnet-padded: 1bitLLM's layout at sizes that run padded (head dim 96, intermediate 624), with
  float16 latent weights, and bitnet-padded-i2_s.gguf;
- bitnet-packed-{i2_s,tq2_0,tq1_0}.gguf: bitnet-packed's weights as bitnet.cpp / llama.cpp write
  them (architecture bitnet-25, the tokenizer embedded), and llama-silu-tq2_0.gguf (llama, q/k
  rows permuted as llama.cpp's converter does).
For each model, reference.npz holds the prompts, transformers' float32 logits of 32 greedy steps
(prefill included), its greedy tokens, and the logits of a bfloat16 run fed the same tokens.

Scales are powers of two and norm and embedding values multiples of 1/64 below 4, so that
bfloat16, float16 (GGUF) and 1 / scale (BitLinear) all hold them exactly: every format of one
model has bit-identical weights.
"""
import argparse
import json
import os
import shutil

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # transformers' BitNet code uses torch.compile

import numpy as np

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = """BitNet b1.58 is a large language model whose weights are ternary: every weight is -1, 0
or +1, with one scale per tensor. Activations are quantized to eight bits per token. The model
has thirty layers, a hidden size of 2560 and a vocabulary of 128256 tokens. It was trained on
four trillion tokens. A ternary matrix multiply needs no multiplications, only additions and
subtractions, so inference is fast on CPUs and GPUs alike. The quick brown fox jumps over the lazy
dog. She sells sea shells by the sea shore. How much wood would a woodchuck chuck if a woodchuck
could chuck wood? Numbers like 12345, 678 and 9 are split into groups of at most three digits.
User: What is the capital of France? Assistant: The capital of France is Paris.
System: You are a helpful assistant. User: Tell me a story about a robot who learns to paint."""
PROMPTS = ["The quick brown fox", "User: What is the capital of France? Assistant: The capital"]
STEPS = 32


def train_tokenizer(vocab_size=480):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer)
    return tok


def sentencepiece_vocab(vocab_size=480):
    """The GGUF metadata of a llama.cpp 'llama' (sentencepiece BPE) tokenizer of vocab_size tokens,
    trained on CORPUS as Llama 2's is laid out: <unk>, <s>, </s> (control), the 256 <0xXX> byte
    tokens, the pieces (merged ones scored minus their merge rank, single characters below them),
    then unused tokens up to vocab_size."""
    from tokenizers import SentencePieceBPETokenizer
    specials = ["<unk>", "<s>", "</s>"]
    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator([CORPUS] * 4, vocab_size=vocab_size - len(specials) - 256,
                                show_progress=False)
    model = json.loads(trained.to_str())["model"]
    merged = ["".join(m if isinstance(m, list) else m.split(" ")) for m in model["merges"]]
    chars = sorted(t for t in model["vocab"] if len(t) == 1)
    pieces = merged + chars
    scores = [-float(i) for i in range(len(pieces))]
    unused = [f"<unused{i}>" for i in range(vocab_size - len(specials) - 256 - len(pieces))]
    return {"tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": specials + [f"<0x{b:02X}>" for b in range(256)] + pieces + unused,
            "tokenizer.ggml.scores": [0.0] * (len(specials) + 256) + scores + [0.0] * len(unused),
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [5] * len(unused),
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2}


def exact_values(rng, shape, spread, center=0.0):
    """Multiples of 1/64 under 4 in magnitude: exact in bfloat16 and float16."""
    return np.clip(np.round((center + spread * rng.standard_normal(shape)) * 64) / 64, -3.96, 3.96)


def ternary(rng, rows, cols):
    """(codes int8 [rows, cols] in {-1, 0, 1}, scale a power of two)."""
    return (rng.integers(0, 3, (rows, cols)) - 1).astype(np.int8), float(2.0 ** -rng.integers(3, 6))


def random_model(rng, c):
    """Ternary codes and scales per projection, norms and embedding, for a transformers config c."""
    H, I, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    D = c.get("head_dim") or H // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * D
    shapes = {"self_attn.q_proj": (H, H), "self_attn.k_proj": (kv, H), "self_attn.v_proj": (kv, H),
              "self_attn.o_proj": (H, H), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H),
              "mlp.down_proj": (H, I)}
    weights = {"model.embed_tokens.weight": exact_values(rng, (c["vocab_size"], H), 0.15),
               "model.norm.weight": exact_values(rng, H, 0.1, 1.0)}
    if not c["tie_word_embeddings"]:
        weights["lm_head.weight"] = exact_values(rng, (c["vocab_size"], H), 0.5)
    ternaries = {}
    for i in range(L):
        p = f"model.layers.{i}."
        for name, shape in shapes.items():
            ternaries[p + name] = ternary(rng, *shape)
        weights[p + "input_layernorm.weight"] = exact_values(rng, H, 0.1, 1.0)
        weights[p + "post_attention_layernorm.weight"] = exact_values(rng, H, 0.1, 1.0)
        if c["architectures"] == ["BitNetForCausalLM"]:
            weights[p + "self_attn.attn_sub_norm.weight"] = exact_values(rng, H, 0.1, 1.0)
            weights[p + "mlp.ffn_sub_norm.weight"] = exact_values(rng, I, 0.1, 1.0)
    return weights, ternaries


def pack_hf(codes):
    """transformers' packing: uint8 [O/4, I], W[k O/4 + r] in bits 2k of row r."""
    R = codes.shape[0] // 4
    c = (codes + 1).astype(np.uint8)
    return c[:R] | (c[R:2 * R] << 2) | (c[2 * R:3 * R] << 4) | (c[3 * R:] << 6)


def save_hf(directory, config_dict, weights, ternaries, layout, tokenizer):
    """save_pretrained of the model in `layout`: "autobitlinear" (packed, absmean scale),
    "bitlinear" (packed, 1 / absmean) or "online" (bfloat16 weights)."""
    import torch
    import transformers
    from transformers.integrations.bitnet import replace_with_bitnet_linear
    from transformers.utils.quantization_config import BitNetQuantConfig
    config_cls = getattr(transformers, config_dict["architectures"][0].replace("ForCausalLM",
                                                                               "Config"))
    model_cls = getattr(transformers, config_dict["architectures"][0])
    config = config_cls(**{k: v for k, v in config_dict.items() if k != "architectures"})
    config.architectures = config_dict["architectures"]
    model = model_cls(config).to(torch.bfloat16)
    quant = {"quant_method": "bitnet", "linear_class": "bitlinear" if layout == "bitlinear"
             else "autobitlinear", "quantization_mode": "online" if layout == "online"
             else "offline"}
    if layout != "online":  # packed uint8 buffers, as BitLinear holds them
        replace_with_bitnet_linear(model, modules_to_not_convert=["lm_head"],
                                   quantization_config=BitNetQuantConfig(linear_class="bitlinear"))
    for name, (codes, scale) in ternaries.items():
        module = model.get_submodule(name)
        if layout == "online":
            module.weight.data = torch.from_numpy(codes.astype(np.float32) * scale).bfloat16()
        else:
            module.weight = torch.from_numpy(pack_hf(codes))
            value = 1.0 / scale if layout == "bitlinear" else scale
            module.weight_scale = torch.tensor([value], dtype=torch.bfloat16)
    state = {k: torch.from_numpy(np.asarray(v, np.float32)).bfloat16() for k, v in weights.items()}
    missing = model.load_state_dict(state, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    if config.tie_word_embeddings:
        model.tie_weights()
    model.config.quantization_config = quant
    model.save_pretrained(directory)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": SPECIALS[0], "eos_token": SPECIALS[2],
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)


def as_transformers_4(directory):
    """config.json as transformers 4.x writes it: rope_theta at the top level."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        c = json.load(f)
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope["rope_theta"]
    c["rope_scaling"] = None
    with open(path, "w") as f:
        json.dump(c, f, indent=2)


def reference(directory, prompts):
    """transformers' greedy run (float32) and a bfloat16 run fed the same tokens."""
    import torch
    import transformers
    out = {}
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        model.to(dtype)  # transformers 5 leaves the embedding and norms in the file's dtype
        for module in model.modules():
            if type(module).__name__ == "BitLinear":
                module.dtype = dtype  # the dtype it unpacks to and computes in
        runs[dtype] = model
    for p, prompt in enumerate(prompts):
        ids = list(prompt)
        logits32, logits16 = [], []
        with torch.no_grad():
            for _ in range(STEPS):
                x = torch.tensor([ids])
                l32 = runs[torch.float32](x).logits[0, -1].float().numpy()
                l16 = runs[torch.bfloat16](x).logits[0, -1].float().numpy()
                logits32.append(l32)
                logits16.append(l16)
                ids.append(int(np.argmax(l32)))
        out[f"prompt{p}"] = np.array(prompt, np.int32)
        out[f"tokens{p}"] = np.array(ids[len(prompt):], np.int32)
        out[f"logits{p}"] = np.array(logits32, np.float32)
        out[f"logits_bf16_{p}"] = np.array(logits16, np.float32)
    np.savez_compressed(os.path.join(directory, "reference.npz"), **out)
    return out


# ---- GGUF ------------------------------------------------------------------------------------

def i2s_bytes(codes, scale):
    """bitnet.cpp I2_S: 128-weight blocks of the row-major codes, weight j of a block in byte
    j % 32 at bit 6 - 2 (j / 32), codes 0, 1, 2 = -1, 0, +1; then 32 bytes, the first 4 the
    float32 scale."""
    c = (codes.reshape(-1, 4, 32) + 1).astype(np.uint8)  # [block, j / 32, j % 32]
    packed = (c[:, 0] << 6) | (c[:, 1] << 4) | (c[:, 2] << 2) | c[:, 3]
    tail = np.zeros(32, np.uint8)
    tail[:4] = np.frombuffer(np.float32(scale).tobytes(), np.uint8)
    return np.concatenate([packed.reshape(-1), tail])


def permute_qk(w, heads):
    """llama.cpp's converter: q/k rows reordered for its interleaved RoPE."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch, c, weights, ternaries, kind, tokenizer):
    import gguf
    from gguf import GGMLQuantizationType
    w = gguf.GGUFWriter(path, arch)
    H = c["hidden_size"]
    D = c.get("head_dim") or H // c["num_attention_heads"]
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    add_gguf_tokenizer(w, tokenizer)
    renames = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.attn_sub_norm": "attn_sub_norm", "mlp.ffn_sub_norm": "ffn_sub_norm"}

    def gguf_name(name):
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            base = rest.rsplit(".weight", 1)[0]
            return f"blk.{i}.{renames[base]}.weight"
        return {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                "model.norm.weight": "output_norm.weight"}[name]

    for name, value in weights.items():
        dtype = np.float32 if value.ndim == 1 else np.float16
        w.add_tensor(gguf_name(name), np.asarray(value, dtype))
    for name, (codes, scale) in ternaries.items():
        if arch == "llama" and name.endswith(("q_proj", "k_proj")):
            heads = c["num_attention_heads"] if name.endswith("q_proj") else c["num_key_value_heads"]
            codes = permute_qk(codes, heads)
        target = gguf_name(name + ".weight")
        if kind == "F16":  # bitnet.cpp's unquantized export: the codes, the scale apart
            w.add_tensor(target, codes.astype(np.float16))
            w.add_tensor(target.replace(".weight", ".scale"), np.array([scale], np.float32))
        elif kind == "I2_S":
            # gguf does not know type 36: write the bytes as I8, then declare I2_S and the shape
            w.add_tensor(target, i2s_bytes(codes, scale).view(np.int8))
            info = w.tensors[-1][target]
            info.shape, info.dtype = codes.shape, 36
        else:
            qtype = GGMLQuantizationType[kind]
            w.add_tensor(target, gguf.quants.quantize(codes.astype(np.float32) * scale, qtype),
                         raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add_gguf_tokenizer(w, tokenizer):
    """A `tokenizers` byte-level BPE as llama.cpp's 'gpt2' tokenizer, or the GGUF metadata of a
    sentencepiece one (a dict, from sentencepiece_vocab) as it is."""
    if isinstance(tokenizer, dict):
        w.add_tokenizer_model(tokenizer["tokenizer.ggml.model"])
        w.add_token_list(tokenizer["tokenizer.ggml.tokens"])
        w.add_token_scores(tokenizer["tokenizer.ggml.scores"])
        w.add_token_types(tokenizer["tokenizer.ggml.token_type"])
        w.add_unk_token_id(tokenizer["tokenizer.ggml.unknown_token_id"])
        w.add_bos_token_id(tokenizer["tokenizer.ggml.bos_token_id"])
        w.add_eos_token_id(tokenizer["tokenizer.ggml.eos_token_id"])
        return
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["id"] for t in data["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[SPECIALS[0]])
    w.add_eos_token_id(vocab[SPECIALS[1]])
    w.add_eot_token_id(vocab[SPECIALS[2]])


# ---- main -------------------------------------------------------------------------------------

def bitnet_config(vocab, **overrides):
    c = dict(architectures=["BitNetForCausalLM"], hidden_size=256, intermediate_size=512,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
             hidden_act="relu2", rms_norm_eps=1e-5, rope_theta=500000.0,
             max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=0,
             eos_token_id=1)
    c.update(overrides)
    return c


def prompt_ids(tok):
    return [[tok.token_to_id(SPECIALS[0])] + tok.encode(p).ids for p in PROMPTS]


def make_small(out):
    tok = train_tokenizer()
    V = tok.get_vocab_size()
    prompts = prompt_ids(tok)
    rng = np.random.default_rng(2026)
    os.makedirs(out, exist_ok=True)

    bitnet = bitnet_config(V)
    weights, ternaries = random_model(rng, bitnet)
    for name, layout in (("bitnet-packed", "autobitlinear"), ("bitnet-bitlinear", "bitlinear")):
        d = os.path.join(out, name)
        shutil.rmtree(d, ignore_errors=True)
        save_hf(d, bitnet, weights, ternaries, layout, tok)
        if layout == "bitlinear":
            as_transformers_4(d)
        reference(d, prompts)
    for kind in ("I2_S", "TQ2_0", "TQ1_0"):
        write_gguf(os.path.join(out, f"bitnet-packed-{kind.lower()}.gguf"), "bitnet-25", bitnet,
                   weights, ternaries, kind, tok)

    d = os.path.join(out, "bitnet-bf16")
    shutil.rmtree(d, ignore_errors=True)
    w16, t16 = random_model(rng, bitnet)
    save_hf(d, bitnet, w16, t16, "online", tok)
    reference(d, prompts)

    llama = dict(architectures=["LlamaForCausalLM"], hidden_size=512, intermediate_size=1024,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                 vocab_size=V, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000042.0,
                 max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0,
                 eos_token_id=1)
    d = os.path.join(out, "llama-silu")
    shutil.rmtree(d, ignore_errors=True)
    wl, tl = random_model(rng, llama)
    save_hf(d, llama, wl, tl, "bitlinear", tok)
    reference(d, prompts)
    write_gguf(os.path.join(out, "llama-silu-tq2_0.gguf"), "llama", llama, wl, tl, "TQ2_0", tok)
    make_padded(out, tok, prompts)


def make_padded(out, tok, prompts):
    """bitnet-padded: 1bitLLM's layout (SiLU, sub-norms named inner_attn_ln and ffn_layernorm,
    untied head, float latent weights and no quantization_config) at sizes that run padded: head
    dim 96, intermediate 624. The oracle runs transformers' BitNetForCausalLM before the renames.
    Its GGUF: bitnet.cpp's I2_S of the quantized weights (codes, absmean), architecture bitnet."""
    import torch
    from safetensors.torch import load_file, save_file
    rng = np.random.default_rng(2027)
    config = bitnet_config(tok.get_vocab_size(), hidden_size=384, intermediate_size=624,
                           num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
                           rope_theta=10000.0, tie_word_embeddings=False)
    d = os.path.join(out, "bitnet-padded")
    shutil.rmtree(d, ignore_errors=True)
    weights, ternaries = random_model(rng, config)
    save_hf(d, config, weights, ternaries, "online", tok)
    reference(d, prompts)
    path = os.path.join(d, "model.safetensors")
    renames = {"self_attn.attn_sub_norm": "self_attn.inner_attn_ln",
               "mlp.ffn_sub_norm": "mlp.ffn_layernorm"}
    tensors = {}
    for name, value in load_file(path).items():
        for old, new in renames.items():
            name = name.replace(old, new)
        tensors[name] = value.to(torch.float16)  # 1bitLLM's dtype; every value is exact in it
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    c["architectures"] = ["BitnetForCausalLM"]
    c.pop("quantization_config")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    absmean = {name: (codes, float(np.float32(scale * np.abs(codes).mean())))
               for name, (codes, scale) in ternaries.items()}
    write_gguf(os.path.join(out, "bitnet-padded-i2_s.gguf"), "bitnet", config, weights, absmean,
               "I2_S", tok)


def make_full_size(directory):
    """A random checkpoint in the exact layout of microsoft/bitnet-b1.58-2B-4T (not committed)."""
    import torch
    from safetensors.torch import save_file
    c = bitnet_config(128256, hidden_size=2560, intermediate_size=6912, num_hidden_layers=30,
                      num_attention_heads=20, num_key_value_heads=5, max_position_embeddings=4096,
                      bos_token_id=128000, eos_token_id=128001)
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    H, I, kv = 2560, 6912, 640
    shapes = {"self_attn.q_proj": H, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
              "self_attn.o_proj": H, "mlp.gate_proj": I, "mlp.up_proj": I, "mlp.down_proj": H}
    tensors = {"model.embed_tokens.weight": torch.randn(128256, H).bfloat16() * 0.5,
               "model.norm.weight": torch.ones(H).bfloat16()}
    for i in range(30):
        p = f"model.layers.{i}."
        for name, rows in shapes.items():
            cols = I if name == "mlp.down_proj" else H
            # random bytes of codes 0..2 in each 2-bit field
            codes = rng.integers(0, 3, (4, rows // 4, cols), dtype=np.uint8)
            packed = codes[0] | (codes[1] << 2) | (codes[2] << 4) | (codes[3] << 6)
            tensors[p + name + ".weight"] = torch.from_numpy(packed)
            tensors[p + name + ".weight_scale"] = torch.tensor([0.03125]).bfloat16()
        for name, width in (("input_layernorm", H), ("post_attention_layernorm", H),
                            ("self_attn.attn_sub_norm", H), ("mlp.ffn_sub_norm", I)):
            tensors[p + name + ".weight"] = torch.ones(width).bfloat16()
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    c["quantization_config"] = {"quant_method": "bitnet", "linear_class": "autobitlinear",
                                "quantization_mode": "offline"}
    c["rope_theta"] = 500000.0
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    tok = train_tokenizer()
    tok.save(os.path.join(directory, "tokenizer.json"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join("tests", "fixtures", "models"))
    parser.add_argument("--full-size", metavar="DIR", help="write a full-size 2B4T checkpoint")
    parser.add_argument("--padded-only", action="store_true", help="write bitnet-padded only")
    args = parser.parse_args()
    if args.full_size:
        make_full_size(args.full_size)
    elif args.padded_only:
        tok = train_tokenizer()
        make_padded(args.out, tok, prompt_ids(tok))
    else:
        make_small(args.out)


if __name__ == "__main__":
    main()
