"""Structured output inside the engine, on a tiny random Llama with a small byte-level BPE tokenizer (garbage text, a
real byte-level vocabulary, fast steps): async scheduling gives the synchronous engine's tokens, through preemptions
too, with decode steps split as under a FULL decode graph (the forward launched before the bitmask is filled, the
tail after it is put) or run whole with the bitmask put first; a request waits while its grammar compiles without
holding up the others; a grammar that fails to compile in the engine fails its request only; n > 1, EOS only where
the grammar may end, and logprobs under a grammar."""

from __future__ import annotations

import math
import re
from concurrent.futures import Future

import pytest

from ember import LLM, SamplingParams, StructuredOutputsParams
from ember.engine.engine import EngineStepError
from ember.runner.sampling_inputs import fits_graph_tail
from tests.helpers.structured_cases import CHOICES, REGEX, SCHEMA, check_matches, generate_results, save_bpe_llama

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_bpe_llama(tmp_path_factory.mktemp("tiny_llama_bpe"), tie_word_embeddings=True)


def _llm(folder, **kwargs) -> LLM:
    return LLM(str(folder), device="cpu", max_model_len=144, max_num_seqs=16, **kwargs)


@pytest.fixture(scope="module")
def sync_llm(folder):
    return _llm(folder, num_kv_blocks=64)


def _requests() -> list[tuple[list[int], SamplingParams]]:
    kinds = [StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(regex=REGEX),
             StructuredOutputsParams(json=SCHEMA), None]
    out = []
    for i in range(8):
        so = kinds[i % 4]
        # prompts of 20-76 tokens: in a cache of 10 blocks of 16 the longer requests preempt one another
        prompt = [(7 * i + j) % 400 + 3 for j in range(20 + 8 * i)]
        params = SamplingParams(temperature=0.0 if i % 2 == 0 else 0.9, seed=i, max_tokens=40 if so else 16,
                                ignore_eos=so is None, structured_outputs=so)
        out.append((prompt, params))
    return out


def _as_if_full_graphs(runner, monkeypatch) -> None:
    """Make the CPU runner route decode steps as a FULL decode graph's would be (split, or the bitmask first)."""
    monkeypatch.setattr(type(runner), "graph_samples",
                        lambda self, prepared: prepared.desc.uniform_decode and fits_graph_tail(prepared.plan))


@pytest.fixture(scope="module")
def async_llm(folder):
    # a small cache: requests are preempted by recompute and come back with their grammar state
    return _llm(folder, num_kv_blocks=10, async_scheduling=True)


def test_async_scheduling_split_or_whole_gives_the_synchronous_tokens(sync_llm, async_llm, monkeypatch):
    requests = _requests()
    expected = generate_results(sync_llm, requests)
    check_matches(expected, requests)
    assert generate_results(async_llm, requests) == expected   # the grammars compile; cached after
    engine = async_llm.engine
    _as_if_full_graphs(engine.runner, monkeypatch)
    stats, preemptions = engine.structured.stats, engine.stats.num_preemptions
    assert engine.structured.split and stats.num_split == 0
    assert generate_results(async_llm, requests) == expected        # forward, then the bitmask, then the tail
    assert stats.num_split > 20 and stats.num_before_forward == 0
    assert engine.stats.num_preemptions > preemptions
    engine.structured.split = False                     # the bitmask before the forward, the step whole
    try:
        split = stats.num_split
        assert generate_results(async_llm, requests) == expected
        assert stats.num_before_forward > 20 and stats.num_split == split
    finally:
        engine.structured.split = True


def test_a_split_step_launches_its_forward_before_its_bitmask_is_filled(async_llm, monkeypatch):
    engine = async_llm.engine
    runner, structured = engine.runner, engine.structured
    _as_if_full_graphs(runner, monkeypatch)
    log: list[str] = []

    def record(obj, name, event):
        real = getattr(obj, name)

        def recorded(*args, **kwargs):
            log.append(event)
            return real(*args, **kwargs)
        monkeypatch.setattr(obj, name, recorded)

    record(runner, "forward_alone", "forward")
    record(runner, "forward", "forward")
    record(structured, "fill", "fill")
    record(runner.grammar, "put", "put")
    record(runner, "sample_alone", "tail")
    record(runner, "sample_step", "sample")
    requests = [(prompt, params) for prompt, params in _requests() if params.structured_outputs is not None]
    check_matches(generate_results(async_llm, requests), requests)
    steps = "".join({"forward": "F", "fill": "M", "put": "P", "tail": "T", "sample": "S"}[e] for e in log)
    # each constrained step: forward, fill, put, then the tail (a split decode step; sample_alone calls sample_step
    # with the tail's tokens) or the full sampler
    assert steps.replace("FMPTS", "").replace("FMPS", "") == ""
    assert steps.count("FMPTS") > 10 and steps.count("FMPS") > 0
    # the split off: a decode step fills and puts its bitmask before its forward, which the pattern above refuses
    log.clear()
    structured.split = False
    try:
        generate_results(async_llm, requests)
    finally:
        structured.split = True
    steps = "".join({"forward": "F", "fill": "M", "put": "P", "tail": "T", "sample": "S"}[e] for e in log)
    assert steps.count("MPFS") > 10
    # a batch without grammar rows runs as it always did: one forward (a FULL decode graph's replay), its sampling
    log.clear()
    puts = runner.grammar.num_puts
    plain = [(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)) for prompt, _ in requests]
    generate_results(async_llm, plain)
    steps = "".join({"forward": "F", "fill": "M", "put": "P", "tail": "T", "sample": "S"}[e] for e in log)
    assert steps == "FS" * (len(steps) // 2) and len(steps) >= 12 and runner.grammar.num_puts == puts


def test_a_request_waits_for_its_grammar_without_holding_up_the_batch(sync_llm, monkeypatch):
    engine = sync_llm.engine
    compiler = engine.structured.compiler
    gate = Future()
    real_submit = compiler.submit

    def slow_submit(params):
        done = real_submit(params)
        if params.kind != "regex":
            return done
        held = Future()      # the regex's compile finishes only when the test says so
        gate.add_done_callback(lambda _: held.set_result(done.result()))
        return held

    monkeypatch.setattr(compiler, "submit", slow_submit)
    waiting = engine.add_request([5, 6, 7], SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(
        regex=r"[0-9]{4}")))
    other = engine.add_request([8, 9, 10], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finished = {}
    for _ in range(4):
        for out in engine.step():
            finished[out.request_id] = out
    assert other in finished and waiting not in finished
    assert engine.scheduler.waiting[0].request_id == waiting        # it kept its place in the queue
    gate.set_result(None)
    while engine.has_unfinished():
        for out in engine.step():
            finished[out.request_id] = out
    assert re.fullmatch(r"[0-9]{4}", finished[waiting].outputs[0].text)


def test_a_grammar_that_fails_in_the_engine_fails_its_request_only(sync_llm, monkeypatch):
    engine = sync_llm.engine

    def failing(params):
        future = Future()
        future.set_exception(ValueError("the grammar cannot be compiled: too complex"))
        return future

    monkeypatch.setattr(engine.structured.compiler, "submit", failing)
    bad = engine.add_request([5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(regex="x+")))
    good = engine.add_request([7, 8], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    with pytest.raises(EngineStepError) as info:
        engine.step()
    assert info.value.request_ids == [bad] and "too complex" in str(info.value)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    reasons = {o.request_id: o.outputs[0].finish_reason for o in outputs}
    assert reasons == {bad: "abort", good: "length"}


def test_n_samples_eos_only_at_the_end_and_logprobs_under_a_grammar(sync_llm):
    tokenizer = sync_llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    # each sample follows its own grammar state
    out = sync_llm.generate("pick:", SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=30,
                                                    structured_outputs=StructuredOutputsParams(regex=REGEX)),
                            use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(re.fullmatch(REGEX, c.text) for c in out.outputs)
    # a grammar that may end after "ab" or go on to "abab": EOS is allowed only at those points, and the request
    # ends once nothing but EOS may follow
    so = StructuredOutputsParams(regex="(ab){1,2}")
    outs = sync_llm.generate([f"go {i}" for i in range(8)],
                             SamplingParams(temperature=1.0, seed=11, max_tokens=10, structured_outputs=so),
                             use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.text in ("ab", "abab")
        assert eos not in c.token_ids[:-1]
    # logprobs come after the bitmask: the sampled token's are finite, a forbidden token's are -inf
    lp = sync_llm.generate("choose:", SamplingParams(temperature=0, max_tokens=5, logprobs=10,
                                                     structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                           use_tqdm=False)[0].outputs[0]
    assert lp.text in ("yes", "no")
    first = lp.logprobs[0]
    assert math.isfinite(first[lp.token_ids[0]].logprob)
    allowed = [t for t, entry in first.items() if math.isfinite(entry.logprob)]
    assert allowed and all(any(w.startswith(tokenizer.decode([t])) for w in ("yes", "no")) for t in allowed)
    assert sum(entry.logprob == -math.inf for entry in first.values()) >= 10 - len(allowed)
