"""`echo` in `/v1/completions`, through the official `openai` client against a live server on the default model: the
prompt goes before each completion, and with `logprobs` its tokens' logprobs equal the offline
`SamplingParams(prompt_logprobs=...)`; `max_tokens: 0` generates nothing; a batch of prompts each gets its own; a
stream's first chunk carries the prompt."""

from __future__ import annotations

import httpx
import pytest
import torch

from ember import LLM, SamplingParams
from tests.helpers.live_server import live_server, start_core

PROMPTS = ["The capital of France is", "Water boils at", "A cat sat on the"]
NUM_LOGPROBS = 2
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def llm(converted):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(str(converted["folder"]), device="cpu", max_model_len=64, num_kv_blocks=32, max_num_seqs=4)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def offline(llm):
    """Each prompt's offline output, with prompt logprobs and logprobs, run before any server owns the engine."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=NUM_LOGPROBS,
                            prompt_logprobs=NUM_LOGPROBS)
    return {p: llm.generate(p, params, use_tqdm=False)[0] for p in PROMPTS}


@pytest.fixture(scope="module")
def core(llm):
    """The engine core in a process of its own, shared by this module's servers."""
    client = start_core(llm)
    yield client
    client.shutdown()


@pytest.fixture
def client(llm, offline, core):
    with live_server(llm, core=core) as server:
        yield server.client()


def _expected(llm, ids: list[int], entries) -> dict:
    """The `logprobs` fields that positions with these offline entries must carry."""
    tok = llm.get_tokenizer()
    pieces = [tok.decode([t]) for t in ids]
    offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    tops = [None if e is None else
            {tok.decode([t]): lp.logprob for t, lp in sorted(e.items(), key=lambda item: item[1].rank)
             if lp.rank <= NUM_LOGPROBS}
            for e in entries]
    return {"tokens": pieces, "token_logprobs": [None if e is None else e[t].logprob for t, e in zip(ids, entries)],
            "top_logprobs": tops, "text_offset": offsets}


def _check(logprobs, expected: dict, num_prompt: int) -> None:
    """The prompt's positions within 1e-5 of the offline prompt logprobs; the completion's within 1e-4 of the offline
    logprobs (a batch of several requests decodes with other shapes than one alone)."""
    assert logprobs.tokens == expected["tokens"]
    assert logprobs.text_offset == expected["text_offset"]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, len(expected["tokens"])):
        tol = 1e-5 if i < num_prompt else 1e-4
        assert logprobs.token_logprobs[i] == pytest.approx(expected["token_logprobs"][i], abs=tol)
        got, want = logprobs.top_logprobs[i], expected["top_logprobs"][i]
        assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=tol)


def test_echo_of_a_batch_with_logprobs_equals_the_offline_prompt_logprobs(client, llm, offline):
    out = client.completions.create(model="test-model", prompt=PROMPTS, echo=True, logprobs=NUM_LOGPROBS,
                                    max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    assert len(out.choices) == len(PROMPTS)
    for choice, prompt in zip(out.choices, PROMPTS):
        ref = offline[prompt]
        completion = ref.outputs[0]
        assert choice.text == prompt + completion.text
        ids = ref.prompt_token_ids + completion.token_ids
        expected = _expected(llm, ids, ref.prompt_logprobs + completion.logprobs)
        n = len(ref.prompt_token_ids)
        assert len(choice.logprobs.tokens) == n + MAX_TOKENS
        _check(choice.logprobs, expected, n)
        assert choice.logprobs.text_offset[n] == len(prompt)       # the completion's offsets follow the prompt's
    assert out.usage.prompt_tokens == sum(len(offline[p].prompt_token_ids) for p in PROMPTS)
    assert out.usage.completion_tokens == MAX_TOKENS * len(PROMPTS)


def test_echo_with_max_tokens_0_generates_nothing(client, llm, offline):
    out = client.completions.create(model="test-model", prompt=PROMPTS, echo=True, logprobs=NUM_LOGPROBS,
                                    max_tokens=0)
    for choice, prompt in zip(out.choices, PROMPTS):
        ref = offline[prompt]
        assert (choice.text, choice.finish_reason) == (prompt, "length")
        _check(choice.logprobs, _expected(llm, ref.prompt_token_ids, ref.prompt_logprobs), len(ref.prompt_token_ids))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (
        sum(len(offline[p].prompt_token_ids) for p in PROMPTS), 0)
    plain = client.completions.create(model="test-model", prompt=PROMPTS[0], echo=True, max_tokens=0)
    assert (plain.choices[0].text, plain.choices[0].logprobs, plain.usage.completion_tokens) == (PROMPTS[0], None, 0)
    ids = offline[PROMPTS[1]].prompt_token_ids      # a prompt of token ids echoes their text
    by_ids = client.completions.create(model="test-model", prompt=ids, echo=True, max_tokens=0)
    assert by_ids.choices[0].text == PROMPTS[1]


def test_echo_without_logprobs_prefixes_the_completion(client, offline):
    out = client.completions.create(model="test-model", prompt=PROMPTS[2], echo=True, max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == PROMPTS[2] + offline[PROMPTS[2]].outputs[0].text
    assert out.choices[0].logprobs is None


def test_echo_streamed_sends_the_prompt_first(client, llm, offline):
    prompt = PROMPTS[0]
    chunks = list(client.completions.create(model="test-model", prompt=prompt, echo=True, logprobs=NUM_LOGPROBS,
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    ref = offline[prompt]
    n = len(ref.prompt_token_ids)
    first = chunks[0].choices[0]
    assert first.text.startswith(prompt) and first.logprobs.tokens[:n] == _expected(
        llm, ref.prompt_token_ids, ref.prompt_logprobs)["tokens"]
    assert "".join(c.choices[0].text for c in chunks) == prompt + ref.outputs[0].text
    joined = {key: [v for c in chunks for v in getattr(c.choices[0].logprobs, key)]
              for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    expected = _expected(llm, ref.prompt_token_ids + ref.outputs[0].token_ids,
                         ref.prompt_logprobs + ref.outputs[0].logprobs)
    _check(type("Logprobs", (), joined), expected, n)
    only = list(client.completions.create(model="test-model", prompt=prompt, echo=True, max_tokens=0, stream=True))
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in only] == [(prompt, "length")]


def test_echo_scores_after_the_requests_in_flight(client, llm, offline):
    """Scoring waits for an idle engine: a request in flight finishes, then the echo's values are the offline ones."""
    stream = client.completions.create(model="test-model", prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)                                   # the request is running
    out = client.completions.create(model="test-model", prompt=PROMPTS[0], echo=True, logprobs=NUM_LOGPROBS,
                                    max_tokens=0)
    ref = offline[PROMPTS[0]]
    _check(out.choices[0].logprobs, _expected(llm, ref.prompt_token_ids, ref.prompt_logprobs),
           len(ref.prompt_token_ids))
    assert [c.usage.completion_tokens for c in chunks if c.usage is not None][-1] == 12


def test_max_tokens_0_without_echo_is_refused(client):
    response = httpx.post(f"{client.base_url}completions", json={"prompt": "x", "max_tokens": 0}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "max_tokens 0 must be at least 1"
