"""A step that fails aborts its requests with a clear error and the engine goes on serving; aborted, failed and
early-closed requests leave no trace; bad prompts are refused naming the value."""

import numpy as np
import pytest
import torch

from ember import LLM, SamplingParams
from ember.engine.engine import EngineStepError
from ember.runner.output import AsyncModelRunnerOutput
from tests.helpers.engine_checks import assert_engine_holds_nothing, drain
from tests.helpers.model_harness import random_hf_model, tiny_config

PROMPTS = [[1, 5, 9, 33, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [200], [17, 250, 31, 64, 99, 12, 5, 8, 201]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("failures_llama")
    random_hf_model(tiny_config("llama")).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(folder):
    """Each prompt's greedy tokens, generated alone."""
    llm = LLM(folder, device="cpu", async_scheduling=False)
    return [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(folder, request):
    return LLM(folder, device="cpu", async_scheduling=request.param)


class _Boom(RuntimeError):
    pass


def _fail_once(monkeypatch, target, name, on_call: int):
    """Make `target.name` raise _Boom on its `on_call`-th call (1-based), and only then."""
    real = getattr(target, name)
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == on_call:
            raise _Boom(f"injected failure in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapped)


@pytest.mark.parametrize("where", ["launch", "result"])
def test_failed_step_aborts_its_requests_and_the_engine_goes_on(llm, reference, monkeypatch, where):
    engine = llm.engine
    if where == "launch":
        _fail_once(monkeypatch, engine.runner, "execute_async", on_call=3)
    else:
        _fail_once(monkeypatch, AsyncModelRunnerOutput, "result", on_call=3)
    first = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    outputs, errors = [], []
    for _ in range(200):
        if not engine.has_unfinished():
            break
        try:
            outputs += engine.step()
        except EngineStepError as e:
            errors.append(e)
            # a request that arrives after the failure is served in full
            late = engine.add_request(PROMPTS[2], GREEDY)
    assert len(errors) == 1
    err = errors[0]
    assert sorted(err.request_ids) == sorted(first) and isinstance(err.__cause__, _Boom)
    assert "injected failure" in str(err) and all(repr(rid) in str(err) for rid in first)
    by_id = {o.request_id: o for o in outputs}
    assert all(o.finished for o in outputs) and len(outputs) == len(by_id) == 3
    for rid in first:
        assert by_id[rid].outputs[0].finish_reason == "abort"
    assert by_id[late].outputs[0].finish_reason == "length"
    assert by_id[late].outputs[0].token_ids == reference[2]
    assert_engine_holds_nothing(engine)
    monkeypatch.undo()
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == reference


def test_failure_in_one_requests_update_aborts_that_request_only(llm, reference, monkeypatch):
    engine = llm.engine
    bad = engine.add_request(PROMPTS[0], GREEDY)
    good = engine.add_request(PROMPTS[1], GREEDY)
    state = engine.output_processor.states[bad]

    class Breaking(list):
        """The request's tokens, whose third append fails (as a tokenizer error would)."""
        def append(self, token_id):
            if len(self) == 2:
                raise _Boom("taking a token broke")
            super().append(token_id)

    state.token_ids = state.detokenizer.output_ids = Breaking(state.token_ids)
    outputs, errors = [], []
    for _ in range(200):
        if not engine.has_unfinished():
            break
        try:
            outputs += engine.step()
        except EngineStepError as e:
            errors.append(e.request_ids)
    assert errors == [[bad]]
    by_id = {o.request_id: o.outputs[0] for o in outputs}
    assert by_id[bad].finish_reason == "abort" and by_id[bad].token_ids == reference[0][:2]
    assert by_id[good].token_ids == reference[1]
    assert_engine_holds_nothing(engine)


def test_generate_fails_clearly_and_leaves_nothing(llm, reference, monkeypatch):
    _fail_once(monkeypatch, llm.engine.runner, "execute_async", on_call=2)
    with pytest.raises(EngineStepError, match="injected failure in execute_async"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    drain(llm.engine)     # the aborted requests' final outputs
    assert_engine_holds_nothing(llm.engine)
    assert not llm._latest and not llm._streams and not llm._errors
    out = llm.generate({"prompt_token_ids": PROMPTS[3]}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference[3]


def test_interrupted_generate_leaves_nothing(llm, monkeypatch):
    _fail_once(monkeypatch, llm.engine, "step", on_call=3)
    with pytest.raises(_Boom):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert llm.engine.num_tracked() == 0
    outputs = drain(llm.engine)
    assert sorted(o.outputs[0].finish_reason for o in outputs) == ["abort"] * len(PROMPTS)
    assert_engine_holds_nothing(llm.engine)


def test_abort_drops_every_trace_and_the_id_can_be_reused(llm, reference):
    engine = llm.engine
    rid = engine.add_request(PROMPTS[1], GREEDY, request_id="x")
    engine.step()
    engine.step()
    assert engine.abort("x") and not engine.abort("x")
    assert engine.num_tracked() == 0 and not engine.scheduler.requests
    engine.add_request(PROMPTS[3], GREEDY, request_id="x")     # the same id, while the old one's step may run
    outputs = drain(engine)
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outputs] == [("x", "abort"), ("x", "length")]
    assert outputs[0].finished and len(outputs[0].outputs[0].token_ids) <= 2
    assert outputs[1].outputs[0].token_ids == reference[3]
    assert_engine_holds_nothing(engine)


def test_stream_closed_early_leaves_nothing(llm, reference):
    stream = llm.generate_stream({"prompt_token_ids": PROMPTS[0]}, GREEDY)
    assert len(next(stream).outputs[0].token_ids) == 1
    next(stream)
    stream.close()
    assert llm.engine.num_tracked() == 0
    outputs = drain(llm.engine)
    assert [o.outputs[0].finish_reason for o in outputs] == ["abort"]
    assert_engine_holds_nothing(llm.engine)
    assert not llm._latest and not llm._streams


def test_unstarted_stream_queues_nothing(llm):
    stream = llm.generate_stream({"prompt_token_ids": PROMPTS[0]}, GREEDY)
    assert not llm.engine.has_unfinished()
    del stream
    assert_engine_holds_nothing(llm.engine)


def test_two_streams_read_in_turns(llm, reference):
    a = llm.generate_stream({"prompt_token_ids": PROMPTS[0]}, GREEDY)
    b = llm.generate_stream({"prompt_token_ids": PROMPTS[3]},
                            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    seen = {"a": [], "b": []}
    iters = {"a": a, "b": b}
    while iters:
        for name in list(iters):
            out = next(iters[name], None)
            if out is None:
                del iters[name]
            else:
                seen[name].append(out)
    for name, ref, n in (("a", reference[0], 8), ("b", reference[3][:5], 5)):
        # outputs are cumulative: a stream read late gets the latest, so lengths may skip but only grow
        lengths = [len(o.outputs[0].token_ids) for o in seen[name]]
        assert lengths == sorted(set(lengths)) and lengths[-1] == n and len(lengths) >= n // 2
        assert seen[name][-1].finished and seen[name][-1].outputs[0].token_ids == ref
        assert not any(o.finished for o in seen[name][:-1])
    assert_engine_holds_nothing(llm.engine)


def test_stream_alongside_generate(llm, reference):
    stream = llm.generate_stream({"prompt_token_ids": PROMPTS[0]}, GREEDY)
    first = next(stream)
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == reference[1:]
    rest = list(stream)
    assert len(first.outputs[0].token_ids) == 1
    assert rest[-1].finished and rest[-1].outputs[0].token_ids == reference[0]
    assert_engine_holds_nothing(llm.engine)


@pytest.mark.parametrize("prompts, error, match", [
    (None, TypeError, r"prompts must be .*got NoneType None"),
    (5, TypeError, r"prompts must be .*got int 5"),
    ([None], TypeError, r"a prompt must be .*got NoneType None"),
    ({"prompt_token_ids": None}, TypeError, r"prompt_token_ids must be a list of int, got NoneType None"),
    ({"prompt_token_ids": [1, 2.5]}, TypeError, r"prompt_token_ids entry must be an int, got float 2.5"),
    ({"prompt_token_ids": "12"}, TypeError, r"prompt_token_ids must be a list of int, got str '12'"),
    ({"prompt": 12}, TypeError, r"prompt must be a str, got int 12"),
    ([[1, 2], [3, True]], TypeError, r"prompt_token_ids entry must be an int, got bool True"),
])
def test_wrong_prompt_types(llm, prompts, error, match):
    with pytest.raises(error, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_engine_holds_nothing(llm.engine)


def test_wrong_sampling_params_type(llm):
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams, got dict"):
        llm.generate({"prompt_token_ids": [1, 2]}, {"temperature": 0}, use_tqdm=False)
    assert_engine_holds_nothing(llm.engine)


@pytest.mark.parametrize("make", [np.array, lambda ids: torch.tensor(ids), lambda ids: [np.int64(t) for t in ids]])
def test_numpy_and_torch_ids_are_ids(llm, reference, make):
    out = llm.generate({"prompt_token_ids": make(PROMPTS[3])}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference[3] and out[0].prompt_token_ids == PROMPTS[3]
    assert all(type(t) is int for t in out[0].prompt_token_ids)
    out = llm.generate([np.int32(t) for t in PROMPTS[0]], GREEDY, use_tqdm=False)     # one prompt of numpy ints
    assert len(out) == 1 and out[0].outputs[0].token_ids == reference[0]


def test_unsupported_device(folder):
    with pytest.raises(ValueError, match=r"device 'tpu' is not supported; use 'cpu', 'cuda' or 'auto'"):
        LLM(folder, device="tpu")
