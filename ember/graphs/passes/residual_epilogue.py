"""The residual add as the epilogue of the projection before it: `linear(x) + residual` ->
`fused_linear(x, residual=residual)`, so o_proj and down write the new residual stream directly (added in float32,
rounded once); likewise `ember::moe(...) + residual` -> `ember::moe(..., residual)` for a mixture-of-experts MLP."""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from ember.graphs.passes.match import (LinearCall, aten, is_call, replace_with, same_rows, same_shape, sole_user,
                                       unit_view_end, unit_view_source, value, with_rank)

NAME = "residual_epilogue"


def fuse_residual_epilogue(graph: Graph) -> int:
    """Rewrite every add of a same-shape, same-dtype tensor to a linear used only by that add; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if not is_call(node, aten.add) or len(node.args) != 2 or node.kwargs:
            continue
        for operand, residual in (node.args, node.args[::-1]):
            projection = unit_view_source(operand)
            if _fuse_moe_residual(graph, node, projection, residual):
                count += 1
                break
            call = LinearCall.of(projection)
            if call is None or call.residual is not None or node not in unit_view_end(projection).users or \
                    len(unit_view_end(projection).users) != 1:
                continue
            out_val, residual_val, sum_val = value(projection), value(residual), value(node)
            if out_val is None or residual_val is None or sum_val is None or out_val.dim() != 2:
                continue
            if not same_rows(out_val, residual_val) or not same_rows(out_val, sum_val) or \
                    not residual_val.dtype == out_val.dtype == sum_val.dtype:
                continue
            call.residual = with_rank(graph, residual, 2, before=node)
            replace_with(graph, node, call.target, call.args(), call.fake)
            graph.erase_node(node)
            count += 1
            break
    return count


def is_moe(node) -> bool:
    """An `ember::moe` call without a residual, with or without an expert map, biases and a SwiGLU limit (matched
    by name: the op exists only where a model has MoE)."""
    return (getattr(node, "op", None) == "call_function" and str(node.target) == "ember.moe.default"
            and not node.kwargs and 6 <= len(node.args) <= 11 and (len(node.args) == 6 or node.args[6] is None))


def _fuse_moe_residual(graph: Graph, add: Node, moe: Node, residual) -> bool:
    """Rewrite `add` = moe + residual into the MoE op with the residual when the add is the op's one user and the
    shapes and dtypes agree; whether it did."""
    if not is_moe(moe) or sole_user(moe)[0] is not add:
        return False
    out_val, residual_val, sum_val = value(moe), value(residual), value(add)
    if out_val is None or residual_val is None or sum_val is None:
        return False
    if not same_shape(out_val, residual_val) or not same_shape(out_val, sum_val) or \
            not residual_val.dtype == out_val.dtype == sum_val.dtype:
        return False
    args = tuple(moe.args[:6]) + (residual,) + tuple(moe.args[7:])      # an expert map, biases, limit kept
    replace_with(graph, add, moe.target, args, lambda: sum_val)
    graph.erase_node(add)
    graph.erase_node(moe)
    return True

