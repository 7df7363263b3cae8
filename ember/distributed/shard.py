"""Which slice of each layer a tensor-parallel rank holds: the rules, as arithmetic on sizes.

A model is built for one shard (`building(ShardSpec(rank, size))` around its construction, as the loader does); its
parallel layers read `current_shard()` once, in their constructors, and size their parameters for it:

- attention heads split evenly (`split`); KV heads too where there are at least as many as ranks, else each KV
  head is replicated on `size / num_kv_heads` consecutive ranks, whose query heads are exactly its group
  (`kv_heads`);
- the vocabulary splits into equal ranges of ceil(V / size) rows, the last one padded (`vocab_range`);
- column-parallel projections split their output rows, row-parallel ones their input columns;
- a mixture of experts splits each expert's intermediate dimension, or, with `expert_parallel`, places whole
  experts on the ranks (ember.models.layers.moe).

Each parameter records what it reads of a checkpoint tensor as a `CheckpointSlice` (`param.checkpoint_slice`), so
the loader reads only that range of the file.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardSpec:
    """Rank `rank` of `size` tensor-parallel ranks; (0, 1) holds the whole model. `expert_parallel`: MoE layers hold
    E / size whole experts each instead of every expert's share of the intermediate dimension."""
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"shard rank {self.rank} of {self.size} is not a rank of the group")


_building: contextvars.ContextVar[ShardSpec] = contextvars.ContextVar("ember_shard", default=ShardSpec())


@contextlib.contextmanager
def building(spec: ShardSpec) -> Iterator[ShardSpec]:
    """Layers constructed inside build the shard `spec` of themselves."""
    token = _building.set(spec)
    try:
        yield spec
    finally:
        _building.reset(token)


def current_shard() -> ShardSpec:
    """The shard the layers under construction build (the whole model outside `building`)."""
    return _building.get()


def split(total: int, spec: ShardSpec, what: str) -> int:
    """This rank's share of `total` (`what` names it in the error when it does not divide)."""
    if total % spec.size:
        raise ValueError(f"{what} {total} is not divisible by tensor_parallel_size {spec.size}; choose a "
                         f"tensor_parallel_size that divides it")
    return total // spec.size


def kv_heads(num_kv_heads: int, num_heads: int, spec: ShardSpec) -> tuple[int, int]:
    """(KV heads this rank holds, the first of them) of `num_kv_heads`: an even split, or one head replicated on
    every rank of its query group when there are fewer KV heads than ranks."""
    split(num_heads, spec, "num_attention_heads")
    if num_kv_heads >= spec.size:
        local = split(num_kv_heads, spec, "num_key_value_heads")
        return local, spec.rank * local
    if spec.size % num_kv_heads:
        raise ValueError(f"num_key_value_heads {num_kv_heads} is fewer than tensor_parallel_size {spec.size} and "
                         f"does not divide it, so its heads cannot be replicated evenly; choose a tensor_parallel_size "
                         f"that is a multiple or a divisor of {num_kv_heads}")
    return 1, spec.rank // (spec.size // num_kv_heads)


def vocab_range(vocab_size: int, spec: ShardSpec) -> tuple[int, int, int]:
    """(first token id, ids held, rows allocated) of this rank's vocabulary range: rows of ceil(V / size), the
    ids past the vocabulary padded (zero rows, their logits dropped after the gather)."""
    rows = -(-vocab_size // spec.size)
    start = spec.rank * rows
    return start, max(0, min(rows, vocab_size - start)), rows


@dataclass(frozen=True)
class CheckpointSlice:
    """The range [start, start + length) along `dim` of a checkpoint tensor of `full` elements along that dim."""
    dim: int
    start: int
    length: int
    full: int

    def check(self, shape: tuple[int, ...]) -> None:
        """Raise ValueError when the checkpoint tensor's size along `dim` is not the one the shard was cut from."""
        if len(shape) <= self.dim or shape[self.dim] != self.full:
            raise ValueError(f"checkpoint tensor has shape {tuple(shape)}, expected {self.full} along dim "
                             f"{self.dim} (this rank reads [{self.start}, {self.start + self.length}) of it)")


# what a parameter reads of the checkpoint tensor that is its shard `shard_id` (None: the whole tensor)
SliceRule = Callable[[int | None], "CheckpointSlice | None"]
