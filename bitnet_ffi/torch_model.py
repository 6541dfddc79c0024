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
    return (codes.float() * scales[:, None]).to(torch.bfloat16)


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

    def rope(self, x):
        half = x.shape[-1] // 2
        cos, sin = self.cos[self.pos], self.sin[self.pos]  # [1, D/2]
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def step(self):
        c, B = self.config, self.batch
        H, eps = c.hidden, c.eps
        h = self.embedding[self.ids]
        mask = (self.positions <= self.pos).view(1, 1, 1, -1)
        for L in self.layers:
            x = F.rms_norm(h, (H,), L["attn_norm"], eps)
            q, k, v = F.linear(x, L["qkv"]).split([H, c.kv_dim, c.kv_dim], dim=-1)
            q = self.rope(q.view(B, 1, c.heads, c.head_dim))
            k = self.rope(k.view(B, 1, c.kv_heads, c.head_dim))
            L["k_cache"].index_copy_(1, self.pos, k)
            L["v_cache"].index_copy_(1, self.pos, v.view(B, 1, c.kv_heads, c.head_dim))
            a = F.scaled_dot_product_attention(q.transpose(1, 2), L["k_cache"].transpose(1, 2),
                                               L["v_cache"].transpose(1, 2), attn_mask=mask,
                                               enable_gqa=True)
            a = F.rms_norm(a.transpose(1, 2).reshape(B, H), (H,), L["attn_sub_norm"], eps)
            h = h + F.linear(a, L["o"])
            x = F.rms_norm(h, (H,), L["ffn_norm"], eps)
            gate, up = F.linear(x, L["gate_up"]).chunk(2, dim=-1)
            g = F.rms_norm(F.relu(gate).square() * up, (c.intermediate,), L["ffn_sub_norm"], eps)
            h = h + F.linear(g, L["down"])
        logits = F.linear(F.rms_norm(h, (H,), self.final_norm, eps), self.embedding).float()
        self.ids.copy_(logits.argmax(-1))
        self.pos += 1

    def step_ms(self, start_position, replays):
        """Median milliseconds of one decode step, as graph replays back to back from
        `start_position`."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the capture, as torch.cuda.graph asks
                self.step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        times = []
        for _ in range(3):
            self.pos.fill_(start_position)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / replays)
        return sorted(times)[1]
