"""Tracing the first decoder layers and stamping out the rest (ember.graphs.layer_stamp), on the CPU: the stamped
graph is the whole trace's node for node, the compiled model equals eager and loads warm, and every case the
stamping cannot vouch for falls back to tracing the whole model."""

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from ember.attention_backends.op import forward_context
from ember.graphs import compile as C
from ember.graphs import piecewise
from ember.graphs import layer_stamp
from ember.graphs.artifacts import describe_graph_inputs
from ember.graphs.compile import CompiledModel, compile_cache_key
from ember.graphs.layer_stamp import TRACED_LAYERS, layer_fingerprint, stamp_layers, uniform_layers
from tests.helpers.toy_decoder import ToyDecoder, toy_forward_context

NUM_LAYERS = 6


class StampableToy(ToyDecoder):
    """The toy decoder, saying its layers run the same code."""

    def stamp_layers_path(self) -> str:
        return "layers"


def make_model(seed: int = 0, num_layers: int = NUM_LAYERS) -> StampableToy:
    torch.manual_seed(seed)
    return StampableToy(num_layers=num_layers).eval()


def batch(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (num_tokens,), generator=gen), torch.randint(0, 4096, (num_tokens,), generator=gen)


def trace(model, num_layers: int | None = None):
    """Dynamo's graph of `model` (cut to its first `num_layers` layers) and each placeholder's input spec."""
    captured = {}
    layers = model.layers
    if num_layers is not None:
        model.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    ids, pos = batch(16, seed=1)
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(pos, 0)

    def backend(gm, example_inputs):
        captured["gm"] = gm
        captured["specs"] = describe_graph_inputs(model, (ids, pos), gm, example_inputs)
        return gm.forward
    try:
        torch._dynamo.reset()
        with torch.inference_mode(), forward_context(toy_forward_context(model)):
            torch.compile(C._private_forward(model), backend=backend, fullgraph=True)(ids, pos)
    finally:
        model.layers = layers
    return captured["gm"], captured["specs"]


def normalized(gm, specs) -> list:
    """The graph's compute nodes in order, inputs written as a placeholder's spec or a node's position."""
    names = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, specs):
        names[node] = ("input", tuple(spec))
    lines = []
    for i, node in enumerate(n for n in gm.graph.nodes if n.op != "placeholder"):
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: names[n])
        lines.append((node.op, str(node.target), repr(args)))
        names[node] = ("node", i)
    return lines


def test_stamped_graph_is_the_whole_trace_node_for_node():
    model = make_model()
    whole, whole_specs = trace(model)
    cut, cut_specs = trace(model, TRACED_LAYERS)
    stamped = stamp_layers(cut, cut_specs, "layers", NUM_LAYERS)
    assert not isinstance(stamped, str), stamped
    gm, specs = stamped
    assert sorted(map(tuple, specs)) == sorted(map(tuple, whole_specs))
    assert len(gm.graph.nodes) == len(whole.graph.nodes)
    assert normalized(gm, specs) == normalized(whole, whole_specs)
    names = [n.args[4] for n in gm.graph.nodes if C.is_attention_node(n)]
    assert names == [f"layers.{i}.attn" for i in range(NUM_LAYERS)]


def test_stamping_refuses_what_it_cannot_vouch_for():
    model = make_model()
    cut, specs = trace(model, TRACED_LAYERS)
    assert "nothing to stamp" in stamp_layers(cut, specs, "layers", TRACED_LAYERS)
    assert "graph inputs" in stamp_layers(cut, specs[1:], "layers", NUM_LAYERS)
    # the template's layer reads another attention layer than its own: not the same program as the layer before
    node = next(n for n in cut.graph.nodes if C.is_attention_node(n) and n.args[4] == "layers.2.attn")
    node.args = (*node.args[:4], "layers.0.attn", *node.args[5:])
    assert "not the same program" in stamp_layers(cut, specs, "layers", NUM_LAYERS)
    # no layer found on dynamo's module stacks (another path): every node is prologue
    assert "has no nodes" in stamp_layers(trace(model, TRACED_LAYERS)[0], specs, "blocks", NUM_LAYERS)


def test_uniform_layers_compares_modules_but_not_their_own_names():
    model = make_model()
    assert uniform_layers(model.layers, "layers") is None
    assert layer_fingerprint(model.layers[2], 2, "layers") == layer_fingerprint(model.layers[5], 5, "layers")
    model.layers[4].attn.scale_hint = 2.0
    assert uniform_layers(model.layers, "layers") == "layer 4 differs from layer 1 in its modules or attributes"
    model = make_model()
    model.layers[3].up = torch.nn.Linear(32, 48)
    assert "layer 3 differs" in uniform_layers(model.layers, "layers")


def run(fn, model, num_tokens, seed):
    ids, pos = batch(num_tokens, seed)
    with torch.inference_mode(), forward_context(toy_forward_context(model)):
        return fn(ids, pos), model(ids, pos)


def test_stamped_compile_equals_eager_and_loads_warm(tmp_path, caplog):
    """Inductor (C++) on the stamped graph: equal to eager at any token count, dynamo traced only the cut model,
    and a second build loads the saved artifacts (the whole model's inputs) without a trace."""
    model = make_model()
    key = compile_cache_key({"model": "StampableToy", "num_layers": NUM_LAYERS}, torch.float32)
    fn = CompiledModel(model, cache_key=key, cache_root=tmp_path)
    with caplog.at_level(logging.INFO, logger="ember"):
        for num_tokens in (16, 2, 37):
            got, want = run(fn, model, num_tokens, seed=num_tokens)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert fn.stats.traced_layers == TRACED_LAYERS
    assert fn.stats.num_pieces == NUM_LAYERS + 1 and fn.stats.num_attention_splits == NUM_LAYERS
    assert fn.stats.artifacts_saved == fn.stats.num_distinct == 3
    assert any("first 3 decoder layers" in r.getMessage() for r in caplog.records)
    again = make_model()
    second = CompiledModel(again, cache_key=key, cache_root=tmp_path)
    frames = counters["frames"]["total"]
    for num_tokens in (5, 40):
        got, want = run(second, again, num_tokens, seed=num_tokens)
        first, _ = run(fn, model, num_tokens, seed=num_tokens)
        torch.testing.assert_close(got, first, rtol=0, atol=0)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert counters["frames"]["total"] == frames and second.stats.artifacts_loaded == 3


@pytest.fixture
def eager_pieces(monkeypatch):
    """Pieces run as their FX graphs (no Inductor build): the fallbacks below are about the trace, not the code."""
    monkeypatch.setattr(piecewise, "_compile_piece", lambda piece, args, options: piece)


@pytest.mark.parametrize("case", ["layers_differ", "stamp_fails", "switched_off", "opted_out"])
def test_fallbacks_trace_the_whole_model(eager_pieces, monkeypatch, hooks_env, tmp_path, caplog, case):
    model = make_model()
    if case == "layers_differ":
        model.layers[5].attn.scale_hint = 2.0
    elif case == "stamp_fails":
        monkeypatch.setattr(layer_stamp, "stamp_layers", lambda *args: "forced for the test")
    elif case == "switched_off":
        hooks_env("layer_stamp=off")
    else:
        monkeypatch.setattr(StampableToy, "stamp_layers_path", lambda self: None)
    seen = []
    original = piecewise.split_at_attention
    monkeypatch.setattr(piecewise, "split_at_attention", lambda gm: seen.append(gm) or original(gm))
    fn = CompiledModel(model, cache_key=f"fallback-{case}", cache_root=tmp_path, use_artifacts=False)
    with caplog.at_level(logging.INFO, logger="ember"):
        got, want = run(fn, model, 16, seed=3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert fn.stats.traced_layers == 0 and fn.stats.num_attention_splits == NUM_LAYERS
    assert len(seen) == 1 and sum(C.is_attention_node(n) for n in seen[0].graph.nodes) == NUM_LAYERS
    messages = " | ".join(r.getMessage() for r in caplog.records)
    expected = {"layers_differ": "layer 5 differs", "stamp_fails": "could not be stamped out (forced for the test)"}
    if case in expected:
        assert expected[case] in messages


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_llama_family_engine_stamps_the_whole_trace(eager_pieces, monkeypatch, hooks_env, tmp_path, family):
    """Through the engine (profile run, runner, attention by layer name): with stamping the graph the backend
    compiles is the whole trace's node for node, and prompt logprobs and greedy tokens are the same."""
    from transformers import LlamaConfig, Qwen3Config
    from ember import LLM, SamplingParams
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=NUM_LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.3)
    config = (Qwen3Config(head_dim=8, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"], **common)
              if family == "qwen3" else LlamaConfig(architectures=["LlamaForCausalLM"], **common))
    config.save_pretrained(tmp_path / "model")
    graphs = {}
    original = C.PiecewiseBackend._save

    def save(self, gm, split, pieces, compiler, example_inputs, specs=None):
        graphs[mode] = (gm, specs if specs is not None else self.describe_inputs(gm, example_inputs))
        return original(self, gm, split, pieces, compiler, example_inputs, specs)
    monkeypatch.setattr(C.PiecewiseBackend, "_save", save)
    results = {}
    for mode in ("1", "0"):
        hooks_env("" if mode == "1" else "layer_stamp=off")
        monkeypatch.setenv("EMBER_CACHE", str(tmp_path / f"cache-{mode}"))
        llm = LLM(str(tmp_path / "model"), load_format="dummy", device="cpu", compile_mode="default",
                  max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64, seed=0)
        assert llm.engine.runner.compile_stats.traced_layers == (TRACED_LAYERS if mode == "1" else 0)
        out = llm.generate([[5, 17, 3, 99, 42, 8, 61]],
                           SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2))[0]
        results[mode] = (out.outputs[0].token_ids, out.prompt_logprobs)
        del llm
    assert normalized(*graphs["1"]) == normalized(*graphs["0"])
    assert results["1"][0] == results["0"][0]
    for stamped, whole in zip(results["1"][1], results["0"][1]):
        assert (stamped is None) == (whole is None)
        if stamped is not None:
            assert stamped.keys() == whole.keys()
            for token in stamped:
                assert stamped[token].logprob == pytest.approx(whole[token].logprob, abs=1e-5)


def test_the_fake_run_runs_each_distinct_piece_once(eager_pieces, monkeypatch, tmp_path):
    """The backend's fake run (for each piece's example inputs) runs one piece per group of equal pieces; the
    others take that piece's outputs, and the compiled model still equals eager."""
    runs = []
    original = torch.fx.Interpreter.call_module

    def call_module(self, target, args, kwargs):
        if isinstance(self, piecewise._PieceCompiler):
            runs.append(target)
        return original(self, target, args, kwargs)
    monkeypatch.setattr(torch.fx.Interpreter, "call_module", call_module)
    model = make_model()
    fn = CompiledModel(model, cache_key="fake-run", cache_root=tmp_path, use_artifacts=False)
    got, want = run(fn, model, 16, seed=4)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    split = fn.split_module
    targets = [n.target for n in split.graph.nodes if n.op == "call_module"]
    attention = [t for t in targets if any(C.is_attention_node(n) for n in split._modules[t].graph.nodes)]
    pieces = [t for t in targets if t not in attention]
    assert len(pieces) == NUM_LAYERS + 1 and len(attention) == NUM_LAYERS and fn.stats.num_distinct == 3
    assert [t for t in runs if t in attention] == attention          # every attention call runs (fake)
    assert len([t for t in runs if t in pieces]) == 3                 # one piece of each group
