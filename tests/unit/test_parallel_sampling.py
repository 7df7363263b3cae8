"""SamplingParams(n=N): N completions of one prompt, each equal to a request of n=1 with the derived seed; the
prompt is prefilled once (the other samples compute only the tail past its last full block), with prefix caching
on or off; aborts, failures and early-closed streams leave nothing behind."""

import json

import pytest

from ember import LLM, SamplingParams
from ember.engine.engine import EngineStepError
from ember.engine.sample_group import sample_request_id
from tests.helpers.engine_checks import assert_engine_holds_nothing, drain
from tests.helpers.model_harness import random_hf_model, tiny_config
from tests.helpers.tiny_tokenizer import save_tiny_tokenizer

BLOCK_SIZE = 16
PROMPT_37 = [(7 * i + 3) % 300 + 10 for i in range(37)]    # 2 full blocks and a tail of 5
PROMPT_32 = [(5 * i + 1) % 300 + 10 for i in range(32)]    # whole blocks: the last one is the tail
PROMPT_10 = [(11 * i + 2) % 300 + 10 for i in range(10)]   # shorter than a block: nothing to share
SAMPLED = dict(temperature=1.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("parallel_sampling_llama")
    random_hf_model(tiny_config("llama")).save_pretrained(path)
    save_tiny_tokenizer(path, 320)
    return str(path)


def _llm(folder, **kwargs):
    return LLM(folder, device="cpu", block_size=BLOCK_SIZE, **kwargs)


def _tokens(llm, prompt, params):
    outs = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return [c.token_ids for c in outs[0].outputs]


def _count_prompt_tokens(engine) -> list[int]:
    """Wrap the scheduler so that the returned list counts every prompt token scheduled for computation."""
    counted = [0]
    real = engine.scheduler.schedule

    def schedule():
        out = real()
        for s in out.scheduled:
            prompt_len = s.request.num_prompt_tokens
            counted[0] += max(0, min(s.num_computed_tokens + s.num_new_tokens, prompt_len) - s.num_computed_tokens)
        return out

    engine.scheduler.schedule = schedule
    return counted


@pytest.mark.parametrize("caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_samples_equal_separate_requests_with_derived_seeds(folder, caching, async_scheduling):
    n, seed = 4, 2**63 - 2     # the derived seeds wrap around 2**63
    llm = _llm(folder, enable_prefix_caching=caching, async_scheduling=async_scheduling)
    out = llm.generate({"prompt_token_ids": PROMPT_37}, SamplingParams(n=n, seed=seed, **SAMPLED),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == list(range(n))
    assert all(c.finish_reason == "length" and len(c.token_ids) == 10 for c in out.outputs)
    separate = [_tokens(llm, PROMPT_37, SamplingParams(seed=(seed + i) % 2**63, **SAMPLED))[0] for i in range(n)]
    assert [c.token_ids for c in out.outputs] == separate
    assert len({tuple(t) for t in separate}) == n      # the seeds differ, and so do the samples
    assert_engine_holds_nothing(llm.engine)


def test_unseeded_samples_draw_their_seeds_in_turn(folder):
    # two engines with the same seed draw the same seeds: one for each of n samples, or one per request
    parallel = _tokens(_llm(folder), PROMPT_37, SamplingParams(n=3, **SAMPLED))
    outs = _llm(folder).generate([{"prompt_token_ids": PROMPT_37}] * 3, SamplingParams(**SAMPLED), use_tqdm=False)
    assert parallel == [o.outputs[0].token_ids for o in outs]
    assert len({tuple(t) for t in parallel}) == 3


@pytest.mark.parametrize("caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
@pytest.mark.parametrize("prompt, chunk", [(PROMPT_37, 8192), (PROMPT_37, 16), (PROMPT_32, 8192),
                                           (PROMPT_10, 8192)], ids=["tail5", "tail5_chunked", "tail16", "short"])
def test_prompt_is_prefilled_once(folder, caching, prompt, chunk):
    n = 5
    llm = _llm(folder, enable_prefix_caching=caching, max_num_batched_tokens=chunk)
    counted = _count_prompt_tokens(llm.engine)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=n, seed=3, **SAMPLED), use_tqdm=False)[0]
    shared = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    tail = len(prompt) - shared
    assert 1 <= tail <= BLOCK_SIZE
    assert counted[0] == len(prompt) + (n - 1) * tail
    assert [c.index for c in out.outputs] == list(range(n))
    assert out.num_cached_tokens == 0
    separate = [_tokens(llm, prompt, SamplingParams(seed=3 + i, **SAMPLED))[0] for i in range(n)]
    assert [c.token_ids for c in out.outputs] == separate
    assert_engine_holds_nothing(llm.engine)


def test_greedy_samples_are_identical(folder):
    llm = _llm(folder)
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    one = _tokens(llm, PROMPT_37, SamplingParams(**greedy))[0]
    assert _tokens(llm, PROMPT_37, SamplingParams(n=3, **greedy)) == [one] * 3


def test_samples_outlive_a_leader_that_finishes_first_and_survive_preemption(folder):
    # max_tokens=1, sync: the first sample finishes before the others are admitted, and its blocks stay shared
    llm = _llm(folder, async_scheduling=False, enable_prefix_caching=False)
    counted = _count_prompt_tokens(llm.engine)
    quick = dict(temperature=1.0, max_tokens=1, ignore_eos=True)
    got = _tokens(llm, PROMPT_37, SamplingParams(n=3, seed=9, **quick))
    assert counted[0] == 37 + 2 * 5
    assert got == [_tokens(llm, PROMPT_37, SamplingParams(seed=9 + i, **quick))[0] for i in range(3)]
    assert_engine_holds_nothing(llm.engine)
    # 9 usable blocks of 16: four samples of 37 + 24 tokens need 2 shared blocks and 2 more each
    small = _llm(folder, num_kv_blocks=9, max_model_len=96, enable_prefix_caching=False)
    longer = dict(temperature=1.0, max_tokens=24, ignore_eos=True)
    got = _tokens(small, PROMPT_37, SamplingParams(n=4, seed=5, **longer))
    assert small.engine.stats.num_preemptions > 0
    assert got == [_tokens(llm, PROMPT_37, SamplingParams(seed=5 + i, **longer))[0] for i in range(4)]
    assert_engine_holds_nothing(small.engine)


def test_abort_of_the_request_aborts_every_sample(folder):
    llm = _llm(folder)
    engine = llm.engine
    rid = engine.add_request(PROMPT_37, SamplingParams(n=3, seed=1, **SAMPLED), request_id="r")
    assert engine.num_tracked() == 4
    for _ in range(3):
        engine.step()
    assert engine.abort(rid)
    outputs = drain(engine)
    assert [o.request_id for o in outputs] == ["r"]
    assert outputs[0].finished and [c.finish_reason for c in outputs[0].outputs] == ["abort"] * 3
    assert_engine_holds_nothing(engine)
    # a sample's own id aborts its whole request too; a stream closed early leaves nothing
    engine.add_request(PROMPT_37, SamplingParams(n=2, **SAMPLED), request_id="r")
    engine.step()
    assert engine.abort(sample_request_id("r", 1))
    assert [c.finish_reason for c in drain(engine)[0].outputs] == ["abort"] * 2
    stream = llm.generate_stream({"prompt_token_ids": PROMPT_37}, SamplingParams(n=3, **SAMPLED))
    first = next(stream)
    assert [c.index for c in first.outputs] == [0, 1, 2] and not first.finished
    stream.close()
    drain(engine)
    assert_engine_holds_nothing(engine)


def test_stream_yields_every_sample_once_per_step(folder):
    llm = _llm(folder)
    params = SamplingParams(n=3, seed=4, **SAMPLED)
    outs = list(llm.generate_stream({"prompt_token_ids": PROMPT_37}, params))
    final = outs[-1]
    assert final.finished and all(not o.finished for o in outs[:-1])
    assert [c.token_ids for c in final.outputs] == _tokens(llm, PROMPT_37, params)
    for before, after in zip(outs, outs[1:]):     # each output grows, and no step is repeated
        assert sum(map(len, (c.token_ids for c in after.outputs))) > sum(map(len, (c.token_ids for c in
                                                                                   before.outputs)))
    assert_engine_holds_nothing(llm.engine)


def test_a_failed_step_aborts_the_request_and_names_it(folder, monkeypatch):
    llm = _llm(folder)
    engine = llm.engine
    calls = [0]
    real = engine.runner.execute_async

    def execute_async(step):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected failure")
        return real(step)

    monkeypatch.setattr(engine.runner, "execute_async", execute_async)
    with pytest.raises(EngineStepError, match="injected failure") as info:
        llm.generate({"prompt_token_ids": PROMPT_37}, SamplingParams(n=3, **SAMPLED), use_tqdm=False)
    assert len(info.value.request_ids) == 1 and "#" not in info.value.request_ids[0]
    drain(engine)
    assert_engine_holds_nothing(engine)


def test_chat_and_text_prompts_give_n_completions(folder):
    llm = _llm(folder)
    params = SamplingParams(n=2, seed=11, **SAMPLED)
    chat = llm.chat([{"role": "user", "content": "hello world"}], params, use_tqdm=False)[0]
    assert [c.index for c in chat.outputs] == [0, 1] and chat.prompt.startswith("<|user|>")
    assert [c.token_ids for c in chat.outputs] == [_tokens(llm, chat.prompt_token_ids,
                                                           SamplingParams(seed=11 + i, **SAMPLED))[0]
                                                   for i in range(2)]
    assert all(c.text for c in chat.outputs)
    text = llm.generate(["the capital of france is", "a cat sat"], params, use_tqdm=False)
    assert [len(o.outputs) for o in text] == [2, 2] and text[1].prompt == "a cat sat"


def test_bad_n_is_refused_naming_it(folder):
    with pytest.raises(ValueError, match="n 0 must be at least 1"):
        SamplingParams(n=0)
    llm = _llm(folder, max_num_seqs=4)
    with pytest.raises(ValueError, match="n 5 exceeds max_num_seqs 4"):
        llm.generate({"prompt_token_ids": PROMPT_10}, SamplingParams(n=5), use_tqdm=False)
    with pytest.raises(TypeError, match="best_of"):
        SamplingParams(n=2, best_of=3)
    llm.engine.add_request(PROMPT_10, SamplingParams(), request_id=sample_request_id("x", 1))
    with pytest.raises(ValueError, match="cannot be used with n=2"):
        llm.engine.add_request(PROMPT_10, SamplingParams(n=2), request_id="x")
    drain(llm.engine)
    assert_engine_holds_nothing(llm.engine)


def test_sliding_window_model_shares_the_blocks_its_window_needs(tmp_path):
    # Gemma 2: one layer with a window of 8, one global; the local group shares only the block its window reads
    random_hf_model(tiny_config("gemma2")).save_pretrained(tmp_path)
    llm = _llm(str(tmp_path), enable_prefix_caching=False)
    counted = _count_prompt_tokens(llm.engine)
    got = _tokens(llm, PROMPT_37, SamplingParams(n=3, seed=2, **SAMPLED))
    assert counted[0] == 37 + 2 * 5
    assert got == [_tokens(llm, PROMPT_37, SamplingParams(seed=2 + i, **SAMPLED))[0] for i in range(3)]
    assert_engine_holds_nothing(llm.engine)


def test_server_completions_return_n_choices(folder):
    import httpx
    from tests.helpers.live_server import live_server

    llm = _llm(folder)
    body = {"model": "test-model", "prompt": PROMPT_37, "n": 3, "seed": 6, "max_tokens": 6, "temperature": 1.0,
            "ignore_eos": True}
    offline = llm.generate({"prompt_token_ids": PROMPT_37}, SamplingParams(n=3, seed=6, temperature=1.0,
                                                                        max_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0]
    words = [c.text for c in offline.outputs]
    assert len(set(words)) == 3 and all(words)
    with live_server(llm) as server:
        whole = httpx.post(f"{server.base_url}/completions", json=body, timeout=30).json()
        assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
        assert [c["text"] for c in whole["choices"]] == words
        assert whole["usage"]["completion_tokens"] == 18
        streamed = ["", "", ""]
        with httpx.stream("POST", f"{server.base_url}/completions", json={**body, "stream": True},
                          timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        streamed[choice["index"]] += choice["text"]
        assert streamed == words
        server.wait_idle()
    assert_engine_holds_nothing(llm.engine)
