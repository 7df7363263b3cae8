"""The whole engine through the flash and the per_phase backends (kernels interpreted on the CPU): the reference
backend's greedy tokens, with chunked prefill and decodes mixed in one step, over 64-token pages."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from ember import LLM, SamplingParams


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow   # about a minute in the interpreter
@pytest.mark.parametrize("backend", ["flash", "per_phase"])
def test_backend_through_the_engine_matches_reference(tmp_path, monkeypatch, backend):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = Qwen3Config(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path)
    prompts = [[1, 5, 9, 33, 7], list(range(3, 80)), [200]]   # the long one spans two pages and five chunks
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    common = dict(device="cpu", max_num_batched_tokens=16, block_size=64)
    ref = _generate(LLM(str(tmp_path), attention_backend="torch_ref", **common), prompts, params)
    llm = LLM(str(tmp_path), attention_backend=backend, **common)
    assert llm.engine.runner.attn.backends[0].name == backend
    assert _generate(llm, prompts, params) == ref
