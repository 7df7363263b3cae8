"""The decode tail (LM head, general sampling, the write into the request table) that uniform-decode FULL graphs
record: run eagerly on the CPU it samples what the step's own plan-specific sampler samples, for greedy, seeded
and mixed batches, and it writes those tokens where the next step reads them."""

import pytest
import torch
from tests.helpers.engine_checks import add_mixed_requests
from tests.helpers.model_harness import save_tiny_llama

from ember import LLM, SamplingParams
from ember.runner.sampling_inputs import fits_graph_tail

PROMPTS = [[1, 5, 9, 33, 7], [3, 4, 5, 6, 7, 8, 9], [200], [17, 250, 31, 64, 99, 12], [7] * 11]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_tail"))


@pytest.mark.parametrize("temperatures", [(0.0,), (0.9,), (0.0, 0.6, 1.0, 1.5)], ids=["greedy", "seeded", "mixed"])
def test_tail_samples_what_the_step_sampler_samples(tiny_llama, temperatures):
    llm = LLM(tiny_llama, device="cpu", enforce_eager=True, async_scheduling=False)
    engine, runner = llm.engine, llm.engine.runner
    add_mixed_requests(engine, PROMPTS, temperatures, seed=40, max_tokens=8)
    compared = 0
    for _ in range(6):
        out = engine.scheduler.schedule()
        with torch.inference_mode():
            prepared = runner.prepare_step(out.step)
            hidden, tokens = runner._run(prepared.batch)
            assert tokens is None                    # no FULL graph on the CPU: the step samples after the forward
            want = runner.sample_step(prepared, hidden).result().sampled_token_ids
            if out.num_decodes == len(out.scheduled):
                assert fits_graph_tail(prepared.plan)
                n = len(want)
                runner.table.token_ids.view(-1)[prepared.batch.sample_index[:n]] = -1
                got = runner.decode_tail(hidden, n)
                assert got.tolist() == want
                assert runner.table.token_ids.view(-1)[prepared.batch.sample_index[:n]].tolist() == want
                compared += 1
        engine.scheduler.update(out, want)
    assert compared >= 4


def test_plans_beyond_the_graph_sample_after_it(tiny_llama):
    """Top-k/top-p, penalties, min_tokens and logprobs need the full sampler; plain temperature does not."""
    llm = LLM(tiny_llama, device="cpu", enforce_eager=True, async_scheduling=False)
    engine, runner = llm.engine, llm.engine.runner
    cases = {"plain": (dict(temperature=0.7), True), "top_p": (dict(temperature=0.7, top_p=0.9), False),
             "top_k": (dict(temperature=0.7, top_k=5), False), "logprobs": (dict(logprobs=1), False),
             "penalty": (dict(presence_penalty=0.5), False), "min_tokens": (dict(min_tokens=3), False)}
    for name, (kwargs, fits) in cases.items():
        rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4, seed=1, **kwargs))
        out = engine.scheduler.schedule()
        with torch.inference_mode():
            prepared = runner.prepare_step(out.step)
        assert fits_graph_tail(prepared.plan) is fits, name
        engine.abort(rid)
        engine.step()
