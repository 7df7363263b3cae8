"""`ember::all_reduce` and `ember::all_gather`: the model's collectives as custom ops, so that dynamo traces them
into the compiled pieces (no graph break) and FULL and PIECEWISE CUDA graphs capture them like any kernel; and
`ember::vocab_shard_embedding`, a vocab-parallel embedding's local rows, so that a rank's first piece holds ember
ops only (ember.graphs.plain_pieces) as one GPU's does.

Each op names its group by a string (`parallel_state.TP_GROUP`), looked up here, so a compiled graph saved by one
process loads in another. The ops are out of place, as traced code wants: the all-reduce copies its input and
reduces the copy (one small copy kernel; `torch.distributed` reduces in place only), unless the symmetric-memory
one-shot kernel takes the message (`symm_mem`), which reads its input where it is. Which path a message takes
depends on its size and dtype only, so a graph's capture and its replays take the same one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.kernels.library import define, register_fake

__all__ = ["all_gather", "all_reduce", "broadcast_", "group_size", "register_group", "unregister_group",
           "vocab_shard_embedding"]


@dataclass
class _Group:
    """A registered group: the process group, its size, and the one-shot all-reduce where it is set up."""
    process_group: object
    size: int
    one_shot: object | None = None      # ember.distributed.symm_mem.OneShotAllReduce


_groups: dict[str, _Group] = {}


def register_group(name: str, process_group, device: torch.device | None = None,
                   symm_mem_all_reduce: bool | None = False) -> None:
    """Make `process_group` the group the ops call `name`; with `symm_mem_all_reduce` (CUDA `device` only), small
    all-reduces over it take the symmetric-memory one-shot kernel; None: `symm_mem.one_shot_by_default` decides
    (a collective: every rank decides alike)."""
    import torch.distributed as dist
    group = _Group(process_group, dist.get_world_size(process_group))
    if symm_mem_all_reduce is None:
        from ember.distributed.symm_mem import one_shot_by_default
        symm_mem_all_reduce = one_shot_by_default(process_group, device)
    elif symm_mem_all_reduce:
        from ember.distributed.symm_mem import one_shot_possible
        possible, reason = one_shot_possible(process_group, device)
        if not possible:
            raise ValueError(f"symm_mem_all_reduce=True cannot be met: {reason}; leave it unset (NCCL then) or "
                             f"start the engine in a fresh process")
    if symm_mem_all_reduce:
        from ember.distributed.symm_mem import OneShotAllReduce
        group.one_shot = OneShotAllReduce(process_group, device)
    _groups[name] = group


def unregister_group(name: str) -> None:
    _groups.pop(name, None)


def _group(name: str) -> _Group:
    group = _groups.get(name)
    if group is None:
        raise RuntimeError(f"no process group {name!r} in this process: a model built for tensor parallelism runs "
                           f"only in a process that joined its group (ember.distributed.parallel_state)")
    return group


def group_size(name: str) -> int:
    """How many ranks the group `name` holds."""
    return _group(name).size


@define("all_reduce")
def _all_reduce_op(x: torch.Tensor, group: str) -> torch.Tensor:
    """The sum of `x` over the ranks of `group`, a new tensor of x's shape and dtype."""
    import torch.distributed as dist
    g = _group(group)
    if g.one_shot is not None and g.one_shot.applies(x):
        return g.one_shot(x)
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=g.process_group)
    return out


@register_fake("all_reduce")
def _all_reduce_fake(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@define("all_gather")
def _all_gather_op(x: torch.Tensor, group: str) -> torch.Tensor:
    """x [N, C] of every rank of `group` side by side along the last dim, in rank order: [N, size * C]."""
    g = _group(group)
    rows, cols = x.shape
    stacked = x.new_empty(g.size * rows, cols)          # [size * N, C], rank r's rows at r * N
    _gather_into(stacked, x.contiguous(), group=g.process_group)
    if rows == 1:       # a decode of one request: the ranks' rows already lie side by side
        return stacked.view(1, g.size * cols)
    return stacked.view(g.size, rows, cols).transpose(0, 1).reshape(rows, g.size * cols)   # [N, size * C]


def _gather_into(output: torch.Tensor, local: torch.Tensor, group) -> None:
    """Every rank's `local` stacked into `output` (torch 2.13 renamed all_gather_into_tensor, and warns at each call
    of the old name)."""
    import torch.distributed as dist
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


@register_fake("all_gather")
def _all_gather_fake(x, group):
    return x.new_empty(x.shape[0], _group(group).size * x.shape[1])


@define("vocab_shard_embedding")
def _vocab_shard_embedding_op(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """The rows of `weight` [R, H] (the vocabulary ids start .. start + R - 1) for `ids` [T], zeros for ids outside
    that range: [T, H]."""
    local = ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    return torch.nn.functional.embedding(local.masked_fill(outside, 0), weight).masked_fill_(outside[:, None], 0)


@register_fake("vocab_shard_embedding")
def _vocab_shard_embedding_fake(ids, weight, start):
    return weight.new_empty(ids.shape[0], weight.shape[1])


def vocab_shard_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """`ember::vocab_shard_embedding`: this rank's embedding rows of `ids`, zeros where another rank holds the id."""
    return torch.ops.ember.vocab_shard_embedding(ids, weight, start)


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """`ember::all_reduce`: the sum of x over the group's ranks."""
    return torch.ops.ember.all_reduce(x, group)


def all_gather(x: torch.Tensor, group: str) -> torch.Tensor:
    """`ember::all_gather` of a 2-D x along its last dim: [N, C] -> [N, size * C]."""
    return torch.ops.ember.all_gather(x, group)


def broadcast_(x: torch.Tensor, group: str) -> None:
    """Overwrite the contiguous `x` on every rank of `group` with its first rank's, in place (a plain call, not an
    op: eager code and the graphs that capture it call it, never traced code)."""
    import torch.distributed as dist
    g = _group(group)
    dist.broadcast(x, src=dist.get_global_rank(g.process_group, 0), group=g.process_group)
