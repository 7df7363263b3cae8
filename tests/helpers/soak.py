"""A soak of a live `ember serve` process: many short requests, streamed and whole, at most `concurrency` at a
time, some clients leaving mid-stream and some sending malformed JSON; then what the server still holds and how its
memory moved. Used by the CPU soak (tests/unit/test_serve_soak.py) and the GPU one (tests/gpu/test_serve_soak_gpu.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

WORDS = ("Hi", "Water", "A cat", "Sun", "Python", "Moon", "Music", "Sea")      # short prompts: a few tokens each
DISCONNECT, MALFORMED, STREAM, WHOLE, CHAT = "disconnect", "malformed", "stream", "whole", "chat"


def kind_of(i: int, chat: bool) -> str:
    """Request i's kind: 2 in 20 leave mid-stream (10%), 1 in 20 sends malformed JSON (5%); the rest alternate
    streamed and whole, one in 20 a chat completion where the model has a chat template (its template's system
    prompt makes it the longest)."""
    r = i % 20
    if r < 2:
        return DISCONNECT
    if r == 2:
        return MALFORMED
    if r == 4 and chat:
        return CHAT
    return STREAM if r % 2 else WHOLE


def max_tokens_of(i: int) -> int:
    return 1 + i % 6


@dataclass
class SoakCounts:
    """How the requests ended: a whole answer checked (its tokens, its finish), a 400 error body for malformed
    JSON, a stream the client left after its first event; anything else is listed in `wrong`."""
    answered: int = 0
    errors: int = 0
    disconnected: int = 0
    wrong: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.answered + self.errors + self.disconnected + len(self.wrong)


async def _one(client: httpx.AsyncClient, i: int, text: bool, chat: bool, counts: SoakCounts) -> None:
    kind, max_tokens = kind_of(i, chat), max_tokens_of(i)
    prompt = f"{WORDS[i % len(WORDS)]} {i}" if text else [1 + i % 97, 2 + i % 13, 3, 4 + i % 5]
    body = {"model": "soak", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    url = "/v1/completions"
    if kind == MALFORMED:
        response = await client.post(url, content=b'{"prompt": "x", "max_tokens": ',
                                     headers={"content-type": "application/json"})
        error = response.json().get("error", {}) if response.status_code == 400 else {}
        if "not valid JSON" in error.get("message", ""):
            counts.errors += 1
        else:
            counts.wrong.append(f"{i} malformed: {response.status_code} {response.text[:200]}")
        return
    if kind == CHAT:
        body = {"model": "soak", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        url = "/v1/chat/completions"
    if kind == WHOLE or kind == CHAT:
        response = await client.post(url, json=body)
        result = response.json()
        ok = response.status_code == 200 and result["usage"]["completion_tokens"] == max_tokens and \
            result["choices"][0]["finish_reason"] == "length"
        if ok:
            counts.answered += 1
        else:
            counts.wrong.append(f"{i} {kind}: {response.status_code} {response.text[:200]}")
        return
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    if kind == DISCONNECT:
        body["max_tokens"] = 64          # still running when the client goes
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            counts.wrong.append(f"{i} {kind}: {response.status_code}")
            return
        lines = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if kind == DISCONNECT:
                    break              # leaving the block closes the connection: the server must abort it
    if kind == DISCONNECT:
        counts.disconnected += 1
        return
    usage = json.loads(lines[-2])["usage"] if len(lines) >= 2 and lines[-1] == "[DONE]" else None
    finishes = [json.loads(line)["choices"][0]["finish_reason"] for line in lines[:-2]]
    if usage is not None and usage["completion_tokens"] == max_tokens and finishes and finishes[-1] == "length":
        counts.answered += 1
    else:
        counts.wrong.append(f"{i} stream: {lines[-3:]}")


async def _run(base_url: str, indices: range, concurrency: int, text: bool, chat: bool) -> SoakCounts:
    counts = SoakCounts()
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        async def guarded(i: int) -> None:
            async with gate:
                try:
                    await _one(client, i, text, chat, counts)
                except Exception as exc:   # noqa: BLE001 - every failure is counted, none stops the soak
                    counts.wrong.append(f"{i} {kind_of(i, chat)}: {type(exc).__name__} {exc}")
        await asyncio.gather(*(guarded(i) for i in indices))
    return counts


def send(base_url: str, indices: range, concurrency: int = 64, text: bool = True, chat: bool = True) -> SoakCounts:
    """Send requests `indices` (their kinds from `kind_of`) and wait for every one to end."""
    return asyncio.run(_run(base_url, indices, concurrency, text, chat))


def metrics(base_url: str) -> dict[str, float]:
    """The server's /metrics as {'name{label="value",...}': value}, labels sorted, the model_name label dropped."""
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        match = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if match is None:
            continue
        name, labels, value = match.groups()
        pairs = sorted(p for p in re.findall(r'(\w+="[^"]*")', labels or "") if not p.startswith("model_name="))
        values[name + (f"{{{','.join(pairs)}}}" if pairs else "")] = float(value)
    return values


def total(values: dict[str, float], name: str, **labels: str) -> float:
    """The sum of metric `name` over the series whose labels include `labels` (every replica's, say)."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    found = [v for key, v in values.items()
             if key.split("{")[0] == name and all(w in key for w in wanted)]
    if not found:
        raise KeyError(f"no {name} {labels} in the metrics")
    return sum(found)


HELD = ("server", "engine", "runner")
# each process's resident memory as /metrics reports it: the front end's (HTTP, text) and the engine core's (the
# model, the cache on a CPU)
RESIDENT = {"front end": "process_resident_memory_bytes",
            "engine core": 'ember_engine_core_resident_memory_bytes{replica="0"}'}


def server_pids(proc, log_path) -> dict[str, int]:
    """{"front end": pid, "engine core": pid} of an `ember serve` started by `ember_serve` (its log names the
    core's pid)."""
    core = re.search(r"engine cores 0: pid (\d+)", open(log_path).read())
    if core is None:
        raise AssertionError(f"the server's log names no engine core pid: {open(log_path).read()[-2000:]}")
    return {"front end": proc.pid, "engine core": int(core.group(1))}


def anonymous_resident(pid: int) -> int:
    """Bytes of a process's anonymous resident memory (RssAnon: its heaps and tensors; not the mapped files, such as
    torch's libraries, whose clean pages the kernel drops and reads back under memory pressure)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon in /proc/{pid}/status")


def wait_idle(base_url: str, timeout: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or is held anywhere, and no KV block is in use; returns the metrics
    (AssertionError with them after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(base_url)
        figures = {name: total(values, name) for name in ("ember_num_requests_running", "ember_num_requests_waiting",
                                                          "ember_kv_cache_usage_perc")}
        figures.update({f"held by {h}": total(values, "ember_num_requests_held", holder=h) for h in HELD})
        busy = {k: v for k, v in figures.items() if v != 0}
        if not busy:
            return values
        if time.monotonic() > deadline:
            raise AssertionError(f"still busy after {timeout} s: {busy}")
        time.sleep(0.2)


@contextlib.contextmanager
def ember_serve(args: list[str], log_path, env: dict | None = None, start_timeout: float = 600.0):
    """`python -m ember serve ARGS --port P` in a process of its own, its output in `log_path`; yields (base URL,
    process). SIGTERM at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "ember", "serve", *args, "--port", str(port)],
                            env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                log.flush()
                raise AssertionError(f"ember serve exited with {proc.returncode}: "
                                     f"{open(log_path).read()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("ember serve did not start")
            time.sleep(0.5)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
