"""The host's grammar work in a decode step, without a model: fill the bitmask of every constrained row and advance
each row's matcher by a token drawn from its mask, as `StructuredOutputs` does in the engine, for rows that all
share one JSON schema and for rows dealt round-robin over N schemas (the schemas of `ember bench throughput
--structured-output json`).

    python benches/grammar_host.py --tokenizer .bench_tokenizer --rows 128 --num-schemas 64 --threads 15

A row whose grammar completes (or refuses nothing but EOS) starts again as a new request. The runs alternate, so
that load from other jobs on the cores falls on each; medians of the per-step milliseconds are printed. --threads
sets the grammar thread pool's size as the engine would size it on a host of threads + 1 cores.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch


class _Request:
    def __init__(self, request_id: str, params):
        self.request_id = request_id
        self.status = SimpleNamespace(finished=False)
        self.sampling_params = SimpleNamespace(structured_outputs=params)
        self.grammar = None


def make_state(tokenizer, vocab_size: int, eos: tuple[int, ...], threads: int):
    """`StructuredOutputs` sized as on a host of threads + 1 cores."""
    from ember.engine import structured_output
    real = os.cpu_count
    os.cpu_count = lambda: threads + 1
    try:
        return structured_output.StructuredOutputs(tokenizer, vocab_size, eos)
    finally:
        os.cpu_count = real


class Walk:
    """`rows` requests over `schemas`, each advanced by random tokens its grammar allows."""

    def __init__(self, state, schemas: list, rows: int, vocab_size: int, seed: int):
        from ember.engine.request import RequestStatus
        self.state, self.schemas, self.vocab_size = state, schemas, vocab_size
        self.rng = random.Random(seed)
        self.num_started = 0
        self.requests = [self._new(j) for j in range(rows)]
        self.running = RequestStatus.RUNNING
        for req in self.requests:
            req.status = RequestStatus.RUNNING
        self.out = SimpleNamespace(step=SimpleNamespace(grammar_rows=tuple(range(rows))),
                                   scheduled=[SimpleNamespace(request=r) for r in self.requests])
        self.bitmask = torch.zeros((rows, -(-vocab_size // 32)), dtype=torch.int32)

    def _new(self, row: int) -> _Request:
        from ember.engine.request import RequestStatus
        req = _Request(f"r{self.num_started}", self.schemas[row % len(self.schemas)])
        self.num_started += 1
        self.state.attach(req)
        req.grammar.future.result()
        assert req.grammar.ready
        req.status = RequestStatus.RUNNING
        return req

    def step(self) -> tuple[float, float]:
        """One step: (fill seconds, advance seconds)."""
        start = time.perf_counter()
        self.state.fill(self.out, self.bitmask)
        filled = time.perf_counter()
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
        tokens = np.empty(len(self.requests), dtype=np.int64)
        for j in range(len(self.requests)):
            allowed = np.flatnonzero(bits[j])
            tokens[j] = allowed[self.rng.randrange(len(allowed))]
        advance = time.perf_counter()
        self.state.advance(self.out, tokens)
        advanced = time.perf_counter()
        for j, req in enumerate(self.requests):
            if req.grammar.terminated:
                self.requests[j] = self.out.scheduled[j].request = self._new(j)
        return filled - start, advanced - advance


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="a fast tokenizer folder (e.g. the default model's)")
    p.add_argument("--vocab-size", type=int, default=151936, help="the model's vocabulary (default Qwen3's)")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--num-schemas", type=int, default=64)
    p.add_argument("--threads", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)))
    p.add_argument("--steps", type=int, default=100, help="steps a round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from transformers import AutoTokenizer
    from ember import StructuredOutputsParams
    from ember.bench.structured import bench_schema
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    eos = (tokenizer.eos_token_id,)
    state = make_state(tokenizer, args.vocab_size, eos, args.threads)
    walks = {
        "one schema": Walk(state, [StructuredOutputsParams(json=bench_schema(0))], args.rows, args.vocab_size, 0),
        f"{args.num_schemas} schemas": Walk(state, [StructuredOutputsParams(json=bench_schema(1000 + i))
                                                    for i in range(args.num_schemas)], args.rows, args.vocab_size, 1)}
    times = {name: ([], []) for name in walks}
    for _ in range(args.rounds):
        for name, walk in walks.items():
            for _ in range(args.steps):
                fill, advance = walk.step()
                times[name][0].append(fill)
                times[name][1].append(advance)
    lanes = getattr(state.compiler, "num_lanes", 0)
    print(f"{args.rows} rows, {args.threads} threads, vocabulary {args.vocab_size}; {lanes} extra lanes compiled")
    for name, (fills, advances) in times.items():
        print(f"{name:>12}: fill {statistics.median(fills) * 1e3:.3f} ms/step, advance "
              f"{statistics.median(advances) * 1e3:.3f} ms/step (medians of {len(fills)} steps; requests started: "
              f"{walks[name].num_started})")
    state.close()


if __name__ == "__main__":
    main()
