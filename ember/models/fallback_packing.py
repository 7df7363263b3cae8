"""Sibling projections of a transformers model packed into one weight: the transformers fallback's q/k/v and gate/up.

transformers code calls `q_proj(x)`, `k_proj(x)` and `v_proj(x)` one by one. The build-time forward on the meta
device records which linear layers of one module read the same input tensor in a row; once the weights are loaded,
each such group's weights (and biases) are copied into one [sum of N, K] parameter of the parent module, and each
projection becomes a `SliceLinear` that multiplies by its rows of it. Eager, that is the same three products; under
torch.compile the `sibling_linears` pass (ember.graphs.passes) merges the products of one input over adjacent rows of
one weight into one `ember::linear` and a split, as a native model's packed q/k/v, so the fusion passes that follow
see the same graph shape (a gate/up split feeds the SiLU·mul epilogue).
"""

from __future__ import annotations

import torch
from torch import nn

from ember.kernels.linear_op import linear as gemv_linear
from ember.models.layers.linear import Linear
from ember.models.layers.onednn import onednn_linear, takes_packed


class PackedWeights(nn.Module):
    """The packed weight [sum of N, K] (and bias [sum of N]) of a group of sibling projections."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None


class SliceLinear(nn.Module):
    """One projection of a packed group: y = x W[start:end]^T (+ b[start:end]), W the parent's `PackedWeights`."""

    def __init__(self, owner: PackedWeights, start: int, end: int):
        super().__init__()
        self._owner = [owner]       # in a list: the owner is the parent's child, not this module's
        self.start, self.end = start, end
        self.in_features, self.out_features = owner.weight.shape[1], end - start
        self.packed_weight: torch.Tensor | None = None    # oneDNN's copy on the CPU (ember.models.layers.onednn)

    def weight_to_pack(self) -> torch.Tensor:
        return self._owner[0].weight[self.start:self.end]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        owner = self._owner[0]
        bias = None if owner.bias is None else owner.bias[self.start:self.end]
        if takes_packed(x, self.packed_weight):
            return onednn_linear(x, self.packed_weight, bias)
        return gemv_linear(x, owner.weight[self.start:self.end], bias)

    def extra_repr(self) -> str:
        return f"rows {self.start}:{self.end} of the packed weight, in_features={self.in_features}"


def sibling_groups(calls: list[tuple[nn.Module, object]], parents: dict[int, tuple[nn.Module, str]]
                   ) -> list[tuple[nn.Module, list[str]]]:
    """(parent module, child names) of each run of two or more linear calls, in call order, of one parent's plain
    `Linear` children on the same input tensor, with the same input width and bias or none; `calls` holds
    (linear module, its input) in call order and `parents` maps id(linear) -> (parent, its name there). A layer
    that was called more than once joins one group at most."""
    groups: list[tuple[nn.Module, list[str]]] = []
    run: list[tuple[nn.Module, object]] = []
    grouped: set[int] = set()

    def flush() -> None:
        if len(run) >= 2 and not grouped & {id(m) for m, _ in run}:
            grouped.update(id(m) for m, _ in run)
            groups.append((parents[id(run[0][0])][0], [parents[id(m)][1] for m, _ in run]))
        run.clear()

    for module, x in calls:
        if type(module) is not Linear or id(module) not in parents:
            flush()
            continue
        first = run[0][0] if run else None
        if first is not None and not (x is run[-1][1] and parents[id(module)][0] is parents[id(first)][0]
                                      and module.in_features == first.in_features
                                      and (module.bias is None) == (first.bias is None)
                                      and all(module is not m for m, _ in run)):
            flush()
        run.append((module, x))
    flush()
    return groups


def pack_siblings(groups: list[tuple[nn.Module, list[str]]]) -> int:
    """Pack each group's loaded weights into one `PackedWeights` of its parent (named by its children joined with
    "__") and make each child a `SliceLinear` of it; groups whose children are no longer plain `Linear` layers
    (quantized ones) stay as they are. Returns how many groups were packed."""
    packed = 0
    for parent, names in groups:
        children = [getattr(parent, n) for n in names]
        if not all(type(c) is Linear for c in children):
            continue
        weights = [c.weight for c in children]
        weight = torch.cat([w.detach() for w in weights])                          # [sum N, K]
        bias = None if children[0].bias is None else torch.cat([c.bias.detach() for c in children])
        owner = PackedWeights(weight, bias)
        parent.add_module("__".join(names), owner)
        start = 0
        for name, child in zip(names, children):
            setattr(parent, name, SliceLinear(owner, start, start + child.out_features))
            start += child.out_features
        packed += 1
    return packed
