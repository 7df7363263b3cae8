"""SiLU·mul as the epilogue of the packed gate/up projection: `silu(gate) * up` over the two halves of one linear's
output -> `fused_linear(..., gated=True)`, which writes only the [M, N] product, never the [M, 2N] projection."""

from __future__ import annotations

import torch
from torch.fx import Graph

from ember.graphs.passes.match import (LinearCall, aten, getitem_users, is_call, match_silu, other_operand, prims,
                                       replace_with, unit_view_end, value)

NAME = "silu_mul_epilogue"


def _halves(split, columns: int) -> bool:
    """Whether `split` cuts a [M, columns] tensor into two equal halves along its last dim."""
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim not in (-1, 1):
        return False
    if is_call(split, aten.split):
        return split.args[1] * 2 == columns
    if is_call(split, aten.split_with_sizes):
        sizes = list(split.args[1])
        return len(sizes) == 2 and sizes[0] == sizes[1] and sizes[0] * 2 == columns
    return False


def fuse_silu_mul_epilogue(graph: Graph) -> int:
    """Rewrite every `silu(gate) * up` whose halves come from one linear used by nothing else; returns how many."""
    count = 0
    for node in list(graph.nodes):
        call = LinearCall.of(node)
        out_val = value(node)
        if call is None or call.gated or call.residual is not None or out_val is None or out_val.dim() != 2:
            continue
        end = unit_view_end(node)     # transformers code may view the output as [1, T, 2N] before its chunk
        split = next(iter(end.users)) if len(end.users) == 1 else None
        if split is None or not isinstance(out_val.shape[-1], int) or not _halves(split, out_val.shape[-1]):
            continue
        items = getitem_users(split)
        if items is None or set(items) != {0, 1} or len(items[1].users) != 1:
            continue
        # transformers code views each half as [1, T, N] before the activation and the product
        gate, up = unit_view_end(items[0]), unit_view_end(items[1])
        if len(up.users) != 1:
            continue
        product = next(iter(up.users))
        if not is_call(product, aten.mul) or product.kwargs:
            continue
        act = other_operand(product, up)
        silu = act
        if is_call(act, prims.convert_element_type):
            if act.args[1] != out_val.dtype:
                continue
            silu = act.args[0]
        elif out_val.dtype != torch.float32:
            continue     # half precision: the model rounds silu's float32 result before the product
        if not match_silu(silu, gate):
            continue
        call.gated = True
        replace_with(graph, product, call.target, call.args(), call.fake)
        graph.erase_node(product)
        count += 1
    return count
