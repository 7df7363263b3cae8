"""Residual donation: `fused_linear(..., residual=r)` -> `fused_linear_into_residual(..., r)` where nothing reads
`r` afterwards, so the projection's result is written over the residual stream instead of a new tensor.

A decoder layer adds the residual twice (o_proj and down_proj). `ember::fused_linear` returns a new tensor, and for
a prefill-sized batch cuBLAS takes the residual as its beta=1 accumulator through `torch.addmm(residual, ...)`,
which first copies the residual into that new tensor: a device-to-device copy of [tokens, hidden] per residual
add (on an H100, 21.7 us for 16,384 x 1,024 bf16). Written over the residual, the same GEMM runs without it.

This runs on plain pieces only (ember.graphs.plain_pieces: the aten graph runs as it is, in order), after the
fusion passes. `r` may be written over when
  - it is a tensor the piece made with an op that returns a new tensor (`FRESH`), or a piece input the caller
    donates (`donated`: the output of an earlier piece that nothing else reads, ember.graphs.piecewise), and
  - every other reader of it runs before, and is an op that only reads it (`READERS`: no view of it survives).

    donate_residuals(graph, donated=frozenset()) -> int        how many residual adds now write in place
    fresh_outputs(graph, donated=frozenset()) -> frozenset[int]     outputs a later piece may write over
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from ember.graphs.passes.match import aten, is_call, same_shape, value

NAME = "donate_residual"


def _ops() -> tuple[frozenset, frozenset]:
    import ember.kernels.fused_linear  # noqa: F401  (registers the ops)
    import ember.kernels.qk_norm_rope  # noqa: F401
    import ember.kernels.rms_norm  # noqa: F401
    ember = torch.ops.ember
    fresh = frozenset({ember.fused_linear.default, ember.rms_norm.default, aten.embedding.default})
    readers = fresh | {ember.fused_linear_into_residual.default, ember.qk_norm_rope.default}
    return fresh, readers


def _position(graph: Graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def donate_residuals(graph: Graph, donated: frozenset[int] = frozenset()) -> int:
    """Rewrite each residual add whose residual nothing reads afterwards to write over it; returns how many.
    `donated`: indices of the graph's inputs the caller hands over (nothing reads them after this graph)."""
    fresh, readers = _ops()
    into = torch.ops.ember.fused_linear_into_residual.default
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    count = 0
    for node in list(graph.nodes):
        if not is_call(node, torch.ops.ember.fused_linear.default) or len(node.args) != 7:
            continue
        residual = node.args[6]
        if not isinstance(residual, Node):
            continue
        if residual.op == "placeholder":
            if inputs.index(residual) not in donated:
                continue
        elif not is_call(residual, *fresh):
            continue
        out, res, x = value(node), value(residual), value(node.args[0])
        if out is None or res is None or x is None or res.dtype != x.dtype or out.dtype != x.dtype \
                or not same_shape(out, res):
            continue
        where = _position(graph)
        if any(user is not node and (where[user] > where[node] or not is_call(user, *readers))
               for user in residual.users):
            continue
        with graph.inserting_before(node):
            written = graph.call_function(into, node.args)
        written.meta["val"] = None
        node.replace_all_uses_with(residual)
        graph.erase_node(node)
        count += 1
    return count


def _root(node):
    """The node whose tensor `node` views (through views, splits and their items)."""
    while isinstance(node, Node) and node.op == "call_function" and (
            node.target is operator.getitem or getattr(node.target, "is_view", False)
            or is_call(node, aten.split, aten.split_with_sizes, aten._unsafe_view, aten.reshape)):
        node = node.args[0]
    return node


def fresh_outputs(graph: Graph, donated: frozenset[int] = frozenset()) -> frozenset[int]:
    """Indices of the graph's outputs that are new tensors of a `FRESH` op, or donated inputs (numbered in
    `donated`: the graph holds the only use of them), which no other output views: a later piece may write over
    them once nothing else reads them."""
    fresh, _ = _ops()
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    handed = {inputs[i] for i in donated}
    outputs = graph.output_node().args[0]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    roots = [_root(o) for o in outputs]
    return frozenset(i for i, o in enumerate(outputs)
                     if isinstance(o, Node) and (is_call(o, *fresh) or o in handed) and roots.count(o) == 1)
