"""N-gram speculative decoding at its real acceptance: the default model (the real SmolLM2-135M-Instruct) on chat
prompts that quote their input (rewrite, summarize, fix typos, extract fields, edit code: `quoting_prompts.py`),
greedy, against plain decoding in the same run.

One engine per setting, built one after another with the memory released between: plain decoding (the engine's
defaults, async scheduling on CUDA), then n-gram speculation for each k. Each runs the prompts at each batch size:
batch 1 sends them one request at a time, batch B in groups of B (all at once when B is the number of prompts).
Per setting and batch size: output tokens, wall time, output tok/s, steps and tokens per step; for speculation the
acceptance rate and mean acceptance length (`ember bench`'s own figures), the speed-up over plain decoding and
the prompts whose greedy tokens differ from plain decoding's at that batch size (there must be none: the exit
status is 1 if any). The prefix cache is emptied before each timed pass; speculation stays on at every batch size
asked (`disable_by_batch_size` is the largest). On an H100:

    PYTHONPATH=. python benches/spec_real.py --model /path/to/SmolLM2-135M-Instruct --json spec_real.json

Under tensor parallelism (every engine of the run on N GPUs, its all-reduces through NCCL), e.g. two H100s:

    PYTHONPATH=. python benches/spec_real.py --model /path/to/Llama-3.1-8B-Instruct --tensor-parallel-size 2 \
        --json spec_real_tp2.json

A smoke test on a CPU (float32):

    PYTHONPATH=. python benches/spec_real.py --device cpu --num-prompts 4 --max-tokens 24 --batch-sizes 1 4 -k 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benches.quoting_prompts import TASKS, conversations
from ember import LLM, SamplingParams
from ember.bench.commands import release_engine, spec_figures
from ember.bench.roofline import device_sync
from ember.chat_input import chat_prompt_ids


def chat_prompts(tokenizer, num_prompts: int) -> list[tuple[str, list[int]]]:
    """(task name, token ids) of the first `num_prompts` quoting prompts, rendered by the model's chat template."""
    return [(name, chat_prompt_ids(tokenizer, conv)) for name, conv in conversations(num_prompts)]


def mismatched(reference: dict[str, list[int]], outputs: dict[str, list[int]]) -> list[dict]:
    """The prompts whose tokens differ from the reference's: name, first differing position and both lengths."""
    out = []
    for name, ref in reference.items():
        got = outputs[name]
        if got != ref:
            first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
            out.append({"prompt": name, "first_diff": first, "reference_len": len(ref), "len": len(got)})
    return out


def timed_pass(llm, prompts: list[tuple[str, list[int]]], params: SamplingParams, batch: int) -> dict:
    """Generate `prompts` in groups of `batch` (one `generate` call each) from an empty prefix cache; the figures
    of the whole pass, the tokens by prompt and, at batch 1, each prompt's own figures."""
    llm.engine.kv.pool.reset_prefix_cache()
    stats, device = llm.engine.stats, llm.engine.runner.device

    def counters():
        return (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_verified_requests,
                stats.num_generated_tokens)

    tokens, per_prompt = {}, []
    steps_before, before = stats.num_steps, counters()
    device_sync(device)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        group_start, group_steps, group_before = time.perf_counter(), stats.num_steps, counters()
        outs = llm.generate([{"prompt_token_ids": ids} for _, ids in group], params, use_tqdm=False)
        tokens.update((name, list(o.outputs[0].token_ids)) for (name, _), o in zip(group, outs))
        if batch == 1:
            device_sync(device)
            name, ids = group[0]
            per_prompt.append({"prompt": name, "prompt_tokens": len(ids), "output_tokens": len(tokens[name]),
                               "elapsed_s": time.perf_counter() - group_start,
                               **spec_figures(stats, group_before, stats.num_steps - group_steps)})
    device_sync(device)
    elapsed = time.perf_counter() - start
    produced = sum(len(t) for t in tokens.values())
    row = {"batch": batch, "output_tokens": produced, "elapsed_s": elapsed, "output_tok_s": produced / elapsed,
           "num_steps": stats.num_steps - steps_before,
           **spec_figures(stats, before, stats.num_steps - steps_before)}
    return {"row": row, "tokens": tokens, "per_prompt": per_prompt}


def measure(llm, name: str, startup_s: float, prompts, params, batch_sizes: list[int],
            warmup_tokens: int) -> tuple[list[dict], dict[int, dict[str, list[int]]]]:
    """On one engine: a short warm-up pass at each batch size (the shapes of its steps), then a timed pass per
    batch size; the rows and the tokens by batch size. The engine is released before returning."""
    for b in batch_sizes:
        timed_pass(llm, prompts, SamplingParams(temperature=0.0, max_tokens=warmup_tokens), b)
    rows, tokens = [], {}
    for b in batch_sizes:
        result = timed_pass(llm, prompts, params, b)
        row = {"setting": name, "startup_s": startup_s, **result["row"]}
        if result["per_prompt"]:
            row["per_prompt"] = result["per_prompt"]
        rows.append(row)
        tokens[b] = result["tokens"]
    llm.shutdown()          # under tensor parallelism the workers stop here, before the next engine's start
    release_engine(llm)
    return rows, tokens


def started(model: str | None, **engine_kwargs):
    """(the engine, seconds it took to start)."""
    start = time.perf_counter()
    llm = LLM(model, **engine_kwargs)
    return llm, time.perf_counter() - start


def describe(row: dict) -> str:
    text = (f"{row['setting']:>10}  batch {row['batch']:>3}: {row['output_tokens']:>5} tokens in "
            f"{row['elapsed_s']:7.2f} s = {row['output_tok_s']:8.1f} tok/s, {row['tokens_per_step']:.2f} tokens/step")
    if "acceptance_rate" in row:
        text += (f", acceptance rate {row['acceptance_rate']:.3f}, mean acceptance length "
                 f"{row['mean_acceptance_length']:.2f}, speed-up {row['speedup']:.2f}x, "
                 f"{row['mismatches']} mismatched prompts")
    elif "speedup" in row:
        text += f", no proposals, speed-up {row['speedup']:.2f}x, {row['mismatches']} mismatched prompts"
    return text


def run(model: str | None, batch_sizes: list[int], ks: list[int], max_tokens: int, num_prompts: int,
        lookup_min: int, lookup_max: int, ignore_eos: bool = False, warmup_tokens: int = 16,
        **engine_kwargs) -> dict:
    """Plain decoding, then n-gram speculation for each k in `ks`, over the quoting prompts at each batch size;
    prints a line per setting and batch size and returns every figure, with `mismatches` the total count of
    prompts whose speculative tokens differ from plain decoding's."""
    if any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes {batch_sizes} must be at least 1")
    # a batch larger than the prompts is all of them at once
    batch_sizes = sorted({min(b, num_prompts) for b in batch_sizes})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    engine_kwargs["max_num_seqs"] = max(max(batch_sizes), 8)
    llm, startup_s = started(model, **engine_kwargs)
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError(f"model {model!r} has no tokenizer with a chat template; the prompts are chat prompts")
    prompts = chat_prompts(llm.tokenizer, num_prompts)
    rows, plain_tokens = measure(llm, "plain", startup_s, prompts, params, batch_sizes, warmup_tokens)
    del llm
    for row in rows:
        print(describe(row), flush=True)
    plain_rate = {row["batch"]: row["output_tok_s"] for row in rows}
    total_mismatches = 0
    for k in ks:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup_min,
                "prompt_lookup_max": lookup_max, "disable_by_batch_size": max(batch_sizes)}
        llm, startup_s = started(model, speculative_config=spec, **engine_kwargs)
        spec_rows, spec_tokens = measure(llm, f"ngram k={k}", startup_s, prompts, params, batch_sizes,
                                         warmup_tokens)
        del llm
        for row in spec_rows:
            b = row["batch"]
            row["mismatched_prompts"] = mismatched(plain_tokens[b], spec_tokens[b])
            row.update(k=k, speedup=row["output_tok_s"] / plain_rate[b],
                       mismatches=len(row["mismatched_prompts"]))
            total_mismatches += row["mismatches"]
            print(describe(row), flush=True)
        rows += spec_rows
    if 1 in batch_sizes:
        # which tasks pay: each prompt's mean acceptance length at batch 1, per k
        for row in rows:
            if row["batch"] == 1 and "acceptance_rate" in row:
                print(f"{row['setting']} batch 1, mean acceptance length by prompt: " + ", ".join(
                    f"{p['prompt']} {p.get('mean_acceptance_length', 1.0):.2f}" for p in row["per_prompt"]))
    print(f"mismatched prompts, all settings: {total_mismatches}", flush=True)
    device = engine_kwargs.get("device", "auto")
    return {"model": model or "default", "date": time.strftime("%Y-%m-%d"),
            "device_name": torch.cuda.get_device_name() if str(device).startswith("cuda") else str(device),
            "engine": {k: str(v) for k, v in engine_kwargs.items()},
            "max_tokens": max_tokens, "ignore_eos": ignore_eos, "prompt_lookup": [lookup_min, lookup_max],
            "prompts": [{"prompt": name, "prompt_tokens": len(ids)} for name, ids in prompts],
            "rows": rows, "mismatches": total_mismatches}


def tensor_parallel(size: int) -> dict:
    """The engine settings for `size` ranks: every engine of the run all-reduces through NCCL, since this process
    keeps the symmetric-memory set-up of the first engine's group, which the later engines' groups cannot take
    (`docs/distributed.md`), and plain decoding and speculation must run the same all-reduce."""
    return {} if size == 1 else {"tensor_parallel_size": size, "symm_mem_all_reduce": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder (default: ember's default model)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, len(TASKS)])
    ap.add_argument("-k", "--num-speculative-tokens", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--prompt-lookup-min", type=int, default=1)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=len(TASKS), help=f"the first N of the {len(TASKS)} prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true", help="generate max_tokens whatever the model says")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="default: bfloat16 on CUDA, float32 on a CPU")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks, one GPU each (every setting)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every figure here")
    args = ap.parse_args()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    report = run(args.model, args.batch_sizes, args.num_speculative_tokens, args.max_tokens, args.num_prompts,
                 args.prompt_lookup_min, args.prompt_lookup_max, args.ignore_eos, device=device, dtype=dtype,
                 **tensor_parallel(args.tensor_parallel_size))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if report["mismatches"]:
        print(f"{report['mismatches']} speculative outputs differ from plain decoding's greedy tokens",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
