"""`ember bench serve`: send a random-token workload to a running OpenAI-compatible server at a request rate
(Poisson arrivals, or all at once with `inf`) and report time to first token, time per output token, inter-token
latency and throughput, like `vllm bench serve`.

Requests are streamed `/v1/completions` calls with token-id prompts and `ignore_eos`, so that every request
produces exactly the tokens asked for; each chunk's token count comes from the server's running usage
(`stream_options.continuous_usage_stats`). A chunk that carries k tokens counts as k inter-token gaps of 1/k of
its delay."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from ember.bench.workloads import MAX_PROMPT_TOKEN_ID, Workload, parse_range, percentiles, random_workload


@dataclass
class RequestResult:
    """What one request saw, in seconds since the benchmark's start."""
    prompt_len: int
    start: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.latency is not None


def parse_rate(text: str) -> float:
    """"inf" or a positive number of requests per second."""
    if str(text).lower() == "inf":
        return float("inf")
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"request rate {text!r} must be a positive number or 'inf'") from None
    if not rate > 0:
        raise ValueError(f"request rate {text!r} must be a positive number or 'inf'")
    return rate


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    """Send times (s) of `num` requests: Poisson arrivals at `rate` per second, or all at 0 when rate is inf."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def _one(session, url: str, body: dict, result: RequestResult, t0: float) -> None:
    result.start = time.perf_counter() - t0
    sent = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    return
                usage = chunk.get("usage")
                if usage is None:
                    continue
                new = usage["completion_tokens"] - result.output_tokens
                if new <= 0:
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - sent
                    new_gaps = new - 1
                    gap_from = now
                else:
                    new_gaps, gap_from = new, last
                result.itl.extend([(now - gap_from) / new_gaps] * new_gaps if new_gaps else [])
                result.chunk_times.append(now - t0)
                result.output_tokens += new
                last = now
        result.latency = time.perf_counter() - sent
    except Exception as exc:   # noqa: BLE001 - a failed request is counted and reported, not fatal
        result.error = f"{type(exc).__name__}: {exc}"


async def run_workload(base_url: str, model: str | None, workload: Workload, rate: float, seed: int = 0,
                       temperature: float = 0.6, max_concurrency: int | None = None
                       ) -> tuple[list[RequestResult], float, str, dict | None]:
    """Send every request of `workload` at its arrival time; returns the results, the elapsed seconds (first send
    to last response), the served model's name and the server's busy time per step over the run (`busy_summary`;
    None if its /metrics has no such counters)."""
    import aiohttp
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if model is None:
            async with session.get(f"{base_url}/models") as response:
                model = (await response.json())["data"][0]["id"]
        url = f"{base_url}/completions"

        def body(prompt: list[int], max_tokens: int) -> dict:
            return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

        warm = RequestResult(len(workload.prompts[0]))
        await _one(session, url, body(workload.prompts[0][:16], 4), warm, time.perf_counter())
        if warm.error:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")

        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        results = [RequestResult(len(p)) for p in workload.prompts]
        sends = arrival_times(len(results), rate, seed)

        async def scheduled(i: int, t0: float):
            delay = sends[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is None:
                await _one(session, url, body(workload.prompts[i], workload.output_lens[i]), results[i], t0)
            else:
                async with gate:
                    await _one(session, url, body(workload.prompts[i], workload.output_lens[i]), results[i], t0)

        before = scrape_busy(base_url)      # after the warm-up: its steps are not the run's
        t0 = time.perf_counter()
        await asyncio.gather(*(scheduled(i, t0) for i in range(len(results))))
        elapsed = time.perf_counter() - t0
        busy = busy_summary(before, scrape_busy(base_url), elapsed)
    return results, elapsed, model, busy


def summarize(results: list[RequestResult], elapsed: float) -> dict:
    """Throughput and latency statistics (ms) of a run."""
    import numpy as np
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    ttft = [r.ttft * 1e3 for r in done if r.ttft is not None]
    tpot = [(r.latency - r.ttft) * 1e3 / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itl = [x * 1e3 for r in done for x in r.itl]
    e2e = [r.latency * 1e3 for r in done]

    def stats(values):
        return {"mean": float(np.mean(values)) if values else float("nan"), **percentiles(values)}

    errors = [r.error for r in results if not r.ok]
    return {"num_requests": len(results), "completed": len(done), "failed": len(errors),
            "errors": sorted(set(e or "no response" for e in errors))[:5], "elapsed_s": elapsed,
            "input_tokens": in_tokens, "output_tokens": out_tokens, "requests_s": len(done) / elapsed,
            "output_tok_s": out_tokens / elapsed, "total_tok_s": (in_tokens + out_tokens) / elapsed,
            "ttft_ms": stats(ttft), "tpot_ms": stats(tpot), "itl_ms": stats(itl), "e2e_ms": stats(e2e)}


def plot_latency(results: list[RequestResult], path: str, title: str) -> None:
    """Save TTFT per request and inter-token latency per chunk against time since the start."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    done = [r for r in results if r.ok]
    top.scatter([r.start for r in done], [r.ttft * 1e3 for r in done], s=6)
    top.set_ylabel("TTFT (ms), at send time")
    times = [t for r in done for t in r.chunk_times[1:]]
    gaps = [(b - a) * 1e3 for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    bottom.scatter(times, gaps, s=2, alpha=0.4)
    bottom.set_ylabel("gap between chunks (ms)")
    bottom.set_xlabel("time since start (s)")
    top.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


BUSY_COUNTERS = ("ember_engine_core_steps_total", "ember_engine_core_busy_seconds_total",
                 "ember_engine_core_step_seconds_total", "ember_frontend_busy_seconds_total")


def scrape_busy(base_url: str) -> dict[str, float] | None:
    """The server's busy-time counters from `/metrics`, summed over replicas (None if it has none)."""
    import re
    import urllib.request
    root = base_url[:-len("/v1")] if base_url.endswith("/v1") else base_url
    try:
        text = urllib.request.urlopen(f"{root}/metrics", timeout=10).read().decode()
    except OSError:
        return None
    totals = {}
    for name in BUSY_COUNTERS:
        values = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        if values:
            totals[name] = sum(float(v) for v in values)
    return totals if len(totals) == len(BUSY_COUNTERS) else None


def busy_summary(before: dict[str, float] | None, after: dict[str, float] | None, elapsed: float) -> dict | None:
    """Per engine-core step: the front end's event-loop busy time and the engine core's host busy time and step
    time (ms), from two scrapes around a run; and the front end's busy share of the run."""
    if before is None or after is None:
        return None
    delta = {name: after[name] - before[name] for name in BUSY_COUNTERS}
    steps = delta["ember_engine_core_steps_total"]
    if steps <= 0:
        return None
    return {"steps": int(steps),
            "frontend_busy_ms_per_step": delta["ember_frontend_busy_seconds_total"] * 1e3 / steps,
            "frontend_busy_share": delta["ember_frontend_busy_seconds_total"] / elapsed,
            "core_busy_ms_per_step": delta["ember_engine_core_busy_seconds_total"] * 1e3 / steps,
            "core_step_ms": delta["ember_engine_core_step_seconds_total"] * 1e3 / steps}


def _pct(d: dict) -> str:
    return f"{d['mean']:.2f} / {d['p50']:.2f} / {d['p90']:.2f} / {d['p99']:.2f} ms (mean / p50 / p90 / p99)"


def _report_rows(rate: str, summary: dict, offline: dict | None) -> list[tuple[str, str]]:
    rows = [("requests", f"{summary['completed']} of {summary['num_requests']} completed at rate {rate}, "
                         f"{summary['input_tokens']:,} input + {summary['output_tokens']:,} output tokens in "
                         f"{summary['elapsed_s']:.2f} s"),
            ("output", f"{summary['output_tok_s']:,.1f} tok/s"),
            ("total", f"{summary['total_tok_s']:,.1f} tok/s"),
            ("req/s", f"{summary['requests_s']:,.2f}"),
            ("TTFT", _pct(summary["ttft_ms"])), ("TPOT", _pct(summary["tpot_ms"])), ("ITL", _pct(summary["itl_ms"])),
            ("E2E", _pct(summary["e2e_ms"]))]
    busy = summary.get("busy")
    if busy is not None:
        rows.append(("busy", f"front end {busy['frontend_busy_ms_per_step']:.2f} ms a step "
                             f"({busy['frontend_busy_share']:.0%} of the run); engine core "
                             f"{busy['core_busy_ms_per_step']:.2f} ms a step (its steps take "
                             f"{busy['core_step_ms']:.2f} ms; {busy['steps']:,} steps)"))
    if offline is not None:
        rows.append(("offline", f"{offline['output_tok_s']:,.1f} output tok/s (ember bench throughput); "
                                f"server/offline {summary['output_tok_s'] / offline['output_tok_s']:.3f}"))
    if summary["failed"]:
        rows.append(("failed", f"{summary['failed']}: {'; '.join(summary['errors'])}"))
    return rows


def _split(text: str, what: str) -> list[str]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"{what} {text!r} is empty")
    return items


def _bench_serve(args) -> int:
    _check_args(args)
    rates = _split(args.request_rate, "--request-rate")
    counts = [int(n) for n in _split(args.num_prompts, "--num-prompts")]
    if len(counts) == 1:
        counts = counts * len(rates)
    if len(counts) != len(rates):
        raise ValueError(f"--num-prompts {args.num_prompts!r} needs one count, or one per rate of "
                         f"--request-rate {args.request_rate!r}")
    parsed = [parse_rate(r) for r in rates]
    lengths = parse_range(args.input_len), parse_range(args.output_len)
    base_url = args.base_url.rstrip("/")
    if not base_url.endswith("/v1"):
        base_url += "/v1"
    offline = json.loads(Path(args.compare_offline).read_text()) if args.compare_offline else None
    report = {"command": "serve", "base_url": base_url, "model": args.model, "runs": []}
    failed = 0
    for rate_text, rate, count in zip(rates, parsed, counts):
        # the same draw as `ember bench throughput --num-prompts N --seed S`, so the two compare
        workload = random_workload(count, *lengths, seed=args.seed, max_token_id=args.max_token_id)
        results, elapsed, model, busy = asyncio.run(run_workload(base_url, args.model, workload, rate, args.seed,
                                                                 args.temperature, args.max_concurrency))
        summary = summarize(results, elapsed)
        summary["busy"] = busy
        run = {"request_rate": rate_text, "num_prompts": count, "max_concurrency": args.max_concurrency, **summary}
        if offline is not None:
            run["offline_output_tok_s"] = offline["output_tok_s"]
            run["server_vs_offline"] = summary["output_tok_s"] / offline["output_tok_s"]
        report["model"] = model
        report["runs"].append(run)
        failed += summary["failed"]
        print(f"serve  {model}  {base_url}  rate {rate_text}")
        for name, value in _report_rows(rate_text, summary, offline):
            print(f"  {name:<10s}{value}")
        if args.json:   # after every rate, so that a later failure keeps the earlier numbers
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        if args.plot:
            path = Path(args.plot)
            if len(rates) > 1:
                path = path.with_name(f"{path.stem}_rate{rate_text}{path.suffix or '.png'}")
            plot_latency(results, str(path), f"{model}, rate {rate_text}, {summary['completed']} requests")
    return 0 if not failed else 1


def add_serve_parser(kinds) -> None:
    """Add `bench serve` to the `ember bench` subcommands."""
    s = kinds.add_parser("serve", help="TTFT, TPOT, ITL and throughput of a running server (like vllm bench serve)")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, with or without /v1")
    s.add_argument("--model", default=None, help="the model name to send (default: the server's first model)")
    s.add_argument("--num-prompts", default="256", help="requests per run; one count, or one per rate")
    s.add_argument("--input-len", default="100:1024", help="prompt length, N or LOW:HIGH (inclusive)")
    s.add_argument("--output-len", default="100:1024", help="output length, N or LOW:HIGH (inclusive)")
    s.add_argument("--request-rate", default="inf",
                   help="requests per second (Poisson arrivals), or inf; several (8,32,inf) run one after another")
    s.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    s.add_argument("--temperature", type=float, default=0.6)
    s.add_argument("--max-token-id", type=int, default=MAX_PROMPT_TOKEN_ID, help="prompt ids are drawn in [0, this]")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", default=None, metavar="PATH", help="write every number to this JSON file")
    s.add_argument("--plot", default=None, metavar="PATH",
                   help="save latency against time as a picture (PNG; one per rate, suffixed, for several rates)")
    s.add_argument("--compare-offline", default=None, metavar="JSON",
                   help="an `ember bench throughput --json` result of the same workload, to print the ratio")
    s.set_defaults(func=_bench_serve)


def _check_args(args: argparse.Namespace) -> None:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency {args.max_concurrency} must be at least 1")
    if args.plot:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install matplotlib")
