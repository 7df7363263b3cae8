"""Linear layers whose parameters know how to load themselves, including packed q/k/v and gate/up projections.

Each parameter carries `weight_loader(param, loaded, shard_id)`: `shard_id` is None for a plain tensor, or the
index of the checkpoint tensor inside a packed parameter (q=0, k=1, v=2; gate=0, up=1).

Under tensor parallelism (a model built inside `ember.distributed.shard.building`) the packed projections are
column-parallel: each rank holds its rows of every packed projection (its query heads, its KV heads, its share of
the MLP), fed by the whole input. `RowParallelLinear` (o_proj, down) holds its columns of the input and all-reduces
its partial product. A sharded parameter also carries `checkpoint_slice(shard_id)`, the range of the checkpoint
tensor it reads, so the loader reads only that. Built whole (one rank), each layer is the plain one.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.distributed.ops import all_reduce
from ember.distributed.parallel_state import TP_GROUP
from ember.distributed.shard import CheckpointSlice, current_shard, kv_heads, split
from ember.kernels.linear_op import linear as gemv_linear
from ember.models.layers.onednn import onednn_linear, takes_packed


def check_shape(param: torch.Tensor, loaded: torch.Tensor, expected: tuple[int, ...] | torch.Size) -> None:
    """Raise a ValueError naming both shapes when a checkpoint tensor does not fit its destination."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    """Copy a whole checkpoint tensor into `param` (the loader assigns instead when `param` is still on meta)."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not packed; got shard {shard_id}")
    check_shape(param, loaded, param.shape)
    param.data.copy_(loaded)


def make_param(shape: tuple[int, ...], weight_loader=default_weight_loader) -> nn.Parameter:
    """An uninitialised, frozen parameter (usually on meta) carrying its weight loader."""
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = weight_loader
    return param


class Linear(nn.Module):
    """y = x W^T (+ b), with W [out_features, in_features] loaded as is."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = make_param((out_features, in_features))
        self.bias = make_param((out_features,)) if bias else None
        self.packed_weight: torch.Tensor | None = None    # oneDNN's copy on the CPU (ember.models.layers.onednn)

    def weight_to_pack(self) -> torch.Tensor:
        """The [out_features, in_features] weight that `packed_weight` holds in oneDNN's layout."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._project(x, self.bias)

    def _project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if takes_packed(x, self.packed_weight):
            return onednn_linear(x, self.packed_weight, bias)
        # `ember::linear` on every device (F.linear off CUDA), so the compile passes see one op to fuse around:
        # a bandwidth-bound Triton GEMV for decode-sized batches on CUDA, cuBLAS for the rest
        return gemv_linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class RowParallelLinear(Linear):
    """y = x W^T (+ b) with W's input columns split over the tensor-parallel ranks: each rank multiplies its columns
    of x (the output of a column-parallel layer) by its columns of W, and the partial products, rank 0's with the
    bias, are all-reduced. `in_features` is the whole layer's; built whole, it is a plain `Linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        spec = current_shard()
        local = split(in_features, spec, f"the input size of a row-parallel projection ({out_features} outputs)")
        super().__init__(local, out_features, bias)
        self.tp_size, self.tp_rank = spec.size, spec.rank
        self.input_range = (spec.rank * local, local, in_features)     # (first column, columns, of the whole's)
        if spec.size > 1:
            self.weight.checkpoint_slice = lambda shard_id: CheckpointSlice(1, spec.rank * local, local, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._project(x, self.bias)
        # the bias joins rank 0's part of the sum, so that it is added once and the reduce's output is the layer's
        return all_reduce(self._project(x, self.bias if self.tp_rank == 0 else None), TP_GROUP)


class PackedLinear(Linear):
    """Several projections of the same input stacked along the output dim (one matmul instead of several).

    `output_sizes[i]` is the row count of checkpoint shard i in the whole model; this rank holds rows
    [start, start + length) of each, `shard_ranges[i]` (default: an even split over the ranks), laid out in order.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 shard_ranges: list[tuple[int, int]] | None = None):
        spec = current_shard()
        self.full_sizes = list(output_sizes)
        if shard_ranges is None:
            shard_ranges = [(spec.rank * n, n) for n in (split(size, spec, "a packed projection's output size")
                                                         for size in self.full_sizes)]
        self.shard_ranges = list(shard_ranges)
        self.output_sizes = [length for _, length in self.shard_ranges]
        super().__init__(in_features, sum(self.output_sizes), bias)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader
                if spec.size > 1:
                    param.checkpoint_slice = self._checkpoint_slice

    def _checkpoint_slice(self, shard_id: int | None) -> CheckpointSlice | None:
        """Rows of checkpoint shard `shard_id` this rank reads; None (the whole tensor) for an already packed one."""
        if shard_id is None or not 0 <= shard_id < len(self.full_sizes):
            return None
        start, length = self.shard_ranges[shard_id]
        return CheckpointSlice(0, start, length, self.full_sizes[shard_id])

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            if self.output_sizes == self.full_sizes:     # an already packed checkpoint tensor, whole
                default_weight_loader(param, loaded)
                return
            # an already packed checkpoint tensor, read whole: this rank's rows of each projection in it
            check_shape(param, loaded, (sum(self.full_sizes), *param.shape[1:]))
            offsets = [sum(self.full_sizes[:i]) for i in range(len(self.full_sizes))]
            loaded = torch.cat([loaded.narrow(0, offset + start, length)
                                for offset, (start, length) in zip(offsets, self.shard_ranges)])
            default_weight_loader(param, loaded)
            return
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard {shard_id} is out of range for {len(self.output_sizes)} packed projections")
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        start, full = self.shard_ranges[shard_id][0], self.full_sizes[shard_id]
        if loaded.shape[0] == full != size:          # handed the whole checkpoint tensor: take this rank's rows
            loaded = loaded.narrow(0, start, size)
        target = param.data.narrow(0, offset, size)
        check_shape(param, loaded, target.shape)
        target.copy_(loaded)


class QKVLinear(PackedLinear):
    """q, k and v projections as one matmul; output is [T, (Hq + 2 * Hkv) * D] of this rank's heads.
    `num_heads` and `num_kv_heads` are the whole model's; `self.num_heads` and `self.num_kv_heads` this rank's."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        spec = current_shard()
        self.num_kv_heads, self.first_kv_head = kv_heads(num_kv_heads, num_heads, spec)
        self.num_kv_heads_in_model = num_kv_heads
        self.num_heads = split(num_heads, spec, "num_attention_heads")
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        kv_range = (self.first_kv_head * head_size, self.kv_size)
        super().__init__(hidden_size, [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size],
                         bias, [(spec.rank * self.q_size, self.q_size), kv_range, kv_range])

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*D]."""
        return self.forward(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def forward_q(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> q [T, q_size] only (a layer that reads another layer's K/V computes none)."""
        bias = None if self.bias is None else self.bias[:self.q_size]
        return gemv_linear(x, self.weight[:self.q_size], bias)


class GateUpLinear(PackedLinear):
    """gate and up projections as one matmul; output is [T, 2 * intermediate]."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__(hidden_size, [intermediate_size, intermediate_size], bias)
