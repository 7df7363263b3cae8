"""N-gram speculation under tensor parallelism on the CPU: two ranks (this process and a worker) over gloo, a tiny
random Llama in float32. Every rank proposes, verifies and writes the same tokens into its own table; rank 0 alone
reads them back. Greedy tokens equal one rank's without speculation over 40 tokens for a batch of mixed lengths,
synchronously (the host's proposals in the step) and under async scheduling (proposals made on the device), with
proposals accepted; a seeded temperature run equals one rank's with speculation."""

import pytest
import torch

from ember import LLM, SamplingParams
from tests.helpers.model_harness import random_hf_model, tiny_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
# repetitive prompts (a random model's greedy continuation of a loop tends to loop: proposals get accepted) and a
# longer one that prefills in chunks; vocabulary 317: the ranks hold 159 and 158 ids (one padding row)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 8], [200],
           list(range(10, 40)) * 2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.5, seed=7, max_tokens=24, ignore_eos=True)
SETTINGS = dict(device="cpu", max_num_batched_tokens=32, block_size=8, max_model_len=128, max_num_seqs=4)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("spec_tp_llama")
    model = random_hf_model(tiny_config("llama", vocab_size=317), seed=0)
    with torch.no_grad():       # peaked logits (the same argmax): sampled proposals get accepted too
        model.lm_head.weight.mul_(10.0)
    model.save_pretrained(p)
    return str(p)


def _run(path, params, **kwargs):
    """(tokens per prompt, figures: accepted proposals, proposals verified, preemptions, rank 0's steps by sampling
    path) of an engine on `SETTINGS` and `kwargs`."""
    llm = LLM(path, **{**SETTINGS, **kwargs})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        stats = llm.engine.stats
        runner = getattr(llm.engine.runner, "driver", llm.engine.runner)
        return [o.outputs[0].token_ids for o in outs], dict(
            accepted=stats.num_accepted_tokens, drafted=stats.num_draft_tokens, preempted=stats.num_preemptions,
            steps=dict(runner.decode_tail.steps))
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def reference(path):
    tokens, figures = _run(path, GREEDY)
    assert figures["drafted"] == 0 and [len(t) for t in tokens] == [40] * len(PROMPTS)
    return tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_two_ranks_speculating_give_one_ranks_greedy_tokens(path, reference, async_scheduling):
    tokens, figures = _run(path, GREEDY, tensor_parallel_size=2, speculative_config=NGRAM,
                           async_scheduling=async_scheduling)
    assert tokens == reference
    # proposals were made, and many of them accepted
    assert figures["accepted"] >= 20 and figures["drafted"] > figures["accepted"], figures
    # the verify steps take the gathered logits (whole rows); the steps without proposals sample shard-local
    steps = figures["steps"]
    assert steps["gathered"] >= 10 and steps["shard_local"] > 0, figures


def test_preemption_under_synchronous_speculation(path, reference):
    # a pool too small for the four requests at once: a preempted request comes back as a new row on every rank,
    # its host count on the worker set anew (no prefix cache: recomputed KV differs from cached KV in the last bits)
    tokens, figures = _run(path, GREEDY, tensor_parallel_size=2, speculative_config=NGRAM, async_scheduling=False,
                           num_kv_blocks=20, enable_prefix_caching=False)
    assert tokens == reference
    assert figures["preempted"] > 0 and figures["accepted"] >= 20, figures


def test_seeded_sampling_equals_one_rank_speculating(path):
    one, one_figures = _run(path, SEEDED, speculative_config=NGRAM, async_scheduling=True)
    two, two_figures = _run(path, SEEDED, tensor_parallel_size=2, speculative_config=NGRAM, async_scheduling=True)
    assert two == one and [len(t) for t in two] == [24] * len(PROMPTS)
    assert two_figures["accepted"] == one_figures["accepted"] >= 10


def test_a_draft_model_under_tensor_parallelism_is_refused_with_the_reason(path):
    from ember.config import EngineConfig, ModelConfig, ParallelConfig
    from ember.speculative_config import SpeculativeConfig
    draft = SpeculativeConfig.from_dict({"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="a draft model runs on one device.*tensor_parallel_size 2"):
        EngineConfig(ModelConfig(path), device="cpu", speculative=draft,
                     parallel=ParallelConfig(tensor_parallel_size=2)).resolve()
    ngram = SpeculativeConfig.from_dict(NGRAM)
    resolved = EngineConfig(ModelConfig(path), device="cpu", speculative=ngram,
                            parallel=ParallelConfig(tensor_parallel_size=2)).resolve()
    assert resolved.speculative.method == "ngram" and resolved.parallel.tensor_parallel_size == 2
