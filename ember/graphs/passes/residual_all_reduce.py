"""Under tensor parallelism, the residual add after a row-parallel projection's all-reduce goes into the reduce:
`all_reduce(linear(x)) + residual` -> `all_reduce(fused_linear(x, residual=residual))` on rank 0 and
`all_reduce(linear(x))` on the others, since the sum over the ranks of (rank 0's part + residual) and the other
parts is the same sum. The reduce's output is then the new residual stream itself: the separate add kernel (one a
reduce, two a layer) is gone, and rank 0's o_proj and down (or MoE op) add the residual in their epilogue as they
do on one GPU. Likewise `all_reduce(ember::moe(...)) + residual` for a mixture-of-experts MLP.

The rewrite depends on the rank, so each rank compiles its own graph (the compile key names the rank) and the pass
names the rank in Inductor's cache key (`rank_key`)."""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from ember.distributed import ops as _ops  # noqa: F401  (registers torch.ops.ember.all_reduce)
from ember.distributed.parallel_state import TP_GROUP, tensor_parallel
from ember.graphs.passes.match import (LinearCall, aten, is_call, replace_with, same_rows, same_shape, unit_view_end,
                                       unit_view_source, value, with_rank)
from ember.graphs.passes.residual_epilogue import is_moe

NAME = "residual_all_reduce"


def rank_key() -> str:
    """What the pass's output depends on besides the graph: this process's tensor-parallel rank."""
    return f"tp rank {tensor_parallel().rank} of {tensor_parallel().size}"


def fuse_residual_into_all_reduce(graph: Graph) -> int:
    """Rewrite every add of a same-shape, same-dtype tensor to an `ember::all_reduce` over the tensor-parallel
    group used only by that add, whose input is a linear or MoE op used only by the reduce; returns how many."""
    all_reduce = torch.ops.ember.all_reduce.default
    rank = tensor_parallel().rank
    count = 0
    for node in list(graph.nodes):
        if not is_call(node, aten.add) or len(node.args) != 2 or node.kwargs:
            continue
        for operand, residual in (node.args, node.args[::-1]):
            reduce = unit_view_source(operand)
            if not is_call(reduce, all_reduce) or tuple(reduce.args[1:]) != (TP_GROUP,):
                continue
            end = unit_view_end(reduce)
            if node not in end.users or len(end.users) != 1:
                continue
            reduce_val, residual_val, sum_val = value(reduce), value(residual), value(node)
            if reduce_val is None or residual_val is None or sum_val is None or not isinstance(residual, Node):
                continue
            if not same_rows(reduce_val, residual_val) or not same_rows(reduce_val, sum_val) or \
                    not residual_val.dtype == reduce_val.dtype == sum_val.dtype:
                continue
            found = _projection_of(reduce, residual)     # decided alike on every rank, from the graph alone
            if found is None:
                continue
            if rank == 0:
                projection = _with_residual(graph, found, residual, before=node)
                replace_with(graph, node, all_reduce, (projection, TP_GROUP),
                             lambda: torch.empty_like(value(projection)))
                graph.erase_node(node)
                _erase_unused(graph, end, stop=unit_view_source(reduce.args[0]))
            else:
                node.replace_all_uses_with(with_rank(graph, end, sum_val.dim(), before=node))
                graph.erase_node(node)
            count += 1
            break
    return count


def _projection_of(reduce: Node, residual: Node):
    """(node, its `LinearCall` or None for a MoE op) of the linear or MoE op whose only use is `reduce`, without a
    residual of its own and of a shape its epilogue can add `residual` to; None otherwise."""
    source = unit_view_source(reduce.args[0])
    end = unit_view_end(source)
    if len(end.users) != 1 or next(iter(end.users)) is not reduce:
        return None
    out_val, residual_val = value(source), value(residual)
    if out_val is None:
        return None
    call = LinearCall.of(source)
    if call is not None:
        fits = call.residual is None and out_val.dim() == 2 and same_rows(out_val, residual_val)
        return (source, call) if fits else None
    return (source, None) if is_moe(source) and same_shape(out_val, residual_val) else None


def _with_residual(graph: Graph, found: tuple, residual: Node, before: Node) -> Node:
    """A new node: the projection `found` (`_projection_of`) with `residual` added in its epilogue."""
    source, call = found
    if call is not None:
        call.residual = with_rank(graph, residual, 2, before=before)
        with graph.inserting_before(before):
            new = graph.call_function(call.target, call.args())
        new.meta["val"] = call.fake()
        return new
    with graph.inserting_before(before):
        new = graph.call_function(source.target, tuple(source.args[:6]) + (residual,) + tuple(source.args[7:]))
    new.meta["val"] = torch.empty_like(value(source))
    return new


def _erase_unused(graph: Graph, node: Node, stop: Node) -> None:
    """Erase `node` and its inputs back to `stop` (included) while each is left without users: the old reduce must
    go, or rank 0 would run one collective more than the others."""
    while isinstance(node, Node) and not node.users:
        source = node.args[0] if node is not stop else None
        graph.erase_node(node)
        if source is None:
            return
        node = source
