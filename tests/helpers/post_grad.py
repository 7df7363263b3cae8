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


def fused_and_reference(model, ids, positions, context):
    """(the fusion pipeline that ran, the fused graph, its output, the unfused graph's output) for one forward of
    `model` under the forward `context`, traced into an aten graph."""
    from ember.attention_backends.op import forward_context
    from ember.graphs.passes.pipeline import FusionPipeline
    with torch.inference_mode(), forward_context(context):
        gm = post_grad_graph(model, ids, positions)
        reference = gm(ids, positions)
        pipeline = FusionPipeline()
        pipeline(gm.graph)
        gm.recompile()
        out = gm(ids, positions)
    return pipeline, gm, out, reference
