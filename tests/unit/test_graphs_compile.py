"""Piecewise torch.compile of a toy decoder on the CPU: the split, dynamic shapes, equality with eager, the cache.

The compile cache lives under ember's cache directory ($EMBER_CACHE), so only the first run on a machine pays
for the Inductor C++ builds.
"""

import logging
import os

import pytest
import torch
from torch._dynamo.utils import counters

from ember.attention_backends.op import forward_context
from ember.config import cache_dir
from ember.graphs.compile import (CompiledModel, compile_cache_key, compile_model, inductor_cache_scope,
                                  resolve_compile_mode, split_at_attention)
from ember.graphs.cuda_graph import CUDAGraphManager, CUDAGraphWrapper
from ember.graphs.modes import BatchDescriptor, CUDAGraphMode
from tests.helpers.toy_decoder import ToyDecoder, toy_forward_context

NUM_LAYERS = 2
TOY = {"model": "ToyDecoder", "num_layers": NUM_LAYERS, "hidden": 32, "num_heads": 4, "num_kv_heads": 2}
TOKEN_COUNTS = [1, 2, 5, 16, 37, 128]


def make_toy(seed: int = 0) -> ToyDecoder:
    torch.manual_seed(seed)
    return ToyDecoder(num_layers=NUM_LAYERS).eval()


def toy_batch(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (num_tokens,), generator=gen), torch.randint(0, 4096, (num_tokens,), generator=gen)


@pytest.fixture(scope="module")
def compiled():
    """One compile shared by the module: the toy model, its CompiledModel (pieces wrapped for CUDA graphs, which
    pass through on a CPU), and the dynamo counters before the first call."""
    model = make_toy()
    manager = CUDAGraphManager("cpu")
    key = compile_cache_key(TOY, torch.float32)
    before_breaks = sum(counters["graph_break"].values())
    before_graphs = counters["stats"]["unique_graphs"]
    fn = compile_model(model, "default", cache_key=key, cache_root=cache_dir(), graph_manager=manager)
    ids, pos = toy_batch(16, seed=1)
    with torch.inference_mode(), forward_context(toy_forward_context(model)):
        fn(ids, pos)
    return model, fn, before_breaks, before_graphs


def test_split_into_layers_plus_one_pieces_without_graph_break(compiled):
    model, fn, before_breaks, before_graphs = compiled
    assert fn.stats.num_graphs == 1
    assert fn.stats.num_pieces == NUM_LAYERS + 1
    assert fn.stats.num_attention_splits == NUM_LAYERS
    assert sum(counters["graph_break"].values()) == before_breaks
    assert counters["stats"]["unique_graphs"] - before_graphs == 1
    split = fn.backend.split_module
    wrapped = [v for v in vars(split).values() if isinstance(v, CUDAGraphWrapper)]
    assert len(wrapped) == NUM_LAYERS + 1
    assert all(w.runtime_mode == CUDAGraphMode.PIECEWISE for w in wrapped)


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_compiled_matches_eager_for_any_token_count(compiled, num_tokens):
    model, fn, _, _ = compiled
    before = counters["stats"]["unique_graphs"]
    ids, pos = toy_batch(num_tokens, seed=num_tokens)
    with torch.inference_mode(), forward_context(toy_forward_context(model)):
        got = fn(ids, pos)
        want = model(ids, pos)
    assert got.shape == (num_tokens, 32)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # one dynamic graph serves every size: nothing recompiled
    assert counters["stats"]["unique_graphs"] == before
    assert fn.stats.num_graphs == 1


def test_piece_wrappers_pass_through_outside_their_mode(compiled):
    model, fn, _, _ = compiled
    ids, pos = toy_batch(8, seed=3)
    ctx = toy_forward_context(model, batch_descriptor=BatchDescriptor(8), runtime_mode=CUDAGraphMode.NONE)
    with torch.inference_mode(), forward_context(ctx):
        got = fn(ids, pos)
        want = model(ids, pos)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    wrapped = [v for v in vars(fn.backend.split_module).values() if isinstance(v, CUDAGraphWrapper)]
    assert all(not w.entries for w in wrapped)


def test_split_at_attention_on_a_symbolic_trace():
    model = ToyDecoder(num_layers=3)
    gm = torch.fx.symbolic_trace(model)
    split, pieces, attention = split_at_attention(gm)
    assert len(pieces) == 4 and len(attention) == 3
    # pieces and attention alternate, starting and ending with a piece
    order = [n.target for n in split.graph.nodes if n.op == "call_module"]
    assert order == [x for pair in zip(pieces, attention + [None]) for x in pair if x is not None]
    ids, pos = toy_batch(6, seed=4)
    with torch.inference_mode(), forward_context(toy_forward_context(model)):
        torch.testing.assert_close(split(ids, pos), model(ids, pos), rtol=0, atol=0)


def test_first_call_needs_two_tokens():
    model = make_toy()
    fn = CompiledModel(model, cache_key="unused", cache_root=cache_dir())
    ids, pos = toy_batch(1, seed=5)
    with pytest.raises(ValueError, match="at least 2 tokens, got 1"):
        fn(ids, pos)


def test_compile_mode_none_is_the_model_itself():
    model = make_toy()
    assert compile_model(model, "none") is model
    with pytest.raises(ValueError, match="'auto'"):
        compile_model(model, "auto")


@pytest.mark.parametrize("mode, device, eager, want", [
    ("auto", "cuda", False, "default"), ("auto", "cpu", False, "none"), ("default", "cpu", False, "default"),
    ("none", "cuda", False, "none"), ("default", "cuda", True, "none"), ("auto", "cuda", True, "none"),
])
def test_resolve_compile_mode(mode, device, eager, want):
    assert resolve_compile_mode(mode, device, eager) == want


def test_resolve_compile_mode_rejects_unknown():
    with pytest.raises(ValueError, match="'max-autotune'"):
        resolve_compile_mode("max-autotune", "cuda")


def test_cache_key_depends_on_config_dtype_and_versions():
    key = compile_cache_key(TOY, torch.float32)
    assert key == compile_cache_key(dict(reversed(list(TOY.items()))), torch.float32)   # key order does not matter
    assert key != compile_cache_key(TOY, torch.bfloat16)
    assert key != compile_cache_key({**TOY, "num_layers": 3}, torch.float32)
    assert len(key) == 16


def test_cache_scope_sets_and_restores_the_inductor_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    with inductor_cache_scope(tmp_path / "k"):
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "k")
        from torch._inductor import config
        assert config.fx_graph_cache is True
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"
    assert (tmp_path / "k").is_dir()


def test_second_build_hits_the_compile_cache(compiled, caplog):
    # runs last: resetting dynamo drops the shared compiled frame
    model, fn, _, _ = compiled
    torch._dynamo.reset()
    again = make_toy()
    second = compile_model(again, "default", cache_key=compile_cache_key(TOY, torch.float32), cache_root=cache_dir())
    ids, pos = toy_batch(9, seed=6)
    with caplog.at_level(logging.INFO, logger="ember"), torch.inference_mode(), \
            forward_context(toy_forward_context(again)):
        got = second(ids, pos)
        want = again(ids, pos)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert second.stats.num_pieces == NUM_LAYERS + 1
    # the three distinct pieces (first, middle, last) all load from the on-disk FX graph cache
    assert second.stats.cache_counters["fxgraph_cache_hit"] >= NUM_LAYERS + 1
    assert second.stats.cache_counters["fxgraph_cache_miss"] == 0
    assert second.stats.cache_dir == str(cache_dir() / "compile" / compile_cache_key(TOY, torch.float32))
    message = next(r.getMessage() for r in caplog.records if "compiled the model" in r.getMessage())
    assert f"FX graph cache {second.stats.fxgraph_cache_hits} hit / 0 miss" in message
