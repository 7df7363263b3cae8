"""Post-grad-like FX graphs on the CPU without Inductor: make_fx with Inductor's decompositions, then Inductor's
no-op removal, the graph the fusion passes see inside a compile (minus the C++ build)."""

from __future__ import annotations

import torch


def post_grad_graph(fn, *args) -> torch.fx.GraphModule:
    """Trace `fn(*args)` (real parameters allowed) into an aten graph whose nodes carry fake values."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.post_grad import remove_noop_ops
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake",
                 _allow_non_fake_inputs=True)(*args)
    remove_noop_ops(gm.graph)
    gm.recompile()
    return gm


def count_calls(gm: torch.fx.GraphModule, op) -> int:
    """How many nodes of `gm` call `op` (an OpOverload)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is op)
