"""The fusion pass pipeline that Inductor runs on each compiled piece's post-grad graph."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterable

from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph

import ember.kernels.fused_linear  # noqa: F401  (registers torch.ops.ember.fused_linear)
import ember.kernels.qk_norm_rope  # noqa: F401  (registers torch.ops.ember.qk_norm_rope)
from ember.graphs.passes import gated_epilogue, match, norm_prologue, qk_norm_rope, residual_epilogue

# in the order they run: the epilogue passes also extend linears that an earlier pass already fused
PASSES: dict[str, Callable[[Graph], int]] = {
    norm_prologue.NAME: norm_prologue.fuse_rms_norm_prologue,
    gated_epilogue.NAME: gated_epilogue.fuse_silu_mul_epilogue,
    residual_epilogue.NAME: residual_epilogue.fuse_residual_epilogue,
    qk_norm_rope.NAME: qk_norm_rope.fuse_qk_norm_rope,
}
_SOURCES = (match, norm_prologue, gated_epilogue, residual_epilogue, qk_norm_rope, ember.kernels.fused_linear,
            ember.kernels.qk_norm_rope)


def check_pass_names(names: Iterable[str]) -> tuple[str, ...]:
    """The names, validated against the known passes ("all" stands for every pass)."""
    names = tuple(names)
    if "all" in names:
        return tuple(PASSES)
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise ValueError(f"fusion pass {unknown[0]!r} is not known; known passes: {list(PASSES)} (or 'all')")
    return names


class FusionPipeline(CustomGraphPass):
    """Runs every fusion pass not in `disabled` over a post-grad graph and counts the rewrites per pass (summed
    over all the graphs it sees; a graph loaded from Inductor's cache is not passed through again)."""

    def __init__(self, disabled: Iterable[str] = ()):
        self.disabled = check_pass_names(disabled)
        self.enabled = tuple(n for n in PASSES if n not in self.disabled)
        self.counts = {name: 0 for name in self.enabled}
        self.num_graphs = 0           # graphs passed through (a piece loaded from the FX graph cache is not)

    def __call__(self, graph: Graph) -> None:
        self.num_graphs += 1
        changed = False
        for name in self.enabled:
            found = PASSES[name](graph)
            self.counts[name] += found
            changed |= found > 0
        if changed:
            graph.eliminate_dead_code()
            graph.lint()

    def uuid(self) -> bytes:
        """Part of Inductor's cache key: the passes' code and which of them run."""
        digest = hashlib.sha256(",".join(self.enabled).encode())
        for module in _SOURCES:
            digest.update(inspect.getsource(module).encode())
        return digest.digest()

    def summary(self, num_cached: int = 0) -> str:
        """One line for the start-up log: matches per pass over the graphs compiled now (`num_cached` more came
        from Inductor's cache, fused when they were first compiled), and the passes turned off."""
        fired = ", ".join(f"{name} {count}" for name, count in self.counts.items()) or "none enabled"
        cached = f", {num_cached} more from the cache" if num_cached else ""
        off = f"; off: {', '.join(self.disabled)}" if self.disabled else ""
        return f"fusion passes over {self.num_graphs} compiled graphs{cached}: {fired}{off}"
