"""Tensor parallelism over every family ember runs (tiny random models, float32, CPU, gloo): greedy tokens and
teacher-forced logits of two ranks against one; the KV-sharing tail; four ranks with two KV heads (each replicated
on two ranks); the compiled forward; a model the ranks cannot split, refused before any worker starts; and a worker
that stops answering. Slow: each case starts a worker process."""

import os
import signal
import time

import pytest

from ember import LLM, SamplingParams
from tests.helpers.model_harness import random_hf_model, tiny_config
from tests.unit.test_tensor_parallel import LOGITS_ATOL, PROMPTS, run_both

pytestmark = pytest.mark.slow

FAMILIES = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {"num_key_value_heads": 2}, "gemma": {}, "gemma2": {},
    "gemma3": {}, "llama_kv_sharing": {"num_hidden_layers": 4, "num_kv_shared_layers": 2},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_gives_one_ranks_tokens_on_two(family, tmp_path):
    random_hf_model(tiny_config(family.split("_")[0], **FAMILIES[family])).save_pretrained(tmp_path)
    (one, _, one_logits, _), (two, _, two_logits, _) = run_both(str(tmp_path), device="cpu")
    assert all(len(t) == 32 for t in two) and two == one
    assert (two_logits - one_logits).abs().max().item() <= LOGITS_ATOL


def test_four_ranks_replicate_two_kv_heads(tmp_path):
    random_hf_model(tiny_config("llama")).save_pretrained(tmp_path)
    one = LLM(str(tmp_path), device="cpu")
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, SamplingParams(
        temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)]
    four = LLM(str(tmp_path), device="cpu", tensor_parallel_size=4)
    try:
        attn = four.engine.runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        got = [o.outputs[0].token_ids for o in four.generate(PROMPTS, SamplingParams(
            temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)]
    finally:
        four.engine.runner.shutdown()
    assert got == expected


def test_the_compiled_forward_on_two_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE", str(tmp_path / "cache"))
    random_hf_model(tiny_config("qwen3", num_key_value_heads=2)).save_pretrained(tmp_path / "model")
    (one, _, one_logits, _), (two, _, two_logits, _) = run_both(str(tmp_path / "model"), PROMPTS[:2], device="cpu",
                                                          compile_mode="default")
    assert two == one
    assert (two_logits - one_logits).abs().max().item() <= LOGITS_ATOL
    # one rank's artifacts, and each of the two ranks' own (the cache key names the rank and the group's size)
    assert len(list((tmp_path / "cache" / "compile").iterdir())) == 3


def test_a_model_the_ranks_cannot_split_is_refused_before_workers_start(tmp_path):
    random_hf_model(tiny_config("qwen3")).save_pretrained(tmp_path)       # 3 KV heads
    with pytest.raises(ValueError, match="num_key_value_heads 3 is not divisible by tensor_parallel_size 2"):
        LLM(str(tmp_path), device="cpu", tensor_parallel_size=2)


def test_a_worker_that_stops_answering_fails_the_step_after_the_timeout(tmp_path):
    random_hf_model(tiny_config("llama")).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", tensor_parallel_size=2, worker_timeout_s=10.0)
    worker = llm.engine.runner.worker_pids[1]
    try:
        os.kill(worker, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(Exception, match="WorkerFailure") as raised:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert 10.0 <= time.monotonic() - start < 40.0
        assert "out of step" in str(raised.value) or "worker_timeout_s" in str(raised.value)
    finally:
        os.kill(worker, signal.SIGKILL)
        llm.engine.runner.shutdown()


def test_the_jit_warm_up_runs_on_every_rank(tmp_path):
    # the warm-up's steps (CUDA's default, asked for here on the CPU) run through each rank's own runner: a worker's
    # steps leave nothing to wait for on the host
    random_hf_model(tiny_config("llama")).save_pretrained(tmp_path)
    (one, _, one_logits, _), (two, _, two_logits, _) = run_both(str(tmp_path), PROMPTS[:2], device="cpu", jit_warmup=True,
                                                          max_num_seqs=4, max_num_batched_tokens=64)
    assert two == one
    assert (two_logits - one_logits).abs().max().item() <= LOGITS_ATOL
