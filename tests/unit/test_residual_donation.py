"""Residual donation (ember/graphs/passes/donate_residual.py): a compiled decoder's residual adds write over the
residual stream (`ember::fused_linear_into_residual`, which runs cuBLAS's beta=1 GEMM in place instead of
`torch.addmm`'s copy of the residual first), two a layer, chained across the pieces, with hidden states equal bit
for bit to the functional op's; a residual something reads afterwards is left alone; the GEMV writes its output
over the residual it reads, equal to a new output."""

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import ember.kernels.fused_linear  # noqa: F401  (registers the ops)
from ember.attention_backends.op import forward_context
from ember.graphs.compile import CompiledModel
from ember.graphs.passes.donate_residual import donate_residuals, fresh_outputs
from ember.models.loader import random_model
from tests.helpers.model_harness import ModelHarness, tiny_config

ember = torch.ops.ember
LAYERS = 4


def _compiled(root: Path, donate: bool):
    """A 4-layer tiny Qwen3 (layers stamped from a trace of three), compiled, and one forward over a 3-token and a
    6-token prefill."""
    torch.manual_seed(0)
    model = random_model(tiny_config("qwen3", num_hidden_layers=LAYERS), torch.bfloat16)
    harness = ModelHarness(model, 2, dtype=torch.bfloat16)
    common, positions = harness._metadata([(0, [1, 2, 3]), (1, [4, 5, 6, 7, 8, 9])])
    from ember.attention_backends.op import ForwardContext
    context = ForwardContext(layers=harness.layers, attn_metadata=(harness.builder.build(common),))
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compiled = CompiledModel(model, cache_key="qwen3-donation", cache_root=root, donate_residuals=donate)
    with torch.inference_mode(), forward_context(context):
        compiled(ids, positions)                     # compiles
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = compiled(ids, positions)
    calls = {}
    for event in prof.events():
        calls[event.name] = calls.get(event.name, 0) + 1
    return compiled, out, calls


def _graph_calls(compiled: CompiledModel, target) -> int:
    """Calls of `target` in the plain graphs the split module runs, each piece counted once per call."""
    split = compiled.split_module
    count = 0
    for node in split.graph.nodes:
        if node.op == "call_module":
            gm = getattr(split.__dict__.get(node.target), "gm", None)
            if gm is not None:
                count += sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)
    return count


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    root = tmp_path_factory.mktemp("donation")
    return _compiled(root, True), _compiled(root, False)


def test_every_residual_add_writes_over_the_residual_with_equal_hidden_states(both):
    (donated, out, calls), (kept, kept_out, kept_calls) = both
    assert donated.cache_dir != kept.cache_dir
    assert donated.stats.num_pieces == LAYERS + 1 and donated.stats.traced_layers == 3     # the 4th layer stamped
    # o_proj's add takes the residual the previous piece handed over, down_proj's the one o_proj wrote: two a layer
    assert _graph_calls(donated, ember.fused_linear_into_residual.default) == 2 * LAYERS
    assert calls.get("ember::fused_linear_into_residual", 0) == 2 * LAYERS
    assert _graph_calls(kept, ember.fused_linear_into_residual.default) == 0
    assert kept_calls.get("ember::fused_linear_into_residual", 0) == 0
    # what is left of ember::fused_linear is the qkv and gate_up projections, which add no residual
    assert calls["ember::fused_linear"] == kept_calls["ember::fused_linear"] - 2 * LAYERS == 2 * LAYERS
    assert torch.equal(out, kept_out)


def _fake_graph(fn, *shapes):
    """`fn`'s aten graph traced on fake bfloat16 inputs of `shapes` (meta values set, as the passes see them)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    args = [torch.randn(*s).to(torch.bfloat16) for s in shapes]
    return make_fx(fn, tracing_mode="fake")(*args)


def _residual_adds(x, w1, w2):
    r = ember.fused_linear(x, w1, None, None, 0.0, False, None)        # a new tensor
    y = ember.fused_linear(x, w2, None, None, 0.0, False, r)
    return y


def _residual_read_after(x, w1, w2):
    r = ember.fused_linear(x, w1, None, None, 0.0, False, None)
    y = ember.fused_linear(x, w2, None, None, 0.0, False, r)
    return y, r * 2                                                      # r is read after its add


def _residual_viewed(x, w1, w2):
    r = ember.fused_linear(x, w1, None, None, 0.0, False, None)
    y = ember.fused_linear(x, w2, None, None, 0.0, False, r)
    return y, r.view(-1)                                                 # a view of r leaves the graph


def _input_residual(x, w, r):
    return ember.fused_linear(x, w, None, None, 0.0, False, r)


def test_only_a_residual_nothing_reads_afterwards_is_written_over():
    shapes = ((5, 8), (8, 8), (8, 8))
    gm = _fake_graph(_residual_adds, *shapes)
    assert donate_residuals(gm.graph) == 1
    assert fresh_outputs(gm.graph) == frozenset({0})      # the written residual is the graph's output
    assert donate_residuals(_fake_graph(_residual_read_after, *shapes).graph) == 0
    assert donate_residuals(_fake_graph(_residual_viewed, *shapes).graph) == 0
    # a graph input only where the caller hands it over
    assert donate_residuals(_fake_graph(_input_residual, (5, 8), (8, 8), (5, 8)).graph) == 0
    gm = _fake_graph(_input_residual, (5, 8), (8, 8), (5, 8))
    assert donate_residuals(gm.graph, frozenset({2})) == 1
    assert fresh_outputs(gm.graph) == frozenset() and fresh_outputs(gm.graph, frozenset({2})) == frozenset({0})


@pytest.mark.parametrize("bias,gated,norm", [(False, False, False), (False, False, True), (True, False, False),
                                             (False, True, True)])
def test_the_op_equals_fused_linear_and_writes_over_the_residual(bias, gated, norm):
    g = torch.Generator().manual_seed(0)
    M, N, K = 7, 24, 32
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    weight = torch.randn(2 * N if gated else N, K, generator=g).to(torch.bfloat16)
    b = torch.randn(weight.shape[0], generator=g).to(torch.bfloat16) if bias else None
    nw = torch.randn(K, generator=g).to(torch.bfloat16) if norm else None
    residual = torch.randn(M, N, generator=g).to(torch.bfloat16)
    expected = ember.fused_linear(x, weight, b, nw, 1e-6, gated, residual)
    written = residual.clone()
    assert ember.fused_linear_into_residual(x, weight, b, nw, 1e-6, gated, written) is None
    assert torch.equal(written, expected)
    with pytest.raises(ValueError, match="contiguous residual"):
        ember.fused_linear_into_residual(x, weight, b, nw, 1e-6, gated, residual.t().contiguous().t())


@pytest.mark.parametrize("M", [1, 5])
def test_the_gemv_writes_its_output_over_the_residual(M):
    pytest.importorskip("triton")
    from ember.kernels.gemv import gemv
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, 64, generator=g)
    weight = torch.randn(32, 64, generator=g)
    residual = torch.randn(M, 32, generator=g)
    expected = gemv(x, weight, None, residual)
    written = residual.clone()
    assert gemv(x, weight, None, written, out=written) is written
    assert torch.equal(written, expected)
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, weight, None, residual, out=torch.empty(M, 16))
