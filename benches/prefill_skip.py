"""Prefill time of a model whose last half of layers read an earlier layer's KV cache (`num_kv_shared_layers`),
with the prefill skip on (those layers run on each request's last token only) and off (every token), in one
engine: random weights of a bundled config, eager mode (the skip's mode), prefix caching off.

    PYTHONPATH=. python benches/prefill_skip.py --config llama-3.2-1b --prompt-len 8000 --runs 3
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from ember import LLM, SamplingParams
from ember.bench.roofline import device_sync

CONFIGS = Path(__file__).resolve().parents[1] / "ember" / "configs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama-3.2-1b")
    p.add_argument("--prompt-len", type=int, default=8000)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    config = json.loads((CONFIGS / f"{args.config}.json").read_text())
    config["num_kv_shared_layers"] = config["num_hidden_layers"] // 2
    folder = Path(tempfile.mkdtemp()) / args.config
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    budget = args.prompt_len + 64
    llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=budget, max_num_batched_tokens=budget, max_num_seqs=8)
    runner = llm.engine.runner
    assert runner.skip_prefill, "the runner does not skip the sharing layers' prefill"
    prompt = [(i * 7919) % 30000 + 1 for i in range(args.prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times = {}
    for skip in (True, False, True, False):   # interleaved, each after a warm-up run
        runner.skip_prefill = skip
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        runs = []
        for _ in range(args.runs):
            device_sync(runner.device)
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            device_sync(runner.device)
            runs.append((time.perf_counter() - start) * 1e3)
        times.setdefault(skip, []).extend(runs)
    on, off = min(times[True]), min(times[False])
    print(f"{args.config}, {config['num_kv_shared_layers']} of {config['num_hidden_layers']} layers sharing, "
          f"{args.prompt_len}-token prompt: prefill with skip {on:.1f} ms, without {off:.1f} ms "
          f"({100 * (1 - on / off):.1f}% less); every run: on {[round(t, 1) for t in times[True]]}, "
          f"off {[round(t, 1) for t in times[False]]}")


if __name__ == "__main__":
    main()
