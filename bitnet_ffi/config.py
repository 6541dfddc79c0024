"""The model description the forward pass reads: one Config for every supported ternary model,
built from a Hugging Face config.json (transformers 4.x or 5.x) or from GGUF metadata.

| model | architecture | gate | sub-norms | head |
| --- | --- | --- | --- | --- |
| BitNet b1.58 2B4T | BitNetForCausalLM, GGUF ``bitnet-25`` or ``bitnet-b1.58`` | relu2 | attn_sub_norm, ffn_sub_norm | tied |
| Falcon3-*-1.58bit, Llama3-8B-1.58 | LlamaForCausalLM, GGUF ``llama`` | silu | none | untied |
| 1bitLLM bitnet_b1_58 | BitnetForCausalLM, GGUF ``bitnet`` | silu | inner_attn_ln, ffn_layernorm | untied |
"""
from dataclasses import dataclass, field

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

    @property
    def kv_dim(self):
        return self.kv_heads * self.head_dim

    def ternary_bytes(self):
        """Packed weights and scales of every ternary layer: what one decode step must read."""
        H, I = self.hidden, self.intermediate
        rows_by_k = {H: H + 2 * self.kv_dim + H + 2 * I, I: H}
        return self.layers * sum(rows * (k // 4 + 4) for k, rows in rows_by_k.items())

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
        for name in ("hidden", "intermediate"):
            if getattr(config, name) % 128:
                raise UnsupportedError(f"{source}: {name} size {getattr(config, name)} is not a "
                                       "multiple of 128, which the ternary GEMV needs")
        return config


def _int(hf, name, source):
    if name not in hf:
        raise UnsupportedError(f"{source}: {name} is missing")
    return int(hf[name])
