"""The demo's model in plain PyTorch bfloat16, for the side-by-side benchmark: the ternary weights
dequantized to dense bfloat16, torch ops (F.linear, F.rms_norm, SDPA with a KV cache), one decode
step captured as a CUDA graph. Imported only where torch is installed."""
import numpy as np
import torch
import torch.nn.functional as F


def _bf16_tensor(array, device):
    """A bfloat16 DeviceArray or numpy array as a torch tensor (a set-up copy through the host)."""
    host = array if isinstance(array, np.ndarray) else array.numpy()
    return torch.from_numpy(host.view(np.int16).copy()).to(device).view(torch.bfloat16)


def _dense(weights, device):
    codes = torch.as_tensor(weights.unpack(), device=device)
    scales = torch.as_tensor(weights.scales, device=device)
    dense = codes.float() * scales[:, None]
    if weights.block_scales is not None:
        blocks = torch.as_tensor(weights.block_scales, device=device)
        dense *= blocks.repeat_interleave(dense.shape[1] // blocks.shape[1], dim=1)
    return dense.to(torch.bfloat16)


class TorchModel:
    def __init__(self, weights, batch, capacity):
        c = self.config = weights.config
        device = torch.device("cuda", weights.layers[0].qkv.device)
        self.batch, self.capacity = batch, capacity
        self.layers = []
        for layer in weights.layers:
            self.layers.append({
                "qkv": _dense(layer.qkv, device), "o": _dense(layer.o, device),
                "gate_up": _dense(layer.gate_up, device), "down": _dense(layer.down, device),
                **{name: _bf16_tensor(getattr(layer, name), device)
                   for name in ("attn_norm", "attn_sub_norm", "ffn_norm", "ffn_sub_norm")},
                "k_cache": torch.randn(batch, capacity, c.kv_heads, c.head_dim, device=device,
                                       dtype=torch.bfloat16),
                "v_cache": torch.randn(batch, capacity, c.kv_heads, c.head_dim, device=device,
                                       dtype=torch.bfloat16)})
        self.final_norm = _bf16_tensor(weights.final_norm, device)
        self.embedding = _bf16_tensor(weights.embedding, device)
        inv_freq = c.theta ** (-torch.arange(0, c.head_dim, 2, device=device).double() / c.head_dim)
        angles = torch.arange(capacity, device=device).double()[:, None] * inv_freq[None]
        self.cos, self.sin = angles.cos().float(), angles.sin().float()
        self.positions = torch.arange(capacity, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.ids = torch.zeros(batch, dtype=torch.long, device=device)

    def rope(self, x, positions):
        """x [B, T, heads, D] rotated (rotate-half) at positions [T]."""
        half = x.shape[-1] // 2
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [T, 1, D/2]
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def layer(self, L, h, attend):
        """One layer over h [B, T, hidden]; attend(L, q, k, v) gives the attention [B, T, hidden]
        from the rotated q [B, T, heads, D], k and v [B, T, kv_heads, D]."""
        c, eps = self.config, self.config.eps
        B, T, H = h.shape
        x = F.rms_norm(h, (H,), L["attn_norm"], eps)
        q, k, v = F.linear(x, L["qkv"]).split([H, c.kv_dim, c.kv_dim], dim=-1)
        a = attend(L, q.view(B, T, c.heads, c.head_dim), k.view(B, T, c.kv_heads, c.head_dim),
                   v.view(B, T, c.kv_heads, c.head_dim))
        h = h + F.linear(F.rms_norm(a, (H,), L["attn_sub_norm"], eps), L["o"])
        x = F.rms_norm(h, (H,), L["ffn_norm"], eps)
        gate, up = F.linear(x, L["gate_up"]).chunk(2, dim=-1)
        g = F.rms_norm(F.relu(gate).square() * up, (c.intermediate,), L["ffn_sub_norm"], eps)
        return h + F.linear(g, L["down"])

    def next_ids(self, h):
        self.logits = F.linear(F.rms_norm(h[:, -1], (self.config.hidden,), self.final_norm,
                                          self.config.eps), self.embedding).float()
        self.ids.copy_(self.logits.argmax(-1))

    def step(self):
        """One decode step at self.pos: the KV cache appended, attention over positions <= pos."""
        B = self.batch
        mask = (self.positions <= self.pos).view(1, 1, 1, -1)

        def attend(L, q, k, v):
            q, k = self.rope(q, self.pos), self.rope(k, self.pos)
            L["k_cache"].index_copy_(1, self.pos, k)
            L["v_cache"].index_copy_(1, self.pos, v)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), L["k_cache"].transpose(1, 2),
                                               L["v_cache"].transpose(1, 2), attn_mask=mask,
                                               enable_gqa=True)
            return a.transpose(1, 2).reshape(B, 1, -1)

        h = self.embedding[self.ids][:, None]
        for L in self.layers:
            h = self.layer(L, h, attend)
        self.next_ids(h)
        self.pos += 1

    def prefill(self, prompt):
        """The prompt [B, T] from position 0: the KV cache's first T positions written, causal
        attention over the prompt itself."""
        B, T = prompt.shape
        positions = self.positions[:T]

        def attend(L, q, k, v):
            q, k = self.rope(q, positions), self.rope(k, positions)
            L["k_cache"][:, :T] = k
            L["v_cache"][:, :T] = v
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True, enable_gqa=True)
            return a.transpose(1, 2).reshape(B, T, -1)

        h = self.embedding[prompt]
        for L in self.layers:
            h = self.layer(L, h, attend)
        self.next_ids(h)

    def graph_ms(self, work, replays, reset=lambda: None):
        """Median milliseconds of work() captured as a CUDA graph, over 3 runs of `replays`
        replays back to back, reset() before each run."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the capture, as torch.cuda.graph asks
                reset()
                work()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            work()
        times = []
        for _ in range(3):
            reset()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / replays)
        return sorted(times)[1]

    def step_ms(self, start_position, replays):
        """Median milliseconds of one decode step, from `start_position`."""
        return self.graph_ms(self.step, replays, lambda: self.pos.fill_(start_position))

    def prefill_tokens_per_s(self, prompt_len, replays):
        """Tokens per second of a batch of random prompt_len-token prompts, prefilled."""
        prompt = torch.randint(0, self.config.vocab, (self.batch, prompt_len),
                               device=self.ids.device)
        return self.batch * prompt_len / (1e-3 * self.graph_ms(lambda: self.prefill(prompt), replays))
