"""Async scheduling: step t+1 is scheduled and launched before step t's tokens reach the host. The outputs must be
exactly those of the synchronous engine, whatever stops, preempts, aborts or chunks the requests."""

import pytest
from tests.helpers.model_harness import save_tiny_llama

from ember import LLM, SamplingParams
from ember.runner.output import AsyncModelRunnerOutput

PROMPTS = [[1, 5, 9, 33, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [200],
           [17, 250, 31, 64, 99, 12, 5, 8, 201], [7] * 23]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_async"))


def _params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=17, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=9, min_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    ]


def _run(llm, params):
    """Per request: (tokens, finish reason, stop reason, logprobs as [(token, rank, value)] per position)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason,
             [[(t, lp.rank, lp.logprob) for t, lp in sorted(d.items())] for d in o.outputs[0].logprobs]
             if o.outputs[0].logprobs else None) for o in outs]


def _assert_same(got, expected):
    """Tokens and reasons exactly; logprobs to float32 rounding (batch shapes differ, so may the matmul order)."""
    assert [g[:3] for g in got] == [e[:3] for e in expected]
    for g, e in zip(got, expected):
        assert (g[3] is None) == (e[3] is None)
        for gp, ep in zip(g[3] or [], e[3] or []):
            assert [(t, r) for t, r, _ in gp] == [(t, r) for t, r, _ in ep]
            assert [v for *_, v in gp] == pytest.approx([v for *_, v in ep], abs=1e-5)


class _LaunchLog:
    """Records the order of step launches and waits for their tokens."""

    def __init__(self, monkeypatch, llm):
        self.events = []
        runner = llm.engine.runner
        launch, result = runner.execute_async, AsyncModelRunnerOutput.result

        def logged_launch(out):
            self.events.append("launch")
            return launch(out)

        def logged_result(handle):
            self.events.append("wait")
            return result(handle)

        monkeypatch.setattr(runner, "execute_async", logged_launch)
        monkeypatch.setattr(AsyncModelRunnerOutput, "result", logged_result)

    @property
    def overlapped_launches(self) -> int:
        """Launches made while an earlier launch's tokens were still unread."""
        unread, count = 0, 0
        for e in self.events:
            if e == "launch":
                count += unread > 0
                unread += 1
            else:
                unread -= 1
        return count


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"max_num_batched_tokens": 6, "enable_prefix_caching": False},                       # chunked prefill
    {"block_size": 8, "num_kv_blocks": 9, "max_model_len": 64, "enable_prefix_caching": False},   # preemption
], ids=["plain", "chunked", "preempting"])
def test_async_outputs_equal_sync(tiny_llama, engine_kwargs, monkeypatch):
    sync = LLM(tiny_llama, device="cpu", async_scheduling=False, **engine_kwargs)
    greedy = sync.generate({"prompt_token_ids": PROMPTS[2]}, SamplingParams(temperature=0, max_tokens=30,
                                                                            ignore_eos=True), use_tqdm=False)
    stop_token = greedy[0].outputs[0].token_ids[11]     # request 2 stops early, while a step is in flight
    expected = _run(sync, _params(stop_token))
    assert expected[2][1] == "stop" and len(expected[2][0]) < 30

    llm = LLM(tiny_llama, device="cpu", async_scheduling=True, **engine_kwargs)
    log = _LaunchLog(monkeypatch, llm)
    _assert_same(_run(llm, _params(stop_token)), expected)
    assert log.overlapped_launches > 0
    if "num_kv_blocks" in engine_kwargs:
        assert llm.engine.stats.num_preemptions > 0
    # nothing leaks: every block is back in the pool
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks - 1


def test_sync_engine_never_overlaps(tiny_llama, monkeypatch):
    llm = LLM(tiny_llama, device="cpu", async_scheduling=False)
    log = _LaunchLog(monkeypatch, llm)
    _run(llm, _params(0))
    assert log.overlapped_launches == 0 and log.events.count("launch") == log.events.count("wait")


def _penalty_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5,
                       ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=30, seed=5, max_tokens=10, presence_penalty=0.8, ignore_eos=True,
                       logprobs=1),
        SamplingParams(temperature=1.0, seed=3, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=13, frequency_penalty=0.7, min_tokens=4, ignore_eos=True),
    ]


@pytest.mark.parametrize("engine_kwargs", [
    {"max_num_seqs": 2},                                                                   # staggered arrivals
    {"max_num_seqs": 3, "max_num_batched_tokens": 6, "enable_prefix_caching": False},      # and chunked prefill
], ids=["staggered", "staggered_chunked"])
def test_penalties_async_equal_sync(tiny_llama, engine_kwargs, monkeypatch):
    """Penalty requests join while others decode (max_num_seqs holds them back) and read their output tokens from
    the device, so async scheduling stays on and the tokens equal the synchronous engine's."""
    sync = LLM(tiny_llama, device="cpu", async_scheduling=False, **engine_kwargs)
    expected = _run(sync, _penalty_params())
    # the penalties change the tokens, or this test would prove nothing
    plain = _run(sync, [SamplingParams(temperature=p.temperature, top_k=p.top_k, seed=p.seed, max_tokens=p.max_tokens,
                                       ignore_eos=True, logprobs=p.logprobs) for p in _penalty_params()])
    assert [e[0] for e in expected[1:3]] != [p[0] for p in plain[1:3]]
    assert expected[4][0] != plain[4][0]

    llm = LLM(tiny_llama, device="cpu", async_scheduling=True, **engine_kwargs)
    log = _LaunchLog(monkeypatch, llm)
    _assert_same(_run(llm, _penalty_params()), expected)
    assert log.overlapped_launches > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks - 1


def test_abort_while_a_step_is_in_flight(tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)
    alone = LLM(tiny_llama, device="cpu", async_scheduling=False).generate(
        {"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(tiny_llama, device="cpu", async_scheduling=True)
    engine = llm.engine
    keep = engine.add_request(PROMPTS[1], params)
    drop = engine.add_request(PROMPTS[3], params)
    engine.step()
    engine.step()                       # the second step is in flight when the abort comes
    assert engine.abort(drop)
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in finished] == [(drop, "abort"), (keep, "length")]
    assert finished[1].outputs[0].token_ids == alone
    assert engine.kv.num_free_blocks == engine.kv.num_blocks - 1
    # the finished request's row leaves the runner's table with the next step's input (here a scoring step)
    assert set(engine.runner.table.rows) <= {keep, drop}
    engine.score(PROMPTS[0])
    assert engine.runner.table.num_rows == 0


def test_streaming_returns_every_token_once(tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM(tiny_llama, device="cpu", async_scheduling=True)
    seen = [len(o.outputs[0].token_ids) for o in llm.generate_stream({"prompt_token_ids": PROMPTS[0]}, params)]
    assert seen == list(range(1, 11))
