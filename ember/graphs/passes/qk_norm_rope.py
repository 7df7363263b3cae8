"""Per-head RMSNorm and rotary of q and k as one kernel: the model's joint form (q and k concatenated into
[T, Hq + Hkv, D], normed with one weight row per head, rotated in rotate-half layout, sliced back into contiguous q
and k) -> `ember::qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps)`, which reads q and k where the qkv
projection wrote them."""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from ember.graphs.passes.match import aten, getitem_users, is_call, match_rms_norm, prims, value

NAME = "qk_norm_rope"


def _mul_operands(node) -> set | None:
    if not is_call(node, aten.mul) or len(node.args) != 2 or node.kwargs:
        return None
    return set(node.args)


def _table(node, dtype):
    """The float32 cos or sin table [T, D/2] behind `table[:, None, :].to(dtype)`."""
    if dtype != torch.float32:
        if not (is_call(node, prims.convert_element_type) and node.args[1] == dtype):
            return None
        node = node.args[0]
    if not (is_call(node, aten.unsqueeze) and node.args[1] == 1):
        return None
    table = node.args[0]
    val = value(table)
    return table if val is not None and val.dim() == 2 and val.dtype == torch.float32 else None


def _match_rotation(cat: Node):
    """cat([x1*cos - x2*sin, x2*cos + x1*sin], -1) with x1, x2 the halves of one tensor -> (that tensor, cos
    table, sin table) or None."""
    out_val = value(cat)
    if out_val is None or out_val.dim() != 3 or len(cat.args[0]) != 2:
        return None
    if (cat.args[1] if len(cat.args) > 1 else 0) not in (-1, 2):
        return None
    first, second = cat.args[0]
    if not (is_call(first, aten.sub) and is_call(second, aten.add)) or first.kwargs or second.kwargs:
        return None
    a, b = _mul_operands(first.args[0]), _mul_operands(first.args[1])
    c, d = _mul_operands(second.args[0]), _mul_operands(second.args[1])
    if None in (a, b, c, d):
        return None
    halves = [n for n in a | b if isinstance(n, Node) and n.target is operator.getitem]
    split = halves[0].args[0] if halves else None
    items = getitem_users(split) if is_call(split, aten.split) else None
    if items is None or set(items) != {0, 1} or items[0] not in a or items[1] not in b:
        return None
    x1, x2 = items[0], items[1]
    cos_b, sin_b = next(iter(a - {x1}), None), next(iter(b - {x2}), None)
    if {x2, cos_b} not in (c, d) or {x1, sin_b} not in (c, d) or c == d:
        return None
    source = split.args[0]
    source_val = value(source)
    if source_val is None or split.args[1] * 2 != source_val.shape[-1] or \
            (split.args[2] if len(split.args) > 2 else 0) not in (-1, 2):
        return None     # a partial rotation leaves channels out of the split
    cos, sin = _table(cos_b, out_val.dtype), _table(sin_b, out_val.dtype)
    return None if cos is None or sin is None else (source, cos, sin)


def _match_joint_input(x):
    """reshape(cat([q, k], -1), [T, H, D]) -> (q, k) with q [T, Hq*D], k [T, Hkv*D]."""
    if not is_call(x, aten.view, aten.reshape, aten._unsafe_view):
        return None
    cat = x.args[0]
    if not is_call(cat, aten.cat) or len(cat.args[0]) != 2 or (cat.args[1] if len(cat.args) > 1 else 0) not in (-1, 1):
        return None
    q, k = cat.args[0]
    return (q, k) if value(q) is not None and value(k) is not None and value(q).dim() == 2 else None


def _match_joint_weight(weight, hq: int, hkv: int, d: int):
    """cat([q_weight.expand(Hq, D), k_weight.expand(Hkv, D)]) -> (q_weight, k_weight)."""
    if not is_call(weight, aten.cat) or len(weight.args[0]) != 2 or (weight.args[1] if len(weight.args) > 1 else 0):
        return None
    found = []
    for part, heads in zip(weight.args[0], (hq, hkv)):
        if not (is_call(part, aten.expand) and list(part.args[1]) == [heads, d]):
            return None
        val = value(part.args[0])
        if val is None or tuple(val.shape) != (d,):
            return None
        found.append(part.args[0])
    return tuple(found)


def _head_slices(cat: Node, hq: int):
    """The users of the rotated [T, H, D] tensor: slices [:, :hq] and [:, hq:] -> ([q slices], [k slices])."""
    q_slices, k_slices = [], []
    for user in cat.users:
        if not (is_call(user, aten.slice) and user.args[1] == 1):
            return None
        start = user.args[2] if len(user.args) > 2 else 0
        end = user.args[3] if len(user.args) > 3 else None
        if start == 0 and end == hq:
            q_slices.append(user)
        elif start == hq and (end is None or end >= value(cat).shape[1]):
            k_slices.append(user)
        else:
            return None
    return q_slices, k_slices


def _rewire(graph: Graph, slices: list[Node], result: Node) -> None:
    """Give a head slice's users the op's contiguous output; a `.contiguous()` copy of the slice becomes it."""
    for piece in slices:
        for user in list(piece.users):
            if is_call(user, aten.clone):
                user.replace_all_uses_with(result)
                graph.erase_node(user)
        piece.replace_all_uses_with(result)
        graph.erase_node(piece)


def fuse_qk_norm_rope(graph: Graph) -> int:
    """Rewrite every joint q/k norm + full rotary; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if not is_call(node, aten.cat):
            continue
        rotation = _match_rotation(node)
        norm = match_rms_norm(rotation[0], weight_dims=2) if rotation else None
        joint = _match_joint_input(norm.x) if norm else None
        if joint is None:
            continue
        q, k = joint
        h, d = value(node).shape[1], value(node).shape[2]
        if not isinstance(d, int) or value(q).shape[1] % d or value(k).shape[1] % d:
            continue
        hq, hkv = value(q).shape[1] // d, value(k).shape[1] // d
        weights = _match_joint_weight(norm.weight, hq, hkv, d) if hq + hkv == h else None
        slices = _head_slices(node, hq) if weights else None
        if slices is None:
            continue
        _, cos, sin = rotation
        args = (q, k, *weights, cos, sin, norm.eps)
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.ember.qk_norm_rope.default, args)
            q_out = graph.call_function(operator.getitem, (fused, 0))
            k_out = graph.call_function(operator.getitem, (fused, 1))
        from torch._guards import detect_fake_mode
        vals = [value(a) if isinstance(a, Node) else a for a in args]
        with detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)]):
            fake = torch.ops.ember.qk_norm_rope.default(*vals)
        fused.meta["val"], q_out.meta["val"], k_out.meta["val"] = fake, fake[0], fake[1]
        _rewire(graph, slices[0], q_out)
        _rewire(graph, slices[1], k_out)
        count += 1
    return count
