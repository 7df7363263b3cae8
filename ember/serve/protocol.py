"""OpenAI request bodies as pydantic models, the checks pydantic cannot express, and their mapping to
`SamplingParams`. Every problem becomes an `ApiError` that the app renders as an OpenAI error body with a 4xx."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from ember.compat import STRUCTURED_OUTPUT_UNSUPPORTED
from ember.sampling_params import MAX_LOGPROBS, SamplingParams

# OpenAI fields ember does not implement, with the values that mean "not used": a request that sets one of them to
# anything else is refused by name rather than silently served without it
NEUTRAL_VALUES: dict[str, tuple] = {
    "best_of": (None, 1), "logit_bias": (None, {}), "suffix": (None, ""),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None, True, False),
    "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]), "prediction": (None,), "audio": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "user": None,   # user: any value, it only labels the caller
}
# fields that ask for structured output (OpenAI's and vLLM's extra ones), refused with one message where set
STRUCTURED_OUTPUT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                            "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs")
CHAT_ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    """A request the server refuses, rendered as `{"error": {...}}` with an HTTP status."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(errors: list[dict]) -> ApiError:
    """One ApiError from pydantic's (or FastAPI's) list of validation errors, naming the field and the value."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if not loc:
        return ApiError(f"the request body must be a JSON object: {first['msg']}")
    param = loc[0]
    if first.get("type") == "missing":
        return ApiError(f"'{'.'.join(loc)}' is required", param=param)
    if sum(1 for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == [param]) > 1 \
            and len(loc) > 1 and not loc[1].isdigit():
        # a union: pydantic reports one error per accepted type
        return ApiError(f"'{param}' has the wrong type: {_short(first.get('input'))} is none of the accepted "
                        f"types", param=param)
    return ApiError(f"'{'.'.join(loc)}': {first['msg']} (got {_short(first.get('input'))})", param=param)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_text(text: str, where: str) -> None:
    """Refuse text no tokenizer can encode (a lone surrogate, which JSON's \\ud800 escapes can produce)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(f"{where} has a lone surrogate U+{ord(text[exc.start]):04X} at index {exc.start}; text must be "
                       f"valid Unicode", param=where.split("[")[0].split(".")[0]) from None


class StreamOptions(BaseModel):
    """`stream_options`: a usage chunk at the end, or usage on every chunk (`continuous_usage_stats`)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Request(BaseModel):
    """The sampling fields both endpoints share; None means the OpenAI default."""
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    def check_fields(self) -> None:
        """Refuse fields ember does not know, or knows but does not implement, by name."""
        for name, value in (self.model_extra or {}).items():
            if name in STRUCTURED_OUTPUT_FIELDS:
                if value not in NEUTRAL_VALUES.get(name, (None,)):
                    raise ApiError(f"'{name}': {STRUCTURED_OUTPUT_UNSUPPORTED}", param=name, code="unsupported_field")
                continue
            if name not in NEUTRAL_VALUES:
                raise ApiError(f"unknown field '{name}'", param=name, code="unsupported_field")
            neutral = NEUTRAL_VALUES[name]
            if neutral is not None and value not in neutral:
                raise ApiError(f"'{name}' is not supported by this server (got {_short(value)})", param=name,
                               code="unsupported_field")
        if self.stream_options is not None and not self.stream:
            raise ApiError("'stream_options' is only allowed when 'stream' is true", param="stream_options")

    def _logprobs(self) -> int | None:
        raise NotImplementedError

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """The request's `SamplingParams`; a bad value raises ApiError naming it."""
        values = dict(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                      repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty, seed=self.seed, min_tokens=self.min_tokens,
                      stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                      skip_special_tokens=self.skip_special_tokens,
                      include_stop_str_in_output=self.include_stop_str_in_output)
        kwargs = {k: v for k, v in values.items() if v is not None}
        kwargs["max_tokens"] = self._max_tokens() if self._max_tokens() is not None else default_max_tokens
        kwargs["logprobs"] = self._logprobs()
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            message = str(exc)
            param = message.split(" ", 1)[0].split("=", 1)[0]
            raise ApiError(message, param=param if param in kwargs else None) from None

    def _max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_Request):
    """`POST /v1/completions`: a prompt (text or token ids, or a list of either) to continue. With `echo` each choice
    starts with its prompt (and its logprobs with the prompt's); `echo` with `max_tokens` 0 generates nothing."""
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens` 0: the prompt (and its logprobs) and no completion."""
        return bool(self.echo) and self.max_tokens == 0

    def check_fields(self) -> None:
        super().check_fields()
        for i, prompt in enumerate(self.prompts()):
            if isinstance(prompt, str):
                check_text(prompt, "prompt" if isinstance(self.prompt, str) else f"prompt[{i}]")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or each of a list."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _max_tokens(self) -> int | None:
        # nothing is generated for echo with max_tokens 0; the parameters of the one token it stands for are checked
        return 1 if self.echo_only else self.max_tokens


class ChatMessage(BaseModel):
    """One message of a conversation; content is a string or a list of text parts."""
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict] | None = None
    name: str | None = None

    def to_template(self, index: int) -> dict:
        """The message as chat templates expect it; refuses what the server cannot render."""
        where = f"messages[{index}]"
        if self.role not in CHAT_ROLES:
            raise ApiError(f"{where}.role {self.role!r} is not a known role; use one of {', '.join(CHAT_ROLES)}",
                           param=f"{where}.role")
        for name, value in (self.model_extra or {}).items():
            if value not in (None, [], ""):
                raise ApiError(f"{where}.{name} is not supported by this server", param=f"{where}.{name}",
                               code="unsupported_field")
        content = self.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(f"{where}.content[{j}] of type {part.get('type')!r} is not supported; only "
                                   f"text parts are", param=f"{where}.content", code="unsupported_field")
                texts.append(part["text"])
            content = "".join(texts)
        if content:
            check_text(content, f"{where}.content")
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Request):
    """`POST /v1/chat/completions`: a conversation to answer, rendered with the tokenizer's chat template."""
    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict | None = None

    def check_fields(self) -> None:
        super().check_fields()
        if not self.messages:
            raise ApiError("'messages' is empty; give at least one message", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(f"top_logprobs {self.top_logprobs} must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                           param="continue_final_message")

    def conversation(self) -> list[dict]:
        return [m.to_template(i) for i, m in enumerate(self.messages)]

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
