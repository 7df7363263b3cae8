"""RMSNorm, in the Llama form (w * norm(x)) and the Gemma form ((1 + w) * norm(x)), with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from ember.models.layers.linear import make_param


class RMSNorm(nn.Module):
    """Llama-style RMSNorm: normalise in float32, cast back, then scale by the weight (as transformers does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = make_param((hidden_size,))

    def reset_parameters(self) -> None:
        """The identity scale, for randomly initialised models."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self._normalise(x).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the residual (in the model dtype, as the reference does) and normalise: -> (normed, new residual).
        With no residual yet (a model's first layer), x itself becomes the residual."""
        if residual is not None:
            x = x + residual
        return self.forward(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the stored weight is an offset from 1 and the scaling happens in float32 before the cast."""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self._normalise(x) * (1.0 + self.weight.float())).to(x.dtype)
