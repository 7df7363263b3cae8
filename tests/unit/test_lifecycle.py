"""Randomized lifecycle over a small KV cache: arrivals, aborts, preemptions, streamed requests closed early, ids
reused and failing steps, round after round. After each round the engine holds exactly the live requests; every
request gets one final output; finished tokens equal the reference, and aborted ones are a prefix of it."""

import random
from collections import defaultdict, deque

import pytest

from ember import LLM, SamplingParams
from ember.engine.engine import EngineStepError
from tests.helpers.engine_checks import assert_engine_holds_nothing, drain
from tests.helpers.model_harness import random_hf_model, tiny_config

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("lifecycle_llama")
    random_hf_model(tiny_config("llama"), seed=1).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def pool(folder):
    """Prompts (some sharing prefixes, for prefix-cache hits) and their greedy references of MAX_TOKENS tokens."""
    rng = random.Random(0)
    base = [rng.randrange(320) for _ in range(24)]
    prompts = [[rng.randrange(320) for _ in range(rng.randint(1, 20))] for _ in range(8)]
    prompts += [base[:n] + [rng.randrange(320)] for n in (8, 16, 17, 23)]
    llm = LLM(folder, device="cpu", async_scheduling=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


def _lifecycle(folder, pool, seed: int, async_scheduling: bool, rounds: int, monkeypatch):
    prompts, refs = pool
    rng = random.Random(seed)
    # 12 blocks of 8 tokens for up to 6 requests of up to 32 tokens: preemption is routine
    llm = LLM(folder, device="cpu", block_size=8, num_kv_blocks=12, max_model_len=64, max_num_seqs=6,
              max_num_batched_tokens=24, async_scheduling=async_scheduling)
    engine = llm.engine
    real_launch = engine.runner.execute_async

    def flaky_launch(out):
        if rng.random() < 0.04:
            raise RuntimeError("injected launch failure")
        return real_launch(out)

    monkeypatch.setattr(engine.runner, "execute_async", flaky_launch)
    live: dict[str, dict] = {}                  # request id -> what was asked
    waiting_final: dict[str, deque] = defaultdict(deque)   # per id, the requests whose final output is due
    closed_early: set[str] = set()
    counts = defaultdict(int)
    next_id = 0

    def expect_final(rid):
        waiting_final[rid].append(live.pop(rid))

    def take(outputs):
        for out in outputs:
            rid, c = out.request_id, out.outputs[0]
            if not out.finished:
                req = live[rid]
                assert c.token_ids == req["ref"][:len(c.token_ids)]
                req["seen"] += 1
                continue
            req = waiting_final[rid].popleft() if waiting_final[rid] else live.pop(rid)
            counts[c.finish_reason] += 1
            if c.finish_reason == "abort":
                assert req.get("aborted"), f"request {rid} aborted without being asked to"
                assert c.token_ids == req["ref"][:len(c.token_ids)]
            else:
                assert not req.get("aborted") and c.finish_reason == "length"
                assert c.token_ids == req["ref"], f"request {rid}"

    for _ in range(rounds):
        for _ in range(rng.randint(0, 3)):
            k = rng.randrange(len(prompts))
            n = rng.randint(1, MAX_TOKENS)
            # now and then reuse an id that has ended, maybe while its final output is still due
            reusable = [r for r in waiting_final if r not in live]
            rid = rng.choice(reusable) if reusable and rng.random() < 0.3 else f"r{next_id}"
            next_id += 1
            engine.add_request(prompts[k], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                               request_id=rid)
            live[rid] = {"ref": refs[k][:n], "seen": 0, "stream": rng.random() < 0.3}
        for rid in list(live):
            req = live[rid]
            # an abort, or a streamed request whose reader goes away after a token or two
            if rng.random() < 0.08 or (req["stream"] and req["seen"] >= rng.randint(1, 3)):
                req["aborted"] = True
                closed_early.add(rid)
                assert engine.abort(rid)
                expect_final(rid)
        for _ in range(rng.randint(1, 4)):
            try:
                take(engine.step(stream=any(r["stream"] for r in live.values())))
            except EngineStepError as e:
                for rid in e.request_ids:
                    live[rid]["aborted"] = True
                    expect_final(rid)
                counts["failed_steps"] += 1
        assert set(engine.output_processor.states) == set(live)
        assert set(engine.scheduler.requests) == set(live)
        for manager in engine.kv.managers:
            assert set(manager.req_blocks) <= set(live)
        # the runner's rows: live requests, and ended ones whose removal goes with the next step
        assert set(engine.runner.table.rows) <= set(live) | set(engine.scheduler._finished_ids)
        if not live and not engine.has_unfinished():
            assert_engine_holds_nothing(engine)
    monkeypatch.setattr(engine.runner, "execute_async", real_launch)
    take(drain(engine))
    assert not live and not any(waiting_final.values())
    assert_engine_holds_nothing(engine)
    return counts, engine.stats.num_preemptions


def test_lifecycle(folder, pool, monkeypatch):
    counts, preemptions = _lifecycle(folder, pool, seed=5, async_scheduling=True, rounds=16, monkeypatch=monkeypatch)
    # the run exercised what it is meant to
    assert counts["length"] >= 4 and counts["abort"] >= 3 and preemptions >= 1, (counts, preemptions)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 7))
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_lifecycle_long(folder, pool, monkeypatch, seed, async_scheduling):
    counts, preemptions = _lifecycle(folder, pool, seed=seed, async_scheduling=async_scheduling, rounds=80,
                                     monkeypatch=monkeypatch)
    assert counts["length"] >= 20 and counts["abort"] >= 10 and preemptions >= 1, (counts, preemptions)
