"""Structured output under tensor parallelism, on two gloo ranks in two processes: rank 0's engine fills the
bitmask and every rank samples under the same rows (broadcast from rank 0's buffer), so a greedy float32 batch that
mixes JSON-schema, regex, choice and unconstrained rows gives one rank's tokens exactly, every constrained output
matching its grammar. Decode steps take the split route (forward, bitmask, tail, as under a FULL decode graph:
`EMBER_GRAMMAR_AS_GRAPH=1`, inherited by the worker), mixed steps sample after their forward, and with the split off
a decode step puts its bitmask first; with shard-local sampling and with the logits gathered. Each constrained step
sends its two parts to the worker and broadcasts once; a batch without grammar rows sends one message a step and
broadcasts nothing."""

from __future__ import annotations

import pytest

from ember import LLM, SamplingParams, StructuredOutputsParams
from ember.runner import grammar_mask
from ember.runner.constrained_step import AS_GRAPH_ENV
from tests.helpers.structured_cases import (CHOICES, REGEX, SCHEMA, check_matches, generate_results,
                                            save_bpe_llama)

pytest.importorskip("llguidance")

KINDS = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
         StructuredOutputsParams(choice=CHOICES), None]
SETTINGS = dict(device="cpu", dtype="float32", max_model_len=144, max_num_seqs=8, num_kv_blocks=64,
                max_num_batched_tokens=64, async_scheduling=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_bpe_llama(tmp_path_factory.mktemp("tiny_llama_bpe_tp"), tie_word_embeddings=False)


def _requests():
    out = []
    for i in range(8):
        so = KINDS[i % 4]
        prompt = [(11 * i + j) % 400 + 3 for j in range(6 + 5 * i)]    # 6-41 tokens: prefills span several steps
        out.append((prompt, SamplingParams(temperature=0.0, max_tokens=40 if so else 12, ignore_eos=so is None,
                                           structured_outputs=so)))
    return out


@pytest.fixture(scope="module")
def expected(folder):
    llm = LLM(str(folder), **SETTINGS)
    requests = _requests()
    results = generate_results(llm, requests)
    check_matches(results, requests)
    return results


class _Recorder:
    """Counts, in rank 0's process, the executor's messages by kind and the bitmask's broadcasts."""

    def __init__(self, executor, monkeypatch):
        self.kinds: list[str] = []
        self.broadcasts: list[int] = []
        real_call, real_broadcast = executor._call, grammar_mask.broadcast_

        def call(kind, message, run):
            self.kinds.append(kind)
            return real_call(kind, message, run)

        def broadcast(x, group):
            self.broadcasts.append(x.shape[0])
            return real_broadcast(x, group)
        monkeypatch.setattr(executor, "_call", call)
        monkeypatch.setattr(grammar_mask, "broadcast_", broadcast)

    def clear(self) -> None:
        self.kinds.clear()
        self.broadcasts.clear()


@pytest.mark.parametrize("shard_local", [True, False])
def test_two_ranks_sample_constrained_rows_as_one_rank(folder, expected, shard_local, monkeypatch):
    monkeypatch.setenv(AS_GRAPH_ENV, "1")         # decode steps split as under a FULL graph, on both ranks
    llm = LLM(str(folder), tensor_parallel_size=2, shard_local_sampling=shard_local, **SETTINGS)
    try:
        engine = llm.engine
        executor = engine.runner
        record = _Recorder(executor, monkeypatch)
        requests = _requests()
        assert generate_results(llm, requests) == expected
        stats = engine.structured.stats
        after = stats.num_steps - stats.num_split - stats.num_before_forward
        assert stats.num_split >= 5 and after >= 1 and stats.num_before_forward == 0
        # each constrained step: its forward and its sampling sent apart, one broadcast of its bitmask rows
        assert record.kinds.count("forward") == record.kinds.count("sample") == stats.num_steps
        assert len(record.broadcasts) == stats.num_steps and min(record.broadcasts) >= 1
        steps = "".join({"forward": "F", "sample": "S"}.get(k, "x") for k in record.kinds)
        assert steps.replace("FS", "").replace("x", "") == ""
        tail = executor.runner.decode_tail.steps
        if shard_local:
            assert tail["shard_local"] > 0
        else:
            assert tail["shard_local"] == 0 and tail["gathered"] > 0

        # the split off: a decode step runs whole, its bitmask put and shared before the forward
        engine.structured.split = False
        split = stats.num_split
        assert generate_results(llm, requests) == expected
        assert stats.num_before_forward >= 5 and stats.num_split == split

        # a batch without grammar rows: one message a step, no broadcast
        record.clear()
        puts = executor.runner.grammar.num_puts
        plain = [(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)) for p, _ in requests]
        assert len(generate_results(llm, plain)) == len(plain)
        assert record.broadcasts == [] and "forward" not in record.kinds and "sample" not in record.kinds
        assert record.kinds.count("execute") >= 6 and executor.runner.grammar.num_puts == puts
    finally:
        llm.engine.runner.shutdown()
