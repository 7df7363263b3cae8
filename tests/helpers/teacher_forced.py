"""Teacher-forced comparison of two runs of one model over the same tokens: how often their next-token argmax
agrees, and the mean KL divergence of the second's next-token distribution from the first's."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Agreement:
    positions: int
    top1: float          # fraction of positions whose argmax agrees
    mean_kl: float       # mean over positions of KL(reference || other), in nats

    def __str__(self) -> str:
        return f"top-1 agreement {100 * self.top1:.2f}% over {self.positions} positions, mean KL {self.mean_kl:.5f}"


def scored_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """Logits [n, V] float32 of every position of one teacher-forced pass through the engine's paged cache."""
    return llm.engine.score(list(token_ids)).float().cpu()


def agreement(reference: torch.Tensor, other: torch.Tensor) -> Agreement:
    """Compare logits [n, V] of two runs (the last position predicts past the text and is left out)."""
    reference, other = reference[:-1].double(), other[:-1].double()
    top1 = (reference.argmax(-1) == other.argmax(-1)).double().mean().item()
    log_p, log_q = torch.log_softmax(reference, -1), torch.log_softmax(other, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    return Agreement(reference.shape[0], top1, kl)
