"""Small matchers over Inductor's post-grad (aten) FX graphs, shared by the fusion passes.

The passes see the graph after AOT autograd's decompositions: a model's `x.float()` is a
`prims.convert_element_type`, `F.silu` is `x / (1 + exp(-x))`, `chunk` is `aten.split`. Each matcher accepts the
forms that the model's plain PyTorch takes there, and nothing it cannot prove equal.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

aten = torch.ops.aten
prims = torch.ops.prims


def is_call(node, *targets) -> bool:
    """Whether `node` is an FX node calling one of `targets` (an op overload or packet, or a Python function)."""
    if not isinstance(node, Node) or node.op != "call_function":
        return False
    for target in targets:
        if node.target is target or getattr(node.target, "overloadpacket", None) is target:
            return True
    return False


def value(node) -> torch.Tensor | None:
    """The fake tensor Inductor recorded for `node`, if it is a tensor."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def skip_noop_views(node):
    """`node`'s source when it is a view or reshape to the shape it already has (a traced `x.reshape(-1, K)` of a
    2-D x; Inductor usually drops these before the passes run, a graph from make_fx keeps them)."""
    while is_call(node, aten.view, aten.reshape, aten._unsafe_view):
        out_val, in_val = value(node), value(node.args[0])
        if out_val is None or in_val is None or not same_shape(out_val, in_val):
            break
        node = node.args[0]
    return node


def _leading_units(val: torch.Tensor) -> int:
    """How many leading dims of `val` are statically 1."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    n = 0
    while n < val.dim() and statically_known_true(val.shape[n] == 1):
        n += 1
    return n


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two shapes are provably equal once their leading size-1 dims are dropped ([1, T, N] and [T, N])."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    a_shape, b_shape = a.shape[min(_leading_units(a), a.dim() - 1):], b.shape[min(_leading_units(b), b.dim() - 1):]
    return len(a_shape) == len(b_shape) and all(statically_known_true(x == y) for x, y in zip(a_shape, b_shape))


def is_unit_view(node) -> bool:
    """Whether `node` views its input with leading size-1 dims added or dropped and nothing else (transformers code
    runs [1, T, N] around a linear layer's [T, N])."""
    if not is_call(node, aten.view, aten.reshape, aten._unsafe_view, aten.unsqueeze, aten.squeeze):
        return False
    out_val, in_val = value(node), value(node.args[0])
    return out_val is not None and in_val is not None and out_val.dim() != in_val.dim() and same_rows(out_val, in_val)


def unit_view_source(node):
    """`node`'s source through no-op views and unit views (`is_unit_view`)."""
    node = skip_noop_views(node)
    while is_unit_view(node):
        node = skip_noop_views(node.args[0])
    return node


def unit_view_end(node: Node) -> Node:
    """The last of a chain of sole-user no-op or unit views of `node` (`node` itself when its users are others)."""
    while len(node.users) == 1:
        user = next(iter(node.users))
        if not (is_unit_view(user) or skip_noop_views(user) is node):
            break
        node = user
    return node


def with_rank(graph: Graph, node: Node, rank: int, before: Node | None = None) -> Node:
    """`node` with leading size-1 dims dropped or added (squeeze / unsqueeze at dim 0) until it has `rank` dims,
    the views inserted before `before` (default: right after `node`); `node` itself when it has that rank."""
    val = value(node)
    while val.dim() != rank:
        op = aten.squeeze.dim if val.dim() > rank else aten.unsqueeze.default
        with graph.inserting_before(before) if before is not None else graph.inserting_after(node):
            node = graph.call_function(op, (node, 0))
        val = op(val, 0)
        node.meta["val"] = val
    return node


def sole_user(node: Node):
    """The one user of `node` seen through no-op views (None when there are several), and the node it uses."""
    while len(node.users) == 1:
        user = next(iter(node.users))
        if skip_noop_views(user) is not node:
            return user, node
        node = user
    return None, node


def other_operand(node: Node, known: Node):
    """The operand of a binary `node` that is not `known` (None when neither or both are)."""
    a, b = node.args[:2]
    if a is known and b is not known:
        return b
    if b is known and a is not known:
        return a
    return None


def strip_upcast(node):
    """(the tensor before `.float()`, its dtype) for a convert to float32, else (node, its dtype)."""
    if is_call(node, prims.convert_element_type) and node.args[1] == torch.float32:
        source = node.args[0]
        val = value(source)
        return source, (val.dtype if val is not None else None)
    val = value(node)
    return node, (val.dtype if val is not None else None)


@dataclass
class RMSNormMatch:
    """`weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)`, with x upcast to float32 first."""
    x: Node
    weight: Node
    eps: float


def match_rms_norm(node, weight_dims: int = 1) -> RMSNormMatch | None:
    """Match the Llama-form RMSNorm ending at `node` (the product with the weight), the weight over the last
    `weight_dims` dims (2: one weight row per head)."""
    if not is_call(node, aten.mul) or len(node.args) != 2:
        return None
    for normed_cast, weight in (node.args, node.args[::-1]):
        out_val, weight_val = value(node), value(weight)
        if out_val is None or weight_val is None or weight_val.dim() != weight_dims:
            continue
        normed = normed_cast
        if is_call(normed_cast, prims.convert_element_type):
            if normed_cast.args[1] != out_val.dtype:
                continue
            normed = normed_cast.args[0]
        found = _match_normalise(normed)
        if found is None:
            continue
        x, x_dtype, eps = found
        if x_dtype != out_val.dtype or weight_val.dtype != out_val.dtype or \
                tuple(weight_val.shape) != tuple(out_val.shape[-weight_dims:]):
            continue
        if x_dtype != torch.float32 and normed is normed_cast:
            continue     # a half-precision norm must round back before the weight, as the model does
        return RMSNormMatch(x, weight, eps)
    return None


def _match_normalise(node):
    """x32 * rsqrt(mean(x32 ** 2, [-1], keepdim) + eps) -> (x, x's dtype, eps)."""
    if not is_call(node, aten.mul) or len(node.args) != 2:
        return None
    for x32, rsqrt in (node.args, node.args[::-1]):
        if not is_call(rsqrt, aten.rsqrt) or not is_call(rsqrt.args[0], aten.add):
            continue
        add = rsqrt.args[0]
        mean, eps = add.args[:2]
        if not isinstance(eps, (int, float)):
            mean, eps = eps, mean
        if not isinstance(eps, (int, float)) or not is_call(mean, aten.mean):
            continue
        val = value(x32)
        if val is None or val.dtype != torch.float32:
            continue
        dims = mean.args[1] if len(mean.args) > 1 else None
        keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
        if list(dims or []) not in ([-1], [val.dim() - 1]) or not keepdim:
            continue
        square = mean.args[0]
        if not (is_call(square, aten.pow) and square.args[0] is x32 and square.args[1] == 2):
            continue
        x, x_dtype = strip_upcast(x32)
        return x, x_dtype, float(eps)
    return None


def getitem_users(node: Node) -> dict[int, Node] | None:
    """{index: getitem node} when every user of a tuple-valued `node` is a getitem, else None."""
    items = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or user.args[1] in items:
            return None
        items[user.args[1]] = user
    return items


def match_silu(node, gate: Node) -> bool:
    """Whether `node` computes silu(gate) in float32 from `gate` (upcast first when gate is half precision)."""
    gate_val = value(gate)
    g32 = gate
    if gate_val is not None and gate_val.dtype != torch.float32:
        g32 = next((u for u in gate.users if is_call(u, prims.convert_element_type)
                    and u.args[1] == torch.float32), None)
        if g32 is None:
            return False
    if is_call(node, aten.silu):
        return node.args[0] in (gate, g32)
    if is_call(node, aten.div) and node.args[0] is g32 and is_call(node.args[1], aten.add):
        # g / (1 + exp(-g)): Inductor's decomposition of silu
        a, b = node.args[1].args[:2]
        exp, one = (a, b) if isinstance(a, Node) else (b, a)
        return (not isinstance(one, Node) and one == 1 and is_call(exp, aten.exp)
                and is_call(exp.args[0], aten.neg) and exp.args[0].args[0] is g32)
    if is_call(node, aten.mul):
        sigmoid = other_operand(node, g32)
        return is_call(sigmoid, aten.sigmoid) and sigmoid.args[0] is g32
    return False


@dataclass
class LinearCall:
    """The arguments of an `ember::linear` or `ember::fused_linear` node, as `ember::fused_linear` takes them, or of
    an `ember::scaled_linear` node (fp8 weights), which takes the same fusions itself."""
    x: Node
    weight: Node
    bias: Node | None = None
    norm_weight: Node | None = None
    eps: float = 0.0
    gated: bool = False
    residual: Node | None = None
    scales: tuple | None = None         # scaled_linear's (weight_scale, input_scale, block_n, block_k)

    @classmethod
    def of(cls, node) -> "LinearCall | None":
        if is_call(node, torch.ops.ember.linear.default):
            return cls(*node.args[:3])
        if is_call(node, torch.ops.ember.fused_linear.default):
            return cls(*node.args[:7])
        if is_call(node, torch.ops.ember.scaled_linear.default):
            x, weight, weight_scale, input_scale, bias, block_n, block_k, *fusions = node.args[:11]
            return cls(x, weight, bias, *fusions, scales=(weight_scale, input_scale, block_n, block_k))
        return None

    @property
    def target(self):
        """The op the fused call runs as: `ember::scaled_linear` for fp8 weights, else `ember::fused_linear`."""
        return torch.ops.ember.fused_linear.default if self.scales is None else torch.ops.ember.scaled_linear.default

    def args(self) -> tuple:
        fusions = (self.norm_weight, self.eps, self.gated, self.residual)
        if self.scales is None:
            return (self.x, self.weight, self.bias, *fusions)
        weight_scale, input_scale, block_n, block_k = self.scales
        return (self.x, self.weight, weight_scale, input_scale, self.bias, block_n, block_k, *fusions)

    def fake(self):
        """The op's output as a fake tensor, from the inputs' recorded values (under their fake mode)."""
        from torch._guards import detect_fake_mode
        vals = [value(a) if isinstance(a, Node) else a for a in self.args()]
        with detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)]):
            return self.target(*vals)


def replace_with(graph: Graph, old: Node, target, args: tuple, fake_fn) -> Node:
    """Insert `target(*args)` before `old`, give it `old`'s users and a fake value from `fake_fn`; where the new
    value has fewer or more leading size-1 dims than `old`'s ([T, N] for [1, T, N]), the users get it viewed to
    `old`'s rank."""
    with graph.inserting_before(old):
        new = graph.call_function(target, args)
    new.meta.update({k: v for k, v in old.meta.items() if k in ("stack_trace", "nn_module_stack")})
    new.meta["val"] = fake_fn()
    old_val = value(old)
    old.replace_all_uses_with(new if old_val is None else with_rank(graph, new, old_val.dim()))
    return new


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (possibly symbolic) shapes are provably equal, without adding guards."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))
