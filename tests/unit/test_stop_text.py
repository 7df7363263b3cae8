"""Text around stops, as in vLLM: min_tokens never deletes a stop string from the middle, streamed text only grows,
a stop token's text is left out; lone surrogates and bad chat messages are refused naming the value.
A tiny random model with the default model's tokenizer (vocabulary 49152)."""

import shutil

import pytest

from ember import LLM, SamplingParams
from tests.helpers.engine_checks import assert_engine_holds_nothing
from tests.helpers.model_harness import random_hf_model, tiny_config

PROMPT = "The quick brown fox"
LONG = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(converted, tmp_path_factory):
    path = tmp_path_factory.mktemp("stop_text_llama")
    random_hf_model(tiny_config("llama", vocab_size=49152, hidden_size=32, intermediate_size=48,
                                num_hidden_layers=1), seed=3).save_pretrained(path)
    for f in converted["folder"].iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith((".jinja", ".txt")):
            shutil.copy(f, path / f.name)
    return LLM(str(path), device="cpu", max_model_len=128)


@pytest.fixture(scope="module")
def full(llm):
    """The greedy completion without stops: (token ids, text)."""
    c = llm.generate(PROMPT, LONG, use_tqdm=False)[0].outputs[0]
    assert c.text == llm.tokenizer.decode(c.token_ids)
    return c.token_ids, c.text


def _token_ends(llm, ids) -> list[int]:
    """Where in the text each output token's text ends."""
    return [len(llm.tokenizer.decode(ids[:i + 1])) for i in range(len(ids))]


def test_min_tokens_keeps_an_early_stop_string(llm, full):
    ids, text = full
    ends = _token_ends(llm, ids)
    stop = text[ends[1] - 2:ends[1]]        # ends within the second token: long before min_tokens
    assert stop.strip()
    c = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, min_tokens=12, stop=[stop],
                                            ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= 12 and c.token_ids == ids[:len(c.token_ids)]
    decoded = llm.tokenizer.decode(c.token_ids)
    assert text.index(stop) < ends[1] and c.text.startswith(text[:ends[1]])     # the early one is kept
    if c.finish_reason == "length":
        assert c.text == decoded
    else:   # a later occurrence, ending after min_tokens, is honoured and cut
        assert c.stop_reason == stop and decoded.startswith(c.text + stop) and len(c.text) >= ends[10]


def _spanning_stop(llm, ids, text) -> tuple[str, int]:
    """A 4-character stop string across a token boundary that does not occur earlier in the text."""
    for end in _token_ends(llm, ids)[1:-1]:
        stop = text[end - 2:end + 2]
        if len(stop) == 4 and text.index(stop) == end - 2:
            return stop, end - 2
    pytest.fail(f"no stop string spans a token boundary of {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_streamed_text_only_grows(llm, full, include):
    ids, text = full
    stop, at = _spanning_stop(llm, ids, text)
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], include_stop_str_in_output=include,
                            ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate_stream(PROMPT, params)]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts
    assert texts[-1] == (text[:at + 4] if include else text[:at])


@pytest.mark.parametrize("how", ["stop_token_ids", "eos"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out(llm, full, monkeypatch, how, include):
    ids, _ = full
    token = ids[5]
    first = ids.index(token)
    kwargs = dict(stop_token_ids=[token]) if how == "stop_token_ids" else {}
    if how == "eos":
        monkeypatch.setattr(llm.engine.core, "eos_token_ids", (token,))   # the core ends requests at EOS
    params = SamplingParams(temperature=0.0, max_tokens=24, skip_special_tokens=False,
                            include_stop_str_in_output=include, **kwargs)
    c = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert c.token_ids == ids[:first + 1] and c.finish_reason == "stop"
    assert c.stop_reason == (token if how == "stop_token_ids" else None)
    assert c.text == llm.tokenizer.decode(ids[:first + 1] if include else ids[:first])


def test_lone_surrogate_prompt(llm):
    with pytest.raises(ValueError, match=r"prompt has a lone surrogate U\+D800 at index 3; text must be valid"):
        llm.generate(["fine", "abc\ud800def"], LONG, use_tqdm=False)
    assert_engine_holds_nothing(llm.engine)


@pytest.mark.parametrize("messages, error, match", [
    ("hello", TypeError, r"messages must be a list of message dicts .*got str 'hello'"),
    (["hi", "there"], TypeError, r"got a list of str starting with 'hi'"),
    ([], ValueError, r"the conversation is empty"),
    ([[{"role": "user", "content": "a"}], []], ValueError, r"conversation 1 is empty"),
    ([{"content": "hi"}], ValueError, r"message 0 of the conversation has no 'role'"),
    ([{"role": "user"}], ValueError, r"message 0 of the conversation has no 'content'"),
    ([{"role": "user", "content": None}], ValueError, r"has content None"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], ValueError,
     r"message 1 of the conversation has role 'robot'; use one of"),
    ([{"role": "user", "content": 5}], TypeError, r"content of message 0 .* must be a str or a list of parts"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], ValueError, r"only text parts"),
    ([{"role": "user", "content": "x\udfffy"}], ValueError, r"lone surrogate U\+DFFF at index 1"),
    ([{"role": "user", "content": "a"}, "b"], TypeError, r"message 1 of the conversation must be a dict"),
])
def test_bad_chat_input(llm, messages, error, match):
    with pytest.raises(error, match=match):
        llm.chat(messages, LONG, use_tqdm=False)
    assert_engine_holds_nothing(llm.engine)


def test_good_chat_input(llm):
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    outs = llm.chat([conversation, [{"role": "user", "content": "Hi"}]],
                    SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
