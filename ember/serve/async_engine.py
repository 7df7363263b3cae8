"""The async front of the server, and the only module of the server that touches the engine.

The engine cores run in processes of their own (`MPClient`); this process keeps what is text or HTTP: the
requests' state (`OutputProcessor`: detokenization, stop strings, logprobs, samples), their streams and the
metrics. A client thread receives each step's outputs and hands them to the event loop in one call; they update
every request's state there, and each request's `RequestStream` is woken. A reader builds its output when it
wakes, from the state as it is then: a reader that falls behind skips to the newest output, which holds
everything before it, and costs nothing for the outputs it skipped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from ember.engine.core_io import CoreStats, EngineCoreRequest
from ember.engine.core_client import EngineCoreDead
from ember.engine.engine import validate_request
from ember.engine.output_processor import OutputProcessor, RequestState, prompt_logprob_entries
from ember.engine.request import RequestOutput
from ember.engine.sample_group import SampleGroup, sample_seeds
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember.serve")


class ServerBusy(Exception):
    """Admitting the request would exceed the server's bound on unfinished requests, or it is shutting down."""


class EngineFailed(Exception):
    """The engine failed the request: its step failed, or its core's process died."""


@dataclass(frozen=True)
class EngineLoad:
    """What the engine cores hold, as of their last steps, summed over replicas: requests running and waiting,
    KV-cache blocks in use, requests they hold (`num_tracked`), and the runners' request-table rows."""
    num_running: int = 0
    num_waiting: int = 0
    num_blocks_used: int = 0
    num_blocks_total: int = 1
    num_tracked: int = 0
    num_runner_rows: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total

    @classmethod
    def of(cls, stats: list[CoreStats]) -> "EngineLoad":
        return cls(sum(s.num_running for s in stats), sum(s.num_waiting for s in stats),
                   sum(s.num_blocks_used for s in stats), max(sum(s.num_blocks_total for s in stats), 1),
                   sum(s.num_requests for s in stats), sum(s.num_runner_rows for s in stats))


class RequestStream:
    """The outputs of one request as the engine produces them. A slow reader skips to the newest output, which
    holds everything before it; iteration ends after the finished output."""

    def __init__(self, request_id: str, num_prompt_tokens: int, processor: OutputProcessor | None = None,
                 replica: int = 0):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.replica = replica
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_output_tokens = 0
        self._processor = processor
        self._item: RequestState | SampleGroup | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def _put(self, item) -> None:
        """The request's state (or group) to make its output from when the reader wakes, or an output made."""
        self._item = item
        self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self._error is not None:
                raise self._error
            item = self._item
            output = item if isinstance(item, RequestOutput) else self._processor.output(item)
            yield output
            if output.finished:
                return


class AsyncEngine:
    """Serves engine cores in their own processes to asyncio: `add` a request, read its `RequestStream`, `abort`
    it. At most `max_num_seqs` per replica plus `max_waiting` requests are unfinished at once; more raise
    `ServerBusy`. `on_dead(error)` is called (on the loop) if a core's process dies."""

    def __init__(self, client, config, tokenizer, max_waiting: int,
                 on_tokens: Callable[[RequestStream, int, float], None] | None = None,
                 on_finish: Callable[[RequestStream, list[str]], None] | None = None, owns_client: bool = True):
        if max_waiting < 0:
            raise ValueError(f"max_waiting {max_waiting} must be >= 0")
        self.client = client
        self.config = config
        self.info = client.info
        self.max_model_len = self.info.max_model_len
        self.capacity = config.scheduler.max_num_seqs * client.num_replicas + max_waiting
        self.on_tokens, self.on_finish = on_tokens, on_finish
        self.on_dead: Callable[[BaseException], None] | None = None
        self.owns_client = owns_client
        self.processor = OutputProcessor(tokenizer)
        self.load = EngineLoad.of(client.stats)
        self.draining = False
        self.error: BaseException | None = client.error      # set if a core died
        self._streams: dict[str, RequestStream] = {}
        self._rng = random.Random(config.model.seed)
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:12]    # unique beyond this front: a core may outlive it (tests)
        self._started = self._stopped = False
        self._idle: asyncio.Event | None = None

    # ---- the event loop's side --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start taking the cores' outputs; call from the event loop that will read the streams."""
        self._idle = asyncio.Event()
        self._idle.set()
        self.client.attach(asyncio.get_running_loop(), self._on_output, self._on_dead)
        self._started = True

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def streams_per_replica(self) -> list[int]:
        """Unfinished requests by the replica that serves them."""
        counts = [0] * self.client.num_replicas
        for stream in self._streams.values():
            counts[stream.replica] += 1
        return counts

    @property
    def alive(self) -> bool:
        return self._started and not self._stopped and self.error is None

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (TypeError for a wrong type) if the engine cannot serve the request."""
        validate_request(prompt_token_ids, params, self.info.vocab_size, self.max_model_len,
                         self.config.scheduler.max_num_seqs)

    def check_structured_output(self, structured_outputs) -> None:
        """Raise ValueError naming the problem if the grammar cannot be served (no engine state: any thread)."""
        self.engine.check_structured_output(structured_outputs)

    def check_structured_output(self, structured_outputs) -> None:
        """Raise ValueError naming the problem if the grammar cannot be served (no engine state: any thread)."""
        from ember.engine.structured_output import check_request
        check_request(structured_outputs, self.config, self.processor.tokenizer)

    def add(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None) -> RequestStream:
        """Send a request to a core; returns the stream of its outputs."""
        if self.draining:
            raise ServerBusy("the server is shutting down")
        if not self.alive:
            raise EngineFailed(f"the engine has stopped: {self.error}")
        if len(self._streams) >= self.capacity:
            raise ServerBusy(f"{len(self._streams)} requests are unfinished, the most this server holds; retry later")
        request_id = f"{self._id_prefix}-{next(self._ids)}"
        seeds = tuple(sample_seeds(params.seed, params.n, self._rng))
        item = self.processor.make(request_id, request_id, prompt_token_ids, params, prompt)
        try:
            replica = self.client.add_request(EngineCoreRequest(request_id, prompt_token_ids, params, seeds,
                                                                time.time()))
        except EngineCoreDead as exc:
            raise EngineFailed(str(exc)) from None
        self.processor.register(item)
        stream = RequestStream(request_id, len(prompt_token_ids), self.processor, replica or 0)
        self._streams[request_id] = stream
        self._idle.clear()
        return stream

    async def score(self, prompt_token_ids: list[int], num_logprobs: int) -> list:
        """The prompt logprobs of `prompt_token_ids`, as `SamplingParams(prompt_logprobs=num_logprobs)` gives them
        offline. Scoring is a pass of its own, which a core runs once no request is in flight there; requests sent
        to that core after it wait for it."""
        if self.draining:
            raise ServerBusy("the server is shutting down")
        if not self.alive:
            raise EngineFailed(f"the engine has stopped: {self.error}")
        try:
            data = await self.client.call_async("prompt_logprobs", (list(prompt_token_ids), num_logprobs))
        except EngineCoreDead as exc:
            raise EngineFailed(str(exc)) from None
        except RuntimeError as exc:     # the core refused: a prompt it cannot score fails its request only
            raise ValueError(str(exc)) from None
        return prompt_logprob_entries(prompt_token_ids, data, self.processor.tokenizer)

    def abort(self, request_id: str) -> None:
        """Abort a request that has not finished (a no-op otherwise); its core frees its blocks."""
        if self._streams.pop(request_id, None) is None:
            return
        core_ids, _ = self.processor.abort(request_id)
        if core_ids:
            self.client.abort_requests(core_ids)
        self._mark_idle()

    async def drain(self, timeout: float) -> int:
        """Refuse new requests and wait up to `timeout` seconds for unfinished ones; abort those left. Returns how
        many were aborted."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        left = list(self._streams.values())
        for stream in left:
            self.abort(stream.request_id)
            stream._fail(ServerBusy("the server shut down before the request finished"))
        return len(left)

    async def stop(self) -> None:
        """Stop taking outputs, and stop the cores if this front owns them."""
        self._stopped = True
        self.client.detach()
        if self.owns_client:
            await asyncio.to_thread(self.client.shutdown)

    def _mark_idle(self) -> None:
        if not self._streams:
            self._idle.set()

    def _on_output(self, outputs) -> None:
        """On the loop: apply a core's outputs and wake the streams they changed."""
        processor, streams = self.processor, self._streams
        due, stopped, failed = processor.process(outputs, True)
        if stopped:
            self.client.finish_requests(stopped)
        now = time.perf_counter()
        for item in due:
            stream = streams.get(item.request_id)
            if stream is None:
                continue
            num_tokens = (len(item.token_ids) if isinstance(item, RequestState)
                          else sum(len(s.token_ids) for s in item.samples))
            new = num_tokens - stream.num_output_tokens
            if new > 0:
                if stream.first_token_at is None:
                    stream.first_token_at = now
                if self.on_tokens is not None:
                    self.on_tokens(stream, new, now)
                stream.num_output_tokens, stream.last_token_at = num_tokens, now
            if item.finished:
                del streams[item.request_id]
                if self.on_finish is not None:
                    reasons = ([item.finish_reason] if isinstance(item, RequestState)
                               else [s.finish_reason for s in item.samples])
                    self.on_finish(stream, reasons)
            stream._put(item)
        if outputs.failed_ids:
            states = processor.states
            ids = {states[c].request_id for c in outputs.failed_ids if c in states}
            logger.error("an engine step failed (%s); dropping %d requests", outputs.failure, len(ids))
            self._fail(ids, EngineFailed(f"the engine step failed: {outputs.failure}"))
        if failed:
            logger.error("processing outputs failed for %d requests: %s", len(failed), failed[-1][1])
            self._fail({state.request_id for state, _ in failed},
                       EngineFailed(f"processing the request's output failed: {failed[-1][1]}"))
        self.load = EngineLoad.of(self.client.stats)
        self._mark_idle()

    def _fail(self, request_ids, error: BaseException) -> None:
        """End these requests' streams with `error` (aborting what is left of them in the core)."""
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            core_ids, _ = self.processor.abort(request_id)
            if core_ids:
                self.client.abort_requests(core_ids)
            if stream is not None:
                stream._fail(error)

    def _on_dead(self, error: BaseException) -> None:
        """On the loop: a core's process died. Every open stream ends with the error; the server is unhealthy."""
        if self.error is not None:
            return
        self.error = error
        logger.error("%s", error)
        failure = EngineFailed(str(error))
        for stream in list(self._streams.values()):
            stream._fail(failure)
        self._streams.clear()
        self._mark_idle()
        if self.on_dead is not None:
            self.on_dead(error)
