"""The engine core in a process of its own: its messages carry every field exactly; offline generation through it
equals generation in-process (greedy, seeded sampling, n > 1, stop strings, logprobs, 64 streams read in turns);
data parallel over two core processes serves every request through the server, on both replicas, with the
single-core outputs; and an `ember serve` whose core is killed ends every open stream with an error, fails its
health check and exits non-zero, naming the cause."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from ember import LLM, SamplingParams
from ember.sampling_params import StructuredOutputsParams
from ember.engine.core_io import CoreStats, EngineCoreOutputs, EngineCoreRequest
from tests.helpers.model_harness import random_hf_model, tiny_config
from tests.helpers.tiny_tokenizer import save_tiny_tokenizer

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

PROMPTS = [[(7 * i + 3 * j) % 300 + 10 for j in range(3 + i % 11)] for i in range(64)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine_process_llama")
    random_hf_model(tiny_config("llama"), seed=3).save_pretrained(path)
    save_tiny_tokenizer(path, 320)
    return str(path)


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # the core processes take this count too
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def inproc(folder, one_thread):
    return LLM(folder, device="cpu", max_num_seqs=64)


@pytest.fixture(scope="module")
def mp(folder, one_thread):
    llm = LLM(folder, device="cpu", max_num_seqs=64, engine_process=True)
    yield llm
    llm.shutdown()


def test_wire_carries_every_field():
    from ember.engine.wire import Codec
    codec = Codec()
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.5, frequency_penalty=-0.5, seed=2**62 + 1, max_tokens=17,
                            min_tokens=2, stop=["ab", "c"], stop_token_ids=[5, 6], ignore_eos=True, logprobs=4,
                            prompt_logprobs=1, skip_special_tokens=False, include_stop_str_in_output=True)
    request = EngineCoreRequest("r-1", [1, 2, 3], params, (11, 12, 13), 1234.5)
    back = codec.decode_request(codec.encode_request(request))
    assert back == request and back.sampling_params == params and type(back.sampling_params) is SamplingParams
    assert back.sampling_params.stop == ("ab", "c") and back.sampling_params.stop_token_ids == (5, 6)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    for structured in (StructuredOutputsParams(json=schema, disable_any_whitespace=False),
                       StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(regex="[a-z]+")):
        params = SamplingParams(max_tokens=5, structured_outputs=structured)
        back = codec.decode_request(codec.encode_request(EngineCoreRequest("r-2", [1], params, (3,)))).sampling_params
        assert back == params and back.structured_outputs.key == structured.key
    out = EngineCoreOutputs(["a", "b", "a"], [7, 8, 9], {"a": ("stop", 9, 5), "b": ("length", None, 3)},
                            {"a": [([7, 9], [-0.5, -1.25], 1), ([9, 7], [-0.25, -2.0], 1)]}, {"b": 16}, ["c"],
                            "RuntimeError: boom", CoreStats(2, 1, 30, 100, 9, 0.5, 1.5, 1, 40, 16, 3, 2, 2**33, 2**34,
                                                            50, 12, 7, 4, 3 * 2**30))
    back = codec.decode_outputs(codec.encode_outputs(out))
    assert back == out and back.stats.kv_cache_usage == 0.3 and back.stats.resident_memory == 3 * 2**30
    assert back.stats.spec_summary() == {"acceptance_rate": 7 / 12, "mean_acceptance_length": 1 + 7 / 4,
                                         "tokens_per_step": 50 / 9}


def _texts(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob,
              None if c.logprobs is None else [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()}
                                               for e in c.logprobs]) for c in o.outputs] for o in outputs]


def test_offline_outputs_equal_in_process_and_in_a_core_process(inproc, mp):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:8]] + ["hello world", "the cat sat"]
    params = [GREEDY, SamplingParams(temperature=1.0, seed=5, max_tokens=7, ignore_eos=True),
              SamplingParams(n=3, temperature=0.9, seed=9, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=["w1"]),
              SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True),     # unseeded: drawn in turn
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=["w2", "sat"],
                             include_stop_str_in_output=True),
              SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2, stop_token_ids=[PROMPTS[0][0]]),
              SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=2, logprobs=1),
              SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True)]
    want = inproc.generate(prompts, params, use_tqdm=False)
    got = mp.generate(prompts, params, use_tqdm=False)
    assert _texts(got) == _texts(want)
    assert any(c.finish_reason == "stop" for o in want for c in o.outputs)    # a stop string took effect
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want]
    assert got[8].prompt_logprobs == want[8].prompt_logprobs
    assert len(got[8].prompt_logprobs) == len(got[8].prompt_token_ids) == 2


def test_64_streams_read_in_turns_equal_in_process_generation(inproc, mp):
    want = [o.outputs[0].token_ids for o in inproc.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                            use_tqdm=False)]
    streams = {i: mp.generate_stream({"prompt_token_ids": p}, GREEDY) for i, p in enumerate(PROMPTS)}
    last = {}
    while streams:
        for i in list(streams):
            out = next(streams[i], None)
            if out is None:
                del streams[i]
            else:
                last[i] = out
    assert [last[i].outputs[0].token_ids for i in range(len(PROMPTS))] == want
    assert all(last[i].finished for i in last)
    assert mp.engine.num_tracked() == 0 and not mp.engine.has_unfinished()


def test_data_parallel_serves_every_request_on_both_replicas(folder, inproc):
    """200 streamed requests through one server over two core processes: all complete, both replicas take work,
    each equals the one-core output; then 200 offline requests added at once alternate between the replicas."""
    from tests.helpers.live_server import live_server, start_core
    prompts = [PROMPTS[i % len(PROMPTS)] + [i % 250 + 20] for i in range(200)]
    want = [o.outputs[0].text for o in inproc.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                       use_tqdm=False)]
    core = start_core(inproc, num_replicas=2)
    try:
        assert core.num_replicas == 2 and len({p.pid for p in core.procs}) == 2
        with live_server(inproc, core=core) as server:
            async def one(client, i):
                body = {"prompt": prompts[i], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                        "stream": True}
                text = ""
                async with client.stream("POST", "/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
                return text

            async def run():
                async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                             limits=httpx.Limits(max_connections=200)) as client:
                    return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))

            got = asyncio.run(run())
            server.wait_idle()
            text = httpx.get(f"{server.url}/metrics").text
        assert got == want and all(got)
        # requests go to the replica holding fewer unfinished ones: both take a share as the load shifts
        assert sum(core.num_routed) == 200 and min(core.num_routed) >= 40, core.num_routed
        finished = {r: float(v) for r, v in re.findall(
            r'^ember_request_success_total\{[^}]*replica="(\d)"[^}]*\} (\S+)$', text, re.MULTILINE)}
        assert finished == {str(i): float(n) for i, n in enumerate(core.num_routed)}
        steps = dict(re.findall(r'^ember_engine_core_steps_total\{[^}]*replica="(\d)"[^}]*\} (\S+)$', text,
                                re.MULTILINE))
        assert set(steps) == {"0", "1"} and all(float(v) > 0 for v in steps.values())
        # the offline engine over the same two cores: 200 requests added at once alternate between them
        from ember.engine.engine import Engine
        routed = list(core.num_routed)
        engine = Engine(inproc.config, inproc.setup.model_path, inproc.tokenizer, client=core)
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        outputs = {}
        while engine.has_unfinished():
            outputs.update((o.request_id, o.outputs[0].text) for o in engine.step())
        assert [outputs[i] for i in ids] == want
        assert [now - before for now, before in zip(core.num_routed, routed)] == [100, 100]
        assert core.num_unfinished == [0, 0]
    finally:
        core.shutdown()
    assert all(p.exitcode == 0 for p in core.procs)


def test_a_killed_core_fails_open_streams_and_the_server_exits_naming_it(folder, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    log = open(tmp_path / "stderr.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "ember", "serve", folder, "--device", "cpu", "--port", str(port),
                             "--max-model-len", "256"], env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        banner = ""
        while "engine cores" not in banner:       # the start-up lines: weights, address, cores
            line = proc.stdout.readline()
            assert line, banner + (tmp_path / "stderr.log").read_text()
            banner += line
        match = re.search(r"engine cores 0: pid (\d+)", banner)
        assert match, banner
        core_pid = int(match.group(1))
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)

        async def streams():
            async with httpx.AsyncClient(base_url=f"{url}/v1", timeout=60) as client:
                async def one(i):
                    body = {"prompt": PROMPTS[i], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                            "stream": True}
                    events = []
                    async with client.stream("POST", "/completions", json=body) as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line[6:])
                                if len(events) == 3 and i == 0:
                                    os.kill(core_pid, signal.SIGKILL)
                    return events
                return await asyncio.gather(*(one(i) for i in range(3)))

        results = asyncio.run(streams())
        for events in results:
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert f"pid {core_pid}" in error["message"] and "SIGKILL" in error["message"], error
            assert len(events) < 200
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and "SIGKILL" in health.json()["error"]
        start = time.monotonic()
        code = proc.wait(15)
        assert code == 1 and time.monotonic() - start < 10
        assert f"exiting: the engine core of replica 0 (pid {core_pid}) was killed by signal SIGKILL" in \
            (tmp_path / "stderr.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.slow
def test_speculative_outputs_equal_in_process_and_in_a_core_process(folder, one_thread):
    """n-gram proposals: a verify step gives a request several tokens at once, sent as one entry each; stop strings
    and logprobs inside such a run come out as they do in-process."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]}, {"prompt_token_ids": [7, 8, 9] * 3},
               "hello world hello world hello"]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["w2"])]
    inproc = LLM(folder, device="cpu", speculative_config=spec)
    want = inproc.generate(prompts, params, use_tqdm=False)
    assert inproc.engine.stats.num_accepted_tokens > 0        # runs of several tokens happened
    mp = LLM(folder, device="cpu", speculative_config=spec, engine_process=True)
    try:
        assert _texts(mp.generate(prompts, params, use_tqdm=False)) == _texts(want)
    finally:
        mp.shutdown()


def test_a_generate_reaches_the_core_as_one_batch_however_slowly_it_is_sent(folder, inproc, mp, monkeypatch):
    # the front end sends the requests slowly; the core, held until the last has come, takes no step before it, so
    # it schedules them as the in-process core does: the same tokens in as many steps
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[10:16]]
    before = inproc.engine.stats.num_steps
    want = inproc.generate(prompts, GREEDY, use_tqdm=False)
    inproc_steps = inproc.engine.stats.num_steps - before
    add = mp.engine.add_request

    def slow_add(*args, **kwargs):
        rid = add(*args, **kwargs)
        time.sleep(0.05)
        return rid

    monkeypatch.setattr(mp.engine, "add_request", slow_add)
    before = mp.engine.client.stats[0].num_steps
    got = mp.generate(prompts, GREEDY, use_tqdm=False)
    assert _texts(got) == _texts(want)
    assert mp.engine.client.stats[0].num_steps - before == inproc_steps
