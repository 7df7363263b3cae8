"""The offline engine: validate and add requests, step the engine core, turn its tokens into outputs.

`Engine` is a front end (`OutputProcessor`: text, stop strings, logprobs, samples) over an engine core reached
through a client: in this process by default (`InprocClient`: a step is a call, nothing is copied or sent), or in
processes of its own (`MPClient`). The token-level work (scheduling, the KV cache, the runner) is the core's
(`ember.engine.core`)."""

from __future__ import annotations

import itertools
import random
import time

from ember.config import EngineConfig
from ember.engine.core_io import EngineCoreOutputs, EngineCoreRequest
from ember.engine.output_processor import OutputProcessor, prompt_logprob_entries
from ember.engine.request import Logprob, RequestOutput
from ember.engine.sample_group import sample_seeds
from ember.profiling import section
from ember.sampling_params import SamplingParams, as_int


class EngineStepError(RuntimeError):
    """A step failed. The requests it held were aborted (each gets a final output with finish_reason "abort" from
    the next `step()`); every other request goes on, and so does the engine."""

    def __init__(self, request_ids: list[str], cause: BaseException | None = None, description: str | None = None):
        self.request_ids = request_ids
        description = description or f"{type(cause).__name__}: {cause}"
        super().__init__(f"a step failed with {description}; its requests {request_ids} were aborted and the "
                         f"engine goes on serving the others")


class Engine:
    """Owns the front end's request state and an engine core; `step()` advances every unfinished request by one
    step. `client` is the core behind its client (default: a new core in this process)."""

    def __init__(self, config: EngineConfig, model_path: str, tokenizer=None, hf_config=None,
                 load_format: str = "auto", client=None):
        from ember.engine.core_client import InprocClient
        self.config = config
        self.tokenizer = tokenizer
        if client is None:
            client = InprocClient(config, model_path, hf_config, load_format, tokenizer)
        self.client = client
        self.inproc = isinstance(client, InprocClient)
        info = client.info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.eos_token_ids = info.eos_token_ids
        self.output_processor = OutputProcessor(tokenizer)
        self._rng = random.Random(config.model.seed)
        self._ids = itertools.count()
        self._core_ids = itertools.count()
        self._ready: list[RequestOutput] = []   # outputs made but not yet returned by step(): aborts, failures
        if self.inproc:       # what a step calls, looked up once
            self._core_step, self._stats = client.core.step, client.core.stats

    # ---- the core in this process ------------------------------------------------------------------------------
    @property
    def core(self):
        """The engine core, when it runs in this process."""
        if not self.inproc:
            raise AttributeError("the engine core runs in a process of its own (engine_process=True or "
                                 "data_parallel_size > 1): its scheduler, KV cache and runner are not in this process")
        return self.client.core

    @property
    def runner(self):
        return self.core.executor

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv(self):
        return self.core.kv

    @property
    def _in_flight(self):
        return self.core._in_flight

    @property
    def stats(self):
        return self.core.stats

    @property
    def structured(self):
        """The core's structured-output state (`StructuredOutputs`), made on first use."""
        return self.core.structured

    # ---- requests ---------------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the value and the limit if the request cannot be served (TypeError naming the
        parameter for a value of the wrong type)."""
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len,
                         self.config.scheduler.max_num_seqs)
        if params.structured_outputs is not None:
            self.check_structured_output(params.structured_outputs)

    def check_structured_output(self, structured_outputs) -> None:
        """Raise ValueError naming the problem if the grammar cannot be served (any thread may call it)."""
        from ember.engine.structured_output import check_request
        check_request(structured_outputs, self.config, self.tokenizer)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id."""
        prompt_token_ids = token_id_list(prompt_token_ids)
        self.validate(prompt_token_ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        processor = self.output_processor
        processor.check_id(request_id, params.n)
        seeds = tuple(sample_seeds(params.seed, params.n, self._rng))
        # in another process the core may still run an aborted request of the same id: each gets its own there
        core_id = request_id if self.inproc else f"{request_id}@{next(self._core_ids)}"
        item = processor.make(request_id, core_id, prompt_token_ids, params, prompt)
        self.client.add_request(EngineCoreRequest(core_id, prompt_token_ids, params, seeds, time.time()))
        processor.register(item)     # last: nothing after the core's add can fail and leave it half added
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request and drop every trace of it at once (its blocks are freed); the next `step()` returns its
        final output, with finish_reason "abort". Returns whether it was found unfinished."""
        core_ids, item = self.output_processor.abort(request_id)
        if item is None:
            return False
        self.client.abort_requests(core_ids)
        self._ready.append(self.output_processor.output(item))
        return True

    def has_unfinished(self) -> bool:
        if self._ready:
            return True
        return self.client.has_unfinished() if self.inproc else len(self.output_processor) > 0

    def num_tracked(self) -> int:
        """How many requests the engine holds output state for (those added and not yet finished or aborted); a
        request with n > 1 counts once, and once more for each of its unfinished samples."""
        return len(self.output_processor)

    # ---- the step ---------------------------------------------------------------------------------------------
    def step(self, stream: bool = False) -> list[RequestOutput]:
        """Advance every unfinished request by one step; returns the outputs of requests that finished, or with
        `stream` of every request that got a new token (building an output copies its tokens, so batch generation
        asks only for finished ones).

        With async scheduling the next step is scheduled and launched while the previous one still runs on the
        device, and the previous one's tokens are processed after: a call returns what the step before it
        produced. A request that stops (EOS, stop string) has then run one extra step, whose token is dropped.
        With the core in another process a call returns the next outputs it sent."""
        if not self.inproc:
            if len(self.output_processor):
                self._apply(self.client.get_output(), stream)
            return self._take_ready()
        stats = self._stats
        start = time.perf_counter()
        waited_before = stats.device_wait_s
        try:
            self._apply(self._core_step(), stream)
        finally:
            stats.host_s += time.perf_counter() - start - (stats.device_wait_s - waited_before)
        ready, self._ready = self._ready, []
        return ready

    def _take_ready(self) -> list[RequestOutput]:
        ready, self._ready = self._ready, []
        return ready

    def _apply(self, out: EngineCoreOutputs, stream: bool) -> None:
        """Turn the core's outputs into request outputs (kept in `_ready`, so that an error raised here loses
        none); raise EngineStepError if a step failed, or a request's processing did."""
        processor = self.output_processor
        with section("ember.output"):
            due, stopped, failed = processor.process(out, stream)
            if stopped:
                self.client.finish_requests(stopped)
            self._ready.extend([processor.output(item) for item in due])
        if out.failed_ids:
            states = processor.states
            ids = list(dict.fromkeys(states[c].request_id for c in out.failed_ids if c in states))
            for request_id in ids:
                self.abort(request_id)       # every sample of a request with n > 1
            raise EngineStepError(ids, out.cause, None if out.cause is not None else out.failure) from out.cause
        if failed:
            ids = list(dict.fromkeys(state.request_id for state, _ in failed))
            for request_id in ids:
                self.abort(request_id)
            error = failed[-1][1]
            raise EngineStepError(ids, error) from error

    # ---- whole-sequence scoring -------------------------------------------------------------------------------
    def score(self, token_ids: list[int]) -> "torch.Tensor":
        """Teacher-forced logits [len(token_ids), V] of one sequence, computed through the paged cache in one
        prefill step. Runs only while no other request is in flight."""
        self.validate(token_ids, SamplingParams())
        return self.core.score(token_ids)

    def prompt_logprobs(self, token_ids: list[int], k: int) -> list[dict[int, Logprob] | None]:
        """[None, {token: Logprob, ...}, ...]: one entry per prompt token; each holds the token itself (with its
        rank) and the `k` most likely tokens at that position (`SamplingParams(prompt_logprobs=k)`)."""
        self.validate(token_ids, SamplingParams())
        return prompt_logprob_entries(token_ids, self.client.prompt_logprobs(list(token_ids), k), self.tokenizer)

    def shutdown(self) -> None:
        """Stop the engine core (a core in this process has nothing to stop; one in its own process exits)."""
        self.client.shutdown()


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                     max_num_seqs: int) -> None:
    """Raise ValueError naming the value and the limit if the request cannot be served (TypeError naming the
    parameter for a value of the wrong type)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__} {params!r}")
    prompt_token_ids = token_id_list(prompt_token_ids)
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size):   # C loops: a long prompt is fast
        bad = next(t for t in prompt_token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids entry {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if n >= max_model_len:
        raise ValueError(f"the prompt has {n} tokens; with at least one generated token it exceeds "
                         f"max_model_len {max_model_len}")
    if params.n > max_num_seqs:
        raise ValueError(f"n {params.n} exceeds max_num_seqs {max_num_seqs}: the samples "
                         f"of one prompt must fit in one batch; lower n or raise max_num_seqs")


def token_id_list(ids) -> list[int]:
    """A prompt's token ids as a list of Python ints; numpy and torch integers count (TypeError otherwise)."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"prompt_token_ids must be a list of int, got {type(ids).__name__} {ids!r}")
    if isinstance(ids, (list, tuple)) and set(map(type, ids)) <= {int}:
        return list(ids)    # plain ints, as a tokenizer gives them: checked in C, 10 times faster than one by one
    return [as_int("prompt_token_ids entry", t) for t in ids]
