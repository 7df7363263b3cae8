"""Engine outputs as OpenAI response bodies and stream chunks (completions and chat), with logprobs and usage.

Streaming sends, for each choice, only what is new since the last chunk. Text that might be the start of a stop
string is held back until the request finishes, so the streamed text always equals the non-streamed text."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from ember.engine.request import CompletionOutput, Logprob, RequestOutput
from ember.serve.tool_calls import ToolCallStream, ToolMode


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class TokenText:
    """Token id -> its text, cached, for logprobs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = (self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}")
            self._cache[token_id] = text
        return text


# JSON has no -inf (a grammar's forbidden tokens have that logprob): like vLLM, send this instead
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


def _top(entry: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The `num` most likely tokens of a position (the sampled token may be among them or not)."""
    ranked = [(t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num]
    return sorted(ranked, key=lambda item: item[1].rank)[:num]


def completion_logprobs(entries: list[dict[int, Logprob] | None], token_ids: list[int], num: int, text: TokenText,
                        offset: int) -> dict:
    """The legacy completions `logprobs` object for these positions; `offset` is where their text starts. A position
    without an entry (a prompt's first token) has null logprobs."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        piece = text(token_id)
        tokens.append(piece)
        token_logprobs.append(_finite(entry[token_id].logprob) if entry is not None else None)
        tops.append({text(t): _finite(lp.logprob) for t, lp in _top(entry, num)} if entry is not None else None)
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


@dataclass(frozen=True)
class EchoedPrompt:
    """A prompt that `echo` puts before each of its completions: its text, its tokens and (with `logprobs`) the
    prompt logprobs of each token (None for the first), as `SamplingParams(prompt_logprobs=...)` gives them."""
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None] | None


def _joined(head: dict, tail: dict) -> dict:
    return {key: head[key] + tail[key] for key in head}


def _text_end(logprobs: dict) -> int:
    """Where the text of these positions ends, by their offsets."""
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1]) if logprobs["tokens"] else 0


def chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], num: int, text: TokenText) -> dict:
    """The chat `logprobs` object for these positions."""
    def item(token_id, lp):
        piece = text(token_id)
        return {"token": piece, "logprob": _finite(lp.logprob), "bytes": list(piece.encode("utf-8"))}
    content = []
    for token_id, entry in zip(token_ids, entries):
        content.append({**item(token_id, entry[token_id]),
                        "top_logprobs": [item(t, lp) for t, lp in _top(entry, num)]})
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ChoiceCursor:
    """How much of one choice's text, tokens and logprobs a stream has sent."""
    __slots__ = ("text_len", "num_tokens", "num_logprobs", "finished", "echoed", "echo_end", "tools")

    def __init__(self):
        self.text_len = self.num_tokens = self.num_logprobs = 0
        self.finished = self.echoed = False
        self.echo_end = 0   # with echo and logprobs: where the prompt's text ends, by its token offsets
        self.tools: ToolCallStream | None = None   # a chat reply read for tool calls: what it has sent of them


class Renderer:
    """Builds the bodies of one response (one id, model and creation time), for completions or chat."""

    def __init__(self, chat: bool, model: str, text: TokenText, num_logprobs: int | None, hold_back: int,
                 n: int = 1, echo: list[EchoedPrompt] | None = None, tools: ToolMode | None = None):
        self.chat, self.model, self.text, self.num_logprobs = chat, model, text, num_logprobs
        self.echo = echo   # completions with `echo`: per prompt, what goes before its completions
        self.tools = tools   # chat with tools: how each reply is read for calls
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.hold_back = hold_back   # characters a stop string could still claim
        self.n = n
        self._head: str | None = None

    # ---- whole responses ----------------------------------------------------------------------------------------
    def response(self, outputs: list[RequestOutput]) -> dict:
        """The non-streamed body for the final outputs of every prompt, in prompt order."""
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        for p, out in enumerate(outputs):
            prompt_tokens += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                choices.append(self._choice(p * self.n + c.index, c, self.echo[p] if self.echo else None))
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, cached)}

    def _choice(self, index: int, c: CompletionOutput, echo: EchoedPrompt | None) -> dict:
        logprobs = None
        if self.chat:
            if self.num_logprobs is not None and c.logprobs is not None:
                logprobs = chat_logprobs(c.logprobs, c.token_ids, self.num_logprobs, self.text)
            if self.tools is None:
                message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
            else:
                message = self.tools.message(c.text)
                finish_reason = self.tools.finish_reason(c.finish_reason, "tool_calls" in message)
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason}
        head = self._echo_logprobs(echo)
        if self.num_logprobs is not None and c.logprobs is not None:
            logprobs = completion_logprobs(c.logprobs, c.token_ids, self.num_logprobs, self.text,
                                           _text_end(head) if head is not None else 0)
            logprobs = _joined(head, logprobs) if head is not None else logprobs
        return {"index": index, "text": echo.text + c.text if echo is not None else c.text, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def _echo_logprobs(self, echo: EchoedPrompt | None) -> dict | None:
        """The `logprobs` of an echoed prompt's tokens (None without echo or without logprobs)."""
        if echo is None or self.num_logprobs is None or echo.logprobs is None:
            return None
        return completion_logprobs(echo.logprobs, echo.token_ids, self.num_logprobs, self.text, 0)

    # ---- stream chunks ----------------------------------------------------------------------------------------
    def chunk_choices(self, prompt_index: int, output: RequestOutput, cursors: list[ChoiceCursor]) -> list[dict]:
        """The chunk choices for what `output` adds to what `cursors` say was sent; advances the cursors."""
        choices = []
        for c in output.outputs:
            cursor = cursors[c.index]
            if cursor.finished:
                continue
            done = c.finish_reason is not None
            end = len(c.text) if done else max(len(c.text) - self.hold_back, cursor.text_len)
            delta_text = c.text[cursor.text_len:end]
            num_tokens = len(c.token_ids)
            if not delta_text and num_tokens == cursor.num_tokens and not done:
                continue
            # with echo, a choice's first chunk carries its prompt, and its completion's offsets follow the prompt's
            echo = self.echo[prompt_index] if self.echo else None
            head = self._echo_logprobs(echo) if echo is not None and not cursor.echoed else None
            if head is not None:
                cursor.echo_end = _text_end(head)
            logprobs = None
            if self.num_logprobs is not None and c.logprobs is not None:
                entries = c.logprobs[cursor.num_logprobs:]
                ids = c.token_ids[cursor.num_logprobs:len(c.logprobs)]
                logprobs = (chat_logprobs(entries, ids, self.num_logprobs, self.text) if self.chat else
                            completion_logprobs(entries, ids, self.num_logprobs, self.text,
                                                cursor.echo_end + cursor.text_len))
                cursor.num_logprobs = len(c.logprobs)
            index = prompt_index * self.n + c.index
            if self.chat and self.tools is not None:
                if cursor.tools is None:
                    cursor.tools = ToolCallStream(self.tools)
                delta = cursor.tools.delta(c.text[:end], done)
                if delta is None and not done and logprobs is None:
                    cursor.text_len, cursor.num_tokens = end, num_tokens
                    continue
                choices.append({"index": index, "delta": delta or {}, "logprobs": logprobs,
                                "finish_reason": self.tools.finish_reason(c.finish_reason, cursor.tools.called)})
            elif self.chat:
                choices.append({"index": index, "delta": {"content": delta_text}, "logprobs": logprobs,
                                "finish_reason": c.finish_reason})
            else:
                if echo is not None and not cursor.echoed:
                    delta_text = echo.text + delta_text
                    if head is not None:
                        logprobs = _joined(head, logprobs) if logprobs is not None else head
                    cursor.echoed = True
                choices.append({"index": index, "text": delta_text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason})
            if done:
                choices[-1]["stop_reason"] = c.stop_reason
            cursor.text_len, cursor.num_tokens, cursor.finished = end, num_tokens, done
        return choices

    def role_chunk(self, num_choices: int) -> bytes:
        """Chat streams open with the assistant's role and empty content, as OpenAI's do."""
        return self.event({"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None} for i in range(num_choices)]})

    def event(self, body: dict) -> bytes:
        """One SSE event carrying a chunk with `body`'s fields."""
        # the fields every chunk of the response shares are encoded once: this runs once per token per stream
        if self._head is None:
            head = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.model}
            self._head = "data: " + _dumps(head)[:-1]
        parts = [self._head]
        for key, value in body.items():
            parts.append(f',"{key}":{_dumps(value)}')
        parts.append("}\n\n")
        return "".join(parts).encode()


DONE = b"data: [DONE]\n\n"
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def error_event(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"
