"""Token embedding and LM head; a tied head reads the embedding's weight instead of holding its own.

Under tensor parallelism both are vocabulary-parallel: rank r holds the rows of token ids [r * R, (r + 1) * R),
R = ceil(V / ranks) (`ember.distributed.shard.vocab_range`; the last range padded with zero rows). The embedding
looks up the ids in its range, zeroes the others' rows and all-reduces; the LM head computes its range's logits and
all-gathers them, so that every rank holds the whole [N, V] logits and samples the same tokens from them (or, for
shard-local sampling, hands out its range's logits alone: `shard_logits`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed.ops import all_gather, all_reduce, vocab_shard_embedding
from ember.distributed.parallel_state import TP_GROUP
from ember.distributed.shard import CheckpointSlice, current_shard, vocab_range
from ember.kernels.linear_op import logits
from ember.models.layers.linear import check_shape, make_param
from ember.models.layers.onednn import onednn_linear, takes_packed


def _vocab_param(vocab_size: int, hidden_size: int) -> tuple[nn.Parameter, int, int, int]:
    """The [rows, hidden] weight of this rank's vocabulary range, with its checkpoint slice and loader when the
    vocabulary is split; and (first id, ids held, tensor-parallel size)."""
    spec = current_shard()
    start, held, rows = vocab_range(vocab_size, spec)
    param = make_param((rows, hidden_size))
    if spec.size > 1:
        param.checkpoint_slice = lambda shard_id: CheckpointSlice(0, start, held, vocab_size)
        param.weight_loader = _vocab_loader(held)
    return param, start, held, spec.size


def _vocab_loader(held: int):
    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Copy this rank's `held` rows in and zero the padding rows after them."""
        if shard_id is not None:
            raise ValueError(f"a vocabulary-parallel weight is not packed; got shard {shard_id}")
        check_shape(param, loaded, (held, *param.shape[1:]))
        param.data[:held].copy_(loaded)
        param.data[held:].zero_()
    return load


class VocabEmbedding(nn.Module):
    """ids [T] int64 -> [T, hidden]; optionally multiplied by a constant (Gemma's sqrt(hidden))."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None):
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.weight, self.vocab_start, self.vocab_held, self.tp_size = _vocab_param(vocab_size, hidden_size)
        # Round the scale to the weight dtype once, so the product equals the reference's (it multiplies by a
        # tensor of the model dtype, e.g. sqrt(2048) becomes 45.25 in bfloat16).
        self.scale = None if scale is None else torch.tensor(scale, dtype=self.weight.dtype, device="cpu").item()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            hidden = F.embedding(input_ids, self.weight)
        else:
            # this rank's rows of the ids it holds, zeros for the others' (`self.vocab_held` rows), summed
            hidden = all_reduce(vocab_shard_embedding(input_ids, self.weight[:self.vocab_held], self.vocab_start),
                                TP_GROUP)
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
        if tied_to is None:
            self.weight, self._start, self._held, self.tp_size = _vocab_param(vocab_size, hidden_size)
        else:
            self.weight, self.tp_size = None, tied_to.tp_size
        self.packed_weight: torch.Tensor | None = None    # oneDNN's copy on the CPU (ember.models.layers.onednn)

    @property
    def tied(self) -> bool:
        return bool(self._tied)

    def weight_to_pack(self) -> torch.Tensor:
        """The [vocab, hidden] weight that `packed_weight` holds in oneDNN's layout (the embedding's when tied)."""
        return self._tied[0].weight if self._tied else self.weight

    @property
    def vocab_shard(self) -> tuple[int, int]:
        """(first token id, ids held) of this rank's vocabulary range; `shard_logits`' columns past the ids held
        are padding."""
        if self._tied:
            return self._tied[0].vocab_start, self._tied[0].vocab_held
        return self._start, self._held

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32 (this rank's vocabulary range gathered with the others')."""
        out = self._local_logits(hidden)
        if self.tp_size == 1:
            return out
        out = all_gather(out, TP_GROUP)                   # [N, ranks * R]
        return out if out.shape[1] == self.vocab_size else out[:, :self.vocab_size].contiguous()

    def shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> this rank's [N, R] float32 logits of its vocabulary range (`vocab_shard`), not gathered:
        for shard-local sampling (ember.runner.sampler.shard_local)."""
        return self._local_logits(hidden)

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if takes_packed(hidden, self.packed_weight):
            return onednn_linear(hidden, self.packed_weight).float()
        weight = self.weight_to_pack()
        # matmul in the model dtype like the reference, then float32 for sampling; on a GPU one op for both
        # (ember::logits: decode rows on the GEMV, which writes float32 itself)
        if hidden.is_cuda:
            return logits(hidden, weight)
        return F.linear(hidden, weight).float()

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}, tied={self.tied}"
