"""A dropped engine gives its GPU memory back: after the last reference to a compiled, graph-captured `LLM` goes,
its model and KV cache are freed and the memory torch has allocated falls back to where it was before it."""

import gc
import weakref

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_dropped_engine_gives_its_gpu_memory_back(tmp_path, monkeypatch):
    from ember import LLM, SamplingParams
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path))
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    llm = LLM("qwen3-0.6b", load_format="dummy", max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
              gpu_memory_utilization=0.3)
    outs = llm.generate([[5, 6, 7, 8]] * 4, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    held = torch.cuda.memory_allocated() - base
    runner = llm.engine.runner
    model, kv = weakref.ref(runner.model), weakref.ref(next(iter(runner.layer_states.values())).kv_cache)
    del runner, llm, outs
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated() - base
    print(f"engine held {held / 2**20:.0f} MiB; {left / 2**20:.0f} MiB left after it was dropped")
    assert model() is None, "the model outlived its engine"
    assert kv() is None, "the KV cache outlived its engine"
    assert left < 0.02 * held, f"{left / 2**20:.0f} of {held / 2**20:.0f} MiB still allocated"


def test_an_engine_after_a_dropped_one_sizes_its_cache_as_the_first(tmp_path, monkeypatch):
    """`del llm; llm = LLM(...)` with the cycle collector off in between (as when no pass happens to run): the second
    engine's KV cache is as large as the first's, not sized around the first's weights and cache."""
    from ember import LLM
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path))
    kwargs = dict(load_format="dummy", max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
                  gpu_memory_utilization=0.6)
    gc.collect()
    torch.cuda.empty_cache()
    first = LLM("qwen3-0.6b", **kwargs)
    blocks = first.engine.runner.num_blocks
    enabled = gc.isenabled()
    gc.disable()
    try:
        del first
        second = LLM("qwen3-0.6b", **kwargs)
        again = second.engine.runner.num_blocks
    finally:
        if enabled:
            gc.enable()
    del second
    gc.collect()
    torch.cuda.empty_cache()
    print(f"KV blocks: first engine {blocks}, the one after it {again}")
    assert again >= 0.95 * blocks, f"{again} blocks after a dropped engine, {blocks} before"


def test_a_large_engine_after_a_dropped_one_loads_its_weights(tmp_path, monkeypatch):
    """`del llm; llm = LLM(...)` with the cycle collector off in between and the first engine holding most of the
    device: the second engine's weights (Llama-3.1-8B's 16 GB) need the first's memory back before they load."""
    from ember import LLM, SamplingParams
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path))
    kwargs = dict(load_format="dummy", max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                  gpu_memory_utilization=0.9, enforce_eager=True)
    gc.collect()
    torch.cuda.empty_cache()
    first = LLM("qwen3-0.6b", **kwargs)
    first.engine.runner.owner = first        # a reference cycle, as a compiled engine's are: only the collector frees it
    free, total = torch.cuda.mem_get_info()
    assert free < 16e9, f"the first engine left {free / 2**30:.1f} GiB free: the case needs less than 8B's weights"
    enabled = gc.isenabled()
    gc.disable()
    try:
        del first
        second = LLM("llama-3.1-8b", **kwargs)
        out = second.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=2),
                              use_tqdm=False)
    finally:
        if enabled:
            gc.enable()
    assert len(out[0].outputs[0].token_ids) == 2
    del second
    gc.collect()
    torch.cuda.empty_cache()
