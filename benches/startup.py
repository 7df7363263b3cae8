"""Start-up of `LLM(...)` in a fresh process, from the call to ready, split into load / compile / capture / rest.

    python benches/startup.py --model qwen3-0.6b --label cold [--tensor-parallel-size N] [--cudagraph-capture lazy]
        [--replay-table [--replay-context N]] [--step-times]
        [--tokens-out FILE] [--tokens-ref FILE] [--profile N | --sample N]

Cold or warm is the caller's choice: point EMBER_CACHE and TRITON_CACHE_DIR at empty or at filled folders. The
script then runs a greedy workload twice (first run vs second run in this process; each run has prompts of its
own, of the same lengths, so the prefix cache cannot favour the second; `--lengths-seeds` sets the runs and the
seeds of their lengths), counts each run's device allocations (cudaMalloc, cudaFree, retries), optionally times
the replay of every captured FULL graph (the step time per bucket, for choosing capture sizes;
`--replay-context N` gives each replayed request N tokens of context), and prints one JSON line. `--profile N` runs
`LLM(...)` under cProfile and prints its N costliest functions (cumulative and own time, then ember's own);
`--sample N` samples its stack instead (no slow-down) and prints the N most-seen, then does the same for each run
(every 5 ms). The Triton compilations of start-up are printed per kernel, and those inside each run counted.
`--step-times` splits each run's time between its steps with a prefill and its uniform decodes, counts Python's
full garbage collections, and pairs the first two runs step by step (`step_pairs`: where the first took longer).
`--tokens-ref` compares the greedy tokens with those another run wrote through `--tokens-out`.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

from stack_sampler import StackSampler


def replay_table(runner, context_len: int = 0) -> list[dict]:
    """Mean replay time of each captured FULL graph over 20 replays (after 3 warm-up replays), on a step of the
    graph's shape whose requests have `context_len` tokens of context each (the null block's)."""
    import torch
    wrapper = runner.forward_fn
    rows = []
    for desc, entry in sorted(getattr(wrapper, "entries", {}).items(), key=lambda de: (de[0].uniform_decode,
                                                                                       de[0].num_tokens)):
        # a step of the graph's own shape fills the input buffers first: a graph replayed on another step's
        # buffers reads rows and lengths that step left (a short-context graph, longer requests than its bound)
        with torch.inference_mode():
            runner._dummy_forward(desc.num_tokens, desc.num_reqs if desc.uniform_decode else 1,
                                  wrapper.runtime_mode, desc, context_len=context_len)
        for _ in range(3):
            entry.graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            entry.graph.replay()
        end.record()
        end.synchronize()
        rows.append({"tokens": desc.num_tokens, "decode": desc.uniform_decode, "max_seq_len": desc.max_seq_len,
                     "ms": start.elapsed_time(end) / 20})
    return rows


_SPENT_ZERO = {"add_s": 0.0, "schedule_s": 0.0, "first_schedule_s": None, "gc_full": 0, "gc_full_s": 0.0}


def _time_steps(engine) -> tuple[list, dict]:
    """Record (launch time, tokens, requests, uniform decode) of each step the runner launches from now on, the
    seconds spent adding requests and scheduling (the first schedule apart), and the full (oldest-generation)
    collections of Python's cycle collector, which scan the whole heap."""
    launched, spent = [], dict(_SPENT_ZERO)
    runner, scheduler = engine.runner, engine.scheduler
    execute_async, schedule, add_request = runner.execute_async, scheduler.schedule, engine.add_request

    def timed(step):
        launched.append((time.perf_counter(), step.total_num_tokens, step.num_reqs, step.num_decodes == step.num_reqs))
        return execute_async(step)

    def timed_schedule():
        start = time.perf_counter()
        out = schedule()
        took = time.perf_counter() - start
        spent["schedule_s"] += took
        if spent["first_schedule_s"] is None:
            spent["first_schedule_s"] = took
        return out

    def timed_add(*args, **kwargs):
        start = time.perf_counter()
        try:
            return add_request(*args, **kwargs)
        finally:
            spent["add_s"] += time.perf_counter() - start
    runner.execute_async, scheduler.schedule, engine.add_request = timed, timed_schedule, timed_add

    def full_collections(phase, info):   # Python's cycle collector over the oldest generation: the whole heap
        if info["generation"] != 2:
            return
        if phase == "start":
            spent["_gc_start"] = time.perf_counter()
        elif "_gc_start" in spent:
            spent["gc_full"] += 1
            spent["gc_full_s"] += time.perf_counter() - spent.pop("_gc_start")
    gc.callbacks.append(full_collections)
    return launched, spent


def _pair_steps(first: list, second: list, top: int = 8) -> dict:
    """The first two runs side by side, step by step (their prompts have the same lengths, so the scheduler makes the
    same steps): the intervals from each launch to the next summed over the steps where the first run took longer
    and over those where it took less, and the `top` steps it took longest against the second (ms: index, first,
    second, tokens, requests, uniform decode); only `same_steps` False and the step counts when the runs differ."""
    shape = [step[1:] for step in first]
    if shape != [step[1:] for step in second]:
        return {"same_steps": False, "steps": [len(first), len(second)]}
    gaps = [(i, b1[0] - a1[0], b2[0] - a2[0], *a1[1:])
            for i, (a1, b1, a2, b2) in enumerate(zip(first, first[1:], second, second[1:]))]
    slower = sum(g1 - g2 for _, g1, g2, *_ in gaps if g1 > g2)
    faster = sum(g2 - g1 for _, g1, g2, *_ in gaps if g1 <= g2)
    worst = sorted(gaps, key=lambda g: g[2] - g[1])[:top]
    return {"same_steps": True, "steps": len(first), "first_slower_s": round(slower, 4),
            "first_faster_s": round(faster, 4),
            "top": [(i, round(g1 * 1e3, 2), round(g2 * 1e3, 2), *rest) for i, g1, g2, *rest in worst]}


def _step_summary(launched: list) -> dict:
    """Seconds and count of the intervals from each launch to the next, for steps with a prefill and for uniform
    decodes, and the five longest intervals (ms, tokens, requests, uniform decode)."""
    gaps = [(b[0] - a[0], *a[1:]) for a, b in zip(launched, launched[1:])]
    out = {}
    for kind, uniform in (("prefill", False), ("decode", True)):
        sel = [g for g in gaps if g[3] == uniform]
        out[kind] = {"steps": len(sel), "s": round(sum(g[0] for g in sel), 4)}
    out["longest"] = [(round(g[0] * 1e3, 2), *g[1:]) for g in sorted(gaps, key=lambda g: -g[0])[:5]]
    return out


def _allocator_counts() -> dict:
    """The CUDA caching allocator's device allocations and frees (cudaMalloc / cudaFree) and its retries after a
    failed allocation (each frees the cached blocks first), so far in this process."""
    import torch
    stats = torch.cuda.memory_stats()
    return {"cuda_malloc": stats.get("num_device_alloc", 0), "cuda_free": stats.get("num_device_free", 0),
            "retries": stats.get("num_alloc_retries", 0)}


def _print_profile(profiler, n: int) -> None:
    import io
    import pstats
    for order, only in (("cumulative", ()), ("tottime", ()), ("cumulative", ("/ember/",))):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(*only, n)
        print(f"PROFILE by {order} {' '.join(only)}\n" + text.getvalue(), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--label", default="run")
    parser.add_argument("--cudagraph-capture", default=None, choices=["eager", "lazy"])
    parser.add_argument("--replay-table", action="store_true")
    parser.add_argument("--replay-context", type=int, default=0, metavar="N",
                        help="each request of a replayed step has N tokens of context (default 0)")
    parser.add_argument("--triton-compile-workers", type=int, default=None, metavar="N",
                        help="processes compiling the start-up's Triton kernels (0: each at its first launch)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="start N ranks, one a GPU (the time to ready counts every rank's start-up)")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--lengths-seeds", type=int, nargs="+", default=[0, 0], metavar="SEED",
                        help="one run per seed; a seed draws the prompt lengths (default 0 0: two runs of the same "
                             "lengths; 0 0 1 adds a run whose step sizes the process has not seen)")
    parser.add_argument("--tokens-out", default=None)
    parser.add_argument("--tokens-ref", default=None)
    parser.add_argument("--step-times", action="store_true",
                        help="per run: the time between launches of prefill and of decode steps, and the slowest")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--sample", type=int, default=0, metavar="N",
                        help="sample the stack every 20 ms during LLM(...) (and 5 ms in each run) and print the N "
                             "most-seen functions")
    args = parser.parse_args()

    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("torch").setLevel(logging.WARNING)
    t0 = time.perf_counter()
    import torch
    from ember import LLM, SamplingParams
    import_s = time.perf_counter() - t0
    if args.replay_table and args.tensor_parallel_size > 1:
        parser.error("--replay-table replays rank 0's graphs alone; it runs with --tensor-parallel-size 1 only")
    kwargs = {"load_format": "dummy", "tensor_parallel_size": args.tensor_parallel_size}
    if args.cudagraph_capture is not None:
        kwargs["cudagraph_capture"] = args.cudagraph_capture
    if args.triton_compile_workers is not None:
        kwargs["triton_compile_workers"] = args.triton_compile_workers
    from ember.kernels.jit_counter import TritonCompileCounter
    counter = TritonCompileCounter().install()
    profiler = None
    if args.profile:
        import cProfile
        profiler = cProfile.Profile()
    sampler = None
    if args.sample:
        sampler = StackSampler(0.02).__enter__()
    t1 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    llm = LLM(args.model, **kwargs)
    torch.cuda.synchronize()
    total_s = time.perf_counter() - t1
    if profiler is not None:
        profiler.disable()
        _print_profile(profiler, args.profile)
    if sampler is not None:
        sampler.__exit__(None, None, None)
        print(sampler.report(args.sample), flush=True)
    print("TRITON_COMPILES", counter.total, json.dumps(counter.kernels.most_common()), flush=True)
    runner = llm.engine.runner
    times, stats = runner.times, getattr(runner, "compile_stats", None)
    result = {"label": args.label, "import_s": round(import_s, 2), "total_s": round(total_s, 2),
              "load_s": round(times.load_s, 2), "compile_s": round(times.compile_s, 2),
              "capture_s": round(times.capture_s, 2), "warmup_s": round(times.warmup_s, 2),
              "precompile_s": round(times.precompile_s, 2),
              "rest_s": round(total_s - times.load_s - times.compile_s - times.capture_s, 2),
              "graph_mib": round(times.graph_memory_bytes / 2**20, 1),
              "descriptors": len(runner.dispatcher.capture_list())}
    if stats is not None:
        result.update({k: getattr(stats, k) for k in ("num_pieces", "num_distinct", "artifacts_loaded",
                                                      "artifacts_saved", "backend_seconds", "traced_layers")
                       if hasattr(stats, k)})
        result["cache_counters"] = stats.cache_counters

    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    runs, tokens = [], None
    steps, spent = _time_steps(llm.engine) if args.step_times else (None, None)
    run_steps: list[list] = []     # each run's launches, for pairing the runs step by step
    for run, lengths_seed in enumerate(args.lengths_seeds):
        # each run its own prompts (same lengths), so the second finds nothing of the first in the prefix cache
        rng, lengths = random.Random(run), random.Random(lengths_seed)
        prompts = [[rng.randrange(1000, 20000) for _ in range(lengths.randint(16, 512))]
                   for _ in range(args.num_prompts)]
        compiles = counter.total
        allocs = _allocator_counts()
        run_sampler = StackSampler(0.005).__enter__() if args.sample else None
        t2 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(time.perf_counter() - t2)
        if run_sampler is not None:
            run_sampler.__exit__(None, None, None)
            print(f"RUN {run + 1} " + run_sampler.report(args.sample), flush=True)
        result[f"run{run + 1}_triton_compiles"] = counter.total - compiles
        result[f"run{run + 1}_allocator"] = {k: v - allocs[k] for k, v in _allocator_counts().items()}
        if steps is not None:
            summary = _step_summary(steps)
            if steps:
                summary["before_first_s"] = round(steps[0][0] - t2, 4)
                summary["after_last_s"] = round(t2 + runs[-1] - steps[-1][0], 4)
            summary.update({k: round(v, 4) for k, v in spent.items() if v is not None and not k.startswith("_")})
            result[f"run{run + 1}_steps"] = summary
            run_steps.append(list(steps))
            steps.clear()
            spent.update(_SPENT_ZERO)
        if tokens is None:
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
    if len(run_steps) >= 2:
        result["step_pairs"] = _pair_steps(run_steps[0], run_steps[1])
    num_out = sum(len(t) for t in tokens)
    for run, seconds in enumerate(runs):    # tokens out per run: every run makes max_tokens per prompt
        result[f"run{run + 1}_s"], result[f"run{run + 1}_tok_s"] = round(seconds, 3), round(num_out / seconds)
    if args.tokens_out:
        with open(args.tokens_out, "w") as f:
            json.dump(tokens, f)
    if args.tokens_ref:
        with open(args.tokens_ref) as f:
            ref = json.load(f)
        result["tokens_equal_ref"] = ref == tokens
        result["rows_differing"] = sum(a != b for a, b in zip(ref, tokens))
    if args.replay_table:
        result["replay"] = replay_table(runner, args.replay_context)
    print("STARTUP " + json.dumps(result), flush=True)
    t_stop = time.perf_counter()
    llm.shutdown()          # the workers (tensor parallel) end here, not in the interpreter's exit
    print(f"SHUTDOWN {time.perf_counter() - t_stop:.2f} s", flush=True)


if __name__ == "__main__":
    main()
