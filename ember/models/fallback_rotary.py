"""The transformers fallback's rotary embeddings as tables: cos and sin of every position, computed once by the
family's own rotary module, then read by position at each step (as ember's native models read theirs).

A transformers rotary module (`inv_freq`, `forward(x, position_ids) -> (cos, sin)` [B, T, D] in x's dtype) computes
its angles from the positions at every step: depending on the transformers version, a batched matmul of the
frequencies by the positions, or their outer product, then cos and sin, all in float32. Under ember's compile that
is one more kernel chain per step in the first piece, over a token count that must stay symbolic (a matmul whose one
side is the token count is where a compiler may fix it). A table read is a gather, the same numbers (the table is
the module's own float32 output, cast to x's dtype as the module casts it), and no arithmetic.

Only rotary embeddings whose table does not depend on the sequence get one: one rope type (not a per-layer-type
dict) that is not "dynamic" or "longrope", whose module holds its angles in `inv_freq`, at most MAX_TABLE_BYTES for
the model's positions. Others run as transformers wrote them.

    tabulate_rotary(model, device) -> how many rotary modules now read tables
"""

from __future__ import annotations

import logging
import types

import torch
from torch import nn

logger = logging.getLogger("ember")

# rope types whose angles change with the sequence length seen (transformers' `dynamic_rope_update`)
SEQUENCE_DEPENDENT = frozenset({"dynamic", "longrope"})
MAX_TABLE_BYTES = 512 << 20        # cos and sin in float32 for every position, per rotary module


def _table_forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
    """The rotary module's forward from its tables: position_ids [B, T] -> (cos, sin) [B, T, D] in x's dtype."""
    if any(a is not None for a in (*args, *kwargs.values())):       # e.g. a layer type: the module's own code
        return type(self).forward(self, x, position_ids, *args, **kwargs)
    return self.ember_cos[position_ids].to(x.dtype), self.ember_sin[position_ids].to(x.dtype)


def _num_positions(module: nn.Module) -> int | None:
    config = getattr(module, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(module, "original_max_seq_len", None) or getattr(text, "max_position_embeddings", None)
    return int(n) if n else None


def _tabulable(module: nn.Module) -> bool:
    rope_type = getattr(module, "rope_type", None)
    return (isinstance(rope_type, str) and rope_type not in SEQUENCE_DEPENDENT
            and isinstance(module._buffers.get("inv_freq"), torch.Tensor) and "ember_cos" not in module._buffers)


@torch.no_grad()
def tabulate_rotary(model: nn.Module, device: torch.device) -> int:
    """Give every rotary module of `model` whose angles do not depend on the sequence its cos/sin tables
    ([positions, D] float32 buffers `ember_cos`/`ember_sin` on `device`) and a forward that reads them."""
    count = 0
    for module in model.modules():
        if not _tabulable(module):
            continue
        num_positions = _num_positions(module)
        head = module._buffers["inv_freq"].numel() * 2
        if not num_positions or 2 * num_positions * head * 4 > MAX_TABLE_BYTES:
            continue
        x = torch.zeros(1, dtype=torch.float32, device=device)
        positions = torch.arange(num_positions, device=device)[None]            # [1, N]
        cos, sin = module(x, positions)                                          # [1, N, D] float32
        if cos.dim() != 3 or tuple(cos.shape[:2]) != (1, num_positions) or cos.shape != sin.shape:
            continue
        module.register_buffer("ember_cos", cos[0].float().contiguous(), persistent=False)     # [N, D]
        module.register_buffer("ember_sin", sin[0].float().contiguous(), persistent=False)     # [N, D]
        module.forward = types.MethodType(_table_forward, module)
        count += 1
    return count
