"""Where each part of the model sits in a checkpoint: tensor names by container. A tuple lists
alternatives (the first present is used); fused parts list their pieces in row order."""

# Hugging Face (transformers) names; layer names are relative to "model.layers.{i}."
HF_EMBEDDING = "model.embed_tokens.weight"
HF_FINAL_NORM = "model.norm.weight"
HF_HEAD = "lm_head.weight"
HF_LAYER_PREFIX = "model.layers.{}."
HF_TERNARY = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "o": ("self_attn.o_proj",),
              "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
              "down": ("mlp.down_proj",)}
HF_NORMS = {"attn_norm": ("input_layernorm.weight",),
            "ffn_norm": ("post_attention_layernorm.weight",),
            # BitNetForCausalLM's names, then 1bitLLM's
            "attn_sub_norm": ("self_attn.attn_sub_norm.weight", "self_attn.inner_attn_ln.weight"),
            "ffn_sub_norm": ("mlp.ffn_sub_norm.weight", "mlp.ffn_layernorm.weight")}
HF_IGNORED = ("rotary_emb.inv_freq",)  # recomputed, never used from the file

# GGUF (llama.cpp / bitnet.cpp) names; layer names are relative to "blk.{i}."
GGUF_EMBEDDING = "token_embd.weight"
GGUF_FINAL_NORM = "output_norm.weight"
GGUF_HEAD = "output.weight"
GGUF_LAYER_PREFIX = "blk.{}."
GGUF_TERNARY = {"qkv": ("attn_q", "attn_k", "attn_v"),
                "o": ("attn_output",),
                "gate_up": ("ffn_gate", "ffn_up"),
                "down": ("ffn_down",)}
GGUF_NORMS = {"attn_norm": ("attn_norm.weight",),
              "ffn_norm": ("ffn_norm.weight",),
              "attn_sub_norm": ("attn_sub_norm.weight",),
              "ffn_sub_norm": ("ffn_sub_norm.weight",)}
GGUF_IGNORED = ("rope_freqs.weight",)

SUB_NORMS = ("attn_sub_norm", "ffn_sub_norm")
