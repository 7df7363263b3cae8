"""The piecewise backend: the FX graph dynamo traced, split at every `ember::attention` call, and each distinct piece
between compiled once (by Inductor, or kept as its plain aten graph: ember.graphs.plain_pieces), the result saved to
the artifact store. ember.graphs.compile drives it from the model's first call."""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import ember.attention_backends.op  # noqa: F401  (registers torch.ops.ember.attention)
from ember.graphs.artifacts import ArtifactStore, InputSpec
from ember.graphs.layer_stamp import StampPlan, WithLayerInputs, stamped_graph
from ember.graphs.piece_dedupe import piece_signature
from ember.graphs.specialization import check_not_specialized

logger = logging.getLogger("ember")


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


def split_names(split: torch.fx.GraphModule) -> tuple[list[str], list[str]]:
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
                 plain_pieces: bool = False, donate_residuals: bool = True):
        self.stats = stats
        self.plain_pieces = plain_pieces
        self.donate_residuals = donate_residuals
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
        # the token count must still be a symbol after the trace and after each piece (ember.graphs.specialization)
        check_not_specialized(fake_mode.shape_env, "dynamo's trace of the model")
        compiler = _PieceCompiler(split, pieces, self.dedupe, self.inductor_options, self.plain_pieces,
                                  self.donate_residuals)
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
                 inductor_options: Mapping[str, Any], plain_pieces: bool = False, donate: bool = True):
        super().__init__(split)
        self.donate = donate
        self.fake_mode = None
        self.pieces = set(pieces)
        self.dedupe = dedupe
        self.inductor_options = inductor_options
        self.plain_pieces = plain_pieces
        self.num_plain = 0
        self.compiled: dict[str, Callable] = {}
        self.groups: dict[str, int] = {}          # piece name -> group index
        self.artifacts: list[Any] = []            # group index -> compiled code
        self.single_output: list[bool] = []       # group index -> the piece returns one value, not a tuple
        self.fresh: list[frozenset[int]] = []     # group index -> outputs a later piece may write over
        self._by_signature: dict[str, int] = {}
        self._outputs: list[Any] = []             # group index -> the fake outputs of its first piece
        self._node: torch.fx.Node | None = None   # the split graph's node being run

    def compile(self, fake_mode, fake_args: list) -> dict[str, Callable]:
        self.fake_mode = fake_mode
        with fake_mode:
            self.run(*fake_args)
        return self.compiled

    def run_node(self, n: torch.fx.Node) -> Any:
        self._node = n
        return super().run_node(n)

    def call_module(self, target, args, kwargs):
        if target not in self.pieces:
            return super().call_module(target, args, kwargs)
        piece = self.fetch_attr(target)
        donated = self._donated(self._node) if self.plain_pieces and self.donate else frozenset()
        signature = f"{piece_signature(piece, args)}:{sorted(donated)}" if self.dedupe else target
        group = self._by_signature.get(signature)
        if group is None:
            out = super().call_module(target, args, kwargs)
            group = self._by_signature[signature] = len(self.artifacts)
            artifact, fresh = self._compile(piece, list(args), donated)
            self.artifacts.append(artifact)
            self.fresh.append(fresh)
            check_not_specialized(getattr(self.fake_mode, "shape_env", None),
                                  f"compiling piece {target} ({_op_summary(piece)})")
            self.single_output.append(isinstance(piece.graph.output_node().args[0], torch.fx.Node))
            self._outputs.append(out)
        self.groups[target] = group
        self.compiled[target] = self.artifacts[group]
        return self._outputs[group]

    def _donated(self, node: torch.fx.Node) -> frozenset[int]:
        """The inputs of the piece `node` calls that it may write over: outputs of an earlier plain piece that are
        new tensors (ember.graphs.passes.donate_residual.fresh_outputs) and that nothing else in the split graph
        reads."""
        donated = set()
        for i, arg in enumerate(node.args):
            if not isinstance(arg, torch.fx.Node) or len(arg.users) != 1 or node.args.count(arg) != 1:
                continue
            if arg.op == "call_function" and arg.target is operator.getitem:
                source, index = arg.args
                if sum(1 for u in source.users if u.target is operator.getitem and u.args[1] == index) != 1:
                    continue
            else:
                source, index = arg, None
            group = self.groups.get(source.target) if source.op == "call_module" else None
            if group is None or (index is None) != self.single_output[group]:
                continue
            if (index or 0) in self.fresh[group]:
                donated.add(i)
        return frozenset(donated)

    def _compile(self, piece: torch.fx.GraphModule, args: list, donated: frozenset[int]
                 ) -> tuple[Callable, frozenset[int]]:
        """The piece as a plain FX graph where nothing is left in it for Inductor (ember.graphs.plain_pieces), else
        Inductor's code; with the outputs a later piece may write over (none for Inductor's). The fusion passes'
        counts go to the pipeline either way."""
        fusion = self.inductor_options.get("post_grad_custom_post_pass")
        if self.plain_pieces:
            from ember.graphs.passes.donate_residual import fresh_outputs
            from ember.graphs.plain_pieces import plain_piece
            try:
                plain, counts = plain_piece(piece, args, getattr(fusion, "disabled", ()),
                                            donated if self.donate else None)
            except Exception as exc:   # a piece the plain trace cannot take is Inductor's, as it always was
                logger.info("a piece goes to Inductor: its plain trace failed (%s: %s)", type(exc).__name__, exc)
                plain, counts = None, {}
            if plain is not None:
                self.num_plain += 1
                if fusion is not None:
                    fusion.record(counts)
                return plain, fresh_outputs(plain.gm.graph, donated) if self.donate else frozenset()
        return _compile_piece(piece, args, self.inductor_options), frozenset()


def _op_summary(piece: torch.fx.GraphModule, limit: int = 12) -> str:
    """The distinct ops a piece calls, in order, for an error message."""
    ops = list(dict.fromkeys(getattr(n.target, "__name__", str(n.target)) for n in piece.graph.nodes
                             if n.op in ("call_function", "call_method")))
    return ", ".join(ops[:limit]) + (f" and {len(ops) - limit} more" if len(ops) > limit else "")


def _compile_piece(piece: torch.fx.GraphModule, args: list, inductor_options: Mapping[str, Any]) -> Callable:
    """Inductor's code for one piece, as a saveable artifact where this torch has standalone_compile."""
    options = {"config_patches": dict(inductor_options)} if inductor_options else {}
    try:
        from torch._inductor import standalone_compile
    except ImportError:
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(piece, args, **options)
    return standalone_compile(piece, args, dynamic_shapes="from_tracing_context", options=options)
