"""Trace a few decoder layers, stamp out the rest: the cold start's dynamo trace of a deep model in a fraction of
the time.

Dynamo's trace of a forward costs milliseconds per FX node (most of it running each op on fake tensors with a
symbolic token count), and a decoder's nodes are almost all its layers': the Qwen3-0.6B config's 28 layers trace to
about 2,450 nodes in 8.9 s on a 2-core CPU. When a model says its layers are uniform (`stamp_layers_path`: the
path of its layer list, set by model families whose layers run the same code whatever their index), the compile
traces the model with only its first `TRACED_LAYERS` layers and builds the full graph from that trace: the last
traced layer's nodes are the template, copied once per further layer with that layer's parameters as inputs, the
previous copy's outputs where the template read its predecessor's, and the layer's own name in every string
argument (the attention op's `layer_name`). The first layer may differ (a Llama block's first norm has no residual
to add), which is why the template is the third layer and not the second.

`stamp_layers` checks before it builds: every node belongs to the prologue, one traced layer (by dynamo's
`nn_module_stack`) or the epilogue, in that order; the template and the layer before it are the same program node
for node (same targets, constants equal up to the layer's name, inputs at the same positions); the epilogue reads
no layer but the last. Anything else returns the reason, and the caller traces the whole model instead.

It reads dynamo's `nn_module_stack` node metadata and the shape of dynamo's graphs: it is the `layer_stamp` hook of
ember.kernels.hooks (docs/hooks.md), off with `EMBER_HOOKS=layer_stamp=off` or on a torch it was not checked with.
"""

from __future__ import annotations

import contextlib
import logging
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.node import map_aggregate

logger = logging.getLogger("ember")

TRACED_LAYERS = 3        # first layer (may differ), the layer before the template, the template


def _layer_pattern(layers_path: str) -> re.Pattern:
    # dynamo writes module paths as "L['model'].model.layers.2.mlp" (or with "[2]" for the index)
    return re.compile(r"(?:^|[.\]'])" + re.escape(layers_path) + r"(?:\.(\d+)(?=\.|$)|\[(\d+)\])")


def node_layer(node: torch.fx.Node, pattern: re.Pattern) -> int | None:
    """The index of the layer whose module ran this node (its innermost layer on dynamo's module stack), or None
    for the prologue and epilogue."""
    stack = node.meta.get("nn_module_stack") or {}
    found = None
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        match = pattern.search(str(path))
        if match:
            found = int(match.group(1) or match.group(2))
    return found


def _param_layer(spec: Any, layers_path: str) -> int | None:
    if spec is None or spec[0] != "param":
        return None
    match = re.match(re.escape(layers_path) + r"\.(\d+)\.", spec[1])
    return int(match.group(1)) if match else None


def _rename(value: Any, old: str, new: str) -> Any:
    return map_aggregate(value, lambda v: v.replace(old, new) if isinstance(v, str) else v)


class _Mismatch(Exception):
    pass


def stamp_layers(gm: torch.fx.GraphModule, specs: Sequence[Any], layers_path: str, num_layers: int
                 ) -> tuple[torch.fx.GraphModule, list[Any]] | str:
    """The graph of the model with `num_layers` layers from `gm`, dynamo's graph of the same model cut to its
    first TRACED_LAYERS layers; `specs` (ember.graphs.artifacts.InputSpec, one per placeholder) names each input.
    Returns (graph, specs of its placeholders) or the reason it cannot be built."""
    t = TRACED_LAYERS
    if num_layers <= t:
        return f"{num_layers} layers: nothing to stamp beyond the {t} traced"
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != len(specs):
        return f"{len(placeholders)} graph inputs but {len(specs)} input specs"
    spec_of = dict(zip(placeholders, specs))
    param_layer = {p: _param_layer(spec_of[p], layers_path) for p in placeholders}
    pattern = _layer_pattern(layers_path)
    compute = [n for n in nodes if n.op not in ("placeholder", "output")]
    blocks: list[list[torch.fx.Node]] = [[] for _ in range(t)]
    prologue, epilogue = [], []
    last = -1
    for node in compute:
        layer = node_layer(node, pattern)
        if layer is None:
            (prologue if last < 0 else epilogue).append(node)
            if last >= 0:
                last = t
            continue
        if not 0 <= layer < t or layer < last or last == t:
            return f"node {node.name} of layer {layer} is out of order (prologue, layers 0..{t - 1}, epilogue)"
        blocks[layer].append(node)
        last = layer
    if any(not block for block in blocks):
        return "a traced layer has no nodes"
    before, template = blocks[t - 2], blocks[t - 1]
    position = {n: (k, i) for k, block in enumerate(blocks) for i, n in enumerate(block)}
    old_name, new_name = f"{layers_path}.{t - 2}.", f"{layers_path}.{t - 1}."

    def same(a: Any, b: Any) -> None:
        """a: an argument in the layer before the template, b: the template's at the same place."""
        if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node):
            pa, pb = position.get(a), position.get(b)
            if pa is not None or pb is not None:
                ok = (pa is not None and pb is not None and
                      ((pa[0] == t - 2 and pb[0] == t - 1 and pa[1] == pb[1])      # inside the layer
                       or (pa[0] == t - 3 and pb[0] == t - 2)))                    # the previous layer's output
                if not ok:
                    raise _Mismatch(f"{a.name} / {b.name}")
            elif param_layer.get(a) is not None or param_layer.get(b) is not None:
                if (param_layer.get(a), param_layer.get(b)) != (t - 2, t - 1) or \
                        spec_of[a][1].replace(old_name, new_name) != spec_of[b][1]:
                    raise _Mismatch(f"inputs {a.name} / {b.name}")
            elif a is not b:
                raise _Mismatch(f"{a.name} / {b.name}")
        elif isinstance(a, (tuple, list)) and type(a) is type(b) and len(a) == len(b):
            for x, y in zip(a, b):
                same(x, y)
        elif isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
            for key in a:
                same(a[key], b[key])
        elif isinstance(a, str) and isinstance(b, str):
            if a.replace(old_name, new_name) != b:
                raise _Mismatch(f"{a!r} / {b!r}")
        elif type(a) is not type(b) or a != b:
            raise _Mismatch(f"{a!r} / {b!r}")

    if len(before) != len(template):
        return f"layers {t - 2} and {t - 1} trace to {len(before)} and {len(template)} nodes"
    try:
        for a, b in zip(before, template):
            if a.op != b.op or a.target != b.target:
                raise _Mismatch(f"{a.name} {a.target} / {b.name} {b.target}")
            same(a.args, b.args)
            same(a.kwargs, b.kwargs)
    except _Mismatch as exc:
        return f"layers {t - 2} and {t - 1} are not the same program ({exc})"
    for node in epilogue + [nodes[-1]]:
        for arg in node.all_input_nodes:
            if arg in position and position[arg][0] != t - 1:
                return f"the epilogue reads layer {position[arg][0]} ({arg.name}), not only the last"
    for node in prologue:
        if any(param_layer.get(a) is not None for a in node.all_input_nodes):
            return f"the prologue node {node.name} reads a layer's parameter"
    return _build(gm, nodes, placeholders, specs, param_layer, prologue, blocks, epilogue, layers_path, num_layers)


def _build(gm, nodes, placeholders, specs, param_layer, prologue, blocks, epilogue, layers_path, num_layers):
    t = TRACED_LAYERS
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    new_specs = list(specs)
    for p in placeholders:
        env[p] = graph.node_copy(p, lambda n: env[n])
    template_inputs = [p for p in placeholders if param_layer[p] == t - 1]
    layer_inputs: dict[int, dict[torch.fx.Node, torch.fx.Node]] = {}
    spec_of = dict(zip(placeholders, specs))
    for k in range(t, num_layers):
        old, new = f"{layers_path}.{t - 1}.", f"{layers_path}.{k}."
        layer_inputs[k] = {}
        for p in template_inputs:
            name = spec_of[p][1].replace(old, new)
            copy = graph.placeholder(re.sub(r"\W", "_", name))
            copy.meta = dict(p.meta)
            layer_inputs[k][p] = copy
            new_specs.append(("param", name))
    for node in prologue + [n for block in blocks for n in block]:
        env[node] = graph.node_copy(node, lambda n: env[n])
    before, template = blocks[t - 2], blocks[t - 1]
    previous = [env[n] for n in template]            # the last built layer's nodes, by template position
    before_index = {n: i for i, n in enumerate(before)}
    template_index = {n: i for i, n in enumerate(template)}
    for k in range(t, num_layers):
        built: list[torch.fx.Node] = []
        old, new = f"{layers_path}.{t - 1}.", f"{layers_path}.{k}."

        def remap(n: torch.fx.Node) -> torch.fx.Node:
            if n in template_index:
                return built[template_index[n]]
            if n in before_index:                      # the template read its predecessor: read the last copy
                return previous[before_index[n]]
            if n in layer_inputs[k]:
                return layer_inputs[k][n]
            return env[n]
        for node in template:
            copy = graph.node_copy(node, remap)
            copy.args, copy.kwargs = _rename(copy.args, old, new), _rename(copy.kwargs, old, new)
            built.append(copy)
        previous = built
    last = {n: previous[i] for i, n in enumerate(template)}
    for node in epilogue + [nodes[-1]]:
        env[node] = graph.node_copy(node, lambda n: last.get(n, env.get(n)))
    return torch.fx.GraphModule(gm, graph), new_specs


_PLAIN = (bool, int, float, str, type(None))


def layer_fingerprint(layer: torch.nn.Module, index: int, layers_path: str) -> tuple:
    """What a layer's traced code can depend on, its own name and index aside: each submodule's type, plain
    attributes (strings with the layer's own path made generic) and parameter and buffer shapes and dtypes."""
    own = f"{layers_path}.{index}."
    items = []
    for name, module in layer.named_modules():
        attrs = []
        for key, value in sorted(vars(module).items()):
            if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
                attrs.append((key, _rename(value, own, "<layer>.")))
        tensors = [(n, tuple(t.shape), str(t.dtype)) for n, t in
                   [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]]
        items.append((name, type(module).__qualname__, tuple(attrs), tuple(tensors)))
    return tuple(items)


def uniform_layers(layers: Sequence[torch.nn.Module], layers_path: str) -> str | None:
    """None when every layer has the fingerprint of the first non-first one (the first layer may differ only in
    the traced code, never in its modules); else the first layer that differs."""
    if len(layers) < 2:
        return None
    reference = layer_fingerprint(layers[1], 1, layers_path)
    for i, layer in enumerate(layers):
        if layer_fingerprint(layer, i, layers_path) != reference:
            return f"layer {i} differs from layer 1 in its modules or attributes"
    return None


class WithLayerInputs:
    """The stamped graph called with the traced (cut) model's inputs: the further layers' parameters go last. They
    are held weakly, as dynamo keeps this callable for the life of the process."""

    def __init__(self, fn, tensors: Sequence[torch.Tensor]):
        self.fn = fn
        self.refs = [weakref.ref(t) for t in tensors]

    def __call__(self, *args):
        extra = [ref() for ref in self.refs]
        if any(t is None for t in extra):
            raise RuntimeError("the model this compiled forward belonged to has been dropped")
        return self.fn(*args, *extra)


@dataclass
class StampPlan:
    """The model is traced cut to its first TRACED_LAYERS layers; the backend stamps the graph of all of them."""
    layers_path: str                     # the layer list's path in the model, e.g. "model.layers"
    num_layers: int
    tensors: dict[str, torch.Tensor]     # the full model's parameters and buffers by name


class StampFailed(Exception):
    """The cut model's graph could not be stamped out; the caller traces the whole model."""


def stamp_plan(model: torch.nn.Module) -> StampPlan | None:
    """How to trace only the first layers, where the model says its layers run the same code
    (`stamp_layers_path()`) and their modules agree; None to trace the whole model."""
    path_of = getattr(model, "stamp_layers_path", None)
    path = path_of() if callable(path_of) else None
    if not path:
        return None
    layers = model.get_submodule(path)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) <= TRACED_LAYERS:
        return None
    why = uniform_layers(layers, path)
    if why is not None:
        logger.info("tracing all %d layers: %s", len(layers), why)
        return None
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return StampPlan(path, len(layers), tensors)


@contextlib.contextmanager
def cut_layers(model: torch.nn.Module, plan: StampPlan) -> Iterator[None]:
    """`model` with only its first TRACED_LAYERS layers (the same modules) inside the block."""
    parent_path, _, attr = plan.layers_path.rpartition(".")
    parent = model.get_submodule(parent_path)
    layers = getattr(parent, attr)
    setattr(parent, attr, torch.nn.ModuleList(list(layers)[:TRACED_LAYERS]))
    try:
        yield
    finally:
        setattr(parent, attr, layers)


def stamped_graph(plan: StampPlan, gm: torch.fx.GraphModule, example_inputs: list,
                  describe_inputs: Callable[[torch.fx.GraphModule, list], list | str] | None) -> tuple:
    """The whole model's graph, example inputs (the cut graph's, then the further layers' tensors) and input specs
    from dynamo's graph of the cut model; StampFailed with the reason where it cannot be built."""
    specs = describe_inputs(gm, example_inputs) if describe_inputs is not None else "no input map"
    if not isinstance(specs, list):
        raise StampFailed(specs)
    stamped = stamp_layers(gm, specs, plan.layers_path, plan.num_layers)
    if isinstance(stamped, str):
        raise StampFailed(stamped)
    full, full_specs = stamped
    extra = [plan.tensors[spec[1]] for spec in full_specs[len(specs):]]
    return full, list(example_inputs) + extra, full_specs


def stamp_failure(exc: BaseException) -> str | None:
    """The reason of a StampFailed in `exc`'s chain (dynamo wraps what its backend raises), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, StampFailed):
            return str(exc)
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None
