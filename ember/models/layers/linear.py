"""Linear layers whose parameters know how to load themselves, including packed q/k/v and gate/up projections.

Each parameter carries `weight_loader(param, loaded, shard_id)`: `shard_id` is None for a plain tensor, or the
index of the checkpoint tensor inside a packed parameter (q=0, k=1, v=2; gate=0, up=1).
"""

from __future__ import annotations

import torch
from torch import nn

from ember.kernels.linear_op import linear as gemv_linear
from ember.models.layers.onednn import onednn_linear


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
        if self.packed_weight is not None:
            return onednn_linear(x, self.packed_weight, self.bias)
        # `ember::linear` on every device (F.linear off CUDA), so the compile passes see one op to fuse around:
        # a bandwidth-bound Triton GEMV for decode-sized batches on CUDA, cuBLAS for the rest
        return gemv_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedLinear(Linear):
    """Several projections of the same input stacked along the output dim (one matmul instead of several).

    `output_sizes[i]` is the row count of checkpoint shard i; shards are laid out in order.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(self.output_sizes), bias)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            # an already packed checkpoint tensor
            default_weight_loader(param, loaded)
            return
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard {shard_id} is out of range for {len(self.output_sizes)} packed projections")
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        target = param.data.narrow(0, offset, size)
        check_shape(param, loaded, target.shape)
        target.copy_(loaded)


class QKVLinear(PackedLinear):
    """q, k and v projections as one matmul; output is [T, (Hq + 2 * Hkv) * D]."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        self.q_size = num_heads * head_size
        self.kv_size = num_kv_heads * head_size
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias)

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
