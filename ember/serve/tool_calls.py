"""Tool calling in `/v1/chat/completions`: a request's `tools` and `tool_choice`, the JSON schema that forces a
call (`"required"`, a named function; compiled by the structured-output grammar engine), the parsers that find calls
in free output (`"auto"`: `hermes` for Hermes/Qwen's `<tool_call>{json}</tool_call>`, `llama3_json` for Llama 3's
bare JSON, chosen by `ember serve --tool-call-parser`), and the calls as OpenAI `tool_calls`, whole or as stream
deltas.

A parser reads the text generated so far and returns (content, calls): the text outside calls that is safe to show
(nothing that may still turn out to be the start of a call) and each call complete so far. Streaming sends what each
reading adds to the last, so a streamed reply adds up to the whole one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from ember.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class FunctionSpec(BaseModel):
    """One function a tool offers: its name, what it does, and its arguments as a JSON schema."""
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    """An entry of `tools`: `{"type": "function", "function": {...}}`."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: str
    function: FunctionSpec


class ToolChoiceError(ValueError):
    """A `tools` / `tool_choice` combination the server refuses; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""
    name: str
    arguments: str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- tool_choice ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolMode:
    """How a request's reply is read: `choice` is "auto" (a parser finds calls in free text), "required" (a JSON
    array of calls, forced by a grammar) or "function" (the arguments of `function`, forced by a grammar)."""
    choice: str
    tools: tuple[ToolSpec, ...]
    function: str | None = None
    parser: str | None = None
    parallel: bool = True

    def structured_output(self) -> StructuredOutputsParams | None:
        """The grammar that forces the reply's shape (None for "auto")."""
        if self.choice == "function":
            spec = next(t.function for t in self.tools if t.function.name == self.function)
            return StructuredOutputsParams(json=_parameters(spec), disable_additional_properties=bool(spec.strict))
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                       "parameters": _parameters(t.function)},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        return None

    def read(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """(content safe to show, complete calls) of the reply so far."""
        if self.choice == "function":
            return "", [ToolCall(self.function, text)] if final else []
        if self.choice == "required":
            return "", _json_calls(text, array=True)
        return PARSERS[self.parser](text, final)

    def message(self, text: str) -> dict:
        """The whole reply as an OpenAI assistant message."""
        content, calls = self.read(text, final=True)
        message = {"role": "assistant", "content": content.strip() or None}
        if calls:
            message["tool_calls"] = [call_json(call, new_call_id()) for call in calls]
        return message

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" where the model chose to call ("auto", "required"); a forced function stops."""
        if reason == "stop" and called and self.choice in ("auto", "required"):
            return "tool_calls"
        return reason


def _parameters(spec: FunctionSpec) -> dict:
    return spec.parameters if spec.parameters is not None else {"type": "object", "properties": {}}


def tool_mode(tools: list[ToolSpec] | None, tool_choice, parallel_tool_calls: bool | None,
              parser: str | None) -> ToolMode | None:
    """The request's `ToolMode`, or None when no tool may be called; ToolChoiceError for what cannot be served."""
    tools = tuple(tools or ())
    names = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise ToolChoiceError(f"tools[{i}].type {tool.type!r} is not supported; only 'function' tools are",
                                  "tools")
        name = tool.function.name
        if not _NAME.match(name):
            raise ToolChoiceError(f"tools[{i}].function.name {name!r} must be 1-64 letters, digits, '_', '.' or '-'",
                                  "tools")
        if name in names:
            raise ToolChoiceError(f"tools[{i}].function.name {name!r} is given twice", "tools")
        names.append(name)
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or set(choice) != {"type", "function"}:
            raise ToolChoiceError(f"tool_choice {choice!r} must be 'none', 'auto', 'required' or "
                                  f"{{'type': 'function', 'function': {{'name': ...}}}}", "tool_choice")
        if name not in names:
            raise ToolChoiceError(f"tool_choice names the function {name!r}, which is not among the tools "
                                  f"{names}", "tool_choice")
        return ToolMode("function", tools, function=name)
    if choice not in ("none", "auto", "required"):
        raise ToolChoiceError(f"tool_choice {choice!r} must be 'none', 'auto', 'required' or a named function",
                              "tool_choice")
    if choice == "none":
        return None
    if not tools:
        raise ToolChoiceError(f"tool_choice {choice!r} needs 'tools'", "tool_choice")
    if choice == "required":
        return ToolMode("required", tools, parallel=parallel_tool_calls is not False)
    if parser is None:
        raise ToolChoiceError("tool_choice 'auto' needs a tool-call parser: start the server with --tool-call-parser "
                              f"{' or '.join(TOOL_CALL_PARSERS)} (the model's tool-call format), or ask for "
                              f"'required' or a named function", "tool_choice")
    return ToolMode("auto", tools, parser=parser)


# ---- parsers --------------------------------------------------------------------------------------------------------
def _call_from(value) -> ToolCall | None:
    """A call from a parsed `{"name": ..., "arguments" | "parameters": {...}}`, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):      # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _json_calls(text: str, array: bool, separator: str = ",") -> list[ToolCall]:
    """The calls among the complete JSON objects of `text`: a JSON array of calls (`array`), or objects separated
    by `separator`. Reading stops at the first object that is incomplete (or malformed)."""
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if array:
        if not text.startswith("[", pos):
            return []
        pos += 1
    calls = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == separator):
            pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return calls
        call = _call_from(value)
        if call is None:
            return calls
        calls.append(call)


def _held_back(text: str, tag: str) -> int:
    """How many trailing characters of `text` may be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, final: bool) -> tuple[str, list[ToolCall]]:
    """Hermes / Qwen: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, text around them is
    content. A call left open is read at the end if its JSON is complete; a malformed one stays content."""
    content, calls, pos = [], [], 0
    while True:
        start = text.find(HERMES_OPEN, pos)
        if start < 0:
            tail = text[pos:]
            content.append(tail if final else tail[:len(tail) - _held_back(tail, HERMES_OPEN)])
            break
        content.append(text[pos:start])
        end = text.find(HERMES_CLOSE, start)
        if end < 0 and not final:
            break
        body = text[start + len(HERMES_OPEN):end if end >= 0 else len(text)]
        try:
            call = _call_from(json.loads(body))
        except ValueError:
            call = None
        if call is None:
            content.append(text[start:end + len(HERMES_CLOSE) if end >= 0 else len(text)])
        else:
            calls.append(call)
        if end < 0:
            break
        pos = end + len(HERMES_CLOSE)
    return "".join(content), calls


LLAMA_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, final: bool) -> tuple[str, list[ToolCall]]:
    """Llama 3: a reply that starts with `{` (or `<|python_tag|>`) is calls, JSON objects `{"name": ...,
    "parameters": {...}}` separated by `;`; any other reply is content. Calls that do not parse in the end leave
    the whole reply as content."""
    body = text.lstrip()
    if body.startswith(LLAMA_PYTHON_TAG):
        body = body[len(LLAMA_PYTHON_TAG):]
    elif not final and LLAMA_PYTHON_TAG.startswith(body):
        return "", []      # not known yet whether it is a call
    if not body.lstrip().startswith("{"):
        return (text if final or body else ""), []
    calls = _json_calls(body, array=False, separator=";")
    if final and not calls:
        return text, []
    return "", calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


# ---- rendering --------------------------------------------------------------------------------------------------------
def call_json(call: ToolCall, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ToolCallStream:
    """What one streamed choice has sent of its content and calls; `delta(text, final)` gives the next chunk's
    `delta` fields (None if there is nothing new)."""
    __slots__ = ("mode", "content_sent", "num_calls", "call_ids", "arguments_sent")

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.content_sent = 0          # characters of the stripped content sent
        self.num_calls = 0             # calls sent whole
        self.call_ids: list[str] = []
        self.arguments_sent = 0        # a forced function: characters of its arguments sent

    @property
    def called(self) -> bool:
        return bool(self.call_ids)

    def delta(self, text: str, final: bool) -> dict | None:
        if self.mode.choice == "function":      # the whole reply is the arguments: stream them as they come
            return self._arguments_delta(text)
        content, calls = self.mode.read(text, final)
        # the whole reply's content is stripped: leading whitespace never goes, trailing whitespace waits for more
        content = content.strip()
        delta: dict = {}
        if len(content) > self.content_sent:
            delta["content"] = content[self.content_sent:]
            self.content_sent = len(content)
        new = calls[self.num_calls:]
        if new:
            entries = []
            for i, call in enumerate(new, start=self.num_calls):
                self.call_ids.append(new_call_id())
                entries.append({"index": i, **call_json(call, self.call_ids[-1])})
            delta["tool_calls"] = entries
            self.num_calls = len(calls)
        return delta or None

    def _arguments_delta(self, text: str) -> dict | None:
        if len(text) <= self.arguments_sent:
            return None
        piece = text[self.arguments_sent:]
        self.arguments_sent = len(text)
        if not self.call_ids:
            self.call_ids.append(new_call_id())
            entry = {"index": 0, **call_json(ToolCall(self.mode.function, piece), self.call_ids[0])}
        else:
            entry = {"index": 0, "function": {"arguments": piece}}
        return {"tool_calls": [entry]}
