"""Checks that an engine holds nothing of requests that are gone: no output state, no queued or running request,
no block in use, no per-request block lists, no runner rows."""

from __future__ import annotations


def assert_engine_holds_nothing(engine) -> None:
    """Every request has finished or been aborted: the engine must hold no trace of any of them."""
    assert not engine.has_unfinished(), "the engine has a request or an output left"
    assert engine._in_flight is None, "the engine holds a launched step"
    assert engine.runner.table.num_rows == 0, f"the runner still has rows {engine.runner.table.rows}"
    assert engine.num_tracked() == 0, f"{engine.num_tracked()} requests still tracked"
    s = engine.scheduler
    assert not s.waiting and not s.running and not s.requests, (list(s.waiting), s.running, list(s.requests))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks - 1, \
        f"{engine.kv.num_blocks - 1 - engine.kv.num_free_blocks} blocks still in use"
    for owner in (engine.kv, *engine.kv.managers):
        per_request = {name: value for name, value in vars(owner).items()
                       if name.startswith("req_") and isinstance(value, dict)}
        assert per_request, f"{type(owner).__name__} keeps no per-request table to check"
        for name, table in per_request.items():
            assert not table, f"{type(owner).__name__}.{name} still holds {list(table)}"


def drain(engine) -> list:
    """Step until the engine has nothing left; returns every output it gave."""
    outputs = []
    for _ in range(10_000):
        if not engine.has_unfinished():
            return outputs
        outputs += engine.step()
    raise AssertionError("the engine did not finish within 10000 steps")


def add_mixed_requests(engine, prompts, temperatures, seed: int, max_tokens: int) -> None:
    """One request per prompt, ignoring EOS: the temperatures taken in turn, seeds seed, seed + 1, ..."""
    from ember import SamplingParams
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=temperatures[i % len(temperatures)], seed=seed + i,
                                             max_tokens=max_tokens, ignore_eos=True))
