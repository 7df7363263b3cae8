"""Structured output on the default model: JSON schemas (nested objects, arrays, enums, required fields), regexes,
choices and EBNF/Lark grammars, offline and through the `openai` client on a live server. Every output parses and
validates; greedy constrained output is the same in a batch of mixed requests as alone; a schema that cannot compile
is refused (ValueError offline, 400 from the server, which keeps serving)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
import torch

from ember import LLM, SamplingParams, StructuredOutputsParams
from tests.helpers.live_server import live_server, start_core

pytest.importorskip("llguidance")

MAX_TOKENS = 96
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["name", "age", "address"], "additionalProperties": False},
    {"type": "object", "properties": {
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "count": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["colours", "count"], "additionalProperties": False},
    {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "level": {"enum": ["low", "high", 1, 2, None]},
        "note": {"type": "string", "maxLength": 10}},
     "required": ["ok", "level"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
]
SUBJECTS = ("a customer", "an order", "the weather", "a city", "a book", "a car", "a song", "a friend", "a planet",
            "a recipe")
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
CHOICES = ["yes", "no", "maybe so"]
GBNF = 'root ::= greeting " " name "!"\ngreeting ::= "Hello" | "Hi" | "Hey"\nname ::= [A-Z] [a-z] [a-z]? [a-z]? [a-z]?'
GBNF_MATCH = r"(Hello|Hi|Hey) [A-Z][a-z]{1,4}!"
LARK = 'start: "A" | "B" NUMBER\nNUMBER: /[0-9]{1,3}/'
LARK_MATCH = r"A|B[0-9]{1,3}"


@pytest.fixture(scope="module")
def llm(converted):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # the server's threads and llguidance's share two cores with torch
    yield LLM(str(converted["folder"]), device="cpu", max_model_len=512, num_kv_blocks=512, max_num_seqs=64)
    torch.set_num_threads(threads)


def _json_params(schema: dict) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=schema))


def _assert_valid_json(text: str, finish_reason: str, schema: dict) -> None:
    assert finish_reason == "stop", text        # the grammar ended it, not max_tokens
    jsonschema.validate(json.loads(text), schema)


def test_fifty_json_schema_requests_offline_all_validate(llm):
    prompts, params = [], []
    for i in range(50):
        schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(f"Describe {SUBJECTS[i // len(SCHEMAS)]} as JSON:")
        params.append(_json_params(schema))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outputs):
        _assert_valid_json(out.outputs[0].text, out.outputs[0].finish_reason, SCHEMAS[i % len(SCHEMAS)])
    # one compile per distinct schema, however many requests
    assert llm.engine.structured.compiler.num_compiled >= len(SCHEMAS)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) > len(SCHEMAS)   # prompts steer the content


@pytest.mark.parametrize("so, pattern", [
    (StructuredOutputsParams(regex=REGEX), REGEX),
    (StructuredOutputsParams(choice=CHOICES), "|".join(map(re.escape, CHOICES))),
    (StructuredOutputsParams(grammar=GBNF), GBNF_MATCH),
    (StructuredOutputsParams(grammar=LARK), LARK_MATCH),
], ids=["regex", "choice", "gbnf", "lark"])
def test_regex_choice_and_grammars_match_every_output(llm, so, pattern):
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=24, structured_outputs=so) for s in range(6)]
    outputs = llm.generate([f"Answer number {s}:" for s in range(6)], params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    assert all(re.fullmatch(pattern, t) for t in texts), texts
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)


def _mixed_requests() -> list[tuple[str, SamplingParams]]:
    """32 greedy requests: JSON schemas, regexes, choices, grammars, and a few without a grammar."""
    kinds = [StructuredOutputsParams(json=s) for s in SCHEMAS] + [
        StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=CHOICES),
        StructuredOutputsParams(grammar=GBNF), StructuredOutputsParams(json_object=True), None]
    out = []
    for i in range(32):
        so = kinds[i % len(kinds)]
        out.append((f"Item {i} for {SUBJECTS[i % len(SUBJECTS)]}:",
                    SamplingParams(temperature=0, max_tokens=16 if so is None or so.kind == "json_object"
                                   else MAX_TOKENS, structured_outputs=so)))
    return out


def _batch_against_alone(llm, alone: list[int]) -> None:
    requests = _mixed_requests()
    batch = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    for i in alone:
        prompt, params = requests[i]
        one = llm.generate(prompt, params, use_tqdm=False)[0]
        assert one.outputs[0].token_ids == batch[i].outputs[0].token_ids, (i, one.outputs[0].text)
    for (prompt, params), out in zip(requests, batch):
        if params.structured_outputs is not None and params.structured_outputs.kind == "json":
            _assert_valid_json(out.outputs[0].text, out.outputs[0].finish_reason, params.structured_outputs.json)


def test_greedy_constrained_output_in_a_mixed_batch_equals_alone(llm):
    # a JSON schema, a regex, a choice and no grammar (the slow test runs all 32)
    _batch_against_alone(llm, alone=[4, 5, 6, 9])


@pytest.mark.slow
def test_greedy_constrained_output_in_a_mixed_batch_equals_alone_all_32(llm):
    _batch_against_alone(llm, alone=list(range(32)))


def test_a_grammar_that_cannot_compile_is_refused_before_anything_runs(llm):
    steps = llm.engine.stats.num_steps
    bad = [({"type": "object", "properties": 5}, "the JSON schema cannot be compiled: properties must be an object"),
           ({"type": "nonsense"}, "the JSON schema cannot be compiled: Invalid type: nonsense")]
    for schema, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate(["x", "y"], [SamplingParams(max_tokens=4), _json_params(schema)], use_tqdm=False)
    with pytest.raises(ValueError, match=r"(?s)the regex cannot be compiled: .*unclosed group"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b")), use_tqdm=False)
    assert llm.engine.stats.num_steps == steps and not llm.engine.has_unfinished()


# ---- the server --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def core(llm):
    """The engine core in a process of its own, shared by this module's servers."""
    client = start_core(llm)
    yield client
    client.shutdown()


@pytest.fixture
def server(llm, core):
    # one app at a time takes the shared core's outputs: each test has its own
    with live_server(llm, core=core) as s:
        yield s


def test_fifty_json_schema_requests_through_the_openai_client_all_validate(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)

        async def one(i: int):
            schema = SCHEMAS[i % len(SCHEMAS)]
            if i % 2:
                return schema, await client.chat.completions.create(
                    model="test-model", messages=[{"role": "user", "content": f"Describe {SUBJECTS[i % 10]}."}],
                    temperature=0, max_tokens=MAX_TOKENS, response_format={
                        "type": "json_schema", "json_schema": {"name": f"s{i % 5}", "schema": schema,
                                                               "strict": True}})
            return schema, await client.completions.create(
                model="test-model", prompt=f"Describe {SUBJECTS[i % 10]} as JSON:", temperature=0,
                max_tokens=MAX_TOKENS, extra_body={"guided_json": schema})
        async with client:
            return await asyncio.gather(*(one(i) for i in range(50)))

    for schema, response in asyncio.run(run()):
        choice = response.choices[0]
        text = choice.message.content if hasattr(choice, "message") else choice.text
        _assert_valid_json(text, choice.finish_reason, schema)


def test_json_object_regex_and_choice_through_the_server(server):
    client = server.client()
    reply = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "A pet?"}],
                                           temperature=0, max_tokens=40, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    text = client.completions.create(model="test-model", prompt="Name and age:", temperature=0, max_tokens=24,
                                     extra_body={"structured_outputs": {"regex": REGEX}}).choices[0].text
    assert re.fullmatch(REGEX, text), text
    chunks = list(client.completions.create(model="test-model", prompt="Well?", max_tokens=8, stream=True,
                                            extra_body={"guided_choice": CHOICES}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) in CHOICES


def test_a_malformed_schema_gets_a_400_naming_it_and_the_server_keeps_serving(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": {"properties": 5}}})
    body = info.value.body
    assert body["param"] == "response_format"
    assert body["message"] == "'response_format': the JSON schema cannot be compiled: properties must be an object"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="test-model", prompt="x", max_tokens=4, extra_body={"guided_regex": "a(b"})
    assert info.value.body["param"] == "guided_regex" and "unclosed group" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="test-model", prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    assert "each ask for structured output; give one" in info.value.body["message"]
    reply = client.completions.create(model="test-model", prompt="Still there?", max_tokens=4, temperature=0,
                                      extra_body={"guided_choice": CHOICES})
    assert reply.choices[0].text in CHOICES
    server.wait_idle()


# ---- tool calling ------------------------------------------------------------------------------------------------
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city now",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 20}},
                                               "required": ["city"], "additionalProperties": False}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
def tool_server(llm, core):
    from tests.helpers.tool_template import HERMES_TOOL_TEMPLATE
    with live_server(llm, chat_template=HERMES_TOOL_TEMPLATE, tool_call_parser="hermes", core=core) as s:
        yield s


def test_a_tool_call_round_trip_with_the_openai_client(tool_server, llm):
    from tests.helpers.tool_template import HERMES_TOOL_TEMPLATE
    client = tool_server.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(model="test-model", messages=messages, tools=TOOLS, tool_choice=NAMED,
                                           temperature=0, max_tokens=MAX_TOKENS)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    # streamed, the same call arrives as deltas that add up to it
    chunks = list(client.chat.completions.create(model="test-model", messages=messages, tools=TOOLS,
                                                 tool_choice=NAMED, temperature=0, max_tokens=MAX_TOKENS,
                                                 stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    # the tool's result goes back, and the final answer is streamed
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}]
    stream = list(client.chat.completions.create(model="test-model", messages=messages, tools=TOOLS,
                                                 tool_choice="none", temperature=0, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}))
    answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    whole = client.chat.completions.create(model="test-model", messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=12)
    assert answer == whole.choices[0].message.content and answer
    conversation = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                    {"role": "tool", "content": json.dumps({"temperature_c": 21}), "tool_call_id": call.id}]
    prompt = llm.chat_prompt_text(conversation, tools=TOOLS, chat_template=HERMES_TOOL_TEMPLATE)
    assert '<tool_response>\n{"temperature_c": 21}' in prompt and "get_time" in prompt
    assert stream[-1].usage.prompt_tokens == len(llm.tokenizer.encode(prompt, add_special_tokens=False))


@pytest.mark.slow
def test_required_tool_choice_is_a_list_of_calls(tool_server):
    client = tool_server.client()
    chunks = list(client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "What time is it in Rome?"}], tools=TOOLS,
        tool_choice="required", temperature=0, max_tokens=MAX_TOKENS, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and [d.index for d in deltas] == list(range(len(deltas)))
    for d in deltas:
        schema = WEATHER if d.function.name == "get_weather" else TOOLS[1]["function"]["parameters"]
        assert d.function.name in ("get_weather", "get_time")
        jsonschema.validate(json.loads(d.function.arguments), schema)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_an_unknown_tool_name_and_a_template_without_tools_get_a_400_and_the_server_keeps_serving(tool_server,
                                                                                                   llm):
    client = tool_server.client()
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="test-model", messages=messages, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "get_news"}})
    assert info.value.body["param"] == "tool_choice"
    assert info.value.body["message"] == ("tool_choice names the function 'get_news', which is not among the tools "
                                          "['get_weather', 'get_time']")
    reply = client.chat.completions.create(model="test-model", messages=messages, tools=TOOLS, tool_choice=NAMED,
                                           temperature=0, max_tokens=MAX_TOKENS)
    jsonschema.validate(json.loads(reply.choices[0].message.tool_calls[0].function.arguments), WEATHER)
    tool_server.wait_idle()


def test_a_chat_template_that_cannot_render_tools_is_refused_with_the_reason(llm, core):
    with live_server(llm, core=core) as plain:          # the default model's own template has no place for tools
        with pytest.raises(openai.BadRequestError) as info:
            plain.client().chat.completions.create(model="test-model", messages=[{"role": "user", "content": "Hi"}],
                                                   tools=TOOLS, tool_choice="required", max_tokens=4)
        assert info.value.body["param"] == "tools"
        assert "chat template does not render tools" in info.value.body["message"]
        assert "--chat-template" in info.value.body["message"]
