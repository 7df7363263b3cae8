"""Piecewise torch.compile: trace the forward once with a dynamic token count, split the FX graph at every
`ember::attention` call, compile each piece between with Inductor, and run attention eagerly in between.

API:
    resolve_compile_mode(compile_mode, device, enforce_eager=False) -> "none" | "default"
    compile_cache_key(model_config, dtype) -> str            hash of config JSON, dtype, ember and torch versions
    compile_model(model, compile_mode, *, cache_key=None, cache_root=None, graph_manager=None,
                  disabled_fusions=()) -> forward callable
    CompiledModel(model, ...)(input_ids [T], positions [T]) -> hidden [T, H]
        .stats -> CompileStats;  .backend.split_module -> the split torch.fx.GraphModule (after the first call)
        .fusion -> the fusion passes (ember.graphs.passes) Inductor runs on each piece, with their match counts

Compilation happens on the first call, which must have at least 2 tokens (dynamo specialises sizes 0 and 1).
Every later call, whatever its token count, reuses that one graph: the compiled frame keeps no guards (the model,
its parameters and the grad mode are fixed for an inference engine), so call it under torch.inference_mode()
consistently. Inductor's FX-graph and AOT-autograd caches live under `cache_root/compile/<cache_key>` (default
root: `ember.config.cache_dir()`), so a second start of the same model mostly loads compiled code.
With a `graph_manager` (ember.graphs.cuda_graph), each compiled piece is wrapped for PIECEWISE CUDA graphs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ember.attention_backends.op  # noqa: F401  (registers torch.ops.ember.attention)

logger = logging.getLogger("ember")

COMPILE_MODES = ("auto", "none", "default")


def resolve_compile_mode(compile_mode: str, device: torch.device | str, enforce_eager: bool = False) -> str:
    """"none" or "default": "auto" compiles on CUDA only (on a CPU the Inductor C++ build costs more than it saves)."""
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode {compile_mode!r} is not known; use one of {list(COMPILE_MODES)}")
    if enforce_eager:
        return "none"
    if compile_mode == "auto":
        return "default" if torch.device(device).type == "cuda" else "none"
    return compile_mode


def compile_cache_key(model_config: Mapping[str, Any] | str | Any, dtype: torch.dtype | str) -> str:
    """A short hash naming the compile cache of one model build: its config (a dict, a JSON string, or an object
    with `to_dict()` such as a transformers config), dtype, ember and torch versions."""
    from ember import __version__ as ember_version
    if hasattr(model_config, "to_dict"):
        model_config = model_config.to_dict()
    text = model_config if isinstance(model_config, str) else json.dumps(model_config, sort_keys=True, default=str)
    blob = json.dumps([text, str(dtype), ember_version, torch.__version__])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def compile_cache_dir(cache_key: str, cache_root: Path | str | None = None) -> Path:
    """Where Inductor keeps this model's compiled code: <root>/compile/<key>."""
    if cache_root is None:
        from ember.config import cache_dir
        cache_root = cache_dir()
    return Path(cache_root) / "compile" / cache_key


@contextlib.contextmanager
def inductor_cache_scope(path: Path) -> Iterator[None]:
    """Point Inductor's on-disk caches at `path` (and turn them on) for the duration of a compile."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    path.mkdir(parents=True, exist_ok=True)
    # Inductor reads its cache location from this variable each time it needs it; there is no config option
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    try:
        with inductor_config.patch(fx_graph_cache=True), functorch_config.patch(enable_autograd_cache=True):
            yield
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def is_attention_node(node: torch.fx.Node) -> bool:
    """Whether an FX node calls `ember::attention` (as dynamo records it, or functionalized)."""
    if node.op != "call_function":
        return False
    op = torch.ops.ember.attention
    if node.target in (op, op.default):
        return True
    auto_functionalized = getattr(torch.ops.higher_order, "auto_functionalized", None)
    return auto_functionalized is not None and node.target is auto_functionalized and node.args[0] is op.default


def split_at_attention(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str], list[str]]:
    """Split `gm` so each attention call is a submodule of its own.

    Returns the split module and the names of its compute pieces and attention submodules, in execution order.
    """
    from torch.fx.passes.split_module import split_module
    partition: dict[torch.fx.Node, int] = {}
    current = 0
    attention_parts: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_attention_node(node):
            current += 1
            partition[node] = current
            attention_parts.add(current)
            current += 1
        else:
            partition[node] = current
    split = split_module(gm, None, lambda node: partition[node], keep_original_order=True)
    pieces, attention = [], []
    for node in split.graph.nodes:
        if node.op == "call_module":
            index = int(node.target.rsplit("_", 1)[1])
            (attention if index in attention_parts else pieces).append(node.target)
    return split, pieces, attention


@dataclass
class CompileStats:
    """What the (last) compile did."""
    num_graphs: int = 0                  # dynamo graphs handed to the backend: 1 unless something recompiled
    num_pieces: int = 0                  # Inductor-compiled pieces (n_attention_layers + 1 for a decoder)
    num_attention_splits: int = 0
    seconds: float = 0.0                 # first call: dynamo trace + Inductor (or cache load) + one run
    backend_seconds: float = 0.0         # the Inductor part
    cache_counters: dict[str, int] = field(default_factory=dict)   # fxgraph / autograd cache hits and misses
    cache_dir: str = ""

    @property
    def fxgraph_cache_hits(self) -> int:
        return self.cache_counters.get("fxgraph_cache_hit", 0)


class PiecewiseBackend:
    """A torch.compile backend: split at attention, compile each piece with Inductor for the dynamic token count."""

    def __init__(self, stats: CompileStats, graph_manager: Any = None, fusion: Any = None):
        self.stats = stats
        self.graph_manager = graph_manager
        # Inductor runs the fusion passes (ember.graphs.passes) on each piece's post-grad graph
        self.config_patches = {"post_grad_custom_post_pass": fusion} if fusion is not None else {}
        self.split_module: torch.fx.GraphModule | None = None   # the last split, kept for inspection

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._guards import detect_fake_mode
        start = time.perf_counter()
        split, pieces, attention = split_at_attention(gm)
        fake_mode = detect_fake_mode(example_inputs)
        # dynamo hands real tensors for parameters; the fake mode's memo maps them (and the marked-dynamic inputs)
        # to the fakes it traced with, so the pieces see the same symbolic token count
        fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_inputs]
        compiled = _PieceCompiler(split, set(pieces), self.config_patches).compile(fake_mode, fake_args)
        for i, name in enumerate(pieces):
            fn = compiled[name]
            if self.graph_manager is not None:
                fn = self.graph_manager.wrap_piece(fn, f"piece {i}/{len(pieces)}")
            # an instance attribute shadows the registered submodule, so the split graph's code calls `fn`
            split.__dict__[name] = fn
        for name in attention:
            split.__dict__[name] = getattr(split, name).forward   # skip nn.Module call overhead
        self.stats.num_graphs += 1
        self.stats.num_pieces += len(pieces)
        self.stats.num_attention_splits += len(attention)
        self.stats.backend_seconds += time.perf_counter() - start
        self.split_module = split
        return split


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split module on fake inputs so each piece is compiled with its own (symbolic) example inputs."""

    def __init__(self, split: torch.fx.GraphModule, pieces: set[str], config_patches: dict | None = None):
        super().__init__(split)
        self.pieces = pieces
        self.config_patches = config_patches or {}
        self.compiled: dict[str, Callable] = {}

    def compile(self, fake_mode, fake_args: list) -> dict[str, Callable]:
        with fake_mode:
            self.run(*fake_args)
        return self.compiled

    def call_module(self, target, args, kwargs):
        out = super().call_module(target, args, kwargs)
        if target in self.pieces:
            from torch._inductor.compile_fx import compile_fx
            self.compiled[target] = compile_fx(self.fetch_attr(target), list(args),
                                               config_patches=self.config_patches)
        return out


def _private_forward(model: nn.Module) -> Callable:
    """`model(input_ids, positions)` behind a code object of its own: dynamo caches compiled frames per code object,
    and since this frame keeps no guards, a shared code object could hand one model's graph to another."""
    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(input_ids, positions)
    forward.__code__ = forward.__code__.replace()
    return forward


class CompiledModel:
    """The model's forward, piecewise-compiled on the first call (see the module docstring)."""

    def __init__(self, model: nn.Module, *, cache_key: str | None = None, cache_root: Path | str | None = None,
                 graph_manager: Any = None, disabled_fusions: tuple[str, ...] = ()):
        from ember.graphs.passes.pipeline import FusionPipeline
        self.model = model
        self.stats = CompileStats()
        self.cache_dir = compile_cache_dir(cache_key or _model_fingerprint(model), cache_root)
        self.stats.cache_dir = str(self.cache_dir)
        self.fusion = FusionPipeline(disabled_fusions)
        self.backend = PiecewiseBackend(self.stats, graph_manager, self.fusion)
        self._compiled = torch.compile(_private_forward(model), backend=self.backend, fullgraph=True,
                                       options={"guard_filter_fn": _keep_no_guards})
        self._ready = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._ready:
            return self._compiled(input_ids, positions)
        return self._first_call(input_ids, positions)

    def _first_call(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        if num_tokens < 2:
            raise ValueError(f"the first call of a compiled model compiles it and needs at least 2 tokens, got "
                             f"{num_tokens}; warm up with a larger batch (e.g. max_num_batched_tokens)")
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, positions.dim() - 1)
        from torch._dynamo.utils import counters
        keys = [("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss")]
        before = {k: counters[g][k] for g, k in keys}
        start = time.perf_counter()
        with inductor_cache_scope(self.cache_dir):
            out = self._compiled(input_ids, positions)
        self.stats.seconds = time.perf_counter() - start
        self.stats.cache_counters = {k: counters[g][k] - before[k] for g, k in keys}
        self._ready = True
        c = self.stats.cache_counters
        logger.info("compiled the model into %d pieces around %d attention calls in %.1f s (Inductor %.1f s); "
                    "FX graph cache %d hit / %d miss, AOT autograd cache %d hit / %d miss; cache %s",
                    self.stats.num_pieces, self.stats.num_attention_splits, self.stats.seconds,
                    self.stats.backend_seconds, c["fxgraph_cache_hit"], c["fxgraph_cache_miss"],
                    c["autograd_cache_hit"], c["autograd_cache_miss"], self.cache_dir)
        logger.info("%s", self.fusion.summary())
        return out


def _keep_no_guards(guards) -> list[bool]:
    return [False] * len(guards)


def _model_fingerprint(model: nn.Module) -> str:
    """A fallback cache key from the module structure and parameter shapes/dtypes (no weights are hashed)."""
    params = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    return compile_cache_key({"repr": repr(model), "params": params}, "")


def compile_model(model: nn.Module, compile_mode: str = "default", *, cache_key: str | None = None,
                  cache_root: Path | str | None = None, graph_manager: Any = None,
                  disabled_fusions: tuple[str, ...] = ()) -> Callable:
    """The forward the runner calls: `model` itself for compile_mode "none", else a `CompiledModel`."""
    if compile_mode == "none":
        return model
    if compile_mode != "default":
        raise ValueError(f"compile_mode {compile_mode!r} is not known here; resolve it first "
                         f"(resolve_compile_mode) to 'none' or 'default'")
    return CompiledModel(model, cache_key=cache_key, cache_root=cache_root, graph_manager=graph_manager,
                         disabled_fusions=disabled_fusions)
