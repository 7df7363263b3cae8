"""A stop string inside a run of accepted proposals (n-gram or draft model) ends the output there: the text is the
plain decoding's cut at the stop and no token after it is returned. A tiny random model with the default model's
tokenizer (slow: the tokenizer's conversion is shared with the other slow text tests)."""

import shutil

import pytest

from ember import LLM, SamplingParams
from tests.helpers.model_harness import random_hf_model, tiny_config

pytestmark = pytest.mark.slow

PROMPT = "one two three one two three one two three one two"
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def path(converted, tmp_path_factory):
    path = tmp_path_factory.mktemp("spec_stop_llama")
    random_hf_model(tiny_config("llama", vocab_size=49152, hidden_size=32, intermediate_size=48,
                                num_hidden_layers=1), seed=3).save_pretrained(path)
    for f in converted["folder"].iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith((".jinja", ".txt")):
            shutil.copy(f, path / f.name)
    return str(path)


def _runs(llm) -> tuple[list[int], list[int]]:
    """The greedy tokens, streamed, and the indices of tokens that arrived after another in the same step."""
    engine = llm.engine
    rid = engine.add_request(llm.tokenizer.encode(PROMPT), LONG)
    seen, inside = 0, []
    tokens = []
    while engine.has_unfinished():
        for out in engine.step(stream=True):
            if out.request_id == rid:
                tokens = out.outputs[0].token_ids
                inside += list(range(seen + 1, len(tokens)))
                seen = len(tokens)
    return tokens, inside


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_stop_string_inside_an_accepted_run(path, method):
    plain = LLM(path, device="cpu", max_model_len=128)
    ref = plain.generate(PROMPT, LONG, use_tqdm=False)[0].outputs[0]
    # the draft model is the target itself: it shares the tokenizer, and every proposal is accepted
    spec_config = ({"method": "ngram", "num_speculative_tokens": 4} if method == "ngram" else
                   {"method": "draft_model", "model": path, "num_speculative_tokens": 4})
    spec = LLM(path, device="cpu", max_model_len=128, speculative_config=spec_config)
    tokens, inside = _runs(spec)
    assert tokens == ref.token_ids and inside, "no proposals were accepted"
    tok = spec.tokenizer
    ends = [len(tok.decode(ref.token_ids[:i + 1])) for i in range(len(ref.token_ids))]
    # a stop string ending inside a token that was accepted as part of a run, not found earlier in the text
    for i in inside:
        stop = ref.text[max(ends[i] - 3, 0):ends[i]]
        if stop.strip() and ref.text.find(stop) == ends[i] - len(stop) and ends[i] > ends[i - 1]:
            break
    else:
        pytest.fail("no usable stop string inside an accepted run")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    got = spec.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.text == ref.text[:ends[i] - len(stop)]
    assert got.token_ids == ref.token_ids[:i + 1]          # the token holding the stop, none after it
