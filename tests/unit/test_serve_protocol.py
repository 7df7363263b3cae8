"""The server's pieces that need no model: request checks and their messages, stream chunks that hold back a
possible stop string, Poisson arrivals and the statistics of `ember bench serve`."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from ember.bench.serve import RequestResult, arrival_times, parse_rate, summarize
from ember.engine.request import CompletionOutput, RequestOutput
from ember.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest, validation_error
from ember.serve.render import ChoiceCursor, Renderer, TokenText


def _error(model, body) -> ApiError:
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        return validation_error(exc.errors())
    with pytest.raises(ApiError) as info:
        request.check_fields()
        request.sampling_params(16)
        if isinstance(request, ChatCompletionRequest):
            request.conversation()
    return info.value


@pytest.mark.parametrize("body, param, words", [
    ({}, "prompt", "'prompt' is required"),
    ({"prompt": 3}, "prompt", "wrong type"),
    ({"prompt": "x", "n": True}, "n", "valid integer"),
    ({"prompt": "x", "top_p": 0}, "top_p", "top_p 0"),
    ({"prompt": "x", "seed": -1}, "seed", "seed -1"),
    ({"prompt": "x", "best_of": 3}, "best_of", "'best_of' is not supported"),
    ({"prompt": "x", "mystery": None}, "mystery", "unknown field 'mystery'"),
    ({"prompt": ["ok", "bad \ud800"]}, "prompt", "prompt[1] has a lone surrogate U+D800"),
])
def test_completion_request_errors_name_the_field(body, param, words):
    error = _error(CompletionRequest, body)
    assert error.status == 400 and error.param == param and words in error.message


def test_neutral_values_of_unimplemented_fields_are_accepted():
    request = CompletionRequest.model_validate({"prompt": [1, 2], "best_of": 1, "echo": False, "user": "me",
                                                "logit_bias": {}, "stop": "\n", "max_tokens": 5})
    request.check_fields()
    params = request.sampling_params(16)
    assert (params.max_tokens, params.stop, params.temperature) == (5, ("\n",), 1.0)
    assert request.prompts() == [[1, 2]]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]


def test_chat_messages_map_to_the_template():
    request = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3})
    request.check_fields()
    assert request.conversation() == [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi there"}]
    params = request.sampling_params(None)
    assert (params.max_tokens, params.logprobs) == (7, 3)
    assert _error(ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]}).param == "messages[0].role"
    # a tool's reply must name the call it answers
    assert _error(ChatCompletionRequest, {"messages": [{"role": "tool", "content": "x"}]}).param == \
        "messages[0].tool_call_id"


def _output(text: str, num_tokens: int, finish: str | None) -> RequestOutput:
    completion = CompletionOutput(0, text, list(range(num_tokens)), None, None, finish)
    return RequestOutput("0", None, [1, 2], [completion], finish is not None)


def test_stream_chunks_hold_back_what_a_stop_string_could_claim():
    renderer = Renderer(False, "m", TokenText(None), None, hold_back=len("STOP") - 1)
    cursors = [ChoiceCursor()]
    sent = []
    for text, n, finish in [("Hello S", 1, None), ("Hello ST", 2, None), ("Hello world", 3, None),
                            ("Hello world!", 4, "length")]:
        for choice in renderer.chunk_choices(0, _output(text, n, finish), cursors):
            sent.append((choice["text"], choice["finish_reason"]))
    # "S" and "ST" could have begun "STOP": they are sent only once the text moved past them
    assert sent == [("Hell", None), ("o", None), (" wo", None), ("rld!", "length")]
    assert "".join(t for t, _ in sent) == "Hello world!"
    event = renderer.event({"choices": []})
    assert event.startswith(b"data: ") and json.loads(event[6:])["object"] == "text_completion"


def test_poisson_arrivals_and_bench_statistics():
    assert arrival_times(4, float("inf"), 0) == [0.0] * 4
    times = arrival_times(2000, 20.0, 0)
    assert times == sorted(times) and times[0] == 0.0
    assert times[-1] / 1999 == pytest.approx(1 / 20.0, rel=0.1)
    assert parse_rate("inf") == float("inf") and parse_rate("8") == 8.0
    with pytest.raises(ValueError, match="request rate '0'"):
        parse_rate("0")
    results = [RequestResult(10, start=0.0, ttft=0.1, latency=0.5, output_tokens=5, itl=[0.1] * 4),
               RequestResult(20, start=0.2, ttft=0.3, latency=0.3, output_tokens=1),
               RequestResult(30, error="HTTP 503")]
    summary = summarize(results, elapsed=2.0)
    assert (summary["completed"], summary["failed"], summary["output_tokens"]) == (2, 1, 6)
    assert summary["input_tokens"] == 30 and summary["output_tok_s"] == 3.0
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert summary["tpot_ms"]["p50"] == pytest.approx(100.0)   # (0.5 - 0.1) / 4 tokens after the first
    assert summary["itl_ms"]["p99"] == pytest.approx(100.0)
    assert summary["errors"] == ["HTTP 503"]
