"""A toy decoder around a toy attention impl, for testing the piecewise compile and CUDA graphs without a model
checkpoint or a KV cache.

API:
    ToyAttention(layer_name, num_heads, num_kv_heads, head_size)     calls torch.ops.ember.attention
    ToyDecoder(num_layers=2, hidden=32, num_heads=4, vocab=64)(input_ids [T], positions [T]) -> hidden [T, H]
    toy_forward_context(model, batch_descriptor=None, runtime_mode=None) -> ForwardContext
"""

from __future__ import annotations

import torch
from torch import nn

from ember.attention_backends.base import AttentionImpl, AttentionLayerOptions
from ember.attention_backends.op import AttentionLayerState, ForwardContext


class ToyAttention(nn.Module):
    """Calls `ember::attention` by layer name, as the models' attention layer does (graphs/ never imports models/)."""

    def __init__(self, layer_name: str, num_heads: int, num_kv_heads: int, head_size: int):
        super().__init__()
        self.layer_name = layer_name
        self.options = AttentionLayerOptions(num_heads, num_kv_heads, head_size, head_size ** -0.5)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]."""
        o = self.options
        num_tokens = q.shape[0]
        q = q.view(num_tokens, o.num_heads, o.head_size)
        out = torch.empty_like(q)   # [T, Hq, D], filled by the op
        torch.ops.ember.attention(q, k.view(num_tokens, o.num_kv_heads, o.head_size),
                                  v.view(num_tokens, o.num_kv_heads, o.head_size), out, self.layer_name)
        return out.view(num_tokens, o.num_heads * o.head_size)


class ToyAttentionImpl(AttentionImpl):
    """Causal softmax attention over this step's tokens only (no cache); pure tensor ops, so it is capturable.

    Padding tokens sit after the live ones, so causality keeps them from changing any live row.
    """

    def forward(self, query, key, value, kv_cache, metadata, out) -> None:
        num_tokens = query.shape[0]
        group = self.options.num_heads // self.options.num_kv_heads
        # expand rather than repeat_interleave, which may sync with the host (not allowed while capturing)
        k = key[:, :, None].expand(-1, -1, group, -1).reshape(query.shape)     # [T, Hq, D]
        v = value[:, :, None].expand(-1, -1, group, -1).reshape(query.shape)
        scores = torch.einsum("thd,shd->hts", query.float(), k.float()) * self.options.scale   # [H, T, T]
        causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=query.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        out.copy_(torch.einsum("hts,shd->thd", probs, v.float()).to(out.dtype))


class ToyLayer(nn.Module):
    """Pre-norm attention block plus a SiLU MLP."""

    def __init__(self, index: int, hidden: int, num_heads: int, num_kv_heads: int):
        super().__init__()
        head_size = hidden // num_heads
        self.q_size, self.kv_size = num_heads * head_size, num_kv_heads * head_size
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, self.q_size + 2 * self.kv_size)
        self.attn = ToyAttention(f"layers.{index}.attn", num_heads, num_kv_heads, head_size)
        self.o_proj = nn.Linear(self.q_size, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(h)).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        h = h + self.o_proj(self.attn(q, k, v))
        return h + self.down(nn.functional.silu(self.up(self.norm2(h))))


class ToyDecoder(nn.Module):
    """Embedding + learned positions, `num_layers` ToyLayers, final norm: model(input_ids, positions) -> hidden."""

    def __init__(self, num_layers: int = 2, hidden: int = 32, num_heads: int = 4, num_kv_heads: int = 2,
                 vocab: int = 64, max_positions: int = 4096):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos_embed = nn.Embedding(max_positions, hidden)
        self.layers = nn.ModuleList(ToyLayer(i, hidden, num_heads, num_kv_heads) for i in range(num_layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + self.pos_embed(positions)   # [T, H]
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


def toy_forward_context(model: ToyDecoder, batch_descriptor=None, runtime_mode=None) -> ForwardContext:
    """A forward context binding every toy attention layer to a `ToyAttentionImpl`."""
    layers = {}
    for module in model.modules():
        if isinstance(module, ToyAttention):
            device = next(model.parameters()).device
            layers[module.layer_name] = AttentionLayerState(ToyAttentionImpl(module.options),
                                                            torch.empty(0, device=device), 0)
    return ForwardContext(layers, (None,), batch_descriptor=batch_descriptor, cudagraph_runtime_mode=runtime_mode)
