"""The fusion pass pipeline that Inductor runs on each compiled piece's post-grad graph."""

from __future__ import annotations

from collections.abc import Iterable

from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph

from ember.graphs.passes.registry import PASSES, check_pass_names, passes_digest

__all__ = ["PASSES", "FusionPipeline", "check_pass_names"]


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

    def record(self, counts: dict[str, int]) -> None:
        """Add the matches of a graph these passes ran over outside Inductor (a plain piece)."""
        self.num_graphs += 1
        for name, found in counts.items():
            self.counts[name] += found

    def uuid(self) -> bytes:
        """Part of Inductor's cache key: the passes' code and which of them run."""
        return passes_digest(self.enabled)

    def summary(self, num_cached: int = 0) -> str:
        """One line for the start-up log: matches per pass over the graphs compiled now (`num_cached` more came
        from Inductor's cache, fused when they were first compiled), and the passes turned off."""
        fired = ", ".join(f"{name} {count}" for name, count in self.counts.items()) or "none enabled"
        cached = f", {num_cached} more from the cache" if num_cached else ""
        off = f"; off: {', '.join(self.disabled)}" if self.disabled else ""
        return f"fusion passes over {self.num_graphs} compiled graphs{cached}: {fired}{off}"
