"""The draft model under async scheduling on tiny random Llamas (float32, CPU): its steps take their inputs from the
target's table on the device and nothing waits for them on the host; greedy tokens equal plain decoding's with
chunked prefill, preemption, prefix hits, a stop string and max_tokens inside an accepted run; the target drafting
for itself has every proposal accepted; a request whose draft lost step catches up on what its cache misses."""

import pytest

from ember import LLM, SamplingParams
from ember.spec_decode.draft_device import DeviceDraftProposer
from tests.helpers.spec_cases import (PROMPTS, check_stop_string_inside_an_accepted_run,
                                      check_stop_token_and_max_tokens, draft_config as _draft, generate_tokens,
                                      num_overlapped, record_launches, save_llama, save_noisy_llama,
                                      save_word_tokenizer)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("draft_async_target")
    save_llama(p)
    save_word_tokenizer(p)       # one word per id: stop strings without a converted vocabulary
    return str(p)


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    # the target with noise of 5% of each layer weight's spread: it agrees with the target about half the time
    return save_noisy_llama(tmp_path_factory.mktemp("draft_async_noisy"))


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    return generate_tokens(llm, prompts, params)


@pytest.fixture(scope="module")
def reference(path):
    return _tokens(LLM(path, device="cpu"))


@pytest.fixture(scope="module")
def self_draft(path):
    return LLM(path, device="cpu", speculative_config=_draft(path), async_scheduling=True)


def _free_again(llm):
    proposer = llm.engine.scheduler.proposer
    return proposer.num_free_blocks == proposer.runner.num_blocks - 1 and not proposer._states


def test_self_draft_accepts_everything_with_steps_overlapped(self_draft, reference, monkeypatch):
    proposer = self_draft.engine.scheduler.proposer
    assert isinstance(proposer, DeviceDraftProposer) and self_draft.engine.runner.verifier.draft is proposer
    events = record_launches(self_draft.engine.runner, monkeypatch)
    stats = self_draft.engine.stats
    before = stats.num_steps
    assert _tokens(self_draft) == reference
    # every wait is for a target step: the draft's steps are never read on the host
    assert events.count("wait") == events.count("launch")
    steps = stats.num_steps - before
    assert num_overlapped(events) >= steps * 3 // 4
    # the draft is the target: a window at the wrong position would propose other tokens
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.spec_summary()["mean_acceptance_length"] > 4.0
    assert _free_again(self_draft)


def test_partly_accepted_drafts_with_chunked_prefill(path, noisy, reference):
    llm = LLM(path, device="cpu", speculative_config=_draft(noisy), async_scheduling=True,
              max_num_batched_tokens=16, block_size=8)
    assert _tokens(llm) == reference
    # rejections part-way (a 1-token catch-up) and whole runs (2 tokens)
    assert 0.3 < llm.engine.stats.spec_summary()["acceptance_rate"] < 0.7
    assert _free_again(llm)


def test_preemption_equals_plain_decoding(path, reference):
    # prefix caching off (recomputed and cached KV differ in the last bits of this random model); 14 blocks of 8
    # tokens in each pool: requests are preempted, and come back to a draft that has forgotten them
    llm = LLM(path, device="cpu", speculative_config=_draft(path, k=3), async_scheduling=True,
              max_num_batched_tokens=16, num_kv_blocks=14, block_size=8, enable_prefix_caching=False)
    assert _tokens(llm) == reference
    stats = llm.engine.stats
    assert stats.num_preemptions > 0 and stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert _free_again(llm)


def test_prefix_hits_equal_plain_decoding(self_draft, reference):
    stats = self_draft.engine.stats
    hits, drafted, accepted = stats.num_prefix_cache_hits, stats.num_draft_tokens, stats.num_accepted_tokens
    # the target finds the prompts' blocks cached; the draft (which dropped them) copies and runs them anew
    assert _tokens(self_draft) == reference
    assert stats.num_prefix_cache_hits > hits
    assert stats.num_draft_tokens > drafted and stats.num_accepted_tokens - accepted == stats.num_draft_tokens - drafted


def test_stop_token_max_tokens_and_stop_string_inside_an_accepted_run(self_draft, reference):
    check_stop_token_and_max_tokens(self_draft, reference, 17, (1, 2, 7))
    check_stop_string_inside_an_accepted_run(self_draft, reference)
    assert _free_again(self_draft)


def test_speculation_off_at_large_batches_then_caught_up(path, reference, monkeypatch):
    prefill = DeviceDraftProposer._prefill
    jobs = []
    monkeypatch.setattr(DeviceDraftProposer, "_prefill", lambda self, j: jobs.extend(j) or prefill(self, j))
    # more requests than disable_by_batch_size: the first request speculates alone, then not while the others run
    # (their prompts arrive in chunks), and again once the shorter ones are done
    llm = LLM(path, device="cpu", speculative_config={**_draft(path), "disable_by_batch_size": 2},
              async_scheduling=True, max_num_batched_tokens=16)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 20, 4, 8, 6)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[:p.max_tokens] for r, p in zip(reference, params)]
    stats = llm.engine.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0       # the target drafting for itself
    # the first request's draft ran its prompt, then later caught up on output tokens emitted while it did not run
    assert ("0", 0, len(PROMPTS[0]) - 1) in jobs
    assert any(req_id == "0" and len(PROMPTS[0]) < start < end for req_id, start, end in jobs)
    assert _free_again(llm)


def test_seeded_sampling_is_reproducible(self_draft):
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=20, ignore_eos=True)
    before = self_draft.engine.stats.num_draft_tokens
    first = _tokens(self_draft, PROMPTS[:2], seeded)
    assert first == _tokens(self_draft, PROMPTS[:2], seeded) and [len(t) for t in first] == [20, 20]
    assert self_draft.engine.stats.num_draft_tokens > before
