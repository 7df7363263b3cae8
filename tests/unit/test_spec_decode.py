"""Speculative decoding with the n-gram proposer on a tiny random Llama (float32, CPU): greedy tokens equal the
non-speculative ones (mixed lengths, chunked prefill, prefix hits, preemption, stop tokens and max_tokens inside
an accepted run), proposals are accepted, and the config refuses bad values by name."""

import logging

import pytest
import torch

from ember import LLM, SamplingParams
from ember.attention_backends.base import CudaGraphSupport
from ember.bench.commands import spec_figures
import ember.graphs.dispatcher as dispatcher_module
from ember.graphs.dispatcher import CudaGraphDispatcher
from ember.graphs.modes import CUDAGraphMode
from ember.speculative_config import SpeculativeConfig
from tests.helpers.spec_cases import PROMPTS, check_stop_token_and_max_tokens, generate_tokens, save_llama

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("spec_llama"))


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    return generate_tokens(llm, prompts, params)


@pytest.fixture(scope="module")
def reference(path):
    return _tokens(LLM(path, device="cpu"))


@pytest.fixture(scope="module")
def spec(path):
    return LLM(path, device="cpu", speculative_config=NGRAM)


def test_greedy_equals_plain_decoding(spec, reference, caplog):
    stats = spec.engine.stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_verified_requests,
              stats.num_generated_tokens)
    steps = stats.num_steps
    with caplog.at_level(logging.INFO, logger="ember"):
        assert _tokens(spec) == reference
    assert stats.num_accepted_tokens - before[1] > 0
    summary = stats.spec_summary()
    assert 0 < summary["acceptance_rate"] <= 1 and summary["mean_acceptance_length"] > 1
    assert any("speculative decoding: acceptance rate" in r.getMessage() for r in caplog.records)
    figures = spec_figures(stats, before, stats.num_steps - steps)
    assert figures["spec_accepted_tokens"] == stats.num_accepted_tokens - before[1]
    # every output token came out of one of the run's steps, several of them a step when proposals were accepted
    assert figures["tokens_per_step"] == sum(map(len, reference)) / (stats.num_steps - steps)
    assert figures["mean_acceptance_length"] > 1


def test_prefix_hits_equal_plain_decoding(spec, reference):
    hits = spec.engine.stats.num_prefix_cache_hits
    # the same prompts again: their full blocks (published after verify steps) are prefix hits now
    assert _tokens(spec) == reference
    assert spec.engine.stats.num_prefix_cache_hits > hits


@pytest.mark.slow
def test_chunked_prefill_and_preemption(path, reference):
    # prefix caching off: in this random model, KV recomputed after a preemption and KV found cached differ in
    # the last bits, and some near-tied logits flip with or without speculation
    llm = LLM(path, device="cpu", speculative_config=NGRAM, max_num_batched_tokens=16, num_kv_blocks=14,
              block_size=8, enable_prefix_caching=False)
    assert _tokens(llm) == reference
    assert llm.engine.stats.num_preemptions > 0 and llm.engine.stats.num_accepted_tokens > 0


def test_stop_token_and_max_tokens_inside_an_accepted_run(spec, reference):
    # a stop token from late in a completion: the output ends at its first occurrence, nothing after it
    check_stop_token_and_max_tokens(spec, reference, 28, (1, 2, 7, 13))


def test_disable_by_batch_size_stops_proposing(path, reference):
    llm = LLM(path, device="cpu", speculative_config={**NGRAM, "disable_by_batch_size": 1})
    assert _tokens(llm) == reference
    # five requests run together at first: no proposals then; the last one alone may speculate
    one = _tokens(llm, PROMPTS[:1])
    assert one == reference[:1] and llm.engine.stats.num_draft_tokens > 0


def _recorded_logits(llm) -> list:
    """Every logits tensor the engine's model computes from now on, in order."""
    model, calls = llm.engine.runner.model, []
    compute = model.compute_logits

    def recorded(hidden):
        out = compute(hidden)
        calls.append(out.detach().clone())
        return out

    model.compute_logits = recorded
    return calls


def test_verify_buckets_pad_without_changing_logits(path, monkeypatch):
    monkeypatch.setattr(dispatcher_module, "VERIFY_BUCKETS", True)
    # the descriptors a FULL-graph dispatcher gives verify steps (R request rows, 5 R tokens), run here without a
    # graph (no CUDA), against the same steps unpadded. The padded GEMMs may round differently and flip a near tie
    # of this random model, after which the two runs part: logits are compared up to that step
    plain = LLM(path, device="cpu", speculative_config=NGRAM)
    llm = LLM(path, device="cpu", speculative_config=NGRAM)
    runner = llm.engine.runner
    # each layer's attention output starts as NaN (it is uninitialised memory): a row the backend leaves unwritten
    # (a padding token's) would carry NaN into the next layer's K/V, which goes to the null block, which real
    # requests read under a zero weight (NaN logits)
    for state in runner.layer_states.values():
        def poisoned(q, k, v, cache, meta, out, forward=state.impl.forward):
            out.fill_(float("nan"))
            forward(q, k, v, cache, meta, out)
        monkeypatch.setattr(state.impl, "forward", poisoned)
    graphs = CudaGraphDispatcher(CUDAGraphMode.FULL, (1, 2, 4, 8, 16, 32, 64), runner.max_num_reqs,
                                 CudaGraphSupport.ALWAYS, verify_query_len=5, max_num_tokens=runner.max_num_tokens)
    unpadded_dispatch, padded_at = runner._dispatch, []
    reference, calls = _recorded_logits(plain), _recorded_logits(llm)

    def dispatch(step):
        mode, desc = graphs.dispatch(step.total_num_tokens, step.num_reqs, step.num_decodes == step.num_reqs,
                                     None, max(step.num_scheduled_tokens))
        if desc.num_reqs is not None and not desc.uniform_decode and desc.num_tokens == 5 * desc.num_reqs:
            if step.total_num_tokens < desc.num_tokens:
                padded_at.append(len(calls))        # the index of this step's logits
            return CUDAGraphMode.NONE, desc
        return unpadded_dispatch(step)

    runner._dispatch = dispatch
    _tokens(plain)
    _tokens(llm)
    compared = 0
    for want, got in zip(reference, calls):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        compared += 1
        if not torch.equal(got.argmax(-1), want.argmax(-1)):
            break
    assert sum(i < compared for i in padded_at) >= 3


@pytest.mark.parametrize("spec, message", [
    ({"method": "draft_model"}, "draft_model"),
    ({"method": "eagle9"}, "eagle9"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens 0"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min 5"),
    ({"method": "ngram", "lookahead": 3}, "'lookahead'"),
    ({"num_speculative_tokens": 3}, "'method'"),
])
def test_bad_config_is_refused_naming_the_value(spec, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(spec)




def test_logprobs_are_the_targets(path, spec):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    plain = LLM(path, device="cpu").generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0]
    before = spec.engine.stats.num_accepted_tokens
    got = spec.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0]
    assert spec.engine.stats.num_accepted_tokens > before
    a, b = plain.outputs[0], got.outputs[0]
    assert a.token_ids == b.token_ids and len(b.logprobs) == 24
    for x, y in zip(a.logprobs, b.logprobs):
        assert list(x) == list(y) and [v.rank for v in x.values()] == [v.rank for v in y.values()]
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert abs(a.cumulative_logprob - b.cumulative_logprob) < 1e-3


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_respects_max_tokens(spec):
    params = SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=20, ignore_eos=True)
    first = _tokens(spec, PROMPTS[:2], params)
    again = _tokens(spec, PROMPTS[:2], params)
    assert first == again and [len(t) for t in first] == [20, 20]
