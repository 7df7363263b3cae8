"""`ember bench throughput` and `ember bench latency`: the standard random-token workloads (`workloads.py`), timed
through the public engine API, reported beside the memory roofline and, on request, beside transformers on the
same shapes (`hf_peer.py`)."""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

from ember.args import DefaultsHelpFormatter, add_engine_args, engine_kwargs
from ember.bench.hf_peer import hf_latency, hf_throughput
from ember.bench.roofline import (decode_roofline, decode_weight_bytes, device_sync, kv_bytes_per_token,
                                  measure_copy_bandwidth, run_roofline)
from ember.bench.workloads import MAX_PROMPT_TOKEN_ID, Workload, parse_range, percentiles, random_workload
from ember.kernels.jit_counter import process_counter

# ---- ember runs ---------------------------------------------------------------------------------------------------
def startup_times(llm) -> dict[str, float]:
    """Seconds the engine spent loading, compiling, capturing CUDA graphs and warming up Triton kernels at
    start-up."""
    t = llm.engine.runner.times
    # the worker compiles before the steps are warm-up too; precompile_s says how much of it they were
    return {"load_s": t.load_s, "compile_s": t.compile_s, "capture_s": t.capture_s,
            "warmup_s": t.warmup_s + t.precompile_s, "precompile_s": t.precompile_s}


class CompileWatch:
    """Triton compilations (ember.kernels.jit_counter) between `start()` and `stop()`: how many, and of which
    kernels."""

    def __init__(self):
        self.counter = process_counter()
        self._before = 0
        self._kernels_before: dict[str, int] = {}

    def start(self) -> None:
        self._before, self._kernels_before = self.counter.total, dict(self.counter.kernels)

    def stop(self) -> dict:
        """{"triton_compiles": N, "triton_compiled_kernels": {name: count}} since `start()`."""
        kernels = {name: n - self._kernels_before.get(name, 0) for name, n in self.counter.kernels.items()
                   if n > self._kernels_before.get(name, 0)}
        return {"triton_compiles": self.counter.total - self._before, "triton_compiled_kernels": kernels}


def model_bytes(llm, tokens_per_step: int | None = None) -> tuple[int, int]:
    """(weight bytes read per step, KV bytes per token) of the loaded model as stored (fp8 weights and their scales,
    an fp8 KV cache), on one GPU (rank 0's shard); with `tokens_per_step`, a MoE layer counts only the experts that
    many tokens choose (roofline.decode_weight_bytes)."""
    runner = llm.engine.runner
    return (decode_weight_bytes(runner.model, runner.hf_config, tokens_per_step),
            kv_bytes_per_token(runner.hf_config, runner.attn.groups[0].spec.dtype,
                               runner.config.parallel.tensor_parallel_size))


def run_throughput(llm, workload: Workload, temperature: float = 0.6, warmup: bool = True,
                   structured: list | None = None) -> dict:
    """Generate the whole workload in one `generate` call; returns rates, step count, elapsed time and the Triton
    compilations inside the timed call. `structured`: grammars (`StructuredOutputsParams`) dealt to the requests in
    turn."""
    from ember import SamplingParams
    device = llm.engine.runner.device
    if warmup:
        # shorter than a block, so that it leaves nothing in the prefix cache
        llm.generate([{"prompt_token_ids": list(range(1, 9))}], SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n,
                             structured_outputs=structured[i % len(structured)] if structured else None)
              for i, n in enumerate(workload.output_lens)]
    stats = llm.engine.stats
    steps_before, host_before, wait_before = stats.num_steps, stats.host_s, stats.device_wait_s
    hits_before = stats.num_prefix_cache_hits
    spec_before = (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_verified_requests,
                   stats.num_generated_tokens)
    compiles = CompileWatch()
    device_sync(device)
    compiles.start()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False)
    device_sync(device)
    elapsed = time.perf_counter() - start
    compiled = compiles.stop()
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    total = workload.input_tokens + produced
    return {"num_prompts": len(workload.prompts), "input_tokens": workload.input_tokens, "output_tokens": produced,
            "elapsed_s": elapsed, "output_tok_s": produced / elapsed, "total_tok_s": total / elapsed,
            "requests_s": len(workload.prompts) / elapsed, "num_steps": stats.num_steps - steps_before,
            "prefix_cache_hit_tokens": stats.num_prefix_cache_hits - hits_before,
            "host_ms_per_step": (stats.host_s - host_before) * 1e3 / max(stats.num_steps - steps_before, 1),
            "device_wait_ms_per_step": (stats.device_wait_s - wait_before) * 1e3 / max(stats.num_steps - steps_before,
                                                                                      1),
            **spec_figures(stats, spec_before, stats.num_steps - steps_before), **compiled}


def spec_figures(stats, before: tuple[int, int, int, int], num_steps: int) -> dict:
    """Speculative decoding's acceptance rate, mean acceptance length and tokens per step over a run."""
    drafts, accepted, verified, generated = (now - b for now, b in zip(
        (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_verified_requests, stats.num_generated_tokens),
        before))
    out = {"tokens_per_step": generated / max(num_steps, 1)}
    if drafts:
        out.update(spec_draft_tokens=drafts, spec_accepted_tokens=accepted, acceptance_rate=accepted / drafts,
                   mean_acceptance_length=1 + accepted / max(verified, 1))
    return out


def run_throughput_repeats(llm, workload: Workload, temperature: float, repeat: int) -> dict:
    """`run_throughput` `repeat` times on the same workload in one process, the prefix cache emptied before each
    repeat so that every run computes every prompt token. The first run's figures lead (the first-run figure is
    the one a user meets); `runs` lists every run's rate and compilations."""
    if repeat < 1:
        raise ValueError(f"repeat {repeat} must be at least 1")
    results = []
    for i in range(repeat):
        if i:
            llm.engine.kv.pool.reset_prefix_cache()
        results.append(run_throughput(llm, workload, temperature, warmup=i == 0))
    first = dict(results[0])
    if repeat > 1:
        first["runs"] = [{k: r[k] for k in ("elapsed_s", "output_tok_s", "total_tok_s", "num_steps",
                                            "prefix_cache_hit_tokens", "triton_compiles")} for r in results]
    return first


def _latency_iteration(engine, prompts: list[list[int]], params) -> tuple[list[float], list[float], float]:
    """One batch from arrival to its last token: (TTFT of each request, duration of each decode step, total)."""
    device = engine.runner.device
    device_sync(device)
    start = time.perf_counter()
    ids = {engine.add_request(p, params) for p in prompts}
    first: dict[str, float] = {}
    decode_steps: list[float] = []
    last = start
    while engine.has_unfinished():
        outputs = engine.step(stream=True)   # no device sync here: it would undo the engine's overlap
        now = time.perf_counter()
        if len(first) == len(ids):   # every request had its first token before this step: a pure decode step
            decode_steps.append(now - last)
        for out in outputs:
            if out.request_id in ids:     # not the final output of a request aborted earlier
                first.setdefault(out.request_id, now - start)
        last = now
    return [first[i] for i in ids], decode_steps, last - start


def run_latency(llm, batch_size: int, input_len: int, output_len: int, num_iters: int = 5, seed: int = 0,
                max_token_id: int = MAX_PROMPT_TOKEN_ID) -> dict:
    """Step the engine over `num_iters` fresh batches (after one warm-up batch) timing every step: TTFT and
    TPOT (decode step time) percentiles in ms, and the decode rate."""
    from ember import SamplingParams
    if output_len < 2:
        raise ValueError(f"output_len {output_len} must be at least 2 to time a decode step")
    if batch_size < 1 or input_len < 1 or num_iters < 1:
        raise ValueError(f"batch_size {batch_size}, input_len {input_len} and num_iters {num_iters} must each be "
                         f"at least 1")
    engine = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    ttfts, tpots, totals = [], [], []
    stats = engine.stats
    compiles = CompileWatch()
    compiles.start()
    for it in range(num_iters + 1):
        if it == 1:   # after the warm-up batch
            steps0, host0, wait0 = stats.num_steps, stats.host_s, stats.device_wait_s
            first_batch = compiles.stop()["triton_compiles"]
            compiles.start()
        # fresh prompts every iteration so that the prefix cache never shortens a prefill
        prompts = [[rng.randint(0, max_token_id) for _ in range(input_len)] for _ in range(batch_size)]
        ttft, steps, total = _latency_iteration(engine, prompts, params)
        if it > 0:
            ttfts += ttft
            tpots += steps
            totals.append(total)
    decode_s = sum(tpots)
    steps = max(stats.num_steps - steps0, 1)
    compiled = compiles.stop()
    return {**compiled, "triton_compiles_first_batch": first_batch, "batch_size": batch_size, "input_len": input_len, "output_len": output_len, "num_iters": num_iters,
            "host_ms_per_step": (stats.host_s - host0) * 1e3 / steps,
            "device_wait_ms_per_step": (stats.device_wait_s - wait0) * 1e3 / steps,
            "ttft_ms": {k: v * 1e3 for k, v in percentiles(ttfts).items()},
            "tpot_ms": {k: v * 1e3 for k, v in percentiles(tpots).items()},
            "latency_s": percentiles(totals), "mean_tpot_s": decode_s / len(tpots),
            "decode_tok_s": batch_size * len(tpots) / decode_s}


def profile_workload(llm, prompts: list[list[int]], params, num_steps: int, skip_steps: int):
    """Queue the prompts, step past `skip_steps` (prefills), profile the next `num_steps` steps, abort the rest."""
    from ember.bench.profiler import profile_steps
    engine = llm.engine
    ids = [engine.add_request(p, params[i] if isinstance(params, list) else params) for i, p in enumerate(prompts)]
    try:
        for _ in range(skip_steps):
            if not engine.has_unfinished():
                break
            engine.step()
        return profile_steps(engine, num_steps)
    finally:
        for rid in ids:
            engine.abort(rid)


def release_engine(llm) -> tuple:
    """Drop the engine and give its memory (KV cache included) back before another model is built; returns the
    (hf_config, dtype) a peer needs to build the same model."""
    runner = llm.engine.runner
    shape = runner.hf_config, runner.dtype
    del llm.engine, runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return shape


def try_peer(fn, *args, **kwargs) -> tuple[dict | None, str | None]:
    """(the transformers figures, None) or (None, why there are none): a failing peer must not hide ember's."""
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:   # noqa: BLE001 - whatever breaks in the peer is reported beside ember's numbers
        return None, f"{type(exc).__name__}: {exc}"


def _compare_with_hf(llm, result: dict, rows: list, key: str, peer, describe) -> None:
    """Release ember's engine, run `peer(hf_config, dtype)` (the same model in transformers) and add its figures,
    ember's ratio on `key` and a row, `describe(figures, ratio)` or why the peer failed, to `result` and `rows`."""
    hf, error = try_peer(peer, *release_engine(llm))
    ratio = result[key] / hf[key] if hf else None
    result.update(hf=hf, hf_error=error, ember_vs_hf=ratio)
    rows.append(("transformers", describe(hf, ratio) if hf else f"failed: {error}"))


# ---- the command line ---------------------------------------------------------------------------------------------
_open_engines: list = []     # the LLMs a command built, shut down when it returns (`_closing`)


def _build_llm(args):
    from ember import LLM
    if args.config and args.model:
        raise ValueError(f"give --model {args.model!r} or --config {args.config!r}, not both")
    if args.config:
        llm = LLM(args.config, load_format="dummy", **engine_kwargs(args))
    else:
        llm = LLM(args.model, load_format=args.load_format, **engine_kwargs(args))
    _open_engines.append(llm)
    return llm


def _closing(command):
    """`command(args)`, then its report flushed and its engines shut down (their worker and core processes end
    here, in order, rather than in the interpreter's exit)."""
    def run(args) -> int:
        try:
            return command(args)
        finally:
            sys.stdout.flush()
            while _open_engines:
                llm = _open_engines.pop()
                if getattr(llm, "engine", None) is not None:     # release_engine may have dropped it already
                    llm.shutdown()
    return run


def _device(args) -> torch.device:
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def _max_token_id(llm) -> int:
    return min(MAX_PROMPT_TOKEN_ID, llm.engine.vocab_size - 1)


def _header(llm, args, startup_compiles: int) -> dict:
    runner = llm.engine.runner
    return {"model": args.config or args.model or "default", "device": str(runner.device), "dtype": str(runner.dtype),
            "quantization": runner.quant.describe() if runner.quant is not None else None,
            "kv_cache_dtype": str(runner.attn.groups[0].spec.dtype),
            "attention": {"backends": sorted({b.name for b in runner.attn.backends}),
                          "options": dict(llm.config.attention_backend_options)},
            "startup": {**startup_times(llm), "triton_compiles": startup_compiles}}


def _build_counted(args):
    """The engine, and the Triton compilations its start-up made."""
    watch = CompileWatch()
    watch.start()
    llm = _build_llm(args)
    return llm, watch.stop()["triton_compiles"]


def _compile_row(result: dict) -> tuple[str, str]:
    kernels = result["triton_compiled_kernels"]
    names = ", ".join(f"{name} x{n}" for name, n in sorted(kernels.items(), key=lambda kv: -kv[1])[:6])
    return ("compiles", f"Triton compiles during the run: {result['triton_compiles']}"
                        + (f" ({names})" if names else ""))


def _host_row(result: dict) -> str:
    return (f"{result['host_ms_per_step']:.3f} ms/step busy, {result['device_wait_ms_per_step']:.3f} ms/step "
            f"waiting for the device")


def _print_report(result: dict, rows: list[tuple[str, str]]) -> None:
    head = f"{result['command']}  {result['model']}  {result['device']} {result['dtype'].replace('torch.', '')}"
    attention = result.get("attention")
    if attention:   # the backend, and the switches an A/B run changes
        head += "  " + ",".join(attention["backends"])
        head += "".join(f" {name}={value}" for name, value in sorted(attention["options"].items()))
    print(head)
    # the number formats the roofline's bytes are counted in: fp8 weights and an fp8 KV cache at one byte
    formats = [result["quantization"]] if result.get("quantization") else []
    if result.get("kv_cache_dtype") not in (None, result["dtype"]):
        formats.append(f"KV cache {result['kv_cache_dtype'].replace('torch.', '')}")
    if formats:
        rows = [("formats", "; ".join(formats))] + rows
    s = result["startup"]
    rows = rows + [("start-up", f"load {s['load_s']:.1f} s, compile {s['compile_s']:.1f} s, "
                                f"capture {s['capture_s']:.1f} s, warm-up {s['warmup_s']:.1f} s "
                                f"({s['triton_compiles']} Triton compiles)")]
    for name, value in rows:
        print(f"  {name:<14s}{value}")


def _finish(result: dict, rows: list[tuple[str, str]], json_path: str | None) -> None:
    """Print the report (and the step profile, if one was taken); write the numbers as JSON when asked."""
    _print_report(result, rows)
    profile = result.get("profile")
    if profile is not None:
        print(profile.table())
        result["profile"] = profile.as_dict()
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")


def _throughput(args) -> int:
    workload_args = (args.num_prompts, parse_range(args.input_len), parse_range(args.output_len))
    device = _device(args)
    bandwidth = measure_copy_bandwidth(device)        # before the KV cache takes the free memory
    llm, startup_compiles = _build_counted(args)
    workload = random_workload(*workload_args, seed=args.seed, max_token_id=_max_token_id(llm))
    if args.structured_output:
        from ember.bench.structured import run_structured_throughput, structured_rows
        result = {"command": "throughput --structured-output json", **_header(llm, args, startup_compiles),
                  **run_structured_throughput(llm, workload, args.temperature, args.num_schemas, run_throughput)}
        _finish(result, structured_rows(result), args.json)
        return 0
    result = {"command": "throughput", **_header(llm, args, startup_compiles),
              **run_throughput_repeats(llm, workload, args.temperature, args.repeat)}
    weight_bytes, kv_token_bytes = model_bytes(llm)
    roof = run_roofline(weight_bytes, kv_token_bytes, result["num_steps"], [len(p) for p in workload.prompts],
                        workload.output_lens, bandwidth, result["elapsed_s"])
    result["roofline"] = roof.as_dict()
    rows = [("prompts", f"{result['num_prompts']}: {result['input_tokens']:,} input + "
                        f"{result['output_tokens']:,} output tokens in {result['num_steps']:,} steps"),
            ("elapsed", f"{result['elapsed_s']:.2f} s"),
            ("output", f"{result['output_tok_s']:,.1f} tok/s   ({roof.describe()})"),
            ("total", f"{result['total_tok_s']:,.1f} tok/s"),
            ("requests", f"{result['requests_s']:,.2f} req/s"),
            ("host", _host_row(result)),
            _compile_row(result)]
    if "acceptance_rate" in result:
        rows.append(("speculation", f"acceptance rate {result['acceptance_rate']:.3f}, mean acceptance length "
                                    f"{result['mean_acceptance_length']:.2f}, {result['tokens_per_step']:.2f} "
                                    f"tokens per step"))
    if "runs" in result:
        runs = result["runs"]
        rows.append(("repeats", ", ".join(f"run {i + 1}: {r['output_tok_s']:,.1f} tok/s ({r['triton_compiles']} "
                                          f"compiles)" for i, r in enumerate(runs))
                     + f"; run 1 / run 2 {runs[0]['output_tok_s'] / runs[1]['output_tok_s']:.3f}"))
    if args.profile:
        from ember import SamplingParams
        params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
                  for n in workload.output_lens]
        # past the prefills: enough steps for every prompt token to have gone through the token budget
        skip = -(-workload.input_tokens // llm.engine.config.scheduler.max_num_batched_tokens) + 8
        result["profile"] = profile_workload(llm, workload.prompts, params, args.profile, skip)
    if args.compare_hf:
        n = min(args.hf_num_prompts, len(workload.prompts))
        subset = Workload(workload.prompts[:n], workload.output_lens[:n])
        _compare_with_hf(llm, result, rows, "output_tok_s",
                         lambda hf_config, dtype: hf_throughput(hf_config, dtype, device, subset, args.hf_batch_size,
                                                                args.temperature),
                         lambda hf, ratio: f"{hf['output_tok_s']:,.1f} output tok/s ({n} prompts, padded batches of "
                                           f"{args.hf_batch_size}); ember/transformers {ratio:.2f}x")
    _finish(result, rows, args.json)
    return 0


def _latency(args) -> int:
    device = _device(args)
    bandwidth = measure_copy_bandwidth(device)
    llm, startup_compiles = _build_counted(args)
    max_id = _max_token_id(llm)
    lat = run_latency(llm, args.batch_size, args.input_len, args.output_len, args.num_iters, args.seed, max_id)
    result = {"command": "latency", **_header(llm, args, startup_compiles), **lat}
    weight_bytes, kv_token_bytes = model_bytes(llm, args.batch_size)
    roof = decode_roofline(weight_bytes, kv_token_bytes, args.batch_size, args.input_len, args.output_len,
                           bandwidth, lat["mean_tpot_s"])
    result["roofline"] = roof.as_dict()
    pct = lambda d: " / ".join(f"{d[k]:.2f}" for k in ("p50", "p90", "p99"))   # noqa: E731
    rows = [("shape", f"batch {args.batch_size}, input {args.input_len}, output {args.output_len}, "
                      f"{args.num_iters} iterations"),
            ("TTFT", f"{pct(lat['ttft_ms'])} ms (p50 / p90 / p99)"),
            ("TPOT", f"{pct(lat['tpot_ms'])} ms (p50 / p90 / p99)"),
            ("decode", f"{lat['decode_tok_s']:,.1f} tok/s   ({roof.describe()})"),
            ("host", _host_row(lat)),
            _compile_row(lat)]
    if args.profile:
        from ember import SamplingParams
        rng = random.Random(args.seed + 1)
        prompts = [[rng.randint(0, max_id) for _ in range(args.input_len)] for _ in range(args.batch_size)]
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.profile + 4)
        skip = 0 if args.profile_prefill else 2        # the prefill step (and the first decode) or past them
        result["profile"] = profile_workload(llm, prompts, params, args.profile, skip)
    if args.compare_hf:
        _compare_with_hf(llm, result, rows, "decode_tok_s",
                         lambda hf_config, dtype: hf_latency(hf_config, dtype, device, args.batch_size, args.input_len,
                                                             args.output_len, args.hf_num_iters, args.seed, max_id),
                         lambda hf, ratio: f"{hf['decode_tok_s']:,.1f} decode tok/s, TTFT p50 "
                                           f"{hf['ttft_ms']['p50']:.2f} ms ({hf['cache']} cache); ember/transformers "
                                           f"{ratio:.2f}x")
    _finish(result, rows, args.json)
    return 0


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="a bundled model config (ember/configs: qwen3-0.6b, llama-3.2-1b, llama-3.1-8b, gemma-3-1b, "
                        "qwen3-30b-a3b, mixtral-8x7b, pythia-1b) with random weights")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="'dummy' gives --model's architecture random weights")
    p.add_argument("--json", default=None, metavar="PATH", help="write every number to this JSON file")
    p.add_argument("--compare-hf", action="store_true",
                   help="also run transformers on the same shapes (random weights from the same config)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after the timed run, profile this many decode steps and print where their time goes")
    p.add_argument("--profile-prefill", action="store_true",
                   help="latency: profile from the first step on (the prefill) instead of after it")


def add_bench_parser(subparsers) -> None:
    """Add `bench throughput`, `bench latency` and `bench serve` to the `ember` command line."""
    bench = subparsers.add_parser("bench", help="benchmark throughput or latency against the memory roofline")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    t = kinds.add_parser("throughput", help="random-token prompts, all at once (nano-vllm's workload)",
                         formatter_class=DefaultsHelpFormatter)
    add_engine_args(t)
    _add_common(t)
    t.add_argument("--num-prompts", type=int, default=256, help="prompts in the workload")
    t.add_argument("--input-len", default="100:1024", help="prompt length, N or LOW:HIGH (inclusive)")
    t.add_argument("--output-len", default="100:1024", help="output length, N or LOW:HIGH (inclusive)")
    t.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of every prompt")
    t.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="time the same workload N times in this process (prefix cache emptied in between); the "
                        "first run leads the report, every run is listed")
    t.add_argument("--structured-output", choices=["json"], default=None,
                   help="run the workload unconstrained, then with every request constrained by a JSON schema "
                        "(needs a tokenizer: --tokenizer for a bundled config)")
    t.add_argument("--num-schemas", type=int, default=1, metavar="N",
                   help="with --structured-output: also run with N distinct schemas dealt to the requests")
    t.add_argument("--hf-num-prompts", type=int, default=32, help="prompts transformers runs (bounds its time)")
    t.add_argument("--hf-batch-size", type=int, default=32)
    t.set_defaults(func=_closing(_throughput))

    lat = kinds.add_parser("latency", help="TTFT and TPOT percentiles of one batch, stepping the engine",
                           formatter_class=DefaultsHelpFormatter)
    add_engine_args(lat)
    _add_common(lat)
    lat.add_argument("--batch-size", type=int, default=1, help="prompts in the batch")
    lat.add_argument("--input-len", type=int, default=32, help="prompt tokens of each")
    lat.add_argument("--output-len", type=int, default=256, help="tokens generated for each")
    lat.add_argument("--num-iters", type=int, default=5, help="timed batches, after one warm-up batch")
    lat.add_argument("--hf-num-iters", type=int, default=3, help="timed batches of transformers (--compare-hf)")
    lat.set_defaults(func=_closing(_latency))

    from ember.bench.serve import add_serve_parser
    add_serve_parser(kinds)
