"""Piecewise torch.compile: trace the forward once with a dynamic token count, split the FX graph at every
`ember::attention` call, compile each distinct piece between with Inductor, and run attention eagerly in between.
A piece left with nothing but ember's ops and views after the fusion passes runs as its aten graph instead, without
Inductor (ember.graphs.plain_pieces; `plain_pieces=False`, or the `plain_pieces` hook off, sends every piece to
Inductor).

API:
    resolve_compile_mode(compile_mode, device, enforce_eager=False) -> "none" | "default"
    compile_cache_key(model_config, dtype, *, device=None, settings=None) -> str     see ember.graphs.artifacts
    compile_model(model, compile_mode, *, cache_key=None, cache_root=None, graph_manager=None,
                  disabled_fusions=()) -> forward callable
    CompiledModel(model, ..., disabled_fusions=(), dedupe=True, donate_residuals=True)(input_ids [T], positions [T])
        -> hidden [T, H]   (donate_residuals=False: plain pieces' residual adds return new tensors, for A/B runs)
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
where the stamping cannot vouch for the result, or where the `layer_stamp` hook is off (ember.kernels.hooks:
`EMBER_HOOKS=layer_stamp=off`, or a torch it was not checked with), the whole model is traced.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ember.attention_backends.op  # noqa: F401  (registers torch.ops.ember.attention)
from ember.graphs.artifacts import ArtifactStore, InputSpec, LoadedForward, describe_graph_inputs
from ember.graphs.artifacts import compile_cache_dir, inductor_cache_scope  # noqa: F401  (part of this API)
from ember.graphs.artifacts import compile_cache_key  # noqa: F401  (part of this module's API)
from ember.graphs.layer_stamp import TRACED_LAYERS, cut_layers, stamp_failure, stamp_plan
from ember.graphs.piecewise import (CompileStats, PiecewiseBackend, install_pieces, split_names,  # noqa: F401
                                    is_attention_node, split_at_attention, uninstall_pieces)   # (part of this API)
from ember.graphs.specialization import TokenCountSpecialized
from ember.kernels import hooks
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
                 plain_pieces: bool = True, donate_residuals: bool = True):
        from ember.graphs.passes.registry import PASSES, check_pass_names, passes_digest
        plain_pieces = plain_pieces and hooks.enabled("plain_pieces")
        self.model = model
        self.stats = CompileStats()
        self.disabled_fusions = check_pass_names(disabled_fusions)
        self._fusion = None
        self._inductor_options = dict(inductor_options or {})
        passes = passes_digest(n for n in PASSES if n not in self.disabled_fusions).hex()[:8]
        # plain pieces (ember.graphs.plain_pieces) change what a cold start saves: an entry of their own
        key = (f"{cache_key or _model_fingerprint(model)}-{passes}{'-plain' if plain_pieces else ''}"
               f"{'' if donate_residuals else '-kept'}")
        self.cache_dir = compile_cache_dir(key, cache_root)
        self.stats.cache_dir = str(self.cache_dir)
        self.graph_manager = graph_manager
        self.store = ArtifactStore(self.cache_dir) if use_artifacts else None
        self._call_inputs: tuple[torch.Tensor, ...] = ()
        self._arity: int | None = None          # how many inputs the first call had; every call must have as many
        self.backend = PiecewiseBackend(self.stats, graph_manager, dedupe=dedupe, inductor_options=None,
                                        store=self.store, describe_inputs=self._describe_inputs,
                                        plain_pieces=plain_pieces, donate_residuals=donate_residuals)
        self.stamp_layers = hooks.enabled("layer_stamp")
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
        pieces, attention = split_names(graph.split)
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
        plain_store = self.store is not None and self.store.plain_only()
        if plain_store and self._load():
            # every piece is a plain FX graph: neither dynamo nor Inductor is imported
            return self._finish(inputs, start, {}, self._compiled(*inputs))
        from torch.fx.experimental import _config as shapes_config
        from torch._dynamo.utils import counters
        keys = [("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss")]
        before = {k: counters[g][k] for g, k in keys}
        with inductor_cache_scope(self.cache_dir):
            if not plain_store and self._load():     # (a plain store that failed to load is compiled again)
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
                except torch._dynamo.exc.BackendCompilerFailed as exc:
                    # the backend's own refusal (a token count the compile fixed) reads better unwrapped
                    if isinstance(exc.inner_exception, TokenCountSpecialized):
                        raise exc.inner_exception from None
                    raise
                except torch._dynamo.exc.Unsupported as exc:
                    # fullgraph: a graph break fails the trace; say where, and what to do meanwhile
                    where = str(exc).strip().splitlines()
                    raise ValueError(f"torch.compile cannot trace {type(self.model).__name__} as one graph (a graph "
                                     f"break: {where[0] if where else exc}); ember splits the forward only at "
                                     f"attention, so this is a bug to fix in the model code; run with "
                                     f"enforce_eager=True (compile_mode='none') meanwhile") from exc
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
            logger.info("compiled the model (one dynamo graph, no graph breaks) into %d pieces (%d distinct) "
                        "around %d attention calls in %.1f s "
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
