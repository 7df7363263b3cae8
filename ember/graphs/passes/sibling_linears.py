"""Sibling projections of one input as one: `linear(x, W[a:b])`, `linear(x, W[b:c])`, ... over adjacent row ranges
of one weight -> `linear(x, W[a:c])` and a split. The transformers fallback packs q/k/v and gate/up this way
(ember.models.fallback_packing), so after this pass its graph holds a native model's packed projections, which the
passes that follow (a gate/up split into the SiLU·mul epilogue) then fuse alike."""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from ember.graphs.passes.match import aten, is_call, value

NAME = "sibling_linears"
_LINEAR = torch.ops.ember.linear.default


def _rows(node) -> tuple[Node, int, int] | None:
    """(weight, start, end) for `weight[start:end]` (a dim-0 slice, step 1, static bounds), else None."""
    if not is_call(node, aten.slice):
        return None
    base, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
    if dim != 0 or step != 1 or not isinstance(start, int) or not isinstance(end, int) or not isinstance(base, Node):
        return None
    return base, start, end


def _input_key(x) -> tuple:
    """Equal for inputs that are the same tensor: the same node, or equal views of the same node."""
    if is_call(x, aten.view, aten.reshape, aten._unsafe_view):
        return (x.args[0], tuple(x.args[1]))
    return (x, None)


def _fake(fn, *nodes_or_values):
    from torch._guards import detect_fake_mode
    vals = [value(a) if isinstance(a, Node) else a for a in nodes_or_values]
    with detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)]):
        return fn(*vals)


def fuse_sibling_linears(graph: Graph) -> int:
    """Merge every run of two or more `ember::linear` calls on one input over adjacent row ranges of one weight (and
    of one bias, or none); returns how many merged calls replaced them."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups: dict[tuple, list[tuple[Node, int, int]]] = {}
    for node in graph.nodes:
        if not is_call(node, _LINEAR) or len(node.args) < 3:
            continue
        x, weight, bias = node.args[:3]
        rows = _rows(weight)
        bias_rows = _rows(bias) if bias is not None else None
        if rows is None or (bias is not None and (bias_rows is None or bias_rows[1:] != rows[1:])):
            continue
        key = (_input_key(x), rows[0], bias_rows[0] if bias_rows else None)
        groups.setdefault(key, []).append((node, rows[1], rows[2]))
    count = 0
    for (_, base, bias_base), members in groups.items():
        members.sort(key=lambda m: m[1])
        run: list[tuple[Node, int, int]] = []
        for member in members + [None]:
            if member is not None and run and member[1] == run[-1][2]:
                run.append(member)
                continue
            if len(run) >= 2:
                _merge(graph, run, base, bias_base, order)
                count += 1
            run = [member] if member is not None else []
    return count


def _merge(graph: Graph, run: list[tuple[Node, int, int]], base: Node, bias_base: Node | None,
           order: dict[Node, int]) -> None:
    """One linear over rows run[0].start:run[-1].end and a split whose pieces replace the run's linears."""
    first = min((node for node, _, _ in run), key=order.__getitem__)
    start, end = run[0][1], run[-1][2]
    sizes = [e - s for _, s, e in run]
    with graph.inserting_before(first):
        weight = graph.call_function(aten.slice.Tensor, (base, 0, start, end))
        weight.meta["val"] = _fake(lambda w: w[start:end], base)
        bias = None
        if bias_base is not None:
            bias = graph.call_function(aten.slice.Tensor, (bias_base, 0, start, end))
            bias.meta["val"] = _fake(lambda b: b[start:end], bias_base)
        merged = graph.call_function(_LINEAR, (first.args[0], weight, bias))
        merged.meta["val"] = _fake(_LINEAR, first.args[0], weight, bias)
        split = graph.call_function(aten.split_with_sizes.default, (merged, sizes, -1))
        split.meta["val"] = _fake(lambda t: aten.split_with_sizes.default(t, sizes, -1), merged)
        for i, (node, _, _) in enumerate(run):
            piece = graph.call_function(operator.getitem, (split, i))
            piece.meta["val"] = split.meta["val"][i]
            piece.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
            node.replace_all_uses_with(piece)
    for node, _, _ in run:
        graph.erase_node(node)
