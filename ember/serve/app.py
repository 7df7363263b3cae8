"""The ASGI app: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`, `/metrics`.

Every refusal is an OpenAI error body with a 4xx (503 with Retry-After when the server is full); a client that goes
away, mid-stream or while waiting for a whole response, aborts its requests."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ember.engine.request import CompletionOutput, RequestOutput
from ember.sampling_params import SamplingParams
from ember.serve.async_engine import AsyncEngine, EngineFailed, RequestStream, ServerBusy
from ember.serve.metrics import ServerMetrics
from ember.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest, validation_error
from ember.serve.render import DONE, ChoiceCursor, EchoedPrompt, Renderer, TokenText, error_event, usage
from ember.serve.chat_prompt import ChatPrompts, check_structured
from ember.serve.tool_calls import TOOL_CALL_PARSERS

logger = logging.getLogger("ember.serve")

RETRY_AFTER_S = 1


class ClientGone(Exception):
    """The client closed the connection before its response was complete."""


class ServerState:
    """What the routes share: the engine front, the config, the tokenizer, the metrics and the served name."""

    def __init__(self, client, setup, model_name: str, max_waiting: int, owns_client: bool,
                 tool_call_parser: str | None = None, chat_template: str | None = None):
        self.config = setup.config
        self.tokenizer = setup.tokenizer
        self.checkpoint = setup.checkpoint
        self.model_name = model_name
        self.tool_call_parser = tool_call_parser
        self.chat = ChatPrompts(setup.tokenizer, chat_template)
        self.metrics = ServerMetrics(model_name, client.num_replicas, setup.config.device.startswith("cuda"))
        self.front = AsyncEngine(client, setup.config, setup.tokenizer, max_waiting, self.metrics.on_tokens,
                                 self.metrics.on_finish, owns_client)
        self.token_text = TokenText(setup.tokenizer)
        self.created = int(time.time())


def build_app(client, setup, model_name: str, max_waiting: int = 512, owns_client: bool = True,
              tool_call_parser: str | None = None, chat_template: str | None = None) -> FastAPI:
    """The server's app around started engine cores (an `MPClient`) and the `EngineSetup` they run (its config,
    tokenizer and checkpoint). The app takes the cores' outputs while its lifespan runs, and stops the cores when
    it ends if it owns them. `tool_call_parser`: how `tool_choice` "auto" finds calls
    (`ember.serve.tool_calls.TOOL_CALL_PARSERS`); `chat_template`: a template (its text) to use instead of the
    tokenizer's."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool call parser {tool_call_parser!r} is not one of {', '.join(TOOL_CALL_PARSERS)}")
    state = ServerState(client, setup, model_name, max_waiting, owns_client, tool_call_parser, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.front.start()
        try:
            yield
        finally:
            # uvicorn has already waited (up to its graceful-shutdown timeout) for responses in flight
            aborted = await state.front.drain(0)
            if aborted:
                logger.warning("shut down with %d requests unfinished; they were aborted", aborted)
            await state.front.stop()

    app = FastAPI(title="ember", lifespan=lifespan)
    app.state.ember = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return await _api_error(request, validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return await _api_error(request, ApiError(f"{request.method} {request.url.path}: {exc.detail}",
                                                  exc.status_code, kind))

    @app.get("/health")
    async def health():
        if not state.front.alive:
            body = {"status": "engine stopped"}
            if state.front.error is not None:
                body["error"] = str(state.front.error)
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "draining" if state.front.draining else "ok"})

    @app.get("/v1/models")
    async def models():
        # root: the weights' folder, as vLLM's card has it; checkpoint: their origin and format
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "ember", "root": state.checkpoint.path,
                                            "max_model_len": state.front.max_model_len,
                                            "checkpoint": state.checkpoint.card()}]}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(state.front.client.stats, state.front.streams_per_replica()),
                        media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check_fields()
        _check_model(state, body.model)
        params = body.sampling_params(default_max_tokens=16)
        check_structured(state.front, params, body.structured_field)
        prompts = [_tokenize(state.tokenizer, p) for p in body.prompts()]
        echo = None
        if body.echo:
            _validate(state, prompts, params, "prompt")
            echo = await _echoed(state, prompts, params.logprobs)
        renderer = Renderer(False, state.model_name, state.token_text, params.logprobs, _hold_back(params),
                            params.n, echo)
        return await _serve(state, request, prompts, params, renderer, body, generate=not body.echo_only)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        body.check_fields()
        _check_model(state, body.model)
        params = body.sampling_params(default_max_tokens=None)
        tools = body.tool_mode(state.tool_call_parser)
        if tools is not None and tools.structured_output() is not None:    # "required" or a named function
            params = dataclasses.replace(params, structured_outputs=tools.structured_output())
        check_structured(state.front, params, body.structured_field or ("tool_choice" if tools is not None else None))
        ids = state.chat.prompt_ids(body)
        renderer = Renderer(True, state.model_name, state.token_text, params.logprobs, _hold_back(params), params.n,
                            tools=tools)
        return await _serve(state, request, [(ids, None)], params, renderer, body)

    return app


# ---- request preparation ----------------------------------------------------------------------------------------
def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(f"the model {model!r} does not exist; this server serves {state.model_name!r}", 404,
                       "not_found_error", "model", "model_not_found")


def _tokenize(tokenizer, prompt: str | list[int]) -> tuple[list[int], str | None]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError("text prompts need a tokenizer and this model has none; send token ids", param="prompt")
        return tokenizer.encode(prompt), prompt
    return list(prompt), None


def _hold_back(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop), default=1) - 1


async def _echoed(state: ServerState, prompts: list[tuple[list[int], str | None]], num_logprobs: int | None
                  ) -> list[EchoedPrompt]:
    """What `echo` puts before each prompt's completions: its text and, with logprobs, its prompt logprobs."""
    scores: list = [None] * len(prompts)
    if num_logprobs is not None:
        limit = state.config.scheduler.max_num_batched_tokens
        for i, (ids, _) in enumerate(prompts):
            if len(ids) > limit:
                raise ApiError(f"echo with logprobs scores each prompt in one step, and prompt {i} has {len(ids)} "
                               f"tokens, more than max_num_batched_tokens {limit}; shorten the prompt or start the "
                               f"server with a larger --max-num-batched-tokens", param="prompt")
        try:
            futures = [state.front.score(ids, num_logprobs) for ids, _ in prompts]
            scores = await asyncio.gather(*futures)
        except ServerBusy as exc:
            raise ApiError(str(exc), 503, "server_overloaded", code="server_busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineFailed as exc:
            raise ApiError(str(exc), 503, "server_error", code="engine_stopped") from None
        except (ValueError, TypeError) as exc:
            raise ApiError(str(exc), param="prompt") from None
    tokenizer = state.tokenizer
    return [EchoedPrompt(text if text is not None else (tokenizer.decode(ids) if tokenizer is not None else ""),
                         ids, entries) for (ids, text), entries in zip(prompts, scores)]


def _echo_only(prompts: list[tuple[list[int], str | None]], params: SamplingParams) -> list[RequestStream]:
    """Finished streams of prompts that `echo` with max_tokens 0 answers with no completion."""
    streams = []
    for i, (ids, text) in enumerate(prompts):
        stream = RequestStream(f"echo-{i}", len(ids))
        completions = [CompletionOutput(j, "", [], None, [] if params.logprobs is not None else None, "length")
                       for j in range(params.n)]
        stream._put(RequestOutput(stream.request_id, text, ids, completions, finished=True))
        streams.append(stream)
    return streams


def _validate(state: ServerState, prompts: list[tuple[list[int], str | None]], params: SamplingParams,
              param: str) -> None:
    """Refuse the request if the engine cannot serve one of its prompts."""
    front = state.front
    for ids, _ in prompts:
        try:
            front.validate(ids, params)
        except (ValueError, TypeError) as exc:
            raise ApiError(str(exc), param=param) from None
        if params.max_tokens is not None and len(ids) + params.max_tokens > front.max_model_len:
            raise ApiError(f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: together they "
                           f"exceed max_model_len {front.max_model_len}; lower max_tokens or shorten the prompt",
                           param="max_tokens")


def _admit(state: ServerState, prompts: list[tuple[list[int], str | None]], params: SamplingParams, param: str
           ) -> list[RequestStream]:
    """Check every prompt, then queue them all, or none."""
    _validate(state, prompts, params, param)
    front = state.front
    streams: list[RequestStream] = []
    try:
        for ids, text in prompts:
            streams.append(front.add(ids, params, text))
    except ServerBusy as exc:
        for stream in streams:
            front.abort(stream.request_id)
        raise ApiError(str(exc), 503, "server_overloaded", code="server_busy",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except EngineFailed as exc:
        raise ApiError(str(exc), 503, "server_error", code="engine_stopped") from None
    return streams


async def _serve(state: ServerState, request: Request, prompts, params: SamplingParams, renderer: Renderer, body,
                 generate: bool = True):
    if generate:
        streams = _admit(state, prompts, params, "messages" if renderer.chat else "prompt")
    else:
        streams = _echo_only(prompts, params)

    def abort_all():
        for stream in streams:
            state.front.abort(stream.request_id)

    if body.stream:
        options = body.stream_options
        include_usage = bool(options and (options.include_usage or options.continuous_usage_stats))
        continuous = bool(options and options.continuous_usage_stats)
        events = _events(renderer, streams, params.n, include_usage, continuous)
        return EventStreamResponse(events, abort_all)
    try:
        outputs = await _until_disconnect(request.receive, _finals(streams))
    except ClientGone:
        return Response(status_code=499)
    except (ValueError, TypeError) as exc:   # the engine refused the request
        raise ApiError(str(exc)) from None
    except (EngineFailed, ServerBusy) as exc:
        raise ApiError(str(exc), 503, "server_error", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    finally:
        abort_all()
    return JSONResponse(renderer.response(outputs))


# ---- waiting for outputs ------------------------------------------------------------------------------------------
async def _finals(streams: list[RequestStream]) -> list[RequestOutput]:
    finals = []
    for stream in streams:
        last = None
        async for last in stream:
            pass
        finals.append(last)
    return finals


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(receive, coro):
    """Run `coro` unless the client disconnects first (then raise ClientGone)."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        raise ClientGone()
    return work.result()


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream):
        try:
            async for output in stream:
                queue.put_nowait((i, output, None))
        except Exception as exc:   # noqa: BLE001 - handed to the reader
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, output, error = await queue.get()
            if error is not None:
                raise error
            yield i, output
            remaining -= output.finished
    finally:
        for task in tasks:
            task.cancel()


async def _events(renderer: Renderer, streams: list[RequestStream], n: int, include_usage: bool,
                  continuous: bool) -> AsyncIterator[bytes]:
    """The SSE events of a streamed response, ending with `[DONE]`."""
    if renderer.chat:
        yield renderer.role_chunk(len(streams) * n)
    cursors = [[ChoiceCursor() for _ in range(n)] for _ in streams]
    prompt_tokens = [s.num_prompt_tokens for s in streams]
    completion_tokens = [0] * len(streams)

    def event(i: int, output: RequestOutput) -> bytes | None:
        completion_tokens[i] = sum(len(c.token_ids) for c in output.outputs)
        choices = renderer.chunk_choices(i, output, cursors[i])
        if not choices:
            return None
        chunk = {"choices": choices}
        if include_usage:
            chunk["usage"] = usage(sum(prompt_tokens), sum(completion_tokens)) if continuous else None
        return renderer.event(chunk)

    try:
        if len(streams) == 1:   # the usual case: read the stream directly, no merging task
            async for output in streams[0]:
                if (data := event(0, output)) is not None:
                    yield data
        else:
            async for i, output in _merge(streams):
                if (data := event(i, output)) is not None:
                    yield data
        if include_usage:
            yield renderer.event({"choices": [], "usage": usage(sum(prompt_tokens), sum(completion_tokens))})
    except (ValueError, TypeError) as exc:
        yield error_event(ApiError(str(exc)).body())
    except (EngineFailed, ServerBusy) as exc:
        yield error_event(ApiError(str(exc), 503, "server_error").body())
    yield DONE


class EventStreamResponse(StreamingResponse):
    """Server-sent events that call `on_close` however the response ends: complete, client gone, or cancelled
    (a shutdown that runs out of time)."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        sender = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            sender.cancel()
            self._on_close()
        if sender.done() and not sender.cancelled() and sender.exception() is not None:
            if not isinstance(sender.exception(), OSError):   # OSError: the client went away mid-send
                logger.error("streaming a response failed", exc_info=sender.exception())

    async def _send_all(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
