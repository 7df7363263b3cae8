"""The residual add as the epilogue of the projection before it: `linear(x) + residual` ->
`fused_linear(x, residual=residual)`, so o_proj and down write the new residual stream directly (added in float32,
rounded once)."""

from __future__ import annotations

import torch
from torch.fx import Graph

from ember.graphs.passes.match import (LinearCall, aten, is_call, replace_with, same_shape, skip_noop_views,
                                       sole_user, value)

NAME = "residual_epilogue"


def fuse_residual_epilogue(graph: Graph) -> int:
    """Rewrite every add of a same-shape, same-dtype tensor to a linear used only by that add; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if not is_call(node, aten.add) or len(node.args) != 2 or node.kwargs:
            continue
        for operand, residual in (node.args, node.args[::-1]):
            projection = skip_noop_views(operand)
            call = LinearCall.of(projection)
            if call is None or call.residual is not None or sole_user(projection)[0] is not node:
                continue
            out_val, residual_val, sum_val = value(projection), value(residual), value(node)
            if out_val is None or residual_val is None or sum_val is None or out_val.dim() != 2:
                continue
            if not same_shape(out_val, residual_val) or not same_shape(out_val, sum_val) or \
                    not residual_val.dtype == out_val.dtype == sum_val.dtype:
                continue
            call.residual = residual
            replace_with(graph, node, call.target, call.args(), call.fake)
            graph.erase_node(node)
            count += 1
            break
    return count
