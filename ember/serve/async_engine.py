"""The async front of the engine, and the only module of the server that touches it.

The engine is not thread-safe, so one thread owns it: it applies queued additions and aborts, steps while any
request is unfinished, and sleeps otherwise. Each step's outputs cross to the event loop in one
`call_soon_threadsafe`; each request reads them from its own `RequestStream`. A client never blocks the engine: a
reader that falls behind just finds a newer output, since outputs are cumulative.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from ember.engine.request import RequestOutput
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember.serve")


class ServerBusy(Exception):
    """Admitting the request would exceed the server's bound on unfinished requests, or it is shutting down."""


class EngineFailed(Exception):
    """The engine raised while running the request's step; the request is dropped."""


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds, as of its last step: requests running and waiting, KV-cache blocks in use, requests
    it keeps output state for, and the runner's request-table rows."""
    num_running: int = 0
    num_waiting: int = 0
    num_blocks_used: int = 0
    num_blocks_total: int = 1
    num_tracked: int = 0
    num_runner_rows: int = 0
    # speculative decoding's totals: proposed and accepted tokens, and `SchedulerStats.spec_summary()`
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    spec_summary: dict | None = None

    @property
    def kv_cache_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total


class RequestStream:
    """The outputs of one request as the engine produces them. A slow reader skips to the newest output, which
    holds everything before it; iteration ends after the finished output."""

    def __init__(self, request_id: str, num_prompt_tokens: int):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_output_tokens = 0
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def _put(self, output: RequestOutput) -> None:
        self._latest = output
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
            output = self._latest
            yield output
            if output.finished:
                return


class AsyncEngine:
    """Runs an `Engine` in its own thread and serves it to asyncio: `add` a request, read its `RequestStream`,
    `abort` it. At most `max_num_seqs + max_waiting` requests are unfinished at once; more raise `ServerBusy`."""

    def __init__(self, engine, max_waiting: int,
                 on_tokens: Callable[[RequestStream, int, float], None] | None = None,
                 on_finish: Callable[[RequestStream, RequestOutput], None] | None = None):
        if max_waiting < 0:
            raise ValueError(f"max_waiting {max_waiting} must be >= 0")
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.capacity = engine.config.scheduler.max_num_seqs + max_waiting
        self.on_tokens, self.on_finish = on_tokens, on_finish
        self.load = EngineLoad(num_blocks_total=self._num_blocks_total())
        self.draining = False
        self.error: BaseException | None = None        # set if the engine thread died
        self._streams: dict[str, RequestStream] = {}   # owned by the event loop
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:12]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._idle = asyncio.Event()

    # ---- the event loop's side --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
        self._thread.start()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the engine cannot serve the request (it reads only fixed limits, so any thread may
        call it)."""
        self.engine.validate(prompt_token_ids, params)

    def check_structured_output(self, structured_outputs) -> None:
        """Raise ValueError naming the problem if the grammar cannot be served (no engine state: any thread)."""
        self.engine.check_structured_output(structured_outputs)

    def add(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None) -> RequestStream:
        """Queue a request for the engine thread; returns the stream of its outputs."""
        if self.draining:
            raise ServerBusy("the server is shutting down")
        if self.error is not None or not self.alive:
            raise EngineFailed(f"the engine has stopped: {self.error}")
        if len(self._streams) >= self.capacity:
            raise ServerBusy(f"{len(self._streams)} requests are unfinished, the most this server holds; retry later")
        # unique beyond this front: another front may have run on the same engine before
        request_id = f"{self._id_prefix}-{next(self._ids)}"
        stream = RequestStream(request_id, len(prompt_token_ids))
        self._streams[request_id] = stream
        self._idle.clear()
        self._commands.append(("add", request_id, prompt_token_ids, params, prompt))
        self._wake.set()
        return stream

    def score(self, prompt_token_ids: list[int], num_logprobs: int) -> asyncio.Future:
        """A future of the prompt logprobs of `prompt_token_ids`, as `SamplingParams(prompt_logprobs=num_logprobs)`
        gives them offline. Scoring is a pass of its own, which the engine thread runs once no request is in
        flight; requests queued after it wait for it."""
        if self.draining:
            raise ServerBusy("the server is shutting down")
        if self.error is not None or not self.alive:
            raise EngineFailed(f"the engine has stopped: {self.error}")
        future = self._loop.create_future()
        self._commands.append(("score", future, list(prompt_token_ids), num_logprobs))
        self._wake.set()
        return future

    def abort(self, request_id: str) -> None:
        """Abort a request that has not finished (a no-op otherwise); the engine frees its blocks."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._mark_idle()
        self._commands.append(("abort", request_id))
        self._wake.set()

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
        """Stop the engine thread once it has applied every queued command."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def _mark_idle(self) -> None:
        if not self._streams:
            self._idle.set()

    def _deliver(self, outputs: list[RequestOutput], load: EngineLoad) -> None:
        """On the loop: hand each output to its stream (outputs of aborted requests are dropped)."""
        self.load = load
        now = time.perf_counter()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            new = num_tokens - stream.num_output_tokens
            if new > 0:
                if stream.first_token_at is None:
                    stream.first_token_at = now
                if self.on_tokens is not None:
                    self.on_tokens(stream, new, now)
                stream.num_output_tokens, stream.last_token_at = num_tokens, now
            if output.finished:
                del self._streams[output.request_id]
                if self.on_finish is not None:
                    self.on_finish(stream, output)
            stream._put(output)
        self._mark_idle()

    def _fail(self, request_ids: list[str], error: BaseException, load: EngineLoad | None = None) -> None:
        """On the loop: end these requests' streams with `error`."""
        if load is not None:
            self.load = load
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream._fail(error)
        self._mark_idle()

    def _set_load(self, load: EngineLoad) -> None:
        self.load = load

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:   # the loop has closed: nobody is left to read
            pass

    # ---- the engine thread's side ------------------------------------------------------------------------------
    def _run(self) -> None:
        live: set[str] = set()   # requests the engine holds, as this thread knows them
        try:
            while True:
                self._wake.clear()
                self._apply_commands(live)
                if not self.engine.has_unfinished():
                    self._call(self._set_load, self._snapshot())
                    if self._stop:
                        return
                    self._wake.wait()
                    continue
                try:
                    outputs = self.engine.step(stream=True)
                except Exception as exc:   # noqa: BLE001 - a failed step fails its requests, not the server
                    # an engine that names the requests the step held has aborted them and serves the rest
                    failed = [r for r in getattr(exc, "request_ids", None) or live if r in live]
                    logger.exception("engine step failed; dropping %d requests", len(failed))
                    for request_id in failed:
                        self._abort_in_engine(request_id)
                        live.discard(request_id)
                    self._call(self._fail, failed, EngineFailed(f"the engine step failed: {exc}"), self._snapshot())
                    continue
                for output in outputs:
                    if output.finished:
                        live.discard(output.request_id)
                if outputs:
                    self._call(self._deliver, outputs, self._snapshot())
        except BaseException as exc:   # the thread is dying: every reader must learn it
            logger.exception("the engine thread stopped")
            self.error = exc
            self._call(self._fail, list(live), EngineFailed(f"the engine stopped: {exc}"))
            for command in self._commands:
                if command[0] == "score":
                    self._call(_settle, command[1], None, EngineFailed(f"the engine stopped: {exc}"))
            raise

    def _apply_commands(self, live: set[str]) -> None:
        while self._commands:
            if self._commands[0][0] == "score":
                if self.engine.has_unfinished():   # it waits for the engine to be idle, and so does what follows it
                    return
                self._score(*self._commands.popleft()[1:])
                continue
            command = self._commands.popleft()
            if command[0] == "add":
                _, request_id, prompt_token_ids, params, prompt = command
                try:
                    self.engine.add_request(prompt_token_ids, params, prompt, request_id=request_id)
                except Exception as exc:   # noqa: BLE001 - a request the engine refuses must not stop the loop
                    self._call(self._fail, [request_id], exc)
                else:
                    live.add(request_id)
            else:
                request_id = command[1]
                if request_id in live:
                    live.discard(request_id)
                    self._abort_in_engine(request_id)

    def _score(self, future: asyncio.Future, prompt_token_ids: list[int], num_logprobs: int) -> None:
        from ember.prompt_logprobs import prompt_logprobs
        try:
            entries = prompt_logprobs(self.engine, prompt_token_ids, num_logprobs, self.engine.tokenizer)
        except Exception as exc:   # noqa: BLE001 - a prompt the engine cannot score fails its request only
            self._call(_settle, future, None, exc)
        else:
            self._call(_settle, future, entries, None)

    def _abort_in_engine(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:   # noqa: BLE001 - an abort that fails must not stop the loop
            logger.exception("aborting request %s failed", request_id)

    def _num_blocks_total(self) -> int:
        # block 0 is the null block, never handed out
        return max(self.engine.runner.num_blocks - 1, 1)

    def _snapshot(self) -> EngineLoad:
        scheduler = self.engine.scheduler
        total = self._num_blocks_total()
        stats = scheduler.stats
        return EngineLoad(len(scheduler.running), len(scheduler.waiting), total - self.engine.kv.num_free_blocks,
                          total, self.engine.num_tracked(), self.engine.runner.table.num_rows,
                          stats.num_draft_tokens, stats.num_accepted_tokens, stats.spec_summary())


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    """On the loop: complete a future unless its waiter has gone (cancelled it)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
