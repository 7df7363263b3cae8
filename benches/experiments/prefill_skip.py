"""Prefill time of a model whose last half of layers read an earlier layer's KV cache (`num_kv_shared_layers`),
with the prefill skip on (those layers run on each request's last token only) and off (every token): random
weights of a bundled config, prefix caching off.

    PYTHONPATH=. python benches/experiments/prefill_skip.py --config llama-3.2-1b --prompt-len 8000 --runs 3 \
        [--mode compiled]

`--mode eager` (default) switches the skip on and off in one engine, in interleaved rounds. `--mode compiled`
builds two engines in turn, torch.compile with CUDA graphs (the default modes): one with the skip, and one whose
model has no skipping tail (`prefill_skip_start` patched to None, so the same layers run on every token, as a
model without the skip would). A prompt of this length runs past the graph buckets, on the compiled pieces.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from ember import LLM, SamplingParams
from ember.bench.roofline import device_sync

CONFIGS = Path(__file__).resolve().parents[1] / "ember" / "configs"


def _timed_prefills(llm, prompt: list[int], runs: int) -> list[float]:
    """One warm-up prefill, then `runs` timed ones (ms), each a fresh request of one output token."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    device = llm.engine.runner.device
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    out = []
    for _ in range(runs):
        device_sync(device)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        device_sync(device)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama-3.2-1b")
    p.add_argument("--prompt-len", type=int, default=8000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--mode", choices=["eager", "compiled"], default="eager")
    args = p.parse_args()
    config = json.loads((CONFIGS / f"{args.config}.json").read_text())
    config["num_kv_shared_layers"] = config["num_hidden_layers"] // 2
    folder = Path(tempfile.mkdtemp()) / args.config
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    budget = args.prompt_len + 64
    kwargs = dict(load_format="dummy", dtype="bfloat16", enable_prefix_caching=False, max_model_len=budget,
                  max_num_batched_tokens=budget, max_num_seqs=8, gpu_memory_utilization=0.4)
    prompt = [(i * 7919) % 30000 + 1 for i in range(args.prompt_len)]
    times: dict[bool, list[float]] = {}
    if args.mode == "eager":
        llm = LLM(str(folder), enforce_eager=True, **kwargs)
        runner = llm.engine.runner
        assert runner.skip_prefill, "the runner does not skip the sharing layers' prefill"
        for skip in (True, False, True, False):   # interleaved, each after a warm-up run
            runner.skip_prefill = skip
            times.setdefault(skip, []).extend(_timed_prefills(llm, prompt, args.runs))
    else:
        for skip in (True, False):
            no_tail = mock.patch("ember.models.llama.prefill_skip_start", return_value=None)
            with contextlib.nullcontext() if skip else no_tail:
                llm = LLM(str(folder), **kwargs)
            assert llm.engine.runner.skip_prefill == skip
            times[skip] = _timed_prefills(llm, prompt, args.runs)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    on, off = min(times[True]), min(times[False])
    print(f"{args.config} ({args.mode}), {config['num_kv_shared_layers']} of {config['num_hidden_layers']} layers "
          f"sharing, {args.prompt_len}-token prompt: prefill with skip {on:.1f} ms, without {off:.1f} ms "
          f"({100 * (1 - on / off):.1f}% less); every run: on {[round(t, 1) for t in times[True]]}, "
          f"off {[round(t, 1) for t in times[False]]}")


if __name__ == "__main__":
    main()
