"""The model description the forward pass reads: one Config for every supported ternary model,
built from a Hugging Face config.json (transformers 4.x or 5.x) or from GGUF metadata.

| model | architecture | gate | sub-norms | head |
| --- | --- | --- | --- | --- |
| BitNet b1.58 2B4T | BitNetForCausalLM, GGUF ``bitnet-25`` or ``bitnet-b1.58`` | relu2 | attn_sub_norm, ffn_sub_norm | tied |
| Falcon3-*-1.58bit, Llama3-8B-1.58 | LlamaForCausalLM, GGUF ``llama`` | silu | none | untied |
| 1bitLLM bitnet_b1_58 | BitnetForCausalLM, GGUF ``bitnet`` | silu | inner_attn_ln, ffn_layernorm | untied |

Head dimensions other than 64, 128, 256 and intermediate sizes that are not multiples of 128 run
in a padded layout (padding.py), whose Config is padded_config(config).
"""
from dataclasses import dataclass, field

import numpy as np

from .errors import UnsupportedError

ACTIVATIONS = ("relu2", "silu")
# architecture -> (gate activation, sub-norms present)
HF_ARCHITECTURES = {"BitNetForCausalLM": ("relu2", True), "LlamaForCausalLM": ("silu", False),
                    "BitnetForCausalLM": ("silu", True)}
GGUF_ARCHITECTURES = {"bitnet-25": ("relu2", True), "bitnet-b1.58": ("relu2", True),
                      "llama": ("silu", False), "bitnet": ("silu", True)}


@dataclass(frozen=True)
class Config:
    hidden: int = 2560
    intermediate: int = 6912
    layers: int = 30
    heads: int = 20
    kv_heads: int = 5
    head_dim: int = 128
    vocab: int = 128256
    eps: float = 1e-5
    theta: float = 500000.0
    activation: str = "relu2"     # the gate: relu2(gate) * up or silu(gate) * up
    sub_norms: bool = True        # RMSNorm before o_proj (width hidden) and down_proj (intermediate)
    tied_head: bool = True        # the output head is the embedding table
    max_positions: int = 4096
    bos_id: int = None
    eos_ids: tuple = field(default=())
    # (head_dim, intermediate) of the checkpoint when this config is its padded layout
    # (padding.py): attention's scale and the sub-norms' eps then follow the checkpoint's sizes
    padded_from: tuple = None

    @property
    def kv_dim(self):
        return self.kv_heads * self.head_dim

    @property
    def q_dim(self):
        """Width of the queries and of attention's output: the o projection's input."""
        return self.heads * self.head_dim

    @property
    def attention_scale(self):
        """Softmax scale 1/sqrt(head dim), in float32 as attention computes its default."""
        D = self.padded_from[0] if self.padded_from else self.head_dim
        return float(np.float32(1) / np.sqrt(np.float32(D)))

    @property
    def attn_sub_eps(self):
        """eps of the sub-norm before o: scaled by real / padded width, so that the padded
        mean square plus eps is the real one times that ratio (padding.py)."""
        return self.eps * (self.padded_from[0] / self.head_dim if self.padded_from else 1)

    @property
    def ffn_sub_eps(self):
        """eps of the sub-norm before down, as attn_sub_eps for the intermediate width."""
        return self.eps * (self.padded_from[1] / self.intermediate if self.padded_from else 1)

    def ternary_bytes(self):
        """Packed weights and scales of every ternary layer: what one decode step must read."""
        H, I = self.hidden, self.intermediate
        shapes = [(self.q_dim + 2 * self.kv_dim + 2 * I, H), (H, self.q_dim), (H, I)]
        return self.layers * sum(rows * (k // 4 + 4) for rows, k in shapes)

    @classmethod
    def from_hf(cls, hf, source="config.json"):
        """From a transformers config dict (rope_theta at the top level as 4.x writes it, or in
        rope_parameters as 5.x does)."""
        architectures = hf.get("architectures") or []
        known = [a for a in architectures if a in HF_ARCHITECTURES]
        if not known:
            raise UnsupportedError(f"{source}: architectures {architectures} are not supported "
                                   f"(supported: {', '.join(HF_ARCHITECTURES)})")
        activation, sub_norms = HF_ARCHITECTURES[known[0]]
        activation = hf.get("hidden_act", activation)
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise UnsupportedError(f"{source}: {flag} = true is not supported (no biases)")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedError(f"{source}: RoPE type {rope_type!r} is not supported "
                                   "(plain rotate-half RoPE only)")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        heads = _int(hf, "num_attention_heads", source)
        hidden = _int(hf, "hidden_size", source)
        eos = hf.get("eos_token_id")
        return cls._checked(
            source, hidden=hidden, intermediate=_int(hf, "intermediate_size", source),
            layers=_int(hf, "num_hidden_layers", source), heads=heads,
            kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            vocab=_int(hf, "vocab_size", source), eps=float(hf.get("rms_norm_eps", 1e-6)),
            theta=float(theta), activation=activation, sub_norms=sub_norms,
            tied_head=bool(hf.get("tie_word_embeddings", False)),
            max_positions=int(hf.get("max_position_embeddings", 4096)),
            bos_id=hf.get("bos_token_id"),
            eos_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]))

    @classmethod
    def from_gguf(cls, meta, vocab, tied_head, source="GGUF"):
        """From GGUF metadata (a dict of key -> value); the vocabulary size and whether the file
        has a separate output.weight come from its tensors."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedError(f"{source}: architecture {arch!r} is not supported (supported: "
                                   f"{', '.join(GGUF_ARCHITECTURES)})")
        activation, sub_norms = GGUF_ARCHITECTURES[arch]

        def key(name, default=None):
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise UnsupportedError(f"{source}: metadata key {arch}.{name} is missing")
            return value

        hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eot = meta.get("tokenizer.ggml.eot_token_id")
        return cls._checked(
            source, hidden=hidden, intermediate=int(key("feed_forward_length")),
            layers=int(key("block_count")), heads=heads,
            kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=int(key("attention.key_length", hidden // heads)), vocab=int(vocab),
            eps=float(key("attention.layer_norm_rms_epsilon")),
            theta=float(key("rope.freq_base", 10000.0)), activation=activation,
            sub_norms=sub_norms, tied_head=tied_head,
            max_positions=int(key("context_length", 4096)),
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_ids=tuple(int(t) for t in (eos, eot) if t is not None))

    @classmethod
    def _checked(cls, source, **values):
        config = cls(**values)
        if config.activation not in ACTIVATIONS:
            raise UnsupportedError(f"{source}: activation {config.activation!r} is not supported "
                                   f"(supported: {', '.join(ACTIVATIONS)})")
        if config.heads % config.kv_heads or config.heads * config.head_dim != config.hidden:
            raise UnsupportedError(f"{source}: {config.heads} heads of dimension "
                                   f"{config.head_dim} with {config.kv_heads} KV heads do not "
                                   f"make hidden size {config.hidden}")
        if config.hidden % 128:
            raise UnsupportedError(f"{source}: hidden size {config.hidden} is not a multiple of "
                                   "128, which the ternary GEMV needs")
        if config.intermediate % 16:
            raise UnsupportedError(f"{source}: intermediate size {config.intermediate} is not a "
                                   "multiple of 16 (it is padded to a multiple of 128 at load, "
                                   "by whole groups of 16 packed weights)")
        if config.head_dim % 2 or config.head_dim > 256:
            raise UnsupportedError(f"{source}: head dimension {config.head_dim} is not supported "
                                   "(even, at most 256)")
        return config


def _int(hf, name, source):
    if name not in hf:
        raise UnsupportedError(f"{source}: {name} is missing")
    return int(hf[name])
