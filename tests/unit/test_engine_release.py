"""A dropped engine gives its model back: after the last reference to an `LLM` goes, its model (weights) and its
runner (KV cache) are freed, eager and compiled. torch._dynamo keeps every backend it was handed in a process-wide
table, so the compiled forward must not let that table reach the model; it also keeps the traced split module, which
must not keep the compiled pieces it calls."""

import gc
import weakref

import pytest

from ember import LLM, SamplingParams
from tests.helpers.model_harness import random_hf_model, tiny_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("release_llama")
    random_hf_model(tiny_config("llama"), seed=3).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("compile_mode", ["none", "default"])
def test_dropped_llm_frees_its_model_and_runner(folder, compile_mode, tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path))
    llm = LLM(folder, device="cpu", compile_mode=compile_mode)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    runner = llm.engine.runner
    model, kv = weakref.ref(runner.model), weakref.ref(next(iter(runner.layer_states.values())).kv_cache)
    split = getattr(runner.forward_fn, "split_module", None)
    installed = dict(split.__dict__) if split is not None else {}
    pieces = [n.target for n in split.graph.nodes if n.op == "call_module"] if split is not None else []
    assert (compile_mode == "default") == bool(pieces) and all(p in installed for p in pieces)
    del runner, llm, out, installed
    gc.collect()
    assert model() is None, "the model outlived its engine"
    assert kv() is None, "the KV cache outlived its engine"
    # torch._dynamo keeps the traced split module for the life of the process; the compiled pieces it called (and,
    # on CUDA, their PIECEWISE graphs) must not stay with it
    assert not [p for p in pieces if p in split.__dict__], "compiled pieces outlived their engine"
