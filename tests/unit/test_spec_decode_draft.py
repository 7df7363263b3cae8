"""Speculative decoding with a draft model on tiny random Llamas (float32, CPU): greedy tokens equal the
non-speculative ones (mixed lengths, chunked prefill, a stop token and max_tokens inside an accepted run), the
target drafting for itself has every proposal accepted, and drafts that cannot propose for the target are
refused with the reason."""

import json

import pytest

from ember import LLM, SamplingParams
from ember.spec_decode.draft_model import check_draft
from ember.speculative_config import SpeculativeConfig
from tests.helpers.model_harness import tiny_config
from tests.helpers.spec_cases import (PROMPTS, check_stop_token_and_max_tokens, draft_config as _draft,
                                      generate_tokens, save_llama, save_noisy_llama)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _model(tmp_path_factory, name, **overrides):
    return save_llama(tmp_path_factory.mktemp(name), **overrides)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return _model(tmp_path_factory, "draft_target")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    # a smaller model of the same vocabulary: one layer, half the width, other weights
    return _model(tmp_path_factory, "draft_small", hidden_size=32, intermediate_size=48, num_hidden_layers=1, seed=5)


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    # the target with noise of 5% of each layer weight's spread: it agrees with the target about half the time
    return save_noisy_llama(tmp_path_factory.mktemp("draft_noisy"))


def _tokens(llm, prompts=PROMPTS, params=GREEDY):
    return generate_tokens(llm, prompts, params)


@pytest.fixture(scope="module")
def reference(path):
    return _tokens(LLM(path, device="cpu"))


@pytest.fixture(scope="module")
def self_draft(path):
    return LLM(path, device="cpu", speculative_config=_draft(path))


def test_target_as_its_own_draft_has_every_proposal_accepted(self_draft, reference):
    stats = self_draft.engine.stats
    assert _tokens(self_draft) == reference
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.spec_summary()["acceptance_rate"] == 1.0
    # every verified request emitted its proposals and one more: 5 tokens a step for most of the run
    assert stats.spec_summary()["mean_acceptance_length"] > 4.0


def test_small_draft_equals_plain_decoding(path, small, reference):
    llm = LLM(path, device="cpu", speculative_config=_draft(small, k=3))
    assert _tokens(llm) == reference
    stats = llm.engine.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens


def test_partly_accepted_drafts_with_chunked_prefill_equal_plain_decoding(path, noisy, reference):
    llm = LLM(path, device="cpu", speculative_config=_draft(noisy), max_num_batched_tokens=16, block_size=8)
    assert _tokens(llm) == reference
    # runs cut short part-way: the draft catches up on one token after a rejection, two after a whole run
    assert 0.3 < llm.engine.stats.spec_summary()["acceptance_rate"] < 0.7
    # finished requests gave their draft blocks back
    proposer = llm.engine.scheduler.proposer
    assert proposer.num_free_blocks == proposer.runner.num_blocks - 1 and not proposer._states


def test_prefix_hits_equal_plain_decoding(self_draft, reference):
    stats = self_draft.engine.stats
    hits, drafted, accepted = stats.num_prefix_cache_hits, stats.num_draft_tokens, stats.num_accepted_tokens
    # the same prompts again: the target finds their blocks cached, the draft (which dropped them) runs them anew
    assert _tokens(self_draft) == reference
    assert stats.num_prefix_cache_hits > hits
    assert stats.num_draft_tokens > drafted and stats.num_accepted_tokens - accepted == stats.num_draft_tokens - drafted


@pytest.mark.slow
def test_preemption_equals_plain_decoding(path, reference):
    # prefix caching off, as for the n-gram proposer's preemption test (recomputed and cached KV differ in the last
    # bits); 14 blocks of 8 tokens for the target, and as many for the draft (the target itself, so that proposals
    # are accepted): requests are preempted, and some get no proposals in a step while the draft's pool is short
    llm = LLM(path, device="cpu", speculative_config=_draft(path, k=3), max_num_batched_tokens=16,
              num_kv_blocks=14, block_size=8, enable_prefix_caching=False)
    assert _tokens(llm) == reference
    stats = llm.engine.stats
    assert stats.num_preemptions > 0 and stats.num_accepted_tokens > 0
    proposer = llm.engine.scheduler.proposer
    assert proposer.num_free_blocks == 14 and not proposer._states


@pytest.mark.slow
def test_sampling_is_reproducible_and_respects_max_tokens(self_draft):
    params = SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=20, ignore_eos=True)
    before = self_draft.engine.stats.num_draft_tokens
    first = _tokens(self_draft, PROMPTS[:2], params)
    assert first == _tokens(self_draft, PROMPTS[:2], params) and [len(t) for t in first] == [20, 20]
    assert self_draft.engine.stats.num_draft_tokens > before


def test_stop_token_and_max_tokens_inside_an_accepted_run(self_draft, reference):
    check_stop_token_and_max_tokens(self_draft, reference, 17, (1, 2, 7))


@pytest.mark.parametrize("spec, message", [
    ({"method": "draft_model"}, "needs 'model'"),
    ({"method": "draft_model", "model": "x", "prompt_lookup_max": 3}, "'prompt_lookup_max' is for method 'ngram'"),
    ({"method": "ngram", "model": "x"}, "model 'x' is for method 'draft_model'"),
])
def test_bad_draft_config_is_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(spec)


def test_draft_of_another_vocabulary_or_shorter_context_is_refused(path, tmp_path_factory):
    other = _model(tmp_path_factory, "draft_vocab", vocab_size=384, hidden_size=32, num_hidden_layers=1)
    with pytest.raises(ValueError, match="vocabulary of 384 tokens and the target 320"):
        LLM(path, device="cpu", speculative_config=_draft(other))
    short = _model(tmp_path_factory, "draft_short", max_position_embeddings=64, hidden_size=32, num_hidden_layers=1)
    with pytest.raises(ValueError, match="allows 64 positions .* max_model_len 256"):
        LLM(path, device="cpu", speculative_config=_draft(short))


def _word_tokenizer(folder, words):
    """A word-level tokenizer over `words` saved in `folder`, loaded back as transformers loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                               "unk_token": "[UNK]"}))
    return AutoTokenizer.from_pretrained(str(folder))


def test_draft_with_another_tokenizer_is_refused(tmp_path):
    words = ["[UNK]", "Hello", ",", "world", "!", "The", "quick", "fox"]
    (tmp_path / "target").mkdir()
    (tmp_path / "draft").mkdir()
    target = _word_tokenizer(tmp_path / "target", words)
    config = tiny_config("llama", vocab_size=320)
    _word_tokenizer(tmp_path / "draft", words)
    check_draft(config, tmp_path / "draft", 320, 256, target)       # the same ids: accepted
    _word_tokenizer(tmp_path / "draft", words[:1] + words[2:] + words[1:2])     # "Hello" moved to the end
    with pytest.raises(ValueError, match=r"tokenizes 'Hello, world!' as \[7, 1, 2, 3\] and the target as "
                                         r"\[1, 2, 3, 4\]"):
        check_draft(config, tmp_path / "draft", 320, 256, target)
