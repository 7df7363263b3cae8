"""Piecewise torch.compile of a toy decoder on the CPU: the split, dynamic shapes, equality with eager, compiling
each distinct piece once, and the warm start from saved artifacts.

Everything compiles into one fresh cache root per module (what a CI machine sees): 4 layers give 5 pieces of
which 3 are distinct (first, middle, last), so the module pays for 3 Inductor C++ builds, plus 2 for the
undeduplicated comparison (its first, second and last pieces hit the FX graph cache).
"""

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from ember.attention_backends.op import forward_context
from ember.graphs.artifacts import ember_source_hash
from ember.graphs.compile import (CompiledModel, compile_cache_key, compile_model, inductor_cache_scope,
                                  resolve_compile_mode, split_at_attention)
from ember.graphs.piece_dedupe import group_pieces, piece_signature
from ember.graphs.cuda_graph import CUDAGraphManager, CUDAGraphWrapper
from ember.graphs.modes import BatchDescriptor, CUDAGraphMode
from tests.helpers.toy_decoder import ToyDecoder, toy_forward_context

NUM_LAYERS = 4
NUM_DISTINCT = 3   # the first piece (embedding), the middle ones (layer to layer), the last (final norm)
TOY = {"model": "ToyDecoder", "num_layers": NUM_LAYERS, "hidden": 32, "num_heads": 4, "num_kv_heads": 2}
TOKEN_COUNTS = [1, 2, 5, 16, 37, 128]


def make_toy(seed: int = 0) -> ToyDecoder:
    torch.manual_seed(seed)
    return ToyDecoder(num_layers=NUM_LAYERS).eval()


def toy_batch(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (num_tokens,), generator=gen), torch.randint(0, 4096, (num_tokens,), generator=gen)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("compile_cache")


@pytest.fixture(scope="module")
def compiled(cache_root):
    """One compile shared by the module: the toy model, its CompiledModel (pieces wrapped for CUDA graphs, which
    pass through on a CPU), and the dynamo counters before the first call."""
    model = make_toy()
    manager = CUDAGraphManager("cpu")
    key = compile_cache_key(TOY, torch.float32)
    before_breaks = sum(counters["graph_break"].values())
    before_graphs = counters["stats"]["unique_graphs"]
    fn = compile_model(model, "default", cache_key=key, cache_root=cache_root, graph_manager=manager)
    ids, pos = toy_batch(16, seed=1)
    with torch.inference_mode(), forward_context(toy_forward_context(model)):
        fn(ids, pos)
    return model, fn, before_breaks, before_graphs


def test_split_into_layers_plus_one_pieces_without_graph_break(compiled):
    model, fn, before_breaks, before_graphs = compiled
    assert fn.stats.num_graphs == 1
    assert fn.stats.num_pieces == NUM_LAYERS + 1
    assert fn.stats.num_distinct == NUM_DISTINCT
    assert fn.stats.artifacts_saved == NUM_DISTINCT
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


def test_first_call_needs_two_tokens(tmp_path):
    model = make_toy()
    fn = CompiledModel(model, cache_key="unused", cache_root=tmp_path)
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


def test_cache_key_depends_on_config_dtype_source_and_settings(tmp_path):
    key = compile_cache_key(TOY, torch.float32)
    assert key == compile_cache_key(dict(reversed(list(TOY.items()))), torch.float32)   # key order does not matter
    assert key != compile_cache_key(TOY, torch.bfloat16)
    assert key != compile_cache_key({**TOY, "num_layers": 3}, torch.float32)
    assert key != compile_cache_key(TOY, torch.float32, settings={"passes": {"fuse_rms_norm": False}})
    assert key != compile_cache_key(TOY, torch.float32, settings={"capture_sizes": [1, 2, 4]})
    assert key == compile_cache_key(TOY, torch.float32, source_hash=ember_source_hash())
    assert len(key) == 16
    # an edit to any source file changes the source hash, hence the key
    (tmp_path / "graphs").mkdir()
    (tmp_path / "llm.py").write_text("LIMIT = 1\n")
    (tmp_path / "graphs" / "compile.py").write_text("SPLIT = True\n")
    before = ember_source_hash(tmp_path)
    assert ember_source_hash(tmp_path) == before
    (tmp_path / "graphs" / "compile.py").write_text("SPLIT = False\n")
    after = ember_source_hash(tmp_path)
    assert after != before
    assert compile_cache_key(TOY, torch.float32, source_hash=before) != \
        compile_cache_key(TOY, torch.float32, source_hash=after)


def test_cache_scope_sets_and_restores_the_inductor_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    with inductor_cache_scope(tmp_path / "k"):
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "k")
        # Triton's folder stays its own, not one Inductor derives from the scope's folder
        assert triton_cache_dir(0) == os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "home" / ".triton" / "cache")
        from torch._inductor import config
        assert config.fx_graph_cache is True
        assert config.triton.autotune_pointwise is False    # one tile a pointwise kernel: no config sweep
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"
    assert config.triton.autotune_pointwise is True
    assert (tmp_path / "k").is_dir()


def test_piece_signature_groups_the_repeated_layers():
    model = ToyDecoder(num_layers=3)
    split, pieces, _ = split_at_attention(torch.fx.symbolic_trace(model))
    # symbolic_trace keeps the weights as get_attr constants: each layer's middle piece differs by content only
    signatures = [piece_signature(getattr(split, name), ()) for name in pieces]
    assert len(set(signatures)) == len(pieces)
    assert group_pieces(["a", "b", "a", "a", "c"]) == [0, 1, 0, 0, 2]


def run_both(fn, model, num_tokens, seed):
    ids, pos = toy_batch(num_tokens, seed=seed)
    with torch.inference_mode(), forward_context(toy_forward_context(model)):
        return fn(ids, pos), model(ids, pos)


def test_distinct_pieces_compile_once_and_match_the_undeduplicated_compile(compiled, cache_root):
    model, fn, _, _ = compiled
    # the same Inductor cache: the undeduplicated build recompiles only the middle pieces it has not seen
    plain = CompiledModel(model, cache_key=compile_cache_key(TOY, torch.float32), cache_root=cache_root,
                          dedupe=False, use_artifacts=False)
    for num_tokens in (2, 7, 33):
        got, want = run_both(fn, model, num_tokens, seed=num_tokens)
        reference, _ = run_both(plain, model, num_tokens, seed=num_tokens)
        torch.testing.assert_close(got, reference, rtol=0, atol=0)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert plain.stats.num_pieces == fn.stats.num_pieces == NUM_LAYERS + 1
    assert plain.stats.num_distinct == NUM_LAYERS + 1
    assert fn.stats.num_distinct == NUM_DISTINCT < fn.stats.num_pieces
    assert plain.stats.artifacts_saved == 0


def test_second_build_loads_artifacts_without_tracing(compiled, cache_root, caplog):
    model, fn, _, _ = compiled
    again = make_toy()
    second = compile_model(again, "default", cache_key=compile_cache_key(TOY, torch.float32), cache_root=cache_root,
                           graph_manager=CUDAGraphManager("cpu"))
    graphs_before, frames_before = counters["stats"]["unique_graphs"], counters["frames"]["total"]
    with caplog.at_level(logging.INFO, logger="ember"):
        for num_tokens in (9, 2, 40):
            got, want = run_both(second, again, num_tokens, seed=num_tokens)
            first, _ = run_both(fn, model, num_tokens, seed=num_tokens)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            torch.testing.assert_close(got, first, rtol=0, atol=0)
    # no dynamo frame was traced and the backend never ran: the split graph and its pieces came from disk
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert counters["frames"]["total"] == frames_before
    assert second.stats.num_graphs == 0 and second.stats.backend_seconds == 0
    assert second.stats.artifacts_loaded == NUM_DISTINCT
    assert second.stats.num_pieces == NUM_LAYERS + 1 and second.stats.num_attention_splits == NUM_LAYERS
    wrapped = [v for v in vars(second.split_module).values() if isinstance(v, CUDAGraphWrapper)]
    assert len(wrapped) == NUM_LAYERS + 1
    message = next(r.getMessage() for r in caplog.records if "loaded from compiled artifacts" in r.getMessage())
    assert message.startswith(f"{NUM_LAYERS + 1} pieces, {NUM_DISTINCT} distinct")


@pytest.mark.parametrize("damaged", ["piece-1.bin", "manifest.json", "split.pkl"])
def test_a_truncated_artifact_recovers_by_recompiling(compiled, cache_root, tmp_path, caplog, damaged):
    model, fn, _, _ = compiled
    key = compile_cache_key(TOY, torch.float32)
    entry = Path(fn.cache_dir).name     # the key plus the enabled fusion passes
    shutil.copytree(cache_root / "compile" / entry, tmp_path / "compile" / entry)
    path = tmp_path / "compile" / entry / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    again = make_toy()
    with caplog.at_level(logging.WARNING, logger="ember"):
        rebuilt = CompiledModel(again, cache_key=key, cache_root=tmp_path)
        got, want = run_both(rebuilt, again, 12, seed=12)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert any("unusable" in r.getMessage() and "compiling again" in r.getMessage() for r in caplog.records)
    assert rebuilt.stats.num_graphs == 1 and rebuilt.stats.artifacts_loaded == 0
    assert rebuilt.stats.artifacts_saved == NUM_DISTINCT
    # the recompile rewrote the entry: the next build loads it
    third = CompiledModel(make_toy(), cache_key=key, cache_root=tmp_path)
    run_both(third, again, 5, seed=5)
    assert third.stats.artifacts_loaded == NUM_DISTINCT


def test_a_changed_pass_setting_uses_another_cache_entry(tmp_path):
    key = compile_cache_key(TOY, torch.float32)
    default = CompiledModel(make_toy(), cache_key=key, cache_root=tmp_path)
    without = CompiledModel(make_toy(), cache_key=key, cache_root=tmp_path, disabled_fusions=("all",))
    assert default.cache_dir != without.cache_dir
    assert default.cache_dir.name.startswith(key) and without.cache_dir.name.startswith(key)
    assert CompiledModel(make_toy(), cache_key=key, cache_root=tmp_path).cache_dir == default.cache_dir
