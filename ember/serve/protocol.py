"""OpenAI request bodies as pydantic models, the checks pydantic cannot express, and their mapping to
`SamplingParams`. Every problem becomes an `ApiError` that the app renders as an OpenAI error body with a 4xx."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ember.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams, check_grammar_backend
from ember.serve.tool_calls import ToolChoiceError, ToolMode, ToolSpec, tool_mode

# OpenAI fields ember does not implement, with the values that mean "not used": a request that sets one of them to
# anything else is refused by name rather than silently served without it
NEUTRAL_VALUES: dict[str, tuple] = {
    "best_of": (None, 1), "logit_bias": (None, {}), "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False),
    "functions": (None, []), "function_call": (None, "none"),
    "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]), "prediction": (None,), "audio": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "user": None,   # user: any value, it only labels the caller
}
# the fields that ask for structured output: OpenAI's response_format, vLLM's structured_outputs and guided_*
STRUCTURED_OUTPUT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                            "guided_grammar")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


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


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the reply must match (`strict` closes its objects to properties
    they do not name, as OpenAI's strict mode does)."""
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: `text` (no constraint), `json_object` (any JSON object) or `json_schema`."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: str
    json_schema: JsonSchemaFormat | None = None


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
    # structured output: OpenAI's field, then vLLM's extra ones (at most one of them per request)
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    def check_fields(self) -> None:
        """Refuse fields ember does not know, or knows but does not implement, by name."""
        for name, value in (self.model_extra or {}).items():
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

    @property
    def structured_field(self) -> str | None:
        """The field that asks for structured output, if one does (ApiError if several do)."""
        fields = [name for name in STRUCTURED_OUTPUT_FIELDS if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            fields.remove("response_format")
        if len(fields) > 1:
            raise ApiError(f"{' and '.join(repr(f) for f in fields)} each ask for structured output; give one",
                           param=fields[1])
        return fields[0] if fields else None

    def structured_output(self) -> StructuredOutputsParams | None:
        """What the reply must match, from whichever field asks (ApiError naming the field if it is malformed)."""
        field = self.structured_field
        if field is None:
            if self.guided_whitespace_pattern is not None:
                raise ApiError("'guided_whitespace_pattern' needs 'guided_json' or a JSON response_format",
                               param="guided_whitespace_pattern")
            return None
        try:
            check_grammar_backend(self.guided_decoding_backend, "guided_decoding_backend")
        except ValueError as exc:
            raise ApiError(str(exc), param="guided_decoding_backend") from None
        whitespace = {"whitespace_pattern": self.guided_whitespace_pattern} if self.guided_whitespace_pattern else {}
        try:
            if field == "response_format":
                return _response_format(self.response_format, whitespace)
            if field == "structured_outputs":
                return StructuredOutputsParams(**{**self.structured_outputs, **whitespace})
            kind = field.removeprefix("guided_")
            return StructuredOutputsParams(**{kind: getattr(self, field)}, **whitespace)
        except ApiError:
            raise
        except (ValueError, TypeError) as exc:
            raise ApiError(f"'{field}': {exc}", param=field) from None

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
        kwargs["structured_outputs"] = self.structured_output()
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            message = str(exc)
            param = message.split(" ", 1)[0].split("=", 1)[0]
            raise ApiError(message, param=param if param in kwargs else None) from None

    def _max_tokens(self) -> int | None:
        return self.max_tokens


def _response_format(fmt: ResponseFormat, whitespace: dict) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        if fmt.json_schema is not None:
            raise ApiError("response_format of type 'json_object' takes no 'json_schema'", param="response_format")
        return StructuredOutputsParams(json_object=True, **whitespace)
    if fmt.type != "json_schema":
        raise ApiError(f"response_format type {fmt.type!r} is not one of 'text', 'json_object', 'json_schema'",
                       param="response_format")
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise ApiError("response_format of type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}",
                       param="response_format")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema,
                                   disable_additional_properties=bool(fmt.json_schema.strict), **whitespace)


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
    tool_calls: list[dict] | None = None     # an assistant's calls
    tool_call_id: str | None = None          # a tool's reply names the call it answers

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
        if self.tool_calls:
            if self.role != "assistant":
                raise ApiError(f"{where}.tool_calls belong to assistant messages, not {self.role!r} ones",
                               param=f"{where}.tool_calls")
            message["tool_calls"] = [_template_call(call, f"{where}.tool_calls[{j}]")
                                     for j, call in enumerate(self.tool_calls)]
        if self.role == "tool":
            if self.tool_call_id is None:
                raise ApiError(f"{where} of role 'tool' needs 'tool_call_id', the id of the call it answers",
                               param=f"{where}.tool_call_id")
            message["tool_call_id"] = self.tool_call_id
        return message


def _template_call(call: dict, where: str) -> dict:
    """An assistant's call as chat templates take it: the arguments parsed from their JSON text into a dict."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., 'arguments': "
                       f"'...'}}}}", param=where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise ApiError(f"{where}.function.arguments is not valid JSON: {exc}", param=where) from None
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if "id" in call:
        out["id"] = call["id"]
    return out


class ChatCompletionRequest(_Request):
    """`POST /v1/chat/completions`: a conversation to answer, rendered with the tokenizer's chat template."""
    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

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

    def tool_mode(self, parser: str | None) -> ToolMode | None:
        """How the reply is read for tool calls (None: as plain content); ApiError for what cannot be served."""
        try:
            mode = tool_mode(self.tools, self.tool_choice, self.parallel_tool_calls, parser)
        except ToolChoiceError as exc:
            raise ApiError(str(exc), param=exc.param) from None
        if mode is not None and mode.choice != "auto" and self.structured_field is not None:
            raise ApiError(f"tool_choice {self.tool_choice!r} forces the reply's shape, and so does "
                           f"'{self.structured_field}'; give one", param=self.structured_field)
        return mode

    def tool_dicts(self) -> list[dict] | None:
        """`tools` as chat templates take them (None without tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
