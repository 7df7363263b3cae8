"""Structured output in the engine: each constrained request's grammar matcher, advanced by its sampled tokens, and
the token bitmask of a step's constrained rows, filled on the host for the runner to apply in its sampler.

The state is token-level and lives here, in the engine, beside the scheduler: a matcher consumes exactly the tokens
that `Scheduler.update` appends to its request (a token of a request preempted or finished while its step ran is
dropped by both). A request waits in the queue until its grammar has compiled (`RequestGrammar.ready`); the
scheduler skips it meanwhile and admits the requests behind it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ember.engine.grammar import GrammarCompiler, check_grammar, llguidance
from ember.engine.request import Request, RequestStatus
from ember.profiling import section
from ember.runner.stream_idle import StreamIdle
from ember.sampling_params import StructuredOutputsParams

logger = logging.getLogger("ember")

# below this many rows a step's tokens and masks are handled one by one: the thread pool's dispatch costs more
PARALLEL_MIN_ROWS = 8
# A/B switch: 0 runs a FULL decode graph's step whole, with its bitmask put before the replay (the device waits)
SPLIT_ENV = "EMBER_GRAMMAR_SPLIT"
COMPILE_POLL_S = 0.05        # the longest an idle engine waits for a compile before it looks at new requests


def check_request(params: StructuredOutputsParams, config, tokenizer) -> None:
    """ValueError naming the problem if an engine of `config` with `tokenizer` cannot serve the grammar (no
    tokenizer, speculative decoding) or it cannot compile."""
    if tokenizer is None:
        raise ValueError("structured output needs the model's tokenizer (its vocabulary), and this engine has none; "
                         "give the model folder a tokenizer or pass tokenizer=")
    if config.speculative is not None:
        raise ValueError("structured output runs without speculative decoding (a grammar would have to check every "
                         "proposed token); serve such requests from an engine without speculative_config")
    check_grammar(params)


class RequestGrammar:
    """One request's grammar: the compile it waits for, then its own matcher (a copy of the compiled one, which
    shares that one's lexer and lock: `lane` tells which)."""
    __slots__ = ("future", "matcher", "error", "lane")

    def __init__(self, future: Future):
        self.future = future
        self.matcher = None
        self.error: str | None = None          # why the matcher refused a token (the request is then ended)
        self.lane = 0

    @property
    def ready(self) -> bool:
        """Whether the grammar has compiled (the request may be scheduled)."""
        if self.matcher is None:
            if not self.future.done() or self.future.exception() is not None:
                return False
            compiled = self.future.result()
            self.matcher = compiled.deep_copy()
            self.lane = id(compiled)
        return True

    @property
    def failed(self) -> BaseException | None:
        """The compile's error, once it has failed."""
        return self.future.exception() if self.future.done() else None

    @property
    def terminated(self) -> bool:
        """Whether the grammar is complete and takes no more tokens (or refused one): the request ends."""
        return self.matcher is not None and (self.error is not None or self.matcher.is_stopped())


@dataclass
class GrammarStats:
    """Counters the benchmark reads: steps with constrained rows (and how each ran), rows filled, and host seconds
    spent waiting for the step in flight before a bitmask, advancing matchers and filling bitmasks."""
    num_steps: int = 0
    num_rows: int = 0
    num_split: int = 0               # FULL decode steps run as the forward, then the bitmask, then the tail
    num_before_forward: int = 0      # FULL decode steps run whole, their bitmask put before the replay
    wait_s: float = 0.0
    advance_s: float = 0.0
    fill_s: float = 0.0


class StructuredOutputs:
    """The engine's structured-output state: the grammar compiler and the requests still compiling."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], threads: int | None = None):
        llg = llguidance()
        threads = threads or max(1, min(16, (os.cpu_count() or 2) - 1))     # the host's cores less the step thread's
        # as many lanes as threads: a step's rows, grouped by lane, give each thread a lock of its own
        self.compiler = GrammarCompiler(hf_tokenizer, vocab_size, eos_token_ids, max_workers=min(4, threads),
                                        max_lanes=threads)
        self.executor = llg.LLExecutor(threads)
        self._compiling: dict[str, tuple[Request, RequestGrammar]] = {}
        self._llg_torch = llg.torch
        self.split = os.environ.get(SPLIT_ENV, "1") != "0"
        self.stats = GrammarStats()
        self.idle: StreamIdle | None = None      # the benchmark sets one to measure the device's idle time

    def attach(self, request: Request) -> None:
        """Start compiling the request's grammar (or find it compiled) and give the request its state."""
        grammar = RequestGrammar(self.compiler.submit(request.sampling_params.structured_outputs))
        request.grammar = grammar
        if not grammar.future.done() or grammar.failed is not None:
            self._compiling[request.request_id] = (request, grammar)

    def wait_for_compiles(self, timeout: float = COMPILE_POLL_S) -> None:
        """Block until a grammar some request waits for has compiled, or `timeout` seconds (new requests and aborts
        are applied between waits)."""
        futures = [grammar.future for _, grammar in self._compiling.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def take_failed(self) -> list[tuple[Request, BaseException]]:
        """Requests whose grammar failed to compile since the last call (the engine ends them)."""
        if not self._compiling:
            return []
        failed = []
        for request_id, (request, grammar) in list(self._compiling.items()):
            if grammar.future.done():
                del self._compiling[request_id]
                if grammar.failed is not None and not request.status.finished:
                    failed.append((request, grammar.failed))
        return failed

    # ---- the step ---------------------------------------------------------------------------------------------
    @torch.inference_mode()     # as `ModelRunner.execute_async`: the compiled forward is always called under it
    def launch(self, runner, out, previous, stats) -> object:
        """Launch a step that has constrained rows, as `ModelRunner.execute_async` does, with its bitmask put where
        the step reads it. The forward never waits for it: a step a FULL decode graph samples runs split (the
        forward alone, the bitmask filled on the host while it runs, then the graph's tail); any other step
        launches its forward, fills the bitmask meanwhile and then samples. With the split off
        (`EMBER_GRAMMAR_SPLIT=0`) a FULL decode step puts its bitmask before its one replay instead, and the device
        waits. `runner`: the model runner, or the tensor-parallel executor, which hands both launches to every
        rank (`runner.constrained_step`); `previous`: the step in flight before it (a `LaunchedStep`), whose
        tokens the bitmask may need."""
        self.stats.num_steps += 1
        idle = self.idle or _NO_IDLE
        launched = runner.launch_forward(out.step, self.split, self.idle)
        self.stats.num_split += launched.route == "split"
        self.stats.num_before_forward += launched.route == "whole"
        num_rows = self._fill(runner, out, previous, stats)
        idle.begin()
        result = runner.launch_sample(launched, num_rows)
        idle.end()
        return result

    def _fill(self, runner, out, previous, stats) -> int:
        """Bring the grammars up to date (waiting for the step in flight if a constrained row needs its token) and
        fill the step's bitmask into the staging buffer of the runner's `GrammarMask`; returns its row count."""
        if (previous is not None and not previous.grammar_advanced and previous.out.step.grammar_rows
                and self.waits_on_step_in_flight(out)):
            start = time.perf_counter()
            try:
                result = previous.handle.result()
            except Exception:   # noqa: BLE001 - the engine meets it again when it processes that step
                result = None
            waited = time.perf_counter() - start
            stats.device_wait_s += waited
            self.stats.wait_s += waited
            if result is not None:
                previous.grammar_advanced = True
                self.advance(previous.out, result.sampled_token_ids)
        start = time.perf_counter()
        with section("ember.grammar_fill"):
            num_rows = self.fill(out, runner.grammar.staging())
        self.stats.fill_s += time.perf_counter() - start
        self.stats.num_rows += num_rows
        return num_rows

    @staticmethod
    def waits_on_step_in_flight(out) -> bool:
        """Whether a constrained row of `out` has a token in the step before it still in flight (its mask needs
        that token): its request counts this step's token and that one as pending."""
        scheduled = out.scheduled
        return any(scheduled[row].request.num_pending > 1 for row in out.step.grammar_rows)

    def advance(self, out, sampled_token_ids) -> None:
        """Feed each constrained request the token it sampled in the step `out`, where `Scheduler.update` appends
        one (the request still runs); a token its grammar refuses ends the request (`RequestGrammar.error`)."""
        start = time.perf_counter()
        pairs = []
        for row in out.step.grammar_rows:
            req = out.scheduled[row].request
            if req.status is RequestStatus.RUNNING and req.grammar.error is None:
                pairs.append((req, int(sampled_token_ids[row])))
        if len(pairs) >= PARALLEL_MIN_ROWS:
            pairs.sort(key=lambda pair: pair[0].grammar.lane)      # a lane's rows together, on one thread
            accepted = self._llg_torch.consume_token_par(self.executor, [(r.grammar.matcher, t) for r, t in pairs])
        else:
            accepted = [r.grammar.matcher.consume_token(t) for r, t in pairs]
        for (req, token), ok in zip(pairs, accepted):
            if not ok:
                req.grammar.error = req.grammar.matcher.get_error() or f"token {token} does not fit the grammar"
                logger.error("request %s: its grammar refused token %d (%s); the request ends", req.request_id,
                             token, req.grammar.error)
        self.stats.advance_s += time.perf_counter() - start

    def fill(self, out, bitmask: torch.Tensor) -> int:
        """Write the next-token bitmask of each constrained row of `out` into `bitmask` [k, words] int32 (row j for
        the step's j-th constrained row); returns k."""
        rows = out.step.grammar_rows
        entries = []
        for j, row in enumerate(rows):
            grammar = out.scheduled[row].request.grammar
            if grammar.error is not None:
                bitmask[j].fill_(-1)        # the request ends before this row's token is read
            else:
                entries.append((grammar.lane, j, grammar.matcher))
        if len(entries) >= 2:
            entries.sort(key=lambda entry: entry[0])     # a lane's rows together, on one thread
            self._llg_torch.fill_next_token_bitmask_par(self.executor, [(m, j) for _, j, m in entries],
                                                        bitmask[:len(rows)])
        elif entries:
            self._llg_torch.fill_next_token_bitmask(entries[0][2], bitmask, entries[0][1])
        return len(rows)

    def close(self) -> None:
        self.compiler.close()


class _NoIdle:
    """`StreamIdle`'s surface, doing nothing (no benchmark is measuring)."""

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass


_NO_IDLE = _NoIdle()
