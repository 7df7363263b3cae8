"""Gemma 2 and Gemma 3 through the engine (float32, CPU): local and global layers in separate KV-cache groups of
one pool give transformers' greedy tokens, with chunked prefill, prefix caching and a pool small enough that
local blocks sliding out of the window are reused."""

import logging

import pytest
import torch

from ember import LLM, SamplingParams
from tests.helpers.model_harness import random_hf_model, tiny_config

PROMPTS = [list(range(40, 63)), [5, 17, 300], [int(t) for t in torch.arange(30) * 7 % 320], list(range(40, 60))]
NEW_TOKENS = 20


def hf_greedy(hf, prompt):
    # an explicit mask: token 0 (the pad id) in a prompt is a token, not padding
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_greedy_tokens_equal_transformers(family, tmp_path):
    hf = random_hf_model(tiny_config(family))
    hf.save_pretrained(tmp_path)
    # 16-token steps split the longer prompts into chunks; 24 blocks of 8 tokens hold all four requests only
    # because the local group keeps just its window (8 tokens) and the chunk in flight
    llm = LLM(str(tmp_path), device="cpu", block_size=8, max_num_batched_tokens=16, num_kv_blocks=24,
              max_model_len=64)
    runner = llm.engine.runner
    assert [g.spec.sliding_window for g in runner.attn.groups] == [8, None]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [hf_greedy(hf, p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.kv.num_free_blocks == 24
    # with room to keep them, the same prompts again hit the prefix cache: the local group resumes from its
    # window's blocks only (null entries before it)
    roomy = LLM(str(tmp_path), device="cpu", block_size=8, max_num_batched_tokens=16, max_model_len=64)
    first = roomy.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    again = roomy.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again] == expected
    assert [o.num_cached_tokens for o in again] == [16, 0, 24, 16]


def test_capacity_of_a_gemma3_shaped_cache_is_logged_and_three_times_full(tmp_path, caplog):
    """5 local layers (window 512) to 1 global: the same pool holds >= 3x the tokens of an all-global cache."""
    config = tiny_config("gemma3", num_hidden_layers=6, sliding_window=512, max_position_embeddings=8192,
                         layer_types=["sliding_attention"] * 5 + ["full_attention"])
    random_hf_model(config).save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="ember"):
        llm = LLM(str(tmp_path), device="cpu", block_size=16, num_kv_blocks=4000, max_num_batched_tokens=512)
    runner = llm.engine.runner
    assert runner.max_model_len == 8192 and runner.attn.slots_per_block == 1 and len(runner.attn.groups) == 6
    held, full = runner.kv_capacity_tokens, runner.kv_full_equivalent_tokens
    # 6 pages per 16 tokens if every layer were global; 512 + 5 * 33 blocks per 8192-token request here
    assert full == 4000 * 16 // 6 and held == 4000 * 8192 // (512 + 5 * 33)
    assert held >= 3 * full
    assert f"KV cache: {held} tokens (full-attention equivalent: {full})" in caplog.text


def test_max_model_len_beyond_the_global_layers_cache_names_both(tmp_path):
    config = tiny_config("gemma2", max_position_embeddings=1024)
    random_hf_model(config).save_pretrained(tmp_path)
    # 20 blocks of 8: a 16-token chunk and the window before it span up to 4 local blocks; 16 are left for the
    # global layer, 128 tokens
    with pytest.raises(ValueError, match="max_model_len 512 exceeds the KV cache capacity of 128 tokens"):
        LLM(str(tmp_path), device="cpu", block_size=8, num_kv_blocks=20, max_num_batched_tokens=16,
            max_model_len=512)


@pytest.mark.slow   # about a minute each in the interpreter
@pytest.mark.parametrize("backend, block_size, prompts", [
    ("triton_unified", 8, PROMPTS),
    ("flash", 64, [list(range(3, 80)), [5, 17, 300], list(range(100, 180))]),   # flash pages are 64 tokens
])
def test_triton_backends_serve_the_groups_like_the_reference(backend, block_size, prompts, tmp_path, monkeypatch):
    """Local blocks released and reused by other requests stay in the device block table before the window: the
    kernels' narrowed loops never read them unmasked."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    random_hf_model(tiny_config("gemma2")).save_pretrained(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # a pool that cannot hold every request's whole history: local blocks are released and handed on
    num_blocks = 24 if block_size == 8 else 6
    common = dict(device="cpu", block_size=block_size, max_num_batched_tokens=16, num_kv_blocks=num_blocks,
                  max_model_len=128)
    requests = [{"prompt_token_ids": p} for p in prompts]
    ref = LLM(str(tmp_path), attention_backend="torch_ref", **common).generate(requests, params, use_tqdm=False)
    llm = LLM(str(tmp_path), attention_backend=backend, **common)
    assert [b.name for b in llm.engine.runner.attn.backends] == [backend, backend]
    got = llm.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
