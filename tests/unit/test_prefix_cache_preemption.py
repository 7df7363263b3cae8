"""Prefix caching under preemption on a tiny random-weight Llama (float32, CPU): a small KV cache forces requests
out and back in, and a request that comes back finds blocks of its own earlier tokens (and of other requests) in
the prefix cache. The greedy tokens must be exactly those of the same engine without prefix caching."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from ember import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 33, 7], list(range(3, 20)), [200], [17, 250, 31, 64, 99, 12, 5, 8, 201]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Two engines over 9 blocks of 8 tokens (72 tokens for every request together): prefix caching on and off."""
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().save_pretrained(path)
    kw = dict(device="cpu", block_size=8, num_kv_blocks=9, max_model_len=64, async_scheduling=False)
    return LLM(str(path), enable_prefix_caching=True, **kw), LLM(str(path), enable_prefix_caching=False, **kw)


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow     # the allocator's order is held in test_kv_cache.py in milliseconds
def test_preempted_request_resumes_from_its_cached_blocks_with_the_same_tokens(engines):
    on, off = engines
    params = SamplingParams(temperature=0.0, max_tokens=47, ignore_eos=True)
    hits, preemptions = on.engine.stats.num_prefix_cache_hits, on.engine.stats.num_preemptions
    got, expected = generate(on, PROMPTS, params), generate(off, PROMPTS, params)
    assert [len(t) for t in got] == [47] * 4
    assert got == expected
    assert on.engine.stats.num_preemptions > preemptions
    assert on.engine.stats.num_prefix_cache_hits > hits          # readmitted requests found their own blocks
    assert on.engine.kv.num_free_blocks == off.engine.kv.num_free_blocks == 9


def shared_prefix_workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Five prompts cut from two random prefixes with random tails, each with its own max_tokens: together they
    need several times the cache."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 320) for _ in range(20)] for _ in range(2)]
    prompts = [rng.choice(prefixes)[:rng.randrange(1, 21)] + [rng.randrange(1, 320) for _ in range(rng.randrange(3))]
               for _ in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(8, 20), ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_caching_keeps_greedy_tokens_under_preemption(engines, seed):
    on, off = engines
    prompts, params = shared_prefix_workload(seed)
    hits, preemptions = on.engine.stats.num_prefix_cache_hits, on.engine.stats.num_preemptions
    got, expected = generate(on, prompts, params), generate(off, prompts, params)
    assert [len(t) for t in got] == [p.max_tokens for p in params]
    assert got == expected
    assert on.engine.stats.num_preemptions > preemptions
    assert on.engine.stats.num_prefix_cache_hits > hits
