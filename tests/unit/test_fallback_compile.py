"""The transformers fallback through ember's own compile (`CompiledModel`: the token count marked dynamic, one dynamo
graph split at attention, each piece compiled in the trace's ShapeEnv), on a tiny Qwen3 forced through it: one
compiled graph runs other token counts than the first call's, as the eager model computes them; and a compile that
fixes the token count to the first call's size is refused where it happens, before anything is saved.

The default tests hand each piece over as its traced FX graph (no Inductor build, a few seconds); the slow one
compiles the pieces with Inductor, as on a GPU. The rotary embedding reads cos/sin tables by position
(ember.models.fallback_rotary) instead of computing them over the tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ember.graphs.piecewise as piecewise
from ember.graphs.compile import CompiledModel
from ember.graphs.specialization import TokenCountSpecialized
from ember.models.loader import load_model
from tests.helpers.model_harness import ModelHarness, random_hf_model, tiny_config

# (sequence, new token ids) per step: the first call (15 tokens) traces; the later ones (2, then 7) reuse its graph
STEPS = [[(0, list(range(5, 17))), (1, [3, 4, 5])], [(0, [7]), (1, [8])], [(0, [9, 10, 11]), (1, [12, 13, 14, 15])]]
FIRST_CALL_TOKENS = 15


@pytest.fixture(scope="module")
def fallback_qwen3(tmp_path_factory):
    """A tiny Qwen3 (q/k norms, rotary computed from positions by transformers) through the fallback, float32."""
    hf = random_hf_model(tiny_config("qwen3"), seed=2)
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path)
    return load_model(path, None, torch.float32, "cpu", progress=False, model_impl="transformers")


def _pieces_as_traced(monkeypatch, specialize_first: bool = False) -> list[torch.fx.GraphModule]:
    """Hand each piece over as its traced FX graph instead of Inductor's code; with `specialize_first`, the first
    piece's compile also fixes its first symbolic input size (as a size read with `int()` would). Returns the list
    the compiled pieces go into."""
    from torch.fx.experimental.symbolic_shapes import guard_int
    compiled: list[torch.fx.GraphModule] = []

    def as_traced(piece, args, inductor_options):
        if specialize_first and not compiled:
            size = next(d for a in args if isinstance(a, torch.Tensor) for d in a.shape if isinstance(d, torch.SymInt))
            guard_int(size)
        compiled.append(piece)
        return piece
    monkeypatch.setattr(piecewise, "_compile_piece", as_traced)
    return compiled


def _run_steps(model, forward) -> list[torch.Tensor]:
    harness = ModelHarness(model, 2)
    harness.model = forward
    with torch.inference_mode():
        return [harness.step(chunks) for chunks in STEPS]


def _check_token_counts(model, compiled: CompiledModel) -> None:
    eager = _run_steps(model, model)
    out = _run_steps(model, compiled)
    assert [o.shape[0] for o in out] == [FIRST_CALL_TOKENS, 2, 7]
    for got, want in zip(out, eager):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert compiled.stats.num_graphs == 1
    assert compiled.stats.num_attention_splits == 2


def test_one_compiled_graph_runs_every_token_count(fallback_qwen3, monkeypatch, tmp_path):
    pieces = _pieces_as_traced(monkeypatch)
    compiled = CompiledModel(fallback_qwen3, cache_root=tmp_path, use_artifacts=False, plain_pieces=False)
    _check_token_counts(fallback_qwen3, compiled)
    assert len(pieces) == compiled.stats.num_distinct == 3       # first, middle, last
    # the rotary angles come from tables (ember.models.fallback_rotary): no matmul, cos or sin over the tokens
    called = {getattr(n.target, "__name__", str(n.target)) for p in pieces for n in p.graph.nodes
              if n.op in ("call_function", "call_method")}
    assert not {name for name in called if name in ("cos", "sin", "matmul", "bmm")}, called


def test_rotary_tables_hold_what_the_module_computes(fallback_qwen3):
    """Each table row is the transformers rotary module's own output for that position, bit for bit."""
    rotary = fallback_qwen3.decoder.rotary_emb
    config = fallback_qwen3.config
    assert tuple(rotary.ember_cos.shape) == (config.max_position_embeddings, config.head_dim)
    positions = torch.tensor([[0, 1, 7, 100, config.max_position_embeddings - 1]])
    x = torch.zeros(1, dtype=torch.bfloat16)
    for got, want in zip(rotary(x, positions), type(rotary).forward(rotary, x, positions)):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, want)


@pytest.mark.slow
def test_one_inductor_compile_runs_every_token_count(fallback_qwen3, tmp_path):
    compiled = CompiledModel(fallback_qwen3, cache_root=tmp_path)
    _check_token_counts(fallback_qwen3, compiled)
    assert compiled.stats.artifacts_saved == compiled.stats.num_distinct == 3


def test_a_piece_that_fixes_the_token_count_is_refused_unsaved(fallback_qwen3, monkeypatch, tmp_path):
    _pieces_as_traced(monkeypatch, specialize_first=True)
    compiled = CompiledModel(fallback_qwen3, cache_root=tmp_path)
    with pytest.raises(TokenCountSpecialized, match=rf"compiling piece submod_0 \(.*embedding.*\) fixed the dynamic "
                                                    rf"token count .* = {FIRST_CALL_TOKENS} \(at "):
        _run_steps(fallback_qwen3, compiled)
    assert compiled.stats.artifacts_saved == 0
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


class _BranchesOnSize(nn.Module):
    """Code that reads the token count as a number: dynamo fixes the dynamic size to it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, input_ids, positions):
        scale = 2.0 if input_ids.shape[0] == 6 else 1.0
        return self.embed(input_ids) * scale + positions[:, None]


def test_a_trace_that_fixes_the_token_count_is_refused(monkeypatch, tmp_path):
    _pieces_as_traced(monkeypatch)
    compiled = CompiledModel(_BranchesOnSize(), cache_root=tmp_path)
    with pytest.raises(TokenCountSpecialized, match=r"dynamo's trace of the model fixed the dynamic token count "
                                                    r".* = 6 \(at "):
        compiled(torch.arange(6), torch.arange(6))
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_a_float_the_trace_fixed_is_not_a_token_count():
    """dynamo may keep a float attribute (a norm's epsilon) symbolic and fix it later: not a size, not refused;
    an integer size fixed the same way is."""
    from torch._dynamo.source import AttrSource, LocalSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from ember.graphs.specialization import check_not_specialized, specialized_inputs
    env = ShapeEnv()
    eps_source = AttrSource(LocalSource("norm"), "variance_epsilon")
    eps = env.create_symfloatnode(env.create_unspecified_symbol(1e-5, eps_source, dynamic_dim=DimDynamic.DYNAMIC),
                                  hint=1e-5, source=eps_source)
    assert float(eps) == 1e-5                    # fixes the float symbol to its value
    assert specialized_inputs(env) == []
    check_not_specialized(env, "the trace")
    size_source = LocalSource("num_tokens")
    size = env.create_symintnode(env.create_unspecified_symbol(7, size_source, dynamic_dim=DimDynamic.DYNAMIC),
                                 hint=7, source=size_source)
    assert int(size) == 7
    assert [(name, value) for name, value, _ in specialized_inputs(env)] == [("L['num_tokens']", 7)]
    with pytest.raises(TokenCountSpecialized, match=r"L\['num_tokens'\] = 7"):
        check_not_specialized(env, "the trace")
