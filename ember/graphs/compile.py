"""Piecewise torch.compile: trace the forward once with a dynamic token count, split the FX graph at every
`ember::attention` call, compile each distinct piece between with Inductor, and run attention eagerly in between.
A piece left with nothing but ember's ops and views after the fusion passes runs as its aten graph instead, without
Inductor (ember.graphs.plain_pieces; `plain_pieces=False` sends every piece to Inductor).

API:
    resolve_compile_mode(compile_mode, device, enforce_eager=False) -> "none" | "default"
    compile_cache_key(model_config, dtype, *, device=None, settings=None) -> str     see ember.graphs.artifacts
    compile_model(model, compile_mode, *, cache_key=None, cache_root=None, graph_manager=None,
                  disabled_fusions=()) -> forward callable
    CompiledModel(model, ..., disabled_fusions=(), dedupe=True)(input_ids [T], positions [T]) -> hidden [T, H]
        (input_ids, positions, logits_indices [N]) -> hidden [N, H] for a model whose tail runs on those tokens
        .stats -> CompileStats;  .split_module -> the split torch.fx.GraphModule, traced or loaded (after 1st call)
        .fusion -> the fusion passes (ember.graphs.passes) Inductor runs on each distinct piece, with their match
                   counts (zero on a warm start: loaded pieces are not passed through again)

Compile each distinct piece once. The pieces between the attention calls of identical layers are one program with
other parameters: pieces are grouped by `piece_dedupe.piece_signature` (graph + input metadata), one piece per
group is compiled, and the others call its code with their own inputs ("29 pieces, 3 distinct" for Qwen3-0.6B).

Cold and warm starts. The first call, which must have at least 2 tokens (dynamo specialises sizes 0 and 1), looks
for saved artifacts under `cache_root/compile/<cache_key>` (default root: `ember.config.cache_dir()`). With none,
dynamo traces the forward, the backend compiles each distinct piece through `torch._inductor.standalone_compile`
and saves the split graph and the artifacts (`ember.graphs.artifacts`). With them, the split graph and its pieces
are loaded and called directly: no dynamo trace, no Inductor lowering. The directory name adds the enabled fusion
passes to `cache_key`, so turning a pass off never loads code compiled with it. Every later call, whatever its token count,
reuses that one graph: the compiled frame keeps no guards (the model, its parameters and the grad mode are fixed
for an inference engine), so call it under torch.inference_mode() consistently, and always with the same inputs.
A third input, `logits_indices`, is traced with a dynamic size of its own (the row count of a prefill-skipping
tail, which changes inside the forward); that trace gives each input size its own symbol even where two are equal
at the first call (no duck sizing), since a guard that ties them would be dropped with the others.
With a `graph_manager` (ember.graphs.cuda_graph), each compiled piece is wrapped for PIECEWISE CUDA graphs.

A model whose `stamp_layers_path()` names its decoder layer list is traced cut to its first TRACED_LAYERS layers,
and the backend stamps the whole graph out of that trace (ember.graphs.layer_stamp), a fraction of the trace time;
where the stamping cannot vouch for the result, or with EMBER_STAMP_LAYERS=0, the whole model is traced.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ember.attention_backends.op  # noqa: F401  (registers torch.ops.ember.attention)
from ember.graphs.artifacts import ArtifactStore, InputSpec, LoadedForward, describe_graph_inputs
from ember.graphs.artifacts import compile_cache_dir, inductor_cache_scope  # noqa: F401  (part of this API)
from ember.graphs.artifacts import compile_cache_key  # noqa: F401  (part of this module's API)
from ember.graphs.layer_stamp import (TRACED_LAYERS, StampPlan, WithLayerInputs, cut_layers, stamp_failure,
                                      stamp_plan, stamped_graph)
from ember.graphs.piece_dedupe import piece_signature
from ember.kernels.triton_key import pin_cache_dir

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
    """What the (last) compile or artifact load did."""
    num_graphs: int = 0                  # dynamo graphs handed to the backend: 1 unless something recompiled
    num_pieces: int = 0                  # compiled pieces (n_attention_layers + 1 for a decoder)
    num_distinct: int = 0                # pieces actually compiled (or loaded): one per group of equal pieces
    num_attention_splits: int = 0
    seconds: float = 0.0                 # first call: trace + compile (or artifact load) + one run
    backend_seconds: float = 0.0         # the Inductor part of a cold start
    artifacts_loaded: int = 0            # distinct pieces a warm start loaded instead of tracing
    artifacts_saved: int = 0             # distinct pieces a cold start saved
    traced_layers: int = 0               # decoder layers dynamo traced when the others were stamped (0: all traced)
    cache_counters: dict[str, int] = field(default_factory=dict)   # fxgraph / autograd cache hits and misses
    cache_dir: str = ""

    @property
    def fxgraph_cache_hits(self) -> int:
        return self.cache_counters.get("fxgraph_cache_hit", 0)


def install_pieces(split: torch.fx.GraphModule, pieces: Sequence[str], attention: Sequence[str],
                   compiled: Mapping[str, Callable], graph_manager: Any = None) -> None:
    """Make `split` call the compiled code of each piece (wrapped for PIECEWISE graphs when a manager is given)."""
    for i, name in enumerate(pieces):
        fn = compiled[name]
        if graph_manager is not None:
            fn = graph_manager.wrap_piece(fn, f"piece {i}/{len(pieces)}")
        # an instance attribute shadows the registered submodule, so the split graph's code calls `fn`
        split.__dict__[name] = fn
    for name in attention:
        split.__dict__[name] = getattr(split, name).forward   # skip nn.Module call overhead


def uninstall_pieces(split: torch.fx.GraphModule) -> None:
    """Undo `install_pieces`: drop the compiled code (and any PIECEWISE graphs) `split` calls."""
    for node in split.graph.nodes:
        if node.op == "call_module":
            split.__dict__.pop(node.target, None)


def _split_names(split: torch.fx.GraphModule) -> tuple[list[str], list[str]]:
    """Names of the split graph's pieces and attention submodules, in call order (attention holds the op)."""
    pieces, attention = [], []
    for node in split.graph.nodes:
        if node.op == "call_module":
            sub = getattr(split, node.target)
            is_attention = isinstance(sub, torch.fx.GraphModule) and any(is_attention_node(n) for n in sub.graph.nodes)
            (attention if is_attention else pieces).append(node.target)
    return pieces, attention


class PiecewiseBackend:
    """A torch.compile backend: split at attention, compile each distinct piece with Inductor for the dynamic token
    count, and save the result to `store` when given. With a `stamp` plan, the graph it is handed is the cut
    model's, and it compiles the full model's graph stamped from it (ember.graphs.layer_stamp)."""

    def __init__(self, stats: CompileStats, graph_manager: Any = None, *, dedupe: bool = True,
                 inductor_options: Mapping[str, Any] | None = None, store: ArtifactStore | None = None,
                 describe_inputs: Callable[[torch.fx.GraphModule, list], list[InputSpec] | str] | None = None,
                 plain_pieces: bool = False):
        self.stats = stats
        self.plain_pieces = plain_pieces
        self.graph_manager = graph_manager
        self.dedupe = dedupe
        self.inductor_options = dict(inductor_options or {})
        self.store = store
        self.describe_inputs = describe_inputs
        self.split_module: torch.fx.GraphModule | None = None   # the last split, kept for inspection
        self.stamp: StampPlan | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._guards import detect_fake_mode
        start = time.perf_counter()
        specs = None
        num_cut_inputs = len(example_inputs)
        if self.stamp is not None:
            gm, example_inputs, specs = stamped_graph(self.stamp, gm, example_inputs, self.describe_inputs)
        split, pieces, attention = split_at_attention(gm)
        fake_mode = detect_fake_mode(example_inputs)
        # dynamo hands real tensors for parameters; the fake mode's memo maps them (and the marked-dynamic inputs)
        # to the fakes it traced with, so the pieces see the same symbolic token count. The stamped layers'
        # parameters, which dynamo never saw, get static shapes like the traced ones (not symbols of their own)
        fake_args = [fake_mode.from_tensor(a, static_shapes=i >= num_cut_inputs) if isinstance(a, torch.Tensor)
                     else a for i, a in enumerate(example_inputs)]
        compiler = _PieceCompiler(split, pieces, self.dedupe, self.inductor_options, self.plain_pieces)
        compiled = compiler.compile(fake_mode, fake_args)
        seconds = time.perf_counter() - start
        if self.store is not None:
            self._save(gm, split, pieces, compiler, example_inputs, specs)
        install_pieces(split, pieces, attention, compiled, self.graph_manager)
        self.stats.num_graphs += 1
        self.stats.num_pieces += len(pieces)
        self.stats.num_distinct += len(compiler.artifacts)
        self.stats.num_attention_splits += len(attention)
        self.stats.backend_seconds += seconds
        self.split_module = split
        logger.info("%d pieces, %d distinct (%d as plain FX graphs, %d by Inductor), compiled in %.1f s", len(pieces),
                    len(compiler.artifacts), compiler.num_plain, len(compiler.artifacts) - compiler.num_plain, seconds)
        if specs is not None:   # dynamo calls this with the cut model's inputs; the further layers' go last
            return WithLayerInputs(split, example_inputs[num_cut_inputs:])
        return split

    def _save(self, gm, split, pieces, compiler: "_PieceCompiler", example_inputs: list, specs=None) -> None:
        why = specs if specs is not None else \
            self.describe_inputs(gm, example_inputs) if self.describe_inputs is not None else "no input map"
        if isinstance(why, list) and not all(_is_saveable(a) for a in compiler.artifacts):
            why = "Inductor produced no saveable artifact for some piece"
        if not isinstance(why, list):
            logger.warning("compiled artifacts not saved (%s); the next start compiles again", why)
            return
        try:
            self.store.save(split, pieces, [compiler.groups[name] for name in pieces], compiler.artifacts,
                            compiler.single_output, why)
        except Exception as exc:   # a full disk or an unpicklable graph costs the next start a compile, no more
            logger.warning("saving compiled artifacts to %s failed (%s: %s); the next start compiles again",
                           self.store.directory, type(exc).__name__, exc)
            return
        self.stats.artifacts_saved = len(compiler.artifacts)


def _is_saveable(artifact: Any) -> bool:
    check = getattr(artifact, "is_saveable", None)
    return check() if check is not None else hasattr(artifact, "save")


class _PieceCompiler(torch.fx.Interpreter):
    """Runs the split module on fake inputs so each piece is compiled with its own (symbolic) example inputs;
    a piece whose signature was already compiled reuses that code, and its fake run too: the same graph on inputs of
    the same metadata gives outputs of the same metadata, which is all the fake run is for (a deep model's middle
    pieces are most of its nodes, at about a millisecond a node)."""

    def __init__(self, split: torch.fx.GraphModule, pieces: Sequence[str], dedupe: bool,
                 inductor_options: Mapping[str, Any], plain_pieces: bool = False):
        super().__init__(split)
        self.pieces = set(pieces)
        self.dedupe = dedupe
        self.inductor_options = inductor_options
        self.plain_pieces = plain_pieces
        self.num_plain = 0
        self.compiled: dict[str, Callable] = {}
        self.groups: dict[str, int] = {}          # piece name -> group index
        self.artifacts: list[Any] = []            # group index -> compiled code
        self.single_output: list[bool] = []       # group index -> the piece returns one value, not a tuple
        self._by_signature: dict[str, int] = {}
        self._outputs: list[Any] = []             # group index -> the fake outputs of its first piece

    def compile(self, fake_mode, fake_args: list) -> dict[str, Callable]:
        with fake_mode:
            self.run(*fake_args)
        return self.compiled

    def call_module(self, target, args, kwargs):
        if target not in self.pieces:
            return super().call_module(target, args, kwargs)
        piece = self.fetch_attr(target)
        signature = piece_signature(piece, args) if self.dedupe else target
        group = self._by_signature.get(signature)
        if group is None:
            out = super().call_module(target, args, kwargs)
            group = self._by_signature[signature] = len(self.artifacts)
            self.artifacts.append(self._compile(piece, list(args)))
            self.single_output.append(isinstance(piece.graph.output_node().args[0], torch.fx.Node))
            self._outputs.append(out)
        self.groups[target] = group
        self.compiled[target] = self.artifacts[group]
        return self._outputs[group]


    def _compile(self, piece: torch.fx.GraphModule, args: list) -> Callable:
        """The piece as a plain FX graph where nothing is left in it for Inductor (ember.graphs.plain_pieces), else
        Inductor's code; the fusion passes' counts go to the pipeline either way."""
        fusion = self.inductor_options.get("post_grad_custom_post_pass")
        if self.plain_pieces:
            from ember.graphs.plain_pieces import plain_piece
            try:
                plain, counts = plain_piece(piece, args, getattr(fusion, "disabled", ()))
            except Exception as exc:   # a piece the plain trace cannot take is Inductor's, as it always was
                logger.info("a piece goes to Inductor: its plain trace failed (%s: %s)", type(exc).__name__, exc)
                plain, counts = None, {}
            if plain is not None:
                self.num_plain += 1
                if fusion is not None:
                    fusion.num_graphs += 1
                    for name, found in counts.items():
                        fusion.counts[name] += found
                return plain
        return _compile_piece(piece, args, self.inductor_options)


def _compile_piece(piece: torch.fx.GraphModule, args: list, inductor_options: Mapping[str, Any]) -> Callable:
    """Inductor's code for one piece, as a saveable artifact where this torch has standalone_compile."""
    options = {"config_patches": dict(inductor_options)} if inductor_options else {}
    try:
        from torch._inductor import standalone_compile
    except ImportError:
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(piece, args, **options)
    return standalone_compile(piece, args, dynamic_shapes="from_tracing_context", options=options)


def _private_forward(model: nn.Module) -> Callable:
    """`model(*inputs)` behind a code object of its own: dynamo caches compiled frames per code object, and since
    this frame keeps no guards, a shared code object could hand one model's graph to another."""
    def forward(*inputs: torch.Tensor) -> torch.Tensor:
        return model(*inputs)
    forward.__code__ = forward.__code__.replace()
    return forward


class CompiledModel:
    """The model's forward, piecewise-compiled (or loaded from saved artifacts) on the first call; see the module
    docstring."""

    def __init__(self, model: nn.Module, *, cache_key: str | None = None, cache_root: Path | str | None = None,
                 graph_manager: Any = None, disabled_fusions: tuple[str, ...] = (), dedupe: bool = True,
                 inductor_options: Mapping[str, Any] | None = None, use_artifacts: bool = True,
                 plain_pieces: bool = True):
        from ember.graphs.passes.registry import PASSES, check_pass_names, passes_digest
        self.model = model
        self.stats = CompileStats()
        self.disabled_fusions = check_pass_names(disabled_fusions)
        self._fusion = None
        self._inductor_options = dict(inductor_options or {})
        passes = passes_digest(n for n in PASSES if n not in self.disabled_fusions).hex()[:8]
        # plain pieces (ember.graphs.plain_pieces) change what a cold start saves: an entry of their own
        key = f"{cache_key or _model_fingerprint(model)}-{passes}{'-plain' if plain_pieces else ''}"
        self.cache_dir = compile_cache_dir(key, cache_root)
        self.stats.cache_dir = str(self.cache_dir)
        self.graph_manager = graph_manager
        self.store = ArtifactStore(self.cache_dir) if use_artifacts else None
        self._call_inputs: tuple[torch.Tensor, ...] = ()
        self._arity: int | None = None          # how many inputs the first call had; every call must have as many
        self.backend = PiecewiseBackend(self.stats, graph_manager, dedupe=dedupe, inductor_options=None,
                                        store=self.store, describe_inputs=self._describe_inputs,
                                        plain_pieces=plain_pieces)
        self.stamp_layers = os.environ.get("EMBER_STAMP_LAYERS", "1") != "0"
        self._compiled: Callable | None = None   # the dynamo frame, made when a trace is needed (not on a load)
        self.split_module: torch.fx.GraphModule | None = None
        self._ready = False

    @property
    def fusion(self):
        """The fusion passes with their match counts (ember.graphs.passes.pipeline; made when first needed, since
        it imports Inductor, which a start from plain pieces never does)."""
        if self._fusion is None:
            from ember.graphs.passes.pipeline import FusionPipeline
            self._fusion = FusionPipeline(self.disabled_fusions)
            # Inductor runs the fusion passes (ember.graphs.passes) on each piece's post-grad graph
            self.backend.inductor_options = {"post_grad_custom_post_pass": self._fusion, **self._inductor_options}
        return self._fusion

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        inputs = (input_ids, positions) if logits_indices is None else (input_ids, positions, logits_indices)
        if self._ready:
            if len(inputs) != self._arity:
                raise ValueError(f"this compiled model was traced with {self._arity} inputs and is called with "
                                 f"{len(inputs)}; logits_indices must be given on every call or on none")
            return self._compiled(*inputs)
        return self._first_call(inputs)

    def _new_frame(self) -> Callable:
        return torch.compile(_private_forward(self.model), backend=_WeakBackend(self.backend), fullgraph=True,
                             options={"guard_filter_fn": _keep_no_guards})

    def _trace(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The first call through dynamo: of the model cut to its first TRACED_LAYERS layers, the backend stamping
        out the others (ember.graphs.layer_stamp), where the model allows; else (or if stamping fails) of the whole
        model."""
        plan = stamp_plan(self.model) if self.stamp_layers else None
        self._compiled = self._new_frame()
        if plan is None:
            return self._compiled(*inputs)
        self.backend.stamp = plan
        try:
            with cut_layers(self.model, plan):
                out = self._compiled(*inputs)
            self.stats.traced_layers = TRACED_LAYERS
            return out
        except Exception as exc:
            reason = stamp_failure(exc)
            if reason is None:
                raise
            logger.info("tracing all %d layers: the traced ones could not be stamped out (%s)", plan.num_layers,
                        reason)
        finally:
            self.backend.stamp = None
        self._compiled = self._new_frame()   # the failed frame belongs to the cut model
        return self._compiled(*inputs)

    def _describe_inputs(self, gm: torch.fx.GraphModule, example_inputs: list) -> list[InputSpec] | str:
        return describe_graph_inputs(self.model, self._call_inputs, gm, example_inputs)

    def _load(self) -> bool:
        """Switch to saved artifacts if there are usable ones."""
        graph = self.store.load() if self.store is not None else None
        if graph is None:
            return False
        try:
            forward = LoadedForward(self.model, graph)
        except ValueError as exc:
            logger.warning("compiled artifacts in %s do not fit this model (%s); compiling again", self.cache_dir, exc)
            return False
        pieces, attention = _split_names(graph.split)
        install_pieces(graph.split, pieces, attention, graph.pieces, self.graph_manager)
        self._compiled, self.split_module = forward, graph.split
        self.stats.num_pieces, self.stats.num_distinct = len(pieces), graph.num_groups
        self.stats.num_attention_splits, self.stats.artifacts_loaded = len(attention), graph.num_groups
        return True

    def _first_call(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        num_tokens = inputs[0].shape[0]
        if num_tokens < 2:
            raise ValueError(f"the first call of a compiled model compiles it and needs at least 2 tokens, got "
                             f"{num_tokens}; warm up with a larger batch (e.g. max_num_batched_tokens)")
        if len(inputs) > 2 and inputs[2].shape[0] < 2:
            raise ValueError(f"the first call of a compiled model compiles it and needs at least 2 logits_indices, "
                             f"got {inputs[2].shape[0]}; warm up with more requests")
        start = time.perf_counter()
        pin_cache_dir()    # Triton's cache folder stays where it is, whether or not Inductor comes in
        if self.store is not None and self.store.plain_only() and self._load():
            # every piece is a plain FX graph: neither dynamo nor Inductor is imported
            return self._finish(inputs, start, {}, self._compiled(*inputs))
        from torch.fx.experimental import _config as shapes_config
        from torch._dynamo.utils import counters
        keys = [("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss")]
        before = {k: counters[g][k] for g, k in keys}
        with inductor_cache_scope(self.cache_dir):
            if self._load():
                out = self._compiled(*inputs)
            else:
                torch._dynamo.mark_dynamic(inputs[0], 0)
                torch._dynamo.mark_dynamic(inputs[1], inputs[1].dim() - 1)
                for extra in inputs[2:]:
                    torch._dynamo.mark_dynamic(extra, 0)
                self._call_inputs = inputs
                self.fusion   # noqa: B018  (made now: the backend hands it to Inductor)
                try:
                    # the tail's row count must keep a symbol of its own even where it equals the token count
                    with shapes_config.patch(use_duck_shape=len(inputs) == 2):
                        out = self._trace(inputs)
                finally:
                    self._call_inputs = ()
                self.split_module = self.backend.split_module
                if self.split_module is not None:
                    # dynamo keeps the traced split module as a global of this module for the life of the process;
                    # what it calls (compiled pieces, their PIECEWISE graphs) goes when this compiled model does
                    weakref.finalize(self, uninstall_pieces, self.split_module)
        return self._finish(inputs, start, {k: counters[g][k] - before[k] for g, k in keys}, out)

    def _finish(self, inputs: tuple, start: float, cache_counters: dict, out: torch.Tensor | None = None):
        self.stats.seconds = time.perf_counter() - start
        self._arity = len(inputs)
        self.stats.cache_counters = cache_counters
        self._ready = True
        s, c = self.stats, self.stats.cache_counters
        if s.artifacts_loaded:
            logger.info("%d pieces, %d distinct, loaded from compiled artifacts in %.2f s (no trace); cache %s",
                        s.num_pieces, s.num_distinct, s.seconds, self.cache_dir)
        else:
            logger.info("compiled the model into %d pieces (%d distinct) around %d attention calls in %.1f s "
                        "(pieces %.1f s); FX graph cache %d hit / %d miss, AOT autograd cache %d hit / %d miss; "
                        "%d artifacts saved to %s", s.num_pieces, s.num_distinct, s.num_attention_splits, s.seconds,
                        s.backend_seconds, c["fxgraph_cache_hit"], c["fxgraph_cache_miss"], c["autograd_cache_hit"],
                        c["autograd_cache_miss"], s.artifacts_saved, self.cache_dir)
            if s.traced_layers:
                logger.info("dynamo traced the first %d decoder layers; the others were stamped from them",
                            s.traced_layers)
            logger.info("%s", self.fusion.summary(c["fxgraph_cache_hit"]))
        return out


class _WeakBackend:
    """The backend as torch.compile keeps it. torch._dynamo holds every backend it is handed in a process-wide
    table for good (`eval_frame.cached_backends`), so what it holds must not keep the compiled model, and through
    it the model's weights, alive once the engine is dropped. (dynamo also keeps the traced split module, as a
    global of this module; CompiledModel empties it of the compiled pieces when it goes.)"""

    def __init__(self, backend: PiecewiseBackend):
        self._backend = weakref.ref(backend)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        backend = self._backend()
        if backend is None:
            raise RuntimeError("the compiled model this forward belonged to has been dropped")
        return backend(gm, example_inputs)


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
