"""Token embedding and LM head; a tied head reads the embedding's weight instead of holding its own."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels.linear_op import logits
from ember.models.layers.linear import make_param
from ember.models.layers.onednn import onednn_linear


class VocabEmbedding(nn.Module):
    """ids [T] int64 -> [T, hidden]; optionally multiplied by a constant (Gemma's sqrt(hidden))."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None):
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.weight = make_param((vocab_size, hidden_size))
        # Round the scale to the weight dtype once, so the product equals the reference's (it multiplies by a
        # tensor of the model dtype, e.g. sqrt(2048) becomes 45.25 in bfloat16).
        self.scale = None if scale is None else torch.tensor(scale, dtype=self.weight.dtype, device="cpu").item()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.weight)
        if self.scale is not None:
            hidden = hidden * self.scale
        return hidden

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}, scale={self.scale}"


class LMHead(nn.Module):
    """hidden [N, H] -> logits [N, V] in float32. With `tied_to`, reuses that embedding's weight (no own parameter)."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None):
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        # A list keeps the embedding out of this module's children, so its weight is loaded and listed once.
        self._tied = [tied_to] if tied_to is not None else []
        self.weight = make_param((vocab_size, hidden_size)) if tied_to is None else None
        self.packed_weight: torch.Tensor | None = None    # oneDNN's copy on the CPU (ember.models.layers.onednn)

    @property
    def tied(self) -> bool:
        return bool(self._tied)

    def weight_to_pack(self) -> torch.Tensor:
        """The [vocab, hidden] weight that `packed_weight` holds in oneDNN's layout (the embedding's when tied)."""
        return self._tied[0].weight if self._tied else self.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return onednn_linear(hidden, self.packed_weight).float()
        weight = self.weight_to_pack()
        # matmul in the model dtype like the reference, then float32 for sampling; on a GPU one op for both
        # (ember::logits: decode rows on the GEMV, which writes float32 itself)
        if hidden.is_cuda:
            return logits(hidden, weight)
        return F.linear(hidden, weight).float()

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}, tied={self.tied}"
