"""KV-sharing layers with the prefill skip, compiled and under every CUDA-graph mode: float32 greedy tokens equal
transformers' Llama with its last layers attending over their source layer's keys and values, and the compiled
forward returns the logits tokens' rows only (the tail ran on them alone)."""

import gc

import pytest
import torch
from tests.helpers.kv_sharing_reference import share_kv_in_hf
from tests.helpers.model_harness import random_hf_model, tiny_config

from ember import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODES = {
    "eager": dict(enforce_eager=True),
    # auto graphs without compiled pieces: triton_unified supports graphs ALWAYS, so every bucket is a FULL graph
    "eager_full_graphs": dict(compile_mode="none"),
    "compiled_no_graphs": dict(cudagraph_mode="none"),
    "full_and_piecewise": dict(cudagraph_mode="full_and_piecewise"),
    "piecewise": dict(cudagraph_mode="piecewise"),
    "full": dict(cudagraph_mode="full"),
    "full_lazy": dict(cudagraph_mode="full", cudagraph_capture="lazy"),
}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(model folder, prompts, transformers' greedy tokens), float32 on the GPU without TF32."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    # head_dim 32: inside every backend's range; 6 layers, the last 3 read layer 2's cache
    config = tiny_config("llama", num_hidden_layers=6, num_kv_shared_layers=3, hidden_size=128,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    hf = random_hf_model(config, seed=5)
    path = tmp_path_factory.mktemp("llama_kv_shared_gpu")
    hf.save_pretrained(path)
    share_kv_in_hf(hf, {3: 2, 4: 2, 5: 2})
    hf = hf.cuda()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (3, 9, 17, 40, 75, 130, 1, 33)]
    expected = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    del hf
    gc.collect()
    yield str(path), prompts, expected
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tokens_equal_transformers_with_the_skip(reference, mode, tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path))
    path, prompts, expected = reference
    # a 48-token budget: the longer prompts arrive in chunks beside decodes, in mixed and decode buckets
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=48,
              gpu_memory_utilization=0.3, **MODES[mode])
    runner = llm.engine.runner
    assert runner.skip_prefill
    if mode == "eager_full_graphs":
        assert runner.modes.compile_mode == "none" and runner.modes.cudagraph_mode.name == "FULL"
        assert runner.graphs.graphs_captured[runner.modes.cudagraph_mode] > 0
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    with torch.inference_mode():
        hidden, _ = runner._dummy_forward(40, 3, skip=True)
    assert hidden.shape[0] == 3          # the tail's rows: one per request, not one per token
    del llm
    gc.collect()
    torch.cuda.empty_cache()
