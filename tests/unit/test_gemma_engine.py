"""Gemma 2 and Gemma 3 through the engine (float32, CPU): local and global layers in one batch, with chunked
prefill and prefix caching, give transformers' greedy tokens."""

import pytest
import torch

from ember import LLM, SamplingParams
from tests.helpers.model_harness import random_hf_model, tiny_config

PROMPTS = [list(range(40, 63)), [5, 17, 300], [int(t) for t in torch.arange(30) * 7 % 320], list(range(40, 60))]
NEW_TOKENS = 20


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_greedy_tokens_equal_transformers(family, tmp_path):
    hf = random_hf_model(tiny_config(family))
    hf.save_pretrained(tmp_path)
    # 16-token steps split the longer prompts into chunks; the last prompt shares a cached 16-token prefix
    llm = LLM(str(tmp_path), device="cpu", block_size=8, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
