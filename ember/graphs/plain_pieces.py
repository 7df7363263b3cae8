"""Pieces that run as plain FX code, without Inductor.

After the fusion passes, a decoder's pieces hold little but ember's own ops: every projection is an
`ember::fused_linear`, Qwen3's q/k norm and rotary an `ember::qk_norm_rope`, and what is left is views, splits, the
embedding, one gather of the rotary rows and the final RMSNorm. Inductor would generate a kernel or two for that
remainder; its import, its compile and the load of its code cost seconds at every start. So a piece whose traced aten
graph (Inductor's decompositions, the fusion passes, and the final RMSNorm as `ember::rms_norm`) calls only
`PLAIN_TARGETS` runs as that graph, eagerly (inside a CUDA graph when captured), and is saved as the pickled FX
graph. Any other piece (arithmetic the passes do not take: Llama's rotary where the attention backend does not
take it, Gemma's norms) goes to Inductor as before. The trace borrows Inductor's decomposition table and its no-op
removal pass: this is the `plain_pieces` hook of ember.kernels.hooks (docs/hooks.md), off with
`EMBER_HOOKS=plain_pieces=off` or on a torch it was not checked with.

    plain_piece(piece, example_inputs, disabled_fusions) -> PlainPiece | None
    PlainPiece(gm)(*args);  .save(path, format);  PlainPiece.load(path)
"""

from __future__ import annotations

import contextlib
import operator
import pickle
from collections.abc import Iterable

import torch

aten = torch.ops.aten

# what a plain piece may call: ember's ops, views and shape arithmetic, and the few data-moving ops a decoder's glue
# needs (each one kernel, as Inductor's own would be)
_VIEWS = ("view.default", "reshape.default", "_unsafe_view.default", "split.Tensor", "split_with_sizes.default",
          "unsqueeze.default", "squeeze.dim", "slice.Tensor", "select.int", "permute.default", "t.default",
          "alias.default", "expand.default", "sym_size.int", "sym_numel.default", "sym_stride.int")
_DATA = ("embedding.default", "index.Tensor", "index_select.default", "empty.memory_format", "clone.default")
_SYM = (operator.getitem, operator.mul, operator.add, operator.sub, operator.floordiv, operator.mod, operator.neg)


def plain_targets() -> frozenset:
    """The call targets a plain piece may hold."""
    import ember.kernels.fused_linear  # noqa: F401  (registers the ember ops a pass may put in)
    import ember.kernels.qk_norm_rope  # noqa: F401
    import ember.kernels.scaled_linear_op  # noqa: F401
    import ember.kernels.rms_norm  # noqa: F401
    ember = torch.ops.ember
    ops = []
    for name in _VIEWS + _DATA:
        op, overload = name.split(".")
        packet = getattr(aten, op, None)
        if packet is not None and hasattr(packet, overload):
            ops.append(getattr(packet, overload))
    # ember::moe is registered by the MoE layers (a model that has them is built before it is traced); importing
    # its kernels for every model would cost a dense model's start-up ~0.1 s
    moe = [ember.moe.default] if hasattr(ember, "moe") else []
    # tensor parallelism's collectives and the vocab-parallel embedding (registered by ember.distributed.ops)
    from ember.distributed import ops as _collective_ops  # noqa: F401
    collectives = [ember.all_reduce.default, ember.all_gather.default, ember.vocab_shard_embedding.default]
    own = [ember.fused_linear.default, ember.fused_linear_into_residual.default, ember.qk_norm_rope.default,
           ember.linear.default, ember.rms_norm.default, ember.scaled_linear.default]
    return frozenset(ops + list(_SYM) + moe + collectives + own)


class PlainPiece:
    """A piece as its traced aten FX graph: called like the piece, saved as a pickle."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm

    def __call__(self, *args):
        return self.gm(*args)

    def is_saveable(self) -> bool:
        return True

    def save(self, path: str, format: str = "binary") -> None:
        """Pickle the graph's code (an FX graph module pickles as its Python source); the tracer that made it is
        left out, so that reading it back imports nothing of the tracing machinery."""
        gm = torch.fx.GraphModule(torch.nn.Module(), self.gm.graph)
        gm._tracer_cls, gm._tracer_extras = None, {}
        with open(path, "wb") as f:
            pickle.dump(gm, f)

    @classmethod
    def load(cls, path: str) -> PlainPiece:
        import ember.kernels.fused_linear  # noqa: F401  (the ops the graph calls must exist before it is read)
        import ember.kernels.qk_norm_rope  # noqa: F401
        import ember.kernels.scaled_linear_op  # noqa: F401
        import ember.kernels.rms_norm  # noqa: F401
        from ember.distributed import ops as _collective_ops  # noqa: F401
        with open(path, "rb") as f:
            gm = pickle.load(f)
        if not isinstance(gm, torch.fx.GraphModule):
            raise ValueError(f"{path} holds a {type(gm).__name__}, not an FX graph")
        return cls(gm)


def fuse_final_rms_norm(graph: torch.fx.Graph) -> int:
    """Rewrite every Llama-form RMSNorm of a 2-D tensor that no projection took as its prologue into
    `ember::rms_norm` (one kernel); returns how many."""
    from ember.graphs.passes.match import match_rms_norm, replace_with, value
    import ember.kernels.rms_norm  # noqa: F401  (registers ember::rms_norm)
    count = 0
    for node in list(graph.nodes):
        norm = match_rms_norm(node) if node.op == "call_function" else None
        x_val = value(norm.x) if norm is not None else None
        if x_val is None or x_val.dim() != 2:
            continue
        out = value(node)
        replace_with(graph, node, torch.ops.ember.rms_norm.default, (norm.x, norm.weight, norm.eps),
                     lambda out=out: torch.empty_like(out, memory_format=torch.contiguous_format))
        graph.erase_node(node)
        count += 1
    return count


def plain_piece(piece: torch.fx.GraphModule, example_inputs: list, disabled_fusions: Iterable[str] = (),
                donated: frozenset[int] | None = frozenset()) -> tuple[PlainPiece | None, dict[str, int]]:
    """The piece as a plain FX graph, or None where something Inductor should compile is left in it; with the
    fusion passes' match counts (empty for None). Its residual adds write over residuals nothing reads afterwards
    (ember.graphs.passes.donate_residual), among them the inputs numbered in `donated`; None: none do."""
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.post_grad import remove_noop_ops
    from torch.fx.experimental.proxy_tensor import make_fx

    from ember.graphs.passes.pipeline import FusionPipeline
    fake_mode = detect_fake_mode(example_inputs)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        gm = make_fx(piece, decomposition_table=select_decomp_table(), tracing_mode="fake",
                     _allow_non_fake_inputs=True)(*example_inputs)
    remove_noop_ops(gm.graph)
    fusion = FusionPipeline(disabled_fusions)
    fusion(gm.graph)
    fuse_final_rms_norm(gm.graph)
    gm.graph.eliminate_dead_code()
    allowed = plain_targets()
    left = [n for n in gm.graph.nodes if n.op == "call_function" and n.target not in allowed]
    if left or any(n.op in ("call_module", "call_method", "get_attr") for n in gm.graph.nodes):
        return None, {}
    if donated is not None:
        from ember.graphs.passes.donate_residual import donate_residuals
        donate_residuals(gm.graph, donated)
    gm.recompile()
    return PlainPiece(gm), dict(fusion.counts)
