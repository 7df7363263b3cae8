"""Tool calls without a model: `tools` / `tool_choice` checks, the schema that forces calls, the hermes and
llama3_json parsers on whole replies, and streamed deltas that add up to the whole reply whatever the chunking."""

from __future__ import annotations

import json

import pytest

from ember.serve.tool_calls import (ToolCall, ToolCallStream, ToolChoiceError, ToolSpec, parse_hermes,
                                    parse_llama3_json, tool_mode)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [ToolSpec.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}),
         ToolSpec.model_validate({"type": "function", "function": {"name": "get_time"}})]


@pytest.mark.parametrize("tools, choice, parser, param, words", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice",
     "names the function 'nope', which is not among the tools ['get_weather', 'get_time']"),
    (TOOLS, "auto", None, "tool_choice", "needs a tool-call parser: start the server with --tool-call-parser"),
    (None, "required", None, "tool_choice", "tool_choice 'required' needs 'tools'"),
    (TOOLS, "sometimes", None, "tool_choice", "must be 'none', 'auto', 'required' or a named function"),
    (TOOLS + TOOLS[:1], "required", None, "tools", "'get_weather' is given twice"),
    ([ToolSpec.model_validate({"type": "web_search", "function": {"name": "x"}})], "required", None, "tools",
     "tools[0].type 'web_search' is not supported"),
])
def test_tool_choice_errors_name_the_field(tools, choice, parser, param, words):
    with pytest.raises(ToolChoiceError) as info:
        tool_mode(tools, choice, None, parser)
    assert info.value.param == param and words in str(info.value)


def test_modes_and_the_schemas_that_force_calls():
    assert tool_mode(None, None, None, None) is None and tool_mode(TOOLS, "none", None, "hermes") is None
    assert tool_mode(TOOLS, None, None, "hermes").choice == "auto"       # tools given: "auto" by default
    named = tool_mode(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, None)
    assert named.structured_output().json == WEATHER
    required = tool_mode(TOOLS, "required", False, None).structured_output().json
    assert required["minItems"] == 1 and required["maxItems"] == 1
    names = [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}


HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_hermes_finds_calls_and_keeps_the_text_around_them():
    content, calls = parse_hermes(HERMES_REPLY, final=True)
    assert content.strip() == "Let me check."
    assert calls == [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", "{}")]
    # a malformed call stays text; an unclosed one with complete JSON is read at the end
    assert parse_hermes('<tool_call>{"name": 3}</tool_call>', final=True) == ('<tool_call>{"name": 3}</tool_call>',
                                                                             [])
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {}}', final=True)[1] == [ToolCall("f", "{}")]
    assert parse_hermes("no calls here", final=True) == ("no calls here", [])
    # mid-stream, text that may still become a tag waits
    assert parse_hermes("Sure <tool_c", final=False) == ("Sure ", [])


def test_llama3_json_reads_calls_or_content():
    reply = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", ' \
            '"parameters": {}}'
    assert parse_llama3_json(reply, final=True) == ("", [ToolCall("get_weather", '{"city": "Oslo"}'),
                                                         ToolCall("get_time", "{}")])
    assert parse_llama3_json("It is sunny.", final=True) == ("It is sunny.", [])
    assert parse_llama3_json('{"oops": 1}', final=True) == ('{"oops": 1}', [])      # not a call: content
    assert parse_llama3_json("<|pyth", final=False) == ("", [])                     # not known yet


def _stream(mode, text: str, step: int) -> tuple[str, list[dict]]:
    """Feed `text` to a ToolCallStream `step` characters at a time; returns the content and the merged calls."""
    stream = ToolCallStream(mode)
    content, calls = "", {}
    for end in list(range(step, len(text), step)) + [len(text)]:
        delta = stream.delta(text[:end], final=end == len(text))
        for entry in (delta or {}).get("tool_calls", []):
            merged = calls.setdefault(entry["index"], {"name": "", "arguments": ""})
            merged["name"] += entry.get("function", {}).get("name", "")
            merged["arguments"] += entry["function"].get("arguments", "")
            if "id" in entry:
                merged["id"] = entry["id"]
        content += (delta or {}).get("content", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_deltas_add_up_to_the_whole_reply(step):
    auto = tool_mode(TOOLS, "auto", None, "hermes")
    whole = auto.message(HERMES_REPLY)
    content, calls = _stream(auto, HERMES_REPLY, step)
    assert content == whole["content"] == "Let me check."
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    assert all(c["id"].startswith("call_") for c in calls)
    named = tool_mode(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, None)
    arguments = '{"city":"Paris"}'
    content, calls = _stream(named, arguments, step)
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [("get_weather", arguments)]
    required = tool_mode(TOOLS, "required", None, None)
    reply = '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"Rome"}}]'
    content, calls = _stream(required, reply, step)
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_time", {}), ("get_weather", {"city": "Rome"})]
    assert required.finish_reason("stop", True) == "tool_calls" and named.finish_reason("stop", True) == "stop"
